//! One bad object fails alone: random malformed objects of every kind the agent reads, added
//! to a valid cluster, leave what the valid objects compile to exactly as it was, and each is
//! refused by name. Every stage's pure compile is run as the agent runs it: the model and the
//! overlay, the Services, NetworkPolicies, admin policies and EgressFirewalls, egress IPs,
//! multicast.

use crate::{
    pipeline::Desired,
    rejected::Rejection,
    source::{ClusterState, add_documents},
    test_rng::TestRng,
};

/// A small valid cluster: two nodes (this one, `a`, and `b`) with creation times, pods on
/// both, a Service with endpoints on both, a NetworkPolicy, an EgressFirewall, an EgressIP,
/// an admin policy, a multicast namespace.
const VALID: &str = r#"
apiVersion: operator.openshift.io/v1
kind: Network
metadata: {name: cluster}
spec:
  clusterNetwork: [{cidr: 10.244.0.0/16, hostPrefix: 24}]
  serviceNetwork: [10.96.0.0/16]
  defaultNetwork: {type: OVNKubernetes}
---
apiVersion: v1
kind: Node
metadata: {name: a, creationTimestamp: "2026-01-01T00:00:00Z", labels: {k8s.ovn.org/egress-assignable: ""}}
spec: {podCIDRs: [10.244.1.0/24]}
status: {addresses: [{type: InternalIP, address: 10.99.0.1}]}
---
apiVersion: v1
kind: Node
metadata: {name: b, creationTimestamp: "2026-01-01T00:00:00Z"}
spec: {podCIDRs: [10.244.2.0/24]}
status: {addresses: [{type: InternalIP, address: 10.99.0.2}]}
---
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {team: shop}, annotations: {k8s.ovn.org/multicast-enabled: "true"}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop, labels: {app: web}}
spec: {nodeName: a, containers: [{name: c, image: i}]}
status: {phase: Running, podIPs: [{ip: 10.244.1.5}]}
---
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: shop, labels: {app: db}}
spec: {nodeName: b, containers: [{name: c, image: i}]}
status: {phase: Running, podIPs: [{ip: 10.244.2.6}]}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80, targetPort: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.244.1.5], conditions: {ready: true}}, {addresses: [10.244.2.6], conditions: {ready: true}}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: web-from-db, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  ingress: [{from: [{podSelector: {matchLabels: {app: db}}}, {ipBlock: {cidr: 192.0.2.0/24}}]}]
---
apiVersion: k8s.ovn.org/v1
kind: EgressFirewall
metadata: {name: default, namespace: shop}
spec: {egress: [{type: Allow, to: {cidrSelector: 198.51.100.0/24}}, {type: Deny, to: {cidrSelector: 0.0.0.0/0}}]}
---
apiVersion: k8s.ovn.org/v1
kind: EgressIP
metadata: {name: shop-out}
spec:
  egressIPs: [10.99.0.50]
  namespaceSelector: {matchLabels: {team: shop}}
status: {items: [{node: a, egressIP: 10.99.0.50}]}
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: pass-dns}
spec:
  priority: 10
  subject: {namespaces: {}}
  egress: [{name: dns, action: Allow, to: [{networks: [10.96.0.0/16]}], ports: [{portNumber: {protocol: UDP, port: 53}}]}]
"#;

/// Every stage's compile as the agent on node `a` runs it.
fn compile_all(state: &ClusterState) -> (Desired, Vec<String>) {
    crate::pipeline::compile_node(state, "a").expect("node a is there")
}

