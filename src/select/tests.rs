//! Tests of each stage on its own and of the pipeline end to end.

use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::cluster::NodeState;
use crate::config::RackPolicy;
use crate::resources::CustomResources;
use crate::spec::{JobSpec, PortRequest, TaskRole};

fn node(host: &str, rack: &str, gpus: u32, used_mask: u64) -> Node {
    let mut n = Node::new(
        host,
        rack,
        Resources::with_mask(
            64,
            256_000,
            crate::resources::mask_of_count(gpus),
            PortSet::range(20000, 29999),
        ),
    );
    let used_gpus = used_mask.count_ones();
    n.set_used(Resources::with_mask(
        4 * used_gpus,
        8192 * u64::from(used_gpus),
        used_mask,
        PortSet::new(),
    ));
    n
}

fn res(cpu: u32, mem: u64, gpus: u32) -> TaskResources {
    TaskResources {
        cpu,
        memory_mb: mem,
        gpus,
        gpu_mask: None,
        ports: Vec::new(),
        ..Default::default()
    }
}

fn role(name: &str, instances: u32, r: TaskResources) -> TaskRole {
    TaskRole {
        name: name.into(),
        instances,
        resources: r,
        commands: vec!["true".into()],
        ..Default::default()
    }
}

fn job(roles: Vec<TaskRole>) -> JobSpec {
    JobSpec {
        name: "j".into(),
        gang: false,
        task_roles: roles,
        ..Default::default()
    }
}

fn settings() -> SelectSettings {
    SelectSettings {
        seed: Some(1),
        ..SelectSettings::default()
    }
}

fn selector(nodes: Vec<Node>) -> Selector {
    Selector::new(ClusterView::new(nodes), settings())
}

fn ask<'a>(r: &'a TaskResources) -> TaskAsk<'a> {
    TaskAsk::plain("worker", r, 1)
}

fn placed(sel: &Selection) -> &Placement {
    match &sel.outcome {
        Outcome::Placed(p) => p,
        other => panic!("expected a placement, got {other:?}\n{}", sel.trace.render()),
    }
}

fn stage<'a>(sel: &'a Selection, name: &str) -> &'a StageTrace {
    sel.trace.stages.iter().find(|s| s.stage == name).unwrap()
}

#[test]
fn packing_order_prefers_fewest_free_gpus_then_smallest_machine() {
    // Free GPUs: a=6, b=2, c=2 on a 4-GPU machine.
    let nodes = vec![
        node("a", "/r", 8, 0x03),
        node("b", "/r", 8, 0x3f),
        node("c", "/r", 4, 0x03),
    ];
    let s = selector(nodes);
    let r = res(1, 1000, 1);
    let sel = s.select(&ask(&r), &JobDemand::new(true));
    assert_eq!(placed(&sel).host, "c", "2 free on the smaller machine wins");
    let p = placed(&sel);
    assert_eq!(p.resources.gpu_mask.count_ones(), 1);
    assert_eq!(p.resources.gpu_mask & 0x03, 0, "never a used GPU");
}

#[test]
fn candidates_stage_drops_nodes_that_are_not_running() {
    let mut down = node("down", "/r", 8, 0);
    down.state = NodeState::New;
    let s = selector(vec![down, node("up", "/r", 8, 0xff)]);
    let r = res(1, 1000, 1);
    let sel = s.select(&ask(&r), &JobDemand::new(true));
    let st = stage(&sel, "candidates");
    assert_eq!((st.nodes_in, st.nodes_out), (2, 1));
    assert_eq!(st.dropped[0].hosts, vec!["down".to_string()]);
    assert!(matches!(sel.outcome, Outcome::NotNow { .. }), "up is full: not now");
}

#[test]
fn labels_are_partitions() {
    let mut gpu = node("labelled", "/r", 8, 0);
    gpu.labels = vec!["gpu".into()];
    let s = selector(vec![gpu, node("plain", "/r", 8, 0)]);
    let r = res(1, 1000, 1);
    let sel = s.select(&ask(&r), &JobDemand::new(true));
    assert_eq!(placed(&sel).host, "plain", "no label = default partition only");
    let mut a = ask(&r);
    a.node_label = Some(" gpu ");
    assert_eq!(placed(&s.select(&a, &JobDemand::new(true))).host, "labelled");
    a.node_label = Some("nope");
    assert!(matches!(
        s.select(&a, &JobDemand::new(true)).outcome,
        Outcome::Impossible { .. }
    ));
}

#[test]
fn gpu_type_filter_is_never_relaxed() {
    let mut v = node("v100", "/r", 8, 0xff);
    v.gpu_type = Some("V100".into());
    let mut a = node("a100", "/r", 8, 0);
    a.gpu_type = Some("A100".into());
    let s = selector(vec![v, a]);
    let r = res(1, 1000, 1);
    let types = vec!["V100".to_string(), "K80".to_string()];
    let mut t = ask(&r);
    t.gpu_types = &types;
    let sel = s.select(&t, &JobDemand::new(true));
    assert!(
        matches!(sel.outcome, Outcome::NotNow { .. }),
        "V100 node is full; A100 is never used"
    );
    assert_eq!(stage(&sel, "gpu-type").nodes_out, 1);
    let none = vec!["H200".to_string()];
    t.gpu_types = &none;
    match s.select(&t, &JobDemand::new(true)).outcome {
        Outcome::Impossible { reason } => assert!(reason.contains("GPU type"), "{reason}"),
        o => panic!("{o:?}"),
    }
}

#[test]
fn none_gpu_jobs_skip_gpu_nodes_only_when_configured() {
    let nodes = vec![node("gpu", "/r", 8, 0), node("cpu", "/r", 0, 0)];
    let r = res(1, 1000, 0);
    let mut st = settings();
    st.allow_none_gpu_job_on_gpu_node = false;
    let s = Selector::new(ClusterView::new(nodes.clone()), st);
    let sel = s.select(&ask(&r), &JobDemand::new(false));
    assert_eq!(placed(&sel).host, "cpu");
    assert_eq!(stage(&sel, "none-gpu").nodes_out, 1);
    // A job that has GPU tasks elsewhere may put its CPU task on a GPU node.
    let s = Selector::new(ClusterView::new(vec![node("gpu", "/r", 8, 0)]), settings());
    assert_eq!(placed(&s.select(&ask(&r), &JobDemand::new(false))).host, "gpu");
}

#[test]
fn explicit_masks_are_honoured_exactly() {
    let s = selector(vec![node("a", "/r", 8, 0x01)]);
    let mut r = res(1, 1000, 2);
    r.gpu_mask = Some(0x0c);
    let p = placed(&s.select(&ask(&r), &JobDemand::new(true))).clone();
    assert_eq!(p.resources.gpu_mask, 0x0c);
    r.gpu_mask = Some(0x03);
    let sel = s.select(&ask(&r), &JobDemand::new(true));
    assert!(matches!(sel.outcome, Outcome::NotNow { .. }), "bit 0 is used");
    assert_eq!(
        stage(&sel, "resources").dropped[0].reason,
        "the requested GPU mask is not free"
    );
    r.gpu_mask = Some(0x300);
    assert!(matches!(
        s.select(&ask(&r), &JobDemand::new(true)).outcome,
        Outcome::Impossible { .. }
    ));
}

#[test]
fn static_dynamic_and_mixed_ports() {
    let mut busy = node("busy", "/r", 8, 0);
    busy.set_used(Resources::with_mask(0, 0, 0, PortSet::range(20000, 20010)));
    let s = selector(vec![busy, node("free", "/r", 8, 0)]);
    let mut r = res(1, 1000, 1);
    r.ports = vec![PortRequest {
        label: "http".into(),
        count: 2,
        start: Some(20005),
    }];
    let sel = s.select(&ask(&r), &JobDemand::new(true));
    assert_eq!(placed(&sel).host, "free", "static port busy on the other node");
    assert_eq!(placed(&sel).resources.ports.to_string(), "20005-20006");
    r.ports.push(PortRequest {
        label: "nccl".into(),
        count: 3,
        start: None,
    });
    for _ in 0..20 {
        let p = placed(&s.select(&ask(&r), &JobDemand::new(true))).clone();
        assert_eq!(p.resources.ports.count(), 5);
        let labelled = assign_port_labels(&r, &p.resources.ports).unwrap();
        assert_eq!(labelled[0], ("http".to_string(), vec![20005, 20006]));
        assert_eq!(labelled[1].1.len(), 3);
        assert!(labelled[1]
            .1
            .iter()
            .all(|p| *p >= 20000 && !(20005..=20006).contains(p)));
    }
}

