//! The main job on its embedded default: simulated nodes with pods in network namespaces, the
//! real agent on each node, traffic between pods, a malformed frame refused, and what each
//! agent reports. Everything it creates is removed when it ends, also on error.

use std::process::Command;

use clap::Parser;
use dataplane_common::{DropReason, Hook, PacketClass};
use dataplane_tests::{
    packets,
    service_bed::{ServicePort, cluster_ip_manifests, echo_backend, tcp_answers},
    topology::{Agent, Mode, Pod, Topology, dataplane_binary},
};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 2)]
    nodes: usize,
    #[arg(long, default_value_t = 2)]
    pods: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        (2..=8).contains(&args.nodes) && (2..=8).contains(&args.pods),
        "--nodes and --pods take 2 to 8"
    );
    println!(
        "== building {} nodes with {} pods each in network namespaces",
        args.nodes, args.pods
    );
    let topology = Topology::build_with(args.nodes, args.pods, Mode::Overlay)?;
    if let Some(dir) = &topology.nodes[0].manifests {
        println!(
            "   cluster state: Kubernetes manifests in {}",
            dir.display()
        );
    }
    for node in &topology.nodes {
        let pods: Vec<String> = node
            .pods
            .iter()
            .map(|p| format!("{} via {}", p.ip, p.host_iface))
            .collect();
        println!(
            "   node {} underlay {}: pods {}",
            node.index,
            node.underlay_ip,
            pods.join(", ")
        );
    }

    let first = &topology.nodes[0];
    let remote = &topology.nodes[1].pods[0];
    let before = first.pods[0].ping(remote.ip, 1)?;
    println!(
        "   before the agents: ping {} -> {} (other node) {}",
        first.pods[0].ip,
        remote.ip,
        if before {
            "answered (unexpected)"
        } else {
            "unanswered: no path between nodes' pods"
        }
    );

    // A ClusterIP Service whose backends are the last pod of every node, each answering TCP on
    // 8080 with its own address (and the client's).
    let backends: Vec<&Pod> = topology
        .nodes
        .iter()
        .filter_map(|n| n.pods.last())
        .collect();
    let http = ServicePort {
        name: "http",
        port: 80,
        protocol: "TCP",
        target: 8080,
    };
    topology.add_manifest(
        "service.yaml",
        &cluster_ip_manifests("web", SERVICE_IP, &[http], &backends),
    )?;
    let mut servers = Vec::new();
    for pod in &backends {
        servers.push(echo_backend(pod, false)?);
    }
    println!(
        "   service default/web {SERVICE_IP}:80 -> port 8080 of {}",
        backends
            .iter()
            .map(|p| p.ip.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );

    println!(
        "== starting one agent per node (reads the manifests, builds the Geneve overlay and the service)"
    );
    let agents: Vec<Agent> = topology
        .nodes
        .iter()
        .map(|n| n.start_agent())
        .collect::<anyhow::Result<_>>()?;

    let mut summary = Vec::new();
    for node in &topology.nodes {
        for pod in &node.pods {
            if pod.ip == first.pods[0].ip {
                continue;
            }
            let ok = first.pods[0].ping(pod.ip, 3)?;
            let scope = if node.index == 0 {
                "same node, redirected"
            } else {
                "cross node, Geneve"
            };
            summary.push(format!(
                "ping {} -> {} ({scope}): {}",
                first.pods[0].ip,
                pod.ip,
                if ok { "3/3 answered" } else { "FAILED" }
            ));
        }
    }

    // Each answer is "<backend> <client seen>"; a client that fails counts as no answers.
    let answers = tcp_answers(&first.pods[0].netns, SERVICE_IP, 80, 12).unwrap_or_default();
    let reached: std::collections::BTreeSet<&str> = answers
        .iter()
        .filter_map(|a| a.split_whitespace().next())
        .collect();
    summary.push(format!(
        "12 TCP connections {} -> {SERVICE_IP}:80: {} answered, backends reached: {}{}",
        first.pods[0].ip,
        answers.len(),
        reached.iter().copied().collect::<Vec<_>>().join(", "),
        if answers.len() == 12 { "" } else { " FAILED" }
    ));
    for mut server in servers {
        let _ = server.kill();
        let _ = server.wait();
    }

    let mut bad = packets::ipv4_udp();
    bad[packets::L3] = 0x44;
    first.pods[1].send_raw_frame(&bad)?;
    let counters = agents[0].counters()?;
    summary.push(format!(
        "malformed frame (IPv4 IHL 4) from {}: dropped as {} ({} counted)",
        first.pods[1].ip,
        DropReason::Ipv4BadIhl.name(),
        counters.drops(DropReason::Ipv4BadIhl)
    ));

    for (node, agent) in topology.nodes.iter().zip(&agents) {
        println!("\n== node {}: dataplane status", node.index);
        let out = Command::new(dataplane_binary())
            .arg("--pin-root")
            .arg(agent.pins.root())
            .arg("--run-dir")
            .arg(&agent.run_dir)
            .arg("status")
            .output()?;
        print!("{}", String::from_utf8_lossy(&out.stdout));
        let c = agent.counters()?;
        summary.push(format!(
            "node {}: {} packets from pods ({} encapsulated, {} redirected locally, {} to a \
             service backend), {} on the underlay ({} decapsulated), {} dropped",
            node.index,
            c.packets(Hook::FromPod, PacketClass::Total),
            c.packets(Hook::FromPod, PacketClass::GeneveEncap),
            c.packets(Hook::FromPod, PacketClass::LocalRedirect),
            c.packets(Hook::FromPod, PacketClass::ServiceDnat),
            c.packets(Hook::Underlay, PacketClass::Total),
            c.packets(Hook::Underlay, PacketClass::GeneveDecap),
            c.drops.iter().map(|d| d.count).sum::<u64>(),
        ));
    }

    println!("\n== summary");
    for line in &summary {
        println!("   {line}");
    }
    let failed = before || summary.iter().any(|l| l.contains("FAILED"));
    drop(agents);
    drop(topology);
    println!("== agents stopped, namespaces and pins removed");
    anyhow::ensure!(!failed, "some traffic did not flow");
    Ok(())
}

const SERVICE_IP: &str = "10.96.0.10";
