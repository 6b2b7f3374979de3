//! SVG charts of `gpuam sim --out`, written by hand (no plotting crate): tierIdeal by
//! topology (grouped bars with 95 % whiskers), queueing-delay CDF per policy, the trade-off
//! of topology against delay per run (where one policy trades one for the other), decision
//! time against cluster size (log–log, one line per policy and preset), and, for
//! `--queues`, each queue's share over time against its deserved share.

use super::{ScalingPoint, TopologyRun};

const W: f64 = 760.0;
const H: f64 = 420.0;
const L: f64 = 60.0; // left margin
const B: f64 = 60.0; // bottom margin
const T: f64 = 40.0; // top margin
const R: f64 = 150.0; // right margin (legend)
const COLORS: &[&str] = &[
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn head(title: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" font-size=\"14\" text-anchor=\"middle\">{}</text>\n",
        W / 2.0,
        esc(title)
    )
}

fn legend(names: &[String]) -> String {
    let mut s = String::new();
    for (i, n) in names.iter().enumerate() {
        let y = T + 16.0 * i as f64;
        s.push_str(&format!(
            "<rect x=\"{}\" y=\"{}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{}\" y=\"{}\">{}</text>\n",
            W - R + 10.0,
            y,
            COLORS[i % COLORS.len()],
            W - R + 26.0,
            y + 9.0,
            esc(n)
        ));
    }
    s
}

fn axes(ylabel: &str, xlabel: &str) -> String {
    format!(
        "<line x1=\"{L}\" y1=\"{T}\" x2=\"{L}\" y2=\"{}\" stroke=\"black\"/>\n\
         <line x1=\"{L}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n\
         <text x=\"14\" y=\"{}\" transform=\"rotate(-90 14 {})\" text-anchor=\"middle\">{}</text>\n\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
        H - B,
        H - B,
        W - R,
        H - B,
        (H - B + T) / 2.0,
        (H - B + T) / 2.0,
        esc(ylabel),
        (L + W - R) / 2.0,
        H - 12.0,
        esc(xlabel)
    )
}

/// Grouped bars: tierIdeal per topology and policy, with the 95 % interval as whiskers.
pub fn tier_ideal_bars(runs: &[TopologyRun]) -> String {
    let mut s = head("tierIdeal by topology (mean, 95 % interval over seeds)");
    s.push_str(&axes("tierIdeal", "topology"));
    let names: Vec<String> = runs
        .first()
        .map(|r| r.policies.iter().map(|(n, _)| n.clone()).collect())
        .unwrap_or_default();
    let plot_w = W - R - L;
    let plot_h = H - B - T;
    let y = |v: f64| H - B - v.clamp(0.0, 1.0) * plot_h;
    for i in 0..=5 {
        let v = i as f64 / 5.0;
        s.push_str(&format!(
            "<line x1=\"{}\" y1=\"{y0}\" x2=\"{L}\" y2=\"{y0}\" stroke=\"black\"/><text x=\"{}\" y=\"{}\" text-anchor=\"end\">{v:.1}</text>\n",
            L - 4.0,
            L - 6.0,
            y(v) + 4.0,
            y0 = y(v)
        ));
    }
    let group = plot_w / runs.len().max(1) as f64;
    let bar = group * 0.8 / names.len().max(1) as f64;
    for (gi, r) in runs.iter().enumerate() {
        let gx = L + group * gi as f64 + group * 0.1;
        for (pi, (_, p)) in r.policies.iter().enumerate() {
            let Some(v) = p.get("tierIdeal") else { continue };
            let x = gx + bar * pi as f64;
            s.push_str(&format!(
                "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\"><title>{} {}: {v:.3}</title></rect>\n",
                y(v),
                bar * 0.9,
                H - B - y(v),
                COLORS[pi % COLORS.len()],
                esc(&r.topology),
                esc(&names.get(pi).cloned().unwrap_or_default())
            ));
            if let Some(c) = p.get("tierIdealCi") {
                let cx = x + bar * 0.45;
                s.push_str(&format!(
                    "<line x1=\"{cx:.1}\" y1=\"{:.1}\" x2=\"{cx:.1}\" y2=\"{:.1}\" stroke=\"black\"/>\n",
                    y(v - c),
                    y(v + c)
                ));
            }
        }
        s.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"end\" transform=\"rotate(-30 {:.1} {})\">{}</text>\n",
            gx + group * 0.4,
            H - B + 14.0,
            gx + group * 0.4,
            H - B + 14.0,
            esc(&r.topology)
        ));
    }
    s.push_str(&legend(&names));
    s.push_str("</svg>\n");
    s
}

