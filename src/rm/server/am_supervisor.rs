//! The AM supervisor: launches one AM process per application attempt, watches it (also
//! one inherited from an earlier RM), and on its death starts the next attempt
//! (work-preserving) or fails the application.
//!
//! Its output: the AM writes `am.stdout` and `am.stderr` in its application's directory
//! itself (opened for appending here, inherited across RM restarts). Every
//! [`OUTPUT_CHECK_EVERY`] the RM bounds each of a running AM's two files to
//! `rm.am_output_bytes` (`crate::rm::log_budget::am_output_cut`): past it, the file's last
//! that many bytes become `am.stdout.1` (replacing the generation before) and the file is
//! cut to one line saying so, so one AM's output takes at most about twice the bound
//! each. The AM's descriptor appends, so it writes on at the file's new end; what it
//! writes between the copy and the cut is lost.

use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::containers::spawn_stops;
use super::transactions::{self, AmEnd};
use super::Shared;
use crate::node::executor::hold;
use crate::node::procs::ProcessId;
use crate::protocol::ContainerState;
use crate::rm::store::StoreError;

/// How long a killed application's AM gets to exit by itself before it is killed.
pub const AM_KILL_GRACE: Duration = Duration::from_secs(5);

/// How often a running AM's output is held to `rm.am_output_bytes`.
const OUTPUT_CHECK_EVERY: Duration = Duration::from_secs(5);

/// The AM's output files, each bounded.
const AM_OUTPUT_FILES: [&str; 2] = ["am.stdout", "am.stderr"];

/// Lines of am.stderr quoted when an AM dies without finishing.
pub(super) const STDERR_TAIL_LINES: usize = 20;

/// Why an AM could not be launched.
#[derive(Debug, thiserror::Error)]
pub(super) enum LaunchError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// Its attempt could not be stored (nothing was started).
    #[error("{0}")]
    Store(StoreError),
}

pub(super) struct AmProc {
    /// Sending (or dropping) kills the AM process.
    pub(super) kill: Option<oneshot::Sender<()>>,
    pub(super) task: JoinHandle<()>,
}

/// After a restart: the executor watches the containers that were running again (a
/// container whose process is gone completes with what it left behind), and each
/// unfinished application's AM is watched again, or, if it died meanwhile, replaced by
/// its next attempt.
pub(super) fn reattach(rm: &Arc<Shared>) {
    let (running, ams) = {
        let st = rm.lock();
        let running: Vec<(String, String)> = st
            .ledger
            .live_containers()
            .into_iter()
            .filter_map(|id| {
                let c = st.ledger.container(&id)?;
                (c.state == ContainerState::Running).then(|| (c.container.host.clone(), id))
            })
            .collect();
        let ams: Vec<(String, Option<ProcessId>)> = st
            .apps
            .values()
            .filter(|a| !a.report.state.is_final() && !a.unregistered && a.launch.is_some())
            .map(|a| (a.report.id.clone(), a.running_am()))
            .collect();
        (running, ams)
    };
    for (host, id) in &running {
        rm.nodes.for_host(host).reattach(host, id);
    }
    if !rm.launch_am {
        return;
    }
    for (id, process) in ams {
        match process.filter(ProcessId::alive) {
            Some(p) => watch_inherited_am(rm, &id, p),
            None => {
                let rm = rm.clone();
                tokio::spawn(async move {
                    on_am_exit(&rm, &id, "it ended while the RM was down".into()).await;
                });
            }
        }
    }
}

/// Starts `<am_program> am <job.yaml> --rm URL --app-id ID [--listen ADDR]` for the
/// application's current attempt, with its output in the app's directory, and watches
/// it. The app token and the job token go in the environment (`GPUAM_APP_TOKEN`,
/// `GPUAM_JOB_TOKEN`), not on the command line where other local users could read
/// them; the RM's settings file goes along as `GPUAM_CONFIG` so the AM runs with the
/// same settings. The attempt is recorded with the process's identity, so a restarted
/// RM can find it again.
/// The AM process of an application's latest attempt (a `ProcessId` as JSON), in the
/// application's directory.
pub const AM_PROCESS_FILE: &str = "am.process";

