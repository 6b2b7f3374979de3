//! The wire between the RM and its node agents (JSON, camelCase).
//!
//! Agent → RM (Bearer: the node token):
//! - `POST /ws/v1/node-agents/register` [`AgentRegister`] → [`AgentReply`]
//! - `POST /ws/v1/node-agents/{host}/heartbeat` [`AgentHeartbeat`] → [`AgentReply`]
//!
//! RM → agent, at the agent's `nodeHTTPAddress`, each call signed for itself (header
//! `x-gpuam-call: gpuam-rm-call-v2 ts=<Unix ms> nonce=<32 hex> mac=<64 hex>`, see
//! [`super::token::sign_call`]: an HMAC under the host key of the method, path and query,
//! the agent's `instance`, the time, the nonce and the body's SHA-256; the agent takes it
//! within ±[`super::token::CALL_WINDOW_MS`] of its clock, once; a bearer token is refused
//! with 401). `start` also carries the container token, [`CONTAINER_TOKEN_HEADER`]:
//! - `POST /ws/v1/node/{host}/containers/{id}/start` [`AgentStart`] → `ContainerStatus`
//! - `POST /ws/v1/node/{host}/containers/{id}/stop?graceMs=N` → `ContainerStatus`
//! - `GET  /ws/v1/node/{host}/containers/{id}/status` → `ContainerStatus`
//! - `GET  /ws/v1/node/{host}/containers/{id}/logs?stream=stdout|stderr&tail=N` → text
//! - `POST /ws/v1/node/{host}/containers/{id}/preempt` [`AgentPreempt`] → `ContainerStatus`

use serde::{Deserialize, Serialize};

use super::Grant;
use crate::protocol::{ContainerState, LaunchContext};
use crate::resources::Resources;

/// Header carrying the RM-signed container token on `start`.
pub const CONTAINER_TOKEN_HEADER: &str = "x-gpuam-container-token";

/// A preemption notice for a running container (the agent creates its
/// `GPUAM_PREEMPT_FILE`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentPreempt {
    pub deadline_ms: u64,
    #[serde(default)]
    pub reason: String,
}

/// One container as an agent reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerReport {
    pub container_id: String,
    /// RUNNING, or COMPLETE (dead: its cgroup is empty).
    pub state: ContainerState,
    #[serde(default)]
    pub exit_status: Option<i32>,
    #[serde(default)]
    pub diagnostics: String,
    /// A bound of its own it went past (typed; the diagnostics lead with its words). Absent
    /// from an older agent: the RM reads its diagnostics then ([`crate::protocol::EndCause::of`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<crate::protocol::EndCause>,
}

/// What an agent offers: the node it is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentRegister {
    pub host: String,
    pub rack: String,
    #[serde(default)]
    pub labels: Vec<String>,
    #[serde(default)]
    pub gpu_type: Option<String>,
    /// CPU, memory, GPU mask and port ranges offered.
    pub total: Resources,
    /// A topology preset name or the text of `nvidia-smi topo -m`; empty: none.
    #[serde(default)]
    pub topology: String,
    /// Base URL where the agent serves the container endpoints.
    pub http_address: String,
    /// The address this node's containers are reached at by their peers (what the RM
    /// hands them in `GPUAM_HOSTS_<ROLE>` and `PAI_HOST_IP_*`); see [`check_node_ip`].
    /// Absent (an older agent): peers get the host name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<std::net::IpAddr>,
    /// Every container the agent knows: running ones and dead ones not yet acknowledged.
    /// A container the RM holds on this host and the agent does not list is gone.
    #[serde(default)]
    pub containers: Vec<ContainerReport>,
    /// Which containment the agent uses (for the node's health report).
    #[serde(default)]
    pub containment: String,
    /// This run of the agent's random id: the RM's calls to it name it in their MAC
    /// ([`super::token::Call::instance`]), so that a call made for an earlier run is
    /// refused by this one. Not kept in the RM's stored declaration.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub instance: String,
}

/// A heartbeat: the agent's containers now.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentHeartbeat {
    #[serde(default)]
    pub containers: Vec<ContainerReport>,
}

