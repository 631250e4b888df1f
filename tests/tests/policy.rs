//! NetworkPolicy packet tests through the real programs with BPF_PROG_TEST_RUN: policies
//! compiled by the agent for two local pods, new flows judged at the sender's egress
//! (`tc_from_pod`) and the receiver's ingress (the same program for a local sender,
//! `tc_to_pod` for what the stack delivers), allowed flows tracked so that their replies pass,
//! verdicts, drop reasons and tracked-flow entries checked exactly.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc};

use aya::maps::{HashMap, MapData};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    acl::{
        ACL_ENDPOINT_INGRESS_PEERS, ACL_FAMILY_PEER, AclAddrKey, AclAddrValue, AclCtKey,
        AclCtValue, AclEndpoint, peer_key,
    },
    maps::{ACL_ADDRS, ACL_CT, ACL_ENDPOINTS, ACL_PEERS, PROG_FROM_POD, PROG_TO_POD},
};
use dataplane_tests::{
    fixture::Fixture,
    packets::{self, tcp_v4_flow, udp_v4_flow},
    privileged::privileged,
};
use dataplane_user::{
    acl::{
        AclPod, AclState, DesiredFirewalls,
        agent::{FirewallAgent, FirewallInputs},
        explain,
        firewall::FirewallContext,
        pods::{NamespaceLabels, PolicyChanges, PolicyPod, PolicyPods},
        policy::policy_sets,
        select::PolicyCluster,
    },
    mapsync::addr16,
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

fn parse_policies(yaml: &str) -> Vec<Arc<NetworkPolicy>> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|d| Arc::new(serde::Deserialize::deserialize(d).expect("NetworkPolicy")))
        .collect()
}

/// The policy sets of the `local` pods (`<namespace>/<name>`) for `yaml`, among `pods`.
fn desired_for(yaml: &str, pods: &PolicyPods, local: &[&str]) -> DesiredFirewalls {
    let policies = parse_policies(yaml);
    let namespaces = NamespaceLabels::default();
    let cluster = PolicyCluster::new(pods, &namespaces);
    let local: Vec<String> = local.iter().map(|key| (*key).to_owned()).collect();
    let compiled = policy_sets(
        &policies,
        &cluster,
        &local,
        &Default::default(),
        &Default::default(),
    );
    assert!(compiled.errors.is_empty(), "{:?}", compiled.errors);
    DesiredFirewalls {
        policy_sets: compiled.sets,
        pod_policies: compiled.pods,
        ..DesiredFirewalls::default()
    }
}

