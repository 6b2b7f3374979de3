//! GPU device isolation in the kernel, attacked: a task tries to open every GPU's device
//! node (nodes this test makes with `mknod`, NVIDIA's character major 195, minors 0..3,
//! and `nvidiactl` 195:255) and must open only its granted GPUs' (and the control node when
//! it has a GPU), under each containment the machine offers: cgroup v2 (a device program),
//! cgroup v1 (the devices controller) and the subreaper shim (a private `/dev`).
//!
//! No NVIDIA driver is loaded here, so an open the filter lets through fails in the driver
//! lookup with ENXIO ("No such device or address"); one the filter refuses fails before,
//! with EPERM ("Operation not permitted") under a cgroup, or EACCES ("Permission denied")
//! on the shim's inaccessible node. Tasks run as `nobody`, as an agent's tasks run as an
//! unprivileged user. Needs root (mknod, cgroups, mount namespaces); skipped otherwise.

#[path = "common/exec.rs"]
mod exec;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use exec::{ctx, executor, next_exit, root};
use gpuam::node::cgroup::{Choice, Containment, Mechanism};
use gpuam::node::executor::{Executor, ExecutorOptions, RunAs};
use gpuam::node::NodeEvent;
use gpuam::protocol::LaunchContext;
use gpuam::resources::Resources;
use tokio::sync::mpsc;

const NODES: [&str; 5] = ["nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl"];

