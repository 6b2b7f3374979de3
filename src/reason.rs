//! Why a task or a job waits: the one structured reason (a [`Kind`], its detail and, where
//! known, since when and until when), defined once. The select pipeline's outcome gives the
//! kind and the detail (`select::Outcome::wait_reason`), the AM's job machine adds the times
//! and the gang's holder, the RM's queue gate gives the queue's causes
//! (`rm::scheduler::WaitReason::reason`), and [`combine`] is the one rule that picks the
//! job's reason from the two. It travels typed: in the AM's status snapshot, in the allocate
//! call (the AM's reason, `waitReason`) and its answer (the queue's), and in the RM's
//! application reports. [`Reason::text`] is the one rendering for the terminal (`gpuam
//! status`, `gpuam jobs`, `gpuam run`); `webui/reason.js` renders the same words on the
//! pages (a test holds the two to the same text).

use serde::{Deserialize, Serialize};

/// What keeps it waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Hash)]
pub enum Kind {
    /// No placement round has run for it yet.
    Starting,
    /// No node has room for it now (the stage that emptied the candidate set says which).
    Resources,
    /// It holds out for its node's ideal GPU tier until `select.topology_wait_sec` has
    /// passed (`until`).
    Topology,
    /// Its gang: the gang timeout gave back what it held, or a task of it has no reason yet.
    Gang,
    /// Its queue: at its cap, or at its share while others wait.
    QueueShare,
    /// An application that ranks ahead (priority, then age) gets the free GPUs first.
    Priority,
    /// GPUs are being taken back (preempted) for it.
    Reclaiming,
    /// No node of the cluster could ever take it.
    Impossible,
    /// Its ask is out: the RM has not granted it yet (it is not placed).
    Requested,
    /// It is tried again: a retry after an exit, a rejected or timed-out ask.
    Retry,
}

impl Kind {
    pub const ALL: [Kind; 10] = [
        Kind::Starting,
        Kind::Resources,
        Kind::Topology,
        Kind::Gang,
        Kind::QueueShare,
        Kind::Priority,
        Kind::Reclaiming,
        Kind::Impossible,
        Kind::Requested,
        Kind::Retry,
    ];

    /// The words the surfaces show for it (`webui/reason.js` has the same table).
    pub fn label(self) -> &'static str {
        match self {
            Kind::Starting => "Starting",
            Kind::Resources => "Resources",
            Kind::Topology => "Topology",
            Kind::Gang => "Gang",
            Kind::QueueShare => "Queue share",
            Kind::Priority => "Priority",
            Kind::Reclaiming => "Reclaiming",
            Kind::Impossible => "Impossible",
            Kind::Requested => "Requested",
            Kind::Retry => "Retry",
        }
    }

    /// A cause of the RM's queues (it outranks what the AM sees of the nodes).
    pub fn is_queue(self) -> bool {
        matches!(self, Kind::QueueShare | Kind::Priority | Kind::Reclaiming)
    }
}

/// Why it waits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Reason {
    pub kind: Kind,
    pub detail: String,
    /// Since when it waits so (milliseconds since the epoch), where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since_ms: Option<u64>,
    /// Until when at most (the topology wait's deadline), where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_ms: Option<u64>,
    /// The task this reason is about (`role/index`) where it is another task's: the task
    /// that holds a gang back, or the job's first waiting task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
}

impl Reason {
    pub fn new(kind: Kind, detail: impl Into<String>) -> Self {
        Reason {
            kind,
            detail: detail.into(),
            since_ms: None,
            until_ms: None,
            task: None,
        }
    }

    pub fn since(mut self, ms: u64) -> Self {
        self.since_ms = Some(ms);
        self
    }

    pub fn until(mut self, ms: u64) -> Self {
        self.until_ms = Some(ms);
        self
    }

    /// The same reason, said of `task`.
    pub fn of_task(mut self, task: impl Into<String>) -> Self {
        self.task = Some(task.into());
        self
    }

