//! The AM control loop: a single task that owns the task table and, once per
//! heartbeat, places waiting tasks, talks to the RM (asks, cancels, releases in one
//! allocate call), applies what comes back, launches, and decides retries and the
//! job's end. Everything that changes a task's state happens here, in order, which
//! is the original's single-threaded transition queue made into one loop.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng;
use serde_json::json;
use tokio::sync::mpsc;

use super::exits::{
    check_completion, classify, decide_retry, retry_delay, ExitInfo, JobVerdict, RetryDecision, RetrySpacing, RoleTally,
};
use super::rm_client::{RmClient, RmError};
use super::status::{
    Command, ExitType, JobState, NodeStatus, RoleCounts, SelectionRecord, StatusHub, TaskState, SELECTION_HISTORY,
};
use super::tasks::{launch_context, now_ms, peer_address, Outstanding, Task};
use crate::cluster::rm_json::parse_node_value;
use crate::config::AmSettings;
use crate::protocol::{
    exit_status, AllocateRequest, AmCommand, Ask, CompletedContainer, Container, ContainerState, PreemptNotice,
    PreviousContainer, RegisterRequest,
};
use crate::resources::{mask_hex, mask_indices};
use crate::select::{assign_port_labels, Outcome, PlacementRound, Selector};
use crate::spec::JobSpec;

/// How the job ended.
#[derive(Clone, Debug, PartialEq)]
pub struct JobEnd {
    pub state: JobState,
    pub exit_code: i32,
    pub diagnostics: String,
}

/// Asks not answered within this time are withdrawn and placed again.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Most tasks placed per heartbeat, so a huge job still heartbeats regularly.
const MAX_ASKS_PER_HEARTBEAT: usize = 2000;

pub struct Control {
    pub job: Arc<JobSpec>,
    pub app_id: String,
    pub rm: RmClient,
    pub selector: Arc<Selector>,
    pub hub: Arc<StatusHub>,
    pub settings: AmSettings,
    pub commands: mpsc::UnboundedReceiver<Command>,
    /// container id → (executor address, host), for reading logs.
    pub container_addrs: Arc<parking_lot::Mutex<HashMap<String, (String, String)>>>,
    /// What this AM registered with (sent again when the RM asks for a resync).
    pub registration: RegisterRequest,
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
    last_refresh: Option<Instant>,
    /// Gang: when the gang started waiting with some containers held.
    gang_wait_since: Option<Instant>,
    gang_backoff_until: Option<Instant>,
    gang_launched: bool,
    /// `select.topology_wait_sec`: how long a waiting task may hold out for its ideal GPU tier.
    topology_wait: Duration,
    rng: rand::rngs::StdRng,
    end: Option<JobEnd>,
    nodes_dirty: bool,
    job_retry: super::job_retry::JobRetry,
    /// Containers the RM is taking back (see `queueing`).
    preempt: super::queueing::Preemptions,
    /// Gang rounds sent so far (a gang's asks carry `gang-<round>`).
    gang_round: u64,
    /// Why the RM's queues keep this job waiting (last allocate answer).
    queue_note: Option<String>,
}

impl Control {
    pub fn new(
        job: Arc<JobSpec>,
        app_id: String,
        rm: RmClient,
        selector: Arc<Selector>,
        hub: Arc<StatusHub>,
        settings: AmSettings,
        commands: mpsc::UnboundedReceiver<Command>,
    ) -> Self {
        let mut tasks = Vec::new();
        let mut role_first = Vec::with_capacity(job.task_roles.len());
        for (ri, role) in job.task_roles.iter().enumerate() {
            role_first.push(tasks.len());
            tasks.extend((0..role.instances).map(|i| Task::new(ri, i)));
        }
        let job_retry = super::job_retry::JobRetry::new(&job);
        let topology_wait = Duration::from_secs(selector.settings().topology_wait_sec);
        Control {
            job,
            app_id,
            rm,
            selector,
            hub,
            settings,
            commands,
            container_addrs: Arc::default(),
            registration: RegisterRequest::default(),
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
            rng: rand::SeedableRng::from_entropy(),
            end: None,
            nodes_dirty: true,
            job_retry,
            preempt: Default::default(),
            gang_round: 0,
            queue_note: None,
        }
    }

