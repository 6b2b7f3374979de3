//! Endpoint tests over the router (no sockets) and one loopback SSE test.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{to_bytes, Body};
use axum::http::{Request, StatusCode};
use axum::Router;
use futures::StreamExt;
use tower::ServiceExt;

use super::demo::{demo_hub, demo_hub_with_commands, DEMO_TOKEN};
use super::router;
use crate::am::status::{Command, JobState, StatusHub, TaskState};

async fn call(app: &Router, req: Request<Body>) -> (StatusCode, String, String) {
    let r = app.clone().oneshot(req).await.unwrap();
    let status = r.status();
    let ctype = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let body = to_bytes(r.into_body(), usize::MAX).await.unwrap();
    (status, ctype, String::from_utf8(body.to_vec()).unwrap())
}

/// `GET uri` with the job token (the API is behind credentials: see `access`).
async fn get(app: &Router, uri: &str) -> (StatusCode, String, String) {
    call(
        app,
        Request::get(uri)
            .header("authorization", format!("Bearer {DEMO_TOKEN}"))
            .body(Body::empty())
            .unwrap(),
    )
    .await
}

/// The status of `GET uri` without reading its body (an event stream does not end).
async fn stream_status(app: &Router, uri: &str) -> StatusCode {
    app.clone()
        .oneshot(Request::get(uri).body(Body::empty()).unwrap())
        .await
        .unwrap()
        .status()
}

/// Unknown tokens cost the RM one question each per `REFUSED_FOR`, however often they
/// come, and at most `MAX_CHECKS` questions are in flight at once.
#[tokio::test]
async fn unknown_tokens_are_asked_once_and_checks_are_bounded() {
    let hub = demo_hub(2, 1);
    let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let in_flight = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (a, f, m) = (asked.clone(), in_flight.clone(), most.clone());
    hub.set_token_check(Arc::new(move |t: String| {
        let (a, f, m) = (a.clone(), f.clone(), m.clone());
        Box::pin(async move {
            use std::sync::atomic::Ordering::SeqCst;
            a.fetch_add(1, SeqCst);
            let now = f.fetch_add(1, SeqCst) + 1;
            m.fetch_max(now, SeqCst);
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            f.fetch_sub(1, SeqCst);
            Some(t == "owner-token")
        })
    }));
    let app = router(hub);
    for _ in 0..5 {
        assert_eq!(
            get_as(&app, "/api/v1/job", Some("Bearer stranger")).await,
            StatusCode::UNAUTHORIZED
        );
    }
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 1, "asked once");
    // Many different unknown tokens at once: never more than MAX_CHECKS questions at a time.
    let calls = (0..40).map(|i| {
        let app = app.clone();
        async move { get_as(&app, "/api/v1/job", Some(&format!("Bearer unknown-{i}"))).await }
    });
    for s in futures::future::join_all(calls).await {
        assert_eq!(s, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 41);
    let most = most.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        (1..=crate::am::status::MAX_CHECKS).contains(&most),
        "{most} checks in flight at once"
    );
    // A known token still works and is remembered.
    assert_eq!(
        get_as(&app, "/api/v1/job", Some("Bearer owner-token")).await,
        StatusCode::OK
    );
}

