//! Container tokens: the RM's proof that it granted a container, checked by node agents
//! before they start (or stop, or show) anything.
//!
//! A token is `hex(HMAC-SHA256(host key, canonical grant))`, where the canonical grant
//! names the container id, application, host, the submitting user (whose uid the task
//! gets) and the exact resources (CPU, memory, GPU
//! mask, ports). Each host has its own key ([`host_key`]): an HMAC, under a secret only the
//! RM holds (`host-keys.secret` beside its state, made at its first start), of the host's
//! name and the digest of its agent's current token. The nodes file holds only the
//! digests ([`token_digest`]), so reading it does not give the keys; the agent gets its
//! key from the RM in the answer to its registration (which its own token authenticates,
//! over TLS where configured), and a new token (`gpuam node-token new`) is a new key. An
//! AM, which holds only its application token, can neither forge a token nor reuse one
//! for other GPUs: any change to the grant changes the MAC; an agent's stolen token or
//! key signs starts for its own host only (the agent checks the grant names it).
//!
//! The RM's calls to an agent are each signed ([`sign_call`], header [`CALL_HEADER`],
//! scheme [`CALL_SCHEME`]): an HMAC under the host key of the method, the path and query,
//! the agent's instance (a random id the agent makes at each start and gives the RM in its
//! registration), a time, a random nonce and the SHA-256 of the body. The agent
//! ([`verify_call`], [`SeenCalls`]) takes a call only when the MAC matches, the time is
//! within [`CALL_WINDOW_MS`] of its own clock, and the nonce was not seen within the
//! window. So a captured call (a task that took the agent's port while it restarted, a
//! sniffer on a link without TLS) is no credential: it cannot be altered (other commands,
//! environment, container, verb), not replayed to the agent it was meant for (the nonce),
//! nor to a later run of that agent (the instance), nor after the window. The fixed bearer
//! the RM's calls carried before (`gpuam-rm-to-agent-v1`) is refused with a 401 that says
//! so. A captured call does not give away the key either.

use ring::hmac;

use super::Grant;

/// The text the MAC covers: one field per line, resources in a fixed order. GPU shares
/// and custom resources add a line each only when present, so a whole-GPU grant's text
/// (and token) is what it always was, and an agent that does not know them cannot verify
/// a grant that has them.
pub fn canonical(grant: &Grant) -> String {
    let r = &grant.resources;
    let mut text = format!(
        "gpuam-container-v1\nid={}\napp={}\nhost={}\ncpu={}\nmemoryMB={}\ngpus={}\ngpuMask={:#x}\nports={}\n",
        grant.container_id, grant.app_id, grant.host, r.cpu, r.memory_mb, r.gpus, r.gpu_mask, r.ports
    );
    if !grant.user.is_empty() {
        // Whose uid the task gets: an AM cannot start its task as another user.
        text.push_str(&format!("user={}\n", grant.user));
    }
    if !r.gpu_shares.is_empty() {
        text.push_str(&format!("gpuShares={}\n", r.gpu_shares));
    }
    if !r.custom.is_empty() {
        text.push_str(&format!("customResources={}\n", r.custom.to_text()));
    }
    text
}

/// The SHA-256 of an agent's token: what the RM's nodes file stores for its host.
pub fn token_digest(agent_token: &str) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, agent_token.trim().as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// A host's key: HMAC-SHA256 under the RM's own secret of the host's name and the digest
/// of its agent's token (see the module doc).
pub fn host_key(rm_secret: &[u8], host: &str, digest: &[u8; 32]) -> [u8; 32] {
    let key = hmac::Key::new(hmac::HMAC_SHA256, rm_secret);
    let text = format!(
        "gpuam-host-key-v2\nhost={host}\ncredential={}\n",
        crate::auth::hex(digest)
    );
    let mut out = [0u8; 32];
    out.copy_from_slice(hmac::sign(&key, text.as_bytes()).as_ref());
    out
}

