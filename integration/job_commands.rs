//! The job commands as a user drives them against a standalone `gpuam rm` with a users
//! file and two users (`itest`, the owner, and `other`): `gpuam submit` without `--wait`
//! prints follow-up commands that work; `gpuam jobs`, `status`, `logs --follow`, `kill`
//! and `history` (tables and `--json`), with the RM and token from flags, the
//! environment or the file `gpuam login` writes; the other user sees and stops nothing
//! of the owner's job; after the job ends its logs and history row (times, exit, reason,
//! GPU-hours) are still served, also after an RM restart. Then the same stop from the
//! pages, in headless Chromium: the job's dashboard with the owner's token, the cluster
//! page's Stop with its confirmation, and its history table. Last, one answer to "why does
//! it wait": a gang held by the topology wait and a job no node has room for show the same
//! reason (kind, detail, start, deadline) in `gpuam status`, its `--json`, the job page,
//! the cluster page and `gpuam run`.
//!
//! Chromium and chromedriver must be installed for the second test (`apt-get install
//! chromium chromium-driver`); without them it fails rather than skips.

mod common;

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

use common::browser::Browser;
use common::*;
use serde_json::Value;

/// A task that writes to both streams, then ticks until `release` exists.
fn chatty_job(rm: &Rm, name: &str) -> std::path::PathBuf {
    let release = rm.path("release").display().to_string();
    let script = format!(
        "echo hello-out; echo hello-err >&2; i=0; while [ ! -e {release} ]; do echo tick $i; i=$((i+1)); sleep 0.3; done"
    );
    rm.write_job(
        name,
        &format!(
            "name: {name}\ntaskRoles:\n  worker:\n    instances: 1\n    \
             resourcePerInstance: {{cpu: 1, memoryMB: 256, gpu: 1}}\n    commands:\n      - {}\n",
            sq(&script)
        ),
    )
}

/// `gpuam ARGS` as user `itest` (token in GPUAM_TOKEN, RM in GPUAM_RM).
fn run(rm: &Rm, args: &[&str]) -> Output {
    rm.as_user(&rm.user_token, args)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn json_of(o: &Output) -> Value {
    assert_eq!(o.status.code(), Some(0), "{}", text(o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(o)))
}

/// Submits without `--wait`; returns (application id, job number, stdout).
fn submit_no_wait(rm: &Rm, job: &Path) -> (String, String, String) {
    let out = rm
        .gpuam()
        .arg("submit")
        .arg(job)
        .arg("--rm")
        .arg(&rm.url)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let s = stdout(&out);
    let id = s
        .lines()
        .find_map(|l| l.strip_prefix("submitted job ").and_then(|r| r.rsplit(' ').next()))
        .unwrap_or_else(|| panic!("no `submitted job` line: {s}"))
        .to_string();
    let n = id.rsplit('_').next().unwrap().trim_start_matches('0').to_string();
    (id, n, s)
}

fn history_row(rm: &Rm, id: &str) -> Value {
    let rows = json_of(&run(rm, &["history", "--json"]));
    rows.as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == id)
        .cloned()
        .unwrap_or_else(|| panic!("no history row of {id}: {rows}"))
}

