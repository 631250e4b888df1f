//! Hybrid overlay packet tests through the real programs (BPF_PROG_TEST_RUN) on the overlay
//! bed with one hybrid node: what we encapsulate in VXLAN must equal, byte for byte, what
//! scapy's VXLAN layer builds; what scapy builds must be unwrapped, or refused with its reason,
//! as OVN-Kubernetes' hybrid overlay has it (VNI 4097, a hybrid node's address, this node's
//! router MAC inside).

use dataplane_common::{
    DropReason, Hook, PacketClass,
    maps::{PROG_FROM_POD, PROG_UNDERLAY},
};
use dataplane_tests::{
    hybrid_bed::{
        HYBRID_NODE_IP, HYBRID_NODE_MAC, HYBRID_ROUTER_MAC, ROUTER_MAC, hybrid_view, set_hybrid,
    },
    overlay_bed::{self, UNDERLAY_MAC},
    packets::{self, GW_MAC, POD_MAC},
    privileged::privileged,
    scapy::{self, bytes_of, hex},
};
use serde_json::json;

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

fn build(expr: &str) -> Vec<u8> {
    bytes_of(&scapy::call(&json!({"op": "build", "expr": expr})).expect("scapy build"))
}

fn mac(bytes: &[u8; 6]) -> String {
    packets::mac_text(bytes)
}

/// A frame from the test pod carrying `packet` (a scapy expression from the IP header on).
fn from_pod(packet: &str) -> Vec<u8> {
    build(&format!(
        "Ether(src='{}', dst='{}')/{packet}",
        mac(&POD_MAC),
        mac(&GW_MAC)
    ))
}

/// VXLAN as a hybrid node sends it to node a, around `inner` (a scapy expression from the
/// inner IP header on); `fields` override the outer source, VNI and inner destination MAC.
fn from_hybrid(inner: &str, fields: &[(&str, &str)]) -> Vec<u8> {
    let field = |name: &str, default: String| {
        fields
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(default, |(_, v)| (*v).to_owned())
    };
    build(&format!(
        "Ether(src='{HYBRID_NODE_MAC}', dst='{}')/IP(src='{}', dst='10.99.0.1', ttl=64)/\
         UDP(sport=51000, dport={}, chksum=0)/VXLAN(flags=0x08, vni={})/\
         Ether(src='{}', dst='{}')/{inner}",
        mac(&UNDERLAY_MAC),
        field("src", HYBRID_NODE_IP.to_owned()),
        field("dport", "4789".to_owned()),
        field("vni", "4097".to_owned()),
        mac(&HYBRID_ROUTER_MAC),
        field("inner_dst", mac(&ROUTER_MAC)),
    ))
}

#[test]
fn pod_traffic_to_a_hybrid_pod_is_vxlan_as_scapy_builds_it() {
    if !privileged("pod_traffic_to_a_hybrid_pod_is_vxlan_as_scapy_builds_it") {
        return;
    }
    let mut bed = overlay_bed::bed().expect("overlay bed");
    for port in [4789u16, 9898] {
        set_hybrid(&mut bed, Some(hybrid_view(port, true))).expect("hybrid maps");
        for (name, inner) in [
            (
                "tcp",
                "IP(src='10.244.1.2', dst='10.132.0.5', ttl=64, id=7)/TCP(sport=40000, dport=80, flags='S')",
            ),
            (
                "udp",
                "IP(src='10.244.1.2', dst='10.132.0.5', ttl=64, id=8)/UDP(sport=40000, dport=53)/Raw(b'hybrid')",
            ),
        ] {
            let frame = from_pod(inner);
            let out = bed
                .fixture
                .run_tc(PROG_FROM_POD, &frame, 1)
                .expect("tc run");
            assert_eq!(
                out.action,
                TC_ACT_REDIRECT,
                "{name}: {:?}",
                bed.fixture.counters().drops
            );
            assert_eq!(
                out.output.len(),
                frame.len() + 50,
                "{name}: 50 bytes over IPv4"
            );
            let sport = u16::from_be_bytes([out.output[34], out.output[35]]);
            assert!(
                sport >= 0xC000,
                "{name}: source port {sport} from the flow hash"
            );
            // Outer: node a to the hybrid node, DF, UDP to the configured port without a
            // checksum; VXLAN with only the I flag and VNI 4097; inner: this node's router
            // MAC to the hybrid node's, then the pod's IP packet unchanged.
            let expected = build(&format!(
                "Ether(src='{}', dst='{HYBRID_NODE_MAC}')/\
                 IP(src='10.99.0.1', dst='{HYBRID_NODE_IP}', ttl=64, id=0, flags='DF')/\
                 UDP(sport={sport}, dport={port}, chksum=0)/VXLAN(flags=0x08, vni=4097)/\
                 Ether(src='{}', dst='{}', type=0x0800)/Raw(bytes.fromhex('{}'))",
                mac(&UNDERLAY_MAC),
                mac(&ROUTER_MAC),
                mac(&HYBRID_ROUTER_MAC),
                hex(&frame[14..]),
            ));
            assert_eq!(
                hex(&out.output),
                hex(&expected),
                "{name} on port {port}: every byte as scapy builds it"
            );
        }
    }
    let counters = bed.fixture.counters();
    assert_eq!(counters.packets(Hook::FromPod, PacketClass::VxlanEncap), 4);
    assert_eq!(counters.packets(Hook::FromPod, PacketClass::GeneveEncap), 0);
}

