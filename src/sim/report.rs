//! Output of `gpuam sim`: the readable table (with the domination verdict of each run), the
//! JSON object (`--json`, and `results.json`), `results.csv`, and the SVG charts under
//! `--out` (among them `trade_off_<run>.svg`: topology against delay, per policy).

use std::path::Path;

use serde_json::{json, Map, Value};

use super::metrics::METRICS;
use super::{charts, dominance};
use super::{ScalingPoint, SimOptions, TopologyRun};

fn policies_json(run: &TopologyRun) -> Value {
    let mut m = Map::new();
    for (name, r) in &run.policies {
        m.insert(name.clone(), serde_json::to_value(r).unwrap_or(Value::Null));
    }
    Value::Object(m)
}

/// The JSON object: `{"policies": {...}}` for one topology, `{"topologies": {label:
/// {"policies": ...}}}` for several; plus the run parameters and the scaling points.
pub fn to_json(opts: &SimOptions, runs: &[TopologyRun], scaling: &[ScalingPoint]) -> Value {
    let mut top = Map::new();
    top.insert("workload".into(), json!(opts.workload));
    top.insert("seeds".into(), json!(opts.seeds));
    top.insert("load".into(), json!(opts.load));
    top.insert("mix".into(), json!(opts.mix));
    top.insert("queueing".into(), queueing_json(opts));
    if runs.len() == 1 {
        let r = &runs[0];
        top.insert("topology".into(), json!(r.topology));
        top.insert(
            "cluster".into(),
            serde_json::to_value(&r.cluster).unwrap_or(Value::Null),
        );
        top.insert("jobs".into(), json!(r.jobs));
        top.insert("policies".into(), policies_json(r));
    } else {
        let mut t = Map::new();
        for r in runs {
            t.insert(
                r.topology.clone(),
                json!({
                    "cluster": r.cluster,
                    "jobs": r.jobs,
                    "policies": policies_json(r),
                }),
            );
        }
        top.insert("topologies".into(), Value::Object(t));
    }
    if !scaling.is_empty() {
        top.insert("scaling".into(), serde_json::to_value(scaling).unwrap_or(Value::Null));
    }
    Value::Object(top)
}

/// The queueing discipline of the run (issue 27): `fifo`, `backfill`, or `backfill` with the
/// reservation policy; the expected durations; the big-gang size.
fn queueing_json(opts: &SimOptions) -> Value {
    let q = &opts.queueing;
    json!({
        "discipline": if q.backfill { "backfill" } else { "fifo" },
        "reserveWaitSec": q.reserve.filter(|p| p.wait_bound_ms != u64::MAX).map(|p| p.wait_bound_ms / 1000),
        "reserveMinGpus": q.reserve.filter(|p| p.min_gpus != u32::MAX).map(|p| p.min_gpus),
        "expectedEnd": q.limit.to_string(),
        "bigGpus": q.big_gpus,
        "runLimits": q.run_limits.map(|(lo, hi)| if lo == hi { format!("{lo}") } else { format!("{lo}-{hi}") }),
    })
}

fn queueing_label(opts: &SimOptions) -> String {
    let q = &opts.queueing;
    let mut s = String::from(if q.backfill { "backfill" } else { "fifo" });
    if let Some(p) = q.reserve {
        let mut parts = Vec::new();
        if p.wait_bound_ms != u64::MAX {
            parts.push(format!("waited ≥ {} s", p.wait_bound_ms / 1000));
        }
        if p.min_gpus != u32::MAX {
            parts.push(format!("≥ {} GPUs", p.min_gpus));
        }
        s.push_str(&format!(" + reservation ({})", parts.join(" or ")));
    }
    s.push_str(&format!(" | expected ends {}", q.limit));
    if let Some((lo, hi)) = q.run_limits {
        s.push_str(&format!(" | jobs declare run limits × {lo}–{hi}"));
    }
    s
}

fn fmt(v: Option<f64>, prec: usize) -> String {
    match v {
        Some(x) => format!("{x:.prec$}"),
        None => "-".into(),
    }
}

fn pm(r: &super::metrics::PolicyResult, m: &str, prec: usize) -> String {
    match (r.get(m), r.get(&format!("{m}Ci"))) {
        (Some(v), Some(c)) => format!("{v:.prec$}±{c:.prec$}"),
        (Some(v), None) => format!("{v:.prec$}"),
        _ => "-".into(),
    }
}

