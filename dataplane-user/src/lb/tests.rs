//! Compile and Maglev tests: Service and EndpointSlice shapes as the API serves them.

use super::*;
use crate::source::{ClusterState, add_documents};
use dataplane_common::{maps::DEFAULT_BACKENDS, overlay::Addr};

fn compile_yaml(yaml: &str) -> CompiledServices {
    let mut state = ClusterState::default();
    add_documents(&mut state, "test.yaml", yaml);
    assert!(state.rejected.is_empty(), "{:?}", state.rejected);
    compile_services(
        &state.services,
        &state.endpoint_slices,
        &LocalNode::named("node-a"),
        &open_policy(),
    )
}

/// A policy that honours every external and load-balancer address (the compile's own tests;
/// the policy's have theirs).
fn open_policy() -> AddressPolicy {
    AddressPolicy {
        external_ip_cidrs: vec!["0.0.0.0/0".parse().unwrap(), "::/0".parse().unwrap()],
        ..AddressPolicy::default()
    }
}

fn backend(text: &str) -> BackendAddr {
    let (ip, port) = text.rsplit_once(':').unwrap();
    BackendAddr {
        ip: ip.trim_matches(['[', ']']).parse().unwrap(),
        port: port.parse().unwrap(),
    }
}

fn backends(texts: &[&str]) -> Vec<BackendAddr> {
    let mut v: Vec<BackendAddr> = texts.iter().map(|t| backend(t)).collect();
    v.sort();
    v
}

const MULTI_PORT: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, "fd00:96::10"]
  ipFamilies: [IPv4, IPv6]
  externalIPs: [192.0.2.10]
  ports:
  - {name: http, port: 80, protocol: TCP, targetPort: web}
  - {name: dns, port: 53, protocol: UDP, targetPort: 5353}
  - {name: sig, port: 9000, protocol: SCTP}
status:
  loadBalancer: {ingress: [{ip: 198.51.100.7}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-v4
  namespace: shop
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
- {name: dns, port: 5353, protocol: UDP}
- {name: sig, port: 9000, protocol: SCTP}
endpoints:
- addresses: [10.244.1.5]
  conditions: {ready: true, serving: true, terminating: false}
- addresses: [10.244.2.6]
  conditions: {ready: false, serving: true, terminating: true}
- addresses: [10.244.2.7]
  conditions: {ready: false, serving: false, terminating: false}
- addresses: [10.244.1.8]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-v6
  namespace: shop
  labels: {kubernetes.io/service-name: web}
addressType: IPv6
ports:
- {name: http, port: 8080, protocol: TCP}
endpoints:
- addresses: ["fd00:10:244:1::5"]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: other-namespace
  namespace: elsewhere
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports: [{name: http, port: 1, protocol: TCP}]
endpoints: [{addresses: [10.9.9.9]}]
"#;

#[test]
fn multi_port_dual_stack_service_with_named_ports_and_terminating_endpoints() {
    let out = compile_yaml(MULTI_PORT);
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    let find = |ip: &str, port: u16, protocol: u8| {
        let key = ServiceKey {
            addr: addr16(ip.parse().unwrap()),
            port_be: port.to_be_bytes(),
            protocol,
            scope: SCOPE_CLUSTER,
        };
        out.ports
            .iter()
            .find(|p| p.key == key)
            .unwrap_or_else(|| panic!("no service port {ip}:{port}/{protocol}"))
    };
    // Four addresses x three ports (UDP and SCTP on IPv6 exist with no backend: new flows
    // are answered, not black-holed), and the external and load-balancer IPs again as reached
    // from outside.
    assert_eq!(out.ports.len(), 18);
    let external: Vec<&ServicePort> = out
        .ports
        .iter()
        .filter(|p| p.key.scope == SCOPE_EXTERNAL)
        .collect();
    assert_eq!(external.len(), 6);
    assert!(external.iter().all(|p| p.ready.len() == 2), "{external:?}");
    for ip in ["10.96.0.10", "192.0.2.10", "198.51.100.7"] {
        let http = find(ip, 80, 6);
        assert_eq!(
            http.ready,
            backends(&["10.244.1.5:8080", "10.244.1.8:8080"])
        );
        assert_eq!(http.terminating, backends(&["10.244.2.6:8080"]));
        assert_eq!(http.name, "shop/web:http");
        let dns = find(ip, 53, 17);
        assert_eq!(dns.ready, backends(&["10.244.1.5:5353", "10.244.1.8:5353"]));
        // SCTP, matched to the slice's port of the same name and protocol.
        let sig = find(ip, 9000, 132);
        assert_eq!(sig.ready, backends(&["10.244.1.5:9000", "10.244.1.8:9000"]));
    }
    assert_eq!(
        find("fd00:96::10", 80, 6).ready,
        backends(&["[fd00:10:244:1::5]:8080"])
    );
    assert!(find("fd00:96::10", 53, 17).ready.is_empty());
    assert!(find("fd00:96::10", 9000, 132).ready.is_empty());
    assert!(out.ports.iter().all(|p| p.affinity_timeout == 0));
}

#[test]
fn unnamed_single_port_no_endpoints_and_only_terminating_endpoints() {
    let out = compile_yaml(
        r#"
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: default}
spec: {clusterIP: 10.96.0.20, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: draining, namespace: default}
spec: {clusterIP: 10.96.0.21, ports: [{port: 80, protocol: UDP}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: draining-1, namespace: default, labels: {kubernetes.io/service-name: draining}}
addressType: IPv4
ports: [{port: 9090, protocol: UDP}]
endpoints:
- addresses: [10.244.1.9]
  conditions: {ready: false, serving: true, terminating: true}
---
apiVersion: v1
kind: Service
metadata: {name: headless, namespace: default}
spec: {clusterIP: None, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: ext, namespace: default}
spec: {type: ExternalName, externalName: example.org}
"#,
    );
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(out.ports.len(), 2);
    let empty = &out.ports[0];
    assert_eq!(empty.name, "default/empty:80");
    assert!(empty.ready.is_empty() && empty.terminating.is_empty());
    // No ready endpoint: the serving-terminating one takes new flows.
    let draining = &out.ports[1];
    assert_eq!(draining.ready, backends(&["10.244.1.9:9090"]));
    assert_eq!(draining.key.protocol, 17);
}

#[test]
fn client_ip_affinity_timeouts_are_defaulted_and_checked() {
    let service = |affinity: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: s, namespace: n}}\n\
             spec: {{clusterIP: 10.96.0.30, ports: [{{port: 80}}], {affinity}}}\n"
        )
    };
    let timeout = |affinity: &str| {
        let out = compile_yaml(&service(affinity));
        (out.ports.first().map(|p| p.affinity_timeout), out.errors)
    };
    assert_eq!(timeout("sessionAffinity: ClientIP"), (Some(10_800), vec![]));
    assert_eq!(
        timeout(
            "sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 5}}"
        ),
        (Some(5), vec![])
    );
    assert_eq!(timeout("sessionAffinity: None"), (Some(0), vec![]));
    let (ports, errors) = timeout(
        "sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 86401}}",
    );
    assert_eq!(ports, None);
    assert_eq!(
        errors,
        vec![
            "Service n/s: spec.sessionAffinityConfig.clientIP.timeoutSeconds: 86401 is outside 1..=86400"
        ]
    );
}

