//! Applications as the RM tracks them: ids, per-app bearer tokens, the state machine
//! (ACCEPTED → RUNNING → FINISHED / FAILED / KILLED), the allocate heartbeat's memory
//! (last answer for idempotent retries, containers completed since the last answer,
//! which node changes this app has already seen), how its AM is started and each AM
//! attempt's history. `Apps` is the table of them that notes which ones changed, so
//! the RM's store writes exactly those.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::node::procs::ProcessId;
use crate::protocol::{now_ms, AllocateResponse, AppReport, AppState, CompletedContainer, FinalStatus, WaitingTasks};
use crate::reason::Reason;

pub use crate::auth::{constant_time_eq, new_token};

/// YARN-style application id.
pub fn app_id(cluster_ts: u64, seq: u32) -> String {
    format!("application_{cluster_ts}_{seq:04}")
}

/// The (cluster timestamp, sequence) of an id made by [`app_id`]:
/// `application_<digits>_<digits>`, plain ASCII digits, the sequence 1..=2^32−1. `None`
/// for anything else (`../..`, a sequence that overflows): such an id was never issued.
pub fn parse_app_id(id: &str) -> Option<(u64, u32)> {
    let (ts, seq) = id.strip_prefix("application_")?.split_once('_')?;
    let digits = |p: &str| !p.is_empty() && p.len() <= 20 && p.bytes().all(|b| b.is_ascii_digit());
    if !digits(ts) || !digits(seq) {
        return None;
    }
    let seq: u32 = seq.parse().ok()?;
    Some((ts.parse().ok()?, seq)).filter(|_| seq > 0)
}

/// How an application's AM is started (kept so later attempts start the same way).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AmLaunch {
    pub job_path: PathBuf,
    /// `--listen` of the AM's dashboard.
    pub listen: Option<String>,
}

/// One AM attempt, as `GET /apps/{id}/appattempts` shows it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AttemptRecord {
    pub attempt: u32,
    pub started_time: u64,
    /// 0 while it runs.
    pub finished_time: u64,
    /// How the attempt's AM process ended ("" while it runs).
    pub diagnostics: String,
    /// The AM process (pid and start time), so a restarted RM can re-attach to it.
    pub process: Option<ProcessId>,
}

/// The sequence number of an id made by [`app_id`] (`None` for other ids).
pub fn app_seq(id: &str) -> Option<u32> {
    parse_app_id(id).map(|(_, seq)| seq)
}

/// One application: what its report says, plus what only the RM needs. Serialized
/// whole into the RM's store, but for the heartbeat's memory, which a restarted RM
/// starts without (the AM re-registers: resync).
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct App {
    /// Id, name, state, final status, exit code, diagnostics, tracking URL, progress,
    /// times and attempt: exactly what `GET /apps/{id}` answers.
    pub report: AppReport,
    token: String,
    #[serde(skip)]
    pub registered: bool,
    /// The AM called finish (its process exiting afterwards is expected).
    pub unregistered: bool,
    /// Answers carry `command: SHUTDOWN` (the application was killed).
    pub shutdown: bool,
    /// The last allocate request's responseId and the answer given to it.
    #[serde(skip)]
    pub last_allocate: Option<(u64, AllocateResponse)>,
    /// Containers of this app that ended since the last allocate answer.
    pub pending_completed: Vec<CompletedContainer>,
    /// Ledger epoch this app's last answer covered (for `updatedNodes`).
    #[serde(skip)]
    pub nodes_seen: u64,
    /// The submitter's job token (also accepted for killing this application).
    job_token: Option<String>,
    /// `None` when the RM launches no AM for it (tests that speak the AM protocol).
    pub launch: Option<AmLaunch>,
    /// Every AM attempt so far, oldest first.
    pub attempts: Vec<AttemptRecord>,
    /// A gang job: its containers are preempted all together or not at all.
    #[serde(default)]
    pub gang: bool,
    /// Its waiting tasks as its AM last reported them (soft state: sent every heartbeat).
    #[serde(skip)]
    pub waiting: Waiting,
    /// Wakes the allocate call its AM lets the RM hold (`AllocateRequest::hold_ms`) when
    /// something for it happens; a wake with no call waiting is kept for the next one.
    #[serde(skip)]
    pub wake: std::sync::Arc<tokio::sync::Notify>,
}

