//! One GPU type per gang (issue 27, DESIGN.md §5): a gang's tasks that name no GPU type
//! (else, without a gang, each such role's) get GPUs of one type, since synchronous
//! training runs at the pace of its slowest GPU. Owns which roles form a group, which type
//! a group keeps to, and the refusal of a gang that no single type can ever hold.
//!
//! The choice, per group, in this order:
//! 1. a type the group already holds (a task placed or asked for) is kept;
//! 2. the types of the GPU nodes the group's roles may use (feasibility rules 2–5), with
//!    what each could hold at once by node totals (rule 6, [`feasible::copies`]); one
//!    type or none: nothing to choose, the group is left free;
//! 3. a gang that no type can hold is refused (`Impossible`, naming the types and their
//!    sizes, and the fix); a role without a gang chooses among all types (its tasks wait
//!    for that type's GPUs);
//! 4. among the types that hold it, the written order: each type is tried by placing the
//!    group's waiting tasks with the pipeline itself (booked, then un-booked): most tasks
//!    placed now, then most at their node's ideal tier, then the highest sum of tiers and
//!    of link weights, then the fewest wholly free nodes broken (what it leaves behind for
//!    others), then the type's name.
//!
//! A job or role with `allowMixedGpuTypes: true` is left free, as is a role that names
//! types (`gpuType`) or asks for no GPU. GPU nodes without a type take no part in the
//! choice once typed nodes exist (a group kept to a type does not use them).

use std::cmp::Reverse;
use std::collections::BTreeMap;

use super::feasible::{self, Ask, NodeFacts, TaskFacts};
use super::placement::{request_order, TaskSlot};
use super::{JobDemand, Outcome, Selector, TaskAsk, TaskShape};
use crate::spec::JobSpec;

/// Tasks of a group the trial places per type at most (a big role is judged by its first
/// ones; the choice is then kept by rule 1).
const MAX_TRIAL_TASKS: usize = 256;

/// What a group keeps to.
#[derive(Clone, Debug, PartialEq)]
pub enum Choice {
    /// No restriction (one type or none to choose from).
    Free,
    /// This type (a one-element list, as a task's `gpu_types`).
    One(Vec<String>),
    /// A gang no single type can ever hold: why, with the fix.
    Refused(String),
}

/// The groups of a job and their choices, decided on first use in a placement round.
pub struct TypeGroups {
    /// Per role: its group, if it is kept to one type.
    group_of: Vec<Option<usize>>,
    /// Per group: its roles and, once decided, its choice.
    groups: Vec<(Vec<usize>, Option<Choice>)>,
}

impl TypeGroups {
    /// A gang's untyped GPU roles form one group; without a gang, each is its own.
    pub fn of(job: &JobSpec) -> Self {
        let kept: Vec<usize> = (0..job.task_roles.len())
            .filter(|&ri| {
                let r = &job.task_roles[ri];
                r.gpu_types.is_empty() && r.resources.uses_gpus() && !job.mixes_gpu_types(r)
            })
            .collect();
        let groups: Vec<Vec<usize>> = match job.gang {
            true if !kept.is_empty() => vec![kept],
            true => Vec::new(),
            false => kept.into_iter().map(|ri| vec![ri]).collect(),
        };
        let mut group_of = vec![None; job.task_roles.len()];
        for (g, roles) in groups.iter().enumerate() {
            for &ri in roles {
                group_of[ri] = Some(g);
            }
        }
        TypeGroups {
            group_of,
            groups: groups.into_iter().map(|r| (r, None)).collect(),
        }
    }

    /// The choice for role `ri` (`None`: the role is not kept to one type), decided now if
    /// it was not yet.
    pub fn choice(
        &mut self,
        ri: usize,
        job: &JobSpec,
        slots: &[Vec<TaskSlot>],
        selector: &Selector,
        demand: &JobDemand,
    ) -> Option<&Choice> {
        let g = self.group_of.get(ri).copied().flatten()?;
        let (roles, choice) = &mut self.groups[g];
        if choice.is_none() {
            *choice = Some(decide(job, roles, slots, selector, demand));
        }
        choice.as_ref()
    }
}

