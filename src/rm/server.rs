//! The RM's REST server (DESIGN.md §3): node listing, cluster info and metrics,
//! applications (submit, report, kill), the AM protocol (register / allocate /
//! finish behind per-application bearer tokens), and the embedded executor's
//! container endpoints. Also launches and watches one AM process per application.
//!
//! All state lives in one `parking_lot::Mutex<RmState>`; handlers take it (through
//! [`Shared::lock`]), decide, drop it, and only then await (executor stops, process
//! kills). Dropping the guard writes what changed to the state store (SQLite) before
//! the lock is released, so the store sees changes in the order they happened and a
//! restarted RM recovers exactly what had been answered.
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

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, SeekFrom};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Path as UrlPath, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::cluster::rm_json::{node_to_json, nodes_to_json};
use crate::cluster::{Node, NodeState};
use crate::protocol::{
    exit_status, AllocateRequest, AllocateResponse, AmCommand, AppState, AppStateUpdate, CompletedContainer,
    ContainerState, ContainerStatus, ErrorBody, FinalStatus, FinishRequest, FinishResponse, LaunchContext,
    NewApplication, PreviousContainer, RegisterRequest, RegisterResponse, SubmitApplication,
};
use crate::rm::apps::{app_id, app_seq, now_ms, AmLaunch, App, Apps};
use crate::rm::executor::{ExecError, LogStream};
use crate::rm::ledger::{Ended, Ledger, DEFAULT_CONTAINER_EXPIRY};
use crate::rm::procs::ProcessId;
use crate::rm::store::{Batch, Meta, Store};

mod nodes;
use nodes::*;

/// Largest request body accepted (413 beyond).
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// How long a killed application's AM gets to exit by itself before it is killed.
pub const AM_KILL_GRACE: Duration = Duration::from_secs(5);
/// SIGTERM → SIGKILL grace for containers the RM stops.
pub const CONTAINER_STOP_GRACE: Duration = Duration::from_secs(3);
/// Lines of am.stderr quoted when an AM dies without finishing.
const STDERR_TAIL_LINES: usize = 20;

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
    /// Run containers on a Ray cluster instead of this process's executor (its dashboard
    /// client and the cancel gate its jobs ask; see `crate::ray`).
    pub ray: Option<(crate::ray::client::RayClient, crate::ray::gate::Gate)>,
    /// The node token node agents present (`None`: no agents accepted).
    pub node_token: Option<String>,
    /// A node agent silent this long is LOST (`rm.node_expiry_sec`).
    pub node_expiry: Duration,
}

/// Most application ids handed out by new-application and not yet submitted that are
/// remembered (the oldest are forgotten first), so that calling new-application in a
/// loop cannot grow the RM without bound.
const MAX_RESERVED_IDS: usize = 10_000;

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
            ray: None,
            node_token: None,
            node_expiry: Duration::from_secs(15),
        }
    }
}

struct RmState {
    ledger: Ledger,
    apps: Apps,
    /// Ids handed out by new-application and not yet submitted.
    /// By sequence number, so the oldest are the first ones.
    reserved: BTreeMap<u32, String>,
    next_app_seq: u32,
    /// `next_app_seq` or `reserved` changed since the last write.
    meta_dirty: bool,
    store: Store,
    /// Writes to the store that failed (the RM keeps serving from memory).
    store_errors: u64,
}

impl RmState {
    /// Remembers an id handed out by new-application (forgetting the oldest beyond
    /// [`MAX_RESERVED_IDS`]).
    fn reserve(&mut self, id: String) {
        let Some(seq) = app_seq(&id) else {
            return;
        };
        self.reserved.insert(seq, id);
        while self.reserved.len() > MAX_RESERVED_IDS {
            self.reserved.pop_first();
        }
        self.meta_dirty = true;
    }

    /// A fresh application id.
    fn next_app_id(&mut self, cluster_ts: u64) -> String {
        self.next_app_seq += 1;
        self.meta_dirty = true;
        app_id(cluster_ts, self.next_app_seq)
    }

    fn is_reserved(&self, id: &str) -> bool {
        app_seq(id).is_some_and(|seq| self.reserved.get(&seq).is_some_and(|r| r == id))
    }

    /// Claims a reserved id; false when it was not reserved.
    fn unreserve(&mut self, id: &str) -> bool {
        let had = self.is_reserved(id);
        if let Some(seq) = app_seq(id).filter(|_| had) {
            self.reserved.remove(&seq);
        }
        self.meta_dirty |= had;
        had
    }

    /// Writes what changed since the last call in one transaction.
    fn persist(&mut self, cluster_ts: u64) {
        let apps = self.apps.take_dirty();
        let changes = self.ledger.take_changes();
        let meta_dirty = std::mem::take(&mut self.meta_dirty);
        if !self.store.is_durable() || (apps.is_empty() && changes.is_empty() && !meta_dirty) {
            return;
        }
        let batch = Batch {
            meta: meta_dirty.then(|| Meta {
                cluster_ts,
                next_app_seq: self.next_app_seq,
                reserved: self.reserved.values().cloned().collect(),
            }),
            apps: apps.iter().map(|id| (id.as_str(), self.apps.get(id))).collect(),
            containers: changes
                .containers
                .iter()
                .filter_map(|id| self.ledger.container(id))
                .collect(),
            nodes: changes
                .nodes
                .iter()
                .filter_map(|h| self.ledger.node(h).map(|n| (h.as_str(), n.state)))
                .collect(),
        };
        if let Err(e) = self.store.write(&batch) {
            self.store_errors += 1;
            tracing::error!(error = %e, "the RM's state could not be saved; a restart now would lose it");
        }
    }
}

/// The state lock; dropping it persists what changed (see the module doc).
struct StateGuard<'a> {
    st: parking_lot::MutexGuard<'a, RmState>,
    cluster_ts: u64,
}

impl std::ops::Deref for StateGuard<'_> {
    type Target = RmState;
    fn deref(&self) -> &RmState {
        &self.st
    }
}

impl std::ops::DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut RmState {
        &mut self.st
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        self.st.persist(self.cluster_ts);
    }
}

struct AmProc {
    /// Sending (or dropping) kills the AM process.
    kill: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
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
    shared: Arc<Shared>,
    server: JoinHandle<()>,
    stop_server: oneshot::Sender<()>,
    background: Vec<JoinHandle<()>>,
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
            let t = super::apps::new_token();
            let path = work_dir.join(ADMIN_TOKEN_FILE);
            write_secret(&path, &t)
                .map_err(|e| anyhow::anyhow!("cannot write the admin token to {}: {e}", path.display()))?;
            (t, Some(path))
        }
    };

    // `local: true` nodes get this machine's real GPUs (nvidia-smi blocks: off the runtime).
    let mut nodes = opts.nodes;
    if nodes.iter().any(|n| n.local) {
        let found = tokio::task::spawn_blocking(super::gpu_discovery::discover)
            .await
            .ok()
            .flatten();
        super::gpu_discovery::apply_to_local_nodes(&mut nodes, found.as_ref());
    }
    // Simulated nodes run their containers in this process's executor.
    let nodes = nodes.into_iter().map(|mut n| {
        if n.http_address.is_empty() {
            n.http_address = base_url.clone();
        }
        n
    });
    let store = match &opts.state_dir {
        Some(dir) => Store::open(dir)?,
        None => Store::memory(),
    };
    let (state, cluster_ts) = recover_state(store, Ledger::new(nodes, opts.container_expiry))?;
    let (events_tx, mut events_rx) = mpsc::unbounded_channel();
    let agents = match opts.node_token.as_deref().map(str::trim).filter(|t| !t.is_empty()) {
        Some(t) => Some(Arc::new(crate::node::remote::AgentNodes::new(
            t.to_string(),
            events_tx.clone(),
        )?)),
        None => None,
    };
    // The in-process node's cgroups: named after the work dir, so that a restarted RM
    // finds its containers again and two RMs on one machine do not meet.
    let containment = crate::node::cgroup::Containment::detect(&format!("gpuam-rm-{:016x}", {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        work_dir.hash(&mut h);
        h.finish()
    }));
    tracing::info!("in-process node {}", containment.describe());
    let ray = opts
        .ray
        .map(|(client, gate)| crate::ray::launcher::RayLauncher::new(client, gate, events_tx.clone()));
    let local = crate::node::InProcessNode::new(
        work_dir.join("containers"),
        events_tx,
        crate::node::executor::ExecutorOptions {
            containment,
            run_as: None,
        },
    );
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
    });

    let mut background = Vec::new();
    let s = shared.clone();
    background.push(tokio::spawn(async move {
        while let Some(ev) = events_rx.recv().await {
            on_node_event(&s, ev);
        }
    }));
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
            let ended = st.ledger.expire(Instant::now());
            for e in &ended {
                tracing::info!(container = %e.container_id, app = %e.app_id, "container expired unused");
                queue_completed(&mut st.apps, e);
            }
        }
    }));

    let router = router(shared.clone());
    let (stop_server, stop_rx) = oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let serve = crate::tls::serve(listener, router, opts.tls, async {
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
        shared,
        server,
        stop_server,
        background,
    })
}

