//! Reservations, backfill and start-time estimates in the policy simulator (issue 27, items 3
//! and 4): what a running or waiting job is expected to take (a declared limit, or one learned
//! from the jobs that ended before), and the estimated start of a job at its submit from the
//! running jobs' expected ends and the queue ahead — with learned or calibrated limits, the
//! median of walks whose ends are drawn from a censored distribution of durations, or of the
//! shares of declared limits used ([`Survival`]). The reservation itself, its start, the
//! doubling of overdue ends, the backfill test and the draws are the RM's
//! ([`crate::rm::scheduler::reservation`], [`crate::rm::scheduler::survival`]); this file
//! only feeds them.
//! Pure: no I/O, time passed in.

use std::collections::BTreeMap;

use super::cluster::{SimCluster, Task};
use crate::resources::GpuMask;
use crate::rm::scheduler::reservation::{self, Policy, Release, Room};
use crate::rm::scheduler::survival::{self, Survival, DRAWS};
use crate::rm::scheduler::walk::{self, Discipline, Queued, Reserved};

/// Where a job's expected duration comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Limit {
    /// Each job declares a time limit, its real duration times a factor in [lo, hi] drawn
    /// per job ([`declared_run_sec`]; lo = hi: every job the same factor), rounded up to the
    /// minute, and the limit is taken as its end (factor 1: a user who knows the duration to
    /// the minute).
    Declared(f64, f64),
    /// The same declared limits, each scaled by what the jobs that ended used of theirs
    /// ([`reservation::calibration`] of their run / limit; the traces carry no user, so all
    /// jobs' — the live RM takes the same user's), a running job's end by
    /// [`reservation::calibrated_end`] for reservations; a start estimate draws each share
    /// used from those runs' (the running ones censored), [`estimate_start_sampled`], as the
    /// live RM's estimate does. The backfill test past a reservation still trusts the limit
    /// itself (the RM ends a run there), as the live RM's gate does.
    Calibrated(f64, f64),
    /// Learned: for reservations, the median duration of the jobs of the same GPU count that
    /// ended before (of all jobs that ended, when none of that count has; unknown before any
    /// ended); for start estimates, draws from the [`Survival`] of those durations and the
    /// running jobs' time so far ([`estimate_start_sampled`]). The traces carry no user, so
    /// "the same user's earlier jobs" cannot be replayed.
    Learned,
}

impl Limit {
    /// `declared`, `declared:F`, `declared:LO-HI` (factors > 0), the same with
    /// `calibrated`, or `learned`.
    pub fn parse(text: &str) -> Result<Limit, String> {
        let t = text.trim();
        if t.eq_ignore_ascii_case("learned") {
            return Ok(Limit::Learned);
        }
        let (kind, factors) = t.split_once(':').unwrap_or((t, "1"));
        let make = if kind.eq_ignore_ascii_case("declared") {
            Limit::Declared
        } else if kind.eq_ignore_ascii_case("calibrated") {
            Limit::Calibrated
        } else {
            return Err(format!(
                "--expected-end {t}: use declared, calibrated (each optionally :F or :LO-HI) or learned"
            ));
        };
        let f = factors.trim();
        let num = |x: &str| x.trim().parse::<f64>().ok().filter(|v| v.is_finite() && *v > 0.0);
        let range = match f.split_once('-') {
            Some((a, b)) => num(a).zip(num(b)),
            None => num(f).map(|v| (v, v)),
        };
        match range {
            Some((lo, hi)) if hi >= lo => Ok(make(lo, hi)),
            _ => Err(format!(
                "--expected-end {t}: the factor `{f}` must be a positive number or a range LO-HI (e.g. declared:1.5, calibrated:1-3)"
            )),
        }
    }

    /// The limit job `id` of real duration `real` declares (seconds), when jobs declare them.
    pub fn declared_sec(&self, id: usize, real: f64) -> Option<f64> {
        match *self {
            Limit::Declared(lo, hi) | Limit::Calibrated(lo, hi) => Some(declared_run_sec((lo, hi), id, real) as f64),
            Limit::Learned => None,
        }
    }
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let factors = |f: &mut std::fmt::Formatter<'_>, lo: f64, hi: f64| {
            if lo == hi {
                write!(f, "{lo}")
            } else {
                write!(f, "{lo}-{hi}")
            }
        };
        match *self {
            Limit::Declared(lo, hi) => {
                write!(f, "declared:")?;
                factors(f, lo, hi)
            }
            Limit::Calibrated(lo, hi) => {
                write!(f, "calibrated:")?;
                factors(f, lo, hi)
            }
            Limit::Learned => write!(f, "learned"),
        }
    }
}

