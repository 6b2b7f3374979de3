//! `gpuam sim --queues NAME=WEIGHT,...`: the RM's queues on a job stream (issue 16). Each
//! queue's use over time is compared with its deserved share, computed and enforced by the
//! RM's own scheduler code ([`crate::rm::scheduler`]): [`Shares::compute`] for the deserved
//! shares, the same ranking for admission (the queue furthest below its share first, then
//! arrival), and [`scheduler::plan`] for preemption.
//!
//! Modelling, stated once (docs/BENCHMARKS.md repeats it):
//! - the traces carry no team, so job `i` goes to queue `i mod n` (round robin: every queue
//!   offers the same load; the weights decide the split under contention);
//! - a job is a gang (all its tasks or none), placed best fit (the node with the fewest
//!   free GPUs that fits, GPUs chosen by DESIGN §5); no priorities;
//! - a job chosen for preemption keeps running for the notice period (`grace`), then frees
//!   its GPUs and waits again with the work it had left (it checkpointed at the notice);
//! - decisions are made at every arrival, end and preemption deadline.

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;

use super::cluster::SimCluster;
use super::reserve::ms;
use super::workload::Job;
use crate::config::QueueSettings;
use crate::protocol::WaitingTasks;
use crate::resources::GpuMask;
use crate::rm::scheduler::reservation::{self, Policy, Release, Reservation, Room};
use crate::rm::scheduler::{self, queues::QueueTree, AppDemand, Held, NodeCap, Shares, Snapshot};

/// A running job.
#[derive(Clone, Debug)]
struct Running {
    job: usize,
    placed: Vec<(usize, GpuMask)>,
    /// When it (re)started and the work it had left then (seconds).
    since: f64,
    left: f64,
    /// Preempted: it frees its GPUs at this time.
    deadline: Option<f64>,
    for_queue: Option<usize>,
}

impl Running {
    /// When it frees its GPUs: its work done, or its preemption deadline if sooner.
    fn end(&self) -> f64 {
        self.deadline
            .map_or(self.since + self.left, |d| d.min(self.since + self.left))
    }
}

/// A queue's share over time.
#[derive(Clone, Debug, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QueueSeries {
    pub name: String,
    pub weight: f64,
    /// (time s, GPUs used, GPUs deserved) at each decision.
    pub points: Vec<(f64, f64, f64)>,
    pub jobs: usize,
    pub preemptions: usize,
    /// Waiting time of each job's first start (seconds).
    pub waits: Vec<f64>,
}

/// What one queue simulation measured.
#[derive(Clone, Debug, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QueueRun {
    pub cluster_gpus: u64,
    pub grace_sec: f64,
    pub queues: Vec<QueueSeries>,
    /// Seconds during which some queue held less than its deserved share.
    pub contended_sec: f64,
    /// The last arrival (s): the table's means are over `0..arrivals_end`.
    pub arrivals_end: f64,
    /// Each job's first start (s; `None`: it never started).
    #[serde(skip)]
    pub starts: Vec<Option<f64>>,
}

/// `name=weight,...` → the settings map (weights must be positive numbers).
pub fn parse_queues(text: &str) -> Result<BTreeMap<String, QueueSettings>, String> {
    let mut map = BTreeMap::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, w) = part
            .split_once('=')
            .ok_or_else(|| format!("--queues: `{part}` is not NAME=WEIGHT (e.g. research=3,prod=1)"))?;
        let weight: f64 = w
            .trim()
            .parse()
            .map_err(|_| format!("--queues: the weight of `{name}` is `{w}`, not a number"))?;
        map.insert(
            name.trim().to_string(),
            QueueSettings {
                weight,
                ..Default::default()
            },
        );
    }
    if map.len() < 2 {
        return Err("--queues: name two or more queues, e.g. research=3,prod=1".into());
    }
    QueueTree::from_settings(&map).map_err(|e| format!("--queues: {e}"))?;
    Ok(map)
}

struct Engine<'a> {
    tree: QueueTree,
    cl: SimCluster,
    jobs: &'a [Job],
    queue_of: Vec<usize>,
    waiting: Vec<VecDeque<(usize, f64)>>,
    running: Vec<Running>,
    grace: f64,
    first_start: Vec<Option<f64>>,
    out: QueueRun,
    /// Reservations for long-waiting or large gangs (None: none, the default).
    reserve: Option<Policy>,
}

