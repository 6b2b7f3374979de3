//! An installed `gpuam` works from any directory: `gpuam run JOB` and `gpuam plan JOB` in a
//! directory without `conf/` use the demo cluster and the settings built into the binary; a
//! `conf/cluster.yaml` there, or `--cluster FILE`, still wins (as in the source tree).
//! README's commands work as written from a clone: the simulator's traces are in the
//! repository, and `$(gpuam ray-node-args ...)` passes its words to `ray start` unchanged.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn job() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/single-gpu.yaml")
}

fn temp_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("jax-installed-{}-", std::process::id()))
        .tempdir()
        .unwrap()
}

/// `gpuam run JOB [args]` with `dir` as the working directory and none of the caller's
/// GPUAM_* variables (so no GPUAM_CONFIG points back into the source tree).
fn run_in(dir: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpuam"));
    cmd.arg("run")
        .arg(job())
        .args(args)
        .arg("--work-dir")
        .arg(dir.join("work"));
    cmd.current_dir(dir);
    for (k, _) in std::env::vars() {
        if k.starts_with("GPUAM") {
            cmd.env_remove(k);
        }
    }
    // The test's private directory is not theirs to reach: tasks run as the RM's user.
    cmd.env("GPUAM__NODE__IN_PROCESS_IDENTITY", "false");
    cmd.output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

const ONE_NODE: &str = "nodes:\n  - host: HOST\n    cpu: 8\n    memoryMB: 16000\n    gpus: 2\n";

#[test]
fn runs_outside_the_source_tree_on_the_built_in_demo_cluster() {
    let dir = temp_dir();
    let out = run_in(dir.path(), &[]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "{all}");
    assert!(!all.contains("cannot read"), "{all}");
    assert!(
        all.contains("built-in demo cluster"),
        "says where the cluster came from:\n{all}"
    );
    assert!(all.contains("Succeeded"), "{all}");
    // The task ran on one of the demo cluster's GPU hosts.
    let demo = gpuam::cluster::file::parse_cluster_file(gpuam::config::BUILT_IN_CLUSTER, "built-in").unwrap();
    let line = all
        .lines()
        .find(|l| l.starts_with("task main/0 running on "))
        .unwrap_or_else(|| panic!("{all}"));
    let host = line["task main/0 running on ".len()..].split(' ').next().unwrap();
    assert!(demo.iter().any(|n| n.host == host), "{host} is a demo host");
}

#[test]
fn a_cluster_file_in_the_directory_or_on_the_command_line_wins() {
    let dir = temp_dir();
    fs::create_dir_all(dir.path().join("conf")).unwrap();
    fs::write(
        dir.path().join("conf/cluster.yaml"),
        ONE_NODE.replace("HOST", "dir-node"),
    )
    .unwrap();
    let out = run_in(dir.path(), &[]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "{all}");
    assert!(all.contains("task main/0 running on dir-node "), "{all}");
    assert!(!all.contains("built-in demo cluster"), "{all}");

    let flag = dir.path().join("mine.yaml");
    fs::write(&flag, ONE_NODE.replace("HOST", "flag-node")).unwrap();
    let out = run_in(dir.path(), &["--cluster", flag.to_str().unwrap()]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "{all}");
    assert!(all.contains("task main/0 running on flag-node "), "{all}");
}

#[test]
fn plan_needs_no_cluster_flag_either() {
    let dir = temp_dir();
    let plan = |dir: &Path| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpuam"));
        cmd.arg("plan").arg(job()).arg("--json").current_dir(dir);
        for (k, _) in std::env::vars() {
            if k.starts_with("GPUAM") {
                cmd.env_remove(k);
            }
        }
        cmd.output().unwrap()
    };
    let out = plan(dir.path());
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "{all}");
    assert!(
        all.contains("built-in demo cluster"),
        "says where the cluster came from:\n{all}"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {all}"));
    let demo = gpuam::cluster::file::parse_cluster_file(gpuam::config::BUILT_IN_CLUSTER, "built-in").unwrap();
    let hosts: Vec<&str> = v["placements"]
        .as_array()
        .unwrap_or_else(|| panic!("no placements array: {v}"))
        .iter()
        .filter_map(|t| t["host"].as_str())
        .collect();
    assert_eq!(hosts.len(), 1, "{v}");
    assert!(demo.iter().any(|n| n.host == hosts[0]), "{} is a demo host", hosts[0]);

    // A conf/cluster.yaml in the directory wins, as for `run`.
    fs::create_dir_all(dir.path().join("conf")).unwrap();
    fs::write(
        dir.path().join("conf/cluster.yaml"),
        ONE_NODE.replace("HOST", "dir-node"),
    )
    .unwrap();
    let out = plan(dir.path());
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "{all}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"dir-node\""), "{all}");
}