/// A host key as the RM hands it to the agent (hex), read back; `None` unless 32 bytes.
pub fn key_from_hex(text: &str) -> Option<[u8; 32]> {
    decode_hex(text.trim())?.try_into().ok()
}

/// The header carrying the signature of an RM → agent call ([`sign_call`]).
pub const CALL_HEADER: &str = "x-gpuam-call";

/// The scheme of a signed call: the first word of [`CALL_HEADER`], and the first line
/// of the text its MAC covers.
pub const CALL_SCHEME: &str = "gpuam-rm-call-v2";

/// How far (either way) a signed call's time may be from the agent's clock: the RM's and
/// the agents' clocks must agree within this. A nonce is remembered this long past its
/// call's time.
pub const CALL_WINDOW_MS: u64 = 120_000;

/// Most nonces an agent remembers at once ([`SeenCalls`]): when full (more than this
/// many calls within a window) it refuses calls rather than forget one.
pub const MAX_SEEN_CALLS: usize = 1 << 17;

/// One RM → agent call, as its MAC sees it.
#[derive(Clone, Copy, Debug)]
pub struct Call<'a> {
    /// `GET`, `POST`, … (upper case).
    pub method: &'a str,
    /// The request target: path and query (`/ws/v1/node/h1/containers/…/stop?graceMs=3000`).
    pub path_and_query: &'a str,
    /// The agent run's instance id from its registration (empty: an agent that sent none).
    pub instance: &'a str,
    /// The request body (empty when none).
    pub body: &'a [u8],
}

/// The text a call's MAC covers.
fn call_text(call: &Call<'_>, ts_ms: u64, nonce: &str) -> String {
    let body = ring::digest::digest(&ring::digest::SHA256, call.body);
    format!(
        "{CALL_SCHEME}\n{}\n{}\n{}\n{ts_ms}\n{nonce}\n{}\n",
        call.method,
        call.path_and_query,
        call.instance,
        crate::auth::hex(body.as_ref())
    )
}

/// A fresh random nonce for [`sign_call`]: 16 bytes in hex.
pub fn new_nonce() -> String {
    crate::auth::random_hex::<16>()
}

/// The [`CALL_HEADER`] value of `call` at `ts_ms` (Unix ms) with `nonce` ([`new_nonce`]):
/// `gpuam-rm-call-v2 ts=<ms> nonce=<32 hex> mac=<64 hex>`, the MAC being HMAC-SHA256
/// under the host key of `gpuam-rm-call-v2\n{method}\n{path and query}\n{instance}\n{ts}\n{nonce}\n{hex SHA-256 of the body}\n`.
pub fn sign_call(host_key: &[u8], call: &Call<'_>, ts_ms: u64, nonce: &str) -> String {
    let key = hmac::Key::new(hmac::HMAC_SHA256, host_key);
    let mac = hmac::sign(&key, call_text(call, ts_ms, nonce).as_bytes());
    format!(
        "{CALL_SCHEME} ts={ts_ms} nonce={nonce} mac={}",
        crate::auth::hex(mac.as_ref())
    )
}

/// A call whose MAC and time [`verify_call`] accepted: its nonce and time, for [`SeenCalls`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Signed {
    pub nonce: u128,
    pub ts_ms: u64,
}