#[test]
fn an_invalid_service_is_refused_naming_object_and_field_and_others_still_compile() {
    let out = compile_yaml(
        r#"
apiVersion: v1
kind: Service
metadata: {name: bad, namespace: a}
spec: {clusterIP: 10.96.0.999, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: good, namespace: a}
spec: {clusterIP: 10.96.0.40, ports: [{port: 80}]}
"#,
    );
    assert_eq!(
        out.errors,
        vec!["Service a/bad: spec.clusterIPs: \"10.96.0.999\" is not an IP address"]
    );
    assert_eq!(out.ports.len(), 1);
    assert_eq!(out.ports[0].name, "a/good:80");
}

fn numbered(n: u32) -> Vec<(u32, BackendAddr)> {
    (1..=n)
        .map(|i| {
            let ip: IpAddr = format!("10.244.{}.{}", i / 200, i % 200 + 1)
                .parse()
                .unwrap();
            (i, BackendAddr { ip, port: 8080 })
        })
        .collect()
}

#[test]
fn maglev_gives_every_backend_a_fair_share() {
    for n in [1u32, 2, 3, 10, 50, 100] {
        let table = maglev_table(&numbered(n));
        assert_eq!(table.len(), MAGLEV_TABLE_SIZE);
        let mut counts = BTreeMap::new();
        for id in &table {
            *counts.entry(*id).or_insert(0u32) += 1;
        }
        assert_eq!(counts.len(), n as usize, "every backend has slots");
        let ideal = MAGLEV_TABLE_SIZE as f64 / n as f64;
        for (&id, &count) in &counts {
            assert!(
                (count as f64 - ideal).abs() <= ideal * 0.1 + 1.0,
                "{n} backends: backend {id} has {count} slots, ideal {ideal:.1}"
            );
        }
    }
}

/// The table as the Maglev paper defines it, a division a probe: backend i's j-th choice
/// is `(offset + j * skip) % M` (its permutation as the agent takes it), the backends taking
/// turns in address order.
fn maglev_by_definition(backends: &[(u32, BackendAddr)]) -> Vec<u32> {
    let m = MAGLEV_TABLE_SIZE as u64;
    let mut sorted = backends.to_vec();
    sorted.sort_by_key(|(_, b)| *b);
    let choices: Vec<(u64, u64)> = sorted.iter().map(|(_, b)| maglev_permutation(b)).collect();
    let mut table = vec![u32::MAX; MAGLEV_TABLE_SIZE];
    let mut next = vec![0u64; sorted.len()];
    let mut filled = 0;
    while filled < MAGLEV_TABLE_SIZE {
        for (i, &(offset, skip)) in choices.iter().enumerate() {
            if filled == MAGLEV_TABLE_SIZE {
                break;
            }
            let mut slot = (offset + next[i] * skip) % m;
            while table[slot as usize] != u32::MAX {
                next[i] += 1;
                slot = (offset + next[i] * skip) % m;
            }
            table[slot as usize] = sorted[i].0;
            next[i] += 1;
            filled += 1;
        }
    }
    table
}

