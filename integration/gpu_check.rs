//! `scripts/gpu-check.sh` (the check made for a real NVIDIA machine, docs/GPU.md) run here,
//! as root, against the fake `nvidia-smi` of `integration/gpu_check/` (one NVIDIA H200,
//! H200-like output for every call the script and `gpuam node --gpus auto` make) and this
//! machine's Python, which has no GPU: the real `gpuam rm` and `gpuam node`, real jobs,
//! real task processes as the task user. What must hold without a GPU: the node registers
//! what the fake reports (1 × H200 with its topology), every section is in the report, the
//! training step and the shares are reported as not on a GPU (and the check fails), the
//! no-GPU task's view is reported, and nothing the script started is left running. A second
//! run with an `nvidia-smi` that finds no device reports that and skips the GPU jobs. The
//! health read goes through `integration/gpu_check/pystub/pynvml.py`, a stand-in for
//! NVIDIA's library, in the first run, and through the failing `nvidia-smi -q` in the second.
//!
//! Uses `target/jax-venv` (JAX on the CPU, `.ci/run` builds it) when it exists, so that the
//! training step's CPU half runs for real; else `/usr/bin/python3` without a framework.
//! Every wait is bounded; the script is killed by pid if it overruns.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A free loopback port (bound, then released for the script's process to take).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// Kills the script (by pid) if a test fails while it runs.
struct Script(Child);

