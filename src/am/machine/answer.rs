//! The job machine's reading of an allocate answer: updated nodes into the view, rejected
//! asks back to waiting, granted containers checked against their asks and taken (or given
//! back), preemption notices taken and released when due, completed containers ended, the
//! queue note kept, and the RM's shutdown command.

use super::{Event, JobMachine, Now};
use crate::am::status::TaskState;
use crate::protocol::{exit_status, AllocateResponse, AmCommand, CompletedContainer, Container, PreemptNotice};
use crate::reason::Kind;
use crate::resources::mask_hex;
use crate::select::assign_port_labels;

impl JobMachine {
    pub(super) fn apply_answer(&mut self, resp: AllocateResponse, now: Now) {
        self.response_id = resp.response_id;
        for r in resp.updated_nodes {
            self.nodes_dirty.add(&r.node.host);
            self.selector.apply_node_report(r.node);
        }
        for rej in resp.rejected {
            self.sent_asks.remove(&rej.request_id);
            let Some(ti) = self.by_request.remove(&rej.request_id) else {
                continue;
            };
            let t = &mut self.tasks[ti];
            if let Some(r) = t.request.take() {
                self.selector.remove_requested(&r.host, &r.resources, true);
                // The queue gate's refusal says what the task waits for (its queue); any
                // other is tried again.
                match rej.wait {
                    Some(why) => t.set_reason(Some(why.since(t.waiting_since_ms))),
                    None => t.waits(Kind::Retry, format!("ask on {} rejected: {}", r.host, rej.reason)),
                }
            }
            t.reset_to_waiting();
            if !rej.retryable {
                // The RM says this exact ask can never be granted; a fresh selection
                // with the node view refreshed will choose differently.
                self.last_refresh = None;
            }
        }
        for c in resp.allocated {
            self.accept_container(c);
        }
        self.take_preemptions(&resp.preempt, now);
        for c in resp.completed {
            self.container_completed(c, now);
        }
        if resp.waiting_reason != self.queue_note {
            self.queue_note = resp.waiting_reason.clone();
            self.out.events.push(Event::QueueNote(resp.waiting_reason));
        }
        self.queue_reason = resp.wait_reason;
        // Other jobs wait: the next placements pack nodes first (issue 27).
        self.selector.set_others_wait(resp.others_waiting);
        let estimate = resp.start_estimate.map(|e| *e);
        if estimate != self.start_estimate {
            self.start_estimate = estimate.clone();
            self.out.events.push(Event::StartEstimate(estimate));
        }
        if resp.command == Some(AmCommand::Shutdown) {
            self.kill("the application was killed at the RM");
        }
    }

    /// Checks a granted container against its ask and takes it, or gives it back.
    pub(super) fn accept_container(&mut self, c: Container) {
        let Some(ti) = self.by_request.remove(&c.request_id) else {
            tracing::warn!(container = %c.container_id, "container for no outstanding ask; releasing");
            self.releases.push(c.container_id);
            return;
        };
        self.sent_asks.remove(&c.request_id);
        let t = &mut self.tasks[ti];
        let Some(req) = t.request.take() else {
            self.releases.push(c.container_id);
            return;
        };
        let role = &self.job.task_roles[t.role];
        let same = c.host == req.host
            && c.resources.gpu_mask == req.resources.gpu_mask
            && c.resources.gpu_count() == req.resources.gpu_mask.count_ones()
            && c.resources.gpu_shares == req.resources.gpu_shares
            && c.resources.ports == req.resources.ports
            && c.resources.cpu == req.resources.cpu
            && c.resources.memory_mb == req.resources.memory_mb
            && c.resources.custom == req.resources.custom;
        let labelled = assign_port_labels(&role.resources, &c.resources.ports);
        self.selector.remove_requested(&req.host, &req.resources, !same);
        match (same, labelled) {
            (true, Some(ports)) => {
                t.ports = ports;
                t.set_reason(None);
                self.by_container.insert(c.container_id.clone(), ti);
                self.out.events.push(Event::container_at(&c));
                t.container = Some(c);
                t.set_state(TaskState::ContainerAllocated);
            }
            _ => {
                tracing::warn!(container = %c.container_id, host = %c.host, "granted container differs from the ask; releasing");
                t.waits(
                    Kind::Retry,
                    format!(
                        "the RM granted {} on {} instead of what was asked on {}; released",
                        mask_hex(c.resources.gpu_mask),
                        c.host,
                        req.host
                    ),
                );
                self.releases.push(c.container_id);
                t.reset_to_waiting();
            }
        }
    }

    pub(super) fn container_completed(&mut self, c: CompletedContainer, now: Now) {
        let Some(ti) = self.by_container.remove(&c.container_id) else {
            return;
        };
        // A task under a preemption notice was preempted, however it exited.
        if let Some(n) = self.preempt.remove(&c.container_id) {
            let exit = self.classify(exit_status::PREEMPTED, "");
            self.task_exited(
                ti,
                exit,
                format!("preempted: {} (it exited {})", n.reason, c.exit_status),
                now,
            );
            return;
        }
        let exit = self.classify(c.exit_status, &c.diagnostics);
        self.task_exited(ti, exit, c.diagnostics, now);
    }

    /// Takes the RM's preemption notices (see `queueing::Preemptions`).
    fn take_preemptions(&mut self, notices: &[PreemptNotice], now: Now) {
        if notices.is_empty() {
            return;
        }
        let (by_container, tasks) = (&self.by_container, &self.tasks);
        let new = self.preempt.take(notices, now.ms, self.settings.stop_grace_ms, |id| {
            let t = &tasks[*by_container.get(id)?];
            Some(matches!(
                t.state,
                TaskState::ContainerLaunched | TaskState::ContainerRunning
            ))
        });
        for id in new {
            tracing::info!(container = %id, "the RM is taking this container back (preemption)");
        }
        self.release_preempted(now);
    }

    /// Gives back the preempted containers that are due; their tasks wait again.
    pub(super) fn release_preempted(&mut self, now: Now) {
        if self.preempt.is_empty() {
            return;
        }
        for id in self.preempt.due(now.ms) {
            let Some(n) = self.preempt.remove(&id) else { continue };
            let Some(ti) = self.by_container.remove(&id) else {
                continue;
            };
            self.releases.push(id);
            let exit = self.classify(exit_status::PREEMPTED, "");
            self.task_exited(ti, exit, format!("preempted: {}", n.reason), now);
        }
        // A gang loses all its containers together: once none is held, it is gathered
        // again as a whole.
        if self.job.gang && self.gang_launched && !self.tasks.iter().any(|t| t.holds_container()) {
            self.gang_launched = false;
        }
    }
}
