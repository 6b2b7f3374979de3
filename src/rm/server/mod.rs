//! The RM's REST server (DESIGN.md §3): node listing, cluster info and metrics,
//! applications (submit, report, kill), the AM protocol (register / allocate /
//! finish behind per-application bearer tokens), and the embedded executor's
//! container endpoints. Also launches and watches one AM process per application.
//!
//! All state lives in one `parking_lot::Mutex<RmState>`; handlers take it (through
//! [`Shared::lock`]), authorize, call one transaction of `transactions` (the RM core: it
//! decides and commits what changed to the state store, SQLite, before it returns), drop
//! it, and only then await (executor stops, process kills): the store sees
//! changes in the order they happened, nothing is acknowledged before it is stored, and a
//! restarted RM recovers exactly what had been answered (see `state`).
//!
//! Credentials (DESIGN.md §10): every call about applications needs a user's token (the
//! users file, `rm.users_file`) or the admin token ([`http::Caller`]); an application
//! records its user, and only that user and the admin see it, kill it or read its logs.
//! Browser-borne requests are refused by `crate::http_guard` (Host, Origin, JSON bodies);
//! every listener has read timeouts (`crate::tls::serve_with`); limits on applications and
//! asks answer 429 naming their setting.
//!
//! RM restart: the store gives back applications, containers and node states; the
//! executor re-attaches to container processes still running, the RM to AM processes
//! still running (or starts the next attempt of an AM that died meanwhile), and each
//! AM, whose heartbeat now gets `command: RESYNC`, registers again and carries on.
//!
//! Protocol choices worth knowing:
//! - Every ask is answered in the heartbeat that carries it, either `allocated` or
//!   `rejected`; asks never stay pending, so `cancels` are accepted and ignored.
//! - Containers the AM `releases` are freed at once and are NOT reported back in
//!   `completed` (the AM already knows); containers that end any other way (exit,
//!   AM `stop` via the executor endpoint, expiry, node loss, kill) are.
//!
//! Where things are: this file starts the RM ([`start`], [`RmHandle`]), routes, and
//! reloads the users file;
//! `state` holds the state and its lock (persist on drop) and recovery; `http` the error
//! answer, the body extractor and the credential checks; `cluster` the cluster and node
//! endpoints; `applications` submit / report / kill; `am_protocol` register / allocate /
//! finish; `transactions` the RM core: every transaction over the state (allocate, start,
//! ending a container, node events, expiry, submit, kill), each committing once, which
//! the handlers and background loops call; `am_supervisor` the AM processes;
//! `containers` the container endpoints that forward to the node backends; `nodes` the
//! node agents' registration, heartbeats and liveness.
use crate::cluster::rm_json::ObjectForm;
use crate::cluster::{Node, NodeState};
use crate::protocol::exit_status;
use crate::rm::apps::App;
use crate::rm::ledger::{Ledger, DEFAULT_CONTAINER_EXPIRY};
use crate::rm::store::Store;
use crate::rm::users::Users;
use axum::extract::{DefaultBodyLimit, State};
use axum::routing::{get, post};
use axum::Router;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

mod am_protocol;
mod am_supervisor;
pub use am_supervisor::AM_PROCESS_FILE;
mod applications;
mod cluster;
mod containers;
mod dashboard;
mod fair;
mod history;
mod http;
mod logs;
mod nodes;
mod private;
mod scheduling;
mod state;
mod transactions;
use am_protocol::{am_allocate, am_finish, am_register};
use am_supervisor::{reattach, AmProc};
use applications::{get_app, get_app_attempts, get_app_state, list_apps, new_application, put_app_state, submit_app};
use cluster::{
    change_node_state, cluster_info, cluster_metrics, get_node, list_nodes, post_node_wiped, put_node_state, NodeView,
};
use containers::{
    container_logs, container_start, container_status, container_stop, containers_start, spawn_stops, stop_running,
};
use http::ApiError;
pub use logs::HistoryOptions;
use nodes::{agent_heartbeat, agent_register, await_agents, delete_node, on_node_event, spawn_liveness, Nodes};
use state::{recover_state, RmState, StateGuard};

/// Largest request body accepted (413 beyond).
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// The limits every caller is held to (settings `rm.max_apps`, `rm.max_apps_per_user`,
/// `rm.max_asks_per_allocate`, `rm.allow_public_dashboards`, `rm.dashboard_ports`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RmLimits {
    /// Unfinished applications at once, all users together (429 beyond).
    pub max_apps: usize,
    /// Unfinished applications at once of one user, the admin included (429 beyond).
    pub max_apps_per_user: usize,
    /// Asks in one allocate request (429 beyond: the AM sends the rest later).
    pub max_asks_per_allocate: usize,
    /// A job may ask for a dashboard address that is not loopback.
    pub allow_public_dashboards: bool,
    /// The dashboard ports a user's job may name (`rm.dashboard_ports`); others take port 0.
    pub dashboard_ports: crate::resources::PortSet,
    /// The longest an idle AM's allocate call is held (`AllocateRequest::hold_ms`;
    /// `protocol::MAX_ALLOCATE_HOLD_MS`, longer only in tests).
    pub max_allocate_hold: Duration,
}