#[test]
fn a_user_lists_follows_stops_and_looks_back_at_a_job_and_another_user_cannot() {
    let mut rm = Rm::start(TWO_NODES_TWO_GPUS, &[("GPUAM_DASHBOARD_LINGER_SEC", "0")]);
    let (id, n, printed) = submit_no_wait(&rm, &chatty_job(&rm, "chatty"));

    // The follow-up commands printed by submit work as printed (here with the --rm flag
    // that submit was given; the token comes from GPUAM_TOKEN).
    let status_line = printed
        .lines()
        .find(|l| l.trim_start().starts_with("gpuam status "))
        .unwrap_or_else(|| panic!("no `gpuam status` follow-up: {printed}"));
    let words: Vec<&str> = status_line.split_whitespace().take_while(|w| *w != "its").collect();
    assert_eq!(words[..3], ["gpuam", "status", n.as_str()], "{printed}");
    assert!(
        words.contains(&"--rm"),
        "the printed command names the RM given by flag: {printed}"
    );
    assert!(!printed.contains("curl"), "{printed}");
    let mut cmd = rm.gpuam();
    cmd.env("GPUAM_CLIENT_CONFIG", rm.path("no-client-config.yaml"));
    let out = cmd.args(&words[1..]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    // Running: jobs lists it (table within 80 columns), status shows the task on a host.
    wait_for(Duration::from_secs(60), "the task to run", || {
        let s = stdout(&run(&rm, &["status", &n]));
        s.contains("worker/0").then_some(()).filter(|_| s.contains("RUNNING"))
    });
    let jobs = run(&rm, &["jobs"]);
    let table = stdout(&jobs);
    assert!(table.lines().all(|l| l.chars().count() <= 80), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.split_whitespace().next() == Some(n.as_str()) && l.contains("chatty")),
        "{table}"
    );
    let listed = json_of(&run(&rm, &["jobs", "--json"]));
    assert_eq!(listed[0]["id"], id.as_str(), "{listed}");
    let detail = json_of(&run(&rm, &["status", &id, "--json"]));
    let c = &detail["containers"][0];
    assert_eq!(c["task"], "worker/0", "{detail}");
    assert_eq!(c["gpus"].as_array().map(Vec::len), Some(1), "{detail}");

    // The other user sees nothing of it and stops nothing of it.
    let other_jobs = rm.as_user(&rm.other_token, &["jobs", "--json"]);
    assert_eq!(json_of(&other_jobs), serde_json::json!([]));
    let o = rm.as_user(&rm.other_token, &["status", &id]);
    assert_eq!(o.status.code(), Some(77), "{}", text(&o));
    let o = rm.as_user(&rm.other_token, &["kill", &id]);
    assert_eq!(o.status.code(), Some(77), "{}", text(&o));
    let o = rm.as_user(&rm.other_token, &["kill", &n]);
    assert_eq!(
        o.status.code(),
        Some(66),
        "a job number names the caller's own jobs: {}",
        text(&o)
    );
    let o = rm.as_user(&rm.other_token, &["logs", &id]);
    assert_eq!(o.status.code(), Some(77), "{}", text(&o));
    assert_eq!(rm.app(&id)["state"], "RUNNING");

    // `gpuam login` writes the client file; then no flag and no variable is needed.
    let token_file = rm.path("itest.token");
    std::fs::write(&token_file, &rm.user_token).unwrap();
    let client = rm.path("client.yaml");
    let login = rm
        .gpuam()
        .env_remove("GPUAM_TOKEN")
        .env("GPUAM_CLIENT_CONFIG", &client)
        .args(["login", "--rm", &rm.url, "--token-file"])
        .arg(&token_file)
        .output()
        .unwrap();
    assert_eq!(login.status.code(), Some(0), "{}", text(&login));
    assert!(stdout(&login).contains("as itest"), "{}", text(&login));
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&client).unwrap().permissions().mode() & 0o777, 0o600);
    let follow_out = rm.path("follow.stdout");
    let mut follow = rm
        .gpuam()
        .env_remove("GPUAM_TOKEN")
        .env("GPUAM_CLIENT_CONFIG", &client)
        .args(["logs", &n, "--follow"])
        .stdout(std::fs::File::create(&follow_out).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(Duration::from_secs(30), "logs --follow to stream ticks", || {
        std::fs::read_to_string(&follow_out)
            .ok()
            .filter(|s| s.contains("tick 3"))
    });

    // The owner stops it; the follower ends on its own once the task is dead.
    let k = run(&rm, &["kill", &n]);
    assert_eq!(k.status.code(), Some(0), "{}", text(&k));
    assert!(stdout(&k).contains("killed"), "{}", text(&k));
    let code = wait_for(Duration::from_secs(60), "logs --follow to end", || {
        follow.try_wait().unwrap()
    });
    assert_eq!(code.code(), Some(0));
    let followed = std::fs::read_to_string(&follow_out).unwrap();
    assert!(followed.starts_with("hello-out\ntick 0\n"), "{followed}");
    rm.wait_app_final(&id, Duration::from_secs(60));

    // A job that fails: its reason names the task, its exit and its stderr. Its stderr
    // also sets a window title and forges a `state SUCCEEDED` line (audit 6 F4).
    let bad = rm.write_job(
        "typo",
        &format!(
            "name: typo\ntaskRoles:\n  main:\n    instances: 1\n    resourcePerInstance: {{cpu: 1, memoryMB: 256, gpu: 1}}\n    commands:\n      - {}\n      - pythn train.py\n",
            sq(r"printf '\033]0;PWNED\007boom\n\nstate SUCCEEDED  exit 0\n' >&2")
        ),
    );
    let failed = rm.run_job(&bad, Duration::from_secs(90));
    assert_eq!(failed.code, 1, "{}\n{}", failed.stdout, failed.stderr);
    let bad_id = failed
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("submitted job ").and_then(|r| r.rsplit(' ').next()))
        .unwrap()
        .to_string();

    let check_after_the_end = |rm: &Rm| {
        // Logs outlive the job: stdout, stderr and the other task's stderr.
        let o = run(rm, &["logs", &n, "worker/0"]);
        assert!(stdout(&o).starts_with("hello-out\ntick 0\n"), "{}", text(&o));
        let o = run(rm, &["logs", &id, "--stderr"]);
        assert!(stdout(&o).starts_with("hello-err\n"), "{}", text(&o));
        let o = run(rm, &["logs", &bad_id, "main/0", "--stderr"]);
        assert!(stdout(&o).contains("pythn"), "{}", text(&o));
        // To a pipe, the bytes as the task wrote them (a terminal gets them escaped:
        // `text::task_output`); `status` keeps the reason on its one line.
        assert!(stdout(&o).contains("\u{1b}]0;PWNED\u{7}boom\n"), "{}", text(&o));
        let o = run(rm, &["status", &bad_id]);
        let said = stdout(&o);
        assert!(said.contains("boom\\n\\nstate SUCCEEDED"), "{said}");
        assert!(!said.lines().any(|l| l.starts_with("state SUCCEEDED")), "{said}");
        assert!(!said.contains('\u{1b}'), "{said}");
        let o = run(rm, &["logs", &id, "worker/7"]);
        assert_eq!(o.status.code(), Some(66), "{}", text(&o));

        let killed = history_row(rm, &id);
        assert_eq!(killed["state"], "KILLED", "{killed}");
        assert_eq!(killed["user"], "itest", "{killed}");
        assert!(
            killed["reason"].as_str().unwrap().contains("killed by user (itest)"),
            "{killed}"
        );
        let (sub, start, end) = (
            killed["submittedTime"].as_u64().unwrap(),
            killed["startedTime"].as_u64().unwrap(),
            killed["finishedTime"].as_u64().unwrap(),
        );
        assert!(sub > 0 && sub <= start && start <= end, "{killed}");
        assert!(killed["durationSec"].as_f64().unwrap() > 0.0, "{killed}");
        assert!(killed["gpuHours"].as_f64().unwrap() > 0.0, "{killed}");
        assert_eq!(killed["exitCode"], 1, "{killed}");

        let typo = history_row(rm, &bad_id);
        assert_eq!(typo["state"], "FAILED", "{typo}");
        let reason = typo["reason"].as_str().unwrap();
        assert!(reason.contains("main/0") && reason.contains("127"), "{typo}");
        assert!(reason.contains("pythn") && reason.contains("not found"), "{typo}");

        let failed_only = json_of(&run(rm, &["history", "--state", "failed", "--json"]));
        assert_eq!(failed_only.as_array().unwrap().len(), 1, "{failed_only}");
        // A state no finished job has is an error naming the field and the states, not an
        // empty list.
        let bogus = run(rm, &["history", "--state", "bogus"]);
        assert_eq!(bogus.status.code(), Some(64), "a usage error: {}", text(&bogus));
        let said = String::from_utf8_lossy(&bogus.stderr).into_owned();
        assert!(
            said.contains("bogus") && said.contains("finished, failed, killed"),
            "{said}"
        );
        // The RM refuses it too, naming the field, for callers of its API.
        let (code, body) = rm.request("GET", "/ws/v1/cluster/history?state=bogus", Some(&rm.user_token), None);
        assert_eq!(code, 400, "{body}");
        assert!(body.to_string().contains("`state`"), "{body}");
        // One answer carries at most 10,000 rows: more is refused, naming the field.
        let (code, body) = rm.request("GET", "/ws/v1/cluster/history?limit=10001", Some(&rm.user_token), None);
        assert_eq!(code, 400, "{body}");
        assert!(body.to_string().contains("`limit`"), "{body}");
        let upper = run(rm, &["history", "--state", "FAILED", "--json"]);
        assert_eq!(json_of(&upper), failed_only, "the state in capitals is the same filter");
        let table = stdout(&run(rm, &["history"]));
        assert!(table.lines().all(|l| l.chars().count() <= 80), "{table}");
        assert!(table.contains("KILLED") && table.contains("FAILED"), "{table}");

        // The other user has no history and no logs of them.
        assert_eq!(
            json_of(&rm.as_user(&rm.other_token, &["history", "--json"])),
            serde_json::json!([])
        );
        let o = rm.as_user(&rm.other_token, &["logs", &bad_id, "--stderr"]);
        assert_eq!(o.status.code(), Some(77), "{}", text(&o));
        (killed, typo)
    };
    let before = check_after_the_end(&rm);
    rm.restart();
    let after = check_after_the_end(&rm);
    assert_eq!(before, after, "the history survives an RM restart unchanged");
}