/// An application's waiting work, as its AM reports it, and why it waits.
#[derive(Clone, Debug, Default)]
pub struct Waiting {
    pub tasks: Vec<WaitingTasks>,
    /// When the AM last reported them (they are ignored once stale).
    pub reported: Option<std::time::Instant>,
    /// Since when (milliseconds since the epoch) some task of it has been waiting.
    pub since_ms: Option<u64>,
    /// Why it waits: a short code and the sentence (from the RM's last scheduling pass).
    pub why: Option<(&'static str, String)>,
    /// The same, typed (`Resources` when the queues name no cause of their own).
    pub queue: Option<Reason>,
    /// Why it waits as its AM's placement found it (sent with the waiting demand).
    pub placement: Option<Reason>,
    /// When it is expected to start, with the basis (the RM's scheduling pass, issue 27).
    pub estimate: Option<crate::rm::scheduler::reserved::StartEstimate>,
}

impl Waiting {
    /// Takes a new report (the whole list).
    pub fn report(&mut self, tasks: Vec<WaitingTasks>, now: std::time::Instant) {
        let waits = tasks.iter().any(|t| t.count > 0);
        match (waits, self.since_ms) {
            (true, None) => self.since_ms = Some(now_ms()),
            (false, _) => {
                self.since_ms = None;
                self.why = None;
                self.queue = None;
                self.placement = None;
                self.estimate = None;
            }
            _ => {}
        }
        self.tasks = tasks;
        self.reported = Some(now);
    }

    /// One task of `role` was granted a container by the allocate whose report this is (the
    /// report counts the tasks asked for in it): it no longer waits, so the asks after it in
    /// the same request are not judged against a demand that counts it twice.
    pub fn granted(&mut self, role: &str) {
        if let Some(w) = self.tasks.iter_mut().find(|w| w.role == role && w.count > 0) {
            w.count -= 1;
        }
    }

    /// What the RM's last scheduling pass found (`None`: the application does not wait).
    pub fn set_why(&mut self, why: Option<&crate::rm::scheduler::WaitReason>) {
        self.why = why.map(|w| (w.code(), w.to_string()));
        self.queue = why.map(|w| w.reason());
    }

    /// Why it waits (`reason::combine` of the queue's cause and its AM's reason), with the
    /// time it began waiting where the reason has none; `None` when it does not wait.
    pub fn reason(&self) -> Option<Reason> {
        let since = self.since_ms?;
        let mut r = crate::reason::combine(self.queue.as_ref(), self.placement.as_ref())?;
        r.since_ms.get_or_insert(since);
        Some(r)
    }

    /// The queue's cause as its AM is told it, since it began waiting.
    pub fn queue_reason(&self) -> Option<Reason> {
        let since = self.since_ms?;
        self.queue.clone().map(|r| r.since(since))
    }

    /// The tasks still waiting, unless the last report is older than `ttl`.
    pub fn current(&self, now: std::time::Instant, ttl: std::time::Duration) -> &[WaitingTasks] {
        match self.reported {
            Some(t) if now.saturating_duration_since(t) <= ttl => &self.tasks,
            _ => &[],
        }
    }
}

impl App {
    pub fn new(id: String, name: String) -> Self {
        App {
            report: AppReport {
                id,
                name,
                state: AppState::Accepted,
                final_status: FinalStatus::Undefined,
                exit_code: None,
                diagnostics: String::new(),
                tracking_url: String::new(),
                progress: 0.0,
                started_time: now_ms(),
                finished_time: 0,
                attempt: 1,
                user: String::new(),
                queue: crate::protocol::DEFAULT_QUEUE.to_string(),
                priority: 0,
            },
            token: new_token(),
            registered: false,
            unregistered: false,
            shutdown: false,
            last_allocate: None,
            pending_completed: Vec::new(),
            nodes_seen: 0,
            job_token: None,
            launch: None,
            attempts: Vec::new(),
            gang: false,
            waiting: Waiting::default(),
            wake: Default::default(),
        }
    }