/// One malformed object of kind `kind`, named `bad-<n>` (in a namespace of its own where it
/// is namespaced, so that an invalid NetworkPolicy, which still isolates the pods it selects,
/// selects none of the valid ones), as YAML; and the words its refusal starts with.
fn malformed(kind: u64, n: u64, rng: &mut TestRng) -> (String, Option<String>) {
    let ns = format!("bad-ns-{n}");
    let name = format!("bad-{n}");
    let pick = rng.below(3);
    match kind {
        // A Node: no address; a CIDR of an older node; a CIDR that is no CIDR.
        0 => {
            let (spec, status) = match pick {
                0 => (
                    "{podCIDRs: [10.244.50.0/24]}",
                    "{addresses: [{type: Hostname, address: x}]}".to_owned(),
                ),
                1 => (
                    "{podCIDRs: [10.244.2.0/25]}",
                    format!(
                        "{{addresses: [{{type: InternalIP, address: 10.99.1.{}}}]}}",
                        n % 250
                    ),
                ),
                _ => (
                    "{podCIDRs: [10.244.300.0/24]}",
                    "{addresses: [{type: InternalIP, address: 10.99.9.999}]}".to_owned(),
                ),
            };
            (
                format!(
                    "apiVersion: v1\nkind: Node\nmetadata: {{name: {name}, creationTimestamp: \"2026-06-01T00:00:00Z\"}}\nspec: {spec}\nstatus: {status}\n"
                ),
                Some(format!("node {name}")),
            )
        }
        // A Pod: an address that is none; outside this node's CIDR on this node; no spec.
        1 => {
            let yaml = match pick {
                0 => format!(
                    "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: shop}}\nspec: {{nodeName: a, containers: [{{name: c, image: i}}]}}\nstatus: {{podIPs: [{{ip: 10.244.1.999}}]}}\n"
                ),
                1 => format!(
                    "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {{nodeName: a, containers: [{{name: c, image: i}}]}}\nstatus: {{podIPs: [{{ip: 10.244.2.{}}}]}}\n",
                    100 + n % 100
                ),
                _ => format!(
                    "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: 7\n"
                ),
            };
            (yaml, None)
        }
        // A Service: no address, no port, no protocol it can serve.
        2 => {
            let spec = match pick {
                0 => "{clusterIP: 300.1.1.1, ports: [{port: 80}]}",
                1 => "{clusterIP: 10.96.1.1, ports: [{port: 0}]}",
                _ => "{clusterIP: 10.96.1.2, ports: [{port: 80, protocol: ICMP}]}",
            };
            (
                format!(
                    "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {spec}\n"
                ),
                Some(format!("Service {ns}/{name}")),
            )
        }
        // An EndpointSlice of the valid Service with endpoints that are no addresses.
        3 => (
            format!(
                "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, namespace: shop, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}]\nendpoints: [{{addresses: [\"10.244.1.{}9\", \"fd00::1\"], conditions: {{ready: true}}}}]\n",
                900 + n % 99
            ),
            Some(format!("EndpointSlice shop/{name}")),
        ),
        // A Namespace whose annotations say nothing it can use.
        4 => (
            format!(
                "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {ns}, annotations: {{k8s.ovn.org/multicast-enabled: maybe, k8s.ovn.org/acl-logging: '{{allow: loud'}}}}\n"
            ),
            None,
        ),
        // A NetworkPolicy with a CIDR that is none, or a selector operator that is none (in a
        // namespace without pods here: refused by the agents whose pods it selects, which
        // it would isolate).
        5 => {
            let rule = if pick == 0 {
                "ingress: [{from: [{ipBlock: {cidr: 10.0.0.0/33}}]}]"
            } else {
                "ingress: [{from: [{podSelector: {matchExpressions: [{key: a, operator: Near}]}}]}]"
            };
            (
                format!(
                    "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {{podSelector: {{}}, {rule}}}\n"
                ),
                None,
            )
        }
        // An EgressFirewall of another name, or with a CIDR that is none.
        6 => {
            let (object, spec) = if pick == 0 {
                (
                    name.clone(),
                    "{egress: [{type: Deny, to: {cidrSelector: 0.0.0.0/0}}]}",
                )
            } else {
                (
                    "default".to_owned(),
                    "{egress: [{type: Deny, to: {cidrSelector: 10.0.0.300/8}}]}",
                )
            };
            (
                format!(
                    "apiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\nmetadata: {{name: {object}, namespace: {ns}}}\nspec: {spec}\n"
                ),
                Some(format!("EgressFirewall {ns}/{object}")),
            )
        }
        // An EgressIP with an address that is none.
        7 => (
            format!(
                "apiVersion: k8s.ovn.org/v1\nkind: EgressIP\nmetadata: {{name: {name}}}\nspec: {{egressIPs: [10.99.0.300], namespaceSelector: {{matchLabels: {{team: shop}}}}}}\n"
            ),
            None,
        ),
        // An admin policy with a priority out of range.
        8 => (
            format!(
                "apiVersion: policy.networking.k8s.io/v1alpha1\nkind: AdminNetworkPolicy\nmetadata: {{name: {name}}}\nspec: {{priority: 5000, subject: {{namespaces: {{}}}}, ingress: [{{action: Deny, from: [{{namespaces: {{}}}}]}}]}}\n"
            ),
            Some(format!("AdminNetworkPolicy {name}")),
        ),
        // Something that is not an object at all.
        _ => (format!("kind: [{name}\n"), None),
    }
}

#[test]
fn malformed_objects_of_every_kind_leave_the_valid_clusters_compile_as_it_was() {
    let mut valid = ClusterState::default();
    add_documents(&mut valid, "valid.yaml", VALID);
    let (want, refused) = compile_all(&valid);
    assert!(
        refused.is_empty(),
        "the valid cluster refuses nothing: {refused:?}"
    );
    let mut rng = TestRng::new(68);
    let mut seen_kinds = std::collections::BTreeSet::new();
    for round in 0..60 {
        let mut state = ClusterState::default();
        add_documents(&mut state, "valid.yaml", VALID);
        let mut named = Vec::new();
        for n in 0..1 + rng.below(6) {
            let kind = rng.below(10);
            seen_kinds.insert(kind);
            let (yaml, refusal) = malformed(kind, round * 10 + n, &mut rng);
            add_documents(&mut state, &format!("bad-{round}-{n}.yaml"), &yaml);
            named.extend(refusal);
        }
        let (got, refused) = compile_all(&state);
        assert_eq!(got, want, "round {round}: {refused:?}");
        // Each refusal names its object, and each is read back into it.
        for name in &named {
            assert!(
                refused.iter().any(|r| r.starts_with(name.as_str())),
                "round {round}: {name} not refused by name: {refused:?}"
            );
        }
        for line in &refused {
            let rejection = Rejection::of(line);
            assert_ne!(rejection.kind, "other", "round {round}: {line}");
        }
    }
    assert_eq!(seen_kinds.len(), 10, "every kind was tried");
}

/// The refusal lines of the whole agent are read back into their objects: no stage writes a
/// line the metrics and Events cannot place.
#[test]
fn every_stage_names_what_it_refuses_in_a_form_the_events_can_place() {
    let mut rng = TestRng::new(1);
    let mut state = ClusterState::default();
    add_documents(&mut state, "valid.yaml", VALID);
    for kind in 0..10 {
        for _ in 0..3 {
            let n = rng.below(1000);
            let (yaml, _) = malformed(kind, n, &mut rng);
            add_documents(&mut state, "bad.yaml", &yaml);
        }
    }
    let (_, refused) = compile_all(&state);
    assert!(refused.len() >= 10, "{refused:?}");
    for line in &refused {
        let rejection = Rejection::of(line);
        assert_ne!(rejection.kind, "other", "{line}");
        if rejection.kind != "manifest" {
            assert!(rejection.object.is_some(), "{line}");
        }
    }
}