impl From<&crate::config::RmSettings> for RmLimits {
    fn from(s: &crate::config::RmSettings) -> Self {
        RmLimits {
            max_apps: s.max_apps,
            max_apps_per_user: s.max_apps_per_user,
            max_asks_per_allocate: s.max_asks_per_allocate,
            allow_public_dashboards: s.allow_public_dashboards,
            // Checked when the settings load (`Settings::validate`).
            dashboard_ports: s
                .dashboard_ports
                .as_deref()
                .and_then(|p| crate::resources::PortSet::parse(p).ok())
                .unwrap_or_default(),
            max_allocate_hold: Duration::from_millis(crate::protocol::MAX_ALLOCATE_HOLD_MS),
        }
    }
}

impl Default for RmLimits {
    /// The settings' defaults.
    fn default() -> Self {
        (&crate::config::RmSettings::default()).into()
    }
}

/// How to run an RM.
#[derive(Clone, Debug)]
pub struct RmOptions {
    pub nodes: Vec<Node>,
    pub listen: SocketAddr,
    /// Holds `<appId>/job.yaml`, the AM's output and the containers' directories.
    pub work_dir: PathBuf,
    /// The program launched as `<am_program> am ...`; default: this executable.
    pub am_program: Option<PathBuf>,
    /// False: submitted applications get no AM process (tests drive the AM protocol).
    pub launch_am: bool,
    /// Granted containers never started within this time are taken back.
    pub container_expiry: Duration,
    /// Bearer token for administrative calls (node state, kill). `None`: a fresh one
    /// is generated at start and written to `<work_dir>/admin.token` (mode 0600).
    pub admin_token: Option<String>,
    /// AM attempts per application: an AM that dies without finishing is started again
    /// (keeping the job's containers) until this many attempts have run.
    pub max_am_attempts: u32,
    /// Where the state database lives (`<dir>/rm-state.db`); `None`: in memory only, a
    /// restarted RM starts empty.
    pub state_dir: Option<PathBuf>,
    /// Serve HTTPS with this config (`None`: plain HTTP).
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// `tls.ca_file`: the CAs the client to node agents trusts for their HTTPS.
    pub agent_ca_file: Option<PathBuf>,
    /// Run containers on a Ray cluster instead of this process's executor (its dashboard
    /// client and the cancel gate its jobs ask; see `crate::ray`).
    pub ray: Option<crate::ray::Backend>,
    /// The node agents' credentials file (`nodes:` host → token digest, `gpuam node-token
    /// new`; reloaded when it changes): `None`, no agents accepted.
    pub nodes_file: Option<PathBuf>,
    /// A node agent silent this long is LOST (`rm.node_expiry_sec`).
    pub node_expiry: Duration,
    /// After a restart, how long the node agents of the stored state have to register
    /// again before their hosts are LOST (`rm.node_reregister_grace_sec`); meanwhile their
    /// containers are kept and the hosts are listed NEW.
    pub node_reregister_grace: Duration,
    /// The users file (`rm.users_file`): reloaded when it changes and on SIGHUP. `None`:
    /// only the admin token and `users` are accepted.
    pub users_file: Option<PathBuf>,
    /// Users known without a file (`gpuam run`'s embedded RM makes its own).
    pub users: Users,
    pub limits: RmLimits,
    /// Names besides loopback and the listen address that a request's `Host` may give
    /// (`rm.public_names`).
    pub public_names: Vec<String>,
    /// Read timeouts of the listener (`http.read_timeout_sec`).
    pub http_timeouts: crate::tls::HttpTimeouts,
    /// Repair damaged state instead of refusing it (`gpuam rm --recover-state`); what was
    /// dropped is in [`RmHandle::recovery_notes`].
    pub recover_state: bool,
    /// Most bytes of each container log on the in-process node (`node.max_log_bytes`).
    pub max_log_bytes: Option<u64>,
    /// The queues jobs run in (`rm.queues`).
    pub queues: crate::rm::scheduler::queues::QueueTree,
    /// Notice before a preempted container is stopped (`rm.preemption_grace_sec`).
    pub preemption_grace: Duration,
    /// Which waiting gangs get a reservation (`rm.reserve_wait_sec`, `rm.reserve_min_gpus`).
    pub reserve: crate::rm::scheduler::reservation::Policy,
    /// How long finished jobs and their collected logs are kept, and how much of each log.
    pub history: HistoryOptions,
    /// The `gpuam` executable that runs the subreaper shim on the in-process node where no
    /// cgroup can be created (`None`: process groups only there). `gpuam rm` and `gpuam
    /// run` set it to themselves.
    pub shim_exe: Option<PathBuf>,
    /// Which uid each user's tasks run as on the in-process node, as on an agent
    /// (`node.user_map`, `node.task_uids`; see `crate::node::identity`): `gpuam rm` and
    /// `gpuam run` set it from the settings; `None` (library use, unit tests): tasks run
    /// as this process.
    pub task_identity: Option<crate::node::identity::IdentitySettings>,
    /// How long a finished container's logs stay (`node.log_retention_sec`).
    pub log_retention: Option<Duration>,
    /// How long after its end a container's work directory goes (`node.work_dir_grace_sec`).
    pub work_dir_grace: Option<Duration>,
    /// What the in-process node does with a task that names an image (`node.*`).
    pub image: crate::node::image::ImagePolicy,
    /// Disk, pids and device bounds of the in-process node (`node.*`).
    pub bounds: crate::node::bounds::NodeBounds,
}

