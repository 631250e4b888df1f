//! Service load-balancing packet tests through the real programs with BPF_PROG_TEST_RUN. Input
//! frames and expected outputs are built by scapy (checksums included), so every rewritten
//! byte is checked against an independent implementation; the backend the kernel picks is
//! predicted from the agent's Maglev table and the shared flow hash.

use std::{net::IpAddr, thread::sleep, time::Duration};

use aya::maps::{Array, HashMap, MapData, MapError};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    frag::{FragKey, FragPorts},
    lb::{
        AffinityKey, AffinityValue, Backend, CT_AFFINITY, CT_CLOSING, CT_ORIGINAL, CT_REPLY,
        CT_RESET, CtKey, CtValue, MemberKey, SCOPE_CLUSTER, SNAT_LOW_PORT_MAX, SNAT_LOW_PORT_MIN,
        SNAT_PORT_MAX, SNAT_PORT_MIN, ServiceKey, ServiceValue, flow_hash, maglev_slot,
    },
    maps::{
        self, FRAGS, LB_AFFINITY, LB_CT, LB_MEMBERS, LB_SERVICES, LB_SNAT_NEXT, PROG_FROM_POD,
        PROG_UNDERLAY, PROG_UNDERLAY_TC,
    },
};
use dataplane_tests::{
    fixture::Fixture,
    packets::{self, tcp_v4_flow, udp_v4_flow},
    privileged::privileged,
    scapy::{self, bytes_of, hex},
};
use dataplane_user::{
    AgentError,
    kernel::capacity::Capacities,
    kernel::testrun::RunOutcome,
    lb::{BackendAddr, LbState, ServicePort, maglev_table, port_bitmaps},
    mapsync::addr16,
};
use serde_json::json;

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;

/// Runs `frame` through `tc_from_pod` as sent by the pod its source names (port security set
/// up for the test run; a frame too malformed to name its source is sent by the last pod).
fn from_pod(fixture: &mut Fixture, frame: &[u8]) -> Result<RunOutcome, AgentError> {
    if packets::source_of(frame).is_ok() {
        fixture.port_as_sender_of(frame).expect("port");
    }
    fixture.run_tc(PROG_FROM_POD, frame, 1)
}

/// Runs `frame` through `program`: from the pod its source names for `tc_from_pod`, as it
/// arrives for the others.
fn run_at(
    fixture: &mut Fixture,
    program: &'static str,
    frame: &[u8],
) -> Result<RunOutcome, AgentError> {
    if program == PROG_FROM_POD {
        return from_pod(fixture, frame);
    }
    fixture.run_tc(program, frame, 1)
}

fn ip(text: &str) -> IpAddr {
    text.parse().expect("address")
}

fn backend(text: &str) -> BackendAddr {
    let (address, port) = text.rsplit_once(':').expect("addr:port");
    BackendAddr {
        ip: ip(address.trim_matches(['[', ']'])),
        port: port.parse().expect("port"),
    }
}

fn service(vip: &str, port: u16, protocol: u8, backends: &[&str], affinity: u32) -> ServicePort {
    let mut ready: Vec<BackendAddr> = backends.iter().map(|b| backend(b)).collect();
    ready.sort();
    ServicePort {
        name: format!("test/{vip}:{port}"),
        kind: dataplane_user::lb::AddressKind::ClusterIp,
        key: ServiceKey {
            addr: addr16(ip(vip)),
            port_be: port.to_be_bytes(),
            protocol,
            scope: SCOPE_CLUSTER,
        },
        affinity_timeout: affinity,
        ready,
        terminating: Vec::new(),
        source_ranges: Vec::new(),
        topology: None,
    }
}

/// A TCP (SYN unless `flags` says otherwise) or UDP frame as scapy builds it.
fn frame(proto: &str, src: &str, sport: u16, dst: &str, dport: u16, flags: &str) -> Vec<u8> {
    bytes_of(
        &scapy::call(&json!({
            "op": "l4", "proto": proto, "src": src, "dst": dst,
            "sport": sport, "dport": dport, "flags": flags,
        }))
        .expect("scapy l4"),
    )
}

fn checksums_ok(frame: &[u8]) -> bool {
    let answer = scapy::call(&json!({"op": "checksums", "hex": hex(frame)})).expect("scapy");
    answer["l4_chksum_ok"] == true && answer.get("ip_chksum_ok").is_none_or(|v| v == true)
}

fn ct_key(src: &str, sport: u16, dst: &str, dport: u16, protocol: u8, direction: u8) -> CtKey {
    CtKey {
        src: addr16(ip(src)),
        dst: addr16(ip(dst)),
        src_port_be: sport.to_be_bytes(),
        dst_port_be: dport.to_be_bytes(),
        protocol,
        direction,
        _pad: [0; 2],
    }
}

fn ct_entry(fixture: &mut Fixture, key: &CtKey) -> Option<CtValue> {
    let ct: HashMap<&mut MapData, CtKey, CtValue> = fixture.typed_map(LB_CT).expect("ct map");
    ct.get(key, 0).ok()
}

/// The backend the kernel must pick for a new flow: the agent's table at the flow's hash.
fn predicted(state: &LbState, port: &ServicePort, key: &CtKey) -> BackendAddr {
    let pairs: Vec<(u32, BackendAddr)> = port
        .ready
        .iter()
        .map(|b| (state.id_of(*b).expect("backend id"), *b))
        .collect();
    let table = maglev_table(&pairs);
    let id = table[maglev_slot(flow_hash(key))];
    pairs.iter().find(|(i, _)| *i == id).expect("table id").1
}

const CLIENT: [u8; 4] = [10, 244, 1, 9];

/// The IPv4 destination of an untagged frame.
/// Whole seconds of CLOCK_MONOTONIC.
fn monotonic_seconds() -> u32 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    assert_eq!(
        // SAFETY: a valid clock id and a valid out pointer.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) },
        0
    );
    now.tv_sec as u32
}

fn destination(frame: &[u8]) -> [u8; 4] {
    [frame[30], frame[31], frame[32], frame[33]]
}

fn text(address: IpAddr) -> String {
    address.to_string()
}

#[test]
fn dnat_and_reverse_nat_are_byte_exact_for_tcp_udp_ipv4_and_ipv6() {
    if !privileged("dnat_and_reverse_nat_are_byte_exact_for_tcp_udp_ipv4_and_ipv6") {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = LbState::default();
    let ports = vec![
        service(
            "10.96.0.10",
            80,
            6,
            &["10.244.1.3:8080", "10.244.2.5:8080"],
            0,
        ),
        service(
            "10.96.0.10",
            53,
            17,
            &["10.244.1.3:5353", "10.244.2.5:5353"],
            0,
        ),
        service("fd00:96::10", 443, 6, &["[fd00:10:244:1::3]:8443"], 0),
    ];
    fixture.sync_lb(&mut state, &ports).expect("sync");
    let cases = [
        ("tcp", 6, "10.244.1.9", 40000, &ports[0]),
        ("udp", 17, "10.244.1.9", 40001, &ports[1]),
        ("tcp", 6, "fd00:10:244:1::9", 40002, &ports[2]),
    ];
    for (proto, number, client, sport, port) in cases {
        let vip = if client.contains(':') {
            "fd00:96::10"
        } else {
            "10.96.0.10"
        };
        let vport = u16::from_be_bytes(port.key.port_be);
        let key = ct_key(client, sport, vip, vport, number, CT_ORIGINAL);
        let chosen = predicted(&state, port, &key);
        let flags = if proto == "tcp" { "S" } else { "" };

        let request = frame(proto, client, sport, vip, vport, flags);
        let out = from_pod(&mut fixture, &request).expect("tc run");
        assert_eq!(
            out.action, TC_ACT_OK,
            "{proto} {client}: continues to the stack"
        );
        let expected = frame(proto, client, sport, &text(chosen.ip), chosen.port, flags);
        assert_eq!(
            hex(&out.output),
            hex(&expected),
            "{proto} {client}: DNAT to {chosen}"
        );
        assert!(checksums_ok(&out.output), "{proto} {client}: checksums");

        // Both directions are tracked, each pointing where the other came from.
        let original = ct_entry(&mut fixture, &key).expect("original entry");
        assert_eq!(original.addr, addr16(chosen.ip));
        assert_eq!(original.port_be, chosen.port.to_be_bytes());
        assert_eq!(Some(original.backend_id), state.id_of(chosen));
        let reply_key = ct_key(
            &text(chosen.ip),
            chosen.port,
            client,
            sport,
            number,
            CT_REPLY,
        );
        let reply_entry = ct_entry(&mut fixture, &reply_key).expect("reply entry");
        assert_eq!(reply_entry.addr, addr16(ip(vip)));
        assert_eq!(reply_entry.port_be, vport.to_be_bytes());

        // The reply gets the service address back, leaving a local backend (tc on its veth)
        // or decapsulated from a remote one (tc on the underlay).
        let reply_flags = if proto == "tcp" { "SA" } else { "" };
        let reply = frame(
            proto,
            &text(chosen.ip),
            chosen.port,
            client,
            sport,
            reply_flags,
        );
        let expected = frame(proto, vip, vport, client, sport, reply_flags);
        for program in [PROG_FROM_POD, PROG_UNDERLAY_TC] {
            let out = run_at(&mut fixture, program, &reply).expect("tc run");
            assert_eq!(out.action, TC_ACT_OK);
            assert_eq!(
                hex(&out.output),
                hex(&expected),
                "{proto} {client}: reverse NAT in {program}"
            );
            assert!(checksums_ok(&out.output));
        }
    }
    let counters = fixture.counters();
    assert_eq!(counters.packets(Hook::FromPod, PacketClass::ServiceDnat), 3);
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::ServiceReverseNat),
        3
    );
    assert_eq!(
        counters.packets(Hook::UnderlayTc, PacketClass::ServiceReverseNat),
        3
    );
}

/// An SCTP frame with one chunk (`INIT`, `ABORT`, or DATA with `payload`), as scapy builds it;
/// its CRC32c zero when `zero_checksum` (left to offload by the sender's stack).
fn sctp_frame(
    src: &str,
    sport: u16,
    dst: &str,
    dport: u16,
    chunk: &str,
    payload: &[u8],
    zero_checksum: bool,
) -> Vec<u8> {
    bytes_of(
        &scapy::call(&json!({
            "op": "l4", "proto": "sctp", "src": src, "dst": dst, "sport": sport,
            "dport": dport, "flags": chunk, "payload": hex(payload),
            "zero_checksum": zero_checksum,
        }))
        .expect("scapy sctp"),
    )
}

#[test]
fn sctp_is_translated_with_its_crc32c_kept_right() {
    if !privileged("sctp_is_translated_with_its_crc32c_kept_right") {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = LbState::default();
    // Port 80 to target 8080: the CRC covers the ports. Port 9000 to 9000 over IPv6: only
    // addresses change, which SCTP's CRC does not cover.
    let ports = vec![
        service(
            "10.96.0.10",
            80,
            132,
            &["10.244.1.3:8080", "10.244.2.5:8080"],
            0,
        ),
        service("fd00:96::10", 9000, 132, &["[fd00:10:244:1::3]:9000"], 0),
    ];
    fixture.sync_lb(&mut state, &ports).expect("sync");
    let long = vec![0xa5; 1200];
    let cases = [
        ("10.244.1.9", 40000, "10.96.0.10", &ports[0]),
        ("fd00:10:244:1::9", 40001, "fd00:96::10", &ports[1]),
    ];
    for (client, sport, vip, port) in cases {
        let vport = u16::from_be_bytes(port.key.port_be);
        let key = ct_key(client, sport, vip, vport, 132, CT_ORIGINAL);
        let chosen = predicted(&state, port, &key);
        let backend_ip = text(chosen.ip);
        // The association opens, then data flows: short, long (the CRC's length tables past
        // 256 bytes) and with the CRC left to offload (zero, and left zero).
        let packets: [(&str, &[u8], bool); 4] = [
            ("INIT", b"", false),
            ("", b"hello", false),
            ("", &long, false),
            ("", b"offloaded", true),
        ];
        for (chunk, payload, zero) in packets {
            let request = sctp_frame(client, sport, vip, vport, chunk, payload, zero);
            let out = from_pod(&mut fixture, &request).expect("tc run");
            assert_eq!(out.action, TC_ACT_OK, "{client} {chunk:?}: continues");
            let expected = sctp_frame(
                client,
                sport,
                &backend_ip,
                chosen.port,
                chunk,
                payload,
                zero,
            );
            assert_eq!(
                hex(&out.output),
                hex(&expected),
                "{client} {chunk:?} {} bytes: DNAT to {chosen}",
                payload.len()
            );
            if !zero {
                assert!(checksums_ok(&out.output), "{client}: CRC32c by scapy");
            }
        }
        let original = ct_entry(&mut fixture, &key).expect("original entry");
        assert_eq!(original.addr, addr16(chosen.ip));
        assert_eq!(original.port_be, chosen.port.to_be_bytes());

        // Replies get the service address and port back, CRC included.
        let reply = sctp_frame(&backend_ip, chosen.port, client, sport, "", b"back", false);
        let expected = sctp_frame(vip, vport, client, sport, "", b"back", false);
        for program in [PROG_FROM_POD, PROG_UNDERLAY_TC] {
            let out = run_at(&mut fixture, program, &reply).expect("tc run");
            assert_eq!(out.action, TC_ACT_OK);
            assert_eq!(
                hex(&out.output),
                hex(&expected),
                "{client}: reverse NAT in {program}"
            );
            assert!(checksums_ok(&out.output));
        }

        // ABORT ends the association: the entry only lingers briefly.
        let abort = sctp_frame(client, sport, vip, vport, "ABORT", b"", false);
        let out = from_pod(&mut fixture, &abort).expect("tc run");
        assert_eq!(out.action, TC_ACT_OK);
        let closing = ct_entry(&mut fixture, &key).expect("entry after abort");
        assert_ne!(
            closing.flags & CT_CLOSING,
            0,
            "{client}: ABORT marks closing"
        );
    }
    let counters = fixture.counters();
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::ServiceDnat),
        10
    );
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::ServiceReverseNat),
        2
    );
}

/// An ICMP (IPv4 source) or ICMPv6 error from `src` to `dst` quoting the IP packet of `frame`
/// (its Ethernet header left out), as scapy builds it.
fn icmp_about(src: &str, dst: &str, kind: u8, code: u8, frame: &[u8]) -> Vec<u8> {
    bytes_of(
        &scapy::call(&json!({
            "op": "icmp_about", "src": src, "dst": dst, "type": kind, "code": code,
            "quote": hex(&frame[14..]),
        }))
        .expect("scapy icmp"),
    )
}

/// [`icmp_about`] with the given Ethernet addresses.
fn icmp_about_between(
    (src, src_mac): (&str, &str),
    (dst, dst_mac): (&str, &str),
    kind: u8,
    code: u8,
    frame: &[u8],
) -> Vec<u8> {
    bytes_of(
        &scapy::call(&json!({
            "op": "icmp_about", "src": src, "dst": dst, "type": kind, "code": code,
            "quote": hex(&frame[14..]), "src_mac": src_mac, "dst_mac": dst_mac,
        }))
        .expect("scapy icmp"),
    )
}

