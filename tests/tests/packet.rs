//! Packet tests through the real, verified kernel programs with BPF_PROG_TEST_RUN.
//! Each case: PKTGEN (build the frame), SETUP (fresh maps from a new fixture), CHECK (verdict,
//! every output byte, and exactly which counters moved).

use dataplane_common::{
    DropReason, Hook, PacketClass,
    maps::{ALL_MAPS, ALL_PROGRAMS, PROG_FROM_POD, PROG_UNDERLAY},
    testbed::TESTBED_PROGRAMS,
};
use dataplane_tests::{
    fixture::Fixture,
    fuzz::XorShift,
    packets::{self, Ext, L3},
    privileged::privileged,
    testbed::Testbed,
};

const XDP_ABORTED: u32 = 0;
const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;

/// Runs `frame` through both attach points and checks it passes unchanged as `class`.
fn assert_passes(fixture: &mut Fixture, name: &str, frame: &[u8], class: PacketClass) {
    let xdp = fixture
        .run_xdp(PROG_UNDERLAY, frame, 1)
        .expect("xdp test run");
    assert_eq!(xdp.action, XDP_PASS, "{name}: underlay verdict");
    assert_eq!(xdp.output, frame, "{name}: underlay must not change a byte");
    let tc = fixture
        .run_tc(PROG_FROM_POD, frame, 1)
        .expect("tc test run");
    assert_eq!(tc.action, TC_ACT_OK, "{name}: from-pod verdict");
    assert_eq!(tc.output, frame, "{name}: from-pod must not change a byte");

    let counters = fixture.counters();
    for hook in [Hook::Underlay, Hook::FromPod] {
        assert_eq!(
            counters.packets(hook, PacketClass::Total),
            1,
            "{name}: {hook:?} total"
        );
        assert_eq!(
            counters.packets(hook, class),
            1,
            "{name}: {hook:?} {class:?}"
        );
        assert_eq!(
            counters.packets(hook, PacketClass::Dropped),
            0,
            "{name}: {hook:?} dropped"
        );
    }
    assert!(
        counters.drops.is_empty(),
        "{name}: no drop expected, got {:?}",
        counters.drops
    );
}

/// Runs `frame` through both attach points and checks it is dropped for `reason` (and that
/// nothing else was counted). The kernel's test run refuses frames shorter than an Ethernet
/// header before any program runs, so `EthTruncated` cannot be exercised here.
fn assert_dropped(fixture: &mut Fixture, name: &str, frame: &[u8], reason: DropReason) {
    let xdp = fixture
        .run_xdp(PROG_UNDERLAY, frame, 1)
        .expect("xdp test run");
    assert_ne!(
        xdp.action, XDP_ABORTED,
        "{name}: malformed input must never abort"
    );
    assert_eq!(xdp.action, XDP_DROP, "{name}: underlay verdict");
    // The kernel's skb test run refuses (EINVAL) a frame whose IPv4/IPv6 header is cut short
    // before the program runs; the topology test sends such frames from a real pod instead.
    let refused_by_test_run = matches!(
        reason,
        DropReason::Ipv4Truncated | DropReason::Ipv6Truncated
    );
    let expected = match fixture.run_tc(PROG_FROM_POD, frame, 1) {
        Ok(tc) => {
            assert!(
                !refused_by_test_run,
                "{name}: expected the kernel to refuse this test run"
            );
            assert_eq!(tc.action, TC_ACT_SHOT, "{name}: from-pod verdict");
            2
        }
        Err(dataplane_user::AgentError::Program {
            source: aya::programs::ProgramError::SyscallError(e),
            ..
        }) if refused_by_test_run && e.io_error.raw_os_error() == Some(libc::EINVAL) => 1,
        Err(e) => panic!("{name}: tc test run: {e:?}"),
    };
    let counters = fixture.counters();
    assert_eq!(counters.drops(reason), expected, "{name}: {reason:?} count");
    assert_eq!(
        counters.drops.len(),
        1,
        "{name}: only {reason:?}, got {:?}",
        counters.drops
    );
    assert_eq!(
        counters.packets(Hook::Underlay, PacketClass::Dropped),
        1,
        "{name}"
    );
}

