//! Exit classification, the task retry policy and the per-role completion policy
//! (reference/frameworklauncher.md §5.2–§5.4), as pure functions.

use super::status::ExitType;
use crate::config::AmSettings;
use crate::protocol::{exit_status as yarn, AbortCause, EndCause};

/// Launcher codes for container exits that the RM, not the task, caused (§5.4).
pub mod code {
    pub const CONTAINER_INVALID_EXIT_STATUS: i32 = -7100;
    pub const CONTAINER_NODE_DISKS_FAILED: i32 = -7102;
    pub const CONTAINER_ABORTED: i32 = -7110;
    pub const CONTAINER_NODE_LOST: i32 = -7111;
    pub const CONTAINER_EXPIRED: i32 = -7112;
    pub const CONTAINER_PREEMPTED: i32 = -7120;
    pub const CONTAINER_KILLED_BY_AM: i32 = -7123;
    pub const CONTAINER_KILLED_BY_RM: i32 = -7124;
    pub const CONTAINER_KILLED_ON_APP_COMPLETION: i32 = -7125;
    pub const CONTAINER_NM_LAUNCH_FAILED: i32 = -7150;
    pub const CONTAINER_RM_RESYNC_LOST: i32 = -7151;
}

/// How an exit is classified.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExitInfo {
    /// The launcher code (YARN statuses mapped to -71xx), or the process's own code.
    pub code: i32,
    pub exit_type: ExitType,
    pub description: &'static str,
}

/// Classifies a raw container exit status with its diagnostics. The causes are typed
/// ([`AbortCause`] from the RM, [`EndCause`] from the node), read back from the
/// diagnostics where they are spelled, in `protocol`.
pub fn classify(raw: i32, diagnostics: &str, settings: &AmSettings) -> ExitInfo {
    use ExitType::*;
    let cause = AbortCause::of(diagnostics);
    let end = EndCause::of(diagnostics);
    let info = |code, exit_type, description| ExitInfo {
        code,
        exit_type,
        description,
    };
    match raw {
        0 => info(0, Succeeded, "succeeded"),
        // Past its declared `maxRunSec` (the RM ended it, issue 27): the task's failure,
        // counted against `taskRetryCount` like the node's bounds below, never a
        // transient end retried for free.
        yarn::KILLED_BY_RESOURCEMANAGER if matches!(end, Some(EndCause::RunLimit { .. })) => info(
            code::CONTAINER_KILLED_BY_RM,
            Unknown,
            "ran past its declared limit (maxRunSec)",
        ),
        yarn::INVALID => info(
            code::CONTAINER_INVALID_EXIT_STATUS,
            TransientNormal,
            "invalid exit status",
        ),
        yarn::DISKS_FAILED => info(code::CONTAINER_NODE_DISKS_FAILED, TransientNormal, "node disks failed"),
        yarn::ABORTED if cause == Some(AbortCause::NodeLost) => {
            info(code::CONTAINER_NODE_LOST, TransientNormal, "node lost")
        }
        yarn::ABORTED if cause == Some(AbortCause::Expired) => {
            info(code::CONTAINER_EXPIRED, TransientConflict, "container expired unused")
        }
        yarn::ABORTED => info(code::CONTAINER_ABORTED, TransientNormal, "container aborted"),
        yarn::PREEMPTED => info(code::CONTAINER_PREEMPTED, TransientNormal, "preempted"),
        yarn::KILLED_BY_APPMASTER => info(code::CONTAINER_KILLED_BY_AM, TransientNormal, "killed by the AM"),
        yarn::KILLED_BY_RESOURCEMANAGER => info(code::CONTAINER_KILLED_BY_RM, TransientNormal, "killed by the RM"),
        yarn::KILLED_AFTER_APP_COMPLETION => info(
            code::CONTAINER_KILLED_ON_APP_COMPLETION,
            TransientNormal,
            "stopped on job completion",
        ),
        code::CONTAINER_NM_LAUNCH_FAILED => info(raw, TransientNormal, "launch failed"),
        code::CONTAINER_RM_RESYNC_LOST => info(raw, TransientNormal, "container lost"),
        // A bound of its own container the task went past: its failure, counted against
        // `taskRetryCount` (the node words these, see node::bounds).
        c if matches!(end, Some(EndCause::OutOfMemory { .. })) => info(c, Unknown, "out of memory"),
        c if matches!(end, Some(EndCause::DiskLimit { .. })) => info(c, Unknown, "disk limit exceeded"),
        c if settings.transient_exit_codes.contains(&c) => info(c, TransientNormal, "user-configured transient"),
        c if settings.permanent_exit_codes.contains(&c) => info(c, NonTransient, "user-configured permanent"),
        154 | 193 => info(raw, TransientNormal, "transient failure"),
        130 => info(raw, TransientNormal, "interrupted (SIGINT)"),
        137 => info(raw, TransientNormal, "killed (SIGKILL)"),
        143 => info(raw, TransientNormal, "terminated (SIGTERM)"),
        132 => info(raw, NonTransient, "illegal instruction (SIGILL)"),
        134 => info(raw, Unknown, "aborted (SIGABRT)"),
        135 => info(raw, NonTransient, "bus error (SIGBUS)"),
        136 => info(raw, NonTransient, "floating-point exception (SIGFPE)"),
        139 => info(raw, NonTransient, "segmentation fault (SIGSEGV)"),
        141 => info(raw, NonTransient, "broken pipe (SIGPIPE)"),
        194 => info(raw, NonTransient, "permanent failure"),
        c if c < 0 => info(c, Unknown, "issued by the RM"),
        c => info(c, Unknown, "exited with an error"),
    }
}