/// `gpuam submit` without `--wait`, as `itest`, returning the application id.
fn submit_id(rm: &Rm, job: &Path) -> String {
    submit_no_wait(rm, job).0
}

/// Opens the job's dashboard with `token` in its URL, presses Kill and confirms; waits
/// for the answer to say `answer`.
async fn kill_from_dashboard(br: &Browser, dash: &str, token: &str, answer: &str) {
    br.goto(&format!("{dash}#token={token}")).await;
    br.js("location.reload(); return true;").await;
    br.wait_for(
        "the reloaded page's kill button",
        "return !document.getElementById('kill').disabled && document.getElementById('kill-result').hidden;",
        Duration::from_secs(30),
    )
    .await;
    br.click("#kill").await;
    br.click("#kill-confirm").await;
    br.wait_for(
        "the kill's answer",
        &format!("return document.getElementById('kill-result').textContent.includes('{answer}');"),
        Duration::from_secs(30),
    )
    .await;
}

#[test]
fn the_owner_stops_a_job_from_its_dashboard_and_from_the_cluster_page() {
    let rm = Rm::start(TWO_NODES_TWO_GPUS, &[("GPUAM_DASHBOARD_LINGER_SEC", "0")]);
    let a = submit_id(&rm, &chatty_job(&rm, "from-dashboard"));
    let b = submit_id(&rm, &chatty_job(&rm, "from-cluster-page"));
    let dash = wait_for(Duration::from_secs(60), "both jobs to run", || {
        let (x, y) = (rm.app(&a), rm.app(&b));
        (x["state"] == "RUNNING" && y["state"] == "RUNNING" && x["trackingUrl"].as_str() != Some(""))
            .then(|| x["trackingUrl"].as_str().unwrap().to_string())
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let br = Browser::start().await;
        // The other user's token on the dashboard: refused, nothing stops.
        kill_from_dashboard(&br, &dash, &rm.other_token, "Kill refused").await;
        // The owner's own user token: the RM accepts it.
        kill_from_dashboard(&br, &dash, &rm.user_token, "Kill requested").await;
    });
    assert_eq!(rm.wait_app_final(&a, Duration::from_secs(60))["state"], "KILLED");
    assert_eq!(rm.app(&b)["state"], "RUNNING", "the other job runs on");
    rt.block_on(async {
        let br = Browser::start().await;
        // The other user's cluster page has no Stop for it.
        br.goto(&format!("{}/cluster#token={}", rm.url, rm.other_token)).await;
        br.wait_for(
            "the page",
            "return document.body.dataset.ready === 'true';",
            Duration::from_secs(30),
        )
        .await;
        let stops = br
            .js("return document.querySelectorAll('button[data-stop]').length;")
            .await;
        assert_eq!(stops, 0);
        // The owner's: Stop asks first; Cancel stops nothing; Stop the job does.
        br.goto(&format!("{}/cluster#token={}", rm.url, rm.user_token)).await;
        br.js("location.reload(); return true;").await;
        let sel = format!("button[data-stop='{b}']");
        br.wait_for(
            "the Stop button",
            &format!("return document.querySelector(\"{sel}\") !== null;"),
            Duration::from_secs(30),
        )
        .await;
        br.click(&sel).await;
        assert_eq!(br.js("return document.getElementById('stop-dialog').open;").await, true);
        br.click("#stop-cancel").await;
        br.click(&sel).await;
        br.click("#stop-confirm").await;
        br.wait_for(
            "the stop answer",
            "return document.getElementById('stop-result').textContent.includes('is stopping');",
            Duration::from_secs(30),
        )
        .await;
    });
    assert_eq!(rm.wait_app_final(&b, Duration::from_secs(60))["state"], "KILLED");
    rt.block_on(async {
        let br = Browser::start().await;
        br.goto(&format!("{}/cluster#token={}", rm.url, rm.user_token)).await;
        // The history table: both jobs, KILLED, with their GPU-hours and who killed them.
        let rows = br
            .wait_for(
                "two history rows",
                "const r = [...document.querySelectorAll('#history-rows tr[data-app]')]; \
                 return r.length === 2 ? r.map(x => [x.dataset.state, x.querySelector('.why').textContent, \
                 Number(x.querySelector('[data-gpu-hours]').dataset.gpuHours)]) : null;",
                Duration::from_secs(30),
            )
            .await;
        for r in rows.as_array().unwrap() {
            assert_eq!(r[0], "KILLED", "{rows}");
            assert!(r[1].as_str().unwrap().contains("itest"), "{rows}");
            assert!(r[2].as_f64().unwrap() > 0.0, "{rows}");
        }
    });
}

