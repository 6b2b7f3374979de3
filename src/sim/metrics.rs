//! What one simulated run measures (per policy and seed), and the mean ± 95 % interval
//! over seeds (Student t, n − 1 degrees of freedom).

use std::collections::BTreeMap;

use serde::Serialize;

/// Raw counters of one run.
#[derive(Clone, Debug, Default)]
pub struct RunStats {
    /// Multi-GPU tasks placed, at the ideal tier, and the sum of their W/W*.
    pub multi_placed: u64,
    pub multi_ideal: u64,
    pub w_ratio_sum: f64,
    /// Multi-GPU task arrivals, and those for which an ideal-tier set existed somewhere.
    pub multi_arrivals: u64,
    pub multi_avail: u64,
    /// Multi-task jobs placed; nodes and racks used above the minimum; at the minimum.
    pub multi_task_jobs: u64,
    /// A job's GPUs on one node (the union, ≥ 2 GPUs) placed, and how many reached the
    /// best tier a node offered for a set of that size at the moment of placement.
    pub union_placed: u64,
    pub union_ideal: u64,
    pub nodes_over_min: u64,
    pub racks_over_min: u64,
    pub at_min_nodes: u64,
    /// Multi-task jobs placed whose GPU tasks span more than one GPU type (issue 27).
    pub mixed_type_jobs: u64,
    /// Seconds from arrival to start, per placed job.
    pub delays: Vec<f64>,
    /// The same for big gangs (at least `Queueing::big_gpus` GPUs) and small jobs (one task,
    /// fewer GPUs) (issue 27, item 3).
    pub big_delays: Vec<f64>,
    pub small_delays: Vec<f64>,
    /// Per placed job with an estimate made at its submit: (|estimated − actual start|,
    /// actual wait), seconds (issue 27, item 4).
    pub estimate_err: Vec<(f64, f64)>,
    /// Wall clock of each choice call that placed a task (ns).
    pub decision_ns: Vec<u64>,
    pub gpu_seconds: f64,
    /// GPU-seconds in use between the first and the last arrival (`utilizationArrivals`).
    pub busy_gpu_seconds: f64,
    pub first_arrival: f64,
    /// The last arrival (s).
    pub last_arrival: f64,
    pub last_end: f64,
    pub cluster_gpus: u64,
    pub placed_jobs: u64,
    /// Jobs that could never fit this cluster (dropped, not queued).
    pub dropped_jobs: u64,
    pub fallbacks: u64,
    pub invalid: u64,
    /// Choices the node model refused (GPU not free, CPU/memory short): policy bugs.
    pub refused: u64,
    /// Seconds the queue's head waited with too few free GPUs in the cluster (capacity),
    /// with enough but in no shape it could take (fragmentation), and holding out for a
    /// better GPU tier (gpuam's topology wait): where the FIFO queue's delay comes from.
    pub head_capacity_sec: f64,
    pub head_fragmented_sec: f64,
    pub head_topology_wait_sec: f64,
}

pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        f64::NAN
    } else {
        a as f64 / b as f64
    }
}

/// Metric names, in report order (JSON keys).
pub const METRICS: &[&str] = &[
    "tierIdeal",
    "tierAvail",
    "wRatio",
    "unionIdeal",
    "nodesOverMin",
    "racksOverMin",
    "atMinNodes",
    "mixedTypeGangs",
    "queueDelayP50",
    "queueDelayP95",
    "utilization",
    "makespan",
    "decisionP50Us",
    "decisionP99Us",
    "placedJobs",
    "droppedJobs",
    "fallbacks",
    "invalid",
    "refused",
    "headCapacityFrac",
    "headFragmentedFrac",
    "headTopologyWaitFrac",
    "bigWaitP95",
    "smallWaitP50",
    "bigJobs",
    "estimateErrP50",
    "estimateRelErrP50",
    "estimateWithin20",
    "utilizationArrivals",
];

/// Jobs that waited at least this long are judged on the relative error of their estimate.
pub const ESTIMATE_MIN_WAIT_SEC: f64 = 60.0;

