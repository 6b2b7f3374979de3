//! The job machine's two ways of lining up with what the RM already holds: adopting the
//! containers of earlier AM attempts (work-preserving restart) and reconciling after the
//! RM restarted (resync).

use std::collections::{BTreeMap, HashMap};

use super::{Event, JobMachine, Now};
use crate::am::exits::{decide_retry, RetryState};
use crate::am::status::TaskState;
use crate::protocol::{exit_status, CompletedContainer, ContainerState, PreviousContainer};
use crate::select::assign_port_labels;

impl JobMachine {
    /// Takes over the containers of earlier AM attempts: a task's newest live container is
    /// re-adopted as it is (running or allocated); a task whose newest container already
    /// ended is judged by that exit, exactly as the earlier attempt would have; containers
    /// no task claims are released. A task's retry counts are rebuilt from its history: the
    /// container that ended each earlier task attempt is judged again (transient or
    /// counted), as the earlier AM judged it.
    pub(super) fn adopt(&mut self, previous: &[PreviousContainer], now: Now) {
        let mut newest: HashMap<usize, &PreviousContainer> = HashMap::new();
        // task → task attempt → the container that ended that attempt (the last one).
        let mut history: HashMap<usize, BTreeMap<u32, &PreviousContainer>> = HashMap::new();
        for p in previous {
            let task = p.container.task.as_deref().and_then(|t| self.task_named(t));
            if let (Some(ti), ContainerState::Complete) = (task, p.state) {
                let last = history
                    .entry(ti)
                    .or_default()
                    .entry(p.container.task_attempt)
                    .or_insert(p);
                if p.container.container_id > last.container.container_id {
                    *last = p;
                }
            }
            match task {
                Some(ti) => {
                    let keep = match newest.get(&ti) {
                        Some(q) => {
                            (p.container.task_attempt, &p.container.container_id)
                                > (q.container.task_attempt, &q.container.container_id)
                        }
                        None => true,
                    };
                    if keep {
                        if let Some(old) = newest.insert(ti, p) {
                            if old.state != ContainerState::Complete {
                                self.releases.push(old.container.container_id.clone());
                            }
                        }
                    } else if p.state != ContainerState::Complete {
                        self.releases.push(p.container.container_id.clone());
                    }
                }
                None if p.state != ContainerState::Complete => self.releases.push(p.container.container_id.clone()),
                None => {}
            }
        }
        let mut adopted = 0;
        let max_transient = self.settings.max_transient_retries;
        for (ti, p) in newest {
            let c = p.container.clone();
            let role = &self.job.task_roles[self.tasks[ti].role];
            let ports = assign_port_labels(&role.resources, &c.resources.ports).unwrap_or_default();
            let max_retry = role.task_retry_count;
            let attempt = c.task_attempt.max(1);
            let mut retry = RetryState::default();
            for k in 1..attempt {
                match history.get(&ti).and_then(|h| h.get(&k)) {
                    Some(ended) => {
                        let raw = ended.exit_status.unwrap_or(exit_status::ABORTED);
                        let exit = self.classify(raw, &ended.diagnostics);
                        decide_retry(&exit, max_retry, &mut retry, max_transient);
                    }
                    // No record of how it ended: count it, so the policy is never exceeded.
                    None => retry.retried += 1,
                }
            }
            let t = &mut self.tasks[ti];
            t.attempt = attempt;
            t.retry = retry;
            match p.state {
                ContainerState::Complete => {
                    let raw = p.exit_status.unwrap_or(exit_status::ABORTED);
                    let exit = self.classify(raw, &p.diagnostics);
                    // A task whose newest container ended while no AM was there to see it.
                    self.tasks[ti].container = Some(c);
                    self.task_exited(ti, exit, p.diagnostics.clone(), now);
                }
                live => {
                    t.ports = ports;
                    t.launched_ms = (live == ContainerState::Running).then_some(now.ms);
                    self.by_container.insert(c.container_id.clone(), ti);
                    self.out.events.push(Event::container_at(&c));
                    t.container = Some(c);
                    t.set_state(if live == ContainerState::Running {
                        TaskState::ContainerRunning
                    } else {
                        TaskState::ContainerAllocated
                    });
                    adopted += 1;
                }
            }
        }
        if self.job.gang && self.tasks.iter().any(|t| t.state == TaskState::ContainerRunning) {
            // The gang had started: a new attempt does not hold back its relaunched tasks.
            self.gang_launched = true;
        }
        tracing::info!(
            adopted,
            released = self.releases.len(),
            "re-adopted containers of earlier attempts"
        );
    }

    /// Lines up this AM's containers with the RM's list of the application's
    /// containers (after a resync):
    /// - one the RM granted for an ask still outstanding here (the answer was lost when
    ///   the RM went down) is taken as if that answer had arrived;
    /// - other live ones unknown here are released;
    /// - one held here that the RM reports completed ends now with the RM's exit status
    ///   (the same completion arriving later in a heartbeat finds nothing to do);
    /// - one held here that the RM does not know at all is lost: -7151
    ///   (CONTAINER_RM_RESYNC_LOST, transient), as frameworklauncher's resync does.
    pub(super) fn reconcile(&mut self, rm_view: &[PreviousContainer], now: Now) {
        let by_id: HashMap<&str, &PreviousContainer> =
            rm_view.iter().map(|p| (p.container.container_id.as_str(), p)).collect();
        let mut answered = 0;
        for p in rm_view {
            let c = &p.container;
            if p.state == ContainerState::Complete || self.by_container.contains_key(&c.container_id) {
                continue;
            }
            let ours = self.by_request.get(&c.request_id).is_some_and(|&ti| {
                let t = &self.tasks[ti];
                c.task.as_deref() == Some(self.task_name(t).as_str()) && c.task_attempt == t.attempt
            });
            if ours {
                answered += 1;
                self.accept_container(c.clone());
            } else if !self.releases.contains(&c.container_id) {
                self.releases.push(c.container_id.clone());
            }
        }
        let mut held: Vec<String> = self.by_container.keys().cloned().collect();
        held.sort();
        let mut lost = 0;
        for cid in held {
            let completed = match by_id.get(cid.as_str()) {
                Some(p) if p.state == ContainerState::Complete => CompletedContainer {
                    container_id: cid,
                    exit_status: p.exit_status.unwrap_or(exit_status::ABORTED),
                    diagnostics: p.diagnostics.clone(),
                },
                Some(_) => continue,
                None => {
                    lost += 1;
                    CompletedContainer {
                        container_id: cid,
                        exit_status: crate::am::exits::code::CONTAINER_RM_RESYNC_LOST,
                        diagnostics: "the RM does not know this container after its restart".into(),
                    }
                }
            };
            self.container_completed(completed, now);
        }
        tracing::info!(answered, lost, released = self.releases.len(), "resync done");
    }
}
