//! Cross-node TCP throughput between two pods: through the dataplane's Geneve overlay, and
//! through the kernel's VXLAN device carrying the same pods' traffic in the same topology (this
//! kernel has no Geneve device; VXLAN is the nearest in-kernel overlay). Rounds alternate so
//! both paths see the same machine conditions; medians and the ratio are printed. Each round
//! also times one-byte round trips over one connection between the same pods (TCP_RR, with
//! `tcp_rr`) through our Geneve and through VXLAN with XDP on the underlay. Our Geneve runs
//! twice a round, the uplinks on XDP then tc (`--uplink-hook`); a last set of rounds makes the
//! fabric's ports plain bridge ports, as a kind node's veth has, and compares our uplinks on
//! tc with the kernel VXLAN device there (no XDP anywhere: 64 KB frames on the veths). A
//! benchmark: it reports, it does not pass or fail.
//!
//! One flow's rate on this testbed is not bounded by either path's per-byte work: both nodes,
//! both pods and the fabric share the machine's CPUs, and the sender's system call runs the
//! whole chain down to waking the receiver. So each run also records how many CPUs the
//! machine kept busy, and the report gives CPU seconds per gigabyte moved for each path: what
//! a path costs per byte, whatever limited the flow. `--cpu-per-node` models the nodes as
//! separate machines instead: each node's pod and receive work on a CPU of its own.

use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};
use clap::Parser;
use dataplane_tests::cpu::CpuTicks;
use dataplane_tests::request_response::{self, Kind, Server, Transactions, median_of};
use dataplane_tests::topology::{
    Mode, Node, OVERLAY_POD_MTU, Topology, UNDERLAY_MTU, kernel_vxlan_down, kernel_vxlan_up,
};
use serde::Serialize;

#[derive(Parser)]
struct Args {
    /// Alternating rounds per path.
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Seconds per iperf3 run.
    #[arg(long, default_value_t = 4)]
    seconds: u32,
    #[arg(long)]
    json: bool,
    /// Carry the fabric's frames in the testbed's XDP switch (`Topology::switch_in_xdp`)
    /// instead of a Linux bridge, for both paths alike.
    #[arg(long)]
    xdp_fabric: bool,
    /// A pfifo queue on each node's underlay veth, as a NIC has one (veth has none), for both
    /// paths alike.
    #[arg(long)]
    queue_uplinks: bool,
    /// Give each node a CPU of its own, as if the nodes were separate machines (for both
    /// paths alike): node n's pod runs iperf3 on CPU n, and node n's receive work after XDP
    /// is steered to CPU n (RPS on its underlay veth).
    #[arg(long)]
    cpu_per_node: bool,
    /// Parallel TCP streams per iperf3 run.
    #[arg(long, default_value_t = 1)]
    streams: u32,
}

