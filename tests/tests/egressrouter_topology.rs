//! The `egress-router` CNI plugin as a runtime runs it, in network namespaces: a node whose
//! NIC is on a LAN with a gateway to a far network, a client pod and a router pod wired to the
//! node as the dataplane's plugin wires pods (a /32 and a default route through 169.254.1.1).
//! The plugin gives the router pod its macvlan on the node's NIC with the reserved address;
//! the client's connections to the router pod reach the far host from the reserved address,
//! per-port rules and the fallback, a port without either refused; the LAN learns the
//! macvlan's MAC from the gratuitous ARP, again when the router pod is made anew; the same
//! over IPv6; and a router pod of the overlay beside the agent's programs on the node's NIC.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::OnceLock,
};

use dataplane_tests::{
    privileged::privileged,
    service_bed::{echo_server, tcp_answers},
    topology::{dataplane_binary, exec_in, run_in, sh_in},
    unique_name,
};
use dataplane_user::egressrouter::reservations::{self, Reservations};
use serde_json::Value;

const RESERVED: &str = "198.51.100.99";
const RESERVED6: &str = "fd00:198::99";

/// Network namespaces deleted on drop.
struct Namespaces(Vec<String>);

impl Namespaces {
    fn add(&mut self, kind: &str) -> String {
        let name = unique_name(kind);
        run_in_host(&["ip", "netns", "add", &name]);
        self.0.push(name.clone());
        name
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for name in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }
}

fn run_in_host(args: &[&str]) {
    let status = Command::new(args[0])
        .args(&args[1..])
        .status()
        .expect("run");
    assert!(status.success(), "{args:?}");
}

/// A pod namespace wired to `node` as the dataplane's plugin wires pods, with `address6` too
/// when given (through fe80::1).
fn wire_pod6(node: &str, pod: &str, host_veth: &str, address: &str, address6: &str) {
    wire_pod(node, pod, host_veth, address);
    for line in [
        format!("ip addr add fe80::1/64 dev {host_veth} nodad"),
        format!("ip -6 route add {address6}/128 dev {host_veth}"),
    ] {
        sh_in(node, &line).expect("node side");
    }
    for line in [
        format!("ip addr add {address6}/128 dev eth0 nodad"),
        "ip -6 route add default via fe80::1 dev eth0".to_owned(),
    ] {
        sh_in(pod, &line).expect("pod side");
    }
}

/// A pod namespace wired to `node` as the dataplane's plugin wires pods.
fn wire_pod(node: &str, pod: &str, host_veth: &str, address: &str) {
    run_in_host(&[
        "ip", "link", "add", host_veth, "netns", node, "type", "veth", "peer", "name", "eth0",
        "netns", pod,
    ]);
    for line in [
        format!("ip addr add 169.254.1.1/32 dev {host_veth}"),
        format!("ip link set {host_veth} up"),
        format!("ip route add {address}/32 dev {host_veth}"),
    ] {
        sh_in(node, &line).expect("node side");
    }
    for line in [
        format!("ip addr add {address}/32 dev eth0"),
        "ip link set eth0 up".to_owned(),
        "ip link set lo up".to_owned(),
        "ip route add 169.254.1.1/32 dev eth0 scope link".to_owned(),
        "ip route add default via 169.254.1.1 dev eth0".to_owned(),
    ] {
        sh_in(pod, &line).expect("pod side");
    }
}

/// A reservations file (as the agent writes them) giving every namespace the standalone
/// tests' reserved addresses.
fn test_reservations() -> &'static Path {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let dir = std::env::temp_dir().join(unique_name("erreserved"));
        std::fs::create_dir_all(&dir).expect("reservations dir");
        let reservations = Reservations {
            reservations: [RESERVED, RESERVED6]
                .iter()
                .map(|address| address.parse().expect("reservation"))
                .collect(),
        };
        reservations.write(&dir).expect("reservations")
    })
}

/// Runs the plugin in `node`'s namespace as a runtime does; its exit success and output.
fn plugin(node: &str, command: &str, container: &str, netns: &str, conf: &str) -> (bool, Value) {
    plugin_as(
        node,
        command,
        container,
        netns,
        conf,
        test_reservations(),
        None,
    )
}

