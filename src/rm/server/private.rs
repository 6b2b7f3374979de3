//! The RM's own files in its work dir (a job's spec and its AM's output, the logs it
//! collects from ended tasks) are the RM's user's alone: directories 0700, files 0600.
//! The work dir itself is 0711 where tasks run on this machine (they pass through it to
//! their containers), so a tenant's task could otherwise list every application and read
//! another tenant's collected logs and AM output; those are served only through the
//! owner-checked routes. A link where one of these is expected is refused, never followed
//! (the work dir is its user's own, `node::identity::make_owned_dir`; this is the second
//! line).

use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::Path;

/// Creates `dir` (and its missing parents) and makes `dir` and each of `also` (parents of
/// it under the work dir, already made) 0700, whatever an older RM left them as.
pub(super) fn dir(dir: &Path, also: &[&Path]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for d in std::iter::once(dir).chain(also.iter().copied()) {
        if std::fs::symlink_metadata(d)?.file_type().is_symlink() {
            return Err(std::io::Error::other(format!(
                "{} is a link, not the RM's own directory: refused",
                d.display()
            )));
        }
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// Opens `path` for writing, 0600 when made (`append` or truncated); an existing file is
/// made 0600 too.
pub(super) fn open(path: &Path, append: bool) -> std::io::Result<std::fs::File> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .append(append)
        .truncate(!append)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    Ok(f)
}

/// The last `max` bytes of the RM's own file at `path` as text ([`crate::text::lossy_tail`]),
/// never the whole file: a link is refused, not followed, and only a regular file is read
/// (a pipe would block the reader).
pub(super) fn tail(path: &Path, max: u64) -> std::io::Result<String> {
    use std::io::{Read as _, Seek as _, SeekFrom};
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other(format!("{} is no regular file", path.display())));
    }
    let start = meta.len().saturating_sub(max);
    f.seek(SeekFrom::Start(start))?;
    let mut b = Vec::new();
    f.take(max).read_to_end(&mut b)?;
    Ok(crate::text::lossy_tail(&b, start > 0))
}

/// Writes `bytes` to `path` (0600).
pub(super) fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    open(path, false)?.write_all(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A link planted where the RM's file or directory goes is refused, and what it names is
    /// left as it was (mode and content).
    #[test]
    fn links_in_place_of_the_rms_files_are_refused_not_followed() {
        let t = tempfile::tempdir().unwrap();
        let victim = t.path().join("victim");
        std::fs::write(&victim, "theirs").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::os::unix::fs::symlink(&victim, t.path().join("am.stderr")).unwrap();
        assert!(write(&t.path().join("am.stderr"), b"ours").is_err());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "theirs");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&victim), 0o644);
        let victim_dir = t.path().join("victim-dir");
        std::fs::create_dir(&victim_dir).unwrap();
        std::fs::set_permissions(&victim_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::symlink(&victim_dir, t.path().join("logs")).unwrap();
        assert!(dir(&t.path().join("logs"), &[]).is_err());
        assert_eq!(mode(&victim_dir), 0o755);
        // The RM's own: made 0700 / 0600.
        dir(&t.path().join("own"), &[]).unwrap();
        write(&t.path().join("own/f"), b"x").unwrap();
        assert_eq!(
            (mode(&t.path().join("own")), mode(&t.path().join("own/f"))),
            (0o700, 0o600)
        );
    }
}
