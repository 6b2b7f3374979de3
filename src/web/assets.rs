//! The dashboards' static files, embedded at build time so the AM (job dashboard) and the
//! RM (cluster page, which shares `style.css`) serve them from any working directory. Served with `no-cache` plus an ETag: browsers revalidate and get
//! a 304 until the binary changes.

use std::hash::{Hash, Hasher};
use std::sync::OnceLock;

use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

pub(crate) const INDEX_HTML: &str = include_str!("../../webui/index.html");
pub(crate) const APP_JS: &str = include_str!("../../webui/app.js");
pub(crate) const STYLE_CSS: &str = include_str!("../../webui/style.css");
pub(crate) const CLUSTER_HTML: &str = include_str!("../../webui/cluster.html");
pub(crate) const CLUSTER_JS: &str = include_str!("../../webui/cluster.js");
pub(crate) const CLUSTER_CSS: &str = include_str!("../../webui/cluster.css");
/// The pages' rendering of a wait reason (`reason::Reason`), shared by both pages.
pub(crate) const REASON_JS: &str = include_str!("../../webui/reason.js");

fn etag(body: &'static str, cell: &'static OnceLock<String>) -> &'static str {
    cell.get_or_init(|| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        body.hash(&mut h);
        format!("\"{:016x}\"", h.finish())
    })
}

fn serve(headers: &HeaderMap, body: &'static str, ctype: &'static str, tag: &'static str) -> Response {
    let matches = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == tag));
    let mut r = if matches {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        body.into_response()
    };
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ctype));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    if let Ok(v) = HeaderValue::from_str(tag) {
        h.insert(header::ETAG, v);
    }
    r
}

static INDEX_TAG: OnceLock<String> = OnceLock::new();
static APP_TAG: OnceLock<String> = OnceLock::new();
static CSS_TAG: OnceLock<String> = OnceLock::new();

static CLUSTER_HTML_TAG: OnceLock<String> = OnceLock::new();
static CLUSTER_JS_TAG: OnceLock<String> = OnceLock::new();
static CLUSTER_CSS_TAG: OnceLock<String> = OnceLock::new();

/// An HTML page that talks only to its own origin.
fn page(headers: &HeaderMap, body: &'static str, tag: &'static str) -> Response {
    let mut r = serve(headers, body, "text/html; charset=utf-8", tag);
    r.headers_mut().insert(
        "content-security-policy",
        HeaderValue::from_static(
            "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'",
        ),
    );
    r
}

pub(crate) async fn index(headers: HeaderMap) -> Response {
    page(&headers, INDEX_HTML, etag(INDEX_HTML, &INDEX_TAG))
}

/// The RM's cluster page.
pub(crate) async fn cluster_html(headers: HeaderMap) -> Response {
    page(&headers, CLUSTER_HTML, etag(CLUSTER_HTML, &CLUSTER_HTML_TAG))
}

pub(crate) async fn cluster_js(headers: HeaderMap) -> Response {
    serve(
        &headers,
        CLUSTER_JS,
        "text/javascript; charset=utf-8",
        etag(CLUSTER_JS, &CLUSTER_JS_TAG),
    )
}

pub(crate) async fn cluster_css(headers: HeaderMap) -> Response {
    serve(
        &headers,
        CLUSTER_CSS,
        "text/css; charset=utf-8",
        etag(CLUSTER_CSS, &CLUSTER_CSS_TAG),
    )
}

pub(crate) async fn app_js(headers: HeaderMap) -> Response {
    serve(
        &headers,
        APP_JS,
        "text/javascript; charset=utf-8",
        etag(APP_JS, &APP_TAG),
    )
}

static REASON_JS_TAG: OnceLock<String> = OnceLock::new();

/// `reasonText`, the pages' one rendering of a wait reason (both pages load it).
pub(crate) async fn reason_js(headers: HeaderMap) -> Response {
    serve(
        &headers,
        REASON_JS,
        "text/javascript; charset=utf-8",
        etag(REASON_JS, &REASON_JS_TAG),
    )
}

pub(crate) async fn style_css(headers: HeaderMap) -> Response {
    serve(
        &headers,
        STYLE_CSS,
        "text/css; charset=utf-8",
        etag(STYLE_CSS, &CSS_TAG),
    )
}
