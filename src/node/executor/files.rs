//! Opening and creating files where a task can write, never following a link: the
//! record's files (logs, `process.json`, `end.json`) read in place, and new files made
//! in the task's own directory (the preemption notice) relative to a directory handle,
//! and trees a task made removed ([`remove_tree`]: without recursion, so a tree of any
//! depth cannot exhaust the node's stack). The root agent uses nothing else to touch a
//! path a task could have replaced.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

/// Opens the directory `path` itself, never through a link (`O_DIRECTORY | O_NOFOLLOW`),
/// for work relative to its handle.
pub fn open_dir_in_place(path: &Path) -> std::io::Result<OwnedFd> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    Ok(nix::fcntl::open(path, flags, Mode::empty())?)
}

/// Most entries [`remove_tree`] removes or moves before it gives up (a tree still growing
/// under it, by another process of the task's user).
const REMOVE_TREE_MAX_STEPS: u64 = 50_000_000;

/// Removes `path` and, when it is a directory (never followed: a link is removed itself),
/// everything under it that the task could have removed itself: entries owned by
/// `task_uid` or by this process's own uid (the node's files in a record), on the
/// filesystem of `path` itself. Anything else stays where it is, with a warning naming it
/// and its owner, and the removal then ends with an error saying it did not finish: a root
/// node removed, with root's rights, another user's files that a task had moved into its
/// directory (a directory of the task's holding one of bob's that the task itself could
/// not empty). A directory is entered only once its opened handle is seen to be of an
/// allowed owner and of the same filesystem, so no swap can make it enter another's; an
/// entry unlinked from a directory of the task's is one the task could unlink itself.
///
/// Unlike `std::fs::remove_dir_all`, which recurses once per level
/// and so overflowed the node's stack on a task's tree 200,000 directories deep (aborting
/// the agent, or an RM with its node inside), this holds two directory handles at a time:
/// it empties `path` round by round, removing what it can and moving the entries of a
/// subdirectory that is not empty up into `path` under fresh names (`renameat2` with
/// `RENAME_NOREPLACE`), so each round takes a level off every chain. Every step is relative
/// to a handle opened with `O_NOFOLLOW`; no `..` is ever taken. Gone already is success. A
/// round that changes nothing ends it (what is left is another's, or held by one).
pub fn remove_tree(path: &Path, task_uid: Option<u32>) -> std::io::Result<()> {
    use nix::errno::Errno;
    use nix::fcntl::{openat, renameat2, AtFlags, RenameFlags};
    use nix::sys::stat::{fstat, fstatat, FileStat};
    use nix::unistd::{unlinkat, UnlinkatFlags};
    let node_uid = nix::unistd::geteuid().as_raw();
    let allowed = |uid: u32| uid == node_uid || Some(uid) == task_uid;
    let not_finished = |left: usize| {
        std::io::Error::other(format!(
            "{}: not removed entirely: {left} entr{} owned by another user (which the task could not remove) left \
             in place",
            path.display(),
            if left == 1 { "y" } else { "ies" }
        ))
    };
    let warn = |at: &Path, uid: u32| {
        tracing::warn!(
            path = %at.display(),
            owner = uid,
            "not removed: owned by another user, or on another filesystem, than the task's (the task could not remove it)"
        );
    };
    let top = match open_dir_in_place(path) {
        Ok(fd) => fd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        // A link or a file: removed itself (when the task's or the node's).
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP) | Some(libc::ENOTDIR)) => {
            use std::os::unix::fs::MetadataExt as _;
            let owner = match std::fs::symlink_metadata(path) {
                Ok(m) => m.uid(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(e),
            };
            if !allowed(owner) {
                warn(path, owner);
                return Err(not_finished(1));
            }
            return match std::fs::remove_file(path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                r => r,
            };
        }
        Err(e) => return Err(e),
    };
    let top_stat = fstat(&top)?;
    if !allowed(top_stat.st_uid) {
        warn(path, top_stat.st_uid);
        return Err(not_finished(1));
    }
    let dev = top_stat.st_dev;
    let removable = |st: &FileStat| allowed(st.st_uid) && st.st_dev == dev;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    // The names in a directory, from a fresh handle of it (a listing's offset is its own).
    let names = |dir: &OwnedFd| -> std::io::Result<Vec<std::ffi::CString>> {
        let listing = nix::dir::Dir::from_fd(openat(dir, ".", flags, Mode::empty())?)?;
        let mut out = Vec::new();
        for e in listing {
            let name = e?.file_name().to_owned();
            if name.as_bytes() != b"." && name.as_bytes() != b".." {
                out.push(name);
            }
        }
        Ok(out)
    };
    let lstat = |dir: &OwnedFd, name: &std::ffi::CStr| fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW);
    let shown = |parts: &[&std::ffi::CStr]| {
        parts.iter().fold(path.to_path_buf(), |p, n| {
            p.join(std::ffi::OsStr::from_bytes(n.to_bytes()))
        })
    };
    // What stays (by device and inode), each named in one warning.
    let mut kept = std::collections::HashSet::new();
    let keep = |kept: &mut std::collections::HashSet<_>, st: &FileStat, at: PathBuf| {
        if kept.insert((st.st_dev, st.st_ino)) {
            warn(&at, st.st_uid);
        }
    };
    let (mut steps, mut fresh) = (0u64, 0u64);
    loop {
        let entries = names(&top)?;
        let mut progress = false;
        for name in &entries {
            steps += 1;
            if steps > REMOVE_TREE_MAX_STEPS {
                return Err(std::io::Error::other(format!(
                    "{}: still not empty after {REMOVE_TREE_MAX_STEPS} removals (something keeps adding to it)",
                    path.display()
                )));
            }
            match lstat(&top, name) {
                Ok(st) if !removable(&st) => {
                    keep(&mut kept, &st, shown(&[name]));
                    continue;
                }
                Ok(_) => {}
                Err(Errno::ENOENT) => {
                    progress = true;
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
            match unlinkat(&top, name.as_c_str(), UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => {
                    progress = true;
                    continue;
                }
                Err(Errno::EISDIR) | Err(Errno::EPERM) => {}
                Err(e) => return Err(e.into()),
            }
            match unlinkat(&top, name.as_c_str(), UnlinkatFlags::RemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => {
                    progress = true;
                    continue;
                }
                Err(Errno::ENOTEMPTY) | Err(Errno::EEXIST) => {}
                // Replaced by a file meanwhile: the next round unlinks it.
                Err(Errno::ENOTDIR) => {
                    progress = true;
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
            // Not empty: its entries move up a level, and the next round removes it. Only
            // a directory of an allowed owner is entered (its handle's owner: no swap).
            let sub = match openat(&top, name.as_c_str(), flags, Mode::empty()) {
                Ok(fd) => fd,
                Err(Errno::ENOENT) | Err(Errno::ELOOP) | Err(Errno::ENOTDIR) => {
                    progress = true;
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let sub_stat = fstat(&sub)?;
            if !removable(&sub_stat) {
                keep(&mut kept, &sub_stat, shown(&[name]));
                continue;
            }
            for child in names(&sub)? {
                steps += 1;
                match lstat(&sub, &child) {
                    Ok(st) if !removable(&st) => {
                        keep(&mut kept, &st, shown(&[name, &child]));
                        continue;
                    }
                    Ok(_) | Err(Errno::ENOENT) => {}
                    Err(e) => return Err(e.into()),
                }
                loop {
                    fresh += 1;
                    let to = format!(".gpuam-removing-{fresh}");
                    match renameat2(&sub, child.as_c_str(), &top, to.as_str(), RenameFlags::RENAME_NOREPLACE) {
                        Err(Errno::EEXIST) => continue,
                        Ok(()) | Err(Errno::ENOENT) => break,
                        Err(e) => return Err(e.into()),
                    }
                }
                progress = true;
            }
        }
        if entries.is_empty() {
            break;
        }
        if !progress {
            // Nothing more can go: what is left is another user's, or holds one's.
            return Err(not_finished(kept.len().max(1)));
        }
    }
    drop(top);
    match std::fs::remove_dir(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Reads at most `max` bytes of a regular file where it is, never through a link (see
/// [`open_log_in_place`]).
pub fn read_small_in_place(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let f = open_log_in_place(path, false)?;
    let mut out = Vec::new();
    f.take(max).read_to_end(&mut out)?;
    Ok(out)
}

/// [`read_small_in_place`] of a file of the node's own in a record (`process.json`,
/// `end.json`): one an older node left readable by others (0644) is made 0600 on the way.
pub(super) fn read_record_file(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    let f = open_log_in_place(path, false)?;
    let meta = f.metadata()?;
    if meta.mode() & 0o077 != 0 && meta.uid() == nix::unistd::geteuid().as_raw() {
        if let Err(e) = f.set_permissions(std::fs::Permissions::from_mode(0o600)) {
            tracing::warn!("cannot make {} private: {e}", path.display());
        }
    }
    let mut out = Vec::new();
    f.take(max).read_to_end(&mut out)?;
    Ok(out)
}

/// Creates `name` in directory `dir` holding `text`, owned by `owner` when given, mode
/// 0600 from its creation (a record's files, `process.json` and `end.json`, sit in a 0711
/// directory under guessable names: another tenant must not read a task's pid, exit status
/// or diagnostics; the preemption notice is read by the task as its owner), without
/// opening or following anything already in `dir`: the directory is opened with
/// `O_NOFOLLOW`, a new file of a fresh name is created in it with `O_CREAT | O_EXCL |
/// O_NOFOLLOW` (relative to the directory's handle), written, and renamed over `name`
/// (which replaces a link rather than following it). So a task that owns `dir` cannot
/// make root write anywhere else.
pub fn create_new_in(dir: &Path, name: &str, text: &[u8], owner: Option<(u32, u32)>) -> std::io::Result<()> {
    use std::ffi::CString;
    use std::os::fd::{AsRawFd as _, FromRawFd as _};
    let c = |s: &str| CString::new(s).map_err(|_| std::io::Error::other("a NUL in a file name"));
    let dfd = open_dir_in_place(dir)?;
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
            0o600 as libc::c_uint,
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

/// Opens a container's log file where it is, never through a link: a task may replace its
/// `stdout` with a symlink (to /etc/passwd, say) or a FIFO, so the file is opened with
/// `O_NOFOLLOW | O_NONBLOCK` and anything but a regular file is refused.
pub(super) fn open_log_in_place(path: &Path, write: bool) -> std::io::Result<File> {
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