    /// Runs until the job ends (or is killed); returns how it ended.
    pub async fn run(mut self, mut shutdown: mpsc::UnboundedReceiver<String>) -> JobEnd {
        self.publish_job(JobState::Waiting);
        let heartbeat = Duration::from_millis(self.settings.heartbeat_interval_ms.max(10));
        let mut rm_down_since: Option<Instant> = None;
        while self.end.is_none() {
            let tick = Instant::now();
            while let Ok(c) = self.commands.try_recv() {
                match c {
                    Command::Kill { reason } => self.kill(&reason),
                }
            }
            if let Ok(reason) = shutdown.try_recv() {
                self.kill(&reason);
            }
            if self.end.is_some() {
                break;
            }
            self.refresh_nodes_if_due().await;
            self.place_waiting();
            match self.heartbeat().await {
                Ok(()) => rm_down_since = None,
                Err(e) => {
                    self.hub
                        .counters
                        .rm_errors
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let since = *rm_down_since.get_or_insert(tick);
                    tracing::warn!(error = %e, "allocate failed; retrying");
                    self.hub
                        .update("job", json!({"rmReachable": false}), |s| s.rm_reachable = false);
                    if !e.is_unreachable() && e.status() != Some(503) {
                        self.end = Some(JobEnd {
                            state: JobState::Failed,
                            exit_code: 1,
                            diagnostics: format!("the RM refused the heartbeat: {e}"),
                        });
                        break;
                    }
                    let limit = Duration::from_secs(self.settings.rm_unreachable_timeout_sec);
                    if since.elapsed() >= limit {
                        self.end = Some(JobEnd {
                            state: JobState::Failed,
                            exit_code: crate::exit::RM_UNREACHABLE,
                            diagnostics: format!(
                                "the RM has been unreachable for {} s (am.rm_unreachable_timeout_sec): giving up; \
                                 last error: {e}",
                                limit.as_secs()
                            ),
                        });
                        break;
                    }
                    // Keep retrying with a capped, jittered back-off; running tasks keep running.
                    let waited = since.elapsed().as_millis() as u64;
                    let backoff = (200 + waited / 4).min(5000);
                    let jitter = self.rng.gen_range(0..=backoff / 2);
                    tokio::time::sleep(Duration::from_millis(backoff + jitter)).await;
                    continue;
                }
            }
            self.release_preempted();
            self.gang_and_launch().await;
            self.publish();
            if self.end.is_none() {
                let busy = self
                    .tasks
                    .iter()
                    .any(|t| t.state == TaskState::TaskWaiting && t.not_before.is_none());
                let pause = if busy { Duration::from_millis(5) } else { heartbeat };
                tokio::select! {
                    _ = tokio::time::sleep(pause.saturating_sub(tick.elapsed())) => {}
                    Some(r) = shutdown.recv() => self.kill(&r),
                }
            }
        }
        let end = self.end.clone().unwrap_or(JobEnd {
            state: JobState::Failed,
            exit_code: 1,
            diagnostics: "control loop ended without a verdict".into(),
        });
        self.finish_tasks(&end);
        self.publish();
        end
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

    async fn refresh_nodes_if_due(&mut self) {
        let due = self
            .last_refresh
            .is_none_or(|t| t.elapsed() >= Duration::from_millis(self.settings.node_refresh_interval_ms));
        if !due {
            return;
        }
        self.last_refresh = Some(Instant::now());
        match self.rm.nodes().await {
            Ok(nodes) => {
                self.selector.replace_nodes(nodes);
                self.nodes_dirty = true;
                self.hub.update("nodes", json!({"refreshed": true}), |s| {
                    s.nodes_refreshed_ms = now_ms();
                    s.rm_reachable = true;
                });
            }
            Err(e) => tracing::warn!(error = %e, "node refresh failed"),
        }
    }

    /// A task's identity as asks and containers carry it: `role/index`.
    fn task_name(&self, t: &Task) -> String {
        format!("{}/{}", self.job.task_roles[t.role].name, t.index)
    }

    /// The task a `role/index` name stands for.
    fn task_named(&self, name: &str) -> Option<usize> {
        let (role, index) = name.rsplit_once('/')?;
        let index: u32 = index.parse().ok()?;
        self.tasks
            .iter()
            .position(|x| x.index == index && self.job.task_roles[x.role].name == role)
    }

    /// Asks for the waiting tasks: one [`PlacementRound`] in request order (the same round
    /// `gpuam plan` runs), each placement becoming an outstanding ask; a role that finds no
    /// place backs off as a whole, an impossible task fails the job.
    fn place_waiting(&mut self) {
        if self.gang_backoff_until.is_some_and(|t| Instant::now() < t) {
            return;
        }
        self.gang_backoff_until = None;
        let now = Instant::now();
        let job = self.job.clone();
        let mut round = PlacementRound::new(&job, |ri, i| {
            self.tasks[self.role_first[ri] + i as usize].slot(now, self.topology_wait)
        });
        let mut asked = 0;
        // One back-off per role and round: its tasks are alike.
        let mut role_wait: HashMap<usize, Instant> = HashMap::new();
        // A gang is asked for whole (see `hold_back_partial_gang`): never cut short.
        let whole_gang = self.job.gang && !self.gang_launched;
        while let Some((ri, index)) = round.next_task() {
            if asked >= MAX_ASKS_PER_HEARTBEAT && !whole_gang {
                break;
            }
            let ti = self.role_first[ri] + index as usize;
            let step = round.place(&self.selector, (ri, index));
            let role_name = job.task_roles[ri].name.clone();
            if !step.repeated {
                self.record_selection(&role_name, index, &step.selection);
            }
            match step.selection.outcome {
                Outcome::Placed(p) => {
                    let id = self.next_request_id;
                    self.next_request_id += 1;
                    asked += 1;
                    let t = &mut self.tasks[ti];
                    t.request = Some(Outstanding {
                        request_id: id,
                        host: p.host,
                        resources: p.resources,
                        sent: now,
                    });
                    t.waiting_reason = None;
                    t.not_before = None;
                    t.set_state(TaskState::ContainerRequested);
                    self.by_request.insert(id, ti);
                }
                Outcome::NotNow { reason } => {
                    let (lo, hi) = (
                        self.settings.not_available_retry_min_ms,
                        self.settings.not_available_retry_max_ms,
                    );
                    let rng = &mut self.rng;
                    let until = *role_wait
                        .entry(ri)
                        .or_insert_with(|| now + Duration::from_millis(rng.gen_range(lo..=hi.max(lo))));
                    let t = &mut self.tasks[ti];
                    t.not_before = Some(until);
                    if t.waiting_reason.as_deref() != Some(reason.as_str()) {
                        t.waiting_reason = Some(reason);
                        t.dirty = true;
                    }
                }
                Outcome::Impossible { reason } => {
                    let t = &mut self.tasks[ti];
                    t.waiting_reason = Some(format!("can never fit this cluster: {reason}"));
                    t.dirty = true;
                    self.end = Some(JobEnd {
                        state: JobState::Failed,
                        exit_code: 1,
                        diagnostics: format!("task {role_name}/{index} can never be placed on this cluster: {reason}"),
                    });
                    return;
                }
            }
        }
    }

    /// Counts a selection's drops per stage and keeps it for the dashboard.
    fn record_selection(&self, role: &str, index: u32, sel: &crate::select::Selection) {
        {
            let mut filtered = self.hub.counters.filtered_per_stage.lock();
            for st in &sel.trace.stages {
                *filtered.entry(st.stage).or_insert(0) += st.dropped.iter().map(|g| g.count as u64).sum::<u64>();
            }
        }
        let record = selection_record(role, index, sel);
        self.hub
            .update("selection", json!({"role": role, "index": index}), |s| {
                s.selections.push_back(record);
                while s.selections.len() > SELECTION_HISTORY {
                    s.selections.pop_front();
                }
            });
    }

    async fn heartbeat(&mut self) -> Result<(), RmError> {
        let now = Instant::now();
        // Withdraw asks the RM has not answered in time and place them again.
        for ti in 0..self.tasks.len() {
            let timed_out = self.tasks[ti]
                .request
                .as_ref()
                .filter(|r| {
                    self.tasks[ti].state == TaskState::ContainerRequested
                        && now.duration_since(r.sent) > REQUEST_TIMEOUT
                })
                .cloned();
            if let Some(r) = timed_out {
                self.sent_asks.remove(&r.request_id);
                self.cancels.push(r.request_id);
                self.by_request.remove(&r.request_id);
                self.selector.remove_requested(&r.host, &r.resources, true);
                let t = &mut self.tasks[ti];
                t.waiting_reason = Some(format!("the ask on {} timed out", r.host));
                t.reset_to_waiting();
            }
        }
        self.hold_back_partial_gang(now);
        let gang = (self.job.gang && !self.gang_launched).then(|| format!("gang-{}", self.gang_round));
        let asks: Vec<Ask> = self
            .tasks
            .iter()
            .filter(|t| t.state == TaskState::ContainerRequested)
            .filter_map(|t| t.request.as_ref().map(|r| (t, r)))
            .filter(|(_, r)| !self.sent_asks.contains(&r.request_id))
            .map(|(t, r)| Ask {
                task: Some(self.task_name(t)),
                task_attempt: t.attempt,
                gang: gang.clone(),
                ..Ask::for_resources(r.request_id, &r.host, &r.resources)
            })
            .collect();
        if gang.is_some() && !asks.is_empty() {
            self.gang_round += 1;
        }
        let req = AllocateRequest {
            response_id: self.response_id,
            progress: self.progress(),
            asks,
            cancels: std::mem::take(&mut self.cancels),
            releases: std::mem::take(&mut self.releases),
            waiting: Some(super::queueing::waiting_demand(&self.job, &self.tasks)),
        };
        let started = Instant::now();
        let resp = match self.rm.allocate(&req).await {
            Ok(r) if r.command == Some(AmCommand::Resync) => {
                // The RM acted on nothing in this request: all of it goes again after
                // registering (asks are rebuilt from the tasks still requesting).
                self.cancels.extend(req.cancels);
                self.releases.extend(req.releases);
                return self.resync().await;
            }
            Ok(r) => r,
            Err(e) => {
                // Keep the cancels and releases for the retry; asks are rebuilt.
                self.cancels.extend(req.cancels);
                self.releases.extend(req.releases);
                return Err(e);
            }
        };
        for a in &req.asks {
            self.sent_asks.insert(a.request_id);
        }
        self.hub.counters.allocate_latency.observe(started.elapsed());
        self.response_id = resp.response_id;
        for v in &resp.updated_nodes {
            match parse_node_value(v) {
                Ok(n) => {
                    self.selector.apply_node_report(n);
                    self.nodes_dirty = true;
                }
                Err(e) => tracing::warn!(error = %e, "ignoring an updated node the AM cannot read"),
            }
        }
        for rej in resp.rejected {
            self.sent_asks.remove(&rej.request_id);
            let Some(ti) = self.by_request.remove(&rej.request_id) else {
                continue;
            };
            let t = &mut self.tasks[ti];
            if let Some(r) = t.request.take() {
                self.selector.remove_requested(&r.host, &r.resources, true);
                t.waiting_reason = Some(format!("ask on {} rejected: {}", r.host, rej.reason));
            }
            t.reset_to_waiting();
            if !rej.retryable {
                // The RM says this exact ask can never be granted; a fresh selection
                // with the node view refreshed will choose differently.
                self.last_refresh = None;
            }
        }
        for c in resp.allocated {
            self.accept_container(c);
        }
        self.take_preemptions(&resp.preempt);
        for c in resp.completed {
            self.container_completed(c);
        }
        self.set_queue_note(resp.waiting_reason);
        if resp.command == Some(AmCommand::Shutdown) {
            self.kill("the application was killed at the RM");
        }
        if !self.hub.read(|s| s.rm_reachable) {
            self.hub
                .update("job", json!({"rmReachable": true}), |s| s.rm_reachable = true);
        }
        Ok(())
    }

    /// The RM restarted (its heartbeat said RESYNC): register again and line up what
    /// this AM believes with what the RM recovered. Running tasks are not touched.
    async fn resync(&mut self) -> Result<(), RmError> {
        tracing::warn!("the RM asked this AM to register again (it restarted); resyncing");
        let registered = self.rm.register(&self.registration).await?;
        self.hub
            .counters
            .rm_resyncs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.reconcile(&registered.containers_from_previous_attempts);
        // The node view may have changed while the RM was away.
        self.last_refresh = None;
        self.hub
            .update("job", json!({"rmReachable": true, "resynced": true}), |s| {
                s.rm_reachable = true
            });
        Ok(())
    }

    /// Lines up this AM's containers with the RM's list of the application's
    /// containers (after a resync):
    /// - one the RM granted for an ask still outstanding here (the answer was lost when
    ///   the RM went down) is taken as if that answer had arrived;
    /// - other live ones unknown here are released;
    /// - one held here that the RM reports completed ends now with the RM's exit status
    ///   (the same completion arriving later in a heartbeat finds nothing to do);
    /// - one held here that the RM does not know at all is lost: -7151
    ///   (CONTAINER_RM_RESYNC_LOST, transient), as frameworklauncher's resync does.
    fn reconcile(&mut self, rm_view: &[PreviousContainer]) {
        let by_id: HashMap<&str, &PreviousContainer> =
            rm_view.iter().map(|p| (p.container.container_id.as_str(), p)).collect();
        let mut answered = 0;
        for p in rm_view {
            let c = &p.container;
            if p.state == ContainerState::Complete || self.by_container.contains_key(&c.container_id) {
                continue;
            }
            let ours = self.by_request.get(&c.request_id).is_some_and(|&ti| {
                let t = &self.tasks[ti];
                c.task.as_deref() == Some(self.task_name(t).as_str()) && c.task_attempt == t.attempt
            });
            if ours {
                answered += 1;
                self.accept_container(c.clone());
            } else if !self.releases.contains(&c.container_id) {
                self.releases.push(c.container_id.clone());
            }
        }
        let held: Vec<String> = self.by_container.keys().cloned().collect();
        let mut lost = 0;
        for cid in held {
            let completed = match by_id.get(cid.as_str()) {
                Some(p) if p.state == ContainerState::Complete => CompletedContainer {
                    container_id: cid,
                    exit_status: p.exit_status.unwrap_or(exit_status::ABORTED),
                    diagnostics: p.diagnostics.clone(),
                },
                Some(_) => continue,
                None => {
                    lost += 1;
                    CompletedContainer {
                        container_id: cid,
                        exit_status: super::exits::code::CONTAINER_RM_RESYNC_LOST,
                        diagnostics: "the RM does not know this container after its restart".into(),
                    }
                }
            };
            self.container_completed(completed);
        }
        tracing::info!(answered, lost, released = self.releases.len(), "resync done");
    }

    /// Checks a granted container against its ask and takes it, or gives it back.
    fn accept_container(&mut self, c: Container) {
        let Some(ti) = self.by_request.remove(&c.request_id) else {
            tracing::warn!(container = %c.container_id, "container for no outstanding ask; releasing");
            self.releases.push(c.container_id);
            return;
        };
        self.sent_asks.remove(&c.request_id);
        let t = &mut self.tasks[ti];
        let Some(req) = t.request.take() else {
            self.releases.push(c.container_id);
            return;
        };
        let role = &self.job.task_roles[t.role];
        let same = c.host == req.host
            && c.resources.gpu_mask == req.resources.gpu_mask
            && c.resources.gpu_count() == req.resources.gpu_mask.count_ones()
            && c.resources.gpu_shares == req.resources.gpu_shares
            && c.resources.ports == req.resources.ports
            && c.resources.cpu == req.resources.cpu
            && c.resources.memory_mb == req.resources.memory_mb
            && c.resources.custom == req.resources.custom;
        let labelled = assign_port_labels(&role.resources, &c.resources.ports);
        self.selector.remove_requested(&req.host, &req.resources, !same);
        match (same, labelled) {
            (true, Some(ports)) => {
                t.ports = ports;
                t.waiting_reason = None;
                self.by_container.insert(c.container_id.clone(), ti);
                self.container_addrs
                    .lock()
                    .insert(c.container_id.clone(), (c.node_http_address.clone(), c.host.clone()));
                t.container = Some(c);
                t.set_state(TaskState::ContainerAllocated);
            }
            _ => {
                tracing::warn!(container = %c.container_id, host = %c.host, "granted container differs from the ask; releasing");
                t.waiting_reason = Some(format!(
                    "the RM granted {} on {} instead of what was asked on {}; released",
                    mask_hex(c.resources.gpu_mask),
                    c.host,
                    req.host
                ));
                self.releases.push(c.container_id);
                t.reset_to_waiting();
            }
        }
    }

    fn container_completed(&mut self, c: CompletedContainer) {
        let Some(ti) = self.by_container.remove(&c.container_id) else {
            return;
        };
        // A task under a preemption notice was preempted, however it exited.
        if let Some(n) = self.preempt.remove(&c.container_id) {
            let exit = classify(exit_status::PREEMPTED, "", &self.settings);
            self.task_exited(
                ti,
                exit,
                format!("preempted: {} (it exited {})", n.reason, c.exit_status),
            );
            return;
        }
        let exit = classify(c.exit_status, &c.diagnostics, &self.settings);
        self.task_exited(ti, exit, c.diagnostics);
    }

    /// Takes the RM's preemption notices (see `queueing::Preemptions`).
    fn take_preemptions(&mut self, notices: &[PreemptNotice]) {
        if notices.is_empty() {
            return;
        }
        let (by_container, tasks) = (&self.by_container, &self.tasks);
        let new = self.preempt.take(notices, now_ms(), self.settings.stop_grace_ms, |id| {
            let t = &tasks[*by_container.get(id)?];
            Some(matches!(
                t.state,
                TaskState::ContainerLaunched | TaskState::ContainerRunning
            ))
        });
        for id in new {
            tracing::info!(container = %id, "the RM is taking this container back (preemption)");
        }
        self.release_preempted();
    }

    /// Gives back the preempted containers that are due; their tasks wait again.
    fn release_preempted(&mut self) {
        if self.preempt.is_empty() {
            return;
        }
        for id in self.preempt.due(now_ms()) {
            let Some(n) = self.preempt.remove(&id) else { continue };
            let Some(ti) = self.by_container.remove(&id) else {
                continue;
            };
            self.releases.push(id);
            let exit = classify(exit_status::PREEMPTED, "", &self.settings);
            self.task_exited(ti, exit, format!("preempted: {}", n.reason));
        }
        // A gang loses all its containers together: once none is held, it is gathered
        // again as a whole.
        if self.job.gang && self.gang_launched && !self.tasks.iter().any(|t| t.holds_container()) {
            self.gang_launched = false;
        }
    }

    /// A gang's asks go out all together (the RM grants them all or none): while some
    /// open task of the gang found no place, the ones placed this round wait with it.
    fn hold_back_partial_gang(&mut self, now: Instant) {
        if !self.job.gang || self.gang_launched {
            return;
        }
        let unplaced = self.tasks.iter().filter(|t| t.state == TaskState::TaskWaiting).count();
        if unplaced == 0 {
            return;
        }
        let total = self
            .tasks
            .iter()
            .filter(|t| t.state != TaskState::TaskCompleted)
            .count();
        let (lo, hi) = (
            self.settings.not_available_retry_min_ms,
            self.settings.not_available_retry_max_ms,
        );
        let wait = Duration::from_millis(self.rng.gen_range(lo..=hi.max(lo)));
        for ti in 0..self.tasks.len() {
            let unsent = self.tasks[ti]
                .request
                .as_ref()
                .filter(|r| {
                    self.tasks[ti].state == TaskState::ContainerRequested && !self.sent_asks.contains(&r.request_id)
                })
                .cloned();
            let Some(r) = unsent else { continue };
            self.by_request.remove(&r.request_id);
            self.selector.remove_requested(&r.host, &r.resources, false);
            let t = &mut self.tasks[ti];
            t.reset_to_waiting();
            t.not_before = Some(now + wait);
            t.waiting_reason = Some(format!(
                "gang: its {total} tasks are asked for together; {unplaced} of them find no place yet"
            ));
        }
    }

    /// Records why the RM's queues keep this job waiting, for the dashboard.
    fn set_queue_note(&mut self, note: Option<String>) {
        if note != self.queue_note {
            self.queue_note = note.clone();
            self.hub
                .update("job", json!({"queueNote": note}), |s| s.job.queue_note = note);
        }
    }

    fn task_exited(&mut self, ti: usize, exit: ExitInfo, diagnostics: String) {
        let max_retry = self.job.task_roles[self.tasks[ti].role].task_retry_count;
        let max_transient = self.settings.max_transient_retries;
        let t = &mut self.tasks[ti];
        t.set_state(TaskState::ContainerCompleted);
        let decision = decide_retry(&exit, max_retry, &mut t.retry, max_transient);
        let counter = match exit.exit_type {
            ExitType::TransientNormal | ExitType::TransientConflict => &self.hub.counters.retries_transient,
            ExitType::NonTransient => &self.hub.counters.retries_permanent,
            _ => &self.hub.counters.retries_unknown,
        };
        let succeeded = exit.exit_type == ExitType::Succeeded;
        t.exit = Some((exit, diagnostics));
        match decision {
            RetryDecision::Retry => {
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let exit = t.exit.as_ref().map(|(e, _)| e.clone());
                let delay = exit.map_or(0, |e| {
                    retry_delay(&e, &mut t.retry, now_ms(), &RetrySpacing::from_settings(&self.settings))
                });
                t.new_attempt();
                t.not_before = (delay > 0).then(|| Instant::now() + Duration::from_millis(delay));
                t.waiting_reason = Some(if delay > 0 {
                    format!(
                        "retrying in {:.1} s after the last attempt ended (back-off)",
                        delay as f64 / 1000.0
                    )
                } else {
                    "retrying after the last attempt ended".into()
                });
            }
            RetryDecision::Complete => {
                t.succeeded = Some(succeeded);
                t.completed_ms = Some(now_ms());
                t.set_state(TaskState::TaskCompleted);
                let role = self.job.task_roles[t.role].name.clone();
                let trigger_task = format!("{role}/{}", t.index);
                let code = t.exit.as_ref().map(|(e, _)| e.code).unwrap_or(1);
                let verdict = check_completion(&self.tallies(), &role, succeeded);
                match verdict {
                    JobVerdict::Running => {}
                    JobVerdict::Succeeded { trigger } => {
                        self.end = Some(JobEnd {
                            state: JobState::Succeeded,
                            exit_code: 0,
                            diagnostics: trigger,
                        })
                    }
                    JobVerdict::Failed { trigger } if self.job_retry.should_restart() => {
                        self.restart_job(&format!("{trigger}; task {trigger_task} exited with {code}"));
                    }
                    JobVerdict::Failed { trigger } => {
                        self.end = Some(JobEnd {
                            state: JobState::Failed,
                            exit_code: 1,
                            diagnostics: format!("{trigger}; task {trigger_task} exited with {code}"),
                        })
                    }
                }
            }
        }
    }

    fn tallies(&self) -> Vec<(String, RoleTally)> {
        self.job
            .task_roles
            .iter()
            .enumerate()
            .map(|(ri, r)| {
                let mut t = RoleTally {
                    instances: r.instances,
                    min_failed: r.completion.min_failed_instances,
                    min_succeeded: r.completion.min_succeeded_instances,
                    ..Default::default()
                };
                for task in self.tasks.iter().filter(|x| x.role == ri) {
                    match task.succeeded {
                        Some(true) => t.succeeded += 1,
                        Some(false) => t.failed += 1,
                        None => {}
                    }
                }
                (r.name.clone(), t)
            })
            .collect()
    }

    /// Gang rule and launching: without gang, launch every allocated task at once;
    /// with gang, launch only when every unfinished task holds a container, and give
    /// everything back if that takes longer than the gang timeout.
    async fn gang_and_launch(&mut self) {
        if self.end.is_some() {
            return;
        }
        let to_launch: Vec<usize> = if self.job.gang && !self.gang_launched {
            let open: Vec<&Task> = self
                .tasks
                .iter()
                .filter(|t| t.state != TaskState::TaskCompleted)
                .collect();
            let complete = !open.is_empty() && open.iter().all(|t| t.holds_container());
            if complete {
                self.gang_wait_since = None;
                self.gang_launched = true;
                (0..self.tasks.len())
                    .filter(|&i| self.tasks[i].state == TaskState::ContainerAllocated)
                    .collect()
            } else {
                let holding = open
                    .iter()
                    .any(|t| t.holds_container() || t.state == TaskState::ContainerRequested);
                if holding {
                    let since = *self.gang_wait_since.get_or_insert_with(Instant::now);
                    let timeout = self.job.gang_timeout_sec.unwrap_or(self.settings.gang_timeout_sec);
                    if since.elapsed() >= Duration::from_secs(timeout) {
                        self.release_gang();
                    }
                } else {
                    self.gang_wait_since = None;
                }
                Vec::new()
            }
        } else {
            (0..self.tasks.len())
                .filter(|&i| self.tasks[i].state == TaskState::ContainerAllocated)
                .collect()
        };
        if to_launch.is_empty() {
            return;
        }
        let peers = if self.job.gang { Some(self.peers()) } else { None };
        let mut launches = Vec::with_capacity(to_launch.len());
        for &ti in &to_launch {
            let t = &self.tasks[ti];
            let Some(c) = t.container.clone() else { continue };
            let ctx = launch_context(&self.job, t, &self.app_id, peers.as_ref(), &self.tasks);
            let rm = self.rm.clone();
            launches.push(async move {
                let r = rm
                    .start_container(&c.node_http_address, &c.host, &c.container_id, &ctx)
                    .await;
                (ti, r)
            });
        }
        // Launch concurrently: a 1,000-task job must not wait for 1,000 round trips in a row.
        let results = futures::future::join_all(launches).await;
        for (ti, r) in results {
            match r {
                Ok(_) => {
                    let t = &mut self.tasks[ti];
                    t.launched_ms = Some(now_ms());
                    t.set_state(TaskState::ContainerRunning);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "container launch failed");
                    if let Some(c) = self.tasks[ti].container.clone() {
                        self.by_container.remove(&c.container_id);
                        self.releases.push(c.container_id);
                    }
                    let exit = classify(super::exits::code::CONTAINER_NM_LAUNCH_FAILED, "", &self.settings);
                    self.task_exited(ti, exit, e.to_string());
                }
            }
        }
    }

