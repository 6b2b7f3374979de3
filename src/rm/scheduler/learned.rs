//! Learned run times (issue 27, item 4): how long a task or job with no declared limit is
//! expected to run, from the run times of comparable ones — the one rule the live RM
//! (`scheduling::learn_ends`: the same job's tasks of the same role) and the policy
//! simulator (`sim::reserve::Durations`: earlier jobs of the same GPU count) both use.
//! Pure: the run times and the time already run are passed in.
//!
//! Two corrections to "the median of the completed ones" (which the replay showed is early
//! for 83 % of the starts it estimates, docs/BENCHMARKS.md item 4):
//!
//! - *Censoring.* At any time the completed runs are the short ones: a long run is still
//!   running. So the run times are estimated as a survival function by Kaplan–Meier over
//!   the completed runs (ended) and the comparable ones still running (censored at the time
//!   they have run so far), not from the completed ones alone.
//! - *Residual life.* A job that has already run `t` is expected to run to the median of
//!   that distribution given that it exceeds `t` (S(x) ≤ S(t) / 2), not to the plain median,
//!   which a job that outlived it has already disproved. A job not yet started gets the
//!   plain median. Where the observations end before that median, the job is expected to
//!   run twice the longest of its run so far and the longest observation (the median of a
//!   tail falling off as 1/t: nothing observed says more).
//!
//! So the expected end never lies before now, and with every completed run time equal and
//! nothing longer running, a job that has not reached it is expected to end exactly at it.

/// A survival function of run times (Kaplan–Meier) from completed runs and censored ones.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Survival {
    /// Distinct completed run times, ascending, and S(x) = P(T > x) just after each.
    times: Vec<u64>,
    surv: Vec<f64>,
    /// The longest observation, completed or still running.
    longest: u64,
}

impl Survival {
    /// From the completed run times `ended` (ascending) and the times the comparable runs
    /// still running have run so far (`running`, any order; censored observations).
    pub fn new(ended: &[u64], running: &[u64]) -> Survival {
        let mut cens = running.to_vec();
        cens.sort_unstable();
        let mut times = Vec::new();
        let mut surv = Vec::new();
        let mut s = 1.0;
        let mut i = 0;
        let mut c = 0;
        while i < ended.len() {
            let d = ended[i];
            let mut deaths = 0usize;
            while i < ended.len() && ended[i] == d {
                deaths += 1;
                i += 1;
            }
            // Censored before d left the risk set; those at d are still at risk.
            while c < cens.len() && cens[c] < d {
                c += 1;
            }
            let at_risk = (ended.len() - i + deaths) + (cens.len() - c);
            s *= 1.0 - deaths as f64 / at_risk as f64;
            times.push(d);
            surv.push(s);
        }
        let longest = ended
            .last()
            .copied()
            .unwrap_or(0)
            .max(cens.last().copied().unwrap_or(0));
        Survival { times, surv, longest }
    }

    /// Nothing completed: nothing is known.
    pub fn is_empty(&self) -> bool {
        self.times.is_empty()
    }

    /// S(x) = P(T > x).
    fn at(&self, x: u64) -> f64 {
        match self.times.partition_point(|&t| t <= x) {
            0 => 1.0,
            k => self.surv[k - 1],
        }
    }

    /// The run time a job that has run `ran` so far is expected to reach: the median of the
    /// run time given that it exceeds `ran` (see the module); always greater than `ran`.
    /// `None` when nothing completed.
    pub fn expected_total(&self, ran: u64) -> Option<u64> {
        if self.is_empty() {
            return None;
        }
        let target = self.at(ran) * 0.5;
        let from = self.times.partition_point(|&t| t <= ran);
        // S is non-increasing: the first time after `ran` where it reaches the target.
        let k = from + self.surv[from..].partition_point(|&s| s > target + 1e-12);
        let total = match self.times.get(k) {
            Some(&t) => t,
            None => ran.max(self.longest).saturating_mul(2),
        };
        Some(total.max(ran.saturating_add(1)))
    }

    /// The expected end of a job that started at `start` and is seen at `now`: `start` +
    /// [`Self::expected_total`] of the time it has run; after `now` and `start`.
    pub fn expected_end(&self, start: u64, now: u64) -> Option<u64> {
        self.expected_total(now.saturating_sub(start))
            .map(|t| start.saturating_add(t))
    }
}

