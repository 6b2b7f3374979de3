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
    pub(crate) ray: Option<Arc<crate::ray::launcher::RayLauncher>>,
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

fn node_agents(rm: &Shared, headers: &HeaderMap) -> Result<Arc<AgentNodes>, ApiError> {
    let agents = rm.nodes.agents.clone().ok_or_else(|| {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "NO_NODE_AGENTS",
            "this RM accepts no node agents; start it with --node-token-file FILE",
        )
    })?;
    match bearer(headers) {
        Some(t) if agents.is_node_token(t) => Ok(agents),
        _ => Err(ApiError::unauthorized()),
    }
}

/// `POST /ws/v1/node-agents/register`: (re-)adds the node, reconciles its containers.
pub(super) async fn agent_register(
    State(rm): Rm,
    headers: HeaderMap,
    ApiJson(req): ApiJson<AgentRegister>,
) -> Result<Json<AgentReply>, ApiError> {
    let agents = node_agents(&rm, &headers)?;
    if !crate::node::executor::valid_container_id(&req.host) {
        return Err(ApiError::bad_request(format!(
            "host `{}` is not a valid host name (use A-Z, a-z, 0-9, `_`, `.`, `-`)",
            req.host
        )));
    }
    let topology = crate::topology::Topology::from_spec(&req.topology)
        .map_err(|e| ApiError::bad_request(format!("topology: {e}")))?;
    let ip = req
        .ip
        .map(crate::node::wire::check_node_ip)
        .transpose()
        .map_err(|e| ApiError::bad_request(format!("ip: {e}")))?;
    let mut node = Node::new(req.host.clone(), req.rack.clone(), req.total.clone());
    node.labels = req.labels.clone();
    node.gpu_type = req.gpu_type.clone();
    node.topology = topology.map(Arc::new);
    // AMs reach every container through this RM (which checks their grants); the
    // containers' peers reach them at the node's own IP.
    node.http_address = rm.base_url.clone();
    node.ip = ip;
    let host = req.host.clone();
    let reply = {
        let mut st = rm.lock();
        let new = st.ledger.add_node(node);
        agents.register(&host, &req.http_address, Instant::now());
        let reply = reconcile(&mut st, &host, &req.containers, true);
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
        reply
    };
    // Dead ones reported at registration free their resources now.
    agents.heartbeat(&host, &req.containers, Instant::now());
    Ok(Json(reply))
}

/// `POST /ws/v1/node-agents/{host}/heartbeat`.
pub(super) async fn agent_heartbeat(
    State(rm): Rm,
    UrlPath(host): UrlPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<AgentHeartbeat>,
) -> Result<Json<AgentReply>, ApiError> {
    let agents = node_agents(&rm, &headers)?;
    if !agents.heartbeat(&host, &req.containers, Instant::now()) {
        return Ok(Json(AgentReply {
            reregister: true,
            ..Default::default()
        }));
    }
    let mut st = rm.lock();
    let reply = reconcile(&mut st, &host, &req.containers, false);
    st.commit_or_log();
    Ok(Json(reply))
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