    /// `jobRetryCount`: the failed job starts again (see `job_retry::reset_for_restart`).
    fn restart_job(&mut self, why: &str) {
        tracing::warn!(
            retry = self.job_retry.used(),
            "job failed ({why}); restarting it (jobRetryCount)"
        );
        let back = super::job_retry::reset_for_restart(&mut self.tasks, why);
        for r in back.requests {
            self.cancels.push(r.request_id);
            self.by_request.remove(&r.request_id);
            self.selector.remove_requested(&r.host, &r.resources, false);
        }
        for c in back.containers {
            self.by_container.remove(&c);
            self.releases.push(c);
        }
        self.gang_launched = false;
        self.gang_wait_since = None;
    }

    /// Gives back every container a gang holds and waits before trying again.
    fn release_gang(&mut self) {
        tracing::info!("gang not complete within the gang timeout; releasing what it holds");
        for ti in 0..self.tasks.len() {
            let t = &mut self.tasks[ti];
            match t.state {
                TaskState::ContainerAllocated => {
                    if let Some(c) = t.container.take() {
                        self.by_container.remove(&c.container_id);
                        self.releases.push(c.container_id);
                    }
                    t.waiting_reason = Some("gang timeout: released and waiting to try again".into());
                    t.reset_to_waiting();
                }
                TaskState::ContainerRequested => {
                    if let Some(r) = t.request.take() {
                        self.cancels.push(r.request_id);
                        self.by_request.remove(&r.request_id);
                        self.selector.remove_requested(&r.host, &r.resources, false);
                    }
                    t.waiting_reason = Some("gang timeout: waiting to try again".into());
                    t.reset_to_waiting();
                }
                _ => {}
            }
        }
        self.gang_wait_since = None;
        let backoff = self.settings.gang_retry_backoff_ms;
        let jitter = self.rng.gen_range(0..=backoff / 2);
        self.gang_backoff_until = Some(Instant::now() + Duration::from_millis(backoff + jitter));
    }

