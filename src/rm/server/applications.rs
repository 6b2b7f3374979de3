//! Application endpoints: new-application, submit, list, report, attempts and kill. What
//! they change in the state is a transaction of `transactions`; the job file and the AM
//! launch are done here, and so is the submit's spec check: off the async workers, at most
//! [`SPEC_CHECKS`] at a time and one per user, 429 when none is free within
//! [`SPEC_CHECK_WAIT`].

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use axum::extract::{Path as UrlPath, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::am_supervisor::{launch_am, LaunchError, AM_KILL_GRACE};
use super::containers::spawn_stops;
use super::http::{app_ref, authenticate, bearer, check_app_id, unknown_to, with_app, ApiError, ApiJson, Caller};
use super::{transactions, Rm, Shared};
use crate::protocol::{AppState, AppStateUpdate, NewApplication, SubmitApplication};
use crate::rm::apps::{AmLaunch, App};
use crate::spec::JobSpec;

/// How many submitted job specs the RM parses and validates at once. A spec is at most
/// 1 MiB and renders to at most `spec::openpai::MAX_RENDERED_BYTES`, but each check is
/// CPU and memory: unbounded, a few users submitting in loops starved the async workers
/// (node heartbeats failed, a host was marked LOST) and grew the RM by gigabytes.
pub(super) const SPEC_CHECKS: usize = 2;
/// How long a submit waits for a free spec check before it is told to retry (429).
const SPEC_CHECK_WAIT: Duration = Duration::from_secs(2);
/// The `Retry-After` of that 429, seconds.
const SPEC_CHECK_RETRY_AFTER: u64 = 1;

/// Parses and validates a submitted job spec on a blocking thread, holding one of
/// `checks`' permits for as long as it runs (the permit goes with the thread, so a caller
/// that hangs up does not free it early). 429 with `Retry-After` when no permit is free
/// within `wait`; 400 `INVALID_JOB_SPEC` with every diagnostic for a spec that is refused;
/// 500 if the check itself failed (a panic in the parser), never a panic here. The text
/// comes back with the spec (it is written as the job file).
async fn check_spec(
    checks: &super::fair::FairPermits,
    who: &str,
    wait: Duration,
    text: String,
    source: String,
) -> Result<(JobSpec, String), ApiError> {
    let permit = match checks.acquire(who, wait).await {
        Some(p) => p,
        None => {
            return Err(ApiError {
                retry_after: Some(SPEC_CHECK_RETRY_AFTER),
                ..ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "BUSY",
                    format!(
                        "the RM is checking as many job specs as it takes at once ({}, one per user), or one of \
                         yours; nothing was submitted: submit again in a second",
                        SPEC_CHECKS
                    ),
                )
            });
        }
    };
    let checked = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let spec = crate::spec::parse_job_spec(&text, &source);
        (spec, text)
    })
    .await;
    match checked {
        Ok((Ok(spec), text)) => Ok((spec, text)),
        Ok((Err(errs), _)) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "INVALID_JOB_SPEC",
            errs.to_string(),
        )),
        Err(e) => {
            tracing::error!(error = %e, "the job spec check failed");
            Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "SPEC_CHECK_FAILED",
                "the RM could not check the job spec (an internal error, logged on the RM); nothing was submitted",
            ))
        }
    }
}

pub(super) async fn new_application(State(rm): Rm, caller: Caller) -> Result<Json<NewApplication>, ApiError> {
    let mut st = rm.lock();
    let id = transactions::new_application(&mut st, caller.name())?;
    tracing::debug!(app = %id, user = caller.name(), "application id handed out");
    Ok(Json(NewApplication {
        application_id: id,
        maximum_resource_capability: st.ledger.max_capability(),
    }))
}

/// The caller's applications (the admin's: every application).
pub(super) async fn list_apps(State(rm): Rm, caller: Caller) -> Json<Value> {
    let st = rm.lock();
    let apps: Vec<_> = st
        .apps
        .values()
        .filter(|a| caller.owns(a))
        .map(|a| a.report.clone())
        .collect();
    Json(json!({ "apps": { "app": apps } }))
}

