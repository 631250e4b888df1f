//! Egress IPs end to end on three overlay nodes and a host outside the cluster on their
//! underlay: the controller (`dataplane controller --manifests`, run on that host) assigns the
//! address, the agents reroute and translate, the outside host sees the egress IP and is
//! answered; the address moves without two nodes answering for it, and fails over when its
//! node loses its link.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use dataplane_tests::{
    capture::Capture,
    privileged::privileged,
    service_bed::{echo_server, tcp_answers},
    topology::{ExternalHost, Mode, Topology, dataplane_binary, exec_in, node_name, sh_in},
};

const EGRESS_IP: &str = "10.99.0.50";
const PROBE_PORT: u16 = 9476;

/// A process killed on drop, its log kept for the assertion messages.
struct Process {
    child: Child,
    log: PathBuf,
}

impl Process {
    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn out(&self) -> String {
        self.log()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_file(&self.log);
    }
}

fn start_controller(external: &ExternalHost, manifests: &Path) -> Process {
    let log = std::env::temp_dir().join(dataplane_tests::unique_name("controller.log"));
    let child = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", external.netns))
        .arg(dataplane_binary())
        .arg("controller")
        .arg("--manifests")
        .arg(manifests)
        .args(["--probe-port", &PROBE_PORT.to_string()])
        .args(["--metrics-address", "127.0.0.1:9477"])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log).expect("controller log"))
        .spawn()
        .expect("spawning the controller");
    Process { child, log }
}

