//! Task identities: which uid a user's tasks run as on a node (issue 23), one rule for
//! the node agents and the in-process node of `gpuam rm` / `gpuam run`.
//!
//! A node that runs as root never runs a task as root, and never runs two users' tasks
//! under one uid:
//! - a user the operator maps to a local account (`node.user_map`, `gpuam node --user-map
//!   alice=alice`, as YARN's LinuxContainerExecutor runs a job as its submitter) runs as
//!   that account, with its groups;
//! - any other user runs as a uid of its own from a range (`node.task_uids`), as systemd's
//!   `DynamicUser=` does: the uid (and a gid of the same number) has no passwd entry, so
//!   nothing is written to `/etc/passwd` and nothing collides with an account (a uid or gid
//!   that exists in the user or group database is never taken). The allocation is
//!   deterministic and recorded machine-wide (`node.task_uid_registry`, one file per uid
//!   holding the user's name, claimed with an atomic `link`): a user keeps its uid across
//!   restarts and on every node of the machine (test hosts share one kernel), and two
//!   users never get one.
//!
//! `gpuam node --run-as USER` runs every task as USER instead (one uid for all: a
//! single-tenant node). A node that is not root runs tasks as itself.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use super::executor::RunAs;

/// The default range of per-user uids ([`crate::config::DEFAULT_TASK_UIDS`]).
pub const DEFAULT_UID_RANGE: (u32, u32) = crate::config::DEFAULT_TASK_UIDS;
/// Where a machine records which per-user uid belongs to whom by default.
pub const DEFAULT_REGISTRY: &str = crate::config::DEFAULT_TASK_UID_REGISTRY;

/// The identity settings of a node (`node.user_map`, `node.task_uids`,
/// `node.task_uid_registry`, `gpuam node --user-map` / `--run-as`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IdentitySettings {
    /// User → local account.
    pub user_map: BTreeMap<String, String>,
    /// `(first, last)` uid of the per-user range; `None`: [`DEFAULT_UID_RANGE`].
    pub uid_range: Option<(u32, u32)>,
    /// `None`: [`DEFAULT_REGISTRY`].
    pub registry: Option<PathBuf>,
    /// `--run-as`: every task as this one account.
    pub run_as: Option<String>,
}

impl IdentitySettings {
    /// A node's identity settings from its `node.*` settings, with `--run-as` and
    /// `--user-map` entries (which win over the file's).
    pub fn from_settings(
        n: &crate::config::NodeSettings,
        run_as: Option<String>,
        cli_map: BTreeMap<String, String>,
    ) -> Result<IdentitySettings, String> {
        let mut user_map = n.user_map.clone();
        user_map.extend(cli_map);
        Ok(IdentitySettings {
            user_map,
            uid_range: Some(parse_uid_range(&n.task_uids).map_err(|e| format!("node.task_uids: {e}"))?),
            registry: Some(n.task_uid_registry.clone()),
            run_as,
        })
    }
}

/// Parses `FIRST-LAST` (a uid range); the error names the fix.
pub fn parse_uid_range(text: &str) -> Result<(u32, u32), String> {
    let bad = || format!("`{text}` is not a uid range: write FIRST-LAST, e.g. 1879048192-1879113727");
    let (a, b) = text.trim().split_once('-').ok_or_else(bad)?;
    let a: u32 = a.trim().parse().map_err(|_| bad())?;
    let b: u32 = b.trim().parse().map_err(|_| bad())?;
    if a < 1000 || b < a || b == u32::MAX {
        return Err(format!(
            "uid range `{text}`: FIRST must be at least 1000 and LAST at least FIRST and below 4294967295"
        ));
    }
    Ok((a, b))
}

/// Parses `USER=ACCOUNT` entries (`--user-map`); the error names the entry.
pub fn parse_user_map(entries: &[String]) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for e in entries {
        let (u, a) = e
            .split_once('=')
            .filter(|(u, a)| !u.is_empty() && !a.is_empty())
            .ok_or_else(|| format!("--user-map `{e}`: write USER=ACCOUNT, e.g. alice=alice"))?;
        out.insert(u.to_string(), a.to_string());
    }
    Ok(out)
}

