//! Port isolation: which ports a container's processes may bind, and the cgroup program
//! that makes the kernel enforce it.
//!
//! The RM grants ports as it grants GPUs (the ledger never gives one port to two live
//! containers), but a grant alone is bookkeeping: any task could bind any free port, take
//! another tenant's granted port before its task did (its rendezvous then reaches the
//! squatter) or, while the node agent or the RM restarts, their port, and read the calls
//! meant for them. The rule ([`BindGuard::denied`], pure): a container may not bind a port
//! the node manages (its offered ports) that is not granted to it, nor a port the node
//! reserves for itself (the agent's and the RM's); every other port, and port 0 (the
//! kernel's choice), stays open. The driver: a `BPF_PROG_TYPE_CGROUP_SOCK_ADDR` program
//! ([`program`]) at `BPF_CGROUP_INET4_BIND` and `BPF_CGROUP_INET6_BIND` of the container's
//! cgroup v2 ([`attach`]); a refused `bind` fails with `EPERM`, for TCP and UDP alike.
//!
//! Not covered: a node without a cgroup v2 (v1 only, the subreaper shim, process groups),
//! which says `ports: NOT isolated` in its containment line; a port the kernel picks for
//! `bind(0)`, `connect` or `listen` without `bind` inside a managed range that overlaps
//! the node's ephemeral range (`net.ipv4.ip_local_port_range`: keep the offered ports
//! outside it, or list them in `ip_local_reserved_ports`).

use std::io;
use std::path::Path;

use super::bpf::{insn, Insn, ALU_TO_BE, EXIT, JA, JGT_K, JLT_K, LDX_MEM_W, MOV64_K};
use crate::resources::PortSet;

/// `offsetof(struct bpf_sock_addr, user_port)`: the port asked for, network byte order.
const USER_PORT: i16 = 24;

/// What a node keeps its containers off.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BindGuard {
    /// The ports the node offers (granted one container at a time).
    pub managed: PortSet,
    /// The node's own ports (the agent's, the RM's): no container may bind them.
    pub reserved: PortSet,
}

impl BindGuard {
    /// The ports a container granted `granted` may not bind.
    pub fn denied(&self, granted: &PortSet) -> PortSet {
        self.managed.subtract(granted).union(&self.reserved)
    }
}

/// The bind program refusing `denied`: r2 = the port asked for (host order); for each
/// range, below its first or above its last port goes on to the next range, else to the
/// refusal; past the last range it is allowed (1); refused is 0.
pub fn program(denied: &PortSet) -> Vec<Insn> {
    let mut p = vec![insn(LDX_MEM_W, 2, 1, USER_PORT, 0), insn(ALU_TO_BE, 2, 0, 0, 16)];
    let mut refusals = Vec::new();
    for r in denied.ranges() {
        p.push(insn(JLT_K, 2, 0, 2, i32::from(r.begin)));
        p.push(insn(JGT_K, 2, 0, 1, i32::from(r.end)));
        refusals.push(p.len());
        p.push(insn(JA, 0, 0, 0, 0));
    }
    p.push(insn(MOV64_K, 0, 0, 0, 1));
    p.push(insn(EXIT, 0, 0, 0, 0));
    let refuse = p.len();
    p.push(insn(MOV64_K, 0, 0, 0, 0));
    p.push(insn(EXIT, 0, 0, 0, 0));
    for at in refusals {
        p[at].off = (refuse - at - 1) as i16;
    }
    p
}

/// Whether [`program`] lets `port` be bound, run as the kernel would (for tests).
pub fn allows(prog: &[Insn], port: u16) -> Option<bool> {
    let mut ctx = [0u32; 7];
    ctx[(USER_PORT / 4) as usize] = u32::from(port.swap_bytes());
    super::bpf::run(prog, &ctx).map(|r| r == 1)
}

/// The two loaded bind programs (IPv4, IPv6) refusing `denied`.
pub struct Programs([super::bpf::Program; 2]);

impl Programs {
    pub fn load(denied: &PortSet) -> io::Result<Programs> {
        let p = program(denied);
        Ok(Programs([
            super::bpf::Program::load(&p, super::bpf::INET4_BIND, "gpuam_bind4")?,
            super::bpf::Program::load(&p, super::bpf::INET6_BIND, "gpuam_bind6")?,
        ]))
    }
}

/// Attaches both of `progs` to the cgroup v2 directory `dir`.
pub fn attach(dir: &Path, progs: &Programs) -> io::Result<()> {
    for p in &progs.0 {
        super::bpf::attach(dir, p)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ports(text: &str) -> PortSet {
        PortSet::parse(text).unwrap()
    }

    /// A container binds its own granted ports and anything the node does not manage, never
    /// another's granted port nor the node's own.
    #[test]
    fn a_container_binds_its_own_ports_only_among_the_managed() {
        let guard = BindGuard {
            managed: ports("20000-20015,21000"),
            reserved: ports("8042,8088"),
        };
        let prog = program(&guard.denied(&ports("20003,20004")));
        let can = |port| allows(&prog, port).expect("the program ran to its end");
        assert!(can(20003) && can(20004), "its own");
        for other in [20000, 20002, 20005, 20015, 21000] {
            assert!(!can(other), "{other} is managed and not granted to it");
        }
        assert!(!can(8042) && !can(8088), "the agent's and the RM's");
        for free in [0, 22, 8043, 19999, 20016, 20999, 21001, 65535] {
            assert!(can(free), "{free} is not the node's");
        }
        // Nothing denied: every port.
        let open = program(&PortSet::new());
        assert!([0, 1, 20000, 65535].iter().all(|p| allows(&open, *p) == Some(true)));
    }

    #[test]
    fn every_jump_lands_inside_the_program_and_it_ends_with_exit() {
        let p = program(&ports("1-5,7,9-11,65535"));
        for (i, ins) in p.iter().enumerate() {
            if ins.is_jump() {
                let to = i as i64 + 1 + i64::from(ins.off);
                assert!(to > i as i64 && (to as usize) < p.len(), "jump at {i} to {to}");
            }
        }
        assert_eq!(p.last().map(|i| i.code), Some(EXIT));
    }

    fn port_set() -> impl Strategy<Value = PortSet> {
        proptest::collection::vec((1u16..=65535, 0u16..40), 0..6).prop_map(|v| {
            PortSet::from_ranges(
                v.into_iter()
                    .map(|(b, len)| crate::resources::PortRange::new(b, b.saturating_add(len))),
            )
        })
    }

    proptest! {
        /// The program decides every port exactly as the rule: denied iff managed and not
        /// granted, or reserved.
        #[test]
        fn the_program_is_the_rule(managed in port_set(), reserved in port_set(), granted in port_set(), probe in proptest::collection::vec(any::<u16>(), 32)) {
            let guard = BindGuard { managed: managed.clone(), reserved: reserved.clone() };
            let prog = program(&guard.denied(&granted));
            let mut near: Vec<u16> = probe;
            for r in managed.ranges().iter().chain(reserved.ranges()).chain(granted.ranges()) {
                near.extend([r.begin, r.end, r.begin.saturating_sub(1), r.end.saturating_add(1)]);
            }
            for port in near {
                let want = !((managed.contains(port) && !granted.contains(port)) || reserved.contains(port));
                prop_assert_eq!(allows(&prog, port), Some(want), "port {}", port);
            }
        }
    }
}
