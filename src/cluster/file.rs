//! Reads a cluster file (DESIGN.md §7): the YAML list of nodes that the embedded RM serves
//! and that `gpuam plan --cluster` places against, with the same located errors as job specs.
//!
//! ```yaml
//! nodes:
//!   - host: node-01
//!     rack: /rack-a              # default /default-rack
//!     labels: [gpu]              # default none
//!     gpuType: V100              # optional
//!     cpu: 64
//!     memoryMB: 256000
//!     gpus: 8                    # or gpuMask: "0xff"; neither = no GPUs
//!     ports: "20000-29999"       # or a list of such strings
//!     topology: pcie8            # preset name or `nvidia-smi topo -m` text
//!     local: false               # use this machine's real GPUs
//!     httpAddress: 127.0.0.1:8042
//!     resources: {nvme: 2}       # custom resources offered (whole units)
//!     used: {cpu: 8, memoryMB: 1000, gpuMask: "0x3", ports: "20000-20009", resources: {nvme: 1}}
//! ```
//! Limits: the file ≤ 10 MiB, ≤ 100 000 nodes, `gpus` ≤ 64, node `cpu` 1..=1 048 576,
//! `memoryMB` 1..=2^40.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use crate::resources::{mask_hex, mask_of_count, GpuMask, PortSet, Resources};
use crate::spec::parse::read_limited;
use crate::spec::validate::{self, limits};
use crate::spec::yaml::{self, clip, join, Diags, Node, Pos, Value};
use crate::spec::SpecErrors;
use crate::topology::Topology;

use super::Node as ClusterNode;

const NODE_FIELDS: &[&str] = &[
    "host",
    "rack",
    "labels",
    "gpuType",
    "cpu",
    "memoryMB",
    "gpus",
    "gpuMask",
    "ports",
    "topology",
    "local",
    "httpAddress",
    "resources",
    "used",
];
const NODE_HINTS: &[(&str, &str)] = &[
    ("hostname", "host"),
    ("name", "host"),
    ("gpu", "gpus"),
    ("gpuNumber", "gpus"),
    ("gpuAttribute", "gpuMask"),
    ("memory", "memoryMB"),
    ("label", "labels"),
    ("nodeLabels", "labels"),
    ("portRanges", "ports"),
    ("gpuTopology", "topology"),
    ("customResources", "resources"),
    ("custom", "resources"),
];
const USED_FIELDS: &[&str] = &["cpu", "memoryMB", "gpuMask", "ports", "resources"];
const DEFAULT_RACK: &str = "/default-rack";

/// Parses a cluster file; `source` names it in errors.
pub fn parse_cluster_file(text: &str, source: &str) -> Result<Vec<ClusterNode>, SpecErrors> {
    let mut d = Diags::new(source);
    if text.len() > limits::MAX_CLUSTER_BYTES {
        d.at(
            Pos::default(),
            "",
            format!(
                "the cluster file is {} bytes; the limit is {} (10 MiB)",
                text.len(),
                limits::MAX_CLUSTER_BYTES
            ),
            "split the cluster or shorten topology texts by using preset names",
        );
        return d.into_result(None);
    }
    let doc = yaml::parse(text);
    d.extend_yaml(&doc.issues);
    if doc.fatal {
        return d.into_result(None);
    }
    let nodes = match &doc.root {
        None => {
            d.at(
                Pos { line: 1, col: 1 },
                "",
                "the cluster file is empty",
                "write `nodes:` with a list of nodes; see conf/cluster.yaml",
            );
            None
        }
        Some(root) => read_cluster(&mut d, root),
    };
    d.into_result(nodes)
}

/// Reads and parses a cluster file; a read error is reported at line 0.
pub fn load_cluster_file(path: &Path) -> Result<Vec<ClusterNode>, SpecErrors> {
    let source = path.display().to_string();
    match read_limited(path, limits::MAX_CLUSTER_BYTES) {
        Ok(text) => parse_cluster_file(&text, &source),
        Err((message, fix)) => {
            let mut d = Diags::new(&source);
            d.at(Pos::default(), "", message, fix);
            d.into_result(None)
        }
    }
}

