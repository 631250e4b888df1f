//! Hostile cluster objects at scale: a valid cluster's manifests, mutated at random (bytes
//! flipped, cut, doubled or inserted; a field's value replaced by another type, a huge or a
//! strange string, a deep nest; a field removed), decoded as the manifest source decodes them
//! and compiled through every stage as a node's agent compiles them
//! ([`dataplane_user::pipeline`]). Invariants on every case: no panic, no case slower than
//! [`CASE_LIMIT`], every refusal read back into the object it names (or a manifest's), and
//! what survived still compiles whole.

use std::{
    panic::AssertUnwindSafe,
    time::{Duration, Instant},
};

use anyhow::bail;
use dataplane_user::{
    rejected::Rejection,
    source::{ClusterState, add_documents},
};

/// The most one case may take (a decode and a compile of a dozen objects: milliseconds).
pub const CASE_LIMIT: Duration = Duration::from_secs(5);

/// A small valid cluster: every kind the agent reads, with fields of every shape.
pub const CORPUS: &str = r#"
apiVersion: operator.openshift.io/v1
kind: Network
metadata: {name: cluster}
spec:
  clusterNetwork: [{cidr: 10.244.0.0/16, hostPrefix: 24}, {cidr: "fd00:10:244::/48", hostPrefix: 64}]
  serviceNetwork: [10.96.0.0/16]
  defaultNetwork:
    type: OVNKubernetes
    ovnKubernetesConfig:
      genevePort: 6081
      mtu: 1400
      policyAuditConfig: {destination: "null", maxFileSize: 50, rateLimit: 20}
      egressIPConfig: {reachabilityTotalTimeoutSeconds: 1}
---
apiVersion: config.openshift.io/v1
kind: Network
metadata: {name: cluster}
spec:
  clusterNetwork: [{cidr: 10.244.0.0/16, hostPrefix: 24}, {cidr: "fd00:10:244::/48", hostPrefix: 64}]
  serviceNetwork: [10.96.0.0/16]
  networkType: Dataplane
  externalIP: {policy: {allowedCIDRs: [192.0.2.0/24], rejectedCIDRs: [192.0.2.128/25]}}
---
apiVersion: network.operator.openshift.io/v1
kind: EgressRouter
metadata: {name: router, namespace: shop, uid: 0f0e0d0c-0000-4000-8000-000000000001}
spec:
  mode: Redirect
  networkInterface: {macvlan: {mode: Bridge, master: eth1}}
  addresses: [{ip: 192.168.12.99/24, gateway: 192.168.12.1}]
  redirect:
    redirectRules: [{destinationIP: 203.0.113.25, port: 80, targetPort: 8080, protocol: TCP}]
    fallbackIP: 203.0.113.26
---
apiVersion: v1
kind: Node
metadata: {name: a, creationTimestamp: "2026-01-01T00:00:00Z", labels: {k8s.ovn.org/egress-assignable: ""}}
spec: {podCIDRs: [10.244.1.0/24, "fd00:10:244:1::/64"]}
status: {addresses: [{type: InternalIP, address: 10.99.0.1}, {type: InternalIP, address: "fd99::1"}]}
---
apiVersion: v1
kind: Node
metadata: {name: b, labels: {kubernetes.io/os: linux}}
spec: {podCIDR: 10.244.2.0/24}
status: {addresses: [{type: InternalIP, address: 10.99.0.2}]}
---
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {team: shop}, annotations: {k8s.ovn.org/multicast-enabled: "true", k8s.ovn.org/acl-logging: '{"deny":"alert"}'}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop, labels: {app: web}, annotations: {k8s.ovn.org/pod-networks: '{"default":{"ip_addresses":["10.244.1.5/24"],"mac_address":"0a:58:0a:f4:01:05"}}'}}
spec: {nodeName: a, containers: [{name: c, image: i, ports: [{name: http, containerPort: 8080}]}]}
status: {phase: Running, podIPs: [{ip: 10.244.1.5}, {ip: "fd00:10:244:1::5"}]}
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
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10]
  externalIPs: [192.0.2.10]
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}
  ports: [{name: http, port: 80, targetPort: http, nodePort: 30080, protocol: TCP}, {name: dns, port: 53, protocol: UDP}]
