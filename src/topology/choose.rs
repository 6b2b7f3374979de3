//! The per-topology lookup tables and [`choose`]: the best free GPU set of a given size
//! (DESIGN.md §5; reference/gpu-topology.md §7.2 "IslandBuddy").
//!
//! Objective, in order: maximise T(S), then W(S), then minimise N(S), the number of NUMA nodes
//! S's GPUs sit on beyond the first (the `NUMA Affinity` column of `nvidia-smi topo -m`; GPUs of
//! unknown affinity count for none, so without the column N is 0 everywhere and changes
//! nothing: among sets equal on the links, one whose GPUs share a NUMA node wins), then minimise
//! A(S), 1 when S (of ≥ 2 GPUs) has no NIC PIX/PXB-near all its GPUs on a node where some NIC
//! is near two GPUs (the NIC columns; issue 27: among sets equal on T, W and N, one whose GPUs
//! share a NIC wins), then minimise the best-fit vector Fit(F, S)
//! (free GPUs left beside S in the NVLink, PIX, PXB, PHB and NUMA groups it takes from,
//! innermost first; [`super::Topology::fit`]), then maximise the fragmentation vector
//! Cap(F∖S) = [cap(8), cap(4), cap(2)] (lexicographic; cap(F, s) = the highest tier c such that
//! some component of G_c[F] has ≥ s GPUs, −1 if none), then the **smallest mask as an
//! integer** ("lowest bits": the set whose highest differing GPU index is lower wins, e.g.
//! {1,2} = 0b110 beats {0,3} = 0b1001).
//!
//! Strategy (every path returns exactly k GPUs inside F with T(S) = the best tier c*):
//! 1. c* = the highest tier with a component of G_c[F] of ≥ k GPUs; only those components
//!    ("candidates") can hold a set of tier c*.
//! 2. **Enumeration** (exact on the whole objective): all k-subsets of the candidates, with W
//!    updated incrementally from per-class adjacency popcounts. Used for k = 1, on
//!    tree nodes when the number of subsets is within [`TREE_ENUM_BUDGET`] (so always on 8-GPU
//!    trees), on every node of ≤ 16 GPUs whose GPUs sit on more than one NUMA node (or that
//!    has a NIC near two GPUs) and on
//!    non-tree nodes of ≤ 16 GPUs whatever the size (at most C(16,8) = 12 870 subsets, so they
//!    are exact, N included), and on larger non-tree nodes within [`ENUM_BUDGET`].
//! 3. **Tree DP** on tree-shaped (ultrametric) nodes beyond that budget (so: larger than 16
//!    GPUs, or of one NUMA node): a knapsack over the island tree, exact on (T, W). Its
//!    tie-break is the reference's best fit: the smallest total size of fully-free islands split
//!    by the choice, then the smallest mask (N, A, Fit and Cap do not decompose over the tree; on
//!    a multi-NUMA or NIC-sharing tree of > 16 GPUs N and A are not applied).
//! 4. **Greedy + swap** on large non-tree meshes beyond the budget: seeded growth inside a
//!    candidate staying connected in G_c*, then 1-swap improvement of W. T is exact, W is a
//!    local optimum; N, A, Fit and Cap rank the local optima (one per candidate component).

use crate::resources::{lowest_bits, GpuMask};

use super::{GpuChoice, Link, Topology};

/// Largest number of k-subsets enumerated on a large (> 16 GPUs) non-tree node.
const ENUM_BUDGET: u64 = 2_000;
/// Largest number of k-subsets enumerated on a tree node (the DP is exact on (T, W) and much
/// cheaper there). 128 ≥ C(8, 4), so every request on an 8-GPU tree gets the full tie-break.
const TREE_ENUM_BUDGET: u64 = 128;
/// Non-tree nodes up to this size are always enumerated (exact).
const ALWAYS_EXACT_GPUS: u32 = 16;
/// Greedy seeds per candidate component.
const GREEDY_SEEDS: usize = 4;
/// Improvement rounds of the swap search.
const SWAP_ROUNDS: usize = 8;

/// Fragmentation vector [cap(8), cap(4), cap(2)]; larger (lexicographic) is better.
pub(crate) type Cap = [i8; 3];

/// Levels of the best-fit vector.
pub const FIT_LEVELS: usize = 5;
/// The link classes whose groups the best-fit vector looks at, innermost first (any NV# counts
/// as NVLink; SYS joins everything, so it is the node level, counted apart).
const FIT_CLASSES: [Link; FIT_LEVELS] = [Link::Nv(1), Link::Pix, Link::Pxb, Link::Phb, Link::Node];