/// frameworklauncher's `amAttemptMaxCount`.
pub const DEFAULT_MAX_AM_ATTEMPTS: u32 = 3;

impl RmOptions {
    /// Defaults: AM launch on, this executable as the AM, 600 s container expiry, a
    /// generated admin token, state kept in SQLite in the work dir.
    pub fn new(nodes: Vec<Node>, listen: SocketAddr, work_dir: PathBuf) -> Self {
        RmOptions {
            state_dir: Some(work_dir.clone()),
            nodes,
            listen,
            work_dir,
            am_program: None,
            launch_am: true,
            container_expiry: DEFAULT_CONTAINER_EXPIRY,
            admin_token: None,
            max_am_attempts: DEFAULT_MAX_AM_ATTEMPTS,
            tls: None,
            agent_ca_file: None,
            ray: None,
            nodes_file: None,
            node_expiry: Duration::from_secs(15),
            node_reregister_grace: Duration::from_secs(crate::config::RmSettings::default().node_reregister_grace_sec),
            users_file: None,
            users: Users::default(),
            limits: RmLimits::default(),
            public_names: Vec::new(),
            http_timeouts: crate::tls::HttpTimeouts::default(),
            recover_state: false,
            max_log_bytes: Some(crate::config::NodeSettings::default().max_log_bytes),
            queues: Default::default(),
            preemption_grace: Duration::from_secs(30),
            reserve: scheduling::default_reserve_policy(),
            history: HistoryOptions::default(),
            shim_exe: None,
            task_identity: None,
            log_retention: None,
            work_dir_grace: None,
            image: Default::default(),
            bounds: crate::node::bounds::NodeBounds::from_settings(&Default::default()).unwrap_or_default(),
        }
    }

    /// As [`RmOptions::new`], with everything the settings decide (`rm.*`, `http.*`,
    /// `node.max_log_bytes`); the one place settings become RM options. `Err`: invalid
    /// queue settings, as a message naming the key.
    pub fn from_settings(
        settings: &crate::config::Settings,
        nodes: Vec<Node>,
        listen: SocketAddr,
        work_dir: PathBuf,
    ) -> Result<Self, String> {
        let rm = &settings.rm;
        Ok(RmOptions {
            container_expiry: Duration::from_secs(rm.container_expiry_sec),
            max_am_attempts: rm.max_am_attempts,
            node_expiry: Duration::from_secs(rm.node_expiry_sec.max(1)),
            node_reregister_grace: Duration::from_secs(rm.node_reregister_grace_sec.max(1)),
            queues: crate::rm::scheduler::queues::QueueTree::from_settings(&rm.queues)?,
            preemption_grace: Duration::from_secs(rm.preemption_grace_sec),
            reserve: crate::rm::scheduler::reserved::policy(rm.reserve_wait_sec, rm.reserve_min_gpus),
            users_file: rm.users_file.clone(),
            limits: rm.into(),
            public_names: rm.public_names.clone(),
            http_timeouts: (&settings.http).into(),
            max_log_bytes: Some(settings.node.max_log_bytes),
            history: rm.into(),
            task_identity: match settings.node.in_process_identity {
                true => Some(crate::node::identity::IdentitySettings::from_settings(
                    &settings.node,
                    None,
                    Default::default(),
                )?),
                false => None,
            },
            log_retention: Some(Duration::from_secs(settings.node.log_retention_sec)),
            work_dir_grace: Some(Duration::from_secs(settings.node.work_dir_grace_sec)),
            image: crate::node::image::ImagePolicy::from_settings(&settings.node),
            bounds: crate::node::bounds::NodeBounds::from_settings(&settings.node)?,
            ..RmOptions::new(nodes, listen, work_dir)
        })
    }
}

/// The users the RM accepts, besides the admin.
pub(crate) struct UsersTable {
    pub(crate) file: Option<PathBuf>,
    /// The file's users plus those given in `RmOptions::users`.
    pub(crate) table: parking_lot::RwLock<Users>,
    fixed: Users,
}

impl UsersTable {
    /// Reads the file again; on an error the users stay as they were (logged).
    fn reload(&self) {
        let Some(path) = &self.file else {
            return;
        };
        match crate::rm::users::load(path) {
            Ok(mut users) => {
                for name in self.fixed.names() {
                    tracing::debug!(user = name, "kept from the RM's options");
                }
                users.merge(&self.fixed);
                let n = users.len();
                *self.table.write() = users;
                tracing::info!(file = %path.display(), users = n, "users file loaded");
            }
            Err(e) => tracing::error!("users file not reloaded, the users stay as they were: {e}"),
        }
    }
}