#[test]
fn icmp_errors_from_backends_get_the_service_address_back() {
    if !privileged("icmp_errors_from_backends_get_the_service_address_back") {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = LbState::default();
    let ports = vec![
        service("10.96.0.10", 53, 17, &["10.244.1.3:5353"], 0),
        service("fd00:96::10", 443, 6, &["[fd00:10:244:1::3]:8443"], 0),
    ];
    fixture.sync_lb(&mut state, &ports).expect("sync");
    // (protocol, client, service, backend, error type and code: port unreachable, and a
    // time exceeded sent by a router on the way.)
    let cases = [
        (
            "udp",
            "10.244.1.9",
            ("10.96.0.10", 53),
            ("10.244.1.3", 5353),
            (3, 3),
            None,
        ),
        (
            "udp",
            "10.244.1.9",
            ("10.96.0.10", 53),
            ("10.244.1.3", 5353),
            (11, 0),
            Some("10.244.9.1"),
        ),
        (
            "tcp",
            "fd00:10:244:1::9",
            ("fd00:96::10", 443),
            ("fd00:10:244:1::3", 8443),
            (1, 4),
            None,
        ),
    ];
    let mut translated = 0;
    for (n, (proto, client, (vip, vport), (backend, bport), (kind, code), router)) in
        cases.into_iter().enumerate()
    {
        let sport = 41000 + n as u16;
        let flags = if proto == "tcp" { "S" } else { "" };
        let request = frame(proto, client, sport, vip, vport, flags);
        let out = from_pod(&mut fixture, &request).expect("tc run");
        let sent = frame(proto, client, sport, backend, bport, flags);
        assert_eq!(hex(&out.output), hex(&sent), "{proto}: DNAT first");

        // The backend (or a router) answers the packet it got with an error; the client must
        // get it about the packet it sent, from the service.
        let from = router.unwrap_or(backend);
        let error = icmp_about(from, client, kind, code, &sent);
        let expected = icmp_about(router.unwrap_or(vip), client, kind, code, &request);
        // A router's error reaches the node from the underlay only: from a pod's veth, port
        // security refuses a source the pod does not own.
        let programs: &[&'static str] = if router.is_some() {
            &[PROG_UNDERLAY_TC]
        } else {
            &[PROG_FROM_POD, PROG_UNDERLAY_TC]
        };
        for &program in programs {
            let out = run_at(&mut fixture, program, &error).expect("tc run");
            assert_eq!(out.action, TC_ACT_OK, "{proto} {kind}/{code} in {program}");
            assert_eq!(
                hex(&out.output),
                hex(&expected),
                "{proto} {kind}/{code} from {from} in {program}: every checksum as scapy's"
            );
            translated += 1;
        }
    }
    // An error about a flow nobody tracks passes as it is.
    let stranger = frame("udp", "10.244.1.9", 999, "10.244.1.3", 5353, "");
    let error = icmp_about("10.244.1.3", "10.244.1.9", 3, 3, &stranger);
    let out = from_pod(&mut fixture, &error).expect("tc run");
    assert_eq!(out.action, TC_ACT_OK);
    assert_eq!(hex(&out.output), hex(&error), "untracked: untouched");

    let counters = fixture.counters();
    let reverse = counters.packets(Hook::FromPod, PacketClass::ServiceReverseNat)
        + counters.packets(Hook::UnderlayTc, PacketClass::ServiceReverseNat);
    assert_eq!(reverse, translated);
}

#[test]
fn new_flows_take_the_maglev_choice_and_established_flows_keep_their_backend() {
    if !privileged("new_flows_take_the_maglev_choice_and_established_flows_keep_their_backend") {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = LbState::default();
    let three = ["10.244.1.3:8080", "10.244.2.5:8080", "10.244.3.7:8080"];
    let mut ports = vec![service("10.96.0.20", 80, 6, &three, 0)];
    fixture.sync_lb(&mut state, &ports).expect("sync");
    let mut chosen = Vec::new();
    for sport in 41000..41200u16 {
        let key = ct_key("10.244.1.9", sport, "10.96.0.20", 80, 6, CT_ORIGINAL);
        let want = predicted(&state, &ports[0], &key);
        let syn = tcp_v4_flow(CLIENT, sport, [10, 96, 0, 20], 80, true);
        let out = from_pod(&mut fixture, &syn).expect("tc run");
        assert_eq!(
            IpAddr::from(destination(&out.output)),
            want.ip,
            "flow {sport}"
        );
        chosen.push(want);
    }
    for b in three {
        let n = chosen.iter().filter(|c| **c == backend(b)).count();
        assert!((40..100).contains(&n), "{b} took {n} of 200 flows");
    }
    // A fourth backend changes the table; the 200 tracked flows stay where they are.
    ports = vec![service(
        "10.96.0.20",
        80,
        6,
        &[three[0], three[1], three[2], "10.244.4.9:8080"],
        0,
    )];
    fixture.sync_lb(&mut state, &ports).expect("sync");
    for (i, sport) in (41000..41200u16).enumerate() {
        let ack = tcp_v4_flow(CLIENT, sport, [10, 96, 0, 20], 80, false);
        let out = from_pod(&mut fixture, &ack).expect("tc run");
        let dst = IpAddr::from(destination(&out.output));
        assert_eq!(dst, chosen[i].ip, "flow {sport} stays on its backend");
    }
}

#[test]
fn a_direct_connection_reusing_a_closed_service_flows_ports_is_not_reverse_translated() {
    if !privileged(
        "a_direct_connection_reusing_a_closed_service_flows_ports_is_not_reverse_translated",
    ) {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = LbState::default();
    let ports = vec![service("10.96.0.40", 80, 6, &["10.244.1.3:8080"], 0)];
    fixture.sync_lb(&mut state, &ports).expect("sync");
    let (client, backend, vip) = ("10.244.1.9", "10.244.1.3", "10.96.0.40");
    let source = |frame: &[u8]| (frame[26..30].to_vec(), frame[34..36].to_vec());
    let service_side = (vec![10, 96, 0, 40], 80u16.to_be_bytes().to_vec());
    let backend_side = (vec![10, 244, 1, 3], 8080u16.to_be_bytes().to_vec());
    // A connection through the service, answered, then ended by the client with a reset
    // (as clients that skip TIME_WAIT do): the backend never closed its side.
    let run = |fixture: &mut Fixture, frame: Vec<u8>| from_pod(fixture, &frame).expect("tc run");
    run(&mut fixture, frame("tcp", client, 43000, vip, 80, "S"));
    let answer = run(
        &mut fixture,
        frame("tcp", backend, 8080, client, 43000, "SA"),
    );
    assert_eq!(source(&answer.output), service_side);
    run(&mut fixture, frame("tcp", client, 43000, vip, 80, "A"));
    let data = run(
        &mut fixture,
        frame("tcp", backend, 8080, client, 43000, "PA"),
    );
    assert_eq!(source(&data.output), service_side);
    run(&mut fixture, frame("tcp", client, 43000, vip, 80, "R"));
    // The client then connects straight to the backend from the same port: its SYN is no
    // service packet, and the backend's answer keeps the backend's address.
    let direct = run(
        &mut fixture,
        frame("tcp", client, 43000, backend, 8080, "S"),
    );
    assert_eq!(&direct.output[30..34], &[10, 244, 1, 3]);
    let answer = run(
        &mut fixture,
        frame("tcp", backend, 8080, client, 43000, "SA"),
    );
    assert_eq!(
        source(&answer.output),
        backend_side,
        "not the service's reply"
    );
    assert!(checksums_ok(&answer.output));
    // The service flow is over: both its entries are gone, and the direct connection's
    // later segments keep the backend's address too.
    for key in [
        ct_key(backend, 8080, client, 43000, 6, CT_REPLY),
        ct_key(client, 43000, vip, 80, 6, CT_ORIGINAL),
    ] {
        assert_eq!(ct_entry(&mut fixture, &key), None, "{key:?}");
    }
    let data = run(
        &mut fixture,
        frame("tcp", backend, 8080, client, 43000, "PA"),
    );
    assert_eq!(source(&data.output), backend_side);
    // A new connection through the service on those ports renews the flow: translated again.
    run(&mut fixture, frame("tcp", client, 43000, vip, 80, "S"));
    let answer = run(
        &mut fixture,
        frame("tcp", backend, 8080, client, 43000, "SA"),
    );
    assert_eq!(source(&answer.output), service_side);
}

#[test]
fn a_removed_backend_resets_tcp_moves_udp_and_no_endpoint_is_answered() {
    if !privileged("a_removed_backend_resets_tcp_moves_udp_and_no_endpoint_is_answered") {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = LbState::default();
    let mut ports = vec![
        service("10.96.0.30", 80, 6, &["10.244.1.3:8080"], 0),
        service("10.96.0.30", 53, 17, &["10.244.1.3:5353"], 0),
        service("10.96.0.31", 80, 6, &[], 0),
    ];
    fixture.sync_lb(&mut state, &ports).expect("sync");
    let tcp = tcp_v4_flow(CLIENT, 42000, [10, 96, 0, 30], 80, true);
    let udp = udp_v4_flow(CLIENT, 42001, [10, 96, 0, 30], 53);
    assert_eq!(from_pod(&mut fixture, &tcp).unwrap().action, TC_ACT_OK);
    assert_eq!(from_pod(&mut fixture, &udp).unwrap().action, TC_ACT_OK);

    // The only backend is replaced by another.
    ports[0] = service("10.96.0.30", 80, 6, &["10.244.2.5:8080"], 0);
    ports[1] = service("10.96.0.30", 53, 17, &["10.244.2.5:5353"], 0);
    fixture.sync_lb(&mut state, &ports).expect("sync");
    let ack = tcp_v4_flow(CLIENT, 42000, [10, 96, 0, 30], 80, false);
    let out = from_pod(&mut fixture, &ack).unwrap();
    assert_eq!(
        out.action, TC_ACT_REDIRECT,
        "the TCP flow is reset, not black-holed"
    );
    assert_eq!(out.output[47] & 0x04, 0x04, "RST flag");
    assert_eq!(
        &out.output[26..30],
        &[10, 96, 0, 30],
        "from the service address"
    );
    let out = from_pod(&mut fixture, &udp).unwrap();
    assert_eq!(out.action, TC_ACT_OK);
    assert_eq!(
        &out.output[30..34],
        &[10, 244, 2, 5],
        "UDP flow moved to the new backend"
    );
    // A new TCP connection on the same ports is a new flow.
    let syn = tcp_v4_flow(CLIENT, 42002, [10, 96, 0, 30], 80, true);
    let out = from_pod(&mut fixture, &syn).unwrap();
    assert_eq!(&out.output[30..34], &[10, 244, 2, 5]);

    let empty = tcp_v4_flow(CLIENT, 42003, [10, 96, 0, 31], 80, true);
    assert_eq!(
        from_pod(&mut fixture, &empty).unwrap().action,
        TC_ACT_REDIRECT,
        "answered with a reset"
    );
    let counters = fixture.counters();
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::ServiceResetBackendGone),
        1
    );
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::ServiceRejected),
        1
    );
}

