//! The stages of the select pipeline, each a small named unit over the candidate list.
//!
//! Order (and why):
//! 1. `candidates`  — only RUNNING nodes can take containers.
//! 2. `node-label`  — partitions are hard boundaries (YARN exclusive partitions).
//! 3. `gpu-type`    — a hard user constraint, never relaxed.
//! 4. `none-gpu`    — keeps GPU nodes for GPU jobs; cheap, job-level.
//! 5. `ports`       — decides how ports are chosen: static or reused ports are part of the
//!    request; dynamic ports are counted per node and drawn on the picked node.
//! 6. `resources`   — the one shortfall rule ([`crate::resources::Resources::shortfall`]):
//!    GPUs (count, explicit mask or a share of one GPU), CPU, memory, custom resources,
//!    ports against total − used − requested
//!    (− recently tried); also counts how many of the job's unplaced tasks each node could hold.
//! 7. `rack-policy` — racks holding the job are criterion 3 of the order (no node dropped).
//! 8. `job-packing` — the placement order of `objective.rs`; keeps the best
//!    `waiting tasks × candidateNodesFactor`.
//! 9. `topology-wait` — only when it holds the task back: the best set is below its node's
//!    ideal tier while other jobs' GPUs may free a better one, and the task may still wait
//!    (`select.topology_wait_sec`; docs/DESIGN-NOTES.md, "Topology wait"). Last, because it
//!    judges the winner, not each node.
//!
//! Stages 1–4 and the GPU and CPU parts of 6 are decided per index bucket (`index.rs`), so
//! their counts come from the index; the rest is decided on the nodes the walk visits, in
//! rank order (`walk.rs`). The pick (best candidate), the topology wait, the final port
//! choice and the placement follow in `outcome.rs`; `Selector::select` chains the steps.

use std::cmp::Reverse;

use super::feasible::{self, Why};
use super::objective::{self, GpuPick, RankKey};
use super::{Cx, PortPlan};
use crate::cluster::Node;
use crate::resources::Resources;

/// What the per-node filters look at: the same for every node of an index bucket.
pub(crate) type Facts<'a> = feasible::NodeFacts<'a>;

/// A stage that judges each node on its own, from its [`Facts`]; decided once per index
/// bucket, each still keeping its own trace, in order. Each is one part of the one
/// feasibility rule (`feasible.rs`), whose [`Why`] says whether it is "never".
pub(crate) trait NodeFilter: Sync {
    fn name(&self) -> &'static str;
    fn check(&self, cx: &Cx<'_>, node: &Facts<'_>) -> Result<(), Why>;
}

pub(crate) struct RunningNodes;
impl NodeFilter for RunningNodes {
    fn name(&self) -> &'static str {
        "candidates"
    }
    fn check(&self, _cx: &Cx<'_>, node: &Facts<'_>) -> Result<(), Why> {
        feasible::running(node)
    }
}

pub(crate) struct NodeLabel;
impl NodeFilter for NodeLabel {
    fn name(&self) -> &'static str {
        "node-label"
    }
    fn check(&self, cx: &Cx<'_>, node: &Facts<'_>) -> Result<(), Why> {
        // A task without a label belongs to the default (unlabelled) partition, as in
        // YARN; the original let it onto labelled nodes (frameworklauncher.md §10.13).
        feasible::partition(&cx.task, node)
    }
}

pub(crate) struct GpuType;
impl NodeFilter for GpuType {
    fn name(&self) -> &'static str {
        "gpu-type"
    }
    fn check(&self, cx: &Cx<'_>, node: &Facts<'_>) -> Result<(), Why> {
        feasible::gpu_type(&cx.task, node)
    }
}

pub(crate) struct NoneGpu;
impl NodeFilter for NoneGpu {
    fn name(&self) -> &'static str {
        "none-gpu"
    }
    fn check(&self, cx: &Cx<'_>, node: &Facts<'_>) -> Result<(), Why> {
        feasible::none_gpu(&cx.task, node)
    }
}

/// How the task's ports are decided: static or reused ports are part of the request;
/// dynamic ones are drawn on the picked node (so no pool common to all candidates has to be
/// computed over every node).
pub(crate) fn port_plan(cx: &Cx<'_>) -> (PortPlan, Option<String>) {
    let res = cx.ask.resources;
    if let Some(reuse) = cx.ask.reuse_ports {
        return (
            PortPlan::Fixed(reuse.clone()),
            Some(format!("samePortAllocation: reusing {reuse}")),
        );
    }
    let statics = res.static_ports();
    let dynamic = res.dynamic_port_count();
    if dynamic == 0 {
        return (PortPlan::Fixed(statics), None);
    }
    let note = format!(
        "{dynamic} dynamic port(s) at or above {} drawn on the chosen node",
        cx.settings.container_min_port
    );
    (PortPlan::PerNode { statics, dynamic }, Some(note))
}

