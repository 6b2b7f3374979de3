//! How a Ray node describes itself to gpuam: the naming scheme of its custom resources and
//! labels, both ways (writing them for `ray start`, reading them back from Ray's node list).
//!
//! Owns, without I/O:
//! - resources: `gpuam-node-<host>` = 1 names the gpuam host of the Ray node (every job
//!   pinned there asks for 0.001 of it); `gpuam-gpu-<i>` = 1 per GPU index `i` (jobs ask for 1
//!   of each granted GPU, so Ray itself never runs two jobs on one GPU). Hyphens, not
//!   underscores: some Ray views camelCase underscores.
//! - labels: `gpuam.io/rack` (the rack path without its leading `/`, inner `/` written `.`),
//!   `gpuam.io/gpu-type`, `gpuam.io/ports` (port ranges joined by `_`), `gpuam.io/topology`
//!   (a preset name, `none`, or `matrix`), and for `matrix` the link classes of every GPU pair,
//!   one character a pair (see [`link_code`]), in chunks of up to 63 characters in
//!   `gpuam.io/topo-0`, `gpuam.io/topo-1`, … (a Ray label value holds at most 63 characters
//!   of `[A-Za-z0-9._-]`, so the text of `nvidia-smi topo -m` cannot be a label).
//! - [`node_from_ray`]: one entry of `GET /api/v0/nodes?detail=true` → a gpuam [`Node`]
//!   (ALIVE → RUNNING, anything else → LOST), and [`merge_by_host`] for a host that Ray
//!   lists more than once (a restarted node leaves its DEAD entry behind).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Deserialize;

use crate::cluster::{Node, NodeState};
use crate::resources::{CustomResources, GpuMask, PortSet, Resources};
use crate::topology::{Link, Topology, MAX_GPUS};

/// Prefix of the per-node resource; the rest is the gpuam host name.
pub const NODE_RESOURCE_PREFIX: &str = "gpuam-node-";
/// Prefix of the per-GPU resources; the rest is the GPU index.
pub const GPU_RESOURCE_PREFIX: &str = "gpuam-gpu-";
/// How much of the node resource a job asks for (many jobs share a node).
pub const NODE_RESOURCE_SHARE: f64 = 0.001;
pub const LABEL_RACK: &str = "gpuam.io/rack";
pub const LABEL_GPU_TYPE: &str = "gpuam.io/gpu-type";
pub const LABEL_PORTS: &str = "gpuam.io/ports";
pub const LABEL_TOPOLOGY: &str = "gpuam.io/topology";
/// Chunk `k` of a matrix topology is `gpuam.io/topo-<k>`.
pub const LABEL_TOPO_CHUNK: &str = "gpuam.io/topo-";
/// `gpuam.io/topology` value saying the matrix follows in the chunk labels.
pub const TOPOLOGY_MATRIX: &str = "matrix";
/// Longest Ray label value.
pub const MAX_LABEL_VALUE: usize = 63;
/// Rack of a Ray node without a rack label.
pub const DEFAULT_RACK: &str = "/default-rack";
/// Ports of a node, when `gpuam ray-node-args` is not told otherwise.
pub const DEFAULT_PORTS: &str = "20000-29999";

/// The resource naming a host.
pub fn node_resource(host: &str) -> String {
    format!("{NODE_RESOURCE_PREFIX}{host}")
}

/// The resource naming GPU `i`.
pub fn gpu_resource(i: u32) -> String {
    format!("{GPU_RESOURCE_PREFIX}{i}")
}

/// Checks a gpuam host name for use in a Ray resource name and label: 1–63 characters of
/// `A-Z a-z 0-9 . _ -`, starting and ending with a letter or digit.
pub fn check_host(host: &str) -> Result<(), String> {
    if is_label_value(host) {
        Ok(())
    } else {
        Err(format!(
            "host `{host}`: use 1-{MAX_LABEL_VALUE} characters of A-Z, a-z, 0-9, `.`, `_`, `-`, starting and ending \
             with a letter or digit"
        ))
    }
}

