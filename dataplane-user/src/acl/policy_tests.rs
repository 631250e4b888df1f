//! The upstream Kubernetes NetworkPolicy e2e scenarios (test/e2e/network/netpol) as truth
//! tables: namespaces x, y, z (labelled `ns: <name>`), pods a, b, c in each (labelled
//! `pod: <name>`, serving TCP, UDP and SCTP on 80 and 81 under the names `serve-80-tcp` ...),
//! every pod probing every pod. The compiled sets decide each probe as the kernel would (the
//! sender's egress set, then the receiver's ingress set; no rule matched = denied for an
//! isolated pod) and the whole 9 x 9 matrix must equal the scenario's expectation.

use std::{collections::BTreeMap, sync::Arc};

use k8s_openapi::api::networking::v1::NetworkPolicy;

use super::{
    CompiledSet, PROTO_SCTP, PROTO_TCP, PROTO_UDP, Verdict, compile_rules,
    peers::Registry,
    pod_rules::PodPolicy,
    pods::{NamespaceLabels, PolicyPod, PolicyPods},
    policy::pod_policy,
    select::PolicyCluster,
};

const NAMESPACES: [&str; 3] = ["x", "y", "z"];
const PODS: [&str; 3] = ["a", "b", "c"];

fn cluster_pods() -> Vec<PolicyPod> {
    let mut pods = Vec::new();
    for (n, namespace) in NAMESPACES.iter().enumerate() {
        for (p, name) in PODS.iter().enumerate() {
            let mut named_ports = BTreeMap::new();
            for port in [80u16, 81] {
                for (protocol, text) in
                    [(PROTO_TCP, "tcp"), (PROTO_UDP, "udp"), (PROTO_SCTP, "sctp")]
                {
                    named_ports.insert(format!("serve-{port}-{text}"), vec![(protocol, port)]);
                }
            }
            pods.push(PolicyPod {
                namespace: (*namespace).into(),
                name: (*name).into(),
                labels: [("pod".to_owned(), (*name).to_owned())].into(),
                addresses: vec![[10, 244, n as u8 + 1, p as u8 + 1].into()],
                named_ports,
            });
        }
    }
    pods
}

fn namespaces() -> NamespaceLabels {
    NAMESPACES
        .iter()
        .map(|ns| {
            (
                (*ns).to_owned(),
                [
                    ("ns".to_owned(), (*ns).to_owned()),
                    ("kubernetes.io/metadata.name".to_owned(), (*ns).to_owned()),
                ]
                .into(),
            )
        })
        .collect()
}

/// Each pod's compiled (ingress, egress) sets; `None` where it is not isolated. With peer
/// identities, also each pod's identity.
struct Compiled {
    pods: Vec<PolicyPod>,
    sets: Vec<(Option<CompiledSet>, Option<CompiledSet>)>,
    identities: Option<Vec<u32>>,
}

/// The NetworkPolicies of a YAML stream.
fn parsed_policies(yaml: &str) -> Vec<Arc<NetworkPolicy>> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|d| Arc::new(serde::Deserialize::deserialize(d).expect("NetworkPolicy")))
        .collect()
}

/// The scenario's sets, peer pods named by their addresses or (`by_identity`) by identity.
fn compile(yaml: &str, by_identity: bool) -> Compiled {
    let policies = parsed_policies(yaml);
    let pods = cluster_pods();
    let labels = namespaces();
    let index: PolicyPods = pods.iter().cloned().collect();
    let registry = Registry::default();
    let mut cluster = PolicyCluster::new(&index, &labels);
    if by_identity {
        cluster = cluster.with_identities(&registry);
    }
    let sets = pods
        .iter()
        .map(|pod| {
            let (PodPolicy { ingress, egress }, errors) = pod_policy(&policies, &cluster, pod);
            assert!(errors.is_empty(), "{errors:?}");
            (
                ingress.map(|r| compile_rules(&r.rules, false).unwrap()),
                egress.map(|r| compile_rules(&r.rules, false).unwrap()),
            )
        })
        .collect();
    let identities = by_identity.then(|| {
        let mut registry = registry.borrow_mut();
        pods.iter()
            .map(|pod| registry.identity(&pod.namespace, &pod.labels))
            .collect()
    });
    Compiled {
        pods,
        sets,
        identities,
    }
}

/// As the kernel decides: the peer's address, then, where no prefix decided, its identity.
fn allows(
    set: &Option<CompiledSet>,
    peer: &PolicyPod,
    identity: Option<u32>,
    protocol: u8,
    port: u16,
) -> bool {
    match set {
        None => true,
        Some(set) => set
            .lookup(peer.addresses[0], protocol, port)
            .or_else(|| set.lookup_peer(identity?, protocol, port))
            .is_some_and(|o| o.verdict == Verdict::Allow),
    }
}

/// The 9 x 9 matrix for one protocol and port, one character per probe (`.` allowed, `X`
/// denied), rows are clients.
fn matrix(compiled: &Compiled, protocol: u8, port: u16) -> String {
    let mut out = String::new();
    let identity = |index: usize| compiled.identities.as_ref().map(|ids| ids[index]);
    let pods = compiled.pods.iter().zip(&compiled.sets).enumerate();
    for (f, (from, (_, egress))) in pods.clone() {
        for (t, (to, (ingress, _))) in pods.clone() {
            let ok = allows(egress, to, identity(t), protocol, port)
                && allows(ingress, from, identity(f), protocol, port);
            out.push(if ok { '.' } else { 'X' });
        }
        out.push('\n');
    }
    out
}

fn expected(rule: impl Fn(&str, &str) -> bool) -> String {
    let keys: Vec<String> = NAMESPACES
        .iter()
        .flat_map(|ns| PODS.iter().map(move |p| format!("{ns}/{p}")))
        .collect();
    let mut out = String::new();
    for from in &keys {
        for to in &keys {
            out.push(if rule(from, to) { '.' } else { 'X' });
        }
        out.push('\n');
    }
    out
}

