//! `gpuam sim --workload fractional` (issue 15): what GPU shares buy.
//!
//! One seeded stream of jobs — [`SMALL_JOBS`] of them small single-task jobs asking 0.25
//! or 0.5 of a GPU, the rest whole-GPU jobs of size mix A (split into tasks of at most a
//! node, placed as a gang) — is placed twice on the same generated cluster by the real
//! select pipeline ([`Selector::select_and_reserve`], bookings undone with
//! [`Selector::remove_requested`]): once with the shares as asked ("shares"), once with
//! every share rounded up to a whole GPU ("whole"), which is what a scheduler without
//! shares must do. The queue is FIFO with head-of-line blocking, as in the other
//! workloads. Reported per mode and as the difference: GPU-hours held (a share holds its
//! fraction of a GPU for the job's duration), GPU-hours saved by sharing, queueing delay
//! (mean and 95th percentile, all jobs, small jobs and whole-GPU jobs) and the makespan.
//!
//! Assumptions (stated again in docs/BENCHMARKS.md): durations are exponential with the
//! same mean (1 h) for small and whole jobs; small tasks ask 1 CPU and 4 GB; the offered
//! load counts GPU-time as asked (shares as fractions), so rounding raises the load that
//! the "whole" run really carries.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::cluster::{generated, SimCluster};
use super::metrics::{mean_ci, percentile};
use super::workload::{split_tasks, MIX_A, SYNTH_MEAN_DURATION, TASK_CPU_PER_GPU, TASK_MEM_MB_PER_GPU};
use super::SimOptions;
use crate::cluster::ClusterView;
use crate::config::SelectSettings;
use crate::resources::{format_hundredths, Resources};
use crate::select::{JobDemand, Outcome, Selector, TaskAsk, TaskShape};
use crate::spec::TaskResources;
use crate::topology::Topology;

/// Share of the jobs that are small fractional jobs.
pub const SMALL_JOBS: f64 = 0.30;
/// The shares small jobs ask for (hundredths), equally likely.
pub const SMALL_SHARES: [u32; 2] = [25, 50];

/// One job of the stream.
#[derive(Clone, Debug, PartialEq)]
pub struct FracJob {
    /// Seconds.
    pub arrival: f64,
    pub duration: f64,
    /// Per task: GPUs in hundredths (100 = one whole GPU; a small job's one task < 100).
    pub tasks: Vec<u32>,
}

impl FracJob {
    pub fn is_small(&self) -> bool {
        self.tasks.iter().all(|h| *h < 100)
    }
}

fn exp_sample(rng: &mut StdRng, mean: f64) -> f64 {
    let u: f64 = 1.0 - rng.gen::<f64>();
    -u.ln() * mean
}

/// The seeded stream: Poisson arrivals at `load` (GPU-time asked / available).
pub fn stream(jobs: usize, load: f64, cluster_gpus: u64, per_node: u32, seed: u64) -> Vec<FracJob> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x0f4a_c710_5a11);
    let mean_whole: f64 = MIX_A.iter().map(|(s, p)| f64::from(*s) * p).sum();
    let mean_small = SMALL_SHARES.iter().map(|h| f64::from(*h) / 100.0).sum::<f64>() / SMALL_SHARES.len() as f64;
    let mean_gpus = SMALL_JOBS * mean_small + (1.0 - SMALL_JOBS) * mean_whole;
    let rate = load.max(1e-6) * cluster_gpus as f64 / (mean_gpus * SYNTH_MEAN_DURATION);
    let mut t = 0.0;
    (0..jobs)
        .map(|_| {
            t += exp_sample(&mut rng, 1.0 / rate);
            let tasks = if rng.gen::<f64>() < SMALL_JOBS {
                vec![SMALL_SHARES[rng.gen_range(0..SMALL_SHARES.len())]]
            } else {
                let u: f64 = rng.gen();
                let mut acc = 0.0;
                let mut size = MIX_A[MIX_A.len() - 1].0;
                for (s, p) in MIX_A {
                    acc += p;
                    if u < acc {
                        size = *s;
                        break;
                    }
                }
                split_tasks(size, per_node).into_iter().map(|g| g * 100).collect()
            };
            FracJob {
                arrival: t,
                duration: exp_sample(&mut rng, SYNTH_MEAN_DURATION).max(1.0),
                tasks,
            }
        })
        .collect()
}

