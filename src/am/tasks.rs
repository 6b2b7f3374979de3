//! The AM's task table: one entry per task of the job, its state, why it waits (the one
//! `reason::Reason`, with since and the topology wait's deadline), its outstanding
//! request or container, its retry counters; and the launch context of each (the AM's part
//! of the container contract, DESIGN.md §6, whose rules are `node::contract`'s).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::exits::{ExitInfo, RetryState};
use super::status::{TaskState, TaskStatus};
use crate::protocol::{Container, LaunchContext};
use crate::reason::{Kind, Reason};
use crate::resources::{mask_hex, mask_indices, Resources};
use crate::select::{Outcome, TaskSlot};
use crate::spec::{JobSpec, SpecFormat};

/// An ask sent to the RM and not yet answered.
#[derive(Clone, Debug)]
pub struct Outstanding {
    pub request_id: u64,
    pub host: String,
    pub resources: Resources,
    pub sent: Instant,
}

/// One task.
#[derive(Clone, Debug)]
pub struct Task {
    pub role: usize,
    pub index: u32,
    pub state: TaskState,
    pub attempt: u32,
    pub retry: RetryState,
    pub request: Option<Outstanding>,
    pub container: Option<Container>,
    /// Ports of the container, by label.
    pub ports: Vec<(String, Vec<u16>)>,
    /// Do not try to place before this time (back-off after "nothing fits now").
    pub not_before: Option<Instant>,
    /// When this attempt began waiting for a container (a lost, rejected or held-back ask
    /// does not restart it): the clock of `select.topology_wait_sec`.
    pub waiting_since: Instant,
    /// The same moment on the wall clock (milliseconds since the epoch), for the reason's
    /// `since` and the topology wait's deadline.
    pub waiting_since_ms: u64,
    /// Why it waits (shown while it is not placed: waiting, or its ask not yet granted).
    pub reason: Option<Reason>,
    pub exit: Option<(ExitInfo, String)>,
    pub succeeded: Option<bool>,
    pub created_ms: u64,
    pub launched_ms: Option<u64>,
    pub completed_ms: Option<u64>,
    /// Changed since the status was last published.
    pub dirty: bool,
}

impl Task {
    /// A task waiting for its first container, created now (tests; the job machine passes
    /// its time in, [`Task::at`]).
    #[cfg(test)]
    pub fn new(role: usize, index: u32) -> Self {
        Task::at(role, index, Instant::now(), crate::protocol::now_ms())
    }

    /// A task waiting for its first container, created at `at` (`ms`: the wall clock then).
    pub fn at(role: usize, index: u32, at: Instant, ms: u64) -> Self {
        Task {
            role,
            index,
            state: TaskState::TaskWaiting,
            attempt: 1,
            retry: RetryState::default(),
            request: None,
            container: None,
            ports: Vec::new(),
            not_before: None,
            waiting_since: at,
            waiting_since_ms: ms,
            reason: Some(Reason::new(Kind::Starting, "waiting for its first placement round").since(ms)),
            exit: None,
            succeeded: None,
            created_ms: ms,
            launched_ms: None,
            completed_ms: None,
            dirty: true,
        }
    }

    pub fn set_state(&mut self, s: TaskState) {
        if self.state != s {
            self.state = s;
            self.dirty = true;
        }
    }

    /// Holds a container that is not finished (allocated, launched or running).
    pub fn holds_container(&self) -> bool {
        matches!(
            self.state,
            TaskState::ContainerAllocated | TaskState::ContainerLaunched | TaskState::ContainerRunning
        )
    }

    /// Where the task stands for the placement round: waiting (ready unless backing off; it
    /// may wait for its ideal GPU tier until `topology_wait` has passed since it began
    /// waiting), placed (an ask out, or a live container: its host and exact resources), or
    /// neither.
    pub fn slot(&self, now: Instant, topology_wait: Duration) -> TaskSlot {
        let placed = |host: &str, resources: &Resources| TaskSlot::Placed {
            host: host.to_string(),
            resources: resources.clone(),
        };
        match (&self.request, &self.container) {
            _ if self.state == TaskState::TaskWaiting => TaskSlot::Waiting {
                ready: self.not_before.is_none_or(|nb| now >= nb),
                topology_wait: now.saturating_duration_since(self.waiting_since) < topology_wait,
            },
            (Some(r), _) if self.state == TaskState::ContainerRequested => placed(&r.host, &r.resources),
            (_, Some(c)) if self.holds_container() => placed(&c.host, &c.resources),
            _ => TaskSlot::Idle,
        }
    }