fn read_cluster(d: &mut Diags, root: &Node) -> Option<Vec<ClusterNode>> {
    d.map(
        root,
        "",
        "start the file with `nodes:` and a list of nodes; see conf/cluster.yaml",
    )?;
    d.unknown_fields(root, "", &["nodes"], &[("node", "nodes"), ("hosts", "nodes")]);
    let Some(list) = root.get("nodes") else {
        d.missing(
            root,
            "",
            "nodes",
            "add `nodes:` with a list of nodes; see conf/cluster.yaml",
        );
        return None;
    };
    let items = d.seq(list, "nodes", "write `nodes:` as a list: `- host: node-01`")?;
    if items.is_empty() {
        d.at(list.pos, "nodes", "`nodes` is empty", "add at least one node");
        return None;
    }
    if items.len() > limits::MAX_NODES {
        d.at(
            list.pos,
            "nodes",
            format!("{} nodes; the limit is {}", items.len(), limits::MAX_NODES),
            "split the cluster into several files",
        );
        return None;
    }
    let mut out = Vec::with_capacity(items.len());
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut ok = true;
    for (i, item) in items.iter().enumerate() {
        let path = format!("nodes[{i}]");
        match read_node(d, item, &path) {
            Some(n) => {
                if let Some(first) = seen.get(&n.host) {
                    let pos = item.get("host").map_or(item.pos, |h| h.pos);
                    d.at(
                        pos,
                        &join(&path, "host"),
                        format!("host \"{}\" is listed twice (first as nodes[{first}])", clip(&n.host)),
                        "give every node a unique host name",
                    );
                    ok = false;
                } else {
                    seen.insert(n.host.clone(), i);
                }
                out.push(n);
            }
            None => ok = false,
        }
    }
    ok.then_some(out)
}

fn read_ports_field(d: &mut Diags, n: &Node, path: &str) -> Option<PortSet> {
    let fix = "write port ranges like \"20000-29999,31000\" or a list of such strings";
    let parts: Vec<(String, &Node)> = match &n.value {
        Value::Null => return Some(PortSet::new()),
        Value::Seq(items) => {
            let mut v = Vec::new();
            for (i, it) in items.iter().enumerate() {
                v.push((d.text(it, &format!("{path}[{i}]"))?, it));
            }
            v
        }
        Value::Map(_) => {
            d.at(
                n.pos,
                path,
                format!("expected port ranges, found {}", n.describe()),
                fix,
            );
            return None;
        }
        _ => vec![(d.text(n, path)?, n)],
    };
    let mut set = PortSet::new();
    for (text, node) in parts {
        match PortSet::parse(&text) {
            Ok(p) => set = set.union(&p),
            Err(e) => {
                d.at(
                    node.pos,
                    path,
                    format!("invalid port range \"{}\": {}", clip(&e.text), e.why),
                    fix,
                );
                return None;
            }
        }
    }
    Some(set)
}

