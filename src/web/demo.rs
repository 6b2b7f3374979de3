//! A realistic fake status hub for development: the dashboard's tests, screenshots and
//! the status-API benchmark run against it, without an RM or a job.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures::future::BoxFuture;

use crate::am::status::{
    ExitType, JobState, JobStatus, LogSource, NodeStatus, RoleCounts, SelectionRecord, Snapshot, StatusHub, TaskState,
    TaskStatus,
};
use crate::resources::{mask_hex, mask_indices, GpuMask};
use crate::select::{CandidateSummary, SelectionTrace, StageTrace};

/// The job token of demo hubs.
pub const DEMO_TOKEN: &str = "demo-token";

/// Fake logs: a few lines naming the task's container.
struct DemoLogs;

impl LogSource for DemoLogs {
    fn read(&self, container_id: &str, stream: &str, tail: u64) -> BoxFuture<'static, Result<String, String>> {
        let mut text = String::new();
        for i in 0..40 {
            text.push_str(&format!(
                "[{stream}] {container_id} step {i}: loss={:.3}\n",
                2.0 / (i as f64 + 1.0)
            ));
        }
        let tail = tail as usize;
        let start = text.len().saturating_sub(tail);
        // Cut at a char boundary (the text is ASCII, so any index is one).
        let out = text[start..].to_string();
        Box::pin(async move { Ok(out) })
    }
}

fn host_name(i: usize) -> String {
    format!("gpu-{:04}", i)
}

/// The `pcie8` grouping (tiers 2, 1, 0): no NVLink, PCIe switches hold pairs, and the
/// whole node is connected through the CPUs.
fn pcie8_groups() -> Vec<Vec<String>> {
    vec![
        vec![],
        ["0x3", "0xc", "0x30", "0xc0"].iter().map(|s| s.to_string()).collect(),
        vec!["0xff".to_string()],
    ]
}

/// The `nvbridge8` grouping: NVLink-bridged pairs, two pairs per PCIe switch.
fn nvbridge8_groups() -> Vec<Vec<String>> {
    vec![
        ["0x3", "0xc", "0x30", "0xc0"].iter().map(|s| s.to_string()).collect(),
        ["0xf", "0xf0"].iter().map(|s| s.to_string()).collect(),
        vec!["0xff".to_string()],
    ]
}

fn demo_trace(nodes: usize, waiting_for_gpus: bool) -> SelectionTrace {
    let n = nodes.max(1);
    let mut stages = Vec::new();
    let mut cand = StageTrace::new("candidates", n);
    if n > 3 {
        cand.drop_node("node is not RUNNING", &host_name(n - 1));
        cand.nodes_out -= 1;
    }
    let mut left = cand.nodes_out;
    stages.push(cand);
    let mut label = StageTrace::new("nodeLabel", left);
    stages.push(label.clone());
    let mut gt = StageTrace::new("gpuType", left);
    let drop_type = left / 4;
    for i in 0..drop_type {
        gt.drop_node("GPU type not among those asked for", &host_name(i * 4 + 3));
    }
    gt.nodes_out = left - drop_type;
    left = gt.nodes_out;
    stages.push(gt);
    let mut ports = StageTrace::new("ports", left);
    ports.note = Some("dynamic ports nccl=31000 http=31001".into());
    stages.push(ports);
    let mut res = StageTrace::new("resources", left);
    if waiting_for_gpus {
        for i in 0..left {
            let reason = if i % 5 == 0 {
                "not enough free CPU"
            } else {
                "not enough free GPUs"
            };
            res.drop_node(reason, &host_name(i));
        }
        res.nodes_out = 0;
    } else {
        let keep = left.clamp(1, 3);
        for i in 0..left - keep {
            res.drop_node("not enough free GPUs", &host_name(i));
        }
        res.nodes_out = keep;
        left = keep;
        let mut rack = StageTrace::new("rackPolicy", left);
        rack.note = Some("keeping the racks this job already uses".into());
        stages.push(res.clone());
        stages.push(rack);
        let pack = StageTrace::new("jobPacking", left);
        stages.push(pack);
        let pick = StageTrace::new("pick", left);
        label.nodes_out = left;
        stages.push(pick);
        return SelectionTrace {
            stages,
            candidates: vec![CandidateSummary {
                host: host_name(0),
                rack: "rack-0".into(),
                job_affinity: true,
                fits_tasks: 2,
                free_gpus: 4,
                gpu_tier: 1,
                gpu_tier_ideal: true,
                gpu_weight: 12,
                union_tier: 1,
                union_weight: 12,
            }],
            alternative: None,
        };
    }
    stages.push(res);
    SelectionTrace {
        stages,
        candidates: Vec::new(),
        alternative: None,
    }
}

