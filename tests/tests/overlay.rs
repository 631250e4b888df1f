//! Geneve overlay packet tests through the real programs with BPF_PROG_TEST_RUN, checked
//! against scapy's Geneve implementation: what we encapsulate must equal, byte for byte, what
//! scapy builds for the same input; what scapy builds must be decapsulated (or refused) as
//! RFC 8926 says.

use aya::maps::{Array, DevMapHash, HashMap, MapData};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    acl::AclEndpoint,
    maps::{self, PROG_FROM_POD, PROG_UNDERLAY, PROG_UNDERLAY_TC},
};
use dataplane_tests::{
    overlay_bed::{LOCAL_HOST_MAC, LOCAL_POD_MAC, NODE_B_MAC, NODE_C_MAC, UNDERLAY_MAC},
    packets,
    privileged::privileged,
    scapy::{self, bytes_of, hex},
};
use serde_json::json;

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_REDIRECT: u32 = 4;
const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

#[test]
fn encapsulation_over_ipv4_matches_scapy_byte_for_byte() {
    if !privileged("encapsulation_over_ipv4_matches_scapy_byte_for_byte") {
        return;
    }
    let mut bed = dataplane_tests::overlay_bed::bed().expect("overlay bed");
    for (name, inner) in [
        ("ipv4 tcp", packets::ipv4_tcp()),
        ("ipv4 udp", packets::ipv4_udp()),
        (
            "ipv6 tcp (node b has no IPv6 underlay)",
            packets::ipv6_tcp(),
        ),
    ] {
        let out = bed
            .fixture
            .run_tc(PROG_FROM_POD, &inner, 1)
            .expect("tc run");
        assert_eq!(
            out.action,
            TC_ACT_REDIRECT,
            "{name}: redirected to the underlay ({:?})",
            bed.fixture.counters().drops
        );
        assert_eq!(
            out.output.len(),
            inner.len() + 50,
            "{name}: 50 bytes of overhead"
        );
        let sport = u16::from_be_bytes([out.output[34], out.output[35]]);
        assert_eq!(
            sport,
            expected_source_port(&inner),
            "{name}: source port from the inner flow's hash"
        );
        let expected = bytes_of(
            &scapy::call(&json!({
                "op": "encap", "inner": hex(&inner),
                "src_mac": packets::mac_text(&UNDERLAY_MAC), "dst_mac": NODE_B_MAC,
                "src_ip": "10.99.0.1", "dst_ip": "10.99.0.2",
                "sport": sport, "dport": 6081, "vni": 1,
            }))
            .expect("scapy encap"),
        );
        assert_eq!(
            hex(&out.output),
            hex(&expected),
            "{name}: every byte as scapy builds it"
        );
        let decoded =
            scapy::call(&json!({"op": "decode", "hex": hex(&out.output)})).expect("decode");
        assert_eq!(decoded["ip_chksum_ok"], true, "{name}");
        assert_eq!(decoded["df"], true, "{name}");
        assert_eq!(decoded["ttl"], 64, "{name}");
        assert_eq!(decoded["udp_chksum"], 0, "{name}");
        assert_eq!(decoded["vni"], 1, "{name}");
        assert_eq!(decoded["proto"], 0x6558, "{name}");
        assert_eq!(decoded["inner"], hex(&inner), "{name}");
    }
    let counters = bed.fixture.counters();
    assert_eq!(counters.packets(Hook::FromPod, PacketClass::GeneveEncap), 3);
}

#[test]
fn encapsulation_over_ipv6_matches_scapy_byte_for_byte() {
    if !privileged("encapsulation_over_ipv6_matches_scapy_byte_for_byte") {
        return;
    }
    let mut bed = dataplane_tests::overlay_bed::bed().expect("overlay bed");
    let inner = packets::with_ipv4_destination(&packets::ipv4_tcp(), [10, 244, 3, 2]);
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &inner, 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(out.output.len(), inner.len() + 70);
    let flow_label = u32::from_be_bytes([0, out.output[15] & 0x0f, out.output[16], out.output[17]]);
    let sport = u16::from_be_bytes([out.output[54], out.output[55]]);
    assert_eq!(sport, expected_source_port(&inner));
    assert_eq!(flow_label, inner_flow_hash(&inner) & 0x000F_FFFF);
    let expected = bytes_of(
        &scapy::call(&json!({
            "op": "encap", "inner": hex(&inner),
            "src_mac": packets::mac_text(&UNDERLAY_MAC), "dst_mac": NODE_C_MAC,
            "src_ip": "fd99::1", "dst_ip": "fd99::3", "flow_label": flow_label,
            "sport": sport, "dport": 6081, "vni": 1,
        }))
        .expect("scapy encap"),
    );
    assert_eq!(hex(&out.output), hex(&expected));
    let decoded = scapy::call(&json!({"op": "decode", "hex": hex(&out.output)})).expect("decode");
    assert_eq!(decoded["hlim"], 64);
    assert_eq!(decoded["plen"], inner.len() + 70 - 14 - 40);
    assert_eq!(decoded["inner"], hex(&inner));
}

/// The inner flow's hash as the encapsulation defines it, written from its description: the
/// 32-bit words of the addresses (native order, as loaded) XORed with the XOR of the ports
/// and the protocol, through murmur3's 32-bit finalizer. The same both ways of a flow.
fn inner_flow_hash(frame: &[u8]) -> u32 {
    let l3 = packets::L3;
    let word = |at: usize| u32::from_ne_bytes(frame[at..at + 4].try_into().expect("four bytes"));
    let (addresses, l4, protocol) = if frame[l3] >> 4 == 6 {
        (l3 + 8..l3 + 40, l3 + 40, frame[l3 + 6])
    } else {
        (
            l3 + 12..l3 + 20,
            l3 + usize::from(frame[l3] & 0x0f) * 4,
            frame[l3 + 9],
        )
    };
    let mut fold = u32::from_ne_bytes([
        frame[l4] ^ frame[l4 + 2],
        frame[l4 + 1] ^ frame[l4 + 3],
        protocol,
        0,
    ]);
    for at in addresses.step_by(4) {
        fold ^= word(at);
    }
    fold ^= fold >> 16;
    fold = fold.wrapping_mul(0x85eb_ca6b);
    fold ^= fold >> 13;
    fold = fold.wrapping_mul(0xc2b2_ae35);
    fold ^ (fold >> 16)
}

