//! The container contract (DESIGN.md §6): the one place that turns a granted container's
//! launch context and grant into the environment its task sees and the command lines of
//! its launch script. Every backend uses it: the node executor (in-process nodes and node
//! agents) and the Ray backend, so a variable promised by §6 is set everywhere or nowhere.
//!
//! Owns:
//! - the names of the variables made from a label or role ([`env_name`]), the AM's part of
//!   the environment ([`app_env`]: job, app, role, index, attempt, ports, peers);
//! - gpuam's own part, which wins over the launch context's ([`container_env`]): the GPU
//!   variables of the grant, container id, host, submitting user, directory, the locality
//!   of its GPUs (`GPUAM_NIC`, `NCCL_IB_HCA`, `GPUAM_NUMA_NODES`, `GPUAM_CPU_AFFINITY`), a
//!   GPU share's and custom resources' variables ([`share_env`]);
//! - the script body that runs the task's commands ([`commands_script`]): in order, in one
//!   bash shell, the first that fails ends the task with its status, a TERM ends the group;
//! - what a launch context may hold ([`validate_context`]: what bash or `execve` can carry)
//!   and what a node's operator may add for every task ([`check_task_env`]: not a name
//!   gpuam sets).
//!
//! What stays with each backend: the base a task starts from (the executor's clean PATH /
//! HOME / LANG and the node's `--task-env`; a Ray worker's own environment) and what the
//! script does before the commands (the executor's exit-code file, Ray's gate).
//! Pure: no I/O.

use std::collections::BTreeMap;
use std::path::Path;

use crate::protocol::LaunchContext;
use crate::resources::{mask_hex, mask_indices, Resources};
use crate::topology::{CpuList, TaskLocality};

/// An environment variable name made from a label or role: upper case, anything other
/// than letters, digits and `_` becomes `_`.
pub fn env_name(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect()
}

/// `CONTAINER_PORTS` in frameworklauncher's format: `label:p1,p2;label2:p3;`.
pub fn container_ports_string(ports: &[(String, Vec<u16>)]) -> String {
    ports
        .iter()
        .map(|(l, ps)| format!("{l}:{};", ps.iter().map(u16::to_string).collect::<Vec<_>>().join(",")))
        .collect()
}

/// The task as the AM knows it, for [`app_env`].
pub struct AppTask<'a> {
    pub job: &'a str,
    pub app_id: &'a str,
    pub role: &'a str,
    pub index: u32,
    pub attempt: u32,
    /// Ports by label.
    pub ports: &'a [(String, Vec<u16>)],
    /// Role → "host:firstPort" per index (gang jobs).
    pub peers: Option<&'a BTreeMap<String, Vec<String>>>,
}

/// The AM's part of a container's environment (the node side adds the rest, see
/// [`container_env`]).
pub fn app_env(t: &AppTask<'_>) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    env.insert("GPUAM_JOB".into(), t.job.to_string());
    env.insert("GPUAM_APP_ID".into(), t.app_id.to_string());
    env.insert("GPUAM_TASK_ROLE".into(), t.role.to_string());
    env.insert("GPUAM_TASK_INDEX".into(), t.index.to_string());
    env.insert("GPUAM_ATTEMPT".into(), t.attempt.to_string());
    env.insert("CONTAINER_PORTS".into(), container_ports_string(t.ports));
    for (label, ps) in t.ports {
        env.insert(
            format!("GPUAM_PORT_{}", env_name(label)),
            ps.iter().map(u16::to_string).collect::<Vec<_>>().join(","),
        );
    }
    if let Some(peers) = t.peers {
        for (r, hosts) in peers {
            env.insert(format!("GPUAM_HOSTS_{}", env_name(r)), hosts.join(","));
        }
    }
    env
}

/// A granted container as its node runs it, for [`container_env`].
pub struct NodeSide<'a> {
    pub container_id: &'a str,
    pub host: &'a str,
    pub granted: &'a Resources,
    /// Who submitted the job (`GPUAM_USER`; an OpenPAI job's `PAI_USER_NAME` too).
    pub user: Option<&'a str>,
    /// Where its GPUs are ([`crate::topology::task_locality`]; default: unknown).
    pub locality: &'a TaskLocality,
    /// The CPUs it is pinned to (`GPUAM_CPU_AFFINITY`); `None`: not pinned, not set.
    pub cpus: Option<&'a CpuList>,
    /// Its own directory and preemption notice (`GPUAM_CONTAINER_DIR`,
    /// `GPUAM_PREEMPT_FILE`) when the node knows them before the task runs; else the
    /// backend's script sets the directory.
    pub dir: Option<(&'a Path, &'a Path)>,
}

