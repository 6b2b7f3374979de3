//! `gpuam node`: the node agent of one machine (see `crate::node::agent`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::Args;

use crate::exit;
use crate::node::agent::{self, AgentOptions};
use crate::resources::{CustomResources, PortSet, Resources};

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct NodeArgs {
    /// An admin command about a host instead of running this machine's agent.
    #[command(subcommand)]
    pub what: Option<Box<NodeCmd>>,
    /// The RM's base URL.
    #[arg(long, value_name = "URL", required = true)]
    pub rm: Option<String>,
    /// This node's host name in the RM's node view.
    #[arg(long, required = true)]
    pub host: Option<String>,
    /// Where the agent serves the container endpoints (the RM must reach it).
    #[arg(long, default_value = "0.0.0.0:8042")]
    pub listen: SocketAddr,
    /// The address the RM reaches this agent at (default: http://LISTEN, https:// with tls.*).
    #[arg(long, value_name = "URL")]
    pub advertise: Option<String>,
    /// File holding this host's own agent token (`gpuam node-token new --host HOST` on the
    /// RM's side makes it; the RM's nodes file binds it to this host name).
    #[arg(long, value_name = "FILE", required = true)]
    pub node_token_file: Option<PathBuf>,
    #[arg(long, default_value = "/default-rack")]
    pub rack: String,
    /// Comma list of node labels.
    #[arg(long, value_delimiter = ',')]
    pub labels: Vec<String>,
    #[arg(long)]
    pub gpu_type: Option<String>,
    /// `auto` (nvidia-smi) or a count (for testing on a machine without GPUs).
    #[arg(long, default_value = "auto")]
    pub gpus: String,
    /// `auto` (nvidia-smi topo -m), a preset name (pcie4, pcie8, dgx1v, ...) or a file with
    /// `nvidia-smi topo -m` text.
    #[arg(long, default_value = "auto")]
    pub topology: String,
    /// CPUs offered (default: this machine's).
    #[arg(long)]
    pub cpu: Option<u32>,
    /// Memory offered in MB (default: this machine's).
    #[arg(long)]
    pub memory_mb: Option<u64>,
    #[arg(long, default_value = "20000-29999")]
    pub ports: String,
    #[arg(long, value_name = "DIR", default_value = "gpuam-node-work")]
    pub work_dir: PathBuf,
    /// Every task runs as this one account (a single-tenant node). Default: each user's
    /// tasks as the account --user-map names, else as a uid of the user's own from
    /// `node.task_uids` (when the agent runs as root).
    #[arg(long, value_name = "USER")]
    pub run_as: Option<String>,
    /// Run USER's tasks as local ACCOUNT (repeat for more; added to `node.user_map`).
    #[arg(long = "user-map", value_name = "USER=ACCOUNT")]
    pub user_map: Vec<String>,
    /// A custom resource this node offers, in whole units (repeat for more), e.g.
    /// `--resource nvme=2 --resource ib_hca=4`; tasks ask for it with
    /// `resourcePerInstance.resources: {nvme: 1}`.
    #[arg(long = "resource", value_name = "NAME=QTY")]
    pub resources: Vec<String>,
    /// The IP address this node's containers are reached at by their peers (given to them
    /// in GPUAM_HOSTS_<ROLE> and PAI_HOST_IP_*). Default: the --listen address when it names
    /// one, else the --advertise URL's when it is an IP, else the address this machine uses
    /// to reach the RM.
    #[arg(long, value_name = "IP")]
    pub ip: Option<std::net::IpAddr>,
    /// A variable every task of this node gets, e.g. a site software directory (repeat for
    /// more). The job's and gpuam's own variables come after it; gpuam's names are refused.
    #[arg(long = "task-env", value_name = "NAME=VALUE")]
    pub task_env: Vec<String>,
    /// How containers are contained: `auto` (cgroup v2, else cgroup v1 pids+freezer, else
    /// a subreaper shim around each container), `v1` (cgroup v1 even where v2 is mounted
    /// beside it) or `subreaper` (the shim even where cgroups exist). The mechanism used is
    /// logged at start.
    #[arg(long, env = "GPUAM_NODE_CONTAINMENT", default_value = "auto")]
    pub containment: crate::node::cgroup::Choice,
}

