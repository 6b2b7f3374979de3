//! The AM's side of the RM's queues (issue 16), without I/O:
//! - [`waiting_demand`]: the tasks waiting for a container (those asked for in the same
//!   request included), grouped by role, sent with every heartbeat so the RM can rank and
//!   reclaim for them (the AM's own select pipeline finds no node for a task when the
//!   cluster is full, so the RM would not hear of it from asks);
//! - [`Preemptions`]: containers the RM is taking back. A container not started yet is
//!   given back at once; a running one is given back shortly before the RM's deadline, so
//!   that its task has the notice period to checkpoint (the node created its
//!   `GPUAM_PREEMPT_FILE`), or as soon as it exits by itself. Either way the task is retried
//!   as preempted, a transient exit that never uses up `taskRetryCount`.

use std::collections::{BTreeMap, HashMap};

use super::status::TaskState;
use super::tasks::Task;
use crate::config::SelectSettings;
use crate::protocol::{PreemptNotice, WaitingTasks};
use crate::spec::{JobSpec, TaskRole};

/// The job's tasks waiting for a container, one entry per role, with what the RM's
/// feasibility rule needs (`select.allow_none_gpu_job_on_gpu_node` and
/// `select.container_min_port` from `select`).
pub fn waiting_demand(job: &JobSpec, tasks: &[Task], select: &SelectSettings) -> Vec<WaitingTasks> {
    let job_uses_gpus = job.task_roles.iter().any(|r| r.resources.gpus > 0);
    let mut per_role: BTreeMap<usize, u32> = BTreeMap::new();
    // A task asked for in this very request still waits for its container: the RM's gate
    // counts the job's demand from this report, and a job that asked for all its tasks at
    // once would otherwise want nothing (deserve no share) while its asks are judged.
    for t in tasks
        .iter()
        .filter(|t| matches!(t.state, TaskState::TaskWaiting | TaskState::ContainerRequested))
    {
        *per_role.entry(t.role).or_default() += 1;
    }
    per_role
        .into_iter()
        .map(|(ri, count)| role_waiting(&job.task_roles[ri], count, job_uses_gpus, select))
        .collect()
}

/// A job not yet submitted as its AM would report it waiting (every task of every role),
/// for the RM's start estimate (`gpuam plan --rm`, issue 27).
pub fn estimate_request(job: &JobSpec, select: &SelectSettings) -> crate::protocol::EstimateRequest {
    let uses_gpus = job.task_roles.iter().any(|r| r.resources.uses_gpus());
    crate::protocol::EstimateRequest {
        queue: job.queue.clone(),
        priority: job.priority,
        gang: job.gang,
        waiting: job
            .task_roles
            .iter()
            .map(|r| role_waiting(r, r.instances, uses_gpus, select))
            .collect(),
        name: Some(job.name.clone()),
    }
}

/// `count` waiting tasks of `role` as the RM sees them: the role's request, partition,
/// GPU types, and whether the none-GPU rule keeps them off GPU nodes.
pub fn role_waiting(role: &TaskRole, count: u32, job_uses_gpus: bool, select: &SelectSettings) -> WaitingTasks {
    let r = &role.resources;
    WaitingTasks {
        role: role.name.clone(),
        count,
        gpus: r.gpus,
        cpu: r.cpu,
        memory_mb: r.memory_mb,
        gpu_types: role.gpu_types.clone(),
        node_label: role.node_label.clone(),
        gpu_share: r.gpu_share,
        gpu_mask: r.gpu_mask.unwrap_or(0),
        custom: r.custom.clone(),
        ports: r.static_ports(),
        dynamic_ports: r.dynamic_port_count(),
        // Sent only where it matters: an older RM refuses fields it does not know.
        min_port: if r.dynamic_port_count() > 0 {
            select.container_min_port
        } else {
            0
        },
        keep_off_gpu_nodes: !job_uses_gpus && !select.allow_none_gpu_job_on_gpu_node,
        max_run_sec: role.max_run_sec,
    }
}

/// A container under a preemption notice.
#[derive(Clone, Debug, PartialEq)]
pub struct Notice {
    /// When the AM gives it back (milliseconds since the epoch).
    pub release_at_ms: u64,
    pub deadline_ms: u64,
    pub reason: String,
}

/// Containers the RM is taking back, by id.
#[derive(Clone, Debug, Default)]
pub struct Preemptions {
    notices: HashMap<String, Notice>,
}

impl Preemptions {
    /// Takes the notices of one allocate answer. `started(id)`: whether that container's
    /// task runs (an unstarted one is given back at once). A running one is given back
    /// `margin` before the deadline: `stop_grace_ms`, or half the notice when that is
    /// shorter, so the RM's own stop at the deadline never has to act. Returns the ids new
    /// to this AM.
    pub fn take(
        &mut self,
        notices: &[PreemptNotice],
        now_ms: u64,
        stop_grace_ms: u64,
        started: impl Fn(&str) -> Option<bool>,
    ) -> Vec<String> {
        let mut new = Vec::new();
        for n in notices {
            if self.notices.contains_key(&n.container_id) {
                continue;
            }
            let Some(running) = started(&n.container_id) else {
                continue;
            };
            let left = n.deadline_ms.saturating_sub(now_ms);
            let release_at_ms = if running {
                n.deadline_ms.saturating_sub(stop_grace_ms.min(left / 2))
            } else {
                now_ms
            };
            self.notices.insert(
                n.container_id.clone(),
                Notice {
                    release_at_ms,
                    deadline_ms: n.deadline_ms,
                    reason: n.reason.clone(),
                },
            );
            new.push(n.container_id.clone());
        }
        new
    }

