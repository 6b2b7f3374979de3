//! The AM's job machine: the task table of one job and every transition of it, without I/O.
//! One entry, [`JobMachine::step`]: an [`Input`] (a heartbeat is due, the RM's answer to an
//! effect, a kill) and the time, in; the [`Effect`]s to carry out (fetch the node view, send an
//! allocate call, register again, launch containers, wait) and the [`Event`]s that happened
//! (for the dashboard and metrics), out. No tokio, no HTTP, no hub: `am::driver` carries out
//! the effects against the RM and feeds the answers back; `gpuam plan` drives the same machine
//! against an in-memory RM (`am::plan_rm`). The selector it places with is pure state.
//!
//! A heartbeat is a fixed sequence of steps, each answered by the driver:
//! `Heartbeat` → [`Effect::FetchNodes`] when the node view is due → `Nodes` → the placement
//! round and the allocate call, [`Effect::Allocate`] → `Allocated` (or, when the RM restarted,
//! [`Effect::Register`] → `Registered`) → preemptions due, the gang rule, [`Effect::Launch`] →
//! `Launched` → [`Effect::Idle`] (or [`Effect::Done`] once the job has ended).
//!
//! This file owns the machine's state, its entry and the heartbeat's order; the transitions
//! live beside it by job: `place` (the placement round and the asks), `answer` (the allocate
//! answer: grants, rejections, completions, preemption notices), `tasks_end` (exits, retries,
//! the job's verdict and restart), `gang` (hold-back, launch and release), `adopt` (restart
//! adoption and resync), `report` (the events the dashboard observes).

mod adopt;
mod answer;
mod gang;
mod place;
mod report;
mod tasks_end;
#[cfg(test)]
mod tests;

use report::NodesDirty;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::exits::{classify, ExitInfo};
use super::status::{ExitType, JobState, TaskState, TaskStatus};
use super::tasks::Task;
use crate::cluster::Node;
use crate::config::AmSettings;
use crate::protocol::{
    exit_status, AllocateRequest, AllocateResponse, Container, LaunchContext, PreviousContainer, RegisterRequest,
    RegisterResponse,
};
use crate::select::{Selection, Selector};
use crate::spec::JobSpec;

/// How the job ended.
#[derive(Clone, Debug, PartialEq)]
pub struct JobEnd {
    pub state: JobState,
    pub exit_code: i32,
    pub diagnostics: String,
}

/// The time a step happens at: the monotonic clock for waits, the wall clock for what is
/// shown and sent (milliseconds since the epoch).
#[derive(Clone, Copy, Debug)]
pub struct Now {
    pub at: Instant,
    pub ms: u64,
}

impl Now {
    /// This moment (for drivers that run in real time).
    pub fn real() -> Self {
        Now {
            at: Instant::now(),
            ms: crate::protocol::now_ms(),
        }
    }

    /// `d` later.
    pub fn after(self, d: Duration) -> Self {
        Now {
            at: self.at + d,
            ms: self.ms + d.as_millis() as u64,
        }
    }
}

/// Why a call to the RM failed, as the machine needs to know it.
#[derive(Clone, Debug, PartialEq)]
pub struct RmFailure {
    /// Worth trying again (no answer, or 503): the job waits for the RM.
    pub retryable: bool,
    pub message: String,
}

impl From<&super::rm_client::RmError> for RmFailure {
    fn from(e: &super::rm_client::RmError) -> Self {
        RmFailure {
            retryable: e.is_unreachable() || e.status() == Some(503),
            message: e.to_string(),
        }
    }
}

/// The answer to one launch: started (when the node started it, by its clock, where it
/// said), or why not.
pub type LaunchAnswer = Result<Option<u64>, String>;

/// What happened, fed to [`JobMachine::step`].
#[derive(Clone, Debug)]
pub enum Input {
    /// A heartbeat is due (the driver's clock).
    Heartbeat,
    /// The job is to be killed (a signal, the dashboard, the RM).
    Kill(String),
    /// The answer to [`Effect::FetchNodes`]: the whole node view.
    Nodes(Result<Vec<Node>, RmFailure>),
    /// The answer to [`Effect::FetchNodes`]: the nodes changed since the last answer.
    NodeChanges(Result<Vec<Node>, RmFailure>),
    /// The answer to [`Effect::Allocate`].
    Allocated(Result<AllocateResponse, RmFailure>),
    /// The answer to [`Effect::Register`].
    Registered(Result<RegisterResponse, RmFailure>),
    /// The answers to [`Effect::Launch`], one per launch (in any order).
    Launched(Vec<(usize, LaunchAnswer)>),
    /// The containers of earlier attempts of this application, as registering answered
    /// (work-preserving restart): adopt them before the first heartbeat.
    Adopt(Vec<PreviousContainer>),
}

