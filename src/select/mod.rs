//! The select pipeline (DESIGN.md §4): for one task, the node, the exact GPUs and
//! the ports, with a trace of why every other node was not chosen.
//!
//! All state (the `allNodes` view, outstanding requests, recently tried resources,
//! the tie-break RNG and a cache of GPU choices) sits behind one `parking_lot::Mutex`
//! in [`Selector`], so a choice and the booking of its resources are one step.
//! The stages themselves are in `stages.rs`, in order, with the reasons for that order.

mod demand;
mod fast_hash;
mod plan;
mod stages;
mod trace;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;

pub use demand::{JobDemand, TaskShape};
pub use plan::{assign_port_labels, plan_job, request_order, JobPlan, PlannedTask, UnplacedTask};
pub use trace::{CandidateSummary, DropGroup, SelectionTrace, StageTrace};

use crate::cluster::{ClusterView, Node};
use crate::config::SelectSettings;
use crate::resources::{GpuMask, PortSet, Resources};
use crate::spec::TaskResources;
use crate::topology::{self, GpuChoice, Topology};

/// What one task asks the pipeline for.
#[derive(Clone, Copy, Debug)]
pub struct TaskAsk<'a> {
    pub role: &'a str,
    pub resources: &'a TaskResources,
    pub node_label: Option<&'a str>,
    /// Acceptable GPU types; empty = any.
    pub gpu_types: &'a [String],
    /// samePortAllocation: the ports the role's live tasks already hold.
    pub reuse_ports: Option<&'a PortSet>,
    /// Tasks of the job waiting for a container (sets the candidate count).
    pub waiting_tasks: u32,
}

impl<'a> TaskAsk<'a> {
    /// An ask with only resources: no label, any GPU type, no port reuse.
    pub fn plain(role: &'a str, resources: &'a TaskResources, waiting_tasks: u32) -> Self {
        TaskAsk {
            role,
            resources,
            node_label: None,
            gpu_types: &[],
            reuse_ports: None,
            waiting_tasks,
        }
    }

    /// The ask of one task of `role`.
    pub fn for_role(role: &'a crate::spec::TaskRole, reuse_ports: Option<&'a PortSet>, waiting_tasks: u32) -> Self {
        TaskAsk {
            role: &role.name,
            resources: &role.resources,
            node_label: role.node_label.as_deref(),
            gpu_types: &role.gpu_types,
            reuse_ports,
            waiting_tasks,
        }
    }
}

/// Where a task goes.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    pub host: String,
    pub rack: String,
    /// Exactly what to ask the RM for: CPU, memory, the GPU mask and the ports.
    pub resources: Resources,
    pub gpu_tier: u8,
    pub gpu_weight: u32,
    /// The GPU set reaches the best tier this node's topology offers for its size.
    pub gpu_tier_ideal: bool,
}

/// The pipeline's answer.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum Outcome {
    Placed(Placement),
    /// Nothing fits now; it may later.
    NotNow {
        reason: String,
    },
    /// Nothing in this cluster could ever take it.
    Impossible {
        reason: String,
    },
}

/// An outcome with its trace.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Selection {
    pub outcome: Outcome,
    pub trace: SelectionTrace,
}

/// How the task's ports are decided.
#[derive(Clone, Debug)]
pub(crate) enum PortPlan {
    /// The same ports on every candidate (static, reused, or a common pool).
    Fixed(PortSet),
    /// Static ports plus `dynamic` ports chosen on the picked node.
    PerNode { statics: PortSet, dynamic: u32 },
}

/// A node under consideration.
pub(crate) struct Cand<'a> {
    pub node: &'a Node,
    /// Free resources minus recently tried asks, when any were tried on this node
    /// (rare; boxed so the candidate stays small: candidates are moved a lot).
    pub adjusted: Option<Box<Resources>>,
    pub fits: u32,
    pub affinity: bool,
    pub choice: Option<GpuChoice>,
    /// The set reaches the node's best tier for its size.
    pub tier_ideal: bool,
    /// The set reaches the node's best (tier, weight) for its size.
    pub ideal: bool,
    pub tie: u32,
    /// Ranking key, computed once by job packing.
    pub key: stages::Key,
}

impl Cand<'_> {
    /// Free resources as the pipeline sees them.
    pub fn avail(&self) -> &Resources {
        self.adjusted.as_deref().unwrap_or(self.node.free())
    }
}

