//! gpuam on a real Ray cluster (`gpuam rm --backend ray`, DESIGN.md §9).
//!
//! Installs Ray into `target/ray-venv` (scripts/ray-setup.sh, cached), makes a network
//! namespace `ray-<pid>` with only loopback, and re-runs this test binary inside it (`ip netns
//! exec`), where it starts a 3-node Ray cluster (head then workers, one `ray start --block` each,
//! with the arguments `gpuam ray-node-args` prints), the RM with `--backend ray`, and real jobs
//! whose tasks append start/end records to a file. Outside, a guard kills every process of the
//! namespace by pid and deletes it, whatever happened inside.
//!
//! Nodes: n1 (4 GPUs, pcie4, type A100, the head), n2 (4 GPUs, pcie4, V100), n3 (2 GPUs, V100).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{pid_alive, sq, wait_for, Rm};
use gpuam::protocol::LaunchContext;
use gpuam::ray::client::{JobStatus, RayClient};
use gpuam::resources::{PortSet, Resources};
use serde_json::Value;

const INNER: &str = "GPUAM_RAY_ITEST_INNER";
const DASHBOARD: &str = "http://127.0.0.1:8265";
const TEST_NAME: &str = "gpuam_places_on_a_real_three_node_ray_cluster";
const TEST_NAME_DRIVER: &str = "gpuam_places_on_a_real_three_node_ray_cluster_with_the_driver";
/// One Ray cluster at a time (each wants the machine's few cores).
static ONE_CLUSTER: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn venv_bin() -> PathBuf {
    repo().join("target/ray-venv/bin")
}

/// Runs scripts/ray-setup.sh (a no-op when the venv already has the supported Ray).
fn ensure_venv() {
    let status = Command::new("bash")
        .arg(repo().join("scripts/ray-setup.sh"))
        .status()
        .expect("run scripts/ray-setup.sh");
    assert!(
        status.success(),
        "scripts/ray-setup.sh failed: Ray could not be installed"
    );
}

/// The namespace, and on drop every process in it (by pid) and the namespace itself.
struct Netns(String);

impl Netns {
    fn create(name: &str) -> Netns {
        let ok = |args: &[&str]| Command::new("ip").args(args).status().is_ok_and(|s| s.success());
        assert!(ok(&["netns", "add", name]), "ip netns add {name} (needs root)");
        let ns = Netns(name.to_string());
        assert!(ok(&["-n", name, "link", "set", "lo", "up"]), "lo up in {name}");
        ns
    }

