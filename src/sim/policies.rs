//! The baseline placement policies, each a choice of (node, GPU mask) over the
//! simulator's node model: `original` (frameworklauncher's packing selection),
//! `random`, `besteffort` (NVIDIA go-gpuallocator's pair scores and partition search,
//! re-implemented from reference/gpu-topology.md §1) and `hived` (a cell tree and
//! best-fit buddy choice after HiveD, §2). The `gpuam` policy is not here: the engine
//! drives the real select pipeline for it (see `mod.rs`).

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;

use super::cluster::{SimCluster, SimNode, Task};
use crate::resources::{lowest_bits, GpuMask};
use crate::topology::{Link, Topology};

/// A baseline: picks a node and the GPUs for one task, or `None` if no node fits now.
pub trait NodePolicy {
    fn choose(&mut self, cl: &SimCluster, task: &Task, remaining_tasks: u32) -> Option<(usize, GpuMask)>;
    /// Calls where the policy's own algorithm could not run and a fallback chose.
    fn fallbacks(&self) -> u64 {
        0
    }
    /// Calls where the faithful algorithm would have returned an invalid (padded) set.
    fn invalid(&self) -> u64 {
        0
    }
}

/// frameworklauncher's candidate factor (amCandidateNodesFactor, default 2).
pub const CANDIDATE_FACTOR: u32 = 2;

/// The original packing order: fewest free GPUs, fewest total GPUs, least free CPU, least
/// free memory; the random `tie` stands for the original's shuffle before a stable sort.
type PackKey = (u32, u32, u32, u64, u32);

fn packing_key(n: &SimNode, tie: u32) -> PackKey {
    (n.free_gpus(), n.gpus_total(), n.free_cpu, n.free_mem, tie)
}

/// frameworklauncher.md §3: packing sort, keep `remaining × factor` candidates, one host
/// uniformly at random among them, its lowest free GPU bits.
pub struct Original {
    pub rng: StdRng,
}

impl NodePolicy for Original {
    fn choose(&mut self, cl: &SimCluster, task: &Task, remaining: u32) -> Option<(usize, GpuMask)> {
        let mut cands: Vec<(PackKey, usize)> = cl
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.fits(task))
            .map(|(i, n)| (packing_key(n, self.rng.gen()), i))
            .collect();
        if cands.is_empty() {
            return None;
        }
        let keep = ((remaining.max(1) * CANDIDATE_FACTOR) as usize).min(cands.len());
        if cands.len() > keep {
            cands.select_nth_unstable(keep - 1);
        }
        let pick = cands[self.rng.gen_range(0..keep)].1;
        let mask = lowest_bits(cl.nodes[pick].free_mask, task.gpus)?;
        Some((pick, mask))
    }
}

/// A random feasible node and random free GPUs on it.
pub struct RandomPolicy {
    pub rng: StdRng,
}

impl NodePolicy for RandomPolicy {
    fn choose(&mut self, cl: &SimCluster, task: &Task, _remaining: u32) -> Option<(usize, GpuMask)> {
        let feasible: Vec<usize> = (0..cl.nodes.len()).filter(|&i| cl.nodes[i].fits(task)).collect();
        let &pick = feasible.choose(&mut self.rng)?;
        let mut bits: Vec<u32> = (0..64).filter(|b| cl.nodes[pick].free_mask >> b & 1 == 1).collect();
        bits.shuffle(&mut self.rng);
        let mask = bits.iter().take(task.gpus as usize).fold(0u64, |m, b| m | 1 << b);
        Some((pick, mask))
    }
}

/// The best node in the packing order (ties at random): what besteffort's scheduler side
/// does here. go-gpuallocator only chooses inside a node; kube-scheduler's
/// MostAllocated scoring is the closest packing node choice.
fn packing_first(cl: &SimCluster, task: &Task, rng: &mut StdRng) -> Option<usize> {
    cl.nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.fits(task))
        .min_by_key(|(_, n)| packing_key(n, rng.gen()))
        .map(|(i, _)| i)
}

/// go-gpuallocator's pair score: PCIe part (SYS 10, NODE 20, PHB 30, PXB 40, PIX 50,
/// same board 60) plus 100 per NVLink. Our link matrix keeps one class per pair, so an
/// NVLinked pair's PCIe part is unknown: it gets the SYS part (10).
pub fn pair_score(l: Link) -> u32 {
    match l {
        Link::Nv(m) => 100 * u32::from(m) + 10,
        Link::Pix => 50,
        Link::Pxb => 40,
        Link::Phb => 30,
        Link::Node => 20,
        Link::Sys => 10,
    }
}

