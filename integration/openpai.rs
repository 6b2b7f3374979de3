//! OpenPAI job protocol v2 files, end to end with the real `gpuam` binary:
//! - conformance: every file under `integration/openpai/accept` (written from OpenPAI's
//!   docs and protocol schema) is accepted by `gpuam validate`, and every file under
//!   `integration/openpai/reject` is refused with the reason its `# expect:` line names;
//! - a 2-role job whose tasks find each other only through `PAI_HOST_IP_*` and
//!   `PAI_*_PORT` (a TCP rendezvous in python) and succeeds under `gpuam run`; its tasks
//!   record `env`, which is checked against OpenPAI's variables; its commands use OpenPAI's
//!   one-script semantics (a heredoc and a `\` continuation across items, a failing line
//!   in the middle);
//! - a task in a locally built image (busybox imported into podman) that sees only its
//!   granted GPUs' device nodes. It needs podman, runc and busybox-static (`.ci/run`
//!   installs them); without them it says so and passes unless `GPUAM_REQUIRE_PODMAN=1`.
//!
//! Every `gpuam run` gets its own temporary work directory and dashboard port 0, and is
//! bounded by a timeout after which it is killed by pid.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_gpuam")
}

fn fixtures(kind: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("integration/openpai")
        .join(kind);
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    v.sort();
    v
}

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

/// Runs `gpuam ARGS` with `env`, killing it (by pid) after `limit`.
fn gpuam(args: &[&str], env: &[(&str, &str)], limit: Duration) -> Out {
    let dir = tempfile::tempdir().expect("temp dir");
    let (out_path, err_path) = (dir.path().join("out"), dir.path().join("err"));
    let mut cmd = Command::new(bin());
    // Its tasks write into the test's private directory: as the RM's user.
    cmd.env("GPUAM__NODE__IN_PROCESS_IDENTITY", "false");
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).expect("out file"))
        .stderr(std::fs::File::create(&err_path).expect("err file"))
        .env("GPUAM_DASHBOARD_LINGER_SEC", "0");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn gpuam");
    let start = Instant::now();
    let code = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st.code().unwrap_or(-1);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break -9;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Out {
        code,
        stdout: std::fs::read_to_string(&out_path).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err_path).unwrap_or_default(),
    }
}

#[test]
fn conformance_accepted_files_validate_with_their_warnings() {
    let files = fixtures("accept");
    assert!(files.len() >= 4, "{files:?}");
    for f in files {
        let out = gpuam(&["validate", &f.display().to_string()], &[], Duration::from_secs(30));
        assert_eq!(out.code, 0, "{} should be accepted:\n{}", f.display(), out.stderr);
        // Every line that is not "ok" is a located warning, never an error.
        for line in out.stderr.lines().filter(|l| !l.trim().is_empty()) {
            assert!(line.contains(": warning: "), "{}: {line}", f.display());
        }
    }
}