/// True when Ray accepts `v` as a label value (`[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?`).
pub fn is_label_value(v: &str) -> bool {
    let b = v.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_LABEL_VALUE
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || b"._-".contains(c))
}

/// The rack's label value: `/dc1/r7` → `dc1.r7`. Racks with `.` cannot be written.
pub fn encode_rack(rack: &str) -> Result<String, String> {
    let v = rack.trim_start_matches('/').replace('/', ".");
    if rack.contains('.') || !is_label_value(&v) {
        return Err(format!(
            "rack `{rack}`: write a path like /dc1/rack7 of letters, digits, `_` and `-` (no `.`), at most \
             {MAX_LABEL_VALUE} characters"
        ));
    }
    Ok(v)
}

/// The inverse of [`encode_rack`].
pub fn decode_rack(v: &str) -> String {
    format!("/{}", v.replace('.', "/"))
}

/// One character per link class: `NV1`..`NV26` → `A`..`Z`, PIX `x`, PXB `b`, PHB `h`,
/// NODE `n`, SYS `s`. `None` for more than 26 bonded NVLinks (no GPU has that many).
pub fn link_code(link: Link) -> Option<char> {
    Some(match link {
        Link::Nv(m) if (1..=26).contains(&m) => char::from(b'A' + (m - 1)),
        Link::Nv(_) => return None,
        Link::Pix => 'x',
        Link::Pxb => 'b',
        Link::Phb => 'h',
        Link::Node => 'n',
        Link::Sys => 's',
    })
}

/// The inverse of [`link_code`].
pub fn link_of_code(c: char) -> Option<Link> {
    Some(match c {
        'A'..='Z' => Link::Nv(c as u8 - b'A' + 1),
        'x' => Link::Pix,
        'b' => Link::Pxb,
        'h' => Link::Phb,
        'n' => Link::Node,
        's' => Link::Sys,
        _ => return None,
    })
}

/// The labels that describe a topology: `[("gpuam.io/topology", preset|none|matrix), chunks…]`.
/// A topology whose name is a preset is written as its name.
pub fn topology_labels(topo: Option<&Topology>) -> Result<Vec<(String, String)>, String> {
    let Some(t) = topo else {
        return Ok(vec![(LABEL_TOPOLOGY.into(), "none".into())]);
    };
    if Topology::preset(t.name()).is_some_and(|p| p == *t) {
        return Ok(vec![(LABEL_TOPOLOGY.into(), t.name().into())]);
    }
    let n = t.gpu_count();
    let mut code = String::new();
    for a in 0..n {
        for b in a + 1..n {
            let link = t.link(a, b);
            code.push(link_code(link).ok_or_else(|| format!("GPU{a}-GPU{b}: {link} has too many NVLinks to encode"))?);
        }
    }
    let mut out = vec![(LABEL_TOPOLOGY.into(), TOPOLOGY_MATRIX.into())];
    let chars: Vec<char> = code.chars().collect();
    for (k, chunk) in chars.chunks(MAX_LABEL_VALUE).enumerate() {
        out.push((format!("{LABEL_TOPO_CHUNK}{k}"), chunk.iter().collect()));
    }
    Ok(out)
}