struct Shared {
    state: Mutex<RmState>,
    nodes: Nodes,
    base_url: String,
    work_dir: PathBuf,
    am_program: Option<PathBuf>,
    launch_am: bool,
    cluster_ts: u64,
    am_procs: Mutex<HashMap<String, AmProc>>,
    admin_token: String,
    max_am_attempts: u32,
    /// Set when an orderly shutdown begins: AMs stopped then are not started again.
    shutting_down: std::sync::atomic::AtomicBool,
    users: UsersTable,
    /// Where the admin token is, for the 401 of an RM without users.
    admin_token_hint: String,
    limits: RmLimits,
    /// Counters and the allocate-latency histogram of `/metrics`.
    metrics: dashboard::RmMetrics,
    /// History and log retention.
    history: HistoryOptions,
    /// The bytes of kept logs per application (locked before `state`; held while one
    /// container's logs are weighed and written).
    kept_logs: Mutex<logs::KeptLogs>,
    /// The node listing's bytes (`cluster::NodeView`; locked after `state`).
    node_view: Mutex<NodeView>,
    /// The same, lean (`?view=lean`).
    node_view_lean: Mutex<NodeView>,
    /// The same, compact (`?view=compact`: what AMs read).
    node_view_compact: Mutex<NodeView>,
    /// `POST /ws/v1/cluster/estimate`s computed at once ([`scheduling::ESTIMATES`], one per
    /// user): each takes a snapshot of every node and container under the state lock, which
    /// a caller's flood must not hold for the AMs' and agents' calls, and walks a CPU
    /// (429 while the caller's own or every permit is taken).
    estimating: fair::FairPermits,
    /// Submitted job specs being checked ([`applications::SPEC_CHECKS`] at once, one per
    /// user, each on a blocking thread that holds its permit).
    spec_checks: fair::FairPermits,
    /// Live log reads from nodes at once ([`logs::LIVE_LOG_READS`], a few per user): each
    /// brings up to 8 MiB from an agent into the RM.
    live_logs: fair::FairPermits,
    /// The addresses whose connections take the listener's reserved pool: this host's
    /// (its AMs, its CLI), this RM's own address, and each live node agent's as its
    /// authenticated calls came from (audit 5 F4: a flood from other sources cannot
    /// lock agents out).
    reserved_peers: crate::tls::ReservedPeers,
}

impl Shared {
    /// Takes the state lock (see [`StateGuard`]).
    fn lock(&self) -> StateGuard<'_> {
        StateGuard {
            st: self.state.lock(),
            cluster_ts: self.cluster_ts,
        }
    }
}

/// Changes node states of a running RM (see [`RmHandle::node_control`]).
#[derive(Clone)]
pub struct NodeControl(Arc<Shared>);

impl NodeControl {
    /// As [`RmHandle::set_node_state`].
    pub async fn set_node_state(&self, host: &str, state: NodeState) -> bool {
        change_node_state(&self.0, host, state).await.is_some()
    }
}

/// A running RM.
pub struct RmHandle {
    addr: SocketAddr,
    admin_token_file: Option<PathBuf>,
    recovery_notes: Vec<String>,
    shared: Arc<Shared>,
    server: JoinHandle<()>,
    stop_server: oneshot::Sender<()>,
    background: Vec<JoinHandle<()>>,
}

/// The name of the in-process node's parent cgroup for the (canonical) work dir
/// `work_dir`: named after it, so that a restarted RM finds its containers again and two
/// RMs on one machine do not meet.
pub fn in_process_cgroups(work_dir: &Path) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    work_dir.hash(&mut h);
    format!("gpuam-rm-{:016x}", h.finish())
}

