//! Unit tests of the simulator: engine invariants, gang undo, policies' choices on
//! known cases, the trace readers and the CLI-level outputs.

use super::cluster::{generated, SimCluster, Task};
use super::policies::{besteffort_choose, partition_count, CellTree};
use super::workload::{split_tasks, synthetic, Job, MIX_A, MIX_B};
use super::*;
use crate::topology::Topology;

fn task(g: u32) -> Task {
    Task {
        gpus: g,
        cpu: 4 * g,
        mem_mb: 1024 * u64::from(g),
    }
}

/// A job of one task of `gpus` GPUs.
fn one_task_job(id: usize, arrival: f64, duration: f64, gpus: u32) -> Job {
    Job {
        id,
        arrival,
        duration,
        tasks: vec![task(gpus)],
    }
}

fn cl(preset: &str, n: usize) -> SimCluster {
    generated(&Topology::preset(preset).unwrap(), n, 4)
}

#[test]
fn every_policy_places_a_synthetic_stream_and_frees_everything() {
    let c = cl("pcie8", 6);
    let jobs = synthetic(MIX_B, 300, 0.9, c.total_gpus(), 8, 3);
    for p in POLICIES {
        let s = simulate(&c, &jobs, p, 1).unwrap();
        assert_eq!(s.placed_jobs + s.dropped_jobs, 300, "{p}");
        assert_eq!(s.refused, 0, "{p} chose something not free");
        assert!(s.multi_placed > 0 && s.multi_ideal <= s.multi_placed, "{p}");
        let u = s.summary()["utilization"];
        assert!(u > 0.1 && u <= 1.0, "{p}: utilization {u}");
        let ua = s.summary()["utilizationArrivals"];
        assert!(ua > 0.1 && ua <= 1.0, "{p}: utilization while jobs arrive {ua}");
        assert_eq!(
            s.decision_ns.len() as u64,
            s.placed_jobs,
            "one task per job on 8-GPU nodes"
        );
    }
}

#[test]
fn gang_job_waits_until_all_tasks_fit_and_bookings_are_undone() {
    // 2 nodes of 4 GPUs; job 0 holds 6 GPUs (2 tasks of 3... split as 4+2), job 1 needs 2 × 4.
    let c = cl("pcie4", 2);
    let jobs = vec![
        Job {
            id: 0,
            arrival: 0.0,
            duration: 100.0,
            tasks: vec![task(3)],
        },
        Job {
            id: 1,
            arrival: 1.0,
            duration: 10.0,
            tasks: vec![task(4), task(4)],
        },
    ];
    for p in POLICIES {
        let s = simulate(&c, &jobs, p, 1).unwrap();
        assert_eq!(s.placed_jobs, 2, "{p}");
        // Job 1 could take one node at t=1 but not both: it must wait for job 0 (t=100).
        assert!((s.delays[1] - 99.0).abs() < 1e-9, "{p}: delay {}", s.delays[1]);
        assert_eq!(s.nodes_over_min, 0, "{p}");
        assert!((s.last_end - 110.0).abs() < 1e-9);
    }
}

#[test]
fn gpuam_bookings_through_the_selector_match_the_node_model() {
    let c = cl("dgx1v", 3);
    let jobs = synthetic(MIX_A, 200, 0.95, c.total_gpus(), 8, 9);
    let mut c2 = c.clone();
    let mut placer = Placer::new("gpuam", &c2, 5, 0).unwrap();
    let mut st = RunStats::default();
    let mut live = Vec::new();
    for j in jobs.iter().take(12) {
        if let Some(p) = placer.place(&mut c2, j, &mut st, false, None) {
            live.push((j.clone(), p));
        }
    }
    let Placer::Gpuam { selector, .. } = &placer else {
        panic!()
    };
    selector.with_view(|v| {
        for n in &c2.nodes {
            let node = v.get(&n.host).unwrap();
            assert_eq!(node.free().gpu_mask, n.free_mask, "{}", n.host);
        }
    });
    for (j, p) in &live {
        placer.release(&mut c2, j, p);
    }
    let Placer::Gpuam { selector, .. } = &placer else {
        panic!()
    };
    selector.with_view(|v| assert!(v.nodes().all(|n| n.free() == n.total())));
    assert!(c2
        .nodes
        .iter()
        .all(|n| n.free_mask == n.all_mask && n.free_cpu == n.cpu_total));
}

#[test]
fn task_split_rules() {
    assert_eq!(split_tasks(4, 8), vec![4]);
    assert_eq!(split_tasks(16, 8), vec![8, 8]);
    assert_eq!(split_tasks(12, 8), vec![6, 6]);
    assert_eq!(split_tasks(20, 8), vec![8, 8, 4]);
    assert_eq!(split_tasks(8, 4), vec![4, 4]);
}