/// Most partitions besteffort may enumerate per call before it falls back (its cost is
/// super-exponential: 2 M partitions for 16 free GPUs at k = 2).
pub const PARTITION_CAP: f64 = 20_000.0;

/// n! / ((k!)^(n/k) · (n/k)!): partitions of `n` padded devices into groups of `k`.
pub fn partition_count(n: u32, k: u32) -> f64 {
    let fact = |x: u32| (1..=x).fold(1.0f64, |a, b| a * f64::from(b));
    let m = n / k.max(1);
    fact(n) / (fact(k).powi(m as i32) * fact(m))
}

/// What one besteffort call returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BestEffortPick {
    pub mask: GpuMask,
    /// The partition search was too large; a greedy choice was made.
    pub fallback: bool,
    /// The faithful code would have returned the padded group (its nil bug, PR #80).
    pub padded_won: bool,
}

/// go-gpuallocator `bestEffortPolicy.Allocate` for `k` of the `free` GPUs (no required
/// devices): pad to a multiple of `k`, enumerate partitions into `k`-groups (first member
/// increasing, a group holds all the padding or none), take the highest-scoring partition
/// (first found on ties), return its highest-scoring group (first on ties) — but never the
/// padded one. `k = 1`: the first free device.
pub fn besteffort_choose(topo: &Topology, free: GpuMask, k: u32) -> Option<BestEffortPick> {
    let devs: Vec<u32> = (0..topo.gpu_count()).filter(|b| free >> b & 1 == 1).collect();
    let n = devs.len() as u32;
    if k == 0 || k > n {
        return None;
    }
    if k == 1 || k == n {
        return Some(BestEffortPick {
            mask: lowest_bits(free, k)?,
            fallback: false,
            padded_won: false,
        });
    }
    let pad = (k - n % k) % k;
    let total = n + pad;
    if partition_count(total, k) > PARTITION_CAP {
        return Some(BestEffortPick {
            mask: greedy_score(topo, &devs, k),
            fallback: true,
            padded_won: false,
        });
    }
    // Positions 0..n are devices, n..total padding; scores by position.
    let score = |a: u32, b: u32| -> u32 {
        if a >= n || b >= n {
            0
        } else {
            pair_score(topo.link(devs[a as usize], devs[b as usize]))
        }
    };
    let pad_mask: u32 = ((1u32 << total) - 1) & !((1u32 << n) - 1);
    let group_score = |g: u32| -> u32 {
        let mut s = 0;
        let mut rest = g;
        while rest != 0 {
            let a = rest.trailing_zeros();
            rest &= rest - 1;
            let mut r2 = rest;
            while r2 != 0 {
                let b = r2.trailing_zeros();
                r2 &= r2 - 1;
                s += score(a, b);
            }
        }
        s
    };
    struct Search<'a> {
        k: u32,
        pad_mask: u32,
        group_score: &'a dyn Fn(u32) -> u32,
        best: Option<(u32, Vec<u32>)>,
        groups: Vec<u32>,
    }
    fn rec(s: &mut Search<'_>, rem: u32, acc: u32) {
        if rem == 0 {
            if s.best.as_ref().is_none_or(|(b, _)| acc > *b) {
                s.best = Some((acc, s.groups.clone()));
            }
            return;
        }
        let first = rem.trailing_zeros();
        combos(s, rem & !(1 << first), s.k - 1, 1 << first, rem, acc);
    }
    /// Groups of the first remaining device plus `need` of `avail`, in lexicographic order
    /// (Go's iterateGPUSets order, which decides "first found").
    fn combos(s: &mut Search<'_>, avail: u32, need: u32, g: u32, rem: u32, acc: u32) {
        if need == 0 {
            let p = g & s.pad_mask;
            if p == 0 || p == s.pad_mask {
                let gs = (s.group_score)(g);
                s.groups.push(g);
                rec(s, rem & !g, acc + gs);
                s.groups.pop();
            }
            return;
        }
        let mut a = avail;
        while a != 0 {
            let b = a.trailing_zeros();
            a &= a - 1;
            if a.count_ones() + 1 < need {
                break;
            }
            combos(s, a, need - 1, g | 1 << b, rem, acc);
        }
    }
    let mut s = Search {
        k,
        pad_mask,
        group_score: &group_score,
        best: None,
        groups: Vec::new(),
    };
    rec(&mut s, (1u32 << total) - 1, 0);
    let (_, groups) = s.best?;
    let mut best: Option<(u32, u32)> = None; // (score, group) among padding-free groups
    let mut padded_won = false;
    let mut go_pick: Option<(u32, bool)> = None; // what the faithful code returns
    for &g in &groups {
        let sc = group_score(g);
        let padded = g & pad_mask != 0;
        if go_pick.is_none_or(|(b, _)| sc > b) {
            go_pick = Some((sc, padded));
        }
        if !padded && best.is_none_or(|(b, _)| sc > b) {
            best = Some((sc, g));
        }
    }
    if let Some((_, true)) = go_pick {
        padded_won = true;
    }
    let (_, g) = best?;
    let mask = (0..n)
        .filter(|p| g >> p & 1 == 1)
        .fold(0u64, |m, p| m | 1 << devs[p as usize]);
    Some(BestEffortPick {
        mask,
        fallback: false,
        padded_won,
    })
}

