//! Job history and the per-task container view, as pure functions of what the RM stores:
//! a finished application (its report and AM attempts) and its containers (host, task
//! "role/index", task attempt, grant and end times, exit) give one history row with
//! its times, duration, final state, exit code, reason (the first failed task and its
//! stderr tail, `killed by bob`, a preemption's notice) and GPU-hours; filters by user,
//! queue and state; and which finished applications the retention bound drops. The RM
//! keeps finished applications and their containers in its store (`crate::rm::store`),
//! so history survives a restart; the I/O (routes, log files) is in
//! `crate::rm::server::history` and `crate::rm::server::logs`.

use serde::{Deserialize, Serialize};

use super::apps::App;
use super::ledger::LedgerContainer;
use crate::protocol::{exit_status, split_task, AppState, ContainerState};

/// One container of an application as `gpuam status` and the logs route show it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerRow {
    pub container_id: String,
    /// "role/index" (empty for containers asked without a task).
    pub task: String,
    pub role: String,
    pub index: Option<u32>,
    /// The task's attempt this container served.
    pub task_attempt: u32,
    pub host: String,
    /// GPU indices on the host.
    pub gpus: Vec<u32>,
    pub state: ContainerState,
    pub exit_status: Option<i32>,
    pub diagnostics: String,
    pub allocated_time: u64,
    /// 0 while live.
    pub ended_time: u64,
}

/// The row of one container.
pub fn container_row(c: &LedgerContainer) -> ContainerRow {
    let task = c.container.task.clone().unwrap_or_default();
    let (role, index) = split_task(&task);
    ContainerRow {
        container_id: c.container.container_id.clone(),
        role: role.to_string(),
        index,
        task,
        task_attempt: c.container.task_attempt,
        host: c.container.host.clone(),
        gpus: crate::resources::mask_indices(c.container.resources.gpu_mask),
        state: c.state,
        exit_status: c.exit_status,
        diagnostics: c.diagnostics.clone(),
        allocated_time: c.allocated_ms,
        ended_time: c.ended_ms,
    }
}

/// The container of `role`/`index` to show: the given task attempt, else the latest one
/// (highest task attempt, then the latest grant).
pub fn pick_container<'a>(
    rows: &'a [ContainerRow],
    role: &str,
    index: u32,
    attempt: Option<u32>,
) -> Option<&'a ContainerRow> {
    rows.iter()
        .filter(|r| r.role == role && r.index == Some(index))
        .filter(|r| attempt.is_none_or(|a| r.task_attempt == a))
        .max_by_key(|r| (r.task_attempt, r.allocated_time, r.container_id.clone()))
}

/// One finished application, as `gpuam history` and the cluster page show it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HistoryRow {
    pub id: String,
    pub name: String,
    pub user: String,
    pub queue: String,
    pub state: AppState,
    pub exit_code: Option<i32>,
    /// When it was submitted (milliseconds since the epoch).
    pub submitted_time: u64,
    /// When its first container was granted (0: none ever was).
    pub started_time: u64,
    pub finished_time: u64,
    /// From its first container (its submission when none ran) to its end, in seconds.
    pub duration_sec: f64,
    /// Why it ended as it did ("" for a success).
    pub reason: String,
    /// AM attempts.
    pub am_attempts: u32,
    /// Containers it was granted (every task attempt).
    pub containers: usize,
    /// Task attempts beyond the first, all tasks together.
    pub task_retries: u32,
    /// GPUs held × hours, from each container's grant to its end.
    pub gpu_hours: f64,
}

/// Most bytes of a failed task's stderr quoted in a reason.
pub const REASON_STDERR_BYTES: usize = 400;

/// Exit statuses that say the RM or the AM ended a container, not its task.
fn ended_by_others(exit: i32) -> bool {
    matches!(
        exit,
        exit_status::KILLED_BY_APPMASTER
            | exit_status::KILLED_BY_RESOURCEMANAGER
            | exit_status::KILLED_AFTER_APP_COMPLETION
    )
}