#[test]
fn dynamic_ports_are_drawn_on_the_chosen_node() {
    let mut a = node("a", "/r", 8, 0);
    a.set_total(Resources::with_mask(64, 256_000, 0xff, PortSet::range(3000, 3001)));
    let mut b = node("b", "/r", 8, 0);
    b.set_total(Resources::with_mask(64, 256_000, 0xff, PortSet::range(4000, 4001)));
    let s = selector(vec![a, b]);
    let mut r = res(1, 1000, 1);
    r.ports = vec![PortRequest {
        label: "p".into(),
        count: 2,
        start: None,
    }];
    let sel = s.select(&ask(&r), &JobDemand::new(true));
    let p = placed(&sel);
    let expect = if p.host == "a" { "3000-3001" } else { "4000-4001" };
    assert_eq!(p.resources.ports.to_string(), expect);
    assert!(stage(&sel, "ports").note.as_deref().unwrap().contains("chosen node"));
    // A node without enough free ports is dropped by the shortfall rule.
    let mut c = node("c", "/r", 8, 0);
    c.set_total(Resources::with_mask(64, 256_000, 0xff, PortSet::range(5000, 5000)));
    let s = selector(vec![c]);
    let sel = s.select(&ask(&r), &JobDemand::new(true));
    assert_eq!(
        stage(&sel, "resources").main_reason(),
        Some("too few free ports at or above container_min_port")
    );
}

#[test]
fn dynamic_ports_respect_container_min_port() {
    let mut a = node("a", "/r", 8, 0);
    a.set_total(Resources::with_mask(64, 256_000, 0xff, PortSet::range(1000, 2001)));
    let s = selector(vec![a]);
    let mut r = res(1, 1000, 1);
    r.ports = vec![PortRequest {
        label: "p".into(),
        count: 2,
        start: None,
    }];
    assert_eq!(
        placed(&s.select(&ask(&r), &JobDemand::new(true)))
            .resources
            .ports
            .to_string(),
        "2000-2001"
    );
    r.ports[0].count = 3;
    match s.select(&ask(&r), &JobDemand::new(true)).outcome {
        Outcome::Impossible { reason } => assert!(reason.contains("ports"), "{reason}"),
        o => panic!("{o:?}"),
    }
}

#[test]
fn same_port_allocation_reuses_the_roles_ports() {
    let mut r = res(1, 1000, 1);
    r.ports = vec![PortRequest {
        label: "p".into(),
        count: 2,
        start: None,
    }];
    let mut j = job(vec![role("w", 3, r)]);
    j.task_roles[0].same_port_allocation = true;
    let s = selector((0..3).map(|i| node(&format!("n{i}"), "/r", 1, 0)).collect());
    let plan = plan_job(&s, &j);
    assert!(plan.unplaced.is_empty(), "{:?}", plan.unplaced);
    let ports: Vec<_> = plan
        .placements
        .iter()
        .map(|p| p.placement.resources.ports.clone())
        .collect();
    assert!(ports.iter().all(|p| *p == ports[0]), "{ports:?}");
    let hosts: std::collections::HashSet<_> = plan.placements.iter().map(|p| p.host.clone()).collect();
    assert_eq!(hosts.len(), 3, "one GPU each: three nodes");
}

#[test]
fn requested_bookkeeping_reduces_and_restores_availability() {
    let s = selector(vec![node("a", "/r", 2, 0)]);
    let r = res(1, 1000, 2);
    let p = placed(&s.select_and_reserve(&ask(&r), &JobDemand::new(true))).clone();
    assert_eq!(p.resources.gpu_mask, 0x3);
    let sel = s.select(&ask(&r), &JobDemand::new(true));
    assert!(
        matches!(sel.outcome, Outcome::NotNow { .. }),
        "booked GPUs are not free"
    );
    assert!(!s.add_requested("a", &p.resources), "double booking is refused");
    s.remove_requested("a", &p.resources, false);
    assert_eq!(placed(&s.select(&ask(&r), &JobDemand::new(true))).host, "a");
}

#[test]
fn tried_resources_are_avoided_until_their_time_is_up() {
    let s = selector(vec![node("a", "/r", 2, 0)]);
    let r = res(1, 1000, 2);
    let p = placed(&s.select_and_reserve(&ask(&r), &JobDemand::new(true))).clone();
    s.remove_requested("a", &p.resources, true);
    let sel = s.select(&ask(&r), &JobDemand::new(true));
    assert!(matches!(sel.outcome, Outcome::NotNow { .. }), "just tried: skip");
    let mut st = settings();
    st.tried_resource_ttl_sec = 0;
    let s = Selector::new(ClusterView::new(vec![node("a", "/r", 2, 0)]), st);
    s.remove_requested("a", &p.resources, true);
    assert_eq!(
        placed(&s.select(&ask(&r), &JobDemand::new(true))).host,
        "a",
        "expired at once"
    );
}

#[test]
fn a_newer_node_report_supersedes_tried_resources() {
    let r = res(1, 1000, 2);
    let s = selector(vec![node("a", "/r", 2, 0)]);
    let p = placed(&s.select_and_reserve(&ask(&r), &JobDemand::new(true))).clone();
    s.remove_requested("a", &p.resources, true);
    assert!(matches!(
        s.select(&ask(&r), &JobDemand::new(true)).outcome,
        Outcome::NotNow { .. }
    ));
    // The report shows the GPUs free again: they are no longer skipped.
    s.apply_node_report(node("a", "/r", 2, 0));
    assert_eq!(placed(&s.select(&ask(&r), &JobDemand::new(true))).host, "a");
    // Same for a full listing.
    let p = placed(&s.select_and_reserve(&ask(&r), &JobDemand::new(true))).clone();
    s.remove_requested("a", &p.resources, true);
    assert!(matches!(
        s.select(&ask(&r), &JobDemand::new(true)).outcome,
        Outcome::NotNow { .. }
    ));
    s.replace_nodes(vec![node("a", "/r", 2, 0)]);
    assert_eq!(placed(&s.select(&ask(&r), &JobDemand::new(true))).host, "a");
}

#[test]
fn a_job_that_fits_one_node_goes_onto_one_node() {
    // Partly used nodes (packing would pick them first) and one empty node.
    let mut nodes: Vec<Node> = (0..6).map(|i| node(&format!("busy{i}"), "/r", 8, 0x0f)).collect();
    nodes.push(node("empty", "/r", 8, 0));
    let s = selector(nodes);
    let j = job(vec![role("w", 4, res(4, 8192, 2))]);
    let plan = plan_job(&s, &j);
    assert!(plan.unplaced.is_empty());
    assert!(
        plan.placements.iter().all(|p| p.host == "empty"),
        "{:?}",
        plan.placements
    );
    let masks: u64 = plan.placements.iter().fold(0, |m, p| {
        assert_eq!(m & p.placement.resources.gpu_mask, 0);
        m | p.placement.resources.gpu_mask
    });
    assert_eq!(masks, 0xff);
}

#[test]
fn a_single_task_packs_into_a_partly_used_node() {
    let s = selector(vec![node("empty", "/r", 8, 0), node("half", "/r", 8, 0x0f)]);
    let j = job(vec![role("w", 1, res(4, 8192, 2))]);
    assert_eq!(plan_job(&s, &j).placements[0].host, "half");
}

#[test]
fn a_job_too_big_for_a_node_uses_fewest_nodes_in_one_rack() {
    let mut nodes = Vec::new();
    for i in 0..4 {
        nodes.push(node(&format!("a{i}"), "/rack-a", 8, 0));
        nodes.push(node(&format!("b{i}"), "/rack-b", 8, 0));
    }
    let s = selector(nodes);
    // 6 tasks × 4 GPUs = 24 GPUs: three whole nodes, one rack.
    let j = job(vec![role("w", 6, res(4, 8192, 4))]);
    let plan = plan_job(&s, &j);
    assert!(plan.unplaced.is_empty());
    let hosts: std::collections::BTreeSet<_> = plan.placements.iter().map(|p| p.host.as_str()).collect();
    let racks: std::collections::BTreeSet<_> = plan.placements.iter().map(|p| p.rack.as_str()).collect();
    assert_eq!(hosts.len(), 3, "{hosts:?}");
    assert_eq!(racks.len(), 1, "{racks:?}");
}

