//! Egress IP packet tests through the real programs (BPF_PROG_TEST_RUN) on the overlay bed:
//! the frames and the expected outputs are built by scapy, checksums included, so every
//! rewritten byte is checked against an independent implementation.

use dataplane_common::{
    DropReason, Hook, PacketClass,
    maps::{PROG_FROM_POD, PROG_UNDERLAY, PROG_UNDERLAY_TC},
};
use dataplane_tests::{
    egress_bed::{Holder, egress_maps},
    overlay_bed::{self, Bed, UNDERLAY_MAC},
    packets::{self, GW_MAC, POD_MAC},
    privileged::privileged,
    scapy::{self, bytes_of, hex},
};
use serde_json::json;

const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

fn build(expr: &str) -> Vec<u8> {
    bytes_of(&scapy::call(&json!({"op": "build", "expr": expr})).expect("scapy build"))
}

fn mac(bytes: &[u8; 6]) -> String {
    packets::mac_text(bytes)
}

/// A TCP segment from the test pod to 192.0.2.1:80, as scapy builds it.
fn pod_to_outside(flags: &str) -> Vec<u8> {
    build(&format!(
        "Ether(src='{}', dst='{}')/IP(src='10.244.1.2', dst='192.0.2.1', ttl=64, id=1)/\
         TCP(sport=40000, dport=80, flags='{flags}', seq=1, window=64240)/Raw(b'egress')",
        mac(&POD_MAC),
        mac(&GW_MAC)
    ))
}

fn bed_with(holder: Holder) -> Bed {
    let mut bed = overlay_bed::bed().expect("overlay bed");
    let maps = egress_maps(&bed.view, holder);
    bed.fixture.sync_egress(&maps).expect("egress maps");
    bed
}

#[test]
fn the_holder_translates_the_source_and_sends_the_replies_back_to_the_pod() {
    if !privileged("the_holder_translates_the_source_and_sends_the_replies_back_to_the_pod") {
        return;
    }
    let mut bed = bed_with(Holder::Here);
    let syn = pod_to_outside("S");
    let out = bed.fixture.run_tc(PROG_FROM_POD, &syn, 1).expect("tc run");
    assert_eq!(
        out.action,
        TC_ACT_REDIRECT,
        "{:?}",
        bed.fixture.counters().drops
    );
    // Only the source address changes (the pod's own port is free on the egress address);
    // the MACs are the neighbour lookup's to write, after the program.
    let expected = build(&format!(
        "Ether(src='{}', dst='{}')/IP(src='10.99.0.50', dst='192.0.2.1', ttl=64, id=1)/\
         TCP(sport=40000, dport=80, flags='S', seq=1, window=64240)/Raw(b'egress')",
        mac(&POD_MAC),
        mac(&GW_MAC)
    ));
    assert_eq!(hex(&out.output), hex(&expected));
    // A later packet of the flow: the same translation.
    let ack = pod_to_outside("A");
    let out = bed.fixture.run_tc(PROG_FROM_POD, &ack, 1).expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(&out.output[26..30], &[10, 99, 0, 50]);
    assert_eq!(&out.output[34..36], &40000u16.to_be_bytes());
    let counters = bed.fixture.counters();
    assert_eq!(counters.packets(Hook::FromPod, PacketClass::EgressSnat), 2);

    // The answer, as it arrives on the underlay: translated back and delivered to the pod.
    let answer = build(&format!(
        "Ether(src='02:00:00:00:99:02', dst='{}')/IP(src='192.0.2.1', dst='10.99.0.50', ttl=63, id=2)/\
         TCP(sport=80, dport=40000, flags='SA', seq=9, ack=2, window=64240)/Raw(b'answer')",
        mac(&UNDERLAY_MAC)
    ));
    let out = bed
        .fixture
        .run_tc(PROG_UNDERLAY_TC, &answer, 1)
        .expect("tc run");
    assert_eq!(
        out.action,
        TC_ACT_REDIRECT,
        "{:?}",
        bed.fixture.counters().drops
    );
    let delivered = build(&format!(
        "Ether(src='{}', dst='{}')/IP(src='192.0.2.1', dst='10.244.1.2', ttl=63, id=2)/\
         TCP(sport=80, dport=40000, flags='SA', seq=9, ack=2, window=64240)/Raw(b'answer')",
        mac(&GW_MAC),
        mac(&POD_MAC)
    ));
    assert_eq!(
        hex(&out.output[14..]),
        hex(&delivered[14..]),
        "the IP packet"
    );
    assert_eq!(&out.output[..6], &POD_MAC, "to the pod's MAC");
    let counters = bed.fixture.counters();
    assert_eq!(
        counters.packets(Hook::UnderlayTc, PacketClass::EgressReverseNat),
        1
    );

    // Nothing else reaches anything on the egress address: a connection to its port 22.
    let ssh = build(&format!(
        "Ether(src='02:00:00:00:99:02', dst='{}')/IP(src='192.0.2.1', dst='10.99.0.50')/TCP(sport=5555, dport=22, flags='S')",
        mac(&UNDERLAY_MAC)
    ));
    let out = bed
        .fixture
        .run_tc(PROG_UNDERLAY_TC, &ssh, 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_SHOT);
    assert_eq!(bed.fixture.counters().drops(DropReason::EgressIpNoFlow), 1);
}

