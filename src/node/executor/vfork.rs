//! Starting a task's process without copying the node's address space (issue 29).
//!
//! `std::process::Command` with a `pre_exec` step forks: the child gets a copy of the
//! node's page tables (every thread's stack, every heap mapping), the parent write-protects
//! all of its memory for copy-on-write, and the exec throws the copy away. In a node (or an
//! RM running simulated nodes) with tens of MiB mapped this cost about 8 ms of wall time
//! per start and most of the RM's CPU in `bench cluster`. Here the child is made with
//! `clone(CLONE_VM | CLONE_VFORK)`, as glibc's `posix_spawn` does: it runs on a stack of
//! its own in the parent's memory while the calling thread waits, takes its steps with
//! plain system calls on data prepared before, and execs; nothing is copied.
//!
//! The child's steps, in order (any failure: the errno goes back through shared memory and
//! the child exits 127 without exec): every caught signal back to its default (the
//! parent's handlers must never run in the child), the standard streams, the working
//! directory, a new session, joining the container's cgroups, the private `/dev`
//! ([`PrivateDev::enter`]), the task's groups, gid and uid (raw system calls: glibc's
//! wrappers would signal the parent's threads to change theirs too), an empty signal mask,
//! `execve`. Signals are blocked in the calling thread around the clone, so none arrives in
//! the child before its handlers are reset.
//!
//! [`Spawned::wait`] waits for the exit through a pidfd (readable once the process has
//! ended), so no thread is held per running task; the process is this node's child until
//! then, so its pid cannot be reused under the pidfd.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::atomic::{AtomicI32, Ordering};

use tokio::io::unix::AsyncFd;

use crate::node::devices::PrivateDev;

/// What the child is made of, all prepared before the clone.
pub struct Plan<'a> {
    /// The program, as given: a path, or a name looked up in `PATH`.
    pub program: &'a OsStr,
    /// The arguments after the program's name.
    pub args: &'a [std::ffi::OsString],
    /// The whole environment.
    pub env: &'a [(String, String)],
    pub cwd: &'a Path,
    /// The standard input; `/dev/null` when none.
    pub stdin: Option<RawFd>,
    pub stdout: RawFd,
    pub stderr: RawFd,
    /// `cgroup.procs` files the child writes itself into.
    pub cgroup_procs: &'a [CString],
    pub private_dev: Option<&'a PrivateDev>,
    /// uid, gid and supplementary groups to become.
    pub ids: Option<(libc::uid_t, libc::gid_t, &'a [libc::gid_t])>,
}

/// The child's data: pointers into the parent's memory, valid while the parent waits.
struct Child<'a> {
    /// The paths `execve` tries in order (`execvp`'s search, as the task's user).
    paths: Vec<CString>,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    cwd: CString,
    fds: [RawFd; 3],
    procs: &'a [CString],
    dev: Option<&'a PrivateDev>,
    ids: Option<(libc::uid_t, libc::gid_t, &'a [libc::gid_t])>,
    /// The errno of the step that failed (0: none); written by the child, read by the
    /// parent after the clone returned.
    error: AtomicI32,
}

/// A started process, this node's child until [`Spawned::wait`] has reaped it.
pub struct Spawned {
    pid: libc::pid_t,
    pidfd: Option<AsyncFd<OwnedFd>>,
    reaped: bool,
}

const STACK: usize = 256 * 1024;