/// Builds the RM's state from what the store kept (a fresh state when it kept nothing);
/// returns it with the cluster timestamp to use in ids.
fn recover_state(store: Store, mut ledger: Ledger) -> anyhow::Result<(RmState, u64)> {
    let mut apps = Apps::default();
    let Some(r) = store.recover()? else {
        let state = RmState {
            ledger,
            apps,
            reserved: BTreeMap::new(),
            next_app_seq: 0,
            meta_dirty: true,
            store,
            store_errors: 0,
        };
        return Ok((state, now_ms()));
    };
    for (host, state) in &r.node_states {
        if ledger.set_node_state(host, *state).is_none() {
            tracing::warn!(%host, "a node of the saved state is no longer in the cluster");
        }
    }
    let (now, wall) = (Instant::now(), now_ms());
    let not_restored: Vec<Ended> = r
        .containers
        .into_iter()
        .filter_map(|c| ledger.restore(c, now, wall))
        .collect();
    let live = r.apps.iter().filter(|a| !a.report.state.is_final()).count();
    for app in r.apps {
        apps.restore(app);
    }
    for e in &not_restored {
        tracing::warn!(container = %e.container_id, "{}", e.diagnostics);
        queue_completed(&mut apps, e);
    }
    tracing::info!(
        apps = apps.len(),
        unfinished = live,
        containers = ledger.live_containers().len(),
        "RM state recovered"
    );
    let state = RmState {
        ledger,
        apps,
        reserved: r
            .meta
            .reserved
            .into_iter()
            .filter_map(|id| Some((app_seq(&id)?, id)))
            .collect(),
        next_app_seq: r.meta.next_app_seq,
        meta_dirty: true,
        store,
        store_errors: 0,
    };
    Ok((state, r.meta.cluster_ts))
}

/// After a restart: the executor watches the containers that were running again (a
/// container whose process is gone completes with what it left behind), and each
/// unfinished application's AM is watched again, or, if it died meanwhile, replaced by
/// its next attempt.
fn reattach(rm: &Arc<Shared>) {
    let (running, ams) = {
        let st = rm.lock();
        let running: Vec<(String, String)> = st
            .ledger
            .live_containers()
            .into_iter()
            .filter_map(|id| {
                let c = st.ledger.container(&id)?;
                (c.state == ContainerState::Running).then(|| (c.container.host.clone(), id))
            })
            .collect();
        let ams: Vec<(String, Option<ProcessId>)> = st
            .apps
            .values()
            .filter(|a| !a.report.state.is_final() && !a.unregistered && a.launch.is_some())
            .map(|a| (a.report.id.clone(), a.running_am()))
            .collect();
        (running, ams)
    };
    for (host, id) in &running {
        rm.nodes.for_host(host).reattach(host, id);
    }
    if !rm.launch_am {
        return;
    }
    for (id, process) in ams {
        match process.filter(ProcessId::alive) {
            Some(p) => watch_inherited_am(rm, &id, p),
            None => {
                let rm = rm.clone();
                tokio::spawn(async move {
                    on_am_exit(&rm, &id, "it ended while the RM was down".into()).await;
                });
            }
        }
    }
}

/// Name of the generated admin token's file in the work dir.
pub const ADMIN_TOKEN_FILE: &str = "admin.token";

/// Writes a secret to a fresh file readable by its owner only (0600 from creation,
/// so there is no window where others could read it).
fn write_secret(path: &Path, secret: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(secret.as_bytes())?;
    f.write_all(b"\n")
}

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

    /// The bearer token of administrative calls (node state changes, kill).
    pub fn admin_token(&self) -> &str {
        &self.shared.admin_token
    }

    /// Where the generated admin token was written (`None` when it was configured).
    pub fn admin_token_file(&self) -> Option<&Path> {
        self.admin_token_file.as_deref()
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
        let id = st.next_app_id(self.shared.cluster_ts);
        let app = App::new(id.clone(), name.to_string());
        let token = app.token().to_string();
        st.apps.insert(app);
        (id, token)
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
        let ended: Vec<Ended> = {
            let mut st = self.shared.lock();
            let ids = st.ledger.live_containers();
            ids.iter()
                .filter_map(|id| {
                    st.ledger
                        .complete(id, exit_status::KILLED_BY_RESOURCEMANAGER, "the RM is shutting down")
                })
                .collect()
        };
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

/// Sets a node's state; unusable states end its containers (completed to their apps
/// with -100 and the lost-node diagnostics) and kill their process groups through the
/// executor. Returns how many containers ended; `None` for an unknown host.
async fn change_node_state(shared: &Shared, host: &str, state: NodeState) -> Option<usize> {
    let ended = {
        let mut st = shared.lock();
        let ended = st.ledger.set_node_state(host, state)?;
        for e in &ended {
            queue_completed(&mut st.apps, e);
        }
        ended
    };
    tracing::warn!(%host, ?state, containers = ended.len(), "node state changed by an administrator");
    stop_running(shared, &ended).await;
    Some(ended.len())
}

/// Queues an ended container for its application's next allocate answer.
fn queue_completed(apps: &mut Apps, e: &Ended) {
    if let Some(app) = apps.get_mut(&e.app_id) {
        app.pending_completed.push(CompletedContainer {
            container_id: e.container_id.clone(),
            exit_status: e.exit_status,
            diagnostics: e.diagnostics.clone(),
        });
    }
}

/// Stops the started ones among `ended` in the background, so heartbeats and
/// finish answers never wait for a process's grace period.
fn spawn_stops(shared: &Arc<Shared>, ended: Vec<Ended>) {
    if ended.iter().any(|e| e.was == ContainerState::Running) {
        let shared = shared.clone();
        tokio::spawn(async move { stop_running(&shared, &ended).await });
    }
}

/// Stops, through the executor, the ended containers that had been started.
async fn stop_running(shared: &Shared, ended: &[Ended]) {
    let stops = ended
        .iter()
        .filter(|e| e.was == ContainerState::Running)
        .map(|e| async move {
            let node = shared.nodes.for_host(&e.host);
            if let Err(err) = node.stop(&e.host, &e.container_id, CONTAINER_STOP_GRACE).await {
                tracing::warn!(container = %e.container_id, "stop failed: {err}");
            }
        });
    futures::future::join_all(stops).await;
}

// ---------------------------------------------------------------------------
// Errors and extractors

/// Every error answer: an HTTP status with an [`ErrorBody`].
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }
    fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "NOT_FOUND", message)
    }
    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "BAD_REQUEST", message)
    }
    fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "CONFLICT", message)
    }
    fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "UNAUTHORIZED",
            "missing or invalid `Authorization: Bearer <application token>`",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            code: self.code.to_string(),
            message: self.message,
        };
        (self.status, Json(body)).into_response()
    }
}

