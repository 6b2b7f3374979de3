//! Issue 23's attacks on the node, with two users (alice, bob), an RM and two node agents,
//! each "machine" a network namespace (`common::hosts`), each asserting the outcome:
//!
//! - alice's task cannot read bob's launch.sh (with his secret), his shell's
//!   /proc/PID/environ or mem, cannot signal or ptrace his task, cannot create or list
//!   files in his directory or read his logs; the two run as different uids; bob's task is
//!   alive afterwards, and its directory is gone once it ended (its logs stay);
//! - a task that makes its directory's `acked`, `.preempt.tmp` and `image-container`
//!   links to a root-only file, deletes its launch.sh and writes a `process.json` naming a
//!   root process cannot change that file (preemption notice, acknowledgement), cannot
//!   write the node's record, and is re-attached by the restarted agent as itself: the RM
//!   keeps its GPUs, and stopping it leaves the root process alive. Under cgroups and
//!   under the subreaper shim;
//! - under a standalone `gpuam rm` (its in-process node) a task cannot read the admin
//!   token or another process's environment (`in_process_tasks_*`).
//!
//! Needs root, `ip`, `nsenter`, `curl` and `perl` (for ptrace).

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::hosts::{host_ip, Hosts, RM_IP};
use common::{bin, pid_alive, sq, wait_for};

/// The hosts with users alice and bob in the RM's users file, a private uid registry and
/// a long node expiry (an agent restarted here must not be taken for lost); an ended
/// task's directory goes 1 s after its end (`node.work_dir_grace_sec`, 30 s by default).
fn tenant_hosts(tag: &str, agent_args: &[&str]) -> (Hosts, String, String) {
    let mut h = Hosts::build(tag);
    let users = h.path("users");
    let alice = gpuam::rm::users::add_token(&users, "alice").unwrap();
    let bob = gpuam::rm::users::add_token(&users, "bob").unwrap();
    fs::write(
        h.path("conf.yaml"),
        format!(
            "rm:\n  node_expiry_sec: 60\n  users_file: {}\nnode:\n  task_uid_registry: {}\n  work_dir_grace_sec: 1\n",
            users.display(),
            h.path("uids").display()
        ),
    )
    .unwrap();
    h.agent_args = agent_args.iter().map(|s| s.to_string()).collect();
    h.start_rm();
    h.start_agent("h1");
    h.start_agent("h2");
    h.wait_agents_running();
    (h, alice, bob)
}

/// `gpuam submit --wait` of `yaml` as the holder of `token`, from the RM's namespace.
fn submit_as(h: &Hosts, name: &str, yaml: &str, token: &str) -> Child {
    let job = h.path(&format!("{name}.yaml"));
    fs::write(&job, yaml).unwrap();
    let out = fs::File::create(h.path(&format!("submit-{name}.out"))).unwrap();
    Command::new("ip")
        .args(["netns", "exec", &h.ns("rm"), bin(), "submit"])
        .arg(&job)
        .args(["--rm", &format!("http://{RM_IP}:8088"), "--wait"])
        .env("GPUAM_TOKEN", token)
        .env_remove("GPUAM_ADMIN_TOKEN")
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap()
}

fn one_task(name: &str, gpus: u32, command: &str) -> String {
    format!(
        "name: {name}\ntaskRoles:\n  worker:\n    instances: 1\n    taskRetryCount: 0\n    \
         resourcePerInstance: {{cpu: 1, memoryMB: 256, gpu: {gpus}}}\n    commands:\n      - {}\n",
        sq(command)
    )
}

fn read(p: PathBuf) -> String {
    fs::read_to_string(p).unwrap_or_default()
}

/// Waits for a child (a `gpuam submit --wait`) to end, within `limit`.
fn wait_child(c: &mut Child, limit: Duration, what: &str) -> std::process::ExitStatus {
    wait_for(limit, what, || c.try_wait().unwrap())
}

