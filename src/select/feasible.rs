//! The one rule for "may this task use this node" (issue 25), answered *fits*, *not now*
//! or *never* with a typed reason. No I/O, no state.
//!
//! Used by the select pipeline's node filters (`stages.rs`, per index bucket), its "can
//! never fit" reasons (`select::impossible_reason`), and the RM's queue gate and
//! preemption (`rm::scheduler::eligible` and its scratch fits), so the RM never keeps or
//! frees room that placement cannot use.
//!
//! The parts, in the pipeline's stage order (the first that says no is the reason):
//! 1. the node RUNNING (*not now* otherwise: a node comes back);
//! 2. its partition is the task's (a task without a label belongs to the unlabelled
//!    partition, as in YARN);
//! 3. its GPU type is among the task's (when the task names any; a node without a type
//!    matches none);
//! 4. the none-GPU rule: a job asking no GPU keeps off GPU nodes unless
//!    `select.allow_none_gpu_job_on_gpu_node`;
//! 5. what fits: THE shortfall rule ([`Resources::shortfalls`]: GPUs with shares and mask,
//!    CPU, memory, custom resources, concrete and dynamic ports), against the node's total
//!    (*never*) and against what is free (*not now*);
//! 6. one GPU type per gang (issue 27): how many tasks a node's total could hold at once
//!    ([`copies`]), summed over the nodes of one GPU type, says whether that type could
//!    ever hold a whole gang (`select::one_type` chooses the type and refuses a gang no
//!    single type can hold).

use crate::resources::{Resources, Shortfall};

/// Why a task may not use a node (now or ever).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// The node is not RUNNING.
    NotRunning,
    /// The node is in a labelled partition; the task asks for none.
    LabelledNode,
    /// The node is not in the task's partition.
    OtherPartition,
    /// The node's GPU type is not among those asked for.
    GpuType,
    /// A GPU node, kept for GPU jobs.
    NoneGpu,
    /// What the task asks does not fit (in what is free, or in the node's total).
    Short(Shortfall),
}

impl Why {
    /// The reason as the select trace groups it.
    pub fn reason(self) -> &'static str {
        match self {
            Why::NotRunning => "node is not RUNNING",
            Why::LabelledNode => "node is in a labelled partition; the task asks for none",
            Why::OtherPartition => "node is not in the task's label partition",
            Why::GpuType => "GPU type not among those asked for",
            Why::NoneGpu => "GPU node kept for GPU jobs (allow_none_gpu_job_on_gpu_node is off)",
            Why::Short(s) => s.reason(),
        }
    }
}

/// The rule's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Fits,
    /// Not now; it may later (the node comes back, resources are released).
    NotNow(Why),
    /// Never, even on this node empty.
    Never(Why),
}

/// What the rule knows of a node apart from its resources (the same for every node of
/// a select index bucket).
#[derive(Clone, Copy, Debug)]
pub struct NodeFacts<'a> {
    pub running: bool,
    /// The node's partition (first label, trimmed; "" = none).
    pub partition: &'a str,
    pub gpu_type: Option<&'a str>,
    pub total_gpus: u32,
}

impl<'a> NodeFacts<'a> {
    /// The facts of one node.
    pub fn of(n: &'a crate::cluster::Node) -> Self {
        NodeFacts {
            running: n.state == crate::cluster::NodeState::Running,
            partition: n.partition(),
            gpu_type: n.gpu_type.as_deref(),
            total_gpus: n.total().gpu_count(),
        }
    }
}

/// What the rule knows of a task apart from its request.
#[derive(Clone, Copy, Debug)]
pub struct TaskFacts<'a> {
    /// Its partition (its label, trimmed; "" = the unlabelled partition).
    pub partition: &'a str,
    /// Acceptable GPU types; empty = any.
    pub gpu_types: &'a [String],
    /// The none-GPU rule applies: the job asks no GPU and
    /// `select.allow_none_gpu_job_on_gpu_node` is off.
    pub keep_off_gpu_nodes: bool,
}

impl<'a> TaskFacts<'a> {
    /// The facts of a task labelled `label` (trimmed here) accepting `gpu_types`.
    pub fn new(label: Option<&'a str>, gpu_types: &'a [String], keep_off_gpu_nodes: bool) -> Self {
        TaskFacts {
            partition: label.map(str::trim).unwrap_or(""),
            gpu_types,
            keep_off_gpu_nodes,
        }
    }
}

/// What the task asks of a node's resources: the request (concrete ports included) and
/// how many more ports it draws at or above `min_port`.
#[derive(Clone, Copy, Debug)]
pub struct Ask<'a> {
    pub request: &'a Resources,
    pub dynamic_ports: u32,
    pub min_port: u16,
}

