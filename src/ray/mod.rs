//! The Ray node backend (DESIGN.md §9): gpuam's placement on an existing Ray cluster.
//!
//! `gpuam rm --backend ray --ray-address http://HOST:8265` builds its node view from the Ray
//! cluster's nodes and runs every granted container as one Ray job on the Ray node it was
//! granted on, pinned to exactly the granted GPUs through per-GPU custom resources.
//!
//! - `scheme`: how a Ray node describes itself (resources and labels), both ways; pure.
//! - `entry`: the job of one container (entrypoint with its cancel gate, submit body); pure.
//! - `client`: the Ray dashboard's REST API.
//! - `gate`: the cancel gate a job's entrypoint asks before it runs anything.
//! - `launcher`: submits, stops and watches the jobs; ends containers when Ray says so.
//! - `nodes`: the node view from Ray and the node-state watch.
//! - `args`: `gpuam ray-node-args`.
//!
//! Supported Ray version: see [`RAY_VERSION`] (scripts/ray-setup.sh installs it).

pub mod args;
pub mod client;
pub mod entry;
pub mod gate;
pub mod launcher;
pub mod nodes;
pub mod scheme;

/// The Ray version this backend is tested with.
pub const RAY_VERSION: &str = "2.60.0";
