//! Queues, fair share and preemption on a real `gpuam rm` (issue 16), with real AMs and
//! real task processes. Each task records its runs (job, index, attempt, host, GPUs, start
//! and end in ms) in `runs.log`; a task runs until its queue's release file exists, and
//! ends early (checkpoint-and-exit) when its `GPUAM_PREEMPT_FILE` appears. Times are µs.
//!
//! - `a_queue_below_its_share_takes_back_its_weighted_share`: 8 GPUs, queues A (weight 3)
//!   and B (weight 1). B fills the cluster (a gang of 4 and four single jobs), A submits a
//!   job of 8 one-GPU tasks: within the preemption deadline plus a few seconds A holds 6 ± 1 GPUs and
//!   B the rest, and it stays so; the gang lost all its containers or none; B's preempted
//!   tasks run again later and finish (taskRetryCount 0: preemption uses none); no GPU was
//!   held by two tasks at once; unknown queues are refused at submit.
//! - `a_queue_whose_demand_comes_in_steps_still_reaches_its_share`: the same B; A wants 4,
//!   then 4 more: after the first step B may hold only its gang, over its share by 2; the
//!   gang goes whole and B's own single jobs take back what it frees beyond that, so A
//!   ends at 6 ± 1 and B at the rest; every task of both finishes.
//! - `a_higher_priority_job_preempts_within_its_queue`: one queue that allows it; a
//!   priority-10 job takes two GPUs from a priority-0 job, a same-priority job waiting
//!   before it does not get them.
//! - `gpu_shares_past_a_queues_share_are_taken_back`: 8 GPUs, queues A and B of equal
//!   weight (RELIABILITY §2e, D3). A holds every GPU through `gpu: 0.99` tasks (7.92 GPUs);
//!   B asks four whole GPUs: three of A's shares are taken back (a fourth would leave A at
//!   3.96, below its 4) and B runs three tasks; the queues read 4.95 and 3; all finish.
//! - `tiny_shares_beside_large_ones_do_not_switch_preemption_off`: one node of 4 GPUs
//!   (third pass, F1): A holds 4 × 0.97 and 8 × 0.01; B asks two GPUs: every share of a
//!   GPU goes together, B runs, A keeps its share of 2; all finish.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::*;

/// Tests here start many processes each: one at a time on small machines.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

const GRACE_SEC: u64 = 2;

/// Two nodes of 4 GPUs.
const CLUSTER: &str = "nodes:\n  - host: n1\n    cpu: 16\n    memoryMB: 16000\n    gpus: 4\n  - host: n2\n    cpu: 16\n    memoryMB: 16000\n    gpus: 4\n";

/// One node of 4 GPUs.
const ONE_NODE: &str = "nodes:\n  - host: n1\n    cpu: 16\n    memoryMB: 16000\n    gpus: 4\n";

/// Faster AM retries than the defaults, so the test's waits are short.
const ENV: &[(&str, &str)] = &[
    ("GPUAM__AM__NOT_AVAILABLE_RETRY_MIN_MS", "200"),
    ("GPUAM__AM__NOT_AVAILABLE_RETRY_MAX_MS", "800"),
    ("GPUAM__AM__NODE_REFRESH_INTERVAL_MS", "500"),
    ("GPUAM_DASHBOARD_LINGER_SEC", "0"),
];

/// A job of `n` one-GPU tasks in `queue` that run until `release-<release>` exists.
fn job(rm: &Rm, name: &str, queue: &str, priority: i32, gang: bool, n: u32, release: &str) -> std::path::PathBuf {
    job_of(rm, name, queue, priority, gang, n, "1", release)
}

/// [`job`] with `gpu` GPUs per task (`0.99`: a share of one).
#[allow(clippy::too_many_arguments)]
fn job_of(
    rm: &Rm,
    name: &str,
    queue: &str,
    priority: i32,
    gang: bool,
    n: u32,
    gpu: &str,
    release: &str,
) -> std::path::PathBuf {
    let root = rm.root().display().to_string();
    let rec = "$GPUAM_JOB $GPUAM_TASK_INDEX $GPUAM_ATTEMPT $GPUAM_HOST $CUDA_VISIBLE_DEVICES";
    let script = format!(
        "R={root}/runs.log; t() {{ echo ${{EPOCHREALTIME/./}}; }}; echo \"start {rec} $(t)\" >> $R; \
         trap 'echo \"end {rec} $(t) term\" >> $R; exit 143' TERM; \
         while [ ! -e {root}/release-{release} ]; do \
           if [ -e \"$GPUAM_PREEMPT_FILE\" ]; then echo \"end {rec} $(t) notice\" >> $R; exit 0; fi; \
           sleep 0.1; \
         done; echo \"end {rec} $(t) done\" >> $R"
    );
    rm.write_job(
        name,
        &format!(
            "name: {name}\nqueue: {queue}\npriority: {priority}\ngang: {gang}\ntaskRoles:\n  worker:\n    instances: {n}\n    \
             taskRetryCount: 0\n    resourcePerInstance: {{cpu: 1, memoryMB: 256, gpu: {gpu}}}\n    commands:\n      - {}\n",
            sq(&script)
        ),
    )
}