impl Ask<'_> {
    /// The first dimension in which the ask does not fit `avail` (the shortfall rule).
    #[inline]
    pub fn shortfall(&self, avail: &Resources) -> Option<Shortfall> {
        self.request
            .shortfall_with_dynamic(avail, self.dynamic_ports, self.min_port)
    }
}

/// Rule 1: the node takes containers now.
#[inline]
pub fn running(n: &NodeFacts<'_>) -> Result<(), Why> {
    if n.running {
        Ok(())
    } else {
        Err(Why::NotRunning)
    }
}

/// Rule 2: the node is in the task's partition.
#[inline]
pub fn partition(t: &TaskFacts<'_>, n: &NodeFacts<'_>) -> Result<(), Why> {
    if n.partition == t.partition {
        Ok(())
    } else if t.partition.is_empty() {
        Err(Why::LabelledNode)
    } else {
        Err(Why::OtherPartition)
    }
}

/// Rule 3: the node's GPU type is among those asked for.
#[inline]
pub fn gpu_type(t: &TaskFacts<'_>, n: &NodeFacts<'_>) -> Result<(), Why> {
    match n.gpu_type {
        _ if t.gpu_types.is_empty() => Ok(()),
        Some(ty) if t.gpu_types.iter().any(|w| w == ty) => Ok(()),
        _ => Err(Why::GpuType),
    }
}

/// Rule 4: a job without GPUs keeps off GPU nodes (when the setting says so).
#[inline]
pub fn none_gpu(t: &TaskFacts<'_>, n: &NodeFacts<'_>) -> Result<(), Why> {
    if !t.keep_off_gpu_nodes || n.total_gpus == 0 {
        Ok(())
    } else {
        Err(Why::NoneGpu)
    }
}

/// Rules 2–4: the ones no release of resources changes.
#[inline]
pub fn placeable(t: &TaskFacts<'_>, n: &NodeFacts<'_>) -> Result<(), Why> {
    partition(t, n)?;
    gpu_type(t, n)?;
    none_gpu(t, n)
}

/// Rule 5 alone: `Never` when the ask does not fit the node's `total`, `NotNow` when it
/// does not fit what is `free`.
#[inline]
pub fn room(ask: &Ask<'_>, free: &Resources, total: &Resources) -> Verdict {
    match ask.shortfall(free) {
        None => Verdict::Fits,
        Some(now) => match ask.shortfall(total) {
            Some(ever) => Verdict::Never(Why::Short(ever)),
            None => Verdict::NotNow(Why::Short(now)),
        },
    }
}

/// May the task use the node: every rule, in order.
pub fn judge(t: &TaskFacts<'_>, n: &NodeFacts<'_>, ask: &Ask<'_>, free: &Resources, total: &Resources) -> Verdict {
    if let Err(why) = placeable(t, n) {
        return Verdict::Never(why);
    }
    if let Some(s) = ask.shortfall(total) {
        return Verdict::Never(Why::Short(s));
    }
    if let Err(why) = running(n) {
        return Verdict::NotNow(why);
    }
    room(ask, free, total)
}

/// Could the task ever use the node (rules 2–5 against its total; a node not RUNNING
/// may come back).
pub fn ever(t: &TaskFacts<'_>, n: &NodeFacts<'_>, ask: &Ask<'_>, total: &Resources) -> Result<(), Why> {
    placeable(t, n)?;
    match ask.shortfall(total) {
        Some(s) => Err(Why::Short(s)),
        None => Ok(()),
    }
}

