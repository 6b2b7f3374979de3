//! Containment: each container's processes in a cgroup of their own, so that stopping a
//! container reaches every process it started (daemons in new sessions, double forks,
//! `nohup`), and "dead" means "its cgroup is empty".
//!
//! Mechanisms, best first (chosen once per node by [`Containment::detect`], logged):
//! - **cgroup v2** (a `cgroup2` mount in `/proc/self/mountinfo` where the node can create
//!   a directory and the kernel has `cgroup.kill`): membership, `cgroup.kill`, and
//!   `cgroup.events` `populated 0` as "empty". Limits (`memory.max`, `cpu.max`,
//!   `pids.max`) where the v2 hierarchy offers those controllers.
//! - **cgroup v1** `pids` (+ `freezer` when mounted): membership from `pids`'s
//!   `cgroup.procs`; kill = freeze, SIGKILL every member, thaw, until empty.
//! - On a hybrid layout (v2 without controllers beside v1 controllers, as on many hosts)
//!   both are used: v2 for membership and kill, the v1 `memory`, `cpu` and `pids`
//!   controllers for limits (`memory.limit_in_bytes`, `cpu.cfs_quota_us`, `pids.max`).
//! - **subreaper shim**, when no cgroup can be created (an unprivileged node without a
//!   delegated cgroup) and the node knows its `gpuam` executable ([`Containment::with_shim`]):
//!   each container runs under `gpuam container-shim`, a child subreaper that keeps every
//!   orphaned descendant and exits only once none is left (see [`super::shim`]). Chosen
//!   also when forced ([`Choice::Subreaper`], `gpuam node --containment subreaper`).
//! - **process group** only, when there is neither a cgroup nor a shim executable: a process
//!   that leaves the container's session escapes; the node logs this at start.
//!
//! - **CPU pinning** ([`Containment::pin_cpus`]): a container given NUMA-local CPUs gets them as
//!   its `cpuset.cpus`, in v2 where the hierarchy offers the `cpuset` controller, else in the
//!   v1 `cpuset` hierarchy (memory nodes copied from the parent); where neither exists the
//!   caller falls back to `taskset`.
//!
//! - **Devices** ([`super::devices`]): each container created with [`Limits::gpus`] may open
//!   only its granted GPUs' device nodes (and the safe defaults): a v2 device program where
//!   the node has a v2 cgroup, else the v1 `devices` controller; without a cgroup, a private
//!   `/dev` in a mount namespace ([`Cgroup::private_dev`], root nodes only). Where the node
//!   has NVIDIA devices and the filter cannot be installed, the container is not created.
//!
//! Processes join their cgroups in the new child before `exec` ([`Cgroup::join_paths`]),
//! so nothing of a container ever runs outside it. Pure file I/O on cgroupfs; no state.

use std::ffi::CString;
use std::io;
use std::path::{Path, PathBuf};

use nix::sys::signal::Signal;

use super::bind_guard::{self, BindGuard};
use super::devices::{self, PrivateDev, Rule};
use super::procs::{send_signal, SignalTo};
use crate::protocol::EndCause;
use crate::resources::PortSet;
use crate::topology::CpuList;

/// Most processes a container may have (`pids.max`): a fork bomb stops here.
pub const DEFAULT_PIDS_MAX: u64 = 4096;

/// Which mechanism a node uses (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mechanism {
    V2,
    V1,
    /// No cgroup; every container under a subreaper shim ([`super::shim`]).
    Subreaper,
    ProcessGroup,
}

/// Which mechanisms a node may use (`gpuam node --containment`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Choice {
    /// The best the machine offers: cgroup v2, else v1, else the subreaper shim.
    #[default]
    Auto,
    /// The subreaper shim even where cgroups exist (tests, or an operator who wants none).
    Subreaper,
    /// cgroup v1 even where a v2 hierarchy is mounted beside it (hybrid hosts; tests).
    V1,
}

impl std::str::FromStr for Choice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Choice::Auto),
            "subreaper" => Ok(Choice::Subreaper),
            "v1" => Ok(Choice::V1),
            _ => Err(format!("unknown containment `{s}`: use auto, v1 or subreaper")),
        }
    }
}

impl std::fmt::Display for Mechanism {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mechanism::V2 => "cgroup v2",
            Mechanism::V1 => "cgroup v1 (pids+freezer)",
            Mechanism::Subreaper => "subreaper shim (no cgroup; PR_SET_CHILD_SUBREAPER keeps every descendant)",
            Mechanism::ProcessGroup => {
                "process group only (no cgroup could be created and no shim executable is known: a process that \
                 leaves its session escapes)"
            }
        })
    }
}

