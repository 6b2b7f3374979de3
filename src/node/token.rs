//! Container tokens: the RM's proof that it granted a container, checked by node agents
//! before they start (or stop, or show) anything.
//!
//! A token is `hex(HMAC-SHA256(node secret, canonical grant))`, where the canonical grant
//! names the container id, application, host and the exact resources (CPU, memory, GPU
//! mask, ports). The node secret is the shared node token (`--node-token-file` on both the
//! RM and its agents). An AM, which holds only its application token, can neither forge a
//! token nor reuse one for other GPUs: any change to the grant changes the MAC.

use ring::hmac;

use super::Grant;

/// The text the MAC covers: one field per line, resources in a fixed order.
pub fn canonical(grant: &Grant) -> String {
    let r = &grant.resources;
    format!(
        "gpuam-container-v1\nid={}\napp={}\nhost={}\ncpu={}\nmemoryMB={}\ngpus={}\ngpuMask={:#x}\nports={}\n",
        grant.container_id, grant.app_id, grant.host, r.cpu, r.memory_mb, r.gpus, r.gpu_mask, r.ports
    )
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
            topology: None,
        }
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
