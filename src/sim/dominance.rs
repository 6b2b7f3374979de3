//! Whether `gpuam` dominates the other policies of one run: at or above the best of them on
//! tierIdeal and unionIdeal and at or below on the median and 95th-percentile queueing delay,
//! all at once (issues 13, 27), and where not, which policy beats it on which metric and whether the gap lies
//! within the 95 % intervals (of the paired per-seed difference where the seeds are known:
//! every policy replays the same streams). The table prints the verdict; the trade-off chart
//! draws it.

use super::TopologyRun;

/// The metrics domination is judged on: (key, higher is better, table label).
pub const JUDGED: &[(&str, bool, &str)] = &[
    ("tierIdeal", true, "tierIdeal"),
    ("unionIdeal", true, "unionIdeal"),
    ("queueDelayP50", false, "qP50"),
    ("queueDelayP95", false, "qP95"),
];

/// One metric on which another policy's mean beats gpuam's.
#[derive(Clone, Debug, PartialEq)]
pub struct Loss {
    pub policy: String,
    pub metric: &'static str,
    /// (mean, 95 % half-width) of gpuam and of the other policy.
    pub gpuam: (f64, f64),
    pub other: (f64, f64),
    /// The gap is not significant over these seeds: the 95 % interval of the paired
    /// per-seed difference (other − gpuam) holds 0, or, without per-seed values, the two
    /// intervals overlap.
    pub within: bool,
    /// The paired per-seed difference other − gpuam (mean, 95 % half-width), when known.
    pub paired: Option<(f64, f64)>,
}

/// Every (policy, metric) where another policy's mean is better than gpuam's (means are
/// compared at the table's precision: 3 decimals, delays to the second). Empty = gpuam
/// dominates. No gpuam in the run, or a metric it lacks: nothing to judge there.
pub fn losses(run: &TopologyRun) -> Vec<Loss> {
    let Some((_, g)) = run.policies.iter().find(|(n, _)| n == "gpuam") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for &(metric, higher, label) in JUDGED {
        let Some(gv) = g.get(metric) else { continue };
        let gc = g.get(&format!("{metric}Ci")).unwrap_or(0.0);
        let round = |v: f64| if higher { (v * 1000.0).round() } else { v.round() };
        for (name, p) in run.policies.iter().filter(|(n, _)| n != "gpuam") {
            let Some(pv) = p.get(metric) else { continue };
            let pc = p.get(&format!("{metric}Ci")).unwrap_or(0.0);
            let better = if higher {
                round(pv) > round(gv)
            } else {
                round(pv) < round(gv)
            };
            if better {
                let paired = g.paired(p, metric);
                let within = match paired {
                    Some((d, c)) => d.abs() <= c,
                    None if higher => gv + gc >= pv - pc,
                    None => gv - gc <= pv + pc,
                };
                out.push(Loss {
                    policy: name.clone(),
                    metric: label,
                    gpuam: (gv, gc),
                    other: (pv, pc),
                    within,
                    paired,
                });
            }
        }
    }
    out
}

/// One line for the table.
pub fn verdict(run: &TopologyRun) -> String {
    if !run.policies.iter().any(|(n, _)| n == "gpuam") {
        return String::new();
    }
    let l = losses(run);
    if l.is_empty() {
        return "gpuam dominates: at or above every other policy on tierIdeal and unionIdeal, at or below on qP50 and qP95"
            .into();
    }
    let parts: Vec<String> = l
        .iter()
        .map(|x| {
            let prec = if x.metric.starts_with('q') { 0 } else { 3 };
            let paired = x
                .paired
                .map(|(d, c)| format!(", paired difference {d:+.prec$}±{c:.prec$}"))
                .unwrap_or_default();
            format!(
                "{} {} {:.prec$}±{:.prec$} vs gpuam {:.prec$}±{:.prec$}{}{}",
                x.policy,
                x.metric,
                x.other.0,
                x.other.1,
                x.gpuam.0,
                x.gpuam.1,
                paired,
                if x.within {
                    " (within the intervals)"
                } else {
                    " (outside the intervals)"
                }
            )
        })
        .collect();
    format!("gpuam does not dominate: {}", parts.join("; "))
}
