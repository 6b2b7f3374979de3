//! Tests of the AM control loop (a child module of `control`, kept in its own file).
use super::*;
use crate::cluster::{ClusterView, Node};
use crate::protocol::PreviousContainer;
use crate::resources::{PortSet, Resources};

fn control(yaml: &str) -> Control {
    let job = crate::spec::parse_job_spec(yaml, "t.yaml").unwrap();
    let nodes = vec![Node::new(
        "n1",
        "/r",
        Resources::with_mask(8, 8000, 0xf, PortSet::new()),
    )];
    control_on(job, Selector::new(ClusterView::new(nodes), Default::default()))
}

/// The AM's control loop for `job` over `selector`'s view (an RM that is never reached).
fn control_on(job: crate::spec::JobSpec, selector: Selector) -> Control {
    let (hub, commands) = crate::web::demo::demo_hub_with_commands(1, 1);
    Control::new(
        Arc::new(job),
        "application_1_0001".into(),
        RmClient::new("http://127.0.0.1:9"),
        Arc::new(selector),
        hub,
        AmSettings::default(),
        commands,
    )
}

/// The container the RM would grant for task `ti`'s outstanding ask.
fn grant_for(c: &Control, ti: usize, id: &str) -> Container {
    let t = &c.tasks[ti];
    let r = t.request.as_ref().unwrap();
    Container {
        container_id: id.into(),
        request_id: r.request_id,
        host: r.host.clone(),
        node_http_address: "http://127.0.0.1:9".into(),
        node_ip: None,
        resources: r.resources.clone(),
        task: Some(format!("worker/{}", t.index)),
        task_attempt: t.attempt,
    }
}

fn seen(c: Container, state: ContainerState, exit: Option<i32>) -> PreviousContainer {
    PreviousContainer {
        container: c,
        state,
        exit_status: exit,
        diagnostics: String::new(),
    }
}

/// A mixed cluster: PCIe, NVLink and NVSwitch boxes, some GPUs and CPUs in use.
fn mixed_nodes() -> Vec<Node> {
    let specs = [
        ("pcie", "/a", "pcie8", 0b0000_0110u64),
        ("dgx", "/a", "dgx1v", 0b1000_0001),
        ("hgx", "/b", "nvswitch8", 0b1111_0000),
        ("old", "/b", "pcie4", 0),
    ];
    specs
        .iter()
        .map(|(host, rack, preset, used)| {
            let t = Arc::new(crate::topology::Topology::preset(preset).unwrap());
            let mut n = Node::new(
                *host,
                *rack,
                Resources::with_mask(64, 512_000, t.all_mask(), PortSet::range(20000, 20099)),
            );
            n.set_used(Resources::with_mask(8, 1000, *used, PortSet::range(20000, 20009)));
            n.topology = Some(t);
            n
        })
        .collect()
}

/// "plan shows what the AM will do": the same job on the same cluster (same seed) gets the
/// same hosts, GPUs and ports from the AM's first placement round as from `gpuam plan`, and
/// the same tasks stay unplaced.
#[test]
fn the_am_asks_for_exactly_what_plan_shows() {
    let yaml = "name: j\ngang: true\ntaskRoles:\n  worker:\n    instances: 3\n    samePortAllocation: true\n    \
                resourcePerInstance: {cpu: 4, memoryMB: 1000, gpu: 2, ports: {nccl: 1}}\n    commands: [\"true\"]\n  \
                ps:\n    instances: 2\n    resourcePerInstance: {cpu: 2, memoryMB: 1000, gpu: 1}\n    commands: [\"true\"]\n  \
                huge:\n    instances: 2\n    resourcePerInstance: {cpu: 60, memoryMB: 1000, gpu: 8}\n    commands: [\"true\"]\n";
    let job = crate::spec::parse_job_spec(yaml, "t.yaml").unwrap();
    let settings = || crate::config::SelectSettings {
        seed: Some(7),
        ..Default::default()
    };
    let plan = crate::select::plan_job(&Selector::new(ClusterView::new(mixed_nodes()), settings()), &job);
    let mut c = control_on(job.clone(), Selector::new(ClusterView::new(mixed_nodes()), settings()));
    c.place_waiting();
    let mut asked: Vec<(String, u32, String, u64, String)> = Vec::new();
    let mut waiting: Vec<(String, u32)> = Vec::new();
    for t in &c.tasks {
        let role = job.task_roles[t.role].name.clone();
        match &t.request {
            Some(r) => asked.push((
                role,
                t.index,
                r.host.clone(),
                r.resources.gpu_mask,
                r.resources.ports.to_string(),
            )),
            None => waiting.push((role, t.index)),
        }
    }
    let mut planned: Vec<(String, u32, String, u64, String)> = plan
        .placements
        .iter()
        .map(|p| {
            (
                p.role.clone(),
                p.index,
                p.host.clone(),
                p.placement.resources.gpu_mask,
                p.placement.resources.ports.to_string(),
            )
        })
        .collect();
    let mut unplaced: Vec<(String, u32)> = plan.unplaced.iter().map(|u| (u.role.clone(), u.index)).collect();
    asked.sort();
    planned.sort();
    waiting.sort();
    unplaced.sort();
    assert_eq!(asked, planned);
    assert_eq!(waiting, unplaced);
    // The case is not trivial: tasks were placed, one role did not fit, and the workers share
    // their port (samePortAllocation) across hosts.
    assert_eq!(asked.len(), 5, "{asked:?}");
    assert_eq!(unplaced, vec![("huge".to_string(), 0), ("huge".to_string(), 1)]);
    let worker_ports: std::collections::BTreeSet<&str> =
        asked.iter().filter(|a| a.0 == "worker").map(|a| a.4.as_str()).collect();
    assert_eq!(worker_ports.len(), 1, "{asked:?}");
}

