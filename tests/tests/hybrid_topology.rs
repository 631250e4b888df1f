//! The hybrid overlay end to end: two overlay nodes running the agent, and a "Windows node"
//! that does not run it: a namespace on the underlay with the kernel's own VXLAN device (VNI
//! 4097, its router MAC), routing for a pod behind it, as OVN-Kubernetes' hybrid overlay has a
//! Windows node do. Both directions with ping, TCP and UDP; the wire format read by tshark;
//! services from the hybrid pod; a pod's ARP kept on its node; NetworkPolicy and
//! EgressFirewall still judging; the node's annotations removed; the VXLAN port moved to 9898.

use std::{
    thread,
    time::{Duration, Instant},
};

use dataplane_common::DropReason;
use dataplane_tests::{
    capture::Capture,
    privileged::privileged,
    service_bed::{ServicePort, cluster_ip_manifests, echo_server, tcp_answers},
    topology::{
        Agent, ExternalHost, Mode, Topology, dataplane_binary, exec_in, pod_cidr, sh_in,
        underlay_ip,
    },
};

const WINDOWS_IP: &str = "10.99.0.50";
const WINDOWS_ROUTER_MAC: &str = "00:15:5d:00:00:50";
const WINDOWS_POD: &str = "10.132.0.5";
const HYBRID_NETWORK: &str = "hybridClusterNetwork: [{cidr: 10.132.0.0/14, hostPrefix: 24}]";

/// Node `n`'s router address and MAC on the hybrid overlay (third address of its pod subnet).
fn router(n: usize) -> (String, String) {
    // Node n's pod subnet is 10.244.(n+1).0/24 (`topology::pod_cidr`).
    let subnet = n + 1;
    (
        format!("10.244.{subnet}.3"),
        format!("0a:58:0a:f4:{subnet:02x}:03"),
    )
}

/// The Windows node's Node object, with or without its hybrid overlay annotations.
fn windows_node_yaml(annotated: bool) -> String {
    let annotations = if annotated {
        format!(
            ", annotations: {{k8s.ovn.org/hybrid-overlay-node-subnet: 10.132.0.0/24, \
             k8s.ovn.org/hybrid-overlay-distributed-router-gateway-mac: '{WINDOWS_ROUTER_MAC}'}}"
        )
    } else {
        String::new()
    };
    format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: win, labels: {{kubernetes.io/os: windows}}{annotations}}}\n\
         status: {{addresses: [{{type: InternalIP, address: {WINDOWS_IP}}}]}}\n"
    )
}

/// The Windows node: VXLAN on `port` to the Linux nodes' router MACs, routes to their pod
/// subnets (and the service network, through node 0) over it, a pod behind it.
fn windows_vxlan(windows: &ExternalHost, nodes: usize, port: u16) {
    let ns = &windows.netns;
    let _ = sh_in(ns, "ip link del vxlan0");
    for line in [
        format!(
            "ip link add vxlan0 type vxlan id 4097 dstport {port} local {WINDOWS_IP} dev eth0 nolearning"
        ),
        format!("ip link set vxlan0 address {WINDOWS_ROUTER_MAC} mtu 1450 up"),
    ] {
        sh_in(ns, &line).expect("vxlan device");
    }
    for n in 0..nodes {
        let (ip, mac) = router(n);
        for line in [
            format!("ip neigh replace {ip} lladdr {mac} dev vxlan0 nud permanent"),
            format!("bridge fdb append {mac} dev vxlan0 dst {}", underlay_ip(n)),
            format!(
                "ip route replace {} via {ip} dev vxlan0 onlink",
                pod_cidr(n)
            ),
        ] {
            sh_in(ns, &line).expect("route to a Linux node");
        }
    }
    let (node0, _) = router(0);
    sh_in(
        ns,
        &format!("ip route replace 10.96.0.0/16 via {node0} dev vxlan0 onlink"),
    )
    .expect("services through node 0");
}

