//! IP fragments end to end on a two-node overlay cluster: real UDP sockets send 3000- and
//! 9000-byte datagrams (the pods' stacks fragment them to the pod MTU) to pods whose ingress
//! policy allows only that UDP port, on the same node and across nodes, directly and through a
//! Service with two backends, over IPv4 and IPv6. Each server echoes the whole datagram, so
//! the replies come back in fragments too. Every datagram must arrive whole: a later fragment
//! carries no ports, and is judged and translated by its first fragment's.

use dataplane_common::DropReason;
use dataplane_tests::{
    privileged::privileged,
    service_bed::Server,
    topology::{Mode, Pod, Topology, exec_in},
};

const SERVICE_V4: &str = "10.96.0.60";
const SERVICE_V6: &str = "fd00:96::60";

/// The servers' isolation (UDP 5353 only, from anyone) and a UDP Service on port 53 in both
/// families whose endpoints are the two servers.
fn manifests(servers: &[&Pod]) -> String {
    let names: Vec<&str> = servers.iter().map(|p| p.name.as_str()).collect();
    let endpoints = |v6: bool| -> String {
        servers
            .iter()
            .map(|p| {
                let address = if v6 {
                    p.ip6.expect("dual stack").to_string()
                } else {
                    p.ip.to_string()
                };
                format!("- addresses: [\"{address}\"]\n  conditions: {{ready: true}}\n")
            })
            .collect()
    };
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
         metadata: {{name: udp-only, namespace: default}}\n\
         spec:\n  podSelector: {{matchExpressions: [{{key: pod, operator: In, values: [{names}]}}]}}\n\
         \x20 policyTypes: [Ingress]\n  ingress: [{{ports: [{{protocol: UDP, port: 5353}}]}}]\n\
         ---\napiVersion: v1\nkind: Service\nmetadata: {{name: big, namespace: default}}\n\
         spec: {{clusterIP: {SERVICE_V4}, clusterIPs: [{SERVICE_V4}], ipFamilies: [IPv4], \
         ports: [{{name: dns, port: 53, protocol: UDP, targetPort: 5353}}]}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: big-v4, namespace: default, labels: {{kubernetes.io/service-name: big}}}}\n\
         addressType: IPv4\nports: [{{name: dns, port: 5353, protocol: UDP}}]\nendpoints:\n{}\
         ---\napiVersion: v1\nkind: Service\nmetadata: {{name: big6, namespace: default}}\n\
         spec: {{clusterIP: \"{SERVICE_V6}\", clusterIPs: [\"{SERVICE_V6}\"], ipFamilies: [IPv6], \
         ports: [{{name: dns, port: 53, protocol: UDP, targetPort: 5353}}]}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: big6-v6, namespace: default, labels: {{kubernetes.io/service-name: big6}}}}\n\
         addressType: IPv6\nports: [{{name: dns, port: 5353, protocol: UDP}}]\nendpoints:\n{}",
        endpoints(false),
        endpoints(true),
        names = names.join(", "),
    )
}

/// A UDP server on 5353 (IPv4 and IPv6) that answers each datagram with its name padded to 40
/// bytes followed by the whole datagram.
fn echo_whole(pod: &Pod) -> Server {
    let script = format!(
        "import socket, threading\n\
         def serve(family, any):\n\
         \x20   s = socket.socket(family, socket.SOCK_DGRAM)\n\
         \x20   if family == socket.AF_INET6: s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)\n\
         \x20   s.bind((any, 5353))\n\
         \x20   while True:\n\
         \x20       d, a = s.recvfrom(65535); s.sendto(b'{name}'.ljust(40) + d, a)\n\
         threading.Thread(target=serve, args=(socket.AF_INET6, '::'), daemon=True).start()\n\
         serve(socket.AF_INET, '0.0.0.0')\n",
        name = pod.name
    );
    std::process::Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", pod.netns))
        .args(["python3", "-c", &script])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map(Server::from)
        .expect("starting the echo server")
}