/// Checks `header` (the [`CALL_HEADER`] value) against `call` under `host_key` at the
/// agent's time `now_ms`: the MAC (constant time), then the time window. The error says
/// why (the time: by how much and which way it is off). Pure: the nonce's freshness is
/// [`SeenCalls::admit`]'s.
pub fn verify_call(host_key: &[u8], call: &Call<'_>, header: &str, now_ms: u64) -> Result<Signed, String> {
    let mut words = header.split_ascii_whitespace();
    if words.next() != Some(CALL_SCHEME) {
        return Err(format!(
            "the call's signature is not `{CALL_SCHEME} ts=… nonce=… mac=…`"
        ));
    }
    let (mut ts, mut nonce, mut mac) = (None, None, None);
    for word in words {
        match word.split_once('=') {
            Some(("ts", v)) if ts.is_none() => ts = Some(v),
            Some(("nonce", v)) if nonce.is_none() => nonce = Some(v),
            Some(("mac", v)) if mac.is_none() => mac = Some(v),
            _ => return Err(format!("the call's signature has an unknown or repeated part `{word}`")),
        }
    }
    let (Some(ts_text), Some(nonce_text), Some(mac_text)) = (ts, nonce, mac) else {
        return Err("the call's signature lacks ts=, nonce= or mac=".into());
    };
    let ts_ms: u64 = ts_text
        .parse()
        .map_err(|_| "the call's ts= is not a time in Unix milliseconds".to_string())?;
    let nonce = (nonce_text.len() == 32 && nonce_text.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| u128::from_str_radix(nonce_text, 16).ok())
        .flatten()
        .ok_or_else(|| "the call's nonce= is not 32 hex digits".to_string())?;
    let Some(tag) = decode_hex(mac_text) else {
        return Err("the call's mac= is not hex".into());
    };
    let key = hmac::Key::new(hmac::HMAC_SHA256, host_key);
    // The MAC covers the nonce as sent (its case too).
    if hmac::verify(&key, call_text(call, ts_ms, nonce_text).as_bytes(), &tag).is_err() {
        return Err(
            "the call's signature does not match this request under this host's key (altered, meant for \
             another request or another run of this agent, or not the RM's)"
                .into(),
        );
    }
    if ts_ms > now_ms.saturating_add(CALL_WINDOW_MS) {
        return Err(format!(
            "the call's time is {} ms ahead of this agent's clock (more than the {CALL_WINDOW_MS} ms window): \
             check the RM's and this node's clocks",
            ts_ms - now_ms
        ));
    }
    if ts_ms.saturating_add(CALL_WINDOW_MS) < now_ms {
        return Err(format!(
            "the call's time is {} ms behind this agent's clock (more than the {CALL_WINDOW_MS} ms window): a \
             replay, or the RM's and this node's clocks differ",
            now_ms - ts_ms
        ));
    }
    Ok(Signed { nonce, ts_ms })
}

/// Why [`SeenCalls::admit`] refused a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotAdmitted {
    /// Its nonce was taken before: a replay.
    Replayed,
    /// The set holds this many nonces, all still in the window.
    Full(usize),
}

impl std::fmt::Display for NotAdmitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotAdmitted::Replayed => write!(f, "this call was taken before (its nonce is used): a replay"),
            NotAdmitted::Full(n) => write!(
                f,
                "this agent took {n} calls within the last {CALL_WINDOW_MS} ms, as many as it remembers: try again \
                 later"
            ),
        }
    }
}

/// The nonces of the calls an agent took, each until its call's time is out of the
/// window (then [`verify_call`] refuses the call anyway). At most [`MAX_SEEN_CALLS`]:
/// a full set refuses new calls rather than forget a nonce still in the window.
#[derive(Debug)]
pub struct SeenCalls {
    /// Nonce → the time (Unix ms) after which it can go.
    seen: std::collections::HashMap<u128, u64>,
    capacity: usize,
    /// When expired nonces were last dropped.
    swept_ms: u64,
}

impl Default for SeenCalls {
    fn default() -> Self {
        SeenCalls::with_capacity(MAX_SEEN_CALLS)
    }
}

impl SeenCalls {
    pub fn with_capacity(capacity: usize) -> Self {
        SeenCalls {
            seen: Default::default(),
            capacity,
            swept_ms: 0,
        }
    }

    /// How many nonces are remembered.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }

    /// Takes `call`'s nonce at `now_ms`: an error if it was seen (a replay) or the set is
    /// full of nonces still in the window.
    pub fn admit(&mut self, call: Signed, now_ms: u64) -> Result<(), NotAdmitted> {
        if self.seen.contains_key(&call.nonce) {
            return Err(NotAdmitted::Replayed);
        }
        if self.seen.len() >= self.capacity || now_ms.saturating_sub(self.swept_ms) >= CALL_WINDOW_MS {
            self.seen.retain(|_, until| *until >= now_ms);
            self.swept_ms = now_ms;
        }
        if self.seen.len() >= self.capacity {
            return Err(NotAdmitted::Full(self.seen.len()));
        }
        self.seen.insert(call.nonce, call.ts_ms.saturating_add(CALL_WINDOW_MS));
        Ok(())
    }
}

