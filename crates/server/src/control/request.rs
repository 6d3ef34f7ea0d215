//! The control protocol's requests, typed once: `ironsan ctl` parses its command line into a
//! [`Request`] with clap (these types carry the help text), sends it as JSON, and
//! [`super::Control::dispatch`] matches on it. A request given as words (`{"argv": [...]}`,
//! what a script sends) is parsed by the same clap grammar ([`Request::from_argv`]), so the
//! socket and the command line accept exactly the same commands with the same options.

use clap::{Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// One command to a running `ironsan serve`.
#[derive(Subcommand, Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Request {
    /// Sessions and their connections: negotiated keys, counters, TCP_INFO.
    Sessions,
    /// Targets: alias, LUNs, sessions, portal groups, ACL, authentication.
    Targets,
    /// LUNs (of one target, or all): backend, I/O engine, size, block size, mode, write cache.
    Luns {
        /// Only this target (IQN).
        target: Option<String>,
    },
    /// Portals listened on, with their portal group tags.
    Portals,
    /// One target in full: access rules, LUNs, sessions.
    #[command(subcommand)]
    Show(ShowRequest),
    /// Server-wide counters (logins, failures by reason, bytes, zero-copy bytes, ...).
    Counters,
    /// Latency per stage (receive, queue, backend, respond, send, total) per LUN and class:
    /// count, bytes, mean, p50, p99.
    Stats {
        /// Only this target (IQN).
        target: Option<String>,
    },
    /// Map, unmap or resize a LUN while initiators are connected.
    #[command(subcommand)]
    Lun(LunRequest),
    /// Add or remove a target.
    #[command(subcommand)]
    Target(TargetRequest),
    /// Listen on a new portal or stop listening on one.
    #[command(subcommand)]
    Portal(PortalRequest),
    /// Add or remove an access-control rule.
    #[command(subcommand)]
    Acl(AclRequest),
    /// ALUA target port groups: show them (with TARGET, of one target), change a group's
    /// access state, or its preferred bit.
    #[command(args_conflicts_with_subcommands = true)]
    Alua {
        /// Show only this target (IQN).
        target: Option<String>,
        #[command(subcommand)]
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cmd: Option<AluaRequest>,
    },
    /// This node's cluster of gateways ([cluster]): its standing, every node per target with
    /// its state, ports and portals, and per shared LUN the reservation record each node
    /// applied; `forget N` removes a node taken out of service for good.
    Cluster {
        #[command(subcommand)]
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cmd: Option<ClusterRequest>,
    },
    /// Reconcile the running state to a configuration file (targets, LUNs, portals, ACLs,
    /// limits, ALUA groups); prints each change.
    Apply {
        /// The TOML configuration file.
        file: PathBuf,
        /// Print the changes without making them.
        #[arg(long)]
        #[serde(default)]
        dry_run: bool,
    },
    /// Write the running state as TOML: portals as bound, [limits], targets, ACLs, LUNs with
    /// their identity (serial, NAA), ALUA groups. Atomic: the file is the old or the new text
    /// after a crash.
    Save {
        /// Where to write (default: the --config file serve started with; without one, the
        /// text is printed).
        file: Option<PathBuf>,
    },
}

#[derive(Subcommand, Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ShowRequest {
    /// Show one target.
    Target {
        /// The target's name (IQN).
        iqn: String,
    },
}

#[derive(Subcommand, Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LunRequest {
    /// Map a new LUN; the other LUs of the target report REPORTED LUNS DATA HAS CHANGED.
    Add {
        /// The target (IQN).
        target: String,
        /// As for `serve --lun`: ram:1G, file:x.img:10G,direct, null:1T, rbd:POOL/IMAGE, ...
        spec: String,
        /// The LUN number (default: one past the highest).
        lun: Option<u64>,
    },
    /// Unmap a LUN (commands in flight finish; the LU reports it is gone).
    Remove {
        /// The target (IQN).
        target: String,
        /// The LUN number.
        lun: u64,
    },
    /// Grow (or shrink) a LUN; raises CAPACITY DATA HAS CHANGED.
    Resize {
        /// The target (IQN).
        target: String,
        /// The LUN number.
        lun: u64,
        /// The new size, with K/M/G/T suffix (e.g. 20G).
        size: String,
    },
}

