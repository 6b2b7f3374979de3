//! Logs that outlive their job (YARN's log aggregation): when a node reports a container
//! dead, the RM reads the end of its stdout and stderr through the node backend (the
//! in-process executor, an agent, Ray) and keeps them under `<work dir>/logs/<app>/`,
//! at most `rm.collected_log_bytes` of each (the tail). The routes
//! `GET /ws/v1/cluster/apps/{id}/containers` (every container of the application: task,
//! attempt, host, GPUs, state, exit) and `GET /ws/v1/cluster/apps/{id}/logs/{role}/{index}`
//! (`?attempt=N&stream=stderr&offset=BYTES`) serve them to the application's owner and
//! the admin: the kept copy once there is one, else the node's live file (`gpuam logs
//! --follow` polls with the offset). A container on a LOST node says so.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::containers::log_stream;
use super::http::{app_ref, check_app_id, ApiError, Caller};
use super::state::RmState;
use super::{Rm, Shared};
use crate::cluster::NodeState;
use crate::node::executor::LogStream;
use crate::protocol::{now_ms, ContainerState};
use crate::rm::history::{container_row, pick_container, ContainerRow};

/// How long the RM keeps finished jobs and their logs, and how much of each log
/// (settings `rm.history_retention_days`, `rm.max_history`, `rm.log_retention_days`,
/// `rm.collected_log_bytes`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryOptions {
    /// Finished applications older than this are forgotten (with their containers and logs).
    pub max_age: Duration,
    /// At most this many finished applications are kept (the oldest go first).
    pub max_apps: usize,
    /// Kept logs of applications finished longer ago than this are deleted (the history
    /// row stays).
    pub log_max_age: Duration,
    /// Most bytes kept of each container's stdout and of its stderr (the end).
    pub log_bytes: u64,
}

impl From<&crate::config::RmSettings> for HistoryOptions {
    fn from(s: &crate::config::RmSettings) -> Self {
        HistoryOptions {
            max_age: Duration::from_secs(s.history_retention_days.saturating_mul(86_400)),
            max_apps: s.max_history,
            log_max_age: Duration::from_secs(s.log_retention_days.saturating_mul(86_400)),
            log_bytes: s.collected_log_bytes,
        }
    }
}

impl Default for HistoryOptions {
    fn default() -> Self {
        (&crate::config::RmSettings::default()).into()
    }
}

/// Most bytes of a log one answer carries (the client asks again from the next offset).
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// Where the kept logs of `app` live.
pub(super) fn logs_dir(rm: &Shared, app: &str) -> PathBuf {
    rm.work_dir.join("logs").join(app)
}

fn log_file(rm: &Shared, app: &str, container: &str, stream: LogStream) -> PathBuf {
    logs_dir(rm, app).join(format!("{container}.{}", stream.file_name()))
}

/// The kept stderr of a container, if any (for history's reasons).
pub(super) fn kept_stderr(rm: &Shared, app: &str, container: &str) -> Option<String> {
    std::fs::read(log_file(rm, app, container, LogStream::Stderr))
        .ok()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
}

/// Collects the logs of a container its node reported dead, in the background.
pub(super) fn spawn_collect(rm: &Arc<Shared>, container_id: String) {
    let (host, app) = {
        let st = rm.lock();
        match st.ledger.container(&container_id) {
            Some(c) => (c.container.host.clone(), c.app_id.clone()),
            None => return,
        }
    };
    let rm = rm.clone();
    tokio::spawn(async move {
        if let Err(e) = collect(&rm, &host, &app, &container_id).await {
            tracing::warn!(container = %container_id, %host, "logs not collected: {e}");
        }
    });
}

