//! Node executor: runs each container's commands as real processes, each container in a
//! cgroup of its own (see [`super::cgroup`]) when the machine allows, as its user's own
//! unprivileged uid when the node has one for it ([`super::identity`], [`RunAs`]).
//!
//! Owns each container's record (`root/<role>-<index>@<containerId>/` for a job's task, so
//! that a person finds it, else `root/<containerId>/`: [`record_name`]; the node's: 0711,
//! nothing in it writable by the task) and in it the task's own directory (`work/`, 0700,
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
//! Process model: `bash launch.sh` is started in a new session (`setsid` in `pre_exec`), so
//! it leads its own process group (pgid = pid) and has no controlling terminal. Signals go
//! to the whole group (`kill(-pgid)`), which reaches the background children of the task's
//! commands too. A new session (rather than only a new group) also detaches the task from
//! the RM's terminal and session, so a later RM restart can re-attach to live containers
//! instead of taking them down with it (DESIGN.md §9).
//!
//! Containment: the process joins the container's cgroup in the forked child, before
//! `exec`. Stopping signals every member of the cgroup (a daemon that left the session with
//! `setsid` included) and ends with `cgroup.kill`; a container is Complete, and its `Exited`
//! event sent, only once its cgroup is empty. Without a cgroup but with a shim executable
//! ([`super::cgroup::Mechanism::Subreaper`]), the process is `gpuam container-shim -- bash
//! launch.sh` ([`super::shim`]): same session, same user; it is the recorded process (pid =
//! pgid), a stop sends it SIGTERM (with the group) and after the grace
//! [`super::shim::KILL_SIGNAL`], never SIGKILL, and the container is Complete once the shim
//! has exited, which it does only when nothing it keeps is alive. Without either, the
//! process group is all there is (and a process that leaves it escapes).
//!
//! The one place that builds the command running a task is [`task_command`]: a runner that
//! wraps tasks (an image runner, say) changes that function only.
//!
//! Log size: with [`ExecutorOptions::max_log_bytes`], a watcher per running container
//! checks its `stdout` and `stderr` every [`LOG_CHECK`] and once more when it ends; a file
//! over the limit is cut to its newest part ([`LOG_KEEP_MAX`] at most) behind a line that
//! says how much was dropped (`node.max_log_bytes`). The files are opened `O_APPEND`, so
//! the task's writes go on at the new end; the watcher holds its own handle of each file,
//! so renaming or replacing them does not escape it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};

use super::cgroup::{Cgroup, Containment, Limits};
use super::contract::shell_quote;
use super::procs::ProcessId;
use super::{NodeError, NodeEvent};
use crate::protocol::{exit_status, ContainerState, ContainerStatus, LaunchContext};
use crate::resources::Resources;
use crate::topology::{task_locality, CpuList, TaskLocality, Topology};

/// Which captured stream to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogStream {
    Stdout,
    Stderr,
}

impl LogStream {
    /// The fixed file name of the stream inside the container directory.
    pub fn file_name(self) -> &'static str {
        match self {
            LogStream::Stdout => "stdout",
            LogStream::Stderr => "stderr",
        }
    }
}

/// Old names, kept for the RM server's imports.
pub type ExecError = NodeError;
pub type ExecEvent = NodeEvent;

/// The most a single `read_log` returns: a larger file (or a larger tail) is cut to its
/// last `MAX_LOG_BYTES` bytes, so a huge log never ends up in memory whole.
pub const MAX_LOG_BYTES: u64 = 8 * 1024 * 1024;

/// How long processes left behind by a container whose main script already exited get
/// after SIGTERM before SIGKILL (the subreaper shim gives its leftovers the same).
pub(super) const LEFTOVER_GRACE: Duration = Duration::from_secs(2);
/// How long to wait for a group to vanish after SIGKILL before giving up on it.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// How often group liveness is polled.
const POLL: Duration = Duration::from_millis(20);
/// How much of stderr's tail goes into a failed container's diagnostics.
const DIAG_STDERR_BYTES: u64 = 512;
/// In a container's work directory: the leader's exit status, written by `launch.sh`
/// itself (the task's own word, read only when the node did not see the end itself).
pub const EXIT_CODE_FILE: &str = "exit_code";
/// In a container's record: the leader's [`ProcessId`] (JSON), for re-attaching.
pub const PROCESS_FILE: &str = "process.json";
/// In a container's record: how it ended ([`RecordedEnd`], JSON), written by the node.
pub const END_FILE: &str = "end.json";
/// In a container's record: the RM acknowledged its end (not re-attached after a restart;
/// removed after [`ExecutorOptions::retention`]).
pub const ACKED_FILE: &str = "acked";
/// In a container's record: the task's own directory (`GPUAM_CONTAINER_DIR`).
pub const WORK_DIR: &str = "work";
/// Created in the container's work directory when the RM takes the container back
/// (`GPUAM_PREEMPT_FILE`): the task may checkpoint before it is stopped. It holds the
/// deadline (milliseconds since the epoch) and the reason, one per line.
pub const PREEMPT_FILE: &str = "preempt";
/// How long a finished container's record (its logs) is kept by default
/// (`node.log_retention_sec`).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// How long after its end a container's work directory is removed by default
/// (`node.work_dir_grace_sec`). Removing it at once put the deletions among the next
/// starts: on ext4 without a journal, every inode the node allocates then scans past the
/// recently deleted ones of its group (`recently_deleted` in the kernel), and a burst of
/// ends made the following starts twice as slow (docs/BENCHMARKS.md). Later, the removals
/// fall outside the burst; the directory is the task's own (0700, its uid) meanwhile.
pub const DEFAULT_WORK_DIR_GRACE: Duration = Duration::from_secs(30);
/// An ended container's work directory holding more than this goes at once, whatever the
/// grace (only small ones wait).
pub const DEFER_REMOVAL_MAX_BYTES: u64 = 1 << 20;
/// Finished records are looked for at most this often (on a start).
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Between the task's label and the container id in a record's name
/// (`worker-1@container_…`): a character no container id holds, so the id is read back
/// without doubt ([`record_id`]).
pub const LABEL_SEP: char = '@';

/// The name of a container's record: `ROLE-INDEX@ID` for a task whose launch context names
/// its role and index (`GPUAM_TASK_ROLE`, `GPUAM_TASK_INDEX`), so that a person looking at a
/// node finds a task's directory; else the bare id.
pub fn record_name(container_id: &str, env: &std::collections::BTreeMap<String, String>) -> String {
    let role = env.get("GPUAM_TASK_ROLE").map(String::as_str).unwrap_or("");
    let index = env.get("GPUAM_TASK_INDEX").map(String::as_str).unwrap_or("");
    let role_ok = (1..=64).contains(&role.len())
        && role
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    let index_ok = (1..=10).contains(&index.len()) && index.bytes().all(|b| b.is_ascii_digit());
    if role_ok && index_ok {
        format!("{role}-{index}{LABEL_SEP}{container_id}")
    } else {
        container_id.to_string()
    }
}

/// The container id a record's directory name holds (see [`record_name`]); `None` for a
/// name that is not a record's.
pub fn record_id(name: &str) -> Option<&str> {
    let id = name.rsplit_once(LABEL_SEP).map_or(name, |(_, id)| id);
    valid_container_id(id).then_some(id)
}

/// The task's own directory inside container record `record`.
pub fn work_dir(record: &Path) -> PathBuf {
    record.join(WORK_DIR)
}

/// How a container ended, as the node saw it (its record's [`END_FILE`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RecordedEnd {
    pub exit_status: i32,
    pub diagnostics: String,
}

/// Variables copied from the executor's own environment; nothing else leaks into a task.
const BASE_ENV: [&str; 3] = ["PATH", "HOME", "LANG"];
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Announced with [`Executor::allocate`], not started.
    Allocated,
    /// `start` is creating the directory and spawning; reported as Allocated.
    Starting,
    Running,
    Complete,
}

#[derive(Debug)]
struct Entry {
    dir: PathBuf,
    phase: Phase,
    pid: Option<u32>,
    /// The leader's identity (pid and start time), to tell it from a reused pid.
    leader: Option<ProcessId>,
    exit_status: Option<i32>,
    diagnostics: String,
    stop_requested: bool,
    /// Turns `true` once the container is Complete (set by its waiter task).
    done: Option<watch::Receiver<bool>>,
    /// Its cgroup (empty when the node has none).
    cgroup: Cgroup,
    /// The recorded process is a subreaper shim (see [`super::shim`]): stopped with
    /// SIGTERM, then [`super::shim::KILL_SIGNAL`], never SIGKILL.
    shim: bool,
    /// Handles of its `stdout` and `stderr` for the log watcher (empty without a limit).
    logs: Arc<Vec<File>>,
    /// The uid and gid its task runs as, when not this process's.
    owner: Option<(u32, u32)>,
}

