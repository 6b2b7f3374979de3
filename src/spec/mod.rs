//! Job specs: YAML task roles (DESIGN.md §8) and OpenPAI job protocol v2 files.
//!
//! The types of a validated job live here; `parse` reads both formats, `validate` holds
//! the limits and name rules, `yaml` is the located-YAML layer shared with the cluster file.

pub mod openpai;
pub mod parse;
pub mod syntax;
pub mod validate;
pub mod yaml;

pub use parse::{load_job_spec, parse_job_spec};
pub use validate::limits;

use std::fmt;

use crate::resources::{CustomResources, GpuMask, PortSet, Resources};

/// A validated job. `Default` exists for building test values, not as a valid job.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobSpec {
    pub name: String,
    /// All tasks must hold a container before any starts.
    pub gang: bool,
    /// How long a gang job may wait for all its containers (`gangTimeoutSec`); `None` = no limit.
    pub gang_timeout_sec: Option<u64>,
    /// Which format the spec was written in.
    pub format: SpecFormat,
    /// Task roles in file order.
    pub task_roles: Vec<TaskRole>,
    /// The queue the job asks for (DESIGN.md §10); OpenPAI v2: `defaults.virtualCluster`.
    pub queue: Option<String>,
    /// Its priority within its queue (`priority`; higher first, default 0).
    pub priority: i32,
    /// `allowMixedGpuTypes` (issue 27): its untyped GPU tasks may span GPU types. Off by
    /// default: a gang (else each role) that names no `gpuType` gets GPUs of one type.
    pub allow_mixed_gpu_types: bool,
    /// `maxRunSec` at the job level (issue 27): each task's run-time limit in seconds,
    /// unless its role declares its own ([`TaskRole::max_run_sec`] holds the one that
    /// applies). OpenPAI v2: `extras.maxRunSec`.
    pub max_run_sec: Option<u64>,
    /// OpenPAI v2 job-level settings (`None` for gpuam's own format).
    pub pai: Option<PaiJob>,
    /// Fields accepted but not honoured (or honoured differently), with their positions;
    /// `validate`, `plan` and `run` print them.
    pub warnings: Vec<SpecWarning>,
}

/// What an OpenPAI protocol v2 job carries beyond the task roles.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PaiJob {
    /// `jobRetryCount`: how many times the whole job is restarted after it failed.
    pub job_retry_count: u32,
    /// `defaults.virtualCluster` (`default` when absent), as `PAI_VIRTUAL_CLUSTER`.
    pub virtual_cluster: String,
    /// `extras.gangAllocation` as written (default true): `taskRetryCount` applies only
    /// when it is false, as on OpenPAI.
    pub gang_allocation: bool,
}

/// A field that is accepted but not honoured, located in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecWarning {
    pub line: usize,
    pub col: usize,
    /// Dotted field path.
    pub field: String,
    pub message: String,
}

impl fmt::Display for SpecWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}: {}: warning: {}",
            self.line, self.col, self.field, self.message
        )
    }
}

/// The format a job spec was written in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SpecFormat {
    /// gpuam's own format (DESIGN.md §8).
    #[default]
    Native,
    /// OpenPAI job protocol v2 (`protocolVersion: 2`).
    PaiV2,
}

/// One task role: `instances` identical tasks.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TaskRole {
    pub name: String,
    pub instances: u32,
    pub resources: TaskResources,
    /// Acceptable GPU types (the spec's comma list); empty = any.
    pub gpu_types: Vec<String>,
    pub node_label: Option<String>,
    pub same_port_allocation: bool,
    /// `allowMixedGpuTypes` on the role: its tasks may span GPU types (see
    /// [`JobSpec::allow_mixed_gpu_types`]).
    pub allow_mixed_gpu_types: bool,
    /// The run-time limit of each of its tasks in seconds (the role's `maxRunSec`, else
    /// the job's): the RM ends a task's container past it (issue 27). `None`: no limit.
    pub max_run_sec: Option<u64>,
    pub commands: Vec<String>,
    /// frameworklauncher semantics: n ≥ 0 retries; -1 = unlimited for failures; -2 = always.
    pub task_retry_count: i32,
    pub completion: Completion,
    /// The image the role's tasks run in (OpenPAI `dockerImage` → its prerequisite's `uri`).
    pub image: Option<String>,
    /// Size of `/dev/shm` in the image, MB (OpenPAI `extraContainerOptions.shmMB`).
    pub shm_mb: Option<u32>,
}

