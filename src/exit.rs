//! Process exit codes (DESIGN.md §7), one place for every command.

/// The job succeeded / the command did what it was asked.
pub const SUCCESS: i32 = 0;
/// The job failed or was killed.
pub const JOB_FAILED: i32 = 1;
/// `plan`: some task cannot be placed.
pub const NOT_PLACEABLE: i32 = 2;
/// Bad command line.
pub const USAGE: i32 = 64;
/// Invalid job spec or cluster file.
pub const INVALID_INPUT: i32 = 65;
/// No such job, or not one of yours (`gpuam status/logs/kill` of an unknown job or task).
pub const NO_SUCH_JOB: i32 = 66;
/// The RM could not be reached (or cannot serve now: 503).
pub const RM_UNREACHABLE: i32 = 69;
/// A bug or an unexpected failure inside gpuam.
pub const INTERNAL: i32 = 70;
/// The RM refused for a limit (429): try again later.
pub const TRY_LATER: i32 = 75;
/// No credential, or one the RM does not accept for this (401, 403).
pub const NOT_PERMITTED: i32 = 77;
