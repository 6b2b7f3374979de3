//! The ending protocol: when a container's leader is gone, what it left behind is
//! stopped, its cgroup emptied, its logs capped, its end recorded (`end.json`) before
//! anyone hears of it, the table updated, and exactly one `NodeEvent::Exited` sent. The
//! exit code and the diagnostics are worded by pure functions ([`describe_exit`],
//! [`end_report`]).

use std::os::unix::process::ExitStatusExt as _;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};

use super::files::create_new_in;
use super::logs::{cap_log, read_tail, LogStream};
use super::records::{remove_work_dir, work_dir, RecordedEnd, DEFER_REMOVAL_MAX_BYTES, END_FILE};
use super::signal::{group_alive, pid_reused, signal_own_group, wait_group_gone, KILL_WAIT, LEFTOVER_GRACE, POLL};
use super::table::{Phase, Table};
use super::Executor;
use crate::node::bounds::Breach;
use crate::node::cgroup::Cgroup;
use crate::node::procs::ProcessId;
use crate::node::NodeEvent;
use crate::protocol::{exit_status, EndCause};

/// How much of stderr's tail goes into a failed container's diagnostics.
pub(super) const DIAG_STDERR_BYTES: u64 = 512;

/// Where a container's end is recorded and whom it is told to.
pub(super) struct Ending {
    pub(super) table: Table,
    pub(super) events: mpsc::UnboundedSender<NodeEvent>,
    pub(super) id: String,
    pub(super) dir: PathBuf,
    /// Turned `true` once the container is Complete.
    pub(super) done: watch::Sender<bool>,
    pub(super) cgroup: Cgroup,
    pub(super) max_log_bytes: Option<u64>,
    /// Why the node killed it (a bound it went past, see [`crate::node::bounds`]).
    pub(super) verdict: Arc<Mutex<Option<Breach>>>,
    /// How long after the end the work directory goes ([`ExecutorOptions::work_dir_grace`]).
    pub(super) work_dir_grace: Duration,
}

impl Executor {
    /// What ends container `id` when its leader is gone (see [`container_ended`]).
    pub(super) fn ending(&self, id: &str, dir: PathBuf, done: watch::Sender<bool>, cgroup: Cgroup) -> Ending {
        Ending {
            table: self.table.clone(),
            events: self.events.clone(),
            id: id.to_string(),
            dir,
            done,
            cgroup,
            max_log_bytes: self.opts.max_log_bytes,
            verdict: Default::default(),
            work_dir_grace: self.work_dir_grace(),
        }
    }
}

/// Waits for the leader, then ends the container (see [`container_ended`]).
pub(super) async fn wait_container(
    ending: Ending,
    mut child: super::vfork::Spawned,
    pgid: u32,
    leader: Option<ProcessId>,
) {
    let (code, how) = match child.wait().await {
        Ok(st) => describe_exit(st),
        Err(e) => (exit_status::INVALID, format!("lost track of the process: {e}")),
    };
    container_ended(ending, pgid, leader, code, how).await;
}

