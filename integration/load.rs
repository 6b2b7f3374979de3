//! Load: one RM (in process, with its real executor starting real task processes) and
//! many concurrent AM clients, each placing its tasks one GPU and one port at a time
//! on a nearly full cluster (75 % of every node's GPUs are taken by others), with
//! deliberately colliding choices (random host, GPU bit and port from a view that is
//! stale by design). Checked: no GPU bit or port is ever granted twice (the ledger's
//! grant audit log, replayed independently), no container is lost (every granted
//! container comes back exactly once as completed with exit 0), every job finishes,
//! and the ledger is all free at the end. Printed, not asserted: the RM's allocate
//! latency (p50 / p99 / max) as the AMs measured it.
//!
//! Default size: 20 AMs × 20 tasks (fits a 2-core machine in well under 90 s);
//! `GPUAM_LOAD_FULL=1` runs the 50 AMs × 40 tasks; `GPUAM_LOAD_STORE=memory`
//! runs the RM without its SQLite state store (to compare). Figures: docs/RELIABILITY.md.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use gpuam::am::rm_client::RmClient;
use gpuam::cluster::Node;
use gpuam::protocol::{AllocateRequest, Ask, FinalStatus, FinishRequest, LaunchContext, RegisterRequest};
use gpuam::resources::{PortSet, Resources};
use gpuam::rm::ledger::verify_audit;
use gpuam::rm::{start, RmOptions};
use rand::{Rng, SeedableRng};

const NODES: usize = 16;
const GPUS: u64 = 0xff;
/// Taken by "others" on every node: GPUs 0-5 and half the ports.
const BASELINE_GPUS: u64 = 0x3f;
const PORTS: &str = "20000-20031";
const BASELINE_PORTS: &str = "20000-20015";
/// Tasks an AM keeps asked-for or running at once.
const IN_FLIGHT: usize = 4;
const DEADLINE: Duration = Duration::from_secs(90);

#[derive(Default, Debug)]
struct AmResult {
    latencies_us: Vec<u64>,
    granted: usize,
    rejected: usize,
    succeeded: usize,
    bad_completions: Vec<String>,
}