#[test]
fn besteffort_reproduces_the_reference_cross_socket_triple() {
    // Reference §1.6: pcie8, free {1,2,4,5,6,7}, k = 3 → {1,4,5} (the partition objective
    // sacrifices the current request).
    let t = Topology::preset("pcie8").unwrap();
    let r = besteffort_choose(&t, 0b1111_0110, 3).unwrap();
    assert_eq!(r.mask, 0b0011_0010);
    assert!(!r.fallback);
    // All free, k = 2 on pcie8: a PIX pair.
    let r = besteffort_choose(&t, 0xff, 2).unwrap();
    assert_eq!(t.tier(r.mask), 1);
    assert_eq!(partition_count(16, 2), 2_027_025.0);
    // 64 free GPUs: the search is capped and a greedy set is returned.
    let t64 = Topology::preset("pcie64").unwrap();
    let r = besteffort_choose(&t64, u64::MAX, 4).unwrap();
    assert!(r.fallback);
    assert_eq!(r.mask.count_ones(), 4);
    assert_eq!(t64.tier(r.mask), 1, "greedy still finds one switch's 4 GPUs");
}

#[test]
fn besteffort_never_returns_the_padded_set() {
    // Reference §1.6: nvbridge8 (#546 pattern), free {0,1,4,5,6}, k = 3: the faithful code
    // returns [4 5 nil]; we return a real set and count the case.
    let t = Topology::preset("nvbridge8").unwrap();
    let r = besteffort_choose(&t, 0b0111_0011, 3).unwrap();
    assert_eq!(r.mask.count_ones(), 3);
    assert_eq!(r.mask & !0b0111_0011, 0);
    assert!(r.padded_won);
}

#[test]
fn hived_cell_tree_follows_links_and_best_fits() {
    let t = Topology::preset("pcie8").unwrap();
    let tree = CellTree::of(&t);
    // GPUs, switches, sockets, node.
    assert_eq!(tree.levels.len(), 4);
    assert_eq!(tree.levels[1], vec![0x3, 0xc, 0x30, 0xc0]);
    // One GPU: take the one whose switch buddy is already used (best fit).
    let (m, _, _) = tree.choose(0b1111_1101, 1).unwrap();
    assert_eq!(m, 0b01, "GPU 0: its switch buddy (GPU 1) is used");
    // Two GPUs spanning: with switches {2,3} and {6,7} free, and GPU 0 free, choose a switch.
    let (m, level, _) = tree.choose(0b1100_1101, 2).unwrap();
    assert_eq!(level, 1);
    assert!(m == 0xc || m == 0xc0, "{m:#x}");
    // dgx1v's NV2 links already connect all 8 GPUs: the tree is flat (a known limit).
    let d = CellTree::of(&Topology::preset("dgx1v").unwrap());
    assert!(d.levels.len() <= 3);
}

#[test]
fn gpuam_is_at_least_as_good_as_baselines_on_pcie8() {
    let c = cl("pcie8", 8);
    let jobs = synthetic(MIX_A, 600, 0.8, c.total_gpus(), 8, 11);
    let ideal = |p: &str| simulate(&c, &jobs, p, 2).unwrap().summary()["tierIdeal"];
    let g = ideal("gpuam");
    for p in ["original", "random"] {
        assert!(g > ideal(p), "gpuam {g} vs {p}");
    }
}

#[test]
fn trace_files_missing_is_a_clear_error() {
    let dir = std::path::Path::new("/nonexistent-gpuam-traces");
    let e = workload::trace_jobs(dir, workload::Trace::Philly).unwrap_err();
    assert!(e.0.contains("GPUAM_TRACES"), "{e}");
    let opts = SimOptions {
        workload: "philly".into(),
        topology: None,
        nodes: 4,
        jobs: 10,
        seeds: 1,
        load: 0.8,
        policies: vec!["gpuam".into()],
        mix: "A".into(),
        rack_size: 4,
        json: true,
        out: None,
        scaling: false,
        traces: Some(dir.to_path_buf()),
        queues: None,
        grace_sec: 30.0,
        topology_wait_sec: 300,
        queueing: Queueing::default(),
    };
    assert!(matches!(run(&opts), Err(super::SimError::Input(_))));
}

