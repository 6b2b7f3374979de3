//! From the search to the answer (the last steps of the select chain in `mod.rs`): the
//! trace counted from the index, the "never" and "not now" reasons, the candidates shown,
//! the topology wait, the draw of the dynamic ports and the placement itself. No I/O.

use super::feasible;
use super::trace::{self, CandidateSummary, SelectionTrace, StageTrace};
use super::walk::{Scored, Search};
use super::{Alternative, Cx, JobDemand, Outcome, Placement, PortPlan, Selection, TaskAsk};
use crate::cluster::{ClusterView, Node};
use crate::config::SelectSettings;
use crate::resources::{CustomResources, PortSet, Resources, Shortfall};

/// The task's GPU count as the tiers count it (a share is one GPU).
pub(crate) fn gpus_of(ask: &TaskAsk<'_>) -> u32 {
    if ask.resources.gpu_share.is_some() {
        1
    } else {
        ask.resources.gpus
    }
}

/// The trace, counted from the index (`nodes` of them): each filter stage, the ports,
/// resources, rack-policy and job-packing stages.
pub(crate) fn trace_of(
    search: &mut Search<'_>,
    nodes: usize,
    port_note: Option<String>,
    ask: &TaskAsk<'_>,
    view: &ClusterView,
) -> SelectionTrace {
    const BELOW_CUT: &str = "ranked below the candidate cut (waiting tasks × candidate_nodes_factor)";
    let mut trace = SelectionTrace::default();
    let mut alive = nodes;
    for mut st in std::mem::take(&mut search.filter_stages) {
        st.nodes_in = alive;
        alive -= st.dropped_count().min(alive);
        st.nodes_out = alive;
        trace.stages.push(st);
    }
    let mut ports_stage = StageTrace::new("ports", alive);
    ports_stage.note = port_note;
    trace.stages.push(ports_stage);
    let mut res_stage = std::mem::replace(&mut search.res_stage, StageTrace::new("resources", 0));
    res_stage.nodes_in = alive;
    alive -= res_stage.dropped_count().min(alive);
    res_stage.nodes_out = alive;
    let custom_short = res_stage.dropped.iter().any(|g| g.reason == Shortfall::Custom.reason());
    if custom_short || (alive == 0 && !ask.resources.custom.is_empty()) {
        res_stage.note = custom_note(&ask.resources.custom, view);
    }
    trace.stages.push(res_stage);
    let mut rack_stage = StageTrace::new("rack-policy", alive);
    if search.rack_on && !search.job_racks.is_empty() {
        rack_stage.note = Some("racks already holding the job rank first after node count (criterion 3)".into());
    }
    trace.stages.push(rack_stage);
    let mut pack = StageTrace::new("job-packing", alive);
    let cands = &search.cands;
    let kept = search.keep.min(cands.len());
    for c in cands.iter().skip(kept) {
        pack.drop_node(BELOW_CUT, &c.node.host);
    }
    let cut = search.scored_ok.saturating_sub(cands.len());
    if cut > 0 {
        pack.drop_many(BELOW_CUT, cut, std::iter::empty());
    }
    let unvisited = alive.saturating_sub(search.scored_ok);
    if unvisited > 0 {
        pack.drop_many(
            "not visited: the node index ranks it below the candidates kept",
            unvisited,
            std::iter::empty(),
        );
    }
    pack.nodes_out = kept;
    trace.stages.push(pack);
    trace
}

/// No candidate: "never" when no node of the cluster could ever take the task, else
/// "not now" with the stage that emptied the set.
pub(crate) fn no_candidate(
    ask: &TaskAsk<'_>,
    demand: &JobDemand,
    settings: &SelectSettings,
    view: &ClusterView,
    trace: SelectionTrace,
) -> Selection {
    let outcome = match impossible_reason(ask, demand, settings, view) {
        Some(reason) => Outcome::Impossible { reason },
        None => Outcome::NotNow {
            reason: custom_wait_reason(&trace).unwrap_or_else(|| not_now_reason(&trace)),
            wait: crate::reason::Kind::Resources,
        },
    };
    Selection { outcome, trace }
}

