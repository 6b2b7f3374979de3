//! The RM's durable state: applications (with their AM attempts), containers, node
//! states and the id counters, in an embedded SQLite database with write-ahead logging,
//! so that a restarted RM recovers every application and every grant.
//!
//! Node agents' declarations (what each host registered with: its resources, labels,
//! address) are kept as opaque documents in `agent_nodes`, so that a restarted RM knows
//! the hosts its restored containers run on before their agents register again. The
//! table came after the first layout: a file without it (an older RM's) gets it, empty.
//!
//! What is stored is what cannot be rebuilt: a node's `used` resources are not, because
//! the ledger always recomputes them from the live containers (so the two can never
//! disagree after a restart). Rows hold JSON documents of the in-memory records; the
//! columns beside them are there for people inspecting the file with `sqlite3`.
//!
//! The RM writes through: every change made under its state lock is committed in one
//! transaction before the answer that depends on it leaves, in the order the changes
//! happened; when a write fails the RM writes the whole state again once it can
//! ([`Store::write`] with [`Batch::whole`]).
//! `synchronous = NORMAL` with WAL makes every committed change survive the RM process
//! dying (SIGKILL, panic); only an operating-system crash or power loss can lose the
//! last few commits. `locking_mode = EXCLUSIVE` keeps WAL's index in the process's own
//! memory instead of the shared `-shm` file: a damaged, locked or read-only `-shm` cannot
//! bring the RM down (SIGBUS), and a second RM on the same directory is refused.
//! `Store::memory()` keeps nothing (tests, and `gpuam run`, whose embedded RM lives and
//! dies with its one job).
//!
//! A file is only taken as it was written: its tables and columns, its schema row, its
//! `state` meta row, every row's document and every id must be what an RM writes, else
//! opening fails with the file and the problem ([`Store::open`]). [`Store::open_recovering`]
//! (`gpuam rm --recover-state`) repairs what it can and says what it dropped.

use std::path::{Path, PathBuf};

use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};

use super::apps::{app_seq, parse_app_id, App};
use super::ledger::{container_seq, LedgerContainer};
use crate::cluster::NodeState;

/// The file's name in the state directory.
pub const STATE_FILE: &str = "rm-state.db";
/// Bumped when the layout changes incompatibly.
const SCHEMA_VERSION: i64 = 1;

/// The tables and their columns, as [`Store::open`] creates them and expects them.
const TABLES: [(&str, &[&str], &str); 5] = [
    (
        "meta",
        &["key", "value"],
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    ),
    (
        "apps",
        &["id", "state", "doc"],
        "CREATE TABLE apps (id TEXT PRIMARY KEY, state TEXT NOT NULL, doc TEXT NOT NULL)",
    ),
    (
        "containers",
        &["id", "app_id", "host", "state", "doc"],
        "CREATE TABLE containers (id TEXT PRIMARY KEY, app_id TEXT NOT NULL, host TEXT NOT NULL,
             state TEXT NOT NULL, doc TEXT NOT NULL);
         CREATE INDEX containers_by_app ON containers (app_id)",
    ),
    (
        "nodes",
        &["host", "state"],
        "CREATE TABLE nodes (host TEXT PRIMARY KEY, state TEXT NOT NULL)",
    ),
    (
        AGENT_NODES,
        &["host", "doc"],
        "CREATE TABLE agent_nodes (host TEXT PRIMARY KEY, doc TEXT NOT NULL)",
    ),
];

/// The table added after the first layout (created empty in an older file).
const AGENT_NODES: &str = "agent_nodes";

/// Why the store could not be opened, read or written.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("RM state database {path}: {why}")]
    Open { path: PathBuf, why: String },
    #[error(
        "RM state database {path}: {what}: {why}; the RM does not start on damaged state: \
         `gpuam rm --recover-state` drops what cannot be read (and says what), or move the file away \
         to start with an empty RM"
    )]
    Corrupt { path: PathBuf, what: String, why: String },
    #[error("RM state database: write failed: {0}")]
    Write(String),
}

/// Counters and ids that outlive applications.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Meta {
    /// The cluster timestamp in application and container ids.
    pub cluster_ts: u64,
    /// The last application sequence number handed out.
    pub next_app_seq: u32,
    /// Ids handed out by new-application and not submitted yet.
    pub reserved: Vec<String>,
    /// The sequence number the next container id gets (0 in files of RMs that did not
    /// keep it: then it follows the highest stored container).
    #[serde(default)]
    pub next_container_seq: u64,
    /// Who reserved each id of `reserved` (only they may submit it); absent in files of
    /// RMs that did not keep it (then anyone may).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub reserved_by: std::collections::BTreeMap<String, String>,
    /// Hosts an admin removed for good (`DELETE /ws/v1/cluster/nodes/{host}`), kept so
    /// that the credential they had stays refused across restarts; absent when none.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub removed_hosts: std::collections::BTreeMap<String, RemovedHost>,
}

/// A host removed for good: when, and the fingerprint of the agent credential it had
/// then (refused until the operator issues the host a new one).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RemovedHost {
    pub removed_ms: u64,
    /// `crate::node::remote::AgentNodes::fingerprint` of the host's credential at the
    /// removal (`None`: it had none).
    #[serde(default)]
    pub credential: Option<String>,
}