/// Per-container limits; `None`: not limited.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub memory_mb: Option<u64>,
    /// Whole CPUs.
    pub cpu: Option<u64>,
    pub pids: Option<u64>,
    /// The GPUs (mask) whose device nodes the container may open; `None`: no device filter.
    pub gpus: Option<u64>,
    /// The ports granted to the container, the only ones of the node's it may bind (where
    /// the node has a [`BindGuard`]); `None`: no bind program.
    pub ports: Option<PortSet>,
}

/// The parent directories a node creates its containers' cgroups in.
#[derive(Clone, Debug, Default)]
pub struct Containment {
    v2: Option<PathBuf>,
    v1_pids: Option<PathBuf>,
    v1_freezer: Option<PathBuf>,
    v1_memory: Option<PathBuf>,
    v1_cpu: Option<PathBuf>,
    v1_cpuset: Option<PathBuf>,
    v1_devices: Option<PathBuf>,
    /// The `gpuam` executable that runs the subreaper shim, used when there is no cgroup.
    shim: Option<PathBuf>,
    /// Where the NVIDIA device nodes are (`None`: `GPUAM_NVIDIA_DEV_DIR`, else `/dev`).
    dev_dir: Option<PathBuf>,
    /// The operator's extra device rules (`node.device_allow`).
    device_allow: Vec<Rule>,
    /// The ports kept from containers not granted them ([`super::bind_guard`]), where the
    /// kernel took a bind program ([`Containment::with_bind_guard`]).
    bind_guard: Option<BindGuard>,
    /// Why ports are not isolated where a guard was asked for and could not be had.
    bind_unguarded: Option<String>,
    /// Device programs loaded so far, by allow list (shared by clones).
    programs:
        std::sync::Arc<parking_lot::Mutex<std::collections::HashMap<Vec<Rule>, std::sync::Arc<devices::Program>>>>,
}

/// One mount of a cgroup hierarchy.
#[derive(Clone, Debug, PartialEq)]
struct CgroupMount {
    /// `cgroup2`, or the v1 controllers of the mount (`["cpu"]`, `["memory"]`, ...).
    v2: bool,
    controllers: Vec<String>,
    /// The hierarchy path mounted there (4th field), usually `/`.
    root: String,
    mount_point: PathBuf,
}

/// Parses `/proc/self/mountinfo` lines into cgroup mounts.
fn parse_mountinfo(text: &str) -> Vec<CgroupMount> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let fields: Vec<&str> = left.split(' ').collect();
        let right: Vec<&str> = right.split(' ').collect();
        if fields.len() < 5 || right.len() < 3 {
            continue;
        }
        let fstype = right[0];
        let mount_point = PathBuf::from(unescape_mount(fields[4]));
        let root = unescape_mount(fields[3]);
        match fstype {
            "cgroup2" => out.push(CgroupMount {
                v2: true,
                controllers: Vec::new(),
                root,
                mount_point,
            }),
            "cgroup" => out.push(CgroupMount {
                v2: false,
                controllers: right[2]
                    .split(',')
                    .filter(|o| !matches!(*o, "rw" | "ro") && !o.contains('='))
                    .map(str::to_string)
                    .collect(),
                root,
                mount_point,
            }),
            _ => {}
        }
    }
    out
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mount(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// This process's cgroup path per hierarchy from `/proc/self/cgroup`: ("" for v2 or the
/// v1 controller list, path).
fn parse_proc_cgroup(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ':');
            let _id = it.next()?;
            let ctrl = it.next()?;
            let path = it.next()?;
            Some((ctrl.to_string(), path.to_string()))
        })
        .collect()
}

/// The directory of this process's own cgroup in `m`.
fn own_dir(m: &CgroupMount, own: &[(String, String)]) -> Option<PathBuf> {
    let path = if m.v2 {
        own.iter().find(|(c, _)| c.is_empty())?.1.clone()
    } else {
        own.iter()
            .find(|(c, _)| c.split(',').any(|c| m.controllers.iter().any(|mc| mc == c)))?
            .1
            .clone()
    };
    let rel = path.strip_prefix(m.root.trim_end_matches('/')).unwrap_or(&path);
    Some(m.mount_point.join(rel.trim_start_matches('/')))
}

/// Creates `dir` (and parents); true if it exists as a directory afterwards.
fn make_dir(dir: &Path) -> bool {
    std::fs::create_dir_all(dir).is_ok() && dir.is_dir()
}

