//! Queues, fair share and preemption (issue 16): the RM's scheduling decisions, without
//! I/O. The RM's handlers build a [`Snapshot`] (nodes, the containers held, each
//! application's queue, priority and waiting tasks) under the state lock and ask this
//! module three things; the simulator asks the same.
//!
//! 1. [`Shares::compute`] — every queue's deserved GPUs per pool (one pool per GPU type):
//!    weighted water-filling over what each queue wants (held + waiting), bounded by
//!    `guaranteedGpus` and `maxGpus`, parents before their leaves (`share`).
//! 2. [`gate`] — may this allocate's ask (or gang of asks, all or nothing) be granted now?
//!    A queue at its `maxGpus` waits. Otherwise the free GPUs are kept for the waiting
//!    work that ranks ahead: applications ordered by their queue's use/deserved ratio on
//!    the pool asked for (furthest below its share first), then priority (higher first),
//!    then submission time. An ask is refused (retryable) when granting it would leave
//!    those ahead less than they could take now (their tasks packed into the free
//!    resources, another queue's only up to what it is still owed). An ask that takes its
//!    queue past its deserved share also keeps what other queues still owed GPUs could take
//!    now, whatever their rank. Only room someone could use is kept, so a task that fits
//!    nowhere holds nothing.
//! 3. [`plan`] — what to take back: for each queue below its deserved share with
//!    waiting tasks that do not fit the free resources, containers of queues above their
//!    share (not below their share or `guaranteedGpus`, but see the swap), and, where allowed,
//!    lower-priority containers of the same queue for a higher-priority job. A gang
//!    application is one victim (all its containers or none); victims are chosen to free
//!    room where the waiting tasks fit, at least cost (`victims`); a gang may take its queue
//!    below its share only where the queue's own waiting jobs take the difference back (the
//!    swap). Also why each waiting application waits ([`WaitReason`]).
//!
//! CPU and memory only have to fit: shares are counted in GPUs (on GPU clusters the
//! dominant resource), in hundredths ([`crate::resources::shares::hundredths`]): a
//! container or task holding part of a GPU (`gpu: 0.5`) counts its part against its queue
//! — use, waiting demand, `maxGpus`, ranking — and may be taken back; its GPU becomes free
//! room only once every share on it has gone ([`Scratch`]). An ask without GPUs ranks by
//! its queue's largest ratio over the pools and never causes preemption. Which nodes a
//! waiting task may use at all is placement's own rule ([`eligible`] over
//! `select::feasible`: partition, GPU type, none-GPU, and the whole request against the
//! node's total), so room is never kept or freed on a node the AM's select would never
//! pick for it.

pub mod queues;
pub mod reservation;
pub mod reserved;
pub mod share;
pub mod survival;
mod victims;
pub mod walk;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use crate::protocol::WaitingTasks;
use crate::resources::{lowest_bits, CustomResources, GpuAmount, GpuMask, GpuShares, PortSet, Resources, WHOLE};
use crate::select::feasible;
use crate::topology::Topology;
use queues::QueueTree;
pub use share::EPS;

/// One node as the scheduler sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeCap {
    pub host: String,
    /// Its GPU type ("" when the node names none): shares are per pool.
    pub pool: String,
    /// Its partition (first label, "" for none).
    pub partition: String,
    /// RUNNING: takes containers.
    pub usable: bool,
    /// Everything it has (what the feasibility rule's "never" is judged against).
    pub total: Resources,
    pub free_gpus: GpuMask,
    pub free_cpu: u32,
    pub free_memory_mb: u64,
    /// Free ports and custom resources (what else a waiting task may need).
    pub free_ports: PortSet,
    pub free_custom: CustomResources,
    pub topology: Option<Arc<Topology>>,
}

/// A live container (or one stopped but still holding its resources).
#[derive(Clone, Debug, PartialEq)]
pub struct Held {
    pub container_id: String,
    /// Index into [`Snapshot::apps`].
    pub app: usize,
    /// Index into [`Snapshot::nodes`].
    pub node: usize,
    /// The GPUs it holds whole.
    pub gpus: GpuMask,
    /// The GPUs it holds in part (issue 15): index → hundredths; empty for whole GPUs.
    pub gpu_shares: GpuShares,
    pub cpu: u32,
    pub memory_mb: u64,
    /// Its ports and custom resources (given back with it).
    pub ports: PortSet,
    pub custom: CustomResources,
    /// How long it has run (0 when it never started): the work a preemption loses.
    pub run_ms: u64,
    /// Being taken back, or ended and not yet dead: not a candidate again.
    pub leaving: bool,
    /// The queue it is being taken back for.
    pub for_queue: Option<usize>,
}

impl Held {
    /// Its GPUs in hundredths, as its queue counts them: 100 per whole GPU plus its shares.
    pub fn hundredths(&self) -> u32 {
        crate::resources::shares::hundredths(self.gpus.count_ones(), &self.gpu_shares)
    }
}

/// An application as the scheduler ranks it.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct AppDemand {
    pub id: String,
    /// Its leaf queue.
    pub queue: usize,
    pub priority: i32,
    pub submitted_ms: u64,
    /// All of its containers are one victim.
    pub gang: bool,
    pub waiting: Vec<WaitingTasks>,
}

/// Everything a decision needs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub nodes: Vec<NodeCap>,
    pub held: Vec<Held>,
    pub apps: Vec<AppDemand>,
    /// Each held container's expected end, in `held`'s order (issue 27; missing entries:
    /// unknown). Only reservations and start estimates read it ([`reserved`]).
    pub ends: Vec<reserved::Expected>,
}

impl NodeCap {
    /// The scheduler's view of one node of the RM (free: its total less what is used).
    pub fn of(n: &crate::cluster::Node) -> NodeCap {
        let total = n.total();
        let free = total.subtract(n.used());
        NodeCap {
            host: n.host.clone(),
            pool: n.gpu_type.clone().unwrap_or_default(),
            partition: n.partition().to_string(),
            usable: n.state == crate::cluster::NodeState::Running,
            total: total.clone(),
            // GPUs free of any holder: a GPU holding shares takes no whole task.
            free_gpus: if total.gpu_mask != 0 {
                free.whole_gpu_mask()
            } else {
                crate::resources::mask_of_count(free.gpus)
            },
            free_cpu: free.cpu,
            free_memory_mb: free.memory_mb,
            free_ports: free.ports.clone(),
            free_custom: free.custom.clone(),
            topology: n.topology.clone(),
        }
    }

    /// What is free on it as the scheduler packs tasks: wholly free GPUs, CPU, memory,
    /// ports and custom resources.
    fn free_room(&self) -> Resources {
        Resources {
            cpu: self.free_cpu,
            memory_mb: self.free_memory_mb,
            gpus: self.free_gpus.count_ones(),
            gpu_mask: self.free_gpus,
            gpu_shares: Default::default(),
            ports: self.free_ports.clone(),
            custom: self.free_custom.clone(),
        }
    }