impl From<ExecError> for ApiError {
    fn from(e: ExecError) -> Self {
        let (status, code) = match &e {
            ExecError::UnknownContainer(_) => (StatusCode::NOT_FOUND, "UNKNOWN_CONTAINER"),
            ExecError::AlreadyStarted(_) => (StatusCode::CONFLICT, "ALREADY_STARTED"),
            ExecError::StartFailed { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "START_FAILED"),
            ExecError::Io(io) if io.kind() == std::io::ErrorKind::PermissionDenied => {
                (StatusCode::FORBIDDEN, "FORBIDDEN")
            }
            ExecError::Io(_) => (StatusCode::INTERNAL_SERVER_ERROR, "IO_ERROR"),
            ExecError::Unreachable { .. } => (StatusCode::BAD_GATEWAY, "NODE_UNREACHABLE"),
            ExecError::Refused(_) => (StatusCode::BAD_GATEWAY, "NODE_REFUSED"),
        };
        ApiError::new(status, code, e.to_string())
    }
}

/// A JSON body whose failures are [`ApiError`]s: 413 over the size limit, 400 for
/// anything that is not the expected JSON (the Content-Type is not required).
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rej| {
            let status = rej.status();
            let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
                "PAYLOAD_TOO_LARGE"
            } else {
                "BAD_REQUEST"
            };
            let mut message = rej.body_text();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                message.push_str(&format!(" (limit {MAX_BODY_BYTES} bytes)"));
            }
            ApiError::new(status, code, message)
        })?;
        serde_json::from_slice(&bytes).map(ApiJson).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "INVALID_JSON",
                format!("invalid request body: {e}"),
            )
        })
    }
}

/// The presented bearer token, if any.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Admin calls: `Authorization: Bearer <admin token>`, compared in constant time.
fn authorize_admin(rm: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    match bearer(headers) {
        Some(t) if super::apps::constant_time_eq(rm.admin_token.as_bytes(), t.as_bytes()) => Ok(()),
        _ => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "UNAUTHORIZED",
            "missing or invalid `Authorization: Bearer <admin token>` (see the RM's admin.token file or GPUAM_ADMIN_TOKEN)",
        )),
    }
}

fn authorize(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    match bearer(headers) {
        Some(t) if app.token_matches(t) => Ok(()),
        _ => Err(ApiError::unauthorized()),
    }
}

fn app_mut<'a>(apps: &'a mut Apps, id: &str) -> Result<&'a mut App, ApiError> {
    apps.get_mut(id)
        .ok_or_else(|| ApiError::not_found(format!("unknown application `{id}`")))
}

// ---------------------------------------------------------------------------
// Routes

type Rm = State<Arc<Shared>>;

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/ws/v1/cluster", get(cluster_info))
        .route("/ws/v1/cluster/info", get(cluster_info))
        .route("/ws/v1/cluster/metrics", get(cluster_metrics))
        .route("/ws/v1/cluster/nodes", get(list_nodes))
        .route("/ws/v1/cluster/nodes/{nodeid}", get(get_node))
        .route(
            "/ws/v1/cluster/nodes/{nodeid}/state",
            axum::routing::put(put_node_state),
        )
        .route("/ws/v1/cluster/apps", get(list_apps).post(submit_app))
        .route("/ws/v1/cluster/apps/new-application", post(new_application))
        .route("/ws/v1/cluster/apps/{id}", get(get_app))
        .route("/ws/v1/cluster/apps/{id}/state", get(get_app_state).put(put_app_state))
        .route("/ws/v1/cluster/apps/{id}/appattempts", get(get_app_attempts))
        .route("/ws/v1/am/{id}/register", post(am_register))
        .route("/ws/v1/am/{id}/allocate", post(am_allocate))
        .route("/ws/v1/am/{id}/finish", post(am_finish))
        .route("/ws/v1/node-agents/register", post(agent_register))
        .route("/ws/v1/node-agents/{host}/heartbeat", post(agent_heartbeat))
        .route("/ws/v1/node/{host}/containers/{id}/start", post(container_start))
        .route("/ws/v1/node/{host}/containers/{id}/stop", post(container_stop))
        .route("/ws/v1/node/{host}/containers/{id}/status", get(container_status))
        .route("/ws/v1/node/{host}/containers/{id}/logs", get(container_logs))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(shared)
}

async fn cluster_info(State(rm): Rm) -> Json<Value> {
    let (store, store_errors) = {
        let st = rm.lock();
        (st.store.kind(), st.store_errors)
    };
    Json(json!({ "clusterInfo": {
        "id": rm.cluster_ts,
        "startedOn": rm.cluster_ts,
        "state": "STARTED",
        "haState": "ACTIVE",
        "rmStateStoreName": store,
        // Writes to the state store that failed (a restart now would lose their changes).
        "rmStateStoreWriteErrors": store_errors,
        "resourceManagerVersion": concat!("gpuam-", env!("CARGO_PKG_VERSION")),
        "hadoopVersion": "3.4.1 (gpuam compatible)",
    }}))
}

async fn cluster_metrics(State(rm): Rm) -> Json<Value> {
    let st = rm.lock();
    let count = |f: &dyn Fn(&App) -> bool| st.apps.values().filter(|a| f(a)).count();
    let (mut total_mb, mut used_mb, mut total_vc, mut used_vc, mut total_gpu, mut used_gpu) =
        (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    let mut by_state: HashMap<NodeState, u32> = HashMap::new();
    let mut containers = 0u32;
    for (n, c) in st.ledger.nodes() {
        *by_state.entry(n.state).or_default() += 1;
        containers += c;
        if n.state.is_unusable() {
            continue;
        }
        total_mb += n.total().memory_mb;
        used_mb += n.used().memory_mb;
        total_vc += u64::from(n.total().cpu);
        used_vc += u64::from(n.used().cpu);
        total_gpu += u64::from(n.total().gpu_count());
        used_gpu += u64::from(n.used().gpu_count());
    }
    let nodes = |s: NodeState| by_state.get(&s).copied().unwrap_or(0);
    Json(json!({ "clusterMetrics": {
        "appsSubmitted": st.apps.len(),
        "appsCompleted": count(&|a| a.report.state.is_final()),
        "appsPending": count(&|a| matches!(a.report.state, AppState::New | AppState::Submitted | AppState::Accepted)),
        "appsRunning": count(&|a| a.report.state == AppState::Running),
        "appsFailed": count(&|a| a.report.state == AppState::Failed),
        "appsKilled": count(&|a| a.report.state == AppState::Killed),
        "reservedMB": 0,
        "availableMB": total_mb.saturating_sub(used_mb),
        "allocatedMB": used_mb,
        "totalMB": total_mb,
        "reservedVirtualCores": 0,
        "availableVirtualCores": total_vc.saturating_sub(used_vc),
        "allocatedVirtualCores": used_vc,
        "totalVirtualCores": total_vc,
        "containersAllocated": containers,
        "containersReserved": 0,
        "containersPending": 0,
        "totalNodes": st.ledger.nodes().count(),
        "activeNodes": nodes(NodeState::Running),
        "lostNodes": nodes(NodeState::Lost),
        "unhealthyNodes": nodes(NodeState::Unhealthy),
        "decommissioningNodes": nodes(NodeState::Decommissioning),
        "decommissionedNodes": nodes(NodeState::Decommissioned),
        "rebootedNodes": nodes(NodeState::Rebooted),
        "shutdownNodes": nodes(NodeState::Shutdown),
        "totalGpus": total_gpu,
        "allocatedGpus": used_gpu,
        "availableGpus": total_gpu.saturating_sub(used_gpu),
    }}))
}

#[derive(Deserialize)]
struct NodesQuery {
    states: Option<String>,
}

async fn list_nodes(State(rm): Rm, Query(q): Query<NodesQuery>) -> Result<Json<Value>, ApiError> {
    let wanted: Option<Vec<NodeState>> = match q.states.as_deref().map(str::trim).filter(|s| !s.is_empty()) {
        None => None,
        Some(s) => Some(
            s.split(',')
                .map(|x| {
                    serde_json::from_value(Value::String(x.trim().to_ascii_uppercase()))
                        .map_err(|_| ApiError::bad_request(format!("`states`: unknown node state `{x}`")))
                })
                .collect::<Result<_, _>>()?,
        ),
    };
    let st = rm.lock();
    let nodes = st
        .ledger
        .nodes()
        .filter(|(n, _)| wanted.as_ref().is_none_or(|w| w.contains(&n.state)));
    Ok(Json(nodes_to_json(nodes, now_ms())))
}

async fn get_node(State(rm): Rm, UrlPath(nodeid): UrlPath<String>) -> Result<Json<Value>, ApiError> {
    let host = nodeid.rsplit_once(':').map_or(nodeid.as_str(), |(h, _)| h);
    let st = rm.lock();
    let node = st
        .ledger
        .node(host)
        .or_else(|| st.ledger.node(&nodeid))
        .ok_or_else(|| ApiError::not_found(format!("unknown node `{nodeid}`")))?;
    Ok(Json(
        json!({ "node": node_to_json(node, st.ledger.num_containers(&node.host), now_ms()) }),
    ))
}

/// `PUT /ws/v1/cluster/nodes/{host}/state` body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeStateUpdate {
    state: NodeState,
}

