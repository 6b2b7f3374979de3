//! Credentials shared by every gpuam server and client: fresh tokens, the bearer header
//! (one parser, so the scheme is case-insensitive everywhere: RM, AM dashboard, node
//! agent, Ray gate), constant-time comparison and the SHA-256 digests a users file stores
//! instead of tokens. No I/O; `ring` does the cryptography.

use axum::http::{header, HeaderMap};

/// Bytes of randomness in a token made by [`new_token`].
pub const TOKEN_BYTES: usize = 32;

/// A fresh token: [`TOKEN_BYTES`] random bytes from the operating system, as lower-case hex
/// (64 characters, safe in headers, files and URLs).
pub fn new_token() -> String {
    random_hex::<TOKEN_BYTES>()
}

/// `N` random bytes from the operating system, as lower-case hex (tokens, nonces).
pub fn random_hex<const N: usize>() -> String {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; N];
    if ring::rand::SystemRandom::new().fill(&mut bytes).is_err() {
        // ring's generator only fails when the OS has none; fall back to rand's OsRng,
        // which reads the same source, rather than hand out weak randomness.
        use rand::RngCore;
        rand::rngs::OsRng.fill_bytes(&mut bytes);
    }
    hex(&bytes)
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The HMAC-SHA256 of `msg` under `key`, as lower-case hex (the dashboards' tickets).
pub fn hmac_hex(key: &[u8], msg: &[u8]) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    hex(ring::hmac::sign(&key, msg).as_ref())
}

/// The SHA-256 digest of a token as 64 lower-case hex digits (what a users file stores).
pub fn sha256_hex(token: &str) -> String {
    hex(ring::digest::digest(&ring::digest::SHA256, token.as_bytes()).as_ref())
}

/// Compares two secrets in time that depends only on their lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// How long a dashboard page ticket ([`page_ticket`]) opens a job's dashboard API.
pub const PAGE_TICKET_FOR: std::time::Duration = std::time::Duration::from_secs(600);

/// How long a chain of renewed page tickets lasts from the credential it was first traded
/// for, at most: past it no ticket of the chain is good, and the page must be opened again
/// from a link (twelfth pass: a ticket copied once renewed itself until the job ended, also
/// after its user's token was revoked).
pub const PAGE_TICKET_CHAIN: std::time::Duration = std::time::Duration::from_secs(12 * 3600);

/// A job dashboard's page ticket: what a page holds instead of a token (issue 23, eleventh
/// audit pass). A dashboard's address is a loopback port that another process may take
/// once the job's AM has gone; a page that kept a user's (or the admin's) token would hand
/// it to whoever took the port. A ticket opens only this job's dashboard API, only until
/// `expires` (Unix seconds), and names the user it was made for (`who`, empty when not
/// known: the job token's holder), whom a kill from the page is written down as:
/// `p.<expires>.<born>.<mac>.<who>`, the MAC an HMAC-SHA256 under the job token of all
/// three (the AM and the RM, who both hold it, make them; nobody else can). `born` is when
/// its chain began (a credential traded for the first ticket; a renewal keeps it): no
/// ticket is good past `born` + [`PAGE_TICKET_CHAIN`]. The RM puts one in the cluster
/// page's link to a job of the viewer's; the page trades whatever credential it was opened
/// with for one at once and renews it from the AM.
pub fn page_ticket(job_token: &str, born: u64, expires: u64, who: &str) -> String {
    format!(
        "p.{expires}.{born}.{}.{who}",
        page_ticket_mac(job_token, born, expires, who)
    )
}

fn page_ticket_mac(job_token: &str, born: u64, expires: u64, who: &str) -> String {
    let msg = format!("gpuam-dashboard-page-ticket-v2\n{expires}\n{born}\n{who}");
    hmac_hex(job_token.as_bytes(), msg.as_bytes())
}

/// What a good page ticket says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageTicket {
    /// The user it was made for (empty: not known).
    pub who: String,
    /// When its chain began (Unix seconds).
    pub born: u64,
    /// When it expires (Unix seconds).
    pub expires: u64,
}

impl PageTicket {
    /// When its chain ends: no renewal expires later.
    pub fn chain_ends(&self) -> u64 {
        self.born.saturating_add(PAGE_TICKET_CHAIN.as_secs())
    }
}