/// The container token of `grant` under `secret`.
pub fn sign(secret: &[u8], grant: &Grant) -> String {
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
    let tag = hmac::sign(&key, canonical(grant).as_bytes());
    tag.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `token` is `grant`'s token under `secret` (constant-time comparison).
pub fn verify(secret: &[u8], grant: &Grant, token: &str) -> bool {
    let Some(tag) = decode_hex(token.trim()) else {
        return false;
    };
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
    hmac::verify(&key, canonical(grant).as_bytes(), &tag).is_ok()
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{PortSet, Resources};
    use proptest::prelude::*;

    fn grant(mask: u64) -> Grant {
        Grant {
            container_id: "container_1_0001_01_000001".into(),
            app_id: "application_1_0001".into(),
            host: "h1".into(),
            resources: Resources::with_mask(2, 1024, mask, PortSet::default()),
            user: String::new(),
            topology: None,
        }
    }

    /// The user is covered: a token for alice's task does not start it as bob's, and a
    /// grant without a user keeps the token it always had.
    #[test]
    fn the_user_is_covered() {
        let g = grant(1);
        let plain = sign(b"s", &g);
        let mut alice = g.clone();
        alice.user = "alice".into();
        let t = sign(b"s", &alice);
        assert_ne!(t, plain);
        assert!(verify(b"s", &alice, &t));
        let mut bob = alice.clone();
        bob.user = "bob".into();
        assert!(!verify(b"s", &bob, &t));
        assert!(!canonical(&g).contains("user="));
    }

    #[test]
    fn shares_and_custom_resources_are_covered() {
        let whole = grant(0x1);
        assert!(
            !canonical(&whole).contains("gpuShares"),
            "a whole grant's text is unchanged"
        );
        let mut quarter = whole.clone();
        quarter.resources = Resources::with_share(2, 1024, 0, 25, PortSet::default());
        let t = sign(b"k", &quarter);
        let mut half = quarter.clone();
        half.resources = Resources::with_share(2, 1024, 0, 50, PortSet::default());
        assert!(verify(b"k", &quarter, &t));
        assert!(!verify(b"k", &half, &t), "another share");
        assert!(!verify(b"k", &whole, &t), "the whole GPU");
        let mut drive = whole.clone();
        drive.resources = drive
            .resources
            .with_custom(crate::resources::CustomResources::from_pairs([("nvme", 1)]));
        assert!(!verify(b"k", &drive, &sign(b"k", &whole)));
    }

    /// The key depends on the RM's secret, the host and the token: the digest alone (the
    /// nodes file) does not give it, another host's is another, a new token a new one.
    #[test]
    fn a_host_key_needs_the_rms_secret() {
        let d = token_digest("agent-token");
        let k = host_key(b"rm-secret", "h1", &d);
        assert_ne!(k, d);
        assert_ne!(k, host_key(b"other-secret", "h1", &d));
        assert_ne!(k, host_key(b"rm-secret", "h2", &d));
        assert_ne!(k, host_key(b"rm-secret", "h1", &token_digest("new-token")));
        assert_eq!(key_from_hex(&crate::auth::hex(&k)), Some(k));
        assert_eq!(key_from_hex("abcd"), None);
    }

    #[test]
    fn a_token_verifies_its_own_grant_only() {
        let t = sign(b"secret", &grant(0x3));
        assert!(verify(b"secret", &grant(0x3), &t));
        assert!(!verify(b"secret", &grant(0x7), &t), "other GPUs");
        assert!(!verify(b"other", &grant(0x3), &t), "other secret");
        assert!(!verify(b"secret", &grant(0x3), "zz"), "not hex");
        assert!(!verify(b"secret", &grant(0x3), ""), "empty");
    }

    const KEY: [u8; 32] = [5u8; 32];
    const NOW: u64 = 1_800_000_000_000;
    const NONCE: &str = "00112233445566778899aabbccddeeff";

    fn start_call(body: &[u8]) -> Call<'_> {
        Call {
            method: "POST",
            path_and_query: "/ws/v1/node/h1/containers/container_1_0001_01_000001/start",
            instance: "run-1",
            body,
        }
    }

    /// A signed call verifies as it was sent; any change to what it covers (the body: its
    /// commands and environment; the path, the query, the method, the agent's run, the
    /// time, the nonce) or another key does not.
    #[test]
    fn a_signed_call_verifies_only_as_sent() {
        let body = br#"{"launchContext":{"commands":["echo bob"]}}"#;
        let call = start_call(body);
        let header = sign_call(&KEY, &call, NOW, NONCE);
        assert!(
            header.starts_with("gpuam-rm-call-v2 ts=1800000000000 nonce=00112233"),
            "{header}"
        );
        let ok = verify_call(&KEY, &call, &header, NOW).unwrap();
        assert_eq!(ok.ts_ms, NOW);
        let refused = |c: &Call<'_>, h: &str, key: &[u8]| verify_call(key, c, h, NOW).unwrap_err();
        let other_body = br#"{"launchContext":{"commands":["echo alice"]}}"#;
        assert!(refused(&start_call(other_body), &header, &KEY).contains("does not match"));
        assert!(refused(&start_call(b""), &header, &KEY).contains("does not match"));
        let mut c = call;
        c.path_and_query = "/ws/v1/node/h1/containers/container_1_0001_01_000002/start";
        assert!(
            refused(&c, &header, &KEY).contains("does not match"),
            "another container"
        );
        let mut c = call;
        c.method = "GET";
        assert!(refused(&c, &header, &KEY).contains("does not match"), "another method");
        let mut c = call;
        c.instance = "run-2";
        assert!(
            refused(&c, &header, &KEY).contains("does not match"),
            "a later run of the agent"
        );
        assert!(
            refused(&call, &header, &[6u8; 32]).contains("does not match"),
            "another key"
        );
        let stop = Call {
            method: "POST",
            path_and_query: "/ws/v1/node/h1/containers/c/stop?graceMs=3000",
            instance: "",
            body: b"",
        };
        let h = sign_call(&KEY, &stop, NOW, NONCE);
        let mut c = stop;
        c.path_and_query = "/ws/v1/node/h1/containers/c/stop?graceMs=0";
        assert!(refused(&c, &h, &KEY).contains("does not match"), "another query");
        // The header's own parts: another time or nonce breaks the MAC.
        let later = header.replace("ts=1800000000000", "ts=1800000000001");
        assert!(refused(&call, &later, &KEY).contains("does not match"));
        let renonced = header.replace(NONCE, "ffffffffffffffffffffffffffffffff");
        assert!(refused(&call, &renonced, &KEY).contains("does not match"));
        // Malformed headers, and the old fixed bearer's form.
        for bad in [
            "",
            "Bearer abc",
            "gpuam-rm-call-v1 ts=1 nonce=00 mac=00",
            "gpuam-rm-call-v2 ts=1",
            "gpuam-rm-call-v2 ts=x nonce=00112233445566778899aabbccddeeff mac=00",
            "gpuam-rm-call-v2 ts=1 nonce=0011 mac=00",
            "gpuam-rm-call-v2 ts=1 nonce=00112233445566778899aabbccddeeff mac=zz",
            "gpuam-rm-call-v2 ts=1 ts=2 nonce=00112233445566778899aabbccddeeff mac=00",
        ] {
            assert!(verify_call(&KEY, &call, bad, NOW).is_err(), "{bad:?}");
        }
    }

    /// Within the window either way it is taken; beyond it refused, saying which way.
    #[test]
    fn a_call_outside_the_time_window_is_refused_saying_which_way() {
        let call = start_call(b"{}");
        let at = |ts: u64| verify_call(&KEY, &call, &sign_call(&KEY, &call, ts, NONCE), NOW);
        assert!(at(NOW - CALL_WINDOW_MS).is_ok());
        assert!(at(NOW + CALL_WINDOW_MS).is_ok());
        let behind = at(NOW - CALL_WINDOW_MS - 1).unwrap_err();
        assert!(behind.contains("120001 ms behind"), "{behind}");
        assert!(behind.contains("behind this agent's clock"), "{behind}");
        let ahead = at(NOW + CALL_WINDOW_MS + 5).unwrap_err();
        assert!(ahead.contains("120005 ms ahead of this agent's clock"), "{ahead}");
    }

    /// A nonce is taken once; it is forgotten only once its call is out of the window;
    /// a full set refuses new calls rather than forget one still in the window.
    #[test]
    fn a_replayed_nonce_is_refused_and_the_set_is_bounded() {
        let call = start_call(b"{}");
        let header = sign_call(&KEY, &call, NOW, NONCE);
        let mut seen = SeenCalls::default();
        let signed = verify_call(&KEY, &call, &header, NOW).unwrap();
        seen.admit(signed, NOW).unwrap();
        let again = verify_call(&KEY, &call, &header, NOW + 1).unwrap();
        assert_eq!(seen.admit(again, NOW + 1), Err(NotAdmitted::Replayed));
        // Still refused at the window's end; after it the time refuses it.
        assert!(seen.admit(again, NOW + CALL_WINDOW_MS).is_err());
        assert!(verify_call(&KEY, &call, &header, NOW + CALL_WINDOW_MS + 1).is_err());

        let mut small = SeenCalls::with_capacity(3);
        let n = |i: u128, ts: u64| Signed { nonce: i, ts_ms: ts };
        for i in 0..3 {
            small.admit(n(i, NOW + i as u64), NOW).unwrap();
        }
        let full = small.admit(n(9, NOW), NOW + 10).unwrap_err();
        assert_eq!(full, NotAdmitted::Full(3));
        assert!(full.to_string().contains("as many as it remembers"), "{full}");
        assert_eq!(small.len(), 3, "nothing forgotten while in the window");
        assert_eq!(small.admit(n(0, NOW), NOW + 10), Err(NotAdmitted::Replayed));
        // Once the first is out of the window it goes, and one new call is taken.
        small
            .admit(n(9, NOW + CALL_WINDOW_MS), NOW + CALL_WINDOW_MS + 1)
            .unwrap();
        assert_eq!(small.len(), 3);
        assert!(small
            .admit(n(10, NOW + CALL_WINDOW_MS), NOW + CALL_WINDOW_MS + 1)
            .is_err());
        // Expired ones also go without the set filling up.
        let mut big = SeenCalls::default();
        big.admit(n(1, NOW), NOW).unwrap();
        big.admit(n(2, NOW + 3 * CALL_WINDOW_MS), NOW + 3 * CALL_WINDOW_MS)
            .unwrap();
        assert_eq!(big.len(), 1, "the expired nonce went");
    }

    #[test]
    fn nonces_are_fresh() {
        let (a, b) = (new_nonce(), new_nonce());
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
    }

    proptest! {
        /// Changing any one field of a grant invalidates its token.
        #[test]
        fn any_changed_field_breaks_the_token(mask in 1u64.., other in 1u64.., field in 0usize..4) {
            let g = grant(mask);
            let t = sign(b"k", &g);
            let mut h = g.clone();
            match field {
                0 => h.resources = Resources::with_mask(2, 1024, mask ^ other, PortSet::default()),
                1 => h.container_id.push('x'),
                2 => h.app_id.push('x'),
                _ => h.host.push('x'),
            }
            prop_assert!(verify(b"k", &g, &t));
            prop_assert!(!verify(b"k", &h, &t));
        }
    }
}