/// Best-fit vector: free GPUs left in the NVLink, PIX, PXB, PHB and NUMA groups a choice takes
/// from; smaller is better.
pub type Fit = [u8; FIT_LEVELS];

/// Lookup tables of a topology, computed once in [`Topology::new`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Tables {
    n: u32,
    pub(crate) all: u64,
    /// `adj[c][i]`: GPUs j ≠ i whose link to i has tier ≥ c.
    adj: [Vec<u64>; 3],
    /// Components of G_c over all GPUs, ordered by lowest GPU.
    pub(crate) islands: [Vec<u64>; 3],
    /// The islands of ≥ 2 GPUs (singletons add nothing to a largest-component search).
    big_islands: [Vec<u64>; 3],
    /// `fit_groups[l]`: the components of ≥ 2 GPUs of the graph of links at least as good as
    /// the l-th class of [`FIT_CLASSES`] (nested: NVLink islands, PIX, PXB, PHB and NUMA
    /// groups).
    fit_groups: [Vec<u64>; FIT_LEVELS],
    /// `clique[c]`: every island of G_c is a clique of G_c, so the components of G_c[F] are the
    /// islands intersected with F and every subset of an island is connected.
    clique: [bool; 3],
    /// Distinct link weights present, and `cls_adj[w * n + i]` = GPUs linked to i with the
    /// w-th weight: W increments are a few popcounts.
    cls_w: Vec<u32>,
    cls_adj: Vec<u64>,
    /// The island tree when the node is ultrametric.
    pub(crate) tree: Option<Tree>,
    /// The GPUs of each NUMA node (known affinity only), when they sit on more than one;
    /// empty otherwise (N(S) then tells no set apart). Set by [`Tables::set_numa`].
    numa: Vec<u64>,
    /// The GPUs PIX/PXB-near each NIC, for the NICs near two GPUs or more (issue 27); empty
    /// otherwise (A(S) then tells no set apart). Set by [`Tables::set_nics`].
    nic: Vec<u64>,
}

/// Island tree of an ultrametric node: leaves are GPUs; an inner node's children are linked to
/// each other by exactly one class (`cross`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Tree {
    nodes: Vec<TreeNode>,
    root: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct TreeNode {
    mask: u64,
    children: Vec<usize>,
    cross_w: u32,
    cross_tier: u8,
}

fn bits(mut m: u64) -> impl Iterator<Item = u32> {
    std::iter::from_fn(move || {
        if m == 0 {
            None
        } else {
            let i = m.trailing_zeros();
            m &= m - 1;
            Some(i)
        }
    })
}

fn binom(n: u32, k: u32) -> u64 {
    if k > n {
        return 0;
    }
    let k = k.min(n - k);
    let mut r: u64 = 1;
    for i in 0..k {
        r = r.saturating_mul(u64::from(n - i)) / u64::from(i + 1);
        if r >= u64::MAX / 128 {
            return u64::MAX;
        }
    }
    r
}

