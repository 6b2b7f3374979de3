//! Fractional GPUs and custom resources (issue 15), end to end on a real RM: real
//! `gpuam rm`, the `gpuam am` processes it launches and real task process groups, which
//! record their environment and hold their containers until the test lets them go.
//!
//! - four 0.25-GPU tasks run at once on one GPU of a 2-GPU node, all seeing the same
//!   `CUDA_VISIBLE_DEVICES`; the fifth goes to the other GPU by best fit, and a whole-GPU
//!   job waits while both GPUs hold shares;
//! - on a 1-GPU node the fifth quarter waits until a quarter's container is dead;
//! - a 2-GPU task of the same job still gets the node's best free pair (as `plan` says);
//! - a task needing `nvme: 1` lands only where an nvme is free and waits when none is;
//! - a node agent offers `--resource nvme=2` and runs a share through its signed grant.
//!
//! Every test ends with the RM's books (GPU bits, shares, custom resources, CPU, memory,
//! ports) back at their baseline.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{bin, parse_mask, read_env_file, sq, wait_for, Rm};
use serde_json::Value;

const JOB_TIMEOUT: Duration = Duration::from_secs(60);
const FREE_TIMEOUT: Duration = Duration::from_secs(10);
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A block list of commands for a job file.
fn commands(cmds: &[String]) -> String {
    cmds.iter().map(|c| format!("      - {}\n", sq(c))).collect()
}

/// Commands of a task that records its environment (`env.<role>.<index>`) and start
/// time (`started.<role>.<index>`), then holds its container until `go` or
/// `go.<role>.<index>` exists in `dir` (at most 120 s), then records its end time.
fn holding_task(dir: &Path) -> String {
    let d = dir.display();
    let me = "$GPUAM_TASK_ROLE.$GPUAM_TASK_INDEX";
    commands(&[
        format!("env | sort > {d}/env.{me}.tmp && mv {d}/env.{me}.tmp {d}/env.{me}"),
        format!("date +%s%N > {d}/started.{me}.tmp && mv {d}/started.{me}.tmp {d}/started.{me}"),
        format!("for i in $(seq 1200); do [ -e {d}/go ] || [ -e {d}/go.{me} ] && break; sleep 0.1; done"),
        format!("date +%s%N > {d}/ended.{me}.tmp && mv {d}/ended.{me}.tmp {d}/ended.{me}"),
    ])
}

/// `role/index` → its recorded environment, for every task that has started.
fn envs(dir: &Path) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(task) = name.strip_prefix("env.").filter(|t| !t.ends_with(".tmp")) {
            out.insert(task.replacen('.', "/", 1), read_env_file(&e.path()));
        }
    }
    out
}

fn started(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().to_string();
            n.strip_prefix("started.")
                .filter(|t| !t.ends_with(".tmp"))
                .map(|t| t.replacen('.', "/", 1))
        })
        .collect();
    v.sort();
    v
}

fn time_of(dir: &Path, what: &str, task: &str) -> u128 {
    let p = dir.join(format!("{what}.{}", task.replacen('/', ".", 1)));
    fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .trim()
        .parse()
        .unwrap()
}

/// The RM's node object of `host`.
fn node_json(rm: &Rm, host: &str) -> Value {
    let v = rm.get_json("/ws/v1/cluster/nodes").unwrap();
    v["nodes"]["node"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["nodeHostName"] == host)
        .cloned()
        .unwrap_or_else(|| panic!("no node {host}"))
}

/// The AM's published tasks of application `app` (its dashboard's `/api/v1/tasks`).
fn am_tasks(rm: &Rm, app: &str) -> Option<Vec<Value>> {
    let tracking = rm.app(app)["trackingUrl"].as_str()?.to_string();
    if tracking.is_empty() {
        return None;
    }
    // The dashboard's API takes the owner's token (the AM asks the RM about it).
    let text = rm.get_text_as(&format!("{tracking}api/v1/tasks"), &rm.user_token)?;
    let v: Value = serde_json::from_str(&text).ok()?;
    v.as_array().cloned().or_else(|| v["tasks"].as_array().cloned())
}

