//! The application master: one per job. Registers with the RM, keeps the node view,
//! places and requests one task at a time, launches, watches, retries, finishes.
//!
//! The parts, each with one job:
//! - [`machine`]: the job machine — the task table and every transition (placement round,
//!   asks and the allocate answer, launches, exits and retries, preemption, the gang rule,
//!   resync and restart adoption), pure, one entry `step(input, now) -> effects + events`;
//! - [`driver`]: the one async loop that carries the machine's effects out against the RM,
//!   feeds the answers back and owns the timing and the one back-off ([`backoff`]);
//! - [`publish`]: turns the machine's events into the status hub's updates ([`status`]),
//!   which the dashboard observes;
//! - [`plan_rm`]: an in-memory RM that grants every ask as asked, so `gpuam plan` runs the
//!   same machine up to its first launch;
//! - pure rules beside it: [`exits`] (exit classes, retry and completion policy),
//!   [`job_retry`], [`queueing`] (waiting demand, preemption notices), [`tasks`] (a task and
//!   its container environment), [`pai_env`]; and the RM's HTTP client, [`rm_client`].
//!
//! The binary wires them (`cli::am`: the RM client, the dashboard, the signals, the exit code).

pub mod backoff;
pub mod driver;
pub mod exits;
pub mod job_retry;
pub mod machine;
pub mod node_page;
pub mod pai_env;
pub mod plan_rm;
pub mod publish;
pub mod queueing;
pub mod rm_client;
pub mod status;
pub mod tasks;

use std::net::SocketAddr;

use crate::cluster::ClusterView;
use crate::config::Settings;
use crate::select::Selector;
use crate::spec::JobSpec;

/// What `gpuam am` needs.
#[derive(Clone, Debug)]
pub struct AmOptions {
    pub job: JobSpec,
    pub rm_url: String,
    pub app_id: String,
    pub token: String,
    /// The dashboard's address.
    pub listen: SocketAddr,
    pub settings: Settings,
    /// Token for mutating dashboard calls; random when not given.
    pub job_token: Option<String>,
}

/// A fresh random token (see [`crate::auth::new_token`]).
pub fn random_token() -> String {
    crate::auth::new_token()
}

/// A gang holds everything it is given until all of it is there, so a gang that could
/// not be placed even on the empty cluster would wait and time out forever: say so at
/// once instead. (Tasks of other jobs can finish; the cluster's own size cannot grow.)
pub fn gang_never_fits(job: &JobSpec, nodes: &[crate::cluster::Node], settings: &Settings) -> Option<String> {
    if !job.gang {
        return None;
    }
    let empty: Vec<_> = nodes
        .iter()
        .cloned()
        .map(|mut n| {
            n.set_used(crate::resources::Resources::default());
            n
        })
        .collect();
    let mut select = settings.select.clone();
    select.seed = Some(0);
    let plan = crate::select::plan_job(&Selector::new(ClusterView::new(empty), select), job);
    plan.unplaced.first().map(|u| {
        format!(
            "the gang of {} tasks cannot fit this cluster even when it is empty: {} of them find no place \
             (first: {}/{}: {})",
            job.total_tasks(),
            plan.unplaced.len(),
            u.role,
            u.index,
            u.reason
        )
    })
}
