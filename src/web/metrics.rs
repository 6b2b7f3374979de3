//! `GET /metrics`: the AM's state for Prometheus, encoded by the maintained
//! `prometheus-client` crate (OpenMetrics text, which Prometheus reads).
//!
//! Two kinds of series: the allocate-latency histogram is a live `prometheus-client`
//! histogram the control loop observes into ([`LatencyHistogram`]: cumulative, so its
//! counts never go down); everything else is read at scrape time from the hub's snapshot
//! and its counters into a registry made for that one scrape (`scrape_registry`).
//!
//! [`LatencyHistogram`]: crate::am::status::LatencyHistogram

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::api::state_name;
use crate::am::status::{JobState, StatusHub, TaskState};
use crate::protocol::now_ms;

const JOB_STATES: [JobState; 6] = [
    JobState::Starting,
    JobState::Waiting,
    JobState::Running,
    JobState::Succeeded,
    JobState::Failed,
    JobState::Killed,
];

fn job_state_name(s: JobState) -> &'static str {
    match s {
        JobState::Starting => "STARTING",
        JobState::Waiting => "WAITING",
        JobState::Running => "RUNNING",
        JobState::Succeeded => "SUCCEEDED",
        JobState::Failed => "FAILED",
        JobState::Killed => "KILLED",
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RoleState {
    role: String,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ExitClass {
    exit_class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Stage {
    stage: String,
}

/// A counter holding `v` (the hub's atomics are the source of truth; counters only grow).
fn counter(v: u64) -> Counter {
    let c = Counter::default();
    c.inc_by(v);
    c
}

/// Every series of one scrape, under the prefix `gpuam`.
fn scrape_registry(hub: &StatusHub) -> Registry {
    let mut reg = Registry::with_prefix("gpuam");
    let now = now_ms();
    hub.read(|s| {
        // Per role and state, zeros included, so that dashboards see every series.
        let mut roles: Vec<&str> = s.job.roles.iter().map(|r| r.role.as_str()).collect();
        for t in &s.tasks {
            if !roles.contains(&t.role.as_str()) {
                roles.push(&t.role);
            }
        }
        let tasks = Family::<RoleState, Gauge>::default();
        for role in &roles {
            for st in TaskState::ALL {
                let n = s.tasks.iter().filter(|t| t.role == *role && t.state == st).count();
                tasks
                    .get_or_create(&RoleState {
                        role: role.to_string(),
                        state: state_name(st).into(),
                    })
                    .set(n as i64);
            }
        }
        reg.register("tasks", "Tasks of this job per role and state", tasks);

        let outstanding = Gauge::<i64>::default();
        outstanding.set(
            s.tasks
                .iter()
                .filter(|t| t.state == TaskState::ContainerRequested)
                .count() as i64,
        );
        reg.register(
            "requests_outstanding",
            "Container requests sent to the RM and not yet answered",
            outstanding,
        );

        let age = Gauge::<f64, AtomicU64>::default();
        age.set(if s.nodes_refreshed_ms == 0 {
            f64::NAN
        } else {
            now.saturating_sub(s.nodes_refreshed_ms) as f64 / 1000.0
        });
        reg.register("node_refresh_age_seconds", "Age of the AM's node view", age);

        let job = Family::<StateLabel, Gauge>::default();
        for st in JOB_STATES {
            job.get_or_create(&StateLabel {
                state: job_state_name(st).into(),
            })
            .set(i64::from(s.job.state == st));
        }
        reg.register("job_state", "1 for the job's current state", job);
    });

    let c = &hub.counters;
    reg.register(
        "rm_errors",
        "Failed calls to the RM",
        counter(c.rm_errors.load(Ordering::Relaxed)),
    );
    reg.register(
        "rm_resyncs",
        "Times the AM registered again after an RM restart",
        counter(c.rm_resyncs.load(Ordering::Relaxed)),
    );
    let retries = Family::<ExitClass, Counter>::default();
    for (class, v) in [
        ("transient", &c.retries_transient),
        ("permanent", &c.retries_permanent),
        ("unknown", &c.retries_unknown),
    ] {
        retries
            .get_or_create(&ExitClass {
                exit_class: class.into(),
            })
            .inc_by(v.load(Ordering::Relaxed));
    }
    reg.register("task_retries", "Task retries per exit class", retries);
    let filtered = Family::<Stage, Counter>::default();
    for (stage, n) in c.filtered_per_stage.lock().iter() {
        filtered
            .get_or_create(&Stage {
                stage: stage.to_string(),
            })
            .inc_by(*n);
    }
    reg.register("selection_filtered", "Nodes filtered out per select stage", filtered);
    reg.register(
        "allocate_latency_seconds",
        "Allocate round-trip latency (every call since the AM started)",
        c.allocate_latency.0.clone(),
    );
    reg
}

/// Renders all series (OpenMetrics text).
pub(crate) fn render(hub: &StatusHub) -> String {
    let mut out = String::with_capacity(4096);
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &scrape_registry(hub)) {
        tracing::error!("metrics encoding failed: {e}");
    }
    out
}

pub(crate) async fn metrics(State(hub): State<Arc<StatusHub>>) -> Response {
    let mut r = render(&hub).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    r
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;
    use crate::web::demo::demo_hub;

    /// `(le, count)` of every bucket, then `_count`, of the allocate-latency histogram.
    fn histogram(text: &str) -> (Vec<(String, u64)>, u64) {
        let buckets = text
            .lines()
            .filter_map(|l| {
                let rest = l.strip_prefix("gpuam_allocate_latency_seconds_bucket{le=\"")?;
                let (le, n) = rest.split_once("\"} ")?;
                Some((le.to_string(), n.trim().parse().ok()?))
            })
            .collect();
        let count = text
            .lines()
            .find_map(|l| {
                l.strip_prefix("gpuam_allocate_latency_seconds_count ")?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("no _count in\n{text}"));
        (buckets, count)
    }

    #[test]
    fn the_latency_histogram_keeps_every_sample() {
        // The old window kept at most 10,000 samples and then dropped 5,000.
        let hub = demo_hub(2, 1);
        let (_, before) = histogram(&render(&hub));
        for i in 0..10_050u64 {
            hub.counters.allocate_latency.observe(Duration::from_micros(i % 3000));
        }
        let (buckets, count) = histogram(&render(&hub));
        assert_eq!(count, before + 10_050);
        assert_eq!(buckets.last().map(|(le, n)| (le.as_str(), *n)), Some(("+Inf", count)));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// Across scrapes, with samples observed in between, no bucket and no count ever
        /// goes down (Prometheus would read that as a counter reset); within a scrape the
        /// buckets are cumulative and `+Inf` equals `_count`.
        #[test]
        fn counts_never_decrease(rounds in proptest::collection::vec(proptest::collection::vec(0u64..8_000_000, 0..300), 1..8)) {
            let hub = demo_hub(2, 1);
            let (mut last, mut last_count) = histogram(&render(&hub));
            let mut observed = last_count;
            for samples in rounds {
                for us in &samples {
                    hub.counters.allocate_latency.observe(Duration::from_micros(*us));
                }
                observed += samples.len() as u64;
                let (now, count) = histogram(&render(&hub));
                prop_assert_eq!(count, observed);
                prop_assert_eq!(now.len(), last.len());
                for ((le, n), (le0, n0)) in now.iter().zip(&last) {
                    prop_assert_eq!(le, le0);
                    prop_assert!(n >= n0, "bucket le={} went from {} to {}", le, n0, n);
                }
                prop_assert!(now.windows(2).all(|w| w[0].1 <= w[1].1));
                prop_assert_eq!(now.last().map(|b| b.1), Some(count));
                prop_assert!(count >= last_count);
                last = now;
                last_count = count;
            }
        }
    }
}