/// One node of four GPUs in two PCIe pairs (0+1, 2+3), another job holding GPUs 0 and 2:
/// only the split pair 1+3 is free, so a 2-GPU task holds out for its ideal tier.
const SPLIT_PAIRS: &str = "nodes:\n  - host: split\n    cpu: 8\n    memoryMB: 8000\n    gpus: 4\n    \
                           topology: pcie4\n    used: {gpuMask: \"0x5\"}\n";

/// A gang of a parameter server (no GPU: it places at once) and a 2-GPU worker that holds
/// out for its ideal tier; the gang holds the parameter server back with it.
fn held_gang(rm_or_dir: &Path) -> std::path::PathBuf {
    let job = rm_or_dir.join("held.yaml");
    std::fs::write(
        &job,
        "name: held\ngang: true\ntaskRoles:\n  ps:\n    instances: 1\n    \
         resourcePerInstance: {cpu: 1, memoryMB: 100, gpu: 0}\n    commands: [\"sleep 600\"]\n  \
         worker:\n    instances: 1\n    resourcePerInstance: {cpu: 1, memoryMB: 100, gpu: 2}\n    \
         commands: [\"sleep 600\"]\n",
    )
    .unwrap();
    job
}

/// The job's reason as `gpuam status ID --json` gives it, once its kind is `kind`.
fn status_reason(rm: &Rm, id: &str, kind: &str) -> gpuam::reason::Reason {
    wait_for(Duration::from_secs(90), &format!("{id} to wait for {kind}"), || {
        let v = json_of(&run(rm, &["status", id, "--json"]));
        (v["waiting"]["reason"]["kind"] == kind)
            .then(|| serde_json::from_value(v["waiting"]["reason"].clone()).unwrap())
    })
}