/// How far into each queue's FIFO admission looks for a job that fits (backfill).
const BACKFILL: usize = 64;

impl Engine<'_> {
    fn leaf_index(&self) -> Vec<usize> {
        self.tree.leaves().collect()
    }

    fn used(&self) -> Vec<u32> {
        let mut u = vec![0; self.tree.len()];
        for r in &self.running {
            for (_, m) in &r.placed {
                u[self.queue_of[r.job]] += m.count_ones();
            }
        }
        u
    }

    fn snapshot(&self, now: f64) -> Snapshot {
        let mut s = Snapshot::default();
        for n in &self.cl.nodes {
            s.nodes.push(NodeCap {
                host: n.host.clone(),
                pool: String::new(),
                partition: String::new(),
                usable: true,
                total: crate::resources::Resources::with_mask(
                    n.cpu_total,
                    n.mem_total,
                    n.all_mask,
                    crate::resources::PortSet::new(),
                ),
                free_gpus: n.free_mask,
                free_cpu: n.free_cpu,
                free_memory_mb: n.free_mem,
                free_ports: Default::default(),
                free_custom: Default::default(),
                topology: Some(self.cl.topos[n.topo].clone()),
            });
        }
        for r in &self.running {
            let a = s.apps.len();
            s.apps.push(AppDemand {
                id: format!("job{}", r.job),
                queue: self.queue_of[r.job],
                submitted_ms: (self.jobs[r.job].arrival * 1000.0) as u64,
                gang: true,
                ..Default::default()
            });
            for (i, &(node, mask)) in r.placed.iter().enumerate() {
                let t = &self.jobs[r.job].tasks[i];
                s.held.push(Held {
                    container_id: format!("job{}-{i}", r.job),
                    app: a,
                    node,
                    gpus: mask,
                    gpu_shares: Default::default(),
                    cpu: t.cpu,
                    memory_mb: t.mem_mb,
                    ports: Default::default(),
                    custom: Default::default(),
                    run_ms: ((now - r.since) * 1000.0) as u64,
                    leaving: r.deadline.is_some(),
                    for_queue: r.for_queue,
                });
            }
        }
        for q in &self.waiting {
            for &(j, _) in q.iter() {
                let mut by_shape: BTreeMap<(u32, u32, u64), u32> = BTreeMap::new();
                for t in &self.jobs[j].tasks {
                    *by_shape.entry((t.gpus, t.cpu, t.mem_mb)).or_default() += 1;
                }
                s.apps.push(AppDemand {
                    id: format!("job{j}"),
                    queue: self.queue_of[j],
                    submitted_ms: (self.jobs[j].arrival * 1000.0) as u64,
                    gang: self.jobs[j].tasks.len() > 1,
                    waiting: by_shape
                        .into_iter()
                        .map(|((gpus, cpu, memory_mb), count)| WaitingTasks {
                            count,
                            gpus,
                            cpu,
                            memory_mb,
                            ..Default::default()
                        })
                        .collect(),
                    ..Default::default()
                });
            }
        }
        s
    }

    /// Books every task of job `j` (best fit, GPUs by DESIGN §5) or none.
    fn place(&mut self, j: usize) -> Option<Vec<(usize, GpuMask)>> {
        let mut placed = Vec::new();
        for t in &self.jobs[j].tasks {
            let best = (0..self.cl.nodes.len())
                .filter(|&n| self.cl.nodes[n].fits(t))
                .min_by_key(|&n| (self.cl.nodes[n].free_gpus(), n));
            let pick = best.and_then(|n| {
                crate::topology::choose(Some(self.cl.topo_of(n)), self.cl.nodes[n].free_mask, t.gpus)
                    .map(|c| (n, c.mask))
            });
            match pick {
                Some((n, mask)) if self.cl.book(n, mask, t) => placed.push((n, mask)),
                _ => {
                    self.unplace(j, &placed);
                    return None;
                }
            }
        }
        Some(placed)
    }

    /// Frees what [`Self::place`] booked for job `j` (its first `placed.len()` tasks).
    fn unplace(&mut self, j: usize, placed: &[(usize, GpuMask)]) {
        for (i, (n, m)) in placed.iter().enumerate() {
            self.cl.free(*n, *m, &self.jobs[j].tasks[i]);
        }
    }

    /// Whether job `j` could be placed now (nothing is booked).
    fn fits_now(&mut self, j: usize) -> bool {
        let Some(placed) = self.place(j) else { return false };
        self.unplace(j, &placed);
        true
    }

    /// The one reservation (issue 27, item 3): the earliest-arrived waiting gang the policy
    /// picks that will ever fit, with where and when it fits as the running jobs end
    /// (their ends are known: each job's remaining work, or its preemption deadline).
    fn reservation(&self, now: f64, policy: Policy, shares: &Shares) -> Option<(usize, Reservation)> {
        // Only within its queue's share: with what the queue still runs at the start, the
        // gang must not take it over its deserved share (it would be taken back at once).
        let within_share = |j: usize, r: &Reservation| {
            let q = self.queue_of[j];
            let d = shares.deserved.first().map_or(0.0, |v| v[q]);
            let still: u32 = self
                .running
                .iter()
                .filter(|x| self.queue_of[x.job] == q && ms(x.end()) > r.start_ms)
                .flat_map(|x| x.placed.iter().map(|(_, m)| m.count_ones()))
                .sum();
            f64::from(still + self.jobs[j].gpus()) <= d + scheduler::EPS
        };
        let free = super::reserve::free_rooms(&self.cl);
        let mut releases = Vec::new();
        for r in &self.running {
            let end = r.end();
            for (node, room) in super::reserve::takes(&r.placed, &self.jobs[r.job].tasks) {
                releases.push(Release {
                    node,
                    room,
                    end_ms: Some(ms(end)),
                });
            }
        }
        let mut waiting: Vec<usize> = self.waiting.iter().flat_map(|q| q.iter().map(|&(j, _)| j)).collect();
        waiting.sort_by(|&a, &b| self.jobs[a].arrival.total_cmp(&self.jobs[b].arrival).then(a.cmp(&b)));
        waiting
            .into_iter()
            .filter(|&j| policy.applies(ms(now).saturating_sub(ms(self.jobs[j].arrival)), self.jobs[j].gpus()))
            .find_map(|j| {
                let tasks: Vec<Room> = self.jobs[j].tasks.iter().map(super::reserve::room_of).collect();
                reservation::reserve(&free, &releases, &tasks, ms(now))
                    .filter(|r| within_share(j, r))
                    .map(|r| (j, r))
            })
    }

    /// Starts waiting job `j` now if it fits (it leaves its queue); false when it does not.
    fn start_now(&mut self, j: usize, now: f64) -> bool {
        let q = self.queue_of[j];
        let Some(k) = self.waiting[q].iter().position(|&(x, _)| x == j) else {
            return false;
        };
        let Some(placed) = self.place(j) else { return false };
        let (_, left) = self.waiting[q].remove(k).unwrap_or((j, 0.0));
        self.begin(j, left, placed, now);
        true
    }

    fn begin(&mut self, j: usize, left: f64, placed: Vec<(usize, GpuMask)>, now: f64) {
        if self.first_start[j].is_none() {
            self.first_start[j] = Some(now);
        }
        self.running.push(Running {
            job: j,
            placed,
            since: now,
            left,
            deadline: None,
            for_queue: None,
        });
    }

    /// Starts what fits, as the RM's gate lets it: the queue furthest below its deserved
    /// share first. A queue below its share takes its jobs in order (its head waits for
    /// the room being made for it, and while it does nobody else takes that room); others
    /// backfill within a bounded window.
    fn admit(&mut self, now: f64) {
        // The reservation's gang starts first when it fits; otherwise others backfill.
        let mut held: Option<(usize, Reservation)> = None;
        if let Some(policy) = self.reserve {
            let shares = Shares::compute(&self.tree, &self.snapshot(now));
            while let Some((j, r)) = self.reservation(now, policy, &shares) {
                if r.start_ms <= ms(now) && self.start_now(j, now) {
                    continue;
                }
                held = Some((j, r));
                break;
            }
        }
        let snap = self.snapshot(now);
        let shares = Shares::compute(&self.tree, &snap);
        let leaves = self.leaf_index();
        let mut used = self.used();
        let mut blocked = vec![false; self.tree.len()];
        let mut incoming = vec![0u32; self.tree.len()];
        for r in self.running.iter().filter(|r| r.deadline.is_some()) {
            if let Some(q) = r.for_queue {
                incoming[q] += r.placed.iter().map(|(_, m)| m.count_ones()).sum::<u32>();
            }
        }
        let deserved = |q: usize| shares.deserved.first().map_or(0.0, |v| v[q]);
        let ratio = |q: usize, used: &[u32]| {
            if deserved(q) <= scheduler::EPS {
                f64::MAX
            } else {
                f64::from(used[q]) / deserved(q)
            }
        };
        loop {
            let next = leaves
                .iter()
                .copied()
                .filter(|&q| !blocked[q] && !self.waiting[q].is_empty())
                .min_by(|&a, &b| ratio(a, &used).total_cmp(&ratio(b, &used)).then(a.cmp(&b)));
            let Some(q) = next else { break };
            // A queue that ranks ahead of the reservation's (further below its share) is
            // not held back by it: the shares decide first.
            let held_back = held
                .as_ref()
                .is_some_and(|(h, _)| ratio(q, &used) >= ratio(self.queue_of[*h], &used));
            let starved = f64::from(used[q]) + 1.0 <= deserved(q) + scheduler::EPS;
            let window = if starved { 1 } else { BACKFILL };
            let free: u32 = self.cl.nodes.iter().map(|n| n.free_gpus()).sum();
            let mut started = None;
            // Other queues' heads owed GPUs that fit now: the same for every candidate
            // (a candidate that does not start is unbooked), so found once, when needed.
            let mut owed_heads: Option<Vec<usize>> = None;
            for k in 0..self.waiting[q].len().min(window) {
                let (j, left) = self.waiting[q][k];
                if self.jobs[j].gpus() > free {
                    continue;
                }
                // As the gate: a start that takes the queue past its share keeps the room
                // of another queue's head that is owed GPUs and fits now.
                let past_share = f64::from(used[q] + self.jobs[j].gpus()) > deserved(q) + scheduler::EPS;
                if past_share && owed_heads.is_none() {
                    let heads = leaves
                        .iter()
                        .copied()
                        .filter(|&o| o != q)
                        .filter_map(|o| {
                            let owed = deserved(o) - f64::from(used[o] + incoming[o]);
                            let &(h, _) = self.waiting[o].front()?;
                            (f64::from(self.jobs[h].gpus()) <= owed + scheduler::EPS && self.fits_now(h)).then_some(h)
                        })
                        .collect();
                    owed_heads = Some(heads);
                }
                let Some(placed) = self.place(j) else { continue };
                if past_share && owed_heads.iter().flatten().any(|&h| !self.fits_now(h)) {
                    self.unplace(j, &placed);
                    continue;
                }
                if let Some((_, r)) = held.as_mut().filter(|(h, _)| held_back && *h != j) {
                    let takes = super::reserve::takes(&placed, &self.jobs[j].tasks);
                    if !r.backfill(&takes, Some(ms(now + left))) {
                        self.unplace(j, &placed);
                        continue;
                    }
                }
                started = Some((k, j, left, placed));
                break;
            }
            match started {
                Some((k, j, left, placed)) => {
                    self.waiting[q].remove(k);
                    used[q] += placed.iter().map(|(_, m)| m.count_ones()).sum::<u32>();
                    self.begin(j, left, placed, now);
                }
                None if starved && incoming[q] > 0 => break,
                None => blocked[q] = true,
            }
        }
    }

    /// Chooses victims with the RM's own planner and gives them their notice. (The
    /// snapshot lists the running jobs first, in order: a victim's application index is
    /// its index in `running`.)
    fn preempt(&mut self, now: f64) {
        let snap = self.snapshot(now);
        let shares = Shares::compute(&self.tree, &snap);
        self.record(now, &shares);
        // Only a queue below its share with waiting work makes anything to take back.
        let starved = (0..shares.pools.len()).any(|p| {
            self.tree
                .leaves()
                .any(|q| shares.waiting[p][q] > 0 && shares.owed(p, q) > 0)
        });
        if !starved {
            return;
        }
        let plan = scheduler::plan(&self.tree, &snap, &shares);
        for v in plan.victims {
            let Some(r) = self.running.get_mut(v.app) else { continue };
            if r.deadline.is_none() {
                r.deadline = Some(now + self.grace);
                r.for_queue = Some(v.for_queue);
                let q = self.queue_of[r.job];
                if let Some(s) = self.out.queues.iter_mut().find(|s| s.name == self.tree.get(q).path) {
                    s.preemptions += 1;
                }
            }
        }
    }

    fn record(&mut self, now: f64, shares: &Shares) {
        let used = self.used();
        for q in self.tree.leaves() {
            let d = shares.deserved.first().map_or(0.0, |v| v[q]);
            let name = self.tree.get(q).path.clone();
            if let Some(s) = self.out.queues.iter_mut().find(|s| s.name == name) {
                s.points.push((now, f64::from(used[q]), d));
            }
        }
    }

    /// The next event: an end or a preemption deadline of a running job.
    fn next_event(&self) -> Option<(f64, usize)> {
        self.running
            .iter()
            .enumerate()
            .map(|(i, r)| (r.end(), i))
            .min_by(|a, b| a.0.total_cmp(&b.0))
    }

    /// Ends running job `i` at `now`: done, or preempted (waits again with what it had left).
    fn stop(&mut self, i: usize, now: f64) {
        let r = self.running.swap_remove(i);
        for (k, (n, m)) in r.placed.iter().enumerate() {
            self.cl.free(*n, *m, &self.jobs[r.job].tasks[k]);
        }
        let left = r.left - (now - r.since);
        if left > 1e-6 {
            let q = self.queue_of[r.job];
            self.waiting[q].push_front((r.job, left));
        }
    }
}

