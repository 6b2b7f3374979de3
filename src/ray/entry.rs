//! The Ray job that runs one container: its entrypoint (the gate check, then the task's
//! commands) and the submit body pinning it to the granted node and GPUs. Pure: no I/O.
//!
//! Why a gate: Ray does not cancel a PENDING job that is stopped; its supervisor still
//! starts the entrypoint once the resources free, and only then delivers the stop. So the
//! entrypoint first asks gpuam's gate (`GET <gate>/gate/<containerId>` with the container's
//! gate key) whether the container may still run; anything but `200` ends it before the
//! task's first command (fail-closed: an unreachable gate is retried for
//! [`GATE_PATIENCE_SEC`] seconds, then the job exits with [`EXIT_GATE_UNREACHABLE`]).
//!
//! The commands run as the node executor runs them (DESIGN.md §8): in order, in one bash
//! shell, the first that fails ends the task with its status; in a fresh directory
//! `${TMPDIR:-/tmp}/gpuam-ray/<containerId>`; stderr goes to stdout (Ray keeps one log).

use std::collections::BTreeMap;

use serde_json::json;

use super::client::JobSubmit;
use super::scheme::{gpu_resource, node_resource, NODE_RESOURCE_SHARE};
use crate::protocol::LaunchContext;
use crate::resources::{mask_hex, mask_indices, Resources};

/// How long the entrypoint keeps trying to reach an unreachable gate.
pub const GATE_PATIENCE_SEC: u32 = 30;
/// Exit status of a job whose gate could not be reached (the task did not run).
pub const EXIT_GATE_UNREACHABLE: i32 = 75;
/// Exit status of a job the gate refused (cancelled before it started; the task did not run).
pub const EXIT_GATE_REFUSED: i32 = 76;
/// Environment variables the entrypoint reads the gate from.
pub const ENV_GATE_URL: &str = "GPUAM_RAY_GATE";
pub const ENV_GATE_KEY: &str = "GPUAM_RAY_GATE_KEY";

/// The gate check, in Python (every Ray node has Python; no curl needed). Exit 0: run.
const GATE_PY: &str = r#"import os, sys, time, urllib.request, urllib.error
url, key = os.environ["GPUAM_RAY_GATE"], os.environ["GPUAM_RAY_GATE_KEY"]
deadline = time.time() + float(sys.argv[1])
while True:
    try:
        req = urllib.request.Request(url, headers={"Authorization": "Bearer " + key})
        with urllib.request.urlopen(req, timeout=5) as r:
            sys.exit(0 if r.status == 200 else int(sys.argv[3]))
    except urllib.error.HTTPError as e:
        print("gpuam: the gate refused this container (HTTP %d): it was cancelled before it started" % e.code)
        sys.exit(int(sys.argv[3]))
    except Exception as e:
        if time.time() > deadline:
            print("gpuam: cannot reach the gate %s: %s" % (url, e))
            sys.exit(int(sys.argv[2]))
        time.sleep(1)
"#;

/// Quotes any text for sh/bash: `'...'` with each `'` written as `'\''`.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The bash script the entrypoint runs.
pub fn script(container_id: &str, commands: &[String]) -> String {
    let mut s = String::new();
    s.push_str(&format!("# gpuam container {container_id}\n"));
    s.push_str("exec 2>&1\n");
    s.push_str("__gpuam_py=$(command -v python3 || command -v python)\n");
    s.push_str(&format!(
        "\"$__gpuam_py\" -c {} {GATE_PATIENCE_SEC} {EXIT_GATE_UNREACHABLE} {EXIT_GATE_REFUSED} || exit $?\n",
        shell_quote(GATE_PY)
    ));
    s.push_str(&format!(
        "GPUAM_CONTAINER_DIR=\"${{TMPDIR:-/tmp}}/gpuam-ray/\"{}\n",
        shell_quote(container_id)
    ));
    s.push_str("export GPUAM_CONTAINER_DIR\n");
    s.push_str("mkdir -p \"$GPUAM_CONTAINER_DIR\" && cd \"$GPUAM_CONTAINER_DIR\" || exit 70\n");
    s.push_str("unset GPUAM_RAY_GATE_KEY\n");
    s.push_str("trap 'trap \"\" TERM; kill -TERM 0 2>/dev/null; wait; exit 143' TERM\n");
    for (i, c) in commands.iter().enumerate() {
        s.push_str(&format!("# command {i}\neval {}\n", shell_quote(c)));
        s.push_str("__gpuam_rc=$?; if [ \"$__gpuam_rc\" -ne 0 ]; then exit \"$__gpuam_rc\"; fi\n");
    }
    s.push_str("exit 0\n");
    s
}

