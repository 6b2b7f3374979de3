//! TLS for every listener and client (DESIGN.md §9): loading the server's certificate
//! chain and key, building clients that trust an extra CA, and [`serve`], the one
//! function every gpuam listener (RM, AM dashboard, node agent, Ray gate) serves HTTP or
//! HTTPS with, and so the one place of its read timeouts and connection caps
//! ([`HttpTimeouts`]): a connection that does not finish its TLS handshake or deliver a
//! request's headers in time (a silent client, a half-sent request, an idle keep-alive
//! connection) is closed, and so is a request whose body does not arrive in time; a
//! connection past a cap is closed as soon as it is accepted.
//!
//! Everything uses rustls with the ring provider (no aws-lc: its C build is slow). Server
//! and CA-trusting configs name the provider explicitly. reqwest is built with
//! `rustls-no-provider`, which panics on `Client::new()` unless a process-wide provider
//! is installed: every HTTP client is therefore made by [`http_client_builder`] (or
//! [`http_client`]), the one place that installs it.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::config::TlsSettings;

/// Why a certificate, key or CA file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {}: {source}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no certificate found in {} (expected PEM `-----BEGIN CERTIFICATE-----` blocks)", .0.display())]
    NoCertificate(PathBuf),
    #[error("{}: not a PEM private key (expected a `-----BEGIN PRIVATE KEY-----`, `RSA PRIVATE KEY` or `EC PRIVATE KEY` block)", .0.display())]
    NotAKey(PathBuf),
    #[error("{}: bad PEM: {why}", path.display())]
    BadPem { path: PathBuf, why: String },
    #[error("{}: {why}", path.display())]
    Unusable { path: PathBuf, why: String },
}

/// The ring provider every config here is built with.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Makes ring the process-wide rustls provider, unless one is installed already.
fn install_default_provider() {
    if CryptoProvider::get_default().is_none() {
        // Losing a race to another thread installing one is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn bad_pem(path: &Path, e: rustls::pki_types::pem::Error) -> TlsError {
    TlsError::BadPem {
        path: path.to_path_buf(),
        why: e.to_string(),
    }
}

/// The certificates of a PEM file (at least one).
pub fn load_certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad_pem(path, e))?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(path.to_path_buf()));
    }
    Ok(certs)
}

/// The first private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read("key file", path)?;
    match PrivateKeyDer::from_pem_slice(&pem) {
        Ok(k) => Ok(k),
        Err(rustls::pki_types::pem::Error::NoItemsFound) => Err(TlsError::NotAKey(path.to_path_buf())),
        Err(e) => Err(bad_pem(path, e)),
    }
}

/// A server config from a PEM certificate chain (leaf first) and its PEM private key.
pub fn server_config(cert_file: &Path, key_file: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let certs = load_certs("certificate file", cert_file)?;
    let key = load_key(key_file)?;
    let unusable = |why: String| TlsError::Unusable {
        path: key_file.to_path_buf(),
        why,
    };
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| unusable(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| {
            unusable(format!(
                "cannot be used with the certificate in {}: {e}",
                cert_file.display()
            ))
        })?;
    Ok(Arc::new(config))
}

/// The server config the settings ask for: `None` (plain HTTP) unless both
/// `tls.cert_file` and `tls.key_file` are set.
pub fn server_config_from_settings(tls: &TlsSettings) -> Result<Option<Arc<rustls::ServerConfig>>, TlsError> {
    match (&tls.cert_file, &tls.key_file) {
        (Some(c), Some(k)) => server_config(c, k).map(Some),
        // Settings validation refuses one without the other.
        _ => Ok(None),
    }
}

/// A client config trusting exactly the CA certificates in `ca_file` (PEM).
pub fn client_config(ca_file: &Path) -> Result<rustls::ClientConfig, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in load_certs("CA file", ca_file)? {
        roots.add(cert).map_err(|e| TlsError::Unusable {
            path: ca_file.to_path_buf(),
            why: format!("not a usable CA certificate: {e}"),
        })?;
    }
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Unusable {
            path: ca_file.to_path_buf(),
            why: e.to_string(),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(config)
}

/// A reqwest client builder for gpuam's servers: with `ca_file`, HTTPS trusts only
/// the CAs in it; without, the operating system's roots. Plain `http://` works either way.
pub fn http_client_builder(ca_file: Option<&Path>) -> Result<reqwest::ClientBuilder, TlsError> {
    install_default_provider();
    let builder = reqwest::Client::builder();
    Ok(match ca_file {
        Some(ca) => builder.tls_backend_preconfigured(client_config(ca)?),
        None => builder,
    })
}