    fn pids(&self) -> Vec<i32> {
        let out = Command::new("ip").args(["netns", "pids", &self.0]).output();
        out.map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for sig in [libc::SIGTERM, libc::SIGKILL] {
            for p in self.pids() {
                unsafe { libc::kill(p, sig) };
            }
            let until = Instant::now() + Duration::from_secs(5);
            while !self.pids().is_empty() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

#[test]
fn gpuam_places_on_a_real_three_node_ray_cluster() {
    in_namespace(TEST_NAME, inner);
}

/// The same checks with the long-lived driver (`--ray-launch driver`): a placement group per
/// container, run by gpuam's actor on its node.
#[test]
fn gpuam_places_on_a_real_three_node_ray_cluster_with_the_driver() {
    in_namespace(TEST_NAME_DRIVER, inner_driver);
}

/// Benchmark (docs/BENCHMARKS.md): time from submit to all tasks running for a 16-task job,
/// on a 3-node Ray cluster and on gpuam's own RM. Prints figures; run with
/// `cargo test --release --test ray -- --ignored --nocapture`.
#[test]
#[ignore = "benchmark: prints figures (docs/BENCHMARKS.md)"]
fn bench_submit_to_all_running_16_tasks() {
    in_namespace("bench_submit_to_all_running_16_tasks", bench_inner);
}

/// Runs `inner` in a fresh network namespace (this test binary again, filtered to `test`),
/// then removes everything it left there.
fn in_namespace(test: &str, inner: fn()) {
    if std::env::var_os(INNER).is_some() {
        return inner();
    }
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    ensure_venv();
    let tag = format!("{}-{}", std::process::id(), test.len());
    let ns = Netns::create(&format!("ray-{tag}"));
    // Ray's temp dir (short: Ray puts unix sockets in it), removed with the namespace.
    let temp = PathBuf::from(format!("/tmp/rayray-{tag}"));
    fs::create_dir_all(&temp).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new("ip")
        .args(["netns", "exec", &ns.0])
        .arg(&exe)
        .args(["--exact", test, "--nocapture", "--test-threads=1", "--include-ignored"])
        .env(INNER, &temp)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(540);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    drop(ns);
    let _ = fs::remove_dir_all(&temp);
    let status = status.expect("the test inside the namespace ran past 540 s");
    assert!(status.success(), "the test inside the namespace failed: {status}");
}

/// One `ray start --block` process (a Ray node).
struct RayNode {
    host: String,
    child: Child,
}

/// The arguments `gpuam ray-node-args` prints, split back into words as `$(...)` splits them.
fn node_args(args: &[&str]) -> Vec<String> {
    let out = Command::new(common::bin())
        .arg("ray-node-args")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ray-node-args: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8(out.stdout).unwrap();
    line.split_whitespace().map(str::to_string).collect()
}

fn ray_env(cmd: &mut Command) {
    let path = format!("{}:{}", venv_bin().display(), std::env::var("PATH").unwrap_or_default());
    cmd.env("PATH", path)
        .env("RAY_USAGE_STATS_ENABLED", "0")
        .env("RAY_enable_worker_prestart", "0")
        .env("RAY_prestart_worker_first_driver", "0");
}

fn start_node(
    temp: &Path,
    log_dir: &Path,
    host: &str,
    head: bool,
    agent_port: u16,
    cpus: u32,
    gpu_args: &[&str],
) -> RayNode {
    let mut a = vec!["--host", host];
    a.extend_from_slice(gpu_args);
    let extra = node_args(&a);
    let mut cmd = Command::new(venv_bin().join("ray"));
    cmd.arg("start").arg("--block");
    if head {
        cmd.args([
            "--head",
            "--port=6379",
            "--dashboard-host=127.0.0.1",
            "--dashboard-port=8265",
        ]);
    } else {
        cmd.arg("--address=127.0.0.1:6379");
    }
    cmd.args([
        "--node-ip-address=127.0.0.1",
        "--memory=8589934592",
        "--object-store-memory=80000000",
        "--disable-usage-stats",
    ])
    .arg(format!("--num-cpus={cpus}"))
    .arg(format!("--dashboard-agent-listen-port={agent_port}"))
    .arg(format!("--temp-dir={}", temp.display()))
    .args(&extra)
    .stdin(Stdio::null())
    .stdout(fs::File::create(log_dir.join(format!("ray-{host}.log"))).unwrap())
    .stderr(Stdio::inherit());
    ray_env(&mut cmd);
    RayNode {
        host: host.to_string(),
        child: cmd.spawn().unwrap(),
    }
}

/// Every descendant of `pid` (by the parent pids in /proc), and `pid` itself.
fn process_tree(pid: i32) -> Vec<i32> {
    let mut parent: Vec<(i32, i32)> = Vec::new();
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // The fields after the `(comm)`: state, ppid, ...
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        if let Some(pp) = rest.split_whitespace().nth(1).and_then(|s| s.parse().ok()) {
            parent.push((p, pp));
        }
    }
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let t = tree[i];
        tree.extend(parent.iter().filter(|(_, pp)| *pp == t).map(|(p, _)| *p));
        i += 1;
    }
    tree
}

/// Kills a Ray node as a machine failure would: every process of it at once.
fn kill_node(node: &mut RayNode) {
    let tree = process_tree(node.child.id() as i32);
    for p in &tree {
        unsafe { libc::kill(*p, libc::SIGSTOP) };
    }
    for p in &tree {
        unsafe { libc::kill(*p, libc::SIGKILL) };
    }
    let _ = node.child.wait();
}

/// One line a task appended: `start|end TIME HOST CVD CONTAINER JOB PID MASK`.
#[derive(Clone, Debug)]
struct Record {
    kind: String,
    time: f64,
    host: String,
    gpus: BTreeSet<u32>,
    container: String,
    job: String,
    pid: i32,
    mask: String,
}

fn records(file: &Path) -> Vec<Record> {
    fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f.len() == 8).then(|| Record {
                kind: f[0].into(),
                time: f[1].parse().unwrap(),
                host: f[2].into(),
                gpus: f[3]
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| s.parse().unwrap())
                    .collect(),
                container: f[4].into(),
                job: f[5].into(),
                pid: f[6].parse().unwrap(),
                mask: f[7].into(),
            })
        })
        .collect()
}

/// The shell line a task runs to append one record.
fn record_cmd(kind: &str, file: &Path) -> String {
    format!(
        "echo \"{kind} $(date +%s.%N) $GPUAM_HOST $CUDA_VISIBLE_DEVICES $GPUAM_CONTAINER_ID $GPUAM_JOB $$ $GPUAM_GPU_MASK\" >> {}",
        file.display()
    )
}

fn job_yaml(
    name: &str,
    gang: bool,
    instances: u32,
    gpus: u32,
    gpu_type: &str,
    retries: u32,
    body: &[String],
) -> String {
    let cmds: String = body.iter().map(|c| format!("      - {}\n", sq(c))).collect();
    format!(
        "name: {name}\ngang: {gang}\ntaskRoles:\n  worker:\n    instances: {instances}\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: {gpus}}}\n    gpuType: {gpu_type}\n    taskRetryCount: {retries}\n    commands:\n{cmds}"
    )
}

