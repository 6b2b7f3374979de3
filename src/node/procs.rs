//! What `/proc` says about processes, read in one place, and the one way the node sends
//! them a signal ([`send_signal`], through `nix`): whether a process group still
//! has a live member, the descendants of a process ([`descendants`], which the subreaper
//! shim signals), and [`ProcessId`], which names a process so that a later RM can
//! find it again. A pid alone is not enough (pids are reused), so the pid goes with the
//! kernel's start time of that process (`/proc/<pid>/stat` field 22, in clock ticks
//! since boot). The pair is what the RM persists for AM processes and the executor for
//! container leaders, and what lets a restarted RM re-attach to processes it did not
//! spawn. Also [`close_inherited_at_exec`]: no descriptor this process inherited reaches
//! what it starts.

use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

/// Whom [`send_signal`] signals.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalTo {
    /// One process.
    Process(u32),
    /// Every process of a process group.
    Group(u32),
}

/// Sends `sig` to `to` (`None`: only checks that it exists and may be signalled). Never to
/// pid or group 0 or 1, nor to a number beyond `pid_t` (`kill(0)` / `kill(-1)` would hit
/// the node's own group or every process): those give `EINVAL` and nothing is sent. A
/// target that is gone gives `ESRCH`, which most callers ignore.
pub fn send_signal(to: SignalTo, sig: Option<Signal>) -> Result<(), Errno> {
    let (n, group) = match to {
        SignalTo::Process(n) => (n, false),
        SignalTo::Group(n) => (n, true),
    };
    let n = i32::try_from(n).map_err(|_| Errno::EINVAL)?;
    if n <= 1 {
        return Err(Errno::EINVAL);
    }
    if group {
        nix::sys::signal::killpg(Pid::from_raw(n), sig)
    } else {
        nix::sys::signal::kill(Pid::from_raw(n), sig)
    }
}

/// A process as (pid, start time); see the module doc.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessId {
    pub pid: u32,
    pub start_ticks: u64,
}

/// How often a re-attached (not our child) process is checked for having ended.
pub const FOREIGN_POLL: Duration = Duration::from_millis(100);

/// Fields of a `/proc/<pid>/stat` text after the parenthesised command name (which may
/// itself contain spaces and parentheses, hence the search for the last `)`): state(0)
/// ppid(1) pgrp(2) ... starttime(19).
fn fields_of(stat: &str) -> Option<Vec<&str>> {
    let close = stat.rfind(')')?;
    Some(stat[close + 1..].split_whitespace().collect())
}

fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(fields_of(&stat)?.into_iter().map(str::to_string).collect())
}

/// A zombie (`Z`) or dead (`X`) process has finished for every purpose here.
fn finished(state: Option<&str>) -> bool {
    matches!(state, Some("Z") | Some("X"))
}

/// `(pid, stat text)` of every process in `/proc` now (processes that vanish while it is
/// read are left out); `None` without `/proc`.
fn stats() -> Option<impl Iterator<Item = (u32, String)>> {
    let entries = std::fs::read_dir("/proc").ok()?;
    Some(entries.flatten().filter_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
        Some((pid, stat))
    }))
}

/// `Some(true)` if some process of group `pgid` is live (not a zombie); `None` without
/// `/proc`.
pub fn group_has_live_member(pgid: u32) -> Option<bool> {
    Some(stats()?.any(|(_, stat)| {
        fields_of(&stat).is_some_and(|f| {
            f.get(2).and_then(|g| g.parse::<u32>().ok()) == Some(pgid) && !finished(f.first().copied())
        })
    }))
}

/// `(pid, ppid)` of every process in `/proc` now (empty without `/proc`).
pub fn process_table() -> Vec<(i32, i32)> {
    let Some(all) = stats() else {
        return Vec::new();
    };
    all.filter_map(|(pid, stat)| {
        let ppid = fields_of(&stat)?.get(1)?.parse().ok()?;
        Some((i32::try_from(pid).ok()?, ppid))
    })
    .collect()
}

/// Every process whose parent chain reaches `root` (not `root` itself), from a table of
/// `(pid, ppid)`. Pure; cycles in a torn table are ignored.
pub fn descendants_in(root: i32, table: &[(i32, i32)]) -> Vec<i32> {
    let mut children: std::collections::HashMap<i32, Vec<i32>> = std::collections::HashMap::new();
    for &(pid, ppid) in table {
        children.entry(ppid).or_default().push(pid);
    }
    let mut seen = std::collections::HashSet::from([root]);
    let mut out = Vec::new();
    let mut todo = vec![root];
    while let Some(p) = todo.pop() {
        for &c in children.get(&p).into_iter().flatten() {
            if seen.insert(c) {
                out.push(c);
                todo.push(c);
            }
        }
    }
    out
}

/// The descendants of `root` now (see [`descendants_in`]).
pub fn descendants(root: i32) -> Vec<i32> {
    descendants_in(root, &process_table())
}

