//! The node agent (`gpuam node`): one per machine, YARN's NodeManager.
//!
//! It registers with the RM (bearer: the node token both share), heartbeats its
//! containers' states, and serves the container endpoints (see [`super::wire`]) at its
//! `nodeHTTPAddress`. It runs each container with the [`Executor`]: in a cgroup of its own
//! ([`super::cgroup`]), as an unprivileged task user (`--run-as`, default `gpuam-task`,
//! created when the agent runs as root).
//!
//! Only granted containers start: `start` needs the node token and the RM's container token
//! for exactly the grant in the request ([`super::token`]).
//!
//! A container's end is reported (heartbeat, at once) only once it is dead, and again on
//! every heartbeat until the RM acknowledges it (an `acked` file in its directory then
//! records that). The agent stopping (SIGTERM) leaves its containers running; a restarted
//! agent re-attaches to every container not yet acknowledged and re-registers, listing them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
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
use super::executor::{valid_container_id, Executor, ExecutorOptions, LogStream, RunAs};
use super::wire::{AgentHeartbeat, AgentRegister, AgentReply, AgentStart, ContainerReport, CONTAINER_TOKEN_HEADER};
use super::{token, NodeError, NodeEvent};
use crate::protocol::{ContainerState, ContainerStatus, ErrorBody};
use crate::resources::Resources;

/// Marks a container whose end the RM acknowledged (not re-attached after a restart).
const ACKED_FILE: &str = "acked";
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
    /// The address the RM reaches this agent at; default `http://<listen>`.
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
    /// Tasks run as this user; `None`: `gpuam-task` (created) when root, else this user.
    pub run_as: Option<String>,
}

struct Agent {
    host: String,
    secret: Vec<u8>,
    total: Resources,
    executor: Executor,
    /// Dead containers not yet acknowledged by the RM.
    exited: Mutex<BTreeMap<String, ContainerReport>>,
    /// Wakes the heartbeat loop (a container died).
    beat_now: Notify,
}

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

/// Starts an agent: the HTTP server and the heartbeat loop; returns the bound address.
pub async fn start(opts: AgentOptions) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let work_dir = prepare_work_dir(&opts.work_dir)?;
    let run_as = match &opts.run_as {
        Some(name) => Some(RunAs::lookup(name).map_err(anyhow::Error::msg)?),
        None if nix::unistd::geteuid().is_root() => {
            Some(RunAs::ensure(super::executor::DEFAULT_TASK_USER).map_err(anyhow::Error::msg)?)
        }
        None => {
            tracing::warn!("not root and no --run-as: tasks run as this agent's user");
            None
        }
    };
    if let Some(u) = &run_as {
        if u.uid == 0 {
            anyhow::bail!(
                "--run-as {}: tasks must not run as root; name an unprivileged user",
                u.name
            );
        }
    }
    let containment = Containment::detect(&cgroup_parent(&opts.host));
    tracing::info!(host = %opts.host, "{}", containment.describe());
    let describe = containment.describe();
    let (events_tx, mut events_rx) = mpsc::unbounded_channel();
    let executor = Executor::with_options(
        work_dir.join("containers"),
        events_tx,
        ExecutorOptions { containment, run_as },
    );
    let agent = Arc::new(Agent {
        host: opts.host.clone(),
        secret: opts.node_token.trim().as_bytes().to_vec(),
        total: opts.total.clone(),
        executor,
        exited: Mutex::new(BTreeMap::new()),
        beat_now: Notify::new(),
    });
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", opts.listen))?;
    let addr = listener.local_addr()?;
    let router = router(agent.clone());
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
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
                },
            );
            a.beat_now.notify_one();
        }
    });
    reattach_all(&agent);
    let advertise = opts.advertise.clone().unwrap_or_else(|| format!("http://{addr}"));
    let register = AgentRegister {
        host: opts.host.clone(),
        rack: opts.rack.clone(),
        labels: opts.labels.clone(),
        gpu_type: opts.gpu_type.clone(),
        total: opts.total.clone(),
        topology: opts.topology.clone(),
        http_address: advertise,
        containers: Vec::new(),
        containment: describe,
    };
    let beat = tokio::spawn(heartbeat_loop(
        agent,
        opts.rm_url.clone(),
        opts.node_token.clone(),
        register,
    ));
    Ok((addr, beat))
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

/// Creates the work dir and its `containers/`: both 0711, so the task user reaches its own
/// container directory without listing anyone else's.
fn prepare_work_dir(dir: &Path) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let containers = dir.join("containers");
    std::fs::create_dir_all(&containers)
        .map_err(|e| anyhow::anyhow!("cannot create the work dir {}: {e}", containers.display()))?;
    let dir = std::fs::canonicalize(dir)?;
    for d in [dir.clone(), dir.join("containers")] {
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o711))
            .map_err(|e| anyhow::anyhow!("cannot set mode 0711 on {}: {e}", d.display()))?;
    }
    Ok(dir)
}

