//! The Ray backend's long-lived driver (`--ray-launch driver`, issue 28): one Python Ray
//! driver (`driver.py`, run with the Ray installation's own Python) per RM, connected to the
//! cluster with `ray.init(address=…)`, instead of one Ray job per container.
//!
//! Owns the driver process (started, supervised, restarted when it dies: each new driver
//! first adopts the containers the RM still runs), the wire to it (JSON lines on its stdin
//! and stdout: requests with a number, answers naming it, and one `exited` report per
//! container), and the table of containers it runs (id → host). On the Ray side, each
//! container holds a placement group of one bundle with exactly its Ray resources
//! ([`super::entry::ray_resources`]) on the granted node, and runs, once Ray has reserved
//! the bundle, as a child of gpuam's actor on that node, in a session of its own, stdout
//! and stderr in files of their own there (see `driver.py`).
//!
//! A container ends (`NodeEvent::Exited`, its GPUs back to the ledger) only when the driver
//! reports it dead: its process group is gone, or its node's actor died with the node.
//! Stop: a container whose group Ray has not reserved yet never starts (the driver holds
//! its start; the node's actor refuses a start it was told to stop); a running one gets
//! TERM, the grace, then KILL to its group.

use std::collections::{BTreeMap, HashMap};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::process::ChildStdin;
use tokio::sync::{mpsc, oneshot};

use super::entry::{contract_env, node_script, ray_resources};
use crate::node::{Grant, LogStream, NodeBackend, NodeError, NodeEvent};
use crate::protocol::{exit_status, ContainerState, ContainerStatus, LaunchContext};

/// The driver's source (run as `python -u -c SOURCE GCS_ADDRESS`).
pub const DRIVER_PY: &str = include_str!("driver.py");
/// How long a new driver may take to connect to Ray and say it is ready.
pub const READY_PATIENCE: Duration = Duration::from_secs(180);
/// How long one request may wait for its answer (a stop: this past its grace).
pub const CALL_PATIENCE: Duration = Duration::from_secs(60);
/// How long `stop` waits past the grace for the container to be reported dead.
pub const STOP_MARGIN: Duration = Duration::from_secs(15);
/// Pause before a driver that died is started again (doubling up to a minute).
const RESTART_PAUSE: Duration = Duration::from_secs(1);

/// How to run the driver.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// The Python of the Ray installation (`--ray-python`, default `python3` on PATH).
    pub python: String,
    /// Ray's GCS address (`--ray-gcs-address`, default the dashboard's host, port 6379).
    pub gcs_address: String,
    /// The gpuam hosts of the cluster: each driver creates their actors when it starts.
    pub hosts: Vec<String>,
}

/// The GCS address of the cluster whose dashboard is at `dashboard` (`http://HOST:8265`):
/// the same host, Ray's default port 6379.
pub fn default_gcs_address(dashboard: &str) -> String {
    let rest = dashboard.split_once("://").map_or(dashboard, |(_, r)| r);
    let hostport = rest.split('/').next().unwrap_or(rest);
    let host = match hostport.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h,
        _ => hostport,
    };
    format!("{host}:6379")
}

/// A container's end as the driver reports it: `how` is `exit` (the task's own status),
/// `stopped` (stopped by request), `refused` (stopped before it started: it never ran) or
/// `lost` (its node or its group was lost).
pub fn exit_of(how: &str, code: Option<i64>, diag: &str) -> (i32, String) {
    match (how, code) {
        ("refused", _) => (
            exit_status::KILLED_BY_APPMASTER,
            format!("cancelled before it started ({diag})"),
        ),
        ("lost", _) | (_, None) => (exit_status::ABORTED, diag.to_string()),
        (_, Some(c)) => (i32::try_from(c).unwrap_or(exit_status::ABORTED), diag.to_string()),
    }
}

/// The start request of a grant.
pub fn start_request(grant: &Grant, ctx: &LaunchContext) -> Value {
    json!({
        "op": "start",
        "id": grant.container_id,
        "host": grant.host,
        "bundle": ray_resources(grant),
        "script": node_script(&grant.container_id, &ctx.commands),
        "env": contract_env(grant, ctx),
    })
}

