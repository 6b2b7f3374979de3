//! Reservations and backfill (issue 27, item 3), without I/O and with time passed in. A
//! waiting gang that has waited past a bound, or that is large, gets one reservation: the
//! nodes where it will fit first as the running containers drain, in the order of their
//! expected ends, and that time (the reservation's start). Until it starts, other work may
//! take free room only if it will end by the start, or if the gang still fits at the start
//! beside it (backfill, as EASY backfilling does in batch schedulers).
//!
//! GPUs, CPU and memory are counted per node ([`Room`]); which nodes a task may use at all
//! is the caller's business (it passes an ineligible node with no room and none of its
//! releases). A container with no expected end (no declared or learned limit) is never
//! counted as released, so a reservation only relies on ends it knows.

/// What one node has free (or one task or container takes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Room {
    pub gpus: u32,
    pub cpu: u32,
    pub memory_mb: u64,
}

impl Room {
    pub(super) fn holds(&self, t: &Room) -> bool {
        self.gpus >= t.gpus && self.cpu >= t.cpu && self.memory_mb >= t.memory_mb
    }

    fn take(&mut self, t: &Room) {
        self.gpus = self.gpus.saturating_sub(t.gpus);
        self.cpu = self.cpu.saturating_sub(t.cpu);
        self.memory_mb = self.memory_mb.saturating_sub(t.memory_mb);
    }

    fn give(&mut self, t: &Room) {
        self.gpus = self.gpus.saturating_add(t.gpus);
        self.cpu = self.cpu.saturating_add(t.cpu);
        self.memory_mb = self.memory_mb.saturating_add(t.memory_mb);
    }
}

/// A running container: where, what it holds, and when it is expected to end (ms; `None`
/// when nothing bounds it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Release {
    pub node: usize,
    pub room: Room,
    pub end_ms: Option<u64>,
}

/// Which waiting gangs get a reservation: those that waited at least `wait_bound_ms`, or
/// that ask for at least `min_gpus` GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    pub wait_bound_ms: u64,
    pub min_gpus: u32,
}

impl Policy {
    pub fn applies(&self, waited_ms: u64, gpus: u32) -> bool {
        waited_ms >= self.wait_bound_ms || gpus >= self.min_gpus
    }
}

/// One gang's reservation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// When it is expected to fit (ms; `now` when it fits already).
    pub start_ms: u64,
    /// The nodes it is expected to take at the start, one per task.
    pub nodes: Vec<usize>,
    /// Its tasks.
    tasks: Vec<Room>,
    /// Each node's room expected at the start, less what backfilled work keeps past it.
    at_start: Vec<Room>,
}

/// Packs `tasks` into `room` (largest first, each on the fitting node with the fewest free
/// GPUs, so big holes stay whole); the node of each task, in `tasks` order.
pub(super) fn pack(room: &[Room], tasks: &[Room]) -> Option<Vec<usize>> {
    let mut room = room.to_vec();
    let mut order: Vec<usize> = (0..tasks.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse((tasks[i].gpus, tasks[i].cpu, tasks[i].memory_mb)));
    let mut at = vec![0; tasks.len()];
    for i in order {
        let n = (0..room.len())
            .filter(|&n| room[n].holds(&tasks[i]))
            .min_by_key(|&n| (room[n].gpus, n))?;
        room[n].take(&tasks[i]);
        at[i] = n;
    }
    Some(at)
}

/// The expected end of work that started at `start` and is expected to take `expected`,
/// seen at `now` (one clock, any unit; at least one unit long): work still running past its
/// expectation is expected to take twice as long again (doubling until the end lies after
/// `now`), so a wrong guess never says "it ends now" again and again. The RM's learned ends
/// (ms) and the simulator's (s) both follow it.
pub fn expected_end(start: f64, expected: f64, now: f64) -> f64 {
    let mut e = expected.max(1.0);
    while start + e <= now {
        e *= 2.0;
    }
    start + e
}