#[test]
fn rack_policy_keeps_the_racks_the_job_uses_unless_turned_off() {
    // The job already runs on a0 (rack a, now full). Packing alone prefers b0 (fewer
    // free GPUs); the rack policy keeps the task in rack a.
    let nodes = vec![
        node("a0", "/rack-a", 8, 0xff),
        node("a1", "/rack-a", 8, 0),
        node("b0", "/rack-b", 8, 0x3f),
    ];
    let r = res(1, 1000, 1);
    let mut demand = JobDemand::new(true);
    demand.add_waiting(TaskShape::of(&r), 1);
    demand.add_host("a0");
    let s = selector(nodes.clone());
    let sel = s.select(&ask(&r), &demand);
    assert_eq!(placed(&sel).host, "a1");
    let alt = sel.trace.alternative.as_ref().unwrap();
    assert_eq!(alt.host, "b0");
    assert!(alt.lost_on.starts_with("rack holds job tasks"), "{}", alt.lost_on);
    let mut st = settings();
    st.rack_policy = RackPolicy::None;
    let s = Selector::new(ClusterView::new(nodes), st);
    assert_eq!(placed(&s.select(&ask(&r), &demand)).host, "b0");
}

#[test]
fn impossible_is_distinct_from_not_now() {
    let s = selector(vec![node("a", "/r", 8, 0xff)]);
    let r = res(1, 1000, 16);
    match s.select(&ask(&r), &JobDemand::new(true)).outcome {
        Outcome::Impossible { reason } => assert!(reason.contains("largest node has 8"), "{reason}"),
        o => panic!("{o:?}"),
    }
    let r = res(128, 1000, 0);
    match s.select(&ask(&r), &JobDemand::new(true)).outcome {
        Outcome::Impossible { reason } => assert!(reason.contains("CPU"), "{reason}"),
        o => panic!("{o:?}"),
    }
    let r = res(1, 1000, 1);
    match s.select(&ask(&r), &JobDemand::new(true)).outcome {
        Outcome::NotNow { reason, .. } => assert!(reason.contains("resources"), "{reason}"),
        o => panic!("{o:?}"),
    }
}

#[test]
fn trace_counts_every_stage_in_order() {
    let s = selector(
        (0..10)
            .map(|i| node(&format!("n{i}"), "/r", 8, if i < 4 { 0xff } else { 0 }))
            .collect(),
    );
    let r = res(1, 1000, 1);
    let sel = s.select(&ask(&r), &JobDemand::new(true));
    let names: Vec<_> = sel.trace.stages.iter().map(|s| s.stage).collect();
    assert_eq!(
        names,
        [
            "candidates",
            "node-label",
            "gpu-type",
            "none-gpu",
            "ports",
            "resources",
            "rack-policy",
            "job-packing"
        ]
    );
    let res_stage = stage(&sel, "resources");
    assert_eq!((res_stage.nodes_in, res_stage.nodes_out), (10, 6));
    assert_eq!(res_stage.dropped[0].count, 4);
    let pack = stage(&sel, "job-packing");
    assert_eq!(pack.nodes_out, 2, "waiting 1 × factor 2");
    for w in sel.trace.stages.windows(2) {
        assert_eq!(w[0].nodes_out, w[1].nodes_in);
    }
}

#[test]
fn roles_interleave_by_index() {
    let j = job(vec![role("ps", 2, res(1, 1, 0)), role("w", 3, res(1, 1, 1))]);
    let order: Vec<_> = request_order(&j)
        .into_iter()
        .map(|(r, i)| (j.task_roles[r].name.clone(), i))
        .collect();
    let expect: Vec<_> = [("ps", 0), ("w", 0), ("ps", 1), ("w", 1), ("w", 2)]
        .iter()
        .map(|(r, i)| (r.to_string(), *i))
        .collect();
    assert_eq!(order, expect);
}

#[test]
fn node_reports_keep_bookings_and_unusable_nodes_leave() {
    let s = selector(vec![node("a", "/r", 8, 0), node("b", "/r", 8, 0)]);
    let booked = Resources::with_mask(1, 1, 0x3, PortSet::new());
    assert!(s.add_requested("a", &booked));
    s.replace_nodes(vec![node("a", "/r", 8, 0x30)]);
    s.with_view(|v| {
        assert_eq!(v.len(), 1);
        let a = v.get("a").unwrap();
        assert_eq!(a.free().gpu_mask, 0xff & !0x33);
    });
    let mut lost = node("a", "/r", 8, 0);
    lost.state = NodeState::Lost;
    s.apply_node_report(lost);
    s.with_view(|v| assert!(v.is_empty()));
}

#[test]
fn topologies_are_shared_between_nodes() {
    let t = crate::topology::Topology::preset("pcie8").unwrap();
    let mut a = node("a", "/r", 8, 0);
    a.topology = Some(Arc::new(t.clone()));
    let mut b = node("b", "/r", 8, 0);
    b.topology = Some(Arc::new(t));
    let s = selector(vec![a, b]);
    s.with_view(|v| {
        let ta = v.get("a").unwrap().topology.as_ref().unwrap();
        let tb = v.get("b").unwrap().topology.as_ref().unwrap();
        assert!(
            Arc::ptr_eq(ta, tb),
            "one copy, so the GPU choice cache hits across nodes"
        );
    });
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Whatever the cluster and job, a plan never books a GPU bit or port twice on a
    /// node, never more CPU or memory than is free, and every mask has exactly the
    /// requested number of bits.
    #[test]
    fn plans_never_overbook(
        used in prop::collection::vec(any::<u8>(), 1..8),
        tasks in prop::collection::vec((1u32..4, 0u32..5, 0u16..3), 1..12),
        seed in any::<u64>(),
    ) {
        let nodes: Vec<Node> = used.iter().enumerate().map(|(i, m)| {
            let mut n = node(&format!("n{i}"), if i.is_multiple_of(2) { "/a" } else { "/b" }, 8, u64::from(*m));
            n.set_total(Resources::with_mask(16, 64_000, 0xff, PortSet::range(2000, 2009)));
            n.set_used(Resources::with_mask(m.count_ones(), 1000, u64::from(*m), PortSet::new()));
            n
        }).collect();
        let mut st = settings();
        st.seed = Some(seed);
        let s = Selector::new(ClusterView::new(nodes.clone()), st);
        let roles: Vec<TaskRole> = tasks.iter().enumerate().map(|(i, (cpu, gpus, ports))| {
            let mut r = res(*cpu, 4000, *gpus);
            if *ports > 0 {
                r.ports = vec![PortRequest { label: "p".into(), count: *ports, start: None }];
            }
            role(&format!("r{i}"), 1, r)
        }).collect();
        let j = job(roles);
        let plan = plan_job(&s, &j);
        prop_assert_eq!(plan.placements.len() + plan.unplaced.len(), tasks.len());
        let mut booked: HashMap<String, Resources> = HashMap::new();
        for p in &plan.placements {
            let want = j.role(&p.role).unwrap().resources.gpus;
            prop_assert_eq!(p.placement.resources.gpu_mask.count_ones(), want);
            let n = nodes.iter().find(|n| n.host == p.host).unwrap();
            prop_assert_eq!(p.placement.resources.gpu_mask & n.used().gpu_mask, 0);
            let cur = booked.remove(&p.host).unwrap_or_default();
            let sum = cur.try_add(&p.placement.resources);
            prop_assert!(sum.is_ok(), "double booking on {}", p.host);
            let sum = sum.unwrap();
            prop_assert!(sum.fits_in(n.free()), "over-booked {}", p.host);
            booked.insert(p.host.clone(), sum);
        }
    }
}

#[test]
fn a_node_offering_the_best_gpu_set_beats_a_fuller_node() {
    // pcie8, 4 GPUs: the best quad is one socket (2 PIX pairs + NODE links). "busy" has
    // fewer free GPUs (packing would pick it) but only cross-socket quads.
    let topo = Arc::new(crate::topology::Topology::preset("pcie8").unwrap());
    let mut busy = node("busy", "/r", 8, 0b1000_1100);
    busy.topology = Some(topo.clone());
    let mut roomy = node("roomy", "/r", 8, 0);
    roomy.topology = Some(topo);
    let s = selector(vec![busy, roomy]);
    let r = res(1, 1000, 4);
    let p = placed(&s.select(&ask(&r), &JobDemand::new(true))).clone();
    assert_eq!(p.host, "roomy");
    assert!(
        p.resources.gpu_mask == 0x0f || p.resources.gpu_mask == 0xf0,
        "{:#x}",
        p.resources.gpu_mask
    );
}

proptest! {
    /// One task with nothing of its job on the node: the pick is exactly DESIGN §5's choice.
    #[test]
    fn a_lone_task_gets_the_section_5_choice(free in any::<u8>(), k in 1u32..9, preset in prop::sample::select(vec!["pcie8", "dgx1v", "nvbridge8x", "nvswitch8", "pcie4"])) {
        let t = crate::topology::Topology::preset(preset).unwrap();
        let free = u64::from(free) & t.all_mask();
        let got = objective::pick(Some(&t), free, 0, objective::Want { k, f: 1, spread: false }).map(|p| (p.task, p.task_tier, p.task_weight));
        let want = crate::topology::choose(Some(&t), free, k).map(|g| (g.mask, g.tier, g.weight));
        prop_assert_eq!(got, want);
    }
}

