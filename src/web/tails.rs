//! The last lines of many tasks' logs in one call (`GET /api/v1/tails`), so that the
//! dashboard's task table can show each worker's latest output (a training loss falling)
//! without one request per task.
//!
//! `last_lines` is the pure part (text → the last non-empty lines, each clipped); the
//! handler picks the tasks, reads their stdout tails through the hub's [`LogSource`]
//! (a few at a time) and answers one JSON object.
//!
//! [`LogSource`]: crate::am::status::LogSource

use std::collections::HashMap;

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Serialize;

use super::api::{Hub, Params};
use super::{json_ok, ApiError};

/// Lines per task when the query does not say.
pub const DEFAULT_LINES: usize = 3;
/// Most lines per task.
pub const MAX_LINES: usize = 20;
/// Most tasks per call.
pub const MAX_TASKS: usize = 200;
/// Bytes read from the end of a log per wanted line (a line longer than this is cut).
const BYTES_PER_LINE: u64 = 512;
/// A line longer than this many characters is cut, with `…` at the end.
pub const MAX_LINE_CHARS: usize = 300;
/// Logs read at the same time.
const CONCURRENT_READS: usize = 8;

/// The last `n` non-blank lines of `text`, oldest first, each cut to
/// [`MAX_LINE_CHARS`] characters (`\r` progress-bar rewrites keep only their last part).
pub fn last_lines(text: &str, n: usize) -> Vec<String> {
    let mut out: Vec<String> = text
        .lines()
        .rev()
        .map(|l| l.rsplit('\r').find(|p| !p.trim().is_empty()).unwrap_or(""))
        .filter(|l| !l.trim().is_empty())
        .take(n)
        .map(clip)
        .collect();
    out.reverse();
    out
}

fn clip(line: &str) -> String {
    match line.char_indices().nth(MAX_LINE_CHARS) {
        None => line.to_string(),
        Some((cut, _)) => format!("{}…", &line[..cut]),
    }
}

/// One task's answer.
#[derive(Serialize, Debug)]
#[serde(rename_all = "camelCase")]
struct Tail {
    role: String,
    index: u32,
    container_id: String,
    /// Oldest first.
    lines: Vec<String>,
    /// Why the log could not be read (then `lines` is empty).
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

#[derive(Serialize)]
struct Tails {
    tails: Vec<Tail>,
}

/// `tasks=role/index,...` (at most [`MAX_TASKS`]); absent = every task with a container,
/// in the API's order, up to [`MAX_TASKS`].
fn wanted_tasks(q: &HashMap<String, String>) -> Result<Option<Vec<(String, u32)>>, ApiError> {
    let Some(list) = q.get("tasks").filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    let mut out = Vec::new();
    for item in list.split(',').filter(|s| !s.is_empty()) {
        let parsed = item
            .rsplit_once('/')
            .and_then(|(r, i)| Some((r.to_string(), i.parse::<u32>().ok()?)));
        let Some(task) = parsed else {
            return Err(ApiError::bad_request(
                "invalid_parameter",
                format!("query parameter `tasks` takes role/index items separated by commas, got {item:?}"),
            ));
        };
        out.push(task);
    }
    if out.len() > MAX_TASKS {
        return Err(ApiError::bad_request(
            "invalid_parameter",
            format!(
                "query parameter `tasks` names {} tasks; at most {MAX_TASKS} per call",
                out.len()
            ),
        ));
    }
    Ok(Some(out))
}

fn wanted_lines(q: &HashMap<String, String>) -> Result<usize, ApiError> {
    match q.get("lines").filter(|v| !v.is_empty()) {
        None => Ok(DEFAULT_LINES),
        Some(v) => match v.parse::<usize>() {
            Ok(n) if (1..=MAX_LINES).contains(&n) => Ok(n),
            _ => Err(ApiError::bad_request(
                "invalid_parameter",
                format!("query parameter `lines` must be a number from 1 to {MAX_LINES}, got {v:?}"),
            )),
        },
    }
}

/// `GET /api/v1/tails?lines=N&tasks=role/index,...`: the last lines of each named task's
/// stdout (tasks without a container are left out).
pub(crate) async fn tails(State(hub): Hub, Query(q): Params) -> Response {
    let run = async {
        let lines = wanted_lines(&q)?;
        let wanted = wanted_tasks(&q)?;
        let targets: Vec<(String, u32, String)> = hub.read(|s| {
            let with_container =
                |t: &crate::am::status::TaskStatus| t.container_id.clone().map(|c| (t.role.clone(), t.index, c));
            match &wanted {
                None => s.tasks.iter().filter_map(with_container).take(MAX_TASKS).collect(),
                Some(list) => list
                    .iter()
                    .filter_map(|(r, i)| s.tasks.iter().find(|t| &t.role == r && t.index == *i))
                    .filter_map(with_container)
                    .collect(),
            }
        });
        let bytes = BYTES_PER_LINE * lines as u64;
        let tails: Vec<Tail> = futures::stream::iter(targets)
            .map(|(role, index, container_id)| {
                let read = hub.logs.read(&container_id, "stdout", bytes);
                async move {
                    let (lines, error) = match read.await {
                        Ok(text) => (last_lines(&text, lines), None),
                        Err(e) => (Vec::new(), Some(e)),
                    };
                    Tail {
                        role,
                        index,
                        container_id,
                        lines,
                        error,
                    }
                }
            })
            .buffered(CONCURRENT_READS)
            .collect()
            .await;
        Ok::<_, ApiError>(json_ok(&Tails { tails }))
    };
    run.await.unwrap_or_else(|e| e.into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn keeps_the_last_non_blank_lines_in_order() {
        let text = "step 1 loss 2.0\nstep 2 loss 1.0\n\n  \nstep 3 loss 0.5\n";
        assert_eq!(last_lines(text, 2), vec!["step 2 loss 1.0", "step 3 loss 0.5"]);
        assert_eq!(last_lines(text, 10).len(), 3);
        assert!(last_lines("", 3).is_empty());
        // A progress bar redrawn with \r shows its latest state.
        assert_eq!(last_lines("10%\r50%\r90%\n", 1), vec!["90%"]);
    }

    #[test]
    fn long_lines_are_cut_at_a_character() {
        let long = "é".repeat(MAX_LINE_CHARS + 10);
        let got = last_lines(&long, 1);
        assert_eq!(got[0].chars().count(), MAX_LINE_CHARS + 1);
        assert!(got[0].ends_with('…'));
    }

    proptest! {
        #[test]
        fn never_more_than_asked_and_always_a_suffix(
            lines in proptest::collection::vec("[a-z0-9 ]{0,20}", 0..30),
            n in 1usize..10,
        ) {
            let text = lines.join("\n");
            let got = last_lines(&text, n);
            let non_blank: Vec<&str> = lines.iter().map(String::as_str).filter(|l| !l.trim().is_empty()).collect();
            prop_assert_eq!(got.len(), n.min(non_blank.len()));
            prop_assert_eq!(&got[..], &non_blank[non_blank.len() - got.len()..]);
        }
    }
}
