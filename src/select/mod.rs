//! The select pipeline (DESIGN.md §4): for one task, the node, the exact GPUs and
//! the ports, with a trace of why every other node was not chosen.
//!
//! All state (the `allNodes` view, outstanding requests, recently tried resources,
//! the tie-break RNG and a cache of GPU choices) sits behind one `parking_lot::Mutex`
//! in [`Selector`], so a choice and the booking of its resources are one step.
//! The stages themselves are in `stages.rs`, in order, with the reasons for that order;
//! "may this task use this node" is `feasible.rs` (shared with the RM). One select is a
//! chain of named steps (`SelectorState::select`): the port plan, the search over the
//! node index (`walk.rs`), then the trace, the never / not-now reasons, the topology wait,
//! the port draw and the placement (`outcome.rs`).

mod demand;
mod fast_hash;
pub mod feasible;
mod index;
mod objective;
mod one_type;
mod outcome;
mod placement;
mod plan;
mod stages;
mod trace;
mod walk;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;

pub use demand::{JobDemand, TaskShape};
pub use objective::Alternative;
pub use placement::{request_order, PlacementRound, Step, TaskRef, TaskSlot};
pub use plan::{assign_port_labels, plan_job, JobPlan, PlannedTask, UnplacedTask};
pub use trace::{CandidateSummary, DropGroup, SelectionTrace, StageTrace};

use index::NodeIndex;
use rand::Rng;
use walk::Search;

use crate::cluster::{ClusterView, Node};
use crate::config::SelectSettings;
use crate::resources::{GpuMask, PortSet, Resources};
use crate::spec::TaskResources;
use crate::topology::Topology;

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
    /// The task may still wait for a GPU set of its node's ideal tier (its
    /// `select.topology_wait_sec` is not spent): a set below it, while GPUs held by other
    /// jobs may free a better one, is answered "not now" (see [`Placement::may_improve`]).
    pub topology_wait: bool,
    /// The task's declared run-time limit (`maxRunSec`): with the selector's clock
    /// ([`Selector::set_clock`]) it gives when the task will have ended, which the order's
    /// drain term compares with each node's `drain_by_ms` (issue 27). `None`: not declared.
    pub max_run_sec: Option<u64>,
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
            topology_wait: false,
            max_run_sec: None,
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
            topology_wait: false,
            max_run_sec: role.max_run_sec,
        }
    }

    /// The same ask, allowed (or not) to wait for its node's ideal GPU tier.
    pub fn with_topology_wait(self, topology_wait: bool) -> Self {
        TaskAsk { topology_wait, ..self }
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
    /// Tier of the job's GPUs on this node once the task is there (the union).
    pub union_tier: u8,
    /// Below the ideal tier while other jobs hold GPUs whose release may free a better set:
    /// a task that may still wait ([`TaskAsk::topology_wait`]) waits instead of taking it.
    pub may_improve: bool,
    /// The NIC(s) nearest the task's GPUs (comma list; what `GPUAM_NIC` will say), where the
    /// node's topology lists NICs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nic: Option<String>,
}

/// The pipeline's answer.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum Outcome {
    Placed(Placement),
    /// Nothing fits now; it may later.
    NotNow {
        reason: String,
        /// What kind of wait it is (`Resources`, or `Topology` when it holds out for its
        /// ideal GPU tier).
        wait: crate::reason::Kind,
    },
    /// Nothing in this cluster could ever take it.
    Impossible {
        reason: String,
    },
}

