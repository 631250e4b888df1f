//! Service packet rate in the veth topology: a client pod blasts UDP at a ClusterIP whose two
//! backends are pods on the same node, through our load-balancer (tc DNAT, then straight into
//! the backend pod) and through an nftables setup equivalent to kube-proxy's nftables mode
//! (a verdict map of service addresses, a random choice of endpoint chain, DNAT, conntrack,
//! then the host's routing), alternating in one run. The rate is what reaches the backends'
//! interfaces per second; sender and forwarding share the machine's two cores, as on a node.
//!
//! Both paths share the sender's cost (its socket or packet writes and the veth crossing),
//! which on this machine is most of the time per packet. So each round also measures the
//! sender alone (the datagrams dropped as they reach the host side of the client's veth), and
//! the report gives each path's own cost, `1/pps - 1/sender-only pps`, and their ratio next
//! to the raw rates.
//!
//! A third path sets the floor: a tc program that redirects every packet into one backend pod
//! and decides nothing (no lookup, no rewrite). What it costs beyond the sender, no tc
//! dataplane on this kernel can go below, so `nftables path / floor path` bounds the path
//! ratio any of them could report here.
//!
//! A second comparison: an external host sends to a NodePort of node 0 whose backend is a pod
//! on node 1. Ours: the flow's first packet through tc, the rest translated, wrapped in Geneve
//! and sent back out by XDP on node 0, unwrapped by XDP on node 1. nftables: kube-proxy's
//! NodePort DNAT and masquerade, then node 1's pod CIDR reached two ways: routed over the
//! underlay, and through the kernel's VXLAN device (the kernel-only equivalent of an overlay
//! cluster, where pod CIDRs are not routed by the underlay). It runs twice: with the hosts
//! joined by a Linux bridge, and by the testbed's XDP switch, which passes frames from port
//! to port as a hardware switch does, at no cost to the nodes' CPUs. On the bridge every
//! path pays for the fabric on the same two CPUs, and an XDP path pays twice: each frame its
//! XDP sends back becomes a socket buffer for the bridge, which the next node's veth copies
//! again for its XDP. Behind a NIC neither happens.
//!
//! Request/response over TCP, as users of a service feel it (`tcp_rr`): one-byte round trips
//! over one connection (TCP_RR) and whole short connections (TCP_CRR), through the ClusterIP
//! and through the NodePort, ours against the same nftables paths. The ClusterIP's runs four
//! ways: ours per packet, ours at the socket (`--socket-lb on`), straight to a backend's pod
//! address (nothing to translate: the floor a socket-level translation should reach), and
//! nftables; each with the machine's busy CPU time per transaction beside its rate.
//! A benchmark: it reports, it does not pass or fail.

use std::{collections::BTreeMap, process::Command};

use anyhow::{Context as _, bail};
use clap::Parser;
use dataplane_common::{
    maps::{PROG_FROM_POD, PROG_SOCK_CONNECT4, PROG_SOCK_CONNECT6, SOCK_PROGRAMS},
    testbed::{BASELINE_REDIRECT, PROG_TC_REDIRECT_BASELINE},
};
use dataplane_tests::cpu::CpuTicks;
use dataplane_tests::median;
use dataplane_tests::request_response::{self, Kind, Server, Transactions, median_of};
use dataplane_tests::service_bed::{ServicePort, cluster_ip_manifests};
use dataplane_tests::testbed::Testbed;
use dataplane_tests::topology::{
    Agent, Mode, Pod, Topology, exec_in, in_netns, kernel_vxlan_down, kernel_vxlan_up, run_in,
    sh_in,
};
use serde::Serialize;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    #[arg(long, default_value_t = 3)]
    seconds: u64,
    /// Rounds of the NodePort comparisons, whose baselines vary most from round to round
    /// (the kernel VXLAN one above all); `--rounds` when not given.
    #[arg(long)]
    node_port_rounds: Option<u32>,
    #[arg(long)]
    json: bool,
    /// Only the NodePort comparisons (to profile that path; the figures are printed alike).
    #[arg(long)]
    node_port_only: bool,
}

impl Args {
    fn node_port_rounds(&self) -> u32 {
        self.node_port_rounds.unwrap_or(self.rounds)
    }
}

/// What joins the nodes and the external host in the NodePort comparisons.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fabric {
    /// A Linux bridge: its cost (a socket buffer per frame, and for a frame a node's XDP sent
    /// back, the conversion into one) falls on the same two CPUs as the paths compared.
    Bridge,
    /// The testbed's XDP switch (`Topology::switch_in_xdp`): frames cross from node to node
    /// as a hardware switch passes them, without costing the nodes' CPUs a bridge.
    Xdp,
}

impl Fabric {
    fn describe(self) -> &'static str {
        match self {
            Fabric::Bridge => "fabric: a Linux bridge",
            Fabric::Xdp => "fabric: the XDP switch (unicast frames port to port, no bridge)",
        }
    }
}

/// The NodePort comparisons on each fabric.
#[derive(Serialize)]
struct NodePortFabrics {
    #[serde(flatten)]
    bridge: NodePortResults,
    xdp_fabric: NodePortResults,
}

impl NodePortFabrics {
    fn measure(args: &Args) -> anyhow::Result<Self> {
        Ok(Self {
            bridge: node_port_comparison(args, Fabric::Bridge)?,
            xdp_fabric: node_port_comparison(args, Fabric::Xdp)?,
        })
    }

    fn print(&self, args: &Args) {
        print_node_port(args, Fabric::Bridge, &self.bridge);
        print_node_port(args, Fabric::Xdp, &self.xdp_fabric);
    }
}

const SERVICE_IP: &str = "10.96.0.10";
/// The services' TCP port for request/response, and the backends' port behind it.
const RR_PORT: u16 = 81;
const RR_TARGET: u16 = 8081;
/// The services' TCP port for one stream (iperf3), the same on the backends.
const STREAM_PORT: u16 = 5201;

#[derive(Serialize)]
struct Report {
    rounds: u32,
    node_port_rounds: u32,
    seconds: u64,
    /// Sender: a UDP socket in the client pod.
    socket: Comparison,
    /// Sender: prebuilt frames written to the client pod's interface.
    raw_frames: Comparison,
    /// TCP request/response through the ClusterIP: ours per packet and at the socket, to a
    /// backend's own address, and nftables (kube-proxy's rules).
    cluster_ip_tcp: ClusterIpTcp,
    /// An external host to a NodePort whose backend is on another node.
    #[serde(flatten)]
    node_port: NodePortFabrics,
    /// Our tc program's own time per packet on the ClusterIP path (`tc_from_pod`: a flow cache
    /// hit, DNAT, local delivery; each flow's first packet of a second takes the full path),
    /// from the kernel's BPF statistics in an extra run of the socket sender.
    tc_program_ns: f64,
    /// What translating at the socket costs a connection: our socket programs' own time, from
    /// the kernel's BPF statistics in an extra TCP_CRR run at the socket.
    socket_programs: SocketPrograms,
}