/// An RM that gives no answer (busy, unreachable) is not a refusal: the owner is told to
/// try again (503) and let in as soon as the RM answers, not locked out for the refusal time.
#[tokio::test]
async fn no_answer_from_the_rm_is_not_remembered_as_a_refusal() {
    let hub = demo_hub(2, 1);
    let rm_up = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let up = rm_up.clone();
    hub.set_token_check(Arc::new(move |t: String| {
        let up = up.load(std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move { up.then_some(t == "owner-token") })
    }));
    let app = router(hub);
    let owner = Some("Bearer owner-token");
    assert_eq!(
        get_as(&app, "/api/v1/job", owner).await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    rm_up.store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(get_as(&app, "/api/v1/job", owner).await, StatusCode::OK);
    assert_eq!(
        get_as(&app, "/api/v1/job", Some("Bearer stranger")).await,
        StatusCode::UNAUTHORIZED
    );
}

/// `GET uri` with `auth` as the Authorization header, or none.
async fn get_as(app: &Router, uri: &str, auth: Option<&str>) -> StatusCode {
    let mut req = Request::get(uri);
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    call(app, req.body(Body::empty()).unwrap()).await.0
}

/// The API answers only the job token, a token the RM accepts for the job (owner,
/// admin) as a bearer, or on the event stream the job's events ticket (or the job token)
/// as `?token=`; the page, health probes and metrics stay open.
#[tokio::test]
async fn the_api_needs_the_job_owner_or_admin_token() {
    let hub = demo_hub(4, 1);
    let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let a = asked.clone();
    hub.set_token_check(Arc::new(move |t: String| {
        a.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move { Some(t == "owner-token" || t == "admin-token") })
    }));
    let app = router(hub);
    let (role, index) = ("worker", 0);
    let logs = format!("/api/v1/tasks/{role}/{index}/logs");
    for uri in [
        "/api/v1/job",
        "/api/v1/tasks",
        "/api/v1/snapshot",
        "/api/v1/tails",
        logs.as_str(),
    ] {
        assert_eq!(get_as(&app, uri, None).await, StatusCode::UNAUTHORIZED, "{uri}");
        assert_eq!(
            get_as(&app, uri, Some("Bearer bob-token")).await,
            StatusCode::UNAUTHORIZED,
            "{uri}"
        );
        assert_ne!(
            get_as(&app, uri, Some("Bearer owner-token")).await,
            StatusCode::UNAUTHORIZED,
            "{uri}"
        );
        assert_ne!(
            get_as(&app, uri, Some("Bearer admin-token")).await,
            StatusCode::UNAUTHORIZED,
            "{uri}"
        );
        assert_ne!(
            get_as(&app, uri, Some(&format!("Bearer {DEMO_TOKEN}"))).await,
            StatusCode::UNAUTHORIZED,
            "{uri}"
        );
    }
    // No credential in URLs: the query is taken on the event stream only, and there only
    // the job's events ticket (or the job token itself).
    for q in [DEMO_TOKEN, "owner-token", "admin-token"] {
        assert_eq!(
            get_as(&app, &format!("/api/v1/job?token={q}"), None).await,
            StatusCode::UNAUTHORIZED,
            "{q} in the query of another route"
        );
    }
    let asked_before = asked.load(std::sync::atomic::Ordering::SeqCst);
    for q in ["owner-token", "admin-token", "bob-token"] {
        assert_eq!(
            stream_status(&app, &format!("/api/v1/events?token={q}")).await,
            StatusCode::UNAUTHORIZED,
            "a user's token in the stream's URL"
        );
    }
    assert_eq!(
        asked.load(std::sync::atomic::Ordering::SeqCst),
        asked_before,
        "a token in a URL is never even asked about"
    );
    let (s, _, body) = call(
        &app,
        Request::get("/api/v1/events-ticket")
            .header("authorization", "Bearer owner-token")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{body}");
    let ticket = serde_json::from_str::<serde_json::Value>(&body).unwrap()["ticket"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(ticket, DEMO_TOKEN);
    assert_eq!(
        get_as(&app, "/api/v1/events-ticket", None).await,
        StatusCode::UNAUTHORIZED
    );
    for q in [ticket.as_str(), DEMO_TOKEN] {
        assert_eq!(
            stream_status(&app, &format!("/api/v1/events?token={q}")).await,
            StatusCode::OK
        );
    }
    assert_eq!(
        get_as(&app, &format!("/api/v1/job?token={ticket}"), None).await,
        StatusCode::UNAUTHORIZED,
        "the ticket opens the stream only"
    );
    assert_eq!(
        get_as(&app, "/api/v1/job", Some(&format!("Bearer {ticket}"))).await,
        StatusCode::UNAUTHORIZED,
        "the ticket is no bearer token"
    );
    // An accepted token is remembered for a while, not asked again on every call.
    let before = asked.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        get_as(&app, "/api/v1/job", Some("Bearer owner-token")).await,
        StatusCode::OK
    );
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), before);
    for open in ["/", "/app.js", "/livez", "/readyz", "/metrics"] {
        assert_eq!(get_as(&app, open, None).await, StatusCode::OK, "{open}");
    }
    // The kill takes the same credentials.
    let kill = |auth: Option<&'static str>| {
        let mut req = Request::post("/api/v1/job/kill");
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        req.body(Body::empty()).unwrap()
    };
    assert_eq!(call(&app, kill(None)).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(
        call(&app, kill(Some("Bearer bob-token"))).await.0,
        StatusCode::UNAUTHORIZED
    );
}

