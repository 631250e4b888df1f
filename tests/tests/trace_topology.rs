//! `dataplane trace` on a live node: a described packet runs through the node's real programs
//! against copies of its maps. A pod's connection to a ClusterIP shows the translation, the
//! conntrack entry it would create (backend = the rewritten destination) and the packet as it
//! leaves; a packet an EgressFirewall denies shows the drop and its reason; and the node's own
//! maps are left exactly as they were.

use dataplane_tests::{
    privileged::privileged,
    service_bed::{ServicePort, cluster_ip_manifests},
    topology::{Mode, Topology, dataplane_json},
};
use serde_json::Value;

const SERVICE_IP: &str = "10.96.0.70";

#[test]
fn trace_shows_translation_conntrack_and_firewall_drops_without_touching_live_maps() {
    if !privileged(
        "trace_shows_translation_conntrack_and_firewall_drops_without_touching_live_maps",
    ) {
        return;
    }
    let topology = Topology::build_with(2, 1, Mode::Overlay).expect("build topology");
    let (client, backend) = (&topology.node(0).pods[0], &topology.node(1).pods[0]);
    let ports = [ServicePort {
        name: "http",
        port: 80,
        protocol: "TCP",
        target: 8080,
    }];
    topology
        .add_manifest(
            "web.yaml",
            &cluster_ip_manifests("web", SERVICE_IP, &ports, &[backend]),
        )
        .expect("service");
    topology
        .add_manifest(
            "firewall.yaml",
            "apiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\n\
             metadata: {name: default, namespace: default}\n\
             spec: {egress: [{type: Deny, to: {cidrSelector: 192.0.2.0/24}, ports: [{protocol: TCP, port: 443}]}]}\n",
        )
        .expect("firewall");
    let node0 = topology.node(0);
    let agent = node0.start_agent().expect("agent");
    let live_conntrack = || dataplane_json(node0, &agent, &["inspect", "conntrack"]);
    let conntrack_before = live_conntrack();
    let counters_before = agent.counters().expect("counters");

    // To the service: DNAT to the backend on the other node, Geneve out of the underlay.
    let to_service = format!("{SERVICE_IP}:80");
    let from = client.ip.to_string();
    let report = dataplane_json(
        node0,
        &agent,
        &["trace", "--from", &from, "--to", &to_service],
    );
    assert_eq!(report["entry"], "from_pod", "{report:#}");
    let step = &report["steps"][0];
    assert_eq!(step["program"], "tc_from_pod");
    assert!(
        step["verdict"]
            .as_str()
            .unwrap_or_default()
            .starts_with("redirect"),
        "{report:#}"
    );
    let decisions: Vec<&str> = step["decisions"]
        .as_array()
        .expect("decisions")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(decisions.contains(&"service_dnat"), "{decisions:?}");
    assert!(decisions.contains(&"geneve_encap"), "{decisions:?}");
    let output = step["output"].as_str().expect("output");
    let inner = format!("ip {} > {} ttl", client.ip, backend.ip);
    assert!(
        output.contains("udp") && output.contains("geneve vni 1") && output.contains(&inner),
        "{output}"
    );
    assert!(output.contains("tcp 40000 > 8080 [S]"), "{output}");
    let created: Vec<&str> = report["created"]
        .as_array()
        .expect("created")
        .iter()
        .filter(|c| c["table"] == "conntrack")
        .filter_map(|c| c["entry"].as_str())
        .collect();
    assert!(
        !created.is_empty() && created.iter().all(|e| e.contains(&backend.ip.to_string())),
        "the conntrack entries name the backend: {created:?}"
    );

    // Denied by the EgressFirewall: dropped, with the reason.
    let from = client.ip.to_string();
    let report = dataplane_json(
        node0,
        &agent,
        &["trace", "--from", &from, "--to", "192.0.2.10:443"],
    );
    assert_eq!(
        report["steps"],
        serde_json::json!([{
            "program": "tc_from_pod",
            "decisions": ["tcp", "dropped", "drop: firewall_denied"],
            "verdict": "shot (dropped)",
            "output": report["input"],
        }]),
        "one program, the drop and its reason: {report:#}"
    );
    assert_eq!(report["created"], serde_json::json!([]), "{report:#}");
    // The same address on another port passes the firewall.
    let report = dataplane_json(
        node0,
        &agent,
        &["trace", "--from", &from, "--to", "192.0.2.10:80"],
    );
    assert!(
        report["input"]
            .as_str()
            .is_some_and(|i| i.ends_with("ip 10.244.1.2 > 192.0.2.10 ttl 64, tcp 40000 > 80 [S]")),
        "{report:#}"
    );
    assert_eq!(
        report["steps"],
        serde_json::json!([{
            "program": "tc_from_pod",
            "decisions": ["tcp", "firewall_allowed"],
            "verdict": "ok (on through the stack)",
            "output": report["input"],
        }]),
        "allowed by the firewall, on to the node's stack unchanged: {report:#}"
    );
    assert_eq!(report["created"], serde_json::json!([]), "{report:#}");

    // Nothing live changed: no conntrack entry, no DNAT or drop counted, no trace pins left.
    assert_eq!(live_conntrack(), conntrack_before);
    let counters_after = agent.counters().expect("counters");
    for class in [
        dataplane_common::PacketClass::ServiceDnat,
        dataplane_common::PacketClass::GeneveEncap,
    ] {
        assert_eq!(
            counters_after.packets(dataplane_common::Hook::FromPod, class),
            counters_before.packets(dataplane_common::Hook::FromPod, class)
        );
    }
    assert_eq!(
        counters_after.drops(dataplane_common::DropReason::FirewallDenied),
        0
    );
    let leftovers: Vec<_> = std::fs::read_dir("/sys/fs/bpf")
        .expect("bpffs")
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("dataplane-trace-")
        })
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}