impl Tables {
    pub(crate) fn build(n: u32, links: &[Link]) -> Tables {
        let all = if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
        let nu = n as usize;
        let link = |a: u32, b: u32| links[(a * n + b) as usize];
        let mut adj: [Vec<u64>; 3] = [vec![0; nu], vec![0; nu], vec![0; nu]];
        let mut cls_w: Vec<u32> = Vec::new();
        for a in 0..n {
            for b in 0..n {
                if a == b {
                    continue;
                }
                let l = link(a, b);
                for (c, row) in adj.iter_mut().enumerate() {
                    if l.tier() as usize >= c {
                        row[a as usize] |= 1 << b;
                    }
                }
                if !cls_w.contains(&l.weight()) {
                    cls_w.push(l.weight());
                }
            }
        }
        cls_w.sort_unstable_by(|a, b| b.cmp(a));
        let mut cls_adj = vec![0u64; cls_w.len() * nu];
        for a in 0..n {
            for b in 0..n {
                if a != b {
                    let w = link(a, b).weight();
                    let ci = cls_w.iter().position(|&x| x == w).unwrap_or(0);
                    cls_adj[ci * nu + a as usize] |= 1 << b;
                }
            }
        }
        let mut t = Tables {
            n,
            all,
            adj,
            islands: [Vec::new(), Vec::new(), Vec::new()],
            big_islands: [Vec::new(), Vec::new(), Vec::new()],
            fit_groups: Default::default(),
            clique: [false; 3],
            cls_w,
            cls_adj,
            tree: None,
            numa: Vec::new(),
            nic: Vec::new(),
        };
        for c in 0..3 {
            let isl = t.bfs_components(c, all);
            t.clique[c] = isl
                .iter()
                .all(|&m| bits(m).all(|i| (t.adj[c][i as usize] | (1 << i)) & m == m));
            t.big_islands[c] = isl.iter().copied().filter(|m| m.count_ones() >= 2).collect();
            t.islands[c] = isl;
        }
        for (l, class) in FIT_CLASSES.iter().enumerate() {
            let min_w = class.weight();
            let mut rest = all;
            while rest != 0 {
                let mut comp = rest & rest.wrapping_neg();
                let mut frontier = comp;
                while frontier != 0 {
                    let mut next = 0u64;
                    for i in bits(frontier) {
                        for j in bits(rest & !comp) {
                            if link(i, j).weight() >= min_w {
                                next |= 1 << j;
                            }
                        }
                    }
                    next &= !comp;
                    comp |= next;
                    frontier = next;
                }
                if comp.count_ones() >= 2 {
                    t.fit_groups[l].push(comp);
                }
                rest &= !comp;
            }
        }
        t.tree = t.build_tree(links);
        t
    }

    /// The island tree, if every triple satisfies w(i,j) ≥ min(w(i,k), w(k,j)).
    fn build_tree(&self, links: &[Link]) -> Option<Tree> {
        let n = self.n;
        let w = |a: u32, b: u32| links[(a * n + b) as usize].weight();
        for i in 0..n {
            for j in i + 1..n {
                let wij = w(i, j);
                for k in 0..n {
                    if k != i && k != j && wij < w(i, k).min(w(k, j)) {
                        return None;
                    }
                }
            }
        }
        let mut nodes: Vec<TreeNode> = (0..n)
            .map(|i| TreeNode {
                mask: 1 << i,
                children: Vec::new(),
                cross_w: 0,
                cross_tier: 2,
            })
            .collect();
        let mut current: Vec<usize> = (0..n as usize).collect();
        for (ci, &cw) in self.cls_w.iter().enumerate() {
            let cross_tier = (0..n)
                .flat_map(|a| (0..n).map(move |b| (a, b)))
                .find(|&(a, b)| a != b && w(a, b) == cw)
                .map_or(0, |(a, b)| links[(a * n + b) as usize].tier());
            // Class of i at threshold cw: i and every GPU linked to it with weight ≥ cw.
            let mut next: Vec<usize> = Vec::new();
            let mut done = 0u64;
            for &v in &current {
                let m = nodes[v].mask;
                if m & done != 0 {
                    continue;
                }
                let i = m.trailing_zeros() as usize;
                let mut class = 1u64 << i;
                for c2 in 0..=ci {
                    class |= self.cls_adj[c2 * n as usize + i];
                }
                done |= class;
                let members: Vec<usize> = current
                    .iter()
                    .copied()
                    .filter(|&u| nodes[u].mask & class != 0)
                    .collect();
                if members.len() == 1 {
                    next.push(v);
                } else {
                    nodes.push(TreeNode {
                        mask: class,
                        children: members,
                        cross_w: cw,
                        cross_tier,
                    });
                    next.push(nodes.len() - 1);
                }
            }
            current = next;
        }
        (current.len() == 1).then(|| Tree {
            nodes,
            root: current[0],
        })
    }

    /// Records each GPU's NUMA node (`None` = unknown; index = GPU).
    pub(crate) fn set_numa(&mut self, numa: &[Option<u32>]) {
        let mut groups: Vec<(u32, u64)> = Vec::new();
        for (g, v) in numa.iter().enumerate().take(self.n as usize) {
            let Some(v) = *v else { continue };
            match groups.iter_mut().find(|(x, _)| *x == v) {
                Some((_, m)) => *m |= 1 << g,
                None => groups.push((v, 1 << g)),
            }
        }
        self.numa = if groups.len() > 1 {
            groups.into_iter().map(|(_, m)| m).collect()
        } else {
            Vec::new()
        };
    }