/// A directory of stand-in NVIDIA device nodes (195:0..3 and nvidiactl 195:255), 0666 as
/// the driver makes them, in a directory `nobody` can enter.
fn fake_dev(base: &Path) -> PathBuf {
    let dev = base.join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    for (name, minor) in NODES.iter().zip([0u32, 1, 2, 3, 255]) {
        let p = std::ffi::CString::new(dev.join(name).into_os_string().into_encoded_bytes()).unwrap();
        // SAFETY: plain syscall on a NUL-terminated path.
        let r = unsafe { libc::mknod(p.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(195, minor)) };
        assert_eq!(r, 0, "mknod {name}: {}", std::io::Error::last_os_error());
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dev.join(name), std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    dev
}

fn open_up(p: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The task: tries to open each node read-write and prints `name: how` per line.
fn probe(dev: &Path) -> LaunchContext {
    let d = dev.display();
    let script = format!(
        "for n in {}; do if msg=$( ( exec 3<>{d}/$n ) 2>&1 ); then echo \"$n: OPENED\"; else echo \"$n: $msg\"; fi; done",
        NODES.join(" ")
    );
    ctx(&script)
}

/// What the probe said for each node: `ok` (the filter let it through: opened, or ENXIO
/// from the absent driver), `refused` (EPERM or EACCES), or the message.
fn outcome(stdout: &str) -> BTreeMap<String, String> {
    stdout
        .lines()
        .filter_map(|l| l.split_once(": "))
        .map(|(n, msg)| {
            let how = if msg.contains("OPENED") || msg.contains("No such device or address") {
                "ok".to_string()
            } else if msg.contains("Operation not permitted") || msg.contains("Permission denied") {
                "refused".to_string()
            } else {
                msg.to_string()
            };
            (n.to_string(), how)
        })
        .collect()
}

/// An executor whose tasks run as `nobody`.
fn as_nobody(dir: &Path, containment: Containment) -> (Executor, mpsc::UnboundedReceiver<NodeEvent>) {
    executor(
        dir,
        ExecutorOptions {
            containment,
            run_as: Some(RunAs::lookup("nobody").unwrap()),
            ..Default::default()
        },
    )
}

/// Runs the probe in container `id` granted the GPUs of `mask`; what it could open.
async fn probe_with(
    exec: &Executor,
    rx: &mut mpsc::UnboundedReceiver<NodeEvent>,
    dev: &Path,
    id: &str,
    mask: u64,
) -> BTreeMap<String, String> {
    let granted = Resources::with_mask(1, 0, mask, Default::default());
    exec.start(id, "h", &granted, probe(dev)).unwrap();
    let (got, code, why) = next_exit(rx).await;
    assert_eq!((got.as_str(), code), (id, 0), "{why}");
    let out = std::fs::read_to_string(exec.container_dir(id).unwrap().join("stdout")).unwrap();
    outcome(&out)
}

fn expect(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
}

/// The attack under one containment: granted GPU 1, then GPUs 0 and 3, then none.
async fn attack(containment: Containment, tag: &str) {
    let tmp = tempfile::tempdir().unwrap();
    open_up(tmp.path());
    let dev = fake_dev(tmp.path());
    let (exec, mut rx) = as_nobody(tmp.path(), containment.with_device_dir(dev.clone()));
    std::fs::create_dir_all(tmp.path().join("containers")).unwrap();
    open_up(&tmp.path().join("containers"));

    let got = probe_with(&exec, &mut rx, &dev, &format!("{tag}-gpu1"), 0b0010).await;
    assert_eq!(
        got,
        expect(&[
            ("nvidia0", "refused"),
            ("nvidia1", "ok"),
            ("nvidia2", "refused"),
            ("nvidia3", "refused"),
            ("nvidiactl", "ok"),
        ]),
        "granted GPU 1 ({tag})"
    );
    let got = probe_with(&exec, &mut rx, &dev, &format!("{tag}-gpu03"), 0b1001).await;
    assert_eq!(
        got,
        expect(&[
            ("nvidia0", "ok"),
            ("nvidia1", "refused"),
            ("nvidia2", "refused"),
            ("nvidia3", "ok"),
            ("nvidiactl", "ok"),
        ]),
        "granted GPUs 0 and 3 ({tag})"
    );
    let got = probe_with(&exec, &mut rx, &dev, &format!("{tag}-none"), 0).await;
    assert_eq!(
        got,
        expect(&[
            ("nvidia0", "refused"),
            ("nvidia1", "refused"),
            ("nvidia2", "refused"),
            ("nvidia3", "refused"),
            ("nvidiactl", "refused"),
        ]),
        "no GPU ({tag})"
    );
}

#[tokio::test]
async fn another_gpus_node_cannot_be_opened_under_cgroup_v2() {
    if !root() {
        return;
    }
    let c = Containment::detect("gpuam-test-23b-dev-v2");
    if c.mechanism() != Mechanism::V2 {
        eprintln!("skipped: no cgroup v2 here ({})", c.describe());
        return;
    }
    assert!(c.describe().contains("v2 device program"), "{}", c.describe());
    attack(c.clone(), "v2").await;
    c.remove_parents();
}

/// Also a task that makes a node of its own (root may `mknod`) with another GPU's
/// numbers in its own directory cannot open it: the program checks numbers, not paths.
#[tokio::test]
async fn a_node_made_elsewhere_is_refused_too_under_cgroup_v2() {
    if !root() {
        return;
    }
    let c = Containment::detect("gpuam-test-23b-dev-v2b");
    if c.mechanism() != Mechanism::V2 {
        eprintln!("skipped: no cgroup v2 here");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dev = fake_dev(tmp.path());
    // Root tasks (no run_as): mknod is allowed by the filter, opening is not.
    let (exec, mut rx) = executor(
        tmp.path(),
        ExecutorOptions {
            containment: c.clone().with_device_dir(dev),
            ..Default::default()
        },
    );
    let cmd = "mknod mine c 195 2 && if msg=$( ( exec 3<>mine ) 2>&1 ); then echo \"mine: OPENED\"; else echo \"mine: $msg\"; fi";
    let granted = Resources::with_mask(1, 0, 0b0010, Default::default());
    exec.start("v2-mknod", "h", &granted, ctx(cmd)).unwrap();
    let (_, code, why) = next_exit(&mut rx).await;
    assert_eq!(code, 0, "{why}");
    let out = std::fs::read_to_string(exec.container_dir("v2-mknod").unwrap().join("stdout")).unwrap();
    assert_eq!(outcome(&out), expect(&[("mine", "refused")]), "{out}");
    c.remove_parents();
}

#[tokio::test]
async fn another_gpus_node_cannot_be_opened_under_cgroup_v1() {
    if !root() {
        return;
    }
    let c = Containment::choose(Choice::V1, "gpuam-test-23b-dev-v1", None).unwrap();
    if c.mechanism() != Mechanism::V1 || !c.describe().contains("v1 devices controller") {
        eprintln!("skipped: no cgroup v1 devices hierarchy here ({})", c.describe());
        c.remove_parents();
        return;
    }
    attack(c.clone(), "v1").await;
    c.remove_parents();
}

#[tokio::test]
async fn another_gpus_node_cannot_be_opened_under_the_shim() {
    if !root() {
        return;
    }
    let c = Containment::subreaper(PathBuf::from(env!("CARGO_BIN_EXE_gpuam")));
    assert!(c.describe().contains("private /dev"), "{}", c.describe());
    attack(c, "shim").await;
}

/// What a device filter adds to a container's start: `Containment::create` of 50
/// containers with the filter (`gpus: Some(mask)`: scan, emit, `BPF_PROG_LOAD`, attach)
/// and 50 without, timed; prints the figures, asserts nothing about time. Run with
/// `cargo test --test devices -- --ignored --nocapture device_filter_cost`.
#[test]
#[ignore = "benchmark: prints figures (docs/BENCHMARKS.md)"]
fn device_filter_cost() {
    if !root() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dev = fake_dev(tmp.path());
    let c = Containment::detect("gpuam-test-23b-dev-cost").with_device_dir(dev);
    let n = 50;
    let time = |gpus: Option<u64>, tag: &str| {
        let t = std::time::Instant::now();
        for i in 0..n {
            let limits = gpuam::node::cgroup::Limits {
                gpus,
                ..Default::default()
            };
            let cg = c.create(&format!("{tag}-{i}"), limits).unwrap();
            cg.remove();
        }
        t.elapsed() / n
    };
    let without = time(None, "plain");
    let with = time(Some(0b0010), "filtered");
    let t = std::time::Instant::now();
    for _ in 0..n {
        std::hint::black_box(gpuam::node::devices::scan(Path::new("/dev")));
    }
    let scan = t.elapsed() / n;
    println!(
        "device filter cost ({}): create+remove without {without:?}, with {with:?} per container; of which a scan of /dev {scan:?}",
        c.describe()
    );
    c.remove_parents();
}
