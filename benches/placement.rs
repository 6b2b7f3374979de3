//! Placement costs: the GPU choice per preset and request size, one select at 1,000 and
//! 10,000 nodes (half-used pcie8 cluster), and one RM ledger grant.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use gpuam::cluster::synthetic::bench_cluster;
use gpuam::cluster::ClusterView;
use gpuam::config::SelectSettings;
use gpuam::protocol::Ask;
use gpuam::resources::PortSet;
use gpuam::rm::ledger::Ledger;
use gpuam::select::{JobDemand, Selector, TaskAsk, TaskShape};
use gpuam::spec::TaskResources;
use gpuam::topology::{choose, Topology};

fn gpu_choice(c: &mut Criterion) {
    for p in ["pcie8", "dgx1v", "nvbridge8x", "pcie16", "pcie64"] {
        let Some(t) = Topology::preset(p) else { continue };
        let n = t.gpu_count();
        // A fragmented free mask: every third GPU used.
        let free = (0..n).filter(|i| i % 3 != 0).fold(0u64, |m, i| m | 1 << i);
        for k in [1u32, 2, 4, 8] {
            if k > free.count_ones() {
                continue;
            }
            c.bench_function(&format!("choose/{p}/k{k}"), |b| {
                b.iter(|| choose(Some(black_box(&t)), black_box(free), black_box(k)))
            });
        }
    }
}

fn select(c: &mut Criterion) {
    let settings = SelectSettings {
        seed: Some(1),
        ..SelectSettings::default()
    };
    let r = TaskResources {
        cpu: 4,
        memory_mb: 8192,
        gpus: 2,
        gpu_mask: None,
        ports: Vec::new(),
        ..Default::default()
    };
    let mut demand = JobDemand::new(true);
    demand.add_waiting(TaskShape::of(&r), 1);
    for n in [1000usize, 10_000] {
        let sel = Selector::new(ClusterView::new(bench_cluster(n, 42)), settings.clone());
        let ask = TaskAsk::plain("w", &r, 1);
        c.bench_function(&format!("select/{n}-nodes"), |b| {
            b.iter(|| sel.select(black_box(&ask), &demand))
        });
    }
}

fn ledger_grant(c: &mut Criterion) {
    let nodes = bench_cluster(1000, 7);
    let host = nodes
        .iter()
        .find(|n| n.free().gpu_count() >= 2)
        .map(|n| (n.host.clone(), n.free().gpu_mask))
        .unwrap();
    let mask = gpuam::resources::lowest_bits(host.1, 2).unwrap();
    let ask = Ask {
        request_id: 1,
        host: host.0.clone(),
        cpu: 4,
        memory_mb: 8192,
        gpu_mask: mask,
        ports: PortSet::new(),
        ..Default::default()
    };
    c.bench_function("ledger/grant+complete", |b| {
        let mut ledger = Ledger::new(nodes.clone(), Duration::from_secs(600));
        b.iter(|| {
            let ct = ledger.grant("app", 1, black_box(&ask), Instant::now()).unwrap();
            ledger.complete(&ct.container_id, 0, "");
        })
    });
}

/// One grant (and its completion) on a node that already holds `live` containers of 1 MB
/// each, against a full recount of that usage (`Ledger::audit_usage`, what every grant did
/// before usage was kept incrementally): issue 11's "one allocate took 7.3 s at 15,000
/// containers".
fn ledger_grant_at_scale(c: &mut Criterion) {
    let node = gpuam::cluster::Node::new(
        "big",
        "/r",
        gpuam::resources::Resources::with_mask(64, 1 << 30, 0xff, PortSet::new()),
    );
    let holding = |live: usize| {
        let mut ledger = Ledger::new([node.clone()], Duration::from_secs(600));
        let now = Instant::now();
        for i in 0..live {
            let small = Ask {
                request_id: i as u64,
                host: "big".into(),
                memory_mb: 1,
                ..Default::default()
            };
            ledger.grant("app", 1, &small, now).unwrap();
        }
        ledger
    };
    for live in [0usize, 1000, 15_000] {
        // The recount first, on a ledger holding exactly `live` containers (the grant
        // bench below leaves its completed ones behind).
        if live > 0 {
            let ledger = holding(live);
            c.bench_function(&format!("ledger/recount/live-{live}"), |b| {
                b.iter(|| black_box(ledger.audit_usage()))
            });
        }
        let mut ledger = holding(live);
        let ask = Ask {
            request_id: u64::MAX,
            host: "big".into(),
            cpu: 1,
            memory_mb: 1,
            gpu_mask: 0x1,
            ..Default::default()
        };
        c.bench_function(&format!("ledger/grant+complete/live-{live}"), |b| {
            b.iter(|| {
                let ct = ledger.grant("app", 1, black_box(&ask), Instant::now()).unwrap();
                ledger.complete(&ct.container_id, 0, "");
            })
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
    targets = gpu_choice, select, ledger_grant, ledger_grant_at_scale
}
criterion_main!(benches);
