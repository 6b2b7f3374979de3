//! Tests of the topology module: presets, metrics, parsing, and `choose` against an
//! independent exhaustive search.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;

// ---------- an independent reference, straight from the definitions ----------

/// The link matrix read once through `Topology::link`, with naive set metrics over it.
struct Ref {
    tier: Vec<u8>,
    weight: Vec<u32>,
    n: usize,
    /// Each GPU's NUMA node from the affinity columns (`None` unknown).
    numa: Vec<Option<u32>>,
    /// Per NIC, the GPUs with a PIX or PXB link to it.
    nic_near: Vec<u64>,
}

fn idx_of(s: u64) -> Vec<usize> {
    let mut out = Vec::with_capacity(s.count_ones() as usize);
    let mut m = s;
    while m != 0 {
        out.push(m.trailing_zeros() as usize);
        m &= m - 1;
    }
    out
}

impl Ref {
    fn new(t: &Topology) -> Ref {
        let n = t.gpu_count() as usize;
        let mut tier = vec![0; n * n];
        let mut weight = vec![0; n * n];
        for a in 0..n {
            for b in 0..n {
                let l = t.link(a as u32, b as u32);
                tier[a * n + b] = l.tier();
                weight[a * n + b] = l.weight();
            }
        }
        let numa = (0..n).map(|g| t.affinity().get(g).and_then(|a| a.numa)).collect();
        let nic_near = t
            .nics()
            .iter()
            .map(|x| {
                (0..n)
                    .filter(|&g| matches!(x.links[g], Link::Pix | Link::Pxb))
                    .fold(0u64, |m, g| m | 1 << g)
            })
            .collect();
        Ref {
            tier,
            weight,
            n,
            numa,
            nic_near,
        }
    }

    /// A(S): 1 when S has ≥ 2 GPUs, some NIC is near two GPUs, and none is near all of S.
    fn nic_apart(&self, s: u64) -> u8 {
        let shared = self.nic_near.iter().any(|m| m.count_ones() >= 2);
        u8::from(shared && s.count_ones() >= 2 && !self.nic_near.iter().any(|&m| s & !m == 0))
    }

    /// The locality terms among sets equal on (T, W): N(S), then A(S).
    fn locality(&self, s: u64) -> (u8, u8) {
        (self.numa_split(s), self.nic_apart(s))
    }

    /// NUMA nodes (known ones) under `s`, beyond the first.
    fn numa_split(&self, s: u64) -> u8 {
        let mut seen: Vec<u32> = idx_of(s).iter().filter_map(|&g| self.numa[g]).collect();
        seen.sort_unstable();
        seen.dedup();
        seen.len().saturating_sub(1) as u8
    }

    /// Size of the largest component of the graph of links of tier ≥ c over `idx`.
    fn max_comp(&self, c: u8, idx: &[usize]) -> usize {
        let mut seen = vec![false; idx.len()];
        let mut best = 0;
        for start in 0..idx.len() {
            if seen[start] {
                continue;
            }
            let mut stack = vec![start];
            seen[start] = true;
            let mut size = 0;
            while let Some(a) = stack.pop() {
                size += 1;
                for b in 0..idx.len() {
                    if !seen[b] && self.tier[idx[a] * self.n + idx[b]] >= c {
                        seen[b] = true;
                        stack.push(b);
                    }
                }
            }
            best = best.max(size);
        }
        best
    }

    /// T(S): highest c such that S is connected by links of tier ≥ c.
    fn tier(&self, s: u64) -> u8 {
        let idx = idx_of(s);
        if idx.len() <= 1 {
            return 2;
        }
        (0..=2u8).rev().find(|&c| self.max_comp(c, &idx) == idx.len()).unwrap()
    }

    fn weight(&self, s: u64) -> u32 {
        let idx = idx_of(s);
        let mut w = 0;
        for (x, &a) in idx.iter().enumerate() {
            for &b in &idx[x + 1..] {
                w += self.weight[a * self.n + b];
            }
        }
        w
    }

    /// Fit(F, S) from its definition: for each class weight of the ladder NV (≥ 25), PIX,
    /// PXB, PHB, NODE, the groups (components of ≥ 2 GPUs over all GPUs, links of at least that
    /// weight) that meet S, and the free GPUs outside S in them.
    fn fit(&self, f: u64, s: u64) -> [u8; 5] {
        let all: Vec<usize> = (0..self.n).collect();
        [25u32, 12, 10, 8, 6].map(|min_w| {
            let mut group = vec![usize::MAX; self.n];
            for start in 0..self.n {
                if group[start] != usize::MAX {
                    continue;
                }
                let mut stack = vec![start];
                group[start] = start;
                while let Some(a) = stack.pop() {
                    for &b in &all {
                        if group[b] == usize::MAX && a != b && self.weight[a * self.n + b] >= min_w {
                            group[b] = start;
                            stack.push(b);
                        }
                    }
                }
            }
            let mut left = 0;
            for g in 0..self.n {
                let members: Vec<usize> = all.iter().copied().filter(|&i| group[i] == g).collect();
                if members.len() >= 2 && members.iter().any(|&i| s >> i & 1 == 1) {
                    left += members.iter().filter(|&&i| f >> i & 1 == 1 && s >> i & 1 == 0).count() as u8;
                }
            }
            left
        })
    }

    fn cap(&self, f: u64) -> [i8; 3] {
        let idx = idx_of(f);
        [8usize, 4, 2].map(|s| {
            (0..=2u8)
                .rev()
                .find(|&c| self.max_comp(c, &idx) >= s)
                .map_or(-1, |c| c as i8)
        })
    }
}

fn ref_max_comp(t: &Topology, c: u8, idx: &[u32]) -> usize {
    let idx: Vec<usize> = idx.iter().map(|&i| i as usize).collect();
    Ref::new(t).max_comp(c, &idx)
}

/// (T, W, Fit, Cap of what is left, mask).
type RefBest = (u8, u32, [u8; 5], [i8; 3], u64);

/// Best (T, W, N, A, Fit, Cap, mask) for every k = 0..=|F|, by visiting every subset of F.
/// With `full = false` only (T, W) are compared (the mask returned is then any optimum).
fn ref_all_k(r: &Ref, f: u64, full: bool) -> Vec<RefBest> {
    let nf = f.count_ones() as usize;
    let mut best: Vec<Option<RefBest>> = vec![None; nf + 1];
    let mut s = f;
    loop {
        let k = s.count_ones() as usize;
        let tw = (r.tier(s), r.weight(s));
        let replace = match best[k] {
            None => true,
            Some((bt, bw, bfit, bc, bm)) => {
                if tw != (bt, bw) {
                    tw > (bt, bw)
                } else if full && r.locality(s) != r.locality(bm) {
                    r.locality(s) < r.locality(bm)
                } else if full {
                    let fit = r.fit(f, s);
                    let cap = r.cap(f & !s);
                    fit < bfit || (fit == bfit && (cap > bc || (cap == bc && s < bm)))
                } else {
                    false
                }
            }
        };
        if replace {
            let (fit, cap) = if full {
                (r.fit(f, s), r.cap(f & !s))
            } else {
                ([0; 5], [0; 3])
            };
            best[k] = Some((tw.0, tw.1, fit, cap, s));
        }
        if s == 0 {
            break;
        }
        s = (s - 1) & f;
    }
    best.into_iter().map(|b| b.unwrap()).collect()
}

