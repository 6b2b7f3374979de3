//! Job history: `GET /ws/v1/cluster/history` (finished applications, newest first, with
//! times, duration, final state, exit code, reason, attempts and GPU-hours; filtered by
//! `user`, `queue`, `state`, at most `limit`: 1,000 unless named, at most 10,000), for the caller's own applications (the
//! admin's: everyone's). Finished applications stay in the RM's store until the
//! retention pass forgets them (`rm.history_retention_days`, `rm.max_history`), and
//! their kept logs go after `rm.log_retention_days`; a forgotten application's directory
//! (its job.yaml copy, its AM's output) goes with it, and while the disk is below its
//! reserve (`rm.min_free_disk_mb`) ended applications keep no job.yaml copy nor older AM
//! output. The rows are computed by `crate::rm::history`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::task::JoinHandle;

use super::http::Caller;
use super::state::RmState;
use super::{transactions, Rm, Shared};
use crate::protocol::now_ms;
use crate::rm::apps::App;
use crate::rm::history::{history_row, HistoryFilter, HistoryRow};
use crate::rm::ledger::LedgerContainer;

/// How often the retention pass runs.
const RETENTION_EVERY: Duration = Duration::from_secs(60);

#[derive(Deserialize)]
pub(super) struct HistoryQuery {
    user: Option<String>,
    queue: Option<String>,
    state: Option<String>,
    limit: Option<usize>,
}

/// Rows one history answer carries when the caller names no `limit`, and at most.
const DEFAULT_ROWS: usize = 1_000;
const MAX_ROWS: usize = 10_000;

/// The history row of one application (finished or not), from its containers, without its
/// failed task's stderr, and the (application, container) whose kept stderr ends its reason:
/// that is a file read, which [`add_stderr_tails`] does after the state's lock is let go (a
/// history of thousands of failed jobs must not hold the heartbeats).
pub(super) fn row_parts(app: &App, containers: &[&LedgerContainer]) -> (HistoryRow, Option<(String, String)>) {
    let wanted = std::cell::RefCell::new(None);
    let row = history_row(app, containers, now_ms(), |c| {
        *wanted.borrow_mut() = Some((app.report.id.clone(), c.to_string()));
        None
    });
    (row, wanted.into_inner())
}

/// Ends each row's reason with its failed task's kept stderr ([`row_parts`]), reading the
/// files off the async workers and without the state's lock (a row whose file cannot be
/// read keeps its reason without it).
pub(super) async fn add_stderr_tails(rm: &Arc<Shared>, rows: &mut [(HistoryRow, Option<(String, String)>)]) {
    let wanted: Vec<(usize, String, String)> = rows
        .iter_mut()
        .enumerate()
        .filter_map(|(i, (_, w))| w.take().map(|(app, cid)| (i, app, cid)))
        .collect();
    if wanted.is_empty() {
        return;
    }
    let shared = Arc::clone(rm);
    let read = tokio::task::spawn_blocking(move || {
        wanted
            .into_iter()
            .filter_map(|(i, app, cid)| Some((i, super::logs::kept_stderr_tail(&shared, &app, &cid)?)))
            .collect::<Vec<_>>()
    })
    .await;
    match read {
        Ok(texts) => {
            for (i, text) in texts {
                if let Some((row, _)) = rows.get_mut(i) {
                    crate::rm::history::add_stderr(&mut row.reason, &text);
                }
            }
        }
        Err(e) => tracing::warn!("history: stderr tails not read: {e}"),
    }
}

/// Every application's containers, in one pass over the ledger.
pub(super) fn containers_by_app(st: &RmState) -> HashMap<&str, Vec<&LedgerContainer>> {
    let mut by_app: HashMap<&str, Vec<&LedgerContainer>> = HashMap::new();
    for c in st.ledger.all_containers() {
        by_app.entry(c.app_id.as_str()).or_default().push(c);
    }
    by_app
}