impl Containment {
    /// No cgroups at all: process groups only.
    pub fn none() -> Self {
        Containment::default()
    }

    /// No cgroups; every container under the subreaper shim run by `exe` (the `gpuam`
    /// executable).
    pub fn subreaper(exe: PathBuf) -> Self {
        Containment::none().with_shim(Some(exe))
    }

    /// The same containment, with `exe` (the `gpuam` executable) to run the subreaper shim
    /// where there is no cgroup; `None` leaves the shim out (process groups only then).
    pub fn with_shim(mut self, exe: Option<PathBuf>) -> Self {
        self.shim = exe;
        self
    }

    /// What `choice` gives on this machine: [`Containment::detect`] with the shim as the
    /// fallback, or the shim alone. `Err` when the shim is forced but `shim_exe` is unknown.
    pub fn choose(choice: Choice, parent: &str, shim_exe: Option<PathBuf>) -> Result<Self, String> {
        match (choice, shim_exe) {
            (Choice::Auto, exe) => Ok(Containment::detect(parent).with_shim(exe)),
            (Choice::V1, exe) => Ok(Containment::find(parent, false).with_shim(exe)),
            (Choice::Subreaper, Some(exe)) => Ok(Containment::subreaper(exe)),
            (Choice::Subreaper, None) => {
                Err("containment `subreaper` needs the path of the gpuam executable, which is not known".into())
            }
        }
    }

    /// The executable to run each container's shim with: `Some` exactly when the
    /// mechanism is [`Mechanism::Subreaper`].
    pub fn shim(&self) -> Option<&Path> {
        (self.mechanism() == Mechanism::Subreaper)
            .then_some(self.shim.as_deref())
            .flatten()
    }

    /// Finds the cgroup mounts and creates `<own cgroup>/<parent>` in each usable one.
    /// `parent` names this node's containers' parent cgroup (e.g. `gpuam-<host>`).
    pub fn detect(parent: &str) -> Self {
        Containment::find(parent, true)
    }

    /// [`Containment::detect`], with the v2 hierarchy left out unless `v2`.
    fn find(parent: &str, v2: bool) -> Self {
        let mounts = std::fs::read_to_string("/proc/self/mountinfo")
            .map(|t| parse_mountinfo(&t))
            .unwrap_or_default();
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .map(|t| parse_proc_cgroup(&t))
            .unwrap_or_default();
        let mut c = Containment::default();
        for m in &mounts {
            let Some(base) = own_dir(m, &own) else {
                continue;
            };
            let dir = base.join(parent);
            if m.v2 {
                if v2 && c.v2.is_none() && make_dir(&dir) && dir.join("cgroup.kill").exists() {
                    // Limits need the controllers delegated to the children (best effort; one
                    // at a time, so a missing one does not keep the others off).
                    for ctrl in ["+memory", "+cpu", "+pids", "+cpuset"] {
                        let _ = std::fs::write(dir.join("cgroup.subtree_control"), ctrl);
                    }
                    c.v2 = Some(dir);
                }
                continue;
            }
            if m.controllers.iter().any(|x| x == "cpuset") {
                // A new v1 cpuset starts with no CPUs and no memory nodes: give the parent
                // its own parent's, or leave the hierarchy unused.
                if c.v1_cpuset.is_none() && make_dir(&dir) && inherit_cpuset(&base, &dir) {
                    c.v1_cpuset = Some(dir);
                }
                continue;
            }
            let has = |name: &str| m.controllers.iter().any(|x| x == name);
            let slot = if has("pids") {
                &mut c.v1_pids
            } else if has("freezer") {
                &mut c.v1_freezer
            } else if has("memory") {
                &mut c.v1_memory
            } else if has("cpu") {
                &mut c.v1_cpu
            } else if has("devices") {
                &mut c.v1_devices
            } else {
                continue;
            };
            if slot.is_none() && make_dir(&dir) {
                *slot = Some(dir);
            }
        }
        c
    }

    /// The mechanism containers of this node get.
    pub fn mechanism(&self) -> Mechanism {
        if self.v2.is_some() {
            Mechanism::V2
        } else if self.v1_pids.is_some() {
            Mechanism::V1
        } else if self.shim.is_some() {
            Mechanism::Subreaper
        } else {
            Mechanism::ProcessGroup
        }
    }