/// (median |error| s, median |error| / wait over the jobs that waited at least
/// [`ESTIMATE_MIN_WAIT_SEC`], share of those within 20 % of their wait).
fn estimate_summary(err: &[(f64, f64)]) -> (f64, f64, f64) {
    let mut abs: Vec<f64> = err.iter().map(|e| e.0).collect();
    abs.sort_by(f64::total_cmp);
    let mut rel: Vec<f64> = err
        .iter()
        .filter(|e| e.1 >= ESTIMATE_MIN_WAIT_SEC)
        .map(|e| e.0 / e.1)
        .collect();
    rel.sort_by(f64::total_cmp);
    let within = if rel.is_empty() {
        f64::NAN
    } else {
        rel.iter().filter(|&&r| r <= 0.2).count() as f64 / rel.len() as f64
    };
    let p50 = |v: &[f64]| if v.is_empty() { f64::NAN } else { percentile(v, 0.5) };
    (p50(&abs), p50(&rel), within)
}

impl RunStats {
    /// The scalar metrics of this run (NaN where nothing was measured, e.g. no
    /// multi-task job).
    pub fn summary(&self) -> BTreeMap<&'static str, f64> {
        let mut d = self.delays.clone();
        d.sort_by(f64::total_cmp);
        let mut t: Vec<f64> = self.decision_ns.iter().map(|&n| n as f64 / 1000.0).collect();
        t.sort_by(f64::total_cmp);
        let makespan = (self.last_end - self.first_arrival).max(0.0);
        let util = if makespan > 0.0 && self.cluster_gpus > 0 {
            self.gpu_seconds / (self.cluster_gpus as f64 * makespan)
        } else {
            f64::NAN
        };
        // Blocked-head time as a fraction of the run (makespan).
        let head_frac = |x: f64| if makespan > 0.0 { x / makespan } else { f64::NAN };
        let per_job = |x: u64| {
            if self.multi_task_jobs == 0 {
                f64::NAN
            } else {
                x as f64 / self.multi_task_jobs as f64
            }
        };
        let sorted = |v: &[f64]| {
            let mut v = v.to_vec();
            v.sort_by(f64::total_cmp);
            v
        };
        let (big, small) = (sorted(&self.big_delays), sorted(&self.small_delays));
        let nan_if_empty = |v: &[f64], p: f64| if v.is_empty() { f64::NAN } else { percentile(v, p) };
        let (est_abs, est_rel, est_within) = estimate_summary(&self.estimate_err);
        let span = self.last_arrival - self.first_arrival;
        let vals = [
            ratio(self.multi_ideal, self.multi_placed),
            ratio(self.multi_avail, self.multi_arrivals),
            if self.multi_placed == 0 {
                f64::NAN
            } else {
                self.w_ratio_sum / self.multi_placed as f64
            },
            ratio(self.union_ideal, self.union_placed),
            per_job(self.nodes_over_min),
            per_job(self.racks_over_min),
            per_job(self.at_min_nodes),
            self.mixed_type_jobs as f64,
            percentile(&d, 0.5),
            percentile(&d, 0.95),
            util,
            makespan,
            percentile(&t, 0.5),
            percentile(&t, 0.99),
            self.placed_jobs as f64,
            self.dropped_jobs as f64,
            self.fallbacks as f64,
            self.invalid as f64,
            self.refused as f64,
            head_frac(self.head_capacity_sec),
            head_frac(self.head_fragmented_sec),
            head_frac(self.head_topology_wait_sec),
            nan_if_empty(&big, 0.95),
            nan_if_empty(&small, 0.5),
            big.len() as f64,
            est_abs,
            est_rel,
            est_within,
            if span > 0.0 && self.cluster_gpus > 0 {
                self.busy_gpu_seconds / (self.cluster_gpus as f64 * span)
            } else {
                f64::NAN
            },
        ];
        METRICS.iter().copied().zip(vals).collect()
    }
}

/// Two-sided 97.5 % quantile of Student's t for `df` degrees of freedom.
pub fn t975(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::NAN,
        d if d <= 30 => T[d - 1],
        // Past the table, the Cornish–Fisher expansion around the normal quantile (within
        // 0.001 of the exact value from 31 degrees of freedom on; it tends to 1.960).
        d => {
            let (z, n) = (1.959_964f64, d as f64);
            z + (z.powi(3) + z) / (4.0 * n) + (5.0 * z.powi(5) + 16.0 * z.powi(3) + 3.0 * z) / (96.0 * n * n)
        }
    }
}

/// Mean and 95 % half-width over seeds (NaN values skipped; one value → half-width 0).
pub fn mean_ci(values: &[f64]) -> (f64, f64) {
    let v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    if v.len() == 1 {
        return (mean, 0.0);
    }
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, t975(v.len() - 1) * (var / n).sqrt())
}

