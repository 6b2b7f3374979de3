//! The RM's state and its one lock: the ledger, the applications, the reserved ids and the
//! store. [`StateGuard`] is the only way in.
//!
//! Durable before acknowledged: a handler that changed something calls
//! [`StateGuard::commit`] before it builds its answer; a failed commit is a 503 (with
//! `Retry-After`) and the answer is not given. From then on the store counts as failing:
//! [`StateGuard::writable`] (called first by every handler that would grant or change an
//! application) answers 503 until a write succeeds again, and the first write that
//! succeeds is the WHOLE state, since what the failed writes missed is not known. Every
//! failure is logged, counted and shown (`clusterInfo.rmStateStoreWriteErrors`,
//! `rmStateStoreFailing`). Background paths (a container's exit, expiry, an AM's death)
//! cannot refuse anything: they commit and log ([`StateGuard::commit_or_log`]). Dropping
//! the guard commits whatever is still uncommitted the same way, as a safety net.
//!
//! Also rebuilding the state from the store at start-up. What changes the state is a
//! transaction of `transactions` (the one door).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use axum::http::StatusCode;

use super::http::ApiError;
use super::{nodes, scheduling};
use crate::cluster::NodeState;
use crate::protocol::now_ms;
use crate::rm::apps::{app_id, app_seq, Apps};
use crate::rm::ledger::{Ended, Ledger};
use crate::rm::store::{Batch, Meta, Store, StoreError};

/// Most application ids handed out by new-application and not yet submitted that are
/// remembered (the oldest are forgotten first), so that calling new-application in a
/// loop cannot grow the RM without bound.
pub(super) const MAX_RESERVED_IDS: usize = 10_000;

/// Most of those one user holds (their oldest are forgotten first), so that one user's loop
/// cannot push out the ids other users were just handed.
pub(super) const MAX_RESERVED_IDS_PER_USER: usize = 1_024;

/// While the store fails, a whole-state write is tried at most this often (callers in
/// between get 503 at once).
const WHOLE_WRITE_RETRY: Duration = Duration::from_millis(250);

/// While the store fails, the failure is logged again at most this often.
const FAILING_LOG_EVERY: Duration = Duration::from_secs(10);

/// How the state store is doing.
#[derive(Debug, Default)]
pub(super) struct StoreHealth {
    /// The last write failed (with this error): grants and state changes are refused
    /// until a whole-state write succeeds.
    pub(super) failing: Option<String>,
    /// Writes that failed since the start.
    pub(super) write_errors: u64,
    /// Whole-state writes that ended a failure.
    pub(super) recoveries: u64,
    pub(super) last_whole_attempt: Option<Instant>,
    /// When a failure was last logged (while failing, at most every [`FAILING_LOG_EVERY`]).
    last_logged: Option<Instant>,
    /// The container sequence the store has (so a grant writes the counter too).
    stored_container_seq: u64,
}

pub(super) struct RmState {
    pub(super) ledger: Ledger,
    pub(super) apps: Apps,
    /// Ids handed out by new-application and not yet submitted, and who reserved each.
    pub(super) reserved: ReservedIds,
    pub(super) next_app_seq: u32,
    /// `next_app_seq` or `reserved` changed since the last write.
    pub(super) meta_dirty: bool,
    pub(super) store: Store,
    pub(super) store_health: StoreHealth,
    /// The queues and the preemptions in progress (not persisted: a restarted RM decides
    /// again from what runs).
    pub(super) sched: scheduling::SchedState,
    /// Node agents' declarations (host → the JSON of its first registration, see
    /// `nodes::declared_node`), kept so that a restarted RM knows their hosts.
    pub(super) agent_nodes: BTreeMap<String, String>,
    /// Hosts of `agent_nodes` changed since the last write.
    pub(super) agent_nodes_dirty: std::collections::BTreeSet<String>,
    /// Hosts an admin removed for good (`cluster::delete_node`), stored in the meta row
    /// (a change sets `meta_dirty`).
    pub(super) removed_hosts: BTreeMap<String, crate::rm::store::RemovedHost>,
}