#[test]
fn trace_readers_parse_the_replay_tables() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(d.path().join("replay")).unwrap();
    std::fs::write(
        d.path().join("replay/philly_machines.csv"),
        "machine_id,num_gpus,gpu_type,gpu_mem_gb,cpu_cores,mem_gb,topo_1,topo_2,topo_3\nm0,2,,12,,,,,\nm1,8,,24,,,,,\n",
    )
    .unwrap();
    std::fs::write(
        d.path().join("replay/philly_pass_ge4gpu_jobs.csv"),
        "job_id,submit_s,start_s,end_s,duration_s,total_gpus,num_tasks,gpus_per_task,gpu_milli_per_task,gpu_type_constraint,cpu_milli_per_task,mem_mib_per_task,status,extra\n\
         a,10,,,100,16,,,,,,,Pass,x\nb,0,,,50,4,,,,,,,Pass,x\nc,oops,,,50,4,,,,,,,Pass,x\n",
    )
    .unwrap();
    let c = workload::trace_cluster(d.path(), workload::Trace::Philly, None).unwrap();
    assert_eq!(c.total_gpus(), 10);
    assert_eq!(c.topo_of(1).name(), "pcie8");
    let e = workload::trace_jobs(d.path(), workload::Trace::Philly).unwrap_err();
    assert!(e.0.contains("line 4") && e.0.contains("submit_s"), "{e}");
}

#[test]
fn trace_window_rescales_to_the_offered_load() {
    let jobs: Vec<Job> = (0..10)
        .map(|i| Job {
            id: i,
            arrival: 100.0 + 10.0 * i as f64,
            duration: 100.0,
            tasks: vec![task(2)],
        })
        .collect();
    let w = workload::trace_window(&jobs, 5, 1, 2, 0.5, 4);
    assert_eq!(w.len(), 5);
    assert_eq!(w[0].arrival, 0.0);
    // work = 5 × 200 GPU·s; at load 0.5 on 4 GPUs the span is 500 s.
    assert!((w[4].arrival - 500.0).abs() < 1e-9);
}

#[test]
fn json_and_charts_have_the_documented_shape() {
    let c = cl("pcie4", 4);
    let opts = SimOptions {
        workload: "synthetic".into(),
        topology: Some("pcie4".into()),
        nodes: 4,
        jobs: 50,
        seeds: 2,
        load: 0.8,
        policies: vec!["original".into(), "gpuam".into()],
        mix: "A".into(),
        rack_size: 4,
        json: true,
        out: None,
        scaling: false,
        traces: None,
        queues: None,
        grace_sec: 30.0,
        topology_wait_sec: 300,
        queueing: Queueing::default(),
    };
    let stream = |s: usize| synthetic(MIX_A, 50, 0.8, c.total_gpus(), 4, s as u64);
    let r = run_topology(&opts, "pcie4", &c, &stream);
    let j = report::to_json(&opts, std::slice::from_ref(&r), &[]);
    let g = &j["policies"]["gpuam"];
    for k in [
        "tierIdeal",
        "tierAvail",
        "wRatio",
        "queueDelayP50",
        "utilization",
        "decisionP99Us",
        "tierIdealCi",
    ] {
        assert!(g.get(k).is_some(), "missing {k} in {g}");
    }
    // Per seed (the paired comparisons), with the issue 27 metrics and the queueing.
    let per = g["perSeed"].as_array().unwrap();
    assert_eq!(per.len(), 2);
    for k in [
        "queueDelayP50",
        "bigWaitP95",
        "smallWaitP50",
        "estimateErrP50",
        "estimateWithin20",
    ] {
        assert!(per[0].get(k).is_some(), "missing {k} in {}", per[0]);
    }
    assert_eq!(j["queueing"]["discipline"], "fifo");
    assert_eq!(j["queueing"]["expectedEnd"], "declared:1");
    let svg = charts::tier_ideal_bars(std::slice::from_ref(&r));
    assert!(svg.starts_with("<svg") && svg.contains("<rect") && svg.trim_end().ends_with("</svg>"));
    assert!(charts::delay_cdf(&r).contains("<polyline"));
    let csv = report::to_csv(std::slice::from_ref(&r));
    assert_eq!(csv.lines().count(), 3);
}

fn result(vals: &[(&str, f64)]) -> super::metrics::PolicyResult {
    let mut p = super::metrics::PolicyResult::default();
    for (k, v) in vals {
        p.values.insert((*k).to_string(), Some(*v));
    }
    p
}

