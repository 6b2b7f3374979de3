//! Who may read the AM dashboard's API (issue 23): the holder of the job token, or of a
//! token the RM accepts for this job (its owner's user token, the admin token), as the RM
//! itself decides for its application routes. The page, its assets, the health probes and
//! `/metrics` (aggregate counts, for scrapers) stay open.
//!
//! The token comes as `Authorization: Bearer ...`, or as the `token` query parameter (the
//! page's event stream: a browser's `EventSource` sends no header). Tokens other than the
//! job token are checked with the RM ([`StatusHub::set_token_check`]); an accepted one is
//! remembered (by its SHA-256) for [`crate::am::status::ACCEPTED_FOR`] (the hub keeps them: [`crate::am::status::Accepted`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::ApiError;
use crate::am::status::StatusHub;

/// The token a request presents: its bearer, else its `token` query parameter.
fn presented(req: &Request) -> Option<String> {
    if let Some(t) = crate::auth::bearer(req.headers()) {
        return Some(t.to_string());
    }
    axum::extract::Query::<HashMap<String, String>>::try_from_uri(req.uri())
        .ok()
        .and_then(|q| q.0.get("token").filter(|t| !t.is_empty()).cloned())
}

/// Whether `token` may read (and act on) this job: the job token, or one the RM accepts.
pub async fn may_access(hub: &StatusHub, token: Option<&str>) -> bool {
    let Some(token) = token.filter(|t| !t.is_empty()) else {
        return false;
    };
    if !hub.job_token.is_empty() && crate::auth::constant_time_eq(token.as_bytes(), hub.job_token.as_bytes()) {
        return true;
    }
    let Some(check) = hub.token_check() else {
        return false;
    };
    let digest = crate::auth::sha256_hex(token);
    let now = Instant::now();
    if hub.accepted.fresh(&digest, now) {
        return true;
    }
    let ok = check(token.to_string()).await;
    if ok {
        hub.accepted.remember(digest, Instant::now());
    }
    ok
}

/// The 401 answer, saying which credentials work.
pub fn refused(what: &str) -> Response {
    let mut r = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        format!(
            "{what} needs `Authorization: Bearer <token>`: the job token (in the dashboard URL that `gpuam run` \
             prints, after #token=), the job owner's user token or the admin token"
        ),
    )
    .into_response();
    r.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

/// Middleware of the protected routes.
pub async fn readers_only(State(hub): State<Arc<StatusHub>>, req: Request, next: Next) -> Response {
    let token = presented(&req);
    if may_access(&hub, token.as_deref()).await {
        next.run(req).await
    } else {
        // The presented value is deliberately not logged.
        refused("reading this job's dashboard API")
    }
}
