//! NetworkPolicy packet tests through the real programs with BPF_PROG_TEST_RUN: policies
//! compiled by the agent for two local pods, new flows judged at the sender's egress
//! (`tc_from_pod`) and the receiver's ingress (the same program for a local sender,
//! `tc_to_pod` for what the stack delivers), allowed flows tracked so that their replies pass,
//! verdicts, drop reasons and tracked-flow entries checked exactly.

use std::{collections::BTreeMap, net::IpAddr};

use aya::maps::{HashMap, MapData};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    acl::{AclCtKey, AclCtValue},
    maps::{ACL_CT, PROG_FROM_POD, PROG_TO_POD},
};
use dataplane_tests::{
    fixture::Fixture,
    packets::{self, tcp_v4_flow, udp_v4_flow},
    privileged::privileged,
};
use dataplane_user::{
    acl::{
        AclPod, AclState, DesiredFirewalls,
        policy::{PolicyCluster, PolicyPod, PolicyPods, policy_sets},
    },
    overlay::addr16,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;

/// x/a and x/b run on this node, y/c on another.
const A: [u8; 4] = [10, 244, 1, 9];
const B: [u8; 4] = [10, 244, 1, 10];
const C: [u8; 4] = [10, 244, 2, 5];
/// x/a's IPv6 address (x/a is dual-stack).
const A6: &str = "fd00:10:244:1::9";

fn cluster_pod(namespace: &str, name: &str, ip: [u8; 4]) -> PolicyPod {
    PolicyPod {
        namespace: namespace.into(),
        name: name.into(),
        labels: [("app".to_owned(), name.to_owned())].into(),
        addresses: vec![IpAddr::from(ip)],
        named_ports: [("http".to_owned(), vec![(6u8, 80u16)])].into(),
    }
}

/// x/a accepts TCP `http` from x/b only; x/b may send only to x/a.
const POLICIES: &str = "\
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-b, namespace: x}
spec:
  podSelector: {matchLabels: {app: a}}
  ingress:
  - from: [{podSelector: {matchLabels: {app: b}}}]
    ports: [{port: http}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: b-to-a, namespace: x}
spec:
  podSelector: {matchLabels: {app: b}}
  policyTypes: [Egress]
  egress:
  - to: [{podSelector: {matchLabels: {app: a}}}]
";

fn installed() -> (Fixture, AclState) {
    let policies: Vec<std::sync::Arc<NetworkPolicy>> = serde_yaml::Deserializer::from_str(POLICIES)
        .map(|d| std::sync::Arc::new(serde::Deserialize::deserialize(d).expect("NetworkPolicy")))
        .collect();
    let mut a = cluster_pod("x", "a", A);
    a.addresses.push(A6.parse().expect("address"));
    let pods: PolicyPods = [a, cluster_pod("x", "b", B), cluster_pod("y", "c", C)]
        .into_iter()
        .collect();
    let namespaces: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let cluster = PolicyCluster::new(&pods, &namespaces);
    let local = ["x/a".to_owned(), "x/b".to_owned()];
    let compiled = policy_sets(
        &policies,
        &cluster,
        &local,
        &Default::default(),
        &Default::default(),
    );
    assert!(compiled.errors.is_empty(), "{:?}", compiled.errors);
    let desired = DesiredFirewalls {
        policy_sets: compiled.sets,
        pod_policies: compiled.pods,
        ..DesiredFirewalls::default()
    };
    let acl_pods = vec![
        AclPod {
            namespace: "x".into(),
            name: "a".into(),
            addresses: vec![IpAddr::from(A), A6.parse().expect("address")],
        },
        AclPod {
            namespace: "x".into(),
            name: "b".into(),
            addresses: vec![IpAddr::from(B)],
        },
    ];
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = AclState::default();
    let stats = fixture
        .sync_acl(&mut state, &desired, &acl_pods)
        .expect("sync");
    assert_eq!(stats.sets, 2, "x/a's ingress set and x/b's egress set");
    (fixture, state)
}

/// Runs `frame` from its source pod (`tc_from_pod`) or, delivered by the node, to its
/// destination pod (`tc_to_pod`), that pod's port security set up for the test run.
fn run(fixture: &mut Fixture, program: &'static str, frame: &[u8]) -> u32 {
    let frame = if program == PROG_TO_POD {
        let delivered = packets::delivered(frame);
        fixture.port_as_receiver_of(&delivered).expect("port");
        delivered
    } else {
        fixture.port_as_sender_of(frame).expect("port");
        frame.to_vec()
    };
    let out = fixture.run_tc(program, &frame, 1).expect("tc run");
    if out.action == TC_ACT_OK {
        assert_eq!(out.output, frame, "policy never changes a packet");
    }
    out.action
}

fn tracked(fixture: &mut Fixture, src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16) -> bool {
    let ct: HashMap<&mut MapData, AclCtKey, AclCtValue> =
        fixture.typed_map(ACL_CT).expect("ct map");
    let key = AclCtKey {
        src: addr16(IpAddr::from(src)),
        dst: addr16(IpAddr::from(dst)),
        src_port: sport,
        dst_port: dport,
        protocol: 6,
        _pad: [0; 3],
    };
    ct.get(&key, 0).is_ok()
}

#[test]
fn new_flows_are_judged_at_both_ends_and_replies_of_allowed_ones_pass() {
    if !privileged("new_flows_are_judged_at_both_ends_and_replies_of_allowed_ones_pass") {
        return;
    }
    let (mut fixture, _) = installed();
    // b -> a on the named port: b's egress allows a, a's ingress allows b on http (TCP 80).
    let syn = tcp_v4_flow(B, 40000, A, 80, true);
    assert_eq!(run(&mut fixture, PROG_FROM_POD, &syn), TC_ACT_OK);
    assert!(tracked(&mut fixture, B, 40000, A, 80));
    // a's reply passes as part of the tracked flow, though a's egress is not isolated anyway;
    // b's further segments pass as tracked.
    let reply = tcp_v4_flow(A, 80, B, 40000, false);
    assert_eq!(run(&mut fixture, PROG_FROM_POD, &reply), TC_ACT_OK);
    assert_eq!(
        run(
            &mut fixture,
            PROG_FROM_POD,
            &tcp_v4_flow(B, 40000, A, 80, false)
        ),
        TC_ACT_OK
    );
    // b -> a on another port: a's ingress allows only http.
    assert_eq!(
        run(
            &mut fixture,
            PROG_FROM_POD,
            &tcp_v4_flow(B, 40001, A, 81, true)
        ),
        TC_ACT_SHOT
    );
    // b -> c: b's egress allows only a.
    assert_eq!(
        run(
            &mut fixture,
            PROG_FROM_POD,
            &tcp_v4_flow(B, 40002, C, 80, true)
        ),
        TC_ACT_SHOT
    );
    assert_eq!(
        run(&mut fixture, PROG_FROM_POD, &udp_v4_flow(B, 40003, C, 53)),
        TC_ACT_SHOT
    );
    // c -> a arrives through the stack (tc_to_pod): a accepts only b.
    assert_eq!(
        run(
            &mut fixture,
            PROG_TO_POD,
            &tcp_v4_flow(C, 40004, A, 80, true)
        ),
        TC_ACT_SHOT
    );
    // c -> b: b's ingress is not isolated.
    assert_eq!(
        run(
            &mut fixture,
            PROG_TO_POD,
            &tcp_v4_flow(C, 40005, B, 80, true)
        ),
        TC_ACT_OK
    );
    let counters = fixture.counters();
    assert_eq!(counters.drops(DropReason::PolicyDeniedIngress), 2);
    assert_eq!(counters.drops(DropReason::PolicyDeniedEgress), 2);
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::PolicyAllowed),
        1
    );
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::PolicyTracked),
        2
    );
    // Tracked because b is policed: its replies must pass b's egress.
    assert_eq!(counters.packets(Hook::ToPod, PacketClass::PolicyAllowed), 1);
}