/// Cleans up what the leader left in its group, records the end and sends the one
/// `Exited` event.
///
/// The group is the leader's pid. Linux does not hand out a pid while a process group
/// of that number has members, so leftovers keep the number ours; but once the group is
/// empty the pid can go to a new process (pid_max can be as low as 32768), which may
/// lead a group of its own, another container's. So a live process with the leader's
/// pid that is not the leader means the group is not ours to signal.
pub(super) async fn container_ended(ending: Ending, pgid: u32, leader: Option<ProcessId>, code: i32, how: String) {
    let Ending {
        table,
        events,
        id,
        dir,
        done,
        cgroup,
        max_log_bytes,
        verdict,
        work_dir_grace,
    } = ending;
    // Background processes the commands left behind must not outlive the container: their
    // GPUs and ports go back to the scheduler with it.
    let mut notes = Vec::new();
    if !pid_reused(pgid, leader) && group_alive(pgid) {
        signal_own_group(pgid, leader, Signal::SIGTERM);
        if !wait_group_gone(pgid, LEFTOVER_GRACE).await {
            signal_own_group(pgid, leader, Signal::SIGKILL);
            if !wait_group_gone(pgid, KILL_WAIT).await {
                notes.push("some processes of its group survived SIGKILL");
            }
        }
    }
    // A task in an image: its container is gone too (see image::reap).
    crate::node::image::reap(&dir, &id).await;
    let oom = cgroup.oom_killed();
    if cgroup.is_real() {
        notes.extend(empty_cgroup(&cgroup, &id).await);
        cgroup.remove();
    }
    let killed_for = verdict.lock().clone();
    // Past its disk bound, or holding more than [`DEFER_REMOVAL_MAX_BYTES`], the directory
    // goes at once (the node needs the room back: short tasks that each leave data behind
    // must not add up over the grace); a small one after the grace, off the path of the
    // next starts.
    let remove_work_now = killed_for.is_some() || work_dir_grace.is_zero() || {
        let work = work_dir(&dir);
        let usage = crate::node::bounds::in_background(move || crate::node::bounds::disk_usage(&work)).await;
        usage.is_none_or(|u| !u.complete || u.bytes > DEFER_REMOVAL_MAX_BYTES)
    };
    // The logs are within their limit before anyone hears of the end.
    if let Some(max) = max_log_bytes {
        let logs = table.lock().get(&id).map(|e| e.logs.clone()).unwrap_or_default();
        let cut = tokio::task::spawn_blocking(move || logs.iter().map(|f| cap_log(f, max)).collect::<Vec<_>>()).await;
        for e in cut.into_iter().flatten().filter_map(Result::err) {
            tracing::warn!(container = %id, "cannot keep a log within node.max_log_bytes: {e}");
        }
    }
    let stop_requested = table.lock().get(&id).is_some_and(|e| e.stop_requested);
    let stderr_tail = (code != 0)
        .then(|| read_tail(&dir.join(LogStream::Stderr.file_name()), DIAG_STDERR_BYTES).ok())
        .flatten();
    let (diagnostics, cause) = end_report(EndFacts {
        code,
        how,
        notes,
        breach: killed_for,
        oom,
        stop_requested,
        stderr_tail,
    });
    // Recorded before anyone hears of it (a restarted node reports this end), and the
    // task's own directory goes: its logs stay in the record.
    let end = RecordedEnd {
        exit_status: code,
        diagnostics: diagnostics.clone(),
        cause,
    };
    let recorded = serde_json::to_vec(&end)
        .map_err(std::io::Error::other)
        .and_then(|b| create_new_in(&dir, END_FILE, &b, None));
    if let Err(e) = recorded {
        tracing::warn!(container = %id, "cannot record the container's end: {e}");
    }
    if remove_work_now {
        // On a thread of its own at the lowest priority: a task that left a million files
        // behind took both runtime workers for the removal, the agent stopped heartbeating
        // and its host went LOST with every other tenant's task on it (twelfth pass). The
        // end is still heard only once its directory is gone.
        let (dir, id) = (dir.clone(), id.clone());
        crate::node::bounds::in_background(move || remove_work_dir(&dir, &id)).await;
    } else {
        // A node that stops before then removes it on its next sweep ([`sweep_records`]).
        let (dir, id) = (dir.clone(), id.clone());
        tokio::spawn(async move {
            tokio::time::sleep(work_dir_grace).await;
            crate::node::bounds::in_background(move || remove_work_dir(&dir, &id)).await;
        });
    }
    {
        let mut table = table.lock();
        if let Some(e) = table.get_mut(&id) {
            e.phase = Phase::Complete;
            e.exit_status = Some(code);
            e.diagnostics = diagnostics.clone();
        }
    }
    let _ = done.send(true);
    // The receiver is gone only when the RM is shutting down; nothing to tell then.
    let _ = events.send(NodeEvent::Exited {
        container_id: id,
        exit_status: code,
        diagnostics,
        cause,
    });
}