/// The simulator's queueing discipline.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Queueing {
    /// false: FIFO with head-of-line blocking (the default); true: every waiting job that
    /// fits starts, in arrival order (greedy backfill), as a resource manager that grants
    /// whoever fits does.
    pub backfill: bool,
    /// With `backfill`: the one reservation for the oldest waiting gang the policy picks;
    /// others start only if the reservation lets them ([`reservation::Reservation::backfill`]).
    pub reserve: Option<Policy>,
    /// Expected durations (reservations and estimates).
    pub limit: Limit,
    /// Gangs of at least this many GPUs are "big" in the report (`bigWaitP95`); single-task
    /// jobs below it are "small" (`smallWaitP50`).
    pub big_gpus: u32,
    /// The run-time limits jobs declare to the placement (`maxRunSec`, issue 27): `Some((lo,
    /// hi))`: each job its duration × a factor drawn from [lo, hi] (seeded by the job),
    /// rounded up to the minute. gpuam's order reads them (the drain term); the other
    /// policies ignore them. `None` (the default): no job declares one.
    pub run_limits: Option<(f64, f64)>,
}

/// `--run-limits`: `off`, `F` or `LO-HI` (factors ≥ 1 of the real duration).
pub fn parse_run_limits(text: &str) -> Result<Option<(f64, f64)>, String> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    let bad = || format!("--run-limits `{t}`: expected off, a factor F or a range LO-HI, each at least 1 (e.g. 1-3)");
    let (lo, hi) = match t.split_once('-') {
        Some((a, b)) => (
            a.trim().parse::<f64>().map_err(|_| bad())?,
            b.trim().parse::<f64>().map_err(|_| bad())?,
        ),
        None => {
            let f = t.parse::<f64>().map_err(|_| bad())?;
            (f, f)
        }
    };
    if !(lo.is_finite() && hi.is_finite() && lo >= 1.0 && hi >= lo) {
        return Err(bad());
    }
    Ok(Some((lo, hi)))
}

/// The limit a job declares under `run_limits` (seconds): its duration × a factor in
/// [lo, hi] drawn from the job's id and duration (the same in every policy's replay),
/// rounded up to the minute; with factors ≥ 1 it never ends past it.
pub fn declared_run_sec(run_limits: (f64, f64), id: usize, duration: f64) -> u64 {
    let (lo, hi) = run_limits;
    let mut h = (id as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ duration.to_bits();
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^= h >> 31;
    let u = (h >> 11) as f64 / (1u64 << 53) as f64;
    let limit = duration * (lo + (hi - lo) * u);
    ((limit / 60.0).ceil().max(1.0) * 60.0) as u64
}

impl Default for Queueing {
    fn default() -> Self {
        Queueing {
            backfill: false,
            reserve: None,
            limit: Limit::Declared(1.0, 1.0),
            run_limits: None,
            big_gpus: 32,
        }
    }
}

/// Durations of the jobs that ended, per GPU count (sorted), for [`Limit::Learned`], and
/// what they used of their declared limits, for [`Limit::Calibrated`].
#[derive(Clone, Debug)]
pub struct Durations {
    by_gpus: BTreeMap<u32, Vec<f64>>,
    all: Vec<f64>,
    used: Vec<f64>,
    /// [`reservation::calibration`] of `used`, or 1 (the limit itself) while too few ended.
    ratio: f64,
}

impl Default for Durations {
    fn default() -> Self {
        Durations {
            by_gpus: BTreeMap::new(),
            all: Vec::new(),
            used: Vec::new(),
            ratio: 1.0,
        }
    }
}

fn insert_sorted(v: &mut Vec<f64>, x: f64) {
    let i = v.partition_point(|y| *y <= x);
    v.insert(i, x);
}

fn median(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v[(v.len() - 1) / 2])
}