impl Outcome {
    /// Why the task waits, when it does: the kind and the detail (the job machine adds
    /// since and until).
    pub fn wait_reason(&self) -> Option<crate::reason::Reason> {
        use crate::reason::{Kind, Reason};
        match self {
            Outcome::Placed(_) => None,
            Outcome::NotNow { reason, wait } => Some(Reason::new(*wait, reason.clone())),
            Outcome::Impossible { reason } => Some(Reason::new(
                Kind::Impossible,
                format!("can never fit this cluster: {reason}"),
            )),
        }
    }
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

/// Memoised GPU picks: nodes of one topology (by content) with one free mask share the
/// answer, which keeps scoring a bucket of the index cheap.
#[derive(Default)]
pub(crate) struct ChoiceCache {
    map: fast_hash::FastMap<(u32, GpuMask, GpuMask, objective::Want), Option<objective::GpuPick>>,
    /// W*(n): the best pair weight of an `n`-GPU set on the empty machine, by (topology id, n).
    best_weight: fast_hash::FastMap<(u32, u32), u32>,
}

impl ChoiceCache {
    const MAX_ENTRIES: usize = 200_000;

    /// [`objective::pick`], memoised by (topology id, free, held, want), with
    /// [`objective::GpuPick::weight_ideal`] set against W* of the union's size. `topo_id` is
    /// the index's content id of `topo` (0 = none).
    pub fn pick(
        &mut self,
        topo_id: u32,
        topo: Option<&Topology>,
        free: GpuMask,
        held: GpuMask,
        want: objective::Want,
    ) -> Option<objective::GpuPick> {
        let key = (topo_id, free, held, want);
        if let Some(c) = self.map.get(&key) {
            return *c;
        }
        if self.map.len() >= Self::MAX_ENTRIES {
            self.map.clear();
        }
        let mut c = objective::pick(topo, free, held, want);
        if let (Some(p), Some(t)) = (c.as_mut(), topo) {
            let n = p.union.count_ones();
            let best = *self
                .best_weight
                .entry((topo_id, n))
                .or_insert_with(|| crate::topology::choose(Some(t), t.all_mask(), n).map_or(0, |g| g.weight));
            p.weight_ideal = p.union_weight >= best;
        }
        self.map.insert(key, c);
        c
    }
}

/// The per-call context the stages share.
pub(crate) struct Cx<'a> {
    pub ask: &'a TaskAsk<'a>,
    /// What the feasibility rule knows of the task (partition, GPU types, none-GPU).
    pub task: feasible::TaskFacts<'a>,
    pub demand: &'a JobDemand,
    pub settings: &'a SelectSettings,
    pub tried: fast_hash::FastMap<&'a str, Resources>,
    pub rng: &'a mut StdRng,
    pub choices: &'a mut ChoiceCache,
    pub ports: PortPlan,
    /// Other jobs wait behind this one (see [`Selector::set_others_wait`]).
    pub others_wait: bool,
    /// The selector's clock and when the task will have ended by its declared limit (ms
    /// since the epoch): `Some` turns the drain term on ([`stages::drain_term`]).
    pub ends_by_ms: Option<(u64, u64)>,
}

impl Cx<'_> {
    /// The request as the resource stage checks it.
    pub fn request(&self) -> Resources {
        let ports = match &self.ports {
            PortPlan::Fixed(p) => p.clone(),
            PortPlan::PerNode { statics, .. } => statics.clone(),
        };
        self.ask.resources.request_with_ports(ports)
    }
}

struct SelectorState {
    view: ClusterView,
    settings: SelectSettings,
    /// Asks that were rejected or timed out, per host, until their time is up.
    tried: HashMap<String, Vec<(Resources, Instant)>>,
    rng: StdRng,
    choices: ChoiceCache,
    /// The view's nodes by bucket and by rack, updated with every change of the view.
    index: NodeIndex,
    /// Other jobs wait for GPUs behind the one being placed (queue pressure, issue 27).
    others_wait: bool,
    /// The caller's clock (ms since the epoch), for the drain term; `None` turns it off.
    now_ms: Option<u64>,
}

/// Most candidates job packing keeps (the pick needs the best and the next best; the
/// trace shows a few).
const MAX_KEEP: usize = 16;

/// The select pipeline and the node view it works on.
pub struct Selector {
    state: Mutex<SelectorState>,
}