/// What the nodes of one GPU type could hold by their totals.
#[derive(Clone, Debug, Default)]
struct TypeSize {
    nodes: u32,
    gpus: u32,
    /// Per role of the group: tasks its nodes could hold at once (rule 6).
    copies: Vec<u64>,
}

/// The choice for the group of `roles` (see the module doc).
fn decide(job: &JobSpec, roles: &[usize], slots: &[Vec<TaskSlot>], selector: &Selector, demand: &JobDemand) -> Choice {
    // 1. A type the group already holds.
    let held = selector.with_view(|v| {
        roles.iter().flat_map(|&ri| &slots[ri]).find_map(|s| match s {
            TaskSlot::Placed { host, .. } => v.get(host).map(|n| n.gpu_type.clone()),
            _ => None,
        })
    });
    if let Some(t) = held {
        return t.map_or(Choice::Free, |t| Choice::One(vec![t]));
    }
    // One task lands on one node, so on one type: no trial (the select pipeline alone
    // finds its node, or says it never fits).
    let tasks: u64 = roles.iter().map(|&ri| u64::from(job.task_roles[ri].instances)).sum();
    // One GPU type in the whole view: nothing to choose (without a pass over the nodes).
    if tasks <= 1 || selector.gpu_types(2) <= 1 {
        return Choice::Free;
    }
    // 2. The types and their sizes.
    let settings = selector.settings();
    let sizes: BTreeMap<String, TypeSize> = selector.with_view(|v| {
        let mut sizes: BTreeMap<String, TypeSize> = BTreeMap::new();
        for n in v.nodes() {
            let (Some(ty), facts) = (n.gpu_type.as_deref(), NodeFacts::of(n)) else {
                continue;
            };
            if facts.total_gpus == 0 {
                continue;
            }
            let mut usable = false;
            let mut copies = vec![0u64; roles.len()];
            for (k, &ri) in roles.iter().enumerate() {
                let role = &job.task_roles[ri];
                let task = TaskFacts::new(role.node_label.as_deref(), &[], false);
                let request = role.resources.as_request();
                let ask = Ask {
                    request: &request,
                    dynamic_ports: role.resources.dynamic_port_count(),
                    min_port: settings.container_min_port,
                };
                if feasible::ever(&task, &facts, &ask, n.total()).is_ok() {
                    usable = true;
                    copies[k] = u64::from(feasible::copies(&ask, n.total()));
                }
            }
            if usable {
                let s = sizes.entry(ty.to_string()).or_insert_with(|| TypeSize {
                    copies: vec![0; roles.len()],
                    ..Default::default()
                });
                s.nodes += 1;
                s.gpus += facts.total_gpus;
                for (c, add) in s.copies.iter_mut().zip(copies) {
                    *c += add;
                }
            }
        }
        sizes
    });
    if sizes.len() <= 1 {
        return Choice::Free;
    }
    // 3. The types that could ever hold the group whole.
    let need: Vec<u64> = roles
        .iter()
        .map(|&ri| slots[ri].iter().filter(|s| !matches!(s, TaskSlot::Idle)).count() as u64)
        .collect();
    let whole_gpus: u64 = roles
        .iter()
        .zip(&need)
        .filter(|(&ri, _)| job.task_roles[ri].resources.gpu_share.is_none())
        .map(|(&ri, &n)| n * u64::from(job.task_roles[ri].resources.gpus))
        .sum();
    let holds = |s: &TypeSize| s.copies.iter().zip(&need).all(|(c, n)| c >= n) && u64::from(s.gpus) >= whole_gpus;
    let mut candidates: Vec<&String> = sizes.iter().filter(|(_, s)| holds(s)).map(|(t, _)| t).collect();
    if candidates.is_empty() {
        if job.gang {
            return Choice::Refused(refusal(job, roles, &need, whole_gpus, &sizes));
        }
        candidates = sizes.keys().collect();
    }
    if candidates.len() == 1 {
        return Choice::One(vec![candidates[0].clone()]);
    }
    // 4. The written order, by trial placement.
    let best = candidates
        .into_iter()
        .max_by_key(|t| (trial(job, roles, slots, selector, demand, t), Reverse(*t)))
        .cloned();
    best.map_or(Choice::Free, |t| Choice::One(vec![t]))
}