    /// N(S): the NUMA nodes the GPUs of `set` sit on beyond the first (0 when they share one,
    /// when the affinity is unknown, or when the node has one NUMA node). Smaller is better.
    #[inline]
    pub(crate) fn numa_split(&self, set: u64) -> u8 {
        (self.numa.iter().filter(|&&m| m & set != 0).count() as u8).saturating_sub(1)
    }

    /// Records the GPUs PIX/PXB-near each NIC (one mask per NIC).
    pub(crate) fn set_nics(&mut self, near: &[u64]) {
        self.nic = near
            .iter()
            .map(|m| m & self.all)
            .filter(|m| m.count_ones() >= 2)
            .collect();
        self.nic.sort_unstable();
        self.nic.dedup();
    }

    /// A(S): 1 when S has two GPUs or more and no NIC is PIX/PXB-near all of them, on a node
    /// where some NIC is near two GPUs; 0 otherwise. Smaller is better (after N).
    #[inline]
    pub(crate) fn nic_apart(&self, set: u64) -> u8 {
        if self.nic.is_empty() || set.count_ones() < 2 {
            return 0;
        }
        u8::from(!self.nic.iter().any(|&g| set & !g == 0))
    }

    /// The locality key of a set among sets equal on (T, W): N(S), then A(S), as one number
    /// (smaller is better).
    #[inline]
    pub(crate) fn locality(&self, set: u64) -> u16 {
        u16::from(self.numa_split(set)) * 2 + u16::from(self.nic_apart(set))
    }

    /// Components of G_c[set], by repeated frontier expansion (u64 BFS).
    fn bfs_components(&self, c: usize, set: u64) -> Vec<u64> {
        let mut out = Vec::new();
        let mut rest = set;
        while rest != 0 {
            let comp = self.component_of(c, rest & rest.wrapping_neg(), rest);
            out.push(comp);
            rest &= !comp;
        }
        out
    }

    /// The component of G_c[set] containing `seed`.
    fn component_of(&self, c: usize, seed: u64, set: u64) -> u64 {
        let adj = &self.adj[c];
        let mut comp = seed;
        let mut frontier = seed;
        while frontier != 0 {
            let mut next = 0;
            for i in bits(frontier) {
                next |= adj[i as usize];
            }
            next &= set & !comp;
            comp |= next;
            frontier = next;
        }
        comp
    }

    /// Components of G_c[set] (islands ∩ set when the islands are cliques).
    fn components(&self, c: usize, set: u64) -> Vec<u64> {
        if self.clique[c] {
            self.islands[c].iter().map(|&m| m & set).filter(|&m| m != 0).collect()
        } else {
            self.bfs_components(c, set)
        }
    }

    /// Whether `set` is connected in G_c (one island when islands are cliques).
    fn connected(&self, c: usize, set: u64) -> bool {
        if set == 0 {
            true
        } else if self.clique[c] {
            self.islands[c].iter().any(|&m| m & set == set)
        } else {
            self.component_of(c, set & set.wrapping_neg(), set) == set
        }
    }

    pub(crate) fn tier(&self, set: u64) -> u8 {
        if set.count_ones() <= 1 {
            return 2;
        }
        (1..=2u8).rev().find(|&c| self.connected(c as usize, set)).unwrap_or(0)
    }

    /// Σ over i ∈ set of w(i, j): the W gained by adding j to `set` (j ∉ set).
    #[inline]
    fn delta(&self, j: u32, set: u64) -> u32 {
        let n = self.n as usize;
        let mut d = 0;
        for (ci, &w) in self.cls_w.iter().enumerate() {
            d += w * (self.cls_adj[ci * n + j as usize] & set).count_ones();
        }
        d
    }

    pub(crate) fn weight(&self, set: u64) -> u32 {
        let mut acc = 0;
        let mut seen = 0;
        for i in bits(set) {
            acc += self.delta(i, seen);
            seen |= 1 << i;
        }
        acc
    }

    /// Size of the largest component of G_c[set], capped at 8 (larger sizes never matter).
    fn max_component(&self, c: usize, set: u64) -> u32 {
        let mut best = 0;
        if self.clique[c] {
            best = u32::from(set != 0);
            for &m in &self.big_islands[c] {
                best = best.max((m & set).count_ones());
            }
        } else {
            let mut rest = set;
            while rest != 0 && best < 8 && rest.count_ones() > best {
                let comp = self.component_of(c, rest & rest.wrapping_neg(), rest);
                best = best.max(comp.count_ones());
                rest &= !comp;
            }
        }
        best
    }