/// The verdict names every metric another policy's mean beats gpuam on, and whether the
/// intervals overlap; the trade-off chart draws each policy on both panels.
#[test]
fn domination_verdict_and_trade_off_chart() {
    let run = |hived_tier: f64, hived_delay: f64| TopologyRun {
        topology: "t".into(),
        cluster: Default::default(),
        jobs: 10,
        policies: vec![
            (
                "hived".into(),
                result(&[
                    ("tierIdeal", hived_tier),
                    ("tierIdealCi", 0.002),
                    ("unionIdeal", 0.7),
                    ("queueDelayP50", hived_delay),
                    ("queueDelayP50Ci", 5.0),
                ]),
            ),
            (
                "gpuam".into(),
                result(&[
                    ("tierIdeal", 0.99),
                    ("tierIdealCi", 0.002),
                    ("unionIdeal", 1.0),
                    ("queueDelayP50", 100.0),
                    ("queueDelayP50Ci", 5.0),
                ]),
            ),
        ],
    };
    let even = run(0.99, 100.2);
    assert!(dominance::losses(&even).is_empty(), "equal at the table's precision");
    assert!(dominance::verdict(&even).starts_with("gpuam dominates"));
    let close = run(0.993, 100.0);
    let l = dominance::losses(&close);
    assert_eq!(l.len(), 1);
    assert_eq!(
        (l[0].policy.as_str(), l[0].metric, l[0].within),
        ("hived", "tierIdeal", true)
    );
    let trade = run(0.999, 40.0);
    let l = dominance::losses(&trade);
    assert_eq!(l.len(), 2, "{l:?}");
    assert!(l.iter().all(|x| !x.within));
    let v = dominance::verdict(&trade);
    assert!(
        v.contains("hived tierIdeal 0.999") && v.contains("hived qP50 40") && v.contains("outside"),
        "{v}"
    );
    let svg = charts::trade_off(&trade);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("<circle").count(), 4, "2 policies × 2 panels");
    assert!(svg.contains("does not dominate"));
}

/// gpuam's topology wait: a 2-GPU job that finds only a split pair waits for a whole one
/// while other jobs run, and takes the split pair when its `select.topology_wait_sec` ends.
#[test]
fn gpuam_waits_for_a_whole_pair_then_takes_the_best_set_when_its_wait_ends() {
    let wait = crate::config::SelectSettings::default().topology_wait_sec as f64;
    assert!(wait > 0.0);
    let c = cl("pcie4", 1);
    // GPUs 0 and 1 (one pair) go to jobs 0 and 1, GPU 2 to job 2; job 1 ends at 50 and
    // leaves GPUs 1 and 3 free: no pair. Job 3 (2 GPUs) arrives at 60.
    let stream = |job0_end: f64| {
        let one = |id: usize, arrival: f64, duration: f64| Job {
            id,
            arrival,
            duration,
            tasks: vec![task(1)],
        };
        vec![
            one(0, 0.0, job0_end),
            one(1, 0.0, 50.0),
            one(2, 1.0, 5000.0),
            Job {
                id: 3,
                arrival: 60.0,
                duration: 10.0,
                tasks: vec![task(2)],
            },
        ]
    };
    // Job 0 ends at 200, inside the wait: job 3 gets the freed pair (0, 1) then.
    let s = simulate(&c, &stream(200.0), "gpuam", 1).unwrap();
    assert_eq!((s.multi_placed, s.multi_ideal), (1, 1));
    assert!((s.delays[3] - 140.0).abs() < 1e-9, "delay {}", s.delays[3]);
    // HiveD-like takes the split pair at once.
    let h = simulate(&c, &stream(200.0), "hived", 1).unwrap();
    assert_eq!((h.multi_placed, h.multi_ideal, h.delays[3]), (1, 0, 0.0));
    // Job 0 ends after the wait: job 3 takes the split pair when its wait ends.
    let s = simulate(&c, &stream(60.0 + wait + 500.0), "gpuam", 1).unwrap();
    assert_eq!((s.multi_placed, s.multi_ideal), (1, 0));
    assert!((s.delays[3] - wait).abs() < 1e-9, "delay {}", s.delays[3]);
}

