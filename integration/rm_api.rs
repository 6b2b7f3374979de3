//! End-to-end tests of the RM's REST API over loopback HTTP: node listing, metrics,
//! applications, the AM protocol (register / allocate / finish) with its conflict
//! rules and idempotent retries, the executor endpoints' routing and auth, and the
//! error bodies. AM launch is off: the tests speak the AM protocol themselves.

use std::time::Duration;

use gpuam::cluster::rm_json::parse_nodes_json;
use gpuam::cluster::{Node, NodeState};
use gpuam::protocol::{
    AllocateRequest, AllocateResponse, AmCommand, AppState, Ask, ErrorBody, FinalStatus, FinishRequest, LaunchContext,
    NewApplication, RegisterRequest, RegisterResponse,
};
use gpuam::resources::{PortSet, Resources};
use gpuam::rm::{start, RmHandle, RmOptions};
use reqwest::StatusCode;
use serde_json::{json, Value};

struct Rm {
    handle: RmHandle,
    http: reqwest::Client,
    base: String,
    expiry_secs: u64,
    _dir: tempfile::TempDir,
}

fn nodes() -> Vec<Node> {
    let mut n1 = Node::new(
        "n1",
        "/rack-a",
        Resources::with_mask(16, 65_536, 0xf, PortSet::parse("20000-20099").unwrap()),
    );
    n1.labels = vec!["gpu".into()];
    n1.gpu_type = Some("V100".into());
    let n2 = Node::new(
        "n2",
        "/rack-b",
        Resources::with_mask(8, 32_768, 0, PortSet::parse("20000-20099").unwrap()),
    );
    vec![n1, n2]
}

async fn rm_with_expiry(expiry: Duration) -> Rm {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = RmOptions::new(nodes(), "127.0.0.1:0".parse().unwrap(), dir.path().join("work"));
    opts.launch_am = false;
    opts.container_expiry = expiry;
    let handle = start(opts).await.unwrap();
    let base = handle.base_url();
    Rm {
        handle,
        http: gpuam::tls::http_client(),
        base,
        expiry_secs: expiry.as_secs(),
        _dir: dir,
    }
}

async fn rm() -> Rm {
    rm_with_expiry(Duration::from_secs(600)).await
}

fn ask(id: u64, host: &str, mask: u64, ports: &str) -> Ask {
    Ask {
        request_id: id,
        host: host.into(),
        cpu: 1,
        memory_mb: 1024,
        gpu_mask: mask,
        ports: PortSet::parse(ports).unwrap(),
        ..Default::default()
    }
}

/// One app speaking the AM protocol, remembering its responseId.
struct Am {
    id: String,
    token: String,
    response_id: u64,
}

impl Rm {
    fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    async fn am(&self, name: &str) -> Am {
        let (id, token) = self.handle.register_test_app(name);
        let r = self
            .http
            .post(self.url(&format!("/ws/v1/am/{id}/register")))
            .bearer_auth(&token)
            .json(&RegisterRequest {
                host: "localhost".into(),
                tracking_url: format!("http://dash/{name}"),
            })
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let reg: RegisterResponse = r.json().await.unwrap();
        assert_eq!(reg.maximum_capability.cpu, 16);
        assert_eq!(reg.maximum_capability.gpu_mask, 0xf);
        assert_eq!(reg.container_expiry_sec, self.expiry_secs);
        Am {
            id,
            token,
            response_id: 0,
        }
    }

    async fn allocate_raw(&self, am: &Am, req: &AllocateRequest) -> reqwest::Response {
        self.http
            .post(self.url(&format!("/ws/v1/am/{}/allocate", am.id)))
            .bearer_auth(&am.token)
            .json(req)
            .send()
            .await
            .unwrap()
    }

    async fn allocate(&self, am: &mut Am, asks: Vec<Ask>, releases: Vec<String>) -> AllocateResponse {
        let req = AllocateRequest {
            response_id: am.response_id,
            asks,
            releases,
            ..Default::default()
        };
        let r = self.allocate_raw(am, &req).await;
        assert_eq!(r.status(), StatusCode::OK);
        let out: AllocateResponse = r.json().await.unwrap();
        assert_eq!(out.response_id, am.response_id + 1);
        am.response_id = out.response_id;
        out
    }

