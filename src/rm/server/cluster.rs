//! Cluster-wide endpoints: cluster info and metrics, the node listing (YARN's shape with
//! gpuam's extensions, DESIGN.md §3) and the admin's node state changes.
//!
//! The node listing is served from [`NodeView`]: each node's JSON object is written once
//! per change of that node (the ledger's change index says which changed since the view
//! was last brought up to date) and the whole answer once per ledger epoch, shared as
//! bytes by every request at that epoch. `?since=<nodesVersion>` answers only the nodes
//! changed since that version, so an AM's refresh costs O(changes), not O(nodes).

use std::collections::{BTreeMap, HashMap, HashSet};

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::containers::stop_running;
use super::http::{authorize_admin, ApiError, ApiJson};
use super::state::RmState;
use super::{transactions, Rm, Shared};
use crate::cluster::rm_json::{self, node_to_json, ObjectForm, CHANGED_SINCE, NODES_VERSION};
use crate::cluster::{Node, NodeState};
use crate::protocol::{now_ms, AppState};
use crate::rm::apps::App;
use crate::rm::ledger::Ledger;

/// Sets a node's state; unusable states end its containers (completed to their apps
/// with -100 and the lost-node diagnostics) and kill their process groups through the
/// executor. Returns how many containers ended; `None` for an unknown host.
pub(super) async fn change_node_state(shared: &Shared, host: &str, state: NodeState) -> Option<usize> {
    let ended = transactions::set_node_state(&mut shared.lock(), host, state)?;
    tracing::warn!(%host, ?state, containers = ended.len(), "node state changed by an administrator");
    stop_running(shared, &ended).await;
    Some(ended.len())
}

pub(super) async fn cluster_info(State(rm): Rm) -> Json<Value> {
    let (store, store_errors, failing, recoveries) = {
        let st = rm.lock();
        let h = &st.store_health;
        (st.store.kind(), h.write_errors, h.failing.clone(), h.recoveries)
    };
    Json(json!({ "clusterInfo": {
        "id": rm.cluster_ts,
        "startedOn": rm.cluster_ts,
        "state": "STARTED",
        "haState": "ACTIVE",
        "rmStateStoreName": store,
        // Writes to the state store that failed; while `rmStateStoreFailing` is set the RM
        // grants nothing and refuses state changes (503) until a write succeeds again.
        "rmStateStoreWriteErrors": store_errors,
        "rmStateStoreFailing": failing,
        // Failures ended by writing the whole state again.
        "rmStateStoreRecoveries": recoveries,
        "resourceManagerVersion": concat!("gpuam-", env!("CARGO_PKG_VERSION")),
        "hadoopVersion": "3.4.1 (gpuam compatible)",
    }}))
}