/// Whether `name` may be a user's name here: 1-64 of `[A-Za-z0-9_.@-]`, not starting with
/// `-` or `.` (it is recorded in a file and shown in `USER`).
pub fn valid_user_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with(['-', '.'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'@' | b'-'))
}

/// How a node picks each task's uid (see the module doc).
#[derive(Debug)]
pub enum TaskUsers {
    /// Tasks run as this process's user (a node that is not root).
    Same,
    /// Every task as one account (`--run-as`).
    Fixed(RunAs),
    /// Each user as its own account or uid.
    PerUser {
        map: BTreeMap<String, RunAs>,
        range: (u32, u32),
        registry: PathBuf,
        /// Uids already found, by user.
        found: Mutex<HashMap<String, RunAs>>,
    },
}

impl TaskUsers {
    /// The identities of a node running with `settings`: per user when this process is
    /// root (unless `--run-as` names one account), else [`TaskUsers::Same`]. Every mapped
    /// account must exist, must not be root, and no two users may share one.
    pub fn for_node(settings: &IdentitySettings) -> Result<TaskUsers, String> {
        let root = nix::unistd::geteuid().is_root();
        if let Some(name) = &settings.run_as {
            let u = RunAs::lookup(name)?;
            if u.uid == 0 {
                return Err(format!(
                    "--run-as {name}: tasks must not run as root; name an unprivileged user"
                ));
            }
            return Ok(TaskUsers::Fixed(u));
        }
        if !root {
            if !settings.user_map.is_empty() {
                return Err(
                    "node.user_map needs a node that runs as root (only root can run a task as another account)".into(),
                );
            }
            return Ok(TaskUsers::Same);
        }
        let mut map = BTreeMap::new();
        let mut owner_of: BTreeMap<u32, &str> = BTreeMap::new();
        for (user, account) in &settings.user_map {
            if !valid_user_name(user) {
                return Err(format!(
                    "node.user_map: `{user}` is not a user name ([A-Za-z0-9_.@-], up to 64)"
                ));
            }
            let u = RunAs::lookup(account).map_err(|e| format!("node.user_map {user}={account}: {e}"))?;
            if u.uid == 0 {
                return Err(format!(
                    "node.user_map {user}={account}: tasks must not run as root; map to an unprivileged account"
                ));
            }
            if let Some(other) = owner_of.insert(u.uid, user) {
                return Err(format!(
                    "node.user_map maps both `{other}` and `{user}` to uid {}: different users never share a uid",
                    u.uid
                ));
            }
            map.insert(user.clone(), u);
        }
        let range = settings.uid_range.unwrap_or(DEFAULT_UID_RANGE);
        if let Some((uid, user)) = owner_of.iter().find(|(uid, _)| (range.0..=range.1).contains(*uid)) {
            return Err(format!(
                "node.user_map: `{user}`'s account has uid {uid}, inside node.task_uids {}-{}; choose a range apart",
                range.0, range.1
            ));
        }
        let registry = settings
            .registry
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_REGISTRY));
        Ok(TaskUsers::PerUser {
            map,
            range,
            registry,
            found: Mutex::new(HashMap::new()),
        })
    }

    /// Says how tasks run, for the node's log.
    pub fn describe(&self) -> String {
        match self {
            TaskUsers::Same => "tasks run as this node's user (it is not root)".into(),
            TaskUsers::Fixed(u) => format!("every task runs as `{}` (uid {}; --run-as)", u.name, u.uid),
            TaskUsers::PerUser { map, range, .. } => format!(
                "each user's tasks run as its own uid: {} mapped account(s), others from uids {}-{}",
                map.len(),
                range.0,
                range.1
            ),
        }
    }

    /// Whether each user gets its own uid.
    pub fn per_user(&self) -> bool {
        matches!(self, TaskUsers::PerUser { .. })
    }

    /// The account `user`'s task runs as (`None`: this process's user).
    pub fn resolve(&self, user: &str) -> Result<Option<RunAs>, String> {
        match self {
            TaskUsers::Same => Ok(None),
            TaskUsers::Fixed(u) => Ok(Some(u.clone())),
            TaskUsers::PerUser {
                map,
                range,
                registry,
                found,
            } => {
                if let Some(u) = map.get(user) {
                    return Ok(Some(u.clone()));
                }
                if !valid_user_name(user) {
                    return Err(format!(
                        "the grant's user `{}` is not a user name this node can give a uid (an RM older than \
                         this node sends none); upgrade the RM",
                        user.escape_debug()
                    ));
                }
                if let Some(u) = found.lock().get(user) {
                    return Ok(Some(u.clone()));
                }
                let uid = allocate(registry, *range, user)?;
                let u = RunAs {
                    name: user.to_string(),
                    uid,
                    gid: uid,
                    groups: Vec::new(),
                };
                found.lock().insert(user.to_string(), u.clone());
                Ok(Some(u))
            }
        }
    }
}