/// Our socket programs' time per connection over a TCP_CRR run at the socket. After `connect`
/// the connection's packets take the pod address's path (nothing to translate), so this is all
/// the socket-level translation adds to a connection.
#[derive(Serialize)]
struct SocketPrograms {
    connections: u64,
    /// Each socket program that ran: runs a connection and nanoseconds a connection.
    programs: BTreeMap<String, (f64, f64)>,
    ns_per_connection: f64,
}

impl SocketPrograms {
    /// From the agent's program costs before and after a run; a connection is a run of
    /// `connect` (IPv4 or IPv6).
    fn new(
        before: &BTreeMap<String, (u64, u64)>,
        after: &BTreeMap<String, (u64, u64)>,
    ) -> anyhow::Result<Self> {
        let delta = |name: &str| {
            let (runs, ns) = after.get(name).copied().unwrap_or((0, 0));
            let (runs_before, ns_before) = before.get(name).copied().unwrap_or((0, 0));
            (runs - runs_before, ns - ns_before)
        };
        let connections = delta(PROG_SOCK_CONNECT4).0 + delta(PROG_SOCK_CONNECT6).0;
        anyhow::ensure!(connections > 0, "no connect ran a socket program");
        let programs: BTreeMap<String, (f64, f64)> = SOCK_PROGRAMS
            .iter()
            .map(|&name| (name, delta(name)))
            .filter(|&(_, (runs, _))| runs > 0)
            .map(|(name, (runs, ns))| {
                let per = |v: u64| v as f64 / connections as f64;
                (name.to_owned(), (per(runs), per(ns)))
            })
            .collect();
        Ok(Self {
            connections,
            ns_per_connection: programs.values().map(|&(_, ns)| ns).sum(),
            programs,
        })
    }
}

#[derive(Serialize)]
struct Comparison {
    dataplane_pps: Vec<f64>,
    nftables_pps: Vec<f64>,
    sender_only_pps: Vec<f64>,
    /// The redirect floor (ClusterIP comparisons only).
    floor_pps: Vec<f64>,
    dataplane_median_pps: f64,
    nftables_median_pps: f64,
    sender_only_median_pps: f64,
    ratio: f64,
    /// Nanoseconds per packet each path adds to the sender's own cost (medians).
    dataplane_path_ns: f64,
    nftables_path_ns: f64,
    path_ratio: f64,
    /// The path ratio of each round from that round's own rates (its four measurements ran
    /// back to back, so a drift of the machine's speed between rounds cancels out), and
    /// their median.
    round_path_ratios: Vec<f64>,
    round_path_ratio_median: f64,
    /// The floor's cost beyond the sender, and the path ratio a dataplane costing no more
    /// than it would reach (0 when not measured).
    floor_path_ns: f64,
    floor_path_ratio: f64,
    /// What each path cost the machine in CPU time (NodePort comparisons only).
    #[serde(skip_serializing_if = "Option::is_none")]
    cpu: Option<CpuCost>,
}

/// The CPU time each path of a comparison cost the machine a packet, round by round: busy
/// CPUs over the blast (all of the machine: sender, nodes, fabric) over the rate. Unlike the
/// rate, it does not depend on whether the path's work ran inline in the sender's softirq on
/// one CPU or was partly deferred to the other; beside the busy CPUs it shows which happened.
#[derive(Serialize)]
struct CpuCost {
    dataplane_busy_cpus: Vec<f64>,
    nftables_busy_cpus: Vec<f64>,
    sender_only_busy_cpus: Vec<f64>,
    /// Medians over the rounds of the machine's CPU time a packet.
    dataplane_cpu_ns: f64,
    nftables_cpu_ns: f64,
    sender_only_cpu_ns: f64,
    /// The same beyond the sender's own (each round less that round's sender alone), and
    /// nftables' over ours.
    dataplane_path_cpu_ns: f64,
    nftables_path_cpu_ns: f64,
    path_cpu_ratio: f64,
}

impl CpuCost {
    fn new(ours: &[Sample], nft: &[Sample], sender: &[Sample]) -> Self {
        let busy = |v: &[Sample]| v.iter().map(|s| s.busy_cpus).collect::<Vec<_>>();
        let cpu = |v: &[Sample]| median(&v.iter().map(|s| s.cpu_ns()).collect::<Vec<_>>());
        let beyond = |v: &[Sample]| {
            let rounds: Vec<f64> = v
                .iter()
                .zip(sender)
                .map(|(s, alone)| s.cpu_ns() - alone.cpu_ns())
                .collect();
            median(&rounds)
        };
        let (dataplane_path_cpu_ns, nftables_path_cpu_ns) = (beyond(ours), beyond(nft));
        Self {
            dataplane_busy_cpus: busy(ours),
            nftables_busy_cpus: busy(nft),
            sender_only_busy_cpus: busy(sender),
            dataplane_cpu_ns: cpu(ours),
            nftables_cpu_ns: cpu(nft),
            sender_only_cpu_ns: cpu(sender),
            dataplane_path_cpu_ns,
            nftables_path_cpu_ns,
            path_cpu_ratio: nftables_path_cpu_ns / dataplane_path_cpu_ns,
        }
    }