/// Replays `jobs` through the queues `settings` on `cl`.
pub fn simulate(cl: &SimCluster, jobs: &[Job], settings: &BTreeMap<String, QueueSettings>, grace: f64) -> QueueRun {
    simulate_with(cl, jobs, settings, grace, None)
}

/// [`simulate`], with reservations and backfill for the gangs `reserve` picks.
pub fn simulate_with(
    cl: &SimCluster,
    jobs: &[Job],
    settings: &BTreeMap<String, QueueSettings>,
    grace: f64,
    reserve: Option<Policy>,
) -> QueueRun {
    let tree = QueueTree::from_settings(settings).unwrap_or_default();
    let leaves: Vec<usize> = tree.leaves().collect();
    let queue_of: Vec<usize> = (0..jobs.len()).map(|i| leaves[i % leaves.len()]).collect();
    let mut e = Engine {
        out: QueueRun {
            cluster_gpus: cl.total_gpus(),
            grace_sec: grace,
            queues: leaves
                .iter()
                .map(|&q| QueueSeries {
                    name: tree.get(q).path.clone(),
                    weight: tree.get(q).weight,
                    jobs: queue_of.iter().filter(|&&x| x == q).count(),
                    ..Default::default()
                })
                .collect(),
            contended_sec: 0.0,
            arrivals_end: jobs.last().map_or(0.0, |j| j.arrival),
            starts: Vec::new(),
        },
        waiting: vec![VecDeque::new(); tree.len()],
        tree,
        cl: cl.clone(),
        jobs,
        queue_of,
        running: Vec::new(),
        grace,
        first_start: vec![None; jobs.len()],
        reserve,
    };
    let mut next_arrival = 0usize;
    let mut last = 0.0;
    loop {
        let arrival = jobs.get(next_arrival).map(|j| j.arrival);
        let event = e.next_event();
        let now = match (arrival, event) {
            (None, None) => break,
            (Some(a), Some((t, _))) if a < t => a,
            (Some(a), None) => a,
            (_, Some((t, _))) => t,
        };
        if arrival == Some(now) {
            let j = next_arrival;
            e.waiting[e.queue_of[j]].push_back((j, jobs[j].duration));
            next_arrival += 1;
        } else if let Some((_, i)) = event {
            e.stop(i, now);
        }
        // Contended time: some queue waits below its share.
        if e.out
            .queues
            .iter()
            .any(|s| s.points.last().is_some_and(|p| p.1 + 0.5 < p.2))
        {
            e.out.contended_sec += now - last;
        }
        last = now;
        e.admit(now);
        e.preempt(now);
    }
    for (j, s) in e.first_start.iter().enumerate() {
        if let Some(t) = s {
            let q = e.tree.get(e.queue_of[j]).path.clone();
            if let Some(series) = e.out.queues.iter_mut().find(|x| x.name == q) {
                series.waits.push(t - jobs[j].arrival);
            }
        }
    }
    e.out.starts = e.first_start.clone();
    e.out
}

