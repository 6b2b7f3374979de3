//! Port sets as sorted, coalesced lists of closed ranges.
//!
//! This is the original's `ValueRange`/`ValueRangeUtils`, made a value type whose
//! invariant (sorted, disjoint, non-adjacent) holds by construction, so no caller has
//! to remember to coalesce. Its known faults are fixed: the random sub-range is
//! unbiased over the ports at or above the minimum, never returns a partial answer,
//! and works for any input order.

use std::fmt;

use rand::Rng;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A closed range `[begin, end]` of ports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortRange {
    pub begin: u16,
    pub end: u16,
}

impl PortRange {
    pub fn new(begin: u16, end: u16) -> Self {
        debug_assert!(begin <= end);
        PortRange { begin, end }
    }

    /// Number of ports in the range (never zero: a range holds at least `begin`).
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> u32 {
        u32::from(self.end) - u32::from(self.begin) + 1
    }
}

/// A set of ports, stored as sorted, disjoint, non-adjacent closed ranges.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PortSet {
    ranges: Vec<PortRange>,
}

/// Why a port-range string could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid port range `{text}`: {why} (write ranges like \"20000-29999,31000\")")]
pub struct PortParseError {
    pub text: String,
    pub why: String,
}

impl PortSet {
    pub fn new() -> Self {
        PortSet::default()
    }

    /// Builds a set from ranges in any order, merging overlaps and neighbours.
    pub fn from_ranges<I: IntoIterator<Item = PortRange>>(ranges: I) -> Self {
        let mut v: Vec<PortRange> = ranges.into_iter().collect();
        v.sort_unstable();
        let mut out: Vec<PortRange> = Vec::with_capacity(v.len());
        for r in v {
            match out.last_mut() {
                Some(last) if u32::from(r.begin) <= u32::from(last.end) + 1 => {
                    last.end = last.end.max(r.end);
                }
                _ => out.push(r),
            }
        }
        PortSet { ranges: out }
    }

    pub fn range(begin: u16, end: u16) -> Self {
        PortSet {
            ranges: vec![PortRange::new(begin, end)],
        }
    }

    pub fn from_ports<I: IntoIterator<Item = u16>>(ports: I) -> Self {
        PortSet::from_ranges(ports.into_iter().map(|p| PortRange::new(p, p)))
    }

