//! Custom resources (issue 15): named whole-unit quantities a node offers and a task asks
//! for (`nvme: 2`, `ib_hca: 4`), kept and checked exactly like CPU and memory.
//!
//! Owns [`CustomResources`] (name → units, sorted by name, no zero entries) with its
//! saturating arithmetic, and the name rule shared by the job spec, the cluster file, the
//! node agent's `--resource NAME=QTY` and the wire.
//!
//! Units are integers (u64), not hundredths: the things nodes offer this way (NVMe drives,
//! InfiniBand HCAs, licences) are counted, and integers keep the ledger's sums exact.

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

/// Longest resource name.
pub const MAX_NAME_LEN: usize = 63;
/// Most custom resources per node or task.
pub const MAX_RESOURCES: usize = 32;
/// Largest quantity of one resource.
pub const MAX_QUANTITY: u64 = 1 << 40;

/// Names that mean a built-in dimension and so cannot be custom.
const RESERVED: &[&str] = &[
    "cpu",
    "cpus",
    "vcores",
    "memory",
    "memorymb",
    "memory-mb",
    "mem",
    "gpu",
    "gpus",
    "gpumask",
    "ports",
    "port",
];

/// Whether `name` can be a custom resource: 1–63 characters of `A-Za-z0-9_.-`, starting
/// with a letter or digit, not a built-in dimension. `Err` says why and how to fix it.
pub fn check_name(name: &str) -> Result<(), String> {
    let ok_chars = name.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
    if name.is_empty()
        || name.len() > MAX_NAME_LEN
        || !ok_chars
        || !name.starts_with(|c: char| c.is_ascii_alphanumeric())
    {
        return Err(format!(
            "`{name}` is not a resource name: use 1-{MAX_NAME_LEN} characters of A-Z, a-z, 0-9, `_`, `.`, `-`, starting with a letter or digit"
        ));
    }
    if RESERVED.contains(&name.to_ascii_lowercase().as_str()) {
        return Err(format!(
            "`{name}` is a built-in resource, not a custom one: give it with `cpu`, `memoryMB`, `gpu` or `ports`"
        ));
    }
    Ok(())
}

/// Named quantities, sorted by name; a zero quantity is no entry.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CustomResources(Vec<(String, u64)>);

impl CustomResources {
    pub fn new() -> Self {
        CustomResources(Vec::new())
    }

    /// From (name, units) pairs; repeated names add up, zeros are dropped.
    pub fn from_pairs<S: Into<String>>(pairs: impl IntoIterator<Item = (S, u64)>) -> Self {
        let mut c = CustomResources::new();
        for (n, q) in pairs {
            let n = n.into();
            let have = c.get(&n);
            c.set(&n, have.saturating_add(q));
        }
        c
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Units of `name` (0 when absent).
    pub fn get(&self, name: &str) -> u64 {
        match self.0.binary_search_by(|e| e.0.as_str().cmp(name)) {
            Ok(i) => self.0[i].1,
            Err(_) => 0,
        }
    }

    /// Whether `name` is here at all (with at least one unit).
    pub fn has(&self, name: &str) -> bool {
        self.get(name) > 0
    }

    /// Sets `name` to `units` (0 removes it).
    pub fn set(&mut self, name: &str, units: u64) {
        match self.0.binary_search_by(|e| e.0.as_str().cmp(name)) {
            Ok(i) if units == 0 => {
                self.0.remove(i);
            }
            Ok(i) => self.0[i].1 = units,
            Err(_) if units == 0 => {}
            Err(i) => self.0.insert(i, (name.to_string(), units)),
        }
    }

    /// (name, units), by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, u64)> + '_ {
        self.0.iter().map(|(n, q)| (n.as_str(), *q))
    }

    /// `self + other`, per name (saturating).
    pub fn add(&self, other: &CustomResources) -> CustomResources {
        if other.is_empty() {
            return self.clone();
        }
        let mut out = self.clone();
        for (n, q) in other.iter() {
            out.set(n, out.get(n).saturating_add(q));
        }
        out
    }

    /// `self − other`, per name, saturating at zero.
    pub fn subtract(&self, other: &CustomResources) -> CustomResources {
        if other.is_empty() || self.is_empty() {
            return self.clone();
        }
        let mut out = self.clone();
        for (n, q) in other.iter() {
            out.set(n, out.get(n).saturating_sub(q));
        }
        out
    }