/// Ids handed out by new-application and not yet submitted, and who reserved each (only
/// they may submit it). Bounded per user and in all; each bound is kept in O(log n).
#[derive(Debug, Default)]
pub(super) struct ReservedIds {
    /// By sequence number, so the oldest are the first ones.
    by_seq: BTreeMap<u32, String>,
    /// Who reserved each id (absent: reserved by an older RM that did not say).
    owner: BTreeMap<String, String>,
    /// Each user's ids, by sequence number.
    per_user: HashMap<String, BTreeSet<u32>>,
}

impl ReservedIds {
    /// What a store kept (no bound applied: it was applied when they were handed out).
    pub(super) fn recovered(ids: Vec<String>, owners: BTreeMap<String, String>) -> ReservedIds {
        let mut r = ReservedIds::default();
        for id in ids {
            let Some(seq) = app_seq(&id) else { continue };
            if let Some(user) = owners.get(&id) {
                r.per_user.entry(user.clone()).or_default().insert(seq);
                r.owner.insert(id.clone(), user.clone());
            }
            r.by_seq.insert(seq, id);
        }
        r
    }

    /// Adds `id` for `user`, forgetting the user's oldest beyond
    /// [`MAX_RESERVED_IDS_PER_USER`], then the oldest beyond [`MAX_RESERVED_IDS`]. False for
    /// an id that names no sequence number (never issued by an RM).
    pub(super) fn insert(&mut self, id: String, user: &str) -> bool {
        let Some(seq) = app_seq(&id) else {
            return false;
        };
        self.forget_seq(seq);
        self.owner.insert(id.clone(), user.to_string());
        self.by_seq.insert(seq, id);
        let mine = self.per_user.entry(user.to_string()).or_default();
        mine.insert(seq);
        if mine.len() > MAX_RESERVED_IDS_PER_USER {
            if let Some(oldest) = mine.first().copied() {
                self.forget_seq(oldest);
            }
        }
        while self.by_seq.len() > MAX_RESERVED_IDS {
            match self.by_seq.first_key_value().map(|(s, _)| *s) {
                Some(oldest) => self.forget_seq(oldest),
                None => break,
            }
        }
        true
    }

    fn forget_seq(&mut self, seq: u32) {
        let Some(id) = self.by_seq.remove(&seq) else {
            return;
        };
        if let Some(user) = self.owner.remove(&id) {
            if let Some(mine) = self.per_user.get_mut(&user) {
                mine.remove(&seq);
                if mine.is_empty() {
                    self.per_user.remove(&user);
                }
            }
        }
    }

    pub(super) fn contains(&self, id: &str) -> bool {
        app_seq(id).is_some_and(|seq| self.by_seq.get(&seq).is_some_and(|r| r == id))
    }

    /// Claims `id`; false when it was not reserved.
    pub(super) fn take(&mut self, id: &str) -> bool {
        let had = self.contains(id);
        if let Some(seq) = app_seq(id).filter(|_| had) {
            self.forget_seq(seq);
        }
        had
    }

    pub(super) fn owner(&self, id: &str) -> Option<&str> {
        self.owner.get(id).map(String::as_str)
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.by_seq.len()
    }

    /// How many ids `user` holds.
    #[cfg(test)]
    pub(super) fn held_by(&self, user: &str) -> usize {
        self.per_user.get(user).map_or(0, BTreeSet::len)
    }

    /// The ids, oldest first (what the store keeps).
    pub(super) fn ids(&self) -> Vec<String> {
        self.by_seq.values().cloned().collect()
    }

    pub(super) fn owners(&self) -> BTreeMap<String, String> {
        self.owner.clone()
    }
}

impl RmState {
    /// Remembers an id handed out by new-application (forgetting the user's oldest beyond
    /// [`MAX_RESERVED_IDS_PER_USER`], then the oldest beyond [`MAX_RESERVED_IDS`]).
    pub(super) fn reserve(&mut self, id: String, user: &str) {
        if self.reserved.insert(id, user) {
            self.meta_dirty = true;
        }
    }