    /// Cap(F) = [cap(F,8), cap(F,4), cap(F,2)].
    pub(crate) fn cap(&self, set: u64) -> Cap {
        let total = set.count_ones();
        let m2 = self.max_component(2, set);
        let m1 = if m2 >= 8 {
            m2
        } else {
            self.max_component(1, set).max(m2)
        };
        [8u32, 4, 2].map(|s| {
            if m2 >= s {
                2
            } else if m1 >= s {
                1
            } else if total >= s {
                0
            } else {
                -1
            }
        })
    }

    /// Fit(F, X) = [free GPUs left in the NVLink islands X takes from, the same for the PCIe
    /// islands]: Σ over the islands I of G_c (c = 2, then 1) that meet X of |I ∩ (F ∖ X)|.
    /// Smaller is better (best fit, innermost islands first: HiveD's buddy rule): a choice
    /// that finishes a broken island keeps whole islands whole.
    pub(crate) fn fit(&self, free: u64, x: u64) -> Fit {
        let rest = free & !x;
        std::array::from_fn(|l| {
            let mut left = 0u32;
            for &m in &self.fit_groups[l] {
                if m & x != 0 {
                    left += (m & rest).count_ones();
                }
            }
            left.min(u32::from(u8::MAX)) as u8
        })
    }

    /// c* and the components of G_c*[free] with ≥ k GPUs (k ≥ 2, |free| ≥ k).
    pub(crate) fn candidates(&self, free: u64, k: u32) -> (u8, Vec<u64>) {
        for c in (1..=2u8).rev() {
            let comps: Vec<u64> = self
                .components(c as usize, free)
                .into_iter()
                .filter(|m| m.count_ones() >= k)
                .collect();
            if !comps.is_empty() {
                return (c, comps);
            }
        }
        (0, vec![free])
    }

    /// The chosen set for `free ⊆ all`, `1 ≤ k ≤ |free|`.
    fn choose(&self, free: u64, k: u32) -> (u64, u8, u32) {
        if k == 1 {
            // W = 0 and T = 2 for every single GPU: only Fit, Cap and the mask decide.
            let ub = self.cap(free);
            let mut best: Option<(u64, Fit, Cap)> = None;
            for i in bits(free) {
                let s = 1u64 << i;
                let fit = self.fit(free, s);
                if best.is_some_and(|(_, bf, _)| fit > bf) {
                    continue;
                }
                let cap = self.cap(free & !s);
                if best.is_none_or(|(_, bf, bc)| fit < bf || cap > bc) {
                    best = Some((s, fit, cap));
                    if fit == [0; FIT_LEVELS] && cap == ub {
                        break; // nothing later can do better, and later masks are larger
                    }
                }
            }
            return (best.map_or(0, |b| b.0), 2, 0);
        }
        let (cstar, comps) = self.candidates(free, k);
        let count = comps
            .iter()
            .fold(0u64, |acc, m| acc.saturating_add(binom(m.count_ones(), k)));
        let (mask, w) = match &self.tree {
            Some(tree)
                if count > TREE_ENUM_BUDGET
                    && ((self.numa.is_empty() && self.nic.is_empty()) || self.n > ALWAYS_EXACT_GPUS) =>
            {
                self.tree_dp(tree, free, k, cstar)
            }
            None if count > ENUM_BUDGET && self.n > ALWAYS_EXACT_GPUS => self.greedy(free, k, cstar, &comps),
            _ => self.enumerate(free, k, cstar, &comps),
        };
        (mask, cstar, w)
    }

    pub(crate) fn enumerate(&self, free: u64, k: u32, cstar: u8, comps: &[u64]) -> (u64, u32) {
        let mut e = Enum {
            t: self,
            free,
            cstar: cstar as usize,
            check: cstar > 0 && !self.clique[cstar as usize],
            ub: self.cap(free),
            best: None,
        };
        for &x in comps {
            e.rec(x, 0, 0, k);
        }
        e.best.map_or((0, 0), |b| (b.mask, b.w))
    }

    fn tree_dp(&self, tree: &Tree, free: u64, k: u32, cstar: u8) -> (u64, u32) {
        let table = self.dp(tree, tree.root, free, k, cstar);
        table
            .get(k as usize)
            .copied()
            .flatten()
            .map_or((0, 0), |v| (v.mask, v.w))
    }

