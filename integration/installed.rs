//! An installed `gpuam` works from any directory: `gpuam run JOB` and `gpuam plan JOB` in a
//! directory without `conf/` use the demo cluster and the settings built into the binary; a
//! `conf/cluster.yaml` there, or `--cluster FILE`, still wins (as in the source tree).

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
