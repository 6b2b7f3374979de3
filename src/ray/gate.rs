//! The gate: the one question a Ray job's entrypoint asks before it runs a container's
//! commands, "may container X still run?" (see `entry.rs` for why Ray needs it).
//!
//! Owns the table of open gates (container id → key) and the small HTTP server that
//! answers `GET /gate/{containerId}` with `Authorization: Bearer <key>`: `200` while the gate
//! is open, `410` once it was closed (the container was stopped or released), `404` for an
//! unknown container or a wrong key. Opened when the RM starts a container, closed before
//! its Ray job is stopped, so a job that Ray starts only after its stop never runs a command.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use axum::Router;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::auth::{constant_time_eq, new_token};

#[derive(Default)]
struct Table {
    /// Container id → (key, open).
    gates: HashMap<String, (String, bool)>,
}

/// A running gate server (clones share it; it stops when the last clone is dropped).
#[derive(Clone)]
pub struct Gate {
    table: Arc<Mutex<Table>>,
    base_url: String,
    stop: Arc<StopOnDrop>,
}

struct StopOnDrop(Mutex<Option<oneshot::Sender<()>>>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Some(s) = self.0.lock().take() {
            let _ = s.send(());
        }
    }
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate").field("base_url", &self.base_url).finish()
    }
}

impl Gate {
    /// Serves on `listen`; the URL handed to jobs is `http://<listen>` (see [`Gate::start_as`]).
    pub async fn start(listen: SocketAddr) -> std::io::Result<Gate> {
        Self::start_as(listen, None).await
    }

    /// Serves on `listen` and hands jobs `advertise` (e.g. `http://rm-host:PORT`) as its URL;
    /// without it, the bound address.
    pub async fn start_as(listen: SocketAddr, advertise: Option<String>) -> std::io::Result<Gate> {
        let listener = tokio::net::TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let table = Arc::new(Mutex::new(Table::default()));
        let router = Router::new().route("/gate/{id}", get(answer)).with_state(table.clone());
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let serve = crate::tls::serve(listener, router, None, async {
                let _ = stopped.await;
            });
            if let Err(e) = serve.await {
                tracing::error!("Ray gate stopped: {e}");
            }
        });
        let base_url = advertise
            .map(|a| a.trim_end_matches('/').to_string())
            .unwrap_or_else(|| format!("http://{addr}"));
        Ok(Gate {
            table,
            base_url,
            stop: Arc::new(StopOnDrop(Mutex::new(Some(stop)))),
        })
    }

    /// The URL a container's entrypoint asks.
    pub fn url_of(&self, container_id: &str) -> String {
        format!("{}/gate/{container_id}", self.base_url)
    }

    /// Opens the gate of a container; returns its key (the same key when already open).
    pub fn open(&self, container_id: &str) -> String {
        let mut t = self.table.lock();
        let e = t
            .gates
            .entry(container_id.to_string())
            .or_insert_with(|| (new_token(), true));
        e.0.clone()
    }

    /// Closes it for good: the container must not start any more.
    pub fn close(&self, container_id: &str) {
        if let Some(e) = self.table.lock().gates.get_mut(container_id) {
            e.1 = false;
        }
    }

    /// Drops an ended container's entry (its job can no longer ask).
    pub fn forget(&self, container_id: &str) {
        self.table.lock().gates.remove(container_id);
    }

    /// Stops serving (every clone).
    pub fn shutdown(&self) {
        if let Some(s) = self.stop.0.lock().take() {
            let _ = s.send(());
        }
    }
}

async fn answer(
    State(table): State<Arc<Mutex<Table>>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> (StatusCode, &'static str) {
    let key = crate::auth::bearer(&headers).unwrap_or("");
    let t = table.lock();
    match t.gates.get(&id) {
        Some((k, open)) if constant_time_eq(k.as_bytes(), key.as_bytes()) => {
            if *open {
                (StatusCode::OK, "run\n")
            } else {
                (StatusCode::GONE, "cancelled\n")
            }
        }
        _ => (StatusCode::NOT_FOUND, "unknown container or key\n"),
    }
}