    /// Containers to give back now, sorted.
    pub fn due(&self, now_ms: u64) -> Vec<String> {
        let mut v: Vec<String> = self
            .notices
            .iter()
            .filter(|(_, n)| n.release_at_ms <= now_ms)
            .map(|(id, _)| id.clone())
            .collect();
        v.sort();
        v
    }

    /// The notice of a container (and forgets it): its end counts as preempted.
    pub fn remove(&mut self, id: &str) -> Option<Notice> {
        self.notices.remove(id)
    }

    pub fn get(&self, id: &str) -> Option<&Notice> {
        self.notices.get(id)
    }

    pub fn is_empty(&self) -> bool {
        self.notices.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn notice(id: &str, deadline: u64) -> PreemptNotice {
        PreemptNotice {
            container_id: id.into(),
            deadline_ms: deadline,
            reason: "queue A is below its share".into(),
        }
    }

    #[test]
    fn unstarted_containers_go_back_at_once_running_ones_before_the_deadline() {
        let mut p = Preemptions::default();
        let started = |id: &str| match id {
            "run" => Some(true),
            "alloc" => Some(false),
            _ => None,
        };
        let new = p.take(
            &[notice("run", 31_000), notice("alloc", 31_000), notice("gone", 31_000)],
            1_000,
            3_000,
            started,
        );
        assert_eq!(
            new,
            vec!["run".to_string(), "alloc".to_string()],
            "unknown ones are ignored"
        );
        assert_eq!(p.due(1_000), vec!["alloc".to_string()]);
        assert_eq!(p.get("run").unwrap().release_at_ms, 28_000, "3 s before the deadline");
        assert!(p.due(27_999).iter().all(|id| id != "run"));
        assert!(p.due(28_000).contains(&"run".to_string()));
        // A repeated notice (every answer repeats them) changes nothing.
        assert!(p.take(&[notice("run", 99_000)], 2_000, 3_000, started).is_empty());
        assert_eq!(p.get("run").unwrap().deadline_ms, 31_000);
        // A short notice: released half-way.
        let mut q = Preemptions::default();
        q.take(&[notice("run", 3_000)], 1_000, 3_000, started);
        assert_eq!(q.get("run").unwrap().release_at_ms, 2_000);
        assert!(q.remove("run").is_some() && q.is_empty());
    }

    #[test]
    fn waiting_demand_groups_waiting_tasks_by_role() {
        let job = crate::spec::parse_job_spec(
            "name: j\ntaskRoles:\n  ps:\n    instances: 1\n    resourcePerInstance: {cpu: 1, memoryMB: 100}\n    commands: [x]\n  \
             worker:\n    instances: 3\n    gpuType: V100\n    resourcePerInstance: {cpu: 2, memoryMB: 200, gpu: 2}\n    commands: [x]\n",
            "j.yaml",
        )
        .unwrap();
        let mut tasks = vec![
            Task::new(0, 0),
            Task::new(1, 0),
            Task::new(1, 1),
            Task::new(1, 2),
            Task::new(1, 3),
        ];
        tasks[2].state = TaskState::ContainerRunning;
        // Asked for in this request: still waiting for its container.
        tasks[3].state = TaskState::ContainerRequested;
        tasks[4].state = TaskState::ContainerAllocated;
        let d = waiting_demand(&job, &tasks, &SelectSettings::default());
        assert_eq!(d.len(), 2);
        assert_eq!((d[0].role.as_str(), d[0].count, d[0].gpus), ("ps", 1, 0));
        assert_eq!(
            (
                d[1].role.as_str(),
                d[1].count,
                d[1].gpus,
                d[1].cpu,
                d[1].gpu_types.clone()
            ),
            ("worker", 2, 2, 2, vec!["V100".to_string()])
        );
        // A whole-GPU role without ports or custom resources is sent as before (an older
        // RM refuses unknown fields); what the feasibility rule needs is added only where
        // it matters, and an older AM's waiting tasks still read.
        let keys = |w: &WaitingTasks| -> Vec<String> {
            let v = serde_json::to_value(w).unwrap();
            v.as_object().unwrap().keys().cloned().collect()
        };
        let old = ["count", "cpu", "gpuTypes", "gpus", "memoryMB", "nodeLabel", "role"];
        assert_eq!(keys(&d[1]), old);
        // The none-GPU rule is the job's, and only with allow_none_gpu_job_on_gpu_node off:
        // this job uses GPUs, so its CPU role may use GPU nodes; in a job without GPUs it
        // keeps off them.
        let strict = SelectSettings {
            allow_none_gpu_job_on_gpu_node: false,
            ..SelectSettings::default()
        };
        assert!(!waiting_demand(&job, &tasks, &strict)[0].keep_off_gpu_nodes);
        assert!(role_waiting(&job.task_roles[0], 1, false, &strict).keep_off_gpu_nodes);
        assert!(!role_waiting(&job.task_roles[0], 1, false, &SelectSettings::default()).keep_off_gpu_nodes);
        let r: WaitingTasks = serde_json::from_str(r#"{"count":1,"gpus":2,"cpu":1,"memoryMB":10}"#).unwrap();
        assert_eq!((r.gpu_share, r.dynamic_ports, r.keep_off_gpu_nodes), (None, 0, false));
        let mut ported = job.task_roles[1].clone();
        ported.resources.ports = vec![crate::spec::PortRequest {
            label: "http".into(),
            count: 2,
            start: None,
        }];
        let w = role_waiting(&ported, 1, true, &SelectSettings::default());
        assert_eq!(
            (w.dynamic_ports, w.min_port),
            (2, SelectSettings::default().container_min_port)
        );
        assert!(keys(&w).contains(&"dynamicPorts".to_string()) && keys(&w).contains(&"minPort".to_string()));
    }
}
