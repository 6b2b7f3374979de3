//! The subreaper shim: containment for a node where no cgroup can be created (an
//! unprivileged agent without a delegated cgroup), the third mechanism of
//! [`super::cgroup`] ([`super::cgroup::Mechanism::Subreaper`]).
//!
//! Owns one container's process tree from the inside: it is exec'd as
//! `gpuam container-shim -- bash launch.sh` (a hidden subcommand; a process of its own,
//! never Rust code in a forked child of the multithreaded node), marks itself a child
//! subreaper (`PR_SET_CHILD_SUBREAPER`), and runs the real command as its child with the
//! same stdin, stdout, stderr, directory and environment. Every process the task starts
//! then stays its descendant: one that leaves the session (`setsid`, a double fork,
//! `nohup`) and loses its parent is reparented to the shim, not to init.
//!
//! Protocol with the executor (the shim is the container's recorded process, pid = pgid):
//! - it reaps every child; when the **main child** ends it SIGTERMs every descendant,
//!   waits [`LEFTOVER_GRACE`], SIGKILLs what is left, and exits once it has no child left,
//!   mirroring the main child's status (the same exit code, or the same signal raised on
//!   itself), so the executor's exit handling is the same as without a shim;
//! - **SIGTERM / SIGINT / SIGHUP** (a stop): SIGTERM to every descendant, once; then as
//!   above when the main child ends;
//! - **[`KILL_SIGNAL`]** (SIGUSR1; the executor sends it when its grace has passed):
//!   SIGKILL to every descendant, again and again, until no child is left. A second
//!   SIGTERM does not escalate: `launch.sh`'s own trap sends SIGTERM to its group, which
//!   holds the shim.
//!
//! So the shim exits only when nothing it contains is alive, and the executor's rule
//! "Complete once the shim has exited" is "Complete once the container is empty".
//! Descendants are found by walking `/proc` ([`super::procs::descendants`]): every process
//! whose parent chain reaches the shim.
//!
//! Limits (honest ones): a task running as the shim's user can SIGKILL the shim itself;
//! its descendants then go to the next subreaper or init and escape. A descendant that
//! gains privileges (a setuid program) cannot be signalled by the shim. A kernel without
//! `PR_SET_CHILD_SUBREAPER` (before Linux 3.4) gets a warning and no more than a process
//! group.

use std::ffi::OsString;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use super::procs::{send_signal, SignalTo};

// How long descendants get after SIGTERM once the main child has ended: the executor's
// grace for the leftovers of a cgroup or process group.
use super::executor::LEFTOVER_GRACE;

/// The hidden `gpuam` subcommand that runs the shim.
pub const SUBCOMMAND: &str = "container-shim";
/// The signal that tells the shim to SIGKILL everything it contains now.
pub const KILL_SIGNAL: Signal = Signal::SIGUSR1;
/// How often the shim looks again while it kills.
const TICK: Duration = Duration::from_millis(20);
/// Exit code when the command could not be run (as a shell's "command not found").
pub const CANNOT_RUN: i32 = 127;

/// How the shim's main child ended: the shim ends the same way (the CLI mirrors it,
/// [`end_as_killed_by`] for a signal), so the executor's exit handling is the same as
/// without a shim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShimEnd {
    /// It exited with this code.
    Exited(i32),
    /// It was killed by this signal (number).
    Killed(i32),
    /// Neither (not seen: a bug).
    Unknown,
}

/// Why the shim could not run its command.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    #[error("gpuam {SUBCOMMAND}: no command to run (usage: gpuam {SUBCOMMAND} -- COMMAND [ARGS...])")]
    NoCommand,
    #[error("gpuam {SUBCOMMAND}: cannot run {program}: {error}")]
    CannotRun { program: String, error: std::io::Error },
}

/// Whether process `pid` is a shim (its command line is `<exe> container-shim ...`): a
/// restarted executor re-attaching to a container learns so how to stop it.
pub fn is_shim(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| c.split(|b| *b == 0).nth(1) == Some(SUBCOMMAND.as_bytes()))
}

/// Sends `sig` to every descendant of `root`; how many there were.
fn signal_descendants(root: i32, sig: Signal) -> usize {
    let all = super::procs::descendants(root);
    for &p in &all {
        if let Ok(p) = u32::try_from(p) {
            // A process that is gone meanwhile is no error.
            let _ = send_signal(SignalTo::Process(p), Some(sig));
        }
    }
    all.len()
}

/// The signals the shim takes synchronously (blocked, then waited for).
fn handled_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset initialises the set; sigaddset only sets bits of valid signals.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [
            libc::SIGCHLD,
            libc::SIGTERM,
            libc::SIGINT,
            libc::SIGHUP,
            KILL_SIGNAL as i32,
        ] {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Waits up to `timeout` for one of `set`; the signal, or `None` on timeout or EINTR.
fn wait_signal(set: &libc::sigset_t, timeout: Duration) -> Option<Signal> {
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `set` and `ts` are valid for the call; no siginfo is asked for.
    let s = unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &ts) };
    Signal::try_from(s).ok()
}