#[derive(Subcommand, Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TargetRequest {
    /// A new target with no LUNs, open to every initiator.
    Add {
        /// The target's name (IQN or EUI).
        iqn: String,
        /// A TargetAlias to announce.
        #[arg(long)]
        #[serde(default, skip_serializing_if = "Option::is_none")]
        alias: Option<String>,
    },
    /// Remove a target (refused while it has sessions, unless --force).
    Remove {
        /// The target's name.
        iqn: String,
        /// Close the target's sessions first.
        #[arg(long)]
        #[serde(default)]
        force: bool,
    },
}

#[derive(Subcommand, Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PortalRequest {
    /// Listen on a new portal now.
    Add {
        /// ADDR:PORT (IPv6 as [::1]:3260).
        addr: String,
        /// Its portal group tag.
        #[arg(long, default_value_t = 1)]
        #[serde(default = "first_tag")]
        tag: u16,
    },
    /// Stop listening there (sessions that came in through it keep running).
    Remove {
        /// ADDR:PORT as listed by `ironsan ctl portals`.
        addr: String,
    },
}

fn first_tag() -> u16 {
    1
}

#[derive(Subcommand, Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AclRequest {
    /// Allow an initiator (or a pattern) to log in.
    Add {
        /// The target (IQN), or 'discovery' for discovery sessions.
        target: String,
        /// As for `serve --acl`: an IQN, a prefix ending in '*', or '*', optionally @ADDR[/LEN].
        rule: String,
    },
    /// Remove a rule (sessions already logged in stay).
    Remove {
        /// The target (IQN), or 'discovery'.
        target: String,
        /// The rule exactly as added.
        rule: String,
    },
}

#[derive(Subcommand, Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClusterRequest {
    /// Remove node N's registration (a node taken out of service for good; refused while it
    /// answers the heartbeat). It registers again if it is started again.
    Forget {
        /// The node's number.
        node: u16,
    },
}

#[derive(Subcommand, Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AluaRequest {
    /// Change a target port group's access state; initiators get ASYMMETRIC ACCESS STATE
    /// CHANGED.
    Set {
        /// The target (IQN).
        target: String,
        /// The target port group number.
        group: u16,
        /// active/optimized | active/non-optimized | standby | unavailable | offline.
        state: String,
        /// Report `transitioning` for SECS seconds first.
        #[arg(long, value_name = "SECS")]
        #[serde(default, skip_serializing_if = "Option::is_none")]
        transition: Option<u64>,
    },
    /// Set or clear the PREF bit multipath adds to a group's priority.
    Prefer {
        /// The target (IQN).
        target: String,
        /// The target port group number.
        group: u16,
        /// Whether the group is preferred.
        on: Switch,
    },
}

/// `on` or `off`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Switch {
    On,
    Off,
}

impl Switch {
    pub fn is_on(self) -> bool {
        self == Switch::On
    }
}

impl std::fmt::Display for Switch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_on() { "on" } else { "off" })
    }
}

/// The clap grammar of a request given as words.
#[derive(Parser, Debug)]
#[command(
    name = "ironsan ctl",
    no_binary_name = true,
    disable_help_subcommand = true
)]
struct Words {
    #[command(subcommand)]
    request: Request,
}