/// Runs `frame`, well formed, through both attach points: the underlay passes it unchanged as
/// `class`, the pod edge refuses it (a pod sends untagged IP and ARP only).
fn assert_refused_from_pod(fixture: &mut Fixture, name: &str, frame: &[u8], class: PacketClass) {
    let xdp = fixture
        .run_xdp(PROG_UNDERLAY, frame, 1)
        .expect("xdp test run");
    assert_eq!(xdp.action, XDP_PASS, "{name}: underlay verdict");
    assert_eq!(xdp.output, frame, "{name}: underlay must not change a byte");
    let tc = fixture
        .run_tc(PROG_FROM_POD, frame, 1)
        .expect("tc test run");
    assert_eq!(tc.action, TC_ACT_SHOT, "{name}: from-pod verdict");
    let counters = fixture.counters();
    for hook in [Hook::Underlay, Hook::FromPod] {
        assert_eq!(
            counters.packets(hook, class),
            1,
            "{name}: {hook:?} {class:?}"
        );
    }
    assert_eq!(counters.drops(DropReason::PortEthertype), 1, "{name}");
    assert_eq!(counters.drops.len(), 1, "{name}: {:?}", counters.drops);
}

/// One fresh fixture per case so every counter assertion is exact.
fn each_case(cases: Vec<(&str, Vec<u8>, PacketClass)>) {
    for (name, frame, class) in cases {
        let mut fixture = Fixture::load().expect("load programs");
        assert_passes(&mut fixture, name, &frame, class);
    }
}

fn each_drop(cases: Vec<(&str, Vec<u8>, DropReason)>) {
    for (name, frame, reason) in cases {
        let mut fixture = Fixture::load().expect("load programs");
        assert_dropped(&mut fixture, name, &frame, reason);
    }
}

#[test]
fn object_has_every_shared_name() {
    if !privileged("object_has_every_shared_name") {
        return;
    }
    let fixture = Fixture::load().expect("load programs");
    for name in ALL_MAPS {
        assert!(
            fixture.ebpf().map(name).is_some(),
            "map {name} missing from the object"
        );
        assert!(fixture.pins().map(name).exists(), "map {name} not pinned");
    }
    for name in ALL_PROGRAMS {
        assert!(
            fixture.ebpf().program(name).is_some(),
            "program {name} missing"
        );
    }
    // The test bed's programs are an object of their own, never in the node's.
    let mut testbed = Testbed::load().expect("load the test bed's programs");
    for &name in TESTBED_PROGRAMS {
        assert!(
            fixture.ebpf().program(name).is_none(),
            "test-bed program {name} in the dataplane's object"
        );
        testbed
            .run_xdp(name, &packets::ipv4_tcp(), 1)
            .or_else(|_| testbed.run_tc(name, &packets::ipv4_tcp(), 1))
            .unwrap_or_else(|e| panic!("test-bed program {name}: {e}"));
    }
    for name in [PROG_UNDERLAY, PROG_FROM_POD] {
        assert!(
            fixture.pins().program(name).exists(),
            "program {name} not pinned"
        );
    }
}