#[test]
fn the_holder_answers_arp_for_the_egress_ip_and_nothing_else() {
    if !privileged("the_holder_answers_arp_for_the_egress_ip_and_nothing_else") {
        return;
    }
    let mut bed = bed_with(Holder::Here);
    let request = |ip: &str| {
        build(&format!(
            "Ether(src='02:00:00:00:99:64', dst='ff:ff:ff:ff:ff:ff')/\
             ARP(op=1, hwsrc='02:00:00:00:99:64', psrc='10.99.0.100', pdst='{ip}')"
        ))
    };
    let out = bed
        .fixture
        .run_xdp(PROG_UNDERLAY, &request("10.99.0.50"), 1)
        .expect("xdp run");
    assert_eq!(out.action, XDP_TX);
    let reply = build(&format!(
        "Ether(src='{0}', dst='02:00:00:00:99:64')/\
         ARP(op=2, hwsrc='{0}', psrc='10.99.0.50', hwdst='02:00:00:00:99:64', pdst='10.99.0.100')",
        mac(&UNDERLAY_MAC)
    ));
    assert_eq!(hex(&out.output[..42]), hex(&reply[..42]));
    let out = bed
        .fixture
        .run_xdp(PROG_UNDERLAY, &request("10.99.0.51"), 1)
        .expect("xdp run");
    assert_eq!(out.action, XDP_PASS, "another address is the stack's");
    // Node b does not hold it: node a does not answer.
    let mut elsewhere = bed_with(Holder::NodeB);
    let out = elsewhere
        .fixture
        .run_xdp(PROG_UNDERLAY, &request("10.99.0.50"), 1)
        .expect("xdp run");
    assert_eq!(out.action, XDP_PASS);
}

