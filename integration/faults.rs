//! End-to-end fault injection on the running system (a real `gpuam rm` process, its
//! real `gpuam am` and task process groups): node loss through the RM's admin
//! endpoint `PUT /ws/v1/cluster/nodes/{host}/state`. Simulated nodes live inside the
//! RM process and cannot stop answering by themselves, so marking a node LOST through
//! that call is how "a node that stops answering" is injected.

mod common;

use std::fs;
use std::time::Duration;

use common::{group_members, sq, wait_for, wait_groups_gone, Rm};
use serde_json::json;

const CLUSTER: &str = r#"
nodes:
  - host: n1
    rack: /r1
    cpu: 8
    memoryMB: 16000
    gpus: 1
    ports: "20000-20009"
  - host: n2
    rack: /r1
    cpu: 8
    memoryMB: 16000
    gpus: 1
    ports: "20000-20009"
  - host: n3
    rack: /r1
    cpu: 8
    memoryMB: 16000
    gpus: 1
    ports: "20000-20009"
"#;

fn commands(cmds: &[&str]) -> String {
    cmds.iter().map(|c| format!("      - {}\n", sq(c))).collect()
}

fn node_state(rm: &Rm, host: &str) -> String {
    let v = rm.get_json("/ws/v1/cluster/nodes").unwrap();
    v["nodes"]["node"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["nodeHostName"] == host)
        .map(|n| n["state"].as_str().unwrap_or("").to_string())
        .unwrap_or_else(|| panic!("no node {host} in {v}"))
}

/// Where attempt `attempt` of task `index` ran and the process group it led.
fn recorded(rm: &Rm, index: u32, attempt: u32) -> Option<(String, i32)> {
    let text = fs::read_to_string(rm.path(&format!("rec.{index}.{attempt}"))).ok()?;
    let mut f = text.split_whitespace();
    Some((f.next()?.to_string(), f.next()?.parse().ok()?))
}

#[test]
fn lost_node_task_is_retried_elsewhere_and_the_node_comes_back() {
    // One GPU per node: the two tasks sit on two nodes, the third is the spare.
    let rm = Rm::start(CLUSTER, &[("GPUAM__SELECT__SEED", "7")]);
    let root = rm.root().display().to_string();
    // Attempt 1 records host and process group, then waits for the release marker
    // with a background child (so the whole group must be killed); a retried attempt
    // exits 0 at once. taskRetryCount 0: only the transient rule can retry it.
    let job = rm.write_job(
        "lossy",
        &format!(
            "name: lossy\ntaskRoles:\n  worker:\n    instances: 2\n    taskRetryCount: 0\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1}}\n    commands:\n{}",
            commands(&[
                &format!("echo $GPUAM_HOST $(awk '{{print $5}}' /proc/$$/stat) > {root}/rec.tmp.$GPUAM_TASK_INDEX.$GPUAM_ATTEMPT && mv {root}/rec.tmp.$GPUAM_TASK_INDEX.$GPUAM_ATTEMPT {root}/rec.$GPUAM_TASK_INDEX.$GPUAM_ATTEMPT"),
                "if [ \"$GPUAM_ATTEMPT\" -gt 1 ]; then exit 0; fi",
                &format!("sleep 300 & while [ ! -f {root}/release ]; do sleep 0.05; done; kill %1; exit 0"),
            ])
        ),
    );
    let sub = rm.submit(&job);
    let app = sub.app_id(Duration::from_secs(10));
    let first: Vec<(String, i32)> = (0..2)
        .map(|i| {
            wait_for(Duration::from_secs(20), "both first attempts to start", || {
                recorded(&rm, i, 1)
            })
        })
        .collect();
    assert_ne!(first[0].0, first[1].0, "one GPU per node: two hosts");
    for (_, g) in &first {
        wait_for(Duration::from_secs(10), "the background sleep", || {
            (group_members(*g).len() >= 2).then_some(())
        });
    }
    let (lost_host, lost_pg) = first[1].clone();
    let spare = ["n1", "n2", "n3"]
        .into_iter()
        .find(|h| *h != first[0].0 && *h != lost_host)
        .unwrap();

    // Without the admin token the node cannot be touched.
    let path = format!("/ws/v1/cluster/nodes/{lost_host}/state");
    let (status, _) = rm.put_json(&path, None, &json!({"state": "LOST"}));
    assert_eq!(status, 401);
    assert_eq!(node_state(&rm, &lost_host), "RUNNING");

    let admin = rm.admin_token();
    let (status, body) = rm.put_json(&path, Some(&admin), &json!({"state": "LOST"}));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["node"]["state"], "LOST", "{body}");
    assert_eq!(body["containersEnded"], 1, "{body}");
    assert_eq!(node_state(&rm, &lost_host), "LOST");
    let running = rm.get_json("/ws/v1/cluster/nodes?states=RUNNING").unwrap();
    let running_hosts: Vec<&str> = running["nodes"]["node"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["nodeHostName"].as_str())
        .collect();
    assert!(!running_hosts.contains(&lost_host.as_str()), "{running_hosts:?}");
    // The lost node's processes are gone (the whole group, background child too).
    wait_groups_gone(&[lost_pg], Duration::from_secs(10));

    // The AM retries the task elsewhere as attempt 2 (on the spare: the lost node takes
    // nothing, the other node's only GPU is busy), and it exits 0 at once.
    let (retry_host, _) = wait_for(Duration::from_secs(20), "the retried attempt", || recorded(&rm, 1, 2));
    assert_ne!(retry_host, lost_host, "retried on another host");
    assert_eq!(retry_host, spare);
    assert!(recorded(&rm, 0, 2).is_none(), "the healthy task was not retried");
    // The AM counted it as a transient retry (CONTAINER_NODE_LOST), not a task failure.
    let tracking = rm.app(&app)["trackingUrl"].as_str().unwrap().to_string();
    let metrics = wait_for(Duration::from_secs(10), "the transient retry in /metrics", || {
        let text = rm.get_text(&format!("{tracking}metrics"))?;
        text.contains("gpuam_task_retries_total{exit_class=\"transient\"} 1")
            .then_some(text)
    });
    assert!(
        metrics.contains("gpuam_task_retries_total{exit_class=\"permanent\"} 0"),
        "{metrics}"
    );

    fs::write(rm.path("release"), "").unwrap();
    let out = sub.wait(Duration::from_secs(40));
    assert_eq!(out.code, 0, "{out:?}\n{}", rm.logs());
    let a = rm.app(&app);
    assert_eq!(a["state"], "FINISHED", "{a}");
    wait_groups_gone(&[first[0].1], Duration::from_secs(5));

    // While LOST the node is out; bring it back: RUNNING again and placeable. A job
    // that needs every node's only GPU proves it.
    let (status, body) = rm.put_json(&path, Some(&admin), &json!({"state": "RUNNING"}));
    assert_eq!(status, 200, "{body}");
    assert_eq!(node_state(&rm, &lost_host), "RUNNING");
    rm.assert_all_free(Duration::from_secs(5));
    let all = rm.write_job(
        "all3",
        &format!(
            "name: all3\ngang: true\ntaskRoles:\n  w:\n    instances: 3\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1}}\n    commands:\n{}",
            commands(&[&format!("echo $GPUAM_HOST > {root}/all3.$GPUAM_TASK_INDEX")])
        ),
    );
    let out = rm.run_job(&all, Duration::from_secs(40));
    assert_eq!(out.code, 0, "{out:?}\n{}", rm.logs());
    let mut hosts: Vec<String> = (0..3)
        .map(|i| {
            fs::read_to_string(rm.path(&format!("all3.{i}")))
                .unwrap()
                .trim()
                .to_string()
        })
        .collect();
    hosts.sort();
    assert_eq!(hosts, ["n1", "n2", "n3"], "the returned node takes work again");
    rm.assert_all_free(Duration::from_secs(5));
}

