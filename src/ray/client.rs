//! The Ray dashboard's REST API, as far as gpuam uses it: the Jobs API (`POST /api/jobs/`,
//! `GET /api/jobs/`, `GET /api/jobs/{id}`, `GET /api/jobs/{id}/logs`,
//! `POST /api/jobs/{id}/stop`) and the node list (`GET /api/v0/nodes?detail=true`).
//!
//! Owns the HTTP calls and the shapes of their bodies, nothing else: which job to submit and
//! what a status means for a container is the launcher's business. Every call has a time
//! limit, and every failure says which call on which address failed and why.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::scheme::RayNode;

/// Longest time one call to the Ray dashboard may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(20);

/// Ray job states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum JobStatus {
    Pending,
    Running,
    Succeeded,
    Failed,
    Stopped,
}

impl JobStatus {
    pub fn is_terminal(self) -> bool {
        matches!(self, JobStatus::Succeeded | JobStatus::Failed | JobStatus::Stopped)
    }
}

/// A job as `GET /api/jobs/{id}` reports it (the fields gpuam reads).
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct JobInfo {
    #[serde(default)]
    pub submission_id: Option<String>,
    pub status: JobStatus,
    #[serde(default)]
    pub message: Option<String>,
    #[serde(default)]
    pub driver_exit_code: Option<i32>,
    #[serde(default)]
    pub driver_node_id: Option<String>,
    #[serde(default)]
    pub start_time: Option<u64>,
    #[serde(default)]
    pub end_time: Option<u64>,
}

/// What `POST /api/jobs/` takes.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct JobSubmit {
    pub entrypoint: String,
    pub submission_id: String,
    pub entrypoint_num_cpus: f64,
    /// Always 0: with more, Ray picks GPUs itself and overrides `CUDA_VISIBLE_DEVICES`.
    pub entrypoint_num_gpus: f64,
    pub entrypoint_resources: BTreeMap<String, f64>,
    pub runtime_env: Value,
    pub metadata: BTreeMap<String, String>,
}

/// How a submit ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Submitted {
    New,
    /// A job with this submission id existed already (an earlier try got through).
    AlreadyExists,
}

#[derive(Debug, thiserror::Error)]
#[error("Ray dashboard {url}: {what}")]
pub struct RayError {
    pub url: String,
    pub what: String,
    /// The HTTP status, when the dashboard answered.
    pub status: Option<u16>,
}

/// A client of one Ray dashboard (`http://HOST:8265`).
#[derive(Clone, Debug)]
pub struct RayClient {
    base: String,
    http: reqwest::Client,
}

impl RayClient {
    /// `address` is the dashboard's URL (`http://HOST:8265`); a bare `HOST:PORT` gets `http://`.
    pub fn new(address: &str) -> Result<Self, String> {
        let a = address.trim().trim_end_matches('/');
        if a.is_empty() {
            return Err("--ray-address is empty: give the Ray dashboard's URL, e.g. http://HOST:8265".into());
        }
        let base = if a.contains("://") {
            a.to_string()
        } else {
            format!("http://{a}")
        };
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(format!(
                "--ray-address `{address}`: use http://HOST:PORT or https://HOST:PORT"
            ));
        }
        let http = crate::tls::http_client_builder(None)
            .map_err(|e| e.to_string())?
            .timeout(CALL_TIMEOUT)
            .build()
            .map_err(|e| format!("cannot build an HTTP client: {e}"))?;
        Ok(RayClient { base, http })
    }

    pub fn address(&self) -> &str {
        &self.base
    }

    fn err(&self, path: &str, what: impl std::fmt::Display, status: Option<u16>) -> RayError {
        RayError {
            url: format!("{}{path}", self.base),
            what: what.to_string(),
            status,
        }
    }

    /// Sends a request; an answer other than 2xx is an error carrying status and body.
    async fn call(&self, req: reqwest::RequestBuilder, path: &str) -> Result<String, RayError> {
        let resp = req.send().await.map_err(|e| self.err(path, e, None))?;
        let status = resp.status();
        let body = resp
            .text()
            .await
            .map_err(|e| self.err(path, e, Some(status.as_u16())))?;
        if !status.is_success() {
            let first = body.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
            return Err(self.err(path, format!("HTTP {status}: {first}"), Some(status.as_u16())));
        }
        Ok(body)
    }

    async fn get_json<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, RayError> {
        let body = self.call(self.http.get(format!("{}{path}", self.base)), path).await?;
        serde_json::from_str(&body).map_err(|e| self.err(path, format!("unexpected answer: {e}"), None))
    }

    /// `GET /api/version`: reachable and a Ray dashboard.
    pub async fn version(&self) -> Result<String, RayError> {
        let v: Value = self.get_json("/api/version").await?;
        Ok(v.get("ray_version")
            .and_then(Value::as_str)
            .unwrap_or("unknown")
            .to_string())
    }

    /// Submits a job. A duplicate `submission_id` (Ray answers 500 "already exists") is
    /// [`Submitted::AlreadyExists`], which makes a retried submit idempotent.
    pub async fn submit(&self, job: &JobSubmit) -> Result<Submitted, RayError> {
        let path = "/api/jobs/";
        match self
            .call(self.http.post(format!("{}{path}", self.base)).json(job), path)
            .await
        {
            Ok(_) => Ok(Submitted::New),
            Err(e) if e.what.contains("already exists") => Ok(Submitted::AlreadyExists),
            Err(e) => Err(e),
        }
    }

    /// `GET /api/jobs/{id}`; `Ok(None)` for a job Ray does not know (404).
    pub async fn job(&self, id: &str) -> Result<Option<JobInfo>, RayError> {
        match self.get_json(&format!("/api/jobs/{id}")).await {
            Ok(j) => Ok(Some(j)),
            Err(e) if e.status == Some(404) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `GET /api/jobs/`: every submission Ray knows, by submission id.
    pub async fn jobs(&self) -> Result<BTreeMap<String, JobInfo>, RayError> {
        let list: Vec<JobInfo> = self.get_json("/api/jobs/").await?;
        Ok(list
            .into_iter()
            .filter_map(|j| Some((j.submission_id.clone()?, j)))
            .collect())
    }

    /// `POST /api/jobs/{id}/stop`: true when the job was still live.
    pub async fn stop(&self, id: &str) -> Result<bool, RayError> {
        let path = format!("/api/jobs/{id}/stop");
        let body = self.call(self.http.post(format!("{}{path}", self.base)), &path).await?;
        let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        Ok(v.get("stopped").and_then(Value::as_bool).unwrap_or(false))
    }

    /// `GET /api/jobs/{id}/logs`: the driver's output (stdout and stderr together).
    pub async fn logs(&self, id: &str) -> Result<String, RayError> {
        let v: Value = self.get_json(&format!("/api/jobs/{id}/logs")).await?;
        Ok(v.get("logs").and_then(Value::as_str).unwrap_or("").to_string())
    }

    /// `GET /api/v0/nodes?detail=true`: every Ray node, alive or dead.
    pub async fn nodes(&self) -> Result<Vec<RayNode>, RayError> {
        let path = "/api/v0/nodes?detail=true&limit=10000";
        let v: Value = self.get_json(path).await?;
        let list = v
            .pointer("/data/result/result")
            .cloned()
            .ok_or_else(|| self.err(path, "no data.result.result in the answer", None))?;
        serde_json::from_value(list).map_err(|e| self.err(path, format!("unexpected node entry: {e}"), None))
    }
}