#[test]
fn alice_cannot_reach_bobs_task_and_his_directory_goes_when_it_ends() {
    let (h, alice, bob) = tenant_hosts("ten23a", &[]);
    let out = h.path("out").display().to_string();
    let bob_cmd = format!(
        ": BOB-SECRET-23a; echo $GPUAM_CONTAINER_DIR > {out}/bob.dir; id -u > {out}/bob.uid; \
         echo $TMPDIR > {out}/bob.tmpdir; echo BOB-TMP-23a > \"$TMPDIR/bob-tmp\" && echo ok > {out}/bob.tmpok; \
         echo $GPUAM_USER > {out}/bob.user; echo $$ > {out}/bob.pid.tmp && mv {out}/bob.pid.tmp {out}/bob.pid; \
         while [ ! -e {out}/bob-go ]; do sleep 0.1; done"
    );
    let mut bob_job = submit_as(&h, "bob", &one_task("bobs", 1, &bob_cmd), &bob);
    let bob_pid: i32 = wait_for(Duration::from_secs(60), "bob's task", || {
        read(h.path("out/bob.pid")).trim().parse().ok()
    });
    let bob_dir = PathBuf::from(read(h.path("out/bob.dir")).trim());
    assert!(bob_dir.is_dir(), "{}", bob_dir.display());
    assert_eq!(
        fs::metadata(&bob_dir).unwrap().permissions().mode() & 0o777,
        0o700,
        "the work directory is private"
    );
    let r = format!("{out}/alice.res");
    let alice_cmd = format!(
        "B=$(cat {out}/bob.pid); D=$(cat {out}/bob.dir); id -u > {out}/alice.uid; \
         cat \"$D/launch.sh\" > {out}/alice-launch 2>/dev/null && echo READ-LAUNCH >> {r}; \
         T=$(cat {out}/bob.tmpdir); ls \"$T\" > /dev/null 2>&1 && echo LIST-TMP >> {r}; \
         cat \"$T/bob-tmp\" > /dev/null 2>&1 && echo READ-TMP >> {r}; \
         cat /proc/$B/environ > /dev/null 2>&1 && echo READ-ENVIRON >> {r}; \
         (exec 3< /proc/$B/mem) 2>/dev/null && echo OPEN-MEM >> {r}; \
         kill -0 $B 2>/dev/null && echo SIGNAL >> {r}; \
         perl -e 'exit(syscall(101, 16, $ARGV[0] + 0, 0, 0) == -1 ? 1 : 0)' $B 2>/dev/null && echo PTRACE >> {r}; \
         touch \"$D/alice-was-here\" 2>/dev/null && echo CREATE >> {r}; \
         ls \"$D\" > /dev/null 2>&1 && echo LIST >> {r}; \
         cat \"$D/../stdout\" > /dev/null 2>&1 && echo READ-LOG >> {r}; \
         ls \"$D/..\" > /dev/null 2>&1 && echo LIST-RECORD >> {r}; \
         touch \"$D/../acked\" 2>/dev/null && echo WRITE-RECORD >> {r}; \
         echo DONE >> {r}"
    );
    let mut alice_job = submit_as(&h, "alice", &one_task("alices", 1, &alice_cmd), &alice);
    let st = wait_child(&mut alice_job, Duration::from_secs(90), "alice's job");
    assert!(st.success(), "{}\n{}", h.submit_output("alice"), h.logs());
    assert_eq!(
        read(h.path("out/alice.res")),
        "DONE\n",
        "what alice's task reached of bob's"
    );
    assert!(!read(h.path("out/alice-launch")).contains("BOB-SECRET"));
    // His temporary files are in his own directory, not the host's shared /tmp.
    assert_eq!(
        read(h.path("out/bob.tmpok")).trim(),
        "ok",
        "bob's task wrote a temporary file"
    );
    let bob_tmp = PathBuf::from(read(h.path("out/bob.tmpdir")).trim());
    assert!(
        bob_tmp.starts_with(&bob_dir) && bob_tmp != bob_dir,
        "{}",
        bob_tmp.display()
    );
    assert_eq!(fs::metadata(&bob_tmp).unwrap().permissions().mode() & 0o777, 0o700);
    let (au, bu) = (read(h.path("out/alice.uid")), read(h.path("out/bob.uid")));
    assert!(
        au.trim() != bu.trim() && au.trim() != "0" && bu.trim() != "0",
        "alice {au} bob {bu}"
    );
    assert_eq!(read(h.path("out/bob.user")).trim(), "bob");
    assert!(pid_alive(bob_pid), "bob's task survived alice's");

    fs::write(h.path("out/bob-go"), "").unwrap();
    let st = wait_child(&mut bob_job, Duration::from_secs(60), "bob's job");
    assert!(st.success(), "{}", h.submit_output("bob"));
    wait_for(Duration::from_secs(20), "bob's directory to be removed", || {
        (!bob_dir.exists()).then_some(())
    });
    let record = bob_dir.parent().unwrap();
    assert!(record.join("stdout").is_file(), "bob's logs stay in the node's record");
}

