//! What runs one container on a Ray node, for both ways gpuam launches there: the
//! container's environment ([`contract_env`]), its Ray resources ([`ray_resources`]) and
//! its script on the node ([`node_script`]); and for a Ray job (`--ray-launch jobs`) the
//! entrypoint (the gate check, then the node script) and the submit body. Pure: no I/O.
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
//! Environment and commands come from the container contract (`node::contract`).

use std::collections::BTreeMap;

use serde_json::json;

use super::client::JobSubmit;
use super::scheme::{gpu_resource, node_resource, NODE_RESOURCE_SHARE};
use crate::node::contract::{self, commands_script, shell_quote, NodeSide};
use crate::node::Grant;
use crate::protocol::LaunchContext;
use crate::resources::{mask_hex, mask_indices};
use crate::topology::task_locality;

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

/// The bash script the entrypoint runs: the gate, then [`node_script`], stderr joined to
/// stdout (Ray keeps one log of a job).
pub fn script(container_id: &str, commands: &[String]) -> String {
    let mut s = String::new();
    s.push_str(&format!("# gpuam container {container_id}\n"));
    s.push_str("exec 2>&1\n");
    s.push_str("__gpuam_py=$(command -v python3 || command -v python)\n");
    s.push_str(&format!(
        "\"$__gpuam_py\" -c {} {GATE_PATIENCE_SEC} {EXIT_GATE_UNREACHABLE} {EXIT_GATE_REFUSED} || exit $?\n",
        shell_quote(GATE_PY)
    ));
    s.push_str("unset GPUAM_RAY_GATE_KEY\n");
    s.push_str(&node_script(container_id, commands));
    s
}

/// What runs a container on a Ray node, whichever way it got there: its directory
/// `${TMPDIR:-/tmp}/gpuam-ray/<containerId>` (`GPUAM_CONTAINER_DIR`), its CPUs
/// (`GPUAM_CPU_AFFINITY`, applied with `taskset` to the task's own shell where the node
/// has it, as the executor does without a cpuset), then the commands as the container
/// contract runs them.
pub fn node_script(container_id: &str, commands: &[String]) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "GPUAM_CONTAINER_DIR=\"${{TMPDIR:-/tmp}}/gpuam-ray/\"{}\n",
        shell_quote(container_id)
    ));
    s.push_str("export GPUAM_CONTAINER_DIR\n");
    s.push_str("mkdir -p \"$GPUAM_CONTAINER_DIR\" && cd \"$GPUAM_CONTAINER_DIR\" || exit 70\n");
    s.push_str(PIN_CPUS);
    s.push_str(&commands_script(commands));
    s
}

/// Pins the script's shell (and so every command) to `GPUAM_CPU_AFFINITY`, or says why not.
const PIN_CPUS: &str = "if [ -n \"${GPUAM_CPU_AFFINITY:-}\" ]; then taskset -cp \"$GPUAM_CPU_AFFINITY\" $$ >/dev/null 2>&1 \\\n  || echo \"gpuam: not pinned to CPUs $GPUAM_CPU_AFFINITY (no taskset here, or not this node's CPUs)\" >&2; fi\n";

/// The environment of the container (DESIGN.md §6, [`crate::node::contract`]) as the RM
/// side sets it for the grant: everything but the directory (the script sets it on the
/// node).
pub fn contract_env(grant: &Grant, ctx: &LaunchContext) -> BTreeMap<String, String> {
    let locality = grant
        .topology
        .as_deref()
        .map(|t| task_locality(t, grant.resources.gpu_mask))
        .unwrap_or_default();
    let side = NodeSide {
        container_id: &grant.container_id,
        host: &grant.host,
        granted: &grant.resources,
        user: Some(grant.user.as_str()).filter(|u| !u.is_empty()),
        locality: &locality,
        cpus: locality.cpus.as_ref(),
        dir: None,
    };
    contract::container_env(BTreeMap::new(), ctx, &side)
}

/// [`contract_env`] and the gate of a Ray job.
pub fn container_env(grant: &Grant, ctx: &LaunchContext, gate_url: &str, gate_key: &str) -> BTreeMap<String, String> {
    let mut env = contract_env(grant, ctx);
    env.insert(ENV_GATE_URL.into(), gate_url.to_string());
    env.insert(ENV_GATE_KEY.into(), gate_key.to_string());
    env
}

/// The Ray resources a container holds: 0.001 of its node's resource, each granted GPU's
/// resource (a share holds that fraction of it: Ray accounts fractional custom resources,
/// so Ray too keeps a GPU's shares within 1), and each custom resource granted under its
/// own name; no Ray GPU and no CPU (gpuam's ledger accounts CPU and memory; Ray's CPUs
/// would only limit how many containers a node runs).
pub fn ray_resources(grant: &Grant) -> BTreeMap<String, f64> {
    let granted = &grant.resources;
    let mut resources = BTreeMap::from([(node_resource(&grant.host), NODE_RESOURCE_SHARE)]);
    for i in mask_indices(granted.gpu_mask) {
        resources.insert(gpu_resource(i), f64::from(granted.gpu_hundredths(i)) / 100.0);
    }
    for (name, units) in granted.custom.iter() {
        resources.insert(name.to_string(), units as f64);
    }
    resources
}