/// Asserts that no GPU of any host was held by two tasks at once, from the tasks' own
/// start/end records (a task without an end record holds its GPUs until `now`).
fn assert_no_gpu_shared(recs: &[Record], now: f64) {
    // (host, GPU) → every (start, end, container) that held it.
    type Spans = BTreeMap<(String, u32), Vec<(f64, f64, String)>>;
    let mut spans: Spans = BTreeMap::new();
    for s in recs.iter().filter(|r| r.kind == "start") {
        let end = recs
            .iter()
            .find(|r| r.kind == "end" && r.container == s.container && r.pid == s.pid)
            .map_or(now, |e| e.time);
        for g in &s.gpus {
            spans
                .entry((s.host.clone(), *g))
                .or_default()
                .push((s.time, end, s.container.clone()));
        }
    }
    for ((host, gpu), mut v) in spans {
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        for w in v.windows(2) {
            assert!(
                w[0].1 <= w[1].0,
                "GPU {gpu} of {host} was held by {} and {} at once: {w:?}",
                w[0].2,
                w[1].2
            );
        }
    }
}

/// The supervisor actor Ray runs for a job (it holds the job's resources) and the
/// resources it required.
fn job_actor(rt: &tokio::runtime::Runtime, container: &str) -> (Value, BTreeMap<String, f64>) {
    let actors: Value = rt
        .block_on(async {
            gpuam::tls::http_client()
                .get(format!(
                    "{DASHBOARD}/api/v0/actors?detail=true&limit=10000&filter_keys=name&filter_predicates=%3D&filter_values=_ray_internal_job_actor_{container}"
                ))
                .send()
                .await?
                .json()
                .await
        })
        .unwrap();
    let actor = actors["data"]["result"]["result"][0].clone();
    let res: BTreeMap<String, f64> = serde_json::from_value(actor["required_resources"].clone())
        .unwrap_or_else(|e| panic!("the job actor of {container}: {e}: {actors}"));
    (actor, res)
}

/// The placement group the driver made for a container (`gpuam-<id>`, also once removed).
fn group_of(rt: &tokio::runtime::Runtime, container: &str) -> Option<Value> {
    let groups: Value = rt
        .block_on(async {
            gpuam::tls::http_client()
                .get(format!(
                    "{DASHBOARD}/api/v0/placement_groups?detail=true&limit=10000&filter_keys=name&filter_predicates=%3D&filter_values=gpuam-{container}"
                ))
                .send()
                .await?
                .json()
                .await
        })
        .ok()?;
    groups["data"]["result"]["result"].as_array()?.last().cloned()
}

/// The Ray node that held a container's resources and the resources it held: its job's
/// supervisor actor (`jobs`), or its placement group's one bundle (`driver`).
fn held(rt: &tokio::runtime::Runtime, launch: &str, container: &str) -> (String, BTreeMap<String, f64>) {
    if launch == "driver" {
        let g = group_of(rt, container).unwrap_or_else(|| panic!("no placement group for {container}"));
        let bundles = g["bundles"].as_array().cloned().unwrap_or_default();
        assert_eq!(bundles.len(), 1, "one bundle per container: {g}");
        let res: BTreeMap<String, f64> = serde_json::from_value(bundles[0]["unit_resources"].clone())
            .unwrap_or_else(|e| panic!("the group of {container}: {e}: {g}"));
        return (bundles[0]["node_id"].as_str().unwrap_or_default().to_string(), res);
    }
    let (actor, res) = job_actor(rt, container);
    (actor["node_id"].as_str().unwrap_or_default().to_string(), res)
}

/// Each task saw CUDA_VISIBLE_DEVICES = its granted mask, and Ray pinned it to exactly
/// those GPUs' resources on the node of that host.
fn assert_pinned(rt: &tokio::runtime::Runtime, ray: &RayClient, recs: &[Record], launch: &str) {
    for s in recs.iter().filter(|r| r.kind == "start") {
        let from_mask: BTreeSet<u32> = (0..64)
            .filter(|i| u64::from_str_radix(s.mask.trim_start_matches("0x"), 16).unwrap() >> i & 1 == 1)
            .collect();
        assert_eq!(
            s.gpus, from_mask,
            "CUDA_VISIBLE_DEVICES vs granted mask of {}",
            s.container
        );
        let (driver, res) = held(rt, launch, &s.container);
        let ray_gpus: BTreeSet<u32> = res
            .keys()
            .filter_map(|k| k.strip_prefix("gpuam-gpu-").and_then(|i| i.parse().ok()))
            .collect();
        assert_eq!(ray_gpus, s.gpus, "Ray resources of {}: {res:?}", s.container);
        assert_eq!(res.get(&format!("gpuam-node-{}", s.host)), Some(&0.001), "{res:?}");
        assert!(!res.contains_key("GPU"), "no Ray GPU: {res:?}");
        // It ran on the Ray node that carries this host's resource.
        let nodes = rt.block_on(ray.nodes()).unwrap();
        let node = nodes.iter().find(|n| n.node_id == driver).expect("driver node");
        assert_eq!(
            node.gpuam_host(),
            Some(s.host.as_str()),
            "{} ran on {}",
            s.container,
            driver
        );
    }
}