/// Empirical CDF of queueing delay (all seeds pooled), one line per policy; x is
/// log-scaled seconds (delays below 1 s drawn at 1 s).
pub fn delay_cdf(run: &TopologyRun) -> String {
    let mut s = head(&format!("queueing delay CDF — {}", run.topology));
    s.push_str(&axes("share of jobs", "queueing delay (s, log scale)"));
    let names: Vec<String> = run.policies.iter().map(|(n, _)| n.clone()).collect();
    let max = run
        .policies
        .iter()
        .filter_map(|(_, p)| p.delays.last().copied())
        .fold(1.0f64, f64::max)
        .max(10.0);
    let lmax = max.log10().ceil();
    let plot_w = W - R - L;
    let plot_h = H - B - T;
    let x = |d: f64| L + d.max(1.0).log10() / lmax * plot_w;
    let y = |f: f64| H - B - f * plot_h;
    for e in 0..=lmax as i32 {
        let px = x(10f64.powi(e));
        s.push_str(&format!(
            "<text x=\"{px:.1}\" y=\"{}\" text-anchor=\"middle\">1e{e}</text>\n",
            H - B + 14.0
        ));
    }
    for i in 0..=4 {
        let f = i as f64 / 4.0;
        s.push_str(&format!(
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{f:.2}</text>\n",
            L - 6.0,
            y(f) + 4.0
        ));
    }
    for (pi, (_, p)) in run.policies.iter().enumerate() {
        let n = p.delays.len();
        if n == 0 {
            continue;
        }
        let step = (n / 400).max(1);
        let pts: Vec<String> = (0..n)
            .step_by(step)
            .chain(std::iter::once(n - 1))
            .map(|i| format!("{:.1},{:.1}", x(p.delays[i]), y((i + 1) as f64 / n as f64)))
            .collect();
        s.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"{}\"/>\n",
            COLORS[pi % COLORS.len()],
            pts.join(" ")
        ));
    }
    s.push_str(&legend(&names));
    s.push_str("</svg>\n");
    s
}

/// Decision time p99 against cluster size, log–log, one line per (policy, preset).
pub fn decision_time(points: &[ScalingPoint]) -> String {
    let mut s = head("decision time p99 per call vs cluster size (4-GPU task)");
    s.push_str(&axes("p99 µs (log)", "nodes (log)"));
    let mut series: Vec<(String, Vec<&ScalingPoint>)> = Vec::new();
    for p in points {
        let key = format!("{} {}", p.policy, p.topology);
        match series.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(p),
            None => series.push((key, vec![p])),
        }
    }
    let (nmin, nmax) = points.iter().fold((f64::MAX, 1.0f64), |(a, b), p| {
        (a.min(p.nodes as f64), b.max(p.nodes as f64))
    });
    let (tmin, tmax) = points.iter().fold((f64::MAX, 1.0f64), |(a, b), p| {
        (a.min(p.p99_us.max(0.1)), b.max(p.p99_us))
    });
    let (lx0, lx1) = (
        nmin.max(1.0).log10().floor(),
        nmax.log10().ceil().max(nmin.log10().floor() + 1.0),
    );
    let (ly0, ly1) = (
        tmin.log10().floor(),
        tmax.log10().ceil().max(tmin.log10().floor() + 1.0),
    );
    let plot_w = W - R - L;
    let plot_h = H - B - T;
    let x = |n: f64| L + (n.log10() - lx0) / (lx1 - lx0) * plot_w;
    let y = |t: f64| H - B - (t.max(0.1).log10() - ly0) / (ly1 - ly0) * plot_h;
    for e in lx0 as i32..=lx1 as i32 {
        s.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">1e{e}</text>\n",
            x(10f64.powi(e)),
            H - B + 14.0
        ));
    }
    for e in ly0 as i32..=ly1 as i32 {
        s.push_str(&format!(
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">1e{e}</text>\n",
            L - 6.0,
            y(10f64.powi(e)) + 4.0
        ));
    }
    let names: Vec<String> = series.iter().map(|(k, _)| k.clone()).collect();
    for (i, (_, pts)) in series.iter().enumerate() {
        let line: Vec<String> = pts
            .iter()
            .map(|p| format!("{:.1},{:.1}", x(p.nodes as f64), y(p.p99_us)))
            .collect();
        s.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"{}\"/>\n",
            COLORS[i % COLORS.len()],
            line.join(" ")
        ));
    }
    s.push_str(&legend(&names));
    s.push_str("</svg>\n");
    s
}

