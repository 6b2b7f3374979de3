//! Deserved shares: how many GPUs of one pool (one GPU type) each queue is owed now.
//!
//! Weighted max-min fairness by water-filling: each queue gets `clamp(weight·λ, lo, hi)`
//! with one λ for all siblings, chosen so the shares add up to the pool (or to what all of
//! them want, when that is less). `hi` is what the queue wants (its GPUs in use plus its
//! waiting tasks' GPUs), capped by `maxGpus`; `lo` is `guaranteedGpus`, but never more than
//! it wants. A queue that wants nothing is owed nothing, so idle queues' shares go to the
//! others (work-conserving). Parents are filled first among the top-level queues, then
//! split among their leaves the same way.

use super::queues::QueueTree;

/// Shares below this are rounding noise.
pub const EPS: f64 = 1e-9;

/// One sibling's claim on a capacity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Claim {
    pub weight: f64,
    /// Owed at least this much (already capped by `hi`).
    pub lo: f64,
    /// Never more than this.
    pub hi: f64,
}

/// Splits `capacity` among `claims` (see the module doc). The result adds up to
/// `min(capacity, Σ hi)`; when even the `lo`s do not fit, they are scaled down alike.
pub fn water_fill(capacity: f64, claims: &[Claim]) -> Vec<f64> {
    let hi: Vec<f64> = claims.iter().map(|c| c.hi.max(0.0)).collect();
    let lo: Vec<f64> = claims.iter().zip(&hi).map(|(c, &h)| c.lo.max(0.0).min(h)).collect();
    let total = capacity.max(0.0).min(hi.iter().sum());
    let lo_sum: f64 = lo.iter().sum();
    if lo_sum >= total {
        let f = if lo_sum > 0.0 { total / lo_sum } else { 0.0 };
        return lo.iter().map(|l| l * f).collect();
    }
    let at = |lambda: f64| -> Vec<f64> {
        claims
            .iter()
            .enumerate()
            .map(|(i, c)| (c.weight * lambda).clamp(lo[i], hi[i]))
            .collect()
    };
    // f(λ) = Σ clamp(w·λ, lo, hi) grows with λ; find f(λ) = total by bisection.
    let mut top = claims
        .iter()
        .zip(&hi)
        .filter(|(c, _)| c.weight > 0.0)
        .map(|(c, h)| h / c.weight)
        .fold(0.0_f64, f64::max);
    let mut bottom = 0.0;
    for _ in 0..100 {
        let mid = (bottom + top) / 2.0;
        if at(mid).iter().sum::<f64>() < total {
            bottom = mid;
        } else {
            top = mid;
        }
    }
    at(top)
}

