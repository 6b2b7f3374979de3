//! End-to-end tests of whole jobs on the running system: a real `gpuam rm` process,
//! the real `gpuam am` processes it launches, and real task process groups (small bash
//! snippets that record their environment, pids and timings into the test's temporary
//! directory). Covered: placement equal to `gpuam plan`, the environment contract,
//! retries, completion policies, a gang held whole or not at all, kill, and two concurrent
//! jobs never sharing a GPU bit or a port. Every test ends by checking that the RM's
//! ledger is back to its baseline.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::time::{Duration, Instant};

use common::{
    group_members, parse_container_ports, parse_mask, parse_ranges, pid_alive, read_env_file, sq, wait_for,
    wait_groups_gone, Rm,
};
use rand::{Rng, SeedableRng};

const JOB_TIMEOUT: Duration = Duration::from_secs(40);
const FREE_TIMEOUT: Duration = Duration::from_secs(5);

/// A block list of commands for a job file.
fn commands(cmds: &[&str]) -> String {
    cmds.iter().map(|c| format!("      - {}\n", sq(c))).collect()
}

#[test]
fn placement_and_environment_match_the_plan() {
    let rm = Rm::start(
        r#"
nodes:
  - host: gpu-a
    rack: /r1
    cpu: 32
    memoryMB: 64000
    gpus: 4
    ports: "20000-20015"
  - host: gpu-b
    rack: /r1
    cpu: 32
    memoryMB: 64000
    gpus: 4
    ports: "20000-20015"
    used: {cpu: 2, memoryMB: 1000, gpuMask: "0x1", ports: "20000-20001"}
  - host: cpu-c
    rack: /r2
    cpu: 16
    memoryMB: 32000
    ports: "20000-20015"
"#,
        &[("GPUAM__SELECT__SEED", "0")],
    );
    let root = rm.root().display().to_string();
    let record = format!("env | sort > {root}/env.$GPUAM_TASK_ROLE.$GPUAM_TASK_INDEX");
    let hello = "echo \"hello from $GPUAM_TASK_ROLE $GPUAM_TASK_INDEX on $GPUAM_HOST\"";
    let job = rm.write_job(
        "placement",
        &format!(
            "name: placement\ngang: true\ntaskRoles:\n  ps:\n    instances: 1\n    resourcePerInstance: {{cpu: 2, memoryMB: 1000, gpu: 0, ports: {{rpc: 1}}}}\n    commands:\n{}  worker:\n    instances: 3\n    resourcePerInstance: {{cpu: 4, memoryMB: 2000, gpu: 2, ports: {{nccl: 1, http: 2}}}}\n    commands:\n{}",
            commands(&[&record, hello]),
            commands(&[&record, hello]),
        ),
    );
    let plan = rm.plan_json(&job);
    assert_eq!(plan["unplaced"].as_array().map(Vec::len), Some(0), "{plan}");
    let placements = plan["placements"].as_array().unwrap().clone();
    assert_eq!(placements.len(), 4, "{plan}");

    let out = rm.run_job(&job, JOB_TIMEOUT);
    assert_eq!(out.code, 0, "{out:?}\n{}", rm.logs());
    let last = out.stdout.lines().last().unwrap_or("");
    assert!(
        last.starts_with("job application_") && last.contains("Succeeded"),
        "{last}"
    );

    let expected_labels: BTreeMap<&str, Vec<&str>> =
        BTreeMap::from([("ps", vec!["rpc"]), ("worker", vec!["nccl", "http"])]);
    let mut envs: BTreeMap<(String, u64), BTreeMap<String, String>> = BTreeMap::new();
    for p in &placements {
        let role = p["role"].as_str().unwrap();
        let index = p["index"].as_u64().unwrap();
        let env = read_env_file(&rm.path(&format!("env.{role}.{index}")));
        let host = p["host"].as_str().unwrap();
        let gpus: Vec<String> = p["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g.as_u64().unwrap().to_string())
            .collect();
        let mask = parse_mask(p["gpuMask"].as_str().unwrap());
        let ctx = format!("task {role}/{index}: plan {p}");
        assert_eq!(env["GPUAM_HOST"], host, "{ctx}");
        assert_eq!(env["GPUAM_GPU_MASK"], format!("{mask:#x}"), "{ctx}");
        assert_eq!(env["CONTAINER_GPUS"], mask.to_string(), "{ctx}");
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], gpus.join(","), "{ctx}");
        let nvidia = if gpus.is_empty() {
            "none".to_string()
        } else {
            gpus.join(",")
        };
        assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], nvidia, "{ctx}");
        assert_eq!(mask.count_ones() as usize, if role == "ps" { 0 } else { 2 }, "{ctx}");
        // Ports: GPUAM_PORT_<LABEL> and CONTAINER_PORTS (labels in spec order) equal the plan's.
        let cports = parse_container_ports(&env["CONTAINER_PORTS"]);
        let labels: Vec<&str> = cports.iter().map(|(l, _)| l.as_str()).collect();
        assert_eq!(labels, expected_labels[role], "{ctx}");
        for (label, ports) in &cports {
            let planned: Vec<u16> = p["ports"][label]
                .as_array()
                .unwrap_or_else(|| panic!("{ctx}: no ports `{label}` in the plan"))
                .iter()
                .map(|x| x.as_u64().unwrap() as u16)
                .collect();
            assert_eq!(ports, &planned, "{ctx}: CONTAINER_PORTS {label}");
            let var = format!("GPUAM_PORT_{}", label.to_uppercase());
            let joined: Vec<String> = planned.iter().map(u16::to_string).collect();
            assert_eq!(env[&var], joined.join(","), "{ctx}: {var}");
        }
        assert_eq!(p["ports"].as_object().unwrap().len(), cports.len(), "{ctx}");
        assert_eq!(env["GPUAM_TASK_ROLE"], role, "{ctx}");
        assert_eq!(env["GPUAM_TASK_INDEX"], index.to_string(), "{ctx}");
        assert_eq!(env["GPUAM_ATTEMPT"], "1", "{ctx}");
        assert_eq!(env["GPUAM_JOB"], "placement", "{ctx}");
        // The task's stdout log holds what it printed.
        let dir = std::path::PathBuf::from(&env["GPUAM_CONTAINER_DIR"]);
        assert!(
            dir.starts_with(rm.work_dir.join("containers")),
            "{ctx}: {}",
            dir.display()
        );
        // The task's own directory is `work/` in the node's record of the container, which
        // holds its logs; the record is named by the task's role and index, then its id.
        let record = dir.parent().unwrap();
        let name = format!(
            "{}-{}@{}",
            env["GPUAM_TASK_ROLE"], env["GPUAM_TASK_INDEX"], env["GPUAM_CONTAINER_ID"]
        );
        assert!(
            dir.ends_with("work") && record.ends_with(&name),
            "{ctx}: {}",
            dir.display()
        );
        let stdout = fs::read_to_string(record.join("stdout")).unwrap();
        assert!(
            stdout.contains(&format!("hello from {role} {index} on {host}")),
            "{ctx}: stdout log is {stdout:?}"
        );
        envs.insert((role.to_string(), index), env);
    }

    // Peers: GPUAM_HOSTS_<ROLE> is "host:firstPort" in index order, the same in every task.
    for role in ["ps", "worker"] {
        let expect: Vec<String> = envs
            .iter()
            .filter(|((r, _), _)| r == role)
            .map(|(_, env)| {
                let first = parse_container_ports(&env["CONTAINER_PORTS"])[0].1[0];
                format!("{}:{first}", env["GPUAM_HOST"])
            })
            .collect();
        let var = format!("GPUAM_HOSTS_{}", role.to_uppercase());
        for ((r, i), env) in &envs {
            assert_eq!(env[&var], expect.join(","), "{var} in task {r}/{i}");
        }
    }

    // Independent of the plan: no two tasks on one host share a GPU bit or a port, and
    // nobody got the node's baseline `used` resources.
    assert_disjoint(&envs.values().map(|e| Rec::from_env(e, 0, 1)).collect::<Vec<_>>(), &rm);
    rm.assert_all_free(FREE_TIMEOUT);
}

