//! Seeded, time-bounded fault injection on the running system: several jobs run
//! concurrently on one real `gpuam rm` process (real `gpuam am` processes, real task
//! process groups) while faults are injected at points chosen from a seed:
//!
//! * `am`   — SIGKILL a running job's AM process (the RM starts the next attempt, which
//!   re-adopts the running containers);
//! * `node` — mark a node LOST through the admin endpoint (its containers end with the
//!   lost-node status), then RUNNING again 1–3 s later;
//! * `task` — SIGKILL the process group of a running task (the attempt ends with 137);
//! * `rm`   — SIGKILL the RM process and start it again on the same port with the same
//!   `--work-dir` (needs RM recovery from `<work-dir>/rm-state.db`).
//!
//! Environment: `GPUAM_CHAOS_SEED` (default [`DEFAULT_SEED`]) and `GPUAM_CHAOS_FAULTS`
//! (comma list of the kinds above, default all four). The seed is printed first and is
//! part of every assertion message, so a failing run is reproduced with
//! `GPUAM_CHAOS_SEED=<seed> GPUAM_CHAOS_FAULTS=<kinds> cargo test --release --test chaos -- --nocapture`.
//!
//! What the seed decides, before anything runs: the jobs (roles, instances, GPUs, ports,
//! `taskRetryCount`, `minFailedInstances`), every task's behaviour (how many times it
//! fails with exit 1 before it succeeds, its run time, whether it waits for its job's
//! release marker), when each job's marker is written, and the fault schedule (how many
//! faults of each enabled kind and at which offsets from the start, plus each node's
//! down time). Which AM, node or task a fault hits is drawn from the same generator at
//! the moment it fires, among the candidates alive then (sorted, so the draw depends
//! only on the seed and on which candidates exist; the processes' timing can change
//! the candidate set, so a seed fixes the schedule exactly and the targets nearly).
//!
//! Each task appends to its own record file one `start` line per run (attempt, host,
//! process group, time, phase `fail`/`ok`, CUDA_VISIBLE_DEVICES, CONTAINER_PORTS) and
//! one `end` line when a run succeeds; the checks count runs from these files.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{parse_container_ports, pid_alive, pids_with_cmdline, prom_histogram, signal_group, sq, Rm, Submission};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const DEFAULT_SEED: u64 = 20_250_611;
/// `rm.max_am_attempts` (default 3): an AM is only killed while its attempt is below it,
/// so a job never runs out of attempts because of this suite.
const MAX_AM_ATTEMPTS: u64 = 3;
/// `am.max_transient_retries` (default 10).
const MAX_TRANSIENT: u32 = 10;
const NODES: usize = 5;
const GPUS_PER_NODE: u32 = 4;
/// Every job must end within this time after the first submission.
const JOBS_DEADLINE: Duration = Duration::from_secs(100);

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Am,
    Node,
    Task,
    Rm,
}

impl Kind {
    fn parse(s: &str) -> Kind {
        match s.trim() {
            "am" => Kind::Am,
            "node" => Kind::Node,
            "task" => Kind::Task,
            "rm" => Kind::Rm,
            other => panic!("GPUAM_CHAOS_FAULTS: unknown fault kind `{other}` (am, node, task, rm)"),
        }
    }
}

struct RolePlan {
    name: String,
    instances: u32,
    retry: u32,
    min_failed: u32,
    gpus: u32,
    ports: bool,
}

/// What the test makes one task do.
struct TaskPlan {
    job: usize,
    role: usize,
    index: u32,
    /// Runs that exit 1 (after `fail_ms`) before the first run that does the work.
    fails: u32,
    fail_ms: u64,
    sleep_ms: u64,
    /// The working run waits for its job's release marker after sleeping.
    long: bool,
}

struct JobPlan {
    name: String,
    roles: Vec<RolePlan>,
    release_at: Duration,
}

/// One run of a task, from its record file.
#[derive(Clone, Debug)]
struct Run {
    attempt: u32,
    host: String,
    pgid: i32,
    start_ms: u64,
    fail: bool,
    gpus: Vec<u32>,
    ports: Vec<u16>,
    end_ms: Option<u64>,
}