/// An events ticket is signed with the job token over its expiry and the credential that
/// fetched it: it opens the stream until it expires and while that credential is still
/// good here; an expired, altered, forged or other job's ticket opens nothing.
#[tokio::test]
async fn an_events_ticket_expires_and_dies_with_its_credential() {
    use super::access::{ticket, ticket_subject, TICKET_FOR};
    let sha = crate::auth::sha256_hex;
    // The pure rule, time passed in.
    let owner = sha("owner-token");
    let t = ticket(DEMO_TOKEN, &owner, 1000);
    assert_eq!(ticket_subject(DEMO_TOKEN, &t, 999), Some(owner.clone()));
    assert_eq!(ticket_subject(DEMO_TOKEN, &t, 1000), None, "expired");
    assert_eq!(ticket_subject("another-job-token", &t, 999), None, "another job's");
    assert_eq!(ticket_subject("", &t, 999), None, "no job token, no tickets");
    let later = t.replacen("1000.", "9999999999.", 1);
    assert_eq!(ticket_subject(DEMO_TOKEN, &later, 999), None, "expiry altered");
    let other = t.replacen(&owner, &sha("admin-token"), 1);
    assert_eq!(ticket_subject(DEMO_TOKEN, &other, 999), None, "subject altered");
    for junk in ["", "1000", "1000.x", "x.y.z", "1000..", &format!("1000.{owner}.")] {
        assert_eq!(ticket_subject(DEMO_TOKEN, junk, 999), None, "{junk:?}");
    }

    // Through the dashboard.
    let hub = demo_hub(2, 1);
    let revoked = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let r = revoked.clone();
    hub.set_token_check(Arc::new(move |t: String| {
        let ok = t == "owner-token" && !r.load(std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move { Some(ok) })
    }));
    let app = router(hub.clone());
    let fetch = |token: &str| {
        let (app, auth) = (app.clone(), format!("Bearer {token}"));
        async move {
            let req = Request::get("/api/v1/events-ticket").header("authorization", auth);
            let (s, _, body) = call(&app, req.body(Body::empty()).unwrap()).await;
            assert_eq!(s, StatusCode::OK, "{body}");
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            v["ticket"].as_str().unwrap().to_string()
        }
    };
    let stream = |t: &str| {
        let (app, uri) = (app.clone(), format!("/api/v1/events?token={t}"));
        async move { stream_status(&app, &uri).await }
    };
    let owners = fetch("owner-token").await;
    assert_eq!(stream(&owners).await, StatusCode::OK);
    let jobs = fetch(DEMO_TOKEN).await;
    assert_eq!(stream(&jobs).await, StatusCode::OK);
    let now = crate::protocol::now_ms() / 1000;
    let expired = ticket(DEMO_TOKEN, &owner, now - 1);
    assert_eq!(stream(&expired).await, StatusCode::UNAUTHORIZED, "expired");
    let forged = ticket("a-guessed-key", &owner, now + TICKET_FOR.as_secs());
    assert_eq!(stream(&forged).await, StatusCode::UNAUTHORIZED, "forged");
    // Signed right, but for a credential this dashboard never accepted.
    let strangers = ticket(DEMO_TOKEN, &sha("bob-token"), now + TICKET_FOR.as_secs());
    assert_eq!(stream(&strangers).await, StatusCode::UNAUTHORIZED, "never accepted");
    // The owner's token revoked at the RM: once the dashboard's memory of its acceptance
    // lapses, its unexpired ticket opens nothing, and no new ticket is given.
    revoked.store(true, std::sync::atomic::Ordering::SeqCst);
    let long_ago = std::time::Instant::now()
        .checked_sub(crate::am::status::ACCEPTED_FOR * 2)
        .unwrap();
    hub.accepted.remember(owner.clone(), long_ago);
    assert_eq!(stream(&owners).await, StatusCode::UNAUTHORIZED, "revoked");
    assert_eq!(
        get_as(&app, "/api/v1/events-ticket", Some("Bearer owner-token")).await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        stream(&jobs).await,
        StatusCode::OK,
        "the job token's ticket still opens"
    );
}