    /// A fresh application id; an error once the sequence reached 2^32−1 (it is never
    /// wrapped: that would hand out an existing id).
    pub(super) fn next_app_id(&mut self, cluster_ts: u64) -> Result<String, ApiError> {
        let Some(seq) = self.next_app_seq.checked_add(1) else {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "ID_SEQUENCE_EXHAUSTED",
                format!(
                    "the application id sequence is exhausted ({}): this RM's ids cannot go on without repeating; \
                     start a new RM with a fresh state directory",
                    u32::MAX
                ),
            ));
        };
        self.next_app_seq = seq;
        self.meta_dirty = true;
        Ok(app_id(cluster_ts, seq))
    }

    /// Who reserved `id` (`None`: nobody known, e.g. reserved by an older RM).
    pub(super) fn reserved_user(&self, id: &str) -> Option<&str> {
        self.reserved.owner(id)
    }

    pub(super) fn is_reserved(&self, id: &str) -> bool {
        self.reserved.contains(id)
    }

    /// Claims a reserved id; false when it was not reserved.
    pub(super) fn unreserve(&mut self, id: &str) -> bool {
        let had = self.reserved.take(id);
        self.meta_dirty |= had;
        had
    }

    fn meta(&self, cluster_ts: u64) -> Meta {
        Meta {
            cluster_ts,
            next_app_seq: self.next_app_seq,
            reserved: self.reserved.ids(),
            next_container_seq: self.ledger.next_container_seq(),
            reserved_by: self.reserved.owners(),
            removed_hosts: self.removed_hosts.clone(),
        }
    }

    /// Writes what changed since the last call in one transaction (the whole state
    /// while the store is failing). `Err` leaves the store failing (see the module doc).
    pub(super) fn persist(&mut self, cluster_ts: u64) -> Result<(), StoreError> {
        if !self.store.is_durable() {
            self.apps.take_dirty();
            self.ledger.take_changes();
            self.meta_dirty = false;
            return Ok(());
        }
        if let Some(why) = &self.store_health.failing {
            // A lock taken only to read does not retry the store (writers do).
            let changed = self.apps.has_changes()
                || self.ledger.has_changes()
                || self.meta_dirty
                || !self.agent_nodes_dirty.is_empty();
            if !changed {
                return Err(StoreError::Write(why.clone()));
            }
            return self.write_whole(cluster_ts);
        }
        let apps = self.apps.take_dirty();
        let changes = self.ledger.take_changes();
        let agent_nodes = std::mem::take(&mut self.agent_nodes_dirty);
        let container_seq = self.ledger.next_container_seq();
        let meta_dirty =
            std::mem::take(&mut self.meta_dirty) || container_seq != self.store_health.stored_container_seq;
        if apps.is_empty() && changes.is_empty() && !meta_dirty && agent_nodes.is_empty() {
            return Ok(());
        }
        let batch = Batch {
            meta: meta_dirty.then(|| self.meta(cluster_ts)),
            apps: apps.iter().map(|id| (id.as_str(), self.apps.get(id))).collect(),
            containers: changes
                .containers
                .iter()
                .filter_map(|id| self.ledger.container(id))
                .collect(),
            nodes: changes
                .nodes
                .iter()
                .filter_map(|h| self.ledger.node(h).map(|n| (h.as_str(), n.state)))
                .collect(),
            agent_nodes: agent_nodes
                .iter()
                .map(|h| (h.as_str(), self.agent_nodes.get(h).map(String::as_str)))
                .collect(),
            // A node changed and no longer in the ledger was removed: its row goes.
            forget_nodes: changes
                .nodes
                .iter()
                .filter(|h| self.ledger.node(h).is_none())
                .map(String::as_str)
                .collect(),
            whole: false,
        };
        let written = self.store.write(&batch);
        drop(batch);
        match written {
            Ok(()) => {
                self.store_health.stored_container_seq = container_seq;
                Ok(())
            }
            Err(e) => {
                self.store_failed(&e);
                Err(e)
            }
        }
    }

    /// Writes the whole state in one transaction (every row not in it deleted); ends a
    /// failure when it succeeds. Tried at most every [`WHOLE_WRITE_RETRY`].
    fn write_whole(&mut self, cluster_ts: u64) -> Result<(), StoreError> {
        let now = Instant::now();
        if let Some(t) = self.store_health.last_whole_attempt {
            if now.duration_since(t) < WHOLE_WRITE_RETRY {
                let why = self.store_health.failing.clone().unwrap_or_default();
                return Err(StoreError::Write(why));
            }
        }
        self.store_health.last_whole_attempt = Some(now);
        self.apps.take_dirty();
        self.ledger.take_changes();
        self.meta_dirty = false;
        self.agent_nodes_dirty.clear();
        let container_seq = self.ledger.next_container_seq();
        let batch = Batch {
            meta: Some(self.meta(cluster_ts)),
            apps: self.apps.values().map(|a| (a.report.id.as_str(), Some(a))).collect(),
            containers: self.ledger.all_containers().collect(),
            nodes: self.ledger.node_states().collect(),
            agent_nodes: self
                .agent_nodes
                .iter()
                .map(|(h, d)| (h.as_str(), Some(d.as_str())))
                .collect(),
            forget_nodes: Vec::new(),
            whole: true,
        };
        let (apps, containers) = (batch.apps.len(), batch.containers.len());
        let written = self.store.write(&batch);
        drop(batch);
        match written {
            Ok(()) => {
                let was = self.store_health.failing.take();
                self.store_health.stored_container_seq = container_seq;
                self.store_health.recoveries += 1;
                self.store_health.last_whole_attempt = None;
                tracing::warn!(
                    apps,
                    containers,
                    "the RM's state store is writable again (it failed with: {}); the whole state was written",
                    was.unwrap_or_default()
                );
                Ok(())
            }
            Err(e) => {
                self.store_failed(&e);
                Err(e)
            }
        }
    }

    fn store_failed(&mut self, e: &StoreError) {
        let h = &mut self.store_health;
        h.write_errors += 1;
        let now = Instant::now();
        let newly = h.failing.is_none();
        if newly {
            h.last_whole_attempt = Some(now);
        }
        h.failing = Some(match e {
            StoreError::Write(why) => why.clone(),
            other => other.to_string(),
        });
        if newly || h.last_logged.is_none_or(|t| now.duration_since(t) >= FAILING_LOG_EVERY) {
            h.last_logged = Some(now);
            tracing::error!(
                error = %e,
                errors = h.write_errors,
                "the RM's state could not be saved: grants and state changes are refused (503) until it can be; \
                 the whole state is written again then"
            );
        }
    }
}

