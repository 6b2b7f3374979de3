//! Reservations, backfill and start-time estimates in the policy simulator (issue 27, items 3
//! and 4): what a running or waiting job is expected to take (a declared limit, or one learned
//! from the jobs that ended before), and the estimated start of a job at its submit from the
//! running jobs' expected ends and the queue ahead. The reservation itself, its start and the
//! backfill test are the RM's ([`crate::rm::scheduler::reservation`]); this file only feeds it.
//! Pure: no I/O, time passed in.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use super::cluster::{SimCluster, Task};
use crate::resources::GpuMask;
use crate::rm::scheduler::reservation::{self, Policy, Release, Room};

/// Where a job's expected duration comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Limit {
    /// A declared time limit: the real duration times the factor, rounded up to the minute
    /// (factor 1: a user who knows the duration to the minute).
    Declared(f64),
    /// Learned: the median duration of the jobs of the same GPU count that ended before (of all
    /// jobs that ended, when none of that count has; unknown before any ended). The traces
    /// carry no user, so "the same user's earlier jobs" cannot be replayed.
    Learned,
}

impl Limit {
    /// `declared`, `declared:F` (F > 0) or `learned`.
    pub fn parse(text: &str) -> Result<Limit, String> {
        let t = text.trim();
        if t.eq_ignore_ascii_case("learned") {
            return Ok(Limit::Learned);
        }
        if t.eq_ignore_ascii_case("declared") {
            return Ok(Limit::Declared(1.0));
        }
        match t.split_once(':') {
            Some((d, f)) if d.eq_ignore_ascii_case("declared") => match f.trim().parse::<f64>() {
                Ok(f) if f.is_finite() && f > 0.0 => Ok(Limit::Declared(f)),
                _ => Err(format!(
                    "--expected-end {t}: the factor `{f}` must be a positive number (e.g. declared:1.5)"
                )),
            },
            _ => Err(format!(
                "--expected-end {t}: use declared, declared:F (F > 0) or learned"
            )),
        }
    }
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Limit::Declared(x) => write!(f, "declared:{x}"),
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
}

impl Default for Queueing {
    fn default() -> Self {
        Queueing {
            backfill: false,
            reserve: None,
            limit: Limit::Declared(1.0),
            big_gpus: 32,
        }
    }
}

/// Durations of the jobs that ended, per GPU count (sorted), for [`Limit::Learned`].
#[derive(Clone, Debug, Default)]
pub struct Durations {
    by_gpus: BTreeMap<u32, Vec<f64>>,
    all: Vec<f64>,
}

fn insert_sorted(v: &mut Vec<f64>, x: f64) {
    let i = v.partition_point(|y| *y <= x);
    v.insert(i, x);
}

fn median(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v[(v.len() - 1) / 2])
}

impl Durations {
    pub fn record(&mut self, gpus: u32, duration: f64) {
        insert_sorted(self.by_gpus.entry(gpus).or_default(), duration);
        insert_sorted(&mut self.all, duration);
    }

    /// The expected duration of a job of `gpus` GPUs that really takes `real` seconds.
    pub fn expected(&self, limit: Limit, gpus: u32, real: f64) -> Option<f64> {
        match limit {
            Limit::Declared(f) => Some(((real * f) / 60.0).ceil().max(1.0) * 60.0),
            Limit::Learned => median(self.by_gpus.get(&gpus).map_or(&[][..], |v| v)).or_else(|| median(&self.all)),
        }
    }
}

