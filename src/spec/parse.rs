//! Reads a job spec — gpuam's native format (DESIGN.md §8) or OpenPAI job protocol v2
//! (reference/frameworklauncher.md §7) — into a [`JobSpec`], collecting every problem with
//! its position, dotted field path and fix instead of stopping at the first.
//!
//! The format is chosen by the presence of `protocolVersion` at the top level. Both are
//! mapped to the same [`JobSpec`]; the differences are defaults (v2: gang on, every role's
//! `minSucceededInstances` = `instances`, `gpu` required) and v2's extras: `<% $parameters.x %>`
//! placeholders, deployments' pre/post commands, `extras.gangAllocation`.

use std::path::Path;

use super::openpai::{self, Prereqs, RenderBudget, RenderCtx, Warnings};
use super::validate::{self, limits, GpuQuantity};
use super::yaml::{self, clip, join, Diags, Node, Pos, Value};
use super::{Completion, JobSpec, PaiJob, PortRequest, SpecErrors, SpecFormat, TaskResources, TaskRole};

const NATIVE_TOP: &[&str] = &[
    "name",
    "description",
    "gang",
    "gangTimeoutSec",
    "queue",
    "priority",
    "allowMixedGpuTypes",
    "maxRunSec",
    "taskRoles",
];
const V2_TOP: &[&str] = &[
    "protocolVersion",
    "name",
    "type",
    "version",
    "contributor",
    "description",
    "prerequisites",
    "parameters",
    "secrets",
    "jobRetryCount",
    "deployments",
    "defaults",
    "extras",
    "taskRoles",
];
const TOP_HINTS: &[(&str, &str)] = &[
    ("jobName", "name"),
    ("gangAllocation", "gang"),
    ("roles", "taskRoles"),
    ("tasks", "taskRoles"),
    ("taskRole", "taskRoles"),
    ("timeLimit", "maxRunSec"),
    ("maxRuntime", "maxRunSec"),
    ("maxRunTime", "maxRunSec"),
];
const V2_TOP_HINTS: &[(&str, &str)] = &[
    ("gang", "extras.gangAllocation"),
    ("gangAllocation", "extras.gangAllocation"),
    ("jobName", "name"),
    ("roles", "taskRoles"),
];
const NATIVE_ROLE: &[&str] = &[
    "instances",
    "resourcePerInstance",
    "gpuType",
    "nodeLabel",
    "samePortAllocation",
    "allowMixedGpuTypes",
    "maxRunSec",
    "commands",
    "taskRetryCount",
    "completion",
];
/// v2 role fields, plus gpuam's `gpuType`, `nodeLabel`, `samePortAllocation`,
/// `allowMixedGpuTypes` and `maxRunSec`.
const V2_ROLE: &[&str] = &[
    "instances",
    "completion",
    "taskRetryCount",
    "dockerImage",
    "data",
    "output",
    "script",
    "prerequisites",
    "extraContainerOptions",
    "resourcePerInstance",
    "commands",
    "gpuType",
    "nodeLabel",
    "samePortAllocation",
    "allowMixedGpuTypes",
    "maxRunSec",
];
const ROLE_HINTS: &[(&str, &str)] = &[
    ("taskNumber", "instances"),
    ("replicas", "instances"),
    ("resource", "resourcePerInstance"),
    ("resources", "resourcePerInstance"),
    ("command", "commands"),
    ("cmd", "commands"),
    ("minFailedInstances", "completion.minFailedInstances"),
    ("minSucceededInstances", "completion.minSucceededInstances"),
    ("retryCount", "taskRetryCount"),
    ("gpu", "resourcePerInstance.gpu"),
    ("cpu", "resourcePerInstance.cpu"),
    ("memoryMB", "resourcePerInstance.memoryMB"),
    ("ports", "resourcePerInstance.ports"),
    ("label", "nodeLabel"),
    ("timeLimit", "maxRunSec"),
    ("maxRuntime", "maxRunSec"),
    ("maxRunTime", "maxRunSec"),
    ("timeout", "maxRunSec"),
];
const RESOURCE: &[&str] = &["cpu", "memoryMB", "gpu", "gpuMask", "ports", "resources"];
const RESOURCE_HINTS: &[(&str, &str)] = &[
    ("gpus", "gpu"),
    ("gpuNumber", "gpu"),
    ("cpuNumber", "cpu"),
    ("cpus", "cpu"),
    ("memory", "memoryMB"),
    ("mem", "memoryMB"),
    ("memoryMiB", "memoryMB"),
    ("portDefinitions", "ports"),
    ("gpuAttribute", "gpuMask"),
];
const COMPLETION: &[&str] = &["minFailedInstances", "minSucceededInstances"];
const COMPLETION_HINTS: &[(&str, &str)] = &[
    ("minFailedTaskCount", "minFailedInstances"),
    ("minSucceededTaskCount", "minSucceededInstances"),
];