/// A container to start: the task it is for (index in the table), where, and what runs.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    pub task: usize,
    pub container: Container,
    pub context: LaunchContext,
}

/// What the driver is to do next (answer with the matching [`Input`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Effect {
    /// List the RM's nodes; answer `Nodes`.
    FetchNodes,
    /// Send this allocate call; answer `Allocated`.
    Allocate(AllocateRequest),
    /// Register again (the RM restarted); answer `Registered`.
    Register(RegisterRequest),
    /// Start these containers (concurrently); answer `Launched`.
    Launch(Vec<Launch>),
    /// The RM did not answer (for `down_for` so far): back off, then `Heartbeat` again.
    RmDown { down_for: Duration },
    /// The heartbeat is done: `Heartbeat` again after the heartbeat interval, or at once
    /// when `busy` (tasks ready to place).
    Idle { busy: bool },
    /// The job has ended (every open task is marked stopped); nothing more to step.
    Done(JobEnd),
}

/// What happened, for the dashboard and metrics (see `am::publish`).
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The job's state and per-role counts.
    Job {
        state: JobState,
        roles: Vec<super::status::RoleCounts>,
        completed: u32,
        /// Set once the job ended (with `state` final).
        end: Option<JobEnd>,
        at_ms: u64,
    },
    /// Tasks whose status changed, by index in the table.
    Tasks(Vec<(usize, TaskStatus)>),
    /// One task's selection in a placement round (`repeated`: the role's earlier answer in
    /// the same round, given again without selecting).
    Selection {
        role: String,
        index: u32,
        selection: Box<Selection>,
        repeated: bool,
        at_ms: u64,
    },
    /// The node view was replaced whole; it holds `count` nodes.
    Nodes { count: usize },
    /// The hosts of the view that changed, or left it (O(changes), not O(nodes)).
    NodesChanged(Vec<String>),
    /// The node view was fetched from the RM.
    NodesRefreshed { at_ms: u64 },
    /// Whether the RM answers.
    RmReachable(bool),
    /// A call to the RM failed.
    RmError(String),
    /// The RM asked for a resync and it was done.
    Resynced,
    /// Why the RM's queues keep this job waiting.
    QueueNote(Option<String>),
    /// Why the job waits (`reason::combine` of the queue's cause and its tasks'), when that
    /// changed.
    Reason(Option<crate::reason::Reason>),
    /// When the RM expects the job's waiting tasks to start (issue 27), when that changed.
    StartEstimate(Option<crate::protocol::StartEstimate>),
    /// A task is retried after an exit of this type.
    Retried(ExitType),
    /// An allocate call's round trip (the driver's measure).
    AllocateLatency(Duration),
    /// A container this job holds, and the node that runs it (for reading its logs).
    ContainerAt {
        container_id: String,
        node_http_address: String,
        host: String,
    },
}

impl Event {
    /// The container `c` this job now holds, on its node.
    fn container_at(c: &Container) -> Event {
        Event::ContainerAt {
            container_id: c.container_id.clone(),
            node_http_address: c.node_http_address.clone(),
            host: c.host.clone(),
        }
    }
}

/// What one step gives back.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Output {
    pub effects: Vec<Effect>,
    pub events: Vec<Event>,
}

/// Asks not answered within this time are withdrawn and placed again.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Most tasks placed per heartbeat, so a huge job still heartbeats regularly.
pub const MAX_ASKS_PER_HEARTBEAT: usize = 2000;

