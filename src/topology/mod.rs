//! GPU interconnect topology of a node and the topology-aware choice of GPU sets
//! (DESIGN.md §5, reference/gpu-topology.md §6–§7).
//!
//! Owns: the link-class matrix of a node ([`Topology`]), built from a preset name or the text of
//! `nvidia-smi topo -m` (`parse`), rendered back to that text for the wire, with the NICs and
//! the GPUs' CPU and NUMA affinity that text lists (`locality`); the set metrics
//! T(S) ([`Topology::tier`]) and W(S) ([`Topology::weight`]); the islands the dashboard groups
//! GPU boxes by ([`Topology::islands`]); and [`choose`], the exact-or-bounded search for the best
//! free GPU set of a given size.
//!
//! Conventions used throughout:
//! - bit `i` of a [`GpuMask`] is GPU `i`; bits at or above [`Topology::gpu_count`] are ignored by
//!   the metrics;
//! - a set of zero or one GPU is connected at every tier, so its tier is 2 (the best);
//! - G_c is the graph whose edges are the links of tier ≥ c. G_0 is complete (every pair has a
//!   link), so every set has tier ≥ 0.

mod choose;
mod link;
mod locality;
mod parse;
mod presets;
#[cfg(test)]
mod tests;

pub use choose::{choose, Fit, FIT_LEVELS};
pub use link::Link;
pub use locality::{task_locality, CpuList, GpuAffinity, Nic, TaskLocality};

use crate::resources::GpuMask;
use choose::Tables;

/// A node's GPU topology: the link class of every GPU pair, plus lookup tables computed once
/// when it is built (adjacency masks per tier and per link class, islands, the island tree of
/// tree-shaped nodes) so that [`choose`] does no per-topology work per call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    name: String,
    n: u32,
    /// Row-major `n × n`; the diagonal holds `Link::Nv(0)` (the `X` cell) and is never used.
    links: Vec<Link>,
    tables: Tables,
    /// NICs and how each GPU reaches them (empty when the text lists none).
    nics: Vec<Nic>,
    /// Per GPU, its CPU and NUMA affinity (empty when the text has no affinity columns).
    affinity: Vec<GpuAffinity>,
    /// GPUs that share a PCIe switch (PIX/PXB) with an InfiniBand/RoCE NIC.
    nic_near: GpuMask,
}

/// A topology that could not be read or built; the message names the line, cell or pair at
/// fault and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TopologyError(pub String);

/// Result of choosing GPUs on a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuChoice {
    pub mask: GpuMask,
    /// Connectivity tier T(S) (2 NVLink, 1 PCIe switch, 0 host); 0 without topology.
    pub tier: u8,
    /// Pair-weight sum W(S); 0 without topology.
    pub weight: u32,
}

/// Most GPUs a topology may describe (one `u64` mask).
pub const MAX_GPUS: u32 = 64;

impl Topology {
    /// Builds a topology of `n` GPUs (1..=64) from a link function. `link(a, b)` is asked only
    /// for `a < b` and the matrix is made symmetric from it. `Nv(0)` is rejected (a pair that
    /// has no NVLink has a PCIe class).
    pub fn new(name: &str, n: u32, link: impl Fn(u32, u32) -> Link) -> Result<Topology, TopologyError> {
        if n == 0 || n > MAX_GPUS {
            return Err(TopologyError(format!("a topology has 1 to {MAX_GPUS} GPUs, not {n}")));
        }
        let mut links = vec![Link::Nv(0); (n * n) as usize];
        for a in 0..n {
            for b in a + 1..n {
                let l = link(a, b);
                if l == Link::Nv(0) {
                    return Err(TopologyError(format!(
                        "GPU{a}–GPU{b}: NV0 is not a link class (use the PCIe class of the pair)"
                    )));
                }
                links[(a * n + b) as usize] = l;
                links[(b * n + a) as usize] = l;
            }
        }
        let tables = Tables::build(n, &links);
        Ok(Topology {
            name: name.to_string(),
            n,
            links,
            tables,
            nics: Vec::new(),
            affinity: Vec::new(),
            nic_near: 0,
        })
    }

    /// The same topology with its NICs (each with one link per GPU) and its GPUs' affinity
    /// (one entry per GPU, or none at all).
    pub fn with_locality(mut self, nics: Vec<Nic>, affinity: Vec<GpuAffinity>) -> Result<Topology, TopologyError> {
        let n = self.n as usize;
        if let Some(nic) = nics.iter().find(|x| x.links.len() != n) {
            return Err(TopologyError(format!(
                "NIC {}: {} GPU links for {n} GPUs (one per GPU)",
                nic.name,
                nic.links.len()
            )));
        }
        if !affinity.is_empty() && affinity.len() != n {
            return Err(TopologyError(format!(
                "{} GPU affinity entries for {n} GPUs (one per GPU, or none)",
                affinity.len()
            )));
        }
        self.nic_near = (0..self.n)
            .filter(|&g| nics.iter().any(|x| x.is_rdma() && x.links[g as usize].tier() >= 1))
            .fold(0, |m, g| m | 1 << g);
        let numa: Vec<Option<u32>> = affinity.iter().map(|a| a.numa).collect();
        self.tables.set_numa(&numa);
        let near: Vec<GpuMask> = nics
            .iter()
            .map(|x| {
                (0..self.n)
                    .filter(|&g| x.links[g as usize].tier() >= 1)
                    .fold(0, |m, g| m | 1 << g)
            })
            .collect();
        self.tables.set_nics(&near);
        self.nics = nics;
        self.affinity = affinity;
        Ok(self)
    }

    /// The NICs the topology text lists, in its column order.
    pub fn nics(&self) -> &[Nic] {
        &self.nics
    }

