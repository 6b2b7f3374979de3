//! The RM's side of the node interface (DESIGN.md §9): which backend runs a host's
//! containers ([`Nodes`]), the node agents' registration and heartbeats with
//! frameworklauncher's reconciliation rules (unknown containers are killed, known ones
//! kept), and agent liveness (silent for `rm.node_expiry_sec` → LOST).
//!
//! Freed only when dead: every path that ends a running container stops it (held) and
//! frees it when its node reports it dead (an agent in its heartbeat or registration,
//! taken and stored before the answer acknowledges it: [`take_deaths`]; the RM's own
//! nodes by event: [`on_node_event`]); the state changes are the node transactions of
//! `transactions`. A LOST agent's containers stay held until it returns and reports them
//! dead or gone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::task::JoinHandle;

use super::cluster::known_host;
use super::containers::stop_running;
use super::http::{bearer, ApiError, ApiJson, Caller};
use super::state::{RmState, StateGuard};
use super::transactions::{self, Registration};
use super::{Rm, Shared};
use crate::cluster::{Node, NodeState};
use crate::node::remote::AgentNodes;
use crate::node::wire::{AgentHeartbeat, AgentRegister, AgentReply, ContainerReport};
use crate::node::{InProcessNode, NodeBackend, NodeEvent};
use crate::protocol::{exit_status, now_ms, ContainerState};
use crate::tls::PeerAddr;

/// The node backends of this RM: a Ray cluster (`--backend ray`: every host), else
/// registered agents, else the in-process node.
pub(crate) struct Nodes {
    pub(crate) local: InProcessNode,
    pub(crate) agents: Option<Arc<AgentNodes>>,
    pub(crate) ray: Option<Arc<dyn NodeBackend>>,
}

impl Nodes {
    /// The backend that runs `host`'s containers.
    pub(crate) fn for_host(&self, host: &str) -> &dyn NodeBackend {
        if let Some(r) = &self.ray {
            return r.as_ref();
        }
        match &self.agents {
            Some(a) if a.knows(host) => a.as_ref(),
            _ => &self.local,
        }
    }
}

/// One of the RM's own nodes (in-process, Ray driver) says a container is dead: free it
/// (and tell its application if it had not heard yet), and collect its logs. Node agents'
/// reports are taken in their heartbeat's transaction instead ([`take_deaths`]).
pub(super) fn on_node_event(rm: &Arc<Shared>, ev: NodeEvent) {
    let NodeEvent::Exited {
        container_id,
        exit_status,
        diagnostics,
        .. // the cause: the diagnostics lead with its words, which the AM reads back
    } = ev;
    transactions::container_exited(&mut rm.lock(), &container_id, exit_status, diagnostics);
    super::logs::spawn_collect(rm, container_id);
}

/// An agent's reports of dead containers (its own: [`transactions::own_reports`]), taken
/// in the transaction of its heartbeat or registration, each ended only when it is on
/// `host` ([`transactions::node_reported_exit`]), and stored before `reply` acknowledges
/// them (the agent forgets what is acknowledged, so an RM that dies after answering must
/// have them). When the store cannot take them, `reply` acknowledges nothing and the
/// agent reports them again. The ids taken (their logs are to be collected).
fn take_deaths(st: &mut StateGuard, host: &str, own: &[ContainerReport], reply: &mut AgentReply) -> Vec<String> {
    let taken = own
        .iter()
        .filter(|r| r.state == ContainerState::Complete)
        .filter(|r| {
            let exit = r.exit_status.unwrap_or(exit_status::ABORTED);
            transactions::node_reported_exit(st, host, &r.container_id, exit, r.diagnostics.clone()).is_ok()
        })
        .map(|r| r.container_id.clone())
        .collect();
    if st.commit().is_err() {
        tracing::warn!(%host, "the state store failed: the agent's reported deaths are not acknowledged (it reports them again)");
        reply.acknowledged.clear();
    }
    taken
}

/// Marks silent agents LOST, every second: their containers end for their applications
/// (held: nothing is known of their processes).
pub(super) fn spawn_liveness(rm: Arc<Shared>, agents: Arc<AgentNodes>, expiry: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_millis(500));
        loop {
            every.tick().await;
            for host in agents.expire(Instant::now(), expiry) {
                rm.reserved_peers.remove(&host);
                let ended = transactions::set_node_state(&mut rm.lock(), &host, NodeState::Lost).unwrap_or_default();
                tracing::warn!(%host, containers = ended.len(), "node agent silent for {expiry:?}: LOST");
            }
        }
    })
}

