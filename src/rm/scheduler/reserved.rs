//! Reservations in the live RM's gate, and start estimates (issue 27, items 3 and 4),
//! without I/O and with time passed in: the bridge from a [`Snapshot`] (nodes, held
//! containers with their expected ends, waiting applications) to the pure
//! [`reservation`](super::reservation) rule.
//!
//! - [`holder`]: the one waiting gang that holds a reservation now — the first, in the
//!   scheduler's order (queue ratio, priority, age), of the gangs that pass the
//!   [`Policy`] (waited past a bound, or large) — with where and when it is expected to
//!   fit as the held containers end ([`reservation::reserve`]).
//! - [`admits`]: whether an ask (or a gang's asks) of another application may take room
//!   now: yes when its application ranks ahead of the holder (queue shares come first),
//!   when it ends by the reservation's start, or when the gang still fits beside it
//!   (backfill); else it waits ([`super::WaitReason::Reserved`]).
//! - [`estimates`]: when each waiting application is expected to start, with the basis of
//!   the estimate (declared limits, learned run times, the jobs ahead, or why it is
//!   unknown) — one [`walk`] of the queue over the same state, honouring the reservation;
//!   where ends are calibrated, the median start of [`DRAWS`] walks over drawn ends
//!   ([`Expectations`], [`survival`]).
//!
//! A held container's end is what the snapshot's [`Snapshot::ends`] says: its declared
//! limit (calibrated by what its user's ended runs used of theirs, when enough ended),
//! else a learned one, else unknown; a container with no known end is never counted
//! as freeing its room, so a reservation only relies on ends it knows.

use serde::Serialize;

pub use crate::protocol::{StartBasis as Basis, StartEstimate};

use std::collections::HashMap;

use super::reservation::{self, Policy, Release, Reservation, Room};
use super::survival::{self, DRAWS};
use super::walk::{self, Discipline, Nodes, Queued, Reserved};
use super::{eligible, rank, rank_cmp, AppDemand, Shares, Snapshot};
use crate::protocol::WaitingTasks;
use crate::resources::Resources;

/// Where a held container's expected end comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum EndBasis {
    /// Nothing bounds it.
    #[default]
    Unknown,
    /// Its task's declared `maxRunSec`.
    Declared,
    /// Its task's declared `maxRunSec`, calibrated by what its user's ended runs used of
    /// their limits ([`reservation::calibrated_end`]).
    Calibrated,
    /// Learned: the median run time of its job's completed tasks of the same role, or,
    /// before any completed, of the same user's earlier runs of the job (same name).
    Learned,
    /// It is leaving (ended, or under a preemption notice with a deadline).
    Leaving,
}

/// A held container's expected end (ms since the epoch; `None`: unknown).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Expected {
    pub end_ms: Option<u64>,
    pub basis: EndBasis,
}

/// The gang holding the reservation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// Index into [`Snapshot::apps`].
    pub app: usize,
    pub reservation: Reservation,
}

/// How a reservation's holder is named to the others who wait behind it: by its size, not
/// its application id (another tenant's job is none of theirs to name).
pub fn holder_label(snap: &Snapshot, h: &Holder) -> String {
    let gpus: u64 = snap.apps[h.app]
        .waiting
        .iter()
        .map(|w| u64::from(w.count) * u64::from(w.gpus))
        .sum();
    format!("a waiting gang of {gpus} GPUs")
}

/// At most this many tasks of one gang are packed (bounds the work of one decision).
const MAX_TASKS: usize = 4096;

fn room_of(r: &Resources) -> Room {
    Room {
        gpus: r.whole_gpu_count(),
        cpu: r.cpu,
        memory_mb: r.memory_mb,
    }
}

/// The expected end of held container `h`.
fn end_of(snap: &Snapshot, h: usize) -> Expected {
    snap.ends.get(h).copied().unwrap_or_default()
}

/// The nodes application `a`'s waiting tasks may all use (placement's `eligible`, asked
/// once per node class).
fn eligibility(snap: &Snapshot, a: usize) -> Vec<bool> {
    let classes = Classes::of(snap);
    let ok = classes.allowing(snap, &shapes_of(&snap.apps[a]));
    classes.of.iter().map(|&c| ok[c]).collect()
}

/// Application `a`'s waiting tasks as rooms (at most [`MAX_TASKS`]).
pub fn tasks_of(snap: &Snapshot, a: usize) -> Vec<Room> {
    snap.apps[a]
        .waiting
        .iter()
        .filter(|w| w.count > 0)
        .flat_map(|w| {
            std::iter::repeat_n(
                Room {
                    gpus: w.gpus,
                    cpu: w.cpu,
                    memory_mb: w.memory_mb,
                },
                w.count as usize,
            )
        })
        .take(MAX_TASKS)
        .collect()
}

/// What each node has free now, as reservations and estimates count it.
pub fn free_rooms(snap: &Snapshot) -> Vec<Room> {
    snap.nodes
        .iter()
        .map(|n| Room {
            gpus: n.free_gpus.count_ones(),
            cpu: n.free_cpu,
            memory_mb: n.free_memory_mb,
        })
        .collect()
}

/// Held container `i` as a release: where, what, and its expected end.
fn release_of(snap: &Snapshot, i: usize) -> Release {
    let h = &snap.held[i];
    Release {
        node: h.node,
        room: Room {
            gpus: h.gpus.count_ones(),
            cpu: h.cpu,
            memory_mb: h.memory_mb,
        },
        end_ms: end_of(snap, i).end_ms,
    }
}

/// Every held container as a release.
pub fn releases(snap: &Snapshot) -> Vec<Release> {
    (0..snap.held.len()).map(|i| release_of(snap, i)).collect()
}

