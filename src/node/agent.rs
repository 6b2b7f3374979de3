//! The node agent (`gpuam node`): one per machine, YARN's NodeManager.
//!
//! It registers with the RM (bearer: this host's own agent token, which the RM's nodes
//! file binds to the host name), heartbeats its
//! containers' states, and serves the container endpoints (see [`super::wire`]) at its
//! `nodeHTTPAddress`. It runs each container with the [`Executor`]: in a cgroup of its own
//! ([`super::cgroup`]), as its submitter's own unprivileged uid when the agent runs as
//! root ([`super::identity`]: `--user-map`, else a uid of the user's own).
//!
//! Only granted containers start: every call to the container endpoints must be the RM's,
//! signed for exactly that request, this run of the agent, now, and taken once
//! ([`super::token::verify_call`]; a bearer token is refused), and `start` also needs the
//! RM's container token for exactly the grant in the request ([`super::token`]).
//!
//! A container's end is reported (heartbeat, at once) only once it is dead, and again on
//! every heartbeat until the RM acknowledges it (its record, which the task cannot write,
//! then says so: [`super::executor::ACKED_FILE`]). The agent stopping (SIGTERM) leaves its
//! containers running; a restarted agent re-attaches to every container whose record is
//! not acknowledged, and re-registers, listing them.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use parking_lot::Mutex;
use serde::Deserialize;
use tokio::sync::{mpsc, Notify};

use super::cgroup::Containment;
use super::executor::{valid_container_id, Executor, ExecutorOptions, LogStream};
use super::start_gate::{Refused, StartGate, UnknownStop};
use super::wire::{AgentHeartbeat, AgentRegister, AgentReply, AgentStart, ContainerReport, CONTAINER_TOKEN_HEADER};
use super::{token, NodeError, NodeEvent};
use crate::protocol::{ContainerState, ContainerStatus, ErrorBody};
use crate::resources::Resources;

/// Heartbeat interval when the RM does not say.
const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);
/// SIGTERM → kill grace for containers the RM's heartbeat answer says to stop.
const STOP_GRACE: Duration = Duration::from_secs(3);

/// How to run an agent (the `gpuam node` flags).
#[derive(Clone, Debug)]
pub struct AgentOptions {
    pub rm_url: String,
    pub host: String,
    pub listen: SocketAddr,
    /// The address the RM reaches this agent at; default `http://<listen>` (`https://`
    /// with `tls.*`).
    pub advertise: Option<String>,
    pub node_token: String,
    pub rack: String,
    pub labels: Vec<String>,
    pub gpu_type: Option<String>,
    /// CPU, memory, GPU mask and ports offered.
    pub total: Resources,
    /// Preset name or `nvidia-smi topo -m` text; empty: none.
    pub topology: String,
    pub work_dir: PathBuf,
    /// Which uid each user's tasks run as (`--user-map`, `--run-as`, `node.task_uids`):
    /// see [`super::identity`].
    pub identity: super::identity::IdentitySettings,
    /// How long a finished container's record (its logs) stays (`node.log_retention_sec`).
    pub retention: Option<Duration>,
    /// How long after its end a container's work directory goes (`node.work_dir_grace_sec`).
    pub work_dir_grace: Option<Duration>,
    /// What to do with a task that names an image (`node.image_runtime`, `node.run_without_image`).
    pub image: crate::node::image::ImagePolicy,
    /// The address peers of this node's containers reach them at (`--ip`); `None`: see
    /// [`peer_ip`].
    pub ip: Option<IpAddr>,
    /// Variables every task of this node gets (`--task-env NAME=VALUE`), checked with
    /// [`super::contract::check_task_env`].
    pub task_env: Vec<(String, String)>,
    /// Most bytes of each container log (`node.max_log_bytes`; `None`: no limit).
    pub max_log_bytes: Option<u64>,
    /// Read timeouts of the agent's listener (`http.read_timeout_sec`).
    pub http_timeouts: crate::tls::HttpTimeouts,
    /// Which containment mechanisms the node may use (`--containment`).
    pub containment: super::cgroup::Choice,
    /// The `gpuam` executable that runs the subreaper shim (`None`: no shim; without a
    /// cgroup, process groups only).
    pub shim_exe: Option<PathBuf>,
    /// Disk, pids and device bounds (`node.*`, see [`super::bounds`]).
    pub bounds: super::bounds::NodeBounds,
    /// `tls.*`: with a certificate and key the agent serves HTTPS (and advertises an
    /// `https://` address); its client to the RM trusts `tls.ca_file`.
    pub tls: crate::config::TlsSettings,
}

struct Agent {
    host: String,
    /// This host's key, from the RM's answer to its registration (`None` until then:
    /// nothing the RM would send can be checked yet, so every call is refused).
    key: parking_lot::RwLock<Option<[u8; 32]>>,
    /// This run's random id, in its registration: the RM's calls name it in their MAC, so
    /// a call made for an earlier run of this agent is refused (see `super::token`).
    instance: String,
    /// The nonces of the RM's calls taken within the window: a replay is refused.
    seen_calls: Mutex<token::SeenCalls>,
    /// Bytes of RM calls' bodies being read now, before their MACs are checked
    /// ([`MAX_BUFFERED_CALL_BYTES`]).
    buffered: std::sync::atomic::AtomicUsize,
    total: Resources,
    /// This machine's topology (NICs, CPU affinity): where each task's GPUs are.
    topology: Option<crate::topology::Topology>,
    executor: Executor,
    /// Dead containers not yet acknowledged by the RM.
    exited: Mutex<BTreeMap<String, ContainerReport>>,
    /// Starts under way and containers stopped before they started (the RM stopped one
    /// whose start answer it never got): one lock decides whether such a container runs
    /// (then the stop reaches it) or never will (a start that arrives later is refused).
    starts: Mutex<StartGate>,
    /// Wakes the heartbeat loop (a container died).
    beat_now: Notify,
    /// Log reads at once ([`LOG_READS`]), each on a blocking thread.
    log_reads: Arc<tokio::sync::Semaphore>,
}