#[test]
fn maglev_tables_are_those_of_the_definition() {
    for n in [1u32, 2, 3, 7, 10, 64, 300, 1021, 1500] {
        assert_eq!(
            maglev_table(&numbered(n)),
            maglev_by_definition(&numbered(n)),
            "{n}"
        );
    }
}

#[test]
fn maglev_ignores_backend_order() {
    let mut backends = numbered(10);
    let table = maglev_table(&backends);
    backends.reverse();
    assert_eq!(maglev_table(&backends), table);
}

#[test]
fn removing_one_of_ten_backends_moves_about_a_tenth_of_the_flows() {
    let all = numbered(10);
    let before = maglev_table(&all);
    let after = maglev_table(&all[1..]);
    // Flows hash to slots; measure over many flows as the kernel would pick them.
    let mut moved = 0;
    let flows = 100_000u32;
    for flow in 0..flows {
        let key = dataplane_common::lb::CtKey {
            src: addr16(IpAddr::from([10, 0, (flow >> 8) as u8, flow as u8])),
            dst: addr16("10.96.0.10".parse().unwrap()),
            src_port_be: ((flow % 50_000) as u16 + 1024).to_be_bytes(),
            dst_port_be: 80u16.to_be_bytes(),
            protocol: 6,
            ..Default::default()
        };
        let slot = dataplane_common::lb::maglev_slot(dataplane_common::lb::flow_hash(&key));
        if before[slot] != after[slot] {
            moved += 1;
        }
    }
    let fraction = moved as f64 / flows as f64;
    // The removed backend's tenth must move; Maglev moves only a little more.
    assert!((0.09..0.13).contains(&fraction), "moved {fraction:.3}");
    // Every flow that was not on the removed backend and moved is Maglev's small disruption.
    println!(
        "removing 1 of 10 backends moved {:.1}% of flows",
        fraction * 100.0
    );
}

#[test]
fn node_ports_per_family_with_external_and_internal_traffic_policy_local() {
    let out = compile_yaml(
        r#"
apiVersion: v1
kind: Service
metadata: {name: np, namespace: web}
spec:
  type: NodePort
  clusterIPs: [10.96.0.70, "fd00:96::70"]
  externalTrafficPolicy: Local
  internalTrafficPolicy: Local
  ports: [{port: 80, targetPort: 8080, nodePort: 30080}]
---
apiVersion: v1
kind: Service
metadata: {name: lb, namespace: web}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.71
  ports: [{port: 80, targetPort: 8080, nodePort: 30081}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: np-1, namespace: web, labels: {kubernetes.io/service-name: np}}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
- {addresses: [10.244.1.5], nodeName: node-a}
- {addresses: [10.244.2.6], nodeName: node-b}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-1, namespace: web, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
- {addresses: [10.244.1.5], nodeName: node-a}
- {addresses: [10.244.2.6], nodeName: node-b}
"#,
    );
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    let find = |addr: Addr, port: u16, scope: u8| {
        out.ports
            .iter()
            .find(|p| {
                p.key.addr == addr && p.key.port_be == port.to_be_bytes() && p.key.scope == scope
            })
            .unwrap_or_else(|| panic!("no {port} scope {scope}"))
    };
    let v4 = |s: &str| addr16(s.parse().unwrap());
    // Local policies: only node-a's endpoint, from pods and from outside.
    assert_eq!(
        find(v4("10.96.0.70"), 80, SCOPE_CLUSTER).ready,
        backends(&["10.244.1.5:8080"])
    );
    assert_eq!(
        find(NODEPORT_ANY_V4, 30080, SCOPE_NODEPORT).ready,
        backends(&["10.244.1.5:8080"])
    );
    // The IPv6 NodePort exists; no IPv6 endpoints.
    assert!(find([0; 16], 30080, SCOPE_NODEPORT).ready.is_empty());
    // Cluster policies: every endpoint.
    let all = backends(&["10.244.1.5:8080", "10.244.2.6:8080"]);
    assert_eq!(find(v4("10.96.0.71"), 80, SCOPE_CLUSTER).ready, all);
    let node_port = find(NODEPORT_ANY_V4, 30081, SCOPE_NODEPORT);
    assert_eq!(node_port.ready, all);
    assert_eq!(node_port.name, "web/lb:80 (NodePort 30081)");
    // Pods reach the Local policy's NodePort at every endpoint (as kube-proxy sends them): a
    // key of their own, per family; the Cluster policy's NodePort needs none.
    let from_pods = find(NODEPORT_ANY_V4, 30080, SCOPE_NODEPORT_FROM_POD);
    assert_eq!(from_pods.ready, all);
    assert_eq!(from_pods.name, "web/np:80 (NodePort 30080 from pods)");
    assert!(
        find([0; 16], 30080, SCOPE_NODEPORT_FROM_POD)
            .ready
            .is_empty()
    );
    assert!(
        !out.ports
            .iter()
            .any(|p| p.key.port_be == 30081u16.to_be_bytes()
                && p.key.scope == SCOPE_NODEPORT_FROM_POD)
    );
    assert_eq!(out.ports.len(), 8);
}

