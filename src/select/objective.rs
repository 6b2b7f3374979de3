//! The placement objective (docs/DESIGN-NOTES.md, "Placement objective (issue 13)"): ONE
//! lexicographic order over the (node, GPU set) pairs a task of a job can take, and the search
//! on one node that the order needs.
//!
//! Owns: [`RankKey`] (the order, field by field, smaller is better), [`pick`] (on one node, the
//! task's GPU set together with the union of the job's GPUs there), and the sentence saying on
//! which field a candidate lost to the chosen one ([`RankKey::lost_on`]). No I/O, no node view:
//! the select pipeline fills the key from a node's free amounts and calls these.
//!
//! Across nodes (issue 27) the pair weights come after packing unless the union reaches the
//! machine's best weight W*(|U|) ([`RankKey::weight_ideal`]); inside a node the set is still
//! chosen by (T, W) first. Under queue pressure (other jobs wait behind this one) packing —
//! best fit in the NVLink groups, then the node's free GPUs, fewest first — comes right after
//! the tiers and the ideal weight after packing ([`RankKey::nvlink_left_first`],
//! [`RankKey::free_first`], [`RankKey::weight_ideal_packed`]); the tiers never move.
//!
//! A task that declares its run time (`maxRunSec`) and a selector that knows the time is
//! placed, right after the tiers (and under pressure the NVLink fit), by best fit in every
//! group and then by how much it would delay its node's draining ([`RankKey::fit_first`],
//! [`RankKey::drain`]; docs/DESIGN-NOTES.md, "Work that ends together, placed together").
//!
//! Among candidates equal on the link terms (T, W of the union and of the task's set), the
//! NUMA term comes next (issue 27): the fewest NUMA nodes under the task's set, so a set within
//! one NUMA node beats an equally linked one split over two; then the NIC terms (a set whose
//! GPUs share a NIC, PIX/PXB, wins; then, for a job spanning nodes, GPUs behind an RDMA NIC),
//! then best fit.

use std::cmp::Reverse;

use serde::Serialize;

use crate::resources::{lowest_bits, GpuMask, Resources, ANY_GPU, WHOLE};
use crate::topology::{self, Fit, Topology};

/// Non-tree nodes up to this many GPUs get the exact (union, task) search; above it the union is
/// the §5 choice of its size and the task's set the §5 choice inside it.
const EXACT_UNION_GPUS: u32 = 8;

/// The GPU half of the order on one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GpuPick {
    /// The task's own GPU set.
    pub task: GpuMask,
    pub task_tier: u8,
    pub task_weight: u32,
    /// The job's GPUs on this node after this choice: those it already holds there plus the
    /// sets planned for its tasks that will go there (this one included).
    pub union: GpuMask,
    pub union_tier: u8,
    pub union_weight: u32,
    /// W(U) reaches the best pair weight of any set of |U| GPUs on this machine when empty
    /// (W*); set by [`crate::select::ChoiceCache::pick`], true where weights do not apply
    /// (no topology, shares, explicit masks).
    pub weight_ideal: bool,
    /// NUMA nodes the task's set sits on beyond the first ([`Topology::numa_split`]; fewer is
    /// better, 0 when unknown).
    pub numa: u8,
    /// 1 when the task's set (≥ 2 GPUs) shares no NIC, on a node where a NIC is near two GPUs
    /// ([`Topology::nic_apart`]; issue 27); 0 otherwise.
    pub nic_apart: u8,
    /// GPUs of the task's set behind an InfiniBand/RoCE NIC's PCIe switch (GPUDirect RDMA),
    /// counted only when the job spans nodes (0 otherwise).
    pub nic: u8,
    /// Free GPUs left beside the job's new GPUs in the NVLink and PCIe islands they take
    /// from ([`Topology::fit`]; best fit, smaller is better).
    pub fit: Fit,
    /// Cap of the free GPUs the job leaves on the node (DESIGN §5 fragmentation vector).
    pub left: [i8; 3],
    /// A fractional task: hundredths left free on its GPU once it is there (best fit,
    /// fewer is better); 0 for whole-GPU tasks.
    pub share_left: u8,
}