/// `gpuam plan` runs the AM's own job machine against an RM that grants every ask as asked,
/// so on an idle cluster the placements it prints are the ones `gpuam run` makes (the seed
/// fixed): a gang over two roles, a task that first holds out for its ideal GPU tier (the
/// `*w` wait, shortened to 2 s; only `split` has the CPUs for it) and then takes the pair the
/// plan shows, and a role that places after another role's tasks have taken the best nodes.
#[test]
fn plan_and_run_place_every_task_alike() {
    let rm = Rm::start(
        r#"
nodes:
  - host: split
    rack: /r1
    cpu: 64
    memoryMB: 64000
    gpus: 4
    topology: pcie4
    ports: "20000-20015"
    used: {cpu: 2, memoryMB: 1000, gpuMask: "0x5", ports: "20000-20001"}
  - host: eight
    rack: /r2
    cpu: 32
    memoryMB: 64000
    gpus: 8
    topology: dgx1v
    ports: "20000-20015"
  - host: cpu-c
    rack: /r2
    cpu: 16
    memoryMB: 32000
    ports: "20000-20015"
"#,
        &[("GPUAM__SELECT__SEED", "0"), ("GPUAM__SELECT__TOPOLOGY_WAIT_SEC", "2")],
    );
    let root = rm.root().display().to_string();
    let record = format!("env | sort > {root}/env.$GPUAM_JOB.$GPUAM_TASK_ROLE.$GPUAM_TASK_INDEX");
    let role = |name: &str, n: u32, cpu: u32, gpus: u32, ports: &str| {
        format!(
            "  {name}:\n    instances: {n}\n    resourcePerInstance: {{cpu: {cpu}, memoryMB: 1000, gpu: {gpus}, ports: {{{ports}}}}}\n    commands:\n{}",
            commands(&[&record])
        )
    };
    let jobs = [
        (
            "gang",
            format!(
                "name: gang\ngang: true\ntaskRoles:\n{}{}",
                role("ps", 1, 2, 0, "rpc: 1"),
                role("worker", 3, 4, 2, "nccl: 1")
            ),
        ),
        (
            "waits",
            format!("name: waits\ntaskRoles:\n{}", role("w", 1, 40, 2, "http: 1")),
        ),
        (
            "spread",
            format!(
                "name: spread\ntaskRoles:\n{}{}",
                role("big", 2, 8, 3, "a: 1"),
                role("small", 3, 1, 1, "b: 2")
            ),
        ),
    ];
    let mut waited = false;
    for (name, yaml) in jobs {
        let job = rm.write_job(name, &yaml);
        let plan = rm.plan_json(&job);
        assert_eq!(plan["unplaced"].as_array().map(Vec::len), Some(0), "{name}: {plan}");
        let out = rm.run_job(&job, JOB_TIMEOUT);
        assert_eq!(out.code, 0, "{name}: {out:?}\n{}", rm.logs());
        for p in plan["placements"].as_array().unwrap() {
            let (r, i) = (p["role"].as_str().unwrap(), p["index"].as_u64().unwrap());
            let env = read_env_file(&rm.path(&format!("env.{name}.{r}.{i}")));
            let ctx = format!("{name} {r}/{i}: plan {p}");
            assert_eq!(env["GPUAM_HOST"], p["host"].as_str().unwrap(), "{ctx}");
            let mask = parse_mask(p["gpuMask"].as_str().unwrap());
            assert_eq!(env["GPUAM_GPU_MASK"], format!("{mask:#x}"), "{ctx}");
            let ports: BTreeMap<String, Vec<u16>> =
                parse_container_ports(&env["CONTAINER_PORTS"]).into_iter().collect();
            let planned: BTreeMap<String, Vec<u16>> = serde_json::from_value(p["ports"].clone()).unwrap();
            assert_eq!(ports, planned, "{ctx}");
            waited |= p["topologyWaitSec"] == 2;
        }
        wait_for(FREE_TIMEOUT, "the cluster to be idle again", || {
            (rm.node("eight").gpu_used == 0 && rm.node("split").gpu_used == 0x5).then_some(())
        });
    }
    assert!(waited, "one task took its pair after the topology wait");
}

#[test]
fn failing_task_retries_then_the_job_fails() {
    let rm = Rm::start(
        "nodes:\n  - host: n1\n    cpu: 8\n    memoryMB: 8000\n    gpus: 2\n    ports: \"20000-20009\"\n",
        &[],
    );
    let attempts = rm.path("attempts");
    let job = rm.write_job(
        "retry",
        &format!(
            "name: retry\ntaskRoles:\n  flaky:\n    instances: 1\n    taskRetryCount: 2\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1}}\n    commands:\n{}",
            commands(&[
                &format!("echo \"$GPUAM_ATTEMPT $GPUAM_CONTAINER_ID\" >> {}", attempts.display()),
                "exit 1",
            ])
        ),
    );
    let sub = rm.submit(&job);
    let app = sub.app_id(Duration::from_secs(10));
    let out = sub.wait(JOB_TIMEOUT);
    assert_eq!(out.code, 1, "{out:?}\n{}", rm.logs());
    let last = out.stdout.lines().last().unwrap_or("");
    assert!(last.starts_with(&format!("job {app} Failed")), "{last}");

    let lines: Vec<String> = fs::read_to_string(&attempts)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(lines.len(), 3, "the task ran {} times: {lines:?}", lines.len());
    let nums: Vec<&str> = lines.iter().map(|l| l.split(' ').next().unwrap()).collect();
    assert_eq!(nums, ["1", "2", "3"]);
    let ids: BTreeSet<&str> = lines.iter().map(|l| l.split(' ').nth(1).unwrap()).collect();
    assert_eq!(ids.len(), 3, "each attempt has its own container: {lines:?}");
    assert_eq!(rm.container_dirs(&app).len(), 3);

    let a = rm.app(&app);
    assert_eq!(a["finalStatus"], "FAILED", "{a}");
    assert_eq!(a["exitCode"], 1, "{a}");
    rm.assert_all_free(FREE_TIMEOUT);
}

