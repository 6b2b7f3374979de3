//! Tasks in their image: when a task's environment names an image (`GPUAM_IMAGE`, set by
//! the AM from an OpenPAI role's `dockerImage` prerequisite) and the node has podman with
//! runc, the executor runs the task's `launch.sh` inside that image instead of on the host.
//!
//! [`podman_command`] is the pure part: from the launch context (container directory,
//! environment, granted GPU mask, the node's NVIDIA device nodes, resource limits) it builds
//! the command to spawn. [`program_for`] is the I/O shell the executor calls: it finds the
//! runtime, the device nodes and the limits, applies `node.run_without_image`, and notes
//! in the task's stderr when a task that names an image runs on the host.
//!
//! What the command does:
//! - `--runtime runc`: Debian's default runtime crun refuses this kind of host's hybrid
//!   cgroup layout; runc runs it;
//! - `--ulimit nproc=N:N --ulimit nofile=N:N` at the executor's own hard limits: podman's
//!   defaults are higher than a process without CAP_SYS_RESOURCE may set;
//! - `--network host`: peers reach the task at the node's address and its granted ports,
//!   as with OpenPAI's `hostNetwork: true`;
//! - the container directory is mounted at the same path and is the working directory, so
//!   `launch.sh`, its exit-status file and the logs work unchanged;
//! - GPUs: `/dev/nvidia<i>` for the granted mask only, plus the shared control nodes
//!   (`nvidiactl`, `nvidia-uvm`, …) when any GPU is granted; `NVIDIA_VISIBLE_DEVICES` is
//!   already in the environment. Character devices are passed with `--device`; a plain
//!   file standing in for one (tests on machines without GPUs) is bind-mounted read-only;
//! - `--shm-size` from `GPUAM_SHM_MB` (OpenPAI `extraContainerOptions.shmMB`);
//! - every variable of the task's environment except PATH and HOME (the image's own) is
//!   passed by name (`--env NAME`), so values never appear on a command line.
//!
//! - the container's first process passes a stop's SIGTERM to everything in it, and
//!   [`reap`] removes the container when the executor declares the task ended.
//!
//! Images come from the node's local store (`podman images`); pulling from a registry is
//! podman's own business.

use std::path::{Path, PathBuf};

/// The environment variable naming a task's image.
pub const IMAGE_ENV: &str = "GPUAM_IMAGE";
/// The environment variable with the image's /dev/shm size in MB.
pub const SHM_ENV: &str = "GPUAM_SHM_MB";
/// Where the node looks for NVIDIA device nodes (default `/dev`); tests point it at a
/// directory of stand-in files.
pub const DEV_DIR_ENV: &str = "GPUAM_NVIDIA_DEV_DIR";

/// An NVIDIA device node of the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceNode {
    pub path: PathBuf,
    /// `Some(i)` for `/dev/nvidia<i>`; `None` for the shared nodes (`nvidiactl`, `nvidia-uvm`, …).
    pub gpu: Option<u32>,
    /// A real character device (`--device`); otherwise a stand-in file (bind-mounted).
    pub is_char_device: bool,
}

/// The OCI runtime found on the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Runtime {
    pub podman: PathBuf,
    pub runc: PathBuf,
}

/// Everything the command depends on.
#[derive(Clone, Debug)]
pub struct ImageLaunch<'a> {
    pub image: &'a str,
    pub container_id: &'a str,
    pub dir: &'a Path,
    pub env: &'a [(String, String)],
    pub gpu_mask: u64,
    pub devices: &'a [DeviceNode],
    pub shm_mb: Option<u32>,
    /// (nproc, nofile) limits to set, at or below the executor's hard limits.
    pub limits: (u64, u64),
    pub runtime: &'a Runtime,
}

/// The program and arguments to spawn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spawn {
    pub program: PathBuf,
    pub args: Vec<String>,
    /// The program is bash running `launch.sh` on the host with the stdin it is given, so
    /// the script itself can hold the task ([`crate::node::executor::hold`]); false for an
    /// image's runtime, which the node holds from outside.
    pub host_script: bool,
}

