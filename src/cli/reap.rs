//! `gpuam run`'s reaper: what ends a run's AM and tasks when the run itself is killed.
//!
//! `gpuam run` holds its RM, its executor and its AM's parent in one process, with no
//! store: a run killed with SIGKILL could not be taken up again, and it left its AM (24 h
//! of dashboard linger) and its tasks running, on GPUs that a second run then granted
//! again. So a run starts a reaper first ([`Reaper::start`]): a process of its own
//! process group (a terminal's signals to the run's group do not reach it) that waits on a
//! socket whose other end only the run holds ([`crate::node::executor::hold`]). A run that
//! ends by itself lets it go ([`Reaper::done`], or when dropped); a run that dies closes
//! its end, and the reaper ([`reap`]) kills every AM process recorded in the work dir
//! (`am.process`), every task process group recorded there (`process.json`, checked by
//! its start time), what the in-process node's cgroups still hold, and removes the
//! emptied cgroups. A task without a cgroup runs under the subreaper shim
//! ([`crate::node::shim`]), which adopts what leaves its session (a `setsid` daemon): the
//! shim is told to kill everything it holds ([`crate::node::shim::KILL_SIGNAL`]) and
//! given [`SHIM_GRACE`] to do it before its group is killed; what it held (read from /proc
//! before, checked by start time) is killed by pid should the shim not end it. A SIGKILL to
//! the shim's group alone killed the shim and set its daemons free (to init), still
//! holding the GPUs that the next run granted again.
//!
//! A run killed together with its reaper (a kill of every process of a session, of both
//! pids, of a unit whose tasks' cgroups lie elsewhere) leaves nobody to reap. So the run
//! writes its own process (pid and start time) into its work dir ([`RUN_PROCESS_FILE`]),
//! removed once it ends by itself, and each later run first sweeps ([`sweep`]): every
//! earlier run's work dir under the temporary directory (`gpuam-run-*`) and the work dir
//! it is given, that is this user's own and not writable by others, and whose run is no
//! longer alive, is reaped as its reaper would have, before anything is granted.

use std::io::BufRead as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::node::executor::{hold, record_id, PROCESS_FILE};
use crate::node::procs::{send_signal, ProcessId, SignalTo};

/// How long a task's subreaper shim gets to end its whole tree once told to.
const SHIM_GRACE: Duration = Duration::from_secs(5);

/// The hidden subcommand the reaper runs as (`Cmd::ReapRun`).
const SUBCOMMAND: &str = "reap-run";

/// The run's own process (pid and start time, JSON) in its work dir while it runs.
pub const RUN_PROCESS_FILE: &str = "run.process";

/// The name of a default work dir: `<temporary directory>/gpuam-run-<random>`.
pub const WORK_DIR_PREFIX: &str = "gpuam-run-";

/// A run's reaper, from the run's side.
pub struct Reaper(Option<hold::Hold>);

impl Reaper {
    /// Starts the reaper of the run whose work dir is `work_dir` (canonical, as the RM
    /// names its cgroups after it).
    pub fn start(work_dir: &Path) -> std::io::Result<Reaper> {
        use std::os::unix::process::CommandExt as _;
        // Who runs here, for a later run to tell whether this one is still alive.
        let me = ProcessId::of(std::process::id())
            .ok_or_else(|| std::io::Error::other("cannot read this process's start time"))?;
        crate::node::executor::create_new_in(work_dir, RUN_PROCESS_FILE, &serde_json::to_vec(&me)?, None)?;
        let (theirs, ours) = hold::new()?;
        std::process::Command::new(std::env::current_exe()?)
            .arg(SUBCOMMAND)
            .arg(work_dir)
            .stdin(std::process::Stdio::from(theirs))
            .stdout(std::process::Stdio::null())
            .process_group(0)
            .spawn()?;
        Ok(Reaper(Some(ours)))
    }

    /// The run at `work_dir` ended by itself (its job and tasks are stopped): the reaper
    /// goes, and no later run needs to sweep here.
    pub fn done(mut self, work_dir: &Path) {
        if let Some(h) = self.0.take() {
            let _ = h.release();
        }
        let _ = std::fs::remove_file(work_dir.join(RUN_PROCESS_FILE));
    }
}