/// A reqwest client builder for a server reached over plain `http://` only: no root
/// store is loaded (loading the system's roots costs an AM more CPU than its
/// registration; issue 29), so an `https://` URL fails with this client.
pub fn plain_http_client_builder() -> reqwest::ClientBuilder {
    install_default_provider();
    reqwest::Client::builder().tls_certs_only(Vec::<reqwest::Certificate>::new())
}

/// A client with no extra CA (plain HTTP, or HTTPS trusting the system's roots).
pub fn http_client() -> reqwest::Client {
    http_client_builder(None)
        .ok()
        .and_then(|b| b.build().ok())
        .unwrap_or_default()
}

/// `https` with TLS, else `http`.
pub fn scheme(tls: bool) -> &'static str {
    if tls {
        "https"
    } else {
        "http"
    }
}

/// Read timeouts and connection caps of every listener (settings `http.*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpTimeouts {
    /// A connection must deliver a request's headers within this time, counted from
    /// when it is ready for one (so an idle keep-alive connection is closed after it
    /// too); then the body must arrive within the same time again.
    pub read: Duration,
    /// Open connections of the general pool in all (`http.max_connections`).
    pub max_connections: usize,
    /// Open connections of the general pool from one source (`http.max_connections_per_peer`;
    /// a source is an IPv4 address, an IPv6 /64, or all of loopback: [`Source`]).
    pub max_connections_per_peer: usize,
    /// Open connections of the reserved pool in all (`http.max_reserved_connections`).
    pub max_reserved_connections: usize,
    /// Open connections of the reserved pool from one reserved peer
    /// (`http.max_reserved_connections_per_peer`).
    pub max_reserved_connections_per_peer: usize,
}

impl From<&crate::config::HttpSettings> for HttpTimeouts {
    fn from(s: &crate::config::HttpSettings) -> Self {
        HttpTimeouts {
            read: Duration::from_secs(s.read_timeout_sec.max(1)),
            max_connections: s.max_connections.max(1),
            max_connections_per_peer: s.max_connections_per_peer.max(1),
            max_reserved_connections: s.max_reserved_connections,
            max_reserved_connections_per_peer: s.max_reserved_connections_per_peer,
        }
    }
}

/// Where a connection comes from, for the general pool's per-source cap: one address
/// alone gives a peer little, since a peer with more addresses would multiply its cap.
/// All of loopback (127.0.0.0/8, `::1`, their IPv4-mapped forms) is one source per local
/// user (any local user can bind any 127.x.y.z, but not another's uid: twelfth pass, a
/// tenant's task beside the RM held every loopback place); an IPv6 peer is its /64 (what
/// one host or one customer gets); an IPv4 peer is its address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// 127.0.0.0/8 and `::1`, from the local user who owns the peer's socket (`None`:
    /// the kernel did not say).
    Loopback(Option<u32>),
    /// One IPv4 address.
    V4(std::net::Ipv4Addr),
    /// The upper 64 bits of an IPv6 address.
    V6Net(u64),
}

/// `ip` with an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`) as the IPv4 address it is.
pub fn canonical(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map_or(std::net::IpAddr::V6(v6), std::net::IpAddr::V4),
        v4 => v4,
    }
}

/// A connection's peer: its address and, on loopback, the local user who owns its socket
/// ([`crate::local_peer::uid_of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    pub ip: std::net::IpAddr,
    /// Only for a loopback peer; ignored for any other.
    pub local_uid: Option<u32>,
}

impl Peer {
    /// A peer known by its address alone.
    pub fn at(ip: std::net::IpAddr) -> Peer {
        Peer { ip, local_uid: None }
    }

    /// The peer of a connection accepted at `local` from `remote`: on loopback, with the
    /// uid owning the remote end (one netlink round trip).
    pub fn of_connection(remote: std::net::SocketAddr, local: Option<std::net::SocketAddr>) -> Peer {
        let local_uid = local
            .filter(|_| canonical(remote.ip()).is_loopback())
            .and_then(|l| crate::local_peer::uid_of(remote, l));
        Peer {
            ip: remote.ip(),
            local_uid,
        }
    }

    /// The key of its reserved places: its address, and on loopback its user.
    fn key(&self) -> (std::net::IpAddr, Option<u32>) {
        let ip = canonical(self.ip);
        (ip, self.local_uid.filter(|_| ip.is_loopback()))
    }
}

impl Source {
    /// The source of a connection from `ip` (on loopback, of no known user).
    pub fn of(ip: std::net::IpAddr) -> Source {
        Source::of_peer(Peer::at(ip))
    }

    /// The source of a connection from `peer`: on loopback, its user's.
    pub fn of_peer(peer: Peer) -> Source {
        match peer.key() {
            (ip, uid) if ip.is_loopback() => Source::Loopback(uid),
            (std::net::IpAddr::V4(v4), _) => Source::V4(v4),
            (std::net::IpAddr::V6(v6), _) => Source::V6Net((u128::from(v6) >> 64) as u64),
        }
    }
}

