//! What `gpuam run` shows of its tasks' output: each task's stdout and stderr streamed to
//! the terminal a line at a time behind a `[role/index]` prefix (as `ray job submit` tails
//! its driver), and the last lines of a failed task's stderr at the end.
//!
//! [`Lines`] is the pure part (bytes as they arrive → whole, printable lines); [`Follow`]
//! keeps one offset per container stream and reads through a [`ReadLog`] (the embedded RM's
//! own node: `gpuam run`'s containers are on this machine).

use std::collections::BTreeMap;

use crate::node::executor::LogStream;

/// Reads at most `max` bytes of a container's stream from an offset; returns them and the
/// file's length now (a length below the offset: the log was cut to its newest part).
pub type ReadLog<'a> = &'a (dyn Fn(&str, LogStream, u64, u64) -> Result<(Vec<u8>, u64), String> + Sync);

/// Most bytes read from one stream per poll.
const READ_CHUNK: u64 = 256 * 1024;
/// An unfinished line longer than this is printed as it is (a progress bar without `\n`).
const MAX_PARTIAL: usize = 16 * 1024;
/// A printed line longer than this many characters is cut, with `…` at the end.
const MAX_LINE_CHARS: usize = 2000;
/// Lines of a failed task's stderr in the final lines.
pub const FAILED_TAIL_LINES: usize = 10;
/// Bytes read from the end of a failed task's stderr for them.
const FAILED_TAIL_BYTES: u64 = 8 * 1024;

/// Splits a stream's bytes into lines, holding an unfinished last line until it ends.
#[derive(Debug, Default)]
pub struct Lines {
    partial: Vec<u8>,
}

impl Lines {
    /// The whole lines that `bytes` completes (with what was held), made printable.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.partial.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(nl) = self.partial.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=nl).collect();
            out.push(printable(&line[..line.len() - 1]));
        }
        if self.partial.len() > MAX_PARTIAL {
            out.push(printable(&std::mem::take(&mut self.partial)));
        }
        out
    }

    /// The unfinished last line, if any (the stream ended without a newline).
    pub fn flush(&mut self) -> Option<String> {
        (!self.partial.is_empty()).then(|| printable(&std::mem::take(&mut self.partial)))
    }
}

/// A task's output line as the terminal gets it: no escape sequences (a task does not
/// drive the user's terminal), a `\r`-rewritten progress line as its last state, cut when
/// very long.
pub fn printable(line: &[u8]) -> String {
    let last = line
        .rsplit(|b| *b == b'\r')
        .find(|p| p.iter().any(|b| !b.is_ascii_whitespace()))
        .unwrap_or(&[]);
    let stripped = strip_ansi_escapes::strip(last);
    let text = String::from_utf8_lossy(&stripped);
    let clean: String = text
        .trim_end()
        .chars()
        .map(|c| if c.is_control() && c != '\t' { '?' } else { c })
        .collect();
    match clean.char_indices().nth(MAX_LINE_CHARS) {
        None => clean,
        Some((cut, _)) => format!("{}…", &clean[..cut]),
    }
}

/// The prefix of a task's lines: `[worker/1]`, `[worker/1 attempt 2]` after a retry.
pub fn prefix(role: &str, index: u64, attempt: u64) -> String {
    if attempt > 1 {
        format!("[{role}/{index} attempt {attempt}]")
    } else {
        format!("[{role}/{index}]")
    }
}

/// One followed stream of one container.
#[derive(Debug)]
struct Stream {
    prefix: String,
    offset: u64,
    lines: Lines,
}

/// Every container stream `gpuam run` follows.
#[derive(Debug, Default)]
pub struct Follow {
    streams: BTreeMap<(String, &'static str), (LogStream, Stream)>,
}

impl Follow {
    /// Starts following a container's stdout and stderr from their beginning (a container
    /// already followed keeps its place).
    pub fn watch(&mut self, container_id: &str, prefix: &str) {
        for s in [LogStream::Stdout, LogStream::Stderr] {
            self.streams
                .entry((container_id.to_string(), s.file_name()))
                .or_insert_with(|| {
                    (
                        s,
                        Stream {
                            prefix: prefix.to_string(),
                            offset: 0,
                            lines: Lines::default(),
                        },
                    )
                });
        }
    }

