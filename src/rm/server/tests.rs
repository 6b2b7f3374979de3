//! Unit tests of the RM server: AM supervision, restart recovery, ids.

use super::am_supervisor::{launch_am, stderr_tail};
use super::http::bearer;
use super::state::{StoreHealth, MAX_RESERVED_IDS, MAX_RESERVED_IDS_PER_USER};
use super::*;
use crate::protocol::{now_ms, AllocateRequest, AmCommand, AppState, ContainerState, LaunchContext};
use crate::resources::{PortSet, Resources};
use crate::rm::apps::{AmLaunch, Apps};
use axum::http::{header, HeaderMap, StatusCode};
use serde_json::Value;
use std::collections::BTreeMap;

async fn rm_with(am_program: Option<PathBuf>, dir: &Path) -> RmHandle {
    let node = Node::new("n1", "/r", Resources::with_mask(4, 1000, 0x3, PortSet::new()));
    let mut opts = RmOptions::new(vec![node], "127.0.0.1:0".parse().unwrap(), dir.to_path_buf());
    opts.am_program = am_program;
    start(opts).await.unwrap()
}

#[tokio::test]
async fn am_dying_without_finish_fails_the_app() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("fake-am.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\necho \"starting $1\"\necho 'boom: no GPUs today' >&2\nexit 3\n",
    )
    .unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let rm = rm_with(Some(script), &dir.path().join("work")).await;
    let (id, _token) = rm.register_test_app("fake");
    let app_dir = rm.shared.work_dir.join(&id);
    std::fs::create_dir_all(&app_dir).unwrap();
    set_launch(&rm, &id, &app_dir, None);
    launch_am(&rm.shared, &id).unwrap();
    let mut report = rm.app_report(&id).unwrap();
    for _ in 0..100 {
        if report.state.is_final() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        report = rm.app_report(&id).unwrap();
    }
    assert_eq!(report.state, AppState::Failed);
    assert_eq!(report.exit_code, Some(1));
    assert!(report.diagnostics.contains("exit code 3"), "{}", report.diagnostics);
    assert!(
        report.diagnostics.contains("boom: no GPUs today"),
        "{}",
        report.diagnostics
    );
    let out = std::fs::read_to_string(app_dir.join("am.stdout")).unwrap();
    assert!(out.contains("starting am"), "the AM got the `am` subcommand: {out}");
    assert!(rm.shared.am_procs.lock().is_empty());
    rm.shutdown().await;
}

fn set_launch(rm: &RmHandle, id: &str, app_dir: &Path, listen: Option<&str>) {
    rm.shared.lock().apps.get_mut(id).unwrap().launch = Some(AmLaunch {
        job_path: app_dir.join("job.yaml"),
        listen: listen.map(str::to_string),
    });
}

fn script(dir: &Path, body: &str) -> PathBuf {
    let p = dir.join("fake-am.sh");
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    p
}

