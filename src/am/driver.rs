//! The AM's driver: the one async loop that runs a [`JobMachine`] in real time. It carries out
//! the machine's effects against the RM (the [`AmRm`] trait; the REST client implements it),
//! feeds the answers back, hands the events to an [`Observer`], and owns the timing: the
//! heartbeat interval, and the one back-off (`am::backoff`) while the RM does not answer —
//! for the heartbeat as for the calls around it ([`with_retries`]). It decides nothing.

use std::future::Future;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::backoff::Backoff;
use super::machine::{Effect, Event, Input, JobEnd, JobMachine, Now, RmFailure};
use super::rm_client::{RmClient, RmError};
use crate::cluster::rm_json::NodeListing;
use crate::protocol::{AllocateRequest, AllocateResponse, Container, LaunchContext, RegisterRequest, RegisterResponse};

/// The RM as the AM's driver calls it.
pub trait AmRm: Sync {
    /// The node listing's changes since the last one read, or the whole listing.
    fn node_changes(&self) -> impl Future<Output = Result<NodeListing, RmError>> + Send;
    fn allocate(&self, req: &AllocateRequest) -> impl Future<Output = Result<AllocateResponse, RmError>> + Send;
    fn register(&self, req: &RegisterRequest) -> impl Future<Output = Result<RegisterResponse, RmError>> + Send;
    /// Starts `ctx` in the granted container `c` on its node.
    fn start(&self, c: &Container, ctx: &LaunchContext) -> impl Future<Output = Result<(), RmError>> + Send;
}

/// How long a container start is sent again while the RM does not answer.
const START_UNREACHABLE_FOR: Duration = Duration::from_secs(120);

/// Container starts one AM has in flight at once.
pub const LAUNCHES_IN_FLIGHT: usize = 16;

impl AmRm for RmClient {
    fn node_changes(&self) -> impl Future<Output = Result<NodeListing, RmError>> + Send {
        RmClient::node_changes(self)
    }
    fn allocate(&self, req: &AllocateRequest) -> impl Future<Output = Result<AllocateResponse, RmError>> + Send {
        RmClient::allocate(self, req)
    }
    fn register(&self, req: &RegisterRequest) -> impl Future<Output = Result<RegisterResponse, RmError>> + Send {
        RmClient::register(self, req)
    }
    /// A start whose answer never came (the RM went down meanwhile) may have started the
    /// task: it is sent again until the RM answers (the RM answers a repeated start of a
    /// running container with its status), so a task is never run twice because one
    /// answer was lost. Given up after [`START_UNREACHABLE_FOR`].
    async fn start(&self, c: &Container, ctx: &LaunchContext) -> Result<(), RmError> {
        let since = Instant::now();
        loop {
            match self
                .start_container(&c.node_http_address, &c.host, &c.container_id, ctx)
                .await
            {
                Err(e) if e.is_unreachable() && since.elapsed() < START_UNREACHABLE_FOR => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                r => return r.map(|_| ()),
            }
        }
    }
}

/// Whoever watches the job (the dashboard's publisher, metrics).
pub trait Observer {
    fn observe(&self, events: Vec<Event>);
}

