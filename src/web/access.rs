//! Who may read the AM dashboard's API (issue 23): the holder of the job token, of a page
//! ticket of this job ([`page_ticket`]: what an open page holds, short-lived), or of a
//! token the RM accepts for this job (its owner's user token, the admin token), as the RM
//! itself decides for its application routes. The page, its assets, the health probes and
//! `/metrics` (aggregate counts, for scrapers) stay open.
//!
//! Credentials come as `Authorization: Bearer ...` only. No credential goes in a URL: the
//! event stream (a browser's `EventSource` sends no header) takes `?token=` with an events
//! ticket, which the page fetches with its header ([`events_ticket`]), or the job token
//! itself, and nothing else; every other route ignores the query. A ticket names the
//! credential that fetched it (its SHA-256) and its expiry, signed with the job token
//! ([`ticket`]): it opens the stream until [`TICKET_FOR`] after it was made, and only while
//! that credential is the job token or one the RM accepted within
//! [`crate::am::status::ACCEPTED_FOR`] (a revoked user token's tickets die with it).
//! Tokens other than the job token are checked with the RM
//! ([`StatusHub::set_token_check`]), at most [`crate::am::status::MAX_CHECKS`] at once; a
//! check waits at most [`CHECK_WAIT`] for its turn and [`CHECK_FOR`] for the RM, else the
//! caller gets 503 with `Retry-After` (a flood of strangers' tokens never holds an owner
//! forever); an accepted one is remembered (by its SHA-256) for
//! [`crate::am::status::ACCEPTED_FOR`], a refused one for
//! [`crate::am::status::REFUSED_FOR`] (bounded, oldest forgotten first), so a stream of
//! unknown tokens costs the RM one question each per period at most.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::ApiError;
use crate::am::status::StatusHub;

/// The route that takes a ticket in its query.
const EVENTS: &str = "/api/v1/events";

/// How long an events ticket opens the stream (the page fetches a new one each time it
/// opens the stream).
pub const TICKET_FOR: Duration = Duration::from_secs(60);
/// Longest wait for a turn to ask the RM about a token ([`crate::am::status::MAX_CHECKS`]
/// in flight); then 503 with `Retry-After`.
pub const CHECK_WAIT: Duration = Duration::from_secs(2);
/// Longest wait for the RM's answer about a token; then 503 with `Retry-After`.
pub const CHECK_FOR: Duration = Duration::from_secs(10);

/// The events ticket for the credential whose SHA-256 is `subject`, opening the stream
/// until `expires` (Unix seconds): `expires.subject.mac`, the MAC an HMAC-SHA256 under the
/// job token of both (only this job's token holder, the AM, makes them).
pub fn ticket(job_token: &str, subject: &str, expires: u64) -> String {
    format!("{expires}.{subject}.{}", ticket_mac(job_token, subject, expires))
}

fn ticket_mac(job_token: &str, subject: &str, expires: u64) -> String {
    let msg = format!("gpuam-dashboard-events-ticket-v2\n{expires}\n{subject}");
    crate::auth::hmac_hex(job_token.as_bytes(), msg.as_bytes())
}

/// The subject (a credential's SHA-256) of `presented` when it is a ticket this job token
/// signed that has not expired at `now` (Unix seconds); `None` for anything else
/// (malformed, forged, another job's, expired).
pub fn ticket_subject(job_token: &str, presented: &str, now: u64) -> Option<String> {
    if job_token.is_empty() {
        return None;
    }
    let mut parts = presented.splitn(3, '.');
    let (expires, subject, mac) = (parts.next()?, parts.next()?, parts.next()?);
    let expires: u64 = expires.parse().ok()?;
    let good = ticket_mac(job_token, subject, expires);
    if !crate::auth::constant_time_eq(mac.as_bytes(), good.as_bytes()) || now >= expires {
        return None;
    }
    Some(subject.to_string())
}

/// Now, in Unix seconds (what tickets count in).
fn unix_now() -> u64 {
    crate::protocol::now_ms() / 1000
}

/// The `token` query parameter of the event stream's request (`None` on other routes).
fn stream_ticket(req: &Request) -> Option<String> {
    if req.uri().path() != EVENTS {
        return None;
    }
    axum::extract::Query::<HashMap<String, String>>::try_from_uri(req.uri())
        .ok()
        .and_then(|q| q.0.get("token").filter(|t| !t.is_empty()).cloned())
}

/// Whether `presented` opens this job's event stream: the job token, or an unexpired
/// ticket of a credential still good here (the job token, or one the RM accepted within
/// [`crate::am::status::ACCEPTED_FOR`]).
fn ticket_opens_stream(hub: &StatusHub, presented: &str) -> bool {
    let job = hub.job_token.as_str();
    if !job.is_empty() && crate::auth::constant_time_eq(presented.as_bytes(), job.as_bytes()) {
        return true;
    }
    let Some(subject) = ticket_subject(job, presented, unix_now()) else {
        return false;
    };
    subject == crate::auth::sha256_hex(job) || hub.accepted.fresh(&subject, Instant::now())
}

