//! GPU device isolation in the kernel: which device nodes a container may open, and the
//! thin drivers that make the kernel enforce it.
//!
//! The rule ([`allow_list`], pure): a container may use the usual safe character devices
//! ([`default_rules`]: `null`, `zero`, `full`, `random`, `urandom`, `tty`, `ptmx`, `pts/*`,
//! `net/tun`, InfiniBand verbs), the operator's extra rules (`node.device_allow`), its granted GPUs'
//! nodes (`/dev/nvidia<i>`) and, when it has a GPU, the shared control nodes (`nvidiactl`,
//! `nvidia-uvm`, `nvidia-uvm-tools`, `nvidia-modeset`); nothing else (default deny, as runc's
//! default device list). Majors and minors come from the node's device nodes themselves
//! ([`scan`]: `stat` of `/dev/nvidia*`, and `/proc/devices` for the dynamic `nvidia-uvm`
//! major when its node is not created yet), so the rule does not depend on paths: a node
//! made elsewhere with another GPU's numbers is refused too.
//!
//! Drivers, one per containment mechanism (chosen by [`super::cgroup`]):
//! - **cgroup v2**: a `BPF_PROG_TYPE_CGROUP_DEVICE` program ([`program`], emitted here as
//!   runc's and crun's device filters are: one block per rule, first match allows, default 0)
//!   loaded with `bpf(BPF_PROG_LOAD)` and attached to the container's cgroup with
//!   `BPF_PROG_ATTACH` + `BPF_F_ALLOW_MULTI` ([`attach_v2`]). The attachment holds the program;
//!   the fds are closed, and the program goes with the cgroup. One load per container.
//! - **cgroup v1**: `devices.deny a` then one `devices.allow` line per rule ([`write_v1`]).
//! - **subreaper shim** (no cgroup): a mount namespace of the task's own in which every
//!   other GPU's node (and, without a GPU, the control nodes) under the device directory is
//!   covered by an inaccessible node (`c 0:0`, mode 0000, as systemd's `InaccessiblePaths`)
//!   ([`PrivateDev`], entered in the new child before `exec`). This is path-based: it needs
//!   a root node, covers only the nodes found in the device directory, and a task that reaches
//!   another mount namespace's `/dev` (`/proc/PID/root` of a process of its own uid outside
//!   its namespace) or is root itself is not stopped. See docs/RELIABILITY.md.
//!
//! Under every mechanism a refused open fails with `EPERM` (cgroup) or `EACCES` (shim).

use std::ffi::CString;
use std::io;
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};

/// NVIDIA's character major (`/dev/nvidia<i>`, `nvidiactl`, `nvidia-modeset`).
pub const NVIDIA_MAJOR: u32 = 195;
/// `nvidiactl`'s and `nvidia-modeset`'s minors under [`NVIDIA_MAJOR`].
const NVIDIACTL_MINOR: u32 = 255;
const MODESET_MINOR: u32 = 254;

/// Which device type a rule matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Char,
    Block,
    /// Both (`a` in cgroup v1).
    Any,
}

/// One allow rule: type, major and minor (`None`: any), and the access it allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rule {
    pub kind: Kind,
    pub major: Option<u32>,
    pub minor: Option<u32>,
    /// `BPF_DEVCG_ACC_*` bits: 1 mknod, 2 read, 4 write.
    pub access: u32,
}

const ACC_MKNOD: u32 = 1;
const ACC_READ: u32 = 2;
const ACC_WRITE: u32 = 4;
const ACC_ALL: u32 = ACC_MKNOD | ACC_READ | ACC_WRITE;

impl Rule {
    const fn chr(major: u32, minor: Option<u32>, access: u32) -> Rule {
        Rule {
            kind: Kind::Char,
            major: Some(major),
            minor,
            access,
        }
    }
}

/// The cgroup v1 syntax: `c 195:1 rwm`, `a *:* m`.
impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = |v: Option<u32>| v.map_or("*".to_string(), |v| v.to_string());
        let kind = match self.kind {
            Kind::Char => 'c',
            Kind::Block => 'b',
            Kind::Any => 'a',
        };
        let mut acc = String::new();
        for (bit, c) in [(ACC_READ, 'r'), (ACC_WRITE, 'w'), (ACC_MKNOD, 'm')] {
            if self.access & bit != 0 {
                acc.push(c);
            }
        }
        write!(f, "{kind} {}:{} {acc}", n(self.major), n(self.minor))
    }
}