/// Time-weighted means while jobs arrive (`0..until`; the tail after the last arrival,
/// where one queue drains alone, is left out): (used, deserved, |used − deserved|), GPUs.
pub fn summary(s: &QueueSeries, until: f64) -> (f64, f64, f64) {
    let (mut used, mut deserved, mut gap, mut total) = (0.0, 0.0, 0.0, 0.0);
    for w in s.points.windows(2) {
        if w[0].0 >= until {
            break;
        }
        let dt = w[1].0.min(until) - w[0].0;
        used += w[0].1 * dt;
        deserved += w[0].2 * dt;
        gap += (w[0].1 - w[0].2).abs() * dt;
        total += dt;
    }
    if total <= 0.0 {
        return (0.0, 0.0, 0.0);
    }
    (used / total, deserved / total, gap / total)
}

/// The table of `gpuam sim --queues`.
pub fn table(run: &QueueRun) -> String {
    let mut out = format!(
        "queues on {} GPUs, notice {:.0} s; shares are time-weighted means while jobs arrive ({:.1} h)\n\
         {:<12} {:>6} {:>6} {:>10} {:>10} {:>10} {:>8} {:>10} {:>10}\n",
        run.cluster_gpus,
        run.grace_sec,
        run.arrivals_end / 3600.0,
        "queue",
        "weight",
        "jobs",
        "deserved",
        "used",
        "|gap|",
        "preempt",
        "wait p50",
        "wait p90"
    );
    let g = run.cluster_gpus.max(1) as f64;
    for s in &run.queues {
        let (u, d, gap) = summary(s, run.arrivals_end);
        let mut w = s.waits.clone();
        w.sort_by(f64::total_cmp);
        let pct = |p: f64| super::metrics::percentile(&w, p);
        out.push_str(&format!(
            "{:<12} {:>6} {:>6} {:>9.1}% {:>9.1}% {:>9.1}% {:>8} {:>9.0}s {:>9.0}s\n",
            s.name,
            s.weight,
            s.jobs,
            100.0 * d / g,
            100.0 * u / g,
            100.0 * gap / g,
            s.preemptions,
            pct(0.5),
            pct(0.9)
        ));
    }
    out
}