/// Starts the process; its pid once it has exec'd. Needs a tokio runtime (the pidfd is
/// registered with it).
pub fn spawn(plan: &Plan<'_>) -> io::Result<Spawned> {
    let cstr = |b: &[u8]| CString::new(b).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte"));
    let paths = candidates(plan.program, plan.env)
        .iter()
        .map(|p| cstr(p.as_os_str().as_bytes()))
        .collect::<io::Result<Vec<_>>>()?;
    let mut strings = vec![cstr(plan.program.as_bytes())?];
    for a in plan.args {
        strings.push(cstr(a.as_bytes())?);
    }
    let env: Vec<CString> = plan
        .env
        .iter()
        .map(|(k, v)| cstr(format!("{k}={v}").as_bytes()))
        .collect::<io::Result<_>>()?;
    let nul_ended = |v: &[CString]| v.iter().map(|s| s.as_ptr()).chain([std::ptr::null()]).collect();
    // Standard streams from fds above 2, so that placing one cannot overwrite another.
    let null = std::fs::File::open("/dev/null")?;
    let high = |fd: RawFd| -> io::Result<OwnedFd> {
        // SAFETY: duplicating a descriptor this process holds; the copy is owned here.
        let d = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
        if d < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `d` is a new descriptor nobody else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(d) })
    };
    let streams = [
        high(plan.stdin.unwrap_or(null.as_raw_fd()))?,
        high(plan.stdout)?,
        high(plan.stderr)?,
    ];
    let child = Child {
        paths,
        argv: nul_ended(&strings),
        envp: nul_ended(&env),
        cwd: cstr(plan.cwd.as_os_str().as_bytes())?,
        fds: [streams[0].as_raw_fd(), streams[1].as_raw_fd(), streams[2].as_raw_fd()],
        procs: plan.cgroup_procs,
        dev: plan.private_dev,
        ids: plan.ids,
        error: AtomicI32::new(0),
    };
    let mut stack = vec![0u8; STACK];
    // SAFETY: the child runs `child_main` on `stack` in this process's memory while this
    // thread is suspended (CLONE_VFORK) until it execs or exits; everything it reads
    // (`child`, the strings it points to, the stack) lives until then. All signals are
    // blocked meanwhile in this thread and restored after.
    let pid = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let top = stack.as_mut_ptr().add(STACK) as usize & !15;
        let pid = libc::clone(
            child_main,
            top as *mut libc::c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            std::ptr::from_ref(&child).cast_mut().cast(),
        );
        let clone_error = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        if pid < 0 {
            return Err(clone_error);
        }
        pid
    };
    drop(stack);
    let errno = child.error.load(Ordering::SeqCst);
    if errno != 0 {
        // It exited without exec: reap it.
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        return Err(io::Error::from_raw_os_error(errno));
    }
    // SAFETY: plain syscall; the pid is our unreaped child.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let pidfd = match RawFd::try_from(fd) {
        Ok(fd) if fd >= 0 && tokio::runtime::Handle::try_current().is_ok() => {
            // SAFETY: a new descriptor nobody else owns.
            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: the `OwnedFd` stays open, the same descriptor, as long as the
            // `AsyncFd` that owns it (a runtime is current: checked above).
            Some(unsafe { AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE)? })
        }
        _ => None,
    };
    Ok(Spawned {
        pid,
        pidfd,
        reaped: false,
    })
}

impl Spawned {
    pub fn id(&self) -> u32 {
        self.pid.unsigned_abs()
    }

    /// Waits until the process has ended and reaps it.
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        if self.reaped {
            return Err(io::Error::other("the process was already waited for"));
        }
        match &self.pidfd {
            Some(fd) => loop {
                let mut ready = fd.readable().await?;
                if let Some(st) = reap(self.pid)? {
                    self.reaped = true;
                    return Ok(st);
                }
                ready.clear_ready();
            },
            // A kernel without pidfds (before 5.3): a blocking thread waits.
            None => {
                let pid = self.pid;
                let status = tokio::task::spawn_blocking(move || {
                    let mut status = 0;
                    // SAFETY: waiting for our own child.
                    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
                    if r < 0 {
                        Err(io::Error::last_os_error())
                    } else {
                        Ok(status)
                    }
                })
                .await
                .map_err(io::Error::other)??;
                self.reaped = true;
                Ok(ExitStatus::from_raw(status))
            }
        }
    }
}

/// The exit of our child `pid` if it has ended (reaped), without blocking.
fn reap(pid: libc::pid_t) -> io::Result<Option<ExitStatus>> {
    let mut status = 0;
    // SAFETY: waiting for our own child, without blocking.
    match unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } {
        0 => Ok(None),
        r if r < 0 => Err(io::Error::last_os_error()),
        _ => Ok(Some(ExitStatus::from_raw(status))),
    }
}