/// `gpuam node remove …`: the admin's calls about a host.
#[derive(clap::Subcommand, Debug)]
pub enum NodeCmd {
    /// Remove a host for good (the admin's token): it leaves the node view, what it holds is
    /// freed once, and its agent's credential is refused until you issue the host a new
    /// one (`gpuam node-token new --host HOST`). A host whose containers still run for
    /// their jobs needs --force (they then end as a lost host's and their jobs retry
    /// elsewhere). Exit 66: no such host; 64: it runs containers and --force was not given.
    Remove {
        /// The host name, as `GET /ws/v1/cluster/nodes` lists it.
        host: String,
        /// End the containers that still run there.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        target: super::target::TargetArgs,
    },
}

/// `gpuam node remove HOST [--force]`.
pub(crate) async fn remove(
    host: &str,
    force: bool,
    target: &super::target::TargetArgs,
    tls: &crate::config::TlsSettings,
) -> i32 {
    let t = match super::target::resolve(target) {
        Ok(t) => t,
        Err(code) => return code,
    };
    let api = match super::rm_api::JobsApi::new(&t, tls) {
        Ok(a) => a,
        Err(code) => return code,
    };
    match api.remove_node(host, force).await {
        Ok(v) => {
            let ended = v["containersEnded"].as_array().map_or(0, Vec::len);
            println!(
                "host {host} removed{}; its agent's credential is refused from now on (to bring the machine back: \
                 gpuam node-token new --host {host} --nodes-file FILE, and restart its agent with the new token)",
                if ended > 0 {
                    format!(": {ended} container(s) ended, their jobs retry elsewhere")
                } else {
                    String::new()
                }
            );
            exit::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            match e.status() {
                Some(404) => exit::NO_SUCH_JOB,
                Some(409) => exit::USAGE,
                _ => e.exit_code(),
            }
        }
    }
}

/// `--task-env` entries as (name, value), or an error naming the bad entry.
fn task_env_of(entries: &[String]) -> Result<Vec<(String, String)>, String> {
    entries
        .iter()
        .map(|e| {
            let (name, value) = e
                .split_once('=')
                .ok_or_else(|| format!("--task-env `{e}`: write NAME=VALUE"))?;
            crate::node::contract::check_task_env(name, value).map_err(|why| format!("--task-env `{e}`: {why}"))?;
            Ok((name.to_string(), value.to_string()))
        })
        .collect()
}

fn machine_memory_mb() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|k| k.parse::<u64>().ok()))
        })
        .map_or(1024, |kb| kb / 1024)
}

/// The topology text `--topology auto` registers: what this machine's `nvidia-smi topo -m`
/// printed when gpuam reads it; text it cannot read is a warning and no topology (the node
/// still starts with its GPUs), never a refusal to start.
fn auto_topology(printed: Option<&str>) -> String {
    let Some(text) = printed else { return String::new() };
    match crate::topology::Topology::from_spec(text) {
        Ok(_) => text.to_string(),
        Err(e) => {
            tracing::warn!("--topology auto: ignoring nvidia-smi topo -m ({e}); the node has no topology");
            String::new()
        }
    }
}

