//! `GET /api/v1/events`: the hub's numbered events as server-sent events. A client that
//! reconnects with `Last-Event-ID` (or `?lastEventId=`) first gets the events it missed,
//! then live ones; a client that fell too far behind gets a `resync` event telling it
//! to refetch the snapshot. A stream lives [`STREAM_FOR`], then sends `reopen` and ends:
//! the page opens it again with a new ticket (`web::access`), so a stream outlives the
//! credential that opened it by that much at most.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, Stream, StreamExt};
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;
use tokio_stream::wrappers::BroadcastStream;

use super::ApiError;
use crate::am::status::{Event, StatusHub};

/// Keep-alive comment interval (proxies drop idle connections).
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// How long one event stream stays open before it asks to be opened again.
pub const STREAM_FOR: Duration = Duration::from_secs(600);

fn to_sse(e: &Event) -> SseEvent {
    SseEvent::default()
        .id(e.id.to_string())
        .event(e.kind)
        .data(serde_json::to_string(&e.data).unwrap_or_else(|_| "null".into()))
}

fn resync(hub: &StatusHub, why: &str) -> SseEvent {
    // No `id:` so the browser keeps its last id.
    SseEvent::default()
        .event("resync")
        .data(serde_json::json!({"reason": why, "lastEventId": hub.last_event_id()}).to_string())
}

/// The last event id the client saw: the header wins over the query parameter.
fn last_id(headers: &HeaderMap, q: &HashMap<String, String>) -> Result<Option<u64>, ApiError> {
    let raw = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| q.get("lastEventId").cloned());
    match raw.as_deref().map(str::trim) {
        None | Some("") => Ok(None),
        Some(v) => v.parse::<u64>().map(Some).map_err(|_| {
            ApiError::bad_request(
                "invalid_parameter",
                format!("Last-Event-ID / lastEventId must be an event id (a number), got {v:?}"),
            )
        }),
    }
}

/// The event stream after `last`: missed events, then live ones.
pub(crate) fn event_stream(
    hub: Arc<StatusHub>,
    last: Option<u64>,
) -> impl Stream<Item = Result<SseEvent, Infallible>> + Send + 'static {
    let (missed, rx) = hub.subscribe(last);
    let mut first: Vec<SseEvent> = Vec::with_capacity(missed.len() + 1);
    if let Some(l) = last {
        // Some of the missed events have already left the history: the client cannot
        // rebuild its state from events alone.
        let oldest_kept = missed.first().map(|e| e.id);
        let gap = match oldest_kept {
            Some(id) => id > l + 1,
            None => hub.last_event_id() > l && missed.is_empty(),
        };
        if gap {
            first.push(resync(&hub, "events since your last id are no longer kept"));
        }
    }
    let mut sent = last.unwrap_or(0);
    for e in &missed {
        first.push(to_sse(e));
        sent = sent.max(e.id);
    }
    let live = BroadcastStream::new(rx).filter_map(move |r| {
        let out = match r {
            // Never repeat an event already sent from the history.
            Ok(e) if e.id <= sent => None,
            Ok(e) => {
                sent = e.id;
                Some(Ok(to_sse(&e)))
            }
            Err(BroadcastStreamRecvError::Lagged(n)) => Some(Ok(resync(
                &hub,
                &format!("you fell {n} events behind; refetch the snapshot"),
            ))),
        };
        futures::future::ready(out)
    });
    stream::iter(first.into_iter().map(Ok)).chain(live)
}

/// `stream` until `life` has passed, then one `reopen` event, and the end.
pub(crate) fn for_a_while(
    stream: impl Stream<Item = Result<SseEvent, Infallible>> + Send + 'static,
    life: Duration,
) -> impl Stream<Item = Result<SseEvent, Infallible>> + Send + 'static {
    let reopen = SseEvent::default()
        .event("reopen")
        .data(r#"{"reason": "a stream lives a while; open it again with a new ticket"}"#);
    stream
        .take_until(tokio::time::sleep(life))
        .chain(stream::once(async move { Ok(reopen) }))
}

pub(crate) async fn events(
    State(hub): State<Arc<StatusHub>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let last = match last_id(&headers, &q) {
        Ok(l) => l,
        Err(e) => return e.into_response(),
    };
    Sse::new(for_a_while(event_stream(hub, last), STREAM_FOR))
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE).text("keep-alive"))
        .into_response()
}