#[test]
fn the_holder_answers_neighbour_solicitations_for_the_egress_ip() {
    if !privileged("the_holder_answers_neighbour_solicitations_for_the_egress_ip") {
        return;
    }
    let mut bed = bed_with(Holder::Here);
    let solicitor = "02:00:00:00:99:64";
    let underlay = mac(&UNDERLAY_MAC);
    let cases = [
        (
            "with the source link-layer option",
            format!(
                "Ether(src='{solicitor}', dst='33:33:ff:00:00:50')/IPv6(src='fd99::64', dst='ff02::1:ff00:50', hlim=255)/\
                 ICMPv6ND_NS(tgt='fd99::50')/ICMPv6NDOptSrcLLAddr(lladdr='{solicitor}')"
            ),
            format!(
                "Ether(src='{underlay}', dst='{solicitor}')/IPv6(src='fd99::50', dst='fd99::64', hlim=255)/\
                 ICMPv6ND_NA(tgt='fd99::50', R=0, S=1, O=1)/ICMPv6NDOptDstLLAddr(lladdr='{underlay}')"
            ),
        ),
        (
            "duplicate address detection, no option",
            format!(
                "Ether(src='{solicitor}', dst='33:33:ff:00:00:50')/IPv6(src='::', dst='ff02::1:ff00:50', hlim=255)/\
                 ICMPv6ND_NS(tgt='fd99::50')"
            ),
            format!(
                "Ether(src='{underlay}', dst='33:33:00:00:00:01')/IPv6(src='fd99::50', dst='ff02::1', hlim=255)/\
                 ICMPv6ND_NA(tgt='fd99::50', R=0, S=0, O=1)/ICMPv6NDOptDstLLAddr(lladdr='{underlay}')"
            ),
        ),
    ];
    for (name, request, answer) in cases {
        let out = bed
            .fixture
            .run_xdp(PROG_UNDERLAY, &build(&request), 1)
            .expect("xdp run");
        assert_eq!(out.action, XDP_TX, "{name}");
        assert_eq!(hex(&out.output), hex(&build(&answer)), "{name}");
    }
    // Another address, or a hop limit that says it was routed: the stack's.
    for request in [
        "Ether(src='02:00:00:00:99:64', dst='33:33:ff:00:00:51')/IPv6(src='fd99::64', dst='ff02::1:ff00:51', hlim=255)/ICMPv6ND_NS(tgt='fd99::51')",
        "Ether(src='02:00:00:00:99:64', dst='33:33:ff:00:00:50')/IPv6(src='fd99::64', dst='ff02::1:ff00:50', hlim=64)/ICMPv6ND_NS(tgt='fd99::50')",
    ] {
        let out = bed
            .fixture
            .run_xdp(PROG_UNDERLAY, &build(request), 1)
            .expect("xdp run");
        assert_eq!(out.action, XDP_PASS, "{request}");
    }
}

#[test]
fn a_remote_holder_gets_the_packet_through_geneve_unchanged() {
    if !privileged("a_remote_holder_gets_the_packet_through_geneve_unchanged") {
        return;
    }
    let mut bed = bed_with(Holder::NodeB);
    let syn = pod_to_outside("S");
    let out = bed.fixture.run_tc(PROG_FROM_POD, &syn, 1).expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT);
    let decoded = scapy::call(&json!({"op": "decode", "hex": hex(&out.output)})).expect("decode");
    assert_eq!(decoded["dst_ip"], "10.99.0.2", "{decoded}");
    assert_eq!(decoded["src_ip"], "10.99.0.1", "{decoded}");
    assert_eq!(decoded["vni"], 1);
    assert_eq!(
        decoded["inner"],
        hex(&syn),
        "the inner packet as the pod sent it"
    );
    assert_eq!(
        bed.fixture
            .counters()
            .packets(Hook::FromPod, PacketClass::EgressRerouted),
        1
    );
}

#[test]
fn until_a_node_holds_the_address_the_selected_pods_traffic_out_is_dropped() {
    if !privileged("until_a_node_holds_the_address_the_selected_pods_traffic_out_is_dropped") {
        return;
    }
    let mut bed = bed_with(Holder::Nobody);
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &pod_to_outside("S"), 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_SHOT);
    assert_eq!(
        bed.fixture.counters().drops(DropReason::EgressIpUnassigned),
        1
    );
    // Inside the cluster it is not egress: pod to pod still goes through the overlay.
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &packets::ipv4_tcp(), 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT);
    assert_eq!(out.output.len(), packets::ipv4_tcp().len() + 50);
}
