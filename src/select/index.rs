//! Incremental indexes of the node view, so that one select visits the nodes it needs and
//! not every node (issue 13).
//!
//! Owns: the buckets of nodes that look alike to every filter and to the GPU half of the
//! placement order, keyed by (RUNNING, partition, GPU type, topology, total mask, free mask),
//! each ordered inside by (free CPU, free memory, a per-AM random tie, slot); the nodes of
//! each rack; the interned partitions, GPU types and topologies (topologies by content, so a
//! cache keyed by a topology id never mixes two matrices). Updated on every node change by
//! [`NodeIndex::upsert`] / [`NodeIndex::remove`]; no I/O.
//!
//! With 8-GPU nodes there are at most 256 free masks per (partition, type, topology), so the
//! number of buckets does not grow with the node count: a select scores each bucket once and
//! walks nodes only in the best buckets.

use std::collections::BTreeSet;
use std::hash::BuildHasher;
use std::sync::Arc;

use super::fast_hash::{FastMap, FastState};
use crate::cluster::{Node, NodeState};
use crate::resources::{GpuMask, GpuShares, PortSet, Resources};
use crate::topology::Topology;

/// What every node of a bucket has in common.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BucketKey {
    pub running: bool,
    /// Interned partition ("" is id 0).
    pub partition: u32,
    /// Interned GPU type; 0 = none.
    pub gpu_type: u32,
    /// Interned topology (by content); 0 = none.
    pub topo: u32,
    pub total_mask: GpuMask,
    pub total_gpus: u32,
    /// The wholly free GPUs (a GPU holding any share is not among them).
    pub free_mask: GpuMask,
    pub free_gpus: u32,
    /// Interned room left on shared GPUs ([`GpuShares`] of the free amount); 0 = none.
    pub free_shares: u32,
}

/// One node's place inside its bucket; the order is the walk order.
pub(crate) type Member = (u32, u64, u32, u32); // (free cpu, free memory, tie, slot)

pub(crate) struct Bucket {
    pub key: BucketKey,
    pub nodes: BTreeSet<Member>,
}

struct Entry {
    bucket: u32,
    member: Member,
    rack: u32,
}

/// Strings to small ids, both ways.
#[derive(Default)]
struct Interner {
    ids: FastMap<String, u32>,
    names: Vec<String>,
}

impl Interner {
    fn id(&mut self, s: &str) -> u32 {
        if let Some(&i) = self.ids.get(s) {
            return i;
        }
        let i = self.names.len() as u32;
        self.names.push(s.to_string());
        self.ids.insert(s.to_string(), i);
        i
    }
    fn name(&self, i: u32) -> &str {
        self.names.get(i as usize).map_or("", String::as_str)
    }
}

/// The indexes. Slots are stable per host until the host leaves.
pub(crate) struct NodeIndex {
    /// Each host's name is held once, shared by both maps (an AM indexes every node).
    slots: FastMap<Arc<str>, u32>,
    hosts: Vec<Arc<str>>,
    entries: Vec<Option<Entry>>,
    free_slots: Vec<u32>,
    buckets: Vec<Bucket>,
    bucket_of: FastMap<BucketKey, u32>,
    partitions: Interner,
    /// GPU types; id 0 is reserved for "none".
    gpu_types: Interner,
    /// Topologies by content; index 0 is unused ("none").
    topologies: Vec<Arc<Topology>>,
    topo_by_hash: FastMap<u64, Vec<u32>>,
    /// Topologies met lately, by their `Arc` (held, so no other can take its address): a
    /// listing shares one `Arc` among the nodes of one topology, so most nodes are found
    /// here without hashing the matrix (issue 29: an AM reading 10,000 nodes).
    recent_topos: Vec<(Arc<Topology>, u32)>,
    rack_ids: Interner,
    /// Rooms left on shared GPUs, by content; id 0 is "none" (no GPU shared).
    shares: Vec<GpuShares>,
    share_ids: FastMap<GpuShares, u32>,
    /// Per rack id: its nodes by bucket, ordered as in the bucket.
    racks: Vec<FastMap<u32, BTreeSet<Member>>>,
    salt: u64,
}

/// How many `Arc`s [`NodeIndex::topo_id`] remembers (a cluster has a handful of
/// topologies; a listing one `Arc` for each).
const RECENT_TOPOLOGIES: usize = 16;

