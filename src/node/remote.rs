//! Node agents on other machines (`gpuam node`), reached over HTTP: the RM side of
//! [`super::wire`], as a [`NodeBackend`].
//!
//! Holds the registry of agents (host → base URL, last heartbeat, containers reported
//! running) and their credentials (the nodes file: each host's token digest, from which
//! its keys derive, `super::token`). An agent's token names its host ([`AgentNodes::host_of`]);
//! each call to an agent is signed for itself with that host's key and the agent run's
//! instance ([`super::token::sign_call`]; a retry is a new call, signed anew); `start` also
//! carries the container token signed with that host's key for exactly the grant. Deaths reach the RM in the
//! agents' heartbeats and registrations, which the RM takes in their own transaction
//! (`rm::server::nodes`; repeats are harmless: the ledger frees once); this registry keeps
//! what each agent runs ([`AgentNodes::heartbeat`]).

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::FutureExt as _;
use parking_lot::Mutex;

use super::wire::{AgentStart, ContainerReport, CONTAINER_TOKEN_HEADER};
use super::{answer, token, Grant, LogStream, NodeBackend, NodeError};
use crate::protocol::{ContainerState, ContainerStatus, LaunchContext};

/// Most bytes of a container log the RM takes from an agent in one answer.
const MAX_LOG_ANSWER: u64 = 8 << 20;

/// One registered agent.
#[derive(Clone, Debug)]
pub struct AgentEntry {
    pub address: String,
    pub last_heard: Instant,
    /// Declared LOST: its heartbeats are answered "register again".
    pub lost: bool,
    pub running: BTreeSet<String>,
    /// Restored by a restarted RM and not registered since: LOST when this passes.
    pub awaiting_until: Option<Instant>,
    /// The agent run's instance id from its registration (its calls' MACs name it).
    pub instance: String,
}

/// The agents registered with this RM.
pub struct AgentNodes {
    /// Each host's agent token digest (the nodes file).
    credentials: parking_lot::RwLock<crate::users::Users>,
    /// The RM's own secret the host keys derive from (`super::token::host_key`).
    rm_secret: Vec<u8>,
    http: reqwest::Client,
    agents: Mutex<HashMap<String, AgentEntry>>,
}

impl AgentNodes {
    /// `credentials`: the hosts and their agents' token digests (the nodes file);
    /// `rm_secret`: what their keys derive from ([`load_or_create_secret`]);
    /// `ca_file` (`tls.ca_file`): the CAs HTTPS to the agents trusts (else the system's).
    pub fn new(
        credentials: crate::users::Users,
        rm_secret: Vec<u8>,
        ca_file: Option<&std::path::Path>,
    ) -> anyhow::Result<Self> {
        let http = crate::tls::http_client_builder(ca_file)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .timeout(Duration::from_secs(70))
            .build()
            .map_err(|e| anyhow::anyhow!("cannot build an HTTP client: {e}"))?;
        Ok(AgentNodes {
            credentials: parking_lot::RwLock::new(credentials),
            rm_secret,
            http,
            agents: Mutex::new(HashMap::new()),
        })
    }

    /// The host whose agent token this is (`None`: no host's, or revoked).
    pub fn host_of(&self, token: &str) -> Option<String> {
        let token = token.trim();
        if token.is_empty() {
            return None;
        }
        self.credentials.read().user_of(token).map(str::to_string)
    }

    /// Takes a new nodes file (reloaded): a host no longer in it is refused from now on.
    pub fn set_credentials(&self, credentials: crate::users::Users) {
        *self.credentials.write() = credentials;
    }

    /// `host`'s key (see `super::token`); an error for a host without a credential.
    fn key(&self, host: &str) -> Result<[u8; 32], NodeError> {
        self.credentials
            .read()
            .digest_of(host)
            .map(|digest| token::host_key(&self.rm_secret, host, &digest))
            .ok_or_else(|| NodeError::Refused(format!("host `{host}` has no agent credential (revoked?)")))
    }

    /// `host`'s key in hex, for the answer to its agent's registration.
    pub fn host_key_hex(&self, host: &str) -> Option<String> {
        self.key(host).ok().map(|k| crate::auth::hex(&k))
    }

    /// A fingerprint of `host`'s current credential (a hash of its digest, which reveals
    /// neither the token nor the digest), so that a removal can refuse exactly the
    /// credential the host had; `None` when the host has none.
    pub fn fingerprint(&self, host: &str) -> Option<String> {
        let digest = self.credentials.read().digest_of(host)?;
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        ctx.update(b"gpuam-agent-credential-fingerprint-v1\n");
        ctx.update(&digest);
        Some(crate::auth::hex(ctx.finish().as_ref()))
    }