#[test]
fn port_bitmaps_mark_service_ports_and_backend_ports() {
    use dataplane_common::lb::{BACKEND_PORTS_BASE, SERVICE_PORTS_BASE, port_bit};
    let out = compile_yaml(MULTI_PORT);
    let words = port_bitmaps(out.ports.iter());
    let marked = |base, port| {
        let (word, bit) = port_bit(base, port);
        words[word as usize] & bit != 0
    };
    for port in [80, 53, 9000] {
        assert!(marked(SERVICE_PORTS_BASE, port));
    }
    for port in [8080, 5353, 9000] {
        assert!(marked(BACKEND_PORTS_BASE, port));
    }
    for port in [8080, 5353] {
        assert!(!marked(SERVICE_PORTS_BASE, port));
    }
    assert!(!marked(BACKEND_PORTS_BASE, 80));
    let set: u32 = words.iter().map(|w| w.count_ones()).sum();
    assert_eq!(set, 6, "nothing else is marked");
}

#[test]
fn masquerade_ports_are_added_to_the_reserved_ports_once() {
    assert_eq!(
        with_snat_ports("\n").as_deref(),
        Some("1024-32767,61000-65535")
    );
    assert_eq!(
        with_snat_ports("22,100-200\n").as_deref(),
        Some("22,100-200,1024-32767,61000-65535")
    );
    assert_eq!(with_snat_ports("1024-32767,61000-65535\n"), None);
    assert_eq!(with_snat_ports("80,1000-40000,60000-65535"), None);
    // One range covered: only the other is added.
    assert_eq!(
        with_snat_ports("61000-65535").as_deref(),
        Some("61000-65535,1024-32767")
    );
    // Half covered: the whole range is added (the kernel merges overlaps).
    assert_eq!(
        with_snat_ports("1024-32767,61000-62000").as_deref(),
        Some("1024-32767,61000-62000,61000-65535")
    );
}

fn numbered_backend(n: u32) -> BackendAddr {
    BackendAddr {
        ip: IpAddr::from((0x0a00_0000 | n).to_be_bytes()),
        port: 8080,
    }
}

#[test]
fn backend_ids_take_fresh_slots_first_then_the_longest_free_with_a_newer_generation() {
    use dataplane_common::lb::{backend_generation, backend_slot};
    // A small array (`--max-backends 64`): the rule is the same at any size.
    const CAPACITY: u32 = 64;
    let mut state = LbState::default();
    let first = state.backend_id(numbered_backend(0), CAPACITY).unwrap();
    assert_eq!((backend_slot(first), backend_generation(first)), (0, 1));
    assert_eq!(
        state.backend_id(numbered_backend(0), CAPACITY),
        Some(first),
        "stable"
    );
    let mut ids = vec![first];
    for n in 1..CAPACITY {
        let id = state.backend_id(numbered_backend(n), CAPACITY).unwrap();
        assert_eq!((backend_slot(id), backend_generation(id)), (n, 1));
        ids.push(id);
    }
    assert_eq!(
        state.backend_id(numbered_backend(CAPACITY), CAPACITY),
        None,
        "full"
    );
    // Slots 7 then 3 freed: reused in that order, one generation up.
    state.release_backend(ids[7]);
    state.release_backend(ids[3]);
    let a = state
        .backend_id(numbered_backend(CAPACITY), CAPACITY)
        .unwrap();
    let b = state
        .backend_id(numbered_backend(CAPACITY + 1), CAPACITY)
        .unwrap();
    assert_eq!((backend_slot(a), backend_generation(a)), (7, 2));
    assert_eq!((backend_slot(b), backend_generation(b)), (3, 2));
    assert_eq!(
        state.backend_id(numbered_backend(CAPACITY + 2), CAPACITY),
        None
    );
}

#[test]
fn adopted_slots_keep_their_ids_and_removed_ones_come_back_a_generation_later() {
    use dataplane_common::lb::{backend_generation, backend_id, backend_slot};
    let live = backend_value(numbered_backend(1), backend_id(0, 4));
    let removed = Backend {
        id: backend_id(2, 9),
        ..Backend::default()
    };
    let mut state = LbState::default();
    state.adopt_slot(0, &live);
    state.adopt_slot(1, &Backend::default());
    state.adopt_slot(2, &removed);
    state.free_unused_slots();
    assert_eq!(state.id_of(numbered_backend(1)), Some(backend_id(0, 4)));
    // Fresh slots first (3 onwards), then the adopted free ones in slot order.
    let fresh = state
        .backend_id(numbered_backend(2), DEFAULT_BACKENDS)
        .unwrap();
    assert_eq!((backend_slot(fresh), backend_generation(fresh)), (3, 1));
    assert_eq!(state.free_slots, [1, 2]);
    assert!(Backend::default().id == 0 && !removed.is_live(removed.id));
    assert!(live.is_live(backend_id(0, 4)) && !live.is_live(backend_id(0, 3)));
}

#[test]
fn a_slot_generation_wraps_past_zero() {
    use dataplane_common::lb::{
        BACKEND_SLOT_BITS, backend_generation, backend_id, next_backend_id,
    };
    let last = backend_id(5, u32::MAX >> BACKEND_SLOT_BITS);
    assert_eq!(backend_generation(next_backend_id(5, last)), 1);
    assert_ne!(next_backend_id(0, 0), 0, "no backend id is 0");
}

