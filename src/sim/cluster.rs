//! The simulator's node model: one flat list of nodes with their topology, rack and free
//! CPU / memory / GPU mask, shared by every policy, plus the cluster builders (generated
//! N × preset × racks, and the Philly / Alibaba 2023 machine lists).

use std::sync::Arc;

use crate::cluster::Node;
use crate::resources::{GpuMask, PortSet, Resources};
use crate::topology::{Link, Topology};

/// One node as the simulator books it.
#[derive(Clone, Debug)]
pub struct SimNode {
    pub host: String,
    pub rack: usize,
    /// Index into [`SimCluster::topos`].
    pub topo: usize,
    pub all_mask: GpuMask,
    pub cpu_total: u32,
    pub mem_total: u64,
    pub free_mask: GpuMask,
    pub free_cpu: u32,
    pub free_mem: u64,
    /// Its GPU type (issue 27): the trace's `gpu_type`, else the machine kind (its
    /// topology's name), so a generated cluster of one preset has one type.
    pub gpu_type: Arc<str>,
}

impl SimNode {
    pub fn gpus_total(&self) -> u32 {
        self.all_mask.count_ones()
    }
    pub fn free_gpus(&self) -> u32 {
        self.free_mask.count_ones()
    }
    /// CPU, memory and GPU count fit (the check every policy must respect).
    pub fn fits(&self, t: &Task) -> bool {
        self.free_cpu >= t.cpu && self.free_mem >= t.mem_mb && self.free_gpus() >= t.gpus
    }
}

/// One task of a job: what it holds while it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Task {
    pub gpus: u32,
    pub cpu: u32,
    pub mem_mb: u64,
}

/// The cluster: nodes, the distinct topologies they use, and rack capacities.
#[derive(Clone, Debug)]
pub struct SimCluster {
    pub nodes: Vec<SimNode>,
    pub topos: Vec<Arc<Topology>>,
    pub rack_names: Vec<String>,
    /// GPUs per rack (for racksOverMin's minimum).
    pub rack_gpus: Vec<u32>,
}

/// Describes how a cluster was built, for the report.
#[derive(Clone, Debug, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterSummary {
    pub nodes: usize,
    pub gpus: u64,
    pub racks: usize,
    /// (topology name, node count).
    pub topologies: Vec<(String, usize)>,
}

impl SimCluster {
    pub fn new() -> Self {
        SimCluster {
            nodes: Vec::new(),
            topos: Vec::new(),
            rack_names: Vec::new(),
            rack_gpus: Vec::new(),
        }
    }

    /// Index of `topo` in the shared list (one `Arc` per topology name, so the select
    /// pipeline's choice cache and the metrics' memo hit).
    pub fn topo_index(&mut self, topo: &Topology) -> usize {
        if let Some(i) = self.topos.iter().position(|t| **t == *topo) {
            return i;
        }
        self.topos.push(Arc::new(topo.clone()));
        self.topos.len() - 1
    }

    fn rack_index(&mut self, name: &str) -> usize {
        if let Some(i) = self.rack_names.iter().position(|r| r == name) {
            return i;
        }
        self.rack_names.push(name.to_string());
        self.rack_gpus.push(0);
        self.rack_names.len() - 1
    }

    pub fn add_node(&mut self, host: String, rack: &str, topo: &Topology, cpu: u32, mem_mb: u64) {
        let t = self.topo_index(topo);
        let r = self.rack_index(rack);
        let all = self.topos[t].all_mask();
        self.rack_gpus[r] += all.count_ones();
        self.nodes.push(SimNode {
            host,
            rack: r,
            topo: t,
            all_mask: all,
            cpu_total: cpu,
            mem_total: mem_mb,
            free_mask: all,
            free_cpu: cpu,
            free_mem: mem_mb,
            gpu_type: Arc::from(topo.name()),
        });
    }

    pub fn topo_of(&self, node: usize) -> &Topology {
        &self.topos[self.nodes[node].topo]
    }

    pub fn max_node_gpus(&self) -> u32 {
        self.nodes.iter().map(|n| n.gpus_total()).max().unwrap_or(0)
    }
    pub fn max_rack_gpus(&self) -> u32 {
        self.rack_gpus.iter().copied().max().unwrap_or(0)
    }
    pub fn total_gpus(&self) -> u64 {
        self.nodes.iter().map(|n| u64::from(n.gpus_total())).sum()
    }

    /// Takes `mask` and the task's CPU/memory on `node`. False (and nothing changes) if
    /// any of it is not free: a policy bug, which the engine reports.
    pub fn book(&mut self, node: usize, mask: GpuMask, t: &Task) -> bool {
        let n = &mut self.nodes[node];
        if mask & !n.free_mask != 0 || mask.count_ones() != t.gpus || n.free_cpu < t.cpu || n.free_mem < t.mem_mb {
            return false;
        }
        n.free_mask &= !mask;
        n.free_cpu -= t.cpu;
        n.free_mem -= t.mem_mb;
        true
    }

