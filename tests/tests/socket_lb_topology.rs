//! Service translation at the socket (`--socket-lb on`): pods' TCP connections and UDP
//! datagrams to a ClusterIP are given a backend by the cgroup programs, in both families,
//! with real sockets in pods on two nodes. Checked: which backends answer, the client
//! address they see, `getpeername` and `recvfrom` giving the service address back, that no
//! packet of those flows was translated on the way (the per-packet counters stay at zero),
//! a service without endpoints refusing the connect at once, a removed backend taking no new
//! connection, ClientIP affinity left to the per-packet path, and a pod that reaches itself
//! through its service seeing its own address.

use std::collections::BTreeSet;

use dataplane_common::{Hook, PacketClass};
use dataplane_tests::{
    eventually,
    privileged::privileged,
    service_bed::{
        Server, ServicePort, check_answers, cluster_ip_manifests, dual_stack_manifests,
        echo_backend, service_requests, tcp_answers,
    },
    topology::{Agent, Mode, Node, Pod, Topology, exec_in},
};

const SERVICE_IP: &str = "10.96.0.30";
const SERVICE_IP6: &str = "fd00:10:96::30";

const HTTP: ServicePort = ServicePort {
    name: "http",
    port: 80,
    protocol: "TCP",
    target: 8080,
};
const DNS: ServicePort = ServicePort {
    name: "dns",
    port: 53,
    protocol: "UDP",
    target: 5353,
};
/// To [`holding_backend`]'s port.
const HOLD: ServicePort = ServicePort {
    name: "hold",
    port: 81,
    protocol: "TCP",
    target: 8081,
};

/// Adds the manifest `file` (`manifests`) and starts the echo servers on each node's second
/// pod (the backends), with [`holding_backend`]'s beside them when `hold`.
fn serve(topology: &Topology, file: &str, manifests: &str, hold: bool) -> Vec<Server> {
    topology.add_manifest(file, manifests).expect("manifests");
    let backends = [&topology.node(0).pods[1], &topology.node(1).pods[1]];
    let mut servers: Vec<Server> = backends
        .iter()
        .map(|p| echo_backend(p, false).expect("backend"))
        .collect();
    if hold {
        servers.extend(backends.iter().map(|p| holding_backend(p)));
    }
    servers
}

/// The agents of both nodes translating at the socket, node 0's with `extra` flags too.
fn start_agents(topology: &Topology, extra: &[&str]) -> (Agent, Agent) {
    let mut flags = vec!["--socket-lb", "on"];
    flags.extend_from_slice(extra);
    (
        topology.node(0).start_agent_with(&flags).expect("agent"),
        topology
            .node(1)
            .start_agent_with(&["--socket-lb", "on"])
            .expect("agent"),
    )
}

/// `dataplane ARGS` against `agent`'s pins, run in `node`'s namespace (as on a node: veths
/// are named from there).
fn dataplane_cli(node: &Node, agent: &Agent, args: &[&str]) -> std::process::Output {
    std::process::Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", node.netns))
        .arg(dataplane_tests::topology::dataplane_binary())
        .arg("--pin-root")
        .arg(agent.pins.root())
        .args(args)
        .output()
        .expect("dataplane")
}

/// Runs python `script` in `netns` and waits for its first line, which must be `ready`; the
/// script then waits for a line on its input to go on.
fn held_client(
    netns: &str,
    script: &str,
) -> (
    std::process::Child,
    std::io::BufReader<std::process::ChildStdout>,
) {
    let mut child = std::process::Command::new("nsenter")
        .arg(format!("--net=/run/netns/{netns}"))
        .args(["python3", "-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("client");
    let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut line).expect("ready");
    assert_eq!(line, "ready\n");
    (child, stdout)
}

/// Lets a [`held_client`] go on and returns the line it prints then.
fn go_on(
    child: &mut std::process::Child,
    stdout: &mut std::io::BufReader<std::process::ChildStdout>,
) -> String {
    std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), b"go\n").expect("go");
    let mut line = String::new();
    std::io::BufRead::read_line(stdout, &mut line).expect("outcome");
    let _ = child.wait();
    line
}