    fn print(&self) {
        let list = |v: &[f64]| {
            v.iter()
                .map(|c| format!("{c:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "    CPUs the machine kept busy: dataplane [{}], nftables [{}], sender alone [{}]",
            list(&self.dataplane_busy_cpus),
            list(&self.nftables_busy_cpus),
            list(&self.sender_only_busy_cpus)
        );
        println!(
            "    CPU time a packet (busy CPUs / rate, medians): dataplane {:.0} ns, nftables {:.0} ns, \
             sender alone {:.0} ns; beyond the sender: dataplane {:.0} ns, nftables {:.0} ns; \
             ratio nftables / dataplane: {:.2}",
            self.dataplane_cpu_ns,
            self.nftables_cpu_ns,
            self.sender_only_cpu_ns,
            self.dataplane_path_cpu_ns,
            self.nftables_path_cpu_ns,
            self.path_cpu_ratio
        );
    }
}

impl Comparison {
    fn new(ours: Vec<f64>, nft: Vec<f64>, sender: Vec<f64>, floor: Vec<f64>) -> Self {
        let (ours_pps, nft_pps, sender_pps) = (median(&ours), median(&nft), median(&sender));
        let round_path_ratios: Vec<f64> = (0..ours.len().min(nft.len()).min(sender.len()))
            .map(|i| {
                let path = |pps: f64| 1e9 / pps - 1e9 / sender[i];
                path(nft[i]) / path(ours[i])
            })
            .collect();
        let path_ns = |pps: f64| 1e9 / pps - 1e9 / sender_pps;
        let floor_path_ns = if floor.is_empty() {
            0.0
        } else {
            path_ns(median(&floor))
        };
        Self {
            floor_path_ns,
            floor_path_ratio: if floor_path_ns > 0.0 {
                path_ns(nft_pps) / floor_path_ns
            } else {
                0.0
            },
            floor_pps: floor,
            dataplane_median_pps: ours_pps,
            nftables_median_pps: nft_pps,
            sender_only_median_pps: sender_pps,
            ratio: ours_pps / nft_pps,
            dataplane_path_ns: path_ns(ours_pps),
            nftables_path_ns: path_ns(nft_pps),
            path_ratio: path_ns(nft_pps) / path_ns(ours_pps),
            round_path_ratio_median: median(&round_path_ratios),
            round_path_ratios,
            cpu: None,
            dataplane_pps: ours,
            nftables_pps: nft,
            sender_only_pps: sender,
        }
    }

    fn with_cpu(self, cpu: CpuCost) -> Self {
        Self {
            cpu: Some(cpu),
            ..self
        }
    }

    /// `rate_target`, `path_target`: what the ratios are held to, printed beside them ("" for
    /// none).
    fn print(&self, sender: &str, ours: &str, theirs: &str, rate_target: &str, path_target: &str) {
        let target = |t: &str| {
            if t.is_empty() {
                String::new()
            } else {
                format!(" (target >= {t})")
            }
        };
        let list = |v: &[f64]| {
            v.iter()
                .map(|p| format!("{p:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!("  sender: {sender}");
        println!(
            "    dataplane ({ours}): median {:.0} pkt/s  [{}]",
            self.dataplane_median_pps,
            list(&self.dataplane_pps)
        );
        println!(
            "    nftables ({theirs}): median {:.0} pkt/s  [{}]",
            self.nftables_median_pps,
            list(&self.nftables_pps)
        );
        println!(
            "    sender alone (dropped on arrival): median {:.0} pkt/s  [{}]",
            self.sender_only_median_pps,
            list(&self.sender_only_pps)
        );
        println!(
            "    ratio of rates dataplane / nftables{}: {:.2}",
            target(rate_target),
            self.ratio
        );
        println!(
            "    cost of each path beyond the sender: dataplane {:.0} ns, nftables {:.0} ns; \
             ratio nftables / dataplane{}: {:.2}",
            self.dataplane_path_ns,
            self.nftables_path_ns,
            target(path_target),
            self.path_ratio
        );
        println!(
            "    the same ratio round by round (each from its own round's rates): median {:.2}  [{}]",
            self.round_path_ratio_median,
            self.round_path_ratios
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        if let Some(cpu) = &self.cpu {
            cpu.print();
        }
        if !self.floor_pps.is_empty() {
            println!(
                "    floor (a tc redirect into the backend, no lookup, no rewrite): median {:.0} pkt/s  [{}]",
                median(&self.floor_pps),
                list(&self.floor_pps)
            );
            println!(
                "    floor cost beyond the sender: {:.0} ns; the best path ratio any tc dataplane \
                 could reach here: {:.2}",
                self.floor_path_ns, self.floor_path_ratio
            );
        }
    }
}

/// One path's TCP request/response runs, with the machine's busy CPU time per transaction
/// (client, path and server together: the paths differ only in the path).
#[derive(Default, Serialize)]
struct TcpPath {
    rr: Vec<Transactions>,
    crr: Vec<Transactions>,
    rr_cpu_us: Vec<f64>,
    crr_cpu_us: Vec<f64>,
}

impl TcpPath {
    /// One round of both kinds from `netns` to `target`.
    fn measure(&mut self, netns: &str, target: &str, seconds: u64) -> anyhow::Result<()> {
        for (kind, runs, cpu) in [
            (Kind::RoundTrips, &mut self.rr, &mut self.rr_cpu_us),
            (Kind::Connections, &mut self.crr, &mut self.crr_cpu_us),
        ] {
            let ticks = CpuTicks::read()?;
            let run = request_response::measure(netns, kind, target, seconds)?;
            let busy = ticks.busy_cpus_until(CpuTicks::read()?);
            cpu.push(busy / run.per_second.max(1.0) * 1e6);
            runs.push(run);
        }
        Ok(())
    }

    fn runs(&self, kind: Kind) -> (&[Transactions], &[f64]) {
        match kind {
            Kind::RoundTrips => (&self.rr, &self.rr_cpu_us),
            Kind::Connections => (&self.crr, &self.crr_cpu_us),
        }
    }

    /// Median rate of `kind`.
    fn rate(&self, kind: Kind) -> f64 {
        median_of(self.runs(kind).0, |r| r.per_second)
    }

    /// Median busy CPU microseconds per transaction of `kind`.
    fn cpu_us(&self, kind: Kind) -> f64 {
        median(self.runs(kind).1)
    }
}

/// One TCP stream's run (iperf3): Gbit/s received and the machine's CPU seconds per GB.
#[derive(Clone, Copy, Serialize)]
struct Stream {
    gbps: f64,
    cpu_seconds_per_gb: f64,
}

impl Stream {
    /// One iperf3 run of `seconds` from `netns` to `address` port `STREAM_PORT` (a server
    /// listens there on every backend).
    fn measure(netns: &str, address: &str, seconds: u64) -> anyhow::Result<Self> {
        // A server that has just ended a test may refuse the next for a moment ("busy"):
        // tried again.
        let mut last = String::new();
        for _ in 0..20 {
            let ticks = CpuTicks::read()?;
            let out = Command::new("nsenter")
                .arg(format!("--net=/run/netns/{netns}"))
                .args([
                    "iperf3",
                    "-c",
                    address,
                    "-p",
                    &STREAM_PORT.to_string(),
                    "-J",
                ])
                .args(["-t", &seconds.max(1).to_string()])
                .output()
                .context("running iperf3")?;
            let busy = ticks.busy_cpus_until(CpuTicks::read()?);
            let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            if let Some(bps) = report["end"]["sum_received"]["bits_per_second"].as_f64()
                && out.status.success()
            {
                let gbps = bps / 1e9;
                return Ok(Self {
                    gbps,
                    cpu_seconds_per_gb: busy * 8.0 / gbps.max(1e-9),
                });
            }
            last = String::from_utf8_lossy(&out.stdout).into_owned();
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        bail!("iperf3 to {address} never ran: {last}")
    }
}

fn median_stream(runs: &[Stream], field: fn(&Stream) -> f64) -> f64 {
    median(&runs.iter().map(field).collect::<Vec<_>>())
}

/// Request/response through the ClusterIP four ways, round by round.
#[derive(Default, Serialize)]
struct ClusterIpTcp {
    /// Ours, translated per packet in tc.
    per_packet: TcpPath,
    /// Ours, translated at the socket (`--socket-lb on`).
    socket: TcpPath,
    /// To a backend's own pod address, ours running: nothing to translate, the floor.
    pod_address: TcpPath,
    /// kube-proxy's nftables rules.
    nftables: TcpPath,
    /// One TCP stream to the ClusterIP translated at the socket, and to a backend's pod
    /// address.
    socket_stream: Vec<Stream>,
    pod_address_stream: Vec<Stream>,
}

impl ClusterIpTcp {
    fn print(&self, socket_programs: &SocketPrograms) {
        for (kind, title) in [
            (Kind::RoundTrips, "round trips over one connection (TCP_RR)"),
            (
                Kind::Connections,
                "connections, one round trip each (TCP_CRR)",
            ),
        ] {
            println!("    {title}:");
            for (name, path) in [
                ("ours, per packet (tc DNAT)", &self.per_packet),
                ("ours, at the socket (--socket-lb on)", &self.socket),
                ("to the backend's pod address", &self.pod_address),
                ("kube-proxy nftables mode", &self.nftables),
            ] {
                println!(
                    "      {name}: {}; {:.1} CPU us a transaction",
                    request_response::summary(path.runs(kind).0),
                    path.cpu_us(kind)
                );
            }
            println!(
                "      rate at the socket / to the pod address: {:.2}; per packet / nftables:                  {:.2}; CPU a transaction, nftables / at the socket: {:.2}",
                self.socket.rate(kind) / self.pod_address.rate(kind),
                self.per_packet.rate(kind) / self.nftables.rate(kind),
                self.nftables.cpu_us(kind) / self.socket.cpu_us(kind)
            );
            // What the translation itself costs: each path's CPU a transaction beyond the
            // pod address's (where nothing is translated), the client's and server's own TCP
            // work taken out.
            let floor = self.pod_address.cpu_us(kind);
            println!(
                "      CPU a transaction beyond the pod address's: per packet {:.1} us, at the \
                 socket {:.1} us, nftables {:.1} us",
                self.per_packet.cpu_us(kind) - floor,
                self.socket.cpu_us(kind) - floor,
                self.nftables.cpu_us(kind) - floor
            );
        }
        // The figure of record: what each path adds to a connection beyond the client's and
        // server's own work. nftables' by difference from the pod address (its own rules,
        // conntrack and NAT, the host's routing); the socket's measured, as its packets then
        // take the pod address's path.
        let nftables_us =
            self.nftables.cpu_us(Kind::Connections) - self.pod_address.cpu_us(Kind::Connections);
        let socket_us = socket_programs.ns_per_connection / 1e3;
        println!(
            "    CPU a connection the path adds (TCP_CRR): at the socket {:.2} us (our socket \
             programs, kernel BPF statistics over {} connections: {}), nftables {:.1} us (by \
             difference from the pod address); nftables / at the socket: {:.1}",
            socket_us,
            socket_programs.connections,
            socket_programs
                .programs
                .iter()
                .map(|(name, (runs, ns))| format!("{name} {runs:.2} runs {ns:.0} ns"))
                .collect::<Vec<_>>()
                .join(", "),
            nftables_us,
            nftables_us / socket_us.max(1e-3)
        );
        if !self.socket_stream.is_empty() {
            let gbps = |r: &Stream| r.gbps;
            let cost = |r: &Stream| r.cpu_seconds_per_gb;
            println!("    one TCP stream (iperf3):");
            for (name, runs) in [
                ("ours, at the socket (--socket-lb on)", &self.socket_stream),
                ("to the backend's pod address", &self.pod_address_stream),
            ] {
                println!(
                    "      {name}: median {:.2} Gbit/s, {:.2} CPU s/GB",
                    median_stream(runs, gbps),
                    median_stream(runs, cost)
                );
            }
            println!(
                "      throughput at the socket / to the pod address: {:.2}; CPU s/GB, pod \
                 address / at the socket: {:.2}",
                median_stream(&self.socket_stream, gbps)
                    / median_stream(&self.pod_address_stream, gbps),
                median_stream(&self.pod_address_stream, cost)
                    / median_stream(&self.socket_stream, cost)
            );
        }
    }
}

/// Round trips and short connections through ours and through nftables, round by round.
#[derive(Default, Serialize)]
struct TcpComparison {
    dataplane_rr: Vec<Transactions>,
    nftables_rr: Vec<Transactions>,
    dataplane_crr: Vec<Transactions>,
    nftables_crr: Vec<Transactions>,
    /// Medians of the rates, ours over nftables.
    rr_ratio: f64,
    crr_ratio: f64,
}

impl TcpComparison {
    /// Times both kinds from `netns` to `target` (one side of the comparison).
    fn measure(
        netns: &str,
        target: &str,
        seconds: u64,
    ) -> anyhow::Result<(Transactions, Transactions)> {
        Ok((
            request_response::measure(netns, Kind::RoundTrips, target, seconds)?,
            request_response::measure(netns, Kind::Connections, target, seconds)?,
        ))
    }

    fn push(&mut self, ours: (Transactions, Transactions), theirs: (Transactions, Transactions)) {
        self.dataplane_rr.push(ours.0);
        self.dataplane_crr.push(ours.1);
        self.nftables_rr.push(theirs.0);
        self.nftables_crr.push(theirs.1);
        let rate = |r: &Transactions| r.per_second;
        self.rr_ratio = median_of(&self.dataplane_rr, rate) / median_of(&self.nftables_rr, rate);
        self.crr_ratio = median_of(&self.dataplane_crr, rate) / median_of(&self.nftables_crr, rate);
    }

    fn print(&self, ours: &str, theirs: &str) {
        println!("    round trips over one connection (TCP_RR):");
        println!(
            "      dataplane ({ours}): {}",
            request_response::summary(&self.dataplane_rr)
        );
        println!(
            "      nftables ({theirs}): {}",
            request_response::summary(&self.nftables_rr)
        );
        println!(
            "      ratio of rates dataplane / nftables: {:.2}",
            self.rr_ratio
        );
        println!("    connections, one round trip each (TCP_CRR):");
        println!(
            "      dataplane ({ours}): {}",
            request_response::summary(&self.dataplane_crr)
        );
        println!(
            "      nftables ({theirs}): {}",
            request_response::summary(&self.nftables_crr)
        );
        println!(
            "      ratio of rates dataplane / nftables: {:.2}",
            self.crr_ratio
        );
    }
}

/// kube-proxy's nftables mode for one ClusterIP with two endpoints: UDP 80 and TCP 81.
fn nftables_rules(backends: &[&Pod]) -> String {
    format!(
        "table ip kube-proxy {{
  map service-ips {{
    type ipv4_addr . inet_proto . inet_service : verdict
    elements = {{ {SERVICE_IP} . udp . 80 : goto service-blast,
                 {SERVICE_IP} . tcp . {RR_PORT} : goto service-rr }}
  }}
  chain nat-prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    jump services
  }}
  chain services {{
    ip daddr . meta l4proto . th dport vmap @service-ips
  }}
  chain service-blast {{
    numgen random mod 2 vmap {{ 0 : goto endpoint-0, 1 : goto endpoint-1 }}
  }}
  chain endpoint-0 {{
    meta l4proto udp dnat to {a}:8080
  }}
  chain endpoint-1 {{
    meta l4proto udp dnat to {b}:8080
  }}
  chain service-rr {{
    numgen random mod 2 vmap {{ 0 : goto endpoint-rr-0, 1 : goto endpoint-rr-1 }}
  }}
  chain endpoint-rr-0 {{
    meta l4proto tcp dnat to {a}:{RR_TARGET}
  }}
  chain endpoint-rr-1 {{
    meta l4proto tcp dnat to {b}:{RR_TARGET}
  }}
}}
",
        a = backends[0].ip,
        b = backends[1].ip
    )
}

/// Packets received on `iface` in `netns` so far.
fn rx_packets(netns: &str, iface: &str) -> anyhow::Result<u64> {
    let out = exec_in(netns, &["cat", "/proc/net/dev"])?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{iface}:")))
        .with_context(|| format!("no {iface} in /proc/net/dev of {netns}"))?;
    let fields: Vec<&str> = line
        .split(':')
        .nth(1)
        .unwrap_or("")
        .split_whitespace()
        .collect();
    Ok(fields.get(1).context("rx packets")?.parse()?)
}

/// Blasts for `seconds` from `client` and returns the packets per second `counted` (network
/// namespace and interface) received.
fn blast(
    client: &Pod,
    counted: &[(&str, &str)],
    seconds: u64,
    raw_gateway: Option<&str>,
) -> anyhow::Result<f64> {
    let source = client.ip.to_string();
    let target = format!("{SERVICE_IP}:80");
    let sample = blast_from(
        &client.netns,
        &source,
        &target,
        counted,
        seconds,
        raw_gateway,
    )?;
    Ok(sample.pps)
}

/// One blast: the packets a second that arrived where counted, and the CPUs the whole
/// machine kept busy on average meanwhile.
#[derive(Clone, Copy)]
struct Sample {
    pps: f64,
    busy_cpus: f64,
}

impl Sample {
    /// The machine's CPU time a packet delivered, whatever CPUs it ran on.
    fn cpu_ns(self) -> f64 {
        self.busy_cpus * 1e9 / self.pps
    }
}

/// As [`blast`], from any namespace (`source`: its address) to `target` (address:port).
fn blast_from(
    netns: &str,
    source: &str,
    target: &str,
    counted: &[(&str, &str)],
    seconds: u64,
    raw_gateway: Option<&str>,
) -> anyhow::Result<Sample> {
    let received = || {
        counted
            .iter()
            .map(|(netns, iface)| rx_packets(netns, iface))
            .sum::<anyhow::Result<u64>>()
    };
    let before = received()?;
    let ticks = CpuTicks::read()?;
    let blaster = std::env::current_exe()?.with_file_name("udp_blast");
    let out = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{netns}"))
        .arg(&blaster)
        .arg(target)
        .args(["--seconds", &seconds.to_string()])
        .args(match raw_gateway {
            Some(mac) => vec![
                "--raw".to_owned(),
                "eth0".to_owned(),
                "--source".to_owned(),
                source.to_owned(),
                "--gateway-mac".to_owned(),
                mac.to_owned(),
            ],
            None => Vec::new(),
        })
        .output()
        .context("running udp_blast")?;
    let busy_cpus = ticks.busy_cpus_until(CpuTicks::read()?);
    if !out.status.success() {
        bail!("udp_blast: {}", String::from_utf8_lossy(&out.stderr));
    }
    let after = received()?;
    Ok(Sample {
        pps: (after - before) as f64 / seconds as f64,
        busy_cpus,
    })
}

/// The index of `iface` in `netns`.
fn interface_index(netns: &str, iface: &str) -> anyhow::Result<u32> {
    // `ip -o link show` lines start with "<index>: <name>".
    let out = exec_in(netns, &["ip", "-o", "link", "show", "dev", iface])?;
    String::from_utf8_lossy(&out.stdout)
        .split(':')
        .next()
        .unwrap_or("")
        .trim()
        .parse()
        .with_context(|| format!("ifindex of {iface} in {netns}"))
}

/// The test bed's programs loaded on their own (no agent), with the redirect floor attached to
/// the ingress of `iface` in `netns` and sending everything into the pod behind
/// `target_ifindex`. Detached when dropped.
fn redirect_floor(netns: &str, iface: &str, target_ifindex: u32) -> anyhow::Result<Testbed> {
    let mut testbed = Testbed::load()?;
    let mut target: aya::maps::Array<_, u32> = testbed.typed_map(BASELINE_REDIRECT)?;
    target.set(0, target_ifindex, 0)?;
    let program = testbed.classifier(PROG_TC_REDIRECT_BASELINE)?;
    // The interface name resolves in the calling thread's namespace.
    in_netns(netns, || {
        program.attach(iface, aya::programs::TcAttachType::Ingress)?;
        Ok(())
    })?;
    Ok(testbed)
}

/// Runs and total run time (ns) of each of the agent's programs, by name, from its status
/// report.
fn program_costs(agent: &Agent) -> anyhow::Result<BTreeMap<String, (u64, u64)>> {
    let status = agent.status_json()?;
    let programs = status["programs"]
        .as_array()
        .context("programs in the agent's status")?;
    Ok(programs
        .iter()
        .filter_map(|p| {
            let name = p["name"].as_str()?.to_owned();
            Some((name, (p["runs"].as_u64()?, p["run_time_ns"].as_u64()?)))
        })
        .collect())
}

/// Runs and total run time (ns) of one of the agent's programs, from its status report.
fn program_cost(agent: &Agent, name: &str) -> anyhow::Result<(u64, u64)> {
    program_costs(agent)?
        .get(name)
        .copied()
        .with_context(|| format!("{name} in the agent's status"))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    dataplane_tests::topology::agents_as_deployed();
    anyhow::ensure!(
        args.rounds > 0 && args.seconds > 0 && args.node_port_rounds() > 0,
        "rounds, node-port rounds and seconds must be positive"
    );
    if args.node_port_only {
        let results = NodePortFabrics::measure(&args)?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&results)?);
        } else {
            results.print(&args);
        }
        return Ok(());
    }
    let topology = Topology::build_with(1, 3, Mode::Overlay)?;
    let node = topology.node(0);
    let client = &node.pods[0];
    let backends = [&node.pods[1], &node.pods[2]];
    let ports = [
        ServicePort {
            name: "blast",
            port: 80,
            protocol: "UDP",
            target: 8080,
        },
        ServicePort {
            name: "rr",
            port: RR_PORT,
            protocol: "TCP",
            target: RR_TARGET,
        },
        ServicePort {
            name: "stream",
            port: STREAM_PORT,
            protocol: "TCP",
            target: STREAM_PORT,
        },
    ];
    let service = cluster_ip_manifests("blast", SERVICE_IP, &ports, &backends);
    topology.add_manifest("blast.yaml", &service)?;
    // The backends count and discard the datagrams at their interface (no socket, no ICMP
    // answers), so the rate measures the way to them rather than their own stack.
    for pod in backends {
        run_in(&pod.netns, &["nft", "add", "table", "netdev", "sink"])?;
        let chain = "{ type filter hook ingress device eth0 priority 0; policy accept; }";
        run_in(
            &pod.netns,
            &["nft", "add", "chain", "netdev", "sink", "drops", chain],
        )?;
        // Only the benchmark's datagrams: ARP must still be answered for the nftables path.
        // Port 80 too: the floor delivers them untranslated.
        let rule = [
            "nft",
            "add",
            "rule",
            "netdev",
            "sink",
            "drops",
            "udp",
            "dport",
            "{ 80, 8080 }",
            "drop",
        ];
        run_in(&pod.netns, &rule)?;
    }
    let rules = std::env::temp_dir().join(dataplane_tests::unique_name("nft"));
    std::fs::write(&rules, nftables_rules(&backends))?;
    // The frames' destination MAC: the host side of the client's veth (its gateway).
    let link = exec_in(
        &node.netns,
        &["ip", "-o", "link", "show", &client.host_iface],
    )?;
    let link = String::from_utf8_lossy(&link.stdout).to_string();
    let gateway_mac = link
        .split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .context("gateway MAC")?
        .to_owned();
    let at_backends: Vec<(&str, &str)> = backends
        .iter()
        .map(|p| (p.netns.as_str(), "eth0"))
        .collect();
    let at_gateway = [(node.netns.as_str(), client.host_iface.as_str())];
    // The sender alone: its datagrams dropped as they arrive on the host side of its veth
    // (the interface's rx counter counts them before the hook).
    let drop_chain = format!(
        "{{ type filter hook ingress device {} priority 0; policy accept; }}",
        client.host_iface
    );
    let sender_only: [&[&str]; 3] = [
        &["nft", "add", "table", "netdev", "sender-only"],
        &[
            "nft",
            "add",
            "chain",
            "netdev",
            "sender-only",
            "drop-blast",
            &drop_chain,
        ],
        &[
            "nft",
            "add",
            "rule",
            "netdev",
            "sender-only",
            "drop-blast",
            "udp",
            "dport",
            "80",
            "drop",
        ],
    ];
    let backend_host_ifindex = interface_index(&node.netns, &backends[0].host_iface)?;
    let mut results = Vec::new();
    for raw in [None, Some(gateway_mac.as_str())] {
        let (mut ours, mut nft, mut sender, mut floor) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..args.rounds {
            {
                let _agent = node.start_agent()?;
                ours.push(blast(client, &at_backends, args.seconds, raw)?);
            }
            run_in(&node.netns, &["nft", "-f", &rules.display().to_string()])?;
            let result = blast(client, &at_backends, args.seconds, raw);
            sh_in(&node.netns, "nft delete table ip kube-proxy")?;
            nft.push(result?);
            for command in sender_only {
                run_in(&node.netns, command)?;
            }
            let result = blast(client, &at_gateway, args.seconds, raw);
            sh_in(&node.netns, "nft delete table netdev sender-only")?;
            sender.push(result?);
            {
                let _floor = redirect_floor(&node.netns, &client.host_iface, backend_host_ifindex)?;
                floor.push(blast(client, &at_backends, args.seconds, raw)?);
            }
        }
        results.push(Comparison::new(ours, nft, sender, floor));
    }
    // TCP request/response through the ClusterIP, ours then nftables, round by round.
    let _servers = backends
        .iter()
        .map(|pod| Server::start(&pod.netns, RR_TARGET))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let _stream_servers = backends
        .iter()
        .map(|pod| {
            Command::new("nsenter")
                .arg(format!("--net=/run/netns/{}", pod.netns))
                .args(["iperf3", "-s", "-p", &STREAM_PORT.to_string()])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .map(KillOnDrop)
                .context("starting iperf3 server")
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    std::thread::sleep(std::time::Duration::from_millis(500));
    let rr_target = format!("{SERVICE_IP}:{RR_PORT}");
    let pod_target = format!("{}:{RR_TARGET}", backends[0].ip);
    let mut cluster_ip_tcp = ClusterIpTcp::default();
    for _ in 0..args.rounds {
        {
            let _agent = node.start_agent_with(&["--socket-lb", "off"])?;
            cluster_ip_tcp
                .per_packet
                .measure(&client.netns, &rr_target, args.seconds)?;
            cluster_ip_tcp
                .pod_address
                .measure(&client.netns, &pod_target, args.seconds)?;
            let stream = Stream::measure(&client.netns, &backends[0].ip.to_string(), args.seconds)?;
            cluster_ip_tcp.pod_address_stream.push(stream);
        }
        {
            let _agent = node.start_agent_with(&["--socket-lb", "on"])?;
            cluster_ip_tcp
                .socket
                .measure(&client.netns, &rr_target, args.seconds)?;
            let stream = Stream::measure(&client.netns, SERVICE_IP, args.seconds)?;
            cluster_ip_tcp.socket_stream.push(stream);
        }
        run_in(&node.netns, &["nft", "-f", &rules.display().to_string()])?;
        let theirs = cluster_ip_tcp
            .nftables
            .measure(&client.netns, &rr_target, args.seconds);
        sh_in(&node.netns, "nft delete table ip kube-proxy")?;
        theirs?;
    }
    let tc_program_ns = {
        let agent = node.start_agent()?;
        // On only for this run: the statistics' clock reads would tax the compared rates.
        let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)
            .context("enabling the kernel's BPF run-time statistics")?;
        let before = program_cost(&agent, PROG_FROM_POD)?;
        blast(client, &at_backends, args.seconds, None)?;
        let after = program_cost(&agent, PROG_FROM_POD)?;
        anyhow::ensure!(after.0 > before.0, "{PROG_FROM_POD} did not run");
        (after.1 - before.1) as f64 / (after.0 - before.0) as f64
    };
    let socket_programs = {
        let agent = node.start_agent_with(&["--socket-lb", "on"])?;
        let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)
            .context("enabling the kernel's BPF run-time statistics")?;
        let before = program_costs(&agent)?;
        request_response::measure(&client.netns, Kind::Connections, &rr_target, args.seconds)?;
        SocketPrograms::new(&before, &program_costs(&agent)?)?
    };
    let _ = std::fs::remove_file(&rules);
    drop(topology);
    let raw_frames = results.pop().context("raw results")?;
    let socket = results.pop().context("socket results")?;
    let node_port = NodePortFabrics::measure(&args)?;
    let report = Report {
        rounds: args.rounds,
        node_port_rounds: args.node_port_rounds(),
        seconds: args.seconds,
        socket,
        raw_frames,
        node_port,
        cluster_ip_tcp,
        tc_program_ns,
        socket_programs,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "service packet rate, UDP to a ClusterIP with 2 same-node backends ({} x {} s alternating)",
        args.rounds, args.seconds
    );
    let cluster_ip = ("tc DNAT, redirect into the pod", "kube-proxy nftables mode");
    report.socket.print(
        "UDP socket in the client pod",
        cluster_ip.0,
        cluster_ip.1,
        "",
        "4",
    );
    report.raw_frames.print(
        "prebuilt frames on the client pod's interface (AF_PACKET)",
        cluster_ip.0,
        cluster_ip.1,
        "",
        "4",
    );
    println!(
        "  our tc program per packet (tc_from_pod, kernel BPF statistics, \
         their clock reads included): {:.0} ns",
        report.tc_program_ns
    );
    println!("  TCP request/response from the client pod to the ClusterIP's TCP port:");
    report.cluster_ip_tcp.print(&report.socket_programs);
    report.node_port.print(&args);
    Ok(())
}