fn check_against_reference(t: &Topology, f: u64, full: bool) {
    let r = Ref::new(t);
    let reference = ref_all_k(&r, f, full);
    for (k, &(rt, rw, rfit, rc, rm)) in reference.iter().enumerate() {
        let got = choose(Some(t), f, k as u32).unwrap();
        assert_eq!(got.mask.count_ones(), k as u32, "{} F={f:#x} k={k}", t.name());
        assert_eq!(got.mask & !f, 0, "{} F={f:#x} k={k}: outside free", t.name());
        assert_eq!(got.tier, r.tier(got.mask), "{} F={f:#x} k={k}: reported tier", t.name());
        assert_eq!(
            got.weight,
            r.weight(got.mask),
            "{} F={f:#x} k={k}: reported weight",
            t.name()
        );
        assert_eq!(
            (got.tier, got.weight),
            (rt, rw),
            "{} F={f:#x} k={k}: got {:#x}, exhaustive {rm:#x}",
            t.name(),
            got.mask
        );
        if full {
            assert_eq!(r.fit(f, got.mask), rfit, "{} F={f:#x} k={k}: Fit", t.name());
            assert_eq!(t.fit(f, got.mask), rfit, "{} F={f:#x} k={k}: Topology::fit", t.name());
            assert_eq!(r.cap(f & !got.mask), rc, "{} F={f:#x} k={k}: Cap", t.name());
            assert_eq!(got.mask, rm, "{} F={f:#x} k={k}: mask", t.name());
        }
    }
}

/// A random symmetric link matrix (mesh-like: many classes, rarely ultrametric).
fn random_topology(rng: &mut SmallRng, n: u32) -> Topology {
    let classes = [
        Link::Nv(1),
        Link::Nv(2),
        Link::Nv(4),
        Link::Pix,
        Link::Pxb,
        Link::Phb,
        Link::Node,
        Link::Sys,
        Link::Sys,
        Link::Sys,
    ];
    let mut m = vec![Link::Sys; (n * n) as usize];
    for a in 0..n {
        for b in a + 1..n {
            m[(a * n + b) as usize] = classes[rng.gen_range(0..classes.len())];
        }
    }
    Topology::new("random", n, |a, b| m[(a * n + b) as usize]).unwrap()
}

/// A random ultrametric (tree-shaped) topology: random nested groups, one class per level.
fn random_tree(rng: &mut SmallRng, n: u32) -> Topology {
    let ladder = [
        Link::Sys,
        Link::Node,
        Link::Phb,
        Link::Pxb,
        Link::Pix,
        Link::Nv(1),
        Link::Nv(4),
    ];
    // group[level][gpu]: refining partitions, level 0 = everything.
    let mut group: Vec<Vec<u32>> = vec![vec![0; n as usize]];
    for level in 1..ladder.len() {
        let prev = &group[level - 1];
        let mut next = Vec::with_capacity(n as usize);
        let mut id = 0;
        for i in 0..n as usize {
            if i > 0 && prev[i] == prev[i - 1] && rng.gen_bool(0.6) {
                next.push(id);
            } else {
                id += 1;
                next.push(id);
            }
        }
        group.push(next);
    }
    Topology::new("random-tree", n, |a, b| {
        let lvl = (0..ladder.len())
            .rev()
            .find(|&l| group[l][a as usize] == group[l][b as usize])
            .unwrap_or(0);
        ladder[lvl]
    })
    .unwrap()
}

fn random_mask(rng: &mut SmallRng, n: u32, p: f64) -> u64 {
    (0..n).filter(|_| rng.gen_bool(p)).fold(0, |m, i| m | 1 << i)
}

// ---------- presets and metrics ----------

#[test]
fn presets_build_with_their_names_and_sizes() {
    let expect = [
        ("pcie4", 4),
        ("pcie4-nvbridge", 4),
        ("hgx4", 4),
        ("pcie8", 8),
        ("pcie8-nic", 8),
        ("pcie8-1root", 8),
        ("dgx1v", 8),
        ("dgx1p", 8),
        ("nvbridge8", 8),
        ("nvbridge8x", 8),
        ("nvswitch8", 8),
        ("nvswitch16", 16),
        ("pcie16", 16),
        ("pcie32", 32),
        ("pcie64", 64),
    ];
    assert_eq!(Topology::preset_names().len(), expect.len());
    for (name, n) in expect {
        assert!(Topology::preset_names().contains(&name));
        let t = Topology::preset(name).unwrap();
        assert_eq!((t.name(), t.gpu_count()), (name, n));
        for a in 0..n {
            for b in 0..n {
                if a != b {
                    assert_eq!(t.link(a, b), t.link(b, a));
                    assert_ne!(t.link(a, b), Link::Nv(0));
                }
            }
        }
    }
    assert_eq!(Topology::preset(" PCIE8 ").unwrap().name(), "pcie8");
    assert!(Topology::preset("none").is_none());
    assert!(Topology::preset("pcie9").is_none());
}

#[test]
fn pcie8_matches_the_reference_layout() {
    let t = Topology::preset("pcie8").unwrap();
    assert_eq!(t.link(0, 1), Link::Pix);
    assert_eq!(t.link(0, 2), Link::Node);
    assert_eq!(t.link(1, 3), Link::Node);
    assert_eq!(t.link(0, 7), Link::Sys);
    assert_eq!(t.link(6, 7), Link::Pix);
    assert_eq!(t.link(4, 6), Link::Node);
    let t = Topology::preset("pcie8-1root").unwrap();
    assert_eq!(
        (t.link(0, 3), t.link(3, 4), t.link(4, 7)),
        (Link::Pix, Link::Pxb, Link::Pix)
    );
    let t = Topology::preset("pcie64").unwrap();
    assert_eq!(
        (t.link(0, 3), t.link(0, 4), t.link(0, 15), t.link(0, 16)),
        (Link::Pix, Link::Node, Link::Node, Link::Sys)
    );
}

#[test]
fn dgx1v_has_the_exact_hybrid_cube_mesh() {
    let t = Topology::preset("dgx1v").unwrap();
    let nv2 = [(0, 3), (0, 4), (1, 2), (1, 5), (2, 3), (4, 7), (5, 6), (6, 7)];
    let nv1 = [(0, 1), (0, 2), (1, 3), (2, 6), (3, 7), (4, 5), (4, 6), (5, 7)];
    let mut sys = 0;
    for a in 0..8 {
        let lanes: u32 = (0..8)
            .filter(|&b| b != a)
            .map(|b| match t.link(a, b) {
                Link::Nv(m) => u32::from(m),
                _ => 0,
            })
            .sum();
        assert_eq!(lanes, 6, "GPU{a} has 6 NVLink lanes");
        for b in a + 1..8 {
            let l = t.link(a, b);
            if nv2.contains(&(a, b)) {
                assert_eq!(l, Link::Nv(2));
            } else if nv1.contains(&(a, b)) {
                assert_eq!(l, Link::Nv(1));
            } else {
                assert_eq!(l, Link::Sys);
                sys += 1;
            }
        }
    }
    assert_eq!(sys, 12);
    assert!(!t.is_tree());
    // The whole mesh is one NVLink island.
    assert_eq!(t.islands(2), vec![0xff]);
    assert_eq!(t.tier(0xff), 2);
}

#[test]
fn tree_detection() {
    for name in [
        "pcie4",
        "pcie8",
        "pcie8-1root",
        "nvbridge8",
        "nvswitch8",
        "nvswitch16",
        "pcie16",
        "pcie64",
        "hgx4",
    ] {
        assert!(Topology::preset(name).unwrap().is_tree(), "{name}");
    }
    for name in ["dgx1v", "dgx1p", "nvbridge8x"] {
        assert!(!Topology::preset(name).unwrap().is_tree(), "{name}");
    }
}

