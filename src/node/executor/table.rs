//! The executor's table of containers and their phases: what the node knows of each
//! container it runs (allocated, starting, running, complete; its process, cgroup, end),
//! and the operations that only read or change that table (announce, status, list,
//! forget once acknowledged).

use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::watch;

use super::files::create_new_in;
use super::records::{valid_container_id, ACKED_FILE};
use super::Executor;
use crate::node::cgroup::Cgroup;
use crate::node::procs::ProcessId;
use crate::node::NodeError;
use crate::protocol::{ContainerState, ContainerStatus};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Announced with [`Executor::allocate`], not started.
    Allocated,
    /// `start` is creating the directory and spawning; reported as Allocated.
    Starting,
    Running,
    Complete,
}

#[derive(Debug)]
pub(super) struct Entry {
    pub(super) dir: PathBuf,
    pub(super) phase: Phase,
    pub(super) pid: Option<u32>,
    /// The leader's identity (pid and start time), to tell it from a reused pid.
    pub(super) leader: Option<ProcessId>,
    pub(super) exit_status: Option<i32>,
    pub(super) diagnostics: String,
    pub(super) stop_requested: bool,
    /// Turns `true` once the container is Complete (set by its waiter task).
    pub(super) done: Option<watch::Receiver<bool>>,
    /// Its cgroup (empty when the node has none).
    pub(super) cgroup: Cgroup,
    /// The recorded process is a subreaper shim (see [`crate::node::shim`]): stopped with
    /// SIGTERM, then [`crate::node::shim::KILL_SIGNAL`], never SIGKILL.
    pub(super) shim: bool,
    /// Handles of its `stdout` and `stderr` for the log watcher (empty without a limit).
    pub(super) logs: Arc<Vec<File>>,
    /// The uid and gid its task runs as, when not this process's.
    pub(super) owner: Option<(u32, u32)>,
}

impl Entry {
    pub(super) fn new(dir: PathBuf, phase: Phase) -> Self {
        Entry {
            dir,
            phase,
            pid: None,
            leader: None,
            exit_status: None,
            diagnostics: String::new(),
            stop_requested: false,
            done: None,
            cgroup: Cgroup::default(),
            shim: false,
            logs: Arc::default(),
            owner: None,
        }
    }
}

pub(super) type Table = Arc<Mutex<HashMap<String, Entry>>>;

/// How a phase is reported (a start under way is still Allocated).
pub(super) fn reported_state(phase: Phase) -> ContainerState {
    match phase {
        Phase::Allocated | Phase::Starting => ContainerState::Allocated,
        Phase::Running => ContainerState::Running,
        Phase::Complete => ContainerState::Complete,
    }
}

impl Executor {
    /// Records a granted, not yet started container so that `status` reports it as
    /// Allocated. Optional: `start` works without it. A container that is already known
    /// and past Allocated gives `AlreadyStarted`.
    pub fn allocate(&self, container_id: &str) -> Result<(), NodeError> {
        if !valid_container_id(container_id) {
            return Err(NodeError::UnknownContainer(container_id.into()));
        }
        let mut table = self.table.lock();
        match table.get(container_id) {
            Some(e) if e.phase != Phase::Allocated => Err(NodeError::AlreadyStarted(container_id.into())),
            Some(_) => Ok(()),
            None => {
                table.insert(
                    container_id.into(),
                    Entry::new(self.root.join(container_id), Phase::Allocated),
                );
                Ok(())
            }
        }
    }

    /// The container's state, exit status, pid (= pgid) and diagnostics; `None` if unknown.
    pub fn status(&self, container_id: &str) -> Option<ContainerStatus> {
        let table = self.table.lock();
        let e = table.get(container_id)?;
        Some(ContainerStatus {
            container_id: container_id.into(),
            state: reported_state(e.phase),
            exit_status: e.exit_status,
            diagnostics: e.diagnostics.clone(),
            pid: e.pid,
            started_ms: None,
        })
    }

    /// Ids of the containers whose process is running now, sorted.
    pub fn running_ids(&self) -> Vec<String> {
        let table = self.table.lock();
        let mut ids: Vec<String> = table
            .iter()
            .filter(|(_, e)| e.phase == Phase::Running)
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        ids
    }

    /// Drops a Complete container from the table once its end was acknowledged; `true` if
    /// it was removed. Its record says so ([`ACKED_FILE`]): it is not re-attached after a
    /// restart, and its record (the logs) goes after [`ExecutorOptions::retention`]. Lets
    /// a long-running RM bound the executor's memory once it has reported the end.
    pub fn forget(&self, container_id: &str) -> bool {
        let mut table = self.table.lock();
        match table.get(container_id) {
            Some(e) if e.phase == Phase::Complete => {
                if let Err(e) = create_new_in(&e.dir, ACKED_FILE, b"", None) {
                    if e.kind() != std::io::ErrorKind::AlreadyExists && e.kind() != std::io::ErrorKind::NotFound {
                        tracing::warn!(container = container_id, "cannot record the acknowledgement: {e}");
                    }
                }
                table.remove(container_id).is_some()
            }
            _ => false,
        }
    }
}
