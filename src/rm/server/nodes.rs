//! The RM's side of the node interface (DESIGN.md §9): which backend runs a host's
//! containers ([`Nodes`]), the node agents' registration and heartbeats with
//! frameworklauncher's reconciliation rules (unknown containers are killed, known ones
//! kept), and agent liveness (silent for `rm.node_expiry_sec` → LOST).
//!
//! Freed only when dead: every path that ends a running container goes through
//! `Ledger::stop` (held) and frees it in `Ledger::complete` when its node reports it dead
//! ([`on_node_event`]). A LOST agent's containers stay held until it returns and reports
//! them dead or gone.

use std::collections::BTreeSet;

use super::*;
use crate::node::remote::AgentNodes;
use crate::node::wire::{AgentHeartbeat, AgentRegister, AgentReply, ContainerReport};
use crate::node::{InProcessNode, NodeBackend, NodeEvent};

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

/// A node says a container is dead: free it (and tell its application if it had not
/// heard yet).
pub(super) fn on_node_event(rm: &Shared, ev: NodeEvent) {
    let NodeEvent::Exited {
        container_id,
        exit_status,
        diagnostics,
    } = ev;
    let mut st = rm.lock();
    // A container under a preemption notice was preempted, however its task exited.
    let (exit_status, diagnostics) = scheduling::exit_of(&st, &container_id, exit_status, diagnostics);
    if let Some(ended) = st
        .ledger
        .complete(&container_id, exit_status, &crate::text::clean(&diagnostics))
    {
        queue_completed(&mut st.apps, &ended);
    }
    st.commit_or_log();
}

/// Marks silent agents LOST, every second: their containers end for their applications
/// (held: nothing is known of their processes).
pub(super) fn spawn_liveness(rm: Arc<Shared>, agents: Arc<AgentNodes>, expiry: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_millis(500));
        loop {
            every.tick().await;
            for host in agents.expire(Instant::now(), expiry) {
                let mut st = rm.lock();
                let ended = st.ledger.set_node_state(&host, NodeState::Lost).unwrap_or_default();
                for e in &ended {
                    queue_completed(&mut st.apps, e);
                }
                st.commit_or_log();
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

/// A stored agent declaration (see [`declaration_of`]) as a node, for a restarted RM.
pub(super) fn declared_node(doc: &str, base_url: &str) -> Result<Node, String> {
    let req: AgentRegister = serde_json::from_str(doc).map_err(|e| e.to_string())?;
    node_of(&req, base_url)
}

/// What the RM keeps of a registration: the node it declares, without its containers.
fn declaration_of(req: &AgentRegister) -> Result<String, String> {
    let decl = AgentRegister {
        containers: Vec::new(),
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
                let ended = st.ledger.set_node_state(&host, NodeState::Lost).unwrap_or_default();
                for e in &ended {
                    queue_completed(&mut st.apps, e);
                }
                tracing::warn!(%host, "a node agent's host, and this RM takes no node agents: LOST");
            }
        }
    }
    st.commit_or_log();
}

/// `POST /ws/v1/node-agents/register`: (re-)adds the node, reconciles its containers.
pub(super) async fn agent_register(
    State(rm): Rm,
    headers: HeaderMap,
    ApiJson(req): ApiJson<AgentRegister>,
) -> Result<Json<AgentReply>, ApiError> {
    let agents = node_agents(&rm, &headers, &req.host)?;
    let node = node_of(&req, &rm.base_url).map_err(ApiError::bad_request)?;
    let decl = declaration_of(&req).map_err(ApiError::bad_request)?;
    let host = req.host.clone();
    let (reply, own) = {
        let mut st = rm.lock();
        if let Some(why) = st.agent_nodes.get(&host).and_then(|old| declaration_change(old, &req)) {
            tracing::warn!(%host, "node agent registration refused: {why}");
            return Err(ApiError::conflict(format!(
                "host `{host}` registered before with other resources: {why}; what a host offers is fixed at \
                 its first registration: start its agent with the same resources, labels, GPU type, rack and \
                 topology, or register the changed machine under a new host name (with its own token)"
            )));
        }
        let own = own_reports(&st, &host, &req.containers);
        let new = st.ledger.add_node(node);
        if st.agent_nodes.get(&host) != Some(&decl) {
            st.agent_nodes.insert(host.clone(), decl);
            st.agent_nodes_dirty.insert(host.clone());
        }
        agents.register(&host, &req.http_address, Instant::now());
        let reply = reconcile(&mut st, &host, &own, true);
        st.commit_or_log();
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
        (reply, own)
    };
    // Dead ones reported at registration free their resources now.
    agents.heartbeat(&host, &own, Instant::now());
    Ok(Json(reply))
}