/// Parses and validates a job spec; `source` names it in errors (a path or `<stdin>`).
///
/// Limits (see [`limits`]): spec text ≤ 1 MiB; ≤ 64 task roles; `instances` 1..=10 000 per
/// role and ≤ 100 000 tasks in all; per task `cpu` 1..=4096, `memoryMB` 1..=16 777 216,
/// `gpu` 0..=64; ≤ 256 port labels and ≤ 1000 ports per task; ≤ 1000 commands per role;
/// `taskRetryCount` -2..=10 000; `gangTimeoutSec` 1..=2 592 000; YAML nesting ≤ 64 levels
/// and alias expansion ≤ 10 000 nodes and 4 MiB of text; v2 commands with their placeholders
/// rendered ≤ 4 MiB for the whole spec ([`openpai::MAX_RENDERED_BYTES`]).
pub fn parse_job_spec(text: &str, source: &str) -> Result<JobSpec, SpecErrors> {
    let mut d = Diags::new(source);
    if text.len() > limits::MAX_SPEC_BYTES {
        d.at(
            Pos::default(),
            "",
            format!(
                "the job spec is {} bytes; the limit is {} (1 MiB)",
                text.len(),
                limits::MAX_SPEC_BYTES
            ),
            "shorten the spec: move long scripts into files and call them from `commands`",
        );
        return d.into_result(None);
    }
    let doc = yaml::parse(text);
    d.extend_yaml(&doc.issues);
    if doc.fatal {
        return d.into_result(None);
    }
    let spec = match &doc.root {
        None => {
            d.at(
                Pos { line: 1, col: 1 },
                "",
                "the job spec is empty",
                "write a job spec; see examples/single-gpu.yaml",
            );
            None
        }
        Some(root) => read_job(&mut d, root),
    };
    d.into_result(spec)
}

/// Reads and parses a job spec file; a read error is reported at line 0.
pub fn load_job_spec(path: &Path) -> Result<JobSpec, SpecErrors> {
    let source = path.display().to_string();
    match read_limited(path, limits::MAX_SPEC_BYTES) {
        Ok(text) => parse_job_spec(&text, &source),
        Err((message, fix)) => {
            let mut d = Diags::new(&source);
            d.at(Pos::default(), "", message, fix);
            d.into_result(None)
        }
    }
}

/// Reads a UTF-8 file of at most `max` bytes (one more is read so that a larger file is
/// reported as too large rather than truncated).
pub fn read_limited(path: &Path, max: usize) -> Result<String, (String, String)> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| {
        (
            format!("cannot read {}: {e}", path.display()),
            "check the path and its permissions".to_string(),
        )
    })?;
    let mut buf = Vec::new();
    file.take(max as u64 + 1).read_to_end(&mut buf).map_err(|e| {
        (
            format!("cannot read {}: {e}", path.display()),
            "check the path and its permissions".to_string(),
        )
    })?;
    if buf.len() > max {
        return Err((
            format!("{} is larger than the limit of {max} bytes", path.display()),
            "shorten the file".to_string(),
        ));
    }
    String::from_utf8(buf).map_err(|e| {
        (
            format!(
                "{} is not UTF-8 text (byte {})",
                path.display(),
                e.utf8_error().valid_up_to()
            ),
            "save the file as UTF-8".to_string(),
        )
    })
}

/// v2-only context for reading roles.
#[derive(Default)]
struct V2<'a> {
    parameters: Option<&'a Node>,
    secrets: Option<&'a Node>,
    prereqs: Prereqs<'a>,
    extras: Option<&'a Node>,
    /// Deployment chosen by `defaults.deployment`: its `taskRoles` mapping.
    deployment: Option<(&'a Node, String)>,
    job_retry_count: u32,
    virtual_cluster: Option<String>,
    gang_allocation: bool,
    /// `extras.maxRunSec` (v2).
    max_run_sec: Option<u64>,
    /// The job's `maxRunSec` (either format): a role without its own takes it.
    job_max_run_sec: Option<u64>,
    warnings: Warnings,
    /// What the spec's rendered commands may still take (all roles together).
    render_budget: RenderBudget,
}