/// The job machine (see the module doc).
pub struct JobMachine {
    job: Arc<JobSpec>,
    app_id: String,
    selector: Arc<Selector>,
    settings: AmSettings,
    /// What this AM registered with (sent again when the RM asks for a resync).
    registration: RegisterRequest,
    tasks: Vec<Task>,
    /// Index in `tasks` of each role's first task (tasks are role by role, in spec order).
    role_first: Vec<usize>,
    by_request: HashMap<u64, usize>,
    by_container: HashMap<String, usize>,
    /// Asks the RM has seen (an answer to each comes in the same heartbeat).
    sent_asks: HashSet<u64>,
    next_request_id: u64,
    response_id: u64,
    cancels: Vec<u64>,
    releases: Vec<String>,
    /// When the node view was last fetched (`None`: fetch at the next heartbeat).
    last_refresh: Option<Instant>,
    /// Gang: when the gang started waiting with some containers held.
    gang_wait_since: Option<Instant>,
    gang_backoff_until: Option<Instant>,
    gang_launched: bool,
    /// `select.topology_wait_sec`: how long a waiting task may hold out for its ideal GPU tier.
    topology_wait: Duration,
    /// The draws of the waits (`am::backoff`): seeded, so a plan is reproducible.
    backoff: super::backoff::Backoff,
    end: Option<JobEnd>,
    /// What of the node view to report: all of it, or the hosts that changed.
    nodes_dirty: NodesDirty,
    job_retry: super::job_retry::JobRetry,
    /// Containers the RM is taking back (see `queueing`).
    preempt: super::queueing::Preemptions,
    /// Gang rounds sent so far (a gang's asks carry `gang-<round>`).
    gang_round: u64,
    /// Why the RM's queues keep this job waiting (last allocate answer).
    queue_note: Option<String>,
    /// The same, typed (last allocate answer).
    queue_reason: Option<crate::reason::Reason>,
    /// The RM's last start estimate for the job's waiting tasks.
    start_estimate: Option<crate::protocol::StartEstimate>,
    /// The job's reason last reported.
    job_reason: Option<crate::reason::Reason>,
    /// Since when the RM has not answered.
    rm_down_since: Option<Instant>,
    rm_reachable: bool,
    /// The job state last reported.
    reported_state: JobState,
    /// An impossible task fails the job (the AM); planning goes on to show the rest.
    impossible_fails: bool,
    /// The allocate call out and not yet answered.
    in_flight: Option<InFlight>,
    /// What the current step gives back.
    out: Output,
}

/// What an allocate call carried that its answer (or its failure) settles.
struct InFlight {
    asks: Vec<u64>,
    cancels: Vec<u64>,
    releases: Vec<String>,
}

impl JobMachine {
    /// A machine for `job` with every task waiting; `seed` draws its back-off jitter.
    pub fn new(
        job: Arc<JobSpec>,
        app_id: String,
        selector: Arc<Selector>,
        settings: AmSettings,
        registration: RegisterRequest,
        seed: u64,
        now: Now,
    ) -> Self {
        let mut tasks = Vec::new();
        let mut role_first = Vec::with_capacity(job.task_roles.len());
        for (ri, role) in job.task_roles.iter().enumerate() {
            role_first.push(tasks.len());
            tasks.extend((0..role.instances).map(|i| Task::at(ri, i, now.at, now.ms)));
        }
        let job_retry = super::job_retry::JobRetry::new(&job);
        let topology_wait = Duration::from_secs(selector.settings().topology_wait_sec);
        JobMachine {
            job,
            app_id,
            selector,
            settings,
            registration,
            tasks,
            role_first,
            by_request: HashMap::new(),
            by_container: HashMap::new(),
            sent_asks: HashSet::new(),
            next_request_id: 1,
            response_id: 0,
            cancels: Vec::new(),
            releases: Vec::new(),
            last_refresh: None,
            gang_wait_since: None,
            gang_backoff_until: None,
            gang_launched: false,
            topology_wait,
            backoff: super::backoff::Backoff::seeded(seed),
            end: None,
            nodes_dirty: NodesDirty::All,
            job_retry,
            preempt: Default::default(),
            gang_round: 0,
            queue_note: None,
            queue_reason: None,
            start_estimate: None,
            job_reason: None,
            rm_down_since: None,
            rm_reachable: true,
            reported_state: JobState::Starting,
            impossible_fails: true,
            in_flight: None,
            out: Output::default(),
        }
    }

    /// A machine for `gpuam plan`: a task that can never be placed does not end the job
    /// (the AM's would fail there); it waits, so the plan shows the rest of the job too.
    pub fn planning(mut self) -> Self {
        self.impossible_fails = false;
        self
    }

    /// The node view was fetched just now (by whoever built the selector): the first
    /// heartbeat does not fetch it again.
    pub fn nodes_fetched(&mut self, now: Now) {
        self.last_refresh = Some(now.at);
    }