    /// role → ["host:firstPort", ...] in index order.
    fn peers(&self) -> BTreeMap<String, Vec<String>> {
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (ri, r) in self.job.task_roles.iter().enumerate() {
            let mut v: Vec<(u32, String)> = self
                .tasks
                .iter()
                .filter(|t| t.role == ri)
                .filter_map(|t| peer_address(t).map(|a| (t.index, a)))
                .collect();
            v.sort();
            out.insert(r.name.clone(), v.into_iter().map(|(_, a)| a).collect());
        }
        out
    }

    fn progress(&self) -> f32 {
        let total = self.tasks.len().max(1) as f32;
        self.tasks
            .iter()
            .filter(|t| t.state == TaskState::TaskCompleted)
            .count() as f32
            / total
    }

    /// At the end: tasks still open are marked completed (stopped on job end).
    fn finish_tasks(&mut self, end: &JobEnd) {
        for ti in 0..self.tasks.len() {
            let t = &mut self.tasks[ti];
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
                t.completed_ms = Some(now_ms());
                t.set_state(TaskState::TaskCompleted);
            }
        }
        let state = end.state;
        self.publish_job(state);
    }

    fn publish_job(&self, state: JobState) {
        let roles = self.role_counts();
        let completed = self
            .tasks
            .iter()
            .filter(|t| t.state == TaskState::TaskCompleted)
            .count() as u32;
        let end = self.end.clone();
        self.hub.update("job", json!({"state": state}), |s| {
            s.job.state = state;
            s.job.roles = roles;
            s.job.completed_tasks = completed;
            if let Some(e) = &end {
                if state.is_final() {
                    s.job.exit_code = Some(e.exit_code);
                    s.job.diagnostics = Some(e.diagnostics.clone());
                    s.job.finished_ms = Some(now_ms());
                }
            }
        });
    }

    fn role_counts(&self) -> Vec<RoleCounts> {
        self.job
            .task_roles
            .iter()
            .enumerate()
            .map(|(ri, r)| {
                let mut c = RoleCounts {
                    role: r.name.clone(),
                    instances: r.instances,
                    ..Default::default()
                };
                for t in self.tasks.iter().filter(|t| t.role == ri) {
                    match t.state {
                        TaskState::TaskWaiting | TaskState::ContainerCompleted => c.waiting += 1,
                        TaskState::ContainerRequested => c.requested += 1,
                        TaskState::ContainerAllocated | TaskState::ContainerLaunched => c.allocated += 1,
                        TaskState::ContainerRunning => c.running += 1,
                        TaskState::TaskCompleted => match t.succeeded {
                            Some(true) => c.succeeded += 1,
                            Some(false) => c.failed += 1,
                            None => c.stopped += 1,
                        },
                    }
                }
                c
            })
            .collect()
    }

    /// Publishes changed tasks, the job counters and (if changed) the node view.
    fn publish(&mut self) {
        let changed: Vec<usize> = (0..self.tasks.len()).filter(|&i| self.tasks[i].dirty).collect();
        if !changed.is_empty() {
            let statuses: Vec<_> = changed.iter().map(|&i| (i, self.tasks[i].status(&self.job))).collect();
            for &i in &changed {
                self.tasks[i].dirty = false;
            }
            let brief: Vec<_> = statuses
                .iter()
                .take(64)
                .map(|(_, s)| json!({"role": s.role, "index": s.index, "state": s.state}))
                .collect();
            self.hub
                .update("task", json!({"changed": statuses.len(), "tasks": brief}), |s| {
                    for (i, st) in statuses {
                        if i < s.tasks.len() {
                            s.tasks[i] = st;
                        }
                    }
                });
            let running = self.tasks.iter().any(|t| t.state == TaskState::ContainerRunning);
            let state = if self.end.is_some() {
                self.hub.read(|s| s.job.state)
            } else if running {
                JobState::Running
            } else {
                JobState::Waiting
            };
            self.publish_job(state);
        }
        if self.nodes_dirty {
            self.nodes_dirty = false;
            let job_masks = self.job_gpu_masks();
            let nodes = self
                .selector
                .with_view(|v| v.nodes().map(|n| node_status(n, &job_masks)).collect::<Vec<_>>());
            self.hub
                .update("nodes", json!({"count": nodes.len()}), |s| s.nodes = nodes);
        }
    }

    fn job_gpu_masks(&self) -> HashMap<String, u64> {
        let mut m: HashMap<String, u64> = HashMap::new();
        for t in &self.tasks {
            if let (true, Some(c)) = (t.holds_container(), &t.container) {
                *m.entry(c.host.clone()).or_insert(0) |= c.resources.gpu_mask;
            }
        }
        m
    }

    /// Takes over the containers of earlier AM attempts (work-preserving restart): a
    /// task's newest live container is re-adopted as it is (running or allocated); a task
    /// whose newest container already ended is judged by that exit, exactly as the
    /// earlier attempt would have; containers no task claims are released. A task's retry
    /// counts are rebuilt from its history: the container that ended each earlier task
    /// attempt is judged again (transient or counted), as the earlier AM judged it.
    pub fn adopt(&mut self, previous: &[PreviousContainer]) {
        let mut newest: HashMap<usize, &PreviousContainer> = HashMap::new();
        // task → task attempt → the container that ended that attempt (the last one).
        let mut history: HashMap<usize, BTreeMap<u32, &PreviousContainer>> = HashMap::new();
        for p in previous {
            let task = p.container.task.as_deref().and_then(|t| self.task_named(t));
            if let (Some(ti), ContainerState::Complete) = (task, p.state) {
                let last = history
                    .entry(ti)
                    .or_default()
                    .entry(p.container.task_attempt)
                    .or_insert(p);
                if p.container.container_id > last.container.container_id {
                    *last = p;
                }
            }
            match task {
                Some(ti) => {
                    let keep = match newest.get(&ti) {
                        Some(q) => {
                            (p.container.task_attempt, &p.container.container_id)
                                > (q.container.task_attempt, &q.container.container_id)
                        }
                        None => true,
                    };
                    if keep {
                        if let Some(old) = newest.insert(ti, p) {
                            if old.state != ContainerState::Complete {
                                self.releases.push(old.container.container_id.clone());
                            }
                        }
                    } else if p.state != ContainerState::Complete {
                        self.releases.push(p.container.container_id.clone());
                    }
                }
                None if p.state != ContainerState::Complete => self.releases.push(p.container.container_id.clone()),
                None => {}
            }
        }
        let mut adopted = 0;
        let max_transient = self.settings.max_transient_retries;
        for (ti, p) in newest {
            let c = p.container.clone();
            let role = &self.job.task_roles[self.tasks[ti].role];
            let ports = assign_port_labels(&role.resources, &c.resources.ports).unwrap_or_default();
            let max_retry = role.task_retry_count;
            let attempt = c.task_attempt.max(1);
            let mut retry = super::exits::RetryState::default();
            for k in 1..attempt {
                match history.get(&ti).and_then(|h| h.get(&k)) {
                    Some(ended) => {
                        let raw = ended.exit_status.unwrap_or(exit_status::ABORTED);
                        let exit = classify(raw, &ended.diagnostics, &self.settings);
                        decide_retry(&exit, max_retry, &mut retry, max_transient);
                    }
                    // No record of how it ended: count it, so the policy is never exceeded.
                    None => retry.retried += 1,
                }
            }
            let t = &mut self.tasks[ti];
            t.attempt = attempt;
            t.retry = retry;
            match p.state {
                ContainerState::Complete => {
                    let raw = p.exit_status.unwrap_or(crate::protocol::exit_status::ABORTED);
                    let exit = classify(raw, &p.diagnostics, &self.settings);
                    self.task_exited_adopted(ti, c, exit, p.diagnostics.clone());
                }
                live => {
                    t.ports = ports;
                    t.launched_ms = (live == ContainerState::Running).then(now_ms);
                    self.by_container.insert(c.container_id.clone(), ti);
                    self.container_addrs
                        .lock()
                        .insert(c.container_id.clone(), (c.node_http_address.clone(), c.host.clone()));
                    t.container = Some(c);
                    t.set_state(if live == ContainerState::Running {
                        TaskState::ContainerRunning
                    } else {
                        TaskState::ContainerAllocated
                    });
                    adopted += 1;
                }
            }
        }
        if self.job.gang && self.tasks.iter().any(|t| t.state == TaskState::ContainerRunning) {
            // The gang had started: a new attempt does not hold back its relaunched tasks.
            self.gang_launched = true;
        }
        tracing::info!(
            adopted,
            released = self.releases.len(),
            "re-adopted containers of earlier attempts"
        );
    }

    /// A task whose newest container ended while no AM was there to see it.
    fn task_exited_adopted(&mut self, ti: usize, c: Container, exit: ExitInfo, diagnostics: String) {
        self.tasks[ti].container = Some(c);
        self.task_exited(ti, exit, diagnostics);
    }

    /// The initial task list for the snapshot.
    pub fn initial_statuses(&self) -> Vec<super::status::TaskStatus> {
        self.tasks.iter().map(|t| t.status(&self.job)).collect()
    }
}