    /// Why it waits, as the RM knows it: its AM has not registered yet (`Starting`, since
    /// it was submitted), else its waiting tasks' reason; `None` once it ended or when
    /// nothing of it waits.
    pub fn wait_reason(&self) -> Option<Reason> {
        if self.report.state.is_final() {
            return None;
        }
        if !self.registered && self.waiting.since_ms.is_none() {
            let r = Reason::new(crate::reason::Kind::Starting, "its application master is starting");
            return Some(r.since(self.report.started_time));
        }
        self.waiting.reason()
    }

    /// Whether its AM must hear something now (an ended container, that it was killed or
    /// ended): an allocate call with news is not held.
    pub fn has_news(&self) -> bool {
        !self.pending_completed.is_empty() || self.shutdown || self.report.state.is_final() || !self.registered
    }

    /// The job token, for the AM's environment.
    pub fn job_token(&self) -> Option<&str> {
        self.job_token.as_deref()
    }

    /// Records that the current attempt's AM process started.
    pub fn attempt_started(&mut self, process: Option<ProcessId>) {
        self.attempts.push(AttemptRecord {
            attempt: self.report.attempt,
            started_time: now_ms(),
            finished_time: 0,
            diagnostics: String::new(),
            process,
        });
    }

    /// Records how the current attempt's AM process ended.
    pub fn attempt_ended(&mut self, how: &str) {
        if let Some(a) = self.attempts.iter_mut().rev().find(|a| a.finished_time == 0) {
            a.finished_time = now_ms();
            a.diagnostics = how.to_string();
        }
    }

    /// The AM process of the attempt that is running, if any.
    pub fn running_am(&self) -> Option<ProcessId> {
        self.attempts
            .last()
            .filter(|a| a.finished_time == 0)
            .and_then(|a| a.process)
    }

    /// Records the submitter's job token (empty = none).
    pub fn set_job_token(&mut self, token: Option<&str>) {
        self.job_token = token.filter(|t| !t.is_empty()).map(str::to_string);
    }

    /// True when `presented` is this application's job token (constant time).
    pub fn job_token_matches(&self, presented: &str) -> bool {
        self.job_token
            .as_deref()
            .is_some_and(|t| constant_time_eq(t.as_bytes(), presented.as_bytes()))
    }

    pub fn token(&self) -> &str {
        &self.token
    }

    pub fn token_matches(&self, presented: &str) -> bool {
        constant_time_eq(self.token.as_bytes(), presented.as_bytes())
    }

    /// Moves to a final state once; later calls change nothing.
    pub fn finish(&mut self, state: AppState, final_status: FinalStatus, exit_code: i32, diagnostics: String) -> bool {
        if self.report.state.is_final() {
            return false;
        }
        self.report.state = state;
        self.report.final_status = final_status;
        self.report.exit_code = Some(exit_code);
        // From the AM (its finish request, its stderr): no terminal escapes kept.
        self.report.diagnostics = crate::text::clean(&diagnostics);
        self.report.finished_time = now_ms();
        if state == AppState::Finished {
            self.report.progress = 1.0;
        }
        true
    }
}

/// All applications by id, remembering which ones changed (or went) since the last
/// [`Apps::take_dirty`]: mutable access is only through `get_mut`/`insert`/`remove`,
/// so nothing can change without being persisted.
#[derive(Default)]
pub struct Apps {
    map: BTreeMap<String, App>,
    dirty: BTreeSet<String>,
    /// The applications that report waiting tasks, so that "does anyone else wait" on the
    /// allocate path costs O(those), not O(every application the RM remembers) (issue 29).
    reporting: Mutex<Reporting>,
}

/// The ids of the applications, not ended, whose AM's last report named waiting tasks
/// (however old it is), brought up to date from `touched` when read.
#[derive(Default)]
struct Reporting {
    ids: BTreeSet<String>,
    /// Changed (or gone) since the ids were last brought up to date.
    touched: BTreeSet<String>,
}

impl Apps {
    pub fn get(&self, id: &str) -> Option<&App> {
        self.map.get(id)
    }

