//! Bounded nodes, attacked with real processes in real cgroups (the library's `Executor`,
//! as an agent runs it): a task that fills its node's disk is killed with `disk limit
//! exceeded (N MiB)` and the next job on that node still runs (under cgroup v2 and under the
//! subreaper shim); a fork bomb spread over two containers stays within the node-wide pids
//! bound; a task that goes past its own memory limit ends with `out of memory (limit N
//! MiB)`. Needs root (tmpfs mounts, cgroups); skipped otherwise. Every wait is bounded.

mod common;
#[path = "common/exec.rs"]
mod exec;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use exec::{ctx, executor, next_exit, root};
use gpuam::node::cgroup::{Containment, Mechanism};
use gpuam::node::executor::{work_dir, ExecutorOptions};
use gpuam::resources::Resources;

use common::{sq, Rm};

fn res(memory_mb: u64) -> Resources {
    Resources::with_mask(1, memory_mb, 0, Default::default())
}

/// A small tmpfs (the "node's disk"), unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, mb: u64) -> Tmpfs {
        std::fs::create_dir_all(at).unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mb}m"), "tmpfs"])
            .arg(at)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mount tmpfs at {}", at.display());
        Tmpfs(at.to_path_buf())
    }

    fn free_mb(&self) -> u64 {
        let c = std::ffi::CString::new(self.0.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: statvfs into a zeroed struct.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
        (st.f_bavail as u64 * st.f_frsize as u64) >> 20
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// The attack: a 64 MiB node disk, a 16 MiB bound per container; the task writes 200 MB
/// and stays. It must end with the reason, its files must be gone, and the next job on the
/// node must run.
async fn fill_the_disk(containment: Containment, tag: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let disk = Tmpfs::mount(&tmp.path().join("disk"), 64);
    let (exec, mut rx) = executor(
        &disk.0,
        ExecutorOptions {
            containment,
            max_log_bytes: Some(1 << 20),
            max_disk_mb: Some(16),
            ..Default::default()
        },
    );
    let id = format!("{tag}-filler");
    exec.start(
        &id,
        "h",
        &res(0),
        ctx("dd if=/dev/zero of=big bs=1M count=200 2>/dev/null; mkdir -p d; dd if=/dev/zero of=d/more bs=1M count=200 2>/dev/null; sleep 600"),
    )
    .unwrap();
    let (got, code, why) = next_exit(&mut rx).await;
    assert_eq!(got, id);
    assert_ne!(code, 0, "{why}");
    assert!(why.starts_with("disk limit exceeded (16 MiB)"), "{why}");
    let dir = exec.container_dir(&id).unwrap();
    assert!(
        !dir.join("big").exists() && !dir.join("d").exists(),
        "the task's files are removed"
    );
    assert!(dir.join("stdout").exists(), "its logs stay");
    assert!(disk.free_mb() > 48, "the disk is free again: {} MiB", disk.free_mb());
    // The next job on the filled node launches and runs.
    exec.start(&format!("{tag}-next"), "h", &res(0), ctx("echo fine > f && cat f"))
        .unwrap();
    let (got, code, why) = next_exit(&mut rx).await;
    assert_eq!((got, code), (format!("{tag}-next"), 0), "{why}");
}

#[tokio::test]
async fn a_task_past_its_disk_bound_is_killed_and_the_next_job_runs_under_a_cgroup() {
    if !root() {
        return;
    }
    let c = Containment::detect("gpuam-test-23b-disk");
    fill_the_disk(c.clone(), "cg").await;
    c.remove_parents();
}

#[tokio::test]
async fn a_task_past_its_disk_bound_is_killed_and_the_next_job_runs_under_the_shim() {
    if !root() {
        return;
    }
    let c = Containment::subreaper(PathBuf::from(env!("CARGO_BIN_EXE_gpuam")));
    fill_the_disk(c, "shim").await;
}

/// Kills what containers `ids` of `c` hold when dropped (a failed assertion leaves nothing).
struct KillOnDrop<'a> {
    c: &'a Containment,
    ids: &'a [&'a str],
}

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        for id in self.ids {
            self.c.cgroup(id).kill();
        }
    }
}