pub(super) async fn cluster_metrics(State(rm): Rm) -> Json<Value> {
    let st = rm.lock();
    let count = |f: &dyn Fn(&App) -> bool| st.apps.values().filter(|a| f(a)).count();
    let (mut total_mb, mut used_mb, mut total_vc, mut used_vc, mut total_gpu, mut used_gpu) =
        (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    let mut by_state: HashMap<NodeState, u32> = HashMap::new();
    let mut containers = 0u32;
    for (n, c) in st.ledger.nodes() {
        *by_state.entry(n.state).or_default() += 1;
        containers += c;
        if n.state.is_unusable() {
            continue;
        }
        total_mb += n.total().memory_mb;
        used_mb += n.used().memory_mb;
        total_vc += u64::from(n.total().cpu);
        used_vc += u64::from(n.used().cpu);
        total_gpu += u64::from(n.total().gpu_count());
        used_gpu += u64::from(n.used().gpu_count());
    }
    let nodes = |s: NodeState| by_state.get(&s).copied().unwrap_or(0);
    Json(json!({ "clusterMetrics": {
        "rmStateStoreWriteErrors": st.store_health.write_errors,
        "rmStateStoreFailing": st.store_health.failing.is_some(),
        "appsSubmitted": st.apps.len(),
        "appsCompleted": count(&|a| a.report.state.is_final()),
        "appsPending": count(&|a| matches!(a.report.state, AppState::New | AppState::Submitted | AppState::Accepted)),
        "appsRunning": count(&|a| a.report.state == AppState::Running),
        "appsFailed": count(&|a| a.report.state == AppState::Failed),
        "appsKilled": count(&|a| a.report.state == AppState::Killed),
        "reservedMB": 0,
        "availableMB": total_mb.saturating_sub(used_mb),
        "allocatedMB": used_mb,
        "totalMB": total_mb,
        "reservedVirtualCores": 0,
        "availableVirtualCores": total_vc.saturating_sub(used_vc),
        "allocatedVirtualCores": used_vc,
        "totalVirtualCores": total_vc,
        "containersAllocated": containers,
        "containersReserved": 0,
        "containersPending": 0,
        "totalNodes": st.ledger.nodes().count(),
        "activeNodes": nodes(NodeState::Running),
        "lostNodes": nodes(NodeState::Lost),
        "unhealthyNodes": nodes(NodeState::Unhealthy),
        "decommissioningNodes": nodes(NodeState::Decommissioning),
        "decommissionedNodes": nodes(NodeState::Decommissioned),
        "rebootedNodes": nodes(NodeState::Rebooted),
        "shutdownNodes": nodes(NodeState::Shutdown),
        "totalGpus": total_gpu,
        "allocatedGpus": used_gpu,
        "availableGpus": total_gpu.saturating_sub(used_gpu),
    }}))
}

#[derive(Deserialize)]
pub(super) struct NodesQuery {
    pub(super) states: Option<String>,
    /// A `nodesVersion` of an earlier answer: only what changed since.
    pub(super) since: Option<String>,
    /// `lean`: each node without what gpuam's reader does without
    /// (`rm_json::NOT_IN_LEAN_VIEW`); absent: YARN's whole node objects.
    pub(super) view: Option<String>,
}

/// The node listing's bytes, kept up to date with the ledger (see the module doc). Lives in
/// [`Shared`] under its own lock, always taken after the state lock.
pub(super) struct NodeView {
    /// Tells this RM process's versions from another's (a restarted RM counts epochs anew).
    incarnation: u64,
    /// Which object each node has: YARN's whole one, the lean one (`?view=lean`), or a
    /// compact entry and its shape (`?view=compact`).
    form: ObjectForm,
    /// The ledger epoch `objects` reflect (`None`: not built yet).
    epoch: Option<u64>,
    /// Each node's JSON object (compact: its entry without the shape), by host.
    objects: BTreeMap<String, Bytes>,
    /// Compact only: each node's shape, by host; equal shapes are one allocation
    /// (`canonical`), so an answer tells them apart by address.
    shapes: BTreeMap<String, Bytes>,
    /// Compact only: every shape text in `shapes`, once.
    canonical: HashSet<Bytes>,
    /// The whole answer at `epoch`, once asked for.
    whole: Option<(u64, Bytes)>,
}

impl NodeView {
    /// The views of one RM process share `incarnation`: a version of one is good for the
    /// others (all count the ledger's epochs).
    pub(super) fn new(form: ObjectForm, incarnation: u64) -> Self {
        NodeView {
            incarnation,
            form,
            epoch: None,
            objects: BTreeMap::new(),
            shapes: BTreeMap::new(),
            canonical: HashSet::new(),
            whole: None,
        }
    }

    fn version(&self, epoch: u64) -> String {
        format!("{:x}-{epoch}", self.incarnation)
    }

    /// The epoch a version of this RM process names (`None`: another process's, or not
    /// a version).
    fn epoch_of(&self, version: &str) -> Option<u64> {
        let (inc, epoch) = version.split_once('-')?;
        (u64::from_str_radix(inc, 16).ok()? == self.incarnation)
            .then(|| epoch.parse().ok())
            .flatten()
    }

    /// A node's object (compact: its entry) and, compact only, its shape.
    fn object(&mut self, node: &Node, num_containers: u32, at_ms: u64) -> (Bytes, Option<Bytes>) {
        if self.form != ObjectForm::Shape {
            let o = rm_json::node_json_bytes(node, num_containers, at_ms, self.form);
            return (Bytes::from(o), None);
        }
        let shape = Bytes::from(rm_json::node_json_bytes(node, num_containers, at_ms, ObjectForm::Shape));
        let shape = match self.canonical.get(&shape) {
            Some(s) => s.clone(),
            None => {
                self.canonical.insert(shape.clone());
                shape
            }
        };
        (Bytes::from(rm_json::node_entry_bytes(node)), Some(shape))
    }

    fn keep(&mut self, host: &str, (object, shape): (Bytes, Option<Bytes>)) {
        self.objects.insert(host.to_string(), object);
        if let Some(shape) = shape {
            self.shapes.insert(host.to_string(), shape);
        }
    }

    /// Brings the node objects up to the ledger's epoch: O(nodes changed since).
    fn catch_up(&mut self, ledger: &Ledger) {
        let now = ledger.epoch();
        let at = now_ms();
        match self.epoch {
            Some(e) if e == now => return,
            Some(e) => {
                for (n, c) in ledger.changed_since(e) {
                    if ledger.node(&n.host).is_some() {
                        let o = self.object(n, c, at);
                        self.keep(&n.host, o);
                    } else {
                        self.objects.remove(&n.host);
                        self.shapes.remove(&n.host);
                    }
                }
            }
            None => {
                self.objects.clear();
                self.shapes.clear();
                for (n, c) in ledger.nodes() {
                    let o = self.object(n, c, at);
                    self.keep(&n.host, o);
                }
            }
        }
        // Shapes no node has any more: dropped once they outnumber the nodes.
        if self.canonical.len() > 2 * self.shapes.len() + 64 {
            self.canonical = self.shapes.values().cloned().collect();
        }
        self.epoch = Some(now);
    }

    /// `{"nodes":{"node":[...]}, "nodesVersion": ..}` (and `changedSince`) of `objects`;
    /// compact: `{"nodes":{"shapes":[...],"node":[{"shape":K,..}...]},..}`, each shape once.
    fn answer<'a>(
        &self,
        objects: impl Iterator<Item = (&'a Bytes, Option<&'a Bytes>)>,
        epoch: u64,
        since: Option<u64>,
    ) -> Bytes {
        // Sized by what is written: a `?since=` answer of a few changes stays small.
        let objects: Vec<(&Bytes, Option<&Bytes>)> = objects.collect();
        let mut nodes = Vec::with_capacity(16 + objects.iter().map(|(o, _)| o.len() + 16).sum::<usize>());
        // Compact: shapes by their allocation's address (equal shapes share one).
        let mut ids: HashMap<(usize, usize), usize> = HashMap::new();
        let mut shapes: Vec<&Bytes> = Vec::new();
        for (i, (o, shape)) in objects.into_iter().enumerate() {
            if i > 0 {
                nodes.push(b',');
            }
            match shape {
                None => nodes.extend_from_slice(o),
                Some(shape) => {
                    let k = *ids.entry((shape.as_ptr() as usize, shape.len())).or_insert_with(|| {
                        shapes.push(shape);
                        shapes.len() - 1
                    });
                    use std::io::Write as _;
                    let _ = write!(nodes, r#"{{"{}":{k},"#, rm_json::SHAPE);
                    nodes.extend_from_slice(o.get(1..).unwrap_or_default());
                }
            }
        }
        let shapes_len = shapes.iter().map(|s| s.len() + 1).sum::<usize>();
        let mut out = Vec::with_capacity(160 + nodes.len() + shapes_len);
        out.extend_from_slice(br#"{"nodes":{"#);
        if self.form == ObjectForm::Shape {
            out.extend_from_slice(br#""shapes":["#);
            for (i, s) in shapes.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(s);
            }
            out.extend_from_slice(b"],");
        }
        out.extend_from_slice(br#""node":["#);
        out.extend_from_slice(&nodes);
        out.extend_from_slice(format!(r#"]}},"{NODES_VERSION}":"{}""#, self.version(epoch)).as_bytes());
        if let Some(s) = since {
            out.extend_from_slice(format!(r#","{CHANGED_SINCE}":"{}""#, self.version(s)).as_bytes());
        }
        out.push(b'}');
        Bytes::from(out)
    }

    /// A node's cached object and shape.
    fn cached(&self, host: &str) -> Option<(&Bytes, Option<&Bytes>)> {
        Some((self.objects.get(host)?, self.shapes.get(host)))
    }

    /// The whole listing, or only the nodes in `states`; written once per epoch.
    pub(super) fn listing(&mut self, ledger: &Ledger, states: Option<&[NodeState]>) -> Bytes {
        self.catch_up(ledger);
        let epoch = ledger.epoch();
        if let Some(states) = states {
            let objects = ledger
                .nodes()
                .filter(|(n, _)| states.contains(&n.state))
                .filter_map(|(n, _)| self.cached(&n.host));
            return self.answer(objects, epoch, None);
        }
        match &self.whole {
            Some((e, bytes)) if *e == epoch => bytes.clone(),
            _ => {
                let bytes = self.answer(self.objects.keys().filter_map(|h| self.cached(h)), epoch, None);
                self.whole = Some((epoch, bytes.clone()));
                bytes
            }
        }
    }

    /// The nodes changed since `version`: O(changes). A version this RM process did not
    /// give (another process's, or garbage) gets the whole listing.
    pub(super) fn changes(&mut self, ledger: &Ledger, version: &str) -> Bytes {
        let epoch = ledger.epoch();
        let Some(since) = self.epoch_of(version).filter(|s| *s <= epoch) else {
            return self.listing(ledger, None);
        };
        self.catch_up(ledger);
        let at = now_ms();
        // A node that left the ledger is reported as the ledger last had it.
        let gone: Vec<(&Node, u32)> = ledger
            .changed_since(since)
            .filter(|(n, _)| !self.objects.contains_key(&n.host))
            .collect();
        let gone: Vec<(Bytes, Option<Bytes>)> = gone.into_iter().map(|(n, c)| self.object(n, c, at)).collect();
        let objects = ledger
            .changed_since(since)
            .filter_map(|(n, _)| self.cached(&n.host))
            .chain(gone.iter().map(|(o, s)| (o, s.as_ref())));
        self.answer(objects, epoch, Some(since))
    }
}

/// The node listing (see the module doc): YARN's `{"nodes":{"node":[...]}}`, with
/// `nodesVersion`; `?since=` answers the changes only (`changedSince`), `?states=` the
/// nodes in those states.
pub(super) async fn list_nodes(State(rm): Rm, Query(q): Query<NodesQuery>) -> Result<Response, ApiError> {
    let wanted: Option<Vec<NodeState>> = match q.states.as_deref().map(str::trim).filter(|s| !s.is_empty()) {
        None => None,
        Some(s) => Some(
            s.split(',')
                .map(|x| {
                    serde_json::from_value(Value::String(x.trim().to_ascii_uppercase()))
                        .map_err(|_| ApiError::bad_request(format!("`states`: unknown node state `{x}`")))
                })
                .collect::<Result<_, _>>()?,
        ),
    };
    let since = q.since.as_deref().map(str::trim).filter(|s| !s.is_empty());
    if since.is_some() && wanted.is_some() {
        return Err(ApiError::bad_request(
            "`since` and `states` cannot be combined: ask for the changes since a version, or for the nodes in some states",
        ));
    }
    let form = match q.view.as_deref().map(str::trim) {
        None | Some("") => ObjectForm::Whole,
        Some("lean") => ObjectForm::Lean,
        Some("compact") => ObjectForm::Shape,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "`view`: unknown view `{other}` (expected `lean`, `compact`, or none for YARN's whole node objects)"
            )))
        }
    };
    let body = {
        let st = rm.lock();
        let mut view = match form {
            ObjectForm::Whole => rm.node_view.lock(),
            ObjectForm::Lean => rm.node_view_lean.lock(),
            ObjectForm::Shape => rm.node_view_compact.lock(),
        };
        match since {
            Some(v) => view.changes(&st.ledger, v),
            None => view.listing(&st.ledger, wanted.as_deref()),
        }
    };
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

pub(super) async fn get_node(State(rm): Rm, UrlPath(nodeid): UrlPath<String>) -> Result<Json<Value>, ApiError> {
    let host = nodeid.rsplit_once(':').map_or(nodeid.as_str(), |(h, _)| h);
    let st = rm.lock();
    let node = st
        .ledger
        .node(host)
        .or_else(|| st.ledger.node(&nodeid))
        .ok_or_else(|| ApiError::not_found(format!("unknown node `{nodeid}`")))?;
    Ok(Json(
        json!({ "node": node_to_json(node, st.ledger.num_containers(&node.host), now_ms()) }),
    ))
}

/// `PUT /ws/v1/cluster/nodes/{host}/state` body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct NodeStateUpdate {
    pub(super) state: NodeState,
}

/// Admin: changes a node's state. LOST / UNHEALTHY / DECOMMISSIONED end its
/// containers (exit -100, "Container released on a *lost* node") and take its
/// resources out of the schedulable view; RUNNING brings it back. Simulated nodes
/// live in this process and cannot stop answering by themselves, so this call is
/// also how "a node that stops answering" is modelled.
pub(super) async fn put_node_state(
    State(rm): Rm,
    UrlPath(nodeid): UrlPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<NodeStateUpdate>,
) -> Result<Json<Value>, ApiError> {
    authorize_admin(&rm, &headers)?;
    if !matches!(
        req.state,
        NodeState::Running | NodeState::Lost | NodeState::Unhealthy | NodeState::Decommissioned
    ) {
        return Err(ApiError::bad_request(format!(
            "`state` {:?} cannot be set: use RUNNING, LOST, UNHEALTHY or DECOMMISSIONED",
            req.state
        )));
    }
    let host = {
        let mut st = rm.lock();
        st.writable()?;
        known_host(&st, &nodeid)?
    };
    let ended = change_node_state(&rm, &host, req.state)
        .await
        .ok_or_else(|| ApiError::not_found(format!("unknown node `{nodeid}`")))?;
    let mut st = rm.lock();
    // The change was committed (or not) by `change_node_state`: acknowledge it only if so.
    st.commit()?;
    let node = st
        .ledger
        .node(&host)
        .ok_or_else(|| ApiError::not_found(format!("unknown node `{nodeid}`")))?;
    Ok(Json(json!({
        "node": node_to_json(node, st.ledger.num_containers(&host), now_ms()),
        "containersEnded": ended,
    })))
}

/// The host a node id names (`host` or `host:port`), if the ledger has it.
pub(super) fn known_host(st: &RmState, nodeid: &str) -> Result<String, ApiError> {
    let host = nodeid.rsplit_once(':').map_or(nodeid, |(h, _)| h);
    [host, nodeid]
        .into_iter()
        .find(|h| st.ledger.node(h).is_some())
        .map(str::to_string)
        .ok_or_else(|| ApiError::not_found(format!("unknown node `{nodeid}`")))
}

/// Admin: `POST /ws/v1/cluster/nodes/{host}/wiped` — the operator says the machine of a
/// node that is not RUNNING (LOST, say) was wiped or will never come back: the containers
/// it still holds (stopped, waiting for the node to report them dead) are freed now. A
/// RUNNING node's agent reports its containers itself, so it is refused (409).
pub(super) async fn post_node_wiped(
    State(rm): Rm,
    UrlPath(nodeid): UrlPath<String>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    authorize_admin(&rm, &headers)?;
    let mut st = rm.lock();
    let host = known_host(&st, &nodeid)?;
    let held = transactions::wipe_host(&mut st, &host)?;
    tracing::warn!(%host, freed = held.len(), "node declared wiped by an administrator: its held containers are freed");
    let node = st
        .ledger
        .node(&host)
        .ok_or_else(|| ApiError::not_found(format!("unknown node `{nodeid}`")))?;
    Ok(Json(json!({
        "node": node_to_json(node, st.ledger.num_containers(&host), now_ms()),
        "containersFreed": held,
    })))
}
