//! `[limits]`: the resource limits and data-path switches of a server (docs/SECURITY.md,
//! docs/CONFIG.md). One type serves the configuration file (serde, the file's units: seconds,
//! sizes like `"64M"`, durations like `"10s"`, `"on"`/`"off"`), the server ([`crate::ServerConfig::limits`])
//! and `ironsan ctl save` (serialized back in the same units). [`BOUNDS`] is the one table of
//! the allowed range of each numeric key, checked by [`Limits::check`].

use crate::ZeroCopyReads;
use ironsan_backend::IoEngine;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The limits; `Default` is what a server runs with when the file says nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// A login must complete within this time (whole seconds in the file).
    #[serde(with = "secs")]
    pub login_timeout: Duration,
    /// Idle time before the target pings the initiator with a NOP-In; zero: never.
    #[serde(with = "secs")]
    pub nop_interval: Duration,
    /// Drop the connection if a ping is not answered within this time.
    #[serde(with = "secs")]
    pub nop_timeout: Duration,
    /// Connections the server holds at once (any state). A login beyond it fails with 0302
    /// (out of resources); a few more are accepted only to say so, the rest closed at once.
    pub max_connections: usize,
    /// Sessions (normal and discovery) at once; a new one beyond it: 0302.
    pub max_sessions: usize,
    /// Sessions one initiator name may have at once; a new one beyond it: 0302.
    pub max_sessions_per_initiator: usize,
    /// Bytes of write data a session may have buffered (sum of the EDTL of its writes from
    /// arrival to completion). A write beyond it ends with TASK SET FULL. At least the largest
    /// transfer, so a write alone always fits.
    #[serde(with = "size")]
    pub write_buffer_per_session: u64,
    /// R2Ts outstanding at once over all the writes of a connection (on top of
    /// MaxOutstandingR2T per task); further R2Ts wait until data arrives.
    pub max_r2ts_per_connection: usize,
    /// Bytes of read data a connection may have between the backend and the socket; a read
    /// waits (holding its CmdSN slot, so MaxCmdSN stops advancing) until the writer has sent
    /// enough. Bounds what an initiator that never reads can make the target hold.
    #[serde(with = "size")]
    pub tx_buffer_per_connection: u64,
    /// On shutdown: how long to wait, after asking every initiator to log out (Async
    /// Message), for in-flight commands to finish and sessions to log out before the
    /// remaining connections are closed.
    #[serde(with = "duration")]
    pub shutdown_grace: Duration,
    /// Opt-in busy polling (`busy_poll_us` in the file): before a connection's reader waits
    /// for the socket, it keeps trying to receive for this long (yielding to other tasks in
    /// between). Cuts QD1 latency by avoiding the sleep and wake-up per command, at the price
    /// of a core spinning while initiators are active. Zero (the default): never poll.
    #[serde(rename = "busy_poll_us", with = "micros")]
    pub busy_poll: Duration,
    /// How large reads of file LUNs avoid a copy through a buffer ([`ZeroCopyReads`]).
    #[serde(with = "text")]
    pub zero_copy_reads: ZeroCopyReads,
    /// Whether large writes to file LUNs on tmpfs/ramfs receive their Data-Out straight into
    /// the file's pages (no copy through a buffer) when a connection has no data digest.
    #[serde(with = "on_off")]
    pub zero_copy_writes: bool,
    /// The connection fairness control ([`crate::iscsi::fair`]): the connections of a session with
    /// several move data in equal shares.
    #[serde(with = "on_off")]
    pub connection_fairness: bool,
    /// What runs file LUNs' I/O that may block (process-wide, fixed at start; the binary
    /// applies it, the server does not read it).
    #[serde(with = "text")]
    pub io_engine: IoEngine,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            login_timeout: Duration::from_secs(15),
            nop_interval: Duration::from_secs(15),
            nop_timeout: Duration::from_secs(30),
            max_connections: 1024,
            max_sessions: 512,
            max_sessions_per_initiator: 32,
            write_buffer_per_session: 64 << 20,
            max_r2ts_per_connection: 256,
            tx_buffer_per_connection: 64 << 20,
            shutdown_grace: Duration::from_secs(10),
            busy_poll: Duration::ZERO,
            zero_copy_reads: ZeroCopyReads::Auto,
            zero_copy_writes: true,
            connection_fairness: true,
            io_engine: IoEngine::Auto,
        }
    }
}

/// The allowed range of a numeric key, in the file's unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    pub key: &'static str,
    pub min: u64,
    pub max: u64,
    /// How the file writes it: seconds, bytes (as a size), milliseconds (as a duration),
    /// microseconds, or a plain count.
    pub unit: &'static str,
}