impl Durations {
    /// A job of `gpus` GPUs ended after `duration` seconds, having declared `limit` seconds.
    pub fn record(&mut self, gpus: u32, duration: f64, limit: Option<f64>) {
        insert_sorted(self.by_gpus.entry(gpus).or_default(), duration);
        insert_sorted(&mut self.all, duration);
        if let Some(l) = limit.filter(|l| *l > 0.0) {
            insert_sorted(&mut self.used, (duration / l).min(1.0));
            self.ratio = reservation::calibration(&mut self.used).unwrap_or(1.0);
        }
    }

    /// What ended jobs used of their declared limits ([`Limit::Calibrated`]; 1 until
    /// enough have ended).
    pub fn ratio(&self) -> f64 {
        self.ratio
    }

    /// Whether enough jobs that declared a limit have ended to calibrate limits by them
    /// ([`reservation::MIN_CALIBRATION`]).
    pub fn calibrated(&self) -> bool {
        self.used.len() >= reservation::MIN_CALIBRATION
    }

    /// The expected duration of job `id` of `gpus` GPUs that really takes `real` seconds.
    pub fn expected(&self, limit: Limit, id: usize, gpus: u32, real: f64) -> Option<f64> {
        match limit {
            Limit::Declared(..) => limit.declared_sec(id, real),
            Limit::Calibrated(..) => limit.declared_sec(id, real).map(|l| (l * self.ratio).max(1.0)),
            Limit::Learned => median(self.by_gpus.get(&gpus).map_or(&[][..], |v| v)).or_else(|| median(&self.all)),
        }
    }

    /// The end job `id` is held to when a reservation lets it backfill (seconds of run): its
    /// declared limit where jobs declare them (the RM ends it there), else [`Self::expected`].
    pub fn bound(&self, limit: Limit, id: usize, gpus: u32, real: f64) -> Option<f64> {
        limit
            .declared_sec(id, real)
            .or_else(|| self.expected(limit, id, gpus, real))
    }

    /// The ended durations of jobs of `gpus` GPUs, or of all jobs when fewer than
    /// [`MIN_OWN`] of that count have ended: a [`Survival`] needs more than the one ended
    /// job a median does, so its fallback lasts longer than [`Self::expected`]'s.
    fn ended(&self, gpus: u32) -> &[f64] {
        match self.by_gpus.get(&gpus) {
            Some(v) if v.len() >= MIN_OWN => v,
            _ => &self.all,
        }
    }
}

/// Jobs of one GPU count that must have ended before their own distribution is used.
const MIN_OWN: usize = 20;

/// A running job for [`estimate_start_sampled`]: what it holds, its GPU count, the seconds
/// it has run, and its declared limit (seconds; `None`: it declared none).
pub struct Running {
    pub takes: Vec<(usize, Room)>,
    pub gpus: u32,
    pub elapsed: f64,
    pub limit: Option<f64>,
}

/// A waiting job ahead for [`estimate_start_sampled`]: its tasks, GPU count and declared
/// limit.
pub struct Waiting<'a> {
    pub tasks: &'a [Room],
    pub gpus: u32,
    pub limit: Option<f64>,
}

/// Where the draws of [`estimate_start_sampled`] come from.
enum Drawn {
    /// Learned durations: the [`Survival`] of each GPU count (seconds).
    Learned(BTreeMap<u32, Survival>),
    /// Calibrated limits: one [`Survival`] of the shares of their limits ended jobs used.
    Calibrated(Survival),
}