pub(super) async fn get_app(
    State(rm): Rm,
    caller: Caller,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    with_app(&rm, &id, &caller, |a| Json(json!({ "app": a.report })))
}

pub(super) async fn get_app_state(
    State(rm): Rm,
    caller: Caller,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    with_app(&rm, &id, &caller, |a| Json(json!({ "state": a.report.state })))
}

/// YARN's `appattempts`: every AM attempt with its start, end and how it ended.
pub(super) async fn get_app_attempts(
    State(rm): Rm,
    caller: Caller,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    with_app(&rm, &id, &caller, |a| {
        let attempts: Vec<Value> = a
            .attempts
            .iter()
            .map(|t| {
                json!({
                    "id": t.attempt,
                    "startTime": t.started_time,
                    "finishedTime": t.finished_time,
                    "diagnostics": t.diagnostics,
                    "pid": t.process.map(|p| p.pid),
                })
            })
            .collect();
        Json(json!({ "appAttempts": { "appAttempt": attempts } }))
    })
}

/// A job's `dashboardListen`: an address, on loopback unless the operator allows others; a
/// port a user names must be one of `rm.dashboard_ports` (seventh pass, F2: the AM binds as
/// the RM's user on the RM's host, so a user naming a port could take an agent's, the
/// RM's or a task's while its owner restarts, and keep it for as long as the job runs).
fn check_dashboard_listen(rm: &Shared, caller: &Caller, listen: Option<&str>) -> Result<Option<String>, ApiError> {
    let Some(text) = listen else {
        return Ok(None);
    };
    let addr: SocketAddr = text.trim().parse().map_err(|_| {
        ApiError::bad_request(format!(
            "`dashboardListen`: `{}` is not an address (IP:PORT, e.g. 127.0.0.1:0)",
            crate::spec::yaml::clip(text)
        ))
    })?;
    // The AM runs as the RM's user: a user's port below 1024 would have it bind one that
    // only the machine's services may (a port of 0 lets the system choose).
    if (1..1024).contains(&addr.port()) {
        return Err(ApiError::bad_request(format!(
            "`dashboardListen` {addr}: port {} is privileged; use port 0 (any free port) or one from 1024 up",
            addr.port()
        )));
    }
    if !addr.ip().is_loopback() && !rm.limits.allow_public_dashboards {
        return Err(ApiError::forbidden(format!(
            "`dashboardListen` {addr} is not a loopback address: a job's dashboard listens on loopback unless the \
             RM's operator sets `rm.allow_public_dashboards: true`"
        )));
    }
    if addr.port() != 0 && !caller.is_admin() && !rm.limits.dashboard_ports.contains(addr.port()) {
        return Err(ApiError::forbidden(format!(
            "`dashboardListen` {addr}: a user's job does not choose its dashboard's port; use port 0 (any free \
             port: the URL is printed and shown by `gpuam status`), or ask the RM's operator for a range \
             (`rm.dashboard_ports`)"
        )));
    }
    // As parsed, so the AM is started with exactly the address checked (eighth pass: a
    // trailing space passed the check and failed every AM attempt).
    Ok(Some(addr.to_string()))
}

