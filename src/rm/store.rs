//! The RM's durable state: applications (with their AM attempts), containers, node
//! states and the id counters, in an embedded SQLite database with write-ahead logging,
//! so that a restarted RM recovers every application and every grant.
//!
//! What is stored is what cannot be rebuilt: a node's `used` resources are not, because
//! the ledger always recomputes them from the live containers (so the two can never
//! disagree after a restart). Rows hold JSON documents of the in-memory records; the
//! columns beside them are there for people inspecting the file with `sqlite3`.
//!
//! The RM writes through: every change made under its state lock is written in one
//! transaction before the lock is released, in the order the changes happened.
//! `synchronous = NORMAL` with WAL makes every committed change survive the RM process
//! dying (SIGKILL, panic); only an operating-system crash or power loss can lose the
//! last few commits. `Store::memory()` keeps nothing (tests, and `gpuam run`, whose
//! embedded RM lives and dies with its one job).

use std::path::{Path, PathBuf};

use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};

use super::apps::App;
use super::ledger::LedgerContainer;
use crate::cluster::NodeState;

/// The file's name in the state directory.
pub const STATE_FILE: &str = "rm-state.db";
/// Bumped when the layout changes incompatibly.
const SCHEMA_VERSION: i64 = 1;

/// Why the store could not be opened, read or written.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("RM state database {path}: {why}")]
    Open { path: PathBuf, why: String },
    #[error("RM state database: cannot read {what}: {why}; move the file away to start with an empty RM")]
    Corrupt { what: String, why: String },
    #[error("RM state database: write failed: {0}")]
    Write(String),
}

/// Counters and ids that outlive applications.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Meta {
    /// The cluster timestamp in application and container ids.
    pub cluster_ts: u64,
    pub next_app_seq: u32,
    /// Ids handed out by new-application and not submitted yet.
    pub reserved: Vec<String>,
}

/// Everything a restarted RM needs.
pub struct Recovered {
    pub meta: Meta,
    pub apps: Vec<App>,
    pub containers: Vec<LedgerContainer>,
    pub node_states: Vec<(String, NodeState)>,
}

/// One transaction's worth of changes; `None` values are deletions.
#[derive(Default)]
pub struct Batch<'a> {
    pub meta: Option<Meta>,
    pub apps: Vec<(&'a str, Option<&'a App>)>,
    pub containers: Vec<&'a LedgerContainer>,
    pub nodes: Vec<(&'a str, NodeState)>,
}

/// The RM's state store (see the module doc).
pub struct Store {
    conn: Option<Connection>,
}

impl Store {
    /// Keeps nothing: a restarted RM starts empty.
    pub fn memory() -> Store {
        Store { conn: None }
    }

