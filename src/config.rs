//! Settings: `conf/gpuam.yaml` (or built-in defaults) overridden by environment
//! variables `GPUAM__<SECTION>__<KEY>` (e.g. `GPUAM__SELECT__CANDIDATE_NODES_FACTOR=3`).
//!
//! Keys are snake_case in the file too, so a file key and its environment variable
//! are the same words; README.md documents every key in one table.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// How the select pipeline treats racks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RackPolicy {
    /// Keep a job's tasks in the racks it already uses, or in one rack that can hold
    /// all it still needs (never emptying the candidate set).
    #[default]
    Pack,
    /// No rack preference.
    None,
}

/// Select pipeline settings (DESIGN.md §4).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SelectSettings {
    /// Candidates kept after ranking = waiting tasks × this factor.
    pub candidate_nodes_factor: u32,
    /// Lowest port ever chosen for a dynamic port.
    pub container_min_port: u16,
    /// Let a job that asks for no GPU at all use GPU nodes.
    pub allow_none_gpu_job_on_gpu_node: bool,
    /// Treat resources of recently rejected or timed-out asks as taken.
    pub skip_local_tried_resource: bool,
    /// How long a tried-and-failed ask keeps its resources marked as taken.
    pub tried_resource_ttl_sec: u64,
    pub rack_policy: RackPolicy,
    /// How long a multi-GPU task may wait for a GPU set of its node's ideal tier when only a
    /// lower tier is free now and GPUs held by other jobs may free a better one (0 = never
    /// wait: take the best set available at once).
    pub topology_wait_sec: u64,
    /// Seed of the tie-breaking RNG; unset = random per AM (so concurrent AMs differ).
    pub seed: Option<u64>,
}

impl Default for SelectSettings {
    fn default() -> Self {
        SelectSettings {
            candidate_nodes_factor: 2,
            container_min_port: 2000,
            allow_none_gpu_job_on_gpu_node: true,
            skip_local_tried_resource: true,
            tried_resource_ttl_sec: 30,
            rack_policy: RackPolicy::Pack,
            topology_wait_sec: 300,
            seed: None,
        }
    }
}

/// AM control-loop settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AmSettings {
    /// Allocate heartbeat interval while asks or containers are outstanding.
    pub heartbeat_interval_ms: u64,
    /// Full node-listing refresh interval (while tasks wait to be placed).
    pub node_refresh_interval_ms: u64,
    /// An AM with nothing to ask, place or launch lets the RM hold its heartbeat this long
    /// (at most 2000) until something for the job happens; 0 heartbeats every interval.
    pub idle_hold_ms: u64,
    /// Back-off range (with jitter) when no node fits a task now.
    pub not_available_retry_min_ms: u64,
    pub not_available_retry_max_ms: u64,
    /// Gang jobs: release everything held if the gang is not complete within this time.
    /// Must stay below the RM's `container_expiry_sec`.
    pub gang_timeout_sec: u64,
    /// Back-off before a gang tries again after a timeout.
    pub gang_retry_backoff_ms: u64,
    /// Most transient-failure retries of one task (transient exits do not use up
    /// `taskRetryCount`, but are not retried forever either).
    pub max_transient_retries: u32,
    /// Exit codes (1..=255) to classify, overriding the defaults of
    /// reference/frameworklauncher.md §5.4: lists of codes per class.
    pub transient_exit_codes: Vec<i32>,
    pub permanent_exit_codes: Vec<i32>,
    /// Grace between SIGTERM and SIGKILL when stopping containers.
    pub stop_grace_ms: u64,
    /// An RM unreachable this long makes the AM give up: the job fails (exit 69) and
    /// the AM exits instead of retrying forever. Longer than an RM restart takes; an RM
    /// that comes back later starts the job's next AM attempt, which re-adopts its tasks.
    pub rm_unreachable_timeout_sec: u64,
    /// Delay before the second retry in a row of failures of one task (the first is
    /// immediate); it doubles per further failure, up to `retry_backoff_max_ms`.
    pub retry_backoff_ms: u64,
    pub retry_backoff_max_ms: u64,
    /// Most retries of one task that begin within any minute (`taskRetryCount: -1` too).
    pub max_retries_per_minute: u32,
}

impl Default for AmSettings {
    fn default() -> Self {
        AmSettings {
            heartbeat_interval_ms: 100,
            node_refresh_interval_ms: 2000,
            idle_hold_ms: 1000,
            not_available_retry_min_ms: 500,
            not_available_retry_max_ms: 3000,
            gang_timeout_sec: 300,
            gang_retry_backoff_ms: 2000,
            max_transient_retries: 10,
            transient_exit_codes: Vec::new(),
            permanent_exit_codes: Vec::new(),
            stop_grace_ms: 3000,
            rm_unreachable_timeout_sec: 600,
            retry_backoff_ms: 1000,
            retry_backoff_max_ms: 60_000,
            max_retries_per_minute: 10,
        }
    }
}

