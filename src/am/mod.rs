//! The application master: one per job. Registers with the RM, keeps the node view,
//! places and requests one task at a time, launches, watches, retries, finishes.

pub mod status;