    /// The new whole lines of every followed stream, prefixed, with the stream each came
    /// from; `ended` containers are read to their end (their unfinished last line too) and
    /// are no longer followed.
    pub fn poll(&mut self, read: ReadLog<'_>, ended: &dyn Fn(&str) -> bool) -> Vec<(LogStream, String)> {
        let mut out = Vec::new();
        let mut done = Vec::new();
        for ((id, name), (stream, s)) in self.streams.iter_mut() {
            let finished = ended(id);
            while let Ok((bytes, len)) = read(id, *stream, s.offset, READ_CHUNK) {
                if len < s.offset {
                    // Cut to its newest part (node.max_log_bytes): the file says so at its start.
                    s.offset = 0;
                    s.lines = Lines::default();
                    continue;
                }
                s.offset += bytes.len() as u64;
                out.extend(
                    s.lines
                        .push(&bytes)
                        .into_iter()
                        .map(|l| (*stream, format!("{} {l}", s.prefix))),
                );
                if bytes.is_empty() || s.offset >= len {
                    break;
                }
            }
            if finished {
                out.extend(s.lines.flush().map(|l| (*stream, format!("{} {l}", s.prefix))));
                done.push((id.clone(), *name));
            }
        }
        for k in done {
            self.streams.remove(&k);
        }
        out
    }
}

/// The last lines of a container's stderr (for a failed task), oldest first.
pub fn stderr_tail(read: ReadLog<'_>, container_id: &str) -> Vec<String> {
    let Ok((_, len)) = read(container_id, LogStream::Stderr, u64::MAX, 0) else {
        return Vec::new();
    };
    let from = len.saturating_sub(FAILED_TAIL_BYTES);
    let Ok((bytes, _)) = read(container_id, LogStream::Stderr, from, FAILED_TAIL_BYTES) else {
        return Vec::new();
    };
    let mut lines: Vec<String> = bytes
        .split(|b| *b == b'\n')
        .skip(usize::from(from > 0))
        .map(printable)
        .filter(|l| !l.trim().is_empty())
        .collect();
    let cut = lines.len().saturating_sub(FAILED_TAIL_LINES);
    lines.drain(..cut);
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::Mutex;
    use std::collections::HashMap;

    #[test]
    fn lines_are_whole_printable_and_held_until_they_end() {
        let mut l = Lines::default();
        assert!(l.push(b"step 1 loss ").is_empty());
        assert_eq!(l.push(b"0.5\nstep 2"), vec!["step 1 loss 0.5"]);
        assert_eq!(
            l.push(b" loss 0.4\n\x1b[31mred\x1b[0m\n10%\r50%\r100%\n"),
            vec!["step 2 loss 0.4", "red", "100%"]
        );
        assert_eq!(l.push(b"no newline"), Vec::<String>::new());
        assert_eq!(l.flush().as_deref(), Some("no newline"));
        assert_eq!(l.flush(), None);
        assert_eq!(printable(b"bell\x07 and \xff bytes"), "bell and \u{fffd} bytes");
        let long = vec![b'x'; MAX_PARTIAL + 1];
        let out = l.push(&long);
        assert_eq!(out.len(), 1);
        assert!(out[0].ends_with('…') && out[0].chars().count() == MAX_LINE_CHARS + 1);
    }

    #[test]
    fn prefixes_name_role_index_and_a_retry() {
        assert_eq!(prefix("worker", 1, 1), "[worker/1]");
        assert_eq!(prefix("worker", 1, 3), "[worker/1 attempt 3]");
    }

    /// Files in memory, keyed by (container, stream).
    struct Files(Mutex<HashMap<(String, &'static str), Vec<u8>>>);

    impl Files {
        fn append(&self, id: &str, s: LogStream, b: &[u8]) {
            self.0
                .lock()
                .entry((id.into(), s.file_name()))
                .or_default()
                .extend_from_slice(b);
        }
        fn replace(&self, id: &str, s: LogStream, b: &[u8]) {
            self.0.lock().insert((id.into(), s.file_name()), b.to_vec());
        }
        fn read(&self, id: &str, s: LogStream, off: u64, max: u64) -> Result<(Vec<u8>, u64), String> {
            let files = self.0.lock();
            let f = files.get(&(id.to_string(), s.file_name())).cloned().unwrap_or_default();
            let len = f.len() as u64;
            let from = off.min(len) as usize;
            let to = (off.saturating_add(max)).min(len) as usize;
            Ok((f[from..to].to_vec(), len))
        }
    }

    #[test]
    fn follow_streams_new_lines_once_survives_a_cut_log_and_drains_ended_ones() {
        let files = Files(Mutex::new(HashMap::new()));
        let read = |id: &str, s: LogStream, off: u64, max: u64| files.read(id, s, off, max);
        let mut f = Follow::default();
        f.watch("c1", "[w/0]");
        f.watch("c2", "[w/1]");
        files.append(
            "c1",
            LogStream::Stdout,
            b"a\nbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
        );
        files.append("c2", LogStream::Stderr, b"pythn: command not found\n");
        let running = |_: &str| false;
        assert_eq!(
            f.poll(&read, &running),
            vec![
                (LogStream::Stdout, "[w/0] a".to_string()),
                (LogStream::Stderr, "[w/1] pythn: command not found".to_string()),
            ]
        );
        assert!(f.poll(&read, &running).is_empty(), "nothing twice");
        // The node cut c1's log to its newest part (shorter than what was read): it is read
        // again from its start, the unfinished line dropped.
        files.replace("c1", LogStream::Stdout, b"[gpuam] log truncated\nz\n");
        assert_eq!(
            f.poll(&read, &running),
            vec![
                (LogStream::Stdout, "[w/0] [gpuam] log truncated".to_string()),
                (LogStream::Stdout, "[w/0] z".to_string()),
            ]
        );
        files.append("c1", LogStream::Stdout, b"last words");
        let c1_ended = |id: &str| id == "c1";
        assert_eq!(
            f.poll(&read, &c1_ended),
            vec![(LogStream::Stdout, "[w/0] last words".to_string())]
        );
        files.append("c1", LogStream::Stdout, b"\nafter the end\n");
        files.append("c2", LogStream::Stdout, b"still here\n");
        assert_eq!(
            f.poll(&read, &running),
            vec![(LogStream::Stdout, "[w/1] still here".to_string())],
            "an ended container is not followed any more"
        );
    }

    #[test]
    fn a_failed_tasks_stderr_tail_is_its_last_lines() {
        let files = Files(Mutex::new(HashMap::new()));
        let read = |id: &str, s: LogStream, off: u64, max: u64| files.read(id, s, off, max);
        let mut text = String::new();
        for i in 0..2000 {
            text.push_str(&format!("line {i}\n"));
        }
        text.push_str("bash: line 1: pythn: command not found\n");
        files.append("c", LogStream::Stderr, text.as_bytes());
        let tail = stderr_tail(&read, "c");
        assert_eq!(tail.len(), FAILED_TAIL_LINES);
        assert_eq!(tail[FAILED_TAIL_LINES - 1], "bash: line 1: pythn: command not found");
        assert_eq!(tail[0], "line 1991");
        assert!(stderr_tail(&read, "none").is_empty());
    }
}