    /// Parses `"20000-29999,31000"`; an empty or blank string is the empty set.
    pub fn parse(text: &str) -> Result<Self, PortParseError> {
        let err = |why: String| PortParseError {
            text: text.to_string(),
            why,
        };
        let mut ranges = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (a, b) = match part.split_once('-') {
                Some((a, b)) => (a.trim(), b.trim()),
                None => (part, part),
            };
            let a: u16 = a
                .parse()
                .map_err(|_| err(format!("`{a}` is not a port number (0-65535)")))?;
            let b: u16 = b
                .parse()
                .map_err(|_| err(format!("`{b}` is not a port number (0-65535)")))?;
            if a > b {
                return Err(err(format!("range {a}-{b} ends before it begins")));
            }
            ranges.push(PortRange::new(a, b));
        }
        Ok(PortSet::from_ranges(ranges))
    }

    pub fn ranges(&self) -> &[PortRange] {
        &self.ranges
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Number of ports in the set.
    pub fn count(&self) -> u32 {
        self.ranges.iter().map(PortRange::len).sum()
    }

    pub fn contains(&self, port: u16) -> bool {
        // Ranges are sorted: binary search by end.
        let i = self.ranges.partition_point(|r| r.end < port);
        self.ranges.get(i).is_some_and(|r| r.begin <= port)
    }

    /// Every port of `self` is in `other`.
    pub fn is_subset(&self, other: &PortSet) -> bool {
        let mut j = 0;
        for r in &self.ranges {
            while j < other.ranges.len() && other.ranges[j].end < r.begin {
                j += 1;
            }
            match other.ranges.get(j) {
                Some(o) if o.begin <= r.begin && r.end <= o.end => {}
                _ => return false,
            }
        }
        true
    }

    pub fn union(&self, other: &PortSet) -> PortSet {
        PortSet::from_ranges(self.ranges.iter().chain(other.ranges.iter()).copied())
    }

    pub fn intersect(&self, other: &PortSet) -> PortSet {
        let (a, b) = (&self.ranges, &other.ranges);
        let (mut i, mut j) = (0, 0);
        let mut out = Vec::new();
        while i < a.len() && j < b.len() {
            let lo = a[i].begin.max(b[j].begin);
            let hi = a[i].end.min(b[j].end);
            if lo <= hi {
                out.push(PortRange::new(lo, hi));
            }
            if a[i].end < b[j].end {
                i += 1;
            } else {
                j += 1;
            }
        }
        PortSet { ranges: out }
    }

    pub fn intersects(&self, other: &PortSet) -> bool {
        let (a, b) = (&self.ranges, &other.ranges);
        let (mut i, mut j) = (0, 0);
        while i < a.len() && j < b.len() {
            if a[i].begin.max(b[j].begin) <= a[i].end.min(b[j].end) {
                return true;
            }
            if a[i].end < b[j].end {
                i += 1;
            } else {
                j += 1;
            }
        }
        false
    }

    pub fn subtract(&self, other: &PortSet) -> PortSet {
        let mut out = Vec::with_capacity(self.ranges.len());
        let mut j = 0;
        for r in &self.ranges {
            let mut begin = u32::from(r.begin);
            let end = u32::from(r.end);
            while j < other.ranges.len() && u32::from(other.ranges[j].end) < begin {
                j += 1;
            }
            let mut k = j;
            while begin <= end {
                match other.ranges.get(k) {
                    Some(o) if u32::from(o.begin) <= end => {
                        if u32::from(o.begin) > begin {
                            out.push(PortRange::new(begin as u16, (u32::from(o.begin) - 1) as u16));
                        }
                        begin = u32::from(o.end) + 1;
                        k += 1;
                    }
                    _ => {
                        out.push(PortRange::new(begin as u16, end as u16));
                        break;
                    }
                }
            }
        }
        PortSet { ranges: out }
    }

    /// The ports in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = u16> + '_ {
        self.ranges.iter().flat_map(|r| r.begin..=r.end)
    }

    /// Number of ports `>= min`, without building the restricted set.
    pub fn count_at_least(&self, min: u16) -> u32 {
        self.ranges
            .iter()
            .filter(|r| r.end >= min)
            .map(|r| u32::from(r.end) - u32::from(r.begin.max(min)) + 1)
            .sum()
    }

    /// The set restricted to ports `>= min`.
    pub fn at_least(&self, min: u16) -> PortSet {
        if min == 0 {
            return self.clone();
        }
        self.intersect(&PortSet::range(min, u16::MAX))
    }

    /// The `k` lowest ports `>= min`, or `None` if there are fewer than `k`.
    pub fn lowest(&self, k: u32, min: u16) -> Option<PortSet> {
        let ports: Vec<u16> = self.at_least(min).iter().take(k as usize).collect();
        (ports.len() == k as usize).then(|| PortSet::from_ports(ports))
    }

    /// `k` ports `>= min`, taken as one contiguous run from a uniformly random start
    /// where such a run exists, else as the `k` ports that follow a random start
    /// (wrapping around). `None` when fewer than `k` ports are available: never a
    /// partial answer.
    pub fn random_subset<R: Rng + ?Sized>(&self, k: u32, min: u16, rng: &mut R) -> Option<PortSet> {
        if k == 0 {
            return Some(PortSet::new());
        }
        let pool = self.at_least(min);
        let total = pool.count();
        if total < k {
            return None;
        }
        // Starts of contiguous runs of length k: each range of length L offers L-k+1.
        let runs: u32 = pool.ranges.iter().map(|r| r.len().saturating_sub(k - 1)).sum();
        if runs > 0 {
            let mut pick = rng.gen_range(0..runs);
            for r in &pool.ranges {
                let starts = r.len().saturating_sub(k - 1);
                if pick < starts {
                    let b = u32::from(r.begin) + pick;
                    return Some(PortSet::range(b as u16, (b + k - 1) as u16));
                }
                pick -= starts;
            }
        }
        // Fragmented: k ports in order from a random position, wrapping around.
        let start = rng.gen_range(0..total) as usize;
        let all: Vec<u16> = pool.iter().collect();
        let chosen = (0..k as usize).map(|i| all[(start + i) % all.len()]);
        Some(PortSet::from_ports(chosen))
    }
}

impl fmt::Display for PortSet {
    /// `"20000-29999,31000"`; the empty set is `""`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.ranges.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            if r.begin == r.end {
                write!(f, "{}", r.begin)?;
            } else {
                write!(f, "{}-{}", r.begin, r.end)?;
            }
        }
        Ok(())
    }
}

impl Serialize for PortSet {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for PortSet {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = Option::<String>::deserialize(d)?.unwrap_or_default();
        PortSet::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn ps(s: &str) -> PortSet {
        PortSet::parse(s).unwrap()
    }