impl ProcessId {
    /// The identity of a running process; `None` when it does not exist (or without /proc).
    pub fn of(pid: u32) -> Option<ProcessId> {
        // After the name: state(0) ppid(1) pgrp(2) ... starttime is field 22 of the
        // whole line, i.e. index 19 here.
        let start_ticks = stat_fields(pid)?.get(19)?.parse().ok()?;
        Some(ProcessId { pid, start_ticks })
    }

    /// True while this very process runs: same pid, same start time, and not a zombie
    /// (an exited process that nobody reaped has finished for every purpose here).
    pub fn alive(&self) -> bool {
        let Some(f) = stat_fields(self.pid) else {
            return false;
        };
        let same = f.get(19).and_then(|s| s.parse::<u64>().ok()) == Some(self.start_ticks);
        same && !finished(f.first().map(String::as_str))
    }

    /// Sends `sig` (a signal number) to this process if it is still the same process.
    pub fn signal(&self, sig: i32) {
        if !self.alive() {
            return;
        }
        if let Ok(sig) = Signal::try_from(sig) {
            let _ = send_signal(SignalTo::Process(self.pid), Some(sig));
        }
    }

    /// Waits (polling) until the process has ended.
    pub async fn ended(&self) {
        while self.alive() {
            tokio::time::sleep(FOREIGN_POLL).await;
        }
    }
}

/// Marks every descriptor from 3 on close-on-exec, so that nothing this process inherited
/// from whoever started it (a shell's `exec 9<secret`, a wrapper's pipe, a lock) reaches
/// an AM, a task or any other program it starts. Called once, first thing in `main`; what
/// Rust opens afterwards is close-on-exec already. `close_range` (Linux 5.11), else each
/// descriptor of `/proc/self/fd`.
pub fn close_inherited_at_exec() {
    // SAFETY: a plain syscall on this process's descriptor table.
    let done = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if done == 0 {
        return;
    }
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|&fd| fd > 2)
        .collect();
    for fd in fds {
        // SAFETY: flags of a descriptor number; one closed meanwhile answers EBADF.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A descriptor inherited without close-on-exec is marked so (what `main` does first).
    #[test]
    fn inherited_descriptors_close_at_exec() {
        let f = std::fs::File::open("/dev/null").unwrap();
        // SAFETY: a duplicate without FD_CLOEXEC, closed below.
        let fd = unsafe { libc::dup(std::os::fd::AsRawFd::as_raw_fd(&f)) };
        let cloexec = |fd| unsafe { libc::fcntl(fd, libc::F_GETFD) } & libc::FD_CLOEXEC != 0;
        assert!(fd > 2 && !cloexec(fd));
        close_inherited_at_exec();
        assert!(cloexec(fd));
        unsafe { libc::close(fd) };
    }

    #[test]
    fn descendants_follow_parent_chains_only() {
        // 10 → 11 → 12 → 13, 10 → 14; 20 is someone else's, 11 ↔ 30 a torn cycle.
        let table = [
            (11, 10),
            (12, 11),
            (13, 12),
            (14, 10),
            (20, 1),
            (21, 20),
            (30, 31),
            (31, 30),
        ];
        let mut d = descendants_in(10, &table);
        d.sort();
        assert_eq!(d, vec![11, 12, 13, 14]);
        assert_eq!(descendants_in(13, &table), Vec::<i32>::new());
        let mut c = descendants_in(30, &table);
        c.sort();
        assert_eq!(c, vec![31], "a cycle ends, without the root itself");
    }

    #[test]
    fn signals_never_go_to_0_or_1_and_a_gone_process_is_esrch() {
        for to in [
            SignalTo::Process(0),
            SignalTo::Process(1),
            SignalTo::Group(0),
            SignalTo::Group(1),
            SignalTo::Group(u32::MAX),
        ] {
            assert_eq!(send_signal(to, Some(Signal::SIGKILL)), Err(Errno::EINVAL), "{to:?}");
        }
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert_eq!(send_signal(SignalTo::Process(pid), None), Err(Errno::ESRCH));
        assert_eq!(send_signal(SignalTo::Process(std::process::id()), None), Ok(()));
    }

    #[test]
    fn ppid_after_a_name_with_spaces_and_parens() {
        assert_eq!(
            fields_of("42 (a) b (c)) S 7 42 42 0 -1").and_then(|f| f.get(1).copied()),
            Some("7")
        );
        assert_eq!(fields_of("garbage"), None);
    }

    #[test]
    fn identifies_this_process_and_rejects_a_wrong_start_time() {
        let me = ProcessId::of(std::process::id()).unwrap();
        assert!(me.alive());
        let impostor = ProcessId {
            start_ticks: me.start_ticks + 1,
            ..me
        };
        assert!(!impostor.alive(), "a reused pid is not the same process");
        assert!(ProcessId::of(u32::MAX).is_none());
    }

    #[tokio::test]
    async fn sees_a_child_end() {
        let mut child = std::process::Command::new("sleep").arg("0.2").spawn().unwrap();
        let id = ProcessId::of(child.id()).unwrap();
        assert!(id.alive());
        let waiter = tokio::spawn(async move { id.ended().await });
        // Reap it, as its parent would; a zombie would also count as ended.
        child.wait().unwrap();
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
        assert!(!id.alive());
    }
}