/// A page ticket (what an open page holds instead of a token: eleventh audit pass): the
/// page trades its token for one, and the ticket opens this job's API, its kill and its
/// event stream until it expires; another job's, an expired or a forged one opens nothing,
/// and the RM is never asked about one.
#[tokio::test]
async fn a_page_ticket_opens_this_jobs_dashboard_until_it_expires() {
    use crate::auth::{page_ticket, PAGE_TICKET_FOR};
    let hub = demo_hub(2, 1);
    let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let a = asked.clone();
    hub.set_token_check(Arc::new(move |t: String| {
        a.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move { Some(t == "owner-token") })
    }));
    let app = router(hub.clone());
    // No credential, no ticket.
    assert_eq!(
        get_as(&app, "/api/v1/page-ticket", None).await,
        StatusCode::UNAUTHORIZED
    );
    let req = Request::get("/api/v1/page-ticket").header("authorization", "Bearer owner-token");
    let (s, _, body) = call(&app, req.body(Body::empty()).unwrap()).await;
    assert_eq!(s, StatusCode::OK, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let t = v["ticket"].as_str().unwrap().to_string();
    let asked_before = asked.load(std::sync::atomic::Ordering::SeqCst);
    let bearer = format!("Bearer {t}");
    assert_eq!(get_as(&app, "/api/v1/job", Some(&bearer)).await, StatusCode::OK);
    assert_eq!(
        get_as(&app, "/api/v1/page-ticket", Some(&bearer)).await,
        StatusCode::OK,
        "renewed with itself"
    );
    // Its events ticket opens the stream.
    let req = Request::get("/api/v1/events-ticket").header("authorization", bearer.as_str());
    let (s, _, body) = call(&app, req.body(Body::empty()).unwrap()).await;
    assert_eq!(s, StatusCode::OK, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let events = v["ticket"].as_str().unwrap().to_string();
    assert_eq!(
        stream_status(&app, &format!("/api/v1/events?token={events}")).await,
        StatusCode::OK
    );
    assert_eq!(
        asked.load(std::sync::atomic::Ordering::SeqCst),
        asked_before,
        "a ticket is checked here, not at the RM"
    );
    let now = crate::protocol::now_ms() / 1000;
    for (what, bad) in [
        ("expired", page_ticket(DEMO_TOKEN, now - 60, now, "owner")),
        (
            "another job's",
            page_ticket("another-job-token", now, now + 60, "owner"),
        ),
        (
            "from too far ahead",
            page_ticket(DEMO_TOKEN, now, now + PAGE_TICKET_FOR.as_secs() * 10, "owner"),
        ),
    ] {
        let bearer = format!("Bearer {bad}");
        assert_eq!(
            get_as(&app, "/api/v1/job", Some(&bearer)).await,
            StatusCode::UNAUTHORIZED,
            "{what}"
        );
        let (s, _, _) = call(&app, kill_req(Some(&bearer))).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{what}: no kill");
    }
    // A renewal keeps its chain's start and never outlives the chain: a ticket born
    // almost PAGE_TICKET_CHAIN ago is renewed only until then, for the same user.
    let chain = crate::auth::PAGE_TICKET_CHAIN.as_secs();
    let born = now - chain + 120;
    let old = page_ticket(DEMO_TOKEN, born, now + 60, "owner");
    let req = Request::get("/api/v1/page-ticket").header("authorization", format!("Bearer {old}"));
    let (s, _, body) = call(&app, req.body(Body::empty()).unwrap()).await;
    assert_eq!(s, StatusCode::OK, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let renewed = crate::auth::page_ticket_read(DEMO_TOKEN, v["ticket"].as_str().unwrap(), now).unwrap();
    assert_eq!((renewed.who.as_str(), renewed.born), ("owner", born));
    assert_eq!(renewed.expires, born + chain, "not past the chain's end");
    // Past the chain's end nothing of it is good, whatever its expiry.
    let ended = page_ticket(DEMO_TOKEN, now - chain, now + 60, "owner");
    for uri in ["/api/v1/job", "/api/v1/page-ticket"] {
        assert_eq!(
            get_as(&app, uri, Some(&format!("Bearer {ended}"))).await,
            StatusCode::UNAUTHORIZED,
            "{uri}"
        );
    }
    // A ticket accepted a moment ago that has expired since is refused (and never renewed),
    // whatever was remembered of it.
    let stale = page_ticket(DEMO_TOKEN, now - 60, now, "owner");
    hub.accepted
        .remember(crate::auth::sha256_hex(&stale), std::time::Instant::now());
    for uri in ["/api/v1/job", "/api/v1/page-ticket"] {
        assert_eq!(
            get_as(&app, uri, Some(&format!("Bearer {stale}"))).await,
            StatusCode::UNAUTHORIZED,
            "{uri}"
        );
    }
    // The page's own ticket kills its job (the page's kill button).
    let (s, _, body) = call(&app, kill_req(Some(&format!("Bearer {t}")))).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{body}");
}

/// A flood of token checks the RM is slow to answer holds every turn: an owner's first
/// check waits a bounded time for one and is told to try again (503 with `Retry-After`),
/// not queued behind them for good; once the flood clears, the owner is let in.
#[tokio::test]
async fn a_flood_of_slow_token_checks_answers_owners_503_instead_of_a_wait() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    let hub = demo_hub(2, 1);
    /// A check in flight, counted until it ends or is given up.
    struct Held(Arc<AtomicUsize>);
    impl Drop for Held {
        fn drop(&mut self) {
            self.0.fetch_sub(1, SeqCst);
        }
    }
    let in_flight = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(tokio::sync::Notify::new());
    let (f, rel) = (in_flight.clone(), release.clone());
    hub.set_token_check(Arc::new(move |t: String| {
        let (f, rel) = (f.clone(), rel.clone());
        Box::pin(async move {
            if t == "owner-token" {
                return Some(true);
            }
            f.fetch_add(1, SeqCst);
            let _held = Held(f);
            rel.notified().await;
            Some(false)
        })
    }));
    let app = router(hub);
    let flood: Vec<_> = (0..crate::am::status::MAX_CHECKS + 4)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move { get_as(&app, "/api/v1/job", Some(&format!("Bearer slow-{i}"))).await })
        })
        .collect();
    for _ in 0..600 {
        if in_flight.load(SeqCst) == crate::am::status::MAX_CHECKS {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        in_flight.load(SeqCst),
        crate::am::status::MAX_CHECKS,
        "the flood holds every turn"
    );
    let owner = tokio::time::timeout(
        Duration::from_secs(120),
        app.clone().oneshot(
            Request::get("/api/v1/job")
                .header("authorization", "Bearer owner-token")
                .body(Body::empty())
                .unwrap(),
        ),
    )
    .await
    .expect("the owner is answered, not queued for good")
    .unwrap();
    assert_eq!(owner.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(owner.headers().contains_key("retry-after"), "{:?}", owner.headers());
    // The flood answered: the owner is let in.
    let mut answered = StatusCode::SERVICE_UNAVAILABLE;
    for _ in 0..100 {
        release.notify_waiters();
        answered = get_as(&app, "/api/v1/job", Some("Bearer owner-token")).await;
        if answered == StatusCode::OK {
            break;
        }
    }
    assert_eq!(answered, StatusCode::OK);
    release.notify_waiters();
    for f in flood {
        let s = f.await.unwrap();
        assert!(
            s == StatusCode::UNAUTHORIZED || s == StatusCode::SERVICE_UNAVAILABLE,
            "{s}"
        );
    }
}

async fn get_json(app: &Router, uri: &str) -> (StatusCode, serde_json::Value) {
    let (s, ctype, body) = get(app, uri).await;
    assert!(ctype.starts_with("application/json"), "{uri}: content type {ctype}");
    (s, serde_json::from_str(&body).unwrap())
}

fn assert_error(v: &serde_json::Value, code: &str) {
    assert_eq!(v["code"], code, "{v}");
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
}

#[tokio::test]
async fn job_and_snapshot_shapes() {
    let hub = demo_hub(40, 10);
    let app = router(hub.clone());
    let (s, job) = get_json(&app, "/api/v1/job").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(job["name"], "resnet-ddp");
    assert_eq!(job["state"], "RUNNING");
    assert_eq!(job["totalTasks"], 40);
    assert!(job["roles"].as_array().unwrap().iter().any(|r| r["role"] == "worker"));
    let (s, snap) = get_json(&app, "/api/v1/snapshot").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(snap["tasks"].as_array().unwrap().len(), 40);
    assert_eq!(snap["nodes"].as_array().unwrap().len(), 10);
    assert_eq!(snap["nodes"][0]["gpuGroups"].as_array().unwrap().len(), 3);
    let (s, cfg) = get_json(&app, "/api/v1/config").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(cfg["select"]["candidateNodesFactor"], 3);
}

#[tokio::test]
async fn tasks_paging_and_filters() {
    let hub = demo_hub(300, 100);
    let app = router(hub.clone());
    let (_, all) = get_json(&app, "/api/v1/tasks").await;
    assert_eq!(all["total"], 300);
    assert_eq!(all["offset"], 0);
    assert_eq!(all["tasks"].as_array().unwrap().len(), 100, "default limit");
    let (_, page) = get_json(&app, "/api/v1/tasks?offset=290&limit=50").await;
    assert_eq!(page["tasks"].as_array().unwrap().len(), 10);
    assert_eq!(page["offset"], 290);
    let (_, ps) = get_json(&app, "/api/v1/tasks?role=ps&limit=1000").await;
    let n_ps = hub.read(|s| s.tasks.iter().filter(|t| t.role == "ps").count());
    assert_eq!(ps["total"], n_ps);
    assert!(ps["tasks"].as_array().unwrap().iter().all(|t| t["role"] == "ps"));
    let (_, w) = get_json(&app, "/api/v1/tasks?state=task_waiting&limit=1000").await;
    let n_wait = hub.read(|s| s.tasks.iter().filter(|t| t.state == TaskState::TaskWaiting).count());
    assert!(n_wait > 0);
    assert_eq!(w["total"], n_wait);
    let (_, h) = get_json(&app, "/api/v1/tasks?host=gpu-0001&limit=1000").await;
    assert!(h["total"].as_u64().unwrap() > 0);
    assert!(h["tasks"].as_array().unwrap().iter().all(|t| t["host"] == "gpu-0001"));

    let (s, e) = get_json(&app, "/api/v1/tasks?limit=1001").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_error(&e, "invalid_parameter");
    let (s, e) = get_json(&app, "/api/v1/tasks?offset=-1").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_error(&e, "invalid_parameter");
    let (s, e) = get_json(&app, "/api/v1/tasks?state=SLEEPING").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(e["message"].as_str().unwrap().contains("CONTAINER_RUNNING"));
}

#[tokio::test]
async fn one_task_and_errors() {
    let app = router(demo_hub(20, 5));
    let (s, t) = get_json(&app, "/api/v1/tasks/worker/3").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(t["role"], "worker");
    assert_eq!(t["index"], 3);
    let (s, e) = get_json(&app, "/api/v1/tasks/worker/999").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&e, "task_not_found");
    let (s, e) = get_json(&app, "/api/v1/tasks/worker/x").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_error(&e, "invalid_parameter");
    let (s, e) = get_json(&app, "/api/v1/nope").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&e, "not_found");
}