#[test]
fn never_ending_ps_is_stopped_when_workers_succeed() {
    let rm = Rm::start(
        "nodes:\n  - host: n1\n    cpu: 8\n    memoryMB: 8000\n    gpus: 2\n    ports: \"20000-20009\"\n  - host: c1\n    cpu: 8\n    memoryMB: 8000\n    ports: \"20000-20009\"\n",
        &[],
    );
    let root = rm.root().display().to_string();
    // Workers wait (bounded) until both PS wrote their pid, so the PS surely run.
    let wait_ps = format!(
        "for i in $(seq 200); do [ -s {root}/ps.0.pid ] && [ -s {root}/ps.1.pid ] && exit 0; sleep 0.05; done; exit 3"
    );
    let job = rm.write_job(
        "psw",
        &format!(
            "name: psw\ntaskRoles:\n  ps:\n    instances: 2\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 0, ports: {{grpc: 1}}}}\n    commands:\n{}  worker:\n    instances: 2\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1}}\n    completion: {{minSucceededInstances: 2}}\n    commands:\n{}",
            commands(&[
                &format!("echo $$ > {root}/ps.$GPUAM_TASK_INDEX.tmp && mv {root}/ps.$GPUAM_TASK_INDEX.tmp {root}/ps.$GPUAM_TASK_INDEX.pid"),
                "sleep 300",
            ]),
            commands(&[&format!("( {wait_ps} )"), "sleep 0.3"]),
        ),
    );
    let sub = rm.submit(&job);
    let app = sub.app_id(Duration::from_secs(10));
    let out = sub.wait(JOB_TIMEOUT);
    assert_eq!(out.code, 0, "{out:?}\n{}", rm.logs());
    assert!(out.elapsed < Duration::from_secs(15), "took {:?}", out.elapsed);
    assert_eq!(rm.app(&app)["finalStatus"], "SUCCEEDED");

    let pids: Vec<i32> = (0..2)
        .map(|i| {
            fs::read_to_string(rm.path(&format!("ps.{i}.pid")))
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        })
        .collect();
    // Each container leads its own process group, so the group is the PS and its `sleep`.
    wait_groups_gone(&pids, Duration::from_secs(5));
    for p in &pids {
        assert!(!pid_alive(*p), "PS pid {p} still alive");
    }
    rm.assert_all_free(FREE_TIMEOUT);
}

/// A gang is asked for whole (issue 16): while only part of it fits, it holds nothing at
/// all (so it neither blocks others nor needs its gang timeout), then starts whole once
/// it fits.
#[test]
fn a_gang_holds_nothing_until_it_fits_whole_then_completes() {
    let rm = Rm::start(
        "nodes:\n  - host: n1\n    cpu: 8\n    memoryMB: 8000\n    gpus: 4\n    ports: \"20000-20009\"\n  - host: n2\n    cpu: 8\n    memoryMB: 8000\n    gpus: 4\n    ports: \"20000-20009\"\n",
        &[("GPUAM__AM__NOT_AVAILABLE_RETRY_MAX_MS", "800")],
    );
    let holder = rm.write_job(
        "holder",
        &format!(
            "name: holder\ntaskRoles:\n  hold:\n    instances: 1\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 4}}\n    commands:\n{}",
            commands(&["sleep 300"])
        ),
    );
    let sub_a = rm.submit(&holder);
    let app_a = sub_a.app_id(Duration::from_secs(10));
    let held = wait_for(Duration::from_secs(10), "job A to hold a whole node", || {
        rm.nodes().into_iter().find(|n| n.gpu_used == 0xf).map(|n| n.host)
    });
    let other = if held == "n1" { "n2" } else { "n1" };

    // Job B: a gang of 3 × 2 GPUs; only 2 fit beside job A.
    let started = rm.path("b.started");
    let gang = rm.write_job(
        "gang",
        &format!(
            "name: gang\ngang: true\ngangTimeoutSec: 2\ntaskRoles:\n  w:\n    instances: 3\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 2}}\n    commands:\n{}",
            commands(&[
                &format!("echo $GPUAM_TASK_INDEX >> {}", started.display()),
                "sleep 0.2"
            ])
        ),
    );
    let sub_b = rm.submit(&gang);
    let app_b = sub_b.app_id(Duration::from_secs(10));
    // B is registered and waiting...
    wait_for(Duration::from_secs(20), "job B to wait for its gang", || {
        let v = rm.get_json("/ws/v1/cluster/overview").ok()?;
        let b = v["apps"]
            .as_array()?
            .iter()
            .find(|a| a["id"] == app_b.as_str())?
            .clone();
        (b["waitingTasks"] == 3).then_some(())
    });
    // ... and holds nothing of the other node meanwhile (its gang timeout is 2 s; nothing
    // to time out, since nothing is held).
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        let n = rm.node(other);
        assert_eq!(
            (n.gpu_used, n.containers),
            (0, 0),
            "part of the gang was granted: {n:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !started.exists(),
        "a gang task started before the whole gang was placed"
    );
    assert_eq!(rm.node(&held).gpu_used, 0xf, "job A still holds its node");

    rm.kill_app(&app_a);
    let out_a = sub_a.wait(Duration::from_secs(15));
    assert_eq!(out_a.code, 1, "{out_a:?}");
    assert_eq!(rm.app(&app_a)["state"], "KILLED");

    let out_b = sub_b.wait(JOB_TIMEOUT);
    assert_eq!(out_b.code, 0, "{out_b:?}\n{}", rm.logs());
    assert_eq!(rm.app(&app_b)["finalStatus"], "SUCCEEDED");
    let mut idx: Vec<String> = fs::read_to_string(&started)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    idx.sort();
    assert_eq!(idx, ["0", "1", "2"]);
    rm.assert_all_free(FREE_TIMEOUT);
}