/// Memoised GPU choices: nodes of one topology with one free mask share the answer,
/// and the "can this node offer its best set" test per (topology, size) is built once.
/// Both keep ranking every candidate by GPU-set quality cheap at 10,000 nodes.
#[derive(Default)]
pub(crate) struct ChoiceCache {
    map: fast_hash::FastMap<(usize, GpuMask, u32), Option<GpuChoice>>,
    ideal: fast_hash::FastMap<(usize, u32), IdealTest>,
}

/// How to tell, from a node's free mask alone, whether it can offer a GPU set as good
/// as the best set of that size on the empty node.
enum IdealTest {
    /// Every optimal (T, W) set of the empty node, when there are few: a node is ideal
    /// when one of them is entirely free. Exact.
    Sets(Vec<GpuMask>),
    /// Nodes too large to enumerate (> 16 GPUs): some island of the best tier has `k`
    /// free GPUs. Checks the tier only; the weight is checked exactly after the cut.
    Islands(Vec<GpuMask>),
    /// Too many optimal sets to list: run the (memoised) choice and compare.
    Choose { tier: u8, weight: u32 },
    /// The node has fewer than `k` GPUs.
    Never,
}

impl ChoiceCache {
    const MAX_ENTRIES: usize = 200_000;
    /// Most optimal sets listed per (topology, size) before falling back to `Choose`.
    const MAX_SETS: usize = 64;

    pub fn choose(&mut self, topo: Option<&Topology>, free: GpuMask, k: u32) -> Option<GpuChoice> {
        let Some(t) = topo else {
            return topology::choose(None, free, k);
        };
        let key = (t as *const Topology as usize, free, k);
        if let Some(c) = self.map.get(&key) {
            return *c;
        }
        if self.map.len() >= Self::MAX_ENTRIES {
            self.map.clear();
        }
        let c = topology::choose(Some(t), free, k);
        self.map.insert(key, c);
        c
    }

    /// The best (tier, weight) of a `k`-set on the empty node.
    pub fn best(&mut self, t: &Topology, k: u32) -> Option<(u8, u32)> {
        self.choose(Some(t), t.all_mask(), k).map(|g| (g.tier, g.weight))
    }

    /// Whether a node of topology `t` with `free` GPUs can offer a `k`-set as good as
    /// the empty node's best (see [`IdealTest`] for the one approximation).
    pub fn can_be_ideal(&mut self, t: &Topology, free: GpuMask, k: u32) -> bool {
        let key = (t as *const Topology as usize, k);
        let test = match self.ideal.get(&key) {
            Some(test) => test,
            None => {
                let test = self.ideal_test(t, k);
                self.ideal.entry(key).or_insert(test)
            }
        };
        let (tier, weight) = match test {
            IdealTest::Sets(sets) => return sets.iter().any(|&s| s & !free == 0),
            IdealTest::Islands(isl) => return isl.iter().any(|&i| (i & free).count_ones() >= k),
            IdealTest::Choose { tier, weight } => (*tier, *weight),
            IdealTest::Never => return false,
        };
        self.choose(Some(t), free, k)
            .is_some_and(|g| g.tier >= tier && g.weight >= weight)
    }

    fn ideal_test(&mut self, t: &Topology, k: u32) -> IdealTest {
        let Some((tier, weight)) = self.best(t, k) else {
            return IdealTest::Never;
        };
        let n = t.gpu_count();
        if n > 16 {
            return IdealTest::Islands(t.islands(tier));
        }
        // Every k-subset of n ≤ 16 GPUs, in increasing order (Gosper's hack).
        let mut sets = Vec::new();
        let mut s: u64 = (1u64 << k) - 1;
        while s < (1u64 << n) {
            if t.tier(s) == tier && t.weight(s) == weight {
                if sets.len() == Self::MAX_SETS {
                    return IdealTest::Choose { tier, weight };
                }
                sets.push(s);
            }
            let c = s & s.wrapping_neg();
            let r = s + c;
            s = (((r ^ s) >> 2) / c) | r;
        }
        IdealTest::Sets(sets)
    }
}

/// The per-call context the stages share.
pub(crate) struct Cx<'a> {
    pub ask: &'a TaskAsk<'a>,
    pub demand: &'a JobDemand,
    pub settings: &'a SelectSettings,
    pub view: &'a ClusterView,
    pub tried: fast_hash::FastMap<&'a str, Resources>,
    pub rng: &'a mut StdRng,
    pub choices: &'a mut ChoiceCache,
    pub ports: PortPlan,
}