/// The environment of the container (DESIGN.md §6) as far as the RM side sets it: the AM's
/// variables, then the GPU variables of the grant, the container id and host, and the gate.
pub fn container_env(
    container_id: &str,
    host: &str,
    granted: &Resources,
    ctx: &LaunchContext,
    gate_url: &str,
    gate_key: &str,
) -> BTreeMap<String, String> {
    let mut env = ctx.env.clone();
    let mask = granted.gpu_mask;
    let list = mask_indices(mask)
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let nvidia = if mask == 0 { "none".to_string() } else { list.clone() };
    for (k, v) in [
        ("CUDA_VISIBLE_DEVICES", list),
        ("NVIDIA_VISIBLE_DEVICES", nvidia),
        ("GPUAM_GPU_MASK", mask_hex(mask)),
        ("CONTAINER_GPUS", mask.to_string()),
        ("GPUAM_CONTAINER_ID", container_id.to_string()),
        ("GPUAM_HOST", host.to_string()),
        (ENV_GATE_URL, gate_url.to_string()),
        (ENV_GATE_KEY, gate_key.to_string()),
    ] {
        env.insert(k.into(), v);
    }
    env.remove("GPUAM_GPU_FRACTION");
    env.extend(crate::node::executor::share_env(granted));
    env
}