#[test]
fn client_ip_affinity_runs_from_the_last_packet_and_repicks_when_its_backend_goes() {
    if !privileged("client_ip_affinity_runs_from_the_last_packet_and_repicks_when_its_backend_goes")
    {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = LbState::default();
    let backends = [
        "10.244.1.3:8080",
        "10.244.2.5:8080",
        "10.244.3.7:8080",
        "10.244.4.9:8080",
    ];
    // A 1-second timeout: the kernel clock is in whole seconds, so an entry expires after
    // 1 to 2 seconds of silence and survives a client sending every half second.
    let mut ports = vec![service("10.96.0.40", 80, 6, &backends, 1)];
    fixture.sync_lb(&mut state, &ports).expect("sync");
    let connect = |fixture: &mut Fixture, sport: u16| -> [u8; 4] {
        let syn = tcp_v4_flow(CLIENT, sport, [10, 96, 0, 40], 80, true);
        let out = from_pod(fixture, &syn).expect("tc run");
        assert_eq!(out.action, TC_ACT_OK);
        destination(&out.output)
    };
    let affinity = |fixture: &mut Fixture| -> Option<AffinityValue> {
        let map: HashMap<&mut MapData, AffinityKey, AffinityValue> =
            fixture.typed_map(LB_AFFINITY).expect("affinity map");
        map.iter().filter_map(Result::ok).map(|(_, v)| v).next()
    };

    // A new connection every half second for 10 s, ten times the timeout: always the same
    // backend, and the one affinity entry's clock moves with the client.
    let first = connect(&mut fixture, 43000);
    let started = affinity(&mut fixture).expect("affinity entry").last_seen;
    // The programs' clock (jiffies, given the tick rate the loader found) is the monotonic
    // clock in seconds, to within the tick and the read's own second boundary.
    let monotonic = monotonic_seconds();
    assert!(
        started.abs_diff(monotonic) <= 1,
        "program clock {started} s against CLOCK_MONOTONIC {monotonic} s"
    );
    for i in 1..=20u16 {
        sleep(Duration::from_millis(500));
        assert_eq!(
            connect(&mut fixture, 43000 + i),
            first,
            "connection {i} sticks"
        );
    }
    let refreshed = affinity(&mut fixture).expect("affinity entry");
    assert!(
        refreshed.last_seen >= started + 9,
        "timer restarted by every packet"
    );

    // One established connection alone keeps the client's timer going too: its conntrack
    // entry is marked as under affinity, so its packets refresh the timer without a service
    // lookup; a new connection after 3 s (three timeouts) still lands on the same backend.
    let ct: HashMap<&mut MapData, CtKey, CtValue> = fixture.typed_map(LB_CT).expect("ct map");
    let marked = ct
        .iter()
        .filter_map(Result::ok)
        .filter(|(k, _)| k.direction == CT_ORIGINAL)
        .all(|(_, v)| v.flags & CT_AFFINITY != 0);
    assert!(
        marked,
        "original entries of an affinity service carry CT_AFFINITY"
    );
    let before = affinity(&mut fixture).expect("affinity entry").last_seen;
    for _ in 0..6 {
        sleep(Duration::from_millis(500));
        let ack = tcp_v4_flow(CLIENT, 43020, [10, 96, 0, 40], 80, false);
        let out = from_pod(&mut fixture, &ack).expect("tc run");
        assert_eq!(out.action, TC_ACT_OK);
        assert_eq!(
            destination(&out.output),
            first,
            "established flow keeps its backend"
        );
    }
    assert!(
        affinity(&mut fixture).expect("affinity entry").last_seen >= before + 2,
        "established packets restart the timer"
    );
    assert_eq!(
        connect(&mut fixture, 43100),
        first,
        "still affine after 3 s"
    );

    // After the timeout with no packet, a fresh choice; repeated, the choices differ.
    let mut seen = std::collections::BTreeSet::from([first]);
    for round in 0..6u16 {
        sleep(Duration::from_millis(2_100));
        seen.insert(connect(&mut fixture, 44000 + round * 7));
        if seen.len() >= 2 {
            break;
        }
    }
    assert!(
        seen.len() >= 2,
        "fresh choices after expiry reached {seen:?}"
    );

    // The affine backend goes away: the next connection re-picks and then sticks.
    let current = connect(&mut fixture, 45000);
    let remaining: Vec<&str> = backends
        .iter()
        .copied()
        .filter(|b| backend(b).ip != IpAddr::from(current))
        .collect();
    ports = vec![service("10.96.0.40", 80, 6, &remaining, 1)];
    fixture.sync_lb(&mut state, &ports).expect("sync");
    let repicked = connect(&mut fixture, 45001);
    assert_ne!(repicked, current);
    for i in 2..6u16 {
        assert_eq!(
            connect(&mut fixture, 45000 + i),
            repicked,
            "sticks to the new backend"
        );
    }
}

#[test]
fn a_backend_that_leaves_a_service_gets_none_of_its_new_flows_though_it_serves_another() {
    if !privileged(
        "a_backend_that_leaves_a_service_gets_none_of_its_new_flows_though_it_serves_another",
    ) {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = LbState::default();
    let backends = [
        "10.244.1.3:8080",
        "10.244.2.5:8080",
        "10.244.3.7:8080",
        "10.244.4.9:8080",
    ];
    // Two services of the same four pods (backends are shared by address and port), the
    // first with ClientIP affinity.
    let sticky = service("10.96.0.41", 80, 6, &backends, 86_400);
    let other = service("10.96.0.42", 80, 6, &backends, 0);
    fixture
        .sync_lb(&mut state, &[sticky.clone(), other.clone()])
        .expect("sync");
    let connect = |fixture: &mut Fixture, sport: u16| -> [u8; 4] {
        let syn = tcp_v4_flow(CLIENT, sport, [10, 96, 0, 41], 80, true);
        let out = from_pod(fixture, &syn).expect("tc run");
        assert_eq!(out.action, TC_ACT_OK);
        destination(&out.output)
    };
    let affinity_rows = |fixture: &mut Fixture| -> Vec<(AffinityKey, AffinityValue)> {
        let map: HashMap<&mut MapData, AffinityKey, AffinityValue> =
            fixture.typed_map(LB_AFFINITY).expect("affinity map");
        map.iter().filter_map(Result::ok).collect()
    };
    let members = |fixture: &mut Fixture| -> Vec<MemberKey> {
        let map: HashMap<&mut MapData, MemberKey, u32> =
            fixture.typed_map(LB_MEMBERS).expect("members map");
        let mut keys: Vec<MemberKey> = map.keys().filter_map(Result::ok).collect();
        keys.sort();
        keys
    };
    let service_id = |fixture: &mut Fixture, key: &ServiceKey| -> u32 {
        let map: HashMap<&mut MapData, ServiceKey, ServiceValue> =
            fixture.typed_map(LB_SERVICES).expect("services map");
        map.get(key, 0).expect("service entry").id
    };
    let sticky_id = service_id(&mut fixture, &sticky.key);
    let id_of = |state: &LbState, b: &str| state.id_of(backend(b)).expect("backend id");
    // Only the service with affinity has members: its four backends.
    let mut expected: Vec<MemberKey> = backends
        .iter()
        .map(|b| MemberKey {
            service_id: sticky_id,
            backend_id: id_of(&state, b),
        })
        .collect();
    expected.sort();
    assert_eq!(members(&mut fixture), expected);

    let first = connect(&mut fixture, 46000);
    let leaving = *backends
        .iter()
        .find(|b| backend(b).ip == IpAddr::from(first))
        .expect("one of the backends");
    let leaving_id = id_of(&state, leaving);
    assert_eq!(
        affinity_rows(&mut fixture)
            .iter()
            .map(|(k, v)| (k.service_id, v.backend_id))
            .collect::<Vec<_>>(),
        vec![(sticky_id, leaving_id)]
    );

    // The chosen pod leaves the sticky service only; it still serves the other.
    let remaining: Vec<&str> = backends.iter().copied().filter(|b| *b != leaving).collect();
    let sticky_after = service("10.96.0.41", 80, 6, &remaining, 86_400);
    fixture
        .sync_lb(&mut state, &[sticky_after.clone(), other.clone()])
        .expect("sync");
    assert_eq!(
        state.id_of(backend(leaving)),
        Some(leaving_id),
        "still a backend"
    );
    assert!(
        affinity_rows(&mut fixture).is_empty(),
        "the entry naming the leaver is cleared"
    );
    assert!(
        !members(&mut fixture)
            .iter()
            .any(|m| m.backend_id == leaving_id)
    );

    // Even an entry naming it (as a program could write in the instant before the sync
    // switched the table) is not followed: the programs ask the membership map.
    {
        let mut map: HashMap<&mut MapData, AffinityKey, AffinityValue> =
            fixture.typed_map(LB_AFFINITY).expect("affinity map");
        let key = AffinityKey {
            client: addr16(IpAddr::from(CLIENT)),
            service_id: sticky_id,
        };
        let now = monotonic_seconds();
        map.insert(
            key,
            AffinityValue {
                backend_id: leaving_id,
                last_seen: now,
            },
            0,
        )
        .expect("stale entry");
    }
    let repicked = connect(&mut fixture, 46001);
    assert_ne!(repicked, first, "the leaver gets no new flow");
    for sport in 46002..46008 {
        assert_eq!(
            connect(&mut fixture, sport),
            repicked,
            "sticks to the new pick"
        );
    }
    // The other service still reaches the pod that left the sticky one.
    let other_backends: std::collections::BTreeSet<[u8; 4]> = (47000..47040)
        .map(|sport| {
            let syn = tcp_v4_flow(CLIENT, sport, [10, 96, 0, 42], 80, true);
            let out = from_pod(&mut fixture, &syn).expect("tc run");
            destination(&out.output)
        })
        .collect();
    assert!(other_backends.contains(&first), "{other_backends:?}");
}

/// Fragment `index` of the datagram scapy builds from `ip` (an IPv4 or IPv6 expression with
/// its transport and payload), cut at 1000 bytes, in the frame a pod sends.
fn fragment_frame(ip: &str, index: usize) -> Vec<u8> {
    let cut = if ip.starts_with("IPv6") {
        format!("fragment6({ip}, 1000)")
    } else {
        format!("fragment({ip}, fragsize=1000)")
    };
    scapy::build(&format!(
        "Ether(src='0a:58:0a:f4:01:09', dst='02:00:00:00:01:09')/{cut}[{index}]"
    ))
    .expect("scapy fragment")
}

#[test]
fn every_fragment_of_a_datagram_is_translated_as_its_first() {
    if !privileged("every_fragment_of_a_datagram_is_translated_as_its_first") {
        return;
    }
    // One CPU: a datagram's entry goes at that CPU's next fragment after its last.
    dataplane_tests::fixture::pin_to_one_cpu();
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = LbState::default();
    let ports = vec![
        service("10.96.0.45", 53, 17, &["10.244.2.5:5353"], 0),
        service("fd00:96::45", 53, 17, &["[fd00:10:244:2::5]:5353"], 0),
    ];
    fixture.sync_lb(&mut state, &ports).expect("sync");
    for (client, vip, backend, header) in [
        (
            "10.244.1.9",
            "10.96.0.45",
            "10.244.2.5",
            "IP(src='{s}', dst='{d}', id=777)",
        ),
        (
            "fd00:10:244:1::9",
            "fd00:96::45",
            "fd00:10:244:2::5",
            "IPv6(src='{s}', dst='{d}')/IPv6ExtHdrFragment(id=777)",
        ),
    ] {
        let datagram = |dst: &str, dport: u16| {
            header.replace("{s}", client).replace("{d}", dst)
                + &format!("/UDP(sport=40000, dport={dport})/Raw(b'0123456789' * 250)")
        };
        // Three fragments; each leaves addressed to the backend, byte for byte as scapy
        // builds the datagram sent to the backend itself: the first with the port and the
        // whole datagram's UDP checksum, the later ones with the address alone.
        for index in 0..3 {
            let sent = fragment_frame(&datagram(vip, 53), index);
            let out = from_pod(&mut fixture, &sent).expect("tc run");
            assert_eq!(out.action, TC_ACT_OK, "{client}: fragment {index}");
            assert_eq!(
                hex(&out.output),
                hex(&fragment_frame(&datagram(backend, 5353), index)),
                "{client}: fragment {index}"
            );
        }
    }
    // The first fragments' ports are remembered by datagram, and go with its last fragment:
    // the IPv4 datagram's went when the IPv6 one began; the IPv6 one's waits for the next
    // fragment (its last fragment may still pass another program of this node).
    let remembered = |fixture: &mut Fixture| -> Vec<(FragKey, FragPorts)> {
        let frags: HashMap<&mut MapData, FragKey, FragPorts> =
            fixture.typed_map(FRAGS).expect("fragments map");
        let mut remembered: Vec<(FragKey, FragPorts)> =
            frags.iter().filter_map(Result::ok).collect();
        remembered.sort_by_key(|(k, _)| k.src);
        remembered
    };
    let ports = FragPorts {
        src_port: 40000u16.to_be_bytes(),
        dst_port: 53u16.to_be_bytes(),
    };
    let key = |src: &str, dst: &str, id: [u8; 4]| FragKey {
        src: addr16(ip(src)),
        dst: addr16(ip(dst)),
        id,
        protocol: 17,
        _pad: [0; 3],
    };
    assert_eq!(
        remembered(&mut fixture),
        vec![(
            key("fd00:10:244:1::9", "fd00:96::45", 777u32.to_be_bytes()),
            ports,
        )]
    );

    // A later fragment of a datagram whose first was never seen: dropped, for its own reason.
    let lone = fragment_frame(
        "IP(src='10.244.1.9', dst='10.96.0.45', id=778)/UDP(sport=40000, dport=53)/Raw(b'x' * 2500)",
        1,
    );
    let out = from_pod(&mut fixture, &lone).expect("tc run");
    assert_eq!(out.action, TC_ACT_SHOT);
    assert_eq!(
        fixture.counters().drops(DropReason::FragmentWithoutFirst),
        1
    );
    // Its run took the last datagram's entry with it: no dead entry stays.
    assert_eq!(remembered(&mut fixture), Vec::new());
}

const TC_ACT_REDIRECT: u32 = 7;

/// The reset scapy builds for the answer: from the service back to the client, gateway MAC to
/// pod MAC, no payload, window 0 (IPv4: DF, ID 0).
fn expected_reset(vip: &str, client: &str, sport: u16, seq: u32, ack: u32, flags: &str) -> Vec<u8> {
    bytes_of(
        &scapy::call(&json!({
            "op": "l4", "proto": "tcp", "src": vip, "dst": client, "sport": 80, "dport": sport,
            "flags": flags, "seq": seq, "ack": ack, "window": 0, "ip_id": 0, "payload": "",
            "src_mac": "02:00:00:00:01:09", "dst_mac": "0a:58:0a:f4:01:09",
        }))
        .expect("scapy reset"),
    )
}

#[test]
fn a_service_without_endpoints_answers_tcp_with_a_reset_and_udp_with_port_unreachable() {
    if !privileged(
        "a_service_without_endpoints_answers_tcp_with_a_reset_and_udp_with_port_unreachable",
    ) {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = LbState::default();
    let ports = vec![
        service("10.96.0.50", 80, 6, &[], 0),
        service("10.96.0.50", 53, 17, &[], 0),
        service("fd00:96::50", 80, 6, &[], 0),
        service("fd00:96::50", 53, 17, &[], 0),
    ];
    fixture.sync_lb(&mut state, &ports).expect("sync");
    for (vip, client) in [
        ("10.96.0.50", "10.244.1.9"),
        ("fd00:96::50", "fd00:10:244:1::9"),
    ] {
        // A SYN with 5 bytes of data: the reset acknowledges SEQ + 5 + 1 and has no sequence.
        let syn = frame("tcp", client, 46000, vip, 80, "S");
        let out = from_pod(&mut fixture, &syn).expect("tc run");
        assert_eq!(
            out.action, TC_ACT_REDIRECT,
            "{vip}: the answer goes back to the pod"
        );
        let want = expected_reset(vip, client, 46000, 0, 1006, "RA");
        assert_eq!(hex(&out.output), hex(&want), "{vip}: reset for a SYN");

        // A segment with ACK: the reset takes the acknowledged number as its sequence.
        let stray = bytes_of(
            &scapy::call(&json!({
                "op": "l4", "proto": "tcp", "src": client, "dst": vip, "sport": 46001,
                "dport": 80, "flags": "A", "ack": 5555,
            }))
            .expect("scapy"),
        );
        let out = from_pod(&mut fixture, &stray).expect("tc run");
        assert_eq!(
            hex(&out.output),
            hex(&expected_reset(vip, client, 46001, 5555, 0, "R"))
        );

        // UDP: port unreachable from the service address, quoting the datagram.
        let datagram = frame("udp", client, 46002, vip, 53, "");
        let out = from_pod(&mut fixture, &datagram).expect("tc run");
        assert_eq!(out.action, TC_ACT_REDIRECT);
        let answer =
            scapy::call(&json!({"op": "icmp_error", "hex": hex(&out.output)})).expect("decode");
        let (kind, quote) = if vip.contains(':') {
            ((1, 4), hex(&datagram[14..]))
        } else {
            ((3, 3), hex(&datagram[14..14 + 28]))
        };
        assert_eq!(
            (
                answer["type"].as_u64().unwrap(),
                answer["code"].as_u64().unwrap()
            ),
            kind
        );
        assert_eq!(answer["src_ip"], vip);
        assert_eq!(answer["dst_ip"], client);
        assert_eq!(answer["dst_mac"], "0a:58:0a:f4:01:09");
        assert_eq!(answer["icmp_chksum_ok"], true, "{vip}: {answer}");
        assert!(answer.get("ip_chksum_ok").is_none_or(|v| v == true));
        assert_eq!(answer["quote"], quote, "{vip}: the datagram is quoted");
    }
    // A reset is never answered.
    let reset = frame("tcp", "10.244.1.9", 46003, "10.96.0.50", 80, "R");
    assert_eq!(from_pod(&mut fixture, &reset).unwrap().action, TC_ACT_SHOT);
    let counters = fixture.counters();
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::ServiceRejected),
        6
    );
    assert_eq!(counters.drops(DropReason::LbNoEndpoints), 1);
}

#[test]
fn a_pod_reaching_itself_through_its_service_is_masqueraded_and_answered_by_the_service() {
    if !privileged(
        "a_pod_reaching_itself_through_its_service_is_masqueraded_and_answered_by_the_service",
    ) {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = LbState::default();
    let ports = vec![
        service("10.96.0.60", 80, 6, &["10.244.1.9:8080"], 0),
        service("fd00:96::60", 80, 6, &["[fd00:10:244:1::9]:8080"], 0),
    ];
    fixture.sync_lb(&mut state, &ports).expect("sync");
    for (vip, pod, masquerade) in [
        ("10.96.0.60", "10.244.1.9", "169.254.0.5"),
        ("fd00:96::60", "fd00:10:244:1::9", "fd69::5"),
    ] {
        // The pod's only backend is itself: the source becomes OVN-Kubernetes' hairpin
        // masquerade address so the pod accepts the packet and answers through us.
        let request = frame("tcp", pod, 47000, vip, 80, "S");
        let out = from_pod(&mut fixture, &request).expect("tc run");
        assert_eq!(out.action, TC_ACT_OK);
        let want = frame("tcp", masquerade, 47000, pod, 8080, "S");
        assert_eq!(hex(&out.output), hex(&want), "{vip}: DNAT and masquerade");
        assert!(checksums_ok(&out.output));
        // Its answer to the masquerade address goes back to the pod, from the service.
        let answer = frame("tcp", pod, 8080, masquerade, 47000, "SA");
        let out = from_pod(&mut fixture, &answer).expect("tc run");
        let want = frame("tcp", vip, 80, pod, 47000, "SA");
        assert_eq!(
            hex(&out.output),
            hex(&want),
            "{vip}: both addresses restored"
        );
        assert!(checksums_ok(&out.output));
        // An ICMP error the pod sends about what it received (to the masquerade address)
        // reaches it about what it sent: from the service, the quoted packet its own.
        let received = frame("tcp", masquerade, 47000, pod, 8080, "S");
        let error = icmp_about(pod, masquerade, 3, 3, &received);
        let out = from_pod(&mut fixture, &error).expect("tc run");
        assert_eq!(out.action, TC_ACT_OK);
        assert_eq!(
            hex(&out.output),
            hex(&icmp_about(vip, pod, 3, 3, &request)),
            "{vip}: the error translated on both sides, every checksum as scapy's"
        );
        // Later packets of the flow are translated the same way.
        let ack = frame("tcp", pod, 47000, vip, 80, "A");
        let out = from_pod(&mut fixture, &ack).expect("tc run");
        assert_eq!(
            hex(&out.output),
            hex(&frame("tcp", masquerade, 47000, pod, 8080, "A"))
        );
    }
}

/// A TCP frame with the given Ethernet addresses, as scapy builds it.
fn tcp_frame(
    src: &str,
    sport: u16,
    dst: &str,
    dport: u16,
    flags: &str,
    src_mac: &str,
    dst_mac: &str,
) -> Vec<u8> {
    l4_frame("tcp", src, sport, dst, dport, flags, src_mac, dst_mac)
}

const XDP_PASS: u32 = 2;
const XDP_REDIRECT: u32 = 4;

/// `inner` wrapped by node a for node b as scapy builds it, with the outer source port XDP
/// derives from the flow's original key.
fn geneve_to_node_b(inner: &[u8], flow: &CtKey) -> Vec<u8> {
    use dataplane_tests::overlay_bed::{NODE_B_MAC, UNDERLAY_MAC};
    let sport = 0xC000 | (flow_hash(flow) as u16 & 0x3FFF);
    bytes_of(
        &scapy::call(&json!({
            "op": "encap", "inner": hex(inner),
            "src_mac": dataplane_tests::packets::mac_text(&UNDERLAY_MAC), "dst_mac": NODE_B_MAC,
            "src_ip": "10.99.0.1", "dst_ip": "10.99.0.2",
            "sport": sport, "dport": 6081, "vni": 1,
        }))
        .expect("scapy encap"),
    )
}

#[test]
fn node_ports_keep_the_client_address_locally_and_masquerade_to_remote_backends() {
    if !privileged("node_ports_keep_the_client_address_locally_and_masquerade_to_remote_backends") {
        return;
    }
    use dataplane_tests::overlay_bed::{LOCAL_HOST_MAC, LOCAL_POD_MAC, NODE_B_MAC, UNDERLAY_MAC};
    let mut bed = dataplane_tests::overlay_bed::bed().expect("overlay bed");
    // An external client on the underlay's subnet (this thread is in the bed's namespace).
    for (ip, mac) in [
        ("10.99.0.50", "02:00:00:00:99:50"),
        ("10.99.0.51", "02:00:00:00:99:51"),
    ] {
        let neigh = std::process::Command::new("ip")
            .args([
                "neigh",
                "add",
                ip,
                "lladdr",
                mac,
                "dev",
                "ul0",
                "nud",
                "permanent",
            ])
            .status()
            .expect("ip neigh");
        assert!(neigh.success());
    }
    let fixture = &mut bed.fixture;
    let mut state = LbState::default();
    let node_port = |port: u16, backend: &str| {
        let mut p = service("10.96.0.80", 80, 6, &[backend], 0);
        p.key.addr = dataplane_common::lb::NODEPORT_ANY_V4;
        p.key.port_be = port.to_be_bytes();
        p.key.scope = dataplane_common::lb::SCOPE_NODEPORT;
        p
    };
    // 30080: the backend is on this node (as with externalTrafficPolicy Local); 30081: on
    // node b.
    let mut udp_port = node_port(30082, "10.244.2.5:5353");
    udp_port.key.protocol = 17;
    let ports = vec![
        node_port(30080, "10.244.1.3:8080"),
        node_port(30081, "10.244.2.5:8080"),
        udp_port,
    ];
    fixture.sync_lb(&mut state, &ports).expect("sync");
    let (client_mac, node_mac) = (
        "02:00:00:00:99:50",
        dataplane_tests::packets::mac_text(&UNDERLAY_MAC),
    );
    let (pod_mac, host_mac) = (
        dataplane_tests::packets::mac_text(&LOCAL_POD_MAC),
        dataplane_tests::packets::mac_text(&LOCAL_HOST_MAC),
    );

    // Local backend: only the destination changes; the pod sees the client's own address.
    let syn = tcp_frame(
        "10.99.0.50",
        45000,
        "10.99.0.1",
        30080,
        "S",
        client_mac,
        &node_mac,
    );
    let out = fixture.run_tc(PROG_UNDERLAY_TC, &syn, 1).expect("tc run");
    assert_eq!(
        out.action,
        TC_ACT_REDIRECT,
        "{:?}",
        fixture.counters().drops
    );
    let want = tcp_frame(
        "10.99.0.50",
        45000,
        "10.244.1.3",
        8080,
        "S",
        &host_mac,
        &pod_mac,
    );
    assert_eq!(
        hex(&out.output),
        hex(&want),
        "DNAT and delivery into the pod"
    );
    // Its reply leaves from the node's address and NodePort, routed out of the underlay.
    let reply = tcp_frame(
        "10.244.1.3",
        8080,
        "10.99.0.50",
        45000,
        "SA",
        &pod_mac,
        &host_mac,
    );
    let out = from_pod(fixture, &reply).expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT);
    let want = tcp_frame(
        "10.99.0.1",
        30080,
        "10.99.0.50",
        45000,
        "SA",
        &node_mac,
        client_mac,
    );
    assert_eq!(
        hex(&out.output),
        hex(&want),
        "reverse NAT and FIB route out"
    );
    // An ICMP error the backend sends about the client's packet: from the node's address
    // about the packet the client sent, routed out to the client like the replies.
    let delivered = tcp_frame(
        "10.99.0.50",
        45000,
        "10.244.1.3",
        8080,
        "S",
        &host_mac,
        &pod_mac,
    );
    let error = icmp_about_between(
        ("10.244.1.3", &pod_mac),
        ("10.99.0.50", &host_mac),
        3,
        3,
        &delivered,
    );
    let out = from_pod(fixture, &error).expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT);
    let client_syn = tcp_frame(
        "10.99.0.50",
        45000,
        "10.99.0.1",
        30080,
        "S",
        client_mac,
        &node_mac,
    );
    let want = icmp_about_between(
        ("10.99.0.1", &node_mac),
        ("10.99.0.50", client_mac),
        3,
        3,
        &client_syn,
    );
    assert_eq!(
        hex(&out.output),
        hex(&want),
        "ICMP error from a local NodePort backend: translated, routed out"
    );
    // The flow's next packets are translated in XDP already and passed up for the stack to
    // route into the pod (its veth's tc program applies the pod's ingress policy).
    let ack = tcp_frame(
        "10.99.0.50",
        45000,
        "10.99.0.1",
        30080,
        "A",
        client_mac,
        &node_mac,
    );
    let out = fixture.run_xdp(PROG_UNDERLAY, &ack, 1).expect("xdp run");
    assert_eq!(out.action, XDP_PASS);
    let want = tcp_frame(
        "10.99.0.50",
        45000,
        "10.244.1.3",
        8080,
        "A",
        client_mac,
        &node_mac,
    );
    assert_eq!(hex(&out.output), hex(&want), "DNAT in XDP, byte-exact");
    assert!(checksums_ok(&out.output));
    // A flow's first packet is left to tc untouched: XDP creates no conntrack entry.
    let syn = tcp_frame(
        "10.99.0.50",
        45009,
        "10.99.0.1",
        30080,
        "S",
        client_mac,
        &node_mac,
    );
    let out = fixture.run_xdp(PROG_UNDERLAY, &syn, 1).expect("xdp run");
    assert_eq!((out.action, hex(&out.output)), (XDP_PASS, hex(&syn)));
    assert!(
        ct_entry(
            fixture,
            &ct_key("10.99.0.50", 45009, "10.99.0.1", 30080, 6, CT_ORIGINAL)
        )
        .is_none()
    );

    // Remote backend: the source becomes this node's address, then Geneve to node b.
    let syn = tcp_frame(
        "10.99.0.50",
        45001,
        "10.99.0.1",
        30081,
        "S",
        client_mac,
        &node_mac,
    );
    let out = fixture.run_tc(PROG_UNDERLAY_TC, &syn, 1).expect("tc run");
    assert_eq!(
        out.action,
        TC_ACT_REDIRECT,
        "{:?}",
        fixture.counters().drops
    );
    let decoded = scapy::call(&json!({"op": "decode", "hex": hex(&out.output)})).expect("decode");
    assert_eq!(decoded["dst_ip"], "10.99.0.2");
    assert_eq!(decoded["dst_mac"], NODE_B_MAC);
    // The source port: one of the ranges the agent reserves on the node (towards another
    // node's pod subnet, both), never the node's own ephemeral ports.
    let inner = scapy::unhex(decoded["inner"].as_str().expect("inner"));
    let first_port = u16::from_be_bytes([inner[34], inner[35]]);
    let masquerade_port = |port: u16| {
        (SNAT_PORT_MIN..=SNAT_PORT_MAX).contains(&port)
            || (SNAT_LOW_PORT_MIN..=SNAT_LOW_PORT_MAX).contains(&port)
    };
    assert!(masquerade_port(first_port), "masquerade port {first_port}");
    let want = tcp_frame(
        "10.99.0.1",
        first_port,
        "10.244.2.5",
        8080,
        "S",
        client_mac,
        &node_mac,
    );
    assert_eq!(hex(&inner), hex(&want), "masqueraded to the node's address");
    let original = ct_entry(
        fixture,
        &ct_key("10.99.0.50", 45001, "10.99.0.1", 30081, 6, CT_ORIGINAL),
    )
    .expect("original entry");
    assert_eq!(original.nat_port_be, first_port.to_be_bytes());
    // The backend answers the node (plainly routed on the underlay); the answer goes back to
    // the client from the NodePort.
    let reply = tcp_frame(
        "10.244.2.5",
        8080,
        "10.99.0.1",
        first_port,
        "SA",
        NODE_B_MAC,
        &node_mac,
    );
    let out = fixture.run_tc(PROG_UNDERLAY_TC, &reply, 1).expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT);
    let want = tcp_frame(
        "10.99.0.1",
        30081,
        "10.99.0.50",
        45001,
        "SA",
        &node_mac,
        client_mac,
    );
    assert_eq!(
        hex(&out.output),
        hex(&want),
        "both addresses restored, routed out"
    );
    // An ICMP error from the backend about the masqueraded packet (to the node's address)
    // reaches the client about the packet it sent, from the NodePort's address.
    let masqueraded = tcp_frame(
        "10.99.0.1",
        first_port,
        "10.244.2.5",
        8080,
        "S",
        client_mac,
        &node_mac,
    );
    let error = icmp_about_between(
        ("10.244.2.5", NODE_B_MAC),
        ("10.99.0.1", &node_mac),
        3,
        3,
        &masqueraded,
    );
    let out = fixture.run_tc(PROG_UNDERLAY_TC, &error, 1).expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT);
    let want = icmp_about_between(
        ("10.99.0.1", &node_mac),
        ("10.99.0.50", client_mac),
        3,
        3,
        &syn,
    );
    assert_eq!(
        hex(&out.output),
        hex(&want),
        "ICMP error about a masqueraded NodePort flow: both sides restored, routed out"
    );
    // The next packet takes XDP's shortcut: masqueraded the same way, wrapped in Geneve to
    // node b and redirected to the underlay, every byte as scapy builds it. The outer source
    // port follows the flow.
    let ack = tcp_frame(
        "10.99.0.50",
        45001,
        "10.99.0.1",
        30081,
        "A",
        client_mac,
        &node_mac,
    );
    let out = fixture.run_xdp(PROG_UNDERLAY, &ack, 1).expect("xdp run");
    assert_eq!(out.action, XDP_REDIRECT, "{:?}", fixture.counters().drops);
    let inner = tcp_frame(
        "10.99.0.1",
        first_port,
        "10.244.2.5",
        8080,
        "A",
        client_mac,
        &node_mac,
    );
    let flow = ct_key("10.99.0.50", 45001, "10.99.0.1", 30081, 6, CT_ORIGINAL);
    assert_eq!(
        hex(&out.output),
        hex(&geneve_to_node_b(&inner, &flow)),
        "XDP: masquerade and Geneve"
    );

    // A second client with the same source port to the same backend: its flow gets another
    // source port of the range, and each reply finds its own client.
    let other_mac = "02:00:00:00:99:51";
    let syn = tcp_frame(
        "10.99.0.51",
        45001,
        "10.99.0.1",
        30081,
        "S",
        other_mac,
        &node_mac,
    );
    let out = fixture.run_tc(PROG_UNDERLAY_TC, &syn, 1).expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT);
    let decoded = scapy::call(&json!({"op": "decode", "hex": hex(&out.output)})).expect("decode");
    let inner = scapy::unhex(decoded["inner"].as_str().expect("inner"));
    let port = u16::from_be_bytes([inner[34], inner[35]]);
    assert!(
        masquerade_port(port) && port != first_port,
        "masquerade port {port}"
    );
    let want = tcp_frame(
        "10.99.0.1",
        port,
        "10.244.2.5",
        8080,
        "S",
        other_mac,
        &node_mac,
    );
    assert_eq!(hex(&inner), hex(&want));
    let reply = tcp_frame(
        "10.244.2.5",
        8080,
        "10.99.0.1",
        port,
        "SA",
        NODE_B_MAC,
        &node_mac,
    );
    let out = fixture.run_tc(PROG_UNDERLAY_TC, &reply, 1).expect("tc run");
    let want = tcp_frame(
        "10.99.0.1",
        30081,
        "10.99.0.51",
        45001,
        "SA",
        &node_mac,
        other_mac,
    );
    assert_eq!(hex(&out.output), hex(&want), "the second client's reply");
    let reply = tcp_frame(
        "10.244.2.5",
        8080,
        "10.99.0.1",
        first_port,
        "A",
        NODE_B_MAC,
        &node_mac,
    );
    let out = fixture.run_tc(PROG_UNDERLAY_TC, &reply, 1).expect("tc run");
    let want = tcp_frame(
        "10.99.0.1",
        30081,
        "10.99.0.50",
        45001,
        "A",
        &node_mac,
        client_mac,
    );
    assert_eq!(
        hex(&out.output),
        hex(&want),
        "the first client's flow is untouched"
    );
    // Every masquerade port towards this backend held by a live flow: a new connection finds
    // none free and is dropped, counted.
    let syn_from = |port: u16| {
        tcp_frame(
            "10.99.0.50",
            port,
            "10.99.0.1",
            30081,
            "S",
            client_mac,
            &node_mac,
        )
    };
    let syns: Vec<Vec<u8>> = (45002..=45005).map(syn_from).collect();
    // The backend's ACK to the first client, as sent above.
    let refresh = reply;
    let reply_key = |port: u16| ct_key("10.244.2.5", 8080, "10.99.0.1", port, 6, CT_REPLY);
    // The first flow's reply entry, its clock refreshed by a packet just now: the live flow
    // every port is filled with (the fill and the runs after it take well under a second).
    let live = |fixture: &mut Fixture| {
        let out = fixture
            .run_tc(PROG_UNDERLAY_TC, &refresh, 1)
            .expect("tc run");
        assert_eq!(out.action, TC_ACT_REDIRECT);
        ct_entry(fixture, &reply_key(first_port)).expect("reply entry of the first flow")
    };
    let reply_keys: Vec<CtKey> = (SNAT_LOW_PORT_MIN..=SNAT_LOW_PORT_MAX)
        .chain(SNAT_PORT_MIN..=SNAT_PORT_MAX)
        .map(reply_key)
        .collect();
    let fill = |fixture: &mut Fixture, entry: CtValue| {
        let mut ct: HashMap<&mut MapData, CtKey, CtValue> =
            fixture.typed_map(LB_CT).expect("ct map");
        for key in &reply_keys {
            ct.insert(*key, entry, 0).expect("held port");
        }
    };
    let put = |fixture: &mut Fixture, key: CtKey, entry: CtValue| {
        let mut ct: HashMap<&mut MapData, CtKey, CtValue> =
            fixture.typed_map(LB_CT).expect("ct map");
        ct.insert(key, entry, 0).expect("ct entry");
    };
    // Ports are tried in turn from the index all CPUs share: set to 0, the next one tried is
    // the first of the high range.
    let next_index = |fixture: &mut Fixture, index: Option<u64>| -> u64 {
        let mut next: Array<&mut MapData, u64> =
            fixture.typed_map(LB_SNAT_NEXT).expect("next port map");
        if let Some(index) = index {
            next.set(0, index, 0).expect("next port index");
        }
        next.get(&0, 0).expect("next port index")
    };
    let masqueraded_port = |out: &RunOutcome| {
        let decoded =
            scapy::call(&json!({"op": "decode", "hex": hex(&out.output)})).expect("decode");
        let inner = scapy::unhex(decoded["inner"].as_str().expect("inner"));
        u16::from_be_bytes([inner[34], inner[35]])
    };
    let held = live(fixture);
    fill(fixture, held);
    let before = next_index(fixture, None);
    let out = fixture
        .run_tc(PROG_UNDERLAY_TC, &syns[0], 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_SHOT, "no port free");
    assert_eq!(
        fixture.counters().drops(DropReason::LbSnatPortsExhausted),
        1
    );
    assert_eq!(
        next_index(fixture, None) - before,
        16,
        "sixteen ports tried, in turn"
    );

    // A flow that has ended at both ends, both directions idle for two clock seconds, gives
    // its port to a new flow at once (a closing flow otherwise keeps it 10 s, which at a few
    // thousand connections a second is more ports than there are): a FIN each way, or an RST
    // either way. One FIN alone is a half-close, and the flow keeps its port. The flow's
    // original direction is found from what its reply entry restores (client and service).
    let holder = |client_port: u16| {
        ct_key(
            "10.99.0.60",
            client_port,
            "10.99.0.1",
            30081,
            6,
            CT_ORIGINAL,
        )
    };
    // A flow of client 10.99.0.60 from `client_port` on masquerade port `port`, both of its
    // entries idle for two clock seconds, with these flags added to each direction's entry.
    let ended_flow = |fixture: &mut Fixture, port: u16, client_port: u16, flags: (u8, u8)| {
        let held = live(fixture);
        fill(fixture, held);
        let key = holder(client_port);
        let idle = held.last_seen - 2;
        let reply = CtValue {
            flags: held.flags | flags.0,
            last_seen: idle,
            nat_addr: key.src,
            nat_port_be: client_port.to_be_bytes(),
            ..held
        };
        put(fixture, reply_key(port), reply);
        let holder_original = CtValue {
            flags: original.flags | flags.1,
            last_seen: idle,
            nat_port_be: port.to_be_bytes(),
            ..original
        };
        put(fixture, key, holder_original);
    };
    // Half-closed (the backend's FIN only): kept.
    ended_flow(fixture, SNAT_PORT_MIN, 47000, (CT_CLOSING, 0));
    next_index(fixture, Some(0));
    let out = fixture
        .run_tc(PROG_UNDERLAY_TC, &syns[1], 1)
        .expect("tc run");
    assert_eq!(out.action, TC_ACT_SHOT, "a half-closed flow keeps its port");
    assert_eq!(
        fixture.counters().drops(DropReason::LbSnatPortsExhausted),
        2
    );
    // A FIN each way: taken over.
    ended_flow(fixture, SNAT_PORT_MIN, 47000, (CT_CLOSING, CT_CLOSING));
    next_index(fixture, Some(0));
    let closed = fixture
        .run_tc(PROG_UNDERLAY_TC, &syns[1], 1)
        .expect("tc run");
    // Reset by its client (the backend sends nothing after an RST): taken over.
    ended_flow(
        fixture,
        SNAT_PORT_MIN + 1,
        47001,
        (0, CT_CLOSING | CT_RESET),
    );
    assert_eq!(next_index(fixture, None), 1, "the port after the one taken");
    let reset = fixture
        .run_tc(PROG_UNDERLAY_TC, &syns[2], 1)
        .expect("tc run");
    for (out, port, client_port) in [
        (closed, SNAT_PORT_MIN, 45003u16),
        (reset, SNAT_PORT_MIN + 1, 45004),
    ] {
        assert_eq!(
            out.action,
            TC_ACT_REDIRECT,
            "{:?}",
            fixture.counters().drops
        );
        assert_eq!(masqueraded_port(&out), port);
        let taken = ct_entry(fixture, &reply_key(port)).expect("reply entry");
        assert_eq!(
            (taken.flags & (CT_CLOSING | CT_RESET), taken.nat_port_be),
            (0, client_port.to_be_bytes()),
            "a fresh entry for the new connection"
        );
    }
    // Closing flows, whatever the other direction did, give their ports up 10 s after their
    // last packet, rather than waiting for the map to evict them (short connections used to
    // keep their ports for good).
    let held = live(fixture);
    fill(
        fixture,
        CtValue {
            flags: held.flags | CT_CLOSING,
            last_seen: held.last_seen - 11,
            ..held
        },
    );
    let out = fixture
        .run_tc(PROG_UNDERLAY_TC, &syns[3], 1)
        .expect("tc run");
    assert_eq!(
        out.action,
        TC_ACT_REDIRECT,
        "{:?}",
        fixture.counters().drops
    );
    let taken_port = masqueraded_port(&out);
    assert!(masquerade_port(taken_port), "masquerade port {taken_port}");
    let taken = ct_entry(fixture, &reply_key(taken_port)).expect("reply entry");
    assert_eq!(
        (taken.flags & CT_CLOSING, taken.nat_port_be),
        (0, 45005u16.to_be_bytes()),
        "a fresh entry for the new connection"
    );

    // UDP: the first datagram through tc, the next through XDP, whose checksum update
    // scapy checks (and an IPv4 datagram without a checksum keeps none).
    let udp = |src: &str, sport: u16, dst: &str, dport: u16, payload: &str| {
        bytes_of(
            &scapy::call(&json!({
                "op": "l4", "proto": "udp", "src": src, "dst": dst, "sport": sport,
                "dport": dport, "src_mac": client_mac, "dst_mac": &node_mac, "payload": payload,
            }))
            .expect("scapy l4"),
        )
    };
    let first = udp("10.99.0.50", 46000, "10.99.0.1", 30082, "6669727374");
    let out = fixture.run_tc(PROG_UNDERLAY_TC, &first, 1).expect("tc run");
    assert_eq!(out.action, TC_ACT_REDIRECT);
    let decoded = scapy::call(&json!({"op": "decode", "hex": hex(&out.output)})).expect("decode");
    let inner = scapy::unhex(decoded["inner"].as_str().expect("inner"));
    let udp_port = u16::from_be_bytes([inner[34], inner[35]]);
    let flow = ct_key("10.99.0.50", 46000, "10.99.0.1", 30082, 17, CT_ORIGINAL);
    for payload in ["7365636f6e64", "74686972642d6c6f6e676572"] {
        let next = udp("10.99.0.50", 46000, "10.99.0.1", 30082, payload);
        let out = fixture.run_xdp(PROG_UNDERLAY, &next, 1).expect("xdp run");
        assert_eq!(out.action, XDP_REDIRECT);
        let inner = udp("10.99.0.1", udp_port, "10.244.2.5", 5353, payload);
        assert_eq!(
            hex(&out.output),
            hex(&geneve_to_node_b(&inner, &flow)),
            "XDP UDP"
        );
    }
    let mut unchecked = udp("10.99.0.50", 46000, "10.99.0.1", 30082, "6e6f6e65");
    unchecked[40..42].copy_from_slice(&[0, 0]);
    let out = fixture
        .run_xdp(PROG_UNDERLAY, &unchecked, 1)
        .expect("xdp run");
    assert_eq!(out.action, XDP_REDIRECT);
    let mut inner = udp("10.99.0.1", udp_port, "10.244.2.5", 5353, "6e6f6e65");
    inner[40..42].copy_from_slice(&[0, 0]);
    assert_eq!(
        hex(&out.output),
        hex(&geneve_to_node_b(&inner, &flow)),
        "no UDP checksum stays none"
    );

    let counters = fixture.counters();
    assert_eq!(
        counters.packets(Hook::Underlay, PacketClass::ServiceDnat),
        5,
        "XDP: one local, four remote"
    );
    assert_eq!(
        counters.packets(Hook::Underlay, PacketClass::GeneveEncap),
        4
    );
    assert_eq!(
        counters.packets(Hook::UnderlayTc, PacketClass::ServiceDnat),
        7,
        "one local, three remote, three over ended flows' ports"
    );
    assert_eq!(
        counters.packets(Hook::UnderlayTc, PacketClass::ServiceReverseNat),
        9,
        "three replies, an ICMP error and the first flow's five refreshes"
    );
    assert_eq!(
        counters.packets(Hook::UnderlayTc, PacketClass::GeneveEncap),
        6
    );
    assert_eq!(
        counters.packets(Hook::UnderlayTc, PacketClass::LocalRedirect),
        1
    );
}