#[test]
fn pods_reach_a_dual_stack_cluster_ip_through_the_socket_with_no_packet_translated() {
    if !privileged(
        "pods_reach_a_dual_stack_cluster_ip_through_the_socket_with_no_packet_translated",
    ) {
        return;
    }
    let topology = Topology::build_with(2, 2, Mode::Overlay).expect("build topology");
    let backends = [&topology.node(0).pods[1], &topology.node(1).pods[1]];
    topology
        .add_manifest(
            "web.yaml",
            &dual_stack_manifests("web", SERVICE_IP, SERVICE_IP6, &backends),
        )
        .expect("manifests");
    let servers: Vec<Server> = backends
        .iter()
        .flat_map(|p| {
            [
                echo_backend(p, false).expect("backend"),
                echo_backend(p, true).expect("backend"),
            ]
        })
        .collect();
    let agents = [
        topology.node(0).start_agent_with(&["--socket-lb", "on"]),
        topology.node(1).start_agent_with(&["--socket-lb", "on"]),
    ]
    .map(|a| a.expect("agent"));
    let v4: BTreeSet<String> = backends.iter().map(|p| p.ip.to_string()).collect();
    let v6: BTreeSet<String> = backends
        .iter()
        .map(|p| p.ip6.expect("ip6").to_string())
        .collect();
    for client in [&topology.node(0).pods[0], &topology.node(1).pods[0]] {
        let lines = service_requests(&client.netns, SERVICE_IP, 12);
        assert_eq!(lines.len(), 24, "{lines:?}");
        let reached = check_answers(&lines, &v4, SERVICE_IP, |_| client.ip.to_string());
        assert_eq!(reached.len(), 4, "client {}: {reached:?}", client.ip);
        let lines = service_requests(&client.netns, SERVICE_IP6, 12);
        assert_eq!(lines.len(), 24, "{lines:?}");
        let client6 = client.ip6.expect("ip6").to_string();
        let reached = check_answers(&lines, &v6, SERVICE_IP6, |_| client6.clone());
        assert_eq!(reached.len(), 4, "client {client6}: {reached:?}");
    }
    for agent in &agents {
        let counters = agent.counters().expect("counters");
        // Every connection and datagram was given its backend at the socket: no packet of
        // them was translated on the way, in either direction.
        for class in [PacketClass::ServiceDnat, PacketClass::ServiceReverseNat] {
            assert_eq!(counters.packets(Hook::FromPod, class), 0, "{counters:?}");
            assert_eq!(counters.packets(Hook::UnderlayTc, class), 0, "{counters:?}");
        }
        assert!(counters.socket("connect") >= 24, "{counters:?}");
        assert_eq!(counters.socket("sendmsg"), 24, "{counters:?}");
        // getpeername for each connection, recvfrom for each datagram.
        assert!(counters.socket("reversed") >= 48, "{counters:?}");
    }

    // `dataplane inspect sockets`: the client pod served, and its live sockets with the
    // backend each talks to and the service address it asked for (a TCP connection and an
    // unconnected UDP socket to each family's service, held open meanwhile).
    let client = &topology.node(0).pods[0];
    let holder_script = format!(
        "import socket, sys\n\
         held = []\n\
         for family, address in ((socket.AF_INET, '{SERVICE_IP}'), (socket.AF_INET6, '{SERVICE_IP6}')):\n\
         \x20   t = socket.socket(family, socket.SOCK_STREAM); t.settimeout(5); t.connect((address, 80))\n\
         \x20   u = socket.socket(family, socket.SOCK_DGRAM); u.sendto(b'q', (address, 53))\n\
         \x20   held += [t, u]\n\
         print('ready', flush=True); sys.stdin.readline()\n"
    );
    let (mut holder, mut held) = held_client(&client.netns, &holder_script);
    let out = dataplane_cli(topology.node(0), &agents[0], &["inspect", "sockets"]);
    let table = String::from_utf8_lossy(&out.stdout);
    go_on(&mut holder, &mut held);
    let veth = format!("{} (", client.host_iface);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("pod ") && l.contains(&veth)),
        "{table}"
    );
    for service in [
        format!("{SERVICE_IP}:80"),
        format!("{SERVICE_IP}:53"),
        format!("[{SERVICE_IP6}]:80"),
        format!("[{SERVICE_IP6}]:53"),
    ] {
        let sockets = table
            .lines()
            .filter(|l| l.starts_with("socket ") && l.contains(&veth) && l.ends_with(&service))
            .count();
        assert_eq!(sockets, 1, "{service}: {table}");
    }

    // A backend reaching its own service: when it picks itself, it talks to itself and sees
    // its own address (no masquerade is needed at the socket).
    let hairpin = &topology.node(0).pods[1];
    let lines = tcp_answers(&hairpin.netns, SERVICE_IP, 80, 16).expect("hairpin");
    let mut seen = BTreeSet::new();
    for line in &lines {
        let (backend, client) = line.split_once(' ').expect("answer");
        assert_eq!(client, hairpin.ip.to_string(), "{line}");
        seen.insert(backend.to_owned());
    }
    assert_eq!(seen, v4, "both backends, itself included: {lines:?}");
    drop(servers);
}