/// Deserved GPUs of every queue (parents too) for one pool of `capacity` GPUs, given each
/// leaf's `want` (used + waiting). Parents want what their leaves want.
pub fn deserved(tree: &QueueTree, capacity: f64, want: &[f64]) -> Vec<f64> {
    let mut wants = vec![0.0; tree.len()];
    for (i, q) in tree.iter() {
        if q.is_leaf() {
            wants[i] = want.get(i).copied().unwrap_or(0.0);
        }
    }
    for (i, q) in tree.iter() {
        if let Some(p) = q.parent {
            wants[p] += wants[i];
        }
    }
    let claim = |i: usize| {
        let q = tree.get(i);
        let hi = q.max_gpus.map_or(wants[i], |m| wants[i].min(f64::from(m)));
        Claim {
            weight: q.weight,
            lo: f64::from(q.guaranteed_gpus),
            hi,
        }
    };
    let mut out = vec![0.0; tree.len()];
    let top: Vec<usize> = tree.top().collect();
    let shares = water_fill(capacity, &top.iter().map(|&i| claim(i)).collect::<Vec<_>>());
    for (&i, s) in top.iter().zip(shares) {
        out[i] = s;
        let kids = &tree.get(i).children;
        if kids.is_empty() {
            continue;
        }
        let inner = water_fill(s, &kids.iter().map(|&k| claim(k)).collect::<Vec<_>>());
        for (&k, v) in kids.iter().zip(inner) {
            out[k] = v;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::QueueSettings;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn c(weight: f64, lo: f64, hi: f64) -> Claim {
        Claim { weight, lo, hi }
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6)
    }

    #[test]
    fn weights_split_a_contended_pool() {
        let s = water_fill(8.0, &[c(3.0, 0.0, 8.0), c(1.0, 0.0, 8.0)]);
        assert!(close(&s, &[6.0, 2.0]), "{s:?}");
        // One side wants less: the other gets the rest (work-conserving).
        let s = water_fill(8.0, &[c(3.0, 0.0, 3.0), c(1.0, 0.0, 8.0)]);
        assert!(close(&s, &[3.0, 5.0]), "{s:?}");
        // Nobody wants the pool: each gets what it wants.
        let s = water_fill(8.0, &[c(3.0, 0.0, 1.0), c(1.0, 0.0, 2.0)]);
        assert!(close(&s, &[1.0, 2.0]), "{s:?}");
    }

    #[test]
    fn guarantees_and_caps_bound_the_split() {
        // B's guarantee of 4 beats the 3:1 weights.
        let s = water_fill(8.0, &[c(3.0, 0.0, 8.0), c(1.0, 4.0, 8.0)]);
        assert!(close(&s, &[4.0, 4.0]), "{s:?}");
        // A capped at 5 (hi already includes the cap).
        let s = water_fill(8.0, &[c(3.0, 0.0, 5.0), c(1.0, 0.0, 8.0)]);
        assert!(close(&s, &[5.0, 3.0]), "{s:?}");
        // Guarantees that do not fit are scaled down alike.
        let s = water_fill(4.0, &[c(1.0, 4.0, 8.0), c(1.0, 4.0, 8.0)]);
        assert!(close(&s, &[2.0, 2.0]), "{s:?}");
    }

    #[test]
    fn parents_are_split_before_their_leaves() {
        let mut map = BTreeMap::new();
        let mut dept = QueueSettings {
            weight: 3.0,
            ..Default::default()
        };
        dept.queues.insert("a".into(), QueueSettings::default());
        dept.queues.insert(
            "b".into(),
            QueueSettings {
                weight: 2.0,
                ..Default::default()
            },
        );
        map.insert("dept".to_string(), dept);
        map.insert("other".to_string(), QueueSettings::default());
        let t = QueueTree::from_settings(&map).unwrap();
        let idx = |n: &str| t.resolve(Some(n)).unwrap();
        let mut want = vec![0.0; t.len()];
        want[idx("a")] = 100.0;
        want[idx("b")] = 100.0;
        want[idx("other")] = 100.0;
        let d = deserved(&t, 12.0, &want);
        // dept 9, other 3; inside dept a:b = 1:2.
        assert!((d[idx("other")] - 3.0).abs() < 1e-6, "{d:?}");
        assert!(
            (d[idx("a")] - 3.0).abs() < 1e-6 && (d[idx("b")] - 6.0).abs() < 1e-6,
            "{d:?}"
        );
    }

    proptest! {
        /// The split adds up to min(capacity, Σ hi), stays inside [lo', hi] when the lo's
        /// fit, and among queues strictly between their bounds share is proportional to
        /// weight (one λ).
        #[test]
        fn water_fill_is_weighted_max_min(
            cap in 0.0f64..200.0,
            raw in proptest::collection::vec((0.1f64..10.0, 0.0f64..30.0, 0.0f64..60.0), 1..8),
        ) {
            let claims: Vec<Claim> = raw.iter().map(|&(w, lo, hi)| c(w, lo, hi)).collect();
            let s = water_fill(cap, &claims);
            let total: f64 = claims.iter().map(|c| c.hi).sum::<f64>().min(cap);
            prop_assert!((s.iter().sum::<f64>() - total).abs() < 1e-6 * (1.0 + total));
            let lo_sum: f64 = claims.iter().map(|c| c.lo.min(c.hi)).sum();
            for (x, c) in s.iter().zip(&claims) {
                prop_assert!(*x <= c.hi + 1e-6 && *x >= -1e-9);
                if lo_sum <= total {
                    prop_assert!(*x >= c.lo.min(c.hi) - 1e-6);
                }
            }
            if lo_sum < total {
                let free: Vec<f64> = s.iter().zip(&claims)
                    .filter(|(x, c)| **x > c.lo.min(c.hi) + 1e-5 && **x < c.hi - 1e-5)
                    .map(|(x, c)| x / c.weight)
                    .collect();
                for w in free.windows(2) {
                    prop_assert!((w[0] - w[1]).abs() < 1e-4 * (1.0 + w[0]), "{free:?}");
                }
                // Nobody strictly inside its bounds has a lower weighted share than a
                // queue that got more than its floor: max-min.
            }
        }
    }
}