#[test]
fn lost_node_takes_no_work_until_it_returns() {
    let rm = Rm::start(CLUSTER, &[("GPUAM__SELECT__SEED", "1")]);
    let admin = rm.admin_token();
    for (host, state) in [("n1", "LOST"), ("n2", "UNHEALTHY"), ("n3", "DECOMMISSIONED")] {
        let (status, body) = rm.put_json(
            &format!("/ws/v1/cluster/nodes/{host}/state"),
            Some(&admin),
            &json!({ "state": state }),
        );
        assert_eq!(status, 200, "{body}");
        assert_eq!(node_state(&rm, host), state);
    }
    let m = rm.get_json("/ws/v1/cluster/metrics").unwrap();
    assert_eq!(m["clusterMetrics"]["totalGpus"], 0, "{m}");
    assert_eq!(m["clusterMetrics"]["lostNodes"], 1, "{m}");
    // Unknown hosts and states that cannot be set are refused with an ErrorBody.
    let (status, body) = rm.put_json(
        "/ws/v1/cluster/nodes/nope/state",
        Some(&admin),
        &json!({"state": "LOST"}),
    );
    assert_eq!((status, body["code"].as_str()), (404, Some("NOT_FOUND")), "{body}");
    let (status, body) = rm.put_json(
        "/ws/v1/cluster/nodes/n1/state",
        Some(&admin),
        &json!({"state": "REBOOTED"}),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body["message"].as_str().unwrap().contains("RUNNING, LOST"), "{body}");

    // No node can hold the job: `gpuam plan --rm` says so.
    let root = rm.root().display().to_string();
    let job = rm.write_job(
        "one",
        &format!(
            "name: one\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1}}\n    commands:\n{}",
            commands(&[&format!("echo $GPUAM_HOST > {root}/one")])
        ),
    );
    let plan = rm
        .gpuam()
        .args(["plan", job.to_str().unwrap(), "--rm", &rm.url, "--json"])
        .output()
        .unwrap();
    assert_eq!(plan.status.code(), Some(2), "{}", String::from_utf8_lossy(&plan.stdout));

    let (status, _) = rm.put_json(
        "/ws/v1/cluster/nodes/n2/state",
        Some(&admin),
        &json!({"state": "RUNNING"}),
    );
    assert_eq!(status, 200);
    let out = rm.run_job(&job, Duration::from_secs(40));
    assert_eq!(out.code, 0, "{out:?}\n{}", rm.logs());
    assert_eq!(fs::read_to_string(rm.path("one")).unwrap().trim(), "n2");
    for host in ["n1", "n3"] {
        rm.put_json(
            &format!("/ws/v1/cluster/nodes/{host}/state"),
            Some(&admin),
            &json!({"state": "RUNNING"}),
        );
    }
    rm.assert_all_free(Duration::from_secs(5));
}