/// Checks one scenario on the given protocols and ports, peer pods named by address and by
/// identity.
fn check(name: &str, yaml: &str, probes: &[(u8, u16)], rule: impl Fn(&str, &str, u8, u16) -> bool) {
    for by_identity in [false, true] {
        let compiled = compile(yaml, by_identity);
        for &(protocol, port) in probes {
            let want = expected(|from, to| rule(from, to, protocol, port));
            let got = matrix(&compiled, protocol, port);
            assert_eq!(
                got, want,
                "{name} (by identity: {by_identity}), protocol {protocol} port {port}: got (left) vs expected (right), rows are clients x/a..z/c"
            );
        }
    }
}

const ALL: [(u8, u16); 6] = [
    (PROTO_TCP, 80),
    (PROTO_TCP, 81),
    (PROTO_UDP, 80),
    (PROTO_UDP, 81),
    (PROTO_SCTP, 80),
    (PROTO_SCTP, 81),
];

fn policy(namespace: &str, name: &str, spec: &str) -> String {
    format!(
        "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: {namespace}}}\nspec:\n{spec}\n"
    )
}

fn ns(pod: &str) -> &str {
    &pod[..1]
}

#[test]
fn default_deny_ingress_and_default_deny_all() {
    check(
        "default-deny-ingress",
        &policy(
            "x",
            "deny-ingress",
            "  podSelector: {}\n  policyTypes: [Ingress]",
        ),
        &ALL,
        |_, to, _, _| ns(to) != "x",
    );
    check(
        "default-deny-all",
        &policy(
            "x",
            "deny-all",
            "  podSelector: {}\n  policyTypes: [Ingress, Egress]",
        ),
        &ALL,
        |from, to, _, _| ns(to) != "x" && ns(from) != "x",
    );
}

#[test]
fn allow_all_ingress_and_egress() {
    check(
        "allow-all",
        &policy(
            "x",
            "allow-all",
            "  podSelector: {}\n  ingress: [{}]\n  egress: [{}]\n  policyTypes: [Ingress, Egress]",
        ),
        &ALL,
        |_, _, _, _| true,
    );
}

#[test]
fn pod_selector_namespace_selector_and_both() {
    check(
        "from pods within the server namespace by podSelector",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {pod: b}}}]",
        ),
        &ALL,
        |from, to, _, _| to != "x/a" || from == "x/b",
    );
    check(
        "only from a different namespace by namespaceSelector",
        &policy(
            "x",
            "p",
            "  podSelector: {}\n  ingress:\n  - from: [{namespaceSelector: {matchLabels: {ns: y}}}]",
        ),
        &ALL,
        |from, to, _, _| ns(to) != "x" || ns(from) == "y",
    );
    check(
        "podSelector OR namespaceSelector",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {pod: b}}}, {namespaceSelector: {matchLabels: {ns: y}}}]",
        ),
        &ALL,
        |from, to, _, _| to != "x/a" || from == "x/b" || ns(from) == "y",
    );
    check(
        "podSelector AND namespaceSelector",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {pod: b}}, namespaceSelector: {matchLabels: {ns: y}}}]",
        ),
        &ALL,
        |from, to, _, _| to != "x/a" || from == "y/b",
    );
    check(
        "deny ingress from pods of other namespaces",
        &policy(
            "x",
            "p",
            "  podSelector: {}\n  ingress:\n  - from: [{podSelector: {}}]",
        ),
        &ALL,
        |from, to, _, _| ns(to) != "x" || ns(from) == "x",
    );
}

#[test]
fn match_expressions_on_pods_and_namespaces() {
    check(
        "podSelector In",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{podSelector: {matchExpressions: [{key: pod, operator: In, values: [b]}]}}]",
        ),
        &ALL,
        |from, to, _, _| to != "x/a" || from == "x/b",
    );
    check(
        "namespaceSelector NotIn",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{namespaceSelector: {matchExpressions: [{key: ns, operator: NotIn, values: [x]}]}}]",
        ),
        &ALL,
        |from, to, _, _| to != "x/a" || ns(from) != "x",
    );
    check(
        "multiple selectors with expressions",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{namespaceSelector: {matchExpressions: [{key: ns, operator: NotIn, values: [x]}]}, podSelector: {matchExpressions: [{key: pod, operator: In, values: [b, c]}]}}]",
        ),
        &ALL,
        |from, to, _, _| to != "x/a" || (ns(from) != "x" && !from.ends_with('a')),
    );
    check(
        "Exists and DoesNotExist",
        &policy(
            "x",
            "p",
            "  podSelector: {matchExpressions: [{key: pod, operator: Exists}]}\n  ingress:\n  - from: [{podSelector: {matchExpressions: [{key: missing, operator: DoesNotExist}]}}]",
        ),
        &ALL,
        |from, to, _, _| ns(to) != "x" || ns(from) == "x",
    );
}