status: {loadBalancer: {ingress: [{ip: 198.51.100.7}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 53, protocol: UDP}]
endpoints: [{addresses: [10.244.1.5], conditions: {ready: true}, nodeName: a}, {addresses: [10.244.2.6], conditions: {ready: false, serving: true, terminating: true}, nodeName: b}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: web-from-db, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Ingress, Egress]
  ingress: [{from: [{podSelector: {matchLabels: {app: db}}}, {ipBlock: {cidr: 192.0.2.0/24, except: [192.0.2.128/25]}}], ports: [{port: http}, {protocol: UDP, port: 53, endPort: 60}]}]
  egress: [{to: [{namespaceSelector: {matchExpressions: [{key: team, operator: In, values: [shop]}]}}]}]
---
apiVersion: k8s.ovn.org/v1
kind: EgressFirewall
metadata: {name: default, namespace: shop}
spec: {egress: [{type: Allow, to: {cidrSelector: 198.51.100.0/24}, ports: [{protocol: TCP, port: 443}]}, {type: Deny, to: {cidrSelector: 0.0.0.0/0}}]}
---
apiVersion: k8s.ovn.org/v1
kind: EgressIP
metadata: {name: shop-out}
spec: {egressIPs: [10.99.0.50], namespaceSelector: {matchLabels: {team: shop}}, podSelector: {matchLabels: {app: web}}}
status: {items: [{node: a, egressIP: 10.99.0.50}]}
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: pass-dns}
spec:
  priority: 10
  subject: {namespaces: {}}
  egress: [{name: dns, action: Allow, to: [{networks: [10.96.0.0/16]}], ports: [{portNumber: {protocol: UDP, port: 53}}]}]
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: BaselineAdminNetworkPolicy
metadata: {name: default}
spec:
  subject: {namespaces: {matchLabels: {team: shop}}}
  ingress: [{name: deny, action: Deny, from: [{namespaces: {}}]}]
"#;

/// What the object fuzzer saw.
#[derive(Debug, Default)]
pub struct ObjectReport {
    pub cases: u64,
    /// Cases whose manifests still compiled (the node there).
    pub compiled: u64,
    /// Refusal lines, by kind.
    pub refused: std::collections::BTreeMap<&'static str, u64>,
    pub slowest: Duration,
}

/// A deterministic generator (xorshift64*): the same seed gives the same cases.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Runs `cases` mutated clusters (seeded by `seed`) through the decode and every compile.
pub fn run(cases: u64, seed: u64) -> anyhow::Result<ObjectReport> {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut report = ObjectReport::default();
    let outcome = (|| {
        for case in 0..cases {
            let text = if rng.below(2) == 0 {
                mutate_bytes(CORPUS, &mut rng)
            } else {
                mutate_values(CORPUS, &mut rng)
            };
            let started = Instant::now();
            let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
                let mut state = ClusterState::default();
                add_documents(&mut state, "fuzz.yaml", &text);
                // The controller's side: an EgressRouter becomes its objects or a refusal.
                for router in state.egress_routers.iter() {
                    let _ = dataplane_user::egressrouter::resource::plan(router, "pause");
                }
                dataplane_user::pipeline::compile_node(&state, "a")
            }));
            let took = started.elapsed();
            report.cases += 1;
            report.slowest = report.slowest.max(took);
            let compiled = match result {
                Ok(compiled) => compiled,
                Err(_) => bail!("case {case} (seed {seed}) panicked on this input:\n{text}"),
            };
            if took > CASE_LIMIT {
                bail!("case {case} (seed {seed}) took {took:?}:\n{text}");
            }
            let Some((_, refused)) = compiled else {
                continue;
            };
            report.compiled += 1;
            for line in refused {
                let rejection = Rejection::of(&line);
                if rejection.kind == "other" {
                    bail!("case {case} (seed {seed}): a refusal names no object: {line:?}\n{text}");
                }
                *report.refused.entry(rejection.kind).or_default() += 1;
            }
        }
        Ok(())
    })();
    outcome.map(|()| report)
}

