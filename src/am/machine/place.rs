//! The job machine's placement round and its asks: the waiting tasks placed in request order
//! (the selector's [`PlacementRound`], as `gpuam plan` shows it), at most
//! [`MAX_ASKS_PER_HEARTBEAT`] a heartbeat unless a gang is gathered whole; a role that finds
//! no place backs off as a whole; an impossible task fails the job. Then the allocate call:
//! asks not answered in time withdrawn, a partial gang held back, new asks, cancels, releases
//! and the waiting demand in one request.

use std::collections::HashMap;

use super::{Effect, Event, InFlight, JobEnd, JobMachine, Now, MAX_ASKS_PER_HEARTBEAT, REQUEST_TIMEOUT};
use crate::am::status::{JobState, TaskState};
use crate::am::tasks::Outstanding;
use crate::protocol::{AllocateRequest, Ask};
use crate::reason::Kind;
use crate::select::{Outcome, PlacementRound};

impl JobMachine {
    /// The placement round, then the allocate call ([`Effect::Allocate`]).
    pub(super) fn place_and_ask(&mut self, now: Now) {
        self.place_waiting(now);
        let req = self.allocate_request(now);
        self.in_flight = Some(InFlight {
            asks: req.asks.iter().map(|a| a.request_id).collect(),
            cancels: req.cancels.clone(),
            releases: req.releases.clone(),
        });
        self.out.effects.push(Effect::Allocate(req));
    }

    /// Asks for the waiting tasks: one [`PlacementRound`] in request order, each placement
    /// becoming an outstanding ask.
    pub(super) fn place_waiting(&mut self, now: Now) {
        if self.gang_backoff_until.is_some_and(|t| now.at < t) {
            return;
        }
        self.gang_backoff_until = None;
        // The drain term reads the step's wall clock (a task's declared end, issue 27).
        self.selector.set_clock(now.ms);
        let job = self.job.clone();
        let (tasks, role_first, topology_wait) = (&self.tasks, &self.role_first, self.topology_wait);
        let mut round = PlacementRound::new(&job, |ri, i| {
            tasks[role_first[ri] + i as usize].slot(now.at, topology_wait)
        });
        let mut asked = 0;
        // One back-off per role and round: its tasks are alike.
        let mut role_wait: HashMap<usize, std::time::Instant> = HashMap::new();
        // A gang is asked for whole (see `hold_back_partial_gang`): never cut short.
        let whole_gang = self.job.gang && !self.gang_launched;
        while let Some((ri, index)) = round.next_task() {
            if asked >= MAX_ASKS_PER_HEARTBEAT && !whole_gang {
                break;
            }
            let ti = self.role_first[ri] + index as usize;
            let step = round.place(&self.selector, (ri, index));
            let role_name = &job.task_roles[ri].name;
            let outcome = step.selection.outcome.clone();
            let why = self.tasks[ti].reason_for(&outcome, self.topology_wait);
            self.out.events.push(Event::Selection {
                role: role_name.clone(),
                index,
                selection: Box::new(step.selection),
                repeated: step.repeated,
                at_ms: now.ms,
            });
            match outcome {
                Outcome::Placed(p) => {
                    let id = self.next_request_id;
                    self.next_request_id += 1;
                    asked += 1;
                    let t = &mut self.tasks[ti];
                    t.set_reason(why);
                    t.request = Some(Outstanding {
                        request_id: id,
                        host: p.host,
                        resources: p.resources,
                        sent: now.at,
                    });
                    t.not_before = None;
                    t.set_state(TaskState::ContainerRequested);
                    self.by_request.insert(id, ti);
                }
                Outcome::Impossible { reason } if self.impossible_fails => {
                    self.tasks[ti].set_reason(why);
                    self.end = Some(JobEnd {
                        state: JobState::Failed,
                        exit_code: 1,
                        diagnostics: format!("task {role_name}/{index} can never be placed on this cluster: {reason}"),
                    });
                    return;
                }
                // Not now: the role backs off. (Planning, an impossible task waits the same
                // way, saying it never fits, so the rest of the job is still shown.)
                Outcome::NotNow { .. } | Outcome::Impossible { .. } => {
                    let (lo, hi) = (
                        self.settings.not_available_retry_min_ms,
                        self.settings.not_available_retry_max_ms,
                    );
                    let backoff = &mut self.backoff;
                    let until = *role_wait.entry(ri).or_insert_with(|| now.at + backoff.between(lo, hi));
                    // Not now while the RM's queues name a cause: the task waits for its
                    // queue (a node it was refused on is only skipped for a while).
                    let why = match matches!(outcome, Outcome::NotNow { .. }) {
                        true => crate::reason::combine(self.queue_reason.as_ref(), why.as_ref()),
                        false => why,
                    };
                    let t = &mut self.tasks[ti];
                    t.not_before = Some(until);
                    t.set_reason(why);
                }
            }
        }
    }

    /// The allocate call: asks not answered in time are withdrawn (and placed again later),
    /// a partial gang is held back, and what is new goes out.
    fn allocate_request(&mut self, now: Now) -> AllocateRequest {
        for ti in 0..self.tasks.len() {
            let timed_out = self.tasks[ti]
                .request
                .as_ref()
                .filter(|r| {
                    self.tasks[ti].state == TaskState::ContainerRequested
                        && now.at.saturating_duration_since(r.sent) > REQUEST_TIMEOUT
                })
                .cloned();
            if let Some(r) = timed_out {
                self.sent_asks.remove(&r.request_id);
                self.cancels.push(r.request_id);
                self.by_request.remove(&r.request_id);
                self.selector.remove_requested(&r.host, &r.resources, true);
                let t = &mut self.tasks[ti];
                t.waits(Kind::Retry, format!("the ask on {} timed out", r.host));
                t.reset_to_waiting();
            }
        }
        self.hold_back_partial_gang(now);
        let gang = (self.job.gang && !self.gang_launched).then(|| format!("gang-{}", self.gang_round));
        let asks: Vec<Ask> = self
            .tasks
            .iter()
            .filter(|t| t.state == TaskState::ContainerRequested)
            .filter_map(|t| t.request.as_ref().map(|r| (t, r)))
            .filter(|(_, r)| !self.sent_asks.contains(&r.request_id))
            .map(|(t, r)| Ask {
                task: Some(self.task_name(t)),
                task_attempt: t.attempt,
                gang: gang.clone(),
                max_run_sec: self.job.task_roles.get(t.role).and_then(|role| role.max_run_sec),
                ..Ask::for_resources(r.request_id, &r.host, &r.resources)
            })
            .collect();
        if gang.is_some() && !asks.is_empty() {
            self.gang_round += 1;
        }
        let hold_ms = (self.idle() && asks.is_empty() && self.cancels.is_empty() && self.releases.is_empty())
            .then_some(self.settings.idle_hold_ms)
            .filter(|&ms| ms > 0);
        AllocateRequest {
            response_id: self.response_id,
            progress: self.progress(),
            asks,
            cancels: std::mem::take(&mut self.cancels),
            releases: std::mem::take(&mut self.releases),
            hold_ms,
            waiting: Some(crate::am::queueing::waiting_demand(
                &self.job,
                &self.tasks,
                &self.selector.settings(),
            )),
            wait_reason: self.placement_reason(),
        }
    }

    fn progress(&self) -> f32 {
        let total = self.tasks.len().max(1) as f32;
        self.tasks
            .iter()
            .filter(|t| t.state == TaskState::TaskCompleted)
            .count() as f32
            / total
    }
}
