//! Egress IPs end to end on three overlay nodes and a host outside the cluster on their
//! underlay: the controller (`dataplane controller --manifests`, run on that host) assigns the
//! address, the agents reroute and translate, the outside host sees the egress IP and is
//! answered; the address moves without two nodes answering for it, and fails over when its
//! node loses its link.

use std::{
    fs,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use dataplane_tests::{
    capture::Capture,
    cni,
    egress_topology::{
        ASSIGNABLE, ASSIGNABLE_DUAL_STACK, ArpProber, EGRESS_IP, UdpReceiver, UdpSender,
        api_status, arp_answers, egress_cluster, egress_ip_yaml, holder, spawn_in, start_agents,
        start_api_controller, start_controller, start_shared_apiserver, underlay_mac,
    },
    privileged::privileged,
    service_bed::{echo_server, tcp_answers},
    topology::{ExternalHost, dataplane_binary, exec_in, node_name, sh_in},
};

#[test]
fn selected_pods_leave_from_the_egress_ip_and_it_fails_over() {
    if !privileged("selected_pods_leave_from_the_egress_ip_and_it_fails_over") {
        return;
    }
    let (mut topology, external, manifests) =
        egress_cluster(&[0, 1], ASSIGNABLE).expect("topology");
    topology
        .add_manifest(
            "egressip.yaml",
            &egress_ip_yaml("prod", &format!("[{EGRESS_IP}]"), "prod"),
        )
        .expect("egress ip manifest");
    let metrics = "0.0.0.0:9476".to_owned();
    let agents = start_agents(&topology, &metrics, &[]).expect("agents");
    let _server = echo_server(&external.netns, "ext", false).expect("server outside");
    let controller = start_controller(&external, &manifests);
    let first = holder(&manifests, None, Duration::from_secs(10))
        .unwrap_or_else(|| panic!("no holder published\n{}", controller.log()));
    assert_eq!(
        first,
        node_name(0),
        "the first by name of three empty nodes"
    );
    // The agent applies the status within its 100 ms tick.
    thread::sleep(Duration::from_millis(500));

    let prod_local = topology.node(0).pods[0].clone();
    let prod_remote = topology.node(1).pods[0].clone();
    let other = topology.node(2).pods[0].clone();
    let seen = |pod: &dataplane_tests::topology::Pod| {
        tcp_answers(&pod.netns, "10.99.0.100", 8080, 2).unwrap_or_else(|e| {
            panic!(
                "{} to the outside host: {e:#}\n{}\n{}",
                pod.name,
                agents[0].log(),
                agents[1].log()
            )
        })
    };
    assert_eq!(
        seen(&prod_local),
        vec![format!("ext {EGRESS_IP}"); 2],
        "a selected pod on the egress node"
    );
    assert_eq!(
        seen(&prod_remote),
        vec![format!("ext {EGRESS_IP}"); 2],
        "a selected pod on another node, rerouted through the overlay"
    );
    assert_eq!(
        seen(&other),
        vec!["ext 10.99.0.3".to_owned(); 2],
        "a pod of another namespace leaves with its node's address (the gateway SNAT)"
    );
    // Ping too: the echo identifier stands for the port, and the replies come back.
    for pod in [&prod_local, &prod_remote] {
        assert_eq!(
            ping_sources(&external, pod, "10.99.0.100"),
            vec![EGRESS_IP.to_owned(); 2],
            "{}'s echo requests",
            pod.name
        );
    }

    // `dataplane inspect egressip` on the holder and on the remote pod's node.
    let inspect = |agent: &dataplane_tests::topology::Agent| {
        let out = Command::new(dataplane_binary())
            .arg("--pin-root")
            .arg(agent.pins.root())
            .args(["inspect", "egressip"])
            .output()
            .expect("dataplane inspect");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let on_holder = inspect(&agents[0]);
    let has =
        |table: &str, words: &[&str]| table.lines().any(|l| words.iter().all(|w| l.contains(w)));
    assert!(
        has(&on_holder, &["address", EGRESS_IP, "held here"]),
        "{on_holder}"
    );
    assert!(
        has(
            &on_holder,
            &["translated", &prod_remote.ip.to_string(), EGRESS_IP]
        ),
        "{on_holder}"
    );
    assert!(
        has(&on_holder, &["flow out", &prod_remote.ip.to_string()]),
        "{on_holder}"
    );
    let on_remote = inspect(&agents[1]);
    assert!(
        has(
            &on_remote,
            &["address", EGRESS_IP, "held by node 10.99.0.1"]
        ),
        "{on_remote}"
    );
    assert!(
        has(&on_remote, &["pod", &prod_remote.ip.to_string(), EGRESS_IP]),
        "{on_remote}"
    );

    // `dataplane trace`: on the remote pod's node, the flow's chosen address and the Geneve
    // leg to the holder; on the holder, the translation and the packet leaving as the egress IP.
    let trace = |node: usize, pod: &dataplane_tests::topology::Pod| {
        let out = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", topology.node(node).netns))
            .arg(dataplane_binary())
            .arg("--pin-root")
            .arg(agents[node].pins.root())
            .args([
                "trace",
                "--from",
                &pod.ip.to_string(),
                "--to",
                "10.99.0.100:8080",
                "--json",
            ])
            .env("RUST_LOG", "warn")
            .output()
            .expect("dataplane trace");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("JSON")
    };
    let rerouted = trace(1, &prod_remote);
    let text = rerouted.to_string();
    assert!(text.contains("egress_rerouted"), "{rerouted:#}");
    assert!(text.contains("geneve vni 1"), "{rerouted:#}");
    assert!(
        text.contains("flow chose") && text.contains(EGRESS_IP),
        "{rerouted:#}"
    );
    let translated = trace(0, &prod_local);
    let text = translated.to_string();
    assert!(text.contains("egress_snat"), "{translated:#}");
    assert!(
        text.contains(&format!("ip {EGRESS_IP} > 10.99.0.100")),
        "{translated:#}"
    );

    // Only the holder answers ARP for the address.
    assert_eq!(
        arp_answers(&external),
        vec![underlay_mac(&topology.node(0).netns)]
    );
    // The node's own sockets never answer on it: with a listener on every address of the
    // holder's port 8080, a connection to the egress IP's port 8080 is not accepted.
    let _sshd = echo_server(&topology.node(0).netns, "sshd", false).expect("listener");
    let ssh = exec_in(
        &external.netns,
        &[
            "python3",
            "-c",
            &format!(
                "import socket\ntry:\n    socket.create_connection(('{EGRESS_IP}', 8080), timeout=1); print('accepted')\nexcept OSError as e:\n    print('refused', e)"
            ),
        ],
    )
    .expect("connect");
    let ssh = String::from_utf8_lossy(&ssh.stdout).into_owned();
    assert!(ssh.contains("timed out"), "{ssh}");

    // A planned move (node 0 loses its label): ARP asked all along, never two answers.
    let prober = ArpProber::start(&external);
    topology
        .set_node_metadata_of(0, "")
        .expect("unlabel node 0");
    let moved = holder(&manifests, Some(&node_name(1)), Duration::from_secs(10));
    assert_eq!(moved, Some(node_name(1)), "{}", controller.log());
    thread::sleep(Duration::from_millis(500));
    let answers = prober.finish();
    let node0_mac = underlay_mac(&topology.node(0).netns);
    let node1_mac = underlay_mac(&topology.node(1).netns);
    assert!(
        answers.iter().all(|macs| macs.len() <= 1),
        "two nodes answered at once: {answers:?}"
    );
    assert_eq!(answers.first().map(Vec::as_slice), Some(&[node0_mac][..]));
    assert_eq!(answers.last().map(Vec::as_slice), Some(&[node1_mac][..]));
    assert_eq!(
        seen(&prod_local),
        vec![format!("ext {EGRESS_IP}"); 2],
        "node 0's pod, now rerouted to node 1"
    );

    // Failover: node 1 loses its underlay link while node 0's pod streams UDP out.
    let capture = Capture::start(
        &topology.fabric,
        "br0",
        "ip and dst host 10.99.0.100 and src net 10.244.0.0/16",
        100,
        &["ip.src"],
    )
    .expect("capture");
    let receiver = UdpReceiver::start(&external);
    let sender = UdpSender::start(&prod_local, 300);
    thread::sleep(Duration::from_secs(1));
    let cut = std::time::SystemTime::now();
    sh_in(&topology.fabric, "ip link set n1 down").expect("cut node 1");
    let failed_over = holder(&manifests, Some(&node_name(2)), Duration::from_secs(10));
    assert_eq!(failed_over, Some(node_name(2)), "{}", controller.log());
    sender.finish();
    let arrivals = receiver.finish();
    let cut_at = cut
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        arrivals.iter().all(|(_, source)| source == EGRESS_IP),
        "a datagram left with another source: {arrivals:?}"
    );
    let resumed = arrivals
        .iter()
        .map(|(at, _)| *at)
        .find(|at| *at > cut_at + 0.05)
        .expect("the stream resumed");
    let failover = resumed - cut_at;
    println!("egress IP failover: the UDP stream resumed {failover:.2} s after the link went down");
    assert!(failover < 3.0, "failover took {failover:.2} s");
    let leaked = capture.finish().expect("capture");
    assert!(
        leaked.is_empty(),
        "pod addresses on the underlay: {leaked:?}"
    );
    drop(controller);
}

/// Pings `target` on the outside host twice from `pod` (both answered) and returns the
/// sources of the echo requests as the outside host received them (tshark).
/// On a fabric whose node ports run neither XDP nor GRO (a kind or k3d node's veth, whose
/// host end is an ordinary bridge port), where a frame XDP sends back out of the uplink is
/// dropped: the holder still answers ARP for the egress IP (at tc, the agent having found a
/// veth uplink), and selected pods leave from it, from the holder and through the overlay.
#[test]
fn on_a_fabric_that_drops_xdp_transmits_the_egress_ip_is_answered_and_used() {
    if !privileged("on_a_fabric_that_drops_xdp_transmits_the_egress_ip_is_answered_and_used") {
        return;
    }
    let (topology, external, manifests) = egress_cluster(&[0, 1], ASSIGNABLE).expect("topology");
    topology.plain_fabric_ports().expect("plain bridge ports");
    topology
        .add_manifest(
            "egressip.yaml",
            &egress_ip_yaml("prod", &format!("[{EGRESS_IP}]"), "prod"),
        )
        .expect("egress ip manifest");
    // As deployed: the agent decides (a veth uplink: XDP sends nothing back out).
    let agents =
        start_agents(&topology, "0.0.0.0:9476", &["--xdp-forward", "auto"]).expect("agents");
    let _server = echo_server(&external.netns, "ext", false).expect("server outside");
    let controller = start_controller(&external, &manifests);
    let first = holder(&manifests, None, Duration::from_secs(10))
        .unwrap_or_else(|| panic!("no holder published\n{}", controller.log()));
    assert_eq!(first, node_name(0));
    thread::sleep(Duration::from_millis(500));
    assert_eq!(
        arp_answers(&external),
        vec![underlay_mac(&topology.node(0).netns)],
        "{:#?}",
        agents[0].counters()
    );
    for pod in [&topology.node(0).pods[0], &topology.node(1).pods[0]] {
        assert_eq!(
            tcp_answers(&pod.netns, "10.99.0.100", 8080, 2).expect("to the outside host"),
            vec![format!("ext {EGRESS_IP}"); 2],
            "{}",
            pod.name
        );
    }
}

fn ping_sources(
    external: &ExternalHost,
    pod: &dataplane_tests::topology::Pod,
    target: &str,
) -> Vec<String> {
    let v6 = target.contains(':');
    let (filter, field) = if v6 {
        ("icmp6 and ip6[40] == 128", "ipv6.src")
    } else {
        ("icmp and icmp[icmptype] == icmp-echo", "ip.src")
    };
    let capture = Capture::start(&external.netns, "eth0", filter, 2, &[field]).expect("capture");
    let out = exec_in(
        &pod.netns,
        &["ping", "-c", "2", "-i", "0.2", "-W", "2", target],
    )
    .expect("ping");
    assert!(
        out.status.success(),
        "{} pinging {target}: {}",
        pod.name,
        String::from_utf8_lossy(&out.stdout)
    );
    capture.finish().expect("capture")
}

/// Keeps `count` TCP connections from a pod to the outside host open and asks each, three
/// times, which source it sees; the sources of each connection in order.
fn sources_per_connection(
    pod: &dataplane_tests::topology::Pod,
    external: &ExternalHost,
    count: usize,
) -> Vec<Vec<String>> {
    let server = "import socket, threading\n\
                  t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
                  t.bind(('0.0.0.0', 7070)); t.listen(256)\n\
                  def serve(c, a):\n\
                  \x20   while c.recv(10): c.sendall(f'{a[0]}\\n'.encode())\n\
                  while True:\n\
                  \x20   c, a = t.accept(); threading.Thread(target=serve, args=(c, a), daemon=True).start()\n";
    let _server = spawn_in(&external.netns, &["python3", "-c", server], "server");
    thread::sleep(Duration::from_millis(500));
    let client = format!(
        "import socket\n\
         conns = [socket.create_connection(('10.99.0.100', 7070), timeout=5) for _ in range({count})]\n\
         seen = [[] for _ in conns]\n\
         for _ in range(3):\n\
         \x20   for i, c in enumerate(conns):\n\
         \x20       c.sendall(b'x'); seen[i].append(c.recv(100).decode().strip())\n\
         for s in seen: print(' '.join(s))\n"
    );
    let out = exec_in(&pod.netns, &["python3", "-c", &client]).expect("client");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect()
}

#[test]
fn flows_spread_over_two_egress_ips_and_bad_objects_are_named() {
    if !privileged("flows_spread_over_two_egress_ips_and_bad_objects_are_named") {
        return;
    }
    let (topology, external, manifests) = egress_cluster(&[0, 2], ASSIGNABLE).expect("topology");
    topology
        .add_manifest(
            "egressip.yaml",
            &egress_ip_yaml("prod", "[10.99.0.50, 10.99.0.51]", "prod"),
        )
        .expect("egress ip manifest");
    // Read after the good one (files are read in name order): each loses to it or fails.
    let bad = [
        ("dup", "[10.99.0.50]"),
        ("nosubnet", "[192.168.77.7]"),
        ("nodeaddr", "[10.99.0.3]"),
        (
            "toomany",
            "[10.99.0.60, 10.99.0.61, 10.99.0.62, 10.99.0.63]",
        ),
    ];
    let bad_yaml: Vec<String> = bad
        .iter()
        .map(|(name, ips)| egress_ip_yaml(name, ips, "nobody"))
        .collect();
    topology
        .add_manifest("zz-bad.yaml", &bad_yaml.join("---\n"))
        .expect("bad manifests");
    // A NodePort whose backend is a selected pod: its answers are replies, not egress.
    let backend = topology.node(0).pods[0].clone();
    topology
        .add_manifest(
            "nodeport.yaml",
            &format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: prod}}\n\
                 spec: {{type: NodePort, clusterIP: 10.96.0.30, clusterIPs: [10.96.0.30], \
                 ports: [{{port: 80, targetPort: 8080, nodePort: 30090, protocol: TCP}}]}}\n\
                 ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
                 metadata: {{name: web-1, namespace: prod, labels: {{kubernetes.io/service-name: web}}}}\n\
                 addressType: IPv4\nports: [{{port: 8080, protocol: TCP}}]\n\
                 endpoints: [{{addresses: [{}], conditions: {{ready: true}}}}]\n",
                backend.ip
            ),
        )
        .expect("nodeport manifest");
    topology
        .add_manifest(
            "firewall.yaml",
            "apiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\nmetadata: {name: default, namespace: prod}\n\
             spec:\n  egress:\n  - type: Deny\n    to: {cidrSelector: 10.99.0.100/32}\n    ports: [{protocol: TCP, port: 7171}]\n",
        )
        .expect("firewall manifest");
    let metrics = "0.0.0.0:9476".to_owned();
    let agents = start_agents(&topology, &metrics, &[]).expect("agents");
    let client = topology.node(2).pods[0].clone();

    // No controller yet, so no node holds the addresses: the selected pod's traffic out is
    // dropped, never sent with its own address.
    let receiver = UdpReceiver::start(&external);
    UdpSender::start(&client, 20).finish();
    let early = receiver.finish();
    assert!(
        early.is_empty(),
        "sent before any node held the address: {early:?}"
    );
    let counters = agents[2].counters().expect("counters");
    assert!(
        counters.drops(dataplane_common::drop::DropReason::EgressIpUnassigned) >= 20,
        "{counters:?}"
    );

    let controller = start_controller(&external, &manifests);
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        let status = fs::read_to_string(manifests.join("egressip-status/status.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
        let assigned = status
            .as_ref()
            .and_then(|s| s["prod"]["items"].as_array().map(Vec::len));
        if assigned == Some(2) || Instant::now() >= deadline {
            break status.unwrap_or_default();
        }
        thread::sleep(Duration::from_millis(50));
    };
    let items = |name: &str| -> Vec<(String, String)> {
        status[name]["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|i| {
                (
                    i["egressIP"].as_str().unwrap_or_default().to_owned(),
                    i["node"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect()
    };
    assert_eq!(
        items("prod"),
        [
            ("10.99.0.50".to_owned(), node_name(0)),
            ("10.99.0.51".to_owned(), node_name(1))
        ],
        "{}",
        controller.log()
    );
    assert_eq!(items("dup"), []);
    assert_eq!(items("nosubnet"), []);
    assert_eq!(items("nodeaddr"), []);
    assert_eq!(items("toomany").len(), 3, "one address per node");
    let log = controller.log();
    for expected in [
        "egressip=\"dup\" egress_ip=10.99.0.50 reason=\"duplicate\"",
        "egressip=\"nosubnet\" egress_ip=192.168.77.7 reason=\"no_subnet\"",
        "egressip=\"nodeaddr\" egress_ip=10.99.0.3 reason=\"node_address\"",
        "egressip=\"toomany\" egress_ip=10.99.0.63 reason=\"no_node\"",
    ] {
        assert!(log.contains(expected), "{expected} not in\n{log}");
    }
    let scrape = exec_in(
        &external.netns,
        &["curl", "-s", "http://127.0.0.1:9477/metrics"],
    )
    .expect("scrape");
    let scrape = String::from_utf8_lossy(&scrape.stdout).into_owned();
    for (name, reason) in [
        ("dup", "duplicate"),
        ("nosubnet", "no_subnet"),
        ("nodeaddr", "node_address"),
        ("toomany", "no_node"),
    ] {
        assert!(
            scrape
                .lines()
                .any(|l| l.starts_with("dataplane_egressip_unassigned{")
                    && l.contains(&format!("egressip=\"{name}\""))
                    && l.contains(&format!("reason=\"{reason}\""))),
            "{name} {reason} not in\n{scrape}"
        );
    }
    thread::sleep(Duration::from_millis(500));

    // 100 connections from a pod on the third node: spread over both addresses by flow hash,
    // each keeping its source.
    let sources = sources_per_connection(&client, &external, 100);
    assert_eq!(sources.len(), 100);
    for connection in &sources {
        assert_eq!(connection.len(), 3);
        assert!(
            connection.iter().all(|s| s == &connection[0]),
            "a connection changed its source: {connection:?}"
        );
    }
    let on_50 = sources.iter().filter(|c| c[0] == "10.99.0.50").count();
    let on_51 = sources.iter().filter(|c| c[0] == "10.99.0.51").count();
    println!("100 connections: {on_50} through 10.99.0.50, {on_51} through 10.99.0.51");
    assert_eq!(on_50 + on_51, 100, "{sources:?}");
    assert!(on_50 >= 20 && on_51 >= 20, "{on_50} / {on_51}");

    // Pod to pod keeps the pod's address.
    let _pod_server = dataplane_tests::service_bed::echo_backend(&backend, false).expect("backend");
    assert_eq!(
        tcp_answers(&client.netns, &backend.ip.to_string(), 8080, 1).expect("pod to pod"),
        vec![format!("{} {}", backend.ip, client.ip)]
    );
    // Pod to a node's own address keeps the pod's address.
    let _node_server = echo_server(&topology.node(1).netns, "node-1", false).expect("node server");
    assert_eq!(
        tcp_answers(&client.netns, "10.99.0.2", 8080, 1).expect("pod to node"),
        vec![format!("node-1 {}", client.ip)]
    );
    // The namespace's EgressFirewall still judges the selected pod's traffic out: port 7171
    // of the outside host is denied, although a server listens there.
    let _denied = spawn_in(
        &external.netns,
        &[
            "python3",
            "-c",
            "import socket\nt = socket.socket(); t.bind(('0.0.0.0', 7171)); t.listen(8)\nwhile True: t.accept()[0].close()\n",
        ],
        "denied",
    );
    let refused = exec_in(
        &client.netns,
        &[
            "python3",
            "-c",
            "import socket\ntry:\n    socket.create_connection(('10.99.0.100', 7171), timeout=1); print('connected')\nexcept OSError as e:\n    print('blocked', e)",
        ],
    )
    .expect("denied connection");
    let refused = String::from_utf8_lossy(&refused.stdout).into_owned();
    assert!(refused.starts_with("blocked"), "{refused}");

    // A NodePort from outside to the selected backend, through each node: answered, the
    // reply untranslated (the client's connection is to the node's address and port).
    for node in 0..3 {
        let address = dataplane_tests::topology::underlay_ip(node).to_string();
        let answers = tcp_answers(&external.netns, &address, 30090, 1)
            .unwrap_or_else(|e| panic!("NodePort on node {node}: {e:#}"));
        assert_eq!(answers.len(), 1, "NodePort on node {node}");
        assert!(
            answers[0].starts_with(&backend.ip.to_string()),
            "{answers:?}"
        );
    }
    drop(controller);
}

/// The MACs that answer a neighbour solicitation for `ip` from the outside host.
fn ns_answers(external: &ExternalHost, ip: &str) -> Vec<String> {
    let script = format!(
        "from scapy.all import *\n\
         conf.verb = 0\n\
         mac = get_if_hwaddr('eth0')\n\
         ns = Ether(src=mac, dst='33:33:ff:00:00:50')/IPv6(src='fd99::100', dst='ff02::1:ff00:50', hlim=255)/\
         ICMPv6ND_NS(tgt='{ip}')/ICMPv6NDOptSrcLLAddr(lladdr=mac)\n\
         answered = srp(ns, iface='eth0', timeout=0.5, multi=True)[0]\n\
         print(' '.join(sorted(set(r[ICMPv6NDOptDstLLAddr].lladdr for _, r in answered if ICMPv6NDOptDstLLAddr in r))))\n"
    );
    let out = exec_in(&external.netns, &["python3", "-c", &script]).expect("scapy ns");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

#[test]
fn ipv6_egress_ips_translate_and_only_the_holder_answers_neighbour_solicitations() {
    if !privileged("ipv6_egress_ips_translate_and_only_the_holder_answers_neighbour_solicitations")
    {
        return;
    }
    let (mut topology, external, manifests) =
        egress_cluster(&[0, 2], ASSIGNABLE_DUAL_STACK).expect("topology");
    exec_in(
        &external.netns,
        &["ip", "addr", "add", "fd99::100/64", "dev", "eth0", "nodad"],
    )
    .expect("external IPv6");
    // An object's addresses go to distinct nodes: 10.99.0.50 to node 0, fd99::50 to node 1.
    topology
        .add_manifest(
            "egressip.yaml",
            &egress_ip_yaml("prod", "[10.99.0.50, 'fd99::50']", "prod"),
        )
        .expect("egress ip manifest");
    let metrics = "[::]:9476".to_owned();
    let agents = start_agents(&topology, &metrics, &[]).expect("agents");
    let _server = echo_server(&external.netns, "ext", true).expect("IPv6 server outside");
    let controller = start_controller(&external, &manifests);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status =
            fs::read_to_string(manifests.join("egressip-status/status.json")).unwrap_or_default();
        if status.contains("fd99::50") || Instant::now() >= deadline {
            assert!(
                status.contains("fd99::50"),
                "{status}\n{}",
                controller.log()
            );
            break;
        }
        thread::sleep(Duration::from_millis(50));
    }
    thread::sleep(Duration::from_millis(500));
    // Only the holder answers for the address (the gratuitous NA went out when it took it).
    assert_eq!(
        ns_answers(&external, "fd99::50"),
        vec![underlay_mac(&topology.node(1).netns)]
    );
    for node in [0, 2] {
        let pod = topology.node(node).pods[0].clone();
        let answers = tcp_answers(&pod.netns, "fd99::100", 8080, 2).unwrap_or_else(|e| {
            let counters: Vec<String> = agents
                .iter()
                .map(|a| format!("{:?}", a.counters().map(|c| c.drops)))
                .collect();
            panic!("{} over IPv6: {e:#}\n{counters:#?}", pod.name)
        });
        assert_eq!(answers, vec!["ext fd99::50".to_owned(); 2], "{}", pod.name);
        assert_eq!(
            ping_sources(&external, &pod, "fd99::100"),
            vec!["fd99::50".to_owned(); 2],
            "{}'s ICMPv6 echo requests",
            pod.name
        );
    }

    // Node 0 goes NotReady: its IPv4 address moves to node 2 (node 1 holds the object's other
    // one), and the pods leave by it again.
    let v4_holder = |want| {
        dataplane_tests::egress_topology::holder_of(
            &manifests,
            "prod",
            "10.99.0.50",
            want,
            Duration::from_secs(10),
        )
    };
    assert_eq!(v4_holder(None), Some(node_name(0)), "{}", controller.log());
    topology.set_node_ready(0, false).expect("NotReady");
    let moved = v4_holder(Some(&node_name(2)));
    assert_eq!(moved, Some(node_name(2)), "{}", controller.log());
    thread::sleep(Duration::from_millis(500));
    let _server4 = echo_server(&external.netns, "ext", false).expect("IPv4 server outside");
    let pod = topology.node(0).pods[0].clone();
    assert_eq!(
        tcp_answers(&pod.netns, "10.99.0.100", 8080, 1).expect("after the move"),
        vec!["ext 10.99.0.50".to_owned()]
    );

    // The IPv6 address moves too: node 0 Ready again, node 1 NotReady. It goes to node 0 (node
    // 2 holds the object's other address); only node 0 answers for it, the outside host's
    // neighbour entry follows the unsolicited advertisement, and the pods leave by it again.
    topology.set_node_ready(0, true).expect("Ready");
    topology.set_node_ready(1, false).expect("NotReady");
    let moved = dataplane_tests::egress_topology::holder_of(
        &manifests,
        "prod",
        "fd99::50",
        Some(&node_name(0)),
        Duration::from_secs(10),
    );
    assert_eq!(moved, Some(node_name(0)), "{}", controller.log());
    thread::sleep(Duration::from_millis(500));
    let new_mac = underlay_mac(&topology.node(0).netns);
    let neighbour = exec_in(
        &external.netns,
        &["ip", "-6", "neigh", "show", "fd99::50", "dev", "eth0"],
    )
    .expect("neighbour entry");
    assert!(
        String::from_utf8_lossy(&neighbour.stdout).contains(&new_mac),
        "the outside host's entry for fd99::50: {}",
        String::from_utf8_lossy(&neighbour.stdout)
    );
    assert_eq!(ns_answers(&external, "fd99::50"), vec![new_mac]);
    let pod = topology.node(2).pods[0].clone();
    assert_eq!(
        tcp_answers(&pod.netns, "fd99::100", 8080, 1).expect("after the IPv6 move"),
        vec!["ext fd99::50".to_owned()]
    );
    drop(controller);
}

#[test]
fn against_an_api_server_one_controller_leads_writes_the_status_and_a_standby_takes_over() {
    if !privileged(
        "against_an_api_server_one_controller_leads_writes_the_status_and_a_standby_takes_over",
    ) {
        return;
    }
    let (topology, external, manifests) = egress_cluster(&[0, 1], ASSIGNABLE).expect("topology");
    topology
        .add_manifest(
            "egressip.yaml",
            &egress_ip_yaml("prod", &format!("[{EGRESS_IP}]"), "prod"),
        )
        .expect("egress ip manifest");
    let api = start_shared_apiserver(&external, &manifests);
    let kubeconfig = api.kubeconfig.to_string_lossy().into_owned();
    let probe_key = api.probe_key.to_string_lossy().into_owned();
    let _agents = start_agents(
        &topology,
        "0.0.0.0:9476",
        &[
            "--kubernetes",
            "--kubeconfig",
            &kubeconfig,
            "--probe-key-file",
            &probe_key,
        ],
    )
    .expect("agents");
    let _server = echo_server(&external.netns, "ext", false).expect("server outside");
    let mut replicas = vec![
        start_api_controller(&external, &api, "replica-a"),
        start_api_controller(&external, &api, "replica-b"),
    ];
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut status = Vec::new();
    while status.is_empty() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
        status = api_status(&external, "prod");
    }
    let logs = || -> String {
        replicas
            .iter()
            .map(|r| r.log())
            .collect::<Vec<_>>()
            .join("\n----\n")
    };
    assert_eq!(status, [(EGRESS_IP.to_owned(), node_name(0))], "{}", logs());
    let leaders: Vec<usize> = (0..2)
        .filter(|i| {
            replicas[*i]
                .log()
                .contains("leading the egress IP controller")
        })
        .collect();
    assert_eq!(leaders.len(), 1, "exactly one replica leads\n{}", logs());
    // The agents program from the API's status.
    thread::sleep(Duration::from_millis(700));
    for node in [0, 1] {
        let pod = topology.node(node).pods[0].clone();
        let answers = tcp_answers(&pod.netns, "10.99.0.100", 8080, 1)
            .unwrap_or_else(|e| panic!("{}: {e:#}", pod.name));
        assert_eq!(answers, vec![format!("ext {EGRESS_IP}")], "{}", pod.name);
    }

    // The leader goes: the standby takes the Lease once it expires, keeps the status, and the
    // traffic is translated again.
    let leader = leaders[0];
    drop(replicas.remove(leader));
    let standby = &replicas[0];
    let deadline = Instant::now() + Duration::from_secs(15);
    while !standby.log().contains("leading the egress IP controller") && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
    }
    assert!(
        standby.log().contains("leading the egress IP controller"),
        "{}",
        standby.log()
    );
    thread::sleep(Duration::from_millis(700));
    assert_eq!(
        api_status(&external, "prod"),
        [(EGRESS_IP.to_owned(), node_name(0))]
    );
    let pod = topology.node(1).pods[0].clone();
    assert_eq!(
        tcp_answers(&pod.netns, "10.99.0.100", 8080, 1).expect("after the takeover"),
        vec![format!("ext {EGRESS_IP}")]
    );
}

/// The forged probes of the issue, from a pod and from a host on the node network: none is
/// taken (a pod's address is refused outright; anything unsigned, or signed with another key,
/// or replayed, is refused), and the holder keeps its egress IP and its traffic through them.
#[test]
fn forged_and_replayed_probes_change_nothing() {
    if !privileged("forged_and_replayed_probes_change_nothing") {
        return;
    }
    let (topology, external, manifests) = egress_cluster(&[0, 1], ASSIGNABLE).expect("topology");
    topology
        .add_manifest(
            "egressip.yaml",
            &egress_ip_yaml("prod", &format!("[{EGRESS_IP}]"), "prod"),
        )
        .expect("egress ip manifest");
    // As deployed: the agent decides (a veth uplink: XDP sends nothing back out).
    let agents =
        start_agents(&topology, "0.0.0.0:9476", &["--xdp-forward", "auto"]).expect("agents");
    let _server = echo_server(&external.netns, "ext", false).expect("server outside");
    let controller = start_controller(&external, &manifests);
    let first = holder(&manifests, None, Duration::from_secs(10))
        .unwrap_or_else(|| panic!("no holder published\n{}", controller.log()));
    assert_eq!(first, node_name(0));
    thread::sleep(Duration::from_millis(500));
    let node0 = topology.node(0).underlay_ip;
    let get = |netns: &str, query: &str| -> String {
        let script = format!(
            "import urllib.request, urllib.error\n\
             try:\n    r = urllib.request.urlopen('http://{node0}:9478/egressip/probe?{query}', timeout=3); print(r.status, r.read().decode())\n\
             except urllib.error.HTTPError as e:\n    print(e.code, e.read().decode())\n\
             except Exception as e:\n    print('unreachable', e)\n"
        );
        let out = exec_in(netns, &["python3", "-c", &script]).expect("python");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    // The forgery: `seq` at its largest (and the new fields at theirs), unsigned.
    let forged = format!(
        "node={}&seq=18446744073709551615&epoch=18446744073709551615&counter=18446744073709551615&grant=",
        node_name(0)
    );
    let pod = &topology.node(1).pods[0];
    let from_pod = get(&pod.netns, &forged);
    assert!(from_pod.starts_with("403 refused: 10.244.2."), "{from_pod}");
    assert!(from_pod.contains("pods may not probe"), "{from_pod}");
    let from_host = get(&external.netns, &forged);
    assert!(from_host.starts_with("403 mac: missing"), "{from_host}");
    // Signed with a key that is not the cluster's.
    let wrong =
        dataplane_user::egressip::probe::ProbeKey::from_bytes(b"not the cluster's key at all")
            .unwrap();
    let signed_wrong = dataplane_user::egressip::probe::Probe {
        node: node_name(0),
        order: dataplane_user::egressip::probe::Order {
            epoch: u64::MAX,
            counter: u64::MAX,
        },
        grants: Default::default(),
    }
    .to_query(&wrong);
    let refused = get(&external.netns, &signed_wrong);
    assert!(
        refused.starts_with("403 not signed with the cluster's probe key"),
        "{refused}"
    );
    // A real probe replayed (signed with the cluster's key, counter 1 of the first epoch):
    // older than what the node took since.
    let key = dataplane_user::egressip::probe::ProbeKey::read(
        &manifests.join(dataplane_user::egressip::probe::MANIFEST_KEY_FILE),
    )
    .expect("the controller's key");
    let replayed = dataplane_user::egressip::probe::Probe {
        node: node_name(0),
        order: dataplane_user::egressip::probe::Order {
            epoch: 1,
            counter: 1,
        },
        grants: Default::default(),
    }
    .to_query(&key);
    let stale = get(&external.netns, &replayed);
    assert!(stale.starts_with("409 probe"), "{stale}");
    // Through all of it (and three reachability timeouts after), node 0 holds the address
    // and the selected pods leave from it.
    thread::sleep(Duration::from_secs(3));
    assert_eq!(
        holder(&manifests, None, Duration::from_secs(1)),
        Some(node_name(0))
    );
    assert_eq!(
        tcp_answers(&topology.node(0).pods[0].netns, "10.99.0.100", 8080, 2).expect("tcp"),
        vec![format!("ext {EGRESS_IP}"); 2],
        "{}",
        agents[0].log()
    );
    assert!(
        agents[0].log().contains("egress IP probe refused"),
        "{}",
        agents[0].log()
    );
}

/// Nothing slow stalls the agent: with node 0's conntrack map full (every scrape of /metrics
/// counting a quarter of a million entries would take a while), /metrics is scraped without
/// pause while the plugin wires pods there: every ADD stays under its deadline, every scrape
/// is answered, /healthz stays 200, and the egress IP's probes keep node 0 the holder.
#[test]
fn scrapes_against_a_full_conntrack_map_stall_neither_cni_adds_nor_egress_probes() {
    if !privileged("scrapes_against_a_full_conntrack_map_stall_neither") {
        return;
    }
    use dataplane_common::lb::{CtKey, CtValue};
    let (mut topology, external, manifests) =
        egress_cluster(&[0, 1], ASSIGNABLE).expect("topology");
    topology
        .add_manifest(
            "egressip.yaml",
            &egress_ip_yaml("prod", &format!("[{EGRESS_IP}]"), "prod"),
        )
        .expect("egress ip manifest");
    const ADDS: usize = 6;
    let pods: String = (0..ADDS)
        .map(|i| {
            format!(
                "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: load-{i}, namespace: default, uid: uid-load-{i}}}\n\
                 spec: {{nodeName: {}, containers: [{{name: c, image: i}}]}}\n",
                node_name(0)
            )
        })
        .collect();
    topology.add_manifest("load.yaml", &pods).expect("pods");
    let agents = start_agents(&topology, "0.0.0.0:9476", &[]).expect("agents");
    let controller = start_controller(&external, &manifests);
    assert_eq!(
        holder(&manifests, None, Duration::from_secs(10)),
        Some(node_name(0)),
        "{}",
        controller.log()
    );
    // Node 0's conntrack map, filled to its size.
    let mut ct = aya::maps::HashMap::<_, CtKey, CtValue>::try_from(aya::maps::Map::LruHashMap(
        aya::maps::MapData::from_pin(agents[0].pins.map(dataplane_common::maps::LB_CT))
            .expect("pinned conntrack map"),
    ))
    .expect("conntrack map");
    for i in 0..dataplane_common::maps::DEFAULT_CT_ENTRIES {
        let key = CtKey {
            src: dataplane_user::mapsync::addr16(std::net::IpAddr::from(
                (0x0a80_0000 + i).to_be_bytes(),
            )),
            protocol: 17,
            ..CtKey::default()
        };
        ct.insert(key, CtValue::default(), 0).expect("an entry");
    }
    // An LRU map may make room a little before its size: what it holds, counted.
    let size = ct.keys().filter(Result::is_ok).count();
    assert!(size > 250_000, "{size} entries");
    // Scraping without pause from inside node 0, while the ADDs run.
    let netns = topology.node(0).netns.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let scraping = {
        let stop = std::sync::Arc::clone(&stop);
        thread::spawn(move || {
            dataplane_tests::topology::in_netns(&netns, move || {
                let get = |path: &str| -> anyhow::Result<(Duration, String)> {
                    use std::io::{Read as _, Write as _};
                    let started = Instant::now();
                    let mut stream = std::net::TcpStream::connect("127.0.0.1:9476")?;
                    stream.set_read_timeout(Some(Duration::from_secs(20)))?;
                    write!(
                        stream,
                        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                    )?;
                    let mut text = String::new();
                    stream.read_to_string(&mut text)?;
                    Ok((started.elapsed(), text))
                };
                let mut slowest = Duration::ZERO;
                let mut scrapes = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let (took, text) = get("/metrics")?;
                    anyhow::ensure!(text.starts_with("HTTP/1.1 200"), "{text}");
                    anyhow::ensure!(
                        text.contains(&format!("dataplane_map_entries{{map=\"DP_LB_CT\"}} {size}")),
                        "the full map counted"
                    );
                    let (_, health) = get("/healthz")?;
                    anyhow::ensure!(health.starts_with("HTTP/1.1 200"), "{health}");
                    slowest = slowest.max(took);
                    scrapes += 1;
                }
                Ok((scrapes, slowest))
            })
        })
    };
    let conf = cni::conf("1.1.0", &cni::socket(&agents[0]));
    let mut slowest_add = Duration::ZERO;
    for i in 0..ADDS {
        let mut container = cni::container(&mut topology, "default", &format!("load-{i}")).unwrap();
        container.uid = format!("uid-load-{i}");
        let started = Instant::now();
        cni::add(&container, &conf)
            .unwrap_or_else(|e| panic!("ADD {i}: {e:#}\n{}", agents[0].log()));
        slowest_add = slowest_add.max(started.elapsed());
    }
    thread::sleep(Duration::from_secs(2));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (scrapes, slowest_scrape) = scraping.join().expect("scraper").expect("scrapes");
    assert!(scrapes > 3, "{scrapes} scrapes");
    assert!(
        slowest_add < Duration::from_secs(5),
        "an ADD took {slowest_add:?}"
    );
    assert!(
        slowest_scrape < Duration::from_secs(5),
        "a scrape took {slowest_scrape:?}"
    );
    // The probes kept the lease: node 0 held the address throughout.
    assert_eq!(
        holder(&manifests, None, Duration::from_secs(1)),
        Some(node_name(0))
    );
    assert!(
        !controller.log().contains("stopped answering"),
        "{}",
        controller.log()
    );
}