/// The node the status file gives the egress IP, waiting up to `wait` for `want` (any node
/// when `None`) to be it.
fn holder(manifests: &Path, want: Option<&str>, wait: Duration) -> Option<String> {
    let deadline = Instant::now() + wait;
    loop {
        let status = fs::read_to_string(manifests.join("egressip-status/status.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
        let node = status.as_ref().and_then(|s| {
            s["prod"]["items"]
                .as_array()?
                .iter()
                .find(|i| i["egressIP"] == EGRESS_IP)
                .and_then(|i| i["node"].as_str())
                .map(str::to_owned)
        });
        if node.is_some() && (want.is_none() || node.as_deref() == want) {
            return node;
        }
        if Instant::now() >= deadline {
            return node;
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// The MACs that answer an ARP request for the egress IP from the outside host.
fn arp_answers(external: &ExternalHost) -> Vec<String> {
    let script = format!(
        "from scapy.all import *\n\
         conf.verb = 0\n\
         answered, _ = srp(Ether(dst='ff:ff:ff:ff:ff:ff')/ARP(pdst='{EGRESS_IP}'), iface='eth0', timeout=0.5, multi=True)\n\
         print(' '.join(sorted(set(r.hwsrc for _, r in answered))))\n"
    );
    let out = exec_in(&external.netns, &["python3", "-c", &script]).expect("scapy arp");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

fn underlay_mac(netns: &str) -> String {
    // `ip`, not /sys: sysfs shows the namespace it was mounted in, not this one.
    let out = exec_in(netns, &["ip", "-br", "link", "show", "eth0"]).expect("mac");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.split_whitespace()
        .nth(2)
        .unwrap_or_default()
        .to_owned()
}

/// Asks for the egress IP's MAC every 50 ms from the outside host, keeping every answer set.
struct ArpProber(Process);

impl ArpProber {
    fn start(external: &ExternalHost) -> Self {
        let script = format!(
            "from scapy.all import *\n\
             import sys, time\n\
             conf.verb = 0\n\
             while True:\n\
             \x20   answered, _ = srp(Ether(dst='ff:ff:ff:ff:ff:ff')/ARP(pdst='{EGRESS_IP}'), iface='eth0', timeout=0.05, multi=True)\n\
             \x20   print(' '.join(sorted(set(r.hwsrc for _, r in answered))), flush=True)\n"
        );
        let prober = ArpProber(spawn_in(
            &external.netns,
            &["python3", "-c", &script],
            "arp",
        ));
        // Started once it heard its first answer (scapy takes a while to import).
        let deadline = Instant::now() + Duration::from_secs(10);
        while prober.0.out().trim().is_empty() && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(50));
        }
        prober
    }

    /// The answer sets, in order, without the empty ones.
    fn finish(mut self) -> Vec<Vec<String>> {
        let _ = self.0.child.kill();
        let _ = self.0.child.wait();
        self.0
            .out()
            .lines()
            .map(|l| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
            .filter(|macs| !macs.is_empty())
            .collect()
    }
}

/// Receives UDP on the outside host's port 9999, printing arrival time and source.
struct UdpReceiver(Process);

impl UdpReceiver {
    fn start(external: &ExternalHost) -> Self {
        let script = "import socket, time\n\
                      s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
                      s.bind(('0.0.0.0', 9999))\n\
                      while True:\n\
                      \x20   data, peer = s.recvfrom(100)\n\
                      \x20   print(time.time(), peer[0], flush=True)\n";
        let receiver = UdpReceiver(spawn_in(&external.netns, &["python3", "-c", script], "udp"));
        thread::sleep(Duration::from_millis(300));
        receiver
    }

    /// (arrival time in Unix seconds, source address) per datagram.
    fn finish(mut self) -> Vec<(f64, String)> {
        let _ = self.0.child.kill();
        let _ = self.0.child.wait();
        self.0
            .out()
            .lines()
            .filter_map(|l| {
                let (at, source) = l.split_once(' ')?;
                Some((at.parse().ok()?, source.to_owned()))
            })
            .collect()
    }
}

/// Sends a datagram every 20 ms from a pod to the outside host, `count` in all.
struct UdpSender(Process);

impl UdpSender {
    fn start(pod: &dataplane_tests::topology::Pod, count: u32) -> Self {
        let script = format!(
            "import socket, time\n\
             s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
             for i in range({count}):\n\
             \x20   s.sendto(str(i).encode(), ('10.99.0.100', 9999))\n\
             \x20   time.sleep(0.02)\n"
        );
        UdpSender(spawn_in(&pod.netns, &["python3", "-c", &script], "send"))
    }

    fn finish(mut self) {
        let _ = self.0.child.wait();
    }
}

/// Spawns `args` in `netns`, stdout to a file read by [`Process::out`].
fn spawn_in(netns: &str, args: &[&str], what: &str) -> Process {
    let log = std::env::temp_dir().join(dataplane_tests::unique_name(what));
    let child = Command::new("ip")
        .args(["netns", "exec", netns])
        .args(args)
        .stdin(Stdio::null())
        .stdout(fs::File::create(&log).expect("output file"))
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    Process { child, log }
}

#[test]
fn selected_pods_leave_from_the_egress_ip_and_it_fails_over() {
    if !privileged("selected_pods_leave_from_the_egress_ip_and_it_fails_over") {
        return;
    }
    let mut topology = Topology::build_with(3, 1, Mode::Overlay).expect("topology");
    topology.set_pod_namespace(0, 0, "prod").expect("namespace");
    topology.set_pod_namespace(1, 0, "prod").expect("namespace");
    topology
        .set_node_metadata(
            "labels: {k8s.ovn.org/egress-assignable: ''}, \
             annotations: {k8s.ovn.org/node-primary-ifaddr: '{\"ipv4\":\"{ip}/24\"}'}",
        )
        .expect("node metadata");
    let external = topology.add_external_host().expect("external host");
    topology.route_pod_networks(&external).expect("routes");
    let manifests = topology.manifest_dir().expect("manifests").to_owned();
    topology
        .add_manifest(
            "egressip.yaml",
            &format!(
                "apiVersion: k8s.ovn.org/v1\nkind: EgressIP\nmetadata: {{name: prod}}\n\
                 spec: {{egressIPs: [{EGRESS_IP}], namespaceSelector: {{matchLabels: {{kubernetes.io/metadata.name: prod}}}}}}\n"
            ),
        )
        .expect("egress ip manifest");
    let metrics = format!("0.0.0.0:{PROBE_PORT}");
    let agents: Vec<_> = (0..3)
        .map(|n| {
            topology
                .node(n)
                .start_agent_with(&["--metrics-address", &metrics])
                .expect("agent")
        })
        .collect();
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
        vec![format!("ext {}", other.ip); 2],
        "a pod of another namespace is not translated"
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
