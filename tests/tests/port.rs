//! Port security packet tests through the real `tc_from_pod` and `tc_to_pod`, each frame run on
//! the host-side veth of the pod it comes from or goes to (BPF_PROG_TEST_RUN on that device),
//! frames encoded by scapy: what a pod may send as itself passes unchanged, everything it may
//! not is dropped with its own reason, and a spoofed packet leaves no tracked state behind.
//!
//! The bed (`overlay_bed`): node a, pod "local" 10.244.1.3 / fd00:102a:0:1::3 behind `vp1`
//! (MAC 0a:58:0a:f4:01:03); the test frames' usual pod 10.244.1.2 behind the test runs' device.

use std::net::IpAddr;

use aya::maps::{HashMap, MapData};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    lb::{CtKey, CtValue, SCOPE_CLUSTER, ServiceKey},
    maps::{LB_CT, PROG_FROM_POD, PROG_TO_POD},
};
use dataplane_tests::{
    overlay_bed::{self, Bed, LOCAL_POD_MAC},
    packets::mac_text,
    privileged::privileged,
    scapy,
};
use dataplane_user::{
    lb::{BackendAddr, LbState, ServicePort},
    mapsync::addr16,
    overlay::compile,
};
use etherparse::PacketBuilder;

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

const POD: &str = "10.244.1.3";
const POD6: &str = "fd00:102a:0:1::3";
const POD_LL: &str = "fe80::858:aff:fef4:103";
/// The test frames' usual pod, on the same node.
const NEIGHBOUR: &str = "10.244.1.2";
const NEIGHBOUR6: &str = "fd00:102a:0:1::2";
/// A pod of node b.
const REMOTE: &str = "10.244.2.5";
const GATEWAY_MAC: &str = "02:00:00:00:01:03";
const GATEWAY: [u8; 6] = [0x02, 0, 0, 0, 0x01, 0x03];

/// The bed with the local pod dual-stack.
fn bed() -> Bed {
    let mut bed = overlay_bed::bed().expect("overlay bed");
    bed.view.local_pods[0]
        .addresses
        .push(POD6.parse().expect("address"));
    let view = bed.view.clone();
    bed.fixture
        .sync_overlay(&compile(&view).expect("compile"), None)
        .expect("sync");
    bed
}

fn pod_veth(bed: &Bed) -> u32 {
    bed.view.local_pods[0].host_ifindex
}

fn frame(expr: &str) -> Vec<u8> {
    scapy::build(expr).unwrap_or_else(|e| panic!("scapy {expr}: {e:#}"))
}

/// `Ether(src=<the pod's MAC>, dst=<its gateway>)` followed by `rest`.
fn from_pod(rest: &str) -> Vec<u8> {
    frame(&format!(
        "Ether(src='{}', dst='{GATEWAY_MAC}')/{rest}",
        mac_text(&LOCAL_POD_MAC)
    ))
}

/// Runs `frame` through `program` on the pod's veth; the verdict, the frame as it left and the
/// drop reasons counted.
fn run(
    bed: &mut Bed,
    program: &'static str,
    frame: &[u8],
) -> (u32, Vec<u8>, Vec<(DropReason, u64)>) {
    let before = bed.fixture.counters();
    let device = pod_veth(bed);
    let out = bed
        .fixture
        .run_tc_on(program, frame, 1, device)
        .expect("tc run");
    let after = bed.fixture.counters();
    let drops = DropReason::ALL
        .iter()
        .map(|&r| (r, after.drops(r) - before.drops(r)))
        .filter(|(_, n)| *n != 0)
        .collect();
    (out.action, out.output, drops)
}

/// `frame` goes on as it came: handed to the stack (`TC_ACT_OK`, the pod's veth or the host
/// routes it), every byte unchanged, no drop counted.
fn passes(bed: &mut Bed, program: &'static str, name: &str, frame: &[u8]) {
    let (action, output, drops) = run(bed, program, frame);
    assert_eq!(action, TC_ACT_OK, "{name}: verdict (drops {drops:?})");
    assert_eq!(output, frame, "{name}: what passes is not changed");
    assert!(drops.is_empty(), "{name}: {drops:?}");
}

fn refused(bed: &mut Bed, program: &'static str, name: &str, frame: &[u8], reason: DropReason) {
    let (action, _, drops) = run(bed, program, frame);
    assert_eq!(action, TC_ACT_SHOT, "{name}: verdict");
    assert_eq!(
        drops,
        vec![(reason, 1)],
        "{name}: exactly one drop, for {reason:?}"
    );
}