/// The order inside one node without its random tie-break, as a tuple (smaller is better):
/// criteria 1–8 with the weights at 6–7 (how a node's own set is chosen, DESIGN §5), then
/// 9–13 (fit and packing). [`node_key`] turns it into the order across nodes.
type Order = (
    (
        std::cmp::Reverse<bool>,
        std::cmp::Reverse<u32>,
        std::cmp::Reverse<bool>,
        std::cmp::Reverse<u8>,
        std::cmp::Reverse<u8>,
        std::cmp::Reverse<u32>,
        std::cmp::Reverse<u32>,
        u8,
        u8,
        std::cmp::Reverse<u32>,
    ),
    (
        [u8; crate::topology::FIT_LEVELS],
        u32,
        std::cmp::Reverse<[i8; 3]>,
        u32,
        u32,
        u64,
    ),
);

/// The best value of the order over every X ⊇ S of the union's size on `n` (brute force,
/// straight from the definition in docs/DESIGN-NOTES.md).
fn order_of(n: &Node, s: u64, demand: &JobDemand, job_racks: &[String], k: u32) -> Option<Order> {
    use std::cmp::Reverse;
    let t = n.topology.as_deref()?;
    let free = n.free();
    if s & !free.gpu_mask != 0 || s.count_ones() != k {
        return None;
    }
    let need = demand.remaining_tasks().max(1);
    let fits = demand.capacity_in(free, 0).max(1).min(need);
    let u = fits.min(free.gpu_count() / k) * k;
    let held = demand.held_on(&n.host);
    let spread = demand.tasks_elsewhere(&n.host) > 0 || fits < need;
    let mut best: Option<Order> = None;
    objective::subsets(free.gpu_mask & !s, u - k, &mut |rest| {
        let x = s | rest;
        let un = held | x;
        let o: Order = (
            (
                Reverse(demand.tasks_on(&n.host) > 0),
                Reverse(fits),
                Reverse(job_racks.contains(&n.rack)),
                Reverse(t.tier(un)),
                Reverse(t.tier(s)),
                Reverse(t.weight(un)),
                Reverse(t.weight(s)),
                t.numa_split(s),
                t.nic_apart(s),
                Reverse(if spread { (s & t.nic_near()).count_ones() } else { 0 }),
            ),
            (
                t.fit(free.gpu_mask, x),
                free.gpu_count(),
                Reverse(t.cap(free.gpu_mask & !x)),
                n.total().gpu_count(),
                free.cpu,
                free.memory_mb,
            ),
        );
        if best.is_none_or(|b| o < b) {
            best = Some(o);
        }
    });
    best
}

/// The written order across nodes (issue 27): the weights move behind packing (9b) and
/// criterion 6 becomes "the union reaches W*(|U|), the machine's best pair weight"; while
/// other jobs wait, best fit's NVLink level and the node's free GPUs come right after the
/// tiers (6q) and the ideal weight after packing (9a).
type NodeKey = (
    (
        std::cmp::Reverse<bool>,
        std::cmp::Reverse<u32>,
        std::cmp::Reverse<bool>,
        std::cmp::Reverse<u8>,
        std::cmp::Reverse<u8>,
        std::cmp::Reverse<bool>,
        // 6q's NVLink fit, then 6d (a declared run time): best fit, the drain term.
        (u8, [u8; crate::topology::FIT_LEVELS], u32),
        u32,
        u8,
        u8,
        std::cmp::Reverse<u32>,
    ),
    (
        [u8; crate::topology::FIT_LEVELS],
        u32,
        std::cmp::Reverse<bool>,
        std::cmp::Reverse<u32>,
        std::cmp::Reverse<u32>,
        std::cmp::Reverse<[i8; 3]>,
        u32,
        u32,
        u64,
    ),
);

/// [`Order`] of a node's chosen (S, X) as the key nodes are compared by; `u` the union's
/// GPU count; `others_wait`: other jobs wait behind this one (queue pressure); `ends`: the
/// clock and the task's declared end (ms), when it declares a run time (criterion 6d: best
/// fit, then the minutes its end passes the node's drain, or its whole run on an idle node).
fn node_key(n: &Node, o: Order, u: u32, others_wait: bool, ends: Option<(u64, u64)>) -> NodeKey {
    let t = n.topology.as_deref().expect("a topology");
    let best = crate::topology::choose(Some(t), t.all_mask(), u).map_or(0, |g| g.weight);
    let ((aff, fits, rack, tu, ts, wu, ws, numa, apart, nic), (fit, free, cap, total, cpu, mem)) = o;
    let ideal = std::cmp::Reverse(wu.0 >= best);
    let (early_ideal, early_nvlink, early_free) = if others_wait {
        (std::cmp::Reverse(true), fit[0], free)
    } else {
        (ideal, 0, 0)
    };
    let declared = match (ends, n.drain_by_ms) {
        (None, _) => (early_nvlink, Default::default(), 0),
        (Some(_), None) => (early_nvlink, fit, 0),
        (Some((now, end)), Some(d)) => (early_nvlink, fit, (end.saturating_sub(d.max(now)) / 60_000) as u32),
    };
    (
        (
            aff,
            fits,
            rack,
            tu,
            ts,
            early_ideal,
            declared,
            early_free,
            numa,
            apart,
            nic,
        ),
        (fit, free, ideal, wu, ws, cap, total, cpu, mem),
    )
}

fn mixed_node(i: usize, preset: &str, used: u64, cpu_used: u32) -> Node {
    let t = Arc::new(crate::topology::Topology::preset(preset).unwrap());
    let all = t.all_mask();
    let mut n = Node::new(
        format!("n{i}"),
        if i.is_multiple_of(2) { "/a" } else { "/b" },
        Resources::with_mask(32, 256_000, all, PortSet::range(20000, 20999)),
    );
    n.topology = Some(t);
    n.set_used(Resources::with_mask(cpu_used, 1000, used & all, PortSet::new()));
    n
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]
    /// On small mixed clusters, every choice the pipeline makes while planning a small job
    /// is optimal under the written order: brute force over every node, every task set S and
    /// every union X ⊇ S finds no better set on the chosen node (the order inside a node)
    /// and no node with a better key (the order across nodes).
    #[test]
    fn every_choice_is_optimal_under_the_written_order(
        nodes in prop::collection::vec(
            (prop::sample::select(vec!["pcie4", "pcie4-nvbridge", "pcie8", "pcie8-nic", "dgx1v", "nvbridge8", "nvbridge8x", "nvswitch8", "pcie8-1root"]), any::<u8>(), 0u32..24, 0u32..6),
            1..7),
        k in prop::sample::select(vec![1u32, 2, 3, 4]),
        instances in 1u32..4,
        others_wait in any::<bool>(),
        declares in any::<bool>(),
    ) {
        // A node's drain: unknown, idle, or 0-3 hours from now (issue 27, criterion 6d).
        const NOW: u64 = 1_700_000_000_000;
        let nodes: Vec<Node> = nodes
            .iter()
            .enumerate()
            .map(|(i, (p, used, cpu, drain))| {
                let mut n = mixed_node(i, p, u64::from(*used), *cpu);
                n.drain_by_ms = match drain {
                    0 => None,
                    1 => Some(0),
                    h => Some(NOW + u64::from(h - 2) * 3_600_000 - 600_000),
                };
                n
            })
            .collect();
        let s = selector(nodes);
        s.set_others_wait(others_wait);
        s.set_clock(NOW);
        let run = declares.then_some(5_400u64);
        let ends = run.map(|r| (NOW, NOW + r * 1000));
        let r = res(4, 1000, k);
        let mut demand = JobDemand::new(true);
        demand.add_waiting(TaskShape::of(&r), instances);
        for left in (1..=instances).rev() {
            let view: Vec<Node> = s.with_view(|v| v.nodes().cloned().collect());
            let job_racks: Vec<String> = demand
                .hosts()
                .filter_map(|(h, _)| view.iter().find(|n| n.host == h).map(|n| n.rack.clone()))
                .collect();
            // Per node, its own best (S, X) by the order inside a node; nodes by the key.
            let node_best = |n: &Node| {
                let mut best: Option<Order> = None;
                objective::subsets(n.free().gpu_mask, k, &mut |set| {
                    if let Some(o) = order_of(n, set, &demand, &job_racks, k) {
                        if best.is_none_or(|b| o < b) {
                            best = Some(o);
                        }
                    }
                });
                best
            };
            let union_size = |n: &Node| {
                let need = demand.remaining_tasks().max(1);
                let fits = demand.capacity_in(n.free(), 0).max(1).min(need);
                demand.held_on(&n.host).count_ones() + fits.min(n.free().gpu_count() / k) * k
            };
            let mut best: Option<NodeKey> = None;
            for n in &view {
                if r.cpu > n.free().cpu {
                    continue;
                }
                if let Some(o) = node_best(n) {
                    let key = node_key(n, o, union_size(n), others_wait, ends);
                    if best.is_none_or(|b| key < b) {
                        best = Some(key);
                    }
                }
            }
            let ask = TaskAsk { max_run_sec: run, ..TaskAsk::plain("w", &r, left) };
            let sel = s.select_and_reserve(&ask, &demand);
            match (&sel.outcome, best) {
                (Outcome::Placed(p), Some(b)) => {
                    let n = view.iter().find(|n| n.host == p.host).unwrap();
                    let got = order_of(n, p.resources.gpu_mask, &demand, &job_racks, k);
                    prop_assert_eq!(got, node_best(n), "task {} chose {} {:#x}: not its node's best set\n{}", instances - left, p.host, p.resources.gpu_mask, sel.trace.render());
                    let got = got.map(|o| node_key(n, o, union_size(n), others_wait, ends));
                    prop_assert_eq!(got, Some(b), "task {} chose {} {:#x}\n{}", instances - left, p.host, p.resources.gpu_mask, sel.trace.render());
                    demand.placed_with_gpus(&TaskShape::of(&r), &p.host, p.resources.gpu_mask);
                }
                (Outcome::Placed(p), None) => prop_assert!(false, "placed on {} where brute force finds nothing", p.host),
                (_, Some(b)) => prop_assert!(false, "not placed, brute force finds {:?}", b),
                (_, None) => break,
            }
        }
    }
}