/// Admin: changes a node's state. LOST / UNHEALTHY / DECOMMISSIONED end its
/// containers (exit -100, "Container released on a *lost* node") and take its
/// resources out of the schedulable view; RUNNING brings it back. Simulated nodes
/// live in this process and cannot stop answering by themselves, so this call is
/// also how "a node that stops answering" is modelled.
async fn put_node_state(
    State(rm): Rm,
    UrlPath(nodeid): UrlPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<NodeStateUpdate>,
) -> Result<Json<Value>, ApiError> {
    authorize_admin(&rm, &headers)?;
    if !matches!(
        req.state,
        NodeState::Running | NodeState::Lost | NodeState::Unhealthy | NodeState::Decommissioned
    ) {
        return Err(ApiError::bad_request(format!(
            "`state` {:?} cannot be set: use RUNNING, LOST, UNHEALTHY or DECOMMISSIONED",
            req.state
        )));
    }
    let host = {
        let st = rm.lock();
        let host = nodeid.rsplit_once(':').map_or(nodeid.as_str(), |(h, _)| h);
        if st.ledger.node(host).is_some() {
            host.to_string()
        } else if st.ledger.node(&nodeid).is_some() {
            nodeid.clone()
        } else {
            return Err(ApiError::not_found(format!("unknown node `{nodeid}`")));
        }
    };
    let ended = change_node_state(&rm, &host, req.state)
        .await
        .ok_or_else(|| ApiError::not_found(format!("unknown node `{nodeid}`")))?;
    let st = rm.lock();
    let node = st
        .ledger
        .node(&host)
        .ok_or_else(|| ApiError::not_found(format!("unknown node `{nodeid}`")))?;
    Ok(Json(json!({
        "node": node_to_json(node, st.ledger.num_containers(&host), now_ms()),
        "containersEnded": ended,
    })))
}

async fn new_application(State(rm): Rm) -> Json<NewApplication> {
    let mut st = rm.lock();
    let id = st.next_app_id(rm.cluster_ts);
    st.reserve(id.clone());
    Json(NewApplication {
        application_id: id,
        maximum_resource_capability: st.ledger.max_capability(),
    })
}

async fn list_apps(State(rm): Rm) -> Json<Value> {
    let st = rm.lock();
    let apps: Vec<_> = st.apps.values().map(|a| a.report.clone()).collect();
    Json(json!({ "apps": { "app": apps } }))
}

/// Reads one application (no change, nothing to persist).
fn with_app<T>(rm: &Shared, id: &str, f: impl FnOnce(&App) -> T) -> Result<T, ApiError> {
    let st = rm.lock();
    let app = st
        .apps
        .get(id)
        .ok_or_else(|| ApiError::not_found(format!("unknown application `{id}`")))?;
    Ok(f(app))
}

async fn get_app(State(rm): Rm, UrlPath(id): UrlPath<String>) -> Result<Json<Value>, ApiError> {
    with_app(&rm, &id, |a| Json(json!({ "app": a.report })))
}

async fn get_app_state(State(rm): Rm, UrlPath(id): UrlPath<String>) -> Result<Json<Value>, ApiError> {
    with_app(&rm, &id, |a| Json(json!({ "state": a.report.state })))
}

/// YARN's `appattempts`: every AM attempt with its start, end and how it ended.
async fn get_app_attempts(State(rm): Rm, UrlPath(id): UrlPath<String>) -> Result<Json<Value>, ApiError> {
    with_app(&rm, &id, |a| {
        let attempts: Vec<Value> = a
            .attempts
            .iter()
            .map(|t| {
                json!({
                    "id": t.attempt,
                    "startTime": t.started_time,
                    "finishedTime": t.finished_time,
                    "diagnostics": t.diagnostics,
                    "pid": t.process.map(|p| p.pid),
                })
            })
            .collect();
        Json(json!({ "appAttempts": { "appAttempt": attempts } }))
    })
}

async fn submit_app(State(rm): Rm, ApiJson(req): ApiJson<SubmitApplication>) -> Result<Response, ApiError> {
    let id = req.application_id.clone();
    // Validate before claiming anything, so a rejected submit leaves nothing behind.
    {
        let st = rm.lock();
        if st.apps.contains_key(&id) {
            return Err(ApiError::conflict(format!("application `{id}` was already submitted")));
        }
        if !st.is_reserved(&id) {
            return Err(ApiError::bad_request(format!(
                "unknown application id `{id}`: get one from POST /ws/v1/cluster/apps/new-application"
            )));
        }
    }
    let source = req.job_spec_name.clone().unwrap_or_else(|| "job.yaml".into());
    let spec = crate::spec::parse_job_spec(&req.job_spec, &source)
        .map_err(|errs| ApiError::new(StatusCode::BAD_REQUEST, "INVALID_JOB_SPEC", errs.to_string()))?;

    // Claim the id (a concurrent submit of the same id loses here).
    if !rm.lock().unreserve(&id) {
        return Err(ApiError::conflict(format!("application `{id}` was already submitted")));
    }
    let unclaim = |rm: &Shared, dir: &Path| {
        let _ = std::fs::remove_dir_all(dir);
        rm.lock().reserve(id.clone());
    };
    let dir = rm.work_dir.join(&id);
    let job_path = dir.join("job.yaml");
    // 0600: an OpenPAI job spec may carry `secrets`.
    let written = std::fs::create_dir_all(&dir).and_then(|_| {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&job_path)
            .and_then(|mut f| f.write_all(req.job_spec.as_bytes()))
    });
    if let Err(e) = written {
        unclaim(&rm, &dir);
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "IO_ERROR",
            format!("cannot write {}: {e}", job_path.display()),
        ));
    }
    let mut app = App::new(id.clone(), spec.name.clone());
    app.set_job_token(req.job_token.as_deref());
    if rm.launch_am {
        app.launch = Some(AmLaunch {
            job_path,
            listen: req.dashboard_listen.clone(),
        });
    }
    let report = app.report.clone();
    rm.lock().apps.insert(app);

    if rm.launch_am {
        if let Err(e) = launch_am(&rm, &id) {
            rm.lock().apps.remove(&id);
            unclaim(&rm, &dir);
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "AM_LAUNCH_FAILED",
                format!("could not launch the AM: {e}"),
            ));
        }
    }
    tracing::info!(app = %id, name = %spec.name, "application accepted");
    let location = format!("/ws/v1/cluster/apps/{id}");
    Ok((
        StatusCode::ACCEPTED,
        [(header::LOCATION, location)],
        Json(json!({ "app": report })),
    )
        .into_response())
}

