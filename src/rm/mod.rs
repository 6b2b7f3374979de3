//! The resource manager: REST server, scheduler ledger, applications, node executor.

pub mod apps;
pub mod history;
pub mod ledger;
pub mod scheduler;
pub mod server;
pub mod store;
/// The users file lives below every component (`crate::users`): the node backends check
/// agents' credentials with it too. Kept under this path for the RM's callers.
pub use crate::users;

pub use server::{start, RmHandle, RmOptions};
