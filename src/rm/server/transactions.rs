//! The RM core: the one door into the RM's state (issue 25). Every change to [`RmState`]
//! is a transaction here: an application's id, submit, kill and the end of its AM; the AM
//! protocol's register, allocate and finish; a container's start, launch failure and stop;
//! a node's events (its report of an exit, its agent's registration and heartbeat, a state
//! change, its removal, a wipe); the expiry of grants never started; the RM's shutdown.
//! Each takes what it needs (the time where it decides on time), changes the state and
//! commits once, before it returns what the caller answers (durable before acknowledged:
//! the rules of `state`). It does no I/O but that commit: what must be stopped on the
//! nodes comes back as the [`Ended`] containers, and the caller stops them.
//!
//! Ending a container is [`end_container`]: every path (an AM's release, a node's report
//! of an exit, the AM's stop, a kill, an application's end, expiry, a node made unusable
//! or removed, a failed launch, preemption, shutdown) goes through it, so freeing a
//! container's resources (once: ending it again is harmless) and telling its application
//! are written once.
//!
//! The HTTP handlers parse, authorize (under the same lock), call one of these and answer;
//! the background loops (expiry, liveness, node events, scheduling) call them too.

use std::collections::BTreeSet;
use std::time::Instant;

use super::am_supervisor::LaunchError;
use super::dashboard::{Refusal, RmMetrics};
use super::http::{app_mut, ApiError};
use super::nodes::declaration_change;
use super::scheduling;
use super::state::{RmState, StateGuard};
use super::{HistoryOptions, RmLimits};
use crate::cluster::rm_json::NodeReport;
use crate::cluster::{Node, NodeState};
use crate::node::procs::ProcessId;
use crate::node::wire::{AgentRegister, AgentReply, ContainerReport};
use crate::protocol::{
    exit_status, AllocateRequest, AllocateResponse, AmCommand, AppState, CompletedContainer, ContainerState,
    ContainerStatus, FinalStatus, FinishRequest, PreviousContainer, RegisterRequest, RegisterResponse, Rejection,
};
use crate::rm::apps::{AmLaunch, App, Apps};
use crate::rm::ledger::{Ended, DIAG_LOST_NODE};
use axum::http::StatusCode;

/// How a container ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ending {
    /// Its processes are known dead, or it never had any: its resources are freed now
    /// (`Ledger::complete`; one the RM ended before and held is freed without a second
    /// report).
    Dead,
    /// Ended for its application while its processes may still run: a running one stays
    /// held until its node reports it dead (`Ledger::stop`); one never started is freed now.
    Stopped,
}

/// Who hears of an ending.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tell {
    /// Its application, in `completed` of its next allocate answer.
    App,
    /// Nobody: the AM asked for it (a release), the AM never heard of it (a gang undone),
    /// or the RM is going away.
    Nobody,
}

/// Ends a container: the one function every ending takes (see the module doc). `None`
/// when it is unknown or had ended already (then nothing changes, and nobody is told
/// twice). The caller commits, as part of its transaction.
pub(super) fn end_container(
    st: &mut RmState,
    id: &str,
    how: Ending,
    exit: i32,
    why: &str,
    tell: Tell,
) -> Option<Ended> {
    let ended = match how {
        Ending::Dead => st.ledger.complete(id, exit, why),
        Ending::Stopped => st.ledger.stop(id, exit, why),
    }?;
    if tell == Tell::App {
        report_ended(&mut st.apps, &ended);
    }
    Some(ended)
}

/// Queues an ended container for its application's next allocate answer (the half of
/// [`end_container`] that a restarted RM also needs for the containers the ledger could
/// not restore).
pub(super) fn report_ended(apps: &mut Apps, e: &Ended) {
    if let Some(app) = apps.get_mut(&e.app_id) {
        app.pending_completed.push(CompletedContainer {
            container_id: e.container_id.clone(),
            exit_status: e.exit_status,
            diagnostics: e.diagnostics.clone(),
        });
        app.wake.notify_one();
    }
}

/// Ends every live container of `app_id` for it (stopped; its application is told).
fn end_app_containers(st: &mut RmState, app_id: &str, exit: i32, why: &str) -> Vec<Ended> {
    st.ledger
        .live_containers_of(app_id)
        .iter()
        .filter_map(|c| end_container(st, c, Ending::Stopped, exit, why, Tell::App))
        .collect()
}

/// A transaction's outcome where what it ended is stopped whether or not its commit
/// succeeded (processes must not outlive what memory says has ended), while the answer
/// waits for the commit.
pub(super) struct Done<T> {
    pub(super) answer: T,
    /// To stop on their nodes (the running ones).
    pub(super) ended: Vec<Ended>,
    pub(super) committed: Result<(), ApiError>,
}

impl<T> Done<T> {
    fn stored(answer: T) -> Self {
        Done {
            answer,
            ended: Vec::new(),
            committed: Ok(()),
        }
    }
}

// ---- applications ----

/// `Err` (429) when `user` may not start another application now.
pub(super) fn check_app_limits(limits: &RmLimits, apps: &Apps, user: &str) -> Result<(), ApiError> {
    let live: Vec<&App> = apps.values().filter(|a| !a.report.state.is_final()).collect();
    if live.len() >= limits.max_apps {
        return Err(ApiError::limit(
            "rm.max_apps",
            limits.max_apps,
            &format!("{} applications are running or waiting", live.len()),
        ));
    }
    let mine = live.iter().filter(|a| a.report.user == user).count();
    if mine >= limits.max_apps_per_user {
        return Err(ApiError::limit(
            "rm.max_apps_per_user",
            limits.max_apps_per_user,
            &format!("user `{user}` has {mine} applications running or waiting"),
        ));
    }
    Ok(())
}

/// New-application: a fresh id, reserved for `user`.
pub(super) fn new_application(st: &mut StateGuard, user: &str) -> Result<String, ApiError> {
    st.writable()?;
    let cluster_ts = st.cluster_ts;
    let id = st.next_app_id(cluster_ts)?;
    st.reserve(id.clone(), user);
    st.commit()?;
    Ok(id)
}

/// What a submit of `id` by `user` must pass before anything is claimed.
pub(super) fn check_submit(st: &mut StateGuard, limits: &RmLimits, id: &str, user: &str) -> Result<(), ApiError> {
    st.writable()?;
    check_app_limits(limits, &st.apps, user)?;
    if st.apps.contains_key(id) {
        return Err(ApiError::conflict(format!("application `{id}` was already submitted")));
    }
    if !st.is_reserved(id) {
        return Err(ApiError::bad_request(format!(
            "unknown application id `{id}`: get one from POST /ws/v1/cluster/apps/new-application"
        )));
    }
    if let Some(owner) = st.reserved_user(id).filter(|u| *u != user) {
        tracing::warn!(app = %id, %owner, caller = user, "submit of an id another user reserved: refused");
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "NOT_YOUR_APPLICATION_ID",
            format!(
                "application id `{id}` was handed out to another user; get your own from POST \
                 /ws/v1/cluster/apps/new-application"
            ),
        ));
    }
    Ok(())
}

