//! Start estimates drawn, not guessed (issue 27, item 4): a start is an early order
//! statistic of many ends (the first few to free the room), so a walk over each end's point
//! guess (its median) is early or late by the ends' spread. Instead an estimate walks the
//! queue [`DRAWS`] times, each with every uncertain end drawn from a learned distribution,
//! and takes the median start. This file owns the distribution ([`Survival`]: Kaplan–Meier
//! with the work still running counted as censored, and an exponential tail), the draws
//! ([`hypercube`]: each item's draws cover the strata of (0, 1) once each, seeded, so an
//! estimate is deterministic), the calibrated share of a declared limit still to run
//! ([`share_left`]) and the median of the walks' starts ([`median_start`]). Used by the
//! live RM ([`super::reserved::estimates`]) and the simulator. Pure: no I/O, no clock.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// Draws (walks) per sampled estimate.
pub const DRAWS: usize = 15;

/// A learned duration distribution (issue 27, item 4): Kaplan–Meier over the jobs that ended
/// and, censored at the time they have run so far, the jobs still running (the ended ones
/// alone are the short ones: the long jobs of the same time have not ended yet), with an
/// exponential tail past the last ended duration whose mean is the censored exponential fit
/// (all time run, ended or not, over the jobs that ended).
#[derive(Clone, Debug)]
pub struct Survival {
    /// Ended durations, ascending, distinct, and the survival just after each.
    times: Vec<f64>,
    surv: Vec<f64>,
    tail_mean: f64,
}

impl Survival {
    /// From the `ended` durations and the `running` jobs' times run so far; `None` before any
    /// job ended.
    pub fn learn(ended: &[f64], running: &[f64]) -> Option<Survival> {
        if ended.is_empty() {
            return None;
        }
        // At one time, ends count before censorings: a job censored at t was still at risk at t.
        let mut obs: Vec<(f64, bool)> = ended
            .iter()
            .map(|&d| (d.max(0.0), true))
            .chain(running.iter().map(|&a| (a.max(0.0), false)))
            .collect();
        obs.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
        let mut at_risk = obs.len() as f64;
        let (mut times, mut surv) = (Vec::new(), Vec::new());
        let mut s = 1.0;
        let mut i = 0;
        while i < obs.len() {
            let t = obs[i].0;
            let (mut d, mut c) = (0.0, 0.0);
            while i < obs.len() && obs[i].0 == t {
                if obs[i].1 {
                    d += 1.0;
                } else {
                    c += 1.0;
                }
                i += 1;
            }
            if d > 0.0 {
                s *= 1.0 - d / at_risk;
                times.push(t);
                surv.push(s);
            }
            at_risk -= d + c;
        }
        let exposure: f64 = obs.iter().map(|o| o.0).sum();
        Some(Survival {
            times,
            surv,
            tail_mean: (exposure / ended.len() as f64).max(1.0),
        })
    }

    /// The share of jobs still running after `t` seconds.
    pub fn at(&self, t: f64) -> f64 {
        match self.times.partition_point(|&x| x <= t) {
            0 => 1.0,
            k => self.surv[k - 1],
        }
    }

    /// The remaining seconds of a job that has run `elapsed`, drawn by inversion at `u` in
    /// (0, 1): the first ended duration past `elapsed` where the survival, relative to the
    /// job's own, falls to `u`; past the last one, the exponential tail.
    pub fn residual(&self, elapsed: f64, u: f64) -> f64 {
        let base = self.at(elapsed);
        let u = u.clamp(f64::MIN_POSITIVE, 1.0);
        let target = u * base;
        let k = self.surv.partition_point(|&s| s > target);
        if base > 0.0 {
            if let Some(&t) = self.times.get(k) {
                return (t - elapsed).max(0.0);
            }
        }
        let last = self.times.last().copied().unwrap_or(0.0);
        if elapsed >= last || base <= 0.0 {
            return self.tail_mean * (1.0 / u).ln();
        }
        // Before the last ended duration but below its survival: from there on, the tail.
        let s_last = self.at(last);
        (last - elapsed) + self.tail_mean * (s_last / target).ln()
    }
}

/// For each of `n` items, [`DRAWS`] values in (0, 1), one in each stratum `(k/DRAWS,
/// (k+1)/DRAWS]`, in an order of its own (a Latin hypercube): few walks already span every
/// item's distribution. Deterministic in `seed`.
pub fn hypercube(n: usize, seed: u64) -> Vec<[f64; DRAWS]> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let mut u = [0.0; DRAWS];
            for (k, x) in u.iter_mut().enumerate() {
                *x = (k as f64 + 1.0 - rng.gen::<f64>()) / DRAWS as f64;
            }
            u.shuffle(&mut rng);
            u
        })
        .collect()
}

