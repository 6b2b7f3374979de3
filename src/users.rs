//! The users (DESIGN.md §10), as the RM and the node backends check them: the users file
//! (`gpuam rm --users-file FILE`, setting `rm.users_file`), who presents a token, and adding a
//! user's token to the file (`gpuam token new`).
//!
//! ```yaml
//! users:
//!   alice: {token_sha256: 3a7bd3e2360a3d29eea436fcfb7e44c735d117c42d1c1835420b6b9942dd4f1b}
//!   bob:   {token_sha256: ...}
//! ```
//!
//! The node agents' credentials file (`gpuam rm --nodes-file FILE`, written by `gpuam
//! node-token new`) has the same form with `nodes:` and one entry per host name
//! ([`Table::Nodes`]): each agent has its own token, bound to its host.
//!
//! Tokens are never stored, only their SHA-256 (hex); a presented token is hashed and
//! compared with every entry in constant time. The admin token is not in the file: it is
//! user [`ADMIN_USER`], and that name cannot be given to anyone else. [`Users`] is the table
//! (no I/O); [`load`] and [`add_token`] read and write the file; the RM reloads it when it
//! changes or on SIGHUP (`rm::server`).

use std::path::{Path, PathBuf};

use crate::auth::{constant_time_eq, new_token, sha256_hex};
use crate::spec::yaml::{self, Diags, Value};

/// The user of the admin token.
pub const ADMIN_USER: &str = "admin";

/// Users files larger than this are refused (a few thousand users fit easily).
pub const MAX_USERS_FILE_BYTES: u64 = 4 << 20;

/// Why a users file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum UsersError {
    #[error("users file {}: {why}", path.display())]
    Io { path: PathBuf, why: String },
    #[error("{0}")]
    Invalid(crate::spec::SpecErrors),
    #[error("user name `{0}`: use 1 to 64 letters, digits, `_`, `.` or `-`, starting with a letter or `_`")]
    BadName(String),
    #[error("user name `admin` is the admin token's; choose another name")]
    Reserved,
    #[error("host name `{0}`: use 1 to 253 letters, digits, `_`, `.` or `-`")]
    BadHost(String),
}

/// Which credentials a file holds: users' (`users:`) or node agents' (`nodes:`, by host).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Table {
    Users,
    Nodes,
}

impl Table {
    /// The file's one top-level key.
    pub fn key(self) -> &'static str {
        match self {
            Table::Users => "users",
            Table::Nodes => "nodes",
        }
    }

    fn check_name(self, name: &str) -> Result<(), UsersError> {
        match self {
            Table::Users => check_user_name(name),
            Table::Nodes if crate::protocol::valid_container_id(name) && name.len() <= 253 => Ok(()),
            Table::Nodes => Err(UsersError::BadHost(crate::spec::yaml::clip(name))),
        }
    }

    fn command(self) -> &'static str {
        match self {
            Table::Users => "`gpuam token new --user NAME --users-file THIS-FILE` adds or replaces a user",
            Table::Nodes => "`gpuam node-token new --host HOST --nodes-file THIS-FILE` adds or replaces a host",
        }
    }
}

/// The users and their token digests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Users {
    /// (name, SHA-256 of the token as 32 bytes), in file order.
    entries: Vec<(String, [u8; 32])>,
}

