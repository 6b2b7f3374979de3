//! GPU interconnect topology of a node and the topology-aware choice of GPU sets.
//!
//! PLACEHOLDER SKELETON — the real implementation replaces this file (see the brief).

use crate::resources::{lowest_bits, GpuMask};

/// Link class between two GPUs, as `nvidia-smi topo -m` prints it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Link {
    /// Bonded NVLinks (`NV#`), with the number of links.
    Nv(u8),
    Pix,
    Pxb,
    Phb,
    Node,
    Sys,
}

/// A node's GPU topology: the link class of every GPU pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    name: String,
    n: u32,
    links: Vec<Link>,
}

/// A topology that could not be read.
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

impl Topology {
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn gpu_count(&self) -> u32 {
        self.n
    }
    pub fn preset(_name: &str) -> Option<Topology> {
        None
    }
    /// A preset name (`pcie8`, `dgx1v`, ...; `none` = no topology → `Ok(None)`) or the
    /// text of `nvidia-smi topo -m`.
    pub fn from_spec(text: &str) -> Result<Option<Topology>, TopologyError> {
        if text.trim() == "none" || text.trim().is_empty() {
            return Ok(None);
        }
        Topology::preset(text.trim())
            .map(Some)
            .ok_or_else(|| TopologyError(format!("unknown topology `{text}`")))
    }
    pub fn tier(&self, _mask: GpuMask) -> u8 {
        0
    }
    pub fn weight(&self, _mask: GpuMask) -> u32 {
        0
    }
    pub fn islands(&self, _tier: u8) -> Vec<GpuMask> {
        Vec::new()
    }
    pub fn best_tier(&self, _k: u32) -> u8 {
        0
    }
    pub fn link(&self, a: u32, b: u32) -> Link {
        self.links[(a * self.n + b) as usize]
    }
}

/// Chooses `k` GPUs among `free`. `None` when `free` has fewer than `k` bits.
pub fn choose(topo: Option<&Topology>, free: GpuMask, k: u32) -> Option<GpuChoice> {
    let _ = topo;
    lowest_bits(free, k).map(|mask| GpuChoice {
        mask,
        tier: 0,
        weight: 0,
    })
}