/// The expected end of a job that started at `start` and is expected to take `expected`
/// seconds, seen at `now`: a job still running past its expectation is expected to take
/// twice as long again (doubling until the end lies after `now`).
pub fn expected_end(start: f64, expected: f64, now: f64) -> f64 {
    let mut e = expected.max(1.0);
    while start + e <= now {
        e *= 2.0;
    }
    start + e
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

/// One waiting gang for [`estimate_start`]: its tasks and expected duration (ms; `None`:
/// unknown, it never ends as far as the estimate knows).
pub struct Ahead {
    pub tasks: Vec<Room>,
    pub duration_ms: Option<u64>,
}

/// A room freed at a time: (end ms, node, GPUs, CPU, memory MB), earliest first.
type End = Reverse<(u64, usize, u32, u32, u64)>;

/// The estimated start (ms) of the gang `tasks` submitted at `now_ms`, behind the jobs
/// `ahead` (in queue order), as the running jobs' `releases` and the started ones' expected
/// ends free room. At each time, the waiting jobs are tried in queue order and each that
/// fits ([`reservation::reserve`] on the room then) starts and holds its room for its
/// expected duration; `in_order` (FIFO): the first that does not fit blocks those behind
/// it; otherwise (backfill) the others are still tried. The gang's estimate is the time it
/// starts in that walk; `None` when it never fits on what is known to end.
pub fn estimate_start(
    free: &[Room],
    releases: &[Release],
    ahead: &[Ahead],
    tasks: &[Room],
    now_ms: u64,
    in_order: bool,
) -> Option<u64> {
    let mut room = free.to_vec();
    let mut ends: BinaryHeap<End> = releases
        .iter()
        .filter(|r| r.node < room.len())
        .filter_map(|r| Some(Reverse((r.end_ms?, r.node, r.room.gpus, r.room.cpu, r.room.memory_mb))))
        .collect();
    let mut free_gpus: u64 = room.iter().map(|r| u64::from(r.gpus)).sum();
    let me = Ahead {
        tasks: tasks.to_vec(),
        duration_ms: None,
    };
    let mut pending: Vec<&Ahead> = ahead.iter().chain(std::iter::once(&me)).collect();
    let mut t = now_ms;
    loop {
        while let Some(Reverse((e, node, gpus, cpu, mem))) = ends.peek().copied() {
            if e > t {
                break;
            }
            ends.pop();
            let r = &mut room[node];
            r.gpus += gpus;
            r.cpu += cpu;
            r.memory_mb += mem;
            free_gpus += u64::from(gpus);
        }
        let mut k = 0;
        while k < pending.len() {
            let job = pending[k];
            let need: u64 = job.tasks.iter().map(|r| u64::from(r.gpus)).sum();
            let fit = (free_gpus >= need)
                .then(|| reservation::reserve(&room, &[], &job.tasks, t))
                .flatten();
            let Some(r) = fit else {
                if in_order {
                    break;
                }
                k += 1;
                continue;
            };
            if k == pending.len() - 1 {
                return Some(t);
            }
            for (task, &node) in job.tasks.iter().zip(&r.nodes) {
                let n = &mut room[node];
                n.gpus = n.gpus.saturating_sub(task.gpus);
                n.cpu = n.cpu.saturating_sub(task.cpu);
                n.memory_mb = n.memory_mb.saturating_sub(task.memory_mb);
                free_gpus = free_gpus.saturating_sub(u64::from(task.gpus));
                if let Some(d) = job.duration_ms {
                    ends.push(Reverse((t + d, node, task.gpus, task.cpu, task.memory_mb)));
                }
            }
            pending.remove(k);
        }
        t = ends.peek()?.0 .0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rm::scheduler::reservation::tests::{g, rel};

    #[test]
    fn the_estimate_waits_for_the_running_ends_and_the_queue_ahead() {
        // Two 8-GPU nodes: node 0 frees 8 at 100, node 1 frees 4 at 50 and 4 at 300.
        let free = [g(0), g(0)];
        let releases = [rel(0, 8, Some(100)), rel(1, 4, Some(50)), rel(1, 4, Some(300))];
        // Alone, a 4-GPU job starts at 50, an 8-GPU one at 100, a 16-GPU gang at 300.
        assert_eq!(estimate_start(&free, &releases, &[], &[g(4)], 0, true), Some(50));
        assert_eq!(estimate_start(&free, &releases, &[], &[g(8)], 0, true), Some(100));
        assert_eq!(estimate_start(&free, &releases, &[], &[g(8), g(8)], 0, true), Some(300));
        // Behind an 8-GPU job of 1000 ms (it takes node 0 at 100): the gang waits until 1100.
        let ahead = [Ahead {
            tasks: vec![g(8)],
            duration_ms: Some(1000),
        }];
        assert_eq!(
            estimate_start(&free, &releases, &ahead, &[g(8), g(8)], 0, true),
            Some(1100)
        );
        // FIFO: a 4-GPU job behind it starts no earlier than it (at 100, on node 1).
        assert_eq!(estimate_start(&free, &releases, &ahead, &[g(4)], 0, true), Some(100));
        // Backfill: it takes node 1's four GPUs at 50, before the 8-GPU job ahead starts.
        assert_eq!(estimate_start(&free, &releases, &ahead, &[g(4)], 0, false), Some(50));
        // ... and a gang behind a blocked one still waits for the room the walk leaves it.
        assert_eq!(
            estimate_start(&free, &releases, &ahead, &[g(8), g(8)], 0, false),
            Some(1100)
        );
        // Ahead with no known end: the gang never gets node 0 back.
        let unknown = [Ahead {
            tasks: vec![g(8)],
            duration_ms: None,
        }];
        assert_eq!(estimate_start(&free, &releases, &unknown, &[g(8), g(8)], 0, true), None);
        // Fits now: now.
        assert_eq!(estimate_start(&[g(8)], &[], &[], &[g(8)], 7, true), Some(7));
        assert_eq!(
            estimate_start(&[g(4)], &[rel(0, 4, None)], &[], &[g(8)], 7, false),
            None
        );
    }

    #[test]
    fn limits_parse_and_learned_ones_are_medians_of_what_ended() {
        assert_eq!(Limit::parse("declared"), Ok(Limit::Declared(1.0)));
        assert_eq!(Limit::parse("declared:2"), Ok(Limit::Declared(2.0)));
        assert_eq!(Limit::parse("LEARNED"), Ok(Limit::Learned));
        assert!(Limit::parse("declared:0").unwrap_err().contains("positive"));
        assert!(Limit::parse("guess").unwrap_err().contains("--expected-end"));
        let mut d = Durations::default();
        // Declared: rounded up to the minute, times the factor.
        assert_eq!(d.expected(Limit::Declared(1.0), 8, 61.0), Some(120.0));
        assert_eq!(d.expected(Limit::Declared(2.0), 8, 600.0), Some(1200.0));
        assert_eq!(d.expected(Limit::Learned, 8, 600.0), None, "nothing ended yet");
        for x in [100.0, 300.0, 200.0] {
            d.record(8, x);
        }
        d.record(4, 5.0);
        assert_eq!(d.expected(Limit::Learned, 8, 1.0), Some(200.0));
        assert_eq!(d.expected(Limit::Learned, 4, 1.0), Some(5.0));
        assert_eq!(
            d.expected(Limit::Learned, 32, 1.0),
            Some(100.0),
            "all jobs: 5, 100, 200, 300"
        );
        // Past its expectation, a job is expected to take twice as long again.
        assert_eq!(expected_end(10.0, 100.0, 50.0), 110.0);
        assert_eq!(expected_end(10.0, 100.0, 110.0), 210.0);
        assert_eq!(expected_end(10.0, 100.0, 500.0), 810.0);
    }
}
