//! Helpers for tests that drive the library's `Executor` directly (real processes in real
//! cgroups, no RM): an executor over a containment, the next `Exited` event, one-command
//! launch contexts. Included with `#[path = "common/exec.rs"] mod exec;`.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use gpuam::node::executor::{Executor, ExecutorOptions};
use gpuam::node::NodeEvent;
use gpuam::protocol::LaunchContext;
use tokio::sync::mpsc;

/// Whether this test runs as root (cgroups, mounts, `mknod`); tests that need it skip
/// otherwise, saying so.
pub fn root() -> bool {
    // SAFETY: plain syscall.
    let r = unsafe { libc::geteuid() == 0 };
    if !r {
        eprintln!("skipped: needs root");
    }
    r
}

/// An executor whose containers live in `dir/containers`, with `opts`.
pub fn executor(dir: &Path, opts: ExecutorOptions) -> (Executor, mpsc::UnboundedReceiver<NodeEvent>) {
    let (tx, rx) = mpsc::unbounded_channel();
    (Executor::with_options(dir.join("containers"), tx, opts), rx)
}

/// The next `Exited` event (at most 60 s): id, exit status, diagnostics.
pub async fn next_exit(rx: &mut mpsc::UnboundedReceiver<NodeEvent>) -> (String, i32, String) {
    let ev = tokio::time::timeout(Duration::from_secs(60), rx.recv())
        .await
        .expect("no Exited event within 60 s")
        .expect("channel closed");
    let NodeEvent::Exited {
        container_id,
        exit_status,
        diagnostics,
        ..
    } = ev;
    (container_id, exit_status, diagnostics)
}

/// A launch context of one command.
pub fn ctx(cmd: &str) -> LaunchContext {
    LaunchContext {
        commands: vec![cmd.to_string()],
        env: BTreeMap::new(),
    }
}