/// Re-attaches to every container directory whose end the RM has not acknowledged.
fn reattach_all(agent: &Agent) {
    let Ok(entries) = std::fs::read_dir(agent.executor.root()) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let Some(id) = path.file_name().and_then(|n| n.to_str()).map(str::to_string) else {
            continue;
        };
        if valid_container_id(&id)
            && path.join(super::executor::PROCESS_FILE).exists()
            && !path.join(ACKED_FILE).exists()
        {
            agent.executor.reattach(&id);
        }
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
        })
        .collect();
    out.extend(agent.exited.lock().values().cloned());
    out
}

async fn heartbeat_loop(agent: Arc<Agent>, rm_url: String, node_token: String, register: AgentRegister) {
    let http = match crate::tls::http_client_builder(None)
        .map_err(|e| e.to_string())
        .and_then(|b| b.timeout(Duration::from_secs(5)).build().map_err(|e| e.to_string()))
    {
        Ok(h) => h,
        Err(e) => {
            tracing::error!("cannot build an HTTP client: {e}");
            return;
        }
    };
    let base = rm_url.trim_end_matches('/').to_string();
    let mut registered = false;
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
            Err(e) => Err(e.to_string()),
        };
        match reply {
            Ok(reply) => {
                if !registered {
                    tracing::info!(rm = %base, "registered with the RM");
                }
                registered = !reply.reregister;
                if reply.heartbeat_ms > 0 {
                    every = Duration::from_millis(reply.heartbeat_ms);
                }
                apply(&agent, reply);
            }
            Err(why) => {
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

async fn send(http: &reqwest::Client, url: &str, token: &str, body: &serde_json::Value) -> Result<AgentReply, String> {
    let resp = http
        .post(url)
        .bearer_auth(token.trim())
        .json(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        return Err(format!("{status}: {text}"));
    }
    resp.json::<AgentReply>().await.map_err(|e| e.to_string())
}

/// Acts on the RM's answer: forget acknowledged deaths, stop what the RM does not want.
fn apply(agent: &Arc<Agent>, reply: AgentReply) {
    {
        let mut exited = agent.exited.lock();
        for id in &reply.acknowledged {
            if exited.remove(id).is_some() {
                if let Some(dir) = agent.executor.container_dir(id) {
                    let _ = std::fs::write(dir.join(ACKED_FILE), "");
                }
                agent.executor.forget(id);
            }
        }
    }
    for id in reply.stop {
        let a = agent.clone();
        tokio::spawn(async move {
            tracing::info!(container = %id, "the RM does not know this container (or ended it): stopping it");
            if let Err(e) = a.executor.stop(&id, STOP_GRACE).await {
                tracing::warn!(container = %id, "stop failed: {e}");
            }
        });
    }
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

/// Equal-time comparison of two secrets.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The caller must hold the node token, and name this agent's host.
fn check(agent: &Agent, host: &str, headers: &HeaderMap) -> Result<(), AgentError> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .unwrap_or("");
    if given.is_empty() || !same_secret(given.as_bytes(), &agent.secret) {
        return Err(AgentError(
            StatusCode::UNAUTHORIZED,
            "UNAUTHORIZED",
            "this endpoint needs the node token (Authorization: Bearer ...); only the RM calls it".into(),
        ));
    }
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
    check(&agent, &host, &headers)?;
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
    if !token::verify(&agent.secret, grant, token) {
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
    let pid = agent.executor.start(&id, &host, r, req.launch_context)?;
    Ok(Json(ContainerStatus {
        container_id: id,
        state: ContainerState::Running,
        exit_status: None,
        diagnostics: String::new(),
        pid: Some(pid),
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
    headers: HeaderMap,
) -> Result<Json<ContainerStatus>, AgentError> {
    check(&agent, &host, &headers)?;
    let grace = Duration::from_millis(q.grace_ms.unwrap_or(3000).min(60_000));
    agent.executor.stop(&id, grace).await?;
    status_of(&agent, &id).map(Json)
}

async fn preempt_container(
    State(agent): Ag,
    UrlPath((host, id)): UrlPath<(String, String)>,
    headers: HeaderMap,
    Json(body): Json<super::wire::AgentPreempt>,
) -> Result<Json<ContainerStatus>, AgentError> {
    check(&agent, &host, &headers)?;
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
        });
    }
    Err(NodeError::UnknownContainer(id.to_string()).into())
}

async fn container_status(
    State(agent): Ag,
    UrlPath((host, id)): UrlPath<(String, String)>,
    headers: HeaderMap,
) -> Result<Json<ContainerStatus>, AgentError> {
    check(&agent, &host, &headers)?;
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
    headers: HeaderMap,
) -> Result<Response, AgentError> {
    check(&agent, &host, &headers)?;
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
    let text = agent.executor.read_log(&id, stream, q.tail)?;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response())
}