/// Starts one Ray node per `(host, gpus, topology, rack, gpu type)`, the first as the head,
/// the others one after another (two raylets registering at once can time out here), and
/// waits until all are ALIVE.
fn start_cluster(
    rt: &tokio::runtime::Runtime,
    ray: &RayClient,
    temp: &Path,
    log_dir: &Path,
    cpus: u32,
    specs: &[(&str, &str, &str, &str, &str)],
) -> Vec<RayNode> {
    let t0 = Instant::now();
    let mut nodes = Vec::new();
    for (i, (host, gpus, topo, rack, gpu_type)) in specs.iter().enumerate() {
        let before = nodes.len();
        wait_for(
            Duration::from_secs(120),
            "the Ray nodes started so far to be ALIVE",
            || {
                if before == 0 {
                    return Some(());
                }
                let n = rt.block_on(ray.nodes()).ok()?;
                (n.iter().filter(|n| n.is_alive()).count() == before).then_some(())
            },
        );
        nodes.push(start_node(
            temp,
            log_dir,
            host,
            i == 0,
            52365 + i as u16,
            cpus,
            &[
                "--gpus",
                gpus,
                "--topology",
                topo,
                "--rack",
                rack,
                "--gpu-type",
                gpu_type,
            ],
        ));
        if i == 0 {
            wait_for(Duration::from_secs(120), "the Ray head's dashboard", || {
                rt.block_on(ray.version()).ok()
            });
        }
    }
    wait_for(Duration::from_secs(120), "every Ray node ALIVE", || {
        let n = rt.block_on(ray.nodes()).ok()?;
        (n.iter().filter(|n| n.is_alive()).count() == specs.len()).then_some(())
    });
    println!(
        "ray: {} nodes ALIVE after {:.1} s",
        specs.len(),
        t0.elapsed().as_secs_f64()
    );
    nodes
}

fn inner() {
    scenarios("jobs");
}

fn inner_driver() {
    scenarios("driver");
}