/// Services enough for `compile_each` to spread them over the cores: each compiled alone (one
/// wanted, on the calling thread) gives what the whole compile gives it, invalid ones and
/// those without slices included.
#[test]
fn services_compiled_on_every_core_equal_each_compiled_alone() {
    let mut yaml = String::new();
    for i in 0..(3 * SERVICES_PER_TASK + 5) {
        let ip = if i % 97 == 5 {
            "10.96.7.999".to_owned()
        } else {
            format!("10.96.{}.{}", i / 250, i % 250 + 1)
        };
        yaml.push_str(&format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: s{i}, namespace: n{}}}\n\
             spec: {{clusterIP: {ip}, ports: [{{port: 80, targetPort: {}}}]}}\n",
            i % 5,
            8000 + i % 7
        ));
        if i % 3 != 0 {
            yaml.push_str(&format!(
                "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
                 metadata: {{name: s{i}-a, namespace: n{}, labels: {{kubernetes.io/service-name: s{i}}}}}\n\
                 addressType: IPv4\nports: [{{port: {}}}]\n\
                 endpoints: [{{addresses: [10.1.{}.{}]}}, {{addresses: [10.2.{}.{}]}}]\n",
                i % 5,
                8000 + i % 7,
                i / 250,
                i % 250 + 1,
                i / 250,
                i % 250 + 1
            ));
        }
    }
    let mut state = ClusterState::default();
    add_documents(&mut state, "test.yaml", &yaml);
    assert!(state.rejected.is_empty(), "{:?}", state.rejected);
    let all = compile_each(
        &state.services,
        &state.endpoint_slices,
        &LocalNode::named("node-a"),
        &open_policy(),
        |_| true,
    );
    assert_eq!(all.len(), 3 * SERVICES_PER_TASK + 5);
    assert!(all.values().any(|s| s.is_err()));
    for (name, compiled) in &all {
        let alone = compile_each(
            &state.services,
            &state.endpoint_slices,
            &LocalNode::named("node-a"),
            &open_policy(),
            |key| *key == (name.0.as_str(), name.1.as_str()),
        );
        assert_eq!(alone.len(), 1);
        assert_eq!(alone.get(name), Some(compiled), "{name:?}");
    }
}

const DNS_AND_TENANT: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: dns, port: 53, protocol: UDP, targetPort: 53}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: kube-dns-1, namespace: kube-system, labels: {kubernetes.io/service-name: kube-dns}}
addressType: IPv4
ports: [{name: dns, port: 53, protocol: UDP}]
endpoints: [{addresses: [10.244.1.53]}]
---
apiVersion: v1
kind: Service
metadata: {name: grab, namespace: aaa-tenant}
spec:
  clusterIP: 10.96.7.7
  externalIPs: [10.96.0.10, 192.0.2.53]
  ports: [{name: dns, port: 53, protocol: UDP, targetPort: 5353}]