/// The agents and the host whose agent token the caller presents; `claimed` (the host the
/// request is about) must be that host (Kubernetes' NodeRestriction: an agent acts for
/// its own node only).
fn node_agents(rm: &Shared, headers: &HeaderMap, claimed: &str) -> Result<Arc<AgentNodes>, ApiError> {
    let agents = rm.nodes.agents.clone().ok_or_else(|| {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "NO_NODE_AGENTS",
            "this RM accepts no node agents; start it with --nodes-file FILE (`gpuam node-token new` writes it)",
        )
    })?;
    let Some(host) = bearer(headers).and_then(|t| agents.host_of(t)) else {
        return Err(ApiError::unauthorized());
    };
    let fingerprint = agents.fingerprint(&host);
    if let Some(refused) = removal_refusal(&rm.lock(), &host, fingerprint.as_deref()) {
        return Err(refused);
    }
    if host != claimed {
        tracing::warn!(credential = %host, %claimed, "a node agent's credential used for another host: refused");
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "NOT_THIS_HOST",
            format!("this agent credential is host `{host}`'s, not `{claimed}`'s; each host has its own (`gpuam node-token new --host {claimed}`)"),
        ));
    }
    Ok(agents)
}

/// `Some(403)` when `host` was removed for good and `fingerprint` is the credential it
/// had then: refused until the operator issues the host a new one.
fn removal_refusal(st: &RmState, host: &str, fingerprint: Option<&str>) -> Option<ApiError> {
    let removed = st.removed_hosts.get(host)?;
    if removed.credential.is_none() || removed.credential.as_deref() != fingerprint {
        return None;
    }
    tracing::warn!(%host, "the agent of a removed host called: refused");
    Some(ApiError::new(
        StatusCode::FORBIDDEN,
        "HOST_REMOVED",
        format!(
            "host `{host}` was removed by an administrator; its agent credential is refused. To bring the \
             machine back, issue it a new one (`gpuam node-token new --host {host} --nodes-file FILE`) and restart \
             its agent with it"
        ),
    ))
}

/// The node an agent's registration describes (AMs reach its containers through this
/// RM at `base_url`; their peers at the node's own IP). The one place a registration
/// becomes a node: at registration and when a restarted RM reads its stored declaration.
fn node_of(req: &AgentRegister, base_url: &str) -> Result<Node, String> {
    if !crate::node::executor::valid_container_id(&req.host) {
        return Err(format!(
            "host `{}` is not a valid host name (use A-Z, a-z, 0-9, `_`, `.`, `-`)",
            req.host
        ));
    }
    check_declared_text(req)?;
    let topology = crate::topology::Topology::from_spec(&req.topology).map_err(|e| format!("topology: {e}"))?;
    let ip = req
        .ip
        .map(crate::node::wire::check_node_ip)
        .transpose()
        .map_err(|e| format!("ip: {e}"))?;
    let mut node = Node::new(req.host.clone(), req.rack.clone(), req.total.clone());
    node.labels = req.labels.clone();
    node.gpu_type = req.gpu_type.clone();
    node.topology = topology.map(Arc::new);
    node.http_address = base_url.to_string();
    node.ip = ip;
    Ok(node)
}

/// Longest containment line an agent may declare.
const MAX_CONTAINMENT_BYTES: usize = 1024;
/// Longest topology an agent may declare (`nvidia-smi topo -m` of a large node).
const MAX_TOPOLOGY_BYTES: usize = 64 * 1024;

/// The text fields of a registration (shown to every user by `gpuam plan`, `gpuam
/// nodes`, the dashboard, and logged) under the cluster file's rules
/// (`spec::validate`): rack, labels and GPU type in their name syntax, containment and
/// topology free of control characters. The error names the field and its fix.
fn check_declared_text(req: &AgentRegister) -> Result<(), String> {
    use crate::spec::validate::{check_gpu_type, check_node_label, check_node_text, check_rack};
    let named = |field: &str, (m, f): (String, String)| format!("{field}: {m}; {f}");
    check_rack(&req.rack).map_err(|p| named("rack", p))?;
    for (i, label) in req.labels.iter().enumerate() {
        check_node_label(label).map_err(|p| named(&format!("labels[{i}]"), p))?;
    }
    if let Some(t) = &req.gpu_type {
        check_gpu_type(t).map_err(|p| named("gpuType", p))?;
    }
    check_node_text(&req.containment, false, MAX_CONTAINMENT_BYTES).map_err(|p| named("containment", p))?;
    check_node_text(&req.topology, true, MAX_TOPOLOGY_BYTES).map_err(|p| named("topology", p))
}