/// Tier a set of `n` GPUs gets on a node whose topology is unknown: one GPU needs no link,
/// anything else is assumed to cross the host.
fn unknown_tier(n: u32) -> u8 {
    if n <= 1 {
        2
    } else {
        0
    }
}

fn count_cap(n: u32) -> [i8; 3] {
    [8u32, 4, 2].map(|s| if n >= s { 0 } else { -1 })
}

/// Calls `f` with every `k`-subset of `set` (as masks).
pub(crate) fn subsets(set: GpuMask, k: u32, f: &mut impl FnMut(GpuMask)) {
    fn rec(rest: GpuMask, k: u32, acc: GpuMask, f: &mut impl FnMut(GpuMask)) {
        if k == 0 {
            f(acc);
            return;
        }
        if rest.count_ones() < k {
            return;
        }
        let low = rest & rest.wrapping_neg();
        rec(rest & !low, k - 1, acc | low, f);
        rec(rest & !low, k, acc, f);
    }
    rec(set, k, 0, f);
}

/// What one task asks of a node's GPUs, job included.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Want {
    /// The task's GPU count.
    pub k: u32,
    /// How many of the job's tasks (this one included, each of `k` GPUs) are planned to go to
    /// this node.
    pub f: u32,
    /// The job spans more than this node (it has tasks elsewhere, or not all of it fits
    /// here): its traffic leaves the node, so GPUs behind a NIC's PCIe switch count.
    pub spread: bool,
}

/// GPUs of `s` that share a PCIe switch with an InfiniBand/RoCE NIC, when the job spans nodes.
fn nic_count(t: &Topology, s: GpuMask, spread: bool) -> u8 {
    if spread {
        (s & t.nic_near()).count_ones() as u8
    } else {
        0
    }
}

/// The best `want.k`-GPU set for one task on a node with `free` GPUs, when the job already
/// holds `held` there and `want.f` of its tasks are planned to go there. The union U = held ∪
/// X, X ⊆ free of `f·k` GPUs (fewer when fewer are free), and the task's set S ⊆ X maximise,
/// in this order: T(U), T(S), W(U), W(S), then the fewest NUMA nodes under S, then S sharing a NIC, then (when the job spans nodes) the GPUs of S behind
/// an RDMA NIC's switch, then the best fit Fit(free, X) (smallest), then leave the best
/// Cap(free ∖ X), then Fit(free, S), Cap(free ∖ S), then the lowest S, then the lowest X. With
/// no other task planned there (f = 1, held = ∅) and no NIC term this is exactly DESIGN §5's
/// choice ([`topology::choose`]). `None` when fewer than `k` GPUs are free.
pub(crate) fn pick(topo: Option<&Topology>, free: GpuMask, held: GpuMask, want: Want) -> Option<GpuPick> {
    let Want { k, f, spread } = want;
    let avail = free.count_ones();
    if avail < k {
        return None;
    }
    if k == 0 {
        let left = topo.map_or(count_cap(avail), |t| t.cap(free));
        return Some(GpuPick {
            task: 0,
            task_tier: 2,
            task_weight: 0,
            union: held,
            union_tier: topo.map_or(unknown_tier(held.count_ones()), |t| t.tier(held)),
            union_weight: topo.map_or(0, |t| t.weight(held)),
            weight_ideal: true,
            numa: 0,
            nic_apart: 0,
            nic: 0,
            fit: [0; topology::FIT_LEVELS],
            left,
            share_left: 0,
        });
    }
    let u = f.max(1).min(avail / k) * k;
    let Some(t) = topo else {
        let task = lowest_bits(free, k)?;
        let x = lowest_bits(free, u).unwrap_or(task);
        let union = held | x;
        return Some(GpuPick {
            task,
            task_tier: unknown_tier(k),
            task_weight: 0,
            union,
            union_tier: unknown_tier(union.count_ones()),
            union_weight: 0,
            weight_ideal: true,
            numa: 0,
            nic_apart: 0,
            nic: 0,
            fit: [0; topology::FIT_LEVELS],
            left: count_cap((free & !x).count_ones()),
            share_left: 0,
        });
    };
    // The NIC term can only tell sets apart when some free GPUs have an RDMA NIC and some not.
    let near = t.nic_near() & free;
    let nic_matters = spread && near != 0 && near != free;
    if u == k && held == 0 && !nic_matters {
        let g = topology::choose(Some(t), free, k)?;
        return Some(GpuPick {
            task: g.mask,
            task_tier: g.tier,
            task_weight: g.weight,
            union: g.mask,
            union_tier: g.tier,
            union_weight: g.weight,
            weight_ideal: true,
            numa: t.numa_split(g.mask),
            nic_apart: t.nic_apart(g.mask),
            nic: nic_count(t, g.mask, spread),
            fit: t.fit(free, g.mask),
            left: t.cap(free & !g.mask),
            share_left: 0,
        });
    }
    if t.gpu_count() <= EXACT_UNION_GPUS {
        return Some(exact(t, free, held, k, u, spread));
    }
    let x = topology::choose(Some(t), free, u)?.mask;
    let g = topology::choose(Some(t), x, k)?;
    let union = held | x;
    Some(GpuPick {
        task: g.mask,
        task_tier: g.tier,
        task_weight: g.weight,
        union,
        union_tier: t.tier(union),
        union_weight: t.weight(union),
        weight_ideal: true,
        numa: t.numa_split(g.mask),
        nic_apart: t.nic_apart(g.mask),
        nic: nic_count(t, g.mask, spread),
        fit: t.fit(free, x),
        left: t.cap(free & !x),
        share_left: 0,
    })
}

