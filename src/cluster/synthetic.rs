//! A synthetic cluster for benchmarks and tests: many uniform 8-GPU nodes, half their GPUs
//! in use at random (seeded), so that placement has real choices to make. No I/O.

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::cluster::Node;
use crate::resources::{PortSet, Resources};
use crate::topology::Topology;

/// N nodes of 64 CPU, 256000 MB, 8 GPUs (pcie8 topology), ports 20000–29999, 40
/// nodes a rack; each GPU used with probability ½, 4 CPU and 8192 MB used per used GPU.
pub fn bench_cluster(n: usize, seed: u64) -> Vec<Node> {
    let mut rng = StdRng::seed_from_u64(seed);
    let topo = Topology::preset("pcie8").map(Arc::new);
    (0..n)
        .map(|i| {
            let mut node = Node::new(
                format!("node{i:05}"),
                format!("/rack{:03}", i / 40),
                Resources::with_mask(64, 256_000, 0xff, PortSet::range(20000, 29999)),
            );
            node.topology = topo.clone();
            node.gpu_type = Some("V100".into());
            let used: u64 = (0..8).filter(|_| rng.gen_bool(0.5)).fold(0, |m, b| m | (1 << b));
            let k = used.count_ones();
            node.set_used(Resources::with_mask(4 * k, 8192 * u64::from(k), used, PortSet::new()));
            node
        })
        .collect()
}
