//! The candidate search of one select (stages 1–8 of `stages.rs` over the node index):
//! which nodes are judged one by one, the screen of every index bucket, the scoring of
//! the nodes judged one by one, and the walk over the buckets in the order of their best
//! possible key, which stops once the kept candidates beat everything not yet visited.
//! Each step counts what it drops in its stage's trace. No I/O.

use super::fast_hash::{FastMap, FastSet};
use super::index::{BucketKey, Member, NodeIndex};
use super::objective::{GpuPick, RankKey};
use super::stages::{self, NODE_FILTERS};
use super::trace::{self, StageTrace};
use super::{Cx, MAX_KEEP};
use crate::cluster::{ClusterView, Node};
use crate::config::RackPolicy;
use crate::resources::{PortSet, Resources, Shortfall};

/// With the drain term on (a task that declares its run time), nodes of one bucket differ
/// in it: this many more of a bucket are judged beyond those the pick needs.
pub(crate) const DRAIN_SCAN_NODES: usize = 256;

/// A node that passed the resource check, with its place in the order.
pub(crate) struct Scored<'v> {
    pub key: RankKey,
    pub node: &'v Node,
    /// Free resources minus recently tried asks, when some were tried on this node.
    pub adjusted: Option<Resources>,
    pub pick: GpuPick,
    pub fits: u32,
}

impl Scored<'_> {
    pub fn avail(&self) -> &Resources {
        self.adjusted.as_ref().unwrap_or(self.node.free())
    }
}

/// Inserts `c` into `cands` (sorted best first) and keeps the best `want`.
fn keep_best<'v>(cands: &mut Vec<Scored<'v>>, c: Scored<'v>, want: usize) {
    let at = cands.partition_point(|x| x.key <= c.key);
    if at < want {
        cands.insert(at, c);
        cands.truncate(want);
    }
}

/// A source of nodes judged through the index: a global bucket, or a job rack's part of it.
type Source = (u32, Option<u32>);

/// One select's search, step by step (see [`Search::run`]).
pub(crate) struct Search<'v> {
    view: &'v ClusterView,
    index: &'v NodeIndex,
    /// The request as the resource stage checks it (static or reused ports included).
    pub req: Resources,
    /// Its GPU part alone (what a bucket's key decides).
    gpu_req: Resources,
    /// The job's unplaced tasks (at least 1).
    need: u32,
    /// Candidates kept (waiting tasks × candidate_nodes_factor, at most [`MAX_KEEP`]).
    pub keep: usize,
    /// Candidates searched for: the pick needs the best and the next best.
    want: usize,
    pub rack_on: bool,
    /// Racks holding the job (criterion 3).
    pub job_racks: FastSet<&'v str>,
    job_rack_ids: Vec<u32>,
    /// Nodes judged one by one: recently tried ones (availability adjusted) and the job's hosts.
    special: FastMap<u32, ()>,
    /// Per source, how many of its nodes are judged elsewhere.
    excluded: FastMap<Source, usize>,
    /// Per node filter, its trace (counts from the index).
    pub filter_stages: Vec<StageTrace>,
    pub res_stage: StageTrace,
    /// Buckets that passed the screen: (bound on their best key, bucket, rack, fits).
    live: Vec<(RankKey, u32, Option<u32>, u32)>,
    /// The best candidates found, best first.
    pub cands: Vec<Scored<'v>>,
    /// Nodes that passed the resource check.
    pub scored_ok: usize,
}