impl Entry {
    fn new(dir: PathBuf, phase: Phase) -> Self {
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

type Table = Arc<Mutex<HashMap<String, Entry>>>;

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

/// How often a running container's log sizes are checked.
pub const LOG_CHECK: Duration = Duration::from_millis(250);
/// The most of a log's newest bytes kept when it is cut (a quarter of the limit when that
/// is less).
pub const LOG_KEEP_MAX: u64 = 4 << 20;

/// How an executor contains and runs its tasks.
#[derive(Clone, Debug, Default)]
pub struct ExecutorOptions {
    /// Where containers' cgroups go ([`Containment::none`]: process groups only).
    pub containment: Containment,
    /// Run tasks as this user (`None`: as this process's user), unless `users` says.
    pub run_as: Option<RunAs>,
    /// Which uid each user's tasks run as ([`super::identity`]); consulted for every start
    /// that names its user ([`Executor::start_as`]); `None`: `run_as`.
    pub users: Option<Arc<super::identity::TaskUsers>>,
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
    /// bound). See [`super::bounds`].
    pub max_disk_mb: Option<u64>,
}

/// Names a node's operator may not set with `--task-env`: gpuam sets them for each task
/// (DESIGN.md §6, OpenPAI's `PAI_*`), and they would be replaced without a word.
fn reserved_task_env(name: &str) -> bool {
    name.starts_with("GPUAM_")
        || name.starts_with("PAI_")
        || matches!(
            name,
            "CUDA_VISIBLE_DEVICES" | "NVIDIA_VISIBLE_DEVICES" | "CONTAINER_GPUS" | "CONTAINER_PORTS"
        )
}

/// Checks one `--task-env NAME=VALUE` entry; the error names the entry and the fix.
pub fn check_task_env(name: &str, value: &str) -> Result<(), String> {
    let valid_name = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !valid_name {
        return Err(format!(
            "`{}` is not a variable name: use letters, digits and `_`, not starting with a digit",
            name.escape_debug()
        ));
    }
    if reserved_task_env(name) {
        return Err(format!(
            "`{name}` is set by gpuam for each task (GPUAM_*, PAI_*, CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES, \
             CONTAINER_GPUS, CONTAINER_PORTS); choose another name"
        ));
    }
    if value.contains('\0') {
        return Err(format!("`{name}` has a NUL character in its value; remove it"));
    }
    Ok(())
}

/// `[A-Za-z0-9_.-]+`, and not `.` / `..` (which would name the root or its parent).
/// Ids longer than 255 bytes are refused too (they cannot be directory names).
pub fn valid_container_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 255
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-')
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

    /// Where container `id`'s record is on disk when this executor's table does not say
    /// (after a restart, or once it was forgotten): `ID`, else the one `LABEL@ID`
    /// ([`record_name`]); `root/ID` (absent) when there is none.
    fn find_record(&self, container_id: &str) -> PathBuf {
        let bare = self.root.join(container_id);
        if !valid_container_id(container_id) || std::fs::symlink_metadata(&bare).is_ok() {
            return bare;
        }
        let suffix = format!("{LABEL_SEP}{container_id}");
        std::fs::read_dir(&self.root)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .find(|name| name.ends_with(&suffix) && record_id(name) == Some(container_id))
            .map_or(bare, |name| self.root.join(name))
    }

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

    /// Starts `ctx.commands` for a granted container; returns the process-group id.
    /// The executor adds the GPU environment (CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES,
    /// GPUAM_GPU_MASK, CONTAINER_GPUS) and GPUAM_CONTAINER_ID / GPUAM_HOST itself.
    ///
    /// Environment: a clean base (PATH, HOME, LANG from the executor's environment), then
    /// `ctx.env`, then the executor's variables, which win over `ctx.env` for their names:
    /// - `CUDA_VISIBLE_DEVICES`: ascending GPU indices of `granted.gpu_mask` (`"1,3"`); for
    ///   no GPUs the empty string, which makes CUDA frameworks see no device at all (unset
    ///   would expose every GPU of a local node);
    /// - `NVIDIA_VISIBLE_DEVICES`: the same list; for no GPUs `none`, the NVIDIA container
    ///   toolkit's explicit "no GPU" value (empty means "not set" to it);
    /// - `GPUAM_GPU_MASK` (`"0xa"`), `CONTAINER_GPUS` (the mask in decimal, `"10"`);
    /// - `GPUAM_CONTAINER_ID`, `GPUAM_HOST`, `GPUAM_CONTAINER_DIR`, `GPUAM_PREEMPT_FILE`
    ///   (a path that exists once the container is being preempted);
    /// - for a GPU share, `GPUAM_GPU_FRACTION` and `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`; for
    ///   custom resources `GPUAM_RESOURCES` and `GPUAM_RESOURCE_<NAME>` (see `share_env`).
    ///
    /// The process runs `bash launch.sh` in the record's `work/` as the leader of a new
    /// session and process group, stdin from /dev/null, stdout and stderr to the files
    /// `stdout` and `stderr` there. One `NodeEvent::Exited` follows when it ends; when the
    /// start itself fails this returns `Err` and no event is sent.
    ///
    /// Must be called within a tokio runtime (see the module doc).
    pub fn start(
        &self,
        container_id: &str,
        host: &str,
        granted: &Resources,
        ctx: LaunchContext,
    ) -> Result<u32, NodeError> {
        self.start_as(container_id, host, granted, ctx, None, None)
    }

    /// [`Executor::start`] on a node whose GPU topology is `topology`: the task also gets
    /// where its GPUs are ([`crate::topology::task_locality`]): `GPUAM_NIC`, `NCCL_IB_HCA`,
    /// `GPUAM_NUMA_NODES`, and its GPUs' NUMA-local CPUs (those this node can use) as its
    /// cgroup's cpuset where the node has one, else through `taskset -c`; either way
    /// `GPUAM_CPU_AFFINITY` names them.
    ///
    /// For a task of `user` (the job's submitter), with [`ExecutorOptions::users`], it
    /// runs as that user's own uid ([`super::identity`]); `user` is the task's `GPUAM_USER`.
    pub fn start_as(
        &self,
        container_id: &str,
        host: &str,
        granted: &Resources,
        ctx: LaunchContext,
        topology: Option<&Topology>,
        user: Option<&str>,
    ) -> Result<u32, NodeError> {
        let fail = |why: String| NodeError::StartFailed {
            id: container_id.into(),
            why,
        };
        if !valid_container_id(container_id) {
            return Err(fail(format!(
                "`{container_id}` is not a valid container id (use 1-255 characters of A-Z, a-z, 0-9, `_`, `.`, `-`, \
                 not `.` or `..`)"
            )));
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(fail("the executor must be called from within a tokio runtime".into()));
        }
        if granted.gpus > 0 && granted.gpu_mask == 0 {
            return Err(fail(format!(
                "the granted resources name {} GPUs but no GPU mask; a container needs exact GPUs (gpuMask)",
                granted.gpus
            )));
        }
        validate_context(&ctx).map_err(&fail)?;
        let run_as = match (&self.opts.users, user) {
            (Some(users), Some(user)) => users.resolve(user).map_err(&fail)?,
            (Some(users), None) if users.per_user() => {
                return Err(fail(
                    "the start names no user; a per-user node runs every task as its user's uid".into(),
                ))
            }
            (Some(users), None) => users.resolve("").map_err(&fail)?,
            (None, _) => self.opts.run_as.clone(),
        };
        self.sweep_now_and_then();
        self.spread.call_once(|| spread_records(&self.root));

        let dir = self.root.join(record_name(container_id, &ctx.env));
        let was_allocated = {
            let mut table = self.table.lock();
            match table.get_mut(container_id) {
                Some(e) if e.phase != Phase::Allocated => return Err(NodeError::AlreadyStarted(container_id.into())),
                Some(e) => {
                    e.phase = Phase::Starting;
                    e.dir = dir.clone();
                    true
                }
                None => {
                    table.insert(container_id.into(), Entry::new(dir.clone(), Phase::Starting));
                    false
                }
            }
        };

        let locality = topology.map(|t| task_locality(t, granted.gpu_mask)).unwrap_or_default();
        let cpus = locality.cpus.as_ref().and_then(usable_cpus);
        let env = container_env(
            container_id,
            host,
            granted,
            &work_dir(&dir),
            &ctx,
            &self.opts,
            run_as.as_ref(),
            user,
            &locality,
            cpus.as_ref(),
        );
        let limits = Limits {
            memory_mb: Some(granted.memory_mb).filter(|m| *m > 0),
            cpu: Some(u64::from(granted.cpu)).filter(|c| *c > 0),
            pids: None,
            gpus: Some(granted.gpu_mask),
        };
        let spawned = self
            .opts
            .containment
            .create(container_id, limits)
            .map_err(|e| format!("cannot create the container's cgroup: {e}"))
            .and_then(|mut cg| {
                // The cpuset where the node has one, else `taskset` around the task.
                let taskset = cpus
                    .as_ref()
                    .filter(|c| !self.opts.containment.pin_cpus(&mut cg, container_id, c))
                    .filter(|c| {
                        let found = taskset_found();
                        if !found {
                            tracing::warn!(
                                container = container_id,
                                "no cpuset and no `taskset` on PATH: not pinned to CPUs {c} (GPUAM_CPU_AFFINITY names them)"
                            );
                        }
                        found
                    })
                    .map(CpuList::to_string);
                let launch = Launch {
                    commands: &ctx.commands,
                    env: &env,
                    cgroup: &cg,
                    run_as: run_as.as_ref(),
                    taskset: taskset.as_deref(),
                    shim: self.opts.containment.shim(),
                };
                spawn_launch(&dir, container_id, &launch)
                    .map(|(child, pid, logs)| (child, pid, cg.clone(), logs))
                    .inspect_err(|_| cg.remove())
            });
        match spawned {
            Err(why) => {
                // Nothing ran: no record of it stays (a restarted node would take it for
                // a launch it has to end).
                let _ = std::fs::remove_dir_all(&dir);
                let mut table = self.table.lock();
                if was_allocated {
                    if let Some(e) = table.get_mut(container_id) {
                        e.phase = Phase::Allocated;
                    }
                } else {
                    table.remove(container_id);
                }
                Err(fail(why))
            }
            Ok((child, pid, cgroup, logs)) => {
                // Written before anything else can happen to it: without this record a
                // restarted executor could not find the process again.
                let leader = ProcessId::of(pid);
                if let Some(p) = leader {
                    let written = serde_json::to_vec(&p)
                        .map_err(std::io::Error::other)
                        .and_then(|b| std::fs::write(dir.join(PROCESS_FILE), b));
                    if let Err(e) = written {
                        tracing::warn!(container = container_id, "cannot record the process: {e}");
                    }
                }
                let (done_tx, done_rx) = watch::channel(false);
                let disk_done = done_rx.clone();
                let logs = Arc::new(logs);
                if let Some(max) = self.opts.max_log_bytes {
                    tokio::spawn(watch_logs(logs.clone(), max, done_rx.clone()));
                }
                {
                    let mut table = self.table.lock();
                    if let Some(e) = table.get_mut(container_id) {
                        e.logs = logs;
                        e.phase = Phase::Running;
                        e.pid = Some(pid);
                        e.leader = leader;
                        e.done = Some(done_rx);
                        e.cgroup = cgroup.clone();
                        e.shim = self.opts.containment.shim().is_some();
                        e.owner = run_as.as_ref().map(|u| (u.uid, u.gid));
                    }
                }
                let ending = self.ending(container_id, dir, done_tx, cgroup);
                if let Some(mb) = self.opts.max_disk_mb {
                    let target = super::bounds::Target {
                        cgroup: ending.cgroup.clone(),
                        pid,
                        shim: self.opts.containment.shim().is_some(),
                    };
                    // The task's own directory: its logs are the node's, bounded apart.
                    let (d, v) = (work_dir(&ending.dir), ending.verdict.clone());
                    tokio::spawn(super::bounds::watch_disk(d, mb, target, v, disk_done));
                }
                tokio::spawn(wait_container(ending, child, pid, leader));
                Ok(pid)
            }
        }
    }

    /// What ends container `id` when its leader is gone (see [`container_ended`]).
    fn ending(&self, id: &str, dir: PathBuf, done: watch::Sender<bool>, cgroup: Cgroup) -> Ending {
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
            });
            return;
        }
        let leader = valid
            .then(|| read_small_in_place(&dir.join(PROCESS_FILE), 64 << 10).ok())
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
        entry.shim = leader.is_some_and(|p| p.alive() && super::shim::is_shim(p.pid));
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

    /// Stops the container's whole process group: SIGTERM, then SIGKILL after `grace` (to
    /// the group and cgroup; under a shim, [`super::shim::KILL_SIGNAL`] to the shim, which
    /// kills everything it keeps).
    ///
    /// Returns once the container is Complete and its group is gone (or, in the worst case,
    /// `KILL_WAIT` after SIGKILL). Idempotent: stopping a completed container does nothing.
    /// A container that was only allocated becomes Complete with `ABORTED` (-100) and gets
    /// its `Exited` event. The `Exited` event of a stopped container says "stopped by
    /// request" and carries 143 (SIGTERM), 137 (SIGKILL) or the code it exited with.
    pub async fn stop(&self, container_id: &str, grace: Duration) -> Result<(), NodeError> {
        if !valid_container_id(container_id) {
            return Err(NodeError::UnknownContainer(container_id.into()));
        }
        // A concurrent `start` is spawning: wait (briefly) until it knows the pid.
        let give_up = Instant::now() + KILL_WAIT;
        let (pgid, leader, mut done, cgroup, shim) = loop {
            {
                let mut table = self.table.lock();
                let entry = table
                    .get_mut(container_id)
                    .ok_or_else(|| NodeError::UnknownContainer(container_id.into()))?;
                match entry.phase {
                    Phase::Complete => return Ok(()),
                    Phase::Allocated => {
                        entry.phase = Phase::Complete;
                        entry.stop_requested = true;
                        entry.exit_status = Some(exit_status::ABORTED);
                        entry.diagnostics = "stopped by request before it started".into();
                        let _ = self.events.send(NodeEvent::Exited {
                            container_id: container_id.into(),
                            exit_status: exit_status::ABORTED,
                            diagnostics: entry.diagnostics.clone(),
                        });
                        return Ok(());
                    }
                    Phase::Running => {
                        entry.stop_requested = true;
                        match (entry.pid, entry.done.clone()) {
                            (Some(pid), Some(done)) => {
                                break (pid, entry.leader, done, entry.cgroup.clone(), entry.shim)
                            }
                            (None, Some(done)) => break (0, None, done, entry.cgroup.clone(), entry.shim),
                            _ => return Ok(()),
                        }
                    }
                    Phase::Starting => {}
                }
            }
            if Instant::now() >= give_up {
                return Err(NodeError::StartFailed {
                    id: container_id.into(),
                    why: "the container is still being started; try stopping it again".into(),
                });
            }
            tokio::time::sleep(POLL).await;
        };

        // Under a shim, the group's SIGTERM reaches the shim too, which passes it on to every
        // process it keeps (those that left the group included).
        signal_own_group(pgid, leader, libc::SIGTERM);
        cgroup.signal(libc::SIGTERM);
        if tokio::time::timeout(grace, done.wait_for(|d| *d)).await.is_err() {
            if shim {
                // Never SIGKILL the shim: its descendants would go to init. It kills them
                // all and exits once none is left.
                tracing::info!(
                    container = container_id,
                    "still running after {grace:?}: its shim kills everything in it"
                );
                if !pid_reused(pgid, leader) {
                    signal_process(pgid, super::shim::KILL_SIGNAL);
                }
            } else {
                tracing::info!(
                    container = container_id,
                    "still running after {grace:?}: SIGKILL to its group and cgroup"
                );
                signal_own_group(pgid, leader, libc::SIGKILL);
                cgroup.kill();
            }
            if tokio::time::timeout(KILL_WAIT, done.wait_for(|d| *d)).await.is_err() {
                tracing::warn!(
                    container = container_id,
                    pgid,
                    "process group did not end after SIGKILL"
                );
            }
        }
        Ok(())
    }

    /// Stops every running container (RM shutdown), all at once, each with `grace`.
    pub async fn stop_all(&self, grace: Duration) {
        let ids: Vec<String> = {
            let table = self.table.lock();
            table
                .iter()
                .filter(|(_, e)| matches!(e.phase, Phase::Running | Phase::Starting))
                .map(|(id, _)| id.clone())
                .collect()
        };
        let stops = ids.iter().map(|id| self.stop(id, grace));
        for (id, result) in ids.iter().zip(futures::future::join_all(stops).await) {
            if let Err(e) = result {
                tracing::warn!(container = id.as_str(), "stop at shutdown failed: {e}");
            }
        }
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

    /// Removes the records of acknowledged containers that ended longer than the retention
    /// ago (their logs included), and the work directory of any ended one still there.
    /// Returns how many records went.
    pub fn sweep(&self, now: std::time::SystemTime) -> usize {
        let retention = self.opts.retention.unwrap_or(DEFAULT_RETENTION);
        sweep_records(
            &self.root,
            &self.table,
            (retention, self.work_dir_grace()),
            self.opts.ends_heard_here,
            now,
        )
    }

    /// [`ExecutorOptions::work_dir_grace`] with its default.
    fn work_dir_grace(&self) -> Duration {
        self.opts.work_dir_grace.unwrap_or(DEFAULT_WORK_DIR_GRACE)
    }

    /// [`Executor::sweep`], at most every [`SWEEP_EVERY`], in the background.
    fn sweep_now_and_then(&self) {
        {
            let mut last = self.last_sweep.lock();
            if last.is_some_and(|t| t.elapsed() < SWEEP_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let (root, table) = (self.root.clone(), self.table.clone());
        let keep = (self.opts.retention.unwrap_or(DEFAULT_RETENTION), self.work_dir_grace());
        let heard = self.opts.ends_heard_here;
        tokio::task::spawn_blocking(move || sweep_records(&root, &table, keep, heard, std::time::SystemTime::now()));
    }

    /// The container's state, exit status, pid (= pgid) and diagnostics; `None` if unknown.
    pub fn status(&self, container_id: &str) -> Option<ContainerStatus> {
        let table = self.table.lock();
        let e = table.get(container_id)?;
        let state = match e.phase {
            Phase::Allocated | Phase::Starting => ContainerState::Allocated,
            Phase::Running => ContainerState::Running,
            Phase::Complete => ContainerState::Complete,
        };
        Some(ContainerStatus {
            container_id: container_id.into(),
            state,
            exit_status: e.exit_status,
            diagnostics: e.diagnostics.clone(),
            pid: e.pid,
        })
    }

    /// The record directory of a known container (or of one whose record exists from an
    /// earlier executor run); `None` for unknown or invalid ids. The task's own directory
    /// is [`work_dir`] of it.
    pub fn container_dir(&self, container_id: &str) -> Option<PathBuf> {
        if !valid_container_id(container_id) {
            return None;
        }
        if let Some(e) = self.table.lock().get(container_id) {
            return Some(e.dir.clone());
        }
        let dir = self.find_record(container_id);
        dir.is_dir().then_some(dir)
    }

    /// Tells a container it is being preempted: creates its `GPUAM_PREEMPT_FILE` (a new
    /// file written beside, then renamed, so a task never reads half of it). The task's
    /// directory is the task's: nothing in it is opened or followed (see [`create_new_in`]),
    /// and the file is given to the task's user.
    pub fn notify_preemption(&self, container_id: &str, deadline_ms: u64, reason: &str) -> Result<(), NodeError> {
        let dir = self
            .container_dir(container_id)
            .ok_or_else(|| NodeError::UnknownContainer(container_id.into()))?;
        let owner = self.table.lock().get(container_id).and_then(|e| e.owner);
        let text = format!("{deadline_ms}\n{}\n", reason.replace('\n', " "));
        create_new_in(&work_dir(&dir), PREEMPT_FILE, text.as_bytes(), owner)?;
        Ok(())
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

    /// Reads a captured stream; `tail_bytes` limits to the last N bytes.
    ///
    /// Only `root/<validated id>/stdout|stderr` can be read. The text is lossy UTF-8; a tail
    /// starts on a character boundary (so it can be up to 3 bytes shorter than asked). At
    /// most [`MAX_LOG_BYTES`] come back (the file's end); the file is seeked, never read
    /// whole. A known container that has written nothing yet gives `""`.
    pub fn read_log(
        &self,
        container_id: &str,
        stream: LogStream,
        tail_bytes: Option<u64>,
    ) -> Result<String, NodeError> {
        let dir = self.log_dir(container_id)?;
        let want = tail_bytes.unwrap_or(MAX_LOG_BYTES).min(MAX_LOG_BYTES);
        match read_tail(&dir.join(stream.file_name()), want) {
            Ok(text) => Ok(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
            Err(e) => Err(e.into()),
        }
    }

    /// At most `max` bytes of a container's stream from byte `offset`, and the file's length
    /// now (how `gpuam run` follows a task's output). A length below `offset` means the log
    /// was cut to its newest part (`node.max_log_bytes`): read it again from 0.
    pub fn read_log_from(
        &self,
        container_id: &str,
        stream: LogStream,
        offset: u64,
        max: u64,
    ) -> Result<(Vec<u8>, u64), NodeError> {
        let dir = self.log_dir(container_id)?;
        let read = || -> std::io::Result<(Vec<u8>, u64)> {
            let mut f = open_log_in_place(&dir.join(stream.file_name()), false)?;
            let len = f.metadata()?.len();
            if offset >= len {
                return Ok((Vec::new(), len));
            }
            f.seek(SeekFrom::Start(offset))?;
            let mut buf = Vec::new();
            f.take(max.min(MAX_LOG_BYTES)).read_to_end(&mut buf)?;
            Ok((buf, len))
        };
        match read() {
            Ok(v) => Ok(v),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((Vec::new(), 0)),
            Err(e) => Err(e.into()),
        }
    }

    /// The directory of a container whose logs are read: known, and a real directory (the
    /// container's directory itself must not have been swapped for a link).
    fn log_dir(&self, container_id: &str) -> Result<PathBuf, NodeError> {
        let dir = self
            .container_dir(container_id)
            .ok_or_else(|| NodeError::UnknownContainer(container_id.into()))?;
        if std::fs::symlink_metadata(&dir).is_ok_and(|m| !m.is_dir()) {
            return Err(NodeError::Io(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!("{} is not a directory; refusing to read logs through it", dir.display()),
            )));
        }
        Ok(dir)
    }
}

/// Asks the filesystem to place each container record (a directory of the root) in a
/// block group of its own choosing, as it places top-level directories (ext4's
/// `FS_TOPDIR_FL`, `chattr +T`), instead of all of them in the root's group. On ext4
/// without a journal every inode allocated in a group scans past that group's recently
/// deleted inodes (`recently_deleted` in the kernel); with every record in one group, the
/// files that other work on the machine (or earlier records) deleted there made each start
/// slower (docs/BENCHMARKS.md). Best effort: other filesystems refuse the flag, which
/// changes nothing else.
fn spread_records(root: &Path) {
    use std::os::fd::AsRawFd as _;
    // linux/fs.h: FS_IOC_GETFLAGS = _IOR('f', 1, long), FS_IOC_SETFLAGS = _IOW('f', 2, long).
    const FS_IOC_GETFLAGS: libc::c_ulong = 0x8008_6601;
    const FS_IOC_SETFLAGS: libc::c_ulong = 0x4008_6602;
    const FS_TOPDIR_FL: libc::c_long = 0x0002_0000;
    if std::fs::create_dir_all(root).is_err() {
        return;
    }
    let Ok(dir) = std::fs::File::open(root) else {
        return;
    };
    let mut flags: libc::c_long = 0;
    // SAFETY: both ioctls read or write one `long` through a pointer to a live local; the
    // descriptor is open for the whole call.
    unsafe {
        if libc::ioctl(dir.as_raw_fd(), FS_IOC_GETFLAGS as _, &mut flags) == 0 && flags & FS_TOPDIR_FL == 0 {
            flags |= FS_TOPDIR_FL;
            libc::ioctl(dir.as_raw_fd(), FS_IOC_SETFLAGS as _, &flags);
        }
    }
}

/// See [`Executor::sweep`]. `keep`: how long a record, and a work directory, stay after the end.
fn sweep_records(
    root: &Path,
    table: &Table,
    keep: (Duration, Duration),
    heard: bool,
    now: std::time::SystemTime,
) -> usize {
    let (retention, work_dir_grace) = keep;
    let Ok(entries) = std::fs::read_dir(root) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let Some(name) = e.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let Some(id) = record_id(&name).map(str::to_string) else {
            continue;
        };
        if table.lock().get(&id).is_some_and(|e| e.phase != Phase::Complete) {
            continue;
        }
        let record = root.join(&name);
        let Ok(ended) = std::fs::symlink_metadata(record.join(END_FILE)).and_then(|m| m.modified()) else {
            continue;
        };
        let acked = heard || std::fs::symlink_metadata(record.join(ACKED_FILE)).is_ok();
        if acked && now.duration_since(ended).is_ok_and(|age| age >= retention) {
            match std::fs::remove_dir_all(&record) {
                Ok(()) => removed += 1,
                Err(e) => tracing::warn!(container = %id, "cannot remove the finished record: {e}"),
            }
        } else if now.duration_since(ended).is_ok_and(|age| age >= work_dir_grace) {
            remove_work_dir(&record, &id);
        }
    }
    removed
}

/// Removes the task's own directory of an ended container (its record stays). The
/// removal does not follow links (`remove_dir_all` opens each level relative to its
/// parent without following).
fn remove_work_dir(record: &Path, id: &str) {
    match std::fs::remove_dir_all(work_dir(record)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(container = id, "cannot remove the finished container's directory: {e}"),
    }
}

/// Reads at most `max` bytes of a regular file where it is, never through a link (see
/// [`open_log_in_place`]).
fn read_small_in_place(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let f = open_log_in_place(path, false)?;
    let mut out = Vec::new();
    f.take(max).read_to_end(&mut out)?;
    Ok(out)
}

/// Creates `name` in directory `dir` holding `text`, owned by `owner` when given, without
/// opening or following anything already in `dir`: the directory is opened with
/// `O_NOFOLLOW`, a new file of a fresh name is created in it with `O_CREAT | O_EXCL |
/// O_NOFOLLOW` (relative to the directory's handle), written, and renamed over `name`
/// (which replaces a link rather than following it). So a task that owns `dir` cannot
/// make root write anywhere else.
pub fn create_new_in(dir: &Path, name: &str, text: &[u8], owner: Option<(u32, u32)>) -> std::io::Result<()> {
    use std::ffi::CString;
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    let c = |s: &str| CString::new(s).map_err(|_| std::io::Error::other("a NUL in a file name"));
    let cdir =
        CString::new(dir.as_os_str().as_encoded_bytes()).map_err(|_| std::io::Error::other("a NUL in a path"))?;
    // SAFETY: plain syscalls on NUL-terminated strings; every fd returned is owned at once.
    let dfd = unsafe {
        libc::open(
            cdir.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if dfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `dfd` is a fresh descriptor nobody else owns.
    let dfd = unsafe { OwnedFd::from_raw_fd(dfd) };
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let tmp = c(&format!(
        ".{name}.{}.{nanos}.{}.tmp",
        std::process::id(),
        SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ))?;
    let target = c(name)?;
    // SAFETY: as above.
    let fd = unsafe {
        libc::openat(
            dfd.as_raw_fd(),
            tmp.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o644 as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let unlink = || {
        // SAFETY: as above; removes our own temporary name.
        unsafe { libc::unlinkat(dfd.as_raw_fd(), tmp.as_ptr(), 0) };
    };
    let written = (|| {
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::fchown(&file, Some(uid), Some(gid))?;
        }
        (&file).write_all(text)?;
        // SAFETY: as above.
        if unsafe { libc::renameat(dfd.as_raw_fd(), tmp.as_ptr(), dfd.as_raw_fd(), target.as_ptr()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    })();
    if written.is_err() {
        unlink();
    }
    written
}

/// Rejects what bash or `execve` cannot carry, naming the field.
pub(crate) fn validate_context(ctx: &LaunchContext) -> Result<(), String> {
    for (i, c) in ctx.commands.iter().enumerate() {
        if c.contains('\0') {
            return Err(format!("commands[{i}] contains a NUL character; remove it"));
        }
    }
    for (k, v) in &ctx.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(format!(
                "env name `{}` is not a valid variable name (non-empty, without `=` or NUL)",
                k.escape_debug()
            ));
        }
        if v.contains('\0') {
            return Err(format!("env `{k}` has a NUL character in its value; remove it"));
        }
    }
    Ok(())
}

/// The task's whole environment: base, then the node's `task_env`, then `ctx.env`, then
/// the executor's (which win).
#[allow(clippy::too_many_arguments)]
fn container_env(
    id: &str,
    host: &str,
    granted: &Resources,
    dir: &Path,
    ctx: &LaunchContext,
    opts: &ExecutorOptions,
    run_as: Option<&RunAs>,
    user: Option<&str>,
    locality: &TaskLocality,
    cpus: Option<&CpuList>,
) -> Vec<(String, String)> {
    let mut env: std::collections::BTreeMap<String, String> = std::collections::BTreeMap::new();
    for name in BASE_ENV {
        if let Some(v) = std::env::var_os(name) {
            env.insert(name.into(), v.to_string_lossy().into_owned());
        }
    }
    env.entry("PATH".into()).or_insert_with(|| DEFAULT_PATH.into());
    if let Some(u) = run_as {
        // The node's own home is not the task user's.
        env.insert("HOME".into(), dir.to_string_lossy().into_owned());
        env.insert("USER".into(), u.name.clone());
        env.insert("LOGNAME".into(), u.name.clone());
    }
    for (k, v) in &opts.task_env {
        env.insert(k.clone(), v.clone());
    }
    let preempt = dir.join(PREEMPT_FILE);
    let side = super::contract::NodeSide {
        container_id: id,
        host,
        granted,
        user,
        locality,
        cpus,
        dir: Some((dir, &preempt)),
    };
    let env = super::contract::container_env(env, ctx, &side);
    env.into_iter().collect()
}

/// Whether `taskset` (util-linux) is on this node's PATH (looked up once).
fn taskset_found() -> bool {
    static FOUND: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FOUND.get_or_init(|| {
        std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join("taskset").is_file()))
            .unwrap_or(false)
    })
}

/// The CPUs of `wanted` this process may run on (`Cpus_allowed_list` of /proc/self/status);
/// `None` when none of them is (a topology text from another machine), or unknown.
fn usable_cpus(wanted: &CpuList) -> Option<CpuList> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let allowed = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .and_then(CpuList::parse)?;
    Some(wanted.intersect(&allowed)).filter(|c| !c.is_empty())
}

/// The launch script: the commands as the container contract runs them
/// ([`super::contract::commands_script`]: in order, the first failure ends it, a TERM
/// ends the group).
///
/// The EXIT trap writes the exit status to `exit_code` in the container's directory
/// (an absolute path: the commands may `cd`), with builtins only (the commands may
/// change PATH): a restarted executor, which is not the process's parent and cannot
/// wait for it, reads the status there.
fn launch_script(id: &str, dir: &Path, commands: &[String]) -> String {
    let mut s = String::new();
    s.push_str("#!/usr/bin/env bash\n");
    s.push_str(&format!(
        "# Generated by gpuam for container {id}: runs the task's commands in order,\n"
    ));
    s.push_str("# ending at the first that fails, with its exit status.\n");
    s.push_str(&format!(
        "readonly __gpuam_exit_file={}\n",
        shell_quote(&dir.join(EXIT_CODE_FILE).display().to_string())
    ));
    s.push_str("trap '__gpuam_rc=$?; printf \"%s\\n\" \"$__gpuam_rc\" > \"$__gpuam_exit_file\"' EXIT\n");
    s.push_str(&super::contract::commands_script(commands));
    s
}

/// The command that runs a task: `bash launch.sh` in the container's directory with
/// exactly `env`, stdin from /dev/null. The one place to change how a task is run (a
/// runner that wraps it in an image, say); [`spawn_launch`] adds the containment.
pub fn task_command(dir: &Path, env: &[(String, String)]) -> std::process::Command {
    let mut cmd = std::process::Command::new("bash");
    cmd.arg("launch.sh")
        .current_dir(dir)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null());
    cmd
}

/// What [`spawn_launch`] runs and how.
struct Launch<'a> {
    commands: &'a [String],
    env: &'a [(String, String)],
    cgroup: &'a Cgroup,
    run_as: Option<&'a RunAs>,
    /// Run under `taskset -c LIST` (CPUs the cgroup could not pin).
    taskset: Option<&'a str>,
    /// Run it all under the subreaper shim of this `gpuam` executable (no cgroup).
    shim: Option<&'a Path>,
}

