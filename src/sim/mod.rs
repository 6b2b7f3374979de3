//! `gpuam sim`: a trace-driven, discrete-event placement simulator. A stream of gang jobs
//! (all tasks or none) waits in one FIFO queue (head-of-line blocking: a job that does
//! not fit blocks those behind it), holds its resources for its duration and frees them.
//! Each policy places the same stream (paired design); the `gpuam` policy is the real
//! select pipeline ([`Selector::select_and_reserve`] with a [`JobDemand`], bookings
//! undone with [`Selector::remove_requested`]), the baselines are in `policies.rs`.
//!
//! Why it does not drive the AM's job machine (`am::machine`, which `gpuam run` and
//! `gpuam plan` drive): the simulator compares placement *policies* on one stream, each
//! deciding a whole gang at once in virtual time with its decision time measured; the job
//! machine adds what no baseline has (asks and their answers, the per-role back-off, gang
//! hold-back and timeouts, heartbeats), which would make the paired comparison unfair and the
//! decision times those of the machine, not of the policy. It calls the same select pipeline
//! the machine's placement round calls, with the same topology wait.

pub mod charts;
pub mod cluster;
pub mod dominance;
pub mod fractional;
pub mod metrics;
pub mod policies;
pub mod queues;
pub mod report;
pub mod reserve;
pub mod workload;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::cluster::ClusterView;
use crate::config::SelectSettings;
use crate::resources::{GpuMask, PortSet, Resources};
use crate::select::{JobDemand, Outcome, PlacementRound, Selector, TaskAsk, TaskShape, TaskSlot};
use crate::spec::{JobSpec, TaskResources, TaskRole};
use crate::topology::{choose, Topology};

use crate::rm::scheduler::reservation::{self, Policy, Release, Reservation, Room};
use crate::rm::scheduler::walk::{Queued, Reserved};
use cluster::{SimCluster, Task};
use metrics::{PolicyResult, RunStats};
use policies::NodePolicy;
use reserve::{ms, Durations, Queueing};
use workload::Job;

/// Every policy the simulator knows, in report order.
pub const POLICIES: &[&str] = &["original", "random", "besteffort", "hived", "gpuam"];

/// One policy instance for one run.
pub enum Placer {
    /// The real select pipeline over its own copy of the nodes.
    Gpuam {
        selector: Box<Selector>,
        hosts: HashMap<String, usize>,
        /// The last `place` failed because a task held out for a better GPU tier.
        held_for_tier: bool,
        /// The last `place` was refused for good (e.g. a gang no single GPU type holds).
        impossible: bool,
    },
    Other(Box<dyn NodePolicy>),
}

impl Placer {
    /// `topology_wait_sec`: gpuam's `select.topology_wait_sec` (the other policies never wait).
    pub fn new(name: &str, cl: &SimCluster, seed: u64, topology_wait_sec: u64) -> Option<Placer> {
        let rng = StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
        Some(match name {
            "gpuam" => {
                let settings = SelectSettings {
                    seed: Some(seed),
                    skip_local_tried_resource: false,
                    topology_wait_sec,
                    ..SelectSettings::default()
                };
                Placer::Gpuam {
                    selector: Box::new(Selector::new(ClusterView::new(cl.to_nodes()), settings)),
                    hosts: cl.nodes.iter().enumerate().map(|(i, n)| (n.host.clone(), i)).collect(),
                    held_for_tier: false,
                    impossible: false,
                }
            }
            "original" => Placer::Other(Box::new(policies::Original { rng })),
            "random" => Placer::Other(Box::new(policies::RandomPolicy { rng })),
            "besteffort" => Placer::Other(Box::new(policies::BestEffort {
                rng,
                fallbacks: 0,
                invalid: 0,
            })),
            "hived" => Placer::Other(Box::new(policies::Hived { trees: HashMap::new() })),
            _ => return None,
        })
    }

    fn resources(t: &Task, mask: GpuMask) -> Resources {
        Resources::with_mask(t.cpu, t.mem_mb, mask, PortSet::new())
    }

    /// Tells gpuam whether other jobs wait behind the one it places next (queue pressure,
    /// [`Selector::set_others_wait`]); the other policies do not look.
    pub fn set_others_wait(&mut self, others_wait: bool) {
        if let Placer::Gpuam { selector, .. } = self {
            selector.set_others_wait(others_wait);
        }
    }

    /// Tells gpuam when `node` is whole again by the declared limits of what runs there (what
    /// the RM's node reports carry, `drain_by_ms`); the other policies do not look.
    pub fn set_drain_by(&mut self, cl: &SimCluster, node: usize, drain_by_ms: u64) {
        if let Placer::Gpuam { selector, .. } = self {
            selector.set_drain_by(&cl.nodes[node].host, Some(drain_by_ms));
        }
    }

    /// gpuam's `select.topology_wait_sec` (0 for the other policies, which never wait).
    pub fn topology_wait_sec(&self) -> f64 {
        match self {
            Placer::Gpuam { selector, .. } => selector.settings().topology_wait_sec as f64,
            Placer::Other(_) => 0.0,
        }
    }