    pub fn total_gpus(&self) -> u32 {
        self.total.gpu_count()
    }

    /// What the feasibility rule knows of it apart from its resources.
    pub fn facts(&self) -> feasible::NodeFacts<'_> {
        feasible::NodeFacts {
            running: self.usable,
            partition: &self.partition,
            gpu_type: Some(self.pool.as_str()).filter(|p| !p.is_empty()),
            total_gpus: self.total_gpus(),
        }
    }
}

/// What the feasibility rule knows of waiting tasks apart from their request.
pub fn task_facts(t: &WaitingTasks) -> feasible::TaskFacts<'_> {
    feasible::TaskFacts::new(t.node_label.as_deref(), &t.gpu_types, t.keep_off_gpu_nodes)
}

/// Whether `t`'s tasks may run on `n`: the node RUNNING, and placement's own rule
/// ([`feasible::ever`]: partition, GPU type, none-GPU, and the request — GPUs with shares
/// and mask, CPU, memory, ports, custom resources — against the node's total).
pub fn eligible(n: &NodeCap, t: &WaitingTasks) -> bool {
    let req = t.request();
    let ask = feasible::Ask {
        request: &req,
        dynamic_ports: t.dynamic_ports,
        min_port: t.min_port,
    };
    n.usable && feasible::ever(&task_facts(t), &n.facts(), &ask, &n.total).is_ok()
}

/// Deserved shares and use, per pool and queue. Use and demand are in hundredths of a
/// GPU (a share counts its part, a whole GPU 100); capacity and deserved shares in GPUs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Shares {
    /// Pool names (GPU types), sorted.
    pub pools: Vec<String>,
    /// GPUs of usable nodes per pool (nodes smaller than every task left out).
    pub capacity: Vec<u32>,
    /// `[pool][queue]`: hundredths held (parents: their leaves' sum).
    pub used: Vec<Vec<u32>>,
    /// `[pool][queue]`: hundredths of waiting tasks that may use the pool.
    pub waiting: Vec<Vec<u32>>,
    /// `[pool][queue]`: deserved GPUs.
    pub deserved: Vec<Vec<f64>>,
    /// `[pool][queue]`: hundredths being taken back from the queue (notices out).
    pub leaving: Vec<Vec<u32>>,
    /// `[pool][queue]`: hundredths being taken back for the queue.
    pub incoming: Vec<Vec<u32>>,
    /// `[queue]`: hundredths held over all pools.
    pub used_total: Vec<u32>,
    /// `[pool][queue]`: the part of `waiting` from jobs that are not gangs of several
    /// tasks (what takes back a swapped gang's GPUs beyond its queue's share, `victims`),
    /// in hundredths.
    pub waiting_singles: Vec<Vec<u32>>,
    /// `[queue]`: waiting tasks.
    pub waiting_tasks: Vec<u32>,
    /// `[queue]`: `guaranteedGpus` (to never reclaim below).
    guaranteed: Vec<u32>,
}

impl Shares {
    /// Counts use and waiting demand per pool and queue and water-fills each pool.
    pub fn compute(tree: &QueueTree, snap: &Snapshot) -> Shares {
        let pools: Vec<String> = snap
            .nodes
            .iter()
            .filter(|n| n.total_gpus() > 0)
            .map(|n| n.pool.clone())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let pool_of = |name: &str| pools.binary_search_by(|p| p.as_str().cmp(name)).ok();
        let nq = tree.len();
        let grid = || vec![vec![0u32; nq]; pools.len()];
        let mut s = Shares {
            capacity: vec![0; pools.len()],
            used: grid(),
            waiting: grid(),
            waiting_singles: grid(),
            leaving: grid(),
            incoming: grid(),
            deserved: vec![vec![0.0; nq]; pools.len()],
            used_total: vec![0; nq],
            waiting_tasks: vec![0; nq],
            guaranteed: (0..nq).map(|q| tree.get(q).guaranteed_gpus).collect(),
            pools: Vec::new(),
        };
        // A node smaller than every task that holds or wants GPUs (e.g. 2-GPU machines
        // when every task takes 4) is no capacity anyone can use: it does not count.
        let smallest = snap
            .held
            .iter()
            .map(|h| h.gpus.count_ones())
            .chain(snap.apps.iter().flat_map(|a| a.waiting.iter().map(|w| w.gpus)))
            .filter(|&g| g > 0)
            .min()
            .unwrap_or(1);
        for n in snap.nodes.iter().filter(|n| n.usable && n.total_gpus() >= smallest) {
            if let Some(p) = pool_of(&n.pool) {
                s.capacity[p] += n.total_gpus();
            }
        }
        for h in &snap.held {
            let Some(p) = snap.nodes.get(h.node).and_then(|n| pool_of(&n.pool)) else {
                continue;
            };
            let k = h.hundredths();
            let q = snap.apps[h.app].queue;
            for up in tree.lineage(q) {
                s.used[p][up] += k;
                s.used_total[up] += k;
                if h.leaving {
                    s.leaving[p][up] += k;
                }
            }
            if let Some(to) = h.for_queue {
                for up in tree.lineage(to) {
                    s.incoming[p][up] += k;
                }
            }
        }
        for a in &snap.apps {
            let single = !(a.gang && a.waiting.iter().map(|w| w.count).sum::<u32>() > 1);
            for w in &a.waiting {
                for up in tree.lineage(a.queue) {
                    s.waiting_tasks[up] = s.waiting_tasks[up].saturating_add(w.count);
                }
                if w.gpus == 0 {
                    continue;
                }
                for (p, name) in pools.iter().enumerate() {
                    if w.gpu_types.is_empty() || w.gpu_types.iter().any(|g| g == name) {
                        // Saturating: an AM may report 100,000 tasks of 64 GPUs per role.
                        let h = w.count.saturating_mul(w.hundredths());
                        for up in tree.lineage(a.queue) {
                            s.waiting[p][up] = s.waiting[p][up].saturating_add(h);
                            if single {
                                s.waiting_singles[p][up] = s.waiting_singles[p][up].saturating_add(h);
                            }
                        }
                    }
                }
            }
        }
        for p in 0..pools.len() {
            // Waiting demand is whole GPUs in the water-filling, each leaf's rounded up: a
            // waiting share task is only ever placed, or made room for, on a whole free GPU
            // (`Scratch`), so a leaf waiting 0.5 wants a GPU (and is owed one), and 36 × 0.11
            // want 4. Use stays exact; whole-GPU demand is unchanged.
            let mut demand = vec![0u32; nq];
            for l in tree.leaves() {
                let whole = s.waiting[p][l].div_ceil(WHOLE).saturating_mul(WHOLE);
                for up in tree.lineage(l) {
                    demand[up] = demand[up].saturating_add(whole);
                }
            }
            let want: Vec<f64> = (0..nq)
                .map(|q| gpus_of(s.used[p][q].saturating_add(demand[q])))
                .collect();
            s.deserved[p] = share::deserved(tree, f64::from(s.capacity[p]), &want);
        }
        s.pools = pools;
        s
    }