impl<'v> Search<'v> {
    /// The search for `cx`'s task, in order: the nodes judged one by one and the sources,
    /// the bucket screen, those nodes scored, then the walk.
    pub fn run(cx: &mut Cx<'_>, view: &'v ClusterView, index: &'v NodeIndex) -> Search<'v> {
        let mut s = Search::new(cx, view, index);
        let sources = s.sources(cx);
        s.screen_buckets(cx, &sources);
        s.score_listed(cx);
        s.walk(cx);
        s
    }

    fn new(cx: &Cx<'_>, view: &'v ClusterView, index: &'v NodeIndex) -> Search<'v> {
        let req = cx.request();
        let gpu_req = Resources {
            cpu: 0,
            memory_mb: 0,
            gpus: req.gpus,
            gpu_mask: req.gpu_mask,
            gpu_shares: req.gpu_shares.clone(),
            ports: PortSet::new(),
            custom: Default::default(),
        };
        let keep = (cx.ask.waiting_tasks.max(1) as usize)
            .saturating_mul(cx.settings.candidate_nodes_factor as usize)
            .clamp(1, MAX_KEEP);
        Search {
            view,
            index,
            req,
            gpu_req,
            need: cx.demand.remaining_tasks().max(1),
            keep,
            want: keep.max(2),
            rack_on: cx.settings.rack_policy != RackPolicy::None,
            job_racks: FastSet::default(),
            job_rack_ids: Vec::new(),
            special: FastMap::default(),
            excluded: FastMap::default(),
            filter_stages: NODE_FILTERS.iter().map(|f| StageTrace::new(f.name(), 0)).collect(),
            res_stage: StageTrace::new("resources", 0),
            live: Vec::new(),
            cands: Vec::new(),
            scored_ok: 0,
        }
    }

    /// Step 1: the nodes judged one by one — recently tried ones (their availability is
    /// adjusted), the job's hosts (the union of its GPUs) — and the racks holding the job
    /// (criterion 3), walked through their own per-rack buckets; every other node is
    /// judged through its global index bucket.
    fn sources(&mut self, cx: &Cx<'_>) -> Vec<Source> {
        let (view, index) = (self.view, self.index);
        for (h, _) in cx.demand.hosts() {
            if let Some(n) = view.get(h) {
                self.job_racks.insert(n.rack.as_str());
            }
            if let Some(s) = index.slot(h) {
                self.special.insert(s, ());
            }
        }
        for h in cx.tried.keys() {
            if let Some(s) = index.slot(h) {
                self.special.insert(s, ());
            }
        }
        if self.rack_on {
            self.job_rack_ids = self.job_racks.iter().filter_map(|r| index.rack_id(r)).collect();
        }
        for &s in self.special.keys() {
            if let Some(b) = index.bucket_of_slot(s) {
                let rack = index.slot_rack(s).filter(|_| self.in_job_rack(s));
                *self.excluded.entry((b, rack)).or_insert(0) += 1;
            }
        }
        let mut sources: Vec<Source> = (0..index.buckets().len() as u32).map(|b| (b, None)).collect();
        for &r in &self.job_rack_ids {
            for (b, set) in index.rack_buckets(r) {
                *self.excluded.entry((b, None)).or_insert(0) += set.len();
                sources.push((b, Some(r)));
            }
        }
        sources
    }

    fn in_job_rack(&self, slot: u32) -> bool {
        self.elsewhere().in_job_rack(slot)
    }

    /// Which nodes a source leaves to another.
    fn elsewhere(&self) -> Elsewhere<'_> {
        Elsewhere {
            special: &self.special,
            job_rack_ids: &self.job_rack_ids,
            index: self.index,
        }
    }

    fn set_of(&self, b: u32, rack: Option<u32>) -> Option<&'v std::collections::BTreeSet<Member>> {
        let index = self.index;
        match rack {
            None => Some(&index.buckets()[b as usize].nodes),
            Some(r) => index.rack_set(r, b),
        }
    }

