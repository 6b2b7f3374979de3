//! Tests through the real RM HTTP server of issue 27's live parts: a declared run-time
//! limit is enforced (the container ends with its own cause), and a waiting gang's
//! reservation holds off a long small job while a short one backfills; the waiting
//! applications are told when they are expected to start.

use super::*;
use crate::am::rm_client::RmClient;
use crate::protocol::{exit_status, AllocateRequest, Ask, LaunchContext, RegisterRequest, WaitingTasks};
use crate::resources::{PortSet, Resources};

fn ask(request_id: u64, host: &str, mask: u64, max_run_sec: Option<u64>) -> Ask {
    Ask {
        cpu: 1,
        memory_mb: 10,
        gpu_mask: mask,
        task: Some(format!("w/{request_id}")),
        task_attempt: 1,
        max_run_sec,
        ..Ask::for_resources(request_id, host, &Resources::with_mask(1, 10, mask, PortSet::new()))
    }
}

async fn rm_on(hosts: &[&str], dir: &Path, reserve: crate::rm::scheduler::reservation::Policy) -> RmHandle {
    let nodes: Vec<Node> = hosts
        .iter()
        .map(|h| Node::new(*h, "/r", Resources::with_mask(4, 1000, 0x3, PortSet::new())))
        .collect();
    let opts = RmOptions {
        launch_am: false,
        reserve,
        ..RmOptions::new(nodes, "127.0.0.1:0".parse().unwrap(), dir.to_path_buf())
    };
    start(opts).await.unwrap()
}

/// `count` waiting tasks of `gpus` GPUs each (role `w`).
fn wait(count: u32, gpus: u32) -> WaitingTasks {
    WaitingTasks {
        role: "w".into(),
        count,
        gpus,
        cpu: 1,
        memory_mb: 10,
        ..Default::default()
    }
}

/// An RM on one 2-GPU node with the default reservation policy.
async fn one_node(dir: &Path) -> RmHandle {
    rm_on(&["n1"], &dir.join("work"), super::scheduling::default_reserve_policy()).await
}

