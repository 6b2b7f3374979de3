//! OpenPAI's task environment for protocol v2 jobs: every `PAI_*` variable that OpenPAI's
//! Kubernetes runtime gives a task (rest-server `runtime-env.js` and `k8s.js`,
//! openpai-runtime `framework_parser.py`), plus the YARN-era names that do not conflict.
//! Role names and port labels keep their case, as on OpenPAI. docs/OPENPAI.md lists every
//! variable with its source.
//!
//! Pure: the AM gives the job, the task and what it knows of every task's host and ports.

use std::collections::BTreeMap;

use crate::protocol::Container;
use crate::spec::JobSpec;

/// What the environment needs to know of one task of the job.
#[derive(Clone, Debug)]
pub struct TaskView<'a> {
    pub role: &'a str,
    pub index: u32,
    /// The node's IP (or host name where it has no IP); `None` while not placed.
    pub ip: Option<String>,
    /// Ports by label, in the role's label order; empty while not placed.
    pub ports: &'a [(String, Vec<u16>)],
}

/// The task being launched.
#[derive(Clone, Debug)]
pub struct Current<'a> {
    pub role_index: usize,
    pub index: u32,
    pub container_id: &'a str,
}

/// The host a task's peers reach it at: the node's IP where the node reported one (node
/// agents, Ray nodes), else the IP its executor's `nodeHTTPAddress` names (simulated nodes
/// run in the RM's process, on the RM's machine), else the host name.
pub fn node_ip(c: &Container) -> String {
    if let Some(ip) = c.node_ip {
        return ip.to_string();
    }
    let from_url = c
        .node_http_address
        .split("://")
        .nth(1)
        .unwrap_or(&c.node_http_address)
        .split('/')
        .next()
        .unwrap_or("");
    let host_part = match from_url.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => from_url.rsplit_once(':').map_or(from_url, |(h, _)| h),
    };
    if let Ok(ip) = host_part.parse::<std::net::IpAddr>() {
        if !ip.is_unspecified() {
            return ip.to_string();
        }
    }
    c.host.clone()
}

/// The user a job runs for: `$USER`, else `$LOGNAME`, else `gpuam`.
pub fn user_name() -> String {
    ["USER", "LOGNAME"]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
        .unwrap_or_else(|| "gpuam".into())
}

fn list(ps: &[u16]) -> String {
    ps.iter().map(u16::to_string).collect::<Vec<_>>().join(",")
}