impl Selector {
    pub fn new(view: ClusterView, settings: SelectSettings) -> Self {
        let mut rng = match settings.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_entropy(),
        };
        let salt: u64 = rng.gen();
        let mut state = SelectorState {
            view: ClusterView::default(),
            settings,
            tried: HashMap::new(),
            rng,
            choices: ChoiceCache::default(),
            index: NodeIndex::new(salt),
            others_wait: false,
            now_ms: None,
        };
        // The view as given, not copied into a new one: an AM's first view is every node
        // of the cluster (issue 29).
        let mut view = view;
        view.retain_usable();
        for n in view.nodes_mut() {
            state.share_topology(n);
        }
        state.view = view;
        state.index.rebuild(state.view.nodes());
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
        let SelectorState { view, index, .. } = &mut *st;
        if let Some(n) = view.get_mut(host) {
            let left = n.requested().subtract(r);
            n.set_requested(left);
            index.upsert(n);
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
        let host = node.host.clone();
        let SelectorState { view, index, .. } = &mut *st;
        view.apply_report(node);
        match view.get(&host) {
            Some(n) => index.upsert(n),
            None => index.remove(&host),
        }
    }

    /// Reads the view under the lock.
    pub fn with_view<R>(&self, f: impl FnOnce(&ClusterView) -> R) -> R {
        f(&self.state.lock().view)
    }

    /// Sets when `host` is whole again as a node report would say (`Node::drain_by_ms`): for
    /// the simulator, which books through the selector instead of reading reports.
    pub fn set_drain_by(&self, host: &str, drain_by_ms: Option<u64>) {
        if let Some(n) = self.state.lock().view.get_mut(host) {
            n.drain_by_ms = drain_by_ms;
        }
    }

    /// The time now (ms since the epoch) as the caller's clock has it: with a task's declared
    /// limit it says when the task will have ended (the drain term; issue 27). Kept until
    /// set again; the pipeline reads no clock of its own.
    pub fn set_clock(&self, now_ms: u64) {
        self.state.lock().now_ms = Some(now_ms);
    }

    /// Says whether other jobs wait for GPUs behind the job placed next (queue pressure;
    /// issue 27, docs/DESIGN-NOTES.md "Packing first while others wait"): while they do, the
    /// order packs nodes (fewest free GPUs) right after the tiers, before the ideal weight.
    /// An input of the decision, kept until set again; `false` (the default) is the order
    /// of an idle queue. The simulator sets it from its queue, the AM from the RM's allocate
    /// answer (`othersWaiting`).
    pub fn set_others_wait(&self, others_wait: bool) {
        self.state.lock().others_wait = others_wait;
    }

    /// Whether other jobs wait, as last set ([`Selector::set_others_wait`]).
    pub fn others_wait(&self) -> bool {
        self.state.lock().others_wait
    }

    /// How many GPU types the view's nodes have, up to `at_most`: O(buckets), not O(nodes)
    /// (`one_type` has nothing to choose where there is one).
    pub fn gpu_types(&self, at_most: usize) -> usize {
        let st = self.state.lock();
        let mut seen: Vec<u32> = Vec::new();
        for b in st
            .index
            .buckets()
            .iter()
            .filter(|b| !b.nodes.is_empty() && b.key.gpu_type != 0)
        {
            if !seen.contains(&b.key.gpu_type) {
                seen.push(b.key.gpu_type);
                if seen.len() >= at_most {
                    break;
                }
            }
        }
        seen.len()
    }

    pub fn settings(&self) -> SelectSettings {
        self.state.lock().settings.clone()
    }
}

impl SelectorState {
    /// Makes nodes with equal link matrices share one topology (by content).
    fn share_topology(&mut self, node: &mut Node) {
        if let Some(t) = &node.topology {
            let id = self.index.topo_id(t);
            if let Some(shared) = self.index.topology(id) {
                node.topology = Some(shared.clone());
            }
        }
    }

