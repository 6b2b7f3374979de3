//! Logs that outlive their job (YARN's log aggregation): when a node reports a container
//! dead, the RM reads the end of its stdout and stderr through the node backend (the
//! in-process executor, an agent, Ray) and keeps them under `<work dir>/logs/<app>/`,
//! at most `rm.collected_log_bytes` of each (the tail). The routes
//! `GET /ws/v1/cluster/apps/{id}/containers` (every container of the application: task,
//! attempt, host, GPUs, state, exit) and `GET /ws/v1/cluster/apps/{id}/logs/{role}/{index}`
//! (`?attempt=N&stream=stderr&offset=BYTES`) serve them to the application's owner and
//! the admin: the kept copy once there is one, else the node's live file (`gpuam logs
//! --follow` polls with the offset). A container on a LOST node says so.
//!
//! What is kept is bounded (RELIABILITY §2e, seventh pass): this file owns the count of
//! kept bytes per application ([`KeptLogs`], rebuilt by a bounded scan when the RM starts)
//! and carries out `crate::rm::log_budget::decide` before each container's logs are
//! written: older ended applications' kept logs are removed (a `removed.why` file says
//! why), or the container's are not kept (its `<container>.not-kept` says why), and the
//! routes give that sentence as their `note`.

use std::collections::HashMap;
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
use crate::rm::log_budget::{self, Budget, Decision, KeptApp, NotKept};

/// How long the RM keeps finished jobs and their logs, and how much of each log
/// (settings `rm.history_retention_days`, `rm.max_history`, `rm.log_retention_days`,
/// `rm.collected_log_bytes`, `rm.collected_logs_user_bytes`, `rm.collected_logs_total_bytes`,
/// `rm.min_free_disk_mb`, `rm.am_output_bytes`).
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
    /// The bounds on all kept logs: per user, in all, and the disk's free-space reserve.
    pub budget: Budget,
    /// Most bytes of each of a running AM's `am.stdout` and `am.stderr`.
    pub am_output_bytes: u64,
}

