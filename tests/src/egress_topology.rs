//! A cluster for egress IP tests and benchmarks: overlay nodes and a host outside the cluster
//! on their underlay, where the egress IP controller runs (`dataplane controller
//! --manifests`), with the processes that drive and observe it (UDP streams, ARP probes).

use std::{
    ffi::OsStr,
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use crate::topology::{Agent, ExternalHost, Mode, Pod, Topology, dataplane_binary, exec_in};

pub const EGRESS_IP: &str = "10.99.0.50";
/// Where the agents answer the controller's probes (their default), apart from their metrics.
pub const PROBE_PORT: u16 = dataplane_user::egressip::probe::DEFAULT_PROBE_PORT;

/// A process killed on drop, its log kept for the assertion messages.
pub struct Process {
    pub child: Child,
    log: PathBuf,
}

impl Process {
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn out(&self) -> String {
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

/// Node metadata that lets a node hold egress IPs of its IPv4 underlay subnet.
pub const ASSIGNABLE: &str = "labels: {k8s.ovn.org/egress-assignable: ''}, \
     annotations: {k8s.ovn.org/node-primary-ifaddr: '{\"ipv4\":\"{ip}/24\"}'}";

/// As [`ASSIGNABLE`], for both underlay subnets.
pub const ASSIGNABLE_DUAL_STACK: &str = "labels: {k8s.ovn.org/egress-assignable: ''}, \
     annotations: {k8s.ovn.org/node-primary-ifaddr: '{\"ipv4\":\"{ip}/24\",\"ipv6\":\"{ip6}/64\"}'}";

/// An EgressIP `name` giving the addresses `ips` (a YAML flow list) to namespace `namespace`.
pub fn egress_ip_yaml(name: &str, ips: &str, namespace: &str) -> String {
    format!(
        "apiVersion: k8s.ovn.org/v1\nkind: EgressIP\nmetadata: {{name: {name}}}\n\
         spec: {{egressIPs: {ips}, namespaceSelector: {{matchLabels: {{kubernetes.io/metadata.name: {namespace}}}}}}}\n"
    )
}

/// Three overlay nodes with a pod each, the pods of `prod_nodes` in namespace `prod`, every
/// node's object carrying `node_metadata`, and a host outside on the underlay with routes to
/// the pod networks. Returns them and the manifest directory.
pub fn egress_cluster(
    prod_nodes: &[usize],
    node_metadata: &str,
) -> anyhow::Result<(Topology, ExternalHost, PathBuf)> {
    let mut topology = Topology::build_with(3, 1, Mode::Overlay)?;
    for node in prod_nodes {
        topology.set_pod_namespace(*node, 0, "prod")?;
    }
    topology.set_node_metadata(node_metadata)?;
    let external = topology.add_external_host()?;
    topology.route_pod_networks(&external)?;
    let manifests = topology
        .manifest_dir()
        .context("an overlay topology has manifests")?
        .to_owned();
    Ok((topology, external, manifests))
}

/// An agent on every node, answering the controller's probes on `metrics` (and given `extra`).
pub fn start_agents(
    topology: &Topology,
    metrics: &str,
    extra: &[&str],
) -> anyhow::Result<Vec<Agent>> {
    let mut args = vec!["--metrics-address", metrics];
    args.extend_from_slice(extra);
    topology
        .nodes
        .iter()
        .map(|node| node.start_agent_with(&args))
        .collect()
}

/// `dataplane controller` with `args` on the outside host, its log kept.
fn spawn_controller(external: &ExternalHost, args: &[&OsStr]) -> Process {
    spawn_controller_in(&external.netns, args)
}

/// `dataplane controller` with `args` in network namespace `netns`, its log kept; killed on
/// drop (a failed assertion leaves no controller behind).
pub fn spawn_controller_in(netns: &str, args: &[&OsStr]) -> Process {
    let log = std::env::temp_dir().join(crate::unique_name("controller.log"));
    let child = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{netns}"))
        .arg(dataplane_binary())
        .arg("controller")
        .args(args)
        .args(["--probe-port", &PROBE_PORT.to_string()])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log).expect("controller log"))
        .spawn()
        .expect("spawning the controller");
    Process { child, log }
}

pub fn start_controller(external: &ExternalHost, manifests: &Path) -> Process {
    spawn_controller(
        external,
        &[
            OsStr::new("--manifests"),
            manifests.as_os_str(),
            OsStr::new("--metrics-address"),
            OsStr::new("127.0.0.1:9477"),
        ],
    )
}

/// The node the status file gives the egress IP, waiting up to `wait` for `want` (any node
/// when `None`) to be it.
pub fn holder(manifests: &Path, want: Option<&str>, wait: Duration) -> Option<String> {
    holder_of(manifests, "prod", EGRESS_IP, want, wait)
}

/// As [`holder`], for address `ip` of EgressIP `object`.
pub fn holder_of(
    manifests: &Path,
    object: &str,
    ip: &str,
    want: Option<&str>,
    wait: Duration,
) -> Option<String> {
    let deadline = Instant::now() + wait;
    loop {
        let status = fs::read_to_string(manifests.join("egressip-status/status.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
        let node = status.as_ref().and_then(|s| {
            s[object]["items"]
                .as_array()?
                .iter()
                .find(|i| i["egressIP"] == ip)
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
pub fn arp_answers(external: &ExternalHost) -> Vec<String> {
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

pub fn underlay_mac(netns: &str) -> String {
    // `ip`, not /sys: sysfs shows the namespace it was mounted in, not this one.
    let out = exec_in(netns, &["ip", "-br", "link", "show", "eth0"]).expect("mac");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.split_whitespace()
        .nth(2)
        .unwrap_or_default()
        .to_owned()
}

/// Asks for the egress IP's MAC every 50 ms from the outside host, keeping every answer set.
pub struct ArpProber(Process);

impl ArpProber {
    pub fn start(external: &ExternalHost) -> Self {
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
    pub fn finish(mut self) -> Vec<Vec<String>> {
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
pub struct UdpReceiver(Process);

impl UdpReceiver {
    pub fn start(external: &ExternalHost) -> Self {
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
    pub fn finish(mut self) -> Vec<(f64, String)> {
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
pub struct UdpSender(Process);

impl UdpSender {
    pub fn start(pod: &Pod, count: u32) -> Self {
        let script = format!(
            "import socket, time\n\
             s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
             for i in range({count}):\n\
             \x20   s.sendto(str(i).encode(), ('10.99.0.100', 9999))\n\
             \x20   time.sleep(0.02)\n"
        );
        UdpSender(spawn_in(&pod.netns, &["python3", "-c", &script], "send"))
    }

    pub fn finish(mut self) {
        let _ = self.0.child.wait();
    }
}

/// Spawns `args` in `netns`, stdout to a file read by [`Process::out`].
pub fn spawn_in(netns: &str, args: &[&str], what: &str) -> Process {
    let log = std::env::temp_dir().join(crate::unique_name(what));
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

/// The stand-in API server (`fake_apiserver`) on the outside host's address, serving the
/// manifests to every node, and a kubeconfig for it; the process goes on drop.
pub struct SharedApiServer {
    _process: Process,
    pub kubeconfig: PathBuf,
    /// The probe key the controller replicas and the agents share (as the Secret would be
    /// mounted into both).
    pub probe_key: PathBuf,
}

pub fn start_shared_apiserver(external: &ExternalHost, manifests: &Path) -> SharedApiServer {
    let binary = dataplane_binary().with_file_name("fake_apiserver");
    let log = std::env::temp_dir().join(crate::unique_name("apiserver.log"));
    let listen = format!("{}:6443", external.ip);
    let child = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", external.netns))
        .arg(&binary)
        .arg("--manifests")
        .arg(manifests)
        .args(["--listen", &listen])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log).expect("apiserver log"))
        .spawn()
        .expect("starting the API server");
    // Beside the manifests (not a .yaml file, so not served) and removed with them.
    let kubeconfig = manifests.join("shared.kubeconfig");
    fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\n\
             clusters: [{{name: fake, cluster: {{server: 'http://{listen}'}}}}]\n\
             users: [{{name: agent, user: {{}}}}]\n\
             contexts: [{{name: fake, context: {{cluster: fake, user: agent}}}}]\n\
             current-context: fake\n"
        ),
    )
    .expect("kubeconfig");
    let probe_key = manifests.join("shared-probe.key");
    fs::write(&probe_key, "a test key, 32 bytes long at least").expect("probe key");
    thread::sleep(Duration::from_millis(300));
    SharedApiServer {
        _process: Process { child, log },
        kubeconfig,
        probe_key,
    }
}

/// A controller replica against the API server, named `identity`, its Lease lasting 3 s.
pub fn start_api_controller(
    external: &ExternalHost,
    api: &SharedApiServer,
    identity: &str,
) -> Process {
    let key = api.probe_key.to_string_lossy().into_owned();
    let args = [
        "--probe-key-file",
        &key,
        "--kubernetes",
        "--identity",
        identity,
        "--lease-namespace",
        "dataplane",
        "--lease-duration-seconds",
        "3",
        "--kubeconfig",
    ]
    .map(OsStr::new);
    let mut args = args.to_vec();
    args.push(api.kubeconfig.as_os_str());
    spawn_controller(external, &args)
}

/// The EgressIP `name`'s `status.items` as the API server has them: (address, node).
pub fn api_status(external: &ExternalHost, name: &str) -> Vec<(String, String)> {
    let url = format!("http://{}:6443/apis/k8s.ovn.org/v1/egressips", external.ip);
    let out = exec_in(&external.netns, &["curl", "-s", &url]).expect("curl");
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|o| o["metadata"]["name"] == name)
        .flat_map(|o| o["status"]["items"].as_array().cloned().unwrap_or_default())
        .map(|i| {
            (
                i["egressIP"].as_str().unwrap_or_default().to_owned(),
                i["node"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}