fn selection_record(role: &str, index: u32, sel: &crate::select::Selection) -> SelectionRecord {
    let (outcome, reason, p) = match &sel.outcome {
        Outcome::Placed(p) => ("placed", None, Some(p)),
        Outcome::NotNow { reason } => ("notNow", Some(reason.clone()), None),
        Outcome::Impossible { reason } => ("impossible", Some(reason.clone()), None),
    };
    SelectionRecord {
        role: role.to_string(),
        index,
        at_ms: now_ms(),
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

/// A node of the view as the dashboard shows it.
pub fn node_status(n: &crate::cluster::Node, job_masks: &HashMap<String, u64>) -> NodeStatus {
    let groups = match &n.topology {
        Some(t) => (0..=2u8)
            .rev()
            .map(|tier| t.islands(tier).into_iter().map(mask_hex).collect())
            .collect(),
        None => Vec::new(),
    };
    NodeStatus {
        host: n.host.clone(),
        rack: n.rack.clone(),
        labels: n.labels.clone(),
        gpu_type: n.gpu_type.clone(),
        state: format!("{:?}", n.state).to_uppercase(),
        topology: n.topology.as_ref().map(|t| t.name().to_string()),
        gpu_count: n.total().gpu_count(),
        gpu_groups: groups,
        total_cpu: n.total().cpu,
        used_cpu: n.used().cpu,
        requested_cpu: n.requested().cpu,
        free_cpu: n.free().cpu,
        total_memory_mb: n.total().memory_mb,
        used_memory_mb: n.used().memory_mb,
        requested_memory_mb: n.requested().memory_mb,
        free_memory_mb: n.free().memory_mb,
        total_gpu_mask: mask_hex(n.total().gpu_mask),
        used_gpu_mask: mask_hex(n.used().gpu_mask),
        requested_gpu_mask: mask_hex(n.requested().gpu_mask),
        free_gpu_mask: mask_hex(n.free().gpu_mask),
        job_gpu_mask: mask_hex(job_masks.get(&n.host).copied().unwrap_or(0)),
        total_ports: n.total().ports.to_string(),
        used_ports: n.used().ports.to_string(),
        free_ports: n.free().ports.to_string(),
        used_gpu_shares: n.used().gpu_shares.clone(),
        custom_resources: n.total().custom.clone(),
        used_custom_resources: n.used().custom.clone(),
        free_custom_resources: n.free().custom.clone(),
    }
}

#[cfg(test)]
#[path = "control_tests.rs"]
mod tests;
