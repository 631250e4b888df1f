//! EgressFirewall end to end: a pod of namespace `team` on a two-node overlay cluster whose
//! `default` EgressFirewall allows TCP 8080 and UDP 5353 to an external host and denies the
//! rest. Real TCP and UDP sockets show what passes and what is refused (denied traffic gets no
//! answer at all; allowed traffic to a closed port is refused by the host), while pods of other
//! namespaces, pod-to-pod traffic and NodePort connections from outside are not affected.

use std::{
    process::{Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use dataplane_common::{DropReason, Hook, PacketClass};
use dataplane_tests::{
    privileged::privileged,
    service_bed::{Server, echo_backend, echo_server, one_syn, probe, tcp_answers},
    topology::{
        Mode, PinsCleanup, Topology, dataplane_binary, exec_in, node_name, run_in, underlay_ip,
    },
};

#[test]
fn egress_firewall_allows_and_refuses_real_connections_as_its_rules_say() {
    if !privileged("egress_firewall_allows_and_refuses_real_connections_as_its_rules_say") {
        return;
    }
    let mut topology = Topology::build_with(2, 2, Mode::Overlay).expect("build topology");
    let external = topology.add_external_host().expect("external host");
    let ext = external.ip.to_string();
    topology.route_pod_networks(&external).expect("routes");
    topology.set_pod_namespace(0, 0, "team").expect("team pod");
    let team = topology.node(0).pods[0].clone();
    let neighbour = topology.node(0).pods[1].clone();
    let remote = topology.node(1).pods[1].clone();
    let manifests = format!(
        "apiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\nmetadata: {{name: default, namespace: team}}\n\
         spec:\n  egress:\n\
         \x20 - {{type: Allow, to: {{cidrSelector: {ext}/32}}, ports: [{{protocol: TCP, port: 8080}}]}}\n\
         \x20 - {{type: Allow, to: {{cidrSelector: {ext}/32}}, ports: [{{protocol: UDP, port: 5353}}]}}\n\
         \x20 - {{type: Deny, to: {{cidrSelector: 0.0.0.0/0}}}}\n\
         ---\napiVersion: v1\nkind: Service\nmetadata: {{name: team-web, namespace: team}}\n\
         spec: {{type: NodePort, clusterIP: 10.96.0.40, externalTrafficPolicy: Local, \
         ports: [{{port: 80, targetPort: 8080, nodePort: 30090}}]}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: team-web-1, namespace: team, labels: {{kubernetes.io/service-name: team-web}}}}\n\
         addressType: IPv4\nports: [{{port: 8080, protocol: TCP}}]\n\
         endpoints: [{{addresses: [{team_ip}], nodeName: {node}, conditions: {{ready: true}}}}]\n\
         ---\napiVersion: v1\nkind: Service\nmetadata: {{name: team-any, namespace: team}}\n\
         spec: {{type: NodePort, clusterIP: 10.96.0.41, externalTrafficPolicy: Cluster, \
         ports: [{{port: 80, targetPort: 8080, nodePort: 30091}}]}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: team-any-1, namespace: team, labels: {{kubernetes.io/service-name: team-any}}}}\n\
         addressType: IPv4\nports: [{{port: 8080, protocol: TCP}}]\n\
         endpoints: [{{addresses: [{team_ip}], nodeName: {node}, conditions: {{ready: true}}}}]\n",
        team_ip = team.ip,
        node = node_name(0),
    );
    topology
        .add_manifest("team.yaml", &manifests)
        .expect("manifests");
    let servers: Vec<Server> = vec![
        echo_server(&external.netns, &ext, false).expect("external server"),
        echo_backend(&team, false).expect("team server"),
        echo_backend(&remote, false).expect("remote server"),
    ];
    let agent0 = topology.node(0).start_agent().expect("agent on node 0");
    let _agent1 = topology.node(1).start_agent().expect("agent on node 1");
    let log = agent0.log();
    assert!(log.contains("access control configured"), "{log}");

    // Let the servers and agents settle: the allowed TCP probe retries until it answers.
    tcp_answers(&team.netns, &ext, 8080, 1).expect("allowed TCP to the external host");
    let remote_ip = remote.ip.to_string();
    let team_probes = probe(
        &team,
        &[
            ("tcp", &ext, 8080),
            ("udp", &ext, 5353),
            ("tcp", &ext, 9090),
            ("udp", &ext, 5454),
            ("tcp", &remote_ip, 8080),
            ("udp", &remote_ip, 5353),
        ],
    )
    .expect("probe");
    assert_eq!(
        team_probes,
        vec![
            ext.as_str(),
            ext.as_str(),
            "timeout",
            "timeout",
            &remote_ip,
            &remote_ip
        ],
        "team pod: allowed, allowed, denied, denied, pod network, pod network"
    );
    // Another namespace on the same node: no firewall, the host refuses the closed ports.
    let neighbour_probes = probe(
        &neighbour,
        &[
            ("tcp", &ext, 8080),
            ("tcp", &ext, 9090),
            ("udp", &ext, 5454),
        ],
    )
    .expect("probe");
    assert_eq!(neighbour_probes, vec![ext.as_str(), "refused", "refused"]);

    // A NodePort connection from outside to the team pod: its replies are not judged.
    let node0 = underlay_ip(0).to_string();
    for line in tcp_answers(&external.netns, &node0, 30090, 3).expect("NodePort client") {
        assert_eq!(line, format!("{} {}", team.ip, ext), "{line}");
    }

    // The same through the other node (externalTrafficPolicy: Cluster): node 1 sends the
    // connection on with its own address as the source, and the team pod's answers to that
    // address are answers, not egress its firewall (`Deny 0.0.0.0/0`) would refuse.
    let node1 = underlay_ip(1).to_string();
    for line in tcp_answers(&external.netns, &node1, 30091, 3).expect("NodePort via node 1") {
        assert_eq!(line, format!("{} {}", team.ip, node1), "{line}");
    }
    // The inbound flows are tracked as such.
    let out = std::process::Command::new(dataplane_binary())
        .arg("--pin-root")
        .arg(agent0.pins.root())
        .args(["inspect", "policy"])
        .output()
        .expect("dataplane inspect");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.lines().any(|l| l.contains(&format!("{node1}:"))
            && l.contains(&format!("-> {}:8080", team.ip))
            && l.contains("inbound")),
        "{table}"
    );

    // `dataplane inspect firewall`: the team pod's set and its prefixes.
    let out = std::process::Command::new(dataplane_binary())
        .arg("--pin-root")
        .arg(agent0.pins.root())
        .args(["inspect", "firewall"])
        .output()
        .expect("dataplane inspect");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&format!("pod {} ", team.ip))),
        "{table}"
    );
    assert!(
        table
            .lines()
            .any(|l| l.contains(&format!("{ext}/32")) && l.contains("port table")),
        "{table}"
    );
    assert!(
        table
            .lines()
            .any(|l| l.contains("0.0.0.0/0") && l.contains("deny") && l.trim_end().ends_with('2')),
        "{table}"
    );
    // Counted exactly: one denied SYN and one denied datagram are two firewall drops; one
    // allowed datagram is one packet the firewall allowed (and its answer comes back).
    let before = agent0.counters().expect("counters");
    assert_eq!(one_syn(&team.netns, &ext, 9090).expect("SYN"), "timeout");
    assert_eq!(
        probe(&team, &[("udp", &ext, 5454), ("udp", &ext, 5353)]).expect("probe"),
        vec!["timeout", ext.as_str()]
    );
    let after = agent0.counters().expect("counters");
    assert_eq!(
        after.drops(DropReason::FirewallDenied),
        before.drops(DropReason::FirewallDenied) + 2,
        "{after:?}"
    );
    assert_eq!(
        after.packets(Hook::FromPod, PacketClass::FirewallAllowed),
        before.packets(Hook::FromPod, PacketClass::FirewallAllowed) + 1,
        "{after:?}"
    );
    drop(servers);
}

