//! Resource quantities: CPU, memory, GPUs (count and 64-bit mask) and ports.
//!
//! Owns the arithmetic every other component uses to decide "does this fit" and
//! "what is left". It is the original's `ResourceDescriptor` with its unsound parts
//! fixed (reference/frameworklauncher.md §4.2, §10 item 16):
//! - where a mask is known, the GPU count is always the mask's popcount;
//! - CPU and memory never go negative (they saturate at zero);
//! - adding resources that share GPU bits or ports is an error ([`Resources::try_add`])
//!   instead of silently counting the shared bits once while doubling CPU and memory.

mod ports;

pub use ports::{PortParseError, PortRange, PortSet};

use serde::{Deserialize, Serialize};

/// Bit `i` set = GPU `i` of the node. Up to 64 GPUs per node.
pub type GpuMask = u64;

/// The indices of the set bits, ascending: `0x13` → `[0, 1, 4]`.
pub fn mask_indices(mask: GpuMask) -> Vec<u32> {
    let mut m = mask;
    let mut out = Vec::with_capacity(m.count_ones() as usize);
    while m != 0 {
        out.push(m.trailing_zeros());
        m &= m - 1;
    }
    out
}

/// The mask with bits `0..n` set (`n` ≤ 64).
pub fn mask_of_count(n: u32) -> GpuMask {
    if n >= 64 {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}

/// The `k` lowest set bits of `free`, or `None` if it has fewer than `k`.
pub fn lowest_bits(free: GpuMask, k: u32) -> Option<GpuMask> {
    if free.count_ones() < k {
        return None;
    }
    let mut m = free;
    let mut out = 0;
    for _ in 0..k {
        let low = m & m.wrapping_neg();
        out |= low;
        m &= !low;
    }
    Some(out)
}

/// Formats a mask the wire way: `"0x3f"`.
pub fn mask_hex(mask: GpuMask) -> String {
    format!("{mask:#x}")
}

/// Parses `"0x3f"`, `"3f"` or a decimal `"63"` (when it has no hex letters and no prefix,
/// it is read as decimal, the frameworklauncher `CONTAINER_GPUS` convention).
pub fn parse_mask(text: &str) -> Option<GpuMask> {
    let t = text.trim();
    if let Some(h) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).ok()
    } else if t.chars().all(|c| c.is_ascii_digit()) && !t.is_empty() {
        t.parse().ok()
    } else {
        u64::from_str_radix(t, 16).ok()
    }
}

/// Serde helper: a mask as a hex string on the wire, accepting hex strings or integers.
pub mod mask_serde {
    use super::{mask_hex, parse_mask, GpuMask};
    use serde::{de, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(m: &GpuMask, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&mask_hex(*m))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<GpuMask, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Num(u64),
            Text(String),
            Null(()),
        }
        match Raw::deserialize(d)? {
            Raw::Num(n) => Ok(n),
            Raw::Text(t) if t.trim().is_empty() => Ok(0),
            Raw::Text(t) => parse_mask(&t)
                .ok_or_else(|| de::Error::custom(format!("`{t}` is not a GPU mask (write it like \"0x3f\")"))),
            Raw::Null(()) => Ok(0),
        }
    }
}

/// A bundle of resources: a node's total, used or free amount, or a container's size.
///
/// `gpu_mask == 0` with `gpus > 0` is a count-only amount (which GPUs is not yet
/// decided); otherwise `gpus == gpu_mask.count_ones()`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Resources {
    pub cpu: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    pub gpus: u32,
    #[serde(with = "mask_serde")]
    pub gpu_mask: GpuMask,
    pub ports: PortSet,
}

/// A dimension in which a request does not fit, in the order the rule checks them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shortfall {
    /// Some requested GPU bit is not free (or does not exist).
    GpuBits,
    /// More GPUs than are free.
    Gpus,
    Cpu,
    Memory,
    /// Some requested concrete port is not free (or not offered).
    Ports,
    /// Too few free ports at or above the minimum for the dynamic ports.
    DynamicPorts,
}