/// Per-instance resources of a role.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TaskResources {
    pub cpu: u32,
    pub memory_mb: u64,
    /// GPUs per task: the whole-GPU count, or 1 for a fractional task.
    pub gpus: u32,
    /// A fractional task's share of its one GPU in hundredths, 1..=99 (`gpu: 0.25` → 25);
    /// `None` = whole GPUs.
    pub gpu_share: Option<u32>,
    /// Explicit GPU mask (`resourcePerInstance.gpuMask`); popcount == gpus.
    pub gpu_mask: Option<GpuMask>,
    /// Port requests in file order.
    pub ports: Vec<PortRequest>,
    /// Custom resources per task (`resourcePerInstance.resources: {nvme: 1}`).
    pub custom: CustomResources,
}

/// A labelled port request: `label: count` (dynamic) or `label: {start, count}` (static).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortRequest {
    pub label: String,
    pub count: u16,
    /// First port of a static range; `None` = dynamic.
    pub start: Option<u16>,
}

/// Per-role completion policy (reference/frameworklauncher.md §5.3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The job fails once this many tasks of the role failed for good; `None` = never.
    pub min_failed_instances: Option<u32>,
    /// The job succeeds once this many tasks of the role succeeded; `None` = only when all tasks end.
    pub min_succeeded_instances: Option<u32>,
}

impl Default for Completion {
    fn default() -> Self {
        Completion {
            min_failed_instances: Some(1),
            min_succeeded_instances: None,
        }
    }
}

impl TaskResources {
    /// The static ports of the role.
    pub fn static_ports(&self) -> PortSet {
        PortSet::from_ranges(self.ports.iter().filter_map(|p| {
            p.start
                .map(|s| crate::resources::PortRange::new(s, s.saturating_add(p.count.saturating_sub(1))))
        }))
    }

    /// How many dynamic ports the role needs.
    pub fn dynamic_port_count(&self) -> u32 {
        self.ports
            .iter()
            .filter(|p| p.start.is_none())
            .map(|p| u32::from(p.count))
            .sum()
    }

    /// The request as a resource amount: static ports and explicit mask included,
    /// dynamic ports not yet chosen. A fractional task's share sits on its explicit GPU,
    /// or on [`ANY_GPU`] while its GPU is not chosen.
    pub fn as_request(&self) -> Resources {
        self.request_with_ports(self.static_ports())
    }

    /// [`TaskResources::as_request`] with these concrete ports.
    pub fn request_with_ports(&self, ports: PortSet) -> Resources {
        Resources::request(
            self.cpu,
            self.memory_mb,
            self.gpus,
            self.gpu_mask.unwrap_or(0),
            self.gpu_share,
            ports,
            self.custom.clone(),
        )
    }

    /// Whether the task asks for any GPU (whole or a share).
    pub fn uses_gpus(&self) -> bool {
        self.gpus > 0
    }
}

impl JobSpec {
    pub fn total_tasks(&self) -> u32 {
        self.task_roles.iter().map(|r| r.instances).sum()
    }
    /// May `role`'s tasks span GPU types (the job's or the role's `allowMixedGpuTypes`)?
    pub fn mixes_gpu_types(&self, role: &TaskRole) -> bool {
        self.allow_mixed_gpu_types || role.allow_mixed_gpu_types
    }
    pub fn role(&self, name: &str) -> Option<&TaskRole> {
        self.task_roles.iter().find(|r| r.name == name)
    }
}

/// One problem in a job spec, located in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecError {
    /// Source name (file path or "<stdin>").
    pub source: String,
    /// 1-based line and column; 0 when the problem has no position (e.g. unreadable file).
    pub line: usize,
    pub col: usize,
    /// Dotted field path, e.g. `taskRoles.worker.resourcePerInstance.gpu`.
    pub field: String,
    pub message: String,
    /// How to fix it.
    pub fix: String,
}

/// Every problem found in a job spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecErrors(pub Vec<SpecError>);

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}: {}",
            self.source, self.line, self.col, self.field, self.message
        )?;
        if !self.fix.is_empty() {
            write!(f, "\n  fix: {}", self.fix)?;
        }
        Ok(())
    }
}

impl fmt::Display for SpecErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for SpecErrors {}

#[cfg(test)]
mod tests;