    pub fn get_mut(&mut self, id: &str) -> Option<&mut App> {
        let app = self.map.get_mut(id)?;
        self.dirty.insert(id.to_string());
        self.reporting.get_mut().touched.insert(id.to_string());
        Some(app)
    }

    pub fn insert(&mut self, app: App) {
        self.dirty.insert(app.report.id.clone());
        self.reporting.get_mut().touched.insert(app.report.id.clone());
        self.map.insert(app.report.id.clone(), app);
    }

    pub fn remove(&mut self, id: &str) -> Option<App> {
        self.dirty.insert(id.to_string());
        self.reporting.get_mut().touched.insert(id.to_string());
        self.map.remove(id)
    }

    /// Whether `pred` holds for some application, not ended, whose AM reports waiting
    /// tasks: O(changes since the last call + those applications), not O(applications).
    pub fn any_reporting_waiting(&self, pred: impl Fn(&App) -> bool) -> bool {
        let mut r = self.reporting.lock();
        let Reporting { ids, touched } = &mut *r;
        for id in std::mem::take(touched) {
            match self.map.get(&id) {
                Some(a) if !a.report.state.is_final() && !a.waiting.tasks.is_empty() => ids.insert(id),
                _ => ids.remove(&id),
            };
        }
        ids.iter().filter_map(|id| self.map.get(id)).any(pred)
    }

    pub fn contains_key(&self, id: &str) -> bool {
        self.map.contains_key(id)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn values(&self) -> impl Iterator<Item = &App> {
        self.map.values()
    }

    /// Whether anything changed since the last [`Apps::take_dirty`].
    pub fn has_changes(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// Ids changed or removed since the last call.
    pub fn take_dirty(&mut self) -> Vec<String> {
        std::mem::take(&mut self.dirty).into_iter().collect()
    }

    /// Puts back an application recovered from the store (not marked changed).
    pub fn restore(&mut self, app: App) {
        self.reporting.get_mut().touched.insert(app.report.id.clone());
        self.map.insert(app.report.id.clone(), app);
    }
}

impl std::fmt::Debug for App {
    /// Never prints the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field("id", &self.report.id)
            .field("name", &self.report.name)
            .field("state", &self.report.state)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Whatever happens to the applications, asking the index of those reporting
        /// waiting tasks answers as a scan of them all does.
        #[test]
        fn the_waiting_index_answers_as_a_scan_of_every_application(
            ops in proptest::collection::vec((0u32..6, 0u8..5), 1..60),
            asks in proptest::collection::vec(0u32..6, 1..20),
        ) {
            let mut apps = Apps::default();
            let now = std::time::Instant::now();
            let scan = |apps: &Apps, other: &str| {
                apps.values().any(|a| a.report.id != other && !a.report.state.is_final() && !a.waiting.tasks.is_empty())
            };
            for (k, (seq, op)) in ops.into_iter().enumerate() {
                let id = app_id(1, seq);
                match op {
                    0 => apps.insert(App::new(id.clone(), "x".into())),
                    1 | 2 => {
                        if let Some(a) = apps.get_mut(&id) {
                            let count = u32::from(op == 1);
                            a.waiting.report(vec![WaitingTasks { count, gpus: 1, ..Default::default() }], now);
                            if count == 0 {
                                a.waiting.report(Vec::new(), now);
                            }
                        }
                    }
                    3 => {
                        if let Some(a) = apps.get_mut(&id) {
                            a.finish(AppState::Killed, FinalStatus::Killed, 1, String::new());
                        }
                    }
                    _ => {
                        apps.remove(&id);
                    }
                }
                let other = app_id(1, asks[k % asks.len()]);
                proptest::prop_assert_eq!(
                    apps.any_reporting_waiting(|a| a.report.id != other),
                    scan(&apps, &other)
                );
            }
        }
    }

    #[test]
    fn constant_time_eq_compares() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        let app = App::new("application_1_0001".into(), "x".into());
        assert!(app.token_matches(app.token()));
        assert!(!app.token_matches(""));
        assert!(!format!("{app:?}").contains(app.token()), "Debug never shows the token");
    }