/// `GET /ws/v1/cluster/history`.
pub(super) async fn get_history(
    State(rm): Rm,
    caller: Caller,
    Query(q): Query<HistoryQuery>,
) -> Result<Json<Value>, super::http::ApiError> {
    use crate::rm::history::FINAL_STATES as STATES;
    if let Some(s) = q.state.as_deref().filter(|s| !s.is_empty()) {
        if !STATES.iter().any(|k| k.eq_ignore_ascii_case(s)) {
            return Err(super::http::ApiError::bad_request(format!(
                "`state`: `{}` is not a state a finished job has; use one of {}",
                crate::spec::yaml::clip(s),
                STATES.join(", ")
            )));
        }
    }
    let filter = HistoryFilter {
        user: q.user.filter(|u| !u.is_empty()),
        queue: q.queue.filter(|u| !u.is_empty()),
        state: q.state.filter(|u| !u.is_empty()),
    };
    let limit = q.limit.unwrap_or(DEFAULT_ROWS);
    if limit > MAX_ROWS {
        return Err(super::http::ApiError::bad_request(format!(
            "`limit`: {limit} rows is more than one answer carries; ask for at most {MAX_ROWS}, or narrow it by user, queue or state"
        )));
    }
    let mut rows: Vec<(HistoryRow, Option<(String, String)>)> = {
        let st = rm.lock();
        let mut apps: Vec<&App> = st
            .apps
            .values()
            .filter(|a| a.report.state.is_final() && caller.owns(a) && filter.accepts(a))
            .collect();
        apps.sort_by(|a, b| {
            b.report
                .finished_time
                .cmp(&a.report.finished_time)
                .then_with(|| b.report.id.cmp(&a.report.id))
        });
        let by_app = containers_by_app(&st);
        apps.into_iter()
            .take(limit)
            .map(|a| row_parts(a, by_app.get(a.report.id.as_str()).map_or(&[], Vec::as_slice)))
            .collect()
    };
    add_stderr_tails(&rm, &mut rows).await;
    let rows: Vec<HistoryRow> = rows.into_iter().map(|(r, _)| r).collect();
    Ok(Json(json!({ "history": rows })))
}

/// `GET /ws/v1/cluster/whoami`: the caller's user name and whether it is the admin (for
/// `gpuam login` and the job commands).
pub(super) async fn whoami(caller: Caller) -> Json<Value> {
    Json(json!({ "user": caller.name(), "admin": caller.is_admin() }))
}

/// Runs the retention pass now and then every [`RETENTION_EVERY`].
pub(super) fn spawn_retention(rm: Arc<Shared>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(RETENTION_EVERY);
        loop {
            every.tick().await;
            // Removing files: off the async workers.
            let shared = Arc::clone(&rm);
            if let Err(e) = tokio::task::spawn_blocking(move || retention_pass(&shared)).await {
                tracing::warn!("history retention pass stopped: {e}");
            }
        }
    })
}

/// Forgets the finished applications beyond the history's bounds (their containers,
/// kept logs and directory with them), deletes kept logs older than
/// `rm.log_retention_days`, and below the disk's reserve the job.yaml copies and older AM
/// output of ended applications.
pub(super) fn retention_pass(rm: &Shared) {
    let now = now_ms();
    let (finished, forgotten, old_logs) = {
        let (finished, gone) = transactions::forget_finished(&mut rm.lock(), &rm.history, now);
        if !gone.is_empty() {
            tracing::info!(apps = gone.len(), "history retention: finished applications forgotten");
        }
        let log_age = rm.history.log_max_age.as_millis() as u64;
        let old_logs: Vec<String> = finished
            .iter()
            .filter(|(id, t)| !gone.contains(id) && now.saturating_sub(*t) > log_age)
            .map(|(id, _)| id.clone())
            .collect();
        (finished, gone, old_logs)
    };
    for id in forgotten.iter().chain(&old_logs) {
        let dir = super::logs::logs_dir(rm, id);
        // Under the kept-logs lock: a collection never writes between the removal and the
        // count's reset (its bytes would go uncounted).
        let mut kept = rm.kept_logs.lock();
        if dir.is_dir() {
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                tracing::warn!(app = %id, "kept logs not deleted: {e}");
                continue;
            }
        }
        kept.forget(id);
    }
    for id in &forgotten {
        let dir = rm.work_dir.join(id);
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(app = %id, "its directory was not deleted: {e}");
            }
        }
    }
    let reserve = rm.history.budget.min_free_bytes;
    let low = match super::logs::free_bytes(&rm.work_dir) {
        Ok(free) => !crate::rm::log_budget::reserve_allows(free, 0, reserve),
        Err(e) => {
            tracing::warn!("{e}");
            false
        }
    };
    if low {
        let mut freed = 0usize;
        for (id, _) in finished.iter().filter(|(id, _)| !forgotten.contains(id)) {
            for name in ENDED_DISPOSABLE {
                if std::fs::remove_file(rm.work_dir.join(id).join(name)).is_ok() {
                    freed += 1;
                }
            }
        }
        tracing::warn!(
            files = freed,
            "the RM's disk is below its reserve (rm.min_free_disk_mb): no new log is kept; ended jobs' job.yaml copies and older AM output removed"
        );
    }
}