/// The outer UDP source port: 0xC000 and the low 14 bits of the inner flow's hash.
fn expected_source_port(inner: &[u8]) -> u16 {
    0xC000 | (inner_flow_hash(inner) as u16 & 0x3FFF)
}

/// The route to a node is copied per CPU for the rest of the clock second: a neighbour change
/// reaches the encapsulation from the next second on, and a packet longer than the copy was
/// checked for is looked up again, so a lowered route MTU still refuses it.
#[test]
fn the_copied_route_to_a_node_follows_neighbour_and_mtu_changes() {
    if !privileged("the_copied_route_to_a_node_follows_neighbour_and_mtu_changes") {
        return;
    }
    let mut bed = dataplane_tests::overlay_bed::bed().expect("overlay bed");
    let frame = packets::ipv4_udp();
    let dst_mac =
        |out: &dataplane_user::kernel::testrun::RunOutcome| packets::mac_text(&out.output[..6]);
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &frame, 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(dst_mac(&out), NODE_B_MAC);
    bed.ip("neigh replace 10.99.0.2 lladdr 02:00:00:00:99:42 dev ul0 nud permanent")
        .expect("neighbour");
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &frame, 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(dst_mac(&out), "02:00:00:00:99:42", "the new neighbour");

    // The copy was checked for a short packet; a full one is looked up and refused.
    // (Locked: the kernel's route lookups honour a route's own MTU only then, or with
    // `ip_forward_use_pmtu`.)
    bed.ip("route add 10.99.0.2/32 dev ul0 mtu lock 1420")
        .expect("route");
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &oversize_v4(1400, true), 1)
        .expect("tc run");
    assert_eq!(out.action, 2, "TC_ACT_SHOT");
    assert_eq!(
        bed.fixture.counters().drops(DropReason::OverlayMtuExceeded),
        1
    );
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &frame, 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT, "what fits still goes");
    assert_eq!(
        bed.fixture
            .counters()
            .packets(Hook::FromPod, PacketClass::GeneveEncap),
        3
    );
}

#[test]
fn same_node_pods_are_redirected_never_encapsulated() {
    if !privileged("same_node_pods_are_redirected_never_encapsulated") {
        return;
    }
    let mut bed = dataplane_tests::overlay_bed::bed().expect("overlay bed");
    let frame = packets::with_ipv4_destination(&packets::ipv4_tcp(), [10, 244, 1, 3]);
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &frame, 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(out.output.len(), frame.len(), "no encapsulation");
    assert_eq!(&out.output[..6], &LOCAL_POD_MAC, "addressed to the pod");
    assert_eq!(&out.output[6..12], &LOCAL_HOST_MAC, "from its gateway");
    assert_eq!(&out.output[12..], &frame[12..], "the rest untouched");
    let counters = bed.fixture.counters();
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::LocalRedirect),
        1
    );
    assert_eq!(counters.packets(Hook::FromPod, PacketClass::GeneveEncap), 0);
}

