//! The RM's node JSON (DESIGN.md §3): writing a [`Node`] as a YARN node object with
//! gpuam's GPU-mask / port / topology extensions, and reading node listings back —
//! our own, and a stock YARN 3 RM's (GPU count only under `yarn.io/gpu`).
//!
//! The reader works on `serde_json::Value` by hand rather than through derived
//! structs because real RMs write empty lists as `null`, `{}`, `""` or nothing at
//! all, single-element lists as bare objects, and `i64::MAX` limits; every such
//! shape must be accepted, and a genuinely wrong field must be named in the error.

use std::sync::Arc;

use serde_json::{json, Map, Value};

use crate::cluster::{Node, NodeState};
use crate::resources::{
    lowest_bits, mask_hex, mask_of_count, parse_mask, CustomResources, GpuMask, GpuShares, PortRange, PortSet,
    Resources,
};
use crate::topology::Topology;

/// The NodeManager RPC port our node ids carry (`host:8041`), as in YARN 3.
pub const NM_PORT: u16 = 8041;

/// YARN's resource name for GPUs in `resourceInformations`.
pub const YARN_GPU: &str = "yarn.io/gpu";

/// A node listing (or one node) that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeJsonError {
    #[error("node listing is not valid JSON: {0}")]
    Json(String),
    #[error("node listing: `{field}`: {message}")]
    Listing { field: String, message: String },
    #[error("node #{index} ({host}): field `{field}`: {message}")]
    Node {
        index: usize,
        host: String,
        field: String,
        message: String,
    },
}

/// Writes one node as a YARN node object. `num_containers` is the number of live
/// containers on it; `last_health_update_ms` milliseconds since the epoch.
/// A preset travels by name; a parsed matrix (named "custom") as its
/// `nvidia-smi topo -m` text. Names are compared, not matrices: this runs for every
/// node of every listing.
fn topology_wire(t: &crate::topology::Topology) -> String {
    if crate::topology::Topology::preset_names().contains(&t.name()) {
        t.name().to_string()
    } else {
        t.to_topo_text()
    }
}

pub fn node_to_json(node: &Node, num_containers: u32, last_health_update_ms: u64) -> Value {
    serde_json::to_value(NodeObject {
        node,
        num_containers,
        last_health_update_ms,
        form: ObjectForm::Whole,
    })
    .unwrap_or(Value::Null)
}

/// Which of a node's fields its object carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectForm {
    /// YARN's whole node object.
    Whole,
    /// The lean view's: without [`NOT_IN_LEAN_VIEW`].
    Lean,
    /// The compact view's shape: the lean object without [`NODE_IDENTITY`], which many
    /// nodes share (see [`node_entry_bytes`]).
    Shape,
}

/// One node's object as bytes, written directly (no `Value` tree), in `form`. What the
/// RM's node listings cache per node.
pub fn node_json_bytes(node: &Node, num_containers: u32, last_health_update_ms: u64, form: ObjectForm) -> Vec<u8> {
    serde_json::to_vec(&NodeObject {
        node,
        num_containers,
        last_health_update_ms,
        form,
    })
    .unwrap_or_default()
}

/// The fields that tell one node from another of the same shape: what a compact listing's
/// node entry carries besides its shape's index (DESIGN.md §3, `?view=compact`).
pub const NODE_IDENTITY: [&str; 5] = ["drainByMs", "nodeHTTPAddress", "nodeHostName", "nodeIp", "rack"];

/// The field of a compact listing's node entry that names its shape (an index into
/// `nodes.shapes`).
pub const SHAPE: &str = "shape";

/// A compact listing's node entry: its shape and [`NODE_IDENTITY`].
#[derive(serde::Serialize, serde::Deserialize)]
struct NodeEntry {
    #[serde(rename = "shape", default, skip_serializing)]
    shape: Option<usize>,
    #[serde(rename = "nodeHTTPAddress", default, skip_serializing_if = "String::is_empty")]
    http_address: String,
    #[serde(rename = "nodeHostName")]
    host: String,
    #[serde(rename = "nodeIp", default, skip_serializing_if = "Option::is_none")]
    ip: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rack: Option<String>,
    /// Busy nodes' drains differ, so it is the node's own, not its shape's (issue 27).
    #[serde(rename = "drainByMs", default, skip_serializing_if = "Option::is_none")]
    drain_by_ms: Option<u64>,
}

/// A node's entry in a compact listing without its shape: `{"nodeHTTPAddress":..,
/// "nodeHostName":..,"rack":..}` ([`NODE_IDENTITY`]). The listing writes `{"shape":K,`
/// and this text after its opening brace.
pub fn node_entry_bytes(node: &Node) -> Vec<u8> {
    serde_json::to_vec(&NodeEntry {
        shape: None,
        http_address: node.http_address.clone(),
        host: node.host.clone(),
        ip: node.ip.map(|ip| ip.to_string()),
        rack: Some(node.rack.clone()),
        drain_by_ms: node.drain_by_ms,
    })
    .unwrap_or_default()
}

/// One node as YARN's node object, serialised field by field (no `Value` tree: an allocate
/// answer writes every changed node, issue 29). Keys go out sorted, as a `Value` map
/// holds them, so [`node_to_json`] and the direct form are the same text.
struct NodeObject<'a> {
    node: &'a Node,
    num_containers: u32,
    last_health_update_ms: u64,
    form: ObjectForm,
}