/// The paths `execve` tries: a name with a `/` as it is, else the name in each directory
/// of the task's `PATH` (the node's when the task has none), as `execvp` would. Only text
/// here: the search itself runs in the child, as the task's user, so the node never looks
/// through a directory the task may have written (a symlink there) with its own rights.
fn candidates(program: &OsStr, env: &[(String, String)]) -> Vec<PathBuf> {
    if program.as_bytes().contains(&b'/') {
        return vec![PathBuf::from(program)];
    }
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| std::ffi::OsString::from(v))
        .or_else(|| std::env::var_os("PATH"))
        .unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    std::env::split_paths(&path)
        .map(|d| {
            if d.as_os_str().is_empty() {
                PathBuf::from(".")
            } else {
                d
            }
        })
        .map(|d| d.join(program))
        .collect()
}

/// The child, before `execve`. Only system calls on prepared data: nothing allocated, no
/// lock taken, nothing that can unwind.
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the parent's `Child`, alive and unchanged while the parent waits.
    let c: &Child<'_> = unsafe { &*(arg as *const Child<'_>) };
    // SAFETY: system calls on the prepared data.
    let errno = unsafe { child_steps(c) };
    c.error.store(errno.max(1), Ordering::SeqCst);
    // SAFETY: ends the child at once (no atexit handlers, no flush of the parent's buffers).
    unsafe { libc::_exit(127) }
}