    /// A new attempt (a retry after its container ended, or the job's restart): back to
    /// waiting (from `now`), with the topology-wait clock restarted.
    pub fn new_attempt(&mut self, now: Instant, now_ms: u64) {
        self.attempt += 1;
        self.waiting_since = now;
        self.waiting_since_ms = now_ms;
        self.reset_to_waiting();
    }

    /// Says why it waits now (`since` the moment it began waiting), marking it changed when
    /// that is news.
    pub fn waits(&mut self, kind: Kind, detail: impl Into<String>) {
        let r = Reason::new(kind, detail).since(self.waiting_since_ms);
        self.set_reason(Some(r));
    }

    /// Why it waits after a selection's `outcome`: the outcome's kind and detail (select),
    /// since it began waiting, and for the topology wait its deadline (`topology_wait`
    /// after it began waiting); a placement is an ask not yet granted (not a place).
    pub fn reason_for(&self, outcome: &Outcome, topology_wait: Duration) -> Option<Reason> {
        let since = self.waiting_since_ms;
        let r = match (outcome.wait_reason(), outcome) {
            (Some(r), _) if r.kind == Kind::Topology => r.until(since + topology_wait.as_millis() as u64),
            (Some(r), _) => r,
            (None, Outcome::Placed(p)) => {
                let gpus = mask_indices(p.resources.gpu_mask);
                let on = match gpus.is_empty() {
                    true => p.host.clone(),
                    false => format!(
                        "{} GPUs {}",
                        p.host,
                        gpus.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
                    ),
                };
                Reason::new(Kind::Requested, format!("asked the RM for {on}; not granted yet"))
            }
            (None, _) => return None,
        };
        Some(r.since(since))
    }

    /// Sets the reason (`None`: it has its place), marking it changed when that is news.
    pub fn set_reason(&mut self, r: Option<Reason>) {
        if self.reason != r {
            self.reason = r;
            self.dirty = true;
        }
    }

    /// Its reason, while it is not placed (waiting, or its ask not yet granted).
    pub fn wait_reason(&self) -> Option<&Reason> {
        self.reason
            .as_ref()
            .filter(|_| matches!(self.state, TaskState::TaskWaiting | TaskState::ContainerRequested))
    }

    /// Back to waiting for a new container (a retry, or a lost ask).
    pub fn reset_to_waiting(&mut self) {
        self.request = None;
        self.container = None;
        self.ports.clear();
        self.launched_ms = None;
        self.set_state(TaskState::TaskWaiting);
    }

    pub fn status(&self, job: &JobSpec) -> TaskStatus {
        let role = &job.task_roles[self.role];
        let mask = self.container.as_ref().map(|c| c.resources.gpu_mask);
        TaskStatus {
            role: role.name.clone(),
            index: self.index,
            state: self.state,
            attempt: self.attempt,
            retried_count: self.retry.retried,
            host: self.container.as_ref().map(|c| c.host.clone()),
            gpus: mask.map(mask_indices).unwrap_or_default(),
            gpu_mask: mask.map(mask_hex),
            gpu_share: self
                .container
                .as_ref()
                .and_then(|c| c.resources.gpu_share())
                .map(crate::resources::format_hundredths),
            resources: self
                .container
                .as_ref()
                .map(|c| c.resources.custom.clone())
                .unwrap_or_default(),
            ports: self.ports.clone(),
            container_id: self.container.as_ref().map(|c| c.container_id.clone()),
            exit_code: self.exit.as_ref().map(|(e, _)| e.code),
            exit_type: self.exit.as_ref().map(|(e, _)| e.exit_type),
            exit_diagnostics: self.exit.as_ref().map(|(e, d)| {
                if d.is_empty() {
                    e.description.to_string()
                } else {
                    format!("{}: {d}", e.description)
                }
            }),
            waiting_reason: self.wait_reason().map(Reason::text),
            reason: self.wait_reason().cloned(),
            created_ms: self.created_ms,
            launched_ms: self.launched_ms,
            completed_ms: self.completed_ms,
        }
    }
}

/// The AM's part of a container's environment (the node adds the GPU variables, the
/// container id and the host: [`crate::node::contract`]). `peers` maps role →
/// "host:firstPort" per index, given for gang jobs.
pub fn task_env(
    job: &JobSpec,
    task: &Task,
    app_id: &str,
    peers: Option<&BTreeMap<String, Vec<String>>>,
) -> BTreeMap<String, String> {
    crate::node::contract::app_env(&crate::node::contract::AppTask {
        job: &job.name,
        app_id,
        role: &job.task_roles[task.role].name,
        index: task.index,
        attempt: task.attempt,
        ports: &task.ports,
        peers,
    })
}