async fn one_am(base: String, id: String, token: String, tasks: usize, seed: u64) -> Result<AmResult, String> {
    let rm = RmClient::for_app(&base, &id, &token);
    rm.register(&RegisterRequest {
        host: "localhost".into(),
        tracking_url: String::new(),
    })
    .await
    .map_err(|e| format!("{id}: register: {e}"))?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = AmResult::default();
    let mut response_id = 0;
    let mut next_request = 1u64;
    // request id → (host, mask, port) of asks in flight; container id → held.
    let mut asked: HashMap<u64, (String, u64, u16)> = HashMap::new();
    let mut held: HashSet<String> = HashSet::new();
    let mut done_containers: HashSet<String> = HashSet::new();
    let started = Instant::now();
    while out.succeeded < tasks {
        if started.elapsed() > DEADLINE {
            return Err(format!(
                "{id}: {} of {tasks} tasks done after {DEADLINE:?}",
                out.succeeded
            ));
        }
        let waiting = tasks - out.succeeded - held.len() - asked.len();
        let mut asks = Vec::new();
        if waiting > 0 && held.len() + asked.len() < IN_FLIGHT {
            let nodes: Vec<Node> = rm.nodes().await.map_err(|e| format!("{id}: nodes: {e}"))?;
            for _ in 0..(IN_FLIGHT - held.len() - asked.len()).min(waiting) {
                let free: Vec<(&Node, u64, PortSet)> = nodes
                    .iter()
                    .filter_map(|n| {
                        let mask = n.total().gpu_mask & !n.used().gpu_mask;
                        let ports = n.total().ports.subtract(&n.used().ports);
                        (mask != 0 && !ports.is_empty()).then_some((n, mask, ports))
                    })
                    .collect();
                if free.is_empty() {
                    break;
                }
                let (n, mask, ports) = &free[rng.gen_range(0..free.len())];
                let bits: Vec<u32> = (0..64).filter(|b| mask & (1 << b) != 0).collect();
                let bit = bits[rng.gen_range(0..bits.len())];
                let port_list: Vec<u16> = ports.iter().collect();
                let port = port_list[rng.gen_range(0..port_list.len())];
                let rid = next_request;
                next_request += 1;
                asked.insert(rid, (n.host.clone(), 1 << bit, port));
                asks.push(Ask {
                    request_id: rid,
                    host: n.host.clone(),
                    cpu: 1,
                    memory_mb: 64,
                    gpu_mask: 1 << bit,
                    ports: PortSet::from_ports([port]),
                    ..Default::default()
                });
            }
        }
        let t0 = Instant::now();
        let resp = rm
            .allocate(&AllocateRequest {
                response_id,
                progress: out.succeeded as f32 / tasks as f32,
                asks,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("{id}: allocate: {e}"))?;
        out.latencies_us.push(t0.elapsed().as_micros() as u64);
        response_id = resp.response_id;
        for r in &resp.rejected {
            asked.remove(&r.request_id);
            out.rejected += 1;
        }
        for c in resp.allocated {
            let Some((host, mask, port)) = asked.remove(&c.request_id) else {
                return Err(format!("{id}: container {} for no ask", c.container_id));
            };
            if c.host != host || c.resources.gpu_mask != mask || c.resources.ports != PortSet::from_ports([port]) {
                return Err(format!("{id}: {} is not what was asked", c.container_id));
            }
            out.granted += 1;
            held.insert(c.container_id.clone());
            let ctx = LaunchContext {
                commands: vec!["sleep 0.0$((RANDOM % 5))".into()],
                env: Default::default(),
            };
            rm.start_container(&c.node_http_address, &c.host, &c.container_id, &ctx)
                .await
                .map_err(|e| format!("{id}: start {}: {e}", c.container_id))?;
        }
        for c in resp.completed {
            if !held.remove(&c.container_id) || !done_containers.insert(c.container_id.clone()) {
                out.bad_completions
                    .push(format!("{}: completed but not held", c.container_id));
            } else if c.exit_status != 0 {
                out.bad_completions.push(format!(
                    "{}: exit {} ({})",
                    c.container_id, c.exit_status, c.diagnostics
                ));
            } else {
                out.succeeded += 1;
            }
        }
        if !out.bad_completions.is_empty() {
            return Err(format!("{id}: {:?}", out.bad_completions));
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    rm.finish(&FinishRequest {
        final_status: FinalStatus::Succeeded,
        exit_code: 0,
        diagnostics: String::new(),
    })
    .await
    .map_err(|e| format!("{id}: finish: {e}"))?;
    Ok(out)
}

fn quantile(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i] as f64 / 1000.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_ams_on_a_nearly_full_cluster_never_share_a_gpu_or_port() {
    let full = std::env::var("GPUAM_LOAD_FULL").is_ok_and(|v| v == "1");
    let (ams, tasks) = if full { (50, 40) } else { (20, 20) };
    let dir = tempfile::tempdir().unwrap();
    let nodes: Vec<Node> = (0..NODES)
        .map(|i| {
            let mut n = Node::new(
                format!("node{i:02}"),
                format!("/rack{}", i % 4),
                Resources::with_mask(64, 512_000, GPUS, PortSet::parse(PORTS).unwrap()),
            );
            n.set_used(Resources::with_mask(
                8,
                64_000,
                BASELINE_GPUS,
                PortSet::parse(BASELINE_PORTS).unwrap(),
            ));
            n
        })
        .collect();
    let mut opts = RmOptions::new(nodes, "127.0.0.1:0".parse().unwrap(), dir.path().join("work"));
    opts.launch_am = false;
    let in_memory = std::env::var("GPUAM_LOAD_STORE").is_ok_and(|v| v == "memory");
    if in_memory {
        opts.state_dir = None;
    }
    let store = if in_memory { "memory" } else { "sqlite" };
    let rm = start(opts).await.unwrap();
    rm.enable_grant_audit();
    let base = rm.base_url();
    let t0 = Instant::now();
    let handles: Vec<_> = (0..ams)
        .map(|i| {
            let (id, token) = rm.register_test_app(&format!("load-{i}"));
            tokio::spawn(one_am(base.clone(), id, token, tasks, i as u64))
        })
        .collect();
    let mut results = Vec::new();
    for h in handles {
        match h.await.unwrap() {
            Ok(r) => results.push(r),
            Err(e) => panic!("{e}"),
        }
    }
    let elapsed = t0.elapsed();

    let succeeded: usize = results.iter().map(|r| r.succeeded).sum();
    let granted: usize = results.iter().map(|r| r.granted).sum();
    let rejected: usize = results.iter().map(|r| r.rejected).sum();
    assert_eq!(succeeded, ams * tasks, "every task of every job succeeded");
    assert_eq!(
        granted, succeeded,
        "every granted container came back exactly once (none lost)"
    );
    // The RM's own view agrees: every job finished, the ledger is all free, and its
    // audit log shows no GPU bit or port ever held by two live containers.
    common::wait_for(Duration::from_secs(10), "the ledger to be all free", || {
        rm.ledger_all_free().then_some(())
    });
    let (grants, frees) = verify_audit(&rm.grant_audit()).unwrap_or_else(|e| panic!("double grant: {e}"));
    assert_eq!((grants, frees), (granted, granted));

    let mut lat: Vec<u64> = results.iter().flat_map(|r| r.latencies_us.iter().copied()).collect();
    lat.sort_unstable();
    println!(
        "load: {ams} AMs x {tasks} tasks = {} tasks in {:.1}s on {NODES} nodes (75% of GPUs pre-used, store {store}); \
         {granted} grants, {rejected} rejected asks (collisions refused), conflicts 0, lost 0; \
         allocate latency over {} calls: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        ams * tasks,
        elapsed.as_secs_f64(),
        lat.len(),
        quantile(&lat, 0.5),
        quantile(&lat, 0.99),
        quantile(&lat, 1.0),
    );
    rm.shutdown().await;
}

/// `gpuam bench cluster` at a tiny size through the real binary: several jobs at once,
/// each with its own AM process, all their tasks run, the table is printed, and the
/// bench stops every AM it started (it fails otherwise).
#[test]
fn bench_cluster_runs_every_job_and_stops_what_it_started() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpuam"))
        .args(["bench", "cluster", "--jobs", "2", "--tasks", "2", "--nodes", "10"])
        .output()
        .expect("run gpuam bench cluster");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench cluster failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = stdout
        .lines()
        .find(|l| l.starts_with("| 2 × 2 | 10 |"))
        .unwrap_or_else(|| panic!("no result row in: {stdout}"));
    assert!(row.contains(" s / "), "no first-task percentiles in {row}");
}