/// Parses the cgroup v1 syntax (`c 231:* rw`), as `node.device_allow` holds it.
impl std::str::FromStr for Rule {
    type Err = String;
    fn from_str(s: &str) -> Result<Rule, String> {
        let bad =
            |why: &str| format!("device rule `{s}`: {why} (write it as `c MAJOR:MINOR ACCESS`, e.g. `c 231:* rw`)");
        let parts: Vec<&str> = s.split_whitespace().collect();
        let [kind, numbers, access] = parts[..] else {
            return Err(bad("three fields expected"));
        };
        let kind = match kind {
            "c" => Kind::Char,
            "b" => Kind::Block,
            "a" => Kind::Any,
            _ => return Err(bad("the type is `c`, `b` or `a`")),
        };
        let (major, minor) = numbers
            .split_once(':')
            .ok_or_else(|| bad("no `:` between major and minor"))?;
        let num = |v: &str| -> Result<Option<u32>, String> {
            if v == "*" {
                Ok(None)
            } else {
                v.parse()
                    .map(Some)
                    .map_err(|_| bad("major and minor are numbers or `*`"))
            }
        };
        let mut bits = 0;
        for c in access.chars() {
            bits |= match c {
                'r' => ACC_READ,
                'w' => ACC_WRITE,
                'm' => ACC_MKNOD,
                _ => return Err(bad("the access is made of `r`, `w` and `m`")),
            };
        }
        Ok(Rule {
            kind,
            major: num(major)?,
            minor: num(minor)?,
            access: bits,
        })
    }
}

/// Checks the operator's extra rules: none may open an NVIDIA device (that would undo
/// the isolation), nor everything (`a *:*` / `c *:*` with read or write).
pub fn check_extra(rules: &[Rule], nvidia_majors: &[u32]) -> Result<(), String> {
    for r in rules {
        let opens = r.access & (ACC_READ | ACC_WRITE) != 0;
        let nvidia = match r.major {
            None => opens && r.kind != Kind::Block,
            Some(m) => m == NVIDIA_MAJOR || nvidia_majors.contains(&m),
        };
        if opens && nvidia {
            return Err(format!(
                "node.device_allow: `{r}` would let every task open NVIDIA devices; GPUs are allowed per grant"
            ));
        }
    }
    Ok(())
}

/// The safe devices every container may use (runc's default list, and InfiniBand verbs,
/// which NCCL uses from host-run tasks): `mknod` of anything (useless without root, and a
/// node made is still checked on open), `null`, `zero`, `full`, `random`, `urandom`, `tty`,
/// `console`, `ptmx`, the `pts` terminals, `net/tun` (10:200, which runc allows too, for
/// the image runtime's networking), `/dev/infiniband/*` (major 231).
pub fn default_rules() -> Vec<Rule> {
    vec![
        Rule {
            kind: Kind::Char,
            major: None,
            minor: None,
            access: ACC_MKNOD,
        },
        Rule {
            kind: Kind::Block,
            major: None,
            minor: None,
            access: ACC_MKNOD,
        },
        Rule::chr(1, Some(3), ACC_ALL),
        Rule::chr(1, Some(5), ACC_ALL),
        Rule::chr(1, Some(7), ACC_ALL),
        Rule::chr(1, Some(8), ACC_ALL),
        Rule::chr(1, Some(9), ACC_ALL),
        Rule::chr(5, Some(0), ACC_ALL),
        Rule::chr(5, Some(1), ACC_ALL),
        Rule::chr(5, Some(2), ACC_ALL),
        Rule::chr(136, None, ACC_ALL),
        Rule::chr(10, Some(200), ACC_ALL),
        Rule::chr(231, None, ACC_ALL),
    ]
}

/// One NVIDIA device node of the machine: its path, GPU index (`None`: a control node) and
/// numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvidiaNode {
    pub path: PathBuf,
    pub gpu: Option<u32>,
    pub major: u32,
    pub minor: u32,
}

/// What a node knows of its NVIDIA devices ([`scan`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NvidiaDevices {
    /// The character device nodes found in the device directory.
    pub nodes: Vec<NvidiaNode>,
    /// `nvidia-uvm`'s dynamic major from `/proc/devices` (its node appears on first use).
    pub uvm_major: Option<u32>,
}

