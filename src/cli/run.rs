//! `gpuam run` and `gpuam submit`: submit a job over the RM's REST API and follow it
//! on the terminal (progress, each task's exit, the dashboard's address, the job's
//! exit code).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;

use crate::am::random_token;
use crate::am::rm_client::RmClient;
use crate::config::{Settings, TlsSettings};
use crate::exit;
use crate::node::executor::LogStream;
use crate::protocol::{AppState, SubmitApplication};

use super::task_output::{prefix, stderr_tail, Follow, ReadLog};

/// Longest wait for an answer from the AM's dashboard.
const DASHBOARD_TIMEOUT: Duration = Duration::from_secs(10);

/// The tokens a command talks to the RM with.
#[derive(Clone, Debug, Default)]
pub struct Credentials {
    /// The user's token (`--token-file`, `GPUAM_TOKEN`): submit, follow, kill.
    pub user: Option<String>,
    /// The admin token (`--admin-token-file`, `GPUAM_ADMIN_TOKEN`): kill on Ctrl-C.
    pub admin: Option<String>,
}

/// The user `gpuam run`'s embedded RM knows the caller as: the login name, else `local`.
fn local_user() -> String {
    let name = std::env::var("USER").unwrap_or_default();
    if crate::rm::users::check_user_name(&name).is_ok() {
        name
    } else {
        "local".to_string()
    }
}

/// How `gpuam run` shows a job: its tasks' output, and how long the dashboard stays up.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunView {
    /// Do not stream the tasks' output (`--quiet-tasks`); a failed task's stderr tail is
    /// still shown.
    pub quiet_tasks: bool,
    /// Seconds the dashboard stays up after the job ends (`--linger`, else
    /// `GPUAM_DASHBOARD_LINGER_SEC`); `None`: [`linger_after`]'s default.
    pub linger: Option<u64>,
}

/// The name of the variable that sets how long a dashboard stays up after its job.
pub const LINGER_ENV: &str = "GPUAM_DASHBOARD_LINGER_SEC";
/// How long `gpuam run`'s AM may keep its dashboard up: `gpuam run` ends it sooner, when
/// its own linger is over (its embedded RM stops the AM).
pub const RUN_AM_LINGER_SEC: u64 = 24 * 3600;
/// The default linger after a failed job: time to open the dashboard and read why.
pub const FAILED_LINGER_SEC: u64 = 60;

/// Seconds `gpuam run` keeps the dashboard after the job: as asked, else
/// [`FAILED_LINGER_SEC`] after a failure and none after a success.
pub fn linger_after(asked: Option<u64>, exit_code: i32) -> u64 {
    asked.unwrap_or(if exit_code == exit::SUCCESS {
        0
    } else {
        FAILED_LINGER_SEC
    })
}

