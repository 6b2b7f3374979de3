//! `gpuam rm` and `gpuam am`: the two long-running processes.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::am::AmOptions;
use crate::config::Settings;
use crate::exit;

/// Where `gpuam rm` keeps its state.
pub enum StateOption {
    /// SQLite in this directory (`None`: the work dir); `recover`: repair damaged state
    /// instead of refusing it (`--recover-state`).
    Sqlite {
        dir: Option<PathBuf>,
        recover: bool,
    },
    Memory,
}

impl StateOption {
    pub fn from_flags(state_dir: Option<PathBuf>, in_memory: bool, recover: bool) -> Self {
        if in_memory {
            StateOption::Memory
        } else {
            StateOption::Sqlite {
                dir: state_dir,
                recover,
            }
        }
    }
}

/// Where the RM's nodes come from besides the cluster file: registered node agents
/// (their credentials file) or a Ray cluster.
pub struct NodeSources<'a> {
    pub nodes_file: Option<&'a Path>,
    pub ray: &'a super::RayBackendArgs,
}

pub async fn rm(
    sources: NodeSources<'_>,
    cluster: Option<&Path>,
    listen: SocketAddr,
    work_dir: Option<PathBuf>,
    admin_token: Option<String>,
    state: StateOption,
    settings: &Settings,
) -> i32 {
    let NodeSources {
        nodes_file,
        ray: ray_args,
    } = sources;
    raise_open_file_limit();
    let (nodes, ray) = if ray_args.backend == "ray" {
        match ray_backend(ray_args, listen).await {
            Ok((nodes, client, gate)) => {
                let launch = match ray_args.ray_launch.as_str() {
                    "driver" => crate::ray::Launch::Driver(crate::ray::driver::DriverConfig {
                        python: ray_args.ray_python.clone(),
                        gcs_address: ray_args.ray_gcs_address.clone().unwrap_or_else(|| {
                            crate::ray::driver::default_gcs_address(ray_args.ray_address.as_deref().unwrap_or(""))
                        }),
                        hosts: nodes.iter().map(|n| n.host.clone()).collect(),
                    }),
                    _ => crate::ray::Launch::Jobs,
                };
                (nodes, Some(crate::ray::Backend { client, gate, launch }))
            }
            Err(code) => return code,
        }
    } else if nodes_file.is_some() && cluster.is_none() {
        // An RM for real machines invents no nodes: without --cluster, the agents alone.
        (Vec::new(), None)
    } else {
        match super::load_cluster(cluster) {
            Ok(n) => (n, None),
            Err(code) => return code,
        }
    };
    let ray_watch = ray.as_ref().map(|b| b.client.clone());
    let initial_states: std::collections::BTreeMap<String, crate::cluster::NodeState> =
        nodes.iter().map(|n| (n.host.clone(), n.state)).collect();
    let work_dir = work_dir.unwrap_or_else(|| PathBuf::from("gpuam-rm-work"));
    if let Err(code) = super::check_own_dir("--work-dir", &work_dir) {
        return code;
    }
    let tls = match crate::tls::server_config_from_settings(&settings.tls) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: TLS: {e}");
            return exit::INVALID_INPUT;
        }
    };
    let (state_dir, recover_state) = match state {
        StateOption::Sqlite { dir, recover } => (Some(dir.unwrap_or_else(|| work_dir.clone())), recover),
        StateOption::Memory => (None, false),
    };
    // A state directory of its own is this user's too (tokens are kept there).
    if let Some(d) = state_dir.as_deref().filter(|d| *d != work_dir.as_path()) {
        if let Err(code) = super::check_own_dir("--state-dir", d) {
            return code;
        }
    }
    let state_text = match &state_dir {
        Some(d) => format!("state in {}", d.join(crate::rm::store::STATE_FILE).display()),
        None => "state in memory only".to_string(),
    };
    let opts = match crate::rm::RmOptions::from_settings(settings, nodes, listen, work_dir.clone()) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: invalid settings: {e}");
            return exit::INVALID_INPUT;
        }
    };
    let handle = match crate::rm::start(crate::rm::RmOptions {
        // The in-process node's shim, where it has no cgroup: this very executable.
        shim_exe: std::env::current_exe().ok(),
        nodes_file: nodes_file.map(Path::to_path_buf),
        admin_token,
        state_dir,
        tls,
        agent_ca_file: settings.tls.ca_file.clone(),
        ray,
        recover_state,
        ..opts
    })
    .await
    {
        Ok(h) => h,
        Err(e) => {
            eprintln!("error: cannot start the RM on {listen}: {e:#}");
            // Damaged state and bad users files are input errors (DESIGN.md §7: 65).
            let damaged = matches!(
                e.downcast_ref::<crate::rm::store::StoreError>(),
                Some(crate::rm::store::StoreError::Corrupt { .. })
            );
            return if damaged || e.downcast_ref::<crate::rm::users::UsersError>().is_some() {
                exit::INVALID_INPUT
            } else {
                exit::USAGE
            };
        }
    };
    for note in handle.recovery_notes() {
        eprintln!("recover-state: {note}");
    }
    println!(
        "gpuam rm listening on {} (work dir {}; {state_text})",
        handle.base_url(),
        work_dir.display()
    );
    match handle.admin_token_file() {
        Some(f) => println!(
            "admin token in {} (mode 0600; kept across restarts: remove the file for a new one)",
            f.display()
        ),
        None => println!("admin token: as configured (--admin-token-file or GPUAM_ADMIN_TOKEN)"),
    }
    match &settings.rm.users_file {
        Some(f) => println!(
            "users: {} from {} (reloaded when it changes or on SIGHUP; `gpuam token new` adds one)",
            handle.user_names().len(),
            f.display()
        ),
        None => println!("users: none (no --users-file): only the admin token can submit, list and kill applications"),
    }
    let watch = ray_watch.map(|client| {
        let control = handle.node_control();
        tokio::spawn(crate::ray::nodes::watch(client, initial_states, move |host, state| {
            let control = control.clone();
            async move {
                control.set_node_state(&host, state).await;
            }
        }))
    });
    let by = stop_signal().await;
    if let Some(w) = watch {
        w.abort();
    }
    let (apps, ams) = handle.live_work();
    eprintln!("{}", stopping_line(by, &apps, ams));
    handle.shutdown().await;
    eprintln!("gpuam rm stopped");
    exit::SUCCESS
}

