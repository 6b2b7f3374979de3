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
    free: Resources,
    total: Resources,
    pub labels: Vec<String>,
    pub gpu_type: Option<String>,
    pub rack: String,
    pub host: String,
    used: Resources,
    requested: Resources,
    /// Where this node's executor listens (`host:port`); empty when unknown.
    pub http_address: String,
    /// The address this node's containers are reached at by their peers (a node agent's
    /// or a Ray node's IP); `None` for simulated nodes, whose peers get the host name.
    pub ip: Option<std::net::IpAddr>,
}

impl Node {
    pub fn new(host: impl Into<String>, rack: impl Into<String>, total: Resources) -> Self {
        let free = total.clone();
        Node {
            host: host.into(),
            rack: rack.into(),
            labels: Vec::new(),
            gpu_type: None,
            topology: None,
            state: NodeState::Running,
            http_address: String::new(),
            ip: None,
            local: false,
            total,
            used: Resources::default(),
            requested: Resources::default(),
            free,
        }
    }

    pub fn total(&self) -> &Resources {
        &self.total
    }
    pub fn used(&self) -> &Resources {
        &self.used
    }
    /// What this AM has asked for on this node and not yet received.
    pub fn requested(&self) -> &Resources {
        &self.requested
    }
    /// total − used − requested.
    pub fn free(&self) -> &Resources {
        &self.free
    }

    /// The node's partition: its first label, trimmed, or "" (YARN's NO_LABEL).
    pub fn partition(&self) -> &str {
        self.labels.first().map(|l| l.trim()).unwrap_or("")
    }

    pub fn set_total(&mut self, total: Resources) {
        self.total = total;
        self.recompute();
    }
    pub fn set_used(&mut self, used: Resources) {
        self.used = used;
        self.recompute();
    }
    pub fn set_requested(&mut self, requested: Resources) {
        self.requested = requested;
        self.recompute();
    }

    fn recompute(&mut self) {
        self.free = self.total.subtract(&self.used).subtract(&self.requested);
    }

    /// Replaces what the RM reports (labels, rack, state, total, used) and keeps the
    /// AM-side `requested`, as the original's upsert did.
    pub fn update_from_report(&mut self, report: Node) {
        let requested = std::mem::take(&mut self.requested);
        *self = report;
        self.requested = requested;
        self.recompute();
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
        let mut next = BTreeMap::new();
        for r in reports {
            if r.state.is_unusable() {
                continue;
            }
            let mut n = r;
            if let Some(old) = self.nodes.get(&n.host) {
                n.requested = old.requested.clone();
                n.recompute();
            }
            next.insert(n.host.clone(), Box::new(n));
        }
        self.nodes = next;
    }
}
