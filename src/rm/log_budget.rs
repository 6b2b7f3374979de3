//! How much disk the logs the RM keeps may take (RELIABILITY §2e, seventh pass): the
//! decision, as pure functions, whether a container's collected logs are kept and whose
//! older kept logs go to make room (`decide`); the free-space reserve under it; the bound
//! on a running AM's own output (`am_output_cut`); and the sentences that say why a log
//! is missing. The I/O (reading sizes, statvfs, removing and writing files) is in
//! `crate::rm::server::logs` and `crate::rm::server::am_supervisor`.
//!
//! The rule: before a container's logs (`need` bytes) are kept for an application of
//! `user`,
//! 1. if the work dir's filesystem would have less than `min_free_bytes` free after
//!    them, they are not kept (the state store may share that disk; it gets the rest);
//! 2. if `user`'s kept bytes would pass `user_bytes`, that user's kept logs of ended
//!    applications go, oldest ended first;
//! 3. if everyone's would pass `total_bytes`, more go: first the user's own remaining
//!    ended applications, then anyone's, oldest ended first;
//! 4. if it still does not fit (what is left belongs to running jobs, or the application
//!    being collected), nothing goes and the logs are not kept.
//!
//! An application's kept logs go together (its directory); the application whose
//! container is being collected never goes, nor one that has not ended.

use std::collections::HashSet;

/// What one kept file counts for: its length, but at least a disk block (eighth pass: 300
/// containers printing one byte each counted 300 bytes and took 600 files and 1.28 MB).
pub const FILE_FLOOR_BYTES: u64 = 4096;

/// The bytes a kept file of `len` bytes counts for ([`FILE_FLOOR_BYTES`]).
pub fn counted(len: u64) -> u64 {
    len.max(FILE_FLOOR_BYTES)
}

/// The last `max` bytes of `text`, cut on a character boundary: a log is kept to its bound
/// after its bytes became text (eighth pass: invalid UTF-8 became U+FFFD, three bytes each,
/// and a 4 KiB log of 0xff bytes was kept as 12 KiB).
pub fn tail(text: &str, max: u64) -> &str {
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    if text.len() <= max {
        return text;
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// The bounds (`rm.collected_logs_user_bytes`, `rm.collected_logs_total_bytes`,
/// `rm.min_free_disk_mb`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    pub user_bytes: u64,
    pub total_bytes: u64,
    pub min_free_bytes: u64,
}

/// One application's kept logs as the RM counts them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptApp {
    pub app: String,
    /// Its owner (empty for logs of an application the RM no longer knows).
    pub user: String,
    pub bytes: u64,
    /// When it ended (ms since the epoch); `None` while it runs.
    pub ended_ms: Option<u64>,
}

/// Which budget a removal or a refusal is over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Over {
    /// The user's (`rm.collected_logs_user_bytes`).
    User(String),
    /// Everyone's (`rm.collected_logs_total_bytes`).
    Total,
}

impl Over {
    fn what(&self) -> String {
        match self {
            Over::User(u) => format!("{u}'s log budget (rm.collected_logs_user_bytes)"),
            Over::Total => "the cluster's log budget (rm.collected_logs_total_bytes)".to_string(),
        }
    }
}

/// Why a container's logs were not kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotKept {
    /// Over a budget, and what remains of it belongs to running jobs.
    Over(Over),
    /// The disk would have less than the reserve left.
    LowDisk { free_bytes: u64, min_free_bytes: u64 },
    /// The free space could not be read (nothing is kept then).
    FreeSpaceUnknown(String),
}

impl NotKept {
    /// The sentence the log routes and `gpuam logs` show.
    pub fn text(&self) -> String {
        match self {
            NotKept::Over(o) => format!(
                "not kept: over {}; the rest of it holds logs of running jobs, which are never removed for a new one",
                o.what()
            ),
            NotKept::LowDisk {
                free_bytes,
                min_free_bytes,
            } => format!(
                "not kept: the RM's disk has {} MiB free, below its reserve (rm.min_free_disk_mb = {})",
                free_bytes >> 20,
                min_free_bytes >> 20
            ),
            NotKept::FreeSpaceUnknown(e) => {
                format!("not kept: the free space of the RM's disk could not be read ({e})")
            }
        }
    }
}

/// The sentence for an application whose kept logs were removed to keep a budget.
pub fn removed_text(over: &Over) -> String {
    format!(
        "removed: the kept logs of this ended job went to keep {} for newer logs",
        over.what()
    )
}

/// What to do with a container's collected logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Keep them, after removing these applications' kept logs (in this order).
    Keep { remove: Vec<(String, Over)> },
    /// Keep nothing, remove nothing.
    Refuse(NotKept),
}

/// Whether `need` more bytes leave at least the reserve free.
pub fn reserve_allows(free_bytes: u64, need: u64, min_free_bytes: u64) -> bool {
    free_bytes.saturating_sub(need) >= min_free_bytes && free_bytes >= need
}