impl NvidiaDevices {
    /// Whether the machine has any NVIDIA device (and so something to isolate).
    pub fn any(&self) -> bool {
        !self.nodes.is_empty() || self.uvm_major.is_some()
    }
}

/// The character majors named in `/proc/devices`' text whose name starts with `prefix`.
pub fn char_majors(proc_devices: &str, prefix: &str) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    let mut chars = false;
    for line in proc_devices.lines() {
        let line = line.trim();
        if line.ends_with(':') {
            chars = line == "Character devices:";
            continue;
        }
        if !chars {
            continue;
        }
        if let Some((n, name)) = line.split_once(' ') {
            if let (Ok(n), true) = (n.trim().parse::<u32>(), name.trim().starts_with(prefix)) {
                out.push((n, name.trim().to_string()));
            }
        }
    }
    out
}

/// The NVIDIA device nodes under `dev_dir` (their numbers from `stat`) and the `nvidia-uvm`
/// major from `/proc/devices`.
pub fn scan(dev_dir: &Path) -> NvidiaDevices {
    let nodes = super::image::find_devices(dev_dir)
        .into_iter()
        .filter(|d| d.is_char_device)
        .filter_map(|d| {
            // No link is followed: a node is what `lstat` says is one.
            let m = std::fs::symlink_metadata(&d.path).ok()?;
            m.file_type().is_char_device().then(|| NvidiaNode {
                major: libc::major(m.rdev()),
                minor: libc::minor(m.rdev()),
                path: d.path,
                gpu: d.gpu,
            })
        })
        .collect();
    let uvm_major = std::fs::read_to_string("/proc/devices")
        .ok()
        .and_then(|t| {
            char_majors(&t, "nvidia-uvm")
                .into_iter()
                .find(|(_, n)| n == "nvidia-uvm")
        })
        .map(|(m, _)| m);
    NvidiaDevices { nodes, uvm_major }
}

/// The devices a container granted the GPUs of `gpu_mask` may use: [`default_rules`],
/// `extra`, each granted GPU's node (its numbers from `devices` where its node was found,
/// else `195:<index>`) and, when a GPU is granted, the control nodes.
pub fn allow_list(gpu_mask: u64, devices: &NvidiaDevices, extra: &[Rule]) -> Vec<Rule> {
    let mut out = default_rules();
    out.extend_from_slice(extra);
    if gpu_mask == 0 {
        return out;
    }
    let rw = ACC_READ | ACC_WRITE;
    for i in (0..64).filter(|i| gpu_mask & (1u64 << i) != 0) {
        let (major, minor) = devices
            .nodes
            .iter()
            .find(|n| n.gpu == Some(i))
            .map_or((NVIDIA_MAJOR, i), |n| (n.major, n.minor));
        out.push(Rule::chr(major, Some(minor), rw));
    }
    for n in devices.nodes.iter().filter(|n| n.gpu.is_none()) {
        out.push(Rule::chr(n.major, Some(n.minor), rw));
    }
    out.push(Rule::chr(NVIDIA_MAJOR, Some(NVIDIACTL_MINOR), rw));
    out.push(Rule::chr(NVIDIA_MAJOR, Some(MODESET_MINOR), rw));
    if let Some(uvm) = devices.uvm_major {
        out.push(Rule::chr(uvm, Some(0), rw));
        out.push(Rule::chr(uvm, Some(1), rw));
    }
    out.dedup();
    out
}

/// The device nodes a container granted `gpu_mask` must not see, for the path-based
/// driver ([`PrivateDev`]): other GPUs' nodes, and the control nodes when it has no GPU.
pub fn hidden_nodes(gpu_mask: u64, devices: &NvidiaDevices) -> Vec<PathBuf> {
    devices
        .nodes
        .iter()
        .filter(|n| match n.gpu {
            Some(i) => i >= 64 || gpu_mask & (1u64 << i) == 0,
            None => gpu_mask == 0,
        })
        .map(|n| n.path.clone())
        .collect()
}

// ---- the eBPF program (cgroup v2) ----

use super::bpf::{insn, Insn, ALU_AND_K, ALU_RSH_K, EXIT, JNE_K, JNE_X, LDX_MEM_W, MOV64_K, MOV64_X};

/// `BPF_DEVCG_DEV_*`.
const DEV_BLOCK: i32 = 1;
const DEV_CHAR: i32 = 2;

