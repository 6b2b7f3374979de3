//! Job-level retry (OpenPAI `jobRetryCount`): a failed job is started again from scratch —
//! every task back to waiting, every container given back — up to `jobRetryCount` times.
//! Only OpenPAI protocol v2 jobs carry it; gpuam's own jobs retry per task
//! (`taskRetryCount`, reference/frameworklauncher.md §5). Task-level retries under gang
//! allocation are turned off when the spec is read (OpenPAI ignores `taskRetryCount`
//! there), so the two never stack.
//!
//! State without I/O: the job machine asks [`JobRetry::should_restart`] when the job
//! fails, resets its tasks with [`reset_for_restart`] and gives back what that returns.

use super::tasks::{Outstanding, Task};
use crate::reason::Kind;
use crate::spec::JobSpec;

/// What a restart takes from the tasks: asks to withdraw and containers to give back (the
/// RM stops a released container).
#[derive(Debug, Default)]
pub struct GivenBack {
    pub requests: Vec<Outstanding>,
    pub containers: Vec<String>,
}

/// Puts every task back to waiting for a new container, as at the job's start but with
/// the next attempt number and fresh task-retry counters.
pub fn reset_for_restart(tasks: &mut [Task], why: &str, now: std::time::Instant, now_ms: u64) -> GivenBack {
    let mut back = GivenBack::default();
    for t in tasks {
        if let Some(r) = t.request.take() {
            back.requests.push(r);
        }
        let holds = t.holds_container();
        if let Some(c) = t.container.take() {
            if holds {
                back.containers.push(c.container_id);
            }
        }
        t.succeeded = None;
        t.completed_ms = None;
        t.retry = Default::default();
        t.new_attempt(now, now_ms);
        t.waits(Kind::Retry, format!("job restarted after a failure ({why})"));
    }
    back
}

/// How many whole-job restarts are left.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobRetry {
    max: u32,
    used: u32,
}

impl JobRetry {
    pub fn new(job: &JobSpec) -> Self {
        JobRetry {
            max: job.pai.as_ref().map_or(0, |p| p.job_retry_count),
            used: 0,
        }
    }

    /// The job failed: restart it? Counts the restart when it says yes.
    pub fn should_restart(&mut self) -> bool {
        if self.used < self.max {
            self.used += 1;
            true
        } else {
            false
        }
    }

    /// Restarts done so far (the job attempt is this + 1).
    pub fn used(&self) -> u32 {
        self.used
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::PaiJob;

    #[test]
    fn restarts_exactly_job_retry_count_times() {
        let mut job = JobSpec::default();
        assert!(!JobRetry::new(&job).should_restart(), "native jobs never restart whole");
        job.pai = Some(PaiJob {
            job_retry_count: 2,
            ..Default::default()
        });
        let mut r = JobRetry::new(&job);
        assert!(r.should_restart());
        assert!(r.should_restart());
        assert!(!r.should_restart());
        assert_eq!(r.used(), 2);
    }

    #[test]
    fn a_restart_gives_back_what_tasks_hold_and_resets_them() {
        use crate::am::status::TaskState;
        let container = |id: &str| crate::protocol::Container {
            container_id: id.into(),
            request_id: 1,
            host: "h".into(),
            node_http_address: String::new(),
            node_ip: None,
            resources: Default::default(),
            task: None,
            task_attempt: 1,
        };
        let mut tasks = vec![Task::new(0, 0), Task::new(0, 1), Task::new(0, 2)];
        tasks[0].state = TaskState::ContainerRunning;
        tasks[0].container = Some(container("c0"));
        tasks[1].state = TaskState::TaskCompleted;
        tasks[1].container = Some(container("c1"));
        tasks[1].succeeded = Some(false);
        tasks[2].state = TaskState::ContainerRequested;
        tasks[2].request = Some(Outstanding {
            request_id: 7,
            host: "h".into(),
            resources: Default::default(),
            sent: std::time::Instant::now(),
        });
        let back = reset_for_restart(&mut tasks, "w/1 failed", std::time::Instant::now(), 0);
        assert_eq!(
            back.containers,
            vec!["c0"],
            "a completed task's container is already gone"
        );
        assert_eq!(back.requests.iter().map(|r| r.request_id).collect::<Vec<_>>(), vec![7]);
        for t in &tasks {
            assert_eq!((t.state, t.attempt, t.succeeded), (TaskState::TaskWaiting, 2, None));
            assert!(t.container.is_none() && t.request.is_none());
        }
    }
}
