//! A real training job end to end: `examples/jax-ddp.yaml` (data-parallel JAX, a gang of
//! 3 workers) through the real `gpuam run` binary, the way README.md tells a user to run
//! it, with the embedded RM, the AM and real worker processes.
//!
//! - the job succeeds and every worker prints the same `PARAMS_SHA256` (3 of them), and
//!   the loss falls;
//! - the same job without the gradient all-reduce ends with different hashes, so the
//!   first check can fail;
//! - killing one worker's training process mid-run fails the job with a message naming
//!   that worker (from the survivors, which stop at their next all-reduce), within a
//!   bounded time, and leaves no worker process behind;
//! - a worker that never starts training fails the job within the rendezvous timeout, with
//!   a message naming the missing task and its host:port.
//!
//! Needs JAX in `target/jax-venv`: `bash examples/jax-setup.sh` (`.ci/run` runs it). When
//! it is missing the tests fail and say so; they do not skip.
//!
//! - the same job, unchanged, submitted to an RM with two node agents in network
//!   namespaces of their own (`common::hosts`): the workers land on both hosts, each
//!   finds task 0 at the IP of task 0's namespace (the product hands peers node IPs, not
//!   host names nobody can resolve), the rendezvous and every all-reduce cross the bridge,
//!   the tasks run as the agents' task user with the repository given by the agents'
//!   `--task-env JAX_EXAMPLE_DIR`, and every replica ends with the same hash. Needs root,
//!   `ip`, `nsenter`, `setpriv` and `curl`, as integration/hosts.rs does.
//!
//! The tests share one lock: each runs 3 JAX processes, and running them one at a time
//! keeps a small CI machine from starving them.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::hosts::{host_ip, Hosts};
use common::{bin, group_members, pid_alive, pids_with_cmdline, wait_for};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Workers in examples/jax-ddp.yaml.
const WORKERS: usize = 3;

