//! Shared helpers of the end-to-end tests: start a real `gpuam rm` process (which
//! launches real `gpuam am` processes, which start real task process groups), write
//! cluster and job files into a per-test temporary directory, submit jobs with
//! `gpuam submit --wait`, talk to the RM's REST API, and check process liveness.
//!
//! Credentials: every RM gets a users file (`users.yaml` in the test's directory) with
//! the user `itest`, whose token every `gpuam` command of the helper carries
//! (`GPUAM_TOKEN`) and every REST read of the helper presents; `other` is a second user.
//!
//! Every process a helper starts is stopped when its guard is dropped (the RM gets
//! SIGINT, which stops its AMs and containers, then SIGKILL if it lingers), so a failing
//! test leaves nothing behind. When a test panics, the RM's and AMs' logs are printed and
//! the temporary directory is kept for inspection.

#![allow(dead_code)] // each test binary uses a different subset

pub mod browser;
pub mod hosts;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A finished command's exit status, stdout and stderr, for an assertion's message.
pub fn text(o: &std::process::Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The `gpuam` binary built by cargo for this test run.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_gpuam")
}

/// Polls `f` every 25 ms until it returns `Some`, or panics with `what` after `timeout`.
pub fn wait_for<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        if start.elapsed() > timeout {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// A YAML single-quoted scalar (so `$VAR`, `"` and `:` reach bash unchanged).
pub fn sq(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// Quotes text for bash: `'...'` with each `'` written as `'\''`.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Parses `0x3f` (or decimal).
pub fn parse_mask(s: &str) -> u64 {
    let s = s.trim();
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).unwrap_or_else(|e| panic!("bad mask `{s}`: {e}")),
        None => s.parse().unwrap_or_else(|e| panic!("bad mask `{s}`: {e}")),
    }
}

/// Parses "20000-20003,20010" into the list of ports ("" = none).
pub fn parse_ranges(s: &str) -> Vec<u16> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => out.extend(a.parse::<u16>().unwrap()..=b.parse::<u16>().unwrap()),
            None => out.push(part.parse().unwrap()),
        }
    }
    out
}

/// Parses `CONTAINER_PORTS` ("http:2001;ssh:2002,2003;") into (label, ports) in order.
pub fn parse_container_ports(s: &str) -> Vec<(String, Vec<u16>)> {
    s.split(';')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (l, ps) = p
                .split_once(':')
                .unwrap_or_else(|| panic!("bad CONTAINER_PORTS entry `{p}` in `{s}`"));
            (
                l.to_string(),
                ps.split(',')
                    .filter(|x| !x.is_empty())
                    .map(|x| x.parse().unwrap())
                    .collect(),
            )
        })
        .collect()
}

/// Reads a `env | sort` dump into a map (multi-line values are ignored).
pub fn read_env_file(path: &Path) -> BTreeMap<String, String> {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// One node of the RM's listing, reduced to what the tests compare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeUse {
    pub host: String,
    pub gpu_total: u64,
    pub gpu_used: u64,
    pub ports_total: String,
    pub ports_used: String,
    pub cpu_used: u64,
    pub mem_used: u64,
    pub containers: u64,
    /// Hundredths used on GPUs held in part (`usedGpuShares` as JSON text; "" = none).
    pub gpu_shares_used: String,
    /// Custom resources in use (`usedCustomResources` as JSON text; "" = none).
    pub custom_used: String,
}

fn node_use(n: &Value) -> NodeUse {
    let s = |k: &str| n[k].as_str().unwrap_or("").to_string();
    NodeUse {
        host: s("nodeHostName"),
        gpu_total: parse_mask(&s("gpuAttribute")),
        gpu_used: parse_mask(&s("usedGpuAttribute")),
        ports_total: s("portRanges"),
        ports_used: s("usedPortRanges"),
        cpu_used: n["usedVirtualCores"].as_u64().unwrap_or(0),
        mem_used: n["usedMemoryMB"].as_u64().unwrap_or(0),
        containers: n["numContainers"].as_u64().unwrap_or(0),
        gpu_shares_used: n.get("usedGpuShares").map(|v| v.to_string()).unwrap_or_default(),
        custom_used: n
            .get("usedCustomResources")
            .filter(|v| v.as_object().is_some_and(|o| !o.is_empty()))
            .map(|v| v.to_string())
            .unwrap_or_default(),
    }
}