/// How many container log reads (up to 8 MiB each) the agent serves at once: 250 at once
/// took it to 1.3 GB and read files on its async workers (twelfth pass).
const LOG_READS: usize = 8;
/// How long a log read waits for its turn before it is refused (503, the RM says so).
const LOG_READ_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Runs an agent until SIGTERM / Ctrl-C (its containers keep running; a restarted agent
/// re-attaches to them).
pub async fn run(opts: AgentOptions) -> anyhow::Result<()> {
    let (addr, _handle) = start(opts).await?;
    tracing::info!(%addr, "node agent serving");
    shutdown_signal().await;
    tracing::info!("node agent stopping; its containers keep running");
    Ok(())
}

/// Resolves on SIGTERM, SIGINT (Ctrl-C) or SIGHUP.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).ok();
    let mut hup = signal(SignalKind::hangup()).ok();
    let term = async {
        match term.as_mut() {
            Some(s) => {
                s.recv().await;
            }
            None => futures::future::pending::<()>().await,
        }
    };
    let hup = async {
        match hup.as_mut() {
            Some(s) => {
                s.recv().await;
            }
            None => futures::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
        _ = hup => {}
    }
}

/// What the agent's containers may not bind: the ports it offers but did not grant them,
/// its own port (`bound`) and the RM's (a task that took either while it restarts would
/// be sent the calls meant for it).
fn bind_guard(opts: &AgentOptions, bound: SocketAddr) -> super::bind_guard::BindGuard {
    let rm_port = reqwest::Url::parse(&opts.rm_url)
        .ok()
        .and_then(|u| u.port_or_known_default());
    super::bind_guard::BindGuard {
        managed: opts.total.ports.clone(),
        reserved: crate::resources::PortSet::from_ports([bound.port()].into_iter().chain(rm_port)),
    }
}

/// Starts an agent: the HTTP server and the heartbeat loop; returns the bound address.
pub async fn start(opts: AgentOptions) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let work_dir = super::identity::open_for_tasks(&opts.work_dir, &opts.work_dir.join("containers"))
        .map_err(anyhow::Error::msg)?;
    let users = super::identity::TaskUsers::for_node(&opts.identity).map_err(anyhow::Error::msg)?;
    tracing::info!(host = %opts.host, "{}", users.describe());
    // Bound before the containers' guard is made: its port is one no task may take.
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", opts.listen))?;
    let addr = listener.local_addr()?;
    let containment = Containment::choose(opts.containment, &cgroup_parent(&opts.host), opts.shim_exe.clone())
        .and_then(|c| opts.bounds.apply(c))
        .map_err(anyhow::Error::msg)?
        .with_bind_guard(bind_guard(&opts, addr));
    tracing::info!(host = %opts.host, "{}", containment.describe());
    let describe = containment.describe();
    let limits = containment.limits();
    let (events_tx, mut events_rx) = mpsc::unbounded_channel();
    let executor = Executor::with_options(
        work_dir.join("containers"),
        events_tx,
        ExecutorOptions {
            containment,
            run_as: None,
            users: Some(Arc::new(users)),
            task_env: opts.task_env.clone(),
            max_log_bytes: opts.max_log_bytes,
            retention: opts.retention,
            work_dir_grace: opts.work_dir_grace,
            ends_heard_here: false,
            max_disk_mb: opts.bounds.max_disk_mb,
            image: opts.image,
        },
    );
    let agent = Arc::new(Agent {
        host: opts.host.clone(),
        key: parking_lot::RwLock::new(None),
        instance: token::new_nonce(),
        seen_calls: Mutex::new(token::SeenCalls::default()),
        buffered: std::sync::atomic::AtomicUsize::new(0),
        total: opts.total.clone(),
        // Checked by `gpuam node` before the agent starts; unreadable text means none.
        topology: crate::topology::Topology::from_spec(&opts.topology).ok().flatten(),
        executor,
        exited: Mutex::new(BTreeMap::new()),
        starts: Mutex::new(StartGate::default()),
        beat_now: Notify::new(),
        log_reads: Arc::new(tokio::sync::Semaphore::new(LOG_READS)),
    });
    let server_tls = crate::tls::server_config_from_settings(&opts.tls)?;
    let router = router(agent.clone());
    let timeouts = opts.http_timeouts;
    let reserved = crate::tls::ReservedPeers::this_host();
    // Its RM's calls (container starts, stops, logs) come from the RM's address: they take
    // the reserved pool, which a flood from other sources cannot fill (audit 5 F4). Looked
    // up beside serving, so that a slow name lookup does not hold the agent's start.
    let (rm_url, rm_reserved) = (opts.rm_url.clone(), reserved.clone());
    tokio::spawn(async move {
        for (i, ip) in rm_addresses(&rm_url).await.into_iter().enumerate() {
            rm_reserved.set_wide(&format!("the RM ({i})"), ip);
        }
    });
    tokio::spawn(async move {
        if let Err(e) =
            crate::tls::serve_reserving(listener, router, server_tls, timeouts, reserved, std::future::pending()).await
        {
            tracing::error!("agent server stopped: {e}");
        }
    });
    // Deaths: remembered until acknowledged, and reported at once.
    let a = agent.clone();
    tokio::spawn(async move {
        while let Some(NodeEvent::Exited {
            container_id,
            exit_status,
            diagnostics,
            cause,
        }) = events_rx.recv().await
        {
            tracing::info!(container = %container_id, exit_status, "container dead: {diagnostics}");
            a.exited.lock().insert(
                container_id.clone(),
                ContainerReport {
                    container_id,
                    state: ContainerState::Complete,
                    exit_status: Some(exit_status),
                    diagnostics,
                    cause,
                },
            );
            a.beat_now.notify_one();
        }
    });
    reattach_all(&agent);
    let advertise = opts
        .advertise
        .clone()
        .unwrap_or_else(|| format!("{}://{addr}", crate::tls::scheme(opts.tls.serves_https())));
    super::wire::check_agent_address(&advertise).map_err(|e| anyhow::anyhow!("--advertise: {e}"))?;
    let ip = peer_ip(&opts, addr).await;
    match ip {
        Some(ip) => tracing::info!(host = %opts.host, %ip, "peers reach this node's containers at {ip}"),
        None => tracing::warn!(
            host = %opts.host,
            "cannot tell this node's IP: its containers' peers get the host name `{}`, which must resolve \
             on every node; pass --ip",
            opts.host
        ),
    }
    let register = AgentRegister {
        host: opts.host.clone(),
        rack: opts.rack.clone(),
        labels: opts.labels.clone(),
        gpu_type: opts.gpu_type.clone(),
        total: opts.total.clone(),
        topology: opts.topology.clone(),
        http_address: advertise,
        ip,
        containers: Vec::new(),
        containment: describe,
        instance: agent.instance.clone(),
    };
    for line in startup_lines(&register, &limits, &opts.rm_url) {
        eprintln!("{line}");
    }
    // HTTPS to the RM trusts `tls.ca_file` (else the system's roots).
    let http = crate::tls::http_client_builder(opts.tls.ca_file.as_deref())?
        .timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| anyhow::anyhow!("cannot build an HTTP client: {e}"))?;
    let beat = tokio::spawn(heartbeat_loop(
        agent,
        http,
        opts.rm_url.clone(),
        opts.node_token.clone(),
        register,
    ));
    Ok((addr, beat))
}

/// The IP addresses `rm_url`'s host names (a literal, or what it resolves to within 5 s;
/// none when it does not).
async fn rm_addresses(rm_url: &str) -> Vec<std::net::IpAddr> {
    let Ok(url) = reqwest::Url::parse(rm_url) else {
        return Vec::new();
    };
    let (Some(host), Some(port)) = (url.host_str(), url.port_or_known_default()) else {
        return Vec::new();
    };
    let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
    match tokio::time::timeout(Duration::from_secs(5), tokio::net::lookup_host((host, port))).await {
        Ok(Ok(addrs)) => addrs.map(|a| a.ip()).collect(),
        _ => Vec::new(),
    }
}

/// What `gpuam node` prints on start: one summary line (host, GPUs and type, topology,
/// containment and limits, RM), then a warning when CPU or memory limits are not enforced.
pub fn startup_lines(reg: &AgentRegister, limits: &[(&str, &str)], rm_url: &str) -> Vec<String> {
    let gpus = reg.total.gpu_count();
    let gpu_text = match (&reg.gpu_type, gpus) {
        (_, 0) => "0 GPUs".to_string(),
        (Some(t), n) => format!("{n} GPU{} ({t})", if n == 1 { "" } else { "s" }),
        (None, n) => format!("{n} GPU{} (no type)", if n == 1 { "" } else { "s" }),
    };
    let topology = match reg.topology.trim() {
        "" => "none (GPU pairs treated alike)".to_string(),
        t if !t.contains('\n') => t.to_string(),
        _ => "from nvidia-smi topo -m".to_string(),
    };
    let mut lines = vec![format!(
        "gpuam node {}: {gpu_text}, {} CPUs, {} MB; topology {topology}; {}; RM {rm_url}; serving at {}{}",
        reg.host,
        reg.total.cpu,
        reg.total.memory_mb,
        reg.containment,
        reg.http_address,
        reg.ip
            .map(|ip| format!(", peers reach its containers at {ip}"))
            .unwrap_or_default()
    )];
    let missing: Vec<&str> = ["cpu", "memory"]
        .into_iter()
        .filter(|c| !limits.iter().any(|(n, _)| n == c))
        .collect();
    if !missing.is_empty() {
        lines.push(format!(
            "warning: node {} enforces no {} limit: a task may use more than it asked for (run the agent \
             as root on a machine with cgroup v2, or cgroup v1's cpu and memory controllers)",
            reg.host,
            missing.join(" and ")
        ));
    }
    if !rm_url.trim().to_ascii_lowercase().starts_with("https://") {
        lines.push(format!(
            "warning: node {} talks to its RM over plain HTTP: its agent token and host key cross the \
             network in clear, and the RM's answers (stop lists, HOST_REMOVED, which stops every container) \
             are taken unauthenticated, so anyone on the path can act as this agent or as its RM; use an \
             https:// RM URL with tls.ca_file on a network you do not trust",
            reg.host
        ));
    }
    lines
}