#[test]
fn traffic_outside_the_pod_network_is_left_to_the_stack() {
    if !privileged("traffic_outside_the_pod_network_is_left_to_the_stack") {
        return;
    }
    let mut bed = dataplane_tests::overlay_bed::bed().expect("overlay bed");
    let outside_v4 = packets::with_ipv4_destination(&packets::ipv4_tcp(), [192, 0, 2, 1]);
    // In a /16 with pods (node b's 10.244.2.0/24): looked up, and no subnet holds it.
    let near_v4 = packets::with_ipv4_destination(&packets::ipv4_udp(), [10, 244, 9, 1]);
    let mut outside_v6 = packets::ipv6_tcp();
    outside_v6[packets::L3 + 24..packets::L3 + 40]
        .copy_from_slice(&[0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
    let run_all = |bed: &mut dataplane_tests::overlay_bed::Bed| {
        for frame in [&outside_v4, &near_v4, &outside_v6] {
            let out = bed.fixture.run_tc(PROG_FROM_POD, frame, 1).expect("tc run");
            assert_eq!(out.action, TC_ACT_OK);
            assert_eq!(&out.output, frame);
        }
    };
    run_all(&mut bed);
    // The agent's bitmap of destinations outside the pod networks: set but for the pods'
    // and subnets' prefixes. Cleared (as a new program's map starts), the lookups decide
    // alike; and a pod subnet is still encapsulated.
    let mut outside: Array<&mut MapData, u64> = bed
        .fixture
        .typed_map(maps::OUTSIDE)
        .expect("outside bitmap");
    let words: Vec<u64> = outside.iter().map(|w| w.expect("word")).collect();
    let clear: u32 = words.iter().map(|w| w.count_zeros()).sum();
    assert_eq!(
        clear, 2,
        "10.244/16, and the fold of fd00:102a (both nodes' subnets)"
    );
    for index in 0..words.len() as u32 {
        outside.set(index, 0, 0).expect("clear");
    }
    run_all(&mut bed);
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &packets::ipv4_tcp(), 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT, "encapsulated");
}

/// A scapy-built Geneve packet for node a, with `overrides` applied to the request.
fn geneve(overrides: serde_json::Value, inner: &[u8]) -> Vec<u8> {
    let mut request = json!({
        "op": "geneve", "inner": hex(inner),
        "src_mac": "02:00:00:00:99:02", "dst_mac": packets::mac_text(&UNDERLAY_MAC),
        "src_ip": "10.99.0.2", "dst_ip": "10.99.0.1",
        "sport": 50000, "dport": 6081, "vni": 1,
    });
    for (key, value) in overrides.as_object().expect("object") {
        request[key] = value.clone();
    }
    bytes_of(&scapy::call(&request).expect("scapy geneve"))
}

/// A scapy-built frame from a pod of node b (10.244.2.5) to the local pod 10.244.1.3, with
/// `ttl` and `transport` (a scapy layer expression), checksums by scapy unless the layer
/// gives one.
fn inner_frame(dst_mac: [u8; 6], src_mac: [u8; 6], ttl: u8, transport: &str) -> Vec<u8> {
    scapy_frame(
        dst_mac,
        src_mac,
        &format!("IP(src='10.244.2.5', dst='10.244.1.3', ttl={ttl}, id=7)/{transport}"),
    )
}

/// A scapy-built Ethernet frame between the given MACs carrying `layers` (a scapy layer
/// expression).
fn scapy_frame(dst_mac: [u8; 6], src_mac: [u8; 6], layers: &str) -> Vec<u8> {
    let expr = format!(
        "Ether(dst='{}', src='{}')/{layers}",
        packets::mac_text(&dst_mac),
        packets::mac_text(&src_mac),
    );
    bytes_of(&scapy::call(&json!({"op": "build", "expr": expr})).expect("scapy build"))
}

/// Puts the local pod 10.244.1.3 under access control as `endpoint` says.
fn police_local_pod(bed: &mut dataplane_tests::overlay_bed::Bed, endpoint: AclEndpoint) {
    let mut active: Array<&mut MapData, u32> =
        bed.fixture.typed_map(maps::ACL_ACTIVE).expect("acl active");
    active.set(0, 1, 0).expect("set");
    let pod = std::net::Ipv4Addr::new(10, 244, 1, 3)
        .to_ipv6_mapped()
        .octets();
    let mut endpoints: HashMap<&mut MapData, [u8; 16], AclEndpoint> = bed
        .fixture
        .typed_map(maps::ACL_ENDPOINTS)
        .expect("endpoints");
    endpoints.insert(pod, endpoint, 0).expect("insert");
}

/// The checksum field a sender with checksum offload leaves in a segment of `len` bytes of
/// `protocol` from 10.244.2.5 to 10.244.1.3: the pseudo-header's sum, folded, not complemented.
fn offload_seed(protocol: u16, len: u16) -> u16 {
    let words = [
        0x0af4u32,
        0x0205,
        0x0af4,
        0x0103,
        u32::from(protocol),
        u32::from(len),
    ];
    let mut sum: u32 = words.iter().sum();
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    sum as u16
}

#[test]
fn decapsulated_frames_go_straight_to_a_pod_that_takes_xdp() {
    if !privileged("decapsulated_frames_go_straight_to_a_pod_that_takes_xdp") {
        return;
    }
    let sender = [0x0a, 0x58, 10, 244, 2, 5];
    let tcp = "TCP(sport=40000, dport=8080, flags='S', seq=1)";
    let udp = "UDP(sport=40000, dport=5353)/Raw(b'abc')";
    let mut bed = dataplane_tests::overlay_bed::bed().expect("overlay bed");
    let pod_veth = bed.view.local_pods[0].host_ifindex;
    // Before the agent says the pod's end takes frames from XDP: up the stack.
    let frame = inner_frame(UNDERLAY_MAC, sender, 64, tcp);
    let out = bed
        .fixture
        .run_xdp(PROG_UNDERLAY, &geneve(json!({}), &frame), 1)
        .expect("xdp run");
    assert_eq!(out.action, XDP_PASS, "not in DP_XDP_PODS");
    let mut xdp_pods: DevMapHash<&mut MapData> =
        bed.fixture.typed_map(maps::XDP_PODS).expect("xdp pods");
    xdp_pods
        .insert(pod_veth, pod_veth, None, 0)
        .expect("insert");

    // Delivered: addressed as the pod's gateway would, the TTL one lower (scapy's own header
    // checksum for TTL 63 is what the incremental update must give), nothing else changed.
    for (name, transport) in [
        ("tcp", tcp),
        ("udp", udp),
        (
            "udp, no checksum",
            "UDP(sport=40000, dport=5353, chksum=0)/Raw(b'abc')",
        ),
    ] {
        let before = bed
            .fixture
            .counters()
            .packets(Hook::Underlay, PacketClass::LocalRedirect);
        let frame = inner_frame(UNDERLAY_MAC, sender, 64, transport);
        let out = bed
            .fixture
            .run_xdp(PROG_UNDERLAY, &geneve(json!({}), &frame), 1)
            .expect("xdp run");
        assert_eq!(out.action, XDP_REDIRECT, "{name}");
        let expected = inner_frame(LOCAL_POD_MAC, LOCAL_HOST_MAC, 63, transport);
        assert_eq!(
            hex(&out.output),
            hex(&expected),
            "{name}: the frame the pod gets"
        );
        assert_eq!(
            bed.fixture
                .counters()
                .packets(Hook::Underlay, PacketClass::LocalRedirect),
            before + 1,
            "{name}"
        );
    }

    // Sent with checksum offload (a veth underlay carries the segments as their sender's
    // stack left them, the checksum field holding the pseudo-header's sum): delivered with
    // the checksum completed, byte for byte scapy's.
    for (name, seeded, whole) in [
        (
            "tcp, checksum left to offload",
            format!(
                "TCP(sport=40000, dport=8080, flags='S', seq=1, chksum={})",
                offload_seed(6, 20)
            ),
            tcp,
        ),
        (
            "udp, checksum left to offload",
            format!(
                "UDP(sport=40000, dport=5353, chksum={})/Raw(b'abc')",
                offload_seed(17, 11)
            ),
            udp,
        ),
    ] {
        let frame = inner_frame(UNDERLAY_MAC, sender, 64, &seeded);
        let out = bed
            .fixture
            .run_xdp(PROG_UNDERLAY, &geneve(json!({}), &frame), 1)
            .expect("xdp run");
        assert_eq!(out.action, XDP_REDIRECT, "{name}");
        let expected = inner_frame(LOCAL_POD_MAC, LOCAL_HOST_MAC, 64 - 1, whole);
        assert_eq!(hex(&out.output), hex(&expected), "{name}");
    }

    // Anything the stack or the tc programs would do more than route goes up to them,
    // unchanged but for its destination MAC.
    let big = "TCP(sport=40000, dport=8080, flags='A')/Raw(b'x' * 600)";
    let up: Vec<(&str, Vec<u8>)> = vec![
        (
            "a transport checksum left to the receiver (offload)",
            inner_frame(
                UNDERLAY_MAC,
                sender,
                64,
                "TCP(sport=40000, dport=8080, chksum=0x1234)",
            ),
        ),
        (
            "TTL 1 (the stack answers)",
            inner_frame(UNDERLAY_MAC, sender, 1, tcp),
        ),
        (
            "longer than 512 bytes of TCP",
            inner_frame(UNDERLAY_MAC, sender, 64, big),
        ),
        (
            // A flow's longer segments go up: its data keeps one path, in order.
            "TCP carrying data, however little",
            inner_frame(
                UNDERLAY_MAC,
                sender,
                64,
                "TCP(sport=40000, dport=8080, flags='PA', seq=1, ack=7)/Raw(b'x')",
            ),
        ),
        (
            "ICMP",
            inner_frame(UNDERLAY_MAC, sender, 64, "ICMP(type=8, id=1, seq=1)"),
        ),
    ];
    for (name, frame) in &up {
        let out = bed
            .fixture
            .run_xdp(PROG_UNDERLAY, &geneve(json!({}), frame), 1)
            .expect("xdp run");
        assert_eq!(out.action, XDP_PASS, "{name}");
        assert_eq!(hex(&out.output), hex(frame), "{name}: unchanged");
    }

    // A pod under access control: its ingress policy judges the frame here, as `tc_to_pod`
    // would. Isolated for egress only: allowed and tracked, then known as tracked.
    police_local_pod(
        &mut bed,
        AclEndpoint {
            egress: 7,
            ..AclEndpoint::default()
        },
    );
    let frame = inner_frame(UNDERLAY_MAC, sender, 64, tcp);
    for class in [PacketClass::PolicyAllowed, PacketClass::PolicyTracked] {
        let out = bed
            .fixture
            .run_xdp(PROG_UNDERLAY, &geneve(json!({}), &frame), 1)
            .expect("xdp run");
        assert_eq!(out.action, XDP_REDIRECT, "{class:?}");
        let counters = bed.fixture.counters();
        assert_eq!(counters.packets(Hook::Underlay, class), 1, "{class:?}");
    }
    // A DNS answer to it: tc copies it for the agent first.
    let dns = inner_frame(
        UNDERLAY_MAC,
        sender,
        64,
        "UDP(sport=53, dport=40000)/Raw(b'abc')",
    );
    let out = bed
        .fixture
        .run_xdp(PROG_UNDERLAY, &geneve(json!({}), &dns), 1)
        .expect("xdp run");
    assert_eq!(out.action, XDP_PASS, "a DNS answer");
    assert_eq!(hex(&out.output), hex(&dns));
    // Isolated for ingress, no rule allowing: dropped here with the reason tc would give.
    police_local_pod(
        &mut bed,
        AclEndpoint {
            ingress: 9,
            ..AclEndpoint::default()
        },
    );
    let other_flow = inner_frame(
        UNDERLAY_MAC,
        sender,
        64,
        "TCP(sport=40001, dport=8080, flags='S', seq=1)",
    );
    let out = bed
        .fixture
        .run_xdp(PROG_UNDERLAY, &geneve(json!({}), &other_flow), 1)
        .expect("xdp run");
    assert_eq!(out.action, XDP_DROP, "denied");
    assert_eq!(
        bed.fixture
            .counters()
            .drops(DropReason::PolicyDeniedIngress),
        1
    );
}

/// A scapy-built IPv6 frame from a pod of node b to the local pod the test frames come from
/// (fd00:102a:0:1::2, behind the test runs' device), with `hlim` and `transport`.
fn inner_frame_v6(dst_mac: [u8; 6], src_mac: [u8; 6], hlim: u8, transport: &str) -> Vec<u8> {
    scapy_frame(
        dst_mac,
        src_mac,
        &format!("IPv6(src='fd00:102a:0:2::5', dst='fd00:102a:0:1::2', hlim={hlim})/{transport}"),
    )
}

#[test]
fn what_xdp_passes_up_for_a_local_pod_tc_hands_straight_to_it() {
    if !privileged("what_xdp_passes_up_for_a_local_pod_tc_hands_straight_to_it") {
        return;
    }
    let sender = [0x0a, 0x58, 10, 244, 2, 5];
    // What XDP leaves to the stack (a segment carrying data, as GRO merges them), decapsulated
    // and addressed to this node: into the pod at once, addressed as its gateway would, the
    // TTL one lower as forwarding would (scapy's header checksum for TTL 63), nothing else
    // changed; tc_to_pod's judgement made here.
    let data = "TCP(sport=40000, dport=8080, flags='PA', seq=1, ack=7)/Raw(b'x' * 600)";
    let mut bed = dataplane_tests::overlay_bed::bed().expect("overlay bed");
    let cases = [
        (
            "IPv4",
            inner_frame(UNDERLAY_MAC, sender, 64, data),
            inner_frame(LOCAL_POD_MAC, LOCAL_HOST_MAC, 63, data),
        ),
        (
            "IPv6",
            inner_frame_v6(UNDERLAY_MAC, sender, 64, data),
            inner_frame_v6(packets::POD_MAC, packets::GW_MAC, 63, data),
        ),
    ];
    for (name, frame, expected) in &cases {
        let out = bed
            .fixture
            .run_tc(PROG_UNDERLAY_TC, frame, 1)
            .expect("tc run");
        assert_eq!(out.action, TC_ACT_REDIRECT, "{name}");
        assert_eq!(
            hex(&out.output),
            hex(expected),
            "{name}: the frame the pod gets"
        );
    }
    let counters = bed.fixture.counters();
    assert_eq!(
        counters.packets(Hook::UnderlayTc, PacketClass::LocalRedirect),
        2
    );

    // What the stack does more than route stays the stack's: unchanged, passed on.
    let mut oversize = oversize_v4(1401, true);
    oversize[..6].copy_from_slice(&UNDERLAY_MAC);
    oversize[packets::L3 + 16..packets::L3 + 20].copy_from_slice(&[10, 244, 1, 3]);
    packets::fix_ipv4_checksum(&mut oversize, packets::L3);
    let up: Vec<(&str, Vec<u8>)> = vec![
        (
            "TTL 1 (the stack answers)",
            inner_frame(UNDERLAY_MAC, sender, 1, data),
        ),
        (
            "a first fragment (the stack may reassemble)",
            scapy_frame(
                UNDERLAY_MAC,
                sender,
                "IP(src='10.244.2.5', dst='10.244.1.3', flags='MF', id=9)/UDP(sport=40000, dport=5353)/Raw(b'x' * 64)",
            ),
        ),
        ("a single packet over the pod's MTU", oversize),
        (
            "no pod of this node",
            scapy_frame(
                UNDERLAY_MAC,
                sender,
                "IP(src='10.244.2.5', dst='10.244.1.99')/TCP(sport=40000, dport=8080, flags='PA')/Raw(b'x')",
            ),
        ),
    ];
    for (name, frame) in &up {
        let out = bed
            .fixture
            .run_tc(PROG_UNDERLAY_TC, frame, 1)
            .expect("tc run");
        assert_eq!(out.action, TC_ACT_OK, "{name}");
        assert_eq!(hex(&out.output), hex(frame), "{name}: unchanged");
    }
    assert_eq!(
        bed.fixture
            .counters()
            .packets(Hook::UnderlayTc, PacketClass::LocalRedirect),
        2,
        "none of them handed over"
    );

    // The pod isolated for ingress, no rule allowing: dropped here, with the reason
    // `tc_to_pod` would give.
    police_local_pod(
        &mut bed,
        AclEndpoint {
            ingress: 9,
            ..AclEndpoint::default()
        },
    );
    let out = bed
        .fixture
        .run_tc(PROG_UNDERLAY_TC, &cases[0].1, 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_SHOT, "denied");
    let counters = bed.fixture.counters();
    assert_eq!(counters.drops(DropReason::PolicyDeniedIngress), 1);
    assert_eq!(
        counters.packets(Hook::UnderlayTc, PacketClass::LocalRedirect),
        2
    );
}

#[test]
fn decapsulation_follows_rfc_8926() {
    if !privileged("decapsulation_follows_rfc_8926") {
        return;
    }
    let inner = packets::with_ipv4_destination(&packets::ipv4_tcp(), [10, 244, 1, 3]);
    let not_local = packets::with_ipv4_destination(&packets::ipv4_tcp(), [10, 244, 1, 99]);
    let option =
        |class: u16, kind: u8, data: &str| json!({"class": class, "type": kind, "data": data});
    let delivered: Vec<(&str, Vec<u8>)> = vec![
        ("no options", geneve(json!({}), &inner)),
        (
            "one non-critical option",
            geneve(
                json!({"options": [option(0x0102, 0x01, "01020304")]}),
                &inner,
            ),
        ),
        (
            "two non-critical options",
            geneve(
                json!({"options": [option(0x0102, 0x01, "0102030405060708"), option(0xffff, 0x7f, "")]}),
                &inner,
            ),
        ),
        (
            "ipv6 underlay",
            geneve(json!({"src_ip": "fd99::3", "dst_ip": "fd99::1"}), &inner),
        ),
    ];
    for (name, packet) in delivered {
        let mut bed = dataplane_tests::overlay_bed::bed().expect("overlay bed");
        let out = bed
            .fixture
            .run_xdp(PROG_UNDERLAY, &packet, 1)
            .expect("xdp run");
        assert_eq!(out.action, XDP_PASS, "{name}");
        let mut expected = inner.clone();
        expected[..6].copy_from_slice(&UNDERLAY_MAC);
        assert_eq!(
            hex(&out.output),
            hex(&expected),
            "{name}: the inner frame, addressed to this node"
        );
        assert_eq!(
            bed.fixture
                .counters()
                .packets(Hook::Underlay, PacketClass::GeneveDecap),
            1,
            "{name}"
        );
    }

    let refused: Vec<(&str, Vec<u8>, DropReason)> = vec![
        (
            "version 1",
            geneve(json!({"version": 1}), &inner),
            DropReason::GeneveBadVersion,
        ),
        (
            "O bit (control)",
            geneve(json!({"oam": 1}), &inner),
            DropReason::GeneveControl,
        ),
        (
            "unknown critical option, C set",
            geneve(
                json!({"critical": 1, "options": [option(0x0102, 0x81, "01020304")]}),
                &inner,
            ),
            DropReason::GeneveCriticalOption,
        ),
        (
            "unknown critical option, C clear",
            geneve(
                json!({"options": [option(0x0102, 0x81, "01020304")]}),
                &inner,
            ),
            DropReason::GeneveCriticalOption,
        ),
        (
            "options longer than the packet",
            geneve(
                json!({"options": [option(0x0102, 0x01, "01020304")], "claim_extra_option_words": 40}),
                &inner,
            ),
            DropReason::GeneveOptionsTruncated,
        ),
        (
            "not Ethernet inside",
            geneve(json!({"proto": 0x0800}), &inner),
            DropReason::GeneveBadProtocol,
        ),
        (
            "from a non-node",
            geneve(json!({"src_ip": "10.99.0.77"}), &inner),
            DropReason::GeneveUnknownNode,
        ),
        (
            "for a pod not on this node",
            geneve(json!({}), &not_local),
            DropReason::GeneveNoLocalPod,
        ),
        (
            "VNI 0, not the default network's",
            geneve(json!({"vni": 0}), &inner),
            DropReason::GeneveUnknownVni,
        ),
        (
            "VNI 0xC012E, not the default network's",
            geneve(json!({"vni": 0xC012E}), &inner),
            DropReason::GeneveUnknownVni,
        ),
        (
            "in a VLAN the underlay does not carry the overlay in",
            geneve(json!({"vlan": 7}), &inner),
            DropReason::GeneveWrongVlan,
        ),
    ];
    for (name, packet, reason) in refused {
        let mut bed = dataplane_tests::overlay_bed::bed().expect("overlay bed");
        let out = bed
            .fixture
            .run_xdp(PROG_UNDERLAY, &packet, 1)
            .expect("xdp run");
        assert_eq!(out.action, XDP_DROP, "{name}");
        let counters = bed.fixture.counters();
        assert_eq!(
            counters.drops(reason),
            1,
            "{name}: {reason:?}, got {:?}",
            counters.drops
        );
        assert_eq!(
            counters.packets(Hook::Underlay, PacketClass::GeneveDecap),
            0,
            "{name}"
        );
    }

    let untouched: Vec<(&str, Vec<u8>)> = vec![
        ("another UDP port", geneve(json!({"dport": 6082}), &inner)),
        (
            "for another address",
            geneve(json!({"dst_ip": "10.99.0.9"}), &inner),
        ),
    ];
    for (name, packet) in untouched {
        let mut bed = dataplane_tests::overlay_bed::bed().expect("overlay bed");
        let out = bed
            .fixture
            .run_xdp(PROG_UNDERLAY, &packet, 1)
            .expect("xdp run");
        assert_eq!(out.action, XDP_PASS, "{name}");
        assert_eq!(out.output, packet, "{name}: passed to the stack unchanged");
    }
}

/// An untagged IPv4 UDP frame of `ip_len` bytes at L3 to node b's pod CIDR, DF as given.
fn oversize_v4(ip_len: usize, dont_fragment: bool) -> Vec<u8> {
    let small = packets::ipv4_udp();
    let header_len = small.len() - packets::PAYLOAD.len();
    let mut frame = small[..header_len].to_vec();
    frame.resize(packets::L3 + ip_len, 0xab);
    let l3 = packets::L3;
    frame[l3 + 2..l3 + 4].copy_from_slice(&(ip_len as u16).to_be_bytes());
    frame[l3 + 6] = if dont_fragment { 0x40 } else { 0 };
    let udp_len = (ip_len - 20) as u16;
    frame[l3 + 24..l3 + 26].copy_from_slice(&udp_len.to_be_bytes());
    packets::fix_ipv4_checksum(&mut frame, l3);
    frame
}

#[test]
fn packets_over_the_pod_mtu_are_answered_with_icmp() {
    if !privileged("packets_over_the_pod_mtu_are_answered_with_icmp") {
        return;
    }
    // IPv4 with DF: fragmentation needed, next-hop MTU 1400, back to the pod.
    let mut bed = dataplane_tests::overlay_bed::bed().expect("overlay bed");
    let frame = oversize_v4(1401, true);
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &frame, 1)
        .expect("tc run");
    assert_eq!(
        out.action,
        TC_ACT_REDIRECT,
        "{:?}",
        bed.fixture.counters().drops
    );
    let answer =
        scapy::call(&json!({"op": "icmp_error", "hex": hex(&out.output)})).expect("decode");
    assert_eq!(
        answer["dst_mac"],
        packets::mac_text(&packets::POD_MAC),
        "to the pod"
    );
    assert_eq!(
        answer["src_mac"],
        packets::mac_text(&packets::GW_MAC),
        "from its gateway"
    );
    assert_eq!(answer["src_ip"], "10.99.0.1");
    assert_eq!(answer["dst_ip"], "10.244.1.2");
    assert_eq!(
        (answer["type"].as_u64(), answer["code"].as_u64()),
        (Some(3), Some(4))
    );
    assert_eq!(answer["mtu"], 1400);
    assert_eq!(answer["ip_chksum_ok"], true);
    assert_eq!(answer["icmp_chksum_ok"], true);
    assert_eq!(
        answer["quote"],
        hex(&frame[packets::L3..packets::L3 + 28]),
        "IP header + 8 bytes"
    );
    assert_eq!(out.output.len(), 14 + 20 + 8 + 28);
    assert_eq!(
        bed.fixture
            .counters()
            .packets(Hook::FromPod, PacketClass::TooBigAnswered),
        1
    );

    // Exactly the MTU still goes through.
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &oversize_v4(1400, true), 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(out.output.len(), 14 + 1400 + 50, "encapsulated");

    // IPv4 without DF cannot be fragmented here: dropped with its reason.
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &oversize_v4(1401, false), 1)
        .expect("tc run");
    assert_eq!(out.action, 2, "TC_ACT_SHOT");
    assert_eq!(
        bed.fixture.counters().drops(DropReason::OverlayMtuExceeded),
        1
    );

    // IPv6: packet too big, MTU 1400, from the node's IPv6 address.
    let small = packets::ipv6_udp();
    let mut frame = small[..small.len() - packets::PAYLOAD.len()].to_vec();
    frame.resize(packets::L3 + 1450, 0xcd);
    let payload_len = (1450 - 40) as u16;
    frame[packets::L3 + 4..packets::L3 + 6].copy_from_slice(&payload_len.to_be_bytes());
    frame[packets::L3 + 44..packets::L3 + 46].copy_from_slice(&payload_len.to_be_bytes());
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &frame, 1)
        .expect("tc run");
    assert_eq!(
        out.action,
        TC_ACT_REDIRECT,
        "{:?}",
        bed.fixture.counters().drops
    );
    let answer =
        scapy::call(&json!({"op": "icmp_error", "hex": hex(&out.output)})).expect("decode");
    assert_eq!(answer["src_ip"], "fd99::1");
    assert_eq!(answer["dst_ip"], "fd00:102a:0:1::2");
    assert_eq!(
        (answer["type"].as_u64(), answer["code"].as_u64()),
        (Some(2), Some(0))
    );
    assert_eq!(answer["mtu"], 1400);
    assert_eq!(answer["icmp_chksum_ok"], true);
    assert_eq!(answer["quote"], hex(&frame[packets::L3..packets::L3 + 64]));
}