/// The estimated start (ms) from drawn ends (issue 27, item 4): not a walk over each job's
/// point guess — a start is the first few of many ends, not each end's median — but the
/// median start over [`DRAWS`] walks of [`estimate_start`], each with every running job's
/// remaining time and every waiting job's duration drawn ([`survival`](crate::rm::scheduler::survival)):
/// with learned limits from the [`Survival`] of its GPU count (the running jobs counted as
/// censored); with calibrated ones (`calibrated`), as a share of its declared limit drawn
/// from the shares ended jobs used of theirs (the running ones censored at the share they
/// have run), never past the limit — the live RM's rule. `None` before enough jobs ended
/// (unless it starts now), or when the median walk never fits the gang. Deterministic in
/// `seed`.
#[allow(clippy::too_many_arguments)]
pub fn estimate_start_sampled(
    free: &[Room],
    running: &[Running],
    ahead: &[Waiting],
    me: &Queued,
    now: f64,
    in_order: bool,
    reserved: Option<&Reserved>,
    history: &Durations,
    calibrated: bool,
    seed: u64,
) -> Option<u64> {
    // What starts now does not depend on any end (every end lies after now): the walk with
    // no known end tells it, without learning or drawing anything.
    let now_ms = ms(now);
    let unknown: Vec<Release> = running
        .iter()
        .flat_map(|r| {
            r.takes.iter().map(|&(node, room)| Release {
                node,
                room,
                end_ms: None,
            })
        })
        .collect();
    let waiting: Vec<Queued> = ahead.iter().map(|w| Queued::gang(w.tasks, None)).collect();
    if estimate_start(free, &unknown, &waiting, me, now_ms, in_order, reserved) == Some(now_ms) {
        return Some(now_ms);
    }
    let drawn = if calibrated {
        if !history.calibrated() {
            return None;
        }
        let shares: Vec<f64> = running
            .iter()
            .filter_map(|r| Some((r.elapsed / r.limit.filter(|l| *l > 0.0)?).min(1.0)))
            .collect();
        Drawn::Calibrated(Survival::learn(&history.used, &shares)?)
    } else {
        let mut dists: BTreeMap<u32, Survival> = BTreeMap::new();
        for g in running.iter().map(|r| r.gpus).chain(ahead.iter().map(|w| w.gpus)) {
            if dists.contains_key(&g) {
                continue;
            }
            let own = history.by_gpus.get(&g).is_some_and(|v| v.len() >= MIN_OWN);
            let elapsed: Vec<f64> = running
                .iter()
                .filter(|r| !own || r.gpus == g)
                .map(|r| r.elapsed)
                .collect();
            dists.insert(g, Survival::learn(history.ended(g), &elapsed)?);
        }
        Drawn::Learned(dists)
    };
    // Seconds still to run of work of `gpus` GPUs and `limit` that has run `elapsed`, at `u`.
    let draw = |gpus: u32, limit: Option<f64>, elapsed: f64, u: f64| -> f64 {
        match (&drawn, limit) {
            (Drawn::Learned(d), _) => d.get(&gpus).map_or(0.0, |d| d.residual(elapsed, u)),
            (Drawn::Calibrated(d), Some(l)) if l > 0.0 => survival::share_left(d, elapsed / l, u) * l,
            (Drawn::Calibrated(_), _) => 0.0,
        }
        .max(1.0)
    };
    let draws = survival::hypercube(running.len() + ahead.len(), seed);
    let (run_u, ahead_u) = draws.split_at(running.len());
    let mut starts: Vec<Option<u64>> = (0..DRAWS)
        .map(|k| {
            let releases: Vec<Release> = running
                .iter()
                .zip(run_u)
                .flat_map(|(r, u)| {
                    let end = ms(now + draw(r.gpus, r.limit, r.elapsed, u[k]));
                    r.takes.iter().map(move |&(node, room)| Release {
                        node,
                        room,
                        end_ms: Some(end),
                    })
                })
                .collect();
            let ahead: Vec<Queued> = ahead
                .iter()
                .zip(ahead_u)
                .map(|(w, u)| Queued::gang(w.tasks, Some(ms(draw(w.gpus, w.limit, 0.0, u[k])))))
                .collect();
            estimate_start(free, &releases, &ahead, me, now_ms, in_order, reserved)
        })
        .collect();
    survival::median_start(&mut starts)
}

/// Seconds as whole milliseconds (the scheduler's clock).
pub fn ms(t: f64) -> u64 {
    (t.max(0.0) * 1000.0).round() as u64
}

/// What each node of `cl` has free now, as a reservation counts it.
pub fn free_rooms(cl: &SimCluster) -> Vec<Room> {
    cl.nodes
        .iter()
        .map(|n| Room {
            gpus: n.free_mask.count_ones(),
            cpu: n.free_cpu,
            memory_mb: n.free_mem,
        })
        .collect()
}

/// A task's ask as a reservation counts it.
pub fn room_of(t: &Task) -> Room {
    Room {
        gpus: t.gpus,
        cpu: t.cpu,
        memory_mb: t.mem_mb,
    }
}

/// What a placed job takes: per task, its node and room (the GPUs of its mask).
pub fn takes(placed: &[(usize, GpuMask)], tasks: &[Task]) -> Vec<(usize, Room)> {
    placed
        .iter()
        .zip(tasks)
        .map(|(&(n, m), t)| {
            let room = Room {
                gpus: m.count_ones(),
                ..room_of(t)
            };
            (n, room)
        })
        .collect()
}