#[tokio::test]
async fn am_exit_after_finish_is_expected() {
    let dir = tempfile::tempdir().unwrap();
    let rm = rm_with(Some(script(dir.path(), "exit 0")), &dir.path().join("work")).await;
    let (id, _token) = rm.register_test_app("x");
    let app_dir = rm.shared.work_dir.join(&id);
    std::fs::create_dir_all(&app_dir).unwrap();
    rm.shared.lock().apps.get_mut(&id).unwrap().unregistered = true;
    set_launch(&rm, &id, &app_dir, Some("127.0.0.1:0"));
    launch_am(&rm.shared, &id).unwrap();
    for _ in 0..100 {
        if rm.shared.am_procs.lock().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(rm.shared.am_procs.lock().is_empty(), "the watcher saw the exit");
    assert_eq!(rm.app_report(&id).unwrap().state, AppState::Accepted, "not failed");
    rm.shutdown().await;
}

/// An RM under `dir` whose AM writes its pid to `am.pid` in its application's directory
/// and sleeps, launched for a test application (its process record failing to be stored
/// when `unrecordable`): the RM, the application and its directory.
async fn launch_pid_writing_am(dir: &Path, unrecordable: bool) -> (RmHandle, String, PathBuf) {
    let rm = rm_with(Some(script(dir, "echo $$ > am.pid; exec sleep 30")), &dir.join("work")).await;
    let (id, _token) = rm.register_test_app("x");
    if unrecordable {
        super::transactions::UNRECORDABLE_AMS.lock().push(id.clone());
    }
    let app_dir = rm.shared.work_dir.join(&id);
    std::fs::create_dir_all(&app_dir).unwrap();
    set_launch(&rm, &id, &app_dir, None);
    launch_am(&rm.shared, &id).unwrap();
    (rm, id, app_dir)
}

/// The AM's process is held until the attempt's record names it, and the record names
/// the AM itself (the hold's step runs it in place, same pid): a restarted RM finds it.
#[tokio::test]
async fn the_attempt_records_the_am_before_the_am_runs() {
    let dir = tempfile::tempdir().unwrap();
    let (rm, id, app_dir) = launch_pid_writing_am(dir.path(), false).await;
    let recorded = rm.shared.lock().apps.get(&id).unwrap().attempts.last().unwrap().process;
    let recorded = recorded.expect("the attempt names its process once launch_am returns");
    let mut ran = None;
    for _ in 0..200 {
        ran = std::fs::read_to_string(app_dir.join("am.pid"))
            .ok()
            .filter(|s| s.ends_with('\n'));
        if ran.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ran: u32 = ran.expect("the released AM ran").trim().parse().unwrap();
    assert_eq!(ran, recorded.pid, "the recorded process is the AM's own");
    rm.shutdown().await;
}

/// An AM whose attempt cannot record its process never runs a command (a restarted RM
/// could not find it): it exits 154 and the attempt ends, saying so. Without the hold the
/// script would run.
#[tokio::test]
async fn an_am_whose_process_cannot_be_recorded_never_runs() {
    let dir = tempfile::tempdir().unwrap();
    let (rm, id, app_dir) = launch_pid_writing_am(dir.path(), true).await;
    let mut ended = None;
    for _ in 0..500 {
        ended = rm
            .shared
            .lock()
            .apps
            .get(&id)
            .unwrap()
            .attempts
            .first()
            .cloned()
            .filter(|a| a.finished_time != 0);
        if ended.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ended = ended.expect("the held AM's attempt ended");
    assert!(ended.diagnostics.contains("154"), "{}", ended.diagnostics);
    assert!(!app_dir.join("am.pid").exists(), "the unrecorded AM ran its script");
    rm.shutdown().await;
}

/// The admin token an RM wrote stays across its restarts (a saved copy keeps working);
/// removing the file makes a new one; a file others can read is refused, not trusted.
#[tokio::test]
async fn the_admin_token_stays_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    let node = Node::new("n1", "/r", Resources::with_mask(4, 1000, 0x3, PortSet::new()));
    let opts = RmOptions::new(vec![node], "127.0.0.1:0".parse().unwrap(), work.clone());
    let any = opts.listen;
    let first = restart_on(any, &opts).await;
    let token = first.admin_token().to_string();
    let file = first.admin_token_file().unwrap().to_path_buf();
    crash(first);
    let again = restart_on(any, &opts).await;
    assert_eq!(again.admin_token(), token, "the same token after a restart");
    crash(again);
    std::fs::remove_file(&file).unwrap();
    let fresh = restart_on(any, &opts).await;
    assert_ne!(fresh.admin_token(), token, "a new token once the file is removed");
    crash(fresh);
    std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let mut refused = None;
    for _ in 0..50 {
        match start(opts.clone()).await {
            Err(e) if e.to_string().contains("locked") => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => {
                refused = Some(e.to_string());
                break;
            }
            Ok(_) => panic!("a token file others can read was trusted"),
        }
    }
    let err = refused.expect("refused");
    assert!(
        err.contains("readable by it alone") && err.contains("remove it"),
        "{err}"
    );
}

/// Without a credential, a request for an application that exists and one for an id that
/// does not get the same answer (401), so ids cannot be probed; with the right token the
/// existing one is served.
#[tokio::test]
async fn without_a_token_an_unknown_application_answers_as_a_known_one() {
    let dir = tempfile::tempdir().unwrap();
    let rm = rm_with(None, &dir.path().join("work")).await;
    let (known, token) = rm.register_test_app("x");
    // Well formed, never handed out.
    let unknown = known.replace("_0001", "_0999");
    let http = crate::tls::http_client();
    let base = rm.base_url();
    let answer = |r: reqwest::Response| async move { (r.status().as_u16(), r.text().await.unwrap()) };
    let register = |id: &str, bearer: Option<&str>| {
        let mut req = http
            .post(format!("{base}/ws/v1/am/{id}/register"))
            .json(&serde_json::json!({"host": "h", "trackingUrl": ""}));
        if let Some(t) = bearer {
            req = req.bearer_auth(t);
        }
        req.send()
    };
    let kill = |id: &str| {
        http.put(format!("{base}/ws/v1/cluster/apps/{id}/state"))
            .json(&serde_json::json!({"state": "KILLED"}))
            .send()
    };
    let (a, b) = (
        answer(register(&known, None).await.unwrap()).await,
        answer(register(&unknown, None).await.unwrap()).await,
    );
    assert_eq!(a.0, 401, "{a:?}");
    assert_eq!(a, b, "register: the same answer for a known and an unknown id");
    let (a, b) = (
        answer(kill(&known).await.unwrap()).await,
        answer(kill(&unknown).await.unwrap()).await,
    );
    assert_eq!(a.0, 401, "{a:?}");
    assert_eq!(a.0, b.0, "kill: the same status for a known and an unknown id");
    assert_eq!(
        a.1.replace(&known, "ID"),
        b.1.replace(&unknown, "ID"),
        "kill: the same words for a known and an unknown id"
    );
    let served = register(&known, Some(&token)).await.unwrap();
    assert_eq!(served.status().as_u16(), 200, "{}", served.text().await.unwrap());
    // The container routes the same way: a container that exists, one that does not and
    // one asked for on another host all answer a wrong token alike.
    let am = crate::am::rm_client::RmClient::for_app(&base, &known, &token);
    let granted = granted(&am, vec![ask(1, "n1", 0x1)]).await;
    let real = granted[0].container_id.clone();
    let none = format!("{}99", &real[..real.len() - 2]);
    let container = |host: &str, id: &str, verb: &str, bearer: &str| {
        let url = format!("{base}/ws/v1/node/{host}/containers/{id}/{verb}");
        let req = if verb == "stop" {
            http.post(url).json(&serde_json::json!({}))
        } else {
            http.get(url)
        };
        req.bearer_auth(bearer).send()
    };
    for verb in ["status", "logs", "stop"] {
        let mut seen = Vec::new();
        for (host, id) in [("n1", real.as_str()), ("n1", none.as_str()), ("n2", real.as_str())] {
            let (code, body) = answer(container(host, id, verb, "not-a-token").await.unwrap()).await;
            seen.push((code, body.replace(id, "ID").replace(host, "HOST")));
        }
        assert_eq!(seen[0].0, 401, "{verb}: {seen:?}");
        assert!(seen.iter().all(|s| *s == seen[0]), "{verb}: {seen:?}");
    }
    let (code, body) = answer(container("n1", &real, "status", &token).await.unwrap()).await;
    assert_eq!(code, 200, "{body}");
    rm.shutdown().await;
}

#[tokio::test]
async fn shutdown_kills_the_am() {
    let dir = tempfile::tempdir().unwrap();
    let rm = rm_with(Some(script(dir.path(), "exec sleep 30")), &dir.path().join("work")).await;
    let (id, _token) = rm.register_test_app("x");
    let app_dir = rm.shared.work_dir.join(&id);
    std::fs::create_dir_all(&app_dir).unwrap();
    set_launch(&rm, &id, &app_dir, None);
    launch_am(&rm.shared, &id).unwrap();
    assert_eq!(rm.shared.am_procs.lock().len(), 1);
    let shared = rm.shared.clone();
    let t0 = Instant::now();
    rm.shutdown().await;
    assert!(t0.elapsed() < Duration::from_secs(4), "killed, not waited for");
    assert!(shared.am_procs.lock().is_empty());
    assert_eq!(
        shared.lock().apps.get(&id).unwrap().report.state,
        AppState::Failed,
        "an AM killed before finishing fails its app"
    );
    // Its diagnostics say the RM stopped it, not that it died on its own.
    let diag = shared.lock().apps.get(&id).unwrap().report.diagnostics.clone();
    assert!(
        diag.starts_with("the RM shut down and stopped the AM process"),
        "{diag}"
    );
}

#[test]
fn bearer_parsing() {
    let mut h = HeaderMap::new();
    assert_eq!(bearer(&h), None);
    h.insert(header::AUTHORIZATION, "Bearer abc".parse().unwrap());
    assert_eq!(bearer(&h), Some("abc"));
    h.insert(header::AUTHORIZATION, "bearer  abc ".parse().unwrap());
    assert_eq!(bearer(&h), Some("abc"));
    h.insert(header::AUTHORIZATION, "Basic abc".parse().unwrap());
    assert_eq!(bearer(&h), None);
}

/// Starts an RM with `opts` on `addr` again (the port a stopped one held may take a moment
/// to be free); panics after 5 s.
pub(super) async fn restart_on(addr: std::net::SocketAddr, opts: &RmOptions) -> RmHandle {
    for _ in 0..50 {
        match start(RmOptions {
            listen: addr,
            ..opts.clone()
        })
        .await
        {
            Ok(r) => return r,
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    panic!("the RM did not start again on {addr}");
}

/// Stops an RM the way SIGKILL would, as far as the state goes: no container or AM
/// is stopped, nothing more is written.
fn crash(rm: RmHandle) {
    rm.server.abort();
    for b in &rm.background {
        b.abort();
    }
}

fn ask(request_id: u64, host: &str, mask: u64) -> crate::protocol::Ask {
    crate::protocol::Ask {
        request_id,
        host: host.into(),
        cpu: 1,
        memory_mb: 10,
        gpu_mask: mask,
        task: Some(format!("w/{request_id}")),
        task_attempt: 1,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_restarted_rm_recovers_apps_grants_and_node_states() {
    use crate::am::rm_client::RmClient;
    use crate::protocol::{Ask, RegisterRequest};
    let dir = tempfile::tempdir().unwrap();
    let nodes: Vec<Node> = ["n1", "n2"]
        .iter()
        .map(|h| Node::new(*h, "/r", Resources::with_mask(4, 1000, 0x3, PortSet::new())))
        .collect();
    let opts = RmOptions {
        launch_am: false,
        ..RmOptions::new(nodes, "127.0.0.1:0".parse().unwrap(), dir.path().join("work"))
    };
    let rm = start(opts.clone()).await.unwrap();
    let (id, token) = rm.register_test_app("job");
    let am = RmClient::for_app(&rm.base_url(), &id, &token);
    am.register(&RegisterRequest::default()).await.unwrap();
    let asks: Vec<Ask> = vec![ask(1, "n1", 0x1), ask(2, "n1", 0x2)];
    let granted = am
        .allocate(&AllocateRequest {
            asks,
            ..Default::default()
        })
        .await
        .unwrap()
        .allocated;
    assert_eq!(granted.len(), 2);
    let running = &granted[0];
    let status = am
        .start_container(
            &running.node_http_address,
            "n1",
            &running.container_id,
            &LaunchContext {
                commands: vec!["sleep 30".into()],
                env: Default::default(),
            },
        )
        .await
        .unwrap();
    let pgid = status.pid.unwrap() as i32;
    assert!(rm.set_node_state("n2", NodeState::Lost).await);
    let reserved = RmClient::new(&rm.base_url())
        .with_user_token(Some(rm.admin_token().to_string()))
        .new_application()
        .await
        .unwrap()
        .application_id;
    let addr = rm.addr();
    crash(rm);

    // The task's process group outlives the RM.
    assert_eq!(unsafe { libc::kill(-pgid, 0) }, 0, "the container still runs");
    let rm2 = restart_on(addr, &opts).await;
    let report = rm2.app_report(&id).expect("the application is recovered");
    assert_eq!(report.state, AppState::Running);
    // Its predecessor's preemption notices are unknown to it: no new victims for a grace (30 s).
    assert!(!rm2.shared.lock().sched.may_choose_victims(Instant::now()));
    // The old heartbeat memory is gone: the AM is told to register again.
    let again = am
        .allocate(&AllocateRequest {
            response_id: 1,
            asks: vec![ask(3, "n1", 0x1)],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(again.command, Some(AmCommand::Resync));
    assert!(
        again.allocated.is_empty() && again.rejected.is_empty(),
        "nothing acted on"
    );
    let reg = am.register(&RegisterRequest::default()).await.unwrap();
    let mut held: Vec<(String, ContainerState)> = reg
        .containers_from_previous_attempts
        .iter()
        .map(|p| (p.container.container_id.clone(), p.state))
        .collect();
    held.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        held,
        vec![
            (granted[0].container_id.clone(), ContainerState::Running),
            (granted[1].container_id.clone(), ContainerState::Allocated)
        ]
    );
    // The grants still hold their GPUs; the lost node stays lost.
    let snap = rm2.nodes_snapshot();
    let n1 = snap.iter().find(|(n, _)| n.host == "n1").unwrap();
    assert_eq!((n1.0.used().gpu_mask, n1.1), (0x3, 2));
    let n2 = snap.iter().find(|(n, _)| n.host == "n2").unwrap();
    assert_eq!(n2.0.state, NodeState::Lost);
    let after = am
        .allocate(&AllocateRequest {
            response_id: 0,
            asks: vec![ask(4, "n1", 0x1)],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(after.rejected.len(), 1, "GPU 0 of n1 is still granted: {after:?}");
    // Ids go on from where they were; the reserved one can still be submitted.
    assert!(rm2.shared.lock().is_reserved(&reserved));
    let next = RmClient::new(&rm2.base_url())
        .with_user_token(Some(rm2.admin_token().to_string()))
        .new_application()
        .await
        .unwrap()
        .application_id;
    assert!(next > reserved, "{next} after {reserved}");
    // The re-attached container can be stopped like any other.
    let released = am
        .allocate(&AllocateRequest {
            response_id: after.response_id,
            releases: vec![granted[0].container_id.clone(), granted[1].container_id.clone()],
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(released.rejected.is_empty());
    let mut gone = false;
    for _ in 0..100 {
        if unsafe { libc::kill(-pgid, 0) } != 0 {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "the released container's group was stopped");
    // Freed only when dead: the node's report of its death frees it.
    let mut free = false;
    for _ in 0..100 {
        if rm2.ledger_all_free() {
            free = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(free, "the released container's resources return once it is dead");
    rm2.shutdown().await;
}

#[tokio::test]
async fn an_in_memory_rm_keeps_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::new("n1", "/r", Resources::with_mask(4, 1000, 0x3, PortSet::new()));
    let opts = RmOptions {
        launch_am: false,
        state_dir: None,
        ..RmOptions::new(vec![node], "127.0.0.1:0".parse().unwrap(), dir.path().join("work"))
    };
    let rm = start(opts.clone()).await.unwrap();
    rm.register_test_app("job");
    rm.shutdown().await;
    assert!(!dir.path().join("work").join(crate::rm::store::STATE_FILE).exists());
    let rm = start(opts).await.unwrap();
    assert!(rm.shared.lock().apps.is_empty());
    rm.shutdown().await;
}

#[test]
fn reserved_ids_are_forgotten_oldest_first() {
    let mut st = RmState {
        ledger: Ledger::new(Vec::<Node>::new(), DEFAULT_CONTAINER_EXPIRY),
        apps: Apps::default(),
        reserved: Default::default(),
        // Across 9999 → 10000, where the ids' text order is not their age.
        next_app_seq: 9_990,
        meta_dirty: false,
        store: Store::memory(),
        store_health: StoreHealth::default(),
        sched: scheduling::SchedState::new(Default::default(), Duration::from_secs(30)),
        agent_nodes: BTreeMap::new(),
        agent_nodes_dirty: Default::default(),
        removed_hosts: BTreeMap::new(),
    };
    // Many users, each within their own bound: the bound for all of them applies.
    let ids: Vec<String> = (0..MAX_RESERVED_IDS + 20)
        .map(|i| {
            let id = st.next_app_id(1).unwrap();
            st.reserve(id.clone(), &format!("user{}", i % 20));
            id
        })
        .collect();
    assert_eq!(st.reserved.len(), MAX_RESERVED_IDS);
    assert!(!st.is_reserved(&ids[19]), "the 20 oldest went");
    assert!(st.is_reserved(&ids[20]) && st.is_reserved(&ids[ids.len() - 1]));
    assert!(st.unreserve(&ids[20]));
    assert!(!st.unreserve(&ids[20]), "claimed once");
    assert!(!st.unreserve("application_1_99999999"));
    // One user's loop forgets that user's oldest, never another user's.
    let theirs: Vec<String> = (0..3)
        .map(|_| {
            let id = st.next_app_id(1).unwrap();
            st.reserve(id.clone(), "alice");
            id
        })
        .collect();
    let bobs: Vec<String> = (0..MAX_RESERVED_IDS_PER_USER + 50)
        .map(|_| {
            let id = st.next_app_id(1).unwrap();
            st.reserve(id.clone(), "bob");
            id
        })
        .collect();
    assert!(theirs.iter().all(|id| st.is_reserved(id)), "alice's ids stay");
    assert!(
        !st.is_reserved(&bobs[49]) && st.is_reserved(&bobs[50]),
        "bob's 50 oldest went"
    );
    assert_eq!(st.reserved.held_by("bob"), MAX_RESERVED_IDS_PER_USER);
    assert_eq!(st.reserved.held_by("alice"), 3);
    // The bounds hold together: the user index and the ids agree after all of it.
    assert_eq!(st.reserved.len(), MAX_RESERVED_IDS);
    assert_eq!(st.reserved.ids().len(), st.reserved.owners().len());
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config { cases: 24, ..Default::default() })]
    /// The indexed `ReservedIds` keeps exactly what the plain rule keeps (the user's oldest
    /// beyond their bound go first, then the oldest of all), whatever the order of
    /// reservations, re-reservations and claims.
    #[test]
    fn reserved_ids_keep_what_the_plain_rule_keeps(
        ops in proptest::collection::vec((0u8..2, 0u32..3_000, proptest::bool::weighted(0.1)), 1..3_000)
    ) {
        let mut fast = super::state::ReservedIds::default();
        // The plain rule: one pass over everything per call.
        let mut plain: Vec<(u32, String, String)> = Vec::new();
        for (i, (user, seq, claim)) in ops.into_iter().enumerate() {
            let seq = if claim { seq } else { u32::try_from(i).unwrap() + 1 };
            let id = crate::rm::apps::app_id(1, seq);
            let user = format!("u{user}");
            if claim {
                let had = plain.iter().any(|(_, i, _)| *i == id);
                plain.retain(|(_, i, _)| *i != id);
                proptest::prop_assert_eq!(fast.take(&id), had);
                continue;
            }
            fast.insert(id.clone(), &user);
            plain.retain(|(_, i, _)| *i != id);
            plain.push((seq, id, user.clone()));
            plain.sort();
            if plain.iter().filter(|(_, _, u)| *u == user).count() > MAX_RESERVED_IDS_PER_USER {
                let k = plain.iter().position(|(_, _, u)| *u == user).unwrap();
                plain.remove(k);
            }
            while plain.len() > MAX_RESERVED_IDS {
                plain.remove(0);
            }
        }
        let want: Vec<String> = plain.iter().map(|(_, i, _)| i.clone()).collect();
        proptest::prop_assert_eq!(fast.ids(), want);
        for (_, id, user) in &plain {
            proptest::prop_assert_eq!(fast.owner(id), Some(user.as_str()));
        }
        for u in ["u0", "u1"] {
            let n = plain.iter().filter(|(_, _, x)| x == u).count();
            proptest::prop_assert_eq!(fast.held_by(u), n);
        }
    }
}

#[test]
fn the_application_sequence_is_refused_at_its_end_not_wrapped() {
    let mut st = RmState {
        ledger: Ledger::new(Vec::<Node>::new(), DEFAULT_CONTAINER_EXPIRY),
        apps: Apps::default(),
        reserved: Default::default(),
        next_app_seq: u32::MAX - 1,
        meta_dirty: false,
        store: Store::memory(),
        store_health: StoreHealth::default(),
        sched: scheduling::SchedState::new(Default::default(), Duration::from_secs(30)),
        agent_nodes: BTreeMap::new(),
        agent_nodes_dirty: Default::default(),
        removed_hosts: BTreeMap::new(),
    };
    assert_eq!(st.next_app_id(7).unwrap(), format!("application_7_{}", u32::MAX));
    let e = st.next_app_id(7).unwrap_err();
    assert_eq!(
        (e.status, e.code),
        (StatusCode::SERVICE_UNAVAILABLE, "ID_SEQUENCE_EXHAUSTED")
    );
    assert_eq!(st.next_app_seq, u32::MAX, "not wrapped to 0");
}

#[test]
fn stderr_tail_keeps_last_lines() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("e");
    let text: String = (0..50).map(|i| format!("line {i}\n")).collect();
    std::fs::write(&p, format!("{text}\u{1b}[31mred\u{1b}[0m\n")).unwrap();
    let t = stderr_tail(&p, 3);
    assert_eq!(t, "line 48\nline 49\nred", "the last lines, without colour codes");
    assert_eq!(stderr_tail(&dir.path().join("missing"), 3), "");
}

/// A restarted RM chooses no new preemption victims for one grace (its predecessor's
/// notices are not kept, and what their AMs give back in answer is seen first); a fresh one
/// chooses at once.
#[test]
fn a_restarted_rm_waits_one_grace_before_choosing_victims() {
    let grace = Duration::from_secs(30);
    let mut s = scheduling::SchedState::new(Default::default(), grace);
    let t0 = Instant::now();
    assert!(s.may_choose_victims(t0), "a fresh RM");
    s.quiet_after_restart(t0);
    assert!(!s.may_choose_victims(t0));
    assert!(!s.may_choose_victims(t0 + grace - Duration::from_millis(1)));
    assert!(s.may_choose_victims(t0 + grace));
    // The recovery of a saved state is a restart; a fresh state is not.
    let fresh = super::state::recover_state(
        Store::memory(),
        Ledger::new(Vec::<Node>::new(), DEFAULT_CONTAINER_EXPIRY),
        scheduling::SchedState::new(Default::default(), grace),
        "http://127.0.0.1:1",
    )
    .unwrap()
    .0;
    assert!(fresh.sched.may_choose_victims(Instant::now()));
}

/// An RM with queues `a` and `b` (weights 1:1) on one node of 2 GPUs, a 600 ms notice,
/// and two test applications registered in them.
async fn rm_with_queues(dir: &Path) -> (RmHandle, [(String, String); 2]) {
    let node = Node::new("n1", "/r", Resources::with_mask(4, 1000, 0x3, PortSet::new()));
    let queues: BTreeMap<String, crate::config::QueueSettings> =
        serde_json::from_str(r#"{"a": {"weight": 1}, "b": {"weight": 1}}"#).unwrap();
    let opts = RmOptions {
        launch_am: false,
        queues: crate::rm::scheduler::queues::QueueTree::from_settings(&queues).unwrap(),
        preemption_grace: Duration::from_millis(600),
        ..RmOptions::new(vec![node], "127.0.0.1:0".parse().unwrap(), dir.to_path_buf())
    };
    let rm = start(opts).await.unwrap();
    let apps = ["a", "b"].map(|q| {
        let (id, token) = rm.register_test_app(q);
        rm.shared.lock().apps.get_mut(&id).unwrap().report.queue = q.to_string();
        (id, token)
    });
    (rm, apps)
}

#[tokio::test]
async fn an_am_that_ignores_the_notice_loses_the_container_at_the_deadline() {
    use crate::am::rm_client::RmClient;
    use crate::protocol::{RegisterRequest, WaitingTasks};
    let dir = tempfile::tempdir().unwrap();
    let (rm, [(a_id, a_tok), (b_id, b_tok)]) = rm_with_queues(&dir.path().join("work")).await;
    let a = RmClient::for_app(&rm.base_url(), &a_id, &a_tok);
    let b = RmClient::for_app(&rm.base_url(), &b_id, &b_tok);
    a.register(&RegisterRequest::default()).await.unwrap();
    b.register(&RegisterRequest::default()).await.unwrap();
    // B takes both GPUs and runs on them.
    let mut b_resp = b
        .allocate(&AllocateRequest {
            asks: vec![ask(1, "n1", 0x1), ask(2, "n1", 0x2)],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(b_resp.allocated.len(), 2);
    for c in &b_resp.allocated {
        b.start_container(
            &c.node_http_address,
            "n1",
            &c.container_id,
            &LaunchContext {
                commands: vec!["sleep 30".into()],
                env: Default::default(),
            },
        )
        .await
        .unwrap();
    }
    // A waits for one GPU.
    let waiting = WaitingTasks {
        role: "w".into(),
        count: 1,
        gpus: 1,
        cpu: 1,
        memory_mb: 10,
        ..Default::default()
    };
    let mut a_resp = a
        .allocate(&AllocateRequest {
            waiting: Some(vec![waiting.clone()]),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(!a_resp.others_waiting, "A's own waiting tasks do not count for A");
    // B hears of the preemption (and ignores it, like an AM that predates it).
    let t0 = Instant::now();
    let notice = loop {
        b_resp = b
            .allocate(&AllocateRequest {
                response_id: b_resp.response_id,
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(b_resp.others_waiting, "A waits: B's placement is told others wait");
        if let Some(n) = b_resp.preempt.first() {
            break n.clone();
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "no preemption notice");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        b_resp.preempt.len(),
        1,
        "one GPU for A, one stays B's: {:?}",
        b_resp.preempt
    );
    assert!(notice.reason.contains("queue `a`"), "{}", notice.reason);
    assert!(notice.deadline_ms > now_ms() && notice.deadline_ms <= now_ms() + 700);
    let record = rm
        .shared
        .nodes
        .local
        .executor()
        .container_dir(&notice.container_id)
        .unwrap();
    let file = crate::node::executor::work_dir(&record).join(crate::node::executor::PREEMPT_FILE);
    assert!(file.exists(), "the task's GPUAM_PREEMPT_FILE was created");
    // Why A waits, as the cluster page and its AM see it.
    a_resp = a
        .allocate(&AllocateRequest {
            response_id: a_resp.response_id,
            waiting: Some(vec![waiting.clone()]),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(
        a_resp
            .waiting_reason
            .as_deref()
            .is_some_and(|w| w.contains("taken back")),
        "{:?}",
        a_resp.waiting_reason
    );
    // The deadline passes: the RM stops it; B hears it ended as preempted (-102).
    let completed = loop {
        b_resp = b
            .allocate(&AllocateRequest {
                response_id: b_resp.response_id,
                ..Default::default()
            })
            .await
            .unwrap();
        if let Some(c) = b_resp.completed.first() {
            break c.clone();
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "the RM never stopped it");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(completed.container_id, notice.container_id);
    assert_eq!(completed.exit_status, exit_status::PREEMPTED);
    assert!(now_ms() + 100 >= notice.deadline_ms, "not before the deadline");
    // Freed only when dead; then A's ask is granted and B's is not.
    let t1 = Instant::now();
    let free_bit = loop {
        let used = rm.nodes_snapshot()[0].0.used().gpu_mask;
        if used.count_ones() == 1 {
            break 0x3 & !used;
        }
        assert!(t1.elapsed() < Duration::from_secs(10), "never freed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    b_resp = b
        .allocate(&AllocateRequest {
            response_id: b_resp.response_id,
            asks: vec![ask(3, "n1", free_bit)],
            waiting: Some(vec![waiting.clone()]),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(
        b_resp
            .rejected
            .first()
            .is_some_and(|r| r.retryable && r.reason.contains("ranks ahead")),
        "{:?}",
        b_resp.rejected
    );
    a_resp = a
        .allocate(&AllocateRequest {
            response_id: a_resp.response_id,
            asks: vec![ask(4, "n1", free_bit)],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(a_resp.allocated.len(), 1, "{:?}", a_resp.rejected);

    // The cluster page's JSON and /metrics.
    let http = crate::tls::http_client();
    let ov = admins_overview(&rm).await;
    let qb = ov["queues"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["name"] == "b")
        .unwrap();
    assert_eq!(qb["preempted"], 1, "{qb}");
    assert_eq!(qb["usedGpus"], 1, "{qb}");
    let gpus = ov["nodes"][0]["gpus"].as_array().unwrap();
    assert!(
        gpus.iter().any(|g| g["app"] == a_id.as_str() && g["queue"] == "a"),
        "{gpus:?}"
    );
    let metrics = http
        .get(format!("{}/metrics", rm.base_url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "gpuam_rm_preemptions_total{queue=\"b\"} 1",
        "gpuam_rm_queue_used_gpus{queue=\"a\",gpu_type=\"\"} 1.0",
        "gpuam_rm_queue_deserved_gpus{queue=\"a\",gpu_type=\"\"} 1.0",
        "gpuam_rm_grants_total 3",
        "gpuam_rm_rejections_total{reason=\"queue\"} 1",
    ] {
        assert!(metrics.contains(line), "missing `{line}` in\n{metrics}");
    }
    assert!(metrics.contains("gpuam_rm_allocate_latency_seconds_count"), "{metrics}");
    rm.shutdown().await;
}

/// The node listing's versions (issue 29): a whole listing carries `nodesVersion`; asking
/// `since` it answers only the nodes changed since (none, then exactly the one a grant
/// changed, with its new use), and a version another RM process gave gets the whole
/// listing again, marked as such.
#[tokio::test]
async fn an_am_refreshes_its_node_view_by_changes_only() {
    use crate::am::rm_client::RmClient;
    use crate::protocol::RegisterRequest;
    let dir = tempfile::tempdir().unwrap();
    let nodes: Vec<Node> = ["n1", "n2", "n3"]
        .iter()
        .map(|h| Node::new(*h, "/r", Resources::with_mask(4, 1000, 0x3, PortSet::new())))
        .collect();
    let opts = RmOptions {
        launch_am: false,
        state_dir: None,
        ..RmOptions::new(nodes, "127.0.0.1:0".parse().unwrap(), dir.path().join("work"))
    };
    let rm = start(opts.clone()).await.unwrap();
    let (id, token) = rm.register_test_app("job");
    let am = RmClient::for_app(&rm.base_url(), &id, &token);
    let whole = am.node_changes().await.unwrap();
    assert_eq!(whole.nodes.len(), 3);
    assert!(whole.changed_since.is_none() && whole.version.is_some(), "{whole:?}");
    let unchanged = am.node_changes().await.unwrap();
    assert!(unchanged.nodes.is_empty(), "nothing changed: {unchanged:?}");
    assert_eq!(unchanged.changed_since, whole.version);
    assert_eq!(unchanged.version, whole.version);
    am.register(&RegisterRequest::default()).await.unwrap();
    let granted = granted(&am, vec![ask(1, "n2", 0x2)]).await;
    assert_eq!(granted.len(), 1);
    let changed = am.node_changes().await.unwrap();
    let hosts: Vec<(&str, u64)> = changed
        .nodes
        .iter()
        .map(|n| (n.host.as_str(), n.used().gpu_mask))
        .collect();
    assert_eq!(hosts, vec![("n2", 0x2)]);
    assert_eq!(changed.changed_since, unchanged.version);
    assert_ne!(changed.version, unchanged.version);
    // The same answer for a plain client asking with that version by hand.
    let http = crate::tls::http_client();
    let v: Value = http
        .get(format!(
            "{}/ws/v1/cluster/nodes?since={}",
            rm.base_url(),
            unchanged.version.clone().unwrap()
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["nodes"]["node"].as_array().map(Vec::len), Some(1), "{v}");
    // `since` and `states` together are refused; a version of another RM process (or
    // garbage) gets the whole listing.
    let r = http
        .get(format!(
            "{}/ws/v1/cluster/nodes?since=1-1&states=RUNNING",
            rm.base_url()
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let other = start(opts).await.unwrap();
    let am2 = RmClient::for_app(&other.base_url(), &id, &token);
    for since in [
        changed.version.clone().unwrap(),
        "garbage".to_string(),
        "0-99999".to_string(),
    ] {
        let v: Value = http
            .get(format!("{}/ws/v1/cluster/nodes?since={since}", other.base_url()))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v["nodes"]["node"].as_array().map(Vec::len), Some(3), "{since}: {v}");
        assert!(v.get("changedSince").is_none(), "{since}: {v}");
    }
    assert_eq!(am2.node_changes().await.unwrap().nodes.len(), 3);
    other.shutdown().await;
    rm.shutdown().await;
}

/// An idle AM's held heartbeat (issue 29) is answered as soon as something for its
/// application happens, a container of it ending or the application killed, not when the
/// hold ends (ten minutes here, far past the test's patience); a call that asks for
/// something is never held.
#[tokio::test]
async fn a_held_heartbeat_is_answered_when_a_container_of_the_job_ends_or_it_is_killed() {
    use crate::am::rm_client::RmClient;
    use crate::protocol::RegisterRequest;
    let dir = tempfile::tempdir().unwrap();
    let node = Node::new("n1", "/r", Resources::with_mask(4, 1000, 0x3, PortSet::new()));
    let mut opts = RmOptions {
        launch_am: false,
        ..RmOptions::new(vec![node], "127.0.0.1:0".parse().unwrap(), dir.path().join("work"))
    };
    opts.limits.max_allocate_hold = Duration::from_secs(600);
    let rm = start(opts).await.unwrap();
    let (id, tok) = rm.register_test_app("held");
    let am = RmClient::for_app(&rm.base_url(), &id, &tok);
    am.register(&RegisterRequest::default()).await.unwrap();
    let patience = Duration::from_secs(60);
    let held = |response_id: u64| AllocateRequest {
        response_id,
        hold_ms: Some(600_000),
        ..Default::default()
    };
    // Asking is not held, whatever the AM says.
    let asked = AllocateRequest {
        asks: vec![ask(1, "n1", 0x1)],
        ..held(0)
    };
    let resp = tokio::time::timeout(patience, am.allocate(&asked))
        .await
        .expect("an allocate call that asks was held")
        .unwrap();
    assert_eq!(resp.allocated.len(), 1);
    let c = resp.allocated[0].clone();
    // The held call is answered when the container ends (a task that exits by itself).
    let call = tokio::spawn({
        let am = am.clone();
        let req = held(resp.response_id);
        async move { am.allocate(&req).await }
    });
    let ctx = LaunchContext {
        commands: vec!["sleep 1".into()],
        env: Default::default(),
    };
    am.start_container(&c.node_http_address, "n1", &c.container_id, &ctx)
        .await
        .unwrap();
    let resp = tokio::time::timeout(patience, call)
        .await
        .expect("the held call was not answered when its container ended")
        .unwrap()
        .unwrap();
    assert_eq!(resp.completed.len(), 1, "{resp:?}");
    assert_eq!(resp.completed[0].container_id, c.container_id);
    // Killed while held: answered with the shutdown.
    let call = tokio::spawn({
        let am = am.clone();
        let req = held(resp.response_id);
        async move { am.allocate(&req).await }
    });
    let admin = RmClient::new(&rm.base_url());
    admin.kill(&id, rm.admin_token()).await.unwrap();
    let resp = tokio::time::timeout(patience, call)
        .await
        .expect("the held call was not answered when its application was killed")
        .unwrap()
        .unwrap();
    assert_eq!(resp.command, Some(AmCommand::Shutdown));
}

/// The JSON of `GET <path>` as the admin sees it.
pub(super) async fn admin_get(rm: &RmHandle, path: &str) -> Value {
    crate::tls::http_client()
        .get(format!("{}{path}", rm.base_url()))
        .bearer_auth(rm.admin_token())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The cluster page's JSON (`/ws/v1/cluster/overview`) as the admin sees it.
async fn admins_overview(rm: &RmHandle) -> Value {
    admin_get(rm, "/ws/v1/cluster/overview").await
}

/// An RM without AMs of its own on one node `n1` of 4 cores and two GPUs, its work below
/// `dir`.
async fn one_node_rm(dir: &std::path::Path) -> RmHandle {
    let node = Node::new("n1", "/r", Resources::with_mask(4, 1000, 0x3, PortSet::new()));
    let opts = RmOptions {
        launch_am: false,
        ..RmOptions::new(vec![node], "127.0.0.1:0".parse().unwrap(), dir.join("work"))
    };
    start(opts).await.unwrap()
}

/// The cluster page never hands a job's dashboard the caller's token (eleventh audit pass):
/// the link of a live job of the caller's carries a page ticket of that job only; another
/// user's job gets none; once the AM has ended its address is forgotten, and a final job is
/// linked nowhere (its port may be another process's by then).
#[tokio::test]
async fn the_cluster_page_links_a_dashboard_with_a_ticket_and_a_final_job_nowhere() {
    use crate::am::rm_client::RmClient;
    use crate::protocol::RegisterRequest;
    let dir = tempfile::tempdir().unwrap();
    let rm = one_node_rm(dir.path()).await;
    let mut ids = Vec::new();
    for (name, user) in [("mine", crate::rm::users::ADMIN_USER), ("theirs", "eve")] {
        let (id, tok) = rm.register_test_app(name);
        {
            let mut st = rm.shared.lock();
            let app = st.apps.get_mut(&id).unwrap();
            app.report.user = user.to_string();
            app.set_job_token(Some(&format!("job-token-{name}")));
        }
        let am = RmClient::for_app(&rm.base_url(), &id, &tok);
        let reg = RegisterRequest {
            host: "127.0.0.1".into(),
            tracking_url: format!("http://127.0.0.1:4567{}/", ids.len()),
        };
        am.register(&reg).await.unwrap();
        ids.push(id);
    }
    let overview = || async {
        let ov = admins_overview(&rm).await;
        let row = |id: &str| {
            ov["apps"]
                .as_array()
                .unwrap()
                .iter()
                .find(|a| a["id"] == id)
                .cloned()
                .unwrap()
        };
        (row(&ids[0]), row(&ids[1]))
    };
    let (mine, theirs) = overview().await;
    assert_eq!(mine["trackingUrl"], "http://127.0.0.1:45670/", "{mine}");
    let ticket = mine["dashboardTicket"].as_str().unwrap();
    assert!(!ticket.contains(rm.admin_token()), "{ticket}");
    let now = now_ms() / 1000;
    assert_eq!(
        crate::auth::page_ticket_user("job-token-mine", ticket, now).as_deref(),
        Some(crate::rm::users::ADMIN_USER),
        "a ticket of this job, naming its caller: {ticket}"
    );
    assert!(!crate::auth::page_ticket_valid("job-token-theirs", ticket, now));
    assert_eq!(theirs["trackingUrl"], "http://127.0.0.1:45671/", "{theirs}");
    assert!(theirs["dashboardTicket"].is_null(), "another user's job: {theirs}");
    // The AM of "mine" exits (a next attempt may follow): its address is forgotten.
    let _ = super::transactions::am_ended(&mut rm.shared.lock(), &ids[0], "exited", String::new(), 2, true);
    let (mine, _) = overview().await;
    assert_eq!(mine["trackingUrl"], "", "{mine}");
    assert!(mine["dashboardTicket"].is_null(), "{mine}");
    // A final job is linked nowhere, whatever address it kept.
    let admin = RmClient::new(&rm.base_url());
    admin.kill(&ids[1], rm.admin_token()).await.unwrap();
    let t0 = std::time::Instant::now();
    loop {
        let (_, theirs) = overview().await;
        if theirs["state"] == "KILLED" {
            assert_eq!(theirs["trackingUrl"], "", "{theirs}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "not killed: {theirs}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    rm.shutdown().await;
}

/// Several starts in one call (issue 29, YARN's `startContainers`): each is checked and
/// started as a single start is, a bad one fails alone with the error its single start
/// would answer, and the same call again answers the running containers' status (so an
/// AM that lost the answer never runs a task twice).
#[tokio::test]
async fn one_start_call_starts_several_containers_each_checked_alone() {
    use crate::am::rm_client::RmClient;
    use crate::protocol::{RegisterRequest, StartContainer, StartContainers};
    let dir = tempfile::tempdir().unwrap();
    let rm = one_node_rm(dir.path()).await;
    let (id, tok) = rm.register_test_app("batch");
    let (other_id, other_tok) = rm.register_test_app("other");
    let am = RmClient::for_app(&rm.base_url(), &id, &tok);
    let other = RmClient::for_app(&rm.base_url(), &other_id, &other_tok);
    am.register(&RegisterRequest::default()).await.unwrap();
    other.register(&RegisterRequest::default()).await.unwrap();
    let mine = granted(&am, vec![ask(1, "n1", 0x1)]).await;
    let theirs = granted(&other, vec![ask(1, "n1", 0x2)]).await;
    let start = |c: &crate::protocol::Container| StartContainer {
        host: c.host.clone(),
        container_id: c.container_id.clone(),
        context: LaunchContext {
            commands: vec!["sleep 30".into()],
            env: Default::default(),
        },
    };
    // Mine, another application's (not this AM's to start) and an unknown one.
    let mut unknown = start(&mine[0]);
    unknown.container_id = "container_1_0001_01_999999".into();
    let call = StartContainers {
        containers: vec![start(&mine[0]), start(&theirs[0]), unknown],
    };
    let answer = am.start_containers(&rm.base_url(), &call).await.unwrap();
    assert_eq!(answer.results.len(), 3);
    let status = answer.results[0].status.as_ref().expect("mine started");
    assert_eq!(status.state, ContainerState::Running);
    assert!(status.pid.is_some());
    let refused = answer.results[1]
        .error
        .as_ref()
        .expect("another AM's container is refused");
    assert!(refused.status == 401 || refused.status == 403, "{refused:?}");
    // An unknown container answers as one that is not the caller's (nobody learns which exist).
    assert_eq!(answer.results[2].error.as_ref().map(|e| e.status), Some(401));
    // Their container was not started by the refused start.
    let theirs_now = rm
        .shared
        .lock()
        .ledger
        .container(&theirs[0].container_id)
        .map(|c| c.state);
    assert_eq!(theirs_now, Some(ContainerState::Allocated));
    // The same call again: mine answers its status (running), it does not start again.
    let again = am.start_containers(&rm.base_url(), &call).await.unwrap();
    let state = again.results[0].status.as_ref().map(|s| s.state);
    assert_eq!(state, Some(ContainerState::Running), "{again:?}");
    let executor = rm.shared.nodes.local.executor();
    let now = executor.status(&mine[0].container_id).and_then(|s| s.pid);
    assert_eq!(now, status.pid, "the same process: the repeated start started nothing");
    // More than a call may carry is refused whole.
    let too_many = StartContainers {
        containers: vec![start(&mine[0]); crate::protocol::MAX_STARTS_PER_CALL + 1],
    };
    assert!(am.start_containers(&rm.base_url(), &too_many).await.is_err());
    rm.shutdown().await;
}

/// The lean node listing AMs read (issue 29) is the whole listing's nodes, smaller; an
/// unknown view is refused with the field named.
#[tokio::test]
async fn the_lean_listing_has_the_whole_listings_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let rm = rm_with(None, &dir.path().join("work")).await;
    let http = crate::tls::http_client();
    let get = |q: &'static str| {
        let (http, url) = (http.clone(), format!("{}/ws/v1/cluster/nodes{q}", rm.base_url()));
        async move { http.get(url).send().await.unwrap() }
    };
    let whole = get("").await.text().await.unwrap();
    let lean = get("?view=lean").await.text().await.unwrap();
    let (w, l) = (
        crate::cluster::rm_json::parse_node_listing(&whole).unwrap(),
        crate::cluster::rm_json::parse_node_listing(&lean).unwrap(),
    );
    assert_eq!(w.nodes, l.nodes);
    assert!(l.version.is_some());
    assert!(lean.len() < whole.len(), "{} vs {}", lean.len(), whole.len());
    let bad = get("?view=tiny").await;
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
    assert!(bad.text().await.unwrap().contains("`view`"));
}

/// The compact node listing AMs read (issue 29: each shape of node once) is the whole
/// listing's nodes, whole and as changes since a version, on a cluster of several kinds of
/// node, with nodes that share a shape and nodes that do not.
#[tokio::test]
async fn the_compact_listing_has_the_whole_listings_nodes() {
    use crate::cluster::rm_json::parse_node_listing;
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = Vec::new();
    for i in 0..40u32 {
        let mask = if i % 3 == 0 { 0xff } else { 0x0f };
        let mut n = Node::new(
            format!("host-{i:02}"),
            format!("/rack{}", i % 4),
            Resources::with_mask(32, 256_000, mask, PortSet::parse("20000-20999").unwrap()),
        );
        n.gpu_type = Some(if i % 2 == 0 { "A100" } else { "V100" }.into());
        n.topology = crate::topology::Topology::preset(if i % 3 == 0 { "dgx1v" } else { "pcie4" }).map(Arc::new);
        n.http_address = format!("10.0.{}.{}:8042", i / 10, i % 10);
        if i % 5 == 0 {
            n.labels = vec!["fast".into()];
            n.ip = Some(format!("10.1.0.{i}").parse().unwrap());
        }
        nodes.push(n);
    }
    let mut opts = RmOptions::new(nodes, "127.0.0.1:0".parse().unwrap(), dir.path().join("work"));
    opts.am_program = None;
    let rm = start(opts).await.unwrap();
    let http = crate::tls::http_client();
    let get = |q: String| {
        let (http, url) = (http.clone(), format!("{}/ws/v1/cluster/nodes{q}", rm.base_url()));
        async move { http.get(url).send().await.unwrap().text().await.unwrap() }
    };
    let whole = get(String::new()).await;
    let lean = get("?view=lean".into()).await;
    let compact = get("?view=compact".into()).await;
    let (w, c) = (
        parse_node_listing(&whole).unwrap(),
        parse_node_listing(&compact).unwrap(),
    );
    assert_eq!(w.nodes.len(), 40);
    assert_eq!(c.nodes, w.nodes);
    // 2 GPU types × 2 masks and topologies × labelled or not, and the nodes with an IP:
    // far fewer shapes than nodes, so far fewer bytes than the lean view.
    let shapes = serde_json::from_str::<serde_json::Value>(&compact).unwrap()["nodes"]["shapes"]
        .as_array()
        .map(Vec::len);
    assert!(matches!(shapes, Some(2..=12)), "{shapes:?}");
    assert!(compact.len() * 2 < lean.len(), "{} vs {}", compact.len(), lean.len());

    // A node that changes shape comes back in the changes since a version, alone.
    let version = c.version.clone().unwrap();
    super::cluster::change_node_state(&rm.shared, "host-07", NodeState::Unhealthy)
        .await
        .unwrap();
    let changed = parse_node_listing(&get(format!("?view=compact&since={version}")).await).unwrap();
    assert_eq!(changed.changed_since.as_deref(), Some(version.as_str()));
    let hosts: Vec<&str> = changed.nodes.iter().map(|n| n.host.as_str()).collect();
    assert_eq!(hosts, ["host-07"]);
    assert_eq!(changed.nodes[0].state, NodeState::Unhealthy);
    assert_eq!(changed.nodes[0].http_address, "10.0.0.7:8042");
    let lean_changed = parse_node_listing(&get(format!("?view=lean&since={version}")).await).unwrap();
    assert_eq!(changed.nodes, lean_changed.nodes);
    let (w, c) = (
        parse_node_listing(&get(String::new()).await).unwrap(),
        parse_node_listing(&get("?view=compact".into()).await).unwrap(),
    );
    assert_eq!(c.nodes, w.nodes);
    rm.shutdown().await;
}

/// Start estimates are computed a few at a time, one per caller (each snapshots the whole
/// state under its lock and walks a CPU): while the caller's own runs, or while every
/// permit is taken by others, it is told to come back (429, `Retry-After`); while another
/// user's runs it is answered.
#[tokio::test]
async fn start_estimates_are_computed_a_few_at_a_time_one_per_caller() {
    let dir = tempfile::tempdir().unwrap();
    let rm = rm_with(None, &dir.path().join("work")).await;
    let http = crate::tls::http_client();
    let ask = || {
        http.post(format!("{}/ws/v1/cluster/estimate", rm.base_url()))
            .bearer_auth(rm.admin_token())
            .json(&serde_json::json!({"waiting": [{"role": "w", "count": 1, "gpus": 1, "cpu": 1, "memoryMB": 10}]}))
            .send()
    };
    let admin = crate::rm::users::ADMIN_USER;
    let busy = |r: reqwest::Response| {
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            r.headers().get(header::RETRY_AFTER).map(|v| v.as_bytes()),
            Some(&b"1"[..])
        );
    };
    let mine = rm.shared.estimating.try_acquire(admin).unwrap();
    busy(ask().await.unwrap());
    drop(mine);
    let others: Vec<_> = (0..super::scheduling::ESTIMATES)
        .map(|i| rm.shared.estimating.try_acquire(&format!("user{i}")).unwrap())
        .collect();
    busy(ask().await.unwrap());
    let mut others = others;
    others.pop();
    let answered = ask().await.unwrap();
    assert_eq!(answered.status(), StatusCode::OK, "{:?}", answered.text().await);
    drop(others);
}

/// What `am` is granted for `asks` (the call must succeed).
async fn granted(
    am: &crate::am::rm_client::RmClient,
    asks: Vec<crate::protocol::Ask>,
) -> Vec<crate::protocol::Container> {
    am.allocate(&AllocateRequest {
        asks,
        ..Default::default()
    })
    .await
    .unwrap()
    .allocated
}
