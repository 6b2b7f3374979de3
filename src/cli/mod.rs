//! The `gpuam` command line (DESIGN.md §7): argument parsing, logging set-up, and
//! one function per command. Every command returns its exit code from `crate::exit`.

pub(crate) mod am;
mod bench;
mod jobs;
mod node;
mod plan;
mod reap;
mod rm_api;
mod run;
pub(crate) mod servers;
mod target;
mod task_output;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};

use crate::config::{default_settings_path, Settings};
use crate::exit;
use crate::spec::JobSpec;

#[derive(Parser, Debug)]
#[command(
    name = "gpuam",
    version,
    about = "A per-job application master for GPU deep-learning jobs",
    after_help = "Exit codes: 0 success; 1 job failed or killed; 2 not placeable (plan); 64 usage; \
                  65 invalid job spec or cluster file; 69 RM unreachable or unavailable; 70 internal error; \
                  75 a limit of the RM was reached (try later); 77 no or a refused credential; \
                  66 no such job (or not yours).\n\
                  Job commands (jobs, status, logs, kill, history) find the RM and your token in --rm/--token-file, \
                  then GPUAM_RM/GPUAM_TOKEN, then ~/.config/gpuam/config.yaml (`gpuam login` writes it).\n\
                  Credentials: `gpuam submit` and `gpuam plan --rm` read a token from --token-file or GPUAM_TOKEN \
                  (the RM's operator makes one with `gpuam token new`).\n\
                  Settings: conf/gpuam.yaml (or $GPUAM_CONFIG), overridden by GPUAM__SECTION__KEY variables."
)]
struct Cli {
    /// Settings file (default: $GPUAM_CONFIG, else conf/gpuam.yaml if present, else built-in defaults).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run a job end to end: embedded RM on loopback, the AM, the executor, the dashboard.
    Run {
        job: PathBuf,
        /// Cluster file (default conf/cluster.yaml if present, else the built-in demo cluster).
        #[arg(long, value_name = "FILE")]
        cluster: Option<PathBuf>,
        /// The dashboard's address.
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
        /// Where containers' working directories and logs go (default: a new temporary directory).
        #[arg(long, value_name = "DIR")]
        work_dir: Option<PathBuf>,
        /// Do not stream the tasks' output (a failed task's stderr tail is still shown).
        #[arg(long)]
        quiet_tasks: bool,
        /// Seconds the dashboard stays up after the job ends (default: $GPUAM_DASHBOARD_LINGER_SEC,
        /// else 60 after a failure and 0 after a success); Ctrl-C leaves at once.
        #[arg(long, value_name = "SECS")]
        linger: Option<u64>,
    },
    /// Dry run of the whole job's placement.
    Plan {
        job: PathBuf,
        /// Cluster file (default conf/cluster.yaml if present, else the built-in demo cluster,
        /// as for `run`).
        #[arg(long, value_name = "FILE", conflicts_with = "rm")]
        cluster: Option<PathBuf>,
        /// Plan against a running RM's node view instead of a cluster file.
        #[arg(long, value_name = "URL")]
        rm: Option<String>,
        /// File holding your token for the RM (default: $GPUAM_TOKEN).
        #[arg(long, value_name = "FILE", requires = "rm")]
        token_file: Option<PathBuf>,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Check a job spec and report every problem with its line and column.
    Validate { job: PathBuf },
    /// The resource manager server.
    Rm {
        #[arg(long, value_name = "FILE")]
        cluster: Option<PathBuf>,
        /// Listen address (loopback by default; give 0.0.0.0:PORT to serve other hosts).
        #[arg(long, default_value = "127.0.0.1:8088")]
        listen: SocketAddr,
        #[arg(long, value_name = "DIR")]
        work_dir: Option<PathBuf>,
        /// File holding the admin token (default: $GPUAM_ADMIN_TOKEN, else a fresh token
        /// written to WORK_DIR/admin.token with mode 0600).
        #[arg(long, value_name = "FILE")]
        admin_token_file: Option<PathBuf>,
        /// Directory of the state database (rm-state.db, SQLite): applications,
        /// containers and node states survive an RM restart (default: WORK_DIR).
        #[arg(long, value_name = "DIR", conflicts_with = "in_memory")]
        state_dir: Option<PathBuf>,
        /// Keep the state in memory only: a restarted RM starts empty.
        #[arg(long)]
        in_memory: bool,
        /// The node agents' credentials file (`nodes:`, one token digest per host; `gpuam
        /// node-token new` writes it; reloaded when it changes): agents (`gpuam node`) are
        /// accepted, each for its own host only; without --cluster the node view is then
        /// the registered agents alone.
        #[arg(long, value_name = "FILE")]
        nodes_file: Option<PathBuf>,
        /// Gone: one token shared by every agent bound nothing to a host. Use --nodes-file.
        #[arg(long, value_name = "FILE", hide = true)]
        node_token_file: Option<PathBuf>,
        /// The users file (users and their token digests; `gpuam token new` writes it;
        /// default: setting rm.users_file). Without one only the admin token submits.
        #[arg(long, value_name = "FILE")]
        users_file: Option<PathBuf>,
        /// Start on a damaged state database anyway: repair what can be repaired, drop what
        /// cannot be read, and say what was dropped.
        #[arg(long, conflicts_with = "in_memory")]
        recover_state: bool,
        #[command(flatten)]
        ray: RayBackendArgs,
    },
    /// Users' credentials for the RM.
    Token {
        #[command(subcommand)]
        what: TokenCmd,
    },
    /// Node agents' credentials for the RM: one per host.
    NodeToken {
        #[command(subcommand)]
        what: NodeTokenCmd,
    },
    /// Print the extra `ray start` arguments that make this machine a gpuam node of a Ray cluster.
    RayNodeArgs {
        /// The node's gpuam host name.
        #[arg(long)]
        host: String,
        /// GPUs: auto (nvidia-smi) or a count.
        #[arg(long, default_value = "auto")]
        gpus: String,
        /// GPU topology: auto (nvidia-smi topo -m), none, or a preset.
        #[arg(long, default_value = "auto")]
        topology: String,
        /// Rack path, e.g. /dc1/rack7.
        #[arg(long)]
        rack: Option<String>,
        /// GPU type for gpuType filters (default: from nvidia-smi).
        #[arg(long)]
        gpu_type: Option<String>,
        /// Port ranges gpuam may hand to containers on this node.
        #[arg(long, default_value = crate::ray::scheme::DEFAULT_PORTS)]
        ports: String,
        /// A custom resource the node offers (repeat for more), e.g. `--resource nvme=2`.
        #[arg(long = "resource", value_name = "NAME=QTY")]
        resources: Vec<String>,
    },
    /// The node agent of this machine: registers with the RM, runs granted containers
    /// (each in its own cgroup, as an unprivileged user).
    Node(node::NodeArgs),
    /// One application master (what the RM launches per job).
    Am {
        job: PathBuf,
        #[arg(long, value_name = "URL")]
        rm: String,
        #[arg(long)]
        app_id: String,
        /// The application's bearer token (also read from GPUAM_APP_TOKEN).
        #[arg(long, env = "GPUAM_APP_TOKEN", hide_env_values = true)]
        token: String,
        /// The dashboard's address.
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
    },
    /// Your jobs that run or wait: number, name, user, queue, state, tasks, GPUs, age.
    Jobs(jobs::JobsArgs),
    /// One job: its state, times, why it waits or why it ended, and its tasks.
    Status(jobs::StatusArgs),
    /// A task's stdout (or --stderr), also after the job ended; --follow streams it.
    Logs(jobs::LogsArgs),
    /// Stop a job (yours; the admin: any).
    Kill(jobs::KillArgs),
    /// Finished jobs: times, exit, reason, GPU-hours (filter by --user, --queue, --state).
    History(jobs::HistoryArgs),
    /// Save the RM's address and your token in ~/.config/gpuam/config.yaml (mode 0600),
    /// so that the job commands need neither --rm nor --token-file.
    Login(jobs::LoginArgs),
    /// Submit a job to a running RM.
    Submit {
        job: PathBuf,
        /// The RM's URL (default: $GPUAM_RM, else `rm:` of ~/.config/gpuam/config.yaml).
        #[arg(long, value_name = "URL")]
        rm: Option<String>,
        /// Follow the job and exit with its exit code.
        #[arg(long)]
        wait: bool,
        /// The dashboard's address (on the AM's machine). A user names port 0 (any free port)
        /// unless the RM's operator gives users a range (`rm.dashboard_ports`).
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
        /// File holding the RM's admin token, used to kill the job on Ctrl-C (default:
        /// $GPUAM_ADMIN_TOKEN; without either, your token, then the job token the CLI
        /// generates, is used).
        #[arg(long, value_name = "FILE")]
        admin_token_file: Option<PathBuf>,
        /// File holding your token for the RM (default: $GPUAM_TOKEN, else `token:` of
        /// ~/.config/gpuam/config.yaml; the RM's operator makes one with `gpuam token new`).
        #[arg(long, value_name = "FILE")]
        token_file: Option<PathBuf>,
    },
    /// Trace-driven placement simulator: policies compared on one job stream (docs/BENCHMARKS.md).
    Sim(SimArgs),
    /// Benchmarks that print their figures (see docs/BENCHMARKS.md).
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
    /// Internal: the subreaper shim a node without cgroups runs each container under
    /// (`crate::node::shim`).
    #[command(name = "container-shim", hide = true)]
    ContainerShim {
        /// The container's command and its arguments, after `--`.
        #[arg(last = true, required = true, value_name = "COMMAND")]
        command: Vec<std::ffi::OsString>,
    },
    /// Internal: `gpuam run`'s reaper, which ends the run's AM and tasks if the run is
    /// killed (`cli::reap`).
    #[command(name = "reap-run", hide = true)]
    ReapRun {
        /// The run's work directory.
        work_dir: PathBuf,
    },
}

/// `gpuam rm --backend ray`: run containers on an existing Ray cluster.
#[derive(clap::Args, Debug)]
pub(crate) struct RayBackendArgs {
    /// Where containers run: `local` (this process, the cluster file's nodes) or `ray`.
    #[arg(long, env = "GPUAM_RM_BACKEND", default_value = "local", value_parser = ["local", "ray"])]
    pub backend: String,
    /// The Ray dashboard's URL (with --backend ray), e.g. http://HOST:8265.
    #[arg(
        long,
        env = "GPUAM_RAY_ADDRESS",
        value_name = "URL",
        required_if_eq("backend", "ray")
    )]
    pub ray_address: Option<String>,
    /// Where the cancel gate that Ray jobs ask before they start listens (default: the RM's
    /// listen address, any port).
    #[arg(long, value_name = "ADDR")]
    pub ray_gate_listen: Option<SocketAddr>,
    /// The gate's URL as Ray nodes reach it (default: http://<gate listen address>).
    #[arg(long, value_name = "URL")]
    pub ray_gate_url: Option<String>,
    /// How containers run on Ray: `jobs` (one Ray job per container) or `driver` (one
    /// long-lived Ray driver, a placement group per container; docs/RAY.md).
    #[arg(long, env = "GPUAM_RAY_LAUNCH", default_value = "driver", value_parser = ["driver", "jobs"])]
    pub ray_launch: String,
    /// The Python of the Ray installation that runs the driver (`--ray-launch driver`).
    #[arg(long, env = "GPUAM_RAY_PYTHON", default_value = "python3", value_name = "PATH")]
    pub ray_python: String,
    /// Ray's GCS address for the driver (default: the dashboard's host, port 6379).
    #[arg(long, env = "GPUAM_RAY_GCS_ADDRESS", value_name = "HOST:PORT")]
    pub ray_gcs_address: Option<String>,
}