/// The verdict judges a gap on the paired per-seed difference when the seeds are known: a
/// gap that is small but the same on every seed is significant although the two intervals
/// over seeds overlap; a gap whose sign changes from seed to seed is not.
#[test]
fn domination_verdict_uses_the_paired_difference_over_seeds() {
    let seeds = |vals: &[f64]| -> super::metrics::PolicyResult {
        let runs: Vec<std::collections::BTreeMap<&'static str, f64>> = vals
            .iter()
            .map(|v| [("queueDelayP50", *v)].into_iter().collect())
            .collect();
        let mut p = result(&[]);
        let (m, c) = super::metrics::mean_ci(vals);
        p.values.insert("queueDelayP50".into(), Some(m));
        p.values.insert("queueDelayP50Ci".into(), Some(c));
        p.per_seed = runs;
        p
    };
    let run = |other: &[f64], gpuam: &[f64]| TopologyRun {
        topology: "t".into(),
        cluster: Default::default(),
        jobs: 10,
        policies: vec![("hived".into(), seeds(other)), ("gpuam".into(), seeds(gpuam))],
    };
    // hived is 10 s faster on every seed, while the seeds spread over hundreds of seconds.
    let steady = run(&[90.0, 290.0, 490.0, 690.0], &[100.0, 300.0, 500.0, 700.0]);
    let l = dominance::losses(&steady);
    assert_eq!(l.len(), 1, "{l:?}");
    let (d, c) = l[0].paired.expect("paired difference over 4 seeds");
    assert!((d + 10.0).abs() < 1e-9 && c < 1e-9, "{d} ± {c}");
    assert!(!l[0].within, "the same gap on every seed is significant");
    assert!(dominance::verdict(&steady).contains("paired difference -10±0"));
    // hived is faster on average, but slower on half the seeds: noise.
    let noisy = run(&[0.0, 400.0, 100.0, 400.0], &[300.0, 100.0, 400.0, 200.0]);
    let l = dominance::losses(&noisy);
    assert_eq!(l.len(), 1, "{l:?}");
    assert!(l[0].within, "{l:?}");
}

/// The blocked-head diagnosis: a head that lacks free GPUs in the cluster counts as
/// capacity, one whose GPUs are free but split over nodes as fragmentation, and gpuam's
/// head holding out for a better tier as the topology wait.
#[test]
fn blocked_head_time_is_split_into_capacity_fragmentation_and_topology_wait() {
    let c = cl("pcie4", 2);
    let job = one_task_job;
    // Two 3-GPU jobs take 3 GPUs of each node until 100; a 2-GPU job at 10 finds 2 GPUs
    // free, one per node: fragmentation for 90 s.
    let frag = vec![job(0, 0.0, 100.0, 3), job(1, 0.0, 100.0, 3), job(2, 10.0, 5.0, 2)];
    for p in POLICIES {
        let s = simulate(&c, &frag, p, 1).unwrap();
        assert!(
            (s.head_fragmented_sec - 90.0).abs() < 1e-9,
            "{p}: {}",
            s.head_fragmented_sec
        );
        assert_eq!((s.head_capacity_sec, s.head_topology_wait_sec), (0.0, 0.0), "{p}");
    }
    // Both nodes full until 100; a 1-GPU job at 20 waits 80 s for capacity.
    let cap = vec![job(0, 0.0, 100.0, 4), job(1, 0.0, 100.0, 4), job(2, 20.0, 5.0, 1)];
    let s = simulate(&c, &cap, "hived", 1).unwrap();
    assert!((s.head_capacity_sec - 80.0).abs() < 1e-9, "{}", s.head_capacity_sec);
    assert_eq!(s.head_fragmented_sec, 0.0);
    // One node: GPUs 0, 1 and 2 busy, 1 frees at 50 (GPUs 1 and 3 free, no PIX pair); a
    // 2-GPU job at 60 holds out for the pair until GPU 0 frees at 200.
    let one = cl("pcie4", 1);
    let tier = vec![
        job(0, 0.0, 200.0, 1),
        job(1, 0.0, 50.0, 1),
        job(2, 1.0, 5000.0, 1),
        job(3, 60.0, 10.0, 2),
    ];
    let s = simulate(&one, &tier, "gpuam", 1).unwrap();
    assert!(
        (s.head_topology_wait_sec - 140.0).abs() < 1e-9,
        "{}",
        s.head_topology_wait_sec
    );
    assert_eq!((s.head_capacity_sec, s.head_fragmented_sec), (0.0, 0.0));
}

/// `mixedTypeGangs` (issue 27): a multi-task job whose GPU tasks land on two GPU types is
/// counted, per policy; one on a single type is not.
#[test]
fn jobs_spanning_gpu_types_are_counted_per_policy() {
    let two_by_four = |types: [&str; 2]| {
        let mut c = cl("pcie4", 2);
        for (n, ty) in c.nodes.iter_mut().zip(types) {
            n.gpu_type = std::sync::Arc::from(ty);
        }
        c
    };
    let jobs = vec![Job {
        id: 0,
        arrival: 0.0,
        duration: 10.0,
        tasks: vec![task(4), task(4)],
    }];
    for p in POLICIES {
        let mixed = simulate(&two_by_four(["V100", "T4"]), &jobs, p, 1).unwrap();
        if *p == "gpuam" {
            // gpuam keeps a gang to one type: no type holds 2 × 4 here, so it is refused.
            assert_eq!(mixed.summary()["mixedTypeGangs"], 0.0, "{p}");
            assert_eq!((mixed.placed_jobs, mixed.dropped_jobs), (0, 1), "{p}");
        } else {
            assert_eq!(mixed.summary()["mixedTypeGangs"], 1.0, "{p}");
        }
        let one = simulate(&two_by_four(["V100", "V100"]), &jobs, p, 1).unwrap();
        assert_eq!(one.summary()["mixedTypeGangs"], 0.0, "{p}");
        assert_eq!(one.placed_jobs, 1, "{p}");
    }
    assert!(cl("pcie8", 3).nodes.iter().all(|n| &*n.gpu_type == "pcie8"));
}