/// Creates the directory and files and spawns the task (see [`task_command`]) in a new
/// session, inside its cgroup, as its user, under `taskset` when asked; returns the child,
/// its pid and handles of its log files (for the log watcher).
fn spawn_launch(dir: &Path, id: &str, launch: &Launch<'_>) -> Result<(tokio::process::Child, u32, Vec<File>), String> {
    let Launch {
        commands,
        env,
        cgroup,
        run_as,
        taskset,
        shim,
    } = *launch;
    let where_ = |what: &str, p: &Path, e: std::io::Error| format!("{what} {}: {e}", p.display());
    use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
    // The record (this node's, 0711: the task passes through to its work directory but
    // cannot list or change it) and in it the task's own directory (0700, the task's).
    let work = work_dir(dir);
    if let Some(root) = dir.parent() {
        std::fs::create_dir_all(root).map_err(|e| where_("cannot create directory", root, e))?;
    }
    // A start tried again after a failed one begins with a fresh work directory.
    match std::fs::remove_dir_all(&work) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(where_("cannot clear", &work, e)),
        _ => {}
    }
    for (d, mode) in [(dir, 0o711), (work.as_path(), 0o700)] {
        match std::fs::DirBuilder::new().mode(mode).create(d) {
            Ok(()) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::AlreadyExists
                    && std::fs::symlink_metadata(d).is_ok_and(|m| m.is_dir()) => {}
            Err(e) => return Err(where_("cannot create directory", d, e)),
        }
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode))
            .map_err(|e| where_("cannot set the mode of", d, e))?;
    }
    if let Some(u) = run_as {
        std::os::unix::fs::chown(&work, Some(u.uid), Some(u.gid)).map_err(|e| where_("cannot chown", &work, e))?;
    }
    let script = work.join("launch.sh");
    // 0600 and the task's alone: the commands may hold rendered secrets (OpenPAI
    // `<% $secrets.x %>`). The directory is new, so nothing of the task's is there yet.
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&script)
        .and_then(|f| {
            if let Some(u) = run_as {
                std::os::unix::fs::fchown(&f, Some(u.uid), Some(u.gid))?;
            }
            (&f).write_all(launch_script(id, &work, commands).as_bytes())
        })
        .map_err(|e| where_("cannot write", &script, e))?;
    // The logs are the node's, in the record: the task writes them through the handles it
    // is given and can neither reach nor replace them by name.
    let out_path = dir.join(LogStream::Stdout.file_name());
    let err_path = dir.join(LogStream::Stderr.file_name());
    // O_APPEND: when the log watcher cuts a file, the task's writes go on at its new end.
    let create = |p: &Path| {
        std::fs::OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(p)
            .and_then(|f| f.set_len(0).map(|()| f))
            .map_err(|e| where_("cannot create", p, e))
    };
    let out = create(&out_path)?;
    let err = create(&err_path)?;
    let watched = [&out, &err]
        .into_iter()
        .map(File::try_clone)
        .collect::<Result<Vec<File>, _>>()
        .map_err(|e| format!("cannot keep a handle of the log files: {e}"))?;

    // On the host, or in the task's image (GPUAM_IMAGE) where the node has podman.
    let spawn = super::image::program_for(dir, &work, id, env)?;
    // [shim --] [taskset -c LIST] program args
    let mut argv: Vec<std::ffi::OsString> = Vec::new();
    if let Some(exe) = shim {
        argv.extend([exe.into(), super::shim::SUBCOMMAND.into(), "--".into()]);
    }
    if let Some(list) = taskset {
        argv.extend(["taskset".into(), "-c".into(), list.into()]);
    }
    argv.push(spawn.program.clone().into());
    argv.extend(spawn.args.iter().map(Into::into));
    let program = argv.remove(0);
    let mut cmd = std::process::Command::new(&program);
    cmd.args(&argv)
        .current_dir(&work)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null());
    cmd.stdout(Stdio::from(out)).stderr(Stdio::from(err));
    let joins = cgroup.join_paths();
    let private_dev = cgroup.private_dev().cloned();
    let ids = run_as.map(|u| (u.uid, u.gid));
    let groups: Vec<libc::gid_t> = run_as.map(|u| u.groups.clone()).unwrap_or_default();
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe syscalls (setsid, open, write, close, setgroups, setgid, setuid)
    // on data prepared before the fork; it allocates nothing and touches no locks.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() == -1 {
                return Err(std::io::Error::last_os_error());
            }
            for path in &joins {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let n = libc::write(fd, b"0\n".as_ptr().cast(), 2);
                let e = std::io::Error::last_os_error();
                libc::close(fd);
                if n < 0 {
                    return Err(e);
                }
            }
            if let Some(dev) = &private_dev {
                dev.enter()?;
            }
            if let Some((uid, gid)) = ids {
                if libc::setgroups(groups.len(), groups.as_ptr()) == -1
                    || libc::setgid(gid) == -1
                    || libc::setuid(uid) == -1
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let mut cmd = tokio::process::Command::from(cmd);
    // The task must outlive a dropped handle (an RM restart re-attaches; DESIGN.md §9).
    cmd.kill_on_drop(false);
    let child = cmd
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", Path::new(&program).display()))?;
    let pid = child
        .id()
        .ok_or_else(|| "the process ended before its pid was known".to_string())?;
    Ok((child, pid, watched))
}

