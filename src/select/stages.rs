//! The stages of the select pipeline, each a small named unit over the candidate list.
//!
//! Order (and why):
//! 1. `candidates`  — only RUNNING nodes can take containers.
//! 2. `node-label`  — partitions are hard boundaries (YARN exclusive partitions).
//! 3. `gpu-type`    — a hard user constraint, never relaxed.
//! 4. `none-gpu`    — keeps GPU nodes for GPU jobs; cheap, job-level.
//! 5. `ports`       — decides the ports before the resource check, so that the resource
//!    check sees the exact port set (a pool common to all remaining candidates where
//!    one exists, else per node).
//! 6. `resources`   — CPU, memory, GPUs (count or explicit mask) and ports against
//!    total − used − requested (− recently tried); also counts how many of the job's
//!    unplaced tasks each node could hold, which the last two stages need.
//! 7. `rack-policy` — narrows to the racks the job already uses, or to racks able to
//!    hold all it still needs, without ever emptying the set.
//! 8. `job-packing` — ranks by job affinity, job fit, GPU-set quality, then the
//!    original packing order; keeps the best `waiting tasks × candidateNodesFactor`.
//!
//! The pick (best candidate, random tie-break) and the final port choice follow in
//! `Selector::select`.

use std::cmp::Reverse;

use rand::Rng;

use super::fast_hash::{FastMap, FastSet};
use super::trace::{CandidateSummary, StageTrace};
use super::{Cand, Cx, PortPlan};
use crate::cluster::Node;
use crate::config::RackPolicy;
use crate::resources::PortSet;

/// One stage of the pipeline.
pub(crate) trait Stage {
    fn name(&self) -> &'static str;
    fn run<'a>(&self, cx: &mut Cx<'a>, cands: &mut Vec<Cand<'a>>, trace: &mut StageTrace);
}

/// Keeps the candidates `keep` accepts, recording the reason for each one it drops.
fn retain<'a>(
    cands: &mut Vec<Cand<'a>>,
    trace: &mut StageTrace,
    mut keep: impl FnMut(&mut Cand<'a>) -> Result<(), &'static str>,
) {
    cands.retain_mut(|c| match keep(c) {
        Ok(()) => true,
        Err(reason) => {
            trace.drop_node(reason, &c.node.host);
            false
        }
    });
}

