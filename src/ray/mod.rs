//! The Ray node backend (DESIGN.md §9): gpuam's placement on an existing Ray cluster.
//!
//! `gpuam rm --backend ray --ray-address http://HOST:8265` builds its node view from the Ray
//! cluster's nodes and runs every granted container on the Ray node it was granted on,
//! pinned to exactly the granted GPUs through per-GPU custom resources: through one
//! long-lived driver with a placement group per container (`driver`, the default), or as
//! one Ray job per container (`launcher`, `--ray-launch jobs`).
//!
//! - `scheme`: how a Ray node describes itself (resources and labels), both ways; pure.
//! - `entry`: what runs one container there (environment, Ray resources, node script) and
//!   its Ray job (entrypoint with its cancel gate, submit body); pure.
//! - `client`: the Ray dashboard's REST API.
//! - `gate`: the cancel gate a job's entrypoint asks before it runs anything.
//! - `launcher`: submits, stops and watches the jobs; ends containers when Ray says so
//!   (`--ray-launch jobs`: one Ray job per container).
//! - `driver`: one long-lived Ray driver with a placement group per container
//!   (`--ray-launch driver`); `driver.py` is its Python side.
//! - `nodes`: the node view from Ray and the node-state watch.
//! - `args`: `gpuam ray-node-args`.
//!
//! Supported Ray version: see [`RAY_VERSION`] (scripts/ray-setup.sh installs it).

pub mod args;
pub mod client;
pub mod driver;
pub mod entry;
pub mod gate;
pub mod launcher;
pub mod nodes;
pub mod scheme;

/// The Ray version this backend is tested with.
pub const RAY_VERSION: &str = "2.60.0";

/// How the Ray backend runs containers.
#[derive(Clone, Debug)]
pub enum Launch {
    /// One Ray job per container through the Jobs REST API (`launcher`).
    Jobs,
    /// One long-lived driver, a placement group per container (`driver`).
    Driver(driver::DriverConfig),
}

/// The Ray backend as `gpuam rm --backend ray` configured it.
#[derive(Clone, Debug)]
pub struct Backend {
    pub client: client::RayClient,
    /// The cancel gate that Ray jobs ask (used by [`Launch::Jobs`]).
    pub gate: gate::Gate,
    pub launch: Launch,
}

impl Backend {
    /// Starts it (within a tokio runtime); its containers' ends go to `events`.
    pub fn start(
        self,
        events: tokio::sync::mpsc::UnboundedSender<crate::node::NodeEvent>,
    ) -> std::sync::Arc<dyn crate::node::NodeBackend> {
        match self.launch {
            Launch::Jobs => launcher::RayLauncher::new(self.client, self.gate, events),
            Launch::Driver(cfg) => driver::RayDriver::new(cfg, events),
        }
    }
}
