//! Table tests of the job machine: inputs at a time in, effects and the task table out.
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::am::tasks::Task;
use crate::cluster::{ClusterView, Node};
use crate::protocol::{Ask, CompletedContainer, ContainerState, PreemptNotice, Rejection};
use crate::reason::{Kind, Reason};
use crate::resources::{PortSet, Resources};
use crate::select::Outcome;

fn one_node() -> Vec<Node> {
    vec![Node::new(
        "n1",
        "/r",
        Resources::with_mask(8, 8000, 0xf, PortSet::new()),
    )]
}

fn machine_on(yaml: &str, nodes: Vec<Node>, select: crate::config::SelectSettings) -> (JobMachine, Now) {
    let job = crate::spec::parse_job_spec(yaml, "t.yaml").unwrap();
    let now = Now::real();
    let mut m = JobMachine::new(
        Arc::new(job),
        "application_1_0001".into(),
        Arc::new(Selector::new(ClusterView::new(nodes), select)),
        AmSettings::default(),
        RegisterRequest::default(),
        1,
        now,
    );
    m.nodes_fetched(now);
    (m, now)
}

fn machine(yaml: &str) -> (JobMachine, Now) {
    machine_on(yaml, one_node(), Default::default())
}

/// The one effect of a step.
fn effect(out: Output) -> Effect {
    assert_eq!(out.effects.len(), 1, "{:?}", out.effects);
    out.effects.into_iter().next().unwrap()
}

/// A heartbeat up to its allocate call (a node listing due is answered with a failure, so
/// the test's node view stays as it is).
fn heartbeat(m: &mut JobMachine, now: Now) -> AllocateRequest {
    let mut out = m.step(Input::Heartbeat, now);
    if out.effects == [Effect::FetchNodes] {
        let kept = RmFailure {
            retryable: true,
            message: "the test keeps its node view".into(),
        };
        out = m.step(Input::Nodes(Err(kept)), now);
    }
    match effect(out) {
        Effect::Allocate(req) => req,
        other => panic!("expected an allocate call, got {other:?}"),
    }
}

/// The RM's answer, then the launches (all succeed); returns the effect that ends the heartbeat.
fn answer(m: &mut JobMachine, resp: AllocateResponse, now: Now) -> Effect {
    match effect(m.step(Input::Allocated(Ok(resp)), now)) {
        Effect::Launch(ls) => effect(m.step(Input::Launched(ls.iter().map(|l| (l.task, Ok(None))).collect()), now)),
        other => other,
    }
}

/// The container the RM grants for `ask`.
fn grant(ask: &Ask, id: &str) -> Container {
    Container {
        container_id: id.into(),
        request_id: ask.request_id,
        host: ask.host.clone(),
        node_http_address: "http://127.0.0.1:9".into(),
        node_ip: None,
        resources: ask.resources(),
        task: ask.task.clone(),
        task_attempt: ask.task_attempt,
    }
}

fn granted(containers: Vec<Container>) -> AllocateResponse {
    AllocateResponse {
        allocated: containers,
        ..Default::default()
    }
}