/// Addresses whose connections may take the reserved pool: this host's own
/// ([`ReservedPeers::this_host`]; an RM's address too when it is an IP) and, at an RM,
/// the live node agents' (each agent's host where the RM last saw its authenticated
/// registration or heartbeat come from: [`ReservedPeers::set`]). Shared between the
/// accept loop and the RM's handlers.
#[derive(Clone, Debug, Default)]
pub struct ReservedPeers(Arc<parking_lot::RwLock<ReservedSet>>);

/// Reserved places per node agent at an address (an agent holds one or two connections
/// to its RM): a task on the agent's host, which shares its address, holds at most these
/// of the reserved pool (audit 6 F1: with the whole per-peer share, tasks on four hosts
/// filled the pool and kept every other agent out).
pub const RESERVED_PLACES_PER_AGENT: usize = 8;

/// The set behind [`ReservedPeers`].
#[derive(Debug, Default)]
pub struct ReservedSet {
    by_owner: std::collections::HashMap<String, std::net::IpAddr>,
    count: std::collections::HashMap<std::net::IpAddr, usize>,
    /// Addresses with the whole per-peer share (`http.max_reserved_connections_per_peer`):
    /// this host's own (its AMs and CLI) and, at an agent, its RM's. Others (node agents at
    /// an RM) get [`RESERVED_PLACES_PER_AGENT`] per agent there.
    wide: std::collections::HashSet<std::net::IpAddr>,
}

impl ReservedSet {
    /// Whether `ip` is a reserved peer's address.
    pub fn contains(&self, ip: std::net::IpAddr) -> bool {
        self.count.contains_key(&canonical(ip))
    }

    /// How many reserved places `ip` may hold, under the per-peer cap `per_peer`.
    pub fn places(&self, ip: std::net::IpAddr, per_peer: usize) -> usize {
        let ip = canonical(ip);
        if self.wide.contains(&ip) {
            return per_peer;
        }
        let agents = self.count.get(&ip).copied().unwrap_or(0);
        per_peer.min(agents.saturating_mul(RESERVED_PLACES_PER_AGENT))
    }

    /// As [`ReservedSet::set`], with the whole per-peer share for `ip` (see `wide`).
    pub fn set_wide(&mut self, owner: &str, ip: std::net::IpAddr) {
        self.set(owner, ip);
        self.wide.insert(canonical(ip));
    }

    /// `owner` (an agent's host) is now at `ip` (replacing where it was).
    pub fn set(&mut self, owner: &str, ip: std::net::IpAddr) {
        let ip = canonical(ip);
        if self.by_owner.get(owner) == Some(&ip) {
            return;
        }
        self.remove(owner);
        self.by_owner.insert(owner.to_string(), ip);
        *self.count.entry(ip).or_default() += 1;
    }

    /// `owner` is no longer reserved (LOST, removed).
    pub fn remove(&mut self, owner: &str) {
        if let Some(ip) = self.by_owner.remove(owner) {
            if let Some(n) = self.count.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    self.count.remove(&ip);
                }
            }
        }
    }
}

impl ReservedPeers {
    /// This host's own canonical loopback addresses (127.0.0.1, `::1`) reserved: where
    /// the local clients of a listener come from (the AMs an RM starts, the CLI on its
    /// host, an RM calling an agent on its host). Other loopback addresses (127.0.0.2…)
    /// are not reserved: any local user can bind them.
    pub fn this_host() -> ReservedPeers {
        let r = ReservedPeers::default();
        r.set_wide("this host (127.0.0.1)", std::net::Ipv4Addr::LOCALHOST.into());
        r.set_wide("this host (::1)", std::net::Ipv6Addr::LOCALHOST.into());
        r
    }

    /// See [`ReservedSet::set_wide`].
    pub fn set_wide(&self, owner: &str, ip: std::net::IpAddr) {
        self.0.write().set_wide(owner, ip);
    }

    /// See [`ReservedSet::set`].
    pub fn set(&self, owner: &str, ip: std::net::IpAddr) {
        let known = self.0.read().by_owner.get(owner) == Some(&canonical(ip));
        if !known {
            self.0.write().set(owner, ip);
        }
    }

    /// See [`ReservedSet::remove`].
    pub fn remove(&self, owner: &str) {
        self.0.write().remove(owner);
    }

    /// See [`ReservedSet::contains`].
    pub fn contains(&self, ip: std::net::IpAddr) -> bool {
        self.0.read().contains(ip)
    }
}

/// Which pool an admitted connection is counted in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pool {
    /// Everyone's, under the per-source cap.
    General(Source),
    /// A reserved peer's own places (its exact address; on loopback, per local user), which
    /// no other source can take.
    Reserved(std::net::IpAddr, Option<u32>),
}