#[test]
fn no_endpoints_refuse_at_connect_a_removed_backend_takes_no_new_connection_and_affinity_stays_per_packet()
 {
    if !privileged(
        "no_endpoints_refuse_at_connect_a_removed_backend_takes_no_new_connection_and_affinity_stays_per_packet",
    ) {
        return;
    }
    let topology = Topology::build_with(2, 2, Mode::Overlay).expect("build topology");
    let backends = [&topology.node(0).pods[1], &topology.node(1).pods[1]];
    topology
        .add_manifest(
            "web.yaml",
            &cluster_ip_manifests("web", "10.96.0.31", &[HTTP], &backends),
        )
        .expect("manifests");
    topology
        .add_manifest(
            "empty.yaml",
            &cluster_ip_manifests("empty", "10.96.0.32", &[HTTP, DNS], &[]),
        )
        .expect("manifests");
    let sticky = cluster_ip_manifests("sticky", "10.96.0.33", &[HTTP], &backends)
        .replacen(
            "spec: {",
            "spec: {sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}, ",
            1,
        );
    let servers = serve(&topology, "sticky.yaml", &sticky, false);
    let (agent, _other) = start_agents(&topology, &[]);
    let client = &topology.node(0).pods[0];
    // Wait until the service serves (the backends start beside the agents).
    let first = tcp_answers(&client.netns, "10.96.0.31", 80, 1).expect("web");
    assert_eq!(first.len(), 1, "{first:?}");

    // No endpoints: the connect and the send fail at once with ECONNREFUSED.
    let script = "import socket, time, errno\n\
         t = time.monotonic()\n\
         try:\n    socket.create_connection(('10.96.0.32', 80), timeout=5); print('connected')\n\
         except OSError as e: print('tcp', errno.errorcode[e.errno], round(time.monotonic() - t, 1))\n\
         u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         try:\n    u.sendto(b'q', ('10.96.0.32', 53)); print('sent')\n\
         except OSError as e: print('udp', errno.errorcode[e.errno])\n";
    let out = exec_in(&client.netns, &["python3", "-c", script]).expect("client");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text, "tcp ECONNREFUSED 0.0\nudp ECONNREFUSED\n", "{out:?}");
    assert_eq!(
        agent.counters().expect("counters").socket("refused"),
        2,
        "{:?}",
        agent.counters()
    );

    // ClientIP affinity: left to the per-packet path (its timer runs from the last packet),
    // so every connection of the client reaches the same backend, translated per packet.
    let sticky_lines = tcp_answers(&client.netns, "10.96.0.33", 80, 12).expect("sticky");
    let sticky_backends: BTreeSet<&str> = sticky_lines
        .iter()
        .map(|l| l.split(' ').next().expect("backend"))
        .collect();
    assert_eq!(sticky_backends.len(), 1, "{sticky_lines:?}");
    let counters = agent.counters().expect("counters");
    assert_eq!(counters.socket("passed"), 12, "{counters:?}");
    assert!(
        counters.packets(Hook::FromPod, PacketClass::ServiceDnat) >= 12,
        "{counters:?}"
    );

    // Which path each takes, as `trace` and `inspect services` say.
    let dataplane =
        |args: &[&str]| dataplane_tests::topology::dataplane_json(topology.node(0), &agent, args);
    let from = client.ip.to_string();
    for (to, path) in [
        ("10.96.0.31:80", "socket: a connect"),
        ("10.96.0.32:80", "socket: refused"),
        ("10.96.0.33:80", "per packet: affinity"),
    ] {
        let trace = dataplane(&["trace", "--from", &from, "--to", to]);
        assert!(
            trace["socket"]
                .as_str()
                .is_some_and(|p| p.starts_with(path)),
            "{to}: {trace:#}"
        );
    }
    let services = dataplane(&["inspect", "services"]);
    let path_of = |address: &str| {
        services
            .as_array()
            .expect("rows")
            .iter()
            .find(|row| row["address"] == address && row["scope"] == "cluster")
            .map(|row| row["from_pods"].clone())
    };
    assert_eq!(
        path_of("10.96.0.31:80"),
        Some("socket".into()),
        "{services:#}"
    );
    assert_eq!(
        path_of("10.96.0.32:53"),
        Some("socket: refused".into()),
        "{services:#}"
    );
    assert_eq!(
        path_of("10.96.0.33:80"),
        Some("per packet: affinity".into()),
        "{services:#}"
    );

    // A backend removed: no new connection reaches it.
    let remaining = backends[1];
    topology
        .add_manifest(
            "web.yaml",
            &cluster_ip_manifests("web", "10.96.0.31", &[HTTP], &[remaining]),
        )
        .expect("manifests");
    let only_remaining = eventually(|| {
        tcp_answers(&client.netns, "10.96.0.31", 80, 16).is_ok_and(|lines| {
            lines
                .iter()
                .all(|l| l.starts_with(&remaining.ip.to_string()))
        })
    });
    assert!(only_remaining, "{}", agent.log());
    let lines = tcp_answers(&client.netns, "10.96.0.31", 80, 16).expect("web");
    assert_eq!(lines.len(), 16);
    for line in &lines {
        assert!(line.starts_with(&remaining.ip.to_string()), "{lines:?}");
    }
    drop(servers);
}