/// Waits until task `role/index` of `app` waits with a reason containing `fragment`.
fn wait_reason(rm: &Rm, app: &str, task: &str, fragment: &str) -> String {
    let (role, index) = task.split_once('/').unwrap();
    wait_for(START_TIMEOUT, &format!("{task} to wait because {fragment}"), || {
        am_tasks(rm, app)?.into_iter().find_map(|t| {
            let same = t["role"] == role && t["index"].as_u64() == index.parse().ok();
            // The task's reason (`reason::Reason`): its detail is the select outcome's.
            let r = t["reason"]["detail"].as_str().unwrap_or("");
            (same && r.contains(fragment)).then(|| r.to_string())
        })
    })
}

#[test]
fn four_quarters_run_at_once_on_one_gpu_and_the_fifth_goes_to_the_other() {
    let rm = Rm::start(
        "nodes:\n  - host: duo\n    cpu: 16\n    memoryMB: 16000\n    gpus: 2\n    topology: none\n    ports: \"20000-20009\"\n",
        &[("GPUAM__SELECT__SEED", "0")],
    );
    let dir = rm.root().join("q");
    fs::create_dir(&dir).unwrap();
    let job = rm.write_job(
        "quarters",
        &format!(
            "name: quarters\ntaskRoles:\n  q:\n    instances: 5\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 0.25}}\n    commands:\n{}",
            holding_task(&dir)
        ),
    );
    let sub = rm.submit(&job);
    let app = sub.app_id(Duration::from_secs(10));
    // All five hold their containers at once (none can end before `go`).
    wait_for(START_TIMEOUT, "five quarters running", || {
        (started(&dir).len() == 5).then_some(())
    });
    let envs = envs(&dir);
    let mut by_gpu: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (task, env) in &envs {
        let cvd = env["CUDA_VISIBLE_DEVICES"].clone();
        assert_eq!(env["GPUAM_GPU_FRACTION"], "0.25", "{task}");
        assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25", "{task}");
        let index: u32 = cvd
            .parse()
            .unwrap_or_else(|_| panic!("{task}: one GPU index, got `{cvd}`"));
        assert_eq!(parse_mask(&env["GPUAM_GPU_MASK"]), 1 << index, "{task}");
        by_gpu.entry(cvd).or_default().push(task.clone());
    }
    let sizes: Vec<usize> = by_gpu.values().map(Vec::len).collect();
    assert_eq!(by_gpu.len(), 2, "the fifth quarter opened the other GPU: {by_gpu:?}");
    assert!(
        sizes.contains(&4) && sizes.contains(&1),
        "four on one GPU, one on the other: {by_gpu:?}"
    );
    let fifth_gpu = by_gpu.iter().find(|(_, t)| t.len() == 1).unwrap().0.clone();
    // The RM's node view: both GPUs in use, the full one whole, the other a quarter used.
    let n = node_json(&rm, "duo");
    assert_eq!(n["usedGpuAttribute"], "0x3", "{n}");
    assert_eq!(
        n["usedGpuShares"],
        serde_json::json!({ fifth_gpu.clone(): "0.25" }),
        "{n}"
    );
    assert_eq!(n["numContainers"], 5, "{n}");

    // A whole-GPU job waits: no GPU is wholly free while both hold shares.
    let whole = rm.write_job(
        "whole",
        &format!(
            "name: whole\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1}}\n    commands:\n{}",
            commands(&[format!("env | sort > {}/whole.env", rm.root().display())])
        ),
    );
    let sub_whole = rm.submit(&whole);
    let app_whole = sub_whole.app_id(Duration::from_secs(10));
    let reason = wait_reason(&rm, &app_whole, "w/0", "not enough free GPUs");
    assert!(
        !rm.path("whole.env").exists(),
        "the whole-GPU task ran beside shares: {reason}"
    );

    fs::write(dir.join("go"), "").unwrap();
    let out = sub.wait(JOB_TIMEOUT);
    assert_eq!(out.code, 0, "{out:?}\n{}", rm.logs());
    let out = sub_whole.wait(JOB_TIMEOUT);
    assert_eq!(out.code, 0, "{out:?}\n{}", rm.logs());
    let env = read_env_file(&rm.path("whole.env"));
    assert!(!env.contains_key("GPUAM_GPU_FRACTION"), "{env:?}");
    assert_eq!(env["CUDA_VISIBLE_DEVICES"].len(), 1);
    assert_eq!(rm.app(&app)["finalStatus"], "SUCCEEDED");
    rm.assert_all_free(FREE_TIMEOUT);
}