/// Starts `<am_program> am <job.yaml> --rm URL --app-id ID [--listen ADDR]` for the
/// application's current attempt, with its output in the app's directory, and watches
/// it. The app token and the job token go in the environment (`GPUAM_APP_TOKEN`,
/// `GPUAM_JOB_TOKEN`), not on the command line where other local users could read
/// them; the RM's settings file goes along as `GPUAM_CONFIG` so the AM runs with the
/// same settings. The attempt is recorded with the process's identity, so a restarted
/// RM can find it again.
fn launch_am(rm: &Arc<Shared>, id: &str) -> std::io::Result<()> {
    let (token, job_token, launch) = {
        let mut st = rm.lock();
        let app = st
            .apps
            .get_mut(id)
            .ok_or_else(|| std::io::Error::other(format!("unknown application `{id}`")))?;
        let launch = app
            .launch
            .clone()
            .ok_or_else(|| std::io::Error::other(format!("application `{id}` has no AM to launch")))?;
        app.attempt_started(None);
        (app.token().to_string(), app.job_token().map(str::to_string), launch)
    };
    let dir = rm.work_dir.join(id);
    // Appended: a later attempt's output follows the earlier one's, which tells why it died.
    let append = |name: &str| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(name))
    };
    let stdout = append("am.stdout")?;
    let stderr = append("am.stderr")?;
    let program = match &rm.am_program {
        Some(p) => p.clone(),
        None => std::env::current_exe()?,
    };
    let mut cmd = tokio::process::Command::new(program);
    cmd.arg("am")
        .arg(&launch.job_path)
        .arg("--rm")
        .arg(&rm.base_url)
        .arg("--app-id")
        .arg(id)
        .env("GPUAM_APP_TOKEN", &token)
        // The AM has no use for the RM's admin token.
        .env_remove("GPUAM_ADMIN_TOKEN");
    if let Some(t) = &job_token {
        cmd.env("GPUAM_JOB_TOKEN", t);
    }
    if std::env::var_os("GPUAM_CONFIG").is_none() {
        if let Some(p) = crate::config::default_settings_path().and_then(|p| std::fs::canonicalize(p).ok()) {
            cmd.env("GPUAM_CONFIG", p);
        }
    }
    if let Some(l) = &launch.listen {
        cmd.arg("--listen").arg(l);
    }
    // `kill_on_drop` only matters for an orderly stop; an RM that dies leaves its AMs
    // running, and the next RM re-attaches to them.
    cmd.stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .current_dir(&dir)
        .kill_on_drop(true);
    let pid = {
        // Hold the table while spawning so the watcher cannot finish before it is listed.
        let mut procs = rm.am_procs.lock();
        let mut child = cmd.spawn()?;
        let pid = child.id();
        let (kill_tx, kill_rx) = oneshot::channel::<()>();
        let watcher_rm = rm.clone();
        let app = id.to_string();
        let task = tokio::spawn(async move {
            let status = tokio::select! {
                s = child.wait() => s,
                _ = kill_rx => {
                    let _ = child.start_kill();
                    child.wait().await
                }
            };
            let how = match &status {
                Ok(s) => match s.code() {
                    Some(c) => format!("exit code {c}"),
                    None => format!("{s}"),
                },
                Err(e) => format!("unknown exit ({e})"),
            };
            on_am_exit(&watcher_rm, &app, how).await;
        });
        procs.insert(
            id.to_string(),
            AmProc {
                kill: Some(kill_tx),
                task,
            },
        );
        pid
    };
    if let Some(p) = pid.and_then(ProcessId::of) {
        let mut st = rm.lock();
        if let Some(a) = st.apps.get_mut(id).and_then(|a| a.attempts.last_mut()) {
            if a.finished_time == 0 && a.process.is_none() {
                a.process = Some(p);
            }
        }
    }
    tracing::info!(app = %id, "AM launched");
    Ok(())
}

/// Watches an AM process that an earlier RM started (RM restart): it is not our child,
/// so its end is polled for and its exit status is unknown.
fn watch_inherited_am(rm: &Arc<Shared>, id: &str, process: ProcessId) {
    let (kill_tx, kill_rx) = oneshot::channel::<()>();
    let watcher_rm = rm.clone();
    let app = id.to_string();
    let mut procs = rm.am_procs.lock();
    let task = tokio::spawn(async move {
        tokio::select! {
            _ = process.ended() => {}
            _ = kill_rx => {
                process.signal(libc::SIGKILL);
                let _ = tokio::time::timeout(AM_KILL_GRACE, process.ended()).await;
            }
        }
        on_am_exit(
            &watcher_rm,
            &app,
            "exit status unknown: it was started by an earlier RM".into(),
        )
        .await;
    });
    procs.insert(
        id.to_string(),
        AmProc {
            kill: Some(kill_tx),
            task,
        },
    );
    tracing::info!(app = %id, pid = process.pid, "re-attached to the running AM");
}

/// The AM process ended: if it never finished the application, a new attempt starts
/// (work-preserving: it re-adopts the job's containers) while attempts remain;
/// otherwise the application failed.
async fn on_am_exit(rm: &Arc<Shared>, id: &str, how: String) {
    rm.am_procs.lock().remove(id);
    let tail = stderr_tail(&rm.work_dir.join(id).join("am.stderr"), STDERR_TAIL_LINES);
    let ended = {
        let mut st = rm.lock();
        let Some(app) = st.apps.get_mut(id) else {
            return;
        };
        app.attempt_ended(&how);
        if app.unregistered || app.report.state.is_final() {
            tracing::info!(app = %id, "AM exited ({how})");
            return;
        }
        let stopping = rm.shutting_down.load(std::sync::atomic::Ordering::SeqCst);
        if app.report.attempt < rm.max_am_attempts && !app.shutdown && !stopping && app.launch.is_some() {
            app.report.attempt += 1;
            app.registered = false;
            app.report.state = AppState::Accepted;
            app.last_allocate = None;
            let attempt = app.report.attempt;
            drop(st);
            tracing::warn!(app = %id, attempt, "AM exited without finishing ({how}); starting attempt {attempt}");
            match launch_am(rm, id) {
                Ok(()) => return,
                Err(e) => {
                    tracing::warn!(app = %id, error = %e, "could not start a new AM attempt");
                    st = rm.lock();
                }
            }
        }
        let Some(app) = st.apps.get_mut(id) else {
            return;
        };
        let mut diag = format!("the AM process exited ({how}) without finishing the application");
        if !tail.is_empty() {
            diag.push_str("; last lines of am.stderr:\n");
            diag.push_str(&tail);
        }
        tracing::warn!(app = %id, "AM exited without finishing ({how})");
        app.finish(AppState::Failed, FinalStatus::Failed, crate::exit::JOB_FAILED, diag);
        release_all(
            &mut st,
            id,
            exit_status::KILLED_BY_RESOURCEMANAGER,
            "the application's AM died",
        )
    };
    spawn_stops(rm, ended);
}