/// A field's value in [`NodeObject`].
enum Field<'a> {
    Str(std::borrow::Cow<'a, str>),
    Num(u64),
    State(&'a crate::cluster::NodeState),
    Labels(&'a [String]),
    Shares(&'a crate::resources::GpuShares),
    Custom(&'a crate::resources::custom::CustomResources),
    Resource(ResourceInfo),
}

impl serde::Serialize for Field<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Field::Str(v) => s.serialize_str(v),
            Field::Num(v) => s.serialize_u64(*v),
            Field::State(v) => v.serialize(s),
            Field::Labels(v) => v.serialize(s),
            Field::Shares(v) => v.serialize(s),
            Field::Custom(v) => v.serialize(s),
            Field::Resource(v) => v.serialize(s),
        }
    }
}

impl serde::Serialize for NodeObject<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        use std::borrow::Cow;
        use Field::*;
        let node = self.node;
        let total = node.total();
        let used = node.used();
        let avail = total.subtract(used);
        let mut fields: Vec<(&str, Field<'_>)> = vec![
            ("id", Str(Cow::Owned(format!("{}:{}", node.host, NM_PORT)))),
            ("rack", Str(Cow::Borrowed(&node.rack))),
            ("state", State(&node.state)),
            ("nodeHostName", Str(Cow::Borrowed(&node.host))),
            ("nodeHTTPAddress", Str(Cow::Borrowed(&node.http_address))),
            ("lastHealthUpdate", Num(self.last_health_update_ms)),
            (
                "version",
                Str(Cow::Borrowed(concat!("gpuam-", env!("CARGO_PKG_VERSION")))),
            ),
            ("healthReport", Str(Cow::Borrowed(""))),
            ("numContainers", Num(u64::from(self.num_containers))),
            ("usedMemoryMB", Num(used.memory_mb)),
            ("availMemoryMB", Num(avail.memory_mb)),
            ("usedVirtualCores", Num(u64::from(used.cpu))),
            ("availableVirtualCores", Num(u64::from(avail.cpu))),
            ("nodeLabels", Labels(&node.labels)),
            (
                "gpuType",
                Str(Cow::Borrowed(node.gpu_type.as_deref().unwrap_or_default())),
            ),
            ("gpuAttribute", Str(Cow::Owned(mask_hex(total.gpu_mask)))),
            ("usedGpuAttribute", Str(Cow::Owned(mask_hex(used.gpu_mask)))),
            ("portRanges", Str(Cow::Owned(total.ports.to_string()))),
            ("usedPortRanges", Str(Cow::Owned(used.ports.to_string()))),
            (
                "gpuTopology",
                Str(node
                    .topology
                    .as_ref()
                    .map_or(Cow::Borrowed("none"), |t| Cow::Owned(topology_wire(t)))),
            ),
            ("totalResource", Resource(ResourceInfo::of(total))),
            ("usedResource", Resource(ResourceInfo::of(used))),
            ("availableResource", Resource(ResourceInfo::of(&avail))),
        ];
        // Issue 15's extensions, only where there is something to say, so a node without
        // shares or custom resources reads exactly as before.
        if !used.gpu_shares.is_empty() {
            fields.push(("usedGpuShares", Shares(&used.gpu_shares)));
        }
        if !total.custom.is_empty() {
            fields.push(("customResources", Custom(&total.custom)));
            fields.push(("usedCustomResources", Custom(&used.custom)));
        }
        // gpuam's extension: the address the node's containers are reached at (agents, Ray).
        if let Some(ip) = node.ip {
            fields.push(("nodeIp", Str(Cow::Owned(ip.to_string()))));
        }
        // gpuam's extension (issue 27): when the node's running work reaches its declared
        // limits; absent when unknown.
        if let Some(ms) = node.drain_by_ms {
            fields.push(("drainByMs", Num(ms)));
        }
        match self.form {
            ObjectForm::Whole => {}
            ObjectForm::Lean => fields.retain(|(k, _)| !NOT_IN_LEAN_VIEW.contains(k)),
            ObjectForm::Shape => fields.retain(|(k, _)| !NOT_IN_LEAN_VIEW.contains(k) && !NODE_IDENTITY.contains(k)),
        }
        fields.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let mut m = s.serialize_map(Some(fields.len()))?;
        for (k, v) in &fields {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// The fields of [`node_to_json`] that gpuam's own reader ([`parse_node_listing`]) does
/// without: YARN's resource blocks (it reads the flat memory and vCore fields and the GPU
/// masks), the id, version, health and container count. Left out of the lean listing
/// (`GET /ws/v1/cluster/nodes?view=lean`, what AMs read), which parses to the same nodes in
/// a fifth of the bytes (issue 29: a hundred AMs reading a 10,000-node listing).
pub const NOT_IN_LEAN_VIEW: [&str; 8] = [
    "totalResource",
    "usedResource",
    "availableResource",
    "id",
    "version",
    "healthReport",
    "lastHealthUpdate",
    "numContainers",
];

/// A node as the lean listing has it: [`node_to_json`] less [`NOT_IN_LEAN_VIEW`].
pub fn node_to_lean_json(node: &Node, num_containers: u32, last_health_update_ms: u64) -> Value {
    serde_json::to_value(NodeObject {
        node,
        num_containers,
        last_health_update_ms,
        form: ObjectForm::Lean,
    })
    .unwrap_or(Value::Null)
}

/// `{"nodes":{"node":[...]}}` for a list of (node, live container count).
pub fn nodes_to_json<'a>(nodes: impl IntoIterator<Item = (&'a Node, u32)>, last_health_update_ms: u64) -> Value {
    let list: Vec<Value> = nodes
        .into_iter()
        .map(|(n, c)| node_to_json(n, c, last_health_update_ms))
        .collect();
    json!({ "nodes": { "node": list } })
}

/// YARN 3 `ResourceInfo`: memory, vCores and the resource-types list with `yarn.io/gpu`
/// (custom resources are YARN resource types too). Serialised with sorted keys, as
/// [`NodeObject`].
struct ResourceInfo {
    memory: u64,
    vcores: u32,
    /// (name, units, value) of each resource type.
    infos: Vec<(String, &'static str, u64)>,
}

impl ResourceInfo {
    fn of(r: &Resources) -> Self {
        let mut infos = vec![
            ("memory-mb".to_string(), "Mi", r.memory_mb),
            ("vcores".to_string(), "", u64::from(r.cpu)),
            (YARN_GPU.to_string(), "", u64::from(r.gpu_count())),
        ];
        infos.extend(r.custom.iter().map(|(n, q)| (n.to_string(), "", q)));
        ResourceInfo {
            memory: r.memory_mb,
            vcores: r.cpu,
            infos,
        }
    }
}

impl serde::Serialize for ResourceInfo {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        struct Entry<'a>(&'a (String, &'static str, u64));
        impl serde::Serialize for Entry<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let (name, units, value) = self.0;
                let mut m = s.serialize_map(Some(6))?;
                m.serialize_entry("maximumAllocation", &i64::MAX)?;
                m.serialize_entry("minimumAllocation", &0)?;
                m.serialize_entry("name", name)?;
                m.serialize_entry("resourceType", "COUNTABLE")?;
                m.serialize_entry("units", units)?;
                m.serialize_entry("value", value)?;
                m.end()
            }
        }
        struct List<'a>(&'a [(String, &'static str, u64)]);
        impl serde::Serialize for List<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut m = s.serialize_map(Some(1))?;
                m.serialize_entry("resourceInformation", &self.0.iter().map(Entry).collect::<Vec<_>>())?;
                m.end()
            }
        }
        let mut m = s.serialize_map(Some(3))?;
        m.serialize_entry("memory", &self.memory)?;
        m.serialize_entry("resourceInformations", &List(&self.infos))?;
        m.serialize_entry("vCores", &self.vcores)?;
        m.end()
    }
}

/// Reads a node listing: `{"nodes":{"node":[...]}}` in every tolerated spelling, a
/// single `{"node":{...}}` answer, or a bare array of node objects.
pub fn parse_nodes_json(text: &str) -> Result<Vec<Node>, NodeJsonError> {
    parse_node_listing(text).map(|l| l.nodes)
}

/// gpuam's versioned node listing (DESIGN.md §3): `GET /ws/v1/cluster/nodes` answers with
/// a `nodesVersion`, and `?since=<nodesVersion>` with only the nodes changed since that
/// version (`changedSince` set). A listing without them (another RM) is a whole one.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeListing {
    pub nodes: Vec<Node>,
    /// The version this listing brings the reader's view to.
    pub version: Option<String>,
    /// Set on an answer of changes only: the version they apply to.
    pub changed_since: Option<String>,
}

/// The top-level field of a listing's version.
pub const NODES_VERSION: &str = "nodesVersion";
/// The top-level field of an answer of changes only.
pub const CHANGED_SINCE: &str = "changedSince";

/// Reads a node listing as [`parse_nodes_json`] does, with its version fields.
pub fn parse_node_listing(text: &str) -> Result<NodeListing, NodeJsonError> {
    // A listing object is read node by node (issue 29: a 10,000-node listing is 10 MB;
    // as one `Value` tree it cost an AM some 200 MB and most of its start); anything
    // else, and text that is not JSON, the whole-tree way below, with its messages.
    let mut stream = ListingStream::default();
    // Sized once: a node object or entry names its host once (growing a list of 10,000
    // nodes by doubling wrote and faulted in twice its memory, issue 29). A host name
    // also met in other text only makes the guess larger.
    let hint = text.matches("\"nodeHostName\"").count();
    stream.listing.nodes.reserve(hint.min(text.len() / 32));
    let mut de = serde_json::Deserializer::from_str(text);
    match serde::Deserializer::deserialize_map(&mut de, &mut stream).and_then(|()| de.end()) {
        Ok(()) => return Ok(stream.listing),
        Err(e) => {
            if let Some(failed) = stream.failed {
                return Err(failed);
            }
            tracing::trace!(error = %e, "node listing: read as a whole");
        }
    }
    let v: Value = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(text).map_err(|e| NodeJsonError::Json(e.to_string()))?
    };
    let field = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
    Ok(NodeListing {
        version: field(NODES_VERSION),
        changed_since: field(CHANGED_SINCE),
        nodes: nodes_of_listing(&v)?,
    })
}

fn nodes_of_listing(v: &Value) -> Result<Vec<Node>, NodeJsonError> {
    let items = match v {
        Value::Object(top) => match top.get("nodes") {
            Some(nodes) => match nodes {
                Value::Object(inner) => list_items(inner.get("node"), "nodes.node")?,
                other => list_items(Some(other), "nodes")?,
            },
            // `GET /ws/v1/cluster/nodes/{id}` answers `{"node": {...}}`.
            None => list_items(top.get("node"), "node")?,
        },
        other => list_items(Some(other), "(top level)")?,
    };
    // Nodes of a listing mostly name the same few topologies: each is built once per
    // listing and shared (a 10,000-node listing built its tables 10,000 times).
    let mut topologies = Topologies::new();
    items
        .iter()
        .enumerate()
        .map(|(i, item)| parse_node_at(i, item, &mut topologies))
        .collect()
}

