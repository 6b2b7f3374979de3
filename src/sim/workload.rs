//! Job streams for the simulator: seeded synthetic streams (size mixes A and B of
//! reference/gpu-topology.md §7.3, Poisson arrivals at an offered load, exponential
//! durations) and the replay tables of the Philly and Alibaba 2023 traces, with the
//! machine lists those traces come with. Every modelling assumption is stated here and
//! repeated in docs/BENCHMARKS.md.

use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::cluster::{small_topology, SimCluster, Task, CPU_PER_GPU, MEM_MB_PER_GPU};
use crate::topology::Topology;

/// One job: it arrives, waits until all its tasks fit at once (gang), holds them for
/// `duration`, then frees them.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    pub id: usize,
    /// Seconds.
    pub arrival: f64,
    /// Seconds.
    pub duration: f64,
    pub tasks: Vec<Task>,
}

impl Job {
    pub fn gpus(&self) -> u32 {
        self.tasks.iter().map(|t| t.gpus).sum()
    }
}

/// A request-size mix: (GPUs, probability).
pub type Mix = &'static [(u32, f64)];
pub const MIX_A: Mix = &[(1, 0.55), (2, 0.20), (3, 0.05), (4, 0.12), (8, 0.08)];
pub const MIX_B: Mix = &[(1, 0.30), (2, 0.30), (4, 0.25), (8, 0.15)];

pub fn mix_by_name(name: &str) -> Option<Mix> {
    match name.trim().to_ascii_uppercase().as_str() {
        "A" => Some(MIX_A),
        "B" => Some(MIX_B),
        _ => None,
    }
}

/// CPU cores and memory a task asks per GPU (half a generated node's share, so GPUs bind).
pub const TASK_CPU_PER_GPU: u32 = 4;
pub const TASK_MEM_MB_PER_GPU: u64 = 16 * 1024;
/// Mean job duration of the synthetic streams (seconds).
pub const SYNTH_MEAN_DURATION: f64 = 3600.0;

fn task_of(gpus: u32) -> Task {
    Task {
        gpus,
        cpu: TASK_CPU_PER_GPU * gpus.max(1),
        mem_mb: TASK_MEM_MB_PER_GPU * u64::from(gpus.max(1)),
    }
}

/// Splits a job of `total` GPUs into tasks of at most `per_node` GPUs: one task if it
/// fits a node; else `n = ceil(total / per_node)` equal tasks when `n` divides `total`,
/// otherwise `per_node`-GPU tasks and one smaller remainder task (e.g. 20 on 8 → 8, 8, 4).
pub fn split_tasks(total: u32, per_node: u32) -> Vec<u32> {
    let per_node = per_node.max(1);
    if total <= per_node {
        return vec![total];
    }
    let n = total.div_ceil(per_node);
    if total.is_multiple_of(n) {
        return vec![total / n; n as usize];
    }
    let mut v = vec![per_node; (total / per_node) as usize];
    v.push(total % per_node);
    v
}

fn exp_sample(rng: &mut StdRng, mean: f64) -> f64 {
    let u: f64 = 1.0 - rng.gen::<f64>(); // (0, 1]
    -u.ln() * mean
}

/// Seeded Poisson stream at offered load `load` (GPU-time asked / GPU-time available),
/// sizes from `mix`, exponential durations of mean [`SYNTH_MEAN_DURATION`].
pub fn synthetic(mix: Mix, jobs: usize, load: f64, cluster_gpus: u64, per_node: u32, seed: u64) -> Vec<Job> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_0f10_b5e5);
    let mean_size: f64 = mix.iter().map(|(s, p)| f64::from(*s) * p).sum();
    let rate = load.max(1e-6) * cluster_gpus as f64 / (mean_size * SYNTH_MEAN_DURATION);
    let mut t = 0.0;
    (0..jobs)
        .map(|id| {
            t += exp_sample(&mut rng, 1.0 / rate);
            let u: f64 = rng.gen();
            let mut acc = 0.0;
            let mut size = mix[mix.len() - 1].0;
            for (s, p) in mix {
                acc += p;
                if u < acc {
                    size = *s;
                    break;
                }
            }
            Job {
                id,
                arrival: t,
                duration: exp_sample(&mut rng, SYNTH_MEAN_DURATION).max(1.0),
                tasks: split_tasks(size, per_node).into_iter().map(task_of).collect(),
            }
        })
        .collect()
}

/// A trace problem: missing file (exit 65 with a hint) or a bad line.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TraceError(pub String);

/// The trace directory: `--traces`, else $GPUAM_TRACES, else [`DEFAULT_TRACES`] (the samples
/// kept in the repository, relative to the working directory: run from the repository root).
pub fn traces_dir(flag: Option<&Path>) -> PathBuf {
    if let Some(p) = flag {
        return p.to_path_buf();
    }
    if let Ok(p) = std::env::var("GPUAM_TRACES") {
        if !p.is_empty() {
            return PathBuf::from(p);
        }
    }
    PathBuf::from(DEFAULT_TRACES)
}