/// Claims a reserved id for its submit (a concurrent submit of the same id loses here).
pub(super) fn claim_id(st: &mut StateGuard, id: &str) -> Result<(), ApiError> {
    if !st.unreserve(id) {
        return Err(ApiError::conflict(format!("application `{id}` was already submitted")));
    }
    st.commit()
}

/// Gives back an id claimed by a submit that failed afterwards (and forgets its
/// application, if it was added).
pub(super) fn unclaim_id(st: &mut StateGuard, id: &str, user: &str) {
    st.apps.remove(id);
    st.reserve(id.to_string(), user);
    st.commit_or_log();
}

/// Adds a submitted application (its limits checked again where it counts: concurrent
/// submits cannot pass them together). On `Err` nothing was added.
pub(super) fn add_app(st: &mut StateGuard, limits: &RmLimits, app: App) -> Result<(), ApiError> {
    check_app_limits(limits, &st.apps, &app.report.user)?;
    let id = app.report.id.clone();
    st.apps.insert(app);
    st.commit().inspect_err(|_| {
        st.apps.remove(&id);
    })
}

/// A kill of an unfinished application (the caller checked who may): it ends, its AM is
/// told SHUTDOWN, its containers end.
pub(super) fn kill_app(st: &mut StateGuard, id: &str, who: &str) -> Result<Done<()>, ApiError> {
    st.writable()?;
    let app = app_mut(&mut st.apps, id)?;
    app.finish(
        AppState::Killed,
        FinalStatus::Killed,
        crate::exit::JOB_FAILED,
        format!("Application killed by user ({who})"),
    );
    app.shutdown = true;
    app.wake.notify_one();
    let ended = end_app_containers(
        st,
        id,
        exit_status::KILLED_BY_RESOURCEMANAGER,
        "the application was killed",
    );
    Ok(Done {
        answer: (),
        ended,
        committed: st.commit(),
    })
}

/// What the end of an application's AM process leads to.
#[derive(Debug, PartialEq)]
pub(super) enum AmEnd {
    /// Nothing more: the application had finished (or is unknown).
    Over,
    /// Start this attempt (work-preserving: it re-adopts the job's containers); if that
    /// fails, [`fail_app`].
    NextAttempt(u32),
    /// The application failed, in the same transaction ([`fail_app`]): these ended.
    Failed(Vec<Ended>),
}

/// An application's AM process ended (`how`): the attempt is recorded; an unfinished
/// application goes on with its next attempt when `may_retry` and attempts remain, else
/// fails with `fail_diag` in the same transaction (no state where its attempt ended but
/// it still runs without an AM is ever stored).
pub(super) fn am_ended(
    st: &mut StateGuard,
    id: &str,
    how: &str,
    fail_diag: String,
    max_attempts: u32,
    may_retry: bool,
) -> AmEnd {
    let Some(app) = st.apps.get_mut(id) else {
        return AmEnd::Over;
    };
    app.attempt_ended(how);
    // The AM's dashboard went with it: its address may be another process's port now.
    app.report.tracking_url.clear();
    if app.unregistered || app.report.state.is_final() {
        st.commit_or_log();
        return AmEnd::Over;
    }
    if app.report.attempt < max_attempts && may_retry && !app.shutdown && app.launch.is_some() {
        app.report.attempt += 1;
        app.registered = false;
        app.report.state = AppState::Accepted;
        app.last_allocate = None;
        let attempt = app.report.attempt;
        st.commit_or_log();
        return AmEnd::NextAttempt(attempt);
    }
    AmEnd::Failed(fail_app(st, id, fail_diag))
}

/// The application failed (its AM died for good, `diag` says how): its containers end.
pub(super) fn fail_app(st: &mut StateGuard, id: &str, diag: String) -> Vec<Ended> {
    let Some(app) = st.apps.get_mut(id) else {
        return Vec::new();
    };
    app.finish(AppState::Failed, FinalStatus::Failed, crate::exit::JOB_FAILED, diag);
    let ended = end_app_containers(
        st,
        id,
        exit_status::KILLED_BY_RESOURCEMANAGER,
        "the application's AM died",
    );
    st.commit_or_log();
    ended
}

/// An AM attempt begins: recorded, and stored before its process exists (so a restarted
/// RM never starts a second AM beside one it does not know of). Returns the application's
/// token, its job token and how to launch its AM.
pub(super) fn begin_attempt(st: &mut StateGuard, id: &str) -> Result<(String, Option<String>, AmLaunch), LaunchError> {
    let app = st
        .apps
        .get_mut(id)
        .ok_or_else(|| std::io::Error::other(format!("unknown application `{id}`")))?;
    let launch = app
        .launch
        .clone()
        .ok_or_else(|| std::io::Error::other(format!("application `{id}` has no AM to launch")))?;
    app.attempt_started(None);
    let started = (app.token().to_string(), app.job_token().map(str::to_string), launch);
    let ts = st.cluster_ts;
    st.persist(ts).map_err(LaunchError::Store)?;
    Ok(started)
}

/// Test fault injection: the applications whose AM's process record fails to be stored.
#[cfg(test)]
pub(super) static UNRECORDABLE_AMS: parking_lot::Mutex<Vec<String>> = parking_lot::Mutex::new(Vec::new());

/// The process of an application's current attempt, once it runs (so a restarted RM can
/// find it again).
/// Whether it is stored: false when the attempt has ended or holds another process, or
/// the store failed (the AM must then not run: a restarted RM could not find it).
pub(super) fn attempt_process(st: &mut StateGuard, id: &str, process: ProcessId) -> bool {
    #[cfg(test)]
    if UNRECORDABLE_AMS.lock().iter().any(|a| a == id) {
        return false;
    }
    let set = match st.apps.get_mut(id).and_then(|a| a.attempts.last_mut()) {
        Some(a) if a.finished_time == 0 && a.process.is_none() => {
            a.process = Some(process);
            true
        }
        _ => false,
    };
    set && st.commit().is_ok()
}

/// History retention at `now_ms`: the finished applications whose containers are all dead
/// (a held one still counts its GPUs), with their end times; those beyond the history's
/// bounds are forgotten with their containers (returned second).
pub(super) fn forget_finished(
    st: &mut StateGuard,
    history: &HistoryOptions,
    now_ms: u64,
) -> (Vec<(String, u64)>, Vec<String>) {
    let busy: std::collections::HashSet<&str> = st
        .ledger
        .all_containers()
        .filter(|c| c.state != ContainerState::Complete || c.held)
        .map(|c| c.app_id.as_str())
        .collect();
    let owned: Vec<crate::rm::history::Finished> = st
        .apps
        .values()
        .filter(|a| a.report.state.is_final() && !busy.contains(a.report.id.as_str()))
        .map(|a| (a.report.id.clone(), a.report.finished_time, a.report.user.clone()))
        .collect();
    drop(busy);
    let max_age = history.max_age.as_millis() as u64;
    let gone = crate::rm::history::to_forget(&owned, now_ms, max_age, history.max_apps);
    let finished: Vec<(String, u64)> = owned.into_iter().map(|(id, t, _)| (id, t)).collect();
    for id in &gone {
        st.apps.remove(id);
        st.ledger.forget_app(id);
    }
    if !gone.is_empty() {
        st.commit_or_log();
    }
    (finished, gone)
}

// ---- the AM protocol ----