/// Issue 27, item 5, in the simulator: gpuam's policy is the AM's placement round, so a gang
/// gets GPUs of one type (select::one_type) on a cluster of several types, while a policy
/// that places task by task mixes them; and gpuam still places the stream.
#[test]
fn gpuam_keeps_every_gang_to_one_gpu_type_on_a_multi_type_cluster() {
    let c = cluster::mixed("mixed-demo", 16, 4).unwrap();
    let types: HashSet<&str> = c.nodes.iter().map(|n| &*n.gpu_type).collect();
    assert!(types.len() >= 4, "{types:?}");
    // Mix B with every job doubled or quadrupled: 2- to 4-task gangs over 4- and 8-GPU nodes.
    let mut jobs = synthetic(MIX_B, 200, 0.9, c.total_gpus(), 8, 5);
    for j in &mut jobs {
        let k = if j.id % 2 == 0 { 2 } else { 4 };
        let t = j.tasks[0];
        j.tasks = vec![t; k];
    }
    let g = simulate(&c, &jobs, "gpuam", 1).unwrap();
    assert!(g.multi_task_jobs > 100, "{}", g.multi_task_jobs);
    assert_eq!(g.summary()["mixedTypeGangs"], 0.0);
    assert_eq!(g.refused, 0);
    assert_eq!(g.placed_jobs + g.dropped_jobs, 200);
    assert!(g.placed_jobs >= 190, "placed {}", g.placed_jobs);
    let r = simulate(&c, &jobs, "random", 1).unwrap();
    assert!(
        r.mixed_type_jobs > 0,
        "the stream does make task-by-task policies mix types"
    );
}

/// Eight 8-GPU nodes full of whole-node jobs: the even ones end at 1070, 1152, 1234 and
/// 1316, the odd ones run 10,000 s. A 32-GPU gang (four 8-GPU tasks) arrives at 100; then
/// 1-GPU jobs of 2000 s every 10 s until 6000, of which job 9 is short (`short` s).
fn drain_scenario(short: f64) -> Vec<Job> {
    let whole = |id: usize, arrival: f64, duration: f64, tasks: usize| Job {
        id,
        arrival,
        duration,
        tasks: vec![task(8); tasks],
    };
    let mut jobs: Vec<Job> = (0..8)
        .map(|i| {
            let d = if i % 2 == 0 { 1070.0 + 40.0 * i as f64 } else { 10_000.0 };
            whole(i, i as f64, d, 1)
        })
        .collect();
    jobs.push(whole(8, 100.0, 500.0, 4));
    for i in 9..600 {
        let duration = if i == 9 { short } else { 2000.0 };
        jobs.push(Job {
            id: i,
            arrival: 100.0 + (i - 8) as f64 * 10.0,
            duration,
            tasks: vec![task(1)],
        });
    }
    jobs
}

/// Issue 27, item 3, through the policy simulator: with greedy backfill a 32-GPU gang starves
/// while 1-GPU jobs take every GPU that frees; with a reservation (the RM's
/// `reservation::Policy`) it starts as soon as its nodes drain, a short job is backfilled
/// on those nodes, and backfilling it does not delay the gang. Every policy.
#[test]
fn a_reserved_gang_starts_as_its_nodes_drain_and_a_backfilled_short_job_does_not_delay_it() {
    let c = cl("pcie8", 8);
    let start_of = |s: &RunStats| s.big_delays.first().map(|w| w + 100.0);
    let reserve = Queueing {
        backfill: true,
        reserve: Some(Policy {
            wait_bound_ms: u64::MAX,
            min_gpus: 32,
        }),
        ..Queueing::default()
    };
    let greedy = Queueing {
        backfill: true,
        ..Queueing::default()
    };
    for p in POLICIES {
        let jobs = drain_scenario(150.0);
        let plain = simulate_queueing(&c, &jobs, p, 1, 0, greedy).unwrap();
        assert_eq!(plain.placed_jobs, 600, "{p}");
        let starved = start_of(&plain).unwrap();
        assert!(
            starved > 6000.0,
            "{p}: without a reservation the gang starves until {starved}"
        );
        let run = simulate_queueing(&c, &jobs, p, 1, 0, reserve).unwrap();
        assert_eq!(run.placed_jobs, 600, "{p}");
        let started = start_of(&run).unwrap();
        assert!(
            (started - 1316.0).abs() < 1e-6,
            "{p}: the gang starts at 1316: {started}"
        );
        // The short job (150 s, declared 180 s) is backfilled at 1070 and ends before 1316.
        // (small_delays 0..8 are the whole-node jobs, started at once.)
        let short_wait = run.small_delays[8];
        assert!((short_wait - (1070.0 - 110.0)).abs() < 1e-6, "{p}: {short_wait}");
        // A long one in its place is not, and the gang starts at the same time.
        let long = simulate_queueing(&c, &drain_scenario(2000.0), p, 1, 0, reserve).unwrap();
        assert_eq!(
            start_of(&long),
            Some(started),
            "{p}: backfilling did not delay the gang"
        );
        assert!(long.small_delays[8] >= started - 110.0, "{p}: the long job waited");
    }
}

