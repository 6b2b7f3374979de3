//! Real hosts for the end-to-end tests: three Linux network namespaces joined by a bridge
//! (in a fourth), the RM (`gpuam rm --nodes-file`, no cluster file) in one, a node
//! agent (`gpuam node`) in each of the other two, each with its own IP on the bridge's
//! network (`10.213.0.0/24`: the RM `.1`, `h1` `.2`, `h2` `.3`).
//!
//! Namespaces are named `node-<pid>-<tag>-{rm,h1,h2,br}` (a tag per test, so tests of one
//! binary do not meet) and deleted when the [`Hosts`] guard drops, even on failure, after
//! every process it started is killed and whatever still runs in the agents' cgroups.
//!
//! Needs root, `ip` (iproute2), `nsenter` (util-linux) and `curl`.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{bin, wait_for};

/// The RM's address on the bridge.
pub const RM_IP: &str = "10.213.0.1";

/// The address of agent host `h1` or `h2` on the bridge.
pub fn host_ip(host: &str) -> &'static str {
    match host {
        "h1" => "10.213.0.2",
        "h2" => "10.213.0.3",
        other => panic!("no agent host `{other}` (h1 or h2)"),
    }
}

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
pub struct Hosts {
    /// `node-<pid>-<tag>`: the namespaces' and the agents' host names' prefix.
    pub prefix: String,
    dir: tempfile::TempDir,
    procs: Vec<(String, Child)>,
    /// Extra arguments every agent started from now on gets (e.g. `--task-env`).
    pub agent_args: Vec<String>,
    /// GPUs each agent offers (2 unless changed before [`Hosts::start_agent`]).
    pub gpus: u32,
    /// The RM keeps its state in SQLite (in its work dir) with a fixed admin token, so
    /// that it can be killed and started again ([`Hosts::restart_rm`]); else in memory.
    pub keep_state: bool,
    /// Processes left behind by a killed RM (its AMs), killed when the guard drops.
    orphans: Vec<i32>,
    /// `tls.*` set for the RM and the agents ([`Hosts::use_tls`]): every call is HTTPS.
    tls: bool,
}

impl Hosts {
    /// The namespace of `name` (`rm`, `h1`, `h2`, `br`).
    pub fn ns(&self, name: &str) -> String {
        format!("{}-{name}", self.prefix)
    }

    /// The host name agent `h1` or `h2` registers with the RM.
    pub fn host_name(&self, host: &str) -> String {
        format!("{}-{host}", self.prefix)
    }

