//! The resource manager: REST server, scheduler ledger, applications, node executor.

pub mod apps;
pub mod gpu_discovery;
pub mod image;
pub mod ledger;
pub mod scheduler;
pub mod server;
pub mod store;
pub mod users;

/// The executor and process identities moved to the node component (`crate::node`).
pub use crate::node::{executor, procs};

pub use server::{start, RmHandle, RmOptions};