fn installed() -> (Fixture, AclState) {
    let mut a = cluster_pod("x", "a", A);
    a.addresses.push(A6.parse().expect("address"));
    let pods: PolicyPods = [a, cluster_pod("x", "b", B), cluster_pod("y", "c", C)]
        .into_iter()
        .collect();
    let desired = desired_for(POLICIES, &pods, &["x/a", "x/b"]);
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

/// Local pods x/a and x/d (same rules, so one shared ingress set) and x/b, with pods of
/// namespace y as peers.
const D: [u8; 4] = [10, 244, 1, 11];
const E: [u8; 4] = [10, 244, 2, 6];

/// x/a and x/d accept TCP 80 from y's `app: c` pods.
const SHARED: &str = "\
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: web, namespace: x}
spec:
  podSelector: {matchExpressions: [{key: app, operator: In, values: [a, d]}]}
  ingress:
  - from: [{namespaceSelector: {}, podSelector: {matchLabels: {app: c}}}]
    ports: [{protocol: TCP, port: 80}]
";

/// x/a alone also accepts TCP 81 from them.
const A_ALSO_81: &str = "\
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-extra, namespace: x}
spec:
  podSelector: {matchLabels: {app: a}}
  ingress:
  - from: [{namespaceSelector: {}, podSelector: {matchLabels: {app: c}}}]
    ports: [{protocol: TCP, port: 81}]
";

/// x/a, x/b and x/d, with `peers` as y's `app: c` pods.
fn cluster_pods(peers: &[(&str, [u8; 4])]) -> PolicyPods {
    let mut pods = vec![
        cluster_pod("x", "a", A),
        cluster_pod("x", "b", B),
        cluster_pod("x", "d", D),
    ];
    for (name, ip) in peers {
        let mut peer = cluster_pod("y", name, *ip);
        peer.labels = [("app".to_owned(), "c".to_owned())].into();
        pods.push(peer);
    }
    pods.into_iter().collect()
}

/// The policy sets of x/a, x/b and x/d for `yaml`, with `peers` as y's pods.
fn compile_local(yaml: &str, peers: &[(&str, [u8; 4])]) -> DesiredFirewalls {
    desired_for(yaml, &cluster_pods(peers), &["x/a", "x/b", "x/d"])
}

fn local_pods() -> Vec<AclPod> {
    [("a", A), ("b", B), ("d", D)]
        .map(|(name, ip)| AclPod {
            namespace: "x".into(),
            name: name.into(),
            addresses: vec![IpAddr::from(ip)],
        })
        .to_vec()
}

/// The ingress set id of the endpoint at `ip`.
fn ingress_set(fixture: &mut Fixture, ip: [u8; 4]) -> u32 {
    let endpoints: HashMap<&mut MapData, [u8; 16], AclEndpoint> =
        fixture.typed_map(ACL_ENDPOINTS).expect("endpoints map");
    endpoints
        .get(&addr16(IpAddr::from(ip)), 0)
        .expect("endpoint")
        .ingress
}

/// What `ACL_PEERS` holds: peer address -> identity.
fn peer_addresses(fixture: &mut Fixture) -> BTreeMap<[u8; 16], u32> {
    let peers: HashMap<&mut MapData, [u8; 16], u32> =
        fixture.typed_map(ACL_PEERS).expect("peers map");
    peers.iter().map(|entry| entry.expect("entry")).collect()
}

/// The identities set `set` has entries for, and how many host prefixes it has.
fn set_peers_and_hosts(fixture: &mut Fixture, set: u32) -> (Vec<u32>, usize) {
    let addrs: HashMap<&mut MapData, AclAddrKey, AclAddrValue> =
        fixture.typed_map(ACL_ADDRS).expect("addrs map");
    let keys: Vec<AclAddrKey> = addrs
        .keys()
        .map(|key| key.expect("key"))
        .filter(|key| key.set == set)
        .collect();
    let mut peers: Vec<u32> = keys
        .iter()
        .filter(|key| key.family == ACL_FAMILY_PEER)
        .map(|key| u32::from_ne_bytes(key.addr[..4].try_into().expect("4 bytes")))
        .collect();
    peers.sort_unstable();
    let hosts = keys.iter().filter(|key| key.len == 32).count();
    (peers, hosts)
}

#[test]
fn a_changed_peer_set_changes_in_place_unless_a_pod_on_it_keeps_other_rules() {
    if !privileged("a_changed_peer_set_changes_in_place_unless_a_pod_on_it_keeps_other_rules") {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = AclState::default();
    let pods = local_pods();
    let first = compile_local(SHARED, &[("c", C)]);
    assert_eq!(first.policy_sets.len(), 1, "x/a and x/d share one set");
    fixture
        .sync_acl(&mut state, &first, &pods)
        .expect("first sync");
    let shared = ingress_set(&mut fixture, A);
    assert_eq!(ingress_set(&mut fixture, D), shared);
    let to_a = |port| tcp_v4_flow(E, 41000 + port, A, port, true);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &to_a(80)), TC_ACT_SHOT);

    // A peer pod comes: the set's new version is a new name, but every pod on the set wants
    // it, so the set changes in place: one prefix written, no endpoint rewritten.
    let second = compile_local(SHARED, &[("c", C), ("e", E)]);
    assert_ne!(
        first.policy_sets.keys().collect::<Vec<_>>(),
        second.policy_sets.keys().collect::<Vec<_>>()
    );
    let stats = fixture
        .sync_acl(&mut state, &second, &pods)
        .expect("second sync");
    assert_eq!((stats.written, stats.deleted), (1, 0), "{stats:?}");
    assert_eq!(ingress_set(&mut fixture, A), shared);
    assert_eq!(ingress_set(&mut fixture, D), shared);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &to_a(80)), TC_ACT_OK);

    // x/a takes more rules while x/d keeps the set's: x/a moves to a set written whole, the
    // shared one stays as it is for x/d.
    let third = compile_local(&format!("{SHARED}{A_ALSO_81}"), &[("c", C), ("e", E)]);
    fixture
        .sync_acl(&mut state, &third, &pods)
        .expect("third sync");
    let own = ingress_set(&mut fixture, A);
    assert_ne!(own, shared);
    assert_eq!(ingress_set(&mut fixture, D), shared);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &to_a(81)), TC_ACT_OK);
    let to_d = tcp_v4_flow(E, 42081, D, 81, true);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &to_d), TC_ACT_SHOT);

    // The peer goes: x/d's set (only x/d on it) changes in place, x/a's too.
    let fourth = compile_local(&format!("{SHARED}{A_ALSO_81}"), &[("c", C)]);
    let stats = fixture
        .sync_acl(&mut state, &fourth, &pods)
        .expect("fourth sync");
    assert_eq!((stats.written, stats.deleted), (0, 2), "{stats:?}");
    assert_eq!(ingress_set(&mut fixture, A), own);
    assert_eq!(ingress_set(&mut fixture, D), shared);
    let again = tcp_v4_flow(E, 43080, D, 80, true);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &again), TC_ACT_SHOT);

    // The shared policy's port changes: x/d's set keeps its id and its port table's id, one
    // port entry written and one removed, no prefix rewritten. x/a's set (two ports) too.
    let fifth = compile_local(
        &format!("{SHARED}{A_ALSO_81}").replace("port: 80}", "port: 8080}"),
        &[("c", C)],
    );
    let stats = fixture
        .sync_acl(&mut state, &fifth, &pods)
        .expect("fifth sync");
    assert_eq!((stats.written, stats.deleted), (2, 2), "{stats:?}");
    assert_eq!(ingress_set(&mut fixture, A), own);
    assert_eq!(ingress_set(&mut fixture, D), shared);
    let from_c = |port, to| tcp_v4_flow(C, 44000 + port, to, port, true);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &from_c(8080, D)), TC_ACT_OK);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &from_c(80, D)), TC_ACT_SHOT);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &from_c(8080, A)), TC_ACT_OK);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &from_c(81, A)), TC_ACT_OK);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &from_c(80, A)), TC_ACT_SHOT);
}

