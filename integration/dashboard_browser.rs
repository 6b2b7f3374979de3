//! Headless-Chromium tests of the dashboard, driven through chromedriver with the W3C
//! WebDriver HTTP protocol (spoken with reqwest; no extra crates).
//!
//! - `dashboard_renders_demo_hub`: the page over a demo hub served by `web::serve`:
//!   task table, GPU boxes and their looks, the waiting panel, logs, kill confirmation.
//! - `dashboard_follows_a_real_job`: `gpuam run examples/ddp-4x2.yaml` end to end:
//!   tasks go RUNNING then SUCCEEDED, a task's two GPUs are marked, its log shows.
//! - `dashboard_shows_the_end_of_a_job`: `gpuam run examples/ps-worker.yaml`: the workers'
//!   latest output in the table, parameter servers STOPPED (not FAILED) when the job
//!   completes, and a "job ended" badge (not "reconnecting…") once the AM has gone.
//! - `an_owner_s_page_opens_its_stream_again_with_a_new_ticket_after_a_refusal`: a page
//!   with a user token follows live events through its ticket, and after a drop whose
//!   reconnect is refused it fetches a new ticket and follows again.
//! - `dashboard_shows_the_loss_falling`: `gpuam run examples/jax-ddp.yaml` (real JAX; run
//!   `bash examples/jax-setup.sh` first): the workers' `step N loss X` lines in the table,
//!   the loss lower at the end than at the first look.
//!
//! Chromium and chromedriver must be installed (`apt-get install chromium
//! chromium-driver`); without them these tests fail rather than skip. The WebDriver helpers
//! ([`Browser`]) are in `common/browser.rs`, shared with the cluster page's test.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::browser::Browser;
use serde_json::json;

