//! The node component: everything that runs containers on a machine, and the one
//! interface through which the RM reaches it (DESIGN.md §9).
//!
//! # The node interface: [`NodeBackend`]
//!
//! The RM never runs a process itself. It decides (in its ledger) which container may run
//! where with exactly which GPUs, ports, CPU and memory, and then hands the container to a
//! node backend. Every backend implements the same small trait:
//!
//! | call | meaning |
//! |------|---------|
//! | [`NodeBackend::start`] | run the task of a granted container ([`Grant`]: id, app, host, exact resources) with its [`LaunchContext`] |
//! | [`NodeBackend::stop`]  | stop it and everything it started (daemons included); returns once it is dead or the backend gave up waiting |
//! | [`NodeBackend::status`] | what the node knows of it (`None`: unknown there) |
//! | [`NodeBackend::read_log`] | its captured stdout / stderr |
//! | [`NodeBackend::reattach`] | after an RM restart: watch a container the RM's records say still runs |
//! | [`NodeBackend::running`] | the ids the node runs now |
//! | [`NodeBackend::forget`] | drop a completed container from memory (its files stay) |
//! | [`NodeBackend::notify_preemption`] | tell a running container it is being taken back (creates its `GPUAM_PREEMPT_FILE`) |
//!
//! and reports back through one event stream, an `mpsc::UnboundedSender<NodeEvent>` it is
//! constructed with:
//!
//! - [`NodeEvent::Exited`] — sent once per started container, and **only when the container is
//!   really dead**: its cgroup (or subreaper shim, or process group) is empty, or the engine says the job ended.
//!   This is the only event on which the RM returns the container's GPUs and ports to the
//!   ledger, so a backend must never send it early (DESIGN.md §9's invariant).
//!
//! Host liveness (registration, heartbeats, LOST after `rm.node_expiry_sec`) is the RM's
//! business for agents and is not part of the trait: a backend that loses a node simply never
//! sends `Exited` for its containers, and the RM keeps their resources held.
//!
//! Implementations:
//! - [`InProcessNode`] (`local`): the simulated nodes of a cluster file and `gpuam run`; runs
//!   containers on this machine with the [`executor::Executor`];
//! - `remote::AgentNodes`: node agents (`gpuam node`) on other machines, reached over HTTP
//!   with per-container tokens signed by the RM;
//! - a Ray backend (branch `ray`) implements the same trait.
//!
//! The trait is dyn-compatible (`Arc<dyn NodeBackend>`): async calls return boxed futures.

pub mod agent;
pub mod answer;
pub mod bind_guard;
pub mod bounds;
pub mod bpf;
pub mod cgroup;
pub mod contract;
pub mod devices;
pub mod executor;
pub mod gpu_discovery;
pub mod identity;
pub mod image;
pub mod local;
pub mod procs;
pub mod remote;
pub mod shim;
pub mod start_gate;
pub mod token;
pub mod turns;
pub mod wire;

use std::time::Duration;

use futures::future::BoxFuture;

use crate::protocol::{ContainerStatus, LaunchContext};
use crate::resources::Resources;

pub use executor::LogStream;
pub use local::InProcessNode;

/// A container the RM granted, exactly as granted: what a node needs to start it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Grant {
    pub container_id: String,
    pub app_id: String,
    pub host: String,
    pub resources: Resources,
    /// Who submitted the job (the RM's user of its credential): the node runs the task as
    /// that user's own uid ([`identity`]). Empty from an older RM.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub user: String,
    /// The node's GPU topology as the RM knows it (NICs, CPU affinity), for the task's
    /// locality; in-process only: an agent uses the topology it found itself.
    #[serde(skip)]
    pub topology: Option<std::sync::Arc<crate::topology::Topology>>,
}

/// Something that happened on a node, pushed to the RM.
#[derive(Clone, Debug, PartialEq)]
pub enum NodeEvent {
    /// The container is dead: no process of it is left (its cgroup is empty). Its
    /// resources may be granted again.
    Exited {
        container_id: String,
        exit_status: i32,
        diagnostics: String,
        /// A bound of its own it went past (the diagnostics lead with its words).
        cause: Option<crate::protocol::EndCause>,
    },
}

/// Node failures (the RM maps each to an HTTP status).
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("container {0} is not known to this node")]
    UnknownContainer(String),
    #[error("container {0} was already started")]
    AlreadyStarted(String),
    #[error("could not start container {id}: {why}")]
    StartFailed { id: String, why: String },
    #[error("node {host} cannot be reached: {why}")]
    Unreachable { host: String, why: String },
    #[error("node refused: {0}")]
    Refused(String),
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

/// The node interface (see the module doc). Implementations are cheap to share behind
/// an `Arc` and must be called within a tokio runtime.
pub trait NodeBackend: Send + Sync + 'static {
    /// A short name for logs: "in-process", "agent", "ray".
    fn kind(&self) -> &'static str;

    /// Whether a failed start may still have started the container: true for a node
    /// behind a network whose answer can be lost after it acted. Such a node must list
    /// the containers it runs (agents: every heartbeat), so that one the RM holds after
    /// such a start is freed once the node says it is dead or does not run it.
    fn start_may_survive(&self, _error: &NodeError) -> bool {
        false
    }

    /// Starts the container's commands with exactly the granted resources. Exactly one
    /// [`NodeEvent::Exited`] follows a successful start; a failed start sends none.
    fn start(&self, grant: Grant, ctx: LaunchContext) -> BoxFuture<'_, Result<ContainerStatus, NodeError>>;

    /// Stops the container and everything it started: SIGTERM, then after `grace` a kill
    /// of the whole container. Idempotent. Returns once the container is dead (or the
    /// backend gave up waiting; the `Exited` event still only comes when it is dead).
    fn stop<'a>(
        &'a self,
        host: &'a str,
        container_id: &'a str,
        grace: Duration,
    ) -> BoxFuture<'a, Result<(), NodeError>>;

    /// The node's view of the container; `None` when the node does not know it.
    fn status<'a>(&'a self, host: &'a str, container_id: &'a str) -> BoxFuture<'a, Option<ContainerStatus>>;

    /// The end of a captured stream (`tail`: at most that many bytes).
    fn read_log<'a>(
        &'a self,
        host: &'a str,
        container_id: &'a str,
        stream: LogStream,
        tail: Option<u64>,
    ) -> BoxFuture<'a, Result<String, NodeError>>;

    /// After an RM restart: takes a container the RM's records say runs back under
    /// watch; one `Exited` follows when it is (or already was) dead.
    fn reattach(&self, host: &str, container_id: &str);

    /// Ids of the containers running on `host` now, sorted.
    fn running(&self, host: &str) -> Vec<String>;

    /// Drops a completed container from memory (its files stay).
    fn forget(&self, container_id: &str);

    /// Tells a running container that the RM is taking it back by `deadline_ms`
    /// (milliseconds since the epoch), so its task may checkpoint: creates the file its
    /// `GPUAM_PREEMPT_FILE` names. A backend without such a file (Ray) does nothing: the
    /// task then only gets SIGTERM and the stop grace at the end.
    fn notify_preemption<'a>(
        &'a self,
        _host: &'a str,
        _container_id: &'a str,
        _deadline_ms: u64,
        _reason: &'a str,
    ) -> BoxFuture<'a, Result<(), NodeError>> {
        Box::pin(async { Ok(()) })
    }
}