/// What `reserve` needs for application `a`'s waiting tasks: the free room of each node
/// (none where its tasks may not go), the releases there, and its tasks.
fn inputs(snap: &Snapshot, a: usize) -> (Vec<Room>, Vec<Release>, Vec<Room>) {
    let ok = eligibility(snap, a);
    let free = free_rooms(snap)
        .into_iter()
        .zip(&ok)
        .map(|(r, &ok)| if ok { r } else { Room::default() })
        .collect();
    let releases = (0..snap.held.len())
        .filter(|&i| ok.get(snap.held[i].node).copied().unwrap_or(false))
        .map(|i| release_of(snap, i))
        .collect();
    (free, releases, tasks_of(snap, a))
}

/// GPUs of `a`'s waiting tasks.
fn waiting_gpus(snap: &Snapshot, a: usize) -> u32 {
    snap.apps[a]
        .waiting
        .iter()
        .map(|w| w.count.saturating_mul(w.gpus))
        .fold(0u32, u32::saturating_add)
}

/// Whether some waiting gang passes `policy` (cheap: no packing): only then is a
/// [`holder`] worth computing.
pub fn candidates(snap: &Snapshot, policy: &Policy, now_ms: u64) -> bool {
    (0..snap.apps.len()).any(|a| passes(snap, policy, a, now_ms))
}

fn passes(snap: &Snapshot, policy: &Policy, a: usize, now_ms: u64) -> bool {
    let app = &snap.apps[a];
    let gpus = waiting_gpus(snap, a);
    app.gang && gpus > 0 && policy.applies(now_ms.saturating_sub(app.submitted_ms), gpus)
}

/// The waiting gang that holds the reservation now, if any (see the module doc): the
/// first gang in the scheduler's order that passes `policy`, when its reservation can be
/// computed from known ends.
pub fn holder(snap: &Snapshot, shares: &Shares, policy: &Policy, now_ms: u64) -> Option<Holder> {
    let mut gangs: Vec<usize> = (0..snap.apps.len())
        .filter(|&a| passes(snap, policy, a, now_ms))
        .collect();
    gangs.sort_by(|&x, &y| rank_cmp(&rank(shares, None, &snap.apps[x]), &rank(shares, None, &snap.apps[y])));
    let &a = gangs.first()?;
    let (free, releases, tasks) = inputs(snap, a);
    let reservation = reservation::reserve(&free, &releases, &tasks, now_ms)?;
    Some(Holder { app: a, reservation })
}

/// Whether application `app` may take `asks` (node index, exact resources) now, given the
/// reservation of `holder`; its asks are expected to end at `end_ms` (`None`: no limit
/// declared). `Err`: the holder's id and the reservation's start.
pub fn admits(
    snap: &Snapshot,
    shares: &Shares,
    holder: &Holder,
    app: usize,
    asks: &[(usize, Resources)],
    end_ms: Option<u64>,
) -> bool {
    let pool = asks
        .iter()
        .find(|(_, r)| r.whole_gpu_count() > 0)
        .and_then(|(n, _)| snap.nodes.get(*n).and_then(|n| shares.pool_of(&n.pool)));
    let takes: Vec<(usize, Room)> = asks.iter().map(|(n, r)| (*n, room_of(r))).collect();
    admits_rooms(snap, shares, holder, app, pool, &takes, end_ms)
}

/// [`admits`] of room amounts, ranked in `pool`.
fn admits_rooms(
    snap: &Snapshot,
    shares: &Shares,
    holder: &Holder,
    app: usize,
    pool: Option<usize>,
    takes: &[(usize, Room)],
    end_ms: Option<u64>,
) -> bool {
    if holder.app == app {
        return true;
    }
    // Queue shares first: an application that ranks ahead of the gang never yields to it.
    let mine = rank(shares, pool, &snap.apps[app]);
    let theirs = rank(shares, pool, &snap.apps[holder.app]);
    if rank_cmp(&mine, &theirs).is_lt() {
        return true;
    }
    holder.reservation.clone().backfill(takes, end_ms)
}

/// How long a waiting application is expected to hold its room once started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Run {
    /// ms; `None`: unknown (it never gives its room back, as far as an estimate knows).
    pub ms: Option<u64>,
    /// `Declared` (every role's `maxRunSec`), `Learned` (some role's from its completed
    /// tasks), else `Unknown`.
    pub basis: EndBasis,
}

/// What an estimate knows of how long work holds its room: each waiting application's
/// expected run ([`Run`], by its index in [`Snapshot::apps`]), and, for the held containers
/// and waiting applications whose ends are calibrated ([`EndBasis::Calibrated`]), their end
/// or run in each of [`DRAWS`] draws ([`survival::share_left`] of their declared limit,
/// drawn from what their users' ended runs used of theirs). With draws, an estimate is the
/// median start over as many walks ([`estimates`]): a start is the first few of many ends,
/// and a walk over each end's point guess is early or late by their spread.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Expectations {
    pub runs: Vec<Run>,
    /// Held container (index in [`Snapshot::held`]) → its end (ms) in each draw.
    pub drawn_ends: HashMap<usize, [u64; DRAWS]>,
    /// Waiting application (index in [`Snapshot::apps`]) → its run (ms) in each draw.
    pub drawn_runs: HashMap<usize, [u64; DRAWS]>,
}

impl From<Vec<Run>> for Expectations {
    fn from(runs: Vec<Run>) -> Self {
        Expectations {
            runs,
            ..Expectations::default()
        }
    }
}

impl Expectations {
    fn drawn(&self) -> bool {
        !self.drawn_ends.is_empty() || !self.drawn_runs.is_empty()
    }
}

/// The expected run of `app`'s waiting tasks: the longest of its roles', each its declared
/// `maxRunSec`, else `learned(role)` (ms: the median run of the job's completed tasks of the
/// role); unknown when some role has neither.
pub fn run_of(app: &AppDemand, learned: impl Fn(&str) -> Option<u64>) -> Run {
    let mut run = Run {
        ms: Some(0),
        basis: EndBasis::Declared,
    };
    for w in app.waiting.iter().filter(|w| w.count > 0) {
        let ms = match w.max_run_sec {
            Some(s) => s.saturating_mul(1000),
            None => match learned(&w.role) {
                Some(ms) => {
                    run.basis = EndBasis::Learned;
                    ms
                }
                None => return Run::default(),
            },
        };
        run.ms = run.ms.map(|m| m.max(ms));
    }
    run
}