/// A stage that judges each node on its own. These run fused in one pass over the
/// view (one memory walk instead of four at 10,000 nodes), each still keeping its own
/// trace, in order.
pub(crate) trait NodeFilter: Sync {
    fn name(&self) -> &'static str;
    fn check(&self, cx: &Cx<'_>, node: &Node) -> Result<(), &'static str>;
}

pub(crate) struct RunningNodes;
impl NodeFilter for RunningNodes {
    fn name(&self) -> &'static str {
        "candidates"
    }
    fn check(&self, _cx: &Cx<'_>, node: &Node) -> Result<(), &'static str> {
        if node.state == crate::cluster::NodeState::Running {
            Ok(())
        } else {
            Err("node is not RUNNING")
        }
    }
}

pub(crate) struct NodeLabel;
impl NodeFilter for NodeLabel {
    fn name(&self) -> &'static str {
        "node-label"
    }
    fn check(&self, cx: &Cx<'_>, node: &Node) -> Result<(), &'static str> {
        // A task without a label belongs to the default (unlabelled) partition, as in
        // YARN; the original let it onto labelled nodes (frameworklauncher.md §10.13).
        let want = cx.ask.node_label.map(str::trim).unwrap_or("");
        // Most nodes and tasks have no label: settle that case without a string compare.
        let same = if want.is_empty() {
            node.labels.is_empty() || node.partition().is_empty()
        } else {
            node.partition() == want
        };
        if same {
            Ok(())
        } else if want.is_empty() {
            Err("node is in a labelled partition; the task asks for none")
        } else {
            Err("node is not in the task's label partition")
        }
    }
}

pub(crate) struct GpuType;
impl NodeFilter for GpuType {
    fn name(&self) -> &'static str {
        "gpu-type"
    }
    fn check(&self, cx: &Cx<'_>, node: &Node) -> Result<(), &'static str> {
        let types = cx.ask.gpu_types;
        match &node.gpu_type {
            _ if types.is_empty() => Ok(()),
            Some(t) if types.iter().any(|w| w == t) => Ok(()),
            _ => Err("GPU type not among those asked for"),
        }
    }
}

pub(crate) struct NoneGpu;
impl NodeFilter for NoneGpu {
    fn name(&self) -> &'static str {
        "none-gpu"
    }
    fn check(&self, cx: &Cx<'_>, node: &Node) -> Result<(), &'static str> {
        if cx.demand.job_uses_gpus || cx.settings.allow_none_gpu_job_on_gpu_node || node.total().gpu_count() == 0 {
            Ok(())
        } else {
            Err("GPU node kept for GPU jobs (allow_none_gpu_job_on_gpu_node is off)")
        }
    }
}

pub(crate) struct Ports;
impl Stage for Ports {
    fn name(&self) -> &'static str {
        "ports"
    }
    fn run<'a>(&self, cx: &mut Cx<'a>, cands: &mut Vec<Cand<'a>>, trace: &mut StageTrace) {
        let res = cx.ask.resources;
        if let Some(reuse) = cx.ask.reuse_ports {
            trace.note = Some(format!("samePortAllocation: reusing {reuse}"));
            cx.ports = PortPlan::Fixed(reuse.clone());
            return;
        }
        let statics = res.static_ports();
        let dynamic = res.dynamic_port_count();
        if dynamic == 0 {
            cx.ports = PortPlan::Fixed(statics);
            return;
        }
        let min = cx.settings.container_min_port;
        // A pool common to every remaining candidate lets all of them take the same
        // ports (what the original did); only intersect when a node differs.
        let mut pool: Option<PortSet> = None;
        for c in cands.iter() {
            let free = &c.node.free().ports;
            pool = Some(match pool {
                None => free.at_least(min).subtract(&statics),
                Some(p) if p.is_subset(free) => p,
                Some(p) => p.intersect(free),
            });
            if pool.as_ref().is_some_and(|p| p.count() < dynamic) {
                break;
            }
        }
        let pool = pool.unwrap_or_default();
        if pool.count() >= dynamic {
            if let Some(chosen) = pool.random_subset(dynamic, min, cx.rng) {
                trace.note = Some(format!("dynamic ports {chosen} free on every candidate"));
                cx.ports = PortPlan::Fixed(statics.union(&chosen));
                return;
            }
        }
        trace.note = Some("no common free ports; choosing per node".into());
        retain(cands, trace, |c| {
            if c.node.free().ports.subtract(&statics).count_at_least(min) >= dynamic {
                Ok(())
            } else {
                Err("too few free ports at or above container_min_port")
            }
        });
        cx.ports = PortPlan::PerNode { statics, dynamic };
    }
}

pub(crate) struct ResourceFit;
impl Stage for ResourceFit {
    fn name(&self) -> &'static str {
        "resources"
    }
    fn run<'a>(&self, cx: &mut Cx<'a>, cands: &mut Vec<Cand<'a>>, trace: &mut StageTrace) {
        let req = cx.request();
        let min_port = cx.settings.container_min_port;
        let tried = &cx.tried;
        let demand = cx.demand;
        retain(cands, trace, |c| {
            // Usually nothing was tried recently: skip hashing the host name then.
            let recent = if tried.is_empty() {
                None
            } else {
                tried.get(c.node.host.as_str())
            };
            let adjusted = recent.map(|t| Box::new(c.node.free().subtract(t)));
            let avail = adjusted.as_deref().unwrap_or(c.node.free());
            if req.cpu > avail.cpu {
                return Err("not enough free CPU");
            }
            if req.memory_mb > avail.memory_mb {
                return Err("not enough free memory");
            }
            if req.gpu_mask != 0 {
                if req.gpu_mask & avail.gpu_mask != req.gpu_mask {
                    return Err("the requested GPU mask is not free");
                }
            } else if req.gpus > avail.gpu_count() {
                return Err("not enough free GPUs");
            }
            if !req.ports.is_subset(&avail.ports) {
                return Err("requested ports are not free");
            }
            c.fits = demand.capacity_in(avail, min_port).max(1);
            c.adjusted = adjusted;
            Ok(())
        });
    }
}

