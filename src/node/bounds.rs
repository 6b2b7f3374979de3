//! Bounded nodes: what one container may take of its node beyond its cgroup limits.
//!
//! - **Disk** (`node.max_container_disk_mb`): the container's directory is measured every
//!   [`DISK_CHECK`] ([`disk_usage`]: allocated blocks, walked by directory handles with
//!   `O_NOFOLLOW`, never leaving through a link); beyond the bound every process of the
//!   container is killed ([`watch_disk`]) and it ends with `disk limit exceeded (N MiB)`; its
//!   directory is then emptied of the task's files ([`trim_dir`]: the logs and gpuam's own
//!   files stay), so a node the task filled runs the next job. Measurement, not a quota: it
//!   works under every containment (cgroup v2, v1, the shim), on every filesystem; a task
//!   can overshoot by what it writes in one interval (or fill a small disk first), which
//!   the trim gives back; a directory whose walk is costly (many entries) is measured less
//!   often ([`next_disk_check`]: the walks take at most a tenth of a CPU of the node's per
//!   container), so it can overshoot by what it writes in that longer interval. A directory deeper than [`MAX_DEPTH`] levels or with more than
//!   [`MAX_ENTRIES`] entries is not walked whole and counts as over the bound ([`verdict`]). Its
//!   temporary files count (`TMPDIR` is in its directory); files it writes elsewhere (the
//!   host's `/tmp` by name) are not (see docs/RELIABILITY.md).
//! - **Out of memory**: an OOM kill inside the container's own memory limit (read by
//!   [`super::cgroup::Cgroup::oom_killed`]) is [`EndCause::OutOfMemory`], worded
//!   `out of memory (limit N MiB)`, which the AM counts as the task's failure (see
//!   `am::exits::classify`). Both bounds end a container with a typed [`EndCause`].
//!
//! The node-wide pids bound is the parent cgroup's `pids.max` ([`super::cgroup`]).

use std::ffi::CStr;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use parking_lot::Mutex;
use tokio::sync::watch;

use super::cgroup::{Cgroup, Containment};
use super::devices::Rule;
use super::procs::{send_signal, SignalTo};
use crate::protocol::EndCause;

/// A node's bounds from its settings (`node.max_container_disk_mb`, `node.max_pids`,
/// `node.device_allow`), for the agent and the in-process node alike.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeBounds {
    pub max_disk_mb: Option<u64>,
    pub max_pids: Option<u64>,
    pub device_allow: Vec<Rule>,
}

/// Half of the machine's `kernel.pid_max`: what `node.max_pids: 0` bounds a node's
/// containers to, so that they never take every pid of the machine.
fn auto_max_pids() -> Option<u64> {
    let max: u64 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some((max / 2).max(64))
}

impl NodeBounds {
    /// The bounds the settings give (0: none); `Err` names the device rule that does not
    /// parse, by its place in `node.device_allow` (where a node's settings are checked:
    /// `config` only parses, it knows no node types).
    pub fn from_settings(n: &crate::config::NodeSettings) -> Result<NodeBounds, String> {
        Ok(NodeBounds {
            max_disk_mb: Some(n.max_container_disk_mb).filter(|v| *v > 0),
            max_pids: Some(n.max_pids).filter(|v| *v > 0).or_else(auto_max_pids),
            device_allow: n
                .device_allow
                .iter()
                .enumerate()
                .map(|(i, r)| r.parse().map_err(|e| format!("node.device_allow[{i}]: {e}")))
                .collect::<Result<_, String>>()?,
        })
    }

    /// `c` with the node-wide pids bound set and the extra device rules checked.
    pub fn apply(&self, c: Containment) -> Result<Containment, String> {
        c.with_max_pids(self.max_pids)
            .with_device_allow(self.device_allow.clone())
    }
}

/// How often a running container's directory is measured.
pub const DISK_CHECK: Duration = Duration::from_secs(1);

/// The share of one CPU a container's disk measurements may take, at most, as the
/// inverse: after a walk that took `d`, the next comes no sooner than `d` × this.
const DISK_CHECK_SPACING: u32 = 10;

/// How long to wait after a measurement that took `took` before the next: [`DISK_CHECK`],
/// or more where the walk was costly (twelfth pass: a task's 900,000 empty files, walked
/// every second, took 90 % of a CPU of the node's, outside the task's own CPU limit).
pub fn next_disk_check(took: Duration) -> Duration {
    DISK_CHECK.max(took.saturating_mul(DISK_CHECK_SPACING))
}
/// Deepest directory level and most entries one measurement visits (a task cannot make
/// the node walk forever). A directory beyond either cannot be measured, and a task
/// could hide bytes past them: it counts as over the bound ([`Usage::complete`]).
pub const MAX_DEPTH: u32 = 64;
pub const MAX_ENTRIES: u64 = 1_000_000;

