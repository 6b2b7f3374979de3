//! What the job machine reports of itself, as [`Event`]s for the dashboard and metrics (the
//! publisher in `am::publish` turns them into updates): changed tasks, the job's state and
//! per-role counts and the node view.

use std::collections::{BTreeSet, HashMap};

use super::{Event, JobMachine, Now};
use crate::am::status::{JobState, NodeStatus, RoleCounts, TaskState};
use crate::reason::Reason;
use crate::resources::mask_hex;

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
        match std::mem::take(&mut self.nodes_dirty) {
            NodesDirty::Hosts(hosts) if hosts.is_empty() => {}
            NodesDirty::Hosts(hosts) => {
                let job_masks = self.job_gpu_masks();
                let mut groups = GroupsOf::default();
                let nodes = self.selector.with_view(|v| {
                    hosts
                        .into_iter()
                        .map(|h| {
                            let n = v.get(&h).map(|n| node_status(n, &job_masks, &mut groups));
                            (h, n)
                        })
                        .collect::<Vec<_>>()
                });
                self.out.events.push(Event::NodesChanged(nodes));
            }
            NodesDirty::All => {
                let job_masks = self.job_gpu_masks();
                let mut groups = GroupsOf::default();
                let nodes = self.selector.with_view(|v| {
                    v.nodes()
                        .map(|n| node_status(n, &job_masks, &mut groups))
                        .collect::<Vec<_>>()
                });
                self.out.events.push(Event::Nodes(nodes));
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

    fn job_gpu_masks(&self) -> HashMap<String, u64> {
        let mut m: HashMap<String, u64> = HashMap::new();
        for t in &self.tasks {
            if let (true, Some(c)) = (t.holds_container(), &t.container) {
                *m.entry(c.host.clone()).or_insert(0) |= c.resources.gpu_mask;
            }
        }
        m
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

/// Merges changed nodes into a node list ordered by host (as [`Event::Nodes`] gives
/// it): each replaced, inserted in order, or removed where it left the view.
pub fn merge_node_changes(list: &mut Vec<NodeStatus>, changes: Vec<(String, Option<NodeStatus>)>) {
    for (host, node) in changes {
        match (list.binary_search_by(|n| n.host.as_str().cmp(&host)), node) {
            (Ok(i), Some(n)) => list[i] = n,
            (Ok(i), None) => {
                list.remove(i);
            }
            (Err(i), Some(n)) => list.insert(i, n),
            (Err(_), None) => {}
        }
    }
}

/// The GPU groups of each topology met in one report, by its `Arc` (held, so no other
/// topology can take its address): the nodes of a listing share their topology's `Arc`,
/// so a 10,000-node view computes each topology's groups once, not per node.
#[derive(Default)]
struct GroupsOf(Vec<(std::sync::Arc<crate::topology::Topology>, Vec<Vec<String>>)>);

impl GroupsOf {
    fn of(&mut self, t: &std::sync::Arc<crate::topology::Topology>) -> Vec<Vec<String>> {
        if let Some((_, g)) = self.0.iter().find(|(k, _)| std::sync::Arc::ptr_eq(k, t)) {
            return g.clone();
        }
        let g: Vec<Vec<String>> = (0..=2u8)
            .rev()
            .map(|tier| t.islands(tier).into_iter().map(mask_hex).collect())
            .collect();
        // A handful of topologies in a cluster; past that, computed per node as before.
        if self.0.len() < 64 {
            self.0.push((t.clone(), g.clone()));
        }
        g
    }
}

/// A node of the view as the dashboard shows it.
fn node_status(n: &crate::cluster::Node, job_masks: &HashMap<String, u64>, groups: &mut GroupsOf) -> NodeStatus {
    let groups = match &n.topology {
        Some(t) => groups.of(t),
        None => Vec::new(),
    };
    NodeStatus {
        host: n.host.clone(),
        rack: n.rack.clone(),
        labels: n.labels.clone(),
        gpu_type: n.gpu_type.clone(),
        state: format!("{:?}", n.state).to_uppercase(),
        topology: n.topology.as_ref().map(|t| t.name().to_string()),
        gpu_count: n.total().gpu_count(),
        gpu_groups: groups,
        total_cpu: n.total().cpu,
        used_cpu: n.used().cpu,
        requested_cpu: n.requested().cpu,
        free_cpu: n.free().cpu,
        total_memory_mb: n.total().memory_mb,
        used_memory_mb: n.used().memory_mb,
        requested_memory_mb: n.requested().memory_mb,
        free_memory_mb: n.free().memory_mb,
        total_gpu_mask: mask_hex(n.total().gpu_mask),
        used_gpu_mask: mask_hex(n.used().gpu_mask),
        requested_gpu_mask: mask_hex(n.requested().gpu_mask),
        free_gpu_mask: mask_hex(n.free().gpu_mask),
        job_gpu_mask: mask_hex(job_masks.get(&n.host).copied().unwrap_or(0)),
        total_ports: n.total().ports.to_string(),
        used_ports: n.used().ports.to_string(),
        free_ports: n.free().ports.to_string(),
        used_gpu_shares: n.used().gpu_shares.clone(),
        custom_resources: n.total().custom.clone(),
        used_custom_resources: n.used().custom.clone(),
        free_custom_resources: n.free().custom.clone(),
    }
}