fn read_node(d: &mut Diags, n: &Node, path: &str) -> Option<ClusterNode> {
    d.map(n, path, "write each node as a mapping: `- host: node-01`")?;
    d.unknown_fields(n, path, NODE_FIELDS, NODE_HINTS);
    let mut ok = true;

    let host = match n.get("host") {
        None => {
            d.missing(n, path, "host", "add `host: node-01`");
            None
        }
        Some(h) => d
            .text(h, &join(path, "host"))
            .and_then(|s| match validate::check_host_name(&s) {
                Ok(()) => Some(s),
                Err((m, f)) => {
                    d.at(h.pos, &join(path, "host"), m, f);
                    None
                }
            }),
    };
    let rack = match n.get("rack") {
        None => Some(DEFAULT_RACK.to_string()),
        Some(r) if r.is_null() => Some(DEFAULT_RACK.to_string()),
        Some(r) => d
            .text(r, &join(path, "rack"))
            .and_then(|s| match validate::check_rack(&s) {
                Ok(()) => Some(s),
                Err((m, f)) => {
                    d.at(r.pos, &join(path, "rack"), m, f);
                    None
                }
            }),
    };
    ok &= rack.is_some();

    let mut labels = Vec::new();
    if let Some(l) = n.get("labels") {
        let lp = join(path, "labels");
        let items: Vec<(String, Pos)> = match &l.value {
            Value::Null => Vec::new(),
            Value::Seq(items) => items
                .iter()
                .enumerate()
                .filter_map(|(i, it)| d.text(it, &format!("{lp}[{i}]")).map(|t| (t, it.pos)))
                .collect(),
            _ => d
                .text(l, &lp)
                .map(|t| t.split(',').map(|p| (p.trim().to_string(), l.pos)).collect())
                .unwrap_or_default(),
        };
        for (label, pos) in items {
            match validate::check_node_label(&label) {
                Ok(()) => labels.push(label),
                Err((m, f)) => {
                    d.at(pos, &lp, m, f);
                    ok = false;
                }
            }
        }
    }
    let gpu_type = match n.get("gpuType") {
        None => None,
        Some(g) if g.is_null() => None,
        Some(g) => {
            let t = d
                .text(g, &join(path, "gpuType"))
                .map(|s| s.trim().to_string())
                .and_then(|s| match s.is_empty() {
                    true => Some(s),
                    false => match validate::check_gpu_type(&s) {
                        Ok(()) => Some(s),
                        Err((m, f)) => {
                            d.at(g.pos, &join(path, "gpuType"), m, f);
                            None
                        }
                    },
                });
            ok &= t.is_some();
            t.filter(|s| !s.is_empty())
        }
    };
    let cpu = match n.get("cpu") {
        None => {
            d.missing(n, path, "cpu", "add `cpu: 64` (the node's CPU cores)");
            None
        }
        Some(v) => d.int(v, &join(path, "cpu"), 1, limits::MAX_NODE_CPU).map(|x| x as u32),
    };
    let memory_mb = match n.get("memoryMB") {
        None => {
            d.missing(n, path, "memoryMB", "add `memoryMB: 256000` (the node's memory in MB)");
            None
        }
        Some(v) => d
            .int(v, &join(path, "memoryMB"), 1, limits::MAX_NODE_MEMORY_MB)
            .map(|x| x as u64),
    };
    let mask: Option<GpuMask> = match (n.get("gpus"), n.get("gpuMask")) {
        (Some(_), Some(m)) => {
            d.at(
                m.pos,
                &join(path, "gpuMask"),
                "give either `gpus` or `gpuMask`, not both",
                "keep `gpus: N` for GPUs 0..N-1, or `gpuMask` for an explicit set",
            );
            None
        }
        (Some(g), None) => d
            .int(g, &join(path, "gpus"), 0, validate::limits::MAX_GPUS)
            .map(|k| mask_of_count(k as u32)),
        (None, Some(m)) => match validate::read_mask(m) {
            Ok(x) => Some(x),
            Err((msg, fix)) => {
                d.at(m.pos, &join(path, "gpuMask"), msg, fix);
                None
            }
        },
        (None, None) => Some(0),
    };
    ok &= mask.is_some();
    let ports = match n.get("ports") {
        None => Some(PortSet::new()),
        Some(p) => read_ports_field(d, p, &join(path, "ports")),
    };
    ok &= ports.is_some();

    let topology = match n.get("topology") {
        None => None,
        Some(t) if t.is_null() => None,
        Some(t) => {
            let tp = join(path, "topology");
            match d.text(t, &tp).map(|s| Topology::from_spec(&s)) {
                None => {
                    ok = false;
                    None
                }
                Some(Err(e)) => {
                    d.at(
                        t.pos,
                        &tp,
                        format!("invalid topology: {e}"),
                        "use a preset (pcie4, pcie8, dgx1v, nvbridge8, nvswitch8, none) or paste the output of `nvidia-smi topo -m`",
                    );
                    ok = false;
                    None
                }
                Some(Ok(None)) => None,
                Some(Ok(Some(topo))) => {
                    if let Some(m) = mask {
                        let n_topo = topo.gpu_count();
                        if m != mask_of_count(n_topo) {
                            d.at(
                                t.pos,
                                &tp,
                                format!(
                                    "the topology describes {n_topo} GPUs but the node has {} (mask {})",
                                    m.count_ones(),
                                    mask_hex(m)
                                ),
                                format!("set `gpus: {n_topo}` or use a topology for this node's GPUs"),
                            );
                            ok = false;
                        }
                    }
                    Some(Arc::new(topo))
                }
            }
        }
    };
    let local = match n.get("local") {
        None => false,
        Some(l) => match d.bool(l, &join(path, "local")) {
            Some(b) => b,
            None => {
                ok = false;
                false
            }
        },
    };
    let http_address = match n.get("httpAddress") {
        None => String::new(),
        Some(h) if h.is_null() => String::new(),
        Some(h) => {
            let hp = join(path, "httpAddress");
            match d.text(h, &hp) {
                Some(s) if valid_http_address(&s) => s,
                Some(s) => {
                    d.at(
                        h.pos,
                        &hp,
                        format!("invalid address \"{}\"", clip(&s)),
                        "write `host:port`, e.g. `127.0.0.1:8042`",
                    );
                    ok = false;
                    String::new()
                }
                None => {
                    ok = false;
                    String::new()
                }
            }
        }
    };

    let custom = match n.get("resources") {
        None => Some(Default::default()),
        Some(r) => validate::read_custom_resources(d, r, &join(path, "resources"), 0),
    };
    ok &= custom.is_some();

    let total = Resources::with_mask(cpu?, memory_mb?, mask?, ports?).with_custom(custom?);
    let used = match n.get("used") {
        None => None,
        Some(u) if u.is_null() => None,
        Some(u) => {
            let r = read_used(d, u, &join(path, "used"), &total);
            ok &= r.is_some();
            r
        }
    };
    if !ok {
        return None;
    }
    let mut node = ClusterNode::new(host?, rack?, total);
    node.labels = labels;
    node.gpu_type = gpu_type;
    node.topology = topology;
    node.local = local;
    node.http_address = http_address;
    if let Some(u) = used {
        node.set_used(u);
    }
    Some(node)
}