#[test]
fn kill_stops_every_process_of_the_job() {
    let rm = Rm::start(
        "nodes:\n  - host: n1\n    cpu: 8\n    memoryMB: 8000\n    gpus: 2\n    ports: \"20000-20009\"\n",
        &[],
    );
    let root = rm.root().display().to_string();
    let job = rm.write_job(
        "killme",
        &format!(
            "name: killme\ntaskRoles:\n  bg:\n    instances: 2\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1}}\n    commands:\n{}",
            commands(&[
                &format!("echo $$ $(awk '{{print $5}}' /proc/$$/stat) > {root}/pg.$GPUAM_TASK_INDEX.tmp && mv {root}/pg.$GPUAM_TASK_INDEX.tmp {root}/pg.$GPUAM_TASK_INDEX"),
                "sleep 300 & sleep 300 & wait",
            ])
        ),
    );
    let sub = rm.submit(&job);
    let app = sub.app_id(Duration::from_secs(10));
    let pgids: Vec<i32> = (0..2)
        .map(|i| {
            let text = wait_for(Duration::from_secs(15), "the tasks to record their group", || {
                fs::read_to_string(rm.path(&format!("pg.{i}"))).ok()
            });
            let f: Vec<i32> = text.split_whitespace().map(|x| x.parse().unwrap()).collect();
            assert_eq!(f[0], f[1], "task {i}: its shell leads its own process group");
            f[1]
        })
        .collect();
    for &g in &pgids {
        // The shell and its two background sleeps.
        wait_for(Duration::from_secs(10), "the background children to start", || {
            (group_members(g).len() >= 3).then_some(())
        });
    }

    rm.kill_app(&app);
    wait_groups_gone(&pgids, Duration::from_secs(5));
    let out = sub.wait(Duration::from_secs(15));
    assert_eq!(out.code, 1, "{out:?}");
    let a = rm.app(&app);
    assert_eq!(a["state"], "KILLED", "{a}");
    assert_eq!(a["finalStatus"], "KILLED", "{a}");
    rm.assert_all_free(FREE_TIMEOUT);
}

/// What a task recorded about itself.
#[derive(Clone, Debug)]
struct Rec {
    job: String,
    index: u32,
    host: String,
    mask: u64,
    ports: Vec<u16>,
    port_labels: Vec<(String, usize)>,
    start: u128,
    end: u128,
}

impl Rec {
    fn from_env(env: &BTreeMap<String, String>, start: u128, end: u128) -> Rec {
        let cports = parse_container_ports(&env["CONTAINER_PORTS"]);
        Rec {
            job: env["GPUAM_JOB"].clone(),
            index: env["GPUAM_TASK_INDEX"].parse().unwrap(),
            host: env["GPUAM_HOST"].clone(),
            mask: parse_mask(&env["GPUAM_GPU_MASK"]),
            ports: cports.iter().flat_map(|(_, p)| p.iter().copied()).collect(),
            port_labels: cports.iter().map(|(l, p)| (l.clone(), p.len())).collect(),
            start,
            end,
        }
    }
}

/// No two tasks whose lifetimes overlapped on one host share a GPU bit or a port, and
/// none got what the node's baseline already uses or what the node does not have.
fn assert_disjoint(recs: &[Rec], rm: &Rm) {
    for r in recs {
        let node = rm
            .baseline
            .iter()
            .find(|n| n.host == r.host)
            .unwrap_or_else(|| panic!("{r:?}: unknown host"));
        assert_eq!(r.mask & !node.gpu_total, 0, "{r:?}: GPU outside the node");
        assert_eq!(r.mask & node.gpu_used, 0, "{r:?}: GPU of the baseline");
        let total = parse_ranges(&node.ports_total);
        let used = parse_ranges(&node.ports_used);
        for p in &r.ports {
            assert!(total.contains(p), "{r:?}: port {p} outside the node");
            assert!(!used.contains(p), "{r:?}: port {p} of the baseline");
        }
    }
    for (i, a) in recs.iter().enumerate() {
        for b in &recs[i + 1..] {
            let overlap = a.host == b.host && a.start < b.end && b.start < a.end;
            if !overlap {
                continue;
            }
            assert_eq!(a.mask & b.mask, 0, "GPU bit shared:\n{a:?}\n{b:?}");
            let shared: Vec<&u16> = a.ports.iter().filter(|p| b.ports.contains(p)).collect();
            assert!(shared.is_empty(), "ports {shared:?} shared:\n{a:?}\n{b:?}");
        }
    }
}

#[test]
fn two_concurrent_jobs_never_share_a_gpu_or_a_port() {
    const CLUSTER: &str = r#"
nodes:
  - host: n1
    cpu: 16
    memoryMB: 16000
    gpus: 4
    ports: "20000-20015"
    used: {gpuMask: "0x1", ports: "20000-20003"}
  - host: n2
    cpu: 16
    memoryMB: 16000
    gpus: 4
    ports: "20000-20015"
    used: {cpu: 2, memoryMB: 1000, gpuMask: "0x8", ports: "20010-20011"}
  - host: n3
    cpu: 16
    memoryMB: 16000
    gpus: 4
    ports: "20000-20015"
"#;
    for round in 0..5u64 {
        let seed = round.to_string();
        // Both AMs get the same seed: the most collisions the RM must refuse.
        let rm = Rm::start(CLUSTER, &[("GPUAM__SELECT__SEED", &seed)]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(round);
        let root = rm.root().display().to_string();
        let record = format!(
            "s=$(date +%s%N); sleep 0.5; e=$(date +%s%N); env | sort > {root}/rec.$GPUAM_JOB.$GPUAM_TASK_INDEX.$GPUAM_ATTEMPT.tmp && echo \"$s $e\" > {root}/time.$GPUAM_JOB.$GPUAM_TASK_INDEX.$GPUAM_ATTEMPT && mv {root}/rec.$GPUAM_JOB.$GPUAM_TASK_INDEX.$GPUAM_ATTEMPT.tmp {root}/rec.$GPUAM_JOB.$GPUAM_TASK_INDEX.$GPUAM_ATTEMPT"
        );
        let mut shapes = BTreeMap::new();
        let mut subs = Vec::new();
        for name in ["a", "b"] {
            let (instances, gpu, ports) = (
                rng.gen_range(2..=4u32),
                rng.gen_range(1..=2u32),
                rng.gen_range(1..=2u32),
            );
            let job_name = format!("r{round}{name}");
            shapes.insert(job_name.clone(), (instances, gpu, ports));
            let job = rm.write_job(
                &job_name,
                &format!(
                    "name: {job_name}\ntaskRoles:\n  t:\n    instances: {instances}\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: {gpu}, ports: {{p: {ports}}}}}\n    commands:\n{}",
                    commands(&[&record])
                ),
            );
            subs.push(rm.submit(&job));
        }
        let round_start = Instant::now();
        for s in subs {
            let out = s.wait(JOB_TIMEOUT);
            eprintln!(
                "round {round}: a job ended after {:?} {:?}",
                round_start.elapsed(),
                shapes
            );
            assert_eq!(out.code, 0, "round {round}: {out:?}\n{}", rm.logs());
        }
        // At most 16 GPUs of work in 0.5 s slices on 10 free GPUs: a few seconds, unless
        // an AM idles beside free resources.
        let took = round_start.elapsed();
        assert!(took < Duration::from_secs(12), "round {round}: both jobs took {took:?}");

        let mut recs = Vec::new();
        for e in fs::read_dir(rm.root()).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(key) = name.strip_prefix("rec.").filter(|k| !k.ends_with(".tmp")) else {
                continue;
            };
            let env = read_env_file(&e.path());
            let times = fs::read_to_string(rm.path(&format!("time.{key}"))).unwrap();
            let t: Vec<u128> = times.split_whitespace().map(|x| x.parse().unwrap()).collect();
            recs.push(Rec::from_env(&env, t[0], t[1]));
        }
        // Every task ran and got exactly what its role asks for.
        let mut seen = BTreeSet::new();
        for r in &recs {
            let (_, gpu, ports) = shapes[&r.job];
            assert_eq!(r.mask.count_ones(), gpu, "round {round}: {r:?}");
            assert_eq!(
                r.port_labels,
                vec![("p".to_string(), ports as usize)],
                "round {round}: {r:?}"
            );
            seen.insert((r.job.clone(), r.index));
        }
        let want: BTreeSet<(String, u32)> = shapes
            .iter()
            .flat_map(|(j, (n, _, _))| (0..*n).map(move |i| (j.clone(), i)))
            .collect();
        assert_eq!(seen, want, "round {round}: tasks that ran");
        assert_disjoint(&recs, &rm);
        rm.assert_all_free(FREE_TIMEOUT);
    }
}