/// `POST /ws/v1/node-agents/{host}/heartbeat`.
pub(super) async fn agent_heartbeat(
    State(rm): Rm,
    UrlPath(host): UrlPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<AgentHeartbeat>,
) -> Result<Json<AgentReply>, ApiError> {
    let agents = node_agents(&rm, &headers, &host)?;
    let own = own_reports(&rm.lock(), &host, &req.containers);
    if !agents.heartbeat(&host, &own, Instant::now()) {
        return Ok(Json(AgentReply {
            reregister: true,
            ..Default::default()
        }));
    }
    let mut st = rm.lock();
    let reply = reconcile(&mut st, &host, &own, false);
    st.commit_or_log();
    Ok(Json(reply))
}

/// What of `reports` a host may report: containers the ledger places on `host`, or does
/// not know at all. Another host's container is dropped (a host cannot end, keep or
/// acknowledge what runs elsewhere).
fn own_reports(st: &RmState, host: &str, reports: &[ContainerReport]) -> Vec<ContainerReport> {
    reports
        .iter()
        .filter(|r| {
            let own = st
                .ledger
                .container(&r.container_id)
                .is_none_or(|c| c.container.host == host);
            if !own {
                tracing::warn!(%host, container = %r.container_id, "a node agent reported another host's container: ignored");
            }
            own
        })
        .cloned()
        .collect()
}

/// What changed between a host's stored declaration and a new registration in what it
/// offers (resources, labels, GPU type, rack, topology); `None` when nothing did (its
/// address and IP may change).
fn declaration_change(stored: &str, new: &AgentRegister) -> Option<String> {
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

/// frameworklauncher's rules for what a node reports: a running container the RM does
/// not know as running there is killed; dead ones are acknowledged (the heartbeat turns
/// them into `Exited` events). At registration, containers the RM holds or runs on the
/// host that the node does not report at all are gone: freed (and reported to their
/// applications when they had not ended yet).
fn reconcile(st: &mut RmState, host: &str, reports: &[ContainerReport], registering: bool) -> AgentReply {
    let mut reply = AgentReply {
        heartbeat_ms: 1000,
        ..Default::default()
    };
    let mut seen = BTreeSet::new();
    for r in reports {
        seen.insert(r.container_id.clone());
        if r.state == ContainerState::Complete {
            reply.acknowledged.push(r.container_id.clone());
            continue;
        }
        let wanted = st
            .ledger
            .container(&r.container_id)
            .is_some_and(|c| c.container.host == host && c.state == ContainerState::Running && !c.held);
        if !wanted {
            reply.stop.push(r.container_id.clone());
        }
    }
    if registering {
        let gone: Vec<String> = st
            .ledger
            .live_containers()
            .into_iter()
            .filter(|id| !seen.contains(id))
            .filter(|id| {
                st.ledger
                    .container(id)
                    .is_some_and(|c| c.container.host == host && (c.state == ContainerState::Running || c.held))
            })
            .collect();
        for id in gone {
            if let Some(e) = st.ledger.complete(
                &id,
                exit_status::ABORTED,
                "the node no longer knows this container (its agent restarted without it)",
            ) {
                queue_completed(&mut st.apps, &e);
            }
        }
    }
    reply
}
