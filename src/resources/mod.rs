//! Resource quantities: CPU, memory, GPUs (count, 64-bit mask and shares of GPUs in
//! hundredths), ports and custom named quantities.
//!
//! Owns the arithmetic every other component uses to decide "does this fit" and
//! "what is left". It is the original's `ResourceDescriptor` with its unsound parts
//! fixed (reference/frameworklauncher.md §4.2, §10 item 16):
//! - where a mask is known, the GPU count is always the mask's popcount;
//! - CPU and memory never go negative (they saturate at zero);
//! - adding resources that share GPU bits or ports is an error ([`Resources::try_add`])
//!   instead of silently counting the shared bits once while doubling CPU and memory;
//! - a GPU can be held in part (issue 15): per GPU index an amount holds 0–100
//!   hundredths, integers throughout ([`shares`]); two amounts may share a GPU only while
//!   their parts add up to at most one GPU, so a whole-GPU holder never shares.

pub mod custom;
mod ports;
pub mod shares;

pub use custom::{check_name as check_resource_name, CustomResources};
pub use ports::{PortParseError, PortRange, PortSet};
pub use shares::{format_hundredths, parse_hundredths, GpuAmount, GpuShares, ANY_GPU, WHOLE};

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
/// decided); otherwise `gpus == gpu_mask.count_ones()`. The mask is every GPU the amount
/// holds any of; `gpu_shares` names those it holds only in part (a fractional container:
/// one bit and its share; a node's used amount: its shared GPUs and how much of each is
/// taken; its free amount: how much is left on each). Per GPU index an amount therefore
/// holds [`Resources::gpu_hundredths`] ∈ 0..=100.
///
/// On the wire `gpuShares` and `customResources` are left out when empty, so a whole-GPU
/// amount reads exactly as before.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Resources {
    pub cpu: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    pub gpus: u32,
    #[serde(with = "mask_serde")]
    pub gpu_mask: GpuMask,
    /// GPUs of the mask held only in part, in hundredths (1..=99); empty = whole GPUs.
    #[serde(default, skip_serializing_if = "GpuShares::is_empty")]
    pub gpu_shares: GpuShares,
    pub ports: PortSet,
    /// Named quantities (`nvme: 2`), whole units.
    #[serde(
        default,
        rename = "customResources",
        skip_serializing_if = "CustomResources::is_empty"
    )]
    pub custom: CustomResources,
}

/// A dimension in which a request does not fit, in the order the rule checks them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shortfall {
    /// Some requested GPU bit is not free (or does not exist).
    GpuBits,
    /// More GPUs than are free.
    Gpus,
    /// No GPU (or not the requested one) has the requested share left.
    GpuShare,
    Cpu,
    Memory,
    /// Fewer units of some custom resource than requested.
    Custom,
    /// Some requested concrete port is not free (or not offered).
    Ports,
    /// Too few free ports at or above the minimum for the dynamic ports.
    DynamicPorts,
}

impl Shortfall {
    const ALL: [Shortfall; 8] = [
        Shortfall::GpuBits,
        Shortfall::Gpus,
        Shortfall::GpuShare,
        Shortfall::Cpu,
        Shortfall::Memory,
        Shortfall::Custom,
        Shortfall::Ports,
        Shortfall::DynamicPorts,
    ];

