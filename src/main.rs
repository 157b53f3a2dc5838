//! `trace`: the command-line tool. A thin clap layer: the flags are defined in `cli`, every
//! subcommand is one function of `commands` over the library's calls, and exit codes are decided
//! here, in one place: 0 success (bisect, report, check: identical), 1 a difference found (a
//! divergence, a root, a replay that gave other bits, a bundle over the size limit), 2 any error
//! (printed as one line naming the file and the problem).

mod cli;
mod commands;

use candle_trace::env;
use candle_trace::error::Result;
use clap::{CommandFactory, Parser};
use cli::{Cli, Cmd};
use commands::{bisect, check, files, record, repro};
use std::process::ExitCode;

fn main() -> ExitCode {
    // Captured before --threads changes RAYON_NUM_THREADS: the header keeps the user's own values.
    let env_vars = env::numeric_env_vars();
    // candle's default thread count, computed once rather than at every matmul; the same
    // threads, so the same results (`--threads` may change it below).
    env::pin_candle_threads();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // No subcommand: the help, on stderr, and the exit code of a usage error (2).
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                eprint!("{}", e.render());
                return ExitCode::from(2);
            }
            // One line, like every other error: clap's message up to its usage block.
            let msg = e.to_string();
            let words: Vec<&str> =
                msg.lines().map(str::trim).take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information")).filter(|l| !l.is_empty() && !l.starts_with("tip:")).collect();
            let line = words.join(" ");
            // Name the subcommand's own help when one was given.
            let sub = std::env::args().nth(1).filter(|a| Cli::command().find_subcommand(a).is_some());
            let help = match sub {
                Some(s) => format!("trace {s} --help"),
                None => "trace --help".into(),
            };
            eprintln!("trace: error: {} (see {help})", line.trim_start_matches("error: "));
            return ExitCode::from(2);
        }
    };
    match run(cli, env_vars) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            // One line, with any control character from a crafted file escaped.
            eprintln!("trace: error: {}", candle_trace::report::clean(&e.to_string()));
            ExitCode::from(2)
        }
    }
}

/// Runs the subcommand; its exit code.
fn run(cli: Cli, env_vars: Vec<(String, String)>) -> Result<u8> {
    match cli.cmd {
        Cmd::Record(args) => record::record_cmd(args, env_vars),
        Cmd::Bisect(args) => bisect::bisect_cmd(args),
        Cmd::Check(args) => check::check_cmd(args, env_vars),
        Cmd::Report(args) => bisect::report_cmd(args),
        Cmd::Replay(args) => repro::replay_cmd(args),
        Cmd::Extract(args) => repro::extract_cmd(args),
        Cmd::Bundle(args) => repro::bundle_cmd(args),
        Cmd::Show(args) => files::show_cmd(args),
        Cmd::Redact(args) => files::redact_cmd(args),
        Cmd::Import(args) => files::import_cmd(args),
    }
}
