//! Which RM the job commands talk to and with which token: `--rm` / `--token-file`, else
//! `GPUAM_RM` / `GPUAM_TOKEN`, else the per-user client file
//! (`$XDG_CONFIG_HOME/gpuam/config.yaml`, by default `~/.config/gpuam/config.yaml`, or
//! `$GPUAM_CLIENT_CONFIG`), which `gpuam login` writes (mode 0600) or a person writes
//! by hand:
//!
//! ```yaml
//! rm: http://rm.example:8088
//! token: 3f9c…            # or token_file: /path/to/token
//! ```

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::exit;

/// The variable naming the RM's URL when no `--rm` is given.
pub const RM_ENV: &str = "GPUAM_RM";

/// `--rm` and `--token-file` of every job command.
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct TargetArgs {
    /// The RM's URL (default: $GPUAM_RM, else `rm:` of ~/.config/gpuam/config.yaml).
    #[arg(long, value_name = "URL")]
    pub rm: Option<String>,
    /// File holding your token (default: $GPUAM_TOKEN, else `token:` of the config file).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
}

/// The RM and credential a command uses, and how to say so again in a printed command.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Target {
    pub rm: String,
    pub token: Option<String>,
    /// The flags a follow-up command needs (empty when the environment or the config
    /// file gives both).
    pub flags: String,
}

/// The per-user client file as written.
#[derive(Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct ClientFile {
    rm: Option<String>,
    token: Option<String>,
    token_file: Option<PathBuf>,
}

/// Where the per-user client file is.
pub(crate) fn config_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("GPUAM_CLIENT_CONFIG").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))?;
    Some(base.join("gpuam").join("config.yaml"))
}

/// Reads the client file; `Ok(default)` when there is none.
fn read_client_file(path: &Path) -> Result<ClientFile, String> {
    if !path.exists() {
        return Ok(ClientFile::default());
    }
    let parsed = config::Config::builder()
        .add_source(config::File::from(path).format(config::FileFormat::Yaml))
        .build()
        .and_then(|c| c.try_deserialize::<ClientFile>())
        .map_err(|e| {
            format!(
                "the client file {} is not valid: {e} (it holds `rm: URL` and `token: TOKEN` or `token_file: PATH`; \
                 `gpuam login --rm URL --token-file FILE` rewrites it)",
                path.display()
            )
        })?;
    Ok(parsed)
}

/// Resolves the target of a job command (see the module doc); `Err` is the exit code,
/// after saying what is missing.
pub(crate) fn resolve(args: &TargetArgs) -> Result<Target, i32> {
    let file_path = config_path();
    let file = match &file_path {
        Some(p) => read_client_file(p).map_err(|e| {
            eprintln!("error: {e}");
            exit::USAGE
        })?,
        None => ClientFile::default(),
    };
    let env_rm = std::env::var(RM_ENV).ok().filter(|s| !s.trim().is_empty());
    let mut flags = String::new();
    let rm = match (&args.rm, env_rm, &file.rm) {
        (Some(r), _, _) => {
            flags.push_str(&format!(" --rm {r}"));
            r.clone()
        }
        (None, Some(r), _) => r,
        (None, None, Some(r)) => r.clone(),
        (None, None, None) => {
            eprintln!(
                "error: which RM? give --rm URL, set {RM_ENV}, or run once: gpuam login --rm URL --token-file FILE"
            );
            return Err(exit::USAGE);
        }
    };
    let token = match super::read_token(args.token_file.as_deref(), super::USER_TOKEN_ENV, "token")? {
        Some(t) => {
            if let Some(f) = &args.token_file {
                flags.push_str(&format!(" --token-file {}", f.display()));
            }
            Some(t)
        }
        None => match (&file.token, &file.token_file) {
            (Some(t), _) if !t.trim().is_empty() => Some(t.trim().to_string()),
            (_, Some(f)) => super::read_token(Some(f), super::USER_TOKEN_ENV, "token")?,
            _ => None,
        },
    };
    Ok(Target {
        rm: rm.trim().trim_end_matches('/').to_string(),
        token,
        flags,
    })
}

/// The client file's text for `rm` and `token` (JSON strings are YAML scalars).
fn client_file_text(rm: &str, token: &str) -> String {
    let q = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    format!(
        "# gpuam client settings (written by `gpuam login`): the RM and your token.\nrm: {}\ntoken: {}\n",
        q(rm),
        q(token)
    )
}

/// `gpuam login`: checks the RM and the token, then writes them to the client file
/// (mode 0600).
pub(crate) async fn login(args: &TargetArgs, tls: &crate::config::TlsSettings) -> i32 {
    let Some(rm) = args.rm.clone().or_else(|| std::env::var(RM_ENV).ok()) else {
        eprintln!("error: gpuam login needs --rm URL (the RM's address, e.g. http://rm.example:8088)");
        return exit::USAGE;
    };
    let token = match super::read_token(args.token_file.as_deref(), super::USER_TOKEN_ENV, "token") {
        Ok(Some(t)) => t,
        Ok(None) => {
            eprintln!(
                "error: gpuam login needs --token-file FILE (or {}): the RM's operator makes one with `gpuam token new`",
                super::USER_TOKEN_ENV
            );
            return exit::USAGE;
        }
        Err(code) => return code,
    };
    let target = Target {
        rm: rm.trim().trim_end_matches('/').to_string(),
        token: Some(token.clone()),
        flags: String::new(),
    };
    let api = match super::rm_api::JobsApi::new(&target, tls) {
        Ok(a) => a,
        Err(code) => return code,
    };
    let me = match api.whoami().await {
        Ok(me) => me,
        Err(e) => return super::rm_api::report(&e),
    };
    let Some(path) = config_path() else {
        eprintln!("error: no HOME or XDG_CONFIG_HOME: set GPUAM_CLIENT_CONFIG to the file to write");
        return exit::USAGE;
    };
    let written = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| crate::auth::write_secret(&path, client_file_text(&target.rm, &token).trim_end()));
    if let Err(e) = written {
        eprintln!("error: cannot write {}: {e}", path.display());
        return exit::USAGE;
    }
    println!(
        "logged in to {} as {}{}; saved in {} (mode 0600). Try: gpuam jobs",
        target.rm,
        me.user,
        if me.admin { " (admin)" } else { "" },
        path.display()
    );
    exit::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_written_file_reads_back() {
        let dir = std::env::temp_dir().join(format!("gpuam-target-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.yaml");
        std::fs::write(&path, client_file_text("http://127.0.0.1:8088", "ab\"c: d")).unwrap();
        let f = read_client_file(&path).unwrap();
        assert_eq!(f.rm.as_deref(), Some("http://127.0.0.1:8088"));
        assert_eq!(f.token.as_deref(), Some("ab\"c: d"));
        std::fs::write(&path, "rm: x\ntokn: y\n").unwrap();
        let err = read_client_file(&path).unwrap_err();
        assert!(err.contains("tokn") && err.contains("gpuam login"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