/// Longest a whole job may take here (JAX start-up dominates; about 20 s on 2 cores).
const JOB_TIMEOUT: Duration = Duration::from_secs(240);

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Panics, naming the fix, when target/jax-venv has no importable JAX.
fn require_jax() {
    let python = repo().join("target/jax-venv/bin/python");
    let ok = Command::new(&python)
        .args(["-c", "import jax"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        ok,
        "JAX is not installed in {}: run `bash examples/jax-setup.sh` in the repository first \
         (.ci/run does this before the tests)",
        python.display()
    );
}

/// One test's files: a HOME of its own (where jax-setup.sh puts the link the job's commands
/// follow, so concurrent checkouts do not meet), the RM's work dir, job variants.
struct Sandbox {
    dir: Option<tempfile::TempDir>,
    home: PathBuf,
    work: PathBuf,
}

impl Sandbox {
    fn new() -> Sandbox {
        require_jax();
        let dir = tempfile::Builder::new()
            .prefix(&format!("jax-itest-{}-", std::process::id()))
            .tempdir()
            .unwrap();
        let home = dir.path().join("home");
        let work = dir.path().join("work");
        fs::create_dir_all(&home).unwrap();
        // Fast when the venv is there (it only links $HOME/.cache/gpuam/jax-example).
        let out = Command::new("bash")
            .arg(repo().join("examples/jax-setup.sh"))
            .env("HOME", &home)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "examples/jax-setup.sh failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Sandbox {
            dir: Some(dir),
            home,
            work,
        }
    }

    fn root(&self) -> &Path {
        self.dir.as_ref().unwrap().path()
    }

    /// examples/jax-ddp.yaml with its commands changed (each `(from, to)` once).
    fn job_variant(&self, name: &str, edits: &[(&str, &str)]) -> PathBuf {
        let mut text = fs::read_to_string(repo().join("examples/jax-ddp.yaml")).unwrap();
        for (from, to) in edits {
            assert!(text.contains(from), "examples/jax-ddp.yaml no longer has `{from}`");
            text = text.replacen(from, to, 1);
        }
        let path = self.root().join(name);
        fs::write(&path, text).unwrap();
        path
    }

    /// `gpuam run JOB` from the repository root, output to files.
    fn spawn_run(&self, job: &Path) -> Child {
        let mut cmd = Command::new(bin());
        cmd.arg("run")
            .arg(job)
            .arg("--work-dir")
            .arg(&self.work)
            // A failed job's dashboard would stay up 60 s: these tests read the files.
            .args(["--linger", "0"])
            .current_dir(repo())
            .env("HOME", &self.home)
            .stdin(Stdio::null())
            .stdout(fs::File::create(self.root().join("run.stdout")).unwrap())
            .stderr(fs::File::create(self.root().join("run.stderr")).unwrap());
        for (k, _) in std::env::vars() {
            if k.starts_with("GPUAM") {
                cmd.env_remove(k);
            }
        }
        // Its tasks write into the test's private directory: as the RM's user.
        cmd.env("GPUAM__NODE__IN_PROCESS_IDENTITY", "false");
        cmd.spawn().unwrap()
    }

    fn output(&self) -> String {
        let read = |n: &str| fs::read_to_string(self.root().join(n)).unwrap_or_default();
        format!("{}{}", read("run.stdout"), read("run.stderr"))
    }

    /// Waits for `gpuam run` to exit (killing it after `timeout`); its exit code.
    fn wait(&self, child: &mut Child, timeout: Duration) -> i32 {
        let start = Instant::now();
        loop {
            if let Some(s) = child.try_wait().unwrap() {
                return s.code().unwrap_or(-1);
            }
            if start.elapsed() > timeout {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "`gpuam run` did not end within {timeout:?}\n{}\n{}",
                    self.output(),
                    self.worker_logs()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn container_dirs(&self) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> = fs::read_dir(self.work.join("containers"))
            .map(|rd| rd.filter_map(Result::ok).map(|e| e.path()).collect())
            .unwrap_or_default();
        out.sort();
        out
    }

    /// Each worker's stdout, keyed by its rank (from its `worker R/N:` line).
    fn worker_stdouts(&self) -> Vec<(usize, String)> {
        let mut out: Vec<(usize, String)> = self
            .container_dirs()
            .iter()
            .filter_map(|d| {
                let text = fs::read_to_string(d.join("stdout")).ok()?;
                let rank = text
                    .lines()
                    .find_map(|l| l.strip_prefix("worker ")?.split('/').next()?.parse().ok())?;
                Some((rank, text))
            })
            .collect();
        out.sort();
        out
    }

    fn worker_logs(&self) -> String {
        self.container_dirs()
            .iter()
            .map(|d| {
                let read = |n: &str| fs::read_to_string(d.join(n)).unwrap_or_default();
                format!("--- {}\n{}{}", d.display(), read("stdout"), read("stderr"))
            })
            .collect()
    }

    /// Live processes started for this sandbox's job (their command line holds its HOME).
    fn live_workers(&self) -> Vec<i32> {
        pids_with_cmdline(&[&self.home.to_string_lossy(), "jax_ddp.py"])
    }

    /// The process-group leaders of every container (every attempt) from their process.json.
    fn container_leaders(&self) -> Vec<i32> {
        self.container_dirs()
            .iter()
            .filter_map(|d| {
                let v: serde_json::Value = serde_json::from_slice(&fs::read(d.join("process.json")).ok()?).ok()?;
                Some(v["pid"].as_i64()? as i32)
            })
            .collect()
    }

    /// Nothing of the job runs any more: no container's process group, no training process.
    fn assert_nothing_left(&self) {
        let leaders = self.container_leaders();
        assert!(!leaders.is_empty(), "no container was started:\n{}", self.output());
        for pgid in leaders {
            let members = group_members(pgid);
            assert!(members.is_empty(), "container group {pgid} still has {members:?}");
        }
        let left = self.live_workers();
        assert!(left.is_empty(), "training processes still alive: {left:?}");
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        for pid in self.live_workers() {
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
        if std::thread::panicking() {
            if let Some(d) = self.dir.take() {
                eprintln!("test files kept in {}", d.keep().display());
            }
        }
    }
}

/// The `PARAMS_SHA256` of each worker's stdout (in rank order).
fn hashes(workers: &[(usize, String)]) -> Vec<String> {
    workers
        .iter()
        .filter_map(|(_, text)| {
            text.lines()
                .find_map(|l| l.strip_prefix("PARAMS_SHA256 ").map(|h| h.trim().to_string()))
        })
        .collect()
}

/// The `step N loss X` values of one worker's stdout, in order.
fn losses(text: &str) -> Vec<f64> {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("step ")?;
            rest.split(" loss ").nth(1)?.trim().parse().ok()
        })
        .collect()
}

#[test]
fn every_worker_ends_with_the_same_parameters() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let sb = Sandbox::new();
    let mut run = sb.spawn_run(&repo().join("examples/jax-ddp.yaml"));
    let code = sb.wait(&mut run, JOB_TIMEOUT);
    let output = sb.output();
    assert_eq!(code, 0, "the job failed:\n{output}\n{}", sb.worker_logs());
    assert!(output.contains("Succeeded"), "{output}");

    let workers = sb.worker_stdouts();
    let ranks: Vec<usize> = workers.iter().map(|(r, _)| *r).collect();
    assert_eq!(ranks, (0..WORKERS).collect::<Vec<_>>(), "{}", sb.worker_logs());
    let hs = hashes(&workers);
    assert_eq!(
        hs.len(),
        WORKERS,
        "every worker prints PARAMS_SHA256:\n{}",
        sb.worker_logs()
    );
    assert!(
        hs.iter()
            .all(|h| h.len() == 64 && h.chars().all(|c| c.is_ascii_hexdigit())),
        "{hs:?}"
    );
    assert!(hs.iter().all(|h| *h == hs[0]), "replicas differ: {hs:?}");
    for (rank, text) in &workers {
        // Its CUDA_VISIBLE_DEVICES is the GPU gpuam granted it.
        let granted = output
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!("task worker/{rank} running on "))?
                    .split_once(" GPUs [")
                    .map(|(_, g)| g.trim_end_matches(']').to_string())
            })
            .unwrap_or_else(|| panic!("no `task worker/{rank} running` line:\n{output}"));
        assert_eq!(granted.split(',').count(), 1, "one GPU each: {granted}");
        assert!(
            text.contains(&format!(
                "worker {rank}/{WORKERS}: GPUs {granted} (CUDA_VISIBLE_DEVICES"
            )),
            "worker {rank} sees its granted GPU {granted}:\n{text}"
        );
        let l = losses(text);
        assert_eq!(l.len(), 40, "worker {rank} ran 40 steps:\n{text}");
        assert!(l[l.len() - 1] < l[0] / 2.0, "worker {rank}'s loss did not fall: {l:?}");
        assert!(
            text.contains(&format!("worker {rank}/{WORKERS}: joined; {WORKERS} devices in all")),
            "{text}"
        );
    }
    sb.assert_nothing_left();
}

