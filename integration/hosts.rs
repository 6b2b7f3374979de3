//! Real hosts: three Linux network namespaces joined by a bridge (in a fourth), the RM
//! (`gpuam rm --node-token-file`, no cluster file) in one, a node agent (`gpuam node`) in
//! each of the other two, each offering 2 GPUs.
//!
//! - a gang of 2 tasks × 2 GPUs runs with one task on each host, as the task user, which
//!   cannot read the RM's admin token;
//! - a job whose tasks start daemons (setsid, double fork, nohup) is killed: no daemon is
//!   left, and the next job on the same GPUs starts only after the last one died (its
//!   heartbeat file's last write is before the next task's start: overlap printed);
//! - killing one agent makes its node LOST after `rm.node_expiry_sec`, and the task is
//!   retried on the other host; the agent restarted re-registers and kills the orphan.
//!
//! Needs root, `ip` (iproute2), `nsenter` (util-linux) and `curl`; namespaces are named `node-<pid>-*` and
//! deleted at the end, even on failure.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{bin, pid_alive, shell_quote, sq, wait_for};

const RM_IP: &str = "10.213.0.1";

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("run ip (install iproute2)");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The namespaces and the processes in them; dropping kills the processes and deletes
/// the namespaces.
struct Hosts {
    prefix: String,
    dir: tempfile::TempDir,
    procs: Vec<(String, Child)>,
}

impl Hosts {
    fn ns(&self, name: &str) -> String {
        format!("{}-{name}", self.prefix)
    }