/// `GET /api/v1/events-ticket` (behind [`readers_only`]): a ticket for the caller's
/// credential, for the event stream's URL, good for [`TICKET_FOR`].
pub async fn events_ticket(State(hub): State<Arc<StatusHub>>, headers: HeaderMap) -> Response {
    let (Some(credential), false) = (crate::auth::bearer(&headers), hub.job_token.is_empty()) else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "no_ticket",
            "this dashboard has no job token (or the call no bearer token), so no event stream ticket",
        )
        .into_response();
    };
    let expires = unix_now() + TICKET_FOR.as_secs();
    let t = ticket(&hub.job_token, &crate::auth::sha256_hex(credential), expires);
    axum::Json(serde_json::json!({ "ticket": t, "expires": expires })).into_response()
}

/// `GET /api/v1/page-ticket` (behind [`readers_only`]): a page ticket of this job
/// ([`crate::auth::page_ticket`]), good for [`crate::auth::PAGE_TICKET_FOR`], naming whom
/// the credential presented belongs to ([`ticket_user`]). The page trades the credential
/// it was opened with for one at once, forgets that credential, and renews the ticket
/// here: a page left open on an address another process takes once the AM has gone hands
/// it at most a ticket to this one job that soon expires. A renewal keeps its chain's
/// start and never expires past the chain's end ([`crate::auth::PAGE_TICKET_CHAIN`]): a
/// ticket copied once opens the job for at most that long.
pub async fn page_ticket(State(hub): State<Arc<StatusHub>>, headers: HeaderMap) -> Response {
    if hub.job_token.is_empty() {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "no_ticket",
            "this dashboard has no job token, so no page ticket",
        )
        .into_response();
    }
    let now = unix_now();
    let presented = crate::auth::bearer(&headers);
    let renewed = presented.and_then(|t| crate::auth::page_ticket_read(&hub.job_token, t, now));
    let (who, born, last) = match renewed {
        Some(t) => {
            let last = t.chain_ends();
            (t.who, t.born, last)
        }
        None => (ticket_user(&hub, presented).await, now, u64::MAX),
    };
    let expires = (now + crate::auth::PAGE_TICKET_FOR.as_secs()).min(last);
    let t = crate::auth::page_ticket(&hub.job_token, born, expires, &who);
    axum::Json(serde_json::json!({ "ticket": t, "expires": expires })).into_response()
}

/// Whom a new chain's page ticket made for `presented` (a credential this dashboard granted,
/// not a ticket: a renewal keeps its ticket's user) names: the job token's holder is not
/// named (empty); a user's or the admin's token, the name the RM gives it (`whoami`; empty
/// when the RM does not answer).
async fn ticket_user(hub: &StatusHub, presented: Option<&str>) -> String {
    let Some(t) = presented else {
        return String::new();
    };
    if crate::auth::constant_time_eq(t.as_bytes(), hub.job_token.as_bytes()) {
        return String::new();
    }
    #[derive(serde::Deserialize)]
    struct WhoAmI {
        user: String,
    }
    let Some(rm) = hub.rm.get() else {
        return String::new();
    };
    let as_them = rm.without_credentials().with_user_token(Some(t.to_string()));
    let asked = as_them.get_json::<WhoAmI>("whoami", "/ws/v1/cluster/whoami");
    match tokio::time::timeout(CHECK_FOR, asked).await {
        Ok(Ok(w)) => w.user,
        _ => String::new(),
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

/// Whether `token` may read (and act on) this job: the job token, a page ticket of this job
/// ([`crate::auth::page_ticket`]), or one the RM accepts.
pub async fn may_access(hub: &StatusHub, token: Option<&str>) -> Access {
    let Some(token) = token.filter(|t| !t.is_empty()) else {
        return Access::Refused;
    };
    if !hub.job_token.is_empty() && crate::auth::constant_time_eq(token.as_bytes(), hub.job_token.as_bytes()) {
        return Access::Granted;
    }
    if crate::auth::page_ticket_valid(&hub.job_token, token, unix_now()) {
        // Remembered as accepted, so its events tickets open the stream while it is good.
        hub.accepted.remember(crate::auth::sha256_hex(token), Instant::now());
        return Access::Granted;
    }
    // A page ticket that is not good now (expired, another job's, forged) is refused here,
    // never found in what was accepted a moment ago nor asked of the RM: no token of the
    // RM's looks like one.
    if token.starts_with("p.") {
        return Access::Refused;
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
    // A bounded wait for a turn: a flood of strangers' tokens makes an owner try again
    // (503), never wait behind them for good.
    let Ok(Ok(_turn)) = tokio::time::timeout(CHECK_WAIT, hub.checks.acquire()).await else {
        return Access::Unanswered;
    };
    // Answered meanwhile by a check that held the turn before this one.
    if let Some(a) = known(Instant::now()) {
        return a;
    }
    match tokio::time::timeout(CHECK_FOR, check(token.to_string()))
        .await
        .ok()
        .flatten()
    {
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
