//! The AM's one back-off scheme: every wait the AM takes before trying again is drawn here —
//! a role that found no place, a gang held back or timed out (the job machine's task waits),
//! and an RM that does not answer (the driver's retries of the heartbeat, the node listing,
//! registering and finishing). Jittered so that many AMs do not retry in step; seeded so a
//! plan (and a test) draws the same waits every time.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The first retry after the RM failed to answer, and the longest.
const RM_RETRY_FIRST_MS: u64 = 200;
const RM_RETRY_CAP_MS: u64 = 5000;

/// Draws the waits.
#[derive(Debug)]
pub struct Backoff {
    rng: StdRng,
}

impl Backoff {
    pub fn seeded(seed: u64) -> Self {
        Backoff {
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// A wait drawn evenly from `lo_ms..=hi_ms` (`hi_ms` below `lo_ms` counts as `lo_ms`).
    pub fn between(&mut self, lo_ms: u64, hi_ms: u64) -> Duration {
        Duration::from_millis(self.rng.gen_range(lo_ms..=hi_ms.max(lo_ms)))
    }

    /// `base_ms` and up to half of it again.
    pub fn jittered(&mut self, base_ms: u64) -> Duration {
        let jitter = self.rng.gen_range(0..=base_ms / 2);
        Duration::from_millis(base_ms + jitter)
    }

    /// The wait before calling the RM again once it has not answered for `down_for`: it grows
    /// with the outage (a quarter of it, from 200 ms) up to 5 s, jittered.
    pub fn rm_retry(&mut self, down_for: Duration) -> Duration {
        let base = (RM_RETRY_FIRST_MS + down_for.as_millis() as u64 / 4).min(RM_RETRY_CAP_MS);
        self.jittered(base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_stay_in_their_bounds_and_repeat_with_the_seed() {
        let (mut a, mut b) = (Backoff::seeded(3), Backoff::seeded(3));
        for _ in 0..100 {
            let w = a.between(100, 300);
            assert!((100..=300).contains(&(w.as_millis() as u64)));
            assert_eq!(w, b.between(100, 300));
        }
        assert_eq!(a.between(50, 10), Duration::from_millis(50));
        let first = a.rm_retry(Duration::ZERO).as_millis() as u64;
        assert!((200..=300).contains(&first), "{first}");
        let late = a.rm_retry(Duration::from_secs(600)).as_millis() as u64;
        assert!((5000..=7500).contains(&late), "capped: {late}");
    }
}