#[derive(clap::Args, Debug)]
struct SimArgs {
    /// Job stream: philly, alibaba2023, synthetic, or fractional (30 % small jobs of 0.25 or
    /// 0.5 GPU, placed with shares and with shares rounded up to whole GPUs).
    #[arg(long, default_value = "synthetic")]
    workload: String,
    /// Node topology preset, or `all` (synthetic: every preset of ≤ 16 GPUs; traces: every
    /// 8-GPU preset for the 8-GPU machines). Default: pcie8 (synthetic), per-trace defaults.
    #[arg(long)]
    topology: Option<String>,
    /// Nodes of the generated cluster (synthetic only).
    #[arg(long, default_value_t = 32)]
    nodes: usize,
    /// Jobs per seed (traces: a window of this many jobs per seed).
    #[arg(long, default_value_t = 2000)]
    jobs: usize,
    #[arg(long, default_value_t = 5)]
    seeds: usize,
    /// Offered load (GPU-time asked / available); traces: arrivals rescaled to it, 0 = recorded times.
    #[arg(long, default_value_t = 0.8)]
    load: f64,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "original,random,besteffort,hived,gpuam"
    )]
    policies: Vec<String>,
    /// Request-size mix of the synthetic stream (A or B).
    #[arg(long, default_value = "A")]
    mix: String,
    /// Nodes per rack of the generated cluster.
    #[arg(long, default_value_t = 8)]
    rack_size: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Write results.json, results.csv and SVG charts here.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Also measure decision time as clusters grow (100 → 10,000 nodes, pcie8 → pcie64).
    #[arg(long)]
    scaling: bool,
    /// Trace directory (default $GPUAM_TRACES, else data/traces: the repository's samples).
    #[arg(long, value_name = "DIR")]
    traces: Option<PathBuf>,
    /// Simulate the RM's queues instead of comparing policies: `name=weight,...` (jobs go to
    /// the queues round robin); reports each queue's share over time against its deserved
    /// share (table, and `queues_share.svg` under --out).
    #[arg(long, value_name = "NAME=WEIGHT,...")]
    queues: Option<String>,
    /// Notice before a preempted job stops, in seconds (with --queues).
    #[arg(long, default_value_t = 30.0)]
    grace_sec: f64,
    /// Queue discipline: every waiting job that fits starts, in arrival order (greedy
    /// backfill), instead of FIFO with head-of-line blocking.
    #[arg(long)]
    backfill: bool,
    /// Reservations (implies --backfill): a gang that has waited this long holds the one
    /// reservation (the RM's reservation::Policy); others backfill around it.
    #[arg(long, value_name = "SEC")]
    reserve_wait_sec: Option<u64>,
    /// Reservations (implies --backfill) for gangs of at least this many GPUs.
    #[arg(long, value_name = "GPUS")]
    reserve_min_gpus: Option<u32>,
    /// Expected durations for reservations and start estimates: declared[:F|:LO-HI] (each
    /// job declares its real duration × F, or × a factor drawn per job in [LO, HI], rounded
    /// up to the minute, and that limit is its end), calibrated[:F|:LO-HI] (the same limits,
    /// scaled by what the jobs that ended used of theirs, as the live RM does per user; a
    /// start estimate is the median of walks over drawn shares) or
    /// learned (reservations: the median of earlier jobs' durations; start estimates: drawn
    /// from those and the running jobs' time so far).
    #[arg(long, default_value = "declared")]
    expected_end: String,
    /// Gangs of at least this many GPUs are reported as big (bigWaitP95).
    #[arg(long, default_value_t = 32)]
    big_gpus: u32,
    /// Run-time limits the jobs declare to the placement (a role's `maxRunSec`): off, F
    /// (each job its duration × F) or LO-HI (× a factor drawn per job between LO and HI),
    /// rounded up to the minute. gpuam's order places declared work where nodes drain
    /// together; the other policies ignore the limits.
    #[arg(long, default_value = "off", value_name = "off|F|LO-HI")]
    run_limits: String,
}