/// Output of a finished command.
#[derive(Debug)]
pub struct Finished {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

/// A running `gpuam submit --wait`, with its output going to files.
pub struct Submission {
    child: Option<Child>,
    stdout: PathBuf,
    stderr: PathBuf,
    started: Instant,
}

impl Submission {
    pub fn stdout(&self) -> String {
        fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    pub fn stderr(&self) -> String {
        fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// The application id from the `submitted job `x` as ID` line.
    pub fn app_id(&self, timeout: Duration) -> String {
        wait_for(timeout, "the `submitted job` line", || {
            self.stdout()
                .lines()
                .find_map(|l| {
                    l.starts_with("submitted job ")
                        .then(|| l.rsplit(' ').next().map(str::to_string))
                })
                .flatten()
        })
    }

    /// The exit code if the command has exited (-1 for a signal), without waiting.
    pub fn try_exit(&mut self) -> Option<i32> {
        let status = self.child.as_mut()?.try_wait().unwrap()?;
        Some(status.code().unwrap_or(-1))
    }

    /// Waits for the command to exit; panics (after killing it) on timeout.
    pub fn wait(mut self, timeout: Duration) -> Finished {
        let child = self.child.as_mut().unwrap();
        let status = wait_for(timeout, "`gpuam submit --wait` to exit", || child.try_wait().unwrap());
        self.child = None;
        Finished {
            code: status.code().unwrap_or(-1),
            stdout: self.stdout(),
            stderr: self.stderr(),
            elapsed: self.started.elapsed(),
        }
    }
}

impl Drop for Submission {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Two nodes of 8 CPUs, 8000 MB and 2 GPUs each.
pub const TWO_NODES_TWO_GPUS: &str = "nodes:\n  - host: n1\n    cpu: 8\n    memoryMB: 8000\n    gpus: 2\n  - host: n2\n    cpu: 8\n    memoryMB: 8000\n    gpus: 2\n";

/// A standalone `gpuam rm` process on 127.0.0.1 (port chosen by the OS) with its own
/// temporary directory for the cluster file, settings, job files, the RM's work dir and
/// whatever the tasks write.
pub struct Rm {
    child: Option<Child>,
    pub url: String,
    pub work_dir: PathBuf,
    dir: Option<tempfile::TempDir>,
    config: PathBuf,
    env: Vec<(String, String)>,
    /// The node listing before any job ran.
    pub baseline: Vec<NodeUse>,
    rt: tokio::runtime::Runtime,
    http: reqwest::Client,
    seq: std::cell::Cell<u32>,
    /// How many `gpuam rm` processes this guard has started (1 after `start`).
    incarnation: u32,
    /// The binary the RM runs ([`bin`] unless [`Rm::restart_from`] named another).
    program: PathBuf,
    /// The token of user `itest` (in `users.yaml`).
    pub user_token: String,
    /// The token of user `other`.
    pub other_token: String,
}

/// The users file of a test RM, in its directory.
pub const USERS_FILE: &str = "users.yaml";

impl Rm {
    /// Starts an RM serving `cluster_yaml`, with `env` (e.g. `GPUAM__SELECT__SEED`)
    /// in its environment, which the AMs it launches inherit.
    pub fn start(cluster_yaml: &str, env: &[(&str, &str)]) -> Rm {
        Rm::start_with_settings(cluster_yaml, "", env)
    }

    /// As [`Rm::start`], with `extra_settings_yaml` appended to the settings file (which
    /// already has an `rm:` section; relative paths in it are relative to the temporary
    /// directory).
    pub fn start_with_settings(cluster_yaml: &str, extra_settings_yaml: &str, env: &[(&str, &str)]) -> Rm {
        Rm::start_in(Rm::temp_dir(), cluster_yaml, extra_settings_yaml, env)
    }

    /// A fresh temporary directory for [`Rm::start_in`] (to put files in before the RM starts).
    pub fn temp_dir() -> tempfile::TempDir {
        tempfile::Builder::new().prefix("gpuam-itest-").tempdir().unwrap()
    }

    /// As [`Rm::start_with_settings`], in a temporary directory the test prepared. When
    /// the settings name a `tls.ca_file`, this helper's own client trusts it.
    pub fn start_in(dir: tempfile::TempDir, cluster_yaml: &str, extra_settings_yaml: &str, env: &[(&str, &str)]) -> Rm {
        let root = dir.path().to_path_buf();
        let cluster = root.join("cluster.yaml");
        fs::write(&cluster, cluster_yaml).unwrap();
        // Own settings file, so the tests do not depend on conf/gpuam.yaml.
        let config = root.join("gpuam.yaml");
        fs::write(
            &config,
            format!("rm:\n  container_expiry_sec: 600\n{extra_settings_yaml}"),
        )
        .unwrap();
        let work_dir = root.join("rm-work");
        let user_token = gpuam::rm::users::add_token(&root.join(USERS_FILE), "itest").unwrap();
        let other_token = gpuam::rm::users::add_token(&root.join(USERS_FILE), "other").unwrap();
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let program = PathBuf::from(bin());
        let child = spawn_rm(&program, &root, &cluster, &config, &work_dir, &env, "127.0.0.1:0", 1);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        // The settings as the RM reads them (without the caller's environment), for the CA.
        // (Invalid settings are the RM's to report, below.)
        let ca_file = gpuam::config::Settings::load_with_env(Some(&config), env.clone())
            .ok()
            .and_then(|s| s.tls.ca_file);
        let http = gpuam::tls::http_client_builder(ca_file.as_deref())
            .unwrap()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let mut rm = Rm {
            child: Some(child),
            url: String::new(),
            work_dir,
            dir: Some(dir),
            config,
            env,
            baseline: Vec::new(),
            rt,
            http,
            seq: std::cell::Cell::new(0),
            incarnation: 1,
            program,
            user_token,
            other_token,
        };
        rm.url = rm.wait_listening();
        rm.baseline = wait_for(Duration::from_secs(10), "the RM to answer", || rm.try_nodes());
        rm
    }

    /// Stdout and stderr file names of RM incarnation `n` (1: `rm.stdout`, `rm.stderr`;
    /// later: `rm-N.stdout`, `rm-N.stderr`, so each start's `listening on` line is its own).
    fn rm_output_names(n: u32) -> (String, String) {
        if n == 1 {
            ("rm.stdout".into(), "rm.stderr".into())
        } else {
            (format!("rm-{n}.stdout"), format!("rm-{n}.stderr"))
        }
    }

    /// Waits for the current RM process's "gpuam rm listening on URL (work dir DIR)" line.
    fn wait_listening(&mut self) -> String {
        let (out, err) = Self::rm_output_names(self.incarnation);
        let (stdout, stderr) = (self.path(&out), self.path(&err));
        let child = self.child.as_mut().unwrap();
        wait_for(Duration::from_secs(20), "the RM's `listening on` line", || {
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "the RM exited ({status}) before listening:\n{}",
                    fs::read_to_string(&stderr).unwrap_or_default()
                );
            }
            let out = fs::read_to_string(&stdout).unwrap_or_default();
            out.lines()
                .find_map(|l| l.strip_prefix("gpuam rm listening on "))
                .and_then(|rest| rest.split_whitespace().next())
                .map(str::to_string)
        })
    }

    /// The pid of the current RM process (`None` after `kill_hard`).
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }

    /// The current RM process's exit status if it has exited (it is reaped then).
    pub fn try_exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut()?.try_wait().unwrap()
    }

    /// The TCP port of the RM's URL.
    pub fn port(&self) -> u16 {
        self.url
            .rsplit(':')
            .next()
            .and_then(|p| p.trim_end_matches('/').parse().ok())
            .unwrap_or_else(|| panic!("no port in the RM url `{}`", self.url))
    }

    /// The pid of the live `gpuam am` process of this RM's application `app`, if any
    /// (matched by its job file in this RM's work dir: RMs started in the same
    /// millisecond by parallel tests hand out the same application ids).
    pub fn am_pid(&self, app: &str) -> Option<i32> {
        let job = format!("{}/{app}/job.yaml", self.work_dir.display());
        pids_with_cmdline(&[" am ", &job]).into_iter().next()
    }

    /// How many RM processes this guard has started so far.
    pub fn incarnation(&self) -> u32 {
        self.incarnation
    }

    /// Kills the RM process with SIGKILL (no shutdown: its AMs and task processes are
    /// left running, as after a crash) and reaps it.
    pub fn kill_hard(&mut self) {
        if let Some(mut c) = self.child.take() {
            unsafe {
                libc::kill(c.id() as i32, libc::SIGKILL);
            }
            let _ = c.wait();
        }
    }