#[test]
fn well_formed_packets_pass_unchanged_and_are_classified() {
    if !privileged("well_formed_packets_pass_unchanged_and_are_classified") {
        return;
    }
    let v4_udp = packets::ipv4_udp();
    let v6_udp = packets::ipv6_udp();
    let v6_tcp = packets::ipv6_tcp();
    each_case(vec![
        ("ipv4 tcp", packets::ipv4_tcp(), PacketClass::Tcp),
        ("ipv4 udp", v4_udp.clone(), PacketClass::Udp),
        (
            "ipv4 icmp echo",
            packets::ipv4_icmp_echo(),
            PacketClass::Icmp,
        ),
        ("ipv4 sctp", packets::ipv4_sctp(), PacketClass::Sctp),
        ("ipv6 tcp", v6_tcp.clone(), PacketClass::Tcp),
        ("ipv6 udp", v6_udp.clone(), PacketClass::Udp),
        ("ipv6 sctp", packets::ipv6_sctp(), PacketClass::Sctp),
        (
            "ipv6 icmpv6 echo",
            packets::ipv6_icmp_echo(),
            PacketClass::Icmpv6,
        ),
        (
            "arp request",
            packets::padded(packets::arp()),
            PacketClass::Arp,
        ),
        (
            "ipv4 options ihl=8",
            packets::with_ipv4_options(&v4_udp, 3),
            PacketClass::Udp,
        ),
        (
            "ipv4 options ihl=15",
            packets::with_ipv4_options(&v4_udp, 10),
            PacketClass::Udp,
        ),
        (
            "ipv4 first fragment",
            packets::as_ipv4_fragment(&v4_udp, 0, true),
            PacketClass::Udp,
        ),
        (
            "ipv4 padded to 60 bytes",
            packets::padded(packets::ipv4_udp_short()),
            PacketClass::Udp,
        ),
        (
            "ipv6 hop-by-hop, dest opts, routing, then tcp",
            packets::with_ipv6_extensions(
                &v6_tcp,
                &[
                    Ext::options(packets::HOP_BY_HOP, 8),
                    Ext::options(packets::DEST_OPTS, 16),
                    Ext::options(packets::ROUTING, 24),
                ],
            ),
            PacketClass::Tcp,
        ),
        (
            "ipv6 six extension headers (the bound)",
            packets::with_ipv6_extensions(&v6_udp, &[Ext::options(packets::DEST_OPTS, 8); 6]),
            PacketClass::Udp,
        ),
        (
            "ipv6 first fragment",
            packets::with_ipv6_extensions(&v6_udp, &[Ext::fragment(0)]),
            PacketClass::Udp,
        ),
        (
            "ipv4 gre (other transport)",
            packets::ipv4_with_protocol(47),
            PacketClass::OtherL4,
        ),
    ]);
}

/// `frame` as the first fragment of a datagram: a fragment header with offset 0 and the M
/// flag (more fragments) set; without M it would be an atomic fragment, a whole datagram.
fn ipv6_first_fragment(frame: &[u8]) -> Vec<u8> {
    let mut first = packets::with_ipv6_extensions(frame, &[Ext::fragment(0)]);
    // Ethernet (14) and IPv6 (40), then the fragment header: its fourth byte ends in M.
    first[14 + 40 + 3] |= 1;
    first
}

#[test]
fn a_later_fragment_passes_after_its_first_and_is_dropped_without_it() {
    if !privileged("a_later_fragment_passes_after_its_first_and_is_dropped_without_it") {
        return;
    }
    let v4_udp = packets::ipv4_udp();
    let v6_udp = packets::ipv6_udp();
    for (name, first, later) in [
        (
            "ipv4",
            packets::as_ipv4_fragment(&v4_udp, 0, true),
            packets::as_ipv4_fragment(&v4_udp, 185, false),
        ),
        (
            "ipv6",
            ipv6_first_fragment(&v6_udp),
            packets::with_ipv6_extensions(&v6_udp, &[Ext::fragment(100)]),
        ),
    ] {
        // Alone: the underlay passes it up untouched (the node's own traffic is the stack's),
        // a pod's veth drops it, for its own reason.
        let mut fixture = Fixture::load().expect("load programs");
        let xdp = fixture
            .run_xdp(PROG_UNDERLAY, &later, 1)
            .expect("xdp test run");
        assert_eq!(xdp.action, XDP_PASS, "{name}");
        assert_eq!(xdp.output, later, "{name}");
        let tc = fixture
            .run_tc(PROG_FROM_POD, &later, 1)
            .expect("tc test run");
        assert_eq!(tc.action, TC_ACT_SHOT, "{name}");
        let counters = fixture.counters();
        assert_eq!(
            counters.packets(Hook::FromPod, PacketClass::Fragment),
            1,
            "{name}"
        );
        assert_eq!(
            counters.drops(DropReason::FragmentWithoutFirst),
            1,
            "{name}"
        );
        assert_eq!(counters.drops.len(), 1, "{name}: {:?}", counters.drops);

        // After its first fragment: both pass unchanged.
        let mut fixture = Fixture::load().expect("load programs");
        for frame in [&first, &later] {
            let tc = fixture
                .run_tc(PROG_FROM_POD, frame, 1)
                .expect("tc test run");
            assert_eq!(tc.action, TC_ACT_OK, "{name}");
            assert_eq!(&tc.output, frame, "{name}: not a byte changed");
        }
        let counters = fixture.counters();
        assert_eq!(
            counters.packets(Hook::FromPod, PacketClass::Fragment),
            1,
            "{name}"
        );
        assert!(counters.drops.is_empty(), "{name}: {:?}", counters.drops);
    }
}