/// How well type `ty` holds the group now: (placed, ideal, Σ tier, Σ weight, −whole nodes
/// broken), larger is better.
fn trial(
    job: &JobSpec,
    roles: &[usize],
    slots: &[Vec<TaskSlot>],
    selector: &Selector,
    demand: &JobDemand,
    ty: &str,
) -> (u32, u32, u32, u64, Reverse<u32>) {
    let one = vec![ty.to_string()];
    let mut demand = demand.clone();
    let waiting: Vec<(usize, u32)> = request_order(job)
        .into_iter()
        .filter(|(ri, i)| roles.contains(ri) && matches!(slots[*ri][*i as usize], TaskSlot::Waiting { .. }))
        .take(MAX_TRIAL_TASKS)
        .collect();
    let mut booked = Vec::new();
    let (mut placed, mut ideal, mut tiers, mut weights) = (0u32, 0u32, 0u32, 0u64);
    for &(ri, _) in &waiting {
        let role = &job.task_roles[ri];
        let ask = TaskAsk {
            gpu_types: &one,
            ..TaskAsk::for_role(role, None, waiting.len() as u32)
        };
        if let Outcome::Placed(p) = selector.select_and_reserve(&ask, &demand).outcome {
            placed += 1;
            ideal += u32::from(p.gpu_tier_ideal);
            tiers += u32::from(p.gpu_tier);
            weights += u64::from(p.gpu_weight);
            demand.placed_with_gpus(&TaskShape::of(&role.resources), &p.host, p.resources.whole_gpu_mask());
            booked.push((p.host, p.resources));
        }
    }
    for (host, r) in &booked {
        selector.remove_requested(host, r, false);
    }
    let mut hosts: Vec<&str> = booked.iter().map(|(h, _)| h.as_str()).collect();
    hosts.sort_unstable();
    hosts.dedup();
    let broken = selector.with_view(|v| {
        hosts
            .iter()
            .filter_map(|h| v.get(h))
            .filter(|n| n.free().whole_gpu_count() == n.total().gpu_count())
            .count() as u32
    });
    (placed, ideal, tiers, weights, Reverse(broken))
}