fn read_runs(path: &Path) -> Vec<Run> {
    let text = fs::read_to_string(path).unwrap_or_default();
    let mut runs: Vec<Run> = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.first() {
            Some(&"start") if f.len() >= 8 => runs.push(Run {
                attempt: f[1].parse().unwrap_or(0),
                host: f[2].to_string(),
                pgid: f[3].parse().unwrap_or(0),
                start_ms: f[4].parse().unwrap_or(0),
                fail: f[5] == "fail",
                gpus: if f[6] == "-" {
                    Vec::new()
                } else {
                    f[6].split(',').filter_map(|g| g.parse().ok()).collect()
                },
                ports: if f[7] == "-" {
                    Vec::new()
                } else {
                    parse_container_ports(f[7]).into_iter().flat_map(|(_, p)| p).collect()
                },
                end_ms: None,
            }),
            Some(&"end") if f.len() >= 4 => {
                let pgid: i32 = f[2].parse().unwrap_or(0);
                if let Some(r) = runs.iter_mut().rev().find(|r| r.pgid == pgid && r.end_ms.is_none()) {
                    r.end_ms = f[3].parse().ok();
                }
            }
            _ => {}
        }
    }
    runs
}

/// One injected fault, as it happened.
#[derive(Debug)]
struct Injected {
    kind: Kind,
    at_ms: u64,
    what: String,
}

/// Kills, when the test ends (passing or not), whatever task process groups and AM
/// processes of this test's jobs are still alive (an RM that was SIGKILLed cannot stop
/// them itself). Only processes this test's jobs started are touched: task groups
/// recorded in the test's record files and AMs whose command line names its directory.
struct Leftovers {
    rec_dir: PathBuf,
    root: String,
}