/// Whether two nodes file under the same bucket key without computing it: the same shared
/// amounts (so the same total and free), state, labels, GPU type and topology. Every input
/// of [`NodeIndex::key_of`] must be compared here.
fn same_key(a: &Node, b: &Node) -> bool {
    std::ptr::eq(a.free(), b.free())
        && a.state == b.state
        && a.labels == b.labels
        && a.gpu_type == b.gpu_type
        && match (&a.topology, &b.topology) {
            (Some(x), Some(y)) => Arc::ptr_eq(x, y),
            (None, None) => true,
            _ => false,
        }
}

impl NodeIndex {
    pub fn new(salt: u64) -> Self {
        let mut gpu_types = Interner::default();
        gpu_types.id("\u{0}none");
        let mut partitions = Interner::default();
        partitions.id("");
        NodeIndex {
            slots: FastMap::default(),
            hosts: Vec::new(),
            entries: Vec::new(),
            free_slots: Vec::new(),
            buckets: Vec::new(),
            bucket_of: FastMap::default(),
            partitions,
            gpu_types,
            topologies: Vec::new(),
            topo_by_hash: FastMap::default(),
            recent_topos: Vec::new(),
            rack_ids: Interner::default(),
            shares: vec![GpuShares::new()],
            share_ids: FastMap::default(),
            racks: Vec::new(),
            salt: salt | 1,
        }
    }

    /// The id of a topology, equal for equal contents (matrix, NICs, affinity) whatever their names.
    pub fn topo_id(&mut self, t: &Arc<Topology>) -> u32 {
        if let Some(&(_, id)) = self.recent_topos.iter().find(|(r, _)| Arc::ptr_eq(r, t)) {
            return id;
        }
        let id = self.topo_id_by_content(t);
        if self.recent_topos.len() >= RECENT_TOPOLOGIES {
            self.recent_topos.remove(0);
        }
        self.recent_topos.push((t.clone(), id));
        id
    }

    fn topo_id_by_content(&mut self, t: &Arc<Topology>) -> u32 {
        let hash = FastState::default().hash_one(&**t);
        if let Some(ids) = self.topo_by_hash.get(&hash) {
            for &i in ids {
                if self.topologies[i as usize - 1].same_content(t) {
                    return i;
                }
            }
        }
        self.topologies.push(t.clone());
        let id = self.topologies.len() as u32;
        self.topo_by_hash.entry(hash).or_default().push(id);
        id
    }

    /// The shared topology of an id (the first one seen with that content).
    pub fn topology(&self, id: u32) -> Option<&Arc<Topology>> {
        id.checked_sub(1).and_then(|i| self.topologies.get(i as usize))
    }

    pub fn partition_name(&self, id: u32) -> &str {
        self.partitions.name(id)
    }
    pub fn gpu_type_name(&self, id: u32) -> Option<&str> {
        (id != 0).then(|| self.gpu_types.name(id))
    }