/// The running agent's access control: peer pods are named by identity; an update that reads
/// nothing new writes nothing (and leaves the rules' description alone), a peer pod added
/// writes its one address, as its identity, and no set changes.
#[test]
fn the_firewall_agent_writes_what_a_change_reaches_and_nothing_otherwise() {
    if !privileged("the_firewall_agent_writes_what_a_change_reaches_and_nothing_otherwise") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("policy-agent-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("directory");
    let rules_dir = dir.join(explain::RULES_DIR);
    let policies = parse_policies(SHARED);
    let inputs = |peers: &[(&str, [u8; 4])], changes: PolicyChanges| FirewallInputs {
        objects: Vec::new(),
        policies: policies.clone(),
        admin: Default::default(),
        nodes: Vec::new(),
        cluster_pods: cluster_pods(peers),
        changes,
        namespaces: Default::default(),
        context: FirewallContext::default(),
        pods: local_pods(),
        dns_server: None,
        dns_cache: dir.join("dns-cache.json"),
        dns_servers: Default::default(),
        audit: Default::default(),
        audit_path: dir.join("audit.log"),
        rules_dir: rules_dir.clone(),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut fixture = Fixture::load().expect("programs load");
    let (mut agent, stats) = runtime
        .block_on(FirewallAgent::start(
            &mut fixture,
            inputs(&[("c", C)], PolicyChanges::everything()),
        ))
        .expect("start");
    // One shared set: a table of one port, the entry of y's `app: c` pods' identity, and
    // the three endpoints' two policed ones (flagged: their set names peers); C's address
    // in `ACL_PEERS`, as that identity.
    assert!(stats.written > 0, "{stats:?}");
    let peers = peer_addresses(&mut fixture);
    assert_eq!(peers.len(), 1, "{peers:?}");
    let identity = peers[&addr16(IpAddr::from(C))];
    let set = ingress_set(&mut fixture, A);
    assert_eq!(set_peers_and_hosts(&mut fixture, set), (vec![identity], 0));
    let endpoints: HashMap<&mut MapData, [u8; 16], AclEndpoint> =
        fixture.typed_map(ACL_ENDPOINTS).expect("endpoints map");
    let flags = endpoints
        .get(&addr16(IpAddr::from(A)), 0)
        .expect("endpoint")
        .flags;
    assert_eq!(
        flags & ACL_ENDPOINT_INGRESS_PEERS,
        ACL_ENDPOINT_INGRESS_PEERS
    );
    let addrs: HashMap<&mut MapData, AclAddrKey, AclAddrValue> =
        fixture.typed_map(ACL_ADDRS).expect("addrs map");
    assert!(addrs.get(&peer_key(set, identity), 0).is_ok());
    // Each set's description file by name, with its inode (a write replaces the file).
    let inode = || -> Vec<(std::ffi::OsString, u64)> {
        let mut files: Vec<_> = std::fs::read_dir(&rules_dir)
            .expect("the descriptions' directory")
            .map(|entry| {
                let entry = entry.expect("entry");
                let inode = std::os::unix::fs::MetadataExt::ino(&entry.metadata().unwrap());
                (entry.file_name(), inode)
            })
            .collect();
        files.sort();
        files
    };
    let described = inode();
    assert_eq!(described.len(), 1, "one set, one file: {described:?}");

    let same = runtime
        .block_on(agent.update(&mut fixture, inputs(&[("c", C)], PolicyChanges::default())))
        .expect("update");
    assert_eq!((same.stats.written, same.stats.deleted), (0, 0));
    assert_eq!(inode(), described, "the description is not written again");

    // Pod y/e added (the agent adds the labels it had and has).
    let mut peer = PolicyChanges::default();
    peer.note_pod("y", "e");
    let added = runtime
        .block_on(agent.update(&mut fixture, inputs(&[("c", C), ("e", E)], peer)))
        .expect("update");
    assert_eq!((added.stats.written, added.stats.deleted), (1, 0));
    assert_eq!(inode(), described, "the set's rules are the same");
    // The one write: E's address, as C's identity; the set is as it was.
    let peers = peer_addresses(&mut fixture);
    assert_eq!(
        peers,
        BTreeMap::from([
            (addr16(IpAddr::from(C)), identity),
            (addr16(IpAddr::from(E)), identity)
        ])
    );
    assert_eq!(ingress_set(&mut fixture, A), set);
    let to_a = tcp_v4_flow(E, 45080, A, 80, true);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &to_a), TC_ACT_OK);

    // The policy's port changes: the set is painted again by the rules covering its prefixes
    // and changes in place, its one port table written over under its id (the entry of port
    // 8080 written, that of 80 removed), no prefix or endpoint written.
    let set_before = ingress_set(&mut fixture, A);
    let mut port = PolicyChanges::default();
    port.policies.insert("x".into());
    let mut moved = inputs(&[("c", C), ("e", E)], port);
    moved.policies = parse_policies(&SHARED.replace("port: 80}", "port: 8080}"));
    let repainted = runtime
        .block_on(agent.update(&mut fixture, moved))
        .expect("update");
    assert_eq!(
        (repainted.stats.written, repainted.stats.deleted),
        (1, 1),
        "{:?}",
        repainted.stats
    );
    assert_eq!(ingress_set(&mut fixture, A), set_before);
    assert_eq!(ingress_set(&mut fixture, D), set_before);
    // (A new flow: the first one's connection stays allowed.)
    let to_a_80 = tcp_v4_flow(E, 45082, A, 80, true);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &to_a_80), TC_ACT_SHOT);
    let to_a_8080 = tcp_v4_flow(E, 45081, A, 8080, true);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &to_a_8080), TC_ACT_OK);

    // The description follows the sets one by one: gone with the policies, described again
    // (under the new set's id) when they come back.
    let first = explain::read(&dir);
    assert!(!first.is_empty());
    let mut without = inputs(&[("c", C), ("e", E)], PolicyChanges::everything());
    without.policies = Vec::new();
    runtime
        .block_on(agent.update(&mut fixture, without))
        .expect("update");
    assert!(explain::read(&dir).is_empty());
    // No set names the identity any more; its addresses stay, for a set naming it again.
    assert_eq!(peer_addresses(&mut fixture), peers);
    runtime
        .block_on(agent.update(
            &mut fixture,
            inputs(&[("c", C), ("e", E)], PolicyChanges::everything()),
        ))
        .expect("update");
    let again = explain::read(&dir);
    assert_eq!(
        again.values().collect::<Vec<_>>(),
        first.values().collect::<Vec<_>>()
    );
    assert_ne!(
        again.keys().collect::<Vec<_>>(),
        first.keys().collect::<Vec<_>>()
    );

    // A restarted agent keeps the peers' identity numbers: the sets the last one left in
    // force keep meaning the same pods until its own replace them.
    let held = peer_addresses(&mut fixture);
    assert_eq!(held.len(), 2, "{held:?}");
    drop(agent);
    // An address the last agent wrote for a pod since gone: removed.
    let gone = addr16(IpAddr::from([10, 244, 9, 9]));
    {
        let mut peers: HashMap<&mut MapData, [u8; 16], u32> =
            fixture.typed_map(ACL_PEERS).expect("peers map");
        peers.insert(gone, 99, 0).expect("insert");
    }
    let (_restarted, _) = runtime
        .block_on(FirewallAgent::start(
            &mut fixture,
            inputs(&[("c", C), ("e", E)], PolicyChanges::everything()),
        ))
        .expect("restart");
    assert_eq!(peer_addresses(&mut fixture), held);
    let to_a_80 = tcp_v4_flow(E, 45083, A, 80, true);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &to_a_80), TC_ACT_OK);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A NetworkPolicy whose set does not fit the address map (other tenants' sets took the
/// room): its pods are denied that direction (an empty set), named, and the sync goes on for
/// every other pod, whose sets are written and in force.
#[test]
fn a_policy_set_the_maps_cannot_hold_closes_its_pods_alone() {
    if !privileged("a_policy_set_the_maps_cannot_hold_closes_its_pods_alone") {
        return;
    }
    // x/a takes TCP from 100 addresses: 100 entries, in a map of 64.
    let hosts: Vec<String> = (0..100)
        .map(|i| format!("{{ipBlock: {{cidr: 198.51.100.{i}/32}}}}"))
        .collect();
    let yaml = format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
         metadata: {{name: big, namespace: x}}\n\
         spec:\n  podSelector: {{matchLabels: {{app: a}}}}\n  ingress:\n  - from: [{}]\n\
         ---\n{}",
        hosts.join(", "),
        POLICIES.split("---\n").nth(1).expect("b-to-a")
    );
    let pods: PolicyPods = [
        cluster_pod("x", "a", A),
        cluster_pod("x", "b", B),
        cluster_pod("y", "c", C),
    ]
    .into_iter()
    .collect();
    let desired = desired_for(&yaml, &pods, &["x/a", "x/b"]);
    let acl_pods: Vec<AclPod> = [("a", A), ("b", B)]
        .iter()
        .map(|(name, ip)| AclPod {
            namespace: "x".into(),
            name: (*name).into(),
            addresses: vec![IpAddr::from(*ip)],
        })
        .collect();
    let capacities = dataplane_user::kernel::capacity::Capacities {
        acl_entries: 64,
        ..Default::default()
    };
    let mut fixture = Fixture::load_with(&capacities).expect("programs load");
    let mut state = AclState::default();
    let stats = fixture
        .sync_acl(&mut state, &desired, &acl_pods)
        .expect("one set that does not fit fails alone, not the sync");
    assert_eq!(stats.closed.len(), 1, "{:?}", stats.closed);
    assert!(
        stats.closed[0].starts_with("NetworkPolicy x/big: the Ingress policy set"),
        "{}",
        stats.closed[0]
    );
    assert!(
        stats.closed[0].contains("--max-acl-entries"),
        "{}",
        stats.closed[0]
    );
    // x/a is closed: not even what the big policy allows comes in.
    let from_allowed = tcp_v4_flow([198, 51, 100, 7], 40000, A, 80, true);
    assert_eq!(run(&mut fixture, PROG_TO_POD, &from_allowed), TC_ACT_SHOT);
    // x/b's egress set is in force: it denies c (and allows a, whose ingress is closed).
    assert_eq!(
        run(
            &mut fixture,
            PROG_FROM_POD,
            &tcp_v4_flow(B, 40000, C, 80, true)
        ),
        TC_ACT_SHOT
    );
    let to_a = tcp_v4_flow(B, 40001, A, 80, true);
    assert_eq!(
        run(&mut fixture, PROG_FROM_POD, &to_a),
        TC_ACT_SHOT,
        "b's egress allows a, a's closed ingress does not"
    );
    let counters = fixture.counters();
    assert_eq!(counters.drops(DropReason::PolicyDeniedIngress), 2);
    assert_eq!(counters.drops(DropReason::PolicyDeniedEgress), 1);
}
