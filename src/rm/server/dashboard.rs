//! The RM's cluster view: `GET /ws/v1/cluster/overview` (the JSON behind the cluster page
//! `/cluster`, whose files are in `webui/`) and `GET /metrics` (Prometheus, OpenMetrics text
//! by `prometheus-client`): per-queue use, deserved share and waiting tasks; grants,
//! rejections and preemptions; allocate latency.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::http::Caller;
use super::scheduling::{queue_view, WAITING_TTL};
use super::{Rm, Shared};
use crate::protocol::{now_ms, ContainerState};
use crate::rm::apps::App;

/// Upper bounds (seconds) of the allocate-latency histogram's buckets (the RM's own time
/// for one allocate call, lock included).
const LATENCY_BUCKETS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabel {
    queue: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueuePoolLabel {
    queue: String,
    gpu_type: String,
}

/// The RM's live counters (clones share their values).
#[derive(Clone)]
pub(super) struct RmMetrics {
    grants: Counter,
    node_reports: Counter,
    rejections: Family<ReasonLabel, Counter>,
    allocate_latency: Histogram,
}

impl Default for RmMetrics {
    fn default() -> Self {
        RmMetrics {
            grants: Counter::default(),
            node_reports: Counter::default(),
            rejections: Family::default(),
            allocate_latency: Histogram::new(LATENCY_BUCKETS),
        }
    }
}

/// Why an ask was refused, for `gpuam_rm_rejections_total{reason}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The queue gate: at its cap, or the room is kept for others ahead.
    Queue,
    /// Its resources are taken now.
    Busy,
    /// It can never be granted as written.
    Never,
}

impl RmMetrics {
    pub(super) fn granted(&self, n: usize) {
        self.grants.inc_by(n as u64);
    }

    /// Changed nodes sent in allocate answers.
    pub(super) fn sent_node_reports(&self, n: usize) {
        self.node_reports.inc_by(n as u64);
    }

    pub(super) fn refused(&self, why: Refusal, n: usize) {
        let reason = match why {
            Refusal::Queue => "queue",
            Refusal::Busy => "busy",
            Refusal::Never => "never",
        };
        self.rejections
            .get_or_create(&ReasonLabel { reason: reason.into() })
            .inc_by(n as u64);
    }

    pub(super) fn allocate_took(&self, d: Duration) {
        self.allocate_latency.observe(d.as_secs_f64());
    }
}

/// Every series of one scrape, under the prefix `gpuam_rm`.
fn scrape_registry(rm: &Shared) -> Registry {
    let mut reg = Registry::with_prefix("gpuam_rm");
    let (queues, preempted) = {
        let st = rm.lock();
        (queue_view(&st, Instant::now()), st.sched.preempted_from.clone())
    };
    // GPUs in hundredths count (shares): fractional gauges.
    let used = Family::<QueuePoolLabel, Gauge<f64, AtomicU64>>::default();
    let deserved = Family::<QueuePoolLabel, Gauge<f64, AtomicU64>>::default();
    let waiting_gpus = Family::<QueuePoolLabel, Gauge<f64, AtomicU64>>::default();
    let waiting = Family::<QueueLabel, Gauge>::default();
    let preemptions = Family::<QueueLabel, Counter>::default();
    for q in &queues {
        let ql = QueueLabel { queue: q.name.clone() };
        waiting.get_or_create(&ql).set(i64::from(q.waiting_tasks));
        preemptions
            .get_or_create(&ql)
            .inc_by(preempted.get(&q.name).copied().unwrap_or(0));
        for p in &q.pools {
            let l = QueuePoolLabel {
                queue: q.name.clone(),
                gpu_type: p.gpu_type.clone(),
            };
            used.get_or_create(&l).set(p.used.as_f64());
            deserved.get_or_create(&l).set(p.deserved);
            waiting_gpus.get_or_create(&l).set(p.waiting.as_f64());
        }
    }
    reg.register("queue_used_gpus", "GPUs held by the queue's containers", used);
    reg.register(
        "queue_deserved_gpus",
        "The queue's deserved share now (weighted fair share of what queues want)",
        deserved,
    );
    reg.register(
        "queue_waiting_gpus",
        "GPUs of the queue's waiting tasks that could use the GPU type",
        waiting_gpus,
    );
    reg.register(
        "queue_waiting_tasks",
        "Tasks of the queue's jobs waiting for a container",
        waiting,
    );
    reg.register(
        "preemptions",
        "Containers taken back from the queue since the RM started",
        preemptions,
    );
    reg.register("grants", "Containers granted", rm.metrics.grants.clone());
    reg.register(
        "node_reports_sent",
        "Changed nodes sent in allocate answers",
        rm.metrics.node_reports.clone(),
    );
    reg.register(
        "rejections",
        "Asks refused, by reason (queue: the queue gate; busy: taken now; never: can never fit)",
        rm.metrics.rejections.clone(),
    );
    reg.register(
        "allocate_latency_seconds",
        "Time the RM spends answering one allocate call",
        rm.metrics.allocate_latency.clone(),
    );
    reg
}