/// `--max-nodes` sizes the nodes' maps: a cluster with more nodes is refused before anything
/// is written, naming the map and the flag, and the maps keep the last good nodes.
#[test]
fn more_nodes_than_the_maps_hold_are_refused_naming_the_map_and_flag_writing_nothing() {
    use aya::maps::{LpmTrie, MapData};
    use dataplane_common::{maps, overlay::TunnelEndpoint};
    use dataplane_tests::fixture::Fixture;
    use dataplane_user::{
        api::network::OvnKubernetesConfig,
        kernel::capacity::Capacities,
        model::{NodeView, OverlayView, Underlay},
        overlay,
    };

    if !privileged(
        "more_nodes_than_the_maps_hold_are_refused_naming_the_map_and_flag_writing_nothing",
    ) {
        return;
    }
    let capacities = Capacities {
        nodes: 4,
        ..Capacities::default()
    };
    let mut fixture = Fixture::load_with(&capacities).expect("programs load");
    assert_eq!(fixture.capacities().nodes, 4);
    // This node and `count - 1` others, one /24 each.
    let view = |count: u8| OverlayView {
        this_node: "n0".into(),
        nodes: std::sync::Arc::new(
            (0..count)
                .map(|i| NodeView {
                    created: i64::MAX,
                    name: format!("n{i}"),
                    addresses: vec![format!("10.99.0.{}", i + 1).parse().expect("address")],
                    pod_cidrs: vec![format!("10.244.{i}.0/24").parse().expect("CIDR")],
                })
                .map(std::sync::Arc::new)
                .collect::<Vec<_>>()
                .into(),
        ),
        local_pods: Vec::new(),
        unrestricted_ifindexes: Vec::new(),
        underlay: Underlay {
            ifindex: 1,
            mac: UNDERLAY_MAC,
            xdp_forward: false,
            nodeport_listed: false,
            mtu: 1500,
        },
        settings: OvnKubernetesConfig::default()
            .validate(1500)
            .expect("settings"),
        hybrid: None,
    };
    let remote_subnets = |fixture: &mut Fixture| {
        let map: LpmTrie<&mut MapData, [u8; 4], TunnelEndpoint> =
            fixture.typed_map(maps::REMOTE_PODS_V4).expect("map");
        map.keys().filter_map(Result::ok).count()
    };
    fixture
        .sync_overlay(&overlay::compile(&view(5)).expect("compile"), None)
        .expect("four other nodes fit");
    assert_eq!(remote_subnets(&mut fixture), 4);
    let error = fixture
        .sync_overlay(&overlay::compile(&view(6)).expect("compile"), None)
        .expect_err("five other nodes do not")
        .to_string();
    assert!(
        error.starts_with(
            "nodes' IPv4 pod subnets: 5 needed, more than the 4 map DP_OVL_REMOTE4 holds; raise --max-nodes"
        ),
        "{error}"
    );
    assert_eq!(remote_subnets(&mut fixture), 4, "nothing written");
}