/// Ends whatever is left in the container's cgroup (daemons that left its session): SIGTERM
/// to every member, [`LEFTOVER_GRACE`], then a kill of the whole cgroup, repeated until it
/// is empty. Never gives up: the container is not dead, and its resources not free, while a
/// process of it runs. Returns a note for the diagnostics when something had to be killed.
pub(super) async fn empty_cgroup(cgroup: &Cgroup, id: &str) -> Option<&'static str> {
    if cgroup.is_empty() {
        return None;
    }
    cgroup.signal(Signal::SIGTERM);
    let until = Instant::now() + LEFTOVER_GRACE;
    while Instant::now() < until {
        if cgroup.is_empty() {
            return Some("processes it left behind ended on SIGTERM");
        }
        tokio::time::sleep(POLL).await;
    }
    let mut warned = Instant::now();
    loop {
        cgroup.kill();
        let until = Instant::now() + KILL_WAIT;
        while Instant::now() < until {
            if cgroup.is_empty() {
                return Some("processes it left behind were killed");
            }
            tokio::time::sleep(POLL).await;
        }
        if warned.elapsed() >= KILL_WAIT {
            tracing::warn!(
                container = id,
                pids = ?cgroup.pids(),
                "processes of the container survive SIGKILL; its resources stay held until they are gone"
            );
            warned = Instant::now();
        }
    }
}

/// What the node found out about a container's end, for [`end_report`].
pub(super) struct EndFacts {
    /// The exit code.
    pub code: i32,
    /// How the leader ended ([`describe_exit`], or the status its script recorded).
    pub how: String,
    /// What cleaning up found (processes left behind, in order).
    pub notes: Vec<&'static str>,
    /// A bound the node killed it for ([`crate::node::bounds::watch_disk`]).
    pub breach: Option<Breach>,
    /// The kernel killed a process of it in its memory limit.
    pub oom: Option<EndCause>,
    /// It ended because it was asked to stop.
    pub stop_requested: bool,
    /// The end of its stderr (read for a non-zero code).
    pub stderr_tail: Option<String>,
}

/// The diagnostics of an end, and its typed cause: a bound it went past leads (the AM
/// classifies on the cause), then how it ended and what cleaning up found; a stop says so
/// first, else a failure ends with the end of its stderr.
pub(super) fn end_report(f: EndFacts) -> (String, Option<EndCause>) {
    let mut diagnostics = f.how;
    for note in f.notes {
        diagnostics.push_str("; ");
        diagnostics.push_str(note);
    }
    let breach = f.breach.or(f.oom.map(Breach::from));
    if let Some(b) = &breach {
        diagnostics = format!("{}; {diagnostics}", b.why);
    }
    if f.stop_requested {
        diagnostics = format!("stopped by request; {diagnostics}");
    } else if f.code != 0 {
        if let Some(tail) = f.stderr_tail.as_deref().map(str::trim).filter(|t| !t.is_empty()) {
            diagnostics.push_str(&format!("{}{tail}", crate::protocol::STDERR_TAIL_MARK));
        }
    }
    (diagnostics, breach.map(|b| b.cause))
}

/// Exit code and a sentence: a code as is; killed by signal N → 128 + N (bash's convention).
pub(super) fn describe_exit(st: ExitStatus) -> (i32, String) {
    if let Some(code) = st.code() {
        (code, format!("exited with code {code}"))
    } else if let Some(sig) = st.signal() {
        (128 + sig, format!("killed by signal {sig} ({})", signal_name(sig)))
    } else {
        (exit_status::INVALID, format!("ended without an exit code ({st})"))
    }
}

/// `SIGSEGV` for 11; `SIG<n>` for a number this system has no name for.
pub(super) fn signal_name(sig: i32) -> String {
    Signal::try_from(sig).map_or_else(|_| format!("SIG{sig}"), |s| s.as_str().to_string())
}