/// One scrape as OpenMetrics text.
pub(super) fn metrics_text(rm: &Shared) -> String {
    let mut out = String::with_capacity(4096);
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &scrape_registry(rm)) {
        tracing::error!("metrics encoding failed: {e}");
    }
    out
}

pub(super) async fn metrics(State(rm): Rm) -> Response {
    let mut r = metrics_text(&rm).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    r
}

/// Finished applications the overview lists at most (the most recent ones).
const MAX_FINISHED_SHOWN: usize = 50;

/// `GET /ws/v1/cluster/overview`: queues, applications, every node's GPUs with their
/// owners, and the preemptions under way. Needs a credential, like the application
/// listing: a user sees the queues, the node grid coloured by queue and their own jobs
/// (other jobs' GPUs show their queue, not the job); the admin sees every job.
pub(super) async fn overview(State(rm): Rm, caller: Caller) -> Json<Value> {
    let st = rm.lock();
    let now = Instant::now();
    let wall = now_ms();
    let queues = queue_view(&st, now);
    // Live containers by application and by node.
    let mut per_app: HashMap<&str, (u32, u32)> = HashMap::new();
    let mut per_node: HashMap<&str, Vec<(&str, u64, bool)>> = HashMap::new();
    let ids = st.ledger.live_containers();
    for id in &ids {
        let Some(c) = st.ledger.container(id) else { continue };
        let r = &c.container.resources;
        let e = per_app.entry(c.app_id.as_str()).or_default();
        e.0 += r.gpu_count();
        e.1 += 1;
        let leaving = c.state == ContainerState::Complete || st.sched.preempting.contains_key(id);
        per_node
            .entry(c.container.host.as_str())
            .or_default()
            .push((c.app_id.as_str(), r.gpu_mask, leaving));
    }
    let app_queue: HashMap<&str, &str> = st
        .apps
        .values()
        .map(|a| (a.report.id.as_str(), a.report.queue.as_str()))
        .collect();
    let visible = |app: &str| st.apps.get(app).is_some_and(|a| caller.owns(a));
    let mut finished: Vec<&App> = st
        .apps
        .values()
        .filter(|a| a.report.state.is_final() && caller.owns(a))
        .collect();
    finished.sort_by_key(|a| std::cmp::Reverse(a.report.finished_time));
    let shown = st
        .apps
        .values()
        .filter(|a| !a.report.state.is_final() && caller.owns(a))
        .chain(finished.into_iter().take(MAX_FINISHED_SHOWN));
    let apps: Vec<Value> = shown
        .map(|a| {
            let r = &a.report;
            let (live, yours) = (!r.state.is_final(), r.user == caller.name());
            let (gpus, containers) = per_app.get(r.id.as_str()).copied().unwrap_or_default();
            let waiting: u32 = a.waiting.current(now, WAITING_TTL).iter().map(|w| w.count).sum();
            let since = a.waiting.since_ms.filter(|_| waiting > 0);
            json!({
                "id": r.id,
                "name": r.name,
                "user": r.user,
                "queue": r.queue,
                "priority": r.priority,
                "state": r.state,
                "finalStatus": r.final_status,
                "gang": a.gang,
                "gpus": gpus,
                "containers": containers,
                "waitingTasks": waiting,
                "waitingSinceMs": since,
                "waitingMs": since.map(|s| wall.saturating_sub(s)),
                "why": a.wait_reason().filter(|_| waiting > 0).map(|r| r.text()),
                "reason": a.wait_reason().filter(|_| waiting > 0),
                "whyCode": a.waiting.why.as_ref().filter(|_| waiting > 0).map(|(c, _)| *c),
                "startEstimate": a.waiting.estimate.as_ref().filter(|_| waiting > 0),
                // A final job's AM is gone or going: its address may soon be another
                // process's port, so the page links none.
                "trackingUrl": if live { r.tracking_url.as_str() } else { "" },
                "yours": yours,
                // What the page's link hands the job's dashboard: never the caller's token
                // (the address is the job's AM's word, and its port may be another
                // process's once the AM has gone) but a page ticket of this job, for the
                // caller's own live jobs only ([`crate::auth::page_ticket`]).
                "dashboardTicket": a
                    .job_token()
                    .filter(|_| live && yours && !r.tracking_url.is_empty())
                    .map(|jt| {
                        let born = wall / 1000;
                        let expires = born + crate::auth::PAGE_TICKET_FOR.as_secs();
                        crate::auth::page_ticket(jt, born, expires, caller.name())
                    }),
                "startedTime": r.started_time,
                "finishedTime": r.finished_time,
            })
        })
        .collect();
    let nodes: Vec<Value> = st
        .ledger
        .nodes()
        .map(|(n, count)| {
            let total = n.total();
            let mask = if total.gpu_mask != 0 {
                total.gpu_mask
            } else {
                crate::resources::mask_of_count(total.gpus)
            };
            let owners = per_node.get(n.host.as_str());
            let gpus: Vec<Value> = crate::resources::mask_indices(mask)
                .into_iter()
                .map(|i| {
                    let owner = owners.and_then(|v| v.iter().find(|(_, m, _)| m >> i & 1 == 1));
                    let used_elsewhere = n.used().gpu_mask >> i & 1 == 1 && owner.is_none();
                    json!({
                        "index": i,
                        "app": owner.map(|o| o.0).filter(|a| visible(a)),
                        "used": owner.is_some(),
                        "queue": owner.and_then(|o| app_queue.get(o.0).copied()),
                        "leaving": owner.is_some_and(|o| o.2),
                        "other": used_elsewhere,
                    })
                })
                .collect();
            json!({
                "host": n.host,
                "rack": n.rack,
                "state": n.state,
                "gpuType": n.gpu_type,
                "gpus": gpus,
                "containers": count,
                "totalCpu": total.cpu,
                "usedCpu": n.used().cpu,
                "totalMemoryMB": total.memory_mb,
                "usedMemoryMB": n.used().memory_mb,
            })
        })
        .collect();
    let preemptions: Vec<Value> = st
        .sched
        .preempting
        .iter()
        .filter(|(_, p)| visible(&p.app_id))
        .map(|(id, p)| {
            json!({
                "containerId": id,
                "app": p.app_id,
                "host": p.host,
                "fromQueue": p.from_queue,
                "forQueue": p.for_queue,
                "deadlineMs": p.deadline_ms,
                "reason": p.reason,
            })
        })
        .collect();
    Json(json!({
        "time": wall,
        "preemptionGraceSec": st.sched.grace.as_secs_f64(),
        "queues": queues,
        "apps": apps,
        "nodes": nodes,
        "preemptions": preemptions,
    }))
}
