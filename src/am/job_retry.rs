//! Job-level retry (OpenPAI `jobRetryCount`): a failed job is started again from scratch —
//! every task back to waiting, every container given back — up to `jobRetryCount` times.
//! Only OpenPAI protocol v2 jobs carry it; gpuam's own jobs retry per task
//! (`taskRetryCount`, reference/frameworklauncher.md §5). Task-level retries under gang
//! allocation are turned off when the spec is read (OpenPAI ignores `taskRetryCount`
//! there), so the two never stack.
//!
//! State without I/O: the control loop asks [`JobRetry::should_restart`] when the job
//! fails and performs the restart itself.

use crate::spec::JobSpec;

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
}