/// The trade-off of one run: each policy as a point (mean, with its 95 % intervals as
/// whiskers) of median queueing delay (x) against tierIdeal (left panel) and unionIdeal
/// (right panel). Up and to the left is better; a policy up and to the right of another
/// trades delay for topology. The verdict of [`super::dominance::verdict`] is the subtitle.
pub fn trade_off(run: &TopologyRun) -> String {
    let mut s = head(&format!("trade-off — {}", run.topology));
    s.push_str(&format!(
        "<text x=\"{}\" y=\"36\" text-anchor=\"middle\" font-size=\"10\">{}</text>\n",
        W / 2.0,
        esc(&super::dominance::verdict(run))
    ));
    let names: Vec<String> = run.policies.iter().map(|(n, _)| n.clone()).collect();
    let get = |p: &super::metrics::PolicyResult, m: &str| {
        (p.get(m).unwrap_or(f64::NAN), p.get(&format!("{m}Ci")).unwrap_or(0.0))
    };
    let xmax = run
        .policies
        .iter()
        .map(|(_, p)| {
            let (v, c) = get(p, "queueDelayP50");
            v + c
        })
        .filter(|v| v.is_finite())
        .fold(1.0f64, f64::max)
        * 1.1;
    let gap = 40.0;
    let panel_w = (W - R - L - gap) / 2.0;
    let top = T + 20.0;
    let plot_h = H - B - top;
    for (pi, metric) in ["tierIdeal", "unionIdeal"].into_iter().enumerate() {
        let x0 = L + pi as f64 * (panel_w + gap);
        let (ymin, ymax) = run
            .policies
            .iter()
            .map(|(_, p)| get(p, metric))
            .filter(|(v, _)| v.is_finite())
            .fold((1.0f64, 0.0f64), |(a, b), (v, c)| (a.min(v - c), b.max(v + c)));
        let ymin = (ymin - 0.02).clamp(0.0, 0.98).min(ymax.clamp(0.0, 1.0) - 0.02).max(0.0);
        let ymax = (ymax + 0.005).min(1.0).max(ymin + 0.02);
        let x = |d: f64| x0 + d.max(0.0) / xmax * panel_w;
        let y = |v: f64| H - B - (v.clamp(ymin, ymax) - ymin) / (ymax - ymin) * plot_h;
        s.push_str(&format!(
            "<line x1=\"{x0}\" y1=\"{top}\" x2=\"{x0}\" y2=\"{}\" stroke=\"black\"/>\n\
             <line x1=\"{x0}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n\
             <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{metric} vs median queueing delay (s)</text>\n",
            H - B,
            H - B,
            x0 + panel_w,
            H - B,
            x0 + panel_w / 2.0,
            H - 12.0,
        ));
        for i in 0..=4 {
            let v = ymin + (ymax - ymin) * i as f64 / 4.0;
            s.push_str(&format!(
                "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{v:.3}</text>\n",
                x0 - 4.0,
                y(v) + 4.0
            ));
            let d = xmax * i as f64 / 4.0;
            s.push_str(&format!(
                "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{d:.0}</text>\n",
                x(d),
                H - B + 14.0
            ));
        }
        for (i, (name, p)) in run.policies.iter().enumerate() {
            let (v, vc) = get(p, metric);
            let (d, dc) = get(p, "queueDelayP50");
            if !v.is_finite() || !d.is_finite() {
                continue;
            }
            let color = COLORS[i % COLORS.len()];
            s.push_str(&format!(
                "<line x1=\"{:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"{color}\"/>\n\
                 <line x1=\"{:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"{color}\"/>\n\
                 <circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"4\" fill=\"{color}\"><title>{}: {metric} {v:.3}±{vc:.3}, qP50 {d:.0}±{dc:.0} s</title></circle>\n",
                x(d - dc),
                y(v),
                x(d + dc),
                y(v),
                x(d),
                y(v - vc),
                x(d),
                y(v + vc),
                x(d),
                y(v),
                esc(name),
            ));
        }
    }
    s.push_str(&legend(&names));
    s.push_str("</svg>\n");
    s
}