impl Shortfall {
    const ALL: [Shortfall; 6] = [
        Shortfall::GpuBits,
        Shortfall::Gpus,
        Shortfall::Cpu,
        Shortfall::Memory,
        Shortfall::Ports,
        Shortfall::DynamicPorts,
    ];

    /// The reason as the select trace groups it.
    pub fn reason(self) -> &'static str {
        match self {
            Shortfall::GpuBits => "the requested GPU mask is not free",
            Shortfall::Gpus => "not enough free GPUs",
            Shortfall::Cpu => "not enough free CPU",
            Shortfall::Memory => "not enough free memory",
            Shortfall::Ports => "requested ports are not free",
            Shortfall::DynamicPorts => "too few free ports at or above container_min_port",
        }
    }
}

/// A set of [`Shortfall`]s (empty = fits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Shortfalls(u8);

impl Shortfalls {
    fn add(&mut self, s: Shortfall) {
        self.0 |= 1 << s as u8;
    }
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
    pub fn contains(self, s: Shortfall) -> bool {
        self.0 & (1 << s as u8) != 0
    }
    /// The first in rule order.
    pub fn first(self) -> Option<Shortfall> {
        self.iter().next()
    }
    pub fn iter(self) -> impl Iterator<Item = Shortfall> {
        Shortfall::ALL.into_iter().filter(move |s| self.contains(*s))
    }
}

/// Two amounts that cannot be added because they claim the same GPU or port.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("resources overlap: GPU bits {gpus:#x}, ports [{ports}]")]
pub struct Overlap {
    pub gpus: GpuMask,
    pub ports: PortSet,
}

impl Resources {
    /// An amount with a known GPU mask (count = popcount).
    pub fn with_mask(cpu: u32, memory_mb: u64, gpu_mask: GpuMask, ports: PortSet) -> Self {
        Resources {
            cpu,
            memory_mb,
            gpus: gpu_mask.count_ones(),
            gpu_mask,
            ports,
        }
    }

    /// A count-only amount (GPU bits not chosen yet).
    pub fn with_count(cpu: u32, memory_mb: u64, gpus: u32, ports: PortSet) -> Self {
        Resources {
            cpu,
            memory_mb,
            gpus,
            gpu_mask: 0,
            ports,
        }
    }

    pub fn is_zero(&self) -> bool {
        self.cpu == 0 && self.memory_mb == 0 && self.gpus == 0 && self.gpu_mask == 0 && self.ports.is_empty()
    }

    /// True when `self` (a request) fits in `avail` (see [`Resources::shortfalls`]).
    pub fn fits_in(&self, avail: &Resources) -> bool {
        self.shortfalls(avail, 0, 0).is_empty()
    }

    /// The first dimension in which `self` (a request) does not fit in `avail`, in the
    /// order of [`Shortfall`].
    pub fn shortfall(&self, avail: &Resources) -> Option<Shortfall> {
        self.shortfalls(avail, 0, 0).first()
    }

    /// [`Resources::shortfall`] for a request that also needs `dynamic` ports of its
    /// choosing at or above `min_port`, besides its concrete ones.
    pub fn shortfall_with_dynamic(&self, avail: &Resources, dynamic: u32, min_port: u16) -> Option<Shortfall> {
        self.shortfalls(avail, dynamic, min_port).first()
    }

    /// THE "does it fit" rule, used by the select pipeline (per node and per index
    /// bucket), its "can never fit" reasons (against a node's total) and the RM's ledger:
    /// every dimension in which `self` (a request) does not fit in `avail`. A request fits
    /// when its GPU bits are all free (or, count-only, no more GPUs than are free), its CPU
    /// and memory are no larger, its concrete ports are all free and `dynamic` more ports
    /// at or above `min_port` are free beside them.
    pub fn shortfalls(&self, avail: &Resources, dynamic: u32, min_port: u16) -> Shortfalls {
        let mut s = Shortfalls(0);
        if self.gpu_mask & avail.gpu_mask != self.gpu_mask {
            s.add(Shortfall::GpuBits);
        } else if self.gpus > avail.gpu_count() {
            s.add(Shortfall::Gpus);
        }
        if self.cpu > avail.cpu {
            s.add(Shortfall::Cpu);
        }
        if self.memory_mb > avail.memory_mb {
            s.add(Shortfall::Memory);
        }
        if !self.ports.is_subset(&avail.ports) {
            s.add(Shortfall::Ports);
        } else if dynamic > 0 && avail.ports.subtract(&self.ports).count_at_least(min_port) < dynamic {
            s.add(Shortfall::DynamicPorts);
        }
        s
    }