/// Everything a restarted RM needs.
pub struct Recovered {
    pub meta: Meta,
    pub apps: Vec<App>,
    pub containers: Vec<LedgerContainer>,
    pub node_states: Vec<(String, NodeState)>,
    /// Node agents' declarations (host, document), as the RM wrote them.
    pub agent_nodes: Vec<(String, String)>,
}

/// One transaction's worth of changes; `None` values are deletions.
#[derive(Default)]
pub struct Batch<'a> {
    pub meta: Option<Meta>,
    pub apps: Vec<(&'a str, Option<&'a App>)>,
    pub containers: Vec<&'a LedgerContainer>,
    pub nodes: Vec<(&'a str, NodeState)>,
    /// Node agents' declarations (host, document); `None`: the host is forgotten.
    pub agent_nodes: Vec<(&'a str, Option<&'a str>)>,
    /// Hosts whose node state row goes (removed for good).
    pub forget_nodes: Vec<&'a str>,
    /// The batch is the whole state: every row not in it is deleted (written after a
    /// failed write, when what the file misses is not known).
    pub whole: bool,
}

/// The RM's state store (see the module doc).
pub struct Store {
    conn: Option<Connection>,
    path: PathBuf,
    /// What `open_recovering` dropped or repaired; `recover` adds what it drops.
    notes: Vec<String>,
    recovering: bool,
}

/// Whether opening repairs what it finds damaged (`--recover-state`) or refuses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Strict,
    Recover,
}

impl Store {
    /// Keeps nothing: a restarted RM starts empty.
    pub fn memory() -> Store {
        Store {
            conn: None,
            path: PathBuf::new(),
            notes: Vec::new(),
            recovering: false,
        }
    }

