//! The AM protocol's endpoints (YARN's ApplicationMasterProtocol over REST): register,
//! allocate (grants, rejections, releases, completions, updated nodes; idempotent by
//! `responseId`) and finish. Each checks the application's token and calls its
//! transaction in `transactions`.

use std::time::Instant;

use axum::extract::{Path as UrlPath, State};
use axum::http::HeaderMap;
use axum::Json;

use super::containers::spawn_stops;
use super::http::{app_ref, authorize_app, ApiError, ApiJson};
use super::{scheduling, transactions, Rm};
use crate::protocol::{
    now_ms, AllocateRequest, AllocateResponse, FinishRequest, FinishResponse, RegisterRequest, RegisterResponse,
};

pub(super) async fn am_register(
    State(rm): Rm,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<RegisterRequest>,
) -> Result<Json<RegisterResponse>, ApiError> {
    let mut st = rm.lock();
    authorize_app(&st.apps, &id, &headers)?;
    transactions::register(&mut st, &id, req).map(Json)
}

pub(super) async fn am_allocate(
    State(rm): Rm,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<AllocateRequest>,
) -> Result<Json<AllocateResponse>, ApiError> {
    if let Some(w) = &req.waiting {
        scheduling::check_waiting(w).map_err(ApiError::bad_request)?;
    }
    if req.asks.len() > rm.limits.max_asks_per_allocate {
        return Err(ApiError::limit(
            "rm.max_asks_per_allocate",
            rm.limits.max_asks_per_allocate,
            &format!("{} asks in one allocate request", req.asks.len()),
        ));
    }
    if let Some(hold) = req.hold(rm.limits.max_allocate_hold) {
        // Nothing to act on: wait (without the lock) until something for this
        // application happens or the hold ends, then answer as usual.
        let wake = {
            let st = rm.lock();
            authorize_app(&st.apps, &id, &headers)?;
            let app = app_ref(&st.apps, &id)?;
            let replay = app.last_allocate.as_ref().is_some_and(|(r, _)| *r == req.response_id);
            let news = app.has_news() || replay || !scheduling::notices_for(&st, &id).is_empty();
            (!news).then(|| app.wake.clone())
        };
        if let Some(wake) = wake {
            let _ = tokio::time::timeout(hold, wake.notified()).await;
        }
    }
    let started = Instant::now();
    let done = {
        let mut st = rm.lock();
        authorize_app(&st.apps, &id, &headers)?;
        transactions::allocate(&mut st, &id, &req, &rm.metrics, Instant::now(), now_ms())?
    };
    // Released containers are stopped either way; grants are acknowledged only when stored
    // (a retry of this responseId gets the same answer once the store takes it).
    spawn_stops(&rm, done.ended);
    rm.metrics.allocate_took(started.elapsed());
    done.committed?;
    Ok(Json(done.answer))
}

pub(super) async fn am_finish(
    State(rm): Rm,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<FinishRequest>,
) -> Result<Json<FinishResponse>, ApiError> {
    let done = {
        let mut st = rm.lock();
        authorize_app(&st.apps, &id, &headers)?;
        transactions::finish(&mut st, &id, req)?
    };
    spawn_stops(&rm, done.ended);
    done.committed?;
    Ok(Json(FinishResponse { is_unregistered: true }))
}