fn print_node_port(args: &Args, fabric: Fabric, results: &NodePortResults) {
    println!(
        "NodePort packet rate, UDP from an external host to node 0, backend on node 1 ({} x {} s alternating; {})",
        args.node_port_rounds(),
        args.seconds,
        fabric.describe()
    );
    let ours = "XDP DNAT + masquerade + Geneve, XDP_TX";
    results.routed.print(
        "UDP socket on the external host",
        ours,
        "kube-proxy nftables NodePort DNAT + masquerade, routed",
        "1.1",
        "",
    );
    results.vxlan.print(
        "UDP socket on the external host",
        ours,
        "kube-proxy nftables NodePort DNAT + masquerade, kernel VXLAN to node 1",
        "1.5",
        "",
    );
    println!("  TCP request/response from the external host to the NodePort's TCP port:");
    results
        .tcp_routed
        .print("tc and XDP, Geneve", "nftables, routed");
    results
        .tcp_vxlan
        .print("tc and XDP, Geneve", "nftables, kernel VXLAN");
    println!("  The same with our uplinks on tc alone (--uplink-hook tc, no XDP):");
    let ours_tc = "tc DNAT + masquerade + Geneve, redirect";
    results.tc_routed.print(
        "UDP socket on the external host",
        ours_tc,
        "kube-proxy nftables NodePort DNAT + masquerade, routed",
        "1.1",
        "",
    );
    results.tc_vxlan.print(
        "UDP socket on the external host",
        ours_tc,
        "kube-proxy nftables NodePort DNAT + masquerade, kernel VXLAN to node 1",
        "1.5",
        "",
    );
    println!("  TCP request/response, uplinks on tc:");
    results
        .tc_tcp_routed
        .print("tc, Geneve", "nftables, routed");
    results
        .tc_tcp_vxlan
        .print("tc, Geneve", "nftables, kernel VXLAN");
    results.programs.print();
}