#[test]
fn a_fifth_quarter_waits_until_a_quarter_is_dead() {
    let rm = Rm::start(
        "nodes:\n  - host: solo\n    cpu: 16\n    memoryMB: 16000\n    gpus: 1\n    ports: \"20000-20009\"\n",
        &[
            ("GPUAM__SELECT__SEED", "0"),
            ("GPUAM__AM__NOT_AVAILABLE_RETRY_MIN_MS", "100"),
            ("GPUAM__AM__NOT_AVAILABLE_RETRY_MAX_MS", "300"),
        ],
    );
    let dir = rm.root().join("q");
    fs::create_dir(&dir).unwrap();
    let job = rm.write_job(
        "quarters",
        &format!(
            "name: quarters\ntaskRoles:\n  q:\n    instances: 5\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 0.25}}\n    commands:\n{}",
            holding_task(&dir)
        ),
    );
    let sub = rm.submit(&job);
    let app = sub.app_id(Duration::from_secs(10));
    wait_for(START_TIMEOUT, "four quarters running", || {
        (started(&dir).len() == 4).then_some(())
    });
    let running = started(&dir);
    let fifth = (0..5).map(|i| format!("q/{i}")).find(|t| !running.contains(t)).unwrap();
    // The GPU is full: four containers, no room left, the fifth waits for a share.
    let n = node_json(&rm, "solo");
    assert_eq!(
        (n["usedGpuAttribute"].as_str(), n["numContainers"].as_u64()),
        (Some("0x1"), Some(4)),
        "{n}"
    );
    assert!(
        n.get("usedGpuShares").is_none(),
        "a GPU filled by shares is used in full: {n}"
    );
    wait_reason(&rm, &app, &fifth, "no GPU has the requested share free");
    assert!(!started(&dir).contains(&fifth));

    // Let one quarter go: the fifth starts only after that container is dead.
    let first = &running[0];
    fs::write(dir.join(format!("go.{}", first.replacen('/', ".", 1))), "").unwrap();
    wait_for(START_TIMEOUT, "the fifth quarter to start", || {
        started(&dir).contains(&fifth).then_some(())
    });
    assert!(
        time_of(&dir, "started", &fifth) > time_of(&dir, "ended", first),
        "the fifth started before the quarter it replaced had ended"
    );
    assert_eq!(envs(&dir)[&fifth]["CUDA_VISIBLE_DEVICES"], "0");
    fs::write(dir.join("go"), "").unwrap();
    let out = sub.wait(JOB_TIMEOUT);
    assert_eq!(out.code, 0, "{out:?}\n{}", rm.logs());
    rm.assert_all_free(FREE_TIMEOUT);
}

#[test]
fn a_pair_in_the_same_job_still_gets_the_best_free_pair() {
    let rm = Rm::start(
        "nodes:\n  - host: quad\n    cpu: 16\n    memoryMB: 16000\n    gpus: 4\n    topology: pcie4\n    ports: \"20000-20009\"\n",
        &[("GPUAM__SELECT__SEED", "0")],
    );
    let dir = rm.root().join("q");
    fs::create_dir(&dir).unwrap();
    let job = rm.write_job(
        "mixed",
        &format!(
            "name: mixed\ntaskRoles:\n  q:\n    instances: 5\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 0.25}}\n    commands:\n{c}  pair:\n    instances: 1\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 2}}\n    commands:\n{c}",
            c = holding_task(&dir)
        ),
    );
    let plan = rm.plan_json(&job);
    let planned: BTreeMap<String, (u64, Option<String>)> = plan["placements"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                format!("{}/{}", p["role"].as_str().unwrap(), p["index"]),
                (
                    parse_mask(p["gpuMask"].as_str().unwrap()),
                    p["gpuShare"].as_str().map(str::to_string),
                ),
            )
        })
        .collect();
    let sub = rm.submit(&job);
    wait_for(START_TIMEOUT, "all six tasks running", || {
        (started(&dir).len() == 6).then_some(())
    });
    let envs = envs(&dir);
    let mask_of = |t: &str| parse_mask(&envs[t]["GPUAM_GPU_MASK"]);
    for (task, (mask, share)) in &planned {
        assert_eq!(mask_of(task), *mask, "{task} got what plan said");
        assert_eq!(envs[task].get("GPUAM_GPU_FRACTION"), share.as_ref(), "{task}");
    }
    let quarters: Vec<u64> = (0..5).map(|i| mask_of(&format!("q/{i}"))).collect();
    let full = quarters
        .iter()
        .copied()
        .find(|m| quarters.iter().filter(|x| *x == m).count() == 4)
        .expect("four quarters share one GPU");
    let fifth = quarters.iter().copied().find(|m| *m != full).unwrap();
    let pair = mask_of("pair/0");
    let topo = gpuam::topology::Topology::preset("pcie4").unwrap();
    assert_eq!(pair.count_ones(), 2);
    assert_eq!(pair & (full | fifth), 0, "the pair shares no GPU with the quarters");
    assert_eq!(
        topo.tier(pair),
        topo.best_tier(2),
        "the pair is a best pair of the node (the quarters kept one free): quarters on {full:#x} and {fifth:#x}, pair {pair:#x}"
    );
    fs::write(dir.join("go"), "").unwrap();
    let out = sub.wait(JOB_TIMEOUT);
    assert_eq!(out.code, 0, "{out:?}\n{}", rm.logs());
    rm.assert_all_free(FREE_TIMEOUT);
}