/// Fallback for large searches: grow from each free GPU by the device adding the most
/// pair score; keep the best set (first on ties).
fn greedy_score(topo: &Topology, devs: &[u32], k: u32) -> GpuMask {
    let mut best: Option<(u32, GpuMask)> = None;
    for &seed in devs {
        let mut set = vec![seed];
        let mut total = 0;
        while (set.len() as u32) < k {
            let next = devs
                .iter()
                .filter(|d| !set.contains(d))
                .map(|&d| (set.iter().map(|&s| pair_score(topo.link(s, d))).sum::<u32>(), d))
                .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            let Some((gain, d)) = next else { break };
            total += gain;
            set.push(d);
        }
        let mask = set.iter().fold(0u64, |m, &d| m | 1 << d);
        if best.is_none_or(|(b, _)| total > b) {
            best = Some((total, mask));
        }
    }
    best.map(|(_, m)| m).unwrap_or(0)
}

/// Packing node choice + go-gpuallocator best-effort GPUs.
pub struct BestEffort {
    pub rng: StdRng,
    pub fallbacks: u64,
    pub invalid: u64,
}

impl NodePolicy for BestEffort {
    fn choose(&mut self, cl: &SimCluster, task: &Task, _remaining: u32) -> Option<(usize, GpuMask)> {
        let pick = packing_first(cl, task, &mut self.rng)?;
        let node = &cl.nodes[pick];
        if task.gpus == 0 {
            return Some((pick, 0));
        }
        let r = besteffort_choose(cl.topo_of(pick), node.free_mask, task.gpus)?;
        self.fallbacks += u64::from(r.fallback);
        self.invalid += u64::from(r.padded_won);
        Some((pick, r.mask))
    }
    fn fallbacks(&self) -> u64 {
        self.fallbacks
    }
    fn invalid(&self) -> u64 {
        self.invalid
    }
}

/// A HiveD-like cell tree of one topology: levels of a laminar family, level 0 the single
/// GPUs, the last level the whole node. Level `i` groups the GPUs connected by links of
/// weight ≥ the i-th best link class present (so a PCIe tree gives switch → socket →
/// node, like HiveD's configured hierarchy; a mesh whose best links already connect
/// everything is flat, as a hierarchy cannot express it).
#[derive(Clone, Debug)]
pub struct CellTree {
    pub levels: Vec<Vec<GpuMask>>,
}

impl CellTree {
    pub fn of(t: &Topology) -> CellTree {
        let n = t.gpu_count();
        let mut weights: Vec<u32> = (0..n)
            .flat_map(|a| (a + 1..n).map(move |b| (a, b)))
            .map(|(a, b)| t.link(a, b).weight())
            .collect();
        weights.sort_unstable_by(|a, b| b.cmp(a));
        weights.dedup();
        let mut levels: Vec<Vec<GpuMask>> = vec![(0..n).map(|i| 1u64 << i).collect()];
        for w in weights {
            // Components of the graph of links with weight ≥ w.
            let mut comps: Vec<GpuMask> = Vec::new();
            let mut seen: GpuMask = 0;
            for s in 0..n {
                if seen >> s & 1 == 1 {
                    continue;
                }
                let mut comp: GpuMask = 1 << s;
                let mut frontier = vec![s];
                while let Some(a) = frontier.pop() {
                    for b in 0..n {
                        if comp >> b & 1 == 0 && t.link(a, b).weight() >= w && a != b {
                            comp |= 1 << b;
                            frontier.push(b);
                        }
                    }
                }
                seen |= comp;
                comps.push(comp);
            }
            if levels.last() != Some(&comps) {
                levels.push(comps);
            }
        }
        if levels.last().map(|l| l.len()) != Some(1) {
            levels.push(vec![t.all_mask()]);
        }
        CellTree { levels }
    }