#[test]
fn conformance_refused_files_name_the_reason_and_the_line() {
    let files = fixtures("reject");
    assert!(files.len() >= 8, "{files:?}");
    for f in files {
        let text = std::fs::read_to_string(&f).expect("read fixture");
        let want = text
            .lines()
            .find_map(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{} has no `# expect:` line", f.display()))
            .to_string();
        let out = gpuam(&["validate", &f.display().to_string()], &[], Duration::from_secs(30));
        assert_eq!(
            out.code,
            65,
            "{} should be refused:\n{}{}",
            f.display(),
            out.stdout,
            out.stderr
        );
        assert!(
            out.stderr.contains(&want),
            "{}: `{want}` not in:\n{}",
            f.display(),
            out.stderr
        );
        let first = out.stderr.lines().next().unwrap_or("");
        let line: usize = first
            .strip_prefix(&format!("{}:", f.display()))
            .and_then(|r| r.split(':').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        assert!(line >= 2, "{}: no line in `{first}`", f.display());
        assert!(
            out.stderr.contains("fix: "),
            "{}: no fix in:\n{}",
            f.display(),
            out.stderr
        );
    }
}

const CLUSTER: &str = "nodes:\n  - host: node-a\n    rack: /r1\n    cpu: 16\n    memoryMB: 16000\n    gpus: 4\n    ports: \"31000-31199\"\n  - host: node-b\n    rack: /r1\n    cpu: 16\n    memoryMB: 16000\n    gpus: 4\n    ports: \"31000-31199\"\n";

/// A YAML single-quoted scalar.
fn sq(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

fn read_env(path: &Path) -> BTreeMap<String, String> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn two_roles_rendezvous_through_pai_variables_under_gpuam_run() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().display().to_string();
    let cluster = dir.path().join("cluster.yaml");
    std::fs::write(&cluster, CLUSTER).expect("cluster");
    let record = format!(
        "ROOT_DIR={root}; env | grep '^PAI_' | sort > $ROOT_DIR/env.$PAI_CURRENT_TASK_ROLE_NAME.$PAI_TASK_INDEX"
    );
    // The python is a heredoc spread over several command items: it only works when the
    // items form one script, as on OpenPAI. OpenPAI trims every item, so no line of it
    // may rely on indentation.
    let server = [
        record.as_str(),
        "false",
        "ROOT=$ROOT_DIR python3 - <<'PY'",
        "import os, socket",
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)",
        "s.bind((os.environ['PAI_CONTAINER_HOST_IP'], int(os.environ['PAI_Server_0_sync_PORT'])))",
        "s.listen(8); s.settimeout(60); seen = set()",
        "def serve(c): i = c.recv(64).decode().strip(); seen.add(i); c.sendall(('ok ' + i).encode()); c.close()",
        "want = int(os.environ['PAI_TASK_ROLE_TASK_COUNT_worker'])",
        "for _ in range(want): serve(s.accept()[0])",
        "open(os.environ['ROOT'] + '/server.saw', 'w').write(','.join(sorted(seen)))",
        "PY",
    ];
    let cont = format!("line >> {root}/continued.$PAI_TASK_INDEX");
    let client = [
        record.as_str(),
        "ROOT=$ROOT_DIR python3 - <<'PY'",
        "import os, socket, time",
        "host = os.environ['PAI_HOST_IP_Server_0']; port = int(os.environ['PAI_Server_0_sync_PORT'])",
        "def once(): k = socket.socket(); return k if k.connect_ex((host, port)) == 0 else k.close()",
        "c = None",
        "for _ in range(600): c = c or once() or time.sleep(0.1)",
        "assert c, 'the server is not reachable'",
        "i = os.environ['PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX']; c.sendall(i.encode())",
        "r = c.recv(64).decode(); open(os.environ['ROOT'] + '/rendezvous.' + i, 'w').write(r)",
        "PY",
        "echo continued \\",
        &cont,
    ];
    let cmds = |c: &[&str]| -> String { c.iter().map(|l| format!("      - {}\n", sq(l))).collect() };
    // OpenPAI's default completion ends the job as soon as one role has all its instances
    // succeeded (`minSucceededInstances` = `instances`): the server, done once both workers
    // were served, would end the job and stop the workers before their last line. Every
    // task here must finish, so both roles leave only the "all tasks done" rule (-1).
    let all_done = "    completion: {minSucceededInstances: -1}\n";
    let job = format!(
        "protocolVersion: 2\nname: rendezvous\ntype: job\n\
         prerequisites:\n  - {{name: img, type: dockerimage, uri: openpai/standard:python_3.6}}\n\
         parameters: {{who: worker}}\n\
         taskRoles:\n  Server:\n    instances: 1\n    dockerImage: img\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1, ports: {{sync: 1}}}}\n{all_done}    commands:\n{}\
         \x20 worker:\n    instances: 2\n    dockerImage: img\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 0}}\n{all_done}    commands:\n{}\
         defaults: {{virtualCluster: default}}\n",
        cmds(&server),
        cmds(&client),
    );
    let job_path = dir.path().join("job.yaml");
    std::fs::write(&job_path, job).expect("job");
    let work = dir.path().join("work");
    let out = gpuam(
        &[
            "run",
            &job_path.display().to_string(),
            "--cluster",
            &cluster.display().to_string(),
            "--listen",
            "127.0.0.1:0",
            "--work-dir",
            &work.display().to_string(),
        ],
        // The image is not in any local store: run on the host, as a node without a runtime.
        &[("GPUAM__NODE__IMAGE_RUNTIME", "none"), ("USER", "alice")],
        Duration::from_secs(120),
    );
    assert_eq!(
        out.code,
        0,
        "stdout:\n{}\nstderr:\n{}\ntasks' stderr:\n{}",
        out.stdout,
        out.stderr,
        files_named(&work, "stderr").join("\n---\n")
    );

    let server_env = read_env(&dir.path().join("env.Server.0"));
    let w0 = read_env(&dir.path().join("env.worker.0"));
    let w1 = read_env(&dir.path().join("env.worker.1"));
    // The same peers for everyone; the case of roles and labels kept.
    for env in [&server_env, &w0, &w1] {
        assert_eq!(env["PAI_HOST_IP_Server_0"], "127.0.0.1");
        assert_eq!(env["PAI_Server_0_sync_PORT"], server_env["PAI_PORT_LIST_Server_0_sync"]);
        assert_eq!(env["PAI_JOB_NAME"], "alice~rendezvous");
        assert_eq!(env["PAI_USER_NAME"], "alice");
        assert_eq!(env["PAI_VIRTUAL_CLUSTER"], "default");
        assert_eq!(env["PAI_TASK_ROLE_LIST"], "Server,worker");
        assert_eq!(env["PAI_TASK_ROLE_TASK_COUNT_worker"], "2");
        assert_eq!(env["PAI_JOB_TASK_COUNT"], "3");
        assert_eq!(env["PAI_TASK_ROLE_INSTANCES"], "Server:0,worker:0,worker:1");
        for k in [
            "PAI_HOST_IP_worker_0",
            "PAI_HOST_IP_worker_1",
            "PAI_worker_1_ssh_PORT",
            "PAI_worker_0_http_PORT",
        ] {
            assert!(env.contains_key(k), "{k} missing: {env:?}");
        }
    }
    // Exactly the variables docs/OPENPAI.md's table promises, no fewer and no more.
    let roles: [(&str, u32, &[&str]); 2] = [("Server", 1, &["sync", "ssh", "http"]), ("worker", 2, &["ssh", "http"])];
    for (env, role) in [(&server_env, "Server"), (&w0, "worker"), (&w1, "worker")] {
        assert_documented_pai_env(env, &roles, role);
    }
    assert_eq!(server_env["PAI_CURRENT_TASK_ROLE_NAME"], "Server");
    assert_eq!(server_env["PAI_CURRENT_TASK_ROLE_GPU_COUNT"], "1");
    assert_eq!(w1["PAI_CURRENT_TASK_ROLE_NAME"], "worker");
    assert_eq!(w1["PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX"], "1");
    assert_eq!(w1["PAI_TASK_INDEX"], "1");
    assert_eq!(w1["PAI_CONTAINER_SSH_PORT"], w1["PAI_worker_1_ssh_PORT"]);
    assert_eq!(w1["PAI_CONTAINER_HOST_PORT"], w1["PAI_worker_1_http_PORT"]);
    assert_eq!(
        w1["PAI_CONTAINER_HOST_PORT_LIST"],
        format!(
            "ssh:{};http:{};",
            w1["PAI_worker_1_ssh_PORT"], w1["PAI_worker_1_http_PORT"]
        )
    );
    assert_eq!(
        w0["PAI_TASK_ROLE_worker_HOST_LIST"],
        format!(
            "127.0.0.1:{},127.0.0.1:{}",
            w0["PAI_worker_0_http_PORT"], w0["PAI_worker_1_http_PORT"]
        )
    );
    // The rendezvous happened, through the PAI_* variables only.
    assert_eq!(
        std::fs::read_to_string(dir.path().join("server.saw")).unwrap_or_default(),
        "0,1"
    );
    for i in 0..2 {
        let got = std::fs::read_to_string(dir.path().join(format!("rendezvous.{i}"))).unwrap_or_default();
        assert_eq!(got, format!("ok {i}"));
    }
    // The `\` continuation across two items.
    for i in 0..2 {
        let got = std::fs::read_to_string(dir.path().join(format!("continued.{i}"))).unwrap_or_default();
        assert_eq!(got.trim(), "continued line");
    }
    // The image was named and the node has no runtime: each task says so in its stderr.
    let warned = files_named(&work, "stderr")
        .iter()
        .filter(|t| t.contains("names the image `openpai/standard:python_3.6`") && t.contains("runs on the host"))
        .count();
    assert_eq!(warned, 3);
}

/// The `PAI_*` names docs/OPENPAI.md's environment table lists, for a job of `roles` (name,
/// instances, port labels) seen from a task of role `current`: `<role>`, `<index>` and
/// `<label>` expanded; `` `_X_Y` `` after a name stands for that name with as many trailing
/// `_` parts replaced (`PAI_CURRENT_TASK_ROLE_CPU_COUNT`, `_MEM_MB`).
fn documented_pai_names(roles: &[(&str, u32, &[&str])], current: &str) -> std::collections::BTreeSet<String> {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/OPENPAI.md"))
        .expect("docs/OPENPAI.md");
    let section = doc
        .split("\n## The environment")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("docs/OPENPAI.md has a section `## The environment`");
    let mut names = std::collections::BTreeSet::new();
    for row in section.lines().filter(|l| l.starts_with("| `")) {
        let cell = row.split('|').nth(1).unwrap_or("");
        let mut first: Option<String> = None;
        for name in cell.split('`').skip(1).step_by(2) {
            let name = match (&first, name.strip_prefix('_')) {
                (Some(f), Some(tail)) => {
                    let keep: Vec<&str> = f.split('_').collect();
                    let cut = keep.len() - tail.split('_').count();
                    format!("{}_{tail}", keep[..cut].join("_"))
                }
                _ => {
                    first = Some(name.to_string());
                    name.to_string()
                }
            };
            if !name.starts_with("PAI_") {
                continue;
            }
            let labels_of = |r: &str| {
                roles
                    .iter()
                    .find(|(n, _, _)| *n == r)
                    .map(|(_, _, l)| l.to_vec())
                    .unwrap_or_default()
            };
            if name.contains("<role>") {
                for (r, instances, labels) in roles {
                    let n = name.replace("<role>", r);
                    for i in 0..*instances {
                        let n = n.replace("<index>", &i.to_string());
                        if n.contains("<label>") {
                            names.extend(labels.iter().map(|l| n.replace("<label>", l)));
                        } else {
                            names.insert(n);
                        }
                    }
                }
            } else if name.contains("<label>") {
                names.extend(labels_of(current).iter().map(|l| name.replace("<label>", l)));
            } else {
                names.insert(name);
            }
        }
    }
    names
}

/// A task's `PAI_*` variables are exactly those docs/OPENPAI.md lists (missing and extra
/// ones named).
fn assert_documented_pai_env(env: &BTreeMap<String, String>, roles: &[(&str, u32, &[&str])], current: &str) {
    let want = documented_pai_names(roles, current);
    assert!(want.len() > 40, "the table was not read: {want:?}");
    let got: std::collections::BTreeSet<String> = env.keys().filter(|k| k.starts_with("PAI_")).cloned().collect();
    let missing: Vec<&String> = want.difference(&got).collect();
    let extra: Vec<&String> = got.difference(&want).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "a task of {current}: documented but not set: {missing:?}; set but not documented: {extra:?}"
    );
}