    /// The namespaces, the bridge, the node token, a writable `out/` for the tasks, and
    /// settings with `rm.node_expiry_sec: 6` (a loaded 2-core machine can delay an agent's
    /// heartbeats by 3 s, which a shorter expiry took for a lost node).
    pub fn build(tag: &str) -> Hosts {
        let prefix = format!("node-{}-{tag}", std::process::id());
        let dir = tempfile::tempdir().unwrap();
        // The task user must reach its agent's work dir (not list it).
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o711)).unwrap();
        let h = Hosts {
            prefix,
            dir,
            procs: Vec::new(),
            agent_args: Vec::new(),
            gpus: 2,
            keep_state: false,
            orphans: Vec::new(),
            tls: false,
        };
        let br = h.ns("br");
        ip(&["netns", "add", &br]);
        ip(&["-n", &br, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &br, "link", "set", "br0", "up"]);
        for name in ["rm", "h1", "h2"] {
            let ns = h.ns(name);
            ip(&["netns", "add", &ns]);
            let (a, b) = (format!("v{name}a"), format!("v{name}b"));
            ip(&[
                "-n", &ns, "link", "add", &a, "type", "veth", "peer", "name", &b, "netns", &br,
            ]);
            ip(&["-n", &br, "link", "set", &b, "master", "br0", "up"]);
            let addr = if name == "rm" { RM_IP } else { host_ip(name) };
            ip(&["-n", &ns, "addr", "add", &format!("{addr}/24"), "dev", &a]);
            ip(&["-n", &ns, "link", "set", &a, "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
        }
        // Each host's agent its own token (`gpuam node-token new`), and one for a host that
        // never runs an agent (`rogue`), for the tests of stolen credentials.
        for host in ["h1", "h2", "rogue"] {
            h.node_token_new(host);
        }
        fs::create_dir_all(h.path("out")).unwrap();
        fs::set_permissions(h.path("out"), fs::Permissions::from_mode(0o777)).unwrap();
        fs::write(h.path("conf.yaml"), "rm:\n  node_expiry_sec: 6\n").unwrap();
        h
    }

    /// `gpuam node-token new` for the host name of `host`: its token in `<host>.token`, its
    /// digest in `nodes.yaml` (the RM's nodes file; a running RM reloads it).
    pub fn node_token_new(&self, host: &str) {
        let out = Command::new(bin())
            .args(["node-token", "new", "--host", &self.host_name(host), "--nodes-file"])
            .arg(self.path("nodes.yaml"))
            .arg("--out")
            .arg(self.path(&format!("{host}.token")))
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }

    /// From now on the RM and the agents serve HTTPS (one certificate for the RM's and both
    /// hosts' IPs, signed by a test CA in `ca.pem`) and trust that CA (`tls.*` in the
    /// settings); the helpers here call over HTTPS trusting it.
    pub fn use_tls(&mut self) {
        super::write_test_pki(self.dir.path(), &[RM_IP, host_ip("h1"), host_ip("h2")]);
        fs::write(
            self.path("conf.yaml"),
            "rm:\n  node_expiry_sec: 6\ntls:\n  cert_file: server.pem\n  key_file: server.key\n  ca_file: ca.pem\n",
        )
        .unwrap();
        self.tls = true;
    }

    /// The RM's URL on the bridge (`https` with [`Hosts::use_tls`]).
    pub fn rm_url(&self) -> String {
        format!("{}://{RM_IP}:8088", if self.tls { "https" } else { "http" })
    }

    /// `curl` in namespace `ns`, trusting the test CA with [`Hosts::use_tls`].
    fn curl(&self, ns: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns(ns), "curl"]);
        if self.tls {
            c.arg("--cacert").arg(self.path("ca.pem"));
        }
        c
    }

    /// A path in the test's temporary directory.
    pub fn path(&self, p: &str) -> PathBuf {
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

    /// `gpuam rm` in namespace `rm`, agents only; waits for its admin token (and, with
    /// [`Hosts::keep_state`], until it answers).
    pub fn start_rm(&mut self) {
        let work = self.path("rm").display().to_string();
        let nodes = self.path("nodes.yaml").display().to_string();
        let admin = self.path("admin.token").display().to_string();
        let listen = format!("{RM_IP}:8088");
        let mut args = vec!["rm", "--listen", &listen, "--work-dir", &work, "--nodes-file", &nodes];
        if self.keep_state {
            // One admin token across restarts, where the helpers read it.
            fs::create_dir_all(self.path("rm")).unwrap();
            fs::write(self.path("admin.token"), "admin-token-of-this-test\n").unwrap();
            fs::write(self.path("rm/admin.token"), "admin-token-of-this-test\n").unwrap();
            args.extend(["--admin-token-file", &admin]);
        } else {
            args.push("--in-memory");
        }
        self.spawn("rm", "rm", &args);
        wait_for(Duration::from_secs(30), "the RM's admin token", || {
            self.path("rm/admin.token").exists().then_some(())
        });
        if self.keep_state {
            wait_for(Duration::from_secs(30), "the RM to answer", || {
                (!self.get("/ws/v1/cluster/info").is_null()).then_some(())
            });
        }
    }

    /// SIGKILLs the RM (its AMs keep running) and starts it again after `down`.
    pub fn restart_rm(&mut self, down: Duration) {
        if let Some((_, c)) = self.procs.iter().find(|(l, _)| l == "rm") {
            if let Ok(pid) = i32::try_from(c.id()) {
                self.orphans.extend(gpuam::node::procs::descendants(pid));
            }
        }
        self.kill("rm");
        std::thread::sleep(down);
        self.start_rm();
    }

    /// `gpuam node` for `h1` or `h2` in its namespace, listening on its IP: 2 GPUs (no
    /// topology), 4 CPUs, 8192 MB, ports 20000-20100, plus [`Hosts::agent_args`].
    pub fn start_agent(&mut self, host: &str) {
        let work = self.path(&format!("{host}-work")).display().to_string();
        let token = self.path(&format!("{host}.token")).display().to_string();
        let name = self.host_name(host);
        let listen = format!("{}:8042", host_ip(host));
        let rm = self.rm_url();
        let gpus = self.gpus.to_string();
        let mut args: Vec<String> = [
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
            &gpus,
            "--topology",
            "none",
            "--cpu",
            "4",
            "--memory-mb",
            "8192",
            "--ports",
            "20000-20100",
            "--work-dir",
            &work,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(self.agent_args.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.spawn(host, host, &args);
    }

    /// Kills (SIGKILL) and reaps the process started under `label`.
    pub fn kill(&mut self, label: &str) {
        if let Some(i) = self.procs.iter().position(|(l, _)| l == label) {
            let (_, mut c) = self.procs.remove(i);
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// GET on the RM, from inside its namespace (`Null` when it does not answer JSON).
    pub fn get(&self, path: &str) -> serde_json::Value {
        let out = self
            .curl("rm")
            .arg("-sf")
            .arg(format!("{}{path}", self.rm_url()))
            .output()
            .expect("curl");
        serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
    }

    /// GET on the RM with the admin token, from inside its namespace (`Null` when it does
    /// not answer JSON).
    pub fn get_admin(&self, path: &str) -> serde_json::Value {
        let token = fs::read_to_string(self.path("rm/admin.token")).unwrap_or_default();
        let out = self
            .curl("rm")
            .args(["-sf", "-H"])
            .arg(format!("Authorization: Bearer {}", token.trim()))
            .arg(format!("{}{path}", self.rm_url()))
            .output()
            .expect("curl");
        serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
    }

    /// `POST path` with an empty JSON body and the admin token, from the RM's namespace →
    /// (HTTP status, body).
    pub fn post_admin(&self, path: &str) -> (u16, serde_json::Value) {
        let token = fs::read_to_string(self.path("rm/admin.token")).expect("the admin token");
        self.post_as("rm", &token, path, &serde_json::json!({}))
    }

    /// `POST path` with `body` and bearer `token`, from namespace `ns` → (HTTP status, body).
    pub fn post_as(&self, ns: &str, token: &str, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        let out = self
            .curl(ns)
            .args(["-s", "-w", "\\n%{http_code}"])
            .args(["-X", "POST", "-H", "Content-Type: application/json", "-d"])
            .arg(body.to_string())
            .arg("-H")
            .arg(format!("Authorization: Bearer {}", token.trim()))
            .arg(format!("{}{path}", self.rm_url()))
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout);
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        (
            code.trim().parse().unwrap_or(0),
            serde_json::from_str(body).unwrap_or(serde_json::Value::Null),
        )
    }

    /// The RM's nodes as (host, state).
    pub fn node_states(&self) -> Vec<(String, String)> {
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

    /// Waits until both agents are registered and RUNNING.
    pub fn wait_agents_running(&self) {
        wait_for(Duration::from_secs(30), "both agents registered", || {
            let s = self.node_states();
            (s.len() == 2 && s.iter().all(|(_, st)| st == "RUNNING")).then_some(())
        });
    }

    /// `gpuam submit` in the RM's namespace (output in `submit-<name>.out`); `wait`:
    /// until the job ends.
    pub fn submit(&self, name: &str, yaml: &str, wait: bool) -> Child {
        let job = self.path(&format!("{name}.yaml"));
        fs::write(&job, yaml).unwrap();
        let out = fs::File::create(self.path(&format!("submit-{name}.out"))).unwrap();
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns("rm"), bin(), "submit"])
            .arg(&job)
            .args(["--rm", &self.rm_url(), "--admin-token-file"])
            .arg(self.path("rm/admin.token"))
            .env(
                "GPUAM_TOKEN",
                fs::read_to_string(self.path("rm/admin.token")).unwrap().trim(),
            )
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        if self.tls {
            cmd.env("GPUAM__TLS__CA_FILE", self.path("ca.pem"));
        }
        if wait {
            cmd.arg("--wait");
        }
        cmd.spawn().unwrap()
    }

    /// What `gpuam submit` printed for job `name`.
    pub fn submit_output(&self, name: &str) -> String {
        fs::read_to_string(self.path(&format!("submit-{name}.out"))).unwrap_or_default()
    }

    /// Every container directory of both agents (`<host>-work/containers/<id>`), as
    /// (`h1`/`h2`, path), sorted.
    pub fn container_dirs(&self) -> Vec<(String, PathBuf)> {
        let mut out = Vec::new();
        for host in ["h1", "h2"] {
            for e in fs::read_dir(self.path(&format!("{host}-work/containers")))
                .into_iter()
                .flatten()
                .flatten()
            {
                out.push((host.to_string(), e.path()));
            }
        }
        out.sort();
        out
    }

    /// The processes' logs, the submissions' output and the tail of every container's
    /// and AM's stderr (printed when a test fails).
    pub fn logs(&self) -> String {
        let tail = |t: &str| -> String {
            let skip = t.chars().count().saturating_sub(3000);
            t.chars().skip(skip).collect()
        };
        let mut s = String::new();
        // The processes' `<label>.log` and the submissions' `submit-<name>.out`.
        let mut files: Vec<PathBuf> = fs::read_dir(self.dir.path())
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name().is_some_and(|n| {
                    let n = n.to_string_lossy();
                    n.ends_with(".log") || n.starts_with("submit-")
                })
            })
            .collect();
        files.sort();
        for f in files {
            s.push_str(&format!(
                "--- {}\n{}\n",
                f.display(),
                tail(&fs::read_to_string(&f).unwrap_or_default())
            ));
        }
        let mut dirs: Vec<PathBuf> = self.container_dirs().into_iter().map(|(_, d)| d).collect();
        dirs.extend(
            fs::read_dir(self.path("rm"))
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path()),
        );
        for d in dirs {
            for f in ["am.stderr", "stderr"] {
                if let Ok(t) = fs::read_to_string(d.join(f)) {
                    s.push_str(&format!("--- {}/{f}\n{}\n", d.display(), tail(&t)));
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
        // The RM's AMs are its children; one still winding down a killed job would outlive
        // the RM and retry it until `am.rm_unreachable_timeout_sec`. Found before the kill
        // (afterwards they belong to init), killed after it.
        let descendants: Vec<i32> = self
            .procs
            .iter()
            .filter_map(|(_, c)| i32::try_from(c.id()).ok())
            .flat_map(gpuam::node::procs::descendants)
            .chain(self.orphans.iter().copied())
            .collect();
        for (_, c) in &mut self.procs {
            let _ = c.kill();
            let _ = c.wait();
        }
        for pid in descendants {
            // SAFETY: plain syscall; a process that is gone gives ESRCH.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
        // Whatever still runs in the agents' cgroups goes too, then the cgroups themselves
        // (these agents are gone for good; a real node keeps its parent cgroup).
        for host in ["h1", "h2"] {
            let cg = PathBuf::from(format!("/sys/fs/cgroup/unified/gpuam-{}-{host}", self.prefix));
            for e in fs::read_dir(&cg).into_iter().flatten().flatten() {
                let _ = fs::write(e.path().join("cgroup.kill"), "1");
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        for host in ["h1", "h2"] {
            remove_cgroups(&format!("gpuam-{}-{host}", self.prefix));
        }
        for ns in ["rm", "h1", "h2", "br"] {
            let _ = Command::new("ip").args(["netns", "del", &self.ns(ns)]).status();
        }
    }
}

/// Removes cgroup `name` and the cgroups below it from every hierarchy mounted under
/// /sys/fs/cgroup (v2 alone, or v1 controllers beside v2's `unified`). Only empty cgroups
/// can be removed: call it once their processes are dead.
fn remove_cgroups(name: &str) {
    fn remove_tree(dir: &std::path::Path) {
        for e in fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&e.path());
            }
        }
        let _ = fs::remove_dir(dir);
    }
    let root = std::path::Path::new("/sys/fs/cgroup");
    let mut dirs = vec![root.join(name)];
    dirs.extend(
        fs::read_dir(root)
            .into_iter()
            .flatten()
            .flatten()
            .map(|h| h.path().join(name)),
    );
    for d in dirs.into_iter().filter(|d| d.is_dir()) {
        remove_tree(&d);
    }
}
