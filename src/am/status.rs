//! The AM's published status: a snapshot of the job, its tasks, the node view and the
//! recent selection traces, plus a numbered event stream. The AM's publisher (`am::publish`) writes it;
//! the dashboard, the status API, `/metrics` and `gpuam run`'s progress read it. In an AM
//! the node pages are computed from its live view when asked ([`NodeSource`]).
//!
//! Events are numbered so a reconnecting SSE client resumes after the last id it saw
//! (Last-Event-ID); the hub keeps the most recent ones for that.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use tokio::sync::{broadcast, mpsc};

use crate::resources::{parse_mask, CustomResources, GpuMask, GpuShares};
use crate::select::SelectionTrace;

/// Job states as users see them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Hash)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum JobState {
    Starting,
    Waiting,
    Running,
    Succeeded,
    Failed,
    Killed,
}

impl JobState {
    pub fn is_final(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Failed | JobState::Killed)
    }
}

/// Task states (reference/frameworklauncher.md §5.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Hash, PartialOrd, Ord)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TaskState {
    TaskWaiting,
    ContainerRequested,
    ContainerAllocated,
    ContainerLaunched,
    ContainerRunning,
    ContainerCompleted,
    TaskCompleted,
}

impl TaskState {
    pub const ALL: [TaskState; 7] = [
        TaskState::TaskWaiting,
        TaskState::ContainerRequested,
        TaskState::ContainerAllocated,
        TaskState::ContainerLaunched,
        TaskState::ContainerRunning,
        TaskState::ContainerCompleted,
        TaskState::TaskCompleted,
    ];
}

/// Exit classes (reference/frameworklauncher.md §5.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Hash)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ExitType {
    Succeeded,
    TransientNormal,
    TransientConflict,
    NonTransient,
    Unknown,
}

/// One task as published.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskStatus {
    pub role: String,
    pub index: u32,
    pub state: TaskState,
    /// 1 for the first try; +1 per retry.
    pub attempt: u32,
    /// Retries that counted against `taskRetryCount`.
    pub retried_count: u32,
    pub host: Option<String>,
    pub gpus: Vec<u32>,
    pub gpu_mask: Option<String>,
    /// A fractional task's share of its GPU ("0.25").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_share: Option<String>,
    /// Custom resources its container holds.
    #[serde(skip_serializing_if = "CustomResources::is_empty")]
    pub resources: CustomResources,
    /// Ports by label.
    pub ports: Vec<(String, Vec<u16>)>,
    pub container_id: Option<String>,
    pub exit_code: Option<i32>,
    pub exit_type: Option<ExitType>,
    pub exit_diagnostics: Option<String>,
    /// Why the task is not placed, when it is not: [`Self::reason`] as one line of text.
    pub waiting_reason: Option<String>,
    /// Why the task is not placed (waiting, or its ask not yet granted), when it is not.
    pub reason: Option<crate::reason::Reason>,
    /// Milliseconds since the epoch.
    pub created_ms: u64,
    pub launched_ms: Option<u64>,
    pub completed_ms: Option<u64>,
}

/// Counts per state for one role.
#[derive(Clone, Debug, PartialEq, Serialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct RoleCounts {
    pub role: String,
    pub instances: u32,
    pub waiting: u32,
    pub requested: u32,
    pub allocated: u32,
    pub running: u32,
    pub succeeded: u32,
    pub failed: u32,
    /// Stopped because the job ended first (e.g. a parameter server).
    pub stopped: u32,
}

/// One node of the AM's view, as published.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    pub host: String,
    pub rack: String,
    pub labels: Vec<String>,
    pub gpu_type: Option<String>,
    pub state: String,
    /// Preset name, or "custom" for a parsed matrix; None = unknown topology.
    pub topology: Option<String>,
    pub gpu_count: u32,
    /// GPU islands per tier, best tier first (for grouping the GPU boxes): each a list
    /// of masks as hex strings; shared by the nodes of one topology.
    pub gpu_groups: std::sync::Arc<Vec<Vec<String>>>,
    pub total_cpu: u32,
    pub used_cpu: u32,
    pub requested_cpu: u32,
    pub free_cpu: u32,
    pub total_memory_mb: u64,
    pub used_memory_mb: u64,
    pub requested_memory_mb: u64,
    pub free_memory_mb: u64,
    pub total_gpu_mask: String,
    pub used_gpu_mask: String,
    pub requested_gpu_mask: String,
    pub free_gpu_mask: String,
    /// GPUs of this node held by this job's containers.
    pub job_gpu_mask: String,
    pub total_ports: String,
    pub used_ports: String,
    pub free_ports: String,
    /// Hundredths used on GPUs held in part (`{"0": "0.75"}`); a GPU filled exactly by
    /// shares reads as used in full.
    #[serde(skip_serializing_if = "GpuShares::is_empty")]
    pub used_gpu_shares: GpuShares,
    /// Custom resources: offered, used, free (`{"nvme": 2}`).
    #[serde(skip_serializing_if = "CustomResources::is_empty")]
    pub custom_resources: CustomResources,
    #[serde(skip_serializing_if = "CustomResources::is_empty")]
    pub used_custom_resources: CustomResources,
    #[serde(skip_serializing_if = "CustomResources::is_empty")]
    pub free_custom_resources: CustomResources,
}

