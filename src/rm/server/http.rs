//! The REST shell's common parts: the error answer ([`ApiError`], one `ErrorBody` shape,
//! with `Retry-After` or `WWW-Authenticate` where they apply), the JSON body extractor with
//! its size limit, the ids that may enter through a URL or a body, and the credentials:
//! [`Caller`] (a user's token or the admin token: the one extractor every user-facing
//! handler starts with), the application token of the AM protocol, the admin token.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;

use super::{Shared, MAX_BODY_BYTES};
use crate::node::executor::ExecError;
use crate::protocol::ErrorBody;
use crate::rm::apps::{App, Apps};
use crate::rm::store::StoreError;

/// Every error answer: an HTTP status with an [`ErrorBody`].
#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    pub(super) code: &'static str,
    pub(super) message: String,
    /// Seconds for `Retry-After` (503 while the state store fails, 429).
    pub(super) retry_after: Option<u64>,
}

impl ApiError {
    pub(super) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            retry_after: None,
        }
    }
    pub(super) fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "FORBIDDEN", message)
    }
    /// 503: the state store cannot take the change (see `state`).
    pub(super) fn store_unavailable(e: &StoreError) -> Self {
        ApiError {
            retry_after: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "STATE_STORE_UNAVAILABLE",
                format!(
                    "the RM cannot save its state ({e}); nothing of this request is acknowledged and nothing is \
                     granted until it can: retry later"
                ),
            )
        }
    }
    /// 429: a documented limit (`setting`, its value) was reached.
    pub(super) fn limit(setting: &str, value: usize, what: &str) -> Self {
        ApiError {
            retry_after: Some(5),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "LIMIT_EXCEEDED",
                format!("{what}: the limit `{setting}` is {value}"),
            )
        }
    }
    pub(super) fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "NOT_FOUND", message)
    }
    pub(super) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "BAD_REQUEST", message)
    }
    pub(super) fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "CONFLICT", message)
    }
    pub(super) fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "UNAUTHORIZED",
            "missing or invalid `Authorization: Bearer <application token>`",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, retry_after) = (self.status, self.retry_after);
        let body = ErrorBody {
            code: self.code.to_string(),
            message: self.message,
        };
        let mut r = (status, Json(body)).into_response();
        if let Some(secs) = retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from(secs));
        }
        if status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
        }
        r
    }
}

impl From<ExecError> for ApiError {
    fn from(e: ExecError) -> Self {
        let (status, code) = match &e {
            ExecError::UnknownContainer(_) => (StatusCode::NOT_FOUND, "UNKNOWN_CONTAINER"),
            ExecError::AlreadyStarted(_) => (StatusCode::CONFLICT, "ALREADY_STARTED"),
            ExecError::StartFailed { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "START_FAILED"),
            ExecError::Io(io) if io.kind() == std::io::ErrorKind::PermissionDenied => {
                (StatusCode::FORBIDDEN, "FORBIDDEN")
            }
            ExecError::Io(_) => (StatusCode::INTERNAL_SERVER_ERROR, "IO_ERROR"),
            ExecError::Unreachable { .. } => (StatusCode::BAD_GATEWAY, "NODE_UNREACHABLE"),
            ExecError::Refused(_) => (StatusCode::BAD_GATEWAY, "NODE_REFUSED"),
        };
        ApiError::new(status, code, e.to_string())
    }
}

/// A JSON body whose failures are [`ApiError`]s: 413 over the size limit, 400 for
/// anything that is not the expected JSON (the Content-Type is not required).
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rej| {
            // The listener's body timeout (`crate::tls::serve_with`).
            let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&rej);
            while let Some(e) = cause {
                if e.downcast_ref::<tower_http::timeout::TimeoutError>().is_some() {
                    return ApiError::new(
                        StatusCode::REQUEST_TIMEOUT,
                        "REQUEST_TIMEOUT",
                        "the request's body did not arrive in time (setting `http.read_timeout_sec`)",
                    );
                }
                cause = e.source();
            }
            let status = rej.status();
            let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
                "PAYLOAD_TOO_LARGE"
            } else {
                "BAD_REQUEST"
            };
            let mut message = rej.body_text();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                message.push_str(&format!(" (limit {MAX_BODY_BYTES} bytes)"));
            }
            ApiError::new(status, code, message)
        })?;
        serde_json::from_slice(&bytes).map(ApiJson).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "INVALID_JSON",
                format!("invalid request body: {e}"),
            )
        })
    }
}

/// The presented bearer token, if any (scheme case-insensitive: `crate::auth::bearer`).
pub(super) fn bearer(headers: &HeaderMap) -> Option<&str> {
    crate::auth::bearer(headers)
}

/// Admin calls: `Authorization: Bearer <admin token>`, compared in constant time.
pub(super) fn authorize_admin(rm: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    match bearer(headers) {
        Some(t) if crate::auth::constant_time_eq(rm.admin_token.as_bytes(), t.as_bytes()) => Ok(()),
        _ => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "UNAUTHORIZED",
            "missing or invalid `Authorization: Bearer <admin token>` (see the RM's admin.token file or GPUAM_ADMIN_TOKEN)",
        )),
    }
}

/// Who makes a user-facing call: the admin token's holder, or a user of the users file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Caller {
    Admin,
    User(String),
}

impl Caller {
    /// The user name (`admin` for the admin token).
    pub(crate) fn name(&self) -> &str {
        match self {
            Caller::Admin => crate::rm::users::ADMIN_USER,
            Caller::User(u) => u,
        }
    }

    pub(crate) fn is_admin(&self) -> bool {
        *self == Caller::Admin
    }

    /// May see and act on `app`: its owner, or the admin.
    pub(crate) fn owns(&self, app: &App) -> bool {
        self.is_admin() || app.report.user == self.name()
    }

