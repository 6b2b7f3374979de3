//! Latency of `topology::choose` per preset and request size, plus a p50/p99/max latency
//! sweep over random free masks at 64 GPUs (printed before the criterion runs).
//!
//! Each criterion iteration calls `choose` once for each of `MASKS` seeded random free
//! masks, so the time per call is the reported time divided by `MASKS`.

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion};
use gpuam::topology::{choose, Topology};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const MASKS: usize = 4;

/// `count` seeded random free masks with at least `k` free GPUs each.
fn free_masks(seed: u64, n: u32, k: u32, count: usize) -> Vec<u64> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        let p = rng.gen_range(0.4..1.0);
        let m = (0..n).filter(|_| rng.gen_bool(p)).fold(0u64, |m, i| m | 1 << i);
        if m.count_ones() >= k {
            out.push(m);
        }
    }
    out
}

/// p50 / p99 / max of single calls over random (free mask, k) pairs, in µs.
fn latency_sweep(t: &Topology, calls: usize) -> (f64, f64, f64) {
    let mut rng = SmallRng::seed_from_u64(64);
    let n = t.gpu_count();
    let mut samples = Vec::with_capacity(calls);
    while samples.len() < calls {
        let p = [0.3, 0.5, 0.75, 0.9, 1.0][rng.gen_range(0..5)];
        let f = (0..n).filter(|_| rng.gen_bool(p)).fold(0u64, |m, i| m | 1 << i);
        let free = f.count_ones();
        if free == 0 {
            continue;
        }
        let k = rng.gen_range(1..=free);
        let start = Instant::now();
        black_box(choose(Some(black_box(t)), black_box(f), black_box(k)));
        samples.push(start.elapsed().as_secs_f64() * 1e6);
    }
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    (at(0.5), at(0.99), at(1.0))
}

fn sweeps(_c: &mut Criterion) {
    for name in ["pcie64", "pcie32", "pcie16", "nvswitch16", "dgx1v", "pcie8"] {
        if let Some(t) = Topology::preset(name) {
            let (p50, p99, max) = latency_sweep(&t, 20_000);
            eprintln!("latency sweep {name}: p50 {p50:.2} µs, p99 {p99:.2} µs, max {max:.2} µs (20000 random (F, k))");
        }
    }
}

fn per_preset(c: &mut Criterion) {
    let cases: &[(&str, &[u32])] = &[
        ("pcie8", &[1, 2, 4, 8]),
        ("dgx1v", &[1, 2, 4, 8]),
        ("nvbridge8x", &[1, 2, 4, 8]),
        ("nvswitch8", &[1, 2, 4, 8]),
        ("pcie16", &[1, 2, 4, 8]),
        ("pcie64", &[1, 2, 4, 8, 16, 32]),
    ];
    for &(name, ks) in cases {
        let Some(t) = Topology::preset(name) else {
            continue;
        };
        for &k in ks {
            let masks = free_masks(u64::from(k) * 1000 + 7, t.gpu_count(), k, MASKS);
            c.bench_function(&format!("choose/{name}/k{k}/x{MASKS}"), |b| {
                b.iter(|| {
                    for &f in &masks {
                        black_box(choose(Some(black_box(&t)), black_box(f), black_box(k)));
                    }
                })
            });
        }
    }
}

criterion_group!(benches, sweeps, per_preset);
criterion_main!(benches);
