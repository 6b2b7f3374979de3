//! Starting a container: checking the start, creating its record and work directory,
//! its cgroup, and spawning `launch.sh` in a new session inside it, as its user, under
//! `taskset` or the subreaper shim when asked; then handing it to the ending protocol
//! ([`super::ending`]) and the log and disk watchers.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use tokio::sync::watch;

use super::ending::wait_container;
use super::env::{container_env, inherited, launch_script};
use super::logs::{watch_logs, LogStream};
use super::records::{record_name, spread_records, valid_container_id, work_dir, PROCESS_FILE};

/// Test fault injection: the containers whose `process.json` write fails (the record is
/// what lets a task run, [`super::hold`]).
#[cfg(test)]
pub(super) static UNRECORDABLE: parking_lot::Mutex<Vec<String>> = parking_lot::Mutex::new(Vec::new());
use super::table::{Entry, Phase};
use super::{Executor, RunAs};
use crate::node::cgroup::{Cgroup, Limits};
use crate::node::contract::validate_context;
use crate::node::procs::ProcessId;
use crate::node::NodeError;
use crate::protocol::LaunchContext;
use crate::resources::Resources;
use crate::topology::{task_locality, CpuList, Topology};

impl Executor {
    /// Starts `ctx.commands` for a granted container; returns the process-group id.
    /// The executor adds the GPU environment (CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES,
    /// GPUAM_GPU_MASK, CONTAINER_GPUS) and GPUAM_CONTAINER_ID / GPUAM_HOST itself.
    ///
    /// Environment: a clean base (PATH, HOME, LANG from the executor's environment), then
    /// `ctx.env`, then the executor's variables, which win over `ctx.env` for their names:
    /// - `CUDA_VISIBLE_DEVICES`: ascending GPU indices of `granted.gpu_mask` (`"1,3"`); for
    ///   no GPUs the empty string, which makes CUDA frameworks see no device at all (unset
    ///   would expose every GPU of a local node);
    /// - `NVIDIA_VISIBLE_DEVICES`: the same list; for no GPUs `none`, the NVIDIA container
    ///   toolkit's explicit "no GPU" value (empty means "not set" to it);
    /// - `GPUAM_GPU_MASK` (`"0xa"`), `CONTAINER_GPUS` (the mask in decimal, `"10"`);
    /// - `GPUAM_CONTAINER_ID`, `GPUAM_HOST`, `GPUAM_CONTAINER_DIR`, `GPUAM_PREEMPT_FILE`
    ///   (a path that exists once the container is being preempted);
    /// - for a GPU share, `GPUAM_GPU_FRACTION` and `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`; for
    ///   custom resources `GPUAM_RESOURCES` and `GPUAM_RESOURCE_<NAME>` (see `share_env`).
    ///
    /// The process runs `bash launch.sh` in the record's `work/` as the leader of a new
    /// session and process group, stdin from /dev/null (once [`super::hold`] let it run),
    /// stdout and stderr to the files `stdout` and `stderr` there. One `NodeEvent::Exited` follows when it ends; when the
    /// start itself fails this returns `Err` and no event is sent.
    ///
    /// Must be called within a tokio runtime (see the module doc).
    pub fn start(
        &self,
        container_id: &str,
        host: &str,
        granted: &Resources,
        ctx: LaunchContext,
    ) -> Result<u32, NodeError> {
        self.start_as(container_id, host, granted, ctx, None, None)
    }

    /// [`Executor::start`] on a node whose GPU topology is `topology`: the task also gets
    /// where its GPUs are ([`crate::topology::task_locality`]): `GPUAM_NIC`, `NCCL_IB_HCA`,
    /// `GPUAM_NUMA_NODES`, and its GPUs' NUMA-local CPUs (those this node can use) as its
    /// cgroup's cpuset where the node has one, else through `taskset -c`; either way
    /// `GPUAM_CPU_AFFINITY` names them.
    ///
    /// For a task of `user` (the job's submitter), with [`ExecutorOptions::users`], it
    /// runs as that user's own uid ([`crate::node::identity`]); `user` is the task's `GPUAM_USER`.
    pub fn start_as(
        &self,
        container_id: &str,
        host: &str,
        granted: &Resources,
        ctx: LaunchContext,
        topology: Option<&Topology>,
        user: Option<&str>,
    ) -> Result<u32, NodeError> {
        let fail = |why: String| NodeError::StartFailed {
            id: container_id.into(),
            why,
        };
        check_start(container_id, granted, &ctx).map_err(&fail)?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(fail("the executor must be called from within a tokio runtime".into()));
        }
        let run_as = match (&self.opts.users, user) {
            (Some(users), Some(user)) => users.resolve(user).map_err(&fail)?,
            (Some(users), None) if users.per_user() => {
                return Err(fail(
                    "the start names no user; a per-user node runs every task as its user's uid".into(),
                ))
            }
            (Some(users), None) => users.resolve("").map_err(&fail)?,
            (None, _) => self.opts.run_as.clone(),
        };
        self.sweep_now_and_then();
        self.spread.call_once(|| spread_records(&self.root));

