//! The main job on its embedded default: simulated nodes in network namespaces, the real agent
//! on each node, pods created through the CNI plugin as a container runtime creates them, traffic between pods and to a Service, an EgressFirewall letting a
//! pod reach only one port outside the cluster (with its audit log), an egress IP that one
//! pod leaves the cluster from (assigned by the egress IP controller), a malformed frame
//! refused, and what each agent reports. Everything it creates is removed when it ends, also on error.

use std::process::Command;

use clap::Parser;
use dataplane_common::{DropReason, Hook, PacketClass};
use dataplane_tests::{
    cni, egress_topology, packets,
    service_bed::{
        ServicePort, cluster_ip_manifests, echo_backend, echo_server, probe, tcp_answers,
    },
    topology::{Agent, Mode, Node, Pod, Topology, dataplane_binary},
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
    let mut topology = Topology::build_with(args.nodes, 0, Mode::Overlay)?;
    // A host outside the cluster, and a namespace whose pods may reach only its port 8080.
    let external = topology.add_external_host()?;
    topology.route_pod_networks(&external)?;
    // Every node may hold egress IPs of its underlay subnet.
    topology.set_node_metadata(egress_topology::ASSIGNABLE)?;
    // The pods as the API server has them before they run: a namespace of their own each,
    // a Pod object (labels, node, no address yet). The plugin wires them once the agents run;
    // the addresses it will give are foreseeable, so the Service and policies can name them.
    let mut planned = Vec::new();
    let mut pod_objects = Vec::new();
    for n in 0..args.nodes {
        for i in 0..args.pods {
            let namespace = if (n, i) == (0, 0) {
                "restricted"
            } else {
                "default"
            };
            let (container, pod) = cni::planned_pod(&mut topology, n, i, namespace)?;
            pod_objects.push(cni::pod_manifest(&pod, n));
            topology.nodes[n].pods.push(pod.clone());
            planned.push((n, container, pod));
        }
    }
    topology.add_manifest("pods.yaml", &pod_objects.join("---\n"))?;
    topology.add_manifest(
        "restricted.yaml",
        &restricted_manifests(&external.ip.to_string()),
    )?;
    let external_server = echo_server(&external.netns, "external", false)?;
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
            .map(|p| format!("{}/{}", p.namespace, p.name))
            .collect();
        println!(
            "   node {} underlay {}: Pod objects {}",
            node.index,
            node.underlay_ip,
            pods.join(", ")
        );
    }

    let first = &topology.nodes[0];

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
        "   namespace restricted ({}): EgressFirewall allows TCP 8080 to {}, denies the rest; audit logged",
        first.pods[0].ip, external.ip
    );
    // An egress IP for the first pod of node 1: the controller (on the outside host, where
    // it reaches every node's agent) assigns it to an assignable node; that node translates.
    let egress_pod = topology.nodes[1].pods[0].clone();
    topology.add_manifest(
        "egressip.yaml",
        &format!(
            "apiVersion: k8s.ovn.org/v1\nkind: EgressIP\nmetadata: {{name: demo}}\n\
             spec: {{egressIPs: [{DEMO_EGRESS_IP}], namespaceSelector: {{matchLabels: {{kubernetes.io/metadata.name: default}}}}, \
             podSelector: {{matchLabels: {{pod: {}}}}}}}\n",
            egress_pod.name
        ),
    )?;
    println!(
        "   EgressIP demo: {} leaves the cluster as {DEMO_EGRESS_IP}",
        egress_pod.ip
    );
    let guarded = topology.nodes[1].pods.last().expect("a pod").clone();
    topology.add_manifest("policy.yaml", &policy_manifest(&guarded.name))?;
    println!(
        "   NetworkPolicy default/only-from-restricted: {} accepts only pods of namespace restricted",
        guarded.ip
    );

    println!(
        "== starting one agent per node (reads the manifests, builds the Geneve overlay, the service and the firewall)"
    );
    let audit_dir = std::env::temp_dir().join(dataplane_tests::unique_name("audit"));
    let audit_log = audit_dir.join("acl-audit-log.log");
    let agents: Vec<Agent> = topology
        .nodes
        .iter()
        .map(|n| {
            n.start_agent_with(&[
                "--audit-log",
                &audit_log.to_string_lossy(),
                // Where the egress IP controller probes the agent.
                "--metrics-address",
                "0.0.0.0:9476",
            ])
        })
        .collect::<anyhow::Result<_>>()?;
    let manifests = topology.nodes[0]
        .manifests
        .clone()
        .ok_or_else(|| anyhow::anyhow!("no manifest directory"))?;
    let controller = egress_topology::start_controller(&external, &manifests);

    println!(
        "== creating the pods through the CNI plugin (dataplane-cni ADD, run as a container runtime runs it)"
    );
    for (n, container, pod) in &planned {
        let conf = cni::conf("1.1.0", &cni::socket(&agents[*n]));
        let started = std::time::Instant::now();
        cni::add_planned(container, pod, &conf)?;
        println!(
            "   {}/{} on node {n}: {}, {} via {}, wired and policed in {} ms",
            pod.namespace,
            pod.name,
            pod.ip,
            pod.ip6.map(|a| a.to_string()).unwrap_or_default(),
            pod.host_iface,
            started.elapsed().as_millis()
        );
    }

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
    summary.push(policy_summary(first, &guarded));
    summary.push(egress_summary(
        &manifests,
        &egress_pod,
        &external.ip.to_string(),
    ));
    drop(controller);
    drop(servers);

    summary.extend(firewall_summary(
        first,
        &external.ip.to_string(),
        &audit_log,
    ));
    drop(external_server);

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

    // What the dataplane would do with one more connection, without sending it.
    let client = first.pods[0].ip.to_string();
    let target = format!("{SERVICE_IP}:80");
    println!(
        "\n== node 0: dataplane trace --from {client} --to {target} (run against copies of the maps)"
    );
    let out = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", first.netns))
        .arg(dataplane_binary())
        .arg("--pin-root")
        .arg(agents[0].pins.root())
        .args(["trace", "--from", &client, "--to", &target])
        .env("RUST_LOG", "warn")
        .output()?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    let traced = String::from_utf8_lossy(&out.stdout);
    summary.push(format!(
        "trace {client} -> {target}: {}",
        if out.status.success() && traced.contains("service_dnat") {
            "translated to a backend, shown above, nothing live changed"
        } else {
            "FAILED"
        }
    ));

    println!("\n== summary");
    for line in &summary {
        println!("   {line}");
    }
    let failed = summary.iter().any(|l| l.contains("FAILED"));
    if failed {
        // What the agents said, to see why.
        for (n, agent) in agents.iter().enumerate() {
            let log = agent.log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            println!("\n== node {n}: the agent's last log lines");
            for line in tail.iter().rev() {
                println!("{line}");
            }
        }
    }
    drop(agents);
    drop(topology);
    let _ = std::fs::remove_dir_all(&audit_dir);
    println!("== agents stopped, namespaces and pins removed");
    anyhow::ensure!(!failed, "some traffic did not flow");
    Ok(())
}