#[derive(Serialize)]
struct Report {
    rounds: u32,
    seconds: u32,
    geneve: Vec<Run>,
    vxlan: Vec<Run>,
    vxlan_xdp: Vec<Run>,
    /// Our Geneve with the uplinks on tc alone (`--uplink-hook tc`), on the same wire as the
    /// kernel VXLAN device's run (no XDP on the nodes' ends).
    geneve_tc: Vec<Run>,
    /// Round trips per second over one connection (TCP_RR) and their latency.
    geneve_rr: Vec<Transactions>,
    geneve_tc_rr: Vec<Transactions>,
    vxlan_xdp_rr: Vec<Transactions>,
    geneve_median_gbps: f64,
    vxlan_median_gbps: f64,
    vxlan_xdp_median_gbps: f64,
    /// Geneve over the kernel VXLAN device as it runs on veth (64 KB frames on the underlay).
    ratio: f64,
    /// Geneve over the kernel VXLAN device with XDP on the same underlay (wire-sized frames).
    ratio_same_wire: f64,
    /// Round trips per second, Geneve over VXLAN with XDP on the underlay (medians).
    rr_ratio: f64,
    /// CPU seconds per gigabyte moved (medians), and VXLAN with XDP's over ours: how much
    /// less the machine works per byte on our path, whatever bounds one flow's rate.
    geneve_cpu_seconds_per_gb: f64,
    vxlan_xdp_cpu_seconds_per_gb: f64,
    cost_ratio: f64,
    /// The uplinks on tc: rate, CPU seconds per GB, and against the kernel VXLAN device on
    /// the same wire (no XDP on the nodes' ends): rate, CPU a GB (VXLAN's over ours),
    /// round trips (over VXLAN with XDP's, as `rr_ratio`).
    geneve_tc_median_gbps: f64,
    geneve_tc_cpu_seconds_per_gb: f64,
    vxlan_cpu_seconds_per_gb: f64,
    tc_ratio: f64,
    tc_cost_ratio: f64,
    tc_rr_ratio: f64,
    /// The fabric's ports plain bridge ports, as on kind: our uplinks on tc and the kernel
    /// VXLAN device, both carrying 64 KB frames; rate and CPU a GB (VXLAN's over ours).
    plain_tc: Vec<Run>,
    plain_vxlan: Vec<Run>,
    plain_tc_ratio: f64,
    plain_tc_cost_ratio: f64,
}

/// One iperf3 run: Gbit/s received, TCP retransmissions, and what the run cost the machine.
#[derive(Clone, Copy, Debug, Serialize)]
struct Run {
    gbps: f64,
    retransmits: u64,
    /// CPUs kept busy on average while the client ran (the whole machine: both nodes, both
    /// pods and the fabric share it).
    busy_cpus: f64,
}

impl Run {
    /// CPU seconds the machine spent per gigabyte moved: the path's cost per byte, whatever
    /// limited the flow's rate.
    fn cpu_seconds_per_gb(&self) -> f64 {
        self.busy_cpus * 8.0 / self.gbps
    }
}