/// How shares are placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Mode {
    /// As asked.
    Shares,
    /// Every share rounded up to one whole GPU.
    Whole,
}

/// What one run measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FracStats {
    /// GPU-hours held by jobs (a share counts its fraction).
    pub gpu_hours: f64,
    pub wait_mean_s: f64,
    pub wait_p95_s: f64,
    pub small_wait_mean_s: f64,
    pub small_wait_p95_s: f64,
    pub whole_wait_mean_s: f64,
    pub whole_wait_p95_s: f64,
    /// First arrival to last completion, hours.
    pub makespan_h: f64,
    /// Jobs that could never be placed (none on a sane cluster).
    pub never_placed: usize,
}

fn task_resources(hundredths: u32, mode: Mode) -> TaskResources {
    let share = hundredths < 100 && mode == Mode::Shares;
    let gpus = hundredths.div_ceil(100).max(1);
    TaskResources {
        cpu: if hundredths < 100 { 1 } else { TASK_CPU_PER_GPU * gpus },
        memory_mb: if hundredths < 100 {
            4096
        } else {
            TASK_MEM_MB_PER_GPU * u64::from(gpus)
        },
        gpus,
        gpu_share: share.then_some(hundredths),
        ..Default::default()
    }
}

/// Places every task of `job` or none (gang); the bookings made, or `None`.
fn place(selector: &Selector, job: &FracJob, mode: Mode) -> Option<Vec<(String, Resources)>> {
    let roles: Vec<TaskResources> = job.tasks.iter().map(|h| task_resources(*h, mode)).collect();
    let mut demand = JobDemand::new(true);
    for r in &roles {
        demand.add_waiting(TaskShape::of(r), 1);
    }
    let mut booked: Vec<(String, Resources)> = Vec::with_capacity(roles.len());
    for (i, r) in roles.iter().enumerate() {
        let ask = TaskAsk::plain("task", r, (roles.len() - i) as u32);
        match selector.select_and_reserve(&ask, &demand).outcome {
            Outcome::Placed(p) => {
                demand.placed_with_gpus(&TaskShape::of(r), &p.host, p.resources.whole_gpu_mask());
                booked.push((p.host, p.resources));
            }
            Outcome::NotNow { .. } | Outcome::Impossible { .. } => {
                for (h, res) in &booked {
                    selector.remove_requested(h, res, false);
                }
                return None;
            }
        }
    }
    Some(booked)
}

/// Replays `jobs` on a fresh copy of `cl` in one mode.
pub fn simulate(cl: &SimCluster, jobs: &[FracJob], mode: Mode, seed: u64) -> FracStats {
    let settings = SelectSettings {
        seed: Some(seed),
        skip_local_tried_resource: false,
        ..SelectSettings::default()
    };
    let selector = Selector::new(ClusterView::new(cl.to_nodes()), settings);
    let mut done: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let mut held: Vec<Option<Vec<(String, Resources)>>> = vec![None; jobs.len()];
    let mut queue: VecDeque<usize> = VecDeque::new();
    let mut waits: Vec<(bool, f64)> = Vec::with_capacity(jobs.len());
    let mut gpu_hours = 0.0;
    let mut last_end: f64 = 0.0;
    let mut next = 0;
    loop {
        let arr = jobs.get(next).map_or(f64::INFINITY, |j| j.arrival);
        let end = done.peek().map_or(f64::INFINITY, |Reverse((t, _))| f64::from_bits(*t));
        if arr.is_infinite() && end.is_infinite() {
            break;
        }
        // Completions first at equal times: what they free is there for the arrival.
        let now = if end <= arr {
            if let Some(Reverse((_, j))) = done.pop() {
                for (h, r) in held[j].take().unwrap_or_default() {
                    selector.remove_requested(&h, &r, false);
                }
            }
            end
        } else {
            queue.push_back(next);
            next += 1;
            arr
        };
        while let Some(&j) = queue.front() {
            let Some(b) = place(&selector, &jobs[j], mode) else {
                break;
            };
            queue.pop_front();
            let job = &jobs[j];
            let gpus: f64 = b
                .iter()
                .map(|(_, r)| match r.gpu_share() {
                    Some(h) => f64::from(h) / 100.0,
                    None => f64::from(r.gpu_count()),
                })
                .sum();
            gpu_hours += gpus * job.duration / 3600.0;
            waits.push((job.is_small(), now - job.arrival));
            let t_end = now + job.duration;
            last_end = last_end.max(t_end);
            done.push(Reverse((t_end.to_bits(), j)));
            held[j] = Some(b);
        }
    }
    let stat = |small: Option<bool>| {
        let mut v: Vec<f64> = waits
            .iter()
            .filter(|(s, _)| small.is_none_or(|want| *s == want))
            .map(|(_, w)| *w)
            .collect();
        v.sort_by(f64::total_cmp);
        let mean = if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        };
        (mean, percentile(&v, 0.95))
    };
    let (wait_mean_s, wait_p95_s) = stat(None);
    let (small_wait_mean_s, small_wait_p95_s) = stat(Some(true));
    let (whole_wait_mean_s, whole_wait_p95_s) = stat(Some(false));
    FracStats {
        gpu_hours,
        wait_mean_s,
        wait_p95_s,
        small_wait_mean_s,
        small_wait_p95_s,
        whole_wait_mean_s,
        whole_wait_p95_s,
        makespan_h: (last_end - jobs.first().map_or(0.0, |j| j.arrival)).max(0.0) / 3600.0,
        never_placed: jobs.len() - waits.len(),
    }
}