#[test]
fn without_the_all_reduce_the_replicas_differ() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let sb = Sandbox::new();
    let job = sb.job_variant("no-allreduce.yaml", &[("--steps 40", "--steps 10 --no-allreduce")]);
    let mut run = sb.spawn_run(&job);
    let code = sb.wait(&mut run, JOB_TIMEOUT);
    assert_eq!(code, 0, "{}\n{}", sb.output(), sb.worker_logs());
    let hs = hashes(&sb.worker_stdouts());
    assert_eq!(hs.len(), WORKERS, "{}", sb.worker_logs());
    for i in 0..WORKERS {
        for j in i + 1..WORKERS {
            assert_ne!(hs[i], hs[j], "workers {i} and {j} agree without an all-reduce");
        }
    }
}

#[test]
fn a_killed_worker_fails_the_job_and_leaves_no_worker_behind() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let sb = Sandbox::new();
    // Long enough that the kill lands mid-training.
    let job = sb.job_variant(
        "long.yaml",
        &[("--steps 40 --step-sleep 0.25", "--steps 100000 --step-sleep 0.05")],
    );
    let mut run = sb.spawn_run(&job);

    // Every worker is training (has printed step 3).
    wait_for(JOB_TIMEOUT, "every worker at step 3", || {
        if let Ok(Some(s)) = run.try_wait() {
            panic!("`gpuam run` ended early ({s}):\n{}\n{}", sb.output(), sb.worker_logs());
        }
        let ws = sb.worker_stdouts();
        (ws.len() == WORKERS && ws.iter().all(|(_, t)| t.contains("\nstep 3 loss"))).then_some(())
    });
    // Worker 1's training process: a member of its container's process group, found
    // through the group leader's pid in process.json.
    let dir = sb
        .container_dirs()
        .into_iter()
        .find(|d| fs::read_to_string(d.join("stdout")).is_ok_and(|t| t.starts_with("worker 1/")))
        .expect("worker 1's container");
    let leader: serde_json::Value = serde_json::from_slice(&fs::read(dir.join("process.json")).unwrap()).unwrap();
    let pgid = leader["pid"].as_i64().unwrap() as i32;
    let victim = group_members(pgid)
        .into_iter()
        .find(|p| {
            fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| String::from_utf8_lossy(&c).contains("jax_ddp.py"))
        })
        .expect("worker 1's python process");
    let all_before = sb.live_workers();
    assert_eq!(all_before.len(), WORKERS, "{all_before:?}");
    assert!(unsafe { libc::kill(victim, libc::SIGKILL) } == 0);

    // A JAX job cannot take a replacement worker mid-run: whether the AM retries worker 1
    // (a kill is a transient exit) or not, the job fails, and the others stop.
    let code = sb.wait(&mut run, Duration::from_secs(120));
    let output = sb.output();
    assert_eq!(code, 1, "the job must fail:\n{output}\n{}", sb.worker_logs());
    // The survivors end at their next all-reduce, naming the worker that left (they learn
    // it from the roll-call connections), and `gpuam run` shows their message.
    let named = output
        .lines()
        .filter(|l| l.starts_with("task worker/") && l.contains("finished: exit 5"))
        .find(|l| l.contains("training stopped at step") && l.contains(": task 1 (") && l.contains(") left the job"));
    assert!(
        named.is_some(),
        "a survivor names task 1 as the one that left:\n{output}"
    );
    let job_line = output
        .lines()
        .find(|l| l.starts_with("job ") && l.contains("Failed"))
        .unwrap_or_else(|| panic!("no `job ... Failed` line:\n{output}"));
    assert!(
        job_line.contains("task worker/"),
        "the job's end names the task: {job_line}"
    );
    // `gpuam run` returns after its RM has stopped every container: nothing left running.
    sb.assert_nothing_left();
    for p in all_before {
        assert!(!pid_alive(p), "worker process {p} outlived the job");
    }
}