/// The steps; returns the errno of the one that failed (`execve` returns only then).
unsafe fn child_steps(c: &Child<'_>) -> i32 {
    let errno = || io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
    // Caught signals back to their default; ignored ones stay ignored, as exec keeps them,
    // except SIGPIPE, which this runtime ignores and a task expects at its default.
    // (Linux numbers signals 1 to 64; glibc's `sigaction` is a thin wrapper of the call.)
    for sig in 1..=64 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(sig, std::ptr::null(), &mut old) != 0 {
            continue;
        }
        if old.sa_sigaction != libc::SIG_DFL && (old.sa_sigaction != libc::SIG_IGN || sig == libc::SIGPIPE) {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(sig, &dfl, std::ptr::null_mut());
        }
    }
    for (target, fd) in c.fds.iter().enumerate() {
        if libc::dup2(*fd, target as RawFd) < 0 {
            return errno();
        }
    }
    // Nothing else of the node's reaches the task: every other descriptor closes at exec,
    // also one the node inherited without close-on-exec from whoever started it (a shell's
    // `exec 9<secret`, a wrapper's pipe). Before Linux 5.11 the call fails; the node then
    // relies on `crate::node::procs::close_inherited_at_exec`, done at its start.
    libc::syscall(
        libc::SYS_close_range,
        c.fds.len() as libc::c_uint,
        libc::c_uint::MAX,
        libc::CLOSE_RANGE_CLOEXEC,
    );
    if libc::chdir(c.cwd.as_ptr()) != 0 {
        return errno();
    }
    if libc::setsid() == -1 {
        return errno();
    }
    for path in c.procs {
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return errno();
        }
        let n = libc::write(fd, b"0\n".as_ptr().cast(), 2);
        let e = errno();
        libc::close(fd);
        if n < 0 {
            return e;
        }
    }
    if let Some(dev) = c.dev {
        if let Err(e) = dev.enter() {
            return e.raw_os_error().unwrap_or(libc::EIO);
        }
    }
    if let Some((uid, gid, groups)) = c.ids {
        if libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) != 0
            || libc::syscall(libc::SYS_setresgid, gid, gid, gid) != 0
            || libc::syscall(libc::SYS_setresuid, uid, uid, uid) != 0
        {
            return errno();
        }
    }
    let mut empty: libc::sigset_t = std::mem::zeroed();
    libc::sigemptyset(&mut empty);
    libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
    // `execvp`'s search: the first that runs; a name not found in one directory (or one
    // this user may not enter) is looked for in the next; no execute permission anywhere
    // is EACCES, else the last error.
    let mut denied = false;
    let mut last = libc::ENOENT;
    for path in &c.paths {
        libc::execve(path.as_ptr(), c.argv.as_ptr(), c.envp.as_ptr());
        last = errno();
        match last {
            libc::EACCES => denied = true,
            libc::ENOENT
            | libc::ENOTDIR
            | libc::ENAMETOOLONG
            | libc::ELOOP
            | libc::ESTALE
            | libc::ENODEV
            | libc::ETIMEDOUT => {}
            _ => return last,
        }
    }
    if denied {
        libc::EACCES
    } else {
        last
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read as _, Seek as _};

    fn plan<'a>(
        program: &'a OsStr,
        args: &'a [std::ffi::OsString],
        env: &'a [(String, String)],
        out: &std::fs::File,
        cwd: &'a Path,
    ) -> Plan<'a> {
        Plan {
            program,
            args,
            env,
            cwd,
            stdin: None,
            stdout: std::os::fd::AsRawFd::as_raw_fd(out),
            stderr: std::os::fd::AsRawFd::as_raw_fd(out),
            cgroup_procs: &[],
            private_dev: None,
            ids: None,
        }
    }

    /// Whether this test runs as root (the user switch needs it; CI runs as root), said
    /// when not.
    fn root() -> bool {
        // SAFETY: plain syscall.
        let root = unsafe { libc::geteuid() } == 0;
        if !root {
            eprintln!("skipped: needs root (the switch of user cannot be tried here)");
        }
        root
    }

    /// Everything written to `out` so far.
    fn written(out: &mut std::fs::File) -> String {
        let mut text = String::new();
        out.rewind().unwrap();
        out.read_to_string(&mut text).unwrap();
        text
    }

    /// The child runs in its directory with exactly its environment and streams, leads a
    /// session of its own, has no handler, no blocked signal and SIGPIPE at its default
    /// (the parent's runtime catches and ignores signals); the exit is reaped.
    #[tokio::test]
    async fn the_child_gets_its_streams_directory_environment_session_and_clean_signals() {
        // A handler of this process's (SIGUSR1, through tokio) that the child must not keep.
        let _usr1 = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut out = tempfile::tempfile().unwrap();
        let script = "echo \"$PWD $GREETING ${HOME:-nohome}\"; ps -o sid= -p $$ | tr -d ' '; echo $$; \
                      exec cat /proc/self/status";
        let args: Vec<std::ffi::OsString> = vec!["-c".into(), script.into()];
        let env = vec![
            ("GREETING".to_string(), "hello world".to_string()),
            ("PATH".to_string(), "/usr/bin:/bin".to_string()),
        ];
        let mut child = spawn(&plan(OsStr::new("sh"), &args, &env, &out, dir.path())).unwrap();
        assert_eq!(child.wait().await.unwrap().code(), Some(0));
        let text = written(&mut out);
        let lines: Vec<&str> = text.lines().collect();
        let cwd = std::fs::canonicalize(dir.path()).unwrap();
        assert_eq!(lines[0], format!("{} hello world nohome", cwd.display()), "{text}");
        // A session leader: its session id is its pid.
        assert_eq!(lines[1], lines[2], "{text}");
        let field = |name: &str| {
            let l = lines
                .iter()
                .find(|l| l.starts_with(name))
                .unwrap_or_else(|| panic!("no {name}: {text}"));
            u64::from_str_radix(l[name.len()..].trim(), 16).unwrap()
        };
        // `cat` (exec'd by the shell, as it was made) catches nothing, blocks nothing, and
        // SIGPIPE (13) is not ignored.
        assert_eq!(field("SigBlk:"), 0, "{text}");
        assert_eq!(field("SigCgt:"), 0, "{text}");
        assert_eq!(field("SigIgn:") & (1 << 12), 0, "{text}");
        // The exit status comes back as it was.
        let args: Vec<std::ffi::OsString> = vec!["-c".into(), "exit 7".into()];
        let mut child = spawn(&plan(OsStr::new("sh"), &args, &env, &out, dir.path())).unwrap();
        assert_eq!(child.wait().await.unwrap().code(), Some(7));
        assert!(child.wait().await.is_err(), "waited twice");
    }

    /// A program that cannot be run is an error at once, naming why.
    #[tokio::test]
    async fn a_program_that_cannot_run_is_an_error_naming_why() {
        let dir = tempfile::tempdir().unwrap();
        let out = tempfile::tempfile().unwrap();
        let env = vec![("PATH".to_string(), "/usr/bin:/bin".to_string())];
        let e = spawn(&plan(OsStr::new("no-such-program-here"), &[], &env, &out, dir.path()))
            .err()
            .unwrap();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
        // Found, but the directory is gone: the child's chdir fails and it exits unrun.
        let gone = dir.path().join("gone");
        let e = spawn(&plan(OsStr::new("/bin/true"), &[], &env, &out, &gone))
            .err()
            .unwrap();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "{e}");
    }

    /// As root: the program is looked for on `PATH` by the child, as the task's user: a
    /// directory only root may enter is passed over for the next one (a search by the
    /// node, with root's rights, would have picked the hidden program, or failed).
    #[tokio::test]
    async fn the_path_search_runs_as_the_tasks_user() {
        if !root() {
            return;
        }
        use std::os::unix::fs::PermissionsExt as _;
        let base = tempfile::tempdir().unwrap();
        std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let (hidden, open) = (base.path().join("hidden"), base.path().join("open"));
        for (d, mode, word) in [(&hidden, 0o700, "hidden"), (&open, 0o755, "open")] {
            std::fs::create_dir(d).unwrap();
            let probe = d.join("gpuam-probe");
            std::fs::write(&probe, format!("#!/bin/sh\necho {word}\n")).unwrap();
            std::fs::set_permissions(&probe, std::fs::Permissions::from_mode(0o755)).unwrap();
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        let mut out = tempfile::tempfile().unwrap();
        let env = vec![(
            "PATH".to_string(),
            format!("{}:{}:/usr/bin:/bin", hidden.display(), open.display()),
        )];
        let mut p = plan(OsStr::new("gpuam-probe"), &[], &env, &out, base.path());
        p.ids = Some((64_000, 64_000, &[]));
        let mut child = spawn(&p).unwrap();
        assert_eq!(child.wait().await.unwrap().code(), Some(0));
        let text = written(&mut out);
        assert_eq!(text.trim(), "open");
        // With only the hidden one on PATH: denied, as `execvp` says it.
        let env = vec![("PATH".to_string(), hidden.display().to_string())];
        let mut p = plan(OsStr::new("gpuam-probe"), &[], &env, &out, base.path());
        p.ids = Some((64_000, 64_000, &[]));
        let e = spawn(&p).err().unwrap();
        assert_eq!(e.raw_os_error(), Some(libc::EACCES), "{e}");
    }

    /// As root: the child becomes the given uid, gid and groups, all of them (real,
    /// effective, saved), before it runs.
    #[tokio::test]
    async fn the_child_runs_as_the_given_user_and_groups() {
        if !root() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
        let mut out = tempfile::tempfile().unwrap();
        let args: Vec<std::ffi::OsString> = vec!["-c".into(), "grep -E '^(Uid|Gid|Groups)' /proc/self/status".into()];
        let env = vec![("PATH".to_string(), "/usr/bin:/bin".to_string())];
        let groups = [64_001, 64_002];
        let mut p = plan(OsStr::new("sh"), &args, &env, &out, dir.path());
        p.ids = Some((64_000, 64_003, &groups));
        let mut child = spawn(&p).unwrap();
        assert_eq!(child.wait().await.unwrap().code(), Some(0));
        let text = written(&mut out);
        let norm: Vec<String> = text
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(
            norm,
            vec![
                "Uid: 64000 64000 64000 64000".to_string(),
                "Gid: 64003 64003 64003 64003".to_string(),
                "Groups: 64001 64002".to_string()
            ],
            "{text}"
        );
    }
}
