//! The node and the pods of other nodes, end to end on a two-node overlay cluster whose
//! underlay has no routes to the pod CIDRs (the nodes share an L2 segment and nothing else):
//! a pod reaches another node's host network over TCP and UDP keeping its own address, a node
//! reaches a pod on another node (ping and TCP), and a Service whose endpoint is a node's own
//! address and port (as the `kubernetes` Service's are) answers pods on every node.

use dataplane_tests::{
    privileged::privileged,
    service_bed::{echo_backend, echo_server, probe, tcp_answers},
    topology::{Mode, Topology, exec_in, underlay_ip},
};

#[test]
fn nodes_and_other_nodes_pods_reach_each_other_through_the_overlay() {
    if !privileged("nodes_and_other_nodes_pods_reach_each_other_through_the_overlay") {
        return;
    }
    let topology = Topology::build_with(2, 2, Mode::Overlay).expect("topology");
    let (node0, node1) = (topology.node(0), topology.node(1));
    let pod = node0.pods[0].clone();
    let remote_pod = node1.pods[0].clone();
    let pod_on_node1 = node1.pods[1].clone();
    let (address0, address1) = (underlay_ip(0).to_string(), underlay_ip(1).to_string());
    // A `kubernetes`-like Service: its endpoint is node 1's own address and port.
    topology
        .add_manifest(
            "kubernetes.yaml",
            &format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: kubernetes, namespace: default}}\n\
                 spec: {{clusterIP: 10.96.0.1, clusterIPs: [10.96.0.1], \
                 ports: [{{name: https, port: 443, protocol: TCP, targetPort: 8080}}]}}\n\
                 ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
                 metadata: {{name: kubernetes, namespace: default, labels: {{kubernetes.io/service-name: kubernetes}}}}\n\
                 addressType: IPv4\nports: [{{name: https, port: 8080, protocol: TCP}}]\n\
                 endpoints: [{{addresses: [{address1}], conditions: {{ready: true}}}}]\n"
            ),
        )
        .expect("manifest");
    let _agent0 = node0.start_agent().expect("agent 0");
    let _agent1 = node1.start_agent().expect("agent 1");
    let _servers = [
        echo_server(&node1.netns, "node-1", false).expect("host server on node 1"),
        echo_backend(&remote_pod, false).expect("pod server on node 1"),
    ];
    // The underlay has no route to any pod CIDR: only the management port's.
    let routes = exec_in(
        &node0.netns,
        &["ip", "-o", "route", "show", "10.244.2.0/24"],
    )
    .expect("ip route");
    let routes = String::from_utf8_lossy(&routes.stdout).into_owned();
    assert!(
        routes.contains("dev dp-mp0") && routes.contains(&format!("src {address0}")),
        "{routes}"
    );

    // A pod to the other node's host network, TCP and UDP: the server sees the pod's own
    // address, and its answers find their way back through the overlay.
    let answers = tcp_answers(&pod.netns, &address1, 8080, 2).expect("pod to node 1, TCP");
    assert_eq!(answers, vec![format!("node-1 {}", pod.ip); 2]);
    assert_eq!(
        probe(&pod, &[("udp", &address1, 5353)]).expect("pod to node 1, UDP"),
        vec!["node-1"]
    );

    // The node to a pod on the other node: ping, and TCP with the node's address as source.
    let ping = exec_in(
        &node0.netns,
        &[
            "ping",
            "-n",
            "-q",
            "-c",
            "2",
            "-W",
            "2",
            &remote_pod.ip.to_string(),
        ],
    )
    .expect("ping");
    assert!(
        ping.status.success(),
        "{}{}",
        String::from_utf8_lossy(&ping.stdout),
        String::from_utf8_lossy(&ping.stderr)
    );
    let answers = tcp_answers(&node0.netns, &remote_pod.ip.to_string(), 8080, 2)
        .expect("node 0 to a pod on node 1");
    assert_eq!(answers, vec![format!("{} {address0}", remote_pod.ip); 2]);

    // The `kubernetes`-like Service from a pod of each node: from node 0 the endpoint is
    // another node, from node 1 the pod's own node (whose answer the pod's veth translates).
    for client in [&pod, &pod_on_node1] {
        let answers = tcp_answers(&client.netns, "10.96.0.1", 443, 2)
            .unwrap_or_else(|e| panic!("{} to the service: {e:#}", client.name));
        assert_eq!(
            answers,
            vec![format!("node-1 {}", client.ip); 2],
            "{}",
            client.name
        );
    }
}