impl Users {
    /// The user whose token this is, if any. Every entry is compared (in constant time),
    /// whether or not an earlier one matched.
    pub fn user_of(&self, token: &str) -> Option<&str> {
        let digest = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
        let mut found = None;
        for (name, hash) in &self.entries {
            if constant_time_eq(digest.as_ref(), hash) && found.is_none() {
                found = Some(name.as_str());
            }
        }
        found
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The user names, in file order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(n, _)| n.as_str())
    }

    /// Adds every user of `other` (replacing one of the same name).
    pub fn merge(&mut self, other: &Users) {
        for (name, hash) in &other.entries {
            match self.entries.iter_mut().find(|(n, _)| n == name) {
                Some(e) => e.1 = *hash,
                None => self.entries.push((name.clone(), *hash)),
            }
        }
    }

    /// The token digest of `name` (a node agent's: what the RM derives its per-host keys
    /// from, see `crate::node::token`).
    pub fn digest_of(&self, name: &str) -> Option<[u8; 32]> {
        self.entries.iter().find(|(n, _)| n == name).map(|(_, h)| *h)
    }

    /// Adds (or replaces) `name` with the digest of `token`.
    pub fn insert_token(&mut self, name: &str, token: &str) -> Result<(), UsersError> {
        self.insert_token_in(Table::Users, name, token)
    }

    fn insert_token_in(&mut self, table: Table, name: &str, token: &str) -> Result<(), UsersError> {
        table.check_name(name)?;
        let hash = digest_bytes(&sha256_hex(token)).unwrap_or([0; 32]);
        match self.entries.iter_mut().find(|(n, _)| n == name) {
            Some(e) => e.1 = hash,
            None => self.entries.push((name.to_string(), hash)),
        }
        Ok(())
    }

    /// Reads a users file's text; every problem is reported with its line and column.
    pub fn parse(text: &str, source: &str) -> Result<Users, UsersError> {
        Self::parse_table(text, source, Table::Users)
    }

    /// Reads a credentials file of `table`'s kind.
    pub fn parse_table(text: &str, source: &str, table: Table) -> Result<Users, UsersError> {
        let doc = yaml::parse(text);
        let mut d = Diags::new(source);
        d.extend_yaml(&doc.issues);
        let key_name = table.key();
        let fix = &format!(
            "write `{key_name}:` with one `NAME: {{token_sha256: HEX}}` per entry ({})",
            table.command()
        );
        let mut users = Users::default();
        let root = match (&doc.root, doc.fatal) {
            (Some(r), false) => r,
            _ => return d.into_result(None).map_err(UsersError::Invalid),
        };
        if let Some(()) = d.map(root, "(document)", fix).map(|_| ()) {
            d.unknown_fields(root, "", &[key_name], &[]);
            match root.get(key_name) {
                None => d.missing(root, "", key_name, fix),
                // `users:` with nothing under it: nobody.
                Some(n) if n.is_null() => {}
                Some(list) => {
                    for (key, entry) in d.map(list, key_name, fix).unwrap_or(&[]) {
                        let path = yaml::join(key_name, &key.text);
                        match table.check_name(&key.text) {
                            Ok(()) => {}
                            Err(e) => {
                                d.at(key.pos, &path, e.to_string(), "rename the entry");
                                continue;
                            }
                        }
                        if d.map(entry, &path, fix).is_none() {
                            continue;
                        }
                        d.unknown_fields(entry, &path, &["token_sha256"], &[("token", "token_sha256")]);
                        let field = yaml::join(&path, "token_sha256");
                        let Some(h) = entry.get("token_sha256") else {
                            d.missing(entry, &path, "token_sha256", "give the SHA-256 of the token");
                            continue;
                        };
                        match (&h.value, digest_bytes(&h.raw)) {
                            (Value::Str(_) | Value::Int(_), Some(hash)) => users.entries.push((key.text.clone(), hash)),
                            _ => d.at(
                                h.pos,
                                &field,
                                "not a SHA-256 digest (64 hex digits)",
                                "store `sha256sum` of the token, never the token itself (`gpuam token new` and \
                                 `gpuam node-token new` do this)",
                            ),
                        }
                    }
                }
            }
        }
        d.into_result(Some(users)).map_err(UsersError::Invalid)
    }

    /// The file's text (what [`add_token`] writes).
    pub fn to_yaml(&self) -> String {
        self.to_yaml_table(Table::Users)
    }

    fn to_yaml_table(&self, table: Table) -> String {
        let mut out = format!(
            "# gpuam {key}: each token is stored as its SHA-256 (never the token).\n# {}.\n{key}:\n",
            table.command(),
            key = table.key()
        );
        for (name, hash) in &self.entries {
            out.push_str(&format!("  {name}: {{token_sha256: {}}}\n", crate::auth::hex(hash)));
        }
        out
    }
}

