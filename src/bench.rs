//! `gpuam bench select`: the select pipeline on the scenario the original AM was
//! measured on (issue 2), printing median and p99 per call, and the time to plan a
//! 1,000-task job on 1,000 nodes. Figures go to docs/BENCHMARKS.md.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::cluster::{ClusterView, Node};
use crate::config::SelectSettings;
use crate::exit;
use crate::resources::{PortSet, Resources};
use crate::select::{plan_job, JobDemand, Outcome, Selector, TaskAsk, TaskShape};
use crate::spec::{Completion, JobSpec, PortRequest, TaskResources, TaskRole};
use crate::topology::Topology;

/// N nodes of 64 CPU, 256000 MB, 8 GPUs (pcie8 topology), ports 20000–29999, 40
/// nodes a rack; each GPU used with probability ½, 4 CPU and 8192 MB used per used GPU.
pub fn bench_cluster(n: usize, seed: u64) -> Vec<Node> {
    let mut rng = StdRng::seed_from_u64(seed);
    let topo = Topology::preset("pcie8").map(Arc::new);
    (0..n)
        .map(|i| {
            let mut node = Node::new(
                format!("node{i:05}"),
                format!("/rack{:03}", i / 40),
                Resources::with_mask(64, 256_000, 0xff, PortSet::range(20000, 29999)),
            );
            node.topology = topo.clone();
            node.gpu_type = Some("V100".into());
            let used: u64 = (0..8).filter(|_| rng.gen_bool(0.5)).fold(0, |m, b| m | (1 << b));
            let k = used.count_ones();
            node.set_used(Resources::with_mask(4 * k, 8192 * u64::from(k), used, PortSet::new()));
            node
        })
        .collect()
}

fn request(ports: bool) -> TaskResources {
    TaskResources {
        cpu: 4,
        memory_mb: 8192,
        gpus: 2,
        gpu_mask: None,
        ports: if ports {
            vec![PortRequest {
                label: "p".into(),
                count: 2,
                start: None,
            }]
        } else {
            Vec::new()
        },
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

pub fn select_bench(sizes: &[usize], iterations: usize, seed: u64) -> i32 {
    let settings = SelectSettings {
        seed: Some(seed),
        ..SelectSettings::default()
    };
    println!("gpuam bench select (seed {seed}, {iterations} timed selects per row, cluster unchanged between calls)");
    println!(
        "{:>8} {:>6} {:>12} {:>12} {:>12}",
        "nodes", "ports", "median", "p99", "max"
    );
    for &n in sizes {
        let selector = Selector::new(ClusterView::new(bench_cluster(n, seed)), settings.clone());
        for ports in [false, true] {
            let r = request(ports);
            let mut demand = JobDemand::new(true);
            demand.add_waiting(TaskShape::of(&r), 1);
            let ask = TaskAsk {
                role: "worker",
                resources: &r,
                node_label: None,
                gpu_types: &[],
                reuse_ports: None,
                waiting_tasks: 1,
            };
            // Warm-up (also fills the GPU-choice cache, as a running AM's would be).
            for _ in 0..20 {
                let _ = selector.select(&ask, &demand);
            }
            let mut times = Vec::with_capacity(iterations);
            let mut placed = 0;
            for _ in 0..iterations {
                let t = Instant::now();
                let sel = selector.select(&ask, &demand);
                times.push(t.elapsed());
                placed += usize::from(matches!(sel.outcome, Outcome::Placed(_)));
            }
            if placed != iterations {
                eprintln!("error: only {placed} of {iterations} selects placed the task");
                return exit::INTERNAL;
            }
            times.sort();
            println!(
                "{:>8} {:>6} {:>12} {:>12} {:>12}",
                n,
                if ports { "2" } else { "0" },
                us(percentile(&times, 0.5)),
                us(percentile(&times, 0.99)),
                us(*times.last().unwrap_or(&Duration::ZERO))
            );
        }
    }
    // A 1,000-task job, 2 GPUs each, on 1,000 nodes, each choice booked before the next.
    let nodes = bench_cluster(1000, seed);
    let selector = Selector::new(ClusterView::new(nodes), settings);
    let job = JobSpec {
        name: "bench".into(),
        gang: false,
        task_roles: vec![TaskRole {
            name: "worker".into(),
            instances: 1000,
            resources: request(false),
            gpu_types: Vec::new(),
            node_label: None,
            same_port_allocation: false,
            commands: vec!["true".into()],
            task_retry_count: 0,
            completion: Completion::default(),
        }],
        ..Default::default()
    };
    let t = Instant::now();
    let plan = plan_job(&selector, &job);
    let took = t.elapsed();
    let hosts: std::collections::HashSet<_> = plan.placements.iter().map(|p| p.host.as_str()).collect();
    println!(
        "plan of a 1,000-task job (2 GPUs each) on 1,000 nodes: {:.1} ms ({} placed on {} nodes, {} unplaced)",
        took.as_secs_f64() * 1e3,
        plan.placements.len(),
        hosts.len(),
        plan.unplaced.len()
    );
    exit::SUCCESS
}