async fn collect(rm: &Shared, host: &str, app: &str, id: &str) -> Result<(), String> {
    let node = rm.nodes.for_host(host);
    let dir = logs_dir(rm, app);
    let root = rm.work_dir.join("logs");
    super::private::dir(&dir, &[&root]).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    for stream in [LogStream::Stdout, LogStream::Stderr] {
        let text = node
            .read_log(host, id, stream, Some(rm.history.log_bytes))
            .await
            .map_err(|e| e.to_string())?;
        let path = log_file(rm, app, id, stream);
        // Per stream (`cid.stdout.part`, `cid.stderr.part`): two streams never share one.
        let tmp = std::path::PathBuf::from(format!("{}.part", path.display()));
        super::private::write(&tmp, text.as_bytes())
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    tracing::debug!(container = %id, %host, "logs collected");
    Ok(())
}

/// The containers of an application the caller owns, as rows.
fn rows_of(st: &RmState, app: &str) -> Vec<ContainerRow> {
    st.ledger.containers_of(app).into_iter().map(container_row).collect()
}

/// `GET /ws/v1/cluster/apps/{id}/containers`: the application's report, why it waits (as
/// the RM's last scheduling pass says) and every container it was granted.
pub(super) async fn get_app_containers(
    State(rm): Rm,
    caller: Caller,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    check_app_id(&id)?;
    let st = rm.lock();
    let app = app_ref(&st.apps, &id)?;
    caller.must_own(app)?;
    let waits = !app.report.state.is_final() && app.waiting.since_ms.is_some();
    let reason = app.wait_reason();
    let rows: Vec<Value> = rows_of(&st, &id)
        .into_iter()
        .map(|r| {
            let lost = st.ledger.node(&r.host).is_some_and(|n| n.state == NodeState::Lost);
            let mut v = serde_json::to_value(&r).unwrap_or(Value::Null);
            v["nodeLost"] = json!(lost);
            v
        })
        .collect();
    Ok(Json(json!({
        "app": app.report,
        "waiting": {
            "since": reason.as_ref().and_then(|r| r.since_ms),
            "why": reason.as_ref().map(|r| r.text()),
            "reason": reason,
            "whyCode": app.waiting.why.as_ref().filter(|_| waits).map(|(c, _)| *c),
            // When it is expected to start, with the basis (issue 27).
            "estimate": app.waiting.estimate.as_ref().filter(|_| waits),
        },
        "containers": rows,
        "history": super::history::row_of(&rm, app, &st.ledger.containers_of(&id)),
    })))
}

#[derive(Deserialize)]
pub(super) struct TaskLogQuery {
    attempt: Option<u32>,
    stream: Option<String>,
    offset: Option<u64>,
}

/// Where a log answer's text came from.
enum Source {
    Kept(PathBuf),
    Live,
    Lost,
}

/// `GET /ws/v1/cluster/apps/{id}/logs/{role}/{index}`: a task's log from `offset` on
/// (`text`, with `size` the log's length so far and `complete` once it will not grow).
pub(super) async fn get_task_log(
    State(rm): Rm,
    caller: Caller,
    UrlPath((id, role, index)): UrlPath<(String, String, u32)>,
    Query(q): Query<TaskLogQuery>,
) -> Result<Json<Value>, ApiError> {
    check_app_id(&id)?;
    let stream = log_stream(q.stream.as_deref())?;
    let (row, app_final, finished, source) = {
        let st = rm.lock();
        let app = app_ref(&st.apps, &id)?;
        caller.must_own(app)?;
        let rows = rows_of(&st, &id);
        let row = pick_container(&rows, &role, index, q.attempt).cloned().ok_or_else(|| {
            let attempt = q.attempt.map(|a| format!(" attempt {a}")).unwrap_or_default();
            ApiError::not_found(format!(
                "application `{id}` has no container for task {role}/{index}{attempt} (yet): `gpuam status {id}` lists its tasks"
            ))
        })?;
        let kept = log_file(&rm, &id, &row.container_id, stream);
        let lost = st.ledger.node(&row.host).is_some_and(|n| n.state == NodeState::Lost);
        let source = if kept.is_file() {
            Source::Kept(kept)
        } else if lost {
            Source::Lost
        } else {
            Source::Live
        };
        (row, app.report.state.is_final(), app.report.finished_time, source)
    };
    let complete = row.state == ContainerState::Complete;
    let offset = q.offset.unwrap_or(0);
    let (text, size, note) = match source {
        Source::Kept(path) => {
            let (text, size) = read_from(&path, offset).map_err(|e| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "IO_ERROR",
                    format!("cannot read {}: {e}", path.display()),
                )
            })?;
            (text, size, String::new())
        }
        Source::Lost => (
            String::new(),
            0,
            format!(
                "node {} is LOST: the logs of container {} could not be collected",
                row.host, row.container_id
            ),
        ),
        Source::Live => match rm
            .nodes
            .for_host(&row.host)
            .read_log(&row.host, &row.container_id, stream, None)
            .await
        {
            Ok(all) => {
                let size = all.len() as u64;
                (slice_from(&all, offset), size, String::new())
            }
            Err(e) if app_final || complete => {
                let old = finished > 0 && now_ms().saturating_sub(finished) > rm.history.log_max_age.as_millis() as u64;
                let why = if old {
                    "its logs were deleted after rm.log_retention_days".to_string()
                } else {
                    format!("its node no longer has them ({e})")
                };
                (
                    String::new(),
                    0,
                    format!("container {} has ended and {why}", row.container_id),
                )
            }
            Err(e) => return Err(e.into()),
        },
    };
    Ok(Json(json!({
        "containerId": row.container_id,
        "task": row.task,
        "taskAttempt": row.task_attempt,
        "host": row.host,
        "state": row.state,
        "exitStatus": row.exit_status,
        "stream": stream.file_name(),
        "offset": offset.min(size),
        "size": size,
        "text": text,
        "complete": complete,
        "note": note,
    })))
}

/// `text` from byte `offset` on (moved forward to a character boundary), at most
/// [`MAX_ANSWER_BYTES`].
fn slice_from(text: &str, offset: u64) -> String {
    let mut start = (offset as usize).min(text.len());
    while !text.is_char_boundary(start) {
        start += 1;
    }
    let mut end = (start + MAX_ANSWER_BYTES).min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[start..end].to_string()
}

/// A kept log file from `offset` on (at most [`MAX_ANSWER_BYTES`]) and its size.
fn read_from(path: &Path, offset: u64) -> std::io::Result<(String, u64)> {
    let mut f = std::fs::File::open(path)?;
    let size = f.metadata()?.len();
    f.seek(SeekFrom::Start(offset.min(size)))?;
    let mut buf = Vec::new();
    f.take(MAX_ANSWER_BYTES as u64).read_to_end(&mut buf)?;
    Ok((String::from_utf8_lossy(&buf).into_owned(), size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_stay_on_character_boundaries() {
        assert_eq!(slice_from("héllo", 2), "llo");
        assert_eq!(slice_from("héllo", 1), "éllo");
        assert_eq!(slice_from("abc", 10), "");
    }
}