/// What one measurement of a directory found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// Bytes allocated to what was visited.
    pub bytes: u64,
    /// Whether everything was visited (no level past [`MAX_DEPTH`], no more than
    /// [`MAX_ENTRIES`] entries).
    pub complete: bool,
}

/// A bound a container went past: the typed cause, and the sentence its diagnostics lead
/// with (the cause's words, and what else the node knows of it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Breach {
    pub cause: EndCause,
    pub why: String,
}

impl From<EndCause> for Breach {
    fn from(cause: EndCause) -> Breach {
        Breach {
            cause,
            why: cause.diagnostics(),
        }
    }
}

fn open_dir(path: &Path) -> Option<OwnedFd> {
    super::executor::open_dir_in_place(path).ok()
}

/// Bytes allocated under the directory `dir` (itself excluded), not following links.
pub fn disk_usage(dir: &Path) -> Usage {
    let mut entries = 0;
    let mut complete = true;
    let bytes = open_dir(dir).map_or(0, |fd| walk(&fd, 0, &mut entries, &mut complete));
    Usage { bytes, complete }
}

/// Whether `usage` is beyond a bound of `limit_mb` MiB, and why: a directory that could
/// not be measured whole is beyond it (what is past the walk's limits is not known).
pub fn verdict(usage: Usage, limit_mb: u64) -> Option<Breach> {
    let cause = EndCause::DiskLimit { limit_mb };
    if !usage.complete {
        return Some(Breach {
            cause,
            why: format!(
                "{}: the directory is deeper than {MAX_DEPTH} levels or holds more than {MAX_ENTRIES} entries, \
                 which the node does not measure",
                cause.diagnostics()
            ),
        });
    }
    over(usage.bytes, limit_mb).then(|| cause.into())
}

fn walk(fd: &OwnedFd, depth: u32, entries: &mut u64, complete: &mut bool) -> u64 {
    let mut total = 0u64;
    // SAFETY: `dup` of an fd we hold; `fdopendir` takes the copy, `closedir` frees it;
    // `readdir` entries are read before the next call.
    unsafe {
        let copy = libc::dup(fd.as_raw_fd());
        if copy < 0 {
            return 0;
        }
        let dirp = libc::fdopendir(copy);
        if dirp.is_null() {
            libc::close(copy);
            return 0;
        }
        loop {
            let ent = libc::readdir(dirp);
            if ent.is_null() {
                break;
            }
            let name = CStr::from_ptr((*ent).d_name.as_ptr());
            if name.to_bytes() == b"." || name.to_bytes() == b".." {
                continue;
            }
            *entries += 1;
            if *entries > MAX_ENTRIES {
                *complete = false;
                break;
            }
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstatat(fd.as_raw_fd(), name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) != 0 {
                continue;
            }
            total = total.saturating_add((st.st_blocks as u64).saturating_mul(512));
            if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
                if depth >= MAX_DEPTH {
                    *complete = false;
                    continue;
                }
                let child = libc::openat(
                    fd.as_raw_fd(),
                    name.as_ptr(),
                    libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                );
                if child >= 0 {
                    let child = OwnedFd::from_raw_fd(child);
                    total = total.saturating_add(walk(&child, depth + 1, entries, complete));
                }
            }
        }
        libc::closedir(dirp);
    }
    total
}

/// Whether `used` bytes are beyond a bound of `limit_mb` MiB.
pub fn over(used: u64, limit_mb: u64) -> bool {
    used > limit_mb.saturating_mul(1 << 20)
}

/// How a container is killed from outside (the watcher's view of it).
#[derive(Clone, Debug)]
pub struct Target {
    pub cgroup: Cgroup,
    /// The recorded process (its group's leader, or the shim).
    pub pid: u32,
    pub shim: bool,
}

impl Target {
    /// Kills every process of the container: its cgroup, else its shim (which kills its
    /// descendants), else its process group.
    pub fn kill(&self) {
        if self.cgroup.is_real() {
            self.cgroup.kill();
            return;
        }
        let (to, sig) = if self.shim {
            (SignalTo::Process(self.pid), super::shim::KILL_SIGNAL)
        } else {
            (SignalTo::Group(self.pid), Signal::SIGKILL)
        };
        let _ = send_signal(to, Some(sig));
    }
}