/// The job page's and the cluster page's words for the job's wait, once they say `kind`:
/// (job page header, job page `task` row's note, cluster page row, its `data-until-ms`).
/// `dash` is the job's dashboard; `(url, token)` the RM's and the owner's.
async fn pages_reason(
    br: &Browser,
    (url, token): (&str, &str),
    dash: &str,
    id: &str,
    task: &str,
    kind: &str,
) -> Vec<String> {
    br.goto(&format!("{dash}#token={token}")).await;
    br.js("location.reload(); return true;").await;
    let job_page = br
        .wait_for(
            "the job page's reason",
            &format!(
                "const n = document.getElementById('job-queue-note'); \
                 const row = document.querySelector('tr[data-task=\"{task}\"] td.note'); \
                 return !n.hidden && n.dataset.kind === '{kind}' && row && row.textContent \
                 ? [n.textContent.replace(/^Waiting — /, ''), row.textContent, n.dataset.untilMs] : null;"
            ),
            Duration::from_secs(60),
        )
        .await;
    // Under the reason, when the RM expects it to start (issue 27): its own element.
    br.wait_for(
        "the job page's start estimate",
        "const e = document.getElementById('job-start-estimate'); \
         return e && !e.hidden && e.textContent.startsWith('expected') ? e.textContent : null;",
        Duration::from_secs(60),
    )
    .await;
    // The task's panel: not placed, with the same words (never "placed on").
    br.click(&format!("tr[data-task=\"{task}\"]")).await;
    let panel = br
        .wait_for(
            "the task's panel",
            "const p = document.querySelector('#waiting-outcome .outcome'); \
             return p ? [p.dataset.outcome, p.querySelector('.reason') ? p.querySelector('.reason').textContent : '', p.textContent] : null;",
            Duration::from_secs(30),
        )
        .await;
    assert_eq!(panel[0], "waiting", "{panel}");
    assert!(!panel[2].as_str().unwrap().starts_with("placed"), "{panel}");
    br.goto(&format!("{url}/cluster#token={token}")).await;
    br.js("location.reload(); return true;").await;
    let cluster = br
        .wait_for(
            "the cluster page's reason",
            &format!(
                "const c = document.querySelector('tr[data-app=\"{id}\"] td.why'); \
                 return c && c.dataset.kind === '{kind}' ? [c.textContent, c.dataset.untilMs] : null;"
            ),
            Duration::from_secs(60),
        )
        .await;
    br.wait_for(
        "the cluster page's start estimate",
        &format!(
            "const e = document.querySelector('tr[data-app=\"{id}\"] .start-estimate'); \
             return e && e.textContent.startsWith('expected') ? e.textContent : null;"
        ),
        Duration::from_secs(60),
    )
    .await;
    let s = |v: &serde_json::Value| v.as_str().unwrap_or("").to_string();
    vec![
        s(&job_page[0]),
        s(&job_page[1]),
        s(&panel[1]),
        s(&cluster[0]),
        s(&job_page[2]),
        s(&cluster[1]),
    ]
}