/// The repository's trace samples (`data/traces/`, README there names each source and licence).
pub const DEFAULT_TRACES: &str = "data/traces";

/// Rows of a replay CSV as (line number, header-name → cell lookup).
struct Csv {
    path: String,
    header: Vec<String>,
    rows: Vec<(usize, Vec<String>)>,
}

impl Csv {
    fn read(path: &Path) -> Result<Csv, TraceError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            TraceError(format!(
                "cannot read trace file {}: {e} (run from the repository root, which holds data/traces/, or point --traces or GPUAM_TRACES at the directory holding replay/)",
                path.display()
            ))
        })?;
        let mut lines = text.lines().enumerate();
        let header = match lines.next() {
            Some((_, h)) => h.split(',').map(|s| s.trim().to_string()).collect(),
            None => return Err(TraceError(format!("{} is empty", path.display()))),
        };
        let rows = lines
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| (i + 1, l.split(',').map(|s| s.trim().to_string()).collect()))
            .collect();
        Ok(Csv {
            path: path.display().to_string(),
            header,
            rows,
        })
    }

    fn col(&self, name: &str) -> Result<usize, TraceError> {
        self.header
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| TraceError(format!("{}: no column `{name}` in the header", self.path)))
    }

    fn num(&self, line: usize, row: &[String], col: usize, name: &str) -> Result<Option<f64>, TraceError> {
        match row.get(col).map(String::as_str) {
            None | Some("") => Ok(None),
            Some(s) => s.parse::<f64>().map(Some).map_err(|_| {
                TraceError(format!(
                    "{} line {line}: column `{name}` is `{s}`, not a number",
                    self.path
                ))
            }),
        }
    }
}

/// Which real trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trace {
    Philly,
    Alibaba2023,
}

impl Trace {
    fn files(self) -> (&'static str, &'static str) {
        match self {
            Trace::Philly => ("replay/philly_machines.csv", "replay/philly_pass_ge4gpu_jobs.csv"),
            Trace::Alibaba2023 => (
                "replay/alibaba_v2023_machines.csv",
                "replay/alibaba_v2023_default_jobs.csv",
            ),
        }
    }
}

/// Nodes a rack for the trace clusters (the traces give no racks; file order).
pub const TRACE_RACK_SIZE: usize = 16;

/// The trace's machine list as a cluster. Topologies: 8 GPUs → `eight` (default pcie8;
/// Alibaba V100M16/V100M32 8-GPU machines → dgx1v unless `eight` was given), 4 → pcie4,
/// 2 → a PIX pair, 1 → a single GPU; GPU-less machines are left out (CPU-only pods are
/// not replayed). Missing CPU / memory: 8 cores and 64 GiB per GPU.
pub fn trace_cluster(dir: &Path, trace: Trace, eight: Option<&Topology>) -> Result<SimCluster, TraceError> {
    let csv = Csv::read(&dir.join(trace.files().0))?;
    let (c_id, c_gpus, c_type, c_cpu, c_mem) = (
        csv.col("machine_id")?,
        csv.col("num_gpus")?,
        csv.col("gpu_type")?,
        csv.col("cpu_cores")?,
        csv.col("mem_gb")?,
    );
    let mut cl = SimCluster::new();
    let pcie8 = Topology::preset("pcie8");
    let dgx1v = Topology::preset("dgx1v");
    let mut i = 0usize;
    for (line, row) in &csv.rows {
        let gpus = csv.num(*line, row, c_gpus, "num_gpus")?.unwrap_or(0.0) as u32;
        if gpus == 0 {
            continue;
        }
        let ty = row.get(c_type).map(String::as_str).unwrap_or("");
        let topo = if gpus == 8 {
            match (eight, trace) {
                (Some(t), _) => Some(t.clone()),
                (None, Trace::Alibaba2023) if ty.starts_with("V100") => dgx1v.clone(),
                _ => pcie8.clone(),
            }
        } else {
            small_topology(gpus)
        };
        let Some(topo) = topo else {
            return Err(TraceError(format!(
                "{} line {line}: no topology for a machine of {gpus} GPUs",
                csv.path
            )));
        };
        let cpu = csv
            .num(*line, row, c_cpu, "cpu_cores")?
            .map(|c| c as u32)
            .unwrap_or(CPU_PER_GPU * gpus);
        let mem = csv
            .num(*line, row, c_mem, "mem_gb")?
            .map(|m| (m * 1024.0) as u64)
            .unwrap_or(MEM_MB_PER_GPU * u64::from(gpus));
        let id = row.get(c_id).cloned().unwrap_or_default();
        cl.add_node(
            format!("{i:05}-{id}"),
            &format!("/rack{:03}", i / TRACE_RACK_SIZE),
            &topo,
            cpu,
            mem,
        );
        if let (Some(n), false) = (cl.nodes.last_mut(), ty.is_empty()) {
            n.gpu_type = std::sync::Arc::from(ty);
        }
        i += 1;
    }
    if cl.nodes.is_empty() {
        return Err(TraceError(format!("{}: no machine with GPUs", csv.path)));
    }
    Ok(cl)
}

