//! Stopping a container and the signals that do it: SIGTERM to its process group (and
//! cgroup), the grace, then SIGKILL (under a shim, [`crate::node::shim::KILL_SIGNAL`]);
//! never to a group whose number went to another process ([`pid_reused`]). Signals go
//! through [`crate::node::procs::send_signal`].

use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::Signal;

use super::records::valid_container_id;
use super::table::Phase;
use super::Executor;
use crate::node::procs::{send_signal, ProcessId, SignalTo};
use crate::node::{NodeError, NodeEvent};
use crate::protocol::exit_status;

/// How long processes left behind by a container whose main script already exited get
/// after SIGTERM before SIGKILL (the subreaper shim gives its leftovers the same).
pub(crate) const LEFTOVER_GRACE: Duration = Duration::from_secs(2);

/// How long to wait for a group to vanish after SIGKILL before giving up on it.
pub(super) const KILL_WAIT: Duration = Duration::from_secs(5);

/// How often group liveness is polled.
pub(super) const POLL: Duration = Duration::from_millis(20);

impl Executor {
    /// Stops the container's whole process group: SIGTERM, then SIGKILL after `grace` (to
    /// the group and cgroup; under a shim, [`crate::node::shim::KILL_SIGNAL`] to the shim, which
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
                            cause: None,
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
        signal_own_group(pgid, leader, Signal::SIGTERM);
        cgroup.signal(Signal::SIGTERM);
        if tokio::time::timeout(grace, done.wait_for(|d| *d)).await.is_err() {
            if shim {
                // Never SIGKILL the shim: its descendants would go to init. It kills them
                // all and exits once none is left.
                tracing::info!(
                    container = container_id,
                    "still running after {grace:?}: its shim kills everything in it"
                );
                if !pid_reused(pgid, leader) {
                    let _ = send_signal(SignalTo::Process(pgid), Some(crate::node::shim::KILL_SIGNAL));
                }
            } else {
                tracing::info!(
                    container = container_id,
                    "still running after {grace:?}: SIGKILL to its group and cgroup"
                );
                signal_own_group(pgid, leader, Signal::SIGKILL);
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
}

/// True when a live process other than `leader` now has the leader's pid: the group of
/// that number is then not the container's (see [`container_ended`]). Without a known
/// leader nothing can be told apart, and the group is taken as the container's.
pub(super) fn pid_reused(pgid: u32, leader: Option<ProcessId>) -> bool {
    leader.is_some_and(|l| ProcessId::of(pgid).is_some_and(|now| now.alive() && now != l))
}

/// Sends `sig` to the container's group, unless its number went to another process (a
/// group that is gone is no error).
pub(super) fn signal_own_group(pgid: u32, leader: Option<ProcessId>, sig: Signal) {
    if !pid_reused(pgid, leader) {
        let _ = send_signal(SignalTo::Group(pgid), Some(sig));
    }
}

/// Whether the group still has a live (non-zombie) process.
///
/// `kill(-pgid, 0)` answers "no" precisely; when it says "yes", the members may all be
/// zombies that an init which does not reap orphans keeps forever (containers without a
/// real init), so on Linux `/proc` is checked for a member that is not a zombie.
pub(super) fn group_alive(pgid: u32) -> bool {
    match send_signal(SignalTo::Group(pgid), None) {
        Err(Errno::ESRCH | Errno::EINVAL) => false,
        _ => crate::node::procs::group_has_live_member(pgid).unwrap_or(true),
    }
}

/// Polls until the group has no live process; `false` if `limit` passed first.
pub(super) async fn wait_group_gone(pgid: u32, limit: Duration) -> bool {
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