#[tokio::test]
async fn task_logs() {
    let hub = demo_hub(20, 5);
    let app = router(hub.clone());
    let (running, waiting) = hub.read(|s| {
        let r = s.tasks.iter().find(|t| t.container_id.is_some()).unwrap();
        let w = s.tasks.iter().find(|t| t.container_id.is_none()).unwrap();
        (
            (r.role.clone(), r.index, r.container_id.clone().unwrap()),
            (w.role.clone(), w.index),
        )
    });
    let uri = format!("/api/v1/tasks/{}/{}/logs?stream=stderr&tail=200", running.0, running.1);
    let (s, ctype, body) = get(&app, &uri).await;
    assert_eq!(s, StatusCode::OK);
    assert!(ctype.starts_with("text/plain"));
    assert!(body.len() <= 200);
    assert!(body.contains(&running.2) && body.contains("[stderr]"), "{body}");
    let (s, e) = get_json(
        &app,
        &format!("/api/v1/tasks/{}/{}/logs?stream=stdin", running.0, running.1),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_error(&e, "invalid_parameter");
    let (s, e) = get_json(&app, &format!("/api/v1/tasks/{}/{}/logs", waiting.0, waiting.1)).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&e, "no_container");
}

#[tokio::test]
async fn tails_give_each_tasks_last_lines() {
    let hub = demo_hub(20, 5);
    let app = router(hub.clone());
    let (placed, waiting) = hub.read(|s| {
        let p: Vec<(String, u32, String)> = s
            .tasks
            .iter()
            .filter_map(|t| Some((t.role.clone(), t.index, t.container_id.clone()?)))
            .collect();
        let w = s.tasks.iter().find(|t| t.container_id.is_none()).unwrap();
        (p, (w.role.clone(), w.index))
    });
    assert!(placed.len() >= 2);
    // Named tasks, in the order asked; a task without a container is left out.
    let ask = format!(
        "{}/{},{}/{},{}/{}",
        placed[1].0, placed[1].1, waiting.0, waiting.1, placed[0].0, placed[0].1
    );
    let (s, v) = get_json(&app, &format!("/api/v1/tails?lines=2&tasks={ask}")).await;
    assert_eq!(s, StatusCode::OK);
    let tails = v["tails"].as_array().unwrap();
    assert_eq!(tails.len(), 2, "{v}");
    for (t, want) in tails.iter().zip([&placed[1], &placed[0]]) {
        assert_eq!(t["role"], want.0.as_str());
        assert_eq!(t["index"], want.1);
        assert_eq!(t["containerId"], want.2.as_str());
        // The demo log's last two lines, from this task's stdout.
        let lines: Vec<&str> = t["lines"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_str().unwrap())
            .collect();
        assert_eq!(
            lines,
            vec![
                format!("[stdout] {} step 38: loss=0.051", want.2),
                format!("[stdout] {} step 39: loss=0.050", want.2)
            ],
            "{t}"
        );
    }
    // Without `tasks`: every task with a container, default 3 lines.
    let (_, all) = get_json(&app, "/api/v1/tails").await;
    let all = all["tails"].as_array().unwrap();
    assert_eq!(all.len(), placed.len());
    assert!(all.iter().all(|t| t["lines"].as_array().unwrap().len() == 3));
    for bad in ["lines=0", "lines=21", "lines=x", "tasks=worker", "tasks=worker/x"] {
        let (s, e) = get_json(&app, &format!("/api/v1/tails?{bad}")).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}");
        assert_error(&e, "invalid_parameter");
    }
}