/// The task's whole environment: `base` (the backend's), then the launch context's, then
/// gpuam's own, which win over both for their names:
/// - `CUDA_VISIBLE_DEVICES`: ascending GPU indices of the grant (`"1,3"`); for no GPUs the
///   empty string, which makes CUDA frameworks see no device at all;
/// - `NVIDIA_VISIBLE_DEVICES`: the same list; for no GPUs `none`;
/// - `GPUAM_GPU_MASK` (`"0xa"`), `CONTAINER_GPUS` (the mask in decimal, `"10"`);
/// - `GPUAM_CONTAINER_ID`, `GPUAM_HOST`, `GPUAM_USER`, the directory (see [`NodeSide::dir`]);
/// - the locality's `GPUAM_NIC`, `NCCL_IB_HCA`, `GPUAM_NUMA_NODES`, and
///   `GPUAM_CPU_AFFINITY` = the CPUs applied ([`NodeSide::cpus`]);
/// - [`share_env`].
pub fn container_env(
    base: BTreeMap<String, String>,
    ctx: &LaunchContext,
    n: &NodeSide<'_>,
) -> BTreeMap<String, String> {
    let mut env = base;
    for (k, v) in &ctx.env {
        env.insert(k.clone(), v.clone());
    }
    let mask = n.granted.gpu_mask;
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
        ("GPUAM_CONTAINER_ID", n.container_id.to_string()),
        ("GPUAM_HOST", n.host.to_string()),
    ] {
        env.insert(k.into(), v);
    }
    if let Some((dir, preempt)) = n.dir {
        env.insert("GPUAM_CONTAINER_DIR".into(), dir.to_string_lossy().into_owned());
        env.insert("GPUAM_PREEMPT_FILE".into(), preempt.to_string_lossy().into_owned());
    }
    if let Some(user) = n.user {
        env.insert("GPUAM_USER".into(), user.to_string());
        if let Some(pai) = env.get_mut("PAI_USER_NAME") {
            *pai = user.to_string();
        }
    }
    // Where its GPUs are; the CPU list is the one applied, never one the job set.
    for (k, v) in n.locality.env() {
        env.insert(k, v);
    }
    match n.cpus {
        Some(c) => env.insert("GPUAM_CPU_AFFINITY".into(), c.to_string()),
        None => env.remove("GPUAM_CPU_AFFINITY"),
    };
    // Ours alone: a whole-GPU task never reads a share that someone else set.
    env.remove("GPUAM_GPU_FRACTION");
    env.extend(share_env(n.granted));
    env
}