/// The socket-level counter `event` of the agent pinned at `pins` (the agent may be gone).
fn socket_count(pins: &dataplane_user::kernel::pins::Pins, event: &str) -> u64 {
    dataplane_user::kernel::stats::read(pins)
        .expect("counters")
        .socket(event)
}

#[test]
fn the_socket_programs_serve_while_no_agent_runs_survive_a_restart_and_go_with_socket_lb_off() {
    if !privileged(
        "the_socket_programs_serve_while_no_agent_runs_survive_a_restart_and_go_with_socket_lb_off",
    ) {
        return;
    }
    let topology = Topology::build_with(2, 2, Mode::Overlay).expect("build topology");
    let backends = [&topology.node(0).pods[1], &topology.node(1).pods[1]];
    let servers = serve(
        &topology,
        "web.yaml",
        &cluster_ip_manifests("web", "10.96.0.34", &[HTTP], &backends),
        false,
    );
    let _other = topology.node(1).start_agent().expect("agent on node 1");
    let agent = topology
        .node(0)
        .start_agent_with(&["--socket-lb", "on"])
        .expect("agent");
    let client = &topology.node(0).pods[0];
    let answered = |count| tcp_answers(&client.netns, "10.96.0.34", 80, count).expect("web");
    assert_eq!(answered(4).len(), 4);
    let links = |pins: &dataplane_user::kernel::pins::Pins| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(pins.links_dir())
            .expect("links")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with("@cgroup"))
            .collect();
        names.sort();
        names
    };
    assert_eq!(links(&agent.pins).len(), 8, "{:?}", links(&agent.pins));

    // No agent: the pinned links keep translating at the socket.
    let (pins, run_dir) = agent.stop_keeping_pins().expect("stop");
    let before = socket_count(&pins, "connect");
    assert_eq!(answered(4).len(), 4);
    assert_eq!(socket_count(&pins, "connect"), before + 4);

    // A new agent takes over: still at the socket, with its own links in the pins.
    let agent = topology
        .node(0)
        .start_agent_at_with(pins, run_dir, &["--socket-lb", "on"])
        .expect("restarted agent");
    assert_eq!(answered(4).len(), 4);
    assert_eq!(socket_count(&agent.pins, "connect"), before + 8);
    assert_eq!(links(&agent.pins).len(), 8);
    // `dataplane status` lists the socket programs beside the packet programs, with their
    // costs.
    let status = agent.status_json().expect("status");
    let listed: Vec<&str> = status["programs"]
        .as_array()
        .expect("programs")
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    for name in dataplane_common::maps::SOCK_PROGRAMS {
        assert!(listed.contains(name), "{name} not in {listed:?}");
    }

    // Restarted with --socket-lb off: the links go, and the flows are translated per packet.
    let (pins, run_dir) = agent.stop_keeping_pins().expect("stop");
    let agent = topology
        .node(0)
        .start_agent_at_with(pins, run_dir, &["--socket-lb", "off"])
        .expect("agent with socket-lb off");
    assert!(links(&agent.pins).is_empty());
    let dnat_before = agent
        .counters()
        .expect("counters")
        .packets(Hook::FromPod, PacketClass::ServiceDnat);
    assert_eq!(answered(4).len(), 4);
    let counters = agent.counters().expect("counters");
    assert_eq!(counters.socket("connect"), before + 8, "{counters:?}");
    assert!(
        counters.packets(Hook::FromPod, PacketClass::ServiceDnat) >= dnat_before + 4,
        "{counters:?}"
    );
    drop(servers);
}