/// Creates a node's work dir and its `containers/` (the executor's root), both 0711 so
/// that a task passes through to its own directory without listing anyone else's, and
/// warns when a directory above is not searchable by others (a task could not reach its
/// directory then). Returns the work dir, canonical. Used by the agents and the
/// in-process node alike.
///
/// The work dir holds what root later reads and acts on (process records it kills or
/// re-attaches, `am.process` for `gpuam run`'s reaper), so it must be this process's own:
/// no other user may own it, `containers/` or a directory above it that is writable by
/// others (a sticky one such as `/tmp` excepted), nor a link on the way to it (another
/// user's `/tmp/work -> /etc` would have root chmod `/etc`). Refused before anything is
/// created or changed ([`make_owned_dir`]).
pub fn open_for_tasks(work_dir: &Path, containers: &Path) -> Result<PathBuf, String> {
    use std::os::unix::fs::PermissionsExt as _;
    make_owned_dir(work_dir)?;
    make_owned_dir(containers)?;
    let dir = std::fs::canonicalize(work_dir).map_err(|e| format!("cannot resolve {}: {e}", work_dir.display()))?;
    for d in [dir.as_path(), containers] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o711))
            .map_err(|e| format!("cannot set mode 0711 on {}: {e}", d.display()))?;
    }
    if nix::unistd::geteuid().is_root() {
        for up in dir.ancestors().skip(1) {
            let mode = std::fs::metadata(up).map(|m| m.permissions().mode()).unwrap_or(0);
            if mode & 0o001 == 0 {
                tracing::warn!(
                    "tasks run as their users' own uids and cannot reach {}: {} is not searchable by others \
                     (mode {:o}); make it so (chmod o+x) or choose a work dir elsewhere",
                    dir.display(),
                    up.display(),
                    mode & 0o7777
                );
                break;
            }
        }
    }
    Ok(dir)
}