#[test]
fn an_isolated_pod_gets_the_replies_of_the_connections_it_opens() {
    if !privileged("an_isolated_pod_gets_the_replies_of_the_connections_it_opens") {
        return;
    }
    let (mut fixture, _) = installed();
    // a is isolated for ingress only; it opens a connection to c on another node.
    assert_eq!(
        run(
            &mut fixture,
            PROG_FROM_POD,
            &tcp_v4_flow(A, 45000, C, 443, true)
        ),
        TC_ACT_OK
    );
    assert!(tracked(&mut fixture, A, 45000, C, 443));
    // c's answer comes back through the stack: a reply, so it passes.
    let answer = tcp_v4_flow(C, 443, A, 45000, false);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &answer), TC_ACT_OK);
    // The same address opening its own connection to a is still refused.
    assert_eq!(
        run(
            &mut fixture,
            PROG_TO_POD,
            &tcp_v4_flow(C, 443, A, 45001, true)
        ),
        TC_ACT_SHOT
    );
    // The node's own addresses reach the isolated pod (kubelet probes), others do not.
    fixture
        .sync_node_addresses(&[IpAddr::from([10, 99, 0, 1])])
        .expect("node addresses");
    let probe = tcp_v4_flow([10, 99, 0, 1], 46000, A, 8081, true);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &probe), TC_ACT_OK);
    let counters = fixture.counters();
    assert_eq!(counters.packets(Hook::ToPod, PacketClass::PolicyTracked), 1);
    assert_eq!(counters.drops(DropReason::PolicyDeniedIngress), 1);
}

/// An ICMP error from `from` to x/a quoting `quoted` (a scapy IP expression).
fn icmp_error_to_a(from: &str, icmp: &str, quoted: &str) -> Vec<u8> {
    dataplane_tests::scapy::build(&format!(
        "Ether(src='02:00:00:00:00:01', dst='0a:58:0a:f4:01:09')/\
         IP(src='{from}', dst='10.244.1.9')/{icmp}/{quoted}"
    ))
    .expect("scapy")
}