/// A server in `pod` on TCP 8081 that tells each client "<its address> <the client>" and
/// then keeps the connection open.
fn holding_backend(pod: &Pod) -> Server {
    let script = format!(
        "import socket, threading, time\n\
         t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         t.bind(('0.0.0.0', 8081)); t.listen(64); held = []\n\
         while True:\n    c, a = t.accept(); c.sendall(f'{} {{a[0]}}'.encode()); held.append(c)\n",
        pod.ip
    );
    std::process::Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", pod.netns))
        .args(["python3", "-c", &script])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map(Server::from)
        .expect("holding backend")
}

#[test]
fn a_removed_backend_ends_the_connected_sockets_sent_to_it_and_no_other() {
    if !privileged("a_removed_backend_ends_the_connected_sockets_sent_to_it_and_no_other") {
        return;
    }
    let topology = Topology::build_with(2, 2, Mode::Overlay).expect("build topology");
    let backends = [&topology.node(0).pods[1], &topology.node(1).pods[1]];
    let ports =
        |backends: &[&Pod]| cluster_ip_manifests("hold", "10.96.0.35", &[HOLD, DNS], backends);
    let servers = serve(&topology, "hold.yaml", &ports(&backends), true);
    let (agent, _other) = start_agents(&topology, &[]);
    let doomed = backends[0].ip.to_string();
    // Through the service: a TCP connection and a connected UDP socket that reached the
    // doomed backend; beside them, a TCP connection straight to the doomed pod's address,
    // which is not the service's to end.
    let script = format!(
        "import socket, sys, errno, time\n\
         def tcp(address, port):\n\
         \x20   for _ in range(100):\n\
         \x20       try:\n\
         \x20           c = socket.create_connection((address, port), timeout=5)\n\
         \x20       except OSError: time.sleep(0.1); continue\n\
         \x20       if c.recv(100).decode().split()[0] == '{doomed}': return c\n\
         \x20       c.close()\n\
         def udp():\n\
         \x20   for _ in range(100):\n\
         \x20       u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(5)\n\
         \x20       u.connect(('10.96.0.35', 53)); u.send(b'q')\n\
         \x20       if u.recv(100).decode().split()[0] == '{doomed}': return u\n\
         \x20       u.close()\n\
         t = tcp('10.96.0.35', 81); u = udp(); direct = tcp('{doomed}', 8081)\n\
         print('ready', flush=True); sys.stdin.readline()\n\
         def outcome(s, timeout):\n\
         \x20   s.settimeout(timeout)\n\
         \x20   try:\n\
         \x20       d = s.recv(100); return 'eof' if not d else 'data'\n\
         \x20   except socket.timeout: return 'open'\n\
         \x20   except OSError as e: return errno.errorcode[e.errno]\n\
         print('tcp', outcome(t, 20), 'udp', outcome(u, 20), 'direct', outcome(direct, 1), flush=True)\n"
    );
    let client = &topology.node(0).pods[0];
    let (mut child, mut stdout) = held_client(&client.netns, &script);

    topology
        .add_manifest("hold.yaml", &ports(&[backends[1]]))
        .expect("manifests");
    let line = go_on(&mut child, &mut stdout);
    assert_eq!(
        line,
        "tcp ECONNABORTED udp ECONNABORTED direct open\n",
        "{}",
        agent.log()
    );
    assert!(
        agent
            .log()
            .contains("ended connected sockets sent to backends that left their services"),
        "{}",
        agent.log()
    );
    drop(servers);
}