/// A UDP exchange from `netns` with `address:5353`: the answer, or `timeout`.
fn udp_answer(netns: &str, address: &str) -> String {
    let script = format!(
        "import socket\n\
         s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)\n\
         s.sendto(b'q', ('{address}', 5353))\n\
         try: print(s.recv(100).decode())\n\
         except socket.timeout: print('timeout')\n"
    );
    let out = exec_in(netns, &["python3", "-c", &script]).expect("udp client");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn ping(netns: &str, target: &str) -> bool {
    exec_in(netns, &["ping", "-c", "2", "-i", "0.2", "-W", "2", target])
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Waits until `check` holds (the agents read the manifests once a second).
fn eventually(what: &str, agents: &[Agent], check: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check() {
        if Instant::now() >= deadline {
            let counters: Vec<String> = agents
                .iter()
                .map(|a| format!("{:?}", a.counters().map(|c| c.drops)))
                .collect();
            panic!(
                "{what}\n{counters:#?}\n{}\n{}",
                agents[0].log(),
                agents[1].log()
            );
        }
        thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn linux_and_windows_pods_reach_each_other_over_the_hybrid_overlay() {
    if !privileged("linux_and_windows_pods_reach_each_other_over_the_hybrid_overlay") {
        return;
    }
    let mut topology = Topology::build_with(2, 1, Mode::Overlay).expect("topology");
    topology
        .set_ovn_config(&format!("hybridOverlayConfig: {{{HYBRID_NETWORK}}}"))
        .expect("hybrid overlay config");
    topology
        .add_manifest("windows.yaml", &windows_node_yaml(true))
        .expect("windows node");
    let external = topology.add_external_host().expect("outside host");
    let windows = topology
        .add_host("win", WINDOWS_IP.parse().unwrap())
        .expect("windows node");
    let pod_ns = topology.add_pod_netns("winpod").expect("windows pod");
    for line in [
        format!("ip link add wp0 type veth peer name eth0 netns {pod_ns}"),
        "ip addr add 10.132.0.1/24 dev wp0".to_owned(),
        "ip link set wp0 up".to_owned(),
        "sysctl -qw net.ipv4.ip_forward=1".to_owned(),
    ] {
        sh_in(&windows.netns, &line).expect("windows node routing");
    }
    for line in [
        format!("ip addr add {WINDOWS_POD}/24 dev eth0"),
        "ip link set eth0 up".to_owned(),
        "ip route add default via 10.132.0.1".to_owned(),
        "ethtool -K eth0 tx off".to_owned(),
    ] {
        sh_in(&pod_ns, &line).expect("windows pod");
    }
    windows_vxlan(&windows, 2, 4789);
    let pod0 = topology.node(0).pods[0].clone();
    let pod1 = topology.node(1).pods[0].clone();
    // Services: one backend on node 0 (where the Windows node sends service traffic), one on
    // node 1.
    let port = |target| ServicePort {
        name: "web",
        port: 80,
        protocol: "TCP",
        target,
    };
    topology
        .add_manifest(
            "services.yaml",
            &format!(
                "{}---\n{}",
                cluster_ip_manifests("near", "10.96.0.81", &[port(8080)], &[&pod0]),
                cluster_ip_manifests("far", "10.96.0.80", &[port(8080)], &[&pod1])
            ),
        )
        .expect("services");
    let agents: Vec<Agent> = topology
        .nodes
        .iter()
        .map(|n| n.start_agent().expect("agent"))
        .collect();
    let _servers = [
        echo_server(&pod_ns, "win", false).expect("server in the windows pod"),
        echo_server(&pod0.netns, "p0", false).expect("server on node 0"),
        echo_server(&pod1.netns, "p1", false).expect("server on node 1"),
        echo_server(&external.netns, "ext", false).expect("server outside"),
    ];
    eventually("a Linux pod pings the Windows pod", &agents, || {
        ping(&pod0.netns, WINDOWS_POD)
    });

    // The wire: VXLAN on 4789 with VNI 4097 both ways, the inner destination MAC the other
    // end's router MAC; no ARP for hybrid addresses on the underlay.
    let capture = Capture::start(
        &topology.fabric,
        "br0",
        "udp port 4789 or arp",
        400,
        &[
            "ip.src",
            "ip.dst",
            "udp.dstport",
            "vxlan.vni",
            "eth.dst",
            "arp.dst.proto_ipv4",
        ],
    )
    .expect("capture");
    for pod in [&pod0, &pod1] {
        assert!(
            ping(&pod.netns, WINDOWS_POD),
            "{} pings the Windows pod",
            pod.name
        );
        assert!(
            ping(&pod_ns, &pod.ip.to_string()),
            "the Windows pod pings {}",
            pod.name
        );
        assert_eq!(
            tcp_answers(&pod.netns, WINDOWS_POD, 8080, 1).expect("TCP to the Windows pod"),
            vec![format!("win {}", pod.ip)],
            "the Windows pod sees {}'s own address",
            pod.name
        );
        assert_eq!(
            udp_answer(&pod.netns, WINDOWS_POD),
            format!("win {}", pod.ip)
        );
    }
    assert_eq!(
        tcp_answers(&pod_ns, &pod1.ip.to_string(), 8080, 1).expect("TCP from the Windows pod"),
        vec![format!("p1 {WINDOWS_POD}")]
    );
    assert_eq!(
        udp_answer(&pod_ns, &pod0.ip.to_string()),
        format!("p0 {WINDOWS_POD}")
    );
    // Services from the Windows pod, through node 0: a backend there sees the pod, a backend
    // on node 1 sees node 0 (masqueraded, so the replies come back through node 0).
    assert_eq!(
        tcp_answers(&pod_ns, "10.96.0.81", 80, 2).unwrap_or_else(|e| panic!(
            "service, local backend: {e:#}\n{:#?}\n{:#?}",
            agents[0].counters(),
            agents[1].counters()
        )),
        vec![format!("p0 {WINDOWS_POD}"); 2]
    );
    assert_eq!(
        tcp_answers(&pod_ns, "10.96.0.80", 80, 2).expect("service, remote backend"),
        vec![format!("p1 {}", underlay_ip(0)); 2]
    );
    // ARP from a pod: its neighbours are its gateway alone, answered on the node (by the
    // pod's host-side veth), however much hybrid traffic it sent; a forged ARP for a Windows
    // pod's address or router is answered by no one and never reaches the underlay (the
    // capture's ARP check below).
    let neighbours = exec_in(&pod0.netns, &["ip", "-4", "-o", "neigh", "show"]).expect("neigh");
    let neighbours = String::from_utf8_lossy(&neighbours.stdout).into_owned();
    assert!(
        !neighbours.trim().is_empty() && neighbours.lines().all(|l| l.starts_with("169.254.1.1 ")),
        "{neighbours}"
    );
    let host_link = exec_in(
        &topology.node(0).netns,
        &["ip", "-br", "link", "show", &pod0.host_iface],
    )
    .expect("host veth");
    let host_mac = String::from_utf8_lossy(&host_link.stdout)
        .split_whitespace()
        .nth(2)
        .unwrap_or_default()
        .to_owned();
    let script = format!(
        "from scapy.all import *\n\
         conf.verb = 0\n\
         for target in ['169.254.1.1', '{WINDOWS_POD}', '10.132.0.1']:\n\
         \x20   ask = Ether(dst='ff:ff:ff:ff:ff:ff')/ARP(pdst=target, psrc='{ip}', hwsrc=get_if_hwaddr('eth0'))\n\
         \x20   answered, _ = srp(ask, iface='eth0', timeout=0.5, multi=True)\n\
         \x20   print(target, ' '.join(sorted(set(r.hwsrc for _, r in answered))) or '-')\n",
        ip = pod0.ip
    );
    let out = exec_in(&pod0.netns, &["python3", "-c", &script]).expect("scapy ARP");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .collect::<Vec<_>>(),
        [
            format!("169.254.1.1 {host_mac}"),
            format!("{WINDOWS_POD} -"),
            "10.132.0.1 -".to_owned()
        ],
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let wire = capture.finish().expect("capture");
    let vxlan: Vec<Vec<&str>> = wire
        .iter()
        .map(|l| l.split('|').collect::<Vec<_>>())
        .filter(|f| !f[3].is_empty())
        .collect();
    assert!(vxlan.len() >= 20, "VXLAN seen: {wire:#?}");
    for fields in &vxlan {
        // Addresses and MACs: the outer header's, then the inner one's.
        fn outer(f: &str) -> &str {
            f.split(',').next().unwrap_or_default()
        }
        let (src, dst, port, vni) = (
            outer(fields[0]),
            outer(fields[1]),
            outer(fields[2]),
            fields[3],
        );
        assert_eq!((port, vni), ("4789", "4097"), "{fields:?}");
        let inner_dst = fields[4].split(',').nth(1).unwrap_or_default();
        if dst == WINDOWS_IP {
            assert_eq!(inner_dst, WINDOWS_ROUTER_MAC, "{fields:?}");
        } else {
            assert_eq!(src, WINDOWS_IP, "{fields:?}");
            let node = if dst == underlay_ip(0).to_string() {
                0
            } else {
                1
            };
            assert_eq!(inner_dst, router(node).1, "{fields:?}");
        }
    }
    let hybrid_arp: Vec<&String> = wire
        .iter()
        .filter(|l| {
            l.rsplit('|')
                .next()
                .is_some_and(|a| a.starts_with("10.132."))
        })
        .collect();
    assert!(
        hybrid_arp.is_empty(),
        "ARP for hybrid addresses: {hybrid_arp:?}"
    );

    // `dataplane inspect nodes` shows the hybrid overlay, its node and the VXLAN routes.
    let out = std::process::Command::new(dataplane_binary())
        .arg("--pin-root")
        .arg(agents[0].pins.root())
        .args(["inspect", "nodes"])
        .output()
        .expect("dataplane inspect");
    let table = String::from_utf8_lossy(&out.stdout);
    let has = |words: &[&str]| table.lines().any(|l| words.iter().all(|w| l.contains(w)));
    let hybrid_route = format!("via hybrid node {WINDOWS_IP} (VXLAN)");
    let hybrid_mac = format!("router MAC {WINDOWS_ROUTER_MAC}");
    let own = format!("router MAC {}, MTU 1450", router(0).1);
    for words in [
        &["pod CIDR", "10.132.0.0/24", &hybrid_route][..],
        &[
            "pod CIDR",
            "10.132.0.0/14",
            "hybrid network, no node: dropped",
        ],
        &["hybrid node", WINDOWS_IP, &hybrid_mac],
        &["hybrid overlay", "VXLAN port 4789, VNI 4097", &own],
    ] {
        assert!(has(words), "{words:?} in:\n{table}");
    }

    // NetworkPolicy still judges: node 1's pod isolated for ingress refuses the Windows pod.
    // The EgressFirewall too: the namespace may not reach the outside host, and still reaches
    // the hybrid pods, which are the cluster's.
    topology
        .add_manifest(
            "policy.yaml",
            &format!(
                "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
                 metadata: {{name: isolate, namespace: default}}\n\
                 spec: {{podSelector: {{matchLabels: {{pod: {}}}}}, policyTypes: [Ingress]}}\n\
                 ---\napiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\n\
                 metadata: {{name: default, namespace: default}}\n\
                 spec: {{egress: [{{type: Deny, to: {{cidrSelector: {}/32}}}}]}}\n",
                pod1.name, external.ip
            ),
        )
        .expect("policies");
    eventually("node 1's pod isolated", &agents, || {
        udp_answer(&pod_ns, &pod1.ip.to_string()) == "timeout"
    });
    assert_eq!(
        udp_answer(&pod_ns, &pod0.ip.to_string()),
        format!("p0 {WINDOWS_POD}")
    );
    assert_eq!(udp_answer(&pod0.netns, &external.ip.to_string()), "timeout");
    assert_eq!(
        udp_answer(&pod0.netns, WINDOWS_POD),
        format!("win {}", pod0.ip)
    );
    topology
        .remove_manifest("policy.yaml")
        .expect("policies gone");

    // The Windows node removes its annotations: its subnet leads nowhere, and is dropped
    // with its reason, not sent to its old address.
    topology
        .add_manifest("windows.yaml", &windows_node_yaml(false))
        .expect("annotations removed");
    eventually("the Windows pod unreachable", &agents, || {
        !ping(&pod0.netns, WINDOWS_POD)
    });
    // On the wire, while three echo requests go to the Windows pod and a ping to node 1's pod
    // shows that the capture sees the overlay: nothing to or from the Windows node's address.
    let capture = Capture::start_for(
        &topology.fabric,
        "br0",
        &format!("udp port 4789 or udp port 6081 or host {WINDOWS_IP}"),
        400,
        4,
        &["ip.src", "ip.dst", "udp.dstport"],
    )
    .expect("capture");
    let before = agents[0]
        .counters()
        .expect("counters")
        .drops(DropReason::HybridNoNode);
    assert!(
        !exec_in(
            &pod0.netns,
            &["ping", "-c", "3", "-i", "0.2", "-W", "1", WINDOWS_POD]
        )
        .expect("ping")
        .status
        .success()
    );
    assert!(ping(&pod0.netns, &pod1.ip.to_string()), "node 1's pod");
    let wire = capture.finish().expect("capture");
    let after = agents[0]
        .counters()
        .expect("counters")
        .drops(DropReason::HybridNoNode);
    assert_eq!(
        after - before,
        3,
        "each echo request counted as hybrid_no_node"
    );
    assert!(
        wire.iter().any(|l| l.ends_with("|6081")),
        "the capture saw the Geneve pings: {wire:#?}"
    );
    assert!(
        !wire
            .iter()
            .any(|l| l.contains(WINDOWS_IP) || l.ends_with("|4789")),
        "nothing went to the Windows node's old address: {wire:#?}"
    );

    // Back, on VXLAN port 9898 (the operator's hybridOverlayVXLANPort).
    topology
        .set_ovn_config(&format!(
            "hybridOverlayConfig: {{{HYBRID_NETWORK}, hybridOverlayVXLANPort: 9898}}"
        ))
        .expect("port 9898");
    topology
        .add_manifest("windows.yaml", &windows_node_yaml(true))
        .expect("annotations back");
    windows_vxlan(&windows, 2, 9898);
    let capture = Capture::start(
        &topology.fabric,
        "br0",
        "udp port 9898",
        8,
        &["ip.src", "ip.dst", "udp.dstport"],
    )
    .expect("capture");
    eventually("pods reach each other on 9898", &agents, || {
        ping(&pod1.netns, WINDOWS_POD)
    });
    assert_eq!(
        tcp_answers(&pod_ns, &pod1.ip.to_string(), 8080, 1).expect("TCP on 9898"),
        vec![format!("p1 {WINDOWS_POD}")]
    );
    let wire = capture.finish().expect("capture");
    assert!(
        wire.iter().any(|l| l.starts_with(WINDOWS_IP))
            && wire.iter().any(|l| l.contains(&format!("|{WINDOWS_IP}|"))),
        "VXLAN both ways on 9898: {wire:?}"
    );
    drop(agents);
}
