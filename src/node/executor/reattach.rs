//! Re-attaching after a restart: a new executor (a restarted RM or agent) finds the
//! containers an earlier one launched from their records alone ([`Executor::unacknowledged`])
//! and takes each back under watch ([`Executor::reattach`]): its recorded end, else its
//! live leader (same pid and start time), else the exit status its script wrote.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use tokio::sync::watch;

use super::ending::{container_ended, Ending};
use super::files::{open_log_in_place, read_record_file, read_small_in_place};
use super::logs::{watch_logs, LogStream};
use super::records::{
    record_id, valid_container_id, work_dir, RecordedEnd, ACKED_FILE, END_FILE, EXIT_CODE_FILE, PROCESS_FILE,
};
use super::table::{Entry, Phase};
use super::Executor;
use crate::node::cgroup::Cgroup;
use crate::node::procs::ProcessId;
use crate::node::NodeEvent;
use crate::protocol::exit_status;

impl Executor {
    /// Takes a container that an earlier executor (an RM before a restart) started, and
    /// that the RM's records say is running, back under watch: if the node recorded its
    /// end ([`END_FILE`]), it ends now with that; else if its leader still runs (the pid
    /// and start time in `process.json` match), it is watched and can be stopped as if
    /// started here; if not, the container ends now with the exit status its script
    /// recorded. Either way exactly one `Exited` event follows. Only the container's
    /// record is read, which its task cannot write (see the module doc).
    pub fn reattach(&self, container_id: &str) {
        let dir = self.find_record(container_id);
        let valid = valid_container_id(container_id);
        if let Some(end) = valid.then(|| recorded_end(&dir)).flatten() {
            let mut entry = Entry::new(dir, Phase::Complete);
            entry.exit_status = Some(end.exit_status);
            entry.diagnostics = end.diagnostics.clone();
            self.table.lock().insert(container_id.to_string(), entry);
            let _ = self.events.send(NodeEvent::Exited {
                container_id: container_id.into(),
                exit_status: end.exit_status,
                diagnostics: end.diagnostics,
                cause: end.cause,
            });
            return;
        }
        let leader = valid
            .then(|| read_record_file(&dir.join(PROCESS_FILE), 64 << 10).ok())
            .flatten()
            .and_then(|b| serde_json::from_slice::<ProcessId>(&b).ok());
        let (done_tx, done_rx) = watch::channel(false);
        let cgroup = if valid_container_id(container_id) {
            self.opts.containment.cgroup(container_id)
        } else {
            Cgroup::default()
        };
        let mut entry = Entry::new(dir.clone(), Phase::Running);
        entry.pid = leader.map(|p| p.pid);
        entry.leader = leader;
        entry.done = Some(done_rx);
        entry.cgroup = cgroup.clone();
        // Whatever this executor's containment: the process an earlier one recorded says.
        entry.shim = leader.is_some_and(|p| p.alive() && crate::node::shim::is_shim(p.pid));
        self.table.lock().insert(container_id.to_string(), entry);
        let ending = self.ending(container_id, dir, done_tx, cgroup);
        match leader.filter(ProcessId::alive) {
            Some(p) => {
                tracing::info!(
                    container = container_id,
                    pid = p.pid,
                    "re-attached to a running container"
                );
                if let Some(max) = self.opts.max_log_bytes {
                    let logs: Arc<Vec<File>> = Arc::new(
                        [LogStream::Stdout, LogStream::Stderr]
                            .into_iter()
                            .filter_map(|s| open_log_in_place(&ending.dir.join(s.file_name()), true).ok())
                            .collect(),
                    );
                    let done = {
                        let mut table = self.table.lock();
                        table.get_mut(container_id).and_then(|e| {
                            e.logs = logs.clone();
                            e.done.clone()
                        })
                    };
                    if let Some(done) = done {
                        tokio::spawn(watch_logs(logs, max, done));
                    }
                }
                tokio::spawn(wait_inherited(ending, p));
            }
            None => {
                let (code, how) = recorded_exit(&work_dir(&ending.dir));
                // The group id is the leader's pid; leftovers of a dead leader still go.
                let pgid = leader.map_or(0, |p| p.pid);
                tokio::spawn(container_ended(ending, pgid, leader, code, how));
            }
        }
    }

    /// Ids of the containers launched here whose end the RM has not acknowledged, from
    /// their records alone (what a restarted agent re-attaches to). That includes one
    /// whose launch began (its log files are created before the spawn) but whose process
    /// was never recorded: re-attaching ends it. Sorted.
    pub fn unacknowledged(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut out: Vec<String> = entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|name| {
                let record = self.root.join(name);
                let launched = [PROCESS_FILE, LogStream::Stdout.file_name()]
                    .iter()
                    .any(|f| std::fs::symlink_metadata(record.join(f)).is_ok());
                launched && std::fs::symlink_metadata(record.join(ACKED_FILE)).is_err()
            })
            .filter_map(|name| record_id(&name).map(str::to_string))
            .collect();
        out.sort();
        out
    }
}

/// Waits for a leader this executor did not start (an earlier RM did), then ends the
/// container with the status the leader's script wrote, if it got to write one.
pub(super) async fn wait_inherited(ending: Ending, leader: ProcessId) {
    leader.ended().await;
    let (code, how) = match recorded_exit(&work_dir(&ending.dir)) {
        // Another watcher of it (the executor that started it, still alive in tests) may
        // have recorded the end, and removed the directory, first.
        (exit_status::ABORTED, how) => {
            recorded_end(&ending.dir).map_or((exit_status::ABORTED, how), |e| (e.exit_status, e.diagnostics))
        }
        other => other,
    };
    container_ended(ending, leader.pid, Some(leader), code, how).await;
}

/// The end the node recorded in container record `record` ([`END_FILE`]), if any.
pub(super) fn recorded_end(record: &Path) -> Option<RecordedEnd> {
    read_record_file(&record.join(END_FILE), 64 << 10)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
}

/// The exit status `launch.sh` wrote in the work directory `work`, with a sentence;
/// ABORTED when there is none (the leader was killed with SIGKILL, or never ran). The
/// file is the task's: read without following a link, at most 32 bytes, only a number kept.
pub(super) fn recorded_exit(work: &Path) -> (i32, String) {
    exit_of_record(read_small_in_place(&work.join(EXIT_CODE_FILE), 32).ok().as_deref())
}

/// [`recorded_exit`] from the file's bytes (`None`: no file).
pub(super) fn exit_of_record(written: Option<&[u8]>) -> (i32, String) {
    match written
        .and_then(|b| std::str::from_utf8(b).ok())
        .and_then(|t| t.trim().parse::<i32>().ok())
        // The task wrote this file: only a real exit code (0-255) is taken, never one of the
        // node's own statuses (negative), which it could use to pass as preempted.
        .filter(|c| (0..=255).contains(c))
    {
        Some(code) => (code, format!("exited with code {code} (seen after an RM restart)")),
        None => (
            exit_status::ABORTED,
            "the container's process ended while the RM was down and left no exit status".into(),
        ),
    }
}
