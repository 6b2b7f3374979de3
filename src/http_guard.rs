//! Refusing browser-borne requests on gpuam's HTTP listeners (the RM and the AM
//! dashboard). A web page the operator opens can make the browser send requests to any
//! address, and through DNS rebinding even read the answers; what it cannot do is make
//! the browser send a `Host` that names this server, an `Origin` other than its own, or
//! (without a CORS preflight, which is never granted) a JSON body. So:
//!
//! - the `Host` header must name this server — a loopback name (`localhost`,
//!   `*.localhost`, a loopback IP), an IP address it listens on (any IP when it listens on
//!   all interfaces: an IP literal cannot be rebound), this machine's host name, or a
//!   configured public name (`rm.public_names`) — else **421**;
//! - an `Origin` header, when present, must name one of these too, else **403**;
//! - with [`Guard::require_json`], mutating calls (POST, PUT, PATCH, DELETE) must carry
//!   `Content-Type: application/json`, else **415**;
//! - no CORS header is ever added (nothing here grants a cross-origin read).
//!
//! [`Served`] is the rule (no I/O); [`Guard::layer`] puts it on a router.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;

/// The names a server answers to (see the module doc).
#[derive(Clone, Debug)]
pub struct Served {
    listen: IpAddr,
    /// Configured public names and this machine's host name, lower case.
    names: Vec<String>,
}

impl Served {
    /// A server listening on `listen`, also known as `public_names`.
    pub fn new(listen: SocketAddr, public_names: &[String]) -> Self {
        let mut names: Vec<String> = public_names
            .iter()
            .map(|n| normal(n))
            .filter(|n| !n.is_empty())
            .collect();
        if let Some(h) = hostname() {
            names.push(normal(&h));
        }
        Served {
            listen: listen.ip(),
            names,
        }
    }

    /// Whether a `Host` header value (`name`, `name:port`, `[v6]:port`) names this server.
    pub fn allows_host(&self, host: &str) -> bool {
        let name = normal(strip_port(host.trim()));
        if name.is_empty() {
            return false;
        }
        if name == "localhost" || name.ends_with(".localhost") {
            return true;
        }
        if let Ok(ip) = name.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
            return ip.is_loopback() || ip == self.listen || self.listen.is_unspecified();
        }
        self.names.contains(&name)
    }

    /// Whether an `Origin` header value (`scheme://host[:port]`) names this server.
    pub fn allows_origin(&self, origin: &str) -> bool {
        match origin.trim().split_once("://") {
            Some((_, rest)) => self.allows_host(rest.split('/').next().unwrap_or("")),
            // `null` (sandboxed frames, files) and anything else that is not an origin.
            None => false,
        }
    }
}

/// `host` without a `:port` suffix (`[v6]:port` keeps its brackets).
fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return host.split_once(']').map_or(host, |(h, _)| &host[..h.len() + 1]);
    }
    match host.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    }
}

fn normal(name: &str) -> String {
    name.trim().trim_end_matches('.').to_ascii_lowercase()
}

/// This machine's host name (`gethostname`).
fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it
    // (or truncates, which `from_utf8` below still handles).
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    std::str::from_utf8(&buf[..end])
        .ok()
        .map(str::to_string)
        .filter(|h| !h.is_empty())
}

/// The guard of one listener.
#[derive(Clone, Debug)]
pub struct Guard {
    pub served: Served,
    /// Mutating calls need `Content-Type: application/json` (the RM's API).
    pub require_json: bool,
}

impl Guard {
    /// `router` with every request checked first (see the module doc).
    pub fn layer(self, router: Router) -> Router {
        router.layer(axum::middleware::from_fn_with_state(Arc::new(self), check))
    }
}

fn refuse(status: StatusCode, code: &str, message: String) -> Response {
    let body = serde_json::json!({ "code": code, "message": message });
    let mut r = (status, body.to_string()).into_response();
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

async fn check(State(guard): State<Arc<Guard>>, req: Request, next: Next) -> Response {
    let headers = req.headers();
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("");
    if !guard.served.allows_host(host) {
        return refuse(
            StatusCode::MISDIRECTED_REQUEST,
            "MISDIRECTED_REQUEST",
            format!(
                "this server does not answer to the name `{}` (requests naming other hosts are refused, \
                 against DNS rebinding); use its IP address or localhost, or add the name to the RM's \
                 `rm.public_names` setting",
                crate::spec::yaml::clip(host)
            ),
        );
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        if !guard.served.allows_origin(origin) {
            return refuse(
                StatusCode::FORBIDDEN,
                "CROSS_ORIGIN",
                format!(
                    "requests from web pages of other sites are refused (Origin `{}`)",
                    crate::spec::yaml::clip(origin)
                ),
            );
        }
    }
    let mutating = matches!(
        *req.method(),
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    );
    if guard.require_json && mutating {
        let ct = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let essence = ct.split(';').next().unwrap_or("").trim();
        if !essence.eq_ignore_ascii_case("application/json") {
            return refuse(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "UNSUPPORTED_MEDIA_TYPE",
                format!(
                    "{} needs `Content-Type: application/json` (found `{}`); send the body as JSON (`{{}}` when \
                     there is nothing to send)",
                    req.method(),
                    crate::spec::yaml::clip(ct)
                ),
            );
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(listen: &str, names: &[&str]) -> Served {
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        Served::new(listen.parse().unwrap(), &names)
    }

    #[test]
    fn hosts_that_name_this_server_pass() {
        let s = served("127.0.0.1:8088", &["rm.example.org"]);
        for ok in [
            "127.0.0.1:8088",
            "127.0.0.1",
            "localhost:8088",
            "LOCALHOST",
            "app.localhost:1",
            "[::1]:8088",
            "rm.example.org:8088",
            "RM.Example.Org.",
        ] {
            assert!(s.allows_host(ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8088",
            "",
            "10.0.0.1:8088",
            "rm.example.org.evil.example",
        ] {
            assert!(!s.allows_host(bad), "{bad}");
        }
        // Listening on every interface: any IP literal (it cannot be rebound), no names.
        let any = served("0.0.0.0:8088", &[]);
        assert!(any.allows_host("10.0.0.1:8088"));
        assert!(!any.allows_host("evil.example:8088"));
        let one = served("10.0.0.5:8088", &[]);
        assert!(one.allows_host("10.0.0.5:8088") && !one.allows_host("10.0.0.6:8088"));
    }

    #[test]
    fn origins_must_name_this_server() {
        let s = served("127.0.0.1:8088", &[]);
        assert!(s.allows_origin("http://127.0.0.1:8088"));
        assert!(s.allows_origin("https://localhost"));
        assert!(!s.allows_origin("http://evil.example"));
        assert!(!s.allows_origin("null"));
        assert!(!s.allows_origin(""));
    }
}
