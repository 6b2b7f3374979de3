//! The hash of the maps the select pipeline fills per call: foldhash's fast hasher with a
//! fixed seed (the same order run after run). Keys are host/rack names and GPU masks from
//! our own view, so SipHash's protection against chosen keys buys nothing and costs time at
//! 10,000 nodes.
//!
//! It replaced a hand-written Fx hash whose low bits, which pick a hash table's slot, barely
//! changed between names that differ only at their end (`/rack001`, `/rack002`, ...): the
//! racks of a 10,000-node view crowded into a few slots, and interning them took a tenth of
//! an AM's start (issue 29).

use std::collections::{HashMap, HashSet};

pub use foldhash::fast::FixedState as FastState;

pub type FastMap<K, V> = HashMap<K, V, FastState>;
pub type FastSet<K> = HashSet<K, FastState>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    /// Names that differ only in their last characters spread over a table's slots: the low
    /// bits of their hashes take many values (the old hash gave such names a few dozen).
    #[test]
    fn names_that_differ_at_their_end_spread_over_the_low_bits() {
        let s = FastState::default();
        for names in [
            (0..1024).map(|i| format!("/rack{i:03}")).collect::<Vec<_>>(),
            (0..1024).map(|i| format!("node{i:05}")).collect(),
        ] {
            let low: HashSet<u64> = names.iter().map(|n| s.hash_one(n.as_str()) & 1023).collect();
            assert!(low.len() > 500, "{} distinct low 10 bits of 1,024 names", low.len());
        }
    }
}