/// Starts the RM: binds `opts.listen`, serves, and runs the executor-event and
/// container-expiry tasks.
pub async fn start(opts: RmOptions) -> anyhow::Result<RmHandle> {
    tokio::fs::create_dir_all(&opts.work_dir)
        .await
        .map_err(|e| anyhow::anyhow!("cannot create the RM work dir {}: {e}", opts.work_dir.display()))?;
    // Absolute: AMs run in their application's directory and are handed paths in here.
    let work_dir = std::fs::canonicalize(&opts.work_dir)
        .map_err(|e| anyhow::anyhow!("cannot resolve the RM work dir {}: {e}", opts.work_dir.display()))?;
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", opts.listen))?;
    let addr = listener.local_addr()?;
    let base_url = base_url_of(addr, opts.tls.is_some());
    let (admin_token, admin_token_file) = match opts.admin_token.filter(|t| !t.trim().is_empty()) {
        Some(t) => (t.trim().to_string(), None),
        None => {
            // The token an earlier start wrote stays (copies of it keep working after a
            // restart); removing the file makes a new one.
            let path = work_dir.join(ADMIN_TOKEN_FILE);
            let kept = crate::auth::read_kept_secret(&path)
                .map_err(|e| anyhow::anyhow!("cannot read the admin token: {e}"))?;
            let t = match kept {
                Some(t) => t,
                None => {
                    let t = super::apps::new_token();
                    crate::auth::write_secret(&path, &t)
                        .map_err(|e| anyhow::anyhow!("cannot write the admin token to {}: {e}", path.display()))?;
                    t
                }
            };
            (t, Some(path))
        }
    };
    let admin_token_hint = match &admin_token_file {
        Some(p) => format!("the RM wrote it to {}", p.display()),
        None => "as configured with --admin-token-file or GPUAM_ADMIN_TOKEN".to_string(),
    };
    let mut users = opts.users.clone();
    if let Some(path) = &opts.users_file {
        let mut from_file = super::users::load(path)?;
        from_file.merge(&opts.users);
        users = from_file;
    }
    if users.is_empty() && opts.users_file.is_none() {
        tracing::warn!(
            "no users file (--users-file, rm.users_file): only the admin token can submit, list and kill applications"
        );
    }

    // `local: true` nodes get this machine's real GPUs (nvidia-smi blocks: off the runtime).
    let mut nodes = opts.nodes;
    if nodes.iter().any(|n| n.local) {
        let found = tokio::task::spawn_blocking(crate::node::gpu_discovery::discover)
            .await
            .ok()
            .flatten();
        crate::node::gpu_discovery::apply_to_local_nodes(&mut nodes, found.as_ref());
    }
    // The ports the in-process node offers (its containers' bind guard).
    let in_process_ports = nodes
        .iter()
        .filter(|n| n.http_address.is_empty())
        .fold(crate::resources::PortSet::new(), |all, n| all.union(&n.total().ports));
    // Simulated nodes run their containers in this process's executor.
    let nodes = nodes.into_iter().map(|mut n| {
        if n.http_address.is_empty() {
            n.http_address = base_url.clone();
        }
        n
    });
    let store = match &opts.state_dir {
        Some(dir) if opts.recover_state => Store::open_recovering(dir)?,
        Some(dir) => Store::open(dir)?,
        None => Store::memory(),
    };
    let mut sched = scheduling::SchedState::new(opts.queues, opts.preemption_grace);
    sched.reserve = opts.reserve;
    let (mut state, cluster_ts) = recover_state(store, Ledger::new(nodes, opts.container_expiry), sched, &base_url)?;
    let recovery_notes = state.store.notes().to_vec();
    for note in &recovery_notes {
        tracing::warn!("state recovery: {note}");
    }
    // What recovery rebuilt (the meta row, repairs) is stored before anything is served.
    state.persist(cluster_ts).map_err(|e| anyhow::anyhow!("{e}"))?;
    let (events_tx, mut events_rx) = mpsc::unbounded_channel();
    let agents = match &opts.nodes_file {
        Some(path) => {
            let credentials = crate::rm::users::load_table(path, crate::rm::users::Table::Nodes)?;
            tracing::info!(hosts = credentials.len(), file = %path.display(), "node agents' credentials");
            // Beside the state (what keeps the agents' hosts), else in the work dir.
            let secret = crate::node::remote::load_or_create_secret(
                &opts
                    .state_dir
                    .as_deref()
                    .unwrap_or(&work_dir)
                    .join(crate::node::remote::HOST_KEYS_SECRET_FILE),
            )?;
            Some(Arc::new(crate::node::remote::AgentNodes::new(
                credentials,
                secret,
                opts.agent_ca_file.as_deref(),
            )?))
        }
        None => None,
    };
    // The in-process node's cgroups: named after the work dir, so that a restarted RM
    // finds its containers again and two RMs on one machine do not meet.
    let containment =
        crate::node::cgroup::Containment::detect(&in_process_cgroups(&work_dir)).with_shim(opts.shim_exe.clone());
    // Its tasks may bind the ports granted to them, none granted to another, nor the RM's
    // own (a task that took it while the RM restarts would be sent every agent's token).
    let guard = crate::node::bind_guard::BindGuard {
        managed: in_process_ports,
        reserved: crate::resources::PortSet::from_ports([addr.port()]),
    };
    let containment = opts
        .bounds
        .apply(containment)
        .map_err(anyhow::Error::msg)?
        .with_bind_guard(guard);
    tracing::info!("in-process node {}", containment.describe());
    let ray = opts.ray.map(|b| b.start(events_tx.clone()));
    // The in-process node runs each user's tasks as the agents do (one rule:
    // `node::identity`); its directories are made reachable for them, nothing more.
    let task_users = match &opts.task_identity {
        Some(identity) => {
            let users = crate::node::identity::TaskUsers::for_node(identity).map_err(anyhow::Error::msg)?;
            tracing::info!("in-process node: {}", users.describe());
            Some(Arc::new(users))
        }
        None => None,
    };
    if task_users.is_some() {
        crate::node::identity::open_for_tasks(&work_dir, &work_dir.join("containers")).map_err(anyhow::Error::msg)?;
    }
    let local = crate::node::InProcessNode::new(
        work_dir.join("containers"),
        events_tx,
        crate::node::executor::ExecutorOptions {
            containment,
            max_log_bytes: opts.max_log_bytes,
            users: task_users,
            retention: opts.log_retention,
            work_dir_grace: opts.work_dir_grace,
            ends_heard_here: true,
            max_disk_mb: opts.bounds.max_disk_mb,
            image: opts.image,
            ..Default::default()
        },
    );
    // Tells this RM process's node listing versions from another's (see `cluster::NodeView`).
    let incarnation = rand::random::<u64>() >> 16;
    // What the RM kept before it restarted counts against the log budgets.
    let kept_logs = logs::KeptLogs::scan(&work_dir);
    let shared = Arc::new(Shared {
        state: Mutex::new(state),
        nodes: Nodes {
            local,
            agents: agents.clone(),
            ray,
        },
        base_url: base_url.clone(),
        work_dir,
        am_program: opts.am_program,
        launch_am: opts.launch_am,
        cluster_ts,
        am_procs: Mutex::new(HashMap::new()),
        admin_token,
        max_am_attempts: opts.max_am_attempts.max(1),
        shutting_down: std::sync::atomic::AtomicBool::new(false),
        users: UsersTable {
            file: opts.users_file.clone(),
            table: parking_lot::RwLock::new(users),
            fixed: opts.users.clone(),
        },
        admin_token_hint,
        limits: opts.limits.clone(),
        metrics: dashboard::RmMetrics::default(),
        history: opts.history.clone(),
        kept_logs: Mutex::new(kept_logs),
        node_view: Mutex::new(NodeView::new(ObjectForm::Whole, incarnation)),
        node_view_lean: Mutex::new(NodeView::new(ObjectForm::Lean, incarnation)),
        node_view_compact: Mutex::new(NodeView::new(ObjectForm::Shape, incarnation)),
        estimating: fair::FairPermits::new(scheduling::ESTIMATES, 1),
        spec_checks: fair::FairPermits::new(applications::SPEC_CHECKS, 1),
        live_logs: fair::FairPermits::new(logs::LIVE_LOG_READS, logs::LIVE_LOG_READS_PER_USER),
        reserved_peers: {
            let r = crate::tls::ReservedPeers::this_host();
            // The AMs this RM starts connect to `base_url`, so from its address.
            r.set_wide(
                "this RM's address",
                if addr.ip().is_unspecified() {
                    [127, 0, 0, 1].into()
                } else {
                    addr.ip()
                },
            );
            r
        },
    });

    let mut background = Vec::new();
    let s = shared.clone();
    background.push(tokio::spawn(async move {
        while let Some(ev) = events_rx.recv().await {
            on_node_event(&s, ev);
        }
    }));
    await_agents(&shared, Instant::now() + opts.node_reregister_grace);
    if let Some(a) = &agents {
        background.push(spawn_liveness(shared.clone(), a.clone(), opts.node_expiry));
    }
    let s = shared.clone();
    let tick = (opts.container_expiry / 4).clamp(Duration::from_millis(20), Duration::from_secs(1));
    background.push(tokio::spawn(async move {
        let mut every = tokio::time::interval(tick);
        loop {
            every.tick().await;
            let mut st = s.lock();
            transactions::expire(&mut st, Instant::now());
            // A failing store is retried even when no request comes.
            let _ = st.writable();
        }
    }));
    if shared.users.file.is_some() {
        background.push(spawn_users_reload(shared.clone())?);
    }
    if let (Some(path), Some(a)) = (opts.nodes_file.clone(), &agents) {
        background.push(spawn_nodes_reload(path, a.clone()));
    }

    background.push(spawn_scheduler(shared.clone()));
    background.push(history::spawn_retention(shared.clone()));
    if shared.launch_am {
        background.push(am_supervisor::spawn_output_bound(shared.clone()));
    }

    let guard = crate::http_guard::Guard {
        served: crate::http_guard::Served::new(addr, &opts.public_names),
        require_json: true,
    };
    let router = guard.layer(router(shared.clone()));
    let (stop_server, stop_rx) = oneshot::channel::<()>();
    let timeouts = opts.http_timeouts;
    let reserved = shared.reserved_peers.clone();
    let server = tokio::spawn(async move {
        let serve = crate::tls::serve_reserving(listener, router, opts.tls, timeouts, reserved, async {
            let _ = stop_rx.await;
        });
        if let Err(e) = serve.await {
            tracing::error!("RM server stopped: {e}");
        }
    });
    tracing::info!(%base_url, "RM listening");
    reattach(&shared);
    Ok(RmHandle {
        addr,
        admin_token_file,
        recovery_notes,
        shared,
        server,
        stop_server,
        background,
    })
}