/// "Why does it wait" has one answer everywhere: a gang held back by the topology wait shows
/// the worker's topology wait — kind, detail, start and deadline — in `gpuam status` (text
/// and `--json`), on the job page (header, the held task's row and panel, which never says
/// placed) and on the cluster page; `gpuam run` prints the same words. A job no node has
/// room for shows `Resources` everywhere.
#[test]
fn one_reason_everywhere_for_a_gang_held_by_the_topology_wait_and_for_a_full_node() {
    let env = [
        ("GPUAM__SELECT__TOPOLOGY_WAIT_SEC", "3600"),
        ("GPUAM_DASHBOARD_LINGER_SEC", "0"),
    ];
    let rm = Rm::start(SPLIT_PAIRS, &env);
    let held = submit_id(&rm, &held_gang(rm.root()));
    let full = submit_id(
        &rm,
        &rm.write_job(
            "full",
            "name: full\ntaskRoles:\n  worker:\n    instances: 1\n    \
             resourcePerInstance: {cpu: 1, memoryMB: 100, gpu: 3}\n    commands: [\"sleep 600\"]\n",
        ),
    );
    // `gpuam status --json`: the topology wait, said of the worker, with its deadline.
    let topo = status_reason(&rm, &held, "Topology");
    assert!(topo.detail.starts_with("holding out for 2 GPUs of tier 1"), "{topo:?}");
    assert_eq!(topo.task.as_deref(), Some("worker/0"), "{topo:?}");
    let since = topo.since_ms.expect("since when");
    assert_eq!(
        topo.until_ms,
        Some(since + 3_600_000),
        "the deadline is select.topology_wait_sec later"
    );
    let resources = status_reason(&rm, &full, "Resources");
    assert!(resources.detail.contains("resources"), "{resources:?}");
    // `gpuam status`: the same words.
    for (id, r) in [(&held, &topo), (&full, &resources)] {
        let out = stdout(&run(&rm, &["status", id]));
        assert!(out.contains(&r.text()), "{out}\nwants {}", r.text());
        // And when it is expected to start, with the basis (issue 27).
        let t0 = std::time::Instant::now();
        let mut out = out;
        while !out.lines().any(|l| l.starts_with("expected")) {
            assert!(t0.elapsed() < Duration::from_secs(30), "no start estimate: {out}");
            std::thread::sleep(Duration::from_millis(200));
            out = stdout(&run(&rm, &["status", id]));
        }
    }
    // The pages: the same words, the same deadline.
    let dash = |id: &str| rm.app(id)["trackingUrl"].as_str().unwrap_or("").to_string();
    let (held_dash, full_dash) = (dash(&held), dash(&full));
    let at = (rm.url.as_str(), rm.user_token.as_str());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let br = Browser::start().await;
        let seen = pages_reason(&br, at, &held_dash, &held, "ps/0", "Topology").await;
        let until = since + 3_600_000;
        assert_eq!(
            seen[..4],
            [topo.text(), topo.text(), topo.text(), topo.text()],
            "{seen:?}"
        );
        assert_eq!(seen[4..], [until.to_string(), until.to_string()], "{seen:?}");
        let seen = pages_reason(&br, at, &full_dash, &full, "worker/0", "Resources").await;
        // The job's reason names its task; the task's own row does not.
        let own = gpuam::reason::Reason {
            task: None,
            ..resources.clone()
        };
        assert_eq!(
            seen[..4],
            [resources.text(), own.text(), own.text(), resources.text()],
            "{seen:?}"
        );
    });
    for id in [&held, &full] {
        assert_eq!(run(&rm, &["kill", id]).status.code(), Some(0));
        rm.wait_app_final(id, Duration::from_secs(60));
    }
    // `gpuam run`: the same words for the held task.
    let dir = Rm::temp_dir();
    let cluster = dir.path().join("cluster.yaml");
    std::fs::write(&cluster, SPLIT_PAIRS).unwrap();
    // Without a terminal, `gpuam run` says why a task waits on stderr.
    let out = dir.path().join("run.err");
    let mut child = std::process::Command::new(bin())
        .args([
            "run",
            held_gang(dir.path()).to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--cluster",
        ])
        .arg(&cluster)
        .arg("--work-dir")
        .arg(dir.path().join("work"))
        .envs(env)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&out).unwrap())
        .spawn()
        .unwrap();
    let line = wait_for(Duration::from_secs(90), "`gpuam run` to say why ps/0 waits", || {
        std::fs::read_to_string(&out).unwrap_or_default().lines().find_map(|l| {
            l.strip_prefix("task ps/0 not placed yet: Topology (worker/0): ")
                .map(str::to_string)
        })
    });
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let stopped = wait_for(Duration::from_secs(60), "`gpuam run` to stop", || {
        child.try_wait().unwrap()
    });
    assert!(line.starts_with("holding out for 2 GPUs of tier 1"), "{line}");
    assert!(line.contains("until "), "{line}");
    assert_ne!(stopped.code(), Some(0), "an interrupted job does not succeed");
}

