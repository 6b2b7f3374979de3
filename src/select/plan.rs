//! Planning a whole job (`gpuam plan`): the AM's placement round ([`PlacementRound`]) over the
//! job with nothing placed, each step recorded, with the port labels and the next-best node.

use serde::Serialize;

use super::placement::PlacementRound;
use super::{Alternative, Outcome, Placement, SelectionTrace, Selector};
use crate::resources::{format_hundredths, mask_hex, mask_indices, PortSet};
use crate::spec::{JobSpec, TaskResources};

/// A task that found a place.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PlannedTask {
    pub role: String,
    pub index: u32,
    pub host: String,
    pub rack: String,
    /// GPU indices, ascending.
    pub gpus: Vec<u32>,
    /// The mask as a hex string ("0x3").
    pub gpu_mask: String,
    /// A fractional task's share of its GPU ("0.25"); `None` for whole GPUs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_share: Option<String>,
    /// Custom resources the task holds.
    #[serde(skip_serializing_if = "crate::resources::CustomResources::is_empty")]
    pub resources: crate::resources::CustomResources,
    /// Ports by label, in the spec's label order.
    pub ports: Vec<(String, Vec<u16>)>,
    pub gpu_tier: u8,
    pub gpu_tier_ideal: bool,
    /// Tier of the job's GPUs on this host once this task is there (the union).
    pub union_tier: u8,
    /// The NIC(s) nearest its GPUs, where the host's topology lists NICs.
    pub nic: Option<String>,
    /// The AM first waits up to this many seconds for a set of the node's ideal tier before
    /// it takes this one (below that tier while other jobs hold GPUs; `select.topology_wait_sec`).
    pub topology_wait_sec: Option<u64>,
    /// The next-best node for this task and the criterion on which it lost.
    pub next_best: Option<Alternative>,
    #[serde(skip)]
    pub placement: Placement,
}

/// A task that found none.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UnplacedTask {
    pub role: String,
    pub index: u32,
    pub reason: String,
    /// True when it can never fit this cluster (not merely "not now").
    pub impossible: bool,
    pub trace: SelectionTrace,
}

/// The plan of a whole job.
#[derive(Clone, Debug, PartialEq, Serialize, Default)]
pub struct JobPlan {
    pub placements: Vec<PlannedTask>,
    pub unplaced: Vec<UnplacedTask>,
}

impl JobPlan {
    /// Adds task `index` of `role` as its selection left it: placed (with its port labels, the
    /// next-best node and the topology wait it takes first, `wait_sec`), or not and why.
    pub fn record(&mut self, role: &crate::spec::TaskRole, index: u32, sel: super::Selection, wait_sec: u64) {
        let impossible = matches!(sel.outcome, Outcome::Impossible { .. });
        match sel.outcome {
            Outcome::Placed(p) => self.placements.push(PlannedTask {
                role: role.name.clone(),
                index,
                host: p.host.clone(),
                rack: p.rack.clone(),
                gpus: mask_indices(p.resources.gpu_mask),
                gpu_mask: mask_hex(p.resources.gpu_mask),
                gpu_share: p.resources.gpu_share().map(format_hundredths),
                resources: p.resources.custom.clone(),
                ports: assign_port_labels(&role.resources, &p.resources.ports).unwrap_or_default(),
                gpu_tier: p.gpu_tier,
                gpu_tier_ideal: p.gpu_tier_ideal,
                union_tier: p.union_tier,
                nic: p.nic.clone(),
                topology_wait_sec: (p.may_improve && wait_sec > 0).then_some(wait_sec),
                next_best: sel.trace.alternative.clone(),
                placement: p,
            }),
            Outcome::NotNow { reason, .. } | Outcome::Impossible { reason } => self.unplaced.push(UnplacedTask {
                role: role.name.clone(),
                index,
                reason,
                impossible,
                trace: sel.trace,
            }),
        }
    }
}

/// Splits a container's ports among the role's labels (reference/frameworklauncher.md
/// §4.4): static labels take their own ranges, dynamic labels take the lowest of the
/// rest in label order. `None` when the ports do not cover the request.
pub fn assign_port_labels(res: &TaskResources, ports: &PortSet) -> Option<Vec<(String, Vec<u16>)>> {
    let statics = res.static_ports();
    if !statics.is_subset(ports) {
        return None;
    }
    let dynamic_pool = ports.subtract(&statics);
    let mut rest = dynamic_pool.iter();
    let mut out = Vec::with_capacity(res.ports.len());
    for p in &res.ports {
        let list: Vec<u16> = match p.start {
            Some(s) => (0..p.count).map(|i| s + i).collect(),
            None => rest.by_ref().take(usize::from(p.count)).collect(),
        };
        if list.len() != usize::from(p.count) {
            return None;
        }
        out.push((p.label.clone(), list));
    }
    Some(out)
}

/// Places every task of `job`, booking each placement on the selector's view: one
/// [`PlacementRound`] over a job with nothing placed, driven exactly as the AM drives it
/// (the AM stops at an impossible task, since its job fails; the plan goes on to show the rest).
/// A task the AM would first hold back for a better GPU tier is placed where it goes once that
/// wait ends, with the wait noted (`topology_wait_sec`).
pub fn plan_job(selector: &Selector, job: &JobSpec) -> JobPlan {
    let mut round = PlacementRound::fresh(job);
    let mut plan = JobPlan::default();
    let wait_sec = selector.settings().topology_wait_sec;
    while let Some((ri, index)) = round.next_task() {
        let sel = round.place(selector, (ri, index)).selection;
        plan.record(&job.task_roles[ri], index, sel, wait_sec);
    }
    plan
}
