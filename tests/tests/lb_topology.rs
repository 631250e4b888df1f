//! A ClusterIP Service with backends on two nodes, reached by real TCP and UDP clients in pods
//! on both nodes: the agents build the load-balancer from Service and EndpointSlice manifests.
//! Each backend answers with its own address and the client address it saw, so the test sees
//! which backend took each connection, that the client's address is preserved, and (for UDP,
//! through an unconnected socket) that replies come from the service address. One backend
//! also reaches its own service, through itself (hairpin) or the other backend.

use std::{
    collections::BTreeSet,
    process::{Child, Command, Stdio},
};

use dataplane_common::{Hook, PacketClass};
use dataplane_tests::{
    privileged::privileged,
    topology::{Mode, Pod, Topology, exec_in, run_in},
};

const SERVICE_IP: &str = "10.96.0.10";
const SERVICE_IP6: &str = "fd00:10:96::30";

fn manifests(backends: &[&Pod]) -> String {
    let endpoints: String = backends
        .iter()
        .map(|p| format!("- addresses: [{}]\n  conditions: {{ready: true}}\n", p.ip))
        .collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: default}}\n\
         spec:\n  clusterIP: {SERVICE_IP}\n  clusterIPs: [{SERVICE_IP}]\n  ports:\n\
         \x20 - {{name: http, port: 80, protocol: TCP, targetPort: 8080}}\n\
         \x20 - {{name: dns, port: 53, protocol: UDP, targetPort: 5353}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: web-1, namespace: default, labels: {{kubernetes.io/service-name: web}}}}\n\
         addressType: IPv4\nports:\n- {{name: http, port: 8080, protocol: TCP}}\n\
         - {{name: dns, port: 5353, protocol: UDP}}\nendpoints:\n{endpoints}"
    )
}