#[test]
fn a_pod_churning_sockets_through_services_costs_no_other_pod_its_way_back_to_the_service() {
    if !privileged(
        "a_pod_churning_sockets_through_services_costs_no_other_pod_its_way_back_to_the_service",
    ) {
        return;
    }
    let topology = Topology::build_with(2, 3, Mode::Overlay).expect("build topology");
    let backends = [&topology.node(0).pods[1], &topology.node(1).pods[1]];
    let manifests = cluster_ip_manifests("shared", "10.96.0.36", &[HOLD, DNS], &backends);
    let servers = serve(&topology, "shared.yaml", &manifests, true);
    let (agent, _other) = start_agents(&topology, &[]);

    // The victim: a connection through the service, and an unconnected UDP socket whose
    // answer waits in its queue while the other pod churns.
    let victim_script = "import socket, sys, time\n\
         for _ in range(100):\n\
         \x20   try: t = socket.create_connection(('10.96.0.36', 81), timeout=5); break\n\
         \x20   except OSError: time.sleep(0.1)\n\
         t.recv(100)\n\
         u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(5)\n\
         u.sendto(b'q', ('10.96.0.36', 53)); time.sleep(0.5)\n\
         print('ready', flush=True); sys.stdin.readline()\n\
         d, a = u.recvfrom(100)\n\
         print('peer', *t.getpeername(), 'udp', *a, flush=True)\n";
    let victim = &topology.node(0).pods[0];
    let (mut child, mut stdout) = held_client(&victim.netns, victim_script);

    // The churner: more sockets through the service than a shared reverse map of the old
    // design held (65,536), each sending once and closing.
    let sent_before = agent.counters().expect("counters").socket("sendmsg");
    let churn = "import socket\n\
         for _ in range(70000):\n\
         \x20   s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         \x20   s.sendto(b'x', ('10.96.0.36', 53)); s.close()\n\
         print('done')\n";
    let out = exec_in(&topology.node(0).pods[2].netns, &["python3", "-c", churn]).expect("churn");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "done\n", "{out:?}");
    let sent = agent.counters().expect("counters").socket("sendmsg") - sent_before;
    assert_eq!(sent, 70_000);

    let line = go_on(&mut child, &mut stdout);
    assert_eq!(
        line,
        "peer 10.96.0.36 81 udp 10.96.0.36 53\n",
        "{}",
        agent.log()
    );
    drop(servers);
}

