//! Wire types of the RM REST contract (DESIGN.md §3), shared by the RM, the AM,
//! the executor client and the CLI. JSON, camelCase, GPU masks as hex strings.
//!
//! The node listing's own types live in `cluster::rm_json`, next to the code that
//! turns them into `cluster::Node`s.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::resources::{mask_serde, CustomResources, GpuMask, GpuShares, PortSet, Resources, ANY_GPU};

/// Milliseconds since the epoch, as every timestamp of the wire is written (the one clock
/// helper of the crate; 0 if the clock is before 1970).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Whether `id` is a safe container id (or host name in a credentials file): one
/// component of a path on a node, `[A-Za-z0-9_.-]+` and not `.` / `..` (which would name
/// the root or its parent), at most 255 bytes (a directory name's limit).
pub fn valid_container_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 255
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-')
}

/// YARN ContainerExitStatus values the RM reports.
pub mod exit_status {
    pub const SUCCESS: i32 = 0;
    pub const INVALID: i32 = -1000;
    /// Released, or lost with its node ("Container released on a *lost* node").
    pub const ABORTED: i32 = -100;
    pub const DISKS_FAILED: i32 = -101;
    pub const PREEMPTED: i32 = -102;
    pub const KILLED_BY_APPMASTER: i32 = -105;
    pub const KILLED_BY_RESOURCEMANAGER: i32 = -106;
    pub const KILLED_AFTER_APP_COMPLETION: i32 = -107;
}

/// Why the RM aborted a container (exit [`exit_status::ABORTED`]), typed: the RM writes the
/// cause's diagnostics (YARN's words, which the wire keeps) and the AM reads the cause back
/// from them here, the one place either side spells them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbortCause {
    /// The container's node was lost.
    NodeLost,
    /// Granted but never started within the expiry.
    Expired,
}

impl AbortCause {
    const ALL: [AbortCause; 2] = [AbortCause::NodeLost, AbortCause::Expired];

    /// The diagnostics the RM reports for this cause.
    pub const fn diagnostics(self) -> &'static str {
        match self {
            AbortCause::NodeLost => "Container released on a *lost* node",
            AbortCause::Expired => "Container expired since it was unused",
        }
    }

    /// The cause that a container's diagnostics report, if any (case aside).
    pub fn of(diagnostics: &str) -> Option<AbortCause> {
        let d = diagnostics.to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|c| d.contains(&c.diagnostics().to_ascii_lowercase()))
    }
}

/// Why a node ended a container that went past a bound of its own: the task's failure,
/// counted against `taskRetryCount` (`am::exits::classify`). Typed on the node's side of
/// the wire (`cause` beside the diagnostics in a node's end report, [`crate::node::NodeEvent`]);
/// the diagnostics lead with its words ([`EndCause::diagnostics`]), and [`EndCause::of`]
/// reads the cause back from diagnostics that came without it (an older node, or through
/// the RM, which keeps the text). This is the one place either side spells them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "SCREAMING_SNAKE_CASE")]
pub enum EndCause {
    /// The kernel killed a process of it in its own memory limit (MiB; `None`: unknown).
    OutOfMemory {
        #[serde(rename = "limitMb", default)]
        limit_mb: Option<u64>,
    },
    /// Its directory went past `node.max_container_disk_mb` (MiB).
    DiskLimit {
        #[serde(rename = "limitMb")]
        limit_mb: u64,
    },
    /// It ran past the run-time limit its spec declared (`maxRunSec`, seconds); the RM
    /// ends it (issue 27).
    RunLimit {
        #[serde(rename = "maxRunSec")]
        max_run_sec: u64,
    },
}

/// What a node's end diagnostics put before the end of a failed task's stderr; what follows
/// it is the task's own text, which no reader may take as the node's words.
pub const STDERR_TAIL_MARK: &str = "; end of stderr: ";

impl EndCause {
    const OOM_WORDS: &'static str = "out of memory (limit ";
    const DISK_WORDS: &'static str = "disk limit exceeded (";
    const RUN_WORDS: &'static str = "ran past its declared limit maxrunsec=";

