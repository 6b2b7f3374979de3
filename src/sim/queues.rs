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
use super::workload::Job;
use crate::config::QueueSettings;
use crate::protocol::WaitingTasks;
use crate::resources::GpuMask;
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
                    for (i, (n, m)) in placed.iter().enumerate() {
                        self.cl.free(*n, *m, &self.jobs[j].tasks[i]);
                    }
                    return None;
                }
            }
        }
        Some(placed)
    }

    /// Starts what fits, as the RM's gate lets it: the queue furthest below its deserved
    /// share first. A queue below its share takes its jobs in order (its head waits for
    /// the room being made for it, and while it does nobody else takes that room); others
    /// backfill within a bounded window.
    fn admit(&mut self, now: f64) {
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
        loop {
            let next = leaves
                .iter()
                .copied()
                .filter(|&q| !blocked[q] && !self.waiting[q].is_empty())
                .min_by(|&a, &b| {
                    let r = |q: usize| {
                        if deserved(q) <= scheduler::EPS {
                            f64::MAX
                        } else {
                            f64::from(used[q]) / deserved(q)
                        }
                    };
                    r(a).total_cmp(&r(b)).then(a.cmp(&b))
                });
            let Some(q) = next else { break };
            let starved = f64::from(used[q]) + 1.0 <= deserved(q) + scheduler::EPS;
            let window = if starved { 1 } else { BACKFILL };
            let free: u32 = self.cl.nodes.iter().map(|n| n.free_gpus()).sum();
            let mut started = None;
            for k in 0..self.waiting[q].len().min(window) {
                let (j, left) = self.waiting[q][k];
                if self.jobs[j].gpus() > free {
                    continue;
                }
                if let Some(placed) = self.place(j) {
                    started = Some((k, j, left, placed));
                    break;
                }
            }
            match started {
                Some((k, j, left, placed)) => {
                    self.waiting[q].remove(k);
                    used[q] += placed.iter().map(|(_, m)| m.count_ones()).sum::<u32>();
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
            .map(|(i, r)| (r.deadline.unwrap_or(r.since + r.left).min(r.since + r.left), i))
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
        },
        waiting: vec![VecDeque::new(); tree.len()],
        tree,
        cl: cl.clone(),
        jobs,
        queue_of,
        running: Vec::new(),
        grace,
        first_start: vec![None; jobs.len()],
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

    #[test]
    fn bad_queue_lists_are_named() {
        assert!(parse_queues("a=3").unwrap_err().contains("two or more"));
        assert!(parse_queues("a=x,b=1").unwrap_err().contains("`x`"));
        assert!(parse_queues("a=0,b=1").unwrap_err().contains("weight"));
        assert!(parse_queues("a,b").unwrap_err().contains("NAME=WEIGHT"));
    }
}