/// The largest transfer a command may carry: the floor of both buffer limits.
const MAX_IO: u64 = ironsan_scsi::MAX_TRANSFER_BYTES as u64;

/// Every numeric key with its range, checked in one place ([`Limits::check`]).
pub const BOUNDS: [Bound; 11] = [
    Bound {
        key: "login_timeout",
        min: 1,
        max: 3600,
        unit: "seconds",
    },
    Bound {
        key: "nop_interval",
        min: 0,
        max: 3600,
        unit: "seconds",
    },
    Bound {
        key: "nop_timeout",
        min: 1,
        max: 3600,
        unit: "seconds",
    },
    Bound {
        key: "max_connections",
        min: 1,
        max: 1 << 20,
        unit: "",
    },
    Bound {
        key: "max_sessions",
        min: 1,
        max: 1 << 16,
        unit: "",
    },
    Bound {
        key: "max_sessions_per_initiator",
        min: 1,
        max: 1 << 16,
        unit: "",
    },
    Bound {
        key: "write_buffer_per_session",
        min: MAX_IO,
        max: 1 << 40,
        unit: "bytes",
    },
    Bound {
        key: "max_r2ts_per_connection",
        min: 1,
        max: 1 << 16,
        unit: "",
    },
    Bound {
        key: "tx_buffer_per_connection",
        min: MAX_IO,
        max: 1 << 40,
        unit: "bytes",
    },
    Bound {
        key: "shutdown_grace",
        min: 0,
        max: 3_600_000,
        unit: "ms",
    },
    Bound {
        key: "busy_poll_us",
        min: 0,
        max: 10_000,
        unit: "us",
    },
];

/// A limit out of its range: the key (for the configuration file's line) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitError {
    pub key: &'static str,
    pub message: String,
}

impl std::fmt::Display for LimitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for LimitError {}

/// The range of `key` (panics on a key not in [`BOUNDS`]: a programming error).
pub fn bound(key: &str) -> Bound {
    match BOUNDS.iter().find(|b| b.key == key) {
        Some(b) => *b,
        None => panic!("no bound for limit {key}"),
    }
}

impl Limits {
    /// The value of a numeric key in its file unit.
    fn value(&self, key: &str) -> u64 {
        let n = |v: usize| v as u64;
        match key {
            "login_timeout" => self.login_timeout.as_secs(),
            "nop_interval" => self.nop_interval.as_secs(),
            "nop_timeout" => self.nop_timeout.as_secs(),
            "max_connections" => n(self.max_connections),
            "max_sessions" => n(self.max_sessions),
            "max_sessions_per_initiator" => n(self.max_sessions_per_initiator),
            "write_buffer_per_session" => self.write_buffer_per_session,
            "max_r2ts_per_connection" => n(self.max_r2ts_per_connection),
            "tx_buffer_per_connection" => self.tx_buffer_per_connection,
            "shutdown_grace" => u64::try_from(self.shutdown_grace.as_millis()).unwrap_or(u64::MAX),
            "busy_poll_us" => u64::try_from(self.busy_poll.as_micros()).unwrap_or(u64::MAX),
            _ => 0,
        }
    }

    /// Every numeric key within its [`BOUNDS`]; the first that is not, named.
    pub fn check(&self) -> Result<(), LimitError> {
        for b in BOUNDS {
            let v = self.value(b.key);
            if v < b.min || v > b.max {
                let message = match b.unit {
                    "bytes" => format!(
                        "{} '{}' must be a size from {} to {} (e.g. \"64M\")",
                        b.key,
                        size_text(v),
                        size_text(b.min),
                        size_text(b.max)
                    ),
                    "ms" => format!(
                        "{} '{}' must be a duration up to {} (e.g. \"10s\", \"500ms\", \"2m\")",
                        b.key,
                        duration_text(Duration::from_millis(v)),
                        duration_text(Duration::from_millis(b.max))
                    ),
                    unit => format!(
                        "{} must be between {} and {}{}{unit}",
                        b.key,
                        b.min,
                        b.max,
                        if unit.is_empty() { "" } else { " " }
                    ),
                };
                return Err(LimitError {
                    key: b.key,
                    message,
                });
            }
        }
        Ok(())
    }

    /// The `[limits]` table as the configuration file writes it (every key).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_default()
    }
}

/// A size as the configuration file writes it: the largest binary unit that divides it
/// (`64M`, `1G`), else bytes.
pub fn size_text(n: u64) -> String {
    for (unit, shift) in [("T", 40), ("G", 30), ("M", 20), ("K", 10)] {
        if n > 0 && n.is_multiple_of(1u64 << shift) {
            return format!("{}{unit}", n >> shift);
        }
    }
    n.to_string()
}