const NODE_PORT: u16 = 30090;
/// The NodePort of the service's TCP port (request/response).
const RR_NODE_PORT: u16 = 30091;

/// kube-proxy's nftables mode for one NodePort service with one endpoint (UDP for the
/// packet rate, TCP for request/response): DNAT to the endpoint, marked for masquerade as
/// traffic from outside with externalTrafficPolicy Cluster.
fn nftables_node_port_rules(backend: &Pod) -> String {
    format!(
        "table ip kube-proxy {{
  map service-nodeports {{
    type inet_proto . inet_service : verdict
    elements = {{ udp . {NODE_PORT} : goto external-blast, tcp . {RR_NODE_PORT} : goto external-rr }}
  }}
  chain nat-prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    fib daddr type local ip daddr != 127.0.0.0/8 jump nodeports
  }}
  chain nodeports {{
    meta l4proto . th dport vmap @service-nodeports
  }}
  chain external-blast {{
    meta mark set mark or 0x4000
    goto endpoint-0
  }}
  chain endpoint-0 {{
    meta l4proto udp dnat to {b}:8080
  }}
  chain external-rr {{
    meta mark set mark or 0x4000
    goto endpoint-rr-0
  }}
  chain endpoint-rr-0 {{
    meta l4proto tcp dnat to {b}:{RR_TARGET}
  }}
  chain nat-postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    mark and 0x4000 != 0 masquerade
  }}
}}
",
        b = backend.ip
    )
}