#[test]
fn a_pod_sends_only_as_itself() {
    if !privileged("a_pod_sends_only_as_itself") {
        return;
    }
    let mut bed = bed();
    let own_mac = mac_text(&LOCAL_POD_MAC);
    let tcp = "TCP(sport=40000, dport=443, flags='S')";
    for (name, rest) in [
        (
            "own IPv4",
            format!("IP(src='{POD}', dst='192.0.2.7')/{tcp}"),
        ),
        (
            "own IPv6",
            format!("IPv6(src='{POD6}', dst='2001:db8::7')/{tcp}"),
        ),
        (
            "own link-local IPv6",
            format!("IPv6(src='{POD_LL}', dst='fe80::1')/ICMPv6EchoRequest()"),
        ),
        (
            "DHCP discover from nobody",
            "IP(src='0.0.0.0', dst='255.255.255.255')/UDP(sport=68, dport=67)/BOOTP()".into(),
        ),
        (
            "duplicate address detection from the unspecified address",
            "IPv6(src='::', dst='ff02::1:ff00:3')/ICMPv6ND_NS(tgt='fd00:102a:0:1::3')".into(),
        ),
        (
            "MLDv2 report from the unspecified address",
            "IPv6(src='::', dst='ff02::16', hlim=1)/IPv6ExtHdrHopByHop(options=[RouterAlert()])\
             /ICMPv6MLReport2()"
                .into(),
        ),
        (
            "router solicitation with its own link-layer address",
            format!(
                "IPv6(src='{POD_LL}', dst='ff02::2')/ICMPv6ND_RS()\
                 /ICMPv6NDOptSrcLLAddr(lladdr='{own_mac}')"
            ),
        ),
        (
            "neighbour solicitation with its own link-layer address",
            format!(
                "IPv6(src='{POD6}', dst='ff02::1:ff00:1')/ICMPv6ND_NS(tgt='fd00:102a:0:1::1')\
                 /ICMPv6NDOptSrcLLAddr(lladdr='{own_mac}')"
            ),
        ),
        (
            "neighbour advertisement of its own address",
            format!(
                "IPv6(src='{POD6}', dst='fe80::1')/ICMPv6ND_NA(tgt='{POD6}', S=1)\
                 /ICMPv6NDOptDstLLAddr(lladdr='{own_mac}')"
            ),
        ),
        (
            "ARP request as itself",
            format!("ARP(op=1, hwsrc='{own_mac}', psrc='{POD}', pdst='169.254.1.1')"),
        ),
        (
            "ARP probe (claims nothing)",
            format!("ARP(op=1, hwsrc='{own_mac}', psrc='0.0.0.0', pdst='{POD}')"),
        ),
    ] {
        passes(&mut bed, PROG_FROM_POD, name, &from_pod(&rest));
    }
    let cases = [
        (
            "another pod's IPv4 on the same node",
            from_pod(&format!("IP(src='{NEIGHBOUR}', dst='192.0.2.7')/{tcp}")),
            DropReason::PortSrcIp,
        ),
        (
            "a remote pod's IPv4",
            from_pod(&format!("IP(src='{REMOTE}', dst='192.0.2.7')/{tcp}")),
            DropReason::PortSrcIp,
        ),
        (
            "another pod's IPv6",
            from_pod(&format!(
                "IPv6(src='{NEIGHBOUR6}', dst='2001:db8::7')/{tcp}"
            )),
            DropReason::PortSrcIp,
        ),
        (
            "Geneve to node a as if from node b (tunnel injection)",
            from_pod(
                "IP(src='10.99.0.2', dst='10.99.0.1')/UDP(sport=49152, dport=6081)\
                 /GENEVE(vni=1, proto=0x6558)/Ether()/IP(src='10.244.2.5', dst='10.244.1.2')/ICMP()",
            ),
            DropReason::PortSrcIp,
        ),
        (
            "the unspecified address to a unicast destination",
            from_pod(&format!("IPv6(src='::', dst='{NEIGHBOUR6}')/{tcp}")),
            DropReason::PortSrcIp,
        ),
        (
            "0.0.0.0 other than a DHCP discover",
            from_pod(&format!("IP(src='0.0.0.0', dst='192.0.2.7')/{tcp}")),
            DropReason::PortSrcIp,
        ),
        (
            "a forged source MAC",
            frame(&format!(
                "Ether(src='0a:58:0a:f4:01:02', dst='{GATEWAY_MAC}')/IP(src='{POD}', dst='192.0.2.7')/{tcp}"
            )),
            DropReason::PortSrcMac,
        ),
        (
            "gratuitous ARP claiming another pod's address",
            from_pod(&format!(
                "ARP(op=2, hwsrc='{own_mac}', psrc='{NEIGHBOUR}', hwdst='ff:ff:ff:ff:ff:ff', pdst='{NEIGHBOUR}')"
            )),
            DropReason::PortArp,
        ),
        (
            "ARP naming another MAC as its sender",
            from_pod(&format!(
                "ARP(op=2, hwsrc='0a:58:0a:f4:01:02', psrc='{POD}', pdst='169.254.1.1')"
            )),
            DropReason::PortArp,
        ),
        (
            "neighbour advertisement of another pod's address",
            from_pod(&format!(
                "IPv6(src='{POD6}', dst='ff02::1')/ICMPv6ND_NA(tgt='{NEIGHBOUR6}', O=1)\
                 /ICMPv6NDOptDstLLAddr(lladdr='{own_mac}')"
            )),
            DropReason::PortNd,
        ),
        (
            "neighbour advertisement naming another link-layer address",
            from_pod(&format!(
                "IPv6(src='{POD6}', dst='ff02::1')/ICMPv6ND_NA(tgt='{POD6}', O=1)\
                 /ICMPv6NDOptDstLLAddr(lladdr='0a:58:0a:f4:01:02')"
            )),
            DropReason::PortNd,
        ),
        (
            "neighbour solicitation naming another link-layer address",
            from_pod(&format!(
                "IPv6(src='{POD6}', dst='ff02::1:ff00:1')/ICMPv6ND_NS(tgt='fd00:102a:0:1::1')\
                 /ICMPv6NDOptSrcLLAddr(lladdr='0a:58:0a:f4:01:02')"
            )),
            DropReason::PortNd,
        ),
        (
            "router advertisement from a pod",
            from_pod(&format!(
                "IPv6(src='{POD_LL}', dst='ff02::1')/ICMPv6ND_RA()\
                 /ICMPv6NDOptSrcLLAddr(lladdr='{own_mac}')"
            )),
            DropReason::PortNd,
        ),
    ];
    for (name, frame, reason) in &cases {
        refused(&mut bed, PROG_FROM_POD, name, frame, *reason);
    }
    let counters = bed.fixture.counters();
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::Dropped),
        cases.len() as u64,
        "every refusal counted once as a drop"
    );
}

