//! The rules a job spec (and a cluster file) must satisfy that are not about YAML types:
//! explicit limits, name syntax, GPU masks and static port ranges. Each check returns a
//! message and a fix; the readers in `parse.rs` and `cluster/file.rs` attach the position.

use crate::resources::{parse_mask, GpuMask};

use super::yaml::{clip, Node, Value};
use super::PortRequest;

/// Explicit limits on job specs and cluster files. They keep every later stage (the
/// select pipeline, the RM ledger, the dashboard) within known bounds and stop hostile or
/// broken files early.
pub mod limits {
    /// A job spec larger than this is rejected before it is parsed (1 MiB).
    pub const MAX_SPEC_BYTES: usize = 1 << 20;
    /// Task roles per job.
    pub const MAX_TASK_ROLES: usize = 64;
    /// `instances` of one role: 1..=10 000.
    pub const MAX_INSTANCES: i64 = 10_000;
    /// Tasks of all roles together.
    pub const MAX_TOTAL_TASKS: u64 = 100_000;
    /// `cpu` per task: 1..=4096.
    pub const MAX_TASK_CPU: i64 = 4096;
    /// `memoryMB` per task: 1..=16 777 216 (16 TiB).
    pub const MAX_TASK_MEMORY_MB: i64 = 16 * 1024 * 1024;
    /// `gpu` per task: 0..=64 (GPU masks are 64 bits).
    pub const MAX_GPUS: i64 = 64;
    /// Port labels per role.
    pub const MAX_PORT_LABELS: usize = 256;
    /// Ports per task (static and dynamic together).
    pub const MAX_PORTS_PER_TASK: i64 = 1000;
    /// Entries in `commands` (including deployment pre/post commands).
    pub const MAX_COMMANDS: usize = 1000;
    /// `taskRetryCount` and `jobRetryCount`: -2..=10 000 (-1 unlimited failures, -2 always).
    pub const MAX_RETRY: i64 = 10_000;
    /// `gangTimeoutSec`: 1..=2 592 000 (30 days).
    pub const MAX_GANG_TIMEOUT_SEC: i64 = 30 * 24 * 3600;
    /// `priority`: -1 000 000..=1 000 000 (higher runs first within its queue).
    pub const MAX_PRIORITY: i64 = 1_000_000;
    /// A cluster file larger than this is rejected before it is parsed (10 MiB).
    pub const MAX_CLUSTER_BYTES: usize = 10 << 20;
    /// Nodes in a cluster file.
    pub const MAX_NODES: usize = 100_000;
    /// `cpu` of one node: 1..=1 048 576.
    pub const MAX_NODE_CPU: i64 = 1 << 20;
    /// `memoryMB` of one node: 1..=2^40 (1 EiB).
    pub const MAX_NODE_MEMORY_MB: i64 = 1 << 40;
}

/// A failed check: what is wrong and how to fix it.
pub type Problem = (String, String);

fn chars_ok(s: &str, extra: &str) -> bool {
    s.chars().all(|c| c.is_ascii_alphanumeric() || extra.contains(c))
}

/// Job names: `^[a-zA-Z0-9_-]{1,255}$`.
pub fn check_job_name(name: &str) -> Result<(), Problem> {
    if name.is_empty() || name.len() > 255 || !chars_ok(name, "_-") {
        return Err((
            format!("invalid job name \"{}\"", clip(name)),
            "use 1 to 255 letters, digits, `_` or `-`, e.g. `resnet-ddp`".into(),
        ));
    }
    Ok(())
}

/// Queue names: one queue (`teamA`) or a department's queue (`dept.teamA`), each part
/// `^[a-zA-Z0-9_-]{1,64}$` (the RM's settings use the same rule).
pub fn check_queue_name(name: &str) -> Result<(), Problem> {
    let part_ok = |p: &str| !p.is_empty() && p.len() <= 64 && chars_ok(p, "_-");
    let parts: Vec<&str> = name.split('.').collect();
    if parts.len() > 2 || !parts.iter().all(|p| part_ok(p)) {
        return Err((
            format!("invalid queue name \"{}\"", clip(name)),
            "name a queue of the RM's settings: 1 to 64 letters, digits, `_` or `-` (or `department.queue`)".into(),
        ));
    }
    Ok(())
}

/// Role names: `^[a-zA-Z_][a-zA-Z0-9_]{0,63}$`. They become environment variable
/// suffixes (`GPUAM_HOSTS_<ROLE>`), hence no `-` or `.`.
pub fn check_role_name(name: &str) -> Result<(), Problem> {
    let first_ok = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if !first_ok || name.len() > 64 || !chars_ok(name, "_") {
        let hint = name.replace(['-', '.', ' '], "_");
        let fix = if !hint.is_empty() && hint != name && check_role_name(&hint).is_ok() {
            format!("role names become environment variable names (GPUAM_HOSTS_<ROLE>): use letters, digits and `_`, not starting with a digit, at most 64, e.g. `{hint}`")
        } else {
            "role names become environment variable names (GPUAM_HOSTS_<ROLE>): use letters, digits and `_`, not starting with a digit, at most 64".to_string()
        };
        return Err((format!("invalid task role name \"{}\"", clip(name)), fix));
    }
    Ok(())
}