    /// Forgets a removed host's agent: its heartbeats are answered "register again"
    /// (which the RM refuses while the removal holds).
    pub fn forget(&self, host: &str) {
        self.agents.lock().remove(host);
    }

    /// Whether `host` is a registered agent (LOST or not).
    pub fn knows(&self, host: &str) -> bool {
        self.agents.lock().contains_key(host)
    }

    /// Whether `host` is registered and not LOST.
    pub fn is_live(&self, host: &str) -> bool {
        self.agents
            .lock()
            .get(host)
            .is_some_and(|a| !a.lost && a.awaiting_until.is_none())
    }

    /// Records a (re-)registration of the agent run `instance`.
    pub fn register(&self, host: &str, address: &str, instance: &str, now: Instant) {
        self.agents.lock().insert(
            host.to_string(),
            AgentEntry {
                address: address.trim_end_matches('/').to_string(),
                last_heard: now,
                lost: false,
                running: BTreeSet::new(),
                awaiting_until: None,
                instance: instance.to_string(),
            },
        );
    }

    /// A host a restarted RM knows from its stored state: its agent has until `deadline`
    /// to register again (its heartbeats are answered "register again"; calls to it fail
    /// as unreachable meanwhile).
    pub fn expect(&self, host: &str, deadline: Instant) {
        self.agents.lock().entry(host.to_string()).or_insert(AgentEntry {
            address: String::new(),
            last_heard: Instant::now(),
            lost: false,
            running: BTreeSet::new(),
            awaiting_until: Some(deadline),
            instance: String::new(),
        });
    }

    /// Records a heartbeat: the agent heard now, and the containers it runs (its running
    /// reports; the RM takes its deaths in the heartbeat's own transaction, stored before
    /// they are acknowledged). False when `host` must register (unknown or LOST).
    pub fn heartbeat(&self, host: &str, reports: &[ContainerReport], now: Instant) -> bool {
        let mut agents = self.agents.lock();
        let Some(a) = agents.get_mut(host).filter(|a| !a.lost && a.awaiting_until.is_none()) else {
            return false;
        };
        a.last_heard = now;
        a.running = reports
            .iter()
            .filter(|r| r.state != ContainerState::Complete)
            .map(|r| r.container_id.clone())
            .collect();
        true
    }

    /// Hosts silent for longer than `expiry` (or, restored after an RM restart, not
    /// registered by their deadline) and not yet LOST: now marked LOST.
    pub fn expire(&self, now: Instant, expiry: Duration) -> Vec<String> {
        let mut agents = self.agents.lock();
        let mut lost: Vec<String> = agents
            .iter_mut()
            .filter(|(_, a)| {
                !a.lost
                    && match a.awaiting_until {
                        Some(deadline) => now > deadline,
                        None => now.saturating_duration_since(a.last_heard) > expiry,
                    }
            })
            .map(|(h, a)| {
                a.lost = true;
                h.clone()
            })
            .collect();
        lost.sort();
        lost
    }

    fn address(&self, host: &str) -> Result<String, NodeError> {
        self.live(host).map(|(address, _)| address)
    }

    /// A live agent's address and instance.
    fn live(&self, host: &str) -> Result<(String, String), NodeError> {
        self.agents
            .lock()
            .get(host)
            .filter(|a| !a.lost && a.awaiting_until.is_none())
            .map(|a| (a.address.clone(), a.instance.clone()))
            .ok_or_else(|| NodeError::Unreachable {
                host: host.to_string(),
                why: "no live agent is registered for this host (after an RM restart: not yet again)".into(),
            })
    }

    /// `req` built and signed for `host`'s current agent run ([`sign_request`]).
    fn signed(&self, host: &str, req: reqwest::RequestBuilder) -> Result<reqwest::Request, NodeError> {
        let mut req = req
            .build()
            .map_err(|e| NodeError::Refused(format!("cannot build the call to `{host}`: {e}")))?;
        let (_, instance) = self.live(host)?;
        sign_request(&self.key(host)?, &instance, &mut req)
            .map_err(|e| NodeError::Refused(format!("cannot sign the call to `{host}`: {e}")))?;
        Ok(req)
    }

    fn url(&self, host: &str, id: &str, verb: &str) -> Result<String, NodeError> {
        Ok(format!(
            "{}/ws/v1/node/{host}/containers/{id}/{verb}",
            self.address(host)?
        ))
    }