/// The history row of `app` (finished or not: an unfinished one shows its times so far,
/// `now_ms` standing for its end). `stderr_tail(container_id)` gives the collected
/// stderr of a container, if any.
pub fn history_row(
    app: &App,
    containers: &[&LedgerContainer],
    now_ms: u64,
    stderr_tail: impl Fn(&str) -> Option<String>,
) -> HistoryRow {
    let r = &app.report;
    let started = containers
        .iter()
        .map(|c| c.allocated_ms)
        .filter(|&t| t > 0)
        .min()
        .unwrap_or(0);
    let end = if r.finished_time > 0 { r.finished_time } else { now_ms };
    let from = if started > 0 { started } else { r.started_time };
    let gpu_ms: f64 = containers
        .iter()
        .map(|c| {
            let until = if c.ended_ms > 0 { c.ended_ms } else { end };
            gpus_held(&c.container.resources) * until.saturating_sub(c.allocated_ms) as f64
        })
        .sum();
    let task_retries = containers
        .iter()
        .map(|c| c.container.task_attempt)
        .filter(|&a| a > 1)
        .map(|a| a - 1)
        .max()
        .unwrap_or(0);
    HistoryRow {
        id: r.id.clone(),
        name: r.name.clone(),
        user: r.user.clone(),
        queue: r.queue.clone(),
        state: r.state,
        exit_code: r.exit_code,
        submitted_time: r.started_time,
        started_time: started,
        finished_time: r.finished_time,
        duration_sec: end.saturating_sub(from) as f64 / 1000.0,
        reason: reason(app, containers, stderr_tail),
        am_attempts: r.attempt,
        containers: containers.len(),
        task_retries,
        // `+ 0.0`: a job that never held a container sums to −0.0 ("-0.000" in a table).
        gpu_hours: (gpu_ms / 3_600_000.0 * 1e4).round() / 1e4 + 0.0,
    }
}

/// GPUs an amount holds: whole ones plus its shares.
fn gpus_held(r: &crate::resources::Resources) -> f64 {
    r.whole_gpu_count() as f64 + r.gpu_shares.iter().map(|(_, h)| h as f64 / 100.0).sum::<f64>()
}

/// Why an application ended as it did: a kill says who; a failure names the first task
/// that failed (a preemption's notice included), its exit and its stderr's last lines; a
/// success has none.
pub fn reason(app: &App, containers: &[&LedgerContainer], stderr_tail: impl Fn(&str) -> Option<String>) -> String {
    let r = &app.report;
    if r.state == AppState::Killed {
        return r.diagnostics.clone();
    }
    if r.state == AppState::Finished && r.exit_code.unwrap_or(0) == 0 {
        return String::new();
    }
    let first_failed = containers
        .iter()
        .filter(|c| c.state == ContainerState::Complete)
        .filter(|c| c.exit_status.is_some_and(|e| e != 0 && !ended_by_others(e)))
        .min_by_key(|c| (c.ended_ms, c.container.container_id.clone()));
    let Some(c) = first_failed else {
        return r.diagnostics.clone();
    };
    let task = c.container.task.as_deref().unwrap_or(&c.container.container_id);
    let mut out = format!(
        "task {task} (attempt {}) exited with {} on {}",
        c.container.task_attempt,
        c.exit_status.unwrap_or_default(),
        c.container.host
    );
    if !c.diagnostics.is_empty() && !c.diagnostics.starts_with("Exited with exit code") {
        out.push_str(": ");
        out.push_str(&c.diagnostics);
    }
    if let Some(text) = stderr_tail(&c.container.container_id) {
        add_stderr(&mut out, &text);
    }
    out
}

/// Ends a reason with the last lines of the failed task's stderr `text` (at most
/// [`REASON_STDERR_BYTES`]), when there are any.
pub fn add_stderr(reason: &mut String, text: &str) {
    let tail = last_lines(text, REASON_STDERR_BYTES);
    if !tail.is_empty() {
        reason.push_str("; stderr: ");
        reason.push_str(&tail);
    }
}

/// The last whole lines of `text` within `max` bytes (one line cut at a char boundary
/// when even the last is longer), trimmed.
pub fn last_lines(text: &str, max: usize) -> String {
    let t = text.trim_end();
    if t.len() <= max {
        return t.trim_start().to_string();
    }
    let mut start = t.len() - max;
    while !t.is_char_boundary(start) {
        start += 1;
    }
    let cut = &t[start..];
    if t.as_bytes()[start - 1] == b'\n' {
        return cut.to_string();
    }
    match cut.find('\n') {
        Some(nl) if nl + 1 < cut.len() => cut[nl + 1..].to_string(),
        _ => cut.to_string(),
    }
}

/// What `gpuam history` filters on (`None`: any).
#[derive(Clone, Debug, Default)]
pub struct HistoryFilter {
    pub user: Option<String>,
    pub queue: Option<String>,
    pub state: Option<String>,
}

impl HistoryFilter {
    /// Whether `app` passes. A queue matches its full path or its last part; a state its
    /// name in any case (FINISHED, FAILED, KILLED).
    pub fn accepts(&self, app: &App) -> bool {
        let r = &app.report;
        self.user.as_deref().is_none_or(|u| r.user == u)
            && self
                .queue
                .as_deref()
                .is_none_or(|q| r.queue == q || r.queue.rsplit('.').next() == Some(q))
            && self
                .state
                .as_deref()
                .is_none_or(|s| format!("{:?}", r.state).eq_ignore_ascii_case(s))
    }
}