fn read_job(d: &mut Diags, root: &Node) -> Option<JobSpec> {
    if root.as_map().is_none() {
        d.at(
            root.pos,
            "",
            format!("a job spec must be a mapping of fields, found {}", root.describe()),
            "start the file with `name: my-job` and `taskRoles:`; see examples/single-gpu.yaml",
        );
        return None;
    }
    let format = if root.get("protocolVersion").is_some() {
        SpecFormat::PaiV2
    } else {
        SpecFormat::Native
    };
    let v2 = format == SpecFormat::PaiV2;
    if v2 {
        d.unknown_fields(root, "", V2_TOP, V2_TOP_HINTS);
    } else {
        d.unknown_fields(root, "", NATIVE_TOP, TOP_HINTS);
    }

    let name = match root.get("name") {
        None => {
            d.missing(root, "", "name", "add `name: my-job` at the top level");
            None
        }
        Some(n) => d.text(n, "name").and_then(|s| match validate::check_job_name(&s) {
            Ok(()) => Some(s),
            Err((m, f)) => {
                d.at(n.pos, "name", m, f);
                None
            }
        }),
    };
    if let Some(n) = root.get("description") {
        if !n.is_null() {
            d.text(n, "description");
        }
    }

    let mut v2ctx = V2::default();
    let (gang, gang_timeout_sec) = if v2 {
        read_v2_top(d, root, &mut v2ctx)
    } else {
        let gang = root.get("gang").and_then(|n| d.bool(n, "gang")).unwrap_or(false);
        let timeout = read_gang_timeout(d, root.get("gangTimeoutSec"), "gangTimeoutSec");
        if let (Some(_), Some(n)) = (timeout, root.get("gangTimeoutSec")) {
            if !gang {
                d.at(
                    n.pos,
                    "gangTimeoutSec",
                    "`gangTimeoutSec` only applies to gang jobs",
                    "set `gang: true` or remove `gangTimeoutSec`",
                );
            }
        }
        (gang, timeout)
    };

    let (native_queue, priority) = if v2 { (None, 0) } else { read_queue(d, root) };
    let allow_mixed_gpu_types = match root.get("allowMixedGpuTypes") {
        Some(n) if !v2 && !n.is_null() => d.bool(n, "allowMixedGpuTypes").unwrap_or(false),
        _ => false,
    };
    let max_run_sec = if v2 {
        v2ctx.max_run_sec
    } else {
        read_max_run(d, root.get("maxRunSec"), "maxRunSec")
    };
    v2ctx.job_max_run_sec = max_run_sec;
    let roles = read_roles(d, root, format, &v2ctx);
    let pai = v2.then(|| PaiJob {
        job_retry_count: v2ctx.job_retry_count,
        virtual_cluster: v2ctx.virtual_cluster.clone().unwrap_or_else(|| "default".into()),
        gang_allocation: v2ctx.gang_allocation,
    });
    Some(JobSpec {
        name: name?,
        gang,
        gang_timeout_sec,
        format,
        task_roles: roles?,
        queue: v2ctx.virtual_cluster.clone().or(native_queue),
        priority,
        allow_mixed_gpu_types,
        max_run_sec,
        pai,
        warnings: v2ctx.warnings.into_sorted(),
    })
}

/// `queue` and `priority` of gpuam's own format (DESIGN.md §10).
fn read_queue(d: &mut Diags, root: &Node) -> (Option<String>, i32) {
    let queue = root.get("queue").filter(|n| !n.is_null()).and_then(|n| {
        let q = d.text(n, "queue")?;
        match validate::check_queue_name(&q) {
            Ok(()) => Some(q),
            Err((m, f)) => {
                d.at(n.pos, "queue", m, f);
                None
            }
        }
    });
    let priority = root
        .get("priority")
        .filter(|n| !n.is_null())
        .and_then(|n| d.int(n, "priority", -limits::MAX_PRIORITY, limits::MAX_PRIORITY))
        .map_or(0, |p| p as i32);
    (queue, priority)
}

/// A `maxRunSec` (job, role or v2 `extras`): whole seconds, 1..=[`limits::MAX_RUN_SEC`].
fn read_max_run(d: &mut Diags, node: Option<&Node>, path: &str) -> Option<u64> {
    let n = node?;
    if n.is_null() {
        return None;
    }
    d.int(n, path, 1, limits::MAX_RUN_SEC).map(|v| v as u64)
}

fn read_gang_timeout(d: &mut Diags, node: Option<&Node>, path: &str) -> Option<u64> {
    let n = node?;
    if n.is_null() {
        return None;
    }
    d.int(n, path, 1, limits::MAX_GANG_TIMEOUT_SEC).map(|v| v as u64)
}

