//! The application master: one per job. Registers with the RM, keeps the node view,
//! places and requests one task at a time, launches, watches, retries, finishes.
//!
//! `run` wires the parts: the RM client, the selector over the node view, the status
//! hub and dashboard, and the control loop that owns every task.

pub mod control;
pub mod exits;
pub mod job_retry;
pub mod pai_env;
pub mod queueing;
pub mod rm_client;
pub mod status;
pub mod tasks;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::mpsc;

use crate::cluster::ClusterView;
use crate::config::Settings;
use crate::exit;
use crate::protocol::{FinalStatus, FinishRequest, RegisterRequest};
use crate::select::Selector;
use crate::spec::JobSpec;
use control::{Control, JobEnd};
use rm_client::RmClient;
use status::{JobState, JobStatus, LogSource, Snapshot, StatusHub};

/// Seconds the dashboard stays up after the job ends, unless
/// `GPUAM_DASHBOARD_LINGER_SEC` says otherwise.
const DEFAULT_LINGER_SEC: u64 = 2;

/// What `gpuam am` needs.
#[derive(Clone, Debug)]
pub struct AmOptions {
    pub job: JobSpec,
    pub rm_url: String,
    pub app_id: String,
    pub token: String,
    /// The dashboard's address.
    pub listen: SocketAddr,
    pub settings: Settings,
    /// Token for mutating dashboard calls; random when not given.
    pub job_token: Option<String>,
}

/// Reads container logs from the executor that runs the container.
struct ExecutorLogs {
    rm: RmClient,
    addrs: Arc<parking_lot::Mutex<HashMap<String, (String, String)>>>,
}

impl LogSource for ExecutorLogs {
    fn read(&self, container_id: &str, stream: &str, tail: u64) -> BoxFuture<'static, Result<String, String>> {
        let addr = self.addrs.lock().get(container_id).cloned();
        let rm = self.rm.clone();
        let (id, stream) = (container_id.to_string(), stream.to_string());
        Box::pin(async move {
            let (node, host) = addr.ok_or_else(|| format!("container {id} is not known to this AM"))?;
            rm.container_logs(&node, &host, &id, &stream, tail)
                .await
                .map_err(|e| e.to_string())
        })
    }
}

/// A fresh random token (see [`crate::auth::new_token`]).
pub fn random_token() -> String {
    crate::auth::new_token()
}