/// The container's first process: runs `launch.sh` with bash where the image has it
/// (OpenPAI's commands are bash), else POSIX sh, which the launch script is written for.
/// It runs the script in the background and waits, so that the SIGTERM podman forwards
/// (a stop) is handled at once: everything in the container gets it (`kill -1`), which a
/// shell waiting for a foreground command would delay until that command ended.
const CONTAINER_INIT: &str = "trap 'kill -TERM -1 2>/dev/null; wait; exit 143' TERM INT; \
if command -v bash >/dev/null 2>&1; then bash launch.sh & else sh launch.sh & fi; \
wait $!";

/// The file in a container's directory that says it runs in an image (holding the podman
/// container's name).
const IMAGE_MARK: &str = "image-container";

/// podman's name for gpuam's container `id`.
pub fn container_name(id: &str) -> String {
    format!("gpuam-{id}")
}

/// Makes sure a task's podman container is gone once the executor considers the task
/// ended: a podman client killed with SIGKILL (a stop past its grace, an RM going down)
/// leaves the container running under conmon, holding GPUs and ports the ledger is about
/// to give back. No-op for tasks that ran on the host.
///
/// `record` is the container's record (the node's, which its task cannot write): the
/// mark there only says that it ran in an image; the name is made from the container id
/// (checked when it started), never read from a file, and follows `--`.
pub async fn reap(record: &Path, id: &str) {
    if std::fs::symlink_metadata(record.join(IMAGE_MARK)).is_err() || !super::executor::valid_container_id(id) {
        return;
    }
    let name = container_name(id);
    let Some(runtime) = find_runtime() else { return };
    let out = tokio::process::Command::new(&runtime.podman)
        .args(["rm", "--force", "--ignore", "--time", "2", "--", name.as_str()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .output()
        .await;
    match out {
        Ok(o) if o.status.success() => {}
        Ok(o) => tracing::warn!(
            container = name.as_str(),
            "podman rm failed: {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => tracing::warn!(container = name.as_str(), "cannot run podman rm: {e}"),
    }
}

/// The device nodes a task with `mask` gets: its GPUs' and, if it has any, the shared ones.
pub fn granted_devices(devices: &[DeviceNode], mask: u64) -> Vec<&DeviceNode> {
    if mask == 0 {
        return Vec::new();
    }
    devices
        .iter()
        .filter(|d| match d.gpu {
            Some(i) => i < 64 && mask & (1u64 << i) != 0,
            None => true,
        })
        .collect()
}

/// The podman command that runs the container's `launch.sh` in `l.image`.
pub fn podman_command(l: &ImageLaunch<'_>) -> Spawn {
    let dir = l.dir.display().to_string();
    let mut a: Vec<String> = vec![
        "run".into(),
        "--rm".into(),
        "--pull=never".into(),
        format!("--name={}", container_name(l.container_id)),
        "--runtime".into(),
        l.runtime.runc.display().to_string(),
        "--network=host".into(),
        "--ulimit".into(),
        format!("nproc={0}:{0}", l.limits.0),
        "--ulimit".into(),
        format!("nofile={0}:{0}", l.limits.1),
        "--volume".into(),
        format!("{dir}:{dir}"),
        "--workdir".into(),
        dir.clone(),
    ];
    if let Some(shm) = l.shm_mb {
        a.push(format!("--shm-size={shm}m"));
    }
    for d in granted_devices(l.devices, l.gpu_mask) {
        let name = d
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let host = d.path.display();
        if d.is_char_device {
            a.push(format!("--device={host}:/dev/{name}"));
        } else {
            a.push(format!("--mount=type=bind,source={host},target=/dev/{name},readonly"));
        }
    }
    for (k, _) in l.env {
        if k != "PATH" && k != "HOME" {
            a.push("--env".into());
            a.push(k.clone());
        }
    }
    a.push("--entrypoint=".into());
    a.push(l.image.into());
    a.extend(["/bin/sh".into(), "-c".into(), CONTAINER_INIT.into()]);
    Spawn {
        program: l.runtime.podman.clone(),
        args: a,
        host_script: false,
    }
}

/// What to do with a task that names an image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Run it in the image.
    Image,
    /// Run it on the host; the note goes to the task's stderr.
    Host { note: String },
    /// Refuse to start it (the reason becomes the container's diagnostics).
    Refuse { why: String },
}

/// The rule of `node.run_without_image`: `runtime` is the node's runtime, `present` says
/// whether the image is in its local store.
pub fn decide(image: &str, runtime: Option<&Runtime>, present: bool, run_without_image: bool) -> Decision {
    let missing = match (runtime, present) {
        (Some(_), true) => return Decision::Image,
        (Some(_), false) => "it is not in this node's local image store (`podman pull` it on the node)",
        (None, _) => "this node has no OCI runtime (podman with runc, and node.image_runtime `auto`)",
    };
    if run_without_image {
        Decision::Host {
            note: format!(
                "gpuam: warning: the task names the image `{image}` but {missing}; it runs on the host \
                 (node.run_without_image is true)."
            ),
        }
    } else {
        Decision::Refuse {
            why: format!(
                "the task names the image `{image}` but {missing}, and node.run_without_image is false: \
                 make the image runnable on the node, or set GPUAM__NODE__RUN_WITHOUT_IMAGE=true"
            ),
        }
    }
}

// ---- the I/O shell ----

fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].iter().map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// podman and runc, when both are installed.
pub fn find_runtime() -> Option<Runtime> {
    Some(Runtime {
        podman: find_in_path("podman")?,
        runc: find_in_path("runc")?,
    })
}

/// Whether `image` is in the node's local store (`podman image exists`; no registry is
/// contacted).
pub fn image_present(runtime: &Runtime, image: &str) -> bool {
    // The image name comes from the task's environment: never an option of root's podman.
    if image.is_empty() || image.starts_with('-') || image.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return false;
    }
    std::process::Command::new(&runtime.podman)
        .args(["image", "exists", "--", image])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The NVIDIA device nodes under `dir` (`/dev` unless `GPUAM_NVIDIA_DEV_DIR` says otherwise).
pub fn find_devices(dir: &Path) -> Vec<DeviceNode> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<DeviceNode> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let rest = name.strip_prefix("nvidia")?;
            let gpu = if rest.is_empty() {
                return None;
            } else if rest.chars().all(|c| c.is_ascii_digit()) {
                Some(rest.parse::<u32>().ok()?)
            } else if ["ctl", "-uvm", "-uvm-tools", "-modeset"].contains(&rest) {
                None
            } else {
                return None;
            };
            let ft = e.file_type().ok()?;
            (ft.is_char_device() || ft.is_file()).then(|| DeviceNode {
                path: e.path(),
                gpu,
                is_char_device: ft.is_char_device(),
            })
        })
        .collect();
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

