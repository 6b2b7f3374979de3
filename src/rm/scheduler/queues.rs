//! The queue tree of `rm.queues` (DESIGN.md §10): validated once from the settings, then
//! looked up by name and asked who may use a queue. No I/O.
//!
//! Shape: top-level queues, each either a leaf (jobs run in it) or a parent holding one
//! level of leaves (`rm.queues.dept: {weight: 2, queues: {teamA: {...}, teamB: {...}}}`).
//! Leaf names are unique across the tree, so a job names its leaf (`queue: teamA`) as in
//! YARN's capacity scheduler; the full path (`dept.teamA`) is accepted too. Without any
//! queue configured the tree is one leaf, `default`, open to everyone, and every job runs
//! in it whatever queue it names (an OpenPAI job's `virtualCluster` included).

use std::collections::BTreeMap;

use crate::config::QueueSettings;
use crate::protocol::DEFAULT_QUEUE;

/// The user the admin credential stands for (no user of the users file may take the
/// name); it may submit to any queue.
pub use crate::rm::users::ADMIN_USER;

/// Longest queue name.
const MAX_NAME: usize = 64;

/// One queue (leaf or parent) with its settings made effective.
#[derive(Clone, Debug, PartialEq)]
pub struct Queue {
    /// Its own name (`teamA`).
    pub name: String,
    /// `dept.teamA` for a leaf of a parent, else the name.
    pub path: String,
    pub parent: Option<usize>,
    pub children: Vec<usize>,
    pub weight: f64,
    pub guaranteed_gpus: u32,
    pub max_gpus: Option<u32>,
    /// Who may submit (`None`: everyone), inherited from the parent when unset.
    pub users: Option<Vec<String>>,
    pub priority_preemption: bool,
}

impl Queue {
    pub fn is_leaf(&self) -> bool {
        self.children.is_empty()
    }
}

/// Why a job may not use the queue it names.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QueueRefusal {
    /// No such queue (HTTP 400).
    #[error("{0}")]
    Unknown(String),
    /// The user is not among the queue's users (HTTP 403).
    #[error("{0}")]
    NotAllowed(String),
}

/// Every queue, parents before their leaves, by index.
#[derive(Clone, Debug, PartialEq)]
pub struct QueueTree {
    queues: Vec<Queue>,
    /// False for the implicit `default` queue of an RM without `rm.queues`: every job
    /// runs in it, whatever queue it names.
    configured: bool,
}

impl Default for QueueTree {
    /// The single `default` queue of an RM with no queues configured.
    fn default() -> Self {
        QueueTree {
            queues: vec![Queue {
                name: DEFAULT_QUEUE.into(),
                path: DEFAULT_QUEUE.into(),
                parent: None,
                children: Vec::new(),
                weight: 1.0,
                guaranteed_gpus: 0,
                max_gpus: None,
                users: None,
                priority_preemption: false,
            }],
            configured: false,
        }
    }
}

fn check_name(name: &str, key: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{key}: queue name `{name}` must be 1 to {MAX_NAME} letters, digits, `_` or `-`"
        ))
    }
}

fn check_settings(s: &QueueSettings, key: &str) -> Result<(), String> {
    if !(s.weight.is_finite() && s.weight > 0.0) {
        return Err(format!("{key}.weight must be a number above 0 (got {})", s.weight));
    }
    if let Some(max) = s.max_gpus {
        if s.guaranteed_gpus > max {
            return Err(format!(
                "{key}: guaranteedGpus ({}) is more than maxGpus ({max})",
                s.guaranteed_gpus
            ));
        }
    }
    if let Some(users) = &s.users {
        if let Some(u) = users.iter().find(|u| u.trim().is_empty()) {
            return Err(format!("{key}.users has an empty name `{u}`"));
        }
    }
    Ok(())
}