    /// The names of which `self` (a request) wants more than `avail` has, in name order.
    pub fn short_in<'a>(&'a self, avail: &'a CustomResources) -> impl Iterator<Item = (&'a str, u64)> + 'a {
        self.iter().filter(move |(n, q)| avail.get(n) < *q)
    }

    /// Whether every unit of `self` is in `avail`.
    pub fn fits_in(&self, avail: &CustomResources) -> bool {
        self.short_in(avail).next().is_none()
    }

    /// `--resource NAME=QTY` flags (node agent, `ray-node-args`); a bad one is named with
    /// its fix.
    pub fn parse_flags(flags: &[String]) -> Result<CustomResources, String> {
        let mut out = CustomResources::new();
        for f in flags {
            let Some((name, qty)) = f.split_once('=') else {
                return Err(format!("--resource `{f}`: write NAME=QTY, e.g. --resource nvme=2"));
            };
            let name = name.trim();
            check_name(name).map_err(|e| format!("--resource `{f}`: {e}"))?;
            let units: u64 = match qty.trim().parse() {
                Ok(u) if u <= MAX_QUANTITY => u,
                _ => {
                    return Err(format!(
                        "--resource `{f}`: `{qty}` is not a whole number of units from 0 to {MAX_QUANTITY}"
                    ))
                }
            };
            if out.has(name) {
                return Err(format!(
                    "--resource `{f}`: `{name}` is given twice; give each resource once"
                ));
            }
            out.set(name, units);
        }
        if out.len() > MAX_RESOURCES {
            return Err(format!(
                "--resource: {} resources; the limit is {MAX_RESOURCES}",
                out.len()
            ));
        }
        Ok(out)
    }

    /// `nvme=1,ib_hca=2`.
    pub fn to_text(&self) -> String {
        self.iter()
            .map(|(n, q)| format!("{n}={q}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Wire form: `{"nvme": 2}`.
impl Serialize for CustomResources {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (n, q) in self.iter() {
            m.serialize_entry(n, &q)?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for CustomResources {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw: Option<std::collections::BTreeMap<String, u64>> = Option::deserialize(d)?;
        let raw = raw.unwrap_or_default();
        if raw.len() > MAX_RESOURCES {
            return Err(de::Error::custom(format!(
                "{} custom resources; the limit is {MAX_RESOURCES}",
                raw.len()
            )));
        }
        for (n, q) in &raw {
            check_name(n).map_err(de::Error::custom)?;
            if *q > MAX_QUANTITY {
                return Err(de::Error::custom(format!(
                    "custom resource `{n}`: {q} is above {MAX_QUANTITY}"
                )));
            }
        }
        Ok(CustomResources::from_pairs(raw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_is_per_name_and_saturating() {
        let node = CustomResources::from_pairs([("nvme", 2), ("ib_hca", 4)]);
        let task = CustomResources::from_pairs([("nvme", 1)]);
        assert!(task.fits_in(&node));
        let used = task.add(&task);
        assert_eq!(node.subtract(&used).get("nvme"), 0);
        assert!(!node.subtract(&used).has("nvme"), "zero is no entry");
        assert_eq!(node.subtract(&used).get("ib_hca"), 4);
        let big = CustomResources::from_pairs([("nvme", 3), ("fpga", 1)]);
        assert_eq!(big.short_in(&node).collect::<Vec<_>>(), vec![("fpga", 1), ("nvme", 3)]);
        assert_eq!(node.to_text(), "ib_hca=4,nvme=2");
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("nvme").is_ok());
        assert!(check_name("ib_hca.v2-x").is_ok());
        for bad in ["", "-x", "a b", "gpu", "CPU", "memoryMB", &"x".repeat(64)] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn wire_form_is_a_map_and_names_are_checked() {
        let c = CustomResources::from_pairs([("nvme", 2)]);
        assert_eq!(serde_json::to_string(&c).unwrap(), r#"{"nvme":2}"#);
        assert_eq!(
            serde_json::from_str::<CustomResources>(r#"{"nvme":2,"x":0}"#).unwrap(),
            c
        );
        assert!(serde_json::from_str::<CustomResources>(r#"{"gpu":1}"#).is_err());
        assert!(serde_json::from_str::<CustomResources>(r#"{"nvme":-1}"#).is_err());
        assert_eq!(
            serde_json::from_str::<CustomResources>("null").unwrap(),
            CustomResources::new()
        );
    }
}