        let dir = self.root.join(record_name(container_id, &ctx.env));
        let was_allocated = {
            let mut table = self.table.lock();
            match table.get_mut(container_id) {
                Some(e) if e.phase != Phase::Allocated => return Err(NodeError::AlreadyStarted(container_id.into())),
                Some(e) => {
                    e.phase = Phase::Starting;
                    e.dir = dir.clone();
                    true
                }
                None => {
                    table.insert(container_id.into(), Entry::new(dir.clone(), Phase::Starting));
                    false
                }
            }
        };

        let locality = topology.map(|t| task_locality(t, granted.gpu_mask)).unwrap_or_default();
        let cpus = locality.cpus.as_ref().and_then(usable_cpus);
        let env = container_env(
            container_id,
            host,
            granted,
            &work_dir(&dir),
            &ctx,
            &self.opts,
            run_as.as_ref(),
            user,
            &locality,
            cpus.as_ref(),
            inherited(),
        );
        let limits = Limits {
            memory_mb: Some(granted.memory_mb).filter(|m| *m > 0),
            cpu: Some(u64::from(granted.cpu)).filter(|c| *c > 0),
            pids: None,
            gpus: Some(granted.gpu_mask),
            ports: Some(granted.ports.clone()),
        };
        let spawned = self
            .opts
            .containment
            .create(container_id, limits)
            .map_err(|e| format!("cannot create the container's cgroup: {e}"))
            .and_then(|mut cg| {
                // The cpuset where the node has one, else `taskset` around the task.
                let taskset = cpus
                    .as_ref()
                    .filter(|c| !self.opts.containment.pin_cpus(&mut cg, container_id, c))
                    .filter(|c| {
                        let found = taskset_found();
                        if !found {
                            tracing::warn!(
                                container = container_id,
                                "no cpuset and no `taskset` on PATH: not pinned to CPUs {c} (GPUAM_CPU_AFFINITY names them)"
                            );
                        }
                        found
                    })
                    .map(CpuList::to_string);
                let launch = Launch {
                    commands: &ctx.commands,
                    env: &env,
                    cgroup: &cg,
                    run_as: run_as.as_ref(),
                    taskset: taskset.as_deref(),
                    shim: self.opts.containment.shim(),
                    image: self.opts.image,
                };
                spawn_launch(&dir, container_id, &launch)
                    .map(|spawned| (spawned, cg.clone()))
                    .inspect_err(|_| cg.remove())
            });
        match spawned {
            Err(why) => {
                // Nothing ran: no record of it stays (a restarted node would take it for
                // a launch it has to end).
                let _ = super::files::remove_tree(&dir, run_as.as_ref().map(|u| u.uid));
                let mut table = self.table.lock();
                if was_allocated {
                    if let Some(e) = table.get_mut(container_id) {
                        e.phase = Phase::Allocated;
                    }
                } else {
                    table.remove(container_id);
                }
                Err(fail(why))
            }
            Ok((Spawned { child, pid, logs, hold }, cgroup)) => {
                // Written before anything else can happen to it, and before the task may
                // run: without this record a restarted executor could not find the process
                // again. Unrecorded, the task is never let run (it exits `HELD_EXIT`).
                let leader = ProcessId::of(pid);
                let recorded = leader
                    .ok_or_else(|| std::io::Error::other("its process is gone or unreadable in /proc"))
                    .and_then(|p| serde_json::to_vec(&p).map_err(std::io::Error::other))
                    .and_then(|b| {
                        #[cfg(test)]
                        if UNRECORDABLE.lock().iter().any(|c| c == container_id) {
                            return Err(std::io::Error::other("a write failure injected by a test"));
                        }
                        super::files::create_new_in(&dir, PROCESS_FILE, &b, None)
                    });
                match recorded {
                    Ok(()) => {
                        if let Err(e) = hold.release() {
                            tracing::warn!(container = container_id, "cannot let the task run: {e}");
                        }
                    }
                    Err(e) => {
                        tracing::warn!(
                            container = container_id,
                            "cannot record the process, so it does not run: {e}"
                        );
                        drop(hold);
                    }
                }
                let (done_tx, done_rx) = watch::channel(false);
                let disk_done = done_rx.clone();
                let logs = Arc::new(logs);
                if let Some(max) = self.opts.max_log_bytes {
                    tokio::spawn(watch_logs(logs.clone(), max, done_rx.clone()));
                }
                {
                    let mut table = self.table.lock();
                    if let Some(e) = table.get_mut(container_id) {
                        e.logs = logs;
                        e.phase = Phase::Running;
                        e.pid = Some(pid);
                        e.leader = leader;
                        e.done = Some(done_rx);
                        e.cgroup = cgroup.clone();
                        e.shim = self.opts.containment.shim().is_some();
                        e.owner = run_as.as_ref().map(|u| (u.uid, u.gid));
                    }
                }
                let ending = self.ending(container_id, dir, done_tx, cgroup);
                if let Some(mb) = self.opts.max_disk_mb {
                    let target = crate::node::bounds::Target {
                        cgroup: ending.cgroup.clone(),
                        pid,
                        shim: self.opts.containment.shim().is_some(),
                    };
                    // The task's own directory: its logs are the node's, bounded apart.
                    let (d, v) = (work_dir(&ending.dir), ending.verdict.clone());
                    tokio::spawn(crate::node::bounds::watch_disk(d, mb, target, v, disk_done));
                }
                tokio::spawn(wait_container(ending, child, pid, leader));
                Ok(pid)
            }
        }
    }
}