/// Whether a candidate's GPU set reaches the best tier its node offers for `k` GPUs.
pub(crate) fn tier_ideal(c: &Scored<'_>, k: u32) -> bool {
    k <= 1
        || c.node
            .topology
            .as_deref()
            .is_none_or(|t| c.pick.task_tier >= t.best_tier(k))
}

/// The candidates the trace shows (at most five of those kept) and the runner-up.
pub(crate) fn summarize(trace: &mut SelectionTrace, search: &Search<'_>, k: u32) {
    let cands = &search.cands;
    let kept = search.keep.min(cands.len());
    trace.candidates = cands
        .iter()
        .take(kept.min(5))
        .map(|c| CandidateSummary {
            host: c.node.host.clone(),
            rack: c.node.rack.clone(),
            job_affinity: c.key.affinity.0,
            fits_tasks: c.fits,
            free_gpus: c.avail().whole_gpu_count(),
            gpu_tier: c.pick.task_tier,
            gpu_tier_ideal: tier_ideal(c, k),
            gpu_weight: c.pick.task_weight,
            union_tier: c.pick.union_tier,
            union_weight: c.pick.union_weight,
        })
        .collect();
    if let (Some(best), Some(next)) = (cands.first(), cands.get(1)) {
        trace.alternative = Some(Alternative {
            host: next.node.host.clone(),
            lost_on: next.key.lost_on(&best.key),
        });
    }
}

/// The topology wait (docs/DESIGN-NOTES.md, "Topology wait"): the best set is below its
/// node's ideal tier and other jobs hold GPUs on nodes this task may use, so a release may
/// free a better set.
pub(crate) fn may_improve(cx: &Cx<'_>, search: &Search<'_>, best: &Scored<'_>, k: u32) -> bool {
    !tier_ideal(best, k)
        && cx.ask.resources.gpu_share.is_none()
        && search.held_gpus_usable(cx, k) > u64::from(cx.demand.held_gpu_count())
}

/// The task waits for its node's ideal tier: every kept candidate is held back.
pub(crate) fn topology_wait(
    mut trace: SelectionTrace,
    best: &Scored<'_>,
    kept: usize,
    k: u32,
    settings: &SelectSettings,
) -> Selection {
    let ideal = best.node.topology.as_deref().map_or(0, |t| t.best_tier(k));
    let mut wait = StageTrace::new("topology-wait", kept);
    wait.drop_many(
        "below its node's ideal GPU tier while other jobs' GPUs may free a better set",
        kept,
        std::iter::empty(),
    );
    wait.nodes_out = 0;
    wait.note = Some(format!(
        "waits up to select.topology_wait_sec = {} s for tier {ideal}",
        settings.topology_wait_sec
    ));
    trace.stages.push(wait);
    Selection {
        outcome: Outcome::NotNow {
            reason: format!(
                "holding out for {k} GPUs of tier {ideal}: the best free now are GPUs {} on {} at tier {}, and other jobs' GPUs may free a better set; it takes the best set once select.topology_wait_sec ({} s) has passed since the task began waiting",
                crate::resources::mask_indices(best.pick.task)
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
                best.node.host,
                best.pick.task_tier,
                settings.topology_wait_sec
            ),
            wait: crate::reason::Kind::Topology,
        },
        trace,
    }
}

/// The task's ports on the picked node: the fixed ones, or the static ones and the
/// dynamic ones drawn at random from what is free at or above `container_min_port`.
/// `None` when too few are free (the resource check kept only nodes with enough, so
/// that would be a bug).
pub(crate) fn draw_ports(cx: &mut Cx<'_>, best: &Scored<'_>) -> Option<PortSet> {
    match &cx.ports {
        PortPlan::Fixed(p) => Some(p.clone()),
        PortPlan::PerNode { statics, dynamic } => best
            .avail()
            .ports
            .subtract(statics)
            .random_subset(*dynamic, cx.settings.container_min_port, cx.rng)
            .map(|d| statics.union(&d)),
    }
}