/// Register (again: a retried request or a resync after an RM restart is harmless).
pub(super) fn register(st: &mut StateGuard, id: &str, req: RegisterRequest) -> Result<RegisterResponse, ApiError> {
    st.writable()?;
    let epoch = st.ledger.epoch();
    let max = st.ledger.max_capability();
    let expiry = st.ledger.expiry().as_secs();
    let app = app_mut(&mut st.apps, id)?;
    if app.report.state.is_final() {
        return Err(ApiError::conflict(format!(
            "application `{id}` is already {:?}",
            app.report.state
        )));
    }
    if !app.registered {
        app.registered = true;
        app.report.state = AppState::Running;
        app.nodes_seen = epoch;
    }
    app.report.tracking_url = req.tracking_url;
    let attempt = app.report.attempt;
    // All of the application's containers: a new attempt has none of its own yet, so
    // these are the earlier attempts'; an AM that resyncs gets its own too, including
    // grants whose answer the RM never got to send.
    let previous = st
        .ledger
        .containers_of(id)
        .into_iter()
        .map(|c| PreviousContainer {
            container: c.container.clone(),
            state: c.state,
            exit_status: c.exit_status,
            diagnostics: c.diagnostics.clone(),
        })
        .collect();
    st.commit()?;
    Ok(RegisterResponse {
        maximum_capability: max,
        containers_from_previous_attempts: previous,
        attempt,
        container_expiry_sec: expiry,
    })
}

/// Allocate: releases, then each ask (or gang of asks) through the queue gate and the
/// ledger, then what the AM must hear (notices, completions, changed nodes). Idempotent
/// by `responseId`: the same request gets the stored answer again. `Err` before anything
/// changed; the released containers in `ended` are stopped whether or not the commit
/// succeeded, the grants acknowledged only when it did.
pub(super) fn allocate(
    guard: &mut StateGuard,
    id: &str,
    req: &AllocateRequest,
    metrics: &RmMetrics,
    now: Instant,
    wall_ms: u64,
) -> Result<Done<AllocateResponse>, ApiError> {
    // Nothing is granted while the store fails; a replayed answer was stored already.
    guard.writable()?;
    let st = &mut **guard;
    let app = app_mut(&mut st.apps, id)?;
    if let Some((last_req, last)) = &app.last_allocate {
        if req.response_id == *last_req {
            return Ok(Done::stored(last.clone()));
        }
        if req.response_id != last.response_id {
            return Err(ApiError::bad_request(format!(
                "responseId {} is out of order: the last answer was {}",
                req.response_id, last.response_id
            )));
        }
    }
    let mut out = AllocateResponse {
        response_id: req.response_id.wrapping_add(1),
        num_cluster_nodes: st.ledger.node_count() as u32,
        ..Default::default()
    };
    if app.shutdown || app.report.state.is_final() {
        out.command = Some(AmCommand::Shutdown);
        out.completed = std::mem::take(&mut app.pending_completed);
        app.last_allocate = Some((req.response_id, out.clone()));
        guard.commit()?;
        return Ok(Done::stored(out));
    }
    if !app.registered {
        // Not registered (never, or not since this RM restarted): YARN's AM_RESYNC.
        // Nothing in this request is acted on; the AM registers and sends it again.
        out.command = Some(AmCommand::Resync);
        return Ok(Done::stored(out));
    }
    app.report.progress = req.progress.clamp(0.0, 1.0);
    let attempt = app.report.attempt;
    if let Some(w) = req.waiting.clone() {
        app.waiting.report(w, now);
        app.waiting.placement = req.wait_reason.clone();
    }
    let ended = release(st, id, &req.releases);
    // Cancels need no work: asks never stay pending.
    grant_asks(st, id, attempt, req, metrics, now, &mut out);
    metrics.granted(out.allocated.len());
    out.preempt = scheduling::notices_for(st, id);
    out.others_waiting = scheduling::others_waiting(st, id, now);
    let app = app_mut(&mut st.apps, id)?;
    out.waiting_reason = app.waiting.why.as_ref().map(|(_, t)| t.clone());
    out.wait_reason = app.waiting.queue_reason();
    out.start_estimate = app
        .waiting
        .estimate
        .clone()
        .filter(|_| app.waiting.since_ms.is_some())
        .map(Box::new);
    out.completed = std::mem::take(&mut app.pending_completed);
    out.updated_nodes = st
        .ledger
        .changed_since(app.nodes_seen)
        .map(|(n, c)| NodeReport {
            node: n.clone(),
            num_containers: c,
            last_health_update_ms: wall_ms,
        })
        .collect();
    app.nodes_seen = st.ledger.epoch();
    metrics.sent_node_reports(out.updated_nodes.len());
    app.last_allocate = Some((req.response_id, out.clone()));
    Ok(Done {
        answer: out,
        ended,
        committed: guard.commit(),
    })
}

/// An AM's releases: ended now and not reported back (the AM asked for it); one under a
/// preemption notice ends as preempted.
fn release(st: &mut RmState, id: &str, releases: &[String]) -> Vec<Ended> {
    let mut ended = Vec::new();
    for cid in releases {
        if st.ledger.container(cid).is_none_or(|c| c.app_id != id) {
            tracing::debug!(app = %id, container = %cid, "release of a container this app does not hold");
            continue;
        }
        let (exit, why) = match st.sched.preempting.get(cid) {
            Some(p) => (exit_status::PREEMPTED, scheduling::preempted_diagnostics(p)),
            None => (exit_status::ABORTED, "Container released by application".to_string()),
        };
        ended.extend(end_container(st, cid, Ending::Stopped, exit, &why, Tell::Nobody));
    }
    ended
}

/// Each ask, or each gang of asks, passes the queue gate first, then the ledger; every
/// ask ends in `out.allocated` or `out.rejected`.
fn grant_asks(
    st: &mut RmState,
    id: &str,
    attempt: u32,
    req: &AllocateRequest,
    metrics: &RmMetrics,
    now: Instant,
    out: &mut AllocateResponse,
) {
    for group in scheduling::group_asks(&req.asks) {
        if let Err(why) = scheduling::admit(st, id, &group, now) {
            metrics.refused(Refusal::Queue, group.len());
            out.rejected.extend(group.iter().map(|a| Rejection {
                request_id: a.request_id,
                reason: why.detail.clone(),
                retryable: true,
                wait: Some(Box::new(why.clone())).filter(|w| w.kind.is_queue()),
            }));
            continue;
        }
        let granted_before = out.allocated.len();
        for ask in &group {
            match st.ledger.grant(id, attempt, ask, now) {
                Ok(c) => {
                    if let (Some(app), Some(task)) = (st.apps.get_mut(id), ask.task.as_deref()) {
                        app.waiting.granted(crate::protocol::split_task(task).0);
                    }
                    out.allocated.push(c)
                }
                Err(r) => {
                    metrics.refused(if r.retryable { Refusal::Busy } else { Refusal::Never }, 1);
                    out.rejected.push(r)
                }
            }
        }
        if group.len() > 1 && out.allocated.len() - granted_before < group.len() {
            // A gang is granted whole or not at all (its fit was checked above under the
            // same lock, so this does not happen; if it ever did, undo it).
            let why = "gang not granted whole";
            for c in out.allocated.drain(granted_before..) {
                end_container(
                    st,
                    &c.container_id,
                    Ending::Dead,
                    exit_status::ABORTED,
                    why,
                    Tell::Nobody,
                );
                out.rejected.push(Rejection {
                    request_id: c.request_id,
                    reason: why.into(),
                    retryable: true,
                    wait: None,
                });
            }
        }
    }
}