impl Leftovers {
    fn live_groups(&self) -> Vec<i32> {
        let mut out = BTreeSet::new();
        for e in fs::read_dir(&self.rec_dir).into_iter().flatten().flatten() {
            for r in read_runs(&e.path()) {
                if r.pgid > 1 && pid_alive(r.pgid) {
                    out.insert(r.pgid);
                }
            }
        }
        out.into_iter().collect()
    }
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        for g in self.live_groups() {
            signal_group(g, libc::SIGKILL);
        }
        for pid in pids_with_cmdline(&[" am ", &self.root]) {
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

fn cluster_yaml() -> String {
    let mut s = String::from("nodes:\n");
    for i in 1..=NODES {
        let _ = write!(
            s,
            "  - host: n{i}\n    rack: /r{}\n    cpu: 32\n    memoryMB: 64000\n    gpus: {GPUS_PER_NODE}\n    ports: \"20000-20199\"\n",
            1 + i % 2
        );
    }
    s
}

/// Jobs and task behaviours from the seed.
fn plan_jobs(rng: &mut StdRng) -> (Vec<JobPlan>, Vec<TaskPlan>) {
    let mut jobs = Vec::new();
    let mut tasks = Vec::new();
    let n_jobs = rng.gen_range(4..=5);
    for j in 0..n_jobs {
        let n_roles = rng.gen_range(1..=2);
        let mut roles = Vec::new();
        for r in 0..n_roles {
            let instances = rng.gen_range(2..=3);
            let retry = rng.gen_range(0..=2);
            // Mostly the default (the first failed task fails the job); sometimes the
            // role tolerates failures until all its tasks failed.
            let min_failed = if rng.gen_bool(0.6) { 1 } else { instances };
            roles.push(RolePlan {
                name: format!("r{r}"),
                instances,
                retry,
                min_failed,
                gpus: if rng.gen_bool(0.25) { 2 } else { 1 },
                ports: rng.gen_bool(0.5),
            });
            for index in 0..instances {
                // 0 failures (most), 1..=retry (recovers by retrying), retry+1 (fails).
                let p: f64 = rng.gen();
                let fails = if p < 0.55 {
                    0
                } else if p < 0.93 {
                    if retry == 0 {
                        0
                    } else {
                        rng.gen_range(1..=retry)
                    }
                } else {
                    retry + 1
                };
                tasks.push(TaskPlan {
                    job: j,
                    role: r,
                    index,
                    fails,
                    fail_ms: rng.gen_range(300..1500),
                    sleep_ms: rng.gen_range(300..2500),
                    long: rng.gen_bool(0.4),
                });
            }
        }
        jobs.push(JobPlan {
            name: format!("chaos{j}"),
            roles,
            release_at: Duration::from_millis(rng.gen_range(12_000..22_000)),
        });
    }
    (jobs, tasks)
}

/// The fault schedule from the seed: (offset from the start, kind), sorted.
fn plan_faults(rng: &mut StdRng, kinds: &[Kind]) -> Vec<(Duration, Kind)> {
    let mut out = Vec::new();
    for &k in kinds {
        let n = match k {
            Kind::Am => rng.gen_range(2..=4),
            Kind::Node => rng.gen_range(2..=3),
            Kind::Task => rng.gen_range(3..=5),
            Kind::Rm => rng.gen_range(1..=2),
        };
        for _ in 0..n {
            out.push((Duration::from_millis(rng.gen_range(2_000..20_000)), k));
        }
    }
    out.sort();
    out
}

fn task_key(jobs: &[JobPlan], t: &TaskPlan) -> String {
    format!("{}.{}.{}", jobs[t.job].name, jobs[t.job].roles[t.role].name, t.index)
}

fn job_yaml(root: &str, job: &JobPlan) -> String {
    let name = &job.name;
    // One bash command: read the plan; while this task still has planned failures,
    // record a `fail` run, sleep, count the failure in the task's own file and exit 1
    // (a run killed by a fault before that point has not used the failure up, so the
    // next run fails again); else record an `ok` run, work, optionally wait for the
    // release marker, and record the end.
    let script = format!(
        "P={root}/plan/{name}.$GPUAM_TASK_ROLE.$GPUAM_TASK_INDEX; R={root}/rec/{name}.$GPUAM_TASK_ROLE.$GPUAM_TASK_INDEX; \
         read F E S L < $P; n=$(cat $R.fails 2>/dev/null || echo 0); pg=$(awk '{{print $5}}' /proc/$$/stat); \
         info=\"$GPUAM_ATTEMPT $GPUAM_HOST $pg $(date +%s%3N)\"; dev=${{CUDA_VISIBLE_DEVICES:--}}; pp=${{CONTAINER_PORTS:--}}; \
         if [ $n -lt $F ]; then echo \"start $info fail $dev $pp\" >> $R; sleep $E; echo $((n+1)) > $R.fails; exit 1; fi; \
         echo \"start $info ok $dev $pp\" >> $R; sleep $S; \
         if [ $L = 1 ]; then while [ ! -f {root}/release.{name} ]; do sleep 0.05; done; fi; \
         echo \"end $GPUAM_ATTEMPT $pg $(date +%s%3N)\" >> $R"
    );
    let mut y = format!("name: {name}\ntaskRoles:\n");
    for r in &job.roles {
        let ports = if r.ports { ", ports: {p: 1}" } else { "" };
        let _ = write!(
            y,
            "  {}:\n    instances: {}\n    taskRetryCount: {}\n    completion: {{minFailedInstances: {}}}\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: {}{ports}}}\n    commands:\n      - {}\n",
            r.name,
            r.instances,
            r.retry,
            r.min_failed,
            r.gpus,
            sq(&script)
        );
    }
    y
}

/// Cumulative histogram buckets summed over several scrapes.
fn merge_hist(all: &HashMap<(String, u64), Vec<(f64, u64)>>) -> Vec<(f64, u64)> {
    let mut sum: BTreeMap<u64, (f64, u64)> = BTreeMap::new();
    for h in all.values() {
        for &(le, n) in h {
            let e = sum.entry(le.to_bits()).or_insert((le, 0));
            e.1 += n;
        }
    }
    let mut v: Vec<(f64, u64)> = sum.into_values().collect();
    v.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
    v
}

struct Chaos {
    seed: u64,
    rng: StdRng,
    rm: Rm,
    jobs: Vec<JobPlan>,
    tasks: Vec<TaskPlan>,
    rec_dir: PathBuf,
    apps: Vec<Option<String>>,
    injected: Vec<Injected>,
    /// Task key → kills that hit one of its runs (the group existed when signalled).
    task_kills: HashMap<String, u32>,
    /// (host, time) of every node loss.
    node_losses: Vec<(String, u64)>,
    /// A node that is LOST now, and when it comes back.
    lost: Option<(String, Instant)>,
    /// App → AM kills.
    am_kills: HashMap<String, u32>,
    conflicts: Vec<String>,
    samples: u64,
    latency: HashMap<(String, u64), Vec<(f64, u64)>>,
    last_scrape: Instant,
}

impl Chaos {
    fn ctx(&self) -> String {
        format!("[chaos seed={}]", self.seed)
    }

    fn rec_path(&self, t: &TaskPlan) -> PathBuf {
        self.rec_dir.join(task_key(&self.jobs, t))
    }

    /// Every task's runs (task index into `self.tasks`).
    fn all_runs(&self) -> Vec<(usize, Vec<Run>)> {
        self.tasks
            .iter()
            .enumerate()
            .map(|(i, t)| (i, read_runs(&self.rec_path(t))))
            .collect()
    }

    /// Runs whose bash leader is alive now, with their task.
    fn live_runs(&self) -> Vec<(usize, Run)> {
        let mut out = Vec::new();
        for (i, runs) in self.all_runs() {
            for r in runs {
                if r.end_ms.is_none() && r.pgid > 1 && pid_alive(r.pgid) {
                    out.push((i, r));
                }
            }
        }
        out
    }

    /// One sample: no two live task processes share a GPU or a port on a host, no task
    /// has two live runs, and no node lists more containers than it has GPUs (every
    /// container here holds at least one GPU) or GPU bits outside its mask.
    fn sample(&mut self) {
        self.samples += 1;
        let live = self.live_runs();
        let mut per_task: HashMap<usize, u32> = HashMap::new();
        for (i, _) in &live {
            *per_task.entry(*i).or_insert(0) += 1;
        }
        for (i, n) in per_task {
            if n > 1 {
                let key = task_key(&self.jobs, &self.tasks[i]);
                self.conflicts.push(format!("task {key} has {n} live runs at once"));
            }
        }
        for (a, (ia, ra)) in live.iter().enumerate() {
            for (ib, rb) in &live[a + 1..] {
                if ra.host != rb.host {
                    continue;
                }
                let gpus: Vec<u32> = ra.gpus.iter().filter(|g| rb.gpus.contains(g)).copied().collect();
                let ports: Vec<u16> = ra.ports.iter().filter(|p| rb.ports.contains(p)).copied().collect();
                if !gpus.is_empty() || !ports.is_empty() {
                    self.conflicts.push(format!(
                        "{} (pgid {}) and {} (pgid {}) on {} share GPUs {gpus:?} ports {ports:?}",
                        task_key(&self.jobs, &self.tasks[*ia]),
                        ra.pgid,
                        task_key(&self.jobs, &self.tasks[*ib]),
                        rb.pgid,
                        ra.host
                    ));
                }
            }
        }
        if let Some(nodes) = self.rm.try_node_list() {
            for n in nodes {
                if n.containers > u64::from(n.gpu_total.count_ones()) || n.gpu_used & !n.gpu_total != 0 {
                    self.conflicts.push(format!("node over capacity: {n:?}"));
                }
            }
        }
        if self.last_scrape.elapsed() > Duration::from_millis(400) {
            self.last_scrape = Instant::now();
            self.scrape_latency();
        }
    }

    /// Keeps the latest allocate-latency histogram of every AM attempt that answers.
    fn scrape_latency(&mut self) {
        for app in self.apps.iter().flatten() {
            let Some(a) = self.rm.try_app(app) else {
                continue;
            };
            if a["state"] != "RUNNING" {
                continue;
            }
            let (Some(url), Some(attempt)) = (a["trackingUrl"].as_str(), a["attempt"].as_u64()) else {
                continue;
            };
            if url.is_empty() {
                continue;
            }
            if let Some(text) = self.rm.get_text(&format!("{url}metrics")) {
                let h = prom_histogram(&text, "gpuam_allocate_latency_seconds");
                if !h.is_empty() {
                    self.latency.insert((app.clone(), attempt), h);
                }
            }
        }
    }

    fn pick<T: Clone>(&mut self, v: &[T]) -> Option<T> {
        (!v.is_empty()).then(|| v[self.rng.gen_range(0..v.len())].clone())
    }

    /// Fires one fault; false when it found no target (then it is skipped).
    fn inject(&mut self, kind: Kind, t0: Instant) -> bool {
        let at_ms = t0.elapsed().as_millis() as u64;
        match kind {
            Kind::Am => {
                let mut cands = Vec::new();
                for app in self.apps.iter().flatten() {
                    let Some(a) = self.rm.try_app(app) else {
                        continue;
                    };
                    if a["state"] == "RUNNING" && a["attempt"].as_u64().unwrap_or(MAX_AM_ATTEMPTS) < MAX_AM_ATTEMPTS {
                        if let Some(pid) = self.rm.am_pid(app) {
                            cands.push((app.clone(), pid, a["attempt"].as_u64().unwrap()));
                        }
                    }
                }
                let Some((app, pid, attempt)) = self.pick(&cands) else {
                    return false;
                };
                // The AM may have finished its job and exited since it was found.
                if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
                    return false;
                }
                *self.am_kills.entry(app.clone()).or_insert(0) += 1;
                self.injected.push(Injected {
                    kind,
                    at_ms,
                    what: format!("SIGKILL AM pid {pid} of {app} (attempt {attempt})"),
                });
            }
            Kind::Node => {
                if self.lost.is_some() {
                    return false;
                }
                // Prefer a node with live work.
                let mut busy: Vec<String> = self.live_runs().into_iter().map(|(_, r)| r.host).collect();
                busy.sort();
                busy.dedup();
                let all: Vec<String> = (1..=NODES).map(|i| format!("n{i}")).collect();
                let host = if busy.is_empty() {
                    self.pick(&all)
                } else {
                    self.pick(&busy)
                }
                .unwrap();
                let t = now_ms();
                let (status, body) = self.rm.set_node_state(&host, "LOST");
                assert_eq!(status, 200, "{} PUT {host} LOST: {body}", self.ctx());
                let back = Duration::from_millis(self.rng.gen_range(1_000..3_000));
                self.node_losses.push((host.clone(), t));
                self.lost = Some((host.clone(), Instant::now() + back));
                self.injected.push(Injected {
                    kind,
                    at_ms,
                    what: format!(
                        "node {host} LOST ({} containers ended), back after {back:?}",
                        body["containersEnded"]
                    ),
                });
            }
            Kind::Task => {
                let mut cands: Vec<(usize, Run)> = self.live_runs();
                cands.sort_by_key(|(i, r)| (*i, r.pgid));
                let Some((i, run)) = self.pick(&cands) else {
                    return false;
                };
                let key = task_key(&self.jobs, &self.tasks[i]);
                if !signal_group(run.pgid, libc::SIGKILL) {
                    return false;
                }
                *self.task_kills.entry(key.clone()).or_insert(0) += 1;
                self.injected.push(Injected {
                    kind,
                    at_ms,
                    what: format!(
                        "SIGKILL group {} of {key} attempt {} on {}",
                        run.pgid, run.attempt, run.host
                    ),
                });
            }
            Kind::Rm => {
                let old = self.rm.pid();
                self.rm.kill_hard();
                // The RM stays down for a while (the AMs retry meanwhile).
                std::thread::sleep(Duration::from_millis(self.rng.gen_range(300..1_500)));
                self.rm.restart();
                self.injected.push(Injected {
                    kind,
                    at_ms,
                    what: format!(
                        "SIGKILL RM pid {old:?}, restarted as pid {:?} (incarnation {})",
                        self.rm.pid(),
                        self.rm.incarnation()
                    ),
                });
            }
        }
        true
    }

    fn node_back_if_due(&mut self) {
        if let Some((host, at)) = self.lost.clone() {
            if Instant::now() >= at {
                let (status, body) = self.rm.set_node_state(&host, "RUNNING");
                assert_eq!(status, 200, "{} PUT {host} RUNNING: {body}", self.ctx());
                self.lost = None;
            }
        }
    }

    fn count(&self, kind: Kind) -> usize {
        self.injected.iter().filter(|f| f.kind == kind).count()
    }
}

#[test]
fn seeded_faults_keep_every_job_correct() {
    let seed: u64 = std::env::var("GPUAM_CHAOS_SEED")
        .ok()
        .map(|s| s.trim().parse().expect("GPUAM_CHAOS_SEED must be an unsigned integer"))
        .unwrap_or(DEFAULT_SEED);
    let kinds_text = std::env::var("GPUAM_CHAOS_FAULTS").unwrap_or_else(|_| "am,node,task,rm".into());
    let mut kinds: Vec<Kind> = kinds_text
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(Kind::parse)
        .collect();
    kinds.sort();
    kinds.dedup();
    println!("chaos seed={seed} faults={kinds:?} (GPUAM_CHAOS_SEED={seed} GPUAM_CHAOS_FAULTS={kinds_text})");
    let mut rng = StdRng::seed_from_u64(seed);
    let (jobs, tasks) = plan_jobs(&mut rng);
    let mut schedule = plan_faults(&mut rng, &kinds);

    let select_seed = seed.to_string();
    let rm = Rm::start(&cluster_yaml(), &[("GPUAM__SELECT__SEED", &select_seed)]);
    let root = rm.root().display().to_string();
    let rec_dir = rm.path("rec");
    fs::create_dir_all(&rec_dir).unwrap();
    fs::create_dir_all(rm.path("plan")).unwrap();
    let mut c = Chaos {
        seed,
        rng,
        rm,
        jobs,
        tasks,
        rec_dir: rec_dir.clone(),
        apps: Vec::new(),
        injected: Vec::new(),
        task_kills: HashMap::new(),
        node_losses: Vec::new(),
        lost: None,
        am_kills: HashMap::new(),
        conflicts: Vec::new(),
        samples: 0,
        latency: HashMap::new(),
        last_scrape: Instant::now(),
    };
    // Declared after `c` (which owns the RM guard), so it runs first on the way out.
    let leftovers = Leftovers {
        rec_dir,
        root: root.clone(),
    };
    for t in &c.tasks {
        fs::write(
            c.rm.path(&format!("plan/{}", task_key(&c.jobs, t))),
            format!(
                "{} {}.{:03} {}.{:03} {}\n",
                t.fails,
                t.fail_ms / 1000,
                t.fail_ms % 1000,
                t.sleep_ms / 1000,
                t.sleep_ms % 1000,
                u8::from(t.long)
            ),
        )
        .unwrap();
    }
    for (j, job) in c.jobs.iter().enumerate() {
        let roles: Vec<String> = job
            .roles
            .iter()
            .map(|r| {
                let fails: Vec<u32> = c
                    .tasks
                    .iter()
                    .filter(|t| t.job == j && c.jobs[t.job].roles[t.role].name == r.name)
                    .map(|t| t.fails)
                    .collect();
                format!(
                    "{}×{} gpu={} ports={} retry={} minFailed={} fails={fails:?}",
                    r.name, r.instances, r.gpus, r.ports, r.retry, r.min_failed
                )
            })
            .collect();
        println!("  job {}: {}", job.name, roles.join("; "));
    }
    println!(
        "  schedule: {}",
        schedule
            .iter()
            .map(|(d, k)| format!("{:?}@{:.1}s", k, d.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(" ")
    );

    let t0 = Instant::now();
    let mut subs: Vec<Option<Submission>> = Vec::new();
    for job in &c.jobs {
        let path = c.rm.write_job(&job.name, &job_yaml(&root, job));
        subs.push(Some(c.rm.submit(&path)));
    }
    for s in &subs {
        let id = s.as_ref().unwrap().app_id(Duration::from_secs(20));
        c.apps.push(Some(id));
    }
    let mut released = vec![false; c.jobs.len()];
    let mut exit_codes: Vec<Option<i32>> = vec![None; c.jobs.len()];
    let mut skipped = 0usize;
    loop {
        let ctx = c.ctx();
        assert!(
            t0.elapsed() < JOBS_DEADLINE,
            "{ctx} jobs still running after {JOBS_DEADLINE:?}; faults so far: {:#?}",
            c.injected
        );
        if let Some(status) = c.rm.try_exited() {
            panic!(
                "{ctx} the RM process exited by itself ({status}) at {:.2}s; faults so far: {:#?}",
                t0.elapsed().as_secs_f64(),
                c.injected
            );
        }
        c.sample();
        c.node_back_if_due();
        for (j, job) in c.jobs.iter().enumerate() {
            if !released[j] && t0.elapsed() >= job.release_at {
                fs::write(c.rm.path(&format!("release.{}", job.name)), "").unwrap();
                released[j] = true;
            }
        }
        while let Some(&(at, kind)) = schedule.first() {
            if t0.elapsed() < at {
                break;
            }
            schedule.remove(0);
            if subs.iter().all(Option::is_none) {
                skipped += 1;
                continue;
            }
            if !c.inject(kind, t0) {
                // No target now (e.g. a node is already down): try again a little later,
                // once; after the last release everything may be winding down.
                if kind == Kind::Node && c.lost.is_some() {
                    schedule.push((at + Duration::from_secs(3), kind));
                    schedule.sort();
                } else {
                    skipped += 1;
                }
            } else if let Some(f) = c.injected.last() {
                println!("  [{:>6.2}s] {:?}: {}", f.at_ms as f64 / 1000.0, f.kind, f.what);
            }
        }
        for (j, s) in subs.iter_mut().enumerate() {
            if let Some(code) = s.as_mut().and_then(Submission::try_exit) {
                exit_codes[j] = Some(code);
                *s = None;
            }
        }
        if subs.iter().all(Option::is_none) && c.lost.is_none() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let elapsed = t0.elapsed();
    let ctx = c.ctx();

    // ---- final checks -------------------------------------------------------------
    let runs = c.all_runs();
    let mut failures: Vec<String> = c.conflicts.clone();
    let mut losses = 0usize;
    let mut total_runs = 0usize;
    for (j, job) in c.jobs.iter().enumerate() {
        let app_id = c.apps[j].clone().unwrap();
        let app = match c.rm.get_json(&format!("/ws/v1/cluster/apps/{app_id}")) {
            Ok(v) => v["app"].clone(),
            Err(e) => {
                failures.push(format!("job {} ({app_id}): the RM cannot report it: {e}", job.name));
                serde_json::Value::Null
            }
        };
        // Expected verdict: a task fails iff it has more planned failures than retries
        // (see the retry rule below); the job fails iff some role has at least
        // minFailedInstances failed tasks (no role sets minSucceededInstances, so the
        // verdict does not depend on the order in which tasks end).
        let expect_fail = job.roles.iter().enumerate().any(|(r, role)| {
            let failed = c
                .tasks
                .iter()
                .filter(|t| t.job == j && t.role == r && t.fails > role.retry)
                .count() as u32;
            failed >= role.min_failed
        });
        let (want_state, want_final, want_code) = if expect_fail {
            ("FAILED", "FAILED", 1)
        } else {
            ("FINISHED", "SUCCEEDED", 0)
        };
        if app["state"] != want_state || app["finalStatus"] != want_final {
            failures.push(format!(
                "job {} ({app_id}): state {} / {} (exit code {}), expected {want_state} / {want_final}; diagnostics: {}",
                job.name, app["state"], app["finalStatus"], app["exitCode"], app["diagnostics"]
            ));
        }
        if exit_codes[j] != Some(want_code) {
            failures.push(format!(
                "job {}: `gpuam submit --wait` exited {:?}, expected {want_code}",
                job.name, exit_codes[j]
            ));
        }
        let attempts = app["attempt"].as_u64().unwrap_or(0);
        let kills = u64::from(c.am_kills.get(&app_id).copied().unwrap_or(0));
        if attempts > 1 + kills && c.count(Kind::Rm) == 0 {
            failures.push(format!(
                "job {}: {attempts} AM attempts after {kills} AM kills",
                job.name
            ));
        }
        for (i, t) in c.tasks.iter().enumerate().filter(|(_, t)| t.job == j) {
            let role = &job.roles[t.role];
            let key = task_key(&c.jobs, t);
            let rs = &runs[i].1;
            total_runs += rs.len();
            let fail_runs = rs.iter().filter(|r| r.fail).count() as u32;
            let ok_runs = rs.iter().filter(|r| !r.fail).count() as u32;
            let ends = rs.iter().filter(|r| r.end_ms.is_some()).count() as u32;
            // Transient faults that hit this task: kills of one of its process groups
            // (exit 137 = SIGKILL is TransientNormal in exits.rs `classify`) and node
            // losses while one of its runs was on that node (the RM completes those
            // containers with -100 + "Container released on a *lost* node" =
            // CONTAINER_NODE_LOST, TransientNormal). `decide_retry` retries transient
            // exits without using up taskRetryCount (up to am.max_transient_retries),
            // while an exit 1 (Unknown) uses one of taskRetryCount's retries and a
            // success is final. AM kills and RM restarts are not exits of a task at all,
            // so they must add no run.
            let kills = c.task_kills.get(&key).copied().unwrap_or(0);
            let node_hits = c
                .node_losses
                .iter()
                .filter(|(h, at)| {
                    rs.iter()
                        .any(|r| &r.host == h && r.start_ms <= *at && r.end_ms.is_none_or(|e| e >= *at))
                })
                .count() as u32;
            let hits = kills + node_hits;
            assert!(hits < MAX_TRANSIENT, "{ctx} {key}: {hits} transient hits reach the cap");
            let recovers = t.fails <= role.retry;
            let why = format!(
                "task {key}: planned failures {}, taskRetryCount {}, transient hits {hits} (kills {kills}, node losses {node_hits}); runs {:?}",
                t.fails,
                role.retry,
                rs.iter()
                    .map(|r| format!(
                        "a{}@{}{}{}",
                        r.attempt,
                        r.host,
                        if r.fail { ":fail" } else { ":ok" },
                        if r.end_ms.is_some() { ":end" } else { "" }
                    ))
                    .collect::<Vec<_>>()
            );
            // The policy bound: runs ≤ 1 + taskRetryCount + transient hits.
            if fail_runs + ok_runs > 1 + role.retry + hits {
                failures.push(format!("ran more often than its retry policy allows: {why}"));
            }
            // Finer: without faults a task runs exactly min(F, 1 + taskRetryCount)
            // failing runs (exit 1 is Unknown: retried while retried < taskRetryCount)
            // plus one working run if F ≤ taskRetryCount; every transient hit can add
            // one run (of either phase) and nothing else can; no task succeeds twice.
            let base = t.fails.min(role.retry + 1) + u32::from(recovers);
            if fail_runs + ok_runs > base + hits {
                failures.push(format!("more runs than planned failures + transient hits: {why}"));
            }
            if fail_runs > t.fails.min(role.retry + 1) + hits {
                failures.push(format!("too many failing runs: {why}"));
            }
            if ok_runs > u32::from(recovers) + hits {
                failures.push(format!("working run repeated without a transient fault: {why}"));
            }
            if ends > 1 {
                failures.push(format!("succeeded more than once: {why}"));
            }
            if !expect_fail {
                // The job ran to its end: every task has its final record.
                let complete = fail_runs >= t.fails.min(role.retry + 1) && ends == u32::from(recovers);
                if !complete {
                    losses += 1;
                    failures.push(format!("task lost (no final record) in a finished job: {why}"));
                }
            }
        }
    }

    // No task process outlives its job.
    let gone_by = Instant::now() + Duration::from_secs(15);
    loop {
        let live = leftovers.live_groups();
        if live.is_empty() {
            break;
        }
        if Instant::now() > gone_by {
            failures.push(format!(
                "task process groups still alive 15 s after every job ended: {live:?}"
            ));
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }

    let hist = merge_hist(&c.latency);
    let p99 = hist
        .last()
        .map(|&(_, total)| total)
        .filter(|&n| n > 0)
        .and_then(|total| {
            let want = (total as f64 * 0.99).ceil() as u64;
            hist.iter().find(|&&(_, n)| n >= want).map(|&(le, _)| (le, total))
        });
    let p99_text = match p99 {
        Some((le, n)) if le.is_finite() => format!(
            "allocate p99<={} ms (histogram bucket bound, {n} calls sampled)",
            le * 1000.0
        ),
        Some((_, n)) => format!("allocate p99>5000 ms ({n} calls sampled)"),
        None => "allocate p99=n/a".into(),
    };
    println!(
        "chaos seed={seed} faults: am={} node={} task={} rm={} skipped={skipped} jobs={} tasks={} runs={total_runs} conflicts={} losses={losses} samples={} elapsed={:.1}s {p99_text}",
        c.count(Kind::Am),
        c.count(Kind::Node),
        c.count(Kind::Task),
        c.count(Kind::Rm),
        c.jobs.len(),
        c.tasks.len(),
        c.conflicts.len(),
        c.samples,
        elapsed.as_secs_f64(),
    );
    assert!(
        failures.is_empty(),
        "{ctx} {} check(s) failed:\n{}\nfaults injected: {:#?}",
        failures.len(),
        failures.join("\n"),
        c.injected
    );
    assert!(c.samples > 10, "{ctx} too few samples ({})", c.samples);
    // Nothing is left booked.
    c.rm.assert_all_free(Duration::from_secs(15));
    drop(leftovers);
}