#[test]
fn ports_numbers_names_ranges_and_protocols() {
    check(
        "ingress on port 81 from namespace y",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{namespaceSelector: {matchLabels: {ns: y}}}]\n    ports: [{port: 81}]",
        ),
        &ALL,
        |from, to, protocol, port| {
            to != "x/a" || (ns(from) == "y" && protocol == PROTO_TCP && port == 81)
        },
    );
    check(
        "ingress on one named port",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - ports: [{port: serve-81-udp, protocol: UDP}]",
        ),
        &ALL,
        |_, to, protocol, port| to != "x/a" || (protocol == PROTO_UDP && port == 81),
    );
    check(
        "ingress from namespace y on one named port",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{namespaceSelector: {matchLabels: {ns: y}}}]\n    ports: [{port: serve-80-tcp}]",
        ),
        &ALL,
        |from, to, protocol, port| {
            to != "x/a" || (ns(from) == "y" && protocol == PROTO_TCP && port == 80)
        },
    );
    check(
        "egress on one named port",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  policyTypes: [Egress]\n  egress:\n  - ports: [{port: serve-80-tcp}]",
        ),
        &ALL,
        |from, _, protocol, port| from != "x/a" || (protocol == PROTO_TCP && port == 80),
    );
    check(
        "any port of one protocol",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - ports: [{protocol: SCTP}]",
        ),
        &ALL,
        |_, to, protocol, _| to != "x/a" || protocol == PROTO_SCTP,
    );
    check(
        "endPort range",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - ports: [{protocol: TCP, port: 81, endPort: 90}]",
        ),
        &[
            (PROTO_TCP, 80),
            (PROTO_TCP, 81),
            (PROTO_TCP, 85),
            (PROTO_TCP, 90),
            (PROTO_TCP, 91),
            (PROTO_UDP, 85),
        ],
        |_, to, protocol, port| to != "x/a" || (protocol == PROTO_TCP && (81..=90).contains(&port)),
    );
    check(
        "rules do not mix their peers and ports",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {pod: b}}}]\n    ports: [{port: 80}]\n  - from: [{podSelector: {matchLabels: {pod: c}}}]\n    ports: [{port: 81}]",
        ),
        &ALL,
        |from, to, protocol, port| {
            to != "x/a"
                || (protocol == PROTO_TCP
                    && ((from == "x/b" && port == 80) || (from == "x/c" && port == 81)))
        },
    );
}

#[test]
fn stacked_policies_are_a_union() {
    let yaml = policy(
        "x",
        "only-80",
        "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - ports: [{port: 80}]",
    ) + &policy(
        "x",
        "from-y",
        "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{namespaceSelector: {matchLabels: {ns: y}}}]",
    );
    check(
        "stacked, overlapping podSelectors",
        &yaml,
        &ALL,
        |from, to, protocol, port| {
            to != "x/a" || ns(from) == "y" || (protocol == PROTO_TCP && port == 80)
        },
    );
    let yaml = policy(
        "x",
        "only-80",
        "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - ports: [{port: 80}]",
    ) + &policy(
        "x",
        "all",
        "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{}]",
    );
    check(
        "ingress allow-all takes precedence",
        &yaml,
        &ALL,
        |_, _, _, _| true,
    );
    let yaml = policy(
        "x",
        "only-80",
        "  podSelector: {matchLabels: {pod: a}}\n  policyTypes: [Egress]\n  egress:\n  - ports: [{port: 80}]",
    ) + &policy(
        "x",
        "all",
        "  podSelector: {matchLabels: {pod: a}}\n  policyTypes: [Egress]\n  egress: [{}]",
    );
    check(
        "egress allow-all takes precedence",
        &yaml,
        &ALL,
        |_, _, _, _| true,
    );
}

#[test]
fn egress_isolation_and_client_side_denial() {
    check(
        "deny egress of one pod",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  policyTypes: [Egress]",
        ),
        &ALL,
        |from, _, _, _| from != "x/a",
    );
    check(
        "deny egress of all pods of a namespace",
        &policy("x", "p", "  podSelector: {}\n  policyTypes: [Egress]"),
        &ALL,
        |from, _, _, _| ns(from) != "x",
    );
    let yaml = policy(
        "x",
        "to-z",
        "  podSelector: {matchLabels: {pod: a}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{namespaceSelector: {matchLabels: {ns: z}}}]",
    ) + &policy("y", "allow-all", "  podSelector: {}\n  ingress: [{}]");
    check(
        "client-side denial even if the server allows",
        &yaml,
        &ALL,
        |from, to, _, _| from != "x/a" || ns(to) == "z",
    );
    check(
        "egress to a pod of another namespace by both selectors",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{namespaceSelector: {matchLabels: {ns: y}}, podSelector: {matchLabels: {pod: a}}}]",
        ),
        &ALL,
        |from, to, _, _| from != "x/a" || to == "y/a",
    );
    check(
        "Ingress and Egress types with only ingress rules",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  policyTypes: [Ingress, Egress]\n  ingress:\n  - from: [{podSelector: {matchLabels: {pod: b}}}]",
        ),
        &ALL,
        |from, to, _, _| from != "x/a" && (to != "x/a" || from == "x/b"),
    );
    let yaml = policy(
        "x",
        "a-no-egress",
        "  podSelector: {matchLabels: {pod: a}}\n  policyTypes: [Egress]",
    ) + &policy(
        "x",
        "b-from-a",
        "  podSelector: {matchLabels: {pod: b}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {pod: a}}}]",
    );
    check(
        "ingress and egress controlled independently",
        &yaml,
        &ALL,
        |from, to, _, _| from != "x/a" && to != "x/b",
    );
}

#[test]
fn ip_blocks_with_except() {
    check(
        "egress to a server in a CIDR block",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{ipBlock: {cidr: 10.244.2.2/32}}]",
        ),
        &ALL,
        |from, to, _, _| from != "x/a" || to == "y/b",
    );
    check(
        "except clause in a CIDR block",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{ipBlock: {cidr: 10.244.0.0/16, except: [10.244.2.2/32]}}]",
        ),
        &ALL,
        |from, to, _, _| from != "x/a" || to != "y/b",
    );
    let yaml = policy(
        "x",
        "except",
        "  podSelector: {matchLabels: {pod: a}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{ipBlock: {cidr: 10.244.0.0/16, except: [10.244.2.0/24]}}]",
    ) + &policy(
        "x",
        "cidr",
        "  podSelector: {matchLabels: {pod: a}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{ipBlock: {cidr: 10.244.2.2/32}}]",
    );
    check(
        "an IP in one rule's except and another's CIDR is allowed",
        &yaml,
        &ALL,
        |from, to, _, _| from != "x/a" || ns(to) != "y" || to == "y/b",
    );
    check(
        "ingress from a CIDR block with except",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{ipBlock: {cidr: 10.244.0.0/16, except: [10.244.3.0/24]}}]",
        ),
        &ALL,
        |from, to, _, _| to != "x/a" || ns(from) != "z",
    );
}