/// Builds a hub with `tasks` tasks (one `ps` role of about a tenth, the rest `worker`s,
/// in every state) spread over `nodes` 8-GPU nodes (pcie8 and nvbridge8 topologies, other
/// jobs using some GPUs), recent selection records, counters and demo logs. Commands
/// sent to it are accepted and dropped. Its job token is [`DEMO_TOKEN`].
pub fn demo_hub(tasks: usize, nodes: usize) -> Arc<StatusHub> {
    let (hub, rx) = demo_hub_with_commands(tasks, nodes);
    // A dev helper: keep the command channel open so that kill is accepted.
    std::mem::forget(rx);
    hub
}

/// Like [`demo_hub`], returning the command receiver the control loop would own.
pub fn demo_hub_with_commands(
    tasks: usize,
    nodes: usize,
) -> (
    Arc<StatusHub>,
    tokio::sync::mpsc::UnboundedReceiver<crate::am::status::Command>,
) {
    let now = crate::protocol::now_ms();
    let nodes = nodes.max(1);
    let ps = (tasks / 10).max(usize::from(tasks > 1));
    let workers = tasks - ps;
    // Per node: GPUs used by other jobs, by this job, requested by this AM.
    let mut used_other: Vec<GpuMask> = (0..nodes)
        .map(|i| {
            if i % 3 == 1 {
                0xc0
            } else if i % 3 == 2 {
                0xf0
            } else {
                0
            }
        })
        .collect();
    let mut job_mask: Vec<GpuMask> = vec![0; nodes];
    let mut req_mask: Vec<GpuMask> = vec![0; nodes];
    let mut task_list = Vec::with_capacity(tasks);
    let mut selections = VecDeque::new();
    let mut cursor = 0usize; // next node to place on
    for k in 0..tasks {
        let (role, index, gpus_per) = if k < ps {
            ("ps", k, 0u32)
        } else {
            ("worker", k - ps, 2u32)
        };
        // States: mostly running, some done, a few waiting/requested at the end.
        let frac = k as f64 / tasks.max(1) as f64;
        let state = if role == "ps" {
            TaskState::ContainerRunning
        } else if frac < 0.25 {
            TaskState::TaskCompleted
        } else if frac < 0.85 {
            TaskState::ContainerRunning
        } else if frac < 0.88 {
            TaskState::ContainerLaunched
        } else if frac < 0.92 {
            TaskState::ContainerRequested
        } else {
            TaskState::TaskWaiting
        };
        let placed = state != TaskState::TaskWaiting;
        let mut host = None;
        let mut gpu_mask = None;
        let mut gpus = Vec::new();
        if placed {
            // Find a node with room for this task's GPUs.
            let mut tries = 0;
            loop {
                let n = cursor % nodes;
                let free = 0xffu64 & !used_other[n] & !job_mask[n] & !req_mask[n];
                let pick = if gpus_per == 0 { Some(0) } else { lowest_pair(free) };
                if let Some(m) = pick {
                    host = Some(host_name(n));
                    if state == TaskState::ContainerRequested {
                        req_mask[n] |= m;
                    } else if state != TaskState::TaskCompleted {
                        job_mask[n] |= m;
                    }
                    gpus = mask_indices(m);
                    gpu_mask = Some(mask_hex(m));
                    if free & !m == 0 || gpus_per == 0 {
                        cursor += 1;
                    }
                    break;
                }
                cursor += 1;
                tries += 1;
                if tries > nodes {
                    // The demo cluster is full: this task waits.
                    break;
                }
            }
        }
        let state = if placed && host.is_none() {
            TaskState::TaskWaiting
        } else {
            state
        };
        let done = state == TaskState::TaskCompleted;
        let failed = done && index % 7 == 3;
        let waiting = state == TaskState::TaskWaiting;
        let has_container = matches!(
            state,
            TaskState::ContainerAllocated
                | TaskState::ContainerLaunched
                | TaskState::ContainerRunning
                | TaskState::TaskCompleted
        );
        let reason = waiting.then(|| "no node has 2 free GPUs with 8 CPUs and 32768 MB (resources dropped 7 nodes: not enough free GPUs x5, not enough free CPU x2)".to_string());
        let why = reason
            .as_ref()
            .map(|r| crate::reason::Reason::new(crate::reason::Kind::Resources, r.clone()).since(now - 600_000));
        task_list.push(TaskStatus {
            role: role.to_string(),
            index: index as u32,
            state,
            attempt: if failed { 2 } else { 1 },
            retried_count: u32::from(failed),
            host: host.clone(),
            gpus: gpus.clone(),
            gpu_mask: gpu_mask.clone(),
            gpu_share: None,
            resources: Default::default(),
            ports: if placed {
                vec![
                    ("nccl".into(), vec![31000 + (k % 500) as u16]),
                    ("http".into(), vec![32000 + (k % 500) as u16]),
                ]
            } else {
                vec![]
            },
            container_id: has_container.then(|| format!("container_demo_{:06}", k)),
            exit_code: done.then_some(if failed { 1 } else { 0 }),
            exit_type: done.then_some(if failed {
                ExitType::NonTransient
            } else {
                ExitType::Succeeded
            }),
            exit_diagnostics: failed.then(|| "command `python train.py` exited with code 1".to_string()),
            waiting_reason: why.as_ref().map(crate::reason::Reason::text),
            reason: why,
            created_ms: now - 600_000,
            launched_ms: has_container.then_some(now - 500_000),
            completed_ms: done.then_some(now - 100_000),
        });
        if waiting || (state == TaskState::ContainerRequested) || k % 25 == 0 {
            let trace = demo_trace(nodes, waiting);
            selections.push_back(SelectionRecord {
                role: role.to_string(),
                index: index as u32,
                at_ms: now - 1000 + k as u64,
                outcome: if waiting { "notNow".into() } else { "placed".into() },
                reason: reason.clone(),
                host: host.clone(),
                gpu_mask: gpu_mask.clone(),
                gpus: gpus.clone(),
                ports: (!waiting).then(|| "nccl:31000;http:32000;".to_string()),
                gpu_tier: (!waiting).then_some(1),
                gpu_tier_ideal: (!waiting).then_some(true),
                gpu_weight: (!waiting).then_some(12),
                nic: (!waiting).then(|| "mlx5_0".to_string()),
                trace,
            });
            while selections.len() > crate::am::status::SELECTION_HISTORY {
                selections.pop_front();
            }
        }
    }
    // A failing-other-jobs sprinkle so that some nodes are busy with other tenants.
    for (i, m) in used_other.iter_mut().enumerate() {
        if i % 5 == 4 {
            *m |= 0x3 & !job_mask[i] & !req_mask[i];
        }
    }
    let node_list: Vec<NodeStatus> = (0..nodes)
        .map(|i| {
            let dgx = i % 2 == 1;
            let used = used_other[i] | job_mask[i];
            let free = 0xff & !used & !req_mask[i];
            let ncpu = 64u32;
            let used_cpu = (used.count_ones() * 8).min(ncpu);
            let req_cpu = (req_mask[i].count_ones() * 4).min(ncpu - used_cpu);
            NodeStatus {
                host: host_name(i),
                rack: format!("rack-{}", i / 16),
                labels: vec!["gpu".into()],
                gpu_type: Some(if dgx { "V100".into() } else { "A100".into() }),
                state: if i == nodes - 1 && nodes > 3 {
                    "UNHEALTHY".into()
                } else {
                    "RUNNING".into()
                },
                topology: Some(if dgx { "nvbridge8".into() } else { "pcie8".into() }),
                gpu_count: 8,
                gpu_groups: std::sync::Arc::new(if dgx { nvbridge8_groups() } else { pcie8_groups() }),
                total_cpu: ncpu,
                used_cpu,
                requested_cpu: req_cpu,
                free_cpu: ncpu - used_cpu - req_cpu,
                total_memory_mb: 512 * 1024,
                used_memory_mb: used.count_ones() as u64 * 32768,
                requested_memory_mb: req_mask[i].count_ones() as u64 * 32768,
                free_memory_mb: 512 * 1024 - (used | req_mask[i]).count_ones() as u64 * 32768,
                total_gpu_mask: "0xff".into(),
                used_gpu_mask: mask_hex(used),
                requested_gpu_mask: mask_hex(req_mask[i]),
                free_gpu_mask: mask_hex(free),
                job_gpu_mask: mask_hex(job_mask[i]),
                total_ports: "20000-39999".into(),
                used_ports: "31000-31001".into(),
                free_ports: "20000-30999,31002-39999".into(),
                used_gpu_shares: Default::default(),
                custom_resources: Default::default(),
                used_custom_resources: Default::default(),
                free_custom_resources: Default::default(),
            }
        })
        .collect();
    let count = |role: &str, f: &dyn Fn(&TaskStatus) -> bool| -> u32 {
        task_list.iter().filter(|t| t.role == role && f(t)).count() as u32
    };
    let roles: Vec<RoleCounts> = [("ps", ps), ("worker", workers)]
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(r, n)| RoleCounts {
            role: r.to_string(),
            instances: *n as u32,
            waiting: count(r, &|t| t.state == TaskState::TaskWaiting),
            requested: count(r, &|t| t.state == TaskState::ContainerRequested),
            allocated: count(r, &|t| {
                matches!(t.state, TaskState::ContainerAllocated | TaskState::ContainerLaunched)
            }),
            running: count(r, &|t| t.state == TaskState::ContainerRunning),
            succeeded: count(r, &|t| t.state == TaskState::TaskCompleted && t.exit_code == Some(0)),
            failed: count(r, &|t| t.state == TaskState::TaskCompleted && t.exit_code != Some(0)),
            stopped: 0,
        })
        .collect();
    let completed = task_list.iter().filter(|t| t.state == TaskState::TaskCompleted).count() as u32;
    let snapshot = Snapshot {
        job: JobStatus {
            name: "resnet-ddp".into(),
            app_id: "application_1700000000000_0001".into(),
            state: JobState::Running,
            attempt: 1,
            gang: false,
            started_ms: now - 600_000,
            finished_ms: None,
            exit_code: None,
            diagnostics: None,
            total_tasks: tasks as u32,
            completed_tasks: completed,
            roles,
            rm_url: "http://127.0.0.1:8088".into(),
            queue: "default".into(),
            priority: 0,
            queue_note: None,
            reason: None,
            start_estimate: None,
        },
        tasks: task_list,
        nodes: node_list,
        selections,
        nodes_refreshed_ms: now,
        registered: true,
        rm_reachable: true,
        config: serde_json::json!({
            "select": {"candidateNodesFactor": 3, "containerMinPort": 30000, "allowNoneGpuJobOnGpuNode": true},
            "am": {"nodeRefreshIntervalSec": 10}
        }),
    };
    let (hub, rx) = StatusHub::new(snapshot, DEMO_TOKEN.to_string(), Arc::new(DemoLogs));
    hub.counters.rm_errors.store(2, Ordering::Relaxed);
    hub.counters.retries_transient.store(1, Ordering::Relaxed);
    for i in 0..200u64 {
        hub.counters
            .allocate_latency
            .observe(std::time::Duration::from_micros(800 + i * 37));
    }
    {
        let mut f = hub.counters.filtered_per_stage.lock();
        f.insert("gpuType", 250);
        f.insert("resources", 1200);
    }
    (hub, rx)
}

/// The two lowest GPUs of one PCIe pair that are both free, else any two free GPUs.
fn lowest_pair(free: GpuMask) -> Option<GpuMask> {
    for p in 0..4 {
        let m = 0x3u64 << (2 * p);
        if free & m == m {
            return Some(m);
        }
    }
    crate::resources::lowest_bits(free, 2)
}