    /// Free counts of the cells holding `cell` (at `level`) and its ancestors, bottom-up:
    /// the buddy best-fit key (prefer cells inside already broken ancestors).
    fn chain(&self, level: usize, cell: GpuMask, free: GpuMask) -> Vec<u32> {
        let bit = cell.trailing_zeros();
        (level..self.levels.len())
            .map(|l| {
                let c = self.levels[l].iter().find(|c| *c >> bit & 1 == 1).copied().unwrap_or(0);
                (c & free).count_ones()
            })
            .collect()
    }

    /// HiveD's choice of `k` GPUs in `free`: the lowest level with a cell holding `k` free
    /// GPUs (lowest common ancestor), the best-fit such cell, then recursively the
    /// best-fit child; a request spanning children takes the fullest children first.
    /// Returns the mask and its key (level, best-fit chain) for node comparison.
    pub fn choose(&self, free: GpuMask, k: u32) -> Option<(GpuMask, usize, Vec<u32>)> {
        if k == 0 {
            return Some((0, 0, Vec::new()));
        }
        for (l, cells) in self.levels.iter().enumerate() {
            let best = cells
                .iter()
                .filter(|c| (**c & free).count_ones() >= k)
                .map(|&c| (self.chain(l, c, free), c))
                .min();
            if let Some((key, cell)) = best {
                return Some((self.alloc(l, cell, free, k), l, key));
            }
        }
        None
    }

    fn alloc(&self, level: usize, cell: GpuMask, free: GpuMask, k: u32) -> GpuMask {
        let here = cell & free;
        if level == 0 || here.count_ones() == k {
            return lowest_bits(here, k).unwrap_or(0);
        }
        let children: Vec<GpuMask> = self.levels[level - 1]
            .iter()
            .copied()
            .filter(|c| c & cell == *c && (c & free) != 0)
            .collect();
        let mut used: Vec<bool> = vec![false; children.len()];
        let mut out = 0;
        let mut rem = k;
        while rem > 0 {
            let fit = (0..children.len())
                .filter(|&i| !used[i] && (children[i] & free).count_ones() >= rem)
                .min_by_key(|&i| ((children[i] & free).count_ones(), i));
            if let Some(i) = fit {
                return out | self.alloc(level - 1, children[i], free, rem);
            }
            let Some(i) = (0..children.len())
                .filter(|&i| !used[i])
                .max_by_key(|&i| ((children[i] & free).count_ones(), std::cmp::Reverse(i)))
            else {
                break;
            };
            used[i] = true;
            out |= children[i] & free;
            rem -= (children[i] & free).count_ones();
        }
        out
    }
}

/// HiveD-like: per node the cell-tree choice; the node with the lowest LCA level, then the
/// best buddy fit (its chain of free counts, node free GPUs last = packing), then index.
pub struct Hived {
    pub trees: HashMap<usize, CellTree>,
}

impl NodePolicy for Hived {
    fn choose(&mut self, cl: &SimCluster, task: &Task, _remaining: u32) -> Option<(usize, GpuMask)> {
        let mut best: Option<((usize, Vec<u32>), usize, GpuMask)> = None;
        for (i, n) in cl.nodes.iter().enumerate() {
            if !n.fits(task) {
                continue;
            }
            let tree = self
                .trees
                .entry(n.topo)
                .or_insert_with(|| CellTree::of(&cl.topos[n.topo]));
            let Some((mask, level, chain)) = tree.choose(n.free_mask, task.gpus) else {
                continue;
            };
            let key = (level, chain);
            if best.as_ref().is_none_or(|(b, _, _)| key < *b) {
                best = Some((key, i, mask));
            }
        }
        best.map(|(_, i, m)| (i, m))
    }
}