    /// `Err` (403) unless the caller owns `app`.
    pub(crate) fn must_own(&self, app: &App) -> Result<(), ApiError> {
        if self.owns(app) {
            return Ok(());
        }
        Err(ApiError::forbidden(format!(
            "application `{}` belongs to another user; only its owner and the admin may see or change it",
            app.report.id
        )))
    }
}

/// The caller of `headers`: the admin token, else a user token of the users file; 401
/// (saying how to get a token) otherwise.
pub(super) fn authenticate(rm: &Shared, headers: &HeaderMap) -> Result<Caller, ApiError> {
    let presented = bearer(headers);
    if let Some(t) = presented {
        if crate::auth::constant_time_eq(rm.admin_token.as_bytes(), t.as_bytes()) {
            return Ok(Caller::Admin);
        }
        if let Some(user) = rm.users.table.read().user_of(t) {
            return Ok(Caller::User(user.to_string()));
        }
    }
    let what = if presented.is_some() {
        "the token presented is not a user's token of this RM"
    } else {
        "this call needs a user's credential (`Authorization: Bearer <token>`)"
    };
    let has_users = rm.users.file.is_some() || !rm.users.table.read().is_empty();
    let how = if has_users {
        "Ask the RM's operator for a token (`gpuam token new --user NAME --users-file FILE` on the RM's machine) \
         and give it to gpuam with `--token-file FILE` or the GPUAM_TOKEN variable."
            .to_string()
    } else {
        format!(
            "This RM has no users file (`gpuam rm --users-file FILE`, setting `rm.users_file`), so only its admin \
             token is accepted ({}); users get tokens with `gpuam token new --user NAME --users-file FILE`. Give a \
             token to gpuam with `--token-file FILE` or the GPUAM_TOKEN variable.",
            rm.admin_token_hint
        )
    };
    Err(ApiError::new(
        StatusCode::UNAUTHORIZED,
        "UNAUTHORIZED",
        format!("{what}. {how}"),
    ))
}

impl axum::extract::FromRequestParts<Arc<Shared>> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        rm: &Arc<Shared>,
    ) -> Result<Self, Self::Rejection> {
        authenticate(rm, &parts.headers)
    }
}

/// `Err` (400) for an application id the RM could not have issued (`../..`, a sequence
/// beyond 2^32−1): such ids never reach a lookup, a path or the store.
pub(super) fn check_app_id(id: &str) -> Result<(), ApiError> {
    match crate::rm::apps::parse_app_id(id) {
        Some(_) => Ok(()),
        None => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "INVALID_ID",
            format!(
                "`{}` is not an application id (application_<clusterTimestamp>_<sequence>, sequence 1 to {})",
                crate::spec::yaml::clip(id),
                u32::MAX
            ),
        )),
    }
}

/// As [`check_app_id`], for container ids.
pub(super) fn check_container_id(id: &str) -> Result<(), ApiError> {
    match crate::rm::ledger::container_seq(id) {
        Some(_) => Ok(()),
        None => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "INVALID_ID",
            format!(
                "`{}` is not a container id (container_<clusterTimestamp>_<application>_<attempt>_<sequence>)",
                crate::spec::yaml::clip(id)
            ),
        )),
    }
}

pub(super) fn authorize(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    match bearer(headers) {
        Some(t) if app.token_matches(t) => Ok(()),
        _ => Err(ApiError::unauthorized()),
    }
}

pub(super) fn app_mut<'a>(apps: &'a mut Apps, id: &str) -> Result<&'a mut App, ApiError> {
    check_app_id(id)?;
    apps.get_mut(id)
        .ok_or_else(|| ApiError::not_found(format!("unknown application `{id}`")))
}

/// An application by id, read only (400 for an id never issued, 404 for an unknown one).
pub(super) fn app_ref<'a>(apps: &'a Apps, id: &str) -> Result<&'a App, ApiError> {
    check_app_id(id)?;
    apps.get(id)
        .ok_or_else(|| ApiError::not_found(format!("unknown application `{id}`")))
}

/// What a caller is told of an id the RM does not know, where owners and the admin may ask
/// (the user routes): a known user is told `missing` (404 and why); a caller without a
/// credential the RM accepts gets `denied` of its credential error, the answer a wrong
/// token gets for an id that exists, so nobody without one learns which ids exist. The AM
/// routes need the application's own token and answer an unknown id as a wrong one always
/// ([`authorize_app`]). Errors other than "not found" (a malformed id) pass unchanged.
pub(super) fn unknown_to(
    caller: &Result<Caller, ApiError>,
    missing: ApiError,
    denied: impl FnOnce(&ApiError) -> ApiError,
) -> ApiError {
    match caller {
        Err(e) if missing.status == StatusCode::NOT_FOUND => denied(e),
        _ => missing,
    }
}

/// The AM protocol: `Err` (401) unless `headers` carry the application's own token.
/// Checked before anything of the application is changed. An unknown application answers
/// as a wrong token does, so that a caller without a token cannot tell which ids exist.
pub(super) fn authorize_app(apps: &Apps, id: &str, headers: &HeaderMap) -> Result<(), ApiError> {
    check_app_id(id)?;
    match apps.get(id) {
        Some(app) => authorize(app, headers),
        None => Err(ApiError::unauthorized()),
    }
}

/// Reads one application its owner or the admin asked for (no change, nothing to persist).
pub(super) fn with_app<T>(rm: &Shared, id: &str, caller: &Caller, f: impl FnOnce(&App) -> T) -> Result<T, ApiError> {
    let st = rm.lock();
    let app = app_ref(&st.apps, id)?;
    caller.must_own(app)?;
    Ok(f(app))
}