/// What the accept loop does with a new connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Served, counted in this pool.
    Accept(Pool),
    /// Closed at once, for this reason (the setting that was reached).
    Refuse(&'static str),
}

/// The open connections of one listener, per pool: the counts [`decide`] reads.
#[derive(Debug, Default)]
pub struct OpenConnections {
    total: usize,
    per_source: std::collections::HashMap<Source, usize>,
    reserved_total: usize,
    per_reserved: std::collections::HashMap<(std::net::IpAddr, Option<u32>), usize>,
}

/// Whether a connection from `peer` is admitted, and into which pool: a pure function of
/// the peer, the open connections, the reserved peers and the caps.
///
/// A reserved peer's connection (its exact address, IPv4-mapped as IPv4; on loopback, each
/// local user apart) takes its reserved place while it has one, else a general place like
/// anyone's. Any other takes a general place under the total and its source's cap
/// ([`Source`]: loopback is one source per local user, IPv6 one per /64), so a flood from
/// any number of loopback addresses holds one user's share, and one from elsewhere never
/// reaches the agents' reserved places.
pub fn decide(peer: Peer, open: &OpenConnections, reserved: &ReservedSet, caps: &HttpTimeouts) -> Admission {
    let (ip, uid) = peer.key();
    if reserved.contains(ip)
        && open.reserved_total < caps.max_reserved_connections
        && open.per_reserved.get(&(ip, uid)).copied().unwrap_or(0)
            < reserved.places(ip, caps.max_reserved_connections_per_peer)
    {
        return Admission::Accept(Pool::Reserved(ip, uid));
    }
    let source = Source::of_peer(peer);
    if open.total >= caps.max_connections {
        return Admission::Refuse("http.max_connections");
    }
    if open.per_source.get(&source).copied().unwrap_or(0) >= caps.max_connections_per_peer {
        return Admission::Refuse("http.max_connections_per_peer");
    }
    Admission::Accept(Pool::General(source))
}

impl OpenConnections {
    /// Counts an admitted connection in its pool.
    fn count_in(&mut self, pool: Pool) {
        match pool {
            Pool::General(s) => {
                self.total += 1;
                *self.per_source.entry(s).or_default() += 1;
            }
            Pool::Reserved(ip, uid) => {
                self.reserved_total += 1;
                *self.per_reserved.entry((ip, uid)).or_default() += 1;
            }
        }
    }

    /// Counts an admitted connection out of its pool.
    fn release(&mut self, pool: Pool) {
        fn down<K: std::hash::Hash + Eq>(m: &mut std::collections::HashMap<K, usize>, k: &K) {
            if let Some(n) = m.get_mut(k) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    m.remove(k);
                }
            }
        }
        match pool {
            Pool::General(s) => {
                self.total = self.total.saturating_sub(1);
                down(&mut self.per_source, &s);
            }
            Pool::Reserved(ip, uid) => {
                self.reserved_total = self.reserved_total.saturating_sub(1);
                down(&mut self.per_reserved, &(ip, uid));
            }
        }
    }
}

/// Releases its connection's place when the connection ends.
struct Admitted {
    open: Arc<parking_lot::Mutex<OpenConnections>>,
    pool: Pool,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.open.lock().release(self.pool);
    }
}

/// The TCP peer of a request, in its extensions (put there by the accept loop).
#[derive(Clone, Copy, Debug)]
pub struct PeerAddr(pub SocketAddr);

impl Default for HttpTimeouts {
    fn default() -> Self {
        (&crate::config::HttpSettings::default()).into()
    }
}

/// Serves `app` on `listener` until `shutdown` completes (then lets open requests
/// finish): plain HTTP when `tls` is `None`, HTTPS otherwise; with the default
/// [`HttpTimeouts`].
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, app, tls, HttpTimeouts::default(), shutdown).await
}

/// As [`serve`], with these timeouts.
pub async fn serve_with(
    listener: TcpListener,
    app: axum::Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    timeouts: HttpTimeouts,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_reserving(listener, app, tls, timeouts, ReservedPeers::this_host(), shutdown).await
}

/// As [`serve_with`], with a reserved pool for the connections of `reserved` peers (the
/// RM's node agents).
pub async fn serve_reserving(
    listener: TcpListener,
    app: axum::Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    timeouts: HttpTimeouts,
    reserved: ReservedPeers,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_on(listener, app, tls.map(TlsAcceptor::from), timeouts, reserved, shutdown).await
}

/// What serves one admitted connection's requests.
type Service = hyper_util::service::TowerToHyperService<tower_http::timeout::RequestBodyTimeout<axum::Router>>;