/// A container of the table: its host, and whether a driver was sent its start (or it was
/// reattached): a new driver adopts exactly those.
struct Entry {
    host: String,
    sent: bool,
}

/// The Ray backend over one long-lived driver.
pub struct RayDriver {
    table: Mutex<BTreeMap<String, Entry>>,
    /// The driver's stdin, while one runs. Held while a request is written, so a new
    /// driver's adoption of what the RM runs goes before any other request.
    link: tokio::sync::Mutex<Option<ChildStdin>>,
    answers: Mutex<HashMap<u64, oneshot::Sender<Value>>>,
    next: AtomicU64,
    events: mpsc::UnboundedSender<NodeEvent>,
    me: Weak<RayDriver>,
}

impl RayDriver {
    /// Starts the driver and its supervisor. Must be called within a tokio runtime.
    pub fn new(cfg: DriverConfig, events: mpsc::UnboundedSender<NodeEvent>) -> Arc<Self> {
        let me = Arc::new_cyclic(|me| RayDriver {
            table: Mutex::new(BTreeMap::new()),
            link: tokio::sync::Mutex::new(None),
            answers: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            events,
            me: me.clone(),
        });
        tokio::spawn(supervise(Arc::downgrade(&me), cfg));
        me
    }

    /// Sends one request and waits for its answer (`patience` at most). The driver may be
    /// (re)starting: the request waits for it within the same patience. `sending` runs
    /// just before the request is written, with the link held.
    async fn call(&self, req: Value, patience: Duration, sending: impl FnOnce()) -> Result<Value, String> {
        let until = Instant::now() + patience;
        let rx = loop {
            let mut link = self.link.lock().await;
            if let Some(stdin) = link.as_mut() {
                sending();
                break self.write(stdin, req).await?;
            }
            drop(link);
            if Instant::now() >= until {
                return Err("the Ray driver is not running (see the RM's log)".into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let answer = tokio::time::timeout_at(until.into(), rx)
            .await
            .map_err(|_| format!("the Ray driver did not answer within {patience:?}"))?
            .map_err(|_| "the Ray driver ended before it answered".to_string())?;
        if answer.get("ok").and_then(Value::as_bool) == Some(false) {
            let why = answer.get("error").and_then(Value::as_str).unwrap_or("no reason given");
            return Err(format!("the Ray driver refused: {why}"));
        }
        Ok(answer)
    }

    /// Writes one request (numbered here) to the driver; the receiver gets its answer.
    async fn write(&self, stdin: &mut ChildStdin, mut req: Value) -> Result<oneshot::Receiver<Value>, String> {
        let re = self.next.fetch_add(1, Ordering::Relaxed);
        req["re"] = json!(re);
        let mut line = serde_json::to_vec(&req).map_err(|e| e.to_string())?;
        line.push(b'\n');
        let (tx, rx) = oneshot::channel();
        self.answers.lock().insert(re, tx);
        if let Err(e) = stdin.write_all(&line).await {
            self.answers.lock().remove(&re);
            return Err(format!("cannot write to the Ray driver: {e}"));
        }
        Ok(rx)
    }

    /// Handles one line from the driver.
    fn on_line(&self, line: &str) {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            tracing::warn!("Ray driver said something that is not JSON: {line}");
            return;
        };
        match v.get("ev").and_then(Value::as_str) {
            Some("reply") => {
                let re = v.get("re").and_then(Value::as_u64).unwrap_or(0);
                if let Some(tx) = self.answers.lock().remove(&re) {
                    let _ = tx.send(v);
                }
            }
            Some("exited") => {
                let Some(id) = v.get("id").and_then(Value::as_str) else {
                    return;
                };
                let how = v.get("how").and_then(Value::as_str).unwrap_or("lost");
                let diag = v.get("diag").and_then(Value::as_str).unwrap_or("");
                let (code, diag) = exit_of(how, v.get("code").and_then(Value::as_i64), diag);
                if self.table.lock().remove(id).is_none() {
                    return;
                }
                tracing::info!(container = id, exit = code, "Ray container ended");
                let _ = self.events.send(NodeEvent::Exited {
                    container_id: id.to_string(),
                    exit_status: code,
                    diagnostics: diag,
                    cause: None,
                });
            }
            Some("ready") => tracing::info!("Ray driver ready: {line}"),
            _ => tracing::warn!("Ray driver: unexpected line {line}"),
        }
    }

    /// Connects a new driver: it first adopts every container a driver was sent (or the
    /// RM reattached), then takes requests.
    async fn connect(&self, mut stdin: ChildStdin, hosts: &[String]) -> Result<(), String> {
        let mut link = self.link.lock().await;
        let list: Vec<Value> = self
            .table
            .lock()
            .iter()
            .filter(|(_, e)| e.sent)
            .map(|(id, e)| json!({ "id": id, "host": e.host }))
            .collect();
        if !list.is_empty() {
            let n = list.len();
            let rx = self
                .write(&mut stdin, json!({ "op": "adopt", "containers": list }))
                .await?;
            tokio::spawn(async move {
                match tokio::time::timeout(READY_PATIENCE, rx).await {
                    Ok(Ok(_)) => tracing::info!("Ray driver adopted {n} container(s)"),
                    other => tracing::warn!("Ray driver: adopting {n} container(s): {other:?}"),
                }
            });
        }
        // Its answer is not awaited (an answer nobody waits for is dropped).
        self.write(&mut stdin, json!({ "op": "prepare", "hosts": hosts }))
            .await?;
        *link = Some(stdin);
        Ok(())
    }

    pub async fn start(&self, grant: Grant, ctx: LaunchContext) -> Result<ContainerStatus, NodeError> {
        let id = grant.container_id.clone();
        if !crate::node::executor::valid_container_id(&id) {
            return Err(NodeError::StartFailed {
                why: format!("`{id}` is not a valid container id"),
                id,
            });
        }
        if let Err(why) = crate::node::contract::validate_context(&ctx) {
            return Err(NodeError::StartFailed { id, why });
        }
        {
            let mut t = self.table.lock();
            if t.contains_key(&id) {
                return Err(NodeError::AlreadyStarted(id));
            }
            t.insert(
                id.clone(),
                Entry {
                    host: grant.host.clone(),
                    sent: false,
                },
            );
        }
        let sending = || {
            if let Some(e) = self.table.lock().get_mut(&id) {
                e.sent = true;
            }
        };
        match self.call(start_request(&grant, &ctx), CALL_PATIENCE, sending).await {
            Ok(_) => Ok(running(&id)),
            Err(why) => {
                self.table.lock().remove(&id);
                Err(NodeError::StartFailed { id, why })
            }
        }
    }

    pub async fn stop(&self, container_id: &str, grace: Duration) -> Result<(), NodeError> {
        if !self.table.lock().contains_key(container_id) {
            return Ok(());
        }
        let req = json!({ "op": "stop", "id": container_id, "grace": grace.as_secs_f64() });
        if let Err(e) = self.call(req, grace + CALL_PATIENCE, || ()).await {
            tracing::warn!(container = container_id, "Ray stop failed: {e}");
        }
        let until = Instant::now() + grace + STOP_MARGIN;
        while Instant::now() < until && self.table.lock().contains_key(container_id) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    pub async fn read_log(
        &self,
        host: &str,
        container_id: &str,
        stream: LogStream,
        tail: Option<u64>,
    ) -> Result<String, NodeError> {
        let stream = stream.file_name();
        let req = json!({ "op": "log", "id": container_id, "host": host, "stream": stream, "tail": tail });
        let answer = self
            .call(req, CALL_PATIENCE, || ())
            .await
            .map_err(|e| NodeError::Io(std::io::Error::other(e)))?;
        match answer.get("text").and_then(Value::as_str) {
            Some(t) => Ok(t.to_string()),
            None => Err(NodeError::UnknownContainer(container_id.to_string())),
        }
    }
}

fn running(id: &str) -> ContainerStatus {
    ContainerStatus {
        container_id: id.to_string(),
        state: ContainerState::Running,
        exit_status: None,
        diagnostics: String::new(),
        pid: None,
        started_ms: None,
    }
}

/// Runs the driver, again and again while the backend lives: start it, wait for its
/// `ready`, hand it the containers the RM runs, serve its lines until it ends.
async fn supervise(me: Weak<RayDriver>, cfg: DriverConfig) {
    let mut pause = RESTART_PAUSE;
    loop {
        let started = Instant::now();
        let child = tokio::process::Command::new(&cfg.python)
            .arg("-u")
            .arg("-c")
            .arg(DRIVER_PY)
            .arg(&cfg.gcs_address)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn();
        match child {
            Err(e) => tracing::error!("cannot start the Ray driver `{}`: {e}", cfg.python),
            Ok(mut child) => {
                let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
                    return;
                };
                let mut lines = BufReader::new(stdout).lines();
                let ready = tokio::time::timeout(READY_PATIENCE, lines.next_line()).await;
                match ready {
                    Ok(Ok(Some(l))) if l.contains("\"ready\"") => {
                        let Some(d) = me.upgrade() else { return };
                        d.on_line(&l);
                        if let Err(e) = d.connect(stdin, &cfg.hosts).await {
                            tracing::error!("Ray driver: {e}");
                        } else {
                            drop(d);
                            while let Ok(Some(l)) = lines.next_line().await {
                                let Some(d) = me.upgrade() else { return };
                                d.on_line(&l);
                            }
                        }
                    }
                    other => tracing::error!("the Ray driver did not get ready: {other:?}"),
                }
                let Some(d) = me.upgrade() else { return };
                *d.link.lock().await = None;
                // Unanswered requests fail now (their callers see the driver ended).
                d.answers.lock().clear();
                let _ = child.kill().await;
                tracing::warn!(
                    "the Ray driver ended after {:.1} s; starting it again",
                    started.elapsed().as_secs_f64()
                );
            }
        }
        if me.strong_count() == 0 {
            return;
        }
        if started.elapsed() > Duration::from_secs(60) {
            pause = RESTART_PAUSE;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(60));
    }
}

impl NodeBackend for RayDriver {
    fn kind(&self) -> &'static str {
        "ray"
    }

    fn start(&self, grant: Grant, ctx: LaunchContext) -> BoxFuture<'_, Result<ContainerStatus, NodeError>> {
        Box::pin(RayDriver::start(self, grant, ctx))
    }