/// The decision for `need` bytes of a container of application `app`, owned by `user`,
/// given what is kept now (`kept`, one entry per application) and the disk's free bytes
/// (`Err`: unreadable). See the module's rule.
pub fn decide(
    kept: &[KeptApp],
    app: &str,
    user: &str,
    need: u64,
    free: Result<u64, String>,
    budget: &Budget,
) -> Decision {
    let free = match free {
        Ok(f) => f,
        Err(e) => return Decision::Refuse(NotKept::FreeSpaceUnknown(e)),
    };
    if !reserve_allows(free, need, budget.min_free_bytes) {
        return Decision::Refuse(NotKept::LowDisk {
            free_bytes: free,
            min_free_bytes: budget.min_free_bytes,
        });
    }
    // Removable: ended, not the one collected for; oldest ended first.
    let mut removable: Vec<&KeptApp> = kept
        .iter()
        .filter(|k| k.ended_ms.is_some() && k.app != app && k.bytes > 0)
        .collect();
    removable.sort_by(|a, b| a.ended_ms.cmp(&b.ended_ms).then_with(|| a.app.cmp(&b.app)));
    let (mine, others): (Vec<&KeptApp>, Vec<&KeptApp>) = removable.into_iter().partition(|k| k.user == user);

    let mut remove: Vec<(String, Over)> = Vec::new();
    let mut gone: HashSet<&str> = HashSet::new();
    let mut user_used: u64 = kept.iter().filter(|k| k.user == user).map(|k| k.bytes).sum();
    for k in &mine {
        if user_used.saturating_add(need) <= budget.user_bytes {
            break;
        }
        user_used = user_used.saturating_sub(k.bytes);
        gone.insert(&k.app);
        remove.push((k.app.clone(), Over::User(user.to_string())));
    }
    if user_used.saturating_add(need) > budget.user_bytes {
        return Decision::Refuse(NotKept::Over(Over::User(user.to_string())));
    }
    let mut total: u64 = kept
        .iter()
        .filter(|k| !gone.contains(k.app.as_str()))
        .map(|k| k.bytes)
        .sum();
    for k in mine.iter().chain(&others).filter(|k| !gone.contains(k.app.as_str())) {
        if total.saturating_add(need) <= budget.total_bytes {
            break;
        }
        total = total.saturating_sub(k.bytes);
        remove.push((k.app.clone(), Over::Total));
    }
    if total.saturating_add(need) > budget.total_bytes {
        return Decision::Refuse(NotKept::Over(Over::Total));
    }
    Decision::Keep { remove }
}

/// A running AM's output file of `len` bytes, bounded to `bound`: `Some(n)` when it is over
/// and its last `n` bytes become the older generation (`am.stdout.1`, replacing the one
/// before) while the file starts again; `None` while it fits.
pub fn am_output_cut(len: u64, bound: u64) -> Option<u64> {
    (len > bound).then_some(bound.min(len))
}