    pub fn pool_of(&self, name: &str) -> Option<usize> {
        self.pools.binary_search_by(|p| p.as_str().cmp(name)).ok()
    }

    /// The queue's GPUs held in the pool (fractional where it holds shares).
    pub fn used_gpus(&self, p: usize, q: usize) -> GpuAmount {
        GpuAmount(self.used[p][q])
    }

    /// Use over deserved share (0 when it holds nothing; very large when it is owed
    /// nothing but holds something).
    pub fn ratio(&self, p: usize, q: usize) -> f64 {
        let (u, d) = (gpus_of(self.used[p][q]), self.deserved[p][q]);
        if u <= EPS {
            0.0
        } else if d <= EPS {
            1e12 * u
        } else {
            u / d
        }
    }

    /// The largest ratio over the pools (for asks without GPUs).
    pub fn dominant_ratio(&self, q: usize) -> f64 {
        (0..self.pools.len()).map(|p| self.ratio(p, q)).fold(0.0, f64::max)
    }

    /// Whole GPUs the queue is still owed in the pool (deserved − used), counting what is
    /// already being taken back for it.
    pub fn owed(&self, p: usize, q: usize) -> u32 {
        let gap = self.deserved[p][q] - gpus_of(self.used[p][q] + self.incoming[p][q]);
        (gap + EPS).floor().max(0.0) as u32
    }

    /// Hundredths that may be taken from the queue in the pool: its use above its share
    /// (and above `guaranteedGpus`), less `leaving`, the hundredths already leaving it (at
    /// least `self.leaving`; a plan adds what it takes).
    pub fn over(&self, p: usize, q: usize, leaving: u32) -> u32 {
        let used = gpus_of(self.used[p][q]);
        let floor = self.deserved[p][q].max(f64::from(self.guaranteed[q]).min(used));
        let gap = used - floor - gpus_of(leaving);
        ((gap + EPS) * f64::from(WHOLE)).floor().max(0.0) as u32
    }
}

/// Hundredths as GPUs.
fn gpus_of(hundredths: u32) -> f64 {
    GpuAmount(hundredths).as_f64()
}

/// Free resources per node, for packing tasks without touching the snapshot: wholly free
/// GPUs, CPU, memory, ports and custom resources, judged by the feasibility rule's
/// shortfall. A waiting share task takes a whole free GPU here (room is only ever kept
/// or made whole); a held share gives its GPU back only when the last share on it goes.
#[derive(Clone, Debug, PartialEq)]
struct Scratch {
    free: Vec<Resources>,
    /// Per node: GPU index → hundredths the snapshot's containers still hold of it in part.
    shared: Vec<BTreeMap<u8, u32>>,
}

/// Whether one task of `t` fits in `room` (the shortfall rule of `select::feasible`).
fn fits_in(room: &Resources, t: &WaitingTasks) -> bool {
    let req = t.request();
    let ask = feasible::Ask {
        request: &req,
        dynamic_ports: t.dynamic_ports,
        min_port: t.min_port,
    };
    ask.shortfall(room).is_none()
}

/// Gives `h`'s resources back to `room`; `shared`: what the node's containers hold of its
/// GPUs in part (a shared GPU joins the room once nothing of it is held).
fn give_back(room: &mut Resources, shared: &mut BTreeMap<u8, u32>, h: &Held) {
    room.gpu_mask |= h.gpus;
    for (i, part) in h.gpu_shares.iter().filter(|&(i, _)| u32::from(i) < 64) {
        if let Some(left) = shared.get_mut(&i) {
            *left = left.saturating_sub(part);
            if *left == 0 {
                shared.remove(&i);
                room.gpu_mask |= 1u64 << i;
            }
        }
    }
    room.gpus = room.gpu_mask.count_ones();
    room.cpu = room.cpu.saturating_add(h.cpu);
    room.memory_mb = room.memory_mb.saturating_add(h.memory_mb);
    if !h.ports.is_empty() {
        room.ports = room.ports.union(&h.ports);
    }
    if !h.custom.is_empty() {
        room.custom = room.custom.add(&h.custom);
    }
}

impl Scratch {
    fn of(snap: &Snapshot) -> Scratch {
        let mut shared = vec![BTreeMap::new(); snap.nodes.len()];
        for h in &snap.held {
            if let Some(on) = shared.get_mut(h.node) {
                for (i, part) in h.gpu_shares.iter() {
                    *on.entry(i).or_insert(0) += part;
                }
            }
        }
        Scratch {
            free: snap.nodes.iter().map(NodeCap::free_room).collect(),
            shared,
        }
    }