/// The contents of every file called `name` under `dir`.
fn files_named(dir: &Path, name: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.file_name().is_some_and(|n| n == name) {
                out.push(std::fs::read_to_string(&p).unwrap_or_default());
            }
        }
    }
    out
}

/// Builds a busybox root filesystem and imports it into podman as `name`; `None` (with
/// the reason) when podman, runc or busybox is missing.
fn busybox_image(dir: &Path, name: &str) -> Result<(), String> {
    for tool in ["podman", "runc"] {
        let found = Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {tool} || test -x /usr/sbin/{tool}"))
            .stdout(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !found {
            return Err(format!("{tool} is not installed"));
        }
    }
    let busybox = Path::new("/bin/busybox");
    if !busybox.exists() {
        return Err("busybox-static is not installed".into());
    }
    let rootfs = dir.join("rootfs");
    for d in ["bin", "dev", "proc", "sys", "tmp", "etc"] {
        std::fs::create_dir_all(rootfs.join(d)).map_err(|e| e.to_string())?;
    }
    std::fs::copy(busybox, rootfs.join("bin/busybox")).map_err(|e| e.to_string())?;
    let list = Command::new(busybox)
        .arg("--list")
        .output()
        .map_err(|e| e.to_string())?;
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        if applet != "busybox" && !applet.is_empty() {
            let _ = std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet));
        }
    }
    let tar = dir.join("rootfs.tar");
    let ok = Command::new("tar")
        .arg("-C")
        .arg(&rootfs)
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        return Err("tar failed".into());
    }
    let imported = Command::new("podman")
        .args(["import", "-q"])
        .arg(&tar)
        .arg(name)
        .output()
        .map_err(|e| e.to_string())?;
    if !imported.status.success() {
        return Err(format!(
            "podman import failed: {}",
            String::from_utf8_lossy(&imported.stderr)
        ));
    }
    Ok(())
}

