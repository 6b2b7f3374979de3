//! `gpuam am`: wires one job's AM — the RM client, the selector over the node view, the
//! status hub and its dashboard, the signals — around the job machine and its driver
//! (`am::machine`, `am::driver`), prints what went wrong and picks the exit code
//! (DESIGN.md §7).

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::sync::mpsc;

use crate::am::backoff::Backoff;
use crate::am::driver::{self, with_retries, Observer};
use crate::am::machine::{Input, JobMachine, Now};
use crate::am::publish::{ContainerAddrs, Publisher};
use crate::am::rm_client::{RmClient, RmError};
use crate::am::status::{Command, JobState, JobStatus, LogSource, Snapshot, StatusHub};
use crate::am::{gang_never_fits, random_token, AmOptions};
use crate::cluster::rm_json::NodeListing;
use crate::cluster::ClusterView;
use crate::exit;
use crate::protocol::{
    AllocateRequest, AllocateResponse, FinalStatus, FinishRequest, RegisterRequest, RegisterResponse,
};
use crate::select::Selector;

/// Seconds the dashboard stays up after the job ends, unless
/// `GPUAM_DASHBOARD_LINGER_SEC` says otherwise.
const DEFAULT_LINGER_SEC: u64 = 2;

/// Reads container logs from the executor that runs the container.
struct ExecutorLogs {
    rm: RmClient,
    addrs: ContainerAddrs,
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

/// The RM as the driver calls it, noting when the first ask goes out: with the times of
/// the AM's start (node listing read, registered) it prints one line to stderr,
/// [`START_LINE`], that `gpuam bench cluster` reads (issue 29: what an AM's start costs).
struct TimedRm {
    rm: RmClient,
    start: Instant,
    /// (nodes, listing read, registered), in milliseconds since the start.
    at: (usize, u128, u128),
    asked: AtomicBool,
}

/// The start of the AM's line on its start's times.
pub const START_LINE: &str = "AM start:";

impl driver::AmRm for TimedRm {
    fn node_changes(&self) -> impl Future<Output = Result<NodeListing, RmError>> + Send {
        self.rm.node_changes()
    }
    async fn allocate(&self, req: &AllocateRequest) -> Result<AllocateResponse, RmError> {
        if !req.asks.is_empty() && !self.asked.swap(true, Ordering::Relaxed) {
            let (nodes, listed, registered) = self.at;
            eprintln!(
                "{START_LINE} node listing of {nodes} nodes read at {listed} ms, registered at {registered} ms, first ask at {} ms",
                self.start.elapsed().as_millis()
            );
        }
        self.rm.allocate(req).await
    }
    fn register(&self, req: &RegisterRequest) -> impl Future<Output = Result<RegisterResponse, RmError>> + Send {
        self.rm.register(req)
    }
    fn start_all(
        &self,
        launches: &[crate::am::machine::Launch],
    ) -> impl Future<Output = Vec<crate::am::machine::LaunchAnswer>> + Send {
        driver::AmRm::start_all(&self.rm, launches)
    }
}

/// Runs one AM to the end of its job; returns the process exit code (DESIGN.md §7).
pub async fn run(opts: AmOptions) -> i32 {
    let start = Instant::now();
    let job = Arc::new(opts.job);
    let mut backoff = Backoff::seeded(rand::random());
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
    let nodes = match with_retries("node listing", 10, &mut backoff, || rm.nodes()).await {
        Ok(n) => n,
        Err(e) => {
            eprintln!("error: {e}");
            return e.exit_code();
        }
    };
    let listed = (nodes.len(), start.elapsed().as_millis());
    if let Some(why) = gang_never_fits(&job, &nodes, &opts.settings) {
        eprintln!("error: {why}");
        let finish = FinishRequest {
            final_status: FinalStatus::Failed,
            exit_code: exit::JOB_FAILED,
            diagnostics: why,
        };
        // Register first so the RM records the verdict as this attempt's.
        let _ = rm.register(&RegisterRequest::default()).await;
        let _ = with_retries("finish", 5, &mut backoff, || rm.finish(&finish)).await;
        return exit::JOB_FAILED;
    }
    let selector = Arc::new(Selector::new(ClusterView::new(nodes), opts.settings.select.clone()));

    let addrs = ContainerAddrs::default();
    let logs = Arc::new(ExecutorLogs {
        rm: rm.clone(),
        addrs: addrs.clone(),
    });
    let job_token = opts.job_token.clone().unwrap_or_else(random_token);
    let started = Now::real();
    let snapshot = Snapshot {
        job: JobStatus {
            name: job.name.clone(),
            app_id: opts.app_id.clone(),
            state: JobState::Starting,
            attempt: 1,
            gang: job.gang,
            started_ms: started.ms,
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
            reason: None,
            start_estimate: None,
        },
        tasks: Vec::new(),
        nodes: Vec::new(),
        selections: VecDeque::new(),
        nodes_refreshed_ms: started.ms,
        registered: false,
        rm_reachable: true,
        config: serde_json::to_value(&opts.settings).unwrap_or_default(),
    };
    let (hub, mut commands) = StatusHub::new(snapshot, job_token, logs);
    let _ = hub.rm.set(rm.clone());
    let _ = hub
        .node_source
        .set(Arc::new(crate::am::node_page::ViewNodes(selector.clone())));
    // The dashboard also takes the tokens the RM takes for this job (owner, admin).
    {
        let client = rm.without_credentials();
        let app_id = opts.app_id.clone();
        hub.set_token_check(Arc::new(move |token: String| {
            let (client, app_id) = (client.clone(), app_id.clone());
            Box::pin(async move {
                match client.with_user_token(Some(token)).app(&app_id).await {
                    Ok(_) => Some(true),
                    // The RM's word that this token may not read the job.
                    Err(crate::am::rm_client::RmError::Refused {
                        status: 401 | 403 | 404,
                        ..
                    }) => Some(false),
                    Err(_) => None,
                }
            })
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
    let registered = match with_retries("register", 10, &mut backoff, || rm.register(&reg)).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return e.exit_code();
        }
    };
    let registered_at = start.elapsed().as_millis();
    let mut machine = JobMachine::new(
        job.clone(),
        opts.app_id.clone(),
        selector,
        opts.settings.am.clone(),
        reg.clone(),
        rand::random(),
        Now::real(),
    );
    let publisher = Publisher {
        hub: hub.clone(),
        addrs,
    };
    if !registered.containers_from_previous_attempts.is_empty() {
        let previous = registered.containers_from_previous_attempts.clone();
        publisher.observe(machine.step(Input::Adopt(previous), Now::real()).events);
    }
    let initial = machine.statuses();
    hub.update("job", serde_json::json!({"registered": true}), |s| {
        s.registered = true;
        s.job.attempt = registered.attempt;
        s.job.state = JobState::Waiting;
        s.tasks = initial;
    });

    // SIGINT / SIGTERM and the dashboard's kill stop the job cleanly.
    let (stop_tx, mut stop_rx) = mpsc::unbounded_channel();
    let dash_stop = stop_tx.clone();
    tokio::spawn(async move {
        while let Some(Command::Kill { reason }) = commands.recv().await {
            let _ = dash_stop.send(reason);
        }
    });
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

    let heartbeat = Duration::from_millis(opts.settings.am.heartbeat_interval_ms.max(10));
    let timed = TimedRm {
        rm: rm.clone(),
        start,
        at: (listed.0, listed.1, registered_at),
        asked: AtomicBool::new(false),
    };
    let end = driver::drive(&mut machine, &timed, &publisher, heartbeat, &mut stop_rx, &mut backoff).await;
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
    if let Err(e) = with_retries("finish", finish_attempts, &mut backoff, || rm.finish(&finish)).await {
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