#[test]
fn an_invalid_policy_is_named_and_still_isolates() {
    let yaml = policy(
        "x",
        "broken",
        "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{ipBlock: {cidr: 10.244.0.0/33}}]",
    );
    let policies = parsed_policies(&yaml);
    let pods = cluster_pods();
    let labels = namespaces();
    let index: PolicyPods = pods.iter().cloned().collect();
    let cluster = PolicyCluster::new(&index, &labels);
    let (result, errors) = pod_policy(&policies, &cluster, &pods[0]);
    assert_eq!(
        errors,
        vec![
            "NetworkPolicy x/broken: spec.ingress[0].from[0].ipBlock.cidr: \"10.244.0.0/33\" is not a CIDR; it isolates its pods and allows nothing"
        ]
    );
    let ingress = result.ingress.expect("isolated");
    assert!(ingress.rules.is_empty());
    assert!(result.egress.is_none());
}

#[test]
fn peers_named_alike_by_two_policies_are_picked_once_and_give_each_its_rule() {
    let peers = "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{namespaceSelector: {matchLabels: {ns: y}}, podSelector: {matchLabels: {pod: b}}}]";
    let two_ports = |port: u16| format!("{peers}\n    ports: [{{protocol: TCP, port: {port}}}]");
    let yaml = policy("x", "first", &two_ports(80)) + &policy("x", "second", &two_ports(443));
    let policies = parsed_policies(&yaml);
    let pods = cluster_pods();
    let labels = namespaces();
    let index: PolicyPods = pods.iter().cloned().collect();
    let shared = PolicyCluster::new(&index, &labels);
    let (both, errors) = pod_policy(&policies, &shared, &pods[0]);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(
        shared.peers_picked(),
        1,
        "the same selectors over the same namespaces"
    );
    let ingress = both.ingress.expect("isolated");
    assert_eq!(ingress.rules.len(), 2);
    // Each as compiled alone, in a compile of its own.
    for (rule, policy) in ingress.rules.iter().zip(&policies) {
        let alone = PolicyCluster::new(&index, &labels);
        let (one, _) = pod_policy(std::slice::from_ref(policy), &alone, &pods[0]);
        let one = one.ingress.expect("isolated").rules.remove(0);
        assert_eq!(rule.destinations, one.destinations);
        assert_eq!(rule.ports, one.ports);
    }
    let y_b = pods
        .iter()
        .find(|p| p.namespace == "y" && p.name == "b")
        .expect("y/b");
    let y_b: Vec<ipnet::IpNet> = y_b
        .addresses
        .iter()
        .map(|a| ipnet::IpNet::from(*a))
        .collect();
    assert_eq!(ingress.rules[0].destinations, y_b);
}

#[test]
fn protocol_specific_and_default_namespace_label_scenarios() {
    check(
        "a policy allowing only SCTP still isolates TCP and UDP",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - ports: [{protocol: SCTP, port: 80}]",
        ),
        &ALL,
        |_, to, protocol, port| to != "x/a" || (protocol == PROTO_SCTP && port == 80),
    );
    check(
        "no TCP when the policy names only UDP",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - ports: [{protocol: UDP, port: 81}]",
        ),
        &ALL,
        |_, to, protocol, port| to != "x/a" || (protocol == PROTO_UDP && port == 81),
    );
    check(
        "namespaceSelector on the default namespace name label",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}}]",
        ),
        &ALL,
        |from, to, _, _| to != "x/a" || ns(from) == "y",
    );
    check(
        "namespaceSelector expressions on the default namespace name label",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{namespaceSelector: {matchExpressions: [{key: kubernetes.io/metadata.name, operator: In, values: [y, z]}]}}]",
        ),
        &ALL,
        |from, to, _, _| to != "x/a" || ns(from) != "x",
    );
    check(
        "ingress from pods in all namespaces",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{namespaceSelector: {}}]",
        ),
        &ALL,
        |_, _, _, _| true,
    );
    check(
        "ingress and egress rules together",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  policyTypes: [Ingress, Egress]\n  ingress:\n  - from: [{namespaceSelector: {matchLabels: {ns: y}}}]\n  egress:\n  - to: [{namespaceSelector: {matchLabels: {ns: z}}}]\n    ports: [{port: 80, protocol: UDP}]",
        ),
        &ALL,
        |from, to, protocol, port| {
            (to != "x/a" || ns(from) == "y")
                && (from != "x/a" || (ns(to) == "z" && protocol == PROTO_UDP && port == 80))
        },
    );
    check(
        "named ports in an egress rule match only peers that have them",
        &policy(
            "x",
            "p",
            "  podSelector: {matchLabels: {pod: a}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{ipBlock: {cidr: 10.244.2.0/24}}, {podSelector: {matchLabels: {pod: b}}}]\n    ports: [{port: serve-81-tcp}]",
        ),
        &ALL,
        // The ipBlock peers (all of y) have no names to resolve: only x/b on TCP 81.
        |from, to, protocol, port| {
            from != "x/a" || (to == "x/b" && protocol == PROTO_TCP && port == 81)
        },
    );
}

