//! `ironsan ctl`: the client of the control socket of a running `ironsan serve`.
//!
//! Every command is a clap subcommand with its own `--help`; `--json` and `--control` are
//! accepted anywhere on the line. A parsed command becomes the `argv` of the control protocol
//! (crates/server/src/control/, "Protocol"): the words a script would send, so the socket and
//! the CLI speak one language. [`render`] turns the answer into the tables printed without
//! `--json`.
//!
//! Exit status: 0 the command succeeded; 1 the running target refused it (the reason is
//! printed, one line); 2 the command line is wrong (clap's usage error); 3 the control socket
//! could not be reached (no `ironsan serve` there, or no permission).

mod hooks;
mod render;

pub(crate) use hooks::{lun_spec, BinHooks};

use clap::{Args, Subcommand};
use ironsan_server::control::{self, CallError};
use std::path::PathBuf;
use std::process::ExitCode;

/// Exit status when the control socket cannot be reached.
pub(crate) const EXIT_UNREACHABLE: u8 = 3;

#[derive(Args, Debug)]
#[command(
    subcommand_required = true,
    arg_required_else_help = true,
    after_help = "EXIT STATUS:
  0  the command succeeded
  1  the running target refused the command (the reason is printed on one line)
  2  the command line is wrong
  3  the control socket could not be reached (is ironsan serve running? --control PATH)

EXAMPLES:
  ironsan ctl sessions                      who is connected, with negotiated keys and TCP_INFO
  ironsan ctl luns --json                   the LUNs as JSON, for scripts
  ironsan ctl lun add iqn.2026-11.org.example:t1 ram:1G
  ironsan ctl alua set iqn.2026-11.org.example:t1 2 standby --transition 5
  ironsan ctl save                          write the running state to the --config file"
)]
pub(crate) struct CtlArgs {
    /// The control socket of `ironsan serve`. Default: /run/ironsan/control.sock as root,
    /// else $XDG_RUNTIME_DIR/ironsan/control.sock or ./ironsan-data/control.sock.
    #[arg(long, value_name = "PATH", env = "IRONSAN_CONTROL", global = true)]
    control: Option<PathBuf>,
    /// Print the JSON answer instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: CtlCmd,
}