    /// Opens (creating if needed) `dir/rm-state.db`.
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        let path = dir.join(STATE_FILE);
        let fail = |why: String| StoreError::Open {
            path: path.clone(),
            why,
        };
        std::fs::create_dir_all(dir).map_err(|e| fail(format!("cannot create {}: {e}", dir.display())))?;
        let conn = Connection::open(&path).map_err(|e| fail(e.to_string()))?;
        // Job tokens and app tokens are in here: owner only.
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
        }
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .map_err(|e| fail(e.to_string()))?;
        let mode: String = conn
            .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
            .map_err(|e| fail(format!("cannot turn on write-ahead logging: {e}")))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(fail(format!(
                "write-ahead logging is not available (journal mode {mode})"
            )));
        }
        conn.execute_batch(
            "PRAGMA synchronous = NORMAL;
             CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS apps (id TEXT PRIMARY KEY, state TEXT NOT NULL, doc TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS containers (
                 id TEXT PRIMARY KEY, app_id TEXT NOT NULL, host TEXT NOT NULL,
                 state TEXT NOT NULL, doc TEXT NOT NULL);
             CREATE INDEX IF NOT EXISTS containers_by_app ON containers (app_id);
             CREATE TABLE IF NOT EXISTS nodes (host TEXT PRIMARY KEY, state TEXT NOT NULL);",
        )
        .map_err(|e| fail(format!("cannot create the tables: {e}")))?;
        let version: Option<String> = conn
            .query_row("SELECT value FROM meta WHERE key = 'schema'", [], |r| r.get(0))
            .optional()
            .map_err(|e| fail(e.to_string()))?;
        match version.as_deref().map(str::parse::<i64>) {
            None => {
                conn.execute(
                    "INSERT INTO meta (key, value) VALUES ('schema', ?1)",
                    params![SCHEMA_VERSION.to_string()],
                )
                .map_err(|e| fail(e.to_string()))?;
            }
            Some(Ok(SCHEMA_VERSION)) => {}
            Some(v) => {
                return Err(fail(format!(
                    "schema version {v:?} is not {SCHEMA_VERSION}: written by another gpuam version"
                )))
            }
        }
        Ok(Store { conn: Some(conn) })
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

    /// What an earlier RM left; `None` for a fresh (or in-memory) store.
    pub fn recover(&self) -> Result<Option<Recovered>, StoreError> {
        let Some(conn) = &self.conn else {
            return Ok(None);
        };
        let corrupt = |what: &str, e: &dyn std::fmt::Display| StoreError::Corrupt {
            what: what.to_string(),
            why: e.to_string(),
        };
        let meta: Option<String> = conn
            .query_row("SELECT value FROM meta WHERE key = 'state'", [], |r| r.get(0))
            .optional()
            .map_err(|e| corrupt("meta", &e))?;
        let Some(meta) = meta else {
            return Ok(None);
        };
        let meta: Meta = serde_json::from_str(&meta).map_err(|e| corrupt("meta", &e))?;
        let docs = |sql: &str, what: &str| -> Result<Vec<(String, String)>, StoreError> {
            let mut stmt = conn.prepare(sql).map_err(|e| corrupt(what, &e))?;
            let rows = stmt
                .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
                .map_err(|e| corrupt(what, &e))?;
            rows.collect::<Result<Vec<_>, _>>().map_err(|e| corrupt(what, &e))
        };
        let apps = docs("SELECT id, doc FROM apps ORDER BY id", "apps")?
            .into_iter()
            .map(|(id, doc)| serde_json::from_str::<App>(&doc).map_err(|e| corrupt(&format!("application {id}"), &e)))
            .collect::<Result<Vec<_>, _>>()?;
        let containers = docs("SELECT id, doc FROM containers ORDER BY id", "containers")?
            .into_iter()
            .map(|(id, doc)| {
                serde_json::from_str::<LedgerContainer>(&doc).map_err(|e| corrupt(&format!("container {id}"), &e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let node_states = docs("SELECT host, state FROM nodes ORDER BY host", "nodes")?
            .into_iter()
            .map(|(host, state)| {
                serde_json::from_value::<NodeState>(serde_json::Value::String(state))
                    .map(|s| (host.clone(), s))
                    .map_err(|e| corrupt(&format!("node {host}"), &e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Some(Recovered {
            meta,
            apps,
            containers,
            node_states,
        }))
    }

    /// Writes one batch in one transaction (all of it or nothing).
    pub fn write(&mut self, batch: &Batch) -> Result<(), StoreError> {
        let Some(conn) = &mut self.conn else {
            return Ok(());
        };
        let fail = |e: &dyn std::fmt::Display| StoreError::Write(e.to_string());
        let tx = conn.transaction().map_err(|e| fail(&e))?;
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
        tx.commit().map_err(|e| fail(&e))
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
            exit_status: None,
            diagnostics: String::new(),
            held: false,
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
            next_app_seq: 2,
            reserved: vec!["application_1_0003".into()],
        };
        store
            .write(&Batch {
                meta: Some(meta.clone()),
                apps: vec![("application_1_0001", Some(&app)), ("application_1_0002", Some(&gone))],
                containers: vec![&c1],
                nodes: vec![("n2", NodeState::Lost)],
            })
            .unwrap();
        // Later changes: one app finishes, one is deleted.
        app.finish(AppState::Finished, FinalStatus::Succeeded, 0, String::new());
        store
            .write(&Batch {
                apps: vec![("application_1_0001", Some(&app)), ("application_1_0002", None)],
                ..Batch::default()
            })
            .unwrap();
        drop(store);

        let store = Store::open(dir.path()).unwrap();
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
}