/// Every check, with containers launched the `launch` way (`--ray-launch`).
fn scenarios(launch: &str) {
    let dir = Rm::temp_dir();
    let temp = PathBuf::from(std::env::var_os(INNER).unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let ray = RayClient::new(DASHBOARD).unwrap();
    let mut nodes = start_cluster(
        &rt,
        &ray,
        &temp,
        dir.path(),
        8,
        &[
            ("n1", "4", "pcie4", "/r1", "A100"),
            ("n2", "4", "pcie4", "/r2", "V100"),
            ("n3", "2", "none", "/r2", "V100"),
        ],
    );

    let venv_path = format!("{}:{}", venv_bin().display(), std::env::var("PATH").unwrap_or_default());
    let mut rm = Rm::start_in(
        dir,
        "nodes: []\n",
        "",
        &[
            ("GPUAM_RM_BACKEND", "ray"),
            ("GPUAM_RAY_ADDRESS", DASHBOARD),
            ("GPUAM_RAY_LAUNCH", launch),
            ("PATH", &venv_path),
        ],
    );
    let hosts: Vec<(String, u64)> = rm.baseline.iter().map(|n| (n.host.clone(), n.gpu_total)).collect();
    assert_eq!(
        hosts,
        vec![("n1".into(), 0xf), ("n2".into(), 0xf), ("n3".into(), 0x3)],
        "the RM's nodes come from Ray"
    );
    let rec = rm.path("records");
    let task = |secs: &str| {
        vec![
            record_cmd("start", &rec),
            format!("sleep {secs}"),
            record_cmd("end", &rec),
        ]
    };

    // 1. Two concurrent jobs that both want n1's GPUs (the only A100 node): 4 tasks of 2.
    let a = rm.write_job("a.yaml", &job_yaml("joba", false, 2, 2, "A100", 0, &task("2")));
    let b = rm.write_job("b.yaml", &job_yaml("jobb", false, 2, 2, "A100", 0, &task("2")));
    let (sa, sb) = (rm.submit(&a), rm.submit(&b));
    let (fa, fb) = (sa.wait(Duration::from_secs(180)), sb.wait(Duration::from_secs(180)));
    assert_eq!(
        (fa.code, fb.code),
        (0, 0),
        "jobs a/b:\n{}\n{}\n{}",
        fa.stderr,
        fb.stderr,
        rm.logs()
    );
    let recs = records(&rec);
    let starts: Vec<&Record> = recs.iter().filter(|r| r.kind == "start").collect();
    assert_eq!(starts.len(), 4, "{recs:?}");
    assert!(starts.iter().all(|r| r.host == "n1" && r.gpus.len() == 2), "{starts:?}");
    assert_no_gpu_shared(&recs, f64::MAX);
    assert_pinned(&rt, &ray, &recs, launch);
    rm.assert_all_free(Duration::from_secs(30));

    // 2. A gang of 2 × 2 GPUs on V100 lands on one Ray node (n2, the one it fits on whole).
    let g = rm.write_job("g.yaml", &job_yaml("gang", true, 2, 2, "V100", 0, &task("1")));
    let fg = rm.run_job(&g, Duration::from_secs(180));
    assert_eq!(fg.code, 0, "gang: {}\n{}", fg.stderr, rm.logs());
    let gang: Vec<Record> = records(&rec)
        .into_iter()
        .filter(|r| r.job == "gang" && r.kind == "start")
        .collect();
    assert_eq!(gang.len(), 2, "{gang:?}");
    assert!(
        gang.iter().all(|r| r.host == "n2"),
        "the gang was split or misplaced: {gang:?}"
    );
    assert_eq!(gang[0].gpus.union(&gang[1].gpus).count(), 4, "{gang:?}");
    assert_no_gpu_shared(&records(&rec), f64::MAX);
    rm.assert_all_free(Duration::from_secs(30));

    // 3. Killing a job: 3 tasks of 2 GPUs on n1 (2 run, 1 waits); no task runs afterwards.
    let k = rm.write_job(
        "k.yaml",
        &job_yaml(
            "killed",
            false,
            3,
            2,
            "A100",
            0,
            // The end record comes from the EXIT trap when the stop's SIGTERM ends the task.
            &[
                format!("trap {} EXIT", sq(&record_cmd("end", &rec))),
                record_cmd("start", &rec),
                "sleep 120".into(),
            ],
        ),
    );
    let sk = rm.submit(&k);
    let app = sk.app_id(Duration::from_secs(60));
    let running = wait_for(
        Duration::from_secs(120),
        "2 tasks of the job to be killed to start",
        || {
            let r: Vec<Record> = records(&rec)
                .into_iter()
                .filter(|r| r.job == "killed" && r.kind == "start")
                .collect();
            (r.len() >= 2).then_some(r)
        },
    );
    rm.kill_app(&app);
    rm.wait_app_final(&app, Duration::from_secs(60));
    let containers: BTreeSet<String> = running.iter().map(|r| r.container.clone()).collect();
    wait_for(
        Duration::from_secs(60),
        "the killed job's Ray jobs or groups to end",
        || {
            if launch == "driver" {
                return containers
                    .iter()
                    .all(|c| group_of(&rt, c).is_some_and(|g| g["state"] == "REMOVED"))
                    .then_some(());
            }
            let jobs = rt.block_on(ray.jobs()).ok()?;
            containers
                .iter()
                .all(|c| jobs.get(c).is_some_and(|j| j.status.is_terminal()))
                .then_some(())
        },
    );
    wait_for(
        Duration::from_secs(30),
        "the killed job's task processes to be gone",
        || running.iter().all(|r| !pid_alive(r.pid)).then_some(()),
    );
    rm.assert_all_free(Duration::from_secs(30));
    std::thread::sleep(Duration::from_secs(5));
    let after: Vec<Record> = records(&rec)
        .into_iter()
        .filter(|r| r.job == "killed" && r.kind == "start")
        .collect();
    assert_eq!(
        after.len(),
        running.len(),
        "a task of the killed job ran after the kill: {after:?}"
    );
    drop(sk);

    // 3b. GPU shares (issue 15): four 0.25-GPU tasks of one job run at once on one GPU, and
    // each Ray job holds 0.25 of that GPU's resource (Ray accounts fractional custom
    // resources, so Ray too keeps a GPU's shares within one). Own records file: the checks
    // of whole GPUs below must not see these tasks, which share a GPU by design.
    let srec = rm.path("share-records");
    let barrier = rm.path("share-barrier");
    fs::create_dir_all(&barrier).unwrap();
    let b = barrier.display();
    let body: String = [
        record_cmd("start", &srec),
        format!("touch {b}/$GPUAM_TASK_INDEX"),
        format!("for i in $(seq 600); do [ $(ls {b} | wc -l) -ge 4 ] && break; sleep 0.1; done"),
        format!("[ $(ls {b} | wc -l) -ge 4 ]"),
        record_cmd("end", &srec),
    ]
    .iter()
    .map(|c| format!("      - {}\n", sq(c)))
    .collect();
    let sj = rm.write_job(
        "s.yaml",
        &format!("name: shares\ntaskRoles:\n  worker:\n    instances: 4\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 0.25}}\n    gpuType: V100\n    commands:\n{body}"),
    );
    let fsh = rm.run_job(&sj, Duration::from_secs(180));
    assert_eq!(fsh.code, 0, "shares (all four at once): {}\n{}", fsh.stderr, rm.logs());
    let starts: Vec<Record> = records(&srec).into_iter().filter(|r| r.kind == "start").collect();
    assert_eq!(starts.len(), 4, "{starts:?}");
    assert!(
        starts
            .iter()
            .all(|r| r.host == starts[0].host && r.gpus == starts[0].gpus && r.gpus.len() == 1),
        "four quarters on one GPU: {starts:?}"
    );
    for s in &starts {
        let (_, res) = held(&rt, launch, &s.container);
        let g = s.gpus.iter().next().unwrap();
        assert_eq!(
            res.get(&format!("gpuam-gpu-{g}")),
            Some(&0.25),
            "{}: {res:?}",
            s.container
        );
    }
    rm.assert_all_free(Duration::from_secs(30));

    // 4. A Ray job stopped while PENDING never runs its task: the gate refuses it (the
    // driver: a container stopped while its group waits for its GPU never starts).
    if launch == "driver" {
        driver_stops_a_pending_container(&rt, &rec);
    } else {
        gate_stops_a_pending_job(&rt, &rec);
    }

    // 4b. The driver killed mid-job: the RM starts a new one, which finds the running
    // container on its node again and reports its end; the task runs once, to its end.
    if launch == "driver" {
        let r = rm.write_job("r.yaml", &job_yaml("restart", false, 1, 1, "A100", 0, &task("8")));
        let sr = rm.submit(&r);
        wait_for(Duration::from_secs(120), "the task to start", || {
            records(&rec).into_iter().find(|r| r.job == "restart")
        });
        let tree = process_tree(rm.pid().expect("the RM's pid"));
        let drivers: Vec<i32> = common::pids_with_cmdline(&["long-lived Ray driver"])
            .into_iter()
            .filter(|p| tree.contains(p))
            .collect();
        assert_eq!(drivers.len(), 1, "one driver: {drivers:?}");
        unsafe { libc::kill(drivers[0], libc::SIGKILL) };
        let fr = sr.wait(Duration::from_secs(180));
        assert_eq!(fr.code, 0, "restart: {}\n{}", fr.stderr, rm.logs());
        let seen: Vec<Record> = records(&rec).into_iter().filter(|r| r.job == "restart").collect();
        assert_eq!(
            seen.iter().map(|r| r.kind.as_str()).collect::<Vec<_>>(),
            ["start", "end"],
            "{seen:?}"
        );
        let again: Vec<i32> = common::pids_with_cmdline(&["long-lived Ray driver"])
            .into_iter()
            .filter(|p| process_tree(rm.pid().unwrap()).contains(p))
            .collect();
        assert!(
            again.len() == 1 && again[0] != drivers[0],
            "a new driver runs: {again:?}"
        );
        rm.assert_all_free(Duration::from_secs(30));
    }

    // 4c. The RM killed and started again mid-job (its driver ends with it): the new RM's
    // driver adopts the container that kept running and reports its end; it ran once.
    if launch == "driver" {
        let r = rm.write_job("rr.yaml", &job_yaml("rmrestart", false, 1, 1, "A100", 0, &task("10")));
        let sr = rm.submit(&r);
        wait_for(Duration::from_secs(120), "the task to start", || {
            records(&rec).into_iter().find(|r| r.job == "rmrestart")
        });
        rm.restart();
        let fr = sr.wait(Duration::from_secs(180));
        assert_eq!(fr.code, 0, "RM restart: {}\n{}", fr.stderr, rm.logs());
        let seen: Vec<Record> = records(&rec).into_iter().filter(|r| r.job == "rmrestart").collect();
        assert_eq!(
            seen.iter().map(|r| r.kind.as_str()).collect::<Vec<_>>(),
            ["start", "end"],
            "{seen:?}"
        );
        rm.assert_all_free(Duration::from_secs(30));
    }

    // 5. A Ray node killed mid-job: LOST in the RM, its task retried on the other V100 node.
    let first = rm.path("lost-first");
    let body = vec![
        format!(
            "if [ -e {0} ]; then {1}; exit 0; fi",
            first.display(),
            record_cmd("start", &rec)
        ),
        format!("touch {}", first.display()),
        record_cmd("start", &rec),
        "sleep 300".into(),
    ];
    let l = rm.write_job("l.yaml", &job_yaml("lost", false, 1, 2, "V100", 3, &body));
    let sl = rm.submit(&l);
    let victim = wait_for(Duration::from_secs(120), "the task on a V100 node to start", || {
        records(&rec).into_iter().find(|r| r.job == "lost")
    });
    let node = nodes.iter_mut().find(|n| n.host == victim.host).unwrap();
    let killed_at = Instant::now();
    kill_node(node);
    wait_for(Duration::from_secs(120), "the RM to mark the killed node LOST", || {
        let v = rm.get_json("/ws/v1/cluster/nodes").ok()?;
        v["nodes"]["node"]
            .as_array()?
            .iter()
            .any(|n| n["nodeHostName"] == victim.host.as_str() && n["state"] == "LOST")
            .then_some(())
    });
    println!(
        "ray: node {} LOST after {:.1} s",
        victim.host,
        killed_at.elapsed().as_secs_f64()
    );
    let fl = sl.wait(Duration::from_secs(240));
    assert_eq!(fl.code, 0, "lost job: {}\n{}", fl.stderr, rm.logs());
    let lost: Vec<Record> = records(&rec).into_iter().filter(|r| r.job == "lost").collect();
    assert_eq!(lost.len(), 2, "{lost:?}");
    assert_ne!(lost[1].host, victim.host, "the retry ran on the lost node: {lost:?}");
    assert_ne!(lost[1].host, "n1", "V100 only: {lost:?}");
    assert_no_gpu_shared(&records(&rec), f64::MAX);
    drop(rm);
    for n in &mut nodes {
        let _ = n.child.kill();
        let _ = n.child.wait();
    }
}

/// Waits for the ends of `c1` and `c2`: `c1` exited 0, `c2` was killed (never started).
fn assert_first_ran_second_killed(
    rt: &tokio::runtime::Runtime,
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<gpuam::node::NodeEvent>,
    c1: &str,
    c2: &str,
) {
    let mut ended = BTreeMap::new();
    while ended.len() < 2 {
        let ev = rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(120), rx.recv()).await })
            .expect("both containers end")
            .unwrap();
        let gpuam::node::NodeEvent::Exited {
            container_id,
            exit_status,
            ..
        } = ev;
        ended.insert(container_id, exit_status);
    }
    assert_eq!(ended[c1], 0);
    assert_eq!(
        ended[c2],
        gpuam::protocol::exit_status::KILLED_BY_APPMASTER,
        "{ended:?}"
    );
}