/// podman starts conmon (and so the container's init) with at most this many processes
/// (measured with podman 4.3: conmon's `Max processes` is 32768 whatever the caller's);
/// asking for more fails with "error setting rlimit type 6: operation not permitted".
const PODMAN_NPROC_CAP: u64 = 32768;

/// The limits to ask for: the executor's hard limits for processes (capped at what podman's
/// conmon holds) and open files (capped at 1 048 576).
pub fn hard_limits() -> (u64, u64) {
    let hard = |res| {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into the struct we own; no other memory is touched.
        let ok = unsafe { libc::getrlimit(res, &mut r) } == 0;
        if !ok || r.rlim_max == libc::RLIM_INFINITY {
            1 << 20
        } else {
            r.rlim_max.min(1 << 20)
        }
    };
    (
        hard(libc::RLIMIT_NPROC).min(PODMAN_NPROC_CAP),
        hard(libc::RLIMIT_NOFILE),
    )
}

/// What a node does with a task that names an image (`node.image_runtime`,
/// `node.run_without_image`), given to the executor by whoever read the settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImagePolicy {
    /// Look for podman with runc (`auto`); `false` (`none`): never run an image.
    pub use_runtime: bool,
    /// A task whose image cannot run here runs on the host (with a note) instead of failing.
    pub run_without_image: bool,
}