    /// The GPU count, derived from the mask where one is known.
    pub fn gpu_count(&self) -> u32 {
        if self.gpu_mask != 0 {
            self.gpu_mask.count_ones()
        } else {
            self.gpus
        }
    }

    /// `self − other`, saturating at zero. GPU bits are removed bitwise; a count-only
    /// `other` taken from a masked `self` removes that many of the lowest remaining
    /// bits, so count and mask never disagree.
    pub fn subtract(&self, other: &Resources) -> Resources {
        let (gpus, gpu_mask) = match (self.gpu_mask != 0, other.gpu_mask != 0) {
            (true, true) => {
                let m = self.gpu_mask & !other.gpu_mask;
                (m.count_ones(), m)
            }
            (true, false) => {
                let drop = lowest_bits(self.gpu_mask, other.gpus.min(self.gpu_mask.count_ones())).unwrap_or(0);
                let m = self.gpu_mask & !drop;
                (m.count_ones(), m)
            }
            (false, _) => (self.gpus.saturating_sub(other.gpu_count()), 0),
        };
        Resources {
            cpu: self.cpu.saturating_sub(other.cpu),
            memory_mb: self.memory_mb.saturating_sub(other.memory_mb),
            gpus,
            gpu_mask,
            ports: self.ports.subtract(&other.ports),
        }
    }