/// The states a finished application has, as a history filter names them (any case).
pub const FINAL_STATES: [&str; 3] = ["finished", "failed", "killed"];

/// One finished application as retention weighs it: its id, when it finished, its owner.
pub type Finished = (String, u64, String);

/// The finished applications the history no longer keeps: those that finished more than
/// `max_age_ms` before `now_ms`, and, beyond `max_count`, the oldest of the user who keeps
/// the most, one at a time (eighth pass: forgetting the oldest of all users together let
/// one user's stream of tiny jobs push another's history and kept logs out). `finished`
/// holds the finished applications whose containers are all dead.
pub fn to_forget(finished: &[Finished], now_ms: u64, max_age_ms: u64, max_count: usize) -> Vec<String> {
    use std::cmp::Reverse;
    use std::collections::{BinaryHeap, HashMap};
    let (old, kept): (Vec<&Finished>, Vec<&Finished>) = finished
        .iter()
        .partition(|(_, t, _)| now_ms.saturating_sub(*t) > max_age_ms);
    let mut gone: Vec<String> = old.iter().map(|(id, _, _)| id.clone()).collect();
    let mut excess = kept.len().saturating_sub(max_count);
    if excess == 0 {
        return gone;
    }
    // Per user, oldest last (popped first).
    let mut by_user: HashMap<&str, Vec<&Finished>> = HashMap::new();
    for f in kept {
        by_user.entry(f.2.as_str()).or_default().push(f);
    }
    let mut heap = BinaryHeap::new();
    for (user, apps) in by_user.iter_mut() {
        apps.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| b.0.cmp(&a.0)));
        let oldest = apps.last().map_or(0, |f| f.1);
        heap.push((apps.len(), Reverse(oldest), *user));
    }
    while excess > 0 {
        let Some((_, _, user)) = heap.pop() else { break };
        let Some(apps) = by_user.get_mut(user) else { break };
        if let Some(f) = apps.pop() {
            gone.push(f.0.clone());
            excess -= 1;
        }
        if let Some(next) = apps.last() {
            heap.push((apps.len(), Reverse(next.1), user));
        }
    }
    gone
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Container, FinalStatus};
    use crate::resources::{PortSet, Resources};

    fn container(
        id: &str,
        task: &str,
        attempt: u32,
        gpus: u64,
        times: (u64, u64),
        exit: Option<i32>,
    ) -> LedgerContainer {
        LedgerContainer {
            container: Container {
                container_id: id.into(),
                request_id: 1,
                host: "n1".into(),
                node_http_address: String::new(),
                node_ip: None,
                resources: Resources::with_mask(1, 100, gpus, PortSet::default()),
                task: Some(task.into()),
                task_attempt: attempt,
            },
            app_id: "application_1_0001".into(),
            attempt: 1,
            state: if exit.is_some() {
                ContainerState::Complete
            } else {
                ContainerState::Running
            },
            allocated_at: std::time::Instant::now(),
            allocated_ms: times.0,
            exit_status: exit,
            diagnostics: String::new(),
            held: false,
            ended_ms: times.1,
            started_ms: 0,
            max_run_sec: None,
        }
    }

    fn app(state: AppState, exit: i32, diag: &str) -> App {
        let mut a = App::new("application_1_0001".into(), "j".into());
        a.report.user = "alice".into();
        a.report.started_time = 1_000;
        a.finish(state, FinalStatus::Failed, exit, diag.into());
        a.report.finished_time = 7_201_000;
        a
    }

    #[test]
    fn a_job_that_held_nothing_has_zero_gpu_hours_not_minus_zero() {
        let a = app(AppState::Killed, 1, "killed");
        let row = history_row(&a, &[], 0, |_| None);
        assert!(
            row.gpu_hours == 0.0 && row.gpu_hours.is_sign_positive(),
            "{}",
            row.gpu_hours
        );
        assert_eq!(format!("{:.3}", row.gpu_hours), "0.000");
    }

    #[test]
    fn gpu_hours_times_and_the_first_failed_task_with_its_stderr() {
        let a = app(AppState::Failed, 1, "task worker/1 exited with 127");
        let cs = [
            container(
                "c1",
                "worker/0",
                1,
                0b11,
                (1_000, 3_601_000),
                Some(exit_status::KILLED_BY_APPMASTER),
            ),
            container("c2", "worker/1", 1, 0b100, (1_000, 1_801_000), Some(127)),
            container("c3", "worker/1", 2, 0b100, (2_000_000, 3_000_000), Some(1)),
        ];
        let refs: Vec<&LedgerContainer> = cs.iter().collect();
        let row = history_row(&a, &refs, 0, |id| {
            (id == "c2").then(|| "line one\nbash: pythn: command not found\n".to_string())
        });
        // 2 GPUs × 1 h + 1 GPU × 0.5 h + 1 GPU × 1,000 s.
        let want = 2.0 + 0.5 + 1_000.0 / 3_600.0;
        assert!((row.gpu_hours - want).abs() < 1e-3, "{}", row.gpu_hours);
        assert_eq!(row.started_time, 1_000);
        assert_eq!(row.duration_sec, 7_200.0);
        assert_eq!(row.task_retries, 1);
        assert!(
            row.reason
                .starts_with("task worker/1 (attempt 1) exited with 127 on n1"),
            "{}",
            row.reason
        );
        assert!(
            row.reason.ends_with("stderr: line one\nbash: pythn: command not found"),
            "{}",
            row.reason
        );
    }

    #[test]
    fn a_kill_says_who_and_a_success_says_nothing() {
        let a = app(AppState::Killed, 1, "Application killed by user (bob)");
        assert_eq!(reason(&a, &[], |_| None), "Application killed by user (bob)");
        let a = app(AppState::Finished, 0, "done");
        assert_eq!(reason(&a, &[], |_| None), "");
    }

    #[test]
    fn last_lines_keeps_whole_lines_within_the_bound() {
        assert_eq!(last_lines("a\nbb\nccc\n", 6), "bb\nccc");
        assert_eq!(last_lines("short\n", 100), "short");
        assert_eq!(last_lines("ééééé", 3), "é");
    }

    #[test]
    fn the_latest_attempt_of_a_task_is_picked_unless_one_is_named() {
        let cs = [
            container("c1", "worker/1", 1, 1, (1, 2), Some(1)),
            container("c2", "worker/1", 2, 1, (3, 0), None),
            container("c3", "worker/0", 1, 1, (1, 0), None),
        ];
        let rows: Vec<ContainerRow> = cs.iter().map(container_row).collect();
        assert_eq!(pick_container(&rows, "worker", 1, None).unwrap().container_id, "c2");
        assert_eq!(pick_container(&rows, "worker", 1, Some(1)).unwrap().container_id, "c1");
        assert!(pick_container(&rows, "worker", 2, None).is_none());
        assert_eq!(split_task("a/b/3"), ("a/b", Some(3)));
        assert_eq!(split_task("main"), ("main", None));
    }

    #[test]
    fn retention_drops_the_old_and_the_oldest_beyond_the_count() {
        let f: Vec<Finished> = [("a", 100), ("b", 5_000), ("c", 9_000), ("d", 9_500)]
            .iter()
            .map(|(id, t)| (id.to_string(), *t, "u".to_string()))
            .collect();
        let mut gone = to_forget(&f, 10_000, 6_000, 10);
        gone.sort();
        assert_eq!(gone, vec!["a"]);
        let mut gone = to_forget(&f, 10_000, u64::MAX, 2);
        gone.sort();
        assert_eq!(gone, vec!["a", "b"]);
    }

    /// Beyond the count the user who keeps the most loses their oldest first: alice's
    /// stream of jobs never pushes bob's one old job out (eighth pass), and among users
    /// keeping as many, the oldest goes.
    #[test]
    fn beyond_the_count_the_user_who_keeps_most_loses_their_oldest_first() {
        let mut f: Vec<Finished> = vec![("bob-1".into(), 1, "bob".into())];
        f.extend((0..25u64).map(|i| (format!("alice-{i:02}"), 100 + i, "alice".to_string())));
        let mut gone = to_forget(&f, 1_000, u64::MAX, 20);
        gone.sort();
        let want: Vec<String> = (0..6).map(|i| format!("alice-{i:02}")).collect();
        assert_eq!(gone, want, "alice's six oldest go, bob's older job stays");
        // Down to one each: the older of the two goes first.
        let two: Vec<Finished> = vec![("bob-1".into(), 1, "bob".into()), ("alice-1".into(), 5, "alice".into())];
        assert_eq!(to_forget(&two, 1_000, u64::MAX, 1), vec!["bob-1"]);
        // Age still applies to everyone.
        assert_eq!(to_forget(&f, 1_000, 950, 100), vec!["bob-1"]);
    }

    #[test]
    fn filters_match_user_queue_leaf_and_state_in_any_case() {
        let mut a = app(AppState::Failed, 1, "x");
        a.report.queue = "research.nlp".into();
        let f = |u: Option<&str>, q: Option<&str>, s: Option<&str>| HistoryFilter {
            user: u.map(Into::into),
            queue: q.map(Into::into),
            state: s.map(Into::into),
        };
        assert!(f(Some("alice"), Some("nlp"), Some("failed")).accepts(&a));
        assert!(f(None, Some("research.nlp"), None).accepts(&a));
        assert!(!f(Some("bob"), None, None).accepts(&a));
        assert!(!f(None, None, Some("killed")).accepts(&a));
    }
}