/// What an ended application's directory need not keep while the disk is below its
/// reserve: its spec's copy (the AM read it) and its AM's older output.
const ENDED_DISPOSABLE: [&str; 3] = ["job.yaml", "am.stdout.1", "am.stderr.1"];

#[cfg(test)]
mod tests {
    use super::super::*;
    use super::*;
    use crate::protocol::{AppState, FinalStatus};
    use crate::resources::{PortSet, Resources};

    fn options(dir: &Path) -> RmOptions {
        let node = Node::new("n1", "/r", Resources::with_mask(4, 1000, 0x3, PortSet::new()));
        let mut opts = RmOptions::new(vec![node], "127.0.0.1:0".parse().unwrap(), dir.to_path_buf());
        opts.launch_am = false;
        opts
    }

    async fn rm_in(dir: &Path) -> RmHandle {
        start(options(dir)).await.unwrap()
    }

    /// A finished application that ended `days_ago`, with a kept log.
    fn finished_app(rm: &RmHandle, name: &str, days_ago: u64) -> String {
        let (id, _) = rm.register_test_app(name);
        let mut st = rm.shared.lock();
        let app = st.apps.get_mut(&id).unwrap();
        app.finish(AppState::Finished, FinalStatus::Succeeded, 0, String::new());
        app.report.finished_time = now_ms() - days_ago * 86_400_000;
        st.commit_or_log();
        drop(st);
        let dir = super::super::logs::logs_dir(&rm.shared, &id);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("c.stdout"), "x").unwrap();
        id
    }

    #[tokio::test]
    async fn retention_forgets_old_jobs_with_their_logs_durably_and_drops_old_logs() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("work");
        let rm = rm_in(&work).await;
        let old = finished_app(&rm, "old", 31);
        let logs_only = finished_app(&rm, "week-old", 8);
        let fresh = finished_app(&rm, "fresh", 0);
        retention_pass(&rm.shared);
        assert!(rm.app_report(&old).is_none());
        assert!(rm.app_report(&logs_only).is_some() && rm.app_report(&fresh).is_some());
        let logs = |id: &str| super::super::logs::logs_dir(&rm.shared, id).exists();
        assert!(!logs(&old) && !logs(&logs_only) && logs(&fresh));
        rm.shutdown().await;
        // The store forgot it too: a restarted RM does not bring it back (its store is
        // free once the old RM's last references are gone).
        let mut again = None;
        for _ in 0..100 {
            match start(options(&work)).await {
                Ok(r) => {
                    again = Some(r);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        let rm = again.expect("the RM starts again on its state");
        assert!(rm.app_report(&old).is_none());
        assert!(rm.app_report(&fresh).is_some());
        rm.shutdown().await;
    }

    #[tokio::test]
    async fn a_task_on_a_lost_node_says_its_logs_are_lost() {
        let dir = tempfile::tempdir().unwrap();
        let rm = rm_in(&dir.path().join("work")).await;
        let (id, _) = rm.register_test_app("lost");
        {
            let mut st = rm.shared.lock();
            let mut ask =
                crate::protocol::Ask::for_resources(1, "n1", &Resources::with_mask(1, 100, 0x1, PortSet::new()));
            ask.task = Some("worker/0".into());
            ask.task_attempt = 1;
            st.ledger.grant(&id, 1, &ask, Instant::now()).unwrap();
            st.commit_or_log();
        }
        assert!(rm.set_node_state("n1", NodeState::Lost).await);
        let v = super::super::tests::admin_get(&rm, &format!("/ws/v1/cluster/apps/{id}/logs/worker/0")).await;
        assert!(v["note"].as_str().unwrap().contains("node n1 is LOST"), "{v}");
        assert_eq!(v["complete"], true, "{v}");
        rm.shutdown().await;
    }
}