/// The address this node's containers are reached at by their peers (the RM hands it to
/// them in `GPUAM_HOSTS_<ROLE>` and `PAI_HOST_IP_*`), the first that peers can connect to
/// of: `--ip`; the `--listen` address; the `--advertise` URL's host when it is an IP; the
/// address this machine sends from towards the RM ([`route_ip_towards`]), which is on the
/// network the nodes share.
async fn peer_ip(opts: &AgentOptions, bound: SocketAddr) -> Option<IpAddr> {
    let usable = |ip: IpAddr| super::wire::check_node_ip(ip).ok();
    let configured = opts
        .ip
        .and_then(usable)
        .or_else(|| usable(bound.ip()))
        .or_else(|| opts.advertise.as_deref().and_then(url_ip).and_then(usable));
    match configured {
        Some(ip) => Some(ip),
        None => route_ip_towards(&opts.rm_url).await.and_then(usable),
    }
}

/// The host of `url` when it is an IP address.
fn url_ip(url: &str) -> Option<IpAddr> {
    let u = reqwest::Url::parse(url).ok()?;
    u.host_str()?.trim_start_matches('[').trim_end_matches(']').parse().ok()
}

/// The source address the kernel picks for packets to the RM: a UDP socket connected to
/// the RM's address (which sends nothing) reports it as its local address.
async fn route_ip_towards(rm_url: &str) -> Option<IpAddr> {
    let u = reqwest::Url::parse(rm_url).ok()?;
    let host = u.host_str()?.trim_start_matches('[').trim_end_matches(']').to_string();
    let port = u.port_or_known_default()?;
    let rm = tokio::net::lookup_host((host.as_str(), port)).await.ok()?.next()?;
    let any: IpAddr = if rm.is_ipv4() {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        Ipv6Addr::UNSPECIFIED.into()
    };
    let socket = std::net::UdpSocket::bind((any, 0)).ok()?;
    socket.connect(rm).ok()?;
    Some(socket.local_addr().ok()?.ip())
}

/// The agent's cgroup parent name: `gpuam-<host>` with anything but `[A-Za-z0-9_.-]` as `_`.
fn cgroup_parent(host: &str) -> String {
    let clean: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_.-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("gpuam-{clean}")
}

/// Re-attaches to every container this node launched whose end the RM has not
/// acknowledged. That includes a container whose launch began (its log files are created
/// before the spawn) but whose process was never recorded (the agent died in between):
/// nothing can own it, so re-attaching ends it at once, killing whatever runs in its
/// cgroup, and reports it dead; its resources return to the RM only then.
fn reattach_all(agent: &Agent) {
    for id in agent.executor.unacknowledged() {
        agent.executor.reattach(&id);
    }
}

/// What the agent tells the RM now: running containers and unacknowledged deaths.
fn reports(agent: &Agent) -> Vec<ContainerReport> {
    let mut out: Vec<ContainerReport> = agent
        .executor
        .running_ids()
        .into_iter()
        .map(|id| ContainerReport {
            container_id: id,
            state: ContainerState::Running,
            exit_status: None,
            diagnostics: String::new(),
            cause: None,
        })
        .collect();
    out.extend(agent.exited.lock().values().cloned());
    out
}

async fn heartbeat_loop(
    agent: Arc<Agent>,
    http: reqwest::Client,
    rm_url: String,
    node_token: String,
    register: AgentRegister,
) {
    let base = rm_url.trim_end_matches('/').to_string();
    let mut registered = false;
    let mut removed = false;
    let mut every = DEFAULT_HEARTBEAT;
    loop {
        let (url, body) = if registered {
            (
                format!("{base}/ws/v1/node-agents/{}/heartbeat", agent.host),
                serde_json::to_value(AgentHeartbeat {
                    containers: reports(&agent),
                }),
            )
        } else {
            let mut r = register.clone();
            r.containers = reports(&agent);
            (format!("{base}/ws/v1/node-agents/register"), serde_json::to_value(r))
        };
        let reply = match body {
            Ok(body) => send(&http, &url, &node_token, &body).await,
            Err(e) => Err(Refusal::Other(e.to_string())),
        };
        match reply {
            Ok(reply) => {
                removed = false;
                if !registered {
                    tracing::info!(rm = %base, instance = %register.instance, "registered with the RM");
                }
                registered = !reply.reregister;
                if let Some(k) = &reply.host_key {
                    match token::key_from_hex(k) {
                        Some(k) => *agent.key.write() = Some(k),
                        None => tracing::warn!("the RM's answer carries a host key that is not 32 bytes of hex"),
                    }
                }
                if reply.heartbeat_ms > 0 {
                    every = Duration::from_millis(reply.heartbeat_ms);
                }
                apply(&agent, reply);
            }
            Err(Refusal::HostRemoved(why)) => {
                // This host was removed for good: nothing it runs may go on (the RM freed
                // its GPUs and ports for others). Stop every container once, then keep
                // asking, so that a new credential brings the host back.
                if !removed {
                    tracing::error!(rm = %base, "HOST_REMOVED: {why}; stopping every container of this host");
                    let a = agent.clone();
                    tokio::spawn(async move { a.executor.stop_all(STOP_GRACE).await });
                }
                removed = true;
                registered = false;
            }
            Err(Refusal::Other(why)) => {
                tracing::warn!(rm = %base, "heartbeat failed: {why}");
                registered = false;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = agent.beat_now.notified() => {}
        }
    }
}

/// Why the RM did not take a heartbeat or registration.
enum Refusal {
    /// 403 `HOST_REMOVED`: an administrator removed this host for good.
    HostRemoved(String),
    /// Anything else (unreachable, busy, another refusal): try again.
    Other(String),
}

/// Most bytes of the RM's answer to a registration or heartbeat read (it names the
/// containers to stop or forget: ids of ~80 bytes).
const AGENT_REPLY_MAX: usize = 64 << 20;

async fn send(http: &reqwest::Client, url: &str, token: &str, body: &serde_json::Value) -> Result<AgentReply, Refusal> {
    let resp = http
        .post(url)
        .bearer_auth(token.trim())
        .json(body)
        .send()
        .await
        .map_err(|e| Refusal::Other(e.to_string()))?;
    let status = resp.status();
    if !status.is_success() {
        let text = super::answer::error_text(resp).await;
        let code = serde_json::from_str::<ErrorBody>(&text)
            .map(|b| b.code)
            .unwrap_or_default();
        let why = format!("{status}: {text}");
        return Err(if status == StatusCode::FORBIDDEN && code == "HOST_REMOVED" {
            Refusal::HostRemoved(why)
        } else {
            Refusal::Other(why)
        });
    }
    super::answer::json_within::<AgentReply>(resp, AGENT_REPLY_MAX)
        .await
        .map_err(Refusal::Other)
}

/// Stops `ids` in the background, each with the usual grace.
fn stop_ids(agent: &Arc<Agent>, ids: Vec<String>) {
    for id in ids {
        let a = agent.clone();
        tokio::spawn(async move {
            if let Err(e) = a.executor.stop(&id, STOP_GRACE).await {
                tracing::warn!(container = %id, "stop failed: {e}");
            }
        });
    }
}

/// Acts on the RM's answer: forget acknowledged deaths, stop what the RM does not want.
fn apply(agent: &Arc<Agent>, reply: AgentReply) {
    {
        let mut exited = agent.exited.lock();
        for id in &reply.acknowledged {
            if exited.remove(id).is_some() {
                agent.executor.forget(id);
            }
        }
    }
    for id in &reply.stop {
        tracing::info!(container = %id, "the RM does not know this container (or ended it): stopping it");
    }
    stop_ids(agent, reply.stop);
}

// ---------------------------------------------------------------------------
// HTTP: the container endpoints

type Ag = State<Arc<Agent>>;

fn router(agent: Arc<Agent>) -> Router {
    Router::new()
        .route("/ws/v1/node/{host}/containers/{id}/start", post(start_container))
        .route("/ws/v1/node/{host}/containers/{id}/stop", post(stop_container))
        .route("/ws/v1/node/{host}/containers/{id}/status", get(container_status))
        .route("/ws/v1/node/{host}/containers/{id}/logs", get(container_logs))
        .route("/ws/v1/node/{host}/containers/{id}/preempt", post(preempt_container))
        .route_layer(axum::middleware::from_fn_with_state(agent.clone(), rm_call_auth))
        .with_state(agent)
}

struct AgentError(StatusCode, &'static str, String);

impl IntoResponse for AgentError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            code: self.1.into(),
            message: self.2,
        };
        (self.0, Json(body)).into_response()
    }
}