/// A frame of `proto` ("tcp" with `flags`, or "udp") between the given MACs, as scapy builds it.
#[expect(
    clippy::too_many_arguments,
    reason = "a frame's fields, named at each call"
)]
fn l4_frame(
    proto: &str,
    src: &str,
    sport: u16,
    dst: &str,
    dport: u16,
    flags: &str,
    src_mac: &str,
    dst_mac: &str,
) -> Vec<u8> {
    bytes_of(
        &scapy::call(&json!({
            "op": "l4", "proto": proto, "src": src, "dst": dst, "sport": sport, "dport": dport,
            "flags": flags, "src_mac": src_mac, "dst_mac": dst_mac,
        }))
        .expect("scapy l4"),
    )
}

/// Waits until early in a second, after second `after`, and returns it (`CLOCK_MONOTONIC`):
/// early in the programs' second too, which counts jiffies since boot and so begins at another
/// moment of each monotonic second (drifting apart over the uptime). Both clocks then have at
/// least 350 ms before their next second begins, for a timed sequence to run within one second
/// of each.
fn early_in_a_second(after: u32) -> u32 {
    // Fractions of a second both clocks may be at: longer than half a second, so the two
    // always overlap (by at least 240 ms), whatever the offset between them.
    const EARLY: std::ops::Range<f64> = 0.03..0.65;
    let offset = program_second_offset();
    loop {
        let now = monotonic();
        let monotonic_fraction = now.fract();
        let program_fraction = (monotonic_fraction - offset).rem_euclid(1.0);
        if now as u32 > after
            && EARLY.contains(&monotonic_fraction)
            && EARLY.contains(&program_fraction)
        {
            return now as u32;
        }
        sleep(Duration::from_millis(20));
    }
}