#[test]
fn only_what_is_addressed_to_a_pod_reaches_it() {
    if !privileged("only_what_is_addressed_to_a_pod_reaches_it") {
        return;
    }
    let mut bed = bed();
    let own_mac = mac_text(&LOCAL_POD_MAC);
    let to = |dst_mac: &str, rest: &str| {
        frame(&format!(
            "Ether(src='{GATEWAY_MAC}', dst='{dst_mac}')/{rest}"
        ))
    };
    let udp = "UDP(sport=53, dport=40000)";
    for (name, frame) in [
        (
            "its MAC and IPv4",
            to(&own_mac, &format!("IP(src='{REMOTE}', dst='{POD}')/{udp}")),
        ),
        (
            "its MAC and IPv6",
            to(
                &own_mac,
                &format!("IPv6(src='fd00:102a:0:2::5', dst='{POD6}')/{udp}"),
            ),
        ),
        (
            "its link-local address",
            to(
                &own_mac,
                &format!("IPv6(src='fe80::1', dst='{POD_LL}')/ICMPv6EchoRequest()"),
            ),
        ),
        (
            "an IGMP query to all hosts",
            to(
                "01:00:5e:00:00:01",
                "IP(src='169.254.1.1', dst='224.0.0.1', ttl=1, proto=2)\
                 /Raw(load=b'\\x11\\x64\\xee\\x9b\\x00\\x00\\x00\\x00')",
            ),
        ),
        (
            "the IPv4 broadcast",
            to(
                "ff:ff:ff:ff:ff:ff",
                "IP(src='10.244.1.1', dst='255.255.255.255')/UDP(sport=67, dport=68)",
            ),
        ),
        (
            "an MLD query to all nodes",
            to(
                "33:33:00:00:00:01",
                "IPv6(src='fe80::1', dst='ff02::1', hlim=1)\
                 /IPv6ExtHdrHopByHop(options=[RouterAlert()])/ICMPv6MLQuery2()",
            ),
        ),
        (
            "an ARP request for it",
            to(
                "ff:ff:ff:ff:ff:ff",
                &format!("ARP(op=1, hwsrc='{GATEWAY_MAC}', psrc='169.254.1.1', pdst='{POD}')"),
            ),
        ),
    ] {
        passes(&mut bed, PROG_TO_POD, name, &frame);
    }
    for (name, frame, reason) in [
        (
            "another pod's MAC",
            to(
                "0a:58:0a:f4:01:02",
                &format!("IP(src='{REMOTE}', dst='{POD}')/{udp}"),
            ),
            DropReason::PortDstMac,
        ),
        (
            "another pod's IPv4 with this pod's MAC",
            to(
                &own_mac,
                &format!("IP(src='{REMOTE}', dst='{NEIGHBOUR}')/{udp}"),
            ),
            DropReason::PortDstIp,
        ),
        (
            "another pod's IPv6 with this pod's MAC",
            to(
                &own_mac,
                &format!("IPv6(src='fd00:102a:0:2::5', dst='{NEIGHBOUR6}')/{udp}"),
            ),
            DropReason::PortDstIp,
        ),
        (
            "a VLAN-tagged frame",
            to(
                &own_mac,
                &format!("Dot1Q(vlan=7)/IP(src='{REMOTE}', dst='{POD}')/{udp}"),
            ),
            DropReason::PortEthertype,
        ),
        // Addressed as port security allows, refused by the multicast policy: this pod's
        // namespace has not enabled multicast, and no member copy carries the mark.
        (
            "data to an IPv4 group",
            to(
                "01:00:5e:00:00:01",
                "IP(src='10.244.1.1', dst='224.0.0.1')/UDP(sport=5000, dport=5000)",
            ),
            DropReason::MulticastDisabled,
        ),
        (
            "an echo to an IPv6 group",
            to(
                "33:33:00:00:00:01",
                "IPv6(src='fe80::1', dst='ff02::1')/ICMPv6EchoRequest()",
            ),
            DropReason::MulticastDisabled,
        ),
    ] {
        refused(&mut bed, PROG_TO_POD, name, &frame, reason);
    }
}