#[test]
fn a_task_in_its_image_sees_only_its_gpus_device_nodes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let image = format!("localhost/gpuam-openpai-test-{}:1", std::process::id());
    if let Err(why) = busybox_image(dir.path(), &image) {
        assert!(
            std::env::var("GPUAM_REQUIRE_PODMAN").is_err(),
            "GPUAM_REQUIRE_PODMAN is set but {why}"
        );
        eprintln!("not run: {why} (install podman, runc and busybox-static)");
        return;
    }
    // Stand-ins for the device nodes of a 4-GPU node: plain files, bind-mounted by the
    // command builder where real nodes would be passed with --device. Only the granted
    // GPUs' and the shared nodes may appear in the container.
    let devs = dir.path().join("dev");
    std::fs::create_dir_all(&devs).expect("dev dir");
    for f in ["nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm"] {
        std::fs::write(devs.join(f), f).expect("stand-in");
    }
    let cluster = dir.path().join("cluster.yaml");
    std::fs::write(
        &cluster,
        "nodes:\n  - host: node-a\n    cpu: 8\n    memoryMB: 8000\n    gpuMask: \"0xf\"\n    used: {gpuMask: \"0x1\"}\n    ports: \"32000-32099\"\n",
    )
    .expect("cluster");
    let job = format!(
        "protocolVersion: 2\nname: in_image\ntype: job\n\
         prerequisites:\n  - {{name: img, type: dockerimage, uri: {image}}}\n\
         taskRoles:\n  worker:\n    dockerImage: img\n    extraContainerOptions: {{shmMB: 32}}\n\
         \x20   resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 2}}\n    commands:\n\
         \x20     - ls /dev | grep nvidia | sed 's/^/devs=/'\n\
         \x20     - echo \"contents=$(cat /dev/nvidia*)\"\n\
         \x20     - echo \"env=$NVIDIA_VISIBLE_DEVICES $PAI_CURRENT_TASK_ROLE_NAME $PAI_CONTAINER_HOST_IP\"\n\
         \x20     - df -m /dev/shm | tail -1 | sed 's/^/shm=/'\n\
         \x20     - test -x /bin/busybox && ! test -e /usr/bin/podman\n"
    );
    let job_path = dir.path().join("job.yaml");
    std::fs::write(&job_path, job).expect("job");
    let work = dir.path().join("work");
    let dev_dir = devs.display().to_string();
    let out = gpuam(
        &[
            "run",
            &job_path.display().to_string(),
            "--cluster",
            &cluster.display().to_string(),
            "--listen",
            "127.0.0.1:0",
            "--work-dir",
            &work.display().to_string(),
        ],
        &[("GPUAM_NVIDIA_DEV_DIR", &dev_dir)],
        Duration::from_secs(180),
    );
    let _ = Command::new("podman").args(["rmi", "-f", &image]).output();
    assert_eq!(out.code, 0, "stdout:\n{}\nstderr:\n{}", out.stdout, out.stderr);
    // What the task saw, from its stdout (its directory is gone once it ended).
    let logs = files_named(&work, "stdout").join("");
    let find = |name: &str| -> String {
        let prefix = format!("{name}=");
        let found: Vec<&str> = logs.lines().filter_map(|l| l.strip_prefix(prefix.as_str())).collect();
        assert!(
            !found.is_empty(),
            "`{name}=` lines in the task's stdout under {}: {logs}",
            work.display()
        );
        found.join("\n")
    };
    // GPU 0 is used on the node: the two granted are 1 and 2 (lowest free bits).
    let seen: Vec<String> = find("devs").lines().map(str::to_string).collect();
    assert_eq!(seen, ["nvidia-uvm", "nvidia1", "nvidia2", "nvidiactl"], "{seen:?}");
    assert_eq!(find("contents"), "nvidia-uvmnvidia1nvidia2nvidiactl");
    assert_eq!(find("env").trim(), "1,2 worker 127.0.0.1");
    let shm_mb: u64 = find("shm")
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert_eq!(shm_mb, 32);
}