    /// Bounds every container of the node together to `max` processes (`pids.max` of their
    /// parent cgroup, v2 where the parent has the controller, else v1): a fork bomb spread
    /// over many containers stops there. A bound that cannot be written is logged.
    pub fn with_max_pids(self, max: Option<u64>) -> Self {
        if let Some(n) = max.filter(|n| *n > 0) {
            let v2 = self.v2.as_ref().map(|d| d.join("pids.max")).filter(|f| f.exists());
            let file = v2.or_else(|| self.v1_pids.as_ref().map(|d| d.join("pids.max")));
            match file.map(|f| std::fs::write(&f, n.to_string()).map(|()| f)) {
                Some(Ok(f)) => tracing::info!("node-wide pids bound {n} ({})", f.display()),
                Some(Err(e)) => tracing::warn!("cannot bound the node's processes to {n}: {e}"),
                None => tracing::warn!("no pids controller: the node's processes are not bounded to {n}"),
            }
        }
        self
    }

    /// The node-wide pids bound's `pids.max` file and value, where one is set.
    pub fn max_pids(&self) -> Option<(PathBuf, String)> {
        let v2 = self.v2.as_ref().map(|d| d.join("pids.max")).filter(|f| f.exists());
        let f = v2.or_else(|| self.v1_pids.as_ref().map(|d| d.join("pids.max")))?;
        let v = std::fs::read_to_string(&f).ok()?.trim().to_string();
        Some((f, v))
    }

    /// Device nodes found in `dir` instead of `GPUAM_NVIDIA_DEV_DIR` or `/dev` (tests).
    pub fn with_device_dir(mut self, dir: PathBuf) -> Self {
        self.dev_dir = Some(dir);
        self
    }

    /// The operator's extra device rules (`node.device_allow`), checked: none may open an
    /// NVIDIA device.
    pub fn with_device_allow(mut self, rules: Vec<Rule>) -> Result<Self, String> {
        let majors: Vec<u32> = std::fs::read_to_string("/proc/devices")
            .map(|t| devices::char_majors(&t, "nvidia").into_iter().map(|(m, _)| m).collect())
            .unwrap_or_default();
        devices::check_extra(&rules, &majors)?;
        self.device_allow = rules;
        Ok(self)
    }

    fn dev_dir(&self) -> PathBuf {
        self.dev_dir.clone().unwrap_or_else(|| {
            std::env::var_os(super::image::DEV_DIR_ENV).map_or_else(|| PathBuf::from("/dev"), PathBuf::from)
        })
    }

    /// Keeps every container off `guard`'s ports but its own (see [`super::bind_guard`]):
    /// where the node has a cgroup v2 and the kernel loads the bind program (tried here
    /// once); else the containment line says ports are not isolated, and why.
    pub fn with_bind_guard(mut self, guard: BindGuard) -> Self {
        let tried = match &self.v2 {
            Some(_) => bind_guard::Programs::load(&guard.denied(&PortSet::new())).map_err(|e| e.to_string()),
            None => Err("no cgroup v2".into()),
        };
        match tried {
            Ok(_) => self.bind_guard = Some(guard),
            Err(e) => {
                tracing::warn!("ports: NOT isolated ({e}): a task can bind ports granted to others");
                self.bind_unguarded = Some(e);
            }
        }
        self
    }

    /// How port isolation is enforced here (for the node's log).
    fn describe_ports(&self) -> String {
        match (&self.bind_guard, &self.bind_unguarded) {
            (Some(g), _) => format!(
                "ports: v2 bind program (offered [{}], the node's own [{}])",
                g.managed, g.reserved
            ),
            (None, Some(why)) => format!("ports: NOT isolated ({why})"),
            (None, None) => "ports: not isolated (no guard asked for)".into(),
        }
    }