    /// `f(v, m)` for m = 0..=min(k, free in v): the best (W, −split, −mask) choice of m GPUs
    /// inside island v whose tier is ≥ c*. Below a node whose cross tier is < c*, GPUs may come
    /// from one child only (crossing would drop the tier).
    fn dp(&self, tree: &Tree, v: usize, free: u64, k: u32, cstar: u8) -> Vec<Option<Val>> {
        let node = &tree.nodes[v];
        let fv = (node.mask & free).count_ones().min(k) as usize;
        let mut acc: Vec<Option<Val>> = vec![None; fv + 1];
        acc[0] = Some(Val::ZERO);
        if node.children.is_empty() {
            if fv == 1 {
                acc[1] = Some(Val {
                    w: 0,
                    split: 0,
                    mask: node.mask,
                });
            }
            return acc;
        }
        let knap = node.cross_tier >= cstar;
        let mut reach = 0usize;
        for &c in &node.children {
            if tree.nodes[c].mask & free == 0 {
                continue;
            }
            let child = self.dp(tree, c, free, k, cstar);
            if knap {
                let mut next: Vec<Option<Val>> = vec![None; fv + 1];
                for (a, va) in acc.iter().enumerate().take(reach + 1) {
                    let Some(va) = va else { continue };
                    for (b, vb) in child.iter().enumerate() {
                        if a + b > fv {
                            break;
                        }
                        let Some(vb) = vb else { continue };
                        let cand = Val {
                            w: va.w + vb.w + node.cross_w * (a * b) as u32,
                            split: va.split + vb.split,
                            mask: va.mask | vb.mask,
                        };
                        if next[a + b].is_none_or(|cur| cand.better(&cur)) {
                            next[a + b] = Some(cand);
                        }
                    }
                }
                acc = next;
                reach = (reach + child.len() - 1).min(fv);
            } else {
                for (m, vc) in child.iter().enumerate().skip(1) {
                    if let Some(vc) = vc {
                        if acc[m].is_none_or(|cur| vc.better(&cur)) {
                            acc[m] = Some(*vc);
                        }
                    }
                }
                reach = reach.max(child.len() - 1);
            }
        }
        let size = node.mask.count_ones() as usize;
        if node.mask & free == node.mask {
            for v in acc.iter_mut().take(size).skip(1).flatten() {
                v.split += size as u32;
            }
        }
        acc
    }

    fn greedy(&self, free: u64, k: u32, cstar: u8, comps: &[u64]) -> (u64, u32) {
        let c = cstar as usize;
        // (W, NUMA nodes then NIC apart, best fit, what is left) of a set, lexicographically.
        type Key = (u32, std::cmp::Reverse<u16>, std::cmp::Reverse<Fit>, Cap);
        let mut best: Option<(Key, u64)> = None;
        for &x in comps {
            let mut seeds: Vec<(u32, u32)> = bits(x).map(|i| (self.delta(i, x & !(1 << i)), i)).collect();
            seeds.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            let mut local: Option<(u32, u64)> = None;
            for &(_, seed) in seeds.iter().take(GREEDY_SEEDS) {
                let mut s = 1u64 << seed;
                let mut w = 0;
                for _ in 1..k {
                    let mut front = x & !s;
                    if c > 0 {
                        let mut reach = 0;
                        for i in bits(s) {
                            reach |= self.adj[c][i as usize];
                        }
                        front &= reach;
                    }
                    // x is connected in G_c and |s| < |x|, so the frontier is never empty.
                    let Some((dj, j)) = bits(front)
                        .map(|j| (self.delta(j, s), j))
                        .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
                    else {
                        break;
                    };
                    s |= 1 << j;
                    w += dj;
                }
                if s.count_ones() == k && local.is_none_or(|(bw, bm)| w > bw || (w == bw && s < bm)) {
                    local = Some((w, s));
                }
            }
            let Some((mut w, mut s)) = local else {
                continue;
            };
            'rounds: for _ in 0..SWAP_ROUNDS {
                for i in bits(s) {
                    let without = s & !(1 << i);
                    let base = w - self.delta(i, without);
                    for j in bits(x & !s) {
                        let nw = base + self.delta(j, without);
                        let ns = without | (1 << j);
                        if nw > w && (c == 0 || self.connected(c, ns)) {
                            s = ns;
                            w = nw;
                            continue 'rounds;
                        }
                    }
                }
                break;
            }
            let key = (
                w,
                std::cmp::Reverse(self.locality(s)),
                std::cmp::Reverse(self.fit(free, s)),
                self.cap(free & !s),
            );
            if best.is_none_or(|(bk, bm)| key > bk || (key == bk && s < bm)) {
                best = Some((key, s));
            }
        }
        best.map_or((0, 0), |((w, ..), s)| (s, w))
    }
}