/// The resource check of one node (stage 6) and its rank key (stage 8) with its GPU pick.
/// `Err` carries the shortfall's reason.
pub(crate) fn score(
    cx: &mut Cx<'_>,
    req: &Resources,
    node: &Node,
    topo_id: u32,
    avail: &Resources,
    rack_holds_job: bool,
) -> Result<(RankKey, GpuPick, u32), &'static str> {
    let (dynamic, min_port) = match &cx.ports {
        PortPlan::PerNode { dynamic, .. } => (*dynamic, cx.settings.container_min_port),
        PortPlan::Fixed(_) => (0, 0),
    };
    if let Some(s) = req.shortfall_with_dynamic(avail, dynamic, min_port) {
        return Err(s.reason());
    }
    let need = cx.demand.remaining_tasks().max(1);
    let fits = cx
        .demand
        .capacity_in(avail, cx.settings.container_min_port)
        .max(1)
        .min(need);
    let held = cx.demand.held_on(&node.host);
    let here = cx.demand.tasks_on(&node.host);
    let affinity = here > 0;
    // The job spans nodes: it has tasks elsewhere, or not all its unplaced tasks fit here.
    let spread = cx.demand.tasks_elsewhere(&node.host) > 0 || fits < need;
    let Some(pick) = pick_gpus(cx, topo_id, node.topology.as_deref(), avail, held, fits, spread) else {
        return Err("no GPU set of the requested size on this node");
    };
    let mut key = rank_key(
        affinity,
        fits,
        rack_holds_job,
        &pick,
        avail,
        node.total().gpu_count(),
        cx.others_wait,
        cx.ends_by_ms.is_some(),
    );
    if let Some(ends) = cx.ends_by_ms {
        key.drain = drain_term(ends, node.drain_by_ms);
    }
    Ok((key, pick, fits))
}

/// The task's GPUs on a node with `avail` free, where the job holds `held`, `fits` of its
/// tasks go and `spread` says whether it spans nodes: an explicit mask as given, a share by
/// best fit ([`objective::pick_share`]), whole GPUs by the order's search among the wholly
/// free ones (memoised).
#[inline]
pub(crate) fn pick_gpus(
    cx: &mut Cx<'_>,
    topo_id: u32,
    topo: Option<&crate::topology::Topology>,
    avail: &Resources,
    held: crate::resources::GpuMask,
    fits: u32,
    spread: bool,
) -> Option<GpuPick> {
    let r = cx.ask.resources;
    match (r.gpu_share, r.gpu_mask) {
        (Some(share), fixed) => objective::pick_share(topo, avail, held, share, fixed.map(|m| m.trailing_zeros())),
        (None, Some(m)) => Some(objective::given(topo, avail.whole_gpu_mask(), held, m, spread)),
        (None, None) => cx.choices.pick(
            topo_id,
            topo,
            avail.whole_gpu_mask(),
            held,
            objective::Want {
                k: r.gpus,
                f: fits,
                spread,
            },
        ),
    }
}

/// The drain term of a node (criterion 6d): the minutes by which a task that has ended by
/// `ends.1` (the clock reading `ends.0`) pushes back the time the node is whole again,
/// `drain_by_ms` (its running containers' declared ends; 0: nothing runs). Unknown: 0.
pub(crate) fn drain_term(ends: (u64, u64), drain_by_ms: Option<u64>) -> u32 {
    let (now, end) = ends;
    drain_by_ms.map_or(0, |d| {
        let past = end.saturating_sub(d.max(now)) / 60_000;
        u32::try_from(past).unwrap_or(u32::MAX)
    })
}

/// The key of the order for one node (see `objective.rs`); `others_wait`: other jobs wait
/// behind this one (queue pressure: best fit in the NVLink groups and node packing right after
/// the tiers, the ideal weight after packing); `declared`: the task declares its run time
/// (best fit in every group right after that; the caller sets the drain term, 0 here).
/// The random tie-break (14) is left 0 for the caller to set.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rank_key(
    affinity: bool,
    fits: u32,
    rack: bool,
    pick: &GpuPick,
    avail: &Resources,
    total_gpus: u32,
    others_wait: bool,
    declared: bool,
) -> RankKey {
    RankKey {
        affinity: Reverse(affinity),
        fits: Reverse(fits),
        rack: Reverse(rack),
        union_tier: Reverse(pick.union_tier),
        task_tier: Reverse(pick.task_tier),
        weight_ideal: Reverse(pick.weight_ideal || others_wait),
        nvlink_left_first: if others_wait { pick.fit[0] } else { 0 },
        fit_first: if declared { pick.fit } else { Default::default() },
        drain: 0,
        free_first: if others_wait { avail.whole_gpu_count() } else { 0 },
        weight_ideal_packed: Reverse(pick.weight_ideal),
        union_weight: Reverse(pick.union_weight),
        task_weight: Reverse(pick.task_weight),
        share_left: pick.share_left,
        numa: pick.numa,
        nic_apart: pick.nic_apart,
        nic: Reverse(pick.nic),
        fit: pick.fit,
        free_gpus: avail.whole_gpu_count(),
        left: Reverse(pick.left),
        total_gpus,
        cpu: avail.cpu,
        memory_mb: avail.memory_mb,
        tie: 0,
    }
}

/// Stages 1–4: per-node filters, in order.
pub(crate) const NODE_FILTERS: &[&dyn NodeFilter] = &[&RunningNodes, &NodeLabel, &GpuType, &NoneGpu];