pub(super) fn launch_am(rm: &Arc<Shared>, id: &str) -> Result<(), LaunchError> {
    let (token, job_token, launch) = transactions::begin_attempt(&mut rm.lock(), id)?;
    let dir = rm.work_dir.join(id);
    // Appended: a later attempt's output follows the earlier one's, which tells why it died.
    let append = |name: &str| super::private::open(&dir.join(name), true);
    let stdout = append("am.stdout")?;
    let stderr = append("am.stderr")?;
    let program = match &rm.am_program {
        Some(p) => p.clone(),
        None => own_binary()?,
    };
    let mut argv: Vec<std::ffi::OsString> = vec![
        program.into(),
        "am".into(),
        launch.job_path.clone().into(),
        "--rm".into(),
        rm.base_url.clone().into(),
        "--app-id".into(),
        id.into(),
    ];
    if let Some(l) = &launch.listen {
        argv.extend(["--listen".into(), l.into()]);
    }
    // Held until its process is in the attempt's record, as a task is until its
    // `process.json` is written: an RM that dies first leaves no AM it cannot find.
    let (held_stdin, hold) = hold::new()?;
    let mut argv = hold::held_argv(argv);
    let mut cmd = tokio::process::Command::new(argv.remove(0));
    cmd.args(argv)
        .env("GPUAM_APP_TOKEN", &token)
        // The AM has no use for the RM's admin token.
        .env_remove("GPUAM_ADMIN_TOKEN");
    if let Some(t) = &job_token {
        cmd.env("GPUAM_JOB_TOKEN", t);
    }
    if std::env::var_os("GPUAM_CONFIG").is_none() {
        if let Some(p) = crate::config::default_settings_path().and_then(|p| std::fs::canonicalize(p).ok()) {
            cmd.env("GPUAM_CONFIG", p);
        }
    }
    // `kill_on_drop` only matters for an orderly stop; an RM that dies leaves its AMs
    // running, and the next RM re-attaches to them.
    cmd.stdin(Stdio::from(held_stdin))
        .stdout(stdout)
        .stderr(stderr)
        .current_dir(&dir)
        .kill_on_drop(true);
    let pid = {
        // Hold the table while spawning so the watcher cannot finish before it is listed.
        let mut procs = rm.am_procs.lock();
        let mut child = cmd.spawn()?;
        let pid = child.id();
        let (kill_tx, kill_rx) = oneshot::channel::<()>();
        let watcher_rm = rm.clone();
        let app = id.to_string();
        let task = tokio::spawn(async move {
            let status = tokio::select! {
                s = child.wait() => s,
                _ = kill_rx => {
                    let _ = child.start_kill();
                    child.wait().await
                }
            };
            let how = match &status {
                Ok(s) => match s.code() {
                    Some(c) => format!("exit code {c}"),
                    None => format!("{s}"),
                },
                Err(e) => format!("unknown exit ({e})"),
            };
            on_am_exit(&watcher_rm, &app, how).await;
        });
        procs.insert(
            id.to_string(),
            AmProc {
                kill: Some(kill_tx),
                task,
            },
        );
        pid
    };
    let process = pid.and_then(ProcessId::of);
    let recorded = process.is_some_and(|p| transactions::attempt_process(&mut rm.lock(), id, p));
    // Beside its output too, for what outlives an RM without a store (`gpuam run`'s reaper).
    if let Some(p) = process.filter(|_| recorded) {
        let written = serde_json::to_vec(&p)
            .map_err(std::io::Error::other)
            .and_then(|b| super::private::write(&dir.join(AM_PROCESS_FILE), &b));
        if let Err(e) = written {
            tracing::warn!(app = %id, "cannot write {AM_PROCESS_FILE}: {e}");
        }
    }
    if !recorded {
        // Unreleased, it exits without running; its watcher ends the attempt.
        tracing::warn!(app = %id, "the AM's process could not be recorded, so it does not run");
        return Ok(());
    }
    if let Err(e) = hold.release() {
        tracing::warn!(app = %id, "cannot let the AM run: {e}");
    }
    tracing::info!(app = %id, "AM launched");
    Ok(())
}

