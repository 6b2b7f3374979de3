//! Holding a task's commands back until its process is recorded.
//!
//! Owns the hold: a socket pair whose one end is the new process's stdin, and the check that
//! reads one line from it and lets the task run only when the line is [`GO`], written by the
//! node ([`Hold::release`]) once `process.json` is on disk. Where the program is bash
//! running the node's `launch.sh` on the host, the check is the script's first lines
//! ([`script_lines`]: no process more); else (an image's runtime) a `/bin/sh` step in front
//! of the program runs it in place once let ([`held_argv`]). Either way the task's stdin is
//! `/dev/null` again before its commands.
//!
//! Why: a task that ran before its record was written could not be found again by a node
//! that restarts in that moment; the restarted node ended what it left and the job ran it a
//! second time (docs/RELIABILITY.md). Held, the commands run only once the record exists.
//! Where the record cannot be written, or the node dies first, the node's end closes
//! unwritten (it is close-on-exec, so no other process holds it), the step reads an end of
//! file and exits [`HELD_EXIT`] without running anything, saying why on the task's stderr.
//!
//! Nothing here is the task's: the check's text is a constant, `/bin/sh` is the node's, and
//! it runs as the task's user after every other step of the spawn (session, cgroup, ids).

use std::ffi::OsString;
use std::os::fd::{FromRawFd as _, OwnedFd};

/// The line that lets a held task run.
const GO: &str = "run";

/// What a held task exits with when it was never let run: the AM's "transient failure"
/// (`am::exits`), so the task is tried again, on this node or another.
pub const HELD_EXIT: i32 = 154;

/// What the step says on the task's stderr when the task never ran.
const NEVER_RAN: &str =
    "gpuam: the node could not record this task before it ran (it stopped or its disk failed), so nothing of the task ran";

/// The check: reads the line; anything else (an end of file) exits [`HELD_EXIT`].
fn check() -> String {
    format!(
        "IFS= read -r __gpuam_go; if [ \"$__gpuam_go\" != {GO} ]; then printf '%s\\n' '{NEVER_RAN}' >&2; exit {HELD_EXIT}; fi"
    )
}

/// The first lines of a held `launch.sh` (sh and bash alike).
pub fn script_lines() -> String {
    format!("{}\nexec </dev/null\n", check())
}

/// The node's end: the held process runs once [`Hold::release`] has written [`GO`];
/// dropped unwritten, it never runs its program.
#[derive(Debug)]
pub struct Hold(OwnedFd);

