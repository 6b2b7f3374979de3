//! The few eBPF pieces the node's cgroup programs need, in one place: instructions as the
//! kernel reads them ([`Insn`]), the opcodes used, an interpreter of exactly those for
//! tests ([`run`]: an emitter and its rule are checked against each other without a
//! kernel), and the thin syscall driver that loads a program ([`Program::load`]) and
//! attaches it to a cgroup v2 directory ([`attach`]). The programs themselves are emitted
//! by their owners: GPU device access ([`super::devices`]) and port binds
//! ([`super::bind_guard`]).

use std::ffi::CString;
use std::io;
use std::path::Path;

/// One `struct bpf_insn`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Insn {
    pub code: u8,
    pub dst: u8,
    pub src: u8,
    pub off: i16,
    pub imm: i32,
}

impl Insn {
    /// The kernel's `struct bpf_insn` (8 bytes, little-endian fields).
    pub fn encode(&self) -> [u8; 8] {
        let mut b = [0u8; 8];
        b[0] = self.code;
        b[1] = (self.src << 4) | (self.dst & 0x0f);
        b[2..4].copy_from_slice(&self.off.to_le_bytes());
        b[4..8].copy_from_slice(&self.imm.to_le_bytes());
        b
    }

    /// Whether this is a conditional or unconditional jump (whose `off` is relative).
    pub fn is_jump(&self) -> bool {
        matches!(self.code, JNE_K | JNE_X | JLT_K | JGT_K | JA)
    }
}

// Opcodes (linux/bpf_common.h, linux/bpf.h).
pub const LDX_MEM_W: u8 = 0x61; // BPF_LDX | BPF_MEM | BPF_W
pub const ALU_AND_K: u8 = 0x54; // BPF_ALU | BPF_AND | BPF_K (32-bit)
pub const ALU_RSH_K: u8 = 0x74; // BPF_ALU | BPF_RSH | BPF_K (32-bit)
/// `BPF_ALU | BPF_END | BPF_TO_BE`: to big-endian (a byte swap on little-endian hosts),
/// `imm` bits wide, the rest cleared.
pub const ALU_TO_BE: u8 = 0xdc;
pub const MOV64_X: u8 = 0xbf; // BPF_ALU64 | BPF_MOV | BPF_X
pub const MOV64_K: u8 = 0xb7; // BPF_ALU64 | BPF_MOV | BPF_K
pub const JNE_K: u8 = 0x55; // BPF_JMP | BPF_JNE | BPF_K
pub const JNE_X: u8 = 0x5d; // BPF_JMP | BPF_JNE | BPF_X
pub const JLT_K: u8 = 0xa5; // BPF_JMP | BPF_JLT | BPF_K (unsigned)
pub const JGT_K: u8 = 0x25; // BPF_JMP | BPF_JGT | BPF_K (unsigned)
pub const JA: u8 = 0x05; // BPF_JMP | BPF_JA
pub const EXIT: u8 = 0x95; // BPF_JMP | BPF_EXIT

pub const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        dst,
        src,
        off,
        imm,
    }
}

/// What `prog` returns for a context whose 32-bit words are `ctx` (word `i` at byte offset
/// `4 i`), run as the kernel would on a little-endian machine; `None` for an instruction
/// outside the set above, a load outside `ctx`, or a program that runs off its end.
pub fn run(prog: &[Insn], ctx: &[u32]) -> Option<u64> {
    let mut r = [0u64; 11];
    let mut pc = 0usize;
    for _ in 0..100_000 {
        let i = *prog.get(pc)?;
        let (d, s) = (usize::from(i.dst), usize::from(i.src));
        pc += 1;
        let jump = |pc: usize| usize::try_from(pc as i64 + i64::from(i.off)).ok();
        match i.code {
            LDX_MEM_W => r[d] = u64::from(*ctx.get(usize::try_from(i.off / 4).ok()?)?),
            MOV64_X => r[d] = r[s],
            MOV64_K => r[d] = i.imm as i64 as u64,
            ALU_AND_K => r[d] = (r[d] & u64::from(i.imm as u32)) & 0xffff_ffff,
            ALU_RSH_K => r[d] = u64::from((r[d] as u32) >> i.imm),
            ALU_TO_BE => {
                r[d] = match i.imm {
                    16 => u64::from((r[d] as u16).swap_bytes()),
                    32 => u64::from((r[d] as u32).swap_bytes()),
                    _ => return None,
                }
            }
            JNE_K if r[d] != i.imm as i64 as u64 => pc = jump(pc)?,
            JNE_X if r[d] != r[s] => pc = jump(pc)?,
            JLT_K if r[d] < i.imm as i64 as u64 => pc = jump(pc)?,
            JGT_K if r[d] > i.imm as i64 as u64 => pc = jump(pc)?,
            JA => pc = jump(pc)?,
            JNE_K | JNE_X | JLT_K | JGT_K => {}
            EXIT => return Some(r[0]),
            _ => return None,
        }
    }
    None
}

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_F_ALLOW_MULTI: u32 = 2;

/// The leading fields of `union bpf_attr` for `BPF_PROG_LOAD`.
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// The fields of `union bpf_attr` for `BPF_PROG_ATTACH`.
#[repr(C)]
#[derive(Default)]
struct ProgAttachAttr {
    target_fd: u32,
    attach_bpf_fd: u32,
    attach_type: u32,
    attach_flags: u32,
    replace_bpf_fd: u32,
}