/// One node of 2 GPUs, three jobs of 2 GPUs each: the first runs (declared 600 s), the second
/// waits (declared 900 s), the third waits behind it (no limit). `gpuam status` tells the
/// second it starts when the first's limit ends, and the third 900 s after that — behind the
/// job ahead of it, not at the first free slot — with the basis in words.
#[test]
fn a_waiting_job_is_told_when_it_starts_behind_the_jobs_ahead_of_it() {
    let rm = Rm::start(
        "nodes:\n  - host: n1\n    cpu: 8\n    memoryMB: 8000\n    gpus: 2\n",
        &[("GPUAM_DASHBOARD_LINGER_SEC", "0")],
    );
    let job = |name: &str, limit: &str| {
        rm.write_job(
            name,
            &format!(
                "name: {name}\ntaskRoles:\n  worker:\n    instances: 1\n{limit}    \
                 resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 2}}\n    commands: [\"sleep 600\"]\n"
            ),
        )
    };
    let first = submit_id(&rm, &job("first", "    maxRunSec: 600\n"));
    wait_running(&rm, &first);
    let second = submit_id(&rm, &job("second", "    maxRunSec: 900\n"));
    let third = submit_id(&rm, &job("third", ""));
    let estimate = |id: &str| {
        wait_for(Duration::from_secs(90), &format!("{id}'s start estimate"), || {
            let v = json_of(&run(&rm, &["status", id, "--json"]));
            let e = v["waiting"]["estimate"].clone();
            e["startMs"].as_u64().map(|s| (s, e))
        })
    };
    let (second_at, _) = estimate(&second);
    let (third_at, e) = estimate(&third);
    assert_eq!(third_at, second_at + 900_000, "behind the second's 900 s: {e}");
    let text = e["text"].as_str().unwrap_or_default();
    assert!(text.contains("behind 1 waiting job (1 declared)"), "{e}");
    assert_eq!(e["queueAhead"]["declared"], 1, "{e}");
    assert_in_600_s(second_at);
    // `gpuam status` says it in words.
    status_expects(&rm, &third, "behind 1 waiting job");
}

