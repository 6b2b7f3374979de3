//! Selection traces: per stage, how many nodes went in and out, and why the others
//! were dropped. Shown by `gpuam plan`, the dashboard and the AM's logs.
//!
//! Reasons are static strings so that dropping 10,000 nodes groups them without
//! allocating per node; each group keeps a few example hosts.

use serde::Serialize;

/// How many example hosts a drop group keeps.
pub(crate) const EXAMPLE_HOSTS: usize = 5;

/// Nodes a stage dropped for one reason.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DropGroup {
    pub reason: &'static str,
    pub count: usize,
    pub hosts: Vec<String>,
}

/// What one stage did.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StageTrace {
    pub stage: &'static str,
    pub nodes_in: usize,
    pub nodes_out: usize,
    pub dropped: Vec<DropGroup>,
    /// Free-form note (e.g. the ports chosen, the rack kept).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl StageTrace {
    pub fn new(stage: &'static str, nodes_in: usize) -> Self {
        StageTrace {
            stage,
            nodes_in,
            nodes_out: nodes_in,
            dropped: Vec::new(),
            note: None,
        }
    }

    /// Records one dropped node.
    pub fn drop_node(&mut self, reason: &'static str, host: &str) {
        // Reasons are literals: comparing addresses first spares a string compare per node.
        let same = |g: &DropGroup| std::ptr::eq(g.reason, reason) || g.reason == reason;
        let group = match self.dropped.iter().position(same) {
            Some(i) => &mut self.dropped[i],
            None => {
                self.dropped.push(DropGroup {
                    reason,
                    count: 0,
                    hosts: Vec::new(),
                });
                // The vector was just pushed to.
                let last = self.dropped.len() - 1;
                &mut self.dropped[last]
            }
        };
        group.count += 1;
        if group.hosts.len() < EXAMPLE_HOSTS {
            group.hosts.push(host.to_string());
        }
    }

    /// Records `count` nodes dropped for one reason at once (counted from the node index),
    /// with a few example hosts.
    pub fn drop_many(&mut self, reason: &'static str, count: usize, hosts: impl Iterator<Item = String>) {
        if count == 0 {
            return;
        }
        let same = |g: &DropGroup| std::ptr::eq(g.reason, reason) || g.reason == reason;
        let i = match self.dropped.iter().position(same) {
            Some(i) => i,
            None => {
                self.dropped.push(DropGroup {
                    reason,
                    count: 0,
                    hosts: Vec::new(),
                });
                self.dropped.len() - 1
            }
        };
        let group = &mut self.dropped[i];
        group.count += count;
        let room = EXAMPLE_HOSTS.saturating_sub(group.hosts.len());
        group.hosts.extend(hosts.take(room));
    }

    /// Nodes this stage dropped.
    pub fn dropped_count(&self) -> usize {
        self.dropped.iter().map(|g| g.count).sum()
    }

    /// The most common drop reason, if any node was dropped.
    pub fn main_reason(&self) -> Option<&'static str> {
        self.dropped.iter().max_by_key(|g| g.count).map(|g| g.reason)
    }
}

/// The whole pipeline's record for one task.
#[derive(Clone, Debug, PartialEq, Serialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct SelectionTrace {
    pub stages: Vec<StageTrace>,
    /// The ranked candidates kept by job packing (best first), at most a few shown.
    pub candidates: Vec<CandidateSummary>,
    /// The next-best node and the criterion of the order on which it lost.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alternative: Option<super::Alternative>,
}

/// One ranked candidate, as shown to people.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CandidateSummary {
    pub host: String,
    pub rack: String,
    /// The node already runs or has asked for tasks of this job.
    pub job_affinity: bool,
    /// How many of the job's still-unplaced tasks fit on this node.
    pub fits_tasks: u32,
    pub free_gpus: u32,
    pub gpu_tier: u8,
    pub gpu_tier_ideal: bool,
    pub gpu_weight: u32,
    /// Tier and weight of the job's GPUs on the node with this task (the union).
    pub union_tier: u8,
    pub union_weight: u32,
}

impl SelectionTrace {
    /// Human-readable lines, one per stage, for `plan` and logs.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for s in &self.stages {
            out.push_str(&format!("  {:<16} {:>6} -> {:<6}", s.stage, s.nodes_in, s.nodes_out));
            let reasons: Vec<String> = s
                .dropped
                .iter()
                .map(|g| format!("{} x{} (e.g. {})", g.reason, g.count, g.hosts.join(", ")))
                .collect();
            if !reasons.is_empty() {
                out.push_str(&format!(" dropped: {}", reasons.join("; ")));
            }
            if let Some(n) = &s.note {
                out.push_str(&format!(" [{n}]"));
            }
            out.push('\n');
        }
        if let Some(a) = &self.alternative {
            out.push_str(&format!("  next best: {} (lost on {})\n", a.host, a.lost_on));
        }
        out
    }
}