#[test]
fn a_sync_against_the_last_written_maps_writes_only_the_change() {
    use aya::maps::{LpmTrie, MapData};
    use dataplane_common::{maps, overlay::TunnelEndpoint};
    use dataplane_tests::fixture::Fixture;
    use dataplane_user::{
        api::network::OvnKubernetesConfig,
        model::{NodeView, OverlayView, Underlay},
        overlay,
    };

    if !privileged("a_sync_against_the_last_written_maps_writes_only_the_change") {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    // This node and `count - 1` others; node `moved` has another address.
    let view = |count: u8, moved: Option<u8>| OverlayView {
        this_node: "n0".into(),
        nodes: std::sync::Arc::new(
            (0..count)
                .map(|i| NodeView {
                    created: i64::MAX,
                    name: format!("n{i}"),
                    addresses: vec![
                        format!("10.99.{}.{}", u8::from(moved == Some(i)), i + 1)
                            .parse()
                            .expect("address"),
                    ],
                    pod_cidrs: vec![format!("10.244.{i}.0/24").parse().expect("CIDR")],
                })
                .map(std::sync::Arc::new)
                .collect::<Vec<_>>()
                .into(),
        ),
        local_pods: Vec::new(),
        unrestricted_ifindexes: Vec::new(),
        underlay: Underlay {
            ifindex: 1,
            mac: UNDERLAY_MAC,
            xdp_forward: false,
            nodeport_listed: false,
            mtu: 1500,
        },
        settings: OvnKubernetesConfig::default()
            .validate(1500)
            .expect("settings"),
        hybrid: None,
    };
    let remote_subnets = |fixture: &mut Fixture| {
        let map: LpmTrie<&mut MapData, [u8; 4], TunnelEndpoint> =
            fixture.typed_map(maps::REMOTE_PODS_V4).expect("map");
        map.iter()
            .filter_map(Result::ok)
            .map(|(key, endpoint)| (key.data(), endpoint))
            .collect::<Vec<_>>()
    };
    let first = overlay::compile(&view(50, None)).expect("compile");
    let stats = fixture.sync_overlay(&first, None).expect("sync");
    // 49 remote subnets, 50 node addresses, the config, and every word of the bitmap of
    // destinations outside the pod networks (a new map's are all clear).
    assert_eq!(
        stats.written,
        100 + dataplane_common::overlay::OUTSIDE_WORDS as usize
    );
    // Node 7 moves (its new address and its subnet's endpoint written, its old address
    // deleted) and node 49 leaves (its subnet and address deleted); the config is written
    // too, its epoch moved on (the kernel's per-CPU copies of node lookups are stale).
    let second = overlay::compile(&view(49, Some(7))).expect("compile");
    let stats = fixture.sync_overlay(&second, Some(&first)).expect("sync");
    assert_eq!((stats.written, stats.deleted), (3, 3));
    let incremental = remote_subnets(&mut fixture);
    assert_eq!(incremental.len(), 48);
    // The kernel holds what a comparison with its own entries finds nothing to change in.
    let stats = fixture.sync_overlay(&second, None).expect("sync");
    assert_eq!((stats.written, stats.deleted), (0, 0));
    assert_eq!(remote_subnets(&mut fixture), incremental);
}

/// The per-CPU copies of node and pod lookups (`DP_OVL_NODE_CACHE`, `DP_OVL_POD_CACHE`) that
/// decapsulation reads first: filled by a frame's lookups, and never answering after the agent
/// changed the nodes or pods (the epoch moves on): a removed node's Geneve is refused, a frame
/// for a removed pod is dropped, as with no copy at all.
#[test]
fn cached_node_and_pod_lookups_follow_the_agents_changes() {
    if !privileged("cached_node_and_pod_lookups_follow_the_agents_changes") {
        return;
    }
    use dataplane_common::overlay::{AddrCacheEntry, addr_cache_slot};
    use dataplane_user::{mapsync::addr16, overlay::compile};
    // The copies are per CPU: every test run on one CPU.
    dataplane_tests::fixture::pin_to_one_cpu();
    let mut bed = dataplane_tests::overlay_bed::bed().expect("overlay bed");
    let inner = packets::with_ipv4_destination(&packets::ipv4_tcp(), [10, 244, 1, 3]);
    let packet = geneve(json!({}), &inner);
    let copy_of = |bed: &dataplane_tests::overlay_bed::Bed, map: &'static str, addr: &str| {
        let cache: aya::maps::PerCpuArray<&MapData, AddrCacheEntry> =
            aya::maps::PerCpuArray::try_from(bed.fixture.map(map).expect("map")).expect("cache");
        let addr = addr16(addr.parse().expect("address"));
        // SAFETY: sched_getcpu has no preconditions; this thread is pinned to that CPU.
        let cpu = unsafe { libc::sched_getcpu() } as usize;
        cache.get(&addr_cache_slot(&addr), 0).expect("slot")[cpu]
    };
    for _ in 0..2 {
        let out = bed
            .fixture
            .run_xdp(PROG_UNDERLAY, &packet, 1)
            .expect("xdp run");
        assert_eq!(out.action, XDP_PASS);
    }
    let epoch = bed.fixture.pods_epoch().expect("epoch");
    let node = copy_of(&bed, maps::NODE_ADDR_CACHE, "10.99.0.2");
    assert_eq!(node.addr, addr16("10.99.0.2".parse().expect("address")));
    assert_eq!(node.epoch_plus_one, epoch.wrapping_add(1));
    let pod = copy_of(&bed, maps::LOCAL_POD_CACHE, "10.244.1.3");
    assert_eq!(pod.addr, addr16("10.244.1.3".parse().expect("address")));
    assert_eq!(pod.epoch_plus_one, epoch.wrapping_add(1));
    assert_eq!(pod.pod.ifindex, bed.view.local_pods[0].host_ifindex);
    assert_eq!(pod.pod.pod_mac, LOCAL_POD_MAC);
    assert_eq!(pod.pod.host_mac, LOCAL_HOST_MAC);

    // Node b leaves the cluster: its Geneve is refused at once.
    let all_nodes = bed.view.nodes.clone();
    let without_b: Vec<_> = all_nodes
        .iter()
        .filter(|n| n.name != "b")
        .cloned()
        .collect();
    bed.view.nodes = std::sync::Arc::new(without_b.into());
    let maps = compile(&bed.view).expect("compile");
    bed.fixture.sync_overlay(&maps, None).expect("sync");
    assert_eq!(
        bed.fixture.pods_epoch().expect("epoch"),
        epoch.wrapping_add(1)
    );
    let out = bed
        .fixture
        .run_xdp(PROG_UNDERLAY, &packet, 1)
        .expect("xdp run");
    assert_eq!(out.action, XDP_DROP);
    assert_eq!(
        bed.fixture.counters().drops(DropReason::GeneveUnknownNode),
        1
    );

    // Node b is back and the pod is gone: its frames are dropped at once.
    bed.view.nodes = all_nodes;
    bed.view.local_pods.retain(|p| p.name != "default/local");
    let maps = compile(&bed.view).expect("compile");
    bed.fixture.sync_overlay(&maps, None).expect("sync");
    let out = bed
        .fixture
        .run_xdp(PROG_UNDERLAY, &packet, 1)
        .expect("xdp run");
    assert_eq!(out.action, XDP_DROP);
    assert_eq!(
        bed.fixture.counters().drops(DropReason::GeneveNoLocalPod),
        1
    );
}