    /// Places every task of `job` or none (gang); bookings go to `cl` (and, for gpuam,
    /// to the selector's view). Records the decision time of every placing call.
    /// `topology_wait`: the job may still wait for its nodes' ideal GPU tier (gpuam only).
    /// `declared`: the clock (ms) and the job's declared run-time limit (seconds), when it
    /// declares one (`--run-limits`): gpuam's drain term reads them.
    pub fn place(
        &mut self,
        cl: &mut SimCluster,
        job: &Job,
        stats: &mut RunStats,
        topology_wait: bool,
        declared: Option<(u64, u64)>,
    ) -> Option<Vec<(usize, GpuMask)>> {
        let mut done: Vec<(usize, GpuMask)> = Vec::with_capacity(job.tasks.len());
        let mut ok = true;
        match self {
            Placer::Other(p) => {
                for (i, t) in job.tasks.iter().enumerate() {
                    let start = Instant::now();
                    let pick = p.choose(cl, t, (job.tasks.len() - i) as u32);
                    let took = start.elapsed().as_nanos() as u64;
                    match pick {
                        Some((node, mask)) if cl.book(node, mask, t) => {
                            stats.decision_ns.push(took);
                            done.push((node, mask));
                        }
                        Some(_) => {
                            stats.refused += 1;
                            ok = false;
                            break;
                        }
                        None => {
                            ok = false;
                            break;
                        }
                    }
                }
                if !ok {
                    for ((node, mask), t) in done.iter().zip(&job.tasks) {
                        cl.free(*node, *mask, t);
                    }
                }
            }
            Placer::Gpuam {
                selector,
                hosts,
                held_for_tier,
                impossible,
            } => {
                *held_for_tier = false;
                *impossible = false;
                // The AM's own placement round over the job as a gang spec: one GPU type
                // per gang (select::one_type) and the request order come from there.
                let (spec, task_of) = gang_spec(job, declared.map(|d| d.1));
                if let Some((now_ms, _)) = declared {
                    selector.set_clock(now_ms);
                }
                let mut round = PlacementRound::new(&spec, |_, _| TaskSlot::Waiting {
                    ready: true,
                    topology_wait,
                });
                let mut at: Vec<Option<(usize, GpuMask)>> = vec![None; job.tasks.len()];
                while let Some((ri, i)) = round.next_task() {
                    let k = task_of[ri][i as usize];
                    let t = &job.tasks[k];
                    let start = Instant::now();
                    let sel = round.place(selector, (ri, i)).selection;
                    let took = start.elapsed().as_nanos() as u64;
                    let p = match sel.outcome {
                        Outcome::Placed(p) => p,
                        Outcome::NotNow { wait, .. } => {
                            *held_for_tier = wait == crate::reason::Kind::Topology;
                            ok = false;
                            break;
                        }
                        Outcome::Impossible { .. } => {
                            *impossible = true;
                            ok = false;
                            break;
                        }
                    };
                    let node = hosts.get(&p.host).copied();
                    let mask = p.resources.gpu_mask;
                    match node {
                        Some(n) if cl.book(n, mask, t) => {
                            stats.decision_ns.push(took);
                            at[k] = Some((n, mask));
                        }
                        _ => {
                            stats.refused += 1;
                            selector.remove_requested(&p.host, &p.resources, false);
                            ok = false;
                            break;
                        }
                    }
                }
                if ok && at.iter().all(Option::is_some) {
                    done = at.into_iter().flatten().collect();
                } else {
                    ok = false;
                    for (k, slot) in at.iter().enumerate() {
                        if let Some((node, mask)) = slot {
                            let t = &job.tasks[k];
                            selector.remove_requested(&cl.nodes[*node].host, &Self::resources(t, *mask), false);
                            cl.free(*node, *mask, t);
                        }
                    }
                }
            }
        }
        ok.then_some(done)
    }

    /// The last [`Placer::place`] failed because a task held out for a better GPU tier
    /// (gpuam's topology wait).
    fn held_for_tier(&self) -> bool {
        matches!(
            self,
            Placer::Gpuam {
                held_for_tier: true,
                ..
            }
        )
    }

    /// The last [`Placer::place`] was refused for good: no waiting makes the job fit (gpuam:
    /// a gang that no single GPU type can ever hold).
    fn impossible(&self) -> bool {
        matches!(self, Placer::Gpuam { impossible: true, .. })
    }

    /// Frees a finished job's tasks.
    pub fn release(&mut self, cl: &mut SimCluster, job: &Job, placed: &[(usize, GpuMask)]) {
        for ((node, mask), t) in placed.iter().zip(&job.tasks) {
            if let Placer::Gpuam { selector, .. } = self {
                selector.remove_requested(&cl.nodes[*node].host, &Self::resources(t, *mask), false);
            }
            cl.free(*node, *mask, t);
        }
    }

    fn finish(&self, stats: &mut RunStats) {
        if let Placer::Other(p) = self {
            stats.fallbacks = p.fallbacks();
            stats.invalid = p.invalid();
        }
    }
}

/// The job as the AM sees a gang spec: one role per distinct task shape (in first-seen
/// order), and per role the sim task behind each instance.
fn gang_spec(job: &Job, max_run_sec: Option<u64>) -> (JobSpec, Vec<Vec<usize>>) {
    let mut roles: Vec<TaskRole> = Vec::new();
    let mut task_of: Vec<Vec<usize>> = Vec::new();
    let mut shapes: Vec<Task> = Vec::new();
    for (k, t) in job.tasks.iter().enumerate() {
        let ri = match shapes.iter().position(|s| s == t) {
            Some(ri) => ri,
            None => {
                shapes.push(*t);
                roles.push(TaskRole {
                    name: format!("r{}", roles.len()),
                    resources: TaskResources {
                        cpu: t.cpu,
                        memory_mb: t.mem_mb,
                        gpus: t.gpus,
                        ..Default::default()
                    },
                    max_run_sec,
                    ..Default::default()
                });
                task_of.push(Vec::new());
                roles.len() - 1
            }
        };
        roles[ri].instances += 1;
        task_of[ri].push(k);
    }
    let spec = JobSpec {
        name: "sim".into(),
        gang: true,
        task_roles: roles,
        ..Default::default()
    };
    (spec, task_of)
}

fn shape(t: &Task) -> TaskShape {
    TaskShape {
        cpu: t.cpu,
        memory_mb: t.mem_mb,
        gpus: t.gpus,
        ports: 0,
        ..Default::default()
    }
}

/// Per-topology reference values: T*(k) and W*(k) on the empty node, and whether a free
/// mask still holds a T*(k) set (memoised: many nodes share a free mask).
#[derive(Default)]
pub struct Ideal {
    best: HashMap<(usize, u32), (u8, u32)>,
    avail: HashMap<(usize, GpuMask, u32), bool>,
    tier_in: HashMap<(usize, GpuMask, u32), Option<u8>>,
}

impl Ideal {
    pub fn best(&mut self, ti: usize, t: &Topology, k: u32) -> (u8, u32) {
        *self.best.entry((ti, k)).or_insert_with(|| {
            let w = choose(Some(t), t.all_mask(), k).map(|c| c.weight).unwrap_or(0);
            (t.best_tier(k), w)
        })
    }

    /// The best tier of a `k`-set among `free` GPUs (0 when fewer are free).
    pub fn tier_in(&mut self, ti: usize, t: &Topology, free: GpuMask, k: u32) -> Option<u8> {
        if free.count_ones() < k {
            return None;
        }
        *self
            .tier_in
            .entry((ti, free, k))
            .or_insert_with(|| choose(Some(t), free, k).map(|c| c.tier))
    }

    pub fn available(&mut self, ti: usize, t: &Topology, free: GpuMask, k: u32) -> bool {
        if free.count_ones() < k {
            return false;
        }
        let (tier, _) = self.best(ti, t, k);
        *self
            .avail
            .entry((ti, free, k))
            .or_insert_with(|| choose(Some(t), free, k).is_some_and(|c| c.tier >= tier))
    }
}

/// A job that no empty node set could ever hold: a task larger than every node.
fn never_fits(cl: &SimCluster, job: &Job) -> bool {
    job.tasks.iter().any(|t| {
        !cl.nodes
            .iter()
            .any(|n| n.gpus_total() >= t.gpus && n.cpu_total >= t.cpu && n.mem_total >= t.mem_mb)
    })
}