pub(crate) struct RackPacking;
impl Stage for RackPacking {
    fn name(&self) -> &'static str {
        "rack-policy"
    }
    fn run<'a>(&self, cx: &mut Cx<'a>, cands: &mut Vec<Cand<'a>>, trace: &mut StageTrace) {
        if cx.settings.rack_policy == RackPolicy::None || cands.is_empty() {
            return;
        }
        // Racks already holding this job's tasks come first.
        let job_racks: FastSet<&str> = cx
            .demand
            .hosts()
            .filter_map(|(h, _)| cx.view.get(h).map(|n| n.rack.as_str()))
            .collect();
        if !job_racks.is_empty() && cands.iter().any(|c| job_racks.contains(&c.node.rack.as_str())) {
            trace.note = Some("keeping the racks this job already uses".into());
            retain(cands, trace, |c| {
                if job_racks.contains(&c.node.rack.as_str()) {
                    Ok(())
                } else {
                    Err("outside the racks this job already uses")
                }
            });
            return;
        }
        // Otherwise the racks that can hold everything the job still needs; if none
        // can, the rack that holds the most of it (fewest racks overall).
        let mut per_rack: FastMap<&str, u32> = FastMap::default();
        for c in cands.iter() {
            *per_rack.entry(c.node.rack.as_str()).or_insert(0) += c.fits;
        }
        if per_rack.len() < 2 {
            return;
        }
        let need = cx.demand.remaining_tasks().max(1);
        let best = per_rack.values().copied().max().unwrap_or(0);
        let threshold = need.min(best);
        if per_rack.values().all(|&f| f >= threshold) {
            return;
        }
        trace.note = Some(if best >= need {
            format!("keeping racks that can hold all {need} unplaced tasks")
        } else {
            format!("no rack holds all {need} unplaced tasks; keeping the rack(s) holding most ({best})")
        });
        retain(cands, trace, |c| {
            if per_rack.get(c.node.rack.as_str()).copied().unwrap_or(0) >= threshold {
                Ok(())
            } else {
                Err("rack cannot hold as much of the job as another rack")
            }
        });
    }
}

/// Sort key of a candidate: smaller is better.
type RankKey = (
    Reverse<bool>, // job affinity
    Reverse<u32>,  // unplaced tasks that fit, capped at what is unplaced
    Reverse<bool>, // GPU set is as good as the node's best (T, W) for this size
    u32,           // free GPUs (pack into busy nodes)
    u32,           // total GPUs (smaller machines first)
    u32,           // free CPU
    u64,           // free memory
    Reverse<u32>,  // GPU set pair weight
    u32,           // random tie-break
);

pub(crate) type Key = RankKey;

fn rank_key(c: &Cand<'_>) -> RankKey {
    (
        Reverse(c.affinity),
        Reverse(c.fits),
        Reverse(c.ideal),
        c.avail().gpu_count(),
        c.node.total().gpu_count(),
        c.avail().cpu,
        c.avail().memory_mb,
        Reverse(c.choice.map(|g| g.weight).unwrap_or(0)),
        c.tie,
    )
}