/// Reads the v2 top-level fields; returns (gang, gang timeout).
fn read_v2_top<'a>(d: &mut Diags, root: &'a Node, ctx: &mut V2<'a>) -> (bool, Option<u64>) {
    if let Some(n) = root.get("protocolVersion") {
        let ok = matches!(&n.value, Value::Int(2)) || matches!(&n.value, Value::Str(s) if s.trim() == "2");
        if !ok {
            d.at(
                n.pos,
                "protocolVersion",
                format!(
                    "unknown protocolVersion {}; gpuam reads OpenPAI protocol version 2",
                    n.describe()
                ),
                "write `protocolVersion: 2`, or remove it to use gpuam's native format",
            );
        }
    }
    match root.get("type") {
        None => d.missing(root, "", "type", "add `type: job` (protocol v2 requires it)"),
        Some(n) => {
            if let Some(t) = d.text(n, "type") {
                if t != "job" {
                    d.at(
                        n.pos,
                        "type",
                        format!("unsupported type \"{}\"; only `job` can be run", clip(&t)),
                        "write `type: job`",
                    );
                }
            }
        }
    }
    for f in ["version", "contributor"] {
        if let Some(n) = root.get(f) {
            if !n.is_null() {
                d.text(n, f);
            }
        }
    }
    if let Some(n) = root.get("jobRetryCount") {
        if !n.is_null() {
            // OpenPAI's schema: an integer ≥ 0.
            ctx.job_retry_count = d.int(n, "jobRetryCount", 0, limits::MAX_RETRY).unwrap_or(0) as u32;
        }
    }
    if let Some(n) = root.get("prerequisites") {
        ctx.prereqs = openpai::read_prerequisites(d, n, &ctx.warnings);
    }
    if let Some(n) = root.get("parameters") {
        if !n.is_null()
            && d.map(n, "parameters", "write parameters as `name: value` pairs")
                .is_some()
            && few_entries(d, n, "parameters")
        {
            ctx.parameters = Some(n);
        }
    }
    if let Some(n) = root.get("secrets") {
        if !n.is_null()
            && d.map(n, "secrets", "write secrets as `name: value` pairs").is_some()
            && few_entries(d, n, "secrets")
        {
            ctx.secrets = Some(n);
        }
    }
    let mut deployment_name = None;
    if let Some(n) = root.get("defaults") {
        if !n.is_null()
            && d.map(n, "defaults", "write `defaults: {virtualCluster: default}`")
                .is_some()
        {
            d.unknown_fields(n, "defaults", &["virtualCluster", "deployment"], &[]);
            if let Some(v) = n.get("virtualCluster") {
                ctx.virtual_cluster = d.text(v, "defaults.virtualCluster");
            }
            if let Some(v) = n.get("deployment") {
                deployment_name = d.text(v, "defaults.deployment").map(|s| (s, v.pos));
            }
        }
    }
    let deployments = root.get("deployments");
    if let Some(n) = deployments {
        if !n.is_null() {
            if let Some(items) = d.seq(n, "deployments", "write a list of `{name, taskRoles}` entries") {
                for (i, item) in items.iter().enumerate() {
                    let p = format!("deployments[{i}]");
                    if d.map(item, &p, "write `{name: NAME, taskRoles: {...}}`").is_none() {
                        continue;
                    }
                    // OpenPAI's schema does not close deployment items: `version` and the
                    // like are accepted; gpuam has no use for them.
                    for (k, _) in item.as_map().unwrap_or_default() {
                        if k.text != "name" && k.text != "taskRoles" {
                            ctx.warnings.add(
                                k.pos,
                                &join(&p, &k.text),
                                format!("`{}` of a deployment is accepted and ignored", clip(&k.text)),
                            );
                        }
                    }
                    match item.get("name") {
                        None => d.missing(item, &p, "name", "give the deployment a `name`"),
                        Some(nm) => {
                            let name = d.text(nm, &join(&p, "name"));
                            if let (Some(name), Some((want, _))) = (name, &deployment_name) {
                                if &name == want {
                                    if let Some(tr) = item.get("taskRoles") {
                                        ctx.deployment = Some((tr, join(&p, "taskRoles")));
                                    }
                                }
                            }
                        }
                    }
                    if let Some(tr) = item.get("taskRoles") {
                        d.map(
                            tr,
                            &join(&p, "taskRoles"),
                            "map role names to `{preCommands, postCommands}`",
                        );
                    }
                }
            }
        }
    }
    if let Some((want, pos)) = &deployment_name {
        let found = deployments
            .and_then(Node::as_seq)
            .is_some_and(|items| items.iter().any(|i| i.get("name").is_some_and(|n| &n.raw == want)));
        if !found {
            d.at(
                *pos,
                "defaults.deployment",
                format!("deployment \"{}\" is not defined under `deployments`", clip(want)),
                "name a deployment listed under `deployments`, or remove `defaults.deployment`",
            );
        }
    }
    let mut gang = true;
    let mut timeout = None;
    if let Some(n) = root.get("extras") {
        if !n.is_null() && d.map(n, "extras", "write extras as `name: value` pairs").is_some() {
            if let Some(g) = n.get("gangAllocation") {
                gang = d.bool(g, "extras.gangAllocation").unwrap_or(true);
            }
            timeout = read_gang_timeout(d, n.get("gangTimeoutSec"), "extras.gangTimeoutSec");
            ctx.max_run_sec = read_max_run(d, n.get("maxRunSec"), "extras.maxRunSec");
            openpai::warn_extras(n, &ctx.warnings);
            ctx.extras = Some(n);
        }
    }
    ctx.gang_allocation = gang;
    (gang, timeout)
}

fn read_roles(d: &mut Diags, root: &Node, format: SpecFormat, v2: &V2<'_>) -> Option<Vec<TaskRole>> {
    let Some(tr) = root.get("taskRoles") else {
        d.missing(
            root,
            "",
            "taskRoles",
            "add `taskRoles:` with at least one role; see examples/single-gpu.yaml",
        );
        return None;
    };
    let entries = d.map(
        tr,
        "taskRoles",
        "write `taskRoles:` as a mapping from role name to role, e.g. `worker: {...}`",
    )?;
    if entries.is_empty() {
        d.at(
            tr.pos,
            "taskRoles",
            "`taskRoles` is empty",
            "add at least one task role, e.g. `worker:`",
        );
        return None;
    }
    if entries.len() > limits::MAX_TASK_ROLES {
        d.at(
            tr.pos,
            "taskRoles",
            format!("{} task roles; the limit is {}", entries.len(), limits::MAX_TASK_ROLES),
            "merge roles that run the same command",
        );
        return None;
    }
    let mut roles = Vec::new();
    let mut ok = true;
    for (key, node) in entries {
        let path = join("taskRoles", &key.text);
        if let Err((m, f)) = validate::check_role_name(&key.text) {
            d.at(key.pos, &path, m, f);
            ok = false;
        }
        match read_role(d, &key.text, node, &path, format, v2) {
            Some(r) => roles.push(r),
            None => ok = false,
        }
    }
    let total: u64 = roles.iter().map(|r| u64::from(r.instances)).sum();
    if total > limits::MAX_TOTAL_TASKS {
        d.at(
            tr.pos,
            "taskRoles",
            format!("the job has {total} tasks; the limit is {}", limits::MAX_TOTAL_TASKS),
            "reduce `instances`",
        );
        ok = false;
    }
    ok.then_some(roles)
}