/// Reads the usual listing, `{"nodes": {"node": [...]}, ...}`, as [`parse_node_listing`]
/// reads it from its `Value` tree, one node object at a time: the same fields and node
/// reader ([`parse_node_at`]), without holding the whole tree. Any other shape is refused
/// with a serde error (the caller then reads it the whole-tree way); a node that cannot be
/// read is `failed`.
#[derive(Default)]
struct ListingStream {
    listing: NodeListing,
    topologies: Topologies,
    failed: Option<NodeJsonError>,
    /// A compact listing's shapes (`nodes.shapes`, read before `nodes.node`), each read
    /// once as a node without its identity; `None` for a listing of whole node objects.
    shapes: Option<Vec<Node>>,
}

impl ListingStream {
    fn fail<E: serde::de::Error>(&mut self, e: NodeJsonError) -> E {
        let message = e.to_string();
        self.failed = Some(e);
        E::custom(message)
    }

    /// `nodes.shapes`: each shape read once, as a node named after its place.
    fn read_shapes<E: serde::de::Error>(&mut self, shapes: Vec<Value>) -> Result<(), E> {
        let mut read = Vec::with_capacity(shapes.len());
        for (k, mut v) in shapes.into_iter().enumerate() {
            let read_one = match &mut v {
                Value::Object(o) => {
                    o.insert("nodeHostName".into(), Value::String(format!("(shape {k})")));
                    parse_node_at(k, &v, &mut self.topologies)
                }
                other => Err(NodeJsonError::Node {
                    index: k,
                    host: format!("(shape {k})"),
                    field: "(shape)".into(),
                    message: format!("expected a node object, found {}", kind(other)),
                }),
            };
            match read_one {
                Ok(mut node) => {
                    // Each entry brings its own host and rack: the shape holds none, so
                    // none is copied per node only to be replaced.
                    node.host = String::new();
                    node.rack = String::new();
                    read.push(node)
                }
                Err(e) => return Err(self.fail(e)),
            }
        }
        self.shapes = Some(read);
        Ok(())
    }

    /// One compact entry: its shape's node with the entry's identity.
    fn node_of_entry(&self, e: NodeEntry) -> Result<Node, NodeJsonError> {
        let index = self.listing.nodes.len();
        let err = |field: &str, message: String| NodeJsonError::Node {
            index,
            host: e.host.clone(),
            field: field.to_string(),
            message,
        };
        let shapes = self.shapes.as_deref().unwrap_or_default();
        let Some(k) = e.shape else {
            return Err(err(SHAPE, "missing: a compact listing's node names its shape".into()));
        };
        let Some(shape) = shapes.get(k) else {
            return Err(err(SHAPE, format!("no shape {k} (the listing has {})", shapes.len())));
        };
        if e.host.trim().is_empty() {
            return Err(err("nodeHostName", "empty".into()));
        }
        let ip = match e.ip.as_deref().map(str::trim).filter(|s| !s.is_empty()) {
            None => None,
            Some(s) => Some(
                s.parse::<std::net::IpAddr>()
                    .map_err(|x| err("nodeIp", format!("`{s}` is not an IP address: {x}")))?,
            ),
        };
        let mut node = shape.clone();
        node.rack = e
            .rack
            .filter(|r| !r.trim().is_empty())
            .unwrap_or_else(|| "/default-rack".into());
        node.http_address = e.http_address;
        node.host = e.host;
        node.ip = ip;
        node.drain_by_ms = e.drain_by_ms;
        Ok(node)
    }
}

impl<'de> serde::de::Visitor<'de> for &mut ListingStream {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a node listing object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut listed = false;
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                NODES_VERSION => self.listing.version = map.next_value::<Value>()?.as_str().map(str::to_string),
                CHANGED_SINCE => self.listing.changed_since = map.next_value::<Value>()?.as_str().map(str::to_string),
                "nodes" if !listed => {
                    listed = true;
                    map.next_value_seed(Nodes(&mut *self))?;
                }
                // A repeated `nodes` or a single `node`: the tree's way.
                "nodes" | "node" => return Err(serde::de::Error::custom("not the usual listing")),
                _ => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        if listed {
            Ok(())
        } else {
            Err(serde::de::Error::custom("not the usual listing"))
        }
    }
}

/// The `nodes` object, whose `node` list is read element by element.
struct Nodes<'s>(&'s mut ListingStream);

impl<'de> serde::de::DeserializeSeed<'de> for Nodes<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Nodes<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an object with a `node` list")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut listed = false;
        while let Some(key) = map.next_key::<String>()? {
            if key == "shapes" {
                if listed || self.0.shapes.is_some() {
                    return Err(serde::de::Error::custom("`shapes` after the `node` list, or twice"));
                }
                match map.next_value::<Value>()? {
                    Value::Array(shapes) => self.0.read_shapes(shapes)?,
                    other => {
                        let e = NodeJsonError::Listing {
                            field: "nodes.shapes".into(),
                            message: format!("expected a list of node objects, found {}", kind(&other)),
                        };
                        return Err(self.0.fail(e));
                    }
                }
            } else if key != "node" {
                map.next_value::<serde::de::IgnoredAny>()?;
            } else if listed {
                return Err(serde::de::Error::custom("a repeated `node`"));
            } else {
                listed = true;
                map.next_value_seed(NodeList(&mut *self.0))?;
            }
        }
        if listed {
            Ok(())
        } else {
            Err(serde::de::Error::custom("no `node` list"))
        }
    }
}

/// `nodes.node` as a list: each element read as a node and dropped before the next.
struct NodeList<'s>(&'s mut ListingStream);

impl<'de> serde::de::DeserializeSeed<'de> for NodeList<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> serde::de::Visitor<'de> for NodeList<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of node objects")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let st = self.0;
        if st.shapes.is_some() {
            // A compact listing: each entry is its shape's node with its own identity.
            loop {
                let index = st.listing.nodes.len();
                let entry = match seq.next_element::<NodeEntry>() {
                    Ok(Some(e)) => e,
                    Ok(None) => return Ok(()),
                    Err(e) => {
                        let e = NodeJsonError::Node {
                            index,
                            host: "?".into(),
                            field: "(entry)".into(),
                            message: e.to_string(),
                        };
                        return Err(st.fail(e));
                    }
                };
                match st.node_of_entry(entry) {
                    Ok(node) => st.listing.nodes.push(node),
                    Err(e) => return Err(st.fail(e)),
                }
            }
        }
        while let Some(v) = seq.next_element::<Value>()? {
            match parse_node_at(st.listing.nodes.len(), &v, &mut st.topologies) {
                Ok(node) => st.listing.nodes.push(node),
                Err(e) => {
                    let message = e.to_string();
                    st.failed = Some(e);
                    return Err(serde::de::Error::custom(message));
                }
            }
        }
        Ok(())
    }
}

/// The topologies read so far in one listing, by their wire text.
type Topologies = std::collections::HashMap<String, Option<Arc<Topology>>>;

/// Reads one node object (e.g. an `updatedNodes` entry of an allocate answer).
pub fn parse_node_value(v: &Value) -> Result<Node, NodeJsonError> {
    parse_node_at(0, v, &mut Topologies::new())
}

/// One node as an allocate answer reports it (`updatedNodes`): on the wire the YARN node
/// object [`node_to_json`] writes, typed on both ends.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeReport {
    pub node: Node,
    /// Live containers on it.
    pub num_containers: u32,
    /// Milliseconds since the epoch.
    pub last_health_update_ms: u64,
}

impl serde::Serialize for NodeReport {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        NodeObject {
            node: &self.node,
            num_containers: self.num_containers,
            last_health_update_ms: self.last_health_update_ms,
            form: ObjectForm::Whole,
        }
        .serialize(s)
    }
}

