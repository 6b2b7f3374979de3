//! The subreaper shim (containment where no cgroup can be created), forced on a machine
//! that has cgroups: the library's `Executor` runs containers under the real
//! `gpuam container-shim` of this build, and every way a task can try to leave its
//! container (a new session, a double fork, `set -m; nohup`, python's fork/setsid/fork,
//! processes that ignore SIGTERM) must be dead when the container's `Exited` event comes,
//! on a stop, on a normal end, and after a re-attach. Exit codes must be those of the task.
//!
//! Every wait is bounded; every process a test may leave is killed by pid when the test
//! ends (also when it fails).

#[path = "common/exec.rs"]
mod exec;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use exec::next_exit;
use gpuam::node::cgroup::{Containment, Mechanism};
use gpuam::node::executor::{Executor, ExecutorOptions};
use gpuam::node::procs::ProcessId;
use gpuam::node::NodeEvent;
use gpuam::protocol::LaunchContext;
use gpuam::resources::Resources;
use tokio::sync::mpsc;

/// How many escapes [`escapes`] starts.
const ESCAPES: usize = 6;

/// Kills (SIGKILL, by pid) whatever a test's containers may have left: the pids in its
/// pid files and the recorded shims. Runs on drop, so a failed assertion leaves nothing.
struct Leftovers {
    files: Vec<PathBuf>,
    pids: Vec<u32>,
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        let mut all: Vec<i32> = self.files.iter().flat_map(|f| pids_in(f)).collect();
        all.extend(self.pids.iter().map(|p| *p as i32));
        for p in all.into_iter().filter(|p| *p > 1) {
            if ProcessId::of(p as u32).is_some_and(|id| id.alive()) {
                // SAFETY: plain syscall on a pid this test's containers started.
                unsafe {
                    libc::kill(p, libc::SIGKILL);
                }
            }
        }
    }
}

fn pids_in(file: &Path) -> Vec<i32> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

fn alive(file: &Path) -> Vec<i32> {
    pids_in(file)
        .into_iter()
        .filter(|p| ProcessId::of(*p as u32).is_some_and(|id| id.alive()))
        .collect()
}

/// The escapes of the executor's unit test `no_daemon_survives_its_container`, and two that
/// ignore SIGTERM (one in a new session, one double-forked). Each writes its pid to `pids`.
fn escapes(pids: &Path) -> Vec<String> {
    let p = pids.display();
    vec![
        format!("setsid sleep 1000 & echo $! >> {p}"),
        format!("( sleep 1001 & echo $! >> {p} ) "),
        format!("set -m; nohup sleep 1002 >/dev/null 2>&1 & echo $! >> {p}; set +m"),
        format!(
            "python3 -c 'import os,time\nif os.fork()==0:\n os.setsid()\n if os.fork()==0:\n  open(\"{p}\",\"a\").write(str(os.getpid())+\"\\n\"); time.sleep(1003)\n os._exit(0)\nos.wait()' "
        ),
        format!("setsid bash -c 'trap \"\" TERM; exec sleep 1004' & echo $! >> {p}"),
        format!("( trap '' TERM; sleep 1005 & echo $! >> {p} )"),
        // Let every daemon write its pid.
        format!("while [ $(wc -l < {p}) -lt {ESCAPES} ]; do sleep 0.02; done"),
    ]
}

fn ctx(commands: &[String]) -> LaunchContext {
    LaunchContext {
        commands: commands.to_vec(),
        env: BTreeMap::new(),
    }
}

fn no_gpus() -> Resources {
    Resources::with_mask(1, 100, 0, Default::default())
}

/// An executor whose containers run under this build's shim (forced: this machine may well
/// have cgroups).
fn shim_executor(root: &Path) -> (Executor, mpsc::UnboundedReceiver<NodeEvent>) {
    let containment = Containment::subreaper(PathBuf::from(env!("CARGO_BIN_EXE_gpuam")));
    assert_eq!(containment.mechanism(), Mechanism::Subreaper);
    assert!(
        containment.describe().contains("subreaper shim"),
        "{}",
        containment.describe()
    );
    let (tx, rx) = mpsc::unbounded_channel();
    let exec = Executor::with_options(
        root.join("containers"),
        tx,
        ExecutorOptions {
            containment,
            ..Default::default()
        },
    );
    (exec, rx)
}