    fn replace_nodes(&mut self, mut nodes: Vec<Node>) {
        for n in &mut nodes {
            self.share_topology(n);
        }
        self.view.replace_all(nodes);
        self.index.rebuild(self.view.nodes());
    }

    fn add_requested(&mut self, host: &str, r: &Resources) -> bool {
        let Some(n) = self.view.get_mut(host) else {
            return false;
        };
        match n.requested().try_add(r) {
            Ok(sum) => {
                n.set_requested(sum);
                self.index.upsert(n);
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

    /// One select: the chain of steps, in order. `stages.rs` says why the stages come in
    /// this order; `walk.rs` runs the search, `outcome.rs` turns it into the answer.
    fn select(&mut self, ask: &TaskAsk<'_>, demand: &JobDemand) -> Selection {
        let tried_owned = if self.settings.skip_local_tried_resource && !self.tried.is_empty() {
            self.live_tried()
        } else {
            HashMap::new()
        };
        let SelectorState {
            view,
            settings,
            rng,
            choices,
            index,
            others_wait,
            now_ms,
            ..
        } = self;
        let mut cx = Cx {
            ask,
            task: outcome::task_facts(ask, demand, settings),
            demand,
            settings,
            tried: tried_owned.iter().map(|(h, r)| (h.as_str(), r.clone())).collect(),
            rng,
            choices,
            ports: PortPlan::Fixed(PortSet::new()),
            others_wait: *others_wait,
            ends_by_ms: now_ms
                .zip(ask.max_run_sec)
                .map(|(now, run)| (now, now.saturating_add(run.saturating_mul(1000)))),
        };
        // 1. How the ports are decided (stage 5).
        let (ports, port_note) = stages::port_plan(&cx);
        cx.ports = ports;
        // 2. The search: node filters, resources, rack and packing over the index (stages 1–8).
        let mut search = Search::run(&mut cx, view, index);
        // 3. The trace, counted from the index.
        let mut trace = outcome::trace_of(&mut search, index.len(), port_note, ask, view);
        // 4. No candidate: never, or not now.
        let Some(best) = search.cands.first() else {
            return outcome::no_candidate(ask, demand, settings, view, trace);
        };
        // 5. The candidates shown and the runner-up.
        let k = outcome::gpus_of(ask);
        outcome::summarize(&mut trace, &search, k);
        // 6. The topology wait (stage 9).
        let may_improve = outcome::may_improve(&cx, &search, best, k);
        if may_improve && ask.topology_wait {
            let kept = search.keep.min(search.cands.len());
            return outcome::topology_wait(trace, best, kept, k, settings);
        }
        // 7. The draw of the dynamic ports on the picked node.
        let Some(ports) = outcome::draw_ports(&mut cx, best) else {
            return Selection {
                outcome: Outcome::NotNow {
                    reason: format!("no free ports left on {}", best.node.host),
                    wait: crate::reason::Kind::Resources,
                },
                trace,
            };
        };
        // 8. The placement.
        Selection {
            outcome: Outcome::Placed(outcome::placement(ask, best, ports, k, may_improve)),
            trace,
        }
    }
}

/// Union of two amounts where overlaps are allowed (tried asks may repeat bits). A tried
/// share marks its whole GPU as tried (the next choices avoid that GPU for a while).
fn union(a: &Resources, b: &Resources) -> Resources {
    let mask = a.gpu_mask | b.gpu_mask;
    Resources {
        cpu: a.cpu.saturating_add(b.cpu),
        memory_mb: a.memory_mb.saturating_add(b.memory_mb),
        gpus: mask.count_ones(),
        gpu_mask: mask,
        gpu_shares: Default::default(),
        ports: a.ports.union(&b.ports),
        custom: a.custom.add(&b.custom),
    }
}

#[cfg(test)]
mod tests;