/// The environment of a GPU share and of custom resources (issue 15). A fractional
/// container gets `GPUAM_GPU_FRACTION` ("0.25") and `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`
/// ("25"): an MPS daemon on the node, if one runs, then limits the task's share of the
/// GPU's threads. GPU memory is not limited by this (set MPS memory limits for that).
/// Each custom resource is `GPUAM_RESOURCE_<NAME>` ([`env_name`]) with its units, and
/// `GPUAM_RESOURCES` lists them all (`nvme=1,ib_hca=2`).
pub fn share_env(granted: &Resources) -> Vec<(String, String)> {
    let mut out = Vec::new();
    if let Some(h) = granted.gpu_share() {
        out.push(("GPUAM_GPU_FRACTION".into(), crate::resources::format_hundredths(h)));
        out.push(("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), h.to_string()));
    }
    if !granted.custom.is_empty() {
        out.push(("GPUAM_RESOURCES".into(), granted.custom.to_text()));
        for (name, units) in granted.custom.iter() {
            out.push((format!("GPUAM_RESOURCE_{}", env_name(name)), units.to_string()));
        }
    }
    out
}

/// Quotes any text for sh/bash: `'...'` with each `'` written as `'\''`.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The part of a launch script that runs the task's commands, after the backend's own
/// prologue.
///
/// The TERM trap makes the leader pass the stop to its whole process group and reap its
/// children before it exits with 143, so a stop leaves no zombies behind even under an
/// init that does not reap orphans.
///
/// Each command runs through `eval` of its single-quoted text, in the script's own shell
/// (so `cd`, `export` and variables carry over to the next command, as in one script), and
/// `$?` is checked after it: the first non-zero status ends the script with that status.
/// `set -e` is not used because it is ignored inside `if`/`&&`/`||` contexts, looks only at
/// a pipeline's last command anyway, and would change the meaning of a multi-statement
/// command by aborting it at an inner failure. `eval` also confines a syntax error to its
/// own command (status 2) instead of breaking the whole script.
pub fn commands_script(commands: &[String]) -> String {
    let mut s = String::new();
    s.push_str("trap 'trap \"\" TERM; kill -TERM 0 2>/dev/null; wait; exit 143' TERM\n");
    for (i, c) in commands.iter().enumerate() {
        s.push_str(&format!("# command {i}\n"));
        s.push_str(&format!("eval {}\n", shell_quote(c)));
        s.push_str("__gpuam_rc=$?; if [ \"$__gpuam_rc\" -ne 0 ]; then exit \"$__gpuam_rc\"; fi\n");
    }
    s.push_str("exit 0\n");
    s
}

/// Names a node's operator may not set with `--task-env`: gpuam sets them for each task
/// (DESIGN.md §6, OpenPAI's `PAI_*`), and they would be replaced without a word.
fn reserved_task_env(name: &str) -> bool {
    name.starts_with("GPUAM_")
        || name.starts_with("PAI_")
        || matches!(
            name,
            "CUDA_VISIBLE_DEVICES" | "NVIDIA_VISIBLE_DEVICES" | "CONTAINER_GPUS" | "CONTAINER_PORTS"
        )
}

/// Checks one `--task-env NAME=VALUE` entry; the error names the entry and the fix.
pub fn check_task_env(name: &str, value: &str) -> Result<(), String> {
    let valid_name = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !valid_name {
        return Err(format!(
            "`{}` is not a variable name: use letters, digits and `_`, not starting with a digit",
            name.escape_debug()
        ));
    }
    if reserved_task_env(name) {
        return Err(format!(
            "`{name}` is set by gpuam for each task (GPUAM_*, PAI_*, CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES, \
             CONTAINER_GPUS, CONTAINER_PORTS); choose another name"
        ));
    }
    if value.contains('\0') {
        return Err(format!("`{name}` has a NUL character in its value; remove it"));
    }
    Ok(())
}

/// Rejects what bash or `execve` cannot carry, naming the field.
pub fn validate_context(ctx: &LaunchContext) -> Result<(), String> {
    for (i, c) in ctx.commands.iter().enumerate() {
        if c.contains('\0') {
            return Err(format!("commands[{i}] contains a NUL character; remove it"));
        }
    }
    for (k, v) in &ctx.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(format!(
                "env name `{}` is not a valid variable name (non-empty, without `=` or NUL)",
                k.escape_debug()
            ));
        }
        if v.contains('\0') {
            return Err(format!("env `{k}` has a NUL character in its value; remove it"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::PortSet;

    #[test]
    fn gpuams_variables_win_and_the_cpu_list_is_the_one_applied() {
        let granted = Resources::with_mask(2, 100, 0b1010, PortSet::new());
        let ctx = LaunchContext {
            commands: vec![],
            env: BTreeMap::from([
                ("CUDA_VISIBLE_DEVICES".to_string(), "7".to_string()),
                ("GPUAM_CPU_AFFINITY".to_string(), "0-63".to_string()),
                ("GPUAM_GPU_FRACTION".to_string(), "0.5".to_string()),
                ("PAI_USER_NAME".to_string(), "x".to_string()),
                ("MINE".to_string(), "kept".to_string()),
            ]),
        };
        let locality = TaskLocality::default();
        let base = BTreeMap::from([("MINE".to_string(), "base".to_string())]);
        let side = |granted, user| NodeSide {
            container_id: "c1",
            host: "h",
            granted,
            user,
            locality: &locality,
            cpus: None,
            dir: None,
        };
        let env = container_env(base, &ctx, &side(&granted, Some("alice")));
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "1,3");
        assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "1,3");
        assert_eq!(env["GPUAM_GPU_MASK"], "0xa");
        assert_eq!(env["CONTAINER_GPUS"], "10");
        assert_eq!(env["GPUAM_USER"], "alice");
        assert_eq!(env["PAI_USER_NAME"], "alice");
        assert_eq!(env["MINE"], "kept", "the launch context wins over the base");
        assert!(!env.contains_key("GPUAM_CPU_AFFINITY"), "not pinned: not set");
        assert!(!env.contains_key("GPUAM_GPU_FRACTION"), "a whole GPU has no fraction");
        assert!(!env.contains_key("GPUAM_CONTAINER_DIR"));
        let none = Resources::with_mask(0, 100, 0, PortSet::new());
        let env = container_env(BTreeMap::new(), &ctx, &side(&none, None));
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "");
        assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "none");
        assert_eq!(env["PAI_USER_NAME"], "x");
    }

    #[test]
    fn names_from_labels_and_the_port_string() {
        assert_eq!(env_name("ssh.x-y"), "SSH_X_Y");
        let ports = vec![("http".to_string(), vec![2001]), ("ssh".to_string(), vec![2002, 2003])];
        assert_eq!(container_ports_string(&ports), "http:2001;ssh:2002,2003;");
    }

    #[test]
    fn the_commands_script_stops_at_the_first_failure() {
        let s = commands_script(&["echo 'a b'".into(), "exit 4".into(), "echo never".into()]);
        let out = std::process::Command::new("bash").arg("-c").arg(&s).output().unwrap();
        assert_eq!(out.status.code(), Some(4));
        assert_eq!(String::from_utf8_lossy(&out.stdout), "a b\n");
    }
}