/// Reads a topology back from a node's labels for a node of `gpus` GPUs. `Ok(None)`: no
/// topology (label absent or `none`).
pub fn topology_from_labels(labels: &BTreeMap<String, String>, gpus: u32) -> Result<Option<Topology>, String> {
    let Some(kind) = labels.get(LABEL_TOPOLOGY) else {
        return Ok(None);
    };
    if kind != TOPOLOGY_MATRIX {
        return Topology::from_spec(kind).map_err(|e| format!("label {LABEL_TOPOLOGY}: {e}"));
    }
    let mut code = String::new();
    for k in 0.. {
        match labels.get(&format!("{LABEL_TOPO_CHUNK}{k}")) {
            Some(chunk) => code.push_str(chunk),
            None => break,
        }
    }
    let pairs = (gpus as usize) * (gpus as usize).saturating_sub(1) / 2;
    let links: Vec<Link> = code
        .chars()
        .map(|c| link_of_code(c).ok_or_else(|| format!("label {LABEL_TOPO_CHUNK}*: `{c}` is not a link code")))
        .collect::<Result<_, _>>()?;
    if links.len() != pairs {
        return Err(format!(
            "labels {LABEL_TOPO_CHUNK}*: {} link codes for {gpus} GPUs, which have {pairs} pairs",
            links.len()
        ));
    }
    // Pair (a, b), a < b, is at index a·n − a(a+1)/2 + (b − a − 1).
    let n = gpus as usize;
    let at = |a: usize, b: usize| {
        let (a, b) = (a.min(b), a.max(b));
        links[a * n - a * (a + 1) / 2 + (b - a - 1)]
    };
    Topology::new("custom", gpus, |a, b| at(a as usize, b as usize))
        .map(Some)
        .map_err(|e| e.to_string())
}

/// What an operator tells `gpuam ray-node-args` about one machine.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeDescription {
    pub host: String,
    pub gpus: u32,
    pub topology: Option<Topology>,
    pub rack: Option<String>,
    pub gpu_type: Option<String>,
    pub ports: PortSet,
    /// Custom resources offered (`--resource nvme=2`), Ray custom resources of the same name.
    pub custom: CustomResources,
}

/// Ray's own resources (and prefixes), never read as gpuam custom resources.
const RAY_BUILT_IN: &[&str] = &["CPU", "GPU", "memory", "object_store_memory"];

/// The custom resources of a Ray node as gpuam sees them: every resource whose name is a
/// gpuam resource name (no `node:…`, `accelerator_type:…`), that is not one of Ray's own
/// (CPU, GPU, memory, object_store_memory) or gpuam's scheme (`gpuam-…`), in whole units
/// (a fractional total is rounded down).
pub fn custom_from_ray(resources_total: &BTreeMap<String, f64>) -> CustomResources {
    CustomResources::from_pairs(
        resources_total
            .iter()
            .filter(|(k, _)| !RAY_BUILT_IN.contains(&k.as_str()) && !k.starts_with("gpuam-"))
            .filter(|(k, _)| crate::resources::check_resource_name(k).is_ok())
            .map(|(k, v)| (k.clone(), if v.is_finite() && *v > 0.0 { v.floor() as u64 } else { 0 })),
    )
}

/// The extra `ray start` arguments for a node: `--num-gpus=0`, `--resources=JSON` (the node
/// resource and one per GPU) and `--labels=k=v,...`, each one shell word.
pub fn ray_start_args(d: &NodeDescription) -> Result<Vec<String>, String> {
    check_host(&d.host)?;
    if d.gpus > MAX_GPUS {
        return Err(format!("--gpus {}: at most {MAX_GPUS} GPUs per node", d.gpus));
    }
    if let Some(t) = &d.topology {
        if t.gpu_count() != d.gpus {
            return Err(format!(
                "the topology describes {} GPUs but the node has {}: give --gpus {} or another --topology",
                t.gpu_count(),
                d.gpus,
                t.gpu_count()
            ));
        }
    }
    let mut resources = serde_json::Map::new();
    resources.insert(node_resource(&d.host), 1.into());
    for i in 0..d.gpus {
        resources.insert(gpu_resource(i), 1.into());
    }
    for (name, units) in d.custom.iter() {
        if RAY_BUILT_IN.contains(&name) || name.starts_with("gpuam-") {
            return Err(format!(
                "--resource {name}: the name is Ray's or gpuam's own; choose another"
            ));
        }
        resources.insert(name.to_string(), units.into());
    }
    let mut labels: Vec<(String, String)> = Vec::new();
    if let Some(r) = &d.rack {
        labels.push((LABEL_RACK.into(), encode_rack(r)?));
    }
    if let Some(t) = &d.gpu_type {
        if !is_label_value(t) {
            return Err(format!(
                "--gpu-type `{t}`: use letters, digits, `.`, `_`, `-` (at most {MAX_LABEL_VALUE})"
            ));
        }
        labels.push((LABEL_GPU_TYPE.into(), t.clone()));
    }
    if !d.ports.is_empty() {
        labels.push((LABEL_PORTS.into(), encode_ports(&d.ports)));
    }
    labels.extend(topology_labels(d.topology.as_ref())?);
    let labels = labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    Ok(vec![
        "--num-gpus=0".into(),
        format!("--resources={}", serde_json::Value::Object(resources)),
        format!("--labels={labels}"),
    ])
}

