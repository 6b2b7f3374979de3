//! Named topologies (reference/gpu-topology.md §6.3): PCIe trees, NVLink meshes and bridges,
//! NVSwitch boxes. Choices the reference leaves open are documented per preset.

use super::{CpuList, GpuAffinity, Link, Nic, Topology};

/// Every preset [`Topology::preset`] knows. `none` (no topology) is accepted by
/// [`Topology::from_spec`] but is not listed here, since it builds no topology.
const NAMES: &[&str] = &[
    "pcie4",
    "pcie4-nvbridge",
    "hgx4",
    "pcie8",
    "pcie8-nic",
    "pcie8-1root",
    "dgx1v",
    "dgx1p",
    "nvbridge8",
    "nvbridge8x",
    "nvswitch8",
    "nvswitch16",
    "pcie16",
    "pcie32",
    "pcie64",
];

/// DGX-1 V100 hybrid cube mesh: NV2 pairs (go-gpuallocator `NewDGX1VoltaNode`).
const DGX1V_NV2: &[(u32, u32)] = &[(0, 3), (0, 4), (1, 2), (1, 5), (2, 3), (4, 7), (5, 6), (6, 7)];
/// DGX-1 V100: NV1 pairs.
const DGX1V_NV1: &[(u32, u32)] = &[(0, 1), (0, 2), (1, 3), (2, 6), (3, 7), (4, 5), (4, 6), (5, 7)];

fn has(pairs: &[(u32, u32)], a: u32, b: u32) -> bool {
    pairs.iter().any(|&(x, y)| (x, y) == (a, b) || (y, x) == (a, b))
}

/// A PCIe tree: `sockets × switches × gpus` per switch. Same switch → `PIX`; same socket →
/// `in_socket`; across sockets → `SYS`.
fn pcie_tree(name: &str, switches_per_socket: u32, gpus_per_switch: u32, sockets: u32, in_socket: Link) -> Topology {
    let per_socket = switches_per_socket * gpus_per_switch;
    let link = move |a: u32, b: u32| {
        if a / gpus_per_switch == b / gpus_per_switch {
            Link::Pix
        } else if a / per_socket == b / per_socket {
            in_socket
        } else {
            Link::Sys
        }
    };
    build(name, sockets * per_socket, link)
}

/// Presets have 1..=64 GPUs and never use `Nv(0)`, so [`Topology::new`] cannot fail on them;
/// a failure would be a bug in this file, caught by the preset tests.
fn build(name: &str, n: u32, link: impl Fn(u32, u32) -> Link) -> Topology {
    match Topology::new(name, n, link) {
        Ok(t) => t,
        Err(e) => unreachable!("preset {name} is malformed: {e}"),
    }
}

/// `pcie8` with one RDMA NIC per socket (see [`Topology::preset`]).
fn pcie8_nic() -> Topology {
    let base = pcie_tree("pcie8-nic", 2, 2, 2, Link::Node);
    // The NIC sits on the PCIe switch of GPU `first_gpu` (and its pair), in that GPU's socket.
    let nic = |name: &str, first_gpu: u32| Nic {
        name: name.to_string(),
        links: (0..8)
            .map(|g| {
                if g / 2 == first_gpu / 2 {
                    Link::Pix
                } else if g / 4 == first_gpu / 4 {
                    Link::Node
                } else {
                    Link::Sys
                }
            })
            .collect(),
    };
    let cpus = |text: &str| CpuList::parse(text);
    let affinity = (0..8)
        .map(|g| GpuAffinity {
            cpus: cpus(if g < 4 { "0-15,32-47" } else { "16-31,48-63" }),
            numa: Some(g / 4),
        })
        .collect();
    match base.with_locality(vec![nic("mlx5_0", 0), nic("mlx5_1", 4)], affinity) {
        Ok(t) => t,
        Err(e) => unreachable!("preset pcie8-nic is malformed: {e}"),
    }
}