/// Both modes over every seed.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FracReport {
    pub topology: String,
    pub nodes: usize,
    pub gpus: u64,
    pub jobs: usize,
    pub seeds: usize,
    pub load: f64,
    pub small_jobs: f64,
    pub small_shares: Vec<String>,
    pub shares: Vec<FracStats>,
    pub whole: Vec<FracStats>,
}

impl FracReport {
    /// (mean, 95 % half-width) of `f` over seeds in one mode.
    fn of(runs: &[FracStats], f: impl Fn(&FracStats) -> f64) -> (f64, f64) {
        mean_ci(&runs.iter().map(f).collect::<Vec<_>>())
    }

    /// GPU-hours saved by shares, per seed (paired).
    pub fn saved(&self) -> Vec<f64> {
        self.whole
            .iter()
            .zip(&self.shares)
            .map(|(w, s)| w.gpu_hours - s.gpu_hours)
            .collect()
    }

    pub fn table(&self) -> String {
        let mut out = format!(
            "fractional workload: {} jobs × {} seeds on {} × {} ({} GPUs), load {:.2}, {:.0} % small jobs asking {} GPU\n\n",
            self.jobs,
            self.seeds,
            self.nodes,
            self.topology,
            self.gpus,
            self.load,
            self.small_jobs * 100.0,
            self.small_shares.join(" or ")
        );
        out.push_str(&format!(
            "{:<34} {:>18} {:>18} {:>18}\n",
            "metric (mean ± 95 % CI)", "shares", "whole (rounded)", "whole − shares"
        ));
        type Metric = (&'static str, fn(&FracStats) -> f64);
        let rows: [Metric; 8] = [
            ("GPU-hours held", |s| s.gpu_hours),
            ("queueing delay, all, mean (s)", |s| s.wait_mean_s),
            ("queueing delay, all, p95 (s)", |s| s.wait_p95_s),
            ("queueing delay, small, mean (s)", |s| s.small_wait_mean_s),
            ("queueing delay, small, p95 (s)", |s| s.small_wait_p95_s),
            ("queueing delay, whole, mean (s)", |s| s.whole_wait_mean_s),
            ("queueing delay, whole, p95 (s)", |s| s.whole_wait_p95_s),
            ("makespan (h)", |s| s.makespan_h),
        ];
        let fmt = |(m, ci): (f64, f64)| format!("{m:.1} ± {ci:.1}");
        for (name, f) in rows {
            let diff: Vec<f64> = self.whole.iter().zip(&self.shares).map(|(w, s)| f(w) - f(s)).collect();
            out.push_str(&format!(
                "{:<34} {:>18} {:>18} {:>18}\n",
                name,
                fmt(Self::of(&self.shares, f)),
                fmt(Self::of(&self.whole, f)),
                fmt(mean_ci(&diff))
            ));
        }
        let saved = mean_ci(&self.saved());
        let pct: Vec<f64> = self
            .whole
            .iter()
            .zip(&self.shares)
            .map(|(w, s)| 100.0 * (w.gpu_hours - s.gpu_hours) / w.gpu_hours.max(1e-9))
            .collect();
        out.push_str(&format!(
            "\nGPU-hours saved by shares: {} ({} % of the rounded run)\n",
            fmt(saved),
            fmt(mean_ci(&pct))
        ));
        let never: usize = self.shares.iter().chain(&self.whole).map(|s| s.never_placed).sum();
        if never > 0 {
            out.push_str(&format!("jobs never placed (all runs): {never}\n"));
        }
        out
    }
}

/// Runs the workload for `opts` (topology preset, nodes, jobs, seeds, load).
pub fn report(opts: &SimOptions) -> Result<FracReport, String> {
    let name = opts.topology.clone().unwrap_or_else(|| "pcie8".into());
    let topo = Topology::preset(&name).ok_or_else(|| {
        format!(
            "--topology {name}: the fractional workload takes one preset ({})",
            Topology::preset_names().join(", ")
        )
    })?;
    let cl = generated(&topo, opts.nodes.max(1), opts.rack_size);
    let gpus = cl.total_gpus();
    let mut shares = Vec::new();
    let mut whole = Vec::new();
    for s in 0..opts.seeds {
        let jobs = stream(opts.jobs, opts.load, gpus, cl.max_node_gpus(), 1000 + s as u64);
        shares.push(simulate(&cl, &jobs, Mode::Shares, 1000 + s as u64));
        whole.push(simulate(&cl, &jobs, Mode::Whole, 1000 + s as u64));
    }
    Ok(FracReport {
        topology: name,
        nodes: opts.nodes.max(1),
        gpus,
        jobs: opts.jobs,
        seeds: opts.seeds,
        load: opts.load,
        small_jobs: SMALL_JOBS,
        small_shares: SMALL_SHARES.iter().map(|h| format_hundredths(*h)).collect(),
        shares,
        whole,
    })
}

/// `gpuam sim --workload fractional`: prints the table (or JSON).
pub fn run(opts: &SimOptions) -> Result<(), super::SimError> {
    let r = report(opts).map_err(super::SimError::Usage)?;
    if opts.json {
        let j = serde_json::to_string_pretty(&r).map_err(|e| super::SimError::Output(e.to_string()))?;
        println!("{j}");
    } else {
        print!("{}", r.table());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_has_the_stated_share_of_small_jobs_and_load() {
        let jobs = stream(4000, 0.8, 256, 8, 7);
        let small = jobs.iter().filter(|j| j.is_small()).count() as f64 / jobs.len() as f64;
        assert!((small - SMALL_JOBS).abs() < 0.03, "{small}");
        assert!(jobs
            .iter()
            .filter(|j| j.is_small())
            .all(|j| j.tasks.len() == 1 && SMALL_SHARES.contains(&j.tasks[0])));
        assert!(jobs.windows(2).all(|w| w[0].arrival <= w[1].arrival));
    }

    #[test]
    fn shares_hold_fewer_gpu_hours_and_never_wait_longer_on_a_small_cluster() {
        let topo = Topology::preset("pcie8").unwrap();
        let cl = generated(&topo, 4, 8);
        let jobs = stream(300, 0.9, cl.total_gpus(), 8, 3);
        let s = simulate(&cl, &jobs, Mode::Shares, 1);
        let w = simulate(&cl, &jobs, Mode::Whole, 1);
        assert_eq!((s.never_placed, w.never_placed), (0, 0));
        // Exactly the rounding: the same jobs, held for the same durations.
        let small_hours: f64 = jobs
            .iter()
            .filter(|j| j.is_small())
            .map(|j| (1.0 - f64::from(j.tasks[0]) / 100.0) * j.duration / 3600.0)
            .sum();
        assert!((w.gpu_hours - s.gpu_hours - small_hours).abs() < 1e-6, "{w:?} {s:?}");
        assert!(s.small_wait_mean_s <= w.small_wait_mean_s, "{s:?} {w:?}");
    }

    #[test]
    fn a_share_job_is_placed_as_a_share() {
        let topo = Topology::preset("pcie4").unwrap();
        let cl = generated(&topo, 1, 8);
        let sel = Selector::new(ClusterView::new(cl.to_nodes()), SelectSettings::default());
        let job = FracJob {
            arrival: 0.0,
            duration: 1.0,
            tasks: vec![25],
        };
        let b = place(&sel, &job, Mode::Shares).unwrap();
        assert_eq!(b[0].1.gpu_share(), Some(25));
        let b = place(&sel, &job, Mode::Whole).unwrap();
        assert_eq!((b[0].1.gpu_share(), b[0].1.gpu_count()), (None, 1));
    }
}