/// Counts of jobs by basis, added up.
fn count(b: &mut Basis, basis: EndBasis) {
    match basis {
        EndBasis::Declared => b.declared += 1,
        EndBasis::Calibrated => b.calibrated += 1,
        EndBasis::Learned => b.learned += 1,
        EndBasis::Unknown => b.unknown += 1,
        EndBasis::Leaving => {}
    }
}

fn plural(k: u32, one: &str, many: &str) -> String {
    format!("{k} {}", if k == 1 { one } else { many })
}

/// The basis in words: "declared limits of 12 running containers", "learned from …",
/// "behind 3 waiting jobs (…)", or, when no start can be told, why.
fn words(b: &Basis, ahead: &Basis, known: bool, cut: bool, drawn: bool) -> String {
    let n = |k: u32| plural(k, "running container", "running containers");
    if !known {
        let mut why = Vec::new();
        if b.unknown > 0 {
            let have = if b.unknown == 1 { "has" } else { "have" };
            why.push(format!("{} {have} no declared limit", n(b.unknown)));
        }
        if ahead.unknown > 0 {
            let s = if ahead.unknown == 1 { "s" } else { "" };
            why.push(format!(
                "{} ahead of it declare{s} no limit",
                plural(ahead.unknown, "waiting job", "waiting jobs")
            ));
        }
        if cut {
            why.push("the queue ahead is longer than an estimate walks".to_string());
        }
        if why.is_empty() {
            why.push("it does not fit on the nodes it may use as the running work is known to end".to_string());
        }
        return format!("unknown: {}", why.join("; "));
    }
    let mut parts = Vec::new();
    if b.declared > 0 {
        parts.push(format!("declared limits of {}", n(b.declared)));
    }
    if b.calibrated > 0 {
        parts.push(format!(
            "declared limits, scaled by what their users' ended runs used of theirs{}, of {}",
            if drawn {
                format!(" (the median start of {DRAWS} draws)")
            } else {
                String::new()
            },
            n(b.calibrated)
        ));
    }
    if b.learned > 0 {
        parts.push(format!(
            "learned from the run times of their jobs' completed tasks (or their users' earlier runs of the jobs) for {}",
            n(b.learned)
        ));
    }
    if parts.is_empty() {
        parts.push("room free now".to_string());
    }
    let mut s = parts.join("; ");
    if b.unknown > 0 {
        s.push_str(&format!(
            "; {} with no declared limit not counted as ending",
            n(b.unknown)
        ));
    }
    let jobs = ahead.declared + ahead.calibrated + ahead.learned + ahead.unknown;
    if jobs > 0 {
        let mut by = Vec::new();
        if ahead.declared > 0 {
            by.push(format!("{} declared", ahead.declared));
        }
        if ahead.calibrated > 0 {
            by.push(format!("{} declared and calibrated", ahead.calibrated));
        }
        if ahead.learned > 0 {
            by.push(format!("{} learned", ahead.learned));
        }
        if ahead.unknown > 0 {
            by.push(format!("{} with no limit", ahead.unknown));
        }
        s.push_str(&format!(
            "; behind {} ({})",
            plural(jobs, "waiting job", "waiting jobs"),
            by.join(", ")
        ));
    }
    s
}

/// Nodes alike for placement's feasibility rule (usable, partition, GPU type, total): the
/// rule is asked once per class, not once per node (10,000 nodes are a few classes).
struct Classes {
    /// Each node's class.
    of: Vec<usize>,
    /// One node of each class.
    rep: Vec<usize>,
}

/// A node's class bucket: usable, partition, GPU type, and its total GPUs, CPU and memory
/// (nodes of one bucket are then told apart by their whole total).
type ClassKey<'a> = (bool, &'a str, &'a str, u32, u32, u64);

impl Classes {
    fn of(snap: &Snapshot) -> Classes {
        let mut buckets: HashMap<ClassKey, Vec<usize>> = HashMap::new();
        let mut rep: Vec<usize> = Vec::new();
        let of = snap
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let key = (
                    n.usable,
                    n.partition.as_str(),
                    n.pool.as_str(),
                    n.total.gpus,
                    n.total.cpu,
                    n.total.memory_mb,
                );
                let bucket = buckets.entry(key).or_default();
                match bucket.iter().copied().find(|&c| snap.nodes[rep[c]].total == n.total) {
                    Some(c) => c,
                    None => {
                        rep.push(i);
                        bucket.push(rep.len() - 1);
                        rep.len() - 1
                    }
                }
            })
            .collect();
        Classes { of, rep }
    }

    /// Per class, whether tasks of all of `shapes` may run there (none: nowhere).
    fn allowing(&self, snap: &Snapshot, shapes: &[WaitingTasks]) -> Vec<bool> {
        self.rep
            .iter()
            .map(|&n| !shapes.is_empty() && shapes.iter().all(|w| eligible(&snap.nodes[n], w)))
            .collect()
    }
}

/// Distinct eligibility patterns (one flag per node class), each kept once, with what the
/// estimates ask of each: the running containers' bases on its nodes, and which patterns
/// share a class (so a node) with it.
#[derive(Default)]
struct Patterns {
    all: Vec<Vec<bool>>,
    index: HashMap<Vec<bool>, usize>,
    basis: HashMap<usize, Basis>,
}

impl Patterns {
    fn id(&mut self, ok: Vec<bool>) -> usize {
        if let Some(&i) = self.index.get(&ok) {
            return i;
        }
        self.all.push(ok.clone());
        self.index.insert(ok, self.all.len() - 1);
        self.all.len() - 1
    }