/// The binary this RM runs, for its AMs. Its path while that file is still this binary;
/// once the file was replaced or removed (a package upgrade under a running RM), the path
/// names another program or none (Linux reads it as `PATH (deleted)`), and the RM's own
/// binary is still reached through `/proc/<pid>/exe` while the RM lives. So an upgrade
/// takes effect for AMs when the RM restarts, never half-way.
fn own_binary() -> std::io::Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    let same = |p: &Path| {
        use std::os::unix::fs::MetadataExt as _;
        let (a, b) = (std::fs::metadata(p), std::fs::metadata("/proc/self/exe"));
        matches!((a, b), (Ok(a), Ok(b)) if a.dev() == b.dev() && a.ino() == b.ino())
    };
    Ok(if same(&exe) {
        exe
    } else {
        format!("/proc/{}/exe", std::process::id()).into()
    })
}

/// Watches an AM process that an earlier RM started (RM restart): it is not our child,
/// so its end is polled for and its exit status is unknown.
pub(super) fn watch_inherited_am(rm: &Arc<Shared>, id: &str, process: ProcessId) {
    let (kill_tx, kill_rx) = oneshot::channel::<()>();
    let watcher_rm = rm.clone();
    let app = id.to_string();
    let mut procs = rm.am_procs.lock();
    let task = tokio::spawn(async move {
        tokio::select! {
            _ = process.ended() => {}
            _ = kill_rx => {
                process.signal(libc::SIGKILL);
                let _ = tokio::time::timeout(AM_KILL_GRACE, process.ended()).await;
            }
        }
        on_am_exit(
            &watcher_rm,
            &app,
            "exit status unknown: it was started by an earlier RM".into(),
        )
        .await;
    });
    procs.insert(
        id.to_string(),
        AmProc {
            kill: Some(kill_tx),
            task,
        },
    );
    tracing::info!(app = %id, pid = process.pid, "re-attached to the running AM");
}

/// The AM process ended: if it never finished the application, a new attempt starts
/// (work-preserving: it re-adopts the job's containers) while attempts remain;
/// otherwise the application failed.
pub(super) async fn on_am_exit(rm: &Arc<Shared>, id: &str, how: String) {
    rm.am_procs.lock().remove(id);
    let tail = stderr_tail(&rm.work_dir.join(id).join("am.stderr"), STDERR_TAIL_LINES);
    let stopping = rm.shutting_down.load(std::sync::atomic::Ordering::SeqCst);
    let mut diag = if stopping {
        format!("the RM shut down and stopped the AM process ({how})")
    } else {
        format!("the AM process exited ({how}) without finishing the application")
    };
    if !tail.is_empty() {
        diag.push_str("; last lines of am.stderr:\n");
        diag.push_str(&tail);
    }
    let end = transactions::am_ended(&mut rm.lock(), id, &how, diag.clone(), rm.max_am_attempts, !stopping);
    let ended = match end {
        AmEnd::Over => {
            tracing::info!(app = %id, "AM exited ({how})");
            drop_spec_copy(rm, id);
            return;
        }
        AmEnd::NextAttempt(attempt) => {
            tracing::warn!(app = %id, attempt, "AM exited without finishing ({how}); starting attempt {attempt}");
            match launch_am(rm, id) {
                Ok(()) => return,
                Err(e) => tracing::warn!(app = %id, error = %e, "could not start a new AM attempt"),
            }
            transactions::fail_app(&mut rm.lock(), id, diag)
        }
        AmEnd::Failed(ended) => ended,
    };
    if stopping {
        // An orderly shutdown stops every AM: said once per AM, not warned about.
        tracing::info!(app = %id, "AM stopped with the RM ({how})");
    } else {
        tracing::warn!(app = %id, "AM exited without finishing ({how})");
    }
    if !stopping {
        drop_spec_copy(rm, id);
    }
    spawn_stops(rm, ended);
}

/// The application ended and its AM with it: its copy of the job spec (`job.yaml`, up to
/// 1 MiB, which only an AM's start reads) goes at once (eighth pass: a user's stream of
/// short jobs with 1 MiB specs piled up copies, counted in no budget, until the disk fell
/// below `rm.min_free_disk_mb` and nobody's logs were kept).
fn drop_spec_copy(rm: &Shared, id: &str) {
    let path = rm.work_dir.join(id).join("job.yaml");
    if let Err(e) = std::fs::remove_file(&path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(app = %id, "its job.yaml copy was not removed: {e}");
        }
    }
}

