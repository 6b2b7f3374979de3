//! Real hosts: three Linux network namespaces joined by a bridge (in a fourth), the RM
//! (`gpuam rm --nodes-file`, no cluster file) in one, a node agent (`gpuam node`) in
//! each of the other two, each offering 2 GPUs.
//!
//! - a gang of 2 tasks × 2 GPUs runs with one task on each host, as the task user, which
//!   cannot read the RM's admin token; each task's peers are named by their node's IP;
//! - an OpenPAI v2 job of two roles on the two hosts sees each node's IP in
//!   `PAI_HOST_IP_<role>_<index>` and `PAI_CONTAINER_HOST_IP`;
//! - a job whose tasks start daemons (setsid, double fork, nohup) is killed: no daemon is
//!   left, and the next job on the same GPUs starts only after the last one died (its
//!   heartbeat file's last write is before the next task's start: overlap printed);
//! - killing one agent makes its node LOST after `rm.node_expiry_sec`, and the task is
//!   retried on the other host; the agent restarted re-registers and kills the orphan.
//!
//! Needs root, `ip` (iproute2), `nsenter` (util-linux) and `curl`; the namespaces
//! (`common::hosts`) are deleted at the end, even on failure.

mod common;

use std::fs;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::hosts::{host_ip, Hosts};
use common::{pid_alive, read_env_file, shell_quote, sq, wait_for};

fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