    /// The words the diagnostics lead with: `out of memory (limit 64 MiB)`,
    /// `disk limit exceeded (16 MiB)`.
    pub fn diagnostics(self) -> String {
        match self {
            EndCause::OutOfMemory { limit_mb: Some(mb) } => format!("{}{mb} MiB)", Self::OOM_WORDS),
            EndCause::OutOfMemory { limit_mb: None } => format!("{}unknown MiB)", Self::OOM_WORDS),
            EndCause::DiskLimit { limit_mb } => format!("{}{limit_mb} MiB)", Self::DISK_WORDS),
            EndCause::RunLimit { max_run_sec } => format!("ran past its declared limit maxRunSec={max_run_sec}"),
        }
    }

    /// The cause that diagnostics report, if any (case aside); the limit as written
    /// (an unreadable one: `None` for memory, 0 for disk). Only the node's words count:
    /// what follows [`STDERR_TAIL_MARK`] is the task's, which could print the same words to
    /// change how its failure is classified.
    pub fn of(diagnostics: &str) -> Option<EndCause> {
        let node_words = diagnostics.split(STDERR_TAIL_MARK).next().unwrap_or_default();
        let d = node_words.to_ascii_lowercase();
        let limit = |words: &str| -> Option<Option<u64>> {
            let rest = &d[d.find(words)? + words.len()..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            Some(digits.parse().ok())
        };
        if let Some(mb) = limit(Self::OOM_WORDS) {
            return Some(EndCause::OutOfMemory { limit_mb: mb });
        }
        if let Some(sec) = limit(Self::RUN_WORDS) {
            return Some(EndCause::RunLimit {
                max_run_sec: sec.unwrap_or(0),
            });
        }
        limit(Self::DISK_WORDS).map(|mb| EndCause::DiskLimit {
            limit_mb: mb.unwrap_or(0),
        })
    }
}

/// Application states (YARN's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AppState {
    New,
    Submitted,
    Accepted,
    Running,
    Finished,
    Failed,
    Killed,
}

impl AppState {
    pub fn is_final(self) -> bool {
        matches!(self, AppState::Finished | AppState::Failed | AppState::Killed)
    }
}

/// Final application status reported by the AM at finish.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Hash, Default)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum FinalStatus {
    #[default]
    Undefined,
    Succeeded,
    Failed,
    Killed,
}

/// `POST /ws/v1/cluster/apps/new-application` answer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NewApplication {
    pub application_id: String,
    pub maximum_resource_capability: Resources,
}

/// `POST /ws/v1/cluster/apps` body.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SubmitApplication {
    pub application_id: String,
    /// The job spec's YAML text (validated by the RM before it is accepted).
    pub job_spec: String,
    /// Where the spec came from, for error messages.
    #[serde(default)]
    pub job_spec_name: Option<String>,
    /// Address the AM's dashboard should listen on (`127.0.0.1:0` = any free port).
    #[serde(default)]
    pub dashboard_listen: Option<String>,
    /// Token for the dashboard's mutating calls (kill), chosen by the submitter and
    /// handed to the AM in its environment (`GPUAM_JOB_TOKEN`), never on a command line.
    #[serde(default)]
    pub job_token: Option<String>,
}

/// `GET /ws/v1/cluster/apps/{id}` answer (inside `{"app": ...}`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AppReport {
    pub id: String,
    pub name: String,
    pub state: AppState,
    pub final_status: FinalStatus,
    /// Job exit code once finished (DESIGN.md §7: 0 success, 1 failed or killed).
    pub exit_code: Option<i32>,
    pub diagnostics: String,
    /// The AM's dashboard URL once it registered.
    pub tracking_url: String,
    pub progress: f32,
    /// Milliseconds since the epoch.
    pub started_time: u64,
    pub finished_time: u64,
    pub attempt: u32,
    /// Who submitted it (the user of the credential; `admin` for the admin token).
    #[serde(default)]
    pub user: String,
    /// The queue it runs in (`default` when the job names none).
    #[serde(default = "default_queue")]
    pub queue: String,
    /// The job's priority within its queue (higher first; default 0).
    #[serde(default)]
    pub priority: i32,
}

/// The queue of a job that names none.
pub const DEFAULT_QUEUE: &str = "default";

fn default_queue() -> String {
    DEFAULT_QUEUE.to_string()
}

/// `PUT /ws/v1/cluster/apps/{id}/state` body.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AppStateUpdate {
    pub state: AppState,
}

/// `POST /ws/v1/am/{appId}/register` body.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RegisterRequest {
    pub host: String,
    pub tracking_url: String,
}

