//! The resource manager: REST server, scheduler ledger, applications, node executor.

pub mod apps;
pub mod history;
pub mod ledger;
pub mod scheduler;
pub mod server;
pub mod store;
pub mod users;

pub use server::{start, RmHandle, RmOptions};
