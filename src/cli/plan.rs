//! `gpuam validate` and `gpuam plan`: the job read and explained; the plan (the AM's own job
//! machine run against an in-memory RM, `am::plan_rm`) printed as the table or the JSON of
//! DESIGN.md §7.

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::config::Settings;
use crate::exit;
use crate::select::JobPlan;

pub fn validate(job: &Path) -> i32 {
    match super::load_job(job) {
        Ok((j, _)) => {
            println!(
                "ok: job `{}`: {} task role(s), {} task(s){}",
                j.name,
                j.task_roles.len(),
                j.total_tasks(),
                if j.gang { ", gang" } else { "" }
            );
            for r in &j.task_roles {
                println!(
                    "  {}: {} × {}",
                    r.name,
                    r.instances,
                    describe_resources(&r.resources, j.format)
                );
            }
            exit::SUCCESS
        }
        Err(code) => code,
    }
}

/// One role's per-task resources as `validate` explains them: GPUs whole or a share of
/// one GPU (gpuam's own format; OpenPAI protocol v2 counts whole GPUs), custom resources.
pub fn describe_resources(r: &crate::spec::TaskResources, format: crate::spec::SpecFormat) -> String {
    let gpus = match (r.gpu_share, format) {
        (Some(h), _) => format!(
            "gpu {} (a share of one GPU; it shares the GPU with other shares up to 1.0)",
            crate::resources::format_hundredths(h)
        ),
        (None, crate::spec::SpecFormat::PaiV2) => format!("gpu {} (whole GPUs: OpenPAI protocol v2)", r.gpus),
        (None, _) => format!("gpu {} (whole GPUs)", r.gpus),
    };
    let mut out = format!("cpu {}, memoryMB {}, {gpus}", r.cpu, r.memory_mb);
    if !r.custom.is_empty() {
        out.push_str(&format!(", resources {}", r.custom.to_text()));
    }
    out
}

pub async fn plan(
    job: &Path,
    cluster: Option<&Path>,
    rm: Option<&str>,
    token: Option<String>,
    as_json: bool,
    settings: &Settings,
) -> i32 {
    let (spec, _) = match super::load_job(job) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let mut client = None;
    let nodes = match rm {
        Some(url) => {
            let c = match crate::am::rm_client::RmClient::with_tls(url, &settings.tls) {
                Ok(c) => c.with_user_token(token),
                Err(e) => {
                    eprintln!("error: TLS: {e}");
                    return exit::INVALID_INPUT;
                }
            };
            let nodes = match c.nodes().await {
                Ok(n) => n,
                Err(e) => return super::run::refused(&c, &e),
            };
            client = Some(c);
            nodes
        }
        None => match super::load_cluster(cluster) {
            Ok(n) => n,
            Err(code) => return code,
        },
    };
    let mut select = settings.select.clone();
    // A plan is reproducible: the same inputs give the same answer.
    select.seed = Some(select.seed.unwrap_or(0));
    // The AM's own job machine, run against an RM that grants every ask as asked.
    let plan = crate::am::plan_rm::plan_job(&spec, nodes, select.clone(), &settings.am);
    // Against a running RM: when the job would start if submitted now (issue 27).
    let estimate = match &client {
        Some(c) => start_estimate(c, &spec, &select).await,
        None => None,
    };
    if as_json {
        let mut v = plan_json(&plan);
        if let Some(e) = &estimate {
            v["startEstimate"] = json!(e);
        }
        println!("{v}");
    } else {
        super::emit(&plan_table(&spec.name, &plan));
        if let Some(e) = &estimate {
            super::emit(&format!(
                "\n{}\n",
                super::jobs::estimate_line(e, crate::protocol::now_ms())
            ));
        }
    }
    if plan.unplaced.is_empty() {
        exit::SUCCESS
    } else {
        exit::NOT_PLACEABLE
    }
}

