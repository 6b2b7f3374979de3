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
            .json("POST", "/ws/v1/cluster/apps/new-application", Some(&rm.alice), json!({}))
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
        ("POST", "/ws/v1/cluster/apps", Some(&rm.alice), b"{\"applicationId\": 5}"),
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
            .json("POST", "/ws/v1/cluster/apps/new-application", Some(&rm.alice), json!({}))
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
    // The task swaps its stdout for a link to a secret (and its stderr for /etc/passwd).
    let cmd = format!(
        "rm -f stdout stderr; ln -s {} stdout; ln -s /etc/passwd stderr; touch swapped; sleep 30",
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
        dir.join("swapped").exists().then_some(())
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

/// A test CA and a server certificate for 127.0.0.1/localhost signed by it, written
/// into `dir` as `ca.pem`, `server.pem` and `server.key`; also `other-ca.pem`, a CA that
/// signed nothing here.
fn write_test_pki(dir: &std::path::Path) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
    let ca = |name: &str| {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).unwrap();
        (cert, Issuer::new(params, key))
    };
    let (ca_cert, issuer) = ca("gpuam test CA");
    let (other_ca, _) = ca("gpuam other CA");
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, "gpuam test server");
    let cert = params.signed_by(&key, &issuer).unwrap();
    fs::write(dir.join("ca.pem"), ca_cert.pem()).unwrap();
    fs::write(dir.join("other-ca.pem"), other_ca.pem()).unwrap();
    fs::write(dir.join("server.pem"), cert.pem()).unwrap();
    fs::write(dir.join("server.key"), key.serialize_pem()).unwrap();
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
    write_test_pki(dir.path());
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
        .get_text(&format!("{tracking}api/v1/job"))
        .expect("the dashboard answers HTTPS trusting the CA");
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
