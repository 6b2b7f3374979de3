//! The resource manager: REST server, scheduler ledger, applications, node executor.
//! The ledger (`ledger`), the applications (`apps`) and the queue scheduler (`scheduler`)
//! are pure; every change to the RM's state goes through the RM core's transactions
//! (`server::transactions`), which the HTTP handlers and the background loops call.

pub mod apps;
pub mod history;
pub mod ledger;
pub mod log_budget;
pub mod scheduler;
pub mod server;
pub mod store;
/// The users file lives below every component (`crate::users`): the node backends check
/// agents' credentials with it too. Kept under this path for the RM's callers.
pub use crate::users;

pub use server::{in_process_cgroups, start, RmHandle, RmOptions, AM_PROCESS_FILE};
