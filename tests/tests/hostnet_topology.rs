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

/// The management port as the agent keeps it, by netlink requests, in a namespace of its own:
/// the pair made, up at the pod MTU, the gateways' permanent neighbours naming the overlay
/// side's MAC, a route per other node's pod CIDR of each family from this node's address of
/// that family; a second sync changes nothing; a node gone takes its routes with it; a pair
/// set down is brought back up.
#[test]
fn the_management_port_follows_the_other_nodes_by_netlink() {
    use std::{net::IpAddr, sync::Arc};

    use dataplane_user::{
        api::network::OvnKubernetesConfig,
        mgmt,
        model::{NodeSeq, NodeView, OverlayView, Underlay},
    };
    use ipnet::IpNet;

    if !privileged("the_management_port_follows_the_other_nodes_by_netlink") {
        return;
    }
    let netns = dataplane_tests::netns::ThreadNetns::enter().expect("netns");
    // This node's addresses, the routes' sources.
    for line in [
        "link add underlay type veth peer name underlay-peer",
        "link set underlay-peer up",
        "addr add 10.99.0.1/24 dev underlay",
        "addr add fd99::1/64 dev underlay nodad",
        "link set underlay up",
    ] {
        netns.sh(line).expect(line);
    }
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let net = |s: &str| s.parse::<IpNet>().unwrap();
    let node = |name: &str, address: &str, cidrs: &[&str]| {
        Arc::new(NodeView {
            created: i64::MAX,
            name: name.into(),
            addresses: if name == "a" {
                vec![ip("10.99.0.1"), ip("fd99::1")]
            } else {
                vec![ip(address)]
            },
            pod_cidrs: cidrs.iter().map(|c| net(c)).collect(),
        })
    };
    let settings = OvnKubernetesConfig::default().validate(1500).unwrap();
    let view = |nodes: Vec<Arc<NodeView>>| OverlayView {
        this_node: "a".into(),
        nodes: Arc::new(NodeSeq::from_iter(nodes)),
        local_pods: Vec::new(),
        unrestricted_ifindexes: Vec::new(),
        underlay: Underlay {
            ifindex: 2,
            mac: [2, 0, 0, 0, 0, 1],
            xdp_forward: false,
            nodeport_listed: false,
            mtu: 1500,
        },
        settings,
        hybrid: None,
    };
    let a = node("a", "", &["10.244.1.0/24", "fd00:10:244:1::/64"]);
    let b = node("b", "10.99.0.2", &["10.244.2.0/24", "fd00:10:244:2::/64"]);
    let c = node("c", "10.99.0.3", &["10.244.3.0/24"]);
    let three = view(vec![a.clone(), b.clone(), c]);
    let sync = |v: &OverlayView| mgmt::sync(v, &settings, "underlay", &[]).expect("sync");
    let show = |args: &[&str]| {
        let out = std::process::Command::new("ip")
            .args(args)
            .output()
            .expect("ip");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };

    let first = sync(&three);
    assert_eq!((first.routes_added, first.routes_removed), (3, 0));
    assert!(first.ifindex != 0 && first.host_ifindex != 0 && first.ifindex != first.host_ifindex);
    let pod_mtu = settings.pod_mtu.to_string();
    for side in [mgmt::HOST_SIDE, mgmt::OVERLAY_SIDE] {
        let link = show(&["-o", "link", "show", side]);
        assert!(link.contains(&format!("mtu {pod_mtu} ")), "{link}");
        assert!(link.contains("state UP") || link.contains(",UP"), "{link}");
    }
    // (sysfs shows the process's namespace, not this thread's: the MAC from ip.)
    let overlay_link = show(&["-o", "link", "show", mgmt::OVERLAY_SIDE]);
    let overlay_mac = overlay_link
        .split("link/ether ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("the overlay side's MAC")
        .to_owned();
    let neighbours = show(&["neigh", "show", "dev", mgmt::HOST_SIDE]);
    for gateway in ["169.254.0.1", "fe80::d:1"] {
        assert!(
            neighbours.contains(&format!("{gateway} lladdr {overlay_mac} PERMANENT")),
            "{neighbours}"
        );
    }
    let v4 = show(&["-4", "-o", "route", "show", "dev", mgmt::HOST_SIDE]);
    for cidr in ["10.244.2.0/24", "10.244.3.0/24"] {
        assert!(
            v4.lines()
                .any(|l| l.starts_with(&format!("{cidr} via 169.254.0.1 "))
                    // (protocol boot, which ip does not print)
                && !l.contains("proto")
                    && l.contains("src 10.99.0.1")
                    && l.contains("onlink")),
            "{v4}"
        );
    }
    assert!(!v4.contains("10.244.1.0/24"), "this node's own CIDR: {v4}");
    let v6 = show(&["-6", "-o", "route", "show", "dev", mgmt::HOST_SIDE]);
    assert!(
        v6.lines().any(
            |l| l.starts_with("fd00:10:244:2::/64 via fe80::d:1 ") && l.contains("src fd99::1")
        ),
        "{v6}"
    );

    // Nothing differs: nothing written.
    let again = sync(&three);
    assert_eq!((again.routes_added, again.routes_removed), (0, 0));
    assert_eq!(
        (again.ifindex, again.host_ifindex),
        (first.ifindex, first.host_ifindex)
    );

    // Node c gone: its route goes.
    let two_nodes = view(vec![a, b]);
    let two = sync(&two_nodes);
    assert_eq!((two.routes_added, two.routes_removed), (0, 1));
    let v4 = show(&["-4", "-o", "route", "show", "dev", mgmt::HOST_SIDE]);
    assert!(
        !v4.contains("10.244.3.0/24") && v4.contains("10.244.2.0/24"),
        "{v4}"
    );

    // The pair set down (which takes its routes): up again, routes back.
    netns
        .sh(&format!("link set {} down", mgmt::HOST_SIDE))
        .expect("down");
    sync(&two_nodes);
    let link = show(&["-o", "link", "show", mgmt::HOST_SIDE]);
    assert!(link.contains(",UP"), "{link}");
    let v4 = show(&["-4", "-o", "route", "show", "dev", mgmt::HOST_SIDE]);
    assert!(v4.contains("10.244.2.0/24 via 169.254.0.1"), "{v4}");
    let v6 = show(&["-6", "-o", "route", "show", "dev", mgmt::HOST_SIDE]);
    assert!(v6.contains("fd00:10:244:2::/64 via fe80::d:1"), "{v6}");
    drop(netns);
}