#[test]
fn tier_weight_islands_and_best_tier() {
    let t = Topology::preset("pcie8").unwrap();
    assert_eq!(t.tier(0), 2);
    assert_eq!(t.tier(0b1), 2);
    assert_eq!(t.tier(0b11), 1);
    assert_eq!(t.tier(0b101), 0);
    assert_eq!(t.weight(0b11), 12);
    assert_eq!(t.weight(0b1111), 2 * 12 + 4 * 6);
    assert_eq!(t.weight(0x81), 4);
    assert_eq!(t.islands(2), (0..8).map(|i| 1u64 << i).collect::<Vec<_>>());
    assert_eq!(t.islands(1), vec![0x03, 0x0c, 0x30, 0xc0]);
    assert_eq!(t.islands(0), vec![0xff]);
    assert_eq!(t.islands(7), t.islands(2));
    assert_eq!(
        (
            t.best_tier(1),
            t.best_tier(2),
            t.best_tier(3),
            t.best_tier(8),
            t.best_tier(9)
        ),
        (2, 1, 0, 0, 0)
    );

    let t = Topology::preset("nvbridge8x").unwrap();
    assert_eq!(t.islands(2), vec![0b0101, 0b1010, 0x50, 0xa0]);
    // Bridges 0–2 joined with the switch pairs 0–1, 2–3 make the socket one tier-1 island.
    assert_eq!(t.islands(1), vec![0x0f, 0xf0]);
    assert_eq!(t.tier(0b0111), 1);
    assert_eq!(t.best_tier(4), 1);
    assert_eq!(t.weight(0b0101), 300);

    let t = Topology::preset("dgx1v").unwrap();
    assert_eq!(t.best_tier(8), 2);
    // {0, 5}: SYS, no NVLink path inside the pair.
    assert_eq!(t.tier(0b100001), 0);
    // {0, 1, 5}: 0–1 NV1 and 1–5 NV2.
    assert_eq!(t.tier(0b100011), 2);
    assert_eq!(t.weight(0b100011), 25 + 50 + 4);
    assert_eq!(t.link(3, 3), Link::Nv(0));
    assert_eq!(t.link(3, 8), Link::Sys);
    // Bits beyond the node are ignored.
    assert_eq!(t.weight(0x1_0000_0003), 25);
}

#[test]
fn new_rejects_bad_sizes_and_nv0() {
    assert!(Topology::new("x", 0, |_, _| Link::Sys).is_err());
    assert!(Topology::new("x", 65, |_, _| Link::Sys).is_err());
    assert!(Topology::new("x", 64, |_, _| Link::Sys).is_ok());
    let e = Topology::new("x", 3, |a, b| if (a, b) == (1, 2) { Link::Nv(0) } else { Link::Sys }).unwrap_err();
    assert!(e.0.contains("GPU1–GPU2"), "{e}");
}

// ---------- choose: behaviour on named cases ----------

#[test]
fn choose_edge_cases() {
    let t = Topology::preset("pcie8").unwrap();
    assert_eq!(choose(Some(&t), 0b111, 4), None);
    assert_eq!(choose(Some(&t), 0b111, 0).unwrap().mask, 0);
    assert_eq!(
        choose(None, 0b1011_0100, 3),
        Some(GpuChoice {
            mask: 0b1011_0100 & !0x80,
            tier: 0,
            weight: 0
        })
    );
    // Free bits beyond the topology's GPUs: fall back to the lowest bits.
    assert_eq!(
        choose(Some(&t), 0x301, 2).unwrap(),
        GpuChoice {
            mask: 0x101,
            tier: 0,
            weight: 0
        }
    );
    let all = choose(Some(&t), 0xff, 8).unwrap();
    assert_eq!((all.mask, all.tier, all.weight), (0xff, 0, t.weight(0xff)));
}

#[test]
fn choose_prefers_whole_switches_and_keeps_pairs_intact() {
    let t = Topology::preset("pcie8").unwrap();
    // Two free in switch {0,1}: pick the pair, not 1 + 2.
    assert_eq!(choose(Some(&t), 0b1110_0011, 2).unwrap().mask, 0b11);
    // k = 1 with one switch half-used: take the lone GPU, keep the full pairs.
    assert_eq!(choose(Some(&t), 0b1111_1101, 1).unwrap().mask, 0b1);
    // Everything free, k = 4: a whole socket (W = 48), the lowest one.
    let c = choose(Some(&t), 0xff, 4).unwrap();
    assert_eq!((c.mask, c.tier, c.weight), (0x0f, 0, 48));
    // nvbridge8x: k = 2 must take the bridge, not the PCIe switch pair.
    let t = Topology::preset("nvbridge8x").unwrap();
    assert_eq!(choose(Some(&t), 0xff, 2).unwrap().mask, 0b0101);
    // dgx1v: k = 2 takes an NV2 pair.
    let t = Topology::preset("dgx1v").unwrap();
    let c = choose(Some(&t), 0xff, 2).unwrap();
    assert_eq!((c.tier, c.weight), (2, 50));
}

#[test]
fn k1_leaves_the_best_groups() {
    let t = Topology::preset("pcie8").unwrap();
    // F = {0,1,2,4}: taking 2 or 4 keeps the last full switch pair {0,1}; 4 is alone in its
    // socket too (best fit at the NUMA level), 2 is not.
    assert_eq!(choose(Some(&t), 0b1_0111, 1).unwrap().mask, 0b1_0000);
    // F = all but 5: Cap = [cap8, cap4, cap2] is the same whichever GPU goes (a PIX pair is
    // left either way), but only GPU 4 leaves no free GPU alone in its switch (best fit).
    assert_eq!(choose(Some(&t), 0xdf, 1).unwrap().mask, 0b1_0000);
    // F = {0,1,2,4,5}: GPU 2 is alone in its switch; the pairs {0,1} and {4,5} stay whole.
    assert_eq!(choose(Some(&t), 0b11_0111, 1).unwrap().mask, 0b100);
    // pcie8 with everything free, k = 1: a GPU of a switch (any), inside a socket left with 3.
    assert_eq!(choose(Some(&t), 0xff, 1).unwrap().mask, 0b1);
    let t = Topology::preset("nvbridge8").unwrap();
    // F = {0,1,2}: taking 1 keeps the bridge 0–2.
    assert_eq!(choose(Some(&t), 0b111, 1).unwrap().mask, 0b10);
    // k = 2 with a lone bridge GPU: take a bridge, never two SYS-linked GPUs.
    let c = choose(Some(&t), 0b1111_0110, 2).unwrap();
    assert_eq!((c.mask, c.tier, c.weight), (0x30, 2, 300));
}

// ---------- choose: exactness against exhaustive search ----------

#[test]
fn exact_on_every_free_mask_of_the_8_gpu_presets() {
    // Every preset of up to 8 GPUs, so a new one is covered without editing this test.
    let small: Vec<Topology> = Topology::preset_names()
        .iter()
        .map(|n| Topology::preset(n).unwrap())
        .filter(|t| t.gpu_count() <= 8)
        .collect();
    assert_eq!(small.len(), 11, "the 4- and 8-GPU presets");
    for t in small {
        let all = t.all_mask();
        for f in 0..=all {
            check_against_reference(&t, f, true);
        }
    }
}