/// The NodePort comparisons: the UDP packet rate and TCP request/response, against nftables
/// with node 1's pods routed and carried by the kernel's VXLAN device.
#[derive(Serialize)]
struct NodePortResults {
    /// The UDP packet rate, the nftables side routed over the underlay.
    #[serde(rename = "node_port")]
    routed: Comparison,
    /// The same, the nftables side carried to node 1 by the kernel's VXLAN device.
    #[serde(rename = "node_port_vxlan")]
    vxlan: Comparison,
    /// TCP request/response, nftables routed and over the kernel's VXLAN device.
    #[serde(rename = "node_port_tcp")]
    tcp_routed: TcpComparison,
    #[serde(rename = "node_port_tcp_vxlan")]
    tcp_vxlan: TcpComparison,
    /// The same four with our uplinks on tc alone (`--uplink-hook tc`).
    #[serde(rename = "node_port_tc")]
    tc_routed: Comparison,
    #[serde(rename = "node_port_tc_vxlan")]
    tc_vxlan: Comparison,
    #[serde(rename = "node_port_tc_tcp")]
    tc_tcp_routed: TcpComparison,
    #[serde(rename = "node_port_tc_tcp_vxlan")]
    tc_tcp_vxlan: TcpComparison,
    #[serde(rename = "node_port_programs")]
    programs: NodePortPrograms,
}