#[test]
fn a_peer_that_never_comes_fails_the_job_naming_it() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let sb = Sandbox::new();
    // Worker 2 holds its container but never starts training.
    let job = sb.job_variant(
        "missing.yaml",
        &[
            (
                "'\"$py\" -u",
                "'if [ \"$GPUAM_TASK_INDEX\" = 2 ]; then sleep 600; else \"$py\" -u",
            ),
            ("--init-timeout 60'", "--init-timeout 8; fi'"),
        ],
    );
    let mut run = sb.spawn_run(&job);
    let code = sb.wait(&mut run, JOB_TIMEOUT);
    let output = sb.output();
    assert_eq!(code, 1, "the job must fail:\n{output}\n{}", sb.worker_logs());
    let logs = sb.worker_logs();
    let port_of_2 = logs
        .lines()
        .find_map(|l| {
            l.split("missing peer: task 2 (")
                .nth(1)?
                .split(')')
                .next()
                .map(str::to_string)
        })
        .unwrap_or_else(|| panic!("no worker names the missing task 2:\n{output}\n{logs}"));
    assert!(
        port_of_2.contains(':'),
        "the missing peer is named with its host:port: {port_of_2}"
    );
    assert!(
        output.contains("missing peer: task 2"),
        "`gpuam run` shows the message:\n{output}"
    );
    sb.assert_nothing_left();
}

/// Panics, naming the fix, when the agents' task user cannot run the venv's python or
/// read the training script (the tasks would fail with exit 3 saying the same).
fn require_task_user_reaches_the_repository(user: &str) {
    let python = repo().join("target/jax-venv/bin/python");
    let script = repo().join("examples/jax_ddp.py");
    let ok = Command::new("setpriv")
        .args([
            &format!("--reuid={user}"),
            &format!("--regid={user}"),
            "--clear-groups",
            "test",
            "-x",
        ])
        .arg(&python)
        .arg("-a")
        .arg("-r")
        .arg(&script)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        ok,
        "user {user}, who runs the node agents' tasks, cannot run {} or read {}: run `bash \
         examples/jax-setup.sh` (it builds the venv on an interpreter every user can run) and keep the \
         checkout where other users may enter (o+x on every directory above it)",
        python.display(),
        script.display()
    );
}

/// The value after `prefix` on the line of `text` that starts with it.
fn after<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    text.lines().find_map(|l| l.strip_prefix(prefix))
}