/// The GPU indices of the boxes marked as the selected task's, on `host`.
const MARKED_GPUS: &str = "return [...document.querySelectorAll('[data-gpu-box][data-task-gpus]')].map(b => b.dataset.host + ':' + b.dataset.gpu);";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_renders_demo_hub() {
    let (hub, mut commands) = gpuam::web::demo::demo_hub_with_commands(40, 16);
    let (addr, server) = gpuam::web::serve(hub.clone(), "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let b = Browser::start().await;
    b.goto(&format!("http://{addr}/#token={}", gpuam::web::demo::DEMO_TOKEN))
        .await;
    b.wait_for(
        "the page to load",
        "return document.body.dataset.ready === 'true';",
        Duration::from_secs(15),
    )
    .await;

    // Task table: one page of 50 rows, each with a state.
    let rows = b
        .js("return [...document.querySelectorAll('tr[data-task]')].map(r => r.dataset.task + '=' + r.dataset.state);")
        .await;
    let rows: Vec<String> = serde_json::from_value(rows).unwrap();
    assert_eq!(rows.len(), 40, "{rows:?}");
    assert!(rows.iter().any(|r| r.ends_with("=RUNNING")));
    assert!(rows.iter().any(|r| r.ends_with("=SUCCEEDED")));
    let page = b.js("return document.getElementById('t-page').textContent;").await;
    assert!(page.as_str().unwrap().contains("of 40"), "{page}");

    // GPU boxes: every look appears; 8 boxes per node card.
    let looks = b
        .js("return [...new Set([...document.querySelectorAll('[data-gpu-box]')].map(b => b.dataset.look))].sort();")
        .await;
    assert_eq!(looks, json!(["free", "job", "other", "requested"]));
    let frames = b.js("return document.querySelectorAll('.gframe[data-group=\"NVLink\"]').length + document.querySelectorAll('.gframe[data-group=\"PCIe switch\"]').length;").await;
    assert!(frames.as_u64().unwrap() > 0, "topology frames drawn");

    // Clicking a running worker marks exactly its GPUs on its node, and shows its log.
    let (role, index, host, gpus, container) = hub.read(|s| {
        let t = s
            .tasks
            .iter()
            .find(|t| {
                t.role == "worker" && t.gpus.len() == 2 && t.state == gpuam::am::status::TaskState::ContainerRunning
            })
            .unwrap();
        (
            t.role.clone(),
            t.index,
            t.host.clone().unwrap(),
            t.gpus.clone(),
            t.container_id.clone().unwrap(),
        )
    });
    b.click(&format!("tr[data-task=\"{role}/{index}\"]")).await;
    let marked = b
        .wait_for("the task's GPUs to be marked", MARKED_GPUS, Duration::from_secs(5))
        .await;
    let mut marked: Vec<String> = serde_json::from_value(marked).unwrap();
    marked.sort();
    let want: Vec<String> = gpus.iter().map(|g| format!("{host}:{g}")).collect();
    assert_eq!(marked, want);
    let looks = b
        .js("return [...document.querySelectorAll('[data-gpu-box][data-task-gpus]')].map(b => b.dataset.look);")
        .await;
    assert_eq!(looks, json!(["job", "job"]));
    let card = b
        .js("return document.querySelector('.node-card.selected').dataset.host;")
        .await;
    assert_eq!(card, json!(host));
    b.wait_for(
        "the log",
        &format!("return document.getElementById('log-view').textContent.includes('{container}');"),
        Duration::from_secs(5),
    )
    .await;
    // The table shows each placed task's latest output (the demo log's last lines).
    let tail = b
        .wait_for(
            "the task's latest output",
            &format!("const c = document.querySelector('td.tail[data-tail=\"{role}/{index}\"]'); return c && c.children.length === 3 ? [...c.children].map(d => d.textContent) : null;"),
            Duration::from_secs(10),
        )
        .await;
    assert_eq!(
        tail,
        json!([
            format!("[stdout] {container} step 37: loss=0.053"),
            format!("[stdout] {container} step 38: loss=0.051"),
            format!("[stdout] {container} step 39: loss=0.050")
        ])
    );

    // A waiting task: the panel shows the stage that emptied the candidates.
    b.js("const s = document.getElementById('f-state'); s.value = 'WAITING'; s.dispatchEvent(new Event('change'));")
        .await;
    b.click("tr[data-task][data-state=\"WAITING\"]").await;
    b.wait_for(
        "the waiting panel",
        "const p = document.getElementById('waiting-panel'); return !p.hidden && p.querySelector('tr[data-stage=\"resources\"]') !== null;",
        Duration::from_secs(5),
    )
    .await;
    let text = b
        .js("return document.getElementById('waiting-panel').textContent;")
        .await;
    let text = text.as_str().unwrap();
    assert!(text.contains("Why is this task waiting?"), "{text}");
    assert!(text.contains("not enough free GPUs") && text.contains("→ 0"), "{text}");
    let log = b.js("return document.getElementById('log-view').textContent;").await;
    assert!(log.as_str().unwrap().contains("no container yet"), "{log}");
    b.js("document.getElementById('waiting-panel').scrollIntoView();").await;
    b.screenshot("target/dashboard-demo-waiting.png").await;
    b.js("const s = document.getElementById('f-state'); s.value = ''; s.dispatchEvent(new Event('change'));")
        .await;
    b.click(&format!("tr[data-task=\"{role}/{index}\"]")).await;
    b.js("window.scrollTo(0, 0);").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    b.screenshot("target/dashboard-demo.png").await;

    // Kill: asks first; cancelling sends nothing; confirming sends the token.
    assert_eq!(
        b.js("return document.getElementById('kill').disabled;").await,
        json!(false)
    );
    b.click("#kill").await;
    assert_eq!(
        b.js("return document.getElementById('kill-dialog').open;").await,
        json!(true)
    );
    b.click("#kill-cancel").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(commands.try_recv().is_err(), "cancel must not kill");
    b.click("#kill").await;
    b.click("#kill-confirm").await;
    b.wait_for(
        "the kill answer",
        "return document.getElementById('kill-result').textContent.includes('Kill requested');",
        Duration::from_secs(5),
    )
    .await;
    assert!(matches!(
        commands.try_recv(),
        Ok(gpuam::am::status::Command::Kill { .. })
    ));

    // Without the token the button is disabled and says why.
    b.goto(&format!("http://{addr}/")).await;
    b.wait_for(
        "reload",
        "return document.body.dataset.ready === 'true';",
        Duration::from_secs(15),
    )
    .await;
    let k = b
        .js("const k = document.getElementById('kill'); return [k.disabled, k.title];")
        .await;
    assert_eq!(k[0], json!(true));
    assert!(k[1].as_str().unwrap().contains("token"));
    // ... and the job's API answers nothing without it: the page says what it needs.
    let said = b
        .js("return [document.body.dataset.auth, document.getElementById('conn').textContent, document.querySelectorAll('tr[data-task]').length];")
        .await;
    assert_eq!(said[0], json!("needed"), "{said}");
    assert!(said[1].as_str().unwrap_or("").contains("token"), "{said}");
    assert_eq!(said[2], json!(0), "no task may show without a credential: {said}");

    // Back with the token for the live updates (a query, so that it is a new page load and
    // not only a new fragment).
    b.goto(&format!(
        "http://{addr}/?again=1#token={}",
        gpuam::web::demo::DEMO_TOKEN
    ))
    .await;
    b.wait_for(
        "reload with the token",
        "return document.body.dataset.ready === 'true' && document.body.dataset.auth !== 'needed' && document.querySelectorAll('tr[data-task]').length > 0;",
        Duration::from_secs(15),
    )
    .await;

    // Live update over SSE: a task changes state and the row follows.
    let row = finish_a_running_task(&hub);
    b.wait_for("the SSE update", &row_succeeded(&row), Duration::from_secs(5))
        .await;

    // A task stopped because the job completed (a parameter server) is STOPPED, not FAILED.
    let second = hub.read(|s| {
        s.tasks
            .iter()
            .position(|t| t.state == gpuam::am::status::TaskState::ContainerRunning)
            .unwrap()
    });
    let (r, i) = hub.read(|s| (s.tasks[second].role.clone(), s.tasks[second].index));
    hub.update("task", json!({"role": r, "index": i}), |s| {
        let t = &mut s.tasks[second];
        t.state = gpuam::am::status::TaskState::TaskCompleted;
        t.exit_code = Some(-7125);
        t.exit_type = Some(gpuam::am::status::ExitType::TransientNormal);
        t.exit_diagnostics = Some("stopped on job completion: stopped when the job ended".into());
    });
    b.wait_for(
        "the stopped task",
        &format!(
            "const r = document.querySelector('tr[data-task=\"{r}/{i}\"]'); return r && r.dataset.state === 'STOPPED';"
        ),
        Duration::from_secs(5),
    )
    .await;
    drop(b);
    server.abort();
}

/// A loopback TCP proxy from `listener` to `to`; aborting its task drops every connection
/// through it (as a network drop would).
fn proxy(listener: tokio::net::TcpListener, to: std::net::SocketAddr) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        while let Ok((mut inbound, _)) = listener.accept().await {
            conns.spawn(async move {
                if let Ok(mut out) = tokio::net::TcpStream::connect(to).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                }
            });
        }
    })
}

