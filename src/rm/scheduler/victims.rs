//! Victim choice: which containers to take back so that waiting tasks fit, at least cost.
//!
//! A unit is what is preempted at once: one container, or every live container of a gang
//! application. Units and limits are in hundredths of a GPU (a container holding part of a
//! GPU is a unit of its part). Each victim queue may lose at most its `limit` (its use
//! above its share). Two plans are made and the better one kept:
//! - by count: per victim queue, an exact 0/1 knapsack over its units reaching the GPUs
//!   still needed with the fewest GPUs (then the lowest priorities, the least run time
//!   lost, the fewest containers) — right for one-GPU tasks, and it finds "the gang plus
//!   two singles" where taking singles one by one would stall below the need (units of
//!   whole GPUs only: a share frees no GPU by itself);
//! - by node: task by task, the node where the cheapest set of units makes the task fit
//!   (GPUs, CPU and memory on that node, exactly there), the best GPU set after it as a
//!   tie-break — right for multi-GPU tasks and topology, and for shares: a shared GPU
//!   counts as room only in a set that takes every share on it (`Scratch`), so its
//!   candidates are whole-GPU units, gangs, and per shared GPU every other share on it as
//!   one group (`groups`): however a GPU is split, it is one candidate.
//!
//! - the swap, only where neither plan lets any task fit: a whole gang bigger than its
//!   queue's limit, when what it frees beyond the limit is at most the GPUs needed and the
//!   queue's own waiting work (not gangs of several tasks) takes it back, so the queue ends
//!   at its share in other jobs of its own. Without it, a demand that arrives in steps (an
//!   earlier step took the queue's singles) leaves the other queue short for as long as a
//!   gang holds the excess.
//!
//! A plan is scored by the tasks it lets fit (more first), then its cost.

use std::collections::BTreeMap;

use super::{eligible, fits_in, Scratch, Snapshot};
use crate::protocol::WaitingTasks;
use crate::resources::WHOLE;

/// Most candidates (units or shared-GPU groups) enumerated on one node by the node plan.
const MAX_UNITS_PER_NODE: usize = 8;
/// Bounds of the count plan's table (units × GPUs); beyond them only the node plan runs.
const MAX_DP_UNITS: usize = 256;
const MAX_DP_GPUS: u32 = 2048;

/// One preemptable unit.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Unit {
    pub app: usize,
    pub queue: usize,
    pub priority: i32,
    /// Indices into `Snapshot::held`.
    pub held: Vec<usize>,
    /// Hundredths of GPU it holds in the pool the choice is for.
    pub hundredths: u32,
    /// Its GPUs are all whole (the count plan's units).
    pub whole: bool,
    /// GPU·milliseconds of run time lost (hundredths · ms).
    pub run: u64,
    /// A gang (several containers that go together).
    pub gang: bool,
}

/// The units of applications `candidate` accepts, from containers not yet taken: a gang
/// application's live containers as one unit (none while any of them is already leaving),
/// others one unit per container in the pool.
pub(super) fn units(
    snap: &Snapshot,
    taken: &[bool],
    candidate: impl Fn(usize) -> bool,
    in_pool: &dyn Fn(usize) -> bool,
) -> Vec<Unit> {
    let mut by_app: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, h) in snap.held.iter().enumerate() {
        if candidate(h.app) {
            by_app.entry(h.app).or_default().push(i);
        }
    }
    let mut out = Vec::new();
    for (app, held) in by_app {
        let a = &snap.apps[app];
        let unit = |held: Vec<usize>| {
            let hundredths = held
                .iter()
                .filter(|&&h| in_pool(snap.held[h].node))
                .map(|&h| snap.held[h].hundredths())
                .sum();
            // A container without GPUs loses its run time as one GPU would.
            let run = held
                .iter()
                .map(|&h| {
                    let k = snap.held[h].hundredths();
                    snap.held[h].run_ms * u64::from(if k == 0 { WHOLE } else { k })
                })
                .sum();
            Unit {
                app,
                queue: a.queue,
                priority: a.priority,
                gang: a.gang && held.len() > 1,
                whole: held.iter().all(|&h| snap.held[h].gpu_shares.is_empty()),
                held,
                hundredths,
                run,
            }
        };
        if a.gang {
            if held.iter().any(|&h| taken[h]) {
                continue;
            }
            let u = unit(held);
            if u.hundredths > 0 {
                out.push(u);
            }
        } else {
            for h in held.into_iter().filter(|&h| !taken[h] && in_pool(snap.held[h].node)) {
                let u = unit(vec![h]);
                if u.hundredths > 0 {
                    out.push(u);
                }
            }
        }
    }
    out
}