    /// Step 2, per bucket: the node filters, then the GPU and CPU parts of the shortfall
    /// rule, then a bound on the key of its best node (the order's GPU half is the bucket's).
    fn screen_buckets(&mut self, cx: &mut Cx<'_>, sources: &[Source]) {
        let index = self.index;
        let (req_cpu, need) = (self.req.cpu, self.need);
        let Search {
            special,
            job_rack_ids,
            excluded,
            filter_stages,
            res_stage,
            gpu_req,
            live,
            ..
        } = self;
        let elsewhere = Elsewhere {
            special,
            job_rack_ids,
            index,
        };
        for &(bi, rack) in sources {
            let b = &index.buckets()[bi as usize];
            let set = match rack {
                None => &b.nodes,
                Some(r) => match index.rack_set(r, bi) {
                    Some(set) => set,
                    None => continue,
                },
            };
            let count = set
                .len()
                .saturating_sub(excluded.get(&(bi, rack)).copied().unwrap_or(0));
            if count == 0 {
                continue;
            }
            let members = || set.iter().filter(|m| !elsewhere.skip(m, rack));
            let examples = || {
                members()
                    .take(trace::EXAMPLE_HOSTS)
                    .map(|m| index.host(m.3).to_string())
            };
            if let Some((i, why)) = failed_filter(cx, &index.facts(&b.key)) {
                filter_stages[i].drop_many(why.reason(), count, examples());
                continue;
            }
            let mut free = index.free_gpus(&b.key);
            if let Some(sf) = gpu_req.shortfall(&free) {
                res_stage.drop_many(sf.reason(), count, examples());
                continue;
            }
            let mut low = 0;
            for m in set.range(..(req_cpu, 0, 0, 0)) {
                if !elsewhere.skip(m, rack) {
                    res_stage.drop_node(Shortfall::Cpu.reason(), index.host(m.3));
                    low += 1;
                }
            }
            let Some(first) = set.range((req_cpu, 0, 0, 0)..).find(|m| !elsewhere.skip(m, rack)) else {
                continue;
            };
            let fits = cx
                .demand
                .capacity_with(u32::MAX, u64::MAX, b.key.free_gpus, &free.gpu_shares, u32::MAX, None)
                .max(1)
                .min(need);
            let topo = index.topology(b.key.topo).map(|t| &**t);
            // The job's hosts are judged one by one, so a bucket's node holds none of its tasks.
            let spread = cx.demand.has_hosts() || fits < need;
            let Some(pick) = stages::pick_gpus(cx, b.key.topo, topo, &free, 0, fits, spread) else {
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
            let bound = stages::rank_key(
                false,
                fits,
                rack.is_some(),
                &pick,
                &free,
                b.key.total_gpus,
                cx.others_wait,
                cx.ends_by_ms.is_some(),
            );
            live.push((bound, bi, rack, fits));
        }
    }

    /// Step 3: the nodes judged one by one, screened on their bucket's key first (no node
    /// lookup: most nodes of a large job's racks are full), then scored.
    fn score_listed(&mut self, cx: &mut Cx<'_>) {
        let (view, index) = (self.view, self.index);
        let mut specials: Vec<u32> = self.special.keys().copied().collect();
        specials.sort_unstable();
        for slot in specials {
            let Some(bkey) = index.bucket_of_slot(slot).map(|b| index.buckets()[b as usize].key) else {
                continue;
            };
            if let Some((i, why)) = failed_filter(cx, &index.facts(&bkey)) {
                self.filter_stages[i].drop_node(why.reason(), index.host(slot));
                continue;
            }
            if let Some(sf) = self.gpu_req.shortfall(&index.free_gpus(&bkey)) {
                self.res_stage.drop_node(sf.reason(), index.host(slot));
                continue;
            }
            let Some(node) = view.get(index.host(slot)) else {
                continue;
            };
            let adjusted = cx.tried.get(node.host.as_str()).map(|t| node.free().subtract(t));
            let rack = self.rack_on && self.job_racks.contains(node.rack.as_str());
            let avail = adjusted.as_ref().unwrap_or(node.free());
            let scored = stages::score(cx, &self.req, node, bkey.topo, avail, rack);
            self.note(scored, node, index.tie(slot), adjusted);
        }
    }

    /// Step 4, the walk: buckets in the order of their bound; inside a bucket, nodes in
    /// the order of the key's tail (free CPU, memory, tie). It stops once `want` nodes are
    /// known to beat everything not yet visited.
    fn walk(&mut self, cx: &mut Cx<'_>) {
        let (view, index) = (self.view, self.index);
        let mut live = std::mem::take(&mut self.live);
        live.sort_unstable_by_key(|a| a.0);
        for &(bound, bi, rack, fits_b) in &live {
            if self.cands.len() >= self.want && self.cands[self.want - 1].key <= bound {
                break;
            }
            let b = &index.buckets()[bi as usize];
            let Some(set) = self.set_of(bi, rack) else {
                continue;
            };
            // `full`: nodes that take as many of the job's tasks as the bucket's bound says;
            // `settled`: those of them that no later node of the bucket can beat on the drain
            // term (it is 0 there, its least).
            let (mut full, mut settled) = (0, 0);
            for m in set.range((self.req.cpu, 0, 0, 0)..) {
                if self.elsewhere().skip(m, rack) {
                    continue;
                }
                let Some(node) = view.get(index.host(m.3)) else {
                    continue;
                };
                let scored = stages::score(cx, &self.req, node, b.key.topo, node.free(), rack.is_some());
                if let Ok((key, _, fits)) = &scored {
                    if *fits == fits_b {
                        full += 1;
                        settled += usize::from(key.drain == 0);
                    }
                }
                self.note(scored, node, m.2, None);
                // The bucket's nodes differ in the tail only (CPU, memory, tie), which the
                // walk visits in order, unless the drain term is on: then a later node may
                // drain better, until `want` nodes have the term at 0; at most
                // DRAIN_SCAN_NODES more of the bucket are judged (the term is exact among
                // those; said in DESIGN-NOTES).
                let done = if cx.ends_by_ms.is_some() {
                    settled >= self.want || full >= self.want + DRAIN_SCAN_NODES
                } else {
                    full >= self.want
                };
                if done {
                    break;
                }
            }
        }
        self.live = live;
    }

    /// Counts a scored node: dropped with its shortfall, or kept among the best.
    fn note(
        &mut self,
        scored: Result<(RankKey, GpuPick, u32), &'static str>,
        node: &'v Node,
        tie: u32,
        adjusted: Option<Resources>,
    ) {
        match scored {
            Err(r) => self.res_stage.drop_node(r, &node.host),
            Ok((mut key, pick, fits)) => {
                key.tie = tie;
                self.scored_ok += 1;
                keep_best(
                    &mut self.cands,
                    Scored {
                        key,
                        node,
                        adjusted,
                        pick,
                        fits,
                    },
                    self.want,
                );
            }
        }
    }

    /// The topology wait's count: GPUs held on nodes this task may use, by bucket.
    pub fn held_gpus_usable(&self, cx: &Cx<'_>, k: u32) -> u64 {
        let index = self.index;
        index.held_gpus(|key: &BucketKey| key.total_gpus >= k && failed_filter(cx, &index.facts(key)).is_none())
    }
}

/// The first node filter (stages 1–4) a bucket's facts fail, with its reason.
fn failed_filter(cx: &Cx<'_>, facts: &super::feasible::NodeFacts<'_>) -> Option<(usize, super::feasible::Why)> {
    NODE_FILTERS
        .iter()
        .enumerate()
        .find_map(|(i, f)| f.check(cx, facts).err().map(|r| (i, r)))
}

/// Which nodes a source leaves to another: those judged one by one, and (for a global
/// bucket) those of the job's racks, walked through their per-rack buckets.
#[derive(Clone, Copy)]
struct Elsewhere<'s> {
    special: &'s FastMap<u32, ()>,
    job_rack_ids: &'s [u32],
    index: &'s NodeIndex,
}

impl Elsewhere<'_> {
    fn in_job_rack(&self, slot: u32) -> bool {
        !self.job_rack_ids.is_empty()
            && self
                .index
                .slot_rack(slot)
                .is_some_and(|r| self.job_rack_ids.contains(&r))
    }

    /// A node judged elsewhere than in the source of `rack`.
    #[inline]
    fn skip(&self, m: &Member, rack: Option<u32>) -> bool {
        self.special.contains_key(&m.3) || (rack.is_none() && self.in_job_rack(m.3))
    }
}