/// Reloads the users file when it changes (checked every second) and on SIGHUP.
fn spawn_users_reload(rm: Arc<Shared>) -> anyhow::Result<JoinHandle<()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = signal(SignalKind::hangup()).map_err(|e| anyhow::anyhow!("cannot watch SIGHUP: {e}"))?;
    Ok(tokio::spawn(async move {
        let stamp = |rm: &Shared| file_stamp(rm.users.file.as_ref()?);
        let mut seen = stamp(&rm);
        let mut every = tokio::time::interval(Duration::from_secs(1));
        loop {
            let by_signal = tokio::select! {
                _ = every.tick() => false,
                _ = hup.recv() => true,
            };
            let now = stamp(&rm);
            if by_signal || now != seen {
                seen = now;
                rm.users.reload();
            }
        }
    }))
}

/// What tells a file changed: inode, modification time and length.
fn file_stamp(path: &Path) -> Option<(u64, i64, i64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.ino(), m.mtime(), m.mtime_nsec(), m.len()))
}

/// Reloads the node agents' credentials file when it changes (checked every second): a
/// host taken out of it is refused from its next call on. A file that does not read
/// leaves the credentials as they were (logged).
fn spawn_nodes_reload(path: PathBuf, agents: Arc<crate::node::remote::AgentNodes>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut seen = file_stamp(&path);
        let mut every = tokio::time::interval(Duration::from_secs(1));
        loop {
            every.tick().await;
            let now = file_stamp(&path);
            if now == seen {
                continue;
            }
            seen = now;
            match crate::rm::users::load_table(&path, crate::rm::users::Table::Nodes) {
                Ok(c) => {
                    tracing::info!(hosts = c.len(), "node agents' credentials reloaded");
                    agents.set_credentials(c);
                }
                Err(e) => tracing::error!("node agents' credentials not reloaded (kept as they were): {e}"),
            }
        }
    })
}

