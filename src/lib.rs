//! gpuam: a per-job application master for GPU deep-learning jobs, with the resource
//! manager and node executor it runs against.
//!
//! Components (DESIGN.md §2); dependencies flow one way:
//! `cli → am / rm / web → select → cluster / topology / spec → resources` (web reads the
//! AM's status hub, never the other way).
//! The AM (`am`) is a pure job machine with one async driver; it knows neither the web
//! dashboard nor the terminal: `web` observes its status hub, and `cli` wires the two,
//! prints and picks exit codes.
//! The wire types (`protocol`, with `cluster::rm_json` for node objects), the settings
//! (`config`) and the credentials (`auth`: tokens and secret files; `users`: the users' and
//! node agents' credential files) sit beside `cluster`: every component reads them and they use
//! none of the components above (`config` only parses; the RM builds its queue tree from it);
//! so does `reason`, the one answer to "why does it wait". "May this task use this node" is one
//! rule, `select::feasible`, which the RM's queue gate and
//! preemption use too.

pub mod am;
pub mod auth;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod exit;
pub mod http_guard;
pub mod local_peer;
pub mod node;
pub mod protocol;
pub mod ray;
pub mod reason;
pub mod resources;
pub mod rm;
pub mod select;
pub mod sim;
pub mod spec;
pub mod text;
pub mod tls;
pub mod topology;
pub mod users;
pub mod web;