    /// The one line shown: `Topology (worker/0): holding out … [since 18:30:02 UTC, until
    /// 18:35:02 UTC]`. `webui/reason.js`'s `reasonText` writes the same.
    pub fn text(&self) -> String {
        let mut out = self.kind.label().to_string();
        if let Some(t) = &self.task {
            out.push_str(&format!(" ({t})"));
        }
        out.push_str(": ");
        out.push_str(&self.detail);
        let times: Vec<String> = [("since", self.since_ms), ("until", self.until_ms)]
            .into_iter()
            .filter_map(|(w, ms)| ms.map(|ms| format!("{w} {}", clock_utc(ms))))
            .collect();
        if !times.is_empty() {
            out.push_str(&format!(" [{}]", times.join(", ")));
        }
        out
    }
}

/// `HH:MM:SS UTC` of milliseconds since the epoch.
pub fn clock_utc(ms: u64) -> String {
    let s = ms / 1000;
    format!("{:02}:{:02}:{:02} UTC", s % 86_400 / 3600, s % 3600 / 60, s % 60)
}

/// The job's reason from the RM's queue gate (`queue`) and what the AM found placing its
/// tasks (`placement`): a queue cause outranks the nodes (the queue would not grant even
/// where a node has room); otherwise the AM's, which knows the select outcome (the RM's
/// "nothing fits" is only its guess from the waiting demand).
pub fn combine(queue: Option<&Reason>, placement: Option<&Reason>) -> Option<Reason> {
    match queue {
        Some(q) if q.kind.is_queue() => Some(q.clone()),
        q => placement.or(q).cloned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_names_kind_task_detail_and_times() {
        let r = Reason::new(Kind::Topology, "holding out for 2 GPUs of tier 1")
            .since(1_700_000_000_000)
            .until(1_700_000_300_000)
            .of_task("worker/0");
        assert_eq!(
            r.text(),
            "Topology (worker/0): holding out for 2 GPUs of tier 1 [since 22:13:20 UTC, until 22:18:20 UTC]"
        );
        assert_eq!(
            Reason::new(Kind::QueueShare, "at its cap").text(),
            "Queue share: at its cap"
        );
    }

    #[test]
    fn on_the_wire_the_kind_is_its_name_and_absent_times_are_left_out() {
        let r = Reason::new(Kind::Resources, "no room").since(5);
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"kind": "Resources", "detail": "no room", "sinceMs": 5})
        );
        assert_eq!(serde_json::from_value::<Reason>(v).unwrap(), r);
    }

    /// The pages' table of words (`webui/reason.js`) is this one: every kind, by its wire
    /// name, has the label the terminal shows.
    #[test]
    fn the_pages_label_every_kind_as_the_terminal_does() {
        let js = include_str!("../webui/reason.js");
        for k in Kind::ALL {
            let name = serde_json::to_value(k).unwrap();
            let entry = format!("{}: '{}'", name.as_str().unwrap(), k.label());
            assert!(js.contains(&entry), "webui/reason.js lacks `{entry}`");
        }
    }

    /// The table of [`combine`]: a queue cause wins; else the AM's reason; else the RM's guess.
    #[test]
    fn a_queue_cause_outranks_the_nodes_and_the_am_knows_the_nodes_best() {
        let queue = Reason::new(Kind::QueueShare, "queue `a` is at its cap");
        let guess = Reason::new(Kind::Resources, "nothing fits yet");
        let topo = Reason::new(Kind::Topology, "holding out").until(9);
        let cases: [(Option<&Reason>, Option<&Reason>, Option<&Reason>); 6] = [
            (Some(&queue), Some(&topo), Some(&queue)),
            (Some(&guess), Some(&topo), Some(&topo)),
            (None, Some(&topo), Some(&topo)),
            (Some(&guess), None, Some(&guess)),
            (Some(&queue), None, Some(&queue)),
            (None, None, None),
        ];
        for (q, p, want) in cases {
            assert_eq!(combine(q, p).as_ref(), want, "{q:?} + {p:?}");
        }
    }
}