    /// Node `n`'s room with `gone` (containers on it) given back.
    fn room_without<'a>(&self, n: usize, gone: impl Iterator<Item = &'a Held>) -> Resources {
        let (mut room, mut shared) = (self.free[n].clone(), self.shared[n].clone());
        for h in gone {
            give_back(&mut room, &mut shared, h);
        }
        room
    }

    /// Wholly free GPUs on the nodes `ok` accepts.
    fn free_gpus(&self, ok: &dyn Fn(usize) -> bool) -> u32 {
        (0..self.free.len()).filter(|&n| ok(n)).map(|n| self.free[n].gpus).sum()
    }

    fn fits(&self, n: usize, t: &WaitingTasks) -> bool {
        fits_in(&self.free[n], t)
    }

    /// Takes one task of `t` on node `n` (its explicit GPUs or the lowest free ones, its
    /// static ports and the lowest dynamic ones); false when it does not fit.
    fn take(&mut self, n: usize, t: &WaitingTasks) -> bool {
        if !self.fits(n, t) {
            return false;
        }
        let f = &self.free[n];
        let gpus = if t.gpu_mask != 0 {
            t.gpu_mask
        } else {
            lowest_bits(f.gpu_mask, t.gpus).unwrap_or(0)
        };
        let mut ports = t.ports.clone();
        if t.dynamic_ports > 0 {
            let drawn = f.ports.subtract(&t.ports).lowest(t.dynamic_ports, t.min_port);
            ports = ports.union(&drawn.unwrap_or_default());
        }
        let grant = Resources {
            cpu: t.cpu,
            memory_mb: t.memory_mb,
            gpus: gpus.count_ones(),
            gpu_mask: gpus,
            gpu_shares: Default::default(),
            ports,
            custom: t.custom.clone(),
        };
        self.take_exact(n, &grant);
        true
    }

    fn take_exact(&mut self, n: usize, r: &Resources) {
        let f = &mut self.free[n];
        f.gpu_mask &= !r.gpu_mask;
        if r.gpu_mask == 0 && r.gpus > 0 {
            f.gpu_mask &= !lowest_bits(f.gpu_mask, r.gpus).unwrap_or(f.gpu_mask);
        }
        f.gpus = f.gpu_mask.count_ones();
        f.cpu = f.cpu.saturating_sub(r.cpu);
        f.memory_mb = f.memory_mb.saturating_sub(r.memory_mb);
        if !r.custom.is_empty() {
            f.custom = f.custom.subtract(&r.custom);
        }
        if !r.ports.is_empty() {
            f.ports = f.ports.subtract(&r.ports);
        }
    }

    /// Adds the resources of the leaving containers `which` accepts; returns the GPUs
    /// that became wholly free.
    fn give_leaving(&mut self, snap: &Snapshot, which: impl Fn(&Held) -> bool) -> u32 {
        let before = self.free_gpus(&|_| true);
        for h in snap.held.iter().filter(|h| h.leaving && which(h)) {
            self.give(h);
        }
        self.free_gpus(&|_| true) - before
    }

    fn give(&mut self, h: &Held) {
        give_back(&mut self.free[h.node], &mut self.shared[h.node], h);
    }

    /// Places one task of `t` best-fit (the eligible node with the fewest free GPUs that
    /// fits, so big holes stay whole) on a node `ok` accepts; returns the node.
    fn place(&mut self, nodes: &[NodeCap], t: &WaitingTasks, ok: &dyn Fn(usize) -> bool) -> Option<usize> {
        let best = (0..nodes.len())
            .filter(|&n| ok(n) && eligible(&nodes[n], t) && self.fits(n, t))
            .min_by_key(|&n| (self.free[n].gpus, n))?;
        self.take(best, t);
        Some(best)
    }

    /// Places as many of an application's waiting tasks as fit (all or none for a gang),
    /// at most `cap` GPUs of them; returns the GPUs placed.
    fn place_app(&mut self, nodes: &[NodeCap], a: &AppDemand, cap: u32, ok: &dyn Fn(usize) -> bool) -> u32 {
        let mut trial = self.clone();
        let (mut gpus, mut all) = (0u32, true);
        'outer: for w in a.waiting.iter().filter(|w| w.gpus > 0) {
            for _ in 0..w.count {
                if gpus + w.gpus > cap || trial.place(nodes, w, ok).is_none() {
                    all = false;
                    if a.gang {
                        break 'outer;
                    }
                    break;
                }
                gpus += w.gpus;
            }
        }
        if a.gang && !all {
            return 0;
        }
        *self = trial;
        gpus
    }
}

/// Why a waiting application waits (shown on the cluster page and sent to its AM).
#[derive(Clone, Debug, PartialEq)]
pub enum WaitReason {
    /// Its queue (or the queue's parent) holds `maxGpus` already.
    AtCap { queue: String, max: u32 },
    /// Free GPUs are kept for an application that ranks ahead of it.
    Behind {
        queue: String,
        used: GpuAmount,
        deserved: f64,
        ahead_app: String,
        ahead_queue: String,
    },
    /// Its queue is at or above its share while another queue below its share waits.
    OverShare {
        queue: String,
        used: GpuAmount,
        deserved: f64,
    },
    /// GPUs are being taken back for it.
    Reclaiming { gpus: u32, from: Vec<String> },
    /// Below its share, but what could be taken back belongs to gangs whose whole
    /// preemption would take their queue below its own share.
    GangProtected {
        queue: String,
        used: GpuAmount,
        deserved: f64,
    },
    /// Nothing else stops it: no node has room for its tasks yet.
    NothingFits,
    /// The room it would take is reserved for a waiting gang that ranks ahead of it
    /// (issue 27), expected to start at `start_ms`; it ends after that and the gang would
    /// not fit beside it.
    /// `gang`: the reservation holder as [`reserved::holder_label`] names it (not its id).
    Reserved { gang: String, start_ms: u64, now_ms: u64 },
}

impl WaitReason {
    /// As the one reason type (`reason::Reason`): a full queue, a share or gang protection
    /// is `QueueShare`, free GPUs kept for an application of the same queue `Priority`
    /// (it ranks ahead by priority, then age), GPUs taken back `Reclaiming`; "nothing
    /// fits" is `Resources` (the AM knows better which, see `reason::combine`).
    pub fn reason(&self) -> crate::reason::Reason {
        use crate::reason::Kind;
        let kind = match self {
            WaitReason::AtCap { .. } | WaitReason::OverShare { .. } | WaitReason::GangProtected { .. } => {
                Kind::QueueShare
            }
            WaitReason::Behind { queue, ahead_queue, .. } if queue == ahead_queue => Kind::Priority,
            WaitReason::Behind { .. } => Kind::QueueShare,
            WaitReason::Reclaiming { .. } => Kind::Reclaiming,
            WaitReason::NothingFits => Kind::Resources,
            WaitReason::Reserved { .. } => Kind::Priority,
        };
        crate::reason::Reason::new(kind, self.to_string())
    }

    /// A short machine name for the cluster page.
    pub fn code(&self) -> &'static str {
        match self {
            WaitReason::AtCap { .. } => "atCap",
            WaitReason::Behind { .. } => "behind",
            WaitReason::OverShare { .. } => "overShare",
            WaitReason::Reclaiming { .. } => "reclaiming",
            WaitReason::GangProtected { .. } => "gangProtected",
            WaitReason::NothingFits => "nothingFits",
            WaitReason::Reserved { .. } => "reserved",
        }
    }
}

impl fmt::Display for WaitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitReason::AtCap { queue, max } => {
                write!(f, "queue `{queue}` is at its cap (maxGpus {max})")
            }
            WaitReason::Behind {
                queue,
                used,
                deserved,
                ahead_app,
                ahead_queue,
            } => write!(
                f,
                "queue `{queue}` holds {used} of its {deserved:.1} deserved GPUs; the free GPUs are kept for \
                 {ahead_app} (queue `{ahead_queue}`), which ranks ahead"
            ),
            WaitReason::OverShare { queue, used, deserved } => write!(
                f,
                "queue `{queue}` holds (or is getting) {used} GPUs, its deserved share is {deserved:.1}, and \
                 other queues want the rest"
            ),
            WaitReason::Reclaiming { gpus, from } => write!(
                f,
                "below its share: {gpus} GPUs are being taken back for it from queue{} {}",
                if from.len() > 1 { "s" } else { "" },
                from.iter().map(|q| format!("`{q}`")).collect::<Vec<_>>().join(", ")
            ),
            WaitReason::GangProtected { queue, used, deserved } => write!(
                f,
                "queue `{queue}` holds {used} of its {deserved:.1} deserved GPUs, but the containers it could take \
                 back belong to gangs whose preemption would take their queue below its own share"
            ),
            WaitReason::NothingFits => write!(f, "nothing fits yet: no node has room for its tasks"),
            WaitReason::Reserved { gang, start_ms, now_ms } => write!(
                f,
                "the free room it would take is reserved for {gang}, expected to start in {} s; only work \
                 declared to end by then (`maxRunSec`) or that leaves the gang room beside it may use it",
                start_ms.saturating_sub(*now_ms).div_ceil(1000)
            ),
        }
    }
}