status:
  loadBalancer: {ingress: [{ip: 10.96.0.10}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: grab-1, namespace: aaa-tenant, labels: {kubernetes.io/service-name: grab}}
addressType: IPv4
ports: [{name: dns, port: 5353, protocol: UDP}]
endpoints: [{addresses: [10.244.9.9]}]
"#;

fn dns_key(ip: &str) -> ServiceKey {
    ServiceKey {
        addr: addr16(ip.parse().unwrap()),
        port_be: 53u16.to_be_bytes(),
        protocol: 17,
        scope: SCOPE_CLUSTER,
    }
}

#[test]
fn a_cluster_ip_keeps_its_address_against_another_services_external_ip() {
    // Even where every external IP is allowed, and the tenant's Service sorts first by name.
    let out = compile_yaml(DNS_AND_TENANT);
    let holder: Vec<&ServicePort> = out
        .ports
        .iter()
        .filter(|p| p.key == dns_key("10.96.0.10"))
        .collect();
    assert_eq!(holder.len(), 1);
    assert_eq!(holder[0].name, "kube-system/kube-dns:dns");
    assert_eq!(holder[0].kind, AddressKind::ClusterIp);
    assert_eq!(holder[0].ready, backends(&["10.244.1.53:53"]));
    assert_eq!(
        out.errors,
        vec![
            "Service aaa-tenant/grab: port dns: address and port already used by another Service"
                .to_owned()
        ]
    );
    // The tenant keeps its own cluster IP and its allowed external IP.
    for ip in ["10.96.7.7", "192.0.2.53"] {
        let port = out.ports.iter().find(|p| p.key == dns_key(ip)).unwrap();
        assert_eq!(port.name, "aaa-tenant/grab:dns", "{ip}");
        assert_eq!(port.ready, backends(&["10.244.9.9:5353"]), "{ip}");
    }
}

#[test]
fn external_and_load_balancer_addresses_are_honoured_only_where_the_policy_allows() {
    let mut state = ClusterState::default();
    add_documents(&mut state, "test.yaml", DNS_AND_TENANT);
    let compile = |policy: &AddressPolicy| {
        compile_services(
            &state.services,
            &state.endpoint_slices,
            &LocalNode::named("node-a"),
            policy,
        )
    };
    let has = |out: &CompiledServices, ip: &str| out.ports.iter().any(|p| p.key == dns_key(ip));
    // The default: no external IP is honoured; each refusal names the Service and field.
    let out = compile(&AddressPolicy::default());
    assert!(has(&out, "10.96.7.7") && has(&out, "10.96.0.10"));
    assert!(!has(&out, "192.0.2.53"));
    assert!(
        out.errors.contains(
            &"Service aaa-tenant/grab: spec.externalIPs: 192.0.2.53: external IPs are not honoured on this cluster (the agent's --external-ip-cidrs is empty); that address is not served".to_owned()
        ),
        "{:?}",
        out.errors
    );
    // Allowed networks; never the cluster's own networks (here the service network), whose
    // refusal names it, for external and load-balancer addresses alike.
    let policy = AddressPolicy {
        external_ip_cidrs: vec![
            "192.0.2.0/24".parse().unwrap(),
            "10.0.0.0/8".parse().unwrap(),
        ],
        reserved_networks: vec!["10.96.0.0/16".parse().unwrap()],
        node_addresses: BTreeSet::from(["192.0.2.1".parse().unwrap()]),
        ..AddressPolicy::default()
    };
    let out = compile(&policy);
    assert!(has(&out, "192.0.2.53"));
    let refused: Vec<&String> = out
        .errors
        .iter()
        .filter(|e| e.contains("inside the cluster's own network 10.96.0.0/16"))
        .collect();
    assert_eq!(refused.len(), 2, "{:?}", out.errors);
    assert!(
        refused[0].contains("spec.externalIPs")
            && refused[0].starts_with("Service aaa-tenant/grab")
    );
    assert!(refused[1].contains("status.loadBalancer.ingress[].ip"));
    // Node addresses and special ones.
    for (ip, why) in [
        ("192.0.2.1", "a node's address"),
        ("127.0.0.1", "loopback"),
        ("169.254.1.1", "link-local"),
        ("224.0.0.251", "multicast"),
        ("0.0.0.0", "unspecified"),
    ] {
        let text = DNS_AND_TENANT.replace("192.0.2.53", ip);
        let mut state = ClusterState::default();
        add_documents(&mut state, "test.yaml", &text);
        let open = AddressPolicy {
            external_ip_cidrs: vec!["0.0.0.0/0".parse().unwrap()],
            ..policy.clone()
        };
        let out = compile_services(
            &state.services,
            &state.endpoint_slices,
            &LocalNode::named("node-a"),
            &open,
        );
        assert!(!has(&out, ip), "{ip}");
        assert!(
            out.errors.iter().any(|e| e.contains(ip) && e.contains(why)),
            "{ip}: {:?}",
            out.errors
        );
    }
    // OpenShift's cluster Network's policy: allowed CIDRs less the rejected ones, named as
    // the reason when an address is refused.
    let openshift = |allowed: &[&str], rejected: &[&str]| AddressPolicy {
        external_ip_cidrs: allowed.iter().map(|c| c.parse().unwrap()).collect(),
        external_ip_rejected_cidrs: rejected.iter().map(|c| c.parse().unwrap()).collect(),
        external_ip_source: super::ExternalIpSource::ClusterNetwork,
        ..AddressPolicy::default()
    };
    let refusal = |policy: &AddressPolicy| -> Vec<String> {
        let out = compile(policy);
        let refused: Vec<String> = (out.errors.iter())
            .filter(|e| e.contains("spec.externalIPs: 192.0.2.53"))
            .cloned()
            .collect();
        assert_eq!(
            has(&out, "192.0.2.53"),
            refused.is_empty(),
            "{:?}",
            out.errors
        );
        refused
    };
    assert_eq!(
        refusal(&openshift(&["192.0.2.0/24"], &[])),
        Vec::<String>::new()
    );
    assert_eq!(
        refusal(&openshift(&["192.0.2.0/24"], &["192.0.2.0/26"])),
        [
            "Service aaa-tenant/grab: spec.externalIPs: 192.0.2.53 is inside 192.0.2.0/26 of the cluster Network's (config.openshift.io/v1) spec.externalIP.policy.rejectedCIDRs; that address is not served"
        ]
    );
    assert_eq!(
        refusal(&openshift(&["198.51.100.0/24"], &[])),
        [
            "Service aaa-tenant/grab: spec.externalIPs: 192.0.2.53 is outside the cluster Network's (config.openshift.io/v1) spec.externalIP.policy.allowedCIDRs; that address is not served"
        ]
    );
    assert_eq!(
        refusal(&openshift(&[], &[])),
        [
            "Service aaa-tenant/grab: spec.externalIPs: 192.0.2.53: external IPs are not honoured on this cluster (the cluster Network's (config.openshift.io/v1) spec.externalIP.policy allows none); that address is not served"
        ]
    );
    // A load balancer may publish a node's address (k3s' ServiceLB does).
    let text = DNS_AND_TENANT.replace("ingress: [{ip: 10.96.0.10}]", "ingress: [{ip: 192.0.2.1}]");
    let mut state = ClusterState::default();
    add_documents(&mut state, "test.yaml", &text);
    let out = compile_services(
        &state.services,
        &state.endpoint_slices,
        &LocalNode::named("node-a"),
        &policy,
    );
    assert!(has(&out, "192.0.2.1"), "{:?}", out.errors);
}

const LOAD_BALANCER: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: front, namespace: shop}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.20
  clusterIPs: [10.96.0.20, "fd00:96::20"]
  ipFamilies: [IPv4, IPv6]
  externalIPs: [192.0.2.20]
  loadBalancerSourceRanges: [" 203.0.113.7/24 ", 198.51.100.0/25, 198.51.100.0/25]
  ports:
  - {name: https, port: 443, protocol: TCP, nodePort: 30443}