    /// [`Rm::restart`] running `program` as the RM (a copy of the binary a test can replace).
    pub fn restart_from(&mut self, program: &Path) {
        self.program = program.to_path_buf();
        self.restart();
    }

    /// Starts `gpuam rm` again with the same cluster file, settings, environment and
    /// `--work-dir`, listening on the old URL's port; waits until it prints its
    /// `listening on` line (read from this incarnation's own stdout file) and answers
    /// the node listing. Kills a still-running RM first.
    pub fn restart(&mut self) {
        self.kill_hard();
        self.incarnation += 1;
        let listen = format!("127.0.0.1:{}", self.port());
        let root = self.root().to_path_buf();
        // The old socket may linger for a moment: retry a start that fails to bind.
        let start = Instant::now();
        loop {
            let child = spawn_rm(
                &self.program,
                &root,
                &root.join("cluster.yaml"),
                &self.config,
                &self.work_dir,
                &self.env,
                &listen,
                self.incarnation,
            );
            self.child = Some(child);
            let (out, _) = Self::rm_output_names(self.incarnation);
            let stdout = self.path(&out);
            let up = wait_for(Duration::from_secs(20), "the restarted RM to listen or exit", || {
                let c = self.child.as_mut().unwrap();
                if fs::read_to_string(&stdout)
                    .unwrap_or_default()
                    .contains("gpuam rm listening on ")
                {
                    return Some(true);
                }
                c.try_wait().unwrap().map(|_| false)
            });
            if up {
                break;
            }
            self.child = None;
            if start.elapsed() > Duration::from_secs(10) {
                let (_, err) = Self::rm_output_names(self.incarnation);
                panic!(
                    "the RM could not be restarted on {listen}:\n{}",
                    fs::read_to_string(self.path(&err)).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let url = self.wait_listening();
        assert_eq!(url, self.url, "the restarted RM listens on the old URL");
        wait_for(Duration::from_secs(10), "the restarted RM to answer", || {
            self.try_nodes()
        });
    }

    /// `PUT /ws/v1/cluster/nodes/{host}/state {"state": STATE}` with the admin token →
    /// (status, body).
    pub fn set_node_state(&self, host: &str, state: &str) -> (u16, Value) {
        self.put_json(
            &format!("/ws/v1/cluster/nodes/{host}/state"),
            Some(&self.admin_token()),
            &serde_json::json!({ "state": state }),
        )
    }

    /// `GET /ws/v1/cluster/apps/{id}` → the `app` object, `None` on any failure (for
    /// polling while the RM may be down).
    pub fn try_app(&self, id: &str) -> Option<Value> {
        self.get(&format!("/ws/v1/cluster/apps/{id}"))
            .ok()
            .map(|v| v["app"].clone())
    }

    /// The node listing, `None` on any failure (for polling while the RM may be down).
    pub fn try_node_list(&self) -> Option<Vec<NodeUse>> {
        self.try_nodes()
    }

    /// The test's temporary directory (absolute).
    pub fn root(&self) -> &Path {
        self.dir.as_ref().unwrap().path()
    }

    /// The lines of a file in the temporary directory (none when it does not exist), e.g.
    /// a task's record of its runs.
    pub fn lines(&self, name: &str) -> Vec<String> {
        fs::read_to_string(self.path(name))
            .map(|t| t.lines().map(str::to_string).collect())
            .unwrap_or_default()
    }

    /// A path in the temporary directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.root().join(name)
    }

    /// Writes a job file; returns its path.
    pub fn write_job(&self, name: &str, yaml: &str) -> PathBuf {
        let p = self.path(&format!("{name}.yaml"));
        fs::write(&p, yaml).unwrap();
        p
    }

    /// A `gpuam` command with the test's settings and environment, as user `itest`
    /// (`GPUAM_TOKEN`).
    pub fn gpuam(&self) -> Command {
        let mut cmd = Command::new(bin());
        cmd.current_dir(self.root()).stdin(Stdio::null());
        scrub_env(&mut cmd, &self.config, &self.env);
        cmd.env("GPUAM_TOKEN", &self.user_token);
        cmd
    }

    /// `gpuam ARGS` against this RM as the holder of `token` (from the environment, with no
    /// client config file).
    pub fn as_user(&self, token: &str, args: &[&str]) -> std::process::Output {
        let mut cmd = self.gpuam();
        cmd.env("GPUAM_TOKEN", token).env("GPUAM_RM", &self.url);
        cmd.env("GPUAM_CLIENT_CONFIG", self.path("no-client-config.yaml"));
        cmd.args(args).output().unwrap()
    }

    /// Runs `gpuam plan JOB --cluster <this RM's cluster file> --json`.
    pub fn plan_json(&self, job: &Path) -> Value {
        let out = self
            .gpuam()
            .arg("plan")
            .arg(job)
            .arg("--cluster")
            .arg(self.path("cluster.yaml"))
            .arg("--json")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "plan failed: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("plan --json is not JSON ({e}): {stdout}"))
    }

    /// Starts `gpuam submit JOB --rm URL --wait` in the background.
    pub fn submit(&self, job: &Path) -> Submission {
        let n = self.seq.get() + 1;
        self.seq.set(n);
        let stdout = self.path(&format!("submit-{n}.stdout"));
        let stderr = self.path(&format!("submit-{n}.stderr"));
        let child = self
            .gpuam()
            .arg("submit")
            .arg(job)
            .arg("--rm")
            .arg(&self.url)
            .arg("--wait")
            .stdout(fs::File::create(&stdout).unwrap())
            .stderr(fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        Submission {
            child: Some(child),
            stdout,
            stderr,
            started: Instant::now(),
        }
    }

    /// Submits and waits for the end.
    pub fn run_job(&self, job: &Path, timeout: Duration) -> Finished {
        self.submit(job).wait(timeout)
    }

    /// `GET path` as user `itest`.
    fn get(&self, path: &str) -> Result<Value, String> {
        let url = format!("{}{path}", self.url);
        self.rt.block_on(async {
            let r = self
                .http
                .get(&url)
                .bearer_auth(&self.user_token)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            let status = r.status();
            let v: Value = r.json().await.map_err(|e| e.to_string())?;
            if status.is_success() {
                Ok(v)
            } else {
                Err(format!("GET {path}: {status}: {v}"))
            }
        })
    }

    fn try_nodes(&self) -> Option<Vec<NodeUse>> {
        let v = self.get("/ws/v1/cluster/nodes").ok()?;
        let mut out: Vec<NodeUse> = v["nodes"]["node"].as_array()?.iter().map(node_use).collect();
        out.sort_by(|a, b| a.host.cmp(&b.host));
        Some(out)
    }

    /// `GET /ws/v1/cluster/nodes`, sorted by host.
    pub fn nodes(&self) -> Vec<NodeUse> {
        self.try_nodes().expect("GET /ws/v1/cluster/nodes")
    }

    /// One node of the listing.
    pub fn node(&self, host: &str) -> NodeUse {
        self.nodes()
            .into_iter()
            .find(|n| n.host == host)
            .unwrap_or_else(|| panic!("no node `{host}` in the RM's listing"))
    }

    /// `GET /ws/v1/cluster/apps/{id}` → the `app` object.
    pub fn app(&self, id: &str) -> Value {
        let v = self.get(&format!("/ws/v1/cluster/apps/{id}")).unwrap();
        v["app"].clone()
    }

    /// `GET url` (absolute) → its text, `None` on any failure.
    pub fn get_text(&self, url: &str) -> Option<String> {
        self.rt.block_on(async {
            let r = self.http.get(url).send().await.ok()?;
            if !r.status().is_success() {
                return None;
            }
            r.text().await.ok()
        })
    }

    /// As [`Rm::get_text`], with `token` as the bearer.
    pub fn get_text_as(&self, url: &str, token: &str) -> Option<String> {
        self.rt.block_on(async {
            let r = self.http.get(url).bearer_auth(token).send().await.ok()?;
            if !r.status().is_success() {
                return None;
            }
            r.text().await.ok()
        })
    }

    /// `GET {path}` → the JSON answer (Err with the status on failure).
    pub fn get_json(&self, path: &str) -> Result<Value, String> {
        self.get(path)
    }

    /// Any request: `method path` (or an absolute URL) with an optional bearer token and raw body →
    /// (status, body as JSON or `Value::String` of the text).
    pub fn request(&self, method: &str, path: &str, token: Option<&str>, body: Option<Vec<u8>>) -> (u16, Value) {
        let url = if path.starts_with("http") {
            path.to_string()
        } else {
            format!("{}{path}", self.url)
        };
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        self.rt.block_on(async {
            let mut req = self.http.request(method, &url);
            if let Some(t) = token {
                req = req.bearer_auth(t);
            }
            if let Some(b) = body {
                req = req.header("content-type", "application/json").body(b);
            }
            let r = req.send().await.unwrap();
            let status = r.status().as_u16();
            let text = r.text().await.unwrap_or_default();
            (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
        })
    }

    /// The admin token the RM generated into its work dir.
    pub fn admin_token(&self) -> String {
        fs::read_to_string(self.work_dir.join("admin.token"))
            .expect("the RM writes <work_dir>/admin.token")
            .trim()
            .to_string()
    }

    /// `PUT {path}` with a JSON body and an optional bearer token → (status, body).
    pub fn put_json(&self, path: &str, token: Option<&str>, body: &Value) -> (u16, Value) {
        let url = format!("{}{path}", self.url);
        self.rt.block_on(async {
            let mut req = self.http.put(&url).json(body);
            if let Some(t) = token {
                req = req.bearer_auth(t);
            }
            let r = req.send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json().await.unwrap_or(Value::Null))
        })
    }

    /// `PUT /ws/v1/cluster/apps/{id}/state {"state":"KILLED"}` with the admin token.
    pub fn kill_app(&self, id: &str) {
        let url = format!("{}/ws/v1/cluster/apps/{id}/state", self.url);
        let token = self.admin_token();
        let status = self.rt.block_on(async {
            self.http
                .put(&url)
                .bearer_auth(&token)
                .json(&serde_json::json!({"state": "KILLED"}))
                .send()
                .await
                .unwrap()
                .status()
        });
        assert!(status.is_success(), "kill {id}: HTTP {status}");
    }

    /// Waits until the app reaches a final state; returns the app object.
    pub fn wait_app_final(&self, id: &str, timeout: Duration) -> Value {
        wait_for(timeout, &format!("app {id} to end"), || {
            let a = self.app(id);
            matches!(a["state"].as_str(), Some("FINISHED" | "FAILED" | "KILLED")).then_some(a)
        })
    }

    /// Container records (`<work_dir>/containers/[<role>-<index>@]<id>`) of an application.
    pub fn container_dirs(&self, app_id: &str) -> Vec<PathBuf> {
        let suffix = app_id.strip_prefix("application_").unwrap_or(app_id);
        let prefix = format!("container_{suffix}_");
        let mut out: Vec<PathBuf> = fs::read_dir(self.work_dir.join("containers"))
            .map(|rd| {
                rd.filter_map(Result::ok)
                    .filter(|e| {
                        let name = e.file_name().to_string_lossy().into_owned();
                        gpuam::node::executor::record_id(&name).is_some_and(|id| id.starts_with(&prefix))
                    })
                    .map(|e| e.path())
                    .collect()
            })
            .unwrap_or_default();
        out.sort();
        out
    }

    /// Asserts that, within `timeout`, every node is back at its baseline use: no
    /// container, GPU bit, port, CPU or memory left booked by any job.
    pub fn assert_all_free(&self, timeout: Duration) {
        let start = Instant::now();
        loop {
            let now = self.nodes();
            if now == self.baseline {
                return;
            }
            if start.elapsed() > timeout {
                panic!(
                    "the RM's ledger is not back to its baseline after {timeout:?}:\nnow:      {now:#?}\nbaseline: {:#?}",
                    self.baseline
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The RM's and every AM's stderr (for failure messages).
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for n in 1..=self.incarnation.max(1) {
            let (_, err) = Self::rm_output_names(n);
            out.push_str(&format!(
                "--- {err}\n{}",
                fs::read_to_string(self.path(&err)).unwrap_or_default()
            ));
        }
        if let Ok(rd) = fs::read_dir(&self.work_dir) {
            let mut apps: Vec<PathBuf> = rd.filter_map(Result::ok).map(|e| e.path()).collect();
            apps.sort();
            for a in apps {
                if let Ok(t) = fs::read_to_string(a.join("am.stderr")) {
                    out.push_str(&format!("--- {}/am.stderr\n{t}", a.display()));
                }
            }
        }
        out
    }
}

impl Drop for Rm {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SIGINT: the RM stops its AMs and containers, then exits.
            unsafe {
                libc::kill(c.id() as i32, libc::SIGINT);
            }
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(10) {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
            if let Some(d) = self.dir.take() {
                eprintln!("test files kept in {}", d.keep().display());
            }
        }
    }
}

/// Starts one `gpuam rm` process (incarnation `n` writes its own stdout/stderr files).
#[allow(clippy::too_many_arguments)]
fn spawn_rm(
    program: &Path,
    root: &Path,
    cluster: &Path,
    config: &Path,
    work_dir: &Path,
    env: &[(String, String)],
    listen: &str,
    n: u32,
) -> Child {
    let (out, err) = Rm::rm_output_names(n);
    let mut cmd = rm_command(program, root, cluster, config, work_dir, env, listen);
    cmd.stdout(fs::File::create(root.join(out)).unwrap())
        .stderr(fs::File::create(root.join(err)).unwrap());
    cmd.spawn().unwrap()
}

impl Rm {
    /// The `gpuam rm` command this guard runs (same cluster, settings, users and work dir)
    /// on `listen`, for a test to add flags to and run itself.
    pub fn rm_command(&self, listen: &str) -> Command {
        let root = self.root().to_path_buf();
        rm_command(
            &self.program,
            &root,
            &root.join("cluster.yaml"),
            &self.config,
            &self.work_dir,
            &self.env,
            listen,
        )
    }
}

fn rm_command(
    program: &Path,
    root: &Path,
    cluster: &Path,
    config: &Path,
    work_dir: &Path,
    env: &[(String, String)],
    listen: &str,
) -> Command {
    let mut cmd = Command::new(program);
    cmd.arg("rm")
        .arg("--cluster")
        .arg(cluster)
        .arg("--listen")
        .arg(listen)
        .arg("--work-dir")
        .arg(work_dir)
        .arg("--users-file")
        .arg(root.join(USERS_FILE))
        .current_dir(root)
        .stdin(Stdio::null());
    scrub_env(&mut cmd, config, env);
    if !env.iter().any(|(k, _)| k == "GPUAM_LOG") {
        cmd.env("GPUAM_LOG", "info");
    }
    cmd
}

/// Pids of live processes whose command line contains every one of `needles`
/// (arguments joined by spaces), e.g. `[" am ", app_id]` for a job's AM.
pub fn pids_with_cmdline(needles: &[&str]) -> Vec<i32> {
    let mut out = Vec::new();
    for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(raw) = fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&raw).replace('\0', " ");
        if needles.iter().all(|n| cmd.contains(n)) && pid_alive(pid) {
            out.push(pid);
        }
    }
    out.sort();
    out
}

/// Sends `sig` to every process of group `pgid`; true when the group existed.
pub fn signal_group(pgid: i32, sig: i32) -> bool {
    assert!(pgid > 1, "refusing to signal process group {pgid}");
    unsafe { libc::kill(-pgid, sig) == 0 }
}

/// Cumulative histogram buckets `(le, count)` of metric `name` in a Prometheus text
/// exposition (`+Inf` as `f64::INFINITY`), in the order given.
pub fn prom_histogram(text: &str, name: &str) -> Vec<(f64, u64)> {
    let prefix = format!("{name}_bucket{{le=\"");
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (le, rest) = rest.split_once("\"}")?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((le, rest.trim().parse().ok()?))
        })
        .collect()
}

/// The test's settings file and environment, and none of the caller's `GPUAM_*`.
fn scrub_env(cmd: &mut Command, config: &Path, env: &[(String, String)]) {
    for (k, _) in std::env::vars() {
        if k.starts_with("GPUAM") {
            cmd.env_remove(k);
        }
    }
    cmd.env("GPUAM_CONFIG", config);
    // The tasks of these tests write into the test's private directory, which their own
    // uid could not reach: the in-process node runs them as the RM's user, unless a test
    // asks otherwise (`tenants::in_process_*` runs the default).
    cmd.env("GPUAM__NODE__IN_PROCESS_IDENTITY", "false");
    for (k, v) in env {
        cmd.env(k, v);
    }
}

/// Whether a process is alive (zombies count as dead: nothing here reaps orphans,
/// so a killed task's orphaned children may linger as zombies under PID 1).
pub fn pid_alive(pid: i32) -> bool {
    if unsafe { libc::kill(pid, 0) } != 0 {
        assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::ESRCH));
        return false;
    }
    proc_state(pid).is_some_and(|s| s != 'Z')
}