impl QueueTree {
    /// Builds and checks the tree: names, weights above 0, `guaranteedGpus ≤ maxGpus`, one
    /// level of nesting, leaf names unique. An empty map gives [`QueueTree::default`].
    /// Errors name the settings key.
    pub fn from_settings(map: &BTreeMap<String, QueueSettings>) -> Result<QueueTree, String> {
        if map.is_empty() {
            return Ok(QueueTree::default());
        }
        let mut queues = Vec::new();
        for (name, s) in map {
            let key = format!("rm.queues.{name}");
            check_name(name, &key)?;
            check_settings(s, &key)?;
            let me = queues.len();
            queues.push(Queue {
                name: name.clone(),
                path: name.clone(),
                parent: None,
                children: Vec::new(),
                weight: s.weight,
                guaranteed_gpus: s.guaranteed_gpus,
                max_gpus: s.max_gpus,
                users: s.users.clone(),
                priority_preemption: s.priority_preemption,
            });
            for (child, cs) in &s.queues {
                let ckey = format!("{key}.queues.{child}");
                check_name(child, &ckey)?;
                check_settings(cs, &ckey)?;
                if !cs.queues.is_empty() {
                    return Err(format!(
                        "{ckey}.queues: queues nest one level only (teams within a department); \
                         move these queues up a level"
                    ));
                }
                let ci = queues.len();
                queues[me].children.push(ci);
                queues.push(Queue {
                    name: child.clone(),
                    path: format!("{name}.{child}"),
                    parent: Some(me),
                    children: Vec::new(),
                    weight: cs.weight,
                    guaranteed_gpus: cs.guaranteed_gpus,
                    max_gpus: cs.max_gpus,
                    users: cs.users.clone().or_else(|| s.users.clone()),
                    priority_preemption: cs.priority_preemption,
                });
            }
        }
        let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
        for q in queues.iter().filter(|q| q.is_leaf()) {
            if let Some(other) = seen.insert(&q.name, &q.path) {
                return Err(format!(
                    "rm.queues: two queues are named `{}` ({other} and {}); jobs name a queue by its \
                     own name, so give one of them another",
                    q.name, q.path
                ));
            }
        }
        Ok(QueueTree {
            queues,
            configured: true,
        })
    }

    pub fn len(&self) -> usize {
        self.queues.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queues.is_empty()
    }

    pub fn get(&self, i: usize) -> &Queue {
        &self.queues[i]
    }