fn lines(p: &Path) -> Vec<String> {
    fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

fn job(name: &str, instances: u32, retries: u32, commands: &[String]) -> String {
    let cmds: String = commands.iter().map(|c| format!("      - {}\n", sq(c))).collect();
    format!(
        "name: {name}\ngang: true\ntaskRoles:\n  worker:\n    instances: {instances}\n    taskRetryCount: {retries}\n    \
         resourcePerInstance: {{cpu: 1, memoryMB: 256, gpu: 2}}\n    commands:\n{cmds}"
    )
}

#[test]
fn three_hosts_in_network_namespaces() {
    let mut h = Hosts::build("hosts");
    h.start_rm();
    h.start_agent("h1");
    h.start_agent("h2");
    let h1 = h.host_name("h1");
    let h2 = h.host_name("h2");
    h.wait_agents_running();
    let out = h.path("out").display().to_string();
    let admin = h.path("rm/admin.token").display().to_string();

    // 1. A gang of 2 × 2 GPUs: one task per host, as the task user, no admin token.
    let gang = job(
        "gang",
        2,
        0,
        &[format!(
            "echo $GPUAM_HOST $CUDA_VISIBLE_DEVICES $(id -u) $GPUAM_HOSTS_WORKER > {out}/gang-$GPUAM_TASK_INDEX; \
             if cat {admin} >/dev/null 2>&1; then echo READ > {out}/gang-token-$GPUAM_TASK_INDEX; fi"
        )],
    );
    let status = h.submit("gang", &gang, true).wait().unwrap();
    assert!(status.success(), "the gang job succeeds");
    let mut hosts: Vec<String> = (0..2)
        .map(|i| lines(&h.path(&format!("out/gang-{i}")))[0].clone())
        .collect();
    for (i, l) in hosts.iter().enumerate() {
        let f: Vec<&str> = l.split_whitespace().collect();
        assert_eq!(f[1], "0,1", "each task has its host's 2 GPUs: {l}");
        assert_ne!(f[2], "0", "tasks do not run as root: {l}");
        // Peers are named by the IP of their node (its namespace's), which they can reach.
        let peers: Vec<&str> = f[3].split(',').collect();
        let mine = if f[0] == h1 { host_ip("h1") } else { host_ip("h2") };
        assert_eq!(peers.len(), 2, "GPUAM_HOSTS_WORKER lists both tasks: {l}");
        assert_eq!(peers[i], mine, "task {i}'s own entry is its node's IP: {l}");
        assert_ne!(peers[0], peers[1], "{l}");
    }
    hosts.sort();
    assert_eq!(
        hosts
            .iter()
            .map(|l| l.split(' ').next().unwrap().to_string())
            .collect::<Vec<_>>(),
        vec![h1.clone(), h2.clone()],
        "one task per host"
    );
    assert!(
        !h.path("out/gang-token-0").exists() && !h.path("out/gang-token-1").exists(),
        "a task read the admin token"
    );

    // 1b. An OpenPAI v2 job of two roles, one per host (2 GPUs each): PAI_HOST_IP_<role>_0
    //     and PAI_CONTAINER_HOST_IP are the nodes' own IPs, not the RM's. The first role to
    //     succeed ends an OpenPAI job (the other is stopped), so each task waits (up to 30 s)
    //     until both have recorded their environment.
    let record = format!(
        "env | grep -E \"^(PAI_|GPUAM_HOST=)\" > {out}/pai-$PAI_CURRENT_TASK_ROLE_NAME.tmp && \
         mv {out}/pai-$PAI_CURRENT_TASK_ROLE_NAME.tmp {out}/pai-$PAI_CURRENT_TASK_ROLE_NAME; \
         for i in $(seq 600); do [ -e {out}/pai-a ] && [ -e {out}/pai-b ] && break; sleep 0.05; done"
    );
    let role = |name: &str| {
        format!(
            "  {name}:\n    dockerImage: img\n    resourcePerInstance: {{cpu: 1, memoryMB: 256, gpu: 2}}\n    commands:\n      - {}\n",
            sq(&record)
        )
    };
    let pai = format!(
        "protocolVersion: 2\nname: pai\ntype: job\nprerequisites:\n  - {{name: img, type: dockerimage, uri: localhost/not-here:1}}\ntaskRoles:\n{}{}",
        role("a"),
        role("b")
    );
    let status = h.submit("pai", &pai, true).wait().unwrap();
    assert!(status.success(), "the OpenPAI job succeeds: {}", h.submit_output("pai"));
    let env_a = read_env_file(&h.path("out/pai-a"));
    let env_b = read_env_file(&h.path("out/pai-b"));
    let ip_of = |env: &std::collections::BTreeMap<String, String>| {
        if env["GPUAM_HOST"] == h1 {
            host_ip("h1")
        } else {
            host_ip("h2")
        }
    };
    let (ip_a, ip_b) = (ip_of(&env_a), ip_of(&env_b));
    assert_ne!(ip_a, ip_b, "one role per host");
    for env in [&env_a, &env_b] {
        assert_eq!(env["PAI_HOST_IP_a_0"], ip_a, "{env:?}");
        assert_eq!(env["PAI_HOST_IP_b_0"], ip_b, "{env:?}");
        assert_eq!(env["PAI_CONTAINER_HOST_IP"], ip_of(env), "{env:?}");
    }

    // 2. Daemons of a killed job: none survives, and the next job on the same GPUs starts
    //    only after the last one is gone.
    let daemon = format!("trap \"\" TERM; while :; do date +%s%N > {out}/beat-$BASHPID; sleep 0.01; done");
    let escapes = job(
        "escapes",
        2,
        0,
        &[format!(
            "setsid bash -c {d} & echo $! >> {out}/daemons; \
             ( bash -c {d} & echo $! >> {out}/daemons ); \
             set -m; nohup bash -c {d} >/dev/null 2>&1 & echo $! >> {out}/daemons; set +m; \
             sleep 1000",
            d = shell_quote(&daemon)
        )],
    );
    let mut killer = h.submit("escapes", &escapes, true);
    // Started, and each has written its first beat (on a busy machine the kill below could
    // otherwise come before any did, leaving no beat to compare with).
    wait_for(Duration::from_secs(60), "6 daemons started and beating", || {
        let beats = fs::read_dir(h.path("out"))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("beat-"))
            .count();
        (lines(&h.path("out/daemons")).len() >= 6 && beats >= 6).then_some(())
    });
    let daemons: Vec<i32> = lines(&h.path("out/daemons"))
        .iter()
        .filter_map(|l| l.parse().ok())
        .collect();
    assert!(daemons.iter().all(|p| pid_alive(*p)));
    // Ctrl-C on `gpuam submit --wait` kills the job with the admin token.
    unsafe {
        libc::kill(killer.id() as i32, libc::SIGINT);
    }
    let _ = killer.wait();
    // A daemon counts as alive unless /proc says it is a zombie (Z) or gone: `kill -0`
    // succeeds on a zombie, and under an init that does not reap orphans (CI's) the
    // killed daemons stay zombies, holding no memory, file or device any more.
    let next = job(
        "next",
        2,
        0,
        &[format!(
            "date +%s%N >> {out}/next-start; for p in $(cat {out}/daemons); do \
             st=$(sed -n 's/^State:[[:space:]]*\\(.\\).*/\\1/p' /proc/$p/status 2>/dev/null); \
             case \"$st\" in ''|Z|X) ;; *) echo \"$p $st\" >> {out}/alive-at-next ;; esac; done; true"
        )],
    );
    let status = h.submit("next", &next, true).wait().unwrap();
    assert!(status.success(), "the next job succeeds");
    assert!(
        !h.path("out/alive-at-next").exists(),
        "daemons alive when the next job started: {:?}",
        lines(&h.path("out/alive-at-next"))
    );
    assert!(daemons.iter().all(|p| !pid_alive(*p)), "no daemon survives its job");
    let last_beat: u128 = fs::read_dir(h.path("out"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("beat-"))
        .filter_map(|e| fs::read_to_string(e.path()).ok()?.trim().parse().ok())
        .max()
        .unwrap();
    let first_next: u128 = lines(&h.path("out/next-start"))
        .iter()
        .filter_map(|l| l.parse().ok())
        .min()
        .unwrap();
    let overlap_ms = (last_beat as i128 - first_next as i128) as f64 / 1e6;
    println!("overlap between the killed job's last daemon beat and the next job's start: {overlap_ms:.1} ms (negative: none)");
    assert!(
        last_beat < first_next,
        "the next job started while a daemon of the killed one still ran"
    );

    // 3. Node loss: the task is retried on the other host; the agent restarted kills the
    //    orphan the RM no longer wants.
    let lost = job(
        "lost",
        1,
        2,
        &[format!("echo $GPUAM_HOST $BASHPID >> {out}/lost-runs; sleep 1000")],
    );
    let mut follower = h.submit("lost", &lost, true);
    let first = wait_for(Duration::from_secs(60), "the task runs", || {
        lines(&h.path("out/lost-runs")).first().cloned()
    });
    let (first_host, first_pid) = first
        .split_once(' ')
        .map(|(a, b)| (a.to_string(), b.parse::<i32>().unwrap()))
        .unwrap();
    let victim = if first_host == h1 { "h1" } else { "h2" };
    let t0 = now_ns();
    h.kill(victim);
    wait_for(Duration::from_secs(30), "the node LOST", || {
        h.node_states()
            .iter()
            .any(|(n, s)| *n == first_host && s == "LOST")
            .then_some(())
    });
    println!(
        "node LOST {:.1} s after its agent was killed",
        (now_ns() - t0) as f64 / 1e9
    );
    let second = wait_for(Duration::from_secs(60), "the retry", || {
        lines(&h.path("out/lost-runs")).get(1).cloned()
    });
    assert!(!second.starts_with(&first_host), "retried on the other host: {second}");
    assert!(
        pid_alive(first_pid),
        "the lost node's task still runs (nobody could stop it)"
    );
    // Its GPUs stay held while nobody knows the task is dead; the admin may say the
    // machine was wiped, which frees them (a RUNNING node is refused: its agent reports).
    let used = |host: &str| {
        h.get("/ws/v1/cluster/nodes")["nodes"]["node"]
            .as_array()
            .and_then(|a| a.iter().find(|n| n["nodeHostName"] == host).cloned())
            .map(|n| n["usedGpuAttribute"].as_str().unwrap_or("").to_string())
            .unwrap_or_default()
    };
    assert_ne!(used(&first_host), "0x0", "the lost node's task keeps its GPUs held");
    let other_host = if victim == "h1" { h2.clone() } else { h1.clone() };
    let (code, _) = h.post_admin(&format!("/ws/v1/cluster/nodes/{other_host}/wiped"));
    assert_eq!(code, 409, "a RUNNING node cannot be declared wiped");
    let (code, body) = h.post_admin(&format!("/ws/v1/cluster/nodes/{first_host}/wiped"));
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["containersFreed"].as_array().map(Vec::len), Some(1), "{body}");
    assert_eq!(used(&first_host), "0x0", "declared wiped: its GPUs are free");
    h.start_agent(victim);
    wait_for(
        Duration::from_secs(30),
        "the orphan killed after the agent came back",
        || (!pid_alive(first_pid)).then_some(()),
    );
    unsafe {
        libc::kill(follower.id() as i32, libc::SIGINT);
    }
    let _ = follower.wait();
}