#[test]
fn tagged_and_non_ip_frames_pass_the_underlay_and_are_refused_from_pods() {
    if !privileged("tagged_and_non_ip_frames_pass_the_underlay_and_are_refused_from_pods") {
        return;
    }
    for (name, frame, class) in [
        (
            "lldp",
            packets::padded(packets::lldp()),
            PacketClass::OtherL2,
        ),
        (
            "802.1q ipv4 udp",
            packets::vlan_ipv4_udp(),
            PacketClass::Udp,
        ),
        (
            "802.1ad qinq ipv4 tcp",
            packets::qinq_ipv4_tcp(),
            PacketClass::Tcp,
        ),
    ] {
        let mut fixture = Fixture::load().expect("load programs");
        assert_refused_from_pod(&mut fixture, name, &frame, class);
    }
}

#[test]
fn malformed_packets_are_dropped_with_their_reason() {
    if !privileged("malformed_packets_are_dropped_with_their_reason") {
        return;
    }
    let v4_tcp = packets::ipv4_tcp();
    let v4_udp = packets::ipv4_udp();
    let v6_udp = packets::ipv6_udp();
    let v6_tcp = packets::ipv6_tcp();
    let set = |frame: &[u8], at: usize, byte: u8| {
        let mut out = frame.to_vec();
        out[at] = byte;
        out
    };
    let cut = |frame: &[u8], len: usize| frame[..len].to_vec();
    // IPv4 total length field, set to `len`.
    let total_len = |frame: &[u8], len: u16| {
        let mut out = frame.to_vec();
        out[L3 + 2..L3 + 4].copy_from_slice(&len.to_be_bytes());
        packets::fix_ipv4_checksum(&mut out, L3);
        out
    };
    let v4_l4 = L3 + 20;
    let v6_l4 = L3 + 40;

    each_drop(vec![
        (
            "vlan tag cut short",
            cut(&packets::vlan_ipv4_udp(), 16),
            DropReason::VlanTruncated,
        ),
        (
            "three vlan tags",
            packets::with_extra_vlan_tags(&packets::qinq_ipv4_tcp(), 1),
            DropReason::VlanTooDeep,
        ),
        (
            "ipv4 header cut short",
            cut(&v4_udp, L3 + 19),
            DropReason::Ipv4Truncated,
        ),
        (
            "ipv4 version 5",
            set(&v4_udp, L3, 0x55),
            DropReason::Ipv4BadVersion,
        ),
        ("ipv4 ihl 4", set(&v4_udp, L3, 0x44), DropReason::Ipv4BadIhl),
        ("ipv4 ihl 0", set(&v4_udp, L3, 0x40), DropReason::Ipv4BadIhl),
        (
            "ipv4 ihl beyond the packet",
            set(&cut(&v4_udp, L3 + 40), L3, 0x4f),
            DropReason::Ipv4OptionsTruncated,
        ),
        (
            "ipv4 total length beyond the packet",
            total_len(&v4_udp, 1500),
            DropReason::Ipv4BadTotalLength,
        ),
        (
            "ipv4 total length below ihl",
            total_len(&v4_udp, 12),
            DropReason::Ipv4BadTotalLength,
        ),
        (
            "ipv6 header cut short",
            cut(&v6_udp, L3 + 39),
            DropReason::Ipv6Truncated,
        ),
        (
            "ipv6 version 4",
            set(&v6_udp, L3, 0x40),
            DropReason::Ipv6BadVersion,
        ),
        (
            "ipv6 payload length beyond the packet",
            set(&v6_udp, L3 + 4, 0x05),
            DropReason::Ipv6BadPayloadLength,
        ),
        (
            "ipv6 extension header cut short",
            packets::ipv6_truncated_extension(),
            DropReason::Ipv6ExtTruncated,
        ),
        (
            "ipv6 seven extension headers (past the bound)",
            packets::with_ipv6_extensions(&v6_udp, &[Ext::options(packets::DEST_OPTS, 8); 7]),
            DropReason::Ipv6ExtTooDeep,
        ),
        (
            "tcp header cut short",
            packets::ipv4_truncated_l4(6, 19),
            DropReason::TcpTruncated,
        ),
        (
            "tcp data offset 4",
            set(&v4_tcp, v4_l4 + 12, 0x40),
            DropReason::TcpBadDataOffset,
        ),
        (
            "tcp data offset beyond the packet",
            set(&v4_tcp, v4_l4 + 12, 0xf0),
            DropReason::TcpBadDataOffset,
        ),
        (
            "ipv6 tcp data offset 0",
            set(&v6_tcp, v6_l4 + 12, 0x00),
            DropReason::TcpBadDataOffset,
        ),
        (
            "udp header cut short",
            packets::ipv4_truncated_l4(17, 7),
            DropReason::UdpTruncated,
        ),
        (
            "sctp header cut short",
            packets::ipv4_truncated_l4(132, 11),
            DropReason::SctpTruncated,
        ),
        (
            "icmp header cut short",
            packets::ipv4_truncated_l4(1, 7),
            DropReason::IcmpTruncated,
        ),
        (
            "icmpv6 header cut short",
            packets::ipv6_truncated_l4(58, 7),
            DropReason::Icmpv6Truncated,
        ),
        (
            "ipv6 udp header cut short",
            packets::ipv6_truncated_l4(17, 4),
            DropReason::UdpTruncated,
        ),
    ]);
}