/// RM settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RmSettings {
    /// Containers granted but never started are taken back after this long.
    pub container_expiry_sec: u64,
    /// AM attempts per job: an AM that dies without finishing is started again, keeping
    /// the job's containers, until this many attempts have run.
    pub max_am_attempts: u32,
    /// A node agent silent for this long becomes LOST (its containers end for their jobs;
    /// their resources stay held until the agent returns and reports them dead).
    pub node_expiry_sec: u64,
    /// After an RM restart, how long the node agents it knew have to register again: until
    /// then their hosts are listed NEW (AMs wait, nothing is placed there) and their
    /// containers are kept; a host whose agent has not come back by then is LOST.
    pub node_reregister_grace_sec: u64,
    /// The users file (`users: {NAME: {token_sha256: HEX}}`); without one only the admin
    /// token submits. Relative to the settings file's directory. `--users-file` wins.
    pub users_file: Option<PathBuf>,
    /// Names the RM (and AM dashboards) answer to in a request's `Host`, besides loopback
    /// names, the listen address and this machine's host name.
    pub public_names: Vec<String>,
    /// A job may ask for a dashboard address that is not loopback (`dashboardListen`).
    pub allow_public_dashboards: bool,
    /// The ports a user's job may name for its dashboard (`dashboardListen`, e.g.
    /// `"28000-28999"`); without them a user's job takes port 0 (any free port). The AM
    /// runs as the RM's user on the RM's host, so a port a user could name is one an agent,
    /// the RM or a task may need while its owner restarts. The admin token may name any.
    pub dashboard_ports: Option<String>,
    /// Unfinished applications at once, all users together.
    pub max_apps: usize,
    /// Unfinished applications at once of one user.
    pub max_apps_per_user: usize,
    /// Asks in one allocate request (gpuam's AM sends at most 2000).
    pub max_asks_per_allocate: usize,
    /// Notice a container gets before the RM kills it to give its GPUs to a queue below
    /// its share (or to a higher-priority job of its queue): the task may checkpoint.
    pub preemption_grace_sec: u64,
    /// Reservations (issue 27): a waiting gang that has waited this long (seconds; 0: never
    /// by waiting) gets the nodes where it will fit first as running work ends; later work
    /// may use them only if it is declared to end first (`maxRunSec`) or leaves the gang
    /// room beside it.
    pub reserve_wait_sec: u64,
    /// ... or a waiting gang of at least this many GPUs (0: never by size).
    pub reserve_min_gpus: u32,
    /// The queues jobs run in (`queue:` in a job spec; `default` when it names none).
    /// Without any, every job runs in one queue named `default`.
    pub queues: BTreeMap<String, QueueSettings>,
    /// Finished jobs (`gpuam history`, the cluster page) are kept this many days.
    pub history_retention_days: u64,
    /// At most this many finished jobs are kept (the oldest are forgotten first).
    pub max_history: usize,
    /// The logs the RM keeps of finished containers are deleted after this many days
    /// (the job's history row stays).
    pub log_retention_days: u64,
    /// Most bytes the RM keeps of each finished container's stdout and of its stderr
    /// (the end of each).
    pub collected_log_bytes: u64,
    /// Most bytes of kept logs one user's applications hold together: past it, that user's
    /// oldest kept logs of ended applications go first; what running jobs hold stays, and
    /// a log that does not fit is not kept (its route says why).
    pub collected_logs_user_bytes: u64,
    /// Most bytes of kept logs all users' applications hold together (the same rule, over
    /// everyone's ended applications).
    pub collected_logs_total_bytes: u64,
    /// Free space (MiB) the RM leaves on its work dir's filesystem, which the state store
    /// may share: below it no new task log is kept and ended jobs' spec copies go.
    pub min_free_disk_mb: u64,
    /// Most bytes of each of a running AM's `am.stdout` and `am.stderr`; past it the file
    /// becomes `am.stdout.1` (its last this many bytes; one older generation) and starts again.
    pub am_output_bytes: u64,
}

impl Default for RmSettings {
    fn default() -> Self {
        RmSettings {
            container_expiry_sec: 600,
            max_am_attempts: 3,
            node_expiry_sec: 15,
            node_reregister_grace_sec: 45,
            users_file: None,
            public_names: Vec::new(),
            allow_public_dashboards: false,
            dashboard_ports: None,
            max_apps: 256,
            max_apps_per_user: 32,
            max_asks_per_allocate: 5000,
            preemption_grace_sec: 30,
            reserve_wait_sec: 1800,
            reserve_min_gpus: 32,
            queues: BTreeMap::new(),
            history_retention_days: 30,
            max_history: 10_000,
            log_retention_days: 7,
            collected_log_bytes: 1 << 20,
            collected_logs_user_bytes: 2 << 30,
            collected_logs_total_bytes: 20 << 30,
            min_free_disk_mb: 1024,
            am_output_bytes: 16 << 20,
        }
    }
}