/// What a plan takes and what it achieves.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Choice {
    /// Indices into the units.
    pub units: Vec<usize>,
    /// Waiting tasks that fit once they are gone.
    pub served: u32,
    /// Some task could not be served and a gang too big for its queue's limit might have.
    pub gang_blocked: bool,
}

/// Cost of a set of units, compared in this order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
struct Cost {
    /// Hundredths.
    gpus: u32,
    /// Σ (priority above the lowest candidate's) × hundredths.
    priority: i64,
    run: u64,
    containers: u32,
}

impl Cost {
    fn of(u: &Unit, base: i32) -> Cost {
        Cost {
            gpus: u.hundredths,
            priority: (i64::from(u.priority) - i64::from(base)) * i64::from(u.hundredths),
            run: u.run,
            containers: u.held.len() as u32,
        }
    }
    fn add(self, o: Cost) -> Cost {
        Cost {
            gpus: self.gpus + o.gpus,
            priority: self.priority + o.priority,
            run: self.run.saturating_add(o.run),
            containers: self.containers + o.containers,
        }
    }
}

/// Tasks of `tasks` that fit `scratch` with `chosen` units' containers gone.
fn served(snap: &Snapshot, scratch: &Scratch, tasks: &[WaitingTasks], units: &[Unit], chosen: &[usize]) -> u32 {
    let mut s = scratch.clone();
    for &u in chosen {
        for &h in &units[u].held {
            let held = &snap.held[h];
            s.give(held);
        }
    }
    let mut n = 0;
    for w in tasks {
        for _ in 0..w.count {
            if s.place(&snap.nodes, w, &|_| true).is_none() {
                break;
            }
            n += 1;
        }
    }
    n
}

/// Chooses units so that `tasks` fit (see the module doc). `limit`: hundredths each victim
/// queue may lose at most; `refill`: hundredths of each victim queue's own waiting work
/// that would take back room a whole gang frees beyond its limit (the swap plan).
pub(super) fn choose(
    snap: &Snapshot,
    scratch: &Scratch,
    tasks: &[WaitingTasks],
    units: &[Unit],
    limit: &BTreeMap<usize, u32>,
    refill: &BTreeMap<usize, u32>,
) -> Choice {
    let total: u32 = tasks.iter().map(|w| w.count).sum();
    if units.is_empty() || total == 0 {
        return Choice {
            gang_blocked: false,
            ..Default::default()
        };
    }
    let base = units.iter().map(|u| u.priority).min().unwrap_or(0);
    let cost = |chosen: &[usize]| {
        chosen
            .iter()
            .fold(Cost::default(), |c, &u| c.add(Cost::of(&units[u], base)))
    };
    let mut plans = vec![by_node(snap, scratch, tasks, units, limit, base)];
    if let Some(p) = by_count(tasks, units, limit, base) {
        plans.push(p);
    }
    let score = |p: Vec<usize>| (served(snap, scratch, tasks, units, &p), cost(&p), p);
    let mut best = plans
        .into_iter()
        .map(score)
        .min_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)))
        .unwrap_or_default();
    // The swap only where nothing within the limits serves anything: it costs a whole gang.
    if best.0 == 0 {
        let need: u32 = tasks
            .iter()
            .map(|w| w.count.saturating_mul(w.gpus).saturating_mul(WHOLE))
            .fold(0, u32::saturating_add);
        if let Some(u) = swap(units, limit, refill, need, base) {
            best = score(vec![u]);
        }
    }
    let (served, _, mut chosen) = best;
    if served == 0 {
        chosen.clear();
    }
    let gang_blocked = served < total
        && units
            .iter()
            .any(|u| u.gang && u.hundredths > limit.get(&u.queue).copied().unwrap_or(0));
    Choice {
        units: chosen,
        served,
        gang_blocked,
    }
}