/// A temporary directory (and its path) holding `cluster.yaml`: one node `n1` of 8 CPUs,
/// 8000 MB and 2 GPUs, for `gpuam run --cluster`.
fn one_node_run_dir() -> (tempfile::TempDir, String) {
    let dir = Rm::temp_dir();
    let root = dir.path().display().to_string();
    fs::write(
        dir.path().join("cluster.yaml"),
        "nodes:\n  - host: n1\n    cpu: 8\n    memoryMB: 8000\n    gpus: 2\n",
    )
    .unwrap();
    (dir, root)
}

/// `gpuam run` of `dir`'s `job.yaml` on its `cluster.yaml`, with `dir/work` as its work dir.
fn gpuam_run_in(dir: &tempfile::TempDir) -> std::process::Command {
    let mut cmd = std::process::Command::new(common::bin());
    cmd.env("GPUAM__NODE__IN_PROCESS_IDENTITY", "false")
        .arg("run")
        .arg(dir.path().join("job.yaml"))
        .arg("--cluster")
        .arg(dir.path().join("cluster.yaml"))
        .arg("--work-dir")
        .arg(dir.path().join("work"));
    cmd
}

/// A `gpuam run` in `dir` of a job whose two tasks each start a daemon in a new session
/// (deaf to SIGTERM and SIGHUP) and sleep; once all of them run: the run, the task and
/// daemon pids, and the AM's pid.
struct LongRun {
    run: std::process::Child,
    pids: Vec<i32>,
    am: i32,
}