/// A gang's GPUs on one node all-reduce together: the union's tier counts, so a 4 × 2 job
/// goes to the all-NVLink box, not to the PCIe box with fewer CPUs (issue 13's bug).
#[test]
fn a_gang_goes_where_the_union_of_its_gpus_is_best() {
    let mut pcie = mixed_node(0, "pcie8", 0, 0);
    pcie.set_total(Resources::with_mask(64, 256_000, 0xff, PortSet::range(20000, 20999)));
    let mut dgx = mixed_node(1, "dgx1v", 0, 0);
    dgx.set_total(Resources::with_mask(80, 512_000, 0xff, PortSet::range(20000, 20999)));
    let s = selector(vec![pcie, dgx]);
    let j = job(vec![role("w", 4, res(8, 32768, 2))]);
    let plan = plan_job(&s, &j);
    assert!(plan.unplaced.is_empty());
    for p in &plan.placements {
        assert_eq!(p.host, "n1", "{:?}", plan.placements);
        assert_eq!(p.gpu_tier, 2);
        assert_eq!(p.union_tier, 2);
    }
    let next = plan.placements[0].next_best.as_ref().unwrap();
    assert_eq!(next.host, "n0");
    assert!(next.lost_on.contains("union tier"), "{}", next.lost_on);
    // A single 8-GPU task makes the same choice.
    let s = selector(vec![mixed_node(0, "pcie8", 0, 0), mixed_node(1, "dgx1v", 0, 0)]);
    let plan = plan_job(&s, &job(vec![role("w", 1, res(8, 32768, 8))]));
    assert_eq!(plan.placements[0].host, "n1");
}

/// The trace's counts come from the index and still add up on a large cluster, and the
/// choice equals the best node found by scoring every node.
#[test]
fn the_index_walk_finds_the_best_node_and_counts_every_drop() {
    let nodes = crate::cluster::synthetic::bench_cluster(2000, 7);
    let s = selector(nodes.clone());
    let r = res(4, 8192, 2);
    let mut demand = JobDemand::new(true);
    demand.add_waiting(TaskShape::of(&r), 1);
    let sel = s.select(&ask(&r), &demand);
    let p = placed(&sel).clone();
    let mut best: Option<Order> = None;
    for n in &nodes {
        if n.free().cpu < 4 {
            continue;
        }
        objective::subsets(n.free().gpu_mask, 2, &mut |set| {
            if let Some(o) = order_of(n, set, &demand, &[], 2) {
                if best.is_none_or(|b| o < b) {
                    best = Some(o);
                }
            }
        });
    }
    let n = nodes.iter().find(|n| n.host == p.host).unwrap();
    assert_eq!(order_of(n, p.resources.gpu_mask, &demand, &[], 2), best);
    let fewer_than_two = nodes.iter().filter(|n| n.free().gpu_count() < 2).count();
    assert_eq!(stage(&sel, "resources").dropped_count(), fewer_than_two);
    let first = &sel.trace.stages[0];
    assert_eq!(first.nodes_in, 2000);
    for w in sel.trace.stages.windows(2) {
        assert_eq!(w[0].nodes_out, w[1].nodes_in);
        assert_eq!(w[1].nodes_in - w[1].nodes_out, w[1].dropped_count(), "{}", w[1].stage);
    }
    // Booking and un-booking keep the index in step with the view.
    assert!(s.add_requested(&p.host, &p.resources));
    let again = placed(&s.select(&ask(&r), &demand)).clone();
    if again.host == p.host {
        assert_eq!(
            again.resources.gpu_mask & p.resources.gpu_mask,
            0,
            "a booked GPU chosen again"
        );
    }
    s.remove_requested(&p.host, &p.resources, false);
    assert_eq!(placed(&s.select(&ask(&r), &demand)).host, p.host);
}

/// A job that spans nodes takes the GPUs behind an RDMA NIC's PCIe switch (GPUDirect RDMA);
/// a job that fits on one node takes a set sharing a NIC among equal ones; plan names the NIC.
#[test]
fn a_job_spanning_nodes_takes_gpus_behind_a_nic() {
    // pcie8-nic: mlx5_0 on GPUs 0–1's switch, mlx5_1 on GPUs 4–5's. n0 has {2,3} (no NIC)
    // and {4,5} (mlx5_1) free; n1 only {0,1} (mlx5_0).
    let nodes = || {
        vec![
            mixed_node(0, "pcie8-nic", 0b1100_0011, 0),
            mixed_node(1, "pcie8-nic", 0b1111_1100, 0),
        ]
    };
    let plan = plan_job(&selector(nodes()), &job(vec![role("w", 3, res(4, 1000, 2))]));
    assert!(plan.unplaced.is_empty(), "{plan:?}");
    let first = &plan.placements[0];
    assert_eq!((first.host.as_str(), first.gpus.as_slice()), ("n0", &[4u32, 5][..]));
    assert_eq!(first.nic.as_deref(), Some("mlx5_1"));
    let on_n1 = plan.placements.iter().find(|p| p.host == "n1").unwrap();
    assert_eq!(on_n1.nic.as_deref(), Some("mlx5_0"));
    // One task that fits on n0 alone: no RDMA term, but among the equal PIX pairs (each
    // within one NUMA node) the one whose GPUs share a NIC wins (issue 27: A(S) after N(S)):
    // {4,5} under mlx5_1, not the lowest pair {2,3}, which shares none.
    let plan = plan_job(
        &selector(vec![nodes().remove(0)]),
        &job(vec![role("w", 1, res(4, 1000, 2))]),
    );
    assert_eq!(plan.placements[0].gpus, [4, 5]);
    assert_eq!(plan.placements[0].nic.as_deref(), Some("mlx5_1"));
}

// ---------- GPU shares and custom resources (issue 15) ----------

fn share_res(cpu: u32, share: u32) -> TaskResources {
    TaskResources {
        gpu_share: Some(share),
        ..res(cpu, 1000, 1)
    }
}

/// A node of `gpus` GPUs whose GPUs hold these shares already (index, hundredths).
fn shared_node(host: &str, gpus: u32, shares: &[(u32, u32)]) -> Node {
    let mut n = node(host, "/r", gpus, 0);
    let mut used = Resources::default();
    for &(i, h) in shares {
        used = used
            .try_add(&Resources::with_share(1, 100, i, h, PortSet::new()))
            .expect("test shares fit");
    }
    n.set_used(used);
    n
}