/// Writes `queues.json` and `queues_share.svg` under `dir`.
pub fn write_out(dir: &Path, run: &QueueRun, title: &str) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create --out {}: {e}", dir.display()))?;
    let json = serde_json::to_string_pretty(run).map_err(|e| e.to_string())?;
    for (name, text) in [
        ("queues.json", json),
        ("queues_share.svg", super::charts::queue_shares(run, title)),
    ] {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|e| format!("cannot write {}: {e}", p.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::cluster::{generated, Task};
    use crate::topology::Topology;

    fn job(id: usize, arrival: f64, duration: f64, gpus: u32) -> Job {
        Job {
            id,
            arrival,
            duration,
            tasks: vec![Task {
                gpus,
                cpu: gpus,
                mem_mb: 1024,
            }],
        }
    }

    #[test]
    fn contended_queues_converge_to_their_weighted_shares() {
        // 4 nodes × 8 = 32 GPUs; both queues keep far more work waiting than fits.
        let cl = generated(&Topology::preset("pcie8").unwrap(), 4, 4);
        let jobs: Vec<Job> = (0..400).map(|i| job(i, i as f64, 3600.0, 1)).collect();
        let settings = parse_queues("a=3,b=1").unwrap();
        let run = simulate(&cl, &jobs, &settings, 30.0);
        // Jobs alternate: B's fill the cluster first (it is empty), then A reclaims.
        let at = |q: &QueueSeries, t: f64| q.points.iter().rev().find(|p| p.0 <= t).map(|p| (p.1, p.2)).unwrap();
        let (a, b) = (&run.queues[0], &run.queues[1]);
        let (ua, da) = at(a, 3000.0);
        let (ub, db) = at(b, 3000.0);
        assert!((da - 24.0).abs() < 1e-6 && (db - 8.0).abs() < 1e-6, "{da} {db}");
        assert!((ua - 24.0).abs() <= 1.0 && (ub - 8.0).abs() <= 1.0, "A {ua} B {ub}");
        assert!(
            run.queues.iter().map(|q| q.waits.len()).sum::<usize>() == 400,
            "every job ran"
        );
        assert!(table(&run).contains("a "));
        let svg = crate::sim::charts::queue_shares(&run, "t");
        assert!(svg.starts_with("<svg") && svg.matches("<polyline").count() == 4);
    }

    /// 8 nodes × 8 GPUs, queues a and b of equal weight (each deserves 32). Jobs 0..7 are
    /// whole-node jobs: a's (even) end at 1070, 1152, 1234, 1316, b's (odd) run 10,000 s.
    /// A's 32-GPU gang (job 8, four 8-GPU tasks) arrives at 100; then 1-GPU jobs of 2000 s
    /// arrive every 10 s until 6000, of which job 9 (queue b) is short (`short` s).
    fn drain_scenario(short: f64) -> Vec<Job> {
        let mut jobs: Vec<Job> = (0..8)
            .map(|i| {
                let d = if i % 2 == 0 { 1070.0 + 40.0 * i as f64 } else { 10_000.0 };
                job(i, i as f64, d, 8)
            })
            .collect();
        let mut gang = job(8, 100.0, 500.0, 8);
        gang.tasks = vec![gang.tasks[0]; 4];
        jobs.push(gang);
        for i in 9..600 {
            let duration = if i == 9 { short } else { 2000.0 };
            jobs.push(job(i, 100.0 + (i - 8) as f64 * 10.0, duration, 1));
        }
        jobs
    }

    #[test]
    fn a_reserved_gang_starts_as_its_nodes_drain_and_a_short_job_backfills() {
        let cl = generated(&Topology::preset("pcie8").unwrap(), 8, 8);
        let settings = parse_queues("a=1,b=1").unwrap();
        let policy = Policy {
            wait_bound_ms: 3_600_000,
            min_gpus: 32,
        };
        let jobs = drain_scenario(150.0);
        // Without a reservation, b's 1-GPU jobs take every GPU a's nodes free; the gang
        // starts only once the RM's planner has taken them back (preemption, lost work).
        let plain = simulate(&cl, &jobs, &settings, 30.0);
        let preempted: usize = plain.queues.iter().map(|q| q.preemptions).sum();
        assert!(preempted > 0, "the gang needed preemptions");
        assert!(plain.starts[8].unwrap() > 1316.0, "{:?}", plain.starts[8]);
        // With one: the gang starts as the last of a's nodes drains, with no preemption;
        // b's long jobs do not take those nodes meanwhile.
        let run = simulate_with(&cl, &jobs, &settings, 30.0, Some(policy));
        let started = run.starts[8].unwrap();
        assert!((started - 1316.0).abs() < 1e-6, "the gang starts at 1316: {started}");
        assert_eq!(run.queues.iter().map(|q| q.preemptions).sum::<usize>(), 0);
        assert!(run.starts.iter().all(Option::is_some), "every job ran");
        assert!((10..jobs.len()).all(|i| run.starts[i].is_some_and(|s| s >= started)));
        // The short job (ends at 1220, before 1316) is backfilled on the first node that
        // drains, and the gang starts exactly when it would without it.
        let short = run.starts[9].unwrap();
        assert!(
            (short - 1070.0).abs() < 1e-6,
            "the short job is backfilled at 1070: {short}"
        );
        let long = simulate_with(&cl, &drain_scenario(2000.0), &settings, 30.0, Some(policy));
        assert_eq!(long.starts[8], Some(started), "backfilling did not delay the gang");
        assert!(
            long.starts[9].is_some_and(|s| s >= started),
            "a long job is not backfilled"
        );
    }

    #[test]
    fn bad_queue_lists_are_named() {
        assert!(parse_queues("a=3").unwrap_err().contains("two or more"));
        assert!(parse_queues("a=x,b=1").unwrap_err().contains("`x`"));
        assert!(parse_queues("a=0,b=1").unwrap_err().contains("weight"));
        assert!(parse_queues("a,b").unwrap_err().contains("NAME=WEIGHT"));
    }
}