fn valid_http_address(s: &str) -> bool {
    let s = s.strip_prefix("http://").unwrap_or(s);
    match s.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0),
        None => false,
    }
}

fn read_used(d: &mut Diags, u: &Node, path: &str, total: &Resources) -> Option<Resources> {
    d.map(
        u,
        path,
        "write `used: {cpu: 8, memoryMB: 1000, gpuMask: \"0x3\", ports: \"20000-20009\"}`",
    )?;
    d.unknown_fields(u, path, USED_FIELDS, &[("gpus", "gpuMask"), ("memory", "memoryMB")]);
    let mut ok = true;
    // An absent field counts as 0 used; a bad one is reported and fails the node.
    let mut field_int = |d: &mut Diags, key: &str, max: u64| -> u64 {
        let Some(v) = u.get(key) else { return 0 };
        let fp = join(path, key);
        let Some(x) = d.int(v, &fp, 0, i64::MAX).map(|x| x as u64) else {
            ok = false;
            return 0;
        };
        if x > max {
            d.at(
                v.pos,
                &fp,
                format!("used {key} {x} is more than the node's total {max}"),
                format!("lower it to at most {max}"),
            );
            ok = false;
        }
        x
    };
    let cpu = field_int(d, "cpu", u64::from(total.cpu)) as u32;
    let memory_mb = field_int(d, "memoryMB", total.memory_mb);
    let mask = match u.get("gpuMask") {
        None => 0,
        Some(m) if m.is_null() => 0,
        Some(m) => match validate::read_mask(m) {
            Ok(x) if x & !total.gpu_mask != 0 => {
                d.at(
                    m.pos,
                    &join(path, "gpuMask"),
                    format!(
                        "used GPUs {} are not all on the node (its GPUs: {})",
                        mask_hex(x),
                        mask_hex(total.gpu_mask)
                    ),
                    "use only bits of the node's GPUs",
                );
                ok = false;
                0
            }
            Ok(x) => x,
            Err((msg, fix)) => {
                d.at(m.pos, &join(path, "gpuMask"), msg, fix);
                ok = false;
                0
            }
        },
    };
    let ports = match u.get("ports") {
        None => PortSet::new(),
        Some(p) => match read_ports_field(d, p, &join(path, "ports")) {
            Some(set) if !set.is_subset(&total.ports) => {
                d.at(
                    p.pos,
                    &join(path, "ports"),
                    format!(
                        "used ports {} are not all among the node's ports \"{}\"",
                        set.subtract(&total.ports),
                        total.ports
                    ),
                    "list only ports within the node's `ports`",
                );
                ok = false;
                PortSet::new()
            }
            Some(set) => set,
            None => {
                ok = false;
                PortSet::new()
            }
        },
    };
    let custom = match u.get("resources") {
        None => Default::default(),
        Some(r) => match validate::read_custom_resources(d, r, &join(path, "resources"), 0) {
            Some(c) => {
                for (name, units) in c.iter() {
                    if units > total.custom.get(name) {
                        let p = join(&join(path, "resources"), name);
                        let pos = r.get(name).map_or(r.pos, |v| v.pos);
                        d.at(
                            pos,
                            &p,
                            format!(
                                "used {name} {units} is more than the node offers ({})",
                                total.custom.get(name)
                            ),
                            format!(
                                "lower it to at most {}, or offer it in the node's `resources`",
                                total.custom.get(name)
                            ),
                        );
                        ok = false;
                    }
                }
                c
            }
            None => {
                ok = false;
                Default::default()
            }
        },
    };
    if !ok {
        return None;
    }
    Some(Resources::with_mask(cpu, memory_mb, mask, ports).with_custom(custom))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<ClusterNode>, SpecErrors> {
        parse_cluster_file(text, "cluster.yaml")
    }

    fn one_error(text: &str) -> crate::spec::SpecError {
        let e = parse(text).unwrap_err();
        assert_eq!(e.0.len(), 1, "expected one error, got:\n{e}");
        e.0.into_iter().next().unwrap()
    }

    const BASE: &str = "nodes:\n  - host: n1\n    cpu: 8\n    memoryMB: 1000\n";

    #[test]
    fn minimal_node_gets_defaults() {
        let nodes = parse(BASE).unwrap();
        assert_eq!(nodes.len(), 1);
        let n = &nodes[0];
        assert_eq!((n.host.as_str(), n.rack.as_str()), ("n1", "/default-rack"));
        assert_eq!((n.total().cpu, n.total().memory_mb, n.total().gpu_mask), (8, 1000, 0));
        assert!(n.labels.is_empty() && n.topology.is_none() && !n.local);
        assert!(n.total().ports.is_empty());
    }

    #[test]
    fn full_node() {
        let text = "nodes:\n  - host: n1\n    rack: /rack-a\n    labels: [gpu, fast]\n    gpuType: V100\n    cpu: 64\n    memoryMB: 256000\n    gpus: 4\n    ports: [\"20000-29999\", \"31000\"]\n    topology: none\n    local: true\n    httpAddress: 127.0.0.1:8042\n    used: {cpu: 8, memoryMB: 1000, gpuMask: \"0x3\", ports: \"20000-20009\"}\n";
        let n = &parse(text).unwrap()[0];
        assert_eq!(n.rack, "/rack-a");
        assert_eq!(n.labels, vec!["gpu", "fast"]);
        assert_eq!(n.gpu_type.as_deref(), Some("V100"));
        assert_eq!((n.total().gpus, n.total().gpu_mask), (4, 0xf));
        assert_eq!(n.total().ports.to_string(), "20000-29999,31000");
        assert!(n.local);
        assert_eq!(n.http_address, "127.0.0.1:8042");
        assert_eq!(n.used().gpu_mask, 0x3);
        assert_eq!(n.free().gpu_mask, 0xc);
        assert_eq!(n.free().cpu, 56);
        assert_eq!(n.free().ports.to_string(), "20010-29999,31000");
    }

    #[test]
    fn custom_resources_offered_and_used() {
        let n = &parse(&format!(
            "{BASE}    resources: {{nvme: 2, ib_hca: 4}}\n    used: {{resources: {{nvme: 1}}}}\n"
        ))
        .unwrap()[0];
        assert_eq!(n.total().custom.to_text(), "ib_hca=4,nvme=2");
        assert_eq!(n.free().custom.to_text(), "ib_hca=4,nvme=1");
        let e = one_error(&format!(
            "{BASE}    resources: {{nvme: 2}}\n    used: {{resources: {{nvme: 3}}}}\n"
        ));
        assert_eq!((e.field.as_str(), e.line), ("nodes[0].used.resources.nvme", 6));
        assert!(e.message.contains("more than the node offers"), "{e}");
        let e = one_error(&format!("{BASE}    resources: {{gpus: 2}}\n"));
        assert_eq!(e.field, "nodes[0].resources.gpus");
        assert!(e.message.contains("built-in"), "{e}");
        let e = one_error(&format!("{BASE}    resources: {{nvme: -1}}\n"));
        assert!(e.message.contains("negative"), "{e}");
    }

    #[test]
    fn gpu_mask_instead_of_count() {
        let n = &parse(&format!("{BASE}    gpuMask: \"0xf0\"\n")).unwrap()[0];
        assert_eq!((n.total().gpus, n.total().gpu_mask), (4, 0xf0));
    }

    #[test]
    fn missing_host() {
        let e = one_error("nodes:\n  - cpu: 8\n    memoryMB: 1000\n");
        assert_eq!((e.field.as_str(), e.line), ("nodes[0].host", 2));
        assert!(e.message.contains("missing"), "{e}");
    }

    #[test]
    fn missing_cpu_and_memory_both_reported() {
        let e = parse("nodes:\n  - host: a\n").unwrap_err();
        let fields: Vec<_> = e.0.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, vec!["nodes[0].cpu", "nodes[0].memoryMB"]);
    }

    #[test]
    fn duplicate_host() {
        let e = one_error(&format!("{BASE}  - host: n1\n    cpu: 8\n    memoryMB: 1000\n"));
        assert_eq!((e.field.as_str(), e.line, e.col), ("nodes[1].host", 5, 11));
        assert!(e.message.contains("listed twice"), "{e}");
    }

    #[test]
    fn gpus_and_mask_together() {
        let e = one_error(&format!("{BASE}    gpus: 2\n    gpuMask: 3\n"));
        assert_eq!((e.field.as_str(), e.line), ("nodes[0].gpuMask", 6));
        assert!(e.message.contains("not both"), "{e}");
    }

    #[test]
    fn too_many_gpus() {
        let e = one_error(&format!("{BASE}    gpus: 65\n"));
        assert_eq!((e.field.as_str(), e.line), ("nodes[0].gpus", 5));
        assert!(e.message.contains("at most 64"), "{e}");
    }

    #[test]
    fn bad_ports() {
        let e = one_error(&format!("{BASE}    ports: \"30000-20000\"\n"));
        assert_eq!((e.field.as_str(), e.line), ("nodes[0].ports", 5));
        assert!(e.message.contains("ends before it begins"), "{e}");
    }

    #[test]
    fn unknown_topology() {
        let e = one_error(&format!("{BASE}    topology: warp9\n"));
        assert_eq!((e.field.as_str(), e.line), ("nodes[0].topology", 5));
        assert!(e.message.contains("warp9"), "{e}");
    }

    #[test]
    fn used_beyond_total() {
        let e = one_error(&format!("{BASE}    gpus: 2\n    used: {{cpu: 9, gpuMask: \"0x3\"}}\n"));
        assert_eq!((e.field.as_str(), e.line), ("nodes[0].used.cpu", 6));
        assert!(e.message.contains("more than the node's total"), "{e}");
        let e = one_error(&format!("{BASE}    gpus: 2\n    used: {{gpuMask: \"0x4\"}}\n"));
        assert_eq!(e.field, "nodes[0].used.gpuMask");
        let e = one_error(&format!(
            "{BASE}    ports: \"100-200\"\n    used: {{ports: \"150-250\"}}\n"
        ));
        assert_eq!(e.field, "nodes[0].used.ports");
        assert!(e.message.contains("201-250"), "{e}");
    }

    #[test]
    fn unknown_field_suggests() {
        let e = one_error(&format!("{BASE}    gpu: 2\n"));
        assert_eq!((e.field.as_str(), e.line, e.col), ("nodes[0].gpu", 5, 5));
        assert!(e.fix.contains("`gpus`"), "{e}");
    }

    #[test]
    fn bad_rack_label_and_address() {
        let e = parse(&format!(
            "{BASE}    rack: rack a\n    labels: [\"a b\"]\n    httpAddress: nowhere\n"
        ))
        .unwrap_err();
        let fields: Vec<_> = e.0.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, vec!["nodes[0].rack", "nodes[0].labels", "nodes[0].httpAddress"]);
    }

    #[test]
    fn not_a_list_and_empty() {
        let e = one_error("nodes: {host: a}\n");
        assert!(e.message.contains("expected a list"), "{e}");
        let e = one_error("nodes: []\n");
        assert!(e.message.contains("empty"), "{e}");
        let e = one_error("");
        assert!(e.message.contains("empty"), "{e}");
        let e = one_error("- host: a\n");
        assert!(e.message.contains("expected a mapping"), "{e}");
    }

    #[test]
    fn oversized_file_is_rejected_before_parsing() {
        let text = " ".repeat(limits::MAX_CLUSTER_BYTES + 1);
        let e = one_error(&text);
        assert_eq!(e.line, 0);
        assert!(e.message.contains("limit"), "{e}");
    }

    #[test]
    fn load_reports_missing_file_at_line_zero() {
        let e = load_cluster_file(Path::new("/nonexistent/cluster.yaml")).unwrap_err();
        assert_eq!(e.0[0].line, 0);
        assert!(e.0[0].message.contains("cannot read"), "{}", e);
    }

    #[test]
    fn topology_presets_are_read_by_name() {
        let n = &parse(&format!("{BASE}    gpus: 8\n    topology: pcie8\n")).unwrap()[0];
        assert_eq!(n.topology.as_ref().map(|t| t.gpu_count()), Some(8));
    }

    #[test]
    fn demo_cluster_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("conf/cluster.yaml");
        let nodes = load_cluster_file(&path).unwrap_or_else(|e| panic!("{e}"));
        assert!(nodes.len() >= 8);
        let racks: std::collections::BTreeSet<_> = nodes.iter().map(|n| n.rack.as_str()).collect();
        assert_eq!(racks.into_iter().collect::<Vec<_>>(), vec!["/rack-a", "/rack-b"]);
        assert!(nodes.iter().any(|n| n.total().gpu_count() == 0));
        for n in nodes.iter().filter(|n| n.total().gpu_count() > 0) {
            let t = n
                .topology
                .as_ref()
                .unwrap_or_else(|| panic!("{} has no topology", n.host));
            assert_eq!(t.gpu_count(), n.total().gpu_count(), "{}", n.host);
        }
        let busy = nodes.iter().find(|n| n.host == "b-a100-bridge").unwrap();
        assert_eq!((busy.free().gpu_mask, busy.free().cpu), (0xfc, 48));
        let labelled: Vec<_> = nodes
            .iter()
            .filter(|n| !n.labels.is_empty())
            .map(|n| n.host.as_str())
            .collect();
        assert_eq!(
            labelled,
            vec!["a-cpu"],
            "only the CPU node is in a partition of its own"
        );
    }

    proptest::proptest! {
        #[test]
        fn never_panics_on_mutations(cut in 0usize..2000, junk in "[-a-z0-9:{}\\[\\],\"' \n]{0,12}") {
            let text = include_str!("../../conf/cluster.yaml");
            let cut = cut.min(text.len());
            let cut = (0..=cut).rev().find(|i| text.is_char_boundary(*i)).unwrap_or(0);
            let mutated = format!("{}{}{}", &text[..cut], junk, &text[cut..]);
            if let Err(errs) = parse(&mutated) {
                for e in &errs.0 {
                    proptest::prop_assert!(
                        !e.message.contains(crate::spec::yaml::PARSER_FAILED),
                        "the parser panicked on {:?}: {}",
                        mutated,
                        e
                    );
                }
            }
        }
    }
}