impl From<&crate::config::RmSettings> for HistoryOptions {
    fn from(s: &crate::config::RmSettings) -> Self {
        HistoryOptions {
            max_age: Duration::from_secs(s.history_retention_days.saturating_mul(86_400)),
            max_apps: s.max_history,
            log_max_age: Duration::from_secs(s.log_retention_days.saturating_mul(86_400)),
            log_bytes: s.collected_log_bytes,
            budget: Budget {
                user_bytes: s.collected_logs_user_bytes,
                total_bytes: s.collected_logs_total_bytes,
                min_free_bytes: s.min_free_disk_mb.saturating_mul(1 << 20),
            },
            am_output_bytes: s.am_output_bytes,
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

/// Bytes read from the end of a kept stderr for a history reason: ten times what a reason
/// quotes, so trailing blank lines still leave it its lines.
const REASON_READ_BYTES: u64 = 10 * crate::rm::history::REASON_STDERR_BYTES as u64;

/// The end of the kept stderr of a container, if any (for history's reasons): its last
/// [`REASON_READ_BYTES`], never the whole file (a kept log may be a mebibyte, and history
/// reads one per failed job).
pub(super) fn kept_stderr_tail(rm: &Shared, app: &str, container: &str) -> Option<String> {
    super::private::tail(&log_file(rm, app, container, LogStream::Stderr), REASON_READ_BYTES).ok()
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

async fn collect(rm: &Arc<Shared>, host: &str, app: &str, id: &str) -> Result<(), String> {
    let node = rm.nodes.for_host(host);
    let mut texts = Vec::with_capacity(2);
    for stream in [LogStream::Stdout, LogStream::Stderr] {
        let text = node
            .read_log(host, id, stream, Some(rm.history.log_bytes))
            .await
            .map_err(|e| e.to_string())?;
        texts.push((stream, text));
    }
    // Writing and removing files, under the kept-logs lock: off the async workers, so a
    // large removal never stalls the API or the heartbeats.
    let (shared, app_id, cid) = (Arc::clone(rm), app.to_string(), id.to_string());
    tokio::task::spawn_blocking(move || keep(&shared, &app_id, &cid, &texts))
        .await
        .map_err(|e| format!("log collection stopped: {e}"))??;
    tracing::debug!(container = %id, %host, "logs collected");
    Ok(())
}

/// Keeps a container's collected logs if the budget allows (after removing what it says),
/// else writes why not. One at a time ([`Shared::kept_logs`]), so two collections never
/// both take the last room.
fn keep(rm: &Shared, app: &str, id: &str, texts: &[(LogStream, String)]) -> Result<(), String> {
    let dir = logs_dir(rm, app);
    let root = rm.work_dir.join("logs");
    super::private::dir(&dir, &[&root]).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    // Cut to the bound as text: invalid UTF-8 grows threefold when it becomes text.
    let texts: Vec<(LogStream, &str)> = texts
        .iter()
        .map(|(s, t)| (*s, log_budget::tail(t, rm.history.log_bytes)))
        .collect();
    let mut kept = rm.kept_logs.lock();
    // Logs kept of this container before (collected again) are replaced, not added to.
    // Each file counts at least a block (`log_budget::counted`), as the start-up scan does.
    let before: u64 = texts.iter().map(|(s, _)| kept_size(&log_file(rm, app, id, *s))).sum();
    let new_bytes: u64 = texts.iter().map(|(_, t)| log_budget::counted(t.len() as u64)).sum();
    let need = new_bytes.saturating_sub(before);
    let (user, apps) = {
        let st = rm.lock();
        let user = st.apps.get(app).map(|a| a.report.user.clone()).unwrap_or_default();
        (user, kept.as_apps(&st))
    };
    let free = free_bytes(&root);
    match log_budget::decide(&apps, app, &user, need, free, &rm.history.budget) {
        Decision::Keep { remove } => {
            for (gone, over) in remove {
                remove_kept(rm, &mut kept, &gone, &log_budget::removed_text(&over));
                tracing::info!(app = %gone, for_app = %app, "kept logs removed: {}", log_budget::removed_text(&over));
            }
            let _ = std::fs::remove_file(not_kept_file(rm, app, id));
            for (stream, text) in &texts {
                let path = log_file(rm, app, id, *stream);
                // Per stream (`cid.stdout.part`, `cid.stderr.part`): two streams never share one.
                let tmp = PathBuf::from(format!("{}.part", path.display()));
                super::private::write(&tmp, text.as_bytes())
                    .and_then(|()| std::fs::rename(&tmp, &path))
                    .map_err(|e| {
                        let _ = std::fs::remove_file(&tmp);
                        format!("cannot write {}: {e}", path.display())
                    })?;
            }
            let now = kept.bytes(app).saturating_sub(before).saturating_add(new_bytes);
            kept.set(app, now);
            Ok(())
        }
        Decision::Refuse(why) => {
            record_not_kept(rm, app, id, &why);
            Ok(())
        }
    }
}

/// Writes why a container's logs were not kept (a sentence; if even that cannot be
/// written the route says the node no longer has them).
fn record_not_kept(rm: &Shared, app: &str, id: &str, why: &NotKept) {
    let text = why.text();
    tracing::warn!(%app, container = %id, "logs {text}");
    if let Err(e) = super::private::write(&not_kept_file(rm, app, id), text.as_bytes()) {
        tracing::warn!(%app, container = %id, "cannot record why its logs were not kept: {e}");
    }
}

/// Removes an application's kept logs, leaving `why` in their place.
fn remove_kept(rm: &Shared, kept: &mut KeptLogs, app: &str, why: &str) {
    let dir = logs_dir(rm, app);
    if let Err(e) = std::fs::remove_dir_all(&dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(%app, "kept logs not removed: {e}");
            return;
        }
    }
    kept.forget(app);
    let root = rm.work_dir.join("logs");
    let written = super::private::dir(&dir, &[&root])
        .and_then(|()| super::private::write(&dir.join(REMOVED_FILE), why.as_bytes()));
    if let Err(e) = written {
        tracing::warn!(%app, "cannot record why its kept logs were removed: {e}");
    }
}

/// Where an application whose kept logs were removed says why.
const REMOVED_FILE: &str = "removed.why";

/// The ending of the file that says why a container's logs were not kept.
const NOT_KEPT_SUFFIX: &str = ".not-kept";

fn not_kept_file(rm: &Shared, app: &str, container: &str) -> PathBuf {
    logs_dir(rm, app).join(format!("{container}{NOT_KEPT_SUFFIX}"))
}

/// What a kept file counts for ([`log_budget::counted`]); 0 when there is none.
fn kept_size(path: &Path) -> u64 {
    std::fs::symlink_metadata(path)
        .ok()
        .filter(|m| m.is_file())
        .map_or(0, |m| log_budget::counted(m.len()))
}

/// Why a container's log is not kept, if the RM recorded it: not kept, or removed since.
fn why_not_kept(rm: &Shared, app: &str, container: &str) -> Option<String> {
    let read = |p: PathBuf| -> Option<String> {
        let mut buf = Vec::new();
        std::fs::File::open(p).ok()?.take(1024).read_to_end(&mut buf).ok()?;
        Some(crate::text::shown_line(&String::from_utf8_lossy(&buf)).into_owned())
    };
    read(not_kept_file(rm, app, container)).or_else(|| read(logs_dir(rm, app).join(REMOVED_FILE)))
}

/// The free bytes (for the RM's user) of the filesystem holding `path`.
pub(super) fn free_bytes(path: &Path) -> Result<u64, String> {
    let v = nix::sys::statvfs::statvfs(path).map_err(|e| format!("statvfs {}: {e}", path.display()))?;
    Ok((v.blocks_available() as u64).saturating_mul(v.fragment_size() as u64))
}

/// Most files the start-up scan of the kept logs reads (a bound on its time; past it,
/// what is not counted is only found by its application's retention).
const MAX_SCANNED_FILES: usize = 1_000_000;

/// The bytes of kept logs per application, as the RM counts them for the budget.
#[derive(Debug, Default)]
pub(super) struct KeptLogs {
    by_app: HashMap<String, u64>,
}

impl KeptLogs {
    /// Counts what is under `<work dir>/logs` (at most [`MAX_SCANNED_FILES`] files).
    pub(super) fn scan(work_dir: &Path) -> KeptLogs {
        let mut by_app = HashMap::new();
        let mut files = 0usize;
        let Ok(apps) = std::fs::read_dir(work_dir.join("logs")) else {
            return KeptLogs { by_app };
        };
        'apps: for entry in apps.flatten() {
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let Ok(inner) = std::fs::read_dir(entry.path()) else {
                continue;
            };
            let mut bytes = 0u64;
            for f in inner.flatten() {
                files += 1;
                if files > MAX_SCANNED_FILES {
                    tracing::warn!("kept logs: more than {MAX_SCANNED_FILES} files; the rest are not counted");
                    by_app.insert(name, bytes);
                    break 'apps;
                }
                let name = f.file_name();
                let name = name.to_string_lossy();
                if name == REMOVED_FILE || name.ends_with(NOT_KEPT_SUFFIX) {
                    continue;
                }
                match f.metadata() {
                    Ok(m) if m.is_file() => bytes = bytes.saturating_add(log_budget::counted(m.len())),
                    _ => {}
                }
            }
            by_app.insert(name, bytes);
        }
        let total: u64 = by_app.values().sum();
        tracing::info!(apps = by_app.len(), bytes = total, "kept logs counted");
        KeptLogs { by_app }
    }

    pub(super) fn bytes(&self, app: &str) -> u64 {
        self.by_app.get(app).copied().unwrap_or(0)
    }

    fn set(&mut self, app: &str, bytes: u64) {
        self.by_app.insert(app.to_string(), bytes);
    }

    /// Its kept logs are gone.
    pub(super) fn forget(&mut self, app: &str) {
        self.by_app.remove(app);
    }

    /// What is kept, with each application's owner and end as the state says (one the
    /// RM no longer knows: no owner, ended at 0, so the first to go).
    fn as_apps(&self, st: &RmState) -> Vec<KeptApp> {
        self.by_app
            .iter()
            .map(|(id, &bytes)| {
                let a = st.apps.get(id);
                KeptApp {
                    app: id.clone(),
                    user: a.map(|a| a.report.user.clone()).unwrap_or_default(),
                    bytes,
                    ended_ms: match a {
                        Some(a) if !a.report.state.is_final() => None,
                        Some(a) => Some(a.report.finished_time),
                        None => Some(0),
                    },
                }
            })
            .collect()
    }
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
    let (mut out, mut rows) = {
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
        let out = json!({
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
        });
        // The reason's stderr is a file read: after the state's lock.
        (out, vec![super::history::row_parts(app, &st.ledger.containers_of(&id))])
    };
    super::history::add_stderr_tails(&rm, &mut rows).await;
    if let Some((row, _)) = rows.first() {
        out["history"] = serde_json::to_value(row).unwrap_or(Value::Null);
    }
    Ok(Json(out))
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

/// How many logs of running containers the RM reads from their nodes at once (each up to
/// 8 MiB in memory): 250 reads at once took the RM to 2 GB (twelfth pass).
pub(super) const LIVE_LOG_READS: usize = 8;
/// Of which one user holds at most this many.
pub(super) const LIVE_LOG_READS_PER_USER: usize = 2;
/// How long a live log read waits for its turn before it is answered 429.
const LIVE_LOG_WAIT: Duration = Duration::from_secs(5);

/// A running container's log as its node has it now, read in `who`'s turn
/// ([`LIVE_LOG_READS`]); 429 when no turn came within [`LIVE_LOG_WAIT`].
async fn read_live(
    rm: &Shared,
    who: &str,
    host: &str,
    container_id: &str,
    stream: LogStream,
) -> Result<Result<String, crate::node::NodeError>, ApiError> {
    let Some(_turn) = rm.live_logs.acquire(who, LIVE_LOG_WAIT).await else {
        return Err(ApiError {
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "BUSY",
                format!(
                    "the RM is reading as many live logs as it reads at once ({LIVE_LOG_READS}, \
                     {LIVE_LOG_READS_PER_USER} per user); ask again in a second"
                ),
            )
        });
    };
    Ok(rm.nodes.for_host(host).read_log(host, container_id, stream, None).await)
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
    // Not kept (a budget, the disk's reserve) or removed since: said whatever is served.
    let not_kept = match source {
        Source::Kept(_) => None,
        _ => why_not_kept(&rm, &id, &row.container_id),
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
            not_kept.unwrap_or_else(|| {
                format!(
                    "node {} is LOST: the logs of container {} could not be collected",
                    row.host, row.container_id
                )
            }),
        ),
        Source::Live => match read_live(&rm, caller.name(), &row.host, &row.container_id, stream).await? {
            Ok(all) => {
                let size = all.len() as u64;
                (slice_from(&all, offset), size, not_kept.unwrap_or_default())
            }
            Err(_) if not_kept.is_some() => (String::new(), 0, not_kept.unwrap_or_default()),
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

    #[test]
    fn the_start_up_scan_counts_kept_logs_per_application_but_not_the_notes() {
        let t = tempfile::tempdir().unwrap();
        let logs = t.path().join("logs");
        for (file, bytes) in [
            ("app1/c1.stdout", 10),
            ("app1/c1.stderr", 5),
            ("app1/c2.not-kept", 20),
            ("app2/removed.why", 30),
            ("app3/c3.stdout.part", 7),
        ] {
            let p = logs.join(file);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, vec![b'x'; bytes]).unwrap();
        }
        std::fs::write(logs.join("stray"), "x").unwrap();
        let k = KeptLogs::scan(t.path());
        // Each kept file counts at least a block (`log_budget::counted`).
        assert_eq!((k.bytes("app1"), k.bytes("app2"), k.bytes("app3")), (8192, 0, 4096));
        assert_eq!(k.by_app.len(), 3, "{k:?}");
        assert!(KeptLogs::scan(&t.path().join("none")).by_app.is_empty());
    }

    /// History reads only the end of a kept stderr (a mebibyte per failed job, read whole
    /// under the state's lock, stalled the heartbeats: ninth pass), and never a pipe or a link.
    #[test]
    fn a_reason_reads_only_the_end_of_a_kept_stderr() {
        let t = tempfile::tempdir().unwrap();
        let big = t.path().join("c.stderr");
        let mut text = "x".repeat(1 << 20);
        text.push_str("\nTraceback\nValueError: bad shape\n\n");
        std::fs::write(&big, &text).unwrap();
        let tail = super::super::private::tail(&big, REASON_READ_BYTES).unwrap();
        assert_eq!(tail.len() as u64, REASON_READ_BYTES);
        assert!(tail.ends_with("ValueError: bad shape\n\n"), "{tail:?}");
        let mut reason = String::from("task main/0 exited with 1");
        crate::rm::history::add_stderr(&mut reason, &tail);
        assert!(
            reason.ends_with("; stderr: Traceback\nValueError: bad shape"),
            "{reason:?}"
        );
        // Shorter than the bound: all of it.
        std::fs::write(&big, "oops\n").unwrap();
        assert_eq!(
            super::super::private::tail(&big, REASON_READ_BYTES).ok().as_deref(),
            Some("oops\n")
        );
        // A pipe (which would block the reader) and a link are not read.
        let fifo = t.path().join("p.stderr");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert_eq!(super::super::private::tail(&fifo, REASON_READ_BYTES).ok(), None);
        let link = t.path().join("l.stderr");
        std::os::unix::fs::symlink(&big, &link).unwrap();
        assert_eq!(super::super::private::tail(&link, REASON_READ_BYTES).ok(), None);
        assert_eq!(
            super::super::private::tail(&t.path().join("none"), REASON_READ_BYTES).ok(),
            None
        );
    }
}