/// No logs (the dashboard below shows none).
struct NoLogs;

impl gpuam::am::status::LogSource for NoLogs {
    fn read(&self, _: &str, _: &str, _: u64) -> futures::future::BoxFuture<'static, Result<String, String>> {
        Box::pin(async { Ok(String::new()) })
    }
}

/// A dashboard of the demo job's snapshot under `job_token`, whose token check (the RM)
/// accepts `owner-token`; its address and server.
async fn owners_dashboard(
    job_token: &str,
) -> (
    std::sync::Arc<gpuam::am::status::StatusHub>,
    std::net::SocketAddr,
    tokio::task::JoinHandle<()>,
) {
    let snapshot = gpuam::web::demo::demo_hub(6, 1).snapshot();
    let (hub, commands) = gpuam::am::status::StatusHub::new(snapshot, job_token.into(), std::sync::Arc::new(NoLogs));
    std::mem::forget(commands);
    hub.set_token_check(std::sync::Arc::new(|t: String| {
        Box::pin(async move { Some(t == "owner-token") })
    }));
    let (addr, server) = gpuam::web::serve(hub.clone(), "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    (hub, addr, server)
}

/// Marks the first RUNNING task of `hub` SUCCEEDED (one event) and returns its row key.
fn finish_a_running_task(hub: &gpuam::am::status::StatusHub) -> String {
    let k = hub.read(|s| {
        s.tasks
            .iter()
            .position(|t| t.state == gpuam::am::status::TaskState::ContainerRunning)
            .unwrap()
    });
    let (r, i) = hub.read(|s| (s.tasks[k].role.clone(), s.tasks[k].index));
    hub.update("task", json!({"role": r, "index": i}), |s| {
        let t = &mut s.tasks[k];
        t.state = gpuam::am::status::TaskState::TaskCompleted;
        t.exit_code = Some(0);
        t.exit_type = Some(gpuam::am::status::ExitType::Succeeded);
    });
    format!("{r}/{i}")
}

/// A script true once the page shows task `row` SUCCEEDED.
fn row_succeeded(row: &str) -> String {
    format!("const r = document.querySelector('tr[data-task=\"{row}\"]'); return r && r.dataset.state === 'SUCCEEDED';")
}

/// The page of a job's owner (a user token, not the job token) trades that token for a page
/// ticket of the job at once and follows live events through its events ticket; when, after
/// a drop, its stream is refused (its events ticket opens nothing behind the same address
/// any more: here the job's AM again, on the same port, which never saw it), the page does
/// not give up: it fetches a new events ticket, opens the stream again, and live updates
/// follow again. Behind that address next, another job's dashboard (what a process that took
/// the port once the AM had gone would be) is never shown the owner's token: the page
/// holds only its job's ticket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_s_page_opens_its_stream_again_with_a_new_ticket_after_a_refusal() {
    let (hub, first, _server) = owners_dashboard("first-job-token").await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let front = listener.local_addr().unwrap();
    let cut = proxy(listener, first);
    let b = Browser::start().await;
    b.goto(&format!("http://{front}/#token=owner-token")).await;
    b.wait_for(
        "the owner's page to load",
        "return document.body.dataset.ready === 'true' && document.body.dataset.auth !== 'needed' && document.querySelectorAll('tr[data-task]').length > 0;",
        Duration::from_secs(30),
    )
    .await;
    let row = finish_a_running_task(&hub);
    b.wait_for(
        "a live update over the owner's stream",
        &row_succeeded(&row),
        Duration::from_secs(30),
    )
    .await;

    // The connection drops; behind the same address the job's dashboard again, a new one
    // that never saw the page's events ticket.
    let (hub, second, _server2) = owners_dashboard("first-job-token").await;
    // Past the ids the page saw, so that its next live event is new to it.
    for _ in 0..5 {
        hub.publish("noop", serde_json::Value::Null);
    }
    cut.abort();
    let _ = cut.await;
    let listener = tokio::net::TcpListener::bind(front).await.unwrap();
    let cut = proxy(listener, second);
    b.wait_for(
        "the page to say it reconnects",
        "const c = document.getElementById('conn'); return !c.hidden && c.dataset.conn === 'reconnecting';",
        Duration::from_secs(30),
    )
    .await;
    b.wait_for(
        "the stream open again (a new ticket)",
        "return document.getElementById('conn').hidden;",
        Duration::from_secs(60),
    )
    .await;
    let row = finish_a_running_task(&hub);
    b.wait_for(
        "a live update over the reopened stream",
        &row_succeeded(&row),
        Duration::from_secs(30),
    )
    .await;
    assert!(
        !b.js("return location.hash;").await.to_string().contains("owner-token"),
        "the page's address keeps no token"
    );

    // Behind the address next: what a process that took the port would be, writing down
    // every request it gets and refusing each. The page calls it (for a new events ticket),
    // but never with the owner's token: only with its ticket of this job.
    let shown = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    cut.abort();
    let _ = cut.await;
    let listener = tokio::net::TcpListener::bind(front).await.unwrap();
    let seen = shown.clone();
    let _squatter = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut conn, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65536 {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                seen.lock().unwrap().push(String::from_utf8_lossy(&head).to_string());
                let _ = conn
                    .write_all(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .await;
            });
        }
    });
    let t0 = std::time::Instant::now();
    let bearer = |r: &String| r.lines().any(|l| l.to_ascii_lowercase().starts_with("authorization:"));
    while !shown.lock().unwrap().iter().any(bearer) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the page never called the address with its credential: {:?}",
            shown.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let shown = shown.lock().unwrap().clone();
    for r in shown.iter().filter(|r| bearer(r)) {
        assert!(!r.contains("owner-token") && r.contains("Bearer p."), "{r}");
    }
}