#[test]
fn exact_on_16_gpu_presets_and_random_nodes() {
    let mut rng = SmallRng::seed_from_u64(0x70_9010);
    let mut topos = vec![
        Topology::preset("pcie16").unwrap(),
        Topology::preset("nvswitch16").unwrap(),
    ];
    for i in 0..6 {
        topos.push(random_topology(&mut rng, 12 + i % 5));
        topos.push(random_tree(&mut rng, 12 + (i + 2) % 5));
    }
    for t in &topos {
        let n = t.gpu_count();
        // Enumeration paths are exact on the whole objective; tree DP beyond the budget is
        // exact on (T, W) only.
        let full = !t.is_tree();
        for round in 0..40 {
            let p = [0.3, 0.5, 0.7][round % 3];
            let f = random_mask(&mut rng, n, p);
            check_against_reference(t, f, full);
        }
    }
    // Fully free nodes (the biggest searches): the two 16-GPU presets and a 12-GPU mesh.
    for t in topos.iter().take(3) {
        check_against_reference(t, t.all_mask(), !t.is_tree());
    }
}

#[test]
fn tree_dp_matches_enumeration_on_tw_for_trees() {
    // Same trees at 24–40 GPUs: the DP (beyond the budget) against the enumerator run directly.
    let mut rng = SmallRng::seed_from_u64(7);
    for n in [24u32, 32, 40] {
        let t = random_tree(&mut rng, n);
        assert!(t.is_tree());
        for _ in 0..20 {
            let f = random_mask(&mut rng, n, 0.6);
            for k in [2u32, 3, 4, 5] {
                if f.count_ones() < k {
                    continue;
                }
                let got = choose(Some(&t), f, k).unwrap();
                let (cstar, comps) = t.tables.candidates(f, k);
                let (em, ew) = t.tables.enumerate(f, k, cstar, &comps);
                assert_eq!(
                    (got.tier, got.weight),
                    (cstar, ew),
                    "n={n} F={f:#x} k={k}: enum {em:#x}, got {:#x}",
                    got.mask
                );
            }
        }
    }
}

// ---------- choose: validity at 64 GPUs ----------

mod validity {
    use super::*;
    use proptest::prelude::*;