pub(super) async fn submit_app(
    State(rm): Rm,
    caller: Caller,
    ApiJson(req): ApiJson<SubmitApplication>,
) -> Result<Response, ApiError> {
    let id = req.application_id.clone();
    check_app_id(&id)?;
    let listen = check_dashboard_listen(&rm, &caller, req.dashboard_listen.as_deref())?;
    // Validate before claiming anything, so a rejected submit leaves nothing behind.
    transactions::check_submit(&mut rm.lock(), &rm.limits, &id, caller.name())?;
    let source = req.job_spec_name.clone().unwrap_or_else(|| "job.yaml".into());
    // Off the async workers and bounded: the check of a spec costs CPU and memory.
    let (spec, job_text) = check_spec(&rm.spec_checks, caller.name(), SPEC_CHECK_WAIT, req.job_spec, source).await?;
    let queue = admit_to_queue(&rm, spec.queue.as_deref(), caller.name())?;

    // Claim the id (a concurrent submit of the same id loses here).
    transactions::claim_id(&mut rm.lock(), &id)?;
    let unclaim = |rm: &Shared, dir: &Path| {
        let _ = std::fs::remove_dir_all(dir);
        transactions::unclaim_id(&mut rm.lock(), &id, caller.name());
    };
    let dir = rm.work_dir.join(&id);
    let job_path = dir.join("job.yaml");
    // 0600: an OpenPAI job spec may carry `secrets`.
    let written = super::private::dir(&dir, &[]).and_then(|()| super::private::write(&job_path, job_text.as_bytes()));
    if let Err(e) = written {
        unclaim(&rm, &dir);
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "IO_ERROR",
            format!("cannot write {}: {e}", job_path.display()),
        ));
    }
    let mut app = App::new(id.clone(), spec.name.clone());
    app.report.user = caller.name().to_string();
    app.report.queue = queue;
    app.report.priority = spec.priority;
    app.gang = spec.gang;
    app.set_job_token(req.job_token.as_deref());
    if rm.launch_am {
        app.launch = Some(AmLaunch { job_path, listen });
    }
    let report = app.report.clone();
    let added = transactions::add_app(&mut rm.lock(), &rm.limits, app);
    if let Err(e) = added {
        unclaim(&rm, &dir);
        return Err(e);
    }

    if rm.launch_am {
        if let Err(e) = launch_am(&rm, &id) {
            // The application goes with its id.
            unclaim(&rm, &dir);
            return Err(match e {
                LaunchError::Store(e) => ApiError::store_unavailable(&e),
                LaunchError::Io(e) => ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "AM_LAUNCH_FAILED",
                    format!("could not launch the AM: {e}"),
                ),
            });
        }
    }
    tracing::info!(app = %id, name = %spec.name, user = caller.name(), "application accepted");
    let location = format!("/ws/v1/cluster/apps/{id}");
    Ok((
        StatusCode::ACCEPTED,
        [(header::LOCATION, location)],
        Json(json!({ "app": report })),
    )
        .into_response())
}

/// The queue a job names (`default` when none), if `user` may submit to it: its full name.
/// 400 for a queue the RM does not have, 403 naming the queue's users for one the user may
/// not use.
fn admit_to_queue(rm: &Shared, queue: Option<&str>, user: &str) -> Result<String, ApiError> {
    let st = rm.lock();
    let q = st.sched.tree.admit(queue, user).map_err(queue_refused)?;
    Ok(st.sched.tree.get(q).path.clone())
}

/// A queue's refusal as the API answers it: 400 for a queue the RM does not have, 403
/// naming the queue's users.
pub(super) fn queue_refused(e: crate::rm::scheduler::queues::QueueRefusal) -> ApiError {
    use crate::rm::scheduler::queues::QueueRefusal;
    match e {
        QueueRefusal::Unknown(m) => ApiError::new(StatusCode::BAD_REQUEST, "UNKNOWN_QUEUE", m),
        QueueRefusal::NotAllowed(m) => ApiError::new(StatusCode::FORBIDDEN, "QUEUE_FORBIDDEN", m),
    }
}