impl From<NodeError> for AgentError {
    fn from(e: NodeError) -> Self {
        match e {
            NodeError::UnknownContainer(_) => AgentError(StatusCode::NOT_FOUND, "NOT_FOUND", e.to_string()),
            NodeError::AlreadyStarted(_) => AgentError(StatusCode::CONFLICT, "CONFLICT", e.to_string()),
            NodeError::StartFailed { .. } => AgentError(StatusCode::BAD_REQUEST, "START_FAILED", e.to_string()),
            _ => AgentError(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL", e.to_string()),
        }
    }
}

/// Most bytes of an RM call's body the agent reads (axum's default body limit).
const MAX_CALL_BODY: usize = 2 << 20;

/// Most bytes of RM calls' bodies the agent holds at once before their MACs are checked:
/// what senders without the key can make it buffer (16 calls of the largest size; the
/// RM's real calls are a few KiB). Past it a call is refused (503) until others are read.
const MAX_BUFFERED_CALL_BYTES: usize = 16 * MAX_CALL_BODY;

/// Bytes taken from the agent's [`MAX_BUFFERED_CALL_BYTES`] by one body as it is read.
struct Buffering<'a>(&'a std::sync::atomic::AtomicUsize, usize);

impl<'a> Buffering<'a> {
    fn new(total: &'a std::sync::atomic::AtomicUsize) -> Buffering<'a> {
        Buffering(total, 0)
    }

    /// Takes `n` more bytes; false (nothing taken) past the budget.
    fn grow(&mut self, n: usize) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        if self.0.fetch_add(n, SeqCst).saturating_add(n) > MAX_BUFFERED_CALL_BYTES {
            self.0.fetch_sub(n, SeqCst);
            return false;
        }
        self.1 += n;
        true
    }
}

impl Drop for Buffering<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Every call to the container endpoints must be the RM's, signed for this request, this
/// run of the agent, now, once (`super::token::verify_call`, [`token::SeenCalls`]); the
/// body is read here (to check its hash) and handed on.
async fn rm_call_auth(State(agent): Ag, req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let (parts, body) = req.into_parts();
    // Refused before its body is read: no key yet, or no signature.
    let signed = match signature(&agent, &parts.headers) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    // Read as it comes, within the agent's budget for bodies not yet checked: senders
    // without the key cannot make it hold more.
    let too_large = || {
        AgentError(
            StatusCode::PAYLOAD_TOO_LARGE,
            "TOO_LARGE",
            format!("an RM call's body is at most {MAX_CALL_BODY} bytes"),
        )
        .into_response()
    };
    let mut held = Buffering::new(&agent.buffered);
    let mut read = Vec::new();
    let mut chunks = body.into_data_stream();
    while let Some(chunk) = futures::StreamExt::next(&mut chunks).await {
        let Ok(chunk) = chunk else {
            return AgentError(
                StatusCode::BAD_REQUEST,
                "BAD_REQUEST",
                "the call's body broke off".into(),
            )
            .into_response();
        };
        if read.len().saturating_add(chunk.len()) > MAX_CALL_BODY {
            return too_large();
        }
        if !held.grow(chunk.len()) {
            return AgentError(
                StatusCode::SERVICE_UNAVAILABLE,
                "BUSY",
                format!("the agent holds {MAX_BUFFERED_CALL_BYTES} bytes of calls' bodies not yet checked: try again"),
            )
            .into_response();
        }
        read.extend_from_slice(&chunk);
    }
    let body = axum::body::Bytes::from(read);
    let target = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path(), |pq| pq.as_str());
    if let Err(e) = authenticate(&agent, signed, parts.method.as_str(), target, &body) {
        return e.into_response();
    }
    next.run(axum::extract::Request::from_parts(parts, axum::body::Body::from(body)))
        .await
}

/// The host key and the call's signature header, or why the call is refused before its
/// body is read (no key yet: 503; no signature, or the old bearer: 401).
fn signature(agent: &Agent, headers: &HeaderMap) -> Result<([u8; 32], String), AgentError> {
    let Some(key) = *agent.key.read() else {
        return Err(AgentError(
            StatusCode::SERVICE_UNAVAILABLE,
            "NOT_REGISTERED",
            "this agent has not registered with the RM yet: it has no key to check the RM's calls with".into(),
        ));
    };
    let unauthorized = |why: String| AgentError(StatusCode::UNAUTHORIZED, "UNAUTHORIZED", why);
    let Some(signature) = headers.get(token::CALL_HEADER) else {
        return Err(unauthorized(if crate::auth::bearer(headers).is_some() {
            format!(
                "the RM's calls must be signed ({}, header {}); a fixed bearer token is no longer taken: upgrade \
                 the RM",
                token::CALL_SCHEME,
                token::CALL_HEADER
            )
        } else {
            format!(
                "this endpoint takes only the RM's calls, each signed ({}: {} ts=… nonce=… mac=…)",
                token::CALL_HEADER,
                token::CALL_SCHEME
            )
        }));
    };
    Ok((key, signature.to_str().unwrap_or("").to_string()))
}

/// Whether this request is an RM call signed for it (see [`rm_call_auth`]).
fn authenticate(
    agent: &Agent,
    (key, signature): ([u8; 32], String),
    method: &str,
    target: &str,
    body: &[u8],
) -> Result<(), AgentError> {
    let unauthorized = |why: String| AgentError(StatusCode::UNAUTHORIZED, "UNAUTHORIZED", why);
    let call = token::Call {
        method,
        path_and_query: target,
        instance: &agent.instance,
        body,
    };
    let now = crate::protocol::now_ms();
    let signed = token::verify_call(&key, &call, &signature, now).map_err(unauthorized)?;
    let admitted = agent.seen_calls.lock().admit(signed, now);
    admitted.map_err(|refused| match refused {
        token::NotAdmitted::Replayed => unauthorized(refused.to_string()),
        token::NotAdmitted::Full(_) => AgentError(StatusCode::SERVICE_UNAVAILABLE, "BUSY", refused.to_string()),
    })
}

/// The call (the RM's: [`rm_call_auth`] checked it) must name this agent's host.
fn check(agent: &Agent, host: &str) -> Result<(), AgentError> {
    if host != agent.host {
        return Err(AgentError(
            StatusCode::NOT_FOUND,
            "NOT_FOUND",
            format!("this agent is host `{}`, not `{host}`", agent.host),
        ));
    }
    Ok(())
}