    /// Sends `req` to `host`'s agent, signed now for exactly this request (a fresh nonce
    /// each time: a retry is signed anew).
    async fn call(&self, host: &str, req: reqwest::RequestBuilder) -> Result<reqwest::Response, NodeError> {
        let req = self.signed(host, req)?;
        let resp = self.http.execute(req).await.map_err(|e| NodeError::Unreachable {
            host: host.to_string(),
            why: e.to_string(),
        })?;
        if resp.status() == reqwest::StatusCode::NOT_FOUND {
            return Err(NodeError::UnknownContainer(answer::error_text(resp).await));
        }
        if !resp.status().is_success() {
            let status = resp.status();
            let text = answer::error_text(resp).await;
            return Err(NodeError::Refused(format!("{status}: {text}")));
        }
        Ok(resp)
    }
}

impl NodeBackend for AgentNodes {
    fn kind(&self) -> &'static str {
        "agent"
    }

    /// The start request may have reached the agent before the connection broke; the
    /// agent's next heartbeat (or registration) tells whether it runs.
    fn start_may_survive(&self, error: &NodeError) -> bool {
        matches!(error, NodeError::Unreachable { .. })
    }

    fn start(&self, grant: Grant, ctx: LaunchContext) -> BoxFuture<'_, Result<ContainerStatus, NodeError>> {
        async move {
            let url = self.url(&grant.host, &grant.container_id, "start")?;
            let token = token::sign(&self.key(&grant.host)?, &grant);
            let host = grant.host.clone();
            let body = AgentStart {
                grant,
                launch_context: ctx,
            };
            let req = self.http.post(url).header(CONTAINER_TOKEN_HEADER, token).json(&body);
            let resp = self.call(&host, req).await?;
            // The agent said yes: an answer that does not arrive whole (the agent died
            // while sending it) or does not read means the task may run all the same.
            answer::json_within::<ContainerStatus>(resp, answer::STATUS_MAX)
                .await
                .map_err(|e| NodeError::Unreachable {
                    host,
                    why: format!("the start's answer did not arrive whole: {e}"),
                })
        }
        .boxed()
    }

    fn stop<'a>(
        &'a self,
        host: &'a str,
        container_id: &'a str,
        grace: Duration,
    ) -> BoxFuture<'a, Result<(), NodeError>> {
        async move {
            let url = self.url(host, container_id, "stop")?;
            let req = self.http.post(format!("{url}?graceMs={}", grace.as_millis()));
            self.call(host, req).await.map(|_| ())
        }
        .boxed()
    }

    fn status<'a>(&'a self, host: &'a str, container_id: &'a str) -> BoxFuture<'a, Option<ContainerStatus>> {
        async move {
            let url = self.url(host, container_id, "status").ok()?;
            let resp = self.call(host, self.http.get(url)).await.ok()?;
            answer::json_within::<ContainerStatus>(resp, answer::STATUS_MAX)
                .await
                .ok()
        }
        .boxed()
    }

    fn read_log<'a>(
        &'a self,
        host: &'a str,
        container_id: &'a str,
        stream: LogStream,
        tail: Option<u64>,
    ) -> BoxFuture<'a, Result<String, NodeError>> {
        async move {
            let mut url = format!(
                "{}?stream={}",
                self.url(host, container_id, "logs")?,
                stream.file_name()
            );
            if let Some(t) = tail {
                url.push_str(&format!("&tail={t}"));
            }
            let mut resp = self.call(host, self.http.get(url)).await?;
            // An agent's answer is read up to the tail asked for (or MAX_LOG_ANSWER), keeping
            // its newest bytes: an agent that sends more cannot fill the RM's memory.
            let limit = usize::try_from(tail.unwrap_or(MAX_LOG_ANSWER).min(MAX_LOG_ANSWER)).unwrap_or(usize::MAX);
            let mut body: Vec<u8> = Vec::new();
            while let Some(chunk) = resp.chunk().await.map_err(|e| NodeError::Refused(e.to_string()))? {
                body.extend_from_slice(&chunk);
                if body.len() > limit {
                    body.drain(..body.len() - limit);
                }
            }
            Ok(String::from_utf8_lossy(&body).into_owned())
        }
        .boxed()
    }

    /// Agents re-attach by themselves and report in their registration.
    fn reattach(&self, _host: &str, _container_id: &str) {}

    fn running(&self, host: &str) -> Vec<String> {
        self.agents
            .lock()
            .get(host)
            .map(|a| a.running.iter().cloned().collect())
            .unwrap_or_default()
    }

    fn forget(&self, _container_id: &str) {}

    fn notify_preemption<'a>(
        &'a self,
        host: &'a str,
        container_id: &'a str,
        deadline_ms: u64,
        reason: &'a str,
    ) -> BoxFuture<'a, Result<(), NodeError>> {
        async move {
            let url = self.url(host, container_id, "preempt")?;
            let body = super::wire::AgentPreempt {
                deadline_ms,
                reason: reason.to_string(),
            };
            let req = self.http.post(url).json(&body);
            self.call(host, req).await.map(|_| ())
        }
        .boxed()
    }
}