/// A stored agent declaration (see [`declaration_of`]) as a node, for a restarted RM.
pub(super) fn declared_node(doc: &str, base_url: &str) -> Result<Node, String> {
    let req: AgentRegister = serde_json::from_str(doc).map_err(|e| e.to_string())?;
    node_of(&req, base_url)
}

/// What the RM keeps of a registration: the node it declares, without its containers.
fn declaration_of(req: &AgentRegister) -> Result<String, String> {
    let decl = AgentRegister {
        containers: Vec::new(),
        instance: String::new(),
        ..req.clone()
    };
    serde_json::to_string(&decl).map_err(|e| e.to_string())
}

/// After an RM restart: the agent hosts restored NEW wait for their agents until
/// `deadline`; then the liveness loop makes them LOST (LOST's rules: their containers end
/// for their applications and stay held until the host reports them dead). Without node
/// agents at all they are LOST at once.
pub(super) fn await_agents(rm: &Shared, deadline: Instant) {
    let mut st = rm.lock();
    let waiting: Vec<String> = st
        .agent_nodes
        .keys()
        .filter(|h| st.ledger.node(h).is_some_and(|n| n.state == NodeState::New))
        .cloned()
        .collect();
    for host in waiting {
        match &rm.nodes.agents {
            Some(agents) => {
                agents.expect(&host, deadline);
                tracing::info!(%host, "waiting for the node agent to register again after the RM restart");
            }
            None => {
                transactions::set_node_state(&mut st, &host, NodeState::Lost);
                tracing::warn!(%host, "a node agent's host, and this RM takes no node agents: LOST");
            }
        }
    }
}

/// A live agent's host `host` called from `peer` with its credential: that address
/// takes the listener's reserved pool from now on, until the host is LOST or removed
/// (audit 5 F4). Its TCP peer, not the address it declares: only where its connections
/// really come from is worth a reserved place.
fn reserve(rm: &Shared, host: &str, peer: Option<Extension<PeerAddr>>) {
    if let Some(Extension(PeerAddr(addr))) = peer {
        rm.reserved_peers.set(host, addr.ip());
    }
}

/// `POST /ws/v1/node-agents/register`: (re-)adds the node, reconciles its containers.
pub(super) async fn agent_register(
    State(rm): Rm,
    peer: Option<Extension<PeerAddr>>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<AgentRegister>,
) -> Result<Json<AgentReply>, ApiError> {
    let agents = node_agents(&rm, &headers, &req.host)?;
    crate::node::wire::check_agent_address(&req.http_address)
        .map_err(|e| ApiError::bad_request(format!("httpAddress: {e}")))?;
    let node = node_of(&req, &rm.base_url).map_err(ApiError::bad_request)?;
    let decl = declaration_of(&req).map_err(ApiError::bad_request)?;
    let host = req.host.clone();
    let fingerprint = agents.fingerprint(&host);
    let (reply, own, taken) = {
        let mut st = rm.lock();
        // Checked again under the lock: a removal may have come since `node_agents`.
        if let Some(refused) = removal_refusal(&st, &host, fingerprint.as_deref()) {
            return Err(refused);
        }
        let (new, mut reply, own) = match transactions::agent_registered(&mut st, node, decl, &req)? {
            Registration::StopFirst(reply) => return Ok(Json(reply)),
            Registration::Joined { new, reply, own } => (new, reply, own),
        };
        let taken = take_deaths(&mut st, &host, &own, &mut reply);
        agents.register(&host, &req.http_address, &req.instance, Instant::now());
        reserve(&rm, &host, peer);
        reply.host_key = agents.host_key_hex(&host);
        tracing::info!(
            %host,
            address = %req.http_address,
            ip = ?req.ip,
            new,
            reported = req.containers.len(),
            stop = reply.stop.len(),
            "node agent registered ({})",
            req.containment
        );
        (reply, own, taken)
    };
    agents.heartbeat(&host, &own, Instant::now());
    for id in taken {
        super::logs::spawn_collect(&rm, id);
    }
    Ok(Json(reply))
}