#[test]
fn a_task_needing_nvme_lands_only_where_one_is_free_and_waits_when_none_is() {
    let rm = Rm::start(
        "nodes:\n  - host: plain\n    cpu: 64\n    memoryMB: 64000\n    ports: \"20000-20009\"\n  - host: disk\n    cpu: 8\n    memoryMB: 8000\n    ports: \"20000-20009\"\n    resources: {nvme: 1}\n",
        &[
            ("GPUAM__SELECT__SEED", "0"),
            ("GPUAM__AM__NOT_AVAILABLE_RETRY_MIN_MS", "100"),
            ("GPUAM__AM__NOT_AVAILABLE_RETRY_MAX_MS", "300"),
        ],
    );
    let dir = rm.root().join("n");
    fs::create_dir(&dir).unwrap();
    let spec = |name: &str, nvme: u32| {
        format!(
            "name: {name}\ntaskRoles:\n  io:\n    instances: 2\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 0, resources: {{nvme: {nvme}}}}}\n    commands:\n{}",
            holding_task(&dir)
        )
    };
    // More than any node has: impossible, and `plan` says which nodes have it.
    let too_many = rm.write_job("too-many", &spec("too-many", 2));
    let out = rm
        .gpuam()
        .arg("plan")
        .arg(&too_many)
        .arg("--cluster")
        .arg(rm.path("cluster.yaml"))
        .arg("--json")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let plan: Value = serde_json::from_slice(&out.stdout).unwrap();
    let u = &plan["unplaced"][0];
    assert_eq!(u["impossible"], true, "{u}");
    assert!(
        u["reason"].as_str().unwrap().contains("no node has 2 nvme") && u["reason"].as_str().unwrap().contains("disk"),
        "{u}"
    );

    let job = rm.write_job("io", &spec("io", 1));
    let sub = rm.submit(&job);
    let app = sub.app_id(Duration::from_secs(10));
    wait_for(START_TIMEOUT, "one io task running", || {
        (started(&dir).len() == 1).then_some(())
    });
    let first = started(&dir)[0].clone();
    let second = if first == "io/0" { "io/1" } else { "io/0" }.to_string();
    let env = &envs(&dir)[&first];
    assert_eq!(env["GPUAM_HOST"], "disk");
    assert_eq!(
        (env["GPUAM_RESOURCE_NVME"].as_str(), env["GPUAM_RESOURCES"].as_str()),
        ("1", "nvme=1")
    );
    let disk = node_json(&rm, "disk");
    assert_eq!(disk["customResources"], serde_json::json!({"nvme": 1}), "{disk}");
    assert_eq!(disk["usedCustomResources"], serde_json::json!({"nvme": 1}), "{disk}");
    let reason = wait_reason(&rm, &app, &second, "no node has 1 nvme free");
    assert_eq!(reason, "no node has 1 nvme free; nodes with nvme: disk");
    assert_eq!(rm.node("plain").containers, 0, "nothing went where no nvme is");

    fs::write(dir.join(format!("go.{}", first.replacen('/', ".", 1))), "").unwrap();
    wait_for(START_TIMEOUT, "the second io task to start", || {
        started(&dir).contains(&second).then_some(())
    });
    assert_eq!(envs(&dir)[&second]["GPUAM_HOST"], "disk");
    assert!(time_of(&dir, "started", &second) > time_of(&dir, "ended", &first));
    fs::write(dir.join("go"), "").unwrap();
    let out = sub.wait(JOB_TIMEOUT);
    assert_eq!(out.code, 0, "{out:?}\n{}", rm.logs());
    rm.assert_all_free(FREE_TIMEOUT);
}

