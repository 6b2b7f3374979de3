//! One test per security or input-hardening rule, each trying the attack and checking
//! the refusal: the AM protocol and container endpoints need the application's own
//! token; administrative calls (node state, kill) need the admin token (kill also takes
//! the job's job token); tokens never reach the logs; container logs cannot be read
//! outside the container's directory; listeners default to loopback; huge bodies get
//! 413; malformed, mistyped or unknown-field bodies get 400 with an ErrorBody; absurd
//! numbers are refused, never a panic or an over-allocation; with the `tls` settings the
//! RM and the AM dashboard serve HTTPS only, and a whole job runs over it.
//!
//! Protocol rules run against an in-process RM (no AM launched, the test speaks the AM
//! protocol); the log rule runs a whole job on a real `gpuam rm` process.

mod common;

use std::fs;
use std::time::Duration;

use gpuam::cluster::Node;
use gpuam::resources::{PortSet, Resources};
use gpuam::rm::{start, RmHandle, RmOptions};
use reqwest::StatusCode;
use serde_json::{json, Value};

struct Rm {
    handle: RmHandle,
    http: reqwest::Client,
    _dir: tempfile::TempDir,
    /// Tokens of the users `alice` and `bob`.
    alice: String,
    bob: String,
}

async fn rm() -> Rm {
    rm_with(|_| {}).await
}

/// An in-process RM (no AM launched) with users `alice` and `bob`, after `tune` changed
/// its options.
async fn rm_with(tune: impl FnOnce(&mut RmOptions)) -> Rm {
    let dir = tempfile::tempdir().unwrap();
    let nodes = vec![
        Node::new(
            "n1",
            "/r",
            Resources::with_mask(16, 65_536, 0xf, PortSet::parse("20000-20099").unwrap()),
        ),
        Node::new(
            "n2",
            "/r",
            Resources::with_mask(16, 65_536, 0xf, PortSet::parse("20000-20099").unwrap()),
        ),
    ];
    let mut opts = RmOptions::new(nodes, "127.0.0.1:0".parse().unwrap(), dir.path().join("work"));
    opts.launch_am = false;
    let (alice, bob) = (gpuam::auth::new_token(), gpuam::auth::new_token());
    opts.users.insert_token("alice", &alice).unwrap();
    opts.users.insert_token("bob", &bob).unwrap();
    tune(&mut opts);
    let handle = start(opts).await.unwrap();
    Rm {
        handle,
        http: gpuam::tls::http_client(),
        _dir: dir,
        alice,
        bob,
    }
}

impl Rm {
    /// `method path` with an optional bearer token and a raw body → (status, JSON body).
    async fn call(&self, method: &str, path: &str, token: Option<&str>, body: Option<Vec<u8>>) -> (StatusCode, Value) {
        let url = format!("{}{path}", self.handle.base_url());
        let mut req = self
            .http
            .request(reqwest::Method::from_bytes(method.as_bytes()).unwrap(), url);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.header("content-type", "application/json").body(b);
        }
        let r = req.send().await.unwrap();
        let status = r.status();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    async fn json(&self, method: &str, path: &str, token: Option<&str>, body: Value) -> (StatusCode, Value) {
        self.call(method, path, token, Some(serde_json::to_vec(&body).unwrap()))
            .await
    }

