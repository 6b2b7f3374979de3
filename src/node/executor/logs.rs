//! A container's captured `stdout` and `stderr`: reading them (a tail, or from an offset,
//! never through a link, never more than [`MAX_LOG_BYTES`]) and keeping them within
//! `node.max_log_bytes` while the container runs ([`watch_logs`], [`cap_log`]).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::files::open_log_in_place;
use super::Executor;
use crate::node::NodeError;

/// Which captured stream to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogStream {
    Stdout,
    Stderr,
}

impl LogStream {
    /// The fixed file name of the stream inside the container directory.
    pub fn file_name(self) -> &'static str {
        match self {
            LogStream::Stdout => "stdout",
            LogStream::Stderr => "stderr",
        }
    }
}

/// The most a single `read_log` returns: a larger file (or a larger tail) is cut to its
/// last `MAX_LOG_BYTES` bytes, so a huge log never ends up in memory whole.
pub const MAX_LOG_BYTES: u64 = 8 * 1024 * 1024;

/// How often a running container's log sizes are checked.
pub const LOG_CHECK: Duration = Duration::from_millis(250);

/// The most of a log's newest bytes kept when it is cut (a quarter of the limit when that
/// is less).
pub const LOG_KEEP_MAX: u64 = 4 << 20;

impl Executor {
    /// Reads a captured stream; `tail_bytes` limits to the last N bytes.
    ///
    /// Only `root/<validated id>/stdout|stderr` can be read. The text is lossy UTF-8; a tail
    /// starts on a character boundary (so it can be up to 3 bytes shorter than asked). At
    /// most [`MAX_LOG_BYTES`] come back (the file's end); the file is seeked, never read
    /// whole. A known container that has written nothing yet gives `""`.
    pub fn read_log(
        &self,
        container_id: &str,
        stream: LogStream,
        tail_bytes: Option<u64>,
    ) -> Result<String, NodeError> {
        let dir = self.log_dir(container_id)?;
        let want = tail_bytes.unwrap_or(MAX_LOG_BYTES).min(MAX_LOG_BYTES);
        match read_tail(&dir.join(stream.file_name()), want) {
            Ok(text) => Ok(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
            Err(e) => Err(e.into()),
        }
    }

    /// At most `max` bytes of a container's stream from byte `offset`, and the file's length
    /// now (how `gpuam run` follows a task's output). A length below `offset` means the log
    /// was cut to its newest part (`node.max_log_bytes`): read it again from 0.
    pub fn read_log_from(
        &self,
        container_id: &str,
        stream: LogStream,
        offset: u64,
        max: u64,
    ) -> Result<(Vec<u8>, u64), NodeError> {
        let dir = self.log_dir(container_id)?;
        let read = || -> std::io::Result<(Vec<u8>, u64)> {
            let mut f = open_log_in_place(&dir.join(stream.file_name()), false)?;
            let len = f.metadata()?.len();
            if offset >= len {
                return Ok((Vec::new(), len));
            }
            f.seek(SeekFrom::Start(offset))?;
            let mut buf = Vec::new();
            f.take(max.min(MAX_LOG_BYTES)).read_to_end(&mut buf)?;
            Ok((buf, len))
        };
        match read() {
            Ok(v) => Ok(v),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((Vec::new(), 0)),
            Err(e) => Err(e.into()),
        }
    }

    /// The directory of a container whose logs are read: known, and a real directory (the
    /// container's directory itself must not have been swapped for a link).
    pub(super) fn log_dir(&self, container_id: &str) -> Result<PathBuf, NodeError> {
        let dir = self
            .container_dir(container_id)
            .ok_or_else(|| NodeError::UnknownContainer(container_id.into()))?;
        if std::fs::symlink_metadata(&dir).is_ok_and(|m| !m.is_dir()) {
            return Err(NodeError::Io(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!("{} is not a directory; refusing to read logs through it", dir.display()),
            )));
        }
        Ok(dir)
    }
}

/// Keeps the logs in `files` within `max` bytes each until the container is done (then
/// once more): see the module doc.
pub(super) async fn watch_logs(files: Arc<Vec<File>>, max: u64, mut done: watch::Receiver<bool>) {
    loop {
        let finished = tokio::select! {
            _ = tokio::time::sleep(LOG_CHECK) => *done.borrow(),
            changed = done.changed() => changed.is_err() || *done.borrow(),
        };
        let f = files.clone();
        let cut = tokio::task::spawn_blocking(move || f.iter().map(|f| cap_log(f, max)).collect::<Vec<_>>()).await;
        for r in cut.into_iter().flatten() {
            if let Err(e) = r {
                tracing::warn!("cannot keep a container log within node.max_log_bytes: {e}");
            }
        }
        if finished {
            return;
        }
    }
}

/// Cuts one log over `max` bytes to its newest part behind a line saying so; returns the
/// bytes dropped (0: under the limit).
pub fn cap_log(f: &File, max: u64) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let len = f.metadata()?.len();
    if len <= max {
        return Ok(0);
    }
    let keep = (max / 4).min(LOG_KEEP_MAX);
    let mut tail = vec![0u8; keep as usize];
    let got = f.read_at(&mut tail, len - keep)?;
    tail.truncate(got);
    // Start the kept part on a line (or at least a character) boundary.
    let start = tail
        .iter()
        .position(|b| *b == b'\n')
        .map(|i| i + 1)
        .filter(|i| *i < tail.len())
        .unwrap_or_else(|| tail.iter().position(|b| (b & 0xC0) != 0x80).unwrap_or(0));
    let kept = &tail[start..];
    let dropped = len - kept.len() as u64;
    f.set_len(0)?;
    // The handle shares the task's O_APPEND description: these land at the new start.
    let note = format!(
        "[gpuam] log truncated: {dropped} bytes dropped (node.max_log_bytes = {max}); the newest {} bytes follow\n",
        kept.len()
    );
    (&*f).write_all(note.as_bytes())?;
    (&*f).write_all(kept)?;
    Ok(dropped)
}

/// The last `want` bytes of a file (seeking, not reading it whole), lossy UTF-8, starting
/// on a character boundary when cut. The file must be a regular file in place (see
/// [`open_log_in_place`]).
pub(super) fn read_tail(path: &Path, want: u64) -> std::io::Result<String> {
    let mut f = open_log_in_place(path, false)?;
    let meta = f.metadata()?;
    let len = meta.len();
    let start = len.saturating_sub(want);
    f.seek(SeekFrom::Start(start))?;
    let mut buf = Vec::with_capacity(usize::try_from(want.min(len)).unwrap_or(0));
    f.take(want).read_to_end(&mut buf)?;
    Ok(crate::text::lossy_tail(&buf, start > 0))
}