/// What a page ticket ([`page_ticket`]) says, when `presented` is one that `job_token`
/// signed, not expired at `now` (Unix seconds), whose chain has not ended; `None` for
/// anything else. No job token: nothing is.
pub fn page_ticket_read(job_token: &str, presented: &str, now: u64) -> Option<PageTicket> {
    if job_token.is_empty() {
        return None;
    }
    let mut parts = presented.splitn(5, '.');
    let (Some("p"), Some(expires), Some(born), Some(mac), Some(who)) =
        (parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    let (expires, born) = (expires.parse::<u64>().ok()?, born.parse::<u64>().ok()?);
    let t = PageTicket {
        who: who.to_string(),
        born,
        expires,
    };
    // A ticket from further ahead than a page ticket lives (a minute of clock skew between
    // the RM and the AM aside) was not made by this code, nor one born after it expires or
    // in the future; one whose chain has ended is good no more.
    let skew = 60;
    let fresh = now < expires
        && expires <= now.saturating_add(PAGE_TICKET_FOR.as_secs() + skew)
        && born <= now.saturating_add(skew)
        && born <= expires
        && now < t.chain_ends();
    (fresh
        && constant_time_eq(
            mac.as_bytes(),
            page_ticket_mac(job_token, born, expires, who).as_bytes(),
        ))
    .then_some(t)
}

/// The user a page ticket ([`page_ticket_read`]) was made for (empty: not known), when it
/// is good at `now`.
pub fn page_ticket_user(job_token: &str, presented: &str, now: u64) -> Option<String> {
    page_ticket_read(job_token, presented, now).map(|t| t.who)
}

/// Whether `presented` is a page ticket of `job_token`'s job, good at `now`.
pub fn page_ticket_valid(job_token: &str, presented: &str, now: u64) -> bool {
    page_ticket_user(job_token, presented, now).is_some()
}

/// The token of an `Authorization: Bearer <token>` header. The scheme is matched without
/// regard to case (RFC 9110 §11.1); surrounding blanks are ignored; an empty token is none.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, token) = v.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The secret an earlier [`write_secret`] left at `path`: `None` when there is no such
/// file or it holds nothing. The file is read only where it is a regular file of this
/// process's user that nobody else can read or write (never through a link); anything else
/// is an error that names the fix, not a secret to trust.
pub fn read_kept_secret(path: &std::path::Path) -> std::io::Result<Option<String>> {
    use std::os::unix::fs::MetadataExt as _;
    let f = match open_regular(path, libc::O_NOFOLLOW) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        r => r?,
    };
    let meta = f.metadata()?;
    // SAFETY: plain syscall.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me || meta.mode() & 0o077 != 0 {
        return Err(std::io::Error::other(format!(
            "{} is not a file of this user readable by it alone (mode {:o}, uid {}): remove it, and a new one is written",
            path.display(),
            meta.mode() & 0o7777,
            meta.uid()
        )));
    }
    let t = read_bounded(f)?;
    Ok((!t.is_empty()).then_some(t))
}

/// Most bytes of a token file read (a token is 64 hex digits; a users file line more).
const TOKEN_FILE_MAX: u64 = 64 << 10;

/// The token in the file `path` (trimmed; an error when empty): a regular file only (a
/// FIFO or a device such as `/dev/zero` is refused at once instead of blocking or reading
/// forever), read up to 64 KiB.
pub fn read_token_file(path: &std::path::Path) -> std::io::Result<String> {
    let t = read_bounded(open_regular(path, 0)?)?;
    if t.is_empty() {
        return Err(std::io::Error::other("the file is empty"));
    }
    Ok(t)
}

/// Opens `path` for reading without blocking on a FIFO, and only if it is a regular file.
fn open_regular(path: &std::path::Path, flags: i32) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags | libc::O_NONBLOCK)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::other(
            "not a regular file (a FIFO, a device or a directory): give a file that holds the token",
        ));
    }
    Ok(f)
}

/// The trimmed text of `f`, up to [`TOKEN_FILE_MAX`] bytes.
fn read_bounded(f: std::fs::File) -> std::io::Result<String> {
    use std::io::Read as _;
    let mut text = String::new();
    f.take(TOKEN_FILE_MAX).read_to_string(&mut text)?;
    Ok(text.trim().to_string())
}