/// A duration as the configuration file writes it (`10s`, `2500ms`, `250us`).
pub fn duration_text(d: Duration) -> String {
    let us = d.as_micros();
    if us.is_multiple_of(1_000_000) {
        format!("{}s", us / 1_000_000)
    } else if us.is_multiple_of(1000) {
        format!("{}ms", us / 1000)
    } else {
        format!("{us}us")
    }
}

pub use ironsan_backend::parse_duration;

/// "on" or "off".
pub fn parse_on_off(v: &str) -> Result<bool, String> {
    match v {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("expected on or off, not {other:?}")),
    }
}

/// Whole seconds.
mod secs {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;
    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_secs())
    }
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_secs)
    }
}

/// Whole microseconds.
mod micros {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;
    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_micros)
    }
}

/// A duration written as text (`"10s"`).
mod duration {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};
    use std::time::Duration;
    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::duration_text(*d))
    }
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = String::deserialize(d)?;
        super::parse_duration(&v).ok_or_else(|| {
            D::Error::custom(format!(
                "'{v}' is not a duration (e.g. \"10s\", \"500ms\", \"2m\")"
            ))
        })
    }
}

/// A size written as text (`"64M"`).
mod size {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};
    pub(super) fn serialize<S: Serializer>(n: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::size_text(*n))
    }
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let v = String::deserialize(d)?;
        ironsan_backend::parse_size(&v)
            .ok_or_else(|| D::Error::custom(format!("'{v}' is not a size (e.g. \"64M\")")))
    }
}

/// "on" / "off".
mod on_off {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};
    pub(super) fn serialize<S: Serializer>(b: &bool, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(if *b { "on" } else { "off" })
    }
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        super::parse_on_off(&String::deserialize(d)?).map_err(D::Error::custom)
    }
}

/// A word parsed with `FromStr` and written with `Display`.
mod text {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};
    pub(super) fn serialize<T: std::fmt::Display, S: Serializer>(
        v: &T,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.to_string())
    }
    pub(super) fn deserialize<'de, T, D>(d: D) -> Result<T, D::Error>
    where
        T: std::str::FromStr<Err = String>,
        D: Deserializer<'de>,
    {
        String::deserialize(d)?.parse().map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_within_bounds_and_read_back_as_written() {
        let d = Limits::default();
        d.check().unwrap();
        let text = d.to_toml();
        assert!(
            text.contains("write_buffer_per_session = \"64M\""),
            "{text}"
        );
        assert!(text.contains("shutdown_grace = \"10s\""), "{text}");
        assert!(text.contains("busy_poll_us = 0"), "{text}");
        assert!(text.contains("zero_copy_writes = \"on\""), "{text}");
        assert_eq!(toml::from_str::<Limits>(&text).unwrap(), d);
        let odd = Limits {
            shutdown_grace: Duration::from_millis(2500),
            busy_poll: Duration::from_micros(50),
            zero_copy_reads: ZeroCopyReads::Mapped,
            io_engine: IoEngine::Threads,
            connection_fairness: false,
            tx_buffer_per_connection: 96 << 20,
            ..d
        };
        assert_eq!(toml::from_str::<Limits>(&odd.to_toml()).unwrap(), odd);
    }

    #[test]
    fn every_bound_is_checked_at_both_ends() {
        for b in BOUNDS {
            let mut text = String::new();
            let write = |v: u64| match b.unit {
                "bytes" => format!("{} = \"{v}\"", b.key),
                "ms" => format!("{} = \"{v}ms\"", b.key),
                _ => format!("{} = {v}", b.key),
            };
            text.push_str(&write(b.max));
            let l: Limits = toml::from_str(&text).unwrap();
            assert_eq!(l.check(), Ok(()), "{text}");
            if b.max < u64::MAX {
                let l: Limits = toml::from_str(&write(b.max + 1)).unwrap();
                let e = l.check().unwrap_err();
                assert_eq!(e.key, b.key);
                assert!(e.message.starts_with(b.key), "{}", e.message);
            }
            if b.min > 0 {
                let l: Limits = toml::from_str(&write(b.min - 1)).unwrap();
                assert_eq!(l.check().unwrap_err().key, b.key);
            }
        }
        assert!(toml::from_str::<Limits>("nonsense = 1").is_err());
        assert!(toml::from_str::<Limits>("zero_copy_writes = \"maybe\"").is_err());
        assert!(toml::from_str::<Limits>("shutdown_grace = \"ten\"").is_err());
    }
}
