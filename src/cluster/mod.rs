//! The AM's `allNodes` view: every node's labels, rack, GPU type, topology, and its
//! total, used and AM-requested resources.
//!
//! `free` (= total − used − requested) is cached on the node and recomputed whenever
//! one of its inputs changes, because the select pipeline reads it for every node on
//! every call and must stay fast at 10,000 nodes.

pub mod file;
pub mod rm_json;
pub mod synthetic;

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::resources::Resources;
use crate::topology::Topology;

/// YARN node states; only `Running` nodes are candidates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default, Hash)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum NodeState {
    New,
    #[default]
    Running,
    Unhealthy,
    Decommissioning,
    Decommissioned,
    Lost,
    Rebooted,
    Shutdown,
}

impl NodeState {
    /// States after which a node's containers are gone (YARN's "unusable").
    pub fn is_unusable(self) -> bool {
        matches!(
            self,
            NodeState::Unhealthy
                | NodeState::Decommissioned
                | NodeState::Lost
                | NodeState::Rebooted
                | NodeState::Shutdown
        )
    }
}

/// One node as the AM sees it.
///
/// `repr(C)` keeps the fields in this order: the ones the select pipeline reads for
/// every node on every call come first, so they share a few cache lines (at 10,000
/// nodes the pipeline is bound by memory, not arithmetic).
#[derive(Clone, Debug, PartialEq)]
#[repr(C)]
pub struct Node {
    pub state: NodeState,
    /// Use this machine's real GPUs (executor side only).
    pub local: bool,
    pub topology: Option<Arc<Topology>>,
    /// Total, used, requested and free, shared by nodes that hold the same (a listing's
    /// nodes of one shape are clones of it) and copied on a node's first change: an AM's
    /// view of 10,000 nodes of a few kinds holds a few amounts, not 10,000 (issue 29).
    amounts: Arc<Amounts>,
    pub labels: Vec<String>,
    pub gpu_type: Option<String>,
    pub rack: String,
    pub host: String,
    /// Where this node's executor listens (`host:port`); empty when unknown.
    pub http_address: String,
    /// The address this node's containers are reached at by their peers (a node agent's
    /// or a Ray node's IP); `None` for simulated nodes, whose peers get the host name.
    pub ip: Option<std::net::IpAddr>,
    /// When every container running on it will have reached its declared run-time limit
    /// (`maxRunSec`; ms since the epoch), so the node is whole again by then at the latest;
    /// 0: nothing runs there. `None`: unknown (a container declared no limit, or the RM
    /// does not say). The order's drain term reads it (issue 27; `select::objective`).
    pub drain_by_ms: Option<u64>,
}

/// A node's amounts; `free` = total − used − requested, kept in step by [`Node`]'s setters.
#[derive(Clone, Debug, PartialEq)]
struct Amounts {
    free: Resources,
    total: Resources,
    used: Resources,
    requested: Resources,
}

impl Amounts {
    fn recompute(&mut self) {
        self.free = self.total.subtract(&self.used).subtract(&self.requested);
    }
}

impl Node {
    pub fn new(host: impl Into<String>, rack: impl Into<String>, total: Resources) -> Self {
        Node {
            host: host.into(),
            rack: rack.into(),
            labels: Vec::new(),
            gpu_type: None,
            topology: None,
            state: NodeState::Running,
            http_address: String::new(),
            ip: None,
            drain_by_ms: None,
            local: false,
            amounts: Arc::new(Amounts {
                free: total.clone(),
                total,
                used: Resources::default(),
                requested: Resources::default(),
            }),
        }
    }

    pub fn total(&self) -> &Resources {
        &self.amounts.total
    }
    pub fn used(&self) -> &Resources {
        &self.amounts.used
    }
    /// What this AM has asked for on this node and not yet received.
    pub fn requested(&self) -> &Resources {
        &self.amounts.requested
    }
    /// total − used − requested.
    pub fn free(&self) -> &Resources {
        &self.amounts.free
    }

    /// The node's partition: its first label, trimmed, or "" (YARN's NO_LABEL).
    pub fn partition(&self) -> &str {
        self.labels.first().map(|l| l.trim()).unwrap_or("")
    }

    pub fn set_total(&mut self, total: Resources) {
        let a = Arc::make_mut(&mut self.amounts);
        a.total = total;
        a.recompute();
    }
    pub fn set_used(&mut self, used: Resources) {
        let a = Arc::make_mut(&mut self.amounts);
        a.used = used;
        a.recompute();
    }
    pub fn set_requested(&mut self, requested: Resources) {
        let a = Arc::make_mut(&mut self.amounts);
        a.requested = requested;
        a.recompute();
    }

    /// Replaces what the RM reports (labels, rack, state, total, used) and keeps the
    /// AM-side `requested`, as the original's upsert did.
    pub fn update_from_report(&mut self, report: Node) {
        let kept = Arc::clone(&self.amounts);
        *self = report;
        // Equal amounts stay shared (the report's `free` already counts what it requests).
        if self.requested() != &kept.requested {
            self.set_requested(kept.requested.clone());
        }
    }
}

/// `allNodes`, keyed and ordered by host.
///
/// Each node is boxed: the tree then holds a host and a pointer per node, not the whole
/// node, and is built without copying every node twice more (an AM's first view is every
/// node of the cluster, all faulted in for the first time: issue 29).
#[derive(Clone, Debug, Default)]
pub struct ClusterView {
    nodes: BTreeMap<String, Box<Node>>,
}

impl ClusterView {
    pub fn new(nodes: impl IntoIterator<Item = Node>) -> Self {
        ClusterView {
            nodes: nodes.into_iter().map(|n| (n.host.clone(), Box::new(n))).collect(),
        }
    }
    pub fn len(&self) -> usize {
        self.nodes.len()
    }
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
    pub fn get(&self, host: &str) -> Option<&Node> {
        self.nodes.get(host).map(|n| &**n)
    }
    pub fn get_mut(&mut self, host: &str) -> Option<&mut Node> {
        self.nodes.get_mut(host).map(|n| &mut **n)
    }
    pub fn nodes(&self) -> impl Iterator<Item = &Node> {
        self.nodes.values().map(|n| &**n)
    }
    /// Drops the nodes in unusable states (as [`ClusterView::replace_all`] leaves them out).
    pub fn retain_usable(&mut self) {
        self.nodes.retain(|_, n| !n.state.is_unusable());
    }
    pub fn nodes_mut(&mut self) -> impl Iterator<Item = &mut Node> {
        self.nodes.values_mut().map(|n| &mut **n)
    }

    /// Applies one node report: unusable states remove the node, others upsert it
    /// (keeping this AM's `requested`).
    pub fn apply_report(&mut self, report: Node) {
        if report.state.is_unusable() {
            self.nodes.remove(&report.host);
            return;
        }
        match self.nodes.get_mut(&report.host) {
            Some(n) => n.update_from_report(report),
            None => {
                self.nodes.insert(report.host.clone(), Box::new(report));
            }
        }
    }

    /// Replaces the whole view with a full listing, keeping `requested` for hosts that
    /// remain and dropping hosts that are gone.
    pub fn replace_all(&mut self, reports: Vec<Node>) {
        let mut old = std::mem::take(&mut self.nodes);
        for r in reports {
            if r.state.is_unusable() {
                continue;
            }
            // A host that remains keeps its `requested` by the one rule for a report.
            let n = match old.remove(&r.host) {
                Some(mut n) => {
                    n.update_from_report(r);
                    n
                }
                None => Box::new(r),
            };
            self.nodes.insert(n.host.clone(), n);
        }
    }
}