    /// Every queue with its index, parents before their leaves.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &Queue)> {
        self.queues.iter().enumerate()
    }

    /// Indices of the top-level queues.
    pub fn top(&self) -> impl Iterator<Item = usize> + '_ {
        self.queues
            .iter()
            .enumerate()
            .filter(|(_, q)| q.parent.is_none())
            .map(|(i, _)| i)
    }

    /// Indices of the queues jobs run in.
    pub fn leaves(&self) -> impl Iterator<Item = usize> + '_ {
        self.queues
            .iter()
            .enumerate()
            .filter(|(_, q)| q.is_leaf())
            .map(|(i, _)| i)
    }

    /// The leaf and its parent (if any): the queues whose caps a job's GPUs count against.
    pub fn lineage(&self, leaf: usize) -> impl Iterator<Item = usize> + '_ {
        std::iter::successors(Some(leaf), move |&i| self.queues[i].parent)
    }

    fn names(&self) -> String {
        self.leaves()
            .map(|i| self.queues[i].name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The leaf a job's `queue` names (its own name or `parent.leaf`); `None` means
    /// `default`.
    pub fn resolve(&self, name: Option<&str>) -> Result<usize, QueueRefusal> {
        if !self.configured {
            return Ok(0);
        }
        let want = name.map(str::trim).filter(|n| !n.is_empty()).unwrap_or(DEFAULT_QUEUE);
        let found = self.queues.iter().position(|q| q.path == want || q.name == want);
        match found {
            Some(i) if self.queues[i].is_leaf() => Ok(i),
            Some(i) => Err(QueueRefusal::Unknown(format!(
                "queue `{want}` holds other queues and takes no jobs itself: name one of {}",
                self.queues[i]
                    .children
                    .iter()
                    .map(|&c| self.queues[c].name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
            None if name.is_none() => Err(QueueRefusal::Unknown(format!(
                "the job names no queue and this RM has no `{DEFAULT_QUEUE}` queue: add `queue: NAME` \
                 to the job (one of {})",
                self.names()
            ))),
            None => Err(QueueRefusal::Unknown(format!(
                "unknown queue `{want}`: this RM's queues are {}",
                self.names()
            ))),
        }
    }

    /// Whether `user` may submit to leaf `q`: the admin always, others when the queue
    /// lists no users or lists them.
    pub fn check_user(&self, q: usize, user: &str) -> Result<(), QueueRefusal> {
        let queue = &self.queues[q];
        match &queue.users {
            _ if user == ADMIN_USER => Ok(()),
            None => Ok(()),
            Some(users) if users.iter().any(|u| u == user) => Ok(()),
            Some(users) => Err(QueueRefusal::NotAllowed(format!(
                "user `{user}` may not submit to queue `{}`: its users are {} (and the admin)",
                queue.path,
                if users.is_empty() {
                    "none".to_string()
                } else {
                    users.join(", ")
                }
            ))),
        }
    }

    /// Resolves the job's queue and checks the user may use it.
    pub fn admit(&self, name: Option<&str>, user: &str) -> Result<usize, QueueRefusal> {
        let q = self.resolve(name)?;
        self.check_user(q, user)?;
        Ok(q)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(yaml: &str) -> BTreeMap<String, QueueSettings> {
        let v: serde_json::Value = serde_json::from_str(yaml).unwrap();
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn no_queues_is_one_open_default_queue() {
        let t = QueueTree::from_settings(&BTreeMap::new()).unwrap();
        assert_eq!(t.len(), 1);
        let q = t.admit(None, "alice").unwrap();
        assert_eq!(t.get(q).name, "default");
        assert_eq!(t.admit(Some("default"), "bob").unwrap(), q);
        assert_eq!(
            t.resolve(Some("research")).unwrap(),
            q,
            "no queues configured: all run in default"
        );
    }

    #[test]
    fn users_lists_admit_their_users_and_the_admin_only() {
        let t = QueueTree::from_settings(&settings(
            r#"{"research": {"weight": 3, "users": ["alice", "bob"]},
                "prod": {"weight": 1, "guaranteedGpus": 2, "maxGpus": 64}}"#,
        ))
        .unwrap();
        let research = t.resolve(Some("research")).unwrap();
        assert!(t.check_user(research, "alice").is_ok());
        assert!(
            t.check_user(research, ADMIN_USER).is_ok(),
            "the admin may use any queue"
        );
        let err = t.check_user(research, "carol").unwrap_err();
        assert!(
            matches!(&err, QueueRefusal::NotAllowed(m) if m.contains("research") && m.contains("alice, bob")),
            "{err}"
        );
        let prod = t.resolve(Some("prod")).unwrap();
        assert!(t.check_user(prod, "carol").is_ok(), "no list: everyone");
        assert_eq!((t.get(prod).guaranteed_gpus, t.get(prod).max_gpus), (2, Some(64)));
        let e = t.resolve(None).unwrap_err();
        assert!(e.to_string().contains("no `default` queue"), "{e}");
    }

    #[test]
    fn one_level_of_nesting_with_inherited_users() {
        let t = QueueTree::from_settings(&settings(
            r#"{"dept": {"weight": 2, "users": ["ann"], "queues": {"teamA": {}, "teamB": {"users": ["ben"]}}},
                "default": {}}"#,
        ))
        .unwrap();
        let a = t.resolve(Some("teamA")).unwrap();
        assert_eq!(t.resolve(Some("dept.teamA")).unwrap(), a);
        assert_eq!(t.get(a).path, "dept.teamA");
        assert!(t.check_user(a, "ann").is_ok(), "inherits the department's users");
        let b = t.resolve(Some("teamB")).unwrap();
        assert!(t.check_user(b, "ann").is_err());
        assert_eq!(t.lineage(b).count(), 2);
        let e = t.resolve(Some("dept")).unwrap_err();
        assert!(e.to_string().contains("teamA, teamB"), "{e}");
    }

    #[test]
    fn bad_settings_name_the_key() {
        for (yaml, what) in [
            (r#"{"a": {"weight": 0}}"#, "rm.queues.a.weight"),
            (r#"{"a": {"guaranteedGpus": 4, "maxGpus": 2}}"#, "guaranteedGpus (4)"),
            (r#"{"a b": {}}"#, "queue name `a b`"),
            (r#"{"d": {"queues": {"t": {"queues": {"x": {}}}}}}"#, "one level only"),
            (
                r#"{"d": {"queues": {"t": {}}}, "e": {"queues": {"t": {}}}}"#,
                "two queues are named `t`",
            ),
            (r#"{"a": {"users": [""]}}"#, "rm.queues.a.users"),
        ] {
            let e = QueueTree::from_settings(&settings(yaml)).unwrap_err();
            assert!(e.contains(what), "{yaml}: {e}");
        }
    }
}