/// `CLOCK_MONOTONIC` in seconds.
fn monotonic() -> f64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    assert_eq!(
        // SAFETY: a valid clock id and a valid out pointer.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) },
        0
    );
    now.tv_sec as f64 + now.tv_nsec as f64 / 1e9
}

/// Where in each monotonic second the programs' seconds begin (a fraction): they count
/// jiffies since boot when the loader knows the tick rate (`clock.rs`), read here from
/// /proc/timer_list beside the monotonic clock; 0 when they read the monotonic clock.
fn program_second_offset() -> f64 {
    let Some(hz) = dataplane_user::kernel::preflight::kernel_tick_hz().map(u64::from) else {
        return 0.0;
    };
    let before = monotonic();
    let text = std::fs::read_to_string("/proc/timer_list").expect("/proc/timer_list");
    let after = monotonic();
    let jiffies: u64 = text
        .lines()
        .find_map(|line| line.trim().strip_prefix("jiffies: "))
        .and_then(|value| value.trim().parse().ok())
        .expect("jiffies in /proc/timer_list");
    let ticks = jiffies.wrapping_sub(dataplane_common::lb::jiffies_at_boot(hz));
    let program_fraction = (ticks % hz) as f64 / hz as f64;
    let monotonic_fraction = ((before + after) / 2.0).fract();
    (monotonic_fraction - program_fraction).rem_euclid(1.0)
}

