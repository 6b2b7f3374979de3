//! The resource manager: REST server, scheduler ledger, applications, node executor.

pub mod executor;

// PLACEHOLDER API — replaced by the RM branch.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub struct RmOptions {
    pub nodes: Vec<crate::cluster::Node>,
    pub listen: SocketAddr,
    pub work_dir: PathBuf,
    pub am_program: Option<PathBuf>,
    pub launch_am: bool,
    pub container_expiry: Duration,
}

pub struct RmHandle {
    addr: SocketAddr,
}

impl RmHandle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }
    pub async fn shutdown(self) {}
    pub fn ledger_all_free(&self) -> bool {
        true
    }
}

pub async fn start(opts: RmOptions) -> anyhow::Result<RmHandle> {
    Ok(RmHandle { addr: opts.listen })
}