impl Cx<'_> {
    /// The request as the resource stage checks it.
    pub fn request(&self) -> Resources {
        let r = self.ask.resources;
        let ports = match &self.ports {
            PortPlan::Fixed(p) => p.clone(),
            PortPlan::PerNode { statics, .. } => statics.clone(),
        };
        Resources {
            cpu: r.cpu,
            memory_mb: r.memory_mb,
            gpus: r.gpus,
            gpu_mask: r.gpu_mask.unwrap_or(0),
            ports,
        }
    }
}

struct SelectorState {
    view: ClusterView,
    settings: SelectSettings,
    /// Asks that were rejected or timed out, per host, until their time is up.
    tried: HashMap<String, Vec<(Resources, Instant)>>,
    rng: StdRng,
    choices: ChoiceCache,
    /// Topologies by name, shared between nodes so the choice cache hits.
    topologies: HashMap<String, Arc<Topology>>,
}

/// The select pipeline and the node view it works on.
pub struct Selector {
    state: Mutex<SelectorState>,
}

impl Selector {
    pub fn new(view: ClusterView, settings: SelectSettings) -> Self {
        let rng = match settings.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_entropy(),
        };
        let mut state = SelectorState {
            view: ClusterView::default(),
            settings,
            tried: HashMap::new(),
            rng,
            choices: ChoiceCache::default(),
            topologies: HashMap::new(),
        };
        state.replace_nodes(view.nodes().cloned().collect());
        Selector {
            state: Mutex::new(state),
        }
    }

    /// Runs the pipeline for one task without booking anything.
    pub fn select(&self, ask: &TaskAsk<'_>, demand: &JobDemand) -> Selection {
        let mut st = self.state.lock();
        st.select(ask, demand)
    }

    /// Runs the pipeline and, when it places the task, books the placement as
    /// requested on its node in the same critical section.
    pub fn select_and_reserve(&self, ask: &TaskAsk<'_>, demand: &JobDemand) -> Selection {
        let mut st = self.state.lock();
        let sel = st.select(ask, demand);
        if let Outcome::Placed(p) = &sel.outcome {
            st.add_requested(&p.host, &p.resources);
        }
        sel
    }

    /// Books `r` as asked for on `host`; false if the host is unknown or `r` overlaps
    /// what is already booked.
    pub fn add_requested(&self, host: &str, r: &Resources) -> bool {
        self.state.lock().add_requested(host, r)
    }

    /// Un-books an ask. `tried` marks its resources as recently tried (for a rejected
    /// or timed-out ask), so the next choices avoid them for a while.
    pub fn remove_requested(&self, host: &str, r: &Resources, tried: bool) {
        let mut st = self.state.lock();
        if let Some(n) = st.view.get_mut(host) {
            let left = n.requested().subtract(r);
            n.set_requested(left);
        }
        if tried && st.settings.skip_local_tried_resource {
            st.tried
                .entry(host.to_string())
                .or_default()
                .push((r.clone(), Instant::now()));
        }
    }

    /// Replaces the view with a full node listing (keeps bookings of known hosts).
    /// A listing fetched after an ask was rejected already shows whoever holds what the
    /// ask wanted, so it supersedes the tried marks; keeping them for their whole TTL
    /// would hide resources that were freed meanwhile (a job then idled ~30 s beside
    /// free GPUs after losing a race with another AM).
    pub fn replace_nodes(&self, nodes: Vec<Node>) {
        let mut st = self.state.lock();
        st.tried.clear();
        st.replace_nodes(nodes);
    }

    /// Applies one node report (an unusable state removes the node); like a full
    /// listing, it supersedes the node's tried marks.
    pub fn apply_node_report(&self, mut node: Node) {
        let mut st = self.state.lock();
        st.tried.remove(&node.host);
        st.share_topology(&mut node);
        st.view.apply_report(node);
    }

    /// Reads the view under the lock.
    pub fn with_view<R>(&self, f: impl FnOnce(&ClusterView) -> R) -> R {
        f(&self.state.lock().view)
    }

    pub fn settings(&self) -> SelectSettings {
        self.state.lock().settings.clone()
    }
}

impl SelectorState {
    fn share_topology(&mut self, node: &mut Node) {
        if let Some(t) = &node.topology {
            let shared = self
                .topologies
                .entry(format!("{}/{}", t.name(), t.gpu_count()))
                .or_insert_with(|| t.clone());
            if **shared == **t {
                node.topology = Some(shared.clone());
            }
        }
    }

    fn replace_nodes(&mut self, mut nodes: Vec<Node>) {
        for n in &mut nodes {
            self.share_topology(n);
        }
        self.view.replace_all(nodes);
    }

