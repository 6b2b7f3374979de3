//! The job commands a Slurm, Ray or YARN user looks for: `gpuam jobs` (squeue, `ray job
//! list`), `gpuam status ID` (`ray job status`, `yarn application -status`), `gpuam logs
//! ID [ROLE/INDEX] [--follow]` (`yarn logs`, `ray job logs`), `gpuam kill ID` (scancel,
//! `ray job stop`), `gpuam history` (sacct). Tables fit 80 columns; `--json` prints
//! the RM's answer for scripts. The RM and the token come from `super::target`; the
//! calls are `super::rm_api`'s.

use std::time::Duration;

use serde_json::{json, Value};

use super::rm_api::{job_number, report, JobsApi};
use super::target::{resolve, TargetArgs};
use crate::config::TlsSettings;
use crate::exit;
use crate::protocol::now_ms;

#[derive(clap::Args, Debug)]
pub(crate) struct JobsArgs {
    /// Every user's jobs (the admin only; others see their own anyway).
    #[arg(long)]
    all: bool,
    /// Print the RM's JSON instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    target: TargetArgs,
}

#[derive(clap::Args, Debug)]
pub(crate) struct StatusArgs {
    /// The job: its number as `gpuam jobs` shows it, or its id application_….
    job: String,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    target: TargetArgs,
}

#[derive(clap::Args, Debug)]
pub(crate) struct LogsArgs {
    /// The job: its number or its id.
    job: String,
    /// The task, ROLE/INDEX (e.g. worker/1; default: the job's first task).
    task: Option<String>,
    /// The task's attempt (default: its latest).
    #[arg(long)]
    attempt: Option<u32>,
    /// The task's stderr instead of its stdout.
    #[arg(long)]
    stderr: bool,
    /// Keep printing what the task writes until it ends.
    #[arg(long, short = 'f')]
    follow: bool,
    /// Print the task's output byte for byte even to a terminal. Without it, a terminal
    /// gets control characters and escape sequences shown escaped (`\u{1b}[31m`), so that
    /// a task cannot drive it (window title, clipboard); a pipe or a file always gets the
    /// bytes as they are.
    #[arg(long)]
    raw: bool,
    #[command(flatten)]
    target: TargetArgs,
}

#[derive(clap::Args, Debug)]
pub(crate) struct KillArgs {
    /// The job: its number or its id.
    job: String,
    #[command(flatten)]
    target: TargetArgs,
}

#[derive(clap::Args, Debug)]
pub(crate) struct HistoryArgs {
    /// Only this user's jobs (the admin sees everyone's; others their own).
    #[arg(long)]
    user: Option<String>,
    /// Only jobs of this queue.
    #[arg(long)]
    queue: Option<String>,
    /// Only jobs that ended so: FINISHED, FAILED or KILLED.
    #[arg(long, ignore_case = true, value_parser = clap::builder::PossibleValuesParser::new(crate::rm::history::FINAL_STATES))]
    state: Option<String>,
    /// At most this many rows, newest first.
    #[arg(long, default_value_t = 50)]
    limit: usize,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    target: TargetArgs,
}

#[derive(clap::Args, Debug)]
pub(crate) struct LoginArgs {
    #[command(flatten)]
    pub target: TargetArgs,
}

/// A client and the target, or the exit code.
fn api(target: &TargetArgs, tls: &TlsSettings) -> Result<(JobsApi, super::target::Target), i32> {
    let t = resolve(target)?;
    Ok((JobsApi::new(&t, tls)?, t))
}

/// A client and the full id of the job `job` names, or the exit code.
async fn job_api(target: &TargetArgs, job: &str, tls: &TlsSettings) -> Result<(JobsApi, String), i32> {
    let (api, _) = api(target, tls)?;
    let id = api.resolve(job).await?;
    Ok((api, id))
}

fn print_json(v: &impl serde::Serialize) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

