//! HTTP client of the RM's REST contract (DESIGN.md §3): the application API used by
//! `gpuam run`/`submit`, the AM protocol behind the application's bearer token, the
//! node listing, and the node executors' container endpoints.

use std::time::Duration;

use reqwest::StatusCode;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::cluster::rm_json::{parse_node_listing, NodeListing};
use crate::cluster::Node;
use crate::config::TlsSettings;
use crate::protocol::{
    AllocateRequest, AllocateResponse, AppReport, AppState, AppStateUpdate, ContainerStatus, ErrorBody, FinishRequest,
    FinishResponse, LaunchContext, NewApplication, RegisterRequest, RegisterResponse, SubmitApplication,
};
use crate::tls::TlsError;

/// Why a call to the RM failed.
#[derive(Debug, thiserror::Error)]
pub enum RmError {
    /// No answer (connection refused, timeout): worth retrying.
    #[error("the RM at {url} is unreachable: {why}")]
    Unreachable { url: String, why: String },
    /// The RM answered with an error.
    #[error("the RM refused {what} ({status}): {message}")]
    Refused {
        what: String,
        status: u16,
        code: String,
        message: String,
    },
    /// The RM answered something that is not what the contract says.
    #[error("unexpected answer to {what}: {why}")]
    BadAnswer { what: String, why: String },
}

impl RmError {
    pub fn is_unreachable(&self) -> bool {
        matches!(self, RmError::Unreachable { .. })
    }
    /// The process exit code a command reports for this failure (DESIGN.md §7).
    pub fn exit_code(&self) -> i32 {
        match self {
            RmError::Unreachable { .. } => crate::exit::RM_UNREACHABLE,
            RmError::Refused { status: 400, .. } => crate::exit::INVALID_INPUT,
            RmError::Refused { status: 401 | 403, .. } => crate::exit::NOT_PERMITTED,
            RmError::Refused { status: 429, .. } => crate::exit::TRY_LATER,
            RmError::Refused { status: 503, .. } => crate::exit::RM_UNREACHABLE,
            _ => crate::exit::INTERNAL,
        }
    }