/// The line a cut AM output file starts again with.
pub fn am_output_cut_line(file: &str, bound: u64, now_ms: u64) -> String {
    format!(
        "[gpuam rm: at {now_ms} ms this file passed rm.am_output_bytes ({bound}); its last {bound} bytes are in {file}.1, anything older is gone]\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn budget(user: u64, total: u64) -> Budget {
        Budget {
            user_bytes: user,
            total_bytes: total,
            min_free_bytes: 100 * MIB,
        }
    }

    fn app(id: &str, user: &str, bytes: u64, ended: Option<u64>) -> KeptApp {
        KeptApp {
            app: id.into(),
            user: user.into(),
            bytes,
            ended_ms: ended,
        }
    }

    const FREE: Result<u64, String> = Ok(1 << 40);

    fn removed(d: &Decision) -> Vec<&str> {
        match d {
            Decision::Keep { remove } => remove.iter().map(|(a, _)| a.as_str()).collect(),
            Decision::Refuse(n) => panic!("refused: {}", n.text()),
        }
    }

    #[test]
    fn within_both_budgets_nothing_goes() {
        let kept = [app("a1", "alice", 3, Some(1)), app("b1", "bob", 3, Some(0))];
        let d = decide(&kept, "a2", "alice", 4, FREE, &budget(10, 20));
        assert_eq!(d, Decision::Keep { remove: vec![] });
    }

    #[test]
    fn over_her_budget_the_users_oldest_ended_logs_go_first_and_never_anothers() {
        let kept = [
            app("b0", "bob", 5, Some(0)),
            app("a2", "alice", 4, Some(20)),
            app("a1", "alice", 4, Some(10)),
            app("a3", "alice", 1, None),
        ];
        // alice holds 9 of 10; 4 more: a1 (oldest ended) goes, 5 + 4 fits.
        let d = decide(&kept, "a4", "alice", 4, FREE, &budget(10, 100));
        assert_eq!(removed(&d), vec!["a1"]);
        let Decision::Keep { remove } = &d else { unreachable!() };
        assert_eq!(remove[0].1, Over::User("alice".into()));
        // 9 more: a1 and a2 go (a3 runs and stays), bob's stays.
        let d = decide(&kept, "a4", "alice", 9, FREE, &budget(10, 100));
        assert_eq!(removed(&d), vec!["a1", "a2"]);
    }

    #[test]
    fn what_running_jobs_hold_is_never_removed_and_the_log_is_refused_with_its_reason() {
        let kept = [app("a1", "alice", 8, None), app("a0", "alice", 1, Some(5))];
        let d = decide(&kept, "a2", "alice", 4, FREE, &budget(10, 100));
        assert_eq!(d, Decision::Refuse(NotKept::Over(Over::User("alice".into()))));
        let text = match d {
            Decision::Refuse(n) => n.text(),
            _ => unreachable!(),
        };
        assert!(
            text.starts_with("not kept: over alice's log budget (rm.collected_logs_user_bytes)"),
            "{text}"
        );
        // Nothing is removed in vain: a0 stays although it could go.
    }

    #[test]
    fn the_application_collected_for_is_never_removed_even_when_ended() {
        let kept = [app("a1", "alice", 8, Some(1))];
        let d = decide(&kept, "a1", "alice", 4, FREE, &budget(10, 100));
        assert_eq!(d, Decision::Refuse(NotKept::Over(Over::User("alice".into()))));
    }

    #[test]
    fn over_the_total_the_users_own_go_first_then_anyones_oldest() {
        let kept = [
            app("b1", "bob", 6, Some(1)),
            app("c1", "carol", 6, Some(2)),
            app("a1", "alice", 2, Some(50)),
            app("orphan", "", 3, Some(0)),
        ];
        // Total 17 of 20; alice adds 8 (her budget 10: fits). 25 > 20: her a1 goes first
        // (23), then the oldest of anyone: the orphan (20: fits).
        let d = decide(&kept, "a2", "alice", 8, FREE, &budget(10, 20));
        assert_eq!(removed(&d), vec!["a1", "orphan"]);
        let Decision::Keep { remove } = &d else { unreachable!() };
        assert!(remove.iter().all(|(_, o)| *o == Over::Total));
        // 12 more (over her 10): refused on her own budget before the total is looked at.
        let d = decide(&kept, "a2", "alice", 12, FREE, &budget(10, 100));
        assert_eq!(d, Decision::Refuse(NotKept::Over(Over::User("alice".into()))));
    }

    #[test]
    fn user_then_total_removals_add_up() {
        let kept = [
            app("a1", "alice", 5, Some(1)),
            app("a2", "alice", 5, Some(2)),
            app("b1", "bob", 9, Some(0)),
            app("b2", "bob", 1, None),
        ];
        // alice: 10 + 5 > 10: a1 goes (user). Total: 20 - 5 + 5 = 20 > 18: a2 goes (hers
        // first), 15: fits; bob's stay.
        let d = decide(&kept, "a3", "alice", 5, FREE, &budget(10, 18));
        let Decision::Keep { remove } = d else { panic!() };
        assert_eq!(
            remove,
            vec![("a1".into(), Over::User("alice".into())), ("a2".into(), Over::Total)]
        );
    }

    #[test]
    fn over_the_total_with_only_running_jobs_is_refused() {
        let kept = [app("b1", "bob", 18, None)];
        let d = decide(&kept, "a1", "alice", 4, FREE, &budget(10, 20));
        assert_eq!(d, Decision::Refuse(NotKept::Over(Over::Total)));
    }

    #[test]
    fn below_the_reserve_nothing_is_kept_nor_removed() {
        let kept = [app("a1", "alice", 8, Some(1))];
        let d = decide(&kept, "a2", "alice", 4 * MIB, Ok(102 * MIB), &budget(1 << 30, 1 << 30));
        let Decision::Refuse(n) = d else { panic!() };
        assert_eq!(
            n.text(),
            "not kept: the RM's disk has 102 MiB free, below its reserve (rm.min_free_disk_mb = 100)"
        );
        let d = decide(&kept, "a2", "alice", 1, Err("EIO".into()), &budget(1 << 30, 1 << 30));
        assert!(matches!(d, Decision::Refuse(NotKept::FreeSpaceUnknown(_))));
        assert!(reserve_allows(10, 0, 10) && !reserve_allows(10, 1, 10) && !reserve_allows(5, 6, 0));
    }

    #[test]
    fn am_output_is_cut_past_its_bound_to_its_last_bound_bytes() {
        assert_eq!(am_output_cut(100, 100), None);
        assert_eq!(am_output_cut(101, 100), Some(100));
        assert!(am_output_cut_line("am.stdout", 100, 7).contains("am.stdout.1"));
    }

    /// A kept file counts at least a block; a log is cut to its bound as text, on a
    /// character boundary (eighth pass).
    #[test]
    fn files_count_a_block_at_least_and_logs_are_cut_as_text() {
        assert_eq!((counted(0), counted(1), counted(5000)), (4096, 4096, 5000));
        let bad = String::from_utf8_lossy(&[0xff; 10]).into_owned();
        assert_eq!(bad.len(), 30, "each invalid byte became three");
        assert_eq!(tail(&bad, 10).len(), 9, "cut to the bound on a boundary");
        assert_eq!(tail("abc", 10), "abc");
        assert_eq!(tail("abcdef", 2), "ef");
    }
}