/// The simulation state of one run.
struct Engine<'a> {
    jobs: &'a [Job],
    cl: SimCluster,
    placer: Placer,
    stats: RunStats,
    ideal: Ideal,
    done: BinaryHeap<Reverse<(u64, usize)>>,
    running: HashMap<usize, Vec<(usize, GpuMask)>>,
    queue: VecDeque<usize>,
    /// Queueing discipline, reservations and expected durations (issue 27, items 3 and 4).
    mode: Queueing,
    /// Per running job: its start and expected duration (`None`: unknown).
    expected: HashMap<usize, (f64, Option<f64>)>,
    /// Durations of the jobs that ended (learned limits).
    history: Durations,
    /// Per waiting job: its estimated start, made at its submit.
    estimates: HashMap<usize, f64>,
    /// The reservation the last backfill pass left (its holder, and the room it books),
    /// which the start estimates honour.
    reserved: Option<(usize, Reservation)>,
    /// GPUs held by running jobs, and the time up to which their use is counted.
    used_gpus: u64,
    counted_to: f64,
    max_node: f64,
    max_rack: f64,
    /// The placer's topology wait (seconds), and the time the queue's head stops waiting
    /// for a better GPU tier (a wake-up event; infinite = none).
    topology_wait: f64,
    wake: f64,
    /// Why the queue's head waits since `head_since` (the blocked-time diagnosis).
    head: HeadBlock,
    head_since: f64,
    /// With `--run-limits`: per node, the declared ends (ms) of the tasks running there
    /// (with their counts), and per running job its declared end.
    node_ends: Vec<std::collections::BTreeMap<u64, u32>>,
    declared_end: HashMap<usize, u64>,
}

/// A job's tasks as reservations count them.
fn rooms(job: &Job) -> Vec<Room> {
    job.tasks.iter().map(reserve::room_of).collect()
}

/// A job's tasks as (GPUs, cores, memory MB): jobs alike for the policy.
type Shape = Vec<(u32, u32, u64)>;

/// Why the queue's head is not placed (docs/DESIGN-NOTES.md, "Where queueing delay comes
/// from"): the job holds out for a better GPU tier (the topology wait), or the cluster lacks
/// the GPUs, or it has them but not in shapes the job can take (fragmentation). Every job
/// behind the head waits too (FIFO).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HeadBlock {
    None,
    Capacity,
    Fragmented,
    TopologyWait,
}

