//! The RM's start estimates on a saturated cluster (issue 27, item 4): every GPU of N 8-GPU
//! nodes held by a running container with a declared end, W applications waiting (1-, 2-,
//! 4- and 8-GPU jobs and 2 × 8 gangs, each declaring a run time). Prints, per size, the time
//! of one walk of the whole queue (`reserved::estimates`, what the scheduling pass runs once a
//! second under the RM's lock) against the rule it replaced — one `reserve` over the running
//! ends per waiting application, blind to the queue ahead — in the same run, and what the
//! walk told; a row marked * gives every application its own shape (the eligibility rule is
//! asked per node class and distinct shape), one marked + makes every application a job of
//! 32 one-GPU tasks that is no gang (the walk starts its tasks one by one; the old rule took
//! them as a gang). "drawn" is the same walk with every end and run drawn (calibrated
//! limits: the median start of `survival::DRAWS` walks, and the point walk). Figures, not
//! assertions: `cargo bench --bench estimates`.

use std::time::Instant;

use gpuam::protocol::WaitingTasks;
use gpuam::resources::{mask_of_count, Resources};
use gpuam::rm::scheduler::queues::QueueTree;
use gpuam::rm::scheduler::reservation;
use gpuam::rm::scheduler::reserved::{self, EndBasis, Expected, Run};
use gpuam::rm::scheduler::{AppDemand, Held, NodeCap, Shares, Snapshot};

const NOW: u64 = 1_800_000_000_000;

/// How the waiting applications are shaped.
#[derive(Clone, Copy, PartialEq)]
enum Shapes {
    /// 1-, 2-, 4-, 8-GPU jobs and 2 × 8 gangs, alike.
    Mixed,
    /// The same, every application of its own shape.
    Distinct,
    /// Jobs of 32 one-GPU tasks that are no gang (walked task by task).
    Tasks,
}

fn world(nodes: usize, waiting: usize, shape: Shapes) -> Snapshot {
    let mut s = Snapshot::default();
    for i in 0..nodes {
        s.nodes.push(NodeCap {
            host: format!("n{i}"),
            pool: String::new(),
            partition: String::new(),
            usable: true,
            total: Resources::with_mask(64, 1 << 20, mask_of_count(8), Default::default()),
            free_gpus: 0,
            free_cpu: 32,
            free_memory_mb: 1 << 19,
            free_ports: Default::default(),
            free_custom: Default::default(),
            topology: None,
        });
    }
    // The running job, holding every node in two halves that end at spread-out times.
    s.apps.push(AppDemand {
        id: "running".into(),
        ..Default::default()
    });
    for n in 0..nodes {
        for half in 0..2u64 {
            s.held.push(Held {
                container_id: format!("c{n}-{half}"),
                app: 0,
                node: n,
                gpus: 0xf << (4 * half),
                gpu_shares: Default::default(),
                cpu: 16,
                memory_mb: 1 << 18,
                ports: Default::default(),
                custom: Default::default(),
                run_ms: 0,
                leaving: false,
                for_queue: None,
            });
            let end = NOW + 60_000 * (1 + ((n as u64 * 7919 + half * 104_729) % 600));
            s.ends.push(Expected {
                end_ms: Some(end),
                basis: EndBasis::Declared,
            });
        }
    }
    let shapes = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)];
    for w in 0..waiting {
        let (count, gpus) = match shape {
            Shapes::Tasks => (32, 1),
            _ => shapes[w % shapes.len()],
        };
        let distinct = shape == Shapes::Distinct;
        s.apps.push(AppDemand {
            id: format!("w{w:05}"),
            submitted_ms: NOW - 1_000_000 + w as u64,
            gang: count > 1 && shape != Shapes::Tasks,
            waiting: vec![WaitingTasks {
                role: "r".into(),
                count,
                gpus,
                cpu: 4 * gpus,
                // Distinct: every application of its own shape (a few MB apart).
                memory_mb: 4096 * u64::from(gpus) + if distinct { w as u64 } else { 0 },
                max_run_sec: Some(600 + 60 * (w as u64 % 50)),
                ..Default::default()
            }],
            ..Default::default()
        });
    }
    s
}