#[test]
fn the_job_trains_across_two_node_agent_hosts() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_jax();
    let mut h = Hosts::build("jax");
    // Tasks run as their user's own uid with their container as HOME: the node tells them where the
    // example is, as an operator would.
    h.agent_args = vec!["--task-env".into(), format!("JAX_EXAMPLE_DIR={}", repo().display())];
    h.start_rm();
    h.start_agent("h1");
    h.start_agent("h2");
    h.wait_agents_running();
    // Any unprivileged uid (here nobody's) stands for the submitter's own.
    require_task_user_reaches_the_repository("65534");

    // The example exactly as README.md shows it, submitted to the RM.
    let yaml = fs::read_to_string(repo().join("examples/jax-ddp.yaml")).unwrap();
    let mut submit = h.submit("jax-ddp", &yaml, true);
    let started = Instant::now();
    let status = loop {
        if let Some(s) = submit.try_wait().unwrap() {
            break s;
        }
        if started.elapsed() > JOB_TIMEOUT {
            let _ = submit.kill();
            let _ = submit.wait();
            panic!("the job did not end within {JOB_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    println!("the job across two hosts took {:.1} s", started.elapsed().as_secs_f64());
    assert!(status.success(), "the job failed:\n{}", h.submit_output("jax-ddp"));

    // Each worker's stdout, with the agent host that ran it, by rank.
    let mut workers: Vec<(usize, String, String)> = h
        .container_dirs()
        .into_iter()
        .filter_map(|(host, dir)| {
            let text = fs::read_to_string(dir.join("stdout")).ok()?;
            let rank = text
                .lines()
                .find_map(|l| l.strip_prefix("worker ")?.split('/').next()?.parse().ok())?;
            Some((rank, host, text))
        })
        .collect();
    workers.sort();
    let ranks: Vec<usize> = workers.iter().map(|(r, _, _)| *r).collect();
    assert_eq!(ranks, (0..WORKERS).collect::<Vec<_>>(), "one container per worker");
    let by_rank: Vec<(usize, String)> = workers.iter().map(|(r, _, t)| (*r, t.clone())).collect();
    let hs = hashes(&by_rank);
    assert_eq!(hs.len(), WORKERS, "every worker prints PARAMS_SHA256");
    assert!(hs.iter().all(|h| h.len() == 64), "{hs:?}");
    assert!(hs.iter().all(|x| *x == hs[0]), "replicas differ across hosts: {hs:?}");

    // Where each worker ran, as it saw it: its GPUAM_HOST and its own address (its entry
    // in GPUAM_HOSTS_WORKER) are those of the agent whose directory holds its container.
    let host_of_0 = &workers[0].1;
    for (rank, host, text) in &workers {
        let me = after(text, &format!("worker {rank}/{WORKERS}: on host "))
            .unwrap_or_else(|| panic!("worker {rank} does not say where it runs:\n{text}"));
        assert_eq!(
            me,
            format!("{} at {}", h.host_name(host), host_ip(host)),
            "worker {rank}'s GPUAM_HOST and address"
        );
        // Task 0's address as every worker used it: the IP of task 0's namespace (a
        // name that does not resolve would have meant 127.0.0.1, "simulated host").
        let coord = after(text, &format!("worker {rank}/{WORKERS}: coordinator task 0 at "))
            .unwrap_or_else(|| panic!("worker {rank} names no coordinator:\n{text}"));
        let ip0 = host_ip(host_of_0);
        assert!(
            coord.starts_with(&format!("{ip0}:"))
                && coord.contains(&format!("-> {ip0}:"))
                && !coord.contains("simulated"),
            "worker {rank} reaches task 0 at {ip0}: {coord}"
        );
        assert!(
            text.contains(&format!("worker {rank}/{WORKERS}: joined; {WORKERS} devices in all")),
            "{text}"
        );
        let l = losses(text);
        assert_eq!(l.len(), 40, "worker {rank} ran 40 steps:\n{text}");
        assert!(l[l.len() - 1] < l[0] / 2.0, "worker {rank}'s loss did not fall: {l:?}");
    }
    let mut hosts: Vec<&str> = workers.iter().map(|(_, host, _)| host.as_str()).collect();
    hosts.sort();
    hosts.dedup();
    assert_eq!(hosts, ["h1", "h2"], "the workers ran on both agent hosts");
    assert!(
        workers.iter().any(|(_, host, _)| host != host_of_0),
        "some worker is on another host than task 0, so its rendezvous crossed the bridge"
    );
    // Nothing of the job runs any more.
    let script = format!("{}/examples/jax_ddp.py", repo().display());
    wait_for(Duration::from_secs(30), "no training process left", || {
        pids_with_cmdline(&[&script]).is_empty().then_some(())
    });
}