/// The answer to `asks`, every one of them granted.
async fn grant_all(c: &RmClient, asks: Vec<Ask>) -> crate::protocol::AllocateResponse {
    let n = asks.len();
    let resp = c
        .allocate(&AllocateRequest {
            asks,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(resp.allocated.len(), n, "{:?}", resp.rejected);
    resp
}

async fn app(rm: &RmHandle, name: &str) -> (String, RmClient) {
    let (id, token) = rm.register_test_app(name);
    let c = RmClient::for_app(&rm.base_url(), &id, &token);
    c.register(&RegisterRequest::default()).await.unwrap();
    (id, c)
}

async fn run(c: &RmClient, host: &str, container: &crate::protocol::Container) {
    run_command(c, host, container, "sleep 60").await;
}

/// Starts `container` on `host` running `command`.
async fn run_command(c: &RmClient, host: &str, container: &crate::protocol::Container, command: &str) {
    c.start_container(
        &container.node_http_address,
        host,
        &container.container_id,
        &LaunchContext {
            commands: vec![command.into()],
            env: Default::default(),
        },
    )
    .await
    .unwrap();
}

/// A container past its declared `maxRunSec` is ended by the RM with the typed cause's
/// words (exit KILLED_BY_RESOURCEMANAGER), and its node stops its processes.
#[tokio::test]
async fn a_container_past_its_declared_limit_is_ended_with_that_cause() {
    let dir = tempfile::tempdir().unwrap();
    let rm = one_node(dir.path()).await;
    let (_, a) = app(&rm, "short").await;
    let mut resp = grant_all(&a, vec![ask(1, "n1", 0x1, Some(1)), ask(2, "n1", 0x2, None)]).await;
    let (limited, free) = (resp.allocated[0].clone(), resp.allocated[1].clone());
    run(&a, "n1", &limited).await;
    run(&a, "n1", &free).await;
    let t0 = Instant::now();
    let ended = loop {
        resp = a
            .allocate(&AllocateRequest {
                response_id: resp.response_id,
                ..Default::default()
            })
            .await
            .unwrap();
        if let Some(c) = resp.completed.first() {
            break c.clone();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the limited container was never ended"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        ended.container_id, limited.container_id,
        "only the one that declared a limit"
    );
    assert_eq!(ended.exit_status, exit_status::KILLED_BY_RESOURCEMANAGER);
    assert!(
        ended.diagnostics.contains("ran past its declared limit maxRunSec=1"),
        "{}",
        ended.diagnostics
    );
    assert_eq!(
        crate::protocol::EndCause::of(&ended.diagnostics),
        Some(crate::protocol::EndCause::RunLimit { max_run_sec: 1 })
    );
    // Its GPU comes back once its node reports it dead; the other still holds its own.
    let t0 = Instant::now();
    loop {
        let used = rm.nodes_snapshot()[0].0.used().gpu_mask;
        if used == 0x2 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "GPU 0 never freed (used {used:#x})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    rm.shutdown().await;
}

/// Two 2-GPU nodes. A job holds 3 GPUs with a declared limit of 10 minutes; a gang of
/// 2 × 2 GPUs waits (reserved: ≥ 4 GPUs). The last free GPU is reserved for it: a small
/// job that declares no limit (or one past the gang's start) waits, told why; one that
/// declares an end before the gang's start backfills. Without a reservation policy the
/// long small job takes the GPU.
#[tokio::test]
async fn a_gangs_reservation_holds_off_a_long_small_job() {
    for reserving in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let policy = if reserving {
            crate::rm::scheduler::reserved::policy(0, 4)
        } else {
            crate::rm::scheduler::reserved::policy(0, 0)
        };
        let rm = rm_on(&["n1", "n2"], &dir.path().join("work"), policy).await;
        let (_, filler) = app(&rm, "filler").await;
        let (gang_id, gang) = app(&rm, "gang").await;
        let (small_id, small) = app(&rm, "small").await;
        rm.shared.lock().apps.get_mut(&gang_id).unwrap().gang = true;
        let held = filler
            .allocate(&AllocateRequest {
                asks: vec![
                    ask(1, "n1", 0x1, Some(600)),
                    ask(2, "n1", 0x2, Some(600)),
                    ask(3, "n2", 0x1, Some(600)),
                ],
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(held.allocated.len(), 3, "{:?}", held.rejected);
        // The gang declares an hour: the jobs behind it are told when it gives its room back.
        gang.allocate(&AllocateRequest {
            waiting: Some(vec![WaitingTasks {
                max_run_sec: Some(3600),
                ..wait(2, 2)
            }]),
            ..Default::default()
        })
        .await
        .unwrap();
        // A small job with no declared limit asks for the last free GPU.
        let long = small
            .allocate(&AllocateRequest {
                asks: vec![ask(1, "n2", 0x2, None)],
                waiting: Some(vec![wait(1, 1)]),
                ..Default::default()
            })
            .await
            .unwrap();
        if !reserving {
            assert_eq!(long.allocated.len(), 1, "no reservation: the small job takes it");
            rm.shutdown().await;
            continue;
        }
        assert!(long.allocated.is_empty(), "the reserved GPU was taken: {long:?}");
        let r = &long.rejected[0];
        assert!(r.retryable);
        // The gang is named by its size, not by another tenant's application id.
        assert!(
            r.reason.contains("reserved for a waiting gang of") && !r.reason.contains(&gang_id),
            "{}",
            r.reason
        );
        // One that ends after the gang's start (declared 20 minutes) waits too.
        let late = small
            .allocate(&AllocateRequest {
                response_id: long.response_id,
                asks: vec![ask(2, "n2", 0x2, Some(1200))],
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(late.allocated.is_empty(), "{late:?}");
        // One declared to end within a minute backfills.
        let short = small
            .allocate(&AllocateRequest {
                response_id: late.response_id,
                asks: vec![ask(3, "n2", 0x2, Some(60))],
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(short.allocated.len(), 1, "{:?}", short.rejected);
        // The gang is told when it will start, and on what basis.
        let t0 = Instant::now();
        let est = loop {
            let e = rm.shared.lock().apps.get(&gang_id).unwrap().waiting.estimate.clone();
            if let Some(e) = e {
                break e;
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "no estimate");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let start = est.start_ms.expect("the filler's ends are declared");
        let in_ms = start.saturating_sub(crate::protocol::now_ms());
        assert!(
            (500_000..=601_000).contains(&in_ms),
            "expected in ~600 s, got {in_ms} ms"
        );
        assert!(
            est.text.contains("declared limits of 4 running containers"),
            "{}",
            est.text
        );
        // `gpuam status` reads the same through the job's route; the small job that still
        // waits is told it starts after the gang's reservation.
        let user = RmClient::new(&rm.base_url()).with_user_token(Some(rm.admin_token().to_string()));
        let detail: serde_json::Value = user
            .get_json("status", &format!("/ws/v1/cluster/apps/{gang_id}/containers"))
            .await
            .unwrap();
        assert_eq!(
            detail["waiting"]["estimate"]["startMs"],
            serde_json::json!(start),
            "{detail}"
        );
        // Still waiting for a GPU, with no limit: the reserved one is the only one it could
        // take before the gang starts.
        small
            .allocate(&AllocateRequest {
                response_id: short.response_id,
                waiting: Some(vec![wait(1, 1)]),
                ..Default::default()
            })
            .await
            .unwrap();
        let t0 = Instant::now();
        loop {
            let detail: serde_json::Value = user
                .get_json("status", &format!("/ws/v1/cluster/apps/{small_id}/containers"))
                .await
                .unwrap();
            let e = &detail["waiting"]["estimate"];
            if e["afterReservationOf"]
                .as_str()
                .is_some_and(|g| g.starts_with("a waiting gang of "))
            {
                assert!(e["text"].as_str().unwrap().contains("after the reservation of"), "{e}");
                assert!(!detail.to_string().contains(&gang_id), "another tenant's id: {detail}");
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "no estimate for the small job: {detail}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // `gpuam plan --rm` of a job not yet submitted: the same rule over the same state.
        let spec = crate::spec::parse_job_spec(
            "name: next\ntaskRoles:\n  w:\n    resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 1}\n    \
             commands: [\"true\"]\n",
            "next.yaml",
        )
        .unwrap();
        let req = crate::am::queueing::estimate_request(&spec, &Default::default());
        let e: crate::protocol::StartEstimate = user
            .post_json("estimate", "/ws/v1/cluster/estimate", &req)
            .await
            .unwrap();
        // Behind the gang's reservation, which is named by its size: the gang is another
        // tenant's, whose application id this user is not told.
        assert!(
            e.after_reservation_of
                .as_deref()
                .is_some_and(|g| g.starts_with("a waiting gang of ")),
            "{e:?}"
        );
        assert!(
            !format!("{e:?}").contains(gang_id.as_str()),
            "another tenant's id in {e:?}"
        );
        // The queue ahead: the gang's hour on every GPU, then the small job, which declares
        // no limit, takes one for good, and this one the next.
        assert!(
            e.start_ms.is_some_and(|s| s >= start + 3_600_000),
            "{e:?} vs the gang's {start} + 1 h"
        );
        assert!(
            e.text.contains("behind 2 waiting jobs (1 declared, 1 with no limit)"),
            "{}",
            e.text
        );
        // Bad input is refused with the field named.
        let too_big = WaitingTasks {
            count: 1,
            gpus: 65,
            ..Default::default()
        };
        for (bad, field) in [
            (vec![too_big], None, "waiting[0]"),
            (vec![wait(1, 1)], Some("../etc".to_string()), "`name`"),
        ]
        .map(|(waiting, name, field)| {
            let bad = crate::protocol::EstimateRequest {
                waiting,
                name,
                ..req.clone()
            };
            (bad, field)
        }) {
            let err = user
                .post_json::<_, serde_json::Value>("estimate", "/ws/v1/cluster/estimate", &bad)
                .await
                .unwrap_err();
            assert!(err.to_string().contains(field), "{err}");
        }
        rm.shutdown().await;
    }
}

/// What the RM learns now: held `container`'s expected end, and waiting application
/// `app`'s expected run.
fn learned(
    rm: &RmHandle,
    container: &str,
    app: Option<&str>,
) -> (
    crate::rm::scheduler::reserved::Expected,
    Option<crate::rm::scheduler::reserved::Run>,
) {
    let st = rm.shared.lock();
    let mut built = super::scheduling::snapshot(&st, Instant::now());
    // Without an application, the reservation path's `learn_ends` (no runs).
    let what = if app.is_some() {
        super::scheduling::Learn::Draws
    } else {
        super::scheduling::Learn::Ends
    };
    let runs = super::scheduling::learn(&st, &mut built, what, None);
    let h = built
        .snap
        .held
        .iter()
        .position(|h| h.container_id == container)
        .unwrap();
    let run = app.map(|id| runs.runs[built.snap.apps.iter().position(|a| a.id == id).unwrap()]);
    (built.snap.ends[h], run)
}

/// Where no limit is declared, a container's expected end is learned: the median run time
/// of its job's completed tasks of the same role; before any completed, it is unknown.
#[tokio::test]
async fn an_undeclared_end_is_learned_from_the_roles_completed_tasks() {
    let dir = tempfile::tempdir().unwrap();
    let rm = one_node(dir.path()).await;
    let (_, a) = app(&rm, "learn").await;
    let resp = grant_all(&a, vec![ask(1, "n1", 0x1, None), ask(2, "n1", 0x2, None)]).await;
    let (quick, long) = (&resp.allocated[0], &resp.allocated[1]);
    // Both tasks are of role `w` (`w/1`, `w/2`).
    run(&a, "n1", long).await;
    let basis = |rm: &RmHandle| learned(rm, &long.container_id, None).0;
    assert_eq!(basis(&rm).basis, crate::rm::scheduler::reserved::EndBasis::Unknown);
    run_command(&a, "n1", quick, "true").await;
    let t0 = Instant::now();
    loop {
        let e = basis(&rm);
        if e.basis == crate::rm::scheduler::reserved::EndBasis::Learned {
            // `long` has outlived `quick`'s run (the role's median): it is expected to take
            // that run doubled until the end lies ahead (from its start), not to end now.
            let st = rm.shared.lock();
            let l = st.ledger.container(&long.container_id).unwrap();
            let q = st.ledger.container(&quick.container_id).unwrap();
            let run = q.ended_ms.saturating_sub(q.run_from_ms()).max(1);
            let end = e.end_ms.unwrap();
            let span = end - l.run_from_ms();
            assert!(
                span % run == 0 && (span / run).is_power_of_two(),
                "end {end}: {span} ms from its start is not {run} ms doubled"
            );
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "never learned: {e:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    rm.shutdown().await;
}

/// A job run again is expected to take what it took before: with no limit declared and no
/// task of its own completed, a running container's end, and a waiting job's run, are
/// learned from the same user's earlier run of the same job name — never another user's.
#[tokio::test]
async fn a_job_run_again_is_expected_to_take_what_it_took_before() {
    use crate::rm::scheduler::reserved::EndBasis;
    let dir = tempfile::tempdir().unwrap();
    let rm = one_node(dir.path()).await;
    let (first_id, first) = app(&rm, "train").await;
    let done = grant_all(&first, vec![ask(1, "n1", 0x1, None)]).await;
    let quick = &done.allocated[0];
    run_command(&first, "n1", quick, "true").await;
    let t0 = Instant::now();
    let took = loop {
        {
            let st = rm.shared.lock();
            let c = st.ledger.container(&quick.container_id).unwrap();
            if c.state == crate::protocol::ContainerState::Complete && c.ended_ms > 0 {
                assert_eq!(c.exit_status, Some(0));
                break c.ended_ms.saturating_sub(c.run_from_ms());
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "the first run never ended");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // The second run of `train` holds GPU 1 with no limit; a third waits.
    let (_, second) = app(&rm, "train").await;
    let held = grant_all(&second, vec![ask(2, "n1", 0x2, None)]).await;
    let long = &held.allocated[0];
    run(&second, "n1", long).await;
    let (third_id, third) = app(&rm, "train").await;
    third
        .allocate(&AllocateRequest {
            waiting: Some(vec![wait(1, 2)]),
            ..Default::default()
        })
        .await
        .unwrap();
    let learned = |rm: &RmHandle| {
        let (end, run) = learned(rm, &long.container_id, Some(&third_id));
        (end, run.unwrap())
    };
    let (end, waiting) = learned(&rm);
    assert_eq!(end.basis, EndBasis::Learned, "{end:?}");
    assert_eq!((waiting.basis, waiting.ms), (EndBasis::Learned, Some(took)));
    // `gpuam plan --rm` of a job not yet submitted, named `train`: its run is learned from
    // its caller's earlier runs of that name, and only its caller's.
    let user = rm.shared.lock().apps.get(&first_id).unwrap().report.user.clone();
    let guest_run = |user: &str, name: &str| {
        let st = rm.shared.lock();
        let mut built = super::scheduling::snapshot(&st, Instant::now());
        built.snap.apps.push(crate::rm::scheduler::AppDemand {
            id: super::scheduling::GUEST.into(),
            queue: 0,
            priority: 0,
            submitted_ms: 0,
            gang: false,
            waiting: vec![wait(1, 2)],
        });
        let guest = super::scheduling::Guest { user, name: Some(name) };
        let runs = super::scheduling::learn(&st, &mut built, super::scheduling::Learn::Draws, Some(guest));
        runs.runs[built.snap.apps.len() - 1]
    };
    let mine = guest_run(&user, "train");
    assert_eq!((mine.basis, mine.ms), (EndBasis::Learned, Some(took)));
    for (who, name) in [("eve", "train"), (user.as_str(), "other")] {
        let theirs = guest_run(who, name);
        assert_eq!((theirs.basis, theirs.ms), (EndBasis::Unknown, None), "{who}/{name}");
    }
    // The first run was another user's: nothing of it is learned.
    rm.shared.lock().apps.get_mut(&first_id).unwrap().report.user = "eve".into();
    let (end, waiting) = learned(&rm);
    assert_eq!(end.basis, EndBasis::Unknown, "{end:?}");
    assert_eq!(waiting.basis, EndBasis::Unknown);
    rm.shutdown().await;
}

/// Users declare limits well past their runs: a declared end is calibrated by what the
/// same user's ended runs used of their limits (issue 27, item 4), for a running container
/// and for a waiting job's run; another user's habit is not theirs, and too few runs say
/// nothing.
#[tokio::test]
async fn a_declared_end_is_calibrated_by_what_its_users_ended_runs_used() {
    use crate::rm::scheduler::reservation::MIN_CALIBRATION;
    use crate::rm::scheduler::reserved::EndBasis;
    let dir = tempfile::tempdir().unwrap();
    let rm = one_node(dir.path()).await;
    let (done_id, done) = app(&rm, "earlier").await;
    // One run granted through the API; its user's earlier ended runs are restored beside it:
    // each declared 1000 s and ran 250 s.
    let first = grant_all(&done, vec![ask(1, "n1", 0x1, Some(1000))]).await.allocated[0].clone();
    let ended = |k: usize| {
        let st = rm.shared.lock();
        let mut c = st.ledger.container(&first.container_id).unwrap().clone();
        let now = crate::protocol::now_ms();
        c.container.container_id = format!("{}_{}", done_id.replace("application", "container"), 900 + k);
        c.state = crate::protocol::ContainerState::Complete;
        c.exit_status = Some(0);
        (c.started_ms, c.ended_ms) = (now - 500_000, now - 250_000);
        c
    };
    let restore = |n: std::ops::Range<usize>| {
        for k in n {
            let c = ended(k);
            rm.shared
                .lock()
                .ledger
                .restore(c, Instant::now(), crate::protocol::now_ms());
        }
    };
    restore(0..MIN_CALIBRATION - 1);
    // The same user's next job runs with a limit of 1000 s; a third waits to run with one.
    let (_, next) = app(&rm, "next").await;
    let held = grant_all(&next, vec![ask(2, "n1", 0x2, Some(1000))]).await.allocated[0].clone();
    run(&next, "n1", &held).await;
    let (third_id, third) = app(&rm, "third").await;
    third
        .allocate(&AllocateRequest {
            waiting: Some(vec![WaitingTasks {
                max_run_sec: Some(1000),
                ..wait(1, 2)
            }]),
            ..Default::default()
        })
        .await
        .unwrap();
    let now = || {
        let (end, run) = learned(&rm, &held.container_id, Some(&third_id));
        (end, run.unwrap())
    };
    let from = rm
        .shared
        .lock()
        .ledger
        .container(&held.container_id)
        .unwrap()
        .run_from_ms();
    // Too few ended runs: the limit itself.
    let (end, run) = now();
    assert_eq!((end.basis, end.end_ms), (EndBasis::Declared, Some(from + 1_000_000)));
    assert_eq!((run.basis, run.ms), (EndBasis::Declared, Some(1_000_000)));
    // Enough: a quarter of it.
    restore(MIN_CALIBRATION - 1..MIN_CALIBRATION);
    let (end, run) = now();
    assert_eq!(
        (end.basis, end.end_ms),
        (EndBasis::Calibrated, Some(from + 250_000)),
        "{end:?}"
    );
    assert_eq!((run.basis, run.ms), (EndBasis::Calibrated, Some(250_000)));
    // The same answer again comes from the calibrations kept (nothing ended since).
    assert_eq!(now(), (end, run));
    // The estimate's draws: every ended run used a quarter, so each draw of the held
    // container's end is a quarter of its limit from its start, and each of the waiting
    // job's runs a quarter of its declared one.
    {
        let st = rm.shared.lock();
        let mut built = super::scheduling::snapshot(&st, Instant::now());
        let e = super::scheduling::learn(&st, &mut built, super::scheduling::Learn::Draws, None);
        let h = built
            .snap
            .held
            .iter()
            .position(|h| h.container_id == held.container_id)
            .unwrap();
        let a = built.snap.apps.iter().position(|a| a.id == third_id).unwrap();
        let ends = e.drawn_ends.get(&h).expect("the held container's end is drawn");
        assert!(ends.iter().all(|&t| t.abs_diff(from + 250_000) <= 1_000), "{ends:?}");
        assert_eq!(
            e.drawn_runs.get(&a),
            Some(&[250_000; crate::rm::scheduler::survival::DRAWS])
        );
        assert_eq!(e.runs[a].ms, Some(250_000));
        // The reservation's pass (`learn_ends`: no runs) draws nothing.
        let mut built = super::scheduling::snapshot(&st, Instant::now());
        let e = super::scheduling::learn(&st, &mut built, super::scheduling::Learn::Ends, None);
        assert!(e.drawn_ends.is_empty() && e.drawn_runs.is_empty() && e.runs.is_empty());
    }
    // The runs were another user's: nothing of them calibrates this user's (one more ended
    // run of theirs: what is kept is computed again).
    rm.shared.lock().apps.get_mut(&done_id).unwrap().report.user = "eve".into();
    restore(MIN_CALIBRATION..MIN_CALIBRATION + 1);
    let (end, run) = now();
    assert_eq!((end.basis, run.basis), (EndBasis::Declared, EndBasis::Declared));
    rm.shutdown().await;
}

/// The estimates come once a second, and on a cluster where one pass takes long, no more
/// than a twentieth of the time.
#[test]
fn estimates_are_spaced_by_what_they_cost() {
    use super::scheduling::estimates_due;
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    assert!(estimates_due(None, t0));
    let quick = Some((t0, Duration::from_millis(2)));
    assert!(!estimates_due(quick, at(999)));
    assert!(estimates_due(quick, at(1000)));
    let slow = Some((t0, Duration::from_millis(300)));
    assert!(!estimates_due(slow, at(5999)));
    assert!(estimates_due(slow, at(6000)));
}

/// Logs of running containers are read from their nodes a few at a time, a few per user
/// (each brings up to 8 MiB into the RM; twelfth pass: 250 at once took it to 2 GB): with
/// the caller's share taken, its read waits and is told to come back (429); once a turn is
/// free it reads the live log.
#[tokio::test]
async fn live_log_reads_are_a_few_at_a_time_and_a_few_per_user() {
    use super::logs::{LIVE_LOG_READS, LIVE_LOG_READS_PER_USER};
    let dir = tempfile::tempdir().unwrap();
    let rm = one_node(dir.path()).await;
    let (id, c) = app(&rm, "logs").await;
    let granted = grant_all(&c, vec![ask(0, "n1", 0, None)]).await;
    run_command(&c, "n1", &granted.allocated[0], "echo hello-live; sleep 60").await;
    let http = crate::tls::http_client();
    let url = format!("{}/ws/v1/cluster/apps/{id}/logs/w/0", rm.base_url());
    let get = || http.get(&url).bearer_auth(rm.admin_token()).send();
    let t0 = Instant::now();
    loop {
        let r: serde_json::Value = get().await.unwrap().json().await.unwrap();
        if r["text"].as_str().is_some_and(|t| t.contains("hello-live")) {
            assert_eq!(r["complete"], false, "read live: {r}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "no live log: {r}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let admin = crate::rm::users::ADMIN_USER;
    let mine: Vec<_> = (0..LIVE_LOG_READS_PER_USER)
        .map(|_| rm.shared.live_logs.try_acquire(admin).expect("a free turn"))
        .collect();
    let busy = get().await.unwrap();
    assert_eq!(busy.status(), axum::http::StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        busy.headers()
            .get(axum::http::header::RETRY_AFTER)
            .map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    // Others' reads are not behind this user's: their turns are still free.
    let others: Vec<_> = (0..LIVE_LOG_READS - LIVE_LOG_READS_PER_USER)
        .map(|i| {
            rm.shared
                .live_logs
                .try_acquire(&format!("user{}", i / LIVE_LOG_READS_PER_USER))
        })
        .collect();
    assert!(others.iter().all(Option::is_some), "the rest of the pool is others'");
    drop((mine, others));
    let r: serde_json::Value = get().await.unwrap().json().await.unwrap();
    assert!(r["text"].as_str().is_some_and(|t| t.contains("hello-live")), "{r}");
    rm.shutdown().await;
}