/// The pick for an explicitly requested mask `m` (the caller checked it is free).
pub(crate) fn given(topo: Option<&Topology>, free: GpuMask, held: GpuMask, m: GpuMask, spread: bool) -> GpuPick {
    let union = held | m;
    let n = m.count_ones();
    match topo {
        Some(t) => GpuPick {
            task: m,
            task_tier: t.tier(m),
            task_weight: t.weight(m),
            union,
            union_tier: t.tier(union),
            union_weight: t.weight(union),
            weight_ideal: true,
            numa: t.numa_split(m),
            nic_apart: t.nic_apart(m),
            nic: nic_count(t, m, spread),
            fit: t.fit(free, m),
            left: t.cap(free & !m),
            share_left: 0,
        },
        None => GpuPick {
            task: m,
            task_tier: unknown_tier(n),
            task_weight: 0,
            union,
            union_tier: unknown_tier(union.count_ones()),
            union_weight: 0,
            weight_ideal: true,
            numa: 0,
            nic_apart: 0,
            nic: 0,
            fit: [0; topology::FIT_LEVELS],
            left: count_cap((free & !m).count_ones()),
            share_left: 0,
        },
    }
}

/// The GPU of a fractional task that needs `share` hundredths of one GPU, on a node with
/// `avail` free (whole free GPUs and the room left on shared ones): best fit. Among the
/// shared GPUs with room enough, the one with the least room (then the lowest index); only
/// when none has room, a wholly free GPU, chosen as DESIGN §5 chooses one GPU. `fixed` pins
/// the GPU (an explicit `gpuMask`). A share joins no all-reduce: the job's union stays
/// `held` and the NIC term is 0; `fit` is that of the wholly free GPU it opens (none when it
/// goes onto a shared one). `None` when no GPU has the room.
pub(crate) fn pick_share(
    topo: Option<&Topology>,
    avail: &Resources,
    held: GpuMask,
    share: u32,
    fixed: Option<u32>,
) -> Option<GpuPick> {
    let whole = avail.whole_gpu_mask();
    let (index, room) = match fixed {
        Some(i) => (i, avail.gpu_hundredths(i)),
        None => match avail
            .gpu_shares
            .iter()
            .filter(|&(i, room)| i < ANY_GPU && room >= share)
            .min_by_key(|&(i, room)| (room, i))
        {
            Some((i, room)) => (u32::from(i), room),
            None => (topology::choose(topo, whole, 1)?.mask.trailing_zeros(), WHOLE),
        },
    };
    if room < share || index >= 64 {
        return None;
    }
    let task = 1u64 << index;
    let opened = if room == WHOLE { task } else { 0 };
    let rest = whole & !opened;
    let (task_tier, task_weight, union_tier, union_weight, fit, left) = match topo {
        Some(t) => (
            t.tier(task),
            t.weight(task),
            t.tier(held),
            t.weight(held),
            if opened != 0 {
                t.fit(whole, opened)
            } else {
                [0; topology::FIT_LEVELS]
            },
            t.cap(rest),
        ),
        None => (
            unknown_tier(1),
            0,
            unknown_tier(held.count_ones()),
            0,
            [0; topology::FIT_LEVELS],
            count_cap(rest.count_ones()),
        ),
    };
    Some(GpuPick {
        task,
        task_tier,
        task_weight,
        union: held,
        union_tier,
        union_weight,
        weight_ideal: true,
        numa: 0,
        nic_apart: 0,
        nic: 0,
        fit,
        left,
        share_left: (room - share) as u8,
    })
}