impl Drop for Script {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Runs `bash scripts/gpu-check.sh OUT` with `fake_dir` first on PATH; returns the exit
/// code and the report.
/// `pystub`: a directory put on PYTHONPATH (the script's own Python calls, not the tasks').
fn run_check(fake_dir: &Path, out: &Path, python: &Path, pystub: Option<&Path>) -> (i32, String) {
    let path = format!("{}:{}", fake_dir.display(), std::env::var("PATH").unwrap_or_default());
    let log = fs::File::create(out.with_extension("log")).expect("the script's log file");
    let mut cmd = Command::new("bash");
    if let Some(dir) = pystub {
        cmd.env("PYTHONPATH", dir);
    }
    let child = cmd
        .arg(repo().join("scripts/gpu-check.sh"))
        .arg(out)
        .current_dir(repo())
        .env("PATH", path)
        .env("GPUAM_BIN", env!("CARGO_BIN_EXE_gpuam"))
        .env("GPU_CHECK_PYTHON", python)
        .env("GPU_CHECK_RM_PORT", free_port().to_string())
        .env("GPU_CHECK_NODE_PORT", free_port().to_string())
        .env("GPU_CHECK_HOLD_SEC", "2")
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("bash runs scripts/gpu-check.sh");
    let mut script = Script(child);
    // The script bounds itself (270 s budget + watchdog); a loaded CI machine gets more.
    let deadline = Instant::now() + Duration::from_secs(420);
    let status = loop {
        if let Some(s) = script.0.try_wait().expect("wait for the script") {
            break s;
        }
        assert!(Instant::now() < deadline, "gpu-check.sh ran past 420 s");
        std::thread::sleep(Duration::from_millis(200));
    };
    let report = fs::read_to_string(out.join("gpu-check-report.txt")).unwrap_or_else(|e| {
        let log = fs::read_to_string(out.with_extension("log")).unwrap_or_default();
        panic!("no report ({e}); the script said:\n{log}")
    });
    (status.code().unwrap_or(-1), report)
}

/// The work dir the report names (`/tmp/gpu-check.XXXXXX`).
fn work_dir_of(report: &str) -> String {
    let at = report
        .find("/tmp/gpu-check.")
        .unwrap_or_else(|| panic!("the report names its work dir:\n{report}"));
    report[at..at + "/tmp/gpu-check.XXXXXX".len()].to_string()
}

/// Processes whose command line or working directory names `dir`.
fn processes_in(dir: &str) -> Vec<String> {
    let mut out = Vec::new();
    for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let p = e.path();
        let cmd = fs::read(p.join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        let cwd = fs::read_link(p.join("cwd")).unwrap_or_default();
        if cmd.contains(dir) || cwd.starts_with(dir) {
            out.push(format!("{}: {cmd}", p.display()));
        }
    }
    out
}

fn assert_line(report: &str, start: &str) {
    assert!(
        report.lines().any(|l| l.starts_with(start)),
        "no line starting `{start}` in the report:\n{report}"
    );
}

#[test]
fn gpu_check_against_a_fake_h200_and_a_machine_without_gpus() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "gpu-check.sh starts a node agent, which runs tasks as another user: run this test as root"
    );
    let tmp = tempfile::tempdir().expect("a temporary directory");
    let venv = repo().join("target/jax-venv/bin/python");
    let with_jax = venv.exists();
    let python = if with_jax {
        venv
    } else {
        PathBuf::from("/usr/bin/python3")
    };

    // Usage errors exit 64 before starting anything.
    let st = Command::new("bash")
        .arg(repo().join("scripts/gpu-check.sh"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("bash");
    assert_eq!(st.code(), Some(64), "no OUTDIR: usage error");

    // 1. One fake H200, and a stand-in for NVIDIA's pynvml for the health read.
    let out = tmp.path().join("h200");
    let fake = repo().join("integration/gpu_check");
    let (code, report) = run_check(&fake, &out, &python, Some(&fake.join("pystub")));
    assert_eq!(code, 1, "no GPU computes here, so the check fails:\n{report}");
    for n in 1..=8 {
        assert!(
            report.contains(&format!("\n== {n}. ")),
            "section {n} missing:\n{report}"
        );
    }
    assert_line(
        &report,
        "PASS registration.count: the node registered 1 GPUs, nvidia-smi lists 1",
    );
    assert_line(
        &report,
        "PASS registration.type: gpuType `H200` is a word of `NVIDIA H200`",
    );
    assert_line(
        &report,
        "PASS registration.topology: the node's topology has the 1 GPU columns",
    );
    assert!(
        report.contains("143771 MiB per GPU"),
        "GPU memory from nvidia-smi:\n{report}"
    );
    assert!(
        report.contains("mlx5_0"),
        "the NIC of the fake topo -m is registered:\n{report}"
    );
    assert_line(
        &report,
        "FAIL train: no training step on granted GPU 0 (CUDA_VISIBLE_DEVICES='0'",
    );
    assert_line(
        &report,
        "PASS no_gpu.env: the task was given CUDA_VISIBLE_DEVICES='' and NVIDIA_VISIBLE_DEVICES=none",
    );
    assert_line(&report, "SEEN no_gpu.isolation: BLOCKED");
    assert_line(
        &report,
        "PASS shares.granted: both tasks were granted 0.5 of GPU 0 and ran at once",
    );
    assert_line(&report, "FAIL shares.on_gpu");
    assert_line(&report, "SEEN shares.compute_apps: no sample lists both task pids");
    assert_line(
        &report,
        "PASS health.gpu0: NVIDIA H200: 31 C, ECC on, volatile uncorrected 0",
    );
    assert!(report.contains("read through NVML (pynvml)"), "{report}");
    assert_line(&report, "PASS cleanup: nothing left running");
    assert_line(&report, "RESULT: FAIL");
    let train: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(out.join("raw/train.json")).expect("raw/train.json"))
            .expect("train.json is JSON");
    assert_eq!(train["CUDA_VISIBLE_DEVICES"], "0", "{train}");
    assert_ne!(train["uid"], 0, "the task does not run as root: {train}");
    if with_jax {
        assert!(
            train["framework"].as_str().is_some_and(|f| f.starts_with("jax "))
                && train["cpu_step_ms"].as_f64().is_some_and(|ms| ms > 0.0)
                && train["gpus_visible"] == 0,
            "JAX ran the CPU step and saw no GPU: {train}"
        );
    }
    let work = work_dir_of(&report);
    assert!(!Path::new(&work).exists(), "the script removes its work dir {work}");
    let left = processes_in(&work);
    assert!(left.is_empty(), "left running: {left:?}");

    // 2. An nvidia-smi that finds no device (exit 6, as the real one): reported, GPU jobs
    //    skipped, the check fails, nothing left.
    let none = tmp.path().join("no-devices");
    fs::create_dir_all(&none).expect("dir");
    let smi = none.join("nvidia-smi");
    fs::write(&smi, "#!/bin/sh\necho 'No devices were found'\nexit 6\n").expect("fake");
    {
        use std::os::unix::fs::PermissionsExt as _;
        fs::set_permissions(&smi, fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let out = tmp.path().join("none");
    let (code, report) = run_check(&none, &out, &python, None);
    assert_eq!(code, 1, "{report}");
    assert_line(
        &report,
        "FAIL registration.count: the node registered 0 GPUs, nvidia-smi lists 0",
    );
    assert_line(&report, "FAIL train: not run (no node with the machine's GPUs");
    assert_line(&report, "FAIL shares.granted: not run");
    assert_line(&report, "SEEN no_gpu.isolation: BLOCKED");
    assert_line(&report, "FAIL health: neither NVML nor nvidia-smi -q answered");
    assert_line(&report, "PASS cleanup: nothing left running");
    assert!(
        report.contains("No devices were found"),
        "nvidia-smi's words are in the report:\n{report}"
    );
    let work = work_dir_of(&report);
    let left = processes_in(&work);
    assert!(left.is_empty(), "left running: {left:?}");
}

/// `verdicts.py` on results as a real GPU run writes them (which cannot be produced here):
/// the training step, the shares and their `nvidia-smi --query-compute-apps` sample pass,
/// a task that computed on a GPU without a grant is reported as REACHED, and an unhealthy
/// GPU fails.
#[test]
fn verdicts_pass_what_a_gpu_run_writes() {
    let tmp = tempfile::tempdir().expect("a temporary directory");
    let d = tmp.path();
    let verdicts = |args: &[&str]| -> (i32, String) {
        let out = Command::new("python3")
            .arg(repo().join("scripts/gpu_check/verdicts.py"))
            .args(args)
            .output()
            .expect("python3 runs verdicts.py");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let write = |name: &str, v: serde_json::Value| {
        let p = d.join(name);
        fs::write(&p, v.to_string()).expect("write");
        p.display().to_string()
    };
    let train = write(
        "train.json",
        serde_json::json!({"CUDA_VISIBLE_DEVICES": "0", "device": "cuda:0", "gpu_name": "NVIDIA H200",
            "framework": "torch 2.9.0", "gpu_step_ms": 0.61, "cpu_step_ms": 48.2, "cpu_over_gpu": 79.0,
            "shape": "MLP", "uid": 999, "gpus_visible": 1,
            "also": {"framework": "jax 0.8.0", "device": "cuda:0", "gpu_name": "NVIDIA H200",
                "gpu_step_ms": 0.52, "cpu_step_ms": 40.1}}),
    );
    let (code, out) = verdicts(&["train", &train]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.starts_with("PASS train: torch 2.9.0 trained on cuda:0 (NVIDIA H200)"),
        "{out}"
    );
    assert!(
        out.contains("0.61 ms/step on the GPU, 48.2 ms/step on the CPU (79.0x)"),
        "{out}"
    );

    for (i, pid) in [(0, 4101), (1, 4102)] {
        write(
            &format!("share-{i}.json"),
            serde_json::json!({"task_index": i.to_string(), "pid": pid, "CUDA_VISIBLE_DEVICES": "0",
                "GPUAM_GPU_FRACTION": "0.5", "on_gpu": true, "gpu_steps": 900,
                "hold_start": 100.0 + f64::from(i), "hold_end": 108.0 + f64::from(i)}),
        );
    }
    let samples = d.join("samples.txt");
    fs::write(
        &samples,
        "--- sample 1 at +40 s\npid, process_name, used_gpu_memory [MiB]\n\
         --- sample 2 at +41 s\npid, process_name, used_gpu_memory [MiB]\n\
         4101, /usr/bin/python3, 1530 MiB\n4102, /usr/bin/python3, 1530 MiB\n",
    )
    .expect("samples");
    let (code, out) = verdicts(&["shares", &d.display().to_string(), &samples.display().to_string()]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("PASS shares.granted: both tasks were granted 0.5 of GPU 0 and ran at once for 7.0 s"),
        "{out}"
    );
    assert!(out.contains("PASS shares.on_gpu"), "{out}");
    assert!(
        out.contains("PASS shares.compute_apps: one nvidia-smi --query-compute-apps sample lists both task pids"),
        "{out}"
    );

    let reached = write(
        "no_gpu.json",
        serde_json::json!({"granted_CUDA_VISIBLE_DEVICES": "", "granted_NVIDIA_VISIBLE_DEVICES": "none",
            "open": {"/dev/nvidia0": "opened"}, "verdict": "REACHED", "computed": "sum on cuda:0 = 1024.0",
            "framework": "torch 2.9.0"}),
    );
    let (code, out) = verdicts(&["no_gpu", &reached]);
    assert_eq!(code, 0, "isolation is reported, not judged: {out}");
    assert!(
        out.contains("SEEN no_gpu.isolation: REACHED: it computed on a GPU anyway"),
        "{out}"
    );

    let sick = write(
        "health.json",
        serde_json::json!({"source": "NVML", "gpus": [{"index": 0, "name": "NVIDIA H200", "temperature_c": 40,
            "ecc_enabled": true, "ecc_volatile_uncorrected": 2, "remapped_rows": null, "power_w": 80.0,
            "power_limit_w": 700.0, "pstate": 0, "healthy": false,
            "problems": ["2 uncorrected ECC errors since the driver loaded"]}]}),
    );
    let (code, out) = verdicts(&["health", &sick]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAIL health.gpu0: NVIDIA H200") && out.contains("2 uncorrected ECC errors"),
        "{out}"
    );
}