/// Sends one datagram of each size in `sizes` from `client` to `address`:53 or :5353 and
/// returns, per datagram, the answering server's name if the echo came back whole, else
/// `timeout` or `mangled`. Retried once per datagram while the servers start.
fn send_whole(client: &Pod, address: &str, port: u16, sizes: &[usize]) -> Vec<String> {
    let family = if address.contains(':') {
        "socket.AF_INET6"
    } else {
        "socket.AF_INET"
    };
    let sizes: Vec<String> = sizes.iter().map(ToString::to_string).collect();
    let script = format!(
        "import os, socket\n\
         for size in [{sizes}]:\n\
         \x20   answer = 'timeout'\n\
         \x20   for attempt in range(3):\n\
         \x20       s = socket.socket({family}, socket.SOCK_DGRAM); s.settimeout(2)\n\
         \x20       payload = os.urandom(size)\n\
         \x20       s.sendto(payload, ('{address}', {port}))\n\
         \x20       try:\n\
         \x20           d = s.recv(65535)\n\
         \x20           answer = d[:40].decode().strip() if d[40:] == payload else 'mangled'\n\
         \x20       except socket.timeout: pass\n\
         \x20       s.close()\n\
         \x20       if answer != 'timeout': break\n\
         \x20   print(answer)\n",
        sizes = sizes.join(", ")
    );
    let out = exec_in(&client.netns, &["python3", "-c", &script]).expect("client");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn fragmented_datagrams_pass_policy_services_and_the_overlay_whole() {
    if !privileged("fragmented_datagrams_pass_policy_services_and_the_overlay_whole") {
        return;
    }
    let topology = Topology::build_with(2, 2, Mode::Overlay).expect("topology");
    let client = topology.node(0).pods[0].clone();
    let local_server = topology.node(0).pods[1].clone();
    let remote_server = topology.node(1).pods[0].clone();
    topology
        .add_manifest(
            "fragments.yaml",
            &manifests(&[&local_server, &remote_server]),
        )
        .expect("manifests");
    let agent0 = topology.node(0).start_agent().expect("agent 0");
    let _agent1 = topology.node(1).start_agent().expect("agent 1");
    let _servers = [echo_whole(&local_server), echo_whole(&remote_server)];
    let sizes = [3000, 9000, 200];
    let whole = |name: &str| vec![name.to_owned(); sizes.len()];

    // Directly, IPv4 and IPv6, on this node and across nodes; the policy lets UDP 5353 in.
    for server in [&local_server, &remote_server] {
        let v4 = server.ip.to_string();
        let v6 = server.ip6.expect("dual stack").to_string();
        assert_eq!(
            send_whole(&client, &v4, 5353, &sizes),
            whole(&server.name),
            "IPv4 to {}",
            server.name
        );
        assert_eq!(
            send_whole(&client, &v6, 5353, &sizes),
            whole(&server.name),
            "IPv6 to {}",
            server.name
        );
    }

    // Through the Service: every fragment of a datagram goes to the backend its first went
    // to (else the datagram is never reassembled), and the echo's fragments get the service
    // address back.
    for service in [SERVICE_V4, SERVICE_V6] {
        let answers = send_whole(&client, service, 53, &[3000, 9000, 3000, 9000, 3000, 9000]);
        assert!(
            answers
                .iter()
                .all(|a| *a == local_server.name || *a == remote_server.name),
            "{service}: {answers:?}\n{}",
            agent0.log()
        );
    }

    // A later fragment whose first never came is dropped, for a reason of its own.
    let before = agent0
        .counters()
        .expect("counters")
        .drops(DropReason::FragmentWithoutFirst);
    let lone = format!(
        "from scapy.all import IP, Raw, send\n\
         send(IP(src='{}', dst='{}', id=4242, flags=0, frag=185, proto=17)/Raw(b'x' * 64), verbose=0)\n",
        client.ip, local_server.ip
    );
    let out = exec_in(&client.netns, &["python3", "-c", &lone]).expect("scapy");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after = agent0
        .counters()
        .expect("counters")
        .drops(DropReason::FragmentWithoutFirst);
    assert_eq!(after - before, 1, "one lone fragment dropped");
}