impl Topology {
    /// Names of the presets, in a stable order (see [`Topology::preset`]).
    pub fn preset_names() -> &'static [&'static str] {
        NAMES
    }

    /// A preset topology by name (case-insensitive, surrounding spaces ignored):
    /// - `pcie4`: 2 sockets × 1 switch × 2 GPUs (PIX in a pair, SYS across).
    /// - `pcie4-nvbridge`: 4 × A100 PCIe, NV12 bridge on 0–1, 2–3 NODE, rest SYS.
    /// - `hgx4`: 4 × H100 SXM, all pairs NV6.
    /// - `pcie8`: 2 sockets × 2 switches × 2 GPUs: PIX in a switch, NODE across switches of a
    ///   socket, SYS across sockets (reference §6.2).
    /// - `pcie8-nic`: `pcie8` with one InfiniBand NIC per socket, on the socket's first switch
    ///   (`mlx5_0` PIX to GPUs 0–1, `mlx5_1` PIX to GPUs 4–5; NODE to the socket's other switch,
    ///   SYS across), CPUs 0–15,32–47 (NUMA 0) for GPUs 0–3 and 16–31,48–63 (NUMA 1) for 4–7: a
    ///   commodity 8-GPU server where only half the GPUs have GPUDirect RDMA.
    /// - `pcie8-1root`: one socket, 2 switches × 4 GPUs: PIX in a switch, PXB across.
    /// - `dgx1v`: DGX-1 V100 hybrid cube mesh with the exact NV1/NV2 pairs of reference §6.3;
    ///   the 12 remaining (cross-quad) pairs are SYS, as on a real DGX-1 where they cross
    ///   sockets. The PCIe switch pairs 0–1, 2–3, 4–5, 6–7 are all NVLinked, and NV takes
    ///   precedence, so no PIX cell shows.
    /// - `dgx1p`: DGX-1 P100: NV1 within the quads {0..3} and {4..7} and on i–(i+4); the other
    ///   pairs SYS.
    /// - `nvbridge8`: NV12 bridges 0–2, 1–3, 4–5, 6–7, everything else SYS.
    /// - `nvbridge8x`: NV12 bridges 0–2, 1–3, 4–6, 5–7 crossing the switches of `pcie8`; the
    ///   other pairs as in `pcie8`.
    /// - `nvswitch8`: 8 GPUs, all pairs NV18 (H100/H200 HGX; an A100 box would print NV12 — the
    ///   choice is the same since all pairs are equal).
    /// - `nvswitch16`: DGX-2, 16 GPUs, all pairs NV6.
    /// - `pcie16` (2 sockets × 4 switches × 2), `pcie32` (4 × 4 × 2), `pcie64` (4 × 4 × 4):
    ///   synthetic PCIe trees, PIX / NODE / SYS like `pcie8`.
    ///
    /// `none` is not a topology: it returns `None` here, like every unknown name.
    pub fn preset(name: &str) -> Option<Topology> {
        let name = name.trim().to_ascii_lowercase();
        let t = match name.as_str() {
            "pcie4" => pcie_tree("pcie4", 1, 2, 2, Link::Node),
            "pcie4-nvbridge" => build("pcie4-nvbridge", 4, |a, b| match (a, b) {
                (0, 1) => Link::Nv(12),
                (2, 3) => Link::Node,
                _ => Link::Sys,
            }),
            "hgx4" => build("hgx4", 4, |_, _| Link::Nv(6)),
            "pcie8" => pcie_tree("pcie8", 2, 2, 2, Link::Node),
            "pcie8-nic" => pcie8_nic(),
            "pcie8-1root" => pcie_tree("pcie8-1root", 2, 4, 1, Link::Pxb),
            "dgx1v" => build("dgx1v", 8, |a, b| {
                if has(DGX1V_NV2, a, b) {
                    Link::Nv(2)
                } else if has(DGX1V_NV1, a, b) {
                    Link::Nv(1)
                } else {
                    Link::Sys
                }
            }),
            "dgx1p" => build("dgx1p", 8, |a, b| {
                if a / 4 == b / 4 || a + 4 == b {
                    Link::Nv(1)
                } else {
                    Link::Sys
                }
            }),
            "nvbridge8" => build("nvbridge8", 8, |a, b| {
                if has(&[(0, 2), (1, 3), (4, 5), (6, 7)], a, b) {
                    Link::Nv(12)
                } else {
                    Link::Sys
                }
            }),
            "nvbridge8x" => {
                let base = pcie_tree("pcie8", 2, 2, 2, Link::Node);
                build("nvbridge8x", 8, |a, b| {
                    if has(&[(0, 2), (1, 3), (4, 6), (5, 7)], a, b) {
                        Link::Nv(12)
                    } else {
                        base.link(a, b)
                    }
                })
            }
            "nvswitch8" => build("nvswitch8", 8, |_, _| Link::Nv(18)),
            "nvswitch16" => build("nvswitch16", 16, |_, _| Link::Nv(6)),
            "pcie16" => pcie_tree("pcie16", 4, 2, 2, Link::Node),
            "pcie32" => pcie_tree("pcie32", 4, 2, 4, Link::Node),
            "pcie64" => pcie_tree("pcie64", 4, 4, 4, Link::Node),
            _ => return None,
        };
        Some(t)
    }
}