    pub fn free(&mut self, node: usize, mask: GpuMask, t: &Task) {
        let n = &mut self.nodes[node];
        n.free_mask |= mask & n.all_mask;
        n.free_cpu = (n.free_cpu + t.cpu).min(n.cpu_total);
        n.free_mem = (n.free_mem + t.mem_mb).min(n.mem_total);
    }

    /// The same nodes for the real select pipeline (all free; the engine books through
    /// the selector).
    pub fn to_nodes(&self) -> Vec<Node> {
        self.nodes
            .iter()
            .map(|n| {
                let mut node = Node::new(
                    n.host.clone(),
                    self.rack_names[n.rack].clone(),
                    Resources::with_mask(n.cpu_total, n.mem_total, n.all_mask, PortSet::new()),
                );
                node.topology = Some(self.topos[n.topo].clone());
                node.gpu_type = Some(n.gpu_type.to_string());
                node
            })
            .collect()
    }

    pub fn summary(&self) -> ClusterSummary {
        let mut topologies: Vec<(String, usize)> = Vec::new();
        for n in &self.nodes {
            let name = self.topos[n.topo].name().to_string();
            match topologies.iter_mut().find(|(t, _)| *t == name) {
                Some((_, c)) => *c += 1,
                None => topologies.push((name, 1)),
            }
        }
        ClusterSummary {
            nodes: self.nodes.len(),
            gpus: self.total_gpus(),
            racks: self.rack_names.len(),
            topologies,
        }
    }
}

impl Default for SimCluster {
    fn default() -> Self {
        Self::new()
    }
}

/// CPU cores and memory a generated node gets per GPU (GPUs, not CPU, are the scarce
/// resource in every workload here).
pub const CPU_PER_GPU: u32 = 8;
pub const MEM_MB_PER_GPU: u64 = 64 * 1024;

/// `n` nodes of one preset, `rack_size` nodes a rack.
pub fn generated(topo: &Topology, n: usize, rack_size: usize) -> SimCluster {
    let mut c = SimCluster::new();
    let g = topo.gpu_count();
    for i in 0..n {
        c.add_node(
            format!("node{i:05}"),
            &format!("/rack{:03}", i / rack_size.max(1)),
            topo,
            CPU_PER_GPU * g,
            MEM_MB_PER_GPU * u64::from(g),
        );
    }
    c
}

/// Small machines of the traces that have no preset: a 2-GPU PIX pair and a single GPU.
pub fn small_topology(gpus: u32) -> Option<Topology> {
    match gpus {
        1 => Topology::new("gpu1", 1, |_, _| Link::Pix).ok(),
        2 => Topology::new("pix2", 2, |_, _| Link::Pix).ok(),
        4 => Topology::preset("pcie4"),
        8 => Topology::preset("pcie8"),
        16 => Topology::preset("pcie16"),
        _ => None,
    }
}

/// Mixed-topology clusters (issue 13), by name: the GPU machines of the demo cluster
/// (`conf/cluster.yaml`: pcie8, dgx1v, pcie4, pcie8, nvswitch8 ×2, nvbridge8, pcie4,
/// repeated), and old PCIe boxes beside NVLink and NVSwitch ones (pcie8 ×2, pcie4, dgx1v,
/// nvbridge8x, nvswitch8, repeated).
pub const MIXED: &[(&str, &[&str])] = &[
    (
        "mixed-demo",
        &[
            "pcie8",
            "dgx1v",
            "pcie4",
            "pcie8",
            "nvswitch8",
            "nvswitch8",
            "nvbridge8",
            "pcie4",
        ],
    ),
    (
        "mixed-old-new",
        &["pcie8", "pcie8", "pcie4", "dgx1v", "nvbridge8x", "nvswitch8"],
    ),
];

/// `n` nodes of a [`MIXED`] cluster, `rack_size` a rack; `None` for an unknown name.
pub fn mixed(name: &str, n: usize, rack_size: usize) -> Option<SimCluster> {
    let (_, cycle) = MIXED.iter().find(|(m, _)| *m == name)?;
    let topos: Vec<Topology> = cycle.iter().filter_map(|p| Topology::preset(p)).collect();
    let mut c = SimCluster::new();
    for i in 0..n {
        let t = &topos[i % topos.len()];
        let g = t.gpu_count();
        c.add_node(
            format!("node{i:05}"),
            &format!("/rack{:03}", i / rack_size.max(1)),
            t,
            CPU_PER_GPU * g,
            MEM_MB_PER_GPU * u64::from(g),
        );
    }
    Some(c)
}