/// GPU count, type and topology text from the flags (and nvidia-smi for `auto`).
fn gpus_of(args: &NodeArgs) -> Result<(u32, Option<String>, String), String> {
    let found = (args.gpus == "auto" || args.topology == "auto")
        .then(crate::node::gpu_discovery::discover)
        .flatten();
    let count = if args.gpus == "auto" {
        found.as_ref().map_or(0, |g| g.count)
    } else {
        args.gpus
            .parse::<u32>()
            .ok()
            .filter(|n| *n <= 64)
            .ok_or_else(|| format!("--gpus `{}`: give `auto` or a number from 0 to 64", args.gpus))?
    };
    let topology = match args.topology.as_str() {
        // What this machine's nvidia-smi printed: text gpuam cannot read is a warning (the
        // node runs without a topology), not a refusal to start.
        "auto" => auto_topology(found.as_ref().and_then(|g| g.topo_text.as_deref())),
        t if Path::new(t).is_file() => std::fs::read_to_string(t).map_err(|e| format!("--topology {t}: {e}"))?,
        t => t.to_string(),
    };
    if !topology.is_empty() {
        crate::topology::Topology::from_spec(&topology).map_err(|e| format!("--topology: {e}"))?;
    }
    let gpu_type = args
        .gpu_type
        .clone()
        .or_else(|| found.as_ref().map(|g| g.gpu_type.clone()).filter(|t| !t.is_empty()));
    Ok((count, gpu_type, topology))
}

/// The warning of a node that offers no GPU (`--gpus` as given).
fn zero_gpus_warning(gpus_flag: &str) -> String {
    let why = if gpus_flag == "auto" {
        "--gpus auto found none (no nvidia-smi on PATH, or it lists no GPU)"
    } else {
        "--gpus 0"
    };
    format!(
        "warning: this node offers 0 GPUs ({why}): only tasks that ask for no GPU run here; give --gpus N to offer N"
    )
}