/// Rule 6's count: at most how many tasks of `ask` a node of `total` resources could hold
/// at once (0 when not even one fits). An upper bound (it counts each dimension apart and
/// leaves custom resources out), so a type whose nodes sum to fewer copies than a gang has
/// tasks can never hold that gang.
pub fn copies(ask: &Ask<'_>, total: &Resources) -> u32 {
    if ask.shortfall(total).is_some() {
        return 0;
    }
    let r = ask.request;
    let per = |have: u64, want: u64| have.checked_div(want).unwrap_or(u64::MAX);
    let gpus = match r.gpu_share() {
        Some(h) => u64::from(total.gpu_count()) * per(100, u64::from(h)),
        None => per(u64::from(total.gpu_count()), u64::from(r.gpus)),
    };
    let static_ports = if r.ports.is_empty() { u64::MAX } else { 1 };
    let dynamic = per(
        u64::from(total.ports.count_at_least(ask.min_port)),
        u64::from(ask.dynamic_ports),
    );
    let n = gpus
        .min(per(u64::from(total.cpu), u64::from(r.cpu)))
        .min(per(total.memory_mb, r.memory_mb))
        .min(static_ports)
        .min(dynamic);
    n.min(u64::from(u32::MAX)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::PortSet;

    fn node<'a>(partition: &'a str, gpu_type: Option<&'a str>, gpus: u32) -> NodeFacts<'a> {
        NodeFacts {
            running: true,
            partition,
            gpu_type,
            total_gpus: gpus,
        }
    }

    #[test]
    fn each_rule_answers_with_its_reason_in_stage_order() {
        let types = vec!["V100".to_string()];
        let t = TaskFacts::new(Some(" gold "), &types, false);
        assert_eq!(placeable(&t, &node("gold", Some("V100"), 4)), Ok(()));
        assert_eq!(placeable(&t, &node("", Some("K80"), 4)), Err(Why::OtherPartition));
        assert_eq!(placeable(&t, &node("gold", Some("K80"), 4)), Err(Why::GpuType));
        assert_eq!(placeable(&t, &node("gold", None, 4)), Err(Why::GpuType));
        let plain = TaskFacts::new(None, &[], true);
        assert_eq!(placeable(&plain, &node("gold", None, 0)), Err(Why::LabelledNode));
        assert_eq!(placeable(&plain, &node("", None, 4)), Err(Why::NoneGpu));
        assert_eq!(placeable(&plain, &node("", None, 0)), Ok(()));
        // A task without GPUs still keeps to the GPU types it names (select's rule).
        let typed_cpu = TaskFacts::new(None, &types, false);
        assert_eq!(placeable(&typed_cpu, &node("", Some("K80"), 4)), Err(Why::GpuType));
    }

    #[test]
    fn room_says_never_against_the_total_and_not_now_against_the_free() {
        let total = Resources::with_mask(8, 1024, 0b1111, PortSet::new());
        let free = Resources::with_mask(8, 1024, 0b0001, PortSet::new());
        let want = |gpus: u32| {
            let mut r = Resources::with_mask(2, 10, 0, PortSet::new());
            r.gpus = gpus;
            r
        };
        let ask = |r: &Resources| -> Verdict {
            let a = Ask {
                request: r,
                dynamic_ports: 0,
                min_port: 0,
            };
            room(&a, &free, &total)
        };
        assert_eq!(ask(&want(2)), Verdict::NotNow(Why::Short(Shortfall::Gpus)));
        assert_eq!(ask(&want(1)), Verdict::Fits);
        assert_eq!(ask(&want(5)), Verdict::Never(Why::Short(Shortfall::Gpus)));
        let t = TaskFacts::new(None, &[], false);
        let mut n = node("", None, 4);
        n.running = false;
        let (five, one) = (want(5), want(1));
        fn a(r: &Resources) -> Ask<'_> {
            Ask {
                request: r,
                dynamic_ports: 0,
                min_port: 0,
            }
        }
        assert_eq!(
            judge(&t, &n, &a(&five), &free, &total),
            Verdict::Never(Why::Short(Shortfall::Gpus))
        );
        assert_eq!(judge(&t, &n, &a(&one), &free, &total), Verdict::NotNow(Why::NotRunning));
        assert_eq!(ever(&t, &n, &a(&one), &total), Ok(()));
        // Dynamic ports count against what is free at or above the minimum.
        let ports_total = Resources::with_mask(8, 1024, 0, PortSet::range(100, 101));
        let two = Ask {
            request: &want(0),
            dynamic_ports: 3,
            min_port: 100,
        };
        assert_eq!(
            room(&two, &ports_total, &ports_total),
            Verdict::Never(Why::Short(Shortfall::DynamicPorts))
        );
    }

    #[test]
    fn copies_count_the_tightest_dimension_and_zero_when_one_does_not_fit() {
        let total = Resources::with_mask(10, 1000, 0xff, PortSet::range(100, 109));
        let ask = |r: &Resources, dynamic: u32| {
            copies(
                &Ask {
                    request: r,
                    dynamic_ports: dynamic,
                    min_port: 100,
                },
                &total,
            )
        };
        let two_gpus = Resources::with_count(1, 10, 2, PortSet::new());
        assert_eq!(ask(&two_gpus, 0), 4, "8 GPUs / 2");
        assert_eq!(
            ask(&Resources::with_count(3, 10, 1, PortSet::new()), 0),
            3,
            "10 CPU / 3"
        );
        assert_eq!(ask(&two_gpus, 3), 3, "10 ports / 3");
        assert_eq!(ask(&Resources::with_count(1, 10, 1, PortSet::range(100, 100)), 0), 1);
        assert_eq!(ask(&Resources::with_count(1, 10, 9, PortSet::new()), 0), 0);
        let quarter = Resources::request(1, 10, 1, 0, Some(25), PortSet::new(), Default::default());
        assert_eq!(ask(&quarter, 0), 10, "32 quarters, but 10 CPU");
    }
}