/// A DP entry: weight, total size of the fully-free islands split, and the set.
#[derive(Clone, Copy, Debug)]
struct Val {
    w: u32,
    split: u32,
    mask: u64,
}

impl Val {
    const ZERO: Val = Val {
        w: 0,
        split: 0,
        mask: 0,
    };

    fn better(&self, other: &Val) -> bool {
        (self.w, other.split, other.mask) > (other.w, self.split, self.mask)
    }
}

struct Best {
    mask: u64,
    w: u32,
    /// N(S) then A(S) ([`Tables::locality`]).
    numa: u16,
    fit: Fit,
    cap: Option<Cap>,
}

/// Exhaustive k-subset search with incremental W and lazy Cap.
struct Enum<'a> {
    t: &'a Tables,
    free: u64,
    cstar: usize,
    /// Connectivity must be checked (G_c* islands are not cliques).
    check: bool,
    /// Cap(F): no choice can leave more, so a tie that reached it is beaten only by a smaller mask.
    ub: Cap,
    best: Option<Best>,
}

impl Enum<'_> {
    fn rec(&mut self, cand: u64, s: u64, w: u32, r: u32) {
        if r == 0 {
            self.leaf(s, w);
            return;
        }
        let mut c = cand;
        while c.count_ones() >= r {
            let b = c & c.wrapping_neg();
            c &= !b;
            let dw = self.t.delta(b.trailing_zeros(), s);
            self.rec(c, s | b, w + dw, r - 1);
        }
    }

    fn leaf(&mut self, s: u64, w: u32) {
        if self.best.as_ref().is_some_and(|b| w < b.w) {
            return;
        }
        if self.check && !self.t.connected(self.cstar, s) {
            return;
        }
        let t = self.t;
        let free = self.free;
        let numa = t.locality(s);
        if self.best.as_ref().is_some_and(|b| w == b.w && numa > b.numa) {
            return;
        }
        let fit = t.fit(free, s);
        match &mut self.best {
            Some(b) if w == b.w && numa == b.numa => {
                if fit > b.fit || (fit == b.fit && b.cap == Some(self.ub) && s > b.mask) {
                    return;
                }
                let sc = t.cap(free & !s);
                let better = fit < b.fit || {
                    let bc = *b.cap.get_or_insert_with(|| t.cap(free & !b.mask));
                    sc > bc || (sc == bc && s < b.mask)
                };
                if better {
                    *b = Best {
                        mask: s,
                        w,
                        numa,
                        fit,
                        cap: Some(sc),
                    };
                }
            }
            _ => {
                self.best = Some(Best {
                    mask: s,
                    w,
                    numa,
                    fit,
                    cap: None,
                });
            }
        }
    }
}

/// Chooses `k` GPUs among `free` (DESIGN.md §5; see the module docs for the objective and the
/// tie-break, NUMA term included). `None` when `free` has fewer than `k` bits; `k = 0` → the empty mask (tier 2
/// with a topology, the zero/one-GPU convention of [`Topology::tier`]). Exact on the whole
/// objective for 8-GPU nodes and non-tree nodes of ≤ 16 GPUs, exact on (T, W) for every tree
/// node, exact on T everywhere; the result always has exactly `k` bits inside `free`. Without a
/// topology, or when `free` has bits beyond the topology's GPUs, the lowest free bits are taken
/// (tier 0, weight 0).
pub fn choose(topo: Option<&Topology>, free: GpuMask, k: u32) -> Option<GpuChoice> {
    if free.count_ones() < k {
        return None;
    }
    let t = match topo {
        Some(t) if free & !t.tables.all == 0 => t,
        _ => {
            return lowest_bits(free, k).map(|mask| GpuChoice {
                mask,
                tier: 0,
                weight: 0,
            })
        }
    };
    if k == 0 {
        return Some(GpuChoice {
            mask: 0,
            tier: 2,
            weight: 0,
        });
    }
    let (mask, tier, weight) = t.tables.choose(free, k);
    debug_assert_eq!(mask.count_ones(), k);
    debug_assert_eq!(mask & !free, 0);
    Some(GpuChoice { mask, tier, weight })
}