/// Refuses `path` (absolute or relative to the current directory) when another user could
/// have put something there or could still replace it: each existing component, read
/// without following links, must belong to root or to this process's user; a link is
/// followed (and its target checked the same way) only then; no directory on the way may
/// be writable by group or others unless sticky; and the directory the path names, once
/// every `..` and link is resolved, must be this process's user's, not writable by group
/// or others, and not the root directory. Components not there yet are fine (this
/// process makes them, [`make_owned_dir`], under a directory that passed).
pub fn check_owned_path(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
    let me = nix::unistd::geteuid().as_raw();
    let trusted = |uid: u32| uid == 0 || uid == me;
    let fix = "choose a work dir that only this user (or root) owns, e.g. a new directory under /var/lib";
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| format!("cannot read the current directory: {e}"))?
            .join(path)
    };
    // Walk the components, resolving links by hand so each one's owner is seen.
    let mut pending: Vec<std::ffi::OsString> = abs.components().rev().map(|c| c.as_os_str().to_os_string()).collect();
    let mut at = PathBuf::from("/");
    let mut hops = 0;
    pending.pop(); // the root directory
    while let Some(part) = pending.pop() {
        if part == ".." {
            at.pop();
            continue;
        }
        if part == "." {
            continue;
        }
        let next = at.join(&part);
        let meta = match std::fs::symlink_metadata(&next) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(format!("cannot inspect {}: {e}", next.display())),
        };
        if !trusted(meta.uid()) {
            return Err(format!(
                "{} belongs to uid {}, not to this process's user: another user could plant or replace \
                 what the node reads there ({}); {fix}",
                next.display(),
                meta.uid(),
                path.display()
            ));
        }
        let ft = meta.file_type();
        if ft.is_symlink() {
            hops += 1;
            if hops > 40 {
                return Err(format!("{}: too many levels of links", path.display()));
            }
            let target =
                std::fs::read_link(&next).map_err(|e| format!("cannot read the link {}: {e}", next.display()))?;
            if target.is_absolute() {
                at = PathBuf::from("/");
            }
            pending.extend(target.components().rev().filter_map(|c| match c {
                std::path::Component::RootDir => None,
                c => Some(c.as_os_str().to_os_string()),
            }));
            continue;
        }
        if !ft.is_dir() {
            let kind = if ft.is_socket() || ft.is_fifo() {
                "a special file"
            } else {
                "not a directory"
            };
            return Err(format!("{} is {kind}; {fix}", next.display()));
        }
        if meta.mode() & 0o022 != 0 && meta.mode() & 0o1000 == 0 {
            return Err(format!(
                "{} is writable by other users (mode {:o}) and not sticky: they could replace what lies \
                 below it ({}); {fix}",
                next.display(),
                meta.mode() & 0o7777,
                path.display()
            ));
        }
        at = next;
    }
    // The directory the path names, once every `..` and link is taken (so `P/x/..` is P):
    // this user's own, and not one others may write.
    if at.parent().is_none() {
        return Err(format!("{} is the root directory; {fix}", path.display()));
    }
    let meta = std::fs::symlink_metadata(&at).map_err(|e| format!("cannot inspect {}: {e}", at.display()))?;
    if meta.uid() != me {
        return Err(format!(
            "{} belongs to uid {}, not to this process's user (uid {me}); {fix}",
            at.display(),
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(format!(
            "{} is writable by other users (mode {:o}; `/tmp` itself, say): they could plant what the \
             node reads there; choose a directory of its own, e.g. {}/gpuam",
            at.display(),
            meta.mode() & 0o7777,
            at.display()
        ));
    }
    Ok(())
}

/// Makes `path` a directory of this process's user, as [`check_owned_path`] wants it, and
/// returns it canonical: checked first; each missing component then made with `mkdir`
/// (which never follows a link in its place: a name someone made meanwhile answers "exists"
/// and is judged by the check after); checked again once all exist. Since no directory on
/// the way is writable by another user unless sticky, what this made stays this user's.
pub fn make_owned_dir(path: &Path) -> Result<PathBuf, String> {
    use std::os::unix::fs::DirBuilderExt as _;
    if path.components().any(|c| c == std::path::Component::ParentDir) {
        return Err(format!(
            "{} has a `..` in it: name the directory itself (nothing is made on the way to it)",
            path.display()
        ));
    }
    check_owned_path(path)?;
    let mut at = PathBuf::new();
    for part in path.components() {
        at.push(part);
        if matches!(
            part,
            std::path::Component::RootDir | std::path::Component::CurDir | std::path::Component::ParentDir
        ) {
            continue;
        }
        match std::fs::DirBuilder::new().mode(0o755).create(&at) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("cannot create {}: {e}", at.display())),
        }
    }
    check_owned_path(path)?;
    std::fs::canonicalize(path).map_err(|e| format!("cannot resolve {}: {e}", path.display()))
}

/// Whether `uid` is an account, or `uid` as a gid a group, of this machine.
fn taken_by_account(uid: u32) -> bool {
    let user = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid));
    let group = nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(uid));
    !matches!((user, group), (Ok(None), Ok(None)))
}

