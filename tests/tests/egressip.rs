//! Egress IP packet tests through the real programs (BPF_PROG_TEST_RUN) on the overlay bed:
//! the frames and the expected outputs are built by scapy, checksums included, so every
//! rewritten byte is checked against an independent implementation.

use std::net::IpAddr;

use dataplane_common::{
    DropReason, Hook, PacketClass,
    egressip::{EGRESS_CT_IN, EgressCtValue},
    lb::CtKey,
    maps::{EGRESS_CT, PROG_FROM_POD, PROG_UNDERLAY, PROG_UNDERLAY_TC},
};
use dataplane_tests::{
    egress_bed::{EGRESS_IP, EGRESS_IP6, Holder, egress_maps},
    overlay_bed::{self, Bed, UNDERLAY_MAC},
    packets::{self, GW_MAC, POD_MAC},
    privileged::privileged,
    scapy::{self, bytes_of, hex},
};
use dataplane_user::mapsync::addr16;
use serde_json::json;

const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_UDP: u8 = 17;

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
    bed.fixture.sync_egress(&maps, None).expect("egress maps");
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

/// Where the underlay drops what XDP sends back out (a veth whose peer does not poll: kind's
/// and k3d's nodes), XDP leaves ARP and neighbour solicitations to tc, which answers them the
/// same, byte for byte, out of the device again by redirect.
#[test]
fn without_xdp_transmit_tc_answers_arp_and_neighbour_solicitations() {
    if !privileged("without_xdp_transmit_tc_answers_arp_and_neighbour_solicitations") {
        return;
    }
    let mut bed = bed_with(Holder::Here);
    bed.view.underlay.xdp_forward = false;
    let maps = dataplane_user::overlay::compile(&bed.view).expect("compile");
    bed.fixture.sync_overlay(&maps, None).expect("sync overlay");
    let solicitor = "02:00:00:00:99:64";
    let underlay = mac(&UNDERLAY_MAC);
    let cases = [
        (
            format!(
                "Ether(src='{solicitor}', dst='ff:ff:ff:ff:ff:ff')/\
                 ARP(op=1, hwsrc='{solicitor}', psrc='10.99.0.100', pdst='10.99.0.50')"
            ),
            format!(
                "Ether(src='{underlay}', dst='{solicitor}')/\
                 ARP(op=2, hwsrc='{underlay}', psrc='10.99.0.50', hwdst='{solicitor}', pdst='10.99.0.100')"
            ),
        ),
        (
            format!(
                "Ether(src='{solicitor}', dst='33:33:ff:00:00:50')/IPv6(src='fd99::64', dst='ff02::1:ff00:50', hlim=255)/\
                 ICMPv6ND_NS(tgt='fd99::50')/ICMPv6NDOptSrcLLAddr(lladdr='{solicitor}')"
            ),
            format!(
                "Ether(src='{underlay}', dst='{solicitor}')/IPv6(src='fd99::50', dst='fd99::64', hlim=255)/\
                 ICMPv6ND_NA(tgt='fd99::50', R=0, S=1, O=1)/ICMPv6NDOptDstLLAddr(lladdr='{underlay}')"
            ),
        ),
    ];
    for (request, answer) in cases {
        let request = build(&request);
        let out = bed
            .fixture
            .run_xdp(PROG_UNDERLAY, &request, 1)
            .expect("xdp run");
        assert_eq!(out.action, XDP_PASS, "left to tc");
        let out = bed
            .fixture
            .run_tc(PROG_UNDERLAY_TC, &request, 1)
            .expect("tc run");
        assert_eq!(out.action, TC_ACT_REDIRECT);
        let answer = build(&answer);
        assert_eq!(hex(&out.output[..answer.len()]), hex(&answer));
    }
    // Another address: the stack's, untouched.
    let other = build(&format!(
        "Ether(src='{solicitor}', dst='ff:ff:ff:ff:ff:ff')/\
         ARP(op=1, hwsrc='{solicitor}', psrc='10.99.0.100', pdst='10.99.0.51')"
    ));
    let out = bed
        .fixture
        .run_tc(PROG_UNDERLAY_TC, &other, 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_OK);
    assert_eq!(hex(&out.output), hex(&other));
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

/// Takes the reply key of `protocol` from `remote` (port `remote_port`) to the egress address
/// `egress` at `port`, as if another translated flow held it: a new flow wanting that port
/// must take another.
fn occupy(
    bed: &mut Bed,
    protocol: u8,
    remote: IpAddr,
    remote_port: u16,
    egress: IpAddr,
    port: u16,
) {
    let mut ct: aya::maps::HashMap<&mut aya::maps::MapData, CtKey, EgressCtValue> = bed
        .fixture
        .typed_map(EGRESS_CT)
        .expect("egress conntrack map");
    let key = CtKey {
        src: addr16(remote),
        dst: addr16(egress),
        src_port_be: remote_port.to_be_bytes(),
        dst_port_be: port.to_be_bytes(),
        protocol,
        direction: EGRESS_CT_IN,
        _pad: [0; 2],
    };
    let elsewhere = EgressCtValue {
        addr: addr16("10.244.9.9".parse().expect("address")),
        port_be: port.to_be_bytes(),
        _pad: [0; 2],
    };
    ct.insert(key, elsewhere, 0).expect("occupying the port");
}

/// Runs `frame` through `program` and expects it sent on (`TC_ACT_REDIRECT`).
fn redirected(bed: &mut Bed, program: &'static str, frame: &[u8]) -> Vec<u8> {
    let out = bed.fixture.run_tc(program, frame, 1).expect("tc run");
    assert_eq!(
        out.action,
        TC_ACT_REDIRECT,
        "{:?}",
        bed.fixture.counters().drops
    );
    out.output
}

/// An underlay frame from the router towards this node, carrying `packet` (a scapy
/// expression from the IP header on).
fn from_outside(packet: &str) -> Vec<u8> {
    build(&format!(
        "Ether(src='02:00:00:00:99:02', dst='{}')/{packet}",
        mac(&UNDERLAY_MAC)
    ))
}

/// A frame from the test pod carrying `packet`.
fn from_pod(packet: &str) -> Vec<u8> {
    build(&format!(
        "Ether(src='{}', dst='{}')/{packet}",
        mac(&POD_MAC),
        mac(&GW_MAC)
    ))
}

#[test]
fn echo_requests_leave_from_the_egress_ip_with_their_identifier_as_port() {
    if !privileged("echo_requests_leave_from_the_egress_ip_with_their_identifier_as_port") {
        return;
    }
    let mut bed = bed_with(Holder::Here);
    // IPv4: the pod's identifier is free on the egress address, so only the source changes.
    let ping = "IP(src='10.244.1.2', dst='192.0.2.1', ttl=64, id=1)/ICMP(type=8, id=0x1234, seq=1)/Raw(b'ping')";
    let out = redirected(&mut bed, PROG_FROM_POD, &from_pod(ping));
    let expected = from_pod(&ping.replace("src='10.244.1.2'", "src='10.99.0.50'"));
    assert_eq!(hex(&out), hex(&expected));
    let pong =
        "IP(src='192.0.2.1', dst='{to}', ttl=63, id=7)/ICMP(type=0, id=0x1234, seq=1)/Raw(b'ping')";
    let out = redirected(
        &mut bed,
        PROG_UNDERLAY_TC,
        &from_outside(&pong.replace("{to}", "10.99.0.50")),
    );
    let delivered = from_pod(&pong.replace("{to}", "10.244.1.2"));
    assert_eq!(
        hex(&out[14..]),
        hex(&delivered[14..]),
        "the reply to the pod"
    );
    assert_eq!(&out[..6], &POD_MAC);

    // An identifier another flow holds on the egress address: the request takes another one
    // of the range, its checksum follows, and the reply gets the pod's back.
    occupy(
        &mut bed,
        IPPROTO_ICMP,
        "192.0.2.1".parse().expect("address"),
        0,
        IpAddr::from(EGRESS_IP),
        0x4321,
    );
    let ping = "IP(src='10.244.1.2', dst='192.0.2.1', ttl=64, id=2)/ICMP(type=8, id={id}, seq=5)/Raw(b'ping')";
    let out = redirected(
        &mut bed,
        PROG_FROM_POD,
        &from_pod(&ping.replace("{id}", "0x4321")),
    );
    let id = u16::from_be_bytes([out[38], out[39]]);
    assert!((32768..=60999).contains(&id), "identifier {id:#x}");
    let expected = from_pod(
        &ping
            .replace("src='10.244.1.2'", "src='10.99.0.50'")
            .replace("{id}", &id.to_string()),
    );
    assert_eq!(
        hex(&out),
        hex(&expected),
        "rewritten identifier and checksum"
    );
    let pong =
        "IP(src='192.0.2.1', dst='{to}', ttl=63, id=8)/ICMP(type=0, id={id}, seq=5)/Raw(b'ping')";
    let out = redirected(
        &mut bed,
        PROG_UNDERLAY_TC,
        &from_outside(
            &pong
                .replace("{to}", "10.99.0.50")
                .replace("{id}", &id.to_string()),
        ),
    );
    let delivered = from_pod(&pong.replace("{to}", "10.244.1.2").replace("{id}", "0x4321"));
    assert_eq!(
        hex(&out[14..]),
        hex(&delivered[14..]),
        "the reply to the pod"
    );

    // IPv6: the ICMPv6 checksum sums the addresses too.
    let ping6 = "IPv6(src='fd00:102a:0:1::2', dst='2001:db8::1', hlim=64)/ICMPv6EchoRequest(id=0x77, seq=3, data=b'ping6')";
    let out = redirected(&mut bed, PROG_FROM_POD, &from_pod(ping6));
    let expected = from_pod(&ping6.replace("src='fd00:102a:0:1::2'", "src='fd99::50'"));
    assert_eq!(hex(&out), hex(&expected));
    let pong6 = "IPv6(src='2001:db8::1', dst='{to}', hlim=63)/ICMPv6EchoReply(id=0x77, seq=3, data=b'ping6')";
    let out = redirected(
        &mut bed,
        PROG_UNDERLAY_TC,
        &from_outside(&pong6.replace("{to}", "fd99::50")),
    );
    let delivered = from_pod(&pong6.replace("{to}", "fd00:102a:0:1::2"));
    assert_eq!(hex(&out[14..]), hex(&delivered[14..]), "the IPv6 reply");

    let counters = bed.fixture.counters();
    assert_eq!(counters.packets(Hook::FromPod, PacketClass::EgressSnat), 3);
    assert_eq!(
        counters.packets(Hook::UnderlayTc, PacketClass::EgressReverseNat),
        3
    );

    // A ping to the egress address itself is answered by nobody; other ICMP from the pod
    // (a timestamp request) has nothing to translate it by and never leaves as the pod.
    let probe = from_outside("IP(src='192.0.2.1', dst='10.99.0.50')/ICMP(type=8, id=9, seq=1)");
    let out = bed
        .fixture
        .run_tc(PROG_UNDERLAY_TC, &probe, 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_SHOT);
    assert_eq!(bed.fixture.counters().drops(DropReason::EgressIpNoFlow), 1);
    let timestamp = from_pod("IP(src='10.244.1.2', dst='192.0.2.1')/ICMP(type=13, id=9, seq=1)");
    let out = bed
        .fixture
        .run_tc(PROG_FROM_POD, &timestamp, 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_SHOT);
    assert_eq!(
        bed.fixture.counters().drops(DropReason::EgressIpProtocol),
        1
    );
}

#[test]
fn an_error_about_a_translated_flow_reaches_the_pod_with_its_own_address_and_port() {
    if !privileged("an_error_about_a_translated_flow_reaches_the_pod_with_its_own_address_and_port")
    {
        return;
    }
    let mut bed = bed_with(Holder::Here);
    // A UDP flow whose port is taken on the egress address: both address and port change.
    occupy(
        &mut bed,
        IPPROTO_UDP,
        "192.0.2.1".parse().expect("address"),
        53,
        IpAddr::from(EGRESS_IP),
        40000,
    );
    let query = "IP(src='10.244.1.2', dst='192.0.2.1', ttl=64, id=3)/UDP(sport=40000, dport=53)/Raw(b'query')";
    let out = redirected(&mut bed, PROG_FROM_POD, &from_pod(query));
    let port = u16::from_be_bytes([out[34], out[35]]);
    assert_ne!(port, 40000);
    // A router on the way cannot forward it: fragmentation needed, quoting the packet as
    // it left.
    let quoted = "IPerror(src='{from}', dst='192.0.2.1', ttl=63, id=3)/\
                  UDPerror(sport={port}, dport=53)/Raw(b'query')";
    let error = |to: &str, from: &str, port: u16| {
        format!(
            "IP(src='192.0.2.254', dst='{to}', ttl=64, id=9)/ICMP(type=3, code=4, nexthopmtu=1300)/{}",
            quoted
                .replace("{from}", from)
                .replace("{port}", &port.to_string())
        )
    };
    let out = redirected(
        &mut bed,
        PROG_UNDERLAY_TC,
        &from_outside(&error("10.99.0.50", "10.99.0.50", port)),
    );
    let delivered = from_pod(&error("10.244.1.2", "10.244.1.2", 40000));
    assert_eq!(
        hex(&out[14..]),
        hex(&delivered[14..]),
        "the error, quoting the pod's own packet"
    );
    assert_eq!(&out[..6], &POD_MAC);

    // IPv6: packet too big about a TCP segment, the ICMPv6 checksum over the new addresses.
    let syn = "IPv6(src='fd00:102a:0:1::2', dst='2001:db8::1', hlim=64)/TCP(sport=41000, dport=443, flags='S', seq=1)";
    let out = redirected(&mut bed, PROG_FROM_POD, &from_pod(syn));
    assert_eq!(&out[22..38], &EGRESS_IP6);
    let too_big = |to: &str, from: &str| {
        format!(
            "IPv6(src='2001:db8::fe', dst='{to}', hlim=64)/ICMPv6PacketTooBig(mtu=1280)/\
             IPerror6(src='{from}', dst='2001:db8::1', hlim=63)/\
             TCPerror(sport=41000, dport=443, flags='S', seq=1)"
        )
    };
    let out = redirected(
        &mut bed,
        PROG_UNDERLAY_TC,
        &from_outside(&too_big("fd99::50", "fd99::50")),
    );
    let delivered = from_pod(&too_big("fd00:102a:0:1::2", "fd00:102a:0:1::2"));
    assert_eq!(hex(&out[14..]), hex(&delivered[14..]), "the IPv6 error");

    // An error about no translated flow is dropped.
    let stray = from_outside(&error("10.99.0.50", "10.99.0.50", 999));
    let out = bed
        .fixture
        .run_tc(PROG_UNDERLAY_TC, &stray, 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_SHOT);
    assert_eq!(bed.fixture.counters().drops(DropReason::EgressIpNoFlow), 1);
}

/// A sync against the maps as last written writes exactly the entries that differ, and
/// leaves the kernel as a sync that reads every entry back would: that one finds nothing to do.
#[test]
fn a_sync_against_the_last_written_maps_writes_only_the_difference() {
    if !privileged("a_sync_against_the_last_written_maps_writes_only_the_difference") {
        return;
    }
    let mut bed = bed_with(Holder::Here);
    let here = egress_maps(&bed.view, Holder::Here);
    let node_b = egress_maps(&bed.view, Holder::NodeB);
    assert_ne!(here, node_b);
    fn differing<K: Ord, V: PartialEq>(
        a: &std::collections::BTreeMap<K, V>,
        b: &std::collections::BTreeMap<K, V>,
    ) -> (usize, usize) {
        let written = b.iter().filter(|(k, v)| a.get(k) != Some(v)).count();
        let deleted = a.keys().filter(|k| !b.contains_key(k)).count();
        (written, deleted)
    }
    let parts = [
        differing(
            &here.internal.iter().map(|(k, v)| (*k, *v)).collect(),
            &node_b.internal.iter().map(|(k, v)| (*k, *v)).collect(),
        ),
        differing(&here.ips, &node_b.ips),
        differing(&here.snat, &node_b.snat),
        differing(&here.pods, &node_b.pods),
    ];
    // The active bits count as a write when bits are set (clearing them comes first, uncounted).
    let written: usize =
        parts.iter().map(|p| p.0).sum::<usize>() + usize::from(node_b.active & !here.active != 0);
    let deleted: usize = parts.iter().map(|p| p.1).sum();
    let stats = bed
        .fixture
        .sync_egress(&node_b, Some(&here))
        .expect("egress sync against the last");
    assert_eq!((stats.written, stats.deleted), (written, deleted));
    assert!(written + deleted > 0);
    let again = bed
        .fixture
        .sync_egress(&node_b, None)
        .expect("egress sync against the kernel");
    assert_eq!((again.written, again.deleted), (0, 0));
}