/// Where the task goes: exactly what to ask the RM for on the best candidate.
pub(crate) fn placement(ask: &TaskAsk<'_>, best: &Scored<'_>, ports: PortSet, k: u32, may_improve: bool) -> Placement {
    let mut resources = match ask.resources.gpu_share {
        Some(share) => Resources::with_share(
            ask.resources.cpu,
            ask.resources.memory_mb,
            best.pick.task.trailing_zeros(),
            share,
            ports,
        ),
        None => Resources::with_mask(ask.resources.cpu, ask.resources.memory_mb, best.pick.task, ports),
    };
    resources.custom = ask.resources.custom.clone();
    Placement {
        host: best.node.host.clone(),
        rack: best.node.rack.clone(),
        resources,
        gpu_tier: best.pick.task_tier,
        gpu_weight: best.pick.task_weight,
        gpu_tier_ideal: tier_ideal(best, k),
        union_tier: best.pick.union_tier,
        may_improve,
        nic: best
            .node
            .topology
            .as_deref()
            .map(|t| crate::topology::task_locality(t, best.pick.task).nics)
            .filter(|n| !n.is_empty())
            .map(|n| n.join(",")),
    }
}

/// Why custom resources can never fit: the first resource that no candidate node offers
/// enough of, with the nodes that have it at all.
fn custom_impossible(want: &CustomResources, nodes: &[&Node]) -> String {
    for (name, units) in want.iter() {
        let having: Vec<&Node> = nodes.iter().copied().filter(|n| n.total().custom.has(name)).collect();
        if having.iter().any(|n| n.total().custom.get(name) >= units) {
            continue;
        }
        return match having.iter().map(|n| n.total().custom.get(name)).max() {
            None => format!("no node offers the custom resource `{name}` (asks {units})"),
            Some(most) => format!(
                "no node has {units} {name} (asks {units}, most on one node {most}; nodes with {name}: {})",
                example_hosts(having.iter().map(|n| n.host.as_str()), having.len())
            ),
        };
    }
    "no node offers all the custom resources asked for together".into()
}

/// Up to five hosts, then how many more.
fn example_hosts<'a>(hosts: impl Iterator<Item = &'a str>, total: usize) -> String {
    let shown: Vec<&str> = hosts.take(trace::EXAMPLE_HOSTS).collect();
    if total > shown.len() {
        format!("{} and {} more", shown.join(", "), total - shown.len())
    } else {
        shown.join(", ")
    }
}

/// For a task asking custom resources: "no node has 1 nvme free; nodes with nvme: a, b"
/// for the first resource that no node has enough of free now, or which nodes have it
/// free. `None` when the task asks none.
fn custom_note(want: &CustomResources, view: &ClusterView) -> Option<String> {
    if want.is_empty() {
        return None;
    }
    let mut parts = Vec::new();
    for (name, units) in want.iter() {
        let having: Vec<&Node> = view.nodes().filter(|n| n.total().custom.has(name)).collect();
        let free: Vec<&str> = having
            .iter()
            .filter(|n| n.free().custom.get(name) >= units)
            .map(|n| n.host.as_str())
            .collect();
        if free.is_empty() {
            let with = if having.is_empty() {
                "none".to_string()
            } else {
                example_hosts(having.iter().map(|n| n.host.as_str()), having.len())
            };
            return Some(format!("no node has {units} {name} free; nodes with {name}: {with}"));
        }
        parts.push(format!(
            "nodes with {units} {name} free: {}",
            example_hosts(free.iter().copied(), free.len())
        ));
    }
    Some(parts.join("; "))
}

/// When the resource stage emptied the set because of a custom resource no node has free,
/// its note is the reason ("no node has 1 nvme free; nodes with nvme: a, b").
fn custom_wait_reason(trace: &SelectionTrace) -> Option<String> {
    let st = trace.stages.iter().find(|s| s.stage == "resources")?;
    if st.nodes_out > 0 || st.main_reason() != Some(Shortfall::Custom.reason()) {
        return None;
    }
    st.note.clone().filter(|n| n.starts_with("no node has"))
}

