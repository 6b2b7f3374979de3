//! The rules a job spec (and a cluster file) must satisfy that are not about YAML types:
//! explicit limits, name syntax, GPU masks and static port ranges. Each check returns a
//! message and a fix; the readers in `parse.rs` and `cluster/file.rs` attach the position.

use crate::resources::shares::HundredthsError;
use crate::resources::{check_resource_name, parse_hundredths, parse_mask, CustomResources, GpuMask, WHOLE};

use super::yaml::{clip, join, Diags, Node, Value};
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
    /// `maxRunSec` (job or role): 1..=31 536 000 (365 days).
    pub const MAX_RUN_SEC: i64 = 365 * 24 * 3600;
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

/// Node racks: a path `^/[A-Za-z0-9/._-]{0,254}$` (cluster files and node agents alike).
pub fn check_rack(rack: &str) -> Result<(), Problem> {
    if !rack.starts_with('/') || rack.len() > 255 || !chars_ok(rack, "/._-") {
        return Err((
            format!("invalid rack \"{}\"", clip(rack)),
            "write a rack path starting with `/` of letters, digits, `/`, `.`, `_` or `-`, e.g. `/rack-a`".into(),
        ));
    }
    Ok(())
}

/// A node's GPU type: `^[A-Za-z0-9 ._+()/-]{1,255}$` (e.g. `V100`, `A100-80GB`, `RTX 4090`;
/// what `short_gpu_type` makes of a detected GPU's name).
pub fn check_gpu_type(gpu_type: &str) -> Result<(), Problem> {
    if gpu_type.is_empty() || gpu_type.len() > 255 || !chars_ok(gpu_type, " ._+()/-") {
        return Err((
            format!("invalid GPU type \"{}\"", clip(gpu_type)),
            "use 1 to 255 letters, digits, spaces, `.`, `_`, `+`, `(`, `)`, `/` or `-`, e.g. `A100-80GB`".into(),
        ));
    }
    Ok(())
}

/// Free text a node declares (its containment line; with `lines`, its `nvidia-smi topo
/// -m` topology, which has newlines and tabs): at most `max` bytes, no control character
/// (a terminal escape sequence starts with one; [`crate::text::is_unsafe`], and with
/// `lines` false also `\n` and `\t`) and no bidirectional override.
pub fn check_node_text(text: &str, lines: bool, max: usize) -> Result<(), Problem> {
    let bad = text.chars().find(|&c| {
        crate::text::is_unsafe(c) || crate::text::is_bidi_control(c) || (!lines && (c == '\n' || c == '\t'))
    });
    if let Some(c) = bad {
        return Err((
            format!("holds the control character {}", c.escape_default()),
            "send printable text only (no terminal escape sequences or control characters)".into(),
        ));
    }
    if text.len() > max {
        return Err((
            format!("is {} bytes long", text.len()),
            format!("send at most {max} bytes"),
        ));
    }
    Ok(())
}

/// GPUs per task as written: a whole count, or a share of one GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuQuantity {
    Whole(u32),
    /// Hundredths of one GPU, 1..=99.
    Share(u32),
}

