//! JSON handlers of the status API (`/api/v1/...`), the kill action and the health
//! probes. Pages are serialized straight from the hub under its read lock, so a request
//! never copies the whole snapshot.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use super::{json_bytes, json_ok, ApiError};
use crate::am::status::{Command, NodeStatus, SelectionRecord, StatusHub, TaskState, TaskStatus};
use crate::protocol::now_ms;

pub(crate) type Hub = State<Arc<StatusHub>>;
pub(crate) type Params = Query<HashMap<String, String>>;

/// Default and largest page sizes for lists.
const DEFAULT_LIMIT: usize = 100;
const MAX_LIMIT: usize = 1000;
/// Default and largest log tails in bytes.
const DEFAULT_TAIL: u64 = 64 * 1024;
const MAX_TAIL: u64 = 8 * 1024 * 1024;
/// A node view older than this makes the AM not ready.
const READY_MAX_REFRESH_AGE_MS: u64 = 30_000;

/// Parses an optional non-negative integer query parameter.
fn param_usize(q: &HashMap<String, String>, name: &str) -> Result<Option<usize>, ApiError> {
    match q.get(name) {
        None => Ok(None),
        Some(v) if v.is_empty() => Ok(None),
        Some(v) => v.parse::<usize>().map(Some).map_err(|_| {
            ApiError::bad_request(
                "invalid_parameter",
                format!("query parameter `{name}` must be a non-negative integer, got {v:?}"),
            )
        }),
    }
}

fn param_str<'a>(q: &'a HashMap<String, String>, name: &str) -> Option<&'a str> {
    q.get(name).map(|s| s.as_str()).filter(|s| !s.is_empty())
}

/// offset and limit (default 100, at most 1000).
fn paging(q: &HashMap<String, String>) -> Result<(usize, usize), ApiError> {
    let offset = param_usize(q, "offset")?.unwrap_or(0);
    let limit = param_usize(q, "limit")?.unwrap_or(DEFAULT_LIMIT);
    if limit > MAX_LIMIT {
        return Err(ApiError::bad_request(
            "invalid_parameter",
            format!("query parameter `limit` must be at most {MAX_LIMIT}, got {limit}; page with `offset`"),
        ));
    }
    Ok((offset, limit))
}

/// The wire name of a task state ("CONTAINER_RUNNING").
pub(crate) fn state_name(s: TaskState) -> &'static str {
    match s {
        TaskState::TaskWaiting => "TASK_WAITING",
        TaskState::ContainerRequested => "CONTAINER_REQUESTED",
        TaskState::ContainerAllocated => "CONTAINER_ALLOCATED",
        TaskState::ContainerLaunched => "CONTAINER_LAUNCHED",
        TaskState::ContainerRunning => "CONTAINER_RUNNING",
        TaskState::ContainerCompleted => "CONTAINER_COMPLETED",
        TaskState::TaskCompleted => "TASK_COMPLETED",
    }
}

fn parse_state(v: &str) -> Result<TaskState, ApiError> {
    TaskState::ALL
        .iter()
        .copied()
        .find(|s| state_name(*s).eq_ignore_ascii_case(v))
        .ok_or_else(|| {
            let all: Vec<&str> = TaskState::ALL.iter().map(|s| state_name(*s)).collect();
            ApiError::bad_request(
                "invalid_parameter",
                format!("query parameter `state` must be one of {}, got {v:?}", all.join(", ")),
            )
        })
}

fn parse_index(index: &str) -> Result<u32, ApiError> {
    index.parse::<u32>().map_err(|_| {
        ApiError::bad_request(
            "invalid_parameter",
            format!("task index must be a non-negative integer, got {index:?}"),
        )
    })
}

fn task_not_found(role: &str, index: u32) -> ApiError {
    ApiError::not_found(
        "task_not_found",
        format!("no task {role}/{index} in this job (see GET /api/v1/tasks)"),
    )
}

