//! The AM protocol (YARN's ApplicationMasterProtocol over REST): register, allocate
//! (grants, rejections, releases, completions, updated nodes; idempotent by `responseId`)
//! and finish.

use super::dashboard::Refusal;
use super::*;
use crate::cluster::rm_json::NodeReport;
use crate::protocol::Rejection;

pub(super) async fn am_register(
    State(rm): Rm,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<RegisterRequest>,
) -> Result<Json<RegisterResponse>, ApiError> {
    let mut st = rm.lock();
    authorize_app(&st.apps, &id, &headers)?;
    st.writable()?;
    let epoch = st.ledger.epoch();
    let max = st.ledger.max_capability();
    let expiry = st.ledger.expiry().as_secs();
    let app = app_mut(&mut st.apps, &id)?;
    if app.report.state.is_final() {
        return Err(ApiError::conflict(format!(
            "application `{id}` is already {:?}",
            app.report.state
        )));
    }
    // Registering again (a retried request, or a resync after an RM restart) is harmless.
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
        .containers_of(&id)
        .into_iter()
        .map(|c| PreviousContainer {
            container: c.container.clone(),
            state: c.state,
            exit_status: c.exit_status,
            diagnostics: c.diagnostics.clone(),
        })
        .collect();
    st.commit()?;
    Ok(Json(RegisterResponse {
        maximum_capability: max,
        containers_from_previous_attempts: previous,
        attempt,
        container_expiry_sec: expiry,
    }))
}

pub(super) async fn am_allocate(
    State(rm): Rm,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<AllocateRequest>,
) -> Result<Json<AllocateResponse>, ApiError> {
    let started = Instant::now();
    if let Some(w) = &req.waiting {
        scheduling::check_waiting(w).map_err(ApiError::bad_request)?;
    }
    if req.asks.len() > rm.limits.max_asks_per_allocate {
        return Err(ApiError::limit(
            "rm.max_asks_per_allocate",
            rm.limits.max_asks_per_allocate,
            &format!("{} asks in one allocate request", req.asks.len()),
        ));
    }
    let (answer, ended, committed) = {
        let mut guard = rm.lock();
        authorize_app(&guard.apps, &id, &headers)?;
        // Nothing is granted while the store fails; a replayed answer was stored already.
        guard.writable()?;
        let st = &mut *guard;
        let app = app_mut(&mut st.apps, &id)?;
        if let Some((last_req, last)) = &app.last_allocate {
            if req.response_id == *last_req {
                return Ok(Json(last.clone()));
            }
            if req.response_id != last.response_id {
                return Err(ApiError::bad_request(format!(
                    "responseId {} is out of order: the last answer was {}",
                    req.response_id, last.response_id
                )));
            }
        }
        let num_cluster_nodes = st.ledger.node_count() as u32;
        let mut out = AllocateResponse {
            response_id: req.response_id.wrapping_add(1),
            num_cluster_nodes,
            ..Default::default()
        };
        if app.shutdown || app.report.state.is_final() {
            out.command = Some(AmCommand::Shutdown);
            out.completed = std::mem::take(&mut app.pending_completed);
            app.last_allocate = Some((req.response_id, out.clone()));
            guard.commit()?;
            return Ok(Json(out));
        }
        if !app.registered {
            // Not registered (never, or not since this RM restarted): YARN's AM_RESYNC.
            // Nothing in this request is acted on; the AM registers and sends it again.
            out.command = Some(AmCommand::Resync);
            return Ok(Json(out));
        }
        app.report.progress = req.progress.clamp(0.0, 1.0);
        let attempt = app.report.attempt;

        let now = Instant::now();
        if let Some(w) = req.waiting.clone() {
            app.waiting.report(w, now);
            app.waiting.placement = req.wait_reason.clone();
        }
        // Releases: freed now, not reported back (the AM asked for it). A container under
        // a preemption notice ends as preempted.
        let mut ended = Vec::new();
        for cid in &req.releases {
            match st.ledger.container(cid) {
                Some(c) if c.app_id == id => {
                    let (exit, why) = match st.sched.preempting.get(cid) {
                        Some(p) => (exit_status::PREEMPTED, scheduling::preempted_diagnostics(p)),
                        None => (exit_status::ABORTED, "Container released by application".to_string()),
                    };
                    if let Some(e) = st.ledger.stop(cid, exit, &why) {
                        ended.push(e);
                    }
                }
                _ => {
                    tracing::debug!(app = %id, container = %cid, "release of a container this app does not hold")
                }
            }
        }
        // Cancels need no work: asks never stay pending (see the module doc). Each ask, or
        // each gang of asks, passes the queue gate first, then the ledger.
        for group in scheduling::group_asks(&req.asks) {
            if let Err(why) = scheduling::admit(st, &id, &group, now) {
                rm.metrics.refused(Refusal::Queue, group.len());
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
                match st.ledger.grant(&id, attempt, ask, now) {
                    Ok(c) => out.allocated.push(c),
                    Err(r) => {
                        rm.metrics
                            .refused(if r.retryable { Refusal::Busy } else { Refusal::Never }, 1);
                        out.rejected.push(r)
                    }
                }
            }
            if group.len() > 1 && out.allocated.len() - granted_before < group.len() {
                // A gang is granted whole or not at all (its fit was checked above under
                // the same lock, so this does not happen; if it ever did, undo it).
                for c in out.allocated.drain(granted_before..) {
                    st.ledger
                        .complete(&c.container_id, exit_status::ABORTED, "gang not granted whole");
                    out.rejected.push(Rejection {
                        request_id: c.request_id,
                        reason: "gang not granted whole".into(),
                        retryable: true,
                        wait: None,
                    });
                }
            }
        }
        rm.metrics.granted(out.allocated.len());
        out.preempt = scheduling::notices_for(st, &id);
        let app = app_mut(&mut st.apps, &id)?;
        out.waiting_reason = app.waiting.why.as_ref().map(|(_, t)| t.clone());
        out.wait_reason = app.waiting.queue_reason();
        out.completed = std::mem::take(&mut app.pending_completed);
        out.updated_nodes = st
            .ledger
            .changed_since(app.nodes_seen)
            .map(|(n, c)| NodeReport {
                node: n.clone(),
                num_containers: c,
                last_health_update_ms: now_ms(),
            })
            .collect();
        app.nodes_seen = st.ledger.epoch();
        app.last_allocate = Some((req.response_id, out.clone()));
        (out, ended, guard.commit())
    };
    // Released containers are stopped either way; grants are acknowledged only when stored
    // (a retry of this responseId gets the same answer once the store takes it).
    spawn_stops(&rm, ended);
    rm.metrics.allocate_took(started.elapsed());
    committed?;
    Ok(Json(answer))
}

pub(super) async fn am_finish(
    State(rm): Rm,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<FinishRequest>,
) -> Result<Json<FinishResponse>, ApiError> {
    let (ended, committed) = {
        let mut st = rm.lock();
        authorize_app(&st.apps, &id, &headers)?;
        st.writable()?;
        let app = app_mut(&mut st.apps, &id)?;
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
        let ended = release_all(
            &mut st,
            &id,
            exit_status::KILLED_AFTER_APP_COMPLETION,
            "Container killed after the application finished",
        );
        (ended, st.commit())
    };
    spawn_stops(&rm, ended);
    committed?;
    Ok(Json(FinishResponse { is_unregistered: true }))
}