/// Finish: the application ends as the AM says (once), its containers end.
pub(super) fn finish(st: &mut StateGuard, id: &str, req: FinishRequest) -> Result<Done<()>, ApiError> {
    st.writable()?;
    let app = app_mut(&mut st.apps, id)?;
    if !app.unregistered {
        let state = match req.final_status {
            FinalStatus::Succeeded => AppState::Finished,
            FinalStatus::Failed => AppState::Failed,
            FinalStatus::Killed => AppState::Killed,
            FinalStatus::Undefined => {
                return Err(ApiError::bad_request(
                    "`finalStatus` must be SUCCEEDED, FAILED or KILLED",
                ))
            }
        };
        app.finish(state, req.final_status, req.exit_code, req.diagnostics);
        app.unregistered = true;
        tracing::info!(app = %id, ?state, "application finished");
    }
    let ended = end_app_containers(
        st,
        id,
        exit_status::KILLED_AFTER_APP_COMPLETION,
        "Container killed after the application finished",
    );
    Ok(Done {
        answer: (),
        ended,
        committed: st.commit(),
    })
}

// ---- containers ----

/// What a start asks of the node.
pub(super) enum Start {
    /// It was started once already (a start sent again because its answer was lost): the
    /// node reports what became of it.
    Again(ContainerStatus),
    /// Start it there: it is RUNNING, and stored so, before its process exists.
    Launch(crate::node::Grant),
}

/// A container's start (its caller authorized, `status` is what the ledger says of it).
pub(super) fn start_container(
    st: &mut StateGuard,
    host: &str,
    id: &str,
    status: ContainerStatus,
) -> Result<Start, ApiError> {
    st.writable()?;
    let (app_id, resources, state, started) = match st.ledger.container(id) {
        // Running is started, whenever it was stored (an older RM stored no start time).
        Some(c) => (
            c.app_id.clone(),
            c.container.resources.clone(),
            c.state,
            c.started_ms > 0 || c.state == ContainerState::Running,
        ),
        None => return Err(ApiError::not_found(format!("no container `{id}` on host `{host}`"))),
    };
    if st.apps.get(&app_id).is_none_or(|a| a.report.state.is_final()) {
        return Err(ApiError::conflict("the container's application has ended"));
    }
    // Started once already (the start sent again because its answer was lost, maybe
    // across an RM restart): what became of it — running, or ended (its end reaches the
    // AM as every end does) — and never a second run of the same container.
    if started && state != ContainerState::Allocated {
        return Ok(Start::Again(status));
    }
    if state != ContainerState::Allocated {
        return Err(ApiError::conflict(format!(
            "container `{id}` is {state:?}; only ALLOCATED containers can be started"
        )));
    }
    // Running before the process exists, so its exit event always finds it live.
    st.ledger
        .mark_running(id)
        .map_err(|e| ApiError::conflict(e.to_string()))?;
    // RUNNING is stored before the process exists: a restarted RM must look for it.
    if let Err(e) = st.commit() {
        let why = "not launched: the RM could not save its state";
        end_container(st, id, Ending::Dead, exit_status::INVALID, why, Tell::App);
        return Err(e);
    }
    Ok(Start::Launch(crate::node::Grant {
        container_id: id.to_string(),
        topology: st.ledger.node(host).and_then(|n| n.topology.clone()),
        // The task runs as its submitter's own uid on the node (issue 23).
        user: st.apps.get(&app_id).map(|a| a.report.user.clone()).unwrap_or_default(),
        app_id,
        host: host.to_string(),
        resources,
    }))
}

/// The node did not start a container (`why`). One that may run there anyway (the
/// answer was lost) ends for its application but stays held until the node reports it
/// dead: returned, to be stopped there; one that surely does not run is freed now.
pub(super) fn launch_failed(st: &mut StateGuard, id: &str, may_run: bool, why: &str) -> Option<Ended> {
    let how = if may_run { Ending::Stopped } else { Ending::Dead };
    let ended = end_container(st, id, how, exit_status::INVALID, why, Tell::App);
    st.commit_or_log();
    ended.filter(|_| may_run)
}

/// The AM stops a container through the container endpoint: it ends (its application is
/// told), and the answer is its status now (`status` when the ledger no longer has it).
pub(super) fn stop_container(
    st: &mut StateGuard,
    id: &str,
    status: ContainerStatus,
) -> Result<Done<ContainerStatus>, ApiError> {
    st.writable()?;
    let ended = end_container(
        st,
        id,
        Ending::Stopped,
        exit_status::KILLED_BY_APPMASTER,
        "Container stopped by the application master",
        Tell::App,
    );
    let status = st.ledger.container(id).map_or(status, |c| ContainerStatus {
        container_id: id.to_string(),
        state: c.state,
        exit_status: c.exit_status,
        diagnostics: c.diagnostics.clone(),
        pid: None,
        started_ms: None,
    });
    Ok(Done {
        answer: status,
        ended: ended.into_iter().collect(),
        committed: st.commit(),
    })
}

/// Ends every container still live (the RM shuts down; nobody is told: the applications
/// learn it when they register with the next RM).
pub(super) fn end_all(st: &mut StateGuard, exit: i32, why: &str) -> Vec<Ended> {
    let ended = st
        .ledger
        .live_containers()
        .iter()
        .filter_map(|id| end_container(st, id, Ending::Dead, exit, why, Tell::Nobody))
        .collect();
    st.commit_or_log();
    ended
}

/// Grants never started within the container expiry at `now` are taken back (their
/// applications hear of it).
pub(super) fn expire(st: &mut StateGuard, now: Instant) -> Vec<Ended> {
    let ended = st.ledger.expire(now);
    for e in &ended {
        report_ended(&mut st.apps, e);
        tracing::info!(container = %e.container_id, app = %e.app_id, "container expired unused");
    }
    st.commit_or_log();
    ended
}

// ---- nodes ----

/// A node says a container is dead: it is freed (and its application told, if it had
/// not heard yet). A container under a preemption notice was preempted, however its
/// task exited.
pub(super) fn container_exited(st: &mut StateGuard, id: &str, exit: i32, diagnostics: String) -> Option<Ended> {
    let (exit, diagnostics) = scheduling::exit_of(st, id, exit, diagnostics);
    let ended = end_container(st, id, Ending::Dead, exit, &crate::text::clean(&diagnostics), Tell::App);
    st.commit_or_log();
    ended
}

/// A node agent reports a container dead. `reporter`, its host, must be the host the
/// ledger places the container on: checked here, in the transaction that ends it, so a
/// report let through while the id was unknown (before a grant placed it elsewhere) ends
/// nothing of another host's.
pub(super) fn node_reported_exit(
    st: &mut StateGuard,
    reporter: &str,
    id: &str,
    exit: i32,
    diagnostics: String,
) -> Result<Option<Ended>, NotItsHost> {
    if let Some(placed) = st.ledger.container(id).map(|c| c.container.host.as_str()) {
        if placed != reporter {
            tracing::warn!(%reporter, host = %placed, container = %id, "a node agent reported another host's container dead: refused");
            return Err(NotItsHost);
        }
    }
    Ok(container_exited(st, id, exit, diagnostics))
}