    #[test]
    fn coalesce_matches_original_examples() {
        assert_eq!(ps("6-7,10-100,3-5,90-102").to_string(), "3-7,10-102");
        assert_eq!(
            ps("80,80-81,100-103").iter().collect::<Vec<_>>(),
            vec![80, 81, 100, 101, 102, 103]
        );
    }

    #[test]
    fn intersect_subtract_add_match_original_examples() {
        let a = ps("3-7,10-102");
        let b = ps("2-3,7-8,10-20");
        assert_eq!(a.intersect(&b).to_string(), "3,7,10-20");
        assert_eq!(a.subtract(&b).to_string(), "4-6,21-102");
        assert_eq!(a.subtract(&ps("80")).to_string(), "3-7,10-79,81-102");
        assert_eq!(ps("6-7,10-100,3-5,90-102").union(&b).to_string(), "2-8,10-102");
    }

    #[test]
    fn subset_and_contains() {
        let big = ps("20000-29999,31000");
        assert!(ps("20000,29999,31000").is_subset(&big));
        assert!(!ps("30000").is_subset(&big));
        assert!(PortSet::new().is_subset(&big));
        assert!(!ps("1").is_subset(&PortSet::new()));
        assert!(big.contains(31000) && !big.contains(30000));
    }

    #[test]
    fn parse_errors_name_the_problem() {
        let e = PortSet::parse("9-3").unwrap_err();
        assert!(e.to_string().contains("ends before it begins"), "{e}");
        let e = PortSet::parse("70000").unwrap_err();
        assert!(e.to_string().contains("not a port number"), "{e}");
        assert!(PortSet::parse("").unwrap().is_empty());
    }

    #[test]
    fn random_subset_respects_min_and_never_partial() {
        let mut rng = StdRng::seed_from_u64(7);
        let avail = ps("1000-1010,5000-5001");
        for _ in 0..200 {
            let s = avail.random_subset(3, 1005, &mut rng).unwrap();
            assert_eq!(s.count(), 3);
            assert!(s.is_subset(&avail));
            assert!(s.iter().all(|p| p >= 1005));
        }
        assert!(avail.random_subset(20, 0, &mut rng).is_none());
        assert!(avail.random_subset(1, 6000, &mut rng).is_none());
        // Fragmented pool: no run of 3, still 3 distinct ports.
        let frag = ps("1,3,5,7");
        let s = frag.random_subset(3, 0, &mut rng).unwrap();
        assert_eq!(s.count(), 3);
        assert!(s.is_subset(&frag));
    }

    fn arb_set() -> impl Strategy<Value = PortSet> {
        prop::collection::vec((0u16..300, 0u16..20), 0..8)
            .prop_map(|v| PortSet::from_ranges(v.into_iter().map(|(b, l)| PortRange::new(b, b + l))))
    }

    fn naive(s: &PortSet) -> std::collections::BTreeSet<u16> {
        s.iter().collect()
    }

    proptest! {
        #[test]
        fn set_algebra_matches_naive_sets(a in arb_set(), b in arb_set()) {
            let (na, nb) = (naive(&a), naive(&b));
            prop_assert_eq!(naive(&a.union(&b)), na.union(&nb).copied().collect());
            prop_assert_eq!(naive(&a.intersect(&b)), na.intersection(&nb).copied().collect());
            prop_assert_eq!(naive(&a.subtract(&b)), na.difference(&nb).copied().collect());
            prop_assert_eq!(a.is_subset(&b), na.is_subset(&nb));
            prop_assert_eq!(a.intersects(&b), !na.is_disjoint(&nb));
            prop_assert_eq!(a.count() as usize, na.len());
            prop_assert_eq!(a.count_at_least(150) as usize, na.iter().filter(|p| **p >= 150).count());
            // Canonical form: sorted, disjoint, non-adjacent.
            for w in a.union(&b).ranges().windows(2) {
                prop_assert!(u32::from(w[0].end) + 1 < u32::from(w[1].begin));
            }
            prop_assert_eq!(PortSet::parse(&a.to_string()).unwrap(), a);
        }

        #[test]
        fn random_subset_has_exactly_k_ports_inside(a in arb_set(), k in 0u32..10, min in 0u16..200, seed in any::<u64>()) {
            let mut rng = StdRng::seed_from_u64(seed);
            match a.random_subset(k, min, &mut rng) {
                Some(s) => {
                    prop_assert_eq!(s.count(), k);
                    prop_assert!(s.is_subset(&a));
                    prop_assert!(s.iter().all(|p| p >= min));
                }
                None => prop_assert!(a.at_least(min).count() < k),
            }
        }
    }
}