    fn build() -> Hosts {
        let prefix = format!("node-{}", std::process::id());
        let dir = tempfile::tempdir().unwrap();
        // The task user must reach its agent's work dir (not list it).
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o711)).unwrap();
        let h = Hosts {
            prefix,
            dir,
            procs: Vec::new(),
        };
        let br = h.ns("br");
        ip(&["netns", "add", &br]);
        ip(&["-n", &br, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &br, "link", "set", "br0", "up"]);
        for (i, name) in ["rm", "h1", "h2"].iter().enumerate() {
            let ns = h.ns(name);
            ip(&["netns", "add", &ns]);
            let (a, b) = (format!("v{name}a"), format!("v{name}b"));
            ip(&[
                "-n", &ns, "link", "add", &a, "type", "veth", "peer", "name", &b, "netns", &br,
            ]);
            ip(&["-n", &br, "link", "set", &b, "master", "br0", "up"]);
            ip(&["-n", &ns, "addr", "add", &format!("10.213.0.{}/24", i + 1), "dev", &a]);
            ip(&["-n", &ns, "link", "set", &a, "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
        }
        fs::write(h.path("node.token"), "node-secret-of-this-test\n").unwrap();
        fs::create_dir_all(h.path("out")).unwrap();
        fs::set_permissions(h.path("out"), fs::Permissions::from_mode(0o777)).unwrap();
        fs::write(h.path("conf.yaml"), "rm:\n  node_expiry_sec: 3\n").unwrap();
        h
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn spawn(&mut self, label: &str, ns: &str, args: &[&str]) {
        let log = fs::File::create(self.path(&format!("{label}.log"))).unwrap();
        // nsenter, not `ip netns exec`: that one remounts /sys, which hides the cgroup
        // mounts from the agent; only the network is to be separate here.
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.ns(ns)))
            .arg(bin())
            .env("GPUAM_LOG", "info")
            .arg("--config")
            .arg(self.path("conf.yaml"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.procs.push((label.to_string(), child));
    }

    fn start_rm(&mut self) {
        let work = self.path("rm").display().to_string();
        let token = self.path("node.token").display().to_string();
        let listen = format!("{RM_IP}:8088");
        self.spawn(
            "rm",
            "rm",
            &[
                "rm",
                "--listen",
                &listen,
                "--work-dir",
                &work,
                "--node-token-file",
                &token,
                "--in-memory",
            ],
        );
        wait_for(Duration::from_secs(30), "the RM's admin token", || {
            self.path("rm/admin.token").exists().then_some(())
        });
    }

    fn start_agent(&mut self, host: &str) {
        let work = self.path(&format!("{host}-work")).display().to_string();
        let token = self.path("node.token").display().to_string();
        let ip_ = if host == "h1" { "10.213.0.2" } else { "10.213.0.3" };
        let name = format!("{}-{host}", self.prefix);
        let listen = format!("{ip_}:8042");
        let rm = format!("http://{RM_IP}:8088");
        self.spawn(
            host,
            host,
            &[
                "node",
                "--rm",
                &rm,
                "--host",
                &name,
                "--listen",
                &listen,
                "--node-token-file",
                &token,
                "--gpus",
                "2",
                "--topology",
                "none",
                "--cpu",
                "4",
                "--memory-mb",
                "4096",
                "--ports",
                "20000-20100",
                "--work-dir",
                &work,
            ],
        );
    }

    fn kill(&mut self, label: &str) {
        if let Some(i) = self.procs.iter().position(|(l, _)| l == label) {
            let (_, mut c) = self.procs.remove(i);
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// GET on the RM, from inside its namespace.
    fn get(&self, path: &str) -> serde_json::Value {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns("rm"), "curl", "-sf"])
            .arg(format!("http://{RM_IP}:8088{path}"))
            .output()
            .expect("curl");
        serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
    }

    fn node_states(&self) -> Vec<(String, String)> {
        let v = self.get("/ws/v1/cluster/nodes");
        v["nodes"]["node"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|n| {
                        (
                            n["nodeHostName"].as_str().unwrap_or("").to_string(),
                            n["state"].as_str().unwrap_or("").to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// `gpuam submit` in the RM's namespace; `wait`: until the job ends.
    fn submit(&self, name: &str, yaml: &str, wait: bool) -> Child {
        let job = self.path(&format!("{name}.yaml"));
        fs::write(&job, yaml).unwrap();
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns("rm"), bin(), "submit"])
            .arg(&job)
            .args(["--rm", &format!("http://{RM_IP}:8088"), "--admin-token-file"])
            .arg(self.path("rm/admin.token"))
            .env(
                "GPUAM_TOKEN",
                fs::read_to_string(self.path("rm/admin.token")).unwrap().trim(),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if wait {
            cmd.arg("--wait");
        }
        cmd.spawn().unwrap()
    }

    fn logs(&self) -> String {
        let mut s = String::new();
        for l in ["rm", "h1", "h2", "h1-again"] {
            if let Ok(t) = fs::read_to_string(self.path(&format!("{l}.log"))) {
                s.push_str(&format!("--- {l}.log\n{t}\n"));
            }
        }
        for sub in ["rm", "h1-work/containers", "h2-work/containers"] {
            for e in fs::read_dir(self.path(sub)).into_iter().flatten().flatten() {
                for f in ["am.stderr", "stderr"] {
                    if let Ok(t) = fs::read_to_string(e.path().join(f)) {
                        let tail: String = t
                            .chars()
                            .rev()
                            .take(3000)
                            .collect::<Vec<_>>()
                            .into_iter()
                            .rev()
                            .collect();
                        s.push_str(&format!("--- {}/{f}\n{tail}\n", e.path().display()));
                    }
                }
            }
        }
        s
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
        }
        for (_, c) in &mut self.procs {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Whatever still runs in the agents' cgroups goes too.
        for host in ["h1", "h2"] {
            let cg = PathBuf::from(format!("/sys/fs/cgroup/unified/gpuam-{}-{host}", self.prefix));
            for e in fs::read_dir(&cg).into_iter().flatten().flatten() {
                let _ = fs::write(e.path().join("cgroup.kill"), "1");
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        for ns in ["rm", "h1", "h2", "br"] {
            let _ = Command::new("ip").args(["netns", "del", &self.ns(ns)]).status();
        }
    }
}

fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

fn lines(p: &Path) -> Vec<String> {
    fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

fn job(name: &str, instances: u32, retries: u32, commands: &[String]) -> String {
    let cmds: String = commands.iter().map(|c| format!("      - {}\n", sq(c))).collect();
    format!(
        "name: {name}\ngang: true\ntaskRoles:\n  worker:\n    instances: {instances}\n    taskRetryCount: {retries}\n    \
         resourcePerInstance: {{cpu: 1, memoryMB: 256, gpu: 2}}\n    commands:\n{cmds}"
    )
}

#[test]
fn three_hosts_in_network_namespaces() {
    let mut h = Hosts::build();
    h.start_rm();
    h.start_agent("h1");
    h.start_agent("h2");
    let h1 = format!("{}-h1", h.prefix);
    let h2 = format!("{}-h2", h.prefix);
    wait_for(Duration::from_secs(30), "both agents registered", || {
        let s = h.node_states();
        (s.len() == 2 && s.iter().all(|(_, st)| st == "RUNNING")).then_some(())
    });
    let out = h.path("out").display().to_string();
    let admin = h.path("rm/admin.token").display().to_string();

    // 1. A gang of 2 × 2 GPUs: one task per host, as the task user, no admin token.
    let gang = job(
        "gang",
        2,
        0,
        &[format!(
            "echo $GPUAM_HOST $CUDA_VISIBLE_DEVICES $(id -u) > {out}/gang-$GPUAM_TASK_INDEX; \
             if cat {admin} >/dev/null 2>&1; then echo READ > {out}/gang-token-$GPUAM_TASK_INDEX; fi"
        )],
    );
    let status = h.submit("gang", &gang, true).wait().unwrap();
    assert!(status.success(), "the gang job succeeds");
    let mut hosts: Vec<String> = (0..2)
        .map(|i| lines(&h.path(&format!("out/gang-{i}")))[0].clone())
        .collect();
    for l in &hosts {
        let f: Vec<&str> = l.split_whitespace().collect();
        assert_eq!(f[1], "0,1", "each task has its host's 2 GPUs: {l}");
        assert_ne!(f[2], "0", "tasks do not run as root: {l}");
    }
    hosts.sort();
    assert_eq!(
        hosts
            .iter()
            .map(|l| l.split(' ').next().unwrap().to_string())
            .collect::<Vec<_>>(),
        vec![h1.clone(), h2.clone()],
        "one task per host"
    );
    assert!(
        !h.path("out/gang-token-0").exists() && !h.path("out/gang-token-1").exists(),
        "a task read the admin token"
    );

    // 2. Daemons of a killed job: none survives, and the next job on the same GPUs starts
    //    only after the last one is gone.
    let daemon = format!("trap \"\" TERM; while :; do date +%s%N > {out}/beat-$BASHPID; sleep 0.01; done");
    let escapes = job(
        "escapes",
        2,
        0,
        &[format!(
            "setsid bash -c {d} & echo $! >> {out}/daemons; \
             ( bash -c {d} & echo $! >> {out}/daemons ); \
             set -m; nohup bash -c {d} >/dev/null 2>&1 & echo $! >> {out}/daemons; set +m; \
             sleep 1000",
            d = shell_quote(&daemon)
        )],
    );
    let mut killer = h.submit("escapes", &escapes, true);
    wait_for(Duration::from_secs(60), "6 daemons started", || {
        (lines(&h.path("out/daemons")).len() >= 6).then_some(())
    });
    let daemons: Vec<i32> = lines(&h.path("out/daemons"))
        .iter()
        .filter_map(|l| l.parse().ok())
        .collect();
    assert!(daemons.iter().all(|p| pid_alive(*p)));
    // Ctrl-C on `gpuam submit --wait` kills the job with the admin token.
    unsafe {
        libc::kill(killer.id() as i32, libc::SIGINT);
    }
    let _ = killer.wait();
    // A daemon counts as alive unless /proc says it is a zombie (Z) or gone: `kill -0`
    // succeeds on a zombie, and under an init that does not reap orphans (CI's) the
    // killed daemons stay zombies, holding no memory, file or device any more.
    let next = job(
        "next",
        2,
        0,
        &[format!(
            "date +%s%N >> {out}/next-start; for p in $(cat {out}/daemons); do \
             st=$(sed -n 's/^State:[[:space:]]*\\(.\\).*/\\1/p' /proc/$p/status 2>/dev/null); \
             case \"$st\" in ''|Z|X) ;; *) echo \"$p $st\" >> {out}/alive-at-next ;; esac; done; true"
        )],
    );
    let status = h.submit("next", &next, true).wait().unwrap();
    assert!(status.success(), "the next job succeeds");
    assert!(
        !h.path("out/alive-at-next").exists(),
        "daemons alive when the next job started: {:?}",
        lines(&h.path("out/alive-at-next"))
    );
    assert!(daemons.iter().all(|p| !pid_alive(*p)), "no daemon survives its job");
    let last_beat: u128 = fs::read_dir(h.path("out"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("beat-"))
        .filter_map(|e| fs::read_to_string(e.path()).ok()?.trim().parse().ok())
        .max()
        .unwrap();
    let first_next: u128 = lines(&h.path("out/next-start"))
        .iter()
        .filter_map(|l| l.parse().ok())
        .min()
        .unwrap();
    let overlap_ms = (last_beat as i128 - first_next as i128) as f64 / 1e6;
    println!("overlap between the killed job's last daemon beat and the next job's start: {overlap_ms:.1} ms (negative: none)");
    assert!(
        last_beat < first_next,
        "the next job started while a daemon of the killed one still ran"
    );

    // 3. Node loss: the task is retried on the other host; the agent restarted kills the
    //    orphan the RM no longer wants.
    let lost = job(
        "lost",
        1,
        2,
        &[format!("echo $GPUAM_HOST $BASHPID >> {out}/lost-runs; sleep 1000")],
    );
    let mut follower = h.submit("lost", &lost, true);
    let first = wait_for(Duration::from_secs(60), "the task runs", || {
        lines(&h.path("out/lost-runs")).first().cloned()
    });
    let (first_host, first_pid) = first
        .split_once(' ')
        .map(|(a, b)| (a.to_string(), b.parse::<i32>().unwrap()))
        .unwrap();
    let victim = if first_host == h1 { "h1" } else { "h2" };
    let t0 = now_ns();
    h.kill(victim);
    wait_for(Duration::from_secs(30), "the node LOST", || {
        h.node_states()
            .iter()
            .any(|(n, s)| *n == first_host && s == "LOST")
            .then_some(())
    });
    println!(
        "node LOST {:.1} s after its agent was killed",
        (now_ns() - t0) as f64 / 1e9
    );
    let second = wait_for(Duration::from_secs(60), "the retry", || {
        lines(&h.path("out/lost-runs")).get(1).cloned()
    });
    assert!(!second.starts_with(&first_host), "retried on the other host: {second}");
    assert!(
        pid_alive(first_pid),
        "the lost node's task still runs (nobody could stop it)"
    );
    h.start_agent(victim);
    wait_for(
        Duration::from_secs(30),
        "the orphan killed after the agent came back",
        || (!pid_alive(first_pid)).then_some(()),
    );
    unsafe {
        libc::kill(follower.id() as i32, libc::SIGINT);
    }
    let _ = follower.wait();
}