/// Two containers each try to start 80 processes on a node bounded to 40: together they
/// never hold more than 40 forked processes (the kernel refuses forks beyond `pids.max`;
/// a process that joins by migration is not refused, so each container's leader may add
/// one), forks fail in them, and once they are stopped the node runs the next job.
#[tokio::test]
async fn a_fork_bomb_over_two_containers_is_bounded_node_wide() {
    if !root() {
        return;
    }
    let c = Containment::detect("gpuam-test-23b-pids").with_max_pids(Some(40));
    if matches!(c.mechanism(), Mechanism::Subreaper | Mechanism::ProcessGroup) {
        eprintln!("skipped: no cgroup here");
        return;
    }
    let Some((file, value)) = c.max_pids() else {
        eprintln!("skipped: no pids controller here ({})", c.describe());
        c.remove_parents();
        return;
    };
    assert_eq!(value, "40", "{}", file.display());
    let current = file.with_file_name("pids.current");
    let tmp = tempfile::tempdir().unwrap();
    let (exec, mut rx) = executor(
        tmp.path(),
        ExecutorOptions {
            containment: c.clone(),
            ..Default::default()
        },
    );
    // bash retries a failed fork a few times, then says so and goes on.
    let bomb = "for i in $(seq 80); do sleep 600 & done 2>>forks.err; echo started; sleep 600";
    let ids = ["bomb-a", "bomb-b"];
    let _guard = KillOnDrop { c: &c, ids: &ids };
    for id in ids {
        exec.start(id, "h", &res(0), ctx(bomb)).unwrap();
    }
    let until = Instant::now() + Duration::from_secs(60);
    let mut most = 0u64;
    let refused = |id: &str| {
        // In the task's own directory (`work/` of the container's record).
        std::fs::read_to_string(work_dir(&exec.container_dir(id).unwrap()).join("forks.err"))
            .unwrap_or_default()
            .contains("Resource temporarily unavailable")
    };
    loop {
        let now: u64 = std::fs::read_to_string(&current)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        most = most.max(now);
        if refused("bomb-a") || refused("bomb-b") {
            break;
        }
        assert!(
            Instant::now() < until,
            "no fork was refused within 60 s ({now} processes)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        most <= 40 + ids.len() as u64,
        "the node held {most} processes, beyond its bound of 40 (+1 leader per container)"
    );
    for id in ["bomb-a", "bomb-b"] {
        exec.stop(id, Duration::from_millis(500)).await.unwrap();
    }
    let mut ended = 0;
    while ended < 2 {
        next_exit(&mut rx).await;
        ended += 1;
    }
    exec.start("after", "h", &res(0), ctx("true")).unwrap();
    let (got, code, why) = next_exit(&mut rx).await;
    assert_eq!((got.as_str(), code), ("after", 0), "{why}");
    c.remove_parents();
}

/// A task that allocates past its own 64 MiB limit is killed by the kernel; its end says
/// `out of memory (limit 64 MiB)`, which the AM counts as the task's failure.
#[tokio::test]
async fn an_oom_kill_in_the_tasks_own_limit_says_so() {
    if !root() {
        return;
    }
    let c = Containment::detect("gpuam-test-23b-oom");
    if !c.describe().contains("memory") {
        eprintln!("skipped: no memory controller here ({})", c.describe());
        c.remove_parents();
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (exec, mut rx) = executor(
        tmp.path(),
        ExecutorOptions {
            containment: c.clone(),
            ..Default::default()
        },
    );
    // `tail` keeps a line without an end in memory: 300 MB of it.
    exec.start("oom", "h", &res(64), ctx("head -c 300000000 /dev/zero | tail"))
        .unwrap();
    let (_, code, why) = next_exit(&mut rx).await;
    assert_ne!(code, 0);
    assert!(why.starts_with("out of memory (limit 64 MiB)"), "{why}");
    let exit = gpuam::am::exits::classify(code, &why, &Default::default());
    assert_eq!(exit.description, "out of memory", "{exit:?}");
    // A task that stays within its limit says nothing of memory.
    exec.start("fits", "h", &res(64), ctx("head -c 1000000 /dev/zero | tail | wc -c"))
        .unwrap();
    let (_, code, why) = next_exit(&mut rx).await;
    assert_eq!(code, 0, "{why}");
    assert!(!why.contains("out of memory"), "{why}");
    c.remove_parents();
}

/// Through a standalone RM and its AM: `taskRetryCount: 0` and a task that goes past its
/// own 64 MiB ends after one attempt (no transient retry), and the job says why.
#[test]
fn an_oom_task_with_no_retries_ends_after_one_attempt_with_the_reason() {
    if !root() {
        return;
    }
    let rm = Rm::start(
        "nodes:\n  - host: n1\n    cpu: 4\n    memoryMB: 4000\n    gpus: 0\n    ports: \"20000-20009\"\n",
        &[],
    );
    let attempts = rm.path("attempts");
    let cmd = format!(
        "echo $GPUAM_ATTEMPT >> {}; head -c 300000000 /dev/zero | tail",
        attempts.display()
    );
    let job = rm.write_job(
        "oom",
        &format!(
            "name: oom\ntaskRoles:\n  worker:\n    instances: 1\n    taskRetryCount: 0\n    resourcePerInstance: {{cpu: 1, memoryMB: 64, gpu: 0}}\n    commands:\n      - {}\n",
            sq(&cmd)
        ),
    );
    let sub = rm.submit(&job);
    let app = sub.app_id(Duration::from_secs(20));
    let fin = rm.wait_app_final(&app, Duration::from_secs(120));
    assert_eq!(fin["finalStatus"], "FAILED", "{fin}");
    // Let a wrongly scheduled retry show up before counting.
    std::thread::sleep(Duration::from_secs(2));
    let runs = std::fs::read_to_string(&attempts).unwrap_or_default();
    assert_eq!(runs.lines().count(), 1, "attempts: {runs:?}");
    let said = format!("{fin} {} {}", sub.stdout(), sub.stderr());
    assert!(said.contains("out of memory (limit 64 MiB)"), "{said}");
}