/// Starts the test bed's DNS server in `netns` on port 53, answering from `answers` (JSON).
fn dns_server(netns: &str, answers: &std::path::Path) -> Server {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/dns_server.py");
    Command::new("nsenter")
        .arg(format!("--net=/run/netns/{netns}"))
        .args(["python3", script])
        .arg(answers)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("DNS server")
        .into()
}

#[test]
fn a_dns_name_rule_follows_the_names_addresses_as_they_change() {
    if !privileged("a_dns_name_rule_follows_the_names_addresses_as_they_change") {
        return;
    }
    let mut topology = Topology::build_with(1, 1, Mode::Overlay).expect("build topology");
    let external = topology.add_external_host().expect("external host");
    let (first, second) = ("10.99.0.100", "10.99.0.101");
    run_in(
        &external.netns,
        &["ip", "addr", "add", &format!("{second}/24"), "dev", "eth0"],
    )
    .expect("second address");
    topology.route_pod_networks(&external).expect("routes");
    topology.set_pod_namespace(0, 0, "team").expect("team pod");
    let team = topology.node(0).pods[0].clone();
    topology
        .add_manifest(
            "firewall.yaml",
            "apiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\nmetadata: {name: default, namespace: team}\n\
             spec:\n  egress:\n\
             \x20 - {type: Allow, to: {dnsName: www.example.com}, ports: [{protocol: TCP, port: 8080}]}\n\
             \x20 - {type: Deny, to: {cidrSelector: 0.0.0.0/0}}\n",
        )
        .expect("manifest");
    let answers = std::env::temp_dir().join(dataplane_tests::unique_name("dns.json"));
    let answer = |address: &str| {
        let json = format!("{{\"www.example.com\": {{\"A\": [\"{address}\"], \"ttl\": 2}}}}");
        std::fs::write(&answers, json).expect("answers");
    };
    answer(first);
    let mut servers = vec![
        dns_server(&external.netns, &answers),
        echo_server(&external.netns, "external", false).expect("server"),
    ];
    sleep(Duration::from_millis(300));
    let agent = topology
        .node(0)
        .start_agent_with(&["--dns-server", first])
        .expect("agent");
    let log = agent.log();
    assert!(log.contains("access control configured"), "{log}");

    let probes = [("tcp", first, 8080), ("tcp", second, 8080)];
    assert_eq!(
        probe(&team, &probes).expect("probe"),
        vec!["external", "timeout"],
        "{}",
        agent.log()
    );

    // The name moves to the second address: within its TTL and the refresh floor, the rule
    // follows it, updated in place.
    answer(second);
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut seen = probe(&team, &probes).expect("probe");
    while seen != ["timeout", "external"] && Instant::now() < deadline {
        sleep(Duration::from_millis(500));
        seen = probe(&team, &probes).expect("probe");
    }
    assert_eq!(seen, vec!["timeout", "external"], "{}", agent.log());
    let log = agent.log();
    assert!(log.contains("updated in place"), "{log}");

    // The server goes away: lookups fail, the last good address stays allowed.
    drop(servers.remove(0));
    let deadline = Instant::now() + Duration::from_secs(15);
    while !agent.log().contains("keeping the last good addresses") && Instant::now() < deadline {
        sleep(Duration::from_millis(500));
    }
    assert!(
        agent.log().contains("keeping the last good addresses"),
        "{}",
        agent.log()
    );
    assert_eq!(
        probe(&team, &probes).expect("probe"),
        vec!["timeout", "external"]
    );

    // The server is back but the name is gone (NXDOMAIN), and the agent restarts meanwhile:
    // the restarted agent starts from the last good address, which stays allowed until a
    // lookup answers.
    std::fs::write(&answers, "{}").expect("answers");
    servers.insert(0, dns_server(&external.netns, &answers));
    let (pins, run_dir) = agent.stop_keeping_pins().expect("stop");
    let _cleanup = PinsCleanup(vec![pins.clone()]);
    let agent = topology
        .node(0)
        .start_agent_at_with(pins, run_dir, &["--dns-server", first])
        .expect("restarted agent");
    let log = agent.log();
    assert!(
        log.contains("DNS names start from the last good addresses"),
        "{log}"
    );
    assert_eq!(
        probe(&team, &probes).expect("probe"),
        vec!["timeout", "external"],
        "{}",
        agent.log()
    );
    let out = Command::new(dataplane_binary())
        .arg("--pin-root")
        .arg(agent.pins.root())
        .args(["inspect", "firewall"])
        .output()
        .expect("dataplane inspect");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains(&format!("{second}/32")), "{table}");
    drop(servers);
    let _ = std::fs::remove_file(&answers);
}