/// Where the dashboard's node pages come from in an AM: its live node view, turned into
/// [`NodeStatus`]es only for the page asked for (issue 29: an AM of a 10,000-node cluster
/// no longer builds 10,000 of them at its start and after each full listing).
pub trait NodeSource: Send + Sync {
    /// The nodes whose host contains `host` (all with `None`), in host order: how many
    /// there are, and `limit` of them from `offset`. `job_gpus`: this job's GPUs per host.
    fn page(
        &self,
        host: Option<&str>,
        offset: usize,
        limit: usize,
        job_gpus: &HashMap<String, GpuMask>,
    ) -> (usize, Vec<NodeStatus>);
}

/// A dashboard page: `limit` of `items` from `offset`, and how many there are in all.
pub fn page_of<T>(items: impl Iterator<Item = T>, offset: usize, limit: usize) -> (usize, Vec<T>) {
    let mut total = 0;
    let mut page = Vec::new();
    for it in items {
        if total >= offset && page.len() < limit {
            page.push(it);
        }
        total += 1;
    }
    (total, page)
}

/// The GPUs this job's containers hold, per host: those of the tasks that hold one.
pub fn job_gpus(tasks: &[TaskStatus]) -> HashMap<String, GpuMask> {
    let mut m: HashMap<String, GpuMask> = HashMap::new();
    for t in tasks {
        let holds = matches!(
            t.state,
            TaskState::ContainerAllocated | TaskState::ContainerLaunched | TaskState::ContainerRunning
        );
        if let (true, Some(host), Some(mask)) = (holds, &t.host, t.gpu_mask.as_deref().and_then(parse_mask)) {
            *m.entry(host.clone()).or_insert(0) |= mask;
        }
    }
    m
}

/// One selection, as published.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SelectionRecord {
    pub role: String,
    pub index: u32,
    pub at_ms: u64,
    /// "placed", "notNow" or "impossible".
    pub outcome: String,
    pub reason: Option<String>,
    pub host: Option<String>,
    pub gpu_mask: Option<String>,
    pub gpus: Vec<u32>,
    pub ports: Option<String>,
    pub gpu_tier: Option<u8>,
    pub gpu_tier_ideal: Option<bool>,
    pub gpu_weight: Option<u32>,
    /// The NIC(s) nearest the GPUs, where the node's topology lists NICs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nic: Option<String>,
    pub trace: SelectionTrace,
}

/// The job as published.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct JobStatus {
    pub name: String,
    pub app_id: String,
    pub state: JobState,
    pub attempt: u32,
    pub gang: bool,
    pub started_ms: u64,
    pub finished_ms: Option<u64>,
    pub exit_code: Option<i32>,
    pub diagnostics: Option<String>,
    pub total_tasks: u32,
    pub completed_tasks: u32,
    pub roles: Vec<RoleCounts>,
    pub rm_url: String,
    /// The RM queue the job runs in, and its priority there.
    pub queue: String,
    pub priority: i32,
    /// Why the RM's queues keep the job's waiting tasks waiting (its queue at its cap,
    /// behind a queue below its share, GPUs being taken back for it, ...).
    pub queue_note: Option<String>,
    /// Why the job waits, while some task of it is not placed: the RM's queue cause or the
    /// reason of the task that holds it back (`reason::combine`).
    pub reason: Option<crate::reason::Reason>,
    /// When the RM expects its waiting tasks to start, and on what basis (issue 27).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_estimate: Option<crate::protocol::StartEstimate>,
}

/// Everything the AM publishes, in one consistent snapshot.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    pub job: JobStatus,
    pub tasks: Vec<TaskStatus>,
    /// The node view where no [`NodeSource`] backs it (the demo); an AM's is computed when
    /// asked ([`SnapshotOut`]).
    #[serde(skip)]
    pub nodes: Vec<NodeStatus>,
    /// Most recent last.
    pub selections: VecDeque<SelectionRecord>,
    /// Milliseconds since the epoch of the last full node refresh.
    pub nodes_refreshed_ms: u64,
    pub registered: bool,
    pub rm_reachable: bool,
    /// The effective settings.
    pub config: serde_json::Value,
}

/// A snapshot as the status API writes it: with its node view, from the [`NodeSource`] where
/// one backs it.
#[derive(Serialize)]
pub struct SnapshotOut<'a> {
    #[serde(flatten)]
    pub snapshot: &'a Snapshot,
    /// `None`: left out (`?nodes=0`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nodes: Option<&'a [NodeStatus]>,
}