    pub fn host(&self, slot: u32) -> &str {
        self.hosts.get(slot as usize).map_or("", |h| h)
    }
    pub fn slot(&self, host: &str) -> Option<u32> {
        self.slots.get(host).copied()
    }
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }
    /// The bucket a slot sits in.
    pub fn bucket_of_slot(&self, slot: u32) -> Option<u32> {
        self.entries.get(slot as usize)?.as_ref().map(|e| e.bucket)
    }
    /// The id of a rack, if any node is or was in it.
    pub fn rack_id(&self, rack: &str) -> Option<u32> {
        self.rack_ids.ids.get(rack).copied()
    }
    /// The rack id of a slot.
    pub fn slot_rack(&self, slot: u32) -> Option<u32> {
        self.entries.get(slot as usize)?.as_ref().map(|e| e.rack)
    }
    /// A rack's nodes by bucket.
    pub fn rack_buckets(&self, rack: u32) -> impl Iterator<Item = (u32, &BTreeSet<Member>)> {
        self.racks
            .get(rack as usize)
            .into_iter()
            .flat_map(|m| m.iter().map(|(b, s)| (*b, s)))
    }
    /// The nodes of one rack in one bucket.
    pub fn rack_set(&self, rack: u32, bucket: u32) -> Option<&BTreeSet<Member>> {
        self.racks.get(rack as usize)?.get(&bucket)
    }

    /// The id of a free amount's shared-GPU rooms (0 = none).
    fn share_id(&mut self, s: &GpuShares) -> u32 {
        if s.is_empty() {
            return 0;
        }
        if let Some(&i) = self.share_ids.get(s) {
            return i;
        }
        let i = self.shares.len() as u32;
        self.shares.push(s.clone());
        self.share_ids.insert(s.clone(), i);
        i
    }

    /// The free GPUs of a bucket's nodes as an amount (wholly free GPUs and the room left
    /// on shared ones), with unlimited CPU and memory and no ports: what the GPU part of
    /// the shortfall rule and the GPU half of the order need.
    pub fn free_gpus(&self, key: &BucketKey) -> Resources {
        let shares = self.shares.get(key.free_shares as usize).cloned().unwrap_or_default();
        let gpu_mask = key.free_mask | shares.mask();
        Resources {
            cpu: u32::MAX,
            memory_mb: u64::MAX,
            gpus: gpu_mask.count_ones(),
            gpu_mask,
            gpu_shares: shares,
            ports: PortSet::new(),
            custom: Default::default(),
        }
    }

    /// The key a node files under (its topology must already be interned or is interned now).
    fn key_of(&mut self, node: &Node) -> BucketKey {
        let free = node.free();
        let total = node.total();
        let free_shares = self.share_id(&free.gpu_shares);
        BucketKey {
            running: node.state == NodeState::Running,
            partition: self.partitions.id(node.partition()),
            gpu_type: node.gpu_type.as_deref().map_or(0, |t| self.gpu_types.id(t)),
            topo: node.topology.as_ref().map_or(0, |t| self.topo_id(t)),
            total_mask: total.gpu_mask,
            total_gpus: total.gpu_count(),
            free_mask: free.whole_gpu_mask(),
            free_gpus: free.whole_gpu_count(),
            free_shares,
        }
    }

    /// A host's slot, given one if it has none.
    fn slot_for(&mut self, host: &str) -> u32 {
        if let Some(&s) = self.slots.get(host) {
            return s;
        }
        let name: Arc<str> = Arc::from(host);
        let s = match self.free_slots.pop() {
            Some(s) => {
                self.hosts[s as usize] = name.clone();
                s
            }
            None => {
                self.hosts.push(name.clone());
                self.entries.push(None);
                (self.hosts.len() - 1) as u32
            }
        };
        self.slots.insert(name, s);
        s
    }

    /// The id of the bucket of `key`, made if it is new.
    fn bucket_for(&mut self, key: BucketKey) -> u32 {
        if let Some(&b) = self.bucket_of.get(&key) {
            return b;
        }
        self.buckets.push(Bucket {
            key,
            nodes: BTreeSet::new(),
        });
        let b = (self.buckets.len() - 1) as u32;
        self.bucket_of.insert(key, b);
        b
    }

    /// A slot's random tie-break, fixed per AM by its salt (so concurrent AMs spread).
    fn salted_tie(&self, slot: u32) -> u32 {
        ((u64::from(slot) + 1).wrapping_mul(self.salt) >> 32) as u32
    }

    /// `node`'s place in its bucket: free cores, free memory, then the salted tie.
    fn member_of(&self, node: &Node, slot: u32) -> Member {
        (node.free().cpu, node.free().memory_mb, self.salted_tie(slot), slot)
    }

    /// Where `node` files: its slot's entry (bucket, place in it, rack).
    fn entry_of(&mut self, node: &Node, slot: u32) -> Entry {
        let key = self.key_of(node);
        let member = self.member_of(node, slot);
        let bucket = self.bucket_for(key);
        let rack = self.rack_ids.id(&node.rack);
        Entry { bucket, member, rack }
    }

    /// Files `node` (new or changed) under its current key.
    pub fn upsert(&mut self, node: &Node) {
        let slot = self.slot_for(&node.host);
        let Entry { bucket, member, rack } = self.entry_of(node, slot);
        if let Some(old) = &self.entries[slot as usize] {
            if old.bucket == bucket && old.member == member && old.rack == rack {
                return;
            }
        }
        self.unfile(slot);
        self.buckets[bucket as usize].nodes.insert(member);
        if self.racks.len() <= rack as usize {
            self.racks.resize_with(rack as usize + 1, FastMap::default);
        }
        self.racks[rack as usize].entry(bucket).or_default().insert(member);
        self.entries[slot as usize] = Some(Entry { bucket, member, rack });
    }

    /// Takes a slot out of its bucket and rack (the slot stays assigned).
    fn unfile(&mut self, slot: u32) {
        if let Some(old) = self.entries[slot as usize].take() {
            self.buckets[old.bucket as usize].nodes.remove(&old.member);
            if let Some(r) = self.racks.get_mut(old.rack as usize) {
                if let Some(set) = r.get_mut(&old.bucket) {
                    set.remove(&old.member);
                    if set.is_empty() {
                        r.remove(&old.bucket);
                    }
                }
            }
        }
    }

    /// Forgets a host.
    pub fn remove(&mut self, host: &str) {
        if let Some(slot) = self.slots.remove(host) {
            self.unfile(slot);
            self.hosts[slot as usize] = Arc::from("");
            self.free_slots.push(slot);
        }
    }

    /// Rebuilds from scratch (a full listing); interned names and topologies are kept.
    pub fn rebuild<'a>(&mut self, nodes: impl Iterator<Item = &'a Node>) {
        self.slots.clear();
        self.hosts.clear();
        self.entries.clear();
        self.free_slots.clear();
        self.buckets.clear();
        self.bucket_of.clear();
        self.racks.clear();
        self.shares.truncate(1);
        self.share_ids.clear();
        // Sized once for the whole view (an AM's first one is every node of the cluster).
        let (count, _) = nodes.size_hint();
        self.slots.reserve(count);
        self.hosts.reserve(count);
        self.entries.reserve(count);
        // Every node filed first, then each bucket's and each rack's set built once from
        // its members (a B-tree built from sorted members, not one insert per node: an
        // AM's start indexes the whole cluster, issue 29). A host met twice is filed again
        // after, as a change.
        let mut members: Vec<Vec<Member>> = Vec::new();
        let mut rack_members: Vec<FastMap<u32, Vec<Member>>> = Vec::new();
        let mut again: Vec<&Node> = Vec::new();
        // The last node's key, bucket and rack: a listing's nodes of one shape share their
        // amounts and come in runs, as do the nodes of a rack.
        let mut last: Option<(&Node, u32, u32)> = None;
        for n in nodes {
            if self.slots.contains_key(n.host.as_str()) {
                again.push(n);
                continue;
            }
            let slot = self.slot_for(&n.host);
            let e = match last {
                Some((p, bucket, rack)) if same_key(p, n) => Entry {
                    bucket,
                    member: self.member_of(n, slot),
                    rack: if p.rack == n.rack {
                        rack
                    } else {
                        self.rack_ids.id(&n.rack)
                    },
                },
                _ => self.entry_of(n, slot),
            };
            last = Some((n, e.bucket, e.rack));
            if members.len() <= e.bucket as usize {
                members.resize_with(e.bucket as usize + 1, Vec::new);
            }
            members[e.bucket as usize].push(e.member);
            if rack_members.len() <= e.rack as usize {
                rack_members.resize_with(e.rack as usize + 1, FastMap::default);
            }
            rack_members[e.rack as usize]
                .entry(e.bucket)
                .or_default()
                .push(e.member);
            self.entries[slot as usize] = Some(e);
        }
        for (b, m) in members.into_iter().enumerate() {
            self.buckets[b].nodes = m.into_iter().collect();
        }
        self.racks = rack_members
            .into_iter()
            .map(|r| r.into_iter().map(|(b, m)| (b, m.into_iter().collect())).collect())
            .collect();
        for n in again {
            self.upsert(n);
        }
    }

    /// The random tie-break of a slot (fixed per AM, so concurrent AMs spread).
    pub fn tie(&self, slot: u32) -> u32 {
        self.entries
            .get(slot as usize)
            .and_then(|e| e.as_ref())
            .map_or(0, |e| e.member.2)
    }

    /// Number of indexed nodes.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// What the node filters see of every node of a bucket.
    pub fn facts(&self, key: &BucketKey) -> super::feasible::NodeFacts<'_> {
        super::feasible::NodeFacts {
            running: key.running,
            partition: self.partition_name(key.partition),
            gpu_type: self.gpu_type_name(key.gpu_type),
            total_gpus: key.total_gpus,
        }
    }

    /// GPUs not wholly free (held by containers or asks, or shared) on the nodes of the
    /// buckets `keep` accepts, summed per bucket: the bucket count does not grow with the node
    /// count.
    pub fn held_gpus(&self, keep: impl Fn(&BucketKey) -> bool) -> u64 {
        self.buckets
            .iter()
            .filter(|b| keep(&b.key))
            .map(|b| u64::from(b.key.total_gpus.saturating_sub(b.key.free_gpus)) * b.nodes.len() as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{mask_of_count, PortSet};
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// Each bucket's members and each rack's members by bucket, by key (its content,
    /// [`key_text`]) and rack name (ids and bucket numbers may differ between two indexes of
    /// the same nodes).
    type Filed = (
        BTreeMap<String, BTreeSet<Member>>,
        BTreeMap<(String, String), BTreeSet<Member>>,
    );

    /// A bucket's key by content: names and contents, not the ids interned for them (two
    /// indexes of the same nodes may intern them in another order: a host met twice in a
    /// listing is filed after the others).
    fn key_text(ix: &NodeIndex, k: &BucketKey) -> String {
        format!(
            "running {} partition {:?} type {:?} topology {:?} total {:#x}/{} free {:#x}/{} shares {:?}",
            k.running,
            ix.partition_name(k.partition),
            ix.gpu_type_name(k.gpu_type),
            ix.topology(k.topo),
            k.total_mask,
            k.total_gpus,
            k.free_mask,
            k.free_gpus,
            ix.shares.get(k.free_shares as usize),
        )
    }

    fn filed(ix: &NodeIndex) -> Filed {
        let key = |b: u32| key_text(ix, &ix.buckets[b as usize].key);
        let buckets = ix
            .buckets
            .iter()
            .filter(|b| !b.nodes.is_empty())
            .map(|b| (key_text(ix, &b.key), b.nodes.clone()))
            .collect();
        let mut racks = BTreeMap::new();
        for (rack, name) in ix.rack_ids.names.iter().enumerate() {
            for (b, set) in ix.rack_buckets(rack as u32) {
                if !set.is_empty() {
                    racks.insert((name.clone(), key(b)), set.clone());
                }
            }
        }
        (buckets, racks)
    }

    fn node(host: u8, rack: u8, gpus: u32, used: u64, cpu: u32) -> Node {
        let mut n = Node::new(
            format!("h{host}"),
            format!("/rack{rack}"),
            Resources::with_mask(64, 256_000, mask_of_count(gpus), PortSet::range(20000, 20099)),
        );
        n.gpu_type = (gpus > 0).then(|| "V100".to_string());
        let used = used & mask_of_count(gpus);
        n.set_used(Resources::with_mask(cpu, 1000, used, PortSet::new()));
        n
    }

    proptest! {
        /// Rebuilding from a listing (every node filed, then each set built once) files
        /// every node exactly as filing them one by one does, hosts met twice included.
        #[test]
        fn a_rebuild_files_nodes_as_one_upsert_each(
            shapes in prop::collection::vec((0u32..=8, any::<u64>(), 0u32..64), 1..4),
            nodes in prop::collection::vec((0u8..40, 0u8..5, 0usize..4, prop::option::of((0u32..=8, any::<u64>(), 0u32..64))), 0..80),
        ) {
            // Most nodes are clones of a few shapes (sharing their amounts, as a compact
            // listing's are), some their own; hosts and racks come in runs and repeat.
            let shapes: Vec<Node> = shapes.into_iter().map(|(g, u, c)| node(0, 0, g, u, c)).collect();
            let nodes: Vec<Node> = nodes
                .into_iter()
                .map(|(h, r, k, own)| match own {
                    Some((g, u, c)) => node(h, r, g, u, c),
                    None => {
                        // A clone keeps its shape's amounts; some differ in the key's
                        // other inputs all the same.
                        let mut n = shapes[k % shapes.len()].clone();
                        n.host = format!("h{h}");
                        n.rack = format!("/rack{r}");
                        match h % 7 {
                            1 => n.state = NodeState::Unhealthy,
                            2 => n.labels = vec!["gpu".into()],
                            3 => n.gpu_type = Some("A100".into()),
                            4 => n.topology = crate::topology::Topology::preset("pcie8").map(Arc::new),
                            _ => {}
                        }
                        n
                    }
                })
                .collect();
            let mut bulk = NodeIndex::new(7);
            bulk.rebuild(nodes.iter());
            let mut one_by_one = NodeIndex::new(7);
            for n in &nodes {
                one_by_one.upsert(n);
            }
            prop_assert_eq!(filed(&bulk), filed(&one_by_one));
            prop_assert_eq!(bulk.len(), one_by_one.len());
            for n in &nodes {
                prop_assert_eq!(bulk.slot(&n.host), one_by_one.slot(&n.host));
            }
        }
    }
}