#[test]
fn resync_lines_up_the_am_with_what_the_rm_recovered() {
    let mut c = control(
        "name: j\ntaskRoles:\n  worker:\n    instances: 3\n    taskRetryCount: 0\n    \
         resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 1}\n    commands: [\"true\"]\n",
    );
    c.place_waiting();
    assert!(c.tasks.iter().all(|t| t.state == TaskState::ContainerRequested));
    let (c0, c1, c2) = (grant_for(&c, 0, "c0"), grant_for(&c, 1, "c1"), grant_for(&c, 2, "c2"));
    for (ti, g) in [(0, &c0), (1, &c1)] {
        c.accept_container(g.clone());
        c.tasks[ti].set_state(TaskState::ContainerRunning);
    }
    // While the RM was away: c1 ended (exit 0), c2 was granted but its answer was
    // lost, some other live container appeared, and c0 is unknown to the RM.
    let stray = Container {
        container_id: "c-stray".into(),
        task: Some("worker/7".into()),
        ..c2.clone()
    };
    c.reconcile(&[
        seen(c1, ContainerState::Complete, Some(0)),
        seen(c2, ContainerState::Allocated, None),
        seen(stray, ContainerState::Allocated, None),
    ]);
    let t = &c.tasks;
    assert_eq!(t[1].state, TaskState::TaskCompleted, "the RM's exit status counts");
    assert_eq!(t[1].succeeded, Some(true));
    assert_eq!(t[2].state, TaskState::ContainerAllocated, "the lost answer is taken");
    assert_eq!(t[2].container.as_ref().unwrap().container_id, "c2");
    // c0: lost (-7151, transient): retried without using taskRetryCount 0.
    assert_eq!(t[0].state, TaskState::TaskWaiting);
    assert_eq!(t[0].attempt, 2);
    let exit = &t[0].exit.as_ref().unwrap().0;
    assert_eq!(exit.code, super::super::exits::code::CONTAINER_RM_RESYNC_LOST);
    assert_eq!(c.releases, vec!["c-stray".to_string()]);
    assert!(c.end.is_none());
    // The same completion arriving later in a heartbeat changes nothing.
    c.container_completed(CompletedContainer {
        container_id: "c1".into(),
        exit_status: 0,
        diagnostics: String::new(),
    });
    assert_eq!(c.tasks[1].state, TaskState::TaskCompleted);
}

#[test]
fn adoption_rebuilds_retry_counts_from_the_task_history() {
    let mut c = control(
        "name: j\ntaskRoles:\n  worker:\n    instances: 1\n    taskRetryCount: 1\n    \
         resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 1}\n    commands: [\"true\"]\n",
    );
    let container = |id: &str, attempt: u32| Container {
        container_id: id.into(),
        request_id: 1,
        host: "n1".into(),
        node_http_address: "http://127.0.0.1:9".into(),
        node_ip: None,
        resources: Resources::with_mask(1, 10, 0x1, PortSet::new()),
        task: Some("worker/0".into()),
        task_attempt: attempt,
    };
    // Attempt 1 was lost with its node (transient); attempt 2 runs.
    let lost = PreviousContainer {
        diagnostics: crate::rm::ledger::DIAG_LOST_NODE.into(),
        ..seen(container("c1", 1), ContainerState::Complete, Some(exit_status::ABORTED))
    };
    c.adopt(&[lost, seen(container("c2", 2), ContainerState::Running, None)]);
    let t = &c.tasks[0];
    assert_eq!((t.attempt, t.state), (2, TaskState::ContainerRunning));
    assert_eq!(
        (t.retry.retried, t.retry.transient_retried),
        (0, 1),
        "the node loss was transient"
    );
    // So a failure of attempt 2 still has its one counted retry.
    c.container_completed(CompletedContainer {
        container_id: "c2".into(),
        exit_status: 1,
        diagnostics: String::new(),
    });
    assert_eq!((c.tasks[0].attempt, c.tasks[0].state), (3, TaskState::TaskWaiting));
    assert!(c.end.is_none());
}
#[test]
fn a_gang_is_asked_for_whole_or_not_at_all() {
    // Two tasks of 3 GPUs on one node of 4: one places, the other cannot.
    let mut c = control(
        "name: j\ngang: true\ntaskRoles:\n  worker:\n    instances: 2\n    \
         resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 3}\n    commands: [\"true\"]\n",
    );
    c.place_waiting();
    let states: Vec<TaskState> = c.tasks.iter().map(|t| t.state).collect();
    assert!(states.contains(&TaskState::ContainerRequested) && states.contains(&TaskState::TaskWaiting));
    c.hold_back_partial_gang(Instant::now());
    for t in &c.tasks {
        assert_eq!(t.state, TaskState::TaskWaiting);
        assert!(t.request.is_none() && t.not_before.is_some());
    }
    assert!(c.by_request.is_empty());
    assert!(
        c.tasks[0]
            .waiting_reason
            .as_deref()
            .unwrap_or("")
            .contains("asked for together")
            || c.tasks[1]
                .waiting_reason
                .as_deref()
                .unwrap_or("")
                .contains("asked for together")
    );
    // What the RM hears: both wait.
    let w = super::super::queueing::waiting_demand(&c.job, &c.tasks, &c.selector.settings());
    assert_eq!((w.len(), w[0].count, w[0].gpus), (1, 2, 3));
}