#[derive(Subcommand, Debug)]
enum TokenCmd {
    /// Make a new token for a user: its SHA-256 goes into the users file (created with
    /// mode 0600 if missing; the user's old token stops working), the token is printed
    /// (or written to --out) once and kept nowhere else.
    New {
        #[arg(long)]
        user: String,
        /// The users file (default: setting rm.users_file).
        #[arg(long, value_name = "FILE")]
        users_file: Option<PathBuf>,
        /// Write the token to this file (mode 0600) instead of printing it.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
}

#[derive(Subcommand, Debug)]
enum NodeTokenCmd {
    /// Make a new token for the agent of one host: its SHA-256 goes into the nodes file
    /// (created with mode 0600 if missing; the host's old token stops working), the token
    /// is printed (or written to --out) once; give it to that host's `gpuam node
    /// --node-token-file`. It lets its holder act as that host only.
    New {
        #[arg(long)]
        host: String,
        /// The RM's nodes file (`gpuam rm --nodes-file`).
        #[arg(long, value_name = "FILE")]
        nodes_file: PathBuf,
        /// Write the token to this file (mode 0600) instead of printing it.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
}

#[derive(Subcommand, Debug)]
enum BenchCmd {
    /// The select pipeline at 100, 1,000, 10,000 and 100,000 nodes, and a 1,000-task job plan.
    Select {
        /// Timed selects per cluster size.
        #[arg(long, default_value_t = 2000)]
        iterations: usize,
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Cluster sizes to measure.
        #[arg(long, value_delimiter = ',', default_value = "100,1000,10000,100000")]
        nodes: Vec<usize>,
        /// The task declares this run time (seconds) and the busy nodes when they drain:
        /// the drain term's path of the order (issue 27).
        #[arg(long, value_name = "SEC")]
        max_run_sec: Option<u64>,
    },
    /// A job of many one-GPU tasks through the real RM, AM and executor.
    Job {
        #[arg(long, default_value_t = 1000)]
        tasks: u32,
        #[arg(long, default_value_t = 200)]
        nodes: usize,
        #[arg(long, default_value_t = 42)]
        seed: u64,
    },
    /// Many jobs at once, each with its own AM, through the real RM and executor.
    Cluster {
        #[arg(long, default_value_t = 20)]
        jobs: u32,
        #[arg(long, default_value_t = 10)]
        tasks: u32,
        #[arg(long, default_value_t = 1000)]
        nodes: usize,
        #[arg(long, default_value_t = 42)]
        seed: u64,
    },
}

/// Entry point: parses the command line and runs the command.
pub fn main() -> i32 {
    crate::node::procs::close_inherited_at_exec();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = match e.kind() {
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => exit::SUCCESS,
                _ => exit::USAGE,
            };
            let _ = e.print();
            return code;
        }
    };
    // A command that prints and exits dies quietly when its reader goes away (`gpuam
    // validate F | head -1`), as Unix tools do, instead of panicking in `println!`. The
    // servers keep Rust's default (ignored; their sockets never raise it anyway).
    if !matches!(
        cli.command,
        Cmd::Rm { .. }
            | Cmd::Node(_)
            | Cmd::Am { .. }
            | Cmd::Run { .. }
            | Cmd::ContainerShim { .. }
            | Cmd::ReapRun { .. }
    ) {
        // SAFETY: plain syscall at start-up, before any other thread exists.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    // The shim is a container's process: no logging set-up, no settings, no runtime (it
    // must stay single-threaded).
    if let Cmd::ContainerShim { command } = &cli.command {
        return shim_exit(crate::node::shim::run(command));
    }
    if let Cmd::ReapRun { work_dir } = &cli.command {
        return reap::run(work_dir);
    }
    init_logging();
    let settings = match load_settings(cli.config.as_deref()) {
        Ok(s) => s,
        Err(code) => return code,
    };
    // AMs (and other children) run in other directories with the same settings: hand
    // them the settings file and the TLS paths made absolute. Set before the runtime
    // starts, while this is the only thread.
    if let Some(file) = cli
        .config
        .clone()
        .or_else(default_settings_path)
        .and_then(|p| std::fs::canonicalize(p).ok())
    {
        std::env::set_var("GPUAM_CONFIG", file);
    }
    for (k, v) in settings.tls.env_vars() {
        std::env::set_var(k, v);
    }
    // `gpuam run` keeps its AM's dashboard up for its own linger and then stops the AM: the
    // AM (a child) waits for that. The caller's own GPUAM_DASHBOARD_LINGER_SEC is the linger.
    let env_linger = std::env::var(run::LINGER_ENV).ok().and_then(|v| v.parse::<u64>().ok());
    if matches!(cli.command, Cmd::Run { .. }) {
        std::env::set_var(run::LINGER_ENV, run::RUN_AM_LINGER_SEC.to_string());
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return exit::INTERNAL;
        }
    };
    match cli.command {
        Cmd::Validate { job } => plan::validate(&job),
        Cmd::Plan {
            job,
            cluster,
            rm,
            json,
            token_file,
        } => match read_token(token_file.as_deref(), USER_TOKEN_ENV, "token") {
            Ok(token) => runtime.block_on(plan::plan(
                &job,
                cluster.as_deref(),
                rm.as_deref(),
                token,
                json,
                &settings,
            )),
            Err(code) => code,
        },
        Cmd::Run {
            job,
            cluster,
            listen,
            work_dir,
            quiet_tasks,
            linger,
        } => match work_dir
            .as_deref()
            .map(|d| check_own_dir("--work-dir", d))
            .unwrap_or(Ok(()))
        {
            Err(code) => code,
            Ok(()) => runtime.block_on(run::run(
                &job,
                cluster.as_deref(),
                listen,
                work_dir,
                &settings,
                run::RunView {
                    quiet_tasks,
                    linger: linger.or(env_linger),
                },
            )),
        },
        Cmd::Submit {
            job,
            rm,
            wait,
            listen,
            admin_token_file,
            token_file,
        } => match (
            admin_token(admin_token_file.as_deref()),
            target::resolve(&target::TargetArgs { rm, token_file }),
        ) {
            (Ok(admin), Ok(t)) => runtime.block_on(run::submit(
                &job,
                &t,
                wait,
                listen,
                run::Credentials {
                    user: t.token.clone(),
                    admin,
                },
                &settings.tls,
            )),
            (Err(code), _) | (_, Err(code)) => code,
        },
        Cmd::Jobs(a) => runtime.block_on(jobs::jobs(&a, &settings.tls)),
        Cmd::Status(a) => runtime.block_on(jobs::status(&a, &settings.tls)),
        Cmd::Logs(a) => runtime.block_on(jobs::logs(&a, &settings.tls)),
        Cmd::Kill(a) => runtime.block_on(jobs::kill(&a, &settings.tls)),
        Cmd::History(a) => runtime.block_on(jobs::history(&a, &settings.tls)),
        Cmd::Login(a) => runtime.block_on(target::login(&a.target, &settings.tls)),
        Cmd::Token {
            what: TokenCmd::New { user, users_file, out },
        } => token_new(
            crate::rm::users::Table::Users,
            &user,
            users_file.or(settings.rm.users_file.clone()).as_deref(),
            out.as_deref(),
        ),
        Cmd::NodeToken {
            what: NodeTokenCmd::New { host, nodes_file, out },
        } => token_new(crate::rm::users::Table::Nodes, &host, Some(&nodes_file), out.as_deref()),
        Cmd::Rm {
            cluster,
            listen,
            work_dir,
            admin_token_file,
            state_dir,
            in_memory,
            nodes_file,
            node_token_file,
            users_file,
            recover_state,
            ray,
        } => match admin_token(admin_token_file.as_deref()) {
            Ok(_) if node_token_file.is_some() => {
                eprintln!(
                    "error: --node-token-file is gone from `gpuam rm`: a token shared by every agent bound nothing \
                     to a host. Give each host its own: `gpuam node-token new --host HOST --nodes-file nodes.yaml \
                     --out HOST.token`, start the RM with --nodes-file nodes.yaml and each agent with \
                     --node-token-file HOST.token"
                );
                exit::USAGE
            }
            Ok(admin) => {
                let state = servers::StateOption::from_flags(state_dir, in_memory, recover_state);
                let mut settings = settings;
                if users_file.is_some() {
                    settings.rm.users_file = users_file;
                }
                runtime.block_on(servers::rm(
                    servers::NodeSources {
                        nodes_file: nodes_file.as_deref(),
                        ray: &ray,
                    },
                    cluster.as_deref(),
                    listen,
                    work_dir,
                    admin,
                    state,
                    &settings,
                ))
            }
            Err(code) => code,
        },
        Cmd::Node(args) => runtime.block_on(node::node(args, &settings)),
        Cmd::RayNodeArgs {
            host,
            gpus,
            topology,
            rack,
            gpu_type,
            ports,
            resources,
        } => match crate::ray::args::line(&crate::ray::args::NodeArgsRequest {
            host,
            gpus,
            topology,
            rack,
            gpu_type,
            ports,
            resources,
        }) {
            Ok(line) => {
                println!("{line}");
                exit::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                exit::USAGE
            }
        },
        Cmd::Am {
            job,
            rm,
            app_id,
            token,
            listen,
        } => runtime.block_on(servers::am(&job, &rm, &app_id, &token, listen, settings)),
        Cmd::Sim(a) => sim_exit(
            crate::sim::SimOptions::queueing_of(
                a.backfill,
                a.reserve_wait_sec,
                a.reserve_min_gpus,
                &a.expected_end,
                a.big_gpus,
                &a.run_limits,
            )
            .and_then(|queueing| {
                crate::sim::run(&crate::sim::SimOptions {
                    workload: a.workload,
                    topology: a.topology,
                    nodes: a.nodes,
                    jobs: a.jobs,
                    seeds: a.seeds,
                    load: a.load,
                    policies: a.policies,
                    mix: a.mix,
                    rack_size: a.rack_size,
                    json: a.json,
                    out: a.out,
                    scaling: a.scaling,
                    traces: a.traces,
                    queues: a.queues,
                    grace_sec: a.grace_sec,
                    topology_wait_sec: settings.select.topology_wait_sec,
                    queueing,
                })
            }),
        ),
        Cmd::Bench { what } => match what {
            BenchCmd::Select {
                iterations,
                seed,
                nodes,
                max_run_sec,
            } => bench::select_bench(&nodes, iterations, seed, max_run_sec),
            BenchCmd::Job { tasks, nodes, seed } => runtime.block_on(bench::job_bench(tasks, nodes, seed)),
            BenchCmd::Cluster {
                jobs,
                tasks,
                nodes,
                seed,
            } => runtime.block_on(bench::cluster_bench(jobs, tasks, nodes, seed)),
        },
        // Run above, before logging and the runtime (the shim must stay single-threaded).
        Cmd::ContainerShim { .. } | Cmd::ReapRun { .. } => exit::INTERNAL,
    }
}