#[derive(Subcommand, Debug, Clone, PartialEq)]
enum CtlCmd {
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
    Show(ShowCmd),
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
    Lun(LunCmd),
    /// Add or remove a target.
    #[command(subcommand)]
    Target(TargetCmd),
    /// Listen on a new portal or stop listening on one.
    #[command(subcommand)]
    Portal(PortalCmd),
    /// Add or remove an access-control rule.
    #[command(subcommand)]
    Acl(AclCmd),
    /// ALUA target port groups: show them (with TARGET, of one target), change a group's
    /// access state, or its preferred bit.
    #[command(args_conflicts_with_subcommands = true)]
    Alua {
        /// Show only this target (IQN).
        target: Option<String>,
        #[command(subcommand)]
        cmd: Option<AluaCmd>,
    },
    /// This node's cluster of gateways ([cluster]): its standing, every node per target with
    /// its state, ports and portals, and per shared LUN the reservation record each node
    /// applied; `forget N` removes a node taken out of service for good.
    Cluster {
        #[command(subcommand)]
        cmd: Option<ClusterCmd>,
    },
    /// Reconcile the running state to a configuration file (targets, LUNs, portals, ACLs,
    /// limits, ALUA groups); prints each change.
    Apply {
        /// The TOML configuration file.
        file: PathBuf,
        /// Print the changes without making them.
        #[arg(long)]
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

#[derive(Subcommand, Debug, Clone, PartialEq)]
enum ShowCmd {
    /// Show one target.
    Target {
        /// The target's name (IQN).
        iqn: String,
    },
}

#[derive(Subcommand, Debug, Clone, PartialEq)]
enum LunCmd {
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

#[derive(Subcommand, Debug, Clone, PartialEq)]
enum TargetCmd {
    /// A new target with no LUNs, open to every initiator.
    Add {
        /// The target's name (IQN or EUI).
        iqn: String,
        /// A TargetAlias to announce.
        #[arg(long)]
        alias: Option<String>,
    },
    /// Remove a target (refused while it has sessions, unless --force).
    Remove {
        /// The target's name.
        iqn: String,
        /// Close the target's sessions first.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Subcommand, Debug, Clone, PartialEq)]
enum PortalCmd {
    /// Listen on a new portal now.
    Add {
        /// ADDR:PORT (IPv6 as [::1]:3260).
        addr: String,
        /// Its portal group tag.
        #[arg(long, default_value_t = 1)]
        tag: u16,
    },
    /// Stop listening there (sessions that came in through it keep running).
    Remove {
        /// ADDR:PORT as listed by `ironsan ctl portals`.
        addr: String,
    },
}

#[derive(Subcommand, Debug, Clone, PartialEq)]
enum AclCmd {
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

#[derive(Subcommand, Debug, Clone, PartialEq)]
enum ClusterCmd {
    /// Remove node N's registration (a node taken out of service for good; refused while it
    /// answers the heartbeat). It registers again if it is started again.
    Forget {
        /// The node's number.
        node: u16,
    },
}

#[derive(Subcommand, Debug, Clone, PartialEq)]
enum AluaCmd {
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
        transition: Option<u64>,
    },
    /// Set or clear the PREF bit multipath adds to a group's priority.
    Prefer {
        /// The target (IQN).
        target: String,
        /// The target port group number.
        group: u16,
        /// on | off.
        #[arg(value_parser = ["on", "off"])]
        on: String,
    },
}

/// Owned words from borrowed ones.
fn words(ws: &[&str]) -> Vec<String> {
    ws.iter().map(|w| w.to_string()).collect()
}

impl CtlCmd {
    /// The control protocol's `argv` for this command.
    fn argv(&self) -> Vec<String> {
        let opt = |first: &[&str], last: &Option<String>| {
            let mut v = words(first);
            v.extend(last.clone());
            v
        };
        match self {
            CtlCmd::Sessions => words(&["sessions"]),
            CtlCmd::Targets => words(&["targets"]),
            CtlCmd::Luns { target } => opt(&["luns"], target),
            CtlCmd::Portals => words(&["portals"]),
            CtlCmd::Show(ShowCmd::Target { iqn }) => words(&["show", "target", iqn]),
            CtlCmd::Counters => words(&["counters"]),
            CtlCmd::Stats { target } => opt(&["stats"], target),
            CtlCmd::Lun(LunCmd::Add { target, spec, lun }) => {
                opt(&["lun", "add", target, spec], &lun.map(|n| n.to_string()))
            }
            CtlCmd::Lun(LunCmd::Remove { target, lun }) => {
                words(&["lun", "remove", target, &lun.to_string()])
            }
            CtlCmd::Lun(LunCmd::Resize { target, lun, size }) => {
                words(&["lun", "resize", target, &lun.to_string(), size])
            }
            CtlCmd::Target(TargetCmd::Add { iqn, alias: None }) => words(&["target", "add", iqn]),
            CtlCmd::Target(TargetCmd::Add {
                iqn,
                alias: Some(a),
            }) => words(&["target", "add", iqn, "--alias", a]),
            CtlCmd::Target(TargetCmd::Remove { iqn, force }) => {
                let mut v = words(&["target", "remove", iqn]);
                if *force {
                    v.push("--force".into());
                }
                v
            }
            CtlCmd::Portal(PortalCmd::Add { addr, tag }) => {
                words(&["portal", "add", addr, "--tag", &tag.to_string()])
            }
            CtlCmd::Portal(PortalCmd::Remove { addr }) => words(&["portal", "remove", addr]),
            CtlCmd::Acl(AclCmd::Add { target, rule }) => words(&["acl", "add", target, rule]),
            CtlCmd::Acl(AclCmd::Remove { target, rule }) => words(&["acl", "remove", target, rule]),
            CtlCmd::Cluster { cmd: None } => words(&["cluster"]),
            CtlCmd::Cluster {
                cmd: Some(ClusterCmd::Forget { node }),
            } => words(&["cluster", "forget", &node.to_string()]),
            CtlCmd::Alua { target, cmd: None } => opt(&["alua"], target),
            CtlCmd::Alua {
                cmd:
                    Some(AluaCmd::Set {
                        target,
                        group,
                        state,
                        transition,
                    }),
                ..
            } => {
                let mut v = words(&["alua", "set", target, &group.to_string(), state]);
                if let Some(t) = transition {
                    v.extend(words(&["--transition", &t.to_string()]));
                }
                v
            }
            CtlCmd::Alua {
                cmd: Some(AluaCmd::Prefer { target, group, on }),
                ..
            } => words(&["alua", "prefer", target, &group.to_string(), on]),
            CtlCmd::Apply { file, dry_run } => {
                let mut v = words(&["apply", &file.to_string_lossy()]);
                if *dry_run {
                    v.push("--dry-run".into());
                }
                v
            }
            CtlCmd::Save { file } => opt(
                &["save"],
                &file.as_ref().map(|f| f.to_string_lossy().into_owned()),
            ),
        }
    }
}

/// Run `ironsan ctl`: errors are printed on one line and mapped to the exit status above.
pub(crate) fn run(args: CtlArgs) -> ExitCode {
    let path = args.control.unwrap_or_else(control::default_socket_path);
    let argv = args.cmd.argv();
    match control::call(&path, &argv) {
        Ok(data) => {
            if args.json {
                match serde_json::to_string_pretty(&data) {
                    Ok(t) => println!("{t}"),
                    Err(e) => {
                        eprintln!("ironsan ctl: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            } else {
                print!("{}", render::render(&args.cmd, &data));
            }
            ExitCode::SUCCESS
        }
        Err(CallError::Unreachable(e)) => {
            eprintln!("ironsan ctl: {e}");
            ExitCode::from(EXIT_UNREACHABLE)
        }
        Err(CallError::Refused(e)) => {
            eprintln!("ironsan ctl: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        ctl: CtlArgs,
    }

    fn parse(line: &[&str]) -> Result<CtlArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("ctl").chain(line.iter().copied())).map(|c| c.ctl)
    }

    fn argv(line: &[&str]) -> Vec<String> {
        parse(line).unwrap().cmd.argv()
    }

    #[test]
    fn flags_are_accepted_anywhere_and_commands_become_the_protocols_argv() {
        let a = parse(&["sessions", "--json"]).unwrap();
        assert!(a.json);
        assert_eq!(a.cmd.argv(), ["sessions"]);
        let a = parse(&["--json", "luns", "iqn.x:t", "--control", "/tmp/s"]).unwrap();
        assert!(a.json);
        assert_eq!(a.control, Some(PathBuf::from("/tmp/s")));
        assert_eq!(a.cmd.argv(), ["luns", "iqn.x:t"]);
        // Already in the protocol's order: the argv is the command line.
        for line in [
            &["lun", "add", "iqn.x:t", "ram:1G", "3"][..],
            &["lun", "resize", "iqn.x:t", "0", "20G"],
            &["target", "add", "iqn.x:u", "--alias", "disk u"],
            &["alua"],
            &["alua", "iqn.x:t"],
            &[
                "alua",
                "set",
                "iqn.x:t",
                "2",
                "standby",
                "--transition",
                "5",
            ],
            &["alua", "prefer", "iqn.x:t", "1", "on"],
            &["save"],
            &["show", "target", "iqn.x:t"],
            &["acl", "remove", "discovery", "*"],
        ] {
            assert_eq!(argv(line), line);
        }
        // Options come after the positional arguments; defaults are spelled out.
        for (line, want) in [
            (
                &["portal", "add", "--tag", "2", "127.0.0.1:3261"][..],
                &["portal", "add", "127.0.0.1:3261", "--tag", "2"][..],
            ),
            (
                &["portal", "add", "127.0.0.1:3261"],
                &["portal", "add", "127.0.0.1:3261", "--tag", "1"],
            ),
            (
                &["target", "remove", "--force", "iqn.x:u"],
                &["target", "remove", "iqn.x:u", "--force"],
            ),
            (
                &["apply", "--dry-run", "/etc/x.toml"],
                &["apply", "/etc/x.toml", "--dry-run"],
            ),
        ] {
            assert_eq!(argv(line), want);
        }
    }

    #[test]
    fn bad_command_lines_are_usage_errors() {
        use clap::error::ErrorKind;
        for (line, kind) in [
            (&["nonsense"][..], ErrorKind::InvalidSubcommand),
            (
                &["lun", "remove", "iqn.x:t", "zero"],
                ErrorKind::ValueValidation,
            ),
            (
                &["lun", "remove", "iqn.x:t"],
                ErrorKind::MissingRequiredArgument,
            ),
            (
                &["alua", "set", "iqn.x:t", "70000", "standby"],
                ErrorKind::ValueValidation,
            ),
            (
                &["alua", "prefer", "iqn.x:t", "1", "maybe"],
                ErrorKind::InvalidValue,
            ),
            (&["sessions", "extra"], ErrorKind::UnknownArgument),
        ] {
            let e = parse(line)
                .err()
                .unwrap_or_else(|| panic!("{line:?} parsed"));
            assert_eq!(e.kind(), kind, "{line:?}: {e}");
            assert_eq!(e.exit_code(), 2, "{line:?}");
        }
    }
}
