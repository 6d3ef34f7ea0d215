//! Who may use what: CHAP credentials and ACLs per target and for discovery sessions, and the
//! CSPRNG the login's CHAP challenges come from.
//!
//! * An [`Access`] with no ACL rules admits every initiator; with rules, an initiator must
//!   match one (name pattern and, if given, source network).
//! * An [`Access`] with `chap` requires CHAP (AuthMethod=None is refused); `mutual_chap` is
//!   what the target answers with when the initiator asks for mutual CHAP.
//! * Secrets live in [`Secret`], whose `Debug` never prints them.

use ironsan_proto::chap::ChapCredentials;
use std::net::IpAddr;

/// A CHAP secret. `Debug` prints `<redacted>`; there is no `Display`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Secret(bytes.into())
    }
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        // Best effort (no `unsafe` volatile writes here): do not leave secrets in freed memory.
        for b in self.0.iter_mut() {
            *b = std::hint::black_box(0);
        }
    }
}

/// One CHAP identity: the name (CHAP_N) and the secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChapAccount {
    pub user: String,
    pub secret: Secret,
}

impl ChapAccount {
    pub fn new(user: impl Into<String>, secret: impl Into<Vec<u8>>) -> Self {
        ChapAccount {
            user: user.into(),
            secret: Secret::new(secret),
        }
    }
}

/// The initiator-name half of an ACL rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NamePattern {
    /// Every initiator (`*`).
    Any,
    /// Names starting with this prefix (`iqn.1993-08.org.debian:*`), lower case.
    Prefix(String),
    /// Exactly this name, lower case.
    Exact(String),
}

/// One ACL rule: `INITIATOR[@ADDRESS[/PREFIX]]` (an iSCSI name never contains `@`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AclRule {
    pub initiator: NamePattern,
    /// Source network: address and prefix length.
    pub network: Option<(IpAddr, u8)>,
}

impl AclRule {
    /// Parse `NAME`, `PREFIX*`, `*`, each optionally followed by `@ADDR` or `@ADDR/LEN`.
    pub fn parse(s: &str) -> Result<AclRule, String> {
        let (name, net) = match s.split_once('@') {
            Some((n, a)) => (n, Some(a)),
            None => (s, None),
        };
        let initiator = if name == "*" {
            NamePattern::Any
        } else if let Some(prefix) = name.strip_suffix('*') {
            if prefix.is_empty() || prefix.contains('*') {
                return Err(format!("'{s}': '*' is allowed only alone or at the end"));
            }
            NamePattern::Prefix(prefix.to_ascii_lowercase())
        } else if name.contains('*') {
            return Err(format!("'{s}': '*' is allowed only alone or at the end"));
        } else if ironsan_proto::negotiate::valid_iscsi_name(name) {
            NamePattern::Exact(name.to_ascii_lowercase())
        } else {
            return Err(format!(
                "'{s}': '{name}' is not an iSCSI name (iqn.…, eui.…, naa.…), a prefix ending in '*', or '*'"
            ));
        };
        let network = match net {
            None => None,
            Some(a) => Some(parse_cidr(a).ok_or_else(|| {
                format!("'{s}': '{a}' is not an address or network (e.g. 10.0.0.0/24, fd00::/64)")
            })?),
        };
        Ok(AclRule { initiator, network })
    }

    /// Does this rule admit `initiator` connecting from `peer`?
    pub fn matches(&self, initiator: &str, peer: IpAddr) -> bool {
        let name = initiator.to_ascii_lowercase();
        let name_ok = match &self.initiator {
            NamePattern::Any => true,
            NamePattern::Prefix(p) => name.starts_with(p.as_str()),
            NamePattern::Exact(n) => name == *n,
        };
        name_ok
            && self
                .network
                .is_none_or(|(net, len)| in_network(peer, net, len))
    }
}

/// The rule as [`AclRule::parse`] reads it (names lower case, a network as `ADDR/LEN`).
impl std::fmt::Display for AclRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.initiator {
            NamePattern::Any => f.write_str("*")?,
            NamePattern::Prefix(p) => write!(f, "{p}*")?,
            NamePattern::Exact(n) => f.write_str(n)?,
        }
        match self.network {
            Some((a, len)) if (a.is_ipv4() && len == 32) || (a.is_ipv6() && len == 128) => {
                write!(f, "@{a}")
            }
            Some((a, len)) => write!(f, "@{a}/{len}"),
            None => Ok(()),
        }
    }
}

fn parse_cidr(s: &str) -> Option<(IpAddr, u8)> {
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (s, None),
    };
    let addr: IpAddr = addr
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .ok()?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let len = match len {
        Some(l) => l.parse::<u8>().ok().filter(|&l| l <= max)?,
        None => max,
    };
    Some((addr.to_canonical(), len))
}