/// Kill: its owner, the admin, or the job token given when the job was submitted (the
/// dashboard's kill button); never the AM's application token (that one only speaks the AM
/// protocol).
pub(super) async fn put_app_state(
    State(rm): Rm,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<AppStateUpdate>,
) -> Result<Json<Value>, ApiError> {
    let caller = authenticate(&rm, &headers);
    let (ended, committed) = {
        let mut st = rm.lock();
        let unauthorized = |e: &ApiError| {
            let why = "killing an application needs its owner's token, the admin token or its job token";
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "UNAUTHORIZED",
                format!("{why}. {}", e.message),
            )
        };
        let app = app_ref(&st.apps, &id).map_err(|missing| unknown_to(&caller, missing, unauthorized))?;
        let job_token_ok = bearer(&headers).is_some_and(|t| app.job_token_matches(t));
        if !job_token_ok {
            match &caller {
                Ok(c) => c.must_own(app)?,
                Err(e) => return Err(unauthorized(e)),
            }
        }
        if req.state != AppState::Killed {
            return Err(ApiError::bad_request("Only 'KILLED' is allowed as the target state"));
        }
        if app.report.state.is_final() {
            return Ok(Json(json!({ "state": app.report.state })));
        }
        let who = caller.as_ref().map_or("its job token", |c| c.name()).to_string();
        let done = transactions::kill_app(&mut st, &id, &who)?;
        (done.ended, done.committed)
    };
    // What memory now says is ended is stopped either way (its processes must not outlive
    // it); the answer waits for the store.
    if committed.is_err() {
        spawn_stops(&rm, ended);
        return committed.map(|()| Json(Value::Null));
    }
    tracing::info!(app = %id, "application killed");
    spawn_stops(&rm, ended);
    // The AM sees SHUTDOWN on its next heartbeat; kill it if it does not exit.
    let rm2 = rm.clone();
    let app = id.clone();
    tokio::spawn(async move {
        tokio::time::sleep(AM_KILL_GRACE).await;
        let proc = rm2.am_procs.lock().get_mut(&app).and_then(|p| p.kill.take());
        if let Some(kill) = proc {
            tracing::warn!(app = %app, "AM did not exit after kill; killing it");
            let _ = kill.send(());
        }
    });
    Ok(Json(json!({ "state": AppState::Killed })))
}

#[cfg(test)]
mod spec_check_tests {
    //! The submit's spec check: 429 when no permit is free (a semaphore with none: no
    //! timing involved), 400 for a refused spec, the permit given back after a check.

    use super::*;

    const SPEC: &str =
        "name: job\ntaskRoles:\n  w:\n    resourcePerInstance: {cpu: 1, memoryMB: 1}\n    commands: [\"echo hi\"]\n";

    #[tokio::test]
    async fn no_free_permit_is_429_with_retry_after() {
        // No permit at all: the wait can only run out, whatever the machine's load.
        let checks = super::super::fair::FairPermits::new(0, 1);
        let e = check_spec(&checks, "alice", Duration::ZERO, SPEC.into(), "job.yaml".into())
            .await
            .expect_err("a busy RM refuses");
        assert_eq!((e.status, e.code), (StatusCode::TOO_MANY_REQUESTS, "BUSY"));
        assert!(e.message.contains("submit again"), "{}", e.message);
        let r = e.into_response();
        assert_eq!(
            r.headers().get(header::RETRY_AFTER).map(|v| v.as_bytes()),
            Some(SPEC_CHECK_RETRY_AFTER.to_string().as_bytes())
        );
    }

    #[tokio::test]
    async fn a_free_permit_checks_the_spec_and_is_given_back() {
        let checks = super::super::fair::FairPermits::new(1, 1);
        let (spec, text) = check_spec(
            &checks,
            "alice",
            Duration::from_secs(60),
            SPEC.into(),
            "job.yaml".into(),
        )
        .await
        .expect("a valid spec");
        assert_eq!((spec.name.as_str(), text.as_str()), ("job", SPEC));
        assert_eq!(checks.available(), 1);
        let e = check_spec(
            &checks,
            "alice",
            Duration::from_secs(60),
            SPEC.replace("commands", "comands"),
            "job.yaml".into(),
        )
        .await
        .expect_err("an invalid spec");
        assert_eq!((e.status, e.code), (StatusCode::BAD_REQUEST, "INVALID_JOB_SPEC"));
        assert!(e.message.contains("job.yaml:"), "{}", e.message);
        assert_eq!(checks.available(), 1);
    }
}
