//! The AM's publisher: turns the job machine's events into the status hub's updates (the
//! dashboard and status API observe the hub) and its metrics counters, and keeps which node
//! runs each container for reading logs. The machine does not know it exists.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde_json::json;

use super::driver::Observer;
use super::machine::Event;
use super::status::{ExitType, SelectionRecord, StatusHub, SELECTION_HISTORY};
use crate::resources::{mask_hex, mask_indices};
use crate::select::{Outcome, Selection};

/// container id → (executor address, host).
pub type ContainerAddrs = Arc<parking_lot::Mutex<HashMap<String, (String, String)>>>;

/// Publishes to one hub.
pub struct Publisher {
    pub hub: Arc<StatusHub>,
    pub addrs: ContainerAddrs,
}

impl Observer for Publisher {
    fn observe(&self, events: Vec<Event>) {
        for e in events {
            self.publish(e);
        }
    }
}

impl Publisher {
    fn publish(&self, e: Event) {
        let hub = &self.hub;
        match e {
            Event::Job {
                state,
                roles,
                completed,
                end,
                at_ms,
            } => hub.update("job", json!({"state": state}), |s| {
                s.job.state = state;
                s.job.roles = roles;
                s.job.completed_tasks = completed;
                if let Some(e) = end {
                    s.job.exit_code = Some(e.exit_code);
                    s.job.diagnostics = Some(e.diagnostics);
                    s.job.finished_ms = Some(at_ms);
                }
            }),
            Event::Tasks(statuses) => {
                let brief: Vec<_> = statuses
                    .iter()
                    .take(64)
                    .map(|(_, s)| json!({"role": s.role, "index": s.index, "state": s.state}))
                    .collect();
                hub.update("task", json!({"changed": statuses.len(), "tasks": brief}), |s| {
                    for (i, st) in statuses {
                        if i < s.tasks.len() {
                            s.tasks[i] = st;
                        }
                    }
                });
            }
            Event::Selection { repeated: true, .. } => {}
            Event::Selection {
                role,
                index,
                selection,
                at_ms,
                ..
            } => {
                {
                    let mut filtered = hub.counters.filtered_per_stage.lock();
                    for st in &selection.trace.stages {
                        *filtered.entry(st.stage).or_insert(0) +=
                            st.dropped.iter().map(|g| g.count as u64).sum::<u64>();
                    }
                }
                let record = selection_record(&role, index, &selection, at_ms);
                hub.update("selection", json!({"role": role, "index": index}), |s| {
                    s.selections.push_back(record);
                    while s.selections.len() > SELECTION_HISTORY {
                        s.selections.pop_front();
                    }
                });
            }
            // The pages are computed from the AM's view when asked (`am::node_page`); the
            // event tells the dashboard to ask again.
            Event::Nodes { count } => hub.update("nodes", json!({"count": count}), |_| {}),
            Event::NodesChanged(hosts) => hub.update("nodes", json!({"changed": hosts.len()}), |_| {}),
            Event::NodesRefreshed { at_ms } => hub.update("nodes", json!({"refreshed": true}), |s| {
                s.nodes_refreshed_ms = at_ms;
                s.rm_reachable = true;
            }),
            Event::RmReachable(r) => {
                if hub.read(|s| s.rm_reachable) != r {
                    hub.update("job", json!({"rmReachable": r}), |s| s.rm_reachable = r);
                }
            }
            Event::RmError(_) => {
                hub.counters.rm_errors.fetch_add(1, Ordering::Relaxed);
            }
            Event::Resynced => {
                hub.counters.rm_resyncs.fetch_add(1, Ordering::Relaxed);
                hub.update("job", json!({"rmReachable": true, "resynced": true}), |s| {
                    s.rm_reachable = true
                });
            }
            Event::QueueNote(note) => hub.update("job", json!({"queueNote": note}), |s| s.job.queue_note = note),
            Event::Reason(reason) => hub.update("job", json!({"reason": reason}), |s| s.job.reason = reason),
            Event::StartEstimate(e) => hub.update("job", json!({"startEstimate": e}), |s| s.job.start_estimate = e),
            Event::Retried(t) => {
                let c = &hub.counters;
                let counter = match t {
                    ExitType::TransientNormal | ExitType::TransientConflict => &c.retries_transient,
                    ExitType::NonTransient => &c.retries_permanent,
                    _ => &c.retries_unknown,
                };
                counter.fetch_add(1, Ordering::Relaxed);
            }
            Event::ContainerAt {
                container_id,
                node_http_address,
                host,
            } => {
                self.addrs.lock().insert(container_id, (node_http_address, host));
            }
            Event::AllocateLatency(d) => hub.counters.allocate_latency.observe(d),
        }
    }
}

/// One selection as the dashboard keeps it.
pub fn selection_record(role: &str, index: u32, sel: &Selection, at_ms: u64) -> SelectionRecord {
    let (outcome, reason, p) = match &sel.outcome {
        Outcome::Placed(p) => ("placed", None, Some(p)),
        Outcome::NotNow { reason, .. } => ("notNow", Some(reason.clone()), None),
        Outcome::Impossible { reason } => ("impossible", Some(reason.clone()), None),
    };
    SelectionRecord {
        role: role.to_string(),
        index,
        at_ms,
        outcome: outcome.into(),
        reason,
        host: p.map(|p| p.host.clone()),
        gpu_mask: p.map(|p| mask_hex(p.resources.gpu_mask)),
        gpus: p.map(|p| mask_indices(p.resources.gpu_mask)).unwrap_or_default(),
        ports: p.map(|p| p.resources.ports.to_string()),
        gpu_tier: p.map(|p| p.gpu_tier),
        gpu_tier_ideal: p.map(|p| p.gpu_tier_ideal),
        gpu_weight: p.map(|p| p.gpu_weight),
        nic: p.and_then(|p| p.nic.clone()),
        trace: sel.trace.clone(),
    }
}