/// Holds every running AM's output to `rm.am_output_bytes`, every [`OUTPUT_CHECK_EVERY`].
pub(super) fn spawn_output_bound(rm: Arc<Shared>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(OUTPUT_CHECK_EVERY);
        loop {
            every.tick().await;
            let rm = Arc::clone(&rm);
            // Copying and cutting files: off the async workers.
            let bounded = tokio::task::spawn_blocking(move || bound_outputs(&rm)).await;
            if let Err(e) = bounded {
                tracing::warn!("AM output bound stopped: {e}");
            }
        }
    })
}

/// One round of [`spawn_output_bound`]: each running AM's output files.
fn bound_outputs(rm: &Shared) {
    let running: Vec<String> = {
        let st = rm.lock();
        st.apps
            .values()
            .filter(|a| !a.report.state.is_final() && a.launch.is_some())
            .map(|a| a.report.id.clone())
            .collect()
    };
    for id in running {
        for name in AM_OUTPUT_FILES {
            if let Err(e) = bound_output(&rm.work_dir.join(&id).join(name), rm.history.am_output_bytes) {
                tracing::warn!(app = %id, "{name} not bounded: {e}");
            }
        }
    }
}

/// Cuts `path` if it is over `bound`: its last `bound` bytes to `PATH.1`, then the file to
/// one line saying so. `Ok(true)` when it was cut.
pub(super) fn bound_output(path: &Path, bound: u64) -> std::io::Result<bool> {
    // The size is the opened file's (never through a link), not a second look at the path.
    let mut f = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Ok(false);
    }
    let len = meta.len();
    let Some(keep) = crate::rm::log_budget::am_output_cut(len, bound) else {
        return Ok(false);
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let older = path.with_file_name(format!("{name}.1"));
    f.seek(SeekFrom::Start(len - keep))?;
    let mut tail = Vec::new();
    (&mut f).take(keep).read_to_end(&mut tail)?;
    let tmp = path.with_file_name(format!("{name}.1.part"));
    super::private::write(&tmp, &tail).and_then(|()| std::fs::rename(&tmp, &older))?;
    f.set_len(0)?;
    let line = crate::rm::log_budget::am_output_cut_line(&name, bound, crate::protocol::now_ms());
    // Appended: the AM's own writes (appending too) follow it.
    std::io::Write::write_all(&mut super::private::open(path, true)?, line.as_bytes())?;
    Ok(true)
}

/// The last `n` lines of a file (reading at most its last 16 KiB).
pub(super) fn stderr_tail(path: &Path, n: usize) -> String {
    // The AM's stderr may be coloured: no terminal escapes go into diagnostics.
    let text = crate::text::clean(&super::private::tail(path, 16 * 1024).unwrap_or_default());
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    /// The AM's descriptor appends: after the cut it writes on at the file's new end, so the
    /// file stays small (no hole at the old length), and `am.stdout.1` holds the last bytes.
    #[test]
    fn am_output_past_its_bound_keeps_one_older_generation() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("am.stdout");
        let mut am = super::super::private::open(&path, true).unwrap();
        let old: Vec<u8> = (0..10_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        am.write_all(&old).unwrap();
        assert!(!bound_output(&path, 10_000).unwrap(), "at the bound: left alone");
        am.write_all(b"z").unwrap();
        assert!(bound_output(&path, 4096).unwrap());
        let older = std::fs::read(t.path().join("am.stdout.1")).unwrap();
        let mut expect = old[old.len() - 4095..].to_vec();
        expect.push(b'z');
        assert_eq!(older, expect);
        am.write_all(b"after\n").unwrap();
        let now = std::fs::read_to_string(&path).unwrap();
        assert!(now.starts_with("[gpuam rm: at "), "{now}");
        assert!(
            now.contains("rm.am_output_bytes (4096)") && now.ends_with("]\nafter\n"),
            "{now}"
        );
        // Cut again: the older generation is replaced, never a third kept.
        am.write_all(&old).unwrap();
        assert!(bound_output(&path, 4096).unwrap());
        assert_eq!(
            std::fs::read(t.path().join("am.stdout.1")).unwrap(),
            old[old.len() - 4096..]
        );
        assert!(!t.path().join("am.stdout.2").exists());
        assert!(!bound_output(&t.path().join("absent"), 4096).unwrap());
    }
}