/// The `PAI_*` environment of `current`, given every task of the job (`tasks`).
pub fn pai_env(job: &JobSpec, user: &str, current: &Current<'_>, tasks: &[TaskView<'_>]) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    let mut set = |k: String, v: String| {
        env.insert(k, v);
    };
    let pai = job.pai.clone().unwrap_or_default();
    let framework = format!("{user}~{}", job.name);
    let roles: Vec<&str> = job.task_roles.iter().map(|r| r.name.as_str()).collect();
    let total: u32 = job.task_roles.iter().map(|r| r.instances).sum();

    // rest-server runtime-env.js: the framework environment.
    set("PAI_FRAMEWORK_NAME".into(), framework.clone());
    set("PAI_JOB_NAME".into(), framework);
    set("PAI_USER_NAME".into(), user.into());
    set("PAI_DEFAULT_FS_URI".into(), String::new());
    set("PAI_TASK_ROLE_COUNT".into(), roles.len().to_string());
    set("PAI_TASK_ROLE_LIST".into(), roles.join(","));
    set("PAI_VIRTUAL_CLUSTER".into(), pai.virtual_cluster.clone());
    for r in &job.task_roles {
        let n = &r.name;
        set(format!("PAI_TASK_ROLE_TASK_COUNT_{n}"), r.instances.to_string());
        set(
            format!("PAI_RESOURCE_{n}"),
            format!(
                "{},{},{},{}",
                r.resources.gpus,
                r.resources.cpu,
                r.resources.memory_mb,
                r.shm_mb.unwrap_or(0)
            ),
        );
        set(format!("PAI_MIN_FAILED_TASK_COUNT_{n}"), min_failed(r));
        set(format!("PAI_MIN_SUCCEEDED_TASK_COUNT_{n}"), min_succeeded(r));
    }
    set("PAI_USERNAME".into(), user.into());
    set("PAI_TASKS_NUM".into(), total.to_string());
    set("PAI_JOB_TASK_COUNT".into(), total.to_string());
    set("PAI_TASK_ROLES_NUM".into(), roles.len().to_string());
    set("PAI_JOB_TASK_ROLE_COUNT".into(), roles.len().to_string());
    set("PAI_JOB_TASK_ROLE_LIST".into(), roles.join(","));

    // k8s.js: the task role's environment.
    let role = &job.task_roles[current.role_index];
    set("PAI_CURRENT_TASK_ROLE_NAME".into(), role.name.clone());
    set(
        "PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX".into(),
        current.index.to_string(),
    );
    set("PAI_TASK_INDEX".into(), current.index.to_string());

    // openpai-runtime framework_parser.py: every task's host and ports, and this one's.
    let mut instances = Vec::new();
    for (ri, r) in job.task_roles.iter().enumerate() {
        let mut mine: Vec<&TaskView<'_>> = tasks.iter().filter(|t| t.role == r.name).collect();
        mine.sort_by_key(|t| t.index);
        let mut host_list = Vec::new();
        for t in mine {
            instances.push(format!("{}:{}", r.name, t.index));
            for (label, ps) in t.ports {
                let v = list(ps);
                set(format!("PAI_PORT_LIST_{}_{}_{label}", r.name, t.index), v.clone());
                set(format!("PAI_{}_{}_{label}_PORT", r.name, t.index), v);
            }
            let http = first_port(t.ports, "http");
            if let Some(ip) = &t.ip {
                set(format!("PAI_HOST_IP_{}_{}", r.name, t.index), ip.clone());
                host_list.push(format!("{ip}:{}", http.map(|p| p.to_string()).unwrap_or_default()));
            }
            if ri == current.role_index && t.index == current.index {
                let ip = t.ip.clone().unwrap_or_default();
                let http = http.map(|p| p.to_string()).unwrap_or_default();
                set("PAI_CURRENT_CONTAINER_IP".into(), ip.clone());
                set("PAI_CURRENT_CONTAINER_PORT".into(), http.clone());
                set("PAI_CONTAINER_HOST_IP".into(), ip);
                set("PAI_CONTAINER_HOST_PORT".into(), http);
                set(
                    "PAI_CONTAINER_SSH_PORT".into(),
                    first_port(t.ports, "ssh").map(|p| p.to_string()).unwrap_or_default(),
                );
                let mut all = String::new();
                for (label, ps) in t.ports {
                    set(format!("PAI_CONTAINER_HOST_{label}_PORT_LIST"), list(ps));
                    all.push_str(&format!("{label}:{};", list(ps)));
                }
                set("PAI_CONTAINER_HOST_PORT_LIST".into(), all);
            }
        }
        set(format!("PAI_TASK_ROLE_{}_HOST_LIST", r.name), host_list.join(","));
    }
    set("PAI_TASK_ROLE_INSTANCES".into(), instances.join(","));

    // YARN-era and kube-runtime names that do not clash with the above.
    set("PAI_TASK_ROLE_INDEX".into(), current.role_index.to_string());
    set("PAI_JOB_VC_NAME".into(), pai.virtual_cluster);
    set("PAI_CONTAINER_ID".into(), current.container_id.into());
    set("PAI_CURRENT_TASK_ROLE_TASK_COUNT".into(), role.instances.to_string());
    set("PAI_CURRENT_TASK_ROLE_CPU_COUNT".into(), role.resources.cpu.to_string());
    set(
        "PAI_CURRENT_TASK_ROLE_MEM_MB".into(),
        role.resources.memory_mb.to_string(),
    );
    set(
        "PAI_CURRENT_TASK_ROLE_SHM_MB".into(),
        role.shm_mb.unwrap_or(0).to_string(),
    );
    set(
        "PAI_CURRENT_TASK_ROLE_GPU_COUNT".into(),
        role.resources.gpus.to_string(),
    );
    set("PAI_CURRENT_TASK_ROLE_MIN_FAILED_TASK_COUNT".into(), min_failed(role));
    set(
        "PAI_CURRENT_TASK_ROLE_MIN_SUCCEEDED_TASK_COUNT".into(),
        min_succeeded(role),
    );
    env
}

fn first_port(ports: &[(String, Vec<u16>)], label: &str) -> Option<u16> {
    ports
        .iter()
        .find(|(l, _)| l == label)
        .and_then(|(_, ps)| ps.first().copied())
}

/// `minFailedInstances` as OpenPAI passes it: the count, or -1 for "never".
fn min_failed(r: &crate::spec::TaskRole) -> String {
    r.completion
        .min_failed_instances
        .map_or_else(|| "-1".to_string(), |v| v.to_string())
}