/// Writes a secret to a fresh file readable by its owner only (0600 from creation,
/// so there is no window where others could read it), followed by a newline.
pub fn write_secret(path: &std::path::Path, secret: &str) -> std::io::Result<()> {
    write_private(path, format!("{secret}\n").as_bytes())
}

/// Replaces `path` with `bytes` so that a reader, or a crash, sees the old file or the new
/// one and never a part: the bytes go to a fresh 0600 temporary beside it (created with
/// `O_EXCL`, so a link planted under that name is not followed), are synced, and the
/// temporary is renamed over `path`.
pub fn write_private(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.{}.tmp", std::process::id(), &new_token()[..8]));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn with_auth(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        h
    }

    #[test]
    fn a_page_ticket_opens_only_its_jobs_dashboard_and_only_for_a_while() {
        let now = 1_000_000;
        let t = page_ticket("job-a", now, now + 60, "alice");
        assert!(page_ticket_valid("job-a", &t, now));
        assert_eq!(page_ticket_user("job-a", &t, now).as_deref(), Some("alice"));
        let anyone = page_ticket("job-a", now, now + 60, "");
        assert_eq!(page_ticket_user("job-a", &anyone, now).as_deref(), Some(""));
        let renamed = t.replacen(".alice", ".admin", 1);
        assert!(!page_ticket_valid("job-a", &renamed, now), "its user altered");
        assert!(!page_ticket_valid("job-b", &t, now), "another job's");
        assert!(!page_ticket_valid("job-a", &t, now + 60), "expired");
        assert!(!page_ticket_valid("", &t, now), "no job token");
        // A forged or altered ticket, one from further ahead than a ticket lives, or any
        // other credential.
        let later = page_ticket("job-a", now, now + PAGE_TICKET_FOR.as_secs() + 3600, "alice");
        assert!(!page_ticket_valid("job-a", &later, now));
        let altered = t.replacen(&format!("{}", now + 60), &format!("{}", now + 61), 1);
        assert!(!page_ticket_valid("job-a", &altered, now));
        let reborn = t.replacen(&format!(".{now}."), &format!(".{}.", now + 1), 1);
        assert!(!page_ticket_valid("job-a", &reborn, now), "its chain's start altered");
        // A chain lasts PAGE_TICKET_CHAIN from its start, whatever a ticket's expiry says;
        // a ticket born in the future or after it expires was not made here.
        let chain = PAGE_TICKET_CHAIN.as_secs();
        let last = page_ticket("job-a", now - chain + 30, now + 60, "alice");
        assert!(page_ticket_valid("job-a", &last, now));
        assert!(!page_ticket_valid("job-a", &last, now + 30), "its chain has ended");
        assert!(!page_ticket_valid(
            "job-a",
            &page_ticket("job-a", now + 3600, now + 60, "alice"),
            now
        ));
        let read = page_ticket_read("job-a", &last, now).unwrap();
        assert_eq!(
            (read.born, read.expires, read.chain_ends()),
            (now - chain + 30, now + 60, now + 30)
        );
        for other in ["job-a", "p.", "p.x.y", &t[..t.len() - 1], ""] {
            assert!(!page_ticket_valid("job-a", other, now), "{other}");
        }
    }

    #[test]
    fn a_secret_replaces_the_file_whole_and_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.secret");
        std::fs::write(&path, "old\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        write_secret(&path, "new").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new\n");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        // Nothing is left beside it.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("s.secret")]);
    }

    #[test]
    fn tokens_are_long_random_hex() {
        let (a, b) = (new_token(), new_token());
        assert_eq!(a.len(), 2 * TOKEN_BYTES);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_ne!(a, b);
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for v in ["Bearer abc", "bearer abc", "BEARER abc", "  bEaReR   abc  "] {
            assert_eq!(bearer(&with_auth(v)), Some("abc"), "{v}");
        }
        for v in ["Basic abc", "Bearer", "Bearer   ", "abc", "Bearerabc"] {
            assert_eq!(bearer(&with_auth(v)), None, "{v}");
        }
        assert_eq!(bearer(&HeaderMap::new()), None);
    }

    #[test]
    fn digests_and_comparison() {
        // sha256("abc"), FIPS 180-2 appendix B.1.
        assert_eq!(
            sha256_hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
    }
}
