//! The Geneve overlay between two simulated nodes: no routes join the nodes' pod CIDRs, so
//! pods on different nodes reach each other only through the overlay. The agents build it
//! from Kubernetes manifests; traffic is real (ping, TCP), the wire is read by tshark.

use std::{
    net::IpAddr,
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use dataplane_common::{Hook, PacketClass};
use dataplane_tests::{
    capture::Capture,
    privileged::privileged,
    topology::{Mode, OVERLAY_POD_MTU, Pod, Topology, arrival_hook, exec_in, run_in, sh_in},
};
use dataplane_user::kernel::stats::Counters;

fn delta(after: &Counters, before: &Counters, hook: Hook, class: PacketClass) -> u64 {
    after.packets(hook, class) - before.packets(hook, class)
}

/// Sends `bytes` over TCP from `client` to `server` at `address` (port 5001) and returns what
/// the server counted.
fn tcp_transfer(
    client: &Pod,
    server: &Pod,
    address: IpAddr,
    bytes: usize,
) -> anyhow::Result<usize> {
    // A dual-stack listener: IPv4 arrives as IPv4-mapped on the IPv6 socket.
    let server_script = "import socket\n\
        s = socket.socket(socket.AF_INET6); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)\n\
        s.bind(('::', 5001)); s.listen(1); s.settimeout(30)\n\
        c, _ = s.accept(); c.settimeout(30); n = 0\n\
        while True:\n    b = c.recv(1 << 16)\n    if not b: break\n    n += len(b)\n\
        print(n)\n";
    let listener = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", server.netns))
        .args(["python3", "-c", server_script])
        .stdout(Stdio::piped())
        .spawn()?;
    let client_script = format!(
        "import socket, time\n\
         for _ in range(100):\n    try:\n        c = socket.create_connection(('{ip}', 5001), timeout=5); break\n\
         \x20   except OSError: time.sleep(0.1)\n\
         c.sendall(b'x' * {bytes}); c.close()\n",
        ip = address
    );
    run_in(&client.netns, &["python3", "-c", &client_script])?;
    let out = listener.wait_with_output()?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

#[test]
fn pods_reach_each_other_across_nodes_only_through_geneve() {
    if !privileged("pods_reach_each_other_across_nodes_only_through_geneve") {
        return;
    }
    let topology = Topology::build_with(2, 2, Mode::Overlay).expect("build topology");
    let (node0, node1) = (topology.node(0), topology.node(1));

    // Without agents there is no path between the nodes' pods.
    assert!(
        !node0.pods[0].ping(node1.pods[0].ip, 1).unwrap(),
        "no overlay, no path"
    );

    let agent0 = node0.start_agent().expect("agent on node 0");
    let agent1 = node1.start_agent().expect("agent on node 1");

    // Cross-node ping, captured on node 0's port of the fabric bridge.
    let capture = Capture::start(
        &topology.fabric,
        "n0",
        "udp port 6081",
        6,
        &[
            "ip.src",
            "ip.dst",
            "udp.dstport",
            "geneve.vni",
            "geneve.proto_type",
            "icmp.type",
        ],
    )
    .expect("tshark");
    let (before0, before1) = (agent0.counters().unwrap(), agent1.counters().unwrap());
    assert!(
        node0.pods[0].ping(node1.pods[0].ip, 3).unwrap(),
        "cross-node ping through the overlay\nagent 0:\n{}\nagent 1:\n{}",
        agent0.log(),
        agent1.log()
    );
    let (after0, after1) = (agent0.counters().unwrap(), agent1.counters().unwrap());
    assert_eq!(
        delta(&after0, &before0, Hook::FromPod, PacketClass::GeneveEncap),
        3
    );
    assert_eq!(
        delta(&after1, &before1, arrival_hook(), PacketClass::GeneveDecap),
        3
    );
    assert_eq!(
        delta(&after1, &before1, Hook::FromPod, PacketClass::GeneveEncap),
        3
    );
    assert_eq!(
        delta(&after0, &before0, arrival_hook(), PacketClass::GeneveDecap),
        3
    );

    // tshark: outer node addresses, inner pod addresses, Geneve VNI 1 carrying Ethernet.
    let lines = capture.finish().expect("capture");
    let request = "10.99.0.1,10.244.1.2|10.99.0.2,10.244.2.2|6081|0x000001|0x6558|8";
    let reply = "10.99.0.2,10.244.2.2|10.99.0.1,10.244.1.2|6081|0x000001|0x6558|0";
    assert_eq!(
        lines.iter().filter(|l| *l == request).count(),
        3,
        "{lines:#?}"
    );
    assert_eq!(
        lines.iter().filter(|l| *l == reply).count(),
        3,
        "{lines:#?}"
    );

    // Same node: handed straight to the other pod, never encapsulated.
    let before0 = agent0.counters().unwrap();
    assert!(
        node0.pods[0].ping(node0.pods[1].ip, 3).unwrap(),
        "same-node ping"
    );
    let after0 = agent0.counters().unwrap();
    assert_eq!(
        delta(&after0, &before0, Hook::FromPod, PacketClass::LocalRedirect),
        6
    );
    assert_eq!(
        delta(&after0, &before0, Hook::FromPod, PacketClass::GeneveEncap),
        0
    );

    // TCP across nodes: every byte arrives (segmentation offload survives encapsulation).
    let bytes = 8 << 20;
    let (client, server) = (&node0.pods[0], &node1.pods[1]);
    let received = tcp_transfer(client, server, server.ip.into(), bytes).expect("tcp transfer");
    assert_eq!(received, bytes, "all bytes of the transfer");
    // And on the same node.
    let (client, server) = (&node1.pods[0], &node1.pods[1]);
    let received = tcp_transfer(client, server, server.ip.into(), bytes).expect("tcp transfer");
    assert_eq!(received, bytes);

    // IPv6 pods across nodes: carried over the IPv6 underlay (both nodes have one).
    let target6 = node1.pods[0].ip6.expect("dual-stack pod");
    let capture = Capture::start(
        &topology.fabric,
        "n0",
        "ip6 and udp port 6081",
        2,
        &["ipv6.src", "ipv6.dst", "geneve.vni", "icmpv6.type"],
    )
    .expect("tshark");
    let (before0, before1) = (agent0.counters().unwrap(), agent1.counters().unwrap());
    assert!(
        node0.pods[0].ping(target6, 3).unwrap(),
        "cross-node ping over IPv6"
    );
    let (after0, after1) = (agent0.counters().unwrap(), agent1.counters().unwrap());
    assert_eq!(
        delta(&after0, &before0, Hook::FromPod, PacketClass::GeneveEncap),
        3
    );
    assert_eq!(
        delta(&after1, &before1, arrival_hook(), PacketClass::GeneveDecap),
        3
    );
    let lines = capture.finish().expect("capture");
    let source6 = node0.pods[0].ip6.expect("dual-stack pod");
    assert_eq!(
        lines.first().map(String::as_str),
        Some(format!("fd99::1,{source6}|fd99::2,{target6}|0x000001|128").as_str()),
        "outer IPv6 node to node, inner IPv6 pod to pod: {lines:#?}"
    );
    let (client, server) = (&node0.pods[0], &node1.pods[1]);
    let address = server.ip6.expect("dual-stack pod").into();
    let received = tcp_transfer(client, server, address, bytes).expect("tcp over IPv6");
    assert_eq!(received, bytes, "all bytes over IPv6");
    // Path MTU: a pod whose interface MTU is wrong (1500) sends a 1478-byte DF packet across
    // nodes; the dataplane answers "fragmentation needed" / "packet too big" with 1400, the
    // pod's kernel caches that path MTU, and 1400-byte packets then get through.
    let pod = &node0.pods[0];
    sh_in(&pod.netns, "ip link set eth0 mtu 1500").expect("raise pod MTU");
    for (target, ping_flag, answer) in [
        (node1.pods[0].ip.to_string(), "-4", "mtu = 1400"),
        (target6.to_string(), "-6", "mtu=1400"),
    ] {
        let before = agent0.counters().unwrap();
        let big = exec_in(
            &pod.netns,
            &[
                "ping", ping_flag, "-n", "-c", "1", "-W", "2", "-M", "do", "-s", "1450", &target,
            ],
        )
        .expect("ping");
        let text = String::from_utf8_lossy(&big.stdout).to_string()
            + &String::from_utf8_lossy(&big.stderr);
        assert!(
            text.contains(answer),
            "{target}: the pod hears the MTU: {text}"
        );
        let after = agent0.counters().unwrap();
        assert_eq!(
            delta(&after, &before, Hook::FromPod, PacketClass::TooBigAnswered),
            1,
            "{target}"
        );
        let route =
            exec_in(&pod.netns, &["ip", ping_flag, "route", "get", &target]).expect("route");
        assert!(
            String::from_utf8_lossy(&route.stdout).contains("mtu 1400"),
            "{target}: path MTU cached: {}",
            String::from_utf8_lossy(&route.stdout)
        );
        // 1400 bytes of IP: 1372 (IPv4) or 1352 (IPv6) bytes of ICMP payload.
        let fits = if ping_flag == "-4" { "1372" } else { "1352" };
        let ok = exec_in(
            &pod.netns,
            &[
                "ping", ping_flag, "-n", "-c", "1", "-W", "2", "-M", "do", "-s", fits, &target,
            ],
        )
        .expect("ping");
        assert!(
            ok.status.success(),
            "{target}: a packet of the path MTU gets through"
        );
    }
    sh_in(
        &pod.netns,
        &format!("ip link set eth0 mtu {OVERLAY_POD_MTU}"),
    )
    .expect("restore MTU");

    thread::sleep(Duration::from_millis(10));
    let drops = agent0.counters().unwrap().drops;
    assert!(drops.is_empty(), "no drops on node 0: {drops:?}");
}