    /// The one entry: takes `input` at `now`, gives back what to do and what happened.
    pub fn step(&mut self, input: Input, now: Now) -> Output {
        match input {
            Input::Heartbeat => self.heartbeat(now),
            Input::Kill(reason) => self.kill(&reason),
            Input::Nodes(answer) => {
                match answer {
                    Ok(nodes) => {
                        self.selector.replace_nodes(nodes);
                        self.nodes_dirty = NodesDirty::All;
                        self.out.events.push(Event::NodesRefreshed { at_ms: now.ms });
                        self.set_reachable(true);
                    }
                    Err(e) => tracing::warn!(error = %e.message, "node refresh failed"),
                }
                self.place_and_ask(now);
            }
            Input::NodeChanges(answer) => {
                if let Ok(nodes) = answer {
                    for n in nodes {
                        self.nodes_dirty.add(&n.host);
                        self.selector.apply_node_report(n);
                    }
                    self.out.events.push(Event::NodesRefreshed { at_ms: now.ms });
                    self.set_reachable(true);
                }
                self.place_and_ask(now);
            }
            Input::Allocated(Ok(resp)) => {
                if let Some(req) = self.in_flight.take() {
                    if resp.command == Some(crate::protocol::AmCommand::Resync) {
                        // The RM acted on nothing in this request: all of it goes again
                        // after registering (asks are rebuilt from the tasks still requesting).
                        self.requeue(req);
                        self.out.effects.push(Effect::Register(self.registration.clone()));
                        return std::mem::take(&mut self.out);
                    }
                    self.sent_asks.extend(req.asks);
                }
                self.apply_answer(resp, now);
                self.rm_answered();
                self.after_answer(now);
            }
            Input::Allocated(Err(e)) => {
                if let Some(req) = self.in_flight.take() {
                    // Keep the cancels and releases for the retry; asks are rebuilt.
                    self.requeue(req);
                }
                self.rm_failed(e, now);
            }
            Input::Registered(Ok(registered)) => {
                self.out.events.push(Event::Resynced);
                self.reconcile(&registered.containers_from_previous_attempts, now);
                // The node view may have changed while the RM was away.
                self.last_refresh = None;
                self.rm_answered();
                self.after_answer(now);
            }
            Input::Registered(Err(e)) => self.rm_failed(e, now),
            Input::Adopt(previous) => self.adopt(&previous, now),
            Input::Launched(results) => {
                self.launched(results, now);
                self.end_heartbeat(now);
            }
        }
        std::mem::take(&mut self.out)
    }

    /// Whether the job has ended.
    pub fn ended(&self) -> Option<&JobEnd> {
        self.end.as_ref()
    }

    /// The task table.
    pub fn tasks(&self) -> &[Task] {
        &self.tasks
    }

    /// The job.
    pub fn job(&self) -> &JobSpec {
        &self.job
    }

    /// Every task's status (the dashboard's first task list).
    pub fn statuses(&self) -> Vec<TaskStatus> {
        self.tasks.iter().map(|t| t.status(&self.job)).collect()
    }