pub async fn node(args: NodeArgs, settings: &crate::config::Settings) -> i32 {
    if let Some(NodeCmd::Remove { host, force, target }) = args.what.as_deref() {
        return remove(host, *force, target, &settings.tls).await;
    }
    // Required by clap unless a subcommand is given.
    let (Some(rm), Some(host), Some(token_file)) = (args.rm.clone(), args.host.clone(), args.node_token_file.clone())
    else {
        eprintln!("error: gpuam node needs --rm URL, --host HOST and --node-token-file FILE");
        return exit::USAGE;
    };
    if let Err(code) = super::check_own_dir("--work-dir", &args.work_dir) {
        return code;
    }
    let token = match crate::auth::read_token_file(&token_file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: --node-token-file {}: {e}", token_file.display());
            return exit::USAGE;
        }
    };
    let (count, gpu_type, topology) = match gpus_of(&args) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e}");
            return exit::USAGE;
        }
    };
    if count == 0 {
        eprintln!("{}", zero_gpus_warning(&args.gpus));
    }
    let ports = match PortSet::parse(&args.ports) {
        Ok(p) => p,
        Err(e) => {
            eprintln!(
                "error: --ports `{}`: {e} (give ranges like 20000-29999,31000)",
                args.ports
            );
            return exit::USAGE;
        }
    };
    let custom = match CustomResources::parse_flags(&args.resources) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return exit::USAGE;
        }
    };
    let task_env = match task_env_of(&args.task_env) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e}");
            return exit::USAGE;
        }
    };
    let identity = match crate::node::identity::parse_user_map(&args.user_map).and_then(|cli| {
        crate::node::identity::IdentitySettings::from_settings(&settings.node, args.run_as.clone(), cli)
    }) {
        Ok(i) => i,
        Err(e) => {
            eprintln!("error: {e}");
            return exit::USAGE;
        }
    };
    // What the RM would refuse at registration (the cluster file's rules), said here first.
    let named = std::iter::once(("--rack", crate::spec::validate::check_rack(&args.rack)))
        .chain(
            gpu_type
                .as_deref()
                .map(|t| ("--gpu-type", crate::spec::validate::check_gpu_type(t))),
        )
        .chain(
            args.labels
                .iter()
                .filter(|l| !l.is_empty())
                .map(|l| ("--labels", crate::spec::validate::check_node_label(l))),
        );
    for (flag, check) in named {
        if let Err((m, f)) = check {
            eprintln!("error: {flag}: {m}; {f}");
            return exit::USAGE;
        }
    }
    if let Some(ip) = args.ip {
        if let Err(e) = crate::node::wire::check_node_ip(ip) {
            eprintln!("error: --ip {e}");
            return exit::USAGE;
        }
    }
    let cpu = args
        .cpu
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(1)));
    let mask = if count >= 64 { u64::MAX } else { (1u64 << count) - 1 };
    let total =
        Resources::with_mask(cpu, args.memory_mb.unwrap_or_else(machine_memory_mb), mask, ports).with_custom(custom);
    let opts = AgentOptions {
        rm_url: rm,
        host,
        listen: args.listen,
        advertise: args.advertise,
        node_token: token,
        rack: args.rack,
        labels: args.labels.into_iter().filter(|l| !l.is_empty()).collect(),
        gpu_type,
        total,
        topology,
        work_dir: args.work_dir,
        identity,
        retention: Some(std::time::Duration::from_secs(settings.node.log_retention_sec)),
        work_dir_grace: Some(std::time::Duration::from_secs(settings.node.work_dir_grace_sec)),
        image: crate::node::image::ImagePolicy::from_settings(&settings.node),
        ip: args.ip,
        task_env,
        max_log_bytes: Some(settings.node.max_log_bytes),
        http_timeouts: (&settings.http).into(),
        containment: args.containment,
        shim_exe: std::env::current_exe().ok(),
        tls: settings.tls.clone(),
        bounds: match crate::node::bounds::NodeBounds::from_settings(&settings.node) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("error: {e}");
                return exit::USAGE;
            }
        },
    };
    match agent::run(opts).await {
        Ok(()) => exit::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            exit::USAGE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_gpus_are_warned_with_the_reason() {
        let w = zero_gpus_warning("auto");
        assert!(
            w.starts_with("warning: this node offers 0 GPUs") && w.contains("nvidia-smi"),
            "{w}"
        );
        assert!(zero_gpus_warning("0").contains("(--gpus 0)"));
    }

    #[test]
    fn resource_flags_are_read_and_checked() {
        let c = CustomResources::parse_flags(&["nvme=2".into(), "ib_hca = 4".into()]).unwrap();
        assert_eq!(c.to_text(), "ib_hca=4,nvme=2");
        for (bad, says) in [
            ("nvme", "NAME=QTY"),
            ("nvme=x", "not a whole number"),
            ("nvme=-1", "not a whole number"),
            ("gpu=1", "built-in"),
            ("a b=1", "not a resource name"),
        ] {
            let e = CustomResources::parse_flags(&[bad.into()]).unwrap_err();
            assert!(e.contains(says) && e.starts_with("--resource"), "{bad}: {e}");
        }
        let e = CustomResources::parse_flags(&["nvme=1".into(), "nvme=2".into()]).unwrap_err();
        assert!(e.contains("twice"), "{e}");
    }

    #[test]
    fn auto_topology_keeps_readable_text_and_drops_the_rest() {
        let good = "\tGPU0\tCPU Affinity\nGPU0\t X \t0-7\n";
        assert_eq!(auto_topology(Some(good)), good);
        assert_eq!(
            auto_topology(Some("\tGPU0\tGPU1\nGPU0\t X \tNV4\n")),
            "",
            "row GPU1 missing"
        );
        assert_eq!(auto_topology(None), "");
    }

    #[test]
    fn task_env_entries_are_name_value_pairs_with_clear_errors() {
        let ok = task_env_of(&["A=1".into(), "B=x=y".into(), "C=".into()]).unwrap();
        assert_eq!(
            ok,
            vec![
                ("A".into(), "1".into()),
                ("B".into(), "x=y".into()),
                ("C".into(), String::new())
            ]
        );
        let e = task_env_of(&["NOVALUE".into()]).unwrap_err();
        assert!(e.contains("--task-env `NOVALUE`") && e.contains("NAME=VALUE"), "{e}");
        let e = task_env_of(&["GPUAM_HOST=x".into()]).unwrap_err();
        assert!(
            e.contains("--task-env `GPUAM_HOST=x`") && e.contains("set by gpuam"),
            "{e}"
        );
    }
}