impl Engine<'_> {
    fn drain(&mut self, now: f64) {
        if self.mode.backfill {
            self.drain_backfill(now);
        } else {
            self.drain_queue(now);
        }
    }

    /// FIFO with head-of-line blocking: place jobs in arrival order until one does not fit.
    /// A job not placed while it may still wait for a better GPU tier gets a wake-up at the end
    /// of its wait (a completion may come first).
    fn drain_queue(&mut self, now: f64) {
        while let Some(&jid) = self.queue.front() {
            let job = &self.jobs[jid];
            let wait_end = job.arrival + self.topology_wait;
            let may_wait = now < wait_end;
            self.placer.set_others_wait(self.queue.len() > 1);
            let declared = self.declared(jid, now);
            let placed = self
                .placer
                .place(&mut self.cl, job, &mut self.stats, may_wait, declared);
            if placed.is_none() && may_wait {
                self.wake = self.wake.min(wait_end);
            }
            match placed {
                Some(placed) => {
                    self.queue.pop_front();
                    self.start(jid, placed, now);
                }
                None if self.running.is_empty() || self.placer.impossible() => {
                    // Nothing runs and it still does not fit, or the policy refused it for
                    // good: it never will.
                    self.queue.pop_front();
                    self.stats.dropped_jobs += 1;
                }
                None => break,
            }
        }
        self.classify_head(now);
    }

    /// Starts job `jid` on `placed` (already booked) at `now`.
    fn start(&mut self, jid: usize, placed: Vec<(usize, GpuMask)>, now: f64) {
        let job = &self.jobs[jid];
        self.record(job, &placed, now);
        let end = now + job.duration;
        self.stats.last_end = self.stats.last_end.max(end);
        self.done.push(Reverse((end.to_bits(), jid)));
        self.running.insert(jid, placed);
        self.used_gpus += u64::from(job.gpus());
        let exp = self.history.expected(self.mode.limit, job.id, job.gpus(), job.duration);
        self.expected.insert(jid, (now, exp));
        if let Some((_, run)) = self.declared(jid, now) {
            let end = ms(now).saturating_add(run.saturating_mul(1000));
            self.declared_end.insert(jid, end);
            self.note_ends(jid, end, true);
        }
    }

    /// The clock and job `jid`'s declared limit, when jobs declare them (`--run-limits`).
    fn declared(&self, jid: usize, now: f64) -> Option<(u64, u64)> {
        let job = &self.jobs[jid];
        self.mode
            .run_limits
            .map(|r| (ms(now), reserve::declared_run_sec(r, job.id, job.duration)))
    }

    /// Adds (or removes) job `jid`'s declared end on its nodes and tells the placer when
    /// each of them is whole again.
    fn note_ends(&mut self, jid: usize, end: u64, add: bool) {
        let Some(placed) = self.running.get(&jid) else {
            return;
        };
        let nodes: Vec<usize> = placed.iter().map(|(n, _)| *n).collect();
        for n in nodes {
            let ends = &mut self.node_ends[n];
            if add {
                *ends.entry(end).or_insert(0) += 1;
            } else if let Some(c) = ends.get_mut(&end) {
                *c -= 1;
                if *c == 0 {
                    ends.remove(&end);
                }
            }
            let drain = ends.keys().next_back().copied().unwrap_or(0);
            self.placer.set_drain_by(&self.cl, n, drain);
        }
    }

    /// Job `jid` ended: its room is freed and its duration learned.
    fn end(&mut self, jid: usize) {
        if let Some(end) = self.declared_end.remove(&jid) {
            self.note_ends(jid, end, false);
        }
        if let Some(p) = self.running.remove(&jid) {
            self.placer.release(&mut self.cl, &self.jobs[jid], &p);
            self.used_gpus = self.used_gpus.saturating_sub(u64::from(self.jobs[jid].gpus()));
        }
        self.expected.remove(&jid);
        let job = &self.jobs[jid];
        self.history.record(
            job.gpus(),
            job.duration,
            self.mode.limit.declared_sec(job.id, job.duration),
        );
    }

    /// Counts the GPUs in use from the last event to `now`, within the arrivals' span
    /// (`utilizationArrivals`: the makespan-based `utilization` is set by the last long job).
    fn account(&mut self, now: f64) {
        let t0 = self.counted_to.max(self.stats.first_arrival);
        let t1 = now.min(self.stats.last_arrival);
        if t1 > t0 {
            self.stats.busy_gpu_seconds += self.used_gpus as f64 * (t1 - t0);
        }
        self.counted_to = self.counted_to.max(now);
    }

    /// The running jobs' tasks with their expected ends seen at `now`.
    fn releases(&self, now: f64) -> Vec<Release> {
        let mut out = Vec::new();
        for (jid, placed) in &self.running {
            let job = &self.jobs[*jid];
            let end = self.expected.get(jid).and_then(|&(start, exp)| match self.mode.limit {
                reserve::Limit::Calibrated(..) => {
                    let limit = self.mode.limit.declared_sec(job.id, job.duration)?;
                    Some(ms(reservation::calibrated_end(start, limit, self.history.ratio(), now)))
                }
                _ => exp.map(|e| ms(reservation::expected_end(start, e, now))),
            });
            for (node, room) in reserve::takes(placed, &self.jobs[*jid].tasks) {
                out.push(Release {
                    node,
                    room,
                    end_ms: end,
                });
            }
        }
        out
    }

    /// The estimated start of the job just queued (issue 27, item 4): the queue ahead and
    /// the running jobs' expected ends through [`reserve::estimate_start`], walked in the
    /// simulator's discipline (FIFO, or backfill: jobs that fit overtake).
    fn estimate(&mut self, jid: usize, now: f64) {
        let ahead_ids: Vec<usize> = self.queue.iter().copied().take_while(|&j| j != jid).collect();
        let ahead_rooms: Vec<Vec<Room>> = ahead_ids.iter().map(|&j| rooms(&self.jobs[j])).collect();
        let tasks = rooms(&self.jobs[jid]);
        // Its own expected duration (the reservation lets it backfill by it).
        let mine = &self.jobs[jid];
        let me = Queued::gang(
            &tasks,
            self.history
                .expected(self.mode.limit, mine.id, mine.gpus(), mine.duration)
                .map(ms),
        );
        let free = reserve::free_rooms(&self.cl);
        let in_order = !self.mode.backfill;
        // The reservation a gang ahead holds: the others start only where it lets them.
        let reserved = self.reserved.as_ref().and_then(|(h, r)| {
            Some(Reserved {
                holder: ahead_ids.iter().position(|j| j == h)?,
                reservation: r.clone(),
                exempt_below: 0,
            })
        });
        // Learned limits, and calibrated ones once enough jobs ended, are drawn: the median
        // start of walks over drawn ends (`reserve::estimate_start_sampled`).
        let calibrated = matches!(self.mode.limit, reserve::Limit::Calibrated(..));
        let start = if self.mode.limit == reserve::Limit::Learned || (calibrated && self.history.calibrated()) {
            // In job order: the draws follow the jobs, and a replay is deterministic.
            let mut ids: Vec<(&usize, &Vec<(usize, GpuMask)>)> = self.running.iter().collect();
            ids.sort_unstable_by_key(|(j, _)| **j);
            let limit_of = |j: usize| {
                let job = &self.jobs[j];
                self.mode.limit.declared_sec(job.id, job.duration)
            };
            let running: Vec<reserve::Running> = ids
                .into_iter()
                .map(|(j, placed)| reserve::Running {
                    takes: reserve::takes(placed, &self.jobs[*j].tasks),
                    gpus: self.jobs[*j].gpus(),
                    elapsed: self.expected.get(j).map_or(0.0, |&(start, _)| now - start),
                    limit: limit_of(*j),
                })
                .collect();
            let waiting: Vec<reserve::Waiting> = ahead_ids
                .iter()
                .zip(&ahead_rooms)
                .map(|(&j, r)| reserve::Waiting {
                    tasks: r,
                    gpus: self.jobs[j].gpus(),
                    limit: limit_of(j),
                })
                .collect();
            reserve::estimate_start_sampled(
                &free,
                &running,
                &waiting,
                &me,
                now,
                in_order,
                reserved.as_ref(),
                &self.history,
                calibrated,
                jid as u64,
            )
        } else {
            let ahead: Vec<Queued> = ahead_ids
                .iter()
                .zip(&ahead_rooms)
                .map(|(&j, r)| {
                    let job = &self.jobs[j];
                    Queued::gang(
                        r,
                        self.history
                            .expected(self.mode.limit, job.id, job.gpus(), job.duration)
                            .map(ms),
                    )
                })
                .collect();
            reserve::estimate_start(
                &free,
                &self.releases(now),
                &ahead,
                &me,
                ms(now),
                in_order,
                reserved.as_ref(),
            )
        };
        if let Some(t) = start {
            self.estimates.insert(jid, t as f64 / 1000.0);
        }
    }

    /// Greedy backfill (`Queueing::backfill`): every waiting job that fits starts, in arrival
    /// order; with a reservation policy, the oldest waiting gang it picks holds the one
    /// reservation and the others start only where the reservation lets them.
    fn drain_backfill(&mut self, now: f64) {
        let mut held: Option<(usize, Reservation)> = None;
        if let Some(policy) = self.mode.reserve {
            let mut tried: HashSet<usize> = HashSet::new();
            loop {
                let cand = self.queue.iter().copied().find(|&j| {
                    let job = &self.jobs[j];
                    !tried.contains(&j) && policy.applies(ms(now).saturating_sub(ms(job.arrival)), job.gpus())
                });
                let Some(j) = cand else { break };
                tried.insert(j);
                if self.try_start(j, now) {
                    continue;
                }
                if let Some(r) = reservation::reserve(
                    &reserve::free_rooms(&self.cl),
                    &self.releases(now),
                    &rooms(&self.jobs[j]),
                    ms(now),
                ) {
                    held = Some((j, r));
                    break;
                }
            }
        }
        let ids: Vec<usize> = self.queue.iter().copied().collect();
        // Shapes (tasks' GPUs, cores, memory; may wait) the policy could not place at this event, and the
        // earliest expected end the reservation refused per shape: later jobs of the shape
        // are not tried again (one pass stays linear in the queue).
        let mut failed: HashSet<(Shape, bool)> = HashSet::new();
        let mut refused: HashMap<Shape, u64> = HashMap::new();
        let mut free: u64 = self.cl.nodes.iter().map(|n| u64::from(n.free_mask.count_ones())).sum();
        for j in ids {
            if held.as_ref().is_some_and(|(h, _)| *h == j) {
                continue;
            }
            let job = &self.jobs[j];
            if free < u64::from(job.gpus()) {
                continue;
            }
            let end = self
                .history
                .bound(self.mode.limit, job.id, job.gpus(), job.duration)
                .map_or(u64::MAX, |e| ms(now + e));
            let gpus: Shape = job.tasks.iter().map(|t| (t.gpus, t.cpu, t.mem_mb)).collect();
            if refused.get(&gpus).is_some_and(|&r| end >= r) {
                continue;
            }
            let wait_end = job.arrival + self.topology_wait;
            let may_wait = now < wait_end;
            let key = (gpus.clone(), may_wait);
            if failed.contains(&key) {
                continue;
            }
            self.placer.set_others_wait(self.queue.len() > 1);
            let declared = self.declared(j, now);
            let Some(placed) = self
                .placer
                .place(&mut self.cl, job, &mut self.stats, may_wait, declared)
            else {
                if may_wait {
                    self.wake = self.wake.min(wait_end);
                }
                if self.placer.impossible() {
                    self.queue.retain(|&x| x != j);
                    self.stats.dropped_jobs += 1;
                } else {
                    failed.insert(key);
                }
                continue;
            };
            if let Some((_, r)) = held.as_mut() {
                if !r.backfill(&reserve::takes(&placed, &job.tasks), (end != u64::MAX).then_some(end)) {
                    self.placer.release(&mut self.cl, job, &placed);
                    let r = refused.entry(gpus).or_insert(end);
                    *r = (*r).min(end);
                    continue;
                }
            }
            free -= u64::from(job.gpus());
            self.queue.retain(|&x| x != j);
            self.start(j, placed, now);
        }
        let idle = self.running.is_empty() && held.is_none();
        self.reserved = held;
        if idle {
            // Nothing runs and what waits did not fit an empty cluster: it never will.
            let n = self.queue.len() as u64;
            if n > 0 && self.wake.is_infinite() {
                self.queue.clear();
                self.stats.dropped_jobs += n;
            }
        }
        self.classify_head(now);
    }

    /// Starts waiting job `j` now if the policy places it; false otherwise.
    fn try_start(&mut self, j: usize, now: f64) -> bool {
        let job = &self.jobs[j];
        let may_wait = now < job.arrival + self.topology_wait;
        self.placer.set_others_wait(self.queue.len() > 1);
        let declared = self.declared(j, now);
        match self
            .placer
            .place(&mut self.cl, job, &mut self.stats, may_wait, declared)
        {
            Some(placed) => {
                self.queue.retain(|&x| x != j);
                self.start(j, placed, now);
                true
            }
            None => {
                if may_wait {
                    self.wake = self.wake.min(job.arrival + self.topology_wait);
                }
                false
            }
        }
    }

    /// Charges the time since the last event to the head's previous state, then classifies
    /// the head now (see [`HeadBlock`]).
    fn classify_head(&mut self, now: f64) {
        let span = (now - self.head_since).max(0.0);
        let st = &mut self.stats;
        match self.head {
            HeadBlock::None => {}
            HeadBlock::Capacity => st.head_capacity_sec += span,
            HeadBlock::Fragmented => st.head_fragmented_sec += span,
            HeadBlock::TopologyWait => st.head_topology_wait_sec += span,
        }
        self.head_since = now;
        self.head = match self.queue.front() {
            None => HeadBlock::None,
            Some(&jid) => {
                let job = &self.jobs[jid];
                let free: u64 = self.cl.nodes.iter().map(|n| u64::from(n.free_mask.count_ones())).sum();
                if self.placer.held_for_tier() {
                    HeadBlock::TopologyWait
                } else if free < u64::from(job.gpus()) {
                    HeadBlock::Capacity
                } else {
                    HeadBlock::Fragmented
                }
            }
        };
    }

    fn arrive(&mut self, j: &Job) {
        if never_fits(&self.cl, j) {
            self.stats.dropped_jobs += 1;
            return;
        }
        for t in j.tasks.iter().filter(|t| t.gpus >= 2) {
            self.stats.multi_arrivals += 1;
            let cl = &self.cl;
            let ideal = &mut self.ideal;
            let exists = cl
                .nodes
                .iter()
                .any(|n| n.fits(t) && ideal.available(n.topo, &cl.topos[n.topo], n.free_mask, t.gpus));
            self.stats.multi_avail += u64::from(exists);
        }
        self.queue.push_back(j.id);
        self.estimate(j.id, j.arrival);
    }

    fn record(&mut self, job: &Job, placed: &[(usize, GpuMask)], now: f64) {
        let st = &mut self.stats;
        st.placed_jobs += 1;
        let wait = now - job.arrival;
        st.delays.push(wait);
        if job.gpus() >= self.mode.big_gpus {
            st.big_delays.push(wait);
        } else if job.tasks.len() == 1 {
            st.small_delays.push(wait);
        }
        if let Some(est) = self.estimates.remove(&job.id) {
            st.estimate_err.push(((est - now).abs(), wait));
        }
        st.gpu_seconds += f64::from(job.gpus()) * job.duration;
        for ((node, mask), t) in placed.iter().zip(&job.tasks) {
            if t.gpus < 2 {
                continue;
            }
            let ti = self.cl.nodes[*node].topo;
            let topo = &self.cl.topos[ti];
            let (best_tier, best_w) = self.ideal.best(ti, topo, t.gpus);
            st.multi_placed += 1;
            st.multi_ideal += u64::from(topo.tier(*mask) >= best_tier);
            st.w_ratio_sum += if best_w > 0 {
                f64::from(topo.weight(*mask)) / f64::from(best_w)
            } else {
                1.0
            };
        }
        // The job-level metric: each node's union of the job's GPUs against the best tier
        // any node offered for a set of that size just before the job was placed.
        let mut unions: HashMap<usize, GpuMask> = HashMap::new();
        for (node, mask) in placed {
            *unions.entry(*node).or_insert(0) |= *mask;
        }
        if unions.values().any(|u| u.count_ones() >= 2) {
            let before = |n: usize| self.cl.nodes[n].free_mask | unions.get(&n).copied().unwrap_or(0);
            let mut size_best: HashMap<u32, u8> = HashMap::new();
            for (&node, &u) in &unions {
                let k = u.count_ones();
                if k < 2 {
                    continue;
                }
                let best = match size_best.get(&k) {
                    Some(&b) => b,
                    None => {
                        let mut b = 0;
                        for (i, n) in self.cl.nodes.iter().enumerate() {
                            if b == 2 {
                                break;
                            }
                            if let Some(t) = self.ideal.tier_in(n.topo, &self.cl.topos[n.topo], before(i), k) {
                                b = b.max(t);
                            }
                        }
                        size_best.insert(k, b);
                        b
                    }
                };
                let topo = &self.cl.topos[self.cl.nodes[node].topo];
                st.union_placed += 1;
                st.union_ideal += u64::from(topo.tier(u) >= best);
            }
        }
        if job.tasks.len() > 1 {
            let nodes: HashSet<usize> = placed.iter().map(|(n, _)| *n).collect();
            let racks: HashSet<usize> = nodes.iter().map(|&n| self.cl.nodes[n].rack).collect();
            let g = f64::from(job.gpus());
            let min_nodes = (g / self.max_node).ceil() as u64;
            let min_racks = (g / self.max_rack).ceil() as u64;
            st.multi_task_jobs += 1;
            st.nodes_over_min += (nodes.len() as u64).saturating_sub(min_nodes);
            st.racks_over_min += (racks.len() as u64).saturating_sub(min_racks);
            st.at_min_nodes += u64::from(nodes.len() as u64 <= min_nodes);
            let types: HashSet<&str> = placed
                .iter()
                .zip(&job.tasks)
                .filter(|(_, t)| t.gpus > 0)
                .map(|((n, _), _)| &*self.cl.nodes[*n].gpu_type)
                .collect();
            st.mixed_type_jobs += u64::from(types.len() > 1);
        }
    }
}

