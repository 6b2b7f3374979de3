//! Turns to start containers on one shared executor, taken round-robin across
//! applications (issue 29).
//!
//! The in-process backend starts the containers of every simulated host on this one
//! machine, a few at a time (each start forks and execs). With a first-come queue, a
//! hundred jobs that each launch ten tasks at once all wait for the whole thousand: every
//! job's first task starts near the end. Here the waiting starts are kept per application
//! and served one application after another ([`RoundRobin`]), so each job's first task
//! starts within one round of the waiting applications, and no job waits for another's
//! whole batch. Within an application the starts keep their order.
//!
//! [`RoundRobin`] is the pure order; [`Turns`] is the async gate around it (a turn is held
//! by a [`Turn`] and handed to the next waiter when dropped).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::oneshot;

/// Waiters per key, served one key after another, each key's waiters in their order.
#[derive(Debug)]
pub struct RoundRobin<K, W> {
    /// Keys with at least one waiter, in serving order.
    order: VecDeque<K>,
    waiting: HashMap<K, VecDeque<W>>,
}

impl<K, W> Default for RoundRobin<K, W> {
    fn default() -> Self {
        RoundRobin {
            order: VecDeque::new(),
            waiting: HashMap::new(),
        }
    }
}

impl<K: Clone + Eq + std::hash::Hash, W> RoundRobin<K, W> {
    /// `w` waits behind `key`'s earlier waiters; a key new to the queue is served after
    /// every key already waiting.
    pub fn push(&mut self, key: K, w: W) {
        let q = self.waiting.entry(key.clone()).or_default();
        if q.is_empty() {
            self.order.push_back(key);
        }
        q.push_back(w);
    }

    /// The next waiter: the first of the key whose turn it is; that key goes to the back
    /// while it has more.
    pub fn pop(&mut self) -> Option<(K, W)> {
        let key = self.order.pop_front()?;
        let q = self.waiting.get_mut(&key)?;
        let w = q.pop_front()?;
        if q.is_empty() {
            self.waiting.remove(&key);
        } else {
            self.order.push_back(key.clone());
        }
        Some((key, w))
    }

    /// How many wait.
    pub fn len(&self) -> usize {
        self.waiting.values().map(VecDeque::len).sum()
    }

    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

struct Gate {
    free: usize,
    queue: RoundRobin<String, oneshot::Sender<Turn>>,
}

/// At most `limit` turns held at once, handed out round-robin across applications.
#[derive(Clone)]
pub struct Turns {
    gate: Arc<Mutex<Gate>>,
}

/// A held turn; dropping it hands it to the next waiter.
pub struct Turn {
    gate: Option<Arc<Mutex<Gate>>>,
}

impl Turns {
    pub fn new(limit: usize) -> Self {
        Turns {
            gate: Arc::new(Mutex::new(Gate {
                free: limit.max(1),
                queue: RoundRobin::default(),
            })),
        }
    }

