//! What a node's `nvidia-smi topo -m` says beside the GPU matrix: the NICs and how each GPU
//! reaches them, and each GPU's CPU and NUMA affinity; and, from those and a granted GPU
//! mask, what a task gets ([`task_locality`]): its NUMA-local CPUs and the NICs behind its
//! GPUs' PCIe switches, as the environment the node hands it.
//!
//! Pure data and functions: the executor applies the CPU list (cpuset or `taskset`), the
//! placement objective reads [`super::Topology::nic_near`].

use std::fmt;

use super::{Link, Topology};
use crate::resources::GpuMask;

/// A network interface in the matrix (`mlx5_0`, `ib0`, `eth2`; new drivers print `NIC0` and
/// name it in the `NIC Legend`), with its link from every GPU.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Nic {
    pub name: String,
    /// `links[g]`: GPU g to this NIC.
    pub links: Vec<Link>,
}

impl Nic {
    /// InfiniBand or RoCE (Mellanox `mlx*`, `ib*`): what NCCL's `NCCL_IB_HCA` names.
    pub fn is_rdma(&self) -> bool {
        self.name.starts_with("mlx") || self.name.starts_with("ib")
    }
}

/// A CPU list as Linux writes it (`0-19,40-59`): sorted, merged inclusive ranges.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CpuList(Vec<(u32, u32)>);

impl CpuList {
    /// Parses `0-19,40-59` (single CPUs and ranges, any order; overlaps merged). `None` for
    /// anything else (`N/A`, an empty cell, a reversed range).
    pub fn parse(text: &str) -> Option<CpuList> {
        let mut ranges = Vec::new();
        for part in text.trim().split(',') {
            let (lo, hi) = match part.split_once('-') {
                Some((a, b)) => (a.trim().parse().ok()?, b.trim().parse().ok()?),
                None => {
                    let c: u32 = part.trim().parse().ok()?;
                    (c, c)
                }
            };
            if lo > hi {
                return None;
            }
            ranges.push((lo, hi));
        }
        Some(CpuList::from_ranges(ranges))
    }

    fn from_ranges(mut ranges: Vec<(u32, u32)>) -> CpuList {
        ranges.sort_unstable();
        let mut out: Vec<(u32, u32)> = Vec::with_capacity(ranges.len());
        for (lo, hi) in ranges {
            match out.last_mut() {
                Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
                _ => out.push((lo, hi)),
            }
        }
        CpuList(out)
    }

    /// Every CPU of either list.
    pub fn union(&self, other: &CpuList) -> CpuList {
        CpuList::from_ranges(self.0.iter().chain(&other.0).copied().collect())
    }

    /// The CPUs of both lists.
    pub fn intersect(&self, other: &CpuList) -> CpuList {
        let mut out = Vec::new();
        for &(a, b) in &self.0 {
            for &(c, d) in &other.0 {
                let (lo, hi) = (a.max(c), b.min(d));
                if lo <= hi {
                    out.push((lo, hi));
                }
            }
        }
        CpuList::from_ranges(out)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Every CPU, ascending.
    pub fn cpus(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().flat_map(|&(lo, hi)| lo..=hi)
    }
}

impl fmt::Display for CpuList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, &(lo, hi)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            if lo == hi {
                write!(f, "{lo}")?;
            } else {
                write!(f, "{lo}-{hi}")?;
            }
        }
        Ok(())
    }
}

/// One GPU's affinity columns (`CPU Affinity`, `NUMA Affinity`); `None` where the text has
/// none or `N/A`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct GpuAffinity {
    pub cpus: Option<CpuList>,
    pub numa: Option<u32>,
}

/// What a task gets from where its GPUs are.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TaskLocality {
    /// The CPUs local to the task's GPUs (the union of their affinities); `None` when some
    /// GPU's affinity is unknown, or the task has no GPU.
    pub cpus: Option<CpuList>,
    /// NUMA nodes of those GPUs, ascending.
    pub numa: Vec<u32>,
    /// The NIC nearest each GPU (the best link class; the first such NIC on a tie), in GPU
    /// order, each named once.
    pub nics: Vec<String>,
    /// Those of `nics` that are InfiniBand/RoCE and share a PCIe switch (PIX/PXB) with their
    /// GPU: the GPUDirect RDMA path NCCL should use.
    pub rdma_nics: Vec<String>,
}

impl TaskLocality {
    /// The environment the node hands the task: `GPUAM_CPU_AFFINITY` (`0-19,40-59`),
    /// `GPUAM_NUMA_NODES` (`0,1`), `GPUAM_NIC` (nearest NICs, comma list) and, when some are
    /// InfiniBand/RoCE behind the GPUs' own PCIe switches, `NCCL_IB_HCA` (`mlx5_0,mlx5_1`).
    pub fn env(&self) -> Vec<(String, String)> {
        let mut env = Vec::new();
        let join = |v: &[String]| v.join(",");
        if let Some(c) = &self.cpus {
            env.push(("GPUAM_CPU_AFFINITY".to_string(), c.to_string()));
        }
        if !self.numa.is_empty() {
            let numa: Vec<String> = self.numa.iter().map(u32::to_string).collect();
            env.push(("GPUAM_NUMA_NODES".to_string(), join(&numa)));
        }
        if !self.nics.is_empty() {
            env.push(("GPUAM_NIC".to_string(), join(&self.nics)));
        }
        if !self.rdma_nics.is_empty() {
            env.push(("NCCL_IB_HCA".to_string(), join(&self.rdma_nics)));
        }
        env
    }
}

/// What a task granted `mask` on a node of topology `topo` gets: the union of its GPUs' CPU
/// affinities (only when every one of them is known), their NUMA nodes, the NIC nearest each
/// GPU and, of those, the InfiniBand/RoCE ones behind the GPU's own PCIe switch. GPUs outside
/// the topology are ignored.
pub fn task_locality(topo: &Topology, mask: GpuMask) -> TaskLocality {
    let gpus: Vec<u32> = (0..topo.gpu_count()).filter(|g| mask >> g & 1 == 1).collect();
    let mut out = TaskLocality::default();
    if gpus.is_empty() {
        return out;
    }
    let affinity = topo.affinity();
    let mut cpus: Option<CpuList> = Some(CpuList::default());
    for &g in &gpus {
        let a = affinity.get(g as usize);
        cpus = match (cpus, a.and_then(|a| a.cpus.as_ref())) {
            (Some(acc), Some(c)) => Some(acc.union(c)),
            _ => None,
        };
        if let Some(n) = a.and_then(|a| a.numa) {
            if !out.numa.contains(&n) {
                out.numa.push(n);
            }
        }
    }
    out.numa.sort_unstable();
    out.cpus = cpus.filter(|c| !c.is_empty());
    for &g in &gpus {
        let nearest = topo
            .nics()
            .iter()
            .filter_map(|n| n.links.get(g as usize).map(|l| (l.weight(), n)))
            .fold(None::<(u32, &Nic)>, |best, (w, n)| match best {
                Some((bw, _)) if bw >= w => best,
                _ => Some((w, n)),
            });
        let Some((_, nic)) = nearest else { continue };
        if !out.nics.contains(&nic.name) {
            out.nics.push(nic.name.clone());
        }
        let behind_switch = nic.links.get(g as usize).is_some_and(|l| l.tier() >= 1);
        if nic.is_rdma() && behind_switch && !out.rdma_nics.contains(&nic.name) {
            out.rdma_nics.push(nic.name.clone());
        }
    }
    out
}