/// The share-over-time chart: per queue its GPUs in use (solid) and deserved (dashed).
pub fn queue_shares(run: &super::queues::QueueRun, title: &str) -> String {
    // Wider than the other charts: a long time axis, and a legend of two lines per queue.
    const W: f64 = 900.0;
    const R: f64 = 170.0;
    let t_max = run
        .queues
        .iter()
        .filter_map(|s| s.points.last().map(|p| p.0))
        .fold(1.0_f64, f64::max);
    let g = run.cluster_gpus.max(1) as f64;
    let x = |t: f64| L + t / t_max * (W - L - R);
    let y = |v: f64| H - B - (v / g).clamp(0.0, 1.0) * (H - B - T);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" font-size=\"14\" text-anchor=\"middle\">{}</text>\n\
         <line x1=\"{L}\" y1=\"{T}\" x2=\"{L}\" y2=\"{}\" stroke=\"black\"/>\n\
         <line x1=\"{L}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n\
         <text x=\"14\" y=\"{}\" transform=\"rotate(-90 14 {})\" text-anchor=\"middle\">share of the cluster's GPUs</text>\n\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">time (hours)</text>\n",
        (W - R + L) / 2.0,
        title.replace('&', "&amp;").replace('<', "&lt;"),
        H - B,
        H - B,
        W - R,
        H - B,
        (H - B + T) / 2.0,
        (H - B + T) / 2.0,
        (L + W - R) / 2.0,
        H - 12.0
    );
    for i in 0..=4 {
        let v = g * f64::from(i) / 4.0;
        s.push_str(&format!(
            "<line x1=\"{}\" y1=\"{y0:.1}\" x2=\"{}\" y2=\"{y0:.1}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}%</text>\n",
            L,
            W - R,
            L - 6.0,
            y(v) + 4.0,
            25 * i,
            y0 = y(v)
        ));
    }
    for i in 0..=5 {
        let t = t_max * f64::from(i) / 5.0;
        s.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{:.0}</text>\n",
            x(t),
            H - B + 14.0,
            t / 3600.0
        ));
    }
    for (i, q) in run.queues.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        // Step lines, thinned to at most ~600 points.
        let step = (q.points.len() / 600).max(1);
        let pts: Vec<&(f64, f64, f64)> = q.points.iter().step_by(step).collect();
        let line = |f: &dyn Fn(&(f64, f64, f64)) -> f64| -> String {
            let mut out = Vec::with_capacity(pts.len() * 2);
            for w in pts.windows(2) {
                out.push(format!("{:.1},{:.1}", x(w[0].0), y(f(w[0]))));
                out.push(format!("{:.1},{:.1}", x(w[1].0), y(f(w[0]))));
            }
            out.join(" ")
        };
        s.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"1.4\" points=\"{}\"/>\n",
            line(&|p| p.1)
        ));
        s.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"1.4\" stroke-dasharray=\"5,3\" points=\"{}\"/>\n",
            line(&|p| p.2)
        ));
        let ly = T + 34.0 * i as f64;
        s.push_str(&format!(
            "<line x1=\"{}\" y1=\"{ly}\" x2=\"{}\" y2=\"{ly}\" stroke=\"{c}\" stroke-width=\"2\"/><text x=\"{}\" y=\"{}\">{} used</text>\n\
             <line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{c}\" stroke-width=\"2\" stroke-dasharray=\"5,3\"/><text x=\"{}\" y=\"{}\">{} deserved (w {})</text>\n",
            W - R + 10.0,
            W - R + 30.0,
            W - R + 34.0,
            ly + 4.0,
            q.name,
            W - R + 10.0,
            ly + 14.0,
            W - R + 30.0,
            ly + 14.0,
            W - R + 34.0,
            ly + 18.0,
            q.name,
            q.weight
        ));
    }
    s.push_str("</svg>\n");
    s
}