/// Replays `jobs` (sorted by arrival, ids = positions) on a fresh copy of `cl` with one
/// policy, gpuam with its default settings. `None` for an unknown policy name.
pub fn simulate(cl: &SimCluster, jobs: &[Job], policy: &str, seed: u64) -> Option<RunStats> {
    simulate_with(cl, jobs, policy, seed, SelectSettings::default().topology_wait_sec)
}

/// [`simulate`] with gpuam's `select.topology_wait_sec` given.
pub fn simulate_with(
    cl: &SimCluster,
    jobs: &[Job],
    policy: &str,
    seed: u64,
    topology_wait_sec: u64,
) -> Option<RunStats> {
    simulate_queueing(cl, jobs, policy, seed, topology_wait_sec, Queueing::default())
}

/// [`simulate_with`] under a queueing discipline: FIFO, greedy backfill, or backfill with a
/// reservation for the gangs a [`Policy`] picks (issue 27, item 3).
pub fn simulate_queueing(
    cl: &SimCluster,
    jobs: &[Job],
    policy: &str,
    seed: u64,
    topology_wait_sec: u64,
    mode: Queueing,
) -> Option<RunStats> {
    let cl = cl.clone();
    let placer = Placer::new(policy, &cl, seed, topology_wait_sec)?;
    let topology_wait = placer.topology_wait_sec();
    let mut e = Engine {
        jobs,
        stats: RunStats {
            cluster_gpus: cl.total_gpus(),
            first_arrival: jobs.first().map(|j| j.arrival).unwrap_or(0.0),
            last_arrival: jobs.last().map(|j| j.arrival).unwrap_or(0.0),
            ..Default::default()
        },
        max_node: f64::from(cl.max_node_gpus().max(1)),
        max_rack: f64::from(cl.max_rack_gpus().max(1)),
        cl,
        placer,
        ideal: Ideal::default(),
        done: BinaryHeap::new(),
        running: HashMap::new(),
        queue: VecDeque::new(),
        mode,
        expected: HashMap::new(),
        history: Durations::default(),
        estimates: HashMap::new(),
        reserved: None,
        used_gpus: 0,
        counted_to: 0.0,
        topology_wait,
        wake: f64::INFINITY,
        head: HeadBlock::None,
        head_since: 0.0,
        node_ends: Vec::new(),
        declared_end: HashMap::new(),
    };
    e.node_ends = vec![Default::default(); e.cl.nodes.len()];
    if e.mode.run_limits.is_some() {
        for n in 0..e.cl.nodes.len() {
            e.placer.set_drain_by(&e.cl, n, 0);
        }
    }
    let mut next = 0usize;
    loop {
        let arr = jobs.get(next).map(|j| j.arrival).unwrap_or(f64::INFINITY);
        let end = e
            .done
            .peek()
            .map(|Reverse((t, _))| f64::from_bits(*t))
            .unwrap_or(f64::INFINITY);
        if arr.is_infinite() && end.is_infinite() {
            break;
        }
        e.account(e.wake.min(arr).min(end));
        if e.wake < arr.min(end) {
            let now = std::mem::replace(&mut e.wake, f64::INFINITY);
            e.drain(now);
            continue;
        }
        // Completions first at equal times: their resources are free for the arrival.
        let now = if end <= arr {
            if let Some(Reverse((_, jid))) = e.done.pop() {
                e.end(jid);
            }
            end
        } else {
            e.arrive(&jobs[next]);
            next += 1;
            arr
        };
        e.drain(now);
    }
    e.placer.finish(&mut e.stats);
    Some(e.stats)
}