async fn with_retries<T, F, Fut>(what: &str, attempts: u32, mut f: F) -> Result<T, rm_client::RmError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, rm_client::RmError>>,
{
    let mut delay = Duration::from_millis(200);
    let mut last = None;
    for _ in 0..attempts {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if e.is_unreachable() || e.status() == Some(503) => {
                tracing::warn!(error = %e, "{what} failed; retrying");
                last = Some(e);
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or(rm_client::RmError::BadAnswer {
        what: what.into(),
        why: "no attempt made".into(),
    }))
}

/// Runs one AM to the end of its job; returns the process exit code (DESIGN.md §7).
pub async fn run(opts: AmOptions) -> i32 {
    let job = Arc::new(opts.job);
    let rm = match RmClient::for_app_with_tls(&opts.rm_url, &opts.app_id, &opts.token, &opts.settings.tls) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: TLS: {e}");
            return exit::INVALID_INPUT;
        }
    };
    let dash_tls = match crate::tls::server_config_from_settings(&opts.settings.tls) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: TLS: {e}");
            return exit::INVALID_INPUT;
        }
    };
    let dash_scheme = crate::tls::scheme(dash_tls.is_some());

    // The node view first: the selector needs it before any task is placed.
    let nodes = match with_retries("node listing", 10, || rm.nodes()).await {
        Ok(n) => n,
        Err(e) => {
            eprintln!("error: {e}");
            return e.exit_code();
        }
    };
    if let Some(why) = gang_never_fits(&job, &nodes, &opts.settings) {
        eprintln!("error: {why}");
        let finish = FinishRequest {
            final_status: FinalStatus::Failed,
            exit_code: exit::JOB_FAILED,
            diagnostics: why,
        };
        // Register first so the RM records the verdict as this attempt's.
        let _ = rm.register(&RegisterRequest::default()).await;
        let _ = with_retries("finish", 5, || rm.finish(&finish)).await;
        return exit::JOB_FAILED;
    }
    let selector = Arc::new(Selector::new(ClusterView::new(nodes), opts.settings.select.clone()));

    let addrs: Arc<parking_lot::Mutex<HashMap<String, (String, String)>>> = Arc::default();
    let logs = Arc::new(ExecutorLogs {
        rm: rm.clone(),
        addrs: addrs.clone(),
    });
    let job_token = opts.job_token.clone().unwrap_or_else(random_token);
    let snapshot = Snapshot {
        job: JobStatus {
            name: job.name.clone(),
            app_id: opts.app_id.clone(),
            state: JobState::Starting,
            attempt: 1,
            gang: job.gang,
            started_ms: tasks::now_ms(),
            finished_ms: None,
            exit_code: None,
            diagnostics: None,
            total_tasks: job.total_tasks(),
            completed_tasks: 0,
            roles: Vec::new(),
            rm_url: opts.rm_url.clone(),
            queue: job
                .queue
                .clone()
                .unwrap_or_else(|| crate::protocol::DEFAULT_QUEUE.to_string()),
            priority: job.priority,
            queue_note: None,
        },
        tasks: Vec::new(),
        nodes: Vec::new(),
        selections: VecDeque::new(),
        nodes_refreshed_ms: tasks::now_ms(),
        registered: false,
        rm_reachable: true,
        config: serde_json::to_value(&opts.settings).unwrap_or_default(),
    };
    let (hub, commands) = StatusHub::new(snapshot, job_token, logs);
    // The dashboard also takes the tokens the RM takes for this job (owner, admin).
    if let Ok(client) = RmClient::with_tls(&opts.rm_url, &opts.settings.tls) {
        let app_id = opts.app_id.clone();
        hub.set_token_check(Arc::new(move |token: String| {
            let (client, app_id) = (client.clone(), app_id.clone());
            Box::pin(async move { client.with_user_token(Some(token)).app(&app_id).await.is_ok() })
        }));
    }
    let (dash_addr, _dash) = match crate::web::serve_with(
        hub.clone(),
        opts.listen,
        dash_tls,
        &opts.settings.rm.public_names,
        (&opts.settings.http).into(),
    )
    .await
    {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: cannot serve the dashboard on {}: {e}", opts.listen);
            return exit::USAGE;
        }
    };
    let tracking_url = format!("{dash_scheme}://{dash_addr}/");
    tracing::info!(%tracking_url, "dashboard listening");

    let reg = RegisterRequest {
        host: dash_addr.ip().to_string(),
        tracking_url: tracking_url.clone(),
    };
    let registered = match with_retries("register", 10, || rm.register(&reg)).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return e.exit_code();
        }
    };
    let mut control = Control::new(
        job.clone(),
        opts.app_id.clone(),
        rm.clone(),
        selector,
        hub.clone(),
        opts.settings.am.clone(),
        commands,
    );
    control.container_addrs = addrs;
    control.registration = reg.clone();
    if !registered.containers_from_previous_attempts.is_empty() {
        control.adopt(&registered.containers_from_previous_attempts);
    }
    let initial = control.initial_statuses();
    hub.update("job", serde_json::json!({"registered": true}), |s| {
        s.registered = true;
        s.job.attempt = registered.attempt;
        s.tasks = initial;
    });

    // SIGINT / SIGTERM kill the job cleanly.
    let (stop_tx, stop_rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let term = async {
            #[cfg(unix)]
            {
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(mut s) => {
                        s.recv().await;
                    }
                    Err(_) => futures::future::pending::<()>().await,
                }
            }
            #[cfg(not(unix))]
            futures::future::pending::<()>().await
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => { let _ = stop_tx.send("SIGINT".to_string()); }
            _ = term => { let _ = stop_tx.send("SIGTERM".to_string()); }
        }
    });

    let end: JobEnd = control.run(stop_rx).await;
    let final_status = match end.state {
        JobState::Succeeded => FinalStatus::Succeeded,
        JobState::Killed => FinalStatus::Killed,
        _ => FinalStatus::Failed,
    };
    let finish = FinishRequest {
        final_status,
        exit_code: end.exit_code,
        diagnostics: end.diagnostics.clone(),
    };
    // An AM that gave up on its RM tries once more, briefly: the RM has been gone for
    // `am.rm_unreachable_timeout_sec` already.
    let finish_attempts = if end.exit_code == exit::RM_UNREACHABLE { 2 } else { 20 };
    if let Err(e) = with_retries("finish", finish_attempts, || rm.finish(&finish)).await {
        eprintln!("warning: could not tell the RM the job ended: {e}");
    }
    eprintln!("job {} {:?}: {}", job.name, end.state, end.diagnostics);
    // Keep the dashboard and status API up a little after the end, so followers
    // (`gpuam run`, `submit --wait`, an open page) can read the final state.
    let linger = std::env::var("GPUAM_DASHBOARD_LINGER_SEC")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(DEFAULT_LINGER_SEC);
    tokio::time::sleep(Duration::from_secs(linger)).await;
    end.exit_code
}

/// A gang holds everything it is given until all of it is there, so a gang that could
/// not be placed even on the empty cluster would wait and time out forever: say so at
/// once instead. (Tasks of other jobs can finish; the cluster's own size cannot grow.)
pub fn gang_never_fits(job: &JobSpec, nodes: &[crate::cluster::Node], settings: &Settings) -> Option<String> {
    if !job.gang {
        return None;
    }
    let empty: Vec<_> = nodes
        .iter()
        .cloned()
        .map(|mut n| {
            n.set_used(crate::resources::Resources::default());
            n
        })
        .collect();
    let mut select = settings.select.clone();
    select.seed = Some(0);
    let plan = crate::select::plan_job(&Selector::new(ClusterView::new(empty), select), job);
    plan.unplaced.first().map(|u| {
        format!(
            "the gang of {} tasks cannot fit this cluster even when it is empty: {} of them find no place \
             (first: {}/{}: {})",
            job.total_tasks(),
            plan.unplaced.len(),
            u.role,
            u.index,
            u.reason
        )
    })
}
