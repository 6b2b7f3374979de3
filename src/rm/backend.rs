//! Which node backend runs the RM's containers: this process's executor (simulated nodes of
//! a cluster file) or a Ray cluster. A stand-in for the node interface of DESIGN.md §9 until
//! it lands; every call the RM makes on a node goes through here.

use std::sync::Arc;
use std::time::Duration;

use crate::protocol::{ContainerStatus, LaunchContext};
use crate::ray::launcher::RayLauncher;
use crate::resources::Resources;
use crate::rm::executor::{ExecError, Executor, LogStream};

pub enum Nodes {
    Local(Executor),
    Ray(Arc<RayLauncher>),
}

impl Nodes {
    /// Starts a granted container; the pid when it runs on this machine.
    pub async fn start(
        &self,
        id: &str,
        host: &str,
        granted: &Resources,
        ctx: LaunchContext,
    ) -> Result<Option<u32>, ExecError> {
        match self {
            Nodes::Local(x) => x.start(id, host, granted, ctx).map(Some),
            Nodes::Ray(r) => r.start(id, host, granted, ctx).await.map(|_| None),
        }
    }

    pub async fn stop(&self, id: &str, grace: Duration) -> Result<(), ExecError> {
        match self {
            Nodes::Local(x) => x.stop(id, grace).await,
            Nodes::Ray(r) => r.stop(id, grace).await,
        }
    }

    pub async fn stop_all(&self, grace: Duration) {
        match self {
            Nodes::Local(x) => x.stop_all(grace).await,
            Nodes::Ray(r) => r.stop_all(grace).await,
        }
    }

    pub fn status(&self, id: &str) -> Option<ContainerStatus> {
        match self {
            Nodes::Local(x) => x.status(id),
            Nodes::Ray(r) => r.status(id),
        }
    }

    pub async fn read_log(&self, id: &str, stream: LogStream, tail: Option<u64>) -> Result<String, ExecError> {
        match self {
            Nodes::Local(x) => x.read_log(id, stream, tail),
            Nodes::Ray(r) => r.read_log(id, stream, tail).await,
        }
    }

    pub fn reattach(&self, host: &str, id: &str) {
        match self {
            Nodes::Local(x) => x.reattach(id),
            Nodes::Ray(r) => r.reattach(host, id),
        }
    }
}