/// A seed for an item's draws from its id (FNV-1a): stable across passes and restarts, so
/// the same state gives the same estimate.
pub fn seed_of(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The share of its declared limit that work still runs, drawn at `u` from `dist` (learned
/// over the shares that ended work used of its limits), when it has run `elapsed` of it:
/// never past the limit (the RM ends it there).
pub fn share_left(dist: &Survival, elapsed: f64, u: f64) -> f64 {
    let e = elapsed.clamp(0.0, 1.0);
    dist.residual(e, u).min(1.0 - e).max(0.0)
}

/// The median of the walks' starts (`None`: that walk never started it): `None` when at
/// least half never did.
pub fn median_start(starts: &mut [Option<u64>]) -> Option<u64> {
    if starts.is_empty() {
        return None;
    }
    starts.sort_unstable_by_key(|s| s.unwrap_or(u64::MAX));
    starts[starts.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn the_learned_distribution_counts_running_jobs_as_censored() {
        // Ended only: the plain empirical distribution.
        let s = Survival::learn(&[1.0, 2.0, 3.0, 4.0], &[]).unwrap();
        assert!(close(s.at(0.5), 1.0) && close(s.at(2.0), 0.5) && close(s.at(4.0), 0.0));
        assert!(
            close(s.residual(0.0, 0.6), 2.0),
            "the first duration where 60 % still run"
        );
        assert!(close(s.residual(2.5, 0.5), 0.5), "half of those past 2.5 s end at 3");
        assert!(
            close(s.residual(9.0, 0.5), s.tail_mean * 2f64.ln()),
            "outlived them all"
        );
        // Two ended at 1 and 2 s while two have run 5 s: ended alone, the median would be
        // 1.5 s; counting the two still running, half the jobs outlive 2 s.
        let s = Survival::learn(&[1.0, 2.0], &[5.0, 5.0]).unwrap();
        assert!(close(s.at(1.0), 0.75) && close(s.at(2.0), 0.5) && close(s.at(100.0), 0.5));
        assert!(close(s.tail_mean, 13.0 / 2.0), "all time run over the jobs that ended");
        assert!(close(s.residual(0.0, 0.8), 1.0));
        // Below the last ended duration's survival: the tail from there on.
        assert!(close(s.residual(0.0, 0.4), 2.0 + 6.5 * (0.5f64 / 0.4).ln()));
        // A running job past every ended duration: memoryless tail.
        assert!(close(s.residual(5.0, 0.25), 6.5 * 4f64.ln()));
        assert!(Survival::learn(&[], &[5.0]).is_none(), "nothing ended: nothing learned");
    }

    #[test]
    fn a_median_start_is_never_when_half_the_walks_never_start() {
        assert_eq!(median_start(&mut [Some(3), None, Some(1)]), Some(3));
        assert_eq!(median_start(&mut [Some(3), None, None]), None);
        assert_eq!(median_start(&mut []), None);
    }

    #[test]
    fn the_draws_cover_every_stratum_once_and_repeat_with_their_seed() {
        let a = hypercube(3, 7);
        assert_eq!(a, hypercube(3, 7), "deterministic in the seed");
        assert_ne!(a, hypercube(3, 8));
        for u in &a {
            let mut strata: Vec<usize> = u.iter().map(|x| ((x * DRAWS as f64).ceil() as usize) - 1).collect();
            strata.sort_unstable();
            assert_eq!(strata, (0..DRAWS).collect::<Vec<_>>(), "{u:?}");
        }
    }

    proptest! {
        /// A calibrated share still to run lies between none and what is left of the limit.
        #[test]
        fn a_share_left_never_passes_the_limit(
            ended in proptest::collection::vec(0.0f64..1.0, 1..30),
            running in proptest::collection::vec(0.0f64..1.0, 0..30),
            elapsed in -0.5f64..1.5,
            u in 0.0f64..1.0,
        ) {
            let d = Survival::learn(&ended, &running).unwrap();
            let left = share_left(&d, elapsed, u);
            prop_assert!(left >= 0.0 && left <= 1.0 - elapsed.clamp(0.0, 1.0) + 1e-12, "{left}");
        }
    }
}