    /// Opens (creating if needed) `dir/rm-state.db`, refusing a file that is not what an
    /// RM writes (see the module doc).
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        Self::open_as(dir, Mode::Strict)
    }

    /// As [`Store::open`], but repairs what it can instead of refusing: missing tables
    /// and rows are created, unreadable rows are dropped at [`Store::recover`]; every
    /// repair is listed by [`Store::notes`]. A file SQLite itself cannot read, or of
    /// another schema version, is still refused.
    pub fn open_recovering(dir: &Path) -> Result<Store, StoreError> {
        Self::open_as(dir, Mode::Recover)
    }

    /// What recovery repaired or dropped so far (empty for [`Store::open`]).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    fn open_as(dir: &Path, mode: Mode) -> Result<Store, StoreError> {
        let path = dir.join(STATE_FILE);
        let fail = |why: String| StoreError::Open {
            path: path.clone(),
            why,
        };
        let damaged = |what: &str, why: String| StoreError::Corrupt {
            path: path.clone(),
            what: what.to_string(),
            why,
        };
        // Tokens are kept here and the RM trusts what it reads back: the directory must be
        // this user's own (another user's could hold a planted database, or a link that
        // root would follow to chmod a file of their choice), and so must the file.
        crate::node::identity::make_owned_dir(dir).map_err(|e| fail(format!("the state directory: {e}")))?;
        match std::fs::symlink_metadata(&path) {
            Ok(m) => {
                use std::os::unix::fs::MetadataExt as _;
                if m.file_type().is_symlink() {
                    return Err(fail(
                        "it is a link, not the RM's own file: remove it, or choose another state directory".into(),
                    ));
                }
                if !m.file_type().is_file() || m.uid() != nix::unistd::geteuid().as_raw() {
                    return Err(fail(format!(
                        "it is not a regular file of this process's user (it is uid {}'s): remove it, or choose \
                         another state directory",
                        m.uid()
                    )));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(fail(e.to_string())),
        }
        let flags = rusqlite::OpenFlags::default() | rusqlite::OpenFlags::SQLITE_OPEN_NOFOLLOW;
        let conn = Connection::open_with_flags(&path, flags).map_err(|e| fail(e.to_string()))?;
        // Job tokens and app tokens are in here: owner only (the file was just checked, or
        // made by SQLite, which does not follow a link in its place).
        {
            use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt};
            if let Ok(f) = std::fs::File::options()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)
            {
                let _ = f.set_permissions(std::fs::Permissions::from_mode(0o600));
            }
        }
        conn.busy_timeout(std::time::Duration::from_secs(2))
            .map_err(|e| fail(e.to_string()))?;
        // Before the first access, so WAL's index never goes to the shared `-shm` file.
        let locking: String = conn
            .query_row("PRAGMA locking_mode = EXCLUSIVE", [], |r| r.get(0))
            .map_err(|e| fail(format!("cannot take exclusive locking mode: {e}")))?;
        if !locking.eq_ignore_ascii_case("exclusive") {
            return Err(fail(format!("exclusive locking is not available (mode {locking})")));
        }
        let mode_now: String = conn
            .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
            .map_err(|e| match e.sqlite_error_code() {
                Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => fail(
                    "the file is locked: is another `gpuam rm` using this state directory? (one RM per state dir)"
                        .into(),
                ),
                Some(rusqlite::ErrorCode::NotADatabase) => damaged("the file", format!("not an SQLite database ({e})")),
                _ => fail(format!("cannot turn on write-ahead logging: {e}")),
            })?;
        if !mode_now.eq_ignore_ascii_case("wal") {
            return Err(fail(format!(
                "write-ahead logging is not available (journal mode {mode_now})"
            )));
        }
        conn.execute_batch("PRAGMA synchronous = NORMAL;")
            .map_err(|e| fail(e.to_string()))?;
        let check: String = conn
            .query_row("PRAGMA quick_check", [], |r| r.get(0))
            .map_err(|e| damaged("the file", format!("SQLite cannot check it: {e}")))?;
        if check != "ok" {
            return Err(damaged("the file", format!("SQLite's integrity check failed: {check}")));
        }
        let mut store = Store {
            conn: Some(conn),
            path: path.clone(),
            notes: Vec::new(),
            recovering: mode == Mode::Recover,
        };
        store.check_layout(mode)?;
        Ok(store)
    }

    /// A fresh file gets the tables, the schema row and an initial meta row in one
    /// transaction; an existing one must have all of them as written.
    fn check_layout(&mut self, mode: Mode) -> Result<(), StoreError> {
        let path = self.path.clone();
        let fail = |why: String| StoreError::Open {
            path: path.clone(),
            why,
        };
        let damaged = |what: &str, why: String| StoreError::Corrupt {
            path: path.clone(),
            what: what.to_string(),
            why,
        };
        let Some(conn) = &mut self.conn else {
            return Ok(());
        };
        let existing: Vec<String> = conn
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
            .and_then(|mut st| st.query_map([], |r| r.get::<_, String>(0))?.collect())
            .map_err(|e| damaged("the table list", e.to_string()))?;
        let tx = conn.transaction().map_err(|e| fail(e.to_string()))?;
        let mut notes = Vec::new();
        if existing.is_empty() {
            for (_, _, create) in TABLES {
                tx.execute_batch(create)
                    .map_err(|e| fail(format!("cannot create the tables: {e}")))?;
            }
            tx.execute(
                "INSERT INTO meta (key, value) VALUES ('schema', ?1)",
                params![SCHEMA_VERSION.to_string()],
            )
            .map_err(|e| fail(e.to_string()))?;
            tx.commit().map_err(|e| fail(e.to_string()))?;
            return Ok(());
        }
        for (table, columns, create) in TABLES {
            if !existing.iter().any(|t| t == table) {
                if table == AGENT_NODES {
                    // Written by an RM from before the table: nothing was lost.
                    tx.execute_batch(create)
                        .map_err(|e| fail(format!("cannot create table `{table}`: {e}")))?;
                    continue;
                }
                if mode == Mode::Strict {
                    return Err(damaged(&format!("table `{table}`"), "missing".into()));
                }
                tx.execute_batch(create)
                    .map_err(|e| fail(format!("cannot create table `{table}`: {e}")))?;
                notes.push(format!(
                    "table `{table}` was missing: created empty ({})",
                    what_a_table_held(table)
                ));
                continue;
            }
            let have: Vec<String> = tx
                .prepare(&format!("SELECT name FROM pragma_table_info('{table}')"))
                .and_then(|mut st| st.query_map([], |r| r.get::<_, String>(0))?.collect())
                .map_err(|e| damaged(&format!("table `{table}`"), e.to_string()))?;
            if have.iter().map(String::as_str).ne(columns.iter().copied()) {
                return Err(damaged(
                    &format!("table `{table}`"),
                    format!("columns {have:?}, expected {columns:?} (written by another program?)"),
                ));
            }
        }
        let version: Option<String> = tx
            .query_row("SELECT value FROM meta WHERE key = 'schema'", [], |r| r.get(0))
            .optional()
            .map_err(|e| damaged("the schema row", e.to_string()))?;
        match version.as_deref().map(str::parse::<i64>) {
            Some(Ok(SCHEMA_VERSION)) => {}
            None if mode == Mode::Recover => {
                tx.execute(
                    "INSERT INTO meta (key, value) VALUES ('schema', ?1)",
                    params![SCHEMA_VERSION.to_string()],
                )
                .map_err(|e| fail(e.to_string()))?;
                notes.push(format!("the schema row was missing: set to version {SCHEMA_VERSION}"));
            }
            None => return Err(damaged("the meta table", "no `schema` row".into())),
            Some(v) => {
                return Err(fail(format!(
                    "schema version {v:?} is not {SCHEMA_VERSION}: written by another gpuam version"
                )))
            }
        }
        tx.commit().map_err(|e| fail(e.to_string()))?;
        self.notes.extend(notes);
        Ok(())
    }

    /// "sqlite" or "memory" (the RM's `clusterInfo.rmStateStoreName`).
    pub fn kind(&self) -> &'static str {
        if self.conn.is_some() {
            "sqlite"
        } else {
            "memory"
        }
    }

    /// True when writes go somewhere (callers skip building batches otherwise).
    pub fn is_durable(&self) -> bool {
        self.conn.is_some()
    }

    /// What an earlier RM left; `None` for a fresh (or in-memory) store. Every row must
    /// read back, and every id must be one the stored counters could have issued; in a
    /// store opened with [`Store::open_recovering`], rows that fail are dropped (and listed
    /// in [`Store::notes`]) and the counters raised past every id kept.
    pub fn recover(&mut self) -> Result<Option<Recovered>, StoreError> {
        let recovering = self.recovering;
        let path = self.path.clone();
        let Some(conn) = &self.conn else {
            return Ok(None);
        };
        let corrupt = |what: &str, e: &dyn std::fmt::Display| StoreError::Corrupt {
            path: path.clone(),
            what: what.to_string(),
            why: e.to_string(),
        };
        let docs = |sql: &str, what: &str| -> Result<Vec<(String, String)>, StoreError> {
            let mut stmt = conn.prepare(sql).map_err(|e| corrupt(what, &e))?;
            let rows = stmt
                .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
                .map_err(|e| corrupt(what, &e))?;
            rows.collect::<Result<Vec<_>, _>>().map_err(|e| corrupt(what, &e))
        };
        let mut notes: Vec<String> = Vec::new();
        // A row that cannot be taken: an error, or (recovering) dropped with a note.
        let mut dropped: Vec<(&'static str, String)> = Vec::new();
        let mut refuse = |table: &'static str, key: &str, what: String, why: String| -> Result<(), StoreError> {
            if !recovering {
                return Err(StoreError::Corrupt {
                    path: path.clone(),
                    what,
                    why,
                });
            }
            notes.push(format!("dropped {what}: {why}"));
            dropped.push((table, key.to_string()));
            Ok(())
        };

        let meta_row: Option<String> = conn
            .query_row("SELECT value FROM meta WHERE key = 'state'", [], |r| r.get(0))
            .optional()
            .map_err(|e| corrupt("the meta table", &e))?;
        let mut meta: Option<Meta> = match meta_row.as_deref().map(serde_json::from_str::<Meta>) {
            Some(Ok(m)) => Some(m),
            Some(Err(e)) => {
                refuse("meta", "state", "the `state` meta row".into(), e.to_string())?;
                None
            }
            None => None,
        };
        let mut apps = Vec::new();
        for (id, doc) in docs("SELECT id, doc FROM apps ORDER BY id", "table `apps`")? {
            match serde_json::from_str::<App>(&doc) {
                Ok(app) if app.report.id != id => refuse(
                    "apps",
                    &id,
                    format!("application {id}"),
                    format!("its document is application {}", app.report.id),
                )?,
                Ok(_) if parse_app_id(&id).is_none() => refuse(
                    "apps",
                    &id,
                    format!("application {id:?}"),
                    "not an id an RM issues (application_<clusterTimestamp>_<sequence>)".into(),
                )?,
                Ok(app) => apps.push(app),
                Err(e) => refuse("apps", &id, format!("application {id}"), e.to_string())?,
            }
        }
        let mut containers = Vec::new();
        for (id, doc) in docs("SELECT id, doc FROM containers ORDER BY id", "table `containers`")? {
            match serde_json::from_str::<LedgerContainer>(&doc) {
                Ok(c) if c.container.container_id != id => refuse(
                    "containers",
                    &id,
                    format!("container {id}"),
                    format!("its document is container {}", c.container.container_id),
                )?,
                Ok(_) if container_seq(&id).is_none() => refuse(
                    "containers",
                    &id,
                    format!("container {id:?}"),
                    "not an id an RM issues (container_<clusterTimestamp>_<app>_<attempt>_<sequence>)".into(),
                )?,
                Ok(c) => containers.push(c),
                Err(e) => refuse("containers", &id, format!("container {id}"), e.to_string())?,
            }
        }
        let mut node_states = Vec::new();
        for (host, state) in docs("SELECT host, state FROM nodes ORDER BY host", "table `nodes`")? {
            match serde_json::from_value::<NodeState>(serde_json::Value::String(state.clone())) {
                Ok(s) => node_states.push((host, s)),
                Err(e) => refuse("nodes", &host, format!("node {host}"), e.to_string())?,
            }
        }

        let agent_nodes = docs("SELECT host, doc FROM agent_nodes ORDER BY host", "table `agent_nodes`")?;

        let max_app = apps.iter().filter_map(|a| app_seq(&a.report.id)).max();
        let max_container = containers
            .iter()
            .filter_map(|c| container_seq(&c.container.container_id))
            .max();
        let anything = !apps.is_empty() || !containers.is_empty() || !node_states.is_empty() || !agent_nodes.is_empty();
        let meta = match meta.take() {
            Some(m) => m,
            // A fresh store: nothing was ever written.
            None if !anything && meta_row.is_none() => return self.finish_recover(notes, dropped, None),
            None if !recovering => {
                return Err(corrupt(
                    "the meta table",
                    &"no `state` row (the id counters), yet the file holds applications, containers or nodes",
                ))
            }
            None => {
                let ts = apps
                    .iter()
                    .filter_map(|a| parse_app_id(&a.report.id).map(|(ts, _)| ts))
                    .max()
                    .unwrap_or_else(crate::protocol::now_ms);
                notes.push(format!(
                    "the `state` meta row was missing: rebuilt from the rows (cluster timestamp {ts}, \
                     reserved application ids forgotten)"
                ));
                Meta {
                    cluster_ts: ts,
                    next_app_seq: max_app.unwrap_or(0),
                    reserved: Vec::new(),
                    next_container_seq: max_container.map_or(0, |s| s.saturating_add(1)),
                    reserved_by: Default::default(),
                    removed_hosts: Default::default(),
                }
            }
        };
        let mut meta = meta;
        // Ids beyond the counters could not have been issued by the RM that wrote them.
        if let Some(seq) = max_app.filter(|s| *s > meta.next_app_seq) {
            let why = format!(
                "application sequence {seq} is beyond the stored counter {}",
                meta.next_app_seq
            );
            if !recovering {
                return Err(corrupt("the id counters", &why));
            }
            notes.push(format!("{why}: counter raised"));
            meta.next_app_seq = seq;
        }
        if let Some(seq) = max_container.filter(|s| meta.next_container_seq != 0 && *s >= meta.next_container_seq) {
            let why = format!(
                "container sequence {seq} is not below the stored counter {}",
                meta.next_container_seq
            );
            if !recovering {
                return Err(corrupt("the id counters", &why));
            }
            notes.push(format!("{why}: counter raised"));
            meta.next_container_seq = seq.saturating_add(1);
        }
        let bad_reserved: Vec<String> = meta
            .reserved
            .iter()
            .filter(|id| app_seq(id).is_none_or(|s| s > meta.next_app_seq))
            .cloned()
            .collect();
        if let Some(id) = bad_reserved.first() {
            let why = format!("reserved application id {id:?} could not have been issued");
            if !recovering {
                return Err(corrupt("the `state` meta row", &why));
            }
            notes.push(format!("{why}: forgotten"));
            meta.reserved.retain(|r| !bad_reserved.contains(r));
        }
        let recovered = Recovered {
            meta,
            apps,
            containers,
            node_states,
            agent_nodes,
        };
        self.finish_recover(notes, dropped, Some(recovered))
    }

    /// Deletes the rows recovery dropped (so the file reads clean next time) and keeps
    /// the notes.
    fn finish_recover(
        &mut self,
        notes: Vec<String>,
        dropped: Vec<(&'static str, String)>,
        recovered: Option<Recovered>,
    ) -> Result<Option<Recovered>, StoreError> {
        if let Some(conn) = &mut self.conn {
            let fail = |e: &dyn std::fmt::Display| StoreError::Write(e.to_string());
            let tx = conn.transaction().map_err(|e| fail(&e))?;
            for (table, key) in &dropped {
                let column = match *table {
                    "meta" => "key",
                    "nodes" | "agent_nodes" => "host",
                    _ => "id",
                };
                tx.execute(&format!("DELETE FROM {table} WHERE {column} = ?1"), params![key])
                    .map_err(|e| fail(&e))?;
            }
            tx.commit().map_err(|e| fail(&e))?;
        }
        self.notes.extend(notes);
        Ok(recovered)
    }

    /// Writes one batch in one transaction (all of it or nothing).
    pub fn write(&mut self, batch: &Batch) -> Result<(), StoreError> {
        let Some(conn) = &mut self.conn else {
            return Ok(());
        };
        let fail = |e: &dyn std::fmt::Display| StoreError::Write(e.to_string());
        let tx = conn.transaction().map_err(|e| fail(&e))?;
        if batch.whole {
            tx.execute_batch("DELETE FROM apps; DELETE FROM containers; DELETE FROM nodes; DELETE FROM agent_nodes;")
                .map_err(|e| fail(&e))?;
        }
        if let Some(meta) = &batch.meta {
            let doc = serde_json::to_string(meta).map_err(|e| fail(&e))?;
            tx.prepare_cached("INSERT OR REPLACE INTO meta (key, value) VALUES ('state', ?1)")
                .and_then(|mut s| s.execute(params![doc]))
                .map_err(|e| fail(&e))?;
        }
        for (id, app) in &batch.apps {
            match app {
                Some(app) => {
                    let doc = serde_json::to_string(app).map_err(|e| fail(&e))?;
                    tx.prepare_cached("INSERT OR REPLACE INTO apps (id, state, doc) VALUES (?1, ?2, ?3)")
                        .and_then(|mut s| s.execute(params![id, name_of(&app.report.state), doc]))
                        .map_err(|e| fail(&e))?;
                }
                None => {
                    tx.prepare_cached("DELETE FROM apps WHERE id = ?1")
                        .and_then(|mut s| s.execute(params![id]))
                        .map_err(|e| fail(&e))?;
                    // A forgotten application's containers go with it (history retention).
                    tx.prepare_cached("DELETE FROM containers WHERE app_id = ?1")
                        .and_then(|mut s| s.execute(params![id]))
                        .map_err(|e| fail(&e))?;
                }
            }
        }
        for c in &batch.containers {
            let doc = serde_json::to_string(c).map_err(|e| fail(&e))?;
            tx.prepare_cached(
                "INSERT OR REPLACE INTO containers (id, app_id, host, state, doc) VALUES (?1, ?2, ?3, ?4, ?5)",
            )
            .and_then(|mut s| {
                s.execute(params![
                    c.container.container_id,
                    c.app_id,
                    c.container.host,
                    name_of(&c.state),
                    doc
                ])
            })
            .map_err(|e| fail(&e))?;
        }
        for (host, state) in &batch.nodes {
            tx.prepare_cached("INSERT OR REPLACE INTO nodes (host, state) VALUES (?1, ?2)")
                .and_then(|mut s| s.execute(params![host, name_of(state)]))
                .map_err(|e| fail(&e))?;
        }
        for host in &batch.forget_nodes {
            tx.prepare_cached("DELETE FROM nodes WHERE host = ?1")
                .and_then(|mut s| s.execute(params![host]))
                .map_err(|e| fail(&e))?;
        }
        for (host, doc) in &batch.agent_nodes {
            match doc {
                Some(doc) => tx
                    .prepare_cached("INSERT OR REPLACE INTO agent_nodes (host, doc) VALUES (?1, ?2)")
                    .and_then(|mut s| s.execute(params![host, doc])),
                None => tx
                    .prepare_cached("DELETE FROM agent_nodes WHERE host = ?1")
                    .and_then(|mut s| s.execute(params![host])),
            }
            .map_err(|e| fail(&e))?;
        }
        tx.commit().map_err(|e| fail(&e))
    }
}

