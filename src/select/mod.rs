//! The select pipeline (DESIGN.md §4): for one task, the node, the exact GPUs and
//! the ports, with a trace of why every other node was not chosen.
//!
//! All state (the `allNodes` view, outstanding requests, recently tried resources,
//! the tie-break RNG and a cache of GPU choices) sits behind one `parking_lot::Mutex`
//! in [`Selector`], so a choice and the booking of its resources are one step.
//! The stages themselves are in `stages.rs`, in order, with the reasons for that order.

mod demand;
mod fast_hash;
mod index;
mod objective;
mod placement;
mod plan;
mod stages;
mod trace;

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

use fast_hash::{FastMap, FastSet};
use index::NodeIndex;
use rand::Rng;

use crate::cluster::{ClusterView, Node};
use crate::config::{RackPolicy, SelectSettings};
use crate::resources::{CustomResources, GpuMask, PortSet, Resources, Shortfall};
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

/// Memoised GPU picks: nodes of one topology (by content) with one free mask share the
/// answer, which keeps scoring a bucket of the index cheap.
#[derive(Default)]
pub(crate) struct ChoiceCache {
    map: fast_hash::FastMap<(u32, GpuMask, GpuMask, objective::Want), Option<objective::GpuPick>>,
}

impl ChoiceCache {
    const MAX_ENTRIES: usize = 200_000;

    /// [`objective::pick`], memoised by (topology id, free, held, want). `topo_id` is the
    /// index's content id of `topo` (0 = none).
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
        let c = objective::pick(topo, free, held, want);
        self.map.insert(key, c);
        c
    }
}

/// The per-call context the stages share.
pub(crate) struct Cx<'a> {
    pub ask: &'a TaskAsk<'a>,
    pub demand: &'a JobDemand,
    pub settings: &'a SelectSettings,
    pub tried: fast_hash::FastMap<&'a str, Resources>,
    pub rng: &'a mut StdRng,
    pub choices: &'a mut ChoiceCache,
    pub ports: PortPlan,
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

    pub fn settings(&self) -> SelectSettings {
        self.state.lock().settings.clone()
    }
}

/// A node that passed the resource check, with its place in the order.
struct Scored<'a> {
    key: objective::RankKey,
    node: &'a Node,
    /// Free resources minus recently tried asks, when some were tried on this node.
    adjusted: Option<Resources>,
    pick: objective::GpuPick,
    fits: u32,
}

impl Scored<'_> {
    fn avail(&self) -> &Resources {
        self.adjusted.as_ref().unwrap_or(self.node.free())
    }
}

