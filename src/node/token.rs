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
//! The RM's calls to an agent carry [`rm_call_token`] of the host key (a MAC of a fixed
//! text), so a captured call does not give away the key that signs starts.

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

/// The bearer token the RM's calls to a host's agent carry.
pub fn rm_call_token(host_key: &[u8]) -> String {
    let key = hmac::Key::new(hmac::HMAC_SHA256, host_key);
    crate::auth::hex(hmac::sign(&key, b"gpuam-rm-to-agent-v1").as_ref())
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
