//! PLACEHOLDER — replaced by the RM branch.
use super::Node;

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NodeJsonError(pub String);

pub fn parse_nodes_json(_text: &str) -> Result<Vec<Node>, NodeJsonError> {
    Err(NodeJsonError("not implemented".into()))
}

pub fn parse_node_value(_v: &serde_json::Value) -> Result<Node, NodeJsonError> {
    Err(NodeJsonError("not implemented".into()))
}