/// In an AM the node pages and the snapshot's node view come from its live view (a
/// `NodeSource`), with the job's GPUs from the tasks that hold containers.
#[tokio::test]
async fn an_ams_node_pages_and_snapshot_come_from_its_live_view() {
    use crate::cluster::{ClusterView, Node};
    use crate::resources::{PortSet, Resources};
    let hub = demo_hub(40, 10);
    let (host, mask) = hub.read(|s| {
        let t = s
            .tasks
            .iter()
            .find(|t| t.state == crate::am::status::TaskState::ContainerRunning)
            .unwrap();
        (t.host.clone().unwrap(), t.gpu_mask.clone().unwrap())
    });
    let nodes = [host.clone(), "zz-spare".to_string()]
        .map(|h| Node::new(h, "/r", Resources::with_mask(8, 8000, 0xff, PortSet::new())));
    let selector = std::sync::Arc::new(crate::select::Selector::new(
        ClusterView::new(nodes),
        Default::default(),
    ));
    let _ = hub
        .node_source
        .set(std::sync::Arc::new(crate::am::node_page::ViewNodes(selector)));
    let app = router(hub.clone());
    let (_, n) = get_json(&app, "/api/v1/nodes?limit=1&offset=1").await;
    assert_eq!(n["total"], 2);
    assert_eq!(n["nodes"][0]["host"], "zz-spare");
    let (_, snap) = get_json(&app, "/api/v1/snapshot").await;
    let hosts: Vec<&str> = snap["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["host"].as_str().unwrap())
        .collect();
    assert_eq!(hosts, [host.as_str(), "zz-spare"]);
    let shown = crate::resources::parse_mask(snap["nodes"][0]["jobGpuMask"].as_str().unwrap()).unwrap();
    assert_eq!(
        shown & crate::resources::parse_mask(&mask).unwrap(),
        crate::resources::parse_mask(&mask).unwrap()
    );
    assert_eq!(snap["tasks"].as_array().unwrap().len(), 40);
    // Pollers of the job and its tasks leave the node view out; a bad value is refused.
    let (_, lean) = get_json(&app, "/api/v1/snapshot?nodes=0").await;
    assert!(lean.get("nodes").is_none(), "{lean}");
    assert_eq!(lean["tasks"].as_array().unwrap().len(), 40);
    let (s, e) = get_json(&app, "/api/v1/snapshot?nodes=yes").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_error(&e, "invalid_parameter");
}

#[tokio::test]
async fn nodes_and_selections() {
    let hub = demo_hub(50, 150);
    let app = router(hub.clone());
    let (_, n) = get_json(&app, "/api/v1/nodes?offset=100&limit=30").await;
    assert_eq!(n["total"], 150);
    assert_eq!(n["nodes"].as_array().unwrap().len(), 30);
    assert_eq!(n["nodes"][0]["host"], "gpu-0100");
    let (_, n) = get_json(&app, "/api/v1/nodes?host=gpu-000").await;
    assert_eq!(n["total"], 10);
    let (s, e) = get_json(&app, "/api/v1/nodes?limit=abc").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_error(&e, "invalid_parameter");

    let (_, sel) = get_json(&app, "/api/v1/selections?limit=5").await;
    let recs = sel["selections"].as_array().unwrap();
    assert_eq!(recs.len(), 5);
    let at: Vec<u64> = recs.iter().map(|r| r["atMs"].as_u64().unwrap()).collect();
    assert!(at.windows(2).all(|w| w[0] >= w[1]), "newest first: {at:?}");
    let w = hub.read(|s| {
        s.tasks
            .iter()
            .find(|t| t.state == TaskState::TaskWaiting)
            .map(|t| (t.role.clone(), t.index))
            .unwrap()
    });
    let (_, sel) = get_json(&app, &format!("/api/v1/selections?role={}&index={}", w.0, w.1)).await;
    let recs = sel["selections"].as_array().unwrap();
    assert!(!recs.is_empty());
    assert!(recs.iter().all(|r| r["role"] == w.0.as_str() && r["index"] == w.1));
    assert_eq!(recs[0]["outcome"], "notNow");
    assert!(recs[0]["trace"]["stages"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["nodesOut"] == 0));
}

fn kill_req(auth: Option<&str>) -> Request<Body> {
    let mut b = Request::post("/api/v1/job/kill");
    if let Some(a) = auth {
        b = b.header("authorization", a);
    }
    b.body(Body::empty()).unwrap()
}

#[tokio::test]
async fn kill_needs_the_token() {
    let (hub, mut rx) = demo_hub_with_commands(10, 3);
    let app = router(hub.clone());
    let (s, _, body) = call(&app, kill_req(None)).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert!(body.contains("\"unauthorized\""));
    let (s, _, _) = call(&app, kill_req(Some("Bearer wrong-token"))).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _, _) = call(&app, kill_req(Some(DEMO_TOKEN))).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "token without the Bearer scheme");
    assert!(rx.try_recv().is_err(), "no command for refused calls");
    // The scheme in any case (as the RM takes it).
    let (s, _, body) = call(&app, kill_req(Some(&format!("bearer {DEMO_TOKEN}")))).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["accepted"],
        true
    );
    assert!(matches!(rx.try_recv(), Ok(Command::Kill { .. })));
    // A final job cannot be killed.
    hub.update("job", serde_json::json!({}), |s| s.job.state = JobState::Succeeded);
    let (s, _, body) = call(&app, kill_req(Some(&format!("Bearer {DEMO_TOKEN}")))).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert!(body.contains("job_final"));
    assert!(rx.try_recv().is_err());
}