/// One of our programs on one node, over a NodePort run with the kernel's BPF statistics on.
#[derive(Serialize)]
struct ProgramShare {
    node: usize,
    program: String,
    runs_per_packet: f64,
    ns_per_run: f64,
    ns_per_packet: f64,
}

/// Where a NodePort packet's time goes in our programs: each program that ran, on each
/// node, per packet delivered to the backend; the rest of the path is the kernel's (veth
/// hops, the stack on node 1, the backend's interface).
#[derive(Serialize)]
struct NodePortPrograms {
    delivered_pps: f64,
    /// 1 s over the rate: the time per packet of the path's slowest stage.
    ns_per_packet: f64,
    programs: Vec<ProgramShare>,
    programs_ns_per_packet: f64,
}

impl NodePortPrograms {
    /// From each node's program costs before and after `packets` delivered at `pps`.
    fn new(
        before: &[BTreeMap<String, (u64, u64)>],
        after: &[BTreeMap<String, (u64, u64)>],
        pps: f64,
        packets: f64,
    ) -> Self {
        let mut programs = Vec::new();
        for (node, (before, after)) in before.iter().zip(after).enumerate() {
            for (program, &(runs, ns)) in after {
                let (runs_before, ns_before) = before.get(program).copied().unwrap_or((0, 0));
                let (runs, ns) = (runs - runs_before, ns - ns_before);
                // A program that ran for a few stray packets (ARP, the agent's probes) is not
                // on the path.
                if (runs as f64) < packets / 100.0 {
                    continue;
                }
                programs.push(ProgramShare {
                    node,
                    program: program.clone(),
                    runs_per_packet: runs as f64 / packets,
                    ns_per_run: ns as f64 / runs as f64,
                    ns_per_packet: ns as f64 / packets,
                });
            }
        }
        Self {
            delivered_pps: pps,
            ns_per_packet: 1e9 / pps,
            programs_ns_per_packet: programs.iter().map(|p| p.ns_per_packet).sum(),
            programs,
        }
    }

    fn print(&self) {
        println!(
            "  our programs per NodePort packet (kernel BPF statistics over an extra run at {:.0} pkt/s, \
             {:.0} ns a packet; their clock reads included):",
            self.delivered_pps, self.ns_per_packet
        );
        for p in &self.programs {
            println!(
                "    node {} {}: {:.2} runs a packet, {:.0} ns a run, {:.0} ns a packet",
                p.node, p.program, p.runs_per_packet, p.ns_per_run, p.ns_per_packet
            );
        }
        println!(
            "    all our programs: {:.0} ns a packet; the rest is the kernel's",
            self.programs_ns_per_packet
        );
    }
}