/// A task's retry counters (frameworklauncher's RetryPolicyState).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetryState {
    /// Retries counted against `taskRetryCount`.
    pub retried: u32,
    /// Transient retries (not counted against `taskRetryCount`, capped separately).
    pub transient_retried: u32,
    /// Preemptions (the RM took the container back for another job): always retried,
    /// never counted against either limit — the task did nothing wrong.
    pub preempted: u32,
    /// Failed attempts since the last success (the back-off's exponent).
    pub failures_in_a_row: u32,
    /// When (ms) the last retries began, newest last, within [`RetrySpacing::window_ms`].
    pub recent_ms: Vec<u64>,
}

/// How retries are spaced (`am.retry_backoff_*`, `am.max_attempts_per_window`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetrySpacing {
    /// Delay before the second retry in a row of failures (the first is immediate); it
    /// doubles with each further failure.
    pub base_ms: u64,
    /// Most delay between two attempts.
    pub max_ms: u64,
    /// At most `max_attempts` retries of one task start within any `window_ms`.
    pub window_ms: u64,
    pub max_attempts: u32,
}

impl RetrySpacing {
    pub fn from_settings(s: &AmSettings) -> RetrySpacing {
        RetrySpacing {
            base_ms: s.retry_backoff_ms,
            max_ms: s.retry_backoff_max_ms,
            window_ms: 60_000,
            max_attempts: s.max_retries_per_minute,
        }
    }
}

/// How long a task waits before the retry [`decide_retry`] just granted (called once per
/// retry, at `now_ms`): none after a preemption or a transient exit (not the task's doing,
/// and capped by `am.max_transient_retries`), nor after a success (`taskRetryCount: -2`) or
/// the first failure; then `base_ms`, doubling per failure in a row up to `max_ms`; and
/// never sooner than the window allows (at most `max_attempts` retries begin in any
/// `window_ms`). Records the retry's start in `state`.
pub fn retry_delay(exit: &ExitInfo, state: &mut RetryState, now_ms: u64, b: &RetrySpacing) -> u64 {
    let transient = matches!(exit.exit_type, ExitType::TransientNormal | ExitType::TransientConflict);
    if exit.code == code::CONTAINER_PREEMPTED || transient {
        // Not the task's doing (and capped by `max_transient_retries`): at once.
        return 0;
    }
    let failed = exit.exit_type != ExitType::Succeeded;
    state.failures_in_a_row = if failed {
        state.failures_in_a_row.saturating_add(1)
    } else {
        0
    };
    let backoff = match state.failures_in_a_row {
        0 | 1 => 0,
        n => b.base_ms.saturating_mul(1u64 << (n - 2).min(30)).min(b.max_ms),
    };
    state.recent_ms.retain(|t| now_ms.saturating_sub(*t) < b.window_ms);
    let full = state.recent_ms.len() >= b.max_attempts.max(1) as usize;
    let window = if full {
        // The oldest retry in the window must leave it first.
        (state.recent_ms[state.recent_ms.len() - b.max_attempts.max(1) as usize] + b.window_ms).saturating_sub(now_ms)
    } else {
        0
    };
    let delay = backoff.max(window);
    state.recent_ms.push(now_ms + delay);
    delay
}

