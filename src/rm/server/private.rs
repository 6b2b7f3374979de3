//! The RM's own files in its work dir (a job's spec and its AM's output, the logs it
//! collects from ended tasks) are the RM's user's alone: directories 0700, files 0600.
//! The work dir itself is 0711 where tasks run on this machine (they pass through it to
//! their containers), so a tenant's task could otherwise list every application and read
//! another tenant's collected logs and AM output; those are served only through the
//! owner-checked routes.

use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::Path;

/// Creates `dir` (and its missing parents) and makes `dir` and each of `also` (parents of
/// it under the work dir, already made) 0700, whatever an older RM left them as.
pub(super) fn dir(dir: &Path, also: &[&Path]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for d in std::iter::once(dir).chain(also.iter().copied()) {
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
        .open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    Ok(f)
}

/// Writes `bytes` to `path` (0600).
pub(super) fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    open(path, false)?.write_all(bytes)
}