/// Where a container's end is recorded and whom it is told to.
struct Ending {
    table: Table,
    events: mpsc::UnboundedSender<NodeEvent>,
    id: String,
    dir: PathBuf,
    /// Turned `true` once the container is Complete.
    done: watch::Sender<bool>,
    cgroup: Cgroup,
    max_log_bytes: Option<u64>,
    /// Why the node killed it (a bound it went past, see [`super::bounds`]).
    verdict: Arc<Mutex<Option<String>>>,
    /// How long after the end the work directory goes ([`ExecutorOptions::work_dir_grace`]).
    work_dir_grace: Duration,
}

/// Waits for the leader, then ends the container (see [`container_ended`]).
async fn wait_container(ending: Ending, mut child: tokio::process::Child, pgid: u32, leader: Option<ProcessId>) {
    let (code, how) = match child.wait().await {
        Ok(st) => describe_exit(st),
        Err(e) => (exit_status::INVALID, format!("lost track of the process: {e}")),
    };
    container_ended(ending, pgid, leader, code, how).await;
}

/// Waits for a leader this executor did not start (an earlier RM did), then ends the
/// container with the status the leader's script wrote, if it got to write one.
async fn wait_inherited(ending: Ending, leader: ProcessId) {
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
fn recorded_end(record: &Path) -> Option<RecordedEnd> {
    read_small_in_place(&record.join(END_FILE), 64 << 10)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
}

/// The exit status `launch.sh` wrote in the work directory `work`, with a sentence;
/// ABORTED when there is none (the leader was killed with SIGKILL, or never ran). The
/// file is the task's: read without following a link, at most 32 bytes, only a number kept.
fn recorded_exit(work: &Path) -> (i32, String) {
    match read_small_in_place(&work.join(EXIT_CODE_FILE), 32)
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
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

/// Cleans up what the leader left in its group, records the end and sends the one
/// `Exited` event.
///
/// The group is the leader's pid. Linux does not hand out a pid while a process group
/// of that number has members, so leftovers keep the number ours; but once the group is
/// empty the pid can go to a new process (pid_max can be as low as 32768), which may
/// lead a group of its own, another container's. So a live process with the leader's
/// pid that is not the leader means the group is not ours to signal.
async fn container_ended(ending: Ending, pgid: u32, leader: Option<ProcessId>, code: i32, how: String) {
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
    let mut diagnostics = how;
    if !pid_reused(pgid, leader) && group_alive(pgid) {
        signal_own_group(pgid, leader, libc::SIGTERM);
        if !wait_group_gone(pgid, LEFTOVER_GRACE).await {
            signal_own_group(pgid, leader, libc::SIGKILL);
            if !wait_group_gone(pgid, KILL_WAIT).await {
                diagnostics.push_str("; some processes of its group survived SIGKILL");
            }
        }
    }
    // A task in an image: its container is gone too (see image::reap).
    super::image::reap(&dir, &id).await;
    let oom = cgroup.oom_killed();
    if cgroup.is_real() {
        if let Some(why) = empty_cgroup(&cgroup, &id).await {
            diagnostics.push_str(why);
        }
        cgroup.remove();
    }
    // A bound the container went past leads its diagnostics (the AM classifies on it).
    let killed_for = verdict.lock().clone();
    // Past its disk bound, or holding more than [`DEFER_REMOVAL_MAX_BYTES`], the directory
    // goes at once (the node needs the room back: short tasks that each leave data behind
    // must not add up over the grace); a small one after the grace, off the path of the
    // next starts.
    let remove_work_now = killed_for.is_some() || work_dir_grace.is_zero() || {
        let work = work_dir(&dir);
        let usage = tokio::task::spawn_blocking(move || super::bounds::disk_usage(&work)).await;
        usage.map_or(true, |u| !u.complete || u.bytes > DEFER_REMOVAL_MAX_BYTES)
    };
    if let Some(why) = killed_for.or(oom) {
        diagnostics = format!("{why}; {diagnostics}");
    }
    // The logs are within their limit before anyone hears of the end.
    if let Some(max) = max_log_bytes {
        let logs = table.lock().get(&id).map(|e| e.logs.clone()).unwrap_or_default();
        let cut = tokio::task::spawn_blocking(move || logs.iter().map(|f| cap_log(f, max)).collect::<Vec<_>>()).await;
        for e in cut.into_iter().flatten().filter_map(Result::err) {
            tracing::warn!(container = %id, "cannot keep a log within node.max_log_bytes: {e}");
        }
    }
    let stop_requested = table.lock().get(&id).is_some_and(|e| e.stop_requested);
    if stop_requested {
        diagnostics = format!("stopped by request; {diagnostics}");
    } else if code != 0 {
        if let Ok(tail) = read_tail(&dir.join(LogStream::Stderr.file_name()), DIAG_STDERR_BYTES) {
            let tail = tail.trim();
            if !tail.is_empty() {
                diagnostics.push_str(&format!("; end of stderr: {tail}"));
            }
        }
    }
    // Recorded before anyone hears of it (a restarted node reports this end), and the
    // task's own directory goes: its logs stay in the record.
    let end = RecordedEnd {
        exit_status: code,
        diagnostics: diagnostics.clone(),
    };
    let recorded = serde_json::to_vec(&end)
        .map_err(std::io::Error::other)
        .and_then(|b| create_new_in(&dir, END_FILE, &b, None));
    if let Err(e) = recorded {
        tracing::warn!(container = %id, "cannot record the container's end: {e}");
    }
    if remove_work_now {
        remove_work_dir(&dir, &id);
    } else {
        // A node that stops before then removes it on its next sweep ([`sweep_records`]).
        let (dir, id) = (dir.clone(), id.clone());
        tokio::spawn(async move {
            tokio::time::sleep(work_dir_grace).await;
            let _ = tokio::task::spawn_blocking(move || remove_work_dir(&dir, &id)).await;
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
    });
}

/// Ends whatever is left in the container's cgroup (daemons that left its session): SIGTERM
/// to every member, [`LEFTOVER_GRACE`], then a kill of the whole cgroup, repeated until it
/// is empty. Never gives up: the container is not dead, and its resources not free, while a
/// process of it runs. Returns a note for the diagnostics when something had to be killed.
async fn empty_cgroup(cgroup: &Cgroup, id: &str) -> Option<&'static str> {
    if cgroup.is_empty() {
        return None;
    }
    cgroup.signal(libc::SIGTERM);
    let until = Instant::now() + LEFTOVER_GRACE;
    while Instant::now() < until {
        if cgroup.is_empty() {
            return Some("; processes it left behind ended on SIGTERM");
        }
        tokio::time::sleep(POLL).await;
    }
    let mut warned = Instant::now();
    loop {
        cgroup.kill();
        let until = Instant::now() + KILL_WAIT;
        while Instant::now() < until {
            if cgroup.is_empty() {
                return Some("; processes it left behind were killed");
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

/// Exit code and a sentence: a code as is; killed by signal N → 128 + N (bash's convention).
fn describe_exit(st: ExitStatus) -> (i32, String) {
    if let Some(code) = st.code() {
        (code, format!("exited with code {code}"))
    } else if let Some(sig) = st.signal() {
        (128 + sig, format!("killed by signal {sig} ({})", signal_name(sig)))
    } else {
        (exit_status::INVALID, format!("ended without an exit code ({st})"))
    }
}

fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        _ => return format!("SIG{sig}"),
    };
    name.into()
}

/// True when a live process other than `leader` now has the leader's pid: the group of
/// that number is then not the container's (see [`container_ended`]). Without a known
/// leader nothing can be told apart, and the group is taken as the container's.
fn pid_reused(pgid: u32, leader: Option<ProcessId>) -> bool {
    leader.is_some_and(|l| ProcessId::of(pgid).is_some_and(|now| now.alive() && now != l))
}

/// Sends `sig` to the container's group, unless its number went to another process.
fn signal_own_group(pgid: u32, leader: Option<ProcessId>, sig: i32) {
    if !pid_reused(pgid, leader) {
        signal_group(pgid, sig);
    }
}

/// Sends `sig` to process `pid` alone (never to 0 or 1).
fn signal_process(pid: u32, sig: i32) {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return;
    };
    if p > 1 {
        // SAFETY: plain syscall; a process that is gone gives ESRCH, which is fine.
        unsafe {
            libc::kill(p, sig);
        }
    }
}

/// Sends `sig` to the whole process group. Never to group 0 or 1 (`kill(0)` / `kill(-1)`
/// would hit the RM's own group or every process).
fn signal_group(pgid: u32, sig: i32) {
    let Ok(p) = libc::pid_t::try_from(pgid) else {
        return;
    };
    if p <= 1 {
        return;
    }
    // SAFETY: plain syscall; a stale group gives ESRCH, which is fine.
    unsafe {
        libc::kill(-p, sig);
    }
}

/// Whether the group still has a live (non-zombie) process.
///
/// `kill(-pgid, 0)` answers "no" precisely; when it says "yes", the members may all be
/// zombies that an init which does not reap orphans keeps forever (containers without a
/// real init), so on Linux `/proc` is checked for a member that is not a zombie.
pub(crate) fn group_alive(pgid: u32) -> bool {
    let Ok(p) = libc::pid_t::try_from(pgid) else {
        return false;
    };
    if p <= 1 {
        return false;
    }
    // SAFETY: signal 0 only checks existence and permission.
    let r = unsafe { libc::kill(-p, 0) };
    if r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return false;
    }
    super::procs::group_has_live_member(pgid).unwrap_or(true)
}

/// Polls until the group has no live process; `false` if `limit` passed first.
async fn wait_group_gone(pgid: u32, limit: Duration) -> bool {
    let until = Instant::now() + limit;
    loop {
        if !group_alive(pgid) {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Keeps the logs in `files` within `max` bytes each until the container is done (then
/// once more): see the module doc.
async fn watch_logs(files: Arc<Vec<File>>, max: u64, mut done: watch::Receiver<bool>) {
    loop {
        let finished = tokio::select! {
            _ = tokio::time::sleep(LOG_CHECK) => *done.borrow(),
            changed = done.changed() => changed.is_err() || *done.borrow(),
        };
        let f = files.clone();
        let cut = tokio::task::spawn_blocking(move || f.iter().map(|f| cap_log(f, max)).collect::<Vec<_>>()).await;
        for r in cut.into_iter().flatten() {
            if let Err(e) = r {
                tracing::warn!("cannot keep a container log within node.max_log_bytes: {e}");
            }
        }
        if finished {
            return;
        }
    }
}

/// Cuts one log over `max` bytes to its newest part behind a line saying so; returns the
/// bytes dropped (0: under the limit).
pub fn cap_log(f: &File, max: u64) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let len = f.metadata()?.len();
    if len <= max {
        return Ok(0);
    }
    let keep = (max / 4).min(LOG_KEEP_MAX);
    let mut tail = vec![0u8; keep as usize];
    let got = f.read_at(&mut tail, len - keep)?;
    tail.truncate(got);
    // Start the kept part on a line (or at least a character) boundary.
    let start = tail
        .iter()
        .position(|b| *b == b'\n')
        .map(|i| i + 1)
        .filter(|i| *i < tail.len())
        .unwrap_or_else(|| tail.iter().position(|b| (b & 0xC0) != 0x80).unwrap_or(0));
    let kept = &tail[start..];
    let dropped = len - kept.len() as u64;
    f.set_len(0)?;
    // The handle shares the task's O_APPEND description: these land at the new start.
    let note = format!(
        "[gpuam] log truncated: {dropped} bytes dropped (node.max_log_bytes = {max}); the newest {} bytes follow\n",
        kept.len()
    );
    (&*f).write_all(note.as_bytes())?;
    (&*f).write_all(kept)?;
    Ok(dropped)
}

/// Opens a container's log file where it is, never through a link: a task may replace its
/// `stdout` with a symlink (to /etc/passwd, say) or a FIFO, so the file is opened with
/// `O_NOFOLLOW | O_NONBLOCK` and anything but a regular file is refused.
fn open_log_in_place(path: &Path, write: bool) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .append(write)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!("{} is a symbolic link; log files must be regular files", path.display()),
                )
            } else {
                e
            }
        })?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("{} is not a regular file", path.display()),
        ));
    }
    Ok(f)
}

