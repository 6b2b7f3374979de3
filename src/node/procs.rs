//! What `/proc` says about processes, read in one place: whether a process group still
//! has a live member, and [`ProcessId`], which names a process so that a later RM can
//! find it again. A pid alone is not enough (pids are reused), so the pid goes with the
//! kernel's start time of that process (`/proc/<pid>/stat` field 22, in clock ticks
//! since boot). The pair is what the RM persists for AM processes and the executor for
//! container leaders, and what lets a restarted RM re-attach to processes it did not
//! spawn.

use std::time::Duration;

use serde::{Deserialize, Serialize};

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

/// `Some(true)` if some process of group `pgid` is live (not a zombie); `None` without
/// `/proc`.
pub fn group_has_live_member(pgid: u32) -> Option<bool> {
    let entries = std::fs::read_dir("/proc").ok()?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit())) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some(f) = fields_of(&stat) else { continue };
        let pgrp = f.get(2).and_then(|g| g.parse::<u32>().ok());
        if pgrp == Some(pgid) && !finished(f.first().copied()) {
            return Some(true);
        }
    }
    Some(false)
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

    /// Sends `sig` to this process if it is still the same process.
    pub fn signal(&self, sig: i32) {
        if !self.alive() {
            return;
        }
        let Ok(p) = libc::pid_t::try_from(self.pid) else {
            return;
        };
        if p <= 1 {
            return;
        }
        // SAFETY: plain syscall on a pid just checked to be this process.
        unsafe {
            libc::kill(p, sig);
        }
    }

    /// Waits (polling) until the process has ended.
    pub async fn ended(&self) {
        while self.alive() {
            tokio::time::sleep(FOREIGN_POLL).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