/// The last `n` lines of a file (reading at most its last 16 KiB).
fn stderr_tail(path: &Path, n: usize) -> String {
    let read = || -> std::io::Result<String> {
        let mut f = std::fs::File::open(path)?;
        let len = f.metadata()?.len();
        f.seek(SeekFrom::Start(len.saturating_sub(16 * 1024)))?;
        let mut buf = Vec::new();
        f.read_to_end(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    };
    let text = read().unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Completes every live container of `app_id`, queueing them for the app.
fn release_all(st: &mut RmState, app_id: &str, exit: i32, why: &str) -> Vec<Ended> {
    let ids = st.ledger.live_containers_of(app_id);
    let ended: Vec<Ended> = ids.iter().filter_map(|c| st.ledger.stop(c, exit, why)).collect();
    for e in &ended {
        queue_completed(&mut st.apps, e);
    }
    ended
}

/// Kill: needs the admin token or the job token given when the job was submitted
/// (never the AM's application token: that one only speaks the AM protocol).
async fn put_app_state(
    State(rm): Rm,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<AppStateUpdate>,
) -> Result<Json<Value>, ApiError> {
    let ended = {
        let mut st = rm.lock();
        let app = app_mut(&mut st.apps, &id)?;
        let job_token_ok = bearer(&headers).is_some_and(|t| app.job_token_matches(t));
        if !job_token_ok {
            authorize_admin(&rm, &headers).map_err(|_| {
                ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "UNAUTHORIZED",
                    "killing an application needs `Authorization: Bearer <admin token or the job's job token>`",
                )
            })?;
        }
        if req.state != AppState::Killed {
            return Err(ApiError::bad_request("Only 'KILLED' is allowed as the target state"));
        }
        if app.report.state.is_final() {
            return Ok(Json(json!({ "state": app.report.state })));
        }
        app.finish(
            AppState::Killed,
            FinalStatus::Killed,
            crate::exit::JOB_FAILED,
            "Application killed by user".into(),
        );
        app.shutdown = true;
        release_all(
            &mut st,
            &id,
            exit_status::KILLED_BY_RESOURCEMANAGER,
            "the application was killed",
        )
    };
    tracing::info!(app = %id, "application killed");
    spawn_stops(&rm, ended);
    // The AM sees SHUTDOWN on its next heartbeat; kill it if it does not exit.
    let rm2 = rm.clone();
    let app = id.clone();
    tokio::spawn(async move {
        tokio::time::sleep(AM_KILL_GRACE).await;
        let proc = rm2.am_procs.lock().get_mut(&app).and_then(|p| p.kill.take());
        if let Some(kill) = proc {
            tracing::warn!(app = %app, "AM did not exit after kill; killing it");
            let _ = kill.send(());
        }
    });
    Ok(Json(json!({ "state": AppState::Killed })))
}

// ---------------------------------------------------------------------------
// AM protocol

async fn am_register(
    State(rm): Rm,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<RegisterRequest>,
) -> Result<Json<RegisterResponse>, ApiError> {
    let mut st = rm.lock();
    let epoch = st.ledger.epoch();
    let max = st.ledger.max_capability();
    let expiry = st.ledger.expiry().as_secs();
    let app = app_mut(&mut st.apps, &id)?;
    authorize(app, &headers)?;
    if app.report.state.is_final() {
        return Err(ApiError::conflict(format!(
            "application `{id}` is already {:?}",
            app.report.state
        )));
    }
    // Registering again (a retried request, or a resync after an RM restart) is harmless.
    if !app.registered {
        app.registered = true;
        app.report.state = AppState::Running;
        app.nodes_seen = epoch;
    }
    app.report.tracking_url = req.tracking_url;
    let attempt = app.report.attempt;
    // All of the application's containers: a new attempt has none of its own yet, so
    // these are the earlier attempts'; an AM that resyncs gets its own too, including
    // grants whose answer the RM never got to send.
    let previous = st
        .ledger
        .containers_of(&id)
        .into_iter()
        .map(|c| PreviousContainer {
            container: c.container.clone(),
            state: c.state,
            exit_status: c.exit_status,
            diagnostics: c.diagnostics.clone(),
        })
        .collect();
    Ok(Json(RegisterResponse {
        maximum_capability: max,
        containers_from_previous_attempts: previous,
        attempt,
        container_expiry_sec: expiry,
    }))
}

async fn am_allocate(
    State(rm): Rm,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<AllocateRequest>,
) -> Result<Json<AllocateResponse>, ApiError> {
    let (answer, ended) = {
        let mut st = rm.lock();
        let st = &mut *st;
        let app = app_mut(&mut st.apps, &id)?;
        authorize(app, &headers)?;
        if let Some((last_req, last)) = &app.last_allocate {
            if req.response_id == *last_req {
                return Ok(Json(last.clone()));
            }
            if req.response_id != last.response_id {
                return Err(ApiError::bad_request(format!(
                    "responseId {} is out of order: the last answer was {}",
                    req.response_id, last.response_id
                )));
            }
        }
        let num_cluster_nodes = st.ledger.nodes().count() as u32;
        let mut out = AllocateResponse {
            response_id: req.response_id + 1,
            num_cluster_nodes,
            ..Default::default()
        };
        if app.shutdown || app.report.state.is_final() {
            out.command = Some(AmCommand::Shutdown);
            out.completed = std::mem::take(&mut app.pending_completed);
            app.last_allocate = Some((req.response_id, out.clone()));
            return Ok(Json(out));
        }
        if !app.registered {
            // Not registered (never, or not since this RM restarted): YARN's AM_RESYNC.
            // Nothing in this request is acted on; the AM registers and sends it again.
            out.command = Some(AmCommand::Resync);
            return Ok(Json(out));
        }
        app.report.progress = req.progress.clamp(0.0, 1.0);
        let attempt = app.report.attempt;

        // Releases: freed now, not reported back (the AM asked for it).
        let mut ended = Vec::new();
        for cid in &req.releases {
            match st.ledger.container(cid) {
                Some(c) if c.app_id == id => {
                    if let Some(e) = st
                        .ledger
                        .stop(cid, exit_status::ABORTED, "Container released by application")
                    {
                        ended.push(e);
                    }
                }
                _ => {
                    tracing::debug!(app = %id, container = %cid, "release of a container this app does not hold")
                }
            }
        }
        // Cancels need no work: asks never stay pending (see the module doc).
        let now = Instant::now();
        for ask in &req.asks {
            match st.ledger.grant(&id, attempt, ask, now) {
                Ok(c) => out.allocated.push(c),
                Err(r) => out.rejected.push(r),
            }
        }
        let app = app_mut(&mut st.apps, &id)?;
        out.completed = std::mem::take(&mut app.pending_completed);
        out.updated_nodes = st
            .ledger
            .changed_since(app.nodes_seen)
            .map(|(n, c)| node_to_json(n, c, now_ms()))
            .collect();
        app.nodes_seen = st.ledger.epoch();
        app.last_allocate = Some((req.response_id, out.clone()));
        (out, ended)
    };
    spawn_stops(&rm, ended);
    Ok(Json(answer))
}

async fn am_finish(
    State(rm): Rm,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<FinishRequest>,
) -> Result<Json<FinishResponse>, ApiError> {
    let ended = {
        let mut st = rm.lock();
        let app = app_mut(&mut st.apps, &id)?;
        authorize(app, &headers)?;
        if !app.unregistered {
            let state = match req.final_status {
                FinalStatus::Succeeded => AppState::Finished,
                FinalStatus::Failed => AppState::Failed,
                FinalStatus::Killed => AppState::Killed,
                FinalStatus::Undefined => {
                    return Err(ApiError::bad_request(
                        "`finalStatus` must be SUCCEEDED, FAILED or KILLED",
                    ))
                }
            };
            app.finish(state, req.final_status, req.exit_code, req.diagnostics);
            app.unregistered = true;
            tracing::info!(app = %id, ?state, "application finished");
        }
        release_all(
            &mut st,
            &id,
            exit_status::KILLED_AFTER_APP_COMPLETION,
            "Container killed after the application finished",
        )
    };
    spawn_stops(&rm, ended);
    Ok(Json(FinishResponse { is_unregistered: true }))
}

// ---------------------------------------------------------------------------
// Executor endpoints (the simulated nodes' NodeManager)

/// Checks that `id` is a container on `host` and that the caller holds its app's token.
fn container_access(st: &RmState, host: &str, id: &str, headers: &HeaderMap) -> Result<ContainerInfo, ApiError> {
    let c = st
        .ledger
        .container(id)
        .filter(|c| c.container.host == host)
        .ok_or_else(|| ApiError::not_found(format!("no container `{id}` on host `{host}`")))?;
    let app = st
        .apps
        .get(&c.app_id)
        .ok_or_else(|| ApiError::not_found(format!("container `{id}` belongs to no known application")))?;
    authorize(app, headers)?;
    Ok(ContainerInfo {
        state: c.state,
        app_final: app.report.state.is_final(),
        status: ContainerStatus {
            container_id: id.to_string(),
            state: c.state,
            exit_status: c.exit_status,
            diagnostics: c.diagnostics.clone(),
            pid: None,
        },
        resources: c.container.resources.clone(),
    })
}

struct ContainerInfo {
    state: ContainerState,
    app_final: bool,
    status: ContainerStatus,
    resources: crate::resources::Resources,
}

async fn container_start(
    State(rm): Rm,
    UrlPath((host, id)): UrlPath<(String, String)>,
    headers: HeaderMap,
    ApiJson(ctx): ApiJson<LaunchContext>,
) -> Result<Json<ContainerStatus>, ApiError> {
    let (granted, app_id, topology) = {
        let mut st = rm.lock();
        let info = container_access(&st, &host, &id, &headers)?;
        if info.app_final {
            return Err(ApiError::conflict("the container's application has ended"));
        }
        if info.state != ContainerState::Allocated {
            return Err(ApiError::conflict(format!(
                "container `{id}` is {:?}; only ALLOCATED containers can be started",
                info.state
            )));
        }
        // Running before the process exists, so its exit event always finds it live.
        st.ledger
            .mark_running(&id)
            .map_err(|e| ApiError::conflict(e.to_string()))?;
        let app_id = st.ledger.container(&id).map(|c| c.app_id.clone()).unwrap_or_default();
        let topology = st.ledger.node(&host).and_then(|n| n.topology.clone());
        (info.resources, app_id, topology)
    };
    let grant = crate::node::Grant {
        container_id: id.clone(),
        app_id,
        host: host.clone(),
        resources: granted,
        topology,
    };
    match rm.nodes.for_host(&host).start(grant, ctx).await {
        Ok(status) => Ok(Json(status)),
        Err(e) => {
            let mut st = rm.lock();
            if let Some(ended) = st
                .ledger
                .complete(&id, exit_status::INVALID, &format!("launch failed: {e}"))
            {
                queue_completed(&mut st.apps, &ended);
            }
            Err(e.into())
        }
    }
}

async fn container_stop(
    State(rm): Rm,
    UrlPath((host, id)): UrlPath<(String, String)>,
    headers: HeaderMap,
) -> Result<Json<ContainerStatus>, ApiError> {
    let (ended, status) = {
        let mut st = rm.lock();
        let info = container_access(&st, &host, &id, &headers)?;
        let ended = st.ledger.stop(
            &id,
            exit_status::KILLED_BY_APPMASTER,
            "Container stopped by the application master",
        );
        if let Some(e) = &ended {
            queue_completed(&mut st.apps, e);
        }
        let status = st.ledger.container(&id).map_or(info.status, |c| ContainerStatus {
            container_id: id.clone(),
            state: c.state,
            exit_status: c.exit_status,
            diagnostics: c.diagnostics.clone(),
            pid: None,
        });
        (ended, status)
    };
    if let Some(e) = ended {
        stop_running(&rm, &[e]).await;
    }
    Ok(Json(status))
}

async fn container_status(
    State(rm): Rm,
    UrlPath((host, id)): UrlPath<(String, String)>,
    headers: HeaderMap,
) -> Result<Json<ContainerStatus>, ApiError> {
    let info = container_access(&rm.lock(), &host, &id, &headers)?;
    // The executor knows the pid and the real exit; the ledger knows RM-side endings.
    let status = match rm.nodes.for_host(&host).status(&host, &id).await {
        Some(s) if info.state != ContainerState::Complete || s.state == ContainerState::Complete => s,
        _ => info.status,
    };
    Ok(Json(status))
}

#[derive(Deserialize)]
struct LogsQuery {
    stream: Option<String>,
    tail: Option<u64>,
}

async fn container_logs(
    State(rm): Rm,
    UrlPath((host, id)): UrlPath<(String, String)>,
    Query(q): Query<LogsQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    container_access(&rm.lock(), &host, &id, &headers)?;
    let stream = match q.stream.as_deref().unwrap_or("stdout") {
        "stdout" => LogStream::Stdout,
        "stderr" => LogStream::Stderr,
        other => {
            return Err(ApiError::bad_request(format!(
                "`stream` must be stdout or stderr, not `{other}`"
            )))
        }
    };
    let text = rm.nodes.for_host(&host).read_log(&host, &id, stream, q.tail).await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{PortSet, Resources};

    async fn rm_with(am_program: Option<PathBuf>, dir: &Path) -> RmHandle {
        let node = Node::new("n1", "/r", Resources::with_mask(4, 1000, 0x3, PortSet::new()));
        let mut opts = RmOptions::new(vec![node], "127.0.0.1:0".parse().unwrap(), dir.to_path_buf());
        opts.am_program = am_program;
        start(opts).await.unwrap()
    }

    #[tokio::test]
    async fn am_dying_without_finish_fails_the_app() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("fake-am.sh");
        std::fs::write(
            &script,
            "#!/bin/sh\necho \"starting $1\"\necho 'boom: no GPUs today' >&2\nexit 3\n",
        )
        .unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let rm = rm_with(Some(script), &dir.path().join("work")).await;
        let (id, _token) = rm.register_test_app("fake");
        let app_dir = rm.shared.work_dir.join(&id);
        std::fs::create_dir_all(&app_dir).unwrap();
        set_launch(&rm, &id, &app_dir, None);
        launch_am(&rm.shared, &id).unwrap();
        let mut report = rm.app_report(&id).unwrap();
        for _ in 0..100 {
            if report.state.is_final() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            report = rm.app_report(&id).unwrap();
        }
        assert_eq!(report.state, AppState::Failed);
        assert_eq!(report.exit_code, Some(1));
        assert!(report.diagnostics.contains("exit code 3"), "{}", report.diagnostics);
        assert!(
            report.diagnostics.contains("boom: no GPUs today"),
            "{}",
            report.diagnostics
        );
        let out = std::fs::read_to_string(app_dir.join("am.stdout")).unwrap();
        assert!(out.contains("starting am"), "the AM got the `am` subcommand: {out}");
        assert!(rm.shared.am_procs.lock().is_empty());
        rm.shutdown().await;
    }

    fn set_launch(rm: &RmHandle, id: &str, app_dir: &Path, listen: Option<&str>) {
        rm.shared.lock().apps.get_mut(id).unwrap().launch = Some(AmLaunch {
            job_path: app_dir.join("job.yaml"),
            listen: listen.map(str::to_string),
        });
    }

    fn script(dir: &Path, body: &str) -> PathBuf {
        let p = dir.join("fake-am.sh");
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        p
    }

    #[tokio::test]
    async fn am_exit_after_finish_is_expected() {
        let dir = tempfile::tempdir().unwrap();
        let rm = rm_with(Some(script(dir.path(), "exit 0")), &dir.path().join("work")).await;
        let (id, _token) = rm.register_test_app("x");
        let app_dir = rm.shared.work_dir.join(&id);
        std::fs::create_dir_all(&app_dir).unwrap();
        rm.shared.lock().apps.get_mut(&id).unwrap().unregistered = true;
        set_launch(&rm, &id, &app_dir, Some("127.0.0.1:0"));
        launch_am(&rm.shared, &id).unwrap();
        for _ in 0..100 {
            if rm.shared.am_procs.lock().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(rm.shared.am_procs.lock().is_empty(), "the watcher saw the exit");
        assert_eq!(rm.app_report(&id).unwrap().state, AppState::Accepted, "not failed");
        rm.shutdown().await;
    }

    #[tokio::test]
    async fn shutdown_kills_the_am() {
        let dir = tempfile::tempdir().unwrap();
        let rm = rm_with(Some(script(dir.path(), "exec sleep 30")), &dir.path().join("work")).await;
        let (id, _token) = rm.register_test_app("x");
        let app_dir = rm.shared.work_dir.join(&id);
        std::fs::create_dir_all(&app_dir).unwrap();
        set_launch(&rm, &id, &app_dir, None);
        launch_am(&rm.shared, &id).unwrap();
        assert_eq!(rm.shared.am_procs.lock().len(), 1);
        let shared = rm.shared.clone();
        let t0 = Instant::now();
        rm.shutdown().await;
        assert!(t0.elapsed() < Duration::from_secs(4), "killed, not waited for");
        assert!(shared.am_procs.lock().is_empty());
        assert_eq!(
            shared.lock().apps.get(&id).unwrap().report.state,
            AppState::Failed,
            "an AM killed before finishing fails its app"
        );
    }

    #[test]
    fn bearer_parsing() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), None);
        h.insert(header::AUTHORIZATION, "Bearer abc".parse().unwrap());
        assert_eq!(bearer(&h), Some("abc"));
        h.insert(header::AUTHORIZATION, "bearer  abc ".parse().unwrap());
        assert_eq!(bearer(&h), Some("abc"));
        h.insert(header::AUTHORIZATION, "Basic abc".parse().unwrap());
        assert_eq!(bearer(&h), None);
    }

    /// Stops an RM the way SIGKILL would, as far as the state goes: no container or AM
    /// is stopped, nothing more is written.
    fn crash(rm: RmHandle) {
        rm.server.abort();
        for b in &rm.background {
            b.abort();
        }
    }

    fn ask(request_id: u64, host: &str, mask: u64) -> crate::protocol::Ask {
        crate::protocol::Ask {
            request_id,
            host: host.into(),
            cpu: 1,
            memory_mb: 10,
            gpu_mask: mask,
            task: Some(format!("w/{request_id}")),
            task_attempt: 1,
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_restarted_rm_recovers_apps_grants_and_node_states() {
        use crate::am::rm_client::RmClient;
        use crate::protocol::{Ask, RegisterRequest};
        let dir = tempfile::tempdir().unwrap();
        let nodes: Vec<Node> = ["n1", "n2"]
            .iter()
            .map(|h| Node::new(*h, "/r", Resources::with_mask(4, 1000, 0x3, PortSet::new())))
            .collect();
        let opts = RmOptions {
            launch_am: false,
            ..RmOptions::new(nodes, "127.0.0.1:0".parse().unwrap(), dir.path().join("work"))
        };
        let rm = start(opts.clone()).await.unwrap();
        let (id, token) = rm.register_test_app("job");
        let am = RmClient::for_app(&rm.base_url(), &id, &token);
        am.register(&RegisterRequest::default()).await.unwrap();
        let asks: Vec<Ask> = vec![ask(1, "n1", 0x1), ask(2, "n1", 0x2)];
        let granted = am
            .allocate(&AllocateRequest {
                asks,
                ..Default::default()
            })
            .await
            .unwrap()
            .allocated;
        assert_eq!(granted.len(), 2);
        let running = &granted[0];
        let status = am
            .start_container(
                &running.node_http_address,
                "n1",
                &running.container_id,
                &LaunchContext {
                    commands: vec!["sleep 30".into()],
                    env: Default::default(),
                },
            )
            .await
            .unwrap();
        let pgid = status.pid.unwrap() as i32;
        assert!(rm.set_node_state("n2", NodeState::Lost).await);
        let reserved = RmClient::new(&rm.base_url())
            .new_application()
            .await
            .unwrap()
            .application_id;
        let addr = rm.addr();
        crash(rm);

        // The task's process group outlives the RM.
        assert_eq!(unsafe { libc::kill(-pgid, 0) }, 0, "the container still runs");
        let mut rm2 = None;
        for _ in 0..50 {
            match start(RmOptions {
                listen: addr,
                ..opts.clone()
            })
            .await
            {
                Ok(r) => {
                    rm2 = Some(r);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        let rm2 = rm2.expect("the RM restarts on its port");
        let report = rm2.app_report(&id).expect("the application is recovered");
        assert_eq!(report.state, AppState::Running);
        // The old heartbeat memory is gone: the AM is told to register again.
        let again = am
            .allocate(&AllocateRequest {
                response_id: 1,
                asks: vec![ask(3, "n1", 0x1)],
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(again.command, Some(AmCommand::Resync));
        assert!(
            again.allocated.is_empty() && again.rejected.is_empty(),
            "nothing acted on"
        );
        let reg = am.register(&RegisterRequest::default()).await.unwrap();
        let mut held: Vec<(String, ContainerState)> = reg
            .containers_from_previous_attempts
            .iter()
            .map(|p| (p.container.container_id.clone(), p.state))
            .collect();
        held.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            held,
            vec![
                (granted[0].container_id.clone(), ContainerState::Running),
                (granted[1].container_id.clone(), ContainerState::Allocated)
            ]
        );
        // The grants still hold their GPUs; the lost node stays lost.
        let snap = rm2.nodes_snapshot();
        let n1 = snap.iter().find(|(n, _)| n.host == "n1").unwrap();
        assert_eq!((n1.0.used().gpu_mask, n1.1), (0x3, 2));
        let n2 = snap.iter().find(|(n, _)| n.host == "n2").unwrap();
        assert_eq!(n2.0.state, NodeState::Lost);
        let after = am
            .allocate(&AllocateRequest {
                response_id: 0,
                asks: vec![ask(4, "n1", 0x1)],
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(after.rejected.len(), 1, "GPU 0 of n1 is still granted: {after:?}");
        // Ids go on from where they were; the reserved one can still be submitted.
        assert!(rm2.shared.lock().is_reserved(&reserved));
        let next = RmClient::new(&rm2.base_url())
            .new_application()
            .await
            .unwrap()
            .application_id;
        assert!(next > reserved, "{next} after {reserved}");
        // The re-attached container can be stopped like any other.
        let released = am
            .allocate(&AllocateRequest {
                response_id: after.response_id,
                releases: vec![granted[0].container_id.clone(), granted[1].container_id.clone()],
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(released.rejected.is_empty());
        let mut gone = false;
        for _ in 0..100 {
            if unsafe { libc::kill(-pgid, 0) } != 0 {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(gone, "the released container's group was stopped");
        // Freed only when dead: the node's report of its death frees it.
        let mut free = false;
        for _ in 0..100 {
            if rm2.ledger_all_free() {
                free = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(free, "the released container's resources return once it is dead");
        rm2.shutdown().await;
    }

    #[tokio::test]
    async fn an_in_memory_rm_keeps_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let node = Node::new("n1", "/r", Resources::with_mask(4, 1000, 0x3, PortSet::new()));
        let opts = RmOptions {
            launch_am: false,
            state_dir: None,
            ..RmOptions::new(vec![node], "127.0.0.1:0".parse().unwrap(), dir.path().join("work"))
        };
        let rm = start(opts.clone()).await.unwrap();
        rm.register_test_app("job");
        rm.shutdown().await;
        assert!(!dir.path().join("work").join(crate::rm::store::STATE_FILE).exists());
        let rm = start(opts).await.unwrap();
        assert!(rm.shared.lock().apps.is_empty());
        rm.shutdown().await;
    }

    #[test]
    fn reserved_ids_are_forgotten_oldest_first() {
        let mut st = RmState {
            ledger: Ledger::new(Vec::<Node>::new(), DEFAULT_CONTAINER_EXPIRY),
            apps: Apps::default(),
            reserved: BTreeMap::new(),
            // Across 9999 → 10000, where the ids' text order is not their age.
            next_app_seq: 9_990,
            meta_dirty: false,
            store: Store::memory(),
            store_errors: 0,
        };
        let ids: Vec<String> = (0..MAX_RESERVED_IDS + 20)
            .map(|_| {
                let id = st.next_app_id(1);
                st.reserve(id.clone());
                id
            })
            .collect();
        assert_eq!(st.reserved.len(), MAX_RESERVED_IDS);
        assert!(!st.is_reserved(&ids[19]), "the 20 oldest went");
        assert!(st.is_reserved(&ids[20]) && st.is_reserved(&ids[ids.len() - 1]));
        assert!(st.unreserve(&ids[20]));
        assert!(!st.unreserve(&ids[20]), "claimed once");
        assert!(!st.unreserve("application_1_99999999"));
    }

    #[test]
    fn stderr_tail_keeps_last_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("e");
        let text: String = (0..50).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&p, text).unwrap();
        let t = stderr_tail(&p, 3);
        assert_eq!(t, "line 47\nline 48\nline 49");
        assert_eq!(stderr_tail(&dir.path().join("missing"), 3), "");
    }
}
