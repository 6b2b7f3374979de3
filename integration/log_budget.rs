//! The logs a standalone `gpuam rm` keeps are bounded (RELIABILITY §2e, seventh pass),
//! with two users: `itest` ("alice", who writes a lot) and `other` ("bob"):
//!
//! - past alice's budget (`rm.collected_logs_user_bytes`) her oldest ended job's kept logs
//!   go, never bob's, and `gpuam logs` of it says why; after an RM restart her kept bytes
//!   are still counted (the next job over her budget removes her older one again);
//! - with the disk's reserve (`rm.min_free_disk_mb`) above the free space, nothing is
//!   kept, the job still succeeds, and `gpuam logs` says why.
//!
//! No disk is filled: the budgets are small, the reserve is set above what is free.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

/// Each stream of a noisy task writes this many bytes (the RM keeps all of it).
const STREAM_BYTES: u64 = 100_000;

/// A job whose one task writes [`STREAM_BYTES`] to stdout and as many to stderr.
fn noisy_job(rm: &Rm, name: &str) -> PathBuf {
    let script = format!("yes out | head -c {STREAM_BYTES}; yes err | head -c {STREAM_BYTES} >&2");
    rm.write_job(
        name,
        &format!(
            "name: {name}\ntaskRoles:\n  worker:\n    instances: 1\n    taskRetryCount: 0\n    \
             resourcePerInstance: {{cpu: 1, memoryMB: 256, gpu: 1}}\n    commands:\n      - {}\n",
            sq(&script)
        ),
    )
}

/// Submits `job` as the holder of `token` and waits for it to succeed; its id.
fn run_as(rm: &Rm, token: &str, job: &Path) -> String {
    let job = job.display().to_string();
    let o = rm.as_user(token, &["submit", &job, "--wait"]);
    assert_eq!(o.status.code(), Some(0), "the job succeeds: {}", text(&o));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("submitted job ").and_then(|r| r.rsplit(' ').next()))
        .unwrap_or_else(|| panic!("no `submitted job` line: {}", text(&o)))
        .to_string()
}

/// The kept log files (`*.stdout`, `*.stderr`) of an application, with their sizes.
fn kept(rm: &Rm, app: &str) -> Vec<(String, u64)> {
    let Ok(dir) = std::fs::read_dir(rm.work_dir.join("logs").join(app)) else {
        return Vec::new();
    };
    let mut files: Vec<(String, u64)> = dir
        .flatten()
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                e.metadata().map_or(0, |m| m.len()),
            )
        })
        .filter(|(n, _)| n.ends_with(".stdout") || n.ends_with(".stderr"))
        .collect();
    files.sort();
    files
}

/// Waits until both streams of the application's one container are kept in full.
fn wait_kept(rm: &Rm, app: &str) {
    wait_for(
        Duration::from_secs(30),
        &format!("the logs of {app} to be kept"),
        || {
            let k = kept(rm, app);
            (k.len() == 2 && k.iter().all(|(_, n)| *n == STREAM_BYTES)).then_some(())
        },
    );
}

fn wait_removed(rm: &Rm, app: &str) {
    wait_for(
        Duration::from_secs(30),
        &format!("the kept logs of {app} to go"),
        || kept(rm, app).is_empty().then_some(()),
    );
}

/// `gpuam logs APP` as the holder of `token`: (stdout, stderr).
fn logs(rm: &Rm, token: &str, app: &str) -> (String, String) {
    let o = rm.as_user(token, &["logs", app, "--raw"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn past_her_log_budget_alices_oldest_kept_logs_go_and_bobs_stay_also_after_a_restart() {
    // Her budget holds one job's logs and a half (2 × 100 kB each); no reserve.
    let mut rm = Rm::start_with_settings(
        TWO_NODES_TWO_GPUS,
        "  collected_log_bytes: 100000\n  collected_logs_user_bytes: 300000\n  \
         collected_logs_total_bytes: 10000000\n  min_free_disk_mb: 0\n",
        &[],
    );
    let (alice, bob) = (rm.user_token.clone(), rm.other_token.clone());
    let a1 = run_as(&rm, &alice, &noisy_job(&rm, "a1"));
    wait_kept(&rm, &a1);
    let b1 = run_as(&rm, &bob, &noisy_job(&rm, "b1"));
    wait_kept(&rm, &b1);

    // Her second job's logs would pass her budget: her first job's go, bob's stay.
    let a2 = run_as(&rm, &alice, &noisy_job(&rm, "a2"));
    wait_kept(&rm, &a2);
    wait_removed(&rm, &a1);
    assert_eq!(kept(&rm, &b1).len(), 2, "bob's kept logs stay");
    let (out, _) = logs(&rm, &alice, &a2);
    assert_eq!(out.len() as u64, STREAM_BYTES, "her newest job's log is served in full");
    let (_, err) = logs(&rm, &alice, &a1);
    assert!(
        err.contains("note: removed:") && err.contains("itest's log budget (rm.collected_logs_user_bytes)"),
        "gpuam logs says why the old job's logs are gone: {err}"
    );
    let (out, _) = logs(&rm, &bob, &b1);
    assert_eq!(out.len() as u64, STREAM_BYTES);

    // A restarted RM counts what was kept: her next job removes a2's logs again.
    rm.restart();
    let a3 = run_as(&rm, &alice, &noisy_job(&rm, "a3"));
    wait_kept(&rm, &a3);
    wait_removed(&rm, &a2);
    assert_eq!(kept(&rm, &b1).len(), 2, "bob's kept logs stay");
}

#[test]
fn below_the_disk_reserve_nothing_is_kept_the_job_succeeds_and_logs_say_why() {
    // A reserve of 1 PiB: more than this disk has free.
    let rm = Rm::start_with_settings(TWO_NODES_TWO_GPUS, "  min_free_disk_mb: 1073741824\n", &[]);
    let token = rm.user_token.clone();
    let id = run_as(&rm, &token, &noisy_job(&rm, "reserved"));
    let err = wait_for(Duration::from_secs(30), "gpuam logs to say why", || {
        let (_, err) = logs(&rm, &token, &id);
        err.contains("not kept").then_some(err)
    });
    assert!(
        err.contains("note: not kept: the RM's disk has") && err.contains("(rm.min_free_disk_mb = 1073741824)"),
        "{err}"
    );
    assert!(kept(&rm, &id).is_empty(), "no log kept: {:?}", kept(&rm, &id));
    // The job's spec copy goes with its AM (eighth pass: copies piled up uncounted).
    let spec = rm.work_dir.join(&id).join("job.yaml");
    wait_for(Duration::from_secs(30), "the ended job's job.yaml copy to go", || {
        (!spec.exists()).then_some(())
    });
}