    fn add_requested(&mut self, host: &str, r: &Resources) -> bool {
        let Some(n) = self.view.get_mut(host) else {
            return false;
        };
        match n.requested().try_add(r) {
            Ok(sum) => {
                n.set_requested(sum);
                true
            }
            Err(_) => false,
        }
    }

    /// Sum of the unexpired tried resources per host (expired ones are dropped).
    fn live_tried(&mut self) -> HashMap<String, Resources> {
        let ttl = Duration::from_secs(self.settings.tried_resource_ttl_sec);
        let now = Instant::now();
        self.tried.retain(|_, v| {
            v.retain(|(_, t)| now.duration_since(*t) < ttl);
            !v.is_empty()
        });
        self.tried
            .iter()
            .map(|(h, v)| {
                let sum = v.iter().fold(Resources::default(), |acc, (r, _)| union(&acc, r));
                (h.clone(), sum)
            })
            .collect()
    }

    fn select(&mut self, ask: &TaskAsk<'_>, demand: &JobDemand) -> Selection {
        let tried_owned = if self.settings.skip_local_tried_resource {
            self.live_tried()
        } else {
            HashMap::new()
        };
        let SelectorState {
            view,
            settings,
            rng,
            choices,
            ..
        } = self;
        let mut cx = Cx {
            ask,
            demand,
            settings,
            view,
            tried: tried_owned.iter().map(|(h, r)| (h.as_str(), r.clone())).collect(),
            rng,
            choices,
            ports: PortPlan::Fixed(PortSet::new()),
        };
        let mut trace = SelectionTrace::default();
        let mut cands: Vec<Cand<'_>> = Vec::new();
        let filters = stages::NODE_FILTERS;
        trace.stages = filters.iter().map(|f| StageTrace::new(f.name(), 0)).collect();
        'nodes: for node in view.nodes() {
            for (f, st) in filters.iter().zip(trace.stages.iter_mut()) {
                st.nodes_in += 1;
                if let Err(reason) = f.check(&cx, node) {
                    st.drop_node(reason, &node.host);
                    continue 'nodes;
                }
                st.nodes_out += 1;
            }
            cands.push(Cand {
                node,
                adjusted: None,
                fits: 0,
                affinity: false,
                choice: None,
                tier_ideal: false,
                ideal: false,
                tie: 0,
                key: Default::default(),
            });
        }
        if cands.is_empty() {
            let outcome = match impossible_reason(ask, demand, cx.settings, view) {
                Some(reason) => Outcome::Impossible { reason },
                None => Outcome::NotNow {
                    reason: not_now_reason(&trace),
                },
            };
            return Selection { outcome, trace };
        }
        for stage in stages::SET_STAGES {
            let mut st = StageTrace::new(stage.name(), cands.len());
            stage.run(&mut cx, &mut cands, &mut st);
            st.nodes_out = cands.len();
            let emptied = cands.is_empty();
            trace.stages.push(st);
            if emptied {
                let outcome = match impossible_reason(ask, demand, cx.settings, view) {
                    Some(reason) => Outcome::Impossible { reason },
                    None => Outcome::NotNow {
                        reason: not_now_reason(&trace),
                    },
                };
                return Selection { outcome, trace };
            }
        }
        let k = ask.resources.gpus;
        trace.candidates = cands.iter().take(5).map(|c| stages::summarize(c, k)).collect();
        let best = &cands[0];
        let ports = match &cx.ports {
            PortPlan::Fixed(p) => Some(p.clone()),
            PortPlan::PerNode { statics, dynamic } => best
                .avail()
                .ports
                .subtract(statics)
                .random_subset(*dynamic, settings.container_min_port, cx.rng)
                .map(|d| statics.union(&d)),
        };
        let Some(ports) = ports else {
            // The ports stage kept only nodes with enough free ports, so this is a bug.
            return Selection {
                outcome: Outcome::NotNow {
                    reason: format!("no free ports left on {}", best.node.host),
                },
                trace,
            };
        };
        let choice = best.choice.unwrap_or(GpuChoice {
            mask: 0,
            tier: 0,
            weight: 0,
        });
        let placement = Placement {
            host: best.node.host.clone(),
            rack: best.node.rack.clone(),
            resources: Resources::with_mask(ask.resources.cpu, ask.resources.memory_mb, choice.mask, ports),
            gpu_tier: choice.tier,
            gpu_weight: choice.weight,
            gpu_tier_ideal: k == 0 || best.tier_ideal,
        };
        Selection {
            outcome: Outcome::Placed(placement),
            trace,
        }
    }
}