fn start_long_run(dir: &tempfile::TempDir, root: &str) -> LongRun {
    let daemon = "trap \"\" TERM HUP; while :; do sleep 0.05; done";
    fs::write(
        dir.path().join("job.yaml"),
        format!(
            "name: long\ntaskRoles:\n  w:\n    instances: 2\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1}}\n    commands:\n{}",
            commands(&[&format!(
                "setsid bash -c {} & echo $! >> {root}/pids; echo $$ >> {root}/pids; sleep 300",
                common::shell_quote(daemon)
            )])
        ),
    )
    .unwrap();
    let work = dir.path().join("work");
    let run = gpuam_run_in(dir)
        .env("GPUAM_DASHBOARD_LINGER_SEC", "0")
        .stdout(fs::File::create(dir.path().join("run.out")).unwrap())
        .stderr(fs::File::create(dir.path().join("run.err")).unwrap())
        .spawn()
        .unwrap();
    let pids: Vec<i32> = wait_for(Duration::from_secs(30), "both tasks and their daemons", || {
        let p: Vec<i32> = fs::read_to_string(dir.path().join("pids"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        (p.len() == 4).then_some(p)
    });
    let am = wait_for(Duration::from_secs(10), "the AM process", || {
        common::pids_with_cmdline(&[" am ", &work.display().to_string()])
            .into_iter()
            .next()
    });
    LongRun { run, pids, am }
}

/// SIGTERM (or SIGHUP, or Ctrl-C) on `gpuam run` kills the job and waits for its end:
/// no task process, no daemon a task started in a new session, and no AM is left.
#[test]
fn sigterm_on_gpuam_run_leaves_no_task_daemon_or_am() {
    let (dir, root) = one_node_run_dir();
    let LongRun { mut run, pids, am } = start_long_run(&dir, &root);
    unsafe {
        libc::kill(run.id() as i32, libc::SIGTERM);
    }
    let status = wait_for(Duration::from_secs(30), "gpuam run to exit", || run.try_wait().unwrap());
    let err = fs::read_to_string(dir.path().join("run.err")).unwrap_or_default();
    assert_eq!(status.code(), Some(1), "a killed job exits 1:\n{err}");
    for p in &pids {
        assert!(
            !pid_alive(*p),
            "task process or daemon {p} survived SIGTERM on gpuam run:\n{err}"
        );
    }
    assert!(!pid_alive(am), "the AM {am} survived SIGTERM on gpuam run:\n{err}");
}

/// SIGKILL on `gpuam run` (nothing of it can stop the job then): its reaper ends the AM,
/// the tasks and a daemon a task started in a new session, so that no process is left and
/// a second run cannot be granted GPUs the first run's tasks still use.
#[test]
fn sigkill_on_gpuam_run_leaves_no_task_daemon_or_am() {
    let (dir, root) = one_node_run_dir();
    let LongRun { mut run, pids, am } = start_long_run(&dir, &root);
    unsafe {
        libc::kill(run.id() as i32, libc::SIGKILL);
    }
    let _ = run.wait();
    let left = || -> Vec<i32> { pids.iter().copied().chain([am]).filter(|p| pid_alive(*p)).collect() };
    wait_for(Duration::from_secs(30), "the run's processes to be ended", || {
        left().is_empty().then_some(())
    });
    // It says so once it is done (on the run's stderr).
    wait_for(Duration::from_secs(10), "the reaper's line", || {
        fs::read_to_string(dir.path().join("run.err"))
            .unwrap_or_default()
            .contains("gpuam run died: its reaper ended")
            .then_some(())
    });
}

/// SIGKILL on a `gpuam run` without cgroups (an unprivileged user: its tasks run under the
/// subreaper shim): the reaper ends the daemon a task started in a new session too. It
/// killed the shim's group alone, which set the daemon free (to init), still holding the
/// GPU that the next run granted again. As root, the run is made a user's of its own
/// (uid 64996), which cannot create cgroups.
#[test]
fn sigkill_on_gpuam_run_without_cgroups_leaves_no_daemon() {
    use std::os::unix::process::CommandExt as _;
    let (dir, root) = one_node_run_dir();
    let as_root = unsafe { libc::geteuid() } == 0;
    let user = 64_996u32;
    // A daemon of its own session, and a task that outlives the test's patience.
    let daemon_tag = format!("900.{}", std::process::id());
    fs::write(
        dir.path().join("job.yaml"),
        format!(
            "name: noshim\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1}}\n    commands:\n{}",
            commands(&[&format!(
                "setsid sh -c 'exec sleep {daemon_tag}' & echo $$ >> {root}/pids; sleep 902"
            )])
        ),
    )
    .unwrap();
    if as_root {
        for e in ["", "cluster.yaml", "job.yaml"] {
            std::os::unix::fs::chown(dir.path().join(e), Some(user), Some(user)).unwrap();
        }
    }
    let mut cmd = gpuam_run_in(&dir);
    cmd.env("GPUAM_DASHBOARD_LINGER_SEC", "0")
        .env("HOME", dir.path())
        .stdout(fs::File::create(dir.path().join("run.out")).unwrap())
        .stderr(fs::File::create(dir.path().join("run.err")).unwrap());
    if as_root {
        cmd.uid(user).gid(user);
    }
    let mut run = cmd.spawn().unwrap();
    let daemon_of = || common::pids_with_cmdline(&["sleep", &daemon_tag]);
    // Every process the test may leave: ended by pid (checked again by its command line).
    // Whatever the test leaves, however it ends: its processes, found in /proc (the daemon
    // by its tag, the run, reaper and AM by the run's directory, the task by its recorded
    // pid), are killed by pid, each checked again by its command line.
    struct OnDrop<F: Fn()>(F);
    impl<F: Fn()> Drop for OnDrop<F> {
        fn drop(&mut self) {
            (self.0)()
        }
    }
    let dir_text = dir.path().display().to_string();
    let _clean_up = OnDrop(|| {
        let mut pids = common::pids_with_cmdline(&[&daemon_tag]);
        pids.extend(common::pids_with_cmdline(&[&dir_text]));
        pids.extend(
            fs::read_to_string(dir.path().join("pids"))
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.trim().parse::<i32>().ok()),
        );
        let ours = [daemon_tag.as_str(), dir_text.as_str(), "launch.sh", "902"];
        for p in pids {
            let cmd = String::from_utf8_lossy(&fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default()).into_owned();
            if common::pid_alive(p) && ours.iter().any(|o| cmd.contains(o)) {
                unsafe {
                    libc::kill(p, libc::SIGKILL);
                }
            }
        }
    });
    let daemon = wait_for(Duration::from_secs(30), "the task and its daemon", || {
        let task = fs::read_to_string(dir.path().join("pids"))
            .ok()?
            .trim()
            .parse::<i32>()
            .ok()?;
        let d = daemon_of().into_iter().next()?;
        Some((task, d))
    });
    let (task, daemon) = daemon;
    // The task is contained by the shim (no cgroup), as the test means it to be.
    let stderr_of_task = || -> String {
        let containers = dir.path().join("work").join("containers");
        fs::read_dir(containers)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| fs::read_to_string(e.path().join("stderr")).unwrap_or_default())
            .collect()
    };
    let shim = wait_for(Duration::from_secs(10), "the shim's word", || {
        let err = stderr_of_task();
        err.contains("containment: subreaper shim").then_some(err)
    });
    assert!(!shim.contains("WITHOUT"), "{shim}");
    unsafe {
        libc::kill(run.id() as i32, libc::SIGKILL);
    }
    let _ = run.wait();
    let gone = (|| {
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            if !common::pid_alive(daemon) && !common::pid_alive(task) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    })();
    let said = wait_for(Duration::from_secs(10), "the reaper's line", || {
        let err = fs::read_to_string(dir.path().join("run.err")).unwrap_or_default();
        err.contains("gpuam run died: its reaper ended").then_some(err)
    });
    let left: Vec<i32> = [task, daemon].into_iter().filter(|p| common::pid_alive(*p)).collect();
    assert!(gone, "left alive after the reaper ({said}): {left:?}");
}

/// A task binds the ports granted to it and no other port the node offers, nor the RM's:
/// a task of another job that asked for no port tries every offered port and the RM's
/// (as a tenant squatting others' rendezvous ports, or the RM's while it restarts, did),
/// and gets none (EPERM), while a task granted a port binds it. Needs root with a cgroup v2
/// (CI): the in-process node's containment line says whether ports are isolated.
#[test]
fn a_task_binds_its_granted_port_and_no_other_the_node_offers() {
    let rm = Rm::start(
        "nodes:\n  - host: n1\n    cpu: 8\n    memoryMB: 8000\n    gpus: 2\n    ports: \"47400-47409\"\n",
        &[],
    );
    let root = rm.root().display().to_string();
    fs::write(
        rm.path("squat.py"),
        format!(
            "import socket\ngot = []\nfor p in list(range(47400, 47410)) + [{}]:\n    s = socket.socket()\n    try:\n        s.bind(('0.0.0.0', p)); s.listen(1); got.append(p)\n    except OSError:\n        pass\nopen('{root}/squat', 'w').write(repr(got))\n",
            rm.port()
        ),
    )
    .unwrap();
    let squat = format!("python3 {root}/squat.py");
    let job = rm.write_job(
        "squat",
        &format!(
            "name: squat\ntaskRoles:\n  squat:\n    instances: 1\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 0}}\n    commands:\n{}",
            commands(&[&squat])
        ),
    );
    let out = rm.run_job(&job, JOB_TIMEOUT);
    assert_eq!(out.code, 0, "{out:?}\n{}", rm.logs());
    assert_eq!(
        fs::read_to_string(rm.path("squat")).unwrap_or_default(),
        "[]",
        "a task granted no port bound some of the node's or the RM's:\n{}",
        rm.logs()
    );
    fs::write(
        rm.path("own.py"),
        format!(
            "import socket, os\np = int(os.environ['GPUAM_PORT_COORD'])\ns = socket.socket(); s.bind(('0.0.0.0', p)); s.listen(1)\nopen('{root}/own', 'w').write(str(p))\n"
        ),
    )
    .unwrap();
    let own = format!("python3 {root}/own.py");
    let job = rm.write_job(
        "own",
        &format!(
            "name: own\ntaskRoles:\n  own:\n    instances: 1\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 0, ports: {{coord: 1}}}}\n    commands:\n{}",
            commands(&[&own])
        ),
    );
    let out = rm.run_job(&job, JOB_TIMEOUT);
    assert_eq!(out.code, 0, "{out:?}\n{}", rm.logs());
    let port: u16 = fs::read_to_string(rm.path("own"))
        .unwrap_or_default()
        .parse()
        .unwrap_or(0);
    assert!((47400..=47409).contains(&port), "the granted port was bound: {port}");
}