/// The RM's estimate of when the job would start if submitted now; `None` (with a note on
/// stderr) when the RM gives none (an older RM, a refusal).
async fn start_estimate(
    c: &crate::am::rm_client::RmClient,
    spec: &crate::spec::JobSpec,
    select: &crate::config::SelectSettings,
) -> Option<crate::protocol::StartEstimate> {
    match c
        .post_json(
            "the start estimate",
            "/ws/v1/cluster/estimate",
            &crate::am::queueing::estimate_request(spec, select),
        )
        .await
    {
        Ok(e) => Some(e),
        Err(e) => {
            eprintln!("note: no start estimate: {e}");
            None
        }
    }
}

/// The JSON of DESIGN.md §7.
pub fn plan_json(plan: &JobPlan) -> Value {
    let placements: Vec<Value> = plan
        .placements
        .iter()
        .map(|p| {
            let ports: Map<String, Value> = p.ports.iter().map(|(l, ps)| (l.clone(), json!(ps))).collect();
            let mut v = json!({
                "role": p.role,
                "index": p.index,
                "host": p.host,
                "rack": p.rack,
                "gpus": p.gpus,
                "gpuMask": p.gpu_mask,
                "ports": ports,
                "gpuTier": p.gpu_tier,
                "gpuTierIdeal": p.gpu_tier_ideal,
                "unionTier": p.union_tier,
                "nic": p.nic,
                "nextBest": p.next_best,
            });
            if let Some(share) = &p.gpu_share {
                v["gpuShare"] = json!(share);
            }
            if let Some(sec) = p.topology_wait_sec {
                v["topologyWaitSec"] = json!(sec);
            }
            if !p.resources.is_empty() {
                v["resources"] = json!(p.resources);
            }
            v
        })
        .collect();
    let unplaced: Vec<Value> = plan
        .unplaced
        .iter()
        .map(|u| {
            json!({
                "role": u.role,
                "index": u.index,
                "reason": u.reason,
                "impossible": u.impossible,
                "trace": u.trace,
            })
        })
        .collect();
    json!({ "placements": placements, "unplaced": unplaced })
}