/// `text` with a few bytes flipped, cut, doubled or inserted (kept UTF-8: the source reads
/// files as text).
fn mutate_bytes(text: &str, rng: &mut Rng) -> String {
    let mut bytes = text.as_bytes().to_vec();
    const SPECIAL: &[u8] = b"{}[]:,'\"\n-&*!|>#%@ \t0123456789./";
    for _ in 0..1 + rng.below(4) {
        if bytes.is_empty() {
            break;
        }
        let at = rng.below(bytes.len() as u64) as usize;
        match rng.below(5) {
            0 => bytes[at] = SPECIAL[rng.below(SPECIAL.len() as u64) as usize],
            1 => {
                let end = (at + 1 + rng.below(40) as usize).min(bytes.len());
                bytes.drain(at..end);
            }
            2 => {
                let end = (at + 1 + rng.below(200) as usize).min(bytes.len());
                let copy = bytes[at..end].to_vec();
                bytes.splice(at..at, copy);
            }
            3 => bytes.insert(at, SPECIAL[rng.below(SPECIAL.len() as u64) as usize]),
            _ => bytes.truncate(at),
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `text`'s documents with one to three values replaced (another type, a huge or strange
/// string, a number out of any range, a deep nest) or removed.
fn mutate_values(text: &str, rng: &mut Rng) -> String {
    use serde::Deserialize as _;
    let mut documents: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(text)
        .filter_map(|d| serde_yaml::Value::deserialize(d).ok())
        .collect();
    for _ in 0..1 + rng.below(3) {
        let index = rng.below(documents.len() as u64) as usize;
        let mut paths = Vec::new();
        collect_paths(&documents[index], &mut Vec::new(), &mut paths);
        if paths.is_empty() {
            continue;
        }
        let path = paths[rng.below(paths.len() as u64) as usize].clone();
        let replacement = strange_value(rng);
        replace_at(&mut documents[index], &path, replacement);
    }
    documents
        .iter()
        .filter_map(|d| serde_yaml::to_string(d).ok())
        .collect::<Vec<_>>()
        .join("---\n")
}

/// A step into a value: a map key or a sequence index.
#[derive(Clone)]
enum Step {
    Key(serde_yaml::Value),
    Index(usize),
}

fn collect_paths(value: &serde_yaml::Value, at: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
    out.push(at.clone());
    match value {
        serde_yaml::Value::Mapping(map) => {
            for (key, inner) in map {
                at.push(Step::Key(key.clone()));
                collect_paths(inner, at, out);
                at.pop();
            }
        }
        serde_yaml::Value::Sequence(items) => {
            for (i, inner) in items.iter().enumerate() {
                at.push(Step::Index(i));
                collect_paths(inner, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

/// Replaces the value at `path` by `replacement`; a `None` replacement removes a map entry.
fn replace_at(
    value: &mut serde_yaml::Value,
    path: &[Step],
    replacement: Option<serde_yaml::Value>,
) {
    let Some((last, parents)) = path.split_last() else {
        if let Some(replacement) = replacement {
            *value = replacement;
        }
        return;
    };
    let mut here = value;
    for step in parents {
        here = match (step, here) {
            (Step::Key(key), serde_yaml::Value::Mapping(map)) => match map.get_mut(key) {
                Some(inner) => inner,
                None => return,
            },
            (Step::Index(i), serde_yaml::Value::Sequence(items)) => match items.get_mut(*i) {
                Some(inner) => inner,
                None => return,
            },
            _ => return,
        };
    }
    match (last, here, replacement) {
        (Step::Key(key), serde_yaml::Value::Mapping(map), None) => {
            map.remove(key);
        }
        (Step::Key(key), serde_yaml::Value::Mapping(map), Some(new)) => {
            map.insert(key.clone(), new);
        }
        (Step::Index(i), serde_yaml::Value::Sequence(items), Some(new)) if *i < items.len() => {
            items[*i] = new;
        }
        (Step::Index(i), serde_yaml::Value::Sequence(items), None) if *i < items.len() => {
            items.remove(*i);
        }
        _ => {}
    }
}

/// A value no schema expects there (`None`: remove the field).
fn strange_value(rng: &mut Rng) -> Option<serde_yaml::Value> {
    use serde_yaml::Value;
    Some(match rng.below(12) {
        0 => return None,
        1 => Value::Null,
        2 => Value::from(-1),
        3 => Value::from(u64::MAX),
        4 => Value::from(i64::MIN),
        5 => Value::from(1e308),
        6 => Value::from("x".repeat(100_000)),
        7 => Value::from(
            [
                "10.0.0.300/8",
                "::/129",
                "0.0.0.0/0",
                "fe80::1%eth0",
                "1.2.3.4/0",
                "",
                "a\nb",
                "é",
                "../../etc/passwd",
                "-1",
                "65536",
                "TCP ",
            ][rng.below(12) as usize],
        ),
        8 => Value::Sequence(vec![Value::from("a"); 1 + rng.below(1000) as usize]),
        9 => Value::Mapping(serde_yaml::Mapping::new()),
        10 => {
            let mut nest = Value::from("deep");
            for _ in 0..64 {
                nest = Value::Sequence(vec![nest]);
            }
            nest
        }
        _ => Value::Bool(true),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_corpus_compiles_whole_and_refuses_only_its_external_ip() {
        let mut state = dataplane_user::source::ClusterState::default();
        dataplane_user::source::add_documents(&mut state, "corpus.yaml", super::CORPUS);
        let router = state.egress_routers.first().expect("an EgressRouter");
        dataplane_user::egressrouter::resource::plan(router, "pause").expect("its objects");
        let (_, refused) = dataplane_user::pipeline::compile_node(&state, "a").expect("node a");
        // External IPs are honoured only where the operator allows (none by default).
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(refused[0].starts_with("Service shop/web: spec.externalIPs: 192.0.2.10"));
    }

    #[test]
    fn a_few_hundred_mutated_clusters_hold_every_invariant() {
        let report = super::run(300, 7).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(report.cases, 300);
        assert!(report.compiled > 50, "{report:?}");
        assert!(report.refused.len() > 3, "{report:?}");
    }
}