/// One policy's results over all seeds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PolicyResult {
    /// metric → mean over seeds; `<metric>Ci` → 95 % half-width.
    #[serde(flatten)]
    pub values: BTreeMap<String, Option<f64>>,
    #[serde(skip)]
    pub delays: Vec<f64>,
    /// Each seed's scalar metrics, in seed order (the paired comparison of the verdict;
    /// `perSeed` in the JSON, NaN as null).
    #[serde(rename = "perSeed")]
    pub per_seed: Vec<BTreeMap<&'static str, f64>>,
}

impl PolicyResult {
    pub fn from_runs(runs: &[RunStats]) -> PolicyResult {
        let sums: Vec<_> = runs.iter().map(RunStats::summary).collect();
        let mut values = BTreeMap::new();
        let fin = |x: f64| x.is_finite().then_some(x);
        for m in METRICS {
            let v: Vec<f64> = sums.iter().map(|s| s[m]).collect();
            let (mean, ci) = mean_ci(&v);
            values.insert((*m).to_string(), fin(mean));
            values.insert(format!("{m}Ci"), fin(ci));
        }
        values.insert("seeds".into(), Some(runs.len() as f64));
        let mut delays: Vec<f64> = runs.iter().flat_map(|r| r.delays.iter().copied()).collect();
        delays.sort_by(f64::total_cmp);
        PolicyResult {
            values,
            delays,
            per_seed: sums,
        }
    }

    pub fn get(&self, m: &str) -> Option<f64> {
        self.values.get(m).copied().flatten()
    }

    /// Mean and 95 % half-width over seeds of `other`'s metric minus this one's, seed by
    /// seed (the streams are paired: both policies replayed the same jobs). `None` without
    /// at least two seeds on both sides.
    pub fn paired(&self, other: &PolicyResult, m: &str) -> Option<(f64, f64)> {
        if self.per_seed.len() < 2 || self.per_seed.len() != other.per_seed.len() {
            return None;
        }
        let d: Vec<f64> = self
            .per_seed
            .iter()
            .zip(&other.per_seed)
            .filter_map(|(a, b)| Some(b.get(m)? - a.get(m)?))
            .collect();
        let (mean, ci) = mean_ci(&d);
        (mean.is_finite() && ci.is_finite()).then_some((mean, ci))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_ci_uses_t_quantiles_and_skips_nan() {
        let (m, h) = mean_ci(&[1.0, 2.0, 3.0, f64::NAN]);
        assert!((m - 2.0).abs() < 1e-12);
        // sd = 1, n = 3, t(2) = 4.303 → 4.303 / sqrt(3)
        assert!((h - 4.303 / 3f64.sqrt()).abs() < 1e-9);
        assert_eq!(mean_ci(&[5.0]), (5.0, 0.0));
        // Past the table: 39 degrees of freedom (40 seeds) is 2.023, not the normal 1.960.
        assert!((t975(39) - 2.023).abs() < 0.001, "{}", t975(39));
        assert!((t975(31) - 2.040).abs() < 0.001, "{}", t975(31));
        assert!((t975(10_000) - 1.960).abs() < 0.001);
        assert!(mean_ci(&[]).0.is_nan());
    }

    #[test]
    fn summary_ratios_and_percentiles() {
        let r = RunStats {
            multi_placed: 4,
            multi_ideal: 3,
            multi_arrivals: 5,
            multi_avail: 5,
            w_ratio_sum: 3.0,
            delays: vec![0.0, 10.0, 20.0, 30.0, 40.0],
            gpu_seconds: 50.0,
            first_arrival: 0.0,
            last_end: 10.0,
            cluster_gpus: 10,
            ..Default::default()
        };
        let s = r.summary();
        assert_eq!(s["tierIdeal"], 0.75);
        assert_eq!(s["tierAvail"], 1.0);
        assert_eq!(s["wRatio"], 0.75);
        assert_eq!(s["queueDelayP50"], 20.0);
        assert_eq!(s["utilization"], 0.5);
        assert!(s["nodesOverMin"].is_nan(), "no multi-task job measured");
        assert!(s["bigWaitP95"].is_nan() && s["estimateErrP50"].is_nan());
        let e = RunStats {
            estimate_err: vec![(10.0, 100.0), (50.0, 100.0), (5.0, 10.0), (0.0, 0.0)],
            ..Default::default()
        };
        let s = e.summary();
        // |error|: 0, 5, 10, 50 → 10; relative over the waits ≥ 60 s: 0.1, 0.5 → 0.5.
        assert_eq!(s["estimateErrP50"], 10.0);
        assert_eq!(s["estimateRelErrP50"], 0.5);
        assert_eq!(s["estimateWithin20"], 0.5);
    }
}