#[test]
fn a_share_goes_best_fit_onto_an_already_shared_gpu() {
    let s = selector(vec![
        shared_node("half", 2, &[(0, 50)]),
        shared_node("quarter", 2, &[(1, 75)]),
        node("empty", "/r", 8, 0),
    ]);
    let d = JobDemand::new(true);
    let r = share_res(1, 25);
    let p = placed(&s.select(&ask(&r), &d)).clone();
    assert_eq!(
        (p.host.as_str(), p.resources.gpu_text()),
        ("quarter", "0x2 (1:0.25)".to_string()),
        "exact fit"
    );
    let r = share_res(1, 50);
    let sel = s.select(&ask(&r), &d);
    let p = placed(&sel);
    assert_eq!(
        (p.host.as_str(), p.resources.gpu_text()),
        ("half", "0x1 (0:0.5)".to_string())
    );
    let alt = sel.trace.alternative.as_ref().expect("a next best");
    assert!(alt.lost_on.starts_with("share left on its GPU"), "{}", alt.lost_on);
    // 0.6 fits no shared GPU: it opens a wholly free GPU, on a busy node (fewest free GPUs).
    let r = share_res(1, 60);
    let p = placed(&s.select(&ask(&r), &d)).clone();
    assert!(p.host == "half" || p.host == "quarter", "{p:?}");
    let n = s.with_view(|v| v.get(&p.host).unwrap().free().clone());
    assert_eq!(
        n.gpu_hundredths(p.resources.gpu_mask.trailing_zeros()),
        100,
        "a wholly free GPU"
    );
}

#[test]
fn whole_gpu_tasks_never_get_a_shared_gpu() {
    let s = selector(vec![shared_node("a", 2, &[(0, 10)])]);
    let d = JobDemand::new(true);
    let p = placed(&s.select(&ask(&res(1, 1000, 1)), &d)).clone();
    assert_eq!(p.resources.gpu_mask, 0x2);
    let sel = s.select(&ask(&res(1, 1000, 2)), &d);
    assert!(matches!(sel.outcome, Outcome::NotNow { .. }), "{:?}", sel.outcome);
    assert_eq!(stage(&sel, "resources").main_reason(), Some("not enough free GPUs"));
    // An explicit mask on the shared GPU is refused too.
    let pinned = TaskResources {
        gpu_mask: Some(0x1),
        ..res(1, 1000, 1)
    };
    let sel = s.select(&ask(&pinned), &d);
    assert!(matches!(sel.outcome, Outcome::NotNow { .. }), "{:?}", sel.outcome);
}

#[test]
fn four_quarters_of_a_job_share_one_gpu_and_a_pair_keeps_the_best_free_pair() {
    // An NVLink-paired 4-GPU box: the 2-GPU task must still find a full pair.
    let mut n = node("box", "/r", 4, 0);
    n.topology = Topology::preset("pcie4").map(Arc::new);
    let s = selector(vec![n]);
    let j = job(vec![
        role("small", 5, share_res(1, 25)),
        role("big", 1, res(1, 1000, 2)),
    ]);
    let plan = plan_job(&s, &j);
    assert!(plan.unplaced.is_empty(), "{:?}", plan.unplaced);
    let small: Vec<&PlannedTask> = plan.placements.iter().filter(|p| p.role == "small").collect();
    let on_first = small.iter().filter(|p| p.gpus == small[0].gpus).count();
    assert_eq!(on_first, 4, "four quarters on one GPU: {small:?}");
    let fifth = small
        .iter()
        .find(|p| p.gpus != small[0].gpus)
        .expect("the fifth elsewhere");
    let big = plan.placements.iter().find(|p| p.role == "big").unwrap();
    let t = Topology::preset("pcie4").unwrap();
    let used = crate::resources::parse_mask(&small[0].gpu_mask).unwrap()
        | crate::resources::parse_mask(&fifth.gpu_mask).unwrap();
    let pair = crate::resources::parse_mask(&big.gpu_mask).unwrap();
    assert_eq!(pair & used, 0, "the pair shares no GPU with the quarters");
    let best = crate::topology::choose(Some(&t), 0xf & !used, 2).unwrap();
    assert_eq!(t.tier(pair), best.tier, "the pair is the best left: {big:?}");
    // The shares kept a good pair free: the quarters took GPUs of one pair.
    assert_eq!(t.tier(pair), t.best_tier(2), "{small:?} {big:?}");
}