/// Runs a one-role v2 job of 2 tasks under `gpuam run` (on the host); `extra` goes at
/// the top level, `role` into the role. Returns the exit code and, per task index, how
/// many times the task ran. Task 0 fails (exit 3) on its first run, or on every run when
/// `always_fail`.
fn retry_job(extra: &str, role: &str, always_fail: bool) -> (i32, [usize; 2], String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().display().to_string();
    let cluster = dir.path().join("cluster.yaml");
    std::fs::write(&cluster, CLUSTER).expect("cluster");
    let fail = if always_fail {
        "if [ $PAI_TASK_INDEX = 0 ]; then exit 3; fi".to_string()
    } else {
        // It fails only once task 1 has run (at most 30 s later): a restart of the whole
        // job must find task 1 running, not stop it before its first command, which a busy
        // machine can delay past task 0's failure.
        format!(
            "if [ $PAI_TASK_INDEX = 0 ] && [ ! -e {root}/failed ]; then \
             n=0; while [ ! -e {root}/runs.1 ] && [ $n -lt 600 ]; do sleep 0.05; n=$((n+1)); done; \
             touch {root}/failed; exit 3; fi"
        )
    };
    let job = format!(
        "protocolVersion: 2\nname: retries\ntype: job\n{extra}\
         prerequisites:\n  - {{name: img, type: dockerimage, uri: none}}\n\
         taskRoles:\n  w:\n    instances: 2\n    dockerImage: img\n{role}\
         \x20   resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 0}}\n    commands:\n\
         \x20     - {}\n      - {}\n      - sleep 0.3\n",
        sq(&format!("echo run >> {root}/runs.$PAI_TASK_INDEX")),
        sq(&fail),
    );
    let job_path = dir.path().join("job.yaml");
    std::fs::write(&job_path, job).expect("job");
    let work = dir.path().join("work");
    let out = gpuam(
        &[
            "run",
            &job_path.display().to_string(),
            "--cluster",
            &cluster.display().to_string(),
            "--listen",
            "127.0.0.1:0",
            "--work-dir",
            &work.display().to_string(),
        ],
        &[("GPUAM__NODE__IMAGE_RUNTIME", "none")],
        Duration::from_secs(120),
    );
    let runs = |i: usize| {
        std::fs::read_to_string(dir.path().join(format!("runs.{i}")))
            .unwrap_or_default()
            .lines()
            .count()
    };
    (out.code, [runs(0), runs(1)], format!("{}\n{}", out.stdout, out.stderr))
}