/// The audit log's lines once `done` says it has enough, or after 10 s.
fn audit_lines(path: &std::path::Path, done: impl Fn(&[String]) -> bool) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let lines: Vec<String> = std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect();
        if done(&lines) || Instant::now() > deadline {
            return lines;
        }
        sleep(Duration::from_millis(200));
    }
}

#[test]
fn audited_namespaces_get_ovn_style_audit_lines_within_the_rate_limit() {
    if !privileged("audited_namespaces_get_ovn_style_audit_lines_within_the_rate_limit") {
        return;
    }
    let mut topology = Topology::build_with(1, 2, Mode::Overlay).expect("build topology");
    let external = topology.add_external_host().expect("external host");
    let ext = external.ip.to_string();
    topology.route_pod_networks(&external).expect("routes");
    topology.set_pod_namespace(0, 0, "team").expect("team pod");
    topology
        .set_ovn_config("policyAuditConfig: {rateLimit: 5, maxFileSize: 1}")
        .expect("audit config");
    let team = topology.node(0).pods[0].clone();
    topology
        .add_manifest(
            "team.yaml",
            &format!(
                "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: team\n  annotations:\n\
                 \x20   k8s.ovn.org/acl-logging: '{{\"deny\":\"alert\",\"allow\":\"notice\"}}'\n\
                 ---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: default\n  annotations:\n\
                 \x20   k8s.ovn.org/acl-logging: 'not json'\n\
                 ---\napiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\nmetadata: {{name: default, namespace: team}}\n\
                 spec:\n  egress:\n\
                 \x20 - {{type: Allow, to: {{cidrSelector: {ext}/32}}, ports: [{{protocol: TCP, port: 8080}}]}}\n\
                 \x20 - {{type: Deny, to: {{cidrSelector: 0.0.0.0/0}}}}\n"
            ),
        )
        .expect("manifests");
    let server = echo_server(&external.netns, "external", false).expect("server");
    let audit_log = std::env::temp_dir()
        .join(dataplane_tests::unique_name("audit"))
        .join("acl-audit-log.log");
    let agent = topology
        .node(0)
        .start_agent_with(&["--audit-log", audit_log.to_str().expect("path")])
        .expect("agent");
    let log = agent.log();
    assert!(log.contains("audit log open"), "{log}");
    assert!(
        log.contains("Namespace default: annotation k8s.ovn.org/acl-logging ignored"),
        "{log}"
    );

    // Three allowed connections: one record each (at the SYN).
    tcp_answers(&team.netns, &ext, 8080, 3).expect("allowed connections");
    let allowed = audit_lines(&audit_log, |l| l.len() >= 3);
    assert_eq!(allowed.len(), 3, "{allowed:?}");
    let expected = format!(
        "|acl_log(dataplane)|NOTICE|name=\"EF:team:default:0\", verdict=allow, severity=notice, \
         direction=from-lport: tcp,nw_src={},nw_dst={ext},tp_src=",
        team.ip
    );
    for line in &allowed {
        assert!(line.contains(&expected), "{line}");
        assert!(line.ends_with(",tp_dst=8080"), "{line}");
    }

    // A burst of 50 denied datagrams: within the rate limit (5 a second, burst 5), not 50.
    let script = format!(
        "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         for i in range(50):\n    s.sendto(b'x', ('{ext}', 5454))\n"
    );
    let out = exec_in(&team.netns, &["python3", "-c", &script]).expect("burst");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = audit_lines(&audit_log, |l| l.len() >= 5);
    sleep(Duration::from_millis(500));
    let lines_later = audit_lines(&audit_log, |_| true);
    let denied: Vec<&String> = lines_later
        .iter()
        .filter(|l| l.contains("verdict=drop"))
        .collect();
    assert!(lines.len() >= 4, "{lines:?}");
    assert!(
        (1..=7).contains(&denied.len()),
        "{} denied records for 50 packets: {denied:?}",
        denied.len()
    );
    for line in &denied {
        assert!(
            line.contains("|ALERT|name=\"EF:team:default:1\", verdict=drop, severity=alert"),
            "{line}"
        );
        assert!(line.contains(",tp_dst=5454"), "{line}");
    }
    let counters = agent.counters().expect("counters");
    assert!(
        counters.packets(Hook::FromPod, PacketClass::AuditSuppressed) >= 40,
        "{counters:?}"
    );
    drop(server);
    if let Some(dir) = audit_log.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
}