/// The device program for `rules`: the context (`struct bpf_cgroup_dev_ctx`: `access_type`
/// = access << 16 | type, `major`, `minor`) is loaded into r2 (type), r3 (access), r4
/// (major), r5 (minor); each rule is a block of tests that jump past it on a mismatch and
/// return 1 (allow) at its end; after the last block the program returns 0 (deny).
pub fn program(rules: &[Rule]) -> Vec<Insn> {
    let mut p = vec![
        insn(LDX_MEM_W, 2, 1, 0, 0),
        insn(MOV64_X, 3, 2, 0, 0),
        insn(ALU_AND_K, 2, 0, 0, 0xffff),
        insn(ALU_RSH_K, 3, 0, 0, 16),
        insn(LDX_MEM_W, 4, 1, 4, 0),
        insn(LDX_MEM_W, 5, 1, 8, 0),
    ];
    for r in rules {
        // Jumps are emitted with offset 0 and fixed once the block's length is known.
        let mut block: Vec<Insn> = Vec::new();
        match r.kind {
            Kind::Char => block.push(insn(JNE_K, 2, 0, 0, DEV_CHAR)),
            Kind::Block => block.push(insn(JNE_K, 2, 0, 0, DEV_BLOCK)),
            Kind::Any => {}
        }
        if r.access & ACC_ALL != ACC_ALL {
            // The access asked for must be within the rule's: (asked & allowed) == asked.
            block.push(insn(MOV64_X, 1, 3, 0, 0));
            block.push(insn(ALU_AND_K, 1, 0, 0, (r.access & ACC_ALL) as i32));
            block.push(insn(JNE_X, 1, 3, 0, 0));
        }
        if let Some(m) = r.major {
            block.push(insn(JNE_K, 4, 0, 0, m as i32));
        }
        if let Some(m) = r.minor {
            block.push(insn(JNE_K, 5, 0, 0, m as i32));
        }
        block.push(insn(MOV64_K, 0, 0, 0, 1));
        block.push(insn(EXIT, 0, 0, 0, 0));
        let n = block.len();
        for (i, ins) in block.iter_mut().enumerate() {
            if ins.code == JNE_K || ins.code == JNE_X {
                ins.off = (n - i - 1) as i16;
            }
        }
        p.extend(block);
    }
    p.push(insn(MOV64_K, 0, 0, 0, 0));
    p.push(insn(EXIT, 0, 0, 0, 0));
    p
}

/// What [`program`] answers for one access, computed as the kernel would run it (for
/// tests: the emitter and the rule agree).
pub fn run_program(prog: &[Insn], kind: Kind, access: u32, major: u32, minor: u32) -> Option<u64> {
    let ty = match kind {
        Kind::Char => DEV_CHAR as u32,
        Kind::Block => DEV_BLOCK as u32,
        Kind::Any => return None,
    };
    super::bpf::run(prog, &[(access << 16) | ty, major, minor])
}

/// A loaded device program: one per allow list, attached to every container cgroup with
/// that list (the verifier runs once, not per container).
pub type Program = super::bpf::Program;

/// Loads the device program of `rules`.
pub fn load(rules: &[Rule]) -> io::Result<Program> {
    Program::load(&program(rules), super::bpf::DEVICE, "gpuam_devs")
}

/// Loads the device program of `rules` and attaches it to the cgroup v2 directory `dir`.
pub fn attach_v2(dir: &Path, rules: &[Rule]) -> io::Result<()> {
    super::bpf::attach(dir, &load(rules)?)
}

/// Sets the cgroup v1 devices cgroup `dir` (new, no process yet) to `rules`: deny all, then
/// allow each.
pub fn write_v1(dir: &Path, rules: &[Rule]) -> io::Result<()> {
    std::fs::write(dir.join("devices.deny"), "a")?;
    for r in rules {
        std::fs::write(dir.join("devices.allow"), r.to_string())?;
    }
    Ok(())
}

// ---- the private /dev of the shim ----

/// Where the inaccessible node lives: a root-only directory, so no task can put a link there.
const INACCESSIBLE_DIR: &str = "/run/gpuam";
const INACCESSIBLE: &str = "/run/gpuam/inaccessible-chr";

/// The mounts that hide other GPUs' nodes from one container run without a cgroup,
/// prepared before the fork (see [`PrivateDev::enter`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrivateDev {
    cover: CString,
    hide: Vec<CString>,
}