/// The state lock (see the module doc).
pub(super) struct StateGuard<'a> {
    pub(super) st: parking_lot::MutexGuard<'a, RmState>,
    pub(super) cluster_ts: u64,
}

impl StateGuard<'_> {
    /// Commits every change made so far; `Err` (503) when the store cannot take it, and
    /// then the caller must not acknowledge anything that depends on it.
    pub(super) fn commit(&mut self) -> Result<(), ApiError> {
        let ts = self.cluster_ts;
        self.st.persist(ts).map_err(|e| ApiError::store_unavailable(&e))
    }

    /// Commits, logging a failure (for paths that cannot refuse: an exit, an expiry).
    pub(super) fn commit_or_log(&mut self) {
        let ts = self.cluster_ts;
        // `persist` logged and counted the failure.
        let _ = self.st.persist(ts);
    }

    /// `Err` (503) while the store is failing and a whole-state write does not succeed
    /// now: nothing may be granted or changed then.
    pub(super) fn writable(&mut self) -> Result<(), ApiError> {
        if self.st.store_health.failing.is_none() {
            return Ok(());
        }
        let ts = self.cluster_ts;
        self.st.write_whole(ts).map_err(|e| ApiError::store_unavailable(&e))
    }
}

impl std::ops::Deref for StateGuard<'_> {
    type Target = RmState;
    fn deref(&self) -> &RmState {
        &self.st
    }
}