    fn stop<'a>(
        &'a self,
        _host: &'a str,
        container_id: &'a str,
        grace: Duration,
    ) -> BoxFuture<'a, Result<(), NodeError>> {
        Box::pin(RayDriver::stop(self, container_id, grace))
    }

    fn status<'a>(&'a self, _host: &'a str, container_id: &'a str) -> BoxFuture<'a, Option<ContainerStatus>> {
        let known = self.table.lock().contains_key(container_id);
        Box::pin(async move { known.then(|| running(container_id)) })
    }

    fn read_log<'a>(
        &'a self,
        host: &'a str,
        container_id: &'a str,
        stream: LogStream,
        tail: Option<u64>,
    ) -> BoxFuture<'a, Result<String, NodeError>> {
        Box::pin(RayDriver::read_log(self, host, container_id, stream, tail))
    }

    /// After an RM restart: the new driver adopts it (watched again if its node's actor
    /// runs it; reported lost if not, and then never started).
    fn reattach(&self, host: &str, container_id: &str) {
        self.table.lock().insert(
            container_id.to_string(),
            Entry {
                host: host.to_string(),
                sent: true,
            },
        );
        // A driver that runs already adopts it now (one that starts later, when it connects).
        if let (Some(d), Ok(rt)) = (self.me.upgrade(), tokio::runtime::Handle::try_current()) {
            let list = json!([{ "id": container_id, "host": host }]);
            rt.spawn(async move {
                if let Err(e) = d
                    .call(json!({ "op": "adopt", "containers": list }), READY_PATIENCE, || ())
                    .await
                {
                    tracing::warn!("Ray driver: cannot adopt a reattached container: {e}");
                }
            });
        }
    }

    fn running(&self, host: &str) -> Vec<String> {
        self.table
            .lock()
            .iter()
            .filter(|(_, e)| e.host == host)
            .map(|(id, _)| id.clone())
            .collect()
    }

    fn forget(&self, _container_id: &str) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{PortSet, Resources};

    #[test]
    fn the_gcs_address_defaults_to_the_dashboards_host() {
        assert_eq!(default_gcs_address("http://127.0.0.1:8265"), "127.0.0.1:6379");
        assert_eq!(default_gcs_address("http://head:8265/"), "head:6379");
        assert_eq!(default_gcs_address("head"), "head:6379");
    }

    #[test]
    fn driver_reports_map_to_container_exits() {
        assert_eq!(exit_of("exit", Some(0), ""), (0, String::new()));
        assert_eq!(exit_of("exit", Some(3), "exited with 3").0, 3);
        assert_eq!(exit_of("stopped", Some(143), "").0, 143);
        assert_eq!(exit_of("refused", None, "x").0, exit_status::KILLED_BY_APPMASTER);
        assert_eq!(exit_of("lost", None, "node").0, exit_status::ABORTED);
        assert_eq!(exit_of("exit", None, "?").0, exit_status::ABORTED);
    }

    /// What no backend could run is refused before anything reaches Ray (no driver runs
    /// here: its Python does not exist).
    #[tokio::test]
    async fn a_bad_launch_context_is_refused_before_ray() {
        let (tx, _rx) = mpsc::unbounded_channel();
        let d = RayDriver::new(
            DriverConfig {
                python: "/nonexistent/python3".into(),
                gcs_address: "127.0.0.1:9".into(),
                hosts: vec![],
            },
            tx,
        );
        let grant = Grant {
            container_id: "c_bad".into(),
            app_id: "a".into(),
            host: "n1".into(),
            resources: Resources::with_mask(1, 100, 0b1, PortSet::new()),
            user: String::new(),
            topology: None,
        };
        let ctx = LaunchContext {
            commands: vec!["true".into()],
            env: BTreeMap::from([("A=B".to_string(), "x".to_string())]),
        };
        let e = d.start(grant.clone(), ctx).await.unwrap_err();
        assert!(e.to_string().contains("A=B"), "{e}");
        assert!(NodeBackend::running(d.as_ref(), "n1").is_empty());
        let mut bad_id = grant;
        bad_id.container_id = "../x".into();
        let e = d.start(bad_id, LaunchContext::default()).await.unwrap_err();
        assert!(e.to_string().contains("not a valid container id"), "{e}");
    }

    #[test]
    fn a_start_holds_exactly_the_grant_on_its_node_and_runs_the_contract() {
        let grant = Grant {
            container_id: "c_1".into(),
            app_id: "a".into(),
            host: "n2".into(),
            resources: Resources::with_mask(2, 100, 0b110, PortSet::new()),
            user: String::new(),
            topology: None,
        };
        let ctx = LaunchContext {
            commands: vec!["echo hi".into()],
            env: BTreeMap::from([("GPUAM_TASK_INDEX".to_string(), "3".to_string())]),
        };
        let r = start_request(&grant, &ctx);
        assert_eq!(
            r["bundle"],
            json!({ "gpuam-node-n2": super::super::scheme::NODE_RESOURCE_SHARE, "gpuam-gpu-1": 1.0, "gpuam-gpu-2": 1.0 })
        );
        assert_eq!(r["env"]["CUDA_VISIBLE_DEVICES"], "1,2");
        assert_eq!(r["env"]["GPUAM_TASK_INDEX"], "3");
        assert!(
            r["env"].get(super::super::entry::ENV_GATE_KEY).is_none(),
            "no gate here"
        );
        assert!(r["script"].as_str().unwrap().contains("eval 'echo hi'"));
    }
}