    /// `self + other`, refusing amounts that claim the same GPU bit or port.
    pub fn try_add(&self, other: &Resources) -> Result<Resources, Overlap> {
        let gpus_shared = self.gpu_mask & other.gpu_mask;
        if gpus_shared != 0 || self.ports.intersects(&other.ports) {
            return Err(Overlap {
                gpus: gpus_shared,
                ports: self.ports.intersect(&other.ports),
            });
        }
        let gpu_mask = self.gpu_mask | other.gpu_mask;
        let gpus = if self.gpu_mask != 0 || other.gpu_mask != 0 {
            // Mixed count-only and masked amounts keep the larger total honest.
            gpu_mask.count_ones().max(self.gpu_count() + other.gpu_count())
        } else {
            self.gpus + other.gpus
        };
        Ok(Resources {
            cpu: self.cpu.saturating_add(other.cpu),
            memory_mb: self.memory_mb.saturating_add(other.memory_mb),
            gpus,
            gpu_mask,
            ports: self.ports.union(&other.ports),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn masked(cpu: u32, mem: u64, mask: u64) -> Resources {
        Resources::with_mask(cpu, mem, mask, PortSet::new())
    }

    #[test]
    fn mask_helpers() {
        assert_eq!(mask_indices(0x13), vec![0, 1, 4]);
        assert_eq!(mask_of_count(8), 0xff);
        assert_eq!(mask_of_count(64), u64::MAX);
        assert_eq!(lowest_bits(0xf0, 2), Some(0x30));
        assert_eq!(lowest_bits(0xff, 4), Some(0x0f));
        assert_eq!(lowest_bits(0x3, 3), None, "never a short answer (original's fault 17)");
        assert_eq!(parse_mask("0x3f"), Some(0x3f));
        assert_eq!(parse_mask("240"), Some(240));
        assert_eq!(parse_mask("ff"), Some(0xff));
        assert_eq!(parse_mask("zz"), None);
        assert_eq!(mask_hex(0x3f), "0x3f");
    }

    #[test]
    fn subtract_matches_original_where_sound() {
        // (8, 0xFF) − (4, 0x0F) → (4, 0xF0)
        let r = masked(8, 100, 0xff).subtract(&masked(1, 10, 0x0f));
        assert_eq!((r.gpus, r.gpu_mask), (4, 0xf0));
        // (4, 0x0F) − (2, 0x30) → (4, 0x0F): bits not there change nothing.
        let r = masked(8, 100, 0x0f).subtract(&masked(1, 10, 0x30));
        assert_eq!((r.gpus, r.gpu_mask), (4, 0x0f));
    }

    #[test]
    fn subtract_fixes_count_mask_disagreement_and_negatives() {
        // Original: (8, 0xFF) − (2, 0x00) → (6, 0xFF). Here the mask follows the count.
        let r = masked(8, 100, 0xff).subtract(&Resources::with_count(1, 10, 2, PortSet::new()));
        assert_eq!((r.gpus, r.gpu_mask), (6, 0xfc));
        let r = masked(1, 10, 0).subtract(&masked(4, 100, 0));
        assert_eq!((r.cpu, r.memory_mb), (0, 0), "saturates instead of going negative");
    }

    #[test]
    fn try_add_refuses_double_claims() {
        // Original: (2, 0x3) + (2, 0x3) → (2, 0x3) while CPU doubled.
        let a = masked(2, 10, 0x3);
        assert_eq!(a.try_add(&a).unwrap_err().gpus, 0x3);
        let p = Resources::with_mask(1, 1, 0, PortSet::parse("2000-2001").unwrap());
        let q = Resources::with_mask(1, 1, 0, PortSet::parse("2001").unwrap());
        assert_eq!(p.try_add(&q).unwrap_err().ports.to_string(), "2001");
        let sum = masked(2, 10, 0x3).try_add(&masked(1, 5, 0xc)).unwrap();
        assert_eq!((sum.cpu, sum.memory_mb, sum.gpus, sum.gpu_mask), (3, 15, 4, 0xf));
    }

    #[test]
    fn fits_in_checks_every_dimension() {
        let avail = Resources::with_mask(8, 1000, 0xf0, PortSet::parse("2000-2010").unwrap());
        assert!(Resources::with_count(8, 1000, 4, PortSet::new()).fits_in(&avail));
        assert!(!Resources::with_count(9, 1000, 4, PortSet::new()).fits_in(&avail));
        assert!(!Resources::with_count(1, 1001, 0, PortSet::new()).fits_in(&avail));
        assert!(!Resources::with_count(1, 1, 5, PortSet::new()).fits_in(&avail));
        assert!(masked(1, 1, 0x30).fits_in(&avail));
        assert!(!masked(1, 1, 0x18).fits_in(&avail), "bit 3 is not free");
        assert!(!Resources::with_mask(1, 1, 0, PortSet::parse("2011").unwrap()).fits_in(&avail));
    }

    #[test]
    fn wire_form_uses_hex_masks() {
        let r = Resources::with_mask(4, 8192, 0x3, PortSet::parse("2000,2005-2006").unwrap());
        let j = serde_json::to_string(&r).unwrap();
        assert_eq!(
            j,
            r#"{"cpu":4,"memoryMB":8192,"gpus":2,"gpuMask":"0x3","ports":"2000,2005-2006"}"#
        );
        let back: Resources = serde_json::from_str(&j).unwrap();
        assert_eq!(back, r);
    }

    proptest! {
        #[test]
        fn count_equals_popcount_where_mask_known(a in any::<u64>(), b in any::<u64>(), n in 0u32..64) {
            let x = masked(8, 8, a);
            let r = x.subtract(&masked(1, 1, b));
            prop_assert_eq!(r.gpus, r.gpu_mask.count_ones());
            let r = x.subtract(&Resources::with_count(1, 1, n, PortSet::new()));
            prop_assert_eq!(r.gpus, r.gpu_mask.count_ones());
            prop_assert_eq!(r.gpu_mask & !a, 0);
            if let Some(m) = lowest_bits(a, n) {
                prop_assert_eq!(m.count_ones(), n);
                prop_assert_eq!(m & !a, 0);
            }
        }

        #[test]
        fn add_then_subtract_round_trips(a in any::<u64>(), b in any::<u64>()) {
            let b = b & !a;
            let x = masked(3, 30, a);
            let y = masked(2, 20, b);
            let s = x.try_add(&y).unwrap();
            let back = s.subtract(&y);
            prop_assert_eq!(back.gpu_mask, a);
            prop_assert_eq!((back.cpu, back.memory_mb), (3, 30));
        }
    }
}