/// The readable table.
pub fn to_table(opts: &SimOptions, runs: &[TopologyRun], scaling: &[ScalingPoint]) -> String {
    let mut s = String::new();
    for r in runs {
        s.push_str(&format!(
            "\n== {} | workload {} | {} nodes, {} GPUs, {} racks | {} jobs × {} seeds | load {} | mix {} | gpuam topology wait {} s\n",
            r.topology,
            opts.workload,
            r.cluster.nodes,
            r.cluster.gpus,
            r.cluster.racks,
            r.jobs,
            opts.seeds,
            opts.load,
            opts.mix,
            opts.topology_wait_sec
        ));
        s.push_str(&format!(
            "{:<11} {:>13} {:>13} {:>13} {:>13} {:>11} {:>11} {:>12} {:>10} {:>7} {:>8} {:>8} {:>6} {:>6}\n",
            "policy",
            "tierIdeal",
            "unionIdeal",
            "tierAvail",
            "wRatio",
            "nodesOver",
            "racksOver",
            "qP50 s",
            "qP95 s",
            "util",
            "dP50 µs",
            "dP99 µs",
            "fb/inv",
            "mixed"
        ));
        for (name, p) in &r.policies {
            s.push_str(&format!(
                "{:<11} {:>13} {:>13} {:>13} {:>13} {:>11} {:>11} {:>12} {:>10} {:>7} {:>8} {:>8} {:>6} {:>6}\n",
                name,
                pm(p, "tierIdeal", 3),
                pm(p, "unionIdeal", 3),
                pm(p, "tierAvail", 3),
                pm(p, "wRatio", 3),
                fmt(p.get("nodesOverMin"), 3),
                fmt(p.get("racksOverMin"), 3),
                pm(p, "queueDelayP50", 0),
                fmt(p.get("queueDelayP95"), 0),
                fmt(p.get("utilization"), 3),
                fmt(p.get("decisionP50Us"), 1),
                fmt(p.get("decisionP99Us"), 1),
                format!("{}/{}", fmt(p.get("fallbacks"), 0), fmt(p.get("invalid"), 0)),
                fmt(p.get("mixedTypeGangs"), 1),
            ));
        }
        s.push_str(&format!(
            "-- {} | big = gangs ≥ {} GPUs, small = one task below that; estimate = start estimated at submit\n",
            queueing_label(opts),
            opts.queueing.big_gpus
        ));
        s.push_str(&format!(
            "{:<11} {:>14} {:>7} {:>14} {:>12} {:>12} {:>12}\n",
            "policy", "bigWaitP95 s", "big n", "smallWaitP50 s", "estErrP50 s", "estRelErrP50", "estWithin20%"
        ));
        for (name, p) in &r.policies {
            s.push_str(&format!(
                "{:<11} {:>14} {:>7} {:>14} {:>12} {:>12} {:>12}\n",
                name,
                pm(p, "bigWaitP95", 0),
                fmt(p.get("bigJobs"), 0),
                pm(p, "smallWaitP50", 0),
                pm(p, "estimateErrP50", 0),
                pm(p, "estimateRelErrP50", 2),
                pm(p, "estimateWithin20", 2),
            ));
        }
        let verdict = dominance::verdict(r);
        if !verdict.is_empty() {
            s.push_str(&format!("{verdict}\n"));
        }
    }
    if !scaling.is_empty() {
        s.push_str("\n== decision time per call, 4-GPU task, half-used cluster (µs)\n");
        s.push_str(&format!(
            "{:<8} {:>7} {:<11} {:>10} {:>10} {:>10}\n",
            "preset", "nodes", "policy", "p50", "p99", "first"
        ));
        for p in scaling {
            s.push_str(&format!(
                "{:<8} {:>7} {:<11} {:>10.1} {:>10.1} {:>10.1}\n",
                p.topology, p.nodes, p.policy, p.p50_us, p.p99_us, p.first_us
            ));
        }
    }
    s
}

/// `results.csv`: one row per (topology, policy), every metric and its half-width.
pub fn to_csv(runs: &[TopologyRun]) -> String {
    let mut s = String::from("topology,policy");
    for m in METRICS {
        s.push_str(&format!(",{m},{m}Ci"));
    }
    s.push('\n');
    for r in runs {
        for (name, p) in &r.policies {
            s.push_str(&format!("{},{}", r.topology, name));
            for m in METRICS {
                let f = |v: Option<f64>| v.map(|x| format!("{x}")).unwrap_or_default();
                s.push_str(&format!(",{},{}", f(p.get(m)), f(p.get(&format!("{m}Ci")))));
            }
            s.push('\n');
        }
    }
    s
}

fn write(dir: &Path, name: &str, text: &str) -> Result<(), String> {
    let p = dir.join(name);
    std::fs::write(&p, text).map_err(|e| format!("cannot write {}: {e}", p.display()))
}

fn write_out(dir: &Path, opts: &SimOptions, runs: &[TopologyRun], scaling: &[ScalingPoint]) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create --out {}: {e}", dir.display()))?;
    let j = to_json(opts, runs, scaling);
    write(
        dir,
        "results.json",
        &serde_json::to_string_pretty(&j).map_err(|e| e.to_string())?,
    )?;
    write(dir, "results.csv", &to_csv(runs))?;
    write(dir, "tier_ideal.svg", &charts::tier_ideal_bars(runs))?;
    for r in runs {
        let safe: String = r
            .topology
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' })
            .collect();
        write(dir, &format!("queue_delay_cdf_{safe}.svg"), &charts::delay_cdf(r))?;
        write(dir, &format!("trade_off_{safe}.svg"), &charts::trade_off(r))?;
    }
    if !scaling.is_empty() {
        write(dir, "decision_time.svg", &charts::decision_time(scaling))?;
    }
    Ok(())
}

/// Prints the results and writes `--out`.
pub fn emit(
    opts: &SimOptions,
    runs: &[TopologyRun],
    scaling: &[ScalingPoint],
    elapsed_s: f64,
) -> Result<(), super::SimError> {
    if opts.json {
        println!("{}", to_json(opts, runs, scaling));
    } else {
        print!("{}", to_table(opts, runs, scaling));
        println!("\n(simulated in {elapsed_s:.1} s; ± = 95 % interval over seeds; fb/inv = besteffort fallbacks / padded-set cases)");
    }
    if let Some(dir) = &opts.out {
        write_out(dir, opts, runs, scaling).map_err(super::SimError::Output)?;
    }
    Ok(())
}