/// The scheduling pass every [`scheduling::TICK`]: preemption deadlines, new victims (their
/// nodes are told at once; their AMs in their next answers), why applications wait, and
/// when due their start estimates (walked off the state lock).
fn spawn_scheduler(shared: Arc<Shared>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(scheduling::TICK);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let work = {
                let mut st = shared.lock();
                let work = scheduling::tick(&mut st, Instant::now());
                if !work.ended.is_empty() {
                    st.commit_or_log();
                }
                work
            };
            spawn_stops(&shared, work.ended);
            if let Some(pass) = work.estimates {
                // The estimates' walks, off the state and off the async workers; the state
                // is locked again only to write what they found.
                let s = shared.clone();
                tokio::spawn(async move {
                    let walked = tokio::task::spawn_blocking(move || pass.walk()).await;
                    if let Err(e) = &walked {
                        tracing::error!("the start estimates failed: {e}");
                    }
                    scheduling::estimated(&mut s.lock(), walked.ok());
                });
            }
            for (host, id, deadline_ms, reason) in work.notify {
                let s = shared.clone();
                tokio::spawn(async move {
                    let node = s.nodes.for_host(&host);
                    if let Err(e) = node.notify_preemption(&host, &id, deadline_ms, &reason).await {
                        tracing::warn!(container = %id, "could not tell the container it is preempted: {e}");
                    }
                });
            }
        }
    })
}

/// Name of the generated admin token's file in the work dir.
pub const ADMIN_TOKEN_FILE: &str = "admin.token";

fn base_url_of(addr: SocketAddr, tls: bool) -> String {
    let ip = if addr.ip().is_unspecified() {
        std::net::IpAddr::from([127, 0, 0, 1])
    } else {
        addr.ip()
    };
    format!("{}://{}", crate::tls::scheme(tls), SocketAddr::new(ip, addr.port()))
}

impl RmHandle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://host:port` or `https://…` (loopback when listening on all interfaces).
    pub fn base_url(&self) -> String {
        self.shared.base_url.clone()
    }

    /// What `GET /metrics` answers now (OpenMetrics text), read in-process.
    pub fn metrics_text(&self) -> String {
        dashboard::metrics_text(&self.shared)
    }

    /// The bearer token of administrative calls (node state changes, kill).
    pub fn admin_token(&self) -> &str {
        &self.shared.admin_token
    }

    /// Where the generated admin token was written (`None` when it was configured).
    pub fn admin_token_file(&self) -> Option<&Path> {
        self.admin_token_file.as_deref()
    }

    /// What `RmOptions::recover_state` repaired or dropped (empty otherwise).
    pub fn recovery_notes(&self) -> &[String] {
        &self.recovery_notes
    }

    /// The users the RM accepts now (besides the admin).
    pub fn user_names(&self) -> Vec<String> {
        self.shared.users.table.read().names().map(str::to_string).collect()
    }

    /// Test support: the ledger's incremental usage against a full recount
    /// ([`crate::rm::ledger::Ledger::audit_usage`]).
    pub fn audit_usage(&self) -> Result<(), String> {
        self.shared.lock().ledger.audit_usage()
    }

    /// Starts the ledger's grant audit log (tests and load runs).
    pub fn enable_grant_audit(&self) {
        self.shared.lock().ledger.enable_audit();
    }

    /// The grant audit log so far (see [`crate::rm::ledger::verify_audit`]).
    pub fn grant_audit(&self) -> Vec<crate::rm::ledger::AuditEvent> {
        self.shared.lock().ledger.audit_log().to_vec()
    }

    /// True when no container is live anywhere (for tests).
    pub fn ledger_all_free(&self) -> bool {
        self.shared.lock().ledger.all_free()
    }

    /// The nodes as the ledger sees them now, with live container counts.
    pub fn nodes_snapshot(&self) -> Vec<(Node, u32)> {
        let st = self.shared.lock();
        st.ledger.nodes().map(|(n, c)| (n.clone(), c)).collect()
    }

    pub fn app_report(&self, app_id: &str) -> Option<crate::protocol::AppReport> {
        self.shared.lock().apps.get(app_id).map(|a| a.report.clone())
    }

    /// Test support: creates an ACCEPTED application without a job spec and without
    /// an AM process, returning `(app id, bearer token)`, so tests can speak the AM
    /// protocol themselves.
    pub fn register_test_app(&self, name: &str) -> (String, String) {
        let mut st = self.shared.lock();
        let id = st
            .next_app_id(self.shared.cluster_ts)
            .unwrap_or_else(|e| panic!("no id for a test app: {}", e.message));
        let mut app = App::new(id.clone(), name.to_string());
        app.report.user = crate::rm::users::ADMIN_USER.to_string();
        let token = app.token().to_string();
        st.apps.insert(app);
        st.commit_or_log();
        (id, token)
    }

    /// Test support: the bearer token of an application's AM (as the RM hands it to the AM
    /// it launches).
    pub fn app_token(&self, app_id: &str) -> Option<String> {
        self.shared.lock().apps.get(app_id).map(|a| a.token().to_string())
    }

    /// Changes a node's state (e.g. LOST: its containers complete with -100 and are
    /// reported to their applications). False for an unknown host.
    pub async fn set_node_state(&self, host: &str, state: NodeState) -> bool {
        change_node_state(&self.shared, host, state).await.is_some()
    }

    /// A handle that changes node states from another task (the Ray node watch).
    pub fn node_control(&self) -> NodeControl {
        NodeControl(self.shared.clone())
    }

    /// A container's output from byte `offset` on this process's own node (`gpuam run`'s
    /// embedded RM): see [`crate::node::executor::Executor::read_log_from`].
    pub fn read_local_log(
        &self,
        container_id: &str,
        stream: crate::node::executor::LogStream,
        offset: u64,
        max: u64,
    ) -> Result<(Vec<u8>, u64), crate::node::NodeError> {
        self.shared
            .nodes
            .local
            .executor()
            .read_log_from(container_id, stream, offset, max)
    }

    /// What [`RmHandle::shutdown`] would stop now: every application not finished
    /// (id, user, live containers) and the number of AM processes.
    pub fn live_work(&self) -> (Vec<(String, String, usize)>, usize) {
        let ams = self.shared.am_procs.lock().len();
        let st = self.shared.lock();
        let apps = st
            .apps
            .values()
            .filter(|a| !a.report.state.is_final())
            .map(|a| {
                let id = &a.report.id;
                (
                    id.clone(),
                    a.report.user.clone(),
                    st.ledger.live_containers_of(id).len(),
                )
            })
            .collect();
        (apps, ams)
    }

    /// Stops every container and AM process, then the server.
    pub async fn shutdown(self) {
        self.shared
            .shutting_down
            .store(true, std::sync::atomic::Ordering::SeqCst);
        // Stop taking requests first, so no container can be started while we stop them.
        let _ = self.stop_server.send(());
        let _ = tokio::time::timeout(Duration::from_secs(5), self.server).await;
        let procs: Vec<AmProc> = self.shared.am_procs.lock().drain().map(|(_, p)| p).collect();
        for mut p in procs {
            if let Some(k) = p.kill.take() {
                let _ = k.send(());
            }
            let _ = tokio::time::timeout(Duration::from_secs(5), p.task).await;
        }
        let ended = transactions::end_all(
            &mut self.shared.lock(),
            exit_status::KILLED_BY_RESOURCEMANAGER,
            "the RM is shutting down",
        );
        stop_running(&self.shared, &ended).await;
        // Anything the executor still runs goes too: no task outlives an orderly shutdown.
        self.shared
            .nodes
            .local
            .executor()
            .stop_all(Duration::from_secs(3))
            .await;
        self.shared.nodes.local.executor().containment().remove_parents();
        for b in self.background {
            b.abort();
        }
    }
}

