//! Shared work permits that no one user can hold all of: the RM's spec checks and start
//! estimates are CPU, bounded to a few at a time for everybody; without a per-user bound
//! one tenant's loop held every permit and every other user's submit or `gpuam plan --rm`
//! was refused (429) for as long as the loop ran (eleventh pass). A [`FairPermits`] pool has
//! `total` permits, of which each user holds at most `per_user` at once: a user's second
//! call waits for its own first, not for the pool, so the rest of the pool stays free for
//! others.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Users' entries kept beyond this are dropped when idle (nobody holding or waiting).
const KEEP_USERS: usize = 1024;

/// A pool of permits with a bound per user.
pub(super) struct FairPermits {
    total: Arc<Semaphore>,
    per_user: usize,
    users: parking_lot::Mutex<HashMap<String, Arc<Semaphore>>>,
}

/// One permit of a [`FairPermits`] pool, and its user's: both are given back when it drops
/// (it may be moved to the thread doing the work, so a caller that hangs up frees nothing
/// early).
pub(super) struct FairPermit {
    _user: OwnedSemaphorePermit,
    _total: OwnedSemaphorePermit,
}

impl FairPermits {
    pub(super) fn new(total: usize, per_user: usize) -> Self {
        FairPermits {
            total: Arc::new(Semaphore::new(total)),
            per_user: per_user.max(1),
            users: parking_lot::Mutex::new(HashMap::new()),
        }
    }

    /// The pool's permits free now.
    #[cfg(test)]
    pub(super) fn available(&self) -> usize {
        self.total.available_permits()
    }

    fn user(&self, who: &str) -> Arc<Semaphore> {
        let mut users = self.users.lock();
        if users.len() >= KEEP_USERS && !users.contains_key(who) {
            // Only entries nobody holds or waits on (the map's own reference alone).
            users.retain(|_, s| Arc::strong_count(s) > 1);
        }
        users
            .entry(who.to_string())
            .or_insert_with(|| Arc::new(Semaphore::new(self.per_user)))
            .clone()
    }

    /// A permit for `who`, waiting at most `wait` for its own turn and then the pool's;
    /// `None` when none came in that time.
    pub(super) async fn acquire(&self, who: &str, wait: Duration) -> Option<FairPermit> {
        let deadline = tokio::time::Instant::now() + wait;
        let user = tokio::time::timeout_at(deadline, self.user(who).acquire_owned())
            .await
            .ok()?
            .ok()?;
        let total = tokio::time::timeout_at(deadline, self.total.clone().acquire_owned())
            .await
            .ok()?
            .ok()?;
        Some(FairPermit {
            _user: user,
            _total: total,
        })
    }

    /// A permit for `who` now, or `None`.
    pub(super) fn try_acquire(&self, who: &str) -> Option<FairPermit> {
        let user = self.user(who).try_acquire_owned().ok()?;
        let total = self.total.clone().try_acquire_owned().ok()?;
        Some(FairPermit {
            _user: user,
            _total: total,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One user's loop holds at most its own share: another user still gets a permit at
    /// once while it runs, and the pool's bound holds for all together.
    #[tokio::test]
    async fn one_users_loop_leaves_the_rest_of_the_pool_to_others() {
        let pool = FairPermits::new(2, 1);
        let bob1 = pool.try_acquire("bob").expect("a free pool");
        assert!(pool.try_acquire("bob").is_none(), "bob's second waits for his first");
        // Held all along: the wait can only run out, whatever the machine's load.
        assert!(pool.acquire("bob", Duration::from_millis(50)).await.is_none());
        let alice = pool
            .acquire("alice", Duration::ZERO)
            .await
            .expect("alice is not behind bob");
        assert!(pool.try_acquire("carol").is_none(), "the pool holds two at most");
        assert_eq!(pool.available(), 0);
        drop(bob1);
        let bob2 = pool.try_acquire("bob").expect("bob's turn again");
        drop((alice, bob2));
        assert_eq!(pool.available(), 2, "every permit given back");
    }

    /// A user waiting for the pool gets the next permit given back within its wait.
    #[tokio::test]
    async fn a_waiting_user_gets_the_next_free_permit() {
        let pool = Arc::new(FairPermits::new(1, 1));
        let alice = pool.try_acquire("alice").unwrap();
        let p = pool.clone();
        let waiter = tokio::spawn(async move { p.acquire("bob", Duration::from_secs(600)).await.is_some() });
        // Bob holds his own turn once he waits for the pool's: only then is alice's given back.
        while pool.user("bob").available_permits() > 0 {
            tokio::task::yield_now().await;
        }
        assert!(!waiter.is_finished(), "bob waits while alice holds the pool");
        drop(alice);
        assert!(waiter.await.unwrap(), "bob got alice's permit once she gave it back");
    }

    /// Idle users' entries are dropped once many users were seen; held ones are kept.
    #[test]
    fn idle_users_are_forgotten_past_the_bound() {
        let pool = FairPermits::new(2, 1);
        let held = pool.try_acquire("u0").unwrap();
        for i in 1..KEEP_USERS + 10 {
            drop(pool.try_acquire(&format!("u{i}")));
        }
        let users = pool.users.lock();
        assert!(users.len() <= KEEP_USERS, "{}", users.len());
        assert!(users.contains_key("u0"), "a user holding a permit is kept");
        drop(users);
        drop(held);
    }
}
