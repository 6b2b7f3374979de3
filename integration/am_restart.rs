//! Work-preserving AM restart: the AM process is killed (SIGKILL) in the middle of a
//! job; the RM starts a second attempt, which re-adopts the running containers and the
//! outcome of the task that already finished; no task runs twice and the job completes.

mod common;

use std::fs;
use std::time::Duration;

#[test]
fn a_killed_am_is_restarted_and_re_adopts_its_tasks() {
    let rm = common::Rm::start(common::TWO_NODES_TWO_GPUS, &[]);
    let root = rm.root().display().to_string();
    let job = rm.write_job(
        "restart",
        &format!(
            "name: restart\ntaskRoles:\n  quick:\n    instances: 1\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1}}\n    commands:\n      - {}\n  long:\n    instances: 2\n    resourcePerInstance: {{cpu: 1, memoryMB: 100, gpu: 1}}\n    commands:\n      - {}\n",
            common::sq(&format!("echo run >> {root}/quick.runs")),
            common::sq(&format!(
                "echo run >> {root}/long-$GPUAM_TASK_INDEX.runs; while [ ! -f {root}/go ]; do sleep 0.05; done"
            )),
        ),
    );
    let sub = rm.submit(&job);
    let app = sub.app_id(Duration::from_secs(10));
    // Both long tasks run and the quick one has finished (its completion is reported).
    common::wait_for(Duration::from_secs(20), "the tasks to start", || {
        (rm.lines("long-0.runs").len() == 1 && rm.lines("long-1.runs").len() == 1 && rm.lines("quick.runs").len() == 1)
            .then_some(())
    });
    std::thread::sleep(Duration::from_millis(500));
    let first = common::wait_for(Duration::from_secs(10), "the AM process", || rm.am_pid(&app));
    assert_eq!(rm.app(&app)["attempt"], 1);
    // The AM dies without a word.
    assert_eq!(unsafe { libc::kill(first, libc::SIGKILL) }, 0);
    common::wait_for(Duration::from_secs(20), "a second AM attempt to register", || {
        let a = rm.app(&app);
        (a["attempt"] == 2 && a["state"] == "RUNNING").then_some(())
    });
    let second = common::wait_for(Duration::from_secs(10), "the new AM process", || rm.am_pid(&app));
    assert_ne!(first, second);
    // The new attempt releases the tasks it re-adopted; none started again meanwhile.
    std::thread::sleep(Duration::from_millis(500));
    fs::write(rm.path("go"), "").unwrap();
    let out = sub.wait(Duration::from_secs(40));
    assert_eq!(out.code, 0, "{out:?}");
    let a = rm.app(&app);
    assert_eq!(a["state"], "FINISHED");
    assert_eq!(a["attempt"], 2);
    for f in ["quick.runs", "long-0.runs", "long-1.runs"] {
        assert_eq!(
            rm.lines(f).len(),
            1,
            "{f}: every task ran exactly once across both AM attempts"
        );
    }
    rm.assert_all_free(Duration::from_secs(10));
}