#[test]
fn established_flows_replay_from_the_flow_cache_until_what_they_depend_on_changes() {
    if !privileged("established_flows_replay_from_the_flow_cache_until_what_they_depend_on_changes")
    {
        return;
    }
    use dataplane_tests::overlay_bed::{LOCAL_HOST_MAC, LOCAL_POD_MAC};
    use dataplane_tests::packets::mac_text;
    use dataplane_user::{model::LocalPodView, overlay::compile};
    const TC_ACT_REDIRECT: u32 = 7;
    // The cache is per CPU, as a flow's packets mostly are: every test run on one CPU.
    dataplane_tests::fixture::pin_to_one_cpu();
    let mut bed = dataplane_tests::overlay_bed::bed().expect("overlay bed");
    // The client is a pod of this node too, behind a veth of its own: each side's frames are
    // run on its pod's device, as port security and the cache's sender check expect.
    let client_ifindex = bed.add_pod_veth("vp9", "pod9").expect("client veth");
    let backend_ifindex = bed.view.local_pods[0].host_ifindex;
    let client_mac = [0x0a, 0x58, 10, 244, 1, 9];
    let client_host_mac = [0x02, 0, 0, 0, 0x01, 0x09];
    // Dual-stack pods: IPv6 flows replay through the cache's general path.
    bed.view.local_pods[0]
        .addresses
        .push(ip("fd00:10:244:1::3"));
    bed.view.local_pods.push(LocalPodView {
        name: "default/client".into(),
        addresses: vec![ip("10.244.1.9"), ip("fd00:10:244:1::9")],
        pod_mac: client_mac,
        host_mac: client_host_mac,
        takes_xdp: false,
        host_ifindex: client_ifindex,
    });
    let view = bed.view.clone();
    let fixture = &mut bed.fixture;
    fixture
        .sync_overlay(&compile(&view).expect("compile"), None)
        .expect("sync overlay");
    let mut state = LbState::default();
    let ports = vec![
        service("10.96.0.10", 80, 6, &["10.244.1.3:8080"], 0),
        service("10.96.0.10", 53, 17, &["10.244.1.3:5353"], 0),
        service("fd00:10:96::10", 53, 17, &["[fd00:10:244:1::3]:5353"], 0),
    ];
    fixture.sync_lb(&mut state, &ports).expect("sync lb");
    let (client, backend_ip, vip) = ("10.244.1.9", "10.244.1.3", "10.96.0.10");
    let (pod_mac, host_mac) = (mac_text(&LOCAL_POD_MAC), mac_text(&LOCAL_HOST_MAC));
    let (client_mac, client_host_mac) = (mac_text(&client_mac), mac_text(&client_host_mac));
    let cached = |fixture: &Fixture| {
        fixture
            .counters()
            .packets(Hook::FromPod, PacketClass::ServiceFlowCached)
    };
    // Sent by a pod (to its gateway) and as delivered into the other pod, byte for byte.
    let to_service = |proto: &str, sport: u16, dport: u16, flags: &str| {
        l4_frame(
            proto,
            client,
            sport,
            vip,
            dport,
            flags,
            &client_mac,
            &client_host_mac,
        )
    };
    let at_backend = |proto: &str, sport: u16, dport: u16, flags: &str, pod_mac: &str| {
        l4_frame(
            proto, client, sport, backend_ip, dport, flags, &host_mac, pod_mac,
        )
    };
    let from_backend = |flags: &str| {
        l4_frame(
            "tcp", backend_ip, 8080, client, 41000, flags, &pod_mac, &host_mac,
        )
    };
    let at_client = |flags: &str| {
        l4_frame(
            "tcp",
            vip,
            80,
            client,
            41000,
            flags,
            &client_host_mac,
            &client_mac,
        )
    };
    // Runs a frame (timed sequences only run frames: scapy is called before and after).
    let run = |fixture: &mut Fixture, frame: &[u8]| {
        // A frame too malformed to name its source is the client's.
        let source = dataplane_tests::packets::source_of(frame).map(|(_, source)| source);
        let device = if source.is_ok_and(|s| s == ip(backend_ip) || s == ip("fd00:10:244:1::3")) {
            backend_ifindex
        } else {
            client_ifindex
        };
        let out = fixture
            .run_tc_on(PROG_FROM_POD, frame, 1, device)
            .expect("tc run");
        (out.action, out.output, cached(fixture))
    };
    let check = |(action, output, _): &(u32, Vec<u8>, u64), want: &[u8], what: &str| {
        assert_eq!(*action, TC_ACT_REDIRECT, "{what}");
        assert_eq!(hex(output), hex(want), "{what}");
        assert!(checksums_ok(output), "{what}: checksums");
    };
    let (syn, ack, udp) = (
        to_service("tcp", 41000, 80, "S"),
        to_service("tcp", 41000, 80, "A"),
        to_service("udp", 42000, 53, ""),
    );
    let (syn_ack, reply) = (from_backend("SA"), from_backend("PA"));
    let (syn_at, ack_at, udp_at) = (
        at_backend("tcp", 41000, 8080, "S", &pod_mac),
        at_backend("tcp", 41000, 8080, "A", &pod_mac),
        at_backend("udp", 42000, 5353, "", &pod_mac),
    );

    // Opening segments take the full path (and fill the cache); the rest replay it, in both
    // directions, byte for byte as the full path writes them.
    let second = early_in_a_second(0);
    let outs: Vec<_> = [&syn, &syn_ack, &ack, &reply, &udp, &udp]
        .into_iter()
        .map(|frame| run(fixture, frame))
        .collect();
    assert_eq!(
        monotonic_seconds(),
        second,
        "the sequence ran within one second"
    );
    let counts: Vec<u64> = outs.iter().map(|o| o.2).collect();
    assert_eq!(
        counts,
        [0, 0, 1, 2, 2, 3],
        "flow cache hits after each packet"
    );
    let wants = [
        &syn_at,
        &at_client("SA"),
        &ack_at,
        &at_client("PA"),
        &udp_at,
        &udp_at,
    ];
    for (n, (out, want)) in outs.iter().zip(wants).enumerate() {
        check(out, want, &format!("packet {n}"));
    }
    let counters = fixture.counters();
    assert_eq!(counters.packets(Hook::FromPod, PacketClass::ServiceDnat), 4);
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::ServiceReverseNat),
        2
    );
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::LocalRedirect),
        6
    );

    // The backend pod recreated behind another MAC: the agent moves the pods' epoch, so the
    // cached delivery is not used; the full path delivers to the new MAC and caches it.
    let new_pod_mac = [0x0a, 0x58, 10, 244, 1, 0x33];
    let mut moved = view.clone();
    moved.local_pods[0].pod_mac = new_pod_mac;
    fixture
        .sync_overlay(&compile(&moved).expect("compile"), None)
        .expect("sync overlay");
    let ack_at_moved = at_backend("tcp", 41000, 8080, "A", &mac_text(&new_pod_mac));
    let moved_at = early_in_a_second(0);
    let outs = [run(fixture, &ack), run(fixture, &ack)];
    assert_eq!(monotonic_seconds(), moved_at);
    assert_eq!(
        [outs[0].2, outs[1].2],
        [3, 4],
        "a stale epoch misses, then refills"
    );
    for out in &outs {
        check(out, &ack_at_moved, "after the move");
    }

    // Each flow's first packet of a second takes the full path, which refreshes its conntrack
    // entry's clock (a replay writes no map).
    let later = early_in_a_second(moved_at);
    let outs = [run(fixture, &ack), run(fixture, &ack)];
    assert_eq!(
        [outs[0].2, outs[1].2],
        [4, 5],
        "a new second misses, then refills"
    );
    let key = ct_key(client, 41000, vip, 80, 6, CT_ORIGINAL);
    let entry = ct_entry(fixture, &key).expect("tracked");
    assert!(
        entry.last_seen.abs_diff(later) <= 1,
        "{} vs {later}",
        entry.last_seen
    );

    // The backend removed: not replayed; the full path answers the segment with a reset.
    let mut gone = ports.clone();
    gone[0].ready = vec![backend("10.244.1.4:8080")];
    fixture.sync_lb(&mut state, &gone).expect("sync lb");
    let out = run(fixture, &ack);
    assert_eq!(out.2, 5, "a removed backend is a miss");
    assert_eq!(
        fixture
            .counters()
            .packets(Hook::FromPod, PacketClass::ServiceResetBackendGone),
        1,
        "verdict {}",
        out.0
    );

    // IPv6: the first datagram takes the full path, the next replays it, byte for byte alike.
    let (client6, backend6, vip6) = ("fd00:10:244:1::9", "fd00:10:244:1::3", "fd00:10:96::10");
    let udp6 = l4_frame(
        "udp",
        client6,
        42000,
        vip6,
        53,
        "",
        &client_mac,
        &client_host_mac,
    );
    // Delivered to the backend's MAC since its move above.
    let udp6_at = l4_frame(
        "udp",
        client6,
        42000,
        backend6,
        5353,
        "",
        &host_mac,
        &mac_text(&new_pod_mac),
    );
    let at = early_in_a_second(later);
    let outs = [run(fixture, &udp6), run(fixture, &udp6)];
    assert_eq!(monotonic_seconds(), at);
    assert_eq!([outs[0].2, outs[1].2], [5, 6], "IPv6: a miss, then a hit");
    for out in &outs {
        check(out, &udp6_at, "IPv6");
    }

    // A datagram sent without a checksum (a zero field, as raw senders and tunnels send them)
    // keeps it zero through the full path and the cache alike; the IPv4 header's is updated.
    let unsummed = |dst: &str, dport: u16, src_mac: &str, dst_mac: &str| {
        bytes_of(
            &scapy::call(&json!({
                "op": "l4", "proto": "udp", "src": client, "dst": dst, "sport": 42001,
                "dport": dport, "src_mac": src_mac, "dst_mac": dst_mac, "udp_chksum": 0,
            }))
            .expect("scapy l4"),
        )
    };
    let udp0 = unsummed(vip, 53, &client_mac, &client_host_mac);
    let udp0_at = unsummed(backend_ip, 5353, &host_mac, &mac_text(&new_pod_mac));
    let at = early_in_a_second(at);
    let outs = [run(fixture, &udp0), run(fixture, &udp0)];
    assert_eq!(monotonic_seconds(), at);
    assert_eq!(
        [outs[0].2, outs[1].2],
        [6, 7],
        "no checksum: a miss, then a hit"
    );
    for (action, output, _) in &outs {
        assert_eq!(*action, TC_ACT_REDIRECT, "no checksum");
        assert_eq!(hex(output), hex(&udp0_at), "no checksum");
        let answer = scapy::call(&json!({"op": "checksums", "hex": hex(output)})).expect("scapy");
        assert_eq!(
            answer["ip_chksum_ok"], true,
            "no checksum: the IPv4 header's"
        );
    }

    // A cached flow's packet is still checked as the parser checks it: one whose IPv4 total
    // length runs past the frame, or a TCP segment with a data offset under 5 words, is
    // dropped for its defect, not replayed.
    let mut too_long = udp0.clone();
    too_long[16..18].copy_from_slice(&0xffffu16.to_be_bytes());
    let mut short_offset = ack.clone();
    short_offset[46] = 0x40;
    let checked_at = early_in_a_second(at);
    let outs = [
        run(fixture, &udp0),
        run(fixture, &too_long),
        run(fixture, &short_offset),
    ];
    assert_eq!(monotonic_seconds(), checked_at);
    assert_eq!(
        outs[0].2, 7,
        "a new second's first datagram refills the entry"
    );
    for (what, out) in ["total length", "data offset"].iter().zip(&outs[1..]) {
        assert_eq!(out.0, TC_ACT_SHOT, "{what}: dropped");
        assert_eq!(out.2, 7, "{what}: not replayed");
    }
    let counters = fixture.counters();
    assert_eq!(counters.drops(DropReason::Ipv4BadTotalLength), 1);
    assert_eq!(counters.drops(DropReason::TcpBadDataOffset), 1);
}

#[test]
fn a_sync_that_does_not_fit_the_maps_names_the_map_and_flag_and_writes_nothing() {
    if !privileged("a_sync_that_does_not_fit_the_maps_names_the_map_and_flag_and_writes_nothing") {
        return;
    }
    // Maps made small, as `--max-backends 8 --max-service-ports 2` makes them.
    let capacities = Capacities {
        backends: 8,
        service_ports: 2,
        ..Capacities::default()
    };
    let mut fixture = Fixture::load_with(&capacities).expect("programs load");
    assert_eq!(fixture.capacities(), &capacities);
    let mut state = LbState::default();
    let web = service(
        "10.96.0.10",
        80,
        6,
        &["10.244.1.3:8080", "10.244.2.5:8080", "10.244.2.6:8080"],
        0,
    );
    fixture
        .sync_lb(&mut state, std::slice::from_ref(&web))
        .expect("sync");
    let installed = |fixture: &mut Fixture| {
        let services: HashMap<&mut MapData, ServiceKey, ServiceValue> =
            fixture.typed_map(maps::LB_SERVICES).expect("services");
        let keys: Vec<ServiceKey> = services.keys().filter_map(Result::ok).collect();
        let backends: Array<&mut MapData, Backend> =
            fixture.typed_map(maps::LB_BACKENDS).expect("backends");
        let live: Vec<Backend> = backends
            .iter()
            .filter_map(Result::ok)
            .filter(|b| b.is_live(b.id))
            .collect();
        (keys, live)
    };
    let before = installed(&mut fixture);
    assert_eq!((before.0.len(), before.1.len()), (1, 3));

    // Six more backends: nine in all, one more than the array holds.
    let backends: Vec<String> = (1..=6).map(|n| format!("10.244.3.{n}:8080")).collect();
    let backends: Vec<&str> = backends.iter().map(String::as_str).collect();
    let big = service("10.96.0.11", 80, 6, &backends, 0);
    let error = fixture
        .sync_lb(&mut state, &[web.clone(), big])
        .expect_err("more backends than the map holds")
        .to_string();
    assert!(
        error.starts_with(
            "backends: 9 needed, more than the 8 map DP_LB_BACKENDS holds; raise --max-backends"
        ),
        "{error}"
    );
    assert_eq!(installed(&mut fixture), before, "nothing written");

    // A third service port where two fit.
    let error = fixture
        .sync_lb(
            &mut state,
            &[
                web.clone(),
                service("10.96.0.12", 80, 6, &["10.244.3.1:8080"], 0),
                service("10.96.0.13", 80, 6, &["10.244.3.2:8080"], 0),
            ],
        )
        .expect_err("more service ports than the map holds")
        .to_string();
    assert!(
        error.starts_with("service ports: 3 needed, more than the 2 map DP_LB_SERVICES holds; raise --max-service-ports"),
        "{error}"
    );
    assert_eq!(installed(&mut fixture), before, "nothing written");

    // What fits still goes in, and the first service still works.
    fixture
        .sync_lb(
            &mut state,
            &[web, service("10.96.0.12", 80, 6, &["10.244.3.1:8080"], 0)],
        )
        .expect("sync within the capacity");
    assert_eq!(installed(&mut fixture).0.len(), 2);
}

/// Service ports with their backend counts, and live backends (`address:port`) with their ids.
type LbMaps = (Vec<(ServiceKey, u32)>, Vec<(String, u32)>);

/// What the load-balancer maps hold.
fn lb_maps(fixture: &mut Fixture) -> LbMaps {
    let services: HashMap<&mut MapData, ServiceKey, ServiceValue> =
        fixture.typed_map(LB_SERVICES).expect("services");
    let mut ports: Vec<(ServiceKey, u32)> = services
        .iter()
        .filter_map(Result::ok)
        .map(|(k, v)| (k, v.backends))
        .collect();
    ports.sort();
    let backends: Array<&mut MapData, Backend> =
        fixture.typed_map(maps::LB_BACKENDS).expect("backends");
    let mut live: Vec<(String, u32)> = backends
        .iter()
        .filter_map(Result::ok)
        .filter(|b| b.is_live(b.id))
        .map(|b| {
            let addr = dataplane_user::mapsync::ip_of(&b.addr);
            (format!("{addr}:{}", u16::from_be_bytes(b.port_be)), b.id)
        })
        .collect();
    live.sort();
    (ports, live)
}