/// A `gpuam run` started by a test. Dropping it (at the test's end, or when it panics)
/// stops the job as Ctrl-C would: SIGTERM, which stops the AM and every task, then waits
/// for the process (SIGKILL after 30 s). A SIGKILL alone would leave the AM behind,
/// retrying its dead embedded RM until `am.rm_unreachable_timeout_sec`.
/// Its containers and logs live in its own temporary directory, removed after it.
struct RunningJob {
    child: Child,
    /// Held so that it is removed only after the job stopped.
    _work: tempfile::TempDir,
}

impl Drop for RunningJob {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: plain syscall on this test's own child.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
        for _ in 0..300 {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `gpuam run examples/ddp-4x2.yaml` and returns the running job and the dashboard
/// URL it printed.
fn start_job() -> (RunningJob, String) {
    start_job_with("examples/ddp-4x2.yaml", 30)
}

/// Starts `gpuam run SPEC` (the AM's dashboard lingering `linger_sec` after the job) and
/// returns the running job and the dashboard URL it printed.
fn start_job_with(spec: &str, linger_sec: u32) -> (RunningJob, String) {
    start_job_env(spec, linger_sec, &[])
}

/// As [`start_job_with`], with extra environment variables for `gpuam run`.
fn start_job_env(spec: &str, linger_sec: u32, env: &[(&str, &Path)]) -> (RunningJob, String) {
    let root = env!("CARGO_MANIFEST_DIR");
    let work = tempfile::tempdir().expect("a temporary work directory");
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpuam"))
        .env("GPUAM__NODE__IN_PROCESS_IDENTITY", "false")
        .args(["run", spec, "--listen", "127.0.0.1:0", "--work-dir"])
        .arg(work.path())
        .current_dir(root)
        .env("GPUAM_DASHBOARD_LINGER_SEC", linger_sec.to_string())
        .envs(env.iter().map(|(k, v)| (*k, *v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start gpuam run");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(i) = line.find("dashboard: ") {
                let _ = tx.send(line[i + "dashboard: ".len()..].trim().to_string());
            }
        }
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(url) => (RunningJob { child, _work: work }, url),
        Err(_) => {
            let status = child.try_wait().ok().flatten();
            drop(RunningJob { child, _work: work });
            panic!(
                "`gpuam run {spec} --listen 127.0.0.1:0` printed no `dashboard: URL` line \
                 within 30 s (exit status so far: {status:?})"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_follows_a_real_job() {
    let b = Browser::start().await;
    let (job, url) = start_job();
    assert!(url.starts_with("http://127.0.0.1:") && url.contains("#token="), "{url}");
    b.goto(&url).await;
    b.wait_for(
        "the page to load",
        "return document.body.dataset.ready === 'true';",
        Duration::from_secs(20),
    )
    .await;

    // A running task with two GPUs.
    let row = b
        .wait_for(
            "a task with 2 GPUs to be RUNNING",
            "const r = [...document.querySelectorAll('tr[data-task][data-state=\"RUNNING\"]')].find(r => r.cells[3].textContent.split(',').length === 2); return r ? r.dataset.task : null;",
            Duration::from_secs(60),
        )
        .await;
    let task = row.as_str().unwrap().to_string();
    b.click(&format!("tr[data-task=\"{task}\"]")).await;
    let marked = b
        .wait_for("the task's GPUs to be marked", MARKED_GPUS, Duration::from_secs(5))
        .await;
    let marked: Vec<String> = serde_json::from_value(marked).unwrap();
    assert_eq!(marked.len(), 2, "exactly the task's two GPUs: {marked:?}");
    let facts = b.js(&format!("const r = document.querySelector('tr[data-task=\"{task}\"]'); return [r.cells[2].textContent, r.cells[3].textContent];")).await;
    let host = facts[0].as_str().unwrap();
    let mut want: Vec<String> = facts[1]
        .as_str()
        .unwrap()
        .split(',')
        .map(|g| format!("{host}:{g}"))
        .collect();
    want.sort();
    let mut got = marked.clone();
    got.sort();
    assert_eq!(got, want);
    // The log shows what the task printed.
    b.wait_for(
        "the task's log line",
        &format!("return document.getElementById('log-view').textContent.includes('task {task}');"),
        Duration::from_secs(30),
    )
    .await;

    // Every task ends SUCCEEDED and the job says so.
    b.wait_for(
        "all tasks SUCCEEDED",
        "const rows = [...document.querySelectorAll('tr[data-task]')]; return rows.length > 0 && rows.every(r => r.dataset.state === 'SUCCEEDED');",
        Duration::from_secs(90),
    )
    .await;
    b.wait_for(
        "the job to succeed",
        "return document.getElementById('job-state').dataset.state === 'SUCCEEDED';",
        Duration::from_secs(30),
    )
    .await;
    b.click(&format!("tr[data-task=\"{task}\"]")).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let png = b.screenshot("target/dashboard.png").await;
    assert!(std::fs::metadata(png).unwrap().len() > 10_000);
    drop(b);
    drop(job);
}

/// `examples/ps-worker.yaml`: the parameter servers, stopped when the workers complete the
/// job, show as STOPPED (not FAILED); the workers' rows show their latest output; once
/// the finished job's AM has gone, the connection badge says the job ended instead of
/// "reconnecting…".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_shows_the_end_of_a_job() {
    let b = Browser::start().await;
    let (job, url) = start_job_with("examples/ps-worker.yaml", 4);
    b.goto(&url).await;
    b.wait_for(
        "the page to load",
        "return document.body.dataset.ready === 'true';",
        Duration::from_secs(20),
    )
    .await;
    // The workers' output appears in the table while they run (they print one line, then
    // sleep 2 s).
    let tails = b
        .wait_for(
            "the workers' latest output",
            "const cs = [...document.querySelectorAll('td.tail[data-tail^=\"worker/\"]')].filter(c => c.textContent.includes('on ')); return cs.length === 3 ? cs.map(c => c.dataset.tail + ' ' + c.textContent) : null;",
            Duration::from_secs(60),
        )
        .await;
    for t in tails.as_array().unwrap() {
        let t = t.as_str().unwrap();
        let task = t.split(' ').next().unwrap();
        assert!(t.contains(&format!("task {task} on ")), "{t}");
    }
    b.wait_for(
        "the job to succeed",
        "return document.getElementById('job-state').dataset.state === 'SUCCEEDED';",
        Duration::from_secs(60),
    )
    .await;
    let states = b
        .wait_for(
            "every task to end",
            "const rows = [...document.querySelectorAll('tr[data-task]')]; return rows.length === 5 && rows.every(r => r.dataset.rawState === 'TASK_COMPLETED') ? rows.map(r => r.dataset.task + '=' + r.dataset.state).sort() : null;",
            Duration::from_secs(20),
        )
        .await;
    assert_eq!(
        states,
        json!([
            "ps/0=STOPPED",
            "ps/1=STOPPED",
            "worker/0=SUCCEEDED",
            "worker/1=SUCCEEDED",
            "worker/2=SUCCEEDED"
        ])
    );
    let ps_colour = b
        .js("return getComputedStyle(document.querySelector('tr[data-task=\"ps/0\"] .state')).color;")
        .await;
    let failed_colour = b
        .js("const s = document.createElement('span'); s.className = 'state'; s.dataset.state = 'FAILED'; document.body.append(s); const c = getComputedStyle(s).color; s.remove(); return c;")
        .await;
    assert_ne!(ps_colour, failed_colour, "STOPPED is not drawn as a failure");
    // The AM stops serving 4 s after the job; the badge then says the job ended.
    let badge = b
        .wait_for(
            "the ended badge",
            "const c = document.getElementById('conn'); return !c.hidden && c.dataset.conn === 'ended' ? c.textContent : null;",
            Duration::from_secs(30),
        )
        .await;
    assert!(badge.as_str().unwrap().contains("job ended"), "{badge}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let badge = b.js("return document.getElementById('conn').textContent;").await;
    assert!(!badge.as_str().unwrap().contains("reconnecting"), "{badge}");
    b.screenshot("target/dashboard-ended.png").await;
    drop(b);
    drop(job);
}

/// `examples/jax-ddp.yaml` (real JAX training; needs `bash examples/jax-setup.sh`): the
/// task table's latest-output column follows each worker's `step N loss X` lines, so a
/// person sees the loss fall.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_shows_the_loss_falling() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = root.join("target/jax-venv/bin/python");
    let has_jax = Command::new(&python)
        .args(["-c", "import jax"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_jax,
        "JAX is not installed in {}: run `bash examples/jax-setup.sh` first (.ci/run does)",
        python.display()
    );
    // A HOME of its own for the link jax-setup.sh makes (the job's commands follow it).
    let home = tempfile::Builder::new()
        .prefix(&format!("jax-dash-{}-", std::process::id()))
        .tempdir()
        .unwrap();
    let setup = Command::new("bash")
        .arg(root.join("examples/jax-setup.sh"))
        .env("HOME", home.path())
        .output()
        .unwrap();
    assert!(setup.status.success(), "{}", String::from_utf8_lossy(&setup.stderr));

    let b = Browser::start().await;
    let (job, url) = start_job_env("examples/jax-ddp.yaml", 10, &[("HOME", home.path())]);
    b.goto(&url).await;
    b.wait_for(
        "the page to load",
        "return document.body.dataset.ready === 'true';",
        Duration::from_secs(20),
    )
    .await;
    // Each worker's latest `step N loss X`, as the table shows it.
    const STEPS: &str = "return [...document.querySelectorAll('td.tail[data-tail^=\"worker/\"]')].map(c => { const ms = [...c.children].map(d => /^step (\\d+) loss ([0-9.]+)$/.exec(d.textContent.trim())).filter(m => m); const m = ms[ms.length - 1]; return m ? [c.dataset.tail, +m[1], +m[2]] : null; });";
    let early = b
        .wait_for(
            "every worker's first loss lines",
            &format!("const v = (() => {{ {STEPS} }})(); return v.length === 3 && v.every(x => x) ? v : null;"),
            Duration::from_secs(120),
        )
        .await;
    b.wait_for(
        "the job to succeed",
        "return document.getElementById('job-state').dataset.state === 'SUCCEEDED';",
        Duration::from_secs(120),
    )
    .await;
    let late = b
        .wait_for(
            "every worker's last step",
            &format!("const v = (() => {{ {STEPS} }})(); return v.length === 3 && v.every(x => x && x[1] === 40) ? v : null;"),
            Duration::from_secs(20),
        )
        .await;
    for (e, l) in early.as_array().unwrap().iter().zip(late.as_array().unwrap()) {
        assert_eq!(e[0], l[0]);
        let (e_step, e_loss) = (e[1].as_u64().unwrap(), e[2].as_f64().unwrap());
        let l_loss = l[2].as_f64().unwrap();
        assert!(e_step < 40, "the first look came before the end: {e}");
        assert!(l_loss < e_loss, "the loss fell on the page: {e} then {l}");
    }
    b.wait_for(
        "every row SUCCEEDED",
        "const rows = [...document.querySelectorAll('tr[data-task]')]; return rows.length === 3 && rows.every(r => r.dataset.state === 'SUCCEEDED');",
        Duration::from_secs(20),
    )
    .await;
    b.screenshot("target/dashboard-jax.png").await;
    drop(b);
    drop(job);
}

/// `examples/fractional.yaml` (issue 15): a GPU held in part is drawn as one box split
/// into its tasks' shares (each segment as wide as its share, clicking it selects the
/// task) and the rest free; the node card shows its custom resources in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_splits_a_shared_gpu_into_its_tasks_shares() {
    let b = Browser::start().await;
    let (job, url) = start_job_with("examples/fractional.yaml", 4);
    b.goto(&url).await;
    b.wait_for(
        "the page to load",
        "return document.body.dataset.ready === 'true';",
        Duration::from_secs(20),
    )
    .await;
    // The five share tasks RUNNING: [task, host, "GPU (share)"].
    let rows = b
        .wait_for(
            "the share tasks to run and their boxes to be split",
            "const rows = [...document.querySelectorAll('tr[data-task]')].filter(r => r.cells[3].textContent.includes('(0.'));
             const boxes = document.querySelectorAll('[data-gpu-box][data-look=\"shared\"] .seg[data-share-task]').length;
             return rows.length === 5 && rows.every(r => r.dataset.state === 'RUNNING') && boxes === 5
               ? rows.map(r => [r.dataset.task, r.cells[2].textContent, r.cells[3].textContent]) : null;",
            Duration::from_secs(60),
        )
        .await;
    let rows: Vec<(String, String, String)> = serde_json::from_value(rows).unwrap();
    let boxes = b
        .js(
            "return [...document.querySelectorAll('[data-gpu-box][data-look=\"shared\"]')].map(b => ({
               host: b.dataset.host, gpu: b.dataset.gpu, width: b.querySelector('.segs').getBoundingClientRect().width,
               segs: [...b.querySelectorAll('.seg')].map(s => ({look: s.dataset.look, task: s.dataset.shareTask || null,
                 share: +s.dataset.share, width: s.getBoundingClientRect().width}))}));",
        )
        .await;
    let boxes = boxes.as_array().unwrap().clone();
    for (task, host, gpus) in &rows {
        let (gpu, share) = gpus.split_once(" (").unwrap();
        let share: f64 = share.trim_end_matches(')').parse().unwrap();
        let bx = boxes
            .iter()
            .find(|b| b["host"] == host.as_str() && b["gpu"] == gpu)
            .unwrap_or_else(|| panic!("no split box for {task} on {host} GPU {gpu}: {boxes:?}"));
        let seg = bx["segs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["task"] == task.as_str())
            .unwrap_or_else(|| panic!("no segment of {task}: {bx}"));
        assert_eq!(seg["look"], "job", "{seg}");
        assert_eq!(seg["share"].as_f64().unwrap(), (share * 100.0).round(), "{task}: {seg}");
    }
    for bx in &boxes {
        let segs = bx["segs"].as_array().unwrap();
        let total: f64 = segs.iter().map(|s| s["share"].as_f64().unwrap()).sum();
        assert_eq!(total, 100.0, "a box is one GPU: {bx}");
        let width = bx["width"].as_f64().unwrap();
        for s in segs {
            let want = width * s["share"].as_f64().unwrap() / 100.0;
            assert!(
                (s["width"].as_f64().unwrap() - want).abs() <= 2.0,
                "segment as wide as its share: {bx}"
            );
        }
    }
    assert!(
        boxes
            .iter()
            .any(|bx| bx["segs"].as_array().unwrap().iter().any(|s| s["look"] == "free")),
        "some shared GPU has room left: {boxes:?}"
    );
    // The prep task's node shows its NVMe drive in use.
    let prep_host = &rows.iter().find(|r| r.0 == "prep/0").expect("prep/0 runs").1;
    let custom = b
        .js(&format!(
            "const c = document.querySelector('.node-card[data-host=\"{prep_host}\"] [data-custom]'); return c ? c.textContent : null;"
        ))
        .await;
    assert!(custom.as_str().unwrap_or("").contains("nvme 1/"), "{custom}");
    // Clicking a segment selects its task.
    b.click("[data-gpu-box][data-look=\"shared\"] .seg[data-share-task=\"prep/0\"]")
        .await;
    b.wait_for(
        "prep/0 to be selected",
        "return document.getElementById('detail-title').textContent.includes('prep/0');",
        Duration::from_secs(5),
    )
    .await;
    let png = b.screenshot("target/dashboard-shares.png").await;
    assert!(std::fs::metadata(png).unwrap().len() > 10_000);
    drop(b);
    drop(job);
}