    /// Whether patterns `a` and `b` share a class (a pass over the classes, a handful; not
    /// remembered, so adversarially many distinct shapes cost time, never memory).
    fn overlap(&self, a: usize, b: usize) -> bool {
        self.all[a].iter().zip(&self.all[b]).any(|(x, y)| *x && *y)
    }

    /// The bases of the running containers on pattern `p`'s nodes.
    fn basis(&mut self, p: usize, snap: &Snapshot, classes: &Classes) -> Basis {
        let ok = &self.all[p];
        *self.basis.entry(p).or_insert_with(|| {
            let mut b = Basis::default();
            for (i, h) in snap.held.iter().enumerate() {
                let class = classes.of.get(h.node).copied();
                if class.and_then(|c| ok.get(c)).copied().unwrap_or(false) {
                    count(&mut b, end_of(snap, i).basis);
                }
            }
            b
        })
    }
}

/// The waiting shapes of an application as eligibility reads them (counts, roles and run
/// limits aside): applications of the same shapes share one pattern.
fn shapes_of(app: &AppDemand) -> Vec<WaitingTasks> {
    app.waiting
        .iter()
        .filter(|w| w.count > 0)
        .map(|w| WaitingTasks {
            role: String::new(),
            count: 1,
            max_run_sec: None,
            ..w.clone()
        })
        .collect()
}

/// Distinct times one estimate walk goes through at most, and the packing work (tasks
/// tried × nodes) it does at most: past them, a job's start is not told (bounds the
/// scheduling pass on a large, busy cluster; `gpuam bench cluster` measures it).
pub const MAX_STEPS: usize = 4096;
pub const MAX_WORK: usize = 50_000_000;

/// Every waiting application's expected start (`None` for one with nothing waiting), from
/// one walk of the queue ([`walk::starts`]): the applications in the scheduler's order
/// (queue ratio, priority, age), each on the nodes it may use, holding its room for its
/// expected run (`runs`, per application); the running containers' expected ends free
/// room; whoever fits takes room (the gate lets work take room nobody ranked ahead can use
/// now), and behind the `holder`'s reservation only what the reservation lets pass.
/// `watch`: only that application's start is wanted (the walk stops when it starts).
pub fn estimates(
    snap: &Snapshot,
    shares: &Shares,
    holder: Option<&Holder>,
    expect: &Expectations,
    now_ms: u64,
    watch: Option<usize>,
) -> Vec<Option<StartEstimate>> {
    let runs = &expect.runs;
    let mut order: Vec<usize> = (0..snap.apps.len())
        .filter(|&a| snap.apps[a].waiting.iter().any(|w| w.count > 0))
        .collect();
    order.sort_by(|&x, &y| rank_cmp(&rank(shares, None, &snap.apps[x]), &rank(shares, None, &snap.apps[y])));
    let mut patterns = Patterns::default();
    let classes = Classes::of(snap);
    // Distinct shape lists and their patterns: the rule is asked once per class and shape.
    let mut seen_shapes: HashMap<Vec<WaitingTasks>, usize> = HashMap::new();
    let queued: Vec<(usize, Vec<Room>, Run, usize)> = order
        .iter()
        .map(|&a| {
            let shapes = shapes_of(&snap.apps[a]);
            let p = match seen_shapes.get(&shapes) {
                Some(&p) => p,
                None => {
                    let p = patterns.id(classes.allowing(snap, &shapes));
                    seen_shapes.insert(shapes, p);
                    p
                }
            };
            (a, tasks_of(snap, a), runs.get(a).copied().unwrap_or_default(), p)
        })
        .collect();
    // A job that may use every node needs no mask.
    let everywhere: Vec<bool> = patterns.all.iter().map(|ok| ok.iter().all(|&x| x)).collect();
    // A gang starts all its tasks or none; a job that is no gang starts them one by one,
    // as the gate admits its asks.
    let queue: Vec<Queued> = queued
        .iter()
        .map(|(a, tasks, run, p)| Queued {
            tasks,
            duration_ms: run.ms,
            eligible: (!everywhere[*p]).then(|| Nodes {
                class: &classes.of,
                ok: &patterns.all[*p],
            }),
            one_by_one: !snap.apps[*a].gang,
        })
        .collect();
    let (free, releases) = (free_rooms(snap), releases(snap));
    let d = Discipline {
        in_order: false,
        reservation: holder.and_then(|h| {
            let at = order.iter().position(|&a| a == h.app)?;
            Some(Reserved {
                holder: at,
                reservation: h.reservation.clone(),
                exempt_below: at,
            })
        }),
        // The walk goes on until every one of its tasks has started.
        watch: watch.and_then(|w| order.iter().position(|&a| a == w)),
        max_steps: MAX_STEPS,
        max_work: MAX_WORK,
    };
    let walked = walk::starts(&free, &releases, &queue, now_ms, d.clone());
    // With drawn ends, each job's first and last start in every draw's walk; the estimate
    // is their median (the point walk above still says who waits behind the reservation
    // and whether the walk was cut).
    let drawn = expect.drawn().then(|| {
        let mut firsts: Vec<Vec<Option<u64>>> = vec![Vec::with_capacity(DRAWS); queued.len()];
        let mut lasts: Vec<Vec<Option<u64>>> = vec![Vec::with_capacity(DRAWS); queued.len()];
        for k in 0..DRAWS {
            let releases_k: Vec<Release> = releases
                .iter()
                .enumerate()
                .map(|(h, r)| match expect.drawn_ends.get(&h) {
                    Some(ends) => Release {
                        end_ms: Some(ends[k]),
                        ..*r
                    },
                    None => *r,
                })
                .collect();
            let queue_k: Vec<Queued> = queue
                .iter()
                .zip(&queued)
                .map(|(q, (a, ..))| match expect.drawn_runs.get(a) {
                    Some(runs) => Queued {
                        duration_ms: Some(runs[k]),
                        ..*q
                    },
                    None => *q,
                })
                .collect();
            let w = walk::starts(&free, &releases_k, &queue_k, now_ms, d.clone());
            for (j, (_, tasks, ..)) in queued.iter().enumerate() {
                firsts[j].push(w.start_ms[j]);
                lasts[j].push(w.last_ms(j, tasks.len()));
            }
        }
        (firsts, lasts)
    });
    // Each application's jobs ahead, by basis, counted where their nodes overlap its own.
    let mut seen: Vec<Basis> = vec![Basis::default(); patterns.all.len()];
    let mut out: Vec<Option<StartEstimate>> = vec![None; snap.apps.len()];
    for (k, (a, tasks, run, p)) in queued.iter().enumerate() {
        let mut ahead = Basis::default();
        for (q, b) in seen.iter().enumerate() {
            if !b.is_zero() && patterns.overlap(*p, q) {
                ahead.add(b);
            }
        }
        count(&mut seen[*p], run.basis);
        if watch.is_some_and(|w| w != *a) {
            continue;
        }
        let basis = patterns.basis(*p, snap, &classes);
        // More waiting tasks than a walk takes ([`MAX_TASKS`]): a gang's start, and the
        // last task's of a job that is no gang, lie past what was walked.
        let waiting: u64 = snap.apps[*a].waiting.iter().map(|w| u64::from(w.count)).sum();
        let beyond = waiting > tasks.len() as u64;
        let gang = snap.apps[*a].gang;
        let (start_ms, last) = match drawn.as_ref() {
            Some((firsts, lasts)) => (
                survival::median_start(&mut firsts[k].clone()),
                survival::median_start(&mut lasts[k].clone()),
            ),
            None => (walked.start_ms[k], walked.last_ms(k, tasks.len())),
        };
        let start_ms = start_ms.filter(|_| !(gang && beyond));
        let last = last.filter(|_| !beyond);
        let all_start_ms = last.filter(|&l| start_ms.is_some_and(|s| l > s));
        let cut = walked.cut && start_ms.is_none();
        let mut text = if gang && beyond {
            format!(
                "unknown: a gang of {waiting} waiting tasks, more than an estimate walks ({})",
                tasks.len()
            )
        } else {
            words(&basis, &ahead, start_ms.is_some(), cut, drawn.is_some())
        };
        if start_ms.is_some() && last.is_none() {
            text.push_str(&if beyond {
                format!(
                    "; when its last waiting tasks start is past what an estimate walks ({waiting} waiting, {} walked)",
                    tasks.len()
                )
            } else if walked.cut {
                "; when its last waiting tasks start is past what an estimate walks".to_string()
            } else {
                "; when its last waiting tasks start cannot be told".to_string()
            });
        }
        let mut after = None;
        if holder.is_some_and(|h| h.app == *a) {
            text = format!("reserved for it; {text}");
        } else if let Some(h) = holder.filter(|_| walked.held_back[k]) {
            let label = holder_label(snap, h);
            text.push_str(&format!("; after the reservation of {label}"));
            after = Some(label);
        }
        out[*a] = Some(StartEstimate {
            start_ms,
            all_start_ms,
            basis,
            queue_ahead: ahead,
            after_reservation_of: after,
            text,
        });
    }
    out
}