impl RmSettings {
    /// The bounds on what the RM keeps on disk fit together: one container's two streams
    /// fit one user's budget, one user's budget fits the total.
    fn check_log_bounds(&self) -> Result<(), String> {
        let per_container = self.collected_log_bytes.saturating_mul(2);
        if self.collected_logs_user_bytes < per_container {
            return Err(format!(
                "rm.collected_logs_user_bytes ({}) must be at least twice rm.collected_log_bytes ({}): one container's stdout and stderr must fit one user's budget",
                self.collected_logs_user_bytes, self.collected_log_bytes
            ));
        }
        if self.collected_logs_total_bytes < self.collected_logs_user_bytes {
            return Err(format!(
                "rm.collected_logs_total_bytes ({}) must be at least rm.collected_logs_user_bytes ({})",
                self.collected_logs_total_bytes, self.collected_logs_user_bytes
            ));
        }
        if self.am_output_bytes < 4096 {
            return Err(format!(
                "rm.am_output_bytes ({}) must be at least 4096",
                self.am_output_bytes
            ));
        }
        if self.min_free_disk_mb > u64::MAX >> 20 {
            return Err(format!("rm.min_free_disk_mb ({}) is too large", self.min_free_disk_mb));
        }
        Ok(())
    }
}

/// One queue of `rm.queues` (DESIGN.md §10). Keys inside a queue are camelCase
/// (`guaranteedGpus`), as in DESIGN.md; snake_case is accepted too, and the environment's
/// lower-cased spelling (`GPUAM__RM__QUEUES__PROD__GUARANTEEDGPUS`) overrides the file.
/// Only read here: the tree is built and checked (names, weights, caps, nesting) in one
/// place, `rm::scheduler::queues::QueueTree::from_settings`, when an RM starts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", try_from = "RawQueueSettings")]
pub struct QueueSettings {
    /// Its share of each GPU type, relative to its siblings, when all of them want more.
    pub weight: f64,
    /// GPUs it keeps when it wants them: never reclaimed below this, and its deserved
    /// share is at least this much of what it asks for.
    pub guaranteed_gpus: u32,
    /// Most GPUs it may hold at once (`None`: no cap).
    pub max_gpus: Option<u32>,
    /// Who may submit to it (`None`: everyone; the admin may use any queue). A queue of a
    /// parent without its own list takes the parent's.
    pub users: Option<Vec<String>>,
    /// Whether a higher-priority job of this queue may preempt a lower-priority one of the
    /// same queue (across queues, only the shares decide).
    pub priority_preemption: bool,
    /// Queues inside this one (one level: teams within a department). A queue with
    /// queues takes no jobs itself.
    pub queues: BTreeMap<String, QueueSettings>,
}

/// [`QueueSettings`] as written, with each camelCase key's lower-cased twin (what an
/// environment override becomes), which wins.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawQueueSettings {
    #[serde(default)]
    weight: Option<f64>,
    #[serde(default, rename = "guaranteedGpus", alias = "guaranteed_gpus")]
    guaranteed_gpus: Option<u32>,
    #[serde(default, rename = "guaranteedgpus")]
    guaranteed_gpus_env: Option<u32>,
    #[serde(default, rename = "maxGpus", alias = "max_gpus")]
    max_gpus: Option<u32>,
    #[serde(default, rename = "maxgpus")]
    max_gpus_env: Option<u32>,
    #[serde(default)]
    users: Option<Vec<String>>,
    #[serde(default, rename = "priorityPreemption", alias = "priority_preemption")]
    priority_preemption: Option<bool>,
    #[serde(default, rename = "prioritypreemption")]
    priority_preemption_env: Option<bool>,
    #[serde(default)]
    queues: BTreeMap<String, QueueSettings>,
}

impl TryFrom<RawQueueSettings> for QueueSettings {
    type Error = String;
    fn try_from(r: RawQueueSettings) -> Result<Self, String> {
        let d = QueueSettings::default();
        Ok(QueueSettings {
            weight: r.weight.unwrap_or(d.weight),
            guaranteed_gpus: r.guaranteed_gpus_env.or(r.guaranteed_gpus).unwrap_or(d.guaranteed_gpus),
            max_gpus: r.max_gpus_env.or(r.max_gpus),
            users: r.users,
            priority_preemption: r
                .priority_preemption_env
                .or(r.priority_preemption)
                .unwrap_or(d.priority_preemption),
            queues: r.queues,
        })
    }
}

impl Default for QueueSettings {
    fn default() -> Self {
        QueueSettings {
            weight: 1.0,
            guaranteed_gpus: 0,
            max_gpus: None,
            users: None,
            priority_preemption: false,
            queues: BTreeMap::new(),
        }
    }
}

