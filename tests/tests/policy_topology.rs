//! NetworkPolicy end to end on a two-node overlay cluster: real TCP and UDP sockets between
//! pods of namespaces x and y, on one node and across nodes, directly and through a Service.
//! The policies isolate x's server (only x's client may reach TCP 8080) and x's client's egress
//! (only pods of x); replies of allowed connections pass, also to an isolated pod that opened
//! them.

use dataplane_common::{DropReason, Hook, PacketClass};
use dataplane_tests::{
    privileged::privileged,
    service_bed::{Server, echo_backend, one_syn, probe, probe_in},
    topology::{Mode, Topology, dataplane_binary, socket_lb_on},
};

const MANIFESTS: &str = "\
apiVersion: v1
kind: Namespace
metadata:
  name: x
  labels: {team: x}
  annotations: {k8s.ovn.org/acl-logging: '{\"deny\":\"alert\"}'}
---
apiVersion: v1
kind: Namespace
metadata: {name: y, labels: {team: y}}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: server-from-client, namespace: x}
spec:
  podSelector: {matchLabels: {pod: pod-0-1}}
  ingress:
  - from: [{podSelector: {matchLabels: {pod: pod-0-0}}}]
    ports: [{protocol: TCP, port: 8080}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: client-stays-in-x, namespace: x}
spec:
  podSelector: {matchLabels: {pod: pod-0-0}}
  policyTypes: [Egress]
  egress:
  - to: [{namespaceSelector: {matchLabels: {team: x}}}]
---
apiVersion: v1
kind: Service
metadata: {name: server, namespace: x}
spec: {clusterIP: 10.96.0.50, clusterIPs: [10.96.0.50], ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: server-1, namespace: x, labels: {kubernetes.io/service-name: server}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.244.1.3]
  conditions: {ready: true}
";