fn read_role(d: &mut Diags, name: &str, node: &Node, path: &str, format: SpecFormat, v2: &V2<'_>) -> Option<TaskRole> {
    let is_v2 = format == SpecFormat::PaiV2;
    d.map(
        node,
        path,
        "write the role as a mapping with `instances`, `resourcePerInstance` and `commands`",
    )?;
    d.unknown_fields(node, path, if is_v2 { V2_ROLE } else { NATIVE_ROLE }, ROLE_HINTS);
    let mut ok = true;

    let instances = match node.get("instances") {
        None => Some(1),
        Some(n) => d
            .int(n, &join(path, "instances"), 1, limits::MAX_INSTANCES)
            .map(|v| v as u32),
    };
    ok &= instances.is_some();

    let resources = match node.get("resourcePerInstance") {
        None => {
            d.missing(
                node,
                path,
                "resourcePerInstance",
                "add `resourcePerInstance: {cpu: 4, memoryMB: 8192, gpu: 1}`",
            );
            None
        }
        Some(n) => read_resources(d, n, &join(path, "resourcePerInstance"), is_v2),
    };

    let gpu_types = match node.get("gpuType") {
        // v2: hivedScheduler's skuType names the GPU type.
        None => openpai::hived_gpu_type(v2.extras, name).into_iter().collect(),
        Some(n) => match read_gpu_types(d, n, &join(path, "gpuType")) {
            Some(v) => v,
            None => {
                ok = false;
                Vec::new()
            }
        },
    };
    let node_label = match node.get("nodeLabel") {
        None => None,
        Some(n) if n.is_null() => None,
        Some(n) => {
            let p = join(path, "nodeLabel");
            match d.text(n, &p) {
                Some(s) if s.trim().is_empty() => {
                    d.at(
                        n.pos,
                        &p,
                        "`nodeLabel` is empty",
                        "write a label such as `gpu`, or remove the field",
                    );
                    ok = false;
                    None
                }
                Some(s) => Some(s.trim().to_string()),
                None => {
                    ok = false;
                    None
                }
            }
        }
    };
    let same_port_allocation = match node.get("samePortAllocation") {
        None => false,
        Some(n) => match d.bool(n, &join(path, "samePortAllocation")) {
            Some(b) => b,
            None => {
                ok = false;
                false
            }
        },
    };
    let allow_mixed_gpu_types = match node.get("allowMixedGpuTypes") {
        None => false,
        Some(n) if n.is_null() => false,
        Some(n) => match d.bool(n, &join(path, "allowMixedGpuTypes")) {
            Some(b) => b,
            None => {
                ok = false;
                false
            }
        },
    };
    // The role's own limit overrides the job's.
    let max_run_sec = match node.get("maxRunSec") {
        Some(n) if !n.is_null() => match read_max_run(d, Some(n), &join(path, "maxRunSec")) {
            Some(v) => Some(v),
            None => {
                ok = false;
                None
            }
        },
        _ => v2.job_max_run_sec,
    };
    let commands = read_commands(d, node, name, path, v2, is_v2);
    ok &= commands.is_some();

    let task_retry_count = match node.get("taskRetryCount") {
        None => 0,
        Some(n) if n.is_null() => 0,
        Some(n) => match d.int(n, &join(path, "taskRetryCount"), -2, limits::MAX_RETRY) {
            Some(v) => v as i32,
            None => {
                ok = false;
                0
            }
        },
    };
    let completion = read_completion(d, node, path, instances, is_v2);
    ok &= completion.is_some();

    let (mut image, mut shm_mb) = (None, None);
    let mut resources = resources?;
    let mut task_retry_count = task_retry_count;
    if is_v2 {
        let (refs_ok, uri) = openpai::check_references(d, node, path, &v2.prereqs);
        ok &= refs_ok;
        image = uri;
        match openpai::read_container_options(d, node, path, &v2.warnings) {
            Some(s) => shm_mb = s,
            None => ok = false,
        }
        let ports_node = node.get("resourcePerInstance").and_then(|r| r.get("ports"));
        for p in &resources.ports {
            let pos = ports_node
                .and_then(|n| n.entry(&p.label))
                .map_or(node.pos, |(k, _)| k.pos);
            let fp = join(path, &format!("resourcePerInstance.ports.{}", p.label));
            ok &= openpai::check_pai_name(d, pos, &fp, &p.label, "port label");
        }
        // OpenPAI gives every role an `ssh` and an `http` port.
        for label in ["ssh", "http"] {
            if !resources.ports.iter().any(|p| p.label == label) {
                resources.ports.push(PortRequest {
                    label: label.into(),
                    count: 1,
                    start: None,
                });
            }
        }
        // taskRetryCount counts only without gang allocation; with it, the job is retried.
        if v2.gang_allocation && task_retry_count != 0 {
            if let Some((k, _)) = node.entry("taskRetryCount") {
                v2.warnings.add(
                    k.pos,
                    &join(path, "taskRetryCount"),
                    "`taskRetryCount` is ignored under gang allocation, as on OpenPAI; `jobRetryCount` restarts the whole job",
                );
            }
            task_retry_count = 0;
        }
    }
    if !ok {
        return None;
    }
    Some(TaskRole {
        name: name.to_string(),
        instances: instances?,
        resources,
        gpu_types,
        node_label,
        same_port_allocation,
        allow_mixed_gpu_types,
        max_run_sec,
        commands: commands?,
        task_retry_count,
        completion: completion?,
        image,
        shm_mb,
    })
}