#[test]
fn job_retry_count_restarts_the_whole_job() {
    let (code, runs, log) = retry_job("jobRetryCount: 1\n", "", false);
    assert_eq!(code, 0, "{log}");
    // Both tasks ran twice: the failure of task 0 restarted task 1 too.
    assert_eq!(runs, [2, 2], "{log}");
}

#[test]
fn task_retry_count_is_ignored_under_gang_allocation() {
    let (code, runs, log) = retry_job("", "    taskRetryCount: 3\n", true);
    assert_eq!(code, 1, "{log}");
    assert_eq!(runs[0], 1, "{log}");
    assert!(log.contains("taskRetryCount") && log.contains("warning"), "{log}");
}

#[test]
fn task_retry_count_retries_one_task_without_gang_allocation() {
    let (code, runs, log) = retry_job("extras: {gangAllocation: false}\n", "    taskRetryCount: 1\n", false);
    assert_eq!(code, 0, "{log}");
    assert_eq!(runs, [2, 1], "{log}");
}

#[test]
fn stopping_a_job_removes_its_tasks_containers() {
    let dir = tempfile::tempdir().expect("temp dir");
    let image = format!("localhost/gpuam-openpai-stop-{}:1", std::process::id());
    if let Err(why) = busybox_image(dir.path(), &image) {
        assert!(
            std::env::var("GPUAM_REQUIRE_PODMAN").is_err(),
            "GPUAM_REQUIRE_PODMAN is set but {why}"
        );
        eprintln!("not run: {why} (install podman, runc and busybox-static)");
        return;
    }
    let cluster = dir.path().join("cluster.yaml");
    std::fs::write(&cluster, CLUSTER).expect("cluster");
    // The task ignores nothing: a foreground `sleep` that only a signal to every process
    // of the container ends early.
    let job = format!(
        "protocolVersion: 2\nname: stop_me\ntype: job\n\
         prerequisites:\n  - {{name: img, type: dockerimage, uri: {image}}}\n\
         taskRoles:\n  w:\n    instances: 2\n    dockerImage: img\n\
         \x20   resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 0}}\n    commands:\n      - sleep 300\n"
    );
    let job_path = dir.path().join("job.yaml");
    std::fs::write(&job_path, job).expect("job");
    let work = dir.path().join("work");
    let mut child = Command::new(bin())
        .env("GPUAM__NODE__IN_PROCESS_IDENTITY", "false")
        .args([
            "run",
            &job_path.display().to_string(),
            "--cluster",
            &cluster.display().to_string(),
        ])
        .args(["--listen", "127.0.0.1:0", "--work-dir", &work.display().to_string()])
        .env("GPUAM_DASHBOARD_LINGER_SEC", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn gpuam run");
    // Both tasks are in their containers once podman lists them.
    let names = |all: bool| -> Vec<String> {
        let mut args = vec!["ps", "--format", "{{.Names}}"];
        if all {
            args.push("-a");
        }
        let out = Command::new("podman").args(&args).output().expect("podman ps");
        let marks = files_named(&work, "image-container");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|n| marks.iter().any(|m| m.trim() == *n))
            .map(str::to_string)
            .collect()
    };
    let start = Instant::now();
    while names(false).len() < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the containers did not start"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // SAFETY: kill(2) on the pid of the child this test started.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGINT);
    }
    let start = Instant::now();
    let code = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st.code();
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("gpuam run did not end after SIGINT");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let left = names(true);
    let _ = Command::new("podman").args(["rmi", "-f", &image]).output();
    assert_eq!(code, Some(1), "a killed job exits 1");
    assert!(left.is_empty(), "containers left behind: {left:?}");
}

/// A command whose reader went away (`gpuam validate FILE | head -1`) ends quietly, killed
/// by SIGPIPE as Unix tools are, never with a panic.
#[test]
fn a_command_whose_output_pipe_closed_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let job = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/ddp-4x2.yaml");
    for _ in 0..3 {
        let mut child = Command::new(bin())
            .args(["validate", job])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
            "{stderr}"
        );
        assert!(
            out.status.success() || out.status.signal() == Some(libc::SIGPIPE),
            "{:?}: {stderr}",
            out.status
        );
    }
}