/// `curl -X METHOD -d BODY` of `url` with the header line `auth`, from namespace `ns` of
/// `h`: the HTTP status.
fn curl_code(h: &Hosts, ns: &str, method: &str, body: &str, auth: &str, url: &str) -> String {
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &h.ns(ns),
            "curl",
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .args(["-X", method, "-H", "Content-Type: application/json", "-d", body])
        .arg("-H")
        .arg(auth)
        .arg(url)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// The instance of the agent run that last registered, from its log (`instance=…`).
fn agent_instance(log: &str) -> String {
    let plain = strip_ansi_escapes::strip_str(log);
    plain
        .lines()
        .rfind(|l| l.contains("registered with the RM"))
        .and_then(|l| l.split("instance=").nth(1))
        .map(|rest| rest.chars().take_while(char::is_ascii_hexdigit).collect())
        .unwrap_or_default()
}

/// A root process the steering task names in its forged `process.json`.
struct Victim(Child);

impl Drop for Victim {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn steer(tag: &str, agent_args: &[&str]) {
    let (mut h, alice, _bob) = tenant_hosts(tag, agent_args);
    let out = h.path("out").display().to_string();
    let target = h.path("root-only");
    fs::write(&target, "ROOT-ONLY\n").unwrap();
    fs::set_permissions(&target, fs::Permissions::from_mode(0o600)).unwrap();
    let mut victim = {
        use std::os::unix::process::CommandExt as _;
        Victim(
            Command::new("sleep")
                .arg("600")
                .process_group(0)
                .stdin(Stdio::null())
                .spawn()
                .unwrap(),
        )
    };
    let forged = serde_json::to_string(&gpuam::node::procs::ProcessId::of(victim.0.id()).unwrap()).unwrap();
    let t = target.display();
    let cmd = format!(
        "ln -s {t} acked; ln -s {t} .preempt.tmp; ln -s {t} image-container; ln -s {t} preempt; \
         rm -f launch.sh; printf '%s' {forged} > process.json; \
         ln -s {t} ../acked 2>/dev/null && echo RECORD-WRITABLE >> {out}/steer.res; \
         echo \"$GPUAM_CONTAINER_ID $GPUAM_HOST\" > {out}/steer.id.tmp && mv {out}/steer.id.tmp {out}/steer.id; \
         sleep 600",
        forged = common::shell_quote(&forged)
    );
    let mut job = submit_as(&h, "steer", &one_task("steer", 2, &cmd), &alice);
    let (id, host) = wait_for(Duration::from_secs(60), "the steering task", || {
        let text = read(h.path("out/steer.id"));
        let (id, host) = text.trim().split_once(' ')?;
        Some((id.to_string(), host.to_string()))
    });
    let label = if host == h.host_name("h1") { "h1" } else { "h2" };
    let metrics = |h: &Hosts| h.get("/ws/v1/cluster/metrics")["clusterMetrics"]["availableGpus"].as_u64();
    assert_eq!(metrics(&h), Some(2), "the task holds its host's 2 GPUs");

    // The preemption notice, straight from the agent's endpoint, signed as the RM signs
    // its calls (the host's key: the RM's secret, the host, its token; the agent's run).
    use gpuam::node::token;
    let digest = token::token_digest(&read(h.path(&format!("{label}.token"))));
    let secret = read(h.path("rm").join(gpuam::node::remote::HOST_KEYS_SECRET_FILE));
    let key = token::host_key(secret.trim().as_bytes(), &host, &digest);
    let instance = agent_instance(&read(h.path(&format!("{label}.log"))));
    assert!(!instance.is_empty(), "the agent's log names its instance");
    let body = r#"{"deadlineMs": 1, "reason": "test"}"#;
    let path = format!("/ws/v1/node/{host}/containers/{id}/preempt");
    let call = token::Call {
        method: "POST",
        path_and_query: &path,
        instance: &instance,
        body: body.as_bytes(),
    };
    let signature = token::sign_call(&key, &call, gpuam::protocol::now_ms(), &token::new_nonce());
    let notice = curl_code(
        &h,
        label,
        "POST",
        body,
        &format!("{}: {signature}", token::CALL_HEADER),
        &format!("http://{}:8042{path}", host_ip(label)),
    );
    assert_eq!(notice, "200", "the notice was given");
    assert_eq!(read(target.clone()), "ROOT-ONLY\n", "the notice went through no link");

    // The agent restarts: it re-attaches to the task from its own record.
    h.kill(label);
    h.start_agent(label);
    wait_for(Duration::from_secs(30), "the restarted agent to register", || {
        read(h.path(&format!("{label}.log")))
            .contains("registered with the RM")
            .then_some(())
    });
    wait_for(
        Duration::from_secs(30),
        "the RM to hear from the restarted agent",
        || {
            read(h.path(&format!("{label}.log")))
                .contains("re-attached to a running container")
                .then_some(())
        },
    );
    // Two heartbeats later the RM still holds the task's GPUs: the agent listed it.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(metrics(&h), Some(2), "the RM still holds the task's GPUs\n{}", h.logs());

    // Stopped (the job killed): the task goes, the root process named in its forgery stays.
    let app = wait_for(Duration::from_secs(10), "the app id", || {
        h.submit_output("steer")
            .lines()
            .find_map(|l| {
                l.starts_with("submitted job ")
                    .then(|| l.rsplit(' ').next().map(str::to_string))
            })
            .flatten()
    });
    let admin = read(h.path("rm/admin.token"));
    let killed = curl_code(
        &h,
        "rm",
        "PUT",
        r#"{"state": "KILLED"}"#,
        &format!("Authorization: Bearer {}", admin.trim()),
        &format!("http://{RM_IP}:8088/ws/v1/cluster/apps/{app}/state"),
    );
    assert!(killed.starts_with('2'), "{killed}");
    wait_child(&mut job, Duration::from_secs(60), "the killed job's submit");
    wait_for(Duration::from_secs(30), "the GPUs back", || {
        (metrics(&h) == Some(4)).then_some(())
    });
    assert!(
        victim.0.try_wait().unwrap().is_none(),
        "the root process named by the task is alive"
    );
    // The node's record of it: `ROLE-INDEX@ID` (named for the person looking at the node).
    let record = fs::read_dir(h.path(&format!("{label}-work/containers")))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().ends_with(&format!("@{id}")))
        })
        .unwrap_or_else(|| panic!("no record of {id}"));
    wait_for(Duration::from_secs(20), "the acknowledgement recorded", || {
        fs::symlink_metadata(record.join("acked")).ok().filter(|m| m.is_file())
    });
    assert_eq!(read(target.clone()), "ROOT-ONLY\n", "the root-only file is unchanged");
    assert_eq!(
        read(h.path("out/steer.res")),
        "",
        "the task could not write the node's record"
    );
    wait_for(
        Duration::from_secs(30),
        "the task's directory gone after the grace",
        || (!record.join("work").exists()).then_some(()),
    );
    let _ = victim.0.kill();
}