/// Waits (at most 10 s) until `n` pids are in `file` and alive.
async fn wait_started(file: &Path, n: usize) {
    let until = Instant::now() + Duration::from_secs(10);
    while alive(file).len() < n {
        assert!(Instant::now() < until, "only {:?} of {n} escapes started", alive(file));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The shim process is the container's recorded process, and its log line is in stderr.
/// (A start returns once the process has begun its `exec`; its command line is there a
/// moment later, so it is looked for up to 10 s.)
fn assert_runs_under_a_shim(exec: &Executor, id: &str) -> u32 {
    let pid = exec.status(id).unwrap().pid.unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while !gpuam::node::shim::is_shim(pid) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(gpuam::node::shim::is_shim(pid), "pid {pid} of {id} is no shim");
    pid
}

/// Starts container `id` running every escape and then `sleep 1000`, under a shim, and
/// waits until every escape has written its pid; the pid file and the guard that kills
/// whatever is left when the test ends (the shim first).
async fn start_escapes_and_wait(exec: &Executor, dir: &Path, id: &str) -> (PathBuf, Leftovers) {
    let pids = dir.join(format!("{id}.pids"));
    std::fs::write(&pids, "").unwrap();
    let mut guard = Leftovers {
        files: vec![pids.clone()],
        pids: Vec::new(),
    };
    let mut cmds = escapes(&pids);
    cmds.push("sleep 1000".into());
    exec.start(id, "h", &no_gpus(), ctx(&cmds)).unwrap();
    guard.pids.push(assert_runs_under_a_shim(exec, id));
    wait_started(&pids, ESCAPES).await;
    (pids, guard)
}

#[tokio::test]
async fn a_stopped_container_leaves_nothing_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let (exec, mut rx) = shim_executor(tmp.path());
    let (pids, guard) = start_escapes_and_wait(&exec, tmp.path(), "c-stopped").await;
    let started = Instant::now();
    exec.stop("c-stopped", Duration::from_millis(500)).await.unwrap();
    let (id, code, diag) = next_exit(&mut rx).await;
    assert_eq!(id, "c-stopped");
    assert_eq!(alive(&pids), Vec::<i32>::new(), "survivors after Exited ({diag})");
    assert!(
        !ProcessId::of(guard.pids[0]).is_some_and(|p| p.alive()),
        "the shim ended"
    );
    assert!(diag.contains("stopped by request"), "{diag}");
    // launch.sh's TERM trap waits for its background children, two of which ignore
    // SIGTERM: the script dies in the shim's SIGKILL after the grace, and the shim dies of
    // the same signal.
    assert_eq!(code, 137, "{diag}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the stop took {:?}",
        started.elapsed()
    );
    let stderr = std::fs::read_to_string(tmp.path().join("containers/c-stopped/stderr")).unwrap();
    assert!(stderr.contains("containment: subreaper shim"), "{stderr}");
}

#[tokio::test]
async fn a_container_that_ends_takes_its_daemons_along_and_keeps_its_exit_code() {
    let tmp = tempfile::tempdir().unwrap();
    let (exec, mut rx) = shim_executor(tmp.path());
    let mut guard = Leftovers {
        files: Vec::new(),
        pids: Vec::new(),
    };
    for (id, last, want) in [("c-ok", "true", 0), ("c-three", "exit 3", 3)] {
        let pids = tmp.path().join(format!("{id}.pids"));
        std::fs::write(&pids, "").unwrap();
        guard.files.push(pids.clone());
        let mut cmds = escapes(&pids);
        cmds.push(last.into());
        exec.start(id, "h", &no_gpus(), ctx(&cmds)).unwrap();
        guard.pids.push(assert_runs_under_a_shim(&exec, id));
        let (got, code, diag) = next_exit(&mut rx).await;
        assert_eq!(got, id);
        assert_eq!(code, want, "{id}: {diag}");
        assert_eq!(pids_in(&pids).len(), ESCAPES, "{id}: every escape wrote its pid");
        assert_eq!(alive(&pids), Vec::<i32>::new(), "{id}: survivors after Exited ({diag})");
    }
}

#[tokio::test]
async fn a_task_killed_by_a_signal_is_reported_as_such() {
    let tmp = tempfile::tempdir().unwrap();
    let (exec, mut rx) = shim_executor(tmp.path());
    exec.start("c-segv", "h", &no_gpus(), ctx(&["kill -SEGV $$".to_string()]))
        .unwrap();
    let _guard = Leftovers {
        files: Vec::new(),
        pids: vec![assert_runs_under_a_shim(&exec, "c-segv")],
    };
    let (_, code, diag) = next_exit(&mut rx).await;
    assert_eq!(code, 128 + libc::SIGSEGV, "{diag}");
    assert!(diag.contains("SIGSEGV"), "the shim died of the same signal: {diag}");
}

/// A second executor (an agent after a restart) re-attaches to a running shim and stops
/// it: the daemons that ignore SIGTERM die too, and only then comes `Exited`.
#[tokio::test]
async fn a_reattached_shim_is_stopped_with_everything_in_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (first, _first_rx) = shim_executor(tmp.path());
    let (pids, _guard) = start_escapes_and_wait(&first, tmp.path(), "c1").await;

    // The second executor's own containment does not matter: the recorded process says.
    let (tx, mut rx) = mpsc::unbounded_channel();
    let second = Executor::new(first.root().to_path_buf(), tx);
    second.reattach("c1");
    second.stop("c1", Duration::from_millis(500)).await.unwrap();
    let (id, _, diag) = next_exit(&mut rx).await;
    assert_eq!(id, "c1");
    assert!(diag.contains("stopped by request"), "{diag}");
    assert_eq!(alive(&pids), Vec::<i32>::new(), "survivors after Exited ({diag})");
}