    /// A registered test app: (id, token).
    async fn app(&self, name: &str) -> (String, String) {
        let (id, token) = self.handle.register_test_app(name);
        let (s, b) = self
            .json(
                "POST",
                &format!("/ws/v1/am/{id}/register"),
                Some(&token),
                json!({"host": "localhost", "trackingUrl": ""}),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{b}");
        (id, token)
    }
}

/// An ErrorBody with this status; returns its message.
fn error_body(got: (StatusCode, Value), want: StatusCode) -> String {
    let (s, b) = got;
    assert_eq!(s, want, "{b}");
    assert!(b["code"].is_string(), "an ErrorBody: {b}");
    b["message"]
        .as_str()
        .unwrap_or_else(|| panic!("an ErrorBody: {b}"))
        .to_string()
}

fn ask(id: u64, host: &str, cpu: Value, mem: Value, mask: &str, ports: &str) -> Value {
    json!({"requestId": id, "host": host, "cpu": cpu, "memoryMB": mem, "gpuMask": mask, "ports": ports})
}

#[tokio::test]
async fn am_protocol_needs_the_apps_own_token() {
    let rm = rm().await;
    let (a, ta) = rm.app("a").await;
    let (b, tb) = rm.app("b").await;
    let alloc = |rid: u64| json!({"responseId": rid, "asks": [ask(1, "n1", json!(1), json!(100), "0x1", "")]});

    // B's token (and no token, and a malformed header) on A's register/allocate/finish.
    for token in [Some(tb.as_str()), None, Some("")] {
        for (verb, body) in [
            ("register", json!({"host": "x", "trackingUrl": ""})),
            ("allocate", alloc(0)),
            (
                "finish",
                json!({"finalStatus": "FAILED", "exitCode": 1, "diagnostics": "x"}),
            ),
        ] {
            error_body(
                rm.json("POST", &format!("/ws/v1/am/{a}/{verb}"), token, body).await,
                StatusCode::UNAUTHORIZED,
            );
        }
    }
    assert!(rm.handle.ledger_all_free(), "the refused allocate granted nothing");
    assert!(!rm.handle.app_report(&a).unwrap().state.is_final(), "not finished");

    // A's own container; B cannot start, stop, read the status or logs of it.
    let (s, got) = rm
        .json("POST", &format!("/ws/v1/am/{a}/allocate"), Some(&ta), alloc(0))
        .await;
    assert_eq!(s, StatusCode::OK, "{got}");
    let cid = got["allocated"][0]["containerId"].as_str().unwrap().to_string();
    let base = format!("/ws/v1/node/n1/containers/{cid}");
    let launch = json!({"commands": ["sleep 30"], "env": {}});
    error_body(
        rm.json("POST", &format!("{base}/start"), Some(&tb), launch.clone())
            .await,
        StatusCode::UNAUTHORIZED,
    );
    for (m, p) in [
        ("POST", "stop"),
        ("GET", "status"),
        ("GET", "logs"),
        ("GET", "logs?stream=stderr"),
    ] {
        let body = (m == "POST").then(|| b"{}".to_vec());
        error_body(
            rm.call(m, &format!("{base}/{p}"), Some(&tb), body.clone()).await,
            StatusCode::UNAUTHORIZED,
        );
        error_body(
            rm.call(m, &format!("{base}/{p}"), None, body).await,
            StatusCode::UNAUTHORIZED,
        );
    }
    // The container is untouched: A can still start and stop it.
    let (s, st) = rm.json("POST", &format!("{base}/start"), Some(&ta), launch).await;
    assert_eq!(s, StatusCode::OK, "{st}");
    let (s, _) = rm.json("POST", &format!("{base}/stop"), Some(&ta), json!({})).await;
    assert_eq!(s, StatusCode::OK);
    // B's own protocol still works with B's token.
    let (s, _) = rm
        .json("POST", &format!("/ws/v1/am/{b}/allocate"), Some(&tb), alloc(0))
        .await;
    assert_eq!(s, StatusCode::OK);
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn admin_calls_need_the_admin_token() {
    let rm = rm().await;
    let (a, ta) = rm.app("a").await;
    let admin = rm.handle.admin_token().to_string();
    assert_eq!(admin.len(), 64, "a 256-bit generated token");
    let file = rm._dir.path().join("work").join("admin.token");
    assert_eq!(fs::read_to_string(&file).unwrap().trim(), admin);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);

    let lost = json!({"state": "LOST"});
    // The admin token with its last digit changed (appending "0" matched it 1 time in 16).
    let wrong = format!("{}{}", &admin[..63], if admin.ends_with('0') { '1' } else { '0' });
    for token in [None, Some(wrong.as_str()), Some(ta.as_str()), Some("")] {
        error_body(
            rm.json("PUT", "/ws/v1/cluster/nodes/n1/state", token, lost.clone())
                .await,
            StatusCode::UNAUTHORIZED,
        );
        error_body(
            rm.json(
                "PUT",
                &format!("/ws/v1/cluster/apps/{a}/state"),
                token,
                json!({"state": "KILLED"}),
            )
            .await,
            StatusCode::UNAUTHORIZED,
        );
    }
    let nodes = rm.handle.nodes_snapshot();
    assert!(nodes.iter().all(|(n, _)| n.state == gpuam::cluster::NodeState::Running));
    assert!(!rm.handle.app_report(&a).unwrap().state.is_final(), "not killed");

    let (s, b) = rm
        .json("PUT", "/ws/v1/cluster/nodes/n1/state", Some(&admin), lost)
        .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let (s, b) = rm
        .json(
            "PUT",
            &format!("/ws/v1/cluster/apps/{a}/state"),
            Some(&admin),
            json!({"state": "KILLED"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert_eq!(
        rm.handle.app_report(&a).unwrap().state,
        gpuam::protocol::AppState::Killed
    );
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn kill_takes_the_jobs_own_job_token_only() {
    let rm = rm().await;
    let spec = "name: t\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 0}\n    commands: [\"true\"]\n";
    let mut apps = Vec::new();
    for jt in ["job-token-aaaa", "job-token-bbbb"] {
        let (_, new) = rm
            .json(
                "POST",
                "/ws/v1/cluster/apps/new-application",
                Some(&rm.alice),
                json!({}),
            )
            .await;
        let id = new["applicationId"].as_str().unwrap().to_string();
        let (s, b) = rm
            .json(
                "POST",
                "/ws/v1/cluster/apps",
                Some(&rm.alice),
                json!({"applicationId": id, "jobSpec": spec, "jobToken": jt}),
            )
            .await;
        assert_eq!(s, StatusCode::ACCEPTED, "{b}");
        apps.push((id, jt));
    }
    let kill = json!({"state": "KILLED"});
    // B's job token does not kill A.
    error_body(
        rm.json(
            "PUT",
            &format!("/ws/v1/cluster/apps/{}/state", apps[0].0),
            Some(apps[1].1),
            kill.clone(),
        )
        .await,
        StatusCode::UNAUTHORIZED,
    );
    let (s, b) = rm
        .json(
            "PUT",
            &format!("/ws/v1/cluster/apps/{}/state", apps[0].0),
            Some(apps[0].1),
            kill,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert_eq!(b["state"], "KILLED");
    assert!(!rm.handle.app_report(&apps[1].0).unwrap().state.is_final());
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn bodies_over_one_mib_are_refused_with_413() {
    let rm = rm().await;
    let (a, ta) = rm.app("a").await;
    let big = {
        let mut v = b"{\"responseId\":0,\"releases\":[\"".to_vec();
        v.extend(std::iter::repeat_n(b'x', (1 << 20) + 10));
        v.extend(b"\"]}");
        v
    };
    for (m, p, t) in [
        ("POST", format!("/ws/v1/am/{a}/allocate"), Some(ta.as_str())),
        ("POST", "/ws/v1/cluster/apps".to_string(), Some(rm.alice.as_str())),
        (
            "PUT",
            "/ws/v1/cluster/nodes/n1/state".to_string(),
            Some(rm.handle.admin_token()),
        ),
    ] {
        let msg = error_body(
            rm.call(m, &p, t, Some(big.clone())).await,
            StatusCode::PAYLOAD_TOO_LARGE,
        );
        assert!(msg.contains("1048576"), "the limit is named: {msg}");
    }
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn malformed_mistyped_and_unknown_fields_get_400() {
    let rm = rm().await;
    let (a, ta) = rm.app("a").await;
    let admin = rm.handle.admin_token().to_string();
    let alloc = format!("/ws/v1/am/{a}/allocate");
    let kill = format!("/ws/v1/cluster/apps/{a}/state");
    let cases: Vec<(&str, &str, Option<&str>, &[u8])> = vec![
        ("POST", &alloc, Some(&ta), b"{\"responseId\": 0,"),
        ("POST", &alloc, Some(&ta), b"not json"),
        ("POST", &alloc, Some(&ta), b"{\"responseId\": \"zero\"}"),
        ("POST", &alloc, Some(&ta), b"{\"responseId\": -1}"),
        ("POST", &alloc, Some(&ta), b"{\"responseId\": 0, \"evil\": true}"),
        ("POST", &alloc, Some(&ta), b"{\"responseId\": 0, \"asks\": {}}"),
        ("POST", &alloc, Some(&ta), b"[]"),
        (
            "POST",
            "/ws/v1/cluster/apps",
            Some(&rm.alice),
            b"{\"applicationId\": 5}",
        ),
        (
            "POST",
            "/ws/v1/cluster/apps",
            Some(&rm.alice),
            b"{\"applicationId\": \"x\", \"jobSpec\": \"\", \"extra\": 1}",
        ),
        (
            "PUT",
            "/ws/v1/cluster/nodes/n1/state",
            Some(&admin),
            b"{\"state\": \"GONE\"}",
        ),
        (
            "PUT",
            "/ws/v1/cluster/nodes/n1/state",
            Some(&admin),
            b"{\"state\": \"LOST\", \"why\": 1}",
        ),
        ("PUT", "/ws/v1/cluster/nodes/n1/state", Some(&admin), b""),
        ("PUT", &kill, Some(&admin), b"{\"state\": 3}"),
    ];
    for (m, p, t, body) in cases {
        let (s, b) = rm.call(m, p, t, Some(body.to_vec())).await;
        assert_eq!(
            s,
            StatusCode::BAD_REQUEST,
            "{m} {p} {}: {b}",
            String::from_utf8_lossy(body)
        );
        assert!(b["code"].is_string() && b["message"].is_string(), "ErrorBody: {b}");
    }
    assert!(rm.handle.ledger_all_free());
    assert!(rm
        .handle
        .nodes_snapshot()
        .iter()
        .all(|(n, _)| n.state == gpuam::cluster::NodeState::Running));
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn absurd_numbers_are_refused_without_panic_or_overallocation() {
    let rm = rm().await;
    // Job specs: 10^9 tasks, 70 GPUs, a CPU count beyond u32 → 400 naming the limit.
    for (res, instances, limit) in [
        ("{cpu: 1, memoryMB: 10, gpu: 0}", "1000000000", "10000"),
        ("{cpu: 1, memoryMB: 10, gpu: 70}", "1", "64"),
        ("{cpu: 4294967295, memoryMB: 10, gpu: 0}", "1", "4096"),
    ] {
        let spec = format!(
            "name: t\ntaskRoles:\n  w:\n    instances: {instances}\n    resourcePerInstance: {res}\n    commands: [\"true\"]\n"
        );
        let (_, new) = rm
            .json(
                "POST",
                "/ws/v1/cluster/apps/new-application",
                Some(&rm.alice),
                json!({}),
            )
            .await;
        let id = new["applicationId"].as_str().unwrap().to_string();
        let msg = error_body(
            rm.json(
                "POST",
                "/ws/v1/cluster/apps",
                Some(&rm.alice),
                json!({"applicationId": id, "jobSpec": spec}),
            )
            .await,
            StatusCode::BAD_REQUEST,
        );
        assert!(msg.contains(limit), "the limit {limit} is named: {msg}");
    }

    // Asks: the RM rejects what no node can hold, never grants more than exists.
    let (a, ta) = rm.app("a").await;
    let alloc = format!("/ws/v1/am/{a}/allocate");
    let (s, out) = rm
        .json(
            "POST",
            &alloc,
            Some(&ta),
            json!({"responseId": 0, "asks": [
                ask(1, "n1", json!(4294967295u64), json!(1), "0x1", ""),
                ask(2, "n1", json!(1), json!(u64::MAX), "0x1", ""),
                ask(3, "n1", json!(1), json!(1), "0xffffffffffffffff", ""),
                ask(4, "n1", json!(1), json!(1), "0x0", "1-65535"),
                ask(5, "nowhere", json!(1), json!(1), "0x1", ""),
            ]}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{out}");
    assert_eq!(out["allocated"].as_array().unwrap().len(), 0, "{out}");
    let rejected = out["rejected"].as_array().unwrap();
    assert_eq!(rejected.len(), 5, "{out}");
    assert!(rejected.iter().all(|r| r["retryable"] == false), "{out}");
    assert!(rm.handle.ledger_all_free());
    // Numbers that do not fit the wire types at all: 400, not a wrap-around.
    for bad in [
        ask(6, "n1", json!(4294967296u64), json!(1), "0x1", ""),
        ask(7, "n1", json!(-1), json!(1), "0x1", ""),
        ask(8, "n1", json!(1), json!(1), "0x1ffffffffffffffff", ""),
        ask(9, "n1", json!(1), json!(1e30), "0x1", ""),
        ask(10, "n1", json!(1), json!(1), "0x1", "70000"),
    ] {
        error_body(
            rm.json("POST", &alloc, Some(&ta), json!({"responseId": 1, "asks": [bad]}))
                .await,
            StatusCode::BAD_REQUEST,
        );
    }
    assert!(rm.handle.ledger_all_free());
    // The RM still serves a sane ask afterwards.
    let (s, out) = rm
        .json(
            "POST",
            &alloc,
            Some(&ta),
            json!({"responseId": 1, "asks": [ask(11, "n1", json!(1), json!(1), "0x1", "20000")]}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{out}");
    assert_eq!(out["allocated"].as_array().unwrap().len(), 1, "{out}");
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn container_logs_stay_inside_the_container_directory() {
    let rm = rm().await;
    let (a, ta) = rm.app("a").await;
    let secret = rm._dir.path().join("secret.txt");
    fs::write(&secret, "TOP-SECRET-LINE\n").unwrap();
    let (_, got) = rm
        .json(
            "POST",
            &format!("/ws/v1/am/{a}/allocate"),
            Some(&ta),
            json!({"responseId": 0, "asks": [ask(1, "n1", json!(1), json!(1), "0x0", "")]}),
        )
        .await;
    let cid = got["allocated"][0]["containerId"].as_str().unwrap().to_string();
    let base = format!("/ws/v1/node/n1/containers/{cid}");
    // The task swaps its stdout for a link to a secret (and its stderr for /etc/passwd). The
    // logs are in the node's record beside the task's directory, out of reach of a task of
    // its own uid; this library RM runs tasks as itself (root), which can reach them: the
    // node still reads them without following links.
    let cmd = format!(
        "rm -f ../stdout ../stderr; ln -s {} ../stdout; ln -s /etc/passwd ../stderr; touch swapped; sleep 30",
        secret.display()
    );
    let (s, b) = rm
        .json(
            "POST",
            &format!("{base}/start"),
            Some(&ta),
            json!({"commands": [cmd], "env": {}}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let dir = rm._dir.path().join("work").join("containers").join(&cid);
    common::wait_for(Duration::from_secs(10), "the task to swap its logs", || {
        dir.join("work").join("swapped").exists().then_some(())
    });
    for stream in ["stdout", "stderr"] {
        let (s, b) = rm
            .call("GET", &format!("{base}/logs?stream={stream}"), Some(&ta), None)
            .await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{b}");
        let text = b.to_string();
        assert!(!text.contains("TOP-SECRET") && !text.contains("root:"), "{text}");
    }
    // Traversal in the path or the query never reaches the file system.
    for p in [
        "/ws/v1/node/n1/containers/..%2F..%2Fsecret.txt/logs".to_string(),
        "/ws/v1/node/n1/containers/%2Fetc%2Fpasswd/logs".to_string(),
        format!("{base}/logs?stream=../../secret.txt"),
        format!("{base}/logs?stream=%2Fetc%2Fpasswd"),
    ] {
        let (s, b) = rm.call("GET", &p, Some(&ta), None).await;
        assert!(matches!(s.as_u16(), 400 | 404), "{p}: {s} {b}");
        assert!(!b.to_string().contains("TOP-SECRET") && !b.to_string().contains("root:"));
    }
    rm.handle.shutdown().await;
}

/// `gpuam run`, `gpuam rm` and `gpuam node` refuse a work dir another user owns (exit 64,
/// naming it and its owner) and write nothing there: root would later read what that user
/// planted in it. Root only (chown); CI runs as root.
#[test]
fn a_work_dir_of_another_user_is_refused_and_left_untouched() {
    use std::os::unix::fs::PermissionsExt as _;
    if !nix::unistd::geteuid().is_root() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let theirs = tmp.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::chown(&theirs, Some(64_998), None).unwrap();
    let w = theirs.display().to_string();
    let token = tmp.path().join("h1.token");
    std::fs::write(&token, "x".repeat(40)).unwrap();
    let t = token.display().to_string();
    for args in [
        vec!["run", "examples/ddp-4x2.yaml", "--work-dir", &w],
        vec!["rm", "--listen", "127.0.0.1:0", "--work-dir", &w],
        vec![
            "node",
            "--rm",
            "http://127.0.0.1:9",
            "--host",
            "h1",
            "--node-token-file",
            &t,
            "--work-dir",
            &w,
        ],
    ] {
        let out = std::process::Command::new(common::bin())
            .args(&args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "gpuam {args:?}: {err}");
        assert!(err.contains("uid 64998") && err.contains(&w), "gpuam {args:?}: {err}");
        assert_eq!(
            std::fs::read_dir(&theirs).unwrap().count(),
            0,
            "gpuam {args:?} wrote there"
        );
        let mode = std::fs::metadata(&theirs).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o755, "gpuam {args:?} changed its mode");
    }
    // `gpuam rm --state-dir` the same (the state file holds tokens).
    let own = tmp.path().join("own-work");
    let out = std::process::Command::new(common::bin())
        .args(["rm", "--listen", "127.0.0.1:0", "--work-dir"])
        .arg(&own)
        .arg("--state-dir")
        .arg(&theirs)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{err}");
    assert!(err.contains("--state-dir") && err.contains("uid 64998"), "{err}");
    assert_eq!(std::fs::read_dir(&theirs).unwrap().count(), 0);
    // A directory every user may write (`/tmp` itself) is no work dir either, even root's.
    let shared = tmp.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let out = std::process::Command::new(common::bin())
        .args(["rm", "--listen", "127.0.0.1:0", "--work-dir"])
        .arg(&shared)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{err}");
    assert!(err.contains("writable by other users"), "{err}");
    assert_eq!(std::fs::read_dir(&shared).unwrap().count(), 0);
    assert_eq!(
        std::fs::metadata(&shared).unwrap().permissions().mode() & 0o7777,
        0o1777
    );
}

#[test]
fn listeners_bind_to_loopback_by_default() {
    for cmd in ["rm", "am", "run", "submit"] {
        let out = std::process::Command::new(common::bin())
            .args([cmd, "--help"])
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        let line = help
            .lines()
            .skip_while(|l| !l.trim_start().starts_with("--listen"))
            .take(4)
            .flat_map(str::split_whitespace)
            .collect::<Vec<_>>()
            .join(" ");
        assert!(line.contains("[default: 127.0.0.1:"), "gpuam {cmd}: {line}");
    }
}

#[test]
fn tokens_never_appear_in_logs() {
    let rm = common::Rm::start(
        "nodes:\n  - host: n1\n    cpu: 4\n    memoryMB: 4000\n    gpus: 1\n",
        &[("GPUAM_LOG", "debug")],
    );
    let admin = rm.admin_token();
    let root = rm.root().display().to_string();
    let job = rm.write_job(
        "quiet",
        &format!(
            "name: quiet\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {{cpu: 1, memoryMB: 10, gpu: 1}}\n    commands:\n      - {}\n",
            common::sq(&format!("env > {root}/task.env; while [ ! -f {root}/go ]; do sleep 0.05; done"))
        ),
    );
    let sub = rm.submit(&job);
    let app = sub.app_id(Duration::from_secs(10));
    // The job token is in the dashboard URL the CLI prints for its user.
    let job_token = common::wait_for(Duration::from_secs(20), "the dashboard line", || {
        sub.stdout()
            .lines()
            .find_map(|l| l.split_once("#token=").map(|(_, t)| t.trim().to_string()))
    });
    // The AM's app token: from its environment (never its command line).
    let am_pid = common::wait_for(Duration::from_secs(10), "the AM process", || {
        fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
            let cmdline = fs::read(e.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            (cmdline.contains(" am ") && cmdline.contains(&app)).then(|| e.path())
        })
    });
    let environ = fs::read(am_pid.join("environ")).unwrap();
    let app_token = String::from_utf8_lossy(&environ)
        .split('\0')
        .find_map(|kv| kv.strip_prefix("GPUAM_APP_TOKEN=").map(str::to_string))
        .unwrap();
    let cmdline = String::from_utf8_lossy(&fs::read(am_pid.join("cmdline")).unwrap()).to_string();
    assert!(!cmdline.contains(&app_token) && !cmdline.contains(&job_token));
    common::wait_for(Duration::from_secs(20), "the task", || {
        fs::metadata(rm.path("task.env")).ok()
    });
    let task_env = fs::read_to_string(rm.path("task.env")).unwrap();
    for t in [&admin, &app_token, &job_token] {
        assert!(
            !task_env.contains(t.as_str()),
            "the task's environment carries no token"
        );
    }
    // Failed attempts with wrong tokens (logged as refusals) must not echo them.
    let attempt = "wrong-token-0123456789abcdef";
    let (s, _) = rm.put_json(
        "/ws/v1/cluster/nodes/n1/state",
        Some(attempt),
        &json!({"state": "LOST"}),
    );
    assert_eq!(s, 401);
    let tracking = rm.app(&app)["trackingUrl"].as_str().unwrap().to_string();
    let (s, _) = rm.request(
        "POST",
        &format!("/ws/v1/am/{app}/allocate"),
        Some(attempt),
        Some(b"{\"responseId\": 0}".to_vec()),
    );
    assert_eq!(s, 401);
    let (s, _) = rm.request("POST", &format!("{tracking}api/v1/job/kill"), Some(attempt), None);
    assert_eq!(s, 401, "the dashboard refuses a wrong job token");
    fs::write(rm.path("go"), "").unwrap();
    let out = sub.wait(Duration::from_secs(40));
    assert_eq!(out.code, 0, "{out:?}");
    rm.kill_app(&app); // admin token on a finished app: a no-op, and logged without it
                       // Every log the RM and the AM wrote.
    let mut logs = vec![rm.path("rm.stdout"), rm.path("rm.stderr")];
    for f in ["am.stdout", "am.stderr"] {
        logs.push(rm.work_dir.join(&app).join(f));
    }
    let mut seen_lines = 0;
    for p in &logs {
        let text = fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        seen_lines += text.lines().count();
        for (what, t) in [
            ("admin", admin.as_str()),
            ("user", rm.user_token.as_str()),
            ("app", app_token.as_str()),
            ("job", job_token.as_str()),
            ("presented", attempt),
        ] {
            assert!(!text.contains(t), "the {what} token is in {}", p.display());
        }
    }
    assert!(
        seen_lines > 5,
        "the logs were written at debug level ({seen_lines} lines)"
    );
}

/// What a plain-HTTP request to `host:port` gets back: the raw bytes until the server
/// closes (or 10 s pass).
fn plain_http_answer(host_port: &str) -> Vec<u8> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(host_port).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /ws/v1/cluster/nodes HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    out
}

#[test]
fn tls_listeners_serve_https_only_and_a_job_runs_over_them() {
    let dir = common::Rm::temp_dir();
    common::write_test_pki(dir.path(), &["127.0.0.1", "localhost"]);
    // Relative paths: relative to the settings file's directory (the AM runs elsewhere).
    let rm = common::Rm::start_in(
        dir,
        "nodes:\n  - host: n1\n    cpu: 4\n    memoryMB: 4000\n    gpus: 1\n",
        "tls:\n  cert_file: server.pem\n  key_file: server.key\n  ca_file: ca.pem\n",
        &[],
    );
    assert!(rm.url.starts_with("https://127.0.0.1:"), "the RM hands out {}", rm.url);
    let host_port = rm.url.trim_start_matches("https://").to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let get = |client: &reqwest::Client, url: String| {
        rt.block_on(async { client.get(url).send().await?.error_for_status()?.text().await })
    };
    // (a) HTTPS trusting the test CA.
    let info = rm.get_json("/ws/v1/cluster/info").unwrap();
    assert!(info.is_object(), "{info}");
    // (b) Plain HTTP to the same port gets no HTTP answer.
    let answer = plain_http_answer(&host_port);
    assert!(
        !answer.starts_with(b"HTTP/"),
        "plain HTTP was answered: {}",
        String::from_utf8_lossy(&answer)
    );
    let ca = rm.path("ca.pem");
    let trusting = gpuam::tls::http_client_builder(Some(&ca)).unwrap().build().unwrap();
    assert!(get(&trusting, format!("http://{host_port}/ws/v1/cluster/info")).is_err());
    // (c) Clients that do not trust the CA are refused with a certificate error.
    let other = gpuam::tls::http_client_builder(Some(&rm.path("other-ca.pem")))
        .unwrap()
        .build()
        .unwrap();
    let system_roots = gpuam::tls::http_client_builder(None).unwrap().build().unwrap();
    for client in [&other, &system_roots] {
        let e = get(client, format!("{}/ws/v1/cluster/info", rm.url)).unwrap_err();
        assert!(format!("{e:?}").to_lowercase().contains("certificate"), "{e:?}");
    }
    assert!(get(&trusting, format!("{}/ws/v1/cluster/info", rm.url)).is_ok());

    // (d) A real job: `gpuam submit --wait` over HTTPS, its AM (launched by the RM, in
    // another directory) reaches the RM over TLS and serves its dashboard over HTTPS.
    let root = rm.root().display().to_string();
    let job = rm.write_job(
        "secure",
        &format!(
            "name: secure\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {{cpu: 1, memoryMB: 10, gpu: 1}}\n    commands:\n      - {}\n",
            common::sq(&format!("while [ ! -f {root}/go ]; do sleep 0.05; done"))
        ),
    );
    let sub = rm.submit(&job);
    let app = sub.app_id(Duration::from_secs(10));
    let dashboard = common::wait_for(Duration::from_secs(20), "the dashboard line", || {
        sub.stdout()
            .lines()
            .find_map(|l| l.strip_prefix("dashboard: ").map(str::to_string))
    });
    assert!(dashboard.starts_with("https://127.0.0.1:"), "{dashboard}");
    let tracking = rm.app(&app)["trackingUrl"].as_str().unwrap().to_string();
    assert!(tracking.starts_with("https://"), "{tracking}");
    let job_json = rm
        .get_text_as(&format!("{tracking}api/v1/job"), &rm.user_token)
        .expect("the dashboard answers HTTPS trusting the CA (and takes the owner's token)");
    assert!(job_json.contains("secure"), "{job_json}");
    let dash_host_port = tracking.trim_start_matches("https://").trim_end_matches('/');
    let answer = plain_http_answer(dash_host_port);
    assert!(
        !answer.starts_with(b"HTTP/"),
        "the dashboard answered plain HTTP: {}",
        String::from_utf8_lossy(&answer)
    );
    assert!(get(&other, format!("{tracking}api/v1/job")).is_err());
    fs::write(rm.path("go"), "").unwrap();
    let out = sub.wait(Duration::from_secs(60));
    assert_eq!(out.code, 0, "{out:?}\n{}", rm.logs());
    let end = rm.wait_app_final(&app, Duration::from_secs(10));
    assert_eq!(end["finalStatus"], "SUCCEEDED", "{end}");
}

// ---- issue 11: credentials, browser-borne requests, limits, input ----

/// A one-task job (no GPU, so it never competes for the test nodes' GPUs).
const SPEC: &str = "name: t\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 0}\n    commands: [\"true\"]\n";

impl Rm {
    /// new-application then submit as the holder of `token`, with `extra` fields in the
    /// submit body: (the submit's status and body, the application id).
    async fn submit_as(&self, token: &str, spec: &str, extra: Value) -> (StatusCode, Value, String) {
        let (s, new) = self
            .json("POST", "/ws/v1/cluster/apps/new-application", Some(token), json!({}))
            .await;
        assert_eq!(s, StatusCode::OK, "{new}");
        let id = new["applicationId"].as_str().unwrap().to_string();
        let mut body = json!({"applicationId": id, "jobSpec": spec});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        let (s, out) = self.json("POST", "/ws/v1/cluster/apps", Some(token), body).await;
        (s, out, id)
    }

    /// The ids of the applications `token`'s holder lists.
    async fn listed(&self, token: &str) -> Vec<String> {
        let (s, b) = self.call("GET", "/ws/v1/cluster/apps", Some(token), None).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let mut ids: Vec<String> = b["apps"]["app"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["id"].as_str().unwrap().to_string())
            .collect();
        ids.sort();
        ids
    }

    /// A started container of `app` (registered through its AM token) running `cmd`:
    /// (its logs URL path, the app token).
    async fn running_container(&self, app: &str, cmd: &str) -> (String, String) {
        let token = self.handle.app_token(app).unwrap();
        let (s, b) = self
            .json(
                "POST",
                &format!("/ws/v1/am/{app}/register"),
                Some(&token),
                json!({"host": "h", "trackingUrl": ""}),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let (s, got) = self
            .json(
                "POST",
                &format!("/ws/v1/am/{app}/allocate"),
                Some(&token),
                json!({"responseId": 0, "asks": [ask(1, "n1", json!(1), json!(10), "0x0", "")]}),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{got}");
        let cid = got["allocated"][0]["containerId"].as_str().unwrap().to_string();
        let base = format!("/ws/v1/node/n1/containers/{cid}");
        let (s, b) = self
            .json(
                "POST",
                &format!("{base}/start"),
                Some(&token),
                json!({"commands": [cmd], "env": {}}),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{b}");
        (format!("{base}/logs"), token)
    }
}

/// Polls `f` every 50 ms until it gives `Some` (panics naming `what` after `timeout`):
/// the async `common::wait_for`, for tests whose RM runs on the test's own runtime.
async fn poll<T, F: std::future::Future<Output = Option<T>>>(
    timeout: Duration,
    what: &str,
    mut f: impl FnMut() -> F,
) -> T {
    let give_up = std::time::Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            std::time::Instant::now() < give_up,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One HTTP/1.1 request written as it is (headers included) on a fresh connection:
/// (status, the answer's header block, its body).
async fn raw(addr: std::net::SocketAddr, head: &str, body: &str) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{head}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("an answer")
        .unwrap();
    let text = String::from_utf8_lossy(&out).to_string();
    let (h, b) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = h.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, h.to_ascii_lowercase(), b.to_string())
}

#[tokio::test]
async fn submitting_listing_killing_and_logs_need_a_user_credential() {
    let rm = rm().await;
    let admin = rm.handle.admin_token().to_string();
    // The attack: no token, or one nobody has. 401, saying how to get a token.
    for token in [None, Some("not-a-token")] {
        for (m, p) in [
            ("POST", "/ws/v1/cluster/apps/new-application"),
            ("GET", "/ws/v1/cluster/apps"),
            ("POST", "/ws/v1/cluster/apps"),
        ] {
            let body = json!({"applicationId": "application_1_0001", "jobSpec": SPEC});
            let got = match m {
                "GET" => rm.call(m, p, token, None).await,
                _ => rm.json(m, p, token, body).await,
            };
            let msg = error_body(got, StatusCode::UNAUTHORIZED);
            assert!(
                msg.contains("gpuam token new") && msg.contains("--token-file") && msg.contains("GPUAM_TOKEN"),
                "{m} {p}: {msg}"
            );
        }
    }
    assert!(rm.listed(&admin).await.is_empty(), "nothing was submitted");

    // alice submits: the application records her; the scheme may be written in any case.
    let (s, b, a) = rm.submit_as(&rm.alice, SPEC, json!({"jobToken": "jt-alice"})).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    assert_eq!(b["app"]["user"], "alice");
    assert_eq!(rm.handle.app_report(&a).unwrap().user, "alice");
    let (_, _, b2) = rm.submit_as(&rm.bob, SPEC, json!({})).await;
    let lower = rm
        .http
        .get(format!("{}/ws/v1/cluster/apps/{a}", rm.handle.base_url()))
        .header("authorization", format!("bearer {}", rm.alice))
        .send()
        .await
        .unwrap();
    assert_eq!(lower.status(), StatusCode::OK, "lower-case `bearer` is accepted");

    // Each user sees only their own; the admin sees all.
    assert_eq!(rm.listed(&rm.alice).await, vec![a.clone()]);
    assert_eq!(rm.listed(&rm.bob).await, vec![b2.clone()]);
    let mut both = vec![a.clone(), b2.clone()];
    both.sort();
    assert_eq!(rm.listed(&admin).await, both);
    for p in [
        format!("/ws/v1/cluster/apps/{a}"),
        format!("/ws/v1/cluster/apps/{a}/state"),
        format!("/ws/v1/cluster/apps/{a}/appattempts"),
    ] {
        let msg = error_body(rm.call("GET", &p, Some(&rm.bob), None).await, StatusCode::FORBIDDEN);
        assert!(msg.contains("another user"), "{msg}");
    }

    // Logs of alice's container: alice, the admin and her AM read them; bob does not.
    let (logs, app_token) = rm.running_container(&a, "echo alice-private-output; sleep 30").await;
    let got = poll(Duration::from_secs(10), "the task's output", || async {
        let (s, b) = rm.call("GET", &logs, Some(&rm.alice), None).await;
        (s == StatusCode::OK && b.to_string().contains("alice-private-output")).then_some(b)
    })
    .await;
    assert!(got.to_string().contains("alice-private-output"));
    for (who, token) in [("the admin", admin.as_str()), ("her AM", app_token.as_str())] {
        let (s, b) = rm.call("GET", &logs, Some(token), None).await;
        assert!(
            s == StatusCode::OK && b.to_string().contains("alice-private"),
            "{who}: {s} {b}"
        );
    }
    let (s, b) = rm.call("GET", &logs, Some(&rm.bob), None).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{b}");
    assert!(!b.to_string().contains("alice-private"));
    error_body(rm.call("GET", &logs, None, None).await, StatusCode::UNAUTHORIZED);

    // Kill: not bob; alice (the owner) may, as may her job token and the admin.
    let kill = json!({"state": "KILLED"});
    error_body(
        rm.json(
            "PUT",
            &format!("/ws/v1/cluster/apps/{a}/state"),
            Some(&rm.bob),
            kill.clone(),
        )
        .await,
        StatusCode::FORBIDDEN,
    );
    assert!(!rm.handle.app_report(&a).unwrap().state.is_final());
    let (s, out) = rm
        .json(
            "PUT",
            &format!("/ws/v1/cluster/apps/{a}/state"),
            Some(&rm.alice),
            kill.clone(),
        )
        .await;
    assert_eq!((s, out["state"].as_str()), (StatusCode::OK, Some("KILLED")), "{out}");
    let (s, _) = rm
        .json("PUT", &format!("/ws/v1/cluster/apps/{b2}/state"), Some(&admin), kill)
        .await;
    assert_eq!(s, StatusCode::OK);
    rm.handle.shutdown().await;

    // An RM without users: only the admin token submits, and the 401 says so.
    let rm = rm_with(|o| o.users = Default::default()).await;
    let msg = error_body(
        rm.json(
            "POST",
            "/ws/v1/cluster/apps/new-application",
            Some(&rm.alice),
            json!({}),
        )
        .await,
        StatusCode::UNAUTHORIZED,
    );
    assert!(msg.contains("no users file") && msg.contains("admin token"), "{msg}");
    let (s, b, _) = rm.submit_as(rm.handle.admin_token(), SPEC, json!({})).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    assert_eq!(b["app"]["user"], "admin");
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn browser_borne_requests_are_refused() {
    let rm = rm_with(|o| o.public_names = vec!["rm.example.org".into()]).await;
    let addr = rm.handle.addr();
    let port = addr.port();
    let submit = |host: &str, origin: Option<&str>, ctype: &str, token: Option<&str>| {
        let mut head =
            format!("POST /ws/v1/cluster/apps/new-application HTTP/1.1\r\nHost: {host}\r\nContent-Type: {ctype}\r\n");
        if let Some(o) = origin {
            head.push_str(&format!("Origin: {o}\r\n"));
        }
        if let Some(t) = token {
            head.push_str(&format!("Authorization: Bearer {t}\r\n"));
        }
        head
    };
    let mut answers = Vec::new();
    // The measured attack: a page at evil.example rebinds its name to the RM and posts
    // text/plain. Refused at the Host, with or without a stolen-looking credential.
    let evil = format!("evil.example:{port}");
    for token in [None, Some(rm.alice.as_str())] {
        let a = raw(
            addr,
            &submit(&evil, Some(&format!("http://{evil}")), "text/plain", token),
            "{}",
        )
        .await;
        assert_eq!(a.0, 421, "{a:?}");
        assert!(
            a.2.contains("rm.public_names"),
            "the refusal says how to allow a name: {a:?}"
        );
        answers.push(a);
    }
    // The right Host, but a page of another site as the Origin: 403.
    let local = format!("127.0.0.1:{port}");
    let a = raw(
        addr,
        &submit(&local, Some("http://evil.example"), "application/json", Some(&rm.alice)),
        "{}",
    )
    .await;
    assert_eq!(a.0, 403, "{a:?}");
    answers.push(a);
    // Bodies a page can send without asking (a form, text/plain): 415.
    for ctype in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let a = raw(addr, &submit(&local, None, ctype, Some(&rm.alice)), "{}").await;
        assert_eq!(a.0, 415, "{ctype}: {a:?}");
        assert!(a.2.contains("application/json"), "{a:?}");
        answers.push(a);
    }
    assert!(rm.handle.app_report(&gpuam::rm::apps::app_id(0, 1)).is_none());
    // What the RM serves: loopback names, its address, the configured public name.
    for host in [
        local.clone(),
        format!("localhost:{port}"),
        format!("rm.example.org:{port}"),
    ] {
        let a = raw(
            addr,
            &submit(
                &host,
                Some(&format!("http://{host}")),
                "application/json; charset=utf-8",
                Some(&rm.alice),
            ),
            "{}",
        )
        .await;
        assert_eq!(a.0, 200, "{host}: {a:?}");
        answers.push(a);
    }
    // A CORS preflight gets no grant; no answer ever carries one.
    let a = raw(
        addr,
        &format!("OPTIONS /ws/v1/cluster/apps HTTP/1.1\r\nHost: {local}\r\nOrigin: http://{local}\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type\r\n"),
        "",
    )
    .await;
    answers.push(a);
    for (status, head, _) in &answers {
        assert!(
            !head.contains("access-control-"),
            "a CORS header in a {status} answer: {head}"
        );
    }

    // A job's dashboard stays on loopback unless the operator allows more.
    for listen in ["0.0.0.0:0", "[::]:0", "10.1.2.3:8000"] {
        let (s, b, _) = rm.submit_as(&rm.alice, SPEC, json!({"dashboardListen": listen})).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{listen}: {b}");
        assert!(
            b["message"].as_str().unwrap().contains("rm.allow_public_dashboards"),
            "{b}"
        );
    }
    let (s, b, _) = rm
        .submit_as(&rm.alice, SPEC, json!({"dashboardListen": "not an address"}))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    // The AM runs as the RM's user: no privileged port for a user's dashboard.
    let (s, b, _) = rm
        .submit_as(&rm.alice, SPEC, json!({"dashboardListen": "127.0.0.9:99"}))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    assert!(b["message"].as_str().unwrap().contains("privileged"), "{b}");
    let (s, b, _) = rm
        .submit_as(&rm.alice, SPEC, json!({"dashboardListen": "127.0.0.1:0"}))
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    // Seventh pass, F2: a user's job does not name its dashboard's port. Its AM binds as
    // the RM's user on the RM's host, so a named port could be an agent's own (taken while
    // the agent restarts, keeping its host out for as long as the job runs), the RM's or
    // a task's. Port 0 only, unless the operator gives users a range; the admin may name one.
    let free_port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    for listen in ["127.0.0.1:8042".to_string(), format!("[::1]:{}", free_port())] {
        let (s, b, _) = rm.submit_as(&rm.alice, SPEC, json!({"dashboardListen": listen})).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{listen}: {b}");
        assert!(b["message"].as_str().unwrap().contains("rm.dashboard_ports"), "{b}");
    }
    let admin = rm.handle.admin_token().to_string();
    let named = format!("127.0.0.1:{}", free_port());
    let (s, b, _) = rm.submit_as(&admin, SPEC, json!({"dashboardListen": named})).await;
    assert_eq!(s, StatusCode::ACCEPTED, "the admin may name a port: {b}");
    rm.handle.shutdown().await;
    let port = free_port();
    let ranged = rm_with(|o| o.limits.dashboard_ports = PortSet::range(port, port)).await;
    let (s, b, _) = ranged
        .submit_as(
            &ranged.alice,
            SPEC,
            json!({"dashboardListen": format!("127.0.0.1:{port}")}),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "a port of rm.dashboard_ports: {b}");
    let (s, b, _) = ranged
        .submit_as(
            &ranged.alice,
            SPEC,
            json!({"dashboardListen": format!("127.0.0.1:{}", port.wrapping_add(1).max(1024))}),
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "a port outside rm.dashboard_ports: {b}");
    ranged.handle.shutdown().await;
    let open = rm_with(|o| o.limits.allow_public_dashboards = true).await;
    let (s, b, _) = open
        .submit_as(&open.alice, SPEC, json!({"dashboardListen": "0.0.0.0:0"}))
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "allowed by the operator: {b}");
    open.handle.shutdown().await;
}

#[tokio::test]
async fn limits_refuse_with_429_naming_the_setting() {
    let rm = rm_with(|o| {
        o.limits.max_apps_per_user = 2;
        o.limits.max_apps = 3;
        o.limits.max_asks_per_allocate = 10;
    })
    .await;
    let admin = rm.handle.admin_token().to_string();
    let mut alices = Vec::new();
    for _ in 0..2 {
        let (s, b, id) = rm.submit_as(&rm.alice, SPEC, json!({})).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{b}");
        alices.push(id);
    }
    let (s, b, _) = rm.submit_as(&rm.alice, SPEC, json!({})).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{b}");
    assert!(b["message"].as_str().unwrap().contains("rm.max_apps_per_user"), "{b}");
    let (s, b, _) = rm.submit_as(&rm.bob, SPEC, json!({})).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    let (s, b, _) = rm.submit_as(&rm.bob, SPEC, json!({})).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{b}");
    assert!(b["message"].as_str().unwrap().contains("rm.max_apps` is 3"), "{b}");
    // A finished application no longer counts.
    let (s, _) = rm
        .json(
            "PUT",
            &format!("/ws/v1/cluster/apps/{}/state", alices[0]),
            Some(&admin),
            json!({"state": "KILLED"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let (s, b, _) = rm.submit_as(&rm.alice, SPEC, json!({})).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");

    // Asks per allocate.
    let (id, token) = rm.app("asks").await;
    let asks: Vec<Value> = (0..11).map(|i| ask(i, "n1", json!(1), json!(1), "0x0", "")).collect();
    let (s, b) = rm
        .json(
            "POST",
            &format!("/ws/v1/am/{id}/allocate"),
            Some(&token),
            json!({"responseId": 0, "asks": asks}),
        )
        .await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{b}");
    assert!(
        b["message"].as_str().unwrap().contains("rm.max_asks_per_allocate"),
        "{b}"
    );
    assert!(rm.handle.ledger_all_free(), "nothing granted");
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn zero_size_asks_are_refused_and_grants_keep_usage_exact() {
    let rm = rm().await;
    let (id, token) = rm.app("zero").await;
    let alloc = format!("/ws/v1/am/{id}/allocate");
    // The measured attack: asks of no CPU and no memory, granted without limit before.
    let zero: Vec<Value> = (0..100).map(|i| ask(i, "n1", json!(0), json!(0), "0x0", "")).collect();
    let (s, out) = rm
        .json("POST", &alloc, Some(&token), json!({"responseId": 0, "asks": zero}))
        .await;
    assert_eq!(s, StatusCode::OK, "{out}");
    assert_eq!(out["allocated"].as_array().unwrap().len(), 0, "{out}");
    let rejected = out["rejected"].as_array().unwrap();
    assert_eq!(rejected.len(), 100);
    assert!(rejected
        .iter()
        .all(|r| r["retryable"] == false && r["reason"].as_str().unwrap().contains("some CPU or memory")));
    // Many small grants on one node: usage kept incrementally equals the recount.
    let small: Vec<Value> = (0..2000)
        .map(|i| ask(1000 + i, "n2", json!(0), json!(1), "0x0", ""))
        .collect();
    let (s, out) = rm
        .json("POST", &alloc, Some(&token), json!({"responseId": 1, "asks": small}))
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(out["allocated"].as_array().unwrap().len(), 2000);
    assert_eq!(rm.handle.audit_usage(), Ok(()));
    let n2 = rm
        .handle
        .nodes_snapshot()
        .into_iter()
        .find(|(n, _)| n.host == "n2")
        .unwrap();
    assert_eq!((n2.0.used().memory_mb, n2.1), (2000, 2000));
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn a_container_log_is_kept_within_its_limit_and_says_so() {
    let rm = rm_with(|o| o.max_log_bytes = Some(64 * 1024)).await;
    let (_, _, a) = rm.submit_as(&rm.alice, SPEC, json!({})).await;
    // The measured attack wrote 1 GiB in 10 s; this one writes 8 MiB and ends.
    let (logs, token) = rm
        .running_container(&a, "head -c 8388608 /dev/zero | tr '\\0' x; echo; echo END-OF-OUTPUT")
        .await;
    let status = logs.replace("/logs", "/status");
    poll(Duration::from_secs(20), "the container to end", || async {
        let (s, b) = rm.call("GET", &status, Some(&token), None).await;
        (s == StatusCode::OK && b["state"] == "COMPLETE").then_some(())
    })
    .await;
    let (s, b) = rm.call("GET", &logs, Some(&rm.alice), None).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let text = b.as_str().unwrap_or("").to_string();
    assert!(text.trim_end().ends_with("END-OF-OUTPUT"), "the newest output is kept");
    assert!(text.len() <= 64 * 1024, "the log holds {} bytes", text.len());
    assert!(
        text.starts_with("[gpuam] log truncated: "),
        "{}",
        &text[..text.len().min(120)]
    );
    assert!(text.contains("node.max_log_bytes = 65536"));
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn half_sent_requests_are_cut_after_the_read_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rm = rm_with(|o| o.http_timeouts.read = Duration::from_secs(1)).await;
    let addr = rm.handle.addr();
    // Headers that never end, and a connection that says nothing: both cut.
    for first in ["POST /ws/v1/cluster/apps HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ", ""] {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(first.as_bytes()).await.unwrap();
        let mut buf = Vec::new();
        // Bounded: a server that never cuts fails this test instead of hanging it.
        let read = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut buf)).await;
        assert!(read.is_ok(), "the RM kept a half-sent request ({first:?}) open");
    }
    // A body that stops halfway: 408 naming the setting.
    let (status, _, body) = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST /ws/v1/cluster/apps HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nAuthorization: Bearer {}\r\nContent-Length: 1000\r\n\r\n{{\"applicationId\"",
            rm.alice
        );
        s.write_all(head.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out))
            .await
            .expect("an answer")
            .unwrap();
        let text = String::from_utf8_lossy(&out).to_string();
        let status: u16 = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        (status, (), text)
    }
    .await;
    assert_eq!(status, 408, "{body}");
    assert!(body.contains("http.read_timeout_sec"), "{body}");
    // The RM still serves.
    assert!(rm.listed(&rm.alice).await.is_empty());
    rm.handle.shutdown().await;
}

/// p50 and p99 of `ms` (sorted in place).
fn p50_p99(ms: &mut [f64]) -> (f64, f64) {
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_idle_connections_from_one_peer_leaves_the_status_api_answering() {
    flood_of_idle_connections(false).await;
}

/// Under TLS the caps count a connection from its TCP accept, before its handshake: a
/// peer opening connections that never send a ClientHello holds its cap, no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_connections_that_never_handshake_leaves_the_tls_status_api_answering() {
    flood_of_idle_connections(true).await;
}

/// FLOOD idle connections from 127.0.0.2 (sending nothing: no request, no ClientHello)
/// against an RM capped at CAP per peer, plain or TLS: exactly the connections past the
/// cap are closed at once, the others held (the read timeout is long), and status calls
/// from 127.0.0.1 on fresh connections keep answering (p50/p99 printed, idle and flooded).
async fn flood_of_idle_connections(tls: bool) {
    const CAP: usize = 16;
    const FLOOD: usize = 200;
    let pki = tempfile::tempdir().unwrap();
    common::write_test_pki(pki.path(), &["127.0.0.1"]);
    let rm = rm_with(|o| {
        o.http_timeouts.max_connections_per_peer = CAP;
        // Admitted idle connections stay (handshakes and headers wait this long): what
        // the RM closes during the test it closed for the cap.
        o.http_timeouts.read = Duration::from_secs(300);
        if tls {
            o.tls = Some(
                gpuam::tls::server_config(&pki.path().join("server.pem"), &pki.path().join("server.key")).unwrap(),
            );
        }
    })
    .await;
    let addr = rm.handle.addr();
    let base = rm.handle.base_url();
    let ca = pki.path().join("ca.pem");
    let status = |http: reqwest::Client| {
        let url = format!("{base}/ws/v1/cluster/info");
        async move {
            let t = std::time::Instant::now();
            let ok = http.get(url).send().await.is_ok_and(|r| r.status().is_success());
            (ok, t.elapsed().as_secs_f64() * 1000.0)
        }
    };
    // Fresh connections each call (no pool), as a new client would.
    let fresh = || {
        gpuam::tls::http_client_builder(tls.then_some(ca.as_path()))
            .unwrap()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap()
    };
    let mut idle = Vec::new();
    for _ in 0..50 {
        let (ok, ms) = status(fresh()).await;
        assert!(ok, "status before the flood");
        idle.push(ms);
    }
    // The flood: FLOOD idle connections from 127.0.0.2, sending nothing, kept open.
    let mut flood = Vec::new();
    for _ in 0..FLOOD {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        if let Ok(s) = sock.connect(addr).await {
            flood.push(s);
        }
    }
    assert_eq!(
        flood.len(),
        FLOOD,
        "the flood's connections were accepted by the kernel"
    );
    // Connections past the cap are closed by the RM as it accepts them (reading one gives
    // EOF); the CAP admitted ones stay open. Read all at once, each for 5 s at most.
    let reads = flood.into_iter().map(|mut s| {
        tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let mut b = [0u8; 1];
            let closed = matches!(
                tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await,
                Ok(Ok(0) | Err(_))
            );
            (closed, s)
        })
    });
    let mut flood = Vec::new();
    let mut closed = 0;
    for r in futures::future::join_all(reads).await {
        let (c, s) = r.unwrap();
        closed += usize::from(c);
        flood.push(s);
    }
    assert_eq!(
        closed,
        FLOOD - CAP,
        "{closed} of {FLOOD} flood connections were closed (cap {CAP}/peer, tls {tls})"
    );
    // Status from 127.0.0.1 keeps answering while the flood's connections stay open.
    let mut during = Vec::new();
    for i in 0..50 {
        let (ok, ms) = status(fresh()).await;
        assert!(ok, "status call {i} during the flood failed");
        during.push(ms);
    }
    let ((i50, i99), (d50, d99)) = (p50_p99(&mut idle), p50_p99(&mut during));
    println!(
        "status /ws/v1/cluster/info over {}, new connection each: idle p50 {i50:.2} ms p99 {i99:.2} ms; \
         with {FLOOD} idle connections from 127.0.0.2 (cap {CAP}/peer, {closed} closed at once): \
         p50 {d50:.2} ms p99 {d99:.2} ms",
        if tls { "HTTPS" } else { "HTTP" }
    );
    drop(flood);
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn bad_input_is_refused_where_it_enters() {
    let rm = rm().await;
    // A NUL in a command (it used to pass, then fail 11 times at launch as "transient").
    let spec = "name: t\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 0}\n    commands: [\"echo \\0 hi\"]\n";
    let (s, b, id) = rm.submit_as(&rm.alice, spec, json!({})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    let msg = b["message"].as_str().unwrap();
    assert!(
        msg.contains("job.yaml:6:") && msg.contains("taskRoles.w.commands[0]") && msg.contains("U+0000"),
        "{msg}"
    );
    assert!(rm.handle.app_report(&id).is_none());
    // Ids that could not have been issued, in URL paths and bodies: 400.
    let alice = rm.alice.clone();
    for (m, p, body) in [
        ("GET", "/ws/v1/cluster/apps/..%2F..".to_string(), None),
        ("GET", "/ws/v1/cluster/apps/application_1_4294967296".to_string(), None),
        (
            "POST",
            "/ws/v1/am/application_1_0/register".to_string(),
            Some(json!({"host": "h", "trackingUrl": ""})),
        ),
        (
            "POST",
            "/ws/v1/cluster/apps".to_string(),
            Some(json!({"applicationId": "../../etc", "jobSpec": SPEC})),
        ),
        (
            "GET",
            "/ws/v1/node/n1/containers/container_1_1_01_99999999999999999999/status".to_string(),
            None,
        ),
    ] {
        let got = match body {
            Some(b) => rm.json(m, &p, Some(&alice), b).await,
            None => rm.call(m, &p, Some(&alice), None).await,
        };
        let msg = error_body(got, StatusCode::BAD_REQUEST);
        assert!(
            msg.contains("not an application id") || msg.contains("not a container id"),
            "{p}: {msg}"
        );
    }
    // Terminal escapes an AM sends are not kept in the diagnostics.
    let (app, token) = rm.app("colours").await;
    let (s, _) = rm
        .json(
            "POST",
            &format!("/ws/v1/am/{app}/finish"),
            Some(&token),
            json!({"finalStatus": "FAILED", "exitCode": 1, "diagnostics": "\u{1b}[1;31mtask failed\u{1b}[0m\u{7}"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(rm.handle.app_report(&app).unwrap().diagnostics, "task failed");
    // The AM protocol takes the scheme in lower case too.
    let (app2, token2) = rm.handle.register_test_app("lower");
    let r = rm
        .http
        .post(format!("{}/ws/v1/am/{app2}/register", rm.handle.base_url()))
        .header("authorization", format!("bearer {token2}"))
        .json(&json!({"host": "h", "trackingUrl": ""}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    rm.handle.shutdown().await;
}

// ---- durable before acknowledged; damaged state (real `gpuam rm` processes, root) ----

/// Files made immutable (`chattr +i`, e2fsprogs): writes fail even through descriptors the
/// RM already has open, as on a read-only or failing disk. Cleared when dropped (also when
/// the test fails).
struct Immutable(Vec<std::path::PathBuf>);

impl Immutable {
    fn set(paths: &[std::path::PathBuf]) -> Immutable {
        let guard = Immutable(paths.to_vec());
        for p in paths {
            let status = std::process::Command::new("chattr")
                .arg("+i")
                .arg(p)
                .status()
                .expect("chattr (e2fsprogs) runs: .ci/run installs it");
            assert!(
                status.success(),
                "chattr +i {} failed: this test needs root and a file system with immutable files",
                p.display()
            );
        }
        guard
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::process::Command::new("chattr").arg("-i").arg(p).status();
        }
    }
}

/// One raw HTTP/1.1 request to `host_port`: (status, header block lower-cased, body).
fn raw_sync(host_port: &str, head: &str, body: &str) -> (u16, String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(host_port).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let req = format!(
        "{head}Host: {host_port}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).to_string();
    let (h, b) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = h.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, h.to_ascii_lowercase(), b.to_string())
}

const TWO_BY_TWO: &str = common::TWO_NODES_TWO_GPUS;

/// A job of two one-GPU tasks that append `start <container id>` to `<name>-<index>.runs`,
/// wait for the file `go`, then append `end`.
fn recording_job(rm: &common::Rm, name: &str) -> std::path::PathBuf {
    let root = rm.root().display().to_string();
    let script = format!(
        "echo \"start $GPUAM_CONTAINER_ID\" >> {root}/{name}-$GPUAM_TASK_INDEX.runs; \
         while [ ! -f {root}/go ]; do sleep 0.05; done; echo end >> {root}/{name}-$GPUAM_TASK_INDEX.runs"
    );
    rm.write_job(
        name,
        &format!(
            "name: {name}\ntaskRoles:\n  w:\n    instances: 2\n    resourcePerInstance: {{cpu: 1, memoryMB: 10, gpu: 1}}\n    commands:\n      - {}\n",
            common::sq(&script)
        ),
    )
}

/// The container ids a task recorded, one per run.
fn runs(rm: &common::Rm, file: &str) -> Vec<String> {
    rm.lines(file)
        .iter()
        .filter_map(|l| l.strip_prefix("start ").map(str::to_string))
        .collect()
}

/// The store fault: writes fail mid-run. The RM answers 503 (with Retry-After) to every
/// state change and grants nothing; when writes work again it writes its whole state and
/// goes on; when it dies while they fail, the restarted RM has lost nothing it
/// acknowledged: no task runs twice and no container id is handed out again.
#[test]
fn a_failing_store_gets_503_grants_nothing_and_loses_nothing() {
    let mut rm = common::Rm::start(TWO_BY_TWO, &[]);
    let host_port = rm.url.trim_start_matches("http://").to_string();
    let (db, wal) = (rm.work_dir.join("rm-state.db"), rm.work_dir.join("rm-state.db-wal"));
    let a = rm.submit(&recording_job(&rm, "a"));
    common::wait_for(Duration::from_secs(30), "job a's two tasks", || {
        (runs(&rm, "a-0.runs").len() == 1 && runs(&rm, "a-1.runs").len() == 1).then_some(())
    });
    let held = rm.nodes();

    // 1. Writes fail: every change is refused with 503 and Retry-After; nothing is granted.
    let broken = Immutable::set(&[db.clone(), wal.clone()]);
    let (s, head, body) = raw_sync(
        &host_port,
        &format!(
            "POST /ws/v1/cluster/apps/new-application HTTP/1.1\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\n",
            rm.user_token
        ),
        "{}",
    );
    assert_eq!(s, 503, "{head}\n{body}");
    assert!(head.contains("retry-after: 1"), "{head}");
    assert!(body.contains("STATE_STORE_UNAVAILABLE"), "{body}");
    let info = rm.get_json("/ws/v1/cluster/info").unwrap();
    let failing = info["clusterInfo"]["rmStateStoreFailing"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(!failing.is_empty(), "the failure is shown: {info}");
    assert!(
        info["clusterInfo"]["rmStateStoreWriteErrors"].as_u64().unwrap() >= 1,
        "{info}"
    );
    // A whole job submitted meanwhile: refused, said so, nothing started.
    let out = rm.run_job(&recording_job(&rm, "refused"), Duration::from_secs(60));
    assert_eq!(out.code, 69, "503 is `unavailable` (exit 69): {out:?}");
    assert!(out.stderr.contains("503"), "{out:?}");
    // The running job's heartbeats are refused too, and nothing is granted.
    common::wait_for(Duration::from_secs(20), "job a's AM to see 503", || {
        rm.logs().contains("the RM refused allocate (503)").then_some(())
    });
    assert_eq!(rm.nodes(), held, "nothing granted or freed while the store fails");
    assert!(rm.lines("refused-0.runs").is_empty() && rm.lines("refused-1.runs").is_empty());
    assert!(
        fs::read_to_string(rm.path("rm.stderr"))
            .unwrap()
            .contains("the RM's state could not be saved"),
        "logged"
    );

    // 2. Writes work again: the whole state is written once and the RM grants again.
    drop(broken);
    common::wait_for(Duration::from_secs(20), "the store to recover", || {
        let info = rm.get_json("/ws/v1/cluster/info").ok()?;
        let c = &info["clusterInfo"];
        (c["rmStateStoreFailing"].is_null() && c["rmStateStoreRecoveries"].as_u64() >= Some(1)).then_some(())
    });
    assert!(fs::read_to_string(rm.path("rm.stderr"))
        .unwrap()
        .contains("the whole state was written"));
    let b = rm.submit(&recording_job(&rm, "b"));
    common::wait_for(Duration::from_secs(30), "job b's two tasks", || {
        (runs(&rm, "b-0.runs").len() == 1 && runs(&rm, "b-1.runs").len() == 1).then_some(())
    });

    // 3. Writes fail again and the RM is SIGKILLed; it restarts on a working store.
    let broken = Immutable::set(&[db.clone(), wal.clone()]);
    common::wait_for(Duration::from_secs(20), "a write to fail", || {
        let info = rm.get_json("/ws/v1/cluster/info").ok()?;
        info["clusterInfo"]["rmStateStoreFailing"].is_string().then_some(())
    });
    rm.kill_hard();
    drop(broken);
    rm.restart();
    fs::write(rm.path("go"), "").unwrap();
    for (name, sub) in [("a", a), ("b", b)] {
        let out = sub.wait(Duration::from_secs(60));
        assert_eq!(out.code, 0, "job {name}: {out:?}\n{}", rm.logs());
    }

    // No task ran twice; no container id was handed out twice.
    let mut ids = Vec::new();
    for f in ["a-0.runs", "a-1.runs", "b-0.runs", "b-1.runs"] {
        let r = runs(&rm, f);
        assert_eq!(r.len(), 1, "{f} ran {r:?}");
        assert_eq!(rm.lines(f).iter().filter(|l| *l == "end").count(), 1, "{f}");
        ids.extend(r);
    }
    let c = rm.run_job(&recording_job(&rm, "c"), Duration::from_secs(60));
    assert_eq!(c.code, 0, "{c:?}");
    let seq = |id: &str| -> u64 { id.rsplit('_').next().unwrap().parse().unwrap() };
    let before = ids.iter().map(|i| seq(i)).max().unwrap();
    for f in ["c-0.runs", "c-1.runs"] {
        for id in runs(&rm, f) {
            assert!(
                !ids.contains(&id) && seq(&id) > before,
                "{id} re-used (before: {ids:?})"
            );
            ids.push(id);
        }
    }
    let unique: std::collections::BTreeSet<&String> = ids.iter().collect();
    assert_eq!(unique.len(), ids.len(), "{ids:?}");
    rm.assert_all_free(Duration::from_secs(20));
}

/// Runs `cmd` (a `gpuam rm` that should refuse to start) to its exit: (code, stderr).
fn refused_start(mut cmd: std::process::Command) -> (i32, String) {
    let mut child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = common::wait_for(Duration::from_secs(30), "`gpuam rm` to exit", || {
        child.try_wait().unwrap()
    });
    let mut err = String::new();
    use std::io::Read;
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (status.code().unwrap_or(-1), err)
}

/// Damaged state is refused at start with the file and the problem (exit 65);
/// `--recover-state` starts anyway and says what it dropped; a locked, damaged `-shm`
/// cannot bring the RM down.
#[test]
fn damaged_state_is_refused_and_recovery_says_what_it_drops() {
    let mut rm = common::Rm::start(TWO_BY_TWO, &[]);
    let job = rm.write_job(
        "quick",
        "name: quick\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 1}\n    commands: [\"true\"]\n",
    );
    let first = rm.run_job(&job, Duration::from_secs(60));
    assert_eq!(first.code, 0, "{first:?}");
    let app = first
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("submitted job `quick` as "))
        .unwrap()
        .to_string();
    rm.kill_hard();
    let db = rm.work_dir.join("rm-state.db");
    let sql = |statement: &str| {
        let conn = rusqlite::Connection::open(&db).unwrap();
        conn.execute_batch(statement).unwrap();
    };
    let listen = format!("127.0.0.1:{}", rm.port());

    // A missing meta row (the id counters): refused, naming the file and the problem.
    sql("DELETE FROM meta WHERE key = 'state';");
    let (code, err) = refused_start(rm.rm_command(&listen));
    assert_eq!(code, 65, "{err}");
    assert!(
        err.contains(&db.display().to_string()) && err.contains("no `state` row"),
        "{err}"
    );
    assert!(err.contains("--recover-state"), "says how to go on: {err}");
    // A missing containers table too: refused (before: an RM with no grants).
    sql("DROP TABLE containers;");
    let (code, err) = refused_start(rm.rm_command(&listen));
    assert_eq!(code, 65, "{err}");
    assert!(err.contains("table `containers`: missing"), "{err}");

    // --recover-state: starts, and says what it repaired and dropped.
    let mut recovering = rm.rm_command(&listen);
    recovering
        .arg("--recover-state")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = recovering.spawn().unwrap();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut said = String::new();
    common::wait_for(Duration::from_secs(30), "the recovery notes", || {
        use std::io::BufRead;
        let mut line = String::new();
        err.read_line(&mut line).ok()?;
        said.push_str(&line);
        (said.contains("`containers` was missing") && said.contains("rebuilt")).then_some(())
    });
    assert!(said.contains("grant"), "says what the dropped table held: {said}");
    // It serves what it kept: the finished application.
    let a = common::wait_for(Duration::from_secs(20), "the recovered RM to answer", || {
        rm.try_app(&app)
    });
    assert_eq!(a["state"], "FINISHED", "{a}");
    unsafe {
        libc::kill(child.id() as i32, libc::SIGKILL);
    }
    let _ = child.wait();

    // A damaged and immutable shared-memory file: the RM does not use it (exclusive
    // locking), so it neither dies (SIGBUS) nor refuses.
    let shm = rm.work_dir.join("rm-state.db-shm");
    fs::write(&shm, b"\xde\xad\xbe\xef not a wal-index").unwrap();
    let _locked = Immutable::set(std::slice::from_ref(&shm));
    rm.restart();
    let out = rm.run_job(&job, Duration::from_secs(60));
    assert_eq!(out.code, 0, "a job runs beside a damaged -shm: {out:?}\n{}", rm.logs());
    assert!(rm.try_exited().is_none(), "the RM is still up");
}

/// The CLI side of credentials: `gpuam token new` hands a token out once and stores only
/// its digest (0600); a running RM takes a new user without a restart; `gpuam submit`
/// without a token exits 77 saying how to get one; with `--token-file` the job runs as
/// that user.
#[test]
fn the_cli_makes_tokens_and_says_how_to_get_one() {
    use std::os::unix::fs::PermissionsExt;
    let rm = common::Rm::start(TWO_BY_TWO, &[]);
    let users = rm.path(common::USERS_FILE);
    let out = rm
        .gpuam()
        .args(["token", "new", "--user", "carol", "--users-file"])
        .arg(&users)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let token = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(token.len(), 64, "one token on stdout: {token}");
    let file = fs::read_to_string(&users).unwrap();
    assert!(!file.contains(&token) && file.contains("carol:"), "{file}");
    assert_eq!(fs::metadata(&users).unwrap().permissions().mode() & 0o777, 0o600);
    let bad = rm
        .gpuam()
        .args(["token", "new", "--user", "admin", "--users-file"])
        .arg(&users)
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(64), "{bad:?}");

    // The running RM picks carol up (file watch), no restart.
    common::wait_for(Duration::from_secs(10), "the RM to load carol", || {
        (rm.request("GET", "/ws/v1/cluster/apps", Some(&token), None).0 == 200).then_some(())
    });

    let job = rm.write_job(
        "mine",
        "name: mine\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {cpu: 1, memoryMB: 10, gpu: 0}\n    commands: [\"true\"]\n",
    );
    // No token at all: 77, the RM's 401 and the CLI's hint.
    let out = rm
        .gpuam()
        .env_remove("GPUAM_TOKEN")
        .args(["submit", job.to_str().unwrap(), "--rm", &rm.url, "--wait"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(77), "{err}");
    assert!(err.contains("(401)") && err.contains("gpuam token new"), "{err}");
    assert!(err.contains("--token-file") && err.contains("GPUAM_TOKEN"), "{err}");
    // --token-file: the job runs as carol.
    let token_file = rm.path("carol.token");
    fs::write(&token_file, format!("{token}\n")).unwrap();
    let out = rm
        .gpuam()
        .env_remove("GPUAM_TOKEN")
        .args([
            "submit",
            job.to_str().unwrap(),
            "--rm",
            &rm.url,
            "--wait",
            "--token-file",
        ])
        .arg(&token_file)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let app = stdout
        .lines()
        .find_map(|l| l.strip_prefix("submitted job `mine` as "))
        .unwrap()
        .to_string();
    let (s, v) = rm.request("GET", &format!("/ws/v1/cluster/apps/{app}"), Some(&token), None);
    assert_eq!((s, v["app"]["user"].as_str()), (200, Some("carol")), "{v}");
    // Another user does not see it.
    let (s, _) = rm.request(
        "GET",
        &format!("/ws/v1/cluster/apps/{app}"),
        Some(&rm.other_token),
        None,
    );
    assert_eq!(s, 403);
    // `gpuam plan --rm` takes the token too.
    let out = rm
        .gpuam()
        .env_remove("GPUAM_TOKEN")
        .args(["plan", job.to_str().unwrap(), "--rm", &rm.url, "--token-file"])
        .arg(&token_file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}

/// An application id belongs to the user who reserved it: another user's submit of it is
/// refused (403) and leaves it to its owner, who can still submit it.
#[tokio::test]
async fn a_reserved_application_id_is_submitted_only_by_who_reserved_it() {
    let rm = rm().await;
    let (s, new) = rm
        .json(
            "POST",
            "/ws/v1/cluster/apps/new-application",
            Some(&rm.alice),
            json!({}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{new}");
    let id = new["applicationId"].as_str().unwrap().to_string();
    let body = json!({"applicationId": id, "jobSpec": SPEC});
    let msg = error_body(
        rm.json("POST", "/ws/v1/cluster/apps", Some(&rm.bob), body.clone())
            .await,
        StatusCode::FORBIDDEN,
    );
    assert!(msg.contains("another user"), "{msg}");
    let (s, out) = rm.json("POST", "/ws/v1/cluster/apps", Some(&rm.alice), body).await;
    assert!(s.is_success(), "{out}");
    assert_eq!(rm.listed(&rm.alice).await, vec![id.clone()]);
    assert!(rm.listed(&rm.bob).await.is_empty());
}

/// Audit 5 F4: idle connections held open from four loopback addresses (127.0.0.2–.5,
/// as any local user can bind) no longer deny the RM. All of loopback is one source, so
/// the flood holds that source's share of the general pool and no more (the rest are
/// closed at once); a user on 127.0.0.1 (this host: reserved) and a node agent whose
/// registration came from 127.0.0.9 (a live agent's address: reserved) still get in,
/// its heartbeat and its re-registration on fresh connections succeed, and a newcomer
/// from another loopback address is refused (the flood's source is full). Before the
/// mend the flood filled the whole listener (160 > 96) and every call failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_from_four_loopback_addresses_leaves_users_and_agents_a_way_in() {
    const TOTAL: usize = 96;
    const PER_ADDRESS: usize = 40;
    let dir = tempfile::tempdir().unwrap();
    let nodes_file = dir.path().join("nodes.yaml");
    let token = gpuam::users::add_token_to(&nodes_file, "a9", gpuam::users::Table::Nodes).unwrap();
    let rm = rm_with(|o| {
        o.nodes_file = Some(nodes_file.clone());
        // A small general pool (the flood's file descriptors stay few); the per-source
        // and reserved caps are the defaults.
        o.http_timeouts.max_connections = TOTAL;
        o.http_timeouts.read = Duration::from_secs(300);
    })
    .await;
    let per_source = gpuam::config::MAX_CONNECTIONS_PER_SOURCE;
    let addr = rm.handle.addr();
    let base = rm.handle.base_url();
    // Fresh connections each call, from `from`.
    let client = |from: &str| {
        gpuam::tls::http_client_builder(None)
            .unwrap()
            .pool_max_idle_per_host(0)
            .local_address(Some(from.parse().unwrap()))
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap()
    };
    let agent = client("127.0.0.9");
    let registration = json!({
        "host": "a9", "rack": "/r",
        "total": {"cpu": 4, "memoryMB": 1000, "gpus": 0, "gpuMask": 0, "ports": ""},
        "httpAddress": "http://127.0.0.9:9", "containers": [],
    });
    let register = || {
        agent
            .post(format!("{base}/ws/v1/node-agents/register"))
            .bearer_auth(&token)
            .json(&registration)
            .send()
    };
    let heartbeat = || {
        agent
            .post(format!("{base}/ws/v1/node-agents/a9/heartbeat"))
            .bearer_auth(&token)
            .json(&json!({"containers": []}))
            .send()
    };
    let r = register().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);

    // The flood: PER_ADDRESS idle connections from each of 127.0.0.2–.5, sending nothing.
    let mut flood = Vec::new();
    for i in 0..4 * PER_ADDRESS {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(format!("127.0.0.{}:0", 2 + i % 4).parse().unwrap()).unwrap();
        flood.push(sock.connect(addr).await.expect("the kernel accepts the connection"));
    }
    // The RM closes those past the loopback source's share as it accepts them (reading
    // one gives EOF or a reset); the admitted ones stay open. Each read waits 10 s at most.
    let reads = flood.into_iter().map(|mut s| {
        tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let mut b = [0u8; 1];
            let closed = matches!(
                tokio::time::timeout(Duration::from_secs(10), s.read(&mut b)).await,
                Ok(Ok(0) | Err(_))
            );
            (closed, s)
        })
    });
    let mut held = Vec::new();
    for r in futures::future::join_all(reads).await {
        let (closed, s) = r.unwrap();
        if !closed {
            held.push(s);
        }
    }
    assert_eq!(
        held.len(),
        per_source,
        "the flood from four loopback addresses holds one source's share"
    );

    // A user on this host gets in.
    let r = client("127.0.0.1")
        .get(format!("{base}/ws/v1/cluster/info"))
        .bearer_auth(&rm.bob)
        .send()
        .await
        .expect("a user's call during the flood");
    assert!(r.status().is_success(), "{r:?}");
    // The agent's heartbeat and re-registration (as after an agent restart) get in.
    for _ in 0..3 {
        let r = heartbeat().await.expect("an agent heartbeat during the flood");
        assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
        let r = register().await.expect("an agent registration during the flood");
        assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
    }
    // A newcomer from the flood's source (another loopback address) is refused.
    let refused = client("127.0.0.7")
        .get(format!("{base}/ws/v1/cluster/info"))
        .send()
        .await;
    assert!(refused.is_err(), "the loopback source's share is full: {refused:?}");

    drop(held);
    rm.handle.shutdown().await;
}

/// Twelfth pass: a tenant's task on the RM's host (its own uid) held every place of
/// 127.0.0.1 (276 idle connections), and the host's users, AMs and a restarted agent were
/// refused. Now each local user holds its own share: a flood of 300 connections from
/// 127.0.0.1 by another user (`nobody`) fills that user's places only (a fresh
/// connection of its own is closed unanswered), and this process's calls from 127.0.0.1
/// on fresh connections are still answered. Root only (a process of another uid); CI runs
/// as root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_from_another_local_user_leaves_this_hosts_own_places() {
    if !nix::unistd::geteuid().is_root() {
        return;
    }
    let rm = rm_with(|o| {
        // Admitted idle connections stay for the test's length.
        o.http_timeouts.read = Duration::from_secs(300);
    })
    .await;
    let port = rm.handle.addr().port();
    let base = rm.handle.base_url();
    let ask_once = format!(
        "exec 3<>/dev/tcp/127.0.0.1/{port} && printf 'GET /ws/v1/cluster/info HTTP/1.0\\r\\n\\r\\n' >&3 && timeout 30 cat <&3"
    );
    let as_nobody = |script: String| {
        use std::os::unix::process::CommandExt as _;
        let mut c = std::process::Command::new("bash");
        c.args(["-c", &script])
            .uid(65534)
            .gid(65534)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null());
        c
    };
    // The flood: 300 connections opened and held (bash keeps their descriptors) until its
    // stdin closes; it says when all are open.
    // Before the flood the other user is answered (so an empty answer below is a refusal).
    let before = as_nobody(ask_once.clone()).output().unwrap();
    assert!(
        String::from_utf8_lossy(&before.stdout).starts_with("HTTP/1."),
        "nobody's request before the flood: {before:?}"
    );
    let mut flood = tokio::process::Command::from(as_nobody(format!(
        "for i in $(seq 1 300); do exec {{fd}}<>/dev/tcp/127.0.0.1/{port} || true; done; echo opened; read -t 240 x"
    )))
    .kill_on_drop(true)
    .spawn()
    .expect("bash as nobody");
    let mut out = tokio::io::BufReader::new(flood.stdout.take().unwrap());
    let mut line = String::new();
    tokio::time::timeout(
        Duration::from_secs(120),
        tokio::io::AsyncBufReadExt::read_line(&mut out, &mut line),
    )
    .await
    .expect("the flood opened its connections")
    .unwrap();
    assert_eq!(line.trim(), "opened");
    // Its user's places are full: one more connection of its own is closed unanswered.
    let one_more = as_nobody(ask_once).output().unwrap();
    assert!(
        one_more.stdout.is_empty(),
        "the flooding user got another place: {}",
        String::from_utf8_lossy(&one_more.stdout)
    );
    // This host's own calls (this process's user) get in, each on a fresh connection.
    let http = gpuam::tls::http_client_builder(None)
        .unwrap()
        .pool_max_idle_per_host(0)
        .local_address(Some("127.0.0.1".parse().unwrap()))
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    for _ in 0..5 {
        let r = http
            .get(format!("{base}/ws/v1/cluster/info"))
            .bearer_auth(&rm.bob)
            .send()
            .await
            .expect("a call of this host's own user during the flood");
        assert!(r.status().is_success(), "{r:?}");
    }
    drop(flood.stdin.take());
    let _ = tokio::time::timeout(Duration::from_secs(30), flood.wait()).await;
    rm.handle.shutdown().await;
}