impl ImagePolicy {
    /// The policy `node.image_runtime` and `node.run_without_image` say.
    pub fn from_settings(n: &crate::config::NodeSettings) -> ImagePolicy {
        ImagePolicy {
            use_runtime: n.image_runtime != "none",
            run_without_image: n.run_without_image,
        }
    }
}

impl Default for ImagePolicy {
    /// The settings' defaults: `image_runtime: auto`, `run_without_image: true`.
    fn default() -> Self {
        ImagePolicy {
            use_runtime: true,
            run_without_image: true,
        }
    }
}

fn env_get<'a>(env: &'a [(String, String)], k: &str) -> Option<&'a str> {
    env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str())
}

/// What the executor spawns for container `id` with record `record` and work directory
/// `dir` (the task's), with environment `env`:
/// `bash launch.sh` on the host, or podman running it in the task's image. A task that
/// names an image on a node without a runtime runs on the host (its stderr starts with a
/// note saying so) or is refused, as `node.run_without_image` says.
pub fn program_for(
    record: &Path,
    dir: &Path,
    id: &str,
    env: &[(String, String)],
    policy: ImagePolicy,
) -> Result<Spawn, String> {
    let host = Spawn {
        program: PathBuf::from("bash"),
        args: vec!["launch.sh".into()],
        host_script: true,
    };
    let Some(image) = env_get(env, IMAGE_ENV).filter(|s| !s.is_empty()) else {
        return Ok(host);
    };
    let runtime = if policy.use_runtime { find_runtime() } else { None };
    let present = runtime.as_ref().is_some_and(|r| image_present(r, image));
    match decide(image, runtime.as_ref(), present, policy.run_without_image) {
        Decision::Refuse { why } => Err(why),
        Decision::Host { note } => {
            tracing::warn!(container = id, "{note}");
            // The task's own stderr starts with the note.
            Ok(Spawn {
                program: PathBuf::from("bash"),
                // `--norc`: bash run with `-c` and a socket on stdin (the start's hold) takes
                // itself for rshd's and would read `~/.bashrc` before the hold's check.
                args: vec![
                    "--norc".into(),
                    "-c".into(),
                    "printf '%s\\n' \"$1\" >&2; exec bash launch.sh".into(),
                    "gpuam".into(),
                    note,
                ],
                host_script: true,
            })
        }
        Decision::Image => {
            let runtime = runtime.ok_or("no runtime")?;
            // The mark `reap` looks for when the container ends.
            // 0600: the node's alone (the record is 0711, its names guessable).
            use std::os::unix::fs::OpenOptionsExt as _;
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(record.join(IMAGE_MARK))
                .and_then(|mut f| std::io::Write::write_all(&mut f, container_name(id).as_bytes()))
                .map_err(|e| format!("cannot write {}: {e}", record.join(IMAGE_MARK).display()))?;
            let dev_dir = std::env::var_os(DEV_DIR_ENV).map_or_else(|| PathBuf::from("/dev"), PathBuf::from);
            let devices = find_devices(&dev_dir);
            let mask = env_get(env, "GPUAM_GPU_MASK")
                .and_then(|m| u64::from_str_radix(m.trim_start_matches("0x"), 16).ok())
                .unwrap_or(0);
            let shm_mb = env_get(env, SHM_ENV).and_then(|v| v.parse().ok());
            Ok(podman_command(&ImageLaunch {
                image,
                container_id: id,
                dir,
                env,
                gpu_mask: mask,
                devices: &devices,
                shm_mb,
                limits: hard_limits(),
                runtime: &runtime,
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(name: &str, gpu: Option<u32>, chr: bool) -> DeviceNode {
        DeviceNode {
            path: PathBuf::from(format!("/dev/{name}")),
            gpu,
            is_char_device: chr,
        }
    }

    fn runtime() -> Runtime {
        Runtime {
            podman: "/usr/bin/podman".into(),
            runc: "/usr/sbin/runc".into(),
        }
    }

    #[test]
    fn only_the_granted_gpus_and_the_shared_nodes_are_mounted() {
        let devs = [
            dev("nvidia0", Some(0), true),
            dev("nvidia1", Some(1), true),
            dev("nvidia2", Some(2), true),
            dev("nvidia3", Some(3), false),
            dev("nvidiactl", None, true),
            dev("nvidia-uvm", None, true),
        ];
        let env = vec![
            ("PATH".to_string(), "/bin".to_string()),
            ("SECRET_TOKEN".to_string(), "hunter22".to_string()),
            ("NVIDIA_VISIBLE_DEVICES".to_string(), "1,3".to_string()),
        ];
        let rt = runtime();
        let s = podman_command(&ImageLaunch {
            image: "busybox:local",
            container_id: "c_1",
            dir: Path::new("/work/c_1"),
            env: &env,
            gpu_mask: 0b1010,
            devices: &devs,
            shm_mb: Some(256),
            limits: (4096, 8192),
            runtime: &rt,
        });
        assert_eq!(s.program, PathBuf::from("/usr/bin/podman"));
        let dev_args: Vec<&String> = s
            .args
            .iter()
            .filter(|a| a.starts_with("--device") || a.starts_with("--mount"))
            .collect();
        assert_eq!(
            dev_args,
            [
                "--device=/dev/nvidia1:/dev/nvidia1",
                "--mount=type=bind,source=/dev/nvidia3,target=/dev/nvidia3,readonly",
                "--device=/dev/nvidiactl:/dev/nvidiactl",
                "--device=/dev/nvidia-uvm:/dev/nvidia-uvm",
            ]
        );
        let joined = s.args.join(" ");
        for want in [
            "--runtime /usr/sbin/runc",
            "--ulimit nproc=4096:4096 --ulimit nofile=8192:8192",
            "--volume /work/c_1:/work/c_1 --workdir /work/c_1",
            "--shm-size=256m",
            "--network=host",
            "--env SECRET_TOKEN --env NVIDIA_VISIBLE_DEVICES",
        ] {
            assert!(joined.contains(want), "`{want}` not in {joined}");
        }
        assert!(!joined.contains("hunter22"), "values never go on the command line");
        assert!(!joined.contains("--env PATH"));
        let img = s.args.iter().position(|a| a == "busybox:local").unwrap_or(0);
        assert!(img > 0 && s.args[img - 1] == "--entrypoint=");
    }

    #[test]
    fn no_gpu_no_device_node() {
        let devs = [dev("nvidia0", Some(0), true), dev("nvidiactl", None, true)];
        assert!(granted_devices(&devs, 0).is_empty());
        assert_eq!(granted_devices(&devs, 1).len(), 2);
    }

    #[test]
    fn without_a_runtime_the_setting_decides() {
        assert_eq!(decide("img", Some(&runtime()), true, false), Decision::Image);
        assert!(matches!(decide("img", None, false, true), Decision::Host { note } if note.contains("`img`")));
        assert!(
            matches!(decide("img", None, false, false), Decision::Refuse { why } if why.contains("GPUAM__NODE__RUN_WITHOUT_IMAGE"))
        );
        assert!(
            matches!(decide("img", Some(&runtime()), false, true), Decision::Host { note } if note.contains("local image store"))
        );
    }

    #[test]
    fn device_nodes_are_found_by_name() {
        let d = tempfile::tempdir().unwrap();
        for f in [
            "nvidia0",
            "nvidia12",
            "nvidiactl",
            "nvidia-uvm",
            "nvidia-caps",
            "nvme0",
            "nvidiafoo",
        ] {
            std::fs::write(d.path().join(f), b"").unwrap();
        }
        let found: Vec<(String, Option<u32>)> = find_devices(d.path())
            .into_iter()
            .map(|n| (n.path.file_name().unwrap().to_string_lossy().into_owned(), n.gpu))
            .collect();
        assert_eq!(
            found,
            [
                ("nvidia-uvm".to_string(), None),
                ("nvidia0".to_string(), Some(0)),
                ("nvidia12".to_string(), Some(12)),
                ("nvidiactl".to_string(), None),
            ]
        );
    }
}