/// One task's run: `(job, task index, host, GPUs, start ns, last beat ns)`.
type GangRun = (String, u32, String, String, u128, u128);

/// RM SIGKILLed at several moments of a 4 × 2-GPU gang's start (agents on 2 hosts of 4
/// GPUs each), started again 1 s later from its SQLite state: every acknowledged job
/// succeeds, each task runs once, and no two runs hold a GPU at once (the tasks ignore
/// SIGTERM, so a stop would have had to wait for the kill).
#[test]
fn an_rm_killed_during_a_gangs_start_comes_back_with_its_agents_and_loses_nothing() {
    let mut h = Hosts::build("rmkill");
    h.gpus = 4;
    h.keep_state = true;
    fs::write(
        h.path("conf.yaml"),
        "rm:\n  node_expiry_sec: 3\n  node_reregister_grace_sec: 60\n",
    )
    .unwrap();
    h.start_rm();
    h.start_agent("h1");
    h.start_agent("h2");
    h.wait_agents_running();
    let out = h.path("out").display().to_string();
    // Each run: "<index> <host> <gpus> <start ns>" in `<job>.runs`, then a beat file
    // written every 20 ms until it ends.
    let task = |name: &str| {
        format!(
            "trap \"\" TERM; s=$(date +%s%N); echo $GPUAM_TASK_INDEX $GPUAM_HOST $CUDA_VISIBLE_DEVICES $s >> {out}/{name}.runs; \
             for i in $(seq 300); do date +%s%N > {out}/{name}-$GPUAM_TASK_INDEX-$s.beat; sleep 0.02; done"
        )
    };
    let mut runs: Vec<GangRun> = Vec::new();
    for (i, kill_after_ms) in [200u64, 1500, 4000].into_iter().enumerate() {
        let name = format!("gang{i}");
        let sub = h
            .submit(&name, &job(&name, 4, 0, &[task(&name)]), false)
            .wait()
            .unwrap();
        assert!(sub.success(), "{name} acknowledged: {}", h.submit_output(&name));
        let app = h
            .submit_output(&name)
            .split_whitespace()
            .find(|w| w.starts_with("application_"))
            .map(str::to_string)
            .unwrap_or_else(|| panic!("no application id: {}", h.submit_output(&name)));
        std::thread::sleep(Duration::from_millis(kill_after_ms));
        h.restart_rm(Duration::from_secs(1));
        let report = wait_for(Duration::from_secs(180), "the job to end", || {
            let r = h.get_admin(&format!("/ws/v1/cluster/apps/{app}"))["app"].clone();
            matches!(r["state"].as_str(), Some("FINISHED" | "FAILED" | "KILLED")).then_some(r)
        });
        assert_eq!(
            report["finalStatus"], "SUCCEEDED",
            "{name} (RM killed {kill_after_ms} ms after the acknowledgement): {report}"
        );
        let mine: Vec<GangRun> = lines(&h.path(&format!("out/{name}.runs")))
            .iter()
            .map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                let (index, start): (u32, u128) = (f[0].parse().unwrap(), f[3].parse().unwrap());
                let beat: u128 = fs::read_to_string(h.path(&format!("out/{name}-{index}-{start}.beat")))
                    .unwrap()
                    .trim()
                    .parse()
                    .unwrap();
                (name.clone(), index, f[1].to_string(), f[2].to_string(), start, beat)
            })
            .collect();
        let mut indexes: Vec<u32> = mine.iter().map(|r| r.1).collect();
        indexes.sort_unstable();
        assert_eq!(indexes, vec![0, 1, 2, 3], "{name}: each task ran once: {mine:?}");
        runs.extend(mine);
    }
    // GPU overlap: any two runs on one host sharing a GPU, their [start, last beat] apart.
    let mut overlap_ms = 0f64;
    for (i, a) in runs.iter().enumerate() {
        for b in &runs[i + 1..] {
            let shared = a.3.split(',').any(|g| b.3.split(',').any(|x| x == g));
            if a.2 == b.2 && shared {
                let both = a.5.min(b.5) as i128 - a.4.max(b.4) as i128;
                overlap_ms += both.max(0) as f64 / 1e6;
            }
        }
    }
    println!("{} runs after 3 RM kills; GPU overlap {overlap_ms:.1} ms", runs.len());
    assert_eq!(overlap_ms, 0.0, "two runs held one GPU at once: {runs:?}");
}