/// The estimate of a job with no task waiting: it needs nothing to start.
pub fn nothing_waits(now_ms: u64) -> StartEstimate {
    StartEstimate {
        start_ms: Some(now_ms),
        all_start_ms: None,
        basis: Basis::default(),
        queue_ahead: Basis::default(),
        after_reservation_of: None,
        text: "no task waits".to_string(),
    }
}

/// An estimate of an application that its queue holds back (`queue_cause`: the scheduler's
/// reason, when it is a queue's — a cap, a share, one ranked ahead): room free now says
/// nothing of when its turn comes, so that start is not told.
pub fn held_by_queue(mut e: StartEstimate, queue_cause: Option<&str>, now_ms: u64) -> StartEstimate {
    if let Some(cause) = queue_cause {
        if e.start_ms.is_some_and(|s| s <= now_ms) {
            e.start_ms = None;
            e.all_start_ms = None;
            e.text = format!("unknown: the room it needs is free, but its queue holds it back ({cause})");
        }
    }
    e
}

/// The reservation settings as the RM reads them: a bound of 0 turns that rule off.
pub fn policy(wait_sec: u64, min_gpus: u32) -> Policy {
    Policy {
        wait_bound_ms: if wait_sec == 0 {
            u64::MAX
        } else {
            wait_sec.saturating_mul(1000)
        },
        min_gpus: if min_gpus == 0 { u32::MAX } else { min_gpus },
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{tree, waiting, Cluster};
    use super::super::{gate, gate_reserved, queues::QueueTree, WaitReason};
    use super::*;
    use crate::resources::PortSet;

    /// Two 8-GPU nodes; app 0 holds 4 GPUs on each, ending (declared) at 100 s and 200 s;
    /// app 1, a gang of 2 × 8 GPUs, waits; app 2, a small job, waits for 4 GPUs.
    fn world() -> (QueueTree, Snapshot) {
        let mut c = Cluster::new(QueueTree::default(), &[8, 8]);
        c.app("default", 0, false, vec![]);
        c.app("default", 0, true, vec![waiting(2, 8)]);
        c.app("default", 0, false, vec![waiting(1, 4)]);
        hold_until(&mut c, 0, 4, &[(0, 100_000), (1, 200_000)]);
        (c.t, c.s)
    }

    /// `app` holds `gpus` GPUs on each node of `ends`, declared to end then.
    fn hold_until(c: &mut Cluster, app: usize, gpus: u32, ends: &[(usize, u64)]) {
        for &(n, end) in ends {
            c.hold(app, n, gpus, 0);
            c.s.ends.push(Expected {
                end_ms: Some(end),
                basis: EndBasis::Declared,
            });
        }
    }

    fn four_on(n: usize) -> Vec<(usize, Resources)> {
        vec![(n, Resources::with_mask(1, 100, 0xf0, PortSet::new()))]
    }

    /// The starvation the reservation ends: the plain gate lets the small job take the
    /// GPUs that free (the gang fits neither before nor after, so nobody "loses"); with
    /// the reservation, a small job that declares no end (or one past the gang's start)
    /// waits, and one declared to end first backfills.
    #[test]
    fn a_big_gang_starves_without_a_reservation_and_is_reserved_with_one() {
        let (tree, s) = world();
        let shares = Shares::compute(&tree, &s);
        assert_eq!(gate(&tree, &s, &shares, 2, &four_on(0)), Ok(()), "starved before");
        let p16 = policy(0, 16);
        let h = holder(&s, &shares, &p16, 0).expect("the gang of 16 GPUs is reserved");
        assert_eq!((h.app, h.reservation.start_ms), (1, 200_000));
        let long = gate_reserved(&tree, &s, &shares, 2, &four_on(0), Some(&h), None, 0);
        assert!(
            matches!(&long, Err(WaitReason::Reserved { gang, start_ms: 200_000, .. })
                if gang.starts_with("a waiting gang of ") && !gang.contains("app1")),
            "{long:?}"
        );
        assert_eq!(long.unwrap_err().reason().kind, crate::reason::Kind::Priority);
        let late = gate_reserved(&tree, &s, &shares, 2, &four_on(1), Some(&h), Some(200_001), 0);
        assert!(late.is_err(), "ends after the gang's start");
        assert_eq!(
            gate_reserved(&tree, &s, &shares, 2, &four_on(0), Some(&h), Some(150_000), 0),
            Ok(()),
            "a short declared job backfills"
        );
        // The gang's own asks pass; a policy it does not meet reserves nothing.
        assert_eq!(
            gate_reserved(&tree, &s, &shares, 1, &four_on(0), Some(&h), None, 0),
            Ok(())
        );
        assert!(holder(&s, &shares, &policy(0, 17), 0).is_none());
        assert!(holder(&s, &shares, &policy(10, 0), 5000).is_none());
        assert!(
            holder(&s, &shares, &policy(10, 0), 20_000).is_some(),
            "waited past the bound"
        );
    }

    /// Every waiting application's estimate, declared runs of `secs` per application.
    fn all(s: &Snapshot, shares: &Shares, h: Option<&Holder>, secs: &[Option<u64>]) -> Vec<Option<StartEstimate>> {
        let runs: Vec<Run> = s
            .apps
            .iter()
            .enumerate()
            .map(|(a, app)| {
                let mut app = app.clone();
                for w in &mut app.waiting {
                    w.max_run_sec = secs.get(a).copied().flatten();
                }
                run_of(&app, |_| None)
            })
            .collect();
        estimates(s, shares, h, &runs.into(), 0, None)
    }

    /// With drawn ends (calibrated limits), an estimate is the median start over the draws'
    /// walks, not the start of the point ends' walk; a draw's run of a job ahead counts too.
    #[test]
    fn drawn_ends_give_the_median_start_of_their_walks() {
        // One 8-GPU node held by app 0 until 100 s (its point end); apps 1 and 2 each wait
        // for the whole node, 1 first.
        let mut c = Cluster::new(QueueTree::default(), &[8]);
        c.app("default", 0, false, vec![]);
        c.app("default", 0, false, vec![waiting(1, 8)]);
        c.app("default", 0, false, vec![waiting(1, 8)]);
        hold_until(&mut c, 0, 8, &[(0, 100_000)]);
        let shares = Shares::compute(&c.t, &c.s);
        let point = estimates(&c.s, &shares, None, &vec![Run::default(); 3].into(), 0, None);
        assert_eq!(point[1].as_ref().unwrap().start_ms, Some(100_000));
        assert_eq!(point[2].as_ref().unwrap().start_ms, None, "app 1's run is unknown");
        // Drawn: the node frees at (k + 1) × 10 s in draw k, and app 1 then runs 5 s.
        let mut e = Expectations::from(vec![Run::default(); 3]);
        e.drawn_ends.insert(0, std::array::from_fn(|k| (k as u64 + 1) * 10_000));
        e.drawn_runs.insert(1, [5_000; DRAWS]);
        let est = estimates(&c.s, &shares, None, &e, 0, None);
        assert_eq!(
            est[1].as_ref().unwrap().start_ms,
            Some(80_000),
            "the 8th of 15: {:?}",
            est[1]
        );
        assert_eq!(est[2].as_ref().unwrap().start_ms, Some(85_000), "{:?}", est[2]);
        // Without app 1's drawn run, app 2 never starts in any walk: no start is told.
        e.drawn_runs.clear();
        let est = estimates(&c.s, &shares, None, &e, 0, None);
        assert_eq!(est[2].as_ref().unwrap().start_ms, None);
    }

    /// A job that is no gang starts when its first waiting task does, and says when its last
    /// one will; a gang of the same tasks starts when all of them fit.
    #[test]
    fn a_job_that_is_no_gang_starts_task_by_task() {
        for gang in [false, true] {
            let mut c = Cluster::new(QueueTree::default(), &[8, 8]);
            c.app("default", 0, false, vec![]);
            c.app("default", 0, gang, vec![waiting(3, 4)]);
            // 4 GPUs free on node 0 now, node 1 whole at 100 s, node 0 whole at 300 s.
            hold_until(&mut c, 0, 4, &[(0, 300_000)]);
            hold_until(&mut c, 0, 8, &[(1, 100_000)]);
            let shares = Shares::compute(&c.t, &c.s);
            let e = all(&c.s, &shares, None, &[]);
            let job = e[1].clone().unwrap();
            let (start, last) = if gang { (100_000, None) } else { (0, Some(100_000)) };
            assert_eq!(
                (job.start_ms, job.all_start_ms),
                (Some(start), last),
                "gang {gang}: {job:?}"
            );
            // Watched alone, the walk goes on until its last task has started.
            let runs = vec![Run::default(); c.s.apps.len()];
            let watched = estimates(&c.s, &shares, None, &runs.into(), 0, Some(1));
            assert_eq!(
                watched[1].as_ref().map(|e| (e.start_ms, e.all_start_ms)),
                Some((Some(start), last))
            );
            // With no end known for node 1 (and none declared for the job, which so holds
            // what it takes), the gang's start and the last task's cannot be told.
            c.s.ends[1] = Expected::default();
            let job = all(&c.s, &shares, None, &[])[1].clone().unwrap();
            if gang {
                assert_eq!(job.start_ms, None, "{job:?}");
            } else {
                assert_eq!((job.start_ms, job.all_start_ms), (Some(0), None), "{job:?}");
                assert!(
                    job.text.ends_with("; when its last waiting tasks start cannot be told"),
                    "{}",
                    job.text
                );
            }
        }
    }

    /// A job of more waiting tasks than a walk takes: a gang's start is not told (its first
    /// tasks alone would fit sooner than all of them), nor the last task's of a job that is
    /// no gang; each says why.
    #[test]
    fn a_job_of_more_tasks_than_a_walk_takes_is_not_told_what_lies_past_it() {
        for gang in [false, true] {
            let mut c = Cluster::new(QueueTree::default(), &[8, 8]);
            c.app("default", 0, gang, vec![waiting(MAX_TASKS as u32 + 1, 0)]);
            let shares = Shares::compute(&c.t, &c.s);
            let e = all(&c.s, &shares, None, &[Some(60)])[0].clone().unwrap();
            if gang {
                assert_eq!(e.start_ms, None, "{e:?}");
                assert!(e.text.contains("more than an estimate walks (4096)"), "{}", e.text);
            } else {
                assert_eq!((e.start_ms, e.all_start_ms), (Some(0), None), "{e:?}");
                assert!(e.text.contains("(4097 waiting, 4096 walked)"), "{}", e.text);
            }
        }
    }

    /// A container with no known end is never counted as freeing: with one, the gang's
    /// start cannot be told, and the estimate says why.
    #[test]
    fn estimates_rest_on_known_ends_and_say_their_basis() {
        let (tree, mut s) = world();
        let shares = Shares::compute(&tree, &s);
        let h = holder(&s, &shares, &policy(0, 16), 0);
        let e = all(&s, &shares, h.as_ref(), &[]);
        assert!(e[0].is_none(), "nothing of app 0 waits");
        let gang = e[1].clone().unwrap();
        assert_eq!(gang.start_ms, Some(200_000));
        assert!(
            gang.text
                .starts_with("reserved for it; declared limits of 2 running containers"),
            "{}",
            gang.text
        );
        // The small job would fit now (4 free on each node) but only on the gang's room:
        // it waits for the gang, which declares no limit, so its start cannot be told.
        let small = e[2].clone().unwrap();
        // Named by its size, never by the other application's id.
        let after = small.after_reservation_of.clone().unwrap_or_default();
        assert!(after.starts_with("a waiting gang of "), "{small:?}");
        assert!(!after.contains("app1") && !small.text.contains("app1"), "{small:?}");
        assert_eq!(small.start_ms, None);
        assert!(
            small.text.contains("1 waiting job ahead of it declares no limit"),
            "{}",
            small.text
        );
        assert_eq!(small.queue_ahead.unknown, 1);
        // The gang declares 1000 s: the small job starts when it ends.
        let e = all(&s, &shares, h.as_ref(), &[None, Some(1000), None]);
        let small = e[2].clone().unwrap();
        assert_eq!(small.start_ms, Some(1_200_000));
        assert!(
            small.text.contains("behind 1 waiting job (1 declared)"),
            "{}",
            small.text
        );
        // Declared to end by the gang's start, it backfills now.
        let e = all(&s, &shares, h.as_ref(), &[None, Some(1000), Some(50)]);
        assert_eq!(e[2].as_ref().and_then(|e| e.start_ms), Some(0));
        assert_eq!(e[2].as_ref().and_then(|e| e.after_reservation_of.clone()), None);
        s.ends[1] = Expected::default();
        let h = holder(&s, &shares, &policy(0, 16), 0);
        assert!(h.is_none(), "no known end on node 1: no start can be told");
        let e = all(&s, &shares, None, &[]);
        let gang = e[1].clone().unwrap();
        assert_eq!(gang.start_ms, None);
        assert_eq!(gang.text, "unknown: 1 running container has no declared limit");
        // Learned ends count, and are named.
        s.ends[1] = Expected {
            end_ms: Some(50_000),
            basis: EndBasis::Learned,
        };
        let gang = all(&s, &shares, None, &[None, None, Some(10)])[1].clone().unwrap();
        assert_eq!(gang.start_ms, Some(100_000));
        assert!(
            gang.text.contains("declared limits of 1") && gang.text.contains("learned"),
            "{}",
            gang.text
        );
    }

    /// The queue ahead: a job behind others waits for the room they take and the time they
    /// hold it, on the nodes both may use; a job ahead on other nodes does not delay it.
    #[test]
    fn a_waiting_job_starts_after_the_jobs_ahead_of_it() {
        let mut c = Cluster::new(QueueTree::default(), &[8, 8]);
        let runner = c.app("default", 0, false, vec![]);
        let first = c.app("default", 0, false, vec![waiting(1, 8)]);
        let second = c.app("default", 0, false, vec![waiting(1, 8)]);
        let third = c.app("default", 0, false, vec![waiting(1, 8)]);
        hold_until(&mut c, runner, 8, &[(0, 100_000), (1, 300_000)]);
        let shares = Shares::compute(&c.t, &c.s);
        // Each holds its node 1000 s: the first gets node 0 at 100 s, the second node 1 at
        // 300 s, the third node 0 again when the first ends, at 1100 s.
        let e = all(&c.s, &shares, None, &[None, Some(1000), Some(1000), Some(1000)]);
        let start = |a: usize| e[a].as_ref().and_then(|e| e.start_ms);
        assert_eq!(
            (start(first), start(second), start(third)),
            (Some(100_000), Some(300_000), Some(1_100_000))
        );
        let third_e = e[third].clone().unwrap();
        assert_eq!(third_e.queue_ahead.declared, 2);
        assert!(
            third_e.text.contains("behind 2 waiting jobs (2 declared)"),
            "{}",
            third_e.text
        );
        // Without the queue ahead, the third would have been told 100 s.
        assert_eq!(
            reservation::reserve(&inputs(&c.s, third).0, &inputs(&c.s, third).1, &[g8()], 0).map(|r| r.start_ms),
            Some(100_000)
        );
        // The second's run unknown: it never gives node 1 back, and the third still gets
        // node 0 after the first.
        let e = all(&c.s, &shares, None, &[None, Some(1000), None, Some(1000)]);
        assert_eq!(e[third].as_ref().and_then(|e| e.start_ms), Some(1_100_000));
        // The first's unknown too: the third's start cannot be told, and it says why.
        let e = all(&c.s, &shares, None, &[None, None, None, Some(1000)]);
        let t = e[third].clone().unwrap();
        assert_eq!(t.start_ms, None);
        assert_eq!(t.text, "unknown: 2 waiting jobs ahead of it declare no limit");
        // Types: the second may only use node 1, the third only node 0; the second is not
        // ahead of it there.
        c.s.nodes[0].pool = "a".into();
        c.s.nodes[1].pool = "b".into();
        c.s.apps[second].waiting[0].gpu_types = vec!["b".into()];
        c.s.apps[third].waiting[0].gpu_types = vec!["a".into()];
        let shares = Shares::compute(&c.t, &c.s);
        let e = all(&c.s, &shares, None, &[None, Some(1000), Some(1000), Some(1000)]);
        let t = e[third].clone().unwrap();
        assert_eq!(t.start_ms, Some(1_100_000), "behind the first only");
        assert_eq!(t.queue_ahead.declared, 1, "the second is on other nodes: {t:?}");
        assert_eq!(t.basis.declared, 1, "one running container on node 0");
        // Only the watched application is estimated.
        let runs = vec![Run::default(); 4];
        let one = estimates(&c.s, &shares, None, &runs.into(), 0, Some(first));
        assert!(one[first].is_some() && one[third].is_none());
    }

    /// Nodes alike in everything the classes bucket by but their ports are told apart: a
    /// job that needs a port only one of them offers waits for that one.
    #[test]
    fn nodes_that_differ_only_in_their_ports_are_told_apart() {
        let mut c = Cluster::new(QueueTree::default(), &[8, 8]);
        let runner = c.app("default", 0, false, vec![]);
        let ported = WaitingTasks {
            ports: PortSet::range(9000, 9000),
            ..waiting(1, 8)
        };
        let job = c.app("default", 0, false, vec![ported]);
        hold_until(&mut c, runner, 8, &[(0, 100_000), (1, 300_000)]);
        let shares = Shares::compute(&c.t, &c.s);
        let start = |s: &Snapshot| all(s, &shares, None, &[])[job].as_ref().and_then(|e| e.start_ms);
        assert_eq!(start(&c.s), None, "no node offers port 9000");
        c.s.nodes[1].total.ports = PortSet::range(8000, 9999);
        assert_eq!(start(&c.s), Some(300_000), "only node 1 offers it");
        c.s.nodes[0].total.ports = PortSet::range(8000, 9999);
        assert_eq!(start(&c.s), Some(100_000));
    }

    fn g8() -> Room {
        Room {
            gpus: 8,
            cpu: 1,
            memory_mb: 100,
        }
    }

    /// Queue shares come first: an application of a queue further below its share than the
    /// gang's ranks ahead of the gang and is never held back by its reservation; one of the
    /// gang's own queue, ranked behind it, is.
    #[test]
    fn a_queue_below_its_share_is_not_held_back_by_another_queues_gang() {
        let t = tree(&[("a", 1.0, 0, None, false), ("b", 1.0, 0, None, false)]);
        let mut c = Cluster::new(t, &[8, 8]);
        let runner = c.app("a", 0, false, vec![]);
        c.app("a", 0, true, vec![waiting(2, 8)]);
        let late_a = c.app("a", 0, false, vec![waiting(1, 4)]);
        let b = c.app("b", 0, false, vec![waiting(1, 4)]);
        for n in 0..2 {
            c.hold(runner, n, 4, 0);
            c.s.ends.push(Expected {
                end_ms: Some(100_000),
                basis: EndBasis::Declared,
            });
        }
        let shares = Shares::compute(&c.t, &c.s);
        let h = holder(&c.s, &shares, &policy(0, 16), 0).expect("reserved");
        assert_eq!(h.app, 1);
        assert_eq!(
            gate_reserved(&c.t, &c.s, &shares, b, &four_on(0), Some(&h), None, 0),
            Ok(()),
            "queue b holds nothing: it ranks ahead of queue a's gang"
        );
        assert!(gate_reserved(&c.t, &c.s, &shares, late_a, &four_on(0), Some(&h), None, 0).is_err());
    }

    /// Room free now does not tell when a job its queue holds back starts.
    #[test]
    fn a_job_its_queue_holds_back_gets_no_start_from_free_room() {
        let now = StartEstimate {
            start_ms: Some(10),
            all_start_ms: Some(20),
            basis: Basis::default(),
            queue_ahead: Basis::default(),
            after_reservation_of: None,
            text: "room free now".into(),
        };
        let e = held_by_queue(now.clone(), Some("atCap"), 10);
        assert_eq!((e.start_ms, e.all_start_ms), (None, None));
        assert!(e.text.starts_with("unknown:") && e.text.contains("atCap"), "{}", e.text);
        assert_eq!(held_by_queue(now.clone(), None, 10), now);
        let later = StartEstimate {
            start_ms: Some(500),
            ..now
        };
        assert_eq!(
            held_by_queue(later.clone(), Some("atCap"), 10),
            later,
            "a later start stands"
        );
    }
}