#[derive(Serialize)]
struct Page<'a, T> {
    total: usize,
    offset: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    tasks: Option<Vec<&'a T>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    nodes: Option<Vec<&'a T>>,
}

pub(crate) async fn livez() -> Response {
    json_ok(&serde_json::json!({"live": true}))
}

pub(crate) async fn readyz(State(hub): Hub) -> Response {
    let (registered, reachable, refreshed) = hub.read(|s| (s.registered, s.rm_reachable, s.nodes_refreshed_ms));
    let mut reasons = Vec::new();
    if !registered {
        reasons.push("the AM is not registered with the RM yet".to_string());
    }
    if !reachable {
        reasons.push("the RM is not reachable".to_string());
    }
    let now = now_ms();
    if refreshed == 0 {
        reasons.push("the node view has not been refreshed yet".to_string());
    } else if now.saturating_sub(refreshed) > READY_MAX_REFRESH_AGE_MS {
        reasons.push(format!(
            "the node view is {} s old (limit {} s)",
            now.saturating_sub(refreshed) / 1000,
            READY_MAX_REFRESH_AGE_MS / 1000
        ));
    }
    if reasons.is_empty() {
        json_ok(&serde_json::json!({"ready": true}))
    } else {
        let body = serde_json::json!({
            "code": "not_ready",
            "message": reasons.join("; "),
            "reasons": reasons,
        });
        json_bytes(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::to_vec(&body).unwrap_or_default(),
        )
    }
}

/// Adds `X-Last-Event-Id` (taken before the read) so that the page can open the event
/// stream right after this state without missing a change.
fn with_event_id(last: u64, mut r: Response) -> Response {
    if let Ok(v) = HeaderValue::from_str(&last.to_string()) {
        r.headers_mut().insert("x-last-event-id", v);
    }
    r
}

pub(crate) async fn job(State(hub): Hub) -> Response {
    let last = hub.last_event_id();
    with_event_id(last, hub.read(|s| json_ok(&s.job)))
}

pub(crate) async fn config(State(hub): Hub) -> Response {
    hub.read(|s| json_ok(&s.config))
}

/// Everything the AM publishes; `?nodes=0` leaves out the node view (what pollers of the
/// job and its tasks do: in an AM the view is built from its live one for each request).
pub(crate) async fn snapshot(State(hub): Hub, Query(q): Params) -> Response {
    let with_nodes = match param_str(&q, "nodes") {
        None | Some("1") => true,
        Some("0") => false,
        Some(other) => {
            return ApiError::bad_request(
                "invalid_parameter",
                format!("query parameter `nodes` must be 0 or 1, got {other:?}"),
            )
            .into_response()
        }
    };
    let last = hub.last_event_id();
    let live = hub.node_source.get().filter(|_| with_nodes).map(|source| {
        let job_gpus = hub.read(|s| crate::am::status::job_gpus(&s.tasks));
        source.page(None, 0, usize::MAX, &job_gpus).1
    });
    with_event_id(
        last,
        hub.read(|s| {
            let nodes = with_nodes.then(|| live.as_deref().unwrap_or(&s.nodes));
            json_ok(&crate::am::status::SnapshotOut { snapshot: s, nodes })
        }),
    )
}

pub(crate) async fn tasks(State(hub): Hub, Query(q): Params) -> Response {
    let run = || -> Result<Response, ApiError> {
        let (offset, limit) = paging(&q)?;
        let role = param_str(&q, "role");
        let state = param_str(&q, "state").map(parse_state).transpose()?;
        let host = param_str(&q, "host");
        Ok(hub.read(|s| {
            let keep = |t: &&TaskStatus| {
                role.is_none_or(|r| t.role == r)
                    && state.is_none_or(|st| t.state == st)
                    && host.is_none_or(|h| t.host.as_deref().is_some_and(|th| th.contains(h)))
            };
            let (total, page) = crate::am::status::page_of(s.tasks.iter().filter(keep), offset, limit);
            json_ok(&Page::<TaskStatus> {
                total,
                offset,
                tasks: Some(page),
                nodes: None,
            })
        }))
    };
    run().unwrap_or_else(|e| e.into_response())
}

