//! The Ray node backend's I/O shell: runs each granted container as one Ray job and tells
//! the RM when it has ended.
//!
//! Owns the table of containers it started (id → host and the last job status Ray
//! reported), the gate of each (see `gate.rs`), and one poll task that lists Ray's jobs
//! every [`POLL`] and sends one `Exited` per container when its job is terminal in Ray
//! (SUCCEEDED, FAILED, STOPPED): only then is the container known dead, so only then do its
//! GPUs and ports return to the ledger (DESIGN.md §9).
//!
//! Stopping: the gate closes first (a job that Ray starts only later runs no command), then
//! Ray is asked to stop the job, and `stop` waits until Ray reports it ended or the grace
//! and a margin have passed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::mpsc;

use super::client::{JobInfo, JobStatus, RayClient};
use super::entry::{job_submit, EXIT_GATE_REFUSED, EXIT_GATE_UNREACHABLE};
use super::gate::Gate;
use crate::node::{Grant, LogStream, NodeBackend, NodeError as ExecError, NodeEvent as ExecEvent};
use crate::protocol::{exit_status, ContainerState, ContainerStatus, LaunchContext};
use crate::resources::Resources;

/// How often Ray's job list is read while containers are live.
pub const POLL: Duration = Duration::from_millis(500);
/// How long `stop` waits past the grace for Ray to report the job ended.
pub const STOP_MARGIN: Duration = Duration::from_secs(10);

struct Entry {
    host: String,
    last: Option<JobInfo>,
    submitted: Instant,
}

/// The Ray backend: a Ray dashboard client, the gate, and the containers it runs.
pub struct RayLauncher {
    client: RayClient,
    gate: Gate,
    table: Mutex<HashMap<String, Entry>>,
    events: mpsc::UnboundedSender<ExecEvent>,
}

/// Container exit status and diagnostics for a terminal Ray job.
pub fn exit_of(info: &JobInfo) -> (i32, String) {
    let message = info.message.clone().unwrap_or_default();
    let short: String = message.lines().take(3).collect::<Vec<_>>().join(" | ");
    match (info.status, info.driver_exit_code) {
        (JobStatus::Succeeded, _) => (exit_status::SUCCESS, String::new()),
        (JobStatus::Stopped, _) => (exit_status::KILLED_BY_APPMASTER, "the Ray job was stopped".to_string()),
        (_, Some(c)) if c == EXIT_GATE_REFUSED => (
            exit_status::KILLED_BY_APPMASTER,
            "cancelled before it started (the gate was closed)".to_string(),
        ),
        (_, Some(c)) if c == EXIT_GATE_UNREACHABLE => (
            exit_status::ABORTED,
            "the Ray job could not reach gpuam's gate; the task did not run".to_string(),
        ),
        // Python reports a signal as −signal; shells as 128 + signal.
        (_, Some(c)) if c < 0 => (128 - c, format!("killed by signal {}", -c)),
        (_, Some(c)) => (c, format!("exited with {c}")),
        // No driver exit code: the supervisor or its node died (node lost).
        (_, None) => (exit_status::ABORTED, format!("the Ray job failed: {short}")),
    }
}

/// The container status a Ray job status stands for.
pub fn status_of(container_id: &str, info: Option<&JobInfo>) -> ContainerStatus {
    let (state, exit, diagnostics) = match info {
        Some(i) if i.status.is_terminal() => {
            let (e, d) = exit_of(i);
            (ContainerState::Complete, Some(e), d)
        }
        Some(i) if i.status == JobStatus::Pending => (
            ContainerState::Running,
            None,
            "the Ray job is pending (waiting for its node and GPUs)".to_string(),
        ),
        _ => (ContainerState::Running, None, String::new()),
    };
    ContainerStatus {
        container_id: container_id.to_string(),
        state,
        exit_status: exit,
        diagnostics,
        pid: None,
        started_ms: None,
    }
}