fn not_now_reason(trace: &SelectionTrace) -> String {
    match trace.stages.iter().rev().find(|s| s.nodes_in > 0 && s.nodes_out == 0) {
        Some(s) => format!(
            "stage {} dropped all {} remaining nodes ({})",
            s.stage,
            s.nodes_in,
            s.main_reason().unwrap_or("no reason recorded")
        ),
        None => "the cluster has no nodes".into(),
    }
}

/// What the feasibility rule knows of the task of `ask` in a job of `demand`.
pub(crate) fn task_facts<'a>(
    ask: &TaskAsk<'a>,
    demand: &JobDemand,
    settings: &SelectSettings,
) -> feasible::TaskFacts<'a> {
    feasible::TaskFacts::new(
        ask.node_label,
        ask.gpu_types,
        !demand.job_uses_gpus && !settings.allow_none_gpu_job_on_gpu_node,
    )
}

/// Why no node of this cluster could ever take the task, even if empty; `None` when
/// some node could. The partition, type and none-GPU rules first (the stage order), then
/// the shortfall rule against each node's total: the reason is the dimension that
/// empties the set when the rule's dimensions are applied in order.
pub(crate) fn impossible_reason(
    ask: &TaskAsk<'_>,
    demand: &JobDemand,
    settings: &SelectSettings,
    view: &ClusterView,
) -> Option<String> {
    let r = ask.resources;
    let task = task_facts(ask, demand, settings);
    let (statics, dynamic) = match ask.reuse_ports {
        Some(p) => (p.clone(), 0),
        None => (r.static_ports(), r.dynamic_port_count()),
    };
    let mut nodes: Vec<&Node> = view.nodes().collect();
    nodes.retain(|n| feasible::partition(&task, &feasible::NodeFacts::of(n)).is_ok());
    if nodes.is_empty() {
        return Some(format!(
            "no node is in the task's label partition (asks `{}`)",
            task.partition
        ));
    }
    nodes.retain(|n| feasible::gpu_type(&task, &feasible::NodeFacts::of(n)).is_ok());
    if nodes.is_empty() {
        return Some(format!(
            "no node has one of the GPU types asked for (asks {})",
            ask.gpu_types.join(",")
        ));
    }
    nodes.retain(|n| feasible::none_gpu(&task, &feasible::NodeFacts::of(n)).is_ok());
    if nodes.is_empty() {
        return Some(
            "the job asks for no GPU and only GPU nodes remain (allow_none_gpu_job_on_gpu_node is off)".into(),
        );
    }
    let req = r.request_with_ports(statics);
    let fit = feasible::Ask {
        request: &req,
        dynamic_ports: dynamic,
        min_port: settings.container_min_port,
    };
    let mut worst: Option<Shortfall> = None;
    for n in &nodes {
        match fit.shortfall(n.total()) {
            None => return None,
            Some(s) => worst = Some(worst.map_or(s, |w| if (s as u8) > (w as u8) { s } else { w })),
        }
    }
    let largest = |f: fn(&Node) -> u64| view.nodes().map(f).max().unwrap_or(0);
    Some(match worst? {
        Shortfall::Custom => custom_impossible(&r.custom, &nodes),
        Shortfall::GpuShare => format!(
            "no node has a GPU for a share of {} (asks {})",
            crate::resources::format_hundredths(r.gpu_share.unwrap_or(0)),
            match r.gpu_mask {
                Some(m) => format!("GPU {}", m.trailing_zeros()),
                None => "any GPU".into(),
            }
        ),
        Shortfall::GpuBits | Shortfall::Gpus => format!(
            "no node has that many GPUs (or the explicit GPU mask) (asks {}, largest node has {})",
            r.gpus,
            largest(|n| u64::from(n.total().gpu_count()))
        ),
        Shortfall::Cpu => format!(
            "no node has that many CPUs (asks {}, largest node has {})",
            r.cpu,
            largest(|n| u64::from(n.total().cpu))
        ),
        Shortfall::Memory => format!(
            "no node has that much memory (asks {} MB, largest node has {} MB)",
            r.memory_mb,
            largest(|n| n.total().memory_mb)
        ),
        Shortfall::Ports | Shortfall::DynamicPorts => "no node offers those ports".into(),
    })
}