/// Every HTTP listener (RM, AM dashboard, node agent, Ray gate).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpSettings {
    /// A connection must send a request's headers within this time (idle keep-alive
    /// connections are closed after it too), then its body within it again.
    pub read_timeout_sec: u64,
    /// Open connections a listener keeps in its general pool in all; beyond, new ones are
    /// closed at once. Below the usual open-file limit (1,024) so that a flood never
    /// exhausts it.
    pub max_connections: usize,
    /// Open connections of the general pool from one source (an IPv4 address, an IPv6
    /// /64, or all of loopback together: `tls::Source`); beyond, its new ones are closed
    /// at once. Well below `max_connections` / 16 ([`MAX_CONNECTIONS_PER_SOURCE`]).
    pub max_connections_per_peer: usize,
    /// Open connections of the reserved pool in all: the places of the listener's own
    /// host (127.0.0.1, `::1`) and, at an RM, of its live node agents' addresses, which
    /// no other source can take.
    pub max_reserved_connections: usize,
    /// Open connections of the reserved pool from one reserved address.
    pub max_reserved_connections_per_peer: usize,
}

/// Default `http.max_connections`: the general pool of a listener.
pub const MAX_CONNECTIONS: usize = 768;

/// Default `http.max_connections_per_peer`, per source (audit 5 F4). At 256 (a third of
/// [`MAX_CONNECTIONS`]) four loopback addresses filled an RM and denied it to every
/// tenant and to a restarting agent; at 24 it takes 32 distinct sources (32 hosts, or
/// 32 IPv6 /64s; all of loopback is one), while one source still holds far more than a
/// client needs (a CLI holds one or two; an AM at most five, and the AMs of the
/// listener's own host use the reserved pool).
pub const MAX_CONNECTIONS_PER_SOURCE: usize = 24;

/// Default `http.max_reserved_connections`: room for the keep-alive connections of
/// about a thousand node agents, besides [`MAX_RESERVED_PER_PEER`] for the own host.
pub const MAX_RESERVED_CONNECTIONS: usize = 1024;

/// Default `http.max_reserved_connections_per_peer`: 256, what one peer could hold
/// before (issue 29: every AM an RM starts connects from the RM's host, a hundred AMs
/// hold a few hundred connections), so the own host's clients and the tests' own
/// concurrency (all on 127.0.0.1) keep the room they had.
pub const MAX_RESERVED_PER_PEER: usize = 256;

impl Default for HttpSettings {
    fn default() -> Self {
        HttpSettings {
            read_timeout_sec: 30,
            max_connections: MAX_CONNECTIONS,
            max_connections_per_peer: MAX_CONNECTIONS_PER_SOURCE,
            max_reserved_connections: MAX_RESERVED_CONNECTIONS,
            max_reserved_connections_per_peer: MAX_RESERVED_PER_PEER,
        }
    }
}

/// TLS of the RM's and the AM dashboard's listeners, and of the clients that call them.
/// Relative paths in the settings file are relative to that file's directory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct TlsSettings {
    /// PEM certificate chain (leaf first); with `key_file`, listeners serve HTTPS.
    pub cert_file: Option<PathBuf>,
    /// PEM private key of the certificate.
    pub key_file: Option<PathBuf>,
    /// PEM CA certificate(s) clients trust (instead of the system's roots).
    pub ca_file: Option<PathBuf>,
}

impl TlsSettings {
    /// Whether listeners serve HTTPS.
    pub fn serves_https(&self) -> bool {
        self.cert_file.is_some() && self.key_file.is_some()
    }

    /// `GPUAM__TLS__…` variables carrying these (absolute) paths, for child processes
    /// whose working directory differs.
    pub fn env_vars(&self) -> Vec<(&'static str, PathBuf)> {
        [
            ("GPUAM__TLS__CERT_FILE", &self.cert_file),
            ("GPUAM__TLS__KEY_FILE", &self.key_file),
            ("GPUAM__TLS__CA_FILE", &self.ca_file),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.clone().map(|v| (k, v)))
        .collect()
    }

    /// Makes relative paths absolute: those from the environment against the working
    /// directory, the others against `base` (the settings file's directory).
    fn resolve(&mut self, file_dir: Option<&Path>, from_env: impl Fn(&str) -> bool) {
        let cwd = std::env::current_dir().unwrap_or_default();
        let base = cwd.join(file_dir.unwrap_or(Path::new("")));
        for (key, path) in [
            ("cert_file", &mut self.cert_file),
            ("key_file", &mut self.key_file),
            ("ca_file", &mut self.ca_file),
        ] {
            if let Some(p) = path.as_mut().filter(|p| p.is_relative()) {
                let dir = if from_env(key) { &cwd } else { &base };
                *p = dir.join(&*p);
            }
        }
    }
}

/// All settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    pub select: SelectSettings,
    pub am: AmSettings,
    pub rm: RmSettings,
    pub tls: TlsSettings,
    pub node: NodeSettings,
    pub http: HttpSettings,
}