/// `POST /ws/v1/node-agents/{host}/heartbeat`.
pub(super) async fn agent_heartbeat(
    State(rm): Rm,
    UrlPath(host): UrlPath<String>,
    peer: Option<Extension<PeerAddr>>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<AgentHeartbeat>,
) -> Result<Json<AgentReply>, ApiError> {
    let agents = node_agents(&rm, &headers, &host)?;
    let own = transactions::own_reports(&rm.lock(), &host, &req.containers);
    if !agents.heartbeat(&host, &own, Instant::now()) {
        return Ok(Json(AgentReply {
            reregister: true,
            ..Default::default()
        }));
    }
    reserve(&rm, &host, peer);
    let (reply, taken) = {
        let mut st = rm.lock();
        let mut reply = transactions::agent_heartbeat(&mut st, &host, &own);
        let taken = take_deaths(&mut st, &host, &own, &mut reply);
        (reply, taken)
    };
    for id in taken {
        super::logs::spawn_collect(&rm, id);
    }
    Ok(Json(reply))
}

/// What changed between a host's stored declaration and a new registration in what it
/// offers (resources, labels, GPU type, rack, topology); `None` when nothing did (its
/// address and IP may change).
pub(super) fn declaration_change(stored: &str, new: &AgentRegister) -> Option<String> {
    let old: AgentRegister = serde_json::from_str(stored).ok()?;
    let mut changed = Vec::new();
    if old.total != new.total {
        let r = |r: &crate::resources::Resources| {
            format!(
                "cpu {}, memoryMB {}, GPU mask {:#x}, ports {}",
                r.cpu, r.memory_mb, r.gpu_mask, r.ports
            )
        };
        changed.push(format!("resources ({}) → ({})", r(&old.total), r(&new.total)));
    }
    if old.labels != new.labels {
        changed.push(format!("labels {:?} → {:?}", old.labels, new.labels));
    }
    if old.gpu_type != new.gpu_type {
        changed.push(format!("GPU type {:?} → {:?}", old.gpu_type, new.gpu_type));
    }
    if old.rack != new.rack {
        changed.push(format!("rack {} → {}", old.rack, new.rack));
    }
    if old.topology != new.topology {
        changed.push("topology".to_string());
    }
    (!changed.is_empty()).then(|| changed.join(", "))
}

/// `DELETE /ws/v1/cluster/nodes/{host}` query.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RemoveQuery {
    #[serde(default)]
    force: bool,
}

/// Admin: `DELETE /ws/v1/cluster/nodes/{host}[?force=true]` — takes a node agent's host
/// out for good (`gpuam node remove HOST`). The host leaves the node view (AMs that saw
/// it hear it DECOMMISSIONED); its stored declaration and state go; whatever it still
/// holds is freed once: containers already ended (a LOST host's) free nothing twice,
/// containers still running for their jobs need `force` (409 without) and then end as on
/// a lost host (-100: their jobs retry elsewhere) and are told to stop. The removal is
/// stored (it survives an RM restart) with a fingerprint of the host's credential, which
/// is refused (403 `HOST_REMOVED`) until the operator issues the host a new one (`gpuam
/// node-token new --host HOST`); with it the host registers again as a new, empty node.
/// Hosts of the cluster file are refused (409): they come back with the file. A user's
/// token gets 403, no token 401, an unknown host 404.
pub(super) async fn delete_node(
    State(rm): Rm,
    UrlPath(nodeid): UrlPath<String>,
    Query(q): Query<RemoveQuery>,
    caller: Caller,
) -> Result<Json<Value>, ApiError> {
    if !caller.is_admin() {
        return Err(ApiError::forbidden(format!(
            "removing a host is the admin's call; `{}` is not the admin",
            caller.name()
        )));
    }
    let (host, ended, refused) = {
        let mut st = rm.lock();
        let host = known_host(&st, &nodeid)?;
        let fingerprint = rm.nodes.agents.as_ref().and_then(|a| a.fingerprint(&host));
        let refused = fingerprint.is_some();
        let ended = transactions::remove_host(&mut st, &host, q.force, fingerprint, now_ms())?;
        (host, ended, refused)
    };
    tracing::warn!(%host, containers = ended.len(), "host removed by an administrator");
    // Told to stop while the RM still knows the agent's address; then forgotten.
    stop_running(&rm, &ended).await;
    rm.reserved_peers.remove(&host);
    if let Some(a) = &rm.nodes.agents {
        a.forget(&host);
    }
    Ok(Json(json!({
        "removed": host,
        "containersEnded": ended.iter().map(|e| e.container_id.as_str()).collect::<Vec<_>>(),
        "credentialRefused": refused,
    })))
}

#[cfg(test)]
mod tests {
    use super::super::*;
    use super::*;
    use crate::am::rm_client::RmClient;
    use crate::protocol::{exit_status, AllocateRequest};
    use crate::resources::{PortSet, Resources};
    use crate::rm::users::{add_token_to, Table};

