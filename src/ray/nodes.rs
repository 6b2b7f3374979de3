//! The node view built from Ray: which gpuam nodes a Ray cluster offers, and their state.
//!
//! Owns reading `GET /api/v0/nodes?detail=true` into gpuam [`Node`]s (through the naming
//! scheme of `scheme.rs`) and the watch loop that turns Ray's node states into RM node states
//! (ALIVE → RUNNING, DEAD → LOST). Ray's view of what is free lags by seconds, so it is never
//! used for placement: the RM's ledger is the truth for what gpuam granted, and Ray's own
//! resource accounting (each job holds its GPUs' resources) is the second, independent guard.

use std::collections::BTreeMap;
use std::time::Duration;

use super::client::RayClient;
use super::scheme::{merge_by_host, node_from_ray};
use crate::cluster::{Node, NodeState};

/// How often the node watch reads Ray's node list.
pub const NODE_POLL: Duration = Duration::from_secs(2);

/// The gpuam nodes of the Ray cluster (one per `gpuam-node-<host>`), ordered by host.
/// Ray nodes without gpuam resources are skipped; a gpuam node whose labels cannot be read
/// is an error naming it.
pub async fn read_nodes(client: &RayClient) -> Result<Vec<Node>, String> {
    let ray_nodes = client.nodes().await.map_err(|e| e.to_string())?;
    merge_by_host(&ray_nodes)
        .values()
        .filter_map(|r| node_from_ray(r))
        .collect()
}

/// The state of each gpuam host now (ALIVE → RUNNING, else LOST).
pub async fn read_states(client: &RayClient) -> Result<BTreeMap<String, NodeState>, String> {
    let ray_nodes = client.nodes().await.map_err(|e| e.to_string())?;
    Ok(merge_by_host(&ray_nodes)
        .into_iter()
        .map(|(h, r)| {
            (
                h,
                if r.is_alive() {
                    NodeState::Running
                } else {
                    NodeState::Lost
                },
            )
        })
        .collect())
}

/// Which hosts changed state between two readings (hosts only in `now` are new nodes,
/// which the RM does not take while running: they are reported separately by the caller).
pub fn changes(before: &BTreeMap<String, NodeState>, now: &BTreeMap<String, NodeState>) -> Vec<(String, NodeState)> {
    now.iter()
        .filter(|(h, s)| before.get(*h).is_some_and(|b| b != *s))
        .map(|(h, s)| (h.clone(), *s))
        .collect()
}

/// Watches Ray's nodes forever, calling `apply(host, state)` for every state change of a
/// host known at start (`initial`). Unreachable Ray: logged, nothing changes.
pub async fn watch<F, Fut>(client: RayClient, initial: BTreeMap<String, NodeState>, mut apply: F)
where
    F: FnMut(String, NodeState) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut known = initial;
    let mut every = tokio::time::interval(NODE_POLL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let now = match read_states(&client).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("cannot read Ray's nodes: {e}");
                continue;
            }
        };
        for h in now.keys().filter(|h| !known.contains_key(*h)) {
            tracing::warn!(host = %h, "a new gpuam node joined the Ray cluster; restart the RM to use it");
        }
        for (host, state) in changes(&known, &now) {
            tracing::warn!(%host, ?state, "Ray node state changed");
            apply(host.clone(), state).await;
            known.insert(host, state);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_changed_known_hosts_are_reported() {
        let before = BTreeMap::from([
            ("a".to_string(), NodeState::Running),
            ("b".to_string(), NodeState::Running),
        ]);
        let now = BTreeMap::from([
            ("a".to_string(), NodeState::Lost),
            ("b".to_string(), NodeState::Running),
            ("c".to_string(), NodeState::Running),
        ]);
        assert_eq!(changes(&before, &now), vec![("a".to_string(), NodeState::Lost)]);
        assert_eq!(changes(&now, &before), vec![("a".to_string(), NodeState::Running)]);
    }
}