status:
  loadBalancer:
    ingress:
    - {ip: 198.51.100.20}
    - {ip: "2001:db8::20"}
    - {ip: 198.51.100.21, ipMode: Proxy}
    - {ip: 198.51.100.22, ipMode: VIP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: front-v4
  namespace: shop
  labels: {kubernetes.io/service-name: front}
addressType: IPv4
ports: [{name: https, port: 8443, protocol: TCP}]
endpoints:
- addresses: [10.244.1.5]
"#;

fn key_of(ip: &str, port: u16, scope: u8) -> ServiceKey {
    ServiceKey {
        addr: addr16(ip.parse().unwrap()),
        port_be: port.to_be_bytes(),
        protocol: 6,
        scope,
    }
}

#[test]
fn source_ranges_apply_to_load_balancer_addresses_of_their_family_only() {
    let out = compile_yaml(LOAD_BALANCER);
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    let ranges_at = |ip: &str, scope: u8| -> Vec<String> {
        let port = out
            .ports
            .iter()
            .find(|p| p.key == key_of(ip, 443, scope))
            .unwrap_or_else(|| panic!("{ip} scope {scope}"));
        port.source_ranges.iter().map(ToString::to_string).collect()
    };
    // Truncated to their networks, spaces forgiven, duplicates once, sorted.
    let v4 = vec!["198.51.100.0/25".to_owned(), "203.0.113.0/24".to_owned()];
    for scope in [SCOPE_CLUSTER, SCOPE_EXTERNAL] {
        assert_eq!(ranges_at("198.51.100.20", scope), v4);
        assert_eq!(ranges_at("198.51.100.22", scope), v4);
        // No IPv6 range: the IPv6 address is open, as kube-proxy leaves it.
        assert!(ranges_at("2001:db8::20", scope).is_empty());
        // External IPs and cluster IPs are not load-balancer addresses.
        assert!(ranges_at("192.0.2.20", scope).is_empty());
    }
    assert!(ranges_at("10.96.0.20", SCOPE_CLUSTER).is_empty());
    // NodePorts are not subject to them (kube-proxy's nftables proxier says as much).
    let node_port = out
        .ports
        .iter()
        .find(|p| p.key.scope == SCOPE_NODEPORT)
        .unwrap();
    assert!(node_port.source_ranges.is_empty());
    // `ipMode: Proxy`: the address belongs to a proxying load balancer, not served here.
    assert!(
        !out.ports
            .iter()
            .any(|p| p.key.addr == addr16("198.51.100.21".parse().unwrap()))
    );
}

#[test]
fn a_range_of_every_address_opens_its_family_and_a_bad_range_allows_nothing() {
    let open = LOAD_BALANCER.replace("198.51.100.0/25, 198.51.100.0/25", "0.0.0.0/0");
    let out = compile_yaml(&open);
    let at = |out: &CompiledServices| {
        out.ports
            .iter()
            .find(|p| p.key == key_of("198.51.100.20", 443, SCOPE_EXTERNAL))
            .unwrap()
            .source_ranges
            .clone()
    };
    assert!(at(&out).is_empty());
    // A range that is no CIDR is refused by name and allows no source: the others stay.
    let bad = LOAD_BALANCER.replace("198.51.100.0/25, 198.51.100.0/25", "10.0.0.0/33");
    let mut state = ClusterState::default();
    add_documents(&mut state, "test.yaml", &bad);
    let out = compile_services(
        &state.services,
        &state.endpoint_slices,
        &LocalNode::named("node-a"),
        &open_policy(),
    );
    assert_eq!(
        out.errors,
        vec![
            "Service shop/front: spec.loadBalancerSourceRanges[1]: \"10.0.0.0/33\" is not a CIDR; that range allows no source"
                .to_owned()
        ]
    );
    assert_eq!(
        at(&out),
        vec!["203.0.113.0/24".parse::<ipnet::IpNet>().unwrap()]
    );
    // More ranges than one Service may give: the whole Service is refused, not opened.
    let many: Vec<String> = (0..=MAX_SOURCE_RANGES)
        .map(|i| format!("10.{}.{}.0/24", i / 256, i % 256))
        .collect();
    let too_many = LOAD_BALANCER.replace(
        "[\" 203.0.113.7/24 \", 198.51.100.0/25, 198.51.100.0/25]",
        &format!("[{}]", many.join(", ")),
    );
    let out = compile_yaml(&too_many);
    assert!(out.ports.is_empty());
    assert_eq!(
        out.errors,
        vec![format!(
            "Service shop/front: spec.loadBalancerSourceRanges: {} ranges, more than the {MAX_SOURCE_RANGES} one Service may give",
            MAX_SOURCE_RANGES + 1
        )]
    );
}

#[test]
fn services_and_slices_of_another_proxy_or_headless_are_ignored() {
    for label in [SERVICE_PROXY_NAME_LABEL, HEADLESS_LABEL] {
        let labelled = LOAD_BALANCER.replace(
            "metadata: {name: front, namespace: shop}",
            &format!("metadata: {{name: front, namespace: shop, labels: {{{label}: other}}}}"),
        );
        assert!(compile_yaml(&labelled).ports.is_empty(), "{label}");
        let slice_labelled = LOAD_BALANCER.replace(
            "labels: {kubernetes.io/service-name: front}",
            &format!("labels: {{kubernetes.io/service-name: front, {label}: other}}"),
        );
        let out = compile_yaml(&slice_labelled);
        assert!(!out.ports.is_empty(), "{label}");
        assert!(
            out.ports.iter().all(|p| p.ready.is_empty()),
            "{label}: the slice's endpoints are not used"
        );
    }
}

const ZONED: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: api, namespace: shop}
spec:
  clusterIP: 10.96.0.30
  trafficDistribution: PreferClose
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: api-v4
  namespace: shop
  labels: {kubernetes.io/service-name: api}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.244.1.5]
  zone: zone-a
  hints: {forZones: [{name: zone-a}]}