/// Reaps what earlier runs killed together with their reapers left: each directory
/// `gpuam-run-*` directly in `temp_root` and `also` (a work dir given by name), where
/// [`sweep_one`] finds a dead run. Returns each swept directory with how many processes
/// or groups were signalled there (directories where nothing was left alive are swept
/// too, and listed with 0).
pub fn sweep(temp_root: &Path, also: Option<&Path>) -> Vec<(PathBuf, usize)> {
    let named = std::fs::read_dir(temp_root)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(WORK_DIR_PREFIX))
        .map(|e| e.path());
    let mut seen = Vec::new();
    let mut out = Vec::new();
    for dir in named.chain(also.map(Path::to_path_buf)) {
        let key = std::fs::canonicalize(&dir).unwrap_or_else(|_| dir.clone());
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        if let Some(n) = sweep_one(&dir) {
            out.push((dir, n));
        }
    }
    out
}

/// Reaps the work dir `dir` of an earlier run that is no longer alive: only where `dir`
/// is a directory (not a link) of this process's user, not writable by group or others
/// (what is recorded there was written by this user's run alone), reached only through
/// directories of root's or this user's that nobody else can rename entries in
/// ([`crate::node::identity::check_owned_path`]: so no name on the way can be swapped for
/// a link between this check and the reads of the records below), and holds a
/// [`RUN_PROCESS_FILE`] naming a process that is no longer the same one. The file goes
/// once reaped. `None` where there is nothing to sweep.
pub fn sweep_one(dir: &Path) -> Option<usize> {
    // Not a link (a link of this user's to another of its directories would sweep that one
    // under this name); owner and modes are `check_owned_path`'s.
    if !std::fs::symlink_metadata(dir).ok()?.is_dir() {
        return None;
    }
    crate::node::identity::check_owned_path(dir).ok()?;
    let file = dir.join(RUN_PROCESS_FILE);
    let text = crate::node::executor::read_small_in_place(&file, 4096).ok()?;
    let run: ProcessId = serde_json::from_slice(&text).ok()?;
    if run.alive() {
        return None;
    }
    let n = reap(dir);
    let _ = std::fs::remove_file(&file);
    Some(n)
}

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            let _ = h.release();
        }
    }
}

/// The reaper's side: waits for the run's word on stdin; none (the run died) reaps.
pub fn run(work_dir: &Path) -> i32 {
    let mut line = String::new();
    let said = std::io::stdin().lock().read_line(&mut line).is_ok_and(|n| n > 0);
    if said {
        return 0;
    }
    let killed = reap(work_dir);
    let _ = std::fs::remove_file(work_dir.join(RUN_PROCESS_FILE));
    eprintln!(
        "gpuam run died: its reaper ended {killed} process(es) of it ({})",
        work_dir.display()
    );
    0
}

