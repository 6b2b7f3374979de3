//! The in-process node backend: the simulated nodes of a cluster file (and `gpuam run`)
//! run their containers on this machine, in this process's [`Executor`]. Every host it
//! serves shares the one executor; container ids are unique across hosts.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt as _;
use tokio::sync::mpsc;

use super::executor::{Executor, ExecutorOptions, LogStream};
use super::turns::Turns;
use super::{Grant, NodeBackend, NodeError, NodeEvent};
use crate::protocol::{ContainerState, ContainerStatus, LaunchContext};

/// Runs the containers of simulated hosts on this machine.
pub struct InProcessNode {
    executor: Arc<Executor>,
    /// Starts at once: no more than the machine has cores, taken round-robin across
    /// applications so every job's first task starts early ([`Turns`]).
    starting: Turns,
}

impl InProcessNode {
    /// Container directories go under `root`; events go to `events`.
    pub fn new(root: PathBuf, events: mpsc::UnboundedSender<NodeEvent>, opts: ExecutorOptions) -> Self {
        let cores = std::thread::available_parallelism().map_or(2, usize::from);
        InProcessNode {
            executor: Arc::new(Executor::with_options(root, events, opts)),
            starting: Turns::new(cores.clamp(1, 8)),
        }
    }

    /// The executor itself (shutdown: `stop_all`).
    pub fn executor(&self) -> &Arc<Executor> {
        &self.executor
    }
}

impl NodeBackend for InProcessNode {
    fn kind(&self) -> &'static str {
        "in-process"
    }

    fn start(&self, grant: Grant, ctx: LaunchContext) -> BoxFuture<'_, Result<ContainerStatus, NodeError>> {
        // A start writes files, makes a cgroup and a process: off the async workers, so
        // the RM serving the simulated nodes keeps answering while many containers start
        // (issue 29).
        let (executor, starting) = (self.executor.clone(), self.starting.clone());
        async move {
            let id = grant.container_id.clone();
            let turn = starting.take(&grant.app_id).await;
            let pid = tokio::task::spawn_blocking(move || {
                let _turn = turn;
                executor.start_as(
                    &grant.container_id,
                    &grant.host,
                    &grant.resources,
                    ctx,
                    grant.topology.as_deref(),
                    Some(grant.user.as_str()).filter(|u| !u.is_empty()),
                )
            })
            .await
            .map_err(|e| NodeError::StartFailed {
                id: id.clone(),
                why: e.to_string(),
            })??;
            Ok(ContainerStatus {
                container_id: id,
                state: ContainerState::Running,
                exit_status: None,
                diagnostics: String::new(),
                pid: Some(pid),
                started_ms: Some(crate::protocol::now_ms()),
            })
        }
        .boxed()
    }

    fn stop<'a>(
        &'a self,
        _host: &'a str,
        container_id: &'a str,
        grace: Duration,
    ) -> BoxFuture<'a, Result<(), NodeError>> {
        self.executor.stop(container_id, grace).boxed()
    }

    fn status<'a>(&'a self, _host: &'a str, container_id: &'a str) -> BoxFuture<'a, Option<ContainerStatus>> {
        futures::future::ready(self.executor.status(container_id)).boxed()
    }

    fn read_log<'a>(
        &'a self,
        _host: &'a str,
        container_id: &'a str,
        stream: LogStream,
        tail: Option<u64>,
    ) -> BoxFuture<'a, Result<String, NodeError>> {
        futures::future::ready(self.executor.read_log(container_id, stream, tail)).boxed()
    }

    fn reattach(&self, _host: &str, container_id: &str) {
        self.executor.reattach(container_id);
    }

    fn running(&self, _host: &str) -> Vec<String> {
        self.executor.running_ids()
    }

    fn notify_preemption<'a>(
        &'a self,
        _host: &'a str,
        container_id: &'a str,
        deadline_ms: u64,
        reason: &'a str,
    ) -> BoxFuture<'a, Result<(), NodeError>> {
        futures::future::ready(self.executor.notify_preemption(container_id, deadline_ms, reason)).boxed()
    }

    fn forget(&self, container_id: &str) {
        self.executor.forget(container_id);
    }
}