/// The container shim's exit: as its main child ended (the same code, or the same signal
/// raised on itself, else 128 + the signal); 64 without a command, 127 when the command
/// cannot be run (as a shell's "command not found").
fn shim_exit(result: Result<crate::node::shim::ShimEnd, crate::node::shim::ShimError>) -> i32 {
    use crate::node::shim::{end_as_killed_by, ShimEnd, ShimError, CANNOT_RUN};
    match result {
        Ok(ShimEnd::Exited(code)) => code,
        Ok(ShimEnd::Killed(sig)) => {
            end_as_killed_by(sig);
            128 + sig
        }
        Ok(ShimEnd::Unknown) => exit::INTERNAL,
        Err(e) => {
            eprintln!("{e}");
            match e {
                ShimError::NoCommand => exit::USAGE,
                ShimError::CannotRun { .. } => CANNOT_RUN,
            }
        }
    }
}

/// `gpuam sim`'s exit: 64 for a bad flag, 65 for trace files missing or malformed, 70
/// when the results cannot be written; the reason on stderr.
fn sim_exit(result: Result<(), crate::sim::SimError>) -> i32 {
    use crate::sim::SimError;
    let Err(e) = result else {
        return exit::SUCCESS;
    };
    eprintln!("error: {e}");
    match e {
        SimError::Usage(_) => exit::USAGE,
        SimError::Input(_) => exit::INVALID_INPUT,
        SimError::Output(_) => exit::INTERNAL,
    }
}