async fn start_container(
    State(agent): Ag,
    UrlPath((host, id)): UrlPath<(String, String)>,
    headers: HeaderMap,
    Json(req): Json<AgentStart>,
) -> Result<Json<ContainerStatus>, AgentError> {
    check(&agent, &host)?;
    let forbidden = |why: String| AgentError(StatusCode::FORBIDDEN, "NOT_GRANTED", why);
    let grant = &req.grant;
    if grant.container_id != id || grant.host != agent.host {
        return Err(forbidden(format!(
            "the grant names container `{}` on `{}`, not `{id}` on `{}`",
            grant.container_id, grant.host, agent.host
        )));
    }
    let token = headers
        .get(CONTAINER_TOKEN_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let verified = agent.key.read().is_some_and(|key| token::verify(&key, grant, token));
    if !verified {
        return Err(forbidden(format!(
            "no valid container token for `{id}` with exactly these resources; only the RM's grants start"
        )));
    }
    let r = &grant.resources;
    if r.gpu_mask & !agent.total.gpu_mask != 0 || !r.ports.is_subset(&agent.total.ports) {
        return Err(forbidden(format!(
            "the grant names GPUs {:#x} / ports [{}] this node does not offer",
            r.gpu_mask, r.ports
        )));
    }
    match agent.starts.lock().begin(&id) {
        Ok(()) => {}
        Err(Refused::Stopped) => {
            return Err(AgentError(
                StatusCode::CONFLICT,
                "STOPPED",
                format!("container `{id}` was stopped before it started; it never runs"),
            ))
        }
        Err(Refused::AlreadyStarting) => {
            return Err(NodeError::AlreadyStarted(id).into());
        }
    }
    let started = agent
        .executor
        .start_as(
            &id,
            &host,
            r,
            req.launch_context,
            agent.topology.as_ref(),
            Some(grant.user.as_str()).filter(|u| !u.is_empty()),
        )
        .map_err(AgentError::from);
    // Recorded by the executor (or failed, leaving no record): the start is over.
    agent.starts.lock().end(&id);
    let pid = started?;
    Ok(Json(ContainerStatus {
        container_id: id,
        state: ContainerState::Running,
        exit_status: None,
        diagnostics: String::new(),
        pid: Some(pid),
        started_ms: Some(crate::protocol::now_ms()),
    }))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct StopQuery {
    grace_ms: Option<u64>,
}

async fn stop_container(
    State(agent): Ag,
    UrlPath((host, id)): UrlPath<(String, String)>,
    Query(q): Query<StopQuery>,
) -> Result<Json<ContainerStatus>, AgentError> {
    check(&agent, &host)?;
    let grace = Duration::from_millis(q.grace_ms.unwrap_or(3000).min(60_000));
    let give_up = tokio::time::Instant::now() + STOP_OF_A_STARTING_WAIT;
    loop {
        match agent.executor.stop(&id, grace).await {
            Err(NodeError::UnknownContainer(_)) if valid_container_id(&id) && status_of(&agent, &id).is_err() => {
                // No record: its start is under way (wait for the record and stop that),
                // or it never started here and never will (a late start is refused), and
                // the RM hears it is dead, which frees what it held for it.
                let decision = {
                    let mut starts = agent.starts.lock();
                    starts.stop_unknown(&id, agent.executor.status(&id).is_some())
                };
                match decision {
                    UnknownStop::NeverRuns => {
                        agent.never_start(&id);
                        break;
                    }
                    _ if tokio::time::Instant::now() >= give_up => {
                        return Err(AgentError(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "STARTING",
                            format!("container `{id}` is still being started; stop it again"),
                        ))
                    }
                    UnknownStop::StopRecorded => {}
                    UnknownStop::WaitForStart => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
            other => {
                other?;
                break;
            }
        }
    }
    status_of(&agent, &id).map(Json)
}

/// How long a stop waits for a start under way to record its container.
const STOP_OF_A_STARTING_WAIT: Duration = Duration::from_secs(10);

impl Agent {
    /// Reports `id`, stopped before it started (the gate now refuses its start), dead to
    /// the RM.
    fn never_start(&self, id: &str) {
        tracing::info!(container = %id, "stopped before it started: it will never run here");
        self.exited.lock().insert(
            id.to_string(),
            ContainerReport {
                container_id: id.to_string(),
                state: ContainerState::Complete,
                exit_status: Some(crate::protocol::exit_status::ABORTED),
                diagnostics: "stopped before it started on the node; it never ran".into(),
                cause: None,
            },
        );
        self.beat_now.notify_one();
    }
}

async fn preempt_container(
    State(agent): Ag,
    UrlPath((host, id)): UrlPath<(String, String)>,
    Json(body): Json<super::wire::AgentPreempt>,
) -> Result<Json<ContainerStatus>, AgentError> {
    check(&agent, &host)?;
    agent.executor.notify_preemption(&id, body.deadline_ms, &body.reason)?;
    status_of(&agent, &id).map(Json)
}

fn status_of(agent: &Agent, id: &str) -> Result<ContainerStatus, AgentError> {
    if let Some(s) = agent.executor.status(id) {
        return Ok(s);
    }
    if let Some(r) = agent.exited.lock().get(id) {
        return Ok(ContainerStatus {
            container_id: id.to_string(),
            state: r.state,
            exit_status: r.exit_status,
            diagnostics: r.diagnostics.clone(),
            pid: None,
            started_ms: None,
        });
    }
    Err(NodeError::UnknownContainer(id.to_string()).into())
}

async fn container_status(
    State(agent): Ag,
    UrlPath((host, id)): UrlPath<(String, String)>,
) -> Result<Json<ContainerStatus>, AgentError> {
    check(&agent, &host)?;
    status_of(&agent, &id).map(Json)
}

#[derive(Deserialize)]
struct LogsQuery {
    stream: Option<String>,
    tail: Option<u64>,
}

async fn container_logs(
    State(agent): Ag,
    UrlPath((host, id)): UrlPath<(String, String)>,
    Query(q): Query<LogsQuery>,
) -> Result<Response, AgentError> {
    check(&agent, &host)?;
    let stream = match q.stream.as_deref().unwrap_or("stdout") {
        "stdout" => LogStream::Stdout,
        "stderr" => LogStream::Stderr,
        other => {
            return Err(AgentError(
                StatusCode::BAD_REQUEST,
                "BAD_REQUEST",
                format!("`stream` must be stdout or stderr, not `{other}`"),
            ))
        }
    };
    let busy = || {
        AgentError(
            StatusCode::SERVICE_UNAVAILABLE,
            "BUSY",
            format!("the node is serving {LOG_READS} log reads already; try again in a second"),
        )
    };
    let turn = tokio::time::timeout(LOG_READ_WAIT, agent.log_reads.clone().acquire_owned())
        .await
        .map_err(|_| busy())?
        .map_err(|_| busy())?;
    let reader = agent.clone();
    let text = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        reader.executor.read_log(&id, stream, q.tail)
    })
    .await
    .map_err(|e| {
        AgentError(
            StatusCode::INTERNAL_SERVER_ERROR,
            "INTERNAL",
            format!("the log read failed: {e}"),
        )
    })??;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A grant of nothing on host h1 to alice's application 1 (what the signed-call tests
    /// start), for container `id`.
    fn alices_grant(id: &str) -> crate::node::Grant {
        crate::node::Grant {
            container_id: id.into(),
            app_id: "application_1_0001".into(),
            host: "h1".into(),
            resources: Resources::default(),
            user: "alice".into(),
            topology: None,
        }
    }

    fn opts(listen: &str, advertise: Option<&str>, ip: Option<&str>, rm: &str) -> AgentOptions {
        AgentOptions {
            rm_url: rm.into(),
            host: "h1".into(),
            listen: listen.parse().unwrap(),
            advertise: advertise.map(str::to_string),
            node_token: "t".into(),
            rack: "/r".into(),
            labels: Vec::new(),
            gpu_type: None,
            total: Resources::default(),
            topology: String::new(),
            work_dir: PathBuf::from("/nonexistent"),
            identity: Default::default(),
            retention: None,
            work_dir_grace: None,
            image: Default::default(),
            ip: ip.map(|s| s.parse().unwrap()),
            task_env: Vec::new(),
            max_log_bytes: None,
            http_timeouts: Default::default(),
            containment: Default::default(),
            bounds: Default::default(),
            shim_exe: None,
            tls: Default::default(),
        }
    }

    fn register(gpus: u64, gpu_type: Option<&str>, topology: &str) -> AgentRegister {
        AgentRegister {
            host: "n1".into(),
            rack: "/r".into(),
            labels: Vec::new(),
            gpu_type: gpu_type.map(str::to_string),
            total: Resources::with_mask(16, 64000, (1u64 << gpus) - 1, Default::default()),
            topology: topology.into(),
            http_address: "http://10.0.0.5:8042".into(),
            ip: Some("10.0.0.5".parse().unwrap()),
            containers: Vec::new(),
            containment: "containment: cgroup v2 under /sys/fs/cgroup/gpuam; limits: memory (v2), cpu (v2)".into(),
            instance: String::new(),
        }
    }

    #[test]
    fn the_startup_line_says_what_the_node_offers_and_warns_of_missing_limits_and_plain_http() {
        let full = [("memory", "v2"), ("cpu", "v2"), ("pids", "v2")];
        let lines = startup_lines(&register(4, Some("A100"), "pcie4"), &full, "https://rm:8088");
        assert_eq!(lines.len(), 1, "{lines:?}");
        let l = &lines[0];
        for part in [
            "gpuam node n1:",
            "4 GPUs (A100)",
            "topology pcie4",
            "cgroup v2",
            "limits: memory (v2), cpu (v2)",
            "RM https://rm:8088",
            "10.0.0.5",
        ] {
            assert!(l.contains(part), "{part} missing in {l}");
        }
        let nvsmi = "\tGPU0\tGPU1\nGPU0\t X \tNV1\nGPU1\tNV1\t X \n";
        let lines = startup_lines(&register(0, None, nvsmi), &[("pids", "v1")], "https://rm:8088");
        assert!(
            lines[0].contains("0 GPUs") && lines[0].contains("from nvidia-smi topo -m"),
            "{lines:?}"
        );
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(
            lines[1].starts_with("warning: node n1 enforces no cpu and memory limit"),
            "{lines:?}"
        );
        let lines = startup_lines(&register(1, None, ""), &[("cpu", "v1")], "https://rm:8088");
        assert!(
            lines[0].contains("1 GPU (no type)") && lines[0].contains("topology none"),
            "{lines:?}"
        );
        assert!(lines[1].contains("enforces no memory limit"), "{lines:?}");
        // Plain HTTP to the RM: said, with what it exposes and the fix.
        let lines = startup_lines(&register(4, Some("A100"), "pcie4"), &full, "http://rm:8088");
        assert_eq!(lines.len(), 2, "{lines:?}");
        for part in [
            "warning: node n1 talks to its RM over plain HTTP",
            "HOST_REMOVED",
            "https://",
            "tls.ca_file",
        ] {
            assert!(lines[1].contains(part), "{part} missing in {lines:?}");
        }
    }

    /// The RM stops a container whose start answer it never got: an agent that never
    /// started it reports it dead (so the RM frees it) and refuses the start if it comes
    /// late, so it never runs.
    /// The RM's side of the calls to an agent of [`rm_giving_key`]: signs them as the RM
    /// does (`remote::sign_request`) with the key and the instance the agent registered.
    #[derive(Clone)]
    struct RmCalls {
        key: [u8; 32],
        instance: Arc<Mutex<String>>,
        http: reqwest::Client,
    }

    impl RmCalls {
        fn send(
            &self,
            rb: reqwest::RequestBuilder,
        ) -> impl std::future::Future<Output = reqwest::Result<reqwest::Response>> {
            let mut req = rb.build().unwrap();
            let instance = self.instance.lock().clone();
            crate::node::remote::sign_request(&self.key, &instance, &mut req).unwrap();
            self.http.execute(req)
        }
    }

    /// An RM that answers every registration and heartbeat with `key` as the host key;
    /// returns its URL, and how to sign calls as it would.
    async fn rm_giving_key(key: [u8; 32]) -> (String, RmCalls) {
        let reply = AgentReply {
            heartbeat_ms: 200,
            host_key: Some(crate::auth::hex(&key)),
            ..Default::default()
        };
        let instance = Arc::new(Mutex::new(String::new()));
        let seen = instance.clone();
        let app = axum::Router::new()
            .route(
                "/ws/v1/node-agents/register",
                axum::routing::post(move |Json(reg): Json<AgentRegister>| async move {
                    *seen.lock() = reg.instance;
                    Json(reply)
                }),
            )
            .route(
                "/ws/v1/node-agents/{host}/heartbeat",
                axum::routing::post(|| async { Json(AgentReply::default()) }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(crate::tls::serve(listener, app, None, std::future::pending()));
        let http = crate::tls::http_client_builder(None).unwrap().build().unwrap();
        (format!("http://{addr}"), RmCalls { key, instance, http })
    }

    /// The fixed bearer the RM's calls carried before this change (`gpuam-rm-to-agent-v1`).
    fn old_bearer(key: &[u8]) -> String {
        crate::auth::hmac_hex(key, b"gpuam-rm-to-agent-v1")
    }

    /// Bodies not yet checked are held within the agent's budget: past it a call is
    /// refused until others are read (a flood of large unsigned bodies held 600 MB).
    #[test]
    fn unchecked_bodies_are_held_within_the_budget() {
        let total = std::sync::atomic::AtomicUsize::new(0);
        let mut held: Vec<Buffering> = (0..16).map(|_| Buffering::new(&total)).collect();
        assert!(held.iter_mut().all(|b| b.grow(MAX_CALL_BODY)));
        let mut more = Buffering::new(&total);
        assert!(!more.grow(1), "the budget is spent");
        drop(held);
        assert_eq!(
            total.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "each given back once read"
        );
        assert!(more.grow(4096) && more.grow(4096));
        assert!(!more.grow(MAX_BUFFERED_CALL_BYTES), "past the budget");
        assert_eq!(
            total.load(std::sync::atomic::Ordering::SeqCst),
            8192,
            "a refused take leaves nothing"
        );
        drop(more);
        assert_eq!(total.load(std::sync::atomic::Ordering::SeqCst), 0);
    }

    /// The agent's listener reserves its RM's addresses (audit 5 F4): a literal, IPv6 in
    /// brackets, or a name looked up; nothing for what is not a URL.
    #[tokio::test]
    async fn the_rm_s_addresses_are_found_for_the_reserved_pool() {
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        assert_eq!(rm_addresses("http://127.0.0.5:8088").await, [ip("127.0.0.5")]);
        assert_eq!(rm_addresses("https://[::1]:9").await, [ip("::1")]);
        assert!(rm_addresses("localhost:8088").await.is_empty(), "not a URL with a host");
        assert!(rm_addresses("not a url").await.is_empty());
    }

    /// Until it registered, an agent refuses the RM's calls (it has no key to check them
    /// with); then it takes calls signed with the key the RM gave it and for its own run,
    /// and no other: not another key's, not a call without a signature, not the old fixed
    /// bearer (a 401 that says the RM must sign its calls).
    #[tokio::test]
    async fn the_agent_checks_calls_with_the_key_the_rm_gave_it_at_registration() {
        let tmp = tempfile::tempdir().unwrap();
        let key = [7u8; 32];
        let mut o = opts("127.0.0.1:0", None, None, "http://127.0.0.1:9");
        o.work_dir = tmp.path().join("unregistered");
        let (lonely, _h) = start(o).await.unwrap();
        let (rm_url, rm) = rm_giving_key(key).await;
        let mut o = opts("127.0.0.1:0", None, None, &rm_url);
        o.work_dir = tmp.path().join("work");
        let (addr, _h) = start(o).await.unwrap();
        let http = crate::tls::http_client_builder(None).unwrap().build().unwrap();
        let url =
            |addr: SocketAddr| format!("http://{addr}/ws/v1/node/h1/containers/container_1_0001_01_000001/status");
        let status = |rm: RmCalls, addr: SocketAddr| async move {
            let r = rm.send(rm.http.get(url(addr))).await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        };
        assert_eq!(status(rm.clone(), lonely).await.0, 503, "not registered: no key");
        registered(&rm, addr).await;
        let mut code = (0, String::new());
        for _ in 0..100 {
            code = status(rm.clone(), addr).await;
            if code.0 != 503 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            code.0, 404,
            "the RM's call is taken (the container is unknown): {}",
            code.1
        );
        // A key from the token alone (what the nodes file holds) is not it.
        let digest = super::super::token::token_digest("t");
        let other = RmCalls {
            key: digest,
            ..rm.clone()
        };
        let (code, text) = status(other, addr).await;
        assert_eq!(code, 401, "{text}");
        assert!(text.contains("does not match"), "{text}");
        // Signed for another run of this agent (one before its restart): refused.
        let earlier = RmCalls {
            instance: Arc::new(Mutex::new("an-earlier-run".into())),
            ..rm.clone()
        };
        assert_eq!(status(earlier, addr).await.0, 401);
        // The old fixed bearer of the right key: refused, saying why.
        let r = http.get(url(addr)).bearer_auth(old_bearer(&key)).send().await.unwrap();
        assert_eq!(r.status(), 401);
        let text = r.text().await.unwrap();
        assert!(
            text.contains("must be signed (gpuam-rm-call-v2") && text.contains("upgrade the RM"),
            "{text}"
        );
        // Nothing at all: refused.
        let r = http.get(url(addr)).send().await.unwrap();
        assert_eq!(r.status(), 401);
    }

    /// Waits until the agent at `addr` registered with `rm` (takes its signed calls).
    /// Waits until the agent at `addr` has registered and has its key: any answer but 503
    /// (a call signed before the registration carries no instance and may answer 401 once
    /// the key has come: the tests' first calls wait here, not on their own answers).
    async fn registered(rm: &RmCalls, addr: SocketAddr) {
        let url = format!("http://{addr}/ws/v1/node/h1/containers/container_1_0001_01_000999/status");
        for _ in 0..200 {
            if rm.send(rm.http.get(&url)).await.unwrap().status() != 503 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("the agent at {addr} did not register");
    }

    /// One request as it crossed the wire.
    #[derive(Clone, Debug)]
    struct Captured {
        method: reqwest::Method,
        target: String,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    }

    impl Captured {
        /// Sends it again to the agent at `base` (headers and body as captured).
        async fn replay(&self, http: &reqwest::Client, base: &str) -> (u16, String) {
            let mut rb = http
                .request(self.method.clone(), format!("{base}{}", self.target))
                .body(self.body.clone());
            for (n, v) in &self.headers {
                rb = rb.header(n, v);
            }
            let r = rb.send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    }

    /// A proxy in front of `agent` that records every request it passes on (what a task
    /// holding the agent's port while it restarted, or a sniffer without TLS, gets).
    async fn recording_proxy(agent: SocketAddr) -> (String, Arc<Mutex<Vec<Captured>>>) {
        let captured = Arc::new(Mutex::new(Vec::<Captured>::new()));
        let cap = captured.clone();
        let http = crate::tls::http_client_builder(None).unwrap().build().unwrap();
        let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
            let (cap, http) = (cap.clone(), http.clone());
            async move {
                let (parts, body) = req.into_parts();
                let c = Captured {
                    method: parts.method.clone(),
                    target: parts.uri.path_and_query().unwrap().as_str().to_string(),
                    headers: parts
                        .headers
                        .iter()
                        .filter(|(n, _)| n.as_str().starts_with("x-gpuam") || *n == header::CONTENT_TYPE)
                        .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_string()))
                        .collect(),
                    body: axum::body::to_bytes(body, 1 << 20).await.unwrap().to_vec(),
                };
                cap.lock().push(c.clone());
                let (code, text) = c.replay(&http, &format!("http://{agent}")).await;
                (StatusCode::from_u16(code).unwrap(), text).into_response()
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(crate::tls::serve(listener, app, None, std::future::pending()));
        (format!("http://{addr}"), captured)
    }

    /// The fifth audit's F1, protocol side: the RM's own client (`AgentNodes`) calls a real
    /// agent through a proxy that records each call. Replayed verbatim, a captured start is
    /// refused (its nonce was taken); with other commands, refused (the MAC covers the
    /// body); sent to the agent run after a restart (which has not seen its nonce),
    /// refused (the MAC names the run it was made for). A captured log read or stop is
    /// refused replayed, and its header on another container's or another verb's path
    /// too. Every call, retries included, carries a new signature.
    #[tokio::test]
    async fn a_captured_rm_call_is_refused_replayed_altered_or_sent_to_a_restarted_agent() {
        let tmp = tempfile::tempdir().unwrap();
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let mut credentials = crate::users::Users::default();
        credentials.insert_token("h1", "agent-token").unwrap();
        let key = token::host_key(b"rm-secret", "h1", &token::token_digest("agent-token"));
        let (rm_url, rm) = rm_giving_key(key).await;
        let mut o = opts("127.0.0.1:0", None, None, &rm_url);
        o.work_dir = tmp.path().join("work");
        let (addr, _h) = start(o).await.unwrap();
        registered(&rm, addr).await;
        let (proxy, captured) = recording_proxy(addr).await;
        let agents = super::super::remote::AgentNodes::new(credentials, b"rm-secret".to_vec(), None).unwrap();
        let instance = rm.instance.lock().clone();
        agents.register("h1", &proxy, &instance, std::time::Instant::now());
        use super::super::NodeBackend as _;

        let id = "container_1_0001_01_000001";
        let grant = alices_grant(id);
        let ctx = crate::protocol::LaunchContext {
            commands: vec!["echo victim-runs; exec sleep 60".into()],
            env: [("SECRET".to_string(), "victim-secret".to_string())].into(),
        };
        let s = agents.start(grant, ctx).await.unwrap();
        assert_eq!(s.state, ContainerState::Running);
        let start_call = captured.lock().last().cloned().unwrap();
        assert!(start_call.target.ends_with("/start"), "{start_call:?}");
        let header = |c: &Captured, name: &str| {
            c.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        assert!(header(&start_call, token::CALL_HEADER).starts_with("gpuam-rm-call-v2 ts="));
        assert!(
            !start_call.headers.iter().any(|(n, _)| n == "authorization"),
            "no bearer crosses the wire"
        );
        let http = crate::tls::http_client_builder(None).unwrap().build().unwrap();
        let agent_url = format!("http://{addr}");

        // Replayed as captured: refused (not a 409 "already started": it never gets that far).
        let (code, text) = start_call.replay(&http, &agent_url).await;
        assert_eq!(code, 401, "{text}");
        assert!(text.contains("replay"), "{text}");
        // With the attacker's commands: refused.
        let mut altered = start_call.clone();
        let body = String::from_utf8(altered.body.clone()).unwrap();
        assert!(body.contains("echo victim-runs"), "{body}");
        altered.body = body.replace("echo victim-runs", "id > /tmp/pwned").into_bytes();
        let (code, text) = altered.replay(&http, &agent_url).await;
        assert_eq!(code, 401, "{text}");
        assert!(text.contains("does not match"), "{text}");

        // The same agent host, restarted (a new run, a new instance, no nonce seen): the
        // captured start, as captured or altered, is refused there too.
        let (rm2_url, rm2) = rm_giving_key(key).await;
        let mut o = opts("127.0.0.1:0", None, None, &rm2_url);
        o.work_dir = tmp.path().join("work2");
        let (addr2, _h2) = start(o).await.unwrap();
        registered(&rm2, addr2).await;
        assert_ne!(*rm2.instance.lock(), instance, "each run has its own instance");
        let restarted = format!("http://{addr2}");
        for c in [&start_call, &altered] {
            let (code, text) = c.replay(&http, &restarted).await;
            assert_eq!(code, 401, "{text}");
            assert!(text.contains("does not match"), "{text}");
        }
        assert!(
            !tmp.path().join("work2/containers").join(id).exists(),
            "nothing was started on the restarted agent"
        );

        // A log read, captured: refused replayed; its header on another path refused.
        let log = agents.read_log("h1", id, LogStream::Stdout, None).await.unwrap();
        let _ = log; // the task may not have written yet
        let logs_call = captured.lock().last().cloned().unwrap();
        assert!(logs_call.target.contains("/logs?stream=stdout"), "{logs_call:?}");
        let (code, text) = logs_call.replay(&http, &agent_url).await;
        assert_eq!(code, 401, "{text}");
        let mut stop_with_it = logs_call.clone();
        stop_with_it.method = reqwest::Method::POST;
        stop_with_it.target = format!("/ws/v1/node/h1/containers/{id}/stop?graceMs=0");
        let (code, text) = stop_with_it.replay(&http, &agent_url).await;
        assert_eq!(code, 401, "{text}");
        let mut other_log = logs_call.clone();
        other_log.target = logs_call.target.replace(id, "container_1_0001_01_000002");
        assert_eq!(other_log.replay(&http, &agent_url).await.0, 401);
        assert_eq!(
            agents.status("h1", id).await.map(|s| s.state),
            Some(ContainerState::Running),
            "the captures neither stopped nor changed the task"
        );

        // Each call (a retry is a call) has its own signature.
        assert!(agents.status("h1", id).await.is_some());
        let calls = captured.lock().clone();
        let (a, b) = (&calls[calls.len() - 2], &calls[calls.len() - 1]);
        assert_eq!(a.target, b.target);
        assert_ne!(header(a, token::CALL_HEADER), header(b, token::CALL_HEADER));

        // The RM's own stop goes through; its capture replayed is refused.
        agents.stop("h1", id, Duration::from_millis(200)).await.unwrap();
        let stop_call = captured.lock().last().cloned().unwrap();
        assert!(stop_call.target.contains("/stop?graceMs=200"), "{stop_call:?}");
        assert_eq!(stop_call.replay(&http, &agent_url).await.0, 401);
    }

    #[tokio::test]
    async fn a_container_stopped_before_it_started_never_runs_and_is_reported_dead() {
        let tmp = tempfile::tempdir().unwrap();
        let key = [9u8; 32];
        let (rm_url, rm) = rm_giving_key(key).await;
        let mut o = opts("127.0.0.1:0", None, None, &rm_url);
        o.work_dir = tmp.path().join("work");
        let (addr, _h) = start(o).await.unwrap();
        let id = "container_1_0001_01_000007";
        let url = |verb: &str| format!("http://{addr}/ws/v1/node/h1/containers/{id}/{verb}");
        let http = crate::tls::http_client_builder(None).unwrap().build().unwrap();
        let stop = || {
            rm.send(
                http.post(url("stop"))
                    .header("Content-Type", "application/json")
                    .body("{}"),
            )
        };
        // Until the agent has registered (and has its key) it answers 503.
        registered(&rm, addr).await;
        let mut r = stop().await.unwrap();
        for _ in 0..100 {
            if r.status() != 503 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            r = stop().await.unwrap();
        }
        assert_eq!(r.status(), 200);
        let s: ContainerStatus = r.json().await.unwrap();
        assert_eq!(s.state, ContainerState::Complete, "reported dead: {s:?}");
        let grant = alices_grant(id);
        let start = AgentStart {
            grant: grant.clone(),
            launch_context: crate::protocol::LaunchContext {
                commands: vec!["true".into()],
                env: Default::default(),
            },
        };
        let r = rm
            .send(
                http.post(url("start"))
                    .header(CONTAINER_TOKEN_HEADER, super::super::token::sign(&key, &grant))
                    .json(&start),
            )
            .await
            .unwrap();
        assert_eq!(r.status(), 409, "a late start is refused: {}", r.text().await.unwrap());
        assert!(!tmp.path().join("work/containers").join(id).join("launch.sh").exists());
    }

    /// A stop that comes while its container's start is under way (the RM stopping a
    /// container whose start answer it never got): the container either runs and the stop
    /// reaches it, or never runs and the start is refused. Never both "stopped before it
    /// started" (which frees its GPUs at the RM) and running. 40 starts and stops at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_stop_racing_its_start_either_stops_the_task_or_keeps_it_from_running() {
        let tmp = tempfile::tempdir().unwrap();
        let key = [7u8; 32];
        let (rm_url, rm) = rm_giving_key(key).await;
        let mut o = opts("127.0.0.1:0", None, None, &rm_url);
        o.work_dir = tmp.path().join("work");
        let (addr, _h) = start(o).await.unwrap();
        let http = crate::tls::http_client_builder(None).unwrap().build().unwrap();
        let url = |id: &str, verb: &str| format!("http://{addr}/ws/v1/node/h1/containers/{id}/{verb}");
        let stop = |id: String| {
            let (http, rm) = (http.clone(), rm.clone());
            let u = url(&id, "stop?graceMs=200");
            async move {
                // 503: still being started; the RM would stop it again.
                loop {
                    let r = rm.send(http.post(&u)).await.unwrap();
                    if r.status() != 503 {
                        return (r.status().as_u16(), r.json::<ContainerStatus>().await.ok());
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        // Until the agent has registered (and has its key) it answers 503.
        registered(&rm, addr).await;
        let ready = stop("container_1_0001_01_000099".into()).await;
        assert_eq!(ready.0, 200, "the agent answers");
        let out = tmp.path().join("out");
        std::fs::create_dir_all(&out).unwrap();
        // The tasks run as the user's own uid: they may write here, and reach it.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o1777)).unwrap();
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let pairs = (0..40u32).map(|i| {
            let id = format!("container_1_0001_01_{:06}", 100 + i);
            let grant = alices_grant(&id);
            let body = AgentStart {
                grant: grant.clone(),
                launch_context: crate::protocol::LaunchContext {
                    commands: vec![format!("echo $$ > {}/ran-{i}; exec sleep 100", out.display())],
                    env: Default::default(),
                },
            };
            let started = rm.send(
                http.post(url(&id, "start"))
                    .header(CONTAINER_TOKEN_HEADER, super::super::token::sign(&key, &grant))
                    .json(&body),
            );
            let stopped = stop(id.clone());
            async move {
                let (started, stopped) = tokio::join!(started, stopped);
                let started = started.unwrap();
                let code = started.status().as_u16();
                (i, (code, started.text().await.unwrap_or_default()), stopped)
            }
        });
        let results = futures::future::join_all(pairs).await;
        let (mut ran, mut refused) = (0, 0);
        for (i, (start_status, start_body), (stop_status, status)) in results {
            let status = status.unwrap_or_else(|| panic!("task {i}: the stop answered {stop_status} without a status"));
            assert_eq!(
                status.state,
                ContainerState::Complete,
                "task {i}: the stop leaves it dead: {status:?}"
            );
            match start_status {
                200 => {
                    ran += 1;
                    assert!(
                        !status.diagnostics.contains("never ran"),
                        "task {i} was started and yet reported as never run (the RM would free its GPUs): {status:?}"
                    );
                }
                409 => {
                    refused += 1;
                    assert!(status.diagnostics.contains("never ran"), "task {i}: {status:?}");
                }
                other => panic!("task {i}: the start answered {other}: {start_body}"),
            }
        }
        // A refused start spawned nothing: no task of one ever wrote its file; a started
        // one's process is gone (the stop answered only once it was dead).
        for i in 0..40u32 {
            if let Ok(pid) = std::fs::read_to_string(out.join(format!("ran-{i}"))) {
                let pid: i32 = pid.trim().parse().unwrap();
                let alive = std::fs::read_to_string(format!("/proc/{pid}/status"))
                    .map(|s| {
                        !s.lines()
                            .any(|l| l.starts_with("State:") && (l.contains('Z') || l.contains('X')))
                    })
                    .unwrap_or(false);
                assert!(!alive, "task {i} (pid {pid}) still runs after its stop answered");
            }
        }
        println!("{ran} started then stopped, {refused} refused as stopped before they started");
        assert_eq!(ran + refused, 40);
    }

    /// An agent killed between spawning a task and recording its process leaves a task
    /// nobody knows; the agent started again kills it (it is in the container's cgroup)
    /// and reports the container dead, instead of leaving it to run unowned while the RM
    /// hands its GPUs to someone else.
    #[tokio::test]
    async fn a_task_launched_but_never_recorded_is_killed_when_the_agent_starts_again() {
        let tmp = tempfile::tempdir().unwrap();
        let host = format!("unrecorded-{}", std::process::id());
        let containment = Containment::detect(&cgroup_parent(&host));
        assert_ne!(
            containment.mechanism(),
            super::super::cgroup::Mechanism::ProcessGroup,
            "this test needs a cgroup it can create (run it as root): {}",
            containment.describe()
        );
        // What the killed agent left: the container's directory with its launch script but
        // no process.json, and the task running in the container's cgroup.
        let id = "container_1_0001_01_000001";
        let dir = tmp.path().join("work/containers").join(id);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("stdout"), "").unwrap();
        let cgroup = containment.create(id, Default::default()).unwrap();
        /// The stand-in task, killed if the test fails.
        struct Task(std::process::Child);
        impl Drop for Task {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let mut task = Task(
            std::process::Command::new("sleep")
                .arg("1000")
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        );
        for procs in cgroup.join_paths() {
            std::fs::write(procs.to_str().unwrap(), task.0.id().to_string()).unwrap();
        }
        assert_eq!(cgroup.pids(), vec![task.0.id() as i32]);

        let mut o = opts("127.0.0.1:0", None, None, "http://127.0.0.1:9");
        o.host = host;
        o.work_dir = tmp.path().join("work");
        let _agent = start(o).await.unwrap();
        let ended = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                if let Some(status) = task.0.try_wait().unwrap() {
                    return status;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the unrecorded task is killed");
        assert!(!ended.success(), "{ended:?}");
        assert!(cgroup.is_empty(), "{:?}", cgroup.pids());
        // The agent's own clean-up of the cgroup runs on; give it a moment, then go.
        tokio::time::sleep(Duration::from_millis(500)).await;
        cgroup.remove();
        containment.remove_parents();
    }

    async fn chosen(o: &AgentOptions) -> Option<String> {
        peer_ip(o, o.listen).await.map(|ip| ip.to_string())
    }

    #[tokio::test]
    async fn peers_get_the_ip_given_else_the_listen_or_advertised_one_else_the_route_to_the_rm() {
        let rm = "http://127.0.0.1:8088";
        let o = opts("10.0.0.2:8042", Some("http://10.9.9.9:8042"), Some("10.0.0.9"), rm);
        assert_eq!(chosen(&o).await.as_deref(), Some("10.0.0.9"), "--ip first");
        let o = opts("10.0.0.2:8042", Some("http://10.9.9.9:8042"), None, rm);
        assert_eq!(chosen(&o).await.as_deref(), Some("10.0.0.2"), "then --listen");
        let o = opts("0.0.0.0:8042", Some("http://[fd00::9]:8042"), None, rm);
        assert_eq!(chosen(&o).await.as_deref(), Some("fd00::9"), "then --advertise");
        let o = opts("0.0.0.0:8042", Some("http://gpu-3.lan:8042"), None, rm);
        assert_eq!(
            chosen(&o).await.as_deref(),
            Some("127.0.0.1"),
            "then the address this machine uses towards the RM"
        );
    }
}
