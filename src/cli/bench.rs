//! `gpuam bench select`: the select pipeline on the scenario the original AM was
//! measured on (issue 2), printing median and p99 per call, and the time to plan a
//! 1,000-task job on 1,000 nodes. `gpuam bench job` and `gpuam bench cluster`: one
//! job, or many jobs at once, through the real RM, AM processes and executor.
//! Figures go to docs/BENCHMARKS.md.

use std::time::{Duration, Instant};

use crate::cluster::ClusterView;
use crate::config::SelectSettings;
use crate::exit;
use crate::resources::Resources;
use crate::select::{plan_job, JobDemand, Outcome, Selector, TaskAsk, TaskShape};
use crate::spec::{JobSpec, PortRequest, TaskResources, TaskRole};

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
        ..Default::default()
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

/// `max_run_sec`: the task declares this run time, and every busy node of the cluster a drain
/// 0–10 h away (the drain term's path, issue 27); `None`: neither.
pub fn select_bench(sizes: &[usize], iterations: usize, seed: u64, max_run_sec: Option<u64>) -> i32 {
    let settings = SelectSettings {
        seed: Some(seed),
        ..SelectSettings::default()
    };
    println!("gpuam bench select (seed {seed}, {iterations} timed selects per row, cluster unchanged between calls)");
    if let Some(sec) = max_run_sec {
        println!("the task declares maxRunSec {sec}; busy nodes drain 0-10 h from now (the drain term)");
    }
    println!(
        "{:>8} {:>6} {:>12} {:>12} {:>12}",
        "nodes", "ports", "median", "p99", "max"
    );
    let mut medians: Vec<(usize, bool, Duration)> = Vec::new();
    for &n in sizes {
        let mut nodes = crate::cluster::synthetic::bench_cluster(n, seed);
        let now_ms = crate::protocol::now_ms();
        if max_run_sec.is_some() {
            for (i, node) in nodes.iter_mut().enumerate() {
                let busy = node.used().gpu_count() > 0;
                node.drain_by_ms = Some(if busy {
                    now_ms + (i as u64 * 7919 % 600) * 60_000
                } else {
                    0
                });
            }
        }
        let selector = Selector::new(ClusterView::new(nodes), settings.clone());
        selector.set_clock(now_ms);
        for ports in [false, true] {
            let r = request(ports);
            let mut demand = JobDemand::new(true);
            demand.add_waiting(TaskShape::of(&r), 1);
            let ask = TaskAsk {
                max_run_sec,
                ..TaskAsk::plain("worker", &r, 1)
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
            medians.push((n, ports, percentile(&times, 0.5)));
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
    // Ratios between sizes, from this one run (the machine's noise cancels out in part).
    let median_of = |n: usize, ports: bool| medians.iter().find(|m| m.0 == n && m.1 == ports).map(|m| m.2);
    for ports in [false, true] {
        for w in sizes.windows(2) {
            if let (Some(a), Some(b)) = (median_of(w[0], ports), median_of(w[1], ports)) {
                println!(
                    "ratio of medians {} / {} nodes ({} ports): {:.2}",
                    w[1],
                    w[0],
                    if ports { 2 } else { 0 },
                    b.as_secs_f64() / a.as_secs_f64().max(1e-12)
                );
            }
        }
    }
    // A 1,000-task job, 2 GPUs each, on 1,000 nodes, each choice booked before the next.
    let nodes = crate::cluster::synthetic::bench_cluster(1000, seed);
    let selector = Selector::new(ClusterView::new(nodes), settings);
    let job = JobSpec {
        name: "bench".into(),
        gang: false,
        task_roles: vec![TaskRole {
            name: "worker".into(),
            instances: 1000,
            resources: request(false),
            commands: vec!["true".into()],
            ..Default::default()
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

/// Peak resident memory (VmHWM) of a process, in MiB, from /proc.
fn peak_rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// The pid of the AM process of `app_id` (its command line names the app id).
fn am_pid(app_id: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let cmd = String::from_utf8_lossy(&cmd);
        (cmd.contains("\0am\0") && cmd.contains(app_id)).then_some(pid)
    })
}

/// A standalone RM (in-process executor; its state in memory when `in_memory`, else in
/// its SQLite store under `work`) on `nodes` empty 8-GPU nodes.
async fn start_bench_rm(
    nodes: usize,
    jobs: usize,
    seed: u64,
    work: &std::path::Path,
    in_memory: bool,
) -> Option<crate::rm::RmHandle> {
    let mut cluster = crate::cluster::synthetic::bench_cluster(nodes, seed);
    for n in &mut cluster {
        n.set_used(Resources::default());
    }
    let mut opts = crate::rm::RmOptions::new(
        cluster,
        std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        work.to_path_buf(),
    );
    if in_memory {
        opts.state_dir = None;
    }
    // The admin submits every job of the bench: the per-user and total limits on
    // unfinished applications must let them all in.
    opts.limits.max_apps = opts.limits.max_apps.max(jobs);
    opts.limits.max_apps_per_user = opts.limits.max_apps_per_user.max(jobs);
    match crate::rm::start(opts).await {
        Ok(h) => Some(h),
        Err(e) => {
            eprintln!("error: cannot start the RM: {e:#}");
            None
        }
    }
}

/// `gpuam bench job`: a job of `tasks` one-GPU tasks that exit at once, on a cluster of
/// `nodes` 8-GPU nodes, through the real RM, AM process and executor. Prints the time
/// from submit to all tasks launched and to the job's end, and the AM's and RM's peak
/// memory.
pub async fn job_bench(tasks: u32, nodes: usize, seed: u64) -> i32 {
    use crate::am::rm_client::RmClient;
    use crate::protocol::SubmitApplication;
    // The AM keeps its status API up briefly after the job so the final figures can be
    // read; it inherits this from the RM, which is this process.
    std::env::set_var("GPUAM_DASHBOARD_LINGER_SEC", "5");
    let work = std::env::temp_dir().join(format!("gpuam-bench-job-{}", std::process::id()));
    let rm = match start_bench_rm(nodes, 1, seed, &work, false).await {
        Some(h) => h,
        None => return exit::INTERNAL,
    };
    let spec = format!(
        "name: bench-{tasks}\ntaskRoles:\n  worker:\n    instances: {tasks}\n    resourcePerInstance: {{cpu: 1, memoryMB: 1024, gpu: 1}}\n    commands: [\"true\"]\n"
    );
    let client = RmClient::new(&rm.base_url()).with_user_token(Some(rm.admin_token().to_string()));
    let http = crate::tls::http_client();
    let started = Instant::now();
    let submit_ms = crate::protocol::now_ms();
    let app = match client.new_application().await {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return exit::INTERNAL;
        }
    };
    if let Err(e) = client
        .submit(&SubmitApplication {
            application_id: app.application_id.clone(),
            job_spec: spec,
            job_spec_name: Some("bench".into()),
            dashboard_listen: None,
            job_token: None,
        })
        .await
    {
        eprintln!("error: {e}");
        return exit::INTERNAL;
    }
    let id = app.application_id;
    // The AM's snapshot, read as the admin (`None` when it does not answer).
    let snapshot = |tracking_url: &str| {
        let req = http
            .get(format!("{tracking_url}api/v1/snapshot?nodes=0"))
            .bearer_auth(rm.admin_token());
        async move { req.send().await.ok()?.json::<serde_json::Value>().await.ok() }
    };
    let mut am_peak: f64 = 0.0;
    let mut last_snapshot: Option<serde_json::Value> = None;
    let report = loop {
        if started.elapsed() > Duration::from_secs(300) {
            eprintln!("error: the job did not finish within 300 s");
            return exit::INTERNAL;
        }
        if let Some(p) = am_pid(&id).and_then(peak_rss_mib) {
            am_peak = am_peak.max(p);
        }
        let Ok(report) = client.app(&id).await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        if !report.tracking_url.is_empty() {
            last_snapshot = snapshot(&report.tracking_url).await.or(last_snapshot);
        }
        if report.state.is_final() {
            break report;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // The AM lingers: read its final snapshot and memory once more.
    tokio::time::sleep(Duration::from_millis(300)).await;
    if let Some(p) = am_pid(&id).and_then(peak_rss_mib) {
        am_peak = am_peak.max(p);
    }
    last_snapshot = snapshot(&report.tracking_url).await.or(last_snapshot);
    let launched: Vec<u64> = last_snapshot
        .as_ref()
        .and_then(|s| s["tasks"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|t| t["launchedMs"].as_u64())
        .collect();
    let rm_peak = peak_rss_mib(std::process::id()).unwrap_or(0.0);
    let all_free = rm.ledger_all_free();
    rm.shutdown().await;
    let _ = std::fs::remove_dir_all(&work);
    println!("gpuam bench job: {tasks} one-GPU tasks that exit at once, {nodes} nodes × 8 GPUs (seed {seed})");
    println!(
        "  final state            {:?} (exit {:?})",
        report.final_status, report.exit_code
    );
    match launched.iter().max() {
        Some(last) if launched.len() == tasks as usize => println!(
            "  submit → all launched  {:.2} s",
            last.saturating_sub(submit_ms) as f64 / 1000.0
        ),
        _ => println!(
            "  submit → all launched  unknown ({} of {tasks} launch times seen)",
            launched.len()
        ),
    }
    println!(
        "  submit → job finished  {:.2} s",
        report.finished_time.saturating_sub(submit_ms) as f64 / 1000.0
    );
    println!("  AM peak RSS            {am_peak:.1} MiB");
    println!("  RM peak RSS            {rm_peak:.1} MiB (this process: embedded RM + executor + the bench's client)");
    println!("  ledger all free after  {all_free}");
    if all_free && report.exit_code == Some(0) {
        exit::SUCCESS
    } else {
        exit::INTERNAL
    }
}

/// CPU seconds (user + system) a process has used so far, from /proc.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    Some(ticks / if hz > 0 { hz as f64 } else { 100.0 })
}

/// What the bench knows of one job: its id, when it was submitted, its job token, its
/// AM's status API and its tasks' launch times.
struct BenchJob {
    id: String,
    submit_ms: u64,
    token: String,
    tracking_url: String,
    launched: Vec<u64>,
}

/// The launch times of the tasks of the AM at `url` (its status API's task list, read with
/// the job token); `Err`: what the AM answered instead (status and the start of the body).
async fn launch_times(http: &reqwest::Client, url: &str, token: &str, tasks: u32) -> Result<Vec<u64>, String> {
    let r = http
        .get(format!("{url}api/v1/tasks?limit={}", tasks.clamp(1, 1000)))
        .bearer_auth(token)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .map_err(|e| {
            let cause = std::error::Error::source(&e)
                .map(|c| format!(" ({c})"))
                .unwrap_or_default();
            format!(
                "no answer{}: {e}{cause}",
                if e.is_timeout() { " within 10 s" } else { "" }
            )
        })?;
    let status = r.status();
    let body = r.text().await.map_err(|e| format!("{status}, body unreadable: {e}"))?;
    let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| {
        let head: String = body.chars().take(200).collect();
        format!("{status}, not JSON ({e}): {head}")
    })?;
    if !status.is_success() {
        return Err(format!("{status}: {v}"));
    }
    Ok(v["tasks"]
        .as_array()
        .map(|ts| ts.iter().filter_map(|t| t["launchedMs"].as_u64()).collect())
        .unwrap_or_default())
}

/// `gpuam bench cluster`: `jobs` jobs of `tasks` one-GPU `sleep 60` tasks submitted at
/// once by the admin to a standalone RM (in-process executor, state in memory) on
/// `nodes` 8-GPU nodes, each job with its own AM process. Prints submit → all tasks
/// running, containers/s, submit → a job's first task (p50/p99) and the RM's peak memory
/// and CPU, then stops every AM and task it started.
pub async fn cluster_bench(jobs: u32, tasks: u32, nodes: usize, seed: u64) -> i32 {
    let work = std::env::temp_dir().join(format!("gpuam-bench-cluster-{}", std::process::id()));
    let Some(rm) = start_bench_rm(nodes, jobs as usize, seed, &work, true).await else {
        return exit::INTERNAL;
    };
    let mut ids = Vec::new();
    // A signal (Ctrl-C, `timeout`'s SIGTERM) still shuts the RM down with every AM and
    // task it started, rather than leaving the AMs without their RM.
    let code = tokio::select! {
        code = cluster_bench_on(&rm, jobs, tasks, nodes, &mut ids, &work) => code,
        by = super::servers::stop_signal() => {
            eprintln!("error: stopped by {by}; stopping the RM, its AMs and their tasks");
            exit::INTERNAL
        }
    };
    rm.shutdown().await;
    let _ = std::fs::remove_dir_all(&work);
    let left: Vec<&String> = ids.iter().filter(|id| am_pid(id).is_some()).collect();
    if !left.is_empty() {
        eprintln!("error: the AMs of {left:?} still run after the RM's shutdown");
        return exit::INTERNAL;
    }
    code
}

async fn cluster_bench_on(
    rm: &crate::rm::RmHandle,
    jobs: u32,
    tasks: u32,
    nodes: usize,
    ids: &mut Vec<String>,
    work: &std::path::Path,
) -> i32 {
    use crate::am::rm_client::RmClient;
    use crate::protocol::SubmitApplication;
    let client = RmClient::new(&rm.base_url()).with_user_token(Some(rm.admin_token().to_string()));
    let http = crate::tls::http_client();
    let spec = format!(
        "name: bench\ntaskRoles:\n  worker:\n    instances: {tasks}\n    resourcePerInstance: {{cpu: 1, memoryMB: 1024, gpu: 1}}\n    commands: [\"sleep 60\"]\n"
    );
    for _ in 0..jobs {
        match client.new_application().await {
            Ok(a) => ids.push(a.application_id),
            Err(e) => {
                eprintln!("error: {e}");
                return exit::INTERNAL;
            }
        }
    }
    let me = std::process::id();
    let cpu_before = cpu_seconds(me).unwrap_or(0.0);
    let first_submit_ms = crate::protocol::now_ms();
    let started = Instant::now();
    // All submits at once, each on its own connection task.
    let submits: Vec<_> = ids
        .iter()
        .map(|id| {
            let client = client.clone();
            let submit = SubmitApplication {
                application_id: id.clone(),
                job_spec: spec.clone(),
                job_spec_name: Some("bench".into()),
                dashboard_listen: None,
                // The bench reads each AM's status API with its job token, which the AM
                // checks itself (another token would be checked with the RM, whose time
                // is what is measured).
                job_token: Some(format!("{:032x}", rand::random::<u128>())),
            };
            tokio::spawn(async move {
                let at = crate::protocol::now_ms();
                let token = submit.job_token.clone().unwrap_or_default();
                client.submit(&submit).await.map(|_| (at, token))
            })
        })
        .collect();
    let mut state = Vec::new();
    for (id, s) in ids.iter().zip(submits) {
        match s.await {
            Ok(Ok((at, token))) => state.push(BenchJob {
                id: id.clone(),
                submit_ms: at,
                token,
                tracking_url: String::new(),
                launched: Vec::new(),
            }),
            Ok(Err(e)) => {
                eprintln!("error: submit of {id}: {e}");
                return exit::INTERNAL;
            }
            Err(e) => {
                eprintln!("error: submit of {id}: {e}");
                return exit::INTERNAL;
            }
        }
    }
    // Poll each AM's status API (not the RM, whose time is what is measured) for its
    // tasks' launch times, which the AMs record themselves: all AMs at once, each read
    // bounded in time (one slow AM must not hold up the reading of the others), and only
    // the task list (`/api/v1/tasks`), not the whole snapshot with its node view.
    let mut am_cpu: f64 = 0.0;
    let mut complaints: std::collections::HashSet<String> = std::collections::HashSet::new();
    let mut next_progress = Duration::from_secs(5);
    loop {
        if started.elapsed() > Duration::from_secs(600) {
            eprintln!("error: not all tasks ran within 600 s");
            return exit::INTERNAL;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let reads = state
            .iter()
            .enumerate()
            .filter(|(_, j)| j.launched.len() < tasks as usize)
            .map(|(i, job)| {
                let (client, http) = (client.clone(), http.clone());
                let (id, token, mut url) = (job.id.clone(), job.token.clone(), job.tracking_url.clone());
                async move {
                    if url.is_empty() {
                        match client.app(&id).await {
                            Ok(r) if r.state.is_final() => {
                                return (
                                    i,
                                    url,
                                    Err(format!("ended before all its tasks ran: {}", r.diagnostics)),
                                )
                            }
                            Ok(r) => url = r.tracking_url,
                            Err(e) => return (i, url, Ok(Err(format!("(the RM's report) {e}")))),
                        }
                        if url.is_empty() {
                            return (i, url, Ok(Err("(the RM's report) no tracking URL yet".into())));
                        }
                    }
                    let read = launch_times(&http, &url, &token, tasks).await;
                    (i, url, Ok(read))
                }
            });
        for (i, url, read) in futures::future::join_all(reads).await {
            let job = &mut state[i];
            job.tracking_url = url;
            match read {
                Err(e) => {
                    eprintln!("error: job {} {e}", job.id);
                    return exit::INTERNAL;
                }
                Ok(Ok(launched)) => job.launched = launched,
                // Said once per job and kind of answer, so a defect shows and the bench
                // goes on reading.
                Ok(Err(why)) => {
                    let early = started.elapsed() < Duration::from_secs(10);
                    if !early && complaints.insert(format!("{} {}", job.id, why.split(':').next().unwrap_or(""))) {
                        eprintln!(
                            "note: the status API of {} ({}) answered: {why}",
                            job.id, job.tracking_url
                        );
                    }
                }
            }
        }
        if state.iter().all(|j| j.launched.len() >= tasks as usize) {
            break;
        }
        if started.elapsed() >= next_progress {
            next_progress += Duration::from_secs(5);
            eprintln!(
                "{:.0} s: {} of {jobs} jobs all running, {} of {} tasks launched",
                started.elapsed().as_secs_f64(),
                state.iter().filter(|j| j.launched.len() >= tasks as usize).count(),
                state.iter().map(|j| j.launched.len()).sum::<usize>(),
                u64::from(jobs) * u64::from(tasks)
            );
        }
    }
    let rm_cpu = cpu_seconds(me).unwrap_or(0.0) - cpu_before;
    for job in &state {
        if let Some(c) = am_pid(&job.id).and_then(cpu_seconds) {
            am_cpu += c;
        }
    }
    let all_ms = state
        .iter()
        .flat_map(|j| j.launched.iter())
        .max()
        .map_or(0, |m| m.saturating_sub(first_submit_ms));
    let mut firsts: Vec<Duration> = state
        .iter()
        .filter_map(|j| j.launched.iter().min().map(|m| m.saturating_sub(j.submit_ms)))
        .map(Duration::from_millis)
        .collect();
    firsts.sort();
    let secs = all_ms as f64 / 1000.0;
    let containers = u64::from(jobs) * u64::from(tasks);
    let rm_peak = peak_rss_mib(me).unwrap_or(0.0);
    println!(
        "gpuam bench cluster: {jobs} jobs × {tasks} one-GPU `sleep 60` tasks submitted at once, {nodes} nodes × 8 GPUs"
    );
    println!("| jobs × tasks | nodes | submit → all tasks running | containers/s | submit → a job's first task, p50 / p99 | RM peak RSS | RM CPU | AMs' CPU |");
    println!("|---|---|---|---|---|---|---|---|");
    println!(
        "| {jobs} × {tasks} | {nodes} | {secs:.2} s | {:.0} | {:.2} s / {:.2} s | {rm_peak:.0} MiB | {rm_cpu:.1} s | {am_cpu:.1} s |",
        containers as f64 / secs.max(1e-3),
        percentile(&firsts, 0.5).as_secs_f64(),
        percentile(&firsts, 0.99).as_secs_f64(),
    );
    println!("(RM = this process: the RM, its in-process executor and the bench's polling client; CPU counted from submit to all running)");
    let c = rm_counters(&rm.metrics_text());
    println!(
        "RM: {} allocate calls, {} changed nodes sent in their answers, {} containers granted, asks refused: {} taken by another, {} queue, {} never",
        c.allocates, c.node_reports, c.grants, c.busy, c.queue, c.never
    );
    let starts = am_start_times(work, ids);
    if !starts.is_empty() {
        let stage = |i: usize| {
            let mut v: Vec<Duration> = starts.iter().map(|t| Duration::from_millis(t[i])).collect();
            v.sort();
            format!(
                "{:.2} s / {:.2} s",
                percentile(&v, 0.5).as_secs_f64(),
                percentile(&v, 0.99).as_secs_f64()
            )
        };
        println!(
            "AM start (process start →), p50 / p99 over {} AMs: node listing read {}, registered {}, first ask {}",
            starts.len(),
            stage(0),
            stage(1),
            stage(2)
        );
    }
    exit::SUCCESS
}

/// The RM's own counts over the run, from its `/metrics`.
struct RmCounters {
    allocates: u64,
    node_reports: u64,
    grants: u64,
    busy: u64,
    queue: u64,
    never: u64,
}

fn rm_counters(text: &str) -> RmCounters {
    let value = |prefix: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .map_or(0, |v| v as u64)
    };
    RmCounters {
        allocates: value("gpuam_rm_allocate_latency_seconds_count"),
        node_reports: value("gpuam_rm_node_reports_sent_total"),
        grants: value("gpuam_rm_grants_total"),
        busy: value("gpuam_rm_rejections_total{reason=\"busy\"}"),
        queue: value("gpuam_rm_rejections_total{reason=\"queue\"}"),
        never: value("gpuam_rm_rejections_total{reason=\"never\"}"),
    }
}

/// Each AM's start times in milliseconds from its process start (node listing read,
/// registered, first ask), from the line [`super::am::START_LINE`] of its stderr
/// (`<work>/<app id>/am.stderr`); AMs without the line are left out.
fn am_start_times(work: &std::path::Path, ids: &[String]) -> Vec<[u64; 3]> {
    ids.iter()
        .filter_map(|id| {
            let text = std::fs::read_to_string(work.join(id).join("am.stderr")).ok()?;
            let line = text.lines().find(|l| l.starts_with(super::am::START_LINE))?;
            let ms: Vec<u64> = line
                .split(" ms")
                .filter_map(|part| part.rsplit(' ').next()?.parse().ok())
                .collect();
            <[u64; 3]>::try_from(ms).ok()
        })
        .collect()
}
