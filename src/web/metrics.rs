//! `GET /metrics`: the AM's state in the Prometheus text exposition format.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};

use super::api::{now_ms, state_name};
use crate::am::status::{JobState, StatusHub, TaskState};

/// Histogram bucket bounds for allocate latency, in seconds.
const LATENCY_BUCKETS: [f64; 12] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

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

/// Escapes a label value (backslash, quote, newline).
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Renders all series.
pub(crate) fn render(hub: &StatusHub) -> String {
    let mut out = String::with_capacity(4096);
    let now = now_ms();
    hub.read(|s| {
        // Per role and state, zeros included, so that dashboards see every series.
        let mut roles: Vec<&str> = s.job.roles.iter().map(|r| r.role.as_str()).collect();
        for t in &s.tasks {
            if !roles.contains(&t.role.as_str()) {
                roles.push(&t.role);
            }
        }
        out.push_str("# HELP gpuam_tasks Tasks of this job per role and state.\n# TYPE gpuam_tasks gauge\n");
        for role in &roles {
            for st in TaskState::ALL {
                let n = s.tasks.iter().filter(|t| t.role == *role && t.state == st).count();
                let _ = writeln!(out, "gpuam_tasks{{role=\"{}\",state=\"{}\"}} {n}", esc(role), state_name(st));
            }
        }
        let outstanding = s.tasks.iter().filter(|t| t.state == TaskState::ContainerRequested).count();
        out.push_str("# HELP gpuam_requests_outstanding Container requests sent to the RM and not yet answered.\n# TYPE gpuam_requests_outstanding gauge\n");
        let _ = writeln!(out, "gpuam_requests_outstanding {outstanding}");
        out.push_str("# HELP gpuam_node_refresh_age_seconds Age of the AM's node view.\n# TYPE gpuam_node_refresh_age_seconds gauge\n");
        if s.nodes_refreshed_ms == 0 {
            out.push_str("gpuam_node_refresh_age_seconds NaN\n");
        } else {
            let age = now.saturating_sub(s.nodes_refreshed_ms) as f64 / 1000.0;
            let _ = writeln!(out, "gpuam_node_refresh_age_seconds {age}");
        }
        out.push_str("# HELP gpuam_job_state 1 for the job's current state.\n# TYPE gpuam_job_state gauge\n");
        for st in JOB_STATES {
            let v = u8::from(s.job.state == st);
            let _ = writeln!(out, "gpuam_job_state{{state=\"{}\"}} {v}", job_state_name(st));
        }
    });

    let c = &hub.counters;
    out.push_str("# HELP gpuam_rm_errors_total Failed calls to the RM.\n# TYPE gpuam_rm_errors_total counter\n");
    let _ = writeln!(out, "gpuam_rm_errors_total {}", c.rm_errors.load(Ordering::Relaxed));
    out.push_str(
        "# HELP gpuam_rm_resyncs_total Times the AM registered again after an RM restart.\n# TYPE gpuam_rm_resyncs_total counter\n",
    );
    let _ = writeln!(out, "gpuam_rm_resyncs_total {}", c.rm_resyncs.load(Ordering::Relaxed));

    out.push_str(
        "# HELP gpuam_task_retries_total Task retries per exit class.\n# TYPE gpuam_task_retries_total counter\n",
    );
    for (class, v) in [
        ("transient", &c.retries_transient),
        ("permanent", &c.retries_permanent),
        ("unknown", &c.retries_unknown),
    ] {
        let _ = writeln!(
            out,
            "gpuam_task_retries_total{{exit_class=\"{class}\"}} {}",
            v.load(Ordering::Relaxed)
        );
    }

    out.push_str("# HELP gpuam_selection_filtered_total Nodes filtered out per select stage.\n# TYPE gpuam_selection_filtered_total counter\n");
    for (stage, n) in c.filtered_per_stage.lock().iter() {
        let _ = writeln!(out, "gpuam_selection_filtered_total{{stage=\"{}\"}} {n}", esc(stage));
    }

    // The latencies kept are a bounded ring, so this histogram covers the recent window.
    let lat = c.allocate_latency_us.lock().clone();
    out.push_str("# HELP gpuam_allocate_latency_seconds Allocate round-trip latency (recent window).\n# TYPE gpuam_allocate_latency_seconds histogram\n");
    let secs: Vec<f64> = lat.iter().map(|us| *us as f64 / 1e6).collect();
    for b in LATENCY_BUCKETS {
        let n = secs.iter().filter(|v| **v <= b).count();
        let _ = writeln!(out, "gpuam_allocate_latency_seconds_bucket{{le=\"{b}\"}} {n}");
    }
    let _ = writeln!(
        out,
        "gpuam_allocate_latency_seconds_bucket{{le=\"+Inf\"}} {}",
        secs.len()
    );
    let _ = writeln!(out, "gpuam_allocate_latency_seconds_sum {}", secs.iter().sum::<f64>());
    let _ = writeln!(out, "gpuam_allocate_latency_seconds_count {}", secs.len());
    out
}

pub(crate) async fn metrics(State(hub): State<Arc<StatusHub>>) -> Response {
    let mut r = render(&hub).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}