/// The accept loop (axum's `serve`, which has no read timeouts, done with hyper's HTTP/1
/// server and its header-read timer, plus a body timeout on every request).
///
/// Every connection is admitted (or closed at once) when its TCP connection is accepted,
/// by [`decide`] (the reserved pool of `reserved` peers; else the general pool under
/// `http.max_connections` and `http.max_connections_per_peer` per source), before
/// anything is read from it: under TLS its handshake runs in its own task holding its place, so a
/// peer that opens connections and never sends a ClientHello holds at most its own cap,
/// each for at most `http.read_timeout_sec` (the handshake's timeout, as for a request's
/// headers), and never the places of others.
async fn serve_on(
    mut listener: TcpListener,
    app: axum::Router,
    tls: Option<TlsAcceptor>,
    timeouts: HttpTimeouts,
    reserved: ReservedPeers,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let service = tower_http::timeout::RequestBodyTimeout::new(app, timeouts.read);
    // Dropped when serving stops: connections start their graceful shutdown then (and
    // handshakes stop); each holds `closed` until it ends, so the loop can wait for them.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(());
    let (closed_tx, closed_rx) = tokio::sync::watch::channel(());
    tokio::pin!(shutdown);
    let open = Arc::new(parking_lot::Mutex::new(OpenConnections::default()));
    loop {
        // axum's accept retries (and logs) errors itself.
        let (tcp, peer) = tokio::select! {
            conn = axum::serve::Listener::accept(&mut listener) => conn,
            _ = &mut shutdown => break,
        };
        // On loopback, whose the connection is (a kernel lookup, before anything is read).
        let who = Peer::of_connection(peer, tcp.local_addr().ok());
        let pool = {
            let mut open = open.lock();
            match decide(who, &open, &reserved.0.read(), &timeouts) {
                Admission::Accept(pool) => {
                    open.count_in(pool);
                    pool
                }
                Admission::Refuse(cap) => {
                    // Closed at once: a source over its cap (or a full listener) holds no more.
                    tracing::debug!(%peer, "connection refused: {cap} reached");
                    drop(tcp);
                    continue;
                }
            }
        };
        let place = Admitted {
            open: open.clone(),
            pool,
        };
        let service = hyper_util::service::TowerToHyperService::new(service.clone());
        let mut stop = stop_rx.clone();
        let closed = closed_rx.clone();
        let (read, tls) = (timeouts.read, tls.clone());
        tokio::spawn(async move {
            // `place` and `closed` go when this task ends, however it ends.
            let _held = (place, closed);
            let Some(acceptor) = tls else {
                return serve_connection(tcp, service, read, stop, peer).await;
            };
            let stream = tokio::select! {
                done = tokio::time::timeout(read, acceptor.accept(tcp)) => match done {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(e)) => return tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => return tracing::debug!(%peer, "TLS handshake timed out (http.read_timeout_sec)"),
                },
                _ = stop.changed() => return,
            };
            serve_connection(stream, service, read, stop, peer).await;
        });
    }
    drop(listener);
    drop(stop_tx);
    drop(closed_rx);
    closed_tx.closed().await;
    Ok(())
}