/// Port labels: `^[A-Za-z0-9._~-]{1,64}$`.
pub fn check_port_label(label: &str) -> Result<(), Problem> {
    if label.is_empty() || label.len() > 64 || !chars_ok(label, "._~-") {
        return Err((
            format!("invalid port label \"{}\"", clip(label)),
            "use 1 to 64 letters, digits, `.`, `_`, `~` or `-`, e.g. `http`".into(),
        ));
    }
    Ok(())
}

/// Host names in cluster files: `^[A-Za-z0-9._-]{1,253}$`.
pub fn check_host_name(host: &str) -> Result<(), Problem> {
    if host.is_empty() || host.len() > 253 || !chars_ok(host, "._-") {
        return Err((
            format!("invalid host name \"{}\"", clip(host)),
            "use 1 to 253 letters, digits, `.`, `_` or `-`, e.g. `node-01`".into(),
        ));
    }
    Ok(())
}

/// Node labels: `^[A-Za-z0-9._-]{1,255}$`.
pub fn check_node_label(label: &str) -> Result<(), Problem> {
    if label.is_empty() || label.len() > 255 || !chars_ok(label, "._-") {
        return Err((
            format!("invalid node label \"{}\"", clip(label)),
            "use 1 to 255 letters, digits, `.`, `_` or `-`, e.g. `gpu`".into(),
        ));
    }
    Ok(())
}

/// A GPU mask node: an integer or a hex string such as `"0x3f"`.
pub fn read_mask(node: &Node) -> Result<GpuMask, Problem> {
    let fix = "write the mask as a hex string such as \"0x3f\" (bit i = GPU i, at most 64 bits)".to_string();
    match &node.value {
        Value::Int(i) if *i >= 0 => Ok(*i as u64),
        Value::Int(i) => Err((format!("a GPU mask cannot be negative (found {i})"), fix)),
        Value::Str(s) => {
            let t = s.trim();
            let hex = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X"));
            if let Some(h) = hex {
                let digits = h.trim_start_matches('0');
                if digits.len() > 16 && digits.chars().all(|c| c.is_ascii_hexdigit()) {
                    return Err((
                        format!(
                            "GPU mask \"{}\" has more than 64 bits; gpuam supports at most 64 GPUs per node",
                            clip(t)
                        ),
                        fix,
                    ));
                }
            }
            parse_mask(t).ok_or_else(|| (format!("\"{}\" is not a GPU mask", clip(t)), fix))
        }
        Value::Float(_) => Err((
            format!("GPU mask `{}` is out of range (more than 64 bits)", clip(&node.raw)),
            fix,
        )),
        _ => Err((
            format!("a GPU mask must be a hex string or a number, found {}", node.describe()),
            fix,
        )),
    }
}

/// The last port of a static range, if it stays within 65535.
pub fn static_range_end(start: u16, count: u16) -> Result<u16, Problem> {
    let end = u32::from(start) + u32::from(count) - 1;
    u16::try_from(end).map_err(|_| {
        (
            format!("static ports {start}..{end} run past 65535"),
            format!(
                "lower `start` to at most {} or reduce `count`",
                65536 - u32::from(count)
            ),
        )
    })
}

/// The first pair of static port requests whose ranges overlap: (earlier, later).
pub fn overlapping_static(ports: &[PortRequest]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for (j, b) in ports.iter().enumerate() {
        let Some(bs) = b.start else { continue };
        let be = u32::from(bs) + u32::from(b.count);
        for (i, a) in ports.iter().enumerate().take(j) {
            let Some(as_) = a.start else { continue };
            let ae = u32::from(as_) + u32::from(a.count);
            if u32::from(as_) < be && u32::from(bs) < ae {
                out.push((i, j));
                break;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(check_job_name("resnet-ddp_2").is_ok());
        assert!(check_job_name("").is_err());
        assert!(check_job_name("a b").is_err());
        assert!(check_job_name(&"a".repeat(256)).is_err());
        assert!(check_role_name("worker_1").is_ok());
        assert!(check_role_name("_ps").is_ok());
        assert!(check_role_name("1worker").is_err());
        let (_, fix) = check_role_name("my-worker").unwrap_err();
        assert!(fix.contains("my_worker"), "{fix}");
        assert!(check_role_name(&"a".repeat(65)).is_err());
        assert!(check_port_label("ssh.v2~x-y").is_ok());
        assert!(check_port_label("a:b").is_err());
        assert!(check_host_name("node-01.example").is_ok());
        assert!(check_host_name("node 1").is_err());
    }

    #[test]
    fn ranges() {
        assert_eq!(static_range_end(65535, 1), Ok(65535));
        assert!(static_range_end(65535, 2).is_err());
        let p = |start: Option<u16>, count| PortRequest {
            label: "x".into(),
            count,
            start,
        };
        let ports = [p(Some(100), 10), p(None, 5), p(Some(110), 1), p(Some(105), 1)];
        assert_eq!(overlapping_static(&ports), vec![(0, 3)]);
    }
}