/// Register answer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RegisterResponse {
    pub maximum_capability: Resources,
    /// Every container the RM holds for this application, live or completed: for a
    /// new attempt, its earlier attempts' (work-preserving AM restart); for an AM that
    /// registers again after `RESYNC`, its own as well (RM restart).
    pub containers_from_previous_attempts: Vec<PreviousContainer>,
    pub attempt: u32,
    /// Containers granted but never started expire after this many seconds.
    pub container_expiry_sec: u64,
}

/// One container ask: exactly one container, pinned to a host, a GPU mask and ports.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Ask {
    pub request_id: u64,
    pub host: String,
    pub cpu: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    #[serde(with = "mask_serde", default)]
    pub gpu_mask: GpuMask,
    /// A fractional ask: its one GPU's share, `{"2": "0.25"}` (the index is the mask's
    /// bit); absent for whole GPUs.
    #[serde(default, skip_serializing_if = "GpuShares::is_empty")]
    pub gpu_shares: GpuShares,
    #[serde(default)]
    pub ports: PortSet,
    /// Custom resources, `{"nvme": 1}`; absent when none.
    #[serde(default, skip_serializing_if = "CustomResources::is_empty")]
    pub custom_resources: CustomResources,
    /// Which task the container is for ("role/index"), kept with the container so that
    /// a later AM attempt can re-adopt it (work-preserving AM restart).
    #[serde(default)]
    pub task: Option<String>,
    /// The task's attempt number this container serves.
    #[serde(default)]
    pub task_attempt: u32,
    /// Asks of one allocate call with the same gang id are granted all together or not
    /// at all (a gang job's containers); `None`: this ask alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang: Option<String>,
    /// The task's declared run-time limit in seconds (`maxRunSec`, issue 27): the RM ends
    /// the container once it has run this long, and counts on its room coming back then
    /// (reservations, start estimates). `None`: no limit declared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_run_sec: Option<u64>,
}

impl Ask {
    /// An ask for exactly `r` on `host`.
    pub fn for_resources(request_id: u64, host: &str, r: &Resources) -> Ask {
        Ask {
            request_id,
            host: host.to_string(),
            cpu: r.cpu,
            memory_mb: r.memory_mb,
            gpu_mask: r.gpu_mask,
            gpu_shares: r.gpu_shares.clone(),
            ports: r.ports.clone(),
            custom_resources: r.custom.clone(),
            task: None,
            task_attempt: 0,
            gang: None,
            max_run_sec: None,
        }
    }

    pub fn resources(&self) -> Resources {
        let mut r = Resources::with_mask(self.cpu, self.memory_mb, self.gpu_mask, self.ports.clone());
        r.gpu_shares = self.gpu_shares.clone();
        r.custom = self.custom_resources.clone();
        r
    }
}

/// A task's name as asks and containers carry it (`Ask::task`): "worker/3" → ("worker",
/// Some(3)); anything else → (it, None).
pub fn split_task(task: &str) -> (&str, Option<u32>) {
    match task.rsplit_once('/') {
        Some((role, i)) => match i.parse() {
            Ok(i) => (role, Some(i)),
            Err(_) => (task, None),
        },
        None => (task, None),
    }
}

/// `POST /ws/v1/am/{appId}/allocate` body (the heartbeat).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AllocateRequest {
    /// The last answer's `responseId` (0 at first). A repeat gets the same answer again.
    pub response_id: u64,
    #[serde(default)]
    pub progress: f32,
    #[serde(default)]
    pub asks: Vec<Ask>,
    /// Request ids to withdraw.
    #[serde(default)]
    pub cancels: Vec<u64>,
    /// Container ids to give back (stopped if running).
    #[serde(default)]
    pub releases: Vec<String>,
    /// Tasks this AM wants containers for and has none yet (YARN's resource requests for
    /// any host): those it finds no room for now and those it asks for in this request, the
    /// whole list each time. The RM's queues rank and reclaim for this demand, and judge this
    /// request's asks against it (each granted ask leaves it). `None` (an AM that never
    /// sends it): no waiting demand known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<Vec<WaitingTasks>>,
    /// Why its tasks wait as the AM's placement found it (`reason::Reason`: the select
    /// outcome of the task that holds the job back, with the topology wait's deadline);
    /// the RM shows it unless its queues name a cause of their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_reason: Option<crate::reason::Reason>,
    /// An AM with nothing to ask, cancel or release and nothing to place may let the RM
    /// hold the answer this long (milliseconds; the RM caps it at [`MAX_ALLOCATE_HOLD_MS`])
    /// until something for the application happens: a container of it ends, a preemption
    /// notice, a kill. An idle AM then costs the RM one call per hold, not one per
    /// heartbeat, and still hears of an end at once (issue 29).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_ms: Option<u64>,
}

