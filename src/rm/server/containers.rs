//! The RM-side container endpoints (DESIGN.md §3 start / stop / status / logs). Every
//! node's `nodeHTTPAddress` in the RM's view is the RM itself: it checks the caller's
//! application token against the ledger, marks the container RUNNING before its process
//! exists, and forwards to the host's node backend (in-process, agent or Ray,
//! `crate::node::NodeBackend`). Also the stops of ended containers through their node.
//! What a start or a stop changes in the state is a transaction of `transactions`.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;

use super::http::{authenticate, authorize, check_container_id, unknown_to, ApiError, ApiJson};
use super::state::RmState;
use super::transactions::{self, Start};
use super::{Rm, Shared};
use crate::node::executor::LogStream;
use crate::protocol::{
    ContainerState, ContainerStatus, LaunchContext, StartContainers, StartError, StartResult, StartedContainers,
    MAX_STARTS_PER_CALL,
};
use crate::rm::apps::App;
use crate::rm::ledger::Ended;

/// SIGTERM → SIGKILL grace for containers the RM stops.
pub const CONTAINER_STOP_GRACE: Duration = Duration::from_secs(3);

/// Stops the started ones among `ended` in the background, so heartbeats and
/// finish answers never wait for a process's grace period.
pub(super) fn spawn_stops(shared: &Arc<Shared>, ended: Vec<Ended>) {
    if ended.iter().any(|e| e.was == ContainerState::Running) {
        let shared = shared.clone();
        tokio::spawn(async move { stop_running(&shared, &ended).await });
    }
}

/// Stops, through the executor, the ended containers that had been started.
pub(super) async fn stop_running(shared: &Shared, ended: &[Ended]) {
    let stops = ended
        .iter()
        .filter(|e| e.was == ContainerState::Running)
        .map(|e| async move {
            let node = shared.nodes.for_host(&e.host);
            if let Err(err) = node.stop(&e.host, &e.container_id, CONTAINER_STOP_GRACE).await {
                tracing::warn!(container = %e.container_id, "stop failed: {err}");
            }
        });
    futures::future::join_all(stops).await;
}

/// Checks that `id` is a container on `host` and that the caller holds its app's token.
pub(super) fn container_access(
    st: &RmState,
    host: &str,
    id: &str,
    headers: &HeaderMap,
) -> Result<ContainerInfo, ApiError> {
    // Only an application's own token opens these routes, so an unknown container (or one
    // on another host) answers as a wrong token does: nobody learns which exist, or where.
    container_info(
        st,
        host,
        id,
        |app| authorize(app, headers),
        |_| ApiError::unauthorized(),
    )
}

/// The container `id` on `host`, if `allowed` accepts its application; `missing` says what
/// the caller is told when there is no such container (or it is of no application), given
/// the error of "not found". One on another host is "not found" only for a caller
/// `allowed` accepts; any other caller gets `allowed`'s answer, as for one on this host.
fn container_info(
    st: &RmState,
    host: &str,
    id: &str,
    allowed: impl FnOnce(&App) -> Result<(), ApiError>,
    missing: impl FnOnce(ApiError) -> ApiError,
) -> Result<ContainerInfo, ApiError> {
    check_container_id(id)?;
    let not_found = || ApiError::not_found(format!("no container `{id}` on host `{host}`"));
    let found = st.ledger.container(id).and_then(|c| Some((c, st.apps.get(&c.app_id)?)));
    let Some((c, app)) = found else {
        return Err(missing(not_found()));
    };
    // Whose it is first: only its own caller learns that it runs elsewhere.
    allowed(app)?;
    if c.container.host != host {
        return Err(not_found());
    }
    Ok(ContainerInfo {
        state: c.state,
        status: ContainerStatus {
            container_id: id.to_string(),
            state: c.state,
            exit_status: c.exit_status,
            diagnostics: c.diagnostics.clone(),
            pid: None,
            started_ms: None,
        },
    })
}

pub(super) struct ContainerInfo {
    pub(super) state: ContainerState,
    pub(super) status: ContainerStatus,
}

pub(super) async fn container_start(
    State(rm): Rm,
    UrlPath((host, id)): UrlPath<(String, String)>,
    headers: HeaderMap,
    ApiJson(ctx): ApiJson<LaunchContext>,
) -> Result<Json<ContainerStatus>, ApiError> {
    start_one(&rm, &host, &id, &headers, ctx).await.map(Json)
}