impl NodeReport {
    /// One report from its node object, its topology looked up in (or added to) those
    /// already read.
    fn of_value(i: usize, v: &Value, topologies: &mut Topologies) -> Result<Self, NodeJsonError> {
        let node = parse_node_at(i, v, topologies)?;
        let num = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
        Ok(NodeReport {
            node,
            num_containers: u32::try_from(num("numContainers")).unwrap_or(u32::MAX),
            last_health_update_ms: num("lastHealthUpdate"),
        })
    }
}

impl<'de> serde::Deserialize<'de> for NodeReport {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        NodeReport::of_value(0, &v, &mut Topologies::new()).map_err(serde::de::Error::custom)
    }
}

/// Reads `updatedNodes`, leaving out (with a warning) an entry that is not a readable node
/// object, so one odd node never costs the AM the rest of an allocate answer. Each topology
/// is built once per answer, not once per node (issue 29: an answer reports about a hundred
/// nodes, and building a topology's tables was most of reading one).
pub fn readable_node_reports<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<NodeReport>, D::Error> {
    use serde::Deserialize;
    let items = Vec::<Value>::deserialize(d)?;
    let mut topologies = Topologies::new();
    Ok(items
        .iter()
        .enumerate()
        .filter_map(|(i, v)| match NodeReport::of_value(i, v, &mut topologies) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!(error = %e, "ignoring an updated node that cannot be read");
                None
            }
        })
        .collect())
}

/// A tolerant list: absent, `null`, `{}`, `""` → empty; a bare object → one item.
fn list_items<'a>(v: Option<&'a Value>, field: &str) -> Result<Vec<&'a Value>, NodeJsonError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) if s.trim().is_empty() => Ok(Vec::new()),
        Some(Value::Object(o)) if o.is_empty() => Ok(Vec::new()),
        Some(Value::Array(a)) => Ok(a.iter().collect()),
        Some(o @ Value::Object(_)) => Ok(vec![o]),
        Some(other) => Err(NodeJsonError::Listing {
            field: field.to_string(),
            message: format!("expected a list of node objects, found {}", kind(other)),
        }),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Field reader for one node object, remembering where it is for error messages.
struct Fields<'a> {
    index: usize,
    host: String,
    obj: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn err(&self, field: &str, message: impl Into<String>) -> NodeJsonError {
        NodeJsonError::Node {
            index: self.index,
            host: self.host.clone(),
            field: field.to_string(),
            message: message.into(),
        }
    }

    /// A present, non-null, non-empty-string value.
    fn get(&self, field: &str) -> Option<&'a Value> {
        present(self.obj.get(field))
    }

    fn string(&self, field: &str) -> Result<Option<String>, NodeJsonError> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Number(n)) => Ok(Some(n.to_string())),
            Some(other) => Err(self.err(field, format!("expected a string, found {}", kind(other)))),
        }
    }

    fn number(&self, field: &str) -> Result<Option<u64>, NodeJsonError> {
        number_of(self.get(field)).map_err(|m| self.err(field, m))
    }

    /// A `ResourceInfo` object's memory, vCores and GPU count (each optional).
    fn resource(&self, field: &str) -> Result<ResourceCounts, NodeJsonError> {
        let Some(v) = self.get(field) else {
            return Ok(ResourceCounts::default());
        };
        let Value::Object(o) = v else {
            return Err(self.err(field, format!("expected an object, found {}", kind(v))));
        };
        let sub = |name: &str| format!("{field}.{name}");
        let mut out = ResourceCounts {
            memory: number_of(present(o.get("memory"))).map_err(|m| self.err(&sub("memory"), m))?,
            vcores: number_of(present(o.get("vCores"))).map_err(|m| self.err(&sub("vCores"), m))?,
            gpus: None,
        };
        let infos = match present(o.get("resourceInformations")) {
            Some(Value::Object(ri)) => list_items(ri.get("resourceInformation"), "")
                .map_err(|_| self.err(&sub("resourceInformations.resourceInformation"), "expected a list"))?,
            Some(other) => list_items(Some(other), "")
                .map_err(|_| self.err(&sub("resourceInformations"), "expected an object or a list"))?,
            None => Vec::new(),
        };
        for info in infos {
            let Value::Object(e) = info else { continue };
            let name = e.get("name").and_then(Value::as_str).unwrap_or("");
            let value = || {
                number_of(present(e.get("value")))
                    .map_err(|m| self.err(&format!("{field}.resourceInformations[{name}].value"), m))
            };
            match name {
                YARN_GPU => out.gpus = value()?,
                "memory-mb" if out.memory.is_none() => out.memory = value()?,
                "vcores" if out.vcores.is_none() => out.vcores = value()?,
                _ => {}
            }
        }
        Ok(out)
    }

    fn mask(&self, field: &str) -> Result<Option<GpuMask>, NodeJsonError> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Number(n)) => n
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.err(field, format!("`{n}` is not a GPU mask (write it like \"0x3f\")"))),
            Some(Value::String(s)) => parse_mask(s)
                .map(Some)
                .ok_or_else(|| self.err(field, format!("`{s}` is not a GPU mask (write it like \"0x3f\")"))),
            Some(other) => Err(self.err(field, format!("expected a hex GPU mask string, found {}", kind(other)))),
        }
    }

    /// `"20000-29999,31000"`, or a list of `{begin, end}` objects / numbers.
    fn ports(&self, field: &str) -> Result<PortSet, NodeJsonError> {
        match self.get(field) {
            None => Ok(PortSet::new()),
            Some(Value::String(s)) => PortSet::parse(s).map_err(|e| self.err(field, e.to_string())),
            Some(Value::Array(items)) => {
                let mut ranges = Vec::new();
                for it in items {
                    let port = |v: Option<&Value>| v.and_then(Value::as_u64).and_then(|p| u16::try_from(p).ok());
                    let r = match it {
                        Value::Object(o) => match (port(o.get("begin")), port(o.get("end"))) {
                            (Some(b), Some(e)) if b <= e => Some(PortRange::new(b, e)),
                            _ => None,
                        },
                        n @ Value::Number(_) => port(Some(n)).map(|p| PortRange::new(p, p)),
                        _ => None,
                    };
                    ranges.push(r.ok_or_else(|| {
                        self.err(
                            field,
                            format!("`{it}` is not a port range (write \"20000-29999,31000\")"),
                        )
                    })?);
                }
                Ok(PortSet::from_ranges(ranges))
            }
            Some(other) => Err(self.err(field, format!("expected a port-range string, found {}", kind(other)))),
        }
    }

    /// `{"0": "0.75"}`: hundredths used on shared GPUs.
    fn shares(&self, field: &str) -> Result<GpuShares, NodeJsonError> {
        match self.get(field) {
            None => Ok(GpuShares::new()),
            Some(v) => serde_json::from_value(v.clone()).map_err(|e| self.err(field, e.to_string())),
        }
    }

    /// `{"nvme": 2}`: custom resources.
    fn custom(&self, field: &str) -> Result<CustomResources, NodeJsonError> {
        match self.get(field) {
            None => Ok(CustomResources::new()),
            Some(v) => serde_json::from_value(v.clone()).map_err(|e| self.err(field, e.to_string())),
        }
    }

    fn labels(&self, field: &str) -> Result<Vec<String>, NodeJsonError> {
        let mut out = match self.get(field) {
            None => Vec::new(),
            Some(Value::String(s)) => s
                .split(',')
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(String::from)
                .collect(),
            Some(Value::Array(a)) => {
                let mut v = Vec::new();
                for l in a {
                    match l {
                        Value::String(s) if !s.trim().is_empty() => v.push(s.trim().to_string()),
                        Value::String(_) | Value::Null => {}
                        other => return Err(self.err(field, format!("expected label strings, found {}", kind(other)))),
                    }
                }
                v
            }
            Some(Value::Object(o)) if o.is_empty() => Vec::new(),
            Some(other) => return Err(self.err(field, format!("expected a list of strings, found {}", kind(other)))),
        };
        out.dedup();
        Ok(out)
    }
}

#[derive(Default)]
struct ResourceCounts {
    memory: Option<u64>,
    vcores: Option<u64>,
    gpus: Option<u64>,
}

/// `null`, `""` and `{}` mean "not there".
fn present(v: Option<&Value>) -> Option<&Value> {
    match v {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.trim().is_empty() => None,
        Some(Value::Object(o)) if o.is_empty() => None,
        other => other,
    }
}

