//! Who may read the AM dashboard's API (issue 23): the holder of the job token, or of a
//! token the RM accepts for this job (its owner's user token, the admin token), as the RM
//! itself decides for its application routes. The page, its assets, the health probes and
//! `/metrics` (aggregate counts, for scrapers) stay open.
//!
//! Credentials come as `Authorization: Bearer ...` only. No credential goes in a URL: the
//! event stream (a browser's `EventSource` sends no header) takes `?token=` with the job's
//! events ticket ([`StatusHub::events_ticket`], which the page fetches with its header,
//! [`events_ticket`]), or the job token itself, and nothing else; every other route
//! ignores the query. Tokens other than the job token are checked with the RM
//! ([`StatusHub::set_token_check`]), at most [`crate::am::status::MAX_CHECKS`] at once; an
//! accepted one is remembered (by its SHA-256) for [`crate::am::status::ACCEPTED_FOR`], a
//! refused one for [`crate::am::status::REFUSED_FOR`] (bounded, oldest forgotten first),
//! so a stream of unknown tokens costs the RM one question each per period at most.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::ApiError;
use crate::am::status::StatusHub;

/// The route that takes a ticket in its query.
const EVENTS: &str = "/api/v1/events";

/// The `token` query parameter of the event stream's request (`None` on other routes).
fn stream_ticket(req: &Request) -> Option<String> {
    if req.uri().path() != EVENTS {
        return None;
    }
    axum::extract::Query::<HashMap<String, String>>::try_from_uri(req.uri())
        .ok()
        .and_then(|q| q.0.get("token").filter(|t| !t.is_empty()).cloned())
}

/// Whether `ticket` opens this job's event stream: its events ticket or the job token.
fn ticket_opens_stream(hub: &StatusHub, ticket: &str) -> bool {
    let eq = |a: &str| !a.is_empty() && crate::auth::constant_time_eq(ticket.as_bytes(), a.as_bytes());
    hub.events_ticket().is_some_and(|t| eq(&t)) || eq(&hub.job_token)
}

/// `GET /api/v1/events-ticket` (behind [`readers_only`]): the ticket the page puts in
/// the event stream's URL.
pub async fn events_ticket(State(hub): State<Arc<StatusHub>>) -> Response {
    match hub.events_ticket() {
        Some(t) => axum::Json(serde_json::json!({ "ticket": t })).into_response(),
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            "no_ticket",
            "this dashboard has no job token, so no event stream ticket",
        )
        .into_response(),
    }
}

/// What the dashboard makes of a presented token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// The job token, or one the RM accepted for this job (owner, admin).
    Granted,
    /// No token, or one the RM refused (remembered for a while).
    Refused,
    /// The RM gave no answer (busy, unreachable): not a refusal and not remembered; the
    /// caller is told to try again (503), so a page does not give up on its owner.
    Unanswered,
}

/// Whether `token` may read (and act on) this job: the job token, or one the RM accepts.
pub async fn may_access(hub: &StatusHub, token: Option<&str>) -> Access {
    let Some(token) = token.filter(|t| !t.is_empty()) else {
        return Access::Refused;
    };
    if !hub.job_token.is_empty() && crate::auth::constant_time_eq(token.as_bytes(), hub.job_token.as_bytes()) {
        return Access::Granted;
    }
    let Some(check) = hub.token_check() else {
        return Access::Refused;
    };
    let digest = crate::auth::sha256_hex(token);
    let known = |now| {
        if hub.accepted.fresh(&digest, now) {
            Some(Access::Granted)
        } else if hub.refused.fresh(&digest, now) {
            Some(Access::Refused)
        } else {
            None
        }
    };
    if let Some(a) = known(Instant::now()) {
        return a;
    }
    let Ok(_turn) = hub.checks.acquire().await else {
        return Access::Unanswered;
    };
    // Answered meanwhile by a check that held the turn before this one.
    if let Some(a) = known(Instant::now()) {
        return a;
    }
    match check(token.to_string()).await {
        Some(true) => {
            hub.accepted.remember(digest, Instant::now());
            Access::Granted
        }
        Some(false) => {
            hub.refused.remember(digest, Instant::now());
            Access::Refused
        }
        None => Access::Unanswered,
    }
}

/// The answer to a token that was not granted: 401 (saying which credentials work), or
/// 503 with `Retry-After` when the RM did not answer.
pub fn not_granted(access: Access, what: &str) -> Response {
    if access != Access::Unanswered {
        return refused(what);
    }
    let mut r = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "rm_unanswered",
        format!("{what}: the RM did not answer whether this token may; try again"),
    )
    .into_response();
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("2"));
    r
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
    let access = match crate::auth::bearer(req.headers()) {
        Some(t) => may_access(&hub, Some(t)).await,
        None if stream_ticket(&req).is_some_and(|t| ticket_opens_stream(&hub, &t)) => Access::Granted,
        None => Access::Refused,
    };
    if access == Access::Granted {
        next.run(req).await
    } else {
        // The presented value is deliberately not logged.
        not_granted(access, "reading this job's dashboard API")
    }
}