/// `gpuam` with no GPUAM_* variable of the caller's, in `dir`.
fn gpuam_in(dir: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpuam"));
    cmd.args(args).current_dir(dir);
    for (k, _) in std::env::vars() {
        if k.starts_with("GPUAM") {
            cmd.env_remove(k);
        }
    }
    cmd.output().unwrap()
}

/// README's `gpuam sim --workload philly ...` runs from the repository root with nothing
/// outside it: the default trace directory is the repository's `data/traces/`, whose files
/// git tracks (so a clone has them). Kept small: a window of 100 jobs, one seed.
#[test]
fn readme_sim_on_a_trace_runs_from_the_repository_root() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = fs::read_to_string(root.join("README.md")).unwrap();
    let line = readme
        .lines()
        .find(|l| l.starts_with("gpuam sim --workload philly"))
        .expect("README shows `gpuam sim --workload philly ...`");
    let command = line.split('#').next().unwrap();
    let out_dir = temp_dir();
    let out_path = out_dir.path().join("q-out");
    let mut args: Vec<String> = Vec::new();
    let mut words = command.split_whitespace().skip(1).peekable();
    while let Some(w) = words.next() {
        if w == "--out" {
            words.next();
            args.extend(["--out".to_string(), out_path.display().to_string()]);
        } else {
            args.push(w.to_string());
        }
    }
    args.extend(["--jobs", "100", "--seeds", "1"].map(str::to_string));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = gpuam_in(root, &argv);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "gpuam {}:\n{all}", argv.join(" "));
    assert!(all.contains("philly, 100 jobs"), "{all}");
    assert!(out_path.join("queues_share.svg").is_file(), "{all}");

    // Every file the simulator reads is tracked, with the README naming sources and licences.
    if root.join(".git").exists() {
        let ls = Command::new("git")
            .args(["ls-files", "data/traces"])
            .current_dir(root)
            .output()
            .unwrap();
        let tracked = String::from_utf8_lossy(&ls.stdout);
        for f in [
            "data/traces/README.md",
            "data/traces/replay/philly_machines.csv",
            "data/traces/replay/philly_pass_ge4gpu_jobs.csv",
            "data/traces/replay/alibaba_v2023_machines.csv",
            "data/traces/replay/alibaba_v2023_default_jobs.csv",
        ] {
            assert!(tracked.lines().any(|l| l == f), "{f} is not tracked by git:\n{tracked}");
        }
    }
    let licences = fs::read_to_string(root.join("data/traces/README.md")).unwrap();
    assert!(
        licences.contains("CC BY 4.0") && licences.contains("licence"),
        "{licences}"
    );

    // Elsewhere, without the traces, the error says where they are expected.
    let away = temp_dir();
    let out = gpuam_in(
        away.path(),
        &["sim", "--workload", "philly", "--jobs", "10", "--seeds", "1"],
    );
    let all = text(&out);
    assert_eq!(out.status.code(), Some(65), "{all}");
    assert!(all.contains("data/traces") && all.contains("--traces"), "{all}");
}

/// README's `ray start --address HEAD:6379 $(gpuam ray-node-args ...)`: a real shell's
/// command substitution hands `ray start` exactly the words the scheme makes, no quote
/// left in them (a substitution removes none).
#[test]
fn ray_node_args_survive_a_shell_command_substitution() {
    let dir = temp_dir();
    let bin = env!("CARGO_BIN_EXE_gpuam");
    let args = [
        "ray-node-args",
        "--host",
        "gpu-a1",
        "--rack",
        "/dc1/r7",
        "--gpus",
        "4",
        "--topology",
        "pcie4",
        "--gpu-type",
        "A100",
        "--resource",
        "nvme=2",
    ];
    let direct = gpuam_in(dir.path(), &args);
    assert_eq!(direct.status.code(), Some(0), "{}", text(&direct));
    let out = Command::new("bash")
        .arg("-c")
        .arg("set -- $(\"$GPUAM_BIN\" \"$@\"); printf '%s\\n' \"$@\"")
        .arg("bash")
        .args(args)
        .env("GPUAM_BIN", bin)
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let words: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(
        words,
        vec![
            "--num-gpus=0".to_string(),
            r#"--resources={"gpuam-gpu-0":1,"gpuam-gpu-1":1,"gpuam-gpu-2":1,"gpuam-gpu-3":1,"gpuam-node-gpu-a1":1,"nvme":2}"#
                .to_string(),
            "--labels=gpuam.io/rack=dc1.r7,gpuam.io/gpu-type=A100,gpuam.io/ports=20000-29999,gpuam.io/topology=pcie4"
                .to_string(),
        ],
        "printed: {}",
        String::from_utf8_lossy(&direct.stdout)
    );
    // The JSON is what Ray parses.
    let json: serde_json::Value = serde_json::from_str(words[1].strip_prefix("--resources=").unwrap()).unwrap();
    assert_eq!(json["nvme"], 2);
}