/// The exhaustive (union, task) search of [`pick`] on a small node.
fn exact(t: &Topology, free: GpuMask, held: GpuMask, k: u32, u: u32, spread: bool) -> GpuPick {
    type Set = (GpuMask, u8, u32, u8, u8, u8, Fit, [i8; 3]);
    let mut sets: Vec<Set> = Vec::new();
    subsets(free, k, &mut |s| {
        sets.push((
            s,
            t.tier(s),
            t.weight(s),
            t.numa_split(s),
            t.nic_apart(s),
            nic_count(t, s, spread),
            t.fit(free, s),
            t.cap(free & !s),
        ))
    });
    type Score = (
        (u8, u8, u32, u32, Reverse<u8>, Reverse<u8>, u8),
        Reverse<Fit>,
        [i8; 3],
        Reverse<Fit>,
        [i8; 3],
        Reverse<GpuMask>,
        Reverse<GpuMask>,
    );
    let mut best: Option<(Score, GpuPick)> = None;
    subsets(free, u, &mut |x| {
        let union = held | x;
        let (ut, uw) = (t.tier(union), t.weight(union));
        let fit = t.fit(free, x);
        let left = t.cap(free & !x);
        for &(s, st, sw, numa, nic_apart, nic, sfit, scap) in sets.iter().filter(|(s, ..)| s & !x == 0) {
            let score = (
                (ut, st, uw, sw, Reverse(numa), Reverse(nic_apart), nic),
                Reverse(fit),
                left,
                Reverse(sfit),
                scap,
                Reverse(s),
                Reverse(x),
            );
            if best.as_ref().is_none_or(|(b, _)| score > *b) {
                let p = GpuPick {
                    task: s,
                    task_tier: st,
                    task_weight: sw,
                    union,
                    union_tier: ut,
                    union_weight: uw,
                    weight_ideal: true,
                    numa,
                    nic_apart,
                    nic,
                    fit,
                    left,
                    share_left: 0,
                };
                best = Some((score, p));
            }
        }
    });
    // `free` holds at least `u ≥ k` GPUs, so some (X, S) was scored.
    best.map(|(_, p)| p).unwrap_or(GpuPick {
        task: 0,
        task_tier: 0,
        task_weight: 0,
        union: held,
        union_tier: 0,
        union_weight: 0,
        weight_ideal: true,
        numa: 0,
        nic_apart: 0,
        nic: 0,
        fit: [0; topology::FIT_LEVELS],
        left: [-1; 3],
        share_left: 0,
    })
}