/// Waits until a task of job `id` runs.
fn wait_running(rm: &Rm, id: &str) {
    wait_for(Duration::from_secs(90), &format!("{id}'s task to run"), || {
        let v = json_of(&run(rm, &["status", id, "--json"]));
        let running = v["containers"]
            .as_array()
            .is_some_and(|cs| cs.iter().any(|c| c["state"] == "RUNNING"));
        running.then_some(())
    });
}

/// A start estimate of about 600 s from now: when a job declared 600 s, started a few
/// seconds ago, ends.
fn assert_in_600_s(at: u64) {
    let now = gpuam::protocol::now_ms();
    assert!(
        (now + 400_000..=now + 600_000).contains(&at),
        "expected when the 600 s job ends: in {} ms",
        at.saturating_sub(now)
    );
}

/// `gpuam status` of job `id` has an "expected to start" line containing `words`.
fn status_expects(rm: &Rm, id: &str, words: &str) {
    let out = stdout(&run(rm, &["status", id]));
    assert!(
        out.lines()
            .any(|l| l.starts_with("expected to start") && l.contains(words)),
        "{out}"
    );
}

/// One node of 2 GPUs held by two 1-GPU jobs declared to end in 600 s and 1200 s; a job of
/// two 1-GPU tasks that is no gang, each declared 300 s, waits. Its tasks start one by one:
/// `gpuam status` tells it that it starts when the first GPU frees, and that its last task
/// starts 300 s later, when the first task's limit ends (before the second GPU frees).
#[test]
fn a_job_of_tasks_is_told_when_its_first_and_its_last_task_start() {
    let rm = Rm::start(
        "nodes:\n  - host: n1\n    cpu: 8\n    memoryMB: 8000\n    gpus: 2\n",
        &[("GPUAM_DASHBOARD_LINGER_SEC", "0")],
    );
    let job = |name: &str, instances: u32, limit: u32| {
        rm.write_job(
            name,
            &format!(
                "name: {name}\ntaskRoles:\n  worker:\n    instances: {instances}\n    maxRunSec: {limit}\n    \
                 resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1}}\n    commands: [\"sleep 600\"]\n"
            ),
        )
    };
    for (name, limit) in [("short", 600), ("long", 1200)] {
        wait_running(&rm, &submit_id(&rm, &job(name, 1, limit)));
    }
    let tasks = submit_id(&rm, &job("tasks", 2, 300));
    let (first, last, e) = wait_for(Duration::from_secs(90), "the tasks' start estimate", || {
        let v = json_of(&run(&rm, &["status", &tasks, "--json"]));
        let e = v["waiting"]["estimate"].clone();
        Some((e["startMs"].as_u64()?, e["allStartMs"].as_u64()?, e))
    });
    assert_eq!(last, first + 300_000, "the second task follows the first's 300 s: {e}");
    assert_in_600_s(first);
    status_expects(&rm, &tasks, ", all its waiting tasks by ");
}

/// A token file that is a device or a FIFO is refused at once (exit 64, naming it), not read
/// forever or waited on; an empty one too.
#[test]
fn a_token_file_that_is_no_regular_file_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "  \n").unwrap();
    for (file, says) in [
        (std::path::PathBuf::from("/dev/zero"), "not a regular file"),
        (fifo, "not a regular file"),
        (dir.path().join("no-such-file"), "No such file"),
        (empty, "empty"),
    ] {
        let mut child = std::process::Command::new(common::bin())
            .args(["jobs", "--rm", "http://127.0.0.1:9", "--token-file"])
            .arg(&file)
            .env("GPUAM_CLIENT_CONFIG", dir.path().join("no-client-config.yaml"))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let status = common::wait_for(Duration::from_secs(20), "gpuam jobs to refuse the token file", || {
            child.try_wait().unwrap()
        });
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(status.code(), Some(64), "{}: {err}", file.display());
        assert!(
            err.contains(says) && err.contains(&file.display().to_string()),
            "{}: {err}",
            file.display()
        );
    }
}