/// Runs the shim around `command` (program and arguments) until nothing it contains is
/// alive; how its main child ended (see the module doc). Must run single-threaded, before
/// any runtime starts. Says on stderr (the container's) what containment it gives.
pub fn run(command: &[OsString]) -> Result<ShimEnd, ShimError> {
    let Some((program, args)) = command.split_first() else {
        return Err(ShimError::NoCommand);
    };
    let set = handled_signals();
    // Blocked before the child exists, so that no stop is missed; `Command` gives the
    // child an empty signal mask.
    // SAFETY: plain syscall on a valid set; this process has one thread.
    unsafe {
        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    // SAFETY: plain syscall.
    let subreaper = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } == 0;
    let me = std::process::id() as i32;
    if subreaper {
        eprintln!("gpuam: containment: subreaper shim (pid {me}); every process of this container stays under it");
    } else {
        eprintln!(
            "gpuam: containment: subreaper shim (pid {me}) WITHOUT PR_SET_CHILD_SUBREAPER ({}): processes that \
             leave the session escape",
            std::io::Error::last_os_error()
        );
    }
    let main = match std::process::Command::new(program).args(args).spawn() {
        Ok(c) => c.id() as i32,
        Err(error) => {
            return Err(ShimError::CannotRun {
                program: program.to_string_lossy().into_owned(),
                error,
            })
        }
    };
    let mut main_status: Option<i32> = None;
    let mut stopping = false;
    let mut killing = false;
    let mut deadline: Option<Instant> = None;
    loop {
        // Reap every child that has ended (orphans reparented to the shim included).
        loop {
            let mut st = 0;
            // SAFETY: plain syscall with a valid status pointer.
            let pid = unsafe { libc::waitpid(-1, &mut st, libc::WNOHANG) };
            if pid > 0 {
                if pid == main {
                    main_status = Some(st);
                }
                continue;
            }
            if pid < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            if pid < 0 {
                // ECHILD: nothing is left. The main child is reaped before that can be.
                return Ok(main_status.map_or(ShimEnd::Unknown, end_of));
            }
            break;
        }
        if main_status.is_some() && deadline.is_none() {
            signal_descendants(me, Signal::SIGTERM);
            deadline = Some(Instant::now() + LEFTOVER_GRACE);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            killing = true;
        }
        if killing {
            signal_descendants(me, Signal::SIGKILL);
        }
        let timeout = match deadline {
            _ if killing => TICK,
            Some(d) => d.saturating_duration_since(Instant::now()).max(TICK),
            None => Duration::from_secs(1),
        };
        match wait_signal(&set, timeout) {
            Some(Signal::SIGTERM | Signal::SIGINT | Signal::SIGHUP) if !stopping => {
                stopping = true;
                signal_descendants(me, Signal::SIGTERM);
            }
            Some(KILL_SIGNAL) => killing = true,
            _ => {}
        }
    }
}

/// How a child ended, from its wait status.
fn end_of(status: i32) -> ShimEnd {
    if libc::WIFEXITED(status) {
        ShimEnd::Exited(libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        ShimEnd::Killed(libc::WTERMSIG(status))
    } else {
        ShimEnd::Unknown
    }
}

/// Ends this process by signal `sig` (its default action, no core dump), as the shim's main
/// child ended; returns only if the signal did not end it.
pub fn end_as_killed_by(sig: i32) {
    // SAFETY: plain syscalls on this process: no core file, the signal's default action,
    // every signal unblocked, then the signal itself.
    unsafe {
        let none = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::setrlimit(libc::RLIMIT_CORE, &none);
        libc::signal(sig, libc::SIG_DFL);
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut all);
        libc::sigprocmask(libc::SIG_SETMASK, &all, std::ptr::null_mut());
        libc::raise(sig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The walk finds this test's own grandchild (a `sleep` under a `sh`), and not itself.
    #[test]
    fn finds_this_process_grandchildren_in_proc() {
        let me = std::process::id() as i32;
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(sh.stdout.take().unwrap()), &mut line).unwrap();
        let sleep: i32 = line.trim().parse().unwrap();
        let d = crate::node::procs::descendants(me);
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(sleep), Signal::SIGKILL).unwrap();
        sh.wait().unwrap();
        assert!(d.contains(&(sh.id() as i32)), "{d:?}");
        assert!(d.contains(&sleep), "{d:?}");
        assert!(!d.contains(&me));
        assert!(!is_shim(sh.id()), "sh is no shim");
    }
}