/// What losing a table's rows means, for recovery's notes.
fn what_a_table_held(table: &str) -> &'static str {
    match table {
        "apps" => "every application it held is forgotten; their AMs and containers are not known to the RM",
        "containers" => {
            "every grant it held is forgotten; processes of those containers that still run are not known to the RM"
        }
        "nodes" => "node states such as LOST are forgotten: every node starts RUNNING",
        "agent_nodes" => "node agents' hosts are forgotten until they register again",
        _ => "the id counters are rebuilt from the rows",
    }
}

/// A state enum's wire name (`RUNNING`, `COMPLETE`, ...), as the columns hold it.
fn name_of<T: Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A link planted where the state file goes is refused, not followed (root would have
    /// made the file it names 0600 and opened it as its state); so is a file of another
    /// user's, and a state directory another user owns.
    #[test]
    fn a_planted_state_file_or_directory_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let t = tempfile::tempdir().unwrap();
        let victim = t.path().join("victim");
        std::fs::write(&victim, "theirs").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o644)).unwrap();
        let dir = t.path().join("state");
        std::fs::create_dir(&dir).unwrap();
        std::os::unix::fs::symlink(&victim, dir.join(STATE_FILE)).unwrap();
        let e = Store::open(&dir).err().expect("a link is refused").to_string();
        assert!(e.contains("link"), "{e}");
        assert_eq!(std::fs::metadata(&victim).unwrap().permissions().mode() & 0o7777, 0o644);
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "theirs");
        if nix::unistd::geteuid().is_root() {
            std::fs::remove_file(dir.join(STATE_FILE)).unwrap();
            std::fs::write(dir.join(STATE_FILE), "").unwrap();
            std::os::unix::fs::chown(dir.join(STATE_FILE), Some(64_993), None).unwrap();
            let e = Store::open(&dir).err().expect("another's file is refused").to_string();
            assert!(e.contains("uid 64993"), "{e}");
            let theirs = t.path().join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            std::os::unix::fs::chown(&theirs, Some(64_993), None).unwrap();
            let e = Store::open(&theirs)
                .err()
                .expect("another's directory is refused")
                .to_string();
            assert!(e.contains("uid 64993"), "{e}");
            assert!(!theirs.join(STATE_FILE).exists());
        }
        // The RM's own: made, 0600.
        let own = t.path().join("own");
        drop(Store::open(&own).unwrap());
        assert_eq!(
            std::fs::metadata(own.join(STATE_FILE)).unwrap().permissions().mode() & 0o7777,
            0o600
        );
    }
    use crate::protocol::{AppState, Container, ContainerState, FinalStatus};
    use crate::resources::{PortSet, Resources};

    fn container(id: &str, state: ContainerState) -> LedgerContainer {
        LedgerContainer {
            container: Container {
                container_id: id.into(),
                request_id: 7,
                host: "n1".into(),
                node_http_address: "http://127.0.0.1:1".into(),
                node_ip: None,
                resources: Resources::with_mask(2, 100, 0b101, PortSet::parse("20000-20001").unwrap()),
                task: Some("worker/3".into()),
                task_attempt: 2,
            },
            app_id: "application_1_0001".into(),
            attempt: 1,
            state,
            allocated_at: std::time::Instant::now(),
            allocated_ms: 1234,
            ended_ms: 0,
            exit_status: None,
            diagnostics: String::new(),
            held: false,
            // A declared limit and its start survive a restart (issue 27).
            started_ms: 1300,
            max_run_sec: Some(60),
        }
    }

    #[test]
    fn a_written_state_is_recovered_by_a_new_store() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path()).unwrap();
        assert_eq!(store.kind(), "sqlite");
        assert!(store.recover().unwrap().is_none(), "fresh");
        let mut app = App::new("application_1_0001".into(), "job".into());
        app.set_job_token(Some("jt"));
        app.attempt_started(None);
        let gone = App::new("application_1_0002".into(), "gone".into());
        let c1 = container("container_1_0001_01_000001", ContainerState::Running);
        let meta = Meta {
            cluster_ts: 1,
            next_app_seq: 3,
            reserved: vec!["application_1_0003".into()],
            next_container_seq: 2,
            reserved_by: [("application_1_0003".to_string(), "alice".to_string())].into(),
            removed_hosts: [(
                "n9".to_string(),
                RemovedHost {
                    removed_ms: 5,
                    credential: Some("ab".into()),
                },
            )]
            .into(),
        };
        store
            .write(&Batch {
                meta: Some(meta.clone()),
                apps: vec![("application_1_0001", Some(&app)), ("application_1_0002", Some(&gone))],
                containers: vec![&c1],
                nodes: vec![("n2", NodeState::Lost), ("n3", NodeState::Lost)],
                agent_nodes: vec![("n2", Some(r#"{"host":"n2"}"#)), ("n3", Some("{}"))],
                forget_nodes: Vec::new(),
                whole: false,
            })
            .unwrap();
        // Later changes: one app finishes, one is deleted.
        app.finish(AppState::Finished, FinalStatus::Succeeded, 0, String::new());
        store
            .write(&Batch {
                apps: vec![("application_1_0001", Some(&app)), ("application_1_0002", None)],
                agent_nodes: vec![("n3", None)],
                forget_nodes: vec!["n3"],
                ..Batch::default()
            })
            .unwrap();
        drop(store);

        let mut store = Store::open(dir.path()).unwrap();
        let r = store.recover().unwrap().unwrap();
        assert_eq!(r.meta, meta);
        assert_eq!(r.apps.len(), 1);
        let a = &r.apps[0];
        assert_eq!(a.report.state, AppState::Finished);
        assert!(a.token_matches(app.token()), "the app token survives");
        assert!(a.job_token_matches("jt"));
        assert_eq!(a.attempts.len(), 1);
        assert!(!a.registered, "the heartbeat's memory is not kept: the AM resyncs");
        assert_eq!(r.containers.len(), 1);
        assert_eq!(r.containers[0].container, c1.container);
        assert_eq!(r.containers[0].state, ContainerState::Running);
        assert_eq!(r.containers[0].allocated_ms, 1234);
        assert_eq!(r.node_states, vec![("n2".to_string(), NodeState::Lost)]);
        assert_eq!(r.agent_nodes, vec![("n2".to_string(), r#"{"host":"n2"}"#.to_string())]);
        let mode: String = store
            .conn
            .as_ref()
            .unwrap()
            .query_row("PRAGMA journal_mode", [], |r| r.get(0))
            .unwrap();
        assert_eq!(mode, "wal");
    }

    #[test]
    fn memory_store_keeps_nothing() {
        let mut s = Store::memory();
        assert!(!s.is_durable());
        s.write(&Batch {
            meta: Some(Meta::default()),
            ..Batch::default()
        })
        .unwrap();
        assert!(s.recover().unwrap().is_none());
        assert_eq!(s.kind(), "memory");
    }

    #[test]
    fn a_damaged_row_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path()).unwrap();
        store
            .write(&Batch {
                meta: Some(Meta::default()),
                ..Batch::default()
            })
            .unwrap();
        store
            .conn
            .as_ref()
            .unwrap()
            .execute(
                "INSERT INTO apps (id, state, doc) VALUES ('application_9_0001', 'RUNNING', '{not json')",
                [],
            )
            .unwrap();
        let err = match store.recover() {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a damaged row must not be ignored"),
        };
        assert!(err.contains("application application_9_0001"), "{err}");
        assert!(err.contains("move the file away"), "{err}");
        assert!(err.contains(STATE_FILE), "names the file: {err}");
    }

    #[test]
    fn another_schema_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        drop(Store::open(dir.path()).unwrap());
        let conn = Connection::open(dir.path().join(STATE_FILE)).unwrap();
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema'", [])
            .unwrap();
        drop(conn);
        let err = Store::open(dir.path()).err().unwrap().to_string();
        assert!(err.contains("schema version"), "{err}");
    }

    /// A store holding one app, one container and a meta row, closed again.
    fn written(dir: &Path) {
        let mut store = Store::open(dir).unwrap();
        let app = App::new("application_1_0001".into(), "job".into());
        let c = container("container_1_0001_01_000001", ContainerState::Running);
        store
            .write(&Batch {
                meta: Some(Meta {
                    cluster_ts: 1,
                    next_app_seq: 1,
                    reserved: Vec::new(),
                    next_container_seq: 2,
                    reserved_by: Default::default(),
                    removed_hosts: Default::default(),
                }),
                apps: vec![("application_1_0001", Some(&app))],
                containers: vec![&c],
                ..Batch::default()
            })
            .unwrap();
    }

    fn sql(dir: &Path, statement: &str) {
        let conn = Connection::open(dir.join(STATE_FILE)).unwrap();
        conn.execute_batch(statement).unwrap();
    }

    fn open_err(dir: &Path) -> String {
        match Store::open(dir).and_then(|mut s| s.recover().map(|_| ())) {
            Err(e) => e.to_string(),
            Ok(()) => panic!("damaged state must be refused"),
        }
    }

    #[test]
    fn a_missing_table_is_refused_and_recovery_says_what_it_drops() {
        let dir = tempfile::tempdir().unwrap();
        written(dir.path());
        sql(dir.path(), "DROP TABLE containers;");
        let err = open_err(dir.path());
        assert!(
            err.contains(STATE_FILE) && err.contains("table `containers`: missing"),
            "{err}"
        );
        assert!(err.contains("--recover-state"), "{err}");
        let mut store = Store::open_recovering(dir.path()).unwrap();
        let r = store.recover().unwrap().unwrap();
        assert_eq!(r.apps.len(), 1, "the rest is kept");
        assert!(r.containers.is_empty());
        assert!(
            store
                .notes()
                .iter()
                .any(|n| n.contains("`containers` was missing") && n.contains("grant")),
            "{:?}",
            store.notes()
        );
        drop(store);
        // Repaired: a plain open takes it now.
        assert!(Store::open(dir.path()).unwrap().recover().unwrap().is_some());
    }

    #[test]
    fn a_file_of_an_rm_from_before_agent_nodes_opens_with_the_table_added() {
        let dir = tempfile::tempdir().unwrap();
        written(dir.path());
        sql(dir.path(), "DROP TABLE agent_nodes;");
        let mut store = Store::open(dir.path()).unwrap();
        let r = store.recover().unwrap().unwrap();
        assert_eq!(r.apps.len(), 1);
        assert!(r.agent_nodes.is_empty());
        assert!(store.notes().is_empty(), "nothing was lost: {:?}", store.notes());
    }

    #[test]
    fn a_missing_meta_row_is_refused_and_recovery_rebuilds_the_counters() {
        let dir = tempfile::tempdir().unwrap();
        written(dir.path());
        sql(dir.path(), "DELETE FROM meta WHERE key = 'state';");
        let err = open_err(dir.path());
        assert!(err.contains("no `state` row"), "{err}");
        let mut store = Store::open_recovering(dir.path()).unwrap();
        let r = store.recover().unwrap().unwrap();
        assert_eq!(
            (r.meta.cluster_ts, r.meta.next_app_seq, r.meta.next_container_seq),
            (1, 1, 2)
        );
        assert_eq!((r.apps.len(), r.containers.len()), (1, 1));
        assert!(
            store.notes().iter().any(|n| n.contains("rebuilt")),
            "{:?}",
            store.notes()
        );
    }

    #[test]
    fn ids_that_could_not_have_been_issued_are_refused_or_dropped() {
        let dir = tempfile::tempdir().unwrap();
        written(dir.path());
        // An application beyond the counter (a sequence that wrapped, say).
        sql(
            dir.path(),
            "UPDATE meta SET value = replace(value, '\"nextAppSeq\":1', '\"nextAppSeq\":0') WHERE key = 'state';",
        );
        let err = open_err(dir.path());
        assert!(err.contains("beyond the stored counter"), "{err}");
        written(dir.path());
        // A row whose key is not an id an RM issues.
        sql(
            dir.path(),
            "INSERT INTO containers SELECT '../..', app_id, host, state, replace(doc, 'container_1_0001_01_000001', '../..') FROM containers;",
        );
        let err = open_err(dir.path());
        assert!(
            err.contains("container \"../..\"") && err.contains("not an id"),
            "{err}"
        );
        let mut store = Store::open_recovering(dir.path()).unwrap();
        let r = store.recover().unwrap().unwrap();
        assert_eq!(r.containers.len(), 1, "only the forged row is dropped");
        assert!(
            store.notes().iter().any(|n| n.contains("dropped container")),
            "{:?}",
            store.notes()
        );
    }

    #[test]
    fn a_second_rm_on_the_same_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut first = Store::open(dir.path()).unwrap();
        first
            .write(&Batch {
                meta: Some(Meta::default()),
                ..Batch::default()
            })
            .unwrap();
        let err = Store::open(dir.path()).err().expect("locked").to_string();
        assert!(err.contains("another `gpuam rm`"), "{err}");
        drop(first);
        Store::open(dir.path()).unwrap();
    }

    #[test]
    fn the_whole_state_replaces_every_row() {
        let dir = tempfile::tempdir().unwrap();
        written(dir.path());
        let mut store = Store::open(dir.path()).unwrap();
        let app = App::new("application_1_0002".into(), "other".into());
        store
            .write(&Batch {
                meta: Some(Meta {
                    cluster_ts: 1,
                    next_app_seq: 2,
                    reserved: Vec::new(),
                    next_container_seq: 2,
                    reserved_by: Default::default(),
                    removed_hosts: Default::default(),
                }),
                apps: vec![("application_1_0002", Some(&app))],
                whole: true,
                ..Batch::default()
            })
            .unwrap();
        let r = store.recover().unwrap().unwrap();
        let ids: Vec<&str> = r.apps.iter().map(|a| a.report.id.as_str()).collect();
        assert_eq!(ids, ["application_1_0002"]);
        assert!(r.containers.is_empty());
    }
}
