//! The job machine's gang rule and launches: a gang's asks go out all together or wait
//! (hold-back), its containers launch only once every open task holds one, and what it holds
//! is given back when that takes longer than the gang timeout; without a gang every granted
//! container launches at once. The launch answers come back here.

use std::collections::BTreeMap;
use std::time::Duration;

use super::{JobMachine, Launch, Now};
use crate::am::status::TaskState;
use crate::am::tasks::{launch_context, peer_address, Task};
use crate::reason::{Kind, Reason};

impl JobMachine {
    /// A gang's asks go out all together (the RM grants them all or none): while some
    /// open task of the gang found no place, the ones placed this round wait with it, and
    /// the whole gang tries again at the same time.
    pub(super) fn hold_back_partial_gang(&mut self, now: Now) {
        if !self.job.gang || self.gang_launched {
            return;
        }
        let unplaced = self.tasks.iter().filter(|t| t.state == TaskState::TaskWaiting).count();
        if unplaced == 0 {
            return;
        }
        let total = self
            .tasks
            .iter()
            .filter(|t| t.state != TaskState::TaskCompleted)
            .count();
        // The reason shown is the one of the task that holds the gang back (its first
        // unplaced task with a reason of its own), said of that task; a gang's own note
        // only when none has one.
        let held = self
            .tasks
            .iter()
            .filter(|t| t.state == TaskState::TaskWaiting)
            .find_map(|t| {
                let why = t.reason.as_ref().filter(|r| r.task.is_none())?;
                Some(why.clone().of_task(self.task_name(t)))
            })
            .unwrap_or_else(|| {
                Reason::new(
                    Kind::Gang,
                    format!("its {total} tasks are asked for together; {unplaced} of them find no place yet"),
                )
            });
        let wait = self.backoff.between(
            self.settings.not_available_retry_min_ms,
            self.settings.not_available_retry_max_ms,
        );
        let mut held_back = false;
        for ti in 0..self.tasks.len() {
            let unsent = self.tasks[ti]
                .request
                .as_ref()
                .filter(|r| {
                    self.tasks[ti].state == TaskState::ContainerRequested && !self.sent_asks.contains(&r.request_id)
                })
                .cloned();
            let Some(r) = unsent else { continue };
            held_back = true;
            self.by_request.remove(&r.request_id);
            self.selector.remove_requested(&r.host, &r.resources, false);
            let t = &mut self.tasks[ti];
            t.reset_to_waiting();
            t.not_before = Some(now.at + wait);
            t.set_reason(Some(held.clone()));
        }
        // Some were held back: the gang is tried again as a whole, every waiting task of it
        // at the same time.
        if held_back {
            for t in self.tasks.iter_mut().filter(|t| t.state == TaskState::TaskWaiting) {
                t.not_before = Some(now.at + wait);
            }
        }
    }

    /// The containers to launch now: without a gang every allocated task's; with a gang only
    /// when every unfinished task holds a container (and everything is given back if that
    /// takes longer than the gang timeout). `None` once the job has ended.
    pub(super) fn launches_due(&mut self, now: Now) -> Option<Vec<Launch>> {
        if self.end.is_some() {
            return None;
        }
        let allocated = |tasks: &[Task]| -> Vec<usize> {
            (0..tasks.len())
                .filter(|&i| tasks[i].state == TaskState::ContainerAllocated)
                .collect()
        };
        let to_launch: Vec<usize> = if self.job.gang && !self.gang_launched {
            let open: Vec<&Task> = self
                .tasks
                .iter()
                .filter(|t| t.state != TaskState::TaskCompleted)
                .collect();
            let complete = !open.is_empty() && open.iter().all(|t| t.holds_container());
            if complete {
                self.gang_wait_since = None;
                self.gang_launched = true;
                allocated(&self.tasks)
            } else {
                let holding = open
                    .iter()
                    .any(|t| t.holds_container() || t.state == TaskState::ContainerRequested);
                if holding {
                    let since = *self.gang_wait_since.get_or_insert(now.at);
                    let timeout = self.job.gang_timeout_sec.unwrap_or(self.settings.gang_timeout_sec);
                    if now.at.saturating_duration_since(since) >= Duration::from_secs(timeout) {
                        self.release_gang(now);
                    }
                } else {
                    self.gang_wait_since = None;
                }
                Vec::new()
            }
        } else {
            allocated(&self.tasks)
        };
        let peers = (self.job.gang && !to_launch.is_empty()).then(|| self.peers());
        Some(
            to_launch
                .into_iter()
                .filter_map(|ti| {
                    let t = &self.tasks[ti];
                    let container = t.container.clone()?;
                    Some(Launch {
                        task: ti,
                        container,
                        context: launch_context(&self.job, t, &self.app_id, peers.as_ref(), &self.tasks),
                    })
                })
                .collect(),
        )
    }

