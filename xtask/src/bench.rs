//! `cargo xtask bench`: per-packet cost of the programs, of the service load-balancer at 10
//! and 10,000 services, of the EgressFirewall at 1 to 8000 rules and of admin policies at 1 to
//! 100 x 100 rules, of multicast with 1 to 32 members and 4 member nodes (BPF_PROG_TEST_RUN against
//! empty programs; the firewall also against an nftables chain of the same rules), the agent's
//! sync (10,000 services and 100 firewalled namespaces from empty, and one change),
//! cross-node TCP throughput (iperf3, our Geneve against the kernel's VXLAN), and the CNI
//! plugin's ADD latency and the agent's memory per pod (against the reference ptp +
//! host-local plugins), the egress IP path's cost and failover time, all from the test bed's benchmark binaries in release mode.

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
    /// Skip the topology benchmarks: cross-node TCP throughput (iperf3, Geneve against kernel
    /// VXLAN), the service packet rate (against nftables) and the CNI plugin's ADD latency
    /// (against ptp + host-local).
    #[arg(long)]
    no_throughput: bool,
    /// Alternating iperf3 rounds per path in the throughput comparison.
    #[arg(long, default_value_t = 5)]
    throughput_rounds: u32,
    /// Alternating rounds per path in the NodePort packet-rate comparisons, whose kernel
    /// VXLAN baseline varies most from round to round.
    #[arg(long, default_value_t = 5)]
    node_port_rounds: u32,
    /// Run every benchmark once with the least work, in the test profile (which `cargo xtask
    /// test` has built), to show each still runs: for CI, not for figures.
    #[arg(long)]
    smoke: bool,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    crate::setup::run()?;
    if args.smoke {
        return smoke();
    }
    let json: Vec<String> = if args.json {
        vec!["--json".into()]
    } else {
        Vec::new()
    };
    let mut bench = vec![
        "--rounds".to_owned(),
        args.rounds.to_string(),
        "--repeat".to_owned(),
        args.repeat.to_string(),
        "--singles".to_owned(),
        args.singles.to_string(),
    ];
    bench.extend(json.iter().cloned());
    crate::run_testbed("bench", &bench)?;
    crate::run_testbed("lb_bench", &json)?;
    crate::run_testbed("acl_bench", &json)?;
    crate::run_testbed("multicast_bench", &json)?;
    crate::run_testbed("sync_bench", &json)?;
    crate::run_testbed("scale_bench", &json)?;
    if args.no_throughput {
        return Ok(());
    }
    // The agents of the topology benchmarks run the release binary; the packet-rate one runs
    // its load generator from the same target directory.
    crate::build_release_agent()?;
    crate::build_release("dataplane-tests", "udp_blast")?;
    crate::build_release("dataplane-tests", "tcp_rr")?;
    let mut lb_pps = vec![
        "--node-port-rounds".to_owned(),
        args.node_port_rounds.to_string(),
    ];
    lb_pps.extend(json.iter().cloned());
    crate::run_testbed("lb_pps", &lb_pps)?;
    crate::run_testbed("cni_bench", &json)?;
    crate::run_testbed("egressip_bench", &json)?;
    let mut throughput = vec!["--rounds".to_owned(), args.throughput_rounds.to_string()];
    throughput.extend(json);
    crate::run_testbed("throughput", &throughput)
}

/// Every benchmark once, with the least work each takes, from the test profile: a benchmark
/// that no longer runs fails here, the day it breaks. The figures mean nothing.
fn smoke() -> anyhow::Result<()> {
    let args = |list: &[&str]| list.iter().map(|a| (*a).to_owned()).collect::<Vec<_>>();
    // The load generators of the packet-rate and throughput benchmarks run from the same
    // target directory.
    crate::run_checked(crate::cargo().args([
        "build",
        "--quiet",
        "--package",
        "dataplane-tests",
        "--bin",
        "udp_blast",
        "--bin",
        "tcp_rr",
    ]))?;
    for (binary, arguments) in [
        (
            "bench",
            args(&["--rounds", "1", "--repeat", "1000", "--singles", "20"]),
        ),
        ("lb_bench", args(&["--rounds", "1", "--singles", "20"])),
        (
            "acl_bench",
            args(&["--rounds", "1", "--repeat", "1000", "--send-ms", "20"]),
        ),
        (
            "multicast_bench",
            args(&["--rounds", "1", "--singles", "20"]),
        ),
        ("sync_bench", Vec::new()),
        ("scale_bench", args(&["--smoke"])),
        ("lb_pps", args(&["--rounds", "1", "--seconds", "1"])),
        ("cni_bench", args(&["--pods", "10", "--parallel", "5"])),
        (
            "egressip_bench",
            args(&["--rounds", "1", "--singles", "20", "--failovers", "1"]),
        ),
        ("throughput", args(&["--rounds", "1", "--seconds", "1"])),
    ] {
        crate::run_test_profile("dataplane-tests", binary, &arguments)?;
    }
    Ok(())
}