/// The variable holding a user's token when no `--token-file` is given.
pub const USER_TOKEN_ENV: &str = "GPUAM_TOKEN";

/// The admin token from `--admin-token-file` or `GPUAM_ADMIN_TOKEN` (`None` if
/// neither is given); exit 64 when the file cannot be read or is empty.
/// The work dir of `gpuam run` (when named), `gpuam rm` and `gpuam node`, and `gpuam rm`'s
/// `--state-dir`, made (when missing) as this user's own before anything is written there:
/// one that another user owns or could replace is refused
/// ([`crate::node::identity::make_owned_dir`]): exit 64, naming `flag`.
pub(crate) fn check_own_dir(flag: &str, dir: &Path) -> Result<(), i32> {
    crate::node::identity::make_owned_dir(dir).map(drop).map_err(|e| {
        eprintln!("error: {flag}: {e}");
        exit::USAGE
    })
}

fn admin_token(file: Option<&Path>) -> Result<Option<String>, i32> {
    read_token(file, "GPUAM_ADMIN_TOKEN", "admin token")
}

/// A token from `file`, else from the variable `env` (`None` if neither is given); exit
/// 64 when the file cannot be read or is empty.
fn read_token(file: Option<&Path>, env: &str, what: &str) -> Result<Option<String>, i32> {
    if let Some(f) = file {
        let t = crate::auth::read_token_file(f).map_err(|e| {
            eprintln!("error: cannot read the {what} file {}: {e}", f.display());
            exit::USAGE
        })?;
        return Ok(Some(t));
    }
    Ok(std::env::var(env)
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty()))
}