impl std::ops::DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut RmState {
        &mut self.st
    }
}

impl Drop for StateGuard<'_> {
    /// The safety net: whatever a path changed and did not commit is committed now.
    fn drop(&mut self) {
        self.commit_or_log();
    }
}

/// Builds the RM's state from what the store kept (a fresh state when it kept nothing);
/// returns it with the cluster timestamp to use in ids.
pub(super) fn recover_state(
    mut store: Store,
    mut ledger: Ledger,
    mut sched: scheduling::SchedState,
    base_url: &str,
) -> anyhow::Result<(RmState, u64)> {
    let mut apps = Apps::default();
    let Some(r) = store.recover()? else {
        let state = RmState {
            ledger,
            apps,
            reserved: ReservedIds::default(),
            next_app_seq: 0,
            meta_dirty: true,
            store,
            store_health: StoreHealth::default(),
            sched,
            agent_nodes: BTreeMap::new(),
            agent_nodes_dirty: Default::default(),
            removed_hosts: BTreeMap::new(),
        };
        return Ok((state, now_ms()));
    };
    // Node agents' hosts first, NEW (not yet registered again) until their agents
    // register or the re-registration grace ends (`nodes::await_agents`), so that the
    // containers restored on them are kept meanwhile.
    let mut agent_nodes = BTreeMap::new();
    let removed = &r.meta.removed_hosts;
    for (host, doc) in r.agent_nodes {
        if removed.contains_key(&host) {
            tracing::info!(%host, "removed by an administrator: not restored");
            continue;
        }
        match nodes::declared_node(&doc, base_url) {
            Ok(node) if node.host == host => {
                if ledger.node(&host).is_none() {
                    ledger.add_node(node);
                    ledger.set_node_state(&host, NodeState::New);
                }
                agent_nodes.insert(host, doc);
            }
            Ok(node) => tracing::warn!(%host, "the stored agent node names another host ({}): ignored", node.host),
            Err(e) => tracing::warn!(%host, "the stored agent node cannot be read ({e}): ignored"),
        }
    }
    for (host, state) in r.node_states.iter().filter(|(h, _)| !removed.contains_key(h)) {
        // A node agent's host that was RUNNING is NEW until its agent registers again.
        let state = if agent_nodes.contains_key(host) && *state == NodeState::Running {
            &NodeState::New
        } else {
            state
        };
        if ledger.set_node_state(host, *state).is_none() {
            tracing::warn!(%host, "a node of the saved state is no longer in the cluster");
        }
    }
    let (now, wall) = (Instant::now(), now_ms());
    let not_restored: Vec<Ended> = r
        .containers
        .into_iter()
        .filter_map(|c| ledger.restore(c, now, wall))
        .collect();
    // Never re-issue an id: not even one of a grant whose row was never written.
    ledger.continue_container_seq(r.meta.next_container_seq);
    let live = r.apps.iter().filter(|a| !a.report.state.is_final()).count();
    for app in r.apps {
        apps.restore(app);
    }
    for e in &not_restored {
        tracing::warn!(container = %e.container_id, "{}", e.diagnostics);
        // The ledger ended it when it could not restore it: its application hears of it.
        super::transactions::report_ended(&mut apps, e);
    }
    tracing::info!(
        apps = apps.len(),
        unfinished = live,
        containers = ledger.live_containers().len(),
        "RM state recovered"
    );
    // The notices of the RM that stopped are not kept: what their AMs give back in answer
    // is seen before new victims are chosen.
    sched.quiet_after_restart(Instant::now());
    let state = RmState {
        ledger,
        apps,
        reserved: ReservedIds::recovered(r.meta.reserved, r.meta.reserved_by),
        next_app_seq: r.meta.next_app_seq,
        meta_dirty: true,
        store,
        store_health: StoreHealth::default(),
        sched,
        agent_nodes,
        agent_nodes_dirty: Default::default(),
        removed_hosts: r.meta.removed_hosts,
    };
    Ok((state, r.meta.cluster_ts))
}