/// Runs `f` on a thread of its own at the lowest CPU priority (nice 19) and the lowest
/// best-effort I/O priority, and gives back what it returns (`None`: it panicked). For the
/// node's work on a task's behalf that a task can make long (walking or removing its
/// millions of files, twelfth pass): it must not hold the runtime's workers, and what it
/// costs the node comes after everything else that wants the CPU or the disk. A thread of
/// its own, so the priority goes with it (a pooled thread would keep it).
pub async fn in_background<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("gpuam-background".into())
        .spawn(move || {
            lower_this_thread();
            let _ = tx.send(f());
        });
    match spawned {
        Ok(_) => rx.await.ok(),
        Err(e) => {
            tracing::warn!("cannot start a background thread: {e}");
            None
        }
    }
}

/// This thread to nice 19 and best-effort I/O priority 7 (failures ignored: a priority is a
/// courtesy, not a bound).
fn lower_this_thread() {
    // SAFETY: plain syscalls on this thread's own id.
    unsafe {
        let tid = libc::gettid() as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
        // ioprio_set(IOPRIO_WHO_PROCESS, tid, IOPRIO_PRIO_VALUE(IOPRIO_CLASS_BE, 7)).
        const IOPRIO_WHO_PROCESS: libc::c_long = 1;
        const BEST_EFFORT_LOWEST: libc::c_long = (2 << 13) | 7;
        libc::syscall(
            libc::SYS_ioprio_set,
            IOPRIO_WHO_PROCESS,
            tid as libc::c_long,
            BEST_EFFORT_LOWEST,
        );
    }
}

/// Measures `dir` every [`DISK_CHECK`] until the container is done; beyond `limit_mb` MiB
/// it records the [`Breach`] in `verdict` and kills the container. A measurement that took
/// long (a directory of many entries) spaces the next ([`next_disk_check`]): the walks are
/// the node's CPU, not the task's (and run at the lowest priority: [`in_background`]).
pub async fn watch_disk(
    dir: std::path::PathBuf,
    limit_mb: u64,
    target: Target,
    verdict: Arc<Mutex<Option<Breach>>>,
    mut done: watch::Receiver<bool>,
) {
    let mut pause = DISK_CHECK;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = done.changed() => return,
        }
        if *done.borrow() {
            return;
        }
        let d = dir.clone();
        let took = std::time::Instant::now();
        let Some(used) = in_background(move || disk_usage(&d)).await else {
            return;
        };
        pause = next_disk_check(took.elapsed());
        if let Some(breach) = self::verdict(used, limit_mb) {
            tracing::warn!(dir = %dir.display(), used = used.bytes, "{}: killing the container", breach.why);
            *verdict.lock() = Some(breach);
            target.kill();
            return;
        }
    }
}