/// Node settings (DESIGN.md §10).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeSettings {
    /// A task that names an image runs on the host when the node has no OCI runtime
    /// (podman with runc), with a warning in its stderr; false refuses to start it.
    pub run_without_image: bool,
    /// `auto`: run tasks that name an image in it when podman and runc are installed;
    /// `none`: never (every task runs on the host, as without a runtime).
    pub image_runtime: String,
    /// Most bytes a container's stdout, and its stderr, may hold: beyond it the node keeps
    /// the newest quarter and writes a line saying how much it dropped.
    pub max_log_bytes: u64,
    /// Users whose tasks run as a local account (`alice: alice`); others get a uid of
    /// their own from `task_uids` (see `node::identity`).
    pub user_map: std::collections::BTreeMap<String, String>,
    /// `FIRST-LAST`: the per-user uids of a root node.
    pub task_uids: String,
    /// Where the machine records which per-user uid is whose.
    pub task_uid_registry: PathBuf,
    /// How long a finished container's logs (its record) stay on the node after the RM
    /// heard of its end.
    pub log_retention_sec: u64,
    /// How long after a container ends its work directory (the task's own files) is
    /// removed: off the start path, so that a burst of ends does not slow the next starts
    /// (see `node::executor`). A container killed for its disk bound loses it at once. 0: at once.
    pub work_dir_grace_sec: u64,
    /// Whether the in-process node of `gpuam rm` / `gpuam run` running as root runs each
    /// user's tasks as its own uid, as the agents do (false: as the RM's user; only for
    /// a single-user machine).
    pub in_process_identity: bool,
    /// Most MiB a container's directory may hold; beyond it the container is killed with
    /// `disk limit exceeded (N MiB)`. 0: no bound.
    pub max_container_disk_mb: u64,
    /// Most processes of all containers of the node together (`pids.max` of their parent
    /// cgroup); 0: half of the machine's `kernel.pid_max`.
    pub max_pids: u64,
    /// Extra devices every task may open, in the cgroup v1 syntax (`c 10:229 rw`), beside
    /// the safe defaults and its granted GPUs.
    pub device_allow: Vec<String>,
}

/// The default range of per-user uids (`node.task_uids`): 0x70000000 + 64 Ki, a block
/// systemd's uid map leaves unused (below it: containers' ranges; above 0x7fffffff:
/// nothing is assigned).
pub const DEFAULT_TASK_UIDS: (u32, u32) = (0x7000_0000, 0x7000_ffff);
/// Where a machine records which per-user uid belongs to whom (`node.task_uid_registry`).
pub const DEFAULT_TASK_UID_REGISTRY: &str = "/var/lib/gpuam/task-uids";
/// How long a finished container's record (its logs) is kept (`node.log_retention_sec`).
pub const DEFAULT_LOG_RETENTION_SEC: u64 = 7 * 24 * 3600;
/// How long after its end a container's work directory is removed
/// (`node.work_dir_grace_sec`; why later and not at once: `node::executor`).
pub const DEFAULT_WORK_DIR_GRACE_SEC: u64 = 30;

impl Default for NodeSettings {
    fn default() -> Self {
        NodeSettings {
            run_without_image: true,
            image_runtime: "auto".into(),
            max_log_bytes: 64 << 20,
            max_container_disk_mb: 10 << 10,
            max_pids: 0,
            device_allow: Vec::new(),
            user_map: Default::default(),
            task_uids: format!("{}-{}", DEFAULT_TASK_UIDS.0, DEFAULT_TASK_UIDS.1),
            task_uid_registry: PathBuf::from(DEFAULT_TASK_UID_REGISTRY),
            log_retention_sec: DEFAULT_LOG_RETENTION_SEC,
            work_dir_grace_sec: DEFAULT_WORK_DIR_GRACE_SEC,
            in_process_identity: true,
        }
    }
}

/// Settings that could not be loaded.
#[derive(Debug, thiserror::Error)]
#[error("invalid settings{}: {message}", file.as_ref().map(|f| format!(" in {}", f.display())).unwrap_or_default())]
pub struct SettingsError {
    pub file: Option<PathBuf>,
    pub message: String,
}

/// `conf/gpuam.yaml` as built into the binary: the settings when no file is given or
/// found, so that an installed `gpuam` works from any directory.
pub const BUILT_IN_SETTINGS: &str = include_str!("../conf/gpuam.yaml");

/// `conf/cluster.yaml` as built into the binary: the demo cluster of `gpuam run` /
/// `gpuam rm` when neither `--cluster` is given nor `conf/cluster.yaml` is found.
pub const BUILT_IN_CLUSTER: &str = include_str!("../conf/cluster.yaml");

/// Where the cluster of `gpuam run` / `gpuam rm` comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterSource {
    /// A cluster file: `--cluster FILE`, else `conf/cluster.yaml` in the working directory.
    File(PathBuf),
    /// [`BUILT_IN_CLUSTER`].
    BuiltIn,
}

/// `explicit` if given, else `conf/cluster.yaml` under `cwd` if it exists (named
/// relative, as before), else the built-in demo cluster.
pub fn cluster_source(explicit: Option<&Path>, cwd: &Path) -> ClusterSource {
    if let Some(p) = explicit {
        return ClusterSource::File(p.to_path_buf());
    }
    let rel = Path::new("conf/cluster.yaml");
    if cwd.join(rel).exists() {
        ClusterSource::File(rel.to_path_buf())
    } else {
        ClusterSource::BuiltIn
    }
}