/// Waits for Ctrl-C (SIGINT) or SIGTERM (systemd, `docker stop`, `kill`): both stop every job.
/// SIGHUP is not a stop: it reloads the users file. Returns the signal's name.
pub(crate) async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => tokio::select! {
            _ = tokio::signal::ctrl_c() => "Ctrl-C",
            _ = term.recv() => "SIGTERM",
        },
        Err(e) => {
            eprintln!("warning: cannot watch SIGTERM ({e}); only Ctrl-C stops the RM's jobs");
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        }
    }
}

/// The line `gpuam rm` prints when a signal stops it: what it is stopping, by application.
fn stopping_line(by: &str, apps: &[(String, String, usize)], ams: usize) -> String {
    if apps.is_empty() && ams == 0 {
        return format!("{by}: stopping the RM (no application running)");
    }
    let list: Vec<String> = apps
        .iter()
        .map(|(id, user, n)| format!("{id} of {user} ({n} container{})", if *n == 1 { "" } else { "s" }))
        .collect();
    format!(
        "{by}: stopping {} application{} and {ams} AM process{}: {}",
        apps.len(),
        if apps.len() == 1 { "" } else { "s" },
        if ams == 1 { "" } else { "es" },
        list.join(", ")
    )
}

pub async fn am(job: &Path, rm: &str, app_id: &str, token: &str, listen: SocketAddr, settings: Settings) -> i32 {
    let (spec, _) = match super::load_job(job) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let job_token = std::env::var("GPUAM_JOB_TOKEN").ok().filter(|t| !t.is_empty());
    super::am::run(AmOptions {
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

/// `--backend ray`: reaches the Ray dashboard, reads its gpuam nodes and starts the cancel
/// gate. Exit 69 when Ray cannot be reached, 65 when its nodes cannot be read or none is a
/// gpuam node, 64 for a bad address.
async fn ray_backend(
    args: &super::RayBackendArgs,
    rm_listen: SocketAddr,
) -> Result<
    (
        Vec<crate::cluster::Node>,
        crate::ray::client::RayClient,
        crate::ray::gate::Gate,
    ),
    i32,
> {
    let address = args.ray_address.as_deref().unwrap_or("");
    let client = crate::ray::client::RayClient::new(address).map_err(|e| {
        eprintln!("error: {e}");
        exit::USAGE
    })?;
    let version = client.version().await.map_err(|e| {
        eprintln!("error: cannot reach Ray: {e}");
        exit::RM_UNREACHABLE
    })?;
    if version != crate::ray::RAY_VERSION {
        eprintln!(
            "warning: Ray {version} at {address}; gpuam's Ray backend is tested with Ray {}",
            crate::ray::RAY_VERSION
        );
    }
    let nodes = crate::ray::nodes::read_nodes(&client).await.map_err(|e| {
        eprintln!("error: {e}");
        exit::INVALID_INPUT
    })?;
    if nodes.is_empty() {
        eprintln!(
            "error: the Ray cluster at {address} has no gpuam node: start each Ray node with the arguments \
             `gpuam ray-node-args --host NAME` prints"
        );
        return Err(exit::INVALID_INPUT);
    }
    let gate_listen = args
        .ray_gate_listen
        .unwrap_or_else(|| SocketAddr::new(rm_listen.ip(), 0));
    let gate = crate::ray::gate::Gate::start_as(gate_listen, args.ray_gate_url.clone())
        .await
        .map_err(|e| {
            eprintln!("error: cannot listen on {gate_listen} for the Ray gate: {e}");
            exit::USAGE
        })?;
    println!(
        "gpuam rm: Ray {version} at {address}, {} gpuam node(s): {}",
        nodes.len(),
        nodes.iter().map(|n| n.host.as_str()).collect::<Vec<_>>().join(", ")
    );
    Ok((nodes, client, gate))
}

/// Raises this process's open-file limit to its hard limit (a default soft limit of 1,024
/// is soon reached by an RM's connections); logged, never fatal.
fn raise_open_file_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a local struct.
    let raised = unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 || lim.rlim_cur >= lim.rlim_max {
            None
        } else {
            let was = lim.rlim_cur;
            lim.rlim_cur = lim.rlim_max;
            (libc::setrlimit(libc::RLIMIT_NOFILE, &lim) == 0).then_some((was, lim.rlim_max))
        }
    };
    if let Some((was, now)) = raised {
        tracing::info!("open-file limit raised from {was} to {now}");
    }
}

#[cfg(test)]
mod tests {
    use super::stopping_line;

    #[test]
    fn the_stopping_line_names_every_application_and_counts() {
        let apps = vec![
            ("application_1_0001".to_string(), "alice".to_string(), 3),
            ("application_1_0002".to_string(), "bob".to_string(), 1),
        ];
        assert_eq!(
            stopping_line("SIGTERM", &apps, 2),
            "SIGTERM: stopping 2 applications and 2 AM processes: application_1_0001 of alice \
             (3 containers), application_1_0002 of bob (1 container)"
        );
        assert_eq!(
            stopping_line("Ctrl-C", &[], 0),
            "Ctrl-C: stopping the RM (no application running)"
        );
    }
}