/// The submit body: named after the container, holding its [`ray_resources`].
pub fn job_submit(grant: &Grant, ctx: &LaunchContext, gate_url: &str, gate_key: &str) -> JobSubmit {
    let (container_id, host, granted) = (grant.container_id.as_str(), grant.host.as_str(), &grant.resources);
    let resources = ray_resources(grant);
    let env = container_env(grant, ctx, gate_url, gate_key);
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
    use crate::resources::{PortSet, Resources};
    use std::process::Command;

    fn grant(id: &str, host: &str, resources: Resources) -> Grant {
        Grant {
            container_id: id.into(),
            app_id: "app_1".into(),
            host: host.into(),
            resources,
            user: String::new(),
            topology: None,
        }
    }

    fn ctx(commands: &[&str]) -> LaunchContext {
        LaunchContext {
            commands: commands.iter().map(|s| s.to_string()).collect(),
            env: BTreeMap::from([("GPUAM_TASK_ROLE".to_string(), "worker".to_string())]),
        }
    }

    #[test]
    fn the_job_is_pinned_to_the_granted_node_and_gpus_only() {
        let granted = Resources::with_mask(2, 100, 0b101000, PortSet::new());
        let j = job_submit(
            &grant("c_1_01_000002", "n1", granted),
            &ctx(&["true"]),
            "http://g/gate/c",
            "k",
        );
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
        let j = job_submit(
            &grant("c_1_01_000003", "n1", granted),
            &ctx(&["true"]),
            "http://g/gate/c",
            "k",
        );
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

    /// The container contract is one: for the same grant (GPU 0 of a node whose GPU sits
    /// on this machine's first CPU behind an RDMA NIC, a user, a custom resource) the node
    /// executor (in-process nodes and node agents both run `Executor::start_as`) and a Ray
    /// job (its script run by bash with its `env_vars`, the gate open) give the task the
    /// same variables, apart from each backend's own: the base (PATH, HOME...), the
    /// directory, the preemption file and the gate.
    #[tokio::test]
    async fn every_backend_gives_the_same_variables_for_the_same_grant() {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let allowed = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .and_then(crate::topology::CpuList::parse)
            .unwrap();
        let cpu = allowed.cpus().next().unwrap();
        let topo = crate::topology::Topology::parse_nvidia_smi(&format!(
            "\tGPU0\tGPU1\tmlx5_0\teth1\tCPU Affinity\tNUMA Affinity\n\
             GPU0\t X \tSYS\tPIX\tSYS\t{cpu}\t0\n\
             GPU1\tSYS\t X \tSYS\tPIX\t{cpu}\t1\n"
        ))
        .unwrap();
        let resources = Resources::with_mask(1, 100, 0b01, PortSet::new())
            .with_custom(crate::resources::CustomResources::from_pairs([("nvme", 1)]));
        let mut g = grant("c_same_1", "n1", resources.clone());
        g.user = "alice".into();
        g.topology = Some(std::sync::Arc::new(topo.clone()));
        let mut c = ctx(&["env"]);
        c.env.insert("CUDA_VISIBLE_DEVICES".into(), "7".into());
        c.env.insert("GPUAM_CPU_AFFINITY".into(), "0-99".into());

        let root = tempfile::tempdir().unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let exec = crate::node::executor::Executor::new(root.path().to_path_buf(), tx);
        exec.start_as("c_same_1", "n1", &resources, c.clone(), Some(&topo), Some("alice"))
            .unwrap();
        let crate::node::NodeEvent::Exited { exit_status, .. } =
            tokio::time::timeout(std::time::Duration::from_secs(60), rx.recv())
                .await
                .unwrap()
                .unwrap();
        assert_eq!(exit_status, 0);
        let node_env = exec.read_log("c_same_1", crate::node::LogStream::Stdout, None).unwrap();

        let gate = super::super::gate::Gate::start("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let key = gate.open("c_same_1");
        let job = job_submit(&g, &c, &gate.url_of("c_same_1"), &key);
        let vars: BTreeMap<String, String> = serde_json::from_value(job.runtime_env["env_vars"].clone()).unwrap();
        let entry = job.entrypoint.clone();
        let ray_env = tokio::task::spawn_blocking(move || {
            let dir = tempfile::tempdir().unwrap();
            let out = Command::new("bash")
                .arg("-c")
                .arg(&entry)
                .env_clear()
                .env("PATH", std::env::var("PATH").unwrap_or_default())
                .env("TMPDIR", dir.path())
                .envs(&vars)
                .output()
                .unwrap();
            assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stdout));
            String::from_utf8_lossy(&out.stdout).into_owned()
        })
        .await
        .unwrap();
        gate.shutdown();

        let contract = |text: &str| -> BTreeMap<String, String> {
            text.lines()
                .filter_map(|l| l.split_once('='))
                .filter(|(k, _)| {
                    ["GPUAM_", "CUDA_", "NVIDIA_", "NCCL_", "CONTAINER_"]
                        .iter()
                        .any(|p| k.starts_with(p))
                        && !["GPUAM_CONTAINER_DIR", "GPUAM_PREEMPT_FILE", ENV_GATE_URL].contains(k)
                })
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let (on_node, on_ray) = (contract(&node_env), contract(&ray_env));
        assert_eq!(on_node, on_ray, "node:\n{node_env}\nray:\n{ray_env}");
        for (k, v) in [
            ("CUDA_VISIBLE_DEVICES", "0".to_string()),
            ("GPUAM_NIC", "mlx5_0".to_string()),
            ("NCCL_IB_HCA", "mlx5_0".to_string()),
            ("GPUAM_NUMA_NODES", "0".to_string()),
            ("GPUAM_CPU_AFFINITY", cpu.to_string()),
            ("GPUAM_USER", "alice".to_string()),
            ("GPUAM_RESOURCE_NVME", "1".to_string()),
        ] {
            assert_eq!(on_ray.get(k), Some(&v), "{k}: {ray_env}");
        }
        assert!(!ray_env.contains(ENV_GATE_KEY), "the gate key is not the task's");
    }
}