/// `gpuam run` killed together with its reaper (both pids; as a kill of the whole session
/// or unit does) leaves its AM, tasks and a daemon a task started in a new session running,
/// with nobody to end them. The next run (here in the same temporary directory, with a
/// default work dir each) ends them first, before it grants anything, and says so.
#[test]
fn a_run_killed_with_its_reaper_is_swept_by_the_next_run() {
    let (dir, root) = one_node_run_dir();
    // The runs' temporary directory: only this test's runs are swept from it.
    let tmp = dir.path().join("tmp");
    fs::create_dir(&tmp).unwrap();
    let tmp_text = tmp.display().to_string();
    let daemon_tag = format!("904.{}", std::process::id());
    let job = |name: &str, command: &str| {
        format!(
            "name: {name}\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1}}\n    commands:\n{}",
            commands(&[command])
        )
    };
    fs::write(
        dir.path().join("long.yaml"),
        job(
            "long",
            &format!("setsid sh -c 'exec sleep {daemon_tag}' & echo $$ >> {root}/pids; sleep 905"),
        ),
    )
    .unwrap();
    fs::write(dir.path().join("short.yaml"), job("short", "true")).unwrap();
    let gpuam_run = |job: &str, out: &str| {
        std::process::Command::new(common::bin())
            .env("GPUAM__NODE__IN_PROCESS_IDENTITY", "false")
            .env("GPUAM_DASHBOARD_LINGER_SEC", "0")
            .env("TMPDIR", &tmp)
            .arg("run")
            .arg(dir.path().join(job))
            .arg("--cluster")
            .arg(dir.path().join("cluster.yaml"))
            .args(["--linger", "0"])
            .stdout(fs::File::create(dir.path().join(format!("{out}.out"))).unwrap())
            .stderr(fs::File::create(dir.path().join(format!("{out}.err"))).unwrap())
            .spawn()
            .unwrap()
    };
    // Whatever the test leaves is killed by pid, each checked again by its command line.
    struct OnDrop<F: Fn()>(F);
    impl<F: Fn()> Drop for OnDrop<F> {
        fn drop(&mut self) {
            (self.0)()
        }
    }
    let _clean_up = OnDrop(|| {
        let mut pids = common::pids_with_cmdline(&[&daemon_tag]);
        pids.extend(common::pids_with_cmdline(&[&tmp_text]));
        pids.extend(
            fs::read_to_string(dir.path().join("pids"))
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.trim().parse::<i32>().ok()),
        );
        for p in pids {
            let cmd = String::from_utf8_lossy(&fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default()).into_owned();
            if pid_alive(p)
                && [daemon_tag.as_str(), tmp_text.as_str(), "905"]
                    .iter()
                    .any(|o| cmd.contains(o))
            {
                unsafe {
                    libc::kill(p, libc::SIGKILL);
                }
            }
        }
    });
    let mut first = gpuam_run("long.yaml", "first");
    let (task, daemon) = wait_for(Duration::from_secs(30), "the task and its daemon", || {
        let task = fs::read_to_string(dir.path().join("pids"))
            .ok()?
            .trim()
            .parse::<i32>()
            .ok()?;
        let d = common::pids_with_cmdline(&["sleep", &daemon_tag]).into_iter().next()?;
        Some((task, d))
    });
    let am = wait_for(Duration::from_secs(10), "the AM process", || {
        common::pids_with_cmdline(&[" am ", &tmp_text]).into_iter().next()
    });
    let reaper = wait_for(Duration::from_secs(10), "the reaper", || {
        common::pids_with_cmdline(&["reap-run", &tmp_text]).into_iter().next()
    });
    unsafe {
        libc::kill(reaper, libc::SIGKILL);
        libc::kill(first.id() as i32, libc::SIGKILL);
    }
    let _ = first.wait();
    wait_for(Duration::from_secs(10), "the reaper to be gone", || {
        (!pid_alive(reaper)).then_some(())
    });
    // Nobody is left to end them: the task and its daemon run on (as they did before the
    // sweep).
    std::thread::sleep(Duration::from_millis(500));
    let left = || -> Vec<i32> { [task, daemon, am].into_iter().filter(|p| pid_alive(*p)).collect() };
    assert!(
        pid_alive(task) && pid_alive(daemon),
        "the first run's task and daemon run on"
    );
    // The next run ends them first, then runs its own job.
    let mut second = gpuam_run("short.yaml", "second");
    let status = wait_for(Duration::from_secs(120), "the second run to end", || {
        second.try_wait().unwrap()
    });
    let err = fs::read_to_string(dir.path().join("second.err")).unwrap_or_default();
    assert!(status.success(), "{err}");
    assert!(
        err.contains("left by an earlier run that was killed with its reaper"),
        "the second run says what it ended:\n{err}"
    );
    wait_for(Duration::from_secs(30), "the first run's processes to be gone", || {
        left().is_empty().then_some(())
    });
}