/// Each agent has its own credential, bound to its host (`gpuam node-token new`):
/// - another host's valid credential cannot register a live host (nor heartbeat for it),
///   and the live host keeps working;
/// - no credential, no node: a fake node cannot join;
/// - a host cannot report another host's container dead (its GPUs stay held, it runs on);
/// - a credential taken out of the nodes file is refused from then on.
#[test]
fn agent_credentials_bind_each_agent_to_its_host() {
    let mut h = Hosts::build("ident");
    h.start_rm();
    h.start_agent("h1");
    h.start_agent("h2");
    h.wait_agents_running();
    let (h1, h2) = (h.host_name("h1"), h.host_name("h2"));
    let out = h.path("out").display().to_string();
    let token = |host: &str| fs::read_to_string(h.path(&format!("{host}.token"))).unwrap();
    let register = |host: &str, gpus: u64| {
        serde_json::json!({
            "host": host, "rack": "/r",
            "total": {"cpu": 64, "memoryMB": 1_000_000, "gpus": gpus, "gpuMask": (1u128 << gpus) - 1, "ports": "20000-20100"},
            "httpAddress": "http://10.213.0.3:9999",
        })
    };

    // A job holding both GPUs of one host (the victim).
    let mut holder = h.submit(
        "holder",
        &job(
            "holder",
            1,
            0,
            &[format!(
                "echo $GPUAM_HOST $GPUAM_CONTAINER_ID > {out}/holder; sleep 1000"
            )],
        ),
        true,
    );
    let line = wait_for(Duration::from_secs(60), "the holder to run", || {
        lines(&h.path("out/holder")).first().cloned()
    });
    let (victim, container) = line
        .split_once(' ')
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .unwrap();
    let (other, other_label) = if victim == h1 {
        (h2.clone(), "h2")
    } else {
        (h1.clone(), "h1")
    };

    // Another host's credential registering the victim: refused; heartbeating for it too.
    let (code, body) = h.post_as(
        other_label,
        &token(other_label),
        "/ws/v1/node-agents/register",
        &register(&victim, 2),
    );
    assert_eq!(code, 403, "{body}");
    let (code, body) = h.post_as(
        other_label,
        &token(other_label),
        &format!("/ws/v1/node-agents/{victim}/heartbeat"),
        &serde_json::json!({"containers": [{"containerId": container, "state": "COMPLETE", "exitStatus": 0}]}),
    );
    assert_eq!(code, 403, "{body}");
    // No credential (or a made-up one): no node.
    for t in ["", "made-up-token"] {
        let (code, body) = h.post_as("h2", t, "/ws/v1/node-agents/register", &register("fake64", 64));
        assert_eq!(code, 401, "{body}");
    }
    // The other host reports the victim's container dead in its own heartbeat: ignored.
    let (code, body) = h.post_as(
        other_label,
        &token(other_label),
        &format!("/ws/v1/node-agents/{other}/heartbeat"),
        &serde_json::json!({"containers": [{"containerId": container, "state": "COMPLETE", "exitStatus": 0}]}),
    );
    assert_eq!(code, 200, "{body}");
    std::thread::sleep(Duration::from_secs(2));
    let nodes = h.get("/ws/v1/cluster/nodes");
    let node = |host: &str| {
        nodes["nodes"]["node"]
            .as_array()
            .and_then(|a| a.iter().find(|n| n["nodeHostName"] == host).cloned())
            .unwrap()
    };
    assert_eq!(node(&victim)["state"], "RUNNING", "{nodes}");
    assert_eq!(
        node(&victim)["usedGpuAttribute"],
        "0x3",
        "the victim's GPUs stay held: {nodes}"
    );
    assert!(
        nodes["nodes"]["node"].as_array().unwrap().len() == 2,
        "no fake node: {nodes}"
    );

    // Revoked: the other host's entry taken out of the nodes file; its agent is refused.
    let nodes_file = fs::read_to_string(h.path("nodes.yaml")).unwrap();
    let kept: String = nodes_file
        .lines()
        .filter(|l| !l.trim_start().starts_with(&format!("{other}:")))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_ne!(kept, nodes_file);
    fs::write(h.path("nodes.yaml"), kept).unwrap();
    wait_for(Duration::from_secs(20), "the revoked agent refused", || {
        let (code, _) = h.post_as(
            other_label,
            &token(other_label),
            &format!("/ws/v1/node-agents/{other}/heartbeat"),
            &serde_json::json!({"containers": []}),
        );
        (code == 401).then_some(())
    });
    wait_for(Duration::from_secs(30), "the revoked host LOST", || {
        h.node_states()
            .iter()
            .any(|(n, s)| *n == other && s == "LOST")
            .then_some(())
    });
    // The victim's agent works on: its job is killed and its GPUs come back.
    unsafe {
        libc::kill(holder.id() as i32, libc::SIGINT);
    }
    let _ = holder.wait();
    wait_for(Duration::from_secs(30), "the victim's GPUs free", || {
        let n = h.get("/ws/v1/cluster/nodes");
        n["nodes"]["node"]
            .as_array()?
            .iter()
            .find(|n| n["nodeHostName"] == victim.as_str())
            .filter(|n| n["usedGpuAttribute"] == "0x0" && n["state"] == "RUNNING")
            .map(|_| ())
    });
}