#[test]
fn a_pod_reaches_a_node_port_on_either_node_through_the_socket() {
    if !privileged("a_pod_reaches_a_node_port_on_either_node_through_the_socket") {
        return;
    }
    let topology = Topology::build_with(2, 2, Mode::Overlay).expect("build topology");
    let backends = [&topology.node(0).pods[1], &topology.node(1).pods[1]];
    let manifests = cluster_ip_manifests("np", "10.96.0.37", &[HTTP, DNS], &backends)
        .replacen("spec: {clusterIP", "spec: {type: NodePort, clusterIP", 1)
        .replacen("targetPort: 8080}", "targetPort: 8080, nodePort: 30095}", 1)
        .replacen("targetPort: 5353}", "targetPort: 5353, nodePort: 30096}", 1);
    let servers = serve(&topology, "np.yaml", &manifests, false);
    let (agent, _other) = start_agents(&topology, &[]);
    let client = &topology.node(0).pods[0];
    let v4: BTreeSet<String> = backends.iter().map(|p| p.ip.to_string()).collect();
    // This node's address and the other node's: each translated at the socket, to either
    // backend, and getpeername and recvfrom give the node's address back.
    for node in [topology.node(0), topology.node(1)] {
        let address = node.underlay_ip.to_string();
        let script = format!(
            "import socket, time\n\
             for _ in range(50):\n\
             \x20   try: socket.create_connection(('{address}', 30095), timeout=2).close(); break\n\
             \x20   except OSError: time.sleep(0.2)\n\
             for _ in range(8):\n\
             \x20   t = socket.create_connection(('{address}', 30095), timeout=5)\n\
             \x20   print(t.recv(100).decode().split()[0], *t.getpeername()); t.close()\n\
             \x20   u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(5)\n\
             \x20   u.sendto(b'q', ('{address}', 30096)); d, a = u.recvfrom(100)\n\
             \x20   print(d.decode().split()[0], *a); u.close()\n"
        );
        let out = exec_in(&client.netns, &["python3", "-c", &script]).expect("client");
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 16, "{out:?}");
        let mut reached = BTreeSet::new();
        for (i, line) in lines.iter().enumerate() {
            let fields: Vec<&str> = line.split(' ').collect();
            let port = if i % 2 == 0 { "30095" } else { "30096" };
            assert_eq!(fields[1..], [address.as_str(), port], "{text}");
            assert!(v4.contains(fields[0]), "{text}");
            reached.insert(fields[0].to_owned());
        }
        assert_eq!(reached, v4, "{text}");
    }
    let counters = agent.counters().expect("counters");
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::ServiceDnat),
        0,
        "{counters:?}"
    );
    assert!(counters.socket("connect") >= 16, "{counters:?}");
    assert_eq!(counters.socket("sendmsg"), 16, "{counters:?}");
    drop(servers);
}

#[test]
fn host_processes_are_served_at_the_socket_with_socket_lb_host_and_listed_by_inspect() {
    if !privileged(
        "host_processes_are_served_at_the_socket_with_socket_lb_host_and_listed_by_inspect",
    ) {
        return;
    }
    let topology = Topology::build_with(2, 2, Mode::Overlay).expect("build topology");
    let backends = [&topology.node(0).pods[1], &topology.node(1).pods[1]];
    let servers = serve(
        &topology,
        "web.yaml",
        &cluster_ip_manifests("web", "10.96.0.38", &[HTTP, DNS], &backends),
        false,
    );
    let (agent, _other) = start_agents(&topology, &["--socket-lb-host", "on"]);
    let node = topology.node(0);
    // Wait until the service serves from the host (its first connection may meet a map
    // still being written).
    let warm = "import socket, time\n\
         for _ in range(50):\n\
         \x20   try: socket.create_connection(('10.96.0.38', 80), timeout=2).close(); break\n\
         \x20   except OSError: time.sleep(0.2)\n";
    exec_in(&node.netns, &["python3", "-c", warm]).expect("warm");
    let before = agent.counters().expect("counters");
    let script = "import socket\n\
         for _ in range(6):\n\
         \x20   t = socket.create_connection(('10.96.0.38', 80), timeout=5)\n\
         \x20   print(t.recv(100).decode().split()[0], *t.getpeername()); t.close()\n\
         \x20   u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(5)\n\
         \x20   u.sendto(b'q', ('10.96.0.38', 53)); d, a = u.recvfrom(100)\n\
         \x20   print(d.decode().split()[0], *a); u.close()\n";
    let out = exec_in(&node.netns, &["python3", "-c", script]).expect("host client");
    let text = String::from_utf8_lossy(&out.stdout);
    let v4: BTreeSet<String> = backends.iter().map(|p| p.ip.to_string()).collect();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 12, "{out:?}");
    for (i, line) in lines.iter().enumerate() {
        let fields: Vec<&str> = line.split(' ').collect();
        let port = if i % 2 == 0 { "80" } else { "53" };
        assert_eq!(fields[1..], ["10.96.0.38", port], "{text}");
        assert!(v4.contains(fields[0]), "{text}");
    }
    let after = agent.counters().expect("counters");
    assert_eq!(
        after.socket("connect") - before.socket("connect"),
        6,
        "{after:?}"
    );
    assert_eq!(
        after.socket("sendmsg") - before.socket("sendmsg"),
        6,
        "{after:?}"
    );

    // `inspect sockets` lists the host as served.
    let out = dataplane_cli(node, &agent, &["inspect", "sockets"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("pod ") && l.contains(" host ")),
        "{table}"
    );
    drop(servers);
}