/// An application's rank: (queue ratio, −priority, submission time, id); smaller first.
fn rank(shares: &Shares, pool: Option<usize>, a: &AppDemand) -> (f64, i64, u64, String) {
    let ratio = match pool {
        Some(p) => shares.ratio(p, a.queue),
        None => shares.dominant_ratio(a.queue),
    };
    (ratio, -i64::from(a.priority), a.submitted_ms, a.id.clone())
}

fn rank_cmp(x: &(f64, i64, u64, String), y: &(f64, i64, u64, String)) -> std::cmp::Ordering {
    x.0.total_cmp(&y.0)
        .then(x.1.cmp(&y.1))
        .then(x.2.cmp(&y.2))
        .then(x.3.cmp(&y.3))
}

/// The queues whose caps bound `q`'s GPUs: the first of them that `more` hundredths
/// would take past its `maxGpus`, if any.
fn at_cap(tree: &QueueTree, shares: &Shares, q: usize, more: u32) -> Option<WaitReason> {
    tree.lineage(q).find_map(|up| {
        let queue = tree.get(up);
        let max = queue.max_gpus?;
        (u64::from(shares.used_total[up]) + u64::from(more) > u64::from(max) * u64::from(WHOLE)).then(|| {
            WaitReason::AtCap {
                queue: queue.path.clone(),
                max,
            }
        })
    })
}

/// GPUs each application in `order` could take from `scratch` now, in that order; another
/// queue than `own` only up to what it is still owed in `pool` (all pools for `None`).
fn reserve(
    snap: &Snapshot,
    shares: &Shares,
    pool: Option<usize>,
    own: usize,
    order: &[usize],
    mut scratch: Scratch,
) -> Vec<u32> {
    let in_pool = |n: usize| pool.is_none_or(|p| shares.pool_of(&snap.nodes[n].pool) == Some(p));
    let mut owed: BTreeMap<usize, u32> = BTreeMap::new();
    order
        .iter()
        .map(|&b| {
            let a = &snap.apps[b];
            let cap = if a.queue == own {
                u32::MAX
            } else {
                *owed.entry(a.queue).or_insert_with(|| match pool {
                    Some(p) => shares.owed(p, a.queue),
                    None => (0..shares.pools.len()).map(|p| shares.owed(p, a.queue)).sum(),
                })
            };
            let got = scratch.place_app(&snap.nodes, a, cap, &in_pool);
            if a.queue != own {
                if let Some(left) = owed.get_mut(&a.queue) {
                    *left = left.saturating_sub(got);
                }
            }
            got
        })
        .collect()
}

/// Whether application `app` may be granted `asks` (node index, exact resources) now,
/// all together; see the module doc. Fitting is the ledger's business: asks that do not
/// fit are not this function's to refuse.
pub fn gate(
    tree: &QueueTree,
    snap: &Snapshot,
    shares: &Shares,
    app: usize,
    asks: &[(usize, Resources)],
) -> Result<(), WaitReason> {
    let me = &snap.apps[app];
    // In hundredths: a share counts its part (an ask of 0.99 passes a cap only with 0.99
    // left under it).
    let gpus: u32 = asks.iter().map(|(_, r)| r.hundredths()).sum();
    if gpus > 0 {
        if let Some(cap) = at_cap(tree, shares, me.queue, gpus) {
            return Err(cap);
        }
    }
    let pool = asks
        .iter()
        .find(|(_, r)| r.hundredths() > 0)
        .and_then(|(n, _)| shares.pool_of(&snap.nodes[*n].pool));
    let mine = rank(shares, pool, me);
    // An ask that takes its queue past its deserved share also keeps the room that another
    // queue still owed GPUs could take now, whatever the ranks: one big ask (a gang's) from
    // the queue furthest below its share must not overshoot into the room of the next.
    let past_share = pool.filter(|&p| gpus_of(shares.used[p][me.queue] + gpus) > shares.deserved[p][me.queue] + EPS);
    let owed_other = |a: &AppDemand| a.queue != me.queue && past_share.is_some_and(|p| shares.owed(p, a.queue) > 0);
    let mut kept: Vec<(usize, (f64, i64, u64, String))> = snap
        .apps
        .iter()
        .enumerate()
        .filter(|(b, a)| *b != app && a.waiting.iter().any(|w| w.gpus > 0 && w.count > 0))
        .map(|(b, a)| (b, rank(shares, pool, a)))
        .filter(|(b, r)| rank_cmp(r, &mine).is_lt() || owed_other(&snap.apps[*b]))
        .collect();
    if kept.is_empty() {
        return Ok(());
    }
    kept.sort_by(|x, y| rank_cmp(&x.1, &y.1));
    let order: Vec<usize> = kept.iter().map(|(b, _)| *b).collect();
    let now = Scratch::of(snap);
    let mut after = now.clone();
    for (n, r) in asks {
        after.take_exact(*n, r);
    }
    let before = reserve(snap, shares, pool, me.queue, &order, now);
    let with = reserve(snap, shares, pool, me.queue, &order, after);
    let loser = kept.iter().zip(before.iter().zip(&with)).find(|(_, (b, w))| w < b);
    match loser.map(|(a, _)| a) {
        None => Ok(()),
        // Kept for a queue owed GPUs that does not rank kept: this ask would take its
        // queue past its share.
        Some((_, r)) if rank_cmp(r, &mine).is_ge() => {
            let p = past_share.unwrap_or_default();
            Err(WaitReason::OverShare {
                queue: tree.get(me.queue).path.clone(),
                used: GpuAmount(shares.used[p][me.queue] + gpus),
                deserved: shares.deserved[p][me.queue],
            })
        }
        Some(&(b, _)) => {
            let (used, deserved) = match pool {
                Some(p) => (shares.used_gpus(p, me.queue), shares.deserved[p][me.queue]),
                None => (
                    GpuAmount(shares.used_total[me.queue]),
                    (0..shares.pools.len()).map(|p| shares.deserved[p][me.queue]).sum(),
                ),
            };
            Err(WaitReason::Behind {
                queue: tree.get(me.queue).path.clone(),
                used,
                deserved,
                ahead_app: snap.apps[b].id.clone(),
                ahead_queue: tree.get(snap.apps[b].queue).path.clone(),
            })
        }
    }
}