#[test]
fn validate_explains_shares_and_refuses_what_is_not_one() {
    let rm = Rm::start(
        "nodes:\n  - host: n\n    cpu: 4\n    memoryMB: 4000\n    gpus: 1\n",
        &[],
    );
    let ok = rm.write_job(
        "ok",
        "name: ok\ntaskRoles:\n  q:\n    instances: 2\n    resourcePerInstance: {cpu: 1, memoryMB: 100, gpu: 0.25, resources: {nvme: 1}}\n    commands: [\"true\"]\n",
    );
    let out = rm.gpuam().arg("validate").arg(&ok).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("q: 2 × cpu 1, memoryMB 100, gpu 0.25 (a share of one GPU"),
        "{text}"
    );
    assert!(text.contains("resources nvme=1"), "{text}");
    for (gpu, says, fix) in [
        ("1.5", "above 1, GPUs are whole", "use 1 or 2"),
        ("0.001", "finer than 0.01", "0.25"),
    ] {
        let bad = rm.write_job(
            "bad",
            &format!("name: bad\ntaskRoles:\n  q:\n    instances: 1\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: {gpu}}}\n    commands: [\"true\"]\n"),
        );
        let out = rm.gpuam().arg("validate").arg(&bad).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(65), "{err}");
        assert!(
            err.contains(":5:") && err.contains("taskRoles.q.resourcePerInstance.gpu"),
            "{err}"
        );
        assert!(err.contains(says) && err.contains(fix), "{err}");
    }
}

/// A node agent and an RM on loopback; dropping kills both (by pid) and removes nothing
/// else. The agent runs each user's tasks as the user's own uid.
struct AgentCluster {
    dir: tempfile::TempDir,
    procs: Vec<Child>,
    url: String,
}

impl AgentCluster {
    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn start(agent_args: &[&str]) -> AgentCluster {
        let dir = tempfile::Builder::new().prefix("gpuam-itest-agent-").tempdir().unwrap();
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o711)).unwrap();
        let made = std::process::Command::new(common::bin())
            .args(["node-token", "new", "--host", "agent-1", "--nodes-file"])
            .arg(dir.path().join("nodes.yaml"))
            .arg("--out")
            .arg(dir.path().join("node.token"))
            .output()
            .unwrap();
        assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
        fs::write(dir.path().join("gpuam.yaml"), "rm:\n  container_expiry_sec: 600\n").unwrap();
        let mut c = AgentCluster {
            dir,
            procs: Vec::new(),
            url: String::new(),
        };
        let rm = c.spawn(
            "rm",
            &[
                "rm",
                "--listen",
                "127.0.0.1:0",
                "--work-dir",
                &c.path("rm").display().to_string(),
                "--nodes-file",
                &c.path("nodes.yaml").display().to_string(),
                "--in-memory",
            ],
        );
        c.procs.push(rm);
        c.url = wait_for(Duration::from_secs(20), "the RM's `listening on` line", || {
            fs::read_to_string(c.path("rm.stdout"))
                .ok()?
                .lines()
                .find_map(|l| l.strip_prefix("gpuam rm listening on "))
                .and_then(|r| r.split_whitespace().next())
                .map(str::to_string)
        });
        let mut args = vec![
            "node".to_string(),
            "--rm".into(),
            c.url.clone(),
            "--host".into(),
            "agent-1".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--node-token-file".into(),
            c.path("node.token").display().to_string(),
            "--topology".into(),
            "none".into(),
            "--cpu".into(),
            "4".into(),
            "--memory-mb".into(),
            "4096".into(),
            "--ports".into(),
            "20000-20100".into(),
            "--work-dir".into(),
            c.path("agent-work").display().to_string(),
        ];
        args.extend(agent_args.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let agent = c.spawn("agent", &args);
        c.procs.push(agent);
        c
    }

    fn spawn(&self, name: &str, args: &[&str]) -> Child {
        let mut cmd = Command::new(bin());
        for (k, _) in std::env::vars() {
            if k.starts_with("GPUAM") {
                cmd.env_remove(k);
            }
        }
        cmd.args(args)
            .current_dir(self.dir.path())
            .env("GPUAM_CONFIG", self.path("gpuam.yaml"))
            .env("GPUAM_LOG", "info")
            .stdin(Stdio::null())
            .stdout(fs::File::create(self.path(&format!("{name}.stdout"))).unwrap())
            .stderr(fs::File::create(self.path(&format!("{name}.stderr"))).unwrap())
            .spawn()
            .unwrap()
    }

    fn nodes(&self) -> Option<Value> {
        let out = Command::new("curl")
            .args(["-sf", &format!("{}/ws/v1/cluster/nodes", self.url)])
            .output()
            .ok()?;
        serde_json::from_slice(&out.stdout).ok()
    }

    fn logs(&self) -> String {
        let mut s = String::new();
        for f in ["rm.stderr", "agent.stderr"] {
            s.push_str(&format!(
                "--- {f}\n{}\n",
                fs::read_to_string(self.path(f)).unwrap_or_default()
            ));
        }
        s
    }
}

