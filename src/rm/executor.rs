//! Node executor: runs each container's commands as a real process group.
//!
//! PLACEHOLDER SKELETON — API only; the real implementation replaces the bodies.

use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::protocol::{ContainerStatus, LaunchContext};
use crate::resources::Resources;

/// Something that happened to a container, pushed to whoever owns the executor (the RM).
#[derive(Clone, Debug, PartialEq)]
pub enum ExecEvent {
    /// The container's process group ended (or could not start).
    Exited {
        container_id: String,
        exit_status: i32,
        diagnostics: String,
    },
}

/// Which captured stream to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogStream {
    Stdout,
    Stderr,
}

/// Executor failures (each maps to an HTTP status in the RM server).
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("container {0} is not known to this executor")]
    UnknownContainer(String),
    #[error("container {0} was already started")]
    AlreadyStarted(String),
    #[error("could not start container {id}: {why}")]
    StartFailed { id: String, why: String },
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

/// Runs containers of all simulated hosts (and `local: true` hosts) on this machine.
pub struct Executor {
    _root: PathBuf,
    _events: mpsc::UnboundedSender<ExecEvent>,
}

impl Executor {
    /// `root` holds one working directory per container (`root/<containerId>/`).
    pub fn new(root: PathBuf, events: mpsc::UnboundedSender<ExecEvent>) -> Self {
        Executor {
            _root: root,
            _events: events,
        }
    }

    /// Starts `ctx.commands` for a granted container; returns the process-group id.
    /// The executor adds the GPU environment (CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES,
    /// GPUAM_GPU_MASK, CONTAINER_GPUS) and GPUAM_CONTAINER_ID / GPUAM_HOST itself.
    pub fn start(
        &self,
        _container_id: &str,
        _host: &str,
        _granted: &Resources,
        _ctx: LaunchContext,
    ) -> Result<u32, ExecError> {
        Err(ExecError::StartFailed {
            id: _container_id.into(),
            why: "not implemented".into(),
        })
    }

    /// Stops the container's whole process group: SIGTERM, then SIGKILL after `grace`.
    pub async fn stop(&self, _container_id: &str, _grace: Duration) -> Result<(), ExecError> {
        Ok(())
    }

    pub fn status(&self, _container_id: &str) -> Option<ContainerStatus> {
        None
    }

    /// Reads a captured stream; `tail_bytes` limits to the last N bytes.
    pub fn read_log(
        &self,
        container_id: &str,
        _stream: LogStream,
        _tail_bytes: Option<u64>,
    ) -> Result<String, ExecError> {
        Err(ExecError::UnknownContainer(container_id.into()))
    }
}
