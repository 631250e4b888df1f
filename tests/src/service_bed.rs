//! Service endpoints and clients in pods, for the load-balancer topology tests and the demo:
//! a backend that answers with its own address and the client address it saw, and a TCP client
//! that collects those answers.

use std::process::{Child, Command, Stdio};

use anyhow::{Context as _, bail};

use crate::topology::{Pod, exec_in};

/// A server process in a test namespace, killed (and reaped) when dropped: a test that fails
/// half-way leaves no process behind.
pub struct Server(Child);

impl From<Child> for Server {
    fn from(child: Child) -> Self {
        Self(child)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a backend in `pod` (IPv4, or IPv6-only sockets with `ipv6`): every TCP connection on
/// 8080 and every UDP datagram on 5353 is answered with "<its address> <the client address it
/// saw>".
pub fn echo_backend(pod: &Pod, ipv6: bool) -> anyhow::Result<Server> {
    let me = if ipv6 {
        pod.ip6
            .context("an IPv6 backend needs a dual-stack pod")?
            .to_string()
    } else {
        pod.ip.to_string()
    };
    echo_server(&pod.netns, &me, ipv6)
}

/// The server of [`echo_backend`] in any namespace, answering as `me`.
pub fn echo_server(netns: &str, me: &str, ipv6: bool) -> anyhow::Result<Server> {
    let (family, any, v6only) = if ipv6 {
        (
            "socket.AF_INET6",
            "::",
            "s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)",
        )
    } else {
        ("socket.AF_INET", "0.0.0.0", "pass")
    };
    let script = format!(
        "import socket, threading\n\
         def bound(kind, port):\n\
         \x20   s = socket.socket({family}, kind); {v6only}\n\
         \x20   s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('{any}', port))\n\
         \x20   return s\n\
         t = bound(socket.SOCK_STREAM, 8080); t.listen(64)\n\
         u = bound(socket.SOCK_DGRAM, 5353)\n\
         def udp():\n    while True:\n        d, a = u.recvfrom(100); u.sendto(f'{me} {{a[0]}}'.encode(), a)\n\
         threading.Thread(target=udp, daemon=True).start()\n\
         print('ready', flush=True)\n\
         while True:\n    c, a = t.accept(); c.sendall(f'{me} {{a[0]}}'.encode()); c.close()\n"
    );
    let mut child = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{netns}"))
        .args(["python3", "-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting a backend")?;
    // Listening once it says so: a client started right after must not find one backend of
    // a service still closed (and every connection then at the other).
    let mut ready = String::new();
    let stdout = child.stdout.take().context("the backend's output")?;
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut ready)
        .context("waiting for a backend")?;
    let server = Server(child);
    anyhow::ensure!(ready == "ready\n", "the backend in {netns} did not start");
    Ok(server)
}

/// `count` TCP connections from `netns` to `address:port`, retried while refused (the server
/// or the agent may still be starting); one line per answer.
pub fn tcp_answers(
    netns: &str,
    address: &str,
    port: u16,
    count: usize,
) -> anyhow::Result<Vec<String>> {
    let script = format!(
        "import socket, time\n\
         for i in range({count}):\n\
         \x20   for attempt in range(30):\n\
         \x20       try:\n\
         \x20           c = socket.create_connection(('{address}', {port}), timeout=5); break\n\
         \x20       except ConnectionRefusedError:\n\
         \x20           if attempt == 29: raise\n\
         \x20           time.sleep(0.1)\n\
         \x20   print(c.recv(100).decode()); c.close()\n"
    );
    let out = exec_in(netns, &["python3", "-c", &script])?;
    if !out.status.success() {
        bail!(
            "client to {address}:{port}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect())
}

/// One port of a test Service: name, service port, protocol, target port.
pub struct ServicePort {
    pub name: &'static str,
    pub port: u16,
    pub protocol: &'static str,
    pub target: u16,
}

/// An IPv4 ClusterIP Service `name` in namespace default and its EndpointSlice listing
/// `backends` as ready, as the API would serve them.
pub fn cluster_ip_manifests(
    name: &str,
    cluster_ip: &str,
    ports: &[ServicePort],
    backends: &[&Pod],
) -> String {
    let service_ports: Vec<String> = ports
        .iter()
        .map(|p| {
            format!(
                "{{name: {}, port: {}, protocol: {}, targetPort: {}}}",
                p.name, p.port, p.protocol, p.target
            )
        })
        .collect();
    let slice_ports: Vec<String> = ports
        .iter()
        .map(|p| {
            format!(
                "{{name: {}, port: {}, protocol: {}}}",
                p.name, p.target, p.protocol
            )
        })
        .collect();
    let endpoints: String = backends
        .iter()
        .map(|p| format!("- addresses: [{}]\n  conditions: {{ready: true}}\n", p.ip))
        .collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\n\
         spec: {{clusterIP: {cluster_ip}, clusterIPs: [{cluster_ip}], ports: [{}]}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: {name}-1, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}\n\
         addressType: IPv4\nports: [{}]\nendpoints:\n{endpoints}",
        service_ports.join(", "),
        slice_ports.join(", ")
    )
}

/// Tries each `(protocol, address, port)` from `pod` and prints one word per probe: the
/// answer's first field, `refused`, or `timeout` (no answer within a second).
pub fn probe(pod: &Pod, probes: &[(&str, &str, u16)]) -> anyhow::Result<Vec<String>> {
    probe_in(&pod.netns, &pod.name, probes)
}

/// One TCP SYN from `netns` to `address`:`port`, given up on after half a second (before the
/// kernel's first retransmission at 1 s), so a counter sees exactly one packet: "connected",
/// "refused" or "timeout".
pub fn one_syn(netns: &str, address: &str, port: u16) -> anyhow::Result<String> {
    let script = format!(
        "import socket\n\
         s = socket.socket(socket.AF_INET6 if ':' in '{address}' else socket.AF_INET)\n\
         s.settimeout(0.5)\n\
         try:\n\
         \x20   s.connect(('{address}', {port})); print('connected')\n\
         except ConnectionRefusedError: print('refused')\n\
         except socket.timeout: print('timeout')\n"
    );
    let out = exec_in(netns, &["python3", "-c", &script])?;
    if !out.status.success() {
        bail!("SYN from {netns}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// As [`probe`], from any network namespace (`who` names it in errors).
pub fn probe_in(
    netns: &str,
    who: &str,
    probes: &[(&str, &str, u16)],
) -> anyhow::Result<Vec<String>> {
    let list: Vec<String> = probes
        .iter()
        .map(|(proto, address, port)| format!("('{proto}', '{address}', {port})"))
        .collect();
    let script = format!(
        "import socket\n\
         for proto, address, port in [{}]:\n\
         \x20   kind = socket.SOCK_STREAM if proto == 'tcp' else socket.SOCK_DGRAM\n\
         \x20   s = socket.socket(socket.AF_INET, kind); s.settimeout(1)\n\
         \x20   try:\n\
         \x20       s.connect((address, port))\n\
         \x20       if proto == 'udp': s.send(b'q')\n\
         \x20       print(s.recv(100).decode().split()[0])\n\
         \x20   except ConnectionRefusedError: print('refused')\n\
         \x20   except socket.timeout: print('timeout')\n\
         \x20   s.close()\n",
        list.join(", ")
    );
    let out = exec_in(netns, &["python3", "-c", &script])?;
    if !out.status.success() {
        bail!(
            "probe from {}: {}",
            who,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect())
}

/// `count` TCP connections (retried while the path is not yet there) and `count` requests
/// from unconnected UDP sockets, from `netns` to ports 80 (TCP) and 53 (UDP) of
/// `service_ip`; one line per answer: "tcp|udp <backend> <client seen> <peer>", the peer
/// being the TCP socket's `getpeername` and the source `recvfrom` gave for UDP, as
/// `address:port`.
pub fn service_requests(netns: &str, service_ip: &str, count: usize) -> Vec<String> {
    let family = if service_ip.contains(':') {
        "AF_INET6"
    } else {
        "AF_INET"
    };
    let script = format!(
        "import socket, time\n\
         for i in range({count}):\n\
         \x20   for _ in range(50):\n\
         \x20       try:\n\
         \x20           c = socket.create_connection(('{service_ip}', 80), timeout=5); break\n\
         \x20       except OSError: time.sleep(0.1)\n\
         \x20   p = c.getpeername()\n\
         \x20   print('tcp', c.recv(100).decode(), f'{{p[0]}}:{{p[1]}}'); c.close()\n\
         for i in range({count}):\n\
         \x20   u = socket.socket(socket.{family}, socket.SOCK_DGRAM); u.settimeout(5)\n\
         \x20   u.sendto(b'q', ('{service_ip}', 53)); d, a = u.recvfrom(100)\n\
         \x20   print('udp', d.decode(), f'{{a[0]}}:{{a[1]}}'); u.close()\n"
    );
    let out = exec_in(netns, &["python3", "-c", &script]).expect("client");
    assert!(
        out.status.success(),
        "client in {netns}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Checks every answer of [`service_requests`]: a backend of `backends`, the client address
/// that backend must have seen (`seen_by(backend)`), the service's address and port as the
/// peer. Returns the (protocol, backend) pairs reached.
pub fn check_answers(
    lines: &[String],
    backends: &std::collections::BTreeSet<String>,
    service_ip: &str,
    seen_by: impl Fn(&str) -> String,
) -> std::collections::BTreeSet<(String, String)> {
    let mut reached = std::collections::BTreeSet::new();
    for line in lines {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [proto, backend, seen, peer] = fields[..] else {
            panic!("answer {line:?}");
        };
        assert!(backends.contains(backend), "{line}");
        assert_eq!(seen, seen_by(backend), "client address preserved: {line}");
        let port = if proto == "tcp" { 80 } else { 53 };
        assert_eq!(
            peer,
            format!("{service_ip}:{port}"),
            "the service as the peer: {line}"
        );
        reached.insert((proto.to_owned(), backend.to_owned()));
    }
    reached
}

/// A dual-stack ClusterIP Service `name` (TCP 80 to 8080 `http`, UDP 53 to 5353 `dns`) at
/// `ipv4` and `ipv6`, with an EndpointSlice per family listing `backends` (dual-stack pods).
pub fn dual_stack_manifests(name: &str, ipv4: &str, ipv6: &str, backends: &[&Pod]) -> String {
    let slice = |family: &str, addresses: Vec<String>| {
        let endpoints: String = addresses
            .iter()
            .map(|a| format!("- addresses: [\"{a}\"]\n"))
            .collect();
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{name: {name}-{family}, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}\n\
             addressType: {family}\nports:\n- {{name: http, port: 8080, protocol: TCP}}\n\
             - {{name: dns, port: 5353, protocol: UDP}}\nendpoints:\n{endpoints}"
        )
    };
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\n\
         spec:\n  ipFamilyPolicy: RequireDualStack\n  ipFamilies: [IPv4, IPv6]\n\
         \x20 clusterIPs: [{ipv4}, \"{ipv6}\"]\n  ports:\n\
         \x20 - {{name: http, port: 80, protocol: TCP, targetPort: 8080}}\n\
         \x20 - {{name: dns, port: 53, protocol: UDP, targetPort: 5353}}\n{}{}",
        slice("IPv4", backends.iter().map(|p| p.ip.to_string()).collect()),
        slice(
            "IPv6",
            backends
                .iter()
                .map(|p| p.ip6.expect("a dual-stack pod").to_string())
                .collect()
        ),
    )
}