#[tokio::test]
async fn metrics_series() {
    let app = router(demo_hub(30, 6));
    let (s, ctype, text) = get(&app, "/metrics").await;
    assert_eq!(s, StatusCode::OK);
    assert!(ctype.starts_with("application/openmetrics-text"), "{ctype}");
    for series in [
        "gpuam_tasks{role=\"worker\",state=\"CONTAINER_RUNNING\"} ",
        "gpuam_requests_outstanding ",
        "gpuam_allocate_latency_seconds_bucket{le=\"+Inf\"} 200",
        "gpuam_allocate_latency_seconds_count 200",
        "gpuam_rm_errors_total 2",
        "gpuam_node_refresh_age_seconds ",
        "gpuam_selection_filtered_total{stage=\"resources\"} 1200",
        "gpuam_task_retries_total{exit_class=\"transient\"} 1",
        "gpuam_job_state{state=\"RUNNING\"} 1",
        "gpuam_job_state{state=\"FAILED\"} 0",
    ] {
        assert!(text.contains(series), "missing {series} in\n{text}");
    }
    // Buckets are cumulative.
    let counts: Vec<u64> = text
        .lines()
        .filter(|l| l.starts_with("gpuam_allocate_latency_seconds_bucket"))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{counts:?}");
}

#[tokio::test]
async fn health_probes() {
    let hub = demo_hub(5, 2);
    let app = router(hub.clone());
    assert_eq!(get(&app, "/livez").await.0, StatusCode::OK);
    assert_eq!(get(&app, "/healthz").await.0, StatusCode::OK);
    assert_eq!(get(&app, "/readyz").await.0, StatusCode::OK);
    hub.update("nodes", serde_json::json!({}), |s| s.nodes_refreshed_ms -= 31_000);
    let (s, e) = get_json(&app, "/readyz").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert_error(&e, "not_ready");
    assert!(e["message"].as_str().unwrap().contains("node view"));
    hub.update("nodes", serde_json::json!({}), |s| {
        s.nodes_refreshed_ms += 31_000;
        s.registered = false;
    });
    let (s, e) = get_json(&app, "/readyz").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert!(e["message"].as_str().unwrap().contains("not registered"));
    assert_eq!(get(&app, "/livez").await.0, StatusCode::OK);
}