#[test]
fn vxlan_from_a_hybrid_node_is_unwrapped_and_anything_else_refused_with_its_reason() {
    if !privileged(
        "vxlan_from_a_hybrid_node_is_unwrapped_and_anything_else_refused_with_its_reason",
    ) {
        return;
    }
    let mut bed = overlay_bed::bed().expect("overlay bed");
    set_hybrid(&mut bed, Some(hybrid_view(4789, true))).expect("hybrid maps");
    let inner = "IP(src='10.132.0.5', dst='10.244.1.3', ttl=63, id=9)/TCP(sport=50000, dport=8080, flags='S')";
    let out = bed
        .fixture
        .run_xdp(PROG_UNDERLAY, &from_hybrid(inner, &[]), 1)
        .expect("xdp run");
    assert_eq!(out.action, XDP_PASS, "{:?}", bed.fixture.counters().drops);
    // The inner frame, addressed to this node for the stack to route to the pod.
    let expected = build(&format!(
        "Ether(src='{}', dst='{}')/{inner}",
        mac(&HYBRID_ROUTER_MAC),
        mac(&UNDERLAY_MAC)
    ));
    assert_eq!(hex(&out.output), hex(&expected));
    assert_eq!(
        bed.fixture
            .counters()
            .packets(Hook::Underlay, PacketClass::VxlanDecap),
        1
    );

    for (case, frame, reason) in [
        (
            "another VNI",
            from_hybrid(inner, &[("vni", "4096")]),
            DropReason::HybridWrongVni,
        ),
        (
            "another inner destination MAC",
            from_hybrid(inner, &[("inner_dst", "02:00:00:00:01:01")]),
            DropReason::HybridWrongMac,
        ),
        (
            "from a node of the dataplane, not a hybrid one",
            from_hybrid(inner, &[("src", "10.99.0.2")]),
            DropReason::HybridUnknownNode,
        ),
        (
            "an inner IPv6 packet",
            from_hybrid(
                "IPv6(src='fd00::5', dst='fd00:102a:0:1::3')/TCP(dport=80)",
                &[],
            ),
            DropReason::HybridMalformed,
        ),
        (
            "an inner frame shorter than its Ethernet header",
            build(&format!(
                "Ether(src='{HYBRID_NODE_MAC}', dst='{}')/IP(src='{HYBRID_NODE_IP}', dst='10.99.0.1')/\
                 UDP(sport=51000, dport=4789, chksum=0)/VXLAN(flags=0x08, vni=4097)/\
                 Raw(bytes.fromhex('{}0000'))",
                mac(&UNDERLAY_MAC),
                hex(&ROUTER_MAC),
            )),
            DropReason::HybridMalformed,
        ),
    ] {
        let before = bed.fixture.counters().drops(reason);
        let out = bed
            .fixture
            .run_xdp(PROG_UNDERLAY, &frame, 1)
            .expect("xdp run");
        assert_eq!(out.action, XDP_DROP, "{case}");
        assert_eq!(
            bed.fixture.counters().drops(reason),
            before + 1,
            "{case}: counted as {}",
            reason.name()
        );
    }
    // VXLAN to another port is not the hybrid overlay's: left alone.
    let other_port = from_hybrid(inner, &[("dport", "9898")]);
    let out = bed
        .fixture
        .run_xdp(PROG_UNDERLAY, &other_port, 1)
        .expect("xdp run");
    assert_eq!(out.action, XDP_PASS);
    assert_eq!(out.output, other_port, "untouched");
    // With the hybrid overlay off, nothing is unwrapped.
    set_hybrid(&mut bed, None).expect("hybrid off");
    let frame = from_hybrid(inner, &[]);
    let out = bed
        .fixture
        .run_xdp(PROG_UNDERLAY, &frame, 1)
        .expect("xdp run");
    assert_eq!((out.action, out.output), (XDP_PASS, frame));
}

#[test]
fn oversized_packets_to_a_hybrid_pod_get_the_vxlan_mtu_and_a_gone_node_gets_nothing() {
    if !privileged(
        "oversized_packets_to_a_hybrid_pod_get_the_vxlan_mtu_and_a_gone_node_gets_nothing",
    ) {
        return;
    }
    let mut bed = overlay_bed::bed().expect("overlay bed");
    set_hybrid(&mut bed, Some(hybrid_view(4789, true))).expect("hybrid maps");
    let sized = |ip_len: usize| {
        from_pod(&format!(
            "IP(src='10.244.1.2', dst='10.132.0.5', flags='DF')/UDP(sport=1000, dport=2000)/Raw(b'x' * {})",
            ip_len - 28
        ))
    };
    // 1450 bytes fit the underlay's 1500 after VXLAN's 50 (more than Geneve's pod MTU, 1400).
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &sized(1450), 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(out.output.len(), 14 + 1450 + 50, "encapsulated");
    // One byte more is answered: fragmentation needed, MTU 1450.
    let frame = sized(1451);
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &frame, 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT);
    let answer =
        scapy::call(&json!({"op": "icmp_error", "hex": hex(&out.output)})).expect("decode");
    assert_eq!(
        (answer["type"].as_u64(), answer["code"].as_u64()),
        (Some(3), Some(4))
    );
    assert_eq!(answer["mtu"], 1450);
    assert_eq!(answer["dst_ip"], "10.244.1.2");
    assert_eq!(answer["icmp_chksum_ok"], true);
    assert_eq!(answer["quote"], hex(&frame[14..14 + 28]));

    // The hybrid node removes its annotations: its subnet is the hybrid network's, of no
    // node, and what is sent there is dropped, never sent to its old address.
    set_hybrid(&mut bed, Some(hybrid_view(4789, false))).expect("hybrid maps");
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &sized(100), 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_SHOT);
    assert_eq!(bed.fixture.counters().drops(DropReason::HybridNoNode), 1);
}