/// Union of two amounts where overlaps are allowed (tried asks may repeat bits).
fn union(a: &Resources, b: &Resources) -> Resources {
    let mask = a.gpu_mask | b.gpu_mask;
    Resources {
        cpu: a.cpu.saturating_add(b.cpu),
        memory_mb: a.memory_mb.saturating_add(b.memory_mb),
        gpus: mask.count_ones(),
        gpu_mask: mask,
        ports: a.ports.union(&b.ports),
    }
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

/// A rule an empty node must pass to ever take the task, and what to say when no
/// node passes it.
struct NeverFits<'a> {
    why: &'static str,
    passes: Box<dyn Fn(&Node) -> bool + 'a>,
    /// Detail for the message, from the whole cluster (e.g. the largest node).
    detail: Box<dyn Fn(&ClusterView) -> String + 'a>,
}

/// Why no node of this cluster could ever take the task, even if empty; `None` when
/// some node could. The rules follow the stage order so the first failing one is the
/// most basic reason.
fn impossible_reason(
    ask: &TaskAsk<'_>,
    demand: &JobDemand,
    settings: &SelectSettings,
    view: &ClusterView,
) -> Option<String> {
    let r = ask.resources;
    let want_label = ask.node_label.map(str::trim).unwrap_or("");
    let statics = match ask.reuse_ports {
        Some(p) => p.clone(),
        None => r.static_ports(),
    };
    let dynamic = if ask.reuse_ports.is_some() {
        0
    } else {
        r.dynamic_port_count()
    };
    let explicit = r.gpu_mask.unwrap_or(0);
    let largest = |f: fn(&Node) -> u64| move |v: &ClusterView| v.nodes().map(f).max().unwrap_or(0);
    let rules = [
        NeverFits {
            why: "no node is in the task's label partition",
            passes: Box::new(|n: &Node| n.partition() == want_label),
            detail: Box::new(|_: &ClusterView| format!(" (asks `{want_label}`)")),
        },
        NeverFits {
            why: "no node has one of the GPU types asked for",
            passes: Box::new(|n: &Node| {
                ask.gpu_types.is_empty() || n.gpu_type.as_ref().is_some_and(|t| ask.gpu_types.contains(t))
            }),
            detail: Box::new(|_: &ClusterView| format!(" (asks {})", ask.gpu_types.join(","))),
        },
        NeverFits {
            why: "the job asks for no GPU and only GPU nodes remain (allow_none_gpu_job_on_gpu_node is off)",
            passes: Box::new(|n: &Node| {
                demand.job_uses_gpus || settings.allow_none_gpu_job_on_gpu_node || n.total().gpu_count() == 0
            }),
            detail: Box::new(|_: &ClusterView| String::new()),
        },
        NeverFits {
            why: "no node has that many CPUs",
            passes: Box::new(|n: &Node| r.cpu <= n.total().cpu),
            detail: Box::new(move |v: &ClusterView| {
                format!(
                    " (asks {}, largest node has {})",
                    r.cpu,
                    largest(|n| u64::from(n.total().cpu))(v)
                )
            }),
        },
        NeverFits {
            why: "no node has that much memory",
            passes: Box::new(|n: &Node| r.memory_mb <= n.total().memory_mb),
            detail: Box::new(move |v: &ClusterView| {
                format!(
                    " (asks {} MB, largest node has {} MB)",
                    r.memory_mb,
                    largest(|n| n.total().memory_mb)(v)
                )
            }),
        },
        NeverFits {
            why: "no node has that many GPUs (or the explicit GPU mask)",
            passes: Box::new(|n: &Node| r.gpus <= n.total().gpu_count() && explicit & n.total().gpu_mask == explicit),
            detail: Box::new(move |v: &ClusterView| {
                format!(
                    " (asks {}, largest node has {})",
                    r.gpus,
                    largest(|n| u64::from(n.total().gpu_count()))(v)
                )
            }),
        },
        NeverFits {
            why: "no node offers those ports",
            passes: Box::new(|n: &Node| {
                let t = &n.total().ports;
                statics.is_subset(t) && t.subtract(&statics).count_at_least(settings.container_min_port) >= dynamic
            }),
            detail: Box::new(|_: &ClusterView| String::new()),
        },
    ];
    let mut nodes: Vec<&Node> = view.nodes().collect();
    for rule in &rules {
        nodes.retain(|n| (rule.passes)(n));
        if nodes.is_empty() {
            return Some(format!("{}{}", rule.why, (rule.detail)(view)));
        }
    }
    None
}

#[cfg(test)]
mod tests;