/// The longest the RM holds an allocate answer ([`AllocateRequest::hold_ms`]).
pub const MAX_ALLOCATE_HOLD_MS: u64 = 2000;

impl AllocateRequest {
    /// How long the RM may hold this request's answer: only one that asks, cancels and
    /// releases nothing, and at most `cap`.
    pub fn hold(&self, cap: std::time::Duration) -> Option<std::time::Duration> {
        let asked = std::time::Duration::from_millis(self.hold_ms.filter(|&ms| ms > 0)?);
        (self.asks.is_empty() && self.cancels.is_empty() && self.releases.is_empty()).then(|| asked.min(cap))
    }
}

/// What a start estimate rests on (issue 27): the running containers on the nodes the job
/// may use, by where their expected end comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct StartBasis {
    /// Ending by their declared `maxRunSec`.
    pub declared: u32,
    /// Ending by their declared `maxRunSec`, calibrated by what their users' ended runs used
    /// of their limits (the median run / limit).
    pub calibrated: u32,
    /// Ending by a learned run time (the median of their job's completed tasks of the role).
    pub learned: u32,
    /// With no known end (never counted as ending).
    pub unknown: u32,
}

impl StartBasis {
    pub fn is_zero(&self) -> bool {
        *self == StartBasis::default()
    }

    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &StartBasis) {
        self.declared += other.declared;
        self.calibrated += other.calibrated;
        self.learned += other.learned;
        self.unknown += other.unknown;
    }
}

/// When a waiting application is expected to start, and on what basis (issue 27, item 4;
/// `rm::scheduler::reserved::estimates`): in the job route's `waiting.estimate`, the cluster
/// page's `startEstimate` and the AM's allocate answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartEstimate {
    /// Expected start (ms since the epoch); `None` when it cannot be told. A job that is no
    /// gang starts when its first waiting task does.
    pub start_ms: Option<u64>,
    /// A job that is no gang, whose waiting tasks start one by one: when the last of them is
    /// expected to start; absent when that is `startMs`, or when it cannot be told.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub all_start_ms: Option<u64>,
    /// The running containers it rests on.
    #[serde(default)]
    pub basis: StartBasis,
    /// The waiting jobs ahead of it (on nodes it may use too), by where their expected
    /// run time comes from (`maxRunSec`, learned, none).
    #[serde(default, skip_serializing_if = "StartBasis::is_zero")]
    pub queue_ahead: StartBasis,
    /// Another gang's reservation it starts after, if any, named by its size (never by its
    /// application id: it may be another tenant's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after_reservation_of: Option<String>,
    /// The basis in words.
    pub text: String,
}

/// `POST /ws/v1/cluster/estimate` body (issue 27): a job not yet submitted, as its AM would
/// report it waiting; the answer is a [`StartEstimate`] (`gpuam plan --rm`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EstimateRequest {
    /// Its queue (`None`: the default queue).
    #[serde(default)]
    pub queue: Option<String>,
    #[serde(default)]
    pub priority: i32,
    /// All its tasks or none.
    #[serde(default)]
    pub gang: bool,
    pub waiting: Vec<WaitingTasks>,
    /// The job's name: the caller's own earlier runs of a job of this name tell how long its
    /// tasks run where no role declares `maxRunSec` (never another user's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// `count` waiting tasks of one shape (one task role): what a queue's share is computed