/// `20000-29999,31000` → `20000-29999_31000` (a label value has no `,`).
pub fn encode_ports(ports: &PortSet) -> String {
    ports
        .ranges()
        .iter()
        .map(|r| {
            if r.begin == r.end {
                r.begin.to_string()
            } else {
                format!("{}-{}", r.begin, r.end)
            }
        })
        .collect::<Vec<_>>()
        .join("_")
}

/// The inverse of [`encode_ports`].
pub fn decode_ports(v: &str) -> Result<PortSet, String> {
    PortSet::parse(&v.replace('_', ",")).map_err(|e| format!("label {LABEL_PORTS} `{v}`: {e}"))
}

/// One node of `GET /api/v0/nodes?detail=true` (the fields gpuam reads).
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct RayNode {
    pub node_id: String,
    #[serde(default)]
    pub node_ip: String,
    pub state: String,
    #[serde(default)]
    pub resources_total: BTreeMap<String, f64>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub start_time_ms: u64,
}

impl RayNode {
    /// The gpuam host this Ray node carries (its `gpuam-node-<host>` resource), if any.
    pub fn gpuam_host(&self) -> Option<&str> {
        self.resources_total
            .keys()
            .find_map(|k| k.strip_prefix(NODE_RESOURCE_PREFIX))
            .filter(|h| !h.is_empty())
    }

    pub fn is_alive(&self) -> bool {
        self.state == "ALIVE"
    }
}

/// A gpuam node from a Ray node; `None` for a Ray node that is not a gpuam node (no
/// `gpuam-node-*` resource); `Some(Err)` names the Ray node and the label at fault.
pub fn node_from_ray(r: &RayNode) -> Option<Result<Node, String>> {
    let host = r.gpuam_host()?.to_string();
    let fail = |m: String| crate::text::shown(&format!("Ray node {} (gpuam host {host}): {m}", r.node_id)).into_owned();
    if let Err((m, f)) = crate::spec::validate::check_host_name(&host) {
        return Some(Err(fail(format!("resource `{NODE_RESOURCE_PREFIX}{host}`: {m}; {f}"))));
    }
    let mut mask: GpuMask = 0;
    for (k, v) in &r.resources_total {
        if let Some(i) = k.strip_prefix(GPU_RESOURCE_PREFIX) {
            match i.parse::<u32>() {
                Ok(i) if i < MAX_GPUS && *v >= 1.0 => mask |= 1 << i,
                _ => {
                    return Some(Err(fail(format!(
                        "resource `{k}` = {v}: want {GPU_RESOURCE_PREFIX}<0-63> = 1"
                    ))))
                }
            }
        }
    }
    let ports = match r.labels.get(LABEL_PORTS) {
        Some(v) => match decode_ports(v) {
            Ok(p) => p,
            Err(e) => return Some(Err(fail(e))),
        },
        None => PortSet::new(),
    };
    let cpu = r.resources_total.get("CPU").copied().unwrap_or(0.0).max(0.0) as u32;
    let memory_mb = (r.resources_total.get("memory").copied().unwrap_or(0.0).max(0.0) / 1048576.0) as u64;
    let rack = r
        .labels
        .get(LABEL_RACK)
        .map_or_else(|| DEFAULT_RACK.to_string(), |v| decode_rack(v));
    let total = Resources::with_mask(cpu, memory_mb, mask, ports).with_custom(custom_from_ray(&r.resources_total));
    // The same rules as a registration's and the cluster file's (`spec::validate`): what
    // a Ray node declares is shown to every user.
    if let Err((m, f)) = crate::spec::validate::check_rack(&rack) {
        return Some(Err(fail(format!("label `{LABEL_RACK}`: {m}; {f}"))));
    }
    let gpu_type = r.labels.get(LABEL_GPU_TYPE).cloned();
    if let Some(Err((m, f))) = gpu_type.as_deref().map(crate::spec::validate::check_gpu_type) {
        return Some(Err(fail(format!("label `{LABEL_GPU_TYPE}`: {m}; {f}"))));
    }
    let mut node = Node::new(host.clone(), rack, total);
    node.gpu_type = gpu_type;
    // Where the node's tasks are reached by their peers (Ray's own address of the node).
    node.ip = r.node_ip.parse().ok();
    // GPUs must be 0..n-1 for a topology to apply to them.
    let gpus = mask.count_ones();
    node.topology = match topology_from_labels(&r.labels, gpus) {
        Ok(t) if mask == crate::resources::mask_of_count(gpus) => t.filter(|t| t.gpu_count() == gpus).map(Arc::new),
        Ok(_) => None,
        Err(e) => return Some(Err(fail(e))),
    };
    node.state = if r.is_alive() {
        NodeState::Running
    } else {
        NodeState::Lost
    };
    Some(Ok(node))
}