/// `gpuam token new` / `gpuam node-token new`: adds a fresh token for `user` (a host for
/// [`Table::Nodes`](crate::rm::users::Table)) to the credentials file and hands it out once.
fn token_new(table: crate::rm::users::Table, user: &str, users_file: Option<&Path>, out: Option<&Path>) -> i32 {
    use crate::rm::users::Table;
    let Some(file) = users_file else {
        eprintln!("error: name the users file: --users-file FILE (or the setting rm.users_file)");
        return exit::USAGE;
    };
    let (who, how) = match table {
        Table::Users => (
            format!("user `{user}`"),
            format!("Give it to gpuam with --token-file FILE or {USER_TOKEN_ENV}"),
        ),
        Table::Nodes => (
            format!("host `{user}`'s agent"),
            format!("Give it to that host's agent only: gpuam node --host {user} --node-token-file FILE"),
        ),
    };
    let token = match crate::rm::users::add_token_to(file, user, table) {
        Ok(t) => t,
        Err(e @ crate::rm::users::UsersError::Invalid(_)) => {
            eprintln!(
                "{e}\nerror: the credentials file {} is not valid; nothing was changed",
                file.display()
            );
            return exit::INVALID_INPUT;
        }
        Err(e) => {
            eprintln!("error: {e}");
            return exit::USAGE;
        }
    };
    match out {
        Some(path) => {
            if let Err(e) = crate::auth::write_secret(path, &token) {
                eprintln!(
                    "error: cannot write the token to {}: {e} (the credentials file already has it: run again for a new one)",
                    path.display()
                );
                return exit::USAGE;
            }
            println!(
                "token of {who} written to {} (mode 0600); its SHA-256 is in {}",
                path.display(),
                file.display()
            );
        }
        None => {
            println!("{token}");
            eprintln!(
                "token of {who} above (shown once); its SHA-256 is in {}. {how}. A running RM picks the change \
                 up within a second.",
                file.display()
            );
        }
    }
    exit::SUCCESS
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPUAM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn load_settings(path: Option<&Path>) -> Result<Settings, i32> {
    let file = path.map(Path::to_path_buf).or_else(default_settings_path);
    Settings::load(file.as_deref()).map_err(|e| {
        eprintln!("error: {e}");
        exit::INVALID_INPUT
    })
}

/// Loads and validates a job spec, printing every problem; exit 65 on failure.
pub(crate) fn load_job(path: &Path) -> Result<(JobSpec, String), i32> {
    let text = match crate::spec::parse::read_limited(path, crate::spec::limits::MAX_SPEC_BYTES) {
        Ok(t) => t,
        Err((msg, fix)) => {
            eprintln!("error: {msg} ({fix})");
            return Err(exit::INVALID_INPUT);
        }
    };
    match crate::spec::parse_job_spec(&text, &path.display().to_string()) {
        Ok(j) => {
            // Accepted but not honoured: said once, where the user reads (validate, plan, run).
            for w in &j.warnings {
                eprintln!("{}:{w}", path.display());
            }
            Ok((j, text))
        }
        Err(errs) => {
            eprintln!("{errs}");
            eprintln!("error: {} problem(s) in {}", errs.0.len(), path.display());
            Err(exit::INVALID_INPUT)
        }
    }
}

/// Writes `text` to `out` as a terminal may show it (`text::shown`: control characters
/// escaped, so `\u{1b}` appears as those six characters). The one way the CLI's tables
/// and reports built from what the RM answered (other users' job names, node racks,
/// labels and GPU types, diagnostics, reasons) reach the terminal: the RM refuses such
/// text where it comes in, and this is the second line for what got in before.
pub(crate) fn emit_to(out: &mut impl std::io::Write, text: &str) -> std::io::Result<()> {
    out.write_all(crate::text::shown(text).as_bytes())
}

/// [`emit_to`] standard output (a closed pipe is not an error worth a panic).
pub(crate) fn emit(text: &str) {
    let _ = emit_to(&mut std::io::stdout().lock(), text);
}

/// Loads the cluster: `--cluster FILE`, else conf/cluster.yaml if present here, else the
/// demo cluster built into the binary (config::cluster_source); exit 65 on failure.
pub(crate) fn load_cluster(path: Option<&Path>) -> Result<Vec<crate::cluster::Node>, i32> {
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    let (loaded, source) = match crate::config::cluster_source(path, &cwd) {
        crate::config::ClusterSource::File(p) => (crate::cluster::file::load_cluster_file(&p), p.display().to_string()),
        crate::config::ClusterSource::BuiltIn => {
            eprintln!("note: no --cluster and no conf/cluster.yaml here: using the built-in demo cluster");
            (
                crate::cluster::file::parse_cluster_file(crate::config::BUILT_IN_CLUSTER, "built-in demo cluster"),
                "the built-in demo cluster".to_string(),
            )
        }
    };
    loaded.map_err(|errs| {
        eprintln!("{errs}");
        eprintln!("error: the cluster file {source} is not valid");
        exit::INVALID_INPUT
    })
}