/// The default settings file, if present: `$GPUAM_CONFIG`, else `conf/gpuam.yaml`.
pub fn default_settings_path() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("GPUAM_CONFIG") {
        return Some(PathBuf::from(p));
    }
    let p = PathBuf::from("conf/gpuam.yaml");
    p.exists().then_some(p)
}

impl Settings {
    /// Loads defaults, then `file` (if any), then `GPUAM__…` environment overrides.
    pub fn load(file: Option<&Path>) -> Result<Settings, SettingsError> {
        Self::load_with_env(file, std::env::vars())
    }

    /// As [`Settings::load`], with the environment given explicitly (for tests).
    pub fn load_with_env(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Settings, SettingsError> {
        let err = |message: String| SettingsError {
            file: file.map(Path::to_path_buf),
            message,
        };
        let mut builder = config::Config::builder();
        match file {
            Some(f) => {
                if !f.exists() {
                    return Err(err("file not found".into()));
                }
                builder = builder.add_source(config::File::from(f).format(config::FileFormat::Yaml));
            }
            // Only without a file: maps (queues) in a file replace the defaults, not merge.
            None => {
                builder = builder.add_source(config::File::from_str(BUILT_IN_SETTINGS, config::FileFormat::Yaml));
            }
        }
        let env: config::Map<String, String> = env.into_iter().filter(|(k, _)| k.starts_with("GPUAM__")).collect();
        // Which TLS paths the environment sets (they resolve against the working directory).
        let tls_env: Vec<&str> = ["cert_file", "key_file", "ca_file"]
            .into_iter()
            .filter(|k| env.contains_key(&format!("GPUAM__TLS__{}", k.to_uppercase())))
            .collect();
        let users_file_env = env.contains_key("GPUAM__RM__USERS_FILE");
        builder = builder.add_source(
            config::Environment::with_prefix("GPUAM")
                .prefix_separator("__")
                .separator("__")
                .try_parsing(true)
                .list_separator(",")
                .with_list_parse_key("am.transient_exit_codes")
                .with_list_parse_key("am.permanent_exit_codes")
                .with_list_parse_key("rm.public_names")
                .source(Some(env)),
        );
        let cfg = builder.build().map_err(|e| err(e.to_string()))?;
        let mut s: Settings = cfg
            .try_deserialize()
            .map_err(|e| err(format!("{e} (see the settings table in README.md)")))?;
        s.tls.resolve(file.and_then(Path::parent), |key| tls_env.contains(&key));
        if let Some(p) = s.rm.users_file.as_mut().filter(|p| p.is_relative()) {
            let cwd = std::env::current_dir().unwrap_or_default();
            let base = match file.and_then(Path::parent) {
                Some(dir) if !users_file_env => cwd.join(dir),
                _ => cwd,
            };
            *p = base.join(&*p);
        }
        s.validate().map_err(err)?;
        Ok(s)
    }

    /// Checks what the settings alone can say; `node.task_uids` and `node.device_allow`,
    /// which name node types, are checked where they become them
    /// (`node::identity::IdentitySettings::from_settings`, `node::bounds::NodeBounds::from_settings`).
    fn validate(&self) -> Result<(), String> {
        if self.rm.max_am_attempts == 0 {
            return Err("rm.max_am_attempts must be at least 1".into());
        }
        if !["auto", "none"].contains(&self.node.image_runtime.as_str()) {
            return Err(format!(
                "node.image_runtime must be `auto` or `none`, not `{}`",
                self.node.image_runtime
            ));
        }
        if self.http.read_timeout_sec == 0 {
            return Err("http.read_timeout_sec must be at least 1".into());
        }
        if self.am.max_retries_per_minute == 0 {
            return Err("am.max_retries_per_minute must be at least 1".into());
        }
        if let Some(p) = &self.rm.dashboard_ports {
            crate::resources::PortSet::parse(p)
                .map_err(|e| format!("rm.dashboard_ports `{p}`: {e} (e.g. \"28000-28999\")"))?;
        }
        if self.node.max_log_bytes < 4096 {
            return Err("node.max_log_bytes must be at least 4096".into());
        }
        for (key, v) in [
            ("rm.max_apps", self.rm.max_apps),
            ("rm.max_apps_per_user", self.rm.max_apps_per_user),
            ("rm.max_asks_per_allocate", self.rm.max_asks_per_allocate),
        ] {
            if v == 0 {
                return Err(format!("{key} must be at least 1"));
            }
        }
        self.rm.check_log_bounds()?;
        if self.select.candidate_nodes_factor == 0 {
            return Err("select.candidate_nodes_factor must be at least 1".into());
        }
        if self.am.not_available_retry_min_ms > self.am.not_available_retry_max_ms {
            return Err("am.not_available_retry_min_ms must not exceed am.not_available_retry_max_ms".into());
        }
        if self.am.gang_timeout_sec >= self.rm.container_expiry_sec {
            return Err(format!(
                "am.gang_timeout_sec ({}) must be shorter than rm.container_expiry_sec ({}), or held containers expire before the gang gives them back",
                self.am.gang_timeout_sec, self.rm.container_expiry_sec
            ));
        }
        match (&self.tls.cert_file, &self.tls.key_file) {
            (Some(_), None) => return Err("tls.cert_file is set but tls.key_file is not (set both, or neither)".into()),
            (None, Some(_)) => return Err("tls.key_file is set but tls.cert_file is not (set both, or neither)".into()),
            _ => {}
        }
        for c in self.am.transient_exit_codes.iter().chain(&self.am.permanent_exit_codes) {
            if !(1..=255).contains(c) {
                return Err(format!("exit code {c} in am.*_exit_codes is outside 1..=255"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn defaults_match_the_original() {
        let s = Settings::load_with_env(None, env(&[])).unwrap();
        assert_eq!(s.select.candidate_nodes_factor, 2);
        assert_eq!(s.select.container_min_port, 2000);
        assert!(s.select.allow_none_gpu_job_on_gpu_node);
        assert!(s.select.skip_local_tried_resource);
        assert_eq!(s.select.rack_policy, RackPolicy::Pack);
    }

    #[test]
    fn bundled_file_loads_and_env_overrides_it() {
        let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("conf/gpuam.yaml");
        let s = Settings::load_with_env(Some(&file), env(&[])).unwrap();
        assert_eq!(s, Settings::default(), "conf/gpuam.yaml restates the defaults");
        let s = Settings::load_with_env(
            Some(&file),
            env(&[
                ("GPUAM__SELECT__CANDIDATE_NODES_FACTOR", "3"),
                ("GPUAM__SELECT__RACK_POLICY", "none"),
                ("GPUAM__AM__TRANSIENT_EXIT_CODES", "3,4"),
                ("UNRELATED", "x"),
            ]),
        )
        .unwrap();
        assert_eq!(s.select.candidate_nodes_factor, 3);
        assert_eq!(s.select.rack_policy, RackPolicy::None);
        assert_eq!(s.am.transient_exit_codes, vec![3, 4]);
    }

    #[test]
    fn built_in_settings_and_cluster_are_the_bundled_files() {
        let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("conf/gpuam.yaml");
        assert_eq!(
            Settings::load_with_env(None, env(&[])).unwrap(),
            Settings::load_with_env(Some(&file), env(&[])).unwrap()
        );
        let on_disk = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("conf/cluster.yaml")).unwrap();
        assert_eq!(BUILT_IN_CLUSTER, on_disk);
        let nodes = crate::cluster::file::parse_cluster_file(BUILT_IN_CLUSTER, "built-in").unwrap();
        assert!(nodes.len() >= 2 && nodes.iter().any(|n| n.gpu_type.is_some()));
        // The environment still overrides the built-in settings.
        let s = Settings::load_with_env(None, env(&[("GPUAM__SELECT__CANDIDATE_NODES_FACTOR", "7")])).unwrap();
        assert_eq!(s.select.candidate_nodes_factor, 7);
    }

    #[test]
    fn the_cluster_comes_from_the_flag_then_the_directory_then_the_binary() {
        let dir = tempfile::Builder::new()
            .prefix(&format!("jax-{}-", std::process::id()))
            .tempdir()
            .unwrap();
        let flag = Path::new("/somewhere/c.yaml");
        assert_eq!(cluster_source(Some(flag), dir.path()), ClusterSource::File(flag.into()));
        assert_eq!(cluster_source(None, dir.path()), ClusterSource::BuiltIn);
        std::fs::create_dir_all(dir.path().join("conf")).unwrap();
        std::fs::write(dir.path().join("conf/cluster.yaml"), "nodes: []\n").unwrap();
        assert_eq!(
            cluster_source(None, dir.path()),
            ClusterSource::File("conf/cluster.yaml".into())
        );
        assert_eq!(cluster_source(Some(flag), dir.path()), ClusterSource::File(flag.into()));
    }

    #[test]
    fn bad_values_are_named() {
        let e = Settings::load_with_env(None, env(&[("GPUAM__SELECT__CANDIDATE_NODES_FACTOR", "0")])).unwrap_err();
        assert!(e.to_string().contains("candidate_nodes_factor"), "{e}");
        let e = Settings::load_with_env(None, env(&[("GPUAM__AM__GANG_TIMEOUT_SEC", "900")])).unwrap_err();
        assert!(e.to_string().contains("container_expiry_sec"), "{e}");
        let e = Settings::load_with_env(None, env(&[("GPUAM__SELECT__RACK_POLICY", "sideways")])).unwrap_err();
        assert!(
            e.to_string().contains("rack_policy") || e.to_string().contains("sideways"),
            "{e}"
        );
        let e = Settings::load_with_env(None, env(&[("GPUAM__RM__DASHBOARD_PORTS", "29000-28000")])).unwrap_err();
        assert!(e.to_string().contains("rm.dashboard_ports"), "{e}");
        let s = Settings::load_with_env(None, env(&[("GPUAM__RM__DASHBOARD_PORTS", "28000-28999")])).unwrap();
        assert_eq!(s.rm.dashboard_ports.as_deref(), Some("28000-28999"));
        let e = Settings::load_with_env(Some(Path::new("/nonexistent/gpuam.yaml")), env(&[])).unwrap_err();
        assert!(e.to_string().contains("not found"), "{e}");
    }

    #[test]
    fn log_bounds_that_do_not_fit_together_are_named() {
        let bad = |pairs: &[(&str, &str)]| Settings::load_with_env(None, env(pairs)).unwrap_err().to_string();
        let e = bad(&[("GPUAM__RM__COLLECTED_LOGS_USER_BYTES", "1048576")]);
        assert!(
            e.contains("rm.collected_logs_user_bytes") && e.contains("twice rm.collected_log_bytes"),
            "{e}"
        );
        let e = bad(&[("GPUAM__RM__COLLECTED_LOGS_TOTAL_BYTES", "4194304")]);
        assert!(
            e.contains("rm.collected_logs_total_bytes") && e.contains("rm.collected_logs_user_bytes"),
            "{e}"
        );
        let e = bad(&[("GPUAM__RM__AM_OUTPUT_BYTES", "100")]);
        assert!(e.contains("rm.am_output_bytes"), "{e}");
        let e = bad(&[("GPUAM__RM__MIN_FREE_DISK_MB", &u64::MAX.to_string())]);
        assert!(e.contains("rm.min_free_disk_mb"), "{e}");
        // Equal bounds fit.
        let s = Settings::load_with_env(
            None,
            env(&[
                ("GPUAM__RM__COLLECTED_LOG_BYTES", "1000"),
                ("GPUAM__RM__COLLECTED_LOGS_USER_BYTES", "2000"),
                ("GPUAM__RM__COLLECTED_LOGS_TOTAL_BYTES", "2000"),
            ]),
        )
        .unwrap();
        assert_eq!(s.rm.collected_logs_total_bytes, 2000);
    }

    #[test]
    fn queues_read_as_the_design_spells_them_and_bad_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("gpuam.yaml");
        std::fs::write(
            &file,
            "rm:\n  preemption_grace_sec: 5\n  queues:\n    research: {weight: 3, users: [alice, bob]}\n    \
             prod:     {weight: 1, guaranteedGpus: 2, maxGpus: 64}\n    dept: {weight: 2, queues: {teamA: {priorityPreemption: true}}}\n",
        )
        .unwrap();
        let s = Settings::load_with_env(Some(&file), env(&[])).unwrap();
        assert_eq!(s.rm.preemption_grace_sec, 5);
        let prod = &s.rm.queues["prod"];
        assert_eq!((prod.weight, prod.guaranteed_gpus, prod.max_gpus), (1.0, 2, Some(64)));
        assert_eq!(
            s.rm.queues["research"].users.as_deref(),
            Some(&["alice".to_string(), "bob".to_string()][..])
        );
        assert!(s.rm.queues["dept"].queues["teamA"].priority_preemption);
        // The environment's lower-cased keys reach the same fields.
        let s = Settings::load_with_env(Some(&file), env(&[("GPUAM__RM__QUEUES__PROD__GUARANTEEDGPUS", "3")])).unwrap();
        assert_eq!(s.rm.queues["prod"].guaranteed_gpus, 3);
        std::fs::write(&file, "rm:\n  queues:\n    a: {wieght: 1}\n").unwrap();
        let e = Settings::load_with_env(Some(&file), env(&[])).unwrap_err();
        assert!(e.to_string().contains("wieght"), "{e}");
    }

    #[test]
    fn tls_paths_resolve_against_the_file_or_the_working_directory() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("gpuam.yaml");
        std::fs::write(
            &file,
            "tls:\n  cert_file: certs/c.pem\n  key_file: /abs/k.pem\n  ca_file: ca.pem\n",
        )
        .unwrap();
        let s = Settings::load_with_env(Some(&file), env(&[])).unwrap();
        assert_eq!(s.tls.cert_file, Some(dir.path().join("certs/c.pem")));
        assert_eq!(s.tls.key_file, Some(PathBuf::from("/abs/k.pem")));
        assert_eq!(s.tls.ca_file, Some(dir.path().join("ca.pem")));
        assert!(s.tls.serves_https());
        let s = Settings::load_with_env(Some(&file), env(&[("GPUAM__TLS__CA_FILE", "mine.pem")])).unwrap();
        assert_eq!(s.tls.ca_file, Some(std::env::current_dir().unwrap().join("mine.pem")));
        assert_eq!(s.tls.env_vars().len(), 3);
        assert!(!Settings::default().tls.serves_https());
    }
}