/// Draws a random half-used state (each GPU used with probability ½, CPU and memory in
/// proportion) for the scaling run.
pub fn half_used(cl: &mut SimCluster, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    for n in &mut cl.nodes {
        let mut used = 0u64;
        for b in 0..64 {
            if n.all_mask >> b & 1 == 1 && rng.gen_bool(0.5) {
                used |= 1 << b;
            }
        }
        let k = used.count_ones();
        let g = n.gpus_total().max(1);
        n.free_mask = n.all_mask & !used;
        n.free_cpu = n.cpu_total - n.cpu_total * k / g;
        n.free_mem = n.mem_total - n.mem_total * u64::from(k) / u64::from(g);
    }
}

/// One point of the decision-time scaling run.
#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ScalingPoint {
    pub topology: String,
    pub gpus_per_node: u32,
    pub nodes: usize,
    pub policy: String,
    pub p50_us: f64,
    pub p99_us: f64,
    /// The first call (cold caches).
    pub first_us: f64,
}

/// Decision time of each policy for a 4-GPU task on half-used clusters of `sizes` nodes
/// of each preset (nothing booked between calls, so gpuam's choice cache is warm after
/// the first call, as in a running AM).
pub fn scaling(presets: &[&str], sizes: &[usize], policies: &[String], calls: usize, seed: u64) -> Vec<ScalingPoint> {
    let mut out = Vec::new();
    let task = Task {
        gpus: 4,
        cpu: 4 * workload::TASK_CPU_PER_GPU,
        mem_mb: 4 * workload::TASK_MEM_MB_PER_GPU,
    };
    for p in presets {
        let Some(topo) = Topology::preset(p) else { continue };
        for &n in sizes {
            let mut cl = cluster::generated(&topo, n, 40);
            half_used(&mut cl, seed);
            for pol in policies {
                let Some(mut placer) = Placer::new(pol, &cl, seed, 0) else {
                    continue;
                };
                if let Placer::Gpuam { selector, .. } = &placer {
                    selector.replace_nodes(used_nodes(&cl));
                }
                let mut times = Vec::with_capacity(calls);
                for _ in 0..calls {
                    let start = Instant::now();
                    match &mut placer {
                        Placer::Other(pp) => {
                            let _ = pp.choose(&cl, &task, 1);
                        }
                        Placer::Gpuam { selector, .. } => {
                            let res = TaskResources {
                                cpu: task.cpu,
                                memory_mb: task.mem_mb,
                                gpus: task.gpus,
                                gpu_mask: None,
                                ports: Vec::new(),
                                ..Default::default()
                            };
                            let mut d = JobDemand::new(true);
                            d.add_waiting(shape(&task), 1);
                            let ask = TaskAsk::plain("task", &res, 1);
                            let _ = selector.select(&ask, &d);
                        }
                    }
                    times.push(start.elapsed().as_secs_f64() * 1e6);
                }
                let first = times.first().copied().unwrap_or(0.0);
                times.sort_by(f64::total_cmp);
                out.push(ScalingPoint {
                    topology: (*p).to_string(),
                    gpus_per_node: topo.gpu_count(),
                    nodes: n,
                    policy: pol.clone(),
                    p50_us: metrics::percentile(&times, 0.5),
                    p99_us: metrics::percentile(&times, 0.99),
                    first_us: first,
                });
            }
        }
    }
    out
}