/// One run of a task, from `runs.log`.
#[derive(Clone, Debug)]
struct Run {
    job: String,
    index: u32,
    attempt: u32,
    host: String,
    gpus: Vec<u32>,
    start: u64,
    end: Option<(u64, String)>,
}

fn runs(rm: &Rm) -> Vec<Run> {
    let mut out: BTreeMap<(String, u32, u32), Run> = BTreeMap::new();
    for line in rm.lines("runs.log") {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 7 {
            continue;
        }
        let (Ok(index), Ok(attempt), Ok(at)) = (f[2].parse(), f[3].parse(), f[6].parse::<u64>()) else {
            panic!("a bad line in runs.log: {line}");
        };
        let key = (f[1].to_string(), index, attempt);
        match f[0] {
            "start" => {
                out.insert(
                    key.clone(),
                    Run {
                        job: key.0.clone(),
                        index: key.1,
                        attempt: key.2,
                        host: f[4].to_string(),
                        gpus: f[5].split(',').map(|g| g.parse().unwrap()).collect(),
                        start: at,
                        end: None,
                    },
                );
            }
            "end" => {
                if let Some(r) = out.get_mut(&key) {
                    r.end = Some((at, f.get(7).unwrap_or(&"").to_string()));
                }
            }
            _ => {}
        }
    }
    out.into_values().collect()
}

/// One run's hold of a GPU: (start, end, which task).
type Span = (u64, u64, String);

/// No GPU of a host in two runs at once (every run ended).
fn assert_no_gpu_held_twice(runs: &[Run]) {
    let mut per_gpu: BTreeMap<(String, u32), Vec<Span>> = BTreeMap::new();
    for r in runs {
        let (end, _) = r.end.clone().unwrap_or_else(|| panic!("run without an end: {r:?}"));
        for g in &r.gpus {
            per_gpu.entry((r.host.clone(), *g)).or_default().push((
                r.start,
                end,
                format!("{}/{} attempt {}", r.job, r.index, r.attempt),
            ));
        }
    }
    for ((host, gpu), mut spans) in per_gpu {
        spans.sort();
        for w in spans.windows(2) {
            assert!(
                w[1].0 >= w[0].1,
                "GPU {gpu} of {host} held twice: {} [{}, {}] and {} from {}",
                w[0].2,
                w[0].0,
                w[0].1,
                w[1].2,
                w[1].0
            );
        }
    }
}

