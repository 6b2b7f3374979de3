//! The AM's driver: the one async loop that runs a [`JobMachine`] in real time. It carries out
//! the machine's effects against the RM (the [`AmRm`] trait; the REST client implements it),
//! feeds the answers back, hands the events to an [`Observer`], and owns the timing: the
//! heartbeat interval, and the one back-off (`am::backoff`) while the RM does not answer —
//! for the heartbeat as for the calls around it ([`with_retries`]). It decides nothing.

use std::future::Future;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::backoff::Backoff;
use super::machine::{Effect, Event, Input, JobEnd, JobMachine, Launch, LaunchAnswer, Now, RmFailure};
use super::rm_client::{RmClient, RmError};
use crate::cluster::rm_json::NodeListing;
use crate::protocol::{
    AllocateRequest, AllocateResponse, RegisterRequest, RegisterResponse, StartContainer, StartContainers,
    StartedContainers,
};

/// The RM as the AM's driver calls it.
pub trait AmRm: Sync {
    /// The node listing's changes since the last one read, or the whole listing.
    fn node_changes(&self) -> impl Future<Output = Result<NodeListing, RmError>> + Send;
    fn allocate(&self, req: &AllocateRequest) -> impl Future<Output = Result<AllocateResponse, RmError>> + Send;
    fn register(&self, req: &RegisterRequest) -> impl Future<Output = Result<RegisterResponse, RmError>> + Send;
    /// Starts each launch's context in its granted container; one result per launch, in
    /// order (the error's words on failure).
    fn start_all(&self, launches: &[Launch]) -> impl Future<Output = Vec<LaunchAnswer>> + Send;
}

/// How long a container start is sent again while the RM does not answer.
const START_UNREACHABLE_FOR: Duration = Duration::from_secs(120);

/// Start calls (each of up to `protocol::MAX_STARTS_PER_CALL` starts) one AM has in flight
/// at once: each is a connection to the RM, and the AMs on the RM's host share its
/// per-peer connection cap.
pub const LAUNCHES_IN_FLIGHT: usize = 4;

/// Starts per call an AM sends (at most `protocol::MAX_STARTS_PER_CALL`): a task runs as
/// `ContainerRunning` once its call is answered (its launch time is the node's
/// `startedMs`), so smaller calls tell the AM sooner.
const STARTS_PER_CALL: usize = 16;

/// Launch contexts (their JSON) one start call carries at most, far below the RM's body
/// limit (1 MiB); a context larger than this goes alone, as a single start would.
const START_CALL_BYTES: usize = 256 * 1024;

/// `indices` cut into start calls: at most [`STARTS_PER_CALL`] starts and about
/// [`START_CALL_BYTES`] of contexts each (`size` of each launch).
fn start_calls(indices: &[usize], size: impl Fn(usize) -> usize) -> Vec<Vec<usize>> {
    let per_call = STARTS_PER_CALL.min(crate::protocol::MAX_STARTS_PER_CALL);
    let mut calls: Vec<Vec<usize>> = Vec::new();
    let mut bytes = 0;
    for &i in indices {
        let s = size(i);
        match calls.last_mut() {
            Some(call) if call.len() < per_call && bytes + s <= START_CALL_BYTES => {
                call.push(i);
                bytes += s;
            }
            _ => {
                calls.push(vec![i]);
                bytes = s;
            }
        }
    }
    calls
}

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
    /// The starts go in calls ([`start_calls`]: one per address that
    /// serves the containers' nodes), [`LAUNCHES_IN_FLIGHT`] at once. A call whose answer
    /// never came (the RM went down meanwhile) may have started its tasks: it is sent
    /// again until the RM answers (the RM answers a repeated start of a running container
    /// with its status), so a task is never run twice because one answer was lost. Given
    /// up after [`START_UNREACHABLE_FOR`].
    async fn start_all(&self, launches: &[Launch]) -> Vec<LaunchAnswer> {
        use futures::StreamExt as _;
        let mut by_address: std::collections::BTreeMap<&str, Vec<usize>> = Default::default();
        for (i, l) in launches.iter().enumerate() {
            by_address
                .entry(l.container.node_http_address.as_str())
                .or_default()
                .push(i);
        }
        let calls: Vec<(String, Vec<usize>)> = by_address
            .into_iter()
            .flat_map(|(address, all)| {
                let size = |i: usize| serde_json::to_vec(&launches[i].context).map_or(0, |v| v.len());
                start_calls(&all, size)
                    .into_iter()
                    .map(|c| (address.to_string(), c))
                    .collect::<Vec<_>>()
            })
            .collect();
        let calls: Vec<_> = calls
            .into_iter()
            .map(|(address, which)| async move {
                let body = StartContainers {
                    containers: which
                        .iter()
                        .map(|&i| StartContainer {
                            host: launches[i].container.host.clone(),
                            container_id: launches[i].container.container_id.clone(),
                            context: launches[i].context.clone(),
                        })
                        .collect(),
                };
                let since = Instant::now();
                let answer = loop {
                    match self.start_containers(&address, &body).await {
                        Err(e) if e.is_unreachable() && since.elapsed() < START_UNREACHABLE_FOR => {
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                        r => break r,
                    }
                };
                (which, answer)
            })
            .collect();
        let answers: Vec<(Vec<usize>, Result<StartedContainers, RmError>)> = futures::stream::iter(calls)
            .buffer_unordered(LAUNCHES_IN_FLIGHT)
            .collect()
            .await;
        let mut out: Vec<LaunchAnswer> = vec![Err("no answer to its start".to_string()); launches.len()];
        for (which, answer) in answers {
            match answer {
                Ok(a) => {
                    for &i in &which {
                        let id = &launches[i].container.container_id;
                        out[i] = match a.results.iter().find(|r| &r.container_id == id) {
                            Some(r) => match &r.error {
                                None => Ok(r.status.as_ref().and_then(|s| s.started_ms)),
                                Some(e) => Err(format!("the RM refused container start ({}): {}", e.status, e.message)),
                            },
                            None => Err(format!("the RM's answer to the start call has no result for {id}")),
                        };
                    }
                }
                Err(e) => {
                    for &i in &which {
                        out[i] = Err(e.to_string());
                    }
                }
            }
        }
        out
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
                // Many starts per call (a 1,000-task job must not wait for 1,000 round trips
                // in a row, nor open 1,000 connections).
                let results = launches
                    .iter()
                    .map(|l| l.task)
                    .zip(rm.start_all(&launches).await)
                    .collect();
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Start calls carry at most 16 starts and about 256 KiB of contexts; a larger
    /// context goes alone; every launch is in exactly one call, in order.
    #[test]
    fn start_calls_are_cut_by_count_and_by_size() {
        let all: Vec<usize> = (0..40).collect();
        let calls = start_calls(&all, |_| 100);
        assert_eq!(calls.iter().map(Vec::len).collect::<Vec<_>>(), vec![16, 16, 8]);
        let sizes = [100, 200 * 1024, 100 * 1024, 2 << 20, 10];
        let calls = start_calls(&[0, 1, 2, 3, 4], |i| sizes[i]);
        assert_eq!(calls, vec![vec![0, 1], vec![2], vec![3], vec![4]]);
        assert_eq!(calls.concat(), vec![0, 1, 2, 3, 4]);
    }
}
