//! RM restart on the real processes: the `gpuam rm` process is killed with SIGKILL in the
//! middle of a job and started again with the same work dir and port. The tasks and the
//! AM keep running while it is down; the new RM recovers the application and its grants
//! from SQLite, re-attaches to the task processes (and learns how those that ended
//! meanwhile ended), the AM registers again, and no task runs twice.

mod common;

use std::fs;
use std::time::Duration;

use common::{pid_alive, sq, wait_for, Rm};

/// A role whose tasks append "attempt pgid" to `<role>-<index>.runs`, then wait for the
/// file `marker` and exit with `code`.
fn role(rm: &Rm, name: &str, instances: u32, marker: &str, code: i32) -> String {
    let root = rm.root().display().to_string();
    let cmd = format!(
        "echo $GPUAM_ATTEMPT $(awk '{{print $5}}' /proc/$$/stat) >> {root}/{name}-$GPUAM_TASK_INDEX.runs; \
         while [ ! -f {root}/{marker} ]; do sleep 0.05; done; exit {code}"
    );
    format!(
        "  {name}:\n    instances: {instances}\n    taskRetryCount: 0\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1}}\n    commands:\n      - {}\n",
        sq(&cmd)
    )
}

/// Asserts that the RM has recorded the processes of `n` containers (their `process.json`)
/// once their tasks have run: a task runs only once its process is recorded
/// (`node::executor::hold`), so an RM killed at any moment after finds every task that ran.
fn assert_recorded(rm: &Rm, n: usize) {
    let recorded = fs::read_dir(rm.work_dir.join("containers"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join("process.json").exists())
        .count();
    assert!(
        recorded >= n,
        "{recorded} of the {n} tasks that ran have their process recorded"
    );
}

fn pgid_of(run_line: &str) -> i32 {
    run_line.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap()
}

#[test]
fn a_killed_rm_comes_back_and_no_task_restarts() {
    let mut rm = Rm::start(common::TWO_NODES_TWO_GPUS, &[]);
    let job = rm.write_job(
        "survive",
        &format!(
            "name: survive\ntaskRoles:\n{}{}",
            role(&rm, "long", 2, "go", 0),
            role(&rm, "ender", 1, "end-now", 0)
        ),
    );
    let sub = rm.submit(&job);
    let app = sub.app_id(Duration::from_secs(10));
    wait_for(Duration::from_secs(20), "all three tasks to run", || {
        (["long-0.runs", "long-1.runs", "ender-0.runs"]
            .iter()
            .all(|f| rm.lines(f).len() == 1))
        .then_some(())
    });
    assert_recorded(&rm, 3);
    let am = wait_for(Duration::from_secs(10), "the AM process", || rm.am_pid(&app));
    let groups: Vec<i32> = ["long-0.runs", "long-1.runs"]
        .iter()
        .map(|f| pgid_of(&rm.lines(f)[0]))
        .collect();

    rm.kill_hard();
    // While the RM is down: one task ends (with status 0, which only the status file
    // it leaves behind can tell); the others and the AM keep running.
    fs::write(rm.path("end-now"), "").unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(pid_alive(am), "the AM outlives the RM");
    for g in &groups {
        assert!(pid_alive(*g), "task group {g} outlives the RM");
    }
    assert!(rm.try_app(&app).is_none(), "the RM is really down (no answer)");

    rm.restart();
    let report = rm.app(&app);
    assert_eq!(report["state"], "RUNNING", "{report}");
    assert_eq!(report["attempt"], 1, "the AM was not restarted: {report}");
    // The AM registers again; the task that ended is reported to it as a success.
    wait_for(
        Duration::from_secs(20),
        "the AM to resync and see `ender` finish",
        || {
            let p = rm.app(&app)["progress"].as_f64().unwrap_or(0.0);
            (p > 0.3).then_some(())
        },
    );
    for g in &groups {
        assert!(pid_alive(*g), "task group {g} still runs after the restart");
    }
    fs::write(rm.path("go"), "").unwrap();
    let out = sub.wait(Duration::from_secs(60));
    assert_eq!(out.code, 0, "{out:?}");
    for f in ["long-0.runs", "long-1.runs", "ender-0.runs"] {
        assert_eq!(
            rm.lines(f),
            vec![format!("1 {}", pgid_of(&rm.lines(f)[0]))],
            "{f}: ran once"
        );
    }
    let attempts = rm.get_json(&format!("/ws/v1/cluster/apps/{app}/appattempts")).unwrap();
    let attempts = attempts["appAttempts"]["appAttempt"].as_array().unwrap().clone();
    assert_eq!(attempts.len(), 1, "{attempts:?}");
    let a = rm.app(&app);
    assert_eq!(
        (a["state"].as_str(), a["finalStatus"].as_str()),
        (Some("FINISHED"), Some("SUCCEEDED"))
    );
    rm.assert_all_free(Duration::from_secs(10));
    // The RM's own record of how `ender` ended: from the status file its script left. (The
    // RM holds its state file exclusively: read it once the RM is gone.)
    rm.kill_hard();
    let saved = gpuam::rm::store::Store::open(&rm.work_dir)
        .unwrap()
        .recover()
        .unwrap()
        .unwrap();
    let ender = saved
        .containers
        .iter()
        .find(|c| c.container.task.as_deref() == Some("ender/0"))
        .unwrap();
    assert_eq!(ender.exit_status, Some(0), "{ender:?}");
    assert!(ender.diagnostics.contains("seen after an RM restart"), "{ender:?}");
}

#[test]
fn an_am_that_died_while_the_rm_was_down_gets_its_next_attempt() {
    let mut rm = Rm::start(common::TWO_NODES_TWO_GPUS, &[]);
    let job = rm.write_job(
        "orphan",
        &format!("name: orphan\ntaskRoles:\n{}", role(&rm, "long", 2, "go", 0)),
    );
    let sub = rm.submit(&job);
    let app = sub.app_id(Duration::from_secs(10));
    wait_for(Duration::from_secs(20), "both tasks to run", || {
        (rm.lines("long-0.runs").len() == 1 && rm.lines("long-1.runs").len() == 1).then_some(())
    });
    assert_recorded(&rm, 2);
    let am = wait_for(Duration::from_secs(10), "the AM process", || rm.am_pid(&app));
    rm.kill_hard();
    assert_eq!(unsafe { libc::kill(am, libc::SIGKILL) }, 0);
    wait_for(Duration::from_secs(10), "the AM to be gone", || {
        (!pid_alive(am)).then_some(())
    });

    rm.restart();
    wait_for(Duration::from_secs(30), "attempt 2 to register", || {
        let a = rm.app(&app);
        (a["attempt"] == 2 && a["state"] == "RUNNING").then_some(())
    });
    let attempts = rm.get_json(&format!("/ws/v1/cluster/apps/{app}/appattempts")).unwrap();
    let first = &attempts["appAttempts"]["appAttempt"][0];
    assert!(
        first["diagnostics"]
            .as_str()
            .unwrap_or("")
            .contains("while the RM was down"),
        "{attempts}"
    );
    fs::write(rm.path("go"), "").unwrap();
    let out = sub.wait(Duration::from_secs(60));
    assert_eq!(out.code, 0, "{out:?}");
    for f in ["long-0.runs", "long-1.runs"] {
        assert_eq!(
            rm.lines(f).len(),
            1,
            "{f}: ran once across the RM restart and both AM attempts"
        );
    }
    rm.assert_all_free(Duration::from_secs(10));
}

#[test]
fn an_am_whose_rm_stays_away_gives_up_and_the_rm_back_later_resumes_the_job() {
    let mut rm = Rm::start(
        common::TWO_NODES_TWO_GPUS,
        &[("GPUAM__AM__RM_UNREACHABLE_TIMEOUT_SEC", "2")],
    );
    let job = rm.write_job(
        "stranded",
        &format!("name: stranded\ntaskRoles:\n{}", role(&rm, "long", 1, "go", 0)),
    );
    let sub = rm.submit(&job);
    let app = sub.app_id(Duration::from_secs(10));
    wait_for(Duration::from_secs(20), "the task to run", || {
        (rm.lines("long-0.runs").len() == 1).then_some(())
    });
    assert_recorded(&rm, 1);
    let am = wait_for(Duration::from_secs(10), "the AM process", || rm.am_pid(&app));

    rm.kill_hard();
    // Bounded: the AM gives up after its 2 s (plus its back-off) instead of retrying forever.
    wait_for(Duration::from_secs(30), "the AM to give up on its RM", || {
        (!pid_alive(am)).then_some(())
    });
    let am_stderr = fs::read_to_string(rm.work_dir.join(&app).join("am.stderr")).unwrap_or_default();
    assert!(
        am_stderr.contains("am.rm_unreachable_timeout_sec"),
        "the AM says why it gave up:\n{am_stderr}"
    );

    // The RM back later: the job's next AM attempt re-adopts the task, which never restarts.
    rm.restart();
    wait_for(Duration::from_secs(30), "attempt 2 to register", || {
        let r = rm.app(&app);
        (r["attempt"] == 2 && r["state"] == "RUNNING").then_some(())
    });
    fs::write(rm.path("go"), "").unwrap();
    let report = rm.wait_app_final(&app, Duration::from_secs(30));
    assert_eq!(report["finalStatus"], "SUCCEEDED", "{report}");
    assert_eq!(rm.lines("long-0.runs").len(), 1, "the task ran once");
    rm.assert_all_free(Duration::from_secs(10));
}

/// The RM's binary replaced under it (a package upgrade: a new file renamed over the old
/// one): the RM still starts AMs, from its own binary, so new jobs run. Before, every AM
/// launch failed ("could not launch the AM: No such file or directory", 500 to submit).
#[test]
fn jobs_still_run_after_the_rms_binary_is_replaced_under_it() {
    let mut rm = Rm::start(common::TWO_NODES_TWO_GPUS, &[]);
    let copy = rm.root().join("bin").join("gpuam");
    fs::create_dir_all(copy.parent().unwrap()).unwrap();
    fs::copy(common::bin(), &copy).unwrap();
    rm.restart_from(&copy);
    // Replaced as package managers do: a new file renamed over the path.
    let new = copy.with_extension("new");
    fs::copy(common::bin(), &new).unwrap();
    fs::rename(&new, &copy).unwrap();
    let job = rm.write_job(
        "after-upgrade",
        "name: after-upgrade\ntaskRoles:\n  main:\n    instances: 1\n    resourcePerInstance: {cpu: 1, memoryMB: 100, gpu: 1}\n    commands: ['echo ran']\n",
    );
    let out = rm.run_job(&job, Duration::from_secs(60));
    assert_eq!(out.code, 0, "{out:?}");
    rm.assert_all_free(Duration::from_secs(10));
}