impl PrivateDev {
    /// The mounts hiding `paths`, with the inaccessible node made when missing. `Err` when
    /// this process cannot (not root).
    pub fn prepare(paths: &[PathBuf]) -> io::Result<PrivateDev> {
        // SAFETY: plain syscall.
        if unsafe { libc::geteuid() } != 0 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "a private /dev needs a root node (mount namespaces)",
            ));
        }
        std::fs::create_dir_all(INACCESSIBLE_DIR)?;
        let dir = std::fs::symlink_metadata(INACCESSIBLE_DIR)?;
        if !dir.is_dir() || dir.uid() != 0 || dir.mode() & 0o022 != 0 {
            return Err(io::Error::other(format!(
                "{INACCESSIBLE_DIR} is not a root-owned directory only root can write"
            )));
        }
        let cover = CString::new(INACCESSIBLE).map_err(io::Error::other)?;
        let ok = |m: &std::fs::Metadata| m.file_type().is_char_device() && m.rdev() == 0 && m.mode() & 0o777 == 0;
        if !std::fs::symlink_metadata(INACCESSIBLE).is_ok_and(|m| ok(&m)) {
            let _ = std::fs::remove_file(INACCESSIBLE);
            // SAFETY: plain syscall on a NUL-terminated path.
            if unsafe { libc::mknod(cover.as_ptr(), libc::S_IFCHR, libc::makedev(0, 0)) } != 0 {
                return Err(io::Error::last_os_error());
            }
            std::fs::set_permissions(INACCESSIBLE, std::os::unix::fs::PermissionsExt::from_mode(0o000))?;
        }
        let hide = paths
            .iter()
            .map(|p| CString::new(p.as_os_str().as_encoded_bytes()).map_err(io::Error::other))
            .collect::<io::Result<_>>()?;
        Ok(PrivateDev { cover, hide })
    }

    /// In the new child, before `exec` (only syscalls, nothing allocated): a mount
    /// namespace of its own (mounts of the host still propagate in), and the inaccessible
    /// node bound over each hidden path.
    pub fn enter(&self) -> io::Result<()> {
        // SAFETY: plain syscalls on NUL-terminated strings prepared before the fork.
        unsafe {
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::mount(
                c"none".as_ptr(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_SLAVE,
                std::ptr::null(),
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            for p in &self.hide {
                if libc::mount(
                    self.cover.as_ptr(),
                    p.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND,
                    std::ptr::null(),
                ) != 0
                {
                    return Err(io::Error::last_os_error());
                }
            }
        }
        Ok(())
    }

    /// How many nodes it hides.
    pub fn hidden(&self) -> usize {
        self.hide.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus(n: u32) -> NvidiaDevices {
        let mut nodes: Vec<NvidiaNode> = (0..n)
            .map(|i| NvidiaNode {
                path: PathBuf::from(format!("/dev/nvidia{i}")),
                gpu: Some(i),
                major: NVIDIA_MAJOR,
                minor: i,
            })
            .collect();
        nodes.push(NvidiaNode {
            path: "/dev/nvidiactl".into(),
            gpu: None,
            major: NVIDIA_MAJOR,
            minor: 255,
        });
        NvidiaDevices {
            nodes,
            uvm_major: Some(510),
        }
    }

    fn allowed(rules: &[Rule], major: u32, minor: u32, access: u32) -> bool {
        let by_program = run_program(&program(rules), Kind::Char, access, major, minor);
        assert!(by_program.is_some(), "the program ran off its end");
        by_program == Some(1)
    }

    #[test]
    fn a_grant_opens_its_gpus_and_the_control_nodes_only() {
        let devs = gpus(4);
        let rules = allow_list(0b0010, &devs, &[]);
        for acc in [ACC_READ, ACC_WRITE, ACC_READ | ACC_WRITE] {
            assert!(allowed(&rules, 195, 1, acc), "granted GPU 1");
            assert!(!allowed(&rules, 195, 0, acc), "GPU 0");
            assert!(!allowed(&rules, 195, 2, acc), "GPU 2");
            assert!(!allowed(&rules, 195, 3, acc), "GPU 3");
            assert!(allowed(&rules, 195, 255, acc), "nvidiactl");
            assert!(allowed(&rules, 195, 254, acc), "nvidia-modeset");
            assert!(allowed(&rules, 510, 0, acc), "nvidia-uvm");
            assert!(allowed(&rules, 510, 1, acc), "nvidia-uvm-tools");
            assert!(!allowed(&rules, 510, 2, acc), "another uvm minor");
            assert!(allowed(&rules, 1, 3, acc), "/dev/null");
            assert!(allowed(&rules, 136, 7, acc), "a pts");
            assert!(!allowed(&rules, 10, 229, acc), "/dev/fuse is not in the default list");
        }
        assert!(allowed(&rules, 195, 0, ACC_MKNOD), "mknod is allowed, opening is not");
        assert!(!allowed(&rules, 195, 0, ACC_MKNOD | ACC_READ));
    }

    #[test]
    fn no_gpu_opens_no_nvidia_device() {
        let rules = allow_list(0, &gpus(4), &[]);
        for minor in [0, 1, 2, 3, 254, 255] {
            assert!(!allowed(&rules, 195, minor, ACC_READ | ACC_WRITE), "195:{minor}");
        }
        assert!(!allowed(&rules, 510, 0, ACC_READ), "nvidia-uvm");
        assert!(allowed(&rules, 1, 9, ACC_READ), "/dev/urandom");
        assert_eq!(hidden_nodes(0, &gpus(2)).len(), 3, "both GPUs and nvidiactl");
        assert_eq!(
            hidden_nodes(0b01, &gpus(2)),
            vec![PathBuf::from("/dev/nvidia1")],
            "only the other GPU"
        );
    }

    #[test]
    fn numbers_come_from_the_nodes_found() {
        // GPU 1's node has minor 7 (a renumbered machine): that minor is allowed, not 1.
        let mut devs = gpus(2);
        devs.nodes[1].minor = 7;
        let rules = allow_list(0b10, &devs, &[]);
        assert!(allowed(&rules, 195, 7, ACC_READ));
        assert!(!allowed(&rules, 195, 1, ACC_READ));
        // A GPU without a node found falls back to 195:<index>.
        let rules = allow_list(0b100, &NvidiaDevices::default(), &[]);
        assert!(allowed(&rules, 195, 2, ACC_READ));
        assert!(!allowed(&rules, 195, 3, ACC_READ));
    }

    #[test]
    fn extra_rules_parse_print_and_may_not_open_gpus() {
        let r: Rule = "c 231:* rw".parse().unwrap();
        assert_eq!(r.to_string(), "c 231:* rw");
        assert_eq!("a *:* m".parse::<Rule>().unwrap().to_string(), "a *:* m");
        for bad in ["c 231 rw", "x 1:2 r", "c a:1 r", "c 1:2 rx", "c 1:2"] {
            assert!(bad.parse::<Rule>().is_err(), "{bad}");
        }
        assert!(check_extra(&["c 10:229 rw".parse().unwrap()], &[510]).is_ok());
        for bad in ["c 195:* rw", "c 510:0 r", "a *:* rwm", "c *:* r"] {
            assert!(check_extra(&[bad.parse().unwrap()], &[510]).is_err(), "{bad}");
        }
        let fuse: Rule = "c 10:229 rw".parse().unwrap();
        let rules = allow_list(0, &gpus(1), &[fuse]);
        assert!(allowed(&rules, 10, 229, ACC_READ | ACC_WRITE));
        assert!(
            !allowed(&rules, 10, 229, ACC_MKNOD | ACC_READ),
            "mknod is not in the rule"
        );
    }

    #[test]
    fn proc_devices_majors() {
        let text = "Character devices:\n  1 mem\n195 nvidia-frontend\n195 nvidia\n510 nvidia-uvm\n511 nvidia-nvlink\n\nBlock devices:\n  7 nvidia-fake\n";
        let m = char_majors(text, "nvidia");
        assert_eq!(m.len(), 4, "{m:?}");
        assert!(m.contains(&(510, "nvidia-uvm".into())));
        assert!(!m.iter().any(|(n, _)| *n == 7), "block majors are not character majors");
    }

    #[test]
    fn every_jump_lands_inside_the_program_and_it_ends_with_exit() {
        let p = program(&allow_list(0b1011, &gpus(4), &[]));
        for (i, ins) in p.iter().enumerate() {
            if ins.is_jump() {
                let to = i as i64 + 1 + i64::from(ins.off);
                assert!(to > i as i64 && (to as usize) < p.len(), "jump at {i} to {to}");
            }
        }
        assert_eq!(p.last().map(|i| i.code), Some(super::super::bpf::EXIT));
    }
}