#[test]
fn icmp_errors_about_allowed_flows_reach_an_isolated_pod_and_others_do_not() {
    if !privileged("icmp_errors_about_allowed_flows_reach_an_isolated_pod_and_others_do_not") {
        return;
    }
    let (mut fixture, _) = installed();
    // a (isolated for ingress) opens TCP to c on another node and sends UDP to it.
    for frame in [
        tcp_v4_flow(A, 45100, C, 443, true),
        udp_v4_flow(A, 45101, C, 53),
    ] {
        assert_eq!(run(&mut fixture, PROG_FROM_POD, &frame), TC_ACT_OK);
    }
    let tcp = "IP(src='10.244.1.9', dst='10.244.2.5')/TCP(sport=45100, dport=443, flags='S')";
    let udp = "IP(src='10.244.1.9', dst='10.244.2.5')/UDP(sport=45101, dport=53)/Raw(b'q')";
    // About those flows: a router's fragmentation needed and time exceeded, the peer's port
    // unreachable. Each belongs to its flow and reaches a, though a's ingress allows only b.
    for (from, icmp, quoted) in [
        ("10.99.0.254", "ICMP(type=3, code=4, nexthopmtu=1400)", tcp),
        ("10.99.0.254", "ICMP(type=11, code=0)", tcp),
        ("10.244.2.5", "ICMP(type=3, code=3)", udp),
    ] {
        let error = icmp_error_to_a(from, icmp, quoted);
        assert_eq!(run(&mut fixture, PROG_TO_POD, &error), TC_ACT_OK, "{icmp}");
    }
    // About flows that were never allowed (another port; a flow c opened): dropped.
    let unknown = "IP(src='10.244.1.9', dst='10.244.2.5')/TCP(sport=45999, dport=443, flags='S')";
    let from_c = "IP(src='10.244.2.5', dst='10.244.1.9')/TCP(sport=443, dport=45998, flags='S')";
    for quoted in [unknown, from_c] {
        let error = icmp_error_to_a(
            "10.99.0.254",
            "ICMP(type=3, code=4, nexthopmtu=1400)",
            quoted,
        );
        assert_eq!(
            run(&mut fixture, PROG_TO_POD, &error),
            TC_ACT_SHOT,
            "{quoted}"
        );
    }
    // Nor is an echo request "related" to anything.
    let echo = icmp_error_to_a("10.244.2.5", "ICMP(type=8)", "Raw(b'ping')");
    assert_eq!(run(&mut fixture, PROG_TO_POD, &echo), TC_ACT_SHOT);
    let counters = fixture.counters();
    assert_eq!(counters.packets(Hook::ToPod, PacketClass::PolicyTracked), 3);
    assert_eq!(counters.drops(DropReason::PolicyDeniedIngress), 3);
}

#[test]
fn icmpv6_errors_about_allowed_flows_reach_an_isolated_pod_and_others_do_not() {
    if !privileged("icmpv6_errors_about_allowed_flows_reach_an_isolated_pod_and_others_do_not") {
        return;
    }
    let (mut fixture, _) = installed();
    let frame = |rest: &str| {
        dataplane_tests::scapy::build(&format!(
            "Ether(src='0a:58:0a:f4:01:09', dst='02:00:00:00:01:01')/{rest}"
        ))
        .expect("scapy")
    };
    // a opens TCP over IPv6 to a peer on another node.
    let syn = frame(&format!(
        "IPv6(src='{A6}', dst='fd00:10:244:2::5')/TCP(sport=45200, dport=443, flags='S')"
    ));
    assert_eq!(run(&mut fixture, PROG_FROM_POD, &syn), TC_ACT_OK);
    let quoted = |sport: u16| {
        format!("IPv6(src='{A6}', dst='fd00:10:244:2::5')/TCP(sport={sport}, dport=443, flags='S')")
    };
    // A router's packet too big and time exceeded about it, the peer's port unreachable:
    // related, they reach a.
    for (from, icmp) in [
        ("fd99::fe", "ICMPv6PacketTooBig(mtu=1280)"),
        ("fd99::fe", "ICMPv6TimeExceeded()"),
        ("fd00:10:244:2::5", "ICMPv6DestUnreach(code=4)"),
    ] {
        let error = frame(&format!(
            "IPv6(src='{from}', dst='{A6}')/{icmp}/{}",
            quoted(45200)
        ));
        assert_eq!(run(&mut fixture, PROG_TO_POD, &error), TC_ACT_OK, "{icmp}");
    }
    // About a flow never allowed: dropped.
    let unrelated = frame(&format!(
        "IPv6(src='fd99::fe', dst='{A6}')/ICMPv6PacketTooBig(mtu=1280)/{}",
        quoted(45999)
    ));
    assert_eq!(run(&mut fixture, PROG_TO_POD, &unrelated), TC_ACT_SHOT);
    let counters = fixture.counters();
    assert_eq!(counters.packets(Hook::ToPod, PacketClass::PolicyTracked), 3);
    assert_eq!(counters.drops(DropReason::PolicyDeniedIngress), 1);
}