    /// The earliest time a waiting task may be placed again (after a back-off), if any
    /// task waits for one.
    pub fn next_ready(&self) -> Option<Instant> {
        let task = self
            .tasks
            .iter()
            .filter(|t| t.state == TaskState::TaskWaiting)
            .filter_map(|t| t.not_before)
            .min();
        match (task, self.gang_backoff_until) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    fn heartbeat(&mut self, now: Now) {
        if self.end.is_some() {
            self.finish(now);
            return;
        }
        // Only a job with something to place needs the node view fresh; the allocate
        // answers bring an idle one the changed nodes anyway.
        let due = !self.idle()
            && self.last_refresh.is_none_or(|t| {
                now.at.saturating_duration_since(t) >= Duration::from_millis(self.settings.node_refresh_interval_ms)
            });
        if due {
            self.last_refresh = Some(now.at);
            self.out.effects.push(Effect::FetchNodes);
        } else {
            self.place_and_ask(now);
        }
    }

    /// Nothing to place, ask for, launch or give back: every task runs or is done, no
    /// preemption notice is open and the job has not ended. Its heartbeat may be held by
    /// the RM (`am.idle_hold_ms`).
    pub(super) fn idle(&self) -> bool {
        self.end.is_none()
            && self.preempt.is_empty()
            && self
                .tasks
                .iter()
                .all(|t| matches!(t.state, TaskState::ContainerRunning | TaskState::TaskCompleted))
    }

    fn kill(&mut self, reason: &str) {
        if self.end.is_none() {
            self.end = Some(JobEnd {
                state: JobState::Killed,
                exit_code: 1,
                diagnostics: format!("killed: {reason}"),
            });
        }
    }

    /// An allocate call that was not acted on: its cancels and releases go again.
    fn requeue(&mut self, req: InFlight) {
        self.cancels.extend(req.cancels);
        self.releases.extend(req.releases);
    }

    fn set_reachable(&mut self, reachable: bool) {
        if self.rm_reachable != reachable {
            self.rm_reachable = reachable;
            self.out.events.push(Event::RmReachable(reachable));
        }
    }

    fn rm_answered(&mut self) {
        self.rm_down_since = None;
        self.set_reachable(true);
    }

    /// A heartbeat's call failed: a refusal fails the job; no answer is waited out (running
    /// tasks keep running) until `am.rm_unreachable_timeout_sec`.
    fn rm_failed(&mut self, e: RmFailure, now: Now) {
        tracing::warn!(error = %e.message, "allocate failed; retrying");
        self.out.events.push(Event::RmError(e.message.clone()));
        self.rm_reachable = false;
        self.out.events.push(Event::RmReachable(false));
        let since = *self.rm_down_since.get_or_insert(now.at);
        let down_for = now.at.saturating_duration_since(since);
        let limit = Duration::from_secs(self.settings.rm_unreachable_timeout_sec);
        if !e.retryable {
            self.end = Some(JobEnd {
                state: JobState::Failed,
                exit_code: 1,
                diagnostics: format!("the RM refused the heartbeat: {}", e.message),
            });
        } else if down_for >= limit {
            self.end = Some(JobEnd {
                state: JobState::Failed,
                exit_code: crate::exit::RM_UNREACHABLE,
                diagnostics: format!(
                    "the RM has been unreachable for {} s (am.rm_unreachable_timeout_sec): giving up; last error: {}",
                    limit.as_secs(),
                    e.message
                ),
            });
        }
        if self.end.is_some() {
            self.finish(now);
        } else {
            self.out.effects.push(Effect::RmDown { down_for });
        }
    }

    /// After the allocate answer (or the resync): preemptions due, then the gang rule and
    /// the launches.
    fn after_answer(&mut self, now: Now) {
        self.release_preempted(now);
        match self.launches_due(now) {
            Some(launches) if !launches.is_empty() => self.out.effects.push(Effect::Launch(launches)),
            _ => self.end_heartbeat(now),
        }
    }

    fn end_heartbeat(&mut self, now: Now) {
        self.report(now);
        if self.end.is_some() {
            self.finish(now);
            return;
        }
        let busy = self
            .tasks
            .iter()
            .any(|t| t.state == TaskState::TaskWaiting && t.not_before.is_none());
        self.out.effects.push(Effect::Idle { busy });
    }

    /// At the end: tasks still open are marked completed (stopped on job end).
    fn finish(&mut self, now: Now) {
        let Some(end) = self.end.clone() else { return };
        for t in &mut self.tasks {
            if let Some(r) = t.request.take() {
                self.selector.remove_requested(&r.host, &r.resources, false);
            }
            if t.state != TaskState::TaskCompleted {
                if t.holds_container() {
                    t.exit = Some((
                        classify(exit_status::KILLED_AFTER_APP_COMPLETION, "", &self.settings),
                        "stopped when the job ended".into(),
                    ));
                }
                t.completed_ms = Some(now.ms);
                t.set_state(TaskState::TaskCompleted);
            }
        }
        self.report_job(end.state, now);
        self.report(now);
        self.out.effects.push(Effect::Done(end));
    }

    /// A task's identity as asks and containers carry it: `role/index`.
    fn task_name(&self, t: &Task) -> String {
        format!("{}/{}", self.job.task_roles[t.role].name, t.index)
    }

    /// The task a `role/index` name stands for.
    fn task_named(&self, name: &str) -> Option<usize> {
        let (role, index) = crate::protocol::split_task(name);
        let index = index?;
        self.tasks
            .iter()
            .position(|x| x.index == index && self.job.task_roles[x.role].name == role)
    }

    /// Classifies an exit the RM reported.
    fn classify(&self, raw: i32, diagnostics: &str) -> ExitInfo {
        classify(raw, diagnostics, &self.settings)
    }
}