/// The rule the walk replaced: each waiting application alone against the running ends.
fn one_reserve_each(s: &Snapshot) -> Vec<u64> {
    let (free, releases) = (reserved::free_rooms(s), reserved::releases(s));
    (0..s.apps.len())
        .filter(|&a| !s.apps[a].waiting.is_empty())
        .filter_map(|a| reservation::reserve(&free, &releases, &reserved::tasks_of(s, a), NOW).map(|r| r.start_ms))
        .collect()
}

/// The median of `starts`, in minutes from now.
fn p50_min(starts: &[u64]) -> u64 {
    let mut waits: Vec<u64> = starts.iter().map(|t| (t - NOW) / 60_000).collect();
    waits.sort_unstable();
    waits.get(waits.len() / 2).copied().unwrap_or(0)
}

fn best_of<T>(reps: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut best = f64::MAX;
    let mut out = None;
    for _ in 0..reps {
        let t = Instant::now();
        let r = f();
        best = best.min(t.elapsed().as_secs_f64() * 1000.0);
        out = Some(r);
    }
    (best, out.expect("at least one repetition"))
}

fn main() {
    println!("(* every waiting application of its own shape; + jobs of 32 one-GPU tasks, no gang)");
    println!(
        "nodes   waiting    walk ms   one-reserve-each ms   walk/old   told   cut   median start in min (walk / old)   drawn ms   drawn/walk"
    );
    // `cargo bench` passes `--bench`; `cargo test --all-targets` (CI's smoke run, an
    // unoptimised build) does not: then the smallest size only, once.
    let full = std::env::args().any(|a| a == "--bench");
    let sizes = [
        (1_000, 100, Shapes::Mixed),
        (10_000, 100, Shapes::Mixed),
        (10_000, 1_000, Shapes::Mixed),
        (10_000, 1_000, Shapes::Distinct),
        (10_000, 1_000, Shapes::Tasks),
    ];
    for &(nodes, waiting, shape) in &sizes[..if full { sizes.len() } else { 1 }] {
        let s = world(nodes, waiting, shape);
        let tree = QueueTree::default();
        let shares = Shares::compute(&tree, &s);
        let runs: reserved::Expectations = s
            .apps
            .iter()
            .map(|a| reserved::run_of(a, |_| None))
            .collect::<Vec<Run>>()
            .into();
        let reps = match (full, nodes * waiting > 1_000_000) {
            (false, _) => 1,
            (true, true) => 3,
            (true, false) => 10,
        };
        let (walk_ms, est) = best_of(reps, || reserved::estimates(&s, &shares, None, &runs, NOW, None));
        let (old_ms, old) = best_of(reps, || one_reserve_each(&s));
        // Calibrated ends: every held container's end and every application's run drawn
        // (here spread from 5/12 to 19/12 of the point value), the median of the walks.
        let mut drawn = runs.clone();
        for (h, e) in s.ends.iter().enumerate() {
            if let Some(end) = e.end_ms {
                drawn
                    .drawn_ends
                    .insert(h, std::array::from_fn(|k| NOW + (end - NOW) * (k as u64 + 5) / 12));
            }
        }
        for (a, r) in runs.runs.iter().enumerate() {
            if let Some(ms) = r.ms {
                drawn
                    .drawn_runs
                    .insert(a, std::array::from_fn(|k| ms * (k as u64 + 5) / 12));
            }
        }
        let (drawn_ms, _) = best_of(reps.min(3), || {
            reserved::estimates(&s, &shares, None, &drawn, NOW, None)
        });
        let starts: Vec<u64> = est.iter().flatten().filter_map(|e| e.start_ms).collect();
        let told = starts.len();
        let cut = est
            .iter()
            .flatten()
            .filter(|e| e.text.contains("longer than an estimate walks"))
            .count();
        println!(
            "{nodes:>6} {waiting:>8}{} {walk_ms:>9.1} {old_ms:>21.1} {:>9.2} {told:>6} {cut:>5}   {} / {} {drawn_ms:>28.1} {:>12.1}",
            match shape {
                Shapes::Mixed => " ",
                Shapes::Distinct => "*",
                Shapes::Tasks => "+",
            },
            walk_ms / old_ms,
            p50_min(&starts),
            p50_min(&old),
            drawn_ms / walk_ms
        );
    }
}