/// Why a gang is refused: what it needs, each type's size, and the fix.
fn refusal(
    job: &JobSpec,
    roles: &[usize],
    need: &[u64],
    whole_gpus: u64,
    sizes: &BTreeMap<String, TypeSize>,
) -> String {
    let asked: Vec<String> = roles
        .iter()
        .zip(need)
        .map(|(&ri, n)| {
            let r = &job.task_roles[ri];
            let per = match r.resources.gpu_share {
                Some(h) => format!("{} of a GPU", crate::resources::format_hundredths(h)),
                None => format!("{} GPU(s)", r.resources.gpus),
            };
            format!("{}: {n} × {per}", r.name)
        })
        .collect();
    let types: Vec<String> = sizes
        .iter()
        .map(|(t, s)| {
            let holds: Vec<String> = roles
                .iter()
                .zip(&s.copies)
                .map(|(&ri, c)| format!("{c} {} task(s)", job.task_roles[ri].name))
                .collect();
            format!(
                "{t}: {} node(s), {} GPUs (holds at most {})",
                s.nodes,
                s.gpus,
                holds.join(", ")
            )
        })
        .collect();
    let roles_named: Vec<String> = roles
        .iter()
        .map(|&ri| format!("taskRoles.{}", job.task_roles[ri].name))
        .collect();
    format!(
        "no single GPU type can ever hold this gang ({}; {whole_gpus} GPUs in all): {}. \
         Fix: name the types it may use with `gpuType` on {}, make the gang smaller, or set \
         `allowMixedGpuTypes: true` on the job (or on those roles) to let it span types",
        asked.join(", "),
        types.join("; "),
        roles_named.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::Arc;

    use proptest::prelude::*;

    use crate::cluster::{ClusterView, Node};
    use crate::config::{AmSettings, SelectSettings};
    use crate::resources::{mask_of_count, PortSet, Resources};
    use crate::select::{plan_job, JobPlan, Selector};
    use crate::topology::Topology;

    fn settings() -> SelectSettings {
        SelectSettings {
            seed: Some(7),
            ..SelectSettings::default()
        }
    }

    fn job(yaml: &str) -> crate::spec::JobSpec {
        crate::spec::parse_job_spec(yaml, "t.yaml").expect("test job")
    }

    fn typed(host: &str, ty: &str, gpus: u32, topo: &str) -> Node {
        let mut n = Node::new(
            host,
            "/r",
            Resources::with_mask(128, 1_000_000, mask_of_count(gpus), PortSet::range(20000, 29999)),
        );
        n.gpu_type = Some(ty.into());
        n.topology = Topology::preset(topo).map(Arc::new);
        n
    }

    /// The built-in demo cluster with every GPU idle.
    fn demo_idle() -> Vec<Node> {
        let mut nodes =
            crate::cluster::file::parse_cluster_file(crate::config::BUILT_IN_CLUSTER, "demo").expect("demo cluster");
        for n in &mut nodes {
            n.set_used(Resources::default());
        }
        nodes
    }

    /// Five 8-GPU machines of four types.
    fn five_of_four() -> Vec<Node> {
        vec![
            typed("v1", "V100", 8, "dgx1v"),
            typed("v2", "V100", 8, "pcie8"),
            typed("t1", "T4", 8, "pcie8"),
            typed("a1", "A100", 8, "nvswitch8"),
            typed("h1", "H100", 8, "nvswitch8"),
        ]
    }

    fn types_of(plan: &JobPlan, nodes: &[Node]) -> BTreeSet<String> {
        plan.placements
            .iter()
            .filter(|p| !p.gpus.is_empty())
            .filter_map(|p| nodes.iter().find(|n| n.host == p.host)?.gpu_type.clone())
            .collect()
    }

    /// `gpuam plan`'s path: the AM's job machine against the plan's RM.
    fn am_plan(j: &crate::spec::JobSpec, nodes: Vec<Node>) -> JobPlan {
        crate::am::plan_rm::plan_job(j, nodes, settings(), &AmSettings::default())
    }

    const GANG_6X2: &str = "name: g\ngang: true\ntaskRoles:\n  w:\n    instances: 6\n    \
                            resourcePerInstance: {cpu: 4, memoryMB: 1000, gpu: 2}\n    commands: [x]\n";

    #[test]
    fn a_6x2_gang_on_the_idle_demo_cluster_gets_one_type_the_a100s() {
        let nodes = demo_idle();
        let plan = am_plan(&job(GANG_6X2), nodes.clone());
        assert_eq!((plan.placements.len(), plan.unplaced.len()), (6, 0), "{plan:?}");
        let types = types_of(&plan, &nodes);
        // The two A100 machines hold it at the NVLink tier (V100 and T4 hold it too, on PCIe).
        assert_eq!(types, BTreeSet::from(["A100".to_string()]), "{plan:?}");
        assert!(plan.placements.iter().all(|p| p.gpu_tier_ideal && p.gpu_tier == 2));
        // Allowed to mix, the same gang may span types (the old behaviour).
        let mixed = job(&GANG_6X2.replace("gang: true\n", "gang: true\nallowMixedGpuTypes: true\n"));
        assert!(mixed.allow_mixed_gpu_types);
        assert_eq!(am_plan(&mixed, nodes).placements.len(), 6);
    }

    const GANG_20X2: &str = "name: g\ngang: true\ntaskRoles:\n  worker:\n    instances: 20\n    \
                             resourcePerInstance: {cpu: 4, memoryMB: 1000, gpu: 2}\n    commands: [x]\n";

    #[test]
    fn a_gang_no_single_type_can_hold_is_refused_naming_the_types_and_their_sizes() {
        let nodes = five_of_four();
        let plan = am_plan(&job(GANG_20X2), nodes.clone());
        assert!(plan.placements.is_empty(), "{plan:?}");
        assert_eq!(plan.unplaced.len(), 20);
        let u = &plan.unplaced[0];
        assert!(u.impossible, "{u:?}");
        for want in [
            "no single GPU type",
            "V100: 2 node(s), 16 GPUs",
            "T4: 1 node(s), 8 GPUs",
            "A100: 1 node(s), 8 GPUs",
            "H100: 1 node(s), 8 GPUs",
            "40 GPUs in all",
            "allowMixedGpuTypes: true",
        ] {
            assert!(u.reason.contains(want), "missing {want:?} in {}", u.reason);
        }
        // The AM's start check says so too (what `gpuam submit` then reports).
        let why = crate::am::gang_never_fits(&job(GANG_20X2), &nodes, &crate::config::Settings::default());
        assert!(why.is_some_and(|w| w.contains("no single GPU type")));
        // The structured reason is `Impossible`.
        let r = crate::select::Outcome::Impossible {
            reason: u.reason.clone(),
        }
        .wait_reason();
        assert_eq!(r.map(|r| r.kind), Some(crate::reason::Kind::Impossible));
    }

    #[test]
    fn mixing_is_allowed_when_the_job_or_the_role_says_so() {
        let nodes = five_of_four();
        let on_job = job(&GANG_20X2.replace("gang: true\n", "gang: true\nallowMixedGpuTypes: true\n"));
        let on_role = job(&GANG_20X2.replace(
            "    instances: 20\n",
            "    instances: 20\n    allowMixedGpuTypes: true\n",
        ));
        assert!(on_role.task_roles[0].allow_mixed_gpu_types);
        for j in [on_job, on_role] {
            let plan = am_plan(&j, nodes.clone());
            assert_eq!((plan.placements.len(), plan.unplaced.len()), (20, 0), "{plan:?}");
            assert_eq!(types_of(&plan, &nodes).len(), 4);
        }
    }

    #[test]
    fn a_gang_one_type_holds_goes_there_and_a_role_without_a_gang_keeps_to_one_type() {
        let nodes = five_of_four();
        // 8 × 2: only the two V100 machines hold it.
        let j = job(&GANG_20X2.replace("instances: 20", "instances: 8"));
        let plan = am_plan(&j, nodes.clone());
        assert_eq!(plan.placements.len(), 8, "{plan:?}");
        assert_eq!(types_of(&plan, &nodes), BTreeSet::from(["V100".to_string()]));
        // Without a gang: one type for the role; the rest waits for that type's GPUs.
        let j = job(&GANG_20X2.replace("gang: true\n", ""));
        let plan = select_plan(&j, nodes.clone());
        assert_eq!(types_of(&plan, &nodes).len(), 1, "{plan:?}");
        assert!(plan.unplaced.iter().all(|u| !u.impossible));
        // A role that names its types keeps to them, mixing included.
        let j = job(&GANG_20X2.replace("    instances: 20\n", "    instances: 12\n    gpuType: T4,A100,H100\n"));
        let plan = select_plan(&j, nodes.clone());
        assert_eq!(plan.placements.len(), 12);
        assert_eq!(types_of(&plan, &nodes).len(), 3);
    }

    #[test]
    fn a_gang_of_two_untyped_roles_shares_one_type_and_a_type_held_is_kept() {
        let nodes = five_of_four();
        let j = job(
            "name: g\ngang: true\ntaskRoles:\n  a:\n    instances: 2\n    resourcePerInstance: {cpu: 1, memoryMB: 1, gpu: 4}\n    \
             commands: [x]\n  b:\n    instances: 4\n    resourcePerInstance: {cpu: 1, memoryMB: 1, gpu: 2}\n    commands: [x]\n",
        );
        let plan = select_plan(&j, nodes.clone());
        assert_eq!(plan.placements.len(), 6, "{plan:?}");
        assert_eq!(types_of(&plan, &nodes), BTreeSet::from(["V100".to_string()]));
        // A task of the group already on T4: the others follow it there.
        let selector = Selector::new(ClusterView::new(nodes.clone()), settings());
        let mut round = crate::select::PlacementRound::new(&j, |ri, i| match (ri, i) {
            (0, 0) => crate::select::TaskSlot::Placed {
                host: "t1".into(),
                resources: Resources::with_mask(1, 1, 0xf, PortSet::new()),
            },
            _ => crate::select::TaskSlot::Waiting {
                ready: true,
                topology_wait: false,
            },
        });
        selector.add_requested("t1", &Resources::with_mask(1, 1, 0xf, PortSet::new()));
        let mut hosts = Vec::new();
        while let Some(t) = round.next_task() {
            if let crate::select::Outcome::Placed(p) = round.place(&selector, t).selection.outcome {
                hosts.push(p.host);
            }
        }
        assert_eq!(
            hosts,
            vec!["t1".to_string(); 2],
            "the 4 GPUs left on T4 take what fits; the rest waits"
        );
    }

    fn select_plan(j: &crate::spec::JobSpec, nodes: Vec<Node>) -> JobPlan {
        plan_job(&Selector::new(ClusterView::new(nodes), settings()), j)
    }

    const TYPES: [&str; 3] = ["V100", "T4", "A100"];
    const TOPOS: [&str; 4] = ["pcie8", "dgx1v", "nvswitch8", "pcie4"];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Placements of untyped gangs never mix types; a refused gang is one no type could
        /// hold by its GPU count or per-node fit.
        #[test]
        fn untyped_gangs_never_mix_types(
            cluster in proptest::collection::vec((0usize..3, 0usize..4, any::<u8>()), 2..7),
            roles in proptest::collection::vec((1u32..6, 1u32..5), 1..3),
            gang in any::<bool>(),
        ) {
            let nodes: Vec<Node> = cluster
                .iter()
                .enumerate()
                .map(|(i, &(t, topo, used))| {
                    let gpus = if TOPOS[topo] == "pcie4" { 4 } else { 8 };
                    let mut n = typed(&format!("n{i}"), TYPES[t], gpus, TOPOS[topo]);
                    n.set_used(Resources::with_mask(0, 0, u64::from(used) & mask_of_count(gpus), PortSet::new()));
                    n
                })
                .collect();
            let mut yaml = format!("name: g\ngang: {gang}\ntaskRoles:\n");
            for (k, (inst, gpus)) in roles.iter().enumerate() {
                yaml.push_str(&format!(
                    "  r{k}:\n    instances: {inst}\n    resourcePerInstance: {{cpu: 1, memoryMB: 1, gpu: {gpus}}}\n    commands: [x]\n"
                ));
            }
            let j = job(&yaml);
            let plan = select_plan(&j, nodes.clone());
            if gang {
                prop_assert!(types_of(&plan, &nodes).len() <= 1, "{:?}", plan);
            } else {
                for r in &j.task_roles {
                    let one: JobPlan = JobPlan {
                        placements: plan.placements.iter().filter(|p| p.role == r.name).cloned().collect(),
                        unplaced: Vec::new(),
                    };
                    prop_assert!(types_of(&one, &nodes).len() <= 1, "{:?}", plan);
                }
            }
            if let Some(u) = plan.unplaced.iter().find(|u| u.reason.contains("no single GPU type")) {
                prop_assert!(gang && u.impossible);
                let need: u32 = j.task_roles.iter().map(|r| r.instances * r.resources.gpus).sum();
                for ty in TYPES {
                    let of_type = nodes.iter().filter(|n| n.gpu_type.as_deref() == Some(ty));
                    let fits = |n: &Node, r: &crate::spec::TaskRole| n.total().gpu_count() / r.resources.gpus;
                    let holds = of_type.clone().map(|n| n.total().gpu_count()).sum::<u32>() >= need
                        && j.task_roles.iter().all(|r| of_type.clone().map(|n| fits(n, r)).sum::<u32>() >= r.instances);
                    prop_assert!(!holds, "{ty} could hold it: {:?}", plan);
                }
            }
        }
    }
}