    /// The reason as the select trace groups it.
    pub fn reason(self) -> &'static str {
        match self {
            Shortfall::GpuBits => "the requested GPU mask is not free",
            Shortfall::Gpus => "not enough free GPUs",
            Shortfall::GpuShare => "no GPU has the requested share free",
            Shortfall::Cpu => "not enough free CPU",
            Shortfall::Memory => "not enough free memory",
            Shortfall::Custom => "not enough of a custom resource free",
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
            gpu_shares: GpuShares::new(),
            ports,
            custom: CustomResources::new(),
        }
    }

    /// A count-only amount (GPU bits not chosen yet).
    pub fn with_count(cpu: u32, memory_mb: u64, gpus: u32, ports: PortSet) -> Self {
        Resources {
            cpu,
            memory_mb,
            gpus,
            gpu_mask: 0,
            gpu_shares: GpuShares::new(),
            ports,
            custom: CustomResources::new(),
        }
    }

    /// A fractional container: `hundredths` of GPU `index` (100 or more = the whole GPU).
    /// A task's request: `gpus` whole GPUs (exactly `gpu_mask` when not 0), or with
    /// `share` that many hundredths of one GPU (the mask's, or any: [`ANY_GPU`]).
    pub fn request(
        cpu: u32,
        memory_mb: u64,
        gpus: u32,
        gpu_mask: GpuMask,
        share: Option<u32>,
        ports: PortSet,
        custom: CustomResources,
    ) -> Self {
        let gpu_shares = match share {
            None => GpuShares::new(),
            Some(h) if gpu_mask != 0 => GpuShares::one(gpu_mask.trailing_zeros() as u8, h),
            Some(h) => GpuShares::one(ANY_GPU, h),
        };
        Resources {
            cpu,
            memory_mb,
            gpus,
            gpu_mask,
            gpu_shares,
            ports,
            custom,
        }
    }

    pub fn with_share(cpu: u32, memory_mb: u64, index: u32, hundredths: u32, ports: PortSet) -> Self {
        let mut r = Resources::with_mask(cpu, memory_mb, 1u64 << index.min(63), ports);
        r.gpu_shares = GpuShares::one(index.min(63) as u8, hundredths);
        r
    }

    /// The same amount with these custom resources.
    pub fn with_custom(mut self, custom: CustomResources) -> Self {
        self.custom = custom;
        self
    }

    pub fn is_zero(&self) -> bool {
        self.cpu == 0
            && self.memory_mb == 0
            && self.gpus == 0
            && self.gpu_mask == 0
            && self.gpu_shares.is_empty()
            && self.ports.is_empty()
            && self.custom.is_empty()
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
    /// when its whole GPUs are all wholly free (or, count-only, no more whole GPUs than are
    /// wholly free: a GPU holding any share is never given whole), each of its GPU shares
    /// finds that much left on its GPU (count-only: on some GPU), its CPU, memory and
    /// custom resources are no larger, its concrete ports are all free and `dynamic` more
    /// ports at or above `min_port` are free beside them.
    #[inline]
    pub fn shortfalls(&self, avail: &Resources, dynamic: u32, min_port: u16) -> Shortfalls {
        let mut s = Shortfalls(0);
        if self.gpu_shares.is_empty() && avail.gpu_shares.is_empty() {
            // Whole GPUs on both sides (the common case, kept cheap for the select walk).
            if self.gpu_mask & avail.gpu_mask != self.gpu_mask {
                s.add(Shortfall::GpuBits);
            } else if self.gpus > avail.gpu_count() {
                s.add(Shortfall::Gpus);
            }
        } else {
            let whole = self.whole_gpu_mask();
            if whole & avail.whole_gpu_mask() != whole {
                s.add(Shortfall::GpuBits);
            } else if self.whole_gpu_count() > avail.whole_gpu_count() {
                s.add(Shortfall::Gpus);
            }
        }
        for (i, h) in self.gpu_shares.iter() {
            let room = if i == ANY_GPU {
                avail.largest_gpu_room()
            } else {
                avail.gpu_hundredths(u32::from(i))
            };
            if room < h {
                s.add(Shortfall::GpuShare);
            }
        }
        if self.cpu > avail.cpu {
            s.add(Shortfall::Cpu);
        }
        if self.memory_mb > avail.memory_mb {
            s.add(Shortfall::Memory);
        }
        if !self.custom.is_empty() && !self.custom.fits_in(&avail.custom) {
            s.add(Shortfall::Custom);
        }
        if !self.ports.is_subset(&avail.ports) {
            s.add(Shortfall::Ports);
        } else if dynamic > 0 && avail.ports.subtract(&self.ports).count_at_least(min_port) < dynamic {
            s.add(Shortfall::DynamicPorts);
        }
        s
    }

    /// The GPU count, derived from the mask where one is known: every GPU the amount
    /// holds any of.
    pub fn gpu_count(&self) -> u32 {
        if self.gpu_mask != 0 {
            self.gpu_mask.count_ones()
        } else {
            self.gpus
        }
    }

    /// The GPUs held whole (the mask without the shared ones).
    #[inline]
    pub fn whole_gpu_mask(&self) -> GpuMask {
        self.gpu_mask & !self.gpu_shares.mask()
    }

    /// How many GPUs are held whole (count-only: the count less its shares).
    #[inline]
    pub fn whole_gpu_count(&self) -> u32 {
        if self.gpu_mask != 0 {
            self.whole_gpu_mask().count_ones()
        } else {
            self.gpus.saturating_sub(self.gpu_shares.len() as u32)
        }
    }

    /// Hundredths of GPU this amount holds in all: 100 per whole GPU plus its shares (what
    /// the queues count, [`shares::hundredths`]).
    pub fn hundredths(&self) -> u32 {
        shares::hundredths(self.whole_gpu_count(), &self.gpu_shares)
    }

    /// Hundredths of GPU `index` this amount holds: 100 for a whole GPU, its share for
    /// a shared one, 0 otherwise.
    #[inline]
    pub fn gpu_hundredths(&self, index: u32) -> u32 {
        if index >= 64 || self.gpu_mask & (1u64 << index) == 0 {
            return 0;
        }
        match self.gpu_shares.get(index as u8) {
            0 => WHOLE,
            h => h,
        }
    }

    /// The most of any one GPU this amount holds (100 when it holds a whole GPU).
    pub fn largest_gpu_room(&self) -> u32 {
        if self.whole_gpu_count() > 0 {
            WHOLE
        } else {
            self.gpu_shares.iter().map(|(_, h)| h).max().unwrap_or(0)
        }
    }

    /// A fractional request's share of its one GPU, in hundredths (`None`: whole GPUs).
    pub fn gpu_share(&self) -> Option<u32> {
        self.gpu_shares.single().map(|(_, h)| h)
    }

    /// The GPUs as people read them: `0x3`, or `0x1 (0:0.25)` with shares.
    pub fn gpu_text(&self) -> String {
        if self.gpu_shares.is_empty() {
            mask_hex(self.gpu_mask)
        } else {
            format!("{} ({})", mask_hex(self.gpu_mask), self.gpu_shares)
        }
    }

    /// Builds the GPU part of an amount from per-index hundredths over `mask`.
    fn gpus_from(mask: GpuMask, hundredths: impl Fn(u32) -> u32) -> (u32, GpuMask, GpuShares) {
        let mut out_mask = 0;
        let mut shares = GpuShares::new();
        let mut m = mask;
        while m != 0 {
            let i = m.trailing_zeros();
            m &= m - 1;
            let h = hundredths(i).min(WHOLE);
            if h > 0 {
                out_mask |= 1u64 << i;
                shares.set(i as u8, h);
            }
        }
        (out_mask.count_ones(), out_mask, shares)
    }

    /// `self − other`, saturating at zero. GPU bits are removed bitwise (per index, in
    /// hundredths, when either side holds shares); a count-only `other` taken from a
    /// masked `self` removes that many of the lowest remaining bits (a count-only share
    /// counts as a whole GPU there: taking too much never over-allocates), so count and
    /// mask never disagree.
    pub fn subtract(&self, other: &Resources) -> Resources {
        let exact = !self.gpu_shares.is_empty() || !other.gpu_shares.is_empty();
        let (gpus, gpu_mask, gpu_shares) = match (self.gpu_mask != 0, other.gpu_mask != 0) {
            (true, true) if exact => Self::gpus_from(self.gpu_mask, |i| {
                self.gpu_hundredths(i).saturating_sub(other.gpu_hundredths(i))
            }),
            (true, true) => {
                let m = self.gpu_mask & !other.gpu_mask;
                (m.count_ones(), m, GpuShares::new())
            }
            (true, false) => {
                let drop = lowest_bits(self.gpu_mask, other.gpus.min(self.gpu_mask.count_ones())).unwrap_or(0);
                Self::gpus_from(self.gpu_mask & !drop, |i| self.gpu_hundredths(i))
            }
            (false, _) => (self.gpus.saturating_sub(other.gpu_count()), 0, GpuShares::new()),
        };
        Resources {
            cpu: self.cpu.saturating_sub(other.cpu),
            memory_mb: self.memory_mb.saturating_sub(other.memory_mb),
            gpus,
            gpu_mask,
            gpu_shares,
            ports: self.ports.subtract(&other.ports),
            custom: self.custom.subtract(&other.custom),
        }
    }

    /// `self + other`, refusing amounts that claim the same port, or between them more
    /// than a whole GPU of one index (two whole holders, or a whole holder and a share, or
    /// shares above 1.0).
    pub fn try_add(&self, other: &Resources) -> Result<Resources, Overlap> {
        let common = self.gpu_mask & other.gpu_mask;
        let mut over = 0;
        let mut m = common;
        while m != 0 {
            let i = m.trailing_zeros();
            m &= m - 1;
            if self.gpu_hundredths(i) + other.gpu_hundredths(i) > WHOLE {
                over |= 1u64 << i;
            }
        }
        if over != 0 || self.ports.intersects(&other.ports) {
            return Err(Overlap {
                gpus: over,
                ports: self.ports.intersect(&other.ports),
            });
        }
        let gpu_mask = self.gpu_mask | other.gpu_mask;
        let (gpus, gpu_mask, gpu_shares) = if self.gpu_shares.is_empty() && other.gpu_shares.is_empty() {
            (gpu_mask.count_ones(), gpu_mask, GpuShares::new())
        } else {
            Self::gpus_from(gpu_mask, |i| self.gpu_hundredths(i) + other.gpu_hundredths(i))
        };
        let gpus = if self.gpu_mask != 0 || other.gpu_mask != 0 {
            // Mixed count-only and masked amounts keep the larger total honest.
            let count_only = |r: &Resources| if r.gpu_mask == 0 { r.gpus } else { 0 };
            gpus.max(gpus + count_only(self) + count_only(other))
        } else {
            self.gpus + other.gpus
        };
        Ok(Resources {
            cpu: self.cpu.saturating_add(other.cpu),
            memory_mb: self.memory_mb.saturating_add(other.memory_mb),
            gpus,
            gpu_mask,
            gpu_shares,
            ports: self.ports.union(&other.ports),
            custom: self.custom.add(&other.custom),
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

    fn share(cpu: u32, index: u32, h: u32) -> Resources {
        Resources::with_share(cpu, 10, index, h, PortSet::new())
    }

    #[test]
    fn shares_add_up_to_one_gpu_and_never_share_with_a_whole_holder() {
        let quarter = share(1, 0, 25);
        let mut used = Resources::default();
        for _ in 0..4 {
            used = used.try_add(&quarter).expect("four quarters fit one GPU");
        }
        assert_eq!((used.gpu_mask, used.gpu_hundredths(0), used.gpus), (0x1, 100, 1));
        assert!(used.gpu_shares.is_empty(), "a full GPU is whole: {:?}", used.gpu_shares);
        assert_eq!(
            used.try_add(&quarter).unwrap_err().gpus,
            0x1,
            "a fifth quarter is too much"
        );
        let whole = masked(1, 10, 0x1);
        assert_eq!(
            quarter.try_add(&whole).unwrap_err().gpus,
            0x1,
            "no whole GPU beside a share"
        );
        let three = share(1, 0, 75).try_add(&share(1, 1, 50)).unwrap();
        assert_eq!(
            (three.gpu_mask, three.gpu_shares.to_string()),
            (0x3, "0:0.75,1:0.5".to_string())
        );
    }

    #[test]
    fn the_one_rule_gives_whole_gpus_only_where_nothing_is_shared() {
        let total = masked(8, 1000, 0x3);
        let used = share(1, 0, 25).try_add(&share(1, 0, 25)).unwrap();
        let free = total.subtract(&used);
        assert_eq!(
            (free.gpu_mask, free.gpu_hundredths(0), free.gpu_hundredths(1)),
            (0x3, 50, 100)
        );
        assert_eq!((free.whole_gpu_mask(), free.whole_gpu_count()), (0x2, 1));
        assert_eq!(
            masked(1, 1, 0x1).shortfall(&free),
            Some(Shortfall::GpuBits),
            "GPU 0 is shared"
        );
        assert_eq!(masked(1, 1, 0x2).shortfall(&free), None);
        assert_eq!(
            Resources::with_count(1, 1, 2, PortSet::new()).shortfall(&free),
            Some(Shortfall::Gpus)
        );
        assert_eq!(share(1, 0, 50).shortfall(&free), None, "exactly what is left");
        assert_eq!(share(1, 0, 51).shortfall(&free), Some(Shortfall::GpuShare));
        let mut any = Resources::with_count(1, 1, 1, PortSet::new());
        any.gpu_shares = GpuShares::one(ANY_GPU, 99);
        assert_eq!(any.shortfall(&free), None, "GPU 1 is wholly free");
        assert_eq!(
            any.shortfall(&free.subtract(&masked(0, 0, 0x2))),
            Some(Shortfall::GpuShare)
        );
        assert_eq!(total.subtract(&used).subtract(&share(0, 0, 50)).gpu_mask, 0x2);
    }

    #[test]
    fn custom_resources_follow_the_rule() {
        let node = masked(8, 1000, 0).with_custom(CustomResources::from_pairs([("nvme", 2)]));
        let task = masked(1, 1, 0).with_custom(CustomResources::from_pairs([("nvme", 1)]));
        let used = task.try_add(&task).unwrap();
        assert_eq!(used.custom.get("nvme"), 2);
        assert_eq!(task.shortfall(&node.subtract(&used)), Some(Shortfall::Custom));
        assert_eq!(task.shortfall(&node.subtract(&task)), None);
        let other = masked(1, 1, 0).with_custom(CustomResources::from_pairs([("fpga", 1)]));
        assert_eq!(other.shortfall(&node), Some(Shortfall::Custom));
    }

    #[test]
    fn wire_form_adds_shares_and_custom_only_when_present() {
        let r = share(4, 2, 25).with_custom(CustomResources::from_pairs([("nvme", 1)]));
        let j = serde_json::to_string(&r).unwrap();
        assert_eq!(
            j,
            r#"{"cpu":4,"memoryMB":10,"gpus":1,"gpuMask":"0x4","gpuShares":{"2":"0.25"},"ports":"","customResources":{"nvme":1}}"#
        );
        assert_eq!(serde_json::from_str::<Resources>(&j).unwrap(), r);
        assert!(!serde_json::to_string(&masked(1, 1, 1)).unwrap().contains("Shares"));
    }

    proptest! {
        /// Per index, adding and taking away shares is exact and never passes one GPU.
        #[test]
        fn share_arithmetic_is_exact(parts in proptest::collection::vec((0u32..4, 1u32..100), 0..12)) {
            let mut used = Resources::default();
            let mut kept = Vec::new();
            for (i, h) in parts {
                let r = share(1, i, h);
                match used.try_add(&r) {
                    Ok(u) => { used = u; kept.push(r); }
                    Err(_) => prop_assert!(used.gpu_hundredths(i) + h > 100),
                }
                for g in 0..4 {
                    prop_assert!(used.gpu_hundredths(g) <= 100);
                }
            }
            for g in 0..4u32 {
                let sum: u32 = kept.iter().map(|r| r.gpu_hundredths(g)).sum();
                prop_assert_eq!(used.gpu_hundredths(g), sum);
            }
            for r in &kept {
                used = used.subtract(r);
            }
            prop_assert!(used.gpu_mask == 0 && used.gpu_shares.is_empty());
        }
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