/// Issue 27, item 4: the start estimated at submit comes from the running jobs' expected
/// ends (declared limits: the duration rounded up to the minute) and the queue ahead; its
/// error is recorded per job.
#[test]
fn the_start_estimated_at_submit_is_recorded_against_the_actual_start() {
    let c = cl("pcie8", 8);
    let jobs = drain_scenario(150.0);
    let fifo = simulate_queueing(&c, &jobs, "gpuam", 1, 0, Queueing::default()).unwrap();
    // The gang (FIFO: it blocks the 1-GPU jobs) is estimated at 1326 (job 6's 1310 s
    // rounded up to 1320, from 6) and starts at 1316: 10 s off a wait of 1216 s.
    let gang = fifo
        .estimate_err
        .iter()
        .find(|(_, w)| (w - 1216.0).abs() < 1e-6)
        .copied();
    let (err, _) = gang.unwrap_or_else(|| panic!("{:?}", &fifo.estimate_err[..10]));
    assert!((err - 10.0).abs() < 1e-6, "{err}");
    assert_eq!(fifo.estimate_err.len(), 600, "every job had an estimate");
    let s = fifo.summary();
    assert!(s["estimateRelErrP50"] < 0.2, "{}", s["estimateRelErrP50"]);
    // Learned limits: nothing has ended when the gang arrives, so it has no estimate.
    let learned = Queueing {
        limit: reserve::Limit::Learned,
        ..Queueing::default()
    };
    let l = simulate_queueing(&c, &jobs, "gpuam", 1, 0, learned).unwrap();
    assert!(l.estimate_err.len() < 600);
}

/// Users who declare twice their runs (`declared:2`) are told starts far too late; the same
/// limits calibrated by what ended jobs used of theirs (`calibrated:2`) are told them as if
/// the runs were declared to the minute; scheduling is the same in all three runs.
#[test]
fn calibrated_limits_take_back_what_users_over_declare() {
    let c = cl("pcie8", 8);
    let jobs = drain_scenario(150.0);
    let with = |limit| {
        let q = Queueing {
            limit,
            ..Queueing::default()
        };
        simulate_queueing(&c, &jobs, "gpuam", 1, 0, q).unwrap().summary()
    };
    let exact = with(reserve::Limit::Declared(1.0, 1.0));
    let over = with(reserve::Limit::Declared(2.0, 2.0));
    let calibrated = with(reserve::Limit::Calibrated(2.0, 2.0));
    assert!(over["estimateRelErrP50"] > 0.5, "{}", over["estimateRelErrP50"]);
    assert!(
        calibrated["estimateRelErrP50"] <= exact["estimateRelErrP50"] + 0.02,
        "{} vs {}",
        calibrated["estimateRelErrP50"],
        exact["estimateRelErrP50"]
    );
    for k in ["queueDelayP50", "queueDelayP95", "makespan"] {
        assert_eq!(exact[k], calibrated[k], "{k}");
        assert_eq!(exact[k], over[k], "{k}");
    }
}

/// `utilizationArrivals`: GPU-seconds in use between the first and the last arrival over
/// the cluster's GPU-seconds then (the makespan-based `utilization` is set by the last job).
#[test]
fn utilization_over_the_arrivals_span_counts_only_that_span() {
    let c = cl("pcie4", 1);
    let one = one_task_job;
    // 4 GPUs busy 0..50, then idle; the last arrival at 100 runs 1000 s on 2 GPUs.
    let jobs = vec![one(0, 0.0, 50.0, 4), one(1, 100.0, 1000.0, 2)];
    for p in POLICIES {
        let s = simulate(&c, &jobs, p, 1).unwrap().summary();
        assert!(
            (s["utilizationArrivals"] - 0.5).abs() < 1e-9,
            "{p}: {}",
            s["utilizationArrivals"]
        );
        // 200 + 2000 GPU-s over 4 GPUs × 1100 s.
        assert!((s["utilization"] - 2200.0 / 4400.0).abs() < 1e-9, "{p}");
    }
}