/// As [`plugin`], reading the reservations at `reservations`, for the Kubernetes pod `pod`
/// (namespace, name) when given (`CNI_ARGS` as the kubelet's runtime sets them).
fn plugin_as(
    node: &str,
    command: &str,
    container: &str,
    netns: &str,
    conf: &str,
    reservations: &Path,
    pod: Option<(&str, &str)>,
) -> (bool, Value) {
    let binary = dataplane_binary().with_file_name("egress-router");
    let args = pod.map_or(String::new(), |(namespace, name)| {
        format!("K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name}")
    });
    let mut child = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{node}"))
        .arg(&binary)
        .env(reservations::PATH_ENV, reservations)
        .env("CNI_ARGS", args)
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", container)
        .env("CNI_NETNS", format!("/run/netns/{netns}"))
        .env("CNI_IFNAME", "net1")
        .env("CNI_PATH", "/opt/cni/bin")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the plugin");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(conf.as_bytes())
        .expect("configuration");
    let out = child.wait_with_output().expect("plugin output");
    let text = String::from_utf8_lossy(&out.stdout);
    let value = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    };
    (out.status.success(), value)
}

fn router_conf(destinations: &str) -> String {
    format!(
        r#"{{"cniVersion": "1.0.0", "name": "egress-router", "type": "egress-router",
            "ip": {{"addresses": ["{RESERVED}/24"], "destinations": [{destinations}], "gateway": "198.51.100.1"}}}}"#
    )
}