/// Pods added, relabelled and removed one at a time: what a pair of selectors picks through
/// the namespace and pod label indexes is what looking at every pod picks, in the same order.
#[test]
fn the_label_index_picks_what_a_scan_of_every_pod_picks() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

    use super::{pods::selects, select::select_pods};

    let mut pods = PolicyPods::default();
    let mut rng = crate::test_rng::TestRng::new(11);
    let mut next = |bound: u64| rng.below(bound);
    let labels = namespaces();
    let everywhere = LabelSelector::default();
    let selector = |app: u64, tier: Option<u64>, not_tier: bool| LabelSelector {
        match_labels: Some(
            [("app".to_owned(), format!("a{app}"))]
                .into_iter()
                .chain(tier.map(|t| ("tier".to_owned(), format!("t{t}"))))
                .collect(),
        ),
        match_expressions: not_tier.then(|| {
            vec![LabelSelectorRequirement {
                key: "tier".into(),
                operator: "NotIn".into(),
                values: Some(vec!["t0".into()]),
            }]
        }),
    };
    for step in 0..400 {
        let namespace = NAMESPACES[next(3) as usize];
        let name = format!("p{}", next(20));
        if next(5) == 0 {
            pods.remove(namespace, &name);
        } else {
            pods.insert(PolicyPod {
                namespace: namespace.into(),
                name,
                labels: [
                    ("app".to_owned(), format!("a{}", next(3))),
                    ("tier".to_owned(), format!("t{}", next(2))),
                ]
                .into(),
                addresses: Vec::new(),
                named_ports: BTreeMap::new(),
            });
        }
        let cluster = PolicyCluster::new(&pods, &labels);
        let in_namespace = |ns: &str| LabelSelector {
            match_labels: Some([("ns".to_owned(), ns.to_owned())].into()),
            ..LabelSelector::default()
        };
        for chosen in [
            selector(next(3), None, false),
            selector(next(3), Some(next(2)), false),
            selector(next(3), None, true),
        ] {
            for namespaces in [everywhere.clone(), in_namespace("y"), in_namespace("w")] {
                let picked: Vec<String> = select_pods(&cluster, &namespaces, Some(&chosen))
                    .iter()
                    .map(|p| p.key())
                    .collect();
                let scanned: Vec<String> = pods
                    .iter()
                    .filter(|p| {
                        selects(&namespaces, labels.get(&p.namespace).expect("labelled"))
                            .expect("valid")
                    })
                    .filter(|p| selects(&chosen, &p.labels).expect("valid"))
                    .map(PolicyPod::key)
                    .collect();
                assert_eq!(picked, scanned, "step {step}");
            }
        }
        assert_eq!(pods.len(), pods.iter().count());
    }
}

/// Collected at once (each namespace's maps built from sorted runs) equals inserted one by
/// one, pods of a name given twice included (the later stays).
#[test]
fn pods_collected_at_once_equal_pods_inserted_one_by_one() {
    let mut rng = crate::test_rng::TestRng::new(5);
    for round in 0..50 {
        let pods: Vec<PolicyPod> = (0..rng.below(300))
            .map(|_| PolicyPod {
                namespace: NAMESPACES[rng.below(3) as usize].into(),
                name: format!("p{}", rng.below(60)),
                labels: (0..rng.below(4))
                    .map(|_| (format!("k{}", rng.below(3)), format!("v{}", rng.below(3))))
                    .collect(),
                addresses: Vec::new(),
                named_ports: BTreeMap::new(),
            })
            .collect();
        let mut one_by_one = PolicyPods::default();
        for pod in pods.clone() {
            one_by_one.insert(pod);
        }
        let at_once: PolicyPods = pods.into_iter().collect();
        assert_eq!(at_once, one_by_one, "round {round}");
        assert_eq!(at_once.len(), one_by_one.len());
    }
}

/// Pods relabelled, added and removed, and policies changed, one at a time: the compile that
/// recompiles only the local pods a change can affect gives what compiling them all gives.
/// A policy set as the kernel sees it: a set made from its last version numbers its tables
/// in another order than a set compiled whole.
type Decided<'a> = (
    (
        &'a String,
        super::pods::Direction,
        &'a [super::pod_rules::RuleRef],
        &'a [super::Rule],
    ),
    Vec<(ipnet::IpNet, Result<super::Decision, super::PortTable>)>,
);

fn decided(sets: &BTreeMap<String, super::pod_rules::PolicySet>) -> Vec<(&String, Decided<'_>)> {
    sets.iter()
        .map(|(name, set)| {
            let compiled = &set.compiled;
            let prefixes = compiled
                .prefixes
                .iter()
                .map(|(prefix, decision)| match decision {
                    super::Decision::Table(index) => {
                        (*prefix, Err(compiled.tables[*index].clone()))
                    }
                    other => (*prefix, Ok(*other)),
                })
                .collect();
            let what = (&set.namespace, set.direction, &set.refs[..], &set.rules[..]);
            (name, (what, prefixes))
        })
        .collect()
}