/// The swap plan: the cheapest whole gang bigger than its queue's limit whose excess (its
/// GPUs beyond the limit) the queue's own waiting work takes back and is at most `need`, the
/// hundredths the plan is made for. The queue ends at its share in other jobs of its own, so a
/// queue over its share only through a gang is not held there (as when its demand came in
/// steps and an earlier step took its singles); the bound keeps a large gang from going
/// for a small need.
fn swap(
    units: &[Unit],
    limit: &BTreeMap<usize, u32>,
    refill: &BTreeMap<usize, u32>,
    need: u32,
    base: i32,
) -> Option<usize> {
    (0..units.len())
        .filter(|&u| {
            let unit = &units[u];
            let excess = unit
                .hundredths
                .saturating_sub(limit.get(&unit.queue).copied().unwrap_or(0));
            unit.gang && excess > 0 && excess <= need && excess <= refill.get(&unit.queue).copied().unwrap_or(0)
        })
        .min_by_key(|&u| (Cost::of(&units[u], base), u))
}

/// The count plan: per victim queue (largest limit first), the cheapest units of whole GPUs
/// adding up to at least the GPUs still needed with the fewest GPUs (or as many as the
/// limit allows). Counted in whole GPUs.
fn by_count(tasks: &[WaitingTasks], units: &[Unit], limit: &BTreeMap<usize, u32>, base: i32) -> Option<Vec<usize>> {
    let mut need: u32 = tasks.iter().map(|w| w.count * w.gpus).sum();
    let gpus = |u: usize| units[u].hundredths / WHOLE;
    let mut queues: Vec<(usize, u32)> = limit.iter().map(|(&q, &l)| (q, l / WHOLE)).collect();
    queues.sort_by_key(|&(q, l)| (std::cmp::Reverse(l), q));
    let mut chosen = Vec::new();
    for (q, lim) in queues {
        if need == 0 {
            break;
        }
        let mut mine: Vec<usize> = (0..units.len())
            .filter(|&u| units[u].queue == q && units[u].whole && gpus(u) <= lim)
            .collect();
        if mine.is_empty() {
            continue;
        }
        if mine.len() > MAX_DP_UNITS {
            return None;
        }
        mine.sort_by_key(|&u| Cost::of(&units[u], base));
        let biggest = mine.iter().map(|&u| gpus(u)).max().unwrap_or(0);
        let cap = lim.min(need.saturating_add(biggest));
        if cap > MAX_DP_GPUS {
            return None;
        }
        let width = cap as usize + 1;
        // best[t]: the cheapest way to free exactly t GPUs; keep[i][t]: unit i is in it.
        let mut best: Vec<Option<Cost>> = vec![None; width];
        best[0] = Some(Cost::default());
        let mut keep = vec![vec![false; width]; mine.len()];
        for (i, &u) in mine.iter().enumerate() {
            let g = gpus(u) as usize;
            let c = Cost::of(&units[u], base);
            for t in (g..width).rev() {
                if let Some(prev) = best[t - g] {
                    let cand = prev.add(c);
                    if best[t].is_none_or(|b| cand < b) {
                        best[t] = Some(cand);
                        keep[i][t] = true;
                    }
                }
            }
        }
        let target = (need as usize..width)
            .find(|&t| best[t].is_some())
            .or_else(|| (1..width.min(need as usize)).rev().find(|&t| best[t].is_some()));
        let Some(mut t) = target else { continue };
        let got = t as u32;
        for i in (0..mine.len()).rev() {
            if t > 0 && keep[i][t] {
                // Unit i was the last improvement of best[t] when it was added; walk back.
                chosen.push(mine[i]);
                t -= gpus(mine[i]) as usize;
            }
        }
        need = need.saturating_sub(got);
    }
    Some(chosen)
}

/// Cost of the units `set`.
fn cost_of(units: &[Unit], set: &[usize], base: i32) -> Cost {
    set.iter()
        .fold(Cost::default(), |acc, &u| acc.add(Cost::of(&units[u], base)))
}