    /// An RM with cluster-file node `n1`, the nodes file `nodes.yaml` (agents) and user
    /// `alice`, keeping its state in `dir/work`.
    fn options(dir: &Path) -> RmOptions {
        let n1 = Node::new("n1", "/r", Resources::with_mask(4, 1000, 0x3, PortSet::new()));
        let mut users = Users::default();
        users.insert_token("alice", "alice-token").unwrap();
        RmOptions {
            launch_am: false,
            nodes_file: Some(dir.join("nodes.yaml")),
            users,
            ..RmOptions::new(vec![n1], "127.0.0.1:0".parse().unwrap(), dir.join("work"))
        }
    }

    /// `method path` with bearer `token` and a `{}` JSON body → (status, JSON answer).
    /// An agent's registration with `token`.
    async fn register(rm: &RmHandle, token: &str, body: Value) -> (u16, Value) {
        call(rm, reqwest::Method::POST, "/ws/v1/node-agents/register", token, body).await
    }

    async fn call(rm: &RmHandle, method: reqwest::Method, path: &str, token: &str, body: Value) -> (u16, Value) {
        let r = reqwest::Client::new()
            .request(method, format!("{}{path}", rm.base_url()))
            .bearer_auth(token)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    fn registration(host: &str) -> Value {
        json!({
            "host": host, "rack": "/r",
            "total": {"cpu": 4, "memoryMB": 1000, "gpus": 2, "gpuMask": 3, "ports": ""},
            "httpAddress": "http://127.0.0.1:9",
        })
    }

    async fn hosts(rm: &RmHandle) -> Vec<String> {
        let (_, v) = call(rm, reqwest::Method::GET, "/ws/v1/cluster/nodes", "", Value::Null).await;
        let mut h: Vec<String> = v["nodes"]["node"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["nodeHostName"].as_str().unwrap().to_string())
            .collect();
        h.sort();
        h
    }

    /// Audit 5 F5: a registration whose rack, labels, GPU type, containment or topology
    /// hold a control character (a terminal escape sequence) is refused with 400 naming
    /// the field and the fix, and the host does not join; a clean one then registers.
    #[tokio::test]
    async fn a_registration_with_control_characters_in_its_text_is_refused_naming_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let nodes_file = dir.path().join("nodes.yaml");
        let t = add_token_to(&nodes_file, "e1", Table::Nodes).unwrap();
        let rm = start(options(dir.path())).await.unwrap();
        let esc = "\u{1b}]0;PWNED\u{7}\u{1b}[2J\u{1b}[HYour session expired\n";
        let cases = [
            ("rack", json!(format!("/r{esc}")), "rack"),
            ("labels", json!(["ok", format!("\u{1b}[31mred")]), "labels[1]"),
            ("gpuType", json!(format!("V100{esc}")), "gpuType"),
            ("containment", json!(format!("x{esc}")), "containment"),
            ("topology", json!(format!("none\u{1b}[2J")), "topology"),
        ];
        for (field, value, named) in cases {
            let mut body = registration("e1");
            body[field] = value;
            let (code, v) = register(&rm, &t, body).await;
            let msg = v["message"].as_str().unwrap_or_default();
            assert_eq!(code, 400, "{field}: {v}");
            assert!(msg.starts_with(&format!("{named}: ")), "{field}: {msg}");
            assert!(!msg.contains('\u{1b}'), "the refusal does not echo the escape: {msg}");
            assert!(
                !hosts(&rm).await.contains(&"e1".to_string()),
                "{field}: the host did not join"
            );
        }
        let mut body = registration("e1");
        body["labels"] = json!(["gpu", "fast"]);
        body["gpuType"] = json!("A100-80GB");
        body["containment"] = json!("containment: cgroup v2 under /sys/fs/cgroup/gpuam; limits: memory (v2)");
        let (code, v) = register(&rm, &t, body).await;
        assert_eq!(code, 200, "{v}");
        rm.shutdown().await;
    }