impl RayLauncher {
    /// Starts the poll task. Must be called within a tokio runtime.
    pub fn new(client: RayClient, gate: Gate, events: mpsc::UnboundedSender<ExecEvent>) -> Arc<Self> {
        let me = Arc::new(RayLauncher {
            client,
            gate,
            table: Mutex::new(HashMap::new()),
            events,
        });
        let weak = Arc::downgrade(&me);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(POLL);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(me) = weak.upgrade() else { return };
                me.poll_once().await;
            }
        });
        me
    }

    pub fn client(&self) -> &RayClient {
        &self.client
    }

    /// Submits the container's Ray job, named after the container, pinned to `host` and to
    /// exactly the granted GPUs. A retried submit of the same container is harmless.
    pub async fn start(
        &self,
        container_id: &str,
        host: &str,
        granted: &Resources,
        ctx: LaunchContext,
    ) -> Result<ContainerStatus, ExecError> {
        let grant = Grant {
            container_id: container_id.to_string(),
            app_id: String::new(),
            host: host.to_string(),
            resources: granted.clone(),
            user: String::new(),
            topology: None,
        };
        self.start_grant(&grant, ctx).await
    }

    /// [`RayLauncher::start`] for a grant (its user and its node's topology reach the
    /// container's environment, as on every backend).
    pub async fn start_grant(&self, grant: &Grant, ctx: LaunchContext) -> Result<ContainerStatus, ExecError> {
        let (container_id, host) = (grant.container_id.as_str(), grant.host.as_str());
        if !crate::node::executor::valid_container_id(container_id) {
            return Err(ExecError::StartFailed {
                id: container_id.into(),
                why: format!("`{container_id}` is not a valid container id"),
            });
        }
        {
            let mut t = self.table.lock();
            if t.contains_key(container_id) {
                return Err(ExecError::AlreadyStarted(container_id.into()));
            }
            t.insert(
                container_id.to_string(),
                Entry {
                    host: host.to_string(),
                    last: None,
                    submitted: Instant::now(),
                },
            );
        }
        let key = self.gate.open(container_id);
        let job = job_submit(grant, &ctx, &self.gate.url_of(container_id), &key);
        match self.client.submit(&job).await {
            Ok(_) => {
                tracing::info!(container = container_id, %host, "Ray job submitted");
                Ok(status_of(container_id, None))
            }
            Err(e) => {
                self.gate.close(container_id);
                self.table.lock().remove(container_id);
                Err(ExecError::StartFailed {
                    id: container_id.into(),
                    why: e.to_string(),
                })
            }
        }
    }

    /// Closes the gate and asks Ray to stop the job; waits until Ray reports it ended (or
    /// `grace` + [`STOP_MARGIN`] passed). The `Exited` event comes from the poll task.
    pub async fn stop(&self, container_id: &str, grace: Duration) -> Result<(), ExecError> {
        self.gate.close(container_id);
        if !self.table.lock().contains_key(container_id) {
            return Ok(());
        }
        if let Err(e) = self.client.stop(container_id).await {
            tracing::warn!(container = container_id, "Ray stop failed: {e}");
        }
        let until = Instant::now() + grace + STOP_MARGIN;
        while Instant::now() < until && self.table.lock().contains_key(container_id) {
            tokio::time::sleep(POLL).await;
        }
        Ok(())
    }

    /// Stops every container this backend runs.
    pub async fn stop_all(&self, grace: Duration) {
        let ids: Vec<String> = self.table.lock().keys().cloned().collect();
        futures::future::join_all(ids.iter().map(|id| self.stop(id, grace))).await;
    }

    /// What Ray last said of the container (`None`: not run by this backend).
    pub fn status(&self, container_id: &str) -> Option<ContainerStatus> {
        let t = self.table.lock();
        t.get(container_id).map(|e| status_of(container_id, e.last.as_ref()))
    }

    /// The job's log (Ray keeps stdout and stderr as one stream: `stderr` is empty).
    pub async fn read_log(
        &self,
        container_id: &str,
        stream: LogStream,
        tail: Option<u64>,
    ) -> Result<String, ExecError> {
        if stream == LogStream::Stderr {
            return Ok(String::new());
        }
        let text = self
            .client
            .logs(container_id)
            .await
            .map_err(|e| ExecError::Io(std::io::Error::other(e.to_string())))?;
        Ok(match tail {
            Some(n) if (n as usize) < text.len() => {
                let mut cut = text.len() - n as usize;
                while !text.is_char_boundary(cut) {
                    cut += 1;
                }
                text[cut..].to_string()
            }
            _ => text,
        })
    }

    /// After an RM restart: watch a container the RM's records say runs (its job keeps
    /// running in Ray; if it was still pending, the new gate does not know it and it will
    /// not run).
    pub fn reattach(&self, host: &str, container_id: &str) {
        self.table.lock().entry(container_id.to_string()).or_insert(Entry {
            host: host.to_string(),
            last: None,
            submitted: Instant::now(),
        });
    }

    /// Ids of the containers this backend runs on `host`, sorted.
    pub fn running(&self, host: &str) -> Vec<String> {
        let t = self.table.lock();
        let mut ids: Vec<String> = t
            .iter()
            .filter(|(_, e)| e.host == host)
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        ids
    }

    /// One look at Ray's jobs: records their statuses and ends the containers whose job
    /// ended. A job Ray does not list (it lost its state) ends its container after a minute.
    async fn poll_once(&self) {
        if self.table.lock().is_empty() {
            return;
        }
        let jobs = match self.client.jobs().await {
            Ok(j) => j,
            Err(e) => {
                tracing::warn!("cannot list Ray jobs: {e}");
                return;
            }
        };
        let mut ended = Vec::new();
        {
            let mut t = self.table.lock();
            for (id, e) in t.iter_mut() {
                match jobs.get(id) {
                    Some(info) => {
                        if info.status.is_terminal() {
                            let (code, diag) = exit_of(info);
                            ended.push((id.clone(), code, diag));
                        }
                        e.last = Some(info.clone());
                    }
                    None if e.submitted.elapsed() > Duration::from_secs(60) => {
                        ended.push((
                            id.clone(),
                            exit_status::ABORTED,
                            "Ray does not know this job".to_string(),
                        ));
                    }
                    None => {}
                }
            }
            for (id, _, _) in &ended {
                t.remove(id);
            }
        }
        for (id, code, diag) in ended {
            self.gate.forget(&id);
            tracing::info!(container = %id, exit = code, "Ray job ended");
            let _ = self.events.send(ExecEvent::Exited {
                container_id: id,
                exit_status: code,
                diagnostics: diag,
                cause: None,
            });
        }
    }
}