/// What the node gets to start `task`: its role's commands and the whole environment —
/// DESIGN.md §6, plus OpenPAI's `PAI_*` variables for protocol v2 jobs (built from every
/// task of the job that holds a container, `all`), plus `GPUAM_IMAGE` / `GPUAM_SHM_MB`
/// when the role names an image (the node runs the task in it; see `node_image`).
pub fn launch_context(
    job: &JobSpec,
    task: &Task,
    app_id: &str,
    peers: Option<&BTreeMap<String, Vec<String>>>,
    all: &[Task],
) -> LaunchContext {
    let role = &job.task_roles[task.role];
    let mut env = task_env(job, task, app_id, peers);
    if job.format == SpecFormat::PaiV2 {
        let views: Vec<super::pai_env::TaskView<'_>> = all
            .iter()
            .filter(|t| t.holds_container())
            .filter_map(|t| {
                let c = t.container.as_ref()?;
                Some(super::pai_env::TaskView {
                    role: &job.task_roles[t.role].name,
                    index: t.index,
                    ip: Some(super::pai_env::node_ip(c)),
                    ports: &t.ports,
                })
            })
            .collect();
        let current = super::pai_env::Current {
            role_index: task.role,
            index: task.index,
            container_id: task.container.as_ref().map_or("", |c| c.container_id.as_str()),
        };
        let user = super::pai_env::user_name();
        env.extend(super::pai_env::pai_env(job, &user, &current, &views));
    }
    if let Some(image) = &role.image {
        env.insert("GPUAM_IMAGE".into(), image.clone());
        // OpenPAI's /dev/shm is 512 MB unless `extraContainerOptions.shmMB` says otherwise.
        let shm = role.shm_mb.or((job.format == SpecFormat::PaiV2).then_some(512));
        if let Some(shm) = shm {
            env.insert("GPUAM_SHM_MB".into(), shm.to_string());
        }
    }
    LaunchContext {
        commands: role.commands.clone(),
        env,
    }
}