fn completed(id: &str, exit: i32) -> AllocateResponse {
    AllocateResponse {
        completed: vec![CompletedContainer {
            container_id: id.into(),
            exit_status: exit,
            diagnostics: String::new(),
        }],
        ..Default::default()
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

/// "plan shows what the AM will do": the AM's first placement round on a cluster chooses the
/// hosts, GPUs and ports of `select::plan_job`'s round (same seed), leaves the same tasks
/// unplaced — and, the job being a gang with a role that does not fit, asks for none of them.
#[test]
fn the_am_places_exactly_what_the_round_plans_and_holds_a_partial_gang_back() {
    let yaml = "name: j\ngang: true\ntaskRoles:\n  worker:\n    instances: 3\n    samePortAllocation: true\n    \
                resourcePerInstance: {cpu: 4, memoryMB: 1000, gpu: 2, ports: {nccl: 1}}\n    commands: [\"true\"]\n  \
                ps:\n    instances: 2\n    resourcePerInstance: {cpu: 2, memoryMB: 1000, gpu: 1}\n    commands: [\"true\"]\n  \
                huge:\n    instances: 2\n    resourcePerInstance: {cpu: 60, memoryMB: 1000, gpu: 8}\n    commands: [\"true\"]\n";
    let settings = || crate::config::SelectSettings {
        seed: Some(7),
        ..Default::default()
    };
    let (mut m, now) = machine_on(yaml, mixed_nodes(), settings());
    let plan = crate::select::plan_job(&Selector::new(ClusterView::new(mixed_nodes()), settings()), m.job());
    let out = m.step(Input::Heartbeat, now);
    let mut placed: Vec<(String, u32, String, u64, String)> = Vec::new();
    let mut waiting: Vec<(String, u32)> = Vec::new();
    for e in &out.events {
        if let Event::Selection {
            role, index, selection, ..
        } = e
        {
            match &selection.outcome {
                Outcome::Placed(p) => placed.push((
                    role.clone(),
                    *index,
                    p.host.clone(),
                    p.resources.gpu_mask,
                    p.resources.ports.to_string(),
                )),
                _ => waiting.push((role.clone(), *index)),
            }
        }
    }
    let mut planned: Vec<_> = plan
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
    for v in [&mut placed, &mut planned] {
        v.sort();
    }
    waiting.sort();
    unplaced.sort();
    assert_eq!(placed, planned);
    assert_eq!(waiting, unplaced);
    assert_eq!(placed.len(), 5, "{placed:?}");
    assert_eq!(unplaced, vec![("huge".to_string(), 0), ("huge".to_string(), 1)]);
    let worker_ports: std::collections::BTreeSet<&str> = placed
        .iter()
        .filter(|a| a.0 == "worker")
        .map(|a| a.4.as_str())
        .collect();
    assert_eq!(worker_ports.len(), 1, "{placed:?}");
    // The gang is asked for whole or not at all: nothing goes out, every task waits.
    match effect(out) {
        Effect::Allocate(req) => {
            assert!(req.asks.is_empty(), "{:?}", req.asks);
            let w = req.waiting.unwrap_or_default();
            assert_eq!(w.iter().map(|w| w.count).sum::<u32>(), 7);
        }
        other => panic!("{other:?}"),
    }
    assert!(m.tasks().iter().all(|t| t.state == TaskState::TaskWaiting));
}

#[test]
fn a_gang_is_asked_for_whole_or_not_at_all() {
    // Two tasks of 3 GPUs on one node of 4: one places, the other cannot.
    let (mut m, now) = machine(
        "name: j\ngang: true\ntaskRoles:\n  worker:\n    instances: 2\n    \
         resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 3}\n    commands: [\"true\"]\n",
    );
    let req = heartbeat(&mut m, now);
    assert!(req.asks.is_empty());
    for t in m.tasks() {
        assert_eq!(t.state, TaskState::TaskWaiting);
        assert!(t.request.is_none() && t.not_before.is_some());
    }
    assert!(m.by_request.is_empty());
    // The placed task waits with the gang and says why: the other task's own reason, said
    // of that task.
    let (held, holder): (Vec<&Task>, Vec<&Task>) = m
        .tasks()
        .iter()
        .partition(|t| t.reason.as_ref().is_some_and(|r| r.task.is_some()));
    assert_eq!((held.len(), holder.len()), (1, 1), "{:?}", m.statuses());
    let own = holder[0].reason.clone().unwrap();
    assert_eq!(own.kind, crate::reason::Kind::Resources);
    let name = format!("worker/{}", holder[0].index);
    assert_eq!(held[0].reason, Some(own.clone().of_task(name.clone())));
    assert_eq!(
        m.placement_reason(),
        Some(own.of_task(name)),
        "the job's reason is the holder's"
    );
    // What the RM hears: both wait.
    let w = req.waiting.unwrap();
    assert_eq!((w.len(), w[0].count, w[0].gpus), (1, 2, 3));
    // The whole gang tries again at one time, and a heartbeat in between does not put it off.
    let again = m.tasks()[0].not_before;
    assert!(m.tasks().iter().all(|t| t.not_before == again));
    answer(&mut m, AllocateResponse::default(), now);
    heartbeat(&mut m, now.after(Duration::from_millis(10)));
    assert!(m.tasks().iter().all(|t| t.not_before == again), "not put off");
}

/// A gang whose asks all place goes out as one gang round; it launches only once every task
/// holds a container, and gives back what it holds when the gang timeout passes first.
#[test]
fn a_gang_launches_whole_or_gives_back_after_its_timeout() {
    let (mut m, now) = machine(
        "name: j\ngang: true\ntaskRoles:\n  worker:\n    instances: 2\n    \
         resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 1}\n    commands: [\"true\"]\n",
    );
    let req = heartbeat(&mut m, now);
    assert_eq!(req.asks.len(), 2);
    assert!(req.asks.iter().all(|a| a.gang.as_deref() == Some("gang-0")));
    // Only one granted: no launch; the gang waits.
    let g0 = grant(&req.asks[0], "c0");
    assert_eq!(answer(&mut m, granted(vec![g0]), now), Effect::Idle { busy: false });
    let timeout = Duration::from_secs(AmSettings::default().gang_timeout_sec);
    let later = now.after(timeout);
    let req2 = heartbeat(&mut m, later);
    assert!(req2.asks.is_empty());
    answer(&mut m, AllocateResponse::default(), later);
    assert!(m.tasks().iter().all(|t| t.state == TaskState::TaskWaiting));
    // The task whose container went back says it waits for its gang, until the gang is
    // tried again (the other's ask had timed out before).
    let why = m.tasks()[0].reason.clone().unwrap();
    assert_eq!(why.kind, Kind::Gang, "{why:?}");
    assert!(why.until_ms.is_some_and(|u| u > later.ms), "{why:?}");
    let req3 = heartbeat(&mut m, later);
    assert!(req3.asks.is_empty(), "it backs off before trying again");
    let (cancels, releases): (Vec<u64>, Vec<String>) = (
        [req2.cancels, req3.cancels].concat(),
        [req2.releases, req3.releases].concat(),
    );
    assert_eq!(cancels, vec![req.asks[1].request_id], "the ask withdrawn");
    assert_eq!(releases, vec!["c0".to_string()], "the container given back");
    answer(&mut m, AllocateResponse::default(), later);
    // Once the back-off is over, both are asked again; granted together, both launch.
    let much_later = later.after(Duration::from_secs(3600));
    let req4 = heartbeat(&mut m, much_later);
    assert_eq!(req4.asks.len(), 2);
    assert!(req4.asks.iter().all(|a| a.gang.as_deref() == Some("gang-1")));
    let grants = vec![grant(&req4.asks[0], "c1"), grant(&req4.asks[1], "c2")];
    match effect(m.step(Input::Allocated(Ok(granted(grants))), much_later)) {
        Effect::Launch(ls) => {
            assert_eq!(ls.len(), 2);
            let hosts = &ls[0].context.env["GPUAM_HOSTS_WORKER"];
            assert_eq!(hosts.split(',').count(), 2, "{hosts}");
        }
        other => panic!("{other:?}"),
    }
}

/// At most 2,000 asks a heartbeat; the rest follow in the next.
#[test]
fn a_heartbeat_asks_for_at_most_the_cap() {
    let nodes = vec![Node::new(
        "big",
        "/r",
        Resources::with_mask(4000, 4_000_000, 0, PortSet::new()),
    )];
    let (mut m, now) = machine_on(
        "name: j\ntaskRoles:\n  w:\n    instances: 2500\n    resourcePerInstance: {cpu: 1, memoryMB: 1}\n    commands: [\"true\"]\n",
        nodes,
        Default::default(),
    );
    let first = heartbeat(&mut m, now);
    assert_eq!(first.asks.len(), MAX_ASKS_PER_HEARTBEAT);
    assert_eq!(
        answer(&mut m, AllocateResponse::default(), now),
        Effect::Idle { busy: true },
        "tasks wait ready: the next heartbeat comes at once"
    );
    let second = heartbeat(&mut m, now);
    assert_eq!(second.asks.len(), 500);
}

#[test]
fn a_rejected_ask_waits_again_and_a_final_rejection_refreshes_the_node_view() {
    let (mut m, now) = machine(
        "name: j\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 1}\n    commands: [\"true\"]\n",
    );
    let req = heartbeat(&mut m, now);
    let resp = AllocateResponse {
        rejected: vec![Rejection {
            request_id: req.asks[0].request_id,
            reason: "no such GPU".into(),
            retryable: false,
            wait: None,
        }],
        ..Default::default()
    };
    assert_eq!(answer(&mut m, resp, now), Effect::Idle { busy: true });
    let t = &m.tasks()[0];
    assert_eq!(t.state, TaskState::TaskWaiting);
    let why = t.reason.as_ref().unwrap();
    assert!(why.detail.contains("rejected: no such GPU"), "{why:?}");
    assert_eq!(why.kind, crate::reason::Kind::Retry);
    assert_eq!(effect(m.step(Input::Heartbeat, now)), Effect::FetchNodes);
    match effect(m.step(Input::Nodes(Ok(one_node())), now)) {
        Effect::Allocate(req) => assert_eq!(req.asks.len(), 1, "placed again"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_unanswering_rm_is_waited_out_until_its_timeout_and_a_refusal_fails_the_job() {
    let yaml = "name: j\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {cpu: 1, memoryMB: 10}\n    commands: [\"true\"]\n";
    let down = |retryable| {
        Input::Allocated(Err(RmFailure {
            retryable,
            message: "connection refused".into(),
        }))
    };
    let (mut m, now) = machine(yaml);
    heartbeat(&mut m, now);
    assert_eq!(
        effect(m.step(down(true), now)),
        Effect::RmDown {
            down_for: Duration::ZERO
        }
    );
    // The ask was not acted on: it goes again.
    assert_eq!(
        heartbeat(&mut m, now).asks.len(),
        1,
        "the ask the RM did not act on goes again"
    );
    let limit = Duration::from_secs(AmSettings::default().rm_unreachable_timeout_sec);
    match effect(m.step(down(true), now.after(limit))) {
        Effect::Done(end) => {
            assert_eq!(end.exit_code, crate::exit::RM_UNREACHABLE);
            assert!(end.diagnostics.contains("unreachable"), "{}", end.diagnostics);
        }
        other => panic!("{other:?}"),
    }
    let (mut m, now) = machine(yaml);
    heartbeat(&mut m, now);
    match effect(m.step(down(false), now)) {
        Effect::Done(end) => assert_eq!((end.state, end.exit_code), (JobState::Failed, 1)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_task_that_can_never_fit_fails_the_job() {
    let (mut m, now) = machine(
        "name: j\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 8}\n    commands: [\"true\"]\n",
    );
    heartbeat(&mut m, now);
    match answer(&mut m, AllocateResponse::default(), now) {
        Effect::Done(end) => {
            assert_eq!(end.state, JobState::Failed);
            assert!(end.diagnostics.contains("can never be placed"), "{}", end.diagnostics);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(m.tasks()[0].state, TaskState::TaskCompleted);
}

#[test]
fn a_failed_launch_is_retried_and_a_finished_job_says_done() {
    let (mut m, now) = machine(
        "name: j\ntaskRoles:\n  w:\n    instances: 1\n    taskRetryCount: 0\n    resourcePerInstance: {cpu: 1, memoryMB: 10}\n    commands: [\"true\"]\n",
    );
    let req = heartbeat(&mut m, now);
    let Effect::Launch(ls) = effect(m.step(Input::Allocated(Ok(granted(vec![grant(&req.asks[0], "c0")]))), now)) else {
        panic!("no launch")
    };
    assert_eq!(ls[0].context.env["GPUAM_TASK_ROLE"], "w");
    m.step(Input::Launched(vec![(ls[0].task, Err("node said no".into()))]), now);
    let t = &m.tasks()[0];
    assert_eq!((t.state, t.attempt), (TaskState::TaskWaiting, 2), "transient: retried");
    let req = heartbeat(&mut m, now);
    assert_eq!(req.releases, vec!["c0".to_string()]);
    assert_eq!(req.asks.len(), 1);
    let g = grant(&req.asks[0], "c1");
    assert_eq!(answer(&mut m, granted(vec![g]), now), Effect::Idle { busy: false });
    assert_eq!(m.tasks()[0].state, TaskState::ContainerRunning);
    heartbeat(&mut m, now);
    match answer(&mut m, completed("c1", 0), now) {
        Effect::Done(end) => assert_eq!((end.state, end.exit_code), (JobState::Succeeded, 0)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn resync_lines_up_the_am_with_what_the_rm_recovered() {
    let (mut m, now) = machine(
        "name: j\ntaskRoles:\n  worker:\n    instances: 3\n    taskRetryCount: 0\n    \
         resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 1}\n    commands: [\"true\"]\n",
    );
    let req = heartbeat(&mut m, now);
    assert!(m.tasks().iter().all(|t| t.state == TaskState::ContainerRequested));
    let (c0, c1, c2) = (
        grant(&req.asks[0], "c0"),
        grant(&req.asks[1], "c1"),
        grant(&req.asks[2], "c2"),
    );
    answer(&mut m, granted(vec![c0.clone(), c1.clone()]), now);
    assert_eq!(m.tasks()[1].state, TaskState::ContainerRunning);
    // The RM restarted: it acted on nothing and asks for a resync.
    heartbeat(&mut m, now);
    let resync = AllocateResponse {
        command: Some(crate::protocol::AmCommand::Resync),
        ..Default::default()
    };
    assert!(matches!(
        effect(m.step(Input::Allocated(Ok(resync)), now)),
        Effect::Register(_)
    ));
    // While the RM was away: c1 ended (exit 0), c2 was granted but its answer was
    // lost, some other live container appeared, and c0 is unknown to the RM.
    let stray = Container {
        container_id: "c-stray".into(),
        task: Some("worker/7".into()),
        ..c2.clone()
    };
    let registered = RegisterResponse {
        containers_from_previous_attempts: vec![
            seen(c1, ContainerState::Complete, Some(0)),
            seen(c2, ContainerState::Allocated, None),
            seen(stray, ContainerState::Allocated, None),
        ],
        maximum_capability: Resources::default(),
        attempt: 1,
        container_expiry_sec: 600,
    };
    let out = m.step(Input::Registered(Ok(registered)), now);
    assert!(out.events.contains(&Event::Resynced));
    let Effect::Launch(ls) = effect(out) else {
        panic!("c2 launches")
    };
    assert_eq!(ls[0].container.container_id, "c2");
    let t = m.tasks();
    assert_eq!(t[1].state, TaskState::TaskCompleted, "the RM's exit status counts");
    assert_eq!(t[1].succeeded, Some(true));
    assert_eq!(t[2].state, TaskState::ContainerAllocated, "the lost answer is taken");
    // c0: lost (-7151, transient): retried without using taskRetryCount 0.
    assert_eq!((t[0].state, t[0].attempt), (TaskState::TaskWaiting, 2));
    let exit = &t[0].exit.as_ref().unwrap().0;
    assert_eq!(exit.code, crate::am::exits::code::CONTAINER_RM_RESYNC_LOST);
    m.step(Input::Launched(vec![(ls[0].task, Ok(None))]), now);
    let req = heartbeat(&mut m, now);
    assert!(req.releases.contains(&"c-stray".to_string()), "{:?}", req.releases);
    assert!(m.ended().is_none());
    // The same completion arriving later in a heartbeat changes nothing.
    answer(&mut m, completed("c1", 0), now);
    assert_eq!(m.tasks()[1].state, TaskState::TaskCompleted);
}

#[test]
fn adoption_rebuilds_retry_counts_from_the_task_history() {
    let (mut m, now) = machine(
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
    let out = m.step(
        Input::Adopt(vec![lost, seen(container("c2", 2), ContainerState::Running, None)]),
        now,
    );
    assert!(out
        .events
        .iter()
        .any(|e| matches!(e, Event::ContainerAt { container_id, .. } if container_id == "c2")));
    let t = &m.tasks()[0];
    assert_eq!((t.attempt, t.state), (2, TaskState::ContainerRunning));
    assert_eq!(
        (t.retry.retried, t.retry.transient_retried),
        (0, 1),
        "the node loss was transient"
    );
    // So a failure of attempt 2 still has its one counted retry.
    heartbeat(&mut m, now);
    answer(&mut m, completed("c2", 1), now);
    assert_eq!((m.tasks()[0].attempt, m.tasks()[0].state), (3, TaskState::TaskWaiting));
    assert!(m.ended().is_none());
}

#[test]
fn a_preempted_task_is_retried_without_using_its_retry_count() {
    let (mut m, mut now) = machine(
        "name: j\ntaskRoles:\n  worker:\n    instances: 1\n    taskRetryCount: 0\n    \
         resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 1}\n    commands: [\"true\"]\n",
    );
    let notice = |id: &str, now: Now| AllocateResponse {
        preempt: vec![PreemptNotice {
            container_id: id.into(),
            deadline_ms: now.ms + 60_000,
            reason: "queue a is below its share".into(),
        }],
        ..Default::default()
    };
    for round in 0..3u32 {
        let id = format!("c{round}");
        let req = heartbeat(&mut m, now);
        answer(&mut m, granted(vec![grant(&req.asks[0], &id)]), now);
        assert_eq!(m.tasks()[0].state, TaskState::ContainerRunning);
        // The notice, then the task exits by itself (0) before the release is due.
        heartbeat(&mut m, now);
        answer(&mut m, notice(&id, now), now);
        assert_eq!(m.tasks()[0].state, TaskState::ContainerRunning, "not due yet");
        heartbeat(&mut m, now);
        answer(&mut m, completed(&id, 0), now);
        let t = &m.tasks()[0];
        assert_eq!(t.state, TaskState::TaskWaiting, "preempted, so retried (round {round})");
        assert_eq!((t.retry.retried, t.retry.preempted), (0, round + 1));
        assert_eq!(
            t.exit.as_ref().unwrap().0.code,
            crate::am::exits::code::CONTAINER_PREEMPTED
        );
        now = now.after(Duration::from_secs(1));
    }
    // An unstarted container under notice goes back at once.
    let req = heartbeat(&mut m, now);
    let mut resp = notice("c9", now);
    resp.allocated = vec![grant(&req.asks[0], "c9")];
    answer(&mut m, resp, now);
    assert_eq!(m.tasks()[0].state, TaskState::TaskWaiting);
    assert_eq!(heartbeat(&mut m, now).releases, vec!["c9".to_string()]);
    assert!(m.ended().is_none());
}

/// One PCIe-paired node of 4 GPUs where another job holds one GPU of each pair (0 and 2):
/// only the split pair 1+3 is free.
fn split_pairs() -> Vec<Node> {
    let t = Arc::new(crate::topology::Topology::preset("pcie4").unwrap());
    let mut n = Node::new("old", "/r", Resources::with_mask(8, 8000, 0xf, PortSet::new()));
    n.set_used(Resources::with_mask(2, 100, 0b0101, PortSet::new()));
    n.topology = Some(t);
    vec![n]
}

/// The topology wait in the AM: a 2-GPU task that finds only a split pair (another job holds
/// one GPU of each pair) waits, saying why, and once `select.topology_wait_sec` has passed
/// since it began waiting it asks for the set `gpuam plan` shows.
#[test]
fn a_task_waits_for_its_ideal_tier_then_asks_for_what_plan_shows() {
    let yaml = "name: j\ntaskRoles:\n  worker:\n    instances: 1\n    \
                resourcePerInstance: {cpu: 1, memoryMB: 1000, gpu: 2}\n    commands: [\"true\"]\n";
    let nodes = split_pairs;
    let (mut m, now) = machine_on(yaml, nodes(), Default::default());
    let plan = crate::am::plan_rm::plan_job(m.job(), nodes(), Default::default(), &AmSettings::default());
    assert_eq!(plan.placements[0].topology_wait_sec, Some(300));
    assert!(heartbeat(&mut m, now).asks.is_empty());
    let t = &m.tasks()[0];
    let why = t.reason.as_ref().unwrap();
    assert!(why.detail.contains("holding out for 2 GPUs of tier 1"), "{why:?}");
    assert_eq!(why.kind, crate::reason::Kind::Topology);
    assert_eq!(
        (why.since_ms, why.until_ms),
        (Some(now.ms), Some(now.ms + 300_000)),
        "it shows when it began waiting and its deadline"
    );
    assert!(t.not_before.is_some(), "it backs off and tries again");
    answer(&mut m, AllocateResponse::default(), now);
    let req = heartbeat(&mut m, now.after(Duration::from_secs(300)));
    let a = &req.asks[0];
    assert_eq!((a.host.as_str(), a.gpu_mask), ("old", 0b1010));
    assert_eq!(a.gpu_mask, plan.placements[0].placement.resources.gpu_mask);
}

/// The job's reason from one heartbeat's answer: the `Event::Reason` it reports (the last
/// one, if it changed).
fn reason_event(m: &mut JobMachine, resp: AllocateResponse, now: Now) -> Option<Option<Reason>> {
    let out = m.step(Input::Allocated(Ok(resp)), now);
    out.events.into_iter().rev().find_map(|e| match e {
        Event::Reason(r) => Some(r),
        _ => None,
    })
}

/// A gang held back by the topology wait shows the topology wait, not a gang note: its
/// placed task carries the holder's reason (kind, detail, since and deadline), so does the
/// job and what the RM hears; a queue cause from the RM outranks it, the RM's "nothing
/// fits" guess does not. A new task says it is starting; a placed task never has a wait.
#[test]
fn a_gang_held_by_the_topology_wait_shows_the_topology_wait_with_its_deadline() {
    let yaml = "name: j\ngang: true\ntaskRoles:\n  ps:\n    instances: 1\n    \
                resourcePerInstance: {cpu: 1, memoryMB: 100, gpu: 0}\n    commands: [\"true\"]\n  \
                worker:\n    instances: 1\n    \
                resourcePerInstance: {cpu: 1, memoryMB: 1000, gpu: 2}\n    commands: [\"true\"]\n";
    let nodes = split_pairs;
    let (mut m, now) = machine_on(yaml, nodes(), Default::default());
    assert!(m
        .statuses()
        .iter()
        .all(|s| s.reason.as_ref().map(|r| r.kind) == Some(Kind::Starting)));
    let req = heartbeat(&mut m, now);
    assert!(req.asks.is_empty(), "the gang waits whole");
    let topo = Reason::new(Kind::Topology, "")
        .since(now.ms)
        .until(now.ms + 300_000)
        .of_task("worker/0");
    let like_topo = |r: &Option<Reason>| {
        let r = r.clone().unwrap_or_else(|| panic!("no reason"));
        assert!(r.detail.starts_with("holding out for 2 GPUs of tier 1"), "{r:?}");
        Reason {
            detail: String::new(),
            ..r
        }
    };
    assert_eq!(like_topo(&req.wait_reason), topo, "what the RM hears");
    for s in m.statuses() {
        // The worker's own reason; the parameter server's is the worker's, said of it.
        let want = match s.role.as_str() {
            "worker" => Reason {
                task: None,
                ..topo.clone()
            },
            _ => topo.clone(),
        };
        assert_eq!(like_topo(&s.reason), want, "{s:?}");
        assert_eq!(s.waiting_reason, s.reason.as_ref().map(Reason::text));
    }
    // The RM's own guess ("nothing fits") does not overwrite it; a queue cause does.
    let guess = AllocateResponse {
        wait_reason: Some(Reason::new(Kind::Resources, "nothing fits yet")),
        ..Default::default()
    };
    let job = reason_event(&mut m, guess, now).expect("the job's reason is reported");
    assert_eq!(like_topo(&job), topo);
    let later = now.after(Duration::from_secs(1));
    heartbeat(&mut m, later);
    let cap = Reason::new(Kind::QueueShare, "queue `a` is at its cap (maxGpus 2)");
    let capped = AllocateResponse {
        response_id: 1,
        wait_reason: Some(cap.clone()),
        ..Default::default()
    };
    assert_eq!(reason_event(&mut m, capped, later), Some(Some(cap)));
}

/// A task whose ask is out is not placed: it says it was asked for, never where it runs;
/// once granted it has no reason at all.
#[test]
fn an_ask_not_yet_granted_is_not_a_place() {
    let (mut m, now) = machine(
        "name: j\ntaskRoles:\n  worker:\n    instances: 1\n    \
         resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 2}\n    commands: [\"true\"]\n",
    );
    let req = heartbeat(&mut m, now);
    let s = &m.statuses()[0];
    assert_eq!(s.state, TaskState::ContainerRequested);
    let why = s.reason.clone().unwrap();
    assert_eq!(why.kind, Kind::Requested);
    assert!(why.detail.starts_with("asked the RM for n1 GPUs "), "{why:?}");
    assert_eq!(s.host, None);
    let resp = AllocateResponse {
        allocated: vec![grant(&req.asks[0], "c1")],
        ..Default::default()
    };
    answer(&mut m, resp, now);
    let s = &m.statuses()[0];
    assert!(
        s.host.is_some() && s.reason.is_none() && s.waiting_reason.is_none(),
        "{s:?}"
    );
}

/// An ask the RM's queue gate refused waits for the queue, typed as the gate said (not a
/// retry); any other refusal is tried again.
#[test]
fn a_refusal_by_the_queue_gate_waits_for_the_queue() {
    let yaml = "name: j\ntaskRoles:\n  w:\n    instances: 2\n    \
                resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 1}\n    commands: [\"true\"]\n";
    let (mut m, now) = machine(yaml);
    let req = heartbeat(&mut m, now);
    let cap = Reason::new(Kind::QueueShare, "queue `a` is at its cap (maxGpus 1)");
    let rejected = |i: usize, wait: Option<Reason>| Rejection {
        request_id: req.asks[i].request_id,
        reason: "refused".into(),
        retryable: true,
        wait: wait.map(Box::new),
    };
    let resp = AllocateResponse {
        rejected: vec![rejected(0, Some(cap.clone())), rejected(1, None)],
        ..Default::default()
    };
    answer(&mut m, resp, now);
    let kinds: Vec<(Kind, String)> = m
        .tasks()
        .iter()
        .map(|t| t.reason.clone().map(|r| (r.kind, r.detail)).unwrap())
        .collect();
    assert_eq!(kinds[0], (Kind::QueueShare, cap.detail.clone()));
    assert_eq!(kinds[1].0, Kind::Retry, "{kinds:?}");
    assert_eq!(m.placement_reason(), Some(cap.since(now.ms).of_task("w/0")));
}

/// While the RM's queues name a cause, a task that finds no node now (here: the one it was
/// refused on is skipped for a while) waits for its queue, as the job does; without one it
/// waits for resources.
#[test]
fn not_now_while_the_queue_names_a_cause_is_the_queues_wait() {
    let yaml = "name: j\ntaskRoles:\n  w:\n    instances: 1\n    \
                resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 4}\n    commands: [\"true\"]\n";
    let cap = Reason::new(Kind::QueueShare, "queue `a` is at its cap (maxGpus 1)").since(7);
    for (queue, kind) in [(Some(cap.clone()), Kind::QueueShare), (None, Kind::Resources)] {
        let (mut m, now) = machine(yaml);
        let req = heartbeat(&mut m, now);
        let resp = AllocateResponse {
            rejected: vec![Rejection {
                request_id: req.asks[0].request_id,
                reason: "refused".into(),
                retryable: true,
                wait: queue.clone().map(Box::new),
            }],
            wait_reason: queue.clone(),
            ..Default::default()
        };
        answer(&mut m, resp, now);
        let req = heartbeat(&mut m, now);
        assert!(req.asks.is_empty(), "the refused GPUs are skipped for a while");
        let why = m.tasks()[0].reason.clone().unwrap();
        assert_eq!(why.kind, kind, "{why:?}");
        if let Some(q) = &queue {
            assert_eq!(&why, q);
        }
    }
}

/// The node view is reported replaced once, then only the hosts an answer changed (issue
/// 29: a heartbeat costs O(changes), not O(nodes)); the dashboard's pages, computed from the
/// view when asked (`am::node_page`), show each change.
#[test]
fn the_node_view_is_reported_whole_once_then_by_changes() {
    use crate::am::status::NodeSource;
    let node = |host: &str, mask: u64| Node::new(host, "/r", Resources::with_mask(8, 8000, mask, PortSet::new()));
    let (mut m, now) = machine_on(
        "name: j\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {cpu: 1, memoryMB: 10}\n    commands: [\"true\"]\n",
        vec![node("a", 0xf), node("b", 0xf), node("c", 0xf)],
        Default::default(),
    );
    let pages = crate::am::node_page::ViewNodes(m.selector.clone());
    let hosts = |pages: &crate::am::node_page::ViewNodes| {
        let (total, page) = pages.page(None, 0, 100, &Default::default());
        assert_eq!(total, page.len());
        page.into_iter().map(|n| (n.host, n.total_gpu_mask)).collect::<Vec<_>>()
    };
    let nodes_events = |events: &[Event]| -> Vec<Event> {
        events
            .iter()
            .filter(|e| matches!(e, Event::Nodes { .. } | Event::NodesChanged(_)))
            .cloned()
            .collect()
    };
    heartbeat(&mut m, now);
    let out = m.step(Input::Allocated(Ok(AllocateResponse::default())), now);
    match nodes_events(&out.events).as_slice() {
        [Event::Nodes { count: 3 }] => {}
        other => panic!("expected the whole view first, got {other:?}"),
    }
    let hex = crate::resources::mask_hex;
    assert_eq!(
        hosts(&pages),
        [("a".into(), hex(0xf)), ("b".into(), hex(0xf)), ("c".into(), hex(0xf))]
    );
    // An answer that changes `b` and brings a new node `d`; `c` goes unusable.
    let mut lost = node("c", 0xf);
    lost.state = crate::cluster::NodeState::Lost;
    let report = |n: Node| crate::cluster::rm_json::NodeReport {
        node: n,
        num_containers: 0,
        last_health_update_ms: 0,
    };
    let resp = AllocateResponse {
        updated_nodes: vec![report(node("b", 0x3)), report(node("d", 0xff)), report(lost)],
        ..Default::default()
    };
    heartbeat(&mut m, now);
    let out = m.step(Input::Allocated(Ok(resp)), now);
    match nodes_events(&out.events).as_slice() {
        [Event::NodesChanged(c)] => assert_eq!(c, &["b", "c", "d"]),
        other => panic!("expected only the changed nodes, got {other:?}"),
    }
    assert_eq!(
        hosts(&pages),
        [("a".into(), hex(0xf)), ("b".into(), hex(0x3)), ("d".into(), hex(0xff))]
    );
    // Nothing changed: nothing reported.
    heartbeat(&mut m, now);
    let out = m.step(Input::Allocated(Ok(AllocateResponse::default())), now);
    assert!(nodes_events(&out.events).is_empty());
}

/// A role's declared `maxRunSec` (else the job's) goes out with each of its asks, so the
/// RM knows when the container is expected to end (issue 27).
#[test]
fn asks_carry_the_roles_declared_run_time_limit() {
    let (mut m, now) = machine(
        "name: j\nmaxRunSec: 600\ntaskRoles:\n  a:\n    resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 1}\n    \
         commands: [\"true\"]\n  b:\n    maxRunSec: 30\n    resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 1}\n    \
         commands: [\"true\"]\n",
    );
    let req = heartbeat(&mut m, now);
    let mut limits: Vec<(Option<String>, Option<u64>)> =
        req.asks.iter().map(|a| (a.task.clone(), a.max_run_sec)).collect();
    limits.sort();
    assert_eq!(
        limits,
        vec![(Some("a/0".into()), Some(600)), (Some("b/0".into()), Some(30))]
    );
    let (mut m, now) = machine(
        "name: j\ntaskRoles:\n  a:\n    resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 1}\n    commands: [\"true\"]\n",
    );
    assert!(heartbeat(&mut m, now).asks.iter().all(|a| a.max_run_sec.is_none()));
}

/// The RM's `othersWaiting` reaches the AM's placement (issue 27: while other jobs wait,
/// nodes are packed right after the GPU tiers), and goes when the RM stops sending it.
#[test]
fn the_rms_others_waiting_reaches_the_placement() {
    let (mut m, now) = machine(
        "name: j\ntaskRoles:\n  a:\n    resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 1}\n    commands: [\"true\"]\n",
    );
    heartbeat(&mut m, now);
    assert!(!m.selector.others_wait());
    let busy = AllocateResponse {
        others_waiting: true,
        ..Default::default()
    };
    m.step(Input::Allocated(Ok(busy)), now);
    assert!(m.selector.others_wait());
    heartbeat(&mut m, now);
    m.step(Input::Allocated(Ok(AllocateResponse::default())), now);
    assert!(!m.selector.others_wait());
}

/// The RM's start estimate in an allocate answer reaches the job's status (an event when it
/// changes, none while it stays the same), and goes when the RM no longer sends one.
#[test]
fn the_rms_start_estimate_reaches_the_jobs_status() {
    let (mut m, now) = machine(
        "name: j\ntaskRoles:\n  a:\n    resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 1}\n    commands: [\"true\"]\n",
    );
    heartbeat(&mut m, now);
    let est = crate::protocol::StartEstimate {
        start_ms: Some(now.ms + 600_000),
        all_start_ms: None,
        basis: crate::protocol::StartBasis {
            declared: 3,
            ..Default::default()
        },
        queue_ahead: Default::default(),
        after_reservation_of: None,
        text: "declared limits of 3 running containers".into(),
    };
    let estimate_events = |out: Output| -> Vec<Option<crate::protocol::StartEstimate>> {
        out.events
            .into_iter()
            .filter_map(|e| match e {
                Event::StartEstimate(e) => Some(e),
                _ => None,
            })
            .collect()
    };
    let with = AllocateResponse {
        start_estimate: Some(Box::new(est.clone())),
        ..Default::default()
    };
    let out = m.step(Input::Allocated(Ok(with.clone())), now);
    assert_eq!(estimate_events(out), vec![Some(est)]);
    heartbeat(&mut m, now);
    let out = m.step(Input::Allocated(Ok(with)), now);
    assert!(estimate_events(out).is_empty(), "unchanged: no event");
    heartbeat(&mut m, now);
    let out = m.step(Input::Allocated(Ok(AllocateResponse::default())), now);
    assert_eq!(estimate_events(out), vec![None]);
}

/// An AM with nothing to place, ask for, launch or give back lets the RM hold its
/// heartbeat (`am.idle_hold_ms`), and skips the node refresh; one with a task to place,
/// or a container to give back, is not held (issue 29).
#[test]
fn only_an_idle_am_lets_the_rm_hold_its_heartbeat() {
    let (mut m, now) = machine(
        "name: j\ntaskRoles:\n  w:\n    instances: 2\n    taskRetryCount: 1\n    resourcePerInstance: {cpu: 1, memoryMB: 10}\n    commands: [\"true\"]\n",
    );
    let req = heartbeat(&mut m, now);
    assert_eq!((req.asks.len(), req.hold_ms), (2, None), "asking: not held");
    // One granted, the other refused: that task waits to be asked for again.
    let g0 = grant(&req.asks[0], "c0");
    let refused = crate::protocol::Rejection {
        request_id: req.asks[1].request_id,
        reason: "taken".into(),
        retryable: true,
        wait: None,
    };
    let resp = AllocateResponse {
        rejected: vec![refused],
        ..granted(vec![g0])
    };
    answer(&mut m, resp, now);
    let later = now.after(Duration::from_secs(60));
    let req = heartbeat(&mut m, later);
    assert_eq!(req.hold_ms, None, "a task still waits: not held");
    let g1 = grant(&req.asks[0], "c1");
    answer(&mut m, granted(vec![g1]), later);
    assert!(m.tasks().iter().all(|t| t.state == TaskState::ContainerRunning));
    // Both run: held, and no node refresh although one is long due.
    let much_later = later.after(Duration::from_secs(60));
    let out = m.step(Input::Heartbeat, much_later);
    let Effect::Allocate(req) = effect(out) else {
        panic!("an idle AM refreshed its node view")
    };
    assert_eq!(req.hold_ms, Some(AmSettings::default().idle_hold_ms));
    // A task fails and is retried: it has a container to give back and a task to
    // place, so its next heartbeat is not held.
    answer(&mut m, completed("c0", 1), much_later);
    let req = heartbeat(&mut m, much_later.after(Duration::from_secs(5)));
    assert!(!req.releases.is_empty() || !req.asks.is_empty(), "{req:?}");
    assert_eq!(req.hold_ms, None);
}
