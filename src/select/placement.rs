//! One job's placement round, free of I/O: which task is asked for next, what the job still
//! needs (the [`JobDemand`] built from every task's state, with the GPUs its tasks hold or asked
//! for per host), running the select pipeline for a task and booking the result, the ports a
//! `samePortAllocation` role reuses, and what a "not now" means for the rest of its role.
//!
//! The AM's job machine (`am::machine`, once per heartbeat; `gpuam plan` runs that machine
//! too) and [`super::plan_job`] (one round over a job with nothing placed: the gang check and
//! the select bench) drive the same [`PlacementRound`].

use super::one_type::{Choice, TypeGroups};
use super::{JobDemand, Outcome, Selection, SelectionTrace, Selector, TaskAsk, TaskShape};
use crate::resources::{PortSet, Resources};
use crate::spec::JobSpec;

/// Where one task of the job stands, as far as placement is concerned.
#[derive(Clone, Debug, PartialEq)]
pub enum TaskSlot {
    /// Needs a container. `ready`: it may be tried now (false while it waits out a back-off;
    /// it still counts as unplaced in the job's demand). `topology_wait`: it may still wait for
    /// its node's ideal GPU tier ([`crate::select::TaskAsk::topology_wait`]).
    Waiting { ready: bool, topology_wait: bool },
    /// Has an ask out or holds a container on `host`, with exactly `resources`.
    Placed { host: String, resources: Resources },
    /// Neither: finished, or not to be placed.
    Idle,
}

/// A task of the job: (role index in the spec, instance index).
pub type TaskRef = (usize, u32);

/// What one [`PlacementRound::place`] did: the pipeline's selection (a placement is already
/// booked on the selector's view and in the round), and whether it is a repeat.
#[derive(Clone, Debug)]
pub struct Step {
    pub selection: Selection,
    /// An earlier task of the same role found no place in this round, so the pipeline was not
    /// run again (tasks of a role are alike): the selection is that task's "not now".
    pub repeated: bool,
}

/// One pass over the job's waiting tasks in the AM's request order.
pub struct PlacementRound<'j> {
    job: &'j JobSpec,
    /// Request order (see [`request_order`]).
    order: Vec<TaskRef>,
    next: usize,
    /// Per role, per instance.
    slots: Vec<Vec<TaskSlot>>,
    demand: JobDemand,
    /// Tasks waiting for a container (the candidate count of each ask).
    waiting: u32,
    /// samePortAllocation: the ports the role's tasks hold or asked for.
    role_ports: Vec<Option<PortSet>>,
    /// Roles that found no place in this round, with the first "not now".
    blocked: Vec<Option<Selection>>,
    /// The GPU type each gang (else each role) that names none keeps to (issue 27).
    types: TypeGroups,
}

/// The AM's request order: by task index, roles interleaved in file order
/// (role A 0, role B 0, role A 1, ...), as the original sorted waiting tasks.
pub fn request_order(job: &JobSpec) -> Vec<TaskRef> {
    let max = job.task_roles.iter().map(|r| r.instances).max().unwrap_or(0);
    (0..max)
        .flat_map(|i| {
            job.task_roles
                .iter()
                .enumerate()
                .filter(move |(_, r)| i < r.instances)
                .map(move |(ri, _)| (ri, i))
        })
        .collect()
}

impl<'j> PlacementRound<'j> {
    /// A round over `job` whose tasks stand where `slot_of(role, index)` says.
    pub fn new(job: &'j JobSpec, mut slot_of: impl FnMut(usize, u32) -> TaskSlot) -> Self {
        let slots: Vec<Vec<TaskSlot>> = job
            .task_roles
            .iter()
            .enumerate()
            .map(|(ri, r)| (0..r.instances).map(|i| slot_of(ri, i)).collect())
            .collect();
        let demand = demand_of(job, &slots);
        let waiting = slots
            .iter()
            .flatten()
            .filter(|s| matches!(s, TaskSlot::Waiting { .. }))
            .count() as u32;
        let role_ports = job
            .task_roles
            .iter()
            .zip(&slots)
            .map(|(role, slots)| {
                role.same_port_allocation
                    .then(|| {
                        slots.iter().find_map(|s| match s {
                            TaskSlot::Placed { resources, .. } => Some(resources.ports.clone()),
                            _ => None,
                        })
                    })
                    .flatten()
            })
            .collect();
        PlacementRound {
            job,
            order: request_order(job),
            next: 0,
            slots,
            demand,
            waiting,
            role_ports,
            blocked: vec![None; job.task_roles.len()],
            types: TypeGroups::of(job),
        }
    }