    /// Who may remove what: 401 without a token, 403 for a user, 404 for an unknown host,
    /// 409 for a cluster-file host and for a host with a running container (unless
    /// forced: then it ends as on a lost host, and its application hears it); a removed
    /// host is gone from the view, its credential refused (also after a restart), and a
    /// new credential re-admits it as an empty node.
    #[tokio::test]
    async fn a_removed_host_is_gone_for_good_until_a_new_credential_re_admits_it() {
        let dir = tempfile::tempdir().unwrap();
        let nodes_file = dir.path().join("nodes.yaml");
        let t1 = add_token_to(&nodes_file, "a1", Table::Nodes).unwrap();
        let t2 = add_token_to(&nodes_file, "a2", Table::Nodes).unwrap();
        let opts = options(dir.path());
        let rm = start(opts.clone()).await.unwrap();
        let admin = rm.admin_token().to_string();
        for (host, t) in [("a1", &t1), ("a2", &t2)] {
            let (code, v) = register(&rm, t, registration(host)).await;
            assert_eq!(code, 200, "{v}");
        }
        assert_eq!(hosts(&rm).await, ["a1", "a2", "n1"]);
        let del = |host: &str| format!("/ws/v1/cluster/nodes/{host}");
        let delete = reqwest::Method::DELETE;
        assert_eq!(call(&rm, delete.clone(), &del("a1"), "", json!({})).await.0, 401);
        let (code, v) = call(&rm, delete.clone(), &del("a1"), "alice-token", json!({})).await;
        assert_eq!(code, 403, "{v}");
        assert_eq!(
            call(&rm, delete.clone(), &del("nowhere"), &admin, json!({})).await.0,
            404
        );
        let (code, v) = call(&rm, delete.clone(), &del("n1"), &admin, json!({})).await;
        assert!(
            code == 409 && v["message"].as_str().unwrap().contains("cluster file"),
            "{v}"
        );

        // A container running on a2: refused without force.
        let (am, cid, _) = running_on(&rm, "a2").await;
        let (code, v) = call(&rm, delete.clone(), &del("a2"), &admin, json!({})).await;
        assert!(code == 409 && v["message"].as_str().unwrap().contains("--force"), "{v}");
        assert_eq!(hosts(&rm).await, ["a1", "a2", "n1"], "nothing changed");
        let (code, v) = call(
            &rm,
            delete.clone(),
            &format!("{}?force=true", del("a2")),
            &admin,
            json!({}),
        )
        .await;
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["containersEnded"], json!([cid]));
        let answer = am
            .allocate(&AllocateRequest {
                response_id: 1,
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(answer.completed.len(), 1, "{answer:?}");
        assert_eq!(answer.completed[0].exit_status, exit_status::ABORTED);
        assert_eq!(
            crate::protocol::AbortCause::of(&answer.completed[0].diagnostics),
            Some(crate::protocol::AbortCause::NodeLost)
        );
        assert!(
            answer
                .updated_nodes
                .iter()
                .any(|r| r.node.host == "a2" && r.node.state == NodeState::Decommissioned),
            "the AM hears the host is gone: {answer:?}"
        );
        // a1 (no containers) goes without force; both agents are refused from now on.
        assert_eq!(call(&rm, delete.clone(), &del("a1"), &admin, json!({})).await.0, 200);
        assert_eq!(call(&rm, delete.clone(), &del("a1"), &admin, json!({})).await.0, 404);
        assert_eq!(hosts(&rm).await, ["n1"]);
        for (host, t) in [("a1", &t1), ("a2", &t2)] {
            let (code, v) = register(&rm, t, registration(host)).await;
            assert!(code == 403 && v["code"] == "HOST_REMOVED", "{v}");
            let hb = format!("/ws/v1/node-agents/{host}/heartbeat");
            let (code, v) = call(&rm, reqwest::Method::POST, &hb, t, json!({"containers": []})).await;
            assert!(code == 403 && v["code"] == "HOST_REMOVED", "{v}");
        }
        rm.audit_usage().unwrap();

        // After a restart: still gone, still refused.
        let addr = rm.addr();
        rm.shutdown().await;
        let rm = super::super::tests::restart_on(addr, &opts).await;
        assert_eq!(hosts(&rm).await, ["n1"]);
        let (code, v) = register(&rm, &t1, registration("a1")).await;
        assert!(code == 403 && v["code"] == "HOST_REMOVED", "{v}");
        // Re-admitted with a new credential: an empty node again (the RM reloads the file).
        let t1 = add_token_to(&nodes_file, "a1", Table::Nodes).unwrap();
        let mut answered = 0;
        for _ in 0..100 {
            let (code, _) = register(&rm, &t1, registration("a1")).await;
            answered = code;
            if code == 200 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(answered, 200);
        assert_eq!(hosts(&rm).await, ["a1", "n1"]);
        assert!(!rm.shared.lock().removed_hosts.contains_key("a1"));
        assert!(rm.shared.lock().removed_hosts.contains_key("a2"));
        rm.audit_usage().unwrap();
        rm.shutdown().await;
    }

    /// An RM (its directory kept until the test ends) with node agents `hosts` registered,
    /// and their tokens.
    async fn agents_registered(hosts: &[&str]) -> (tempfile::TempDir, RmHandle, Vec<String>) {
        let dir = tempfile::tempdir().unwrap();
        let nodes_file = dir.path().join("nodes.yaml");
        let tokens: Vec<String> = hosts
            .iter()
            .map(|h| add_token_to(&nodes_file, h, Table::Nodes).unwrap())
            .collect();
        let rm = start(options(dir.path())).await.unwrap();
        for (host, t) in hosts.iter().zip(&tokens) {
            let (code, v) = register(&rm, t, registration(host)).await;
            assert_eq!(code, 200, "{v}");
        }
        (dir, rm, tokens)
    }

    /// A job's AM and a container granted to it on `host`, marked running: (the AM's
    /// client, the container, the allocate answer's response id).
    async fn running_on(rm: &RmHandle, host: &str) -> (RmClient, String, u64) {
        let (id, token) = rm.register_test_app("job");
        let am = RmClient::for_app(&rm.base_url(), &id, &token);
        am.register(&Default::default()).await.unwrap();
        let granted = am
            .allocate(&AllocateRequest {
                asks: vec![crate::protocol::Ask {
                    request_id: 1,
                    host: host.into(),
                    cpu: 1,
                    memory_mb: 10,
                    gpu_mask: 0x1,
                    ..Default::default()
                }],
                ..Default::default()
            })
            .await
            .unwrap();
        let cid = granted.allocated[0].container_id.clone();
        rm.shared.lock().ledger.mark_running(&cid).unwrap();
        (am, cid, granted.response_id)
    }

    /// The containers the AM's next allocate answer (after `response_id`) reports ended.
    async fn completed_after(am: &RmClient, response_id: u64) -> Vec<crate::protocol::CompletedContainer> {
        let answer = am
            .allocate(&AllocateRequest {
                response_id,
                ..Default::default()
            })
            .await
            .unwrap();
        answer.completed
    }

    /// A peer agent never ends another host's container: agent a2 (its own valid
    /// credential) reports a1's running container dead. Through its heartbeat the report is
    /// dropped; and a report that got past that filter (the race: the id unknown when it was
    /// filtered, granted on a1 since) is refused by the transaction that would end the
    /// container. a1's own report ends it with a1's exit status.
    #[tokio::test]
    async fn a_peer_agent_s_exit_report_never_ends_another_host_s_container() {
        let (_dir, rm, tokens) = agents_registered(&["a1", "a2"]).await;
        let (t1, t2) = (&tokens[0], &tokens[1]);
        let (am, cid, response_id) = running_on(&rm, "a1").await;
        let dead = |exit: i32, why: &str| crate::node::wire::ContainerReport {
            container_id: cid.clone(),
            state: ContainerState::Complete,
            exit_status: Some(exit),
            diagnostics: why.into(),
            cause: None,
        };
        let beat = |host: &str| format!("/ws/v1/node-agents/{host}/heartbeat");
        let post = reqwest::Method::POST;
        let forged = json!({ "containers": [dead(0, "forged by a2")] });
        let (code, v) = call(&rm, post.clone(), &beat("a2"), t2, forged).await;
        assert_eq!(code, 200, "{v}");
        let acknowledged = v["acknowledged"].as_array().cloned().unwrap_or_default();
        assert!(!acknowledged.contains(&json!(cid)), "a2's forgery is not taken: {v}");
        // The race window: a2's report past the heartbeat's filter (taken under another
        // lock), as if the id had been unknown then.
        let mut reply = AgentReply::default();
        let taken = take_deaths(&mut rm.shared.lock(), "a2", &[dead(0, "forged by a2")], &mut reply);
        assert!(taken.is_empty(), "refused in the transaction: {taken:?}");
        let state = rm.shared.lock().ledger.container(&cid).map(|c| (c.state, c.held));
        assert_eq!(state, Some((ContainerState::Running, false)), "a1's container runs on");
        // a1's own report ends it: the AM hears a1's status.
        let real = json!({ "containers": [dead(137, "killed on a1")] });
        let (code, v) = call(&rm, post, &beat("a1"), t1, real).await;
        assert_eq!(code, 200, "{v}");
        // Taken in the heartbeat's transaction: the AM's next answer has it.
        let completed = completed_after(&am, response_id).await;
        assert_eq!(completed.len(), 1, "{completed:?}");
        assert_eq!(completed[0].container_id, cid);
        assert_eq!(completed[0].exit_status, 137, "a1's report, not a2's: {completed:?}");
        assert!(completed[0].diagnostics.contains("killed on a1"), "{completed:?}");
        rm.audit_usage().unwrap();
        rm.shutdown().await;
    }

    /// An agent's death report is stored before the answer acknowledges it (the agent
    /// forgets what is acknowledged): while the store fails, the death is not acknowledged
    /// and the agent keeps reporting it; once the store works, the answer that acknowledges
    /// it comes after its commit, and the AM hears the agent's exit status.
    #[tokio::test]
    async fn an_agent_s_death_report_is_stored_before_it_is_acknowledged() {
        let (_dir, rm, tokens) = agents_registered(&["a1"]).await;
        let t1 = tokens[0].clone();
        let (am, cid, response_id) = running_on(&rm, "a1").await;
        let dead = json!({ "containers": [crate::node::wire::ContainerReport {
            container_id: cid.clone(),
            state: ContainerState::Complete,
            exit_status: Some(3),
            diagnostics: "exited 3".into(),
            cause: None,
        }] });
        let beat = |rm: &RmHandle| {
            let (rm_url, t1, dead) = (rm.base_url(), t1.clone(), dead.clone());
            async move {
                let r = reqwest::Client::new()
                    .post(format!("{rm_url}/ws/v1/node-agents/a1/heartbeat"))
                    .bearer_auth(t1)
                    .json(&dead)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status().as_u16(), 200);
                r.json::<AgentReply>().await.unwrap()
            }
        };
        // The store fails (its next whole write not due yet): nothing is acknowledged.
        {
            let mut st = rm.shared.lock();
            st.store_health.failing = Some("disk full (test)".into());
            st.store_health.last_whole_attempt = Some(Instant::now() + Duration::from_secs(3600));
        }
        let reply = beat(&rm).await;
        assert!(
            !reply.acknowledged.contains(&cid),
            "acknowledged while not stored: {reply:?}"
        );
        // The store works again: the report made again is acknowledged, and stored by then.
        {
            let mut st = rm.shared.lock();
            st.store_health.failing = None;
            st.store_health.last_whole_attempt = None;
        }
        let reply = beat(&rm).await;
        assert_eq!(reply.acknowledged, vec![cid.clone()]);
        {
            let st = rm.shared.lock();
            let c = st.ledger.container(&cid).map(|c| (c.state, c.held));
            assert_eq!(c, Some((ContainerState::Complete, false)));
            assert!(
                !st.ledger.has_changes() && !st.apps.has_changes(),
                "committed before the answer"
            );
        }
        let completed = completed_after(&am, response_id).await;
        assert_eq!(completed.len(), 1, "{completed:?}");
        assert_eq!(
            (completed[0].exit_status, completed[0].diagnostics.as_str()),
            (3, "exited 3")
        );
        rm.audit_usage().unwrap();
        rm.shutdown().await;
    }

    /// A re-admitted host that still runs containers of before its removal is told to
    /// stop them and to register again; it joins once it reports none.
    #[tokio::test]
    async fn a_re_admitted_host_joins_only_once_its_old_containers_are_gone() {
        let dir = tempfile::tempdir().unwrap();
        let nodes_file = dir.path().join("nodes.yaml");
        let t = add_token_to(&nodes_file, "a1", Table::Nodes).unwrap();
        let rm = start(options(dir.path())).await.unwrap();
        let register_a1 = |t: String, running: bool| {
            let rm = &rm;
            async move {
                let mut body = registration("a1");
                if running {
                    body["containers"] = json!([{"containerId": "container_1_0001_01_000009", "state": "RUNNING"}]);
                }
                register(rm, &t, body).await
            }
        };
        assert_eq!(register_a1(t.clone(), false).await.0, 200);
        let admin = rm.admin_token().to_string();
        let (code, _) = call(
            &rm,
            reqwest::Method::DELETE,
            "/ws/v1/cluster/nodes/a1",
            &admin,
            json!({}),
        )
        .await;
        assert_eq!(code, 200);
        let t = add_token_to(&nodes_file, "a1", Table::Nodes).unwrap();
        // Until the RM reloads the nodes file the new token is unknown (401).
        let mut answer = (0, Value::Null);
        for _ in 0..100 {
            answer = register_a1(t.clone(), true).await;
            if answer.0 != 401 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (code, v) = answer;
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["reregister"], true, "{v}");
        assert_eq!(v["stop"], json!(["container_1_0001_01_000009"]));
        assert_eq!(hosts(&rm).await, ["n1"], "not joined yet");
        let (code, v) = register_a1(t, false).await;
        assert!(code == 200 && v["reregister"] != true, "{v}");
        assert_eq!(hosts(&rm).await, ["a1", "n1"]);
        rm.shutdown().await;
    }
}
