//! The job machine's task endings: an exit classified and judged by the retry policy (a new
//! attempt, or the task completed), the completion policy's verdict on the job, and the
//! job's restart (`jobRetryCount`).

use super::{Event, JobEnd, JobMachine, Now};
use crate::am::exits::{
    check_completion, decide_retry, retry_delay, ExitInfo, JobVerdict, RetryDecision, RetrySpacing, RoleTally,
};
use crate::am::status::{ExitType, JobState, TaskState};
use crate::reason::Kind;

impl JobMachine {
    pub(super) fn task_exited(&mut self, ti: usize, exit: ExitInfo, diagnostics: String, now: Now) {
        let max_retry = self.job.task_roles[self.tasks[ti].role].task_retry_count;
        let max_transient = self.settings.max_transient_retries;
        let t = &mut self.tasks[ti];
        t.set_state(TaskState::ContainerCompleted);
        let decision = decide_retry(&exit, max_retry, &mut t.retry, max_transient);
        // Retries of a task that keeps failing are spaced (and bounded per minute).
        let delay = match decision {
            RetryDecision::Retry => retry_delay(
                &exit,
                &mut t.retry,
                now.ms,
                &RetrySpacing::from_settings(&self.settings),
            ),
            RetryDecision::Complete => 0,
        };
        let exit_type = exit.exit_type;
        let succeeded = exit_type == ExitType::Succeeded;
        t.exit = Some((exit, diagnostics));
        match decision {
            RetryDecision::Retry => {
                self.out.events.push(Event::Retried(exit_type));
                t.new_attempt(now.at, now.ms);
                t.not_before = (delay > 0).then(|| now.at + std::time::Duration::from_millis(delay));
                t.waits(
                    Kind::Retry,
                    if delay > 0 {
                        format!(
                            "retrying in {:.1} s after the last attempt ended (back-off)",
                            delay as f64 / 1000.0
                        )
                    } else {
                        "retrying after the last attempt ended".into()
                    },
                );
                // The back-off's end is known: until then it is not tried.
                if let Some(r) = t.reason.as_mut().filter(|_| delay > 0) {
                    r.until_ms = Some(now.ms + delay);
                }
            }
            RetryDecision::Complete => {
                t.succeeded = Some(succeeded);
                t.completed_ms = Some(now.ms);
                t.set_state(TaskState::TaskCompleted);
                let role = self.job.task_roles[t.role].name.clone();
                let trigger_task = format!("{role}/{}", t.index);
                let code = t.exit.as_ref().map(|(e, _)| e.code).unwrap_or(1);
                // The node's own word on how the task ended (out of memory, a disk bound, a
                // signal) goes into the job's reason, so history and status say why.
                let how = t
                    .exit
                    .as_ref()
                    .map(|(_, d)| d.lines().next().unwrap_or("").trim())
                    .filter(|d| !d.is_empty())
                    .map(|d| format!(" ({})", d.chars().take(200).collect::<String>()))
                    .unwrap_or_default();
                match check_completion(&self.tallies(), &role, succeeded) {
                    JobVerdict::Running => {}
                    JobVerdict::Succeeded { trigger } => {
                        self.end = Some(JobEnd {
                            state: JobState::Succeeded,
                            exit_code: 0,
                            diagnostics: trigger,
                        })
                    }
                    JobVerdict::Failed { trigger } if self.job_retry.should_restart() => {
                        self.restart_job(&format!("{trigger}; task {trigger_task} exited with {code}{how}"), now);
                    }
                    JobVerdict::Failed { trigger } => {
                        self.end = Some(JobEnd {
                            state: JobState::Failed,
                            exit_code: 1,
                            diagnostics: format!("{trigger}; task {trigger_task} exited with {code}{how}"),
                        })
                    }
                }
            }
        }
    }

    fn tallies(&self) -> Vec<(String, RoleTally)> {
        self.job
            .task_roles
            .iter()
            .enumerate()
            .map(|(ri, r)| {
                let mut t = RoleTally {
                    instances: r.instances,
                    min_failed: r.completion.min_failed_instances,
                    min_succeeded: r.completion.min_succeeded_instances,
                    ..Default::default()
                };
                for task in self.tasks.iter().filter(|x| x.role == ri) {
                    match task.succeeded {
                        Some(true) => t.succeeded += 1,
                        Some(false) => t.failed += 1,
                        None => {}
                    }
                }
                (r.name.clone(), t)
            })
            .collect()
    }

    /// `jobRetryCount`: the failed job starts again (see `job_retry::reset_for_restart`).
    fn restart_job(&mut self, why: &str, now: Now) {
        tracing::warn!(
            retry = self.job_retry.used(),
            "job failed ({why}); restarting it (jobRetryCount)"
        );
        let back = crate::am::job_retry::reset_for_restart(&mut self.tasks, why, now.at, now.ms);
        for r in back.requests {
            self.cancels.push(r.request_id);
            self.by_request.remove(&r.request_id);
            self.selector.remove_requested(&r.host, &r.resources, false);
        }
        for c in back.containers {
            self.by_container.remove(&c);
            self.releases.push(c);
        }
        self.gang_launched = false;
        self.gang_wait_since = None;
    }
}
