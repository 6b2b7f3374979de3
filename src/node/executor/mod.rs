//! Node executor: runs each container's commands as real processes, each container in a
//! cgroup of its own (see [`crate::node::cgroup`]) when the machine allows, as its user's own
//! unprivileged uid when the node has one for it ([`crate::node::identity`], [`RunAs`]).
//!
//! Owns each container's record (`root/<role>-<index>@<containerId>/` for a job's task, so
//! that a person finds it, else `root/<containerId>/`: [`record_name`]; the node's: 0711,
//! nothing in it writable by the task, its files 0600) and in it the task's own directory (`work/`, 0700,
//! owned by the task's uid: `GPUAM_CONTAINER_DIR`, holding `launch.sh`). The record holds the captured
//! `stdout` / `stderr` (the task writes them through the handles it is given), what was
//! launched (`process.json`: pid and start time), how it ended (`end.json`), that the RM
//! acknowledged the end (`acked`) and whether it ran in an image; a restarted node reads
//! only the record ([`Executor::unacknowledged`], [`Executor::reattach`]). Nothing in the
//! task's directory is ever opened or followed by the node, except the preemption notice
//! it creates there ([`create_new_in`]: relative to a directory handle, `O_EXCL |
//! O_NOFOLLOW`, renamed into place) and the leader's own exit code read without following
//! links. The task's directory is removed when the container ends; the record (its logs)
//! after [`ExecutorOptions::retention`] once the end was acknowledged ([`Executor::sweep`]).
//!
//! Also owns the generated `launch.sh`, the container environment of
//! DESIGN.md §6 that the executor itself is responsible for (GPU variables, container id,
//! host, directory), stopping (SIGTERM → grace → SIGKILL to the whole group) and the one
//! `NodeEvent::Exited` per started container.
//!
//! Runtime: every method that spawns or waits uses tokio (`tokio::process`, `tokio::spawn`),
//! so the executor must be called from within a tokio runtime — the RM always calls it from
//! its axum handlers. [`Executor::start`] checks this and fails cleanly instead of panicking.
//!
//! Process model: `bash launch.sh` is started in a new session (`setsid` before `exec`, [`vfork`]), so
//! it leads its own process group (pgid = pid) and has no controlling terminal. Signals go
//! to the whole group (`kill(-pgid)`), which reaches the background children of the task's
//! commands too. A new session (rather than only a new group) also detaches the task from
//! the RM's terminal and session, so a later RM restart can re-attach to live containers
//! instead of taking them down with it (DESIGN.md §9). The program runs only once its
//! `process.json` is written ([`hold`]): a node that restarts finds every task that ran.
//!
//! Containment: the process joins the container's cgroup in the new child, before
//! `exec`. Stopping signals every member of the cgroup (a daemon that left the session with
//! `setsid` included) and ends with `cgroup.kill`; a container is Complete, and its `Exited`
//! event sent, only once its cgroup is empty. Without a cgroup but with a shim executable
//! ([`crate::node::cgroup::Mechanism::Subreaper`]), the process is `gpuam container-shim -- bash
//! launch.sh` ([`crate::node::shim`]): same session, same user; it is the recorded process (pid =
//! pgid), a stop sends it SIGTERM (with the group) and after the grace
//! [`crate::node::shim::KILL_SIGNAL`], never SIGKILL, and the container is Complete once the shim
//! has exited, which it does only when nothing it keeps is alive. Without either, the
//! process group is all there is (and a process that leaves it escapes).
//!
//! What program a task runs as (on the host, or in its image) is chosen by
//! [`crate::node::image::program_for`]; spawning adds the containment around it.
//!
//! Log size: with [`ExecutorOptions::max_log_bytes`], a watcher per running container
//! checks its `stdout` and `stderr` every [`LOG_CHECK`] and once more when it ends; a file
//! over the limit is cut to its newest part ([`LOG_KEEP_MAX`] at most) behind a line that
//! says how much was dropped (`node.max_log_bytes`). The files are opened `O_APPEND`, so
//! the task's writes go on at the new end; the watcher holds its own handle of each file,
//! so renaming or replacing them does not escape it.
//!
//! This file holds the executor's state and options; each job is a file of its own:
//! - [`table`]: the table of containers and their phases (allocate, status, forget);
//! - [`env`]: the executor's part of a task's environment and launch script (the rest
//!   of DESIGN.md §6 is [`crate::node::contract`]);
//! - [`spawn`]: starting a container (record, cgroup, `launch.sh` in a new session);
//! - [`hold`]: holding its commands back until its process is recorded;
//! - [`signal`]: stopping it (SIGTERM, grace, SIGKILL) and the signals that do it;
//! - [`ending`]: the ending protocol (leftovers, cgroup, `end.json`, one `Exited`);
//! - [`reattach`]: taking containers back after a restart, from their records alone;
//! - [`logs`]: reading and capping `stdout` / `stderr`;
//! - [`records`]: the record on disk, the preemption notice, removing what ended;
//! - [`files`]: opening and creating files where a task can write, never following a link.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::mpsc;

use super::{NodeError, NodeEvent};
use crate::node::cgroup::Containment;

mod ending;
mod env;
mod files;
pub mod hold;
mod logs;
mod reattach;
mod records;
mod signal;
mod spawn;
mod table;
#[cfg(test)]
mod tests;
mod vfork;