/// What to do after a container ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryDecision {
    Retry,
    Complete,
}

/// The retry policy: a preempted task always retries, using up nothing; transient exits
/// retry without using up `taskRetryCount` (up to `max_transient`), permanent ones never retry, success and unknown follow
/// `taskRetryCount` (−1 = unlimited for failures, −2 = always, even after success).
pub fn decide_retry(exit: &ExitInfo, max_retry: i32, state: &mut RetryState, max_transient: u32) -> RetryDecision {
    if exit.code == code::CONTAINER_PREEMPTED {
        state.preempted += 1;
        return RetryDecision::Retry;
    }
    match exit.exit_type {
        ExitType::TransientNormal | ExitType::TransientConflict => {
            if state.transient_retried < max_transient {
                state.transient_retried += 1;
                return RetryDecision::Retry;
            }
        }
        ExitType::NonTransient => return RetryDecision::Complete,
        ExitType::Succeeded | ExitType::Unknown => {}
    }
    let succeeded = exit.exit_type == ExitType::Succeeded;
    let retry = max_retry == -2 || (!succeeded && (max_retry == -1 || (state.retried as i64) < i64::from(max_retry)));
    if retry {
        state.retried += 1;
        RetryDecision::Retry
    } else {
        RetryDecision::Complete
    }
}

/// Outcome of the completion check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobVerdict {
    Running,
    Succeeded { trigger: String },
    Failed { trigger: String },
}

/// Counts of one role's completed tasks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoleTally {
    pub instances: u32,
    pub succeeded: u32,
    pub failed: u32,
    pub min_failed: Option<u32>,
    pub min_succeeded: Option<u32>,
}