#[tokio::test]
async fn static_assets() {
    let app = router(demo_hub(1, 1));
    let (s, ctype, body) = get(&app, "/").await;
    assert_eq!(s, StatusCode::OK);
    assert!(ctype.starts_with("text/html"));
    assert!(body.contains("id=\"log-view\"") && body.contains("/app.js"));
    let (s, ctype, body) = get(&app, "/app.js").await;
    assert_eq!(s, StatusCode::OK);
    assert!(ctype.starts_with("text/javascript"));
    assert!(body.contains("EventSource"));
    let r = app
        .clone()
        .oneshot(Request::get("/style.css").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/css"));
    assert_eq!(r.headers()["cache-control"], "no-cache");
    let tag = r.headers()["etag"].clone();
    let r = app
        .clone()
        .oneshot(
            Request::get("/style.css")
                .header("if-none-match", tag)
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NOT_MODIFIED);
}

/// Reads SSE frames from a loopback server until `n` events (not comments) arrived.
async fn read_events(mut resp: reqwest::Response, n: usize) -> Vec<(Option<String>, String, String)> {
    let mut buf = String::new();
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while out.len() < n {
        let chunk = tokio::time::timeout_at(deadline, resp.chunk())
            .await
            .expect("events in time")
            .unwrap()
            .unwrap();
        buf.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = buf.find("\n\n") {
            let frame: String = buf.drain(..end + 2).collect();
            let (mut id, mut ev, mut data) = (None, String::new(), String::new());
            for line in frame.lines() {
                if let Some(v) = line.strip_prefix("id:") {
                    id = Some(v.trim().to_string());
                } else if let Some(v) = line.strip_prefix("event:") {
                    ev = v.trim().to_string();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data = v.trim().to_string();
                }
            }
            if !ev.is_empty() {
                out.push((id, ev, data));
            }
        }
    }
    out
}

#[tokio::test]
async fn sse_resumes_after_last_event_id() {
    let hub: Arc<StatusHub> = demo_hub(5, 2);
    for i in 1..=5 {
        hub.publish("task", serde_json::json!({"n": i}));
    }
    let (addr, server) = super::serve(hub.clone(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let client = crate::tls::http_client();
    let resp = client
        .get(format!("http://{addr}/api/v1/events"))
        .bearer_auth(DEMO_TOKEN)
        .header("Last-Event-ID", "3")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let publisher = {
        let hub = hub.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            hub.publish("job", serde_json::json!({"n": 6}));
        })
    };
    let evs = read_events(resp, 3).await;
    let ids: Vec<_> = evs.iter().map(|e| e.0.clone().unwrap()).collect();
    assert_eq!(ids, ["4", "5", "6"]);
    assert_eq!(evs[0].1, "task");
    assert_eq!(evs[2].1, "job");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&evs[2].2).unwrap()["n"], 6);
    publisher.await.unwrap();

    // The query parameter works too; the header wins over it.
    let resp = client
        .get(format!("http://{addr}/api/v1/events?lastEventId=5&token={DEMO_TOKEN}"))
        .send()
        .await
        .unwrap();
    let evs = read_events(resp, 1).await;
    assert_eq!(evs[0].0.as_deref(), Some("6"));
    let (s, _, _) = get(&router(hub.clone()), "/api/v1/events?lastEventId=abc").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    server.abort();
}

#[tokio::test]
async fn sse_lagging_client_gets_resync() {
    let hub = demo_hub(2, 1);
    let stream = super::sse::event_stream(hub.clone(), None);
    futures::pin_mut!(stream);
    // More than the broadcast channel holds, before the client reads anything.
    for i in 0..1100 {
        hub.publish("task", serde_json::json!({"n": i}));
    }
    let first = tokio::time::timeout(Duration::from_secs(2), stream.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let text = format!("{first:?}");
    assert!(text.contains("resync"), "{text}");
}

/// An event stream ends after its life with a `reopen` event (the page then opens it
/// again with a new ticket), so an open stream outlives its opener's credential by that
/// much at most.
#[tokio::test]
async fn an_event_stream_ends_after_its_life_asking_to_be_reopened() {
    let hub = demo_hub(2, 1);
    let stream = super::sse::for_a_while(super::sse::event_stream(hub.clone(), None), Duration::from_millis(200));
    hub.publish("task", serde_json::json!({"n": 1}));
    let all: Vec<_> = tokio::time::timeout(Duration::from_secs(60), stream.collect::<Vec<_>>())
        .await
        .expect("the stream ends");
    let texts: Vec<String> = all.iter().map(|e| format!("{e:?}")).collect();
    let last = texts.last().expect("at least the reopen event");
    assert!(last.contains("reopen"), "{texts:?}");
    assert_eq!(texts.iter().filter(|t| t.contains("reopen")).count(), 1, "{texts:?}");
}

/// The dashboard as served (`serve_with`): a request naming another host (DNS rebinding)
/// gets 421, one from a page of another site 403; its own address is served.
#[tokio::test]
async fn the_served_dashboard_refuses_other_hosts_and_origins() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let hub = demo_hub(4, 2);
    let (addr, server) = crate::web::serve_with(
        hub,
        "127.0.0.1:0".parse().unwrap(),
        None,
        &[],
        crate::tls::HttpTimeouts::default(),
    )
    .await
    .unwrap();
    let status = |host: String, origin: Option<&'static str>| async move {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let origin = origin.map(|o| format!("Origin: {o}\r\n")).unwrap_or_default();
        let req = format!(
            "GET /api/v1/job HTTP/1.1\r\nHost: {host}\r\n{origin}Authorization: Bearer {DEMO_TOKEN}\r\n\
             Connection: close\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        let text = String::from_utf8_lossy(&out).to_string();
        text.split_whitespace().nth(1).unwrap_or("").to_string()
    };
    assert_eq!(status(format!("evil.example:{}", addr.port()), None).await, "421");
    assert_eq!(status(addr.to_string(), Some("http://evil.example")).await, "403");
    assert_eq!(status(addr.to_string(), None).await, "200");
    assert_eq!(status(format!("localhost:{}", addr.port()), None).await, "200");
    server.abort();
}