/// Kills what the run at `work_dir` left: its AMs, its tasks' process groups, what its
/// cgroups hold; removes the cgroups. Returns how many processes or groups it signalled.
pub fn reap(work_dir: &Path) -> usize {
    let mut killed = 0;
    let kill = |p: ProcessId, group: bool| {
        if !p.alive() {
            return false;
        }
        let to = if group {
            SignalTo::Group(p.pid)
        } else {
            SignalTo::Process(p.pid)
        };
        send_signal(to, Some(nix::sys::signal::Signal::SIGKILL)).is_ok()
    };
    let read = |path: PathBuf| -> Option<ProcessId> {
        let text = crate::node::executor::read_small_in_place(&path, 4096).ok()?;
        serde_json::from_slice(&text).ok()
    };
    // The AMs first, so that none asks for more.
    for app in entries(work_dir) {
        if let Some(p) = read(app.join(crate::rm::AM_PROCESS_FILE)) {
            killed += usize::from(kill(p, false));
        }
    }
    let containment = crate::node::cgroup::Containment::detect(&crate::rm::in_process_cgroups(work_dir));
    let mut cgroups = Vec::new();
    for record in entries(&work_dir.join("containers")) {
        if let Some(p) = read(record.join(PROCESS_FILE)) {
            if p.alive() && crate::node::shim::is_shim(p.pid) {
                killed += end_shim_tree(p);
            }
            killed += usize::from(kill(p, true));
        }
        let name = record
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if let Some(id) = record_id(&name) {
            let cg = containment.cgroup(id);
            cg.kill();
            cgroups.push(cg);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while cgroups.iter().any(|c| !c.is_empty()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    for c in &cgroups {
        c.remove();
    }
    containment.remove_parents();
    killed
}

/// Ends everything task shim `shim` holds (its descendants: the task, and daemons that
/// left its session and were adopted by it): tells the shim to SIGKILL them
/// ([`crate::node::shim::KILL_SIGNAL`]; it does so until it has no child left, then exits),
/// waits up to [`SHIM_GRACE`], then SIGKILLs by pid each process of the tree read from
/// /proc before that is still the same process (its start time), should the shim not have
/// ended it (a stopped shim, or one killed meanwhile). Returns how many of them there were.
fn end_shim_tree(shim: ProcessId) -> usize {
    use crate::node::procs::descendants;
    let Ok(root) = i32::try_from(shim.pid) else {
        return 0;
    };
    let held: Vec<ProcessId> = descendants(root)
        .into_iter()
        .filter_map(|p| u32::try_from(p).ok())
        .filter_map(ProcessId::of)
        .collect();
    // Read while the shim was alive: every one of them was its descendant.
    if !shim.alive() {
        return 0;
    }
    let _ = send_signal(SignalTo::Process(shim.pid), Some(crate::node::shim::KILL_SIGNAL));
    let deadline = Instant::now() + SHIM_GRACE;
    while shim.alive() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    for p in &held {
        if p.alive() {
            let _ = send_signal(SignalTo::Process(p.pid), Some(nix::sys::signal::Signal::SIGKILL));
        }
    }
    held.len()
}

/// The directories directly in `dir` (not through links).
fn entries(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    /// A process that has ended (a child run and waited for), as its record names it.
    fn dead_process() -> ProcessId {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let p = ProcessId::of(child.id()).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        p
    }

    fn run_dir(root: &Path, name: &str, run: ProcessId) -> PathBuf {
        let d = root.join(name);
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        crate::node::executor::create_new_in(&d, RUN_PROCESS_FILE, &serde_json::to_vec(&run).unwrap(), None).unwrap();
        d
    }

    /// Only the work dirs of dead runs that are this user's own and closed to others are
    /// swept (each once); a live run's, one others may write, a link in place of one, and
    /// a directory of another name are left alone.
    #[test]
    fn only_this_users_work_dirs_of_dead_runs_are_swept() {
        let t = tempfile::tempdir().unwrap();
        let me = ProcessId::of(std::process::id()).unwrap();
        let dead = run_dir(t.path(), "gpuam-run-dead", dead_process());
        let live = run_dir(t.path(), "gpuam-run-live", me);
        let open = run_dir(t.path(), "gpuam-run-open", dead_process());
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let other_name = run_dir(t.path(), "elsewhere", dead_process());
        let given = run_dir(t.path(), "given", dead_process());
        let target = run_dir(t.path(), "target", dead_process());
        std::os::unix::fs::symlink(&target, t.path().join("gpuam-run-link")).unwrap();

        let swept = sweep(t.path(), Some(&given));
        let mut names: Vec<String> = swept
            .iter()
            .map(|(d, _)| d.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["given", "gpuam-run-dead"]);
        assert!(
            swept.iter().all(|(_, n)| *n == 0),
            "nothing of them was alive: {swept:?}"
        );
        // Swept once: the record goes; the others keep theirs.
        assert!(!dead.join(RUN_PROCESS_FILE).exists());
        assert!(!given.join(RUN_PROCESS_FILE).exists());
        for kept in [&live, &open, &other_name, &target] {
            assert!(kept.join(RUN_PROCESS_FILE).exists(), "{}", kept.display());
        }
        assert!(sweep(t.path(), Some(&given)).is_empty());
    }

    /// As root: a dead run's work dir that another user owns is not swept (what its records
    /// name is not this user's to kill), nor one of root's inside a directory another user
    /// owns (even sticky: its owner may rename root's entries there, and swap one for a
    /// link to records of their own between the check and the reads).
    #[test]
    fn a_work_dir_of_another_user_or_in_their_directory_is_not_swept() {
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root (directories of other uids)");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let theirs = run_dir(t.path(), "gpuam-run-theirs", dead_process());
        std::os::unix::fs::chown(&theirs, Some(64_995), Some(64_995)).unwrap();
        assert!(sweep(t.path(), None).is_empty());
        assert!(theirs.join(RUN_PROCESS_FILE).exists());
        let shared = t.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        std::os::unix::fs::chown(&shared, Some(64_995), Some(64_995)).unwrap();
        let ours = run_dir(&shared, "gpuam-run-ours", dead_process());
        assert!(sweep(&shared, None).is_empty());
        assert!(ours.join(RUN_PROCESS_FILE).exists());
        // The same, in a directory of root's: swept.
        std::os::unix::fs::chown(&shared, Some(0), Some(0)).unwrap();
        assert_eq!(sweep(&shared, None).len(), 1);
    }
}