impl Request {
    /// Parse the words after `ironsan ctl` (no global flags) as the command line does.
    pub fn from_argv<S: AsRef<str>>(argv: &[S]) -> Result<Request, String> {
        Words::try_parse_from(argv.iter().map(|s| s.as_ref()))
            .map(|w| w.request)
            .map_err(|e| {
                use clap::error::ErrorKind;
                if matches!(
                    e.kind(),
                    ErrorKind::DisplayHelp | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
                ) {
                    let words: Vec<&str> = argv.iter().map(|s| s.as_ref()).collect();
                    return format!(
                        "'{}' requires a subcommand (see ironsan ctl --help)",
                        words.join(" ")
                    );
                }
                // clap's first line names the problem; the usage that follows is the CLI's.
                let text = e.to_string();
                let first = text
                    .lines()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("bad command")
                    .trim_start_matches("error: ")
                    .to_string();
                format!("{first} (see ironsan ctl --help)")
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_and_json_give_the_same_request() {
        for (words, json) in [
            (&["sessions"][..], r#""sessions""#),
            (&["luns", "iqn.x:t"], r#"{"luns":{"target":"iqn.x:t"}}"#),
            (&["luns"], r#"{"luns":{"target":null}}"#),
            (
                &["lun", "add", "iqn.x:t", "ram:1G", "3"],
                r#"{"lun":{"add":{"target":"iqn.x:t","spec":"ram:1G","lun":3}}}"#,
            ),
            // Options anywhere, as on the command line; defaults filled in.
            (
                &["portal", "add", "--tag", "2", "127.0.0.1:3261"],
                r#"{"portal":{"add":{"addr":"127.0.0.1:3261","tag":2}}}"#,
            ),
            (
                &["portal", "add", "127.0.0.1:3261"],
                r#"{"portal":{"add":{"addr":"127.0.0.1:3261"}}}"#,
            ),
            (
                &["target", "remove", "--force", "iqn.x:u"],
                r#"{"target":{"remove":{"iqn":"iqn.x:u","force":true}}}"#,
            ),
            (
                &[
                    "alua",
                    "set",
                    "iqn.x:t",
                    "2",
                    "standby",
                    "--transition",
                    "5",
                ],
                r#"{"alua":{"target":null,"cmd":{"set":{"target":"iqn.x:t","group":2,"state":"standby","transition":5}}}}"#,
            ),
            (
                &["alua", "prefer", "iqn.x:t", "1", "on"],
                r#"{"alua":{"target":null,"cmd":{"prefer":{"target":"iqn.x:t","group":1,"on":"on"}}}}"#,
            ),
            (&["cluster"], r#"{"cluster":{}}"#),
            (
                &["cluster", "forget", "2"],
                r#"{"cluster":{"cmd":{"forget":{"node":2}}}}"#,
            ),
            (
                &["apply", "--dry-run", "/etc/x.toml"],
                r#"{"apply":{"file":"/etc/x.toml","dry_run":true}}"#,
            ),
        ] {
            let from_words = Request::from_argv(words).unwrap();
            let from_json: Request = serde_json::from_str(json).unwrap();
            assert_eq!(from_words, from_json, "{words:?}");
            // And back: what the CLI sends parses to the same request.
            let sent = serde_json::to_string(&from_words).unwrap();
            assert_eq!(serde_json::from_str::<Request>(&sent).unwrap(), from_words);
        }
    }

    #[test]
    fn bad_words_are_refused_with_what_is_wrong() {
        for (words, says) in [
            (&["nonsense"][..], "unrecognized subcommand 'nonsense'"),
            (
                &["lun", "remove", "iqn.x:t", "zero"],
                "invalid value 'zero'",
            ),
            (
                &["lun", "remove", "iqn.x:t"],
                "required arguments were not provided",
            ),
            (
                &["alua", "set", "iqn.x:t", "70000", "standby"],
                "invalid value '70000'",
            ),
            (
                &["alua", "prefer", "iqn.x:t", "1", "maybe"],
                "invalid value 'maybe'",
            ),
            (&["sessions", "extra"], "unexpected argument 'extra'"),
            (&[], "requires a subcommand"),
            (&["lun"], "'lun' requires a subcommand"),
            (&["--help"], "requires a subcommand"),
        ] {
            let e = Request::from_argv(words).unwrap_err();
            assert!(e.contains(says), "{words:?}: {e}");
            assert!(!e.contains('\n'), "{words:?}: one line: {e}");
        }
    }
}
