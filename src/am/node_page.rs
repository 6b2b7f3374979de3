//! The dashboard's node pages from the AM's live node view (the selector's): each node
//! turned into a [`NodeStatus`] only when a page that shows it is asked for (issue 29).

use std::collections::HashMap;
use std::sync::Arc;

use crate::am::status::{page_of, NodeSource, NodeStatus};
use crate::resources::{mask_hex, GpuMask};
use crate::select::Selector;
use crate::topology::Topology;

/// The AM's node view as a [`NodeSource`].
pub struct ViewNodes(pub Arc<Selector>);

impl NodeSource for ViewNodes {
    fn page(
        &self,
        host: Option<&str>,
        offset: usize,
        limit: usize,
        job_gpus: &HashMap<String, GpuMask>,
    ) -> (usize, Vec<NodeStatus>) {
        self.0.with_view(|v| {
            let mut groups = GroupsOf::default();
            let matching = v.nodes().filter(|n| host.is_none_or(|h| n.host.contains(h)));
            let (total, page) = page_of(matching, offset, limit);
            let page = page
                .into_iter()
                .map(|n| node_status(n, job_gpus, &mut groups))
                .collect();
            (total, page)
        })
    }
}

/// The GPU groups of each topology met in one report, by its `Arc` (held, so no other
/// topology can take its address): the nodes of a listing share their topology's `Arc`,
/// so a page computes each topology's groups once, not per node.
#[derive(Default)]
struct GroupsOf(Vec<(Arc<Topology>, Groups)>);

/// A topology's GPU islands per tier, best tier first, as hex masks ([`NodeStatus::gpu_groups`]).
type Groups = Arc<Vec<Vec<String>>>;

impl GroupsOf {
    fn of(&mut self, t: &Arc<Topology>) -> Groups {
        if let Some((_, g)) = self.0.iter().find(|(k, _)| Arc::ptr_eq(k, t)) {
            return g.clone();
        }
        let g: Groups = Arc::new(
            (0..=2u8)
                .rev()
                .map(|tier| t.islands(tier).into_iter().map(mask_hex).collect())
                .collect(),
        );
        // A handful of topologies in a cluster; past that, computed per node as before.
        if self.0.len() < 64 {
            self.0.push((t.clone(), g.clone()));
        }
        g
    }
}

/// A node of the view as the dashboard shows it.
fn node_status(n: &crate::cluster::Node, job_gpus: &HashMap<String, GpuMask>, groups: &mut GroupsOf) -> NodeStatus {
    let groups = match &n.topology {
        Some(t) => groups.of(t),
        None => Arc::default(),
    };
    NodeStatus {
        host: n.host.clone(),
        rack: n.rack.clone(),
        labels: n.labels.clone(),
        gpu_type: n.gpu_type.clone(),
        state: format!("{:?}", n.state).to_uppercase(),
        topology: n.topology.as_ref().map(|t| t.name().to_string()),
        gpu_count: n.total().gpu_count(),
        gpu_groups: groups,
        total_cpu: n.total().cpu,
        used_cpu: n.used().cpu,
        requested_cpu: n.requested().cpu,
        free_cpu: n.free().cpu,
        total_memory_mb: n.total().memory_mb,
        used_memory_mb: n.used().memory_mb,
        requested_memory_mb: n.requested().memory_mb,
        free_memory_mb: n.free().memory_mb,
        total_gpu_mask: mask_hex(n.total().gpu_mask),
        used_gpu_mask: mask_hex(n.used().gpu_mask),
        requested_gpu_mask: mask_hex(n.requested().gpu_mask),
        free_gpu_mask: mask_hex(n.free().gpu_mask),
        job_gpu_mask: mask_hex(job_gpus.get(&n.host).copied().unwrap_or(0)),
        total_ports: n.total().ports.to_string(),
        used_ports: n.used().ports.to_string(),
        free_ports: n.free().ports.to_string(),
        used_gpu_shares: n.used().gpu_shares.clone(),
        custom_resources: n.total().custom.clone(),
        used_custom_resources: n.used().custom.clone(),
        free_custom_resources: n.free().custom.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{ClusterView, Node};
    use crate::resources::{PortSet, Resources};

    fn pages() -> ViewNodes {
        let nodes = ["gpu-1", "gpu-2", "cpu-1", "gpu-10"].map(|h| {
            let mut n = Node::new(
                h,
                "/r",
                Resources::with_mask(8, 8000, 0xff, PortSet::parse("9000-9009").unwrap()),
            );
            n.topology = Topology::preset("dgx1v").map(Arc::new);
            n
        });
        ViewNodes(Arc::new(Selector::new(ClusterView::new(nodes), Default::default())))
    }

    #[test]
    fn a_page_is_the_matching_nodes_in_host_order_from_its_offset() {
        let p = pages();
        let hosts =
            |(total, page): (usize, Vec<NodeStatus>)| (total, page.into_iter().map(|n| n.host).collect::<Vec<_>>());
        let none = HashMap::new();
        assert_eq!(
            hosts(p.page(None, 0, 10, &none)),
            (4, vec!["cpu-1".into(), "gpu-1".into(), "gpu-10".into(), "gpu-2".into()])
        );
        assert_eq!(hosts(p.page(Some("gpu"), 1, 1, &none)), (3, vec!["gpu-10".into()]));
        assert_eq!(hosts(p.page(Some("gpu"), 5, 10, &none)), (3, vec![]));
        assert_eq!(hosts(p.page(Some("tpu"), 0, 10, &none)), (0, vec![]));
    }

    #[test]
    fn a_page_shows_the_jobs_gpus_and_each_topologys_groups() {
        let p = pages();
        let job = HashMap::from([("gpu-2".to_string(), 0x3)]);
        let (_, page) = p.page(None, 0, 10, &job);
        let of = |h: &str| page.iter().find(|n| n.host == h).unwrap();
        assert_eq!(of("gpu-2").job_gpu_mask, "0x3");
        assert_eq!(of("gpu-1").job_gpu_mask, "0x0");
        assert_eq!(of("gpu-1").total_ports, "9000-9009");
        // One topology: its groups computed once and shared by the page's nodes.
        assert!(!of("gpu-1").gpu_groups.is_empty());
        assert!(Arc::ptr_eq(&of("gpu-1").gpu_groups, &of("cpu-1").gpu_groups));
    }

    /// The job's GPUs per host, from its published tasks, are what the demo's node view
    /// shows (the demo computes them from its placements, not from the tasks).
    #[test]
    fn the_jobs_gpus_come_from_the_tasks_that_hold_containers() {
        let hub = crate::web::demo::demo_hub(40, 12);
        let (tasks, nodes) = hub.read(|s| (s.tasks.clone(), s.nodes.clone()));
        let job = crate::am::status::job_gpus(&tasks);
        assert!(!job.is_empty());
        for n in &nodes {
            let shown = crate::resources::parse_mask(&n.job_gpu_mask).unwrap();
            assert_eq!(job.get(&n.host).copied().unwrap_or(0), shown, "{}", n.host);
        }
    }
}