/// What `curl` run in namespace `ns` gets from `url`: (exit code, HTTP status, `000` when
/// no HTTP answer came). `ca`: the CA file it trusts.
fn curl_code(h: &Hosts, ns: &str, url: &str, ca: Option<&Path>) -> (i32, String) {
    let mut c = std::process::Command::new("ip");
    c.args([
        "netns",
        "exec",
        &h.ns(ns),
        "curl",
        "-s",
        "-m",
        "10",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
    ]);
    if let Some(ca) = ca {
        c.arg("--cacert").arg(ca);
    }
    let out = c.arg(url).output().expect("curl");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
    )
}

#[test]
fn with_tls_the_agents_serve_https_only_and_a_gang_runs_over_it() {
    let mut h = Hosts::build("tls");
    h.use_tls();
    h.start_rm();
    h.start_agent("h1");
    h.start_agent("h2");
    // Both agents registered over HTTPS, trusting `tls.ca_file` (no SSL_CERT_FILE).
    h.wait_agents_running();
    // A gang of 2 × 2 GPUs, one task per host: the RM starts each over HTTPS.
    let out = h.path("out").display().to_string();
    let gang = job(
        "gang",
        2,
        0,
        &[format!("echo $GPUAM_HOST > {out}/tls-$GPUAM_TASK_INDEX")],
    );
    let status = h.submit("gang", &gang, true).wait().unwrap();
    assert!(
        status.success(),
        "the gang job succeeds over TLS: {}\n{}",
        h.submit_output("gang"),
        h.logs()
    );
    let mut ran: Vec<String> = (0..2)
        .map(|i| lines(&h.path(&format!("out/tls-{i}"))).join(""))
        .collect();
    ran.sort();
    assert_eq!(ran, vec![h.host_name("h1"), h.host_name("h2")], "one task per host");

    let ca = h.path("ca.pem");
    for host in ["h1", "h2"] {
        let path = format!("{}:8042/ws/v1/node/{}/containers", host_ip(host), h.host_name(host));
        // Plain HTTP to an agent's port gets no HTTP answer.
        let (_, code) = curl_code(&h, "rm", &format!("http://{path}"), None);
        assert_eq!(code, "000", "{host}'s agent answered plain HTTP with {code}");
        // HTTPS trusting the CA is answered (whatever the status, without a token).
        let (_, code) = curl_code(&h, "rm", &format!("https://{path}"), Some(&ca));
        assert_ne!(code, "000", "{host}'s agent did not answer HTTPS");
        // A client trusting another CA is refused at the handshake (curl 60: certificate).
        let (rc, code) = curl_code(&h, "rm", &format!("https://{path}"), Some(&h.path("other-ca.pem")));
        assert_eq!(
            (rc, code.as_str()),
            (60, "000"),
            "{host}'s certificate was accepted under another CA"
        );
    }
}