#[test]
fn a_sync_writes_only_the_changed_service_ports_and_keeps_shared_backends() {
    if !privileged("a_sync_writes_only_the_changed_service_ports_and_keeps_shared_backends") {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = LbState::default();
    let web = |backends: &[&str]| service("10.96.0.10", 80, 6, backends, 0);
    let api = |backends: &[&str]| service("10.96.0.11", 443, 6, backends, 10800);
    let stats = fixture
        .sync_lb(
            &mut state,
            &[
                web(&["10.244.1.3:8080", "10.244.2.5:8080"]),
                api(&["10.244.2.5:8080"]),
            ],
        )
        .expect("sync");
    assert_eq!((stats.services, stats.backends), (2, 2));
    let (_, first) = lb_maps(&mut fixture);
    // The same ports again: nothing written.
    let stats = fixture
        .sync_lb(
            &mut state,
            &[
                web(&["10.244.1.3:8080", "10.244.2.5:8080"]),
                api(&["10.244.2.5:8080"]),
            ],
        )
        .expect("sync");
    assert_eq!((stats.written, stats.deleted), (0, 0));
    // web loses the shared backend: web's table and entry are written, the backend stays
    // (api still has it) with its id.
    let stats = fixture
        .sync_lb(
            &mut state,
            &[web(&["10.244.1.3:8080"]), api(&["10.244.2.5:8080"])],
        )
        .expect("sync");
    assert_eq!(
        (stats.written, stats.deleted),
        (2, 1),
        "web's new table and entry; its old table"
    );
    let (ports, live) = lb_maps(&mut fixture);
    assert_eq!(ports.iter().map(|p| p.1).collect::<Vec<_>>(), [1, 1]);
    assert_eq!(live, first, "both backends live, ids unchanged");
    // api goes: its entry, table and member go, and the backend nobody has any more.
    let stats = fixture
        .sync_lb(&mut state, &[web(&["10.244.1.3:8080"])])
        .expect("sync");
    assert_eq!(
        stats.deleted, 4,
        "api's entry, table, member, and 10.244.2.5"
    );
    let (ports, live) = lb_maps(&mut fixture);
    assert_eq!(ports.len(), 1);
    assert_eq!(live, [first[0].clone()]);
    let members: HashMap<&mut MapData, MemberKey, u32> =
        fixture.typed_map(LB_MEMBERS).expect("members");
    assert_eq!(members.keys().count(), 0);
    // A fresh agent's state over the same maps sweeps what no port references.
    let mut fresh = LbState::default();
    fixture.adopt_lb(&mut fresh).expect("adopt");
    let stats = fixture
        .sync_lb(&mut fresh, &[api(&["10.244.2.6:8080"])])
        .expect("sync after adoption");
    assert_eq!(stats.backends, 1);
    let (ports, live) = lb_maps(&mut fixture);
    assert_eq!(ports.len(), 1);
    assert_eq!(
        live.iter().map(|l| l.0.as_str()).collect::<Vec<_>>(),
        ["10.244.2.6:8080"],
        "web's backend swept"
    );
}

/// A sync of the service ports that changed alone (what the agent does between full syncs):
/// the changed port gets its new backend, the added one works, the removed one is gone, and a
/// full sync afterwards finds nothing to write.
#[test]
fn a_sync_of_the_changed_service_ports_alone_leaves_the_maps_as_a_full_sync_has_them() {
    if !privileged(
        "a_sync_of_the_changed_service_ports_alone_leaves_the_maps_as_a_full_sync_has_them",
    ) {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = LbState::default();
    // Before a first full sync, every port is needed.
    assert!(
        fixture
            .sync_lb_changed(&mut state, &[])
            .expect("sync")
            .is_none()
    );
    let kept = service(
        "10.96.0.20",
        80,
        6,
        &["10.244.1.3:8080", "10.244.2.5:8080"],
        0,
    );
    let moved = service("10.96.0.21", 80, 6, &["10.244.1.4:8080"], 0);
    let gone = service("10.96.0.22", 53, 17, &["10.244.2.6:53"], 0);
    fixture
        .sync_lb(&mut state, &[kept.clone(), moved.clone(), gone.clone()])
        .expect("sync");
    let moved_now = service("10.96.0.21", 80, 6, &["10.244.3.8:8080"], 0);
    // A port and a backend port no other service uses: its bits come and go with it.
    let added = service("10.96.0.23", 8443, 6, &["10.244.4.9:9443"], 0);
    let stats = fixture
        .sync_lb_changed(
            &mut state,
            &[
                (moved.key, Some(moved_now.clone())),
                (gone.key, None),
                (added.key, Some(added.clone())),
            ],
        )
        .expect("sync")
        .expect("after a full sync, the changes alone");
    assert_eq!(stats.services, 3);
    for (vip, port, want) in [
        ([10, 96, 0, 21], 80, "10.244.3.8"),
        ([10, 96, 0, 23], 8443, "10.244.4.9"),
    ] {
        let syn = tcp_v4_flow(CLIENT, 42000, vip, port, true);
        let out = from_pod(&mut fixture, &syn).expect("tc run");
        assert_eq!(IpAddr::from(destination(&out.output)), ip(want));
    }
    let services: HashMap<&mut MapData, ServiceKey, ServiceValue> =
        fixture.typed_map(LB_SERVICES).expect("map");
    assert!(services.get(&gone.key, 0).is_err(), "the removed port left");
    assert!(services.get(&kept.key, 0).is_ok());
    // The port bitmaps are those of the ports now: port 53 (UDP) and its backend's gone.
    let words = |fixture: &mut Fixture| -> Vec<u64> {
        let map: Array<&mut MapData, u64> = fixture.typed_map(maps::LB_PORTS).expect("map");
        map.iter().map(|w| w.expect("word")).collect()
    };
    let now = [kept.clone(), moved_now.clone(), added.clone()];
    assert_eq!(words(&mut fixture), port_bitmaps(now.iter()));
    // A second sync of a few, from the bit counts and words the first one left: the UDP
    // port comes back (its bits set again), the added port goes (its bits cleared).
    fixture
        .sync_lb_changed(
            &mut state,
            &[(gone.key, Some(gone.clone())), (added.key, None)],
        )
        .expect("sync")
        .expect("the changes alone");
    let now = [kept, moved_now, gone];
    assert_eq!(words(&mut fixture), port_bitmaps(now.iter()));
    let full = fixture.sync_lb(&mut state, &now).expect("sync");
    assert_eq!((full.written, full.deleted), (0, 0));
}

/// The agent's batch calls on real maps: every entry written in order comes back from a
/// batch read exactly, the whole array included (its untouched slots zero), and a batch into
/// a hash map with room for fewer stops at the first that does not fit, saying how many went
/// in and why (the kernel's E2BIG, which the agent names as a full map).
#[test]
fn batch_writes_reads_and_deletes_give_back_every_entry_and_say_how_many_went() {
    if !privileged("batch_writes_reads_and_deletes_give_back_every_entry_and_say_how_many_went") {
        return;
    }
    let capacities = Capacities {
        service_ports: 3,
        ..Capacities::default()
    };
    let mut fixture = Fixture::load_with(&capacities).expect("programs load");
    let backend = |n: u32| Backend {
        addr: addr16(IpAddr::from([10, 244, (n >> 8) as u8, n as u8])),
        port_be: 8080u16.to_be_bytes(),
        family: dataplane_common::overlay::FAMILY_IPV4,
        _pad: 0,
        id: n,
    };
    // 10,000 slots, scattered over the array and more than one call's worth, in no order.
    let written: Vec<(u32, Backend)> = (0..10_000u32)
        .map(|n| ((n * 7919) % maps::DEFAULT_BACKENDS, backend(n + 1)))
        .collect();
    let map = fixture.ebpf().map(maps::LB_BACKENDS).expect("backends map");
    dataplane_user::kernel::batch::update(map, &written).expect("batch write");
    let read = dataplane_user::kernel::batch::read::<u32, Backend>(map).expect("batch read");
    assert_eq!(
        read.len(),
        maps::DEFAULT_BACKENDS as usize,
        "every slot of the array"
    );
    let mut expected = vec![Backend::default(); maps::DEFAULT_BACKENDS as usize];
    for &(slot, value) in &written {
        expected[slot as usize] = value;
    }
    for (slot, value) in &read {
        assert_eq!(value, &expected[*slot as usize], "slot {slot}");
    }
    // The same slots through aya's one-entry reads.
    let backends: Array<&mut MapData, Backend> =
        fixture.typed_map(maps::LB_BACKENDS).expect("backends");
    for &(slot, value) in written.iter().step_by(97) {
        assert_eq!(backends.get(&slot, 0).expect("slot"), value);
    }

    let key = |n: u8| ServiceKey {
        addr: addr16(IpAddr::from([10, 96, 0, n])),
        port_be: 80u16.to_be_bytes(),
        protocol: 6,
        scope: SCOPE_CLUSTER,
    };
    let value = |n: u32| ServiceValue {
        id: n,
        table: 2 * n,
        backends: 1,
        affinity_timeout: 0,
    };
    let five: Vec<(ServiceKey, ServiceValue)> =
        (1..=5u8).map(|n| (key(n), value(n.into()))).collect();
    let map = fixture.ebpf().map(LB_SERVICES).expect("services map");
    let stopped = dataplane_user::kernel::batch::update(map, &five).expect_err("two more than fit");
    assert_eq!(stopped.done, 3);
    assert!(
        dataplane_user::kernel::capacity::is_full(&stopped.source),
        "{:?}",
        stopped.source
    );
    let mut held =
        dataplane_user::kernel::batch::read::<ServiceKey, ServiceValue>(map).expect("read");
    held.sort_by_key(|(k, _)| k.addr);
    assert_eq!(held, five[..3].to_vec(), "the first three, as written");

    // Deleted in one call: the first two go, the third stays.
    dataplane_user::kernel::batch::delete::<ServiceKey, ServiceValue>(map, &[key(1), key(2)])
        .expect("batch delete");
    let held = dataplane_user::kernel::batch::read::<ServiceKey, ServiceValue>(map).expect("read");
    assert_eq!(held, vec![(key(3), value(3))]);
    // A key the map does not hold stops the batch, as a one-entry delete fails: what came
    // before it is deleted and counted.
    let stopped = dataplane_user::kernel::batch::delete::<ServiceKey, ServiceValue>(
        map,
        &[key(3), key(1), key(2)],
    )
    .expect_err("key 1 is gone");
    assert_eq!(stopped.done, 1);
    assert!(
        matches!(&stopped.source, MapError::SyscallError(e) if e.io_error.raw_os_error() == Some(libc::ENOENT)),
        "{:?}",
        stopped.source
    );
    let held = dataplane_user::kernel::batch::read::<ServiceKey, ServiceValue>(map).expect("read");
    assert!(held.is_empty(), "{held:?}");
}

#[test]
fn only_maps_this_load_created_skip_their_first_read_and_a_restart_still_sweeps() {
    if !privileged("only_maps_this_load_created_skip_their_first_read_and_a_restart_still_sweeps") {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    // Created by this load: the first read of each is spared, once.
    assert!(fixture.first_read_of_created(maps::LB_MEMBERS));
    assert!(!fixture.first_read_of_created(maps::LB_MEMBERS));
    let web = |backends: &[&str]| service("10.96.0.10", 80, 6, backends, 0);
    let mut state = LbState::default();
    let stats = fixture
        .sync_lb(&mut state, &[web(&["10.244.1.3:8080", "10.244.2.5:8080"])])
        .expect("first sync");
    assert_eq!((stats.services, stats.backends), (1, 2));
    assert!(
        !fixture.first_read_of_created(maps::LB_BACKENDS),
        "the first sync took the spared read"
    );
    // A restarted agent over the same pins finds them pinned: it reads them whole and sweeps
    // the backend its ports no longer have.
    let mut restarted =
        dataplane_user::kernel::loader::Dataplane::load(fixture.pins()).expect("reload");
    assert!(!restarted.first_read_of_created(maps::LB_BACKENDS));
    assert!(!restarted.first_read_of_created(maps::LB_MEMBERS));
    let mut fresh = LbState::default();
    restarted.adopt_lb(&mut fresh).expect("adopt");
    let stats = restarted
        .sync_lb(&mut fresh, &[web(&["10.244.1.3:8080"])])
        .expect("sync after the restart");
    assert_eq!(stats.backends, 1);
    drop(restarted);
    let (ports, live) = lb_maps(&mut fixture);
    assert_eq!(ports.len(), 1);
    assert_eq!(
        live.iter().map(|l| l.0.as_str()).collect::<Vec<_>>(),
        ["10.244.1.3:8080"],
        "10.244.2.5 swept by the restarted agent"
    );
}

/// A NodePort flow to a backend on another node: after its first packet through tc, XDP
/// translates and wraps its packets, and from the second on within a clock second replays
/// them from its per-CPU flow cache (no conntrack, pod, pod-subnet or route lookup), every
/// byte as the full path writes it. Segments that end the connection, a change of the pods
/// or nodes, and a backend that went away all take the full path again.
#[test]
fn node_port_flows_to_remote_backends_replay_from_the_xdp_flow_cache() {
    if !privileged("node_port_flows_to_remote_backends_replay_from_the_xdp_flow_cache") {
        return;
    }
    use dataplane_tests::overlay_bed::UNDERLAY_MAC;
    // The cache is per CPU: every test run on one CPU.
    dataplane_tests::fixture::pin_to_one_cpu();
    let mut bed = dataplane_tests::overlay_bed::bed().expect("overlay bed");
    let fixture = &mut bed.fixture;
    let mut state = LbState::default();
    let mut port = service("10.96.0.80", 80, 6, &["10.244.2.5:8080"], 0);
    port.key.addr = dataplane_common::lb::NODEPORT_ANY_V4;
    port.key.port_be = 30081u16.to_be_bytes();
    port.key.scope = dataplane_common::lb::SCOPE_NODEPORT;
    fixture
        .sync_lb(&mut state, std::slice::from_ref(&port))
        .expect("sync");
    let client_mac = "02:00:00:00:99:50";
    let node_mac = packets::mac_text(&UNDERLAY_MAC);
    let segment = |flags: &str| {
        tcp_frame(
            "10.99.0.50",
            45001,
            "10.99.0.1",
            30081,
            flags,
            client_mac,
            &node_mac,
        )
    };
    let out = fixture
        .run_tc(PROG_UNDERLAY_TC, &segment("S"), 1)
        .expect("tc run");
    assert_eq!(
        out.action,
        TC_ACT_REDIRECT,
        "{:?}",
        fixture.counters().drops
    );
    let decoded = scapy::call(&json!({"op": "decode", "hex": hex(&out.output)})).expect("decode");
    let inner = scapy::unhex(decoded["inner"].as_str().expect("inner"));
    let masquerade = u16::from_be_bytes([inner[34], inner[35]]);
    assert!(
        (SNAT_PORT_MIN..=SNAT_PORT_MAX).contains(&masquerade)
            || (SNAT_LOW_PORT_MIN..=SNAT_LOW_PORT_MAX).contains(&masquerade),
        "masquerade port {masquerade}"
    );
    let flow = ct_key("10.99.0.50", 45001, "10.99.0.1", 30081, 6, CT_ORIGINAL);
    let wrapped = |flags: &str| {
        let inner = tcp_frame(
            "10.99.0.1",
            masquerade,
            "10.244.2.5",
            8080,
            flags,
            client_mac,
            &node_mac,
        );
        geneve_to_node_b(&inner, &flow)
    };
    let cached = |fixture: &Fixture| {
        fixture
            .counters()
            .packets(Hook::Underlay, PacketClass::ServiceFlowCached)
    };
    let encapsulated = |fixture: &Fixture| {
        fixture
            .counters()
            .packets(Hook::Underlay, PacketClass::GeneveEncap)
    };
    // Built before the runs (each scapy call takes a while): every step runs early in a clock
    // second, so an entry filled in it is still current.
    let (ack, fin) = (segment("A"), segment("FA"));
    let (wrapped_ack, wrapped_fin) = (hex(&wrapped("A")), hex(&wrapped("FA")));
    let second = early_in_a_second(0);
    // The first XDP packet takes the full path and fills the cache; the next is replayed.
    for replays in [0, 1, 2] {
        let out = fixture.run_xdp(PROG_UNDERLAY, &ack, 1).expect("xdp run");
        assert_eq!(out.action, XDP_REDIRECT, "{:?}", fixture.counters().drops);
        assert_eq!(hex(&out.output), wrapped_ack, "every byte as the full path");
        assert_eq!(cached(fixture), replays);
    }
    assert_eq!(encapsulated(fixture), 3);
    // A segment that ends the connection is tracked by the full path, not replayed.
    let out = fixture.run_xdp(PROG_UNDERLAY, &fin, 1).expect("xdp run");
    assert_eq!(out.action, XDP_REDIRECT);
    assert_eq!(hex(&out.output), wrapped_fin);
    assert_eq!(cached(fixture), 2);
    let entry = ct_entry(fixture, &flow).expect("conntrack entry");
    assert_ne!(entry.flags & CT_CLOSING, 0, "the FIN was tracked");
    // A change of the nodes (a node added) moves the epoch: the next packet takes the full
    // path again and refills, the one after is replayed.
    early_in_a_second(second);
    let out = fixture.run_xdp(PROG_UNDERLAY, &ack, 1).expect("xdp run");
    assert_eq!(hex(&out.output), wrapped_ack);
    assert_eq!(
        cached(fixture),
        2,
        "a new clock second: the full path again"
    );
    let mut nodes: Vec<_> = bed.view.nodes.iter().cloned().collect();
    nodes.push(std::sync::Arc::new(dataplane_user::model::NodeView {
        created: i64::MAX,
        name: "d".into(),
        addresses: vec![ip("10.99.0.4")],
        pod_cidrs: vec!["10.244.4.0/24".parse().expect("cidr")],
    }));
    bed.view.nodes = std::sync::Arc::new(nodes.into());
    let before = bed.fixture.pods_epoch().expect("epoch");
    bed.fixture
        .sync_overlay(
            &dataplane_user::overlay::compile(&bed.view).expect("compile"),
            None,
        )
        .expect("sync overlay");
    let fixture = &mut bed.fixture;
    assert_eq!(fixture.pods_epoch().expect("epoch"), before.wrapping_add(1));
    for replays in [2, 3] {
        let out = fixture.run_xdp(PROG_UNDERLAY, &ack, 1).expect("xdp run");
        assert_eq!(hex(&out.output), wrapped_ack);
        assert_eq!(cached(fixture), replays);
    }
    // The backend went away: nothing is replayed to it; the packet goes up untouched (tc
    // answers it).
    let mut gone = port.clone();
    gone.ready.clear();
    fixture
        .sync_lb(&mut state, std::slice::from_ref(&gone))
        .expect("sync");
    let out = fixture.run_xdp(PROG_UNDERLAY, &ack, 1).expect("xdp run");
    assert_eq!(out.action, XDP_PASS);
    assert_eq!(out.output, ack, "untouched");
    assert_eq!(cached(fixture), 3);
}

/// Only a connection's opening takes a backend and conntrack entries: a TCP segment without
/// SYN (or a SYN-ACK) to a service port that no flow tracks is dropped, counted, and leaves no
/// entry; a SYN opens both directions, which live a minute until the connection gets past its
/// opening (the client's next segment), then the established timeout.
#[test]
fn only_an_opening_creates_entries_and_unestablished_flows_live_a_minute() {
    if !privileged("only_an_opening_creates_entries_and_unestablished_flows_live_a_minute") {
        return;
    }
    use dataplane_common::lb::{CT_ESTABLISHED, CT_REPLY, CT_TIMEOUT_OPENING};
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = LbState::default();
    let ports = vec![service("10.96.0.30", 80, 6, &["10.244.2.5:8080"], 0)];
    fixture.sync_lb(&mut state, &ports).expect("sync");
    let vip = [10, 96, 0, 30];
    let original = |sport| ct_key("10.244.1.9", sport, "10.96.0.30", 80, 6, CT_ORIGINAL);
    let reply = |sport| ct_key("10.244.2.5", 8080, "10.244.1.9", sport, 6, CT_REPLY);
    let before = fixture.counters();
    // An ACK, a SYN-ACK, a FIN, an RST of no tracked flow: dropped, no entry made.
    for (sport, flags) in [(42000u16, "A"), (42001, "SA"), (42002, "FA"), (42003, "R")] {
        let segment = frame("tcp", "10.244.1.9", sport, "10.96.0.30", 80, flags);
        let out = from_pod(&mut fixture, &segment).expect("tc run");
        assert_eq!(out.action, TC_ACT_SHOT, "{flags}");
        assert_eq!(ct_entry(&mut fixture, &original(sport)), None, "{flags}");
    }
    let counters = fixture.counters();
    assert_eq!(
        counters.drops(DropReason::LbNotOpening) - before.drops(DropReason::LbNotOpening),
        4
    );
    // A SYN opens the flow: both directions, neither established yet.
    let syn = tcp_v4_flow(CLIENT, 42010, vip, 80, true);
    assert_eq!(
        from_pod(&mut fixture, &syn).expect("tc run").action,
        TC_ACT_OK
    );
    let opened = ct_entry(&mut fixture, &original(42010)).expect("original entry");
    assert_eq!(opened.flags & CT_ESTABLISHED, 0);
    assert!(
        ct_entry(&mut fixture, &reply(42010)).is_some(),
        "reply entry"
    );
    // Idle past a minute without getting past its opening: gone for the next segment (which,
    // being no SYN, opens nothing).
    let mut ct: HashMap<&mut MapData, CtKey, CtValue> = fixture.typed_map(LB_CT).expect("ct");
    let mut aged = opened;
    aged.last_seen = opened.last_seen - CT_TIMEOUT_OPENING - 1;
    ct.insert(original(42010), aged, 0).expect("age the entry");
    let ack = tcp_v4_flow(CLIENT, 42010, vip, 80, false);
    assert_eq!(
        from_pod(&mut fixture, &ack).expect("tc run").action,
        TC_ACT_SHOT
    );
    // A flow whose client got past the opening is established, and lives past the minute.
    let syn = tcp_v4_flow(CLIENT, 42011, vip, 80, true);
    assert_eq!(
        from_pod(&mut fixture, &syn).expect("tc run").action,
        TC_ACT_OK
    );
    let ack = tcp_v4_flow(CLIENT, 42011, vip, 80, false);
    assert_eq!(
        from_pod(&mut fixture, &ack).expect("tc run").action,
        TC_ACT_OK
    );
    let established = ct_entry(&mut fixture, &original(42011)).expect("entry");
    assert_eq!(established.flags & CT_ESTABLISHED, CT_ESTABLISHED);
    let mut ct: HashMap<&mut MapData, CtKey, CtValue> = fixture.typed_map(LB_CT).expect("ct");
    let mut aged = established;
    aged.last_seen = established.last_seen - CT_TIMEOUT_OPENING - 1;
    ct.insert(original(42011), aged, 0).expect("age the entry");
    let out = from_pod(&mut fixture, &ack).expect("tc run");
    assert_eq!(
        out.action, TC_ACT_OK,
        "an established flow outlives the minute"
    );
    assert_eq!(IpAddr::from(destination(&out.output)), ip("10.244.2.5"));
    // UDP needs no opening: any datagram opens its flow.
    let udp_ports = vec![
        service("10.96.0.30", 80, 6, &["10.244.2.5:8080"], 0),
        service("10.96.0.30", 53, 17, &["10.244.2.5:5353"], 0),
    ];
    fixture.sync_lb(&mut state, &udp_ports).expect("sync");
    let datagram = frame("udp", "10.244.1.9", 42020, "10.96.0.30", 53, "");
    assert_eq!(
        from_pod(&mut fixture, &datagram).expect("tc run").action,
        TC_ACT_OK
    );
    // Each service flow a pod opened is counted against it (its veth), as are its drops.
    let pods = dataplane_user::cli::inspect::read(
        fixture.pins(),
        dataplane_user::cli::inspect::Table::Pods,
        &Default::default(),
    )
    .expect("inspect pods");
    assert_eq!(pods.rows.len(), 1, "{:?}", pods.rows);
    let row = &pods.rows[0];
    use dataplane_user::cli::inspect::Cell;
    assert_eq!(
        row[2],
        Cell::Number(5),
        "drops: 4 strays, the ACK of the expired flow"
    );
    assert_eq!(
        row[3],
        Cell::Number(3),
        "flows opened: two SYNs and a datagram"
    );
}

/// A load-balancer address with `ranges`, as the compile gives it: the pods' key and the
/// outside's, both carrying the ranges (the kernel's entries come from the outside's).
fn load_balancer(vip: &str, backends: &[&str], ranges: &[&str]) -> Vec<ServicePort> {
    let mut pods = service(vip, 443, 6, backends, 0);
    pods.kind = dataplane_user::lb::AddressKind::External;
    pods.source_ranges = ranges.iter().map(|r| r.parse().expect("range")).collect();
    let mut outside = pods.clone();
    outside.key.scope = dataplane_common::lb::SCOPE_EXTERNAL;
    vec![pods, outside]
}

/// `LB_SOURCE_RANGES` as the kernel holds it: (prefix length, key bytes) -> verdict.
fn source_range_entries(fixture: &mut Fixture) -> dataplane_user::lb::RangeEntries {
    let map: aya::maps::lpm_trie::LpmTrie<
        &mut MapData,
        [u8; dataplane_user::lb::RANGE_KEY_LEN],
        u8,
    > = fixture
        .typed_map(maps::LB_SOURCE_RANGES)
        .expect("source ranges map");
    map.keys()
        .map(|k| {
            let k = k.expect("key");
            let verdict = map.get(&k, 0).expect("value");
            ((k.prefix_len(), k.data()), verdict)
        })
        .collect()
}

#[test]
fn load_balancer_source_ranges_admit_new_flows_from_their_ranges_alone() {
    if !privileged("load_balancer_source_ranges_admit_new_flows_from_their_ranges_alone") {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = LbState::default();
    let (vip, vip6, cluster_ip) = ("192.0.2.30", "2001:db8:30::30", "10.96.0.30");
    let backends = ["10.244.3.7:8443"];
    let backends6 = ["[fd00:10:244:3::7]:8443"];
    let with_ranges = |v4: &[&str], v6: &[&str]| {
        let mut ports = load_balancer(vip, &backends, v4);
        ports.extend(load_balancer(vip6, &backends6, v6));
        ports.push(service(cluster_ip, 443, 6, &backends, 0));
        ports
    };
    let ports = with_ranges(&["10.244.1.0/24"], &["fd00:10:244:1::/64"]);
    fixture.sync_lb(&mut state, &ports).expect("sync");
    // The map: per address, a deny of every source and an allow of the range, and nothing
    // for the cluster IP.
    let expected = |v4: &[&str], v6: &[&str]| {
        let keys: std::collections::BTreeMap<ServiceKey, Vec<ipnet::IpNet>> = with_ranges(v4, v6)
            .iter()
            .filter(|p| p.key.scope == dataplane_common::lb::SCOPE_EXTERNAL)
            .filter(|p| !p.source_ranges.is_empty())
            .map(|p| (p.key, p.source_ranges.clone()))
            .collect();
        dataplane_user::lb::range_entries(&keys)
    };
    let held = source_range_entries(&mut fixture);
    assert_eq!(held, expected(&["10.244.1.0/24"], &["fd00:10:244:1::/64"]));
    assert_eq!(held.len(), 4);
    // `dataplane inspect services` shows each load-balancer address's ranges.
    let rows = dataplane_user::cli::inspect::read(
        fixture.pins(),
        dataplane_user::cli::inspect::Table::Services,
        &Default::default(),
    )
    .expect("inspect");
    let text = dataplane_user::cli::inspect::render(&rows);
    assert!(text.contains("SOURCE_RANGES"), "{text}");
    let line = |address: &str| {
        text.lines()
            .filter(|l| l.starts_with(address))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    // The ranges, then the path pods' flows take: per packet (no socket-level programs are
    // attached here) to the address reached from pods, none from outside.
    for row in line("192.0.2.30:443") {
        assert!(row.contains(" 10.244.1.0/24 "), "{row}");
        let path = if row.contains(" cluster ") {
            "per packet"
        } else {
            "-"
        };
        assert!(row.trim_end().ends_with(path), "{row}");
    }
    for row in line("[2001:db8:30::30]:443") {
        assert!(row.contains(" fd00:10:244:1::/64 "), "{row}");
    }
    assert_eq!(line("192.0.2.30:443").len(), 2, "{text}");
    assert!(!line("10.96.0.30:443")[0].contains("10.244.1.0/24"));

    let syn_from = |fixture: &mut Fixture, client: &str, sport: u16, to: &str| {
        from_pod(fixture, &frame("tcp", client, sport, to, 443, "S")).expect("tc run")
    };
    let backend_v4: [u8; 4] = [10, 244, 3, 7];
    // Inside the range: translated to the backend, both families.
    let out = syn_from(&mut fixture, "10.244.1.9", 47000, vip);
    assert_eq!(
        (out.action, destination(&out.output)),
        (TC_ACT_OK, backend_v4)
    );
    assert!(checksums_ok(&out.output));
    let out = syn_from(&mut fixture, "fd00:10:244:1::9", 47000, vip6);
    assert_eq!(out.action, TC_ACT_OK);
    assert_eq!(&out.output[38..54], &addr16(ip("fd00:10:244:3::7"))[..]);
    // Outside the range: dropped, counted, and no entry made; the cluster IP of the same
    // backends is not subject to the ranges.
    for (client, to) in [("10.244.2.9", vip), ("fd00:10:244:2::9", vip6)] {
        let out = syn_from(&mut fixture, client, 47001, to);
        assert_eq!(out.action, TC_ACT_SHOT, "{client} -> {to}");
        let key = ct_key(client, 47001, to, 443, 6, CT_ORIGINAL);
        assert!(ct_entry(&mut fixture, &key).is_none(), "{client}: no flow");
    }
    assert_eq!(fixture.counters().drops(DropReason::LbSourceRange), 2);
    let out = syn_from(&mut fixture, "10.244.2.9", 47002, cluster_ip);
    assert_eq!(
        (out.action, destination(&out.output)),
        (TC_ACT_OK, backend_v4)
    );

    // The ranges change on the live Service: the established flow keeps going; new flows
    // follow the new ranges.
    let ports = with_ranges(&["10.244.2.0/24"], &["fd00:10:244:1::/64"]);
    fixture.sync_lb(&mut state, &ports).expect("sync");
    assert_eq!(
        source_range_entries(&mut fixture),
        expected(&["10.244.2.0/24"], &["fd00:10:244:1::/64"])
    );
    let ack = frame("tcp", "10.244.1.9", 47000, vip, 443, "A");
    let out = from_pod(&mut fixture, &ack).expect("tc run");
    assert_eq!(
        (out.action, destination(&out.output)),
        (TC_ACT_OK, backend_v4)
    );
    let out = syn_from(&mut fixture, "10.244.1.9", 47003, vip);
    assert_eq!(out.action, TC_ACT_SHOT);
    let out = syn_from(&mut fixture, "10.244.2.9", 47004, vip);
    assert_eq!(
        (out.action, destination(&out.output)),
        (TC_ACT_OK, backend_v4)
    );
    assert_eq!(fixture.counters().drops(DropReason::LbSourceRange), 3);

    // Without ranges, every source; the map is empty again, through the changed-ports sync too.
    let ports = with_ranges(&[], &[]);
    let changed: Vec<(ServiceKey, Option<ServicePort>)> =
        ports.iter().map(|p| (p.key, Some(p.clone()))).collect();
    fixture
        .sync_lb_changed(&mut state, &changed)
        .expect("sync changed")
        .expect("the state allows a sync of the changed ports");
    assert!(source_range_entries(&mut fixture).is_empty());
    let out = syn_from(&mut fixture, "10.244.1.9", 47005, vip);
    assert_eq!(
        (out.action, destination(&out.output)),
        (TC_ACT_OK, backend_v4)
    );
    // And back, through the changed-ports sync.
    let ports = with_ranges(&["10.244.1.0/24"], &[]);
    let changed: Vec<(ServiceKey, Option<ServicePort>)> =
        ports.iter().map(|p| (p.key, Some(p.clone()))).collect();
    fixture
        .sync_lb_changed(&mut state, &changed)
        .expect("sync changed")
        .expect("changed-ports sync");
    assert_eq!(
        source_range_entries(&mut fixture),
        expected(&["10.244.1.0/24"], &[])
    );
    let out = syn_from(&mut fixture, "10.244.2.9", 47006, vip);
    assert_eq!(out.action, TC_ACT_SHOT);
    // The Service goes: its entries go with it.
    let ports = vec![service(cluster_ip, 443, 6, &backends, 0)];
    fixture.sync_lb(&mut state, &ports).expect("sync");
    assert!(source_range_entries(&mut fixture).is_empty());
}