    /// The launch answers: running, or ended as a failed launch (and retried).
    pub(super) fn launched(&mut self, results: Vec<(usize, super::LaunchAnswer)>, now: Now) {
        for (ti, r) in results {
            if ti >= self.tasks.len() {
                continue;
            }
            match r {
                Ok(started) => {
                    let t = &mut self.tasks[ti];
                    // When the node started it (a start call answers for all its starts at
                    // once), never later than now whatever the node's clock says.
                    t.launched_ms = Some(started.map_or(now.ms, |s| s.min(now.ms)));
                    t.set_state(TaskState::ContainerRunning);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "container launch failed");
                    if let Some(c) = self.tasks[ti].container.clone() {
                        self.by_container.remove(&c.container_id);
                        self.releases.push(c.container_id);
                    }
                    let exit = self.classify(crate::am::exits::code::CONTAINER_NM_LAUNCH_FAILED, "");
                    self.task_exited(ti, exit, e, now);
                }
            }
        }
    }

    /// Gives back every container a gang holds and waits before trying again.
    fn release_gang(&mut self, now: Now) {
        tracing::info!("gang not complete within the gang timeout; releasing what it holds");
        let wait = self.backoff.jittered(self.settings.gang_retry_backoff_ms);
        // Every task it resets says so, until the gang is tried again.
        let again = |t: &Task, detail: &str| {
            let r = Reason::new(Kind::Gang, detail).since(t.waiting_since_ms);
            Some(r.until(now.ms + wait.as_millis() as u64))
        };
        for t in &mut self.tasks {
            match t.state {
                TaskState::ContainerAllocated => {
                    if let Some(c) = t.container.take() {
                        self.by_container.remove(&c.container_id);
                        self.releases.push(c.container_id);
                    }
                    t.reset_to_waiting();
                    t.set_reason(again(t, "gang timeout: released and waiting to try again"));
                }
                TaskState::ContainerRequested => {
                    if let Some(r) = t.request.take() {
                        self.cancels.push(r.request_id);
                        self.by_request.remove(&r.request_id);
                        self.selector.remove_requested(&r.host, &r.resources, false);
                    }
                    t.reset_to_waiting();
                    t.set_reason(again(t, "gang timeout: waiting to try again"));
                }
                _ => {}
            }
        }
        self.gang_wait_since = None;
        self.gang_backoff_until = Some(now.at + wait);
    }

    /// role → ["host:firstPort", ...] in index order.
    fn peers(&self) -> BTreeMap<String, Vec<String>> {
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (ri, r) in self.job.task_roles.iter().enumerate() {
            let mut v: Vec<(u32, String)> = self
                .tasks
                .iter()
                .filter(|t| t.role == ri)
                .filter_map(|t| peer_address(t).map(|a| (t.index, a)))
                .collect();
            v.sort();
            out.insert(r.name.clone(), v.into_iter().map(|(_, a)| a).collect());
        }
        out
    }
}