/// "host:firstPort" (or just "host") of a task holding a container, where host is the
/// address its peers reach it at ([`Container::peer_host`]: the node's IP where known).
pub fn peer_address(task: &Task) -> Option<String> {
    let c = task.container.as_ref()?;
    let host = c.peer_host();
    Some(match task.ports.first().and_then(|(_, ps)| ps.first()) {
        Some(p) => format!("{host}:{p}"),
        None => host,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{TaskResources, TaskRole};

    /// The topology-wait clock runs from when the attempt began waiting: a lost or held-back
    /// ask does not restart it, a new attempt does.
    #[test]
    fn the_topology_wait_runs_from_when_the_attempt_began_waiting() {
        let wait = Duration::from_secs(300);
        let mut t = Task::new(0, 0);
        let now = Instant::now();
        let topology_wait = |t: &Task, at: Instant| match t.slot(at, wait) {
            TaskSlot::Waiting { topology_wait, .. } => topology_wait,
            other => panic!("not waiting: {other:?}"),
        };
        assert!(topology_wait(&t, now));
        assert!(!topology_wait(&t, now + wait), "spent after 300 s");
        assert!(!matches!(
            t.slot(now, Duration::ZERO),
            TaskSlot::Waiting {
                topology_wait: true,
                ..
            }
        ));
        // An ask lost or held back: back to waiting, the clock keeps running.
        t.set_state(TaskState::ContainerRequested);
        t.reset_to_waiting();
        assert!(!topology_wait(&t, now + wait));
        // A retry is a new attempt: a new wait.
        let before = t.attempt;
        t.new_attempt(Instant::now(), 0);
        assert_eq!(t.attempt, before + 1);
        assert!(t.waiting_since >= now);
        assert!(topology_wait(&t, t.waiting_since + wait - Duration::from_millis(1)));
        assert!(!topology_wait(&t, t.waiting_since + wait));
    }

    #[test]
    fn env_follows_the_contract() {
        let job = JobSpec {
            name: "resnet".into(),
            gang: true,
            task_roles: vec![TaskRole {
                name: "worker-a".into(),
                instances: 2,
                resources: TaskResources {
                    cpu: 1,
                    memory_mb: 1,
                    gpus: 0,
                    gpu_mask: None,
                    ports: vec![],
                    ..Default::default()
                },
                commands: vec![],
                ..Default::default()
            }],
            ..Default::default()
        };
        let mut t = Task::new(0, 1);
        t.attempt = 2;
        t.ports = vec![("http".into(), vec![2001]), ("ssh.x".into(), vec![2002, 2003])];
        let mut peers = BTreeMap::new();
        peers.insert(
            "worker-a".to_string(),
            vec!["h1:2001".to_string(), "h2:2001".to_string()],
        );
        let env = task_env(&job, &t, "app_1", Some(&peers));
        assert_eq!(env["CONTAINER_PORTS"], "http:2001;ssh.x:2002,2003;");
        assert_eq!(env["GPUAM_PORT_SSH_X"], "2002,2003");
        assert_eq!(env["GPUAM_TASK_INDEX"], "1");
        assert_eq!(env["GPUAM_ATTEMPT"], "2");
        assert_eq!(env["GPUAM_HOSTS_WORKER_A"], "h1:2001,h2:2001");
        assert_eq!(env["GPUAM_JOB"], "resnet");
    }

    #[test]
    fn launch_context_adds_pai_env_and_the_image_for_v2_only() {
        let v2 = crate::spec::parse_job_spec(
            "protocolVersion: 2\nname: j\ntype: job\nprerequisites: [{name: i, type: dockerimage, uri: 'img:1'}]\n\
             taskRoles:\n  w:\n    dockerImage: i\n    resourcePerInstance: {cpu: 1, memoryMB: 1, gpu: 0}\n    commands: [a, b]\n",
            "j.yaml",
        )
        .unwrap();
        let mut t = Task::new(0, 0);
        t.state = super::TaskState::ContainerAllocated;
        t.container = Some(Container {
            container_id: "c1".into(),
            request_id: 1,
            host: "n1".into(),
            node_http_address: "http://10.1.2.3:8088".into(),
            node_ip: None,
            resources: Default::default(),
            task: None,
            task_attempt: 1,
        });
        t.ports = vec![("ssh".into(), vec![3001]), ("http".into(), vec![3002])];
        let ctx = launch_context(&v2, &t, "app_1", None, std::slice::from_ref(&t));
        assert_eq!(ctx.commands, vec!["a\nb"]);
        assert_eq!(ctx.env["GPUAM_IMAGE"], "img:1");
        assert_eq!(ctx.env["GPUAM_SHM_MB"], "512", "OpenPAI's default /dev/shm");
        assert_eq!(ctx.env["PAI_HOST_IP_w_0"], "10.1.2.3");
        assert_eq!(ctx.env["PAI_CONTAINER_SSH_PORT"], "3001");
        assert_eq!(ctx.env["GPUAM_TASK_INDEX"], "0", "gpuam's own variables stay");

        let native = crate::spec::parse_job_spec(
            "name: j\ntaskRoles:\n  w:\n    resourcePerInstance: {cpu: 1, memoryMB: 1}\n    commands: [a, b]\n",
            "j.yaml",
        )
        .unwrap();
        let ctx = launch_context(&native, &t, "app_1", None, std::slice::from_ref(&t));
        assert_eq!(ctx.commands, vec!["a", "b"]);
        assert!(ctx.env.keys().all(|k| !k.starts_with("PAI_") && k != "GPUAM_IMAGE"));
    }

    #[test]
    fn peers_get_the_node_ip_where_the_node_has_one_else_the_host_name() {
        let mut t = Task::new(0, 0);
        t.ports = vec![("coord".into(), vec![20005])];
        let mut c = Container {
            container_id: "c1".into(),
            request_id: 1,
            host: "gpu-3".into(),
            node_http_address: "http://10.0.0.1:8088".into(),
            node_ip: None,
            resources: Default::default(),
            task: None,
            task_attempt: 1,
        };
        t.container = Some(c.clone());
        assert_eq!(peer_address(&t).unwrap(), "gpu-3:20005", "a simulated node: its name");
        c.node_ip = Some("10.0.0.7".parse().unwrap());
        t.container = Some(c.clone());
        assert_eq!(peer_address(&t).unwrap(), "10.0.0.7:20005", "an agent's node: its IP");
        c.node_ip = Some("fd00::7".parse().unwrap());
        t.container = Some(c);
        assert_eq!(peer_address(&t).unwrap(), "[fd00::7]:20005");
        t.ports.clear();
        assert_eq!(peer_address(&t).unwrap(), "[fd00::7]");
    }
}