/// An IPv6 backend (IPv6-only sockets next to the IPv4 ones of [`start_backend`]).
fn start_backend6(pod: &Pod) -> Child {
    let script = format!(
        "import socket, threading\n\
         me = '{ip}'\n\
         t = socket.socket(socket.AF_INET6); t.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)\n\
         t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); t.bind(('::', 8080)); t.listen(64)\n\
         u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n\
         u.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1); u.bind(('::', 5353))\n\
         def udp():\n    while True:\n        d, a = u.recvfrom(100); u.sendto(f'{{me}} {{a[0]}}'.encode(), a)\n\
         threading.Thread(target=udp, daemon=True).start()\n\
         while True:\n    c, a = t.accept(); c.sendall(f'{{me}} {{a[0]}}'.encode()); c.close()\n",
        ip = pod.ip6.expect("dual-stack pod")
    );
    Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", pod.netns))
        .args(["python3", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting an IPv6 backend")
}

/// A backend: answers every TCP connection on 8080 and every UDP datagram on 5353 with
/// "<its address> <the client address it saw>".
fn start_backend(pod: &Pod) -> Child {
    let script = format!(
        "import socket, threading\n\
         me = '{ip}'\n\
         t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         t.bind(('0.0.0.0', 8080)); t.listen(64)\n\
         u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(('0.0.0.0', 5353))\n\
         def udp():\n    while True:\n        d, a = u.recvfrom(100); u.sendto(f'{{me}} {{a[0]}}'.encode(), a)\n\
         threading.Thread(target=udp, daemon=True).start()\n\
         while True:\n    c, a = t.accept(); c.sendall(f'{{me}} {{a[0]}}'.encode()); c.close()\n",
        ip = pod.ip
    );
    Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", pod.netns))
        .args(["python3", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting a backend")
}

/// `count` TCP connections and `count` UDP requests to the service from `client`; returns
/// one line per answer: "tcp|udp <backend> <client seen> <reply source>".
fn client_requests(client: &Pod, count: usize) -> Vec<String> {
    requests_to(client, SERVICE_IP, count)
}

/// As [`client_requests`], to the service at `service_ip` (IPv4 or IPv6).
fn requests_to(client: &Pod, service_ip: &str, count: usize) -> Vec<String> {
    let family = if service_ip.contains(':') {
        "AF_INET6"
    } else {
        "AF_INET"
    };
    let script = format!(
        "import socket, time\n\
         for i in range({count}):\n\
         \x20   for _ in range(50):\n\
         \x20       try:\n\
         \x20           c = socket.create_connection(('{service_ip}', 80), timeout=5); break\n\
         \x20       except OSError: time.sleep(0.1)\n\
         \x20   print('tcp', c.recv(100).decode(), c.getpeername()[0]); c.close()\n\
         for i in range({count}):\n\
         \x20   u = socket.socket(socket.{family}, socket.SOCK_DGRAM); u.settimeout(5)\n\
         \x20   u.sendto(b'q', ('{service_ip}', 53)); d, a = u.recvfrom(100)\n\
         \x20   print('udp', d.decode(), f'{{a[0]}}:{{a[1]}}'); u.close()\n"
    );
    let out = exec_in(&client.netns, &["python3", "-c", &script]).expect("client");
    assert!(
        out.status.success(),
        "client in {}: {}",
        client.netns,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn cluster_ip_with_backends_on_two_nodes_serves_tcp_and_udp_clients_on_both() {
    if !privileged("cluster_ip_with_backends_on_two_nodes_serves_tcp_and_udp_clients_on_both") {
        return;
    }
    let topology = Topology::build_with(2, 2, Mode::Overlay).expect("build topology");
    let backends = [&topology.node(0).pods[1], &topology.node(1).pods[1]];
    topology
        .add_manifest("web.yaml", &manifests(&backends))
        .expect("service manifests");
    let mut servers: Vec<Child> = backends.iter().map(|p| start_backend(p)).collect();
    let agent0 = topology.node(0).start_agent().expect("agent on node 0");
    let agent1 = topology.node(1).start_agent().expect("agent on node 1");
    let log = agent0.log();
    assert!(log.contains("services configured"), "{log}");

    let backend_ips: BTreeSet<String> = backends.iter().map(|p| p.ip.to_string()).collect();
    // Clients on both nodes, and a backend reaching its own service (hairpin when it picks
    // itself: it then sees the masquerade address as its client).
    for client in [
        &topology.node(0).pods[0],
        &topology.node(1).pods[0],
        &topology.node(0).pods[1],
    ] {
        let lines = client_requests(client, 16);
        assert_eq!(lines.len(), 32, "{lines:?}");
        let mut reached = BTreeSet::new();
        for line in &lines {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [proto, backend, seen, source] = fields[..] else {
                panic!("answer {line:?}");
            };
            assert!(backend_ips.contains(backend), "{line}");
            let expected_seen = if backend == client.ip.to_string() {
                "169.254.0.5".to_owned()
            } else {
                client.ip.to_string()
            };
            assert_eq!(seen, expected_seen, "client address preserved: {line}");
            let expected_source = if proto == "tcp" {
                SERVICE_IP.to_owned()
            } else {
                format!("{SERVICE_IP}:53")
            };
            assert_eq!(
                source, expected_source,
                "replies come from the service: {line}"
            );
            reached.insert((proto.to_owned(), backend.to_owned()));
        }
        // Sixteen flows per protocol over two backends: both are reached.
        assert_eq!(reached.len(), 4, "client {}: {reached:?}", client.ip);
    }
    for agent in [&agent0, &agent1] {
        let counters = agent.counters().expect("counters");
        assert!(counters.packets(Hook::FromPod, PacketClass::ServiceDnat) >= 32);
        assert!(counters.packets(Hook::FromPod, PacketClass::ServiceReverseNat) > 0);
        assert!(counters.packets(Hook::UnderlayTc, PacketClass::ServiceReverseNat) > 0);
    }
    for server in &mut servers {
        let _ = server.kill();
        let _ = server.wait();
    }
}

/// TCP connections from `netns` to `address:port`; each answer line is "<backend> <client seen>".
fn connect_from(netns: &str, address: &str, port: u16, count: usize) -> Vec<String> {
    let script = format!(
        "import socket, time\n\
         for i in range({count}):\n\
         \x20   for attempt in range(30):\n\
         \x20       try:\n\
         \x20           c = socket.create_connection(('{address}', {port}), timeout=5); break\n\
         \x20       except ConnectionRefusedError:\n\
         \x20           if attempt == 29: raise\n\
         \x20           time.sleep(0.1)\n\
         \x20   print(c.recv(100).decode()); c.close()\n"
    );
    let out = exec_in(netns, &["python3", "-c", &script]).expect("client");
    assert!(
        out.status.success(),
        "client to {address}:{port}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn node_ports_and_external_ips_from_outside_keep_the_client_address_with_local_policy() {
    if !privileged(
        "node_ports_and_external_ips_from_outside_keep_the_client_address_with_local_policy",
    ) {
        return;
    }
    let mut topology = Topology::build_with(2, 2, Mode::Overlay).expect("build topology");
    let external = topology.add_external_host().expect("external host");
    let backend = topology.node(0).pods[1].clone();
    let slice = |service: &str| {
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{name: {service}-1, namespace: default, labels: {{kubernetes.io/service-name: {service}}}}}\n\
             addressType: IPv4\nports: [{{port: 8080, protocol: TCP}}]\n\
             endpoints: [{{addresses: [{ip}], nodeName: {node}, conditions: {{ready: true}}}}]\n",
            ip = backend.ip,
            node = dataplane_tests::topology::node_name(0),
        )
    };
    let manifests = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: local, namespace: default}}\n\
         spec: {{type: NodePort, clusterIP: 10.96.0.20, externalIPs: [192.0.2.11], externalTrafficPolicy: Local, \
         ports: [{{port: 80, targetPort: 8080, nodePort: 30080}}]}}\n{}\
         ---\napiVersion: v1\nkind: Service\nmetadata: {{name: cluster, namespace: default}}\n\
         spec: {{type: NodePort, clusterIP: 10.96.0.21, externalIPs: [192.0.2.10], externalTrafficPolicy: Cluster, \
         ports: [{{port: 80, targetPort: 8080, nodePort: 30081}}]}}\n{}",
        slice("local"),
        slice("cluster")
    );
    topology
        .add_manifest("nodeports.yaml", &manifests)
        .expect("manifests");
    let mut server = start_backend(&backend);
    let _agents = (
        topology.node(0).start_agent().expect("agent on node 0"),
        topology.node(1).start_agent().expect("agent on node 1"),
    );
    let node0 = topology.node(0).underlay_ip.to_string();
    let node1 = topology.node(1).underlay_ip.to_string();

    // Local policy, on the backend's node: the pod sees the external client itself.
    for line in connect_from(&external.netns, &node0, 30080, 5) {
        assert_eq!(line, format!("{} {}", backend.ip, external.ip), "{line}");
    }
    // Cluster policy, on the node without the backend: through Geneve to the other node,
    // from this node's address (so the answer comes back the same way).
    for line in connect_from(&external.netns, &node1, 30081, 5) {
        assert_eq!(line, format!("{} {}", backend.ip, node1), "{line}");
    }
    // Cluster policy on the backend's own node: the client's address is kept.
    for line in connect_from(&external.netns, &node0, 30081, 5) {
        assert_eq!(line, format!("{} {}", backend.ip, external.ip), "{line}");
    }
    // External IPs routed to a node, as a router or load-balancer would: the same policies.
    run_in(
        &external.netns,
        &["ip", "route", "add", "192.0.2.11", "via", &node0],
    )
    .unwrap();
    run_in(
        &external.netns,
        &["ip", "route", "add", "192.0.2.10", "via", &node1],
    )
    .unwrap();
    for line in connect_from(&external.netns, "192.0.2.11", 80, 3) {
        assert_eq!(line, format!("{} {}", backend.ip, external.ip), "{line}");
    }
    for line in connect_from(&external.netns, "192.0.2.10", 80, 3) {
        assert_eq!(line, format!("{} {}", backend.ip, node1), "{line}");
    }
    let _ = server.kill();
    let _ = server.wait();
}

#[test]
fn a_dual_stack_service_serves_ipv6_clients_on_both_nodes() {
    if !privileged("a_dual_stack_service_serves_ipv6_clients_on_both_nodes") {
        return;
    }
    let topology = Topology::build_with(2, 2, Mode::Overlay).expect("build topology");
    let backends = [&topology.node(0).pods[1], &topology.node(1).pods[1]];
    let slice = |family: &str, addresses: Vec<String>| {
        let endpoints: String = addresses
            .iter()
            .map(|a| format!("- addresses: [\"{a}\"]\n"))
            .collect();
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{name: web6-{family}, namespace: default, labels: {{kubernetes.io/service-name: web6}}}}\n\
             addressType: {family}\nports:\n- {{name: http, port: 8080, protocol: TCP}}\n\
             - {{name: dns, port: 5353, protocol: UDP}}\nendpoints:\n{endpoints}"
        )
    };
    let manifests = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web6, namespace: default}}\n\
         spec:\n  ipFamilyPolicy: RequireDualStack\n  ipFamilies: [IPv4, IPv6]\n\
         \x20 clusterIPs: [10.96.0.30, \"{SERVICE_IP6}\"]\n  ports:\n\
         \x20 - {{name: http, port: 80, protocol: TCP, targetPort: 8080}}\n\
         \x20 - {{name: dns, port: 53, protocol: UDP, targetPort: 5353}}\n{}{}",
        slice("IPv4", backends.iter().map(|p| p.ip.to_string()).collect()),
        slice(
            "IPv6",
            backends
                .iter()
                .map(|p| p.ip6.expect("ip6").to_string())
                .collect()
        ),
    );
    topology
        .add_manifest("web6.yaml", &manifests)
        .expect("manifests");
    let mut servers: Vec<Child> = backends.iter().map(|p| start_backend6(p)).collect();
    let _agents = (
        topology.node(0).start_agent().expect("agent on node 0"),
        topology.node(1).start_agent().expect("agent on node 1"),
    );
    let backend_ips: BTreeSet<String> = backends
        .iter()
        .map(|p| p.ip6.expect("ip6").to_string())
        .collect();
    for client in [&topology.node(0).pods[0], &topology.node(1).pods[0]] {
        let lines = requests_to(client, SERVICE_IP6, 12);
        assert_eq!(lines.len(), 24, "{lines:?}");
        let mut reached = BTreeSet::new();
        for line in &lines {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [proto, backend, seen, source] = fields[..] else {
                panic!("answer {line:?}");
            };
            assert!(backend_ips.contains(backend), "{line}");
            assert_eq!(seen, client.ip6.expect("ip6").to_string(), "{line}");
            let expected = if proto == "tcp" {
                SERVICE_IP6.to_owned()
            } else {
                format!("{SERVICE_IP6}:53")
            };
            assert_eq!(source, expected, "replies come from the service: {line}");
            reached.insert((proto.to_owned(), backend.to_owned()));
        }
        assert_eq!(reached.len(), 4, "client {}: {reached:?}", client.ip);
    }
    for server in &mut servers {
        let _ = server.kill();
        let _ = server.wait();
    }
}