#[test]
fn recompiling_only_the_pods_a_change_affects_gives_the_full_compile() {
    use super::admin::AdminPolicies;
    use super::{
        pods::PolicyChanges,
        policy::{CompiledPolicies, PodRulesCache, policy_sets, policy_sets_since},
    };

    let labels = namespaces();
    let mut pods: PolicyPods = cluster_pods().into_iter().collect();
    // x's pods are this node's; peers in every namespace, by namespace and by pod label.
    let local: Vec<String> = PODS.iter().map(|p| format!("x/{p}")).collect();
    let policy_text = |port: u32| {
        format!(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
             metadata: {{name: from-y, namespace: x}}\n\
             spec:\n  podSelector: {{matchLabels: {{pod: a}}}}\n  ingress:\n\
             \x20 - from: [{{namespaceSelector: {{matchLabels: {{ns: y}}}}, podSelector: {{matchLabels: {{pod: b}}}}}}]\n\
             \x20   ports: [{{port: {port}}}]\n"
        )
    };
    // Kept as the same objects while from-y changes: the pods' parts of them are reused.
    let others = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
             metadata: {name: same-namespace, namespace: x}\n\
             spec:\n  podSelector: {matchLabels: {pod: b}}\n  ingress: [{from: [{podSelector: {}}]}]\n\
             \x20 egress: [{to: [{podSelector: {matchLabels: {pod: c}}}]}]\n\
             ---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
             metadata: {name: from-c, namespace: x}\n\
             spec:\n  podSelector: {}\n  ingress:\n\
             \x20 - from: [{namespaceSelector: {}, podSelector: {matchLabels: {pod: c}}}]\n\
             \x20   ports: [{port: 443}]\n";
    let parse = parsed_policies;
    let others = parse(others);
    let mut policies = parse(&policy_text(80));
    policies.extend(others.iter().cloned());
    let admin = AdminPolicies::default();
    let mut cache = PodRulesCache::default();
    let mut since = CompiledPolicies::default();
    let mut changes = PolicyChanges::everything();
    let mut rng = crate::test_rng::TestRng::new(5);
    let mut next = |bound: u64| rng.below(bound);
    for step in 0..200 {
        let cluster = PolicyCluster::new(&pods, &labels);
        let before = (since.sets.clone(), since.pods.clone());
        let done = policy_sets_since(
            &policies, &cluster, &local, &mut since, &admin, &mut cache, &changes,
        );
        let cluster = PolicyCluster::new(&pods, &labels);
        let full = policy_sets(&policies, &cluster, &local, &BTreeMap::new(), &admin);
        assert_eq!(decided(&since.sets), decided(&full.sets), "step {step}");
        assert_eq!(since.pods, full.pods, "step {step}");
        assert_eq!(since.errors, full.errors, "step {step}");
        assert_eq!(done.changed, before.1 != since.pods, "step {step}");
        if !done.changed {
            assert_eq!(before.0, since.sets, "step {step}");
        }
        changes = PolicyChanges::default();
        let before = pods.clone();
        let namespace = NAMESPACES[next(3) as usize];
        let name = PODS[next(3) as usize];
        match next(4) {
            0 => {
                policies = parse(&policy_text(80 + next(2) as u32));
                policies.extend(others.iter().cloned());
                changes.policies.insert("x".into());
            }
            1 => {
                pods.remove(namespace, name);
                changes.note_pod(namespace, name);
            }
            _ => {
                pods.insert(PolicyPod {
                    namespace: namespace.into(),
                    name: name.into(),
                    labels: [("pod".to_owned(), PODS[next(3) as usize].to_owned())].into(),
                    addresses: vec![[10, 244, next(250) as u8, next(250) as u8].into()],
                    named_ports: BTreeMap::new(),
                });
                changes.note_pod(namespace, name);
            }
        }
        // As the agent does: the changed pods' labels before and after.
        changes.label(&before, &pods);
    }
}

/// A pod change recompiles only the local pods a rule of whose picked it, before or after the
/// change, and the changed pod itself: a pod added beside local pods that no rule picks (in
/// their own namespace, too) recompiles none of them.
#[test]
fn a_pod_change_recompiles_only_the_local_pods_whose_rules_pick_it() {
    use super::admin::AdminPolicies;
    use super::{
        pods::PolicyChanges,
        policy::{CompiledPolicies, PodRulesCache, Recompiled, policy_sets, policy_sets_since},
    };

    let labels = namespaces();
    let mut pods: PolicyPods = cluster_pods().into_iter().collect();
    let local: Vec<String> = PODS.iter().map(|p| format!("x/{p}")).collect();
    let policies: Vec<Arc<NetworkPolicy>> = vec![Arc::new(
        serde_yaml::from_str(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
             metadata: {name: from-y, namespace: x}\n\
             spec:\n  podSelector: {matchLabels: {pod: a}}\n  ingress:\n\
             \x20 - from: [{namespaceSelector: {matchLabels: {ns: y}}, podSelector: {matchLabels: {pod: b}}}]\n",
        )
        .expect("NetworkPolicy"),
    )];
    let admin = AdminPolicies::default();
    let mut cache = PodRulesCache::default();
    let mut since = CompiledPolicies::default();
    let pod = |namespace: &str, name: &str, label: &str, last: u8| PolicyPod {
        namespace: namespace.into(),
        name: name.into(),
        labels: [("pod".to_owned(), label.to_owned())].into(),
        addresses: vec![[10, 244, 9, last].into()],
        named_ports: BTreeMap::new(),
    };
    let recompiled = |pods: usize, changed: bool| Recompiled { pods, changed };
    // (what changes, what the compile after it does)
    let steps: Vec<(PolicyPod, Recompiled)> = vec![
        // In a namespace the rule picks, but not a pod it picks.
        (pod("y", "d", "c", 1), recompiled(0, false)),
        // Beside the local pods, in their own namespace: no rule picks pods of x.
        (pod("x", "d", "a", 2), recompiled(0, false)),
        // Picked: x/a's ingress takes it.
        (pod("y", "e", "b", 3), recompiled(1, true)),
        // No longer picked: its labels before the change were.
        (pod("y", "e", "c", 3), recompiled(1, true)),
        // A local pod relabelled (now isolated): itself only.
        (pod("x", "b", "a", 4), recompiled(1, true)),
    ];
    let mut changes = PolicyChanges::everything();
    let mut expected = recompiled(PODS.len(), true);
    let mut compile = |pods: &PolicyPods, changes: &PolicyChanges, step: usize| {
        let cluster = PolicyCluster::new(pods, &labels);
        let done = policy_sets_since(
            &policies, &cluster, &local, &mut since, &admin, &mut cache, changes,
        );
        let full = policy_sets(&policies, &cluster, &local, &BTreeMap::new(), &admin);
        assert_eq!(since.sets, full.sets, "step {step}");
        assert_eq!(since.pods, full.pods, "step {step}");
        done
    };
    for (step, (changed, next)) in steps.into_iter().enumerate() {
        assert_eq!(compile(&pods, &changes, step), expected, "step {step}");
        let before = pods.clone();
        changes = PolicyChanges::default();
        changes.note_pod(&changed.namespace, &changed.name);
        pods.insert(changed);
        changes.label(&before, &pods);
        expected = next;
    }
    assert_eq!(compile(&pods, &changes, 99), expected);
}

