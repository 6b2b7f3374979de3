//! The resource manager: REST server, scheduler ledger, applications, node executor.

pub mod executor;
pub mod gpu_discovery;
