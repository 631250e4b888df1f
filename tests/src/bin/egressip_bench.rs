//! Egress IPs: the per-packet cost of a selected pod's packet leaving the cluster (translated
//! on this node, or carried to the holder through Geneve) beside the same packet with no
//! egress IP and an empty tc program, interleaved round by round (BPF_PROG_TEST_RUN, single
//! runs: the translated packet changes); and the failover time, measured on three nodes in
//! network namespaces: a UDP stream from a selected pod, the holder's underlay link cut, the
//! time until the stream arrives again from the egress IP. A benchmark: it reports.

use std::{thread, time::Duration};

use clap::Parser;
use dataplane_common::{maps::PROG_FROM_POD, testbed::PROG_TC_BASELINE};
use dataplane_tests::{
    egress_bed::{Holder, egress_maps},
    egress_topology::{
        ASSIGNABLE, EGRESS_IP, UdpReceiver, UdpSender, egress_cluster, egress_ip_yaml, holder,
        start_agents, start_controller,
    },
    median, overlay_bed, packets,
    topology::{node_name, sh_in},
};
use serde::Serialize;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 15)]
    rounds: u32,
    /// Single-iteration runs per case and round.
    #[arg(long, default_value_t = 2_000)]
    singles: u32,
    /// Failovers measured (each cuts the current holder's link).
    #[arg(long, default_value_t = 3)]
    failovers: u32,
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct CostRow {
    case: &'static str,
    median_ns: f64,
    ratio_to_no_egress_ip: f64,
    ratio_to_empty_program: f64,
}

#[derive(Serialize)]
struct Report {
    rounds: u32,
    singles: u32,
    costs: Vec<CostRow>,
    failover_seconds: Vec<f64>,
    failover_median_seconds: f64,
}

/// (label, program, egress maps): the cases, in the order each round runs them.
const CASES: [(&str, &str, Holder); 4] = [
    ("empty tc program", PROG_TC_BASELINE, Holder::NoEgressIp),
    (
        "no egress IP (to the stack)",
        PROG_FROM_POD,
        Holder::NoEgressIp,
    ),
    ("egress IP held here (SNAT)", PROG_FROM_POD, Holder::Here),
    ("egress IP on node b (Geneve)", PROG_FROM_POD, Holder::NodeB),
];

fn packet_costs(args: &Args) -> anyhow::Result<Vec<CostRow>> {
    let mut bed = overlay_bed::bed()?;
    let frame = packets::ipv4_tcp_to([192, 0, 2, 1]);
    let mut samples = vec![Vec::new(); CASES.len()];
    for _ in 0..args.rounds {
        for (i, (_, program, holder)) in CASES.iter().enumerate() {
            let maps = egress_maps(&bed.view, *holder);
            bed.fixture.sync_egress(&maps, None)?;
            let mut round = Vec::with_capacity(args.singles as usize);
            for _ in 0..args.singles {
                let outcome = bed.fixture.run_tc(program, &frame, 1)?;
                round.push(outcome.duration.as_nanos() as f64);
            }
            samples[i].push(median(&round));
        }
    }
    let medians: Vec<f64> = samples.iter().map(|s| median(s)).collect();
    Ok(CASES
        .iter()
        .zip(&medians)
        .map(|((case, _, _), &median_ns)| CostRow {
            case,
            median_ns,
            ratio_to_no_egress_ip: median_ns / medians[1],
            ratio_to_empty_program: median_ns / medians[0],
        })
        .collect())
}

fn failovers(count: u32) -> anyhow::Result<Vec<f64>> {
    let (topology, external, manifests) = egress_cluster(&[0, 1, 2], ASSIGNABLE)?;
    topology.add_manifest(
        "egressip.yaml",
        &egress_ip_yaml("prod", &format!("[{EGRESS_IP}]"), "prod"),
    )?;
    let _agents = start_agents(&topology, "0.0.0.0:9476", &[])?;
    let controller = start_controller(&external, &manifests);
    let mut seconds = Vec::new();
    for _ in 0..count {
        let Some(current) = holder(&manifests, None, Duration::from_secs(10)) else {
            anyhow::bail!("no holder published\n{}", controller.log());
        };
        let cut = (0..3)
            .find(|n| node_name(*n) == current)
            .ok_or_else(|| anyhow::anyhow!("holder {current} is not a node"))?;
        // The stream comes from a node that keeps its link.
        let pod = topology.node((cut + 1) % 3).pods[0].clone();
        thread::sleep(Duration::from_secs(1));
        let receiver = UdpReceiver::start(&external);
        let sender = UdpSender::start(&pod, 300);
        thread::sleep(Duration::from_secs(1));
        let cut_at = std::time::SystemTime::now();
        sh_in(&topology.fabric, &format!("ip link set n{cut} down"))?;
        let mut moved = None;
        for _ in 0..200 {
            moved = holder(&manifests, None, Duration::ZERO).filter(|h| *h != current);
            if moved.is_some() {
                break;
            }
            thread::sleep(Duration::from_millis(50));
        }
        anyhow::ensure!(moved.is_some(), "no failover\n{}", controller.log());
        sender.finish();
        let arrivals = receiver.finish();
        let cut_at = cut_at.duration_since(std::time::UNIX_EPOCH)?.as_secs_f64();
        let resumed = arrivals
            .iter()
            .filter(|(_, source)| source == EGRESS_IP)
            .map(|(at, _)| *at)
            .find(|at| *at > cut_at + 0.05)
            .ok_or_else(|| anyhow::anyhow!("the stream did not resume"))?;
        seconds.push(resumed - cut_at);
        sh_in(&topology.fabric, &format!("ip link set n{cut} up"))?;
        // Back in the cluster before the next round: answering its probes again.
        thread::sleep(Duration::from_secs(2));
    }
    Ok(seconds)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    dataplane_tests::topology::agents_as_deployed();
    anyhow::ensure!(
        args.rounds > 0 && args.singles > 0 && args.failovers > 0,
        "rounds, singles and failovers must be positive"
    );
    let costs = packet_costs(&args)?;
    let failover_seconds = failovers(args.failovers)?;
    let report = Report {
        rounds: args.rounds,
        singles: args.singles,
        failover_median_seconds: median(&failover_seconds),
        costs,
        failover_seconds,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "Egress IP: tc_from_pod on a TCP packet leaving the cluster, median of {} single runs \
         per round, {} interleaved rounds",
        report.singles, report.rounds
    );
    println!(
        "{:<30} {:>9} {:>16} {:>16}",
        "case", "ns/pkt", "vs no egress IP", "vs empty prog"
    );
    for row in &report.costs {
        println!(
            "{:<30} {:>9.1} {:>16.2} {:>16.2}",
            row.case, row.median_ns, row.ratio_to_no_egress_ip, row.ratio_to_empty_program
        );
    }
    let list: Vec<String> = report
        .failover_seconds
        .iter()
        .map(|s| format!("{s:.2}"))
        .collect();
    println!(
        "Egress IP failover (holder's underlay link cut, UDP stream from a selected pod): \
         median {:.2} s over {} ({} s); target < 3 s",
        report.failover_median_seconds,
        report.failover_seconds.len(),
        list.join(", ")
    );
    Ok(())
}
