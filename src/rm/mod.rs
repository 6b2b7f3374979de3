//! The resource manager: REST server, scheduler ledger, applications, node executor.

pub mod apps;
pub mod backend;
pub mod executor;
pub mod gpu_discovery;
pub mod ledger;
pub mod procs;
pub mod server;
pub mod store;

pub use server::{start, RmHandle, RmOptions};