fn in_network(peer: IpAddr, net: IpAddr, len: u8) -> bool {
    match (peer.to_canonical(), net) {
        (IpAddr::V4(p), IpAddr::V4(n)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            u32::from(p) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(p), IpAddr::V6(n)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            u128::from(p) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

/// Access control for one target, or for discovery sessions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Access {
    /// Empty: every initiator may log in. Otherwise one rule must match.
    pub acl: Vec<AclRule>,
    /// CHAP the initiator must pass (one-way). `None`: no authentication.
    pub chap: Option<ChapAccount>,
    /// What the target proves itself with when the initiator asks (mutual CHAP).
    pub mutual_chap: Option<ChapAccount>,
}

impl Access {
    /// May `initiator` connecting from `peer` use this target?
    pub fn allows(&self, initiator: &str, peer: IpAddr) -> bool {
        self.acl.is_empty() || self.acl.iter().any(|r| r.matches(initiator, peer))
    }

    /// Is CHAP required?
    pub fn auth_required(&self) -> bool {
        self.chap.is_some()
    }

    /// Configuration checks: mutual CHAP needs one-way CHAP, and the two secrets must differ
    /// (RFC 7143 §12.1.3: a secret used in both directions allows reflection).
    pub fn validate(&self) -> Result<(), String> {
        if let Some(m) = &self.mutual_chap {
            let Some(c) = &self.chap else {
                return Err("mutual_chap needs chap (the initiator's credentials) too".into());
            };
            if c.secret == m.secret {
                return Err(
                    "the CHAP secret and the mutual CHAP secret must differ (RFC 7143 §12.1.3)"
                        .into(),
                );
            }
        }
        for a in self.chap.iter().chain(&self.mutual_chap) {
            if a.user.is_empty() {
                return Err("a CHAP user name cannot be empty".into());
            }
            if a.secret.is_empty() {
                return Err(format!("the CHAP secret of '{}' is empty", a.user));
            }
        }
        Ok(())
    }
}

impl ChapCredentials for Access {
    fn initiator_secret(&self, user: &str) -> Option<Vec<u8>> {
        self.chap
            .as_ref()
            .filter(|c| c.user == user)
            .map(|c| c.secret.expose().to_vec())
    }
    fn target_credentials(&self) -> Option<(String, Vec<u8>)> {
        self.mutual_chap
            .as_ref()
            .map(|m| (m.user.clone(), m.secret.expose().to_vec()))
    }
}

/// Fill `buf` from the operating system's CSPRNG (getrandom(2)). Challenges made from it are
/// unpredictable and, with 32 bytes, never repeat across logins or restarts in practice.
pub fn os_random(buf: &mut [u8]) -> bool {
    getrandom::fill(buf).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn acl_rules_parse_and_match() {
        let r = AclRule::parse("iqn.1993-08.org.debian:01:host1").unwrap();
        assert!(r.matches("iqn.1993-08.org.debian:01:host1", ip("10.0.0.1")));
        assert!(r.matches("IQN.1993-08.org.debian:01:HOST1", ip("10.0.0.1")));
        assert!(!r.matches("iqn.1993-08.org.debian:01:host10", ip("10.0.0.1")));
        let r = AclRule::parse("iqn.1993-08.org.debian:*").unwrap();
        assert!(r.matches("iqn.1993-08.org.debian:01:x", ip("::1")));
        assert!(!r.matches("iqn.2000-01.com.other:x", ip("::1")));
        let r = AclRule::parse("*@10.1.0.0/16").unwrap();
        assert!(r.matches("iqn.x:y", ip("10.1.200.3")));
        assert!(r.matches("iqn.x:y", ip("::ffff:10.1.200.3")));
        assert!(!r.matches("iqn.x:y", ip("10.2.0.1")));
        assert!(!r.matches("iqn.x:y", ip("fd00::1")));
        let r = AclRule::parse("iqn.x:y@fd00::/8").unwrap();
        assert!(r.matches("iqn.x:y", ip("fd12::5")));
        let r = AclRule::parse("*@127.0.0.1").unwrap();
        assert!(r.matches("iqn.x:y", ip("127.0.0.1")));
        assert!(!r.matches("iqn.x:y", ip("127.0.0.2")));
        assert!(AclRule::parse("*@0.0.0.0/0")
            .unwrap()
            .matches("iqn.a:b", ip("8.8.8.8")));
        for bad in [
            "",
            "host",
            "iqn.*.x",
            "**",
            "*@10.0.0.0/33",
            "*@nowhere",
            "iqn.a:b@",
            "*x*",
        ] {
            assert!(AclRule::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn access_validation_refuses_identical_secrets() {
        let mut a = Access {
            chap: Some(ChapAccount::new("u", "secret-123456")),
            mutual_chap: Some(ChapAccount::new("t", "secret-123456")),
            ..Default::default()
        };
        assert!(a.validate().unwrap_err().contains("must differ"));
        a.mutual_chap = Some(ChapAccount::new("t", "other-1234567"));
        assert!(a.validate().is_ok());
        a.chap = None;
        assert!(a.validate().is_err());
    }

    #[test]
    fn secrets_are_never_printed() {
        let a = ChapAccount::new("alice", "hunter2hunter2");
        let s = format!("{a:?}");
        assert!(!s.contains("hunter2") && s.contains("<redacted>"), "{s}");
    }

    #[test]
    fn os_random_gives_fresh_bytes() {
        let (mut a, mut b) = ([0u8; 32], [0u8; 32]);
        assert!(os_random(&mut a) && os_random(&mut b));
        assert_ne!(a, b);
    }
}