/// The RM's answer to a registration or heartbeat.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentReply {
    /// Containers to kill (unknown to the RM, or ended there).
    #[serde(default)]
    pub stop: Vec<String>,
    /// Dead containers whose end the RM recorded: the agent may stop reporting them.
    #[serde(default)]
    pub acknowledged: Vec<String>,
    /// The RM does not know this agent (it restarted, or declared the node LOST):
    /// register again.
    #[serde(default)]
    pub reregister: bool,
    /// How often to heartbeat.
    #[serde(default)]
    pub heartbeat_ms: u64,
    /// In the answer to a registration: this host's key (hex, `super::token::host_key`),
    /// which checks the RM's calls and signs its container starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_key: Option<String>,
}

/// `start` body, RM → agent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentStart {
    pub grant: Grant,
    pub launch_context: LaunchContext,
}

/// A node's peer address must be one its containers' peers can connect to: not
/// `0.0.0.0`/`::` (every interface, no address at all), multicast or broadcast.
pub fn check_node_ip(ip: std::net::IpAddr) -> Result<std::net::IpAddr, String> {
    let broadcast = matches!(ip, std::net::IpAddr::V4(v4) if v4.is_broadcast());
    if ip.is_unspecified() || ip.is_multicast() || broadcast {
        return Err(format!(
            "{ip} is not an address peers can connect to: give the node's own IP on the network its peers share"
        ));
    }
    Ok(ip)
}

/// The address an agent registers, which the RM then calls (with that host's credentials)
/// for starts, stops and logs: `http://HOST:PORT` or `https://HOST:PORT`, nothing more. A
/// path, query, fragment or user name would let one host's token point the RM's calls at
/// a chosen endpoint of another service.
pub fn check_agent_address(address: &str) -> Result<(), String> {
    let url = reqwest::Url::parse(address).map_err(|e| format!("`{address}` is not a URL: {e}"))?;
    let plain = matches!(url.scheme(), "http" | "https")
        && url.host_str().is_some_and(|h| !h.is_empty())
        && url.username().is_empty()
        && url.password().is_none()
        && matches!(url.path(), "" | "/")
        && url.query().is_none()
        && url.fragment().is_none();
    if !plain {
        return Err(format!(
            "`{address}` is not an agent address: give http://HOST:PORT or https://HOST:PORT, with no path, query or user"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_address_is_a_scheme_a_host_and_a_port_only() {
        for ok in ["http://10.0.0.5:8042", "https://gpu1.example:8042/", "http://[::1]:9"] {
            assert_eq!(check_agent_address(ok), Ok(()), "{ok}");
        }
        for bad in [
            "http://169.254.169.254/latest/meta-data",
            "http://10.0.0.5:8042/?x=1",
            "http://user:pw@10.0.0.5:8042",
            "http://10.0.0.5:8042#frag",
            "file:///etc/passwd",
            "gpu1:8042",
            "",
        ] {
            let err = check_agent_address(bad).unwrap_err();
            assert!(
                err.contains("http://HOST:PORT") || err.contains("not a URL"),
                "{bad}: {err}"
            );
        }
    }

    /// The cause is an optional field: an older agent's report (without it) still parses,
    /// and a report without a cause writes none.
    #[test]
    fn an_end_report_carries_its_cause_and_old_reports_still_parse() {
        let old = r#"{"containerId":"c1","state":"COMPLETE","exitStatus":137,"diagnostics":"disk limit exceeded (16 MiB); x"}"#;
        let r: ContainerReport = serde_json::from_str(old).unwrap();
        assert_eq!(r.cause, None);
        assert!(!serde_json::to_string(&r).unwrap().contains("cause"));
        let cause = crate::protocol::EndCause::DiskLimit { limit_mb: 16 };
        let typed = ContainerReport {
            cause: Some(cause),
            ..r
        };
        let back: ContainerReport = serde_json::from_str(&serde_json::to_string(&typed).unwrap()).unwrap();
        assert_eq!(back.cause, Some(cause));
    }

    #[test]
    fn a_node_ip_must_be_one_peers_can_connect_to() {
        for ok in ["10.0.0.7", "127.0.0.1", "fd00::7"] {
            assert!(check_node_ip(ok.parse().unwrap()).is_ok(), "{ok}");
        }
        for bad in ["0.0.0.0", "::", "224.0.0.1", "255.255.255.255"] {
            let e = check_node_ip(bad.parse().unwrap()).unwrap_err();
            assert!(e.contains(bad) && e.contains("not an address"), "{e}");
        }
    }
}
