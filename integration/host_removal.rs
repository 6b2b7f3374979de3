//! Removing a host for good (`gpuam node remove HOST [--force]`, `DELETE
//! /ws/v1/cluster/nodes/{host}`), with the RM and two real node agents in network
//! namespaces (`common::hosts`), the RM keeping its state in SQLite:
//!
//! - a LOST host (its agent SIGKILLed) is removed: gone from the node view, also after an
//!   RM restart; its agent started again with its old credential is refused
//!   (`HOST_REMOVED`) and never joins; a new credential (`gpuam node-token new`) re-admits it;
//! - a live host running a job's task is not removed without `--force` (exit 64, the node
//!   stays); with it, the task ends as on a lost host, its old process is stopped, and the
//!   job's task is retried on the other host and the job succeeds.
//!
//! Needs root, `ip` (iproute2), `nsenter` (util-linux) and `curl`.

mod common;

use std::fs;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use common::hosts::Hosts;
use common::{bin, wait_for};

fn lines(p: &Path) -> Vec<String> {
    fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// `gpuam node remove HOST [--force]` with the admin token, from the RM's namespace.
fn remove(h: &Hosts, host: &str, force: bool) -> Output {
    let mut c = Command::new("ip");
    c.args([
        "netns",
        "exec",
        &h.ns("rm"),
        bin(),
        "node",
        "remove",
        host,
        "--rm",
        &h.rm_url(),
    ])
    .arg("--token-file")
    .arg(h.path("admin.token"));
    if force {
        c.arg("--force");
    }
    c.output().unwrap()
}

/// Submits job `name`: one 2-GPU task, retried up to twice, that appends `HOST PID` to
/// `out/runs` and ends well only on its second run (else sleeps); waits for its first run.
/// Returns the submission, the first run's host and its pid.
fn run_retried(h: &Hosts, name: &str) -> (std::process::Child, String, i32) {
    let runs = h.path("out/runs").display().to_string();
    let cmd = format!("echo $GPUAM_HOST $$ >> {runs}; if [ $(wc -l < {runs}) -ge 2 ]; then exit 0; fi; sleep 1000");
    let yaml = format!(
        "name: {name}\ntaskRoles:\n  worker:\n    instances: 1\n    taskRetryCount: 2\n    \
         resourcePerInstance: {{cpu: 1, memoryMB: 256, gpu: 2}}\n    commands:\n      - {}\n",
        common::sq(&cmd)
    );
    let job = h.submit(name, &yaml, true);
    let first = wait_for(Duration::from_secs(60), "the task to run", || {
        lines(&h.path("out/runs")).first().cloned()
    });
    let (victim, pid) = first.split_once(' ').unwrap();
    (job, victim.to_string(), pid.trim().parse::<i32>().unwrap())
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// An RM keeping its state (hosts LOST after 3 s) and agents `h1` and `h2`, running.
fn two_hosts(tag: &str) -> Hosts {
    let mut h = Hosts::build(tag);
    h.keep_state = true;
    fs::write(
        h.path("conf.yaml"),
        "rm:\n  node_expiry_sec: 3\n  node_reregister_grace_sec: 20\n",
    )
    .unwrap();
    h.start_rm();
    h.start_agent("h1");
    h.start_agent("h2");
    h.wait_agents_running();
    h
}

/// Whether `pid` runs (a zombie or a gone process does not).
fn running(pid: i32) -> bool {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let state = status
        .lines()
        .find_map(|l| l.strip_prefix("State:"))
        .map(|s| s.trim().chars().next().unwrap_or('X'))
        .unwrap_or('X');
    !matches!(state, 'Z' | 'X')
}

#[test]
fn a_host_removed_for_good_stays_out_until_re_admitted_and_forced_removal_retries_its_task() {
    let mut h = two_hosts("24c-remove");
    let (h1, h2) = (h.host_name("h1"), h.host_name("h2"));
    let listed = |h: &Hosts| -> Vec<String> {
        let mut v: Vec<String> = h.node_states().into_iter().map(|(n, _)| n).collect();
        v.sort();
        v
    };

    // 1. A LOST host is removed: out of the view, its agent refused.
    h.kill("h1");
    wait_for(Duration::from_secs(60), "h1 LOST", || {
        h.node_states()
            .iter()
            .any(|(n, s)| *n == h1 && s == "LOST")
            .then_some(())
    });
    let out = remove(&h, &h1, false);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("removed"), "{}", text(&out));
    assert_eq!(listed(&h), vec![h2.clone()]);
    let again = remove(&h, &h1, false);
    assert_eq!(again.status.code(), Some(66), "unknown now: {}", text(&again));
    h.start_agent("h1");
    let old = fs::read_to_string(h.path("h1.token")).unwrap();
    let (code, body) = h.post_as(
        "h1",
        &old,
        &format!("/ws/v1/node-agents/{h1}/heartbeat"),
        &serde_json::json!({"containers": []}),
    );
    assert_eq!((code, body["code"].as_str()), (403, Some("HOST_REMOVED")), "{body}");
    wait_for(Duration::from_secs(60), "the removed agent refused", || {
        fs::read_to_string(h.path("h1.log"))
            .unwrap_or_default()
            .contains("HOST_REMOVED")
            .then_some(())
    });
    assert_eq!(listed(&h), vec![h2.clone()], "the removed agent did not join");

    // 2. The removal is durable: after an RM restart h1 is still out and refused.
    h.restart_rm(Duration::from_millis(500));
    wait_for(Duration::from_secs(60), "h2 back after the restart", || {
        (h.node_states() == vec![(h2.clone(), "RUNNING".to_string())]).then_some(())
    });
    let (code, body) = h.post_as(
        "h1",
        &old,
        &format!("/ws/v1/node-agents/{h1}/heartbeat"),
        &serde_json::json!({"containers": []}),
    );
    assert_eq!((code, body["code"].as_str()), (403, Some("HOST_REMOVED")), "{body}");
    // Its agent keeps trying (a heartbeat a second): still out after a few of them.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        listed(&h),
        vec![h2.clone()],
        "the removed agent did not join after the restart"
    );

    // 3. Re-admitted with a new credential (the RM reloads the nodes file).
    h.kill("h1");
    h.node_token_new("h1");
    h.start_agent("h1");
    h.wait_agents_running();

    // 4. A live host running a task: refused without --force; forced, the task is retried
    //    on the other host and the job succeeds.
    let (mut job, victim, pid) = run_retried(&h, "moved");
    let other = if victim == h1 { h2.clone() } else { h1.clone() };
    let refused = remove(&h, &victim, false);
    assert_eq!(refused.status.code(), Some(64), "{}", text(&refused));
    assert!(text(&refused).contains("--force"), "{}", text(&refused));
    assert_eq!(listed(&h).len(), 2, "nothing removed without --force");
    let forced = remove(&h, &victim, true);
    assert!(forced.status.success(), "{}", text(&forced));
    assert!(text(&forced).contains("1 container(s) ended"), "{}", text(&forced));
    let status = job.wait().unwrap();
    assert!(status.success(), "the job succeeds: {}", h.submit_output("moved"));
    let all = lines(&h.path("out/runs"));
    assert_eq!(all.len(), 2, "{all:?}");
    assert!(all[1].starts_with(&format!("{other} ")), "retried on {other}: {all:?}");
    wait_for(Duration::from_secs(30), "the removed host's task stopped", || {
        (!running(pid)).then_some(())
    });
    assert_eq!(listed(&h), vec![other]);
}