/// Inserts `x` into the ascending `sorted`, keeping it sorted.
pub fn insert_sorted(sorted: &mut Vec<u64>, x: u64) {
    let i = sorted.partition_point(|&y| y <= x);
    sorted.insert(i, x);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_job_that_outlived_the_median_is_expected_at_the_median_of_the_longer_runs() {
        let s = Survival::new(&[10, 20, 30, 400, 500], &[]);
        // Not started, or below every run: the plain median.
        assert_eq!(s.expected_total(0), Some(30));
        assert_eq!(s.expected_total(9), Some(30));
        // Past 30: only 400 and 500 remain possible; their (lower) median.
        assert_eq!(s.expected_total(30), Some(400));
        assert_eq!(s.expected_total(399), Some(400));
        // Past 400: 500.
        assert_eq!(s.expected_total(450), Some(500));
        // Outlived them all: as long again as it has run.
        assert_eq!(s.expected_total(500), Some(1000));
        assert_eq!(s.expected_total(800), Some(1600));
        // Nothing completed: unknown, even with runs going on.
        assert_eq!(Survival::new(&[], &[5, 9]).expected_total(5), None);
        // Ends are from the start, and after now.
        assert_eq!(s.expected_end(1000, 1000), Some(1030));
        assert_eq!(s.expected_end(1000, 1040), Some(1400));
        assert_eq!(s.expected_end(1000, 1600), Some(2200));
        assert_eq!(
            s.expected_end(1000, 900),
            Some(1030),
            "a start after now: from the start"
        );
        let mut v = vec![];
        for x in [5, 1, 3, 3, 2] {
            insert_sorted(&mut v, x);
        }
        assert_eq!(v, vec![1, 2, 3, 3, 5]);
    }

    #[test]
    fn runs_still_going_lengthen_what_the_completed_ones_say() {
        // Completed: 10, 20, 30. Alone, the median is 20.
        assert_eq!(Survival::new(&[10, 20, 30], &[]).expected_total(0), Some(20));
        // Three more have already run 100 and go on: of six, only the 10 has ended by
        // 10 and the 20 by 20 (S = 5/6, then 5/6 · 4/5 = 2/3), 30 (S = 2/3 · 3/4 = 1/2):
        // the median is 30.
        let s = Survival::new(&[10, 20, 30], &[100, 100, 100]);
        assert_eq!(s.expected_total(0), Some(30));
        // Past every completed run, with S still 1/2: twice the longest observation.
        assert_eq!(s.expected_total(40), Some(200));
        assert_eq!(s.expected_total(150), Some(300));
        // A censored run shorter than a death leaves the risk set before it.
        let s = Survival::new(&[10, 20], &[5]);
        assert_eq!(s.at(10), 0.5);
        assert_eq!(s.at(20), 0.0);
    }

    proptest! {
        /// The expected end never lies at or before now, and running longer never makes a
        /// job expected sooner; the total is a completed run time unless the job has
        /// outlived where they reach the median.
        #[test]
        fn the_expected_end_is_after_now_and_moves_only_later(
            mut ended in proptest::collection::vec(0u64..100_000, 1..40),
            running in proptest::collection::vec(0u64..150_000, 0..20),
            start in 0u64..1_000_000,
            a in 0u64..200_000,
            b in 0u64..200_000,
        ) {
            ended.sort_unstable();
            let s = Survival::new(&ended, &running);
            let (a, b) = (a.min(b), a.max(b));
            let ea = s.expected_end(start, start + a).unwrap();
            let eb = s.expected_end(start, start + b).unwrap();
            prop_assert!(ea > start + a);
            prop_assert!(eb > start + b);
            prop_assert!(eb >= ea, "ran {a} → {ea}, ran {b} → {eb}");
            let t = s.expected_total(a).unwrap();
            prop_assert!(ended.contains(&t) || t >= 2 * a.max(*ended.last().unwrap()));
            // The survival function is a distribution's: from 1 down, never below 0.
            let mut last = 1.0;
            for &x in &ended {
                let v = s.at(x);
                prop_assert!((0.0..=last).contains(&v));
                last = v;
            }
        }

        /// With every completed run time equal (and nothing longer running), a job that has
        /// not reached it is expected to end exactly at it.
        #[test]
        fn equal_run_times_give_the_exact_end(
            d in 1u64..1_000_000,
            n in 1usize..20,
            start in 0u64..1_000_000,
            frac in 0.0f64..1.0,
        ) {
            let ran = ((d as f64) * frac) as u64 % d;
            let s = Survival::new(&vec![d; n], &[ran]);
            prop_assert_eq!(s.expected_end(start, start + ran), Some(start + d));
        }
    }
}
