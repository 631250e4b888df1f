//! Port security end to end: real frames written by real pods (AF_PACKET, encoded by scapy)
//! on a two-node overlay cluster with the real agents. A pod that sends as another pod, with
//! another MAC, as a node, or claims another pod's address in ARP or neighbour discovery is
//! refused at its own veth; what it may send still flows; a spoofed packet leaves no tracked
//! flow that another pod could use; and no pod can inject overlay traffic.
//!
//! Pods: node 0 runs pod-0-0 (the attacker, 10.244.1.2), pod-0-1 (10.244.1.3) and pod-0-2
//! (10.244.1.4); node 1 runs pod-1-0 (10.244.2.2) and more.

use std::{
    io::{BufRead as _, BufReader, Read as _},
    process::{Child, ChildStdout, Command, Stdio},
    thread,
    time::Duration,
};

use dataplane_common::{DropReason, Hook, PacketClass};
use dataplane_tests::{
    packets::mac_text,
    privileged::privileged,
    scapy,
    topology::{Agent, Mode, Pod, Topology, dataplane_binary, exec_in, underlay_ip},
};

/// A UDP listener in a pod (IPv4 and IPv6) that records which sources reached it.
struct Listener {
    child: Child,
    output: BufReader<ChildStdout>,
}

impl Listener {
    fn start(pod: &Pod, port: u16, seconds: u32) -> Self {
        let script = format!(
            "import socket, select, sys, time, json\n\
             socks = []\n\
             for fam, any in ((socket.AF_INET, '0.0.0.0'), (socket.AF_INET6, '::')):\n\
             \x20   s = socket.socket(fam, socket.SOCK_DGRAM)\n\
             \x20   if fam == socket.AF_INET6: s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)\n\
             \x20   s.bind((any, {port})); socks.append(s)\n\
             print('ready', flush=True)\n\
             seen = []\n\
             end = time.time() + {seconds}\n\
             done = False\n\
             while time.time() < end and not done:\n\
             \x20   ready, _, _ = select.select(socks + [sys.stdin], [], [], max(0, end - time.time()))\n\
             \x20   for s in ready:\n\
             \x20       if s is sys.stdin: done = not sys.stdin.read(); continue\n\
             \x20       d, a = s.recvfrom(2000); seen.append(a[0])\n\
             print(json.dumps(seen))\n"
        );
        let mut child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", pod.netns))
            .args(["python3", "-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting a listener");
        // Bound before anything is sent: it says so once both sockets are.
        let mut output = BufReader::new(child.stdout.take().expect("listener stdout"));
        let mut line = String::new();
        output.read_line(&mut line).expect("listener ready");
        assert_eq!(line.trim(), "ready", "listener in {}", pod.name);
        Self { child, output }
    }

    /// The sources of every datagram received until now (a moment for what is on its way),
    /// or until the listener's time ran out.
    fn sources(mut self) -> Vec<String> {
        thread::sleep(Duration::from_millis(300));
        // Closing its input tells the listener to report.
        drop(self.child.stdin.take());
        let mut text = String::new();
        self.output
            .read_to_string(&mut text)
            .expect("listener output");
        let _ = self.child.wait();
        serde_json::from_str(&text).expect("listener JSON")
    }
}

/// The MAC of a pod's gateway (its host-side veth), which its frames are addressed to.
fn gateway_mac(topology: &Topology, node: usize, pod: &Pod) -> String {
    let out = exec_in(
        &topology.node(node).netns,
        &["ip", "-o", "link", "show", &pod.host_iface],
    )
    .expect("ip link");
    let text = String::from_utf8_lossy(&out.stdout);
    let mac = text
        .split_whitespace()
        .skip_while(|word| *word != "link/ether")
        .nth(1)
        .unwrap_or_else(|| panic!("no MAC in {text:?}"));
    mac.to_owned()
}

/// Writes the frame scapy builds from `Ether(src=<pod's MAC>, dst=<its gateway>)/<rest>`
/// out of `pod`'s eth0; `src_mac` overrides the source MAC.
fn send(topology: &Topology, node: usize, pod: &Pod, rest: &str, src_mac: Option<&str>) {
    let own = mac_text(&pod.mac);
    let expr = format!(
        "Ether(src='{}', dst='{}')/{rest}",
        src_mac.unwrap_or(&own),
        gateway_mac(topology, node, pod)
    );
    let frame = scapy::build(&expr).unwrap_or_else(|e| panic!("scapy {expr}: {e:#}"));
    pod.send_raw_frame(&frame).expect("sending a raw frame");
}

fn drops(agent: &Agent, reason: DropReason) -> u64 {
    agent.counters().expect("counters").drops(reason)
}

/// The neighbour entries a node holds for `address`, as `ip neigh` prints them.
/// The node's neighbour entries for `address`: device and link-layer address, without the
/// reachability state (which ages on its own: REACHABLE becomes STALE or DELAY with time, not
/// because of anything a pod sent).
fn neighbours(topology: &Topology, node: usize, address: &str) -> String {
    let out = exec_in(
        &topology.node(node).netns,
        &["ip", "neigh", "show", address],
    )
    .expect("ip neigh");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| {
            line.split_whitespace()
                // The state is the one word in capitals.
                .filter(|word| !word.chars().all(|c| c.is_ascii_uppercase()))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn cluster(pods_per_node: usize, extra: &str) -> (Topology, Agent, Agent) {
    let topology = Topology::build_with(2, pods_per_node, Mode::Overlay).expect("topology");
    if !extra.is_empty() {
        topology
            .add_manifest("extra.yaml", extra)
            .expect("manifest");
    }
    let agent0 = topology.node(0).start_agent().expect("agent 0");
    let agent1 = topology.node(1).start_agent().expect("agent 1");
    // The agents have synced and attached once they answer status with their links. Status
    // runs here, outside the nodes' namespaces, and still names each link's interface as its
    // node sees it (the host may have other devices at the same ifindexes).
    for (index, agent) in [&agent0, &agent1].into_iter().enumerate() {
        let node = topology.node(index);
        let status = agent.status_json().expect("status");
        assert_eq!(
            status["interfaces_seen_from"], "agent namespace",
            "{status}"
        );
        let links = status["links"].as_array().expect("links");
        assert!(!links.is_empty());
        let mut expected: Vec<&str> = node.pods.iter().map(|p| p.host_iface.as_str()).collect();
        expected.push(&node.underlay_iface);
        // The management port's overlay side runs tc_from_pod as a pod veth does.
        expected.push("dp-mp1");
        for link in links {
            let interface = link["interface"].as_str().expect("named");
            assert!(expected.contains(&interface), "{link} not in {expected:?}");
        }
    }
    (topology, agent0, agent1)
}

#[test]
fn pods_send_only_as_themselves_on_one_node_and_across_nodes() {
    if !privileged("pods_send_only_as_themselves_on_one_node_and_across_nodes") {
        return;
    }
    let (topology, agent0, _agent1) = cluster(2, "");
    let attacker = topology.node(0).pods[0].clone();
    let neighbour = topology.node(0).pods[1].clone();
    let remote = topology.node(1).pods[0].clone();
    let remote_other = topology.node(1).pods[1].clone();
    let (n6, r6) = (
        neighbour.ip6.expect("dual stack"),
        remote.ip6.expect("dual stack"),
    );
    let here = Listener::start(&neighbour, 9999, 60);
    let there = Listener::start(&remote, 9999, 60);
    let udp = "UDP(sport=40000, dport=9999)/Raw(b'spoofed')";
    // Another pod's address, on the same node and across nodes, IPv4 and IPv6.
    let spoofed = [
        format!(
            "IP(src='{}', dst='{}')/{udp}",
            remote_other.ip, neighbour.ip
        ),
        format!("IP(src='{}', dst='{}')/{udp}", neighbour.ip, remote.ip),
        format!(
            "IPv6(src='{}', dst='{n6}')/{udp}",
            remote_other.ip6.expect("dual stack")
        ),
        format!("IPv6(src='{n6}', dst='{r6}')/{udp}"),
    ];
    for rest in &spoofed {
        send(&topology, 0, &attacker, rest, None);
    }
    // Its own address with another pod's MAC.
    let forged_mac = mac_text(&neighbour.mac);
    let own_to_remote = format!("IP(src='{}', dst='{}')/{udp}", attacker.ip, remote.ip);
    send(&topology, 0, &attacker, &own_to_remote, Some(&forged_mac));
    // What it may send still arrives, on its own node and across.
    let honest = "UDP(sport=40001, dport=9999)/Raw(b'honest')";
    send(
        &topology,
        0,
        &attacker,
        &format!("IP(src='{}', dst='{}')/{honest}", attacker.ip, neighbour.ip),
        None,
    );
    send(
        &topology,
        0,
        &attacker,
        &format!("IP(src='{}', dst='{}')/{honest}", attacker.ip, remote.ip),
        None,
    );
    let (here, there) = (here.sources(), there.sources());
    let own = attacker.ip.to_string();
    assert_eq!(
        here,
        vec![own.clone()],
        "only the honest datagram on the same node"
    );
    assert_eq!(there, vec![own], "only the honest datagram across nodes");
    assert_eq!(drops(&agent0, DropReason::PortSrcIp), spoofed.len() as u64);
    assert_eq!(drops(&agent0, DropReason::PortSrcMac), 1);
}

#[test]
fn forged_arp_and_neighbour_advertisements_change_no_neighbour_table() {
    if !privileged("forged_arp_and_neighbour_advertisements_change_no_neighbour_table") {
        return;
    }
    let (topology, agent0, _agent1) = cluster(2, "");
    let attacker = topology.node(0).pods[0].clone();
    let victim = topology.node(0).pods[1].clone();
    let victim6 = victim.ip6.expect("dual stack");
    let own = mac_text(&attacker.mac);
    // The node learns the victim through its own veth, over ARP and over neighbour discovery:
    // make sure it has both, so a poisoned entry would show as a change.
    assert!(victim.ping(topology.node(0).underlay_ip, 1).expect("ping"));
    let node_ns = topology.node(0).netns.clone();
    let ping6 = exec_in(
        &node_ns,
        &["ping", "-6", "-c", "1", "-W", "2", &victim6.to_string()],
    )
    .expect("ping -6");
    assert!(
        ping6.status.success(),
        "the node reaches the victim over IPv6"
    );
    let before = (
        neighbours(&topology, 0, &victim.ip.to_string()),
        neighbours(&topology, 0, &victim6.to_string()),
    );
    let victim_mac = mac_text(&victim.mac);
    assert!(
        before.0.contains(&victim_mac) && before.1.contains(&victim_mac),
        "the node knows the victim's MAC for both addresses: {before:?}"
    );
    // Gratuitous ARP claiming the victim's address, and an ARP reply naming another MAC.
    let claim = format!(
        "ARP(op=2, hwsrc='{own}', psrc='{ip}', hwdst='ff:ff:ff:ff:ff:ff', pdst='{ip}')",
        ip = victim.ip
    );
    send(&topology, 0, &attacker, &claim, None);
    send(
        &topology,
        0,
        &attacker,
        &format!(
            "ARP(op=2, hwsrc='{}', psrc='{}', pdst='169.254.1.1')",
            mac_text(&victim.mac),
            attacker.ip
        ),
        None,
    );
    // An unsolicited, overriding neighbour advertisement of the victim's IPv6 address.
    let advert = format!(
        "IPv6(src='{}', dst='ff02::1')/ICMPv6ND_NA(tgt='{victim6}', O=1, S=0)\
         /ICMPv6NDOptDstLLAddr(lladdr='{own}')",
        attacker.ip6.expect("dual stack")
    );
    send(&topology, 0, &attacker, &advert, None);
    thread::sleep(Duration::from_millis(300));
    let after = (
        neighbours(&topology, 0, &victim.ip.to_string()),
        neighbours(&topology, 0, &victim6.to_string()),
    );
    assert_eq!(after, before, "the node's view of the victim is unchanged");
    assert!(
        !after.0.contains(&own) && !after.1.contains(&own),
        "{after:?}"
    );
    assert_eq!(drops(&agent0, DropReason::PortArp), 2);
    assert_eq!(drops(&agent0, DropReason::PortNd), 1);
    // The attacker's own ARP still works: it reaches its gateway.
    assert!(
        attacker
            .ping(topology.node(0).underlay_ip, 1)
            .expect("ping")
    );
}

const SERVICE: &str = "\
apiVersion: v1
kind: Service
metadata: {name: flood, namespace: default}
spec: {clusterIP: 10.96.0.60, clusterIPs: [10.96.0.60], ports: [{name: udp, port: 53, protocol: UDP, targetPort: 5353}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: flood-1, namespace: default, labels: {kubernetes.io/service-name: flood}}
addressType: IPv4
ports: [{name: udp, port: 5353, protocol: UDP}]
endpoints:
- addresses: [10.244.2.2]
  conditions: {ready: true}
";

#[test]
fn a_flood_of_random_sources_leaves_the_conntrack_empty() {
    if !privileged("a_flood_of_random_sources_leaves_the_conntrack_empty") {
        return;
    }
    let (topology, agent0, _agent1) = cluster(1, SERVICE);
    let attacker = topology.node(0).pods[0].clone();
    let gateway = gateway_mac(&topology, 0, &attacker);
    // 1000 datagrams to the Service from random sources, written in one go.
    let script = format!(
        "import random, socket\n\
         from scapy.all import Ether, IP, UDP, Raw\n\
         s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW); s.bind(('eth0', 0))\n\
         random.seed(7)\n\
         for n in range(1000):\n\
         \x20   src = '.'.join(str(random.randint(1, 254)) for _ in range(4))\n\
         \x20   s.send(bytes(Ether(src='{mac}', dst='{gateway}')/IP(src=src, dst='10.96.0.60')\
         /UDP(sport=1024 + n, dport=53)/Raw(b'flood')))\n",
        mac = mac_text(&attacker.mac),
    );
    let out = exec_in(&attacker.netns, &["python3", "-c", &script]).expect("flood");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let conntrack = Command::new(dataplane_binary())
        .arg("--pin-root")
        .arg(agent0.pins.root())
        .args(["inspect", "conntrack", "--json"])
        .output()
        .expect("inspect");
    assert!(conntrack.status.success());
    let entries: serde_json::Value =
        serde_json::from_slice(&conntrack.stdout).expect("inspect JSON");
    assert_eq!(
        entries,
        serde_json::json!([]),
        "no tracked flow from a spoofed source"
    );
    let counters = agent0.counters().expect("counters");
    // (Random sources may hit the pod's own address only by a chance of 1000 in 4 billion.)
    assert_eq!(counters.drops(DropReason::PortSrcIp), 1000);
    assert_eq!(counters.packets(Hook::FromPod, PacketClass::ServiceDnat), 0);
}

/// pod-0-1 accepts nothing; pod-0-2 accepts anything.
const ISOLATED: &str = "\
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: isolated, namespace: default}
spec:
  podSelector: {matchLabels: {pod: pod-0-1}}
  policyTypes: [Ingress]
";

#[test]
fn a_spoofed_packet_opens_no_tracked_flow_for_a_third_pod_to_use() {
    if !privileged("a_spoofed_packet_opens_no_tracked_flow_for_a_third_pod_to_use") {
        return;
    }
    let (topology, agent0, _agent1) = cluster(3, ISOLATED);
    let attacker = topology.node(0).pods[0].clone();
    let victim = topology.node(0).pods[1].clone();
    let accomplice = topology.node(0).pods[2].clone();
    let listener = Listener::start(&victim, 7000, 60);
    // The attacker sends as the victim to the accomplice: if that opened a tracked flow
    // victim:7000 -> accomplice:7001, the accomplice's "reply" would pass the victim's
    // ingress policy as tracked.
    send(
        &topology,
        0,
        &attacker,
        &format!(
            "IP(src='{}', dst='{}')/UDP(sport=7000, dport=7001)/Raw(b'open')",
            victim.ip, accomplice.ip
        ),
        None,
    );
    thread::sleep(Duration::from_millis(200));
    send(
        &topology,
        0,
        &accomplice,
        &format!(
            "IP(src='{}', dst='{}')/UDP(sport=7001, dport=7000)/Raw(b'reply')",
            accomplice.ip, victim.ip
        ),
        None,
    );
    assert_eq!(
        listener.sources(),
        Vec::<String>::new(),
        "nothing reaches the victim"
    );
    let counters = agent0.counters().expect("counters");
    assert_eq!(counters.drops(DropReason::PortSrcIp), 1);
    assert_eq!(counters.drops(DropReason::PolicyDeniedIngress), 1);
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::PolicyTracked),
        0
    );
}

#[test]
fn no_pod_can_inject_overlay_traffic() {
    if !privileged("no_pod_can_inject_overlay_traffic") {
        return;
    }
    let (topology, agent0, agent1) = cluster(2, "");
    let attacker = topology.node(0).pods[0].clone();
    let target_here = topology.node(0).pods[1].clone();
    let target_there = topology.node(1).pods[0].clone();
    let here = Listener::start(&target_here, 9999, 60);
    let there = Listener::start(&target_there, 9999, 60);
    let inner = |dst: &Pod| {
        format!(
            "Ether(src='0a:58:0a:f4:02:03', dst='0a:58:0a:f4:02:02')\
             /IP(src='10.244.2.3', dst='{}')/UDP(sport=40000, dport=9999)/Raw(b'injected')",
            dst.ip
        )
    };
    let geneve = |src: &str, dst: &str, to: &Pod| {
        format!(
            "IP(src='{src}', dst='{dst}')/UDP(sport=49152, dport=6081)\
             /GENEVE(vni=1, proto=0x6558)/{}",
            inner(to)
        )
    };
    let (node0, node1) = (underlay_ip(0).to_string(), underlay_ip(1).to_string());
    // As node 0 (a real node's underlay address) to node 1: port security refuses the source.
    send(
        &topology,
        0,
        &attacker,
        &geneve(&node0, &node1, &target_there),
        None,
    );
    // Well-formed Geneve with its own source to node 1 and to its own node: ordinary UDP of
    // a pod, never decapsulated (node 1 accepts Geneve from nodes only; on node 0 it is
    // addressed to the node's stack, which has no Geneve socket).
    let own = attacker.ip.to_string();
    send(
        &topology,
        0,
        &attacker,
        &geneve(&own, &node1, &target_there),
        None,
    );
    send(
        &topology,
        0,
        &attacker,
        &geneve(&own, &node0, &target_here),
        None,
    );
    assert_eq!(
        here.sources(),
        Vec::<String>::new(),
        "nothing delivered on node 0"
    );
    assert_eq!(
        there.sources(),
        Vec::<String>::new(),
        "nothing delivered on node 1"
    );
    assert_eq!(drops(&agent0, DropReason::PortSrcIp), 1);
    assert_eq!(
        drops(&agent1, DropReason::GeneveUnknownNode),
        1,
        "node 1: {:?}; node 0: {:?}",
        agent1.counters().expect("counters"),
        agent0.counters().expect("counters")
    );
    for agent in [&agent0, &agent1] {
        let counters = agent.counters().expect("counters");
        assert_eq!(
            counters.packets(Hook::Underlay, PacketClass::GeneveDecap),
            0
        );
    }
}