/// Serves the requests of one connection until it ends, shutting it down gracefully when
/// `stop` changes (serving stops).
async fn serve_connection<I>(
    io: I,
    service: Service,
    read: Duration,
    mut stop: tokio::sync::watch::Receiver<()>,
    peer: SocketAddr,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use hyper_util::rt::{TokioIo, TokioTimer};
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(read);
    // Every request carries its TCP peer (the RM learns its agents' addresses from it).
    let service = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
        req.extensions_mut().insert(PeerAddr(peer));
        hyper::service::Service::call(&service, req)
    });
    let conn = builder.serve_connection(TokioIo::new(io), service).with_upgrades();
    tokio::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            done = conn.as_mut() => {
                if let Err(e) = done {
                    tracing::trace!(?peer, error = %e, "connection ended");
                }
                break;
            }
            _ = stop.changed(), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    /// A self-signed certificate for 127.0.0.1 and its key, as PEM files.
    fn self_signed(dir: &Path) -> (PathBuf, PathBuf) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".into(), "localhost".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (
            write(dir, "cert.pem", &cert.pem()),
            write(dir, "key.pem", &key.serialize_pem()),
        )
    }

    fn caps(total: usize, per_source: usize, reserved: usize, per_reserved: usize) -> HttpTimeouts {
        HttpTimeouts {
            read: Duration::from_secs(30),
            max_connections: total,
            max_connections_per_peer: per_source,
            max_reserved_connections: reserved,
            max_reserved_connections_per_peer: per_reserved,
        }
    }

    fn ip(s: &str) -> std::net::IpAddr {
        s.parse().unwrap()
    }

    /// Admits one connection as the accept loop does; its pool, or the refusal's reason.
    fn admit(open: &mut OpenConnections, reserved: &ReservedSet, peer: &str, caps: &HttpTimeouts) -> Admission {
        let a = decide(Peer::at(ip(peer)), open, reserved, caps);
        if let Admission::Accept(pool) = a {
            open.count_in(pool);
        }
        a
    }

    #[test]
    fn sources_merge_loopback_and_ipv6_64s() {
        for lo in ["127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", "::ffff:127.0.0.5"] {
            assert_eq!(Source::of(ip(lo)), Source::Loopback(None), "{lo}");
        }
        assert_eq!(Source::of(ip("::ffff:10.0.0.1")), Source::of(ip("10.0.0.1")));
        assert_ne!(Source::of(ip("10.0.0.1")), Source::of(ip("10.0.0.2")));
        assert_eq!(
            Source::of(ip("2001:db8:1:2::1")),
            Source::of(ip("2001:db8:1:2:ffff::9"))
        );
        assert_ne!(Source::of(ip("2001:db8:1:2::1")), Source::of(ip("2001:db8:1:3::1")));
        assert_eq!(canonical(ip("::ffff:10.0.0.1")), ip("10.0.0.1"));
    }

    #[test]
    fn connections_are_capped_per_source_and_in_all_and_places_come_back() {
        let none = ReservedSet::default();
        let c = caps(3, 2, 0, 0);
        let mut open = OpenConnections::default();
        assert!(matches!(admit(&mut open, &none, "127.0.0.2", &c), Admission::Accept(_)));
        assert!(matches!(admit(&mut open, &none, "127.0.0.3", &c), Admission::Accept(_)));
        assert_eq!(
            admit(&mut open, &none, "127.0.0.4", &c),
            Admission::Refuse("http.max_connections_per_peer"),
            "a third loopback address is the same source"
        );
        assert_eq!(
            admit(&mut open, &none, "2001:db8::2", &c),
            Admission::Accept(Pool::General(Source::of(ip("2001:db8::"))))
        );
        assert_eq!(
            admit(&mut open, &none, "10.0.0.1", &c),
            Admission::Refuse("http.max_connections")
        );
        open.release(Pool::General(Source::Loopback(None)));
        assert!(
            matches!(admit(&mut open, &none, "10.0.0.1", &c), Admission::Accept(_)),
            "a released place is free again"
        );
        for p in ["127.0.0.1", "2001:db8::", "10.0.0.1"] {
            open.release(Pool::General(Source::of(ip(p))));
        }
        assert_eq!(open.total, 0);
        assert!(open.per_source.is_empty(), "{open:?}");
    }

    /// Audit 5 F4: a flood from many sources fills the general pool, and a live agent's
    /// address still gets its reserved places (and only it: a neighbouring address does
    /// not); past its reserved cap it competes in the general pool like anyone.
    #[test]
    fn a_flood_from_elsewhere_cannot_take_an_agent_s_reserved_places() {
        let mut reserved = ReservedSet::default();
        reserved.set("n2", ip("10.0.0.2"));
        let c = caps(8, 2, 3, 2);
        let mut open = OpenConnections::default();
        for i in 0..100 {
            let _ = admit(&mut open, &reserved, &format!("10.1.0.{i}"), &c);
            let _ = admit(&mut open, &reserved, &format!("127.0.0.{}", i + 2), &c);
        }
        assert_eq!(open.total, 8, "the general pool is full");
        assert_eq!(
            open.per_source.get(&Source::Loopback(None)),
            Some(&2),
            "all of loopback holds one source's share"
        );
        assert_eq!(
            admit(&mut open, &reserved, "10.0.0.2", &c),
            Admission::Accept(Pool::Reserved(ip("10.0.0.2"), None))
        );
        assert_eq!(
            admit(&mut open, &reserved, "::ffff:10.0.0.2", &c),
            Admission::Accept(Pool::Reserved(ip("10.0.0.2"), None)),
            "IPv4-mapped is the same agent"
        );
        assert_eq!(
            admit(&mut open, &reserved, "10.0.0.2", &c),
            Admission::Refuse("http.max_connections"),
            "past its reserved cap, the general pool (full)"
        );
        assert_eq!(
            admit(&mut open, &reserved, "10.0.0.3", &c),
            Admission::Refuse("http.max_connections")
        );
        // LOST: the address is no longer reserved.
        reserved.remove("n2");
        open.release(Pool::Reserved(ip("10.0.0.2"), None));
        assert_eq!(
            admit(&mut open, &reserved, "10.0.0.2", &c),
            Admission::Refuse("http.max_connections")
        );
    }

    /// Twelfth pass: a tenant's task on the RM's host (its own uid) held every place of
    /// 127.0.0.1, and the host's users, its AMs and a restarted agent were refused. Each
    /// local user now holds its own share of this host's reserved places and of loopback's
    /// general ones: the flood fills its own, root's and alice's stay free.
    #[test]
    fn a_local_users_flood_holds_only_its_own_places() {
        let mut reserved = ReservedSet::default();
        reserved.set_wide("this host", ip("127.0.0.1"));
        let c = caps(100, 4, 1000, 8);
        let mut open = OpenConnections::default();
        let from = |uid: Option<u32>| Peer {
            ip: ip("127.0.0.1"),
            local_uid: uid,
        };
        let take = |open: &mut OpenConnections, peer: Peer| {
            let a = decide(peer, open, &reserved, &c);
            if let Admission::Accept(pool) = a {
                open.count_in(pool);
            }
            a
        };
        let bob = Some(1001);
        let bobs = (0..100)
            .filter(|_| matches!(take(&mut open, from(bob)), Admission::Accept(_)))
            .count();
        assert_eq!(bobs, 8 + 4, "his reserved share, then his general share");
        assert_eq!(
            take(&mut open, from(bob)),
            Admission::Refuse("http.max_connections_per_peer")
        );
        for uid in [Some(0), Some(1000)] {
            assert_eq!(
                take(&mut open, from(uid)),
                Admission::Accept(Pool::Reserved(ip("127.0.0.1"), uid)),
                "{uid:?} is not behind bob"
            );
        }
        // Another loopback address is the same host and the same user.
        assert_eq!(
            take(
                &mut open,
                Peer {
                    ip: ip("127.0.0.7"),
                    local_uid: bob
                }
            ),
            Admission::Refuse("http.max_connections_per_peer")
        );
        // A uid is never read off a peer that is not on loopback.
        let far = Peer {
            ip: ip("10.0.0.1"),
            local_uid: Some(5),
        };
        assert_eq!(Source::of_peer(far), Source::of(ip("10.0.0.1")));
    }

    /// The reserved pool is bounded in all too, and shared addresses are counted once per
    /// owner: removing one owner of an address leaves it reserved for the other.
    #[test]
    fn the_reserved_pool_is_bounded_and_owners_are_counted() {
        let mut reserved = ReservedSet::default();
        for (h, a) in [("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.2")] {
            reserved.set(h, ip(a));
        }
        let c = caps(1, 1, 2, 5);
        let mut open = OpenConnections::default();
        assert!(matches!(
            admit(&mut open, &reserved, "10.0.0.1", &c),
            Admission::Accept(Pool::Reserved(..))
        ));
        assert!(matches!(
            admit(&mut open, &reserved, "10.0.0.2", &c),
            Admission::Accept(Pool::Reserved(..))
        ));
        assert!(
            matches!(
                admit(&mut open, &reserved, "10.0.0.2", &c),
                Admission::Accept(Pool::General(_))
            ),
            "reserved pool full: the general pool"
        );
        reserved.remove("b");
        assert!(reserved.contains(ip("10.0.0.2")), "still c's");
        reserved.set("a", ip("10.0.0.9"));
        assert!(
            !reserved.contains(ip("10.0.0.1")) && reserved.contains(ip("10.0.0.9")),
            "a moved"
        );
        // An agent's address holds its agents' places only; this host's, the per-peer share.
        let mut reserved = ReservedSet::default();
        reserved.set("h1", ip("10.0.0.5"));
        reserved.set_wide("the RM", ip("10.0.0.6"));
        assert_eq!(reserved.places(ip("10.0.0.5"), 256), RESERVED_PLACES_PER_AGENT);
        reserved.set("h2", ip("10.0.0.5"));
        assert_eq!(reserved.places(ip("10.0.0.5"), 256), 2 * RESERVED_PLACES_PER_AGENT);
        assert_eq!(reserved.places(ip("10.0.0.6"), 256), 256);
        assert_eq!(reserved.places(ip("10.0.0.7"), 256), 0);
        let c = caps(100, 1, 1000, 256);
        let mut open = OpenConnections::default();
        let reserved_now = (0..20)
            .filter(|_| {
                matches!(
                    admit(&mut open, &reserved, "10.0.0.5", &c),
                    Admission::Accept(Pool::Reserved(..))
                )
            })
            .count();
        assert_eq!(
            reserved_now,
            2 * RESERVED_PLACES_PER_AGENT,
            "a flood from an agent's host holds its agents' places, not the pool"
        );
        let this = ReservedPeers::this_host();
        assert!(this.contains(ip("127.0.0.1")) && this.contains(ip("::1")) && this.contains(ip("::ffff:127.0.0.1")));
        assert!(!this.contains(ip("127.0.0.2")), "other loopback addresses are anyone's");
    }

    /// The defaults: it takes many sources to fill the general pool (audit 5 F4: four
    /// did), and the own host keeps what one peer had before.
    #[test]
    fn the_default_caps_need_many_sources_to_fill_the_general_pool() {
        let c = HttpTimeouts::default();
        assert!(c.max_connections / c.max_connections_per_peer >= 32, "{c:?}");
        assert!(c.max_reserved_connections_per_peer >= 256, "{c:?}");
    }

    #[test]
    fn a_good_pair_loads() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = self_signed(dir.path());
        server_config(&cert, &key).unwrap();
        client_config(&cert).unwrap();
    }

    #[test]
    fn missing_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = self_signed(dir.path());
        let missing = dir.path().join("nope.pem");
        let e = server_config(&missing, &key).unwrap_err().to_string();
        assert!(
            e.contains("cannot read certificate file") && e.contains("nope.pem"),
            "{e}"
        );
        let e = server_config(&cert, &missing).unwrap_err().to_string();
        assert!(e.contains("cannot read key file") && e.contains("nope.pem"), "{e}");
        let e = client_config(&missing).unwrap_err().to_string();
        assert!(e.contains("cannot read CA file") && e.contains("nope.pem"), "{e}");
    }

    #[test]
    fn empty_pem_has_no_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let (_, key) = self_signed(dir.path());
        let empty = write(dir.path(), "empty.pem", "");
        let e = server_config(&empty, &key).unwrap_err();
        assert!(matches!(e, TlsError::NoCertificate(_)), "{e}");
        assert!(e.to_string().contains("no certificate found in") && e.to_string().contains("empty.pem"));
        // A key file is not a certificate either.
        let e = client_config(&key).unwrap_err();
        assert!(matches!(e, TlsError::NoCertificate(_)), "{e}");
    }

    #[test]
    fn a_certificate_is_not_a_key() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, _) = self_signed(dir.path());
        let e = server_config(&cert, &cert).unwrap_err();
        assert!(matches!(e, TlsError::NotAKey(_)), "{e}");
        assert!(e.to_string().contains("cert.pem: not a PEM private key"), "{e}");
        let garbage = write(dir.path(), "garbage.pem", "hello\n");
        assert!(matches!(server_config(&cert, &garbage), Err(TlsError::NotAKey(_))));
    }

    #[test]
    fn a_key_of_another_certificate_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, _) = self_signed(dir.path());
        let other = write(
            dir.path(),
            "other.pem",
            &rcgen::KeyPair::generate().unwrap().serialize_pem(),
        );
        let e = server_config(&cert, &other).unwrap_err().to_string();
        assert!(e.contains("other.pem") && e.contains("cert.pem"), "{e}");
    }

    #[test]
    fn settings_need_both_cert_and_key() {
        let env = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<Vec<_>>()
        };
        let e = Settings::load_with_env(None, env(&[("GPUAM__TLS__CERT_FILE", "/x/cert.pem")])).unwrap_err();
        assert!(e.to_string().contains("tls.key_file"), "{e}");
        let e = Settings::load_with_env(None, env(&[("GPUAM__TLS__KEY_FILE", "/x/key.pem")])).unwrap_err();
        assert!(e.to_string().contains("tls.cert_file"), "{e}");
        let s = Settings::load_with_env(None, env(&[("GPUAM__TLS__CA_FILE", "/x/ca.pem")])).unwrap();
        assert_eq!(s.tls.ca_file.as_deref(), Some(Path::new("/x/ca.pem")));
        assert!(
            server_config_from_settings(&s.tls).unwrap().is_none(),
            "a CA alone serves plain HTTP"
        );
    }

    async fn get(client: &reqwest::Client, url: &str) -> Result<String, reqwest::Error> {
        client.get(url).send().await?.text().await
    }

    #[tokio::test]
    async fn serves_https_and_refuses_plain_http() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = self_signed(dir.path());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "hello" }));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(
            listener,
            app,
            Some(server_config(&cert, &key).unwrap()),
            async move {
                let _ = stopped.await;
            },
        ));
        // A silent client holding a handshake open does not stop others being served.
        let _silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        let trusting = http_client_builder(Some(&cert)).unwrap().build().unwrap();
        assert_eq!(get(&trusting, &format!("https://{addr}/")).await.unwrap(), "hello");
        let plain = http_client_builder(None).unwrap().build().unwrap();
        assert!(get(&plain, &format!("http://{addr}/")).await.is_err());
        let other_dir = tempfile::tempdir().unwrap();
        let (other_ca, _) = self_signed(other_dir.path());
        let distrusting = http_client_builder(Some(&other_ca)).unwrap().build().unwrap();
        let e = get(&distrusting, &format!("https://{addr}/")).await.unwrap_err();
        assert!(format!("{e:?}").to_lowercase().contains("certificate"), "{e:?}");
        // Still serving after the failures.
        assert_eq!(get(&trusting, &format!("https://{addr}/")).await.unwrap(), "hello");
        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}
