//! The resource manager: REST server, scheduler ledger, applications, node executor.

pub mod apps;
pub mod executor;
pub mod gpu_discovery;
pub mod ledger;
pub mod server;

pub use server::{start, RmHandle, RmOptions};