/// A node agent's report of a container the ledger places on another host: refused.
#[derive(Debug)]
pub(super) struct NotItsHost;

/// A node's state changes: unusable states end its containers for their applications
/// (-100, the lost-node diagnostics; running ones stay held until the node reports them
/// dead). `None` for an unknown host.
pub(super) fn set_node_state(st: &mut StateGuard, host: &str, state: NodeState) -> Option<Vec<Ended>> {
    let ids = st.ledger.mark_node(host, state)?;
    let ended = ids
        .iter()
        .filter_map(|id| end_container(st, id, Ending::Stopped, exit_status::ABORTED, DIAG_LOST_NODE, Tell::App))
        .collect();
    st.commit_or_log();
    Some(ended)
}

/// What a node agent's registration led to.
pub(super) enum Registration {
    /// A removed host re-admitted (a new credential) that still runs containers of before
    /// its removal: it stops them and registers again once it reports none (it joins
    /// empty, so nothing of before its removal runs beside what is granted now).
    StopFirst(AgentReply),
    /// It joined: whether the host is new, the reply, and the reports it may make (its
    /// own containers only; see [`own_reports`]).
    Joined {
        new: bool,
        reply: AgentReply,
        own: Vec<ContainerReport>,
    },
}

/// A node agent (the caller checked its credential) (re-)registers `node` with its
/// declaration `decl` (`req`): the node joins (or takes its new description) and what it
/// reports is reconciled. What a host offers is fixed at its first registration: another
/// offer is refused (409). A host an admin removed joins again as a new, empty node.
pub(super) fn agent_registered(
    st: &mut StateGuard,
    node: Node,
    decl: String,
    req: &AgentRegister,
) -> Result<Registration, ApiError> {
    let host = node.host.clone();
    if st.removed_hosts.contains_key(&host) {
        let running: Vec<String> = req
            .containers
            .iter()
            .filter(|r| r.state != ContainerState::Complete)
            .map(|r| r.container_id.clone())
            .collect();
        if !running.is_empty() {
            tracing::warn!(%host, containers = running.len(), "a re-admitted host still runs containers of before its removal: stopping them first");
            return Ok(Registration::StopFirst(AgentReply {
                reregister: true,
                stop: running,
                heartbeat_ms: 1000,
                ..Default::default()
            }));
        }
        tracing::warn!(%host, "a removed host registers with a new credential: re-admitted");
    }
    if let Some(why) = st.agent_nodes.get(&host).and_then(|old| declaration_change(old, req)) {
        tracing::warn!(%host, "node agent registration refused: {why}");
        return Err(ApiError::conflict(format!(
            "host `{host}` registered before with other resources: {why}; what a host offers is fixed at \
             its first registration: start its agent with the same resources, labels, GPU type, rack and \
             topology, or register the changed machine under a new host name (with its own token)"
        )));
    }
    let own = own_reports(st, &host, &req.containers);
    if st.removed_hosts.remove(&host).is_some() {
        st.meta_dirty = true;
    }
    let new = st.ledger.add_node(node);
    if st.agent_nodes.get(&host) != Some(&decl) {
        st.agent_nodes.insert(host.clone(), decl);
        st.agent_nodes_dirty.insert(host.clone());
    }
    let reply = reconcile(st, &host, &own, true);
    st.commit_or_log();
    Ok(Registration::Joined { new, reply, own })
}

/// A node agent's heartbeat with what it reports (its own only).
pub(super) fn agent_heartbeat(st: &mut StateGuard, host: &str, reports: &[ContainerReport]) -> AgentReply {
    let reply = reconcile(st, host, reports, false);
    st.commit_or_log();
    reply
}

/// What of `reports` a host may report: containers the ledger places on `host`, or does
/// not know at all. Another host's container is dropped (a host cannot end, keep or
/// acknowledge what runs elsewhere).
pub(super) fn own_reports(st: &RmState, host: &str, reports: &[ContainerReport]) -> Vec<ContainerReport> {
    reports
        .iter()
        .filter(|r| {
            let own = st
                .ledger
                .container(&r.container_id)
                .is_none_or(|c| c.container.host == host);
            if !own {
                tracing::warn!(%host, container = %r.container_id, "a node agent reported another host's container: ignored");
            }
            own
        })
        .cloned()
        .collect()
}

/// frameworklauncher's rules for what a node reports: a running container the RM does
/// not know as running there is killed; dead ones are acknowledged (the heartbeat turns
/// them into `Exited` events). At registration, containers the RM holds or runs on the
/// host that the node does not report at all are gone: freed (and reported to their
/// applications when they had not ended yet).
fn reconcile(st: &mut RmState, host: &str, reports: &[ContainerReport], registering: bool) -> AgentReply {
    let mut reply = AgentReply {
        heartbeat_ms: 1000,
        ..Default::default()
    };
    let mut seen = BTreeSet::new();
    for r in reports {
        seen.insert(r.container_id.clone());
        if r.state == ContainerState::Complete {
            reply.acknowledged.push(r.container_id.clone());
            continue;
        }
        let wanted = st
            .ledger
            .container(&r.container_id)
            .is_some_and(|c| c.container.host == host && c.state == ContainerState::Running && !c.held);
        if !wanted {
            reply.stop.push(r.container_id.clone());
        }
    }
    if registering {
        let gone: Vec<String> = st
            .ledger
            .live_containers()
            .into_iter()
            .filter(|id| !seen.contains(id))
            .filter(|id| {
                st.ledger
                    .container(id)
                    .is_some_and(|c| c.container.host == host && (c.state == ContainerState::Running || c.held))
            })
            .collect();
        let why = "the node no longer knows this container (its agent restarted without it)";
        for id in gone {
            end_container(st, &id, Ending::Dead, exit_status::ABORTED, why, Tell::App);
        }
    }
    reply
}

/// An admin takes a node agent's host out for good: everything on it is freed once (a
/// live container ends for its application as on a lost host, with -100; a held one is
/// freed without a second report), the host leaves the view and its declaration goes, and
/// the removal is stored with `credential` (the fingerprint refused from now on) at
/// `wall_ms`. Refused (409) for a host of the cluster file, and for one that runs
/// containers for their jobs unless `force`.
pub(super) fn remove_host(
    st: &mut StateGuard,
    host: &str,
    force: bool,
    credential: Option<String>,
    wall_ms: u64,
) -> Result<Vec<Ended>, ApiError> {
    st.writable()?;
    if !st.agent_nodes.contains_key(host) {
        return Err(ApiError::conflict(format!(
            "host `{host}` is not a node agent's: it comes from the RM's cluster file (or Ray) and would come \
             back with it; take it out there and restart the RM, or mark it DECOMMISSIONED \
             (PUT /ws/v1/cluster/nodes/{host}/state)"
        )));
    }
    let running = (st.ledger.num_containers(host) as usize).saturating_sub(st.ledger.held_on(host).len());
    if running > 0 && !force {
        return Err(ApiError::conflict(format!(
            "host `{host}` runs {running} container(s) for their jobs: removing it ends them as a lost host's \
             (their jobs retry elsewhere). Give --force (`gpuam node remove {host} --force`, `?force=true`) \
             to do so, or wait until they end"
        )));
    }
    let why = format!("{DIAG_LOST_NODE} (host `{host}` was removed by an administrator)");
    let ended = st.ledger.remove_node(host, &why).unwrap_or_default();
    for e in &ended {
        report_ended(&mut st.apps, e);
    }
    st.agent_nodes.remove(host);
    st.agent_nodes_dirty.insert(host.to_string());
    st.removed_hosts.insert(
        host.to_string(),
        crate::rm::store::RemovedHost {
            removed_ms: wall_ms,
            credential,
        },
    );
    st.meta_dirty = true;
    st.commit()?;
    Ok(ended)
}