const SERVICE_IP: &str = "10.96.0.10";
const DEMO_EGRESS_IP: &str = "10.99.0.50";

/// Where the controller put the demo's egress IP, and what the outside host sees of the pod.
fn egress_summary(manifests: &std::path::Path, pod: &Pod, external: &str) -> String {
    let holder = egress_topology::holder_of(
        manifests,
        "demo",
        DEMO_EGRESS_IP,
        None,
        std::time::Duration::from_secs(10),
    );
    // The holder programs the status within its 100 ms tick.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let answers = tcp_answers(&pod.netns, external, 8080, 2).unwrap_or_default();
    let seen: Vec<&str> = answers
        .iter()
        .filter_map(|a| a.split_whitespace().nth(1))
        .collect();
    format!(
        "egress IP {DEMO_EGRESS_IP} held by {}: {} -> {external} seen as {}{}",
        holder.as_deref().unwrap_or("nobody"),
        pod.ip,
        seen.join(", "),
        if seen == [DEMO_EGRESS_IP; 2] {
            ""
        } else {
            " FAILED"
        }
    )
}

/// Namespace `restricted` (audit logging on) and its EgressFirewall: TCP 8080 to `external`,
/// nothing else outside the cluster.
fn restricted_manifests(external: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: restricted\n  annotations:\n\
         \x20   k8s.ovn.org/acl-logging: '{{\"deny\":\"alert\",\"allow\":\"notice\"}}'\n\
         ---\napiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\n\
         metadata: {{name: default, namespace: restricted}}\nspec:\n  egress:\n\
         \x20 - {{type: Allow, to: {{cidrSelector: {external}/32}}, ports: [{{protocol: TCP, port: 8080}}]}}\n\
         \x20 - {{type: Deny, to: {{cidrSelector: 0.0.0.0/0}}}}\n"
    )
}