/// The order, one field per criterion, smaller is better (see the module doc and
/// DESIGN-NOTES). Fields compare in declaration order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct RankKey {
    /// 1. The node already holds tasks of this job (adds no node).
    pub affinity: Reverse<bool>,
    /// 2. How many of the job's unplaced tasks the node can take (fewest nodes).
    pub fits: Reverse<u32>,
    /// 3. The node's rack already holds tasks of this job (fewest racks).
    pub rack: Reverse<bool>,
    /// 4. Tier of the job's GPUs on the node (the union).
    pub union_tier: Reverse<u8>,
    /// 5. Tier of the task's own set.
    pub task_tier: Reverse<u8>,
    /// 6. The union's pair weight is the best this machine offers a set of its size (W(U) =
    ///    W*(|U|) on the empty node): an ideal set anywhere beats packing.
    pub weight_ideal: Reverse<bool>,
    /// 6q. Under queue pressure (other jobs wait behind this one; issue 27), right after the
    ///     tiers: the free GPUs left beside the job's new GPUs in the NVLink groups they take
    ///     from (best fit's innermost level: break no NVLink island more than needed), then
    ///     the node's free GPUs, fewest first (node packing); criterion 6 is then neutral
    ///     (its value moves to [`RankKey::weight_ideal_packed`]). Both 0 otherwise.
    pub nvlink_left_first: u8,
    /// 6d. A task that declares its run time (`maxRunSec`; issue 27, fifth round): best fit
    ///     in every group first (criterion 9's [`GpuPick::fit`]: keep pairs, switches and
    ///     sockets whole) ...
    pub fit_first: Fit,
    /// ... then the drain term: the minutes by which the task would push back the time its
    ///     node is whole again (its end past the node's `drain_by_ms`, ends by the running
    ///     containers' declared limits; an idle node: the task's whole run): work that ends
    ///     together goes together, so nodes drain whole for the gangs that wait. 0 where the
    ///     node's drain is unknown. Both 0 for a task that declares no run time.
    pub drain: u32,
    pub free_first: u32,
    /// 7a. A fractional task: hundredths left free on its GPU after it (best fit onto
    /// already-shared GPUs, so whole GPUs and multi-GPU sets stay free); 0 for whole tasks.
    pub share_left: u8,
    /// 7b. NUMA nodes the task's set sits on beyond the first (fewer is better: a set within
    /// one NUMA node beats an equally linked set split over two; 0 when the affinity is
    /// unknown).
    pub numa: u8,
    /// 7c. The task's set shares no NIC (1) though a NIC of the node is near two GPUs
    /// (issue 27: among sets equal so far, one whose GPUs share a NIC wins).
    pub nic_apart: u8,
    /// 8. GPUs of the task's set behind an RDMA NIC's PCIe switch, for a job spanning nodes.
    pub nic: Reverse<u8>,
    /// 9. Best fit, innermost group first: free GPUs left beside the job's new GPUs in the
    ///    NVLink, PIX, PXB, PHB and NUMA groups they take from ([`GpuPick::fit`]) ...
    pub fit: Fit,
    /// ... then on the node: free GPUs (pack busy nodes, keep empty ones whole).
    pub free_gpus: u32,
    /// 9a. The ideal weight of criterion 6 again: it decides here, after packing, when
    ///     criterion 6 was neutral under queue pressure (otherwise it was decided there).
    pub weight_ideal_packed: Reverse<bool>,
    /// 9b. Pair weight of the union, then of the task's set (issue 27: below the ideal
    ///     weight, packing first; the weight then chooses among equally packed nodes).
    pub union_weight: Reverse<u32>,
    pub task_weight: Reverse<u32>,
    /// 10. What the job leaves there for future jobs (Cap of the rest, larger is better).
    pub left: Reverse<[i8; 3]>,
    /// 11. Total GPUs (smaller machines first).
    pub total_gpus: u32,
    /// 12. Free CPU, then 13. free memory (best fit).
    pub cpu: u32,
    pub memory_mb: u64,
    /// 14. Random tie-break (per AM, so concurrent AMs spread).
    pub tie: u32,
}

fn format_hundredths_u8(h: u8) -> String {
    crate::resources::format_hundredths(u32::from(h))
}

/// Why the next-best node lost to the chosen one.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Alternative {
    pub host: String,
    /// The first criterion of the order on which it differs, with both values.
    pub lost_on: String,
}