/// [`gate`], then the reservation of a waiting gang (issue 27, [`reserved`]): an ask of
/// an application ranked behind the gang that holds it passes only if it ends by the
/// reservation's start (`end_ms`: its declared end, `None` when it declared none) or the
/// gang still fits beside it (backfill). `holder`: [`reserved::holder`] of the same
/// snapshot (computed once by the caller).
#[allow(clippy::too_many_arguments)]
pub fn gate_reserved(
    tree: &QueueTree,
    snap: &Snapshot,
    shares: &Shares,
    app: usize,
    asks: &[(usize, Resources)],
    holder: Option<&reserved::Holder>,
    end_ms: Option<u64>,
    now_ms: u64,
) -> Result<(), WaitReason> {
    gate(tree, snap, shares, app, asks)?;
    match holder {
        Some(h) if !reserved::admits(snap, shares, h, app, asks, end_ms) => Err(WaitReason::Reserved {
            gang: reserved::holder_label(snap, h),
            start_ms: h.reservation.start_ms,
            now_ms,
        }),
        _ => Ok(()),
    }
}

/// A sufficient condition for [`gate`] to pass an ask that no queue cap stops, checked
/// without a snapshot (issue 29): the free room of `nodes` (the usable nodes the ask does
/// not touch, in its pool) holds every one of `waiting` (all other applications' waiting
/// tasks) at once, whatever order and place the reservation picks. Each node counts how
/// many of the largest waiting task (per resource) it holds — one at most when a waiting
/// task names ports, custom resources, GPUs or a share — and only when every waiting
/// task is eligible there and fits; placing any task takes at most one from that count,
/// so with counts summing to at least the number of waiting tasks, `reserve` places them
/// all with or without the ask, and `gate` finds no one it would take from. Stops reading
/// `nodes` as soon as the count is reached: O(waiting tasks) on a cluster with room.
pub fn room_for_all_waiting<'a>(
    waiting: impl IntoIterator<Item = &'a WaitingTasks>,
    nodes: impl Iterator<Item = NodeCap>,
) -> bool {
    let mut shapes: Vec<&WaitingTasks> = Vec::new();
    let mut tasks: u64 = 0;
    for w in waiting.into_iter().filter(|w| w.gpus > 0 && w.count > 0) {
        tasks += u64::from(w.count);
        // One shape per distinct task (what `fits_in` and `eligible` read; not count or role).
        let same = |s: &&WaitingTasks| {
            (
                s.gpus,
                s.cpu,
                s.memory_mb,
                s.gpu_share,
                s.gpu_mask,
                s.dynamic_ports,
                s.min_port,
            ) == (
                w.gpus,
                w.cpu,
                w.memory_mb,
                w.gpu_share,
                w.gpu_mask,
                w.dynamic_ports,
                w.min_port,
            ) && (&s.gpu_types, &s.node_label, &s.custom, &s.ports, s.keep_off_gpu_nodes)
                == (&w.gpu_types, &w.node_label, &w.custom, &w.ports, w.keep_off_gpu_nodes)
        };
        if !shapes.iter().any(same) {
            shapes.push(w);
        }
    }
    if tasks == 0 {
        return true;
    }
    let plain = shapes.iter().all(|w| {
        w.gpu_mask == 0 && w.gpu_share.is_none() && w.ports.is_empty() && w.dynamic_ports == 0 && w.custom.is_empty()
    });
    let max_gpus = shapes.iter().map(|w| w.gpus).max().unwrap_or(1).max(1);
    let max_cpu = shapes.iter().map(|w| w.cpu).max().unwrap_or(0);
    let max_mem = shapes.iter().map(|w| w.memory_mb).max().unwrap_or(0);
    let mut room: u64 = 0;
    for n in nodes {
        let free = n.free_room();
        if !shapes.iter().all(|w| eligible(&n, w) && fits_in(&free, w)) {
            continue;
        }
        let holds = if plain {
            let per = |free: u64, max: u64| free.checked_div(max).unwrap_or(u64::MAX);
            per(u64::from(free.gpus), u64::from(max_gpus))
                .min(per(u64::from(free.cpu), u64::from(max_cpu)))
                .min(per(free.memory_mb, max_mem))
        } else {
            1
        };
        room += holds.max(1);
        if room >= tasks {
            return true;
        }
    }
    false
}

/// One preemption decision: containers of one application taken back for a queue.
#[derive(Clone, Debug, PartialEq)]
pub struct Victim {
    /// Indices into [`Snapshot::held`] (all of the application's live ones for a gang).
    pub held: Vec<usize>,
    /// The application they belong to.
    pub app: usize,
    /// The queue the GPUs go to.
    pub for_queue: usize,
    /// The application whose waiting tasks made room necessary.
    pub for_app: usize,
    pub reason: String,
}

/// What [`plan`] decided.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    pub victims: Vec<Victim>,
    /// Per application (index into [`Snapshot::apps`]): why it waits (`None`: nothing waits).
    pub why: Vec<Option<WaitReason>>,
}

/// What a plan builds up as it goes.
struct PlanState {
    out: Plan,
    scratch: Scratch,
    /// Containers already chosen (by an earlier decision or in this plan).
    taken: Vec<bool>,
    /// `[pool][queue]`: hundredths leaving the queue (earlier decisions and this plan's).
    leaving: Vec<Vec<u32>>,
    /// Per application: GPUs being taken back for it, and from which queues.
    reclaiming: BTreeMap<usize, (u32, BTreeSet<String>)>,
    /// `[pool][queue]`: hundredths this plan takes back for each queue.
    gained: Vec<Vec<u32>>,
    /// Applications whose room only gangs too big to take could have made.
    protected: BTreeSet<usize>,
    /// `[pool][queue]`: hundredths a swap of this plan took beyond the queue's limit,
    /// counting on the queue's own waiting work to take them back.
    refilled: Vec<Vec<u32>>,
}

