//! The RM calls of the job commands (`gpuam jobs/status/logs/kill/history/login`), over
//! the RM's REST client (`crate::am::rm_client::RmClient`) with the user's token, and
//! the one mapping of their failures to exit codes and messages.

use serde::Deserialize;
use serde_json::Value;

use crate::am::rm_client::{RmClient, RmError};
use crate::exit;
use crate::protocol::AppReport;
use crate::rm::history::{ContainerRow, HistoryRow};

use super::target::Target;

/// Who the token belongs to (`GET /ws/v1/cluster/whoami`).
#[derive(Debug, Deserialize)]
pub(crate) struct WhoAmI {
    pub user: String,
    pub admin: bool,
}

/// A job with its containers and why it waits (`GET …/apps/{id}/containers`).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct JobDetail {
    pub app: AppReport,
    pub waiting: Waiting,
    pub containers: Vec<ContainerView>,
    pub history: HistoryRow,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Waiting {
    pub since: Option<u64>,
    pub why: Option<String>,
    /// The same, typed (an older RM sends only `why`).
    #[serde(default)]
    pub reason: Option<crate::reason::Reason>,
    /// When it is expected to start, with the basis (issue 27; an older RM sends none).
    #[serde(default)]
    pub estimate: Option<crate::rm::scheduler::reserved::StartEstimate>,
}

impl Waiting {
    /// The line that says why it waits (`Reason::text`, the words every surface shows).
    pub fn line(&self) -> Option<String> {
        self.reason
            .as_ref()
            .map(crate::reason::Reason::text)
            .or_else(|| self.why.clone())
    }
}

/// A container row and whether its node is LOST.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ContainerView {
    #[serde(flatten)]
    pub row: ContainerRow,
    #[serde(default)]
    pub node_lost: bool,
}

/// One answer of the task log route.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct TaskLog {
    pub container_id: String,
    pub offset: u64,
    pub text: String,
    pub complete: bool,
    pub note: String,
}

/// The job commands' client of one RM.
pub(crate) struct JobsApi {
    rm: RmClient,
}

/// Percent-encodes a query value.
fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

impl JobsApi {
    /// A client of `target` trusting the settings' CA; `Err` is the exit code.
    pub(crate) fn new(target: &Target, tls: &crate::config::TlsSettings) -> Result<Self, i32> {
        let rm = RmClient::with_tls(&target.rm, tls).map_err(|e| {
            eprintln!("error: TLS: {e}");
            exit::INVALID_INPUT
        })?;
        Ok(JobsApi {
            rm: rm.with_user_token(target.token.clone()),
        })
    }

    pub(crate) async fn whoami(&self) -> Result<WhoAmI, RmError> {
        self.rm.get_json("whoami", "/ws/v1/cluster/whoami").await
    }

    /// The cluster page's view: live jobs (and the latest finished ones) with their GPUs.
    pub(crate) async fn overview(&self) -> Result<Value, RmError> {
        self.rm.get_json("the job list", "/ws/v1/cluster/overview").await
    }

    pub(crate) async fn apps(&self) -> Result<Vec<AppReport>, RmError> {
        let v: Value = self.rm.get_json("the job list", "/ws/v1/cluster/apps").await?;
        serde_json::from_value(v["apps"]["app"].clone()).map_err(|e| RmError::BadAnswer {
            what: "the job list".into(),
            why: e.to_string(),
        })
    }

    pub(crate) async fn job(&self, id: &str) -> Result<JobDetail, RmError> {
        self.rm
            .get_json("the job's status", &format!("/ws/v1/cluster/apps/{id}/containers"))
            .await
    }

    pub(crate) async fn task_log(
        &self,
        id: &str,
        task: (&str, u32),
        attempt: Option<u32>,
        stream: &str,
        offset: u64,
    ) -> Result<TaskLog, RmError> {
        let mut path = format!(
            "/ws/v1/cluster/apps/{id}/logs/{}/{}?stream={stream}&offset={offset}",
            enc(task.0),
            task.1
        );
        if let Some(a) = attempt {
            path.push_str(&format!("&attempt={a}"));
        }
        self.rm.get_json("the task's log", &path).await
    }

    pub(crate) async fn history(
        &self,
        filters: &[(&str, Option<&str>)],
        limit: usize,
    ) -> Result<Vec<HistoryRow>, RmError> {
        let mut path = format!("/ws/v1/cluster/history?limit={limit}");
        for (k, v) in filters {
            if let Some(v) = v {
                path.push_str(&format!("&{k}={}", enc(v)));
            }
        }
        let v: Value = self.rm.get_json("the history", &path).await?;
        serde_json::from_value(v["history"].clone()).map_err(|e| RmError::BadAnswer {
            what: "the history".into(),
            why: e.to_string(),
        })
    }

    /// Removes a host for good (`DELETE /ws/v1/cluster/nodes/{host}`; the admin's token).
    pub(crate) async fn remove_node(&self, host: &str, force: bool) -> Result<Value, RmError> {
        let path = format!("/ws/v1/cluster/nodes/{}?force={force}", enc(host));
        self.rm.delete_json("the host's removal", &path).await
    }

    /// Kills the job with the user's own token.
    pub(crate) async fn kill(&self, id: &str) -> Result<Value, RmError> {
        let token = self.rm.user_token().unwrap_or_default().to_string();
        self.rm.kill(id, &token).await
    }

    /// The full application id of `arg`: an id as is, or the job number `gpuam jobs`
    /// shows (the newest of the caller's jobs with that number).
    pub(crate) async fn resolve(&self, arg: &str) -> Result<String, i32> {
        let arg = arg.trim();
        if crate::rm::apps::parse_app_id(arg).is_some() {
            return Ok(arg.to_string());
        }
        let Ok(seq) = arg.parse::<u32>() else {
            eprintln!("error: `{arg}` is not a job: give its number as `gpuam jobs` shows it, or its id application_…");
            return Err(exit::USAGE);
        };
        let apps = self.apps().await.map_err(|e| report(&e))?;
        apps.iter()
            .filter(|a| crate::rm::apps::app_seq(&a.id) == Some(seq))
            .max_by_key(|a| a.started_time)
            .map(|a| a.id.clone())
            .ok_or_else(|| {
                eprintln!("error: you have no job {seq} on this RM (`gpuam jobs`, `gpuam history` list yours)");
                exit::NO_SUCH_JOB
            })
    }
}

/// Says why a call failed and gives its exit code (404: no such job).
pub(crate) fn report(e: &RmError) -> i32 {
    eprintln!("error: {}", crate::text::shown(&e.to_string()));
    match e.status() {
        Some(404) => exit::NO_SUCH_JOB,
        Some(401) => {
            eprintln!(
                "hint: give your token with --token-file FILE, GPUAM_TOKEN, or once with `gpuam login --rm URL --token-file FILE`"
            );
            exit::NOT_PERMITTED
        }
        _ => e.exit_code(),
    }
}

/// The job number of an id (`gpuam jobs`' first column).
pub(crate) fn job_number(id: &str) -> String {
    crate::rm::apps::app_seq(id).map_or_else(|| id.to_string(), |s| s.to_string())
}