    async fn finish(&self, am: &Am, status: FinalStatus, code: i32) {
        let r = self
            .http
            .post(self.url(&format!("/ws/v1/am/{}/finish", am.id)))
            .bearer_auth(&am.token)
            .json(&FinishRequest {
                final_status: status,
                exit_code: code,
                diagnostics: "done".into(),
            })
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["isUnregistered"], true);
    }

    /// `GET path` as the admin (application reads need a credential).
    async fn get_json(&self, path: &str) -> (StatusCode, Value) {
        let r = self
            .http
            .get(self.url(path))
            .bearer_auth(self.handle.admin_token())
            .send()
            .await
            .unwrap();
        let s = r.status();
        (s, r.json().await.unwrap())
    }
}

// The handle's test helpers (app_report, ledger_all_free, ...) straight on `Rm`.
impl std::ops::Deref for Rm {
    type Target = RmHandle;
    fn deref(&self) -> &RmHandle {
        &self.handle
    }
}

async fn error_body(r: reqwest::Response, status: StatusCode) -> ErrorBody {
    assert_eq!(r.status(), status);
    r.json().await.unwrap()
}

#[tokio::test]
async fn node_listing_has_yarn_shape_and_round_trips() {
    let rm = rm().await;
    let text = rm
        .http
        .get(rm.url("/ws/v1/cluster/nodes"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let list = v["nodes"]["node"].as_array().unwrap();
    assert_eq!(list.len(), 2);
    assert_eq!(list[0]["id"], "n1:8041");
    assert_eq!(list[0]["nodeHTTPAddress"], rm.base.as_str());
    assert_eq!(list[0]["gpuAttribute"], "0xf");
    assert_eq!(list[0]["availMemoryMB"], 65_536);

    let parsed = parse_nodes_json(&text).unwrap();
    let want = nodes();
    for (p, w) in parsed.iter().zip(&want) {
        assert_eq!(p.host, w.host);
        assert_eq!(p.total(), w.total());
        assert_eq!(p.used(), w.used());
        assert_eq!(
            (&p.labels, &p.rack, p.state, &p.gpu_type),
            (&w.labels, &w.rack, w.state, &w.gpu_type)
        );
        assert_eq!(p.http_address, rm.base);
    }

    let (s, one) = rm.get_json("/ws/v1/cluster/nodes/n2:8041").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(one["node"]["nodeHostName"], "n2");
    assert_eq!(parse_nodes_json(&one.to_string()).unwrap()[0].host, "n2");
    let (s, e) = rm.get_json("/ws/v1/cluster/nodes/nope:8041").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(e["code"], "NOT_FOUND");
    let (_, lost) = rm.get_json("/ws/v1/cluster/nodes?states=LOST").await;
    assert_eq!(parse_nodes_json(&lost.to_string()).unwrap().len(), 0);
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn metrics_and_cluster_info() {
    let rm = rm().await;
    let mut am = rm.am("m").await;
    rm.allocate(&mut am, vec![ask(1, "n1", 0x3, "")], vec![]).await;
    let (s, m) = rm.get_json("/ws/v1/cluster/metrics").await;
    assert_eq!(s, StatusCode::OK);
    let m = &m["clusterMetrics"];
    assert_eq!(m["totalMB"], 65_536 + 32_768);
    assert_eq!(m["allocatedMB"], 1024);
    assert_eq!(m["availableMB"], 65_536 + 32_768 - 1024);
    assert_eq!(m["totalVirtualCores"], 24);
    assert_eq!(m["allocatedVirtualCores"], 1);
    assert_eq!(m["containersAllocated"], 1);
    assert_eq!(m["activeNodes"], 2);
    assert_eq!(m["appsRunning"], 1);
    assert_eq!(m["allocatedGpus"], 2);
    let (s, info) = rm.get_json("/ws/v1/cluster").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(info["clusterInfo"]["haState"], "ACTIVE");
    assert_eq!(info["clusterInfo"]["rmStateStoreName"], "sqlite");
    assert_eq!(info["clusterInfo"]["rmStateStoreWriteErrors"], 0);
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn new_application_and_rejected_submit_leave_no_state() {
    let rm = rm().await;
    let r = rm
        .http
        .post(rm.url("/ws/v1/cluster/apps/new-application"))
        .bearer_auth(rm.handle.admin_token())
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let new: NewApplication = r.json().await.unwrap();
    assert!(new.application_id.starts_with("application_"));
    assert_eq!(new.maximum_resource_capability.memory_mb, 65_536);

    let bad = json!({"applicationId": new.application_id, "jobSpec": "name: [unclosed\ntaskRoles: 7\n", "jobSpecName": "bad.yaml"});
    let r = rm
        .http
        .post(rm.url("/ws/v1/cluster/apps"))
        .bearer_auth(rm.handle.admin_token())
        .json(&bad)
        .send()
        .await
        .unwrap();
    let e = error_body(r, StatusCode::BAD_REQUEST).await;
    assert_eq!(e.code, "INVALID_JOB_SPEC");
    assert!(e.message.contains("bad.yaml"), "{}", e.message);
    let (s, _) = rm
        .get_json(&format!("/ws/v1/cluster/apps/{}", new.application_id))
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let work = rm._dir.path().join("work").join(&new.application_id);
    assert!(!work.exists(), "no directory left behind");
    let (_, apps) = rm.get_json("/ws/v1/cluster/apps").await;
    assert_eq!(apps["apps"]["app"].as_array().unwrap().len(), 0);

    let unknown = json!({"applicationId": "application_1_9999", "jobSpec": "name: x"});
    let r = rm
        .http
        .post(rm.url("/ws/v1/cluster/apps"))
        .bearer_auth(rm.handle.admin_token())
        .json(&unknown)
        .send()
        .await
        .unwrap();
    let e = error_body(r, StatusCode::BAD_REQUEST).await;
    assert!(e.message.contains("new-application"), "{}", e.message);
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn am_protocol_needs_the_apps_own_token() {
    let rm = rm().await;
    let a = rm.am("a").await;
    let b = rm.am("b").await;
    let url = rm.url(&format!("/ws/v1/am/{}/allocate", a.id));
    let body = AllocateRequest::default();
    let r = rm.http.post(&url).json(&body).send().await.unwrap();
    assert_eq!(error_body(r, StatusCode::UNAUTHORIZED).await.code, "UNAUTHORIZED");
    let r = rm
        .http
        .post(&url)
        .bearer_auth(&b.token)
        .json(&body)
        .send()
        .await
        .unwrap();
    error_body(r, StatusCode::UNAUTHORIZED).await;
    let r = rm.http.post(&url).bearer_auth("").json(&body).send().await.unwrap();
    error_body(r, StatusCode::UNAUTHORIZED).await;
    let r = rm
        .http
        .post(rm.url(&format!("/ws/v1/am/{}/finish", a.id)))
        .bearer_auth(&b.token)
        .json(&json!({"finalStatus":"SUCCEEDED","exitCode":0,"diagnostics":""}))
        .send()
        .await
        .unwrap();
    error_body(r, StatusCode::UNAUTHORIZED).await;
    let r = rm
        .http
        .post(rm.url("/ws/v1/am/application_0_0042/allocate"))
        .bearer_auth(&a.token)
        .json(&body)
        .send()
        .await
        .unwrap();
    // An unknown id answers as a wrong token does: no caller can probe which ids exist.
    error_body(r, StatusCode::UNAUTHORIZED).await;
    assert_eq!(rm.app_report(&a.id).unwrap().state, AppState::Running);
    assert_eq!(rm.app_report(&a.id).unwrap().tracking_url, "http://dash/a");
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn conflicting_asks_exactly_one_wins() {
    let rm = rm().await;
    let mut a = rm.am("a").await;
    let mut b = rm.am("b").await;
    // Both apps ask for GPU bit 0 and port 20000 on n1 at the same time.
    let (ra, rb) = tokio::join!(
        rm.allocate(&mut a, vec![ask(1, "n1", 0x1, "20000")], vec![]),
        rm.allocate(&mut b, vec![ask(1, "n1", 0x1, "20000")], vec![])
    );
    assert_eq!(ra.allocated.len() + rb.allocated.len(), 1, "exactly one granted");
    let (winner, loser) = if ra.allocated.is_empty() {
        (&rb, &ra)
    } else {
        (&ra, &rb)
    };
    let c = &winner.allocated[0];
    assert_eq!((c.host.as_str(), c.request_id, c.resources.gpu_mask), ("n1", 1, 0x1));
    assert_eq!(c.resources.ports, PortSet::parse("20000").unwrap());
    assert_eq!(c.node_http_address, rm.base);
    assert_eq!(loser.rejected.len(), 1);
    assert!(loser.rejected[0].retryable);
    assert!(
        loser.rejected[0].reason.contains("in use"),
        "{}",
        loser.rejected[0].reason
    );

    // Never-grantable asks are not retryable.
    let r = rm
        .allocate(
            &mut a,
            vec![
                ask(2, "n1", 0x10, ""),
                ask(3, "nowhere", 0, ""),
                ask(4, "n2", 0, "30000"),
            ],
            vec![],
        )
        .await;
    assert!(r.allocated.is_empty());
    assert_eq!(
        r.rejected.iter().map(|x| x.request_id).collect::<Vec<_>>(),
        vec![2, 3, 4]
    );
    assert!(r.rejected.iter().all(|x| !x.retryable), "{:?}", r.rejected);
    assert!(r.rejected[0].reason.contains("do not exist"));
    assert!(r.rejected[1].reason.contains("unknown host"));
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn repeated_response_id_is_idempotent() {
    let rm = rm().await;
    let mut a = rm.am("a").await;
    let req = AllocateRequest {
        response_id: 0,
        asks: vec![ask(1, "n1", 0x3, "")],
        ..Default::default()
    };
    let first: AllocateResponse = rm.allocate_raw(&a, &req).await.json().await.unwrap();
    assert_eq!(first.allocated.len(), 1);
    // The same request again (a retry after a lost answer): same answer, nothing new.
    let again: AllocateResponse = rm.allocate_raw(&a, &req).await.json().await.unwrap();
    assert_eq!(again, first);
    let (n, count) = rm.nodes_snapshot().into_iter().find(|(n, _)| n.host == "n1").unwrap();
    assert_eq!((count, n.used().gpu_mask), (1, 0x3), "the ask was applied once");
    // An out-of-order id is refused.
    let stale = AllocateRequest {
        response_id: 7,
        ..Default::default()
    };
    error_body(rm.allocate_raw(&a, &stale).await, StatusCode::BAD_REQUEST).await;
    a.response_id = first.response_id;
    let next = rm.allocate(&mut a, vec![], vec![]).await;
    assert_eq!(next.response_id, 2);
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn release_and_finish_free_everything() {
    let rm = rm().await;
    let mut a = rm.am("a").await;
    let mut b = rm.am("b").await;
    let ra = rm
        .allocate(
            &mut a,
            vec![ask(1, "n1", 0x1, "20005"), ask(2, "n2", 0, "20006")],
            vec![],
        )
        .await;
    assert_eq!(ra.allocated.len(), 2);
    let rb = rm.allocate(&mut b, vec![ask(1, "n1", 0x1, "")], vec![]).await;
    assert!(rb.rejected[0].retryable);
    assert!(
        rb.updated_nodes
            .iter()
            .any(|n| n.node.host == "n1" && n.node.used().gpu_mask == 0x1),
        "b sees the node a's grant changed: {:?}",
        rb.updated_nodes
    );

    // a releases its n1 container: freed at once, not reported back to a.
    let c1 = ra.allocated[0].container_id.clone();
    let r = rm.allocate(&mut a, vec![], vec![c1.clone()]).await;
    assert!(
        r.completed.is_empty(),
        "released containers are not reported: {:?}",
        r.completed
    );
    let rb = rm.allocate(&mut b, vec![ask(2, "n1", 0x1, "20005")], vec![]).await;
    assert_eq!(
        rb.allocated.len(),
        1,
        "the released bit and port are free again: {:?}",
        rb.rejected
    );

    // finish stops and frees every live container of the app.
    rm.finish(&a, FinalStatus::Succeeded, 0).await;
    rm.finish(&a, FinalStatus::Succeeded, 0).await; // a retried finish is harmless
    let rep = rm.app_report(&a.id).unwrap();
    assert_eq!(
        (rep.state, rep.final_status, rep.exit_code),
        (AppState::Finished, FinalStatus::Succeeded, Some(0))
    );
    assert!(!rm.ledger_all_free(), "b still holds one");
    rm.finish(&b, FinalStatus::Failed, 1).await;
    assert_eq!(rm.app_report(&b.id).unwrap().state, AppState::Failed);
    assert!(rm.ledger_all_free());
    let (_, app) = rm.get_json(&format!("/ws/v1/cluster/apps/{}", b.id)).await;
    assert_eq!(app["app"]["state"], "FAILED");
    assert_eq!(app["app"]["exitCode"], 1);
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn kill_shuts_the_am_down_and_frees() {
    let rm = rm().await;
    let mut a = rm.am("a").await;
    let got = rm.allocate(&mut a, vec![ask(1, "n1", 0x4, "")], vec![]).await;
    let cid = got.allocated[0].container_id.clone();
    let url = rm.url(&format!("/ws/v1/cluster/apps/{}/state", a.id));
    let r = rm
        .http
        .put(&url)
        .bearer_auth(rm.handle.admin_token())
        .json(&json!({"state":"RUNNING"}))
        .send()
        .await
        .unwrap();
    error_body(r, StatusCode::BAD_REQUEST).await;
    let r = rm.http.put(&url).json(&json!({"state":"KILLED"})).send().await.unwrap();
    error_body(r, StatusCode::UNAUTHORIZED).await;
    let r = rm
        .http
        .put(&url)
        .bearer_auth(&a.token)
        .json(&json!({"state":"KILLED"}))
        .send()
        .await
        .unwrap();
    error_body(r, StatusCode::UNAUTHORIZED).await;
    assert!(!rm.ledger_all_free(), "refused kills change nothing");
    let r = rm
        .http
        .put(&url)
        .bearer_auth(rm.handle.admin_token())
        .json(&json!({"state":"KILLED"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert!(rm.ledger_all_free());
    let out = rm.allocate(&mut a, vec![ask(2, "n1", 0x4, "")], vec![]).await;
    assert_eq!(out.command, Some(AmCommand::Shutdown));
    assert!(out.allocated.is_empty(), "a killed app gets nothing");
    assert_eq!(out.completed.len(), 1);
    assert_eq!(
        (out.completed[0].container_id.as_str(), out.completed[0].exit_status),
        (cid.as_str(), -106)
    );
    let (_, st) = rm.get_json(&format!("/ws/v1/cluster/apps/{}/state", a.id)).await;
    assert_eq!(st["state"], "KILLED");
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn executor_endpoints_route_and_authorize() {
    let rm = rm().await;
    let mut a = rm.am("a").await;
    let b = rm.am("b").await;
    let got = rm
        .allocate(&mut a, vec![ask(1, "n1", 0x1, ""), ask(2, "n1", 0x2, "")], vec![])
        .await;
    let c = got.allocated[0].container_id.clone();
    let c2 = got.allocated[1].container_id.clone();
    let node = |host: &str, id: &str, what: &str| rm.url(&format!("/ws/v1/node/{host}/containers/{id}/{what}"));
    let ctx = LaunchContext {
        // Lasts past the second start below (a task that ended at once would make that start
        // race its exit); finishing the application stops it.
        commands: vec!["sleep 30".into()],
        ..Default::default()
    };

    let r = rm.http.post(node("n1", &c, "start")).json(&ctx).send().await.unwrap();
    error_body(r, StatusCode::UNAUTHORIZED).await;
    let r = rm
        .http
        .post(node("n1", &c, "start"))
        .bearer_auth(&b.token)
        .json(&ctx)
        .send()
        .await
        .unwrap();
    error_body(r, StatusCode::UNAUTHORIZED).await;
    let r = rm
        .http
        .post(node("n2", &c, "start"))
        .bearer_auth(&a.token)
        .json(&ctx)
        .send()
        .await
        .unwrap();
    error_body(r, StatusCode::NOT_FOUND).await;
    let r = rm
        .http
        .post(node("n1", "container_x", "start"))
        .bearer_auth(&a.token)
        .json(&ctx)
        .send()
        .await
        .unwrap();
    // Not an id the RM could have issued: refused before any lookup.
    error_body(r, StatusCode::BAD_REQUEST).await;
    let r = rm
        .http
        .get(format!("{}?stream=both", node("n1", &c, "logs")))
        .bearer_auth(&a.token)
        .send()
        .await
        .unwrap();
    error_body(r, StatusCode::BAD_REQUEST).await;

    // The executor runs it; a second start of the same container (an AM whose first answer
    // was lost) is answered with its status and starts nothing.
    let r = rm
        .http
        .post(node("n1", &c, "start"))
        .bearer_auth(&a.token)
        .json(&ctx)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let s: Value = r.json().await.unwrap();
    assert_eq!(s["state"], "RUNNING");
    let again = rm
        .http
        .post(node("n1", &c, "start"))
        .bearer_auth(&a.token)
        .json(&ctx)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), StatusCode::OK);
    let s: Value = again.json().await.unwrap();
    assert_eq!(s["state"], "RUNNING", "{s}");
    let r = rm
        .http
        .get(node("n1", &c, "status"))
        .bearer_auth(&a.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);

    // Stopping a never-started container: complete with KILLED_BY_APPMASTER, reported.
    let r = rm
        .http
        .post(node("n1", &c2, "stop"))
        .bearer_auth(&a.token)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let s: Value = r.json().await.unwrap();
    assert_eq!(
        (s["state"].as_str(), s["exitStatus"].as_i64()),
        (Some("COMPLETE"), Some(-105))
    );
    let out = rm.allocate(&mut a, vec![], vec![]).await;
    assert!(
        out.completed
            .iter()
            .any(|x| x.container_id == c2 && x.exit_status == -105),
        "{:?}",
        out.completed
    );
    let r = rm
        .http
        .post(node("n1", &c2, "start"))
        .bearer_auth(&a.token)
        .json(&ctx)
        .send()
        .await
        .unwrap();
    error_body(r, StatusCode::CONFLICT).await;
    rm.finish(&a, FinalStatus::Succeeded, 0).await;
    // Finishing stops `c` if its exit has not been reported yet; its GPU returns when the
    // executor reports it dead, a moment later (freed only when dead), not at once.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while !rm.ledger_all_free() && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(rm.ledger_all_free());
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn bad_bodies_get_error_json() {
    let rm = rm().await;
    let a = rm.am("a").await;
    let url = rm.url(&format!("/ws/v1/am/{}/allocate", a.id));
    let r = rm
        .http
        .post(&url)
        .bearer_auth(&a.token)
        .header("content-type", "application/json")
        .body("{\"responseId\": ")
        .send()
        .await
        .unwrap();
    let e = error_body(r, StatusCode::BAD_REQUEST).await;
    assert_eq!(e.code, "INVALID_JSON");
    let r = rm
        .http
        .post(&url)
        .bearer_auth(&a.token)
        .json(&json!({"responseId": 0, "bogus": 1}))
        .send()
        .await
        .unwrap();
    let e = error_body(r, StatusCode::BAD_REQUEST).await;
    assert!(e.message.contains("bogus"), "{}", e.message);

    let big = format!("{{\"responseId\":0,\"pad\":\"{}\"}}", "x".repeat(2 << 20));
    let r = rm
        .http
        .post(&url)
        .bearer_auth(&a.token)
        .header("content-type", "application/json")
        .body(big)
        .send()
        .await
        .unwrap();
    let e = error_body(r, StatusCode::PAYLOAD_TOO_LARGE).await;
    assert_eq!(e.code, "PAYLOAD_TOO_LARGE");

    let r = rm.http.get(rm.url("/ws/v1/nothing/here")).send().await.unwrap();
    error_body(r, StatusCode::NOT_FOUND).await;
    let r = rm
        .http
        .get(rm.url("/ws/v1/cluster/apps/application_0_0077"))
        .bearer_auth(rm.handle.admin_token())
        .send()
        .await
        .unwrap();
    error_body(r, StatusCode::NOT_FOUND).await;
    rm.handle.shutdown().await;
}

#[tokio::test]
async fn unused_containers_expire_and_lost_nodes_release() {
    let rm = rm_with_expiry(Duration::from_millis(200)).await;
    let mut a = rm.am("a").await;
    let got = rm.allocate(&mut a, vec![ask(1, "n1", 0x1, "")], vec![]).await;
    let c = got.allocated[0].container_id.clone();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let out = rm.allocate(&mut a, vec![ask(2, "n2", 0, "20001")], vec![]).await;
    assert_eq!(out.completed.len(), 1);
    assert_eq!(out.completed[0].container_id, c);
    assert_eq!(out.completed[0].exit_status, -100);
    assert_eq!(out.completed[0].diagnostics, "Container expired since it was unused");

    assert!(rm.set_node_state("n2", NodeState::Lost).await);
    let out = rm.allocate(&mut a, vec![ask(3, "n2", 0, "")], vec![]).await;
    assert_eq!(out.completed.len(), 1);
    assert_eq!(out.completed[0].diagnostics, "Container released on a *lost* node");
    assert!(!out.rejected[0].retryable, "a lost node takes no asks");
    assert!(out
        .updated_nodes
        .iter()
        .any(|n| n.node.host == "n2" && n.node.state == gpuam::cluster::NodeState::Lost));
    assert!(rm.ledger_all_free());
    rm.handle.shutdown().await;
}

/// A node's drain (issue 27, the drain term of the AM's order) goes out with the node, in
/// the listing and in the allocate answer's `updatedNodes`: the latest end its containers
/// declared (`maxRunSec`), unknown once one declares none, 0 when nothing runs.
#[tokio::test]
async fn nodes_say_when_their_declared_work_drains() {
    let rm = rm().await;
    let mut a = rm.am("a").await;
    let drain_in_listing = |v: &Value, host: &str| {
        v["nodes"]["node"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["nodeHostName"] == host)
            .map(|n| n["drainByMs"].clone())
            .unwrap()
    };
    let (_, v) = rm.get_json("/ws/v1/cluster/nodes").await;
    assert_eq!(drain_in_listing(&v, "n1"), 0, "nothing runs: {v}");
    let before = gpuam::protocol::now_ms();
    let limited = Ask {
        max_run_sec: Some(3600),
        ..ask(1, "n1", 0x1, "")
    };
    let r = rm.allocate(&mut a, vec![limited], vec![]).await;
    assert_eq!(r.allocated.len(), 1);
    let (_, v) = rm.get_json("/ws/v1/cluster/nodes").await;
    let drain = drain_in_listing(&v, "n1")
        .as_u64()
        .expect("a drain once a limit is declared");
    assert!(
        drain >= before + 3_600_000 && drain <= gpuam::protocol::now_ms() + 3_600_000,
        "{drain}"
    );
    let mut b = rm.am("b").await;
    let r = rm.allocate(&mut b, vec![ask(1, "n1", 0x2, "")], vec![]).await;
    assert_eq!(r.allocated.len(), 1);
    let seen = r
        .updated_nodes
        .iter()
        .find(|n| n.node.host == "n1")
        .expect("n1 changed");
    assert_eq!(seen.node.drain_by_ms, None, "b's container declared no limit");
    let (_, v) = rm.get_json("/ws/v1/cluster/nodes").await;
    assert!(drain_in_listing(&v, "n1").is_null(), "{v}");
    rm.handle.shutdown().await;
}
