//! `gpuam rm` and `gpuam am`: the two long-running processes.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::am::{self, AmOptions};
use crate::config::Settings;
use crate::exit;

/// Where `gpuam rm` keeps its state.
pub enum StateOption {
    /// SQLite in this directory (`None`: the work dir).
    Sqlite(Option<PathBuf>),
    Memory,
}

impl StateOption {
    pub fn from_flags(state_dir: Option<PathBuf>, in_memory: bool) -> Self {
        if in_memory {
            StateOption::Memory
        } else {
            StateOption::Sqlite(state_dir)
        }
    }
}

pub async fn rm(
    node_token_file: Option<&Path>,
    cluster: Option<&Path>,
    listen: SocketAddr,
    work_dir: Option<PathBuf>,
    admin_token: Option<String>,
    state: StateOption,
    settings: &Settings,
) -> i32 {
    let node_token = match node_token_file.map(std::fs::read_to_string) {
        None => None,
        Some(Ok(t)) if !t.trim().is_empty() => Some(t.trim().to_string()),
        Some(Ok(_)) => {
            eprintln!("error: --node-token-file is empty");
            return exit::USAGE;
        }
        Some(Err(e)) => {
            eprintln!("error: --node-token-file: {e}");
            return exit::USAGE;
        }
    };
    // An RM for real machines invents no nodes: without --cluster, the agents alone.
    let nodes = if node_token.is_some() && cluster.is_none() {
        Vec::new()
    } else {
        match super::load_cluster(cluster) {
            Ok(n) => n,
            Err(code) => return code,
        }
    };
    let work_dir = work_dir.unwrap_or_else(|| PathBuf::from("gpuam-rm-work"));
    let tls = match crate::tls::server_config_from_settings(&settings.tls) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: TLS: {e}");
            return exit::INVALID_INPUT;
        }
    };
    let state_dir = match state {
        StateOption::Sqlite(dir) => Some(dir.unwrap_or_else(|| work_dir.clone())),
        StateOption::Memory => None,
    };
    let state_text = match &state_dir {
        Some(d) => format!("state in {}", d.join(crate::rm::store::STATE_FILE).display()),
        None => "state in memory only".to_string(),
    };
    let handle = match crate::rm::start(crate::rm::RmOptions {
        container_expiry: Duration::from_secs(settings.rm.container_expiry_sec),
        max_am_attempts: settings.rm.max_am_attempts,
        node_expiry: Duration::from_secs(settings.rm.node_expiry_sec.max(1)),
        node_token,
        admin_token,
        state_dir,
        tls,
        ..crate::rm::RmOptions::new(nodes, listen, work_dir.clone())
    })
    .await
    {
        Ok(h) => h,
        Err(e) => {
            eprintln!("error: cannot start the RM on {listen}: {e:#}");
            return exit::USAGE;
        }
    };
    println!(
        "gpuam rm listening on {} (work dir {}; {state_text})",
        handle.base_url(),
        work_dir.display()
    );
    match handle.admin_token_file() {
        Some(f) => println!("admin token written to {} (mode 0600)", f.display()),
        None => println!("admin token: as configured (--admin-token-file or GPUAM_ADMIN_TOKEN)"),
    }
    let _ = tokio::signal::ctrl_c().await;
    eprintln!("stopping: containers and AMs are being stopped");
    handle.shutdown().await;
    exit::SUCCESS
}

pub async fn am(job: &Path, rm: &str, app_id: &str, token: &str, listen: SocketAddr, settings: Settings) -> i32 {
    let (spec, _) = match super::load_job(job) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let job_token = std::env::var("GPUAM_JOB_TOKEN").ok().filter(|t| !t.is_empty());
    am::run(AmOptions {
        job: spec,
        rm_url: rm.to_string(),
        app_id: app_id.to_string(),
        token: token.to_string(),
        listen,
        settings,
        job_token,
    })
    .await
}
