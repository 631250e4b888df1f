//! Hitless restart: a long-lived TCP connection through a ClusterIP Service, from a pod on one
//! node to a backend on the other (DNAT and reverse NAT on the client's node, Geneve both
//! ways), keeps flowing while both agents are stopped and restarted. The programs stay attached
//! through their pinned links while no agent runs; the new agents adopt the pinned maps
//! (conntrack included) and swap their programs into the links. The client checks every echo,
//! and the client's kernel must not have retransmitted a single segment.

use std::{
    io::{BufRead as _, BufReader},
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use dataplane_common::{Hook, PacketClass};
use dataplane_tests::{
    privileged::privileged,
    service_bed::{ServicePort, cluster_ip_manifests},
    topology::{Mode, PinsCleanup, Topology, exec_in},
};

const SERVICE_IP: &str = "10.96.0.40";
/// How long the client streams, and the interval between its lines.
const STREAM_SECONDS: f64 = 8.0;
const INTERVAL: f64 = 0.01;

/// A line echo server on 7000: every line sent on a connection comes back on it.
const ECHO_SERVER: &str = "import socket, threading\n\
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
s.bind(('0.0.0.0', 7000)); s.listen(8)\n\
def serve(c):\n    f = c.makefile('rb')\n    for line in f: c.sendall(line)\n\
while True:\n    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()\n";

/// Streams numbered lines over one connection and checks each echo; prints `ready` once
/// connected, then `sent <n> echoed <n>` at the end, or fails on any mismatch or error.
fn client_script() -> String {
    format!(
        "import socket, time, sys\n\
         for attempt in range(50):\n\
         \x20   try:\n\
         \x20       c = socket.create_connection(('{SERVICE_IP}', 80), timeout=5); break\n\
         \x20   except OSError: time.sleep(0.1)\n\
         c.settimeout(3); f = c.makefile('rb')\n\
         print('ready', flush=True)\n\
         n = 0; end = time.time() + {STREAM_SECONDS}\n\
         while time.time() < end:\n\
         \x20   c.sendall(b'line %d\\n' % n)\n\
         \x20   got = f.readline()\n\
         \x20   assert got == b'line %d\\n' % n, (n, got)\n\
         \x20   n += 1; time.sleep({INTERVAL})\n\
         print('sent', n, 'echoed', n, flush=True)\n"
    )
}

/// The client namespace's count of retransmitted TCP segments.
fn retransmitted(netns: &str) -> u64 {
    let out = exec_in(netns, &["nstat", "-az", "TcpRetransSegs"]).expect("nstat");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| {
            let mut fields = l.split_whitespace();
            (fields.next() == Some("TcpRetransSegs")).then(|| fields.next()?.parse().ok())?
        })
        .unwrap_or_else(|| panic!("no TcpRetransSegs in {text}"))
}

#[test]
fn a_service_connection_survives_restarting_both_agents() {
    if !privileged("a_service_connection_survives_restarting_both_agents") {
        return;
    }
    let topology = Topology::build_with(2, 1, Mode::Overlay).expect("build topology");
    let (client, backend) = (&topology.node(0).pods[0], &topology.node(1).pods[0]);
    let ports = [ServicePort {
        name: "stream",
        port: 80,
        protocol: "TCP",
        target: 7000,
    }];
    topology
        .add_manifest(
            "stream.yaml",
            &cluster_ip_manifests("stream", SERVICE_IP, &ports, &[backend]),
        )
        .expect("service manifests");
    let mut server = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", backend.netns))
        .args(["python3", "-c", ECHO_SERVER])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("echo server");
    let agent0 = topology.node(0).start_agent().expect("agent on node 0");
    let agent1 = topology.node(1).start_agent().expect("agent on node 1");

    let retrans_before = retransmitted(&client.netns);
    let mut stream = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", client.netns))
        .args(["python3", "-c", &client_script()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("client");
    let mut lines = BufReader::new(stream.stdout.take().expect("stdout")).lines();
    assert_eq!(
        lines.next().and_then(Result::ok).as_deref(),
        Some("ready"),
        "client did not connect"
    );
    thread::sleep(Duration::from_secs(1));

    // Both agents stop; the stream goes on through the pinned programs, which keep counting.
    let (pins0, run0) = agent0.stop_keeping_pins().expect("stop agent 0");
    let (pins1, run1) = agent1.stop_keeping_pins().expect("stop agent 1");
    let _cleanup = PinsCleanup(vec![pins0.clone(), pins1.clone()]);
    let stopped = dataplane_user::kernel::stats::read(&pins0).expect("counters");
    thread::sleep(Duration::from_millis(1500));
    let unattended = dataplane_user::kernel::stats::read(&pins0).expect("counters");
    let forwarded = unattended.packets(Hook::FromPod, PacketClass::Tcp)
        - stopped.packets(Hook::FromPod, PacketClass::Tcp);
    assert!(
        forwarded >= 50,
        "only {forwarded} client packets went through while no agent ran"
    );

    // New agents adopt the pins and swap their programs in, with the stream still running.
    let agent0 = topology
        .node(0)
        .start_agent_at(pins0, run0)
        .expect("restart agent 0");
    let agent1 = topology
        .node(1)
        .start_agent_at(pins1, run1)
        .expect("restart agent 1");
    for agent in [&agent0, &agent1] {
        assert!(
            agent.log().contains("took over the pinned link"),
            "{}",
            agent.log()
        );
    }

    let status = stream.wait().expect("client exit");
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut stream.stderr.take().expect("stderr"), &mut stderr)
        .expect("client stderr");
    assert!(status.success(), "client failed: {stderr}");
    let summary = lines.next().and_then(Result::ok).expect("client summary");
    let fields: Vec<&str> = summary.split_whitespace().collect();
    assert_eq!(fields.len(), 4, "{summary}");
    assert_eq!(fields[1], fields[3], "every line echoed: {summary}");
    let sent: u64 = fields[1].parse().expect("count");
    assert!(sent >= 300, "the stream ran: {summary}");
    assert_eq!(
        retransmitted(&client.netns) - retrans_before,
        0,
        "no segment lost across the restarts"
    );
    // The flow kept its conntrack entry and the new programs translated it.
    let after = agent0.counters().expect("counters");
    assert!(
        after.packets(Hook::FromPod, PacketClass::ServiceDnat)
            > unattended.packets(Hook::FromPod, PacketClass::ServiceDnat),
        "the restarted agent's programs carry the flow"
    );
    let _ = server.kill();
    let _ = server.wait();
}