/// Runs `machine` until the job ends (or is killed: a reason on `stop`); returns how it
/// ended. `heartbeat`: the pause between heartbeats while nothing is ready to place.
pub async fn drive<R: AmRm, O: Observer>(
    machine: &mut JobMachine,
    rm: &R,
    observer: &O,
    heartbeat: Duration,
    stop: &mut mpsc::UnboundedReceiver<String>,
    backoff: &mut Backoff,
) -> JobEnd {
    let mut input = Input::Heartbeat;
    let mut tick = Instant::now();
    loop {
        if matches!(input, Input::Heartbeat) {
            while let Ok(reason) = stop.try_recv() {
                observer.observe(machine.step(Input::Kill(reason), Now::real()).events);
            }
        }
        let out = machine.step(input, Now::real());
        observer.observe(out.events);
        let Some(effect) = out.effects.into_iter().next() else {
            // Every step ends in one effect; none means a defect, and the job ends.
            return machine.ended().cloned().unwrap_or(JobEnd {
                state: super::status::JobState::Failed,
                exit_code: crate::exit::INTERNAL,
                diagnostics: "the job machine stopped without an effect".into(),
            });
        };
        input = match effect {
            // Only what changed since the last listing when the RM can say (O(changes)).
            Effect::FetchNodes => match rm.node_changes().await {
                Ok(l) if l.changed_since.is_some() => Input::NodeChanges(Ok(l.nodes)),
                Ok(l) => Input::Nodes(Ok(l.nodes)),
                Err(e) => Input::Nodes(Err(RmFailure::from(&e))),
            },
            Effect::Allocate(req) => {
                let started = Instant::now();
                let answer = rm.allocate(&req).await;
                if answer.is_ok() {
                    observer.observe(vec![Event::AllocateLatency(started.elapsed())]);
                }
                Input::Allocated(answer.map_err(|e| RmFailure::from(&e)))
            }
            Effect::Register(reg) => {
                tracing::warn!("the RM asked this AM to register again (it restarted); resyncing");
                Input::Registered(rm.register(&reg).await.map_err(|e| RmFailure::from(&e)))
            }
            Effect::Launch(launches) => {
                // Launch concurrently (a 1,000-task job must not wait for 1,000 round trips
                // in a row), but at most LAUNCHES_IN_FLIGHT at once: each is a connection
                // to the RM, and a hundred AMs on the RM's host share its per-peer cap.
                use futures::StreamExt as _;
                let results: Vec<_> = futures::stream::iter(launches.iter().map(|l| async move {
                    (
                        l.task,
                        rm.start(&l.container, &l.context).await.map_err(|e| e.to_string()),
                    )
                }))
                .buffer_unordered(LAUNCHES_IN_FLIGHT)
                .collect()
                .await;
                Input::Launched(results)
            }
            Effect::RmDown { down_for } => {
                // Keep retrying with the back-off; running tasks keep running.
                if let Some(reason) = pause(backoff.rm_retry(down_for), stop).await {
                    observer.observe(machine.step(Input::Kill(reason), Now::real()).events);
                }
                tick = Instant::now();
                Input::Heartbeat
            }
            Effect::Idle { busy } => {
                let wait = if busy { Duration::from_millis(5) } else { heartbeat };
                if let Some(reason) = pause(wait.saturating_sub(tick.elapsed()), stop).await {
                    observer.observe(machine.step(Input::Kill(reason), Now::real()).events);
                }
                tick = Instant::now();
                Input::Heartbeat
            }
            Effect::Done(end) => return end,
        };
    }
}

/// Waits `d`, or less if a stop comes (its reason).
async fn pause(d: Duration, stop: &mut mpsc::UnboundedReceiver<String>) -> Option<String> {
    tokio::select! {
        _ = tokio::time::sleep(d) => None,
        Some(r) = stop.recv() => Some(r),
    }
}

/// Calls `f` until it answers, up to `attempts` times, backing off (`am::backoff`) while the
/// RM does not answer or answers 503; any other refusal is returned at once.
pub async fn with_retries<T, F, Fut>(what: &str, attempts: u32, backoff: &mut Backoff, mut f: F) -> Result<T, RmError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, RmError>>,
{
    let first = Instant::now();
    let mut last = None;
    for _ in 0..attempts {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if RmFailure::from(&e).retryable => {
                tracing::warn!(error = %e, "{what} failed; retrying");
                last = Some(e);
                tokio::time::sleep(backoff.rm_retry(first.elapsed())).await;
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or(RmError::BadAnswer {
        what: what.into(),
        why: "no attempt made".into(),
    }))
}