#[test]
fn custom_resources_filter_and_explain_in_the_trace() {
    let mut a = node("a", "/r", 0, 0);
    a.set_total(
        a.total()
            .clone()
            .with_custom(CustomResources::from_pairs([("nvme", 2)])),
    );
    let mut b = node("b", "/r", 0, 0);
    b.set_total(
        b.total()
            .clone()
            .with_custom(CustomResources::from_pairs([("ib_hca", 1)])),
    );
    let c = node("c", "/r", 0, 0);
    let s = selector(vec![a, b, c]);
    let r = TaskResources {
        custom: CustomResources::from_pairs([("nvme", 1)]),
        ..res(1, 1000, 0)
    };
    let d = JobDemand::new(false);
    for _ in 0..2 {
        let sel = s.select_and_reserve(&ask(&r), &d);
        assert_eq!(placed(&sel).host, "a");
        assert_eq!(placed(&sel).resources.custom.get("nvme"), 1);
        let st = stage(&sel, "resources");
        assert_eq!(st.main_reason(), Some("not enough of a custom resource free"));
        assert_eq!(st.note.as_deref(), Some("nodes with 1 nvme free: a"));
    }
    let sel = s.select(&ask(&r), &d);
    match &sel.outcome {
        Outcome::NotNow { reason, .. } => assert_eq!(reason, "no node has 1 nvme free; nodes with nvme: a"),
        other => panic!("{other:?}"),
    }
    assert!(sel
        .trace
        .render()
        .contains("no node has 1 nvme free; nodes with nvme: a"));
    let fpga = TaskResources {
        custom: CustomResources::from_pairs([("fpga", 1)]),
        ..res(1, 1000, 0)
    };
    match s.select(&ask(&fpga), &d).outcome {
        Outcome::Impossible { reason } => {
            assert!(reason.contains("no node offers the custom resource `fpga`"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    let many = TaskResources {
        custom: CustomResources::from_pairs([("nvme", 3)]),
        ..res(1, 1000, 0)
    };
    match s.select(&ask(&many), &d).outcome {
        Outcome::Impossible { reason } => assert!(
            reason.contains("no node has 3 nvme") && reason.contains(": a"),
            "{reason}"
        ),
        other => panic!("{other:?}"),
    }
}

proptest! {
    /// On random clusters with random shares already used, a share always lands where
    /// the least room is left among every (node, GPU) that can take it (best fit), never
    /// on a GPU without the room, and is NotNow exactly when no GPU has the room.
    #[test]
    fn a_share_is_placed_best_fit_over_the_whole_cluster(
        nodes in proptest::collection::vec((1u32..5, proptest::collection::vec((0u32..4, 1u32..100), 0..5), 0u64..16), 1..6),
        share in 1u32..100,
    ) {
        let mut view = Vec::new();
        for (i, (gpus, shares, whole)) in nodes.iter().enumerate() {
            let mut n = node(&format!("n{i}"), "/r", *gpus, 0);
            let mut used = Resources::with_mask(0, 0, whole & crate::resources::mask_of_count(*gpus), PortSet::new());
            for &(g, h) in shares {
                if g < *gpus {
                    if let Ok(u) = used.try_add(&Resources::with_share(0, 0, g, h, PortSet::new())) {
                        used = u;
                    }
                }
            }
            n.set_used(used);
            view.push(n);
        }
        let best = view
            .iter()
            .flat_map(|n| (0..n.total().gpu_count()).map(move |g| n.free().gpu_hundredths(g)))
            .filter(|room| *room >= share)
            .map(|room| room - share)
            .min();
        let s = selector(view.clone());
        let r = share_res(1, share);
        let sel = s.select(&ask(&r), &JobDemand::new(true));
        match (&sel.outcome, best) {
            (Outcome::Placed(p), Some(least)) => {
                let n = view.iter().find(|n| n.host == p.host).unwrap();
                let g = p.resources.gpu_mask.trailing_zeros();
                prop_assert_eq!(p.resources.gpu_mask.count_ones(), 1);
                let room = n.free().gpu_hundredths(g);
                prop_assert!(room >= share);
                prop_assert_eq!(room - share, least, "best fit: {:?}", p);
                prop_assert_eq!(p.resources.gpu_share(), Some(share));
            }
            (Outcome::NotNow { .. }, None) => {}
            (o, b) => prop_assert!(false, "outcome {:?} with best room {:?}", o, b),
        }
    }
}

/// A pcie4 node (pairs 0-1 and 2-3 on their own PCIe switches) with `used` held.
fn pcie4_node(host: &str, used: u64) -> Node {
    let mut n = node(host, "/r", 4, used);
    n.topology = Some(Arc::new(crate::topology::Topology::preset("pcie4").unwrap()));
    n
}

/// The topology wait (docs/DESIGN-NOTES.md): a set below its node's ideal tier, while other
/// jobs hold GPUs, is "not now" for a task that may still wait, and taken by one whose wait
/// is spent; the trace says why.
#[test]
fn a_task_below_its_ideal_tier_waits_while_other_jobs_may_free_a_better_set() {
    // Another job holds GPUs 0 and 2: only the split pair 1 + 3 is free.
    let s = selector(vec![pcie4_node("split", 0b0101)]);
    let r = res(1, 1000, 2);
    let demand = JobDemand::new(true);
    let sel = s.select(&ask(&r).with_topology_wait(true), &demand);
    match &sel.outcome {
        Outcome::NotNow { reason, .. } => {
            assert!(reason.contains("GPUs 1,3 on split at tier 0"), "{reason}");
            assert!(reason.contains("topology_wait_sec (300 s)"), "{reason}");
        }
        other => panic!("expected not now, got {other:?}"),
    }
    let st = stage(&sel, "topology-wait");
    assert_eq!((st.nodes_in, st.nodes_out), (1, 0));
    assert_eq!(
        sel.trace.candidates[0].host, "split",
        "the trace still shows the best candidate"
    );
    // Its wait spent, it takes the best set there is.
    let p = placed(&s.select(&ask(&r), &demand)).clone();
    assert_eq!(p.resources.gpu_mask, 0b1010);
    assert!(!p.gpu_tier_ideal && p.may_improve);
}

#[test]
fn no_topology_wait_when_an_ideal_set_is_free_or_only_the_job_itself_holds_gpus() {
    let r = res(1, 1000, 2);
    // A whole pair free elsewhere: taken at once.
    let s = selector(vec![pcie4_node("split", 0b0101), pcie4_node("pair", 0b0011)]);
    let p = placed(&s.select(&ask(&r).with_topology_wait(true), &JobDemand::new(true))).clone();
    assert_eq!((p.host.as_str(), p.resources.gpu_mask), ("pair", 0b1100));
    assert!(p.gpu_tier_ideal && !p.may_improve);
    // The GPUs in use are the job's own: no release will come, so no wait.
    let s = selector(vec![pcie4_node("own", 0b0101)]);
    let mut demand = JobDemand::new(true);
    demand.add_held("own", 0b0101);
    let p = placed(&s.select(&ask(&r).with_topology_wait(true), &demand)).clone();
    assert_eq!(p.resources.gpu_mask, 0b1010);
    assert!(!p.gpu_tier_ideal && !p.may_improve);
    // Other jobs hold GPUs only on nodes of a type the task does not take: no release there
    // can help it, so it does not wait; a task that takes any type does.
    let mut own = pcie4_node("own", 0b0101);
    own.gpu_type = Some("V100".into());
    let mut other = pcie4_node("other", 0b1111);
    other.gpu_type = Some("A100".into());
    let s = selector(vec![own, other]);
    let mut demand = JobDemand::new(true);
    demand.add_held("own", 0b0101);
    let v100 = vec!["V100".to_string()];
    let mut typed = ask(&r).with_topology_wait(true);
    typed.gpu_types = &v100;
    let p = placed(&s.select(&typed, &demand)).clone();
    assert!(!p.gpu_tier_ideal && !p.may_improve);
    let any = s.select(&ask(&r).with_topology_wait(true), &demand);
    assert!(matches!(any.outcome, Outcome::NotNow { .. }), "{:?}", any.outcome);
    // A one-GPU task has no tier to wait for.
    let s = selector(vec![pcie4_node("split", 0b0101)]);
    let one = res(1, 1000, 1);
    placed(&s.select(&ask(&one).with_topology_wait(true), &JobDemand::new(true)));
}

/// The AM's round asks with the task's own wait; `plan` places the task where it goes once
/// the wait ends and says the AM waits first.
#[test]
fn the_round_waits_per_task_and_plan_shows_the_wait() {
    let j = job(vec![role("w", 1, res(1, 1000, 2))]);
    let s = selector(vec![pcie4_node("split", 0b0101)]);
    let mut round = placement::PlacementRound::new(&j, |_, _| TaskSlot::Waiting {
        ready: true,
        topology_wait: true,
    });
    let t = round.next_task().unwrap();
    assert!(matches!(round.place(&s, t).selection.outcome, Outcome::NotNow { .. }));
    let plan = plan_job(&s, &j);
    assert_eq!(plan.placements.len(), 1);
    assert_eq!(plan.placements[0].gpus, vec![1, 3]);
    assert_eq!(plan.placements[0].topology_wait_sec, Some(300));
    // (How `gpuam plan` prints it: cli::plan::tests.)
    // Nothing held by others: no wait in the plan either.
    let plan = plan_job(&selector(vec![pcie4_node("free", 0)]), &j);
    assert_eq!(plan.placements[0].topology_wait_sec, None);
}

/// The wait's kind comes from the outcome, one row per cause: a full cluster is
/// `Resources`, the topology wait `Topology` (with its detail), a task no node can ever take
/// `Impossible`, a placement no reason.
#[test]
fn the_outcome_gives_the_kind_of_the_wait() {
    use crate::reason::Kind;
    let split = selector(vec![pcie4_node("split", 0b0101)]);
    let full = selector(vec![node("full", "/r", 2, 0b11)]);
    let roomy = selector(vec![node("roomy", "/r", 8, 0)]);
    let two = res(1, 1000, 2);
    let nine = res(1, 1000, 9);
    let demand = JobDemand::new(true);
    let cases: [(&Selector, TaskAsk<'_>, Option<Kind>, &str); 5] = [
        (
            &split,
            ask(&two).with_topology_wait(true),
            Some(Kind::Topology),
            "holding out for 2 GPUs of tier 1",
        ),
        (&split, ask(&two), None, ""),
        (
            &full,
            ask(&two),
            Some(Kind::Resources),
            "stage resources dropped all 1 remaining nodes",
        ),
        (
            &roomy,
            ask(&nine),
            Some(Kind::Impossible),
            "can never fit this cluster: no node has that many GPUs",
        ),
        (&roomy, ask(&two), None, ""),
    ];
    for (s, a, kind, detail) in cases {
        let why = s.select(&a, &demand).outcome.wait_reason();
        assert_eq!(why.as_ref().map(|r| r.kind), kind, "{why:?}");
        let got = why.map(|r| r.detail).unwrap_or_default();
        assert!(got.starts_with(detail), "{got}");
    }
}

/// Issue 27, criteria 6 and 9b: a node that offers a set at the machine's best pair weight
/// wins over packing; when no node does, packing (best fit, then free GPUs) wins over the
/// weight of the leftovers.
#[test]
fn an_ideal_weight_set_beats_packing_and_below_it_packing_beats_the_weight() {
    let t = Arc::new(crate::topology::Topology::preset("pcie8").unwrap());
    let on = |host: &str, used: u64| {
        let mut n = node(host, "/r", 8, used);
        n.topology = Some(t.clone());
        n
    };
    let r = res(8, 1000, 4);
    // "whole" has socket 1 (GPUs 4–7) free, W 48 = W*(4), and GPU 0 (5 free); "pairs" has
    // PIX pairs {0,1} and {4,5} free in different sockets (4 free, W 40).
    let whole = on("whole", 0b0000_1110);
    let pairs = on("pairs", 0b1100_1100);
    let s = selector(vec![whole, pairs]);
    let p = placed(&s.select(&ask(&r), &JobDemand::new(true))).clone();
    assert_eq!((p.host.as_str(), p.resources.gpu_mask), ("whole", 0b1111_0000));
    // No socket free anywhere: "pairs5" has {0,1}, {4,5} and GPU 2 free (best W 40, leaves
    // GPU 2 alone); "spread" has one GPU per switch free (W 28, nothing left). The old order
    // took the better-linked leftovers and broke "pairs5" for the next 8- or 4-GPU job.
    let pairs5 = on("pairs5", 0b1100_1000);
    let spread = on("spread", 0b1010_1010);
    let s = selector(vec![pairs5, spread]);
    let sel = s.select(&ask(&r), &JobDemand::new(true));
    let p = placed(&sel).clone();
    assert_eq!((p.host.as_str(), p.resources.gpu_mask), ("spread", 0b0101_0101));
    let alt = sel.trace.alternative.as_ref().expect("a runner-up");
    assert_eq!(alt.host, "pairs5");
    assert!(alt.lost_on.starts_with("free GPUs left beside it"), "{}", alt.lost_on);
}

/// Queue pressure (issue 27, "Packing first while others wait"): while other jobs wait, a
/// fuller node whose pair breaks no NVLink group beats an ideal-weight set on an emptier
/// node of the same tier; with nobody waiting the ideal weight wins; the tier is never
/// traded for packing.
#[test]
fn while_others_wait_packing_beats_the_ideal_weight_but_never_the_tier() {
    let t = Arc::new(crate::topology::Topology::preset("dgx1v").unwrap());
    let pairs: Vec<u64> = (0..8u32)
        .flat_map(|i| (i + 1..8).map(move |j| (1u64 << i) | (1u64 << j)))
        .collect();
    let best = pairs.iter().map(|&p| (t.tier(p), t.weight(p))).max().unwrap();
    // A pair of the best tier below the best weight (an NV1 pair), and one of a lower tier.
    let weaker = *pairs
        .iter()
        .find(|&&p| t.tier(p) == best.0 && t.weight(p) < best.1)
        .expect("an NV1 pair");
    let lower = *pairs
        .iter()
        .find(|&&p| t.tier(p) < best.0)
        .expect("a pair without NVLink");
    let on = |host: &str, free: u64| {
        let mut n = node(host, "/r", 8, 0xff & !free);
        n.topology = Some(t.clone());
        n
    };
    let r = res(8, 1000, 2);
    let pick = |nodes: Vec<Node>, others_wait: bool| {
        let s = selector(nodes);
        s.set_others_wait(others_wait);
        let sel = s.select(&ask(&r), &JobDemand::new(true));
        let p = placed(&sel).clone();
        (p.host, p.resources.gpu_mask, sel.trace.alternative.map(|a| a.lost_on))
    };
    // "empty" offers an ideal pair (8 free); "full" only the weaker pair (2 free).
    let (host, mask, _) = pick(vec![on("empty", 0xff), on("full", weaker)], false);
    assert_eq!(host, "empty", "nobody waits: the ideal weight wins");
    assert_eq!((t.tier(mask), t.weight(mask)), best);
    let (host, mask, lost) = pick(vec![on("empty", 0xff), on("full", weaker)], true);
    assert_eq!((host.as_str(), mask), ("full", weaker), "others wait: packing wins");
    let lost = lost.expect("a runner-up");
    assert!(lost.contains("while other jobs wait"), "{lost}");
    // A fuller node whose pair is of a lower tier never wins, waiting or not.
    for others_wait in [false, true] {
        let (host, _, _) = pick(vec![on("empty", 0xff), on("full", lower)], others_wait);
        assert_eq!(host, "empty", "others wait: {others_wait}");
    }
}

/// While other jobs wait, packing still breaks no NVLink island more than needed: on
/// `nvbridge8x` (NV12 bridges 0–2, 1–3, 4–6, 5–7) a 1-GPU task takes the lone GPU 1 of a
/// node with 3 free GPUs over one GPU of the whole bridged pair of a node with 2 free (which
/// would leave its partner alone for the next 2-GPU task, a lower tier).
#[test]
fn while_others_wait_packing_keeps_nvlink_pairs_whole() {
    let t = Arc::new(crate::topology::Topology::preset("nvbridge8x").unwrap());
    let on = |host: &str, free: u64| {
        let mut n = node(host, "/r", 8, 0xff & !free);
        n.topology = Some(t.clone());
        n
    };
    let r = res(8, 1000, 1);
    let s = selector(vec![on("pair", 0b0000_0101), on("lone", 0b0101_0010)]);
    s.set_others_wait(true);
    let sel = s.select(&ask(&r), &JobDemand::new(true));
    let p = placed(&sel).clone();
    assert_eq!(
        (p.host.as_str(), p.resources.gpu_mask),
        ("lone", 0b10),
        "{}",
        sel.trace.render()
    );
    let lost = sel.trace.alternative.expect("a runner-up").lost_on;
    assert!(
        lost.starts_with("free GPUs left beside it in its NVLink group"),
        "{lost}"
    );
}

/// The view's GPU types are counted from the index's buckets, up to the bound asked.
#[test]
fn the_views_gpu_types_are_counted_up_to_a_bound() {
    let typed = |host: &str, ty: Option<&str>| {
        let mut n = node(host, "/r", 8, 0);
        n.gpu_type = ty.map(String::from);
        n
    };
    let one = Selector::new(
        ClusterView::new([typed("a", Some("V100")), typed("b", Some("V100")), typed("c", None)]),
        SelectSettings::default(),
    );
    assert_eq!(one.gpu_types(5), 1);
    let three = Selector::new(
        ClusterView::new([
            typed("a", Some("V100")),
            typed("b", Some("A100")),
            typed("c", Some("H100")),
        ]),
        SelectSettings::default(),
    );
    assert_eq!(three.gpu_types(5), 3);
    assert_eq!(three.gpu_types(2), 2);
    let none = Selector::new(ClusterView::new([typed("c", None)]), SelectSettings::default());
    assert_eq!(none.gpu_types(5), 0);
}

/// The drain term (issue 27, fifth round): a task that declares its run time goes where its
/// end adds least to the time its node is whole again — beside work that ends after it
/// rather than onto an emptier node or one whose work ends soon — after the tiers and best
/// fit; without a declared time, or without the selector's clock, the order is as before;
/// and it never buys a worse tier.
#[test]
fn a_task_that_declares_its_run_time_goes_where_work_ends_after_it() {
    let t = Arc::new(crate::topology::Topology::preset("pcie8").unwrap());
    let hour = 3_600_000u64;
    let now = 100 * hour;
    // Each node holds GPUs 0-3 (one socket): GPUs 4-7, an ideal 4-set, are free on both.
    let on = |host: &str, used: u64, drain: Option<u64>| {
        let mut n = node(host, "/r", 8, used);
        n.topology = Some(t.clone());
        n.drain_by_ms = drain;
        n
    };
    let nodes = || {
        vec![
            on("soon", 0x0f, Some(now + hour / 6)),
            on("later", 0x0f, Some(now + 2 * hour)),
            on("idle", 0, Some(0)),
        ]
    };
    let r = res(8, 1000, 4);
    let pick = |nodes: Vec<Node>, run: Option<u64>, clock: bool| {
        let s = selector(nodes);
        if clock {
            s.set_clock(now);
        }
        let a = TaskAsk {
            max_run_sec: run,
            ..ask(&r)
        };
        let sel = s.select(&a, &JobDemand::new(false));
        let p = placed(&sel).clone();
        (p.host, sel.trace.alternative.map(|a| a.lost_on))
    };
    // One hour: ends before "later" drains (adds 0 min) — "soon" would add 50, "idle" 60.
    let (host, lost) = pick(nodes(), Some(3600), true);
    assert_eq!(host, "later");
    let lost = lost.expect("a runner-up");
    assert!(lost.contains("draining"), "{lost}");
    // Three hours: "later" adds 60 min, "soon" 170, "idle" 180.
    assert_eq!(pick(nodes(), Some(3 * 3600), true).0, "later");
    // No declared time, or no clock: the order without the term (here the packing's tie
    // among the equally full "soon" and "later" by the seeded tie-break, never "idle").
    for (run, clock) in [(None, true), (Some(3600), false)] {
        let (host, _) = pick(nodes(), run, clock);
        assert_ne!(host, "idle", "run {run:?}, clock {clock}");
    }
    // A node whose drain is unknown (a container declared no limit) adds 0.
    let (host, _) = pick(
        vec![on("unknown", 0x0f, None), on("later", 0x0f, Some(now + hour / 2))],
        Some(3600),
        true,
    );
    assert_eq!(host, "unknown");
    // Nodes alike but for their CPU (one bucket of the index, walked least free CPU first):
    // the one that drains best is the last the walk reaches, and is still found.
    let alike: Vec<Node> = (0..12u32)
        .map(|i| {
            let mut n = on(&format!("alike-{i:02}"), 0x0f, Some(now + hour / 6));
            n.set_used(Resources::with_mask(40 - i, 8192, 0x0f, PortSet::new()));
            if i == 11 {
                n.drain_by_ms = Some(now + 2 * hour);
            }
            n
        })
        .collect();
    assert_eq!(pick(alike.clone(), Some(3600), true).0, "alike-11");
    assert_ne!(
        pick(alike, None, true).0,
        "alike-11",
        "without the term, least free CPU first"
    );
    // The tier first: a node that would drain best but offers only a split 4-set loses.
    let split = on("split", 0b1010_1010, Some(now + 10 * hour));
    let (host, _) = pick(vec![split, on("idle", 0, Some(0))], Some(3600), true);
    assert_eq!(host, "idle", "a worse tier is never bought by draining");
}
