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

use std::io::BufRead as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::node::executor::{hold, record_id, PROCESS_FILE};
use crate::node::procs::{send_signal, ProcessId, SignalTo};

/// How long a task's subreaper shim gets to end its whole tree once told to.
const SHIM_GRACE: Duration = Duration::from_secs(5);

/// The hidden subcommand the reaper runs as (`Cmd::ReapRun`).
const SUBCOMMAND: &str = "reap-run";

/// A run's reaper, from the run's side.
pub struct Reaper(Option<hold::Hold>);

impl Reaper {
    /// Starts the reaper of the run whose work dir is `work_dir` (canonical, as the RM
    /// names its cgroups after it).
    pub fn start(work_dir: &Path) -> std::io::Result<Reaper> {
        use std::os::unix::process::CommandExt as _;
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

    /// The run ended by itself (its job and tasks are stopped): the reaper goes.
    pub fn done(mut self) {
        if let Some(h) = self.0.take() {
            let _ = h.release();
        }
    }
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