/// A numbered change notification.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Event {
    pub id: u64,
    /// "job", "task", "selection" or "nodes".
    pub kind: &'static str,
    pub data: serde_json::Value,
}

/// A request from the dashboard to the AM (the binary forwards it to the driver).
#[derive(Debug)]
pub enum Command {
    Kill { reason: String },
}

/// Counters for `/metrics` that are not derivable from the snapshot.
#[derive(Debug, Default)]
pub struct Counters {
    pub rm_errors: AtomicU64,
    /// Times the RM asked this AM to register again (it had restarted).
    pub rm_resyncs: AtomicU64,
    pub retries_transient: AtomicU64,
    pub retries_permanent: AtomicU64,
    pub retries_unknown: AtomicU64,
    /// Allocate round-trip latencies: a cumulative histogram (every sample counted,
    /// none ever dropped, so its counts only grow).
    pub allocate_latency: LatencyHistogram,
    /// Nodes filtered per stage name, summed over all selections.
    pub filtered_per_stage: Mutex<std::collections::BTreeMap<&'static str, u64>>,
}

/// Upper bounds (seconds) of the allocate-latency histogram's buckets.
pub const ALLOCATE_LATENCY_BUCKETS: [f64; 12] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

/// A Prometheus histogram (`prometheus-client`) of durations in seconds over
/// [`ALLOCATE_LATENCY_BUCKETS`]; clones share the same counts.
#[derive(Clone, Debug)]
pub struct LatencyHistogram(pub prometheus_client::metrics::histogram::Histogram);

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram(prometheus_client::metrics::histogram::Histogram::new(
            ALLOCATE_LATENCY_BUCKETS,
        ))
    }
}

impl LatencyHistogram {
    pub fn observe(&self, d: std::time::Duration) {
        self.0.observe(d.as_secs_f64());
    }
}

/// Where the dashboard reads container logs from.
pub trait LogSource: Send + Sync {
    /// The last `tail` bytes of a container's stream ("stdout" or "stderr").
    fn read(
        &self,
        container_id: &str,
        stream: &str,
        tail: u64,
    ) -> futures::future::BoxFuture<'static, Result<String, String>>;
}

/// How many events a reconnecting client can catch up on.
const EVENT_HISTORY: usize = 4096;
/// How many selection records the snapshot keeps.
pub const SELECTION_HISTORY: usize = 200;

/// The shared status hub.
pub struct StatusHub {
    snapshot: RwLock<Snapshot>,
    seq: AtomicU64,
    history: Mutex<VecDeque<Event>>,
    events: broadcast::Sender<Event>,
    commands: mpsc::UnboundedSender<Command>,
    /// Token that mutating dashboard calls must present.
    pub job_token: String,
    pub counters: Counters,
    pub logs: Arc<dyn LogSource>,
    /// The AM's RM client, through which the dashboard's kill passes a user's token (the
    /// owner's or the admin's) for the RM to judge (`crate::web::api::kill`).
    pub rm: std::sync::OnceLock<crate::am::rm_client::RmClient>,
    /// Asks the RM about tokens other than the job token (`crate::web::access`).
    token_check: std::sync::OnceLock<TokenCheck>,
    /// The AM's live node view, from which the dashboard's node pages are computed when
    /// asked (`None`: the snapshot's `nodes`, as the demo has them).
    pub node_source: std::sync::OnceLock<Arc<dyn NodeSource>>,
    /// Tokens the RM accepted lately.
    pub(crate) accepted: Accepted,
    /// Tokens the RM refused lately: asked again only after [`REFUSED_FOR`].
    pub(crate) refused: Accepted,
    /// Bounds the RM checks in flight at once ([`MAX_CHECKS`]).
    pub(crate) checks: tokio::sync::Semaphore,
}

impl StatusHub {
    /// Lets the dashboard accept tokens the RM accepts for this job (its owner's, the
    /// admin's) besides the job token; set once.
    pub fn set_token_check(&self, check: TokenCheck) {
        let _ = self.token_check.set(check);
    }

    /// See [`StatusHub::set_token_check`].
    pub fn token_check(&self) -> Option<&TokenCheck> {
        self.token_check.get()
    }

