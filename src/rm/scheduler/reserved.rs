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
//! - [`estimate`]: when a waiting application is expected to start, with the basis of the
//!   estimate (declared limits, learned run times, or why it is unknown) — the same
//!   `reserve` over the same state.
//!
//! A held container's end is what the snapshot's [`Snapshot::ends`] says: its declared
//! limit, else a learned one, else unknown; a container with no known end is never counted
//! as freeing its room, so a reservation only relies on ends it knows.

use serde::Serialize;

pub use crate::protocol::{StartBasis as Basis, StartEstimate};

use super::reservation::{self, Policy, Release, Reservation, Room};
use super::{eligible, rank, rank_cmp, Shares, Snapshot};
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
    /// Learned: the median run time of its job's completed tasks of the same role.
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

/// What `reserve` needs for application `a`'s waiting tasks: the free room of each node
/// (none where its tasks may not go), the releases there, its tasks; and the basis counts
/// of the containers that hold room on those nodes.
fn inputs(snap: &Snapshot, a: usize) -> (Vec<Room>, Vec<Release>, Vec<Room>, Basis) {
    let app = &snap.apps[a];
    let waiting: Vec<_> = app.waiting.iter().filter(|w| w.count > 0).collect();
    let ok: Vec<bool> = snap
        .nodes
        .iter()
        .map(|n| !waiting.is_empty() && waiting.iter().all(|w| eligible(n, w)))
        .collect();
    let free = snap
        .nodes
        .iter()
        .zip(&ok)
        .map(|(n, &ok)| {
            if ok {
                Room {
                    gpus: n.free_gpus.count_ones(),
                    cpu: n.free_cpu,
                    memory_mb: n.free_memory_mb,
                }
            } else {
                Room::default()
            }
        })
        .collect();
    let mut basis = Basis::default();
    let mut releases = Vec::new();
    for (i, h) in snap.held.iter().enumerate() {
        if !ok.get(h.node).copied().unwrap_or(false) {
            continue;
        }
        let e = end_of(snap, i);
        match e.basis {
            EndBasis::Declared => basis.declared += 1,
            EndBasis::Learned => basis.learned += 1,
            EndBasis::Unknown => basis.unknown += 1,
            EndBasis::Leaving => {}
        }
        releases.push(Release {
            node: h.node,
            room: Room {
                gpus: h.gpus.count_ones(),
                cpu: h.cpu,
                memory_mb: h.memory_mb,
            },
            end_ms: e.end_ms,
        });
    }
    let tasks = waiting
        .iter()
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
        .collect();
    (free, releases, tasks, basis)
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
    let (free, releases, tasks, _) = inputs(snap, a);
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

/// The basis in words: "declared limits of 12 running containers", "learned from …",
/// or "unknown: N running containers have no declared limit".
fn words(b: &Basis, known: bool) -> String {
    let n = |k: u32| format!("{k} running container{}", if k == 1 { "" } else { "s" });
    if !known {
        let have = if b.unknown == 1 { "has" } else { "have" };
        return format!("unknown: {} {have} no declared limit", n(b.unknown));
    }
    let mut parts = Vec::new();
    if b.declared > 0 {
        parts.push(format!("declared limits of {}", n(b.declared)));
    }
    if b.learned > 0 {
        parts.push(format!(
            "learned from the median run time of their jobs' completed tasks for {}",
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
    s
}

/// When waiting application `a` is expected to start, by `reserve` over the snapshot's
/// held containers and their expected ends; `holder` (another gang's reservation) puts it
/// after that gang's start when its tasks could only go on the reserved room.
pub fn estimate(snap: &Snapshot, shares: &Shares, holder: Option<&Holder>, a: usize, now_ms: u64) -> StartEstimate {
    let (free, releases, tasks, basis) = inputs(snap, a);
    if let Some(h) = holder.filter(|h| h.app == a) {
        return StartEstimate {
            start_ms: Some(h.reservation.start_ms),
            basis,
            after_reservation_of: None,
            text: format!("reserved for it; {}", words(&basis, true)),
        };
    }
    let start = reservation::reserve(&free, &releases, &tasks, now_ms);
    let mut after = None;
    let start_ms = start.map(|r| {
        // Behind a reservation it cannot backfill: not before the gang's start.
        match holder {
            Some(h) if !admits_rooms(snap, shares, h, a, None, &placed(&r, &tasks), None) => {
                after = Some(holder_label(snap, h));
                r.start_ms.max(h.reservation.start_ms)
            }
            _ => r.start_ms,
        }
    });
    let mut text = words(&basis, start_ms.is_some());
    if let Some(g) = &after {
        text.push_str(&format!("; after the reservation of {g}"));
    }
    StartEstimate {
        start_ms,
        basis,
        after_reservation_of: after,
        text,
    }
}

/// An estimate of an application that its queue holds back (`queue_cause`: the scheduler's
/// reason, when it is a queue's — a cap, a share, one ranked ahead): room free now says
/// nothing of when its turn comes, so that start is not told.
pub fn held_by_queue(mut e: StartEstimate, queue_cause: Option<&str>, now_ms: u64) -> StartEstimate {
    if let Some(cause) = queue_cause {
        if e.start_ms.is_some_and(|s| s <= now_ms) {
            e.start_ms = None;
            e.text = format!("unknown: the room it needs is free, but its queue holds it back ({cause})");
        }
    }
    e
}

/// `tasks` on the nodes `at` finds for them.
fn placed(at: &Reservation, tasks: &[Room]) -> Vec<(usize, Room)> {
    at.nodes.iter().copied().zip(tasks.iter().copied()).collect()
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
        for (n, end) in [(0, 100_000), (1, 200_000)] {
            c.hold(0, n, 4, 0);
            c.s.ends.push(Expected {
                end_ms: Some(end),
                basis: EndBasis::Declared,
            });
        }
        (c.t, c.s)
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

    /// A container with no known end is never counted as freeing: with one, the gang's
    /// start cannot be told, and the estimate says why.
    #[test]
    fn estimates_rest_on_known_ends_and_say_their_basis() {
        let (tree, mut s) = world();
        let shares = Shares::compute(&tree, &s);
        let h = holder(&s, &shares, &policy(0, 16), 0);
        let e = estimate(&s, &shares, h.as_ref(), 1, 0);
        assert_eq!(e.start_ms, Some(200_000));
        assert!(e.text.contains("declared limits of 2 running containers"), "{}", e.text);
        // The small job fits now (4 free on each node) and is told so, behind nobody.
        let small = estimate(&s, &shares, h.as_ref(), 2, 0);
        // Named by its size, never by the other application's id.
        let after = small.after_reservation_of.clone().unwrap_or_default();
        assert!(after.starts_with("a waiting gang of "), "{small:?}");
        assert!(!after.contains("app1") && !small.text.contains("app1"), "{small:?}");
        assert_eq!(
            small.start_ms,
            Some(200_000),
            "it could only start beside the gang's room then"
        );
        s.ends[1] = Expected::default();
        let h = holder(&s, &shares, &policy(0, 16), 0);
        assert!(h.is_none(), "no known end on node 1: no start can be told");
        let e = estimate(&s, &shares, None, 1, 0);
        assert_eq!(e.start_ms, None);
        assert_eq!(e.text, "unknown: 1 running container has no declared limit");
        // Learned ends count, and are named.
        s.ends[1] = Expected {
            end_ms: Some(50_000),
            basis: EndBasis::Learned,
        };
        let e = estimate(&s, &shares, None, 1, 0);
        assert_eq!(e.start_ms, Some(100_000));
        assert!(
            e.text.contains("declared limits of 1") && e.text.contains("learned"),
            "{}",
            e.text
        );
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
            basis: Basis::default(),
            after_reservation_of: None,
            text: "room free now".into(),
        };
        let e = held_by_queue(now.clone(), Some("atCap"), 10);
        assert_eq!(e.start_ms, None);
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
