//! An AM's start at 1,000 and 10,000 nodes, in-process and by phase (issue 29): reading the
//! RM's compact node listing (`?view=compact`), building the `allNodes` view, building the
//! selector's index. Prints each phase's median over a few runs; the cluster-wide figure is
//! `gpuam bench cluster` (docs/BENCHMARKS.md). Run: `cargo bench --bench am_start`.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use gpuam::cluster::rm_json::{node_entry_bytes, node_json_bytes, parse_node_listing, ObjectForm, SHAPE};
use gpuam::cluster::synthetic::bench_cluster;
use gpuam::cluster::{ClusterView, Node};
use gpuam::config::SelectSettings;
use gpuam::select::Selector;

/// The compact listing of `nodes`, as the RM writes it: each distinct shape once, then each
/// node's identity and the index of its shape.
fn compact_listing(nodes: &[Node]) -> (String, usize) {
    let mut ids: HashMap<Vec<u8>, usize> = HashMap::new();
    let mut shapes: Vec<Vec<u8>> = Vec::new();
    let mut entries: Vec<String> = Vec::new();
    for n in nodes {
        let shape = node_json_bytes(n, 0, 0, ObjectForm::Shape);
        let k = *ids.entry(shape.clone()).or_insert_with(|| {
            shapes.push(shape);
            shapes.len() - 1
        });
        let entry = String::from_utf8(node_entry_bytes(n)).unwrap_or_default();
        entries.push(format!(r#"{{"{SHAPE}":{k},{}"#, entry.get(1..).unwrap_or_default()));
    }
    let count = shapes.len();
    let shapes: Vec<String> = shapes
        .into_iter()
        .map(|s| String::from_utf8(s).unwrap_or_default())
        .collect();
    let text = format!(
        r#"{{"nodes":{{"shapes":[{}],"node":[{}]}},"nodesVersion":"1-1"}}"#,
        shapes.join(","),
        entries.join(",")
    );
    (text, count)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// One AM start's phases in ms, in this process: read the listing, build the view, build
/// the selector's index.
fn phases(text: &str, settings: &SelectSettings) -> [f64; 3] {
    let t0 = Instant::now();
    let listing = parse_node_listing(black_box(text)).unwrap_or_default();
    let t1 = Instant::now();
    let v = ClusterView::new(listing.nodes);
    let t2 = Instant::now();
    let sel = Selector::new(v, settings.clone());
    let t3 = Instant::now();
    black_box(&sel);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    [ms(t1 - t0), ms(t2 - t1), ms(t3 - t2)]
}

const CHILD: &str = "GPUAM_AM_START_CHILD";

/// This process's minor page faults so far (pages it touched for the first time).
fn minor_faults() -> f64 {
    // SAFETY: getrusage writes the struct it is given and nothing else.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is a valid target.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return f64::NAN;
    }
    u.ru_minflt as f64
}

fn main() {
    let settings = SelectSettings {
        seed: Some(1),
        ..SelectSettings::default()
    };
    // A child: one start in a fresh process, as an AM makes it (its memory faulted in for
    // the first time), the listing read from the file its parent wrote.
    if let Ok(path) = std::env::var(CHILD) {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let before = minor_faults();
        let p = phases(&text, &settings);
        println!("{} {} {} {}", p[0], p[1], p[2], minor_faults() - before);
        return;
    }
    let me = std::env::current_exe().ok();
    let dir = tempfile::tempdir().ok();
    println!("AM start by phase (ms): median of 9 runs in this process (warm) and of 9 fresh processes (cold)");
    println!("| nodes | shapes | listing bytes | read listing warm / cold | view warm / cold | selector index warm / cold | total warm / cold | pages faulted in (cold) |");
    println!("|---|---|---|---|---|---|---|---|");
    for (n, busy) in [(1000usize, false), (10_000, false), (1000, true), (10_000, true)] {
        let mut nodes = bench_cluster(n, 42);
        if !busy {
            // An idle cluster: every node of one shape (what `gpuam bench cluster` starts with).
            for x in &mut nodes {
                x.set_used(Default::default());
            }
        }
        let (text, shapes) = compact_listing(&nodes);
        let warm: Vec<[f64; 3]> = (0..9).map(|_| phases(&text, &settings)).collect();
        let mut cold: Vec<[f64; 3]> = Vec::new();
        let mut faults: Vec<f64> = Vec::new();
        if let (Some(me), Some(dir)) = (&me, &dir) {
            let path = dir.path().join(format!("listing-{n}-{busy}.json"));
            if std::fs::write(&path, &text).is_ok() {
                for _ in 0..9 {
                    let Ok(out) = std::process::Command::new(me).env(CHILD, &path).output() else {
                        continue;
                    };
                    let v: Vec<f64> = String::from_utf8_lossy(&out.stdout)
                        .split_whitespace()
                        .filter_map(|x| x.parse().ok())
                        .collect();
                    if let [a, b, c, f] = v[..] {
                        cold.push([a, b, c]);
                        faults.push(f);
                    }
                }
            }
        }
        let col = |runs: &[[f64; 3]], i: Option<usize>| {
            median(runs.iter().map(|r| i.map_or(r.iter().sum(), |i| r[i])).collect())
        };
        let cell = |i: Option<usize>| format!("{:.2} / {:.2}", col(&warm, i), col(&cold, i));
        println!(
            "| {n}{} | {shapes} | {} | {} | {} | {} | {} | {:.0} |",
            if busy { " (half used)" } else { "" },
            text.len(),
            cell(Some(0)),
            cell(Some(1)),
            cell(Some(2)),
            cell(None),
            median(faults),
        );
    }
}