/// Mutated and random frames: whatever the bytes, the verdict is pass or drop (never abort),
/// and every packet is counted exactly once, as passed or as dropped with a reason.
#[test]
fn fuzzed_frames_never_abort_and_are_all_accounted_for() {
    if !privileged("fuzzed_frames_never_abort_and_are_all_accounted_for") {
        return;
    }
    let mut fixture = Fixture::load().expect("load programs");
    let seeds = [
        packets::ipv4_tcp(),
        packets::ipv6_tcp(),
        packets::qinq_ipv4_tcp(),
        packets::with_ipv6_extensions(
            &packets::ipv6_udp(),
            &[Ext::options(packets::HOP_BY_HOP, 16)],
        ),
        packets::with_ipv4_options(&packets::ipv4_udp(), 4),
    ];
    let mut rng = XorShift::new(0x9e37_79b9_7f4a_7c15);
    let rounds = 3000u64;
    let (mut passed, mut dropped) = (0u64, 0u64);
    for round in 0..rounds {
        let seed = &seeds[(round as usize) % seeds.len()];
        let mut frame = seed.clone();
        // Flip a few bytes in the headers and maybe cut the frame.
        for _ in 0..1 + rng.next_u64() % 4 {
            let at = (rng.next_u64() as usize) % frame.len().min(80);
            frame[at] = rng.next_u64() as u8;
        }
        // Cut it, keeping the 14 bytes the kernel's test run requires.
        if rng.next_u64().is_multiple_of(3) {
            let len = 14 + (rng.next_u64() as usize) % (frame.len() - 14);
            frame.truncate(len);
        }
        let outcome = fixture
            .run_xdp(PROG_UNDERLAY, &frame, 1)
            .expect("xdp test run");
        match outcome.action {
            XDP_PASS => {
                assert_eq!(outcome.output, frame, "pass must not change bytes");
                passed += 1;
            }
            XDP_DROP => dropped += 1,
            other => panic!("round {round}: verdict {other} for {frame:02x?}"),
        }
    }
    let counters = fixture.counters();
    assert_eq!(counters.packets(Hook::Underlay, PacketClass::Total), rounds);
    assert_eq!(
        counters.packets(Hook::Underlay, PacketClass::Dropped),
        dropped
    );
    let drops: u64 = counters.drops.iter().map(|d| d.count).sum();
    assert_eq!(drops, dropped, "every drop has exactly one reason");
    assert!(
        passed > 0 && dropped > 0,
        "the mutations exercise both outcomes"
    );
}