/// At most `w` characters of `s` (cut with `…`).
fn fit(s: &str, w: usize) -> String {
    if s.chars().count() <= w {
        return s.to_string();
    }
    let mut out: String = s.chars().take(w.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// `90s`, `12m`, `3h05m`, `2d04h`.
pub(crate) fn short_duration(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..=119 => format!("{s}s"),
        120..=3599 => format!("{}m", s / 60),
        3600..=86_399 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// `MM-DD HH:MM` (UTC) of milliseconds since the epoch; `-` for 0.
pub(crate) fn utc_minute(ms: u64) -> String {
    if ms == 0 {
        return "-".into();
    }
    let secs = ms / 1000;
    let days = (secs / 86_400) as i64;
    let (_, m, d) = civil_from_days(days);
    format!("{m:02}-{d:02} {:02}:{:02}", secs % 86_400 / 3600, secs % 3600 / 60)
}

/// (year, month, day) of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// A state as the RM's JSON names it (`RUNNING`, `KILLED`).
fn wire_name(v: &impl serde::Serialize) -> String {
    match serde_json::to_value(v) {
        Ok(Value::String(s)) => s,
        _ => "?".into(),
    }
}

/// `gpuam jobs`.
pub(crate) async fn jobs(a: &JobsArgs, tls: &TlsSettings) -> i32 {
    let (api, _) = match api(&a.target, tls) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let me = match api.whoami().await {
        Ok(m) => m,
        Err(e) => return report(&e),
    };
    if a.all && !me.admin {
        eprintln!(
            "note: --all shows every user's jobs to the admin only; these are yours ({})",
            me.user
        );
    }
    let v = match api.overview().await {
        Ok(v) => v,
        Err(e) => return report(&e),
    };
    let empty = Vec::new();
    let jobs: Vec<&Value> = v["apps"]
        .as_array()
        .unwrap_or(&empty)
        .iter()
        .filter(|j| !is_final(j["state"].as_str().unwrap_or("")))
        .filter(|j| a.all || j["user"].as_str() == Some(me.user.as_str()))
        .collect();
    if a.json {
        print_json(&jobs);
        return exit::SUCCESS;
    }
    super::emit(&jobs_table(&jobs, now_ms()));
    exit::SUCCESS
}

fn is_final(state: &str) -> bool {
    matches!(state, "FINISHED" | "FAILED" | "KILLED")
}

/// The `gpuam jobs` table (76 columns), with the reason under each waiting job.
fn jobs_table(jobs: &[&Value], now: u64) -> String {
    let mut out = format!(
        "{:>6} {:<16} {:<10} {:<10} {:<9} {:>5} {:>5} {:>8}\n",
        "JOB", "NAME", "USER", "QUEUE", "STATE", "TASKS", "GPUS", "AGE"
    );
    for j in jobs {
        let s = |k: &str| j[k].as_str().unwrap_or("").to_string();
        let n = |k: &str| j[k].as_u64().unwrap_or(0);
        let waiting = n("waitingTasks");
        let state = if s("state") == "RUNNING" && waiting > 0 && n("containers") == 0 {
            "WAITING".to_string()
        } else {
            s("state")
        };
        out.push_str(&format!(
            "{:>6} {:<16} {:<10} {:<10} {:<9} {:>5} {:>5} {:>8}\n",
            job_number(&s("id")),
            fit(&s("name"), 16),
            fit(&s("user"), 10),
            fit(&s("queue"), 10),
            fit(&state, 9),
            n("containers"),
            n("gpus"),
            short_duration(now.saturating_sub(n("startedTime")))
        ));
        let reason = serde_json::from_value::<crate::reason::Reason>(j["reason"].clone()).ok();
        let line = reason
            .map(|r| r.text())
            .or_else(|| j["why"].as_str().map(str::to_string));
        if let Some(why) = line.filter(|_| waiting > 0) {
            let since = j["waitingMs"].as_u64().map(short_duration).unwrap_or_default();
            let why = crate::text::shown_line(&why);
            out.push_str(&format!("       {}\n", fit(&format!("waits {since}: {why}"), 72)));
        }
    }
    if jobs.is_empty() {
        out.push_str("(no running or waiting jobs; `gpuam history` lists finished ones)\n");
    }
    out
}

/// `gpuam status ID`.
pub(crate) async fn status(a: &StatusArgs, tls: &TlsSettings) -> i32 {
    let (api, id) = match job_api(&a.target, &a.job, tls).await {
        Ok(v) => v,
        Err(code) => return code,
    };
    let d = match api.job(&id).await {
        Ok(d) => d,
        Err(e) => return report(&e),
    };
    if a.json {
        let containers: Vec<Value> = d
            .containers
            .iter()
            .map(|c| {
                let mut v = serde_json::to_value(&c.row).unwrap_or(Value::Null);
                v["nodeLost"] = json!(c.node_lost);
                v
            })
            .collect();
        print_json(&json!({
            "app": d.app,
            "waiting": {
                "since": d.waiting.since,
                "why": d.waiting.why,
                "reason": d.waiting.reason,
                // When it is expected to start, with the basis (issue 27).
                "estimate": d.waiting.estimate,
            },
            "containers": containers,
            "history": d.history,
        }));
        return exit::SUCCESS;
    }
    super::emit(&status_text(&d, now_ms()));
    exit::SUCCESS
}

/// "expected to start 11-26 15:40 UTC (in 10m); basis: …", or why it cannot be told (issue
/// 27): the RM's estimate (`rm::scheduler::reserved::estimates`) in the terminal's words.
pub(crate) fn estimate_line(e: &crate::rm::scheduler::reserved::StartEstimate, now: u64) -> String {
    let at = |t: u64| format!("{} UTC (in {})", utc_minute(t), short_duration(t - now));
    // A job that is no gang: its waiting tasks start one by one.
    let all = e
        .all_start_ms
        .filter(|&t| t > now)
        .map(|t| format!(", all its waiting tasks by {}", at(t)))
        .unwrap_or_default();
    match e.start_ms {
        Some(t) if t <= now => format!("expected to start now{all}; basis: {}", e.text),
        Some(t) => format!("expected to start {}{all}; basis: {}", at(t), e.text),
        None => format!("expected start: {}", e.text),
    }
}

fn status_text(d: &super::rm_api::JobDetail, now: u64) -> String {
    let r = &d.app;
    let h = &d.history;
    let mut out = format!(
        "job {} ({})  {}  user {}  queue {}\nstate {}",
        job_number(&r.id),
        r.id,
        r.name,
        r.user,
        r.queue,
        wire_name(&r.state)
    );
    if let Some(code) = r.exit_code {
        out.push_str(&format!("  exit {code}"));
    }
    out.push_str(&format!(
        "  submitted {}  started {}",
        utc_minute(h.submitted_time),
        utc_minute(h.started_time)
    ));
    if r.finished_time > 0 {
        out.push_str(&format!("  ended {}", utc_minute(r.finished_time)));
    }
    out.push_str(&format!(
        " (UTC)\nran {}  GPU-hours {:.3}  AM attempts {}\n",
        short_duration((h.duration_sec * 1000.0) as u64),
        h.gpu_hours,
        h.am_attempts
    ));
    if let Some(why) = d.waiting.line() {
        let since = d
            .waiting
            .since
            .map(|s| short_duration(now.saturating_sub(s)))
            .unwrap_or_default();
        out.push_str(&format!("waiting {since}: {}\n", crate::text::shown_line(&why)));
    }
    if let Some(e) = &d.waiting.estimate {
        out.push_str(&format!("{}\n", estimate_line(e, now)));
    }
    if !h.reason.is_empty() {
        out.push_str(&format!("reason: {}\n", crate::text::shown_line(&h.reason)));
    } else if !r.diagnostics.is_empty() && !r.state.is_final() {
        out.push_str(&format!("note: {}\n", crate::text::shown_line(&r.diagnostics)));
    }
    if !r.tracking_url.is_empty() && !r.state.is_final() {
        out.push_str(&format!("dashboard: {}\n", r.tracking_url));
    }
    out.push_str(&format!(
        "\n{:<16} {:>3} {:<16} {:<9} {:<9} {:>6} {:>9}\n",
        "TASK", "ATT", "HOST", "GPUS", "STATE", "EXIT", "RAN"
    ));
    for c in &d.containers {
        let row = &c.row;
        let gpus = row.gpus.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let state = if c.node_lost {
            "LOST".to_string()
        } else {
            wire_name(&row.state)
        };
        let end = if row.ended_time > 0 { row.ended_time } else { now };
        out.push_str(&format!(
            "{:<16} {:>3} {:<16} {:<9} {:<9} {:>6} {:>9}\n",
            fit(
                if row.task.is_empty() {
                    &row.container_id
                } else {
                    &row.task
                },
                16
            ),
            row.task_attempt,
            fit(&row.host, 16),
            fit(if gpus.is_empty() { "-" } else { &gpus }, 9),
            state,
            row.exit_status.map_or("-".to_string(), |e| e.to_string()),
            short_duration(end.saturating_sub(row.allocated_time))
        ));
    }
    if d.containers.is_empty() {
        out.push_str("(no task has been placed yet)\n");
    }
    out
}

/// `gpuam logs ID [ROLE/INDEX]`.
pub(crate) async fn logs(a: &LogsArgs, tls: &TlsSettings) -> i32 {
    use std::io::Write;
    let (api, id) = match job_api(&a.target, &a.job, tls).await {
        Ok(v) => v,
        Err(code) => return code,
    };
    let stream = if a.stderr { "stderr" } else { "stdout" };
    let mut task: Option<(String, u32)> = match a.task.as_deref().map(parse_task).transpose() {
        Ok(t) => t,
        Err(msg) => {
            eprintln!("error: {msg}");
            return exit::USAGE;
        }
    };
    let to_terminal = !a.raw && std::io::IsTerminal::is_terminal(&std::io::stdout());
    let mut offset = 0u64;
    let mut container = String::new();
    loop {
        let chosen = match &task {
            Some(t) => Some(t.clone()),
            None => match api.job(&id).await {
                Ok(d) => first_task(&d),
                Err(e) => return report(&e),
            },
        };
        let Some((role, index)) = chosen else {
            if !a.follow {
                eprintln!(
                    "job {id} has no task placed yet; `gpuam status {}` says why",
                    job_number(&id)
                );
                return exit::NO_SUCH_JOB;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        task = Some((role.clone(), index));
        let log = match api.task_log(&id, (&role, index), a.attempt, stream, offset).await {
            Ok(l) => l,
            Err(e) if a.follow && e.status() == Some(404) => {
                // Not placed yet: wait for it while the job lives.
                match api.job(&id).await {
                    Ok(d) if !d.app.state.is_final() => {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                    _ => return report(&e),
                }
            }
            Err(e) => return report(&e),
        };
        if log.container_id != container {
            // A new attempt of the task: its log starts again.
            if !container.is_empty() && a.attempt.is_none() {
                eprintln!("--- {role}/{index}: a new attempt ({}) ---", log.container_id);
                offset = 0;
                container = log.container_id.clone();
                continue;
            }
            container = log.container_id.clone();
        }
        print!("{}", crate::text::task_output(&log.text, to_terminal));
        let _ = std::io::stdout().flush();
        offset = log.offset + log.text.len() as u64;
        if !log.note.is_empty() {
            eprintln!("note: {}", log.note);
        }
        if !a.follow || (log.complete && log.text.is_empty()) {
            return exit::SUCCESS;
        }
        if log.text.is_empty() {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

/// `worker/1` → ("worker", 1).
fn parse_task(s: &str) -> Result<(String, u32), String> {
    match crate::protocol::split_task(s) {
        (role, Some(i)) if !role.is_empty() => Ok((role.to_string(), i)),
        _ => Err(format!(
            "`{s}` is not a task: give ROLE/INDEX, e.g. worker/0 (`gpuam status JOB` lists them)"
        )),
    }
}

/// The task a `gpuam logs` without one shows: the first by role and index.
fn first_task(d: &super::rm_api::JobDetail) -> Option<(String, u32)> {
    d.containers
        .iter()
        .filter_map(|c| c.row.index.map(|i| (c.row.role.clone(), i)))
        .min()
}

/// `gpuam kill ID`.
pub(crate) async fn kill(a: &KillArgs, tls: &TlsSettings) -> i32 {
    let (api, id) = match job_api(&a.target, &a.job, tls).await {
        Ok(v) => v,
        Err(code) => return code,
    };
    match api.kill(&id).await {
        Ok(v) => {
            let state = v["state"].as_str().unwrap_or("KILLED");
            if state == "KILLED" {
                println!("job {} ({id}) killed", job_number(&id));
            } else {
                println!("job {} ({id}) had already ended: {state}", job_number(&id));
            }
            exit::SUCCESS
        }
        Err(e) => report(&e),
    }
}

/// `gpuam history`.
pub(crate) async fn history(a: &HistoryArgs, tls: &TlsSettings) -> i32 {
    let (api, _) = match api(&a.target, tls) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let filters = [
        ("user", a.user.as_deref()),
        ("queue", a.queue.as_deref()),
        ("state", a.state.as_deref()),
    ];
    let rows = match api.history(&filters, a.limit).await {
        Ok(r) => r,
        Err(e) => return report(&e),
    };
    if a.json {
        print_json(&rows);
        return exit::SUCCESS;
    }
    let mut out = format!(
        "{:>6} {:<14} {:<8} {:<8} {:>4} {:<11} {:>8} {:>7}\n",
        "JOB", "NAME", "USER", "STATE", "EXIT", "ENDED(UTC)", "RAN", "GPU-H"
    );
    for r in &rows {
        out.push_str(&format!(
            "{:>6} {:<14} {:<8} {:<8} {:>4} {:<11} {:>8} {:>7.2}\n",
            job_number(&r.id),
            fit(&r.name, 14),
            fit(&r.user, 8),
            wire_name(&r.state),
            r.exit_code.map_or("-".into(), |c| c.to_string()),
            utc_minute(r.finished_time),
            short_duration((r.duration_sec * 1000.0) as u64),
            r.gpu_hours
        ));
        if !r.reason.is_empty() {
            out.push_str(&format!("       {}\n", fit(&crate::text::shown_line(&r.reason), 72)));
        }
    }
    if rows.is_empty() {
        out.push_str("(no finished jobs)\n");
    }
    super::emit(&out);
    exit::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_and_durations_read_as_people_write_them() {
        assert_eq!(utc_minute(0), "-");
        // 2026-11-26 15:21:00 UTC.
        assert_eq!(utc_minute(1_795_706_460_000), "11-26 15:21");
        assert_eq!(utc_minute(951_782_400_000), "02-29 00:00");
        assert_eq!(short_duration(59_000), "59s");
        assert_eq!(short_duration(600_000), "10m");
        assert_eq!(short_duration(3_900_000), "1h05m");
        assert_eq!(short_duration(90_000_000), "1d01h");
    }

    #[test]
    fn the_jobs_table_fits_80_columns_and_says_why_a_job_waits() {
        let j = json!({"id": "application_1764170000_0042", "name": "a-very-long-job-name-indeed",
            "user": "alice", "queue": "research", "state": "RUNNING", "containers": 0, "gpus": 0,
            "waitingTasks": 2, "waitingMs": 65_000, "startedTime": 1_000,
            "why": "holding out for 2 GPUs of tier 1 until 15:40:00 (topology wait)"});
        let t = jobs_table(&[&j], 61_000);
        for line in t.lines() {
            assert!(line.chars().count() <= 80, "{line:?}");
        }
        assert!(t.contains("    42 a-very-long-job…"), "{t}");
        assert!(t.contains("WAITING"), "{t}");
        assert!(t.contains("waits 65s: holding out for 2 GPUs"), "{t}");
    }

    /// `gpuam status` of a waiting job says when it is expected to start and on what
    /// basis, from the RM's answer (issue 27).
    #[test]
    fn status_says_when_a_waiting_job_is_expected_to_start() {
        let now = 1_795_706_460_000;
        let detail = |estimate: Value| -> super::super::rm_api::JobDetail {
            let app = crate::rm::apps::App::new("application_1_0042".into(), "big".into()).report;
            serde_json::from_value(json!({
                "app": app,
                "waiting": {"since": now - 65_000, "why": "nothing fits yet", "estimate": estimate},
                "containers": [],
                "history": {"id": "application_1_0042", "name": "big", "user": "alice", "queue": "default",
                    "state": "RUNNING", "exitCode": null, "submittedTime": now, "startedTime": now,
                    "finishedTime": 0, "durationSec": 0.0, "reason": "", "amAttempts": 1, "containers": 0,
                    "taskRetries": 0, "gpuHours": 0.0}
            }))
            .unwrap()
        };
        let d = detail(json!({"startMs": now + 600_000, "basis": {"declared": 12},
            "text": "declared limits of 12 running containers"}));
        let t = status_text(&d, now);
        assert!(
            t.contains("expected to start 11-26 15:31 UTC (in 10m); basis: declared limits of 12 running containers"),
            "{t}"
        );
        let d = detail(
            json!({"startMs": now + 600_000, "allStartMs": now + 7_200_000, "basis": {"declared": 12},
            "text": "declared limits of 12 running containers"}),
        );
        let t = status_text(&d, now);
        assert!(
            t.contains(
                "expected to start 11-26 15:31 UTC (in 10m), all its waiting tasks by 11-26 17:21 UTC (in 2h00m)"
            ),
            "{t}"
        );
        let d = detail(json!({"startMs": null, "basis": {"unknown": 3},
            "text": "unknown: 3 running containers have no declared limit"}));
        let t = status_text(&d, now);
        assert!(
            t.contains("expected start: unknown: 3 running containers have no declared limit"),
            "{t}"
        );
        let d = detail(Value::Null);
        assert!(!status_text(&d, now).contains("expected"), "an older RM: no line");
    }

    /// A task's stderr inside `reason:` stays on its line: its newlines cannot forge a
    /// `state SUCCEEDED` line below it (audit 6 F4).
    #[test]
    fn a_reason_is_one_line_whatever_the_task_wrote() {
        let now = 1_795_706_460_000;
        let app = crate::rm::apps::App::new("application_1_0004".into(), "j".into()).report;
        let reason = "task main/0 (attempt 1) exited with 4: end of stderr: boom\n\nstate SUCCEEDED  exit 0\r";
        let d: super::super::rm_api::JobDetail = serde_json::from_value(json!({
            "app": app,
            "waiting": {},
            "containers": [],
            "history": {"id": "application_1_0004", "name": "j", "user": "alice", "queue": "default",
                "state": "FAILED", "exitCode": 4, "submittedTime": now, "startedTime": now,
                "finishedTime": now, "durationSec": 1.0, "reason": reason, "amAttempts": 1, "containers": 0,
                "taskRetries": 0, "gpuHours": 0.0}
        }))
        .unwrap();
        let t = status_text(&d, now);
        assert!(
            t.contains(
                "reason: task main/0 (attempt 1) exited with 4: end of stderr: boom\\n\\nstate SUCCEEDED  exit 0\\r\n"
            ),
            "{t}"
        );
        assert!(!t.lines().any(|l| l.starts_with("state SUCCEEDED")), "{t}");
    }

    #[test]
    fn tasks_are_role_slash_index() {
        assert_eq!(parse_task("worker/3").unwrap(), ("worker".to_string(), 3));
        assert!(parse_task("worker").unwrap_err().contains("ROLE/INDEX"));
        assert!(parse_task("/3").is_err());
    }
}
