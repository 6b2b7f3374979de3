//! The AM's web dashboard and status API: JSON under `/api/v1/`, live events over SSE,
//! `/metrics` for Prometheus, health probes, and the embedded static page (`webui/`).
//!
//! Everything here only reads the [`StatusHub`] the AM's publisher writes; the one action
//! (kill) is forwarded to the AM as a [`crate::am::status::Command`].

pub mod access;
mod api;
pub(crate) mod assets;
pub mod demo;
mod metrics;
mod sse;
mod tails;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Serialize;

use crate::am::status::StatusHub;

/// A JSON error answer: `{"code": "...", "message": "..."}` with an HTTP status.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }
    pub(crate) fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }
    pub(crate) fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    code: &'a str,
    message: &'a str,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            code: self.code,
            message: &self.message,
        };
        json_bytes(self.status, serde_json::to_vec(&body).unwrap_or_default())
    }
}

/// A response with an already-serialized JSON body (serialized under the hub's read
/// lock, so that no copy of the snapshot is made).
pub(crate) fn json_bytes(status: StatusCode, body: Vec<u8>) -> Response {
    let mut r = (status, body).into_response();
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// Serializes `v` as a 200 JSON answer.
pub(crate) fn json_ok<T: Serialize + ?Sized>(v: &T) -> Response {
    match serde_json::to_vec(v) {
        Ok(b) => json_bytes(StatusCode::OK, b),
        Err(e) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("could not serialize the answer: {e}"),
        )
        .into_response(),
    }
}

/// The dashboard's routes over a hub: the API behind credentials ([`access`]), the page,
/// its assets, health probes and `/metrics` open.
pub fn router(hub: Arc<StatusHub>) -> Router {
    let api = Router::new()
        .route("/api/v1/job", get(api::job))
        .route("/api/v1/tasks", get(api::tasks))
        .route("/api/v1/tasks/{role}/{index}", get(api::task))
        .route("/api/v1/tasks/{role}/{index}/logs", get(api::task_logs))
        .route("/api/v1/tails", get(tails::tails))
        .route("/api/v1/nodes", get(api::nodes))
        .route("/api/v1/selections", get(api::selections))
        .route("/api/v1/config", get(api::config))
        .route("/api/v1/snapshot", get(api::snapshot))
        .route("/api/v1/events", get(sse::events))
        .route("/api/v1/events-ticket", get(access::events_ticket))
        .route("/api/v1/page-ticket", get(access::page_ticket))
        .route_layer(axum::middleware::from_fn_with_state(hub.clone(), access::readers_only));
    Router::new()
        .route("/", get(assets::index))
        .route("/index.html", get(assets::index))
        .route("/app.js", get(assets::app_js))
        .route("/reason.js", get(assets::reason_js))
        .route("/style.css", get(assets::style_css))
        .route("/livez", get(api::livez))
        .route("/healthz", get(api::livez))
        .route("/readyz", get(api::readyz))
        .route("/metrics", get(metrics::metrics))
        .route("/api/v1/job/kill", post(api::kill))
        .merge(api)
        .fallback(api::fallback)
        .with_state(hub)
}

/// Binds `listen` (use a loopback address unless the dashboard must be reachable from
/// elsewhere), serves the dashboard in a background task and returns the bound address
/// (port 0 picks a free one).
pub async fn serve(
    hub: Arc<StatusHub>,
    listen: SocketAddr,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    serve_tls(hub, listen, None).await
}

/// As [`serve`], over HTTPS when `tls` is given.
pub async fn serve_tls(
    hub: Arc<StatusHub>,
    listen: SocketAddr,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    serve_with(hub, listen, tls, &[], crate::tls::HttpTimeouts::default()).await
}

/// As [`serve_tls`]; requests must name this dashboard in `Host` (loopback names, its
/// address, this machine's name or one of `public_names`: `crate::http_guard`), and the
/// listener has these read timeouts.
pub async fn serve_with(
    hub: Arc<StatusHub>,
    listen: SocketAddr,
    tls: Option<Arc<rustls::ServerConfig>>,
    public_names: &[String],
    timeouts: crate::tls::HttpTimeouts,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("dashboard: cannot listen on {listen}: {e} (pick another --listen address)"))?;
    let addr = listener.local_addr()?;
    let guard = crate::http_guard::Guard {
        served: crate::http_guard::Served::new(addr, public_names),
        // The page's kill button posts without a body; it needs the job token anyway.
        require_json: false,
    };
    let app = guard.layer(router(hub));
    let handle = tokio::spawn(async move {
        if let Err(e) = crate::tls::serve_with(listener, app, tls, timeouts, std::future::pending()).await {
            tracing::error!(error = %e, "dashboard server stopped");
        }
    });
    Ok((addr, handle))
}