pub(crate) async fn task(State(hub): Hub, Path((role, index)): Path<(String, String)>) -> Response {
    let index = match parse_index(&index) {
        Ok(i) => i,
        Err(e) => return e.into_response(),
    };
    hub.read(|s| match s.tasks.iter().find(|t| t.role == role && t.index == index) {
        Some(t) => json_ok(t),
        None => task_not_found(&role, index).into_response(),
    })
}

pub(crate) async fn task_logs(
    State(hub): Hub,
    Path((role, index)): Path<(String, String)>,
    Query(q): Params,
) -> Response {
    let run = async {
        let index = parse_index(&index)?;
        let stream = param_str(&q, "stream").unwrap_or("stdout");
        if stream != "stdout" && stream != "stderr" {
            return Err(ApiError::bad_request(
                "invalid_parameter",
                format!("query parameter `stream` must be stdout or stderr, got {stream:?}"),
            ));
        }
        let tail = match q.get("tail").filter(|v| !v.is_empty()) {
            None => DEFAULT_TAIL,
            Some(v) => v.parse::<u64>().map_err(|_| {
                ApiError::bad_request(
                    "invalid_parameter",
                    format!("query parameter `tail` must be a byte count, got {v:?}"),
                )
            })?,
        }
        .min(MAX_TAIL);
        let container = hub.read(|s| {
            s.tasks
                .iter()
                .find(|t| t.role == role && t.index == index)
                .map(|t| t.container_id.clone())
        });
        let container = match container {
            None => return Err(task_not_found(&role, index)),
            Some(None) => {
                return Err(ApiError::not_found(
                    "no_container",
                    format!("task {role}/{index} has no container yet, so no logs"),
                ))
            }
            Some(Some(c)) => c,
        };
        let text = hub.logs.read(&container, stream, tail).await.map_err(|e| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                "logs_unavailable",
                format!("could not read {stream} of container {container}: {e}"),
            )
        })?;
        let mut r = text.into_response();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        r.headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        Ok(r)
    };
    run.await.unwrap_or_else(|e| e.into_response())
}

pub(crate) async fn nodes(State(hub): Hub, Query(q): Params) -> Response {
    let run = || -> Result<Response, ApiError> {
        let (offset, limit) = paging(&q)?;
        let host = param_str(&q, "host");
        if let Some(source) = hub.node_source.get() {
            // An AM: the page from its live view.
            let job_gpus = hub.read(|s| crate::am::status::job_gpus(&s.tasks));
            let (total, page) = source.page(host, offset, limit, &job_gpus);
            return Ok(json_ok(&Page::<NodeStatus> {
                total,
                offset,
                tasks: None,
                nodes: Some(page.iter().collect()),
            }));
        }
        Ok(hub.read(|s| {
            let keep = |n: &&NodeStatus| host.is_none_or(|h| n.host.contains(h));
            let (total, page) = crate::am::status::page_of(s.nodes.iter().filter(keep), offset, limit);
            json_ok(&Page::<NodeStatus> {
                total,
                offset,
                tasks: None,
                nodes: Some(page),
            })
        }))
    };
    run().unwrap_or_else(|e| e.into_response())
}

pub(crate) async fn selections(State(hub): Hub, Query(q): Params) -> Response {
    let run = || -> Result<Response, ApiError> {
        let role = param_str(&q, "role");
        let index = match param_str(&q, "index") {
            Some(i) => Some(parse_index(i)?),
            None => None,
        };
        let limit = param_usize(&q, "limit")?.unwrap_or(20).min(MAX_LIMIT);
        Ok(hub.read(|s| {
            let recs: Vec<&SelectionRecord> = s
                .selections
                .iter()
                .rev()
                .filter(|r| role.is_none_or(|x| r.role == x) && index.is_none_or(|i| r.index == i))
                .take(limit)
                .collect();
            json_ok(&serde_json::json!({ "selections": recs }))
        }))
    };
    run().unwrap_or_else(|e| e.into_response())
}

