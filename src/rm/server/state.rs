//! The RM's state and its one lock: the ledger, the applications, the reserved ids and the
//! store. [`StateGuard`] is the only way in; dropping it writes what changed to the store
//! in one transaction before the lock is released. Also rebuilding the state from the
//! store at start-up, and the two small rules every ending follows (queue the completion
//! for the application; release all of an application's containers).

use super::*;

/// Most application ids handed out by new-application and not yet submitted that are
/// remembered (the oldest are forgotten first), so that calling new-application in a
/// loop cannot grow the RM without bound.
pub(super) const MAX_RESERVED_IDS: usize = 10_000;

pub(super) struct RmState {
    pub(super) ledger: Ledger,
    pub(super) apps: Apps,
    /// Ids handed out by new-application and not yet submitted.
    /// By sequence number, so the oldest are the first ones.
    pub(super) reserved: BTreeMap<u32, String>,
    pub(super) next_app_seq: u32,
    /// `next_app_seq` or `reserved` changed since the last write.
    pub(super) meta_dirty: bool,
    pub(super) store: Store,
    /// Writes to the store that failed (the RM keeps serving from memory).
    pub(super) store_errors: u64,
    /// The queues and the preemptions in progress (not persisted: a restarted RM decides
    /// again from what runs).
    pub(super) sched: scheduling::SchedState,
}

impl RmState {
    /// Remembers an id handed out by new-application (forgetting the oldest beyond
    /// [`MAX_RESERVED_IDS`]).
    pub(super) fn reserve(&mut self, id: String) {
        let Some(seq) = app_seq(&id) else {
            return;
        };
        self.reserved.insert(seq, id);
        while self.reserved.len() > MAX_RESERVED_IDS {
            self.reserved.pop_first();
        }
        self.meta_dirty = true;
    }

    /// A fresh application id.
    pub(super) fn next_app_id(&mut self, cluster_ts: u64) -> String {
        self.next_app_seq += 1;
        self.meta_dirty = true;
        app_id(cluster_ts, self.next_app_seq)
    }

    pub(super) fn is_reserved(&self, id: &str) -> bool {
        app_seq(id).is_some_and(|seq| self.reserved.get(&seq).is_some_and(|r| r == id))
    }

    /// Claims a reserved id; false when it was not reserved.
    pub(super) fn unreserve(&mut self, id: &str) -> bool {
        let had = self.is_reserved(id);
        if let Some(seq) = app_seq(id).filter(|_| had) {
            self.reserved.remove(&seq);
        }
        self.meta_dirty |= had;
        had
    }

    /// Writes what changed since the last call in one transaction.
    pub(super) fn persist(&mut self, cluster_ts: u64) {
        let apps = self.apps.take_dirty();
        let changes = self.ledger.take_changes();
        let meta_dirty = std::mem::take(&mut self.meta_dirty);
        if !self.store.is_durable() || (apps.is_empty() && changes.is_empty() && !meta_dirty) {
            return;
        }
        let batch = Batch {
            meta: meta_dirty.then(|| Meta {
                cluster_ts,
                next_app_seq: self.next_app_seq,
                reserved: self.reserved.values().cloned().collect(),
            }),
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
        };
        if let Err(e) = self.store.write(&batch) {
            self.store_errors += 1;
            tracing::error!(error = %e, "the RM's state could not be saved; a restart now would lose it");
        }
    }
}

/// The state lock; dropping it persists what changed (see the module doc).
pub(super) struct StateGuard<'a> {
    pub(super) st: parking_lot::MutexGuard<'a, RmState>,
    pub(super) cluster_ts: u64,
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
    fn drop(&mut self) {
        self.st.persist(self.cluster_ts);
    }
}

/// Builds the RM's state from what the store kept (a fresh state when it kept nothing);
/// returns it with the cluster timestamp to use in ids.
pub(super) fn recover_state(
    store: Store,
    mut ledger: Ledger,
    sched: scheduling::SchedState,
) -> anyhow::Result<(RmState, u64)> {
    let mut apps = Apps::default();
    let Some(r) = store.recover()? else {
        let state = RmState {
            ledger,
            apps,
            reserved: BTreeMap::new(),
            next_app_seq: 0,
            meta_dirty: true,
            store,
            store_errors: 0,
            sched,
        };
        return Ok((state, now_ms()));
    };
    for (host, state) in &r.node_states {
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
    let live = r.apps.iter().filter(|a| !a.report.state.is_final()).count();
    for app in r.apps {
        apps.restore(app);
    }
    for e in &not_restored {
        tracing::warn!(container = %e.container_id, "{}", e.diagnostics);
        queue_completed(&mut apps, e);
    }
    tracing::info!(
        apps = apps.len(),
        unfinished = live,
        containers = ledger.live_containers().len(),
        "RM state recovered"
    );
    let state = RmState {
        ledger,
        apps,
        reserved: r
            .meta
            .reserved
            .into_iter()
            .filter_map(|id| Some((app_seq(&id)?, id)))
            .collect(),
        next_app_seq: r.meta.next_app_seq,
        meta_dirty: true,
        store,
        store_errors: 0,
        sched,
    };
    Ok((state, r.meta.cluster_ts))
}

/// Queues an ended container for its application's next allocate answer.
pub(super) fn queue_completed(apps: &mut Apps, e: &Ended) {
    if let Some(app) = apps.get_mut(&e.app_id) {
        app.pending_completed.push(CompletedContainer {
            container_id: e.container_id.clone(),
            exit_status: e.exit_status,
            diagnostics: e.diagnostics.clone(),
        });
    }
}

/// Completes every live container of `app_id`, queueing them for the app.
pub(super) fn release_all(st: &mut RmState, app_id: &str, exit: i32, why: &str) -> Vec<Ended> {
    let ids = st.ledger.live_containers_of(app_id);
    let ended: Vec<Ended> = ids.iter().filter_map(|c| st.ledger.stop(c, exit, why)).collect();
    for e in &ended {
        queue_completed(&mut st.apps, e);
    }
    ended
}