/// The cluster's current state as select-pipeline nodes (`used` = total − free).
fn used_nodes(cl: &SimCluster) -> Vec<crate::cluster::Node> {
    let mut nodes = cl.to_nodes();
    for (node, n) in nodes.iter_mut().zip(&cl.nodes) {
        node.set_used(Resources::with_mask(
            n.cpu_total - n.free_cpu,
            n.mem_total - n.free_mem,
            n.all_mask & !n.free_mask,
            PortSet::new(),
        ));
    }
    nodes
}

/// Options of one `gpuam sim` invocation (the CLI flags).
#[derive(Clone, Debug)]
pub struct SimOptions {
    pub workload: String,
    /// A preset, `all`, or none (trace default).
    pub topology: Option<String>,
    pub nodes: usize,
    pub jobs: usize,
    pub seeds: usize,
    pub load: f64,
    pub policies: Vec<String>,
    pub mix: String,
    pub rack_size: usize,
    pub json: bool,
    pub out: Option<PathBuf>,
    pub scaling: bool,
    pub traces: Option<PathBuf>,
    /// `name=weight,...`: simulate the RM's queues instead of comparing policies.
    pub queues: Option<String>,
    /// Notice before a preempted job stops (queue simulation).
    pub grace_sec: f64,
    /// gpuam's `select.topology_wait_sec` (from the settings: `GPUAM__SELECT__TOPOLOGY_WAIT_SEC=0
    /// gpuam sim` replays gpuam without the wait).
    pub topology_wait_sec: u64,
    /// FIFO or backfill, reservations, expected durations, the big-gang size (issue 27).
    pub queueing: Queueing,
}

impl SimOptions {
    /// The queueing discipline from the CLI flags: a reservation flag implies backfill; a
    /// reservation policy needs at least one of the two bounds.
    pub fn queueing_of(
        backfill: bool,
        reserve_wait_sec: Option<u64>,
        reserve_min_gpus: Option<u32>,
        expected_end: &str,
        big_gpus: u32,
        run_limits: &str,
    ) -> Result<Queueing, SimError> {
        let limit = reserve::Limit::parse(expected_end).map_err(SimError::Usage)?;
        let run_limits = reserve::parse_run_limits(run_limits).map_err(SimError::Usage)?;
        if big_gpus == 0 {
            return Err(SimError::Usage("--big-gpus must be at least 1".into()));
        }
        let reserve = (reserve_wait_sec.is_some() || reserve_min_gpus.is_some()).then(|| Policy {
            wait_bound_ms: reserve_wait_sec.map_or(u64::MAX, |s| s.saturating_mul(1000)),
            min_gpus: reserve_min_gpus.unwrap_or(u32::MAX),
        });
        Ok(Queueing {
            backfill: backfill || reserve.is_some(),
            reserve,
            limit,
            big_gpus,
            run_limits,
        })
    }
}

/// Results of one topology (one cluster).
#[derive(Clone, Debug, serde::Serialize)]
pub struct TopologyRun {
    pub topology: String,
    pub cluster: cluster::ClusterSummary,
    pub jobs: usize,
    pub policies: Vec<(String, PolicyResult)>,
}

/// Runs every (seed, policy) pair on one cluster and one stream family.
pub fn run_topology(
    opts: &SimOptions,
    label: &str,
    cl: &SimCluster,
    stream: &dyn Fn(usize) -> Vec<Job>,
) -> TopologyRun {
    let mut per: Vec<(String, Vec<RunStats>)> = opts.policies.iter().map(|p| (p.clone(), Vec::new())).collect();
    let mut njobs = 0;
    for s in 0..opts.seeds {
        let jobs = stream(s);
        njobs = jobs.len();
        for (p, runs) in per.iter_mut() {
            if let Some(r) = simulate_queueing(cl, &jobs, p, 1000 + s as u64, opts.topology_wait_sec, opts.queueing) {
                runs.push(r);
            }
        }
    }
    TopologyRun {
        topology: label.to_string(),
        cluster: cl.summary(),
        jobs: njobs,
        policies: per.into_iter().map(|(p, r)| (p, PolicyResult::from_runs(&r))).collect(),
    }
}

#[cfg(test)]
mod tests;

/// Presets `--topology all` runs over (8-GPU ones only for the traces, whose 8-GPU
/// machines take the preset).
fn topologies_for(opts: &SimOptions, trace: bool) -> Result<Vec<Option<Topology>>, String> {
    match opts.topology.as_deref() {
        None if trace => Ok(vec![None]),
        None => Ok(vec![Topology::preset("pcie8")]),
        Some(t) if t.eq_ignore_ascii_case("all") => Ok(Topology::preset_names()
            .iter()
            .filter_map(|n| Topology::preset(n))
            .filter(|t| !trace || t.gpu_count() == 8)
            .filter(|t| trace || t.gpu_count() <= 16)
            .map(Some)
            .collect()),
        Some(t) if !trace && cluster::MIXED.iter().any(|(m, _)| *m == t) => Ok(Vec::new()),
        Some(t) => match Topology::preset(t) {
            Some(topo) if trace && topo.gpu_count() != 8 => Err(format!(
                "--topology {t}: with a trace, the preset replaces the 8-GPU machines' topology, so it needs 8 GPUs"
            )),
            Some(topo) => Ok(vec![Some(topo)]),
            None => Err(format!(
                "--topology {t}: unknown preset (one of: all, {}, {})",
                Topology::preset_names().join(", "),
                cluster::MIXED.iter().map(|(m, _)| *m).collect::<Vec<_>>().join(", ")
            )),
        },
    }
}