/// Straight through the Ray backend: c1 holds GPU 0 of n1; c2 asks for the same GPU and
/// stays PENDING in Ray; c2 is stopped (gate closed), then c1 ends. Ray then starts c2's
/// entrypoint, which must run no command, and c2 must end as killed.
fn gate_stops_a_pending_job(rt: &tokio::runtime::Runtime, rec: &Path) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let launcher = rt.block_on(async {
        let gate = gpuam::ray::gate::Gate::start("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        gpuam::ray::launcher::RayLauncher::new(RayClient::new(DASHBOARD).unwrap(), gate, tx)
    });
    let granted = Resources::with_mask(1, 100, 0x1, PortSet::new());
    let ctx = |job: &str, secs: &str| LaunchContext {
        commands: vec![
            record_cmd("start", rec).replace("$GPUAM_JOB", job),
            format!("sleep {secs}"),
            record_cmd("end", rec).replace("$GPUAM_JOB", job),
        ],
        env: BTreeMap::new(),
    };
    let suffix = std::process::id();
    let (c1, c2) = (
        format!("container_gate_{suffix}_1"),
        format!("container_gate_{suffix}_2"),
    );
    rt.block_on(launcher.start(&c1, "n1", &granted, ctx("gate1", "6")))
        .unwrap();
    wait_for(Duration::from_secs(120), "c1 to start", || {
        records(rec).into_iter().find(|r| r.container == c1)
    });
    rt.block_on(launcher.start(&c2, "n1", &granted, ctx("gate2", "1")))
        .unwrap();
    wait_for(Duration::from_secs(30), "c2 to be PENDING in Ray", || {
        let j = rt.block_on(launcher.client().job(&c2)).ok()??;
        (j.status == JobStatus::Pending).then_some(())
    });
    rt.block_on(launcher.stop(&c2, Duration::from_secs(1))).unwrap();
    assert_first_ran_second_killed(rt, &mut rx, &c1, &c2);
    assert!(
        records(rec).iter().all(|r| r.container != c2),
        "the stopped pending job ran its task"
    );
}