pub async fn run(
    job: &Path,
    cluster: Option<&Path>,
    listen: SocketAddr,
    work_dir: Option<PathBuf>,
    settings: &Settings,
    view: RunView,
) -> i32 {
    let (spec, text) = match super::load_job(job) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let nodes = match super::load_cluster(cluster) {
        Ok(n) => n,
        Err(code) => return code,
    };
    // What earlier runs killed together with their reapers left (their AMs and tasks, on
    // GPUs this run is about to grant again) is ended first.
    for (dir, n) in super::reap::sweep(&std::env::temp_dir(), work_dir.as_deref()) {
        if n > 0 {
            eprintln!(
                "gpuam run: ended {n} process(es) left by an earlier run that was killed with its reaper ({})",
                dir.display()
            );
        }
    }
    // A fresh directory of a name nobody could guess and make first (mkdtemp: random, 0700,
    // created here): a predictable `/tmp/gpuam-run-PID` could be another user's, made
    // ahead with a link in it that root would follow.
    let work_dir = match work_dir {
        Some(d) => d,
        None => match tempfile::Builder::new().prefix(super::reap::WORK_DIR_PREFIX).tempdir() {
            Ok(d) => d.keep(),
            Err(e) => {
                eprintln!(
                    "error: cannot make a work directory under {}: {e}",
                    std::env::temp_dir().display()
                );
                return exit::INTERNAL;
            }
        },
    };
    let tls = match crate::tls::server_config_from_settings(&settings.tls) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: TLS: {e}");
            return exit::INVALID_INPUT;
        }
    };
    // What ends the run's AM and tasks if this process is killed (`reap`); canonical, as
    // the RM names its cgroups after it.
    let reaper = match std::fs::create_dir_all(&work_dir)
        .and_then(|()| std::fs::canonicalize(&work_dir))
        .and_then(|d| super::reap::Reaper::start(&d).map(|r| (r, d)))
    {
        Ok(r) => Some(r),
        Err(e) => {
            eprintln!(
                "warning: no reaper for this run ({e}): if it is killed with SIGKILL, its AM and tasks outlive it"
            );
            None
        }
    };
    // The embedded RM makes its own user and token, so a newcomer needs nothing.
    let (user, token) = (local_user(), crate::auth::new_token());
    let mut users = crate::rm::users::Users::default();
    if let Err(e) = users.insert_token(&user, &token) {
        eprintln!("error: {e}");
        return exit::INTERNAL;
    }
    // The embedded RM is this user's alone: the dashboard port they asked for is theirs.
    let own;
    let settings = if listen.port() != 0 {
        let mut s = settings.clone();
        s.rm.dashboard_ports = Some(listen.port().to_string());
        own = s;
        &own
    } else {
        settings
    };
    let opts = match crate::rm::RmOptions::from_settings(
        settings,
        nodes,
        SocketAddr::from(([127, 0, 0, 1], 0)),
        work_dir.clone(),
    ) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: invalid settings: {e}");
            return exit::INVALID_INPUT;
        }
    };
    let rm = match crate::rm::start(crate::rm::RmOptions {
        // The in-process node's shim, where it has no cgroup: this very executable.
        shim_exe: std::env::current_exe().ok(),
        // The embedded RM lives and dies with this one job: nothing to recover later.
        state_dir: None,
        // Its users are the one it makes for this run, never a users file.
        users_file: None,
        tls,
        users,
        ..opts
    })
    .await
    {
        Ok(h) => h,
        Err(e) => {
            eprintln!("error: cannot start the embedded RM: {e:#}");
            return exit::INTERNAL;
        }
    };
    println!(
        "rm: {} (containers and logs under {})",
        rm.base_url(),
        work_dir.display()
    );
    // The tasks run on this process's own node: their output is read where it is written.
    let read = |id: &str, stream, offset, max| rm.read_local_log(id, stream, offset, max).map_err(|e| e.to_string());
    let output = TaskOutput {
        read: &read,
        quiet: view.quiet_tasks,
    };
    let (code, dashboard) = match rm_client(&rm.base_url(), &settings.tls) {
        Ok(client) => {
            submit_and_follow(
                client.with_user_token(Some(token)),
                &spec.name,
                &text,
                &job.display().to_string(),
                None,
                listen,
                Some(rm.admin_token().to_string()),
                Some(output),
            )
            .await
        }
        Err(code) => (code, None),
    };
    // The AM keeps its dashboard up until the embedded RM (which serves the task logs)
    // stops it, so the page stays whole for as long as we wait here.
    let secs = linger_after(view.linger, code);
    if let (Some(url), true) = (dashboard, secs > 0) {
        println!("the dashboard stays up for {secs} s at {url} (--linger SECS); Ctrl-C to leave now");
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(secs)) => {}
            _ = crate::node::agent::shutdown_signal() => {}
        }
    }
    rm.shutdown().await;
    // Everything of the run is stopped: nothing for the reaper to do.
    if let Some((r, dir)) = reaper {
        r.done(&dir);
    }
    code
}

/// Where `gpuam run` reads its tasks' output, and whether it streams it.
#[derive(Clone, Copy)]
pub struct TaskOutput<'a> {
    pub read: ReadLog<'a>,
    pub quiet: bool,
}

/// How long `submit --wait` keeps following a job while the RM does not answer (an RM
/// restart keeps the job running).
const RM_OUTAGE_WAIT: Duration = Duration::from_secs(300);

pub async fn submit(
    job: &Path,
    target: &super::target::Target,
    wait: bool,
    listen: SocketAddr,
    creds: Credentials,
    tls: &TlsSettings,
) -> i32 {
    let (spec, text) = match super::load_job(job) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let rm = match rm_client(&target.rm, tls) {
        Ok(c) => c.with_user_token(creds.user),
        Err(code) => return code,
    };
    submit_and_follow(
        rm,
        &spec.name,
        &text,
        &job.display().to_string(),
        (!wait).then_some(target.flags.as_str()),
        listen,
        creds.admin,
        None,
    )
    .await
    .0
}

