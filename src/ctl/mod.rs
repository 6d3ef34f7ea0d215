//! `ironsan ctl`: the client of the control socket of a running `ironsan serve`.
//!
//! Every command is a clap subcommand with its own `--help`; `--json` and `--control` are
//! accepted anywhere on the line. The commands are the control protocol's own request type
//! ([`ironsan_server::control::Request`], which carries the clap grammar and the help), sent
//! as JSON; a script that sends the words instead gets them parsed by the same grammar on the
//! server. [`render`] turns the answer into the tables printed without `--json`.
//!
//! Exit status: 0 the command succeeded; 1 the running target refused it (the reason is
//! printed, one line); 2 the command line is wrong (clap's usage error); 3 the control socket
//! could not be reached (no `ironsan serve` there, or no permission).

mod render;

use clap::Args;
use ironsan_server::control::{self, CallError, Request};
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
    cmd: Request,
}

/// Run `ironsan ctl`: errors are printed on one line and mapped to the exit status above.
pub(crate) fn run(args: CtlArgs) -> ExitCode {
    let path = args.control.unwrap_or_else(control::default_socket_path);
    match control::call_request(&path, &args.cmd) {
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
            eprintln!("ironsan ctl: {}", e.message);
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

    #[test]
    fn flags_are_accepted_anywhere_and_the_command_is_what_the_socket_parses() {
        let a = parse(&["sessions", "--json"]).unwrap();
        assert!(a.json);
        assert_eq!(a.cmd, Request::Sessions);
        let a = parse(&["--json", "luns", "iqn.x:t", "--control", "/tmp/s"]).unwrap();
        assert!(a.json);
        assert_eq!(a.control, Some(PathBuf::from("/tmp/s")));
        assert_eq!(
            a.cmd,
            Request::Luns {
                target: Some("iqn.x:t".into())
            }
        );
        // The command line and the socket's words are one grammar.
        for line in [
            &["lun", "add", "iqn.x:t", "ram:1G", "3"][..],
            &["lun", "resize", "iqn.x:t", "0", "20G"],
            &["target", "add", "iqn.x:u", "--alias", "disk u"],
            &["target", "remove", "--force", "iqn.x:u"],
            &["portal", "add", "--tag", "2", "127.0.0.1:3261"],
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
            &["apply", "--dry-run", "/etc/x.toml"],
            &["save"],
            &["show", "target", "iqn.x:t"],
            &["acl", "remove", "discovery", "*"],
            &["cluster", "forget", "3"],
        ] {
            assert_eq!(parse(line).unwrap().cmd, Request::from_argv(line).unwrap());
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