/// A LOST host's task outlives its agent (its cgroup keeps it); the host is removed (its
/// task ends in the RM as a lost host's and is retried elsewhere), and when its agent
/// comes back with the old credential it is refused `HOST_REMOVED` and stops everything it
/// re-attached: the removed host's GPUs and ports run nothing the RM has freed.
#[test]
fn a_removed_host_s_agent_stops_what_it_still_runs() {
    let mut h = two_hosts("hr-stop");
    let (mut job, victim, pid) = run_retried(&h, "orphan");
    let label = if victim == h.host_name("h1") { "h1" } else { "h2" };
    h.kill(label);
    wait_for(Duration::from_secs(60), "the victim LOST", || {
        h.node_states()
            .iter()
            .any(|(n, s)| *n == victim && s == "LOST")
            .then_some(())
    });
    assert!(running(pid), "the task outlives its agent");
    let out = remove(&h, &victim, false);
    assert!(out.status.success(), "{}", text(&out));
    let status = job.wait().unwrap();
    assert!(
        status.success(),
        "the job succeeds elsewhere: {}",
        h.submit_output("orphan")
    );
    assert!(running(pid), "nothing could stop the old task while its agent was away");
    h.start_agent(label);
    wait_for(
        Duration::from_secs(60),
        "the removed host's agent stops its task",
        || (!running(pid)).then_some(()),
    );
    assert!(
        fs::read_to_string(h.path(&format!("{label}.log")))
            .unwrap_or_default()
            .contains("HOST_REMOVED"),
        "the agent says why"
    );
}