impl PlanState {
    /// Takes containers of other queues above their share in pool `p` so that `tasks`
    /// (of `beneficiaries`, with their GPUs, in rank order) fit; a `whole` batch (a gang)
    /// is served entirely or nothing is taken.
    #[allow(clippy::too_many_arguments)]
    fn reclaim_across(
        &mut self,
        tree: &QueueTree,
        snap: &Snapshot,
        shares: &Shares,
        p: usize,
        s: usize,
        tasks: &[WaitingTasks],
        whole: bool,
        beneficiaries: &[(usize, u32)],
    ) {
        let in_pool = |n: usize| shares.pool_of(&snap.nodes[n].pool) == Some(p);
        let mut limit: BTreeMap<usize, u32> = BTreeMap::new();
        for v in tree.leaves().filter(|&v| v != s) {
            let room = shares.over(p, v, self.leaving[p][v]);
            if room > 0 {
                limit.insert(v, room);
            }
        }
        // Each victim queue's own waiting work that would take back room beyond its limit,
        // less what a swap of this plan already counted on.
        let refill: BTreeMap<usize, u32> = limit
            .keys()
            .map(|&v| (v, shares.waiting_singles[p][v].saturating_sub(self.refilled[p][v])))
            .collect();
        let units = victims::units(
            snap,
            &self.taken,
            |app| limit.contains_key(&snap.apps[app].queue),
            &in_pool,
        );
        let mut choice = victims::choose(snap, &self.scratch, tasks, &units, &limit, &refill);
        let all: u32 = tasks.iter().map(|w| w.count).sum();
        if whole && choice.served < all {
            choice.units.clear();
        }
        if choice.units.is_empty() {
            if choice.gang_blocked {
                self.protected.extend(beneficiaries.iter().map(|b| b.0));
            }
            return;
        }
        let mut freed = apply_choice(
            snap,
            &units,
            &choice,
            &mut self.scratch,
            &mut self.taken,
            &mut self.leaving[p],
            &in_pool,
        );
        let from: BTreeSet<String> = choice
            .units
            .iter()
            .map(|&u| tree.get(snap.apps[units[u].app].queue).path.clone())
            .collect();
        let first = beneficiaries.first().map_or(0, |x| x.0);
        for &u in &choice.units {
            let unit = &units[u];
            let vq = snap.apps[unit.app].queue;
            let beyond = unit.hundredths.saturating_sub(limit.get(&vq).copied().unwrap_or(0));
            self.refilled[p][vq] += beyond;
            self.out.victims.push(Victim {
                held: unit.held.clone(),
                app: unit.app,
                for_queue: s,
                for_app: first,
                reason: format!(
                    "queue `{}` is below its share and waits; queue `{}` holds {} GPUs and deserves {:.1}{}",
                    tree.get(s).path,
                    tree.get(vq).path,
                    shares.used_gpus(p, vq),
                    shares.deserved[p][vq],
                    if beyond > 0 {
                        format!(
                            "; the gang goes whole and {} of its GPUs go back to the queue's own waiting jobs",
                            GpuAmount(beyond)
                        )
                    } else {
                        String::new()
                    }
                ),
            });
            self.gained[p][s] += unit.hundredths;
        }
        // The room made is the queue's, for its applications in rank order.
        for &(a, gpus) in beneficiaries {
            let got = gpus.min(freed);
            freed -= got;
            if got > 0 {
                let e = self.reclaiming.entry(a).or_default();
                e.0 += got;
                e.1.extend(from.iter().cloned());
            }
            if got < gpus && choice.gang_blocked {
                self.protected.insert(a);
            }
        }
        place_rest(&snap.nodes, &mut self.scratch, tasks, &in_pool);
    }
}

/// Chooses containers to take back and says why each waiting application waits (see the
/// module doc).
pub fn plan(tree: &QueueTree, snap: &Snapshot, shares: &Shares) -> Plan {
    let mut st = PlanState {
        out: Plan {
            victims: Vec::new(),
            why: vec![None; snap.apps.len()],
        },
        scratch: Scratch::of(snap),
        taken: snap.held.iter().map(|h| h.leaving).collect(),
        leaving: shares.leaving.clone(),
        reclaiming: BTreeMap::new(),
        gained: vec![vec![0u32; tree.len()]; shares.pools.len()],
        protected: BTreeSet::new(),
        refilled: vec![vec![0u32; tree.len()]; shares.pools.len()],
    };
    for p in 0..shares.pools.len() {
        let in_pool = |n: usize| shares.pool_of(&snap.nodes[n].pool) == Some(p);
        // Queues furthest below their share first: they pack into the free room first.
        let mut queues: Vec<usize> = tree.leaves().filter(|&q| shares.waiting[p][q] > 0).collect();
        queues.sort_by(|&a, &b| shares.ratio(p, a).total_cmp(&shares.ratio(p, b)).then(a.cmp(&b)));
        for s in queues {
            let owed_now = shares.owed(p, s);
            let by_priority = tree.get(s).priority_preemption;
            if owed_now == 0 && !by_priority {
                // Nothing can be taken for it: its jobs only pack into the free room.
                continue;
            }
            // Room already being made for this queue (notices out) is its own: its tasks
            // may take it as if it were free, so it is not made twice.
            let incoming = st
                .scratch
                .give_leaving(snap, |h| h.for_queue == Some(s) && in_pool(h.node));
            let mut apps: Vec<usize> = (0..snap.apps.len())
                .filter(|&a| snap.apps[a].queue == s && snap.apps[a].waiting.iter().any(|w| w.gpus > 0))
                .collect();
            apps.sort_by(|&x, &y| {
                rank_cmp(
                    &rank(shares, Some(p), &snap.apps[x]),
                    &rank(shares, Some(p), &snap.apps[y]),
                )
            });
            // What fits the free resources needs no preemption. (Without priority
            // preemption, only work up to what the queue is owed matters.)
            let want = if owed_now > 0 { owed_now + incoming } else { 0 };
            let (mut fit_total, mut unmet_total) = (0u32, 0u32);
            let mut unmet: Vec<(usize, Vec<WaitingTasks>)> = Vec::new();
            for &a in &apps {
                if !by_priority && fit_total + unmet_total >= want {
                    break;
                }
                let fit = st.scratch.place_app(&snap.nodes, &snap.apps[a], u32::MAX, &in_pool);
                fit_total += fit;
                let rest = unmet_tasks(&snap.apps[a], fit, u32::MAX, &snap.nodes, &in_pool);
                unmet_total += rest.iter().map(|w| w.count * w.gpus).sum::<u32>();
                if !rest.is_empty() {
                    unmet.push((a, rest));
                }
            }
            // Across queues: the queue is below its share; its unmet work, up to what it is
            // owed, in rank order. Single jobs are made room for together (so that a gang
            // victim plus singles can add up to the need); each gang alone, and only whole.
            let mut budget = want.saturating_sub(fit_total);
            let mut batch: Vec<WaitingTasks> = Vec::new();
            let mut batch_of: Vec<(usize, u32)> = Vec::new();
            for (a, rest) in &unmet {
                if budget == 0 {
                    break;
                }
                if snap.apps[*a].gang {
                    let all: u32 = rest.iter().map(|w| w.count * w.gpus).sum();
                    if all > budget {
                        continue;
                    }
                    if !batch.is_empty() {
                        st.reclaim_across(tree, snap, shares, p, s, &batch, false, &batch_of);
                        batch.clear();
                        batch_of.clear();
                    }
                    budget -= all;
                    st.reclaim_across(tree, snap, shares, p, s, rest, true, &[(*a, all)]);
                    continue;
                }
                let mut gpus = 0;
                for w in rest {
                    let n = (budget / w.gpus.max(1)).min(w.count);
                    if n > 0 {
                        batch.push(WaitingTasks { count: n, ..w.clone() });
                        budget -= n * w.gpus;
                        gpus += n * w.gpus;
                    }
                }
                if gpus > 0 {
                    batch_of.push((*a, gpus));
                }
            }
            if !batch.is_empty() {
                st.reclaim_across(tree, snap, shares, p, s, &batch, false, &batch_of);
            }
            for (_, rest) in unmet.iter_mut() {
                *rest = place_rest(&snap.nodes, &mut st.scratch, rest, &in_pool);
            }
            // Within the queue, where allowed: a job may take the room of lower-priority jobs
            // of the same queue for what is still unmet.
            if !by_priority {
                continue;
            }
            unmet.sort_by_key(|(a, _)| (-i64::from(snap.apps[*a].priority), snap.apps[*a].submitted_ms));
            for (a, rest) in unmet {
                if rest.is_empty() {
                    continue;
                }
                let me = &snap.apps[a];
                let limit: BTreeMap<usize, u32> = [(s, u32::MAX)].into();
                let units = victims::units(
                    snap,
                    &st.taken,
                    |app| snap.apps[app].queue == s && snap.apps[app].priority < me.priority,
                    &in_pool,
                );
                let mut choice = victims::choose(snap, &st.scratch, &rest, &units, &limit, &BTreeMap::new());
                if me.gang && choice.served < rest.iter().map(|w| w.count).sum::<u32>() {
                    choice.units.clear();
                }
                if choice.units.is_empty() {
                    continue;
                }
                let freed = apply_choice(
                    snap,
                    &units,
                    &choice,
                    &mut st.scratch,
                    &mut st.taken,
                    &mut st.leaving[p],
                    &in_pool,
                );
                place_rest(&snap.nodes, &mut st.scratch, &rest, &in_pool);
                let e = st.reclaiming.entry(a).or_default();
                e.0 += freed;
                e.1.insert(tree.get(s).path.clone());
                for &u in &choice.units {
                    let unit = &units[u];
                    st.out.victims.push(Victim {
                        held: unit.held.clone(),
                        app: unit.app,
                        for_queue: s,
                        for_app: a,
                        reason: format!(
                            "{} (priority {}) of queue `{}` needs the GPUs of this priority-{} job",
                            me.id,
                            me.priority,
                            tree.get(s).path,
                            snap.apps[unit.app].priority
                        ),
                    });
                }
            }
        }
    }
    for (a, app) in snap.apps.iter().enumerate() {
        if app.waiting.iter().all(|w| w.count == 0) {
            continue;
        }
        st.out.why[a] = Some(why_waiting(
            tree,
            shares,
            &st.gained,
            snap,
            a,
            st.reclaiming.get(&a),
            st.protected.contains(&a),
        ));
    }
    st.out
}