/// The node interface (DESIGN.md §9) over the methods above: every host is a Ray node.
impl NodeBackend for RayLauncher {
    fn kind(&self) -> &'static str {
        "ray"
    }

    fn start(&self, grant: Grant, ctx: LaunchContext) -> BoxFuture<'_, Result<ContainerStatus, ExecError>> {
        Box::pin(async move { RayLauncher::start_grant(self, &grant, ctx).await })
    }

    fn stop<'a>(
        &'a self,
        _host: &'a str,
        container_id: &'a str,
        grace: Duration,
    ) -> BoxFuture<'a, Result<(), ExecError>> {
        Box::pin(RayLauncher::stop(self, container_id, grace))
    }

    fn status<'a>(&'a self, _host: &'a str, container_id: &'a str) -> BoxFuture<'a, Option<ContainerStatus>> {
        Box::pin(async move { RayLauncher::status(self, container_id) })
    }

    fn read_log<'a>(
        &'a self,
        _host: &'a str,
        container_id: &'a str,
        stream: LogStream,
        tail: Option<u64>,
    ) -> BoxFuture<'a, Result<String, ExecError>> {
        Box::pin(RayLauncher::read_log(self, container_id, stream, tail))
    }

    fn reattach(&self, host: &str, container_id: &str) {
        RayLauncher::reattach(self, host, container_id)
    }

    fn running(&self, host: &str) -> Vec<String> {
        RayLauncher::running(self, host)
    }

    fn forget(&self, container_id: &str) {
        self.gate.forget(container_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(status: JobStatus, code: Option<i32>, message: &str) -> JobInfo {
        JobInfo {
            submission_id: Some("c".into()),
            status,
            message: Some(message.into()),
            driver_exit_code: code,
            driver_node_id: None,
            start_time: None,
            end_time: None,
        }
    }

    #[test]
    fn ray_job_endings_map_to_container_exits() {
        assert_eq!(exit_of(&info(JobStatus::Succeeded, Some(0), "")).0, 0);
        assert_eq!(exit_of(&info(JobStatus::Failed, Some(3), "")).0, 3);
        assert_eq!(exit_of(&info(JobStatus::Failed, Some(-15), "")).0, 143);
        assert_eq!(
            exit_of(&info(JobStatus::Stopped, None, "")).0,
            exit_status::KILLED_BY_APPMASTER
        );
        assert_eq!(
            exit_of(&info(JobStatus::Failed, Some(EXIT_GATE_REFUSED), "")).0,
            exit_status::KILLED_BY_APPMASTER
        );
        let (code, diag) = exit_of(&info(JobStatus::Failed, None, "Job supervisor actor died\nnode dead"));
        assert_eq!(code, exit_status::ABORTED);
        assert!(diag.contains("supervisor actor died"), "{diag}");
    }

    #[test]
    fn pending_and_running_jobs_are_running_containers() {
        let s = status_of("c", Some(&info(JobStatus::Pending, None, "")));
        assert_eq!(s.state, ContainerState::Running);
        assert!(s.diagnostics.contains("pending"));
        assert_eq!(status_of("c", None).state, ContainerState::Running);
        let s = status_of("c", Some(&info(JobStatus::Failed, Some(2), "")));
        assert_eq!((s.state, s.exit_status), (ContainerState::Complete, Some(2)));
    }
}