    /// A round over a job none of whose tasks has a place yet (what `plan` starts from), with
    /// no topology wait: `plan` shows where each task goes, and flags a task the AM would first
    /// hold back for a better GPU tier ([`super::Placement::may_improve`]).
    pub fn fresh(job: &'j JobSpec) -> Self {
        PlacementRound::new(job, |_, _| TaskSlot::Waiting {
            ready: true,
            topology_wait: false,
        })
    }

    /// The next task to try, in request order: waiting and ready, not tried yet this round.
    pub fn next_task(&mut self) -> Option<TaskRef> {
        while let Some(&(ri, i)) = self.order.get(self.next) {
            self.next += 1;
            if matches!(self.slots[ri][i as usize], TaskSlot::Waiting { ready: true, .. }) {
                return Some((ri, i));
            }
        }
        None
    }

    /// What the job still needs and where its tasks are, as the pipeline sees it.
    pub fn demand(&self) -> &JobDemand {
        &self.demand
    }

    /// Runs the select pipeline for `task` and, when it is placed, books it on the selector's
    /// view (in the same critical section) and in the round (its host and GPUs join the job's
    /// demand, its ports become the role's for samePortAllocation).
    pub fn place(&mut self, selector: &Selector, task: TaskRef) -> Step {
        let (ri, index) = task;
        if let Some(first) = &self.blocked[ri] {
            return Step {
                selection: first.clone(),
                repeated: true,
            };
        }
        let role = &self.job.task_roles[ri];
        let reuse = if role.same_port_allocation {
            self.role_ports[ri].as_ref()
        } else {
            None
        };
        let topology_wait = matches!(
            self.slots[ri][index as usize],
            TaskSlot::Waiting {
                topology_wait: true,
                ..
            }
        );
        // One GPU type per gang (else per role) that names none: chosen on first use.
        let choice = self
            .types
            .choice(ri, self.job, &self.slots, selector, &self.demand)
            .cloned();
        let one;
        let mut ask = TaskAsk::for_role(role, reuse, self.waiting).with_topology_wait(topology_wait);
        match choice {
            Some(Choice::Refused(reason)) => {
                return Step {
                    selection: Selection {
                        outcome: Outcome::Impossible { reason },
                        trace: SelectionTrace::default(),
                    },
                    repeated: false,
                }
            }
            Some(Choice::One(ty)) => {
                one = ty;
                ask.gpu_types = &one;
            }
            Some(Choice::Free) | None => {}
        }
        let selection = selector.select_and_reserve(&ask, &self.demand);
        match &selection.outcome {
            Outcome::Placed(p) => {
                let shape = TaskShape::of(&role.resources);
                // A share joins no all-reduce: only whole GPUs count in the job's union.
                self.demand
                    .placed_with_gpus(&shape, &p.host, p.resources.whole_gpu_mask());
                self.waiting = self.waiting.saturating_sub(1);
                if role.same_port_allocation && self.role_ports[ri].is_none() {
                    self.role_ports[ri] = Some(p.resources.ports.clone());
                }
                self.slots[ri][index as usize] = TaskSlot::Placed {
                    host: p.host.clone(),
                    resources: p.resources.clone(),
                };
            }
            Outcome::NotNow { .. } => self.blocked[ri] = Some(selection.clone()),
            Outcome::Impossible { .. } => {}
        }
        Step {
            selection,
            repeated: false,
        }
    }
}

/// The job's demand from its tasks' slots: waiting tasks by shape (those backing off too:
/// they still need a place), and per host the tasks and GPUs the job holds or asked for.
fn demand_of(job: &JobSpec, slots: &[Vec<TaskSlot>]) -> JobDemand {
    let mut d = JobDemand::new(job.task_roles.iter().any(|r| r.resources.gpus > 0));
    for (role, slots) in job.task_roles.iter().zip(slots) {
        for s in slots {
            match s {
                TaskSlot::Waiting { .. } => d.add_waiting(TaskShape::of(&role.resources), 1),
                TaskSlot::Placed { host, resources } => {
                    d.add_host(host);
                    d.add_held(host, resources.whole_gpu_mask());
                }
                TaskSlot::Idle => {}
            }
        }
    }
    d
}