/// 64-bit FNV-1a of `s`: where `user`'s search for a free uid starts (the same on every
/// node and every run).
fn slot_of(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// `user`'s uid in `range`, recorded in `registry` (see the module doc): the first slot
/// from `user`'s own that is recorded for `user`, or free (no record, no account), which
/// it then claims.
pub fn allocate(registry: &Path, range: (u32, u32), user: &str) -> Result<u32, String> {
    use std::os::unix::fs::DirBuilderExt as _;
    // One claim at a time in this process (the temporary name below is per process); other
    // processes are kept apart by the hard link and the read-back after it.
    static CLAIMING: parking_lot::Mutex<()> = parking_lot::Mutex::new(());
    let _one = CLAIMING.lock();
    let len = u64::from(range.1 - range.0) + 1;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(registry)
        .map_err(|e| format!("cannot create the uid registry {}: {e}", registry.display()))?;
    let start = slot_of(user) % len;
    // Far fewer users than slots: a short probe finds a free one.
    for k in 0..len.min(1 << 16) {
        let uid = range.0 + u32::try_from((start + k) % len).unwrap_or(0);
        let path = registry.join(uid.to_string());
        match std::fs::read_to_string(&path) {
            Ok(owner) if owner == user => {
                if taken_by_account(uid) {
                    // An account got this number since: never share it; look further.
                    continue;
                }
                return Ok(uid);
            }
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("cannot read the uid registry {}: {e}", path.display())),
        }
        if taken_by_account(uid) {
            continue;
        }
        // Claim: a complete file under a name of our own, linked to the uid's name (which
        // fails if another node claimed it first; then whoever did is read back).
        let tmp = registry.join(format!(".{uid}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, user).map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) if std::fs::read_to_string(&path).is_ok_and(|o| o == user) => return Ok(uid),
            Ok(()) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                if std::fs::read_to_string(&path).is_ok_and(|o| o == user) {
                    return Ok(uid);
                }
            }
            Err(e) => return Err(format!("cannot record uid {uid} in {}: {e}", registry.display())),
        }
    }
    Err(format!(
        "no free uid left in node.task_uids {}-{} (recorded in {})",
        range.0,
        range.1,
        registry.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Root only (CI runs as root): chown needs it.
    #[test]
    fn a_work_dir_another_user_could_write_is_refused_before_anything_changes() {
        use std::os::unix::fs::{symlink, PermissionsExt as _};
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let other = Some(nix::unistd::Uid::from_raw(64_999));
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        let chmod = |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path();
        chmod(t, 0o755);
        let open = |w: &Path| open_for_tasks(w, &w.join("containers"));

        // Another user's directory: refused, its mode left as it was.
        let theirs = t.join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        chmod(&theirs, 0o755);
        nix::unistd::chown(&theirs, other, None).unwrap();
        let e = open(&theirs).unwrap_err();
        assert!(e.contains("uid 64999") && e.contains("choose a work dir"), "{e}");
        assert_eq!(mode(&theirs), 0o755);
        assert!(!theirs.join("containers").exists());

        // Another user's link to a directory of root's (`/tmp/work -> /etc`): refused, the
        // target untouched.
        let target = t.join("roots");
        std::fs::create_dir(&target).unwrap();
        chmod(&target, 0o755);
        let link = t.join("link");
        symlink(&target, &link).unwrap();
        std::os::unix::fs::lchown(&link, Some(64_999), None).unwrap();
        let e = open(&link).unwrap_err();
        assert!(e.contains("link") && e.contains("uid 64999"), "{e}");
        assert_eq!(mode(&target), 0o755);
        assert!(!target.join("containers").exists());
        // Root's own link to it is followed.
        let own = t.join("own-link");
        symlink(&target, &own).unwrap();
        assert_eq!(open(&own).unwrap(), std::fs::canonicalize(&target).unwrap());
        assert_eq!(mode(&target), 0o711);

        // Below a directory anyone may write (not sticky): refused; sticky: accepted.
        let shared = t.join("shared");
        std::fs::create_dir(&shared).unwrap();
        chmod(&shared, 0o777);
        let e = open(&shared.join("work")).unwrap_err();
        assert!(e.contains("writable by other users"), "{e}");
        assert!(!shared.join("work").exists());
        chmod(&shared, 0o1777);
        assert!(open(&shared.join("work")).is_ok());
        // The shared directory itself (e.g. `/tmp`) is no work dir.
        let e = open(&shared).unwrap_err();
        assert!(e.contains("writable by other users (mode 1777"), "{e}");
        assert_eq!(mode(&shared), 0o1777);

        // A trailing `..` names the directory above: judged as that one (`shared`, 1777).
        let e = check_owned_path(&shared.join("work/..")).unwrap_err();
        assert!(e.contains("writable by other users"), "{e}");
        // And a work dir is named without `..`: refused before anything is made.
        let e = open(&shared.join("y/..")).unwrap_err();
        assert!(e.contains("`..`"), "{e}");
        assert!(!shared.join("y").exists());
        assert_eq!(mode(&shared), 0o1777);
        // The root directory is no work dir, however it is named.
        for root in [Path::new("/"), Path::new("/tmp/.."), Path::new("//")] {
            let e = check_owned_path(root).unwrap_err();
            assert!(e.contains("root directory"), "{root:?}: {e}");
        }

        // A `containers/` another user made inside a work dir of root's: refused.
        let planted = t.join("planted");
        std::fs::create_dir_all(planted.join("containers")).unwrap();
        nix::unistd::chown(&planted.join("containers"), other, None).unwrap();
        let e = open(&planted).unwrap_err();
        assert!(e.contains("containers") && e.contains("uid 64999"), "{e}");

        // A fresh path: created, 0711.
        let fresh = t.join("a/b/work");
        assert!(open(&fresh).is_ok());
        assert_eq!((mode(&fresh), mode(&fresh.join("containers"))), (0o711, 0o711));
    }

    #[test]
    fn users_get_distinct_stable_uids_that_no_account_has() {
        let tmp = tempfile::tempdir().unwrap();
        let range = (DEFAULT_UID_RANGE.0, DEFAULT_UID_RANGE.0 + 3);
        let a = allocate(tmp.path(), range, "alice").unwrap();
        let b = allocate(tmp.path(), range, "bob").unwrap();
        assert_ne!(a, b);
        assert_eq!(allocate(tmp.path(), range, "alice").unwrap(), a, "stable");
        // Another node of the machine (same registry) agrees.
        assert_eq!(allocate(tmp.path(), range, "bob").unwrap(), b);
        let c = allocate(tmp.path(), range, "carol").unwrap();
        let d = allocate(tmp.path(), range, "dave").unwrap();
        let mut all = vec![a, b, c, d];
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 4, "{all:?}");
        let e = allocate(tmp.path(), range, "eve").unwrap_err();
        assert!(e.contains("no free uid"), "{e}");
        for uid in all {
            assert!(!taken_by_account(uid), "{uid}");
        }
    }

    #[test]
    fn an_accounts_uid_is_never_allocated() {
        let tmp = tempfile::tempdir().unwrap();
        // uid 0..=2 are accounts on every machine (root, daemon, bin).
        let e = allocate(tmp.path(), (0, 0), "alice").unwrap_err();
        assert!(e.contains("no free uid"), "{e}");
        assert!(allocate(tmp.path(), (0, 1), "alice").is_err());
    }

    #[test]
    fn ranges_maps_and_names_are_checked() {
        assert_eq!(parse_uid_range("70000-70010"), Ok((70000, 70010)));
        assert!(parse_uid_range("10-20").unwrap_err().contains("at least 1000"));
        assert!(parse_uid_range("abc").unwrap_err().contains("FIRST-LAST"));
        assert_eq!(
            parse_user_map(&["alice=al".into()])
                .unwrap()
                .get("alice")
                .map(String::as_str),
            Some("al")
        );
        assert!(parse_user_map(&["alice".into()]).unwrap_err().contains("USER=ACCOUNT"));
        assert!(valid_user_name("alice.b@x"));
        for bad in ["", "-rf", "../x", "a/b", "a b", ".hidden"] {
            assert!(!valid_user_name(bad), "{bad}");
        }
    }

    #[test]
    fn a_root_node_refuses_maps_to_root_or_shared_accounts() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let mut s = IdentitySettings::default();
        s.user_map.insert("alice".into(), "root".into());
        assert!(TaskUsers::for_node(&s).unwrap_err().contains("must not run as root"));
        s.user_map.clear();
        s.user_map.insert("alice".into(), "daemon".into());
        s.user_map.insert("bob".into(), "daemon".into());
        assert!(TaskUsers::for_node(&s).unwrap_err().contains("never share a uid"));
        s.user_map.remove("bob");
        s.user_map.insert("bob".into(), "no-such-account-23a".into());
        assert!(TaskUsers::for_node(&s).unwrap_err().contains("bob=no-such-account-23a"));
        let tmp = tempfile::tempdir().unwrap();
        s.user_map.remove("bob");
        s.registry = Some(tmp.path().to_path_buf());
        let users = TaskUsers::for_node(&s).unwrap();
        assert!(users.per_user());
        assert_eq!(users.resolve("alice").unwrap().unwrap().name, "daemon");
        let bob = users.resolve("bob").unwrap().unwrap();
        assert!((DEFAULT_UID_RANGE.0..=DEFAULT_UID_RANGE.1).contains(&bob.uid));
        assert!(users.resolve("").is_err(), "no user: refused");
    }
}