fn read_gpu_types(d: &mut Diags, n: &Node, path: &str) -> Option<Vec<String>> {
    let fix = "write a comma list of GPU types, e.g. `gpuType: V100,A100`";
    let items: Vec<(String, Pos)> = match &n.value {
        Value::Null => return Some(Vec::new()),
        Value::Seq(items) => {
            let mut out = Vec::new();
            for (i, it) in items.iter().enumerate() {
                out.push((d.text(it, &format!("{path}[{i}]"))?, it.pos));
            }
            out
        }
        _ => vec![(d.text(n, path)?, n.pos)],
    };
    let mut out = Vec::new();
    for (text, pos) in items {
        for part in text.split(',') {
            let t = part.trim();
            if t.is_empty() {
                d.at(pos, path, format!("empty GPU type in \"{}\"", clip(&text)), fix);
                return None;
            }
            out.push(t.to_string());
        }
    }
    Some(out)
}

fn read_resources(d: &mut Diags, n: &Node, path: &str, is_v2: bool) -> Option<TaskResources> {
    d.map(n, path, "write `resourcePerInstance: {cpu: 4, memoryMB: 8192, gpu: 1}`")?;
    d.unknown_fields(n, path, RESOURCE, RESOURCE_HINTS);
    let mut ok = true;
    let cpu = match n.get("cpu") {
        None => {
            d.missing(n, path, "cpu", "add `cpu: 1` (CPU cores per task)");
            None
        }
        Some(v) => d.int(v, &join(path, "cpu"), 1, limits::MAX_TASK_CPU).map(|x| x as u32),
    };
    let memory_mb = match n.get("memoryMB") {
        None => {
            d.missing(n, path, "memoryMB", "add `memoryMB: 4096` (memory per task in MB)");
            None
        }
        Some(v) => d
            .int(v, &join(path, "memoryMB"), 1, limits::MAX_TASK_MEMORY_MB)
            .map(|x| x as u64),
    };
    let mask = match n.get("gpuMask") {
        None => None,
        Some(v) if v.is_null() => None,
        Some(v) => match validate::read_mask(v) {
            Ok(m) => Some((m, v)),
            Err((msg, fix)) => {
                d.at(v.pos, &join(path, "gpuMask"), msg, fix);
                ok = false;
                None
            }
        },
    };
    let gpus = match n.get("gpu") {
        None if is_v2 => {
            d.missing(
                n,
                path,
                "gpu",
                "add `gpu: 0` or the number of GPUs per task (protocol v2 requires it)",
            );
            None
        }
        // Native: gpu defaults to the mask's popcount, else 0.
        None => Some(GpuQuantity::Whole(mask.map_or(0, |(m, _)| m.count_ones()))),
        Some(v) => match validate::read_gpu_quantity(v, !is_v2) {
            Ok(q) => Some(q),
            Err((msg, fix)) => {
                d.at(v.pos, &join(path, "gpu"), msg, fix);
                None
            }
        },
    };
    let (gpus, gpu_share) = match gpus {
        Some(GpuQuantity::Whole(g)) => (Some(g), None),
        Some(GpuQuantity::Share(h)) => (Some(1), Some(h)),
        None => (None, None),
    };
    if let (Some(g), Some((m, v))) = (gpus, mask) {
        if gpu_share.is_some() && m.count_ones() != 1 {
            d.at(
                v.pos,
                &join(path, "gpuMask"),
                format!(
                    "a GPU share goes on one GPU, but gpuMask {} selects {}",
                    crate::resources::mask_hex(m),
                    m.count_ones()
                ),
                "give a mask with one bit (e.g. \"0x2\" for GPU 1), or remove gpuMask",
            );
            ok = false;
        } else if m.count_ones() != g {
            d.at(
                v.pos,
                &join(path, "gpuMask"),
                format!(
                    "gpuMask {} selects {} GPU(s) but `gpu` is {g}",
                    crate::resources::mask_hex(m),
                    m.count_ones()
                ),
                format!(
                    "make `gpu` equal the number of bits set in the mask ({}), or fix the mask",
                    m.count_ones()
                ),
            );
            ok = false;
        }
    }
    let ports = match n.get("ports") {
        None => Some(Vec::new()),
        Some(v) if v.is_null() => Some(Vec::new()),
        Some(v) => read_ports(d, v, &join(path, "ports")),
    };
    let custom = match n.get("resources") {
        None => Some(Default::default()),
        Some(v) if is_v2 => {
            d.at(
                v.pos,
                &join(path, "resources"),
                "custom resources are not part of OpenPAI protocol v2",
                "write the job in gpuam's own format (no `protocolVersion`) to ask for `resources: {nvme: 1}`",
            );
            None
        }
        Some(v) => validate::read_custom_resources(d, v, &join(path, "resources"), 1),
    };
    if !ok {
        return None;
    }
    Some(TaskResources {
        cpu: cpu?,
        memory_mb: memory_mb?,
        gpus: gpus?,
        gpu_share,
        gpu_mask: mask.map(|(m, _)| m).filter(|m| *m != 0),
        ports: ports?,
        custom: custom?,
    })
}