/// Removes everything in the container directory `dir` but the names in `keep` (its logs
/// and gpuam's own files), without following links and at any depth
/// ([`crate::node::executor::remove_tree`]); nothing owned by another user than the
/// task's (`task_uid`) or the node's.
pub fn trim_dir(dir: &Path, keep: &[&str], task_uid: Option<u32>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        if keep.iter().any(|k| name == std::ffi::OsStr::new(k)) {
            continue;
        }
        let p = e.path();
        if let Err(err) = crate::node::executor::remove_tree(&p, task_uid) {
            tracing::warn!("cannot remove {}: {err}", p.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node's work for a task runs at the lowest priority, on a thread that goes with
    /// it: what it returns comes back, and this thread's priority is untouched.
    #[tokio::test]
    async fn background_work_runs_at_the_lowest_priority_and_returns() {
        let nice = || unsafe {
            *libc::__errno_location() = 0;
            libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t)
        };
        let before = nice();
        let (there, name) = in_background(move || (nice(), std::thread::current().name().map(str::to_string)))
            .await
            .expect("it ran");
        assert_eq!(there, 19);
        assert_eq!(name.as_deref(), Some("gpuam-background"));
        assert_eq!(nice(), before, "the caller's thread is as it was");
        assert!(in_background(|| panic!("a walk that fails")).await.is_none());
    }

    /// A cheap walk comes back every second; a costly one no sooner than 10 × its time.
    #[test]
    fn a_costly_measurement_spaces_the_next() {
        assert_eq!(next_disk_check(Duration::ZERO), DISK_CHECK);
        assert_eq!(next_disk_check(Duration::from_millis(50)), DISK_CHECK);
        assert_eq!(next_disk_check(Duration::from_millis(900)), Duration::from_secs(9));
        assert_eq!(next_disk_check(Duration::MAX), Duration::MAX);
    }

    #[test]
    fn usage_counts_files_and_subdirectories_but_not_through_links() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("c");
        std::fs::create_dir_all(d.join("sub/deeper")).unwrap();
        std::fs::write(d.join("a"), vec![1u8; 1 << 20]).unwrap();
        std::fs::write(d.join("sub/deeper/b"), vec![1u8; 2 << 20]).unwrap();
        // Outside: 4 MiB behind a link, which must not count.
        std::fs::write(tmp.path().join("outside"), vec![1u8; 4 << 20]).unwrap();
        std::os::unix::fs::symlink(tmp.path(), d.join("link")).unwrap();
        let Usage { bytes: used, complete } = disk_usage(&d);
        assert!(complete);
        assert!(used >= 3 << 20, "{used}");
        assert!(used < 7 << 20, "counted through the link: {used}");
        assert!(over(used, 2));
        assert!(!over(used, 8));
        assert_eq!(
            verdict(disk_usage(&d), 2),
            Some(Breach {
                cause: EndCause::DiskLimit { limit_mb: 2 },
                why: "disk limit exceeded (2 MiB)".into()
            })
        );
        assert_eq!(verdict(disk_usage(&d), 8), None);
        assert_eq!(
            disk_usage(&d.join("link")).bytes,
            0,
            "the directory itself is not followed"
        );
    }

    /// Bytes hidden below the deepest level the walk visits are not known, so such a
    /// directory counts as over the bound, with a reason that says why.
    #[test]
    fn a_tree_deeper_than_the_walk_goes_is_over_the_bound() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("c");
        let mut deep = d.clone();
        for _ in 0..=MAX_DEPTH {
            deep.push("d");
        }
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::write(deep.join("hidden"), vec![1u8; 4 << 20]).unwrap();
        let usage = disk_usage(&d);
        assert!(!usage.complete, "{usage:?}");
        assert!(usage.bytes < 4 << 20, "the hidden file was not reached: {usage:?}");
        let Breach { cause, why } = verdict(usage, 1024).unwrap();
        assert_eq!(cause, EndCause::DiskLimit { limit_mb: 1024 });
        assert!(
            why.starts_with("disk limit exceeded (1024 MiB): the directory is deeper than 64 levels"),
            "{why}"
        );
        // One level less is measured whole.
        let shallow = tmp.path().join("s");
        let mut p = shallow.clone();
        for _ in 0..MAX_DEPTH {
            p.push("d");
        }
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("f"), b"x").unwrap();
        assert!(disk_usage(&shallow).complete);
        assert_eq!(verdict(disk_usage(&shallow), 1024), None);
    }

    #[test]
    fn trim_keeps_the_logs_and_removes_the_rest_without_following_links() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("c");
        std::fs::create_dir_all(d.join("sub")).unwrap();
        std::fs::write(d.join("stdout"), "log").unwrap();
        std::fs::write(d.join("big"), vec![0u8; 1 << 20]).unwrap();
        std::fs::write(d.join("sub/x"), "x").unwrap();
        let victim = tmp.path().join("victim");
        std::fs::create_dir_all(&victim).unwrap();
        std::fs::write(victim.join("keep-me"), "x").unwrap();
        std::os::unix::fs::symlink(&victim, d.join("link")).unwrap();
        trim_dir(&d, &["stdout"], None);
        let left: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("stdout")]);
        assert!(victim.join("keep-me").exists(), "a link's target is not touched");
    }

    #[test]
    fn reasons_name_the_bound_and_are_read_back() {
        let causes = [
            (EndCause::DiskLimit { limit_mb: 16 }, "disk limit exceeded (16 MiB)"),
            (
                EndCause::OutOfMemory { limit_mb: Some(64) },
                "out of memory (limit 64 MiB)",
            ),
            (
                EndCause::OutOfMemory { limit_mb: None },
                "out of memory (limit unknown MiB)",
            ),
        ];
        for (cause, words) in causes {
            assert_eq!(cause.diagnostics(), words);
            let diagnostics = format!("{words}; killed by signal 9 (SIGKILL); end of stderr: x");
            assert_eq!(EndCause::of(&diagnostics), Some(cause), "{diagnostics}");
            let wire = serde_json::to_string(&cause).unwrap();
            assert_eq!(serde_json::from_str::<EndCause>(&wire).unwrap(), cause, "{wire}");
        }
        assert_eq!(EndCause::of("exited with code 1; end of stderr: oops"), None);
        // A task that prints the node's words does not pass for a bound the node enforced.
        assert_eq!(
            EndCause::of("exited with code 3; end of stderr: out of memory (limit 64 MiB)"),
            None
        );
        assert_eq!(
            serde_json::to_string(&EndCause::DiskLimit { limit_mb: 16 }).unwrap(),
            r#"{"kind":"DISK_LIMIT","limitMb":16}"#
        );
    }
}