/// The readable table: one line per placed task, then the stage trace of each
/// task that found no place.
pub fn plan_table(job: &str, plan: &JobPlan) -> String {
    let mut out = String::new();
    let hosts: std::collections::BTreeSet<&str> = plan.placements.iter().map(|p| p.host.as_str()).collect();
    let racks: std::collections::BTreeSet<&str> = plan.placements.iter().map(|p| p.rack.as_str()).collect();
    out.push_str(&format!(
        "plan for job `{job}`: {} placed on {} node(s) in {} rack(s), {} unplaced\n\n",
        plan.placements.len(),
        hosts.len(),
        racks.len(),
        plan.unplaced.len()
    ));
    if !plan.placements.is_empty() {
        out.push_str(&format!(
            "{:<14} {:>5}  {:<16} {:<10} {:<16} {:<5} {}\n",
            "ROLE", "INDEX", "HOST", "RACK", "GPUS", "TIER", "PORTS / RESOURCES"
        ));
        for p in &plan.placements {
            let mut gpus = if p.gpus.is_empty() {
                "-".to_string()
            } else {
                p.gpus.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
            };
            if let Some(share) = &p.gpu_share {
                gpus.push_str(&format!(" ({share})"));
            }
            let tier = if p.gpus.len() < 2 {
                "-".to_string()
            } else {
                let mark = match (p.gpu_tier_ideal, p.topology_wait_sec) {
                    (true, _) => "",
                    (false, None) => "*",
                    (false, Some(_)) => "*w",
                };
                format!("{}{mark}", p.gpu_tier)
            };
            let ports = p
                .ports
                .iter()
                .map(|(l, ps)| format!("{l}={}", ps.iter().map(u16::to_string).collect::<Vec<_>>().join(",")))
                .chain(p.resources.iter().map(|(n, q)| format!("{n}:{q}")))
                .collect::<Vec<_>>()
                .join(" ");
            let gpus = match &p.nic {
                Some(nic) => format!("{gpus} ({nic})"),
                None => gpus,
            };
            out.push_str(&format!(
                "{:<14} {:>5}  {:<16} {:<10} {:<16} {:<5} {}\n",
                p.role,
                p.index,
                p.host,
                p.rack,
                gpus,
                tier,
                if ports.is_empty() { "-".into() } else { ports }
            ));
        }
        out.push_str("\nTIER: 2 = NVLink, 1 = one PCIe switch tree, 0 = through the host; * = below the node's best for that size\n");
        if let Some(sec) = plan.placements.iter().find_map(|p| p.topology_wait_sec) {
            out.push_str(&format!(
                "      *w = the AM first waits up to {sec} s (select.topology_wait_sec) for a set of the node's best tier, since other jobs' GPUs may free one\n"
            ));
        }
        out.push_str("GPUS (nic): the NIC nearest those GPUs, where the node's topology lists NICs\n");
        out.push_str("\nNext-best node per task and why it lost (the order of docs/DESIGN-NOTES.md, issue 13):\n");
        for p in &plan.placements {
            match &p.next_best {
                Some(a) => out.push_str(&format!(
                    "  {}/{}: {} — lost on {}\n",
                    p.role, p.index, a.host, a.lost_on
                )),
                None => out.push_str(&format!("  {}/{}: no other node could take it\n", p.role, p.index)),
            }
        }
    }
    for u in &plan.unplaced {
        out.push_str(&format!(
            "\n{}/{}: {} — {}\n",
            u.role,
            u.index,
            if u.impossible {
                "IMPOSSIBLE on this cluster"
            } else {
                "no place now"
            },
            u.reason
        ));
        out.push_str(&u.trace.render());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{ClusterView, Node};
    use crate::resources::{PortSet, Resources};
    use crate::select::{plan_job, Selector};

    /// A task the AM would first hold back for a better GPU tier is marked `*w` in the table,
    /// with the wait explained under it, and carries `topologyWaitSec` in the JSON.
    #[test]
    fn the_topology_wait_shows_in_the_table_and_the_json() {
        // pcie4: pairs 0-1 and 2-3; another job holds 0 and 2, so only the split pair is free.
        let mut n = Node::new("split", "/r", Resources::with_mask(8, 8000, 0xf, PortSet::new()));
        n.set_used(Resources::with_mask(2, 100, 0b0101, PortSet::new()));
        n.topology = Some(std::sync::Arc::new(crate::topology::Topology::preset("pcie4").unwrap()));
        let job = crate::spec::parse_job_spec(
            "name: j\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {cpu: 1, memoryMB: 1000, gpu: 2}\n    commands: [\"true\"]\n",
            "j.yaml",
        )
        .unwrap();
        let plan = plan_job(&Selector::new(ClusterView::new(vec![n]), Default::default()), &job);
        let table = plan_table("j", &plan);
        assert!(table.contains("0*w") && table.contains("waits up to 300 s"), "{table}");
        assert_eq!(plan_json(&plan)["placements"][0]["topologyWaitSec"], 300);
    }

    /// Audit 5 F5's second line: a node whose rack holds a terminal escape sequence (one
    /// that got in before the RM checked racks) shows it escaped in `gpuam plan`'s
    /// output, not as the sequence.
    #[test]
    fn a_rack_with_an_escape_sequence_is_shown_escaped() {
        let rack = "/r\u{1b}]0;PWNED\u{7}\u{1b}[2J\u{1b}[HYour session expired";
        let n = Node::new("n4", rack, Resources::with_mask(64, 400_000, 0x3, PortSet::new()));
        let job = crate::spec::parse_job_spec(
            "name: small\ntaskRoles:\n  w:\n    instances: 1\n    resourcePerInstance: {cpu: 32, memoryMB: 100000, gpu: 1}\n    commands: [\"true\"]\n",
            "small.yaml",
        )
        .unwrap();
        let plan = plan_job(&Selector::new(ClusterView::new(vec![n]), Default::default()), &job);
        let mut out = Vec::new();
        crate::cli::emit_to(&mut out, &plan_table("small", &plan)).unwrap();
        let out = String::from_utf8(out).unwrap();
        assert!(!out.contains('\u{1b}') && !out.contains('\u{7}'), "{out:?}");
        assert!(out.contains("/r\\u{1b}]0;PWNED\\u{7}\\u{1b}[2J"), "{out}");
    }
}
