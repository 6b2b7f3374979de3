//! `gpuam plan`'s in-memory RM and the synchronous loop that runs the AM's own job machine
//! against it (Nomad's in-memory planner): every ask is granted exactly as asked while it
//! fits the node (else rejected, as the RM would), every launch succeeds, and time is
//! virtual — it jumps to the next moment a waiting task may be placed again. So what the AM
//! does before its first launch (the placement round, the 2,000-ask cap, the per-role
//! back-off, gang hold-back, the topology wait, rejections) is in the plan by construction.
//! The loop stops once every task holds a container, or once the waits have run out and a
//! heartbeat changes nothing.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::machine::{Effect, Event, Input, JobMachine, Now};
use crate::cluster::rm_json::NodeReport;
use crate::cluster::{ClusterView, Node};
use crate::config::{AmSettings, SelectSettings};
use crate::protocol::{AllocateRequest, AllocateResponse, Container, RegisterRequest, Rejection};
use crate::select::{JobPlan, Selection, Selector};
use crate::spec::JobSpec;

/// Heartbeats a plan runs at most (a guard; the waits end long before).
const MAX_HEARTBEATS: usize = 10_000;

/// The RM of a plan: the nodes, with what the plan's containers hold on them.
pub struct PlanRm {
    nodes: Vec<Node>,
    next_container: u64,
}

impl PlanRm {
    pub fn new(nodes: Vec<Node>) -> Self {
        PlanRm {
            nodes,
            next_container: 1,
        }
    }

    /// Grants each ask as asked where it still fits its node; rejects the rest.
    pub fn allocate(&mut self, req: &AllocateRequest) -> AllocateResponse {
        let mut resp = AllocateResponse {
            response_id: req.response_id + 1,
            ..Default::default()
        };
        let mut changed = Vec::new();
        for ask in &req.asks {
            let r = ask.resources();
            let Some(ni) = self.nodes.iter().position(|n| n.host == ask.host) else {
                resp.rejected.push(Rejection {
                    request_id: ask.request_id,
                    reason: format!("no node {}", ask.host),
                    retryable: false,
                    wait: None,
                });
                continue;
            };
            let n = &mut self.nodes[ni];
            let fits = r.fits_in(n.free());
            match n.used().try_add(&r) {
                Ok(used) if fits => {
                    n.set_used(used);
                    if !changed.contains(&ni) {
                        changed.push(ni);
                    }
                    resp.allocated.push(Container {
                        container_id: format!("plan_{:06}", self.next_container),
                        request_id: ask.request_id,
                        host: ask.host.clone(),
                        node_http_address: String::new(),
                        node_ip: None,
                        resources: r,
                        task: ask.task.clone(),
                        task_attempt: ask.task_attempt,
                    });
                    self.next_container += 1;
                }
                _ => resp.rejected.push(Rejection {
                    request_id: ask.request_id,
                    reason: "it no longer fits the node".into(),
                    retryable: true,
                    wait: None,
                }),
            }
        }
        resp.updated_nodes = changed
            .into_iter()
            .map(|i| NodeReport {
                node: self.nodes[i].clone(),
                num_containers: 0,
                last_health_update_ms: 0,
            })
            .collect();
        resp
    }
}