- addresses: [10.244.2.6]
  zone: zone-b
  hints: {forZones: [{name: zone-b}]}
- addresses: [10.244.3.7]
  zone: zone-b
  hints: {forZones: [{name: zone-b}]}
"#;

fn compile_on(yaml: &str, node: &LocalNode) -> CompiledServices {
    let mut state = ClusterState::default();
    add_documents(&mut state, "test.yaml", yaml);
    assert!(state.rejected.is_empty(), "{:?}", state.rejected);
    compile_services(
        &state.services,
        &state.endpoint_slices,
        node,
        &open_policy(),
    )
}

#[test]
fn zone_hints_narrow_a_node_to_its_zone_and_fall_back_as_kube_proxy_does() {
    let in_zone = |zone: Option<&str>| LocalNode {
        name: "node-a".into(),
        zone: zone.map(str::to_owned),
    };
    let port_of = |out: &CompiledServices| out.ports[0].clone();
    // In zone-b: its two endpoints; zone-a's keeps its established flows only.
    let port = port_of(&compile_on(ZONED, &in_zone(Some("zone-b"))));
    assert_eq!(
        port.ready,
        backends(&["10.244.2.6:8080", "10.244.3.7:8080"])
    );
    assert_eq!(port.terminating, backends(&["10.244.1.5:8080"]));
    assert_eq!(port.topology.as_deref(), Some("zone zone-b"));
    let port = port_of(&compile_on(ZONED, &in_zone(Some("zone-a"))));
    assert_eq!(port.ready, backends(&["10.244.1.5:8080"]));
    // No endpoint hinted for the node's zone, no zone label, or one endpoint without hints:
    // every endpoint, as without topology.
    let all = backends(&["10.244.1.5:8080", "10.244.2.6:8080", "10.244.3.7:8080"]);
    for (yaml, zone) in [
        (ZONED.to_owned(), Some("zone-c")),
        (ZONED.to_owned(), None),
        (
            ZONED.replace(
                "  hints: {forZones: [{name: zone-b}]}\n- addresses: [10.244.3.7]",
                "- addresses: [10.244.3.7]",
            ),
            Some("zone-b"),
        ),
    ] {
        let port = port_of(&compile_on(&yaml, &in_zone(zone)));
        assert_eq!(port.ready, all, "{zone:?}");
        assert!(port.terminating.is_empty());
        assert_eq!(port.topology, None);
    }
    // Node hints on every endpoint, one for this node: that one alone.
    let node_hinted = ZONED
        .replace(
            "hints: {forZones: [{name: zone-a}]}",
            "hints: {forZones: [{name: zone-a}], forNodes: [{name: node-a}]}",
        )
        .replace(
            "hints: {forZones: [{name: zone-b}]}",
            "hints: {forZones: [{name: zone-b}], forNodes: [{name: node-b}]}",
        );
    let port = port_of(&compile_on(&node_hinted, &in_zone(Some("zone-b"))));
    assert_eq!(port.ready, backends(&["10.244.1.5:8080"]));
    assert_eq!(port.topology.as_deref(), Some("node node-a"));
    // A Local traffic policy takes its own endpoints; hints do not narrow it.
    let local = ZONED.replace(
        "trafficDistribution: PreferClose",
        "internalTrafficPolicy: Local",
    );
    let local = local.replace("  zone: zone-a\n", "  zone: zone-a\n  nodeName: node-a\n");
    let port = port_of(&compile_on(&local, &in_zone(Some("zone-b"))));
    assert_eq!(port.ready, backends(&["10.244.1.5:8080"]));
    assert_eq!(port.topology, None);
}