    /// Waits for a turn of `app`'s. A waiter that is dropped before its turn comes gives
    /// it up (the turn goes to the next).
    pub async fn take(&self, app: &str) -> Turn {
        let rx = {
            let mut g = self.gate.lock();
            if g.free > 0 && g.queue.is_empty() {
                g.free -= 1;
                return Turn {
                    gate: Some(self.gate.clone()),
                };
            }
            let (tx, rx) = oneshot::channel();
            g.queue.push(app.to_string(), tx);
            rx
        };
        match rx.await {
            Ok(turn) => turn,
            // The gate hands every queued waiter a turn or drops it only with the gate,
            // which this `Turns` keeps alive: not reached; a turn of no gate holds nothing.
            Err(_) => Turn { gate: None },
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let Some(gate) = self.gate.take() else { return };
        let mut g = gate.lock();
        // Hand the turn on to the next waiter still waiting; with none, it is free again.
        while let Some((_, tx)) = g.queue.pop() {
            let next = Turn {
                gate: Some(gate.clone()),
            };
            match tx.send(next) {
                Ok(()) => return,
                // That waiter is gone and the turn came back: dropped with its gate it
                // would re-enter this lock, so it is emptied and the next waiter tried.
                Err(mut back) => {
                    back.gate = None;
                }
            }
        }
        g.free += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Each application's first waiter is served before any application's second, and
    /// each application's waiters keep their order.
    #[test]
    fn every_application_gets_its_first_turn_in_the_first_round() {
        let mut rr = RoundRobin::default();
        for app in ["a", "b", "c"] {
            for i in 0..3 {
                rr.push(app, (app, i));
            }
        }
        rr.push("d", ("d", 0));
        let order: Vec<_> = std::iter::from_fn(|| rr.pop().map(|(_, w)| w)).collect();
        assert_eq!(&order[..4], &[("a", 0), ("b", 0), ("c", 0), ("d", 0)]);
        assert_eq!(
            &order[4..],
            &[("a", 1), ("b", 1), ("c", 1), ("a", 2), ("b", 2), ("c", 2)]
        );
        assert!(rr.is_empty());
    }

    proptest! {
        /// Whatever is pushed comes out once, each key's waiters in order, and no key is
        /// served twice while another waiting key has not been served since.
        #[test]
        fn round_robin_serves_everyone_in_order(pushes in proptest::collection::vec(0u8..6, 0..60)) {
            let mut rr = RoundRobin::default();
            for (i, k) in pushes.iter().enumerate() {
                rr.push(*k, i);
            }
            prop_assert_eq!(rr.len(), pushes.len());
            let out: Vec<(u8, usize)> = std::iter::from_fn(|| rr.pop()).collect();
            prop_assert_eq!(out.len(), pushes.len());
            for k in 0u8..6 {
                let mine: Vec<usize> = out.iter().filter(|(kk, _)| *kk == k).map(|(_, w)| *w).collect();
                let pushed: Vec<usize> = pushes.iter().enumerate().filter(|(_, kk)| **kk == k).map(|(i, _)| i).collect();
                prop_assert_eq!(mine, pushed);
            }
            // Fairness: between two turns of a key, every key that still had waiters
            // (all were pushed up front) is served at most once more than it.
            let mut served: HashMap<u8, usize> = HashMap::new();
            let total: HashMap<u8, usize> = pushes.iter().fold(HashMap::new(), |mut m, k| { *m.entry(*k).or_default() += 1; m });
            for (k, _) in &out {
                let n = served.entry(*k).or_default();
                *n += 1;
                let now = *n;
                for (other, t) in &total {
                    let s = served.get(other).copied().unwrap_or(0);
                    if s < *t {
                        prop_assert!(now <= s + 1, "key {k} served {now} times while {other} waits with {s}");
                    }
                }
            }
        }
    }

    /// Through the async gate: with one turn held, the waiters of three applications are
    /// let in round-robin, and a waiter that gave up is skipped.
    #[tokio::test]
    async fn turns_are_handed_round_robin_and_skip_who_left() {
        let turns = Turns::new(1);
        let first = turns.take("a").await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut handles = Vec::new();
        for (app, i) in [("a", 1), ("a", 2), ("b", 1), ("c", 1), ("b", 2)] {
            let (mine, tx) = (turns.clone(), tx.clone());
            handles.push(tokio::spawn(async move {
                let t = mine.take(app).await;
                let _ = tx.send((app, i));
                drop(t);
            }));
            // Queued in this order.
            tokio::task::yield_now().await;
            while turns.gate.lock().queue.len() < handles.len() {
                tokio::task::yield_now().await;
            }
        }
        // One that gives up before its turn.
        let quitter = {
            let mine = turns.clone();
            tokio::spawn(async move {
                let _t = mine.take("q").await;
                unreachable!("aborted before its turn");
            })
        };
        while turns.gate.lock().queue.len() < 6 {
            tokio::task::yield_now().await;
        }
        quitter.abort();
        let _ = quitter.await;
        drop(first);
        for h in handles {
            h.await.unwrap_or_else(|e| panic!("waiter failed: {e}"));
        }
        drop(tx);
        let mut order = Vec::new();
        while let Some(x) = rx.recv().await {
            order.push(x);
        }
        assert_eq!(order, vec![("a", 1), ("b", 1), ("c", 1), ("a", 2), ("b", 2)]);
        // Every turn came back: one can be taken at once.
        assert_eq!(turns.gate.lock().free, 1);
    }
}
