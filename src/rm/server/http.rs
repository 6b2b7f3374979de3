//! The REST shell's common parts: the error answer ([`ApiError`], one `ErrorBody` shape),
//! the JSON body extractor with its size limit, and the credential checks (bearer tokens:
//! admin, application).

use super::*;

/// Every error answer: an HTTP status with an [`ErrorBody`].
#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    pub(super) code: &'static str,
    pub(super) message: String,
}

impl ApiError {
    pub(super) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
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
        let body = ErrorBody {
            code: self.code.to_string(),
            message: self.message,
        };
        (self.status, Json(body)).into_response()
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

/// The presented bearer token, if any.
pub(super) fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Admin calls: `Authorization: Bearer <admin token>`, compared in constant time.
pub(super) fn authorize_admin(rm: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    match bearer(headers) {
        Some(t) if crate::rm::apps::constant_time_eq(rm.admin_token.as_bytes(), t.as_bytes()) => Ok(()),
        _ => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "UNAUTHORIZED",
            "missing or invalid `Authorization: Bearer <admin token>` (see the RM's admin.token file or GPUAM_ADMIN_TOKEN)",
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
    apps.get_mut(id)
        .ok_or_else(|| ApiError::not_found(format!("unknown application `{id}`")))
}

/// Reads one application (no change, nothing to persist).
pub(super) fn with_app<T>(rm: &Shared, id: &str, f: impl FnOnce(&App) -> T) -> Result<T, ApiError> {
    let st = rm.lock();
    let app = st
        .apps
        .get(id)
        .ok_or_else(|| ApiError::not_found(format!("unknown application `{id}`")))?;
    Ok(f(app))
}