fn read_ports(d: &mut Diags, n: &Node, path: &str) -> Option<Vec<PortRequest>> {
    let entries = d.map(
        n,
        path,
        "write ports as `label: count` (dynamic) or `label: {start: 9000, count: 2}` (static)",
    )?;
    if entries.len() > limits::MAX_PORT_LABELS {
        d.at(
            n.pos,
            path,
            format!(
                "{} port labels; the limit is {}",
                entries.len(),
                limits::MAX_PORT_LABELS
            ),
            "use fewer labels with larger counts",
        );
        return None;
    }
    let mut ok = true;
    let mut out: Vec<PortRequest> = Vec::new();
    let mut nodes: Vec<&Node> = Vec::new();
    for (key, v) in entries {
        let p = join(path, &key.text);
        if let Err((m, f)) = validate::check_port_label(&key.text) {
            d.at(key.pos, &p, m, f);
            ok = false;
        }
        let count_range = |d: &mut Diags, c: &Node, cp: &str| -> Option<u16> {
            if matches!(c.value, Value::Int(0)) {
                d.at(
                    c.pos,
                    cp,
                    "a port count must be at least 1",
                    "request 1 or more ports, or remove the label",
                );
                return None;
            }
            d.int(c, cp, 1, limits::MAX_PORTS_PER_TASK).map(|x| x as u16)
        };
        let req = match &v.value {
            Value::Map(_) => {
                d.unknown_fields(v, &p, &["start", "count"], &[("port", "start"), ("number", "count")]);
                let count = match v.get("count") {
                    None => {
                        d.missing(v, &p, "count", "add `count: 1`");
                        None
                    }
                    Some(c) => count_range(d, c, &join(&p, "count")),
                };
                let start = match v.get("start") {
                    None => Some(0),
                    Some(s) => d.int(s, &join(&p, "start"), 0, 65535).map(|x| x as u16),
                };
                match (start, count) {
                    (Some(0), Some(c)) => Some(PortRequest {
                        label: key.text.clone(),
                        count: c,
                        start: None,
                    }),
                    (Some(s), Some(c)) => match validate::static_range_end(s, c) {
                        Ok(_) => Some(PortRequest {
                            label: key.text.clone(),
                            count: c,
                            start: Some(s),
                        }),
                        Err((m, f)) => {
                            d.at(v.pos, &p, m, f);
                            None
                        }
                    },
                    _ => None,
                }
            }
            _ => count_range(d, v, &p).map(|c| PortRequest {
                label: key.text.clone(),
                count: c,
                start: None,
            }),
        };
        match req {
            Some(r) => {
                out.push(r);
                nodes.push(v);
            }
            None => ok = false,
        }
    }
    for (i, j) in validate::overlapping_static(&out) {
        let (a, b) = (&out[i], &out[j]);
        d.at(
            nodes[j].pos,
            &join(path, &b.label),
            format!("static ports of `{}` overlap those of `{}`", b.label, a.label),
            "give each label its own range of ports",
        );
        ok = false;
    }
    let total: i64 = out.iter().map(|p| i64::from(p.count)).sum();
    if total > limits::MAX_PORTS_PER_TASK {
        d.at(
            n.pos,
            path,
            format!("{total} ports per task; the limit is {}", limits::MAX_PORTS_PER_TASK),
            "request fewer ports",
        );
        ok = false;
    }
    ok.then_some(out)
}

fn read_command_list(
    d: &mut Diags,
    n: &Node,
    path: &str,
    v2: (&V2<'_>, &RenderCtx<'_>),
    is_v2: bool,
    out: &mut Vec<String>,
) -> bool {
    let Some(items) = d.seq(
        n,
        path,
        "write commands as a list, e.g. `commands: [\"python train.py\"]`",
    ) else {
        return false;
    };
    let mut ok = true;
    for (i, it) in items.iter().enumerate() {
        let p = format!("{path}[{i}]");
        let text = match &it.value {
            Value::Null => None,
            _ => d.text(it, &p),
        };
        match text {
            Some(t) if is_v2 || !t.trim().is_empty() => {
                let t = if is_v2 {
                    openpai::render(d, &v2.0.warnings, &t, it, &p, v2.1)
                } else {
                    Some(t)
                };
                match t {
                    Some(t) => out.push(t),
                    None => ok = false,
                }
            }
            Some(_) | None if matches!(it.value, Value::Null | Value::Str(_)) => {
                d.at(it.pos, &p, "empty command", "write a command, or remove the entry");
                ok = false;
            }
            _ => ok = false,
        }
    }
    ok
}