    /// Each GPU's CPU and NUMA affinity (empty when unknown).
    pub fn affinity(&self) -> &[GpuAffinity] {
        &self.affinity
    }

    /// N(S): how many NUMA nodes the GPUs of `mask` sit on beyond the first (GPUs of unknown
    /// affinity count for none; 0 when they share one NUMA node, or the affinity is unknown).
    /// Among sets equal on T and W, fewer is better ([`choose`]). Bits outside the node are
    /// ignored.
    pub fn numa_split(&self, mask: GpuMask) -> u8 {
        self.tables.numa_split(mask & self.tables.all)
    }

    /// A(S) (issue 27): 1 when `mask` holds two GPUs or more and no NIC is PIX/PXB-near all
    /// of them, on a node where some NIC is near two GPUs; 0 otherwise. Among sets equal on
    /// T, W and N, fewer is better ([`choose`]): the set whose GPUs share a NIC wins.
    pub fn nic_apart(&self, mask: GpuMask) -> u8 {
        self.tables.nic_apart(mask & self.tables.all)
    }

    /// The GPUs that share a PCIe switch (PIX/PXB) with an InfiniBand/RoCE NIC: their traffic
    /// to other nodes can go GPUDirect RDMA.
    pub fn nic_near(&self) -> GpuMask {
        self.nic_near
    }

    /// Preset name, or `"custom"` for a topology parsed from `nvidia-smi topo -m` text.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn gpu_count(&self) -> u32 {
        self.n
    }

    /// Link class between GPUs `a` and `b`. `a == b` (the `X` cell) gives `Link::Nv(0)`; a GPU
    /// index outside the node gives `Link::Sys` (nothing better is known about it).
    pub fn link(&self, a: u32, b: u32) -> Link {
        if a >= self.n || b >= self.n {
            return Link::Sys;
        }
        self.links[(a * self.n + b) as usize]
    }

    /// The mask of all GPUs of the node (bits `0..gpu_count`).
    pub fn all_mask(&self) -> GpuMask {
        self.tables.all
    }

    /// T(S): the highest tier c such that the GPUs of `mask` are connected using only links of
    /// tier ≥ c. Zero or one GPU → 2 by convention (nothing to connect). Bits outside the node
    /// are ignored.
    pub fn tier(&self, mask: GpuMask) -> u8 {
        self.tables.tier(mask & self.tables.all)
    }

    /// W(S): the sum of the pair weights of the GPUs of `mask` (bits outside the node ignored).
    pub fn weight(&self, mask: GpuMask) -> u32 {
        self.tables.weight(mask & self.tables.all)
    }

    /// T*(k): the best tier a set of `k` GPUs can reach on the empty node. `k ≤ 1` → 2;
    /// `k` above the GPU count → 0 (no such set; callers check the count first).
    pub fn best_tier(&self, k: u32) -> u8 {
        if k <= 1 {
            return 2;
        }
        (0..=2u8)
            .rev()
            .find(|&c| self.tables.islands[c as usize].iter().any(|m| m.count_ones() >= k))
            .unwrap_or(0)
    }

    /// Connected components of G_tier over all GPUs (tier above 2 is read as 2), ordered by
    /// lowest GPU. Tier 2: NVLink islands; tier 1: PCIe switch groups (and NVLink islands
    /// joined through them); tier 0: the whole node. Every GPU is in exactly one island.
    pub fn islands(&self, tier: u8) -> Vec<GpuMask> {
        self.tables.islands[tier.min(2) as usize].clone()
    }

    /// True when the node is tree-shaped (ultrametric): every pair's link is the one of their
    /// lowest common island, e.g. PCIe trees, NVSwitch boxes, aligned NVLink bridges.
    pub fn is_tree(&self) -> bool {
        self.tables.tree.is_some()
    }
}

impl Topology {
    /// The fragmentation vector of a free set: [cap(8), cap(4), cap(2)], where cap(s) is the
    /// best tier of a component of ≥ s GPUs (−1 when there are fewer than s GPUs). Larger is
    /// better: more room for well-connected future sets.
    pub fn cap(&self, set: GpuMask) -> [i8; 3] {
        self.tables.cap(set & self.tables.all)
    }

    /// Fit(F, X), the best-fit vector of taking `x` from the free set `free`: for each link
    /// class of the ladder NV#, PIX, PXB, PHB, NODE (innermost first), the free GPUs left
    /// beside `x` in the groups of that level it takes from (a group: a component of ≥ 2 GPUs
    /// of the graph of links at least that good; any NV# counts as NVLink). Smaller is better:
    /// finishing a broken group keeps whole groups whole (HiveD's buddy rule, innermost level
    /// first). The levels mean the same on every topology, so the vectors of different
    /// machines compare. Bits outside the node are ignored.
    pub fn fit(&self, free: GpuMask, x: GpuMask) -> Fit {
        let all = self.tables.all;
        self.tables.fit(free & all, x & all)
    }
}

/// Content hash: the GPU count, the link matrix, the NICs and the affinity (not the name, so a
/// parsed matrix equal to a preset hashes alike; equal topologies hash equal as `Eq` requires).
impl std::hash::Hash for Topology {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.n.hash(state);
        self.links.hash(state);
        self.nics.hash(state);
        self.affinity.hash(state);
    }
}

impl Topology {
    /// Same GPU count, link matrix, NICs and affinity, whatever the names (everything a GPU
    /// choice and a task's locality depend on).
    pub fn same_content(&self, other: &Topology) -> bool {
        self.n == other.n && self.links == other.links && self.nics == other.nics && self.affinity == other.affinity
    }
}