/// GPUs each queue holds now, fractional with shares (the cluster page's JSON).
fn queue_use_f(rm: &Rm) -> BTreeMap<String, f64> {
    let v = rm.get_json("/ws/v1/cluster/overview").expect("overview");
    v["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| (q["name"].as_str().unwrap().to_string(), q["usedGpus"].as_f64().unwrap()))
        .collect()
}

/// GPUs each queue holds now (the cluster page's JSON).
fn queue_use(rm: &Rm) -> BTreeMap<String, u64> {
    let v = rm.get_json("/ws/v1/cluster/overview").expect("overview");
    v["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| (q["name"].as_str().unwrap().to_string(), q["usedGpus"].as_u64().unwrap()))
        .collect()
}

fn running(runs: &[Run], job: &str) -> usize {
    runs.iter().filter(|r| r.job == job && r.end.is_none()).count()
}

/// Tasks of queue `q` (jobs named from its letter) running now.
fn live(r: &[Run], q: char) -> u64 {
    r.iter().filter(|x| x.job.starts_with(q) && x.end.is_none()).count() as u64
}

/// Generous: a busy 2-core machine; B's jobs never end by themselves, so only preemption
/// can make the split.
const SPLIT_DEADLINE: Duration = Duration::from_secs(GRACE_SEC + 90);

/// B fills the 8 GPUs: a gang of 4 (`bgang`), then four single jobs (`b1`..`b4`); all run
/// until `release-b` exists. Their submissions.
fn fill_with_b(rm: &Rm) -> Vec<(&'static str, Submission)> {
    let mut subs = vec![("bgang", rm.submit(&job(rm, "bgang", "b", 0, true, 4, "b")))];
    wait_for(Duration::from_secs(60), "B's gang to run", || {
        (running(&runs(rm), "bgang") == 4).then_some(())
    });
    for i in 1..=4 {
        let name = format!("b{i}");
        subs.push(("b", rm.submit(&job(rm, &name, "b", 0, false, 1, "b"))));
    }
    wait_for(Duration::from_secs(60), "B to hold all 8 GPUs", || {
        (live(&runs(rm), 'b') == 8).then_some(())
    });
    subs
}

/// Waits until A holds 6 ± 1 GPUs and B the rest, each GPU under a running task of its
/// queue: (A's, B's).
fn wait_for_split(rm: &Rm) -> (u64, u64) {
    wait_for(SPLIT_DEADLINE, "A to hold 6 ± 1 GPUs and B the rest", || {
        let u = queue_use(rm);
        let (a, b) = (u["a"], u["b"]);
        let r = runs(rm);
        ((5..=7).contains(&a) && a + b == 8 && live(&r, 'a') == a && live(&r, 'b') == b).then_some((a, b))
    })
}

/// The split stays for 3 s (no flapping).
fn assert_split_stays(rm: &Rm) {
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let u = queue_use(rm);
        assert!((5..=7).contains(&u["a"]) && u["a"] + u["b"] == 8, "{u:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// B's gang lost all its first containers or none; nothing of A was preempted.
fn assert_gang_whole_and_a_untouched(r: &[Run]) {
    let gang_first: Vec<&Run> = r.iter().filter(|x| x.job == "bgang" && x.attempt == 1).collect();
    let ended = gang_first.iter().filter(|x| x.end.is_some()).count();
    assert!(ended == 0 || ended == 4, "a gang preempted in part: {gang_first:?}");
    assert!(
        r.iter().filter(|x| x.job.starts_with('a')).all(|x| x.attempt == 1),
        "nothing of A was preempted"
    );
}

#[test]
fn a_queue_below_its_share_takes_back_its_weighted_share() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let settings = format!(
        "  preemption_grace_sec: {GRACE_SEC}\n  queues:\n    a: {{weight: 3}}\n    b: {{weight: 1, users: [itest]}}\n"
    );
    let rm = Rm::start_with_settings(CLUSTER, &settings, ENV);

    // A queue with users takes no job of anyone else: 403 naming the queue and its users.
    let out = rm
        .gpuam()
        .arg("submit")
        .arg(job(&rm, "intruder", "b", 0, false, 1, "x"))
        .arg("--rm")
        .arg(&rm.url)
        .env("GPUAM_TOKEN", &rm.other_token)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(77), "not permitted (exit 77): {err}");
    assert!(
        err.contains("QUEUE_FORBIDDEN") || (err.contains("`b`") && err.contains("itest")),
        "the refusal names the queue and its users: {err}"
    );

    // Nor is anyone else told when a job of theirs would start there (`gpuam plan --rm`):
    // that queue's state is none of theirs.
    let plan_as = |token: &str, name: &str| {
        let out = rm
            .gpuam()
            .arg("plan")
            .arg(job(&rm, name, "b", 0, false, 1, "x"))
            .args(["--rm", &rm.url, "--json"])
            .env("GPUAM_TOKEN", token)
            .output()
            .unwrap();
        let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        (plan, String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (plan, err) = plan_as(&rm.other_token, "intruder");
    assert!(plan.get("startEstimate").is_none(), "{plan}");
    assert!(
        err.contains("no start estimate") && err.contains("`b`"),
        "the refusal names the queue: {err}"
    );
    let (plan, err) = plan_as(&rm.user_token, "mine");
    assert!(plan.get("startEstimate").is_some(), "{plan} {err}");

    // Unknown queues are refused at submit, naming the queues there are.
    let bad = job(&rm, "nowhere", "research", 0, false, 1, "x");
    let out = rm.run_job(&bad, Duration::from_secs(30));
    assert_ne!(out.code, 0);
    assert!(
        out.stderr.contains("unknown queue `research`") && out.stderr.contains("a, b"),
        "{}",
        out.stderr
    );

    let mut subs = fill_with_b(&rm);
    assert_eq!(queue_use(&rm).get("b"), Some(&8));

    // A asks for 8 more, in one job of eight tasks (not a gang), so that the RM sees A's
    // whole demand in one report (demand that comes in steps is the next test's).
    let asked = Instant::now();
    subs.push(("a", rm.submit(&job(&rm, "a", "a", 0, false, 8, "a"))));
    let split = wait_for_split(&rm);
    eprintln!("A {} / B {} after {:?}", split.0, split.1, asked.elapsed());
    assert_split_stays(&rm);
    let overview = rm.get_json("/ws/v1/cluster/overview").unwrap();
    let b = overview["queues"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["name"] == "b")
        .unwrap()
        .clone();
    assert_eq!(b["preempted"].as_u64(), Some(8 - split.1), "{b}");
    assert!((b["deservedGpus"].as_f64().unwrap() - 2.0).abs() < 1e-6, "{b}");

    assert_gang_whole_and_a_untouched(&runs(&rm));

    // A finishes; B's preempted tasks run again and finish.
    std::fs::write(rm.path("release-a"), "").unwrap();
    wait_for(Duration::from_secs(60), "B's preempted tasks to run again", || {
        let r = runs(&rm);
        let again = r.iter().filter(|x| x.job.starts_with('b') && x.attempt > 1).count();
        (again as u64 == 8 - split.1 && r.iter().filter(|x| x.end.is_none()).count() == 8).then_some(())
    });
    std::fs::write(rm.path("release-b"), "").unwrap();
    for (what, s) in subs {
        let out = s.wait(Duration::from_secs(60));
        assert_eq!(out.code, 0, "{what}: {}\n{}\n{}", out.stdout, out.stderr, rm.logs());
    }
    let r = runs(&rm);
    let preempted = preempted(&r);
    assert_eq!(preempted.len() as u64, 8 - split.1, "{preempted:?}");
    assert!(preempted.iter().all(|x| x.job.starts_with('b')));
    for p in &preempted {
        let again = r
            .iter()
            .find(|x| x.job == p.job && x.index == p.index && x.attempt > p.attempt)
            .unwrap_or_else(|| panic!("{p:?} never ran again"));
        assert_eq!(again.end.as_ref().map(|e| e.1.as_str()), Some("done"));
    }
    assert_no_gpu_held_twice(&r);
    rm.assert_all_free(Duration::from_secs(20));
}

#[test]
fn a_queue_whose_demand_comes_in_steps_still_reaches_its_share() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let settings =
        format!("  preemption_grace_sec: {GRACE_SEC}\n  queues:\n    a: {{weight: 3}}\n    b: {{weight: 1}}\n");
    let rm = Rm::start_with_settings(CLUSTER, &settings, ENV);
    let mut subs = fill_with_b(&rm);

    // Step one: A wants 4, and deserves them.
    subs.push(("a1", rm.submit(&job(&rm, "a1", "a", 0, false, 4, "a"))));
    wait_for(SPLIT_DEADLINE, "A to hold 4 GPUs", || {
        let u = queue_use(&rm);
        (u["a"] == 4 && live(&runs(&rm), 'a') == 4).then_some(())
    });
    // Step two: A wants 4 more and deserves 6. Whatever step one took, B is over its share
    // by 2 and A is owed 2: B's gang (if step one left it) goes whole and B's own singles
    // take back the 2 GPUs beyond that.
    let asked = Instant::now();
    subs.push(("a2", rm.submit(&job(&rm, "a2", "a", 0, false, 4, "a"))));
    let split = wait_for_split(&rm);
    eprintln!(
        "A {} / B {} {:?} after the second step",
        split.0,
        split.1,
        asked.elapsed()
    );
    assert_split_stays(&rm);
    assert_gang_whole_and_a_untouched(&runs(&rm));

    release_all(&rm, subs);
    let r = runs(&rm);
    for job in ["bgang", "b1", "b2", "b3", "b4", "a1", "a2"] {
        let tasks: BTreeSet<u32> = r
            .iter()
            .filter(|x| x.job == job && x.end.as_ref().is_some_and(|e| e.1 == "done"))
            .map(|x| x.index)
            .collect();
        let want = if job.len() == 2 && job.starts_with('b') { 1 } else { 4 };
        assert_eq!(tasks.len(), want, "{job} finished every task: {r:?}");
    }
    assert_no_gpu_held_twice(&r);
    rm.assert_all_free(Duration::from_secs(20));
}

#[test]
fn a_higher_priority_job_preempts_within_its_queue() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let settings =
        format!("  preemption_grace_sec: {GRACE_SEC}\n  queues:\n    q: {{weight: 1, priorityPreemption: true}}\n");
    let rm = Rm::start_with_settings(ONE_NODE, &settings, ENV);
    let low = rm.submit(&job(&rm, "low", "q", 0, false, 4, "low"));
    wait_for(Duration::from_secs(60), "the low job to fill the node", || {
        (running(&runs(&rm), "low") == 4).then_some(())
    });
    // Same priority: waits, takes nothing.
    let mid = rm.submit(&job(&rm, "mid", "q", 0, false, 1, "mid"));
    std::thread::sleep(Duration::from_secs(GRACE_SEC + 1));
    assert_eq!(running(&runs(&rm), "low"), 4, "a same-priority job preempts nothing");
    let high = rm.submit(&job(&rm, "high", "q", 10, false, 2, "high"));
    wait_for(
        Duration::from_secs(GRACE_SEC + 90),
        "the high job to run on two GPUs",
        || (running(&runs(&rm), "high") == 2).then_some(()),
    );
    let r = runs(&rm);
    assert_eq!(running(&r, "low"), 2, "{r:?}");
    assert!(
        r.iter().all(|x| x.job != "mid"),
        "mid must not take the room made for high"
    );
    std::fs::write(rm.path("release-high"), "").unwrap();
    std::fs::write(rm.path("release-low"), "").unwrap();
    std::fs::write(rm.path("release-mid"), "").unwrap();
    for (what, s) in [("low", low), ("mid", mid), ("high", high)] {
        let out = s.wait(Duration::from_secs(60));
        assert_eq!(out.code, 0, "{what}: {}\n{}\n{}", out.stdout, out.stderr, rm.logs());
    }
    let r = runs(&rm);
    let preempted = r
        .iter()
        .filter(|x| x.job == "low" && x.attempt == 1 && x.end.as_ref().is_some_and(|e| e.1 != "done"))
        .count();
    assert_eq!(preempted, 2, "{r:?}");
    assert_no_gpu_held_twice(&r);
    rm.assert_all_free(Duration::from_secs(20));
}

#[test]
fn gpu_shares_past_a_queues_share_are_taken_back() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let settings = equal_queues();
    let rm = Rm::start_with_settings(CLUSTER, &settings, ENV);
    let a = rm.submit(&job_of(&rm, "a", "a", 0, false, 8, "0.99", "a"));
    wait_for(Duration::from_secs(60), "A to hold every GPU through shares", || {
        (running(&runs(&rm), "a") == 8).then_some(())
    });
    assert!((queue_use_f(&rm)["a"] - 7.92).abs() < 1e-9, "{:?}", queue_use_f(&rm));
    let b = rm.submit(&job(&rm, "b", "b", 0, false, 4, "b"));
    wait_for(SPLIT_DEADLINE, "B to run three tasks on A's freed GPUs", || {
        let r = runs(&rm);
        (running(&r, "b") == 3 && running(&r, "a") == 5).then_some(())
    });
    // Nothing more goes: A stays at 4.95 (above its 4), B at 3.
    std::thread::sleep(Duration::from_secs(GRACE_SEC + 1));
    let u = queue_use_f(&rm);
    assert!((u["a"] - 4.95).abs() < 1e-9 && (u["b"] - 3.0).abs() < 1e-9, "{u:?}");
    let r = runs(&rm);
    assert_eq!(running(&r, "a"), 5, "{r:?}");
    release_all(&rm, [("a", a), ("b", b)]);
    let r = runs(&rm);
    let preempted = preempted(&r);
    assert_eq!(preempted.len(), 3, "{preempted:?}");
    assert!(preempted.iter().all(|x| x.job == "a"), "{preempted:?}");
    assert_no_gpu_held_twice(&r);
    rm.assert_all_free(Duration::from_secs(20));
}

#[test]
fn a_queue_waiting_half_a_gpu_is_made_room_for() {
    // Fourth pass, F2: one node of 4 GPUs, A and B of equal weight. B holds every GPU; A,
    // holding nothing, waits one `gpu: 0.5` task. A share is only placed on a whole free
    // GPU, so A is owed one: one of B's tasks is taken back and A's share runs there.
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rm = Rm::start_with_settings(ONE_NODE, &equal_queues(), ENV);
    let b = rm.submit(&job(&rm, "b", "b", 0, false, 4, "b"));
    wait_for(Duration::from_secs(60), "B to hold every GPU", || {
        (running(&runs(&rm), "b") == 4).then_some(())
    });
    let a = rm.submit(&job_of(&rm, "a", "a", 0, false, 1, "0.5", "a"));
    wait_for(SPLIT_DEADLINE, "A's half GPU to run on one B gave back", || {
        let r = runs(&rm);
        (running(&r, "a") == 1 && running(&r, "b") == 3).then_some(())
    });
    // Nothing more goes: B at its share of 3 (A deserves the whole GPU its share holds).
    std::thread::sleep(Duration::from_secs(GRACE_SEC + 1));
    let r = runs(&rm);
    assert_eq!((running(&r, "a"), running(&r, "b")), (1, 3), "{r:?}");
    release_all(&rm, [("a", a), ("b", b)]);
    let r = runs(&rm);
    let preempted = preempted(&r);
    assert_eq!(preempted.len(), 1, "{preempted:?}");
    assert!(preempted.iter().all(|x| x.job == "b"), "{preempted:?}");
    assert_no_gpu_held_twice(&r);
    rm.assert_all_free(Duration::from_secs(20));
}

#[test]
fn tiny_shares_beside_large_ones_do_not_switch_preemption_off() {
    // Third pass, F1: one node of 4 GPUs, A and B of equal weight. A holds 4 × 0.97, then
    // 8 × 0.01 beside them (3.96 GPUs, its share 2); B asks two whole GPUs. Every share of
    // a GPU goes together: at least one GPU is freed and B runs, A keeps its share.
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let settings = equal_queues();
    let rm = Rm::start_with_settings(ONE_NODE, &settings, ENV);
    let big = rm.submit(&job_of(&rm, "big", "a", 0, false, 4, "0.97", "a"));
    wait_for(Duration::from_secs(60), "A's 0.97 shares to run", || {
        (running(&runs(&rm), "big") == 4).then_some(())
    });
    let tiny = rm.submit(&job_of(&rm, "tiny", "a", 0, false, 8, "0.01", "a"));
    wait_for(Duration::from_secs(60), "A's 0.01 shares to run", || {
        (running(&runs(&rm), "tiny") == 8).then_some(())
    });
    assert!((queue_use_f(&rm)["a"] - 3.96).abs() < 1e-9, "{:?}", queue_use_f(&rm));
    let b = rm.submit(&job(&rm, "b", "b", 0, false, 2, "b"));
    wait_for(SPLIT_DEADLINE, "B to run on a GPU freed of every share", || {
        (running(&runs(&rm), "b") >= 1).then_some(())
    });
    std::thread::sleep(Duration::from_secs(GRACE_SEC + 1));
    let u = queue_use_f(&rm);
    assert!(
        u["a"] >= 2.0 - 1e-9 && u["b"] >= 1.0 - 1e-9,
        "A never below its share: {u:?}"
    );
    release_all(&rm, [("big", big), ("tiny", tiny), ("b", b)]);
    let r = runs(&rm);
    assert!(preempted(&r).iter().all(|x| x.job != "b"), "{r:?}");
    // (Shares of one GPU run side by side here: `assert_no_gpu_held_twice` is for whole GPUs.)
    rm.assert_all_free(Duration::from_secs(20));
}

/// Queues `a` and `b` of equal weight, with this file's notice period.
fn equal_queues() -> String {
    format!("  preemption_grace_sec: {GRACE_SEC}\n  queues:\n    a: {{weight: 1}}\n    b: {{weight: 1}}\n")
}

/// The runs that ended other than by finishing (taken back).
fn preempted(r: &[Run]) -> Vec<&Run> {
    r.iter()
        .filter(|x| x.end.as_ref().is_some_and(|(_, why)| why != "done"))
        .collect()
}

/// Lets every task of both queues finish, and each submission end with exit 0.
fn release_all<'a>(rm: &Rm, subs: impl IntoIterator<Item = (&'a str, Submission)>) {
    std::fs::write(rm.path("release-a"), "").unwrap();
    std::fs::write(rm.path("release-b"), "").unwrap();
    for (what, s) in subs {
        let out = s.wait(Duration::from_secs(90));
        assert_eq!(out.code, 0, "{what}: {}\n{}\n{}", out.stdout, out.stderr, rm.logs());
    }
}
