//! A container's record on disk: its name (`ROLE-INDEX@ID` or `ID`), the files in it
//! (`process.json`, `end.json`, `acked`, the logs, the task's `work/`), finding it again,
//! the preemption notice, and removing what ended: the work directory after its grace,
//! the record after the retention once its end was acknowledged ([`Executor::sweep`]).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::files::create_new_in;
use super::table::{Phase, Table};
use super::Executor;
use crate::node::NodeError;

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
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(crate::config::DEFAULT_LOG_RETENTION_SEC);

/// How long after its end a container's work directory is removed by default
/// (`node.work_dir_grace_sec`). Removing it at once put the deletions among the next
/// starts: on ext4 without a journal, every inode the node allocates then scans past the
/// recently deleted ones of its group (`recently_deleted` in the kernel), and a burst of
/// ends made the following starts twice as slow (docs/BENCHMARKS.md). Later, the removals
/// fall outside the burst; the directory is the task's own (0700, its uid) meanwhile.
pub const DEFAULT_WORK_DIR_GRACE: Duration = Duration::from_secs(crate::config::DEFAULT_WORK_DIR_GRACE_SEC);

/// An ended container's work directory holding more than this goes at once, whatever the
/// grace (only small ones wait).
pub const DEFER_REMOVAL_MAX_BYTES: u64 = 1 << 20;

/// Finished records are looked for at most this often (on a start).
pub(super) const SWEEP_EVERY: Duration = Duration::from_secs(60);

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
    /// A bound it went past (absent in records of older nodes, and for other ends).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<crate::protocol::EndCause>,
}

pub use crate::protocol::valid_container_id;

impl Executor {
    /// Where container `id`'s record is on disk when this executor's table does not say
    /// (after a restart, or once it was forgotten): `ID`, else the one `LABEL@ID`
    /// ([`record_name`]); `root/ID` (absent) when there is none.
    pub(super) fn find_record(&self, container_id: &str) -> PathBuf {
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
    pub(super) fn work_dir_grace(&self) -> Duration {
        self.opts.work_dir_grace.unwrap_or(DEFAULT_WORK_DIR_GRACE)
    }

    /// [`Executor::sweep`], at most every [`SWEEP_EVERY`], in the background.
    pub(super) fn sweep_now_and_then(&self) {
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
}

/// Asks the filesystem to place each container record (a directory of the root) in a
/// block group of its own choosing, as it places top-level directories (ext4's
/// `FS_TOPDIR_FL`, `chattr +T`), instead of all of them in the root's group. On ext4
/// without a journal every inode allocated in a group scans past that group's recently
/// deleted inodes (`recently_deleted` in the kernel); with every record in one group, the
/// files that other work on the machine (or earlier records) deleted there made each start
/// slower (docs/BENCHMARKS.md). Best effort: other filesystems refuse the flag, which
/// changes nothing else.
pub(super) fn spread_records(root: &Path) {
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
pub(super) fn sweep_records(
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
        let age = now.duration_since(ended).ok();
        match sweep_action(acked, age, retention, work_dir_grace) {
            SweepAction::RemoveRecord => match super::files::remove_tree(&record, task_uid_of(&record)) {
                Ok(()) => removed += 1,
                Err(e) => tracing::warn!(container = %id, "cannot remove the finished record: {e}"),
            },
            SweepAction::RemoveWorkDir => remove_work_dir(&record, &id),
            SweepAction::Keep => {}
        }
    }
    removed
}

/// What a sweep does with an ended container's record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SweepAction {
    Keep,
    /// Its task's directory goes (the logs stay).
    RemoveWorkDir,
    /// The whole record goes (its logs included).
    RemoveRecord,
}

/// The sweep's rule for a record that ended `age` ago (`None`: in the future, a clock
/// that went back): the record goes once its end was acknowledged and the retention
/// passed; else the work directory once the grace passed.
pub(super) fn sweep_action(acked: bool, age: Option<Duration>, retention: Duration, grace: Duration) -> SweepAction {
    match age {
        Some(age) if acked && age >= retention => SweepAction::RemoveRecord,
        Some(age) if age >= grace => SweepAction::RemoveWorkDir,
        _ => SweepAction::Keep,
    }
}

/// The uid a container's task ran as: the owner of its work directory, which the node
/// made and gave to the task's uid at the start ([`super::spawn`]) and which the task can
/// neither give away nor replace (it sits in the node's 0711 record). Known so after a
/// restart too, when the executor's table (its entry's `owner`) is gone. `None` once
/// the work directory is gone.
pub(super) fn task_uid_of(record: &Path) -> Option<u32> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::symlink_metadata(work_dir(record))
        .ok()
        .filter(std::fs::Metadata::is_dir)
        .map(|m| m.uid())
}

/// Removes the task's own directory of an ended container (its record stays). The
/// removal does not follow links, takes a tree of any depth, and removes nothing the task
/// could not have removed itself ([`super::files::remove_tree`] with [`task_uid_of`]).
pub(super) fn remove_work_dir(record: &Path, id: &str) {
    match super::files::remove_tree(&work_dir(record), task_uid_of(record)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(container = id, "cannot remove the finished container's directory: {e}"),
    }
}
