//! Link classes between two GPUs (`NV#`, `PIX`, `PXB`, `PHB`, `NODE`, `SYS`), their tiers
//! and pair weights (DESIGN.md §5), and how they print and parse.

use std::fmt;
use std::str::FromStr;

/// Link class between two GPUs, as `nvidia-smi topo -m` prints it.
///
/// Ordered ladder, best first: `NV#` (more links better), `PIX`, `PXB`, `PHB`, `NODE`,
/// `SYS`. [`Link::weight`] strictly decreases along that ladder, so it doubles as the rank of
/// a class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Link {
    /// Bonded NVLinks (`NV#`), with the number of links (≥ 1 for a real link).
    Nv(u8),
    /// At most one PCIe switch on the path.
    Pix,
    /// Several PCIe switches, no host bridge.
    Pxb,
    /// Through a PCIe host bridge (the CPU root complex).
    Phb,
    /// Between host bridges inside one NUMA node.
    Node,
    /// Across the inter-socket link (older drivers print `SOC`).
    Sys,
}

impl Link {
    /// Connectivity tier: `NV#` = 2; `PIX`, `PXB` = 1; `PHB`, `NODE`, `SYS` = 0.
    pub fn tier(self) -> u8 {
        match self {
            Link::Nv(_) => 2,
            Link::Pix | Link::Pxb => 1,
            Link::Phb | Link::Node | Link::Sys => 0,
        }
    }

    /// Pair weight: `NV#` = 25·#, `PIX` 12, `PXB` 10, `PHB` 8, `NODE` 6, `SYS` 4.
    pub fn weight(self) -> u32 {
        match self {
            Link::Nv(m) => 25 * u32::from(m),
            Link::Pix => 12,
            Link::Pxb => 10,
            Link::Phb => 8,
            Link::Node => 6,
            Link::Sys => 4,
        }
    }

    /// Parses one matrix cell (`NV12`, `PIX`, ..., `SOC` = `SYS`); `X` and anything else → `None`.
    pub fn parse_cell(cell: &str) -> Option<Link> {
        match cell {
            "PIX" => Some(Link::Pix),
            "PXB" => Some(Link::Pxb),
            "PHB" => Some(Link::Phb),
            "NODE" => Some(Link::Node),
            "SYS" | "SOC" => Some(Link::Sys),
            _ => {
                let m: u8 = cell.strip_prefix("NV")?.parse().ok()?;
                (m >= 1).then_some(Link::Nv(m))
            }
        }
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Link::Nv(m) => write!(f, "NV{m}"),
            Link::Pix => f.write_str("PIX"),
            Link::Pxb => f.write_str("PXB"),
            Link::Phb => f.write_str("PHB"),
            Link::Node => f.write_str("NODE"),
            Link::Sys => f.write_str("SYS"),
        }
    }
}

impl FromStr for Link {
    type Err = super::TopologyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Link::parse_cell(s.trim()).ok_or_else(|| {
            super::TopologyError(format!(
                "unknown link class `{s}` (expected NV#, PIX, PXB, PHB, NODE, SYS or SOC)"
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiers_and_weights_follow_the_design() {
        assert_eq!(Link::Nv(12).tier(), 2);
        assert_eq!(Link::Nv(12).weight(), 300);
        assert_eq!(Link::Nv(1).weight(), 25);
        assert_eq!((Link::Pix.tier(), Link::Pix.weight()), (1, 12));
        assert_eq!((Link::Pxb.tier(), Link::Pxb.weight()), (1, 10));
        assert_eq!((Link::Phb.tier(), Link::Phb.weight()), (0, 8));
        assert_eq!((Link::Node.tier(), Link::Node.weight()), (0, 6));
        assert_eq!((Link::Sys.tier(), Link::Sys.weight()), (0, 4));
    }

    #[test]
    fn display_and_parse_round_trip() {
        for l in [
            Link::Nv(1),
            Link::Nv(18),
            Link::Pix,
            Link::Pxb,
            Link::Phb,
            Link::Node,
            Link::Sys,
        ] {
            assert_eq!(l.to_string().parse::<Link>().unwrap(), l);
        }
        assert_eq!(Link::Nv(12).to_string(), "NV12");
        assert_eq!(Link::Node.to_string(), "NODE");
        assert_eq!(Link::parse_cell("SOC"), Some(Link::Sys));
        assert_eq!(Link::parse_cell("NV0"), None);
        assert_eq!(Link::parse_cell("NV"), None);
        assert_eq!(Link::parse_cell("X"), None);
        assert!("QPI".parse::<Link>().unwrap_err().0.contains("QPI"));
    }
}