/// An fd closed on drop.
#[derive(Debug)]
struct Fd(libc::c_int);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: an fd this module opened and owns.
        unsafe {
            libc::close(self.0);
        }
    }
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, initialised `bpf_attr` prefix of the size passed.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, std::mem::size_of::<T>()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// What kind of cgroup program, and where it is attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hook {
    /// `BPF_PROG_TYPE_*`.
    pub prog_type: u32,
    /// `BPF_CGROUP_*`: the attach type, also the load's expected attach type.
    pub attach_type: u32,
}

/// `BPF_PROG_TYPE_CGROUP_DEVICE` at `BPF_CGROUP_DEVICE`.
pub const DEVICE: Hook = Hook {
    prog_type: 15,
    attach_type: 6,
};
/// `BPF_PROG_TYPE_CGROUP_SOCK_ADDR` at `BPF_CGROUP_INET4_BIND`.
pub const INET4_BIND: Hook = Hook {
    prog_type: 18,
    attach_type: 8,
};
/// `BPF_PROG_TYPE_CGROUP_SOCK_ADDR` at `BPF_CGROUP_INET6_BIND`.
pub const INET6_BIND: Hook = Hook {
    prog_type: 18,
    attach_type: 9,
};

/// A loaded program (its fd, closed on drop) and where it attaches.
#[derive(Debug)]
pub struct Program {
    fd: Fd,
    hook: Hook,
}

impl Program {
    /// Loads `prog` for `hook`, named `name` (at most 15 bytes shown); the verifier's log
    /// is in the error.
    pub fn load(prog: &[Insn], hook: Hook, name: &str) -> io::Result<Program> {
        let code: Vec<u8> = prog.iter().flat_map(Insn::encode).collect();
        let license = c"Apache-2.0";
        let mut prog_name = [0u8; 16];
        let n = name.len().min(15);
        prog_name[..n].copy_from_slice(&name.as_bytes()[..n]);
        let attr = |log: &mut Vec<u8>| ProgLoadAttr {
            prog_type: hook.prog_type,
            insn_cnt: (code.len() / 8) as u32,
            insns: code.as_ptr() as u64,
            license: license.as_ptr() as u64,
            log_level: u32::from(!log.is_empty()),
            log_size: log.len() as u32,
            log_buf: if log.is_empty() { 0 } else { log.as_mut_ptr() as u64 },
            prog_name,
            expected_attach_type: hook.attach_type,
            ..Default::default()
        };
        let fd = match bpf(BPF_PROG_LOAD, &mut attr(&mut Vec::new())) {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) || e.raw_os_error() == Some(libc::EACCES) => {
                // Again with the verifier's log, to say why.
                let mut log = vec![0u8; 1 << 16];
                match bpf(BPF_PROG_LOAD, &mut attr(&mut log)) {
                    Ok(fd) => fd,
                    Err(_) => {
                        let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
                        let said = String::from_utf8_lossy(&log[..end]);
                        return Err(io::Error::new(
                            e.kind(),
                            format!("the kernel refused the {name} program: {e}; verifier: {}", said.trim()),
                        ));
                    }
                }
            }
            Err(e) => return Err(e),
        };
        let fd = libc::c_int::try_from(fd).map_err(io::Error::other)?;
        Ok(Program { fd: Fd(fd), hook })
    }
}

/// Attaches `prog` to the cgroup v2 directory `dir` at its hook (`BPF_F_ALLOW_MULTI`:
/// programs of parent cgroups still run; all must allow). The attachment holds the program
/// for as long as the cgroup lives.
pub fn attach(dir: &Path, prog: &Program) -> io::Result<()> {
    let path = CString::new(dir.as_os_str().as_encoded_bytes()).map_err(io::Error::other)?;
    // SAFETY: plain syscall on a NUL-terminated path.
    let cg = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if cg < 0 {
        return Err(io::Error::last_os_error());
    }
    let cg = Fd(cg);
    let mut attr = ProgAttachAttr {
        target_fd: cg.0 as u32,
        attach_bpf_fd: prog.fd.0 as u32,
        attach_type: prog.hook.attach_type,
        attach_flags: BPF_F_ALLOW_MULTI,
        ..Default::default()
    };
    bpf(BPF_PROG_ATTACH, &mut attr).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instructions_encode_as_the_kernel_reads_them() {
        assert_eq!(insn(LDX_MEM_W, 4, 1, 4, 0).encode(), [0x61, 0x14, 4, 0, 0, 0, 0, 0]);
        assert_eq!(insn(JNE_K, 5, 0, 3, 195).encode(), [0x55, 0x05, 3, 0, 195, 0, 0, 0]);
        assert_eq!(insn(ALU_TO_BE, 2, 0, 0, 16).encode(), [0xdc, 0x02, 0, 0, 16, 0, 0, 0]);
    }

    #[test]
    fn the_interpreter_swaps_compares_and_jumps_as_the_kernel() {
        // r2 = ctx[1] as big-endian 16 bits; r0 = 1 if 1000 <= r2 <= 2000 else 0.
        let p = [
            insn(LDX_MEM_W, 2, 1, 4, 0),
            insn(ALU_TO_BE, 2, 0, 0, 16),
            insn(MOV64_K, 0, 0, 0, 0),
            insn(JLT_K, 2, 0, 2, 1000),
            insn(JGT_K, 2, 0, 1, 2000),
            insn(MOV64_K, 0, 0, 0, 1),
            insn(EXIT, 0, 0, 0, 0),
        ];
        let be = |port: u16| u32::from(port.swap_bytes());
        assert_eq!(run(&p, &[0, be(1500)]), Some(1));
        assert_eq!(run(&p, &[0, be(999)]), Some(0));
        assert_eq!(run(&p, &[0, be(2001)]), Some(0));
        assert_eq!(run(&p, &[0]), None, "a load outside the context");
        assert_eq!(run(&p[..3], &[0, 0]), None, "off the end");
    }
}
