//! The node agent's one decision between a container's start and a stop that comes before
//! it (the RM stops a container whose start answer it never got): the start runs, or it
//! never will. Pure state; the agent holds it under one lock.
//!
//! The race it closes: a start passes its "was it stopped?" check, then spends time before
//! the executor records the container (the task user's lookup, a sweep of old records);
//! a stop arriving in that window found no record, marked the id stopped and reported it
//! dead, and the RM freed its GPUs while the start went on and ran the task on them. Now
//! a start is *under way* from its check until the executor has recorded it (or failed),
//! and a stop that finds no record asks the gate: under way → wait for the record and
//! stop that; not under way and still unknown → never runs (a later start is refused).

use std::collections::{BTreeSet, VecDeque};

/// Most stopped-before-started container ids remembered (oldest forgotten first).
pub const MAX_STOPPED_UNSTARTED: usize = 10_000;

/// Starts under way and ids stopped before they started.
#[derive(Debug, Default)]
pub struct StartGate {
    stopped: VecDeque<String>,
    starting: BTreeSet<String>,
}

/// Why a start may not begin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Stopped before it started: it never runs.
    Stopped,
    /// Another start of the same container is under way.
    AlreadyStarting,
}

/// What a stop that found no record of its container does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownStop {
    /// Its start is under way: wait until the executor has its record, then stop that.
    WaitForStart,
    /// The executor has it now (its start ended between the stop's look and this one):
    /// stop it.
    StopRecorded,
    /// Nothing started and nothing will: report it dead.
    NeverRuns,
}

impl StartGate {
    /// A start of `id` begins (the caller then records and spawns it, and calls
    /// [`StartGate::end`] whatever the outcome).
    pub fn begin(&mut self, id: &str) -> Result<(), Refused> {
        if self.stopped.iter().any(|s| s == id) {
            return Err(Refused::Stopped);
        }
        if !self.starting.insert(id.to_string()) {
            return Err(Refused::AlreadyStarting);
        }
        Ok(())
    }

    /// The start of `id` is over: the executor has its record, or it failed and left none.
    pub fn end(&mut self, id: &str) {
        self.starting.remove(id);
    }

    /// A stop found no record of `id`; `recorded`: whether the executor has one now (looked
    /// at under the same lock as this call).
    pub fn stop_unknown(&mut self, id: &str, recorded: bool) -> UnknownStop {
        if self.starting.contains(id) {
            return UnknownStop::WaitForStart;
        }
        if recorded {
            return UnknownStop::StopRecorded;
        }
        if !self.stopped.iter().any(|s| s == id) {
            self.stopped.push_back(id.to_string());
            while self.stopped.len() > MAX_STOPPED_UNSTARTED {
                self.stopped.pop_front();
            }
        }
        UnknownStop::NeverRuns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every interleaving of one start (check, record, end) and one stop that found no
    /// record (its gate decision): the container is either running and stopped through
    /// its record, or never runs; never reported dead while it runs.
    #[test]
    fn a_stop_and_a_start_never_leave_a_task_running_that_was_reported_dead() {
        // The start's steps: 0 = begin, 1 = the executor records it, 2 = end.
        // The stop's one step (under the lock) can come before, between or after them.
        for stop_at in 0..=3 {
            let mut gate = StartGate::default();
            let mut recorded = false;
            let mut runs = false;
            let mut reported_dead = false;
            let mut stopped_through_record = false;
            let mut waited = false;
            let mut began = true;
            for step in 0..=3 {
                if step == stop_at {
                    match gate.stop_unknown("c", recorded) {
                        UnknownStop::WaitForStart => waited = true,
                        UnknownStop::StopRecorded => stopped_through_record = true,
                        UnknownStop::NeverRuns => reported_dead = true,
                    }
                }
                match step {
                    0 => began = gate.begin("c").is_ok(),
                    1 if began => {
                        recorded = true;
                        runs = true;
                    }
                    2 if began => gate.end("c"),
                    _ => {}
                }
            }
            if waited {
                // The waiting stop looks again once the start is over: it finds the record.
                assert!(recorded, "stop at {stop_at}: waited for a start that recorded nothing");
                assert_eq!(gate.stop_unknown("c", recorded), UnknownStop::StopRecorded);
                stopped_through_record = true;
            }
            assert!(
                !(runs && reported_dead),
                "stop at {stop_at}: reported dead while it runs"
            );
            assert!(
                !runs || stopped_through_record,
                "stop at {stop_at}: it runs and the stop did not reach it"
            );
        }
    }

    #[test]
    fn a_stopped_id_is_refused_and_a_second_start_waits_its_turn() {
        let mut gate = StartGate::default();
        assert_eq!(gate.stop_unknown("a", false), UnknownStop::NeverRuns);
        assert_eq!(
            gate.stop_unknown("a", false),
            UnknownStop::NeverRuns,
            "asked again, the same"
        );
        assert_eq!(gate.begin("a"), Err(Refused::Stopped));
        assert_eq!(gate.begin("b"), Ok(()));
        assert_eq!(gate.begin("b"), Err(Refused::AlreadyStarting));
        gate.end("b");
        assert_eq!(gate.begin("b"), Ok(()), "a start that ended leaves no mark");
    }

    #[test]
    fn the_stopped_list_is_bounded_oldest_first() {
        let mut gate = StartGate::default();
        for i in 0..=MAX_STOPPED_UNSTARTED {
            gate.stop_unknown(&format!("c{i}"), false);
        }
        assert_eq!(gate.begin("c0"), Ok(()), "the oldest is forgotten");
        gate.end("c0");
        assert_eq!(gate.begin(&format!("c{MAX_STOPPED_UNSTARTED}")), Err(Refused::Stopped));
    }
}