/// for and what preemption frees room for.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, Hash, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WaitingTasks {
    /// The task role (for display).
    #[serde(default)]
    pub role: String,
    pub count: u32,
    /// GPUs per task, all on one node.
    #[serde(default)]
    pub gpus: u32,
    #[serde(default)]
    pub cpu: u32,
    #[serde(default, rename = "memoryMB")]
    pub memory_mb: u64,
    /// Acceptable GPU types (empty: any).
    #[serde(default)]
    pub gpu_types: Vec<String>,
    /// The node partition (label) the tasks go to (`None`: unlabelled nodes).
    #[serde(default)]
    pub node_label: Option<String>,
    // What else the feasibility rule (`select::feasible`) needs, so the RM's gate and
    // preemption keep or free only room placement can use. Optional: an older AM's
    // waiting tasks read as whole GPUs, CPU and memory only.
    /// A fractional task's share of its one GPU in hundredths (`None`: whole GPUs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_share: Option<u32>,
    /// An explicit GPU mask per task (0: any GPUs).
    #[serde(default, with = "mask_serde", skip_serializing_if = "is_zero")]
    pub gpu_mask: GpuMask,
    /// Custom resources per task.
    #[serde(default, skip_serializing_if = "CustomResources::is_empty")]
    pub custom: CustomResources,
    /// Concrete ports per task (static or reused).
    #[serde(default, skip_serializing_if = "PortSet::is_empty")]
    pub ports: PortSet,
    /// Ports per task drawn at or above `minPort` besides `ports`.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub dynamic_ports: u32,
    #[serde(default, skip_serializing_if = "is_zero_u16")]
    pub min_port: u16,
    /// The none-GPU rule applies: the job asks no GPU and the AM keeps such jobs off GPU
    /// nodes (`select.allow_none_gpu_job_on_gpu_node` off).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep_off_gpu_nodes: bool,
    /// The role's declared run-time limit (`maxRunSec`, issue 27): how long these tasks
    /// hold their room once started, for the start estimates of the jobs behind them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_run_sec: Option<u64>,
}

fn is_zero(m: &GpuMask) -> bool {
    *m == 0
}
fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}
fn is_zero_u16(n: &u16) -> bool {
    *n == 0
}

impl WaitingTasks {
    /// One task's GPUs in hundredths as the queues count them (its request's
    /// [`Resources::hundredths`]: its share, or 100 per GPU).
    pub fn hundredths(&self) -> u32 {
        let shares = self
            .gpu_share
            .map_or_else(GpuShares::new, |h| GpuShares::one(ANY_GPU, h));
        let whole = self.gpus.saturating_sub(shares.len() as u32);
        crate::resources::shares::hundredths(whole, &shares)
    }

    /// One task's request as the shortfall rule reads it (concrete ports included).
    pub fn request(&self) -> Resources {
        Resources::request(
            self.cpu,
            self.memory_mb,
            self.gpus,
            self.gpu_mask,
            self.gpu_share,
            self.ports.clone(),
            self.custom.clone(),
        )
    }
}

/// A container the RM takes back (YARN's PreemptionMessage, strict form): the AM should
/// let the task checkpoint (the node created `GPUAM_PREEMPT_FILE` for it) and release the
/// container before the deadline; the RM stops it at the deadline regardless.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PreemptNotice {
    pub container_id: String,
    /// Milliseconds since the epoch.
    pub deadline_ms: u64,
    /// Why (which queue or job the GPUs go to).
    pub reason: String,
}

/// A granted container: exactly what was asked.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Container {
    pub container_id: String,
    pub request_id: u64,
    pub host: String,
    /// Where the node's executor listens (base URL, e.g. `http://127.0.0.1:8088`).
    pub node_http_address: String,
    /// The address its peers reach it at: the node's IP where the node has one (node
    /// agents, Ray nodes); absent for simulated nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_ip: Option<std::net::IpAddr>,
    pub resources: Resources,
    /// The task it was asked for ("role/index"), from the ask.
    #[serde(default)]
    pub task: Option<String>,
    #[serde(default)]
    pub task_attempt: u32,
}

impl Container {
    /// The host part of the address its peers are given (`GPUAM_HOSTS_<ROLE>`,
    /// "host:port"): the node's IP when the node has one (IPv6 in brackets), else the
    /// host name.
    pub fn peer_host(&self) -> String {
        match self.node_ip {
            Some(std::net::IpAddr::V6(ip)) => format!("[{ip}]"),
            Some(ip) => ip.to_string(),
            None => self.host.clone(),
        }
    }
}

/// A container of an earlier attempt of this application, as a new AM attempt receives
/// it at registration: live ones to re-adopt, completed ones to learn how tasks ended.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PreviousContainer {
    #[serde(flatten)]
    pub container: Container,
    pub state: ContainerState,
    pub exit_status: Option<i32>,
    #[serde(default)]
    pub diagnostics: String,
}

/// An ask the RM refused.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Rejection {
    pub request_id: u64,
    pub reason: String,
    /// False when the ask can never be granted as written (unknown host, bigger than the node).
    pub retryable: bool,
    /// Why, typed (`reason::Reason`), when the RM's queue gate refused it: the task waits
    /// for its queue (`QueueShare`, `Priority`, `Reclaiming`), not for another try.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait: Option<Box<crate::reason::Reason>>,
}