/// By identity, a peer pod is one entry of the set for its namespace and labels, and none of
/// its addresses is a prefix of the set; an egress rule whose ports name container ports
/// (which resolve on each peer) still names the peers' addresses.
#[test]
fn peer_pods_are_named_by_identity_unless_their_own_ports_resolve_the_rule() {
    let yaml = policy(
        "x",
        "from-b",
        "  podSelector: {matchLabels: {pod: a}}\n  policyTypes: [Ingress, Egress]\n  \
         ingress: [{from: [{namespaceSelector: {}, podSelector: {matchLabels: {pod: b}}}], ports: [{protocol: TCP, port: 80}]}]\n  \
         egress: [{to: [{podSelector: {matchLabels: {pod: c}}}], ports: [{protocol: TCP, port: serve-81-tcp}]}]",
    );
    let compiled = compile(&yaml, true);
    let identities = compiled.identities.as_ref().expect("identities");
    let (ingress, egress) = &compiled.sets[0];
    let ingress = ingress.as_ref().expect("x/a is isolated for ingress");
    // x/b, y/b and z/b: one identity each (their namespaces differ).
    let bs: Vec<u32> = [1, 4, 7].map(|i| identities[i]).into();
    assert_eq!(ingress.peers.keys().copied().collect::<Vec<_>>(), bs);
    assert!(ingress.prefixes.is_empty(), "{:?}", ingress.prefixes);
    let allowed = ingress
        .lookup_peer(bs[1], PROTO_TCP, 80)
        .expect("y/b allowed on TCP 80");
    assert_eq!(allowed.verdict, Verdict::Allow);
    assert_eq!(ingress.lookup_peer(bs[1], PROTO_TCP, 81), None);
    assert_eq!(ingress.lookup_peer(identities[0], PROTO_TCP, 80), None);
    let egress = egress.as_ref().expect("x/a is isolated for egress");
    assert!(egress.peers.is_empty());
    let xc = compiled.pods[2].addresses[0];
    assert_eq!(
        egress.lookup(xc, PROTO_TCP, 81).map(|o| o.verdict),
        Some(Verdict::Allow)
    );
}

/// A NetworkPolicy of `nets` (IPv6 networks) allowing ingress to x/a from each.
fn ip_block_policy(name: &str, nets: &[String]) -> String {
    let peers: Vec<String> = nets
        .iter()
        .map(|n| format!("{{ipBlock: {{cidr: \"{n}\"}}}}"))
        .collect();
    policy(
        "x",
        name,
        &format!(
            "  podSelector: {{matchLabels: {{pod: a}}}}\n  ingress:\n  - from: [{}]",
            peers.join(", ")
        ),
    )
}

/// Nine IPv6 networks of nine lengths 13 bits apart, the `n`th of each length: alone, the
/// cheapest way down to the kernel's eight lengths is 2^13 entries.
fn spread_nets(n: u16) -> Vec<String> {
    [16u8, 29, 42, 55, 68, 81, 94, 107, 120]
        .iter()
        .map(|len| format!("fd{:02x}:{n:x}::/{len}", n % 256))
        .collect()
}

/// Whether x/a's compiled ingress set allows `from` on TCP 80.
fn x_a_allows(compiled: &super::policy::CompiledPolicies, from: &str) -> bool {
    let Some(name) = compiled.pods.get("x/a").and_then(|s| s.ingress.as_ref()) else {
        return true;
    };
    compiled.sets[name]
        .compiled
        .lookup(from.parse().unwrap(), PROTO_TCP, 80)
        .is_some_and(|o| o.verdict == Verdict::Allow)
}

#[test]
fn a_policy_too_large_to_compile_is_refused_alone_and_the_others_hold() {
    use super::admin::AdminPolicies;
    use super::policy::policy_sets;
    // 2^16 entries for one pod (::/0 expanded into /16s): more than one policy may
    // have. Another policy of the namespace still allows y/b.
    let huge: Vec<String> = [0u8, 16, 32, 48, 64, 80, 96, 112, 128]
        .iter()
        .map(|len| format!("{}/{len}", if *len == 0 { "::" } else { "2001:db8::" }))
        .collect();
    let yaml = ip_block_policy("huge", &huge)
        + &policy(
            "x",
            "from-y-b",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{namespaceSelector: {matchLabels: {ns: y}}, podSelector: {matchLabels: {pod: b}}}]",
        );
    let policies = parsed_policies(&yaml);
    let pods: PolicyPods = cluster_pods().into_iter().collect();
    let labels = namespaces();
    let cluster = PolicyCluster::new(&pods, &labels);
    let started = std::time::Instant::now();
    let compiled = policy_sets(
        &policies,
        &cluster,
        &["x/a".to_owned()],
        &BTreeMap::new(),
        &AdminPolicies::default(),
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    assert_eq!(compiled.errors.len(), 1, "{:?}", compiled.errors);
    let error = &compiled.errors[0];
    assert!(
        error.starts_with("NetworkPolicy x/huge: spec.ingress[].from[].ipBlock: its IPv6 networks would need about 65544 address entries for one pod, more than the 16384 one policy may have"),
        "{error}"
    );
    assert!(
        error.ends_with("it isolates its pods and allows nothing"),
        "{error}"
    );
    assert!(
        x_a_allows(&compiled, "10.244.2.2"),
        "y/b, by the other policy"
    );
    assert!(
        !x_a_allows(&compiled, "2001:db8::1"),
        "the refused policy allows nothing"
    );
    assert!(!x_a_allows(&compiled, "10.244.2.1"), "y/a: still isolated");
}