    /// How device isolation is enforced here (for the node's log).
    fn describe_devices(&self) -> &'static str {
        if self.v2.is_some() {
            "devices: v2 device program"
        } else if self.v1_devices.is_some() {
            "devices: v1 devices controller"
        } else if matches!(self.mechanism(), Mechanism::Subreaper | Mechanism::ProcessGroup)
            // SAFETY: plain syscall.
            && unsafe { libc::geteuid() } == 0
        {
            "devices: private /dev per container (path-based)"
        } else {
            "devices: NOT isolated (no cgroup and not root): a task can open every GPU's node"
        }
    }

    /// The loaded device program of `rules` (loaded on first use).
    fn program(&self, rules: &[Rule]) -> io::Result<std::sync::Arc<devices::Program>> {
        let mut progs = self.programs.lock();
        if let Some(p) = progs.get(rules) {
            return Ok(p.clone());
        }
        let p = std::sync::Arc::new(devices::load(rules)?);
        progs.insert(rules.to_vec(), p.clone());
        Ok(p)
    }

    /// Installs container `cg`'s device filter for the GPUs of `mask` (see the module doc).
    /// `Err` only where the node has NVIDIA devices and no filter could be installed.
    fn filter_devices(&self, id: &str, cg: &mut Cgroup, mask: u64) -> io::Result<()> {
        let found = devices::scan(&self.dev_dir());
        let rules = devices::allow_list(mask, &found, &self.device_allow);
        let mut why = Vec::new();
        if let Some(d) = &cg.v2 {
            match self.program(&rules).and_then(|p| super::bpf::attach(d, &p)) {
                Ok(()) => return Ok(()),
                Err(e) => why.push(format!("v2 device program: {e}")),
            }
        }
        if let Some(d) = &cg.v1_devices {
            match devices::write_v1(d, &rules) {
                Ok(()) => return Ok(()),
                Err(e) => why.push(format!("v1 devices: {e}")),
            }
        }
        if !cg.is_real() {
            let hide = devices::hidden_nodes(mask, &found);
            if hide.is_empty() {
                return Ok(());
            }
            match PrivateDev::prepare(&hide) {
                Ok(p) => {
                    cg.private_dev = Some(p);
                    return Ok(());
                }
                Err(e) => why.push(format!("private /dev: {e}")),
            }
        }
        if why.is_empty() {
            why.push("no devices controller, no v2 cgroup".into());
        }
        let why = why.join("; ");
        if found.any() {
            return Err(io::Error::other(format!(
                "cannot isolate the GPU devices of container {id} ({why})"
            )));
        }
        tracing::debug!(
            container = id,
            "no device filter ({why}); the node has no NVIDIA device"
        );
        Ok(())
    }

    /// The limits containers of this node get, as (controller, cgroup version): `memory`,
    /// `cpu`, `pids`, `cpuset` where a controller enforces them; empty: none is enforced.
    pub fn limits(&self) -> Vec<(&'static str, &'static str)> {
        let limits = |name: &'static str, v1: &Option<PathBuf>| -> Option<(&'static str, &'static str)> {
            if self.v2.as_ref().is_some_and(|d| v2_has_controller(d, name)) {
                Some((name, "v2"))
            } else {
                v1.as_ref().map(|_| (name, "v1"))
            }
        };
        [
            limits("memory", &self.v1_memory),
            limits("cpu", &self.v1_cpu),
            limits("pids", &self.v1_pids),
            limits("cpuset", &self.v1_cpuset),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// One line for the node's log: the mechanism and where limits come from.
    pub fn describe(&self) -> String {
        let l: Vec<String> = self.limits().iter().map(|(n, v)| format!("{n} ({v})")).collect();
        let dir = self.v2.as_ref().or(self.v1_pids.as_ref());
        let shim = self.shim().map(|e| format!(" run by {}", e.display()));
        format!(
            "containment: {}{}; limits: {}; {}; {}",
            self.mechanism(),
            dir.map(|d| format!(" under {}", d.display()))
                .or(shim)
                .unwrap_or_default(),
            if l.is_empty() { "none".into() } else { l.join(", ") },
            self.describe_devices(),
            self.describe_ports()
        )
    }

    /// Removes this node's parent cgroups (when empty; errors ignored).
    pub fn remove_parents(&self) {
        for d in [
            &self.v2,
            &self.v1_pids,
            &self.v1_freezer,
            &self.v1_memory,
            &self.v1_cpu,
            &self.v1_cpuset,
            &self.v1_devices,
        ]
        .into_iter()
        .flatten()
        {
            let _ = std::fs::remove_dir(d);
        }
    }

    /// The cgroup of container `id` (not created): for a restarted node to find it again.
    pub fn cgroup(&self, id: &str) -> Cgroup {
        Cgroup {
            v2: self.v2.as_ref().map(|d| d.join(id)),
            v1_pids: self.v1_pids.as_ref().map(|d| d.join(id)),
            v1_freezer: self.v1_freezer.as_ref().map(|d| d.join(id)),
            v1_memory: self.v1_memory.as_ref().map(|d| d.join(id)),
            v1_cpu: self.v1_cpu.as_ref().map(|d| d.join(id)),
            // Only containers that were pinned have one (see `pin_cpus`).
            v1_cpuset: self.v1_cpuset.as_ref().map(|d| d.join(id)).filter(|d| d.is_dir()),
            v1_devices: self.v1_devices.as_ref().map(|d| d.join(id)),
            private_dev: None,
        }
    }

    /// Restricts container `id` (its cgroup `cg`, created, nothing in it yet) to `cpus`: the
    /// v2 `cpuset.cpus` where the controller is delegated, else a v1 cpuset of its own (which
    /// `cg` then joins). False when neither could be set: the caller pins another way.
    pub fn pin_cpus(&self, cg: &mut Cgroup, id: &str, cpus: &CpuList) -> bool {
        let list = cpus.to_string();
        if let Some(d) = cg.v2.as_ref().filter(|d| d.join("cpuset.cpus").exists()) {
            match std::fs::write(d.join("cpuset.cpus"), &list) {
                Ok(()) => return true,
                Err(e) => tracing::warn!(container = id, "cannot set cpuset.cpus = {list} (v2): {e}"),
            }
        }
        let Some(parent) = &self.v1_cpuset else {
            return false;
        };
        let dir = parent.join(id);
        let set = std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::read_to_string(parent.join("cpuset.mems")))
            .and_then(|mems| std::fs::write(dir.join("cpuset.mems"), mems.trim()))
            .and_then(|()| std::fs::write(dir.join("cpuset.cpus"), &list));
        match set {
            Ok(()) => {
                cg.v1_cpuset = Some(dir);
                true
            }
            Err(e) => {
                tracing::warn!(container = id, "cannot set cpuset.cpus = {list} (v1): {e}");
                let _ = std::fs::remove_dir(&dir);
                false
            }
        }
    }

    /// Creates container `id`'s cgroup with `limits`. A limit that cannot be written is
    /// logged, not fatal; a cgroup that cannot be created is an error.
    pub fn create(&self, id: &str, limits: Limits) -> io::Result<Cgroup> {
        let mut cg = self.cgroup(id);
        for d in cg.dirs() {
            std::fs::create_dir_all(d)?;
        }
        let write = |dir: &Option<PathBuf>, file: &str, value: String| {
            if let Some(d) = dir {
                if let Err(e) = std::fs::write(d.join(file), &value) {
                    tracing::warn!(container = id, "cannot set {file} = {value}: {e}");
                }
            }
        };
        let v2_mem = cg.v2.as_ref().filter(|d| d.join("memory.max").exists()).cloned();
        let v2_cpu = cg.v2.as_ref().filter(|d| d.join("cpu.max").exists()).cloned();
        let v2_pids = cg.v2.as_ref().filter(|d| d.join("pids.max").exists()).cloned();
        if let Some(mb) = limits.memory_mb.filter(|m| *m > 0) {
            let bytes = mb.saturating_mul(1024 * 1024);
            if v2_mem.is_some() {
                write(&v2_mem, "memory.max", bytes.to_string());
            } else {
                write(&cg.v1_memory, "memory.limit_in_bytes", bytes.to_string());
            }
        }
        if let Some(cpu) = limits.cpu.filter(|c| *c > 0) {
            let period = 100_000u64;
            let quota = cpu.saturating_mul(period);
            if v2_cpu.is_some() {
                write(&v2_cpu, "cpu.max", format!("{quota} {period}"));
            } else {
                write(&cg.v1_cpu, "cpu.cfs_period_us", period.to_string());
                write(&cg.v1_cpu, "cpu.cfs_quota_us", quota.to_string());
            }
        }
        let pids = limits.pids.unwrap_or(DEFAULT_PIDS_MAX);
        if v2_pids.is_some() {
            write(&v2_pids, "pids.max", pids.to_string());
        } else {
            write(&cg.v1_pids, "pids.max", pids.to_string());
        }
        if let Some(mask) = limits.gpus {
            if let Err(e) = self.filter_devices(id, &mut cg, mask) {
                cg.remove();
                return Err(e);
            }
        }
        if let (Some(granted), Some(guard), Some(dir)) = (&limits.ports, &self.bind_guard, &cg.v2) {
            // The kernel took the program at the node's start: a container it cannot be
            // attached to is not created (it could bind others' ports).
            let attached = bind_guard::Programs::load(&guard.denied(granted)).and_then(|p| bind_guard::attach(dir, &p));
            if let Err(e) = attached {
                cg.remove();
                return Err(io::Error::other(format!(
                    "cannot keep the container off others' ports: {e}"
                )));
            }
        }
        Ok(cg)
    }
}