/// What a start must hold before anything is created: a valid id, exact GPUs for GPUs
/// granted, and a launch context bash can carry ([`validate_context`]). The error names
/// the field and the fix.
pub(super) fn check_start(container_id: &str, granted: &Resources, ctx: &LaunchContext) -> Result<(), String> {
    if !valid_container_id(container_id) {
        return Err(format!(
            "`{container_id}` is not a valid container id (use 1-255 characters of A-Z, a-z, 0-9, `_`, `.`, `-`, \
             not `.` or `..`)"
        ));
    }
    if granted.gpus > 0 && granted.gpu_mask == 0 {
        return Err(format!(
            "the granted resources name {} GPUs but no GPU mask; a container needs exact GPUs (gpuMask)",
            granted.gpus
        ));
    }
    validate_context(ctx)
}

/// Whether `taskset` (util-linux) is on this node's PATH (looked up once).
pub(super) fn taskset_found() -> bool {
    static FOUND: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FOUND.get_or_init(|| {
        std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join("taskset").is_file()))
            .unwrap_or(false)
    })
}

/// The CPUs of `wanted` this process may run on (`Cpus_allowed_list` of /proc/self/status);
/// `None` when none of them is (a topology text from another machine), or unknown.
pub(super) fn usable_cpus(wanted: &CpuList) -> Option<CpuList> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let allowed = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .and_then(CpuList::parse)?;
    Some(wanted.intersect(&allowed)).filter(|c| !c.is_empty())
}

/// What [`spawn_launch`] runs and how.
pub(super) struct Launch<'a> {
    commands: &'a [String],
    env: &'a [(String, String)],
    cgroup: &'a Cgroup,
    run_as: Option<&'a RunAs>,
    /// Run under `taskset -c LIST` (CPUs the cgroup could not pin).
    taskset: Option<&'a str>,
    /// Run it all under the subreaper shim of this `gpuam` executable (no cgroup).
    shim: Option<&'a Path>,
    /// What to do with a task that names an image.
    image: crate::node::image::ImagePolicy,
}

/// A task's process just started, held back from running its program.
pub(super) struct Spawned {
    pub child: super::vfork::Spawned,
    pub pid: u32,
    /// Handles of its log files, for the log watcher.
    pub logs: Vec<File>,
    /// Lets it run; released only once its process is recorded ([`super::hold`]).
    pub hold: super::hold::Hold,
}