    fn check_valid(t: &Topology, f: u64, k: u32) {
        match choose(Some(t), f, k) {
            None => assert!(f.count_ones() < k),
            Some(c) => {
                assert_eq!(c.mask.count_ones(), k);
                assert_eq!(c.mask & !f, 0);
                assert_eq!(c.tier, t.tier(c.mask));
                assert_eq!(c.weight, t.weight(c.mask));
                if k >= 2 {
                    // T is always exact: the best tier of any k-set inside F.
                    let idx: Vec<u32> = (0..64).filter(|i| f >> i & 1 == 1).collect();
                    let best = (1..=2u8)
                        .rev()
                        .find(|&c| ref_max_comp(t, c, &idx) >= k as usize)
                        .unwrap_or(0);
                    assert_eq!(c.tier, best);
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn valid_on_big_trees(f in any::<u64>(), k in 0u32..=40, which in 0usize..2) {
            let t = Topology::preset(["pcie32", "pcie64"][which]).unwrap();
            let f = f & t.all_mask();
            check_valid(&t, f, k);
        }

        #[test]
        fn valid_on_random_64_gpu_meshes(seed in any::<u64>(), f in any::<u64>(), k in 0u32..=40) {
            let mut rng = SmallRng::seed_from_u64(seed);
            let t = random_topology(&mut rng, 64);
            check_valid(&t, f, k);
        }
    }
}

// ---------- parsing ----------

const H100_NEW_DRIVER: &str =
    "\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tNIC2\tNIC3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tPIX\tNODE\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNODE\tNODE\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNODE\tPIX\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNODE\tNODE\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU4\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tSYS\tSYS\tPIX\tNODE\t56-111,168-223\t1\t\tN/A
GPU5\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tSYS\tSYS\tNODE\tNODE\t56-111,168-223\t1\t\tN/A
GPU6\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tSYS\tSYS\tNODE\tPIX\t56-111,168-223\t1\t\tN/A
GPU7\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tSYS\tSYS\tNODE\tNODE\t56-111,168-223\t1\t\tN/A
NIC0\tPIX\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t X \tNODE\tSYS\tSYS
NIC1\tNODE\tNODE\tPIX\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\t X \tSYS\tSYS
NIC2\tSYS\tSYS\tSYS\tSYS\tPIX\tNODE\tNODE\tNODE\tSYS\tSYS\t X \tNODE
NIC3\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tPIX\tNODE\tSYS\tSYS\tNODE\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
  NIC2: mlx5_2
  NIC3: mlx5_3
";

const OLD_DRIVER_SOC: &str = "        GPU0    GPU1    GPU2    GPU3    mlx5_0  CPU Affinity
GPU0     X      PIX     SOC     SOC     SOC     0-11
GPU1    PIX      X      SOC     SOC     SOC     0-11
GPU2    SOC     SOC      X      PHB     PHB     12-23
GPU3    SOC     SOC     PHB      X      PHB     12-23
mlx5_0  SOC     SOC     PHB     PHB      X

Legend:

  X   = Self
  SOC  = Connection traversing PCIe as well as the SMP link between CPU sockets(e.g. QPI)
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe switches (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing a single PCIe switch
  NV#  = Connection traversing a bonded set of # NVLinks
";

const DGX1V_TEXT: &str =
    "\u{1b}[4m\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tmlx5_0\tmlx5_2\tmlx5_1\tmlx5_3\tCPU Affinity\u{1b}[0m
GPU0\t X \tNV1\tNV1\tNV2\tNV2\tSYS\tSYS\tSYS\tPIX\tSYS\tPHB\tSYS\t0-19,40-59
GPU1\tNV1\t X \tNV2\tNV1\tSYS\tNV2\tSYS\tSYS\tPIX\tSYS\tPHB\tSYS\t0-19,40-59
GPU2\tNV1\tNV2\t X \tNV2\tSYS\tSYS\tNV1\tSYS\tPHB\tSYS\tPIX\tSYS\t0-19,40-59
GPU3\tNV2\tNV1\tNV2\t X \tSYS\tSYS\tSYS\tNV1\tPHB\tSYS\tPIX\tSYS\t0-19,40-59
GPU4\tNV2\tSYS\tSYS\tSYS\t X \tNV1\tNV1\tNV2\tSYS\tPIX\tSYS\tPHB\t20-39,60-79
GPU5\tSYS\tNV2\tSYS\tSYS\tNV1\t X \tNV2\tNV1\tSYS\tPIX\tSYS\tPHB\t20-39,60-79
GPU6\tSYS\tSYS\tNV1\tSYS\tNV1\tNV2\t X \tNV2\tSYS\tPHB\tSYS\tPIX\t20-39,60-79
GPU7\tSYS\tSYS\tSYS\tNV1\tNV2\tNV1\tNV2\t X \tSYS\tPHB\tSYS\tPIX\t20-39,60-79
mlx5_0\tPIX\tPIX\tPHB\tPHB\tSYS\tSYS\tSYS\tSYS\t X \tSYS\tPHB\tSYS
mlx5_2\tSYS\tSYS\tSYS\tSYS\tPIX\tPIX\tPHB\tPHB\tSYS\t X \tSYS\tPHB
mlx5_1\tPHB\tPHB\tPIX\tPIX\tSYS\tSYS\tSYS\tSYS\tPHB\tSYS\t X \tSYS
mlx5_3\tSYS\tSYS\tSYS\tSYS\tPHB\tPHB\tPIX\tPIX\tSYS\tPHB\tSYS\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks
";

#[test]
fn parses_h100_output_with_nics_and_numa_columns() {
    let t = Topology::parse_nvidia_smi(H100_NEW_DRIVER).unwrap();
    assert_eq!((t.name(), t.gpu_count()), ("custom", 8));
    assert_eq!(t.link(0, 7), Link::Nv(18));
    assert_eq!(t.link(5, 2), Link::Nv(18));
    let preset = Topology::preset("nvswitch8").unwrap();
    for a in 0..8 {
        for b in 0..8 {
            assert_eq!(t.link(a, b), preset.link(a, b));
        }
    }
    assert_eq!(Topology::from_spec(H100_NEW_DRIVER).unwrap().unwrap(), t);
}

#[test]
fn parses_old_driver_output_with_soc() {
    let t = Topology::parse_nvidia_smi(OLD_DRIVER_SOC).unwrap();
    assert_eq!(t.gpu_count(), 4);
    assert_eq!(t.link(0, 1), Link::Pix);
    assert_eq!(t.link(0, 2), Link::Sys);
    assert_eq!(t.link(2, 3), Link::Phb);
    assert_eq!(t.islands(1), vec![0b0011, 0b0100, 0b1000]);
}

#[test]
fn parses_dgx1v_output_with_ansi_codes_into_the_preset_matrix() {
    let t = Topology::parse_nvidia_smi(DGX1V_TEXT).unwrap();
    let preset = Topology::preset("dgx1v").unwrap();
    for a in 0..8 {
        for b in 0..8 {
            assert_eq!(t.link(a, b), preset.link(a, b), "GPU{a}–GPU{b}");
        }
    }
    assert_eq!(choose(Some(&t), 0xff, 4), choose(Some(&preset), 0xff, 4));
}

#[test]
fn parses_a_single_gpu() {
    let t = Topology::parse_nvidia_smi("\tGPU0\tCPU Affinity\tNUMA Affinity\nGPU0\t X \t0-7\t0\n").unwrap();
    assert_eq!(t.gpu_count(), 1);
    assert_eq!(choose(Some(&t), 1, 1).unwrap().mask, 1);
}

#[test]
fn every_preset_round_trips_through_topo_text() {
    for name in Topology::preset_names() {
        let p = Topology::preset(name).unwrap();
        let text = p.to_topo_text();
        let back = Topology::parse_nvidia_smi(&text).unwrap();
        assert_eq!(back.name(), "custom");
        let renamed = Topology::new(name, back.gpu_count(), |a, b| back.link(a, b))
            .unwrap()
            .with_locality(back.nics().to_vec(), back.affinity().to_vec())
            .unwrap();
        assert_eq!(renamed, p, "{name}");
        assert!(back.same_content(&p), "{name}");
        assert_eq!(Topology::from_spec(&text).unwrap(), Some(back));
    }
}

#[test]
fn from_spec_handles_presets_none_and_unknown_names() {
    assert_eq!(Topology::from_spec("none").unwrap(), None);
    assert_eq!(Topology::from_spec("  ").unwrap(), None);
    assert_eq!(Topology::from_spec("").unwrap(), None);
    assert_eq!(Topology::from_spec("dgx1v").unwrap().unwrap().name(), "dgx1v");
    let e = Topology::from_spec("dgx2").unwrap_err();
    assert!(
        e.0.contains("dgx2") && e.0.contains("pcie8") && e.0.contains("nvidia-smi"),
        "{e}"
    );
}

fn parse_err(text: &str) -> String {
    Topology::parse_nvidia_smi(text).unwrap_err().0
}

#[test]
fn parse_errors_name_the_place() {
    let e = parse_err("\tGPU0\tGPU1\nGPU0\t X \tFOO\nGPU1\tPIX\t X \n");
    assert!(e.contains("row GPU0, column GPU1") && e.contains("`FOO`"), "{e}");

    let e = parse_err("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU1\tSYS\t X \n");
    assert!(
        e.contains("not symmetric") && e.contains("GPU0→GPU1 is PIX") && e.contains("SYS"),
        "{e}"
    );

    let e = parse_err("\tGPU0\tGPU1\nGPU0\tPIX\tPIX\nGPU1\tPIX\t X \n");
    assert!(e.contains("diagonal"), "{e}");

    let e = parse_err("\tGPU0\tGPU1\nGPU0\t X \tX\nGPU1\tPIX\t X \n");
    assert!(e.contains("only valid on the diagonal"), "{e}");

    let e = parse_err("\tGPU0\tGPU1\tGPU2\nGPU0\t X \tPIX\tSYS\nGPU1\tPIX\t X \tSYS\n");
    assert!(e.contains("row GPU2 is missing"), "{e}");

    let e = parse_err("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU1\tPIX\t X \nGPU2\tSYS\tSYS\t X\n");
    assert!(e.contains("GPU2") && e.contains("only 2 GPU columns"), "{e}");

    let e = parse_err("\tGPU0\tGPU1\nGPU0\t X \nGPU1\tPIX\t X \n");
    assert!(e.contains("line 2") && e.contains("1 cells, expected 2"), "{e}");

    let e = parse_err("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU0\t X \tPIX\n");
    assert!(e.contains("appears twice"), "{e}");

    let e = parse_err("hello\nworld\n");
    assert!(e.contains("no header line"), "{e}");

    let e = parse_err("\tGPU0\tGPU2\nGPU0\t X \tPIX\n");
    assert!(e.contains("expected `GPU1`"), "{e}");

    let e = parse_err("\tGPU0\tGPU1\nGPU0\t X \tNV0\nGPU1\tNV0\t X \n");
    assert!(e.contains("`NV0`"), "{e}");

    let big: String = {
        let mut s = String::new();
        for j in 0..65 {
            s.push_str(&format!("\tGPU{j}"));
        }
        s.push('\n');
        s
    };
    assert!(parse_err(&big).contains("at most 64"));
}

// ---------- NICs, CPU and NUMA affinity ----------

/// Shaped like a DGX A100 (`nvidia-smi topo -m`, driver 470): NVSwitch, one PCIe switch per GPU
/// pair with its InfiniBand NIC (PXB), CPUs by NPS4 NUMA node, NIC rows, the legend.
const DGXA100_TEXT: &str =
    "\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tmlx5_0\tmlx5_1\tmlx5_2\tmlx5_3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\tPXB\tSYS\tSYS\tSYS\t48-63,176-191\t3
GPU1\tNV12\t X \tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\tPXB\tSYS\tSYS\tSYS\t48-63,176-191\t3
GPU2\tNV12\tNV12\t X \tNV12\tNV12\tNV12\tNV12\tNV12\tSYS\tPXB\tSYS\tSYS\t16-31,144-159\t1
GPU3\tNV12\tNV12\tNV12\t X \tNV12\tNV12\tNV12\tNV12\tSYS\tPXB\tSYS\tSYS\t16-31,144-159\t1
GPU4\tNV12\tNV12\tNV12\tNV12\t X \tNV12\tNV12\tNV12\tSYS\tSYS\tPXB\tSYS\t112-127,240-255\t7
GPU5\tNV12\tNV12\tNV12\tNV12\tNV12\t X \tNV12\tNV12\tSYS\tSYS\tPXB\tSYS\t112-127,240-255\t7
GPU6\tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\t X \tNV12\tSYS\tSYS\tSYS\tPXB\t80-95,208-223\t5
GPU7\tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\t X \tSYS\tSYS\tSYS\tPXB\t80-95,208-223\t5
mlx5_0\tPXB\tPXB\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t X \tSYS\tSYS\tSYS
mlx5_1\tSYS\tSYS\tPXB\tPXB\tSYS\tSYS\tSYS\tSYS\tSYS\t X \tSYS\tSYS
mlx5_2\tSYS\tSYS\tSYS\tSYS\tPXB\tPXB\tSYS\tSYS\tSYS\tSYS\t X \tSYS
mlx5_3\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tPXB\tPXB\tSYS\tSYS\tSYS\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
";

fn nic_names(t: &Topology) -> Vec<&str> {
    t.nics().iter().map(|n| n.name.as_str()).collect()
}

fn env_of(t: &Topology, mask: u64) -> Vec<(String, String)> {
    task_locality(t, mask).env()
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
}

#[test]
fn nics_and_affinity_are_read_with_the_matrix() {
    // New driver: NIC0… in the header, named by the NIC Legend; NUMA Affinity and GPU NUMA ID.
    let t = Topology::parse_nvidia_smi(H100_NEW_DRIVER).unwrap();
    assert_eq!(nic_names(&t), ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]);
    assert_eq!(t.nics()[0].links[0], Link::Pix);
    assert_eq!(t.nics()[0].links[1], Link::Node);
    assert_eq!(t.nics()[3].links[6], Link::Pix);
    assert_eq!(t.affinity()[0].cpus.as_ref().unwrap().to_string(), "0-55,112-167");
    assert_eq!(t.affinity()[5].numa, Some(1));
    assert_eq!(t.nic_near(), 0b0101_0101, "GPUs 0, 2, 4, 6 sit behind a NIC's switch");
    // DGX-1: NICs named in the header (in the order mlx5_0, mlx5_2, mlx5_1, mlx5_3), CPU
    // affinity only.
    let t = Topology::parse_nvidia_smi(DGX1V_TEXT).unwrap();
    assert_eq!(nic_names(&t), ["mlx5_0", "mlx5_2", "mlx5_1", "mlx5_3"]);
    assert_eq!(t.nic_near(), 0xff);
    assert_eq!(t.affinity()[7].numa, None);
    // Old driver: one NIC, SOC-linked to half the GPUs, PHB to the others: no GPUDirect path.
    let t = Topology::parse_nvidia_smi(OLD_DRIVER_SOC).unwrap();
    assert_eq!(nic_names(&t), ["mlx5_0"]);
    assert_eq!(t.nics()[0].links, vec![Link::Sys, Link::Sys, Link::Phb, Link::Phb]);
    assert_eq!(t.nic_near(), 0);
    // DGX A100 shape: NUMA Affinity and NIC rows.
    let t = Topology::parse_nvidia_smi(DGXA100_TEXT).unwrap();
    assert_eq!(t.nics().len(), 4);
    assert_eq!(t.affinity()[4].numa, Some(7));
    assert_eq!(t.nic_near(), 0xff);
    // A matrix without NICs is not near any.
    assert_eq!(Topology::preset("pcie8").unwrap().nic_near(), 0);
    assert_eq!(Topology::preset("pcie8-nic").unwrap().nic_near(), 0b0011_0011);
}

#[test]
fn texts_with_nics_round_trip_and_nics_are_part_of_the_content() {
    for text in [H100_NEW_DRIVER, DGX1V_TEXT, OLD_DRIVER_SOC, DGXA100_TEXT] {
        let t = Topology::parse_nvidia_smi(text).unwrap();
        let back = Topology::parse_nvidia_smi(&t.to_topo_text()).unwrap();
        assert_eq!(back, t);
    }
    // The DGX-1 text's matrix is the preset's, but its NICs make it another content.
    let text = Topology::parse_nvidia_smi(DGX1V_TEXT).unwrap();
    let preset = Topology::preset("dgx1v").unwrap();
    assert!(!text.same_content(&preset));
    let bare = Topology::new("x", 8, |a, b| text.link(a, b)).unwrap();
    assert!(bare.same_content(&preset));
}

#[test]
fn nic_and_affinity_errors_name_the_place() {
    let bad_nic = "\tGPU0\tGPU1\tmlx5_0\nGPU0\t X \tPIX\tNV2\nGPU1\tPIX\t X \tPIX\n";
    let e = parse_err(bad_nic);
    assert!(e.contains("row GPU0, column mlx5_0") && e.contains("NV2"), "{e}");
    let short = "\tGPU0\tGPU1\tmlx5_0\nGPU0\t X \tPIX\nGPU1\tPIX\t X \tPIX\n";
    let e = parse_err(short);
    assert!(
        e.contains("line 2") && e.contains("expected 3") && e.contains("GPU and NIC"),
        "{e}"
    );
    let cpus = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tPIX\t0-7\nGPU1\tPIX\t X \t7-0\n";
    let e = parse_err(cpus);
    assert!(
        e.contains("line 3") && e.contains("CPU Affinity") && e.contains("`7-0`"),
        "{e}"
    );
    let numa = "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tPIX\t0-7\tzero\nGPU1\tPIX\t X \t0-7\t0\n";
    let e = parse_err(numa);
    assert!(e.contains("NUMA Affinity") && e.contains("`zero`"), "{e}");
    let asym = "\tGPU0\tGPU1\tmlx5_0\nGPU0\t X \tPIX\tPIX\nGPU1\tPIX\t X \tSYS\nmlx5_0\tPIX\tPIX\t X \n";
    let e = parse_err(asym);
    assert!(e.contains("line 4") && e.contains("GPU1→mlx5_0 is SYS"), "{e}");
    // N/A cells are "unknown", not errors.
    let na = "\tGPU0\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tN/A\tN/A\n";
    let t = Topology::parse_nvidia_smi(na).unwrap();
    assert_eq!(t.affinity()[0], GpuAffinity::default());
}

#[test]
fn cpu_lists_parse_merge_and_print() {
    let a = CpuList::parse("40-59, 0-19").unwrap();
    assert_eq!(a.to_string(), "0-19,40-59");
    let b = CpuList::parse("20-39,60-79").unwrap();
    assert_eq!(a.union(&b).to_string(), "0-79");
    assert_eq!(CpuList::parse("3,1,2,7").unwrap().to_string(), "1-3,7");
    assert_eq!(
        a.intersect(&CpuList::parse("10-45").unwrap()).to_string(),
        "10-19,40-45"
    );
    assert!(a.intersect(&b).is_empty());
    assert_eq!(CpuList::parse("0-3").unwrap().cpus().collect::<Vec<_>>(), [0, 1, 2, 3]);
    for bad in ["N/A", "", "5-2", "a-b", "1,,2"] {
        assert_eq!(CpuList::parse(bad), None, "{bad}");
    }
}

#[test]
fn a_task_gets_its_gpus_cpus_and_nics() {
    let dgx1 = Topology::parse_nvidia_smi(DGX1V_TEXT).unwrap();
    // One PCIe switch, one socket: its NIC, its socket's CPUs.
    assert_eq!(
        env_of(&dgx1, 0b11),
        pairs(&[
            ("GPUAM_CPU_AFFINITY", "0-19,40-59"),
            ("GPUAM_NIC", "mlx5_0"),
            ("NCCL_IB_HCA", "mlx5_0"),
        ])
    );
    // Two switches of socket 0: both NICs, in GPU order.
    assert_eq!(
        env_of(&dgx1, 0b0101),
        pairs(&[
            ("GPUAM_CPU_AFFINITY", "0-19,40-59"),
            ("GPUAM_NIC", "mlx5_0,mlx5_1"),
            ("NCCL_IB_HCA", "mlx5_0,mlx5_1"),
        ])
    );
    // Across sockets: both sockets' CPUs.
    let l = task_locality(&dgx1, 0b1_1000);
    assert_eq!(l.cpus.unwrap().to_string(), "0-79");
    assert_eq!(l.nics, ["mlx5_1", "mlx5_2"]);
    // DGX A100: NUMA nodes too.
    let a100 = Topology::parse_nvidia_smi(DGXA100_TEXT).unwrap();
    assert_eq!(
        env_of(&a100, 0b1100_0000),
        pairs(&[
            ("GPUAM_CPU_AFFINITY", "80-95,208-223"),
            ("GPUAM_NUMA_NODES", "5"),
            ("GPUAM_NIC", "mlx5_3"),
            ("NCCL_IB_HCA", "mlx5_3"),
        ])
    );
    assert_eq!(task_locality(&a100, 0b101).numa, [1, 3]);
    // Old driver: the nearest NIC is across the host bridge: named, but no NCCL_IB_HCA.
    let old = Topology::parse_nvidia_smi(OLD_DRIVER_SOC).unwrap();
    assert_eq!(
        env_of(&old, 0b100),
        pairs(&[("GPUAM_CPU_AFFINITY", "12-23"), ("GPUAM_NIC", "mlx5_0")])
    );
    // An Ethernet NIC behind the GPU's switch is named, but NCCL_IB_HCA is for IB/RoCE only.
    let eth = Topology::parse_nvidia_smi("\tGPU0\teth2\tCPU Affinity\nGPU0\t X \tPIX\t0-3\n").unwrap();
    assert_eq!(
        env_of(&eth, 1),
        pairs(&[("GPUAM_CPU_AFFINITY", "0-3"), ("GPUAM_NIC", "eth2")])
    );
    // No GPU, or a topology without NICs or affinity: nothing.
    assert!(env_of(&dgx1, 0).is_empty());
    assert!(env_of(&Topology::preset("pcie8").unwrap(), 0b11).is_empty());
    // One GPU's affinity unknown: no CPU list at all (a partial one would starve the task).
    let partial =
        Topology::parse_nvidia_smi("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tPIX\t0-3\nGPU1\tPIX\t X \tN/A\n").unwrap();
    assert_eq!(task_locality(&partial, 0b11).cpus, None);
    assert_eq!(task_locality(&partial, 0b01).cpus.unwrap().to_string(), "0-3");
}

// ---------- NUMA in ties, on real `nvidia-smi topo -m` texts ----------

/// 8 × RTX 4090: every GPU pair is SYS, the NUMA Affinity column splits the GPUs 0–3 / 4–7.
/// Source: https://github.com/NVIDIA/go-gpuallocator/issues/17 (as posted; no legend).
const RTX4090X8_TEXT: &str =
    "\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU1\tSYS\t X \tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU2\tSYS\tSYS\t X \tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU3\tSYS\tSYS\tSYS\t X \tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU4\tSYS\tSYS\tSYS\tSYS\t X \tSYS\tSYS\tSYS\tSYS\tSYS\t56-111,168-223\t1\t\tN/A
GPU5\tSYS\tSYS\tSYS\tSYS\tSYS\t X \tSYS\tSYS\tSYS\tSYS\t56-111,168-223\t1\t\tN/A
GPU6\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t X \tSYS\tPHB\tPHB\t56-111,168-223\t1\t\tN/A
GPU7\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t X \tSYS\tSYS\t56-111,168-223\t1\t\tN/A
NIC0\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tPHB\tSYS\t X \tPIX
NIC1\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tPHB\tSYS\tPIX\t X
";

/// 8 × H100/H200 SXM on NVSwitch (NV18 everywhere), nine NICs, NUMA 0 (GPUs 0–3) and 1
/// (GPUs 4–7). Source: https://github.com/NVIDIA/nccl/issues/1453 (the GPU rows as posted; the
/// NIC rows, which only repeat the GPU rows' NIC cells, left out).
const HGX_NV18_TEXT: &str =
    "\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tNIC2\tNIC3\tNIC4\tNIC5\tNIC6\tNIC7\tNIC8\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tSYS\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tNODE\tPIX\t0-79\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tSYS\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tPIX\tNODE\t0-79\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tSYS\tSYS\tSYS\tSYS\tSYS\tNODE\tPIX\tNODE\tNODE\t0-79\t0\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tSYS\tSYS\tSYS\tSYS\tSYS\tPIX\tNODE\tNODE\tNODE\t0-79\t0\t\tN/A
GPU4\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tSYS\tNODE\tNODE\tNODE\tPIX\tSYS\tSYS\tSYS\tSYS\t80-159\t1\t\tN/A
GPU5\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tSYS\tNODE\tNODE\tPIX\tNODE\tSYS\tSYS\tSYS\tSYS\t80-159\t1\t\tN/A
GPU6\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tSYS\tNODE\tPIX\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t80-159\t1\t\tN/A
GPU7\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tSYS\tPIX\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t80-159\t1\t\tN/A
";

/// 8 × H100 SXM on NVSwitch, no NICs listed, NUMA 0 / 1 by halves.
/// Source: https://github.com/HazyResearch/ThunderKittens/issues/167 (as posted).
const H100_NO_NIC_TEXT: &str = "        GPU0    GPU1    GPU2    GPU3    GPU4    GPU5    GPU6    GPU7    CPU Affinity    NUMA Affinity   GPU NUMA ID
GPU0     X      NV18    NV18    NV18    NV18    NV18    NV18    NV18    0-47,96-143     0               N/A
GPU1    NV18     X      NV18    NV18    NV18    NV18    NV18    NV18    0-47,96-143     0               N/A
GPU2    NV18    NV18     X      NV18    NV18    NV18    NV18    NV18    0-47,96-143     0               N/A
GPU3    NV18    NV18    NV18     X      NV18    NV18    NV18    NV18    0-47,96-143     0               N/A
GPU4    NV18    NV18    NV18    NV18     X      NV18    NV18    NV18    48-95,144-191   1               N/A
GPU5    NV18    NV18    NV18    NV18    NV18     X      NV18    NV18    48-95,144-191   1               N/A
GPU6    NV18    NV18    NV18    NV18    NV18    NV18     X      NV18    48-95,144-191   1               N/A
GPU7    NV18    NV18    NV18    NV18    NV18    NV18    NV18     X      48-95,144-191   1               N/A
";

/// The fewest NUMA nodes (beyond the first) of any k-subset of `f` with the best (T, W), by
/// visiting every subset; and whether some such subset lies within one NUMA node.
fn best_tw_numa(r: &Ref, f: u64, k: u32) -> ((u8, u32), u8) {
    let (tw, (n, _)) = best_locality(r, f, k);
    (tw, n)
}

#[test]
fn numa_decides_ties_on_real_matrices_for_every_free_mask_and_size() {
    // The DGX A100 text's GPU rows (links, CPU and NUMA affinity 3,3,1,1,7,7,5,5) are those of
    // https://github.com/NVIDIA/nccl/issues/1505 (a DGX A100 40GB), with four of its NICs.
    let texts = [
        ("8x RTX 4090", RTX4090X8_TEXT),
        ("HGX NV18", HGX_NV18_TEXT),
        ("H100 no NIC", H100_NO_NIC_TEXT),
        ("DGX A100", DGXA100_TEXT),
        ("H100 new driver", H100_NEW_DRIVER),
    ];
    for (name, text) in texts {
        let t = Topology::parse_nvidia_smi(text).unwrap();
        let r = Ref::new(&t);
        assert!(
            r.numa.iter().all(Option::is_some),
            "{name}: NUMA Affinity read for every GPU"
        );
        let mut split_free = 0;
        for f in 0..=t.all_mask() {
            for k in 1..=f.count_ones() {
                let got = choose(Some(&t), f, k).unwrap();
                let (tw, n) = best_tw_numa(&r, f, k);
                assert_eq!((got.tier, got.weight), tw, "{name} F={f:#x} k={k}: (T, W)");
                assert_eq!(
                    r.numa_split(got.mask),
                    n,
                    "{name} F={f:#x} k={k}: chose {:#x}, split over NUMA nodes while a set of equal (T, W) spans fewer",
                    got.mask
                );
                assert_eq!(t.numa_split(got.mask), n, "{name} F={f:#x} k={k}: Topology::numa_split");
                if n == 0 && k >= 2 && r.numa_split(f) > 0 {
                    split_free += 1;
                }
            }
            // And the whole objective (N, then Fit, Cap, lowest mask) against the reference.
            check_against_reference(&t, f, true);
        }
        assert!(
            split_free > 100,
            "{name}: the free masks straddle NUMA nodes often ({split_free})"
        );
    }
}

#[test]
fn numa_example_of_the_issue_and_the_unknown_column() {
    // GPUs 3, 4, 5 free on the 4090 box: {3,4} and {4,5} are both SYS pairs; {4,5} shares
    // NUMA node 1 and wins (the lowest mask, {3,4}, won before the NUMA term).
    let t = Topology::parse_nvidia_smi(RTX4090X8_TEXT).unwrap();
    assert_eq!(choose(Some(&t), 0b11_1000, 2).unwrap().mask, 0b11_0000);
    assert_eq!(t.numa_split(0b1_1000), 1);
    assert_eq!(t.numa_split(0b11_0000), 0);
    // Three GPUs from {2,3,4,5,6}: {4,5,6}, not {2,3,4}.
    assert_eq!(choose(Some(&t), 0b111_1100, 3).unwrap().mask, 0b111_0000);
    // Same matrix without the affinity columns: N is 0 everywhere, the lowest mask wins.
    let bare = Topology::new("bare", 8, |a, b| t.link(a, b)).unwrap();
    assert_eq!(bare.numa_split(0b1_1000), 0);
    assert_eq!(choose(Some(&bare), 0b11_1000, 2).unwrap().mask, 0b1_1000);
    // NVSwitch box, GPUs 1, 2, 4, 5 free: {4,5} (NUMA 7) rather than {1,2} (NUMA 3 and 1).
    let t = Topology::parse_nvidia_smi(DGXA100_TEXT).unwrap();
    assert_eq!(choose(Some(&t), 0b11_0110, 2).unwrap().mask, 0b11_0000);
    // NVSwitch box, GPUs 3–7 free: the four of NUMA node 1, not the lowest mask {3,4,5,6}.
    let h = Topology::parse_nvidia_smi(HGX_NV18_TEXT).unwrap();
    assert_eq!(choose(Some(&h), 0b1111_1000, 4).unwrap().mask, 0b1111_0000);
}

// ---------- the NIC term in ties, on real `nvidia-smi topo -m` texts ----------

/// The smallest A(S) among the k-subsets of `f` with the best (T, W, N), by visiting every
/// subset.
fn best_locality(r: &Ref, f: u64, k: u32) -> ((u8, u32), (u8, u8)) {
    let mut best: Option<((u8, u32), (u8, u8))> = None;
    let mut s = f;
    loop {
        if s.count_ones() == k {
            let tw = (r.tier(s), r.weight(s));
            let loc = r.locality(s);
            if best.is_none_or(|(btw, bl)| tw > btw || (tw == btw && loc < bl)) {
                best = Some((tw, loc));
            }
        }
        if s == 0 {
            break;
        }
        s = (s - 1) & f;
    }
    best.unwrap_or(((2, 0), (0, 0)))
}

#[test]
fn nic_decides_ties_on_real_matrices_for_every_free_mask_and_size() {
    // Texts whose NIC columns put a NIC PIX/PXB-near two GPUs (DGX-1V; DGX A100, where the
    // NIC pairs are the NUMA pairs, so N decides first, and the same without its affinity
    // columns, where A does), one NIC per GPU (HGX NV18, H100: A alike for every set) and
    // NICs only PHB-near (8 × 4090).
    let a100 = Topology::parse_nvidia_smi(DGXA100_TEXT).unwrap();
    let a100_nics_only = Topology::new("custom", 8, |x, y| a100.link(x, y))
        .unwrap()
        .with_locality(a100.nics().to_vec(), Vec::new())
        .unwrap();
    let parsed = |text: &str| Topology::parse_nvidia_smi(text).unwrap();
    let texts = [
        ("DGX-1V", parsed(DGX1V_TEXT), true),
        ("DGX A100", a100.clone(), false),
        ("DGX A100, NIC columns only", a100_nics_only, true),
        ("HGX NV18", parsed(HGX_NV18_TEXT), false),
        ("H100 new driver", parsed(H100_NEW_DRIVER), false),
        ("8x RTX 4090", parsed(RTX4090X8_TEXT), false),
    ];
    for (name, t, shares) in texts {
        let r = Ref::new(&t);
        let mut decided = 0;
        for f in 0..=t.all_mask() {
            for k in 1..=f.count_ones() {
                let got = choose(Some(&t), f, k).unwrap();
                let (tw, loc) = best_locality(&r, f, k);
                assert_eq!((got.tier, got.weight), tw, "{name} F={f:#x} k={k}: (T, W)");
                assert_eq!(
                    r.locality(got.mask),
                    loc,
                    "{name} F={f:#x} k={k}: chose {:#x}, whose GPUs share no NIC while a set equal on (T, W, N) does",
                    got.mask
                );
                assert_eq!(
                    t.nic_apart(got.mask),
                    loc.1,
                    "{name} F={f:#x} k={k}: Topology::nic_apart"
                );
                // A set equal on (T, W, N) but apart from any NIC was free: the term decided.
                let mut s = f;
                while s != 0 {
                    if s.count_ones() == k
                        && (r.tier(s), r.weight(s)) == tw
                        && r.numa_split(s) == loc.0
                        && r.nic_apart(s) > loc.1
                    {
                        decided += 1;
                        break;
                    }
                    s = (s - 1) & f;
                }
            }
            check_against_reference(&t, f, true);
        }
        assert_eq!(
            decided > 0,
            shares,
            "{name}: free masks where the NIC term decides: {decided}"
        );
    }
}

#[test]
fn nic_example_and_the_order_after_numa() {
    // DGX-1V: mlx5_0 is PIX-near GPUs 0 and 1 (one PCIe switch), mlx5_1 GPUs 2 and 3.
    let t = Topology::parse_nvidia_smi(DGX1V_TEXT).unwrap();
    assert_eq!(t.nic_apart(0b11), 0, "GPUs 0 and 1 share mlx5_0 (PIX)");
    assert_eq!(t.nic_apart(0b1001), 1);
    assert_eq!(t.nic_apart(0b1), 0, "a single GPU shares with itself");
    // DGX A100 (every pair NV12) with its NIC columns but no affinity columns: GPUs 1, 2, 3
    // free: {2,3} shares mlx5_1 (PXB) and wins over the lowest mask {1,2}.
    let a = Topology::parse_nvidia_smi(DGXA100_TEXT).unwrap();
    let nics_only = Topology::new("custom", 8, |x, y| a.link(x, y))
        .unwrap()
        .with_locality(a.nics().to_vec(), Vec::new())
        .unwrap();
    assert_eq!(nics_only.numa_split(0b110), 0, "no affinity: N tells nothing");
    assert_eq!(choose(Some(&nics_only), 0b1110, 2).unwrap().mask, 0b1100);
    // The same matrix without its NIC columns and affinity: the lowest mask.
    let bare = Topology::new("bare", 8, |x, y| a.link(x, y)).unwrap();
    assert_eq!(bare.nic_apart(0b110), 0);
    assert_eq!(choose(Some(&bare), 0b1110, 2).unwrap().mask, 0b110);
    // NIC after NUMA: the pcie8-nic preset (one NIC per socket) keeps N first.
    let p = Topology::preset("pcie8-nic").unwrap();
    assert_eq!(p.nic_apart(0b11), 0);
    assert_eq!(p.nic_apart(0b1100), 1, "GPUs 2 and 3 are on the socket's second switch");
}
