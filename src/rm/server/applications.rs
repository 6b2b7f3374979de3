//! Application endpoints: new-application, submit, list, report, attempts and kill.

use super::*;

pub(super) async fn new_application(State(rm): Rm) -> Json<NewApplication> {
    let mut st = rm.lock();
    let id = st.next_app_id(rm.cluster_ts);
    st.reserve(id.clone());
    Json(NewApplication {
        application_id: id,
        maximum_resource_capability: st.ledger.max_capability(),
    })
}

pub(super) async fn list_apps(State(rm): Rm) -> Json<Value> {
    let st = rm.lock();
    let apps: Vec<_> = st.apps.values().map(|a| a.report.clone()).collect();
    Json(json!({ "apps": { "app": apps } }))
}

pub(super) async fn get_app(State(rm): Rm, UrlPath(id): UrlPath<String>) -> Result<Json<Value>, ApiError> {
    with_app(&rm, &id, |a| Json(json!({ "app": a.report })))
}

pub(super) async fn get_app_state(State(rm): Rm, UrlPath(id): UrlPath<String>) -> Result<Json<Value>, ApiError> {
    with_app(&rm, &id, |a| Json(json!({ "state": a.report.state })))
}

/// YARN's `appattempts`: every AM attempt with its start, end and how it ended.
pub(super) async fn get_app_attempts(State(rm): Rm, UrlPath(id): UrlPath<String>) -> Result<Json<Value>, ApiError> {
    with_app(&rm, &id, |a| {
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

pub(super) async fn submit_app(State(rm): Rm, ApiJson(req): ApiJson<SubmitApplication>) -> Result<Response, ApiError> {
    let id = req.application_id.clone();
    // Validate before claiming anything, so a rejected submit leaves nothing behind.
    {
        let st = rm.lock();
        if st.apps.contains_key(&id) {
            return Err(ApiError::conflict(format!("application `{id}` was already submitted")));
        }
        if !st.is_reserved(&id) {
            return Err(ApiError::bad_request(format!(
                "unknown application id `{id}`: get one from POST /ws/v1/cluster/apps/new-application"
            )));
        }
    }
    let source = req.job_spec_name.clone().unwrap_or_else(|| "job.yaml".into());
    let spec = crate::spec::parse_job_spec(&req.job_spec, &source)
        .map_err(|errs| ApiError::new(StatusCode::BAD_REQUEST, "INVALID_JOB_SPEC", errs.to_string()))?;
    // Every submit is the admin's until callers have their own credentials.
    let user = crate::rm::scheduler::queues::ADMIN_USER;
    let queue = admit_to_queue(&rm, spec.queue.as_deref(), user)?;

    // Claim the id (a concurrent submit of the same id loses here).
    if !rm.lock().unreserve(&id) {
        return Err(ApiError::conflict(format!("application `{id}` was already submitted")));
    }
    let unclaim = |rm: &Shared, dir: &Path| {
        let _ = std::fs::remove_dir_all(dir);
        rm.lock().reserve(id.clone());
    };
    let dir = rm.work_dir.join(&id);
    let job_path = dir.join("job.yaml");
    // 0600: an OpenPAI job spec may carry `secrets`.
    let written = std::fs::create_dir_all(&dir).and_then(|_| {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&job_path)
            .and_then(|mut f| f.write_all(req.job_spec.as_bytes()))
    });
    if let Err(e) = written {
        unclaim(&rm, &dir);
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "IO_ERROR",
            format!("cannot write {}: {e}", job_path.display()),
        ));
    }
    let mut app = App::new(id.clone(), spec.name.clone());
    app.report.queue = queue;
    app.report.priority = spec.priority;
    app.report.user = user.to_string();
    app.gang = spec.gang;
    app.set_job_token(req.job_token.as_deref());
    if rm.launch_am {
        app.launch = Some(AmLaunch {
            job_path,
            listen: req.dashboard_listen.clone(),
        });
    }
    let report = app.report.clone();
    rm.lock().apps.insert(app);

    if rm.launch_am {
        if let Err(e) = launch_am(&rm, &id) {
            rm.lock().apps.remove(&id);
            unclaim(&rm, &dir);
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "AM_LAUNCH_FAILED",
                format!("could not launch the AM: {e}"),
            ));
        }
    }
    tracing::info!(app = %id, name = %spec.name, "application accepted");
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
    use crate::rm::scheduler::queues::QueueRefusal;
    let st = rm.lock();
    match st.sched.tree.admit(queue, user) {
        Ok(q) => Ok(st.sched.tree.get(q).path.clone()),
        Err(QueueRefusal::Unknown(m)) => Err(ApiError::new(StatusCode::BAD_REQUEST, "UNKNOWN_QUEUE", m)),
        Err(QueueRefusal::NotAllowed(m)) => Err(ApiError::new(StatusCode::FORBIDDEN, "QUEUE_FORBIDDEN", m)),
    }
}

/// Kill: needs the admin token or the job token given when the job was submitted
/// (never the AM's application token: that one only speaks the AM protocol).
pub(super) async fn put_app_state(
    State(rm): Rm,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<AppStateUpdate>,
) -> Result<Json<Value>, ApiError> {
    let ended = {
        let mut st = rm.lock();
        let app = app_mut(&mut st.apps, &id)?;
        let job_token_ok = bearer(&headers).is_some_and(|t| app.job_token_matches(t));
        if !job_token_ok {
            authorize_admin(&rm, &headers).map_err(|_| {
                ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "UNAUTHORIZED",
                    "killing an application needs `Authorization: Bearer <admin token or the job's job token>`",
                )
            })?;
        }
        if req.state != AppState::Killed {
            return Err(ApiError::bad_request("Only 'KILLED' is allowed as the target state"));
        }
        if app.report.state.is_final() {
            return Ok(Json(json!({ "state": app.report.state })));
        }
        app.finish(
            AppState::Killed,
            FinalStatus::Killed,
            crate::exit::JOB_FAILED,
            "Application killed by user".into(),
        );
        app.shutdown = true;
        release_all(
            &mut st,
            &id,
            exit_status::KILLED_BY_RESOURCEMANAGER,
            "the application was killed",
        )
    };
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