impl Hold {
    /// Lets the held process run. An error means it will not (it has already ended). Never
    /// a signal, whatever the process's SIGPIPE disposition (gpuam's short-lived commands
    /// take its default action, which a write to a pipe whose reader is gone kills with):
    /// this end is a socket written with `MSG_NOSIGNAL`.
    pub fn release(self) -> std::io::Result<()> {
        let line = format!("{GO}\n");
        // SAFETY: a send on a socket this value owns, from a buffer that lives across it.
        let n = unsafe {
            libc::send(
                std::os::fd::AsRawFd::as_raw_fd(&self.0),
                line.as_ptr().cast(),
                line.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        match usize::try_from(n) {
            Ok(n) if n == line.len() => Ok(()),
            Ok(_) => Err(std::io::Error::other("the release was cut short")),
            Err(_) => Err(std::io::Error::last_os_error()),
        }
    }
}

/// A new hold: the end for the process's stdin, and the end the node keeps (a connected
/// pair of Unix stream sockets: a shell reads its stdin from one as from a pipe). Both are
/// close-on-exec: the first becomes the child's stdin by `dup2` (which clears the flag on
/// the copy), and no other child the node starts can inherit the node's end.
pub fn new() -> std::io::Result<(OwnedFd, Hold)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` is two ints, filled by the call on success.
    if unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    } != 0
    {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors are new and owned by nobody else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // The task's end only reads: a task cannot write back into the node's end.
    // SAFETY: plain syscall on a descriptor owned here.
    unsafe { libc::shutdown(fds[0], libc::SHUT_WR) };
    Ok((read, Hold(write)))
}

/// `argv` (program first) behind the hold's step: `/bin/sh -c STEP gpuam-hold argv...`, the
/// program run in place (same pid) once let.
pub fn held_argv(argv: Vec<OsString>) -> Vec<OsString> {
    let step = format!("{}; exec \"$@\" </dev/null", check());
    let mut held: Vec<OsString> = vec!["/bin/sh".into(), "-c".into(), step.into(), "gpuam-hold".into()];
    held.extend(argv);
    held
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd as _;

    use super::*;

    /// The two forms of the hold: the step in front of a program, and a held script's first
    /// lines (run by bash, as `launch.sh` is on the host).
    #[derive(Clone, Copy, Debug)]
    enum Form {
        Step,
        Script,
    }

    /// Starts `SCRIPT` held in `form`, in `dir`, the way the executor does; its stderr in `dir/err`.
    fn start_held(dir: &std::path::Path, form: Form, script: &str) -> (super::super::vfork::Spawned, Hold) {
        let (stdin, hold) = new().unwrap();
        let err = std::fs::File::create(dir.join("err")).unwrap();
        let mut argv = match form {
            Form::Step => held_argv(vec!["sh".into(), "-c".into(), script.into()]),
            Form::Script => vec!["bash".into(), "-c".into(), format!("{}{script}", script_lines()).into()],
        };
        let program = argv.remove(0);
        let env = vec![("PATH".to_string(), "/usr/bin:/bin".to_string())];
        let plan = super::super::vfork::Plan {
            program: &program,
            args: &argv,
            env: &env,
            cwd: dir,
            stdin: Some(stdin.as_raw_fd()),
            stdout: err.as_raw_fd(),
            stderr: err.as_raw_fd(),
            cgroup_procs: &[],
            private_dev: None,
            ids: None,
        };
        let child = super::super::vfork::spawn(&plan).unwrap();
        (child, hold)
    }

    #[tokio::test]
    async fn a_held_task_runs_its_program_only_once_released() {
        for form in [Form::Step, Form::Script] {
            let tmp = tempfile::tempdir().unwrap();
            // The program also checks that the hold's pipe is gone from its stdin.
            let (mut child, hold) = start_held(tmp.path(), form, "touch ran; cat > stdin-seen");
            // Held: however long it waits, its program has not run.
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            assert!(
                !tmp.path().join("ran").exists(),
                "{form:?}: the program ran before its release"
            );
            hold.release().unwrap();
            let status = child.wait().await.unwrap();
            let err = std::fs::read_to_string(tmp.path().join("err")).unwrap();
            assert_eq!(status.code(), Some(0), "{form:?}: {err}");
            assert!(tmp.path().join("ran").exists(), "{form:?}: released, the program ran");
            assert_eq!(
                std::fs::read(tmp.path().join("stdin-seen")).unwrap(),
                b"",
                "{form:?}: stdin is /dev/null"
            );
        }
    }

    #[tokio::test]
    async fn a_hold_dropped_unreleased_never_lets_the_program_run() {
        for form in [Form::Step, Form::Script] {
            let tmp = tempfile::tempdir().unwrap();
            let (mut child, hold) = start_held(tmp.path(), form, "touch ran");
            // What a node that dies before recording the process leaves: the write end closed.
            drop(hold);
            let status = child.wait().await.unwrap();
            assert_eq!(status.code(), Some(HELD_EXIT), "{form:?}");
            assert!(!tmp.path().join("ran").exists(), "{form:?}: the program ran unreleased");
            let err = std::fs::read_to_string(tmp.path().join("err")).unwrap();
            assert!(err.contains(NEVER_RAN), "{form:?}: the task's stderr says why: {err:?}");
        }
    }

    #[tokio::test]
    async fn a_release_after_the_process_ended_is_an_error_not_a_signal() {
        let tmp = tempfile::tempdir().unwrap();
        let (mut child, hold) = start_held(tmp.path(), Form::Step, "true");
        // The held step killed (as a stop would) before its release.
        // SAFETY: plain syscall on our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) };
        child.wait().await.unwrap();
        // In a process that takes SIGPIPE's default action, as gpuam's servers do (a test
        // process ignores it): a forked copy releases, and must live to say it failed.
        // SAFETY: the child only makes system calls and exits; it touches no lock.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
            let code = if hold.release().is_err() { 0 } else { 1 };
            unsafe { libc::_exit(code) };
        }
        drop(hold);
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the release killed its process or did not fail (wait status {status:#x})"
        );
    }
}