/// A container that ended.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CompletedContainer {
    pub container_id: String,
    pub exit_status: i32,
    pub diagnostics: String,
}

/// Instruction from the RM to the AM.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AmCommand {
    /// Register again (the RM lost this attempt's registration).
    Resync,
    /// Stop now (the application was killed).
    Shutdown,
}

/// Allocate answer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct AllocateResponse {
    pub response_id: u64,
    #[serde(default)]
    pub allocated: Vec<Container>,
    #[serde(default)]
    pub rejected: Vec<Rejection>,
    #[serde(default)]
    pub completed: Vec<CompletedContainer>,
    /// Nodes that changed since the last answer (YARN node objects on the wire).
    #[serde(default, deserialize_with = "crate::cluster::rm_json::readable_node_reports")]
    pub updated_nodes: Vec<crate::cluster::rm_json::NodeReport>,
    #[serde(default)]
    pub num_cluster_nodes: u32,
    #[serde(default)]
    pub command: Option<AmCommand>,
    /// Containers of this application the RM is taking back (repeated in every answer
    /// until they end).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preempt: Vec<PreemptNotice>,
    /// Why this application's waiting tasks wait, as the RM's queues see it (its queue is
    /// at its cap, behind a queue below its share, reclaiming, ...); `None` when nothing
    /// of it waits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_reason: Option<String>,
    /// The same, typed (`reason::Reason`; a `Resources` kind when the queues name no cause).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_reason: Option<crate::reason::Reason>,
    /// When its waiting tasks are expected to start, and on what basis (issue 27). Boxed:
    /// most answers carry none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_estimate: Option<Box<StartEstimate>>,
    /// Other applications have tasks waiting (issue 27): the AM's placement then packs
    /// nodes (fewest free GPUs) right after the GPU tiers (`Selector::set_others_wait`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub others_waiting: bool,
}

/// `POST /ws/v1/am/{appId}/finish` body.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FinishRequest {
    pub final_status: FinalStatus,
    pub exit_code: i32,
    pub diagnostics: String,
}

/// Finish answer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FinishResponse {
    pub is_unregistered: bool,
}

/// `POST /ws/v1/node/{host}/containers/{id}/start` body.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LaunchContext {
    /// Run in order by one bash script; the first failing command ends the container.
    pub commands: Vec<String>,
    pub env: BTreeMap<String, String>,
}

/// Executor-side container states.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ContainerState {
    /// Granted, not started.
    Allocated,
    Running,
    Complete,
}

/// `POST /ws/v1/node/containers/start` body: several starts in one call (YARN's
/// `startContainers`), so that an AM launching many tasks holds one connection to the RM,
/// not one per task (issue 29). At most [`MAX_STARTS_PER_CALL`].
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StartContainers {
    pub containers: Vec<StartContainer>,
}

/// The most starts in one [`StartContainers`] call.
pub const MAX_STARTS_PER_CALL: usize = 64;

/// One start of a [`StartContainers`] call: what `POST /ws/v1/node/{host}/containers/{id}/start`
/// takes, with its host and id.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StartContainer {
    pub host: String,
    pub container_id: String,
    pub context: LaunchContext,
}

/// The answer to [`StartContainers`]: one result per start, in its order.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct StartedContainers {
    pub results: Vec<StartResult>,
}

/// One start's result: its status, or the error the single start would have answered.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StartResult {
    pub container_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<ContainerStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<StartError>,
}

/// Why one start of a [`StartContainers`] call failed: the HTTP status, code and message
/// its single start would have answered.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StartError {
    pub status: u16,
    pub code: String,
    pub message: String,
}

/// `GET /ws/v1/node/{host}/containers/{id}/status` answer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ContainerStatus {
    pub container_id: String,
    pub state: ContainerState,
    pub exit_status: Option<i32>,
    pub diagnostics: String,
    pub pid: Option<u32>,
    /// When the node started its process (ms since the epoch, the node's clock): in the
    /// answer to a start, so the AM knows when each task of a start call really began,
    /// not only when the whole call was answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_ms: Option<u64>,
}

/// Error body of every REST endpoint: a machine code and a message.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ErrorBody {
    pub code: String,
    pub message: String,
}