    /// The RM's answer to "why does it wait", one row per stage of an application: its AM
    /// starting; its AM's reason (the topology wait, with its deadline) over the queues'
    /// "nothing fits" guess; a queue cause over the AM's; nothing once it ended.
    #[test]
    fn the_rm_says_why_an_application_waits_at_each_stage() {
        use crate::reason::Kind;
        let mut app = App::new(app_id(1, 1), "x".into());
        let kind = |a: &App| a.wait_reason().map(|r| r.kind);
        assert_eq!(kind(&app), Some(Kind::Starting));
        app.registered = true;
        assert_eq!(kind(&app), None, "registered, nothing reported: it does not wait");
        let w = WaitingTasks {
            count: 1,
            gpus: 2,
            ..Default::default()
        };
        app.waiting.report(vec![w], std::time::Instant::now());
        let topo = Reason::new(Kind::Topology, "holding out").since(5).until(9);
        app.waiting.placement = Some(topo.clone());
        app.waiting
            .set_why(Some(&crate::rm::scheduler::WaitReason::NothingFits));
        assert_eq!(app.wait_reason(), Some(topo));
        let cap = crate::rm::scheduler::WaitReason::AtCap {
            queue: "a".into(),
            max: 1,
        };
        app.waiting.set_why(Some(&cap));
        assert_eq!(kind(&app), Some(Kind::QueueShare));
        app.waiting.report(Vec::new(), std::time::Instant::now());
        assert_eq!(kind(&app), None, "nothing waits any more");
        app.finish(AppState::Finished, FinalStatus::Succeeded, 0, String::new());
        assert_eq!(kind(&app), None);
    }

    #[test]
    fn finish_happens_once() {
        let mut app = App::new(app_id(17, 3), "x".into());
        assert_eq!(app.report.id, "application_17_0003");
        assert_eq!(app_seq(&app_id(17, 12_345)), Some(12_345));
        assert_eq!(app_seq("container_1_0001"), None);
        for bad in [
            "../..",
            "application_1_0",
            "application_1_4294967296",
            "application_x_1",
            "application_1_+1",
            "application_1_2_3",
        ] {
            assert_eq!(parse_app_id(bad), None, "{bad}");
        }
        assert_eq!(parse_app_id("application_17_4294967295"), Some((17, u32::MAX)));
        let mut colored = App::new(app_id(1, 1), "x".into());
        colored.finish(
            AppState::Failed,
            FinalStatus::Failed,
            1,
            "\u{1b}[31mboom\u{1b}[0m".into(),
        );
        assert_eq!(colored.report.diagnostics, "boom");
        assert!(app.finish(AppState::Killed, FinalStatus::Killed, 1, "killed".into()));
        assert!(!app.finish(AppState::Finished, FinalStatus::Succeeded, 0, String::new()));
        let r = app.report.clone();
        assert_eq!(
            (r.state, r.final_status, r.exit_code),
            (AppState::Killed, FinalStatus::Killed, Some(1))
        );
        assert!(r.finished_time > 0);
    }
}