/// The estimated start (ms) of the gang `me` (its tasks, and its expected duration, which
/// decides whether it may backfill past a reservation) submitted at `now_ms`, behind the
/// jobs `ahead` (in queue order), as the running jobs' `releases` and the started ones' expected
/// ends free room: the RM's queue walk ([`walk::starts`]) watching the gang, in the
/// simulator's discipline (`in_order`: FIFO; else backfill), honouring `reserved` (a job
/// ahead holds a reservation: the others start only where it lets them). `None` when it
/// never fits on what is known to end.
pub fn estimate_start(
    free: &[Room],
    releases: &[Release],
    ahead: &[Queued],
    me: &Queued,
    now_ms: u64,
    in_order: bool,
    reserved: Option<&Reserved>,
) -> Option<u64> {
    let queue: Vec<Queued> = ahead.iter().chain(std::iter::once(me)).copied().collect();
    let me = queue.len() - 1;
    let d = Discipline {
        in_order,
        watch: Some(me),
        reservation: reserved.filter(|r| r.holder < me).cloned(),
        ..Discipline::default()
    };
    walk::starts(free, releases, &queue, now_ms, d).start_ms[me]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rm::scheduler::reservation::{
        self,
        tests::{g, rel},
    };

    #[test]
    fn the_estimate_waits_for_the_running_ends_and_the_queue_ahead() {
        // Two 8-GPU nodes: node 0 frees 8 at 100, node 1 frees 4 at 50 and 4 at 300.
        let free = [g(0), g(0)];
        let releases = [rel(0, 8, Some(100)), rel(1, 4, Some(50)), rel(1, 4, Some(300))];
        // Alone, a 4-GPU job starts at 50, an 8-GPU one at 100, a 16-GPU gang at 300.
        assert_eq!(
            estimate_start(&free, &releases, &[], &me(&[g(4)]), 0, true, None),
            Some(50)
        );
        assert_eq!(
            estimate_start(&free, &releases, &[], &me(&[g(8)]), 0, true, None),
            Some(100)
        );
        assert_eq!(
            estimate_start(&free, &releases, &[], &me(&[g(8), g(8)]), 0, true, None),
            Some(300)
        );
        // Behind an 8-GPU job of 1000 ms (it takes node 0 at 100): the gang waits until 1100.
        let eight = [g(8)];
        let ahead = [Queued::gang(&eight, Some(1000))];
        assert_eq!(
            estimate_start(&free, &releases, &ahead, &me(&[g(8), g(8)]), 0, true, None),
            Some(1100)
        );
        // FIFO: a 4-GPU job behind it starts no earlier than it (at 100, on node 1).
        assert_eq!(
            estimate_start(&free, &releases, &ahead, &me(&[g(4)]), 0, true, None),
            Some(100)
        );
        // Backfill: it takes node 1's four GPUs at 50, before the 8-GPU job ahead starts.
        assert_eq!(
            estimate_start(&free, &releases, &ahead, &me(&[g(4)]), 0, false, None),
            Some(50)
        );
        // ... and a gang behind a blocked one still waits for the room the walk leaves it.
        assert_eq!(
            estimate_start(&free, &releases, &ahead, &me(&[g(8), g(8)]), 0, false, None),
            Some(1100)
        );
        // Queued with no known end: the gang never gets node 0 back.
        let unknown = [Queued::gang(&eight, None)];
        assert_eq!(
            estimate_start(&free, &releases, &unknown, &me(&[g(8), g(8)]), 0, true, None),
            None
        );
        // Fits now: now.
        assert_eq!(estimate_start(&[g(8)], &[], &[], &me(&[g(8)]), 7, true, None), Some(7));
        assert_eq!(
            estimate_start(&[g(4)], &[rel(0, 4, None)], &[], &me(&[g(8)]), 7, false, None),
            None
        );
    }

    /// The job estimated, with no expected duration.
    fn me(tasks: &[Room]) -> Queued<'_> {
        Queued::gang(tasks, None)
    }

    /// A gang ahead holds a reservation: a job that would take its room waits for it to
    /// start and end, unless its own expected duration ends before the gang's start.
    #[test]
    fn the_estimate_honours_the_reservation_of_a_gang_ahead() {
        // Node 0 frees 8 at 100, node 1 has 4 free and frees 4 at 200; the gang of 2 × 8
        // (1000 ms) is reserved for 200.
        let free = [g(0), g(4)];
        let releases = [rel(0, 8, Some(100)), rel(1, 4, Some(200))];
        let gang = [g(8), g(8)];
        let reserved = Reserved {
            holder: 0,
            reservation: reservation::reserve(&free, &releases, &gang, 0).unwrap(),
            exempt_below: 0,
        };
        let ahead = [Queued::gang(&gang, Some(1000))];
        let four = [g(4)];
        let est = |duration_ms, r: Option<&Reserved>| {
            let me = Queued::gang(&four, duration_ms);
            estimate_start(&free, &releases, &ahead, &me, 0, false, r)
        };
        assert_eq!(est(Some(5000), None), Some(0), "no reservation: it takes node 1 now");
        assert_eq!(est(Some(5000), Some(&reserved)), Some(1200), "after the gang");
        assert_eq!(est(Some(150), Some(&reserved)), Some(0), "it ends by the gang's start");
        assert_eq!(est(None, Some(&reserved)), Some(1200));
    }

    #[test]
    fn learned_estimates_draw_the_running_ends_and_the_queue_ahead() {
        let mut d = Durations::default();
        let running = |elapsed: f64| Running {
            takes: vec![(0, g(8))],
            gpus: 8,
            elapsed,
            limit: None,
        };
        // One 8-GPU node with `free` GPUs free beside a job that has run 30 s.
        let alone = |free: u32, d: &Durations| {
            estimate_start_sampled(
                &[g(free)],
                &[running(30.0)],
                &[],
                &me(&[g(8)]),
                1000.0,
                true,
                None,
                d,
                false,
                1,
            )
        };
        // Nothing ended, but the room is free: now, with nothing to learn or draw.
        assert_eq!(alone(8, &d), Some(1_000_000));
        // Nothing ended and the room is held: no estimate.
        assert_eq!(alone(0, &d), None);
        // Every 8-GPU job ended at 100 s: the one that has run 30 s frees the node in 70 s,
        // and a job ahead of ours holds it 100 s more, whatever the draws.
        for _ in 0..MIN_OWN {
            d.record(8, 100.0, None);
        }
        // The node held by a job that has run `elapsed` s, behind `ahead`.
        let held = |elapsed: f64, ahead: &[Waiting], seed: u64| {
            estimate_start_sampled(
                &[g(0)],
                &[running(elapsed)],
                ahead,
                &me(&[g(8)]),
                1000.0,
                true,
                None,
                &d,
                false,
                seed,
            )
        };
        for seed in 0..5 {
            assert_eq!(held(30.0, &[], seed), Some(1_070_000));
            let ahead = [Waiting {
                tasks: &[g(8)],
                gpus: 8,
                limit: None,
            }];
            assert_eq!(held(30.0, &ahead, seed), Some(1_170_000));
        }
        // A job that outlived every ended one ends in the exponential tail, whose mean is
        // all time run over the jobs that ended, (20 × 100 + 500) / 20 = 125 s: the median
        // draw is near 125 × ln 2 = 87 s from now, the same for the same seed.
        let late = |seed| held(500.0, &[], seed);
        let a = late(7).unwrap();
        assert_eq!(late(7), Some(a), "deterministic in the seed");
        assert!((1_060_000..1_120_000).contains(&a), "{a}");
    }

    #[test]
    fn calibrated_estimates_draw_shares_of_the_limits_and_never_pass_them() {
        let mut d = Durations::default();
        // Every 8-GPU job ran a quarter of its 400 s limit: the one that has run 30 s of its
        // 400 frees the node 70 s from now, and a waiting one declaring 400 s holds it 100 s.
        let running = |elapsed: f64, limit: f64| Running {
            takes: vec![(0, g(8))],
            gpus: 8,
            elapsed,
            limit: Some(limit),
        };
        let held = |d: &Durations, r: Running, ahead: &[Waiting], seed: u64| {
            estimate_start_sampled(&[g(0)], &[r], ahead, &me(&[g(8)]), 1000.0, true, None, d, true, seed)
        };
        assert_eq!(held(&d, running(30.0, 400.0), &[], 1), None, "too few ended: no draws");
        for _ in 0..reservation::MIN_CALIBRATION {
            d.record(8, 100.0, Some(400.0));
        }
        let ahead = [Waiting {
            tasks: &[g(8)],
            gpus: 8,
            limit: Some(400.0),
        }];
        for seed in 0..5 {
            assert_eq!(held(&d, running(30.0, 400.0), &[], seed), Some(1_070_000));
            assert_eq!(held(&d, running(30.0, 400.0), &ahead, seed), Some(1_170_000));
            // Past every ended share (a quarter), but it ends by its limit: 300 s of 400 run,
            // whatever the draw, it frees the node within the 100 s left.
            let e = held(&d, running(300.0, 400.0), &[], seed).unwrap();
            assert!((1_000_000..=1_100_000).contains(&e), "{e}");
        }
    }

    #[test]
    fn limits_parse_and_learned_ones_are_medians_of_what_ended() {
        assert_eq!(Limit::parse("declared"), Ok(Limit::Declared(1.0, 1.0)));
        assert_eq!(Limit::parse("declared:2"), Ok(Limit::Declared(2.0, 2.0)));
        assert_eq!(Limit::parse("calibrated:1-3"), Ok(Limit::Calibrated(1.0, 3.0)));
        assert_eq!(Limit::parse(" Calibrated "), Ok(Limit::Calibrated(1.0, 1.0)));
        assert_eq!(Limit::parse("LEARNED"), Ok(Limit::Learned));
        for bad in [
            "declared:0",
            "declared:3-1",
            "calibrated:x",
            "declared:1-",
            "declared:-2",
        ] {
            assert!(Limit::parse(bad).unwrap_err().contains("positive"), "{bad}");
        }
        assert!(Limit::parse("guess").unwrap_err().contains("--expected-end"));
        for l in ["declared:1", "declared:1.5", "calibrated:1-3", "learned"] {
            assert_eq!(Limit::parse(l).map(|x| x.to_string()), Ok(l.to_string()));
        }
        let mut d = Durations::default();
        // Declared: rounded up to the minute, times the factor.
        assert_eq!(d.expected(Limit::Declared(1.0, 1.0), 0, 8, 61.0), Some(120.0));
        assert_eq!(d.expected(Limit::Declared(2.0, 2.0), 0, 8, 600.0), Some(1200.0));
        assert_eq!(d.expected(Limit::Learned, 0, 8, 600.0), None, "nothing ended yet");
        for x in [100.0, 300.0, 200.0] {
            d.record(8, x, None);
        }
        d.record(4, 5.0, None);
        assert_eq!(d.expected(Limit::Learned, 0, 8, 1.0), Some(200.0));
        assert_eq!(d.expected(Limit::Learned, 0, 4, 1.0), Some(5.0));
        assert_eq!(
            d.expected(Limit::Learned, 0, 32, 1.0),
            Some(100.0),
            "all jobs: 5, 100, 200, 300"
        );
    }

    /// Calibrated limits: the declared limit until enough jobs ended, then scaled by what
    /// they used of theirs (a user who declares twice the run is told the run); the backfill
    /// bound stays the limit.
    #[test]
    fn calibrated_limits_are_scaled_by_what_ended_jobs_used_of_theirs() {
        let cal = Limit::Calibrated(2.0, 2.0);
        let mut d = Durations::default();
        assert_eq!(d.expected(cal, 0, 8, 600.0), Some(1200.0), "nothing ended: the limit");
        for k in 0..reservation::MIN_CALIBRATION {
            let run = 300.0 * (k + 1) as f64;
            d.record(8, run, cal.declared_sec(k, run));
            // A job that declares nothing is no evidence.
            d.record(8, run, None);
        }
        assert!((d.ratio() - 0.5).abs() < 1e-9, "{}", d.ratio());
        assert_eq!(d.expected(cal, 0, 8, 600.0), Some(600.0));
        assert_eq!(d.bound(cal, 0, 8, 600.0), Some(1200.0));
        // Factors drawn per job in [1, 3]: each job its own limit, the same one each time.
        let spread = Limit::Calibrated(1.0, 3.0);
        let limits: Vec<f64> = (0..50).filter_map(|id| spread.declared_sec(id, 600.0)).collect();
        assert!(limits.iter().all(|l| (600.0..=1800.0).contains(l)));
        assert!(limits.iter().any(|&l| l < 1000.0) && limits.iter().any(|&l| l > 1400.0));
        assert_eq!(spread.declared_sec(7, 600.0), spread.declared_sec(7, 600.0));
        assert_eq!(Limit::Learned.declared_sec(7, 600.0), None);
    }
}