/// The queueing flags: a reservation bound implies backfill; bad values name the flag.
#[test]
fn queueing_flags_are_checked_and_a_reservation_implies_backfill() {
    let q = SimOptions::queueing_of(false, None, Some(32), "declared:2", 32, "off").unwrap();
    assert!(q.backfill);
    assert_eq!(
        q.reserve,
        Some(Policy {
            wait_bound_ms: u64::MAX,
            min_gpus: 32
        })
    );
    assert_eq!(q.limit, reserve::Limit::Declared(2.0, 2.0));
    let w = SimOptions::queueing_of(false, Some(600), None, "learned", 8, "off").unwrap();
    assert_eq!(
        w.reserve.map(|p| (p.wait_bound_ms, p.min_gpus)),
        Some((600_000, u32::MAX))
    );
    let plain = SimOptions::queueing_of(false, None, None, "declared", 32, "off").unwrap();
    assert_eq!(plain, Queueing::default());
    for (e, want) in [("guess", "--expected-end"), ("declared:-1", "positive")] {
        match SimOptions::queueing_of(false, None, None, e, 32, "off") {
            Err(SimError::Usage(m)) => assert!(m.contains(want), "{m}"),
            other => panic!("{e}: {other:?}"),
        }
    }
    assert!(matches!(
        SimOptions::queueing_of(true, None, None, "declared", 0, "off"),
        Err(SimError::Usage(m)) if m.contains("--big-gpus")
    ));
    let r = SimOptions::queueing_of(false, None, None, "declared", 32, "1-3").unwrap();
    assert_eq!(r.run_limits, Some((1.0, 3.0)));
    assert_eq!(
        SimOptions::queueing_of(false, None, None, "declared", 32, "2")
            .unwrap()
            .run_limits,
        Some((2.0, 2.0))
    );
    for bad in ["0.5", "3-1", "x", "1-", "nan"] {
        assert!(
            matches!(SimOptions::queueing_of(false, None, None, "declared", 32, bad), Err(SimError::Usage(m)) if m.contains("--run-limits")),
            "{bad}"
        );
    }
}

/// The drain term (issue 27, fifth round): with declared run times, a long task goes beside
/// long work rather than onto the node whose work ends soon, so that node drains whole for
/// the 8-GPU job behind it. Node X runs a 1 h job, node Y a 10 h one (each holds 4 GPUs; the
/// CPU they take keeps them apart); a 9 h job of 4 GPUs then fits on either: by the packing
/// order alone it takes X (less free CPU) and the 8-GPU job waits for it, 9 h; with the
/// limits declared it takes Y and the 8-GPU job starts when X's hour is over.
#[test]
fn declared_run_times_keep_work_that_ends_together_on_one_node() {
    let c = cl("pcie8", 2);
    let cpu = c.nodes[0].cpu_total;
    let job = |id: usize, arrival: f64, duration: f64, gpus: u32, cpu: u32| Job {
        id,
        arrival,
        duration,
        tasks: vec![Task {
            gpus,
            cpu,
            mem_mb: 1024,
        }],
    };
    let jobs = vec![
        job(0, 0.0, 3600.0, 4, cpu / 2 + 1),
        job(1, 1.0, 36_000.0, 4, cpu / 2),
        job(2, 3.0, 32_400.0, 4, 1),
        job(3, 4.0, 100.0, 8, 1),
    ];
    let run = |limits: Option<(f64, f64)>| {
        let mode = Queueing {
            run_limits: limits,
            ..Queueing::default()
        };
        simulate_queueing(&c, &jobs, "gpuam", 1, 300, mode).unwrap()
    };
    let without = run(None);
    assert!(
        (without.delays[3] - (3.0 + 32_400.0 - 4.0)).abs() < 1e-6,
        "without limits the 9 h job shares X and the 8-GPU job waits for it: {}",
        without.delays[3]
    );
    let with = run(Some((1.0, 1.0)));
    assert!(
        (with.delays[3] - (3600.0 - 4.0)).abs() < 1e-6,
        "with limits X drains after its hour: {}",
        with.delays[3]
    );
    // Declared limits change where work goes, never whether it runs or its tier.
    assert_eq!(with.multi_ideal, without.multi_ideal);
    assert!(with.delays[..3].iter().all(|d| *d == 0.0), "{:?}", with.delays);
}