/// iperf3 from the first pod of node 0 to the first pod of node 1.
fn iperf(topology: &Topology, args: &Args) -> anyhow::Result<Run> {
    let (seconds, streams) = (args.seconds, args.streams);
    let server_pod = &topology.node(1).pods[0];
    let client_pod = &topology.node(0).pods[0];
    let cpu = |node: usize| args.cpu_per_node.then_some(node);
    let mut server = iperf3_in(&server_pod.netns, cpu(1))
        .args(["-s", "-1", "-p", "5201"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting iperf3 server")?;
    // The server may take longer than a moment to listen on a loaded machine: the client is
    // tried again, and the server stopped whatever happened (it would wait for a client
    // forever).
    let mut out = None;
    let mut busy_cpus = 0.0;
    for _ in 0..25 {
        std::thread::sleep(std::time::Duration::from_millis(200));
        let before = CpuTicks::read()?;
        let run = iperf3_in(&client_pod.netns, cpu(0))
            .args(["-c", &server_pod.ip.to_string(), "-p", "5201", "-J"])
            .args(["-t", &seconds.to_string(), "-P", &streams.to_string()])
            .output()
            .context("running iperf3 client")?;
        busy_cpus = before.busy_cpus_until(CpuTicks::read()?);
        let done = run.status.success();
        out = Some(run);
        if done {
            break;
        }
    }
    let _ = server.kill();
    let _ = server.wait();
    let out = out.context("iperf3 client never ran")?;
    if !out.status.success() {
        bail!("iperf3: {}", String::from_utf8_lossy(&out.stdout));
    }
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let bps = report["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .context("iperf3 report without sum_received")?;
    let retransmits = report["end"]["sum_sent"]["retransmits"]
        .as_u64()
        .unwrap_or(0);
    Ok(Run {
        gbps: bps / 1e9,
        retransmits,
        busy_cpus,
    })
}

/// iperf3 in `netns`, on CPU `cpu` alone when one is given.
fn iperf3_in(netns: &str, cpu: Option<usize>) -> Command {
    let mut command = Command::new("nsenter");
    command.arg(format!("--net=/run/netns/{netns}"));
    if let Some(cpu) = cpu {
        command.args(["taskset", "-c", &cpu.to_string()]);
    }
    command.arg("iperf3");
    command
}

/// Steers the receive work of each node's underlay veth, after XDP, to the node's own CPU
/// (node n to CPU n) with Receive Packet Steering.
fn steer_nodes_to_own_cpus(topology: &Topology) -> anyhow::Result<()> {
    let cpus = std::thread::available_parallelism()?.get();
    anyhow::ensure!(
        cpus >= topology.nodes.len(),
        "a CPU per node needs {} CPUs, this machine has {cpus}",
        topology.nodes.len()
    );
    for (n, node) in topology.nodes.iter().enumerate() {
        let path = format!(
            "/sys/class/net/{}/queues/rx-0/rps_cpus",
            node.underlay_iface
        );
        // `ip netns exec` mounts the namespace's own /sys, where its devices are.
        let out = Command::new("ip")
            .args(["netns", "exec", &node.netns, "sh", "-c"])
            .arg(format!("echo {:x} > {path}", 1u64 << n))
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "setting {path} in {}: {}",
            node.netns,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// TCP_RR from the first pod of node 0 to the first pod of node 1 for `seconds`.
fn round_trips(topology: &Topology, seconds: u32) -> anyhow::Result<Transactions> {
    let server_pod = &topology.node(1).pods[0];
    let _server = Server::start(&server_pod.netns, 5202)?;
    request_response::measure(
        &topology.node(0).pods[0].netns,
        Kind::RoundTrips,
        &format!("{}:5202", server_pod.ip),
        seconds.into(),
    )
}

/// The median of one figure of the runs.
fn median_by(runs: &[Run], figure: fn(&Run) -> f64) -> f64 {
    dataplane_tests::median(&runs.iter().map(figure).collect::<Vec<_>>())
}

fn median(runs: &[Run]) -> f64 {
    median_by(runs, |r| r.gbps)
}

fn median_cost(runs: &[Run]) -> f64 {
    median_by(runs, Run::cpu_seconds_per_gb)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    dataplane_tests::topology::agents_as_deployed();
    anyhow::ensure!(
        args.rounds > 0 && args.seconds > 0,
        "rounds and seconds must be positive"
    );
    let mut topology = Topology::build_with(2, 1, Mode::Overlay)?;
    if args.xdp_fabric {
        topology.switch_in_xdp()?;
    }
    if args.queue_uplinks {
        for node in &topology.nodes {
            dataplane_tests::topology::sh_in(
                &node.netns,
                &format!(
                    "tc qdisc replace dev {} root pfifo limit 1000",
                    node.underlay_iface
                ),
            )?;
        }
    }
    if args.cpu_per_node {
        steer_nodes_to_own_cpus(&topology)?;
    }
    let nodes = topology.nodes.clone();
    // The same nodes without the overlay: the agent only parses and counts on the underlay.
    let plain: Vec<Node> = nodes
        .iter()
        .map(|n| Node {
            manifests: None,
            pods: Vec::new(),
            ..n.clone()
        })
        .collect();
    let (mut geneve, mut vxlan, mut vxlan_xdp) = (Vec::new(), Vec::new(), Vec::new());
    let (mut geneve_rr, mut vxlan_xdp_rr) = (Vec::new(), Vec::new());
    let (mut geneve_tc, mut geneve_tc_rr) = (Vec::new(), Vec::new());
    let xdp = ["--uplink-hook", "xdp"];
    let tc = ["--uplink-hook", "tc"];
    for _ in 0..args.rounds {
        {
            let _agents = (
                nodes[0].start_agent_with(&xdp)?,
                nodes[1].start_agent_with(&xdp)?,
            );
            geneve.push(iperf(&topology, &args)?);
            geneve_rr.push(round_trips(&topology, args.seconds)?);
        }
        {
            let _agents = (
                nodes[0].start_agent_with(&tc)?,
                nodes[1].start_agent_with(&tc)?,
            );
            geneve_tc.push(iperf(&topology, &args)?);
            geneve_tc_rr.push(round_trips(&topology, args.seconds)?);
        }
        kernel_vxlan_up(&nodes)?;
        let result = iperf(&topology, &args);
        let with_xdp = (|| {
            // XDP on a veth makes its peer hand over wire-sized frames, as a real NIC does.
            let _agents = (
                plain[0].start_agent_with(&xdp)?,
                plain[1].start_agent_with(&xdp)?,
            );
            Ok::<_, anyhow::Error>((
                iperf(&topology, &args)?,
                round_trips(&topology, args.seconds)?,
            ))
        })();
        kernel_vxlan_down(&nodes)?;
        vxlan.push(result?);
        let (with_xdp, rr) = with_xdp?;
        vxlan_xdp.push(with_xdp);
        vxlan_xdp_rr.push(rr);
    }
    // The bed as a kind or k3d node has it: the fabric's ends of the nodes' veths are plain
    // bridge ports (no XDP there), so a veth carries 64 KB frames end to end. Our uplinks on
    // tc against the kernel VXLAN device, both without XDP anywhere.
    let (mut plain_tc, mut plain_vxlan) = (Vec::new(), Vec::new());
    if !args.xdp_fabric {
        topology.plain_fabric_ports()?;
        for _ in 0..args.rounds {
            {
                let _agents = (
                    nodes[0].start_agent_with(&tc)?,
                    nodes[1].start_agent_with(&tc)?,
                );
                plain_tc.push(iperf(&topology, &args)?);
            }
            kernel_vxlan_up(&nodes)?;
            let result = iperf(&topology, &args);
            kernel_vxlan_down(&nodes)?;
            plain_vxlan.push(result?);
        }
    }
    let rate = |r: &Transactions| r.per_second;
    let report = Report {
        rounds: args.rounds,
        seconds: args.seconds,
        geneve_median_gbps: median(&geneve),
        vxlan_median_gbps: median(&vxlan),
        vxlan_xdp_median_gbps: median(&vxlan_xdp),
        ratio: median(&geneve) / median(&vxlan),
        ratio_same_wire: median(&geneve) / median(&vxlan_xdp),
        rr_ratio: median_of(&geneve_rr, rate) / median_of(&vxlan_xdp_rr, rate),
        geneve_cpu_seconds_per_gb: median_cost(&geneve),
        vxlan_xdp_cpu_seconds_per_gb: median_cost(&vxlan_xdp),
        cost_ratio: median_cost(&vxlan_xdp) / median_cost(&geneve),
        geneve_tc_median_gbps: median(&geneve_tc),
        geneve_tc_cpu_seconds_per_gb: median_cost(&geneve_tc),
        vxlan_cpu_seconds_per_gb: median_cost(&vxlan),
        tc_ratio: median(&geneve_tc) / median(&vxlan),
        tc_cost_ratio: median_cost(&vxlan) / median_cost(&geneve_tc),
        tc_rr_ratio: median_of(&geneve_tc_rr, rate) / median_of(&vxlan_xdp_rr, rate),
        plain_tc_ratio: median(&plain_tc) / median(&plain_vxlan),
        plain_tc_cost_ratio: median_cost(&plain_vxlan) / median_cost(&plain_tc),
        plain_tc,
        plain_vxlan,
        geneve_tc,
        geneve_tc_rr,
        geneve_rr,
        vxlan_xdp_rr,
        geneve,
        vxlan,
        vxlan_xdp,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "cross-node pod TCP (iperf3, {} s x {} alternating rounds, {} stream(s), pod MTU {OVERLAY_POD_MTU}, underlay veth MTU {UNDERLAY_MTU})",
            args.seconds, args.rounds, args.streams
        );
        if args.cpu_per_node {
            println!(
                "  each node on a CPU of its own: its pod's iperf3 pinned there, its receive work steered there"
            );
        }
        let runs = |runs: &[Run]| {
            runs.iter()
                .map(|r| {
                    format!(
                        "{:.2} ({} retr, {:.2} CPUs)",
                        r.gbps, r.retransmits, r.busy_cpus
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "  dataplane Geneve (tc encap, XDP decap): median {:.2} Gbit/s  [{}]",
            report.geneve_median_gbps,
            runs(&report.geneve)
        );
        println!(
            "  dataplane Geneve, uplinks on tc:        median {:.2} Gbit/s  [{}]",
            report.geneve_tc_median_gbps,
            runs(&report.geneve_tc)
        );
        println!(
            "  kernel VXLAN device:                    median {:.2} Gbit/s  [{}]",
            report.vxlan_median_gbps,
            runs(&report.vxlan)
        );
        println!(
            "  kernel VXLAN device, XDP on underlay:   median {:.2} Gbit/s  [{}]",
            report.vxlan_xdp_median_gbps,
            runs(&report.vxlan_xdp)
        );
        println!(
            "  ratio Geneve / VXLAN on the same wire (target >= 1.2): {:.2}",
            report.ratio_same_wire
        );
        println!(
            "  ratio Geneve / VXLAN with 64 KB frames on the veth:    {:.2}  (no NIC carries such frames)",
            report.ratio
        );
        println!(
            "  CPU seconds per GB moved: Geneve {:.2}, VXLAN with XDP on underlay {:.2}; ratio VXLAN / Geneve {:.2}",
            report.geneve_cpu_seconds_per_gb,
            report.vxlan_xdp_cpu_seconds_per_gb,
            report.cost_ratio
        );
        let rr = |name: &str, runs: &[Transactions]| {
            println!("  TCP_RR {name}: {}", request_response::summary(runs));
        };
        rr("dataplane Geneve            ", &report.geneve_rr);
        rr("dataplane Geneve, tc uplinks", &report.geneve_tc_rr);
        rr("kernel VXLAN, XDP on underlay", &report.vxlan_xdp_rr);
        println!(
            "  ratio of round trips Geneve / VXLAN on the same wire (target >= 1.1): {:.2}",
            report.rr_ratio
        );
        println!(
            "  uplinks on tc, against the kernel VXLAN device without XDP on the nodes (the fabric's ends run XDP, as throughout: wire-sized frames, no GRO of the inner packets at tc):"
        );
        println!(
            "    rate {:.2}; CPU seconds per GB: Geneve {:.2}, VXLAN {:.2}, ratio VXLAN / Geneve {:.2} (target >= 1.1); round trips against VXLAN with XDP {:.2} (target >= 1.1)",
            report.tc_ratio,
            report.geneve_tc_cpu_seconds_per_gb,
            report.vxlan_cpu_seconds_per_gb,
            report.tc_cost_ratio,
            report.tc_rr_ratio
        );
        if !report.plain_tc.is_empty() {
            println!(
                "  the fabric's ports plain bridge ports, as on kind (no XDP anywhere, 64 KB frames on the veths):"
            );
            println!(
                "    dataplane Geneve, uplinks on tc: median {:.2} Gbit/s [{}]; kernel VXLAN: median {:.2} Gbit/s [{}]",
                median(&report.plain_tc),
                runs(&report.plain_tc),
                median(&report.plain_vxlan),
                runs(&report.plain_vxlan)
            );
            println!(
                "    rate {:.2}; CPU seconds per GB: Geneve {:.2}, VXLAN {:.2}, ratio VXLAN / Geneve {:.2} (target >= 1.1)",
                report.plain_tc_ratio,
                median_cost(&report.plain_tc),
                median_cost(&report.plain_vxlan),
                report.plain_tc_cost_ratio
            );
        }
    }
    Ok(())
}
