//! Admin policy packet tests through the real programs with BPF_PROG_TEST_RUN: the three
//! tiers compiled by the agent into the pods' policy sets, verdicts checked exactly. A deny is
//! a silent drop: the program shoots the packet as it came (no reset, no ICMP error built in
//! its place), as the upstream conformance suite requires.

use std::{collections::BTreeMap, net::IpAddr};

use dataplane_common::{
    DropReason, Hook, PacketClass,
    maps::{PROG_FROM_POD, PROG_TO_POD},
};
use dataplane_tests::{
    fixture::Fixture,
    packets::{self, icmp_v4_echo, tcp_v4_flow, udp_v4_flow},
    privileged::privileged,
};
use dataplane_user::{
    acl::{
        AclPod, AclState, DesiredFirewalls,
        admin::validate_all,
        pods::{NamespaceLabels, PolicyPod, PolicyPods},
        policy::policy_sets,
        select::PolicyCluster,
    },
    source::{ClusterState, add_documents},
};

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;

/// x/a and x/b run on this node, y/c on another.
const A: [u8; 4] = [10, 244, 1, 9];
const B: [u8; 4] = [10, 244, 1, 10];
const C: [u8; 4] = [10, 244, 2, 5];

/// x/a: the admin tier refuses y, passes x on TCP 80 to x's NetworkPolicy (which admits b)
/// and refuses the rest; x/b: the baseline refuses its UDP to node 2's pods.
const POLICIES: &str = "\
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: guard}
spec:
  priority: 1
  subject: {pods: {namespaceSelector: {matchLabels: {team: x}}, podSelector: {matchLabels: {app: a}}}}
  ingress:
  - action: Deny
    from: [{namespaces: {matchLabels: {team: y}}}]
  - action: Pass
    from: [{namespaces: {matchLabels: {team: x}}}]
    ports: [{portNumber: {protocol: TCP, port: 80}}]
  - action: Deny
    from: [{namespaces: {}}]
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: BaselineAdminNetworkPolicy
metadata: {name: default}
spec:
  subject: {pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: b}}}}
  egress:
  - action: Deny
    to: [{networks: [10.244.2.0/24]}]
    ports: [{portRange: {protocol: UDP, start: 1, end: 65535}}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-b, namespace: x}
spec:
  podSelector: {matchLabels: {app: a}}
  ingress:
  - from: [{podSelector: {matchLabels: {app: b}}}]
";

fn cluster_pod(namespace: &str, name: &str, ip: [u8; 4]) -> PolicyPod {
    PolicyPod {
        namespace: namespace.into(),
        name: name.into(),
        labels: [("app".to_owned(), name.to_owned())].into(),
        addresses: vec![IpAddr::from(ip)],
        named_ports: BTreeMap::new(),
    }
}

fn installed() -> Fixture {
    let mut state = ClusterState::default();
    add_documents(&mut state, "policies.yaml", POLICIES);
    assert!(state.rejected.is_empty(), "{:?}", state.rejected);
    let validated = validate_all(&state.admin_objects(), &mut BTreeMap::new());
    assert!(validated.errors.is_empty(), "{:?}", validated.errors);
    let pods: PolicyPods = [
        cluster_pod("x", "a", A),
        cluster_pod("x", "b", B),
        cluster_pod("y", "c", C),
    ]
    .into_iter()
    .collect();
    let namespaces: NamespaceLabels = ["x", "y"]
        .map(|n| (n.to_owned(), [("team".to_owned(), n.to_owned())].into()))
        .into_iter()
        .collect();
    let cluster = PolicyCluster::new(&pods, &namespaces);
    let local = ["x/a".to_owned(), "x/b".to_owned()];
    let compiled = policy_sets(
        &state.network_policies.to_vec(),
        &cluster,
        &local,
        &Default::default(),
        &validated.policies,
    );
    assert!(compiled.errors.is_empty(), "{:?}", compiled.errors);
    let desired = DesiredFirewalls {
        policy_sets: compiled.sets,
        pod_policies: compiled.pods,
        ..DesiredFirewalls::default()
    };
    let acl_pods = [("a", A), ("b", B)].map(|(name, ip)| AclPod {
        namespace: "x".into(),
        name: name.into(),
        addresses: vec![IpAddr::from(ip)],
    });
    let mut fixture = Fixture::load().expect("programs load");
    let stats = fixture
        .sync_acl(&mut AclState::default(), &desired, &acl_pods)
        .expect("sync");
    assert_eq!(stats.sets, 2, "x/a's ingress set and x/b's egress set");
    fixture
}

/// Runs `frame` from its source pod or, delivered by the node, to its destination pod. A
/// packet that is not passed on must come out as it went in: dropped, not answered.
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
    assert!(
        out.action == TC_ACT_OK || out.action == TC_ACT_SHOT,
        "action {}: nothing but pass or drop",
        out.action
    );
    assert_eq!(out.output, frame, "policy never rewrites a packet");
    out.action
}

#[test]
fn the_tiers_decide_in_order_and_a_deny_is_a_silent_drop() {
    if !privileged("the_tiers_decide_in_order_and_a_deny_is_a_silent_drop") {
        return;
    }
    let mut fixture = installed();
    // b -> a on TCP 80: passed by the admin tier, admitted by the NetworkPolicy.
    assert_eq!(
        run(
            &mut fixture,
            PROG_FROM_POD,
            &tcp_v4_flow(B, 40000, A, 80, true)
        ),
        TC_ACT_OK
    );
    // b -> a on TCP 81: not passed, refused by the admin tier's last rule.
    assert_eq!(
        run(
            &mut fixture,
            PROG_FROM_POD,
            &tcp_v4_flow(B, 40001, A, 81, true)
        ),
        TC_ACT_SHOT
    );
    // c -> a: refused by the admin tier's first rule, TCP, UDP and ICMP alike.
    for frame in [
        tcp_v4_flow(C, 40002, A, 80, true),
        udp_v4_flow(C, 40003, A, 53),
        icmp_v4_echo(C, A),
    ] {
        assert_eq!(run(&mut fixture, PROG_TO_POD, &frame), TC_ACT_SHOT);
    }
    // b -> c: the baseline refuses UDP, the rest is allowed (no NetworkPolicy isolates b).
    assert_eq!(
        run(&mut fixture, PROG_FROM_POD, &udp_v4_flow(B, 40004, C, 53)),
        TC_ACT_SHOT
    );
    assert_eq!(
        run(
            &mut fixture,
            PROG_FROM_POD,
            &tcp_v4_flow(B, 40005, C, 443, true)
        ),
        TC_ACT_OK
    );
    // c -> b: b's ingress is judged by nothing.
    assert_eq!(
        run(
            &mut fixture,
            PROG_TO_POD,
            &tcp_v4_flow(C, 40006, B, 80, true)
        ),
        TC_ACT_OK
    );
    let counters = fixture.counters();
    assert_eq!(counters.drops(DropReason::PolicyDeniedIngress), 4);
    assert_eq!(counters.drops(DropReason::PolicyDeniedEgress), 1);
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::PolicyAllowed),
        2
    );
}