/// Finished runs that must have declared a limit before their use of it calibrates others
/// ([`calibration`]): fewer say too little of a user's habit.
pub const MIN_CALIBRATION: usize = 5;

/// What finished runs used of their declared limits (issue 27, item 4): the median of their
/// run / limit ratios, within (0, 1] (the RM ends a run at its limit); `None` with fewer than
/// [`MIN_CALIBRATION`] of them. Users declare limits well past their runs (a 2-hour limit for
/// a 50-minute job); taking the limit as the end puts every estimate late by that margin,
/// and the same user's earlier runs tell it.
pub fn calibration(used: &mut [f64]) -> Option<f64> {
    if used.len() < MIN_CALIBRATION {
        return None;
    }
    used.sort_unstable_by(f64::total_cmp);
    let m = used[(used.len() - 1) / 2];
    (m.is_finite() && m > 0.0).then(|| m.min(1.0))
}

/// The expected end of work that started at `start` with a declared `limit`, calibrated by
/// `ratio` ([`calibration`]), seen at `now` (one clock, any unit): `start + limit × ratio`;
/// once `now` is past that, halfway from `now` to the limit (it ends by the limit, and has
/// outlived its users' habit); at the limit, `now` (the RM is ending it).
pub fn calibrated_end(start: f64, limit: f64, ratio: f64, now: f64) -> f64 {
    let hard = start + limit.max(0.0);
    if hard <= now {
        return now;
    }
    let e = start + limit * ratio.clamp(0.0, 1.0);
    if e > now {
        e
    } else {
        now + (hard - now) / 2.0
    }
}

/// The earliest time `tasks` (a gang: all or none) fit as `releases` end, from the room
/// `free` now; `None` when they never fit on what is known to end.
pub fn reserve(free: &[Room], releases: &[Release], tasks: &[Room], now_ms: u64) -> Option<Reservation> {
    let mut room = free.to_vec();
    let mut ends: Vec<&Release> = releases
        .iter()
        .filter(|r| r.end_ms.is_some() && r.node < room.len())
        .collect();
    ends.sort_by_key(|r| r.end_ms);
    let mut t = now_ms;
    let mut i = 0;
    loop {
        // Everything that ends by `t` is free at `t`.
        while i < ends.len() && ends[i].end_ms.unwrap_or(u64::MAX) <= t {
            room[ends[i].node].give(&ends[i].room);
            i += 1;
        }
        if let Some(nodes) = pack(&room, tasks) {
            return Some(Reservation {
                start_ms: t,
                nodes,
                tasks: tasks.to_vec(),
                at_start: room,
            });
        }
        t = ends.get(i)?.end_ms?;
    }
}