/// `minSucceededInstances`, defaulting to the role's instances.
fn min_succeeded(r: &crate::spec::TaskRole) -> String {
    r.completion.min_succeeded_instances.unwrap_or(r.instances).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::parse_job_spec;

    const JOB: &str = "protocolVersion: 2\nname: dist\ntype: job\n\
        prerequisites:\n  - {name: img, type: dockerimage, uri: busybox}\n\
        defaults: {virtualCluster: vc1}\n\
        taskRoles:\n  Master:\n    dockerImage: img\n    resourcePerInstance: {cpu: 2, memoryMB: 100, gpu: 1, ports: {SyncPort: 1}}\n    commands: [x]\n\
        \x20 worker:\n    instances: 2\n    dockerImage: img\n    extraContainerOptions: {shmMB: 64}\n    resourcePerInstance: {cpu: 1, memoryMB: 50, gpu: 0}\n    commands: [x]\n";

    fn ports(p: &[(&str, u16)]) -> Vec<(String, Vec<u16>)> {
        p.iter().map(|(l, n)| (l.to_string(), vec![*n])).collect()
    }

    #[test]
    fn every_task_sees_its_peers_with_the_case_of_roles_and_labels() {
        let job = parse_job_spec(JOB, "j.yaml").unwrap();
        let m0 = ports(&[("SyncPort", 3000), ("ssh", 3001), ("http", 3002)]);
        let w0 = ports(&[("ssh", 4001), ("http", 4002)]);
        let w1 = ports(&[("ssh", 5001), ("http", 5002)]);
        let tasks = vec![
            TaskView {
                role: "Master",
                index: 0,
                ip: Some("10.0.0.1".into()),
                ports: &m0,
            },
            TaskView {
                role: "worker",
                index: 1,
                ip: Some("10.0.0.3".into()),
                ports: &w1,
            },
            TaskView {
                role: "worker",
                index: 0,
                ip: Some("10.0.0.2".into()),
                ports: &w0,
            },
        ];
        let cur = Current {
            role_index: 1,
            index: 1,
            container_id: "c_7",
        };
        let env = pai_env(&job, "alice", &cur, &tasks);
        let want = [
            ("PAI_JOB_NAME", "alice~dist"),
            ("PAI_USER_NAME", "alice"),
            ("PAI_VIRTUAL_CLUSTER", "vc1"),
            ("PAI_TASK_ROLE_LIST", "Master,worker"),
            ("PAI_TASK_ROLE_TASK_COUNT_worker", "2"),
            ("PAI_TASK_ROLE_TASK_COUNT_Master", "1"),
            ("PAI_RESOURCE_worker", "0,1,50,64"),
            ("PAI_JOB_TASK_COUNT", "3"),
            ("PAI_CURRENT_TASK_ROLE_NAME", "worker"),
            ("PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX", "1"),
            ("PAI_TASK_INDEX", "1"),
            ("PAI_HOST_IP_Master_0", "10.0.0.1"),
            ("PAI_HOST_IP_worker_0", "10.0.0.2"),
            ("PAI_Master_0_SyncPort_PORT", "3000"),
            ("PAI_PORT_LIST_Master_0_SyncPort", "3000"),
            ("PAI_worker_0_ssh_PORT", "4001"),
            ("PAI_CONTAINER_HOST_IP", "10.0.0.3"),
            ("PAI_CONTAINER_HOST_PORT", "5002"),
            ("PAI_CONTAINER_SSH_PORT", "5001"),
            ("PAI_CONTAINER_HOST_PORT_LIST", "ssh:5001;http:5002;"),
            ("PAI_CONTAINER_HOST_http_PORT_LIST", "5002"),
            ("PAI_TASK_ROLE_worker_HOST_LIST", "10.0.0.2:4002,10.0.0.3:5002"),
            ("PAI_TASK_ROLE_INSTANCES", "Master:0,worker:0,worker:1"),
            ("PAI_CURRENT_TASK_ROLE_GPU_COUNT", "0"),
            ("PAI_CURRENT_TASK_ROLE_SHM_MB", "64"),
            ("PAI_CONTAINER_ID", "c_7"),
            ("PAI_MIN_SUCCEEDED_TASK_COUNT_worker", "2"),
        ];
        for (k, v) in want {
            assert_eq!(env.get(k).map(String::as_str), Some(v), "{k}");
        }
        assert!(env.keys().all(|k| k.starts_with("PAI_")));
    }

    proptest::proptest! {
        /// Whatever the job's shape and which tasks are placed: every role has its count,
        /// every placed task its host and each of its labels, the current task its own
        /// view, and every name starts with PAI_.
        #[test]
        fn every_placed_task_and_label_is_there(
            shape in proptest::collection::vec((1u32..4, proptest::collection::vec("[a-zA-Z_][a-zA-Z0-9_]{0,5}", 0..3)), 1..4),
            placed_mask in proptest::num::u64::ANY,
        ) {
            let mut yaml = String::from("protocolVersion: 2\nname: p\ntype: job\nprerequisites: [{name: i, type: dockerimage, uri: x}]\ntaskRoles:\n");
            for (ri, (n, labels)) in shape.iter().enumerate() {
                let mut ls: Vec<&String> = labels.iter().filter(|l| *l != "ssh" && *l != "http").collect();
                ls.sort();
                ls.dedup();
                let ports: Vec<String> = ls.iter().map(|l| format!("{l}: 1")).collect();
                yaml.push_str(&format!(
                    "  Role{ri}:\n    instances: {n}\n    dockerImage: i\n    resourcePerInstance: {{cpu: 1, memoryMB: 1, gpu: 0, ports: {{{}}}}}\n    commands: [x]\n",
                    ports.join(", ")
                ));
            }
            let job = parse_job_spec(&yaml, "p.yaml").map_err(|e| proptest::test_runner::TestCaseError::fail(e.to_string()))?;
            let all_ports: Vec<Vec<(String, Vec<u16>)>> = job
                .task_roles
                .iter()
                .map(|r| r.resources.ports.iter().enumerate().map(|(i, p)| (p.label.clone(), vec![20000 + i as u16])).collect())
                .collect();
            let mut views = Vec::new();
            let mut bit = 0;
            for (ri, r) in job.task_roles.iter().enumerate() {
                for i in 0..r.instances {
                    if placed_mask & (1 << (bit % 64)) != 0 || (ri == 0 && i == 0) {
                        views.push(TaskView { role: &r.name, index: i, ip: Some(format!("10.0.{ri}.{i}")), ports: &all_ports[ri] });
                    }
                    bit += 1;
                }
            }
            let env = pai_env(&job, "u", &Current { role_index: 0, index: 0, container_id: "c" }, &views);
            for r in &job.task_roles {
                proptest::prop_assert_eq!(env.get(&format!("PAI_TASK_ROLE_TASK_COUNT_{}", r.name)), Some(&r.instances.to_string()));
            }
            for v in &views {
                let host = format!("PAI_HOST_IP_{}_{}", v.role, v.index);
                proptest::prop_assert!(env.contains_key(&host), "{} missing", host);
                for (l, _) in v.ports {
                    let key = format!("PAI_{}_{}_{}_PORT", v.role, v.index, l);
                    proptest::prop_assert!(env.contains_key(&key), "{} missing", key);
                }
            }
            proptest::prop_assert_eq!(env.get("PAI_CONTAINER_HOST_IP").map(String::as_str), Some("10.0.0.0"));
            proptest::prop_assert!(env.get("PAI_CONTAINER_SSH_PORT").is_some_and(|p| !p.is_empty()));
            proptest::prop_assert!(env.keys().all(|k| k.starts_with("PAI_")));
        }
    }

    #[test]
    fn node_ip_comes_from_the_executor_address_else_the_host() {
        let c = |addr: &str, host: &str| Container {
            container_id: "c".into(),
            request_id: 1,
            host: host.into(),
            node_http_address: addr.into(),
            node_ip: None,
            resources: Default::default(),
            task: None,
            task_attempt: 1,
        };
        assert_eq!(node_ip(&c("http://127.0.0.1:8088", "node1")), "127.0.0.1");
        assert_eq!(node_ip(&c("https://[::1]:9", "node1")), "::1");
        assert_eq!(node_ip(&c("http://gpu7.lan:8088", "gpu7")), "gpu7");
        assert_eq!(node_ip(&c("http://0.0.0.0:8088", "10.1.1.1")), "10.1.1.1");
        // A node agent's containers are reached through the RM (`nodeHTTPAddress`), but
        // their peers need the node's own IP.
        let mut agent = c("http://10.0.0.1:8088", "h1");
        agent.node_ip = Some("10.0.0.7".parse().unwrap());
        assert_eq!(node_ip(&agent), "10.0.0.7");
    }
}
