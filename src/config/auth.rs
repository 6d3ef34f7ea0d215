//! Authentication settings: CHAP credentials from flags, files and the environment.

use super::*;

/// Shortest CHAP secret accepted (RFC 3720 §8.2.1 asks for at least 96 bits; Windows and
/// several initiators require 12 bytes).
pub(crate) const MIN_SECRET_LEN: usize = 12;
/// Longest CHAP secret accepted (what open-iscsi and libiscsi can store).
pub(crate) const MAX_SECRET_LEN: usize = 255;

pub(crate) fn check_chap_user(user: &str) -> Result<(), String> {
    if user.is_empty() || user.len() > 255 || user.chars().any(|c| c.is_control()) {
        return Err(format!(
            "CHAP user name '{}' must be 1 to 255 printable characters",
            user.escape_debug()
        ));
    }
    Ok(())
}

pub(crate) fn check_secret(secret: &[u8]) -> Result<(), String> {
    if !(MIN_SECRET_LEN..=MAX_SECRET_LEN).contains(&secret.len()) {
        return Err(format!(
            "CHAP secret is {} bytes; it must be {MIN_SECRET_LEN} to {MAX_SECRET_LEN} bytes",
            secret.len()
        ));
    }
    if secret.contains(&0) {
        return Err("CHAP secret contains a NUL byte".into());
    }
    Ok(())
}

/// Read a secret from a file: its content less one trailing newline.
pub(crate) fn read_secret_file(path: &Path) -> Result<Vec<u8>, String> {
    let mut b = std::fs::read(path)
        .map_err(|e| format!("cannot read secret file {}: {e}", path.display()))?;
    if b.ends_with(b"\n") {
        b.pop();
        if b.ends_with(b"\r") {
            b.pop();
        }
    }
    Ok(b)
}

pub(crate) fn read_secret_env(var: &str) -> Result<Vec<u8>, String> {
    std::env::var_os(var)
        .map(|v| {
            use std::os::unix::ffi::OsStrExt;
            v.as_bytes().to_vec()
        })
        .ok_or_else(|| format!("environment variable {var} (CHAP secret) is not set"))
}

/// Parse a credential flag: `USER:SECRET`, where SECRET is `@PATH` (read from a file),
/// `env:VAR` (from the environment) or the secret itself. With `secret_file`, the whole value
/// is the user name (which may then contain ':').
pub(crate) fn parse_credential(
    flag: &str,
    value: &str,
    secret_file: Option<&Path>,
) -> Result<ChapAccount, String> {
    let (user, secret) = match secret_file {
        Some(f) => (
            value,
            read_secret_file(f).map_err(|e| format!("--chap-secret-file: {e}"))?,
        ),
        None => {
            let (user, spec) = value.split_once(':').ok_or_else(|| {
                format!("{flag}: expected USER:SECRET, USER:@FILE or USER:env:VAR")
            })?;
            let secret = if let Some(path) = spec.strip_prefix('@') {
                read_secret_file(Path::new(path)).map_err(|e| format!("{flag}: {e}"))?
            } else if let Some(var) = spec.strip_prefix("env:") {
                read_secret_env(var).map_err(|e| format!("{flag}: {e}"))?
            } else {
                spec.as_bytes().to_vec()
            };
            (user, secret)
        }
    };
    check_chap_user(user).map_err(|e| format!("{flag}: {e}"))?;
    check_secret(&secret).map_err(|e| format!("{flag}: {e}"))?;
    Ok(ChapAccount::new(user, secret))
}

/// Access-control flags for the flag-defined target and for discovery.
#[derive(Debug, Default, Clone)]
pub(crate) struct AuthFlags {
    pub chap: Option<String>,
    pub mutual_chap: Option<String>,
    pub chap_secret_file: Option<PathBuf>,
    pub discovery_chap: Option<String>,
    pub discovery_mutual_chap: Option<String>,
    pub acl: Vec<String>,
    pub discovery_acl: Vec<String>,
}

impl AuthFlags {
    fn access(
        chap: &Option<String>,
        chap_flag: &str,
        secret_file: Option<&Path>,
        mutual: &Option<String>,
        mutual_flag: &str,
        acl: &[String],
        acl_flag: &str,
    ) -> Result<Access, String> {
        let mut a = Access::default();
        if let Some(v) = chap {
            a.chap = Some(parse_credential(chap_flag, v, secret_file)?);
        }
        if let Some(v) = mutual {
            a.mutual_chap = Some(parse_credential(mutual_flag, v, None)?);
        }
        for e in acl {
            a.acl
                .push(AclRule::parse(e).map_err(|e| format!("{acl_flag} {e}"))?);
        }
        a.validate().map_err(|e| format!("{mutual_flag}: {e}"))?;
        Ok(a)
    }

    /// (target access, discovery access)
    pub(crate) fn plan(&self) -> Result<(Access, Access), String> {
        if self.chap_secret_file.is_some() && self.chap.is_none() {
            return Err("--chap-secret-file: needs --chap USER".into());
        }
        let target = Self::access(
            &self.chap,
            "--chap",
            self.chap_secret_file.as_deref(),
            &self.mutual_chap,
            "--mutual-chap",
            &self.acl,
            "--acl",
        )?;
        let discovery = Self::access(
            &self.discovery_chap,
            "--discovery-chap",
            None,
            &self.discovery_mutual_chap,
            "--discovery-mutual-chap",
            &self.discovery_acl,
            "--discovery-acl",
        )?;
        Ok((target, discovery))
    }
}