    pub fn new(
        snapshot: Snapshot,
        job_token: String,
        logs: Arc<dyn LogSource>,
    ) -> (Arc<StatusHub>, mpsc::UnboundedReceiver<Command>) {
        let (tx, _) = broadcast::channel(1024);
        let (ctx, crx) = mpsc::unbounded_channel();
        let hub = StatusHub {
            snapshot: RwLock::new(snapshot),
            seq: AtomicU64::new(0),
            history: Mutex::new(VecDeque::new()),
            events: tx,
            commands: ctx,
            job_token,
            counters: Counters::default(),
            logs,
            rm: std::sync::OnceLock::new(),
            token_check: std::sync::OnceLock::new(),
            node_source: std::sync::OnceLock::new(),
            accepted: Accepted::new(ACCEPTED_FOR, MAX_REMEMBERED),
            refused: Accepted::new(REFUSED_FOR, MAX_REFUSED),
            checks: tokio::sync::Semaphore::new(MAX_CHECKS),
        };
        (Arc::new(hub), crx)
    }

    /// A copy of the current snapshot.
    pub fn snapshot(&self) -> Snapshot {
        self.snapshot.read().clone()
    }

    /// Reads the snapshot without copying it.
    pub fn read<R>(&self, f: impl FnOnce(&Snapshot) -> R) -> R {
        f(&self.snapshot.read())
    }

    /// Changes the snapshot and publishes one event describing the change.
    pub fn update(&self, kind: &'static str, data: serde_json::Value, f: impl FnOnce(&mut Snapshot)) {
        f(&mut self.snapshot.write());
        self.publish(kind, data);
    }

    /// Publishes an event without changing the snapshot.
    pub fn publish(&self, kind: &'static str, data: serde_json::Value) {
        let mut hist = self.history.lock();
        let id = self.seq.fetch_add(1, Ordering::SeqCst) + 1;
        let ev = Event { id, kind, data };
        hist.push_back(ev.clone());
        if hist.len() > EVENT_HISTORY {
            hist.pop_front();
        }
        // No receiver is fine: nobody is watching.
        let _ = self.events.send(ev);
    }

    /// Subscribes to new events, returning the events after `last_id` that are still
    /// kept (for Last-Event-ID) and a receiver for the ones to come. The two never
    /// miss or repeat an event: both are taken under the history lock.
    pub fn subscribe(&self, last_id: Option<u64>) -> (Vec<Event>, broadcast::Receiver<Event>) {
        let hist = self.history.lock();
        let rx = self.events.subscribe();
        let missed = match last_id {
            Some(id) => hist.iter().filter(|e| e.id > id).cloned().collect(),
            None => Vec::new(),
        };
        (missed, rx)
    }

    /// The id of the newest event.
    pub fn last_event_id(&self) -> u64 {
        self.seq.load(Ordering::SeqCst)
    }

    /// Sends a command to the AM; false if its driver has ended.
    pub fn command(&self, c: Command) -> bool {
        self.commands.send(c).is_ok()
    }
}

// ---- tokens the dashboard takes besides the job token (checked by `web::access`) ----

/// Asks the RM whether a token may read this job (owner or admin): `Some(true)` it may,
/// `Some(false)` the RM refused it, `None` no answer (unreachable, busy, an error of its
/// own): not a refusal, so not remembered as one.
pub type TokenCheck = Arc<dyn Fn(String) -> futures::future::BoxFuture<'static, Option<bool>> + Send + Sync>;

/// How long a token the RM accepted is taken without asking again.
pub const ACCEPTED_FOR: std::time::Duration = std::time::Duration::from_secs(30);
/// Most accepted tokens remembered.
const MAX_REMEMBERED: usize = 256;
/// How long a token the RM refused is refused without asking again (a token made valid
/// meanwhile, a new user's, works after this).
pub const REFUSED_FOR: std::time::Duration = std::time::Duration::from_secs(10);
/// Most refused tokens remembered (the oldest are forgotten first).
const MAX_REFUSED: usize = 1024;
/// RM checks in flight at once; more wait their turn.
pub const MAX_CHECKS: usize = 8;

/// Tokens the RM answered about, by digest, with when: each is taken as answered for
/// `ttl`; at most `max` are kept (the oldest forgotten first).
pub struct Accepted {
    seen: parking_lot::Mutex<std::collections::HashMap<String, std::time::Instant>>,
    ttl: std::time::Duration,
    max: usize,
}

impl Accepted {
    pub fn new(ttl: std::time::Duration, max: usize) -> Self {
        Accepted {
            seen: Default::default(),
            ttl,
            max,
        }
    }

    pub(crate) fn fresh(&self, digest: &str, now: std::time::Instant) -> bool {
        self.seen
            .lock()
            .get(digest)
            .is_some_and(|t| now.saturating_duration_since(*t) < self.ttl)
    }

    pub(crate) fn remember(&self, digest: String, now: std::time::Instant) {
        let mut m = self.seen.lock();
        m.retain(|_, t| now.saturating_duration_since(*t) < self.ttl);
        while m.len() >= self.max {
            let Some(oldest) = m.iter().min_by_key(|(_, t)| **t).map(|(d, _)| d.clone()) else {
                break;
            };
            m.remove(&oldest);
        }
        m.insert(digest, now);
    }
}