/// An RM client trusting the settings' CA; `Err` is the exit code.
fn rm_client(rm_url: &str, tls: &TlsSettings) -> Result<RmClient, i32> {
    RmClient::with_tls(rm_url, tls).map_err(|e| {
        eprintln!("error: TLS: {e}");
        exit::INVALID_INPUT
    })
}

/// Submits the job; then follows it to its end (`print_only: None`), or prints the
/// commands that follow it, with `print_only`'s flags, and returns: the exit code and the
/// dashboard URL (with its token) last seen.
#[allow(clippy::too_many_arguments)]
async fn submit_and_follow(
    rm: RmClient,
    name: &str,
    text: &str,
    source: &str,
    print_only: Option<&str>,
    listen: SocketAddr,
    admin_token: Option<String>,
    output: Option<TaskOutput<'_>>,
) -> (i32, Option<String>) {
    let rm_url = rm.base_url();
    let app = match rm.new_application().await {
        Ok(a) => a,
        Err(e) => return (refused(&rm, &e), None),
    };
    let job_token = random_token();
    let submit = SubmitApplication {
        application_id: app.application_id.clone(),
        job_spec: text.to_string(),
        job_spec_name: Some(source.to_string()),
        dashboard_listen: Some(listen.to_string()),
        job_token: Some(job_token.clone()),
    };
    // A busy RM (its spec checks all taken: 429) is asked again a few times before the
    // user is told to try later.
    let mut tries = 0;
    let report = loop {
        match rm.submit(&submit).await {
            Ok(r) => break r,
            Err(e) if e.status() == Some(429) && tries < 5 => {
                tries += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => return (refused(&rm, &e), None),
        }
    };
    println!("submitted job `{name}` as {}", report.id);
    if let Some(flags) = print_only {
        let n = super::rm_api::job_number(&report.id);
        println!("  gpuam status {n}{flags}          its tasks, and why it waits");
        println!("  gpuam logs {n} --follow{flags}  its first task's output (ROLE/INDEX for another)");
        println!("  gpuam kill {n}{flags}            stop it");
        println!(
            "(REST: {rm_url}/ws/v1/cluster/apps/{} with `Authorization: Bearer <your token>`)",
            report.id
        );
        return (exit::SUCCESS, None);
    }
    follow(&rm, &report.id, &job_token, admin_token.as_deref(), output).await
}

/// Says why the RM refused (with how to get a token when that is the reason); the exit code.
pub(crate) fn refused(rm: &RmClient, e: &crate::am::rm_client::RmError) -> i32 {
    eprintln!("error: {e}");
    if matches!(e.status(), Some(401)) && !rm.has_user_token() {
        eprintln!(
            "hint: no token was given: put yours in a file and pass --token-file FILE, or set {}",
            super::USER_TOKEN_ENV
        );
    }
    e.exit_code()
}

/// Counts of tasks per coarse state, from the AM's snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counts {
    waiting: u64,
    running: u64,
    succeeded: u64,
    failed: u64,
    total: u64,
}

fn counts(job: &Value) -> Counts {
    let mut c = Counts {
        total: job["totalTasks"].as_u64().unwrap_or(0),
        ..Default::default()
    };
    for r in job["roles"].as_array().into_iter().flatten() {
        let n = |k: &str| r[k].as_u64().unwrap_or(0);
        c.waiting += n("waiting") + n("requested") + n("allocated");
        c.running += n("running");
        c.succeeded += n("succeeded");
        c.failed += n("failed");
    }
    c
}