#[test]
fn a_task_cannot_steer_its_agent_with_links_and_forged_records() {
    steer("ten23b", &[]);
}

#[test]
fn a_task_cannot_steer_its_agent_under_the_subreaper_shim() {
    steer("ten23c", &["--containment", "subreaper"]);
}

/// Under a standalone `gpuam rm` as root (its in-process node, the default
/// `node.in_process_identity`), a task runs as its user's own uid: it cannot read the admin
/// token or the RM's state, no other process's environment (the RM's, the AMs', another
/// user's task: their `GPUAM_*` tokens), not the other user's launch.sh, and not what the
/// RM keeps of the other user's ended job (its collected logs, its AM's output).
#[test]
fn in_process_tasks_cannot_read_tokens_or_other_processes() {
    let dir = common::Rm::temp_dir();
    // The tasks' uids must reach their directories (not list anything) and write `out/`.
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o711)).unwrap();
    fs::create_dir_all(dir.path().join("out")).unwrap();
    fs::set_permissions(dir.path().join("out"), fs::Permissions::from_mode(0o777)).unwrap();
    let registry = dir.path().join("uids").display().to_string();
    let rm = common::Rm::start_in(
        dir,
        common::TWO_NODES_TWO_GPUS,
        &format!("node:\n  task_uid_registry: {registry}\n"),
        &[("GPUAM__NODE__IN_PROCESS_IDENTITY", "true")],
    );
    let out = rm.path("out").display().to_string();
    let work = rm.work_dir.display().to_string();
    // A job of the other user that has ended: its logs collected by the RM, its AM's output.
    let done_job = rm.write_job("other-done", &one_task("other-done", 0, "echo OTHER-LOG-SECRET-5f1"));
    let ended = rm
        .gpuam()
        .env("GPUAM_TOKEN", &rm.other_token)
        .args(["submit"])
        .arg(&done_job)
        .args(["--rm", &rm.url, "--wait"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&ended.stdout).into_owned();
    assert!(ended.status.success(), "{said}");
    let done_app = said
        .split_whitespace()
        .find(|w| w.starts_with("application_"))
        .expect("the submit names the application")
        .to_string();
    let collected = wait_for(Duration::from_secs(30), "the ended job's logs collected", || {
        fs::read_dir(rm.work_dir.join("logs").join(&done_app))
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "stdout"))
    });
    assert!(read(collected.clone()).contains("OTHER-LOG-SECRET-5f1"), "collected");
    let collected = collected.display().to_string();
    // The other user's task: a secret in its launch.sh; waits.
    let other_cmd = format!(
        ": OTHER-SECRET-23a; echo $GPUAM_CONTAINER_DIR > {out}/other.dir.tmp && mv {out}/other.dir.tmp {out}/other.dir; \
         id -u > {out}/other.uid; while [ ! -e {out}/other-go ]; do sleep 0.1; done"
    );
    let other_job = rm.write_job("other", &one_task("other", 1, &other_cmd));
    let mut other = rm.gpuam();
    let other_out = fs::File::create(rm.path("other.out")).unwrap();
    let mut other = other
        .env("GPUAM_TOKEN", &rm.other_token)
        .args(["submit"])
        .arg(&other_job)
        .args(["--rm", &rm.url, "--wait"])
        .stdout(other_out.try_clone().unwrap())
        .stderr(other_out)
        .spawn()
        .unwrap();
    wait_for(Duration::from_secs(60), "the other user's task", || {
        rm.path("out/other.dir").exists().then_some(())
    });
    let r = format!("{out}/itest.res");
    let cmd = format!(
        "D=$(cat {out}/other.dir); id -u > {out}/itest.uid; \
         cat {work}/admin.token > /dev/null 2>&1 && echo READ-ADMIN-TOKEN >> {r}; \
         ls {work} > /dev/null 2>&1 && echo LIST-WORK-DIR >> {r}; \
         cat {work}/rm-state.db > /dev/null 2>&1 && echo READ-STATE >> {r}; \
         cat \"$D/launch.sh\" > /dev/null 2>&1 && echo READ-OTHER-LAUNCH >> {r}; \
         cat {collected} > /dev/null 2>&1 && echo READ-OTHER-COLLECTED-LOG >> {r}; \
         ls {work}/logs > /dev/null 2>&1 && echo LIST-LOGS >> {r}; \
         ls {work}/{done_app} > /dev/null 2>&1 && echo LIST-OTHER-APP >> {r}; \
         cat {work}/{done_app}/am.stderr > /dev/null 2>&1 && echo READ-OTHER-AM-OUTPUT >> {r}; \
         me=$(id -u); for p in /proc/[0-9]*; do \
           [ \"$(stat -c %u $p 2>/dev/null)\" = \"$me\" ] && continue; \
           tr '\\0' '\\n' < $p/environ 2>/dev/null | grep -q '^GPUAM_' && echo \"READ-ENVIRON $p\" >> {r}; \
         done; \
         echo DONE >> {r}"
    );
    let job = rm.write_job("itest", &one_task("itest", 1, &cmd));
    let done = rm.run_job(&job, Duration::from_secs(120));
    assert_eq!(done.code, 0, "{done:?}\n{}", rm.logs());
    assert_eq!(read(rm.path("out/itest.res")), "DONE\n", "what the task reached");
    let (a, b) = (read(rm.path("out/itest.uid")), read(rm.path("out/other.uid")));
    assert!(
        a.trim() != b.trim() && a.trim() != "0" && b.trim() != "0",
        "itest {a} other {b}"
    );
    fs::write(rm.path("out/other-go"), "").unwrap();
    let st = wait_child(&mut other, Duration::from_secs(60), "the other user's job");
    assert!(st.success(), "{}", read(rm.path("other.out")));
}