/// A count: integers up to u64 (negative ones, which overcommitted RMs print for
/// "available", read as 0), integral floats, or a decimal string.
fn number_of(v: Option<&Value>) -> Result<Option<u64>, String> {
    match v {
        None => Ok(None),
        Some(Value::Number(n)) => {
            if let Some(u) = n.as_u64() {
                Ok(Some(u))
            } else if n.as_i64().is_some() {
                Ok(Some(0))
            } else {
                match n.as_f64() {
                    Some(f) if f.is_finite() => Ok(Some(if f <= 0.0 { 0 } else { f as u64 })),
                    _ => Err(format!("`{n}` is not a count")),
                }
            }
        }
        Some(Value::String(s)) => s
            .trim()
            .parse::<u64>()
            .map(Some)
            .map_err(|_| format!("`{s}` is not a count (expected a whole number)")),
        Some(other) => Err(format!("expected a number, found {}", kind(other))),
    }
}

fn to_u32(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn parse_node_at(index: usize, v: &Value, topologies: &mut Topologies) -> Result<Node, NodeJsonError> {
    let Value::Object(obj) = v else {
        return Err(NodeJsonError::Node {
            index,
            host: "?".into(),
            field: "(node)".into(),
            message: format!("expected a node object, found {}", kind(v)),
        });
    };
    let mut f = Fields {
        index,
        host: "?".into(),
        obj,
    };
    if obj.contains_key(SHAPE) {
        // Read as a node object, a compact entry would be a node with nothing on it.
        f.host = f.string("nodeHostName")?.unwrap_or_else(|| "?".into());
        return Err(f.err(
            SHAPE,
            "a compact listing's node entry, but the listing has no `nodes.shapes` before its `nodes.node`",
        ));
    }
    let id = f.string("id")?;
    let host = match f.string("nodeHostName")? {
        Some(h) => h,
        None => match id.as_deref() {
            // `host:port`; a bracketed IPv6 id keeps its brackets off.
            Some(id) => id
                .rsplit_once(':')
                .map(|(h, _)| h)
                .unwrap_or(id)
                .trim_matches(|c| c == '[' || c == ']')
                .to_string(),
            None => return Err(f.err("nodeHostName", "missing (and no `id` to take the host from)")),
        },
    };
    f.host = host.clone();

    let rack = f.string("rack")?.unwrap_or_else(|| "/default-rack".into());
    let state = match f.string("state")? {
        None => NodeState::Running,
        Some(s) => serde_json::from_value::<NodeState>(Value::String(s.trim().to_ascii_uppercase())).map_err(|_| {
            f.err(
                "state",
                format!("unknown node state `{s}` (expected NEW, RUNNING, UNHEALTHY, DECOMMISSIONING, DECOMMISSIONED, LOST, REBOOTED or SHUTDOWN)"),
            )
        })?,
    };
    let labels = f.labels("nodeLabels")?;
    let gpu_type = f
        .string("gpuType")?
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());
    let http_address = f.string("nodeHTTPAddress")?.unwrap_or_default();
    let ip = match f.string("nodeIp")?.filter(|s| !s.trim().is_empty()) {
        None => None,
        Some(s) => Some(
            s.trim()
                .parse::<std::net::IpAddr>()
                .map_err(|e| f.err("nodeIp", format!("`{s}` is not an IP address: {e}")))?,
        ),
    };

    let total_ri = f.resource("totalResource")?;
    let used_ri = f.resource("usedResource")?;
    let avail_ri = f.resource("availableResource")?;

    let used_mem = f.number("usedMemoryMB")?.or(used_ri.memory).unwrap_or(0);
    let avail_mem = f.number("availMemoryMB")?.or(avail_ri.memory).unwrap_or(0);
    let used_cpu = f.number("usedVirtualCores")?.or(used_ri.vcores).unwrap_or(0);
    let avail_cpu = f.number("availableVirtualCores")?.or(avail_ri.vcores).unwrap_or(0);
    let total_mem = total_ri.memory.unwrap_or_else(|| used_mem.saturating_add(avail_mem));
    let total_cpu = total_ri.vcores.unwrap_or_else(|| used_cpu.saturating_add(avail_cpu));

    // GPUs: our mask extension when present; otherwise YARN's count means GPUs 0..n-1.
    let gpu_count = total_ri
        .gpus
        .or_else(|| match (used_ri.gpus, avail_ri.gpus) {
            (None, None) => None,
            (u, a) => Some(u.unwrap_or(0).saturating_add(a.unwrap_or(0))),
        })
        .unwrap_or(0);
    let total_mask = match f.mask("gpuAttribute")? {
        Some(m) if m != 0 || gpu_count == 0 => m,
        _ => mask_of_count(to_u32(gpu_count)),
    };
    let used_mask = match f.mask("usedGpuAttribute")? {
        Some(m) => m & total_mask,
        None => {
            let n = to_u32(used_ri.gpus.unwrap_or(0)).min(total_mask.count_ones());
            lowest_bits(total_mask, n).unwrap_or(0)
        }
    };
    let total_ports = f.ports("portRanges")?;
    let used_ports = f.ports("usedPortRanges")?;

    let topology = match f.string("gpuTopology")? {
        None => None,
        Some(text) => match topologies.get(&text) {
            Some(t) => t.clone(),
            None => {
                let t = match Topology::from_spec(&text) {
                    Ok(t) => t.map(Arc::new),
                    Err(e) => {
                        tracing::debug!(host = %host, "node #{index}: ignoring gpuTopology: {e}");
                        None
                    }
                };
                topologies.insert(text, t.clone());
                t
            }
        },
    };

    let used_shares = f.shares("usedGpuShares")?;
    if used_shares.mask() & !used_mask != 0 {
        return Err(f.err(
            "usedGpuShares",
            format!(
                "names GPUs {} that usedGpuAttribute {} does not",
                mask_hex(used_shares.mask() & !used_mask),
                mask_hex(used_mask)
            ),
        ));
    }
    let total_custom = f.custom("customResources")?;
    let used_custom = f.custom("usedCustomResources")?;

    let total = Resources::with_mask(to_u32(total_cpu), total_mem, total_mask, total_ports).with_custom(total_custom);
    let mut used = Resources::with_mask(to_u32(used_cpu), used_mem, used_mask, used_ports).with_custom(used_custom);
    used.gpu_shares = used_shares;
    let mut node = Node::new(host, rack, total);
    node.labels = labels;
    node.gpu_type = gpu_type;
    node.topology = topology;
    node.state = state;
    node.http_address = http_address;
    node.ip = ip;
    node.drain_by_ms = f.number("drainByMs")?;
    node.set_used(used);
    Ok(node)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A compact listing of `nodes` as the RM writes one: each node's shape, then its entry.
    fn compact(nodes: &[Node]) -> String {
        let mut shapes: Vec<String> = Vec::new();
        let mut entries = Vec::new();
        for n in nodes {
            let shape = String::from_utf8(node_json_bytes(n, 1, 2, ObjectForm::Shape)).unwrap();
            let k = shapes.iter().position(|s| *s == shape).unwrap_or_else(|| {
                shapes.push(shape);
                shapes.len() - 1
            });
            let entry = String::from_utf8(node_entry_bytes(n)).unwrap();
            entries.push(format!(r#"{{"shape":{k},{}"#, &entry[1..]));
        }
        format!(
            r#"{{"nodes":{{"shapes":[{}],"node":[{}]}},"nodesVersion":"1-2"}}"#,
            shapes.join(","),
            entries.join(",")
        )
    }

    #[test]
    fn a_compact_listing_reads_as_its_nodes() {
        let a = sample_node();
        let mut b = sample_node();
        b.host = "gpu-2".into();
        b.rack = "/rack-b".into();
        b.ip = None;
        b.http_address = String::new();
        // Its own drain (issue 27) rides with its identity: the shape stays shared.
        b.drain_by_ms = Some(1_700_000_360_000);
        let mut c = sample_node();
        c.host = "gpu-\"3\"".into();
        c.state = NodeState::Lost;
        let text = compact(&[a.clone(), b.clone(), c.clone()]);
        // a and b share their shape; c's state differs.
        assert_eq!(text.matches("\"gpuTopology\"").count(), 2, "{text}");
        let read = parse_node_listing(&text).unwrap();
        assert_eq!(read.nodes, vec![a, b, c]);
        assert_eq!(read.version.as_deref(), Some("1-2"));
    }

    #[test]
    fn a_bad_compact_listing_is_refused_with_the_node_and_field_named() {
        let shape = String::from_utf8(node_json_bytes(&sample_node(), 0, 0, ObjectForm::Shape)).unwrap();
        let err = |node: &str| {
            let text = format!(r#"{{"nodes":{{"shapes":[{shape}],"node":[{node}]}}}}"#);
            parse_node_listing(&text).unwrap_err().to_string()
        };
        let e = err(r#"{"shape":1,"nodeHostName":"h1"}"#);
        assert!(
            e.contains("node #0 (h1)") && e.contains("`shape`") && e.contains("no shape 1"),
            "{e}"
        );
        let e = err(r#"{"nodeHostName":"h1"}"#);
        assert!(e.contains("`shape`") && e.contains("missing"), "{e}");
        let e = err(r#"{"shape":0,"nodeHostName":"h1","nodeIp":"ten"}"#);
        assert!(e.contains("`nodeIp`") && e.contains("not an IP address"), "{e}");
        let e = err(r#"{"shape":0}"#);
        assert!(e.contains("node #0") && e.contains("nodeHostName"), "{e}");
        // A shape that is not a node object, and entries with no shapes before them.
        let e = parse_node_listing(r#"{"nodes":{"shapes":[3],"node":[]}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("shape 0") && e.contains("expected a node object"), "{e}");
        let e = parse_node_listing(r#"{"nodes":{"shapes":{},"node":[]}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("nodes.shapes"), "{e}");
        for text in [
            r#"{"nodes":{"node":[{"shape":0,"nodeHostName":"h1"}]}}"#.to_string(),
            format!(r#"{{"nodes":{{"node":[{{"shape":0,"nodeHostName":"h1"}}],"shapes":[{shape}]}}}}"#),
        ] {
            let e = parse_node_listing(&text).unwrap_err().to_string();
            assert!(e.contains("(h1)") && e.contains("no `nodes.shapes` before"), "{e}");
        }
    }

    fn sample_node() -> Node {
        let mut n = Node::new(
            "gpu-1",
            "/rack-a",
            Resources::with_mask(32, 262_144, 0xff, PortSet::parse("20000-29999,31000").unwrap()),
        );
        n.labels = vec!["gpu".into()];
        n.gpu_type = Some("V100".into());
        n.http_address = "http://127.0.0.1:8088".into();
        n.ip = Some("10.1.2.3".parse().unwrap());
        n.set_used(Resources::with_mask(
            8,
            65_536,
            0x0c,
            PortSet::parse("20001-20002").unwrap(),
        ));
        n
    }

    #[test]
    fn round_trip_own_output() {
        let a = sample_node();
        let mut b = Node::new("cpu-1", "/rack-b", Resources::with_mask(4, 8192, 0, PortSet::new()));
        b.state = NodeState::Lost;
        let text = nodes_to_json([(&a, 2), (&b, 0)], 1_700_000_000_000).to_string();
        let back = parse_nodes_json(&text).unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(back[0], a, "every field of the node survives the round trip");
        assert_eq!(back[1].total(), b.total());
        assert_eq!(back[1].used(), b.used());
        assert_eq!(back[1].state, NodeState::Lost);
        assert_eq!(back[1].gpu_type, None);
        assert!(back[1].labels.is_empty());
        // The drain (issue 27) goes out only when known, and reads back as it went.
        assert!(!text.contains("drainByMs"));
        assert_eq!(back[1].drain_by_ms, None);
        let mut c = sample_node();
        c.drain_by_ms = Some(1_700_000_360_000);
        let text = nodes_to_json([(&c, 1)], 1_700_000_000_000).to_string();
        assert_eq!(parse_nodes_json(&text).unwrap()[0], c);
        let bad = text.replace("1700000360000", "\"soon\"");
        assert!(parse_nodes_json(&bad).unwrap_err().to_string().contains("drainByMs"));
    }

    /// The usual listing is read node by node (issue 29); it reads as the whole tree does,
    /// versions and topologies included, and a bad node is named the same way.
    #[test]
    fn a_listing_read_node_by_node_reads_as_its_tree() {
        let mut a = sample_node();
        a.topology = Topology::from_spec("pcie8").unwrap().map(Arc::new);
        let mut b = a.clone();
        b.host = "gpu-2".into();
        let mut v = nodes_to_json([(&a, 1), (&b, 0)], 1_700_000_000_000);
        v[NODES_VERSION] = json!("7.3");
        v[CHANGED_SINCE] = json!("7.1");
        v["other"] = json!({"ignored": [1, 2]});
        let text = v.to_string();
        let streamed = parse_node_listing(&text).unwrap();
        let tree = NodeListing {
            nodes: nodes_of_listing(&v).unwrap(),
            version: Some("7.3".into()),
            changed_since: Some("7.1".into()),
        };
        assert_eq!(streamed, tree);
        assert_eq!(streamed.nodes[0], a);
        // One topology shared by the listing's nodes.
        let (ta, tb) = (streamed.nodes[0].topology.as_ref(), streamed.nodes[1].topology.as_ref());
        assert!(Arc::ptr_eq(ta.unwrap(), tb.unwrap()));
        // A bad second node: the same error as the tree's.
        v["nodes"]["node"][1]["usedMemoryMB"] = json!("lots");
        assert_eq!(
            parse_node_listing(&v.to_string()),
            Err(nodes_of_listing(&v).unwrap_err())
        );
        // Not JSON: the tree's message.
        assert!(matches!(
            parse_node_listing(&text[..text.len() - 3]),
            Err(NodeJsonError::Json(_))
        ));
    }

    #[test]
    fn shares_and_custom_resources_round_trip_and_appear_only_when_present() {
        let mut n = Node::new(
            "g",
            "/r",
            Resources::with_mask(8, 1000, 0x3, PortSet::new()).with_custom(CustomResources::from_pairs([("nvme", 2)])),
        );
        let used =
            Resources::with_share(1, 10, 0, 75, PortSet::new()).with_custom(CustomResources::from_pairs([("nvme", 1)]));
        n.set_used(used);
        let v = node_to_json(&n, 3, 5);
        assert_eq!(v["usedGpuShares"], json!({"0": "0.75"}));
        assert_eq!(v["customResources"], json!({"nvme": 2}));
        assert_eq!(v["usedCustomResources"], json!({"nvme": 1}));
        let infos = &v["totalResource"]["resourceInformations"]["resourceInformation"];
        assert_eq!(
            (infos[3]["name"].as_str(), infos[3]["value"].as_u64()),
            (Some("nvme"), Some(2))
        );
        let back = parse_node_value(&v).unwrap();
        assert_eq!(back, n, "shares and custom resources survive the round trip");
        assert_eq!(back.free().gpu_hundredths(0), 25);
        let plain = node_to_json(&sample_node(), 2, 5);
        assert!(plain.get("usedGpuShares").is_none() && plain.get("customResources").is_none());
        let mut bad = v.clone();
        bad["usedGpuShares"] = json!({"1": "0.5"});
        let e = parse_node_value(&bad).unwrap_err().to_string();
        assert!(e.contains("usedGpuShares") && e.contains("0x2"), "{e}");
        bad["usedGpuShares"] = json!({"0": "0.001"});
        assert!(parse_node_value(&bad)
            .unwrap_err()
            .to_string()
            .contains("finer than 0.01"));
    }

    #[test]
    fn own_output_has_yarn_fields_and_extensions() {
        let v = node_to_json(&sample_node(), 2, 5);
        assert_eq!(v["id"], "gpu-1:8041");
        assert_eq!(v["numContainers"], 2);
        assert_eq!(v["availMemoryMB"], 262_144 - 65_536);
        assert_eq!(v["availableVirtualCores"], 24);
        assert_eq!(v["gpuAttribute"], "0xff");
        assert_eq!(v["usedGpuAttribute"], "0xc");
        assert_eq!(v["portRanges"], "20000-29999,31000");
        assert_eq!(v["usedPortRanges"], "20001-20002");
        assert_eq!(v["gpuTopology"], "none");
        assert_eq!(v["nodeIp"], "10.1.2.3");
        let without = Node::new("cpu-1", "/r", Resources::default());
        assert!(node_to_json(&without, 0, 5).get("nodeIp").is_none(), "no IP, no field");
        let gpu = &v["totalResource"]["resourceInformations"]["resourceInformation"][2];
        assert_eq!(gpu["name"], YARN_GPU);
        assert_eq!(gpu["value"], 8);
        assert_eq!(
            v["usedResource"]["resourceInformations"]["resourceInformation"][2]["value"],
            2
        );
    }

    /// A stock YARN 3 RM answer (ecosystem.md §1.1): GPU count only, no mask, no ports.
    const YARN3: &str = r#"{
      "nodes": {
        "node": [
          {
            "id": "gpu-node-03.example:45454",
            "rack": "/dc1/rack2",
            "state": "RUNNING",
            "nodeHostName": "gpu-node-03.example",
            "nodeHTTPAddress": "gpu-node-03.example:8042",
            "lastHealthUpdate": 1763700000000,
            "version": "3.4.1",
            "healthReport": "",
            "numContainers": 3,
            "usedMemoryMB": 98304,
            "availMemoryMB": 163840,
            "usedVirtualCores": 24,
            "availableVirtualCores": 40,
            "numRunningOpportContainers": 0,
            "nodeLabels": ["gpu"],
            "resourceUtilization": {"nodePhysicalMemoryMB": 101000, "nodeCPUUsage": 0.37},
            "totalResource": {
              "memory": 262144,
              "vCores": 64,
              "resourceInformations": {
                "resourceInformation": [
                  {"name": "memory-mb", "resourceType": "COUNTABLE", "units": "Mi",
                   "value": 262144, "minimumAllocation": 0, "maximumAllocation": 9223372036854775807},
                  {"name": "vcores", "resourceType": "COUNTABLE", "units": "",
                   "value": 64, "minimumAllocation": 0, "maximumAllocation": 9223372036854775807},
                  {"name": "yarn.io/gpu", "resourceType": "COUNTABLE", "units": "",
                   "value": 8, "minimumAllocation": 0, "maximumAllocation": 9223372036854775807}
                ]
              }
            },
            "usedResource": {"memory": 98304, "vCores": 24, "resourceInformations": {"resourceInformation": [{"name": "yarn.io/gpu", "resourceType": "COUNTABLE", "units": "", "value": 3}]}},
            "availableResource": {"memory": 163840, "vCores": 40, "resourceInformations": {"resourceInformation": [{"name": "yarn.io/gpu", "resourceType": "COUNTABLE", "units": "", "value": 5}]}}
          }
        ]
      }
    }"#;

    #[test]
    fn stock_yarn3_answer() {
        let nodes = parse_nodes_json(YARN3).unwrap();
        assert_eq!(nodes.len(), 1);
        let n = &nodes[0];
        assert_eq!(n.host, "gpu-node-03.example");
        assert_eq!(n.rack, "/dc1/rack2");
        assert_eq!(n.state, NodeState::Running);
        assert_eq!(n.labels, vec!["gpu".to_string()]);
        assert_eq!(n.http_address, "gpu-node-03.example:8042");
        assert_eq!((n.total().cpu, n.total().memory_mb), (64, 262_144));
        assert_eq!(
            (n.total().gpus, n.total().gpu_mask),
            (8, 0xff),
            "count only → GPUs 0..n-1"
        );
        assert_eq!((n.used().gpus, n.used().gpu_mask), (3, 0x7), "used count → lowest bits");
        assert_eq!((n.used().cpu, n.used().memory_mb), (24, 98_304));
        assert!(n.topology.is_none());
        assert!(n.total().ports.is_empty());
        assert_eq!(n.free().gpu_mask, 0xf8);
    }

    #[test]
    fn totals_from_used_plus_avail_without_total_resource() {
        let t = r#"{"nodes":{"node":[{"nodeHostName":"h","usedMemoryMB":100,"availMemoryMB":900,
            "usedVirtualCores":1,"availableVirtualCores":7,
            "usedResource":{"resourceInformations":{"resourceInformation":{"name":"yarn.io/gpu","value":1}}},
            "availableResource":{"resourceInformations":{"resourceInformation":[{"name":"yarn.io/gpu","value":3}]}}}]}}"#;
        let n = &parse_nodes_json(t).unwrap()[0];
        assert_eq!((n.total().cpu, n.total().memory_mb, n.total().gpu_mask), (8, 1000, 0xf));
        assert_eq!(n.used().gpu_mask, 0x1);
        assert_eq!(n.rack, "/default-rack");
        assert_eq!(n.state, NodeState::Running);
    }

    #[test]
    fn empty_listings_in_every_spelling() {
        for t in [
            r#"{"nodes":null}"#,
            r#"{"nodes":{}}"#,
            r#"{"nodes":""}"#,
            r#"{}"#,
            r#"{"nodes":{"node":null}}"#,
            r#"{"nodes":{"node":[]}}"#,
            r#"{"nodes":{"node":""}}"#,
            r#"{"nodes":{"node":{}}}"#,
            "",
        ] {
            assert_eq!(parse_nodes_json(t).unwrap(), Vec::<Node>::new(), "input {t}");
        }
    }

    #[test]
    fn single_object_instead_of_array_and_node_answer() {
        let one = r#"{"nodes":{"node":{"id":"h1:45454","usedMemoryMB":1,"availMemoryMB":1}}}"#;
        let n = parse_nodes_json(one).unwrap();
        assert_eq!(n.len(), 1);
        assert_eq!(n[0].host, "h1", "host taken from id when nodeHostName is absent");
        let single = r#"{"node":{"nodeHostName":"h2","nodeLabels":null,"gpuType":""}}"#;
        let n = parse_nodes_json(single).unwrap();
        assert_eq!(n[0].host, "h2");
        assert!(n[0].labels.is_empty());
        assert_eq!(n[0].gpu_type, None);
    }

    #[test]
    fn huge_and_odd_numbers() {
        let t = format!(
            r#"{{"nodes":{{"node":[{{"nodeHostName":"h","usedMemoryMB":-5,"availMemoryMB":{max},
               "usedVirtualCores":"2","availableVirtualCores":{max},"gpuAttribute":255,"usedGpuAttribute":"0x1"}}]}}}}"#,
            max = i64::MAX
        );
        let n = &parse_nodes_json(&t).unwrap()[0];
        assert_eq!(n.total().memory_mb, i64::MAX as u64);
        assert_eq!(n.total().cpu, u32::MAX, "saturates instead of failing");
        assert_eq!(n.used().memory_mb, 0, "negative counts read as 0");
        assert_eq!(n.used().cpu, 2);
        assert_eq!(n.total().gpu_mask, 0xff);
        assert_eq!(n.used().gpu_mask, 0x1);
    }

    #[test]
    fn unknown_topology_is_not_an_error() {
        let t = r#"{"nodes":{"node":[{"nodeHostName":"h","gpuTopology":"warp-drive-9000"}]}}"#;
        let n = parse_nodes_json(t).unwrap();
        assert!(n[0].topology.is_none());
    }

    #[test]
    fn updated_node_value_and_port_lists() {
        let v: Value = serde_json::from_str(
            r#"{"nodeHostName":"h","x":1,"portRanges":[{"begin":2000,"end":2010},3000],"usedPortRanges":"2000"}"#,
        )
        .unwrap();
        let n = parse_node_value(&v).unwrap();
        assert_eq!(n.total().ports, PortSet::parse("2000-2010,3000").unwrap());
        assert_eq!(n.used().ports, PortSet::parse("2000").unwrap());
    }

    #[test]
    fn a_node_ip_that_is_not_an_address_is_named() {
        let t = r#"{"nodes":{"node":[{"nodeHostName":"h1","nodeIp":"h1.example"}]}}"#;
        let e = parse_nodes_json(t).unwrap_err().to_string();
        assert!(
            e.contains("h1") && e.contains("nodeIp") && e.contains("not an IP address"),
            "{e}"
        );
        let t = r#"{"nodes":{"node":[{"nodeHostName":"h1","nodeIp":""}]}}"#;
        assert_eq!(parse_nodes_json(t).unwrap()[0].ip, None, "empty means unknown");
    }

    #[test]
    fn errors_name_node_and_field() {
        let t = r#"{"nodes":{"node":[{"nodeHostName":"ok"},{"nodeHostName":"bad-1","usedMemoryMB":"lots"}]}}"#;
        let e = parse_nodes_json(t).unwrap_err();
        assert!(
            matches!(&e, NodeJsonError::Node { index: 1, host, field, .. } if host == "bad-1" && field == "usedMemoryMB"),
            "{e}"
        );
        assert!(e.to_string().contains("node #1 (bad-1)"), "{e}");

        let e = parse_nodes_json(r#"{"nodes":{"node":[{"nodeHostName":"h","gpuAttribute":"0xZZ"}]}}"#).unwrap_err();
        assert!(e.to_string().contains("gpuAttribute"), "{e}");
        let e = parse_nodes_json(r#"{"nodes":{"node":[{"nodeHostName":"h","portRanges":"9-1"}]}}"#).unwrap_err();
        assert!(e.to_string().contains("portRanges"), "{e}");
        let e = parse_nodes_json(r#"{"nodes":{"node":[{"nodeHostName":"h","state":"ASLEEP"}]}}"#).unwrap_err();
        assert!(e.to_string().contains("state"), "{e}");
        let e = parse_nodes_json(r#"{"nodes":{"node":[{"rack":"/r"}]}}"#).unwrap_err();
        assert!(e.to_string().contains("nodeHostName"), "{e}");
        let e = parse_nodes_json(r#"{"nodes":{"node":[{"nodeHostName":"h","totalResource":{"memory":"x"}}]}}"#)
            .unwrap_err();
        assert!(e.to_string().contains("totalResource.memory"), "{e}");
        assert!(matches!(parse_nodes_json("{not json"), Err(NodeJsonError::Json(_))));
        assert!(matches!(
            parse_nodes_json(r#"{"nodes":5}"#),
            Err(NodeJsonError::Listing { .. })
        ));
    }
}

#[cfg(test)]
mod topology_wire_tests {
    use super::*;
    use crate::resources::{PortSet, Resources};
    use std::sync::Arc;

    #[test]
    fn custom_topologies_travel_as_matrix_text_and_come_back_equal() {
        let text = crate::topology::Topology::preset("dgx1v").unwrap().to_topo_text();
        let custom = crate::topology::Topology::parse_nvidia_smi(&text).unwrap();
        let mut n = Node::new("h", "/r", Resources::with_mask(8, 100, 0xff, PortSet::new()));
        n.topology = Some(Arc::new(custom.clone()));
        let v = node_to_json(&n, 0, 0);
        assert!(v["gpuTopology"].as_str().unwrap().contains("GPU0"), "sent as text");
        let back = parse_node_value(&v).unwrap();
        assert_eq!(back.topology.as_deref(), Some(&custom));
        let mut p = n.clone();
        p.topology = crate::topology::Topology::preset("pcie8").map(Arc::new);
        assert_eq!(node_to_json(&p, 0, 0)["gpuTopology"], "pcie8", "presets travel by name");
    }
}

#[cfg(test)]
mod lean_view_tests {
    use super::*;
    use crate::cluster::NodeState;
    use crate::resources::{CustomResources, PortSet, Resources};
    use proptest::prelude::*;
    use std::sync::Arc;

    proptest! {
        /// The lean listing (issue 29) reads as exactly the nodes the whole one does, for
        /// any GPUs, use, shares, custom resources, ports, labels, state, topology and IP.
        #[test]
        fn the_lean_view_reads_as_the_whole_one(
            gpus in 0u32..=8,
            used_bits in any::<u8>(),
            share in proptest::option::of(1u32..100),
            cpu in 0u32..64, used_cpu in 0u32..64,
            mem in 0u64..1_000_000, used_mem in 0u64..1_000_000,
            nvme in proptest::option::of((1u64..8, 0u64..8)),
            ports in proptest::option::of((2000u32..3000, 0u32..5)),
            labelled in any::<bool>(),
            state in prop_oneof![Just(NodeState::Running), Just(NodeState::Lost), Just(NodeState::Unhealthy)],
            topo in prop_oneof![Just(None), Just(Some("pcie8")), Just(Some("dgx1v"))],
            ip in any::<bool>(),
        ) {
            let mask = if gpus == 0 { 0 } else { (1u64 << gpus) - 1 };
            let port_set = ports.map_or(PortSet::new(), |(lo, n)| PortSet::parse(&format!("{lo}-{}", lo + 10 * n + 10)).unwrap());
            let mut total = Resources::with_mask(cpu.max(used_cpu), mem.max(used_mem), mask, port_set.clone());
            if let Some((t, _)) = nvme {
                total = total.with_custom(CustomResources::from_pairs([("nvme", t)]));
            }
            let mut n = Node::new("gpu-7", "/rack-b", total);
            let used_mask = u64::from(used_bits) & mask;
            let mut used = match (share, used_mask.trailing_zeros()) {
                (Some(h), first) if first < 64 && gpus > 0 => Resources::with_share(used_cpu, used_mem, first, h, PortSet::new()),
                _ => Resources::with_mask(used_cpu, used_mem, used_mask, PortSet::new()),
            };
            if let Some((t, u)) = nvme {
                used = used.with_custom(CustomResources::from_pairs([("nvme", u.min(t))]));
            }
            if let Some((lo, _)) = ports {
                used.ports = PortSet::parse(&lo.to_string()).unwrap();
            }
            n.set_used(used);
            n.state = state;
            if labelled {
                n.labels = vec!["gpu".into(), "fast".into()];
            }
            n.gpu_type = (gpus > 0).then(|| "A100".to_string());
            n.http_address = "http://127.0.0.1:8088".into();
            n.ip = ip.then(|| "10.0.0.7".parse().unwrap());
            n.topology = topo.and_then(crate::topology::Topology::preset).map(Arc::new);
            let whole = parse_node_value(&node_to_json(&n, 3, 9)).unwrap();
            let lean_json = node_to_lean_json(&n, 3, 9);
            let lean = parse_node_value(&lean_json).unwrap();
            prop_assert_eq!(&lean, &whole);
            for k in NOT_IN_LEAN_VIEW {
                prop_assert!(lean_json.get(k).is_none(), "{} is in the lean view", k);
            }
            prop_assert!(lean_json.to_string().len() * 2 < node_to_json(&n, 3, 9).to_string().len());
            // An allocate answer's node report is written without a `Value` tree: the same
            // text as the listing's object, and read back as the same node and counts.
            let report = NodeReport { node: n.clone(), num_containers: 3, last_health_update_ms: 9 };
            let text = serde_json::to_string(&report).unwrap();
            prop_assert_eq!(&text, &node_to_json(&n, 3, 9).to_string());
            // The listings' cached bytes are the same texts, whole and lean.
            prop_assert_eq!(node_json_bytes(&n, 3, 9, ObjectForm::Whole), text.clone().into_bytes());
            prop_assert_eq!(node_json_bytes(&n, 3, 9, ObjectForm::Lean), lean_json.to_string().into_bytes());
            // The compact view's shape and entry read back as the same node.
            let shape = String::from_utf8(node_json_bytes(&n, 3, 9, ObjectForm::Shape)).unwrap();
            let entry = String::from_utf8(node_entry_bytes(&n)).unwrap();
            let compact = format!(r#"{{"nodes":{{"shapes":[{shape}],"node":[{{"shape":0,{}]}}}}"#, &entry[1..]);
            prop_assert_eq!(&parse_node_listing(&compact).unwrap().nodes, &vec![whole.clone()]);
            let back: NodeReport = serde_json::from_str(&text).unwrap();
            prop_assert_eq!(&back.node, &whole);
            prop_assert_eq!((back.num_containers, back.last_health_update_ms), (3, 9));
        }
    }
}