/// Rounds of: our agents on both nodes; nftables on node 0 with node 1's pod CIDR routed over
/// the underlay; nftables with both nodes' pod CIDRs carried by the kernel's VXLAN device;
/// then the sender alone (dropped as it reaches node 0). All on `fabric`.
fn node_port_comparison(args: &Args, fabric: Fabric) -> anyhow::Result<NodePortResults> {
    let mut topology = Topology::build_with(2, 1, Mode::Overlay)?;
    let external = topology.add_external_host()?;
    if fabric == Fabric::Xdp {
        topology.switch_in_xdp()?;
    }
    let backend = topology.node(1).pods[0].clone();
    let service = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: blast, namespace: default}}\n\
         spec: {{type: NodePort, clusterIP: 10.96.0.11, ports: [\
         {{name: blast, port: 80, protocol: UDP, targetPort: 8080, nodePort: {NODE_PORT}}}, \
         {{name: rr, port: {RR_PORT}, protocol: TCP, targetPort: {RR_TARGET}, nodePort: {RR_NODE_PORT}}}]}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: blast-1, namespace: default, labels: {{kubernetes.io/service-name: blast}}}}\n\
         addressType: IPv4\nports: [{{name: blast, port: 8080, protocol: UDP}}, {{name: rr, port: {RR_TARGET}, protocol: TCP}}]\n\
         endpoints: [{{addresses: [{ip}], nodeName: {node}, conditions: {{ready: true}}}}]\n",
        ip = backend.ip,
        node = dataplane_tests::topology::node_name(1),
    );
    topology.add_manifest("blast.yaml", &service)?;
    sink_udp(&backend.netns, "eth0", 8080)?;
    let _server = Server::start(&backend.netns, RR_TARGET)?;
    let nodes = topology.nodes.clone();
    let (node0, node1) = (&nodes[0], &nodes[1]);
    let target = format!("{}:{NODE_PORT}", node0.underlay_ip);
    let rr_target = format!("{}:{RR_NODE_PORT}", node0.underlay_ip);
    let source = external.ip.to_string();
    let rules = std::env::temp_dir().join(dataplane_tests::unique_name("nft"));
    std::fs::write(&rules, nftables_node_port_rules(&backend))?;
    let route = format!(
        "{} via {}",
        dataplane_tests::topology::pod_cidr(1),
        node1.underlay_ip
    );
    let at_backend = [(backend.netns.as_str(), "eth0")];
    let at_node = [(node0.netns.as_str(), "eth0")];
    let blast = |counted: &[(&str, &str)]| {
        blast_from(
            &external.netns,
            &source,
            &target,
            counted,
            args.seconds,
            None,
        )
    };
    let tcp = || TcpComparison::measure(&external.netns, &rr_target, args.seconds);
    let (mut ours, mut routed, mut vxlan, mut sender) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut tcp_routed, mut tcp_vxlan) = (TcpComparison::default(), TcpComparison::default());
    let mut ours_tc = Vec::new();
    let (mut tc_tcp_routed, mut tc_tcp_vxlan) =
        (TcpComparison::default(), TcpComparison::default());
    let hook = |name: &'static str| ["--uplink-hook", name];
    for _ in 0..args.node_port_rounds() {
        let ours_tcp = {
            let _agents = (
                node0.start_agent_with(&hook("xdp"))?,
                node1.start_agent_with(&hook("xdp"))?,
            );
            ours.push(blast(&at_backend)?);
            tcp()?
        };
        let ours_tc_tcp = {
            let _agents = (
                node0.start_agent_with(&hook("tc"))?,
                node1.start_agent_with(&hook("tc"))?,
            );
            ours_tc.push(blast(&at_backend)?);
            tcp()?
        };
        run_in(&node0.netns, &["nft", "-f", &rules.display().to_string()])?;
        // kube-proxy's world routes the pod CIDRs over the underlay: the agent's management
        // port (and its route to node 1's pods), which outlives the agent, goes first.
        let _ = sh_in(
            &node0.netns,
            &format!("ip link del {}", dataplane_user::mgmt::HOST_SIDE),
        );
        sh_in(&node0.netns, &format!("ip route add {route}"))?;
        let result = blast(&at_backend).and_then(|sample| Ok((sample, tcp()?)));
        sh_in(&node0.netns, &format!("ip route del {route}"))?;
        let (sample, theirs) = result?;
        routed.push(sample);
        tcp_routed.push(ours_tcp, theirs);
        tc_tcp_routed.push(ours_tc_tcp, theirs);
        // An overlay cluster without us: the pod CIDRs reach the other node only through
        // the kernel's VXLAN device.
        kernel_vxlan_up(&nodes)?;
        let result = blast(&at_backend).and_then(|sample| Ok((sample, tcp()?)));
        kernel_vxlan_down(&nodes)?;
        sh_in(&node0.netns, "nft delete table ip kube-proxy")?;
        let (sample, theirs) = result?;
        vxlan.push(sample);
        tcp_vxlan.push(ours_tcp, theirs);
        tc_tcp_vxlan.push(ours_tc_tcp, theirs);
        sink_udp(&node0.netns, "eth0", NODE_PORT)?;
        let result = blast(&at_node);
        sh_in(&node0.netns, "nft delete table netdev sink")?;
        sender.push(result?);
    }
    let _ = std::fs::remove_file(&rules);
    // On only for this run: the statistics' clock reads would tax the compared rates.
    let programs = {
        let agents = [
            node0.start_agent_with(&hook("xdp"))?,
            node1.start_agent_with(&hook("xdp"))?,
        ];
        let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)
            .context("enabling the kernel's BPF run-time statistics")?;
        let costs = || {
            agents
                .iter()
                .map(program_costs)
                .collect::<anyhow::Result<Vec<_>>>()
        };
        let before = costs()?;
        let pps = blast(&at_backend)?.pps;
        let after = costs()?;
        NodePortPrograms::new(&before, &after, pps, pps * args.seconds as f64)
    };
    let rates = |samples: &[Sample]| samples.iter().map(|s| s.pps).collect::<Vec<_>>();
    Ok(NodePortResults {
        routed: Comparison::new(rates(&ours), rates(&routed), rates(&sender), Vec::new())
            .with_cpu(CpuCost::new(&ours, &routed, &sender)),
        vxlan: Comparison::new(rates(&ours), rates(&vxlan), rates(&sender), Vec::new())
            .with_cpu(CpuCost::new(&ours, &vxlan, &sender)),
        tcp_routed,
        tcp_vxlan,
        tc_routed: Comparison::new(rates(&ours_tc), rates(&routed), rates(&sender), Vec::new())
            .with_cpu(CpuCost::new(&ours_tc, &routed, &sender)),
        tc_vxlan: Comparison::new(rates(&ours_tc), rates(&vxlan), rates(&sender), Vec::new())
            .with_cpu(CpuCost::new(&ours_tc, &vxlan, &sender)),
        tc_tcp_routed,
        tc_tcp_vxlan,
        programs,
    })
}

/// Drops UDP to `port` as it arrives on `iface` in `netns` (its rx counter still counts it),
/// in a netdev table `sink`.
fn sink_udp(netns: &str, iface: &str, port: u16) -> anyhow::Result<()> {
    run_in(netns, &["nft", "add", "table", "netdev", "sink"])?;
    let chain = format!("{{ type filter hook ingress device {iface} priority 0; policy accept; }}");
    run_in(
        netns,
        &["nft", "add", "chain", "netdev", "sink", "drops", &chain],
    )?;
    let port = port.to_string();
    run_in(
        netns,
        &[
            "nft", "add", "rule", "netdev", "sink", "drops", "udp", "dport", &port, "drop",
        ],
    )
}

/// A child process killed (and reaped) when dropped.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