/// An admin says the machine of a node that is not RUNNING was wiped: the containers it
/// still holds (ended, waiting for the node to report them dead) are freed. Returns them.
/// A RUNNING node's agent reports its containers itself: refused (409).
pub(super) fn wipe_host(st: &mut StateGuard, host: &str) -> Result<Vec<String>, ApiError> {
    st.writable()?;
    if st.ledger.node(host).is_some_and(|n| n.state == NodeState::Running) {
        return Err(ApiError::conflict(format!(
            "node `{host}` is RUNNING: its agent reports its containers; mark it LOST or \
             DECOMMISSIONED first (PUT /ws/v1/cluster/nodes/{host}/state)"
        )));
    }
    let held = st.ledger.held_on(host);
    let why = "the machine was declared wiped by an administrator";
    for id in &held {
        end_container(st, id, Ending::Dead, exit_status::ABORTED, why, Tell::App);
    }
    st.commit()?;
    Ok(held)
}

#[cfg(test)]
mod tests {
    //! The core's transactions on a state of their own (no server): what ending a
    //! container frees and tells, and that each transaction's commit is in the store
    //! before its answer is returned.

    use super::*;
    use crate::protocol::Ask;
    use crate::resources::{PortSet, Resources};
    use crate::rm::ledger::Ledger;
    use crate::rm::store::Store;
    use parking_lot::Mutex;
    use std::time::Duration;

    const TS: u64 = 1_700_000_000_000;

    /// A state over node `n1` (4 CPU, 1000 MB, GPUs 0-1, ports 5000-5009) with `store`.
    fn state(store: Store) -> Mutex<RmState> {
        let ports = PortSet::range(5000, 5009);
        let n1 = Node::new("n1", "/r", Resources::with_mask(4, 1000, 0x3, ports));
        let ledger = Ledger::new(vec![n1], Duration::from_secs(60));
        let sched = scheduling::SchedState::new(Default::default(), Duration::from_secs(30));
        let (st, _) = super::super::state::recover_state(store, ledger, sched, "http://rm").unwrap();
        Mutex::new(st)
    }