/// Signs `req` (built, body in memory) now, with a fresh nonce, as a call to the agent
/// run `instance` under `host_key`: its [`token::CALL_HEADER`] ([`token::sign_call`]).
pub fn sign_request(host_key: &[u8], instance: &str, req: &mut reqwest::Request) -> Result<(), String> {
    let url = req.url();
    let target = match url.query() {
        Some(q) => format!("{}?{q}", url.path()),
        None => url.path().to_string(),
    };
    let body = match req.body() {
        None => &[][..],
        Some(b) => b.as_bytes().ok_or("the call's body is a stream")?,
    };
    let call = token::Call {
        method: req.method().as_str(),
        path_and_query: &target,
        instance,
        body,
    };
    let signature = token::sign_call(host_key, &call, crate::protocol::now_ms(), &token::new_nonce());
    let value = reqwest::header::HeaderValue::from_str(&signature).map_err(|e| e.to_string())?;
    req.headers_mut().insert(token::CALL_HEADER, value);
    Ok(())
}

/// The file of the RM's host-key secret, in its state directory.
pub const HOST_KEYS_SECRET_FILE: &str = "host-keys.secret";

/// The RM's host-key secret from `path` (its text, as written), made (32 random bytes in
/// hex, mode 0600) when the file does not exist yet, so that keys stay the same across
/// restarts. An empty or unreadable file is an error naming it.
pub fn load_or_create_secret(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    match std::fs::read_to_string(path) {
        Ok(text) if !text.trim().is_empty() => Ok(text.trim().as_bytes().to_vec()),
        Ok(_) => anyhow::bail!(
            "{} is empty: it holds the secret the node agents' keys derive from (remove it to make a new one; every \
             agent then gets its new key when it registers again)",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let secret = crate::auth::new_token();
            crate::auth::write_secret(path, &secret)
                .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
            Ok(secret.into_bytes())
        }
        Err(e) => anyhow::bail!("cannot read {}: {e}", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An agent that dies after its "200" for a start and before the body: the task may
    /// run, so the start's error is one after which it may survive (the RM then keeps its
    /// resources held until the node reports it dead), not a refusal (which frees them).
    #[tokio::test]
    async fn a_start_answer_cut_off_after_its_status_may_have_started_the_task() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 1 << 16];
            let _ = s.read(&mut buf).await;
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"conta")
                .await;
            // Dropped: the body never completes.
        });
        let mut credentials = crate::users::Users::default();
        credentials.insert_token("h1", "agent-token").unwrap();
        let agents = AgentNodes::new(credentials, b"s".to_vec(), None).unwrap();
        agents.register("h1", &format!("http://{addr}"), "run-1", Instant::now());
        let grant = Grant {
            container_id: "container_1_0001_01_000001".into(),
            app_id: "application_1_0001".into(),
            host: "h1".into(),
            resources: Default::default(),
            user: "alice".into(),
            topology: None,
        };
        let ctx = LaunchContext {
            commands: vec!["true".into()],
            env: Default::default(),
        };
        let e = agents.start(grant, ctx).await.unwrap_err();
        assert!(agents.start_may_survive(&e), "{e}");
    }

    #[test]
    fn a_host_restored_after_a_restart_waits_for_its_agent_until_the_deadline() {
        let agents = AgentNodes::new(Default::default(), b"s".to_vec(), None).unwrap();
        let t0 = Instant::now();
        agents.expect("h", t0 + Duration::from_secs(30));
        assert!(agents.knows("h") && !agents.is_live("h"));
        assert!(!agents.heartbeat("h", &[], t0), "a heartbeat is told to register");
        assert!(
            agents
                .expire(t0 + Duration::from_secs(20), Duration::from_secs(3))
                .is_empty(),
            "not LOST within the grace, however long beyond the expiry"
        );
        assert!(agents.address("h").is_err(), "no address before it registers");
        assert_eq!(
            agents.expire(t0 + Duration::from_secs(31), Duration::from_secs(3)),
            vec!["h".to_string()],
            "LOST once the grace ended"
        );
        // One that registers in time is an ordinary live agent.
        agents.expect("g", t0 + Duration::from_secs(30));
        agents.register("g", "http://10.0.0.2:8042/", "run-1", t0 + Duration::from_secs(1));
        assert!(agents.is_live("g"));
        assert!(agents.heartbeat("g", &[], t0 + Duration::from_secs(2)));
        assert!(agents
            .expire(t0 + Duration::from_secs(4), Duration::from_secs(3))
            .is_empty());
        assert_eq!(agents.address("g").unwrap(), "http://10.0.0.2:8042");
        // `expect` never demotes a registered agent.
        agents.expect("g", t0);
        assert!(agents.is_live("g"));
    }
}