#[test]
fn policies_that_fit_alone_but_not_together_refuse_the_largest_until_the_rest_fit() {
    use super::admin::AdminPolicies;
    use super::{
        pods::PolicyChanges,
        policy::{CompiledPolicies, PodRulesCache, policy_sets_since},
    };
    // Nine policies of 8,201 entries each alone; together 9 x 2^13 expanded entries, more
    // than one set holds: two are refused (the first of the largest each time), seven hold.
    let all: Vec<String> = (0..9)
        .map(|n| ip_block_policy(&format!("p{n}"), &spread_nets(n)))
        .collect();
    let pods: PolicyPods = cluster_pods().into_iter().collect();
    let labels = namespaces();
    let admin = AdminPolicies::default();
    let local = ["x/a".to_owned()];
    let mut cache = PodRulesCache::default();
    let mut since = CompiledPolicies::default();
    let policies = parsed_policies(&all.concat());
    let cluster = PolicyCluster::new(&pods, &labels);
    policy_sets_since(
        &policies,
        &cluster,
        &local,
        &mut since,
        &admin,
        &mut cache,
        &PolicyChanges::everything(),
    );
    let refused: Vec<&str> = since
        .errors
        .iter()
        .map(|e| e.split(':').next().unwrap())
        .collect();
    assert_eq!(
        refused,
        vec!["NetworkPolicy x/p0", "NetworkPolicy x/p1"],
        "{:?}",
        since.errors
    );
    assert!(
        since.errors[0].contains("with the pod x/a's other policies"),
        "{}",
        since.errors[0]
    );
    assert!(!x_a_allows(&since, "fd00:0::1"), "p0 refused");
    assert!(x_a_allows(&since, "fd02:2::1"), "p2 holds");
    assert!(x_a_allows(&since, "fd08:8::1"), "p8 holds");
    // Two policies gone: the rest fit, the refused ones included (a refusal is not kept).
    let policies = parsed_policies(&all[..7].concat());
    let cluster = PolicyCluster::new(&pods, &labels);
    let mut changes = PolicyChanges::default();
    changes.policies.insert("x".into());
    policy_sets_since(
        &policies, &cluster, &local, &mut since, &admin, &mut cache, &changes,
    );
    assert!(since.errors.is_empty(), "{:?}", since.errors);
    assert!(x_a_allows(&since, "fd00:0::1"), "p0 now holds");
}

/// The local pods' sets together stay within the agent's budget (the maps' capacity): the set
/// that would pass it is refused as a set too large is (its pod's policy allows nothing, the
/// error names the budget), the other pods keep theirs, and once room is made the refused
/// pod is compiled again though nothing it reads changed.
#[test]
fn the_policy_sets_of_all_local_pods_stay_within_the_budget() {
    use super::admin::AdminPolicies;
    use super::{
        pods::PolicyChanges,
        policy::{CompiledPolicies, EntryBudget, PodRulesCache, policy_sets_since},
    };
    let allows = |compiled: &CompiledPolicies, pod: &str, from: &str| {
        let name = compiled.pods[pod].ingress.as_ref().expect("isolated");
        compiled.sets[name]
            .compiled
            .lookup(from.parse().unwrap(), PROTO_TCP, 80)
            .is_some_and(|o| o.verdict == Verdict::Allow)
    };
    let blocks = |first: u8| {
        (0..4)
            .map(|n| format!("{{ipBlock: {{cidr: 192.0.{}.0/24}}}}", first + n))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let of = |namespace: &str, first: u8| {
        policy(
            namespace,
            "web",
            &format!(
                "  podSelector: {{matchLabels: {{pod: a}}}}\n  ingress:\n  - from: [{}]",
                blocks(first)
            ),
        )
    };
    let pods: PolicyPods = cluster_pods().into_iter().collect();
    let labels = namespaces();
    let admin = AdminPolicies::default();
    let local = ["x/a".to_owned(), "y/a".to_owned()];
    let compile = |yaml: &str,
                   since: &mut CompiledPolicies,
                   cache: &mut PodRulesCache,
                   changes: &PolicyChanges| {
        let policies = parsed_policies(yaml);
        let cluster = PolicyCluster::new(&pods, &labels);
        policy_sets_since(&policies, &cluster, &local, since, &admin, cache, changes);
    };
    let both = of("x", 10) + &of("y", 20);
    // What each set takes, with room for both.
    let mut roomy = CompiledPolicies::default();
    compile(
        &both,
        &mut roomy,
        &mut PodRulesCache::default(),
        &PolicyChanges::everything(),
    );
    assert!(roomy.errors.is_empty(), "{:?}", roomy.errors);
    let entries = |pod: &str| {
        roomy.sets[roomy.pods[pod].ingress.as_ref().unwrap()]
            .compiled
            .entries()
    };
    let (x, y) = (entries("x/a"), entries("y/a"));
    assert!(x > 1 && y > 1, "{x} {y}");
    // One entry short: x/a (compiled first) keeps its set, y/a's policy is refused.
    let mut since = CompiledPolicies {
        budget: EntryBudget(x + y - 1),
        ..CompiledPolicies::default()
    };
    let mut cache = PodRulesCache::default();
    compile(&both, &mut since, &mut cache, &PolicyChanges::everything());
    assert_eq!(
        since.errors,
        [format!(
            "NetworkPolicy y/web: with the pod y/a's other policies, its {y} entries would take the \
             node's policy sets past the agent's budget of {} (--max-acl-entries; {x} held by other \
             sets); it isolates its pods and allows nothing",
            x + y - 1
        )]
    );
    assert!(allows(&since, "x/a", "192.0.10.1"));
    assert!(
        !allows(&since, "y/a", "192.0.20.1"),
        "refused: allows nothing"
    );
    let held: usize = since.sets.values().map(|s| s.compiled.entries()).sum();
    assert!(held < x + y, "{held}");
    // x's policy goes (a change in x alone): y/a is compiled again and now fits.
    let mut changes = PolicyChanges::default();
    changes.policies.insert("x".into());
    compile(&of("y", 20), &mut since, &mut cache, &changes);
    assert!(since.errors.is_empty(), "{:?}", since.errors);
    assert!(allows(&since, "y/a", "192.0.20.1"));
}