/// `resourcePerInstance.gpu`: a whole number 0..=64, or (when `shares` is allowed) a
/// fraction below 1 in steps of 0.01, read from its decimal text (never through a float).
/// Above 1 GPUs are whole, as in Ray: `1.5` is refused. OpenPAI protocol v2 (`shares`
/// false) keeps GPUs whole.
pub fn read_gpu_quantity(node: &Node, shares: bool) -> Result<GpuQuantity, Problem> {
    let max = limits::MAX_GPUS;
    let whole_fix = format!("write a whole number from 0 to {max}");
    match &node.value {
        Value::Int(i) if (0..=max).contains(i) => Ok(GpuQuantity::Whole(*i as u32)),
        Value::Int(i) if *i < 0 => Err((format!("must not be negative (found {i})"), whole_fix)),
        Value::Int(i) => Err((format!("must be at most {max} (found {i})"), whole_fix)),
        Value::Float(_) => {
            let raw = node.raw.trim();
            if raw.starts_with('-') {
                return Err((format!("must not be negative (found {})", clip(raw)), whole_fix));
            }
            let h = match parse_hundredths(raw) {
                Ok(h) => h,
                Err(HundredthsError::TooFine(_)) => {
                    return Err((
                        format!(
                            "GPU share `{}` is finer than 0.01 (shares go in steps of 0.01)",
                            clip(raw)
                        ),
                        "write a share from 0.01 to 0.99 with at most two decimals, e.g. `gpu: 0.25`".into(),
                    ))
                }
                Err(_) => return Err((format!("`{}` is not a number of GPUs", clip(raw)), whole_fix)),
            };
            if h % WHOLE == 0 && h / WHOLE <= max as u32 {
                return Ok(GpuQuantity::Whole(h / WHOLE));
            }
            if !shares {
                return Err((
                    format!("OpenPAI protocol v2 counts whole GPUs (found {})", clip(raw)),
                    "write a whole number such as `gpu: 1`; GPU shares (`gpu: 0.25`) need gpuam's own job format (no `protocolVersion`)".into(),
                ));
            }
            if h > WHOLE {
                let lo = h / WHOLE;
                return Err((
                    format!(
                        "a fraction above 1 is not a GPU quantity (found {}): above 1, GPUs are whole",
                        clip(raw)
                    ),
                    format!("above 1, GPUs are whole: use {lo} or {}", lo + 1),
                ));
            }
            Ok(GpuQuantity::Share(h))
        }
        Value::Str(s) if parse_hundredths(s).is_ok() => Err((
            format!("must be a number, found the text \"{}\"", clip(s)),
            format!("remove the quotes: {}", s.trim()),
        )),
        _ => Err((
            format!("must be a number of GPUs, found {}", node.describe()),
            if shares {
                format!("write a whole number from 0 to {max}, or a share below 1 such as 0.25")
            } else {
                whole_fix
            },
        )),
    }
}

/// A map of custom resources (`resources: {nvme: 2}`) at `path`: names by
/// [`check_resource_name`], quantities whole numbers from `min` to 2^40, at most 32.
pub fn read_custom_resources(d: &mut Diags, node: &Node, path: &str, min: i64) -> Option<CustomResources> {
    if node.is_null() {
        return Some(CustomResources::new());
    }
    let entries = d.map(node, path, "write custom resources as `resources: {nvme: 1}`")?;
    let mut out = CustomResources::new();
    let mut ok = true;
    if entries.len() > crate::resources::custom::MAX_RESOURCES {
        d.at(
            node.pos,
            path,
            format!(
                "{} custom resources; the limit is {}",
                entries.len(),
                crate::resources::custom::MAX_RESOURCES
            ),
            "keep at most 32 names",
        );
        return None;
    }
    for (k, v) in entries {
        let field = join(path, &k.text);
        if let Err(why) = check_resource_name(&k.text) {
            let fix = if matches!(
                k.text.to_ascii_lowercase().as_str(),
                "gpu" | "gpus" | "cpu" | "memorymb"
            ) {
                format!("give `{}` beside `resources`, not inside it", k.text)
            } else {
                "name it with letters, digits, `_`, `.` or `-`, e.g. `nvme`".to_string()
            };
            d.at(k.pos, &field, why, fix);
            ok = false;
            continue;
        }
        match d.int(v, &field, min, crate::resources::custom::MAX_QUANTITY as i64) {
            Some(q) => out.set(&k.text, q as u64),
            None => ok = false,
        }
    }
    ok.then_some(out)
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
    fn messages_quote_a_spec_value_escaped() {
        let (msg, _) = check_job_name("esc\u{1b}]0;PWNED\u{7}\nstate SUCCEEDED\u{200f}").unwrap_err();
        assert_eq!(
            msg,
            "invalid job name \"esc\\u{1b}]0;PWNED\\u{7}\\nstate SUCCEEDED\\u{200f}\""
        );
        let (msg, _) = check_port_label(&format!("{}\u{1b}[2J", "a".repeat(59))).unwrap_err();
        assert!(msg.ends_with("a\\u{1b}…\""), "{msg}");
        assert!(!msg.contains('\u{1b}'), "{msg}");
    }

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