/// `gpuam sim --queues`: one stream (the first seed's window) through the RM's queues on
/// the first cluster; prints the per-queue table (or JSON), writes `--out`.
fn run_queues(
    opts: &SimOptions,
    queues: &str,
    trace: Option<workload::Trace>,
    mix: workload::Mix,
    topos: &[Option<Topology>],
) -> Result<(), SimError> {
    let settings = queues::parse_queues(queues).map_err(SimError::Usage)?;
    let topo = topos.first().cloned().flatten();
    let dir = workload::traces_dir(opts.traces.as_deref());
    let (label, cl, jobs) = match trace {
        Some(t) => {
            let cl = workload::trace_cluster(&dir, t, topo.as_ref()).map_err(|e| SimError::Input(e.to_string()))?;
            let all = workload::trace_jobs(&dir, t).map_err(|e| SimError::Input(e.to_string()))?;
            let jobs = workload::trace_window(&all, opts.jobs, 0, 1, opts.load, cl.total_gpus());
            (opts.workload.clone(), cl, jobs)
        }
        None => {
            let Some(t) = topo.or_else(|| Topology::preset("pcie8")) else {
                return Err(SimError::Usage("--topology: no topology to simulate".into()));
            };
            let cl = cluster::generated(&t, opts.nodes.max(1), opts.rack_size);
            let jobs = workload::synthetic(mix, opts.jobs, opts.load, cl.total_gpus(), cl.max_node_gpus(), 1000);
            (format!("synthetic {}", t.name()), cl, jobs)
        }
    };
    let started = Instant::now();
    let run = queues::simulate(&cl, &jobs, &settings, opts.grace_sec.max(0.0));
    let title = format!(
        "{label}: {} jobs at load {}, queues {queues} — GPUs in use (solid) vs deserved (dashed)",
        jobs.len(),
        opts.load
    );
    if opts.json {
        println!("{}", serde_json::to_string(&run).unwrap_or_default());
    } else {
        print!("{}", queues::table(&run));
        println!(
            "({label}, {} jobs, load {}, jobs spread round-robin over the queues; simulated in {:.1} s)",
            jobs.len(),
            opts.load,
            started.elapsed().as_secs_f64()
        );
    }
    if let Some(out) = &opts.out {
        queues::write_out(out, &run, &title).map_err(SimError::Output)?;
    }
    Ok(())
}

/// Why `gpuam sim` failed; the CLI prints it and picks the exit code.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A bad flag (its value named, with the fix).
    #[error("{0}")]
    Usage(String),
    /// Trace files missing or malformed.
    #[error("{0}")]
    Input(String),
    /// The results could not be written (`--out`) or encoded.
    #[error("{0}")]
    Output(String),
}

/// `gpuam sim`: runs the simulation, prints the table or JSON, writes `--out`.
pub fn run(opts: &SimOptions) -> Result<(), SimError> {
    for p in &opts.policies {
        if !POLICIES.contains(&p.as_str()) {
            return Err(SimError::Usage(format!(
                "--policies: unknown policy `{p}` (known: {})",
                POLICIES.join(",")
            )));
        }
    }
    if opts.seeds == 0 || opts.jobs == 0 {
        return Err(SimError::Usage("--seeds and --jobs must be at least 1".into()));
    }
    if opts.workload == "fractional" {
        return fractional::run(opts);
    }
    let trace = match opts.workload.as_str() {
        "synthetic" => None,
        "philly" => Some(workload::Trace::Philly),
        "alibaba2023" => Some(workload::Trace::Alibaba2023),
        w => {
            return Err(SimError::Usage(format!(
                "--workload {w}: use philly, alibaba2023, synthetic or fractional"
            )))
        }
    };
    let Some(mix) = workload::mix_by_name(&opts.mix) else {
        return Err(SimError::Usage(format!("--mix {}: use A or B", opts.mix)));
    };
    let topos = topologies_for(opts, trace.is_some()).map_err(SimError::Usage)?;
    if let Some(q) = &opts.queues {
        return run_queues(opts, q, trace, mix, &topos);
    }
    let started = Instant::now();
    let mut runs = Vec::new();
    let dir = workload::traces_dir(opts.traces.as_deref());
    let all_jobs = match trace {
        Some(t) => workload::trace_jobs(&dir, t).map_err(|e| SimError::Input(e.to_string()))?,
        None => Vec::new(),
    };
    for topo in &topos {
        let (label, cl) = match (trace, topo) {
            (Some(t), _) => match workload::trace_cluster(&dir, t, topo.as_ref()) {
                Ok(cl) => (
                    format!(
                        "{}:{}",
                        opts.workload,
                        topo.as_ref().map(|t| t.name()).unwrap_or("default")
                    ),
                    cl,
                ),
                Err(e) => return Err(SimError::Input(e.to_string())),
            },
            (None, Some(t)) => (
                t.name().to_string(),
                cluster::generated(t, opts.nodes.max(1), opts.rack_size),
            ),
            (None, None) => continue,
        };
        let gpus = cl.total_gpus();
        let per_node = cl.max_node_gpus();
        let stream = |s: usize| -> Vec<Job> {
            match trace {
                Some(_) => workload::trace_window(&all_jobs, opts.jobs, s, opts.seeds, opts.load, gpus),
                None => workload::synthetic(mix, opts.jobs, opts.load, gpus, per_node, 1000 + s as u64),
            }
        };
        runs.push(run_topology(opts, &label, &cl, &stream));
    }
    // Mixed-topology clusters (synthetic streams only: a trace brings its own machines).
    if trace.is_none() {
        for (name, _) in cluster::MIXED {
            let wanted = opts
                .topology
                .as_deref()
                .is_some_and(|t| t.eq_ignore_ascii_case("all") || t == *name);
            let Some(cl) = cluster::mixed(name, opts.nodes.max(1), opts.rack_size).filter(|_| wanted) else {
                continue;
            };
            let gpus = cl.total_gpus();
            let per_node = cl.max_node_gpus();
            let stream = |s: usize| -> Vec<Job> {
                workload::synthetic(mix, opts.jobs, opts.load, gpus, per_node, 1000 + s as u64)
            };
            runs.push(run_topology(opts, name, &cl, &stream));
        }
    }
    let scaling_points = if opts.scaling {
        scaling(
            &["pcie8", "pcie16", "pcie32", "pcie64"],
            &[100, 1000, 10_000],
            &opts.policies,
            50,
            7,
        )
    } else {
        Vec::new()
    };
    let elapsed = started.elapsed().as_secs_f64();
    report::emit(opts, &runs, &scaling_points, elapsed)
}