    pub fn status(&self) -> Option<u16> {
        match self {
            RmError::Refused { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// A client of one RM (and of the executors it names).
#[derive(Clone)]
pub struct RmClient {
    http: reqwest::Client,
    base: String,
    /// Application id and bearer token for the AM protocol.
    app: Option<(String, String)>,
    /// A user's (or the admin) token for the application API: submit, list, status, kill.
    user_token: Option<String>,
    /// The `nodesVersion` of the last node listing read (see [`RmClient::node_changes`]).
    nodes_version: std::sync::Arc<parking_lot::Mutex<Option<String>>>,
}

/// An error with its causes: reqwest's own text omits them, and the cause (e.g. a
/// certificate the client does not trust) is what the user needs to see.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

fn trim_base(url: &str) -> String {
    url.trim_end_matches('/').to_string()
}

impl RmClient {
    /// A client without application credentials (submit, status, kill, nodes); HTTPS
    /// trusts the system's roots.
    pub fn new(base: &str) -> Self {
        match crate::tls::http_client_builder(None) {
            Ok(builder) => Self::from_builder(base, builder),
            // Cannot happen without a CA file; a client with reqwest's defaults then.
            Err(_) => Self::from_builder(base, reqwest::Client::builder()),
        }
    }

    /// A client without application credentials whose HTTPS trusts `tls.ca_file`
    /// (when set; the system's roots otherwise).
    pub fn with_tls(base: &str, tls: &TlsSettings) -> Result<Self, TlsError> {
        let builder = match base.starts_with("http://") {
            true => crate::tls::plain_http_client_builder(),
            false => crate::tls::http_client_builder(tls.ca_file.as_deref())?,
        };
        Ok(Self::from_builder(base, builder))
    }

    /// The same connection pool without this client's credentials (tokens are added per
    /// use with [`RmClient::with_user_token`]).
    pub fn without_credentials(&self) -> Self {
        RmClient {
            http: self.http.clone(),
            base: self.base.clone(),
            app: None,
            user_token: None,
            nodes_version: Default::default(),
        }
    }

    /// As [`RmClient::for_app`], trusting `tls.ca_file` as [`RmClient::with_tls`] does.
    pub fn for_app_with_tls(base: &str, app_id: &str, token: &str, tls: &TlsSettings) -> Result<Self, TlsError> {
        let mut c = RmClient::with_tls(base, tls)?;
        c.app = Some((app_id.to_string(), token.to_string()));
        Ok(c)
    }

    fn from_builder(base: &str, builder: reqwest::ClientBuilder) -> Self {
        let http = builder
            .timeout(Duration::from_secs(30))
            .connect_timeout(Duration::from_secs(5))
            .pool_max_idle_per_host(crate::am::driver::LAUNCHES_IN_FLIGHT)
            .build()
            .unwrap_or_default();
        RmClient {
            http,
            base: trim_base(base),
            app: None,
            user_token: None,
            nodes_version: Default::default(),
        }
    }

    /// This client with a user's (or the admin) token for the application API.
    pub fn with_user_token(mut self, token: Option<String>) -> Self {
        self.user_token = token.filter(|t| !t.is_empty());
        self
    }

    /// Whether a user token was given.
    pub fn has_user_token(&self) -> bool {
        self.user_token.is_some()
    }

    /// The user token, if given.
    pub fn user_token(&self) -> Option<&str> {
        self.user_token.as_deref()
    }

    /// `req` with the user token, when there is one.
    fn as_user(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.user_token {
            Some(t) => req.bearer_auth(t),
            None => req,
        }
    }

    /// The HTTP client (with this client's TLS trust), for calls outside the RM
    /// contract such as the AM's dashboard.
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// A client that speaks the AM protocol for `app_id`.
    pub fn for_app(base: &str, app_id: &str, token: &str) -> Self {
        let mut c = RmClient::new(base);
        c.app = Some((app_id.to_string(), token.to_string()));
        c
    }

    pub fn base_url(&self) -> &str {
        &self.base
    }

    async fn send<T: DeserializeOwned>(&self, what: &str, req: reqwest::RequestBuilder) -> Result<T, RmError> {
        let resp = req.send().await.map_err(|e| RmError::Unreachable {
            url: self.base.clone(),
            why: error_chain(&e),
        })?;
        let status = resp.status();
        let body = resp.bytes().await.map_err(|e| RmError::Unreachable {
            url: self.base.clone(),
            why: error_chain(&e),
        })?;
        if !status.is_success() {
            let (code, message) = match serde_json::from_slice::<ErrorBody>(&body) {
                Ok(e) => (e.code, e.message),
                Err(_) => (status.as_str().to_string(), String::from_utf8_lossy(&body).into_owned()),
            };
            return Err(RmError::Refused {
                what: what.to_string(),
                status: status.as_u16(),
                code,
                message,
            });
        }
        serde_json::from_slice(&body).map_err(|e| RmError::BadAnswer {
            what: what.to_string(),
            why: e.to_string(),
        })
    }

    fn am_post<B: Serialize>(&self, verb: &str, body: &B) -> Result<reqwest::RequestBuilder, RmError> {
        let Some((app, token)) = &self.app else {
            return Err(RmError::BadAnswer {
                what: verb.into(),
                why: "this client has no application credentials".into(),
            });
        };
        Ok(self
            .http
            .post(format!("{}/ws/v1/am/{app}/{verb}", self.base))
            .bearer_auth(token)
            .json(body))
    }

    fn app_token(&self) -> Option<&str> {
        self.app.as_ref().map(|(_, t)| t.as_str())
    }

    pub async fn new_application(&self) -> Result<NewApplication, RmError> {
        self.send(
            "new-application",
            self.as_user(
                self.http
                    .post(format!("{}/ws/v1/cluster/apps/new-application", self.base))
                    .json(&serde_json::json!({})),
            ),
        )
        .await
    }

    pub async fn submit(&self, app: &SubmitApplication) -> Result<AppReport, RmError> {
        #[derive(serde::Deserialize)]
        struct Wrapped {
            app: AppReport,
        }
        let w: Wrapped = self
            .send(
                "submit",
                self.as_user(self.http.post(format!("{}/ws/v1/cluster/apps", self.base)).json(app)),
            )
            .await?;
        Ok(w.app)
    }

    pub async fn app(&self, id: &str) -> Result<AppReport, RmError> {
        #[derive(serde::Deserialize)]
        struct Wrapped {
            app: AppReport,
        }
        let w: Wrapped = self
            .send(
                "application status",
                self.as_user(self.http.get(format!("{}/ws/v1/cluster/apps/{id}", self.base))),
            )
            .await?;
        Ok(w.app)
    }

    /// `GET {base}{path}` (path with its query) as the user, its JSON answer; for the
    /// job commands (`crate::cli::rm_api`).
    pub async fn get_json<T: DeserializeOwned>(&self, what: &str, path: &str) -> Result<T, RmError> {
        self.send(what, self.as_user(self.http.get(format!("{}{path}", self.base))))
            .await
    }

    /// `POST path` of a JSON `body` as the user, its JSON answer (`gpuam plan --rm`'s start
    /// estimate).
    pub async fn post_json<B: serde::Serialize, T: DeserializeOwned>(
        &self,
        what: &str,
        path: &str,
        body: &B,
    ) -> Result<T, RmError> {
        let req = self.http.post(format!("{}{path}", self.base)).json(body);
        self.send(what, self.as_user(req)).await
    }

    /// `DELETE path` with the user token (and the `{}` body the RM's guard wants).
    pub async fn delete_json<T: DeserializeOwned>(&self, what: &str, path: &str) -> Result<T, RmError> {
        let req = self
            .http
            .delete(format!("{}{path}", self.base))
            .json(&serde_json::json!({}));
        self.send(what, self.as_user(req)).await
    }

    /// Kills an application; `token` is the RM's admin token or the job's job token.
    pub async fn kill(&self, id: &str, token: &str) -> Result<serde_json::Value, RmError> {
        self.send(
            "kill",
            self.http
                .put(format!("{}/ws/v1/cluster/apps/{id}/state", self.base))
                .bearer_auth(token)
                .json(&AppStateUpdate {
                    state: AppState::Killed,
                }),
        )
        .await
    }

    /// The full node listing, parsed into the AM's node model.
    pub async fn nodes(&self) -> Result<Vec<Node>, RmError> {
        Ok(self.node_listing(None).await?.nodes)
    }

    /// What changed in the node listing since the last one this client read (its
    /// `nodesVersion`): only the changed nodes (`changed_since` set), or the whole listing
    /// when there was none, or when the RM cannot answer changes since that version (it
    /// restarted, or is not gpuam's).
    pub async fn node_changes(&self) -> Result<NodeListing, RmError> {
        let since = self.nodes_version.lock().clone();
        self.node_listing(since).await
    }

    async fn node_listing(&self, since: Option<String>) -> Result<NodeListing, RmError> {
        let url = format!("{}/ws/v1/cluster/nodes", self.base);
        // The compact view: each shape of node once, then each node's identity and shape
        // (rm_json::NODE_IDENTITY); a 10,000-node listing of a few kinds of machine is read
        // in a few of them, not 10,000 objects (issue 29).
        let mut params: Vec<(&str, &str)> = vec![("view", "compact")];
        params.extend(since.iter().map(|v| ("since", v.as_str())));
        let url = reqwest::Url::parse_with_params(&url, &params).map_err(|e| RmError::BadAnswer {
            what: "node listing".into(),
            why: format!("the RM's address `{url}` is not a URL: {e}"),
        })?;
        let resp = self
            .as_user(self.http.get(url))
            .send()
            .await
            .map_err(|e| RmError::Unreachable {
                url: self.base.clone(),
                why: error_chain(&e),
            })?;
        if resp.status() != StatusCode::OK {
            return Err(RmError::Refused {
                what: "node listing".into(),
                status: resp.status().as_u16(),
                code: String::new(),
                message: String::new(),
            });
        }
        let text = resp.text().await.map_err(|e| RmError::Unreachable {
            url: self.base.clone(),
            why: error_chain(&e),
        })?;
        let mut listing = parse_node_listing(&text).map_err(|e| RmError::BadAnswer {
            what: "node listing".into(),
            why: e.to_string(),
        })?;
        // Changes answer only the version they were asked for; anything else is whole.
        if listing.changed_since.is_some() && listing.changed_since != since {
            listing.changed_since = None;
            return Err(RmError::BadAnswer {
                what: "node listing".into(),
                why: "changes since a version that was not asked for".into(),
            });
        }
        *self.nodes_version.lock() = listing.version.clone();
        Ok(listing)
    }

    pub async fn register(&self, req: &RegisterRequest) -> Result<RegisterResponse, RmError> {
        self.send("register", self.am_post("register", req)?).await
    }

    pub async fn allocate(&self, req: &AllocateRequest) -> Result<AllocateResponse, RmError> {
        self.send("allocate", self.am_post("allocate", req)?).await
    }

    pub async fn finish(&self, req: &FinishRequest) -> Result<FinishResponse, RmError> {
        self.send("finish", self.am_post("finish", req)?).await
    }

    fn container_url(node_http: &str, host: &str, id: &str, verb: &str) -> String {
        format!("{}/ws/v1/node/{host}/containers/{id}/{verb}", trim_base(node_http))
    }

    pub async fn start_container(
        &self,
        node_http: &str,
        host: &str,
        id: &str,
        ctx: &LaunchContext,
    ) -> Result<ContainerStatus, RmError> {
        let mut req = self
            .http
            .post(Self::container_url(node_http, host, id, "start"))
            .json(ctx);
        if let Some(t) = self.app_token() {
            req = req.bearer_auth(t);
        }
        self.send("container start", req).await
    }

    /// Several starts in one call (`POST /ws/v1/node/containers/start` at `node_http`).
    pub async fn start_containers(
        &self,
        node_http: &str,
        starts: &crate::protocol::StartContainers,
    ) -> Result<crate::protocol::StartedContainers, RmError> {
        let mut req = self
            .http
            .post(format!("{}/ws/v1/node/containers/start", trim_base(node_http)))
            .json(starts);
        if let Some(t) = self.app_token() {
            req = req.bearer_auth(t);
        }
        self.send("container start", req).await
    }

    pub async fn container_logs(
        &self,
        node_http: &str,
        host: &str,
        id: &str,
        stream: &str,
        tail: u64,
    ) -> Result<String, RmError> {
        let mut req = self.http.get(format!(
            "{}?stream={stream}&tail={tail}",
            Self::container_url(node_http, host, id, "logs")
        ));
        if let Some(t) = self.app_token() {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.map_err(|e| RmError::Unreachable {
            url: node_http.to_string(),
            why: error_chain(&e),
        })?;
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        if status.is_success() {
            Ok(text)
        } else {
            Err(RmError::Refused {
                what: "container logs".into(),
                status: status.as_u16(),
                code: String::new(),
                message: text,
            })
        }
    }
}