impl Reservation {
    /// May work that takes `takes` (node, room per task, out of the room free now) and is
    /// expected to end at `end_ms` start now? Yes when it ends by the start, or when the
    /// gang still fits at the start beside it; then its room is booked past the start.
    /// `None` for the end (no limit known) counts as never ending.
    pub fn backfill(&mut self, takes: &[(usize, Room)], end_ms: Option<u64>) -> bool {
        if end_ms.is_some_and(|e| e <= self.start_ms) {
            return true;
        }
        let mut trial = self.at_start.clone();
        for (n, r) in takes {
            match trial.get_mut(*n) {
                Some(room) => room.take(r),
                None => return false,
            }
        }
        match pack(&trial, &self.tasks) {
            Some(nodes) => {
                self.at_start = trial;
                self.nodes = nodes;
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A task or room of `gpus` GPUs (one core and 1 GiB each); also `sim::reserve`'s tests.
    pub(crate) fn g(gpus: u32) -> Room {
        Room {
            gpus,
            cpu: gpus,
            memory_mb: 1024 * u64::from(gpus),
        }
    }

    #[test]
    fn work_past_its_expected_end_is_expected_to_take_twice_as_long_again() {
        assert_eq!(expected_end(10.0, 100.0, 50.0), 110.0);
        assert_eq!(expected_end(10.0, 100.0, 110.0), 210.0);
        assert_eq!(expected_end(10.0, 100.0, 500.0), 810.0);
        assert_eq!(expected_end(10.0, 0.0, 10.5), 11.0, "at least one unit");
        // In ms since the epoch, as the RM calls it: exact in f64.
        let (start, now) = (1_790_000_000_000u64, 1_790_000_250_000u64);
        assert_eq!(
            expected_end(start as f64, 100_000.0, now as f64) as u64,
            start + 400_000
        );
    }

    #[test]
    fn a_declared_limit_is_calibrated_by_what_finished_runs_used_of_theirs() {
        // Too few runs say nothing; the median of those there are; never past the limit.
        assert_eq!(calibration(&mut [0.5; MIN_CALIBRATION - 1]), None);
        assert_eq!(calibration(&mut [0.9, 0.2, 0.5, 0.4, 0.6]), Some(0.5));
        assert_eq!(calibration(&mut [1.5; MIN_CALIBRATION]), Some(1.0));
        assert_eq!(calibration(&mut [0.0; MIN_CALIBRATION]), None, "no run of length 0");
        assert_eq!(calibration(&mut [f64::NAN; MIN_CALIBRATION]), None);
        // Started at 100 with a limit of 1000, users use half of theirs: ends at 600.
        assert_eq!(calibrated_end(100.0, 1000.0, 0.5, 200.0), 600.0);
        // Outlived the habit: halfway from now to the limit, never past it.
        assert_eq!(calibrated_end(100.0, 1000.0, 0.5, 700.0), 900.0);
        assert_eq!(calibrated_end(100.0, 1000.0, 0.5, 1099.0), 1099.5);
        // At or past its limit the RM is ending it.
        assert_eq!(calibrated_end(100.0, 1000.0, 0.5, 1100.0), 1100.0);
        assert_eq!(calibrated_end(100.0, 1000.0, 0.5, 5000.0), 5000.0);
        // Uncalibrated (ratio 1) is the limit itself.
        assert_eq!(calibrated_end(100.0, 1000.0, 1.0, 200.0), 1100.0);
    }

    proptest::proptest! {
        /// A calibrated end lies after now (or is now, at the limit) and never past the limit.
        #[test]
        fn a_calibrated_end_lies_between_now_and_the_limit(
            start in 0u64..1_000_000, limit in 0u64..1_000_000, ratio in 0.0f64..2.0, after in 0u64..3_000_000,
        ) {
            let (start, limit, now) = (start as f64, limit as f64, (start + after) as f64);
            let e = calibrated_end(start, limit, ratio, now);
            proptest::prop_assert!(e >= now);
            proptest::prop_assert!(e <= (start + limit).max(now));
        }
    }

    pub(crate) fn rel(node: usize, gpus: u32, end_ms: Option<u64>) -> Release {
        Release {
            node,
            room: g(gpus),
            end_ms,
        }
    }

    #[test]
    fn a_gang_is_reserved_where_it_fits_first_as_work_drains() {
        // Two 8-GPU nodes, all busy; node 1 drains at 100 (two holders), node 0 at 50 and 300.
        let free = [g(0), g(0)];
        let releases = [
            rel(0, 4, Some(50)),
            rel(0, 4, Some(300)),
            rel(1, 4, Some(80)),
            rel(1, 4, Some(100)),
        ];
        let r = reserve(&free, &releases, &[g(8)], 10).unwrap();
        assert_eq!((r.start_ms, r.nodes.clone()), (100, vec![1]));
        // A gang of two 8-GPU tasks waits for both nodes.
        let both = reserve(&free, &releases, &[g(8), g(8)], 10).unwrap();
        assert_eq!(both.start_ms, 300);
        // It fits now: the start is now.
        assert_eq!(reserve(&[g(8), g(0)], &[], &[g(8)], 10).unwrap().start_ms, 10);
        // An end nobody knows is never counted: it never fits.
        assert!(reserve(&free, &[rel(1, 8, None)], &[g(8)], 10).is_none());
    }

    #[test]
    fn backfill_takes_only_work_that_ends_first_or_fits_beside() {
        // Node 0 has 4 free now; node 1 frees 8 at 100. Gang: one 8-GPU task, start 100.
        let free = [g(4), g(0)];
        let mut r = reserve(&free, &[rel(1, 8, Some(100))], &[g(8)], 0).unwrap();
        assert_eq!((r.start_ms, r.nodes.clone()), (100, vec![1]));
        // Ends before the start: on any node.
        assert!(r.backfill(&[(1, g(0)), (0, g(4))], Some(100)));
        // Ends after, but node 0 is not where the gang goes: fits beside.
        assert!(r.backfill(&[(0, g(4))], Some(10_000)));
        // Ends after and would take the gang's node (once node 1 has room): refused.
        let mut r2 = reserve(&[g(0), g(2)], &[rel(1, 6, Some(100))], &[g(8)], 0).unwrap();
        assert!(!r2.backfill(&[(1, g(2))], Some(101)));
        assert!(!r2.backfill(&[(1, g(1))], None));
        assert!(r2.backfill(&[(1, g(2))], Some(99)));
        // What was backfilled past the start is booked: a second taker finds less.
        let mut r3 = reserve(&[g(4), g(4)], &[], &[g(4)], 0).unwrap();
        assert_eq!(r3.start_ms, 0);
        assert!(r3.backfill(&[(0, g(4))], Some(500)), "the gang still fits on node 1");
        assert_eq!(r3.nodes, vec![1]);
        assert!(!r3.backfill(&[(1, g(1))], Some(500)));
    }

    proptest::proptest! {
        /// The start is the earliest release time at which the gang fits, and no work the
        /// reservation admits past its start ever leaves the gang without room then.
        #[test]
        fn the_start_is_earliest_and_backfill_never_takes_it(
            free in proptest::collection::vec(0u32..9, 1..5),
            rels in proptest::collection::vec((0usize..4, 1u32..9, proptest::option::of(1u64..100)), 0..8),
            tasks in proptest::collection::vec(1u32..9, 1..4),
            fills in proptest::collection::vec((0usize..4, 1u32..4, 0u64..200), 0..6),
        ) {
            let free: Vec<Room> = free.into_iter().map(g).collect();
            let rels: Vec<Release> = rels.into_iter().map(|(n, k, e)| rel(n % free.len(), k, e)).collect();
            let tasks: Vec<Room> = tasks.into_iter().map(g).collect();
            let Some(mut r) = reserve(&free, &rels, &tasks, 0) else {
                // Never fits: not even once everything with a known end has ended.
                let mut all = free.clone();
                for x in rels.iter().filter(|x| x.end_ms.is_some()) {
                    all[x.node].give(&x.room);
                }
                proptest::prop_assert!(pack(&all, &tasks).is_none());
                return Ok(());
            };
            let room_at = |t: u64| {
                let mut room = free.clone();
                for x in rels.iter().filter(|x| x.end_ms.is_some_and(|e| e <= t)) {
                    room[x.node].give(&x.room);
                }
                room
            };
            proptest::prop_assert!(pack(&room_at(r.start_ms), &tasks).is_some());
            for t in std::iter::once(0).chain(rels.iter().filter_map(|x| x.end_ms)) {
                if t < r.start_ms {
                    proptest::prop_assert!(pack(&room_at(t), &tasks).is_none(), "fits earlier, at {}", t);
                }
            }
            let mut kept = room_at(r.start_ms);
            for (n, k, end) in fills {
                let n = n % free.len();
                if r.backfill(&[(n, g(k))], Some(end)) && end > r.start_ms {
                    kept[n].take(&g(k));
                }
            }
            proptest::prop_assert!(pack(&kept, &tasks).is_some(), "backfill took the gang's room");
        }
    }

    #[test]
    fn the_policy_picks_long_waiters_and_large_gangs() {
        let p = Policy {
            wait_bound_ms: 600_000,
            min_gpus: 32,
        };
        assert!(p.applies(600_000, 1) && p.applies(0, 32));
        assert!(!p.applies(599_999, 31));
    }
}