/// The last `want` bytes of a file (seeking, not reading it whole), lossy UTF-8, starting
/// on a character boundary when cut. The file must be a regular file in place (see
/// [`open_log_in_place`]).
fn read_tail(path: &Path, want: u64) -> std::io::Result<String> {
    let mut f = open_log_in_place(path, false)?;
    let meta = f.metadata()?;
    let len = meta.len();
    let start = len.saturating_sub(want);
    f.seek(SeekFrom::Start(start))?;
    let mut buf = Vec::with_capacity(usize::try_from(want.min(len)).unwrap_or(0));
    f.take(want).read_to_end(&mut buf)?;
    let mut skip = 0;
    if start > 0 {
        // Drop the continuation bytes of a character cut in half (at most 3).
        while skip < 3 && skip < buf.len() && (buf[skip] & 0xC0) == 0x80 {
            skip += 1;
        }
    }
    Ok(String::from_utf8_lossy(&buf[skip..]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn setup() -> (tempfile::TempDir, Executor, mpsc::UnboundedReceiver<NodeEvent>) {
        let tmp = tempfile::tempdir().unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        let exec = Executor::new(tmp.path().join("containers"), tx);
        (tmp, exec, rx)
    }

    /// [`setup`] with `opts`.
    fn setup_with(opts: ExecutorOptions) -> (tempfile::TempDir, Executor, mpsc::UnboundedReceiver<NodeEvent>) {
        let tmp = tempfile::tempdir().unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        let exec = Executor::with_options(tmp.path().join("containers"), tx, opts);
        (tmp, exec, rx)
    }

    fn ctx(commands: &[&str]) -> LaunchContext {
        LaunchContext {
            commands: commands.iter().map(|s| s.to_string()).collect(),
            env: BTreeMap::new(),
        }
    }

    fn no_gpus() -> Resources {
        Resources::with_mask(1, 100, 0, Default::default())
    }

    async fn next_exit(rx: &mut mpsc::UnboundedReceiver<NodeEvent>) -> (String, i32, String) {
        let ev = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("no Exited event within 10 s")
            .expect("channel closed");
        let NodeEvent::Exited {
            container_id,
            exit_status,
            diagnostics,
        } = ev;
        (container_id, exit_status, diagnostics)
    }

    /// A second executor over the same directory stands for the executor of a
    /// restarted RM: it did not spawn the processes it re-attaches to.
    #[tokio::test]
    async fn a_new_executor_reattaches_to_running_and_ended_containers() {
        let (tmp, first, mut first_rx) = setup();
        let marker = tmp.path().join("go");
        first
            .start(
                "c-run",
                "h",
                &no_gpus(),
                ctx(&[&format!(
                    "while [ ! -f {} ]; do sleep 0.02; done; exit 7",
                    marker.display()
                )]),
            )
            .unwrap();
        first.start("c-done", "h", &no_gpus(), ctx(&["exit 5"])).unwrap();
        first.start("c-killed", "h", &no_gpus(), ctx(&["sleep 30"])).unwrap();
        let killed_pgid = first.status("c-killed").unwrap().pid.unwrap();
        // c-done ends while "the RM is down"; c-killed dies without a word.
        assert_eq!(next_exit(&mut first_rx).await.0, "c-done");
        signal_group(killed_pgid, libc::SIGKILL);
        assert_eq!(next_exit(&mut first_rx).await.0, "c-killed");

        // c-killed's end was seen here, but stands for one the node never saw (it was down):
        // without the node's record of it, the script's own word is all there is.
        std::fs::remove_file(tmp.path().join("containers/c-killed").join(END_FILE)).unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let second = Executor::new(tmp.path().join("containers"), tx);
        for id in ["c-run", "c-done", "c-killed", "c-never-started"] {
            second.reattach(id);
        }
        let mut ended = std::collections::HashMap::new();
        for _ in 0..3 {
            let (id, code, diag) = next_exit(&mut rx).await;
            ended.insert(id, (code, diag));
        }
        assert_eq!(ended["c-done"].0, 5, "the recorded end: {:?}", ended["c-done"]);
        assert!(
            ended["c-done"].1.contains("exited with code 5"),
            "{:?}",
            ended["c-done"]
        );
        // SIGKILL: the script never got to write a status.
        assert_eq!(ended["c-killed"].0, exit_status::ABORTED, "{:?}", ended["c-killed"]);
        assert!(ended["c-killed"].1.contains("left no exit status"));
        assert_eq!(ended["c-never-started"].0, exit_status::ABORTED);
        assert_eq!(second.status("c-run").unwrap().state, ContainerState::Running);
        std::fs::write(&marker, "").unwrap();
        let (id, code, diag) = next_exit(&mut rx).await;
        assert_eq!((id.as_str(), code), ("c-run", 7), "{diag}");
        assert_eq!(second.status("c-run").unwrap().state, ContainerState::Complete);
    }

    /// A task that writes far more than `max_log_bytes` ends with each log within the
    /// limit, a line saying what was dropped, and its newest output kept. (Its logs are in
    /// the node's record, out of its reach: it cannot rename them away.)
    #[tokio::test]
    async fn logs_are_kept_within_the_limit_and_say_so() {
        let tmp = tempfile::tempdir().unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let max = 64 * 1024;
        let exec = Executor::with_options(
            tmp.path().join("containers"),
            tx,
            ExecutorOptions {
                max_log_bytes: Some(max),
                ..ExecutorOptions::default()
            },
        );
        // 4 MiB to stdout in lines, then the last line; 1 MiB to stderr.
        let cmd = "yes \"$(head -c 1023 /dev/zero | tr '\\0' x)\" | head -n 4096; echo LAST-LINE; \
                   head -c 1048576 /dev/zero >&2";
        exec.start("c-log", "h", &no_gpus(), ctx(&[cmd])).unwrap();
        let (_, code, diag) = next_exit(&mut rx).await;
        assert_eq!(code, 0, "{diag}");
        let dir = tmp.path().join("containers/c-log");
        let out = std::fs::read_to_string(dir.join("stdout")).unwrap();
        assert!(out.len() as u64 <= max, "stdout is {} bytes", out.len());
        assert!(
            out.starts_with("[gpuam] log truncated: ") && out.contains("node.max_log_bytes = 65536"),
            "{}",
            &out[..out.len().min(200)]
        );
        assert!(out.trim_end().ends_with("LAST-LINE"), "the newest output is kept");
        let err = std::fs::metadata(dir.join("stderr")).unwrap().len();
        assert!(err <= max, "stderr is {err} bytes");
    }

    /// Polls (up to 10 s) until container `id`'s stdout holds `text`.
    async fn wait_stdout(exec: &Executor, id: &str, text: &str) {
        for _ in 0..500 {
            if exec.read_log(id, LogStream::Stdout, None).unwrap().contains(text) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Issue 23: the preemption notice is written into the task's directory without
    /// following what the task put there: links named `preempt` or like the old fixed
    /// temporary name leave their targets unchanged, and the notice is a new regular file.
    #[tokio::test]
    async fn the_preemption_notice_never_follows_the_tasks_links() {
        let (tmp, exec, mut rx) = setup();
        let target = tmp.path().join("root-owned");
        std::fs::write(&target, "root:x:0:0\n").unwrap();
        let go = tmp.path().join("go");
        let cmd = format!(
            "ln -s {t} .preempt.tmp; ln -s {t} preempt; echo linked; while [ ! -f {go} ]; do sleep 0.02; done",
            t = target.display(),
            go = go.display()
        );
        exec.start("c-pre", "h", &no_gpus(), ctx(&[&cmd])).unwrap();
        let work = work_dir(&exec.container_dir("c-pre").unwrap());
        wait_stdout(&exec, "c-pre", "linked").await;
        exec.notify_preemption("c-pre", 1234, "taken back").unwrap();
        assert_eq!(
            std::fs::read_to_string(&target).unwrap(),
            "root:x:0:0\n",
            "the target is unchanged"
        );
        let notice = std::fs::symlink_metadata(work.join(PREEMPT_FILE)).unwrap();
        assert!(notice.is_file(), "the notice replaced the link: {notice:?}");
        assert_eq!(
            std::fs::read_to_string(work.join(PREEMPT_FILE)).unwrap(),
            "1234\ntaken back\n"
        );
        std::fs::write(&go, "").unwrap();
        assert_eq!(next_exit(&mut rx).await.1, 0);
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "root:x:0:0\n");
    }

    /// Issue 23: what a restarted node re-attaches to comes from the container's record
    /// alone. A task that creates `acked`, deletes its launch.sh, and writes a
    /// `process.json` naming another process (this test's own) in its directory is still
    /// re-attached to, as itself, and stopping it signals no one else.
    #[tokio::test]
    async fn a_task_cannot_steer_the_reattach() {
        let (tmp, first, _rx) = setup();
        let me = ProcessId::of(std::process::id()).unwrap();
        let forged = serde_json::to_string(&me).unwrap();
        let cmd = format!(
            "touch acked; rm -f launch.sh; printf '%s' {forged} > process.json; \
             echo forged; sleep 30",
            forged = shell_quote(&forged)
        );
        first.start("c-steer", "h", &no_gpus(), ctx(&[&cmd])).unwrap();
        let leader = first.status("c-steer").unwrap().pid.unwrap();
        wait_stdout(&first, "c-steer", "forged").await;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let second = Executor::new(tmp.path().join("containers"), tx);
        assert_eq!(second.unacknowledged(), vec!["c-steer".to_string()]);
        second.reattach("c-steer");
        let s = second.status("c-steer").unwrap();
        assert_eq!((s.state, s.pid), (ContainerState::Running, Some(leader)), "{s:?}");
        second.stop("c-steer", Duration::from_millis(200)).await.unwrap();
        let (id, _, _) = next_exit(&mut rx).await;
        assert_eq!(id, "c-steer");
        assert!(me.alive(), "this process was not signalled");
    }

    /// Finished records go after the retention once acknowledged; unacknowledged ones stay
    /// (a restarted node reports them), and so does a running container's.
    #[tokio::test]
    async fn finished_records_are_removed_after_the_retention_once_acknowledged() {
        let (tmp, exec, mut rx) = setup();
        exec.start("c-old", "h", &no_gpus(), ctx(&["echo bye"])).unwrap();
        exec.start("c-unacked", "h", &no_gpus(), ctx(&["true"])).unwrap();
        for _ in 0..2 {
            next_exit(&mut rx).await;
        }
        let root = tmp.path().join("containers");
        let now = std::time::SystemTime::now();
        assert!(
            work_dir(&root.join("c-old")).is_dir(),
            "within the grace, the work directory stays"
        );
        assert_eq!(exec.sweep(now), 0, "within the retention");
        assert!(
            work_dir(&root.join("c-old")).is_dir(),
            "a sweep within the grace keeps it"
        );
        assert_eq!(exec.sweep(now + DEFAULT_WORK_DIR_GRACE + Duration::from_secs(1)), 0);
        for id in ["c-old", "c-unacked"] {
            assert!(
                !work_dir(&root.join(id)).exists(),
                "{id}: a sweep after the grace removes it"
            );
        }
        assert!(exec.forget("c-old"));
        assert!(root.join("c-old").join(ACKED_FILE).exists());
        assert_eq!(exec.read_log("c-old", LogStream::Stdout, None).unwrap(), "bye\n");
        assert_eq!(exec.sweep(now + DEFAULT_RETENTION + Duration::from_secs(1)), 1);
        assert!(!root.join("c-old").exists());
        assert!(root.join("c-unacked").join(END_FILE).exists());
        assert_eq!(exec.unacknowledged(), vec!["c-unacked".to_string()]);
    }

    /// [`create_new_in`] refuses a directory that is a link, and never writes through one.
    #[test]
    fn create_new_in_never_follows() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(create_new_in(&link, "x", b"1", None).is_err());
        assert!(!real.join("x").exists());
        let target = tmp.path().join("target");
        std::fs::write(&target, "keep").unwrap();
        std::os::unix::fs::symlink(&target, real.join("x")).unwrap();
        create_new_in(&real, "x", b"new", None).unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
        assert_eq!(std::fs::read_to_string(real.join("x")).unwrap(), "new");
    }

    #[test]
    fn cap_log_cuts_only_above_the_limit() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("log");
        std::fs::write(&p, "a\n".repeat(100)).unwrap();
        let f = std::fs::OpenOptions::new().read(true).append(true).open(&p).unwrap();
        assert_eq!(cap_log(&f, 200).unwrap(), 0, "exactly at the limit: kept whole");
        std::fs::write(&p, "0123456789\n".repeat(1000)).unwrap();
        let dropped = cap_log(&f, 4096).unwrap();
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(
            text.len() <= 4096 && dropped > 10_000 - 4096,
            "{} {dropped}",
            text.len()
        );
        let (note, rest) = text.split_once('\n').unwrap();
        assert!(note.contains(&format!("{dropped} bytes dropped")), "{note}");
        assert!(rest.lines().all(|l| l == "0123456789"), "cut on a line boundary");
    }

    #[test]
    fn a_reused_pid_is_not_the_containers_group() {
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        let real = ProcessId::of(child.id()).unwrap();
        let earlier = ProcessId {
            start_ticks: real.start_ticks.saturating_sub(1),
            ..real
        };
        assert!(!pid_reused(child.id(), Some(real)), "the leader itself");
        assert!(
            pid_reused(child.id(), Some(earlier)),
            "another process with the leader's pid"
        );
        assert!(!pid_reused(child.id(), None), "unknown leader: nothing to tell apart");
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!pid_reused(child.id(), Some(earlier)), "nobody has the pid now");
    }

    #[tokio::test]
    async fn a_reattached_container_can_be_stopped() {
        let (tmp, first, _first_rx) = setup();
        let started = tmp.path().join("started");
        first
            .start(
                "c1",
                "h",
                &no_gpus(),
                ctx(&[&format!("touch {}; sleep 30", started.display())]),
            )
            .unwrap();
        let pgid = first.status("c1").unwrap().pid.unwrap();
        // Its traps are set once its commands run (a loaded machine may take a while).
        let deadline = Instant::now() + Duration::from_secs(60);
        while !started.exists() {
            assert!(Instant::now() < deadline, "the task did not start within 60 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (tx, mut rx) = mpsc::unbounded_channel();
        let second = Executor::new(first.root().to_path_buf(), tx);
        second.reattach("c1");
        second.stop("c1", Duration::from_secs(2)).await.unwrap();
        let (_, code, diag) = next_exit(&mut rx).await;
        assert_eq!(code, 143, "{diag}");
        assert!(diag.contains("stopped by request"), "{diag}");
        assert!(!group_alive(pgid));
    }

    #[tokio::test]
    async fn commands_run_in_order_and_stop_at_first_failure() {
        let (_t, exec, mut rx) = setup();
        exec.start("c1", "h", &no_gpus(), ctx(&["echo a", "exit 3", "echo never"]))
            .unwrap();
        let (id, code, diag) = next_exit(&mut rx).await;
        assert_eq!((id.as_str(), code), ("c1", 3));
        assert!(diag.contains("exited with code 3"), "{diag}");
        let out = exec.read_log("c1", LogStream::Stdout, None).unwrap();
        assert_eq!(out, "a\n");
        let st = exec.status("c1").unwrap();
        assert_eq!(st.state, ContainerState::Complete);
        assert_eq!(st.exit_status, Some(3));
        assert!(st.pid.is_some());
    }

    #[tokio::test]
    async fn failing_command_inside_a_list_and_state_carries_over() {
        let (_t, exec, mut rx) = setup();
        // `false; echo x` succeeds as a command (its last statement), like in any script;
        // a syntax error fails its own command (status 2) without breaking the script.
        exec.start(
            "c2",
            "h",
            &no_gpus(),
            ctx(&[
                "false; echo x",
                "export V=7; mkdir sub; cd sub",
                "echo \"v=$V\"; pwd",
                "if then",
                "echo never",
            ]),
        )
        .unwrap();
        let (_, code, _) = next_exit(&mut rx).await;
        assert_eq!(code, 2);
        let dir = work_dir(&exec.container_dir("c2").unwrap());
        let out = exec.read_log("c2", LogStream::Stdout, None).unwrap();
        assert!(out.starts_with("x\nv=7\n"), "{out}");
        assert!(out.contains(&format!("{}\n", dir.join("sub").display())), "{out}");
        assert!(!out.contains("never"));
    }

    #[tokio::test]
    async fn success_exits_zero_and_quoting_survives() {
        let (_t, exec, mut rx) = setup();
        exec.start("ok", "h", &no_gpus(), ctx(&["echo 'it'\"'\"'s' \"$((1+2))\" '$HOME'"]))
            .unwrap();
        let (_, code, _) = next_exit(&mut rx).await;
        assert_eq!(code, 0);
        assert_eq!(exec.read_log("ok", LogStream::Stdout, None).unwrap(), "it's 3 $HOME\n");
    }

    #[tokio::test]
    async fn environment_contract() {
        let (_t, exec, mut rx) = setup();
        let mut c = ctx(&["env"]);
        c.env.insert("MY_VAR".into(), "hello world".into());
        c.env.insert("GPUAM_TASK_INDEX".into(), "2".into());
        c.env.insert("CUDA_VISIBLE_DEVICES".into(), "7".into());
        c.env.insert("GPUAM_HOST".into(), "spoofed".into());
        std::env::set_var("GPUAM_TEST_LEAK_CHECK", "1");
        let granted = Resources::with_mask(2, 100, 0xa, Default::default());
        exec.start("env1", "node-3", &granted, c).unwrap();
        let (_, code, _) = next_exit(&mut rx).await;
        assert_eq!(code, 0);
        let dir = work_dir(&exec.container_dir("env1").unwrap());
        let text = exec.read_log("env1", LogStream::Stdout, None).unwrap();
        let vars: BTreeMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
        assert_eq!(vars["CUDA_VISIBLE_DEVICES"], "1,3");
        assert_eq!(vars["NVIDIA_VISIBLE_DEVICES"], "1,3");
        assert_eq!(vars["GPUAM_GPU_MASK"], "0xa");
        assert_eq!(vars["CONTAINER_GPUS"], "10");
        assert_eq!(vars["GPUAM_CONTAINER_ID"], "env1");
        assert_eq!(vars["GPUAM_HOST"], "node-3");
        assert_eq!(vars["GPUAM_CONTAINER_DIR"], dir.to_str().unwrap());
        assert_eq!(vars["MY_VAR"], "hello world");
        assert_eq!(vars["GPUAM_TASK_INDEX"], "2");
        assert!(vars.contains_key("PATH"));
        assert!(
            !vars.contains_key("GPUAM_TEST_LEAK_CHECK"),
            "executor env leaked into the task"
        );
    }

    /// The node's `--task-env` reaches every task; the job's variables and gpuam's own
    /// come after it.
    #[tokio::test]
    async fn the_node_task_env_comes_before_the_job_and_gpuam() {
        let tmp = tempfile::tempdir().unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let exec = Executor::with_options(
            tmp.path().join("containers"),
            tx,
            ExecutorOptions {
                task_env: vec![
                    ("SITE_SOFTWARE".into(), "/opt/site".into()),
                    ("LANG".into(), "C.UTF-8".into()),
                    ("SHARED".into(), "from-node".into()),
                ],
                ..Default::default()
            },
        );
        let mut c = ctx(&["echo \"$SITE_SOFTWARE $LANG $SHARED\""]);
        c.env.insert("SHARED".into(), "from-job".into());
        exec.start("te", "h", &no_gpus(), c).unwrap();
        let (_, code, _) = next_exit(&mut rx).await;
        assert_eq!(code, 0);
        assert_eq!(
            exec.read_log("te", LogStream::Stdout, None).unwrap(),
            "/opt/site C.UTF-8 from-job\n"
        );
    }

    #[test]
    fn task_env_names_gpuam_sets_or_bash_cannot_carry_are_refused() {
        assert!(check_task_env("JAX_EXAMPLE_DIR", "/srv/gpuam").is_ok());
        assert!(check_task_env("_X1", "").is_ok());
        for bad in [
            "GPUAM_HOST",
            "PAI_TASK_INDEX",
            "CUDA_VISIBLE_DEVICES",
            "CONTAINER_PORTS",
        ] {
            let e = check_task_env(bad, "x").unwrap_err();
            assert!(e.contains(bad) && e.contains("set by gpuam"), "{e}");
        }
        for bad in ["", "1X", "A-B", "A B"] {
            let e = check_task_env(bad, "x").unwrap_err();
            assert!(e.contains("not a variable name"), "{e}");
        }
        assert!(check_task_env("A", "x\0y").unwrap_err().contains("NUL"));
    }

    /// A 2-GPU node whose GPU0 sits on CPUs `cpu0` behind `mlx5_0`, GPU1 on CPUs `cpu1`
    /// behind an Ethernet NIC.
    fn small_topology(cpu0: &str, cpu1: &str) -> Topology {
        let text = format!(
            "\tGPU0\tGPU1\tmlx5_0\teth1\tCPU Affinity\tNUMA Affinity\n\
             GPU0\t X \tSYS\tPIX\tSYS\t{cpu0}\t0\n\
             GPU1\tSYS\t X \tSYS\tPIX\t{cpu1}\t1\n"
        );
        Topology::parse_nvidia_smi(&text).unwrap()
    }

    /// What the task saw: its environment's locality variables and the CPUs it may run on.
    async fn locality_seen(
        exec: &Executor,
        rx: &mut mpsc::UnboundedReceiver<NodeEvent>,
        id: &str,
        mask: u64,
        topo: &Topology,
    ) -> String {
        let granted = Resources::with_mask(1, 100, mask, Default::default());
        let cmd = "echo \"cpus=$GPUAM_CPU_AFFINITY nic=$GPUAM_NIC hca=${NCCL_IB_HCA-unset} numa=$GPUAM_NUMA_NODES\"; \
                   grep Cpus_allowed_list /proc/self/status";
        exec.start_as(id, "h", &granted, ctx(&[cmd]), Some(topo), None).unwrap();
        let (_, code, diag) = next_exit(rx).await;
        assert_eq!(
            code,
            0,
            "{diag}: {}",
            exec.read_log(id, LogStream::Stderr, None).unwrap()
        );
        exec.read_log(id, LogStream::Stdout, None).unwrap()
    }

    /// This process's `Cpus_allowed_list` line, and the first CPU in it.
    fn allowed_cpus() -> (String, u32) {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status
            .lines()
            .find(|l| l.starts_with("Cpus_allowed_list"))
            .unwrap()
            .to_string();
        let list = CpuList::parse(line.split_once(':').unwrap().1).unwrap();
        let first = list.cpus().next().unwrap();
        (line, first)
    }

    /// Without a cgroup the task runs under `taskset -c` on its GPU's NUMA-local CPU, with
    /// its NIC named; a GPU whose CPUs this machine does not have is not pinned.
    #[tokio::test]
    async fn a_task_is_pinned_to_its_gpus_cpus_and_told_its_nic() {
        let (_t, exec, mut rx) = setup();
        let (allowed, cpu) = allowed_cpus();
        let topo = small_topology(&cpu.to_string(), "1");
        let out = locality_seen(&exec, &mut rx, "pin0", 0b01, &topo).await;
        assert_eq!(
            out,
            format!("cpus={cpu} nic=mlx5_0 hca=mlx5_0 numa=0\nCpus_allowed_list:\t{cpu}\n")
        );
        // GPU1: an Ethernet NIC (no NCCL_IB_HCA) and CPU 4000, which no machine here has.
        let topo = small_topology(&cpu.to_string(), "4000");
        let out = locality_seen(&exec, &mut rx, "pin1", 0b10, &topo).await;
        assert_eq!(out, format!("cpus= nic=eth1 hca=unset numa=1\n{allowed}\n"));
    }

    /// With a cgroup that has a cpuset (v2 controller or v1 hierarchy), the pin is the
    /// container's cpuset.
    #[tokio::test]
    async fn a_contained_task_gets_its_cpus_as_a_cpuset() {
        let (_tmp, exec, mut rx, containment) = contained("cpuset");
        let (_, cpu) = allowed_cpus();
        let topo = small_topology(&cpu.to_string(), "4000");
        let out = locality_seen(&exec, &mut rx, "pin-cg", 0b01, &topo).await;
        assert_eq!(
            out,
            format!("cpus={cpu} nic=mlx5_0 hca=mlx5_0 numa=0\nCpus_allowed_list:\t{cpu}\n")
        );
        let described = containment.describe();
        if described.contains("cpuset (v1)") {
            // Pinned by its own v1 cpuset, not by taskset.
            let granted = Resources::with_mask(1, 100, 0b01, Default::default());
            exec.start_as(
                "pin-cg2",
                "h",
                &granted,
                ctx(&["cat /proc/self/cgroup"]),
                Some(&topo),
                None,
            )
            .unwrap();
            next_exit(&mut rx).await;
            let groups = exec.read_log("pin-cg2", LogStream::Stdout, None).unwrap();
            assert!(
                groups
                    .lines()
                    .any(|l| l.contains(":cpuset:") && l.ends_with("/pin-cg2")),
                "{groups}"
            );
        }
        if described.contains("cpuset") {
            // The cpuset itself says so (the cgroup is gone with the container; pin another).
            let mut cg = containment.create("pin-probe", Limits::default()).unwrap();
            let one = CpuList::parse(&cpu.to_string()).unwrap();
            assert!(containment.pin_cpus(&mut cg, "pin-probe", &one), "{described}");
            cg.remove();
        }
        containment.remove_parents();
    }

    #[tokio::test]
    async fn a_share_and_custom_resources_are_in_the_environment() {
        let (_t, exec, mut rx) = setup();
        let mut c = ctx(&["env"]);
        c.env.insert("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), "100".into());
        let granted = Resources::with_share(1, 100, 1, 25, Default::default()).with_custom(
            crate::resources::CustomResources::from_pairs([("nvme", 1), ("ib-hca", 2)]),
        );
        exec.start("share1", "h", &granted, c).unwrap();
        assert_eq!(next_exit(&mut rx).await.1, 0);
        let text = exec.read_log("share1", LogStream::Stdout, None).unwrap();
        let vars: BTreeMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
        assert_eq!(vars["CUDA_VISIBLE_DEVICES"], "1");
        assert_eq!(vars["GPUAM_GPU_MASK"], "0x2");
        assert_eq!(vars["GPUAM_GPU_FRACTION"], "0.25");
        assert_eq!(
            vars["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25",
            "the share wins over ctx.env"
        );
        assert_eq!(vars["GPUAM_RESOURCES"], "ib-hca=2,nvme=1");
        assert_eq!((vars["GPUAM_RESOURCE_NVME"], vars["GPUAM_RESOURCE_IB_HCA"]), ("1", "2"));
        // A whole-GPU task has no fraction, even one set by the caller.
        let mut c = ctx(&["env"]);
        c.env.insert("GPUAM_GPU_FRACTION".into(), "0.5".into());
        exec.start("whole1", "h", &Resources::with_mask(1, 100, 0x1, Default::default()), c)
            .unwrap();
        assert_eq!(next_exit(&mut rx).await.1, 0);
        let text = exec.read_log("whole1", LogStream::Stdout, None).unwrap();
        assert!(!text.contains("GPUAM_GPU_FRACTION"), "{text}");
    }

    #[tokio::test]
    async fn no_gpus_hides_all_devices() {
        let (_t, exec, mut rx) = setup();
        exec.start(
            "env0",
            "h",
            &no_gpus(),
            ctx(&["echo \"[${CUDA_VISIBLE_DEVICES-unset}] [$NVIDIA_VISIBLE_DEVICES] [$GPUAM_GPU_MASK] [$CONTAINER_GPUS]\""]),
        )
        .unwrap();
        next_exit(&mut rx).await;
        assert_eq!(
            exec.read_log("env0", LogStream::Stdout, None).unwrap(),
            "[] [none] [0x0] [0]\n"
        );
    }

    /// An ended container's work directory goes by itself once the grace has passed (no
    /// sweep, no further start needed); its record stays.
    #[tokio::test]
    async fn the_work_directory_goes_after_the_grace() {
        let (_tmp, exec, mut rx) = setup_with(ExecutorOptions {
            work_dir_grace: Some(Duration::from_millis(300)),
            ..ExecutorOptions::default()
        });
        exec.start("c-grace", "h", &no_gpus(), ctx(&["echo kept > mine"]))
            .unwrap();
        next_exit(&mut rx).await;
        let record = exec.container_dir("c-grace").unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while work_dir(&record).exists() {
            assert!(
                Instant::now() < deadline,
                "the work directory is still there after 30 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(record.join(END_FILE).is_file(), "the record stays");

        // One that leaves more than a little behind loses it at once, grace or not.
        exec.start("c-big", "h", &no_gpus(), ctx(&["head -c 3000000 /dev/zero > big"]))
            .unwrap();
        let (id, code, diag) = next_exit(&mut rx).await;
        assert_eq!((id.as_str(), code), ("c-big", 0), "{diag}");
        let record = exec.container_dir("c-big").unwrap();
        assert!(!work_dir(&record).exists(), "3 MB left behind are removed at the end");
        assert!(record.join(END_FILE).is_file(), "the record stays");
    }

    #[test]
    fn a_record_is_named_by_its_task_and_its_id_is_read_back() {
        let env = |role: &str, index: &str| {
            BTreeMap::from([
                ("GPUAM_TASK_ROLE".to_string(), role.to_string()),
                ("GPUAM_TASK_INDEX".to_string(), index.to_string()),
            ])
        };
        assert_eq!(record_name("c_1", &env("worker", "3")), "worker-3@c_1");
        assert_eq!(record_id("worker-3@c_1"), Some("c_1"));
        assert_eq!(record_id("c.1-x"), Some("c.1-x"), "a bare id");
        // Names that could mislead are left out: the bare id then.
        for (role, index) in [
            ("", "0"),
            ("a/b", "0"),
            ("..", "1"),
            ("w", "x"),
            ("w", ""),
            ("w@x", "1"),
        ] {
            assert_eq!(record_name("c_1", &env(role, index)), "c_1", "{role:?} {index:?}");
        }
        assert_eq!(record_name("c_1", &BTreeMap::new()), "c_1");
        assert_eq!(record_id("w-1@"), None);
        assert_eq!(record_id("w-1@.."), None);
    }

    /// A task's record is `ROLE-INDEX@ID`; a restarted executor finds it by id (re-attach,
    /// logs), lists it as unacknowledged by its id, and sweeps it after the retention.
    #[tokio::test]
    async fn a_named_record_is_found_again_by_its_id() {
        let (tmp, first, _rx) = setup();
        let ctx = LaunchContext {
            commands: vec!["echo hi; sleep 30".into()],
            env: BTreeMap::from([
                ("GPUAM_TASK_ROLE".to_string(), "worker".to_string()),
                ("GPUAM_TASK_INDEX".to_string(), "2".to_string()),
            ]),
        };
        first.start("c-named", "h", &no_gpus(), ctx).unwrap();
        let record = first.root().join("worker-2@c-named");
        assert_eq!(first.container_dir("c-named"), Some(record.clone()));
        wait_stdout(&first, "c-named", "hi").await;
        assert!(!first.root().join("c-named").exists());

        let (tx, mut rx) = mpsc::unbounded_channel();
        let second = Executor::new(tmp.path().join("containers"), tx);
        assert_eq!(second.unacknowledged(), vec!["c-named".to_string()]);
        assert_eq!(second.container_dir("c-named"), Some(record.clone()));
        second.reattach("c-named");
        assert_eq!(second.status("c-named").unwrap().state, ContainerState::Running);
        second.stop("c-named", Duration::from_millis(200)).await.unwrap();
        let (id, _, _) = next_exit(&mut rx).await;
        assert_eq!(id, "c-named");
        assert_eq!(second.read_log("c-named", LogStream::Stdout, None).unwrap(), "hi\n");
        assert!(second.forget("c-named"));
        assert_eq!(
            second.container_dir("c-named"),
            Some(record.clone()),
            "found after it was forgotten"
        );
        let later = std::time::SystemTime::now() + DEFAULT_RETENTION + Duration::from_secs(1);
        assert_eq!(second.sweep(later), 1);
        assert!(!record.exists());
    }

    #[tokio::test]
    async fn working_directory_and_separate_streams() {
        let (_tmp, exec, mut rx) = setup_with(ExecutorOptions {
            work_dir_grace: Some(Duration::ZERO),
            ..ExecutorOptions::default()
        });
        exec.start("wd", "h", &no_gpus(), ctx(&["pwd", "echo oops >&2", "echo out"]))
            .unwrap();
        next_exit(&mut rx).await;
        let record = exec.container_dir("wd").unwrap();
        assert_eq!(record, exec.root().join("wd"));
        let out = exec.read_log("wd", LogStream::Stdout, None).unwrap();
        assert_eq!(out, format!("{}\nout\n", work_dir(&record).display()));
        assert_eq!(exec.read_log("wd", LogStream::Stderr, None).unwrap(), "oops\n");
        // With no grace the task's directory (its launch.sh with it) is gone once it ended;
        // its logs and the node's record of its end stay.
        assert!(!work_dir(&record).exists());
        assert!(record.join("stdout").is_file() && record.join(END_FILE).is_file());
    }

    #[tokio::test]
    async fn tail_cuts_on_char_boundary() {
        let (_t, exec, mut rx) = setup();
        // "héllo wörld\n": ö is 2 bytes; the last 5 bytes start inside it.
        exec.start("tail", "h", &no_gpus(), ctx(&["printf 'héllo wörld\\n'"]))
            .unwrap();
        next_exit(&mut rx).await;
        assert_eq!(exec.read_log("tail", LogStream::Stdout, Some(5)).unwrap(), "rld\n");
        assert_eq!(exec.read_log("tail", LogStream::Stdout, Some(6)).unwrap(), "örld\n");
        assert_eq!(exec.read_log("tail", LogStream::Stdout, Some(7)).unwrap(), "wörld\n");
        assert_eq!(exec.read_log("tail", LogStream::Stdout, Some(0)).unwrap(), "");
        assert_eq!(
            exec.read_log("tail", LogStream::Stdout, Some(1000)).unwrap(),
            "héllo wörld\n"
        );
    }

    #[test]
    fn read_tail_of_a_large_file() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("big");
        let mut f = File::create(&p).unwrap();
        for i in 0..100_000 {
            writeln!(f, "line {i:06}").unwrap();
        }
        drop(f);
        assert_eq!(read_tail(&p, 24).unwrap(), "line 099998\nline 099999\n");
        let lossy = tmp.path().join("lossy");
        std::fs::write(&lossy, b"ab\xffcd").unwrap();
        assert_eq!(read_tail(&lossy, 100).unwrap(), "ab\u{fffd}cd");
    }

    #[test]
    fn read_log_refuses_symlinks_and_fifos() {
        let (t, exec, _rx) = setup();
        let secret = t.path().join("secret");
        std::fs::write(&secret, "root:x:0:0\n").unwrap();
        let dir = t.path().join("containers").join("container_1_0001_01_000001");
        std::fs::create_dir_all(&dir).unwrap();
        std::os::unix::fs::symlink(&secret, dir.join("stdout")).unwrap();
        let err = exec
            .read_log("container_1_0001_01_000001", LogStream::Stdout, None)
            .unwrap_err();
        assert!(err.to_string().contains("symbolic link"), "{err}");
        let c = std::ffi::CString::new(dir.join("stderr").to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = exec
            .read_log("container_1_0001_01_000001", LogStream::Stderr, None)
            .unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        // Ids that are paths never reach the file system.
        for bad in ["../secret", "/etc/passwd", "container_1/../../secret"] {
            assert!(matches!(
                exec.read_log(bad, LogStream::Stdout, None),
                Err(NodeError::UnknownContainer(_))
            ));
        }
    }

    #[tokio::test]
    async fn stop_kills_the_whole_group() {
        let (_t, exec, mut rx) = setup();
        let pgid = exec
            .start("bg", "h", &no_gpus(), ctx(&["sleep 100 & sleep 100 & wait"]))
            .unwrap();
        // Let the background children start.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(group_alive(pgid));
        assert_eq!(exec.running_ids(), vec!["bg".to_string()]);
        let t0 = Instant::now();
        exec.stop("bg", Duration::from_secs(5)).await.unwrap();
        assert!(t0.elapsed() < Duration::from_secs(3), "stop took {:?}", t0.elapsed());
        // Strictly: no process at all, not even a zombie, is left in the group.
        let r = unsafe { libc::kill(-(pgid as libc::pid_t), 0) };
        assert_eq!(r, -1);
        assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::ESRCH));
        let (_, code, diag) = next_exit(&mut rx).await;
        assert_eq!(code, 143);
        assert!(diag.contains("stopped by request"), "{diag}");
        assert_eq!(exec.status("bg").unwrap().state, ContainerState::Complete);
        assert!(exec.running_ids().is_empty());
        // Idempotent, and no second event.
        exec.stop("bg", Duration::from_secs(1)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn stop_escalates_to_sigkill_after_grace() {
        let (_t, exec, mut rx) = setup();
        let pgid = exec
            .start(
                "stubborn",
                "h",
                &no_gpus(),
                ctx(&["trap '' TERM; sleep 100 & sleep 100; wait"]),
            )
            .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let t0 = Instant::now();
        exec.stop("stubborn", Duration::from_millis(300)).await.unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(300));
        assert!(!group_alive(pgid));
        let (_, code, diag) = next_exit(&mut rx).await;
        assert_eq!(code, 137, "{diag}");
        assert!(
            diag.contains("stopped by request") && diag.contains("SIGKILL"),
            "{diag}"
        );
    }

    #[tokio::test]
    async fn leftovers_of_a_finished_container_are_killed() {
        let (_t, exec, mut rx) = setup();
        let pgid = exec
            .start("left", "h", &no_gpus(), ctx(&["sleep 100 &", "echo done"]))
            .unwrap();
        let (_, code, _) = next_exit(&mut rx).await;
        assert_eq!(code, 0);
        assert!(!group_alive(pgid), "a background process outlived its container");
    }

    #[tokio::test]
    async fn killed_by_signal_maps_to_128_plus_n() {
        let (_t, exec, mut rx) = setup();
        exec.start("sig", "h", &no_gpus(), ctx(&["kill -KILL $$"])).unwrap();
        let (_, code, diag) = next_exit(&mut rx).await;
        assert_eq!(code, 137);
        assert!(diag.contains("signal 9 (SIGKILL)"), "{diag}");
        assert!(!diag.contains("stopped by request"));

        exec.start("seg", "h", &no_gpus(), ctx(&["kill -SEGV $$"])).unwrap();
        let (_, code, diag) = next_exit(&mut rx).await;
        assert_eq!(code, 128 + libc::SIGSEGV);
        assert!(diag.contains("SIGSEGV"), "{diag}");
    }

    #[test]
    fn describe_exit_codes() {
        assert_eq!(describe_exit(ExitStatus::from_raw(3 << 8)).0, 3);
        assert_eq!(describe_exit(ExitStatus::from_raw(libc::SIGTERM)).0, 143);
        assert_eq!(
            describe_exit(ExitStatus::from_raw(libc::SIGKILL)).1,
            "killed by signal 9 (SIGKILL)"
        );
    }

    #[tokio::test]
    async fn invalid_ids_are_rejected() {
        let (t, exec, mut rx) = setup();
        std::fs::write(t.path().join("x"), "secret").unwrap();
        for bad in ["../x", "..", ".", "", "a/b", "a b", "/etc", "c\0"] {
            let err = exec.start(bad, "h", &no_gpus(), ctx(&["true"])).unwrap_err();
            assert!(matches!(err, NodeError::StartFailed { .. }), "{bad:?}: {err}");
            assert!(matches!(
                exec.read_log(bad, LogStream::Stdout, None),
                Err(NodeError::UnknownContainer(_))
            ));
            assert!(matches!(
                exec.stop(bad, Duration::from_millis(10)).await,
                Err(NodeError::UnknownContainer(_))
            ));
            assert!(exec.container_dir(bad).is_none());
            assert!(exec.status(bad).is_none());
        }
        assert!(valid_container_id("container_e01_000001.01-x"));
        assert!(
            !t.path().join("containers").exists()
                || std::fs::read_dir(t.path().join("containers")).unwrap().count() == 0
        );
        assert!(rx.try_recv().is_err(), "a rejected start must send no event");
    }

    #[tokio::test]
    async fn unknown_container() {
        let (_t, exec, _rx) = setup();
        assert!(matches!(
            exec.stop("nope", Duration::from_millis(10)).await,
            Err(NodeError::UnknownContainer(_))
        ));
        assert!(matches!(
            exec.read_log("nope", LogStream::Stderr, None),
            Err(NodeError::UnknownContainer(_))
        ));
        assert!(exec.status("nope").is_none());
    }

    #[tokio::test]
    async fn same_id_twice_and_exactly_one_event() {
        let (_t, exec, mut rx) = setup();
        exec.start("dup", "h", &no_gpus(), ctx(&["sleep 0.2"])).unwrap();
        assert!(matches!(
            exec.start("dup", "h", &no_gpus(), ctx(&["true"])),
            Err(NodeError::AlreadyStarted(_))
        ));
        let (id, code, _) = next_exit(&mut rx).await;
        assert_eq!((id.as_str(), code), ("dup", 0));
        assert!(matches!(
            exec.start("dup", "h", &no_gpus(), ctx(&["true"])),
            Err(NodeError::AlreadyStarted(_))
        ));
        // A stop after completion must not produce a second event either.
        exec.stop("dup", Duration::from_millis(10)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn allocated_then_started_or_stopped() {
        let (_t, exec, mut rx) = setup();
        exec.allocate("a1").unwrap();
        exec.allocate("a2").unwrap();
        assert_eq!(exec.status("a1").unwrap().state, ContainerState::Allocated);
        assert_eq!(exec.read_log("a1", LogStream::Stdout, None).unwrap(), "");
        exec.start("a1", "h", &no_gpus(), ctx(&["true"])).unwrap();
        assert_eq!(next_exit(&mut rx).await.1, 0);
        exec.stop("a2", Duration::from_millis(10)).await.unwrap();
        let (id, code, _) = next_exit(&mut rx).await;
        assert_eq!((id.as_str(), code), ("a2", exit_status::ABORTED));
        assert!(matches!(exec.allocate("a1"), Err(NodeError::AlreadyStarted(_))));
    }

    #[tokio::test]
    async fn bad_launch_context_fails_without_event() {
        let (_t, exec, mut rx) = setup();
        let mut c = ctx(&["true"]);
        c.env.insert("A=B".into(), "x".into());
        let err = exec.start("badenv", "h", &no_gpus(), c).unwrap_err();
        assert!(err.to_string().contains("A=B"), "{err}");
        let count_only = Resources::with_count(1, 1, 2, Default::default());
        assert!(exec.start("nomask", "h", &count_only, ctx(&["true"])).is_err());
        assert!(exec.status("badenv").is_none());
        // The id is free again after a failed start.
        exec.start("badenv", "h", &no_gpus(), ctx(&["true"])).unwrap();
        assert_eq!(next_exit(&mut rx).await.0, "badenv");
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn stop_all_stops_every_running_container() {
        let (_t, exec, mut rx) = setup();
        let p1 = exec.start("s1", "h", &no_gpus(), ctx(&["sleep 100"])).unwrap();
        let p2 = exec.start("s2", "h", &no_gpus(), ctx(&["sleep 100"])).unwrap();
        assert_eq!(exec.running_ids(), vec!["s1".to_string(), "s2".to_string()]);
        exec.stop_all(Duration::from_secs(2)).await;
        assert!(!group_alive(p1) && !group_alive(p2));
        let mut ids = vec![next_exit(&mut rx).await.0, next_exit(&mut rx).await.0];
        ids.sort();
        assert_eq!(ids, vec!["s1", "s2"]);
    }

    #[test]
    fn start_outside_a_runtime_fails_cleanly() {
        let (_t, exec, _rx) = setup();
        let err = exec.start("rt", "h", &no_gpus(), ctx(&["true"])).unwrap_err();
        assert!(err.to_string().contains("tokio runtime"), "{err}");
    }

    #[test]
    fn executor_and_its_futures_are_send() {
        fn send_sync<T: Send + Sync>(_: &T) {}
        fn send<T: Send>(_: T) {}
        let (_t, exec, _rx) = setup();
        send_sync(&exec);
        // axum handlers need Send futures: no lock guard may live across an await.
        send(exec.stop("x", Duration::from_millis(1)));
        send(exec.stop_all(Duration::from_millis(1)));
    }

    #[tokio::test]
    async fn forget_only_completed() {
        let (_t, exec, mut rx) = setup();
        exec.start("f", "h", &no_gpus(), ctx(&["sleep 0.2"])).unwrap();
        assert!(!exec.forget("f"));
        next_exit(&mut rx).await;
        assert!(exec.forget("f"));
        assert!(exec.status("f").is_none());
        // The logs stay readable from the directory.
        assert_eq!(exec.read_log("f", LogStream::Stdout, None).unwrap(), "");
    }

    #[test]
    fn shell_quote_round_trips() {
        assert_eq!(shell_quote("a'b"), r"'a'\''b'");
        assert_eq!(shell_quote(""), "''");
    }

    /// The escapes a task can try: a new session (`setsid`), a double fork (orphaned to
    /// init), `nohup` in a new process group (`set -m`), python's `os.setsid()` + fork. Each writes its pid
    /// to `pids`.
    fn escapes(pids: &Path) -> Vec<String> {
        let p = pids.display();
        vec![
            format!("setsid sleep 1000 & echo $! >> {p}"),
            format!("( sleep 1001 & echo $! >> {p} ) "),
            format!("set -m; nohup sleep 1002 >/dev/null 2>&1 & echo $! >> {p}; set +m"),
            format!(
                "python3 -c 'import os,time\nif os.fork()==0:\n os.setsid()\n if os.fork()==0:\n  open(\"{p}\",\"a\").write(str(os.getpid())+\"\\n\"); time.sleep(1003)\n os._exit(0)\nos.wait()' "
            ),
            // Let every daemon write its pid.
            format!("while [ $(wc -l < {p}) -lt 4 ]; do sleep 0.02; done"),
        ]
    }

    fn alive_pids(pids: &Path) -> Vec<i32> {
        std::fs::read_to_string(pids)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse::<i32>().ok())
            .filter(|p| ProcessId::of(*p as u32).is_some_and(|id| id.alive()))
            .collect()
    }

    fn contained(
        name: &str,
    ) -> (
        tempfile::TempDir,
        Executor,
        mpsc::UnboundedReceiver<NodeEvent>,
        Containment,
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let containment = Containment::detect(&format!("node-{}-{name}", std::process::id()));
        assert_ne!(
            containment.mechanism(),
            super::super::cgroup::Mechanism::ProcessGroup,
            "this test needs a cgroup the test can create (run it as root): {}",
            containment.describe()
        );
        let (tx, rx) = mpsc::unbounded_channel();
        let exec = Executor::with_options(
            tmp.path().join("containers"),
            tx,
            ExecutorOptions {
                containment: containment.clone(),
                ..Default::default()
            },
        );
        (tmp, exec, rx, containment)
    }

    /// Daemons of every kind die with their container, on stop and on a normal end, and
    /// the `Exited` event comes only once none is left.
    #[tokio::test]
    async fn no_daemon_survives_its_container() {
        let (tmp, exec, mut rx, containment) = contained("escape");
        for (id, stop) in [("c-stopped", true), ("c-ended", false)] {
            let pids = tmp.path().join(format!("{id}.pids"));
            std::fs::write(&pids, "").unwrap();
            let mut cmds = escapes(&pids);
            if stop {
                cmds.push("sleep 1000".into());
            }
            let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
            exec.start(id, "h", &no_gpus(), ctx(&cmds)).unwrap();
            if stop {
                for _ in 0..500 {
                    if std::fs::read_to_string(&pids).unwrap().lines().count() >= 4 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                assert_eq!(alive_pids(&pids).len(), 4, "the daemons started");
                exec.stop(id, Duration::from_millis(300)).await.unwrap();
            }
            let (got, _, diag) = next_exit(&mut rx).await;
            assert_eq!(got, id);
            assert_eq!(
                alive_pids(&pids),
                Vec::<i32>::new(),
                "{id}: survivors after Exited ({diag})"
            );
            assert!(containment.cgroup(id).is_empty());
        }
        containment.remove_parents();
    }
}