fn read_commands(d: &mut Diags, node: &Node, role: &str, path: &str, v2: &V2<'_>, is_v2: bool) -> Option<Vec<String>> {
    let p = join(path, "commands");
    let Some(n) = node.get("commands") else {
        d.missing(node, path, "commands", "add `commands: [\"echo hello\"]`");
        return None;
    };
    let mut out = Vec::new();
    let mut ok = true;
    let prereq = |kind: &str| {
        PREREQ_FIELD
            .iter()
            .find(|(k, _)| *k == kind)
            .and_then(|(_, field)| node.get(field))
            .and_then(|v| match &v.value {
                Value::Str(s) => v2.prereqs.get(kind, s),
                _ => None,
            })
    };
    let ctx = RenderCtx {
        parameters: v2.parameters,
        secrets: v2.secrets,
        data: prereq("data"),
        script: prereq("script"),
        output: prereq("output"),
        budget: &v2.render_budget,
    };
    let v2 = (v2, &ctx);
    // Deployment pre/post commands (v2) wrap the role's own.
    let dep =
        v2.0.deployment
            .as_ref()
            .and_then(|(tr, tp)| tr.get(role).map(|r| (r, join(tp, role))));
    if let Some((r, rp)) = &dep {
        if d.map(r, rp, "write `{preCommands: [...], postCommands: [...]}`")
            .is_some()
        {
            d.unknown_fields(r, rp, &["preCommands", "postCommands"], &[]);
            if let Some(pre) = r.get("preCommands") {
                ok &= read_command_list(d, pre, &join(rp, "preCommands"), v2, is_v2, &mut out);
            }
        }
    }
    let before = out.len();
    ok &= read_command_list(d, n, &p, v2, is_v2, &mut out);
    if ok && out.len() == before && n.as_seq().is_some_and(|s| s.is_empty()) {
        d.at(
            n.pos,
            &p,
            "`commands` is empty",
            "add at least one command, e.g. `- echo hello`",
        );
        ok = false;
    }
    if let Some((r, rp)) = &dep {
        if let Some(post) = r.get("postCommands") {
            ok &= read_command_list(d, post, &join(rp, "postCommands"), v2, is_v2, &mut out);
        }
    }
    if out.len() > limits::MAX_COMMANDS {
        d.at(
            n.pos,
            &p,
            format!("{} commands; the limit is {}", out.len(), limits::MAX_COMMANDS),
            "move the commands into a script and run it",
        );
        ok = false;
    }
    if is_v2 {
        // OpenPAI runs a role's commands as one newline-joined bash script.
        out = vec![openpai::join_commands(&out)];
    }
    ok.then_some(out)
}

const PREREQ_FIELD: &[(&str, &str)] = openpai::PREREQ_TYPES;

fn read_completion(d: &mut Diags, node: &Node, path: &str, instances: Option<u32>, is_v2: bool) -> Option<Completion> {
    let default_succeeded = if is_v2 { instances } else { None };
    let Some(n) = node.get("completion") else {
        return Some(Completion {
            min_failed_instances: Some(1),
            min_succeeded_instances: default_succeeded,
        });
    };
    let p = join(path, "completion");
    if n.is_null() {
        return Some(Completion {
            min_failed_instances: Some(1),
            min_succeeded_instances: default_succeeded,
        });
    }
    d.map(
        n,
        &p,
        "write `completion: {minFailedInstances: 1, minSucceededInstances: null}`",
    )?;
    d.unknown_fields(n, &p, COMPLETION, COMPLETION_HINTS);
    let mut read = |key: &str, default: Option<u32>| -> Result<Option<u32>, ()> {
        let Some(v) = n.get(key) else {
            return Ok(default);
        };
        let fp = join(&p, key);
        match &v.value {
            Value::Null | Value::Int(-1) => Ok(None),
            Value::Int(0) => {
                d.at(
                    v.pos,
                    &fp,
                    format!("`{key}` must be at least 1"),
                    "write a count from 1 to `instances`, or null (or -1) for \"never\"",
                );
                Err(())
            }
            Value::Int(x) if *x > 0 && instances.is_some_and(|i| *x > i64::from(i)) => {
                let i = instances.unwrap_or(0);
                d.at(
                    v.pos,
                    &fp,
                    format!("`{key}` is {x} but the role has only {i} instance(s)"),
                    format!("write a count from 1 to {i}, or null for \"never\""),
                );
                Err(())
            }
            _ => match d.int(v, &fp, 1, limits::MAX_INSTANCES) {
                Some(x) => Ok(Some(x as u32)),
                None => Err(()),
            },
        }
    };
    let failed = read("minFailedInstances", Some(1));
    let succeeded = read("minSucceededInstances", default_succeeded);
    Some(Completion {
        min_failed_instances: failed.ok()?,
        min_succeeded_instances: succeeded.ok()?,
    })
}

/// At most this many `parameters` (or `secrets`) entries: each placeholder looks its name up
/// among them, so a spec of tens of thousands of both held a spec check for seconds
/// (eleventh audit pass, review). Real jobs name a handful.
pub const MAX_PARAMETERS: usize = 1_000;

/// Whether the mapping `n` at `field` has at most [`MAX_PARAMETERS`] entries (an error
/// naming it otherwise).
fn few_entries(d: &mut Diags, n: &Node, field: &str) -> bool {
    let count = n.as_map().map_or(0, |m| m.len());
    if count <= MAX_PARAMETERS {
        return true;
    }
    d.at(
        n.pos,
        field,
        format!("{count} entries, more than the {MAX_PARAMETERS} a job spec may have"),
        "keep large or many values in a file the command reads (a `data` prerequisite) instead",
    );
    false
}
