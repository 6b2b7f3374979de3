//! What the job machine reports of itself, as [`Event`]s for the dashboard and metrics (the
//! publisher in `am::publish` turns them into updates): changed tasks, the job's state and
//! per-role counts, and which nodes of the view changed.

use std::collections::BTreeSet;

use super::{Event, JobMachine, Now};
use crate::am::status::{JobState, RoleCounts, TaskState};
use crate::reason::Reason;

impl JobMachine {
    /// Reports the changed tasks, the job's counters and (if changed) the node view.
    pub(super) fn report(&mut self, now: Now) {
        let changed: Vec<usize> = (0..self.tasks.len()).filter(|&i| self.tasks[i].dirty).collect();
        if !changed.is_empty() {
            let statuses: Vec<_> = changed.iter().map(|&i| (i, self.tasks[i].status(&self.job))).collect();
            for &i in &changed {
                self.tasks[i].dirty = false;
            }
            self.out.events.push(Event::Tasks(statuses));
            let running = self.tasks.iter().any(|t| t.state == TaskState::ContainerRunning);
            let state = if self.end.is_some() {
                self.reported_state
            } else if running {
                JobState::Running
            } else {
                JobState::Waiting
            };
            self.report_job(state, now);
        }
        let reason = if self.end.is_some() {
            None
        } else {
            crate::reason::combine(self.queue_reason.as_ref(), self.placement_reason().as_ref())
        };
        if reason != self.job_reason {
            self.job_reason = reason.clone();
            self.out.events.push(Event::Reason(reason));
        }
        // What changed in the node view; the dashboard computes its pages from the view
        // itself when asked (`am::node_page`).
        match std::mem::take(&mut self.nodes_dirty) {
            NodesDirty::Hosts(hosts) if hosts.is_empty() => {}
            NodesDirty::Hosts(hosts) => self.out.events.push(Event::NodesChanged(hosts.into_iter().collect())),
            NodesDirty::All => {
                let count = self.selector.with_view(|v| v.len());
                self.out.events.push(Event::Nodes { count });
            }
        }
    }

    /// What the AM found placing the job's tasks: the reason of its first task that is not
    /// placed (waiting before asked), said of that task. A task a gang holds back carries
    /// the reason of the task that holds it, so the gang shows that one.
    pub(super) fn placement_reason(&self) -> Option<Reason> {
        let first = |state: TaskState| {
            self.tasks.iter().filter(|t| t.state == state).find_map(|t| {
                let r = t.wait_reason()?.clone();
                Some(match r.task {
                    Some(_) => r,
                    None => r.of_task(self.task_name(t)),
                })
            })
        };
        first(TaskState::TaskWaiting).or_else(|| first(TaskState::ContainerRequested))
    }

    /// Reports the job's state and counts (and, once it ended, how).
    pub(super) fn report_job(&mut self, state: JobState, now: Now) {
        self.reported_state = state;
        let completed = self
            .tasks
            .iter()
            .filter(|t| t.state == TaskState::TaskCompleted)
            .count() as u32;
        self.out.events.push(Event::Job {
            state,
            roles: self.role_counts(),
            completed,
            end: self.end.clone().filter(|_| state.is_final()),
            at_ms: now.ms,
        });
    }

    fn role_counts(&self) -> Vec<RoleCounts> {
        self.job
            .task_roles
            .iter()
            .enumerate()
            .map(|(ri, r)| {
                let mut c = RoleCounts {
                    role: r.name.clone(),
                    instances: r.instances,
                    ..Default::default()
                };
                for t in self.tasks.iter().filter(|t| t.role == ri) {
                    match t.state {
                        TaskState::TaskWaiting | TaskState::ContainerCompleted => c.waiting += 1,
                        TaskState::ContainerRequested => c.requested += 1,
                        TaskState::ContainerAllocated | TaskState::ContainerLaunched => c.allocated += 1,
                        TaskState::ContainerRunning => c.running += 1,
                        TaskState::TaskCompleted => match t.succeeded {
                            Some(true) => c.succeeded += 1,
                            Some(false) => c.failed += 1,
                            None => c.stopped += 1,
                        },
                    }
                }
                c
            })
            .collect()
    }
}

/// What of the node view the next report publishes: the whole view (at the start and
/// after a full listing) or only the hosts that changed since the last report, so a
/// heartbeat that brings a few changed nodes costs O(changes), not O(nodes).
#[derive(Clone, Debug, PartialEq)]
pub(super) enum NodesDirty {
    All,
    Hosts(BTreeSet<String>),
}

impl Default for NodesDirty {
    fn default() -> Self {
        NodesDirty::Hosts(BTreeSet::new())
    }
}

impl NodesDirty {
    pub(super) fn add(&mut self, host: &str) {
        if let NodesDirty::Hosts(h) = self {
            h.insert(host.to_string());
        }
    }
}