/// Places what of `tasks` fits; returns what still does not.
fn place_rest(
    nodes: &[NodeCap],
    scratch: &mut Scratch,
    tasks: &[WaitingTasks],
    in_pool: &dyn Fn(usize) -> bool,
) -> Vec<WaitingTasks> {
    let mut out = Vec::new();
    for w in tasks {
        let mut placed = 0;
        while placed < w.count && scratch.place(nodes, w, in_pool).is_some() {
            placed += 1;
        }
        if placed < w.count {
            out.push(WaitingTasks {
                count: w.count - placed,
                ..w.clone()
            });
        }
    }
    out
}

/// The tasks of `a` that did not fit (after `fit` GPUs of them did), at most `owed` GPUs.
fn unmet_tasks(
    a: &AppDemand,
    fit: u32,
    owed: u32,
    nodes: &[NodeCap],
    in_pool: &dyn Fn(usize) -> bool,
) -> Vec<WaitingTasks> {
    let mut skip = fit;
    let mut budget = owed;
    let mut out = Vec::new();
    for w in a.waiting.iter().filter(|w| w.gpus > 0) {
        if !(0..nodes.len()).any(|n| in_pool(n) && eligible(&nodes[n], w)) {
            continue;
        }
        let mut n = 0;
        for _ in 0..w.count {
            if skip >= w.gpus {
                skip -= w.gpus;
                continue;
            }
            if budget < w.gpus {
                break;
            }
            budget -= w.gpus;
            n += 1;
        }
        if n > 0 {
            out.push(WaitingTasks { count: n, ..w.clone() });
        }
    }
    out
}

/// Marks a choice's containers taken and gives their resources to `scratch`; returns the
/// GPUs wholly freed in the pool (a shared GPU once its last share goes).
fn apply_choice(
    snap: &Snapshot,
    units: &[victims::Unit],
    choice: &victims::Choice,
    scratch: &mut Scratch,
    taken: &mut [bool],
    leaving: &mut [u32],
    in_pool: &dyn Fn(usize) -> bool,
) -> u32 {
    let before = scratch.free_gpus(in_pool);
    for &u in &choice.units {
        for &h in &units[u].held {
            let held = &snap.held[h];
            taken[h] = true;
            scratch.give(held);
            if in_pool(held.node) {
                leaving[snap.apps[held.app].queue] += held.hundredths();
            }
        }
    }
    scratch.free_gpus(in_pool).saturating_sub(before)
}

fn why_waiting(
    tree: &QueueTree,
    shares: &Shares,
    gained: &[Vec<u32>],
    snap: &Snapshot,
    a: usize,
    reclaiming: Option<&(u32, BTreeSet<String>)>,
    protected: bool,
) -> WaitReason {
    let app = &snap.apps[a];
    // At its cap when not even its smallest waiting task fits under it.
    let smallest = app
        .waiting
        .iter()
        .filter(|w| w.count > 0)
        .map(WaitingTasks::hundredths)
        .filter(|&h| h > 0)
        .min()
        .unwrap_or(1);
    if let Some(cap) = at_cap(tree, shares, app.queue, smallest) {
        return cap;
    }
    if let Some((gpus, from)) = reclaiming {
        return WaitReason::Reclaiming {
            gpus: *gpus,
            from: from.iter().cloned().collect(),
        };
    }
    // Incoming GPUs from earlier decisions count as reclaiming too (a part of one as one).
    let incoming: u32 = (0..shares.pools.len())
        .map(|p| shares.incoming[p][app.queue])
        .sum::<u32>()
        .div_ceil(WHOLE);
    let pool = (0..shares.pools.len()).max_by(|&x, &y| shares.waiting[x][app.queue].cmp(&shares.waiting[y][app.queue]));
    let Some(p) = pool else {
        return WaitReason::NothingFits;
    };
    let (used, deserved) = (shares.used[p][app.queue], shares.deserved[p][app.queue]);
    let used_gpus = GpuAmount(used);
    let queue = tree.get(app.queue).path.clone();
    if protected {
        return WaitReason::GangProtected {
            queue,
            used: used_gpus,
            deserved,
        };
    }
    // What the queue will hold once what is being taken back for it arrives.
    let coming = shares.incoming[p][app.queue] + gained[p][app.queue];
    let others_want = tree
        .leaves()
        .any(|q| q != app.queue && shares.used[p][q] + shares.waiting[p][q] > 0);
    if gpus_of(used + coming) >= deserved - EPS && others_want {
        return WaitReason::OverShare {
            queue,
            used: GpuAmount(used + coming),
            deserved,
        };
    }
    if incoming > 0 {
        return WaitReason::Reclaiming {
            gpus: incoming,
            from: Vec::new(),
        };
    }
    WaitReason::NothingFits
}

#[cfg(test)]
mod tests;