impl RankKey {
    /// The first field on which `self` (a losing candidate) differs from `best`, as
    /// "criterion: this vs best".
    pub(crate) fn lost_on(&self, best: &RankKey) -> String {
        let b = |v: Reverse<bool>| if v.0 { "yes" } else { "no" };
        let diffs: [(bool, &str, String, String); 24] = [
            (
                self.affinity != best.affinity,
                "holds job tasks",
                b(self.affinity).into(),
                b(best.affinity).into(),
            ),
            (
                self.fits != best.fits,
                "job tasks it can take",
                self.fits.0.to_string(),
                best.fits.0.to_string(),
            ),
            (
                self.rack != best.rack,
                "rack holds job tasks",
                b(self.rack).into(),
                b(best.rack).into(),
            ),
            (
                self.union_tier != best.union_tier,
                "job's GPU union tier",
                self.union_tier.0.to_string(),
                best.union_tier.0.to_string(),
            ),
            (
                self.task_tier != best.task_tier,
                "task's GPU set tier",
                self.task_tier.0.to_string(),
                best.task_tier.0.to_string(),
            ),
            (
                self.weight_ideal != best.weight_ideal,
                "job's GPU union at the machine's best pair weight",
                b(self.weight_ideal).into(),
                b(best.weight_ideal).into(),
            ),
            (
                self.nvlink_left_first != best.nvlink_left_first,
                "free GPUs left beside it in its NVLink group while other jobs wait (fewer fits better)",
                self.nvlink_left_first.to_string(),
                best.nvlink_left_first.to_string(),
            ),
            (
                self.fit_first != best.fit_first,
                "free GPUs left beside it in its NVLink, PIX, PXB, PHB and NUMA groups, for a task that declares its run time (fewer fits better)",
                format!("{:?}", self.fit_first),
                format!("{:?}", best.fit_first),
            ),
            (
                self.drain != best.drain,
                "minutes it would delay its node's draining whole, by the declared run times (fewer is better)",
                self.drain.to_string(),
                best.drain.to_string(),
            ),
            (
                self.free_first != best.free_first,
                "free GPUs while other jobs wait (fewer packs better)",
                self.free_first.to_string(),
                best.free_first.to_string(),
            ),
            (
                self.share_left != best.share_left,
                "share left on its GPU (less is a better fit)",
                format_hundredths_u8(self.share_left),
                format_hundredths_u8(best.share_left),
            ),
            (
                self.numa != best.numa,
                "NUMA nodes the task's GPU set spans beyond the first (fewer is better)",
                self.numa.to_string(),
                best.numa.to_string(),
            ),
            (
                self.nic_apart != best.nic_apart,
                "task's GPUs share no NIC (1) where a set sharing one was free (0)",
                self.nic_apart.to_string(),
                best.nic_apart.to_string(),
            ),
            (
                self.nic != best.nic,
                "task's GPUs behind an RDMA NIC's PCIe switch (job spans nodes)",
                self.nic.0.to_string(),
                best.nic.0.to_string(),
            ),
            (
                self.fit != best.fit,
                "free GPUs left beside it in its NVLink/PIX/PXB/PHB/NUMA groups (fewer fits better)",
                format!("{:?}", self.fit),
                format!("{:?}", best.fit),
            ),
            (
                self.free_gpus != best.free_gpus,
                "free GPUs (fewer packs better)",
                self.free_gpus.to_string(),
                best.free_gpus.to_string(),
            ),
            (
                self.weight_ideal_packed != best.weight_ideal_packed,
                "job's GPU union at the machine's best pair weight (after packing, while other jobs wait)",
                b(self.weight_ideal_packed).into(),
                b(best.weight_ideal_packed).into(),
            ),
            (
                self.union_weight != best.union_weight,
                "job's GPU union weight",
                self.union_weight.0.to_string(),
                best.union_weight.0.to_string(),
            ),
            (
                self.task_weight != best.task_weight,
                "task's GPU set weight",
                self.task_weight.0.to_string(),
                best.task_weight.0.to_string(),
            ),
            (
                self.left != best.left,
                "GPUs left for other jobs (cap 8/4/2)",
                format!("{:?}", self.left.0),
                format!("{:?}", best.left.0),
            ),
            (
                self.total_gpus != best.total_gpus,
                "total GPUs (smaller first)",
                self.total_gpus.to_string(),
                best.total_gpus.to_string(),
            ),
            (
                self.cpu != best.cpu,
                "free CPU (less packs better)",
                self.cpu.to_string(),
                best.cpu.to_string(),
            ),
            (
                self.memory_mb != best.memory_mb,
                "free memory MB (less packs better)",
                self.memory_mb.to_string(),
                best.memory_mb.to_string(),
            ),
            (
                self.tie != best.tie,
                "random tie-break",
                self.tie.to_string(),
                best.tie.to_string(),
            ),
        ];
        match diffs.into_iter().find(|d| d.0) {
            Some((_, what, mine, theirs)) => format!("{what}: {mine} vs {theirs}"),
            None => "equal on every criterion".into(),
        }
    }
}