/// `POST /ws/v1/node/containers/start`: several starts in one call, each checked and
/// started as [`container_start`] does one, all at once; one result per start, in order.
pub(super) async fn containers_start(
    State(rm): Rm,
    headers: HeaderMap,
    ApiJson(req): ApiJson<StartContainers>,
) -> Result<Json<StartedContainers>, ApiError> {
    if req.containers.len() > MAX_STARTS_PER_CALL {
        return Err(ApiError::bad_request(format!(
            "{} starts in one call; at most {MAX_STARTS_PER_CALL} (send the rest in another)",
            req.containers.len()
        )));
    }
    let starts = req.containers.into_iter().map(|s| {
        let (rm, headers) = (&rm, &headers);
        async move {
            let result = start_one(rm, &s.host, &s.container_id, headers, s.context).await;
            let (status, error) = match result {
                Ok(status) => (Some(status), None),
                Err(e) => (
                    None,
                    Some(StartError {
                        status: e.status.as_u16(),
                        code: e.code.to_string(),
                        message: e.message,
                    }),
                ),
            };
            StartResult {
                container_id: s.container_id,
                status,
                error,
            }
        }
    });
    let results = futures::future::join_all(starts).await;
    Ok(Json(StartedContainers { results }))
}

/// One start: the caller must be the container's AM; a repeated start answers the
/// container's status; a failed launch ends the container (stopped where it may run).
async fn start_one(
    rm: &Arc<Shared>,
    host: &str,
    id: &str,
    headers: &HeaderMap,
    ctx: LaunchContext,
) -> Result<ContainerStatus, ApiError> {
    let grant = {
        let mut st = rm.lock();
        let info = container_access(&st, host, id, headers)?;
        match transactions::start_container(&mut st, host, id, info.status)? {
            Start::Again(status) => return Ok(status),
            Start::Launch(grant) => grant,
        }
    };
    let node = rm.nodes.for_host(host);
    match node.start(grant, ctx).await {
        Ok(status) => Ok(status),
        Err(e) => {
            let why = format!("launch failed: {e}");
            // A node that may have started the container before its answer was lost: stop
            // it there (a node that runs it kills it, one that never got the start refuses
            // it from now on; either way it reports the container dead).
            let may_run = node.start_may_survive(&e);
            let to_stop = transactions::launch_failed(&mut rm.lock(), id, may_run, &why);
            spawn_stops(rm, to_stop.into_iter().collect());
            Err(e.into())
        }
    }
}

pub(super) async fn container_stop(
    State(rm): Rm,
    UrlPath((host, id)): UrlPath<(String, String)>,
    headers: HeaderMap,
) -> Result<Json<ContainerStatus>, ApiError> {
    let done = {
        let mut st = rm.lock();
        let info = container_access(&st, &host, &id, &headers)?;
        transactions::stop_container(&mut st, &id, info.status)?
    };
    stop_running(&rm, &done.ended).await;
    done.committed?;
    Ok(Json(done.answer))
}

pub(super) async fn container_status(
    State(rm): Rm,
    UrlPath((host, id)): UrlPath<(String, String)>,
    headers: HeaderMap,
) -> Result<Json<ContainerStatus>, ApiError> {
    let info = container_access(&rm.lock(), &host, &id, &headers)?;
    // The executor knows the pid and the real exit; the ledger knows RM-side endings.
    let status = match rm.nodes.for_host(&host).status(&host, &id).await {
        Some(s) if info.state != ContainerState::Complete || s.state == ContainerState::Complete => s,
        _ => info.status,
    };
    Ok(Json(status))
}

#[derive(Deserialize)]
pub(super) struct LogsQuery {
    pub(super) stream: Option<String>,
    pub(super) tail: Option<u64>,
}

pub(super) async fn container_logs(
    State(rm): Rm,
    UrlPath((host, id)): UrlPath<(String, String)>,
    Query(q): Query<LogsQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    // The AM (its application token), the application's owner, or the admin.
    let caller = authenticate(&rm, &headers);
    // The user routes' rule for an unknown id (`unknown_to`), as for applications.
    container_info(
        &rm.lock(),
        &host,
        &id,
        |app| match authorize(app, &headers) {
            Ok(()) => Ok(()),
            Err(not_the_am) => match &caller {
                Ok(c) => c.must_own(app),
                Err(_) => Err(not_the_am),
            },
        },
        |not_found| unknown_to(&caller, not_found, |_| ApiError::unauthorized()),
    )?;
    let stream = log_stream(q.stream.as_deref())?;
    let text = rm.nodes.for_host(&host).read_log(&host, &id, stream, q.tail).await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response())
}

/// The `stream` query parameter (stdout when absent); 400 for anything else.
pub(super) fn log_stream(q: Option<&str>) -> Result<LogStream, ApiError> {
    match q.unwrap_or("stdout") {
        "stdout" => Ok(LogStream::Stdout),
        "stderr" => Ok(LogStream::Stderr),
        other => Err(ApiError::bad_request(format!(
            "`stream` must be stdout or stderr, not `{other}`"
        ))),
    }
}