impl Drop for AgentCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
        }
        // The agent first (it stops its containers), then the RM (it stops its AMs).
        for c in self.procs.iter_mut().rev() {
            unsafe {
                libc::kill(c.id() as i32, libc::SIGINT);
            }
            for _ in 0..200 {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(25));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn a_node_agent_offers_custom_resources_and_runs_shares_it_was_granted() {
    if Command::new("curl").arg("--version").output().is_err() {
        panic!("this test needs curl (apt-get install curl)");
    }
    let c = AgentCluster::start(&["--gpus", "1", "--resource", "nvme=2", "--resource", "ib_hca=1"]);
    let node = wait_for(Duration::from_secs(30), "the agent to register", || {
        c.nodes()?["nodes"]["node"].as_array()?.first().cloned()
    });
    assert_eq!(
        node["customResources"],
        serde_json::json!({"ib_hca": 1, "nvme": 2}),
        "{node}"
    );
    // Two half-GPU tasks with an nvme each: both run at once on GPU 0 through the agent,
    // which checks the RM's signed grant (shares and custom resources included).
    let shared = c.path("shared");
    fs::create_dir(&shared).unwrap();
    fs::set_permissions(&shared, fs::Permissions::from_mode(0o777)).unwrap();
    let s = shared.display();
    let job = c.path("halves.yaml");
    fs::write(
        &job,
        format!(
            "name: halves\ntaskRoles:\n  h:\n    instances: 2\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 0.5, resources: {{nvme: 1}}}}\n    commands:\n{}",
            commands(&[
                format!("env | sort > {s}/env.$GPUAM_TASK_INDEX.tmp && mv {s}/env.$GPUAM_TASK_INDEX.tmp {s}/env.$GPUAM_TASK_INDEX"),
                format!("for i in $(seq 1200); do [ -e {s}/env.0 ] && [ -e {s}/env.1 ] && break; sleep 0.1; done"),
                format!("[ -e {s}/env.0 ] && [ -e {s}/env.1 ]"),
            ])
        ),
    )
    .unwrap();
    let admin = fs::read_to_string(c.path("rm/admin.token")).unwrap();
    let out = Command::new(bin())
        .args(["submit"])
        .arg(&job)
        .args(["--rm", &c.url, "--wait"])
        .env("GPUAM_TOKEN", admin.trim())
        .env("GPUAM_CONFIG", c.path("gpuam.yaml"))
        .current_dir(c.dir.path())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        c.logs()
    );
    for i in 0..2 {
        let env = read_env_file(&shared.join(format!("env.{i}")));
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "0");
        assert_eq!(env["GPUAM_GPU_FRACTION"], "0.5");
        assert_eq!(env["GPUAM_RESOURCE_NVME"], "1");
        assert_eq!(env["GPUAM_HOST"], "agent-1");
    }
    let node = wait_for(FREE_TIMEOUT, "the agent's node to be free again", || {
        let n = c.nodes()?["nodes"]["node"].as_array()?.first().cloned()?;
        (n["numContainers"] == 0).then_some(n)
    });
    assert_eq!(node["usedGpuAttribute"], "0x0", "{node}");
    assert_eq!(node["usedCustomResources"], serde_json::json!({}), "{node}");
}