pub use files::{create_new_in, open_dir_in_place, read_small_in_place, remove_tree};
pub use logs::{cap_log, LogStream, LOG_CHECK, LOG_KEEP_MAX, MAX_LOG_BYTES};
pub use records::{
    record_id, record_name, valid_container_id, work_dir, RecordedEnd, ACKED_FILE, DEFAULT_RETENTION,
    DEFAULT_WORK_DIR_GRACE, DEFER_REMOVAL_MAX_BYTES, END_FILE, EXIT_CODE_FILE, LABEL_SEP, PREEMPT_FILE, PROCESS_FILE,
    WORK_DIR,
};
pub(super) use signal::LEFTOVER_GRACE;
use table::Table;

/// The old name, kept for the RM server's imports.
pub type ExecError = NodeError;

/// Runs containers of all simulated hosts (and `local: true` hosts) on this machine.
///
/// Cheap to share behind an `Arc`; its state sits behind a `parking_lot::Mutex` that is
/// never held across an `.await`.
pub struct Executor {
    root: PathBuf,
    events: mpsc::UnboundedSender<NodeEvent>,
    table: Table,
    opts: ExecutorOptions,
    /// When finished records were last looked for ([`Executor::sweep`]).
    last_sweep: Mutex<Option<Instant>>,
    /// Whether the root was marked to spread its records ([`spread_records`]).
    spread: std::sync::Once,
}

/// The unprivileged user a task runs as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunAs {
    /// The account's name, or the user's for a per-user uid without an account (the
    /// task's `USER` and `LOGNAME`).
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (an account's, from the group database); none for a per-user uid.
    pub groups: Vec<u32>,
}

impl RunAs {
    /// Looks `name` up in the user database.
    pub fn lookup(name: &str) -> Result<RunAs, String> {
        match nix::unistd::User::from_name(name) {
            Ok(Some(u)) => Ok(RunAs {
                name: name.to_string(),
                uid: u.uid.as_raw(),
                gid: u.gid.as_raw(),
                groups: std::ffi::CString::new(name)
                    .ok()
                    .and_then(|c| nix::unistd::getgrouplist(&c, u.gid).ok())
                    .map(|gs| gs.into_iter().map(nix::unistd::Gid::as_raw).collect())
                    .unwrap_or_default(),
            }),
            Ok(None) => Err(format!("there is no user `{name}` on this machine")),
            Err(e) => Err(format!("cannot look up user `{name}`: {e}")),
        }
    }
}

/// How an executor contains and runs its tasks.
#[derive(Clone, Debug, Default)]
pub struct ExecutorOptions {
    /// Where containers' cgroups go ([`Containment::none`]: process groups only).
    pub containment: Containment,
    /// Run tasks as this user (`None`: as this process's user), unless `users` says.
    pub run_as: Option<RunAs>,
    /// Which uid each user's tasks run as ([`crate::node::identity`]); consulted for every start
    /// that names its user ([`Executor::start_as`]); `None`: `run_as`.
    pub users: Option<Arc<crate::node::identity::TaskUsers>>,
    /// Set by the node's operator for every task (`gpuam node --task-env`, YARN's
    /// admin-env): site paths such as a shared software directory. Checked with
    /// [`check_task_env`]; the job's and gpuam's own variables come after it.
    pub task_env: Vec<(String, String)>,
    /// Most bytes each of a container's `stdout` and `stderr` may hold (`node.max_log_bytes`;
    /// `None`: no limit). See the module doc.
    pub max_log_bytes: Option<u64>,
    /// How long a finished, acknowledged container's record (its logs) is kept
    /// (`node.log_retention_sec`; `None`: [`DEFAULT_RETENTION`]).
    pub retention: Option<Duration>,
    /// How long after its end a container's work directory is removed
    /// (`node.work_dir_grace_sec`; `None`: [`DEFAULT_WORK_DIR_GRACE`]). A container killed
    /// for its disk bound loses it at once.
    pub work_dir_grace: Option<Duration>,
    /// Ends are heard in this process (the in-process node), so no acknowledgement comes:
    /// a finished record counts as acknowledged for the retention.
    pub ends_heard_here: bool,
    /// Most MiB a container's directory may hold (`node.max_container_disk_mb`; `None`: no
    /// bound). See [`crate::node::bounds`].
    pub max_disk_mb: Option<u64>,
    /// What to do with a task that names an image (`node.image_runtime`,
    /// `node.run_without_image`).
    pub image: crate::node::image::ImagePolicy,
}

impl Executor {
    /// `root` holds one record per container ([`record_name`]); it is
    /// created on the first start.
    pub fn new(root: PathBuf, events: mpsc::UnboundedSender<NodeEvent>) -> Self {
        Executor::with_options(root, events, ExecutorOptions::default())
    }

    /// As [`Executor::new`], with containment and a task user.
    pub fn with_options(root: PathBuf, events: mpsc::UnboundedSender<NodeEvent>, opts: ExecutorOptions) -> Self {
        Executor {
            root,
            events,
            table: Arc::new(Mutex::new(HashMap::new())),
            opts,
            last_sweep: Mutex::new(None),
            spread: std::sync::Once::new(),
        }
    }

    /// The containment its containers get.
    pub fn containment(&self) -> &Containment {
        &self.opts.containment
    }

    /// The directory that holds all container directories.
    pub fn root(&self) -> &Path {
        &self.root
    }
}
