//! `cargo xtask bench`: per-packet cost of the programs (BPF_PROG_TEST_RUN against empty
//! programs) and cross-node TCP throughput (iperf3, our Geneve against the kernel's VXLAN),
//! both from the test bed's benchmark binaries in release mode.

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
    /// Skip the cross-node TCP throughput comparison (iperf3, Geneve against kernel VXLAN).
    #[arg(long)]
    no_throughput: bool,
    /// Alternating iperf3 rounds per path in the throughput comparison.
    #[arg(long, default_value_t = 3)]
    throughput_rounds: u32,
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
    run_checked(&mut command)?;
    if args.no_throughput {
        return Ok(());
    }
    // The agents of the throughput topology run the release binary.
    crate::build_release_agent()?;
    let mut throughput = crate::cargo();
    throughput
        .args([
            "run",
            "--quiet",
            "--release",
            "--package",
            "dataplane-tests",
        ])
        .args(["--bin", "throughput", "--", "--rounds"])
        .arg(args.throughput_rounds.to_string());
    if args.json {
        throughput.arg("--json");
    }
    run_checked(&mut throughput)
}