/// Straight through the driver: c1 holds GPU 0 of n1; c2 asks for the same GPU, so its
/// placement group stays PENDING in Ray; c2 is stopped, then c1 ends. c2 must never run a
/// command and must end as killed.
fn driver_stops_a_pending_container(rt: &tokio::runtime::Runtime, rec: &Path) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let driver = rt.block_on(async {
        gpuam::ray::driver::RayDriver::new(
            gpuam::ray::driver::DriverConfig {
                python: venv_bin().join("python").display().to_string(),
                gcs_address: "127.0.0.1:6379".into(),
                hosts: vec!["n1".into()],
            },
            tx,
        )
    });
    let grant = |id: &str| gpuam::node::Grant {
        container_id: id.to_string(),
        app_id: "app_gate".into(),
        host: "n1".into(),
        resources: Resources::with_mask(1, 100, 0x1, PortSet::new()),
        user: String::new(),
        topology: None,
    };
    let ctx = |job: &str, secs: &str| LaunchContext {
        commands: vec![
            format!("echo {job}-out; echo {job}-err >&2"),
            record_cmd("start", rec).replace("$GPUAM_JOB", job),
            format!("sleep {secs}"),
            record_cmd("end", rec).replace("$GPUAM_JOB", job),
        ],
        env: BTreeMap::new(),
    };
    let suffix = std::process::id();
    let (c1, c2) = (format!("container_pg_{suffix}_1"), format!("container_pg_{suffix}_2"));
    rt.block_on(driver.start(grant(&c1), ctx("pg1", "6"))).unwrap();
    wait_for(Duration::from_secs(120), "c1 to start", || {
        records(rec).into_iter().find(|r| r.container == c1)
    });
    rt.block_on(driver.start(grant(&c2), ctx("pg2", "1"))).unwrap();
    wait_for(
        Duration::from_secs(30),
        "c2's placement group to be PENDING in Ray",
        || (group_of(rt, &c2)?["state"] == "PENDING").then_some(()),
    );
    rt.block_on(driver.stop(&c2, Duration::from_secs(1))).unwrap();
    assert_first_ran_second_killed(rt, &mut rx, &c1, &c2);
    // Its group is gone, and nothing of it ran (not even after c1 freed the GPU).
    wait_for(Duration::from_secs(30), "c2's group to be removed", || {
        (group_of(rt, &c2)?["state"] == "REMOVED").then_some(())
    });
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        records(rec).iter().all(|r| r.container != c2),
        "the stopped pending container ran its task"
    );
    // Its output stays on its node, each stream apart, and reaches the RM.
    let log = |stream| rt.block_on(driver.read_log("n1", &c1, stream, None)).unwrap();
    assert_eq!(log(gpuam::node::LogStream::Stdout), "pg1-out\n");
    assert_eq!(log(gpuam::node::LogStream::Stderr), "pg1-err\n");
}