/// The node plan's candidates on node `n` among the units `here` not yet `chosen`: each
/// unit of whole GPUs and each gang alone, and the other units holding shares grouped per
/// shared GPU — every such share on GPU g together, one candidate (one share frees no GPU,
/// all of them do; so a tenant cannot hide a GPU behind many small shares). A unit sharing
/// several GPUs is in each of their groups (a set counts it once).
fn groups(snap: &Snapshot, units: &[Unit], here: &[usize], n: usize, chosen: &[usize]) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut per_gpu: BTreeMap<u8, Vec<usize>> = BTreeMap::new();
    for &u in here.iter().filter(|u| !chosen.contains(u)) {
        let unit = &units[u];
        if unit.whole || unit.gang {
            out.push(vec![u]);
            continue;
        }
        let mut shared = false;
        for &h in unit.held.iter().filter(|&&h| snap.held[h].node == n) {
            for (i, _) in snap.held[h].gpu_shares.iter() {
                let g = per_gpu.entry(i).or_default();
                if !g.contains(&u) {
                    g.push(u);
                }
                shared = true;
            }
        }
        if !shared {
            out.push(vec![u]);
        }
    }
    out.extend(per_gpu.into_values());
    out
}

/// The node plan: task by task, the node where the cheapest units make it fit.
fn by_node(
    snap: &Snapshot,
    scratch: &Scratch,
    tasks: &[WaitingTasks],
    units: &[Unit],
    limit: &BTreeMap<usize, u32>,
    base: i32,
) -> Vec<usize> {
    let mut s = scratch.clone();
    let mut left = limit.clone();
    let mut chosen: Vec<usize> = Vec::new();
    let mut on_node: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (u, unit) in units.iter().enumerate() {
        for &h in &unit.held {
            let v = on_node.entry(snap.held[h].node).or_default();
            if !v.contains(&u) {
                v.push(u);
            }
        }
    }
    for w in tasks {
        for _ in 0..w.count {
            if s.place(&snap.nodes, w, &|_| true).is_some() {
                continue;
            }
            // (cost, −tier, node, units)
            let mut best: Option<(Cost, i8, usize, Vec<usize>)> = None;
            for (&n, here) in &on_node {
                if !eligible(&snap.nodes[n], w) {
                    continue;
                }
                let mut cands: Vec<Vec<usize>> = groups(snap, units, here, n, &chosen)
                    .into_iter()
                    .filter(|g| {
                        let mut per_queue: BTreeMap<usize, u32> = BTreeMap::new();
                        for &u in g {
                            *per_queue.entry(units[u].queue).or_default() += units[u].hundredths;
                        }
                        per_queue.iter().all(|(q, h)| *h <= left.get(q).copied().unwrap_or(0))
                    })
                    .collect();
                cands.sort_by_key(|g| (cost_of(units, g, base), g.clone()));
                cands.truncate(MAX_UNITS_PER_NODE);
                for set in 1u32..(1 << cands.len()) {
                    let mut pick: Vec<usize> = Vec::new();
                    for u in (0..cands.len())
                        .filter(|i| set >> i & 1 == 1)
                        .flat_map(|i| cands[i].iter().copied())
                    {
                        if !pick.contains(&u) {
                            pick.push(u);
                        }
                    }
                    let mut per_queue: BTreeMap<usize, u32> = BTreeMap::new();
                    for &u in &pick {
                        *per_queue.entry(units[u].queue).or_default() += units[u].hundredths;
                    }
                    if per_queue.iter().any(|(q, g)| *g > left.get(q).copied().unwrap_or(0)) {
                        continue;
                    }
                    let room = s.room_without(
                        n,
                        pick.iter()
                            .flat_map(|&u| units[u].held.iter())
                            .map(|&h| &snap.held[h])
                            .filter(|h| h.node == n),
                    );
                    if !fits_in(&room, w) {
                        continue;
                    }
                    let tier = crate::topology::choose(snap.nodes[n].topology.as_deref(), room.gpu_mask, w.gpus)
                        .map_or(0, |c| c.tier as i8);
                    let cost = cost_of(units, &pick, base);
                    let key = (cost, -tier, n);
                    if best.as_ref().is_none_or(|b| key < (b.0, b.1, b.2)) {
                        best = Some((cost, -tier, n, pick));
                    }
                }
            }
            let Some((_, _, n, pick)) = best else {
                continue;
            };
            for u in pick {
                chosen.push(u);
                if let Some(l) = left.get_mut(&units[u].queue) {
                    *l -= units[u].hundredths;
                }
                for &h in &units[u].held {
                    let held = &snap.held[h];
                    s.give(held);
                }
            }
            s.take(n, w);
        }
    }
    chosen
}
