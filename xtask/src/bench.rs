//! `cargo xtask bench`: runs the benchmark binary of the test bed in release mode.

use crate::run_checked;

#[derive(clap::Args)]
pub struct Args {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Interleaved rounds per packet class (the median is reported).
    #[arg(long, default_value_t = 15)]
    rounds: u32,
    /// Program runs per measurement (BPF_PROG_TEST_RUN repeat).
    #[arg(long, default_value_t = 1_000_000)]
    repeat: u32,
    /// Single-iteration runs per round for cases that change the packet.
    #[arg(long, default_value_t = 2_000)]
    singles: u32,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    crate::setup::run()?;
    let mut command = crate::cargo();
    command
        .args([
            "run",
            "--quiet",
            "--release",
            "--package",
            "dataplane-tests",
            "--bin",
            "bench",
            "--",
        ])
        .args([
            "--rounds",
            &args.rounds.to_string(),
            "--repeat",
            &args.repeat.to_string(),
            "--singles",
            &args.singles.to_string(),
        ]);
    if args.json {
        command.arg("--json");
    }
    run_checked(&mut command)
}