/// Gives a new v1 cpuset `dir` the CPUs and memory nodes of `parent`.
fn inherit_cpuset(parent: &Path, dir: &Path) -> bool {
    ["cpuset.cpus", "cpuset.mems"].iter().all(|f| {
        let mine = std::fs::read_to_string(dir.join(f)).unwrap_or_default();
        if !mine.trim().is_empty() {
            return true;
        }
        std::fs::read_to_string(parent.join(f)).is_ok_and(|v| std::fs::write(dir.join(f), v.trim()).is_ok())
    })
}

fn v2_has_controller(dir: &Path, name: &str) -> bool {
    std::fs::read_to_string(dir.join("cgroup.subtree_control")).is_ok_and(|t| t.split_whitespace().any(|c| c == name))
}

/// One container's cgroup (one directory per hierarchy in use).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Cgroup {
    v2: Option<PathBuf>,
    v1_pids: Option<PathBuf>,
    v1_freezer: Option<PathBuf>,
    v1_memory: Option<PathBuf>,
    v1_cpu: Option<PathBuf>,
    /// Only when the container was pinned to CPUs in v1 (a v1 cpuset without CPUs takes no
    /// process).
    v1_cpuset: Option<PathBuf>,
    v1_devices: Option<PathBuf>,
    /// Without a cgroup: the mounts that hide other GPUs' nodes ([`super::devices`]).
    private_dev: Option<PrivateDev>,
}