/// The completion policy, checked after a task of `role` completed with `succeeded`.
/// (1) enough failures of the role fail the job; (2) enough successes of the role
/// succeed it; (3) when every task of every role is completed, the job succeeds.
pub fn check_completion(roles: &[(String, RoleTally)], role: &str, succeeded: bool) -> JobVerdict {
    if let Some((_, t)) = roles.iter().find(|(n, _)| n == role) {
        if !succeeded {
            if let Some(m) = t.min_failed {
                if t.failed >= m {
                    return JobVerdict::Failed {
                        trigger: format!(
                            "{} failed tasks reached minFailedInstances {} in task role [{}]",
                            t.failed, m, role
                        ),
                    };
                }
            }
        } else if let Some(m) = t.min_succeeded {
            if t.succeeded >= m {
                return JobVerdict::Succeeded {
                    trigger: format!(
                        "{} succeeded tasks reached minSucceededInstances {} in task role [{}]",
                        t.succeeded, m, role
                    ),
                };
            }
        }
    }
    if roles.iter().all(|(_, t)| t.succeeded + t.failed >= t.instances) {
        return JobVerdict::Succeeded {
            trigger: "all tasks completed".into(),
        };
    }
    JobVerdict::Running
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s() -> AmSettings {
        AmSettings::default()
    }

    #[test]
    fn yarn_statuses_map_to_launcher_codes() {
        let c = classify(-100, AbortCause::NodeLost.diagnostics(), &s());
        assert_eq!(
            (c.code, c.exit_type),
            (code::CONTAINER_NODE_LOST, ExitType::TransientNormal)
        );
        let c = classify(-100, "container EXPIRED since it was unused", &s());
        assert_eq!(
            (c.code, c.exit_type),
            (code::CONTAINER_EXPIRED, ExitType::TransientConflict)
        );
        assert_eq!(classify(-100, "", &s()).code, code::CONTAINER_ABORTED);
        assert_eq!(classify(-102, "", &s()).exit_type, ExitType::TransientNormal);
        assert_eq!(classify(0, "", &s()).exit_type, ExitType::Succeeded);
    }

    #[test]
    fn a_bound_of_its_own_is_the_tasks_failure_not_transient() {
        let oom = classify(137, "out of memory (limit 64 MiB); killed by signal 9 (SIGKILL)", &s());
        assert_eq!(oom.exit_type, ExitType::Unknown);
        assert_eq!(oom.description, "out of memory");
        let mut st = RetryState::default();
        assert_eq!(
            decide_retry(&oom, 0, &mut st, 10),
            RetryDecision::Complete,
            "taskRetryCount 0"
        );
        let disk = classify(137, "disk limit exceeded (16 MiB); killed by signal 9 (SIGKILL)", &s());
        assert_eq!(disk.exit_type, ExitType::Unknown);
        assert_eq!(
            classify(137, "killed by signal 9 (SIGKILL)", &s()).exit_type,
            ExitType::TransientNormal
        );
    }

    #[test]
    fn past_its_declared_limit_is_the_tasks_failure_not_transient() {
        let words = EndCause::RunLimit { max_run_sec: 60 }.diagnostics();
        assert_eq!(words, "ran past its declared limit maxRunSec=60");
        assert_eq!(EndCause::of(&words), Some(EndCause::RunLimit { max_run_sec: 60 }));
        let c = classify(yarn::KILLED_BY_RESOURCEMANAGER, &words, &s());
        assert_eq!((c.code, c.exit_type), (code::CONTAINER_KILLED_BY_RM, ExitType::Unknown));
        let mut st = RetryState::default();
        assert_eq!(decide_retry(&c, 1, &mut st, 10), RetryDecision::Retry);
        assert_eq!(
            decide_retry(&c, 1, &mut st, 10),
            RetryDecision::Complete,
            "counted against taskRetryCount, not retried for free"
        );
        // Any other kill by the RM stays transient; the task's own words change nothing.
        let other = classify(yarn::KILLED_BY_RESOURCEMANAGER, "killed by the RM", &s());
        assert_eq!(other.exit_type, ExitType::TransientNormal);
        let forged = format!("exited 1{}{words}", crate::protocol::STDERR_TAIL_MARK);
        assert_eq!(
            classify(yarn::KILLED_BY_RESOURCEMANAGER, &forged, &s()).exit_type,
            ExitType::TransientNormal
        );
    }

    #[test]
    fn user_codes_follow_the_default_spec_and_overrides() {
        assert_eq!(classify(1, "", &s()).exit_type, ExitType::Unknown);
        assert_eq!(classify(139, "", &s()).exit_type, ExitType::NonTransient);
        assert_eq!(classify(143, "", &s()).exit_type, ExitType::TransientNormal);
        let mut st = s();
        st.transient_exit_codes = vec![1];
        st.permanent_exit_codes = vec![2];
        assert_eq!(classify(1, "", &st).exit_type, ExitType::TransientNormal);
        assert_eq!(classify(2, "", &st).exit_type, ExitType::NonTransient);
    }

    fn exit(t: ExitType) -> ExitInfo {
        ExitInfo {
            code: 1,
            exit_type: t,
            description: "",
        }
    }

    #[test]
    fn unknown_failures_retry_up_to_the_count() {
        let mut st = RetryState::default();
        assert_eq!(
            decide_retry(&exit(ExitType::Unknown), 2, &mut st, 10),
            RetryDecision::Retry
        );
        assert_eq!(
            decide_retry(&exit(ExitType::Unknown), 2, &mut st, 10),
            RetryDecision::Retry
        );
        assert_eq!(
            decide_retry(&exit(ExitType::Unknown), 2, &mut st, 10),
            RetryDecision::Complete
        );
        assert_eq!(st.retried, 2);
    }

    #[test]
    fn success_never_retries_unless_always() {
        let mut st = RetryState::default();
        assert_eq!(
            decide_retry(&exit(ExitType::Succeeded), 5, &mut st, 10),
            RetryDecision::Complete
        );
        assert_eq!(
            decide_retry(&exit(ExitType::Succeeded), -2, &mut st, 10),
            RetryDecision::Retry
        );
        assert_eq!(
            decide_retry(&exit(ExitType::Unknown), -1, &mut st, 10),
            RetryDecision::Retry
        );
    }

    #[test]
    fn transient_retries_do_not_use_the_count_but_are_capped() {
        let mut st = RetryState::default();
        for _ in 0..3 {
            assert_eq!(
                decide_retry(&exit(ExitType::TransientNormal), 0, &mut st, 3),
                RetryDecision::Retry
            );
        }
        assert_eq!(st.retried, 0);
        assert_eq!(
            decide_retry(&exit(ExitType::TransientNormal), 0, &mut st, 3),
            RetryDecision::Complete
        );
        assert_eq!(
            decide_retry(&exit(ExitType::NonTransient), -2, &mut st, 3),
            RetryDecision::Complete
        );
    }

    fn backoff() -> RetrySpacing {
        RetrySpacing {
            base_ms: 1000,
            max_ms: 8000,
            window_ms: 60_000,
            max_attempts: 5,
        }
    }

    #[test]
    fn failures_in_a_row_back_off_exponentially_up_to_the_cap() {
        let mut st = RetryState::default();
        let fail = exit(ExitType::Unknown);
        let b = RetrySpacing {
            max_attempts: 100,
            ..backoff()
        };
        let delays: Vec<u64> = (0..7).map(|i| retry_delay(&fail, &mut st, i * 100_000, &b)).collect();
        assert_eq!(delays, [0, 1000, 2000, 4000, 8000, 8000, 8000]);
        // A success (taskRetryCount -2) starts over; a preemption is never delayed.
        assert_eq!(retry_delay(&exit(ExitType::Succeeded), &mut st, 800_000, &b), 0);
        assert_eq!(retry_delay(&fail, &mut st, 900_000, &b), 0);
        let pre = ExitInfo {
            code: code::CONTAINER_PREEMPTED,
            exit_type: ExitType::TransientNormal,
            description: "",
        };
        assert_eq!(retry_delay(&pre, &mut st, 1_000_000, &b), 0);
    }

    /// `taskRetryCount: -1` with a task that fails at once: never more than `max_attempts`
    /// retries begin in any window, whatever the clock says.
    #[test]
    fn a_retry_storm_is_bounded_per_window() {
        let b = RetrySpacing {
            base_ms: 0,
            ..backoff()
        };
        let mut st = RetryState::default();
        let fail = exit(ExitType::Unknown);
        let mut now = 0u64;
        let mut starts = Vec::new();
        for _ in 0..40 {
            assert_eq!(decide_retry(&fail, -1, &mut st, 10), RetryDecision::Retry);
            let d = retry_delay(&fail, &mut st, now, &b);
            now += d;
            starts.push(now);
            now += 10; // the attempt fails 10 ms after it starts
        }
        for (i, t) in starts.iter().enumerate() {
            let in_window = starts[i..].iter().filter(|s| **s < t + b.window_ms).count();
            assert!(
                in_window <= 5,
                "{in_window} retries within a window from {t}: {starts:?}"
            );
        }
        assert!(
            now >= 7 * b.window_ms,
            "40 retries at 5 per minute take at least 7 minutes"
        );
    }

    fn tally(
        instances: u32,
        succeeded: u32,
        failed: u32,
        min_failed: Option<u32>,
        min_succeeded: Option<u32>,
    ) -> RoleTally {
        RoleTally {
            instances,
            succeeded,
            failed,
            min_failed,
            min_succeeded,
        }
    }

    #[test]
    fn completion_policy_rules_in_order() {
        // Default: the first failure fails the job.
        let roles = vec![("w".to_string(), tally(4, 1, 1, Some(1), None))];
        assert!(matches!(
            check_completion(&roles, "w", false),
            JobVerdict::Failed { .. }
        ));
        // PS never ends; workers' minSucceeded completes the job.
        let roles = vec![
            ("ps".to_string(), tally(1, 0, 0, Some(1), None)),
            ("w".to_string(), tally(2, 2, 0, Some(1), Some(2))),
        ];
        assert!(matches!(
            check_completion(&roles, "w", true),
            JobVerdict::Succeeded { .. }
        ));
        // Failures below the threshold: done when everything is done.
        let roles = vec![("w".to_string(), tally(2, 1, 1, None, None))];
        assert!(matches!(
            check_completion(&roles, "w", false),
            JobVerdict::Succeeded { .. }
        ));
        let roles = vec![("w".to_string(), tally(3, 1, 1, None, None))];
        assert_eq!(check_completion(&roles, "w", true), JobVerdict::Running);
    }
}