/// One Ray node per gpuam host: an ALIVE entry wins over DEAD ones (a restarted node
/// leaves its DEAD entry behind); among several ALIVE, the newest. Returns the chosen Ray
/// node of each host, ordered by host.
pub fn merge_by_host(nodes: &[RayNode]) -> BTreeMap<String, &RayNode> {
    let mut by_host: BTreeMap<String, &RayNode> = BTreeMap::new();
    for n in nodes {
        let Some(h) = n.gpuam_host() else { continue };
        let better = by_host
            .get(h)
            .is_none_or(|old| (n.is_alive(), n.start_time_ms) > (old.is_alive(), old.start_time_ms));
        if better {
            by_host.insert(h.to_string(), n);
        }
    }
    by_host
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ray_node(id: &str, state: &str, host: &str, gpus: u32, labels: &[(String, String)]) -> RayNode {
        let mut resources_total = BTreeMap::from([
            ("CPU".to_string(), 4.0),
            ("memory".to_string(), 8.0 * 1048576.0 * 1024.0),
            (node_resource(host), 1.0),
        ]);
        for i in 0..gpus {
            resources_total.insert(gpu_resource(i), 1.0);
        }
        RayNode {
            node_id: id.into(),
            node_ip: "127.0.0.1".into(),
            state: state.into(),
            resources_total,
            labels: labels.iter().cloned().collect(),
            start_time_ms: 0,
        }
    }

    /// Parses the `--labels=` word back into pairs, as `ray start` does.
    fn labels_of(args: &[String]) -> Vec<(String, String)> {
        let l = args.iter().find_map(|a| a.strip_prefix("--labels=")).unwrap_or("");
        l.split(',')
            .filter(|s| !s.is_empty())
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                (k.to_string(), v.to_string())
            })
            .collect()
    }

    #[test]
    fn node_args_round_trip_through_ray_for_a_preset() {
        let d = NodeDescription {
            host: "gpu-a1".into(),
            gpus: 8,
            topology: Topology::preset("dgx1v"),
            rack: Some("/dc1/r7".into()),
            gpu_type: Some("V100".into()),
            ports: PortSet::parse("20000-29999,31000").unwrap(),
            custom: Default::default(),
        };
        let args = ray_start_args(&d).unwrap();
        assert_eq!(args[0], "--num-gpus=0");
        let res: BTreeMap<String, f64> = serde_json::from_str(args[1].strip_prefix("--resources=").unwrap()).unwrap();
        assert_eq!(res.len(), 9);
        assert_eq!(res["gpuam-node-gpu-a1"], 1.0);
        assert_eq!(res["gpuam-gpu-7"], 1.0);
        let labels = labels_of(&args);
        assert!(labels.iter().all(|(_, v)| is_label_value(v)), "{labels:?}");
        let r = ray_node("abc", "ALIVE", "gpu-a1", 8, &labels);
        let n = node_from_ray(&r).unwrap().unwrap();
        assert_eq!(n.host, "gpu-a1");
        assert_eq!(n.ip, Some("127.0.0.1".parse().unwrap()), "peers get the Ray node's IP");
        assert_eq!(n.rack, "/dc1/r7");
        assert_eq!(n.gpu_type.as_deref(), Some("V100"));
        assert_eq!(n.total().gpu_mask, 0xff);
        assert_eq!(n.total().cpu, 4);
        assert_eq!(n.total().memory_mb, 8192);
        assert_eq!(n.total().ports, d.ports);
        assert_eq!(n.topology.as_deref(), Topology::preset("dgx1v").as_ref());
        assert_eq!(n.state, NodeState::Running);
    }

    #[test]
    fn custom_resources_travel_as_ray_resources_of_the_same_name() {
        let d = NodeDescription {
            host: "n1".into(),
            gpus: 2,
            topology: None,
            rack: None,
            gpu_type: None,
            ports: PortSet::new(),
            custom: CustomResources::from_pairs([("nvme", 2)]),
        };
        let args = ray_start_args(&d).unwrap();
        let res: BTreeMap<String, f64> = serde_json::from_str(args[1].strip_prefix("--resources=").unwrap()).unwrap();
        assert_eq!(res["nvme"], 2.0);
        let mut r = ray_node("abc", "ALIVE", "n1", 2, &labels_of(&args));
        r.resources_total.insert("nvme".into(), 2.0);
        r.resources_total.insert("ib_hca".into(), 1.5);
        r.resources_total.insert("object_store_memory".into(), 1e9);
        r.resources_total.insert("node:10.0.0.1".into(), 1.0);
        r.resources_total.insert("accelerator_type:A100".into(), 1.0);
        let n = node_from_ray(&r).unwrap().unwrap();
        assert_eq!(
            n.total().custom.to_text(),
            "ib_hca=1,nvme=2",
            "Ray's own resources are not gpuam's"
        );
        let mut bad = d.clone();
        bad.custom = CustomResources::from_pairs([("object_store_memory", 1)]);
        assert!(ray_start_args(&bad).unwrap_err().contains("Ray's or gpuam's own"));
    }

    #[test]
    fn a_dead_node_is_lost_and_a_plain_ray_node_is_not_a_gpuam_node() {
        let r = ray_node("x", "DEAD", "n1", 2, &[]);
        let n = node_from_ray(&r).unwrap().unwrap();
        assert_eq!(n.state, NodeState::Lost);
        assert_eq!(n.rack, DEFAULT_RACK);
        assert!(n.topology.is_none());
        let mut plain = r.clone();
        plain.resources_total.retain(|k, _| !k.starts_with("gpuam-"));
        assert!(node_from_ray(&plain).is_none());
    }

    /// Audit 5 F5: a Ray node whose host, rack or GPU type label holds a control character
    /// is refused, named, and the message shows it escaped.
    #[test]
    fn a_ray_node_with_control_characters_is_refused() {
        let bad = [
            ("ok", LABEL_RACK, "r\u{1b}[2J"),
            ("ok", LABEL_GPU_TYPE, "V100\u{1b}]0;x\u{7}"),
            ("n\u{1b}[2J", LABEL_GPU_TYPE, "V100"),
        ];
        for (host, label, value) in bad {
            let r = ray_node("id1", "ALIVE", host, 1, &[(label.to_string(), value.to_string())]);
            let e = node_from_ray(&r).unwrap().unwrap_err();
            assert!(!e.contains('\u{1b}') && e.contains("\\u{1b}"), "{e}");
        }
        let r = ray_node(
            "id1",
            "ALIVE",
            "ok",
            1,
            &[(LABEL_GPU_TYPE.to_string(), "A100".to_string())],
        );
        assert!(node_from_ray(&r).unwrap().is_ok());
    }

    #[test]
    fn bad_labels_are_named() {
        let r = ray_node("x", "ALIVE", "n1", 2, &[(LABEL_TOPOLOGY.into(), "warp9".into())]);
        let e = node_from_ray(&r).unwrap().unwrap_err();
        assert!(
            e.contains("n1") && e.contains(LABEL_TOPOLOGY) && e.contains("warp9"),
            "{e}"
        );
        let r = ray_node(
            "x",
            "ALIVE",
            "n1",
            4,
            &[(LABEL_TOPOLOGY.into(), TOPOLOGY_MATRIX.into())],
        );
        let e = node_from_ray(&r).unwrap().unwrap_err();
        assert!(e.contains("0 link codes for 4 GPUs"), "{e}");
        assert!(encode_rack("/r.1").is_err());
        assert!(check_host("bad host").is_err());
        assert!(ray_start_args(&NodeDescription {
            host: "n1".into(),
            gpus: 2,
            topology: Topology::preset("pcie4"),
            rack: None,
            gpu_type: None,
            ports: PortSet::new(),
            custom: Default::default(),
        })
        .unwrap_err()
        .contains("describes 4 GPUs"));
    }

    #[test]
    fn a_restarted_node_replaces_its_dead_entry() {
        let mut dead = ray_node("old", "DEAD", "n1", 2, &[]);
        dead.start_time_ms = 5;
        let mut alive = ray_node("new", "ALIVE", "n1", 2, &[]);
        alive.start_time_ms = 9;
        let other = ray_node("o", "ALIVE", "n2", 2, &[]);
        for order in [
            vec![dead.clone(), alive.clone(), other.clone()],
            vec![alive.clone(), dead.clone(), other],
        ] {
            let m = merge_by_host(&order);
            assert_eq!(m.len(), 2);
            assert_eq!(m["n1"].node_id, "new");
        }
    }

    fn any_link() -> impl Strategy<Value = Link> {
        prop_oneof![
            (1u8..=18).prop_map(Link::Nv),
            Just(Link::Pix),
            Just(Link::Pxb),
            Just(Link::Phb),
            Just(Link::Node),
            Just(Link::Sys),
        ]
    }

    proptest! {
        /// Any symmetric topology of up to 20 GPUs survives labels → Ray → gpuam unchanged,
        /// and every label it writes is one Ray accepts.
        #[test]
        fn matrix_topologies_round_trip(n in 2u32..20, cells in proptest::collection::vec(any_link(), 190)) {
            let link = |a: u32, b: u32| {
                let (a, b) = (a.min(b) as usize, a.max(b) as usize);
                cells[b * (b - 1) / 2 + a]
            };
            let t = Topology::new("custom", n, link).unwrap();
            let labels = topology_labels(Some(&t)).unwrap();
            prop_assert!(labels.iter().all(|(_, v)| is_label_value(v)));
            let map: BTreeMap<String, String> = labels.into_iter().collect();
            let back = topology_from_labels(&map, n).unwrap().unwrap();
            for a in 0..n {
                for b in 0..n {
                    if a != b {
                        prop_assert_eq!(back.link(a, b), t.link(a, b));
                    }
                }
            }
        }

        #[test]
        fn racks_round_trip(parts in proptest::collection::vec("[a-z0-9][a-z0-9_-]{0,6}[a-z0-9]", 1..4)) {
            let rack = format!("/{}", parts.join("/"));
            let v = encode_rack(&rack).unwrap();
            prop_assert!(is_label_value(&v));
            prop_assert_eq!(decode_rack(&v), rack);
        }
    }
}