pub(crate) struct JobPacking;
impl Stage for JobPacking {
    fn name(&self) -> &'static str {
        "job-packing"
    }
    fn run<'a>(&self, cx: &mut Cx<'a>, cands: &mut Vec<Cand<'a>>, trace: &mut StageTrace) {
        let need = cx.demand.remaining_tasks().max(1);
        let k = cx.ask.resources.gpus;
        let explicit = cx.ask.resources.gpu_mask;
        // One random draw per call; per-candidate tie-breaks are derived from it, which
        // is as random across calls and far cheaper than a draw per node.
        let salt: u64 = cx.rng.gen::<u64>() | 1;
        let any_placed = cx.demand.has_hosts();
        for (i, c) in cands.iter_mut().enumerate() {
            c.affinity = any_placed && cx.demand.tasks_on(&c.node.host) > 0;
            c.fits = c.fits.min(need);
            c.tie = ((i as u64 + 1).wrapping_mul(salt) >> 32) as u32;
            // Ideal = the node can offer a set as good as its best set of that size when
            // empty, in both tier and pair weight (the (T, W) objective of DESIGN §5):
            // tier alone cannot tell a socket-local quad from a cross-socket one on a
            // PCIe tree. Decided from the free mask without choosing the set.
            c.ideal = match (k, c.node.topology.as_deref(), explicit) {
                (0, _, _) => true,
                (_, None, _) => c.avail().gpu_count() >= k,
                (_, Some(t), Some(m)) => cx
                    .choices
                    .best(t, k)
                    .is_some_and(|(bt, bw)| t.tier(m) >= bt && t.weight(m) >= bw),
                (_, Some(t), None) => cx.choices.can_be_ideal(t, c.avail().gpu_mask, k),
            };
            c.key = rank_key(c);
        }
        // Cut to the best `waiting tasks × factor` on the cheap key, then choose the
        // GPU sets of those only (the original chose masks for its candidates only too).
        let keep = (cx.ask.waiting_tasks.max(1) as usize).saturating_mul(cx.settings.candidate_nodes_factor as usize);
        let keep = keep.clamp(1, cands.len().max(1));
        if cands.len() > keep {
            cands.select_nth_unstable_by(keep - 1, |a, b| a.key.cmp(&b.key));
            for c in cands.drain(keep..) {
                trace.drop_node(
                    "ranked below the candidate cut (waiting tasks × candidate_nodes_factor)",
                    &c.node.host,
                );
            }
        }
        for c in cands.iter_mut() {
            if k == 0 {
                c.tier_ideal = true;
                continue;
            }
            let topo = c.node.topology.as_deref();
            c.choice = match explicit {
                Some(m) => Some(crate::topology::GpuChoice {
                    mask: m,
                    tier: topo.map(|t| t.tier(m)).unwrap_or(0),
                    weight: topo.map(|t| t.weight(m)).unwrap_or(0),
                }),
                None => cx.choices.choose(topo, c.avail().gpu_mask, k),
            };
            (c.tier_ideal, c.ideal) = match (c.choice, topo) {
                (Some(g), Some(t)) => match cx.choices.best(t, k) {
                    Some((bt, bw)) => (g.tier >= bt, g.tier >= bt && g.weight >= bw),
                    None => (false, false),
                },
                (Some(_), None) => (true, true),
                (None, _) => (false, false),
            };
            c.key = rank_key(c);
        }
        // A candidate whose GPU choice failed cannot take the task (count-only free
        // amounts can disagree with masks only on malformed nodes).
        retain(cands, trace, |c| {
            if k == 0 || c.choice.is_some() {
                Ok(())
            } else {
                Err("no GPU set of the requested size on this node")
            }
        });
        cands.sort_unstable_by_key(|c| c.key);
    }
}

pub(crate) fn summarize(c: &Cand<'_>, k: u32) -> CandidateSummary {
    CandidateSummary {
        host: c.node.host.clone(),
        rack: c.node.rack.clone(),
        job_affinity: c.affinity,
        fits_tasks: c.fits,
        free_gpus: c.avail().gpu_count(),
        gpu_tier: c.choice.map(|g| g.tier).unwrap_or(0),
        gpu_tier_ideal: k == 0 || c.tier_ideal,
        gpu_weight: c.choice.map(|g| g.weight).unwrap_or(0),
    }
}

/// Stages 1–4: per-node filters, run fused, in order.
pub(crate) const NODE_FILTERS: &[&dyn NodeFilter] = &[&RunningNodes, &NodeLabel, &GpuType, &NoneGpu];

/// Stages 5–8: they need the whole surviving set, in order.
pub(crate) const SET_STAGES: &[&dyn Stage] = &[&Ports, &ResourceFit, &RackPacking, &JobPacking];