/// One connection from `netns`: the answer's text, `refused` or `timeout`.
fn connect_once(netns: &str, address: &str, port: u16) -> String {
    let script = format!(
        "import socket\n\
         try:\n\
         \x20   c = socket.create_connection(('{address}', {port}), timeout=3); print(c.recv(100).decode())\n\
         except ConnectionRefusedError:\n\
         \x20   print('refused')\n\
         except socket.timeout:\n\
         \x20   print('timeout')\n"
    );
    let out = exec_in(netns, &["python3", "-c", &script]).expect("client");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn udp_once(netns: &str, address: &str, port: u16) -> String {
    let script = format!(
        "import socket\n\
         s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)\n\
         s.sendto(b'x', ('{address}', {port}))\n\
         try:\n\
         \x20   print(s.recv(100).decode())\n\
         except socket.timeout:\n\
         \x20   print('timeout')\n"
    );
    let out = exec_in(netns, &["python3", "-c", &script]).expect("client");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The MAC the LAN's gateway has for `address` (`-` when none).
fn lan_neighbour(lan: &str, address: &str) -> String {
    let out = exec_in(lan, &["ip", "-j", "neigh", "show", address]).expect("neigh");
    let entries: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    entries[0]["lladdr"].as_str().unwrap_or("-").to_owned()
}

/// The namespaces of a node on a LAN: `lan` is the gateway (198.51.100.1) to the far network
/// (203.0.113.0/24, where `far` holds .25 and .26); `client` (10.244.0.10) and `router`
/// (10.244.0.20) are pods wired to `node`.
struct LanBed {
    node: String,
    lan: String,
    far: String,
    client: String,
    router: String,
}

fn lan_bed(namespaces: &mut Namespaces) -> LanBed {
    let (node, lan, far) = (
        namespaces.add("ernode"),
        namespaces.add("erlan"),
        namespaces.add("erfar"),
    );
    let (client, router) = (namespaces.add("erclient"), namespaces.add("errouter"));
    // The node's NIC on the LAN; the LAN's gateway routes to the far network. The gateway
    // learns addresses from gratuitous ARP (as switches and routers do).
    run_in_host(&[
        "ip", "link", "add", "uplink", "netns", &node, "type", "veth", "peer", "name", "lan0",
        "netns", &lan,
    ]);
    run_in_host(&[
        "ip", "link", "add", "lan1", "netns", &lan, "type", "veth", "peer", "name", "eth0",
        "netns", &far,
    ]);
    for (netns, line) in [
        (&node, "ip link set lo up"),
        (&node, "ip addr add 198.51.100.2/24 dev uplink"),
        (&node, "ip link set uplink up"),
        (&node, "ip route add default via 198.51.100.1"),
        (&node, "sysctl -qw net.ipv4.ip_forward=1"),
        (&lan, "ip addr add 198.51.100.1/24 dev lan0"),
        (&lan, "ip addr add 203.0.113.1/24 dev lan1"),
        (&lan, "ip link set lan0 up"),
        (&lan, "ip link set lan1 up"),
        (&lan, "sysctl -qw net.ipv4.ip_forward=1"),
        (&lan, "sysctl -qw net.ipv4.conf.all.arp_accept=1"),
        (&lan, "sysctl -qw net.ipv4.conf.lan0.arp_accept=1"),
        (&far, "ip addr add 203.0.113.25/24 dev eth0"),
        (&far, "ip addr add 203.0.113.26/24 dev eth0"),
        (&far, "ip link set eth0 up"),
        (&far, "ip route add default via 203.0.113.1"),
    ] {
        sh_in(netns, line).unwrap_or_else(|e| panic!("{line}: {e:#}"));
    }
    wire_pod(&node, &client, "vclient", "10.244.0.10");
    wire_pod(&node, &router, "vrouter", "10.244.0.20");
    LanBed {
        node,
        lan,
        far,
        client,
        router,
    }
}

#[test]
fn an_egress_router_pod_sends_its_clients_on_from_the_reserved_address() {
    if !privileged("an_egress_router_pod_sends_its_clients_on_from_the_reserved_address") {
        return;
    }
    let mut namespaces = Namespaces(Vec::new());
    let LanBed {
        node,
        lan,
        far,
        client,
        router,
    } = lan_bed(&mut namespaces);
    let _far_server = echo_server(&far, "far", false).expect("far server");

    // Bad configurations are refused with the field named, and make nothing.
    let (ok, error) = plugin(
        &node,
        "ADD",
        "router-0",
        &router,
        &router_conf(r#""80 icmp 203.0.113.25""#),
    );
    assert!(!ok);
    assert_eq!(error["code"], 7, "{error}");
    assert_eq!(
        error["msg"],
        "ip.destinations[0]: \"icmp\" is not tcp, udp or sctp"
    );

    // A master the node does not have: refused, nothing left on the node.
    let missing = router_conf(r#""203.0.113.26""#).replace(
        r#""type": "egress-router","#,
        r#""type": "egress-router", "interfaceArgs": {"master": "nosuch0"},"#,
    );
    let (ok, error) = plugin(&node, "ADD", "router-0", &router, &missing);
    assert!(!ok);
    assert_eq!(error["code"], 101, "{error}");
    assert!(
        error["msg"].as_str().is_some_and(|m| m.contains("nosuch0")),
        "{error}"
    );
    let links = exec_in(&node, &["ip", "-o", "link", "show"]).expect("links");
    assert!(
        !String::from_utf8_lossy(&links.stdout).contains(": er"),
        "{}",
        String::from_utf8_lossy(&links.stdout)
    );

    // An address nothing reserves for the pod's namespace is not claimed; without the
    // agent's reservations the runtime is asked to try again later.
    let fallback_only = router_conf(r#""203.0.113.26""#);
    let empty = std::env::temp_dir().join(unique_name("erempty"));
    std::fs::create_dir_all(&empty).expect("dir");
    let empty_file = Reservations::default().write(&empty).expect("reservations");
    let (ok, error) = plugin_as(
        &node,
        "ADD",
        "router-0",
        &router,
        &fallback_only,
        &empty_file,
        Some(("tenant", "router")),
    );
    assert!(!ok);
    assert_eq!(error["code"], 104, "{error}");
    assert_eq!(
        error["msg"],
        format!(
            "ip.addresses[0]: {RESERVED} is not reserved for namespace tenant (an EgressRouter of the namespace reserves its address; the agent's --egress-router-reservation others)"
        )
    );
    let (ok, error) = plugin_as(
        &node,
        "ADD",
        "router-0",
        &router,
        &fallback_only,
        &empty.join("absent.json"),
        Some(("tenant", "router")),
    );
    assert!(!ok);
    assert_eq!(error["code"], 11, "{error}");
    let _ = std::fs::remove_dir_all(&empty);

    let conf =
        router_conf(r#""80 tcp 203.0.113.25 8080", "5353 udp 203.0.113.25", "203.0.113.26""#);
    let (ok, result) = plugin(&node, "ADD", "router-1", &router, &conf);
    assert!(ok, "{result}");
    let mac = result["interfaces"][0]["mac"]
        .as_str()
        .expect("mac")
        .to_owned();
    assert_eq!(result["interfaces"][0]["name"], "net1");
    assert_eq!(result["ips"][0]["address"], format!("{RESERVED}/24"));
    assert_eq!(result["ips"][0]["gateway"], "198.51.100.1");
    // Announced as it came up: the gateway knows the macvlan's MAC before any traffic.
    assert_eq!(lan_neighbour(&lan, RESERVED), mac);
    let (ok, checked) = plugin(&node, "CHECK", "router-1", &router, &conf);
    assert!(ok, "{checked}");

    // Per-port rules (the remote port given, and kept), the fallback for every other port;
    // each arrives from the reserved address.
    let from_reserved = format!("far {RESERVED}");
    assert_eq!(
        tcp_answers(&client, "10.244.0.20", 80, 2).expect("rule"),
        vec![from_reserved.clone(); 2]
    );
    assert_eq!(udp_once(&client, "10.244.0.20", 5353), from_reserved);
    assert_eq!(connect_once(&client, "10.244.0.20", 8080), from_reserved);
    // The frames came from the macvlan: the gateway's neighbour entry is still its MAC.
    assert_eq!(lan_neighbour(&lan, RESERVED), mac);

    // The router pod made anew (a new container), without a fallback: a new macvlan whose
    // MAC the gateway learns at once; a port with no rule is refused, not dropped.
    let (ok, _) = plugin(&node, "DEL", "router-1", &router, &conf);
    assert!(ok);
    let (ok, gone) = plugin(&node, "CHECK", "router-1", &router, &conf);
    assert!(!ok, "{gone}");
    let conf = router_conf(r#""80 tcp 203.0.113.25 8080""#);
    let (ok, result) = plugin(&node, "ADD", "router-2", &router, &conf);
    assert!(ok, "{result}");
    let new_mac = result["interfaces"][0]["mac"]
        .as_str()
        .expect("mac")
        .to_owned();
    assert_ne!(new_mac, mac);
    assert_eq!(lan_neighbour(&lan, RESERVED), new_mac);
    assert_eq!(connect_once(&client, "10.244.0.20", 80), from_reserved);
    assert_eq!(connect_once(&client, "10.244.0.20", 8080), "refused");
    // DEL twice, and with the namespace gone, is fine.
    for _ in 0..2 {
        let (ok, out) = plugin(&node, "DEL", "router-2", &router, &conf);
        assert!(ok, "{out}");
    }
    run_in(&node, &["ip", "link", "show", "uplink"]).expect("the node's NIC stays");
}

/// The same over IPv6: the reserved address announced by an unsolicited neighbour
/// advertisement, the redirect in an `ip6` table.
#[test]
fn an_ipv6_egress_router_pod_sends_its_clients_on_from_the_reserved_address() {
    if !privileged("an_ipv6_egress_router_pod_sends_its_clients_on_from_the_reserved_address") {
        return;
    }
    let mut namespaces = Namespaces(Vec::new());
    let (node, lan, far) = (
        namespaces.add("ernode"),
        namespaces.add("erlan"),
        namespaces.add("erfar"),
    );
    let (client, router) = (namespaces.add("erclient"), namespaces.add("errouter"));
    run_in_host(&[
        "ip", "link", "add", "uplink", "netns", &node, "type", "veth", "peer", "name", "lan0",
        "netns", &lan,
    ]);
    run_in_host(&[
        "ip", "link", "add", "lan1", "netns", &lan, "type", "veth", "peer", "name", "eth0",
        "netns", &far,
    ]);
    for (netns, line) in [
        (&node, "ip addr add fd00:198::2/64 dev uplink nodad"),
        (&node, "ip link set uplink up"),
        (&node, "sysctl -qw net.ipv6.conf.all.forwarding=1"),
        (&node, "ip -6 route add default via fd00:198::1"),
        (&lan, "sysctl -qw net.ipv6.conf.all.forwarding=1"),
        (&lan, "ip addr add fd00:198::1/64 dev lan0 nodad"),
        (&lan, "ip addr add fd00:203::1/64 dev lan1 nodad"),
        (&lan, "ip link set lan0 up"),
        (&lan, "ip link set lan1 up"),
        (&far, "ip addr add fd00:203::25/64 dev eth0 nodad"),
        (&far, "ip link set eth0 up"),
        (&far, "ip -6 route add default via fd00:203::1"),
    ] {
        sh_in(netns, line).unwrap_or_else(|e| panic!("{line}: {e:#}"));
    }
    wire_pod6(&node, &client, "vclient", "10.244.0.10", "fd00:244::10");
    wire_pod6(&node, &router, "vrouter", "10.244.0.20", "fd00:244::20");
    let _far_server = echo_server(&far, "far", true).expect("far server");
    let conf = format!(
        r#"{{"cniVersion": "1.1.0", "name": "egress-router", "type": "egress-router",
            "ip": {{"addresses": ["{RESERVED6}/64"], "destinations": ["80 tcp fd00:203::25 8080"], "gateway": "fd00:198::1"}}}}"#
    );
    let (ok, result) = plugin(&node, "ADD", "router-6", &router, &conf);
    assert!(ok, "{result}");
    let mac = result["interfaces"][0]["mac"]
        .as_str()
        .expect("mac")
        .to_owned();
    // The unsolicited advertisement updates what the gateway holds (it learnt the router
    // from its own solicitation otherwise): after one connection it is the macvlan's MAC.
    let script = "import socket\n\
         c = socket.create_connection(('fd00:244::20', 80), timeout=3); print(c.recv(100).decode())\n";
    let out = exec_in(&client, &["python3", "-c", script]).expect("client");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("far {RESERVED6}"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(lan_neighbour(&lan, RESERVED6), mac);
    assert_eq!(connect_once(&client, "fd00:244::20", 81), "refused");
    let (ok, out) = plugin(&node, "DEL", "router-6", &router, &conf);
    assert!(ok, "{out}");
}

/// Beside the dataplane (issue 74, part 3): the router pod is a pod of the overlay, its
/// macvlan on a node whose NIC runs the agent's XDP and tc programs. A pod on the other node
/// reaches the router pod through the overlay; the router sends it on to the outside host from
/// the reserved address, and the replies, addressed to the macvlan's MAC, pass the node's
/// programs untouched.
#[test]
fn an_egress_router_pod_beside_the_dataplane() {
    if !privileged("an_egress_router_pod_beside_the_dataplane") {
        return;
    }
    use dataplane_tests::topology::{Mode, Topology};
    let mut topology = Topology::build_with(2, 2, Mode::Overlay).expect("topology");
    let external = topology.add_external_host().expect("outside host");
    let (router, client, other) = (
        topology.node(0).pods[0].clone(),
        topology.node(1).pods[0].clone(),
        topology.node(1).pods[1].clone(),
    );
    // The router's EgressRouter reserves its address in its namespace (the agents write the
    // reservations the plugin reads); a NetworkPolicy lets only the client reach the router
    // pod on its cluster interface.
    topology
        .add_manifest(
            "router.yaml",
            &format!(
                "apiVersion: network.operator.openshift.io/v1\nkind: EgressRouter\n\
                 metadata: {{name: router, namespace: {ns}}}\n\
                 spec:\n  addresses: [{{ip: 10.99.0.99/24, gateway: 10.99.0.100}}]\n\
                 \x20 redirect: {{redirectRules: [{{destinationIP: 10.99.0.100, port: 80, targetPort: 8080, protocol: TCP}}]}}\n\
                 ---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
                 metadata: {{name: router-clients, namespace: {ns}}}\n\
                 spec:\n  podSelector: {{matchLabels: {{pod: {router}}}}}\n  policyTypes: [Ingress]\n\
                 \x20 ingress: [{{from: [{{podSelector: {{matchLabels: {{pod: {client}}}}}}}]}}]\n",
                ns = router.namespace,
                router = router.name,
                client = client.name,
            ),
        )
        .expect("router manifests");
    let agents = [
        topology.node(0).start_agent().expect("agent"),
        topology.node(1).start_agent().expect("agent"),
    ];
    let _server = echo_server(&external.netns, "ext", false).expect("outside server");
    // The outside host is the node network's gateway too.
    let conf = r#"{"cniVersion": "1.0.0", "name": "egress-router", "type": "egress-router",
        "interfaceArgs": {"master": "eth0"},
        "ip": {"addresses": ["10.99.0.99/24"], "destinations": ["80 tcp 10.99.0.100 8080"], "gateway": "10.99.0.100"}}"#;
    let node = topology.node(0).netns.clone();
    let reserved = agents[0].run_dir.join(reservations::FILE_NAME);
    // A pod of another namespace may not claim the router's address.
    let (ok, error) = plugin_as(
        &node,
        "ADD",
        "router-other",
        &router.netns,
        conf,
        &reserved,
        Some(("tenant", "thief")),
    );
    assert!(!ok);
    assert_eq!(error["code"], 104, "{error}");
    let pod = Some((router.namespace.as_str(), router.name.as_str()));
    let (ok, result) = plugin_as(
        &node,
        "ADD",
        "router-dp",
        &router.netns,
        conf,
        &reserved,
        pod,
    );
    assert!(ok, "{result}");
    let mac = result["interfaces"][0]["mac"]
        .as_str()
        .expect("mac")
        .to_owned();
    assert_eq!(
        tcp_answers(&client.netns, &router.ip.to_string(), 80, 3).expect("through the router"),
        vec!["ext 10.99.0.99".to_owned(); 3],
        "{:#?}",
        agents[0].counters()
    );
    assert_eq!(lan_neighbour(&external.netns, "10.99.0.99"), mac);
    // Nothing of it was dropped by the node's programs.
    let counters = agents[0].counters().expect("counters");
    assert!(
        counters.drops.iter().all(|d| d.count == 0),
        "{:#?}",
        counters.drops
    );
    // The router pod is an ordinary pod on its cluster interface: NetworkPolicy keeps the
    // other pod out.
    assert_eq!(
        dataplane_tests::service_bed::one_syn(&other.netns, &router.ip.to_string(), 80)
            .expect("syn"),
        "timeout"
    );
    // Port security takes from it what its cluster interface may send, nothing more: the
    // reserved address as a source there is dropped and counted.
    let spoof = format!(
        "import socket\n\
         s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         s.bind(('10.99.0.99', 0))\n\
         s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b'eth0')\n\
         s.sendto(b'x', ('{}', 9))\n",
        client.ip
    );
    exec_in(&router.netns, &["python3", "-c", &spoof]).expect("spoof");
    let counters = agents[0].counters().expect("counters");
    let spoofed = counters
        .drops
        .iter()
        .find(|d| d.reason == "port_src_ip")
        .map_or(0, |d| d.count);
    assert_eq!(spoofed, 1, "{:#?}", counters.drops);
    let (ok, out) = plugin_as(
        &node,
        "DEL",
        "router-dp",
        &router.netns,
        conf,
        &reserved,
        pod,
    );
    assert!(ok, "{out}");
}

/// `GET` of `path` on the stand-in API server in `netns`: the object, or null when absent.
fn api_get(netns: &str, path: &str) -> Value {
    let script = "import sys, urllib.request, urllib.error\n\
                  try:\n\
                  \x20   print(urllib.request.urlopen('http://127.0.0.1:6443' + sys.argv[1], timeout=3).read().decode())\n\
                  except urllib.error.HTTPError:\n\
                  \x20   print('null')\n";
    let out = exec_in(netns, &["python3", "-c", script, path]).expect("GET");
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

/// A merge patch of `body` to `path` on the stand-in API server in `netns`.
fn api_merge_patch(netns: &str, path: &str, body: &Value) {
    let script = "import sys, urllib.request\n\
                  r = urllib.request.Request('http://127.0.0.1:6443' + sys.argv[1], data=sys.argv[2].encode(), method='PATCH', headers={'Content-Type': 'application/merge-patch+json'})\n\
                  urllib.request.urlopen(r, timeout=3).read()\n";
    exec_in(netns, &["python3", "-c", script, path, &body.to_string()]).expect("PATCH");
}

/// `path`'s object once `ready` holds for it (waiting up to 20 s); the last one read if never.
fn api_get_until(netns: &str, path: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let value = api_get(netns, path);
        if ready(&value) || std::time::Instant::now() > deadline {
            return value;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// A condition of an EgressRouter's status: (status, reason, message).
fn condition(router: &Value, kind: &str) -> (String, String, String) {
    let found = router["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == kind))
        .cloned()
        .unwrap_or(Value::Null);
    let text = |field: &str| found[field].as_str().unwrap_or_default().to_owned();
    (text("status"), text("reason"), text("message"))
}

#[test]
fn the_controller_makes_an_egress_routers_objects_and_the_plugin_runs_its_attachment() {
    if !privileged(
        "the_controller_makes_an_egress_routers_objects_and_the_plugin_runs_its_attachment",
    ) {
        return;
    }
    let mut namespaces = Namespaces(Vec::new());
    let LanBed {
        node,
        far,
        client,
        router,
        ..
    } = lan_bed(&mut namespaces);
    let _far_server = echo_server(&far, "far", false).expect("far server");
    // The cluster as the API server serves it: an EgressRouter as OpenShift documents it,
    // and one without a gateway.
    let dir = std::env::temp_dir().join(unique_name("ermanifests"));
    std::fs::create_dir_all(&dir).expect("manifests");
    std::fs::write(
        dir.join("routers.yaml"),
        format!(
            "apiVersion: network.operator.openshift.io/v1\nkind: EgressRouter\n\
             metadata: {{name: router, namespace: egress, uid: 0f0e0d0c-0000-4000-8000-000000000001}}\n\
             spec:\n  mode: Redirect\n  networkInterface: {{macvlan: {{mode: Bridge}}}}\n\
             \x20 addresses: [{{ip: {RESERVED}/24, gateway: 198.51.100.1}}]\n\
             \x20 redirect:\n    redirectRules:\n\
             \x20   - {{destinationIP: 203.0.113.25, port: 80, targetPort: 8080, protocol: TCP}}\n\
             \x20   - {{destinationIP: 203.0.113.25, port: 5353, protocol: UDP}}\n\
             \x20   fallbackIP: 203.0.113.26\n\
             ---\napiVersion: network.operator.openshift.io/v1\nkind: EgressRouter\n\
             metadata: {{name: broken, namespace: egress, uid: 0f0e0d0c-0000-4000-8000-000000000002}}\n\
             spec:\n  addresses: [{{ip: 198.51.100.98/24}}]\n  redirect: {{fallbackIP: 203.0.113.26}}\n"
        ),
    )
    .expect("routers");
    let api = dataplane_tests::topology::spawn_fake_apiserver(&node, &dir, &[]).expect("API");
    let key = dir.join("probe.key");
    std::fs::write(&key, "0123456789abcdef0123456789abcdef").expect("probe key");
    let controller = dataplane_tests::egress_topology::spawn_controller_in(
        &node,
        &[
            "--kubernetes".as_ref(),
            "--kubeconfig".as_ref(),
            api.kubeconfig.as_os_str(),
            "--probe-key-file".as_ref(),
            key.as_os_str(),
            "--identity".as_ref(),
            "controller-0".as_ref(),
        ],
    );
    let objects = "/namespaces/egress";
    let attachment = api_get_until(
        &node,
        &format!("/apis/k8s.cni.cncf.io/v1{objects}/network-attachment-definitions/router"),
        |v| !v.is_null(),
    );
    let conf = attachment["spec"]["config"]
        .as_str()
        .unwrap_or_else(|| panic!("no attachment: {attachment}\n{}", controller.log()))
        .to_owned();
    assert_eq!(
        attachment["metadata"]["ownerReferences"][0]["uid"],
        "0f0e0d0c-0000-4000-8000-000000000001"
    );

    // The plugin runs the attachment as Multus would for the router pod: the rules and the
    // fallback as the EgressRouter says, from the reserved address (which the router
    // reserves in its namespace: the reservations as the node's agent writes them from the
    // same objects).
    let mut cluster = dataplane_user::source::ClusterState::default();
    dataplane_user::source::add_documents(
        &mut cluster,
        "routers.yaml",
        &std::fs::read_to_string(dir.join("routers.yaml")).expect("routers"),
    );
    let reserved = Reservations::of(&cluster, &[])
        .write(&dir)
        .expect("reservations");
    let pod = Some(("egress", "router-5d8f7"));
    let (ok, result) = plugin_as(&node, "ADD", "router-1", &router, &conf, &reserved, pod);
    assert!(ok, "{result}");
    let from_reserved = format!("far {RESERVED}");
    assert_eq!(connect_once(&client, "10.244.0.20", 80), from_reserved);
    assert_eq!(udp_once(&client, "10.244.0.20", 5353), from_reserved);
    assert_eq!(connect_once(&client, "10.244.0.20", 8080), from_reserved);

    // The Deployment: one router pod at a time on that attachment; the Service: the rules'
    // ports.
    let deployment = api_get(&node, &format!("/apis/apps/v1{objects}/deployments/router"));
    assert_eq!(deployment["spec"]["replicas"], 1, "{deployment}");
    assert_eq!(deployment["spec"]["strategy"]["type"], "Recreate");
    let template = &deployment["spec"]["template"];
    assert_eq!(
        template["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"],
        "router"
    );
    assert_eq!(template["metadata"]["labels"]["app"], "egress-router-cni");
    assert_eq!(
        template["spec"]["containers"][0]["image"],
        "registry.k8s.io/pause:3.10"
    );
    let service = api_get(&node, &format!("/api/v1{objects}/services/router"));
    let ports: Vec<String> = service["spec"]["ports"]
        .as_array()
        .map(|ports| {
            ports
                .iter()
                .map(|p| format!("{} {}", p["protocol"].as_str().unwrap_or("?"), p["port"]))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(ports, ["TCP 80", "UDP 5353"], "{service}");

    // Its status follows the rollout: progressing until the Deployment's pod is available.
    let router_path =
        format!("/apis/network.operator.openshift.io/v1{objects}/egressrouters/router");
    let status = api_get_until(&node, &router_path, |v| {
        condition(v, "Progressing").0 == "True"
    });
    assert_eq!(
        condition(&status, "Available"),
        (
            "False".to_owned(),
            "RouterPodUnavailable".to_owned(),
            "0 of 1 router pod available".to_owned()
        ),
        "{status}\n{}",
        controller.log()
    );
    let generation = api_get(&node, &format!("/apis/apps/v1{objects}/deployments/router"))
        ["metadata"]["generation"]
        .clone();
    api_merge_patch(
        &node,
        &format!("/apis/apps/v1{objects}/deployments/router/status"),
        &serde_json::json!({"status": {"observedGeneration": generation, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 1}}),
    );
    let status = api_get_until(&node, &router_path, |v| {
        condition(v, "Available").0 == "True"
    });
    assert_eq!(
        [
            condition(&status, "Available").1,
            condition(&status, "Progressing").1,
            condition(&status, "Degraded").1
        ],
        ["RouterPodAvailable", "AsExpected", "AsExpected"],
        "{status}"
    );

    // The router without a gateway: degraded, the field named, nothing made for it.
    let broken = api_get_until(
        &node,
        &format!("/apis/network.operator.openshift.io/v1{objects}/egressrouters/broken"),
        |v| condition(v, "Degraded").0 == "True",
    );
    assert_eq!(
        condition(&broken, "Degraded"),
        (
            "True".to_owned(),
            "InvalidSpec".to_owned(),
            "spec.addresses[0].gateway: missing (the router's next hop on the reserved address's network)"
                .to_owned()
        ),
        "{broken}"
    );
    assert!(api_get(&node, &format!("/apis/apps/v1{objects}/deployments/broken")).is_null());

    let (ok, out) = plugin_as(&node, "DEL", "router-1", &router, &conf, &reserved, pod);
    assert!(ok, "{out}");
    drop(controller);
    drop(api);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A real container runtime runs the plugin for a second network: podman (CNI backend) on a
/// node running the agent starts a router container on the cluster network and an
/// egress-router network (its `eth1`, a macvlan on the node's NIC); a client container of
/// the other node reaches the outside host through it from the reserved address (which the
/// namespace's EgressRouter reserves) and the macvlan's MAC; the container removed (its
/// macvlan gone) and started again serves again.
#[test]
fn podman_attaches_an_egress_router_as_a_containers_second_network() {
    if !privileged("podman_attaches_an_egress_router_as_a_containers_second_network") {
        return;
    }
    use dataplane_tests::{
        cni::plugin_binary,
        podman::Podman,
        topology::{Mode, Topology},
    };
    let mut topology = Topology::build_with(2, 0, Mode::Overlay).expect("topology");
    let external = topology.add_external_host().expect("outside host");
    let _server = echo_server(&external.netns, "ext", false).expect("outside server");
    let (router, client) = (unique_name("router"), unique_name("client"));
    // podman names the pod after the container and no namespace: default.
    topology
        .add_manifest(
            "pods.yaml",
            &format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: {router}, namespace: default}}\n\
                 spec: {{nodeName: node0, containers: [{{name: r, image: busybox}}]}}\n---\n\
                 apiVersion: v1\nkind: Pod\nmetadata: {{name: {client}, namespace: default}}\n\
                 spec: {{nodeName: node1, containers: [{{name: c, image: busybox}}]}}\n---\n\
                 apiVersion: network.operator.openshift.io/v1\nkind: EgressRouter\n\
                 metadata: {{name: router, namespace: default}}\n\
                 spec: {{addresses: [{{ip: 10.99.0.99/24, gateway: 10.99.0.100}}], redirect: {{fallbackIP: 10.99.0.100}}}}\n"
            ),
        )
        .expect("manifests");
    let (agents, conf_dirs) =
        dataplane_tests::cni::start_agents_with_conf_dirs(&topology, 2).expect("agents");
    // The router's second network, as the NetworkAttachmentDefinition the controller makes
    // for that EgressRouter would configure it (a fallback for every port).
    std::fs::write(
        conf_dirs[0].join("20-egress.conflist"),
        r#"{"cniVersion": "1.0.0", "name": "egress", "plugins": [{"type": "egress-router",
            "interfaceArgs": {"master": "eth0"},
            "ip": {"addresses": ["10.99.0.99/24"], "destinations": ["10.99.0.100"], "gateway": "10.99.0.100"}}]}"#,
    )
    .expect("egress network");
    let plugin_dir = plugin_binary().parent().expect("bin dir").to_owned();
    let reserved = agents[0].run_dir.join(reservations::FILE_NAME);
    let mut node0 = Podman::new(&conf_dirs[0], &plugin_dir)
        .expect("podman")
        .in_netns(&topology.node(0).netns)
        .with_env(reservations::PATH_ENV, &reserved.display().to_string());
    let node1 = Podman::new(&conf_dirs[1], &plugin_dir)
        .expect("podman")
        .in_netns(&topology.node(1).netns);
    let fetch = |address: &str| {
        let out = node1
            .run(
                &client,
                "dataplane",
                &[
                    "/bin/sh",
                    "-c",
                    &format!("sleep 1 | nc -w 2 {address} 8080"),
                ],
            )
            .expect("client container");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    for round in 0..2 {
        node0
            .start_on(&router, &["dataplane", "egress"], &["/bin/sleep", "600"])
            .expect("router container");
        let router_ip = node0.address(&router, "dataplane").expect("address");
        assert_eq!(
            node0.address(&router, "egress").expect("reserved"),
            "10.99.0.99"
        );
        let mut answer = String::new();
        for _ in 0..10 {
            answer = fetch(&router_ip);
            if !answer.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        assert_eq!(answer, "ext 10.99.0.99", "round {round}");
        // The gateway knows the reserved address by the macvlan's MAC, not the node's.
        let node_mac = exec_in(
            &topology.node(0).netns,
            &["cat", "/sys/class/net/eth0/address"],
        )
        .expect("node MAC");
        let gateway_has = lan_neighbour(&external.netns, "10.99.0.99");
        assert_ne!(gateway_has, "-", "round {round}");
        assert_ne!(
            gateway_has,
            String::from_utf8_lossy(&node_mac.stdout).trim(),
            "round {round}"
        );
        // Removed: the runtime ran DEL, the macvlan is gone from the node.
        node0.remove(&router).expect("router removed");
        let links = exec_in(&topology.node(0).netns, &["ip", "-o", "link", "show"]).expect("links");
        assert!(
            !String::from_utf8_lossy(&links.stdout).contains("macvlan"),
            "{}",
            String::from_utf8_lossy(&links.stdout)
        );
        sh_in(&external.netns, "ip neigh flush all").expect("flush");
    }
    drop(agents);
    for dir in &conf_dirs {
        let _ = std::fs::remove_dir_all(dir);
    }
}