/// Follows an application to its end: progress, each task's exit (and, with `output`, its
/// output as it comes), the final state; the exit code and the dashboard URL.
async fn follow(
    rm: &RmClient,
    app_id: &str,
    job_token: &str,
    admin_token: Option<&str>,
    output: Option<TaskOutput<'_>>,
) -> (i32, Option<String>) {
    // The dashboard is served with the same TLS settings as the RM: the same trust.
    let http = rm.http().clone();
    let tty = std::io::stderr().is_terminal();
    let bar = tty.then(|| {
        let b = ProgressBar::new(0);
        b.set_style(
            ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} done  {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.enable_steady_tick(Duration::from_millis(120));
        b
    });
    let say = |line: String| match &bar {
        Some(b) => b.println(line),
        None => eprintln!("{line}"),
    };
    // A task's line: above the progress bar on a terminal, else stdout to stdout and
    // stderr to stderr.
    let print_task_line = |stream: LogStream, line: String| match (&bar, stream) {
        (Some(b), _) => b.println(line),
        (None, LogStream::Stdout) => println!("{line}"),
        (None, LogStream::Stderr) => eprintln!("{line}"),
    };
    let mut streams = Follow::default();
    // Containers of tasks whose container has not ended, from the last snapshot.
    let mut live: HashSet<String> = HashSet::new();
    // role/index → (container, exit code) of tasks whose last attempt failed.
    let mut failed: BTreeMap<String, (String, i64)> = BTreeMap::new();
    let started = Instant::now();
    let mut dashboard: Option<String> = None;
    let mut last_counts = Counts::default();
    // (role/index) → what was seen of it last.
    let mut seen: HashMap<String, SeenTask> = HashMap::new();
    let mut unreachable_since: Option<Instant> = None;
    let mut interrupted = false;
    // Ctrl-C, SIGTERM or SIGHUP: kill the job and follow it to its end, so that `gpuam
    // run` leaves no task and no AM behind (its embedded RM then shuts down).
    let ctrl_c = crate::node::agent::shutdown_signal();
    tokio::pin!(ctrl_c);
    loop {
        let report = match rm.app(app_id).await {
            Ok(r) => {
                if unreachable_since.take().is_some() {
                    say("the RM is back".to_string());
                }
                r
            }
            Err(e) if e.is_unreachable() => {
                // An RM restart keeps the job running: wait for it to come back.
                let since = *unreachable_since.get_or_insert_with(|| {
                    say(format!(
                        "the RM is unreachable ({e}); the job keeps running, waiting up to {} s for the RM",
                        RM_OUTAGE_WAIT.as_secs()
                    ));
                    Instant::now()
                });
                if since.elapsed() > RM_OUTAGE_WAIT {
                    eprintln!("error: {e}; job {app_id} may still be running: `gpuam submit` can no longer follow it");
                    return (
                        exit::RM_UNREACHABLE,
                        dashboard.map(|u| format!("{u}#token={job_token}")),
                    );
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            Err(e) => return (refused(rm, &e), dashboard.map(|u| format!("{u}#token={job_token}"))),
        };
        // A new AM attempt (after the AM died) serves its dashboard elsewhere.
        if !report.tracking_url.is_empty() && dashboard.as_deref() != Some(report.tracking_url.as_str()) {
            let url = report.tracking_url.clone();
            if dashboard.is_some() {
                say(format!(
                    "the AM restarted (attempt {}); new dashboard below",
                    report.attempt
                ));
            }
            println!("dashboard: {url}#token={job_token}");
            dashboard = Some(url);
        }
        if let Some(url) = &dashboard {
            if let Ok(resp) = http
                .get(format!("{url}api/v1/snapshot?nodes=0"))
                .bearer_auth(job_token)
                .timeout(DASHBOARD_TIMEOUT)
                .send()
                .await
            {
                if let Ok(snap) = resp.json::<Value>().await {
                    let c = counts(&snap["job"]);
                    if let Some(b) = &bar {
                        b.set_length(c.total);
                        b.set_position(c.succeeded + c.failed);
                        b.set_message(format!(
                            "waiting {} running {} succeeded {} failed {}",
                            c.waiting, c.running, c.succeeded, c.failed
                        ));
                    } else if c != last_counts {
                        eprintln!(
                            "[{:>6.1}s] waiting {} running {} succeeded {} failed {} (of {})",
                            started.elapsed().as_secs_f64(),
                            c.waiting,
                            c.running,
                            c.succeeded,
                            c.failed,
                            c.total
                        );
                    }
                    last_counts = c;
                    live.clear();
                    for t in snap["tasks"].as_array().into_iter().flatten() {
                        report_task_change(t, &mut seen, &say);
                        if output.is_some() {
                            note_task_output(t, &mut streams, &mut live, &mut failed);
                        }
                    }
                }
            }
        }
        let job_over = report.state.is_final();
        if let Some(out) = &output {
            let ended = |id: &str| job_over || !live.contains(id);
            for (stream, line) in streams.poll(out.read, &ended) {
                if !out.quiet {
                    print_task_line(stream, line);
                }
            }
        }
        if job_over {
            if let Some(b) = &bar {
                b.finish_and_clear();
            }
            let code = report
                .exit_code
                .unwrap_or(if report.state == AppState::Finished { 0 } else { 1 });
            println!(
                "job {} {:?} after {:.1}s (exit {code}){}",
                report.id,
                report.final_status,
                started.elapsed().as_secs_f64(),
                if report.diagnostics.is_empty() {
                    String::new()
                } else {
                    format!(": {}", report.diagnostics)
                }
            );
            if let (Some(out), false, false) = (&output, code == 0, interrupted) {
                for line in failed_tails(out.read, &failed) {
                    eprintln!("{line}");
                }
            }
            let code = if code == 0 { exit::SUCCESS } else { exit::JOB_FAILED };
            return (code, dashboard.map(|u| format!("{u}#token={job_token}")));
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(300)) => {}
            _ = &mut ctrl_c, if !interrupted => {
                interrupted = true;
                say("interrupted: killing the job".to_string());
                kill_job(rm, &http, app_id, job_token, admin_token, dashboard.as_deref()).await;
            }
        }
    }
}

/// Most failed tasks whose stderr tail `gpuam run` shows at the end.
const FAILED_TASKS_SHOWN: usize = 3;

/// From one task of a snapshot: follows its container's output, marks it live while its
/// container runs, and remembers it when its last attempt failed.
fn note_task_output(
    t: &Value,
    streams: &mut Follow,
    live: &mut HashSet<String>,
    failed: &mut BTreeMap<String, (String, i64)>,
) {
    let Some(container) = t["containerId"].as_str() else {
        return;
    };
    let role = t["role"].as_str().unwrap_or("?");
    let index = t["index"].as_u64().unwrap_or(0);
    let key = format!("{role}/{index}");
    streams.watch(container, &prefix(role, index, t["attempt"].as_u64().unwrap_or(1)));
    let state = t["state"].as_str().unwrap_or("");
    if !matches!(state, "CONTAINER_COMPLETED" | "TASK_COMPLETED") {
        live.insert(container.to_string());
    }
    // A task stopped because the job ended (a worker beside the failed one) did not fail.
    let stopped = i64::from(crate::am::exits::code::CONTAINER_KILLED_ON_APP_COMPLETION);
    match t["exitCode"].as_i64() {
        Some(code) if code != 0 && code != stopped && state == "TASK_COMPLETED" => {
            failed.insert(key, (container.to_string(), code));
        }
        _ => {
            failed.remove(&key);
        }
    }
}

/// The final lines of a failed job: the last lines of each failed task's stderr (the first
/// few tasks), so that a mistyped command says why at once.
fn failed_tails(read: ReadLog<'_>, failed: &BTreeMap<String, (String, i64)>) -> Vec<String> {
    let mut out = Vec::new();
    for (task, (container, code)) in failed.iter().take(FAILED_TASKS_SHOWN) {
        let tail = stderr_tail(read, container);
        if tail.is_empty() {
            out.push(format!("task {task} exited with {code}; its stderr is empty"));
            continue;
        }
        out.push(format!("task {task} exited with {code}; the last lines of its stderr:"));
        out.extend(tail.into_iter().map(|l| format!("  {l}")));
    }
    if failed.len() > FAILED_TASKS_SHOWN {
        out.push(format!(
            "({} more failed tasks; their logs are in the dashboard)",
            failed.len() - FAILED_TASKS_SHOWN
        ));
    }
    out
}

/// Kills the job at the RM with the admin token when known, else as its owner (the user
/// token), else with the job token (the RM accepts the token given at submission); if the
/// RM refuses, through the dashboard's job-token kill.
async fn kill_job(
    rm: &RmClient,
    http: &reqwest::Client,
    app_id: &str,
    job_token: &str,
    admin_token: Option<&str>,
    dashboard: Option<&str>,
) {
    let token = admin_token.or(rm.user_token()).unwrap_or(job_token);
    let err = match rm.kill(app_id, token).await {
        Ok(_) => return,
        Err(e) => e,
    };
    if let Some(url) = dashboard {
        let via_dashboard = http
            .post(format!("{url}api/v1/job/kill"))
            .timeout(DASHBOARD_TIMEOUT)
            .bearer_auth(job_token)
            .send()
            .await;
        if matches!(&via_dashboard, Ok(r) if r.status().is_success()) {
            return;
        }
    }
    eprintln!("error: could not kill {app_id}: {err}");
}

/// Prints a line when a task completes an attempt (its exit) or finishes for good.
/// What `gpuam run` last saw of a task: its attempt, state and why it waits.
#[derive(Clone, Debug, Default, PartialEq)]
struct SeenTask {
    attempt: u64,
    state: String,
    waiting: Option<String>,
}

fn report_task_change(t: &Value, seen: &mut HashMap<String, SeenTask>, say: &impl Fn(String)) {
    let key = format!(
        "{}/{}",
        t["role"].as_str().unwrap_or("?"),
        t["index"].as_u64().unwrap_or(0)
    );
    let attempt = t["attempt"].as_u64().unwrap_or(1);
    let state = t["state"].as_str().unwrap_or("").to_string();
    // The task's reason (`reason::Reason`), in the words every surface shows.
    let waiting = (state == "TASK_WAITING")
        .then(|| serde_json::from_value::<crate::reason::Reason>(t["reason"].clone()).ok())
        .flatten()
        .map(|r| r.text());
    let now = SeenTask {
        attempt,
        state: state.clone(),
        waiting: waiting.clone(),
    };
    let prev = seen.insert(key.clone(), now);
    // A waiting task says why, once per reason (e.g. the topology wait, a full cluster).
    if let Some(why) = &waiting {
        if prev.as_ref().and_then(|p| p.waiting.as_ref()) != Some(why) {
            say(format!("task {key} not placed yet: {why}"));
        }
    }
    let prev = prev.map(|p| (p.attempt, p.state));
    let gpus = t["gpus"]
        .as_array()
        .map(|g| {
            g.iter()
                .filter_map(Value::as_u64)
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default();
    let host = t["host"].as_str().unwrap_or("-");
    match prev {
        Some((a, _)) if a < attempt => say(format!(
            "task {key} attempt {a} ended ({}); retrying as attempt {attempt}",
            t["exitDiagnostics"].as_str().unwrap_or("exited")
        )),
        Some((_, s)) if s != "TASK_COMPLETED" && state == "TASK_COMPLETED" => say(format!(
            "task {key} on {host} GPUs [{gpus}] finished: exit {} {}",
            t["exitCode"]
                .as_i64()
                .map(|c| c.to_string())
                .unwrap_or_else(|| "-".into()),
            t["exitDiagnostics"].as_str().unwrap_or("")
        )),
        None if state == "CONTAINER_RUNNING" => say(format!("task {key} running on {host} GPUs [{gpus}]")),
        Some((_, s)) if s != "CONTAINER_RUNNING" && state == "CONTAINER_RUNNING" => {
            say(format!("task {key} running on {host} GPUs [{gpus}]"))
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `gpuam run` says why a task waits, once per reason, then that it runs.
    #[test]
    fn a_waiting_task_says_why_once_per_reason() {
        let lines = std::cell::RefCell::new(Vec::new());
        let say = |l: String| lines.borrow_mut().push(l);
        let mut seen = HashMap::new();
        let waiting = |kind: &str, why: &str| {
            let reason = serde_json::json!({"kind": kind, "detail": why, "sinceMs": 0, "untilMs": 300_000});
            serde_json::json!({"role": "w", "index": 0, "attempt": 1, "state": "TASK_WAITING", "reason": reason})
        };
        report_task_change(
            &waiting("Topology", "holding out for 2 GPUs of tier 1"),
            &mut seen,
            &say,
        );
        report_task_change(
            &waiting("Topology", "holding out for 2 GPUs of tier 1"),
            &mut seen,
            &say,
        );
        report_task_change(&waiting("Resources", "no node has 2 free GPUs"), &mut seen, &say);
        let running = serde_json::json!({"role": "w", "index": 0, "attempt": 1, "state": "CONTAINER_RUNNING", "host": "n1", "gpus": [0, 1]});
        report_task_change(&running, &mut seen, &say);
        assert_eq!(
            lines.into_inner(),
            vec![
                "task w/0 not placed yet: Topology: holding out for 2 GPUs of tier 1 [since 00:00:00 UTC, until 00:05:00 UTC]"
                    .to_string(),
                "task w/0 not placed yet: Resources: no node has 2 free GPUs [since 00:00:00 UTC, until 00:05:00 UTC]"
                    .to_string(),
                "task w/0 running on n1 GPUs [0,1]".to_string(),
            ]
        );
    }
}