/// Plans `job` on `nodes`: the AM's job machine run against a [`PlanRm`] (see the module
/// doc). Each task is shown with its last selection: placed where its container was
/// granted, or why it found no place.
pub fn plan_job(job: &JobSpec, nodes: Vec<Node>, select: SelectSettings, am: &AmSettings) -> JobPlan {
    let wait_sec = select.topology_wait_sec;
    let selector = Arc::new(Selector::new(ClusterView::new(nodes.clone()), select));
    let mut rm = PlanRm::new(nodes);
    let start = Now::real();
    let mut now = start;
    let seed = selector.settings().seed.unwrap_or(0);
    let mut machine = JobMachine::new(
        Arc::new(job.clone()),
        "plan".into(),
        selector,
        am.clone(),
        RegisterRequest::default(),
        seed,
        now,
    )
    .planning();
    machine.nodes_fetched(now);
    // The waits the machine may take: a topology wait, then the longest back-off.
    let settle = Duration::from_secs(wait_sec) + Duration::from_millis(am.not_available_retry_max_ms.max(1)) * 2;
    let heartbeat = Duration::from_millis(am.heartbeat_interval_ms.max(10));
    let mut last: HashMap<(String, u32), (usize, Selection)> = HashMap::new();
    let mut seen = 0usize;
    let mut input = Input::Heartbeat;
    let mut asked = false;
    let mut heartbeats = 0;
    loop {
        let out = machine.step(input, now);
        for e in out.events {
            if let Event::Selection {
                role, index, selection, ..
            } = e
            {
                let order = last.get(&(role.clone(), index)).map_or_else(
                    || {
                        seen += 1;
                        seen
                    },
                    |(o, _)| *o,
                );
                last.insert((role, index), (order, *selection));
            }
        }
        let Some(effect) = out.effects.into_iter().next() else {
            break;
        };
        input = match effect {
            Effect::FetchNodes => Input::Nodes(Ok(rm.nodes.clone())),
            Effect::Allocate(req) => {
                asked |= !req.asks.is_empty();
                Input::Allocated(Ok(rm.allocate(&req)))
            }
            Effect::Launch(launches) => Input::Launched(launches.iter().map(|l| (l.task, Ok(None))).collect()),
            Effect::Idle { busy } => {
                heartbeats += 1;
                let all_held = machine.tasks().iter().all(|t| t.holds_container());
                let settled = now.at.saturating_duration_since(start.at) > settle && !asked;
                if all_held || settled || heartbeats >= MAX_HEARTBEATS {
                    break;
                }
                asked = false;
                let next = if busy {
                    now.at
                } else {
                    machine
                        .next_ready()
                        .unwrap_or(now.at + heartbeat)
                        .max(now.at + heartbeat)
                };
                now = now.after(next.saturating_duration_since(now.at));
                Input::Heartbeat
            }
            // The plan's RM always answers and never restarts; the job cannot end while
            // planning but by finishing, which needs launches it does not run.
            Effect::Register(_) | Effect::RmDown { .. } | Effect::Done(_) => break,
        };
    }
    let mut tasks: Vec<(usize, String, u32, Selection)> =
        last.into_iter().map(|((r, i), (o, s))| (o, r, i, s)).collect();
    tasks.sort_by_key(|t| t.0);
    let mut plan = JobPlan::default();
    for (_, role, index, sel) in tasks {
        if let Some(r) = job.task_roles.iter().find(|r| r.name == role) {
            plan.record(r, index, sel, wait_sec);
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Ask;
    use crate::resources::{PortSet, Resources};

    fn job(yaml: &str) -> JobSpec {
        crate::spec::parse_job_spec(yaml, "t.yaml").unwrap()
    }

    fn seeded() -> SelectSettings {
        SelectSettings {
            seed: Some(3),
            ..Default::default()
        }
    }

    fn cluster() -> Vec<Node> {
        (0..3)
            .map(|i| {
                let mut n = Node::new(
                    format!("n{i}"),
                    "/r",
                    Resources::with_mask(16, 64_000, 0xff, PortSet::range(20000, 20019)),
                );
                n.set_used(Resources::with_mask(0, 0, 0x1 << i, PortSet::new()));
                n
            })
            .collect()
    }

    /// (role, index, host, GPU mask) per placement; (role, index, impossible) per unplaced task.
    type Keys = (Vec<(String, u32, String, String)>, Vec<(String, u32, bool)>);

    fn keys(plan: &JobPlan) -> Keys {
        (
            plan.placements
                .iter()
                .map(|p| (p.role.clone(), p.index, p.host.clone(), p.gpu_mask.clone()))
                .collect(),
            plan.unplaced
                .iter()
                .map(|u| (u.role.clone(), u.index, u.impossible))
                .collect(),
        )
    }

    /// Where no wait applies, the machine's plan is the single round over the job (the order,
    /// the hosts and GPUs), a role that never fits included: it is shown, and so is the rest.
    #[test]
    fn without_waits_the_plan_is_the_round_and_an_impossible_role_does_not_hide_the_rest() {
        let j = job(
            "name: j\ntaskRoles:\n  never:\n    instances: 1\n    resourcePerInstance: {cpu: 1, memoryMB: 1, gpu: 9}\n    commands: [x]\n  \
             w:\n    instances: 5\n    resourcePerInstance: {cpu: 2, memoryMB: 100, gpu: 2, ports: {p: 1}}\n    commands: [x]\n",
        );
        let plan = plan_job(&j, cluster(), seeded(), &AmSettings::default());
        let round = crate::select::plan_job(&Selector::new(ClusterView::new(cluster()), seeded()), &j);
        assert_eq!(keys(&plan), keys(&round));
        assert_eq!(plan.placements.len(), 5);
        assert_eq!(keys(&plan).1, vec![("never".to_string(), 0, true)]);
    }

    /// A job over the 2,000-ask cap is planned whole: the rest goes out in the next heartbeats.
    #[test]
    fn a_job_over_the_ask_cap_is_planned_whole() {
        let big = vec![Node::new(
            "big",
            "/r",
            Resources::with_mask(4000, 4_000_000, 0, PortSet::new()),
        )];
        let j = job("name: j\ntaskRoles:\n  w:\n    instances: 2100\n    resourcePerInstance: {cpu: 1, memoryMB: 1}\n    commands: [x]\n");
        let plan = plan_job(&j, big, seeded(), &AmSettings::default());
        assert_eq!((plan.placements.len(), plan.unplaced.len()), (2100, 0));
        let mut indices: Vec<u32> = plan.placements.iter().map(|p| p.index).collect();
        indices.sort();
        assert_eq!(indices, (0..2100).collect::<Vec<_>>());
    }

    /// A gang with a task that finds no place is held back whole; the plan shows where the
    /// others would go and why the last one waits.
    #[test]
    fn a_held_back_gang_shows_its_places_and_what_blocks_it() {
        let j = job(
            "name: j\ngang: true\ntaskRoles:\n  w:\n    instances: 4\n    resourcePerInstance: {cpu: 1, memoryMB: 1, gpu: 6}\n    commands: [x]\n",
        );
        let plan = plan_job(&j, cluster(), seeded(), &AmSettings::default());
        assert_eq!((plan.placements.len(), plan.unplaced.len()), (3, 1), "{plan:?}");
        assert!(!plan.unplaced[0].impossible);
    }

    /// The plan's RM grants what fits and rejects what no longer does.
    #[test]
    fn the_plan_rm_grants_what_fits_and_rejects_the_rest() {
        let mut rm = PlanRm::new(cluster());
        let ask = |id, mask| Ask {
            task: Some("w/0".into()),
            ..Ask::for_resources(id, "n0", &Resources::with_mask(1, 1, mask, PortSet::new()))
        };
        let req = AllocateRequest {
            asks: vec![ask(1, 0b110), ask(2, 0b100), ask(3, 0b1)],
            ..Default::default()
        };
        let resp = rm.allocate(&req);
        assert_eq!(resp.allocated.len(), 1);
        assert_eq!(resp.allocated[0].resources.gpu_mask, 0b110);
        let rejected: Vec<u64> = resp.rejected.iter().map(|r| r.request_id).collect();
        assert_eq!(rejected, vec![2, 3], "a GPU held by the plan, and one held before");
        assert_eq!(resp.updated_nodes.len(), 1);
    }
}