/// A policy isolating `pod` (namespace default): only pods of namespace restricted get in.
fn policy_manifest(pod: &str) -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
         metadata: {{name: only-from-restricted, namespace: default}}\nspec:\n\
         \x20 podSelector: {{matchLabels: {{pod: {pod}}}}}\n  ingress:\n\
         \x20 - from: [{{namespaceSelector: {{matchLabels: {{kubernetes.io/metadata.name: restricted}}}}}}]\n"
    )
}

/// Who reaches the isolated pod: the restricted namespace's pod does, a default one does not.
fn policy_summary(node: &Node, guarded: &Pod) -> String {
    let target = guarded.ip.to_string();
    let probes = [("tcp", target.as_str(), 8080)];
    let answered = |pod: &Pod| {
        probe(pod, &probes)
            .unwrap_or_default()
            .first()
            .is_some_and(|a| a == &target)
    };
    let (allowed, refused) = (answered(&node.pods[0]), !answered(&node.pods[1]));
    format!(
        "NetworkPolicy: restricted {} -> {target}:8080 {}, default {} -> {target}:8080 {}{}",
        node.pods[0].ip,
        if allowed { "answered" } else { "not answered" },
        node.pods[1].ip,
        if refused {
            "no answer (dropped)"
        } else {
            "answered"
        },
        if allowed && refused { "" } else { " FAILED" }
    )
}

/// What the firewalled pod and its unfirewalled neighbour reach outside the cluster, and what
/// the audit log says about it.
fn firewall_summary(node: &Node, external: &str, audit_log: &std::path::Path) -> Vec<String> {
    let probes = [("tcp", external, 8080), ("tcp", external, 9090)];
    let restricted = probe(&node.pods[0], &probes).unwrap_or_default();
    let neighbour = probe(&node.pods[1], &probes).unwrap_or_default();
    let verdict = |seen: Option<&String>, expected: &str| {
        let seen = seen.map_or("nothing", String::as_str);
        let text = match seen {
            "timeout" => "no answer (dropped)".to_owned(),
            "refused" => "refused by the host".to_owned(),
            other => format!("answered by {other}"),
        };
        if seen == expected {
            text
        } else {
            format!("{text} FAILED")
        }
    };
    let mut lines = vec![
        format!(
            "restricted {} -> {external}: TCP 8080 {}, TCP 9090 {} (EgressFirewall)",
            node.pods[0].ip,
            verdict(restricted.first(), "external"),
            verdict(restricted.get(1), "timeout"),
        ),
        format!(
            "default {} -> {external}: TCP 8080 {}, TCP 9090 {} (no firewall)",
            node.pods[1].ip,
            verdict(neighbour.first(), "external"),
            verdict(neighbour.get(1), "refused"),
        ),
    ];
    // The agent writes records as the kernel sends them; give it a moment.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let audit = std::fs::read_to_string(audit_log).unwrap_or_default();
    let records: Vec<&str> = audit.lines().collect();
    let (allowed, denied) = (
        records
            .iter()
            .filter(|l| l.contains("verdict=allow"))
            .count(),
        records
            .iter()
            .filter(|l| l.contains("verdict=drop"))
            .count(),
    );
    lines.push(format!(
        "audit log {}: {allowed} allow and {denied} drop records{}",
        audit_log.display(),
        if allowed >= 1 && denied >= 1 {
            ""
        } else {
            " FAILED"
        }
    ));
    if let Some(last) = records.iter().rev().find(|l| l.contains("verdict=drop")) {
        lines.push(format!("  {last}"));
    }
    lines
}
