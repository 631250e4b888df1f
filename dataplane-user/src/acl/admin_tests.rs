//! Truth tables of the tier model: namespaces x, y, z (labelled `ns: <name>`), pods a, b, c in
//! each (labelled `pod: <name>`, serving TCP and UDP 80 and 81 under names `serve-80-tcp` ...),
//! all on this node, every pod probing every pod. The compiled sets decide each probe as the
//! kernel does (the client's egress set, then the server's ingress set; no match in a set is a
//! deny) and the whole 9 x 9 matrix must equal the expectation.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use k8s_openapi::api::networking::v1::NetworkPolicy;

use crate::api::adminpolicy::AdminObjects;

use super::{
    PROTO_TCP, PROTO_UDP, Verdict,
    admin::{AdminNode, AdminPolicies, AdminPolicy, ObjectKey, Validated, validate_all},
    pods::{NamespaceLabels, PolicyPod, PolicyPods},
    policy::{CompiledPolicies, policy_sets},
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
                for (protocol, text) in [(PROTO_TCP, "tcp"), (PROTO_UDP, "udp")] {
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

fn nodes() -> Vec<AdminNode> {
    vec![
        AdminNode {
            labels: [("role".to_owned(), "infra".to_owned())].into(),
            addresses: vec!["192.168.50.1".parse().unwrap()],
        },
        AdminNode {
            labels: [("role".to_owned(), "worker".to_owned())].into(),
            addresses: vec!["192.168.50.2".parse().unwrap()],
        },
    ]
}

/// The objects of a YAML stream, by kind.
fn objects(yaml: &str) -> (Vec<Arc<NetworkPolicy>>, AdminObjects) {
    let mut state = crate::source::ClusterState::default();
    crate::source::add_documents(&mut state, "test.yaml", yaml);
    assert!(state.rejected.is_empty(), "{:?}", state.rejected);
    let admin = state.admin_objects();
    (state.network_policies.to_vec(), admin)
}

fn validated(yaml: &str, last_good: &mut BTreeMap<ObjectKey, AdminPolicy>) -> Validated {
    let (_, admin) = objects(yaml);
    let mut validated = validate_all(&admin, last_good);
    validated.policies.nodes = nodes();
    validated
}

struct Compiled {
    pods: Vec<PolicyPod>,
    compiled: CompiledPolicies,
}

fn compile_with(yaml: &str, admin: &AdminPolicies) -> Compiled {
    let (policies, _) = objects(yaml);
    let pods = cluster_pods();
    let labels = namespaces();
    let index: PolicyPods = pods.iter().cloned().collect();
    let cluster = PolicyCluster::new(&index, &labels);
    let local: Vec<String> = pods.iter().map(PolicyPod::key).collect();
    let compiled = policy_sets(&policies, &cluster, &local, &BTreeMap::new(), admin);
    assert!(compiled.errors.is_empty(), "{:?}", compiled.errors);
    Compiled { pods, compiled }
}

fn compile(yaml: &str) -> Compiled {
    let validated = validated(yaml, &mut BTreeMap::new());
    assert!(validated.errors.is_empty(), "{:?}", validated.errors);
    compile_with(yaml, &validated.policies)
}

impl Compiled {
    /// What `pod`'s set of one direction decides for traffic with `peer` (the kernel's
    /// reading: no set, allowed; a set without a match, denied).
    fn allows(
        &self,
        pod: &PolicyPod,
        ingress: bool,
        peer: std::net::IpAddr,
        protocol: u8,
        port: u16,
    ) -> bool {
        let Some(sets) = self.compiled.pods.get(&pod.key()) else {
            return true;
        };
        let name = if ingress { &sets.ingress } else { &sets.egress };
        match name {
            None => true,
            Some(name) => self.compiled.sets[name]
                .compiled
                .lookup(peer, protocol, port)
                .is_some_and(|o| o.verdict == Verdict::Allow),
        }
    }

    fn matrix(&self, protocol: u8, port: u16) -> String {
        let mut out = String::new();
        for from in &self.pods {
            for to in &self.pods {
                let ok = self.allows(from, false, to.addresses[0], protocol, port)
                    && self.allows(to, true, from.addresses[0], protocol, port);
                out.push(if ok { '.' } else { 'X' });
            }
            out.push('\n');
        }
        out
    }
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

const PROBES: [(u8, u16); 4] = [
    (PROTO_TCP, 80),
    (PROTO_TCP, 81),
    (PROTO_UDP, 80),
    (PROTO_UDP, 81),
];

fn check_compiled(name: &str, compiled: &Compiled, rule: &impl Fn(&str, &str, u8, u16) -> bool) {
    for (protocol, port) in PROBES {
        let want = expected(|from, to| rule(from, to, protocol, port));
        assert_eq!(
            compiled.matrix(protocol, port),
            want,
            "{name}, protocol {protocol} port {port}: got (left) vs expected (right), rows are clients x/a..z/c"
        );
    }
}

fn check(name: &str, yaml: &str, rule: impl Fn(&str, &str, u8, u16) -> bool) {
    check_compiled(name, &compile(yaml), &rule);
}

fn ns(pod: &str) -> &str {
    &pod[..1]
}

fn anp(name: &str, priority: i32, spec: &str) -> String {
    format!(
        "---\napiVersion: policy.networking.k8s.io/v1alpha1\nkind: AdminNetworkPolicy\nmetadata: {{name: {name}}}\nspec:\n  priority: {priority}\n{spec}\n"
    )
}

fn banp(spec: &str) -> String {
    format!(
        "---\napiVersion: policy.networking.k8s.io/v1alpha1\nkind: BaselineAdminNetworkPolicy\nmetadata: {{name: default}}\nspec:\n{spec}\n"
    )
}

fn cnp(name: &str, tier: &str, priority: i32, spec: &str) -> String {
    format!(
        "---\napiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata: {{name: {name}}}\nspec:\n  tier: {tier}\n  priority: {priority}\n{spec}\n"
    )
}

fn netpol(namespace: &str, name: &str, spec: &str) -> String {
    format!(
        "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: {namespace}}}\nspec:\n{spec}\n"
    )
}

const SUBJECT_X: &str = "  subject: {namespaces: {matchLabels: {ns: x}}}";

fn from_ns(action: &str, namespace: &str) -> String {
    format!(
        "  - action: {action}\n    from: [{{namespaces: {{matchLabels: {{ns: {namespace}}}}}}}]"
    )
}

#[test]
fn an_admin_deny_wins_over_a_network_policy_that_allows() {
    let yaml = anp(
        "deny-y",
        10,
        &format!("{SUBJECT_X}\n  ingress:\n{}", from_ns("Deny", "y")),
    ) + &netpol("x", "allow-all", "  podSelector: {}\n  ingress: [{}]");
    check("deny beats NetworkPolicy", &yaml, |from, to, _, _| {
        !(ns(to) == "x" && ns(from) == "y")
    });
}

#[test]
fn an_admin_allow_wins_over_network_policy_isolation() {
    let yaml = anp(
        "allow-y",
        10,
        &format!("{SUBJECT_X}\n  ingress:\n{}", from_ns("Allow", "y")),
    ) + &netpol(
        "x",
        "deny-ingress",
        "  podSelector: {}\n  policyTypes: [Ingress]",
    );
    check("allow beats isolation", &yaml, |from, to, _, _| {
        ns(to) != "x" || ns(from) == "y"
    });
}

#[test]
fn pass_skips_the_rest_of_the_admin_tier_to_network_policy_then_baseline() {
    // x: y passes (priority 1), everyone else is denied (priority 2).
    let admin = anp(
        "pass-y",
        1,
        &format!("{SUBJECT_X}\n  ingress:\n{}", from_ns("Pass", "y")),
    ) + &anp(
        "deny-all",
        2,
        &format!("{SUBJECT_X}\n  ingress:\n  - action: Deny\n    from: [{{namespaces: {{}}}}]"),
    );
    // Nothing below: what passed is allowed.
    check("pass, nothing below", &admin, |from, to, _, _| {
        ns(to) != "x" || ns(from) == "y"
    });
    // The baseline denies y: what passed meets it.
    let with_baseline = admin.clone()
        + &banp(&format!(
            "{SUBJECT_X}\n  ingress:\n{}",
            from_ns("Deny", "y")
        ));
    check("pass, then baseline", &with_baseline, |_, to, _, _| {
        ns(to) != "x"
    });
    // A NetworkPolicy isolating x/a and allowing y on TCP 80: for x/a it decides what passed
    // and the baseline is not consulted; x/b and x/c still meet the baseline.
    let with_np = with_baseline
        + &netpol(
            "x",
            "a-from-y",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{namespaceSelector: {matchLabels: {ns: y}}}]\n    ports: [{port: 80}]",
        );
    check(
        "pass, then NetworkPolicy",
        &with_np,
        |from, to, protocol, port| {
            ns(to) != "x" || (to == "x/a" && ns(from) == "y" && protocol == PROTO_TCP && port == 80)
        },
    );
}

#[test]
fn the_baseline_applies_only_where_no_network_policy_isolates() {
    let yaml = banp(&format!(
        "  subject: {{namespaces: {{}}}}\n  ingress:\n{}",
        from_ns("Deny", "z")
    )) + &netpol("y", "allow-all", "  podSelector: {}\n  ingress: [{}]");
    check("baseline under NetworkPolicy", &yaml, |from, to, _, _| {
        ns(from) != "z" || ns(to) == "y"
    });
}

#[test]
fn rules_are_first_match_in_order_and_policies_by_priority() {
    let spec = format!(
        "{SUBJECT_X}\n  ingress:\n  - action: Allow\n    from: [{{namespaces: {{}}}}]\n    ports: [{{portNumber: {{protocol: TCP, port: 80}}}}]\n  - action: Deny\n    from: [{{namespaces: {{}}}}]"
    );
    check(
        "rule order",
        &anp("ordered", 5, &spec),
        |_, to, protocol, port| ns(to) != "x" || (protocol == PROTO_TCP && port == 80),
    );
    // Priority: a deny at 5 before an allow at 10.
    let deny_first = anp(
        "deny",
        5,
        &format!("{SUBJECT_X}\n  ingress:\n{}", from_ns("Deny", "y")),
    ) + &anp(
        "allow",
        10,
        &format!("{SUBJECT_X}\n  ingress:\n{}", from_ns("Allow", "y")),
    ) + &netpol(
        "x",
        "deny-ingress",
        "  podSelector: {}\n  policyTypes: [Ingress]",
    );
    check("deny first", &deny_first, |_, to, _, _| ns(to) != "x");
}

#[test]
fn a_live_object_reordered_by_priority_takes_effect_and_an_invalid_one_keeps_its_last_good_version()
{
    let isolate = netpol(
        "x",
        "deny-ingress",
        "  podSelector: {}\n  policyTypes: [Ingress]",
    );
    let objects = |deny: i32, allow: i32| {
        anp(
            "deny",
            deny,
            &format!("{SUBJECT_X}\n  ingress:\n{}", from_ns("Deny", "y")),
        ) + &anp(
            "allow",
            allow,
            &format!("{SUBJECT_X}\n  ingress:\n{}", from_ns("Allow", "y")),
        ) + &isolate
    };
    let mut last_good = BTreeMap::new();
    let first = objects(5, 10);
    let v = validated(&first, &mut last_good);
    check_compiled(
        "deny at 5",
        &compile_with(&first, &v.policies),
        &|_, to, _, _| ns(to) != "x",
    );
    let second = objects(20, 10);
    let v = validated(&second, &mut last_good);
    let allow_y = |from: &str, to: &str, _: u8, _: u16| ns(to) != "x" || ns(from) == "y";
    check_compiled(
        "deny moved to 20",
        &compile_with(&second, &v.policies),
        &allow_y,
    );
    // The allow turns invalid: its last good version (priority 10) stays.
    let third = objects(20, 1001);
    let v = validated(&third, &mut last_good);
    assert_eq!(v.errors.len(), 1, "{:?}", v.errors);
    assert!(
        v.errors[0].contains("AdminNetworkPolicy allow: spec.priority: 1001 is outside 0 to 1000")
            && v.errors[0].contains("last good version stays"),
        "{}",
        v.errors[0]
    );
    check_compiled(
        "invalid update",
        &compile_with(&third, &v.policies),
        &allow_y,
    );
}

#[test]
fn networks_peers_match_pod_addresses_and_nodes_peers_the_nodes_addresses() {
    let yaml = anp(
        "egress",
        3,
        &format!(
            "{SUBJECT_X}\n  egress:\n  - action: Deny\n    to: [{{networks: [10.244.2.0/24]}}]\n  - action: Deny\n    to: [{{nodes: {{matchLabels: {{role: infra}}}}}}]"
        ),
    );
    check("networks", &yaml, |from, to, _, _| {
        !(ns(from) == "x" && ns(to) == "y")
    });
    let compiled = compile(&yaml);
    let xa = &compiled.pods[0];
    let infra = "192.168.50.1".parse().unwrap();
    let worker = "192.168.50.2".parse().unwrap();
    assert!(!compiled.allows(xa, false, infra, PROTO_TCP, 10250));
    assert!(compiled.allows(xa, false, worker, PROTO_TCP, 10250));
}

#[test]
fn named_ports_resolve_on_the_destination_pod() {
    // Egress: the peer's port named serve-80-udp (UDP 80); ingress: the subject's serve-81-tcp.
    let yaml = anp(
        "named",
        3,
        &format!(
            "{SUBJECT_X}\n  egress:\n  - action: Deny\n    to: [{{namespaces: {{matchLabels: {{ns: y}}}}}}]\n    ports: [{{namedPort: serve-80-udp}}]\n  ingress:\n  - action: Deny\n    from: [{{namespaces: {{matchLabels: {{ns: z}}}}}}]\n    ports: [{{namedPort: serve-81-tcp}}]"
        ),
    );
    check("named ports", &yaml, |from, to, protocol, port| {
        let egress_denied = ns(from) == "x" && ns(to) == "y" && protocol == PROTO_UDP && port == 80;
        let ingress_denied =
            ns(to) == "x" && ns(from) == "z" && protocol == PROTO_TCP && port == 81;
        !egress_denied && !ingress_denied
    });
}

#[test]
fn cluster_network_policies_give_the_same_matrix_as_the_v1alpha1_kinds() {
    let v1alpha1 = anp(
        "pass-y",
        1,
        &format!("{SUBJECT_X}\n  ingress:\n{}", from_ns("Pass", "y")),
    ) + &anp(
        "deny-rest",
        2,
        &format!(
            "{SUBJECT_X}\n  ingress:\n  - action: Deny\n    from: [{{namespaces: {{}}}}]\n    ports: [{{portRange: {{protocol: TCP, start: 80, end: 81}}}}, {{portNumber: {{protocol: UDP, port: 81}}}}]"
        ),
    ) + &banp(&format!(
        "{SUBJECT_X}\n  ingress:\n{}",
        from_ns("Deny", "y")
    )) + &netpol(
        "x",
        "a-from-y",
        "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{namespaceSelector: {matchLabels: {ns: y}}}]",
    );
    let v1alpha2 = cnp(
        "pass-y",
        "Admin",
        1,
        &format!("{SUBJECT_X}\n  ingress:\n{}", from_ns("Pass", "y")),
    ) + &cnp(
        "deny-rest",
        "Admin",
        2,
        &format!(
            "{SUBJECT_X}\n  ingress:\n  - action: Deny\n    from: [{{namespaces: {{}}}}]\n    protocols: [{{tcp: {{destinationPort: {{range: {{start: 80, end: 81}}}}}}}}, {{udp: {{destinationPort: {{number: 81}}}}}}]"
        ),
    ) + &cnp(
        "baseline",
        "Baseline",
        0,
        &format!("{SUBJECT_X}\n  ingress:\n{}", from_ns("Deny", "y")),
    ) + &netpol(
        "x",
        "a-from-y",
        "  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from: [{namespaceSelector: {matchLabels: {ns: y}}}]",
    );
    let rule = |from: &str, to: &str, protocol: u8, port: u16| {
        if ns(to) != "x" {
            return true;
        }
        if ns(from) == "y" {
            return to == "x/a";
        }
        // Not passed: denied on TCP 80-81 and UDP 81, else NetworkPolicy (x/a isolated:
        // denied) or the baseline (no match for x, z: allowed).
        let denied = protocol == PROTO_TCP || port == 81;
        !denied && to != "x/a"
    };
    check("v1alpha1", &v1alpha1, rule);
    check("v1alpha2", &v1alpha2, rule);
    assert_eq!(
        compile(&v1alpha1).matrix(PROTO_UDP, 80),
        compile(&v1alpha2).matrix(PROTO_UDP, 80)
    );
}

#[test]
fn invalid_objects_are_rejected_naming_the_object_and_field() {
    let cases = [
        (
            anp("big", 1001, SUBJECT_X),
            "AdminNetworkPolicy big: spec.priority: 1001 is outside 0 to 1000",
        ),
        (
            banp(&format!(
                "{SUBJECT_X}\n  ingress:\n{}",
                from_ns("Pass", "y")
            )),
            "BaselineAdminNetworkPolicy default: spec.ingress[0].action: Pass is not allowed in a baseline policy",
        ),
        (
            cnp(
                "base",
                "Baseline",
                1,
                &format!("{SUBJECT_X}\n  ingress:\n{}", from_ns("Pass", "y")),
            ),
            "ClusterNetworkPolicy base: spec.ingress[0].action: Pass is not allowed in a baseline policy",
        ),
        (
            anp(
                "dns",
                1,
                &format!(
                    "{SUBJECT_X}\n  egress:\n  - action: Deny\n    to: [{{domainNames: [example.com]}}]"
                ),
            ),
            "AdminNetworkPolicy dns: spec.egress[0].to[0].domainNames: only an Allow (Accept) rule may name domains",
        ),
        (
            anp(
                "cidr",
                1,
                &format!(
                    "{SUBJECT_X}\n  egress:\n  - action: Deny\n    to: [{{networks: [10.0.0.0/33]}}]"
                ),
            ),
            "AdminNetworkPolicy cidr: spec.egress[0].to[0].networks[0]: \"10.0.0.0/33\" is not a CIDR",
        ),
        (
            anp(
                "both",
                1,
                "  subject: {namespaces: {}, pods: {namespaceSelector: {}, podSelector: {}}}",
            ),
            "AdminNetworkPolicy both: spec.subject: needs exactly one of namespaces and pods",
        ),
        (
            anp("neither", 1, "  subject: {}"),
            "AdminNetworkPolicy neither: spec.subject: needs exactly one of namespaces and pods",
        ),
        (
            cnp("tier", "Middle", 1, SUBJECT_X),
            "ClusterNetworkPolicy tier: spec.tier: \"Middle\" is not Admin or Baseline",
        ),
        (
            anp(
                "named",
                1,
                &format!(
                    "{SUBJECT_X}\n  egress:\n  - action: Allow\n    to: [{{networks: [10.0.0.0/8]}}]\n    ports: [{{namedPort: http}}]"
                ),
            ),
            "AdminNetworkPolicy named: spec.egress[0]: a named port with nodes, networks or domainNames peers, which have none",
        ),
    ];
    for (yaml, want) in cases {
        let v = validated(&yaml, &mut BTreeMap::new());
        assert_eq!(v.errors.len(), 1, "{yaml}: {:?}", v.errors);
        assert!(
            v.errors[0].starts_with(want) && v.errors[0].ends_with("it has no effect"),
            "{yaml}: {}",
            v.errors[0]
        );
        assert!(v.policies.admin.is_empty() && v.policies.baseline.is_empty());
    }
}

#[test]
fn equal_priorities_are_allowed_with_a_warning() {
    let yaml = anp("one", 7, SUBJECT_X) + &anp("two", 7, SUBJECT_X);
    let v = validated(&yaml, &mut BTreeMap::new());
    assert!(v.errors.is_empty(), "{:?}", v.errors);
    assert_eq!(v.policies.admin.len(), 2);
    assert_eq!(v.warnings.len(), 1, "{:?}", v.warnings);
    assert!(
        v.warnings[0].contains("same priority 7"),
        "{}",
        v.warnings[0]
    );
}

#[test]
fn pods_under_admin_policies_only_are_judged_and_audit_names_follow_ovn_kubernetes() {
    let yaml = anp(
        "deny-y",
        10,
        &format!("{SUBJECT_X}\n  ingress:\n{}", from_ns("Deny", "y")),
    );
    let compiled = compile(&yaml);
    // x's pods have an ingress set (no NetworkPolicy needed), no egress set; y's none.
    let xa = &compiled.compiled.pods["x/a"];
    assert!(xa.ingress.is_some() && xa.egress.is_none());
    assert!(!compiled.compiled.pods.contains_key("y/a"));
    let set = &compiled.compiled.sets[xa.ingress.as_ref().unwrap()];
    let outcome = set
        .compiled
        .lookup("10.244.2.1".parse().unwrap(), PROTO_TCP, 80)
        .expect("a decision");
    assert_eq!(outcome.verdict, Verdict::Deny);
    let reference = &set.refs[outcome.rule as usize];
    assert_eq!(
        reference.describe(),
        "admin tier: AdminNetworkPolicy deny-y ingress[0]"
    );
    // Everything else: the catch-all allow, which is no rule (never audited).
    let other = set
        .compiled
        .lookup("10.244.3.1".parse().unwrap(), PROTO_TCP, 80)
        .expect("a decision");
    assert_eq!(other.verdict, Verdict::Allow);
    assert_eq!(other.rule, dataplane_common::acl::ACL_RULE_EXEMPT);
}

#[test]
fn domain_names_allow_their_resolved_addresses_and_only_local_subjects_resolve_them() {
    let yaml = anp(
        "dns",
        3,
        &format!(
            "{SUBJECT_X}\n  egress:\n  - action: Allow\n    to: [{{domainNames: [DB.example.com.]}}]\n  - action: Deny\n    to: [{{networks: [10.244.0.0/16]}}]"
        ),
    );
    let mut validated = validated(&yaml, &mut BTreeMap::new());
    assert!(validated.errors.is_empty(), "{:?}", validated.errors);
    validated.policies.domains = [(
        "db.example.com".to_owned(),
        ["10.244.2.1".parse().unwrap()].into(),
    )]
    .into();
    let compiled = compile_with(&yaml, &validated.policies);
    // x reaches only y/a (the name's address): the deny covers the rest of the pod network.
    check_compiled("domain names", &compiled, &|from, to, _, _| {
        ns(from) != "x" || to == "y/a"
    });
    // The name is wanted only where a subject pod runs.
    let pods = cluster_pods();
    let labels = namespaces();
    let index: PolicyPods = pods.iter().cloned().collect();
    let cluster = PolicyCluster::new(&index, &labels);
    let in_x: Vec<&PolicyPod> = pods.iter().filter(|p| p.namespace == "x").collect();
    let in_y: Vec<&PolicyPod> = pods.iter().filter(|p| p.namespace == "y").collect();
    assert_eq!(
        super::admin::domain_names(&validated.policies, &cluster, &in_x),
        (["db.example.com".to_owned()].into(), BTreeSet::new())
    );
    assert_eq!(
        super::admin::domain_names(&validated.policies, &cluster, &in_y),
        (BTreeSet::new(), BTreeSet::new())
    );
}