/// 64 hex digits as 32 bytes.
fn digest_bytes(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim();
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// User names: `^[A-Za-z_][A-Za-z0-9_.-]{0,63}$`, not [`ADMIN_USER`].
pub fn check_user_name(name: &str) -> Result<(), UsersError> {
    let first_ok = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    let rest_ok = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if !first_ok || !rest_ok || name.len() > 64 {
        return Err(UsersError::BadName(crate::spec::yaml::clip(name)));
    }
    if name == ADMIN_USER {
        return Err(UsersError::Reserved);
    }
    Ok(())
}

/// Reads and parses a users file.
pub fn load(path: &Path) -> Result<Users, UsersError> {
    load_table(path, Table::Users)
}

/// Reads and parses a credentials file of `table`'s kind.
pub fn load_table(path: &Path, table: Table) -> Result<Users, UsersError> {
    let io = |why: String| UsersError::Io {
        path: path.to_path_buf(),
        why,
    };
    let meta = std::fs::metadata(path).map_err(|e| io(e.to_string()))?;
    if meta.len() > MAX_USERS_FILE_BYTES {
        return Err(io(format!(
            "{} bytes; users files are limited to {MAX_USERS_FILE_BYTES} bytes",
            meta.len()
        )));
    }
    let text = std::fs::read_to_string(path).map_err(|e| io(e.to_string()))?;
    Users::parse_table(&text, &path.display().to_string(), table)
}

/// Makes a fresh token for `user`, puts its digest into the users file (created 0600 if
/// missing; rewritten atomically: a temporary file in the same directory, synced, renamed
/// over it) and returns the token, which exists nowhere else.
pub fn add_token(path: &Path, user: &str) -> Result<String, UsersError> {
    add_token_to(path, user, Table::Users)
}

/// [`add_token`] for a credentials file of `table`'s kind (`gpuam node-token new`: a host).
pub fn add_token_to(path: &Path, user: &str, table: Table) -> Result<String, UsersError> {
    table.check_name(user)?;
    let io = |why: String| UsersError::Io {
        path: path.to_path_buf(),
        why,
    };
    let mut users = match std::fs::metadata(path) {
        Ok(_) => load_table(path, table)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Users::default(),
        Err(e) => return Err(io(e.to_string())),
    };
    let token = new_token();
    users.insert_token_in(table, user, &token)?;
    if let Err(e) = crate::auth::write_private(path, users.to_yaml_table(table).as_bytes()) {
        return Err(io(format!("cannot write it: {e}")));
    }
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_users_file_maps_tokens_to_users() {
        let text = format!(
            "users:\n  alice: {{token_sha256: {}}}\n  bob:\n    token_sha256: \"{}\"\n",
            sha256_hex("alice-secret"),
            sha256_hex("bob-secret").to_uppercase()
        );
        let users = Users::parse(&text, "users.yaml").unwrap();
        assert_eq!(users.names().collect::<Vec<_>>(), ["alice", "bob"]);
        assert_eq!(users.user_of("alice-secret"), Some("alice"));
        assert_eq!(users.user_of("bob-secret"), Some("bob"));
        assert_eq!(users.user_of("alice-secret "), None);
        assert_eq!(users.user_of(""), None);
        assert!(Users::parse("users:\n", "u").unwrap().is_empty());
    }

    #[test]
    fn problems_are_named_with_line_and_column() {
        let bad = "users:\n  alice: {token_sha256: abc}\n  admin: {token_sha256: x}\n  bob: {token: y}\n";
        let err = Users::parse(bad, "users.yaml").unwrap_err().to_string();
        assert!(
            err.contains("users.yaml:2:") && err.contains("users.alice.token_sha256"),
            "{err}"
        );
        assert!(err.contains("users.yaml:3:") && err.contains("admin token"), "{err}");
        assert!(
            err.contains("users.yaml:4:") && err.contains("did you mean `token_sha256`"),
            "{err}"
        );
        let err = Users::parse("people: {}\n", "u").unwrap_err().to_string();
        assert!(err.contains("unknown field `people`"), "{err}");
    }

    #[test]
    fn token_new_adds_a_hashed_token_to_a_0600_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("users.yaml");
        let alice = add_token(&path, "alice").unwrap();
        let bob = add_token(&path, "bob").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            !text.contains(&alice) && !text.contains(&bob),
            "tokens are never stored"
        );
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let users = load(&path).unwrap();
        assert_eq!(users.user_of(&alice), Some("alice"));
        // A new token for alice replaces the old one.
        let alice2 = add_token(&path, "alice").unwrap();
        let users = load(&path).unwrap();
        assert_eq!((users.user_of(&alice), users.user_of(&alice2)), (None, Some("alice")));
        assert_eq!(users.user_of(&bob), Some("bob"));
        assert_eq!(users.len(), 2);
        assert!(matches!(add_token(&path, "admin"), Err(UsersError::Reserved)));
        assert!(matches!(add_token(&path, "../x"), Err(UsersError::BadName(_))));
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_nodes_file_binds_each_token_to_a_host() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nodes.yaml");
        let gpu1 = add_token_to(&path, "gpu1", Table::Nodes).unwrap();
        let gpu2 = add_token_to(&path, "10-gpu2.rack", Table::Nodes).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\nnodes:\n") && !text.contains(&gpu1), "{text}");
        let nodes = load_table(&path, Table::Nodes).unwrap();
        assert_eq!(nodes.user_of(&gpu1), Some("gpu1"));
        assert_eq!(nodes.user_of(&gpu2), Some("10-gpu2.rack"));
        assert_eq!(
            nodes.digest_of("gpu1").map(|d| crate::auth::hex(&d)),
            Some(sha256_hex(&gpu1))
        );
        assert!(matches!(
            add_token_to(&path, "a/b", Table::Nodes),
            Err(UsersError::BadHost(_))
        ));
        let err = load(&path).unwrap_err().to_string();
        assert!(
            err.contains("unknown field `nodes`"),
            "a nodes file is no users file: {err}"
        );
    }
}