/// Creates the directory and files and spawns the task (its program from
/// [`crate::node::image::program_for`]) in a new
/// session, inside its cgroup, as its user, under `taskset` when asked, held until the
/// caller releases it.
pub(super) fn spawn_launch(dir: &Path, id: &str, launch: &Launch<'_>) -> Result<Spawned, String> {
    let Launch {
        commands,
        env,
        cgroup,
        run_as,
        taskset,
        shim,
        image,
    } = *launch;
    let where_ = |what: &str, p: &Path, e: std::io::Error| format!("{what} {}: {e}", p.display());
    use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
    // The record (this node's, 0711: the task passes through to its work directory but
    // cannot list or change it) and in it the task's own directory (0700, the task's).
    let work = work_dir(dir);
    if let Some(root) = dir.parent() {
        std::fs::create_dir_all(root).map_err(|e| where_("cannot create directory", root, e))?;
    }
    // A start tried again after a failed one begins with a fresh work directory.
    match super::files::remove_tree(&work, run_as.map(|u| u.uid)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(where_("cannot clear", &work, e)),
        _ => {}
    }
    for (d, mode) in [(dir, 0o711), (work.as_path(), 0o700)] {
        match std::fs::DirBuilder::new().mode(mode).create(d) {
            Ok(()) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::AlreadyExists
                    && std::fs::symlink_metadata(d).is_ok_and(|m| m.is_dir()) => {}
            Err(e) => return Err(where_("cannot create directory", d, e)),
        }
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode))
            .map_err(|e| where_("cannot set the mode of", d, e))?;
    }
    // The task's own temporary directory (`TMPDIR`, [`super::env::TMP_DIR`]): the host's
    // /tmp is shared by every tenant (umask 022, names other tools derive from the user).
    // Made before the task runs, in a directory that is new.
    let tmp = work.join(super::env::TMP_DIR);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&tmp)
        .map_err(|e| where_("cannot create directory", &tmp, e))?;
    if let Some(u) = run_as {
        for d in [&work, &tmp] {
            std::os::unix::fs::lchown(d, Some(u.uid), Some(u.gid)).map_err(|e| where_("cannot chown", d, e))?;
        }
    }
    // On the host, or in the task's image (GPUAM_IMAGE) where the node has podman.
    let spawn = crate::node::image::program_for(dir, &work, id, env, image)?;
    let script = work.join("launch.sh");
    // 0600 and the task's alone: the commands may hold rendered secrets (OpenPAI
    // `<% $secrets.x %>`). The directory is new, so nothing of the task's is there yet.
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&script)
        .and_then(|f| {
            if let Some(u) = run_as {
                std::os::unix::fs::fchown(&f, Some(u.uid), Some(u.gid))?;
            }
            (&f).write_all(launch_script(id, &work, commands, spawn.host_script).as_bytes())
        })
        .map_err(|e| where_("cannot write", &script, e))?;
    // The logs are the node's, in the record: the task writes them through the handles it
    // is given and can neither reach nor replace them by name.
    let out_path = dir.join(LogStream::Stdout.file_name());
    let err_path = dir.join(LogStream::Stderr.file_name());
    // O_APPEND: when the log watcher cuts a file, the task's writes go on at its new end.
    let create = |p: &Path| {
        std::fs::OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(p)
            .and_then(|f| f.set_len(0).map(|()| f))
            .map_err(|e| where_("cannot create", p, e))
    };
    let out = create(&out_path)?;
    let err = create(&err_path)?;
    let watched = [&out, &err]
        .into_iter()
        .map(File::try_clone)
        .collect::<Result<Vec<File>, _>>()
        .map_err(|e| format!("cannot keep a handle of the log files: {e}"))?;

    // [shim --] [taskset -c LIST] program args
    let mut argv: Vec<std::ffi::OsString> = Vec::new();
    if let Some(exe) = shim {
        argv.extend([exe.into(), crate::node::shim::SUBCOMMAND.into(), "--".into()]);
    }
    if let Some(list) = taskset {
        argv.extend(["taskset".into(), "-c".into(), list.into()]);
    }
    argv.push(spawn.program.clone().into());
    argv.extend(spawn.args.iter().map(Into::into));
    // Held until its process is recorded (`hold`): the caller releases it. `launch.sh` on
    // the host holds itself; an image's runtime is held by a step in front of it.
    let (held_stdin, hold) = super::hold::new().map_err(|e| format!("cannot make the start's hold: {e}"))?;
    if !spawn.host_script {
        argv = super::hold::held_argv(argv);
    }
    let program = argv.remove(0);
    let joins = cgroup.join_paths();
    let private_dev = cgroup.private_dev();
    let plan = super::vfork::Plan {
        program: &program,
        args: &argv,
        env,
        cwd: &work,
        stdin: Some(std::os::fd::AsRawFd::as_raw_fd(&held_stdin)),
        stdout: std::os::fd::AsRawFd::as_raw_fd(&out),
        stderr: std::os::fd::AsRawFd::as_raw_fd(&err),
        cgroup_procs: &joins,
        private_dev,
        ids: run_as.map(|u| (u.uid, u.gid, u.groups.as_slice())),
    };
    let child = super::vfork::spawn(&plan).map_err(|e| format!("cannot run {}: {e}", Path::new(&program).display()))?;
    let pid = child.id();
    Ok(Spawned {
        child,
        pid,
        logs: watched,
        hold,
    })
}