pub(crate) async fn kill(State(hub): Hub, headers: HeaderMap) -> Response {
    let presented = crate::auth::bearer(&headers);
    // The job token, or a page ticket of this job (made with it: what an open page holds),
    // whose user the kill is written down as.
    let ticket_user =
        presented.and_then(|t| crate::auth::page_ticket_user(&hub.job_token, t, crate::protocol::now_ms() / 1000));
    let ok = match presented {
        Some(t) => {
            (!hub.job_token.is_empty() && crate::auth::constant_time_eq(t.as_bytes(), hub.job_token.as_bytes()))
                || ticket_user.is_some()
        }
        None => false,
    };
    // Not the job token: the owner's or the admin's user token, which the RM judges; asked
    // through the dashboard's own check first (remembered, bounded), so that strangers'
    // tokens cannot make every AM call the RM's kill.
    if let (false, Some(token), Some(rm)) = (ok, presented, hub.rm.get()) {
        return match super::access::may_access(&hub, Some(token)).await {
            super::access::Access::Granted => kill_through_rm(&hub, rm, token).await,
            other => super::access::not_granted(other, "killing the job"),
        };
    }
    if !ok {
        // The presented value is deliberately not logged.
        tracing::warn!("dashboard kill refused: missing or wrong token");
        return super::access::refused("killing the job");
    }
    let state = hub.read(|s| s.job.state);
    if state.is_final() {
        return ApiError::new(
            StatusCode::CONFLICT,
            "job_final",
            format!("the job has already ended ({state:?}); nothing to kill"),
        )
        .into_response();
    }
    let reason = match ticket_user.as_deref() {
        Some(who) if !who.is_empty() => format!("killed from the dashboard by {who}"),
        _ => "killed from the dashboard".to_string(),
    };
    if !hub.command(Command::Kill { reason }) {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "control_loop_gone",
            "the AM's control loop has stopped; the job is ending",
        )
        .into_response();
    }
    tracing::info!("dashboard kill accepted");
    let mut r = json_ok(&serde_json::json!({"accepted": true}));
    *r.status_mut() = StatusCode::ACCEPTED;
    r
}

/// The dashboard's kill with a user's token: the RM kills the job if the token is its
/// owner's or the admin's (the AM then hears SHUTDOWN), and its refusal is the answer.
async fn kill_through_rm(hub: &StatusHub, rm: &crate::am::rm_client::RmClient, token: &str) -> Response {
    let app_id = hub.read(|s| s.job.app_id.clone());
    match rm.kill(&app_id, token).await {
        Ok(_) => {
            tracing::info!("dashboard kill accepted by the RM (a user's token)");
            let mut r = json_ok(&serde_json::json!({"accepted": true}));
            *r.status_mut() = StatusCode::ACCEPTED;
            r
        }
        Err(e) => {
            let status = e
                .status()
                .and_then(|s| StatusCode::from_u16(s).ok())
                .unwrap_or(StatusCode::BAD_GATEWAY);
            let message = match &e {
                crate::am::rm_client::RmError::Refused { message, .. } => message.clone(),
                other => other.to_string(),
            };
            tracing::warn!("dashboard kill refused by the RM: {message}");
            ApiError::new(
                status,
                "refused",
                format!(
                    "killing the job needs its job token (in the dashboard URL), its owner's token or the admin's: {message}"
                ),
            )
            .into_response()
        }
    }
}

pub(crate) async fn fallback(uri: Uri) -> Response {
    ApiError::not_found(
        "not_found",
        format!("no such endpoint {} (the API is under /api/v1/)", uri.path()),
    )
    .into_response()
}