    fn guard(m: &Mutex<RmState>) -> StateGuard<'_> {
        StateGuard {
            st: m.lock(),
            cluster_ts: TS,
        }
    }

    /// A registered application of `alice`.
    fn app(st: &mut StateGuard) -> String {
        let id = new_application(st, "alice").unwrap();
        claim_id(st, &id).unwrap();
        let mut app = App::new(id.clone(), "job".into());
        app.report.user = "alice".into();
        add_app(st, &RmLimits::default(), app).unwrap();
        register(st, &id, RegisterRequest::default()).unwrap();
        id
    }

    fn ask(request_id: u64, gpu_mask: u64, ports: &[u16]) -> Ask {
        Ask {
            request_id,
            host: "n1".into(),
            cpu: 1,
            memory_mb: 100,
            gpu_mask,
            ports: PortSet::from_ports(ports.iter().copied()),
            ..Default::default()
        }
    }

    fn allocate_asks(
        st: &mut StateGuard,
        id: &str,
        response_id: u64,
        asks: Vec<Ask>,
        releases: Vec<String>,
    ) -> Done<AllocateResponse> {
        let req = AllocateRequest {
            response_id,
            asks,
            releases,
            ..Default::default()
        };
        allocate(st, id, &req, &RmMetrics::default(), Instant::now(), 1).unwrap()
    }

    /// What the handler would have read of the container before the call.
    fn status(id: &str) -> ContainerStatus {
        ContainerStatus {
            container_id: id.to_string(),
            state: ContainerState::Allocated,
            exit_status: None,
            diagnostics: String::new(),
            pid: None,
            started_ms: None,
        }
    }

    fn used(st: &StateGuard) -> Resources {
        st.ledger.node("n1").unwrap().used().clone()
    }

    /// Ending a container frees its GPUs and ports exactly once and tells its application
    /// once; ending it again (any way) changes nothing and tells nobody.
    #[test]
    fn ending_a_container_frees_it_once_and_tells_its_application_once() {
        let m = state(Store::memory());
        let mut st = guard(&m);
        let id = app(&mut st);
        let granted = allocate_asks(&mut st, &id, 0, vec![ask(1, 0x1, &[5000])], vec![]).answer;
        let cid = granted.allocated[0].container_id.clone();
        assert_eq!(used(&st).gpu_mask, 0x1);
        let e = end_container(&mut st, &cid, Ending::Dead, 7, "gone", Tell::App).unwrap();
        assert_eq!((e.exit_status, e.was), (7, ContainerState::Allocated));
        assert_eq!(used(&st), Resources::default(), "GPU, port, CPU and memory all free");
        for how in [Ending::Dead, Ending::Stopped] {
            assert!(end_container(&mut st, &cid, how, 9, "again", Tell::App).is_none());
        }
        assert_eq!(used(&st), Resources::default());
        st.ledger.audit_usage().unwrap();
        let answer = allocate_asks(&mut st, &id, 1, vec![], vec![]).answer;
        assert_eq!(answer.completed.len(), 1, "told once: {answer:?}");
        assert_eq!(answer.completed[0].exit_status, 7);
        // The GPU and the port can be granted again.
        let again = allocate_asks(&mut st, &id, 2, vec![ask(2, 0x1, &[5000])], vec![]).answer;
        assert_eq!(again.allocated.len(), 1, "{again:?}");
    }

    /// A running container the RM stops stays held (its GPUs used) until its node reports
    /// it dead, and its application hears of it once, at the stop.
    #[test]
    fn a_stopped_running_container_is_held_until_its_node_reports_it_dead() {
        let m = state(Store::memory());
        let mut st = guard(&m);
        let id = app(&mut st);
        let granted = allocate_asks(&mut st, &id, 0, vec![ask(1, 0x2, &[])], vec![]).answer;
        let cid = granted.allocated[0].container_id.clone();
        let Start::Launch(grant) = start_container(&mut st, "n1", &cid, status(&cid)).unwrap() else {
            panic!("not launched");
        };
        assert_eq!((grant.app_id.as_str(), grant.user.as_str()), (id.as_str(), "alice"));
        let killed = kill_app(&mut st, &id, "alice").unwrap();
        assert!(killed.committed.is_ok());
        assert_eq!(killed.ended.len(), 1);
        assert_eq!(
            killed.ended[0].was,
            ContainerState::Running,
            "to be stopped on its node"
        );
        assert_eq!(used(&st).gpu_mask, 0x2, "held while its process may run");
        assert_eq!(st.apps.get(&id).unwrap().pending_completed.len(), 1);
        // The node reports it dead: freed, and not told twice.
        assert!(container_exited(&mut st, &cid, 137, "killed".into()).is_none());
        assert_eq!(used(&st), Resources::default());
        assert_eq!(st.apps.get(&id).unwrap().pending_completed.len(), 1);
        st.ledger.audit_usage().unwrap();
    }

    /// A start sent again after its container ran and ended (its first answer lost, say
    /// to an RM restart) answers what became of it: it is not refused as a failed launch,
    /// which would make the AM run the task a second time.
    #[test]
    fn a_start_sent_again_after_its_container_ended_answers_its_end() {
        let m = state(Store::memory());
        let mut st = guard(&m);
        let id = app(&mut st);
        let granted = allocate_asks(&mut st, &id, 0, vec![ask(1, 0x1, &[])], vec![]).answer;
        let cid = granted.allocated[0].container_id.clone();
        assert!(matches!(
            start_container(&mut st, "n1", &cid, status(&cid)).unwrap(),
            Start::Launch(_)
        ));
        assert!(matches!(
            start_container(&mut st, "n1", &cid, status(&cid)).unwrap(),
            Start::Again(_)
        ));
        assert!(container_exited(&mut st, &cid, 0, "exited with code 0".into()).is_some());
        match start_container(&mut st, "n1", &cid, status(&cid)) {
            Ok(Start::Again(_)) => {}
            Ok(Start::Launch(_)) => panic!("an ended container launched again"),
            Err(e) => panic!("refused, which the AM takes for a failed launch: {}", e.message),
        }
        // One never started that ended (it expired) is refused: nothing of it ran.
        let granted = allocate_asks(&mut st, &id, 1, vec![ask(2, 0x2, &[])], vec![]).answer;
        let never = granted.allocated[0].container_id.clone();
        expire(&mut st, Instant::now() + Duration::from_secs(61));
        assert!(start_container(&mut st, "n1", &never, status(&never)).is_err());
        st.ledger.audit_usage().unwrap();
    }

    /// An AM's release ends the container without telling the AM; a node made LOST ends
    /// the rest for their application; expiry takes back what was never started.
    #[test]
    fn releases_lost_nodes_and_expiry_end_through_the_one_door() {
        let m = state(Store::memory());
        let mut st = guard(&m);
        let id = app(&mut st);
        let asks = vec![ask(1, 0x1, &[]), ask(2, 0x2, &[])];
        let granted = allocate_asks(&mut st, &id, 0, asks, vec![]).answer;
        let (a, b) = (
            granted.allocated[0].container_id.clone(),
            granted.allocated[1].container_id.clone(),
        );
        let released = allocate_asks(&mut st, &id, 1, vec![], vec![a.clone()]);
        assert_eq!(released.ended.len(), 1);
        assert!(released.answer.completed.is_empty(), "the AM asked: not told back");
        assert_eq!(used(&st).gpu_mask, 0x2);
        let lost = set_node_state(&mut st, "n1", NodeState::Lost).unwrap();
        assert_eq!(lost.len(), 1);
        assert_eq!(lost[0].container_id, b);
        assert_eq!(used(&st), Resources::default(), "never started: freed at once");
        let answer = allocate_asks(&mut st, &id, 2, vec![], vec![]).answer;
        assert_eq!(answer.completed.len(), 1);
        assert_eq!(answer.completed[0].diagnostics, DIAG_LOST_NODE);
        assert!(set_node_state(&mut st, "nowhere", NodeState::Lost).is_none());

        set_node_state(&mut st, "n1", NodeState::Running).unwrap();
        let granted = allocate_asks(&mut st, &id, 3, vec![ask(3, 0x1, &[])], vec![]).answer;
        let c = granted.allocated[0].container_id.clone();
        assert!(expire(&mut st, Instant::now()).is_empty(), "not due yet");
        let ended = expire(&mut st, Instant::now() + Duration::from_secs(61));
        assert_eq!(ended.len(), 1);
        assert_eq!(ended[0].container_id, c);
        assert_eq!(used(&st), Resources::default());
        let answer = allocate_asks(&mut st, &id, 4, vec![], vec![]).answer;
        assert_eq!(answer.completed[0].diagnostics, crate::rm::ledger::DIAG_EXPIRED);
        st.ledger.audit_usage().unwrap();
    }

    /// A container under a preemption notice ends as preempted whichever way it ends: the
    /// AM's release (not told back), the deadline passing in the scheduling pass (its
    /// application told, once), and its node's report of the exit.
    #[test]
    fn a_preempted_container_ends_as_preempted_through_the_one_door() {
        let m = state(Store::memory());
        let mut st = guard(&m);
        let id = app(&mut st);
        let granted = allocate_asks(&mut st, &id, 0, vec![ask(1, 0x1, &[]), ask(2, 0x2, &[])], vec![]).answer;
        let (a, b) = (
            granted.allocated[0].container_id.clone(),
            granted.allocated[1].container_id.clone(),
        );
        start_container(&mut st, "n1", &b, status(&b)).unwrap();
        let now = Instant::now();
        for c in [&a, &b] {
            st.sched.preempting.insert(
                c.clone(),
                scheduling::Preempting {
                    app_id: id.clone(),
                    host: "n1".into(),
                    from_queue: "root.default".into(),
                    for_queue: "root.other".into(),
                    deadline: now,
                    deadline_ms: 1,
                    reason: "for another queue".into(),
                },
            );
        }
        let released = allocate_asks(&mut st, &id, 1, vec![], vec![a.clone()]);
        assert_eq!(released.ended[0].exit_status, exit_status::PREEMPTED);
        assert!(released.answer.completed.is_empty());
        let work = scheduling::tick(&mut st, now + Duration::from_secs(1));
        assert_eq!(work.ended.len(), 1, "the deadline passed");
        assert_eq!(work.ended[0].container_id, b);
        assert_eq!(work.ended[0].exit_status, exit_status::PREEMPTED);
        assert_eq!(used(&st).gpu_mask, 0x2, "held until its node reports it dead");
        assert!(container_exited(&mut st, &b, 143, "terminated".into()).is_none());
        assert_eq!(used(&st), Resources::default());
        let answer = allocate_asks(&mut st, &id, 2, vec![], vec![]).answer;
        assert_eq!(answer.completed.len(), 1, "told once: {answer:?}");
        assert_eq!(answer.completed[0].exit_status, exit_status::PREEMPTED);
        st.ledger.audit_usage().unwrap();
    }

    /// The scheduling pass hands its start estimates out to be walked off the state, one
    /// pass at a time, and writes what they found only for applications still waiting: one
    /// that started waiting behind a declared end is told that end; one that stopped
    /// waiting while the walks ran is told nothing; a failed walk writes nothing and lets the
    /// next pass be taken.
    #[test]
    fn start_estimates_are_walked_off_the_state_and_written_only_where_still_waiting() {
        use crate::protocol::WaitingTasks;
        let m = state(Store::memory());
        let now = Instant::now();
        let mut st = guard(&m);
        let holder = app(&mut st);
        let mut both = ask(1, 0x3, &[5000]);
        both.max_run_sec = Some(600);
        let granted = allocate_asks(&mut st, &holder, 0, vec![both], vec![]).answer;
        assert_eq!(granted.allocated.len(), 1);
        let waits = WaitingTasks {
            role: "w".into(),
            count: 1,
            gpus: 1,
            cpu: 1,
            memory_mb: 10,
            max_run_sec: Some(60),
            ..Default::default()
        };
        let (stays, leaves) = (app(&mut st), app(&mut st));
        for id in [&stays, &leaves] {
            st.apps.get_mut(id).unwrap().waiting.report(vec![waits.clone()], now);
        }
        let pass = scheduling::tick(&mut st, now).estimates.expect("estimates are due");
        assert!(st.sched.estimating);
        assert!(
            scheduling::tick(&mut st, now + Duration::from_secs(5))
                .estimates
                .is_none(),
            "one pass out at a time"
        );
        drop(st);
        // The walks need nothing of the state: it is free while they run.
        let walked = pass.walk();
        let mut st = guard(&m);
        st.apps.get_mut(&leaves).unwrap().waiting.report(Vec::new(), now);
        scheduling::estimated(&mut st, Some(walked));
        assert!(!st.sched.estimating);
        let told = st
            .apps
            .get(&stays)
            .unwrap()
            .waiting
            .estimate
            .clone()
            .expect("still waiting: told");
        let end = st.ledger.container(&granted.allocated[0].container_id).unwrap();
        let declared = end.declared_end_ms().expect("a declared limit");
        assert!(
            told.start_ms.is_some_and(|s| s.abs_diff(declared) <= 60_000),
            "starts when the holder's declared end frees the GPUs: {told:?}, end {declared}"
        );
        assert!(
            st.apps.get(&leaves).unwrap().waiting.estimate.is_none(),
            "no longer waits: told nothing"
        );
        // A failed walk writes nothing, and the next pass comes when due.
        let due = now + Duration::from_secs(2);
        let pass = scheduling::tick(&mut st, due).estimates.expect("due again");
        drop(pass);
        scheduling::estimated(&mut st, None);
        assert!(!st.sched.estimating);
        assert_eq!(st.apps.get(&stays).unwrap().waiting.estimate, Some(told));
        assert!(scheduling::tick(&mut st, due).estimates.is_some());
    }

    /// A removed host frees everything on it once: a running container ends for its
    /// application (told once), a held one is freed without a second report; the admin's
    /// refusals (a cluster-file host; running containers without force; wiping a RUNNING
    /// node) change nothing.
    #[test]
    fn removing_or_wiping_a_host_frees_what_it_holds_once() {
        let m = state(Store::memory());
        let mut st = guard(&m);
        let id = app(&mut st);
        let conflict = |r: Result<Vec<Ended>, ApiError>| r.err().map(|e| e.status);
        assert_eq!(
            conflict(remove_host(&mut st, "n1", true, None, 1)),
            Some(StatusCode::CONFLICT),
            "a cluster-file host"
        );
        st.agent_nodes.insert("n1".into(), "{}".into());
        let granted = allocate_asks(&mut st, &id, 0, vec![ask(1, 0x1, &[]), ask(2, 0x2, &[])], vec![]).answer;
        let (a, b) = (
            granted.allocated[0].container_id.clone(),
            granted.allocated[1].container_id.clone(),
        );
        for c in [&a, &b] {
            start_container(&mut st, "n1", c, status(c)).unwrap();
        }
        assert_eq!(
            wipe_host(&mut st, "n1").err().map(|e| e.status),
            Some(StatusCode::CONFLICT),
            "RUNNING"
        );
        // `a` was stopped before (held: its process may run); `b` still runs.
        stop_container(&mut st, &a, status(&a)).unwrap();
        assert_eq!(
            conflict(remove_host(&mut st, "n1", false, None, 1)),
            Some(StatusCode::CONFLICT),
            "runs a container, no force"
        );
        assert_eq!(used(&st).gpu_mask, 0x3);
        let ended = remove_host(&mut st, "n1", true, Some("fp".into()), 1).unwrap();
        assert_eq!(ended.len(), 1);
        assert_eq!(ended[0].container_id, b);
        assert!(st.ledger.node("n1").is_none());
        assert!(st.removed_hosts.contains_key("n1"));
        let told: Vec<String> = st
            .apps
            .get(&id)
            .unwrap()
            .pending_completed
            .iter()
            .map(|c| c.container_id.clone())
            .collect();
        assert_eq!(told, [a.clone(), b.clone()], "each told once");
        // What the node says later frees nothing twice.
        assert!(container_exited(&mut st, &a, 0, String::new()).is_none());
        assert!(container_exited(&mut st, &b, 0, String::new()).is_none());
        st.ledger.audit_usage().unwrap();
    }

    /// Each transaction commits before it returns: nothing it changed is left for the
    /// guard's safety net (still held here), and what it answered is what a restarted RM
    /// reads back from the file.
    #[test]
    fn what_a_transaction_answers_is_stored_before_it_returns() {
        let dir = tempfile::tempdir().unwrap();
        let m = state(Store::open(dir.path()).unwrap());
        let uncommitted = |st: &StateGuard| st.ledger.has_changes() || st.apps.has_changes() || st.meta_dirty;
        let mut st = guard(&m);
        let id = app(&mut st);
        assert!(!uncommitted(&st));
        let granted = allocate_asks(&mut st, &id, 0, vec![ask(1, 0x1, &[]), ask(2, 0x2, &[])], vec![]);
        assert!(granted.committed.is_ok());
        assert!(!uncommitted(&st), "the grants are stored before they are answered");
        let (a, b) = (
            granted.answer.allocated[0].container_id.clone(),
            granted.answer.allocated[1].container_id.clone(),
        );
        start_container(&mut st, "n1", &a, status(&a)).unwrap();
        assert!(!uncommitted(&st), "RUNNING is stored before the process exists");
        let done = stop_container(&mut st, &b, status(&b)).unwrap();
        assert!(done.committed.is_ok() && !uncommitted(&st));
        let done = finish(
            &mut st,
            &id,
            FinishRequest {
                final_status: FinalStatus::Succeeded,
                exit_code: 0,
                diagnostics: String::new(),
            },
        )
        .unwrap();
        assert!(done.committed.is_ok() && !uncommitted(&st));
        container_exited(&mut st, &a, 0, String::new());
        assert!(!uncommitted(&st));
        drop(st);
        drop(m);
        let r = Store::open(dir.path()).unwrap().recover().unwrap().unwrap();
        let state_of = |cid: &str| {
            r.containers
                .iter()
                .find(|c| c.container.container_id == cid)
                .map(|c| (c.state, c.held))
        };
        assert_eq!(state_of(&a), Some((ContainerState::Complete, false)));
        assert_eq!(state_of(&b), Some((ContainerState::Complete, false)));
        let app = r.apps.iter().find(|x| x.report.id == id).unwrap();
        assert_eq!(app.report.state, AppState::Finished);
    }
}