/// The live (non-zombie) members of process group `pgid`.
pub fn group_members(pgid: i32) -> Vec<i32> {
    if unsafe { libc::kill(-pgid, 0) } != 0 {
        let err = std::io::Error::last_os_error().raw_os_error();
        assert_eq!(err, Some(libc::ESRCH), "kill(-{pgid}, 0)");
        return Vec::new();
    }
    let mut out = Vec::new();
    for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp ...; comm may hold spaces, so split after ')'.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.len() > 2 && f[2].parse::<i32>().ok() == Some(pgid) && f[0] != "Z" {
            out.push(pid);
        }
    }
    out
}

fn proc_state(pid: i32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().next()?.chars().next()
}

/// Waits until no live process remains in any of `pgids`.
pub fn wait_groups_gone(pgids: &[i32], timeout: Duration) {
    wait_for(timeout, &format!("process groups {pgids:?} to be gone"), || {
        pgids.iter().all(|&g| group_members(g).is_empty()).then_some(())
    });
}

/// A test CA and a server certificate for `names` (IP addresses or DNS names) signed by
/// it, written into `dir` as `ca.pem`, `server.pem` and `server.key`; also
/// `other-ca.pem`, a CA that signed nothing here.
pub fn write_test_pki(dir: &Path, names: &[&str]) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
    let ca = |name: &str| {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).unwrap();
        (cert, Issuer::new(params, key))
    };
    let (ca_cert, issuer) = ca("gpuam test CA");
    let (other_ca, _) = ca("gpuam other CA");
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
    params.distinguished_name.push(DnType::CommonName, "gpuam test server");
    let cert = params.signed_by(&key, &issuer).unwrap();
    fs::write(dir.join("ca.pem"), ca_cert.pem()).unwrap();
    fs::write(dir.join("other-ca.pem"), other_ca.pem()).unwrap();
    fs::write(dir.join("server.pem"), cert.pem()).unwrap();
    fs::write(dir.join("server.key"), key.serialize_pem()).unwrap();
}