/// Inserts `c` into `cands` (sorted best first) and keeps the best `want`.
fn keep_best<'a>(cands: &mut Vec<Scored<'a>>, c: Scored<'a>, want: usize) {
    let at = cands.partition_point(|x| x.key <= c.key);
    if at < want {
        cands.insert(at, c);
        cands.truncate(want);
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
            ..
        } = self;
        let mut cx = Cx {
            ask,
            demand,
            settings,
            tried: tried_owned.iter().map(|(h, r)| (h.as_str(), r.clone())).collect(),
            rng,
            choices,
            ports: PortPlan::Fixed(PortSet::new()),
        };
        let (ports, port_note) = stages::port_plan(&cx);
        cx.ports = ports;
        let req = cx.request();
        let k = if ask.resources.gpu_share.is_some() {
            1
        } else {
            ask.resources.gpus
        };
        let need = demand.remaining_tasks().max(1);
        let keep = (ask.waiting_tasks.max(1) as usize)
            .saturating_mul(settings.candidate_nodes_factor as usize)
            .clamp(1, MAX_KEEP);
        let want = keep.max(2);
        let filters = stages::NODE_FILTERS;
        let mut fstages: Vec<StageTrace> = filters.iter().map(|f| StageTrace::new(f.name(), 0)).collect();
        let mut res_stage = StageTrace::new("resources", 0);

        // Nodes judged one by one: recently tried ones (their availability is adjusted),
        // the job's hosts (the union of its GPUs) and the racks holding the job
        // (criterion 3). Every other node is judged through its index bucket.
        let rack_on = settings.rack_policy != RackPolicy::None;
        let mut job_racks: FastSet<&str> = FastSet::default();
        let mut special: FastMap<u32, ()> = FastMap::default();
        for (h, _) in demand.hosts() {
            if let Some(n) = view.get(h) {
                job_racks.insert(n.rack.as_str());
            }
            if let Some(s) = index.slot(h) {
                special.insert(s, ());
            }
        }
        for h in cx.tried.keys() {
            if let Some(s) = index.slot(h) {
                special.insert(s, ());
            }
        }
        // Racks holding the job are walked through their own per-rack buckets, with
        // criterion 3 set; the global buckets skip their nodes.
        let job_rack_ids: Vec<u32> = if rack_on {
            job_racks.iter().filter_map(|r| index.rack_id(r)).collect()
        } else {
            Vec::new()
        };
        let in_job_rack =
            |slot: u32| !job_rack_ids.is_empty() && index.slot_rack(slot).is_some_and(|r| job_rack_ids.contains(&r));
        // Nodes of each source (global bucket, or a job rack's part of it) judged apart.
        let mut excluded: FastMap<(u32, Option<u32>), usize> = FastMap::default();
        for &s in special.keys() {
            if let Some(b) = index.bucket_of_slot(s) {
                let rack = index.slot_rack(s).filter(|_| in_job_rack(s));
                *excluded.entry((b, rack)).or_insert(0) += 1;
            }
        }
        let mut sources: Vec<(u32, Option<u32>)> = (0..index.buckets().len() as u32).map(|b| (b, None)).collect();
        for &r in &job_rack_ids {
            for (b, set) in index.rack_buckets(r) {
                *excluded.entry((b, None)).or_insert(0) += set.len();
                sources.push((b, Some(r)));
            }
        }
        let set_of = |b: u32, rack: Option<u32>| match rack {
            None => Some(&index.buckets()[b as usize].nodes),
            Some(r) => index.rack_set(r, b),
        };
        let skip =
            |m: &index::Member, rack: Option<u32>| special.contains_key(&m.3) || (rack.is_none() && in_job_rack(m.3));

        // Per bucket: the filters, then the GPU and CPU parts of the shortfall rule, then
        // a bound on the key of its best node (the order's GPU half is the bucket's).
        let gpu_req = Resources {
            cpu: 0,
            memory_mb: 0,
            gpus: req.gpus,
            gpu_mask: req.gpu_mask,
            gpu_shares: req.gpu_shares.clone(),
            ports: PortSet::new(),
            custom: Default::default(),
        };
        let mut live: Vec<(objective::RankKey, u32, Option<u32>, u32)> = Vec::new();
        for &(bi, rack) in &sources {
            let b = &index.buckets()[bi as usize];
            let Some(set) = set_of(bi, rack) else {
                continue;
            };
            let count = set
                .len()
                .saturating_sub(excluded.get(&(bi, rack)).copied().unwrap_or(0));
            if count == 0 {
                continue;
            }
            let members = || set.iter().filter(|m| !skip(m, rack));
            let examples = || {
                members()
                    .take(trace::EXAMPLE_HOSTS)
                    .map(|m| index.host(m.3).to_string())
            };
            let facts = index.facts(&b.key);
            let failed = filters
                .iter()
                .enumerate()
                .find_map(|(i, f)| f.check(&cx, &facts).err().map(|r| (i, r)));
            if let Some((i, reason)) = failed {
                fstages[i].drop_many(reason, count, examples());
                continue;
            }
            let mut free = index.free_gpus(&b.key);
            if let Some(sf) = gpu_req.shortfall(&free) {
                res_stage.drop_many(sf.reason(), count, examples());
                continue;
            }
            let mut low = 0;
            for m in set.range(..(req.cpu, 0, 0, 0)) {
                if !skip(m, rack) {
                    res_stage.drop_node(Shortfall::Cpu.reason(), index.host(m.3));
                    low += 1;
                }
            }
            let Some(first) = set.range((req.cpu, 0, 0, 0)..).find(|m| !skip(m, rack)) else {
                continue;
            };
            let fits = demand
                .capacity_with(u32::MAX, u64::MAX, b.key.free_gpus, &free.gpu_shares, u32::MAX, None)
                .max(1)
                .min(need);
            let topo = index.topology(b.key.topo).map(|t| &**t);
            // The job's hosts are judged one by one, so a bucket's node holds none of its tasks.
            let spread = demand.has_hosts() || fits < need;
            let Some(pick) = stages::pick_gpus(&mut cx, b.key.topo, topo, &free, 0, fits, spread) else {
                res_stage.drop_many(
                    "no GPU set of the requested size on this node",
                    count - low,
                    members()
                        .skip(low)
                        .take(trace::EXAMPLE_HOSTS)
                        .map(|m| index.host(m.3).to_string()),
                );
                continue;
            };
            // The bound: the best key any node of the bucket can have (least CPU, no memory).
            free.cpu = first.0;
            free.memory_mb = 0;
            let bound = stages::rank_key(false, fits, rack.is_some(), &pick, &free, b.key.total_gpus, 0);
            live.push((bound, bi, rack, fits));
        }

        // The nodes judged one by one.
        let mut cands: Vec<Scored<'_>> = Vec::new();
        let mut scored_ok = 0usize;
        let mut specials: Vec<u32> = special.keys().copied().collect();
        specials.sort_unstable();
        for slot in specials {
            let Some(bkey) = index.bucket_of_slot(slot).map(|b| index.buckets()[b as usize].key) else {
                continue;
            };
            // Screened on its bucket's key first (no node lookup): most nodes of a large
            // job's racks are full.
            let facts = index.facts(&bkey);
            let failed = filters
                .iter()
                .enumerate()
                .find_map(|(i, f)| f.check(&cx, &facts).err().map(|r| (i, r)));
            if let Some((i, reason)) = failed {
                fstages[i].drop_node(reason, index.host(slot));
                continue;
            }
            if let Some(sf) = gpu_req.shortfall(&index.free_gpus(&bkey)) {
                res_stage.drop_node(sf.reason(), index.host(slot));
                continue;
            }
            let Some(node) = view.get(index.host(slot)) else {
                continue;
            };
            let adjusted = cx.tried.get(node.host.as_str()).map(|t| node.free().subtract(t));
            let topo_id = bkey.topo;
            let rack = rack_on && job_racks.contains(node.rack.as_str());
            let avail = adjusted.as_ref().unwrap_or(node.free());
            match stages::score(&mut cx, &req, node, topo_id, avail, rack) {
                Err(r) => res_stage.drop_node(r, &node.host),
                Ok((mut key, pick, fits)) => {
                    key.tie = index.tie(slot);
                    scored_ok += 1;
                    keep_best(
                        &mut cands,
                        Scored {
                            key,
                            node,
                            adjusted,
                            pick,
                            fits,
                        },
                        want,
                    );
                }
            }
        }

        // The walk: buckets in the order of their bound; inside a bucket, nodes in the
        // order of the key's tail (free CPU, memory, tie). It stops once `want` nodes are
        // known to beat everything not yet visited.
        live.sort_unstable_by_key(|a| a.0);
        for &(bound, bi, rack, fits_b) in &live {
            if cands.len() >= want && cands[want - 1].key <= bound {
                break;
            }
            let b = &index.buckets()[bi as usize];
            let Some(set) = set_of(bi, rack) else {
                continue;
            };
            let mut full = 0;
            for m in set.range((req.cpu, 0, 0, 0)..) {
                if skip(m, rack) {
                    continue;
                }
                let Some(node) = view.get(index.host(m.3)) else {
                    continue;
                };
                match stages::score(&mut cx, &req, node, b.key.topo, node.free(), rack.is_some()) {
                    Err(r) => res_stage.drop_node(r, &node.host),
                    Ok((mut key, pick, fits)) => {
                        key.tie = m.2;
                        scored_ok += 1;
                        full += usize::from(fits == fits_b);
                        keep_best(
                            &mut cands,
                            Scored {
                                key,
                                node,
                                adjusted: None,
                                pick,
                                fits,
                            },
                            want,
                        );
                        if full >= want {
                            break;
                        }
                    }
                }
            }
        }

        // The trace, counted from the index.
        let mut trace = SelectionTrace::default();
        let mut alive = index.len();
        for mut st in fstages {
            st.nodes_in = alive;
            alive -= st.dropped_count().min(alive);
            st.nodes_out = alive;
            trace.stages.push(st);
        }
        let mut ports_stage = StageTrace::new("ports", alive);
        ports_stage.note = port_note;
        trace.stages.push(ports_stage);
        res_stage.nodes_in = alive;
        alive -= res_stage.dropped_count().min(alive);
        res_stage.nodes_out = alive;
        let custom_short = res_stage.dropped.iter().any(|g| g.reason == Shortfall::Custom.reason());
        if custom_short || (alive == 0 && !ask.resources.custom.is_empty()) {
            res_stage.note = custom_note(&ask.resources.custom, view);
        }
        trace.stages.push(res_stage);
        let mut rack_stage = StageTrace::new("rack-policy", alive);
        if rack_on && !job_racks.is_empty() {
            rack_stage.note = Some("racks already holding the job rank first after node count (criterion 3)".into());
        }
        trace.stages.push(rack_stage);
        let mut pack = StageTrace::new("job-packing", alive);
        let kept = keep.min(cands.len());
        for c in cands.iter().skip(kept) {
            pack.drop_node(
                "ranked below the candidate cut (waiting tasks × candidate_nodes_factor)",
                &c.node.host,
            );
        }
        let cut = scored_ok.saturating_sub(cands.len());
        if cut > 0 {
            pack.drop_many(
                "ranked below the candidate cut (waiting tasks × candidate_nodes_factor)",
                cut,
                std::iter::empty(),
            );
        }
        let unvisited = alive.saturating_sub(scored_ok);
        if unvisited > 0 {
            pack.drop_many(
                "not visited: the node index ranks it below the candidates kept",
                unvisited,
                std::iter::empty(),
            );
        }
        pack.nodes_out = kept;
        trace.stages.push(pack);

        if cands.is_empty() {
            let outcome = match impossible_reason(ask, demand, cx.settings, view) {
                Some(reason) => Outcome::Impossible { reason },
                None => Outcome::NotNow {
                    reason: custom_wait_reason(&trace).unwrap_or_else(|| not_now_reason(&trace)),
                },
            };
            return Selection { outcome, trace };
        }
        let tier_ideal = |c: &Scored<'_>| {
            k <= 1
                || c.node
                    .topology
                    .as_deref()
                    .is_none_or(|t| c.pick.task_tier >= t.best_tier(k))
        };
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
                gpu_tier_ideal: tier_ideal(c),
                gpu_weight: c.pick.task_weight,
                union_tier: c.pick.union_tier,
                union_weight: c.pick.union_weight,
            })
            .collect();
        let best = &cands[0];
        trace.alternative = cands.get(1).map(|c| Alternative {
            host: c.node.host.clone(),
            lost_on: c.key.lost_on(&best.key),
        });
        // The topology wait (docs/DESIGN-NOTES.md, "Topology wait"): the best set is below its
        // node's ideal tier and other jobs hold GPUs on nodes this task may use, so a release
        // may free a better set.
        let may_use = |key: &index::BucketKey| {
            key.total_gpus >= k && filters.iter().all(|f| f.check(&cx, &index.facts(key)).is_ok())
        };
        let may_improve = !tier_ideal(best)
            && ask.resources.gpu_share.is_none()
            && index.held_gpus(may_use) > u64::from(demand.held_gpu_count());
        if may_improve && ask.topology_wait {
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
            return Selection {
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
                },
                trace,
            };
        }
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
            // The resource check kept only nodes with enough free ports, so this is a bug.
            return Selection {
                outcome: Outcome::NotNow {
                    reason: format!("no free ports left on {}", best.node.host),
                },
                trace,
            };
        };
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
        let placement = Placement {
            host: best.node.host.clone(),
            rack: best.node.rack.clone(),
            resources,
            gpu_tier: best.pick.task_tier,
            gpu_weight: best.pick.task_weight,
            gpu_tier_ideal: tier_ideal(best),
            union_tier: best.pick.union_tier,
            may_improve,
            nic: best
                .node
                .topology
                .as_deref()
                .map(|t| crate::topology::task_locality(t, best.pick.task).nics)
                .filter(|n| !n.is_empty())
                .map(|n| n.join(",")),
        };
        Selection {
            outcome: Outcome::Placed(placement),
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

/// Why no node of this cluster could ever take the task, even if empty; `None` when
/// some node could. The partition, type and none-GPU rules first (the stage order), then
/// the shortfall rule against each node's total: the reason is the dimension that
/// empties the set when the rule's dimensions are applied in order.
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
    let mut nodes: Vec<&Node> = view.nodes().collect();
    nodes.retain(|n| n.partition() == want_label);
    if nodes.is_empty() {
        return Some(format!(
            "no node is in the task's label partition (asks `{want_label}`)"
        ));
    }
    nodes.retain(|n| ask.gpu_types.is_empty() || n.gpu_type.as_ref().is_some_and(|t| ask.gpu_types.contains(t)));
    if nodes.is_empty() {
        return Some(format!(
            "no node has one of the GPU types asked for (asks {})",
            ask.gpu_types.join(",")
        ));
    }
    nodes.retain(|n| demand.job_uses_gpus || settings.allow_none_gpu_job_on_gpu_node || n.total().gpu_count() == 0);
    if nodes.is_empty() {
        return Some(
            "the job asks for no GPU and only GPU nodes remain (allow_none_gpu_job_on_gpu_node is off)".into(),
        );
    }
    let req = r.request_with_ports(statics);
    let mut worst: Option<Shortfall> = None;
    for n in &nodes {
        match req.shortfall_with_dynamic(n.total(), dynamic, settings.container_min_port) {
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

#[cfg(test)]
mod tests;