impl Cgroup {
    fn dirs(&self) -> impl Iterator<Item = &PathBuf> {
        [
            &self.v2,
            &self.v1_pids,
            &self.v1_freezer,
            &self.v1_memory,
            &self.v1_cpu,
            &self.v1_cpuset,
            &self.v1_devices,
        ]
        .into_iter()
        .flatten()
    }

    /// Whether the kernel killed a process of the container in its own memory limit (v2
    /// `memory.events`, v1 `memory.oom_control` `oom_kill N`); then the reason, naming the
    /// limit ([`EndCause::OutOfMemory`]). Read before the cgroup is removed.
    pub fn oom_killed(&self) -> Option<EndCause> {
        let count = |f: PathBuf| -> Option<u64> {
            std::fs::read_to_string(f).ok()?.lines().find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == "oom_kill").then(|| v.trim().parse().ok()).flatten()
            })
        };
        let mb = |f: PathBuf| -> Option<u64> {
            let v: u64 = std::fs::read_to_string(f).ok()?.trim().parse().ok()?;
            // "max" (v2) does not parse; v1's unlimited is near u64::MAX.
            (v < 1 << 60).then_some(v >> 20)
        };
        let v2 = self.v2.as_ref().filter(|d| d.join("memory.events").exists());
        let (kills, limit) = if let Some(d) = v2 {
            (count(d.join("memory.events")), mb(d.join("memory.max")))
        } else if let Some(d) = &self.v1_memory {
            (count(d.join("memory.oom_control")), mb(d.join("memory.limit_in_bytes")))
        } else {
            return None;
        };
        (kills? > 0).then_some(EndCause::OutOfMemory { limit_mb: limit })
    }

    /// Without a cgroup: the private `/dev` the new child enters before `exec`
    /// ([`PrivateDev::enter`]), when other GPUs' nodes must be hidden.
    pub fn private_dev(&self) -> Option<&PrivateDev> {
        self.private_dev.as_ref()
    }

    /// Whether any cgroup is in use (false: process group only).
    pub fn is_real(&self) -> bool {
        self.v2.is_some() || self.v1_pids.is_some()
    }

    /// The `cgroup.procs` files a new process writes `0` to before `exec`, prepared as C
    /// strings so that the new child only makes syscalls.
    pub fn join_paths(&self) -> Vec<CString> {
        self.dirs()
            .filter_map(|d| CString::new(d.join("cgroup.procs").into_os_string().into_encoded_bytes()).ok())
            .collect()
    }

    /// The members (pids) now; empty when there is no cgroup.
    pub fn pids(&self) -> Vec<i32> {
        let Some(d) = self.v2.as_ref().or(self.v1_pids.as_ref()) else {
            return Vec::new();
        };
        std::fs::read_to_string(d.join("cgroup.procs"))
            .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// Whether no process is left (v2: `populated 0`; v1: no member). A cgroup that does
    /// not exist (removed, or never created) is empty.
    pub fn is_empty(&self) -> bool {
        if let Some(d) = &self.v2 {
            return match std::fs::read_to_string(d.join("cgroup.events")) {
                Ok(t) => !t.lines().any(|l| l.trim() == "populated 1"),
                Err(_) => true,
            };
        }
        self.pids().is_empty()
    }

    /// Sends `sig` to every member (a member that is gone meanwhile is no error).
    pub fn signal(&self, sig: Signal) {
        for p in self.pids() {
            if let Ok(p) = u32::try_from(p) {
                let _ = send_signal(SignalTo::Process(p), Some(sig));
            }
        }
    }

    /// Kills every member at once: `cgroup.kill` (v2), else freeze + SIGKILL + thaw (v1).
    pub fn kill(&self) {
        if let Some(d) = &self.v2 {
            if std::fs::write(d.join("cgroup.kill"), "1").is_ok() {
                return;
            }
        }
        let frozen = self
            .v1_freezer
            .as_ref()
            .is_some_and(|d| std::fs::write(d.join("freezer.state"), "FROZEN").is_ok());
        self.signal(Signal::SIGKILL);
        if frozen {
            if let Some(d) = &self.v1_freezer {
                let _ = std::fs::write(d.join("freezer.state"), "THAWED");
            }
        }
    }

    /// Removes the (empty) cgroup directories; errors are logged.
    pub fn remove(&self) {
        for d in self.dirs() {
            if let Err(e) = std::fs::remove_dir(d) {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::debug!("cannot remove cgroup {}: {e}", d.display());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/un\\040ified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn mountinfo_of_a_hybrid_layout() {
        let m = parse_mountinfo(HYBRID);
        assert_eq!(m.len(), 6, "{m:?}");
        let v2: Vec<_> = m.iter().filter(|m| m.v2).collect();
        assert_eq!(v2.len(), 1);
        assert_eq!(v2[0].mount_point, PathBuf::from("/sys/fs/cgroup/un ified"));
        let mem = m.iter().find(|m| m.controllers == ["memory"]).unwrap();
        assert_eq!(mem.mount_point, PathBuf::from("/sys/fs/cgroup/memory"));
        let sysd = m.iter().find(|m| m.mount_point.ends_with("systemd")).unwrap();
        assert!(sysd.controllers.is_empty(), "name= options are no controllers");
    }

    #[test]
    fn own_cgroup_dirs_follow_proc_self_cgroup() {
        let m = parse_mountinfo(HYBRID);
        let own = parse_proc_cgroup("8:pids:/\n4:memory:/process_api/abc\n0::/user.slice/x\n");
        let mem = m.iter().find(|m| m.controllers == ["memory"]).unwrap();
        assert_eq!(
            own_dir(mem, &own),
            Some(PathBuf::from("/sys/fs/cgroup/memory/process_api/abc"))
        );
        let v2 = m.iter().find(|m| m.v2).unwrap();
        assert_eq!(
            own_dir(v2, &own),
            Some(PathBuf::from("/sys/fs/cgroup/un ified/user.slice/x"))
        );
        let cpu = m.iter().find(|m| m.controllers == ["cpu"]).unwrap();
        assert_eq!(own_dir(cpu, &own), None, "no cpu line: not this process's hierarchy");
    }

    #[test]
    fn no_cgroup_is_empty_and_has_no_members() {
        let cg = Containment::none().cgroup("c1");
        assert!(!cg.is_real());
        assert!(cg.is_empty());
        assert!(cg.pids().is_empty());
        assert!(cg.join_paths().is_empty());
    }

    #[test]
    fn the_shim_is_the_fallback_and_can_be_forced() {
        let exe = PathBuf::from("/opt/gpuam/bin/gpuam");
        assert_eq!(Containment::none().mechanism(), Mechanism::ProcessGroup);
        assert_eq!(Containment::none().shim(), None);
        let shim = Containment::none().with_shim(Some(exe.clone()));
        assert_eq!(shim.mechanism(), Mechanism::Subreaper);
        assert_eq!(shim.shim(), Some(exe.as_path()));
        assert!(shim.describe().contains("subreaper shim"), "{}", shim.describe());
        assert!(shim.describe().contains("/opt/gpuam/bin/gpuam"), "{}", shim.describe());
        assert!(!shim.cgroup("c1").is_real(), "no cgroup under the shim");
        // A cgroup wins over the shim; the shim is then not used.
        let v2 = Containment {
            v2: Some(PathBuf::from("/sys/fs/cgroup/x")),
            ..Containment::default()
        }
        .with_shim(Some(exe.clone()));
        assert_eq!(v2.mechanism(), Mechanism::V2);
        assert_eq!(v2.shim(), None);
        let forced = Containment::choose(Choice::Subreaper, "unused", Some(exe.clone())).unwrap();
        assert_eq!(forced.mechanism(), Mechanism::Subreaper);
        assert!(Containment::choose(Choice::Subreaper, "unused", None).is_err());
        assert_eq!("subreaper".parse::<Choice>(), Ok(Choice::Subreaper));
        assert_eq!("auto".parse::<Choice>(), Ok(Choice::Auto));
        assert!("v3".parse::<Choice>().is_err());
    }
}