#[test]
fn network_policies_allow_and_refuse_real_connections_on_one_node_and_across_nodes() {
    if !privileged(
        "network_policies_allow_and_refuse_real_connections_on_one_node_and_across_nodes",
    ) {
        return;
    }
    let mut topology = Topology::build_with(2, 2, Mode::Overlay).expect("build topology");
    for (node, pod, namespace) in [(0, 0, "x"), (0, 1, "x"), (1, 0, "y"), (1, 1, "x")] {
        topology
            .set_pod_namespace(node, pod, namespace)
            .expect("namespace");
    }
    let client = topology.node(0).pods[0].clone();
    let server = topology.node(0).pods[1].clone();
    let outsider = topology.node(1).pods[0].clone();
    let peer = topology.node(1).pods[1].clone();
    assert_eq!(
        server.ip.to_string(),
        "10.244.1.3",
        "the EndpointSlice names the server"
    );
    topology
        .add_manifest("policies.yaml", MANIFESTS)
        .expect("manifests");
    let servers: Vec<Server> = [&server, &outsider, &peer]
        .iter()
        .map(|p| echo_backend(p, false).expect("server"))
        .collect();
    let audit_log = std::env::temp_dir()
        .join(dataplane_tests::unique_name("audit"))
        .join("acl-audit-log.log");
    let agent0 = topology
        .node(0)
        .start_agent_with(&["--audit-log", audit_log.to_str().expect("path")])
        .expect("agent on node 0");
    let agent1 = topology.node(1).start_agent().expect("agent on node 1");
    let log = agent0.log();
    assert!(log.contains("isolated_pods=2"), "{log}");

    let (s, o, p) = (
        server.ip.to_string(),
        outsider.ip.to_string(),
        peer.ip.to_string(),
    );
    // Wait for the servers: the allowed connection answers once they listen.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while probe(&client, &[("tcp", &s, 8080)]).expect("probe") != [s.as_str()]
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let from_client = probe(
        &client,
        &[
            ("tcp", &s, 8080),
            ("udp", &s, 5353),
            ("tcp", "10.96.0.50", 80),
            ("tcp", &p, 8080),
            ("tcp", &o, 8080),
        ],
    )
    .expect("probe");
    assert_eq!(
        from_client,
        vec![s.as_str(), "timeout", s.as_str(), p.as_str(), "timeout"],
        "client: server TCP allowed, UDP not; the Service to it allowed; a pod of x on the \
         other node allowed; a pod of y refused by the client's egress policy"
    );
    let from_outsider = probe(
        &outsider,
        &[
            ("tcp", &s, 8080),
            ("tcp", "10.96.0.50", 80),
            ("tcp", &p, 8080),
        ],
    )
    .expect("probe");
    assert_eq!(
        from_outsider,
        vec!["timeout", "timeout", p.as_str()],
        "outsider: the isolated server refuses it directly and through the Service"
    );
    // Counted exactly: one SYN refused by the client's egress policy (on node 0, leaving the
    // client), one refused by the server's ingress policy (on node 0, arriving over Geneve).
    let before = agent0.counters().expect("counters");
    assert_eq!(one_syn(&client.netns, &o, 8080).expect("SYN"), "timeout");
    let after_egress = agent0.counters().expect("counters");
    assert_eq!(one_syn(&outsider.netns, &s, 8080).expect("SYN"), "timeout");
    let after_ingress = agent0.counters().expect("counters");
    let denied = |c: &dataplane_user::kernel::stats::Counters| {
        (
            c.drops(DropReason::PolicyDeniedEgress),
            c.drops(DropReason::PolicyDeniedIngress),
        )
    };
    let (egress0, ingress0) = denied(&before);
    assert_eq!(
        denied(&after_egress),
        (egress0 + 1, ingress0),
        "{after_egress:?}"
    );
    assert_eq!(
        denied(&after_ingress),
        (egress0 + 1, ingress0 + 1),
        "{after_ingress:?}"
    );
    // The node itself reaches the isolated server (kubelet probes must), as in OVN-Kubernetes.
    let node0 = topology.node(0).netns.clone();
    assert_eq!(
        probe_in(&node0, "node 0", &[("tcp", &s, 8080)]).expect("probe"),
        vec![s.as_str()]
    );
    // The server is isolated for ingress, yet the answers of connections it opens come in.
    let from_server = probe(&server, &[("tcp", &o, 8080), ("udp", &o, 5353)]).expect("probe");
    assert_eq!(from_server, vec![o.as_str(), o.as_str()]);

    // Namespace x audits its denials: the client's egress and the server's ingress.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let audit = std::fs::read_to_string(&audit_log).expect("node 0's audit log");
    assert!(
        audit.lines().any(|l| l.contains("name=\"NP:x:isolation:Egress:default\", verdict=drop, severity=alert, direction=from-lport: tcp,nw_src=10.244.1.2,nw_dst=10.244.2.2")),
        "{audit}"
    );
    assert!(
        audit.lines().any(|l| l.contains("name=\"NP:x:isolation:Ingress:default\", verdict=drop, severity=alert, direction=to-lport: tcp,nw_src=10.244.2.2,nw_dst=10.244.1.3")),
        "{audit}"
    );
    assert!(
        !audit.contains("verdict=allow"),
        "allows are not audited in x: {audit}"
    );
    if let Some(dir) = audit_log.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
    // What the pinned maps hold, decoded by `dataplane inspect`.
    let inspect = |table: &str, json: bool| -> String {
        let mut command = std::process::Command::new(dataplane_binary());
        command
            .arg("--pin-root")
            .arg(agent0.pins.root())
            .args(["inspect", table]);
        if json {
            command.arg("--json");
        }
        let out = command.output().expect("dataplane inspect");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let services = inspect("services", false);
    assert!(
        services
            .lines()
            .any(|l| l.starts_with("10.96.0.50:80") && l.contains("tcp") && l.contains("cluster")),
        "{services}"
    );
    // In JSON, numbers are numbers and the backends are named by address.
    let services: serde_json::Value =
        serde_json::from_str(&inspect("services", true)).expect("JSON");
    let service = services
        .as_array()
        .expect("rows")
        .iter()
        .find(|row| row["address"] == "10.96.0.50:80")
        .unwrap_or_else(|| panic!("{services}"));
    assert!(service["id"].is_u64(), "{service}");
    assert_eq!(service["backends"], 1, "{service}");
    assert_eq!(service["affinity_s"], 0, "{service}");
    assert_eq!(
        service["backend_addresses"],
        serde_json::json!([format!("{s}:8080")]),
        "{service}"
    );
    let policy = inspect("policy", false);
    assert!(
        policy.lines().any(|l| l.starts_with(&format!("pod {s} "))
            && l.contains("ingress set")
            && l.contains("egress set -")),
        "{policy}"
    );
    assert!(policy.contains("allowed flow"), "{policy}");
    let nodes = inspect("nodes", false);
    assert!(
        nodes.contains("10.244.2.0/24") && nodes.contains("via node 10.99.0.2"),
        "{nodes}"
    );
    let conntrack: serde_json::Value =
        serde_json::from_str(&inspect("conntrack", true)).expect("JSON");
    let tracked = conntrack.as_array().expect("rows").iter().any(|row| {
        row["flow"]
            .as_str()
            .is_some_and(|f| f.ends_with("-> 10.96.0.50:80"))
            && row["translated_to"] == format!("{s}:8080")
    });
    if socket_lb_on() {
        // Given its backend at the socket: the flow needed no conntrack entry, and policy
        // judged the backend's address as it does after the per-packet DNAT.
        assert!(!tracked, "{conntrack}");
        assert_eq!(service["from_pods"], "socket", "{service}");
    } else {
        assert!(tracked, "{conntrack}");
    }

    // A label change: namespace y now carries team: x, so the client's egress policy selects
    // its pods too. The agents see the changed manifest and re-evaluate the selectors.
    topology
        .add_manifest(
            "policies.yaml",
            &MANIFESTS.replace(
                "metadata: {name: y, labels: {team: y}}",
                "metadata: {name: y, labels: {team: x}}",
            ),
        )
        .expect("changed manifests");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let mut seen = probe(&client, &[("tcp", &o, 8080)]).expect("probe");
    while seen != [o.as_str()] && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(300));
        seen = probe(&client, &[("tcp", &o, 8080)]).expect("probe");
    }
    assert_eq!(seen, vec![o.as_str()], "{}", agent0.log());
    // The change was synced as one (or, when the tests' 2 s full recompute came first, by
    // it, as a change not yet synced rather than a missed one).
    let log = agent0.log();
    assert!(
        log.contains("cluster changed; syncing")
            || log.contains("full recompute, with changes not yet synced"),
        "{log}"
    );
    // The server's ingress policy did not change: the outsider is still refused.
    assert_eq!(
        probe(&outsider, &[("tcp", &s, 8080)]).expect("probe"),
        vec!["timeout"]
    );

    let c0 = agent0.counters().expect("counters");
    // A cross-node flow's segments with data reach the pod from `tc_underlay`, which judges
    // and tracks them as `tc_to_pod` did before it handed them over itself.
    assert!(
        c0.packets(Hook::UnderlayTc, PacketClass::PolicyTracked) >= 1,
        "{c0:?}"
    );
    let _ = agent1;
    drop(servers);
}