#[test]
fn a_spoofed_packet_never_reaches_the_load_balancer_or_the_flow_cache() {
    if !privileged("a_spoofed_packet_never_reaches_the_load_balancer_or_the_flow_cache") {
        return;
    }
    let mut bed = bed();
    // A service whose backend is another pod of this node: a spoofed SYN to it would create a
    // conntrack entry if it reached the load-balancer.
    let mut state = LbState::default();
    let backend = BackendAddr {
        ip: IpAddr::from([10, 244, 1, 2]),
        port: 8080,
    };
    let port = ServicePort {
        name: "test/svc:80".into(),
        kind: dataplane_user::lb::AddressKind::ClusterIp,
        key: ServiceKey {
            addr: addr16("10.96.0.10".parse().expect("vip")),
            port_be: 80u16.to_be_bytes(),
            protocol: 6,
            scope: SCOPE_CLUSTER,
        },
        affinity_timeout: 0,
        ready: vec![backend],
        terminating: Vec::new(),
        source_ranges: Vec::new(),
        topology: None,
    };
    bed.fixture.sync_lb(&mut state, &[port]).expect("sync lb");
    // A flood of random sources (and random source MACs) to the service.
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for n in 0..200u32 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let b = seed.to_be_bytes();
        let src = [b[0], b[1], b[2], b[3]];
        let mac = if n % 2 == 0 {
            LOCAL_POD_MAC
        } else {
            [0x0a, 0x58, b[4], b[5], b[6], b[7]]
        };
        let mut spoofed = Vec::new();
        PacketBuilder::ethernet2(mac, GATEWAY)
            .ipv4(src, [10, 96, 0, 10], 64)
            .tcp(1024 + n as u16, 80, 1, 64240)
            .syn()
            .write(&mut spoofed, &[])
            .expect("etherparse");
        let (action, _, _) = run(&mut bed, PROG_FROM_POD, &spoofed);
        assert_eq!(action, TC_ACT_SHOT, "spoofed source {src:?}");
    }
    let ct: HashMap<&mut MapData, CtKey, CtValue> =
        bed.fixture.typed_map(LB_CT).expect("conntrack map");
    assert_eq!(
        ct.keys().count(),
        0,
        "no conntrack entry from a spoofed packet"
    );
    let counters = bed.fixture.counters();
    assert_eq!(
        counters.drops(DropReason::PortSrcIp) + counters.drops(DropReason::PortSrcMac),
        200
    );
    assert_eq!(counters.packets(Hook::FromPod, PacketClass::ServiceDnat), 0);
    // The pod's own SYN to the service is translated and tracked.
    let own = from_pod(&format!(
        "IP(src='{POD}', dst='10.96.0.10')/TCP(sport=40000, dport=80, flags='S')"
    ));
    let device = pod_veth(&bed);
    let out = bed
        .fixture
        .run_tc_on(PROG_FROM_POD, &own, 1, device)
        .expect("tc run");
    assert_eq!(
        out.action, TC_ACT_REDIRECT,
        "delivered to the local backend"
    );
    let ct: HashMap<&mut MapData, CtKey, CtValue> =
        bed.fixture.typed_map(LB_CT).expect("conntrack map");
    assert_eq!(
        ct.keys().count(),
        2,
        "both directions of the pod's own flow"
    );
}