/// The submit body: named after the container, on the granted node (0.001 of its node
/// resource), holding each granted GPU's resource (a share holds that fraction of it: Ray
/// accounts fractional custom resources, so Ray too keeps a GPU's shares within 1), and
/// each custom resource granted under its own name, with no Ray GPU and no CPU (gpuam's
/// ledger accounts CPU and memory; Ray's CPUs would only limit how many jobs a node runs).
pub fn job_submit(
    container_id: &str,
    host: &str,
    granted: &Resources,
    ctx: &LaunchContext,
    gate_url: &str,
    gate_key: &str,
) -> JobSubmit {
    let mut resources = BTreeMap::from([(node_resource(host), NODE_RESOURCE_SHARE)]);
    for i in mask_indices(granted.gpu_mask) {
        resources.insert(gpu_resource(i), f64::from(granted.gpu_hundredths(i)) / 100.0);
    }
    for (name, units) in granted.custom.iter() {
        resources.insert(name.to_string(), units as f64);
    }
    let env = container_env(container_id, host, granted, ctx, gate_url, gate_key);
    JobSubmit {
        entrypoint: format!("bash -c {}", shell_quote(&script(container_id, &ctx.commands))),
        submission_id: container_id.to_string(),
        entrypoint_num_cpus: 0.0,
        entrypoint_num_gpus: 0.0,
        entrypoint_resources: resources,
        runtime_env: json!({ "env_vars": env }),
        metadata: BTreeMap::from([
            ("gpuam.container".to_string(), container_id.to_string()),
            ("gpuam.host".to_string(), host.to_string()),
            ("gpuam.gpuMask".to_string(), mask_hex(granted.gpu_mask)),
        ]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::PortSet;
    use std::process::Command;

    fn ctx(commands: &[&str]) -> LaunchContext {
        LaunchContext {
            commands: commands.iter().map(|s| s.to_string()).collect(),
            env: BTreeMap::from([("GPUAM_TASK_ROLE".to_string(), "worker".to_string())]),
        }
    }

    #[test]
    fn the_job_is_pinned_to_the_granted_node_and_gpus_only() {
        let granted = Resources::with_mask(2, 100, 0b101000, PortSet::new());
        let j = job_submit("c_1_01_000002", "n1", &granted, &ctx(&["true"]), "http://g/gate/c", "k");
        assert_eq!(j.submission_id, "c_1_01_000002");
        assert_eq!(j.entrypoint_num_gpus, 0.0);
        assert_eq!(
            j.entrypoint_resources,
            BTreeMap::from([
                ("gpuam-node-n1".to_string(), NODE_RESOURCE_SHARE),
                ("gpuam-gpu-3".to_string(), 1.0),
                ("gpuam-gpu-5".to_string(), 1.0),
            ])
        );
        let env = &j.runtime_env["env_vars"];
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "3,5");
        assert_eq!(env["GPUAM_GPU_MASK"], "0x28");
        assert_eq!(env["GPUAM_TASK_ROLE"], "worker");
        assert_eq!(env[ENV_GATE_KEY], "k");
    }

    #[test]
    fn a_share_holds_its_fraction_of_the_gpu_resource_and_custom_resources_by_name() {
        let granted = Resources::with_share(1, 100, 2, 25, PortSet::new())
            .with_custom(crate::resources::CustomResources::from_pairs([("nvme", 1)]));
        let j = job_submit("c_1_01_000003", "n1", &granted, &ctx(&["true"]), "http://g/gate/c", "k");
        assert_eq!(
            j.entrypoint_resources,
            BTreeMap::from([
                ("gpuam-node-n1".to_string(), NODE_RESOURCE_SHARE),
                ("gpuam-gpu-2".to_string(), 0.25),
                ("nvme".to_string(), 1.0),
            ])
        );
        let env = &j.runtime_env["env_vars"];
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "2");
        assert_eq!(env["GPUAM_GPU_FRACTION"], "0.25");
        assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
        assert_eq!(env["GPUAM_RESOURCE_NVME"], "1");
    }

    /// Runs the entrypoint's script with bash against a gate URL (nothing listens on port 9
    /// of loopback, so the gate is unreachable at once).
    fn run_script(commands: &[&str], gate: &str, patience_env: &[(&str, &str)]) -> (i32, String) {
        let dir = tempfile::tempdir().unwrap();
        let s = script("c_test", &commands.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .replace(&format!(" {GATE_PATIENCE_SEC} "), " 0 ");
        let out = Command::new("bash")
            .arg("-c")
            .arg(&s)
            .env("TMPDIR", dir.path())
            .env(ENV_GATE_URL, gate)
            .env(ENV_GATE_KEY, "k")
            .envs(patience_env.iter().copied())
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }

    #[test]
    fn an_unreachable_gate_runs_no_command() {
        let (code, out) = run_script(&["echo RAN"], "http://127.0.0.1:9/gate/c_test", &[]);
        assert_eq!(code, EXIT_GATE_UNREACHABLE, "{out}");
        assert!(!out.contains("RAN"), "{out}");
        assert!(out.contains("cannot reach the gate"), "{out}");
    }

    #[tokio::test]
    async fn an_open_gate_runs_the_commands_in_order_and_stops_at_the_first_failure() {
        let gate = super::super::gate::Gate::start("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let key = gate.open("c_test");
        let url = gate.url_of("c_test");
        let (code, out) = tokio::task::spawn_blocking(move || {
            let dir = tempfile::tempdir().unwrap();
            let s = script(
                "c_test",
                &[
                    "echo one; echo err >&2".into(),
                    "pwd".into(),
                    "exit 7".into(),
                    "echo never".into(),
                ],
            );
            let out = Command::new("bash")
                .arg("-c")
                .arg(&s)
                .env("TMPDIR", dir.path())
                .env(ENV_GATE_URL, url)
                .env(ENV_GATE_KEY, key)
                .output()
                .unwrap();
            (
                out.status.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stdout).into_owned(),
            )
        })
        .await
        .unwrap();
        assert_eq!(code, 7, "{out}");
        assert!(out.contains("one\nerr\n"), "stderr joins stdout: {out}");
        assert!(out.contains("gpuam-ray/c_test"), "{out}");
        assert!(!out.contains("never"), "{out}");
        gate.shutdown();
    }

    #[tokio::test]
    async fn a_closed_gate_runs_no_command() {
        let gate = super::super::gate::Gate::start("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let key = gate.open("c_test");
        gate.close("c_test");
        let url = gate.url_of("c_test");
        let (code, out) =
            tokio::task::spawn_blocking(move || run_script(&["echo RAN"], &url, &[(ENV_GATE_KEY, key.as_str())]))
                .await
                .unwrap();
        assert_eq!(code, EXIT_GATE_REFUSED, "{out}");
        assert!(!out.contains("RAN"), "{out}");
        // A wrong key is refused too.
        let key = gate.open("c_other");
        let url = gate.url_of("c_other");
        let _ = key;
        let (code, out) = tokio::task::spawn_blocking(move || run_script(&["echo RAN"], &url, &[]))
            .await
            .unwrap();
        assert_eq!(code, EXIT_GATE_REFUSED, "{out}");
        gate.shutdown();
    }
}