#[test]
fn a_preempted_task_is_retried_without_using_its_retry_count() {
    let mut c = control(
        "name: j\ntaskRoles:\n  worker:\n    instances: 1\n    taskRetryCount: 0\n    \
         resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 1}\n    commands: [\"true\"]\n",
    );
    for round in 0..3u32 {
        c.place_waiting();
        let g = grant_for(&c, 0, &format!("c{round}"));
        c.accept_container(g);
        c.tasks[0].set_state(TaskState::ContainerRunning);
        // The notice, then the task exits by itself (0) before the release is due.
        c.take_preemptions(&[PreemptNotice {
            container_id: format!("c{round}"),
            deadline_ms: now_ms() + 60_000,
            reason: "queue a is below its share".into(),
        }]);
        assert_eq!(c.tasks[0].state, TaskState::ContainerRunning, "not due yet");
        c.container_completed(CompletedContainer {
            container_id: format!("c{round}"),
            exit_status: 0,
            diagnostics: String::new(),
        });
        let t = &c.tasks[0];
        assert_eq!(t.state, TaskState::TaskWaiting, "preempted, so retried (round {round})");
        assert_eq!((t.retry.retried, t.retry.preempted), (0, round + 1));
        assert_eq!(
            t.exit.as_ref().unwrap().0.code,
            super::super::exits::code::CONTAINER_PREEMPTED
        );
        c.tasks[0].not_before = None;
    }
    // An unstarted container under notice goes back at once.
    c.place_waiting();
    let g = grant_for(&c, 0, "c9");
    c.accept_container(g);
    c.take_preemptions(&[PreemptNotice {
        container_id: "c9".into(),
        deadline_ms: now_ms() + 60_000,
        reason: "r".into(),
    }]);
    assert_eq!(c.releases, vec!["c9".to_string()]);
    assert_eq!(c.tasks[0].state, TaskState::TaskWaiting);
    assert!(c.end.is_none());
}

/// The topology wait in the AM: a 2-GPU task that finds only a split pair (another job holds
/// one GPU of each pair) waits, saying why, and once `select.topology_wait_sec` has passed
/// since it began waiting it asks for the set `gpuam plan` shows.
#[test]
fn a_task_waits_for_its_ideal_tier_then_asks_for_what_plan_shows() {
    let yaml = "name: j\ntaskRoles:\n  worker:\n    instances: 1\n    \
                resourcePerInstance: {cpu: 1, memoryMB: 1000, gpu: 2}\n    commands: [\"true\"]\n";
    let job = crate::spec::parse_job_spec(yaml, "t.yaml").unwrap();
    let nodes = || {
        let t = Arc::new(crate::topology::Topology::preset("pcie4").unwrap());
        let mut n = Node::new("old", "/r", Resources::with_mask(8, 8000, 0xf, PortSet::new()));
        n.set_used(Resources::with_mask(2, 100, 0b0101, PortSet::new()));
        n.topology = Some(t);
        vec![n]
    };
    let plan = crate::select::plan_job(&Selector::new(ClusterView::new(nodes()), Default::default()), &job);
    assert_eq!(plan.placements[0].topology_wait_sec, Some(300));
    let mut c = control_on(job, Selector::new(ClusterView::new(nodes()), Default::default()));
    c.place_waiting();
    let t = &c.tasks[0];
    assert!(t.request.is_none());
    let why = t.waiting_reason.as_deref().unwrap_or_default();
    assert!(why.contains("holding out for 2 GPUs of tier 1"), "{why}");
    assert!(t.not_before.is_some(), "it backs off and tries again");
    // Its wait spent (the wait is shortened to what has passed instead of sleeping 300 s;
    // the clock itself is Task::slot's, tested in am::tasks).
    c.topology_wait = c.tasks[0].waiting_since.elapsed();
    c.tasks[0].not_before = None;
    c.place_waiting();
    let r = c.tasks[0].request.as_ref().expect("asked once the wait is spent");
    assert_eq!((r.host.as_str(), r.resources.gpu_mask), ("old", 0b1010));
    assert_eq!(r.resources.gpu_mask, plan.placements[0].placement.resources.gpu_mask);
}