/// Every job of the trace, arrivals from 0, in submit order.
/// Philly: `total_gpus` split by [`split_tasks`] over 8-GPU nodes, 4 cores and 16 GiB
/// per GPU. Alibaba: one task per pod with `gpus_per_task`, `cpu_milli_per_task`
/// (rounded up to cores), `mem_mib_per_task`; GPU-sharing pods (gpu_milli < 1000) count
/// as one whole GPU; pods asking for no GPU, and pending pods (no duration), are skipped;
/// GPU-type constraints ignored.
pub fn trace_jobs(dir: &Path, trace: Trace) -> Result<Vec<Job>, TraceError> {
    let csv = Csv::read(&dir.join(trace.files().1))?;
    let (c_sub, c_dur, c_tot, c_gpt, c_cpu, c_mem) = (
        csv.col("submit_s")?,
        csv.col("duration_s")?,
        csv.col("total_gpus")?,
        csv.col("gpus_per_task")?,
        csv.col("cpu_milli_per_task")?,
        csv.col("mem_mib_per_task")?,
    );
    let mut jobs = Vec::new();
    for (line, row) in &csv.rows {
        let need = |v: Option<f64>, name: &str| {
            v.ok_or_else(|| TraceError(format!("{} line {line}: column `{name}` is empty", csv.path)))
        };
        let arrival = need(csv.num(*line, row, c_sub, "submit_s")?, "submit_s")?;
        let duration = match (csv.num(*line, row, c_dur, "duration_s")?, trace) {
            (Some(d), _) => d.max(1.0),
            // Pending pods were never scheduled: nothing to replay.
            (None, Trace::Alibaba2023) => continue,
            (None, Trace::Philly) => {
                return Err(TraceError(format!(
                    "{} line {line}: column `duration_s` is empty",
                    csv.path
                )))
            }
        };
        let tasks = match trace {
            Trace::Philly => {
                let total = need(csv.num(*line, row, c_tot, "total_gpus")?, "total_gpus")? as u32;
                split_tasks(total, 8).into_iter().map(task_of).collect::<Vec<_>>()
            }
            Trace::Alibaba2023 => {
                let g = csv.num(*line, row, c_gpt, "gpus_per_task")?.unwrap_or(0.0) as u32;
                if g == 0 {
                    continue;
                }
                let cpu = csv.num(*line, row, c_cpu, "cpu_milli_per_task")?.unwrap_or(0.0);
                let mem = csv.num(*line, row, c_mem, "mem_mib_per_task")?.unwrap_or(0.0);
                vec![Task {
                    gpus: g,
                    cpu: (cpu / 1000.0).ceil() as u32,
                    mem_mb: mem.max(0.0) as u64,
                }]
            }
        };
        if tasks.iter().all(|t| t.gpus == 0) {
            continue;
        }
        jobs.push(Job {
            id: jobs.len(),
            arrival,
            duration,
            tasks,
        });
    }
    jobs.sort_by(|a, b| a.arrival.total_cmp(&b.arrival));
    Ok(jobs)
}

/// The `n`-job window of seed `s` of `seeds` (windows evenly spaced over the trace, so
/// seeds differ in workload as well as in policy randomness), arrivals rebased to 0 and
/// compressed or stretched so that the offered load is `load` (≤ 0: recorded times).
pub fn trace_window(all: &[Job], n: usize, s: usize, seeds: usize, load: f64, cluster_gpus: u64) -> Vec<Job> {
    let n = n.min(all.len());
    let slack = all.len() - n;
    let start = if seeds > 1 { slack * s / (seeds - 1) } else { 0 };
    let mut w: Vec<Job> = all[start..start + n].to_vec();
    let t0 = w.first().map(|j| j.arrival).unwrap_or(0.0);
    let span = w.last().map(|j| j.arrival - t0).unwrap_or(0.0).max(1.0);
    let work: f64 = w.iter().map(|j| f64::from(j.gpus()) * j.duration).sum();
    let factor = if load > 0.0 {
        (work / (cluster_gpus.max(1) as f64 * load)) / span
    } else {
        1.0
    };
    for (i, j) in w.iter_mut().enumerate() {
        j.id = i;
        j.arrival = (j.arrival - t0) * factor;
    }
    w
}