type Rm = State<Arc<Shared>>;

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/ws/v1/cluster", get(cluster_info))
        .route("/ws/v1/cluster/info", get(cluster_info))
        .route("/ws/v1/cluster/metrics", get(cluster_metrics))
        .route("/ws/v1/cluster/nodes", get(list_nodes))
        .route("/ws/v1/cluster/nodes/{nodeid}", get(get_node).delete(delete_node))
        .route(
            "/ws/v1/cluster/nodes/{nodeid}/state",
            axum::routing::put(put_node_state),
        )
        .route("/ws/v1/cluster/nodes/{nodeid}/wiped", post(post_node_wiped))
        .route("/ws/v1/cluster/apps", get(list_apps).post(submit_app))
        .route("/ws/v1/cluster/apps/new-application", post(new_application))
        .route("/ws/v1/cluster/apps/{id}", get(get_app))
        .route("/ws/v1/cluster/apps/{id}/state", get(get_app_state).put(put_app_state))
        .route("/ws/v1/cluster/apps/{id}/appattempts", get(get_app_attempts))
        .route("/ws/v1/cluster/apps/{id}/containers", get(logs::get_app_containers))
        .route("/ws/v1/cluster/apps/{id}/logs/{role}/{index}", get(logs::get_task_log))
        .route("/ws/v1/cluster/history", get(history::get_history))
        .route("/ws/v1/cluster/estimate", post(scheduling::post_estimate))
        .route("/ws/v1/cluster/whoami", get(history::whoami))
        .route("/ws/v1/am/{id}/register", post(am_register))
        .route("/ws/v1/am/{id}/allocate", post(am_allocate))
        .route("/ws/v1/am/{id}/finish", post(am_finish))
        .route("/ws/v1/node-agents/register", post(agent_register))
        .route("/ws/v1/node-agents/{host}/heartbeat", post(agent_heartbeat))
        .route("/ws/v1/node/{host}/containers/{id}/start", post(container_start))
        .route("/ws/v1/node/containers/start", post(containers_start))
        .route("/ws/v1/node/{host}/containers/{id}/stop", post(container_stop))
        .route("/ws/v1/node/{host}/containers/{id}/status", get(container_status))
        .route("/ws/v1/node/{host}/containers/{id}/logs", get(container_logs))
        .route("/ws/v1/cluster/overview", get(dashboard::overview))
        .route("/metrics", get(dashboard::metrics))
        .route("/", get(crate::web::assets::cluster_html))
        .route("/cluster", get(crate::web::assets::cluster_html))
        .route("/cluster.js", get(crate::web::assets::cluster_js))
        .route("/cluster.css", get(crate::web::assets::cluster_css))
        .route("/style.css", get(crate::web::assets::style_css))
        .route("/reason.js", get(crate::web::assets::reason_js))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(shared)
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_reserve;