/// Submit → every task of a job of `instances` tasks of `gpu` GPUs each has written its
/// start record (`gang`: all granted before any starts).
fn time_to_all_running(rm: &Rm, name: &str, instances: u32, gpu: &str, gang: bool) -> f64 {
    let rec = rm.path(&format!("records-{name}"));
    let cmds: String = [record_cmd("start", &rec), "sleep 3".into()]
        .iter()
        .map(|c| format!("      - {}\n", sq(c)))
        .collect();
    let job = rm.write_job(
        &format!("{name}.yaml"),
        &format!(
            "name: {name}\ngang: {gang}\ntaskRoles:\n  worker:\n    instances: {instances}\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: {gpu}}}\n    gpuType: V100\n    commands:\n{cmds}"
        ),
    );
    let t = Instant::now();
    let sub = rm.submit(&job);
    wait_for(Duration::from_secs(300), "every task running", || {
        (records(&rec).len() >= instances as usize).then_some(())
    });
    let secs = t.elapsed().as_secs_f64();
    let f = sub.wait(Duration::from_secs(300));
    assert_eq!(f.code, 0, "{}\n{}", f.stderr, rm.logs());
    secs
}

/// Ray's own placement-group path on the same cluster (scripts/ray-launch-bench.py, a
/// fresh driver each time): its warm figure, in seconds, for `tasks` tasks (`mode`: `pg`,
/// one group per one-GPU task; `gang:4`, one group of quarter-GPU bundles).
fn ray_own(tasks: u32, mode: &str, dir: &Path) -> f64 {
    let out = Command::new(venv_bin().join("python"))
        .arg(repo().join("scripts/ray-launch-bench.py"))
        .args([&tasks.to_string(), "n1,n2,n3", "8"])
        .arg(dir.join(format!("ray-own-{mode}")))
        .arg(mode)
        .env("RAY_ADDRESS", "127.0.0.1:6379")
        .env("RAY_USAGE_STATS_ENABLED", "0")
        .stderr(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{text}");
    text.lines()
        .find(|l| l.contains("(warm)"))
        .and_then(|l| l.split("after ").nth(1))
        .and_then(|r| r.trim_end_matches(" s").trim().parse().ok())
        .unwrap_or_else(|| panic!("ray-launch-bench.py {mode}: {text}"))
}

fn bench_inner() {
    let dir = Rm::temp_dir();
    let temp = PathBuf::from(std::env::var_os(INNER).unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let ray = RayClient::new(DASHBOARD).unwrap();
    // 32 declared CPUs a node: a 64-task gang of one CPU each fits gpuam's ledger.
    let mut nodes = start_cluster(
        &rt,
        &ray,
        &temp,
        dir.path(),
        32,
        &[
            ("n1", "8", "pcie8", "/r1", "V100"),
            ("n2", "8", "pcie8", "/r1", "V100"),
            ("n3", "8", "pcie8", "/r1", "V100"),
        ],
    );
    let venv_path = format!("{}:{}", venv_bin().display(), std::env::var("PATH").unwrap_or_default());
    let launch = std::env::var("GPUAM_BENCH_RAY_LAUNCH").unwrap_or_else(|_| "driver".into());
    let on_ray = Rm::start_in(
        dir,
        "nodes: []\n",
        "",
        &[
            ("GPUAM_RM_BACKEND", "ray"),
            ("GPUAM_RAY_ADDRESS", DASHBOARD),
            ("GPUAM_RAY_LAUNCH", &launch),
            ("PATH", &venv_path),
        ],
    );
    let rounds: usize = std::env::var("GPUAM_BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(2);
    let (mut ours16, mut own16, mut ours64, mut own64) = (vec![], vec![], vec![], vec![]);
    for i in 0..rounds {
        ours16.push(time_to_all_running(&on_ray, &format!("r16x{i}"), 16, "1", false));
        own16.push(ray_own(16, "pg", &on_ray.path("")));
        ours64.push(time_to_all_running(&on_ray, &format!("g64x{i}"), 64, "0.25", true));
        own64.push(ray_own(64, "gang:4", &on_ray.path("")));
    }
    drop(on_ray);
    for n in &mut nodes {
        let _ = n.child.kill();
        let _ = n.child.wait();
    }
    let fmt = |v: &[f64]| v.iter().map(|s| format!("{s:.2}")).collect::<Vec<_>>().join(", ");
    println!(
        "bench ({launch}): submit -> all running (s), alternating: 16 one-GPU tasks: gpuam on Ray [{}], Ray's own warm PG [{}]; 64-task gang of 0.25 GPU: gpuam on Ray [{}], Ray's own warm gang PG [{}]",
        fmt(&ours16),
        fmt(&own16),
        fmt(&ours64),
        fmt(&own64)
    );
}