/// After a run that ends by itself no reaper is left behind.
#[test]
fn a_run_that_ends_leaves_no_reaper() {
    let (dir, _root) = one_node_run_dir();
    fs::write(
        dir.path().join("job.yaml"),
        "name: short\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {cpu: 1, memoryMB: 100, gpu: 1}\n    commands: ['true']\n",
    )
    .unwrap();
    let work = dir.path().join("work");
    let out = gpuam_run_in(&dir).args(["--linger", "0"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    wait_for(Duration::from_secs(10), "the reaper to go", || {
        common::pids_with_cmdline(&["reap-run", &work.display().to_string()])
            .is_empty()
            .then_some(())
    });
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("reaper ended"),
        "nothing was reaped"
    );
}

/// SIGTERM on `gpuam rm` (what systemd and `docker stop` send) stops every job as Ctrl-C
/// does: no AM, task process or daemon a task started in a new session is left, and the RM
/// says what it stopped.
#[test]
fn sigterm_on_gpuam_rm_leaves_no_am_task_or_daemon() {
    let mut rm = Rm::start(
        "nodes:\n  - host: n1\n    cpu: 8\n    memoryMB: 8000\n    gpus: 2\n",
        &[],
    );
    let root = rm.root().display().to_string();
    let daemon = "trap \"\" TERM HUP; while :; do sleep 0.05; done";
    let job = rm.write_job(
        "rmterm",
        &format!(
            "name: rmterm\ntaskRoles:\n  w:\n    instances: 2\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1}}\n    commands:\n{}",
            commands(&[&format!(
                "setsid bash -c {} & echo $! >> {root}/pids; echo $$ >> {root}/pids; sleep 300",
                common::shell_quote(daemon)
            )])
        ),
    );
    let sub = rm.submit(&job);
    let app = sub.app_id(Duration::from_secs(10));
    let pids: Vec<i32> = wait_for(Duration::from_secs(30), "both tasks and their daemons", || {
        let p: Vec<i32> = fs::read_to_string(rm.path("pids"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        (p.len() == 4).then_some(p)
    });
    let am = wait_for(Duration::from_secs(10), "the AM process", || rm.am_pid(&app));
    let rm_pid = rm.pid().unwrap();
    unsafe {
        libc::kill(rm_pid, libc::SIGTERM);
    }
    let status = wait_for(Duration::from_secs(30), "gpuam rm to exit", || rm.try_exited());
    let err = fs::read_to_string(rm.path("rm.stderr")).unwrap_or_default();
    assert_eq!(status.code(), Some(0), "SIGTERM is an orderly stop:\n{err}");
    assert!(
        err.contains(&format!(
            "SIGTERM: stopping 1 application and 1 AM process: {app} of itest (2 containers)"
        )),
        "the RM says what it stops:\n{err}"
    );
    for p in &pids {
        assert!(
            !pid_alive(*p),
            "task process or daemon {p} survived SIGTERM on gpuam rm:\n{err}"
        );
    }
    assert!(!pid_alive(am), "the AM {am} survived SIGTERM on gpuam rm:\n{err}");
    drop(sub);
}

/// `gpuam run` streams each task's output behind its `[role/index]` (stdout to stdout,
/// stderr to stderr), ends a failed job with the failed task's stderr tail (a mistyped
/// command says `command not found`), and keeps the dashboard for the linger it names;
/// `--quiet-tasks` keeps only the tail.
#[test]
fn gpuam_run_streams_task_output_and_ends_with_a_failed_tasks_stderr() {
    let (dir, root) = one_node_run_dir();
    let run = |name: &str, extra: &[&str]| {
        let marks = format!("{root}/{name}");
        fs::create_dir_all(&marks).unwrap();
        // The workers speak first; the mistyped command runs once both have.
        let job = format!(
            "name: {name}\ntaskRoles:\n  worker:\n    instances: 2\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 0}}\n    commands:\n{}  main:\n    instances: 1\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1}}\n    commands:\n{}",
            commands(&[
                "echo \"hello from worker $GPUAM_TASK_INDEX\"",
                "printf '\\033[31mwarn %s\\033[0m\\n' $GPUAM_TASK_INDEX >&2",
                &format!("touch {marks}/ready.$GPUAM_TASK_INDEX"),
                "sleep 300",
            ]),
            commands(&[
                &format!("until [ -e {marks}/ready.0 ] && [ -e {marks}/ready.1 ]; do sleep 0.1; done"),
                "pythn train.py",
            ]),
        );
        let path = dir.path().join(format!("{name}.yaml"));
        fs::write(&path, job).unwrap();
        let (out, err) = (
            dir.path().join(format!("{name}.out")),
            dir.path().join(format!("{name}.err")),
        );
        let mut child = std::process::Command::new(common::bin())
            .arg("run")
            .arg(&path)
            .arg("--cluster")
            .arg(dir.path().join("cluster.yaml"))
            .arg("--work-dir")
            .arg(dir.path().join(format!("{name}-work")))
            .args(extra)
            // The tasks write their marks into this test's private directory.
            .env("GPUAM__NODE__IN_PROCESS_IDENTITY", "false")
            .env_remove("GPUAM_DASHBOARD_LINGER_SEC")
            .stdin(std::process::Stdio::null())
            .stdout(fs::File::create(&out).unwrap())
            .stderr(fs::File::create(&err).unwrap())
            .spawn()
            .unwrap();
        let status = wait_for(Duration::from_secs(60), "gpuam run to exit", || {
            child.try_wait().unwrap()
        });
        (
            status.code(),
            fs::read_to_string(out).unwrap(),
            fs::read_to_string(err).unwrap(),
        )
    };

    let (code, out, err) = run("loud", &["--linger", "1"]);
    let all = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, Some(1), "{all}");
    for i in 0..2 {
        assert!(out.contains(&format!("[worker/{i}] hello from worker {i}\n")), "{all}");
        // Stderr lines go to stderr, without the task's terminal escapes.
        assert!(err.contains(&format!("[worker/{i}] warn {i}\n")), "{all}");
    }
    assert!(!out.contains("warn") && !all.contains('\u{1b}'), "{all}");
    assert!(
        err.lines()
            .any(|l| l.starts_with("[main/0] ") && l.contains("pythn: command not found")),
        "the failing task's stderr streams too:\n{all}"
    );
    // The final lines: the job's end, then the failed task's stderr tail.
    let tail_at = err
        .find("task main/0 exited with 127; the last lines of its stderr:\n")
        .unwrap_or_else(|| panic!("no stderr tail:\n{all}"));
    let tail = &err[tail_at..];
    assert!(
        tail.lines()
            .nth(1)
            .is_some_and(|l| l.starts_with("  ") && l.contains("pythn: command not found")),
        "{all}"
    );
    assert!(!tail.contains("task worker/"), "only the failed task's tail: {all}");
    assert!(out.contains("the dashboard stays up for 1 s at http"), "{all}");

    let (code, out, err) = run("quiet", &["--quiet-tasks", "--linger", "0"]);
    let all = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, Some(1), "{all}");
    assert!(
        !all.contains("[worker/") && !all.contains("[main/0]"),
        "--quiet-tasks: {all}"
    );
    assert!(
        err.contains("task main/0 exited with 127; the last lines of its stderr:\n")
            && err.contains("pythn: command not found"),
        "the tail stays with --quiet-tasks: {all}"
    );
    assert!(!out.contains("dashboard stays up"), "{all}");
}
