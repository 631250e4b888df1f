//! Cluster-wide admin policies end to end, conformance style: five namespaces with a pod on
//! each of two nodes, real TCP and UDP probes by pod address and by Service address, and the
//! nodes themselves (what host-network pods are) as clients. The same scenario written as
//! AdminNetworkPolicy + BaselineAdminNetworkPolicy and as ClusterNetworkPolicy must give the
//! same matrix; a denial is a silent drop (a probe times out, it is never refused).
//!
//! The scenario:
//! - n0 ("monitoring"): admin tier allows n0 and n1, denies every other namespace;
//! - n2: admin tier passes its egress to n3 and denies its UDP to the pod network;
//! - n3: a NetworkPolicy admits n2 on TCP only;
//! - n4: a NetworkPolicy admits n3 only;
//! - baseline: n1 and n4 refuse n3 (n4's NetworkPolicy overrides it, n1 has none).

use dataplane_tests::{
    privileged::privileged,
    service_bed::{Server, echo_backend, one_syn, probe_in},
    topology::{Agent, Mode, Pod, Topology, dataplane_json},
};
use serde_json::Value;

const NAMESPACES: usize = 5;

/// The namespaces; n4 audits its NetworkPolicies' denials, so that node 0's audit log has
/// lines in both runs and an admin record's absence means something.
fn namespaces() -> String {
    (0..NAMESPACES)
        .map(|n| {
            let audit = if n == 4 {
                ", annotations: {k8s.ovn.org/acl-logging: '{\"deny\":\"alert\"}'}"
            } else {
                ""
            };
            format!("---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: n{n}, labels: {{team: n{n}}}{audit}}}\n")
        })
        .collect()
}

const COMMON: &str = "\
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: from-n2-tcp, namespace: n3}
spec:
  podSelector: {}
  ingress:
  - from: [{namespaceSelector: {matchLabels: {team: n2}}}]
    ports: [{protocol: TCP, port: 8080}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: from-n3, namespace: n4}
spec:
  podSelector: {}
  ingress:
  - from: [{namespaceSelector: {matchLabels: {team: n3}}}]
---
apiVersion: v1
kind: Service
metadata: {name: monitoring, namespace: n0}
spec: {clusterIP: 10.96.0.60, clusterIPs: [10.96.0.60], ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: monitoring-1, namespace: n0, labels: {kubernetes.io/service-name: monitoring}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.244.1.2]
  conditions: {ready: true}
";

const V1ALPHA1: &str = "\
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata:
  name: monitoring
  annotations: {k8s.ovn.org/acl-logging: '{\"deny\":\"alert\"}'}
spec:
  priority: 10
  subject: {namespaces: {matchLabels: {team: n0}}}
  ingress:
  - name: monitoring-itself
    action: Allow
    from: [{namespaces: {matchLabels: {team: n0}}}]
  - name: prometheus
    action: Allow
    from: [{pods: {namespaceSelector: {matchLabels: {team: n1}}, podSelector: {}}}]
  - name: nobody-else
    action: Deny
    from: [{namespaces: {}}]
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: n2-egress}
spec:
  priority: 20
  subject: {namespaces: {matchLabels: {team: n2}}}
  egress:
  - action: Pass
    to: [{namespaces: {matchLabels: {team: n3}}}]
  - action: Deny
    to: [{networks: [10.244.0.0/16]}]
    ports: [{portRange: {protocol: UDP, start: 1, end: 65535}}]
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: BaselineAdminNetworkPolicy
metadata: {name: default}
spec:
  subject: {namespaces: {matchExpressions: [{key: team, operator: In, values: [n1, n4]}]}}
  ingress:
  - action: Deny
    from: [{namespaces: {matchLabels: {team: n3}}}]
";

const V1ALPHA2: &str = "\
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: monitoring}
spec:
  tier: Admin
  priority: 10
  subject: {namespaces: {matchLabels: {team: n0}}}
  ingress:
  - action: Accept
    from: [{namespaces: {matchLabels: {team: n0}}}]
  - action: Accept
    from: [{pods: {namespaceSelector: {matchLabels: {team: n1}}, podSelector: {}}}]
  - action: Deny
    from: [{namespaces: {}}]
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: n2-egress}
spec:
  tier: Admin
  priority: 20
  subject: {namespaces: {matchLabels: {team: n2}}}
  egress:
  - action: Pass
    to: [{namespaces: {matchLabels: {team: n3}}}]
  - action: Deny
    to: [{networks: [10.244.0.0/16]}]
    protocols: [{udp: {}}]
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: baseline}
spec:
  tier: Baseline
  priority: 0
  subject: {namespaces: {matchExpressions: [{key: team, operator: In, values: [n1, n4]}]}}
  ingress:
  - action: Deny
    from: [{namespaces: {matchLabels: {team: n3}}}]
";

/// Whether a client of namespace `from` reaches a server of namespace `to` with `protocol`.
fn expected(from: usize, to: usize, protocol: &str) -> bool {
    let udp = protocol == "udp";
    // n2's egress: UDP to the pod network is denied, except to n3 (passed on).
    if from == 2 && udp && to != 3 {
        return false;
    }
    match to {
        0 => from <= 1,
        1 => from != 3,
        2 => true,
        3 => from == 2 && !udp,
        4 => from == 3,
        _ => unreachable!(),
    }
}

/// Every client probes every server, the clients in parallel: one line per client, one
/// character per (server, protocol): `.` answered, `X` timed out, `R` refused.
fn matrix(clients: &[(String, String)], servers: &[Pod]) -> String {
    let rows: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = clients
            .iter()
            .map(|(netns, who)| {
                scope.spawn(move || {
                    let addresses: Vec<String> = servers.iter().map(|s| s.ip.to_string()).collect();
                    let mut probes = Vec::new();
                    for address in &addresses {
                        probes.push(("tcp", address.as_str(), 8080));
                        probes.push(("udp", address.as_str(), 5353));
                    }
                    let answers = probe_in(netns, who, &probes).expect("probe");
                    answers
                        .iter()
                        .zip(&probes)
                        .map(|(answer, (_, address, _))| match answer.as_str() {
                            "timeout" => 'X',
                            "refused" => 'R',
                            a if a == *address => '.',
                            _ => '?',
                        })
                        .collect::<String>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("probe thread"))
            .collect()
    });
    rows.join("\n")
}

/// `dataplane trace` and `dataplane inspect policy` on node 0 name the tier, the policy and
/// the rule that decided.
fn check_explained(name: &str, topology: &Topology, agent: &Agent, kind: &str) {
    // n2's client on node 0 to n0's pod there: the admin tier's rule 2 refuses it.
    let trace = dataplane_json(
        topology.node(0),
        agent,
        &["trace", "--from", "10.244.1.4", "--to", "10.244.1.2:8080"],
    );
    let policy: Vec<&str> = trace["policy"]
        .as_array()
        .expect("policy decisions")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let refused =
        format!("ingress of 10.244.1.2: deny by admin tier: {kind} monitoring ingress[2]");
    assert!(
        policy.iter().any(|d| d.starts_with(&refused)),
        "{name}: {trace:#}"
    );
    assert!(
        policy.contains(&"egress of 10.244.1.4: allow by nothing matched: allowed by default"),
        "{name}: {trace:#}"
    );
    assert!(
        trace["steps"][0]["verdict"]
            .as_str()
            .is_some_and(|v| v.starts_with("shot")),
        "{name}: {trace:#}"
    );
    // n1's client on node 1 reached n0's pod on node 0: admitted by the admin tier's rule 1.
    let rows = dataplane_json(topology.node(0), agent, &["inspect", "policy"]);
    let rows = rows.as_array().expect("rows");
    let admitted = format!("ingress: allow by admin tier: {kind} monitoring ingress[1]");
    assert!(
        rows.iter().any(|row| row["what"] == "allowed flow"
            && row["who"]
                .as_str()
                .is_some_and(|w| w.starts_with("10.244.2.3:") && w.ends_with("-> 10.244.1.2:8080"))
            && row["decided_by"]
                .as_str()
                .is_some_and(|d| d.starts_with(&admitted))),
        "{name}: {rows:#?}"
    );
    assert!(
        rows.iter().any(|row| row["what"]
            .as_str()
            .is_some_and(|w| w.starts_with("policy set"))
            && row["who"] == "n0 ingress"
            && row["detail"]
                .as_str()
                .is_some_and(|d| d.starts_with(&format!("admin tier: {kind} monitoring")))),
        "{name}: {rows:#?}"
    );
}

/// Runs the scenario; `audited`: the admin policy `monitoring` logs its denials.
fn run(name: &str, policies: &str, audited: bool) {
    if !privileged(name) {
        return;
    }
    let mut topology = Topology::build_with(2, NAMESPACES, Mode::Overlay).expect("topology");
    for node in 0..2 {
        for pod in 0..NAMESPACES {
            topology
                .set_pod_namespace(node, pod, &format!("n{pod}"))
                .expect("namespace");
        }
    }
    let manifest = namespaces() + COMMON + policies;
    topology
        .add_manifest("admin.yaml", &manifest)
        .expect("manifests");
    let servers: Vec<Pod> = (0..2)
        .flat_map(|node| topology.node(node).pods.clone())
        .collect();
    assert_eq!(
        servers[0].ip.to_string(),
        "10.244.1.2",
        "the Service's backend"
    );
    let _echo: Vec<Server> = servers
        .iter()
        .map(|p| echo_backend(p, false).expect("server"))
        .collect();
    let audit_log = std::env::temp_dir()
        .join(dataplane_tests::unique_name("audit"))
        .join("acl-audit-log.log");
    let agents = [
        topology
            .node(0)
            .start_agent_with(&["--audit-log", audit_log.to_str().expect("path")])
            .expect("agent 0"),
        topology.node(1).start_agent().expect("agent 1"),
    ];
    // The client of namespace n lives on node n % 2: same-node and cross-node pairs both.
    let clients: Vec<(String, String)> = (0..NAMESPACES)
        .map(|n| {
            let pod = &topology.node(n % 2).pods[n];
            (pod.netns.clone(), pod.name.clone())
        })
        .collect();
    let want: String = (0..NAMESPACES)
        .map(|from| {
            servers
                .iter()
                .enumerate()
                .flat_map(|(s, _)| {
                    let to = s % NAMESPACES;
                    // A pod reaching its own address never leaves it.
                    let itself = s == (from % 2) * NAMESPACES + from;
                    ["tcp", "udp"].map(|p| {
                        if itself || expected(from, to, p) {
                            '.'
                        } else {
                            'X'
                        }
                    })
                })
                .collect::<String>()
        })
        .collect::<Vec<_>>()
        .join("\n");
    // The servers start listening while the agents sync: retry until the matrix settles.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut got = matrix(&clients, &servers);
    while got != want && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(300));
        got = matrix(&clients, &servers);
    }
    assert_eq!(
        got,
        want,
        "{name}: rows are clients n0..n4, columns servers n0..n4 on node 0 then node 1, tcp and udp each\n{}",
        agents[0].log()
    );
    let kind = if audited {
        "AdminNetworkPolicy"
    } else {
        "ClusterNetworkPolicy"
    };
    check_explained(name, &topology, &agents[0], kind);
    // By the Service address: the backend's admin ingress decides, after the load-balancer.
    let by_service: Vec<String> = clients
        .iter()
        .map(|(netns, who)| {
            probe_in(netns, who, &[("tcp", "10.96.0.60", 80)]).expect("probe")[0].clone()
        })
        .collect();
    assert_eq!(
        by_service,
        ["10.244.1.2", "10.244.1.2", "timeout", "timeout", "timeout"],
        "{name}: the monitoring Service from n0..n4"
    );
    // The nodes (host-network pods) are no namespace's pods: the admin deny does not match
    // them, and nothing else isolates n0.
    for node in 0..2 {
        let netns = topology.node(node).netns.clone();
        assert_eq!(
            probe_in(
                &netns,
                &format!("node {node}"),
                &[("tcp", "10.244.2.2", 8080)]
            )
            .expect("probe"),
            ["10.244.2.2"],
            "{name}: node {node} to n0's pod on node 1"
        );
    }
    // The monitoring policy's denials, named as OVN-Kubernetes names them: n2's client on
    // node 0 refused by rule 2 (`nobody-else`) of the admin policy.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let audit = std::fs::read_to_string(&audit_log)
        .unwrap_or_else(|e| panic!("{name}: node 0's audit log {}: {e}", audit_log.display()));
    // n4's NetworkPolicy audits in both runs: n0's client on node 0 refused by n4's pod there.
    let n4_record = "name=\"NP:n4:isolation:Ingress:default\", verdict=drop, severity=alert, direction=to-lport: tcp,nw_src=10.244.1.2,nw_dst=10.244.1.6";
    assert!(
        audit.lines().any(|l| l.contains(n4_record)),
        "{name}: n4's denial is audited: {audit}"
    );
    let record = "name=\"ANP:monitoring:Ingress:2\", verdict=drop, severity=alert, direction=to-lport: tcp,nw_src=10.244.1.4,nw_dst=10.244.1.2";
    assert_eq!(
        audit.lines().any(|l| l.contains(record)),
        audited,
        "{name}: {audit}"
    );
    assert!(!audit.contains("verdict=allow"), "{audit}");
    if let Some(dir) = audit_log.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
    // Counted exactly: one SYN of n2's client (node 0) to n0's pod on node 1, refused there
    // by the admin tier's ingress rule, is one ingress denial on node 1 and none on node 0.
    let denied = |agent: &Agent| {
        agent
            .counters()
            .expect("counters")
            .drops(dataplane_common::DropReason::PolicyDeniedIngress)
    };
    let before = (denied(&agents[0]), denied(&agents[1]));
    let (n2_client, _) = &clients[2];
    assert_eq!(
        one_syn(n2_client, "10.244.2.2", 8080).expect("SYN"),
        "timeout",
        "{name}"
    );
    assert_eq!(
        (denied(&agents[0]), denied(&agents[1])),
        (before.0, before.1 + 1),
        "{name}: one ingress denial, on node 1"
    );
}

#[test]
fn admin_network_policies_decide_real_connections_by_tier() {
    run(
        "admin_network_policies_decide_real_connections_by_tier",
        V1ALPHA1,
        true,
    );
}

#[test]
fn cluster_network_policies_give_the_same_matrix() {
    run(
        "cluster_network_policies_give_the_same_matrix",
        V1ALPHA2,
        false,
    );
}

/// A DNS server: `api.example.com` is 10.244.1.4 (node 0's third pod), `api.other.org`
/// 10.244.2.3 (node 1's second pod); A records with a 60 s TTL, anything else NXDOMAIN.
const DNS_SERVER: &str = "\
import socket
records = {'api.example.com': '10.244.1.4', 'api.other.org': '10.244.2.3'}
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(('0.0.0.0', 53))
while True:
    q, client = s.recvfrom(512)
    i, labels = 12, []
    while q[i]:
        labels.append(q[i + 1:i + 1 + q[i]].decode()); i += 1 + q[i]
    question = q[12:i + 5]
    name = '.'.join(labels).lower()
    if name in records:
        answer = b'\\xc0\\x0c\\x00\\x01\\x00\\x01' + (60).to_bytes(4, 'big') + b'\\x00\\x04' + socket.inet_aton(records[name])
        header = q[:2] + b'\\x81\\x80\\x00\\x01\\x00\\x01\\x00\\x00\\x00\\x00'
    else:
        answer = b''
        header = q[:2] + b'\\x81\\x83\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00'
    s.sendto(header + question + answer, client)
";

/// Asks `server` for `name`'s A record from `netns`: the address, or `none`.
fn resolve(netns: &str, server: &str, name: &str) -> String {
    let script = format!(
        "import socket\n\
         q = b'\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00' + b''.join(bytes([len(l)]) + l.encode() for l in '{name}'.split('.')) + b'\\x00\\x00\\x01\\x00\\x01'\n\
         s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)\n\
         s.sendto(q, ('{server}', 53))\n\
         a = s.recv(512)\n\
         print(socket.inet_ntoa(a[-4:]) if a[7] else 'none')\n"
    );
    let out =
        dataplane_tests::topology::exec_in(netns, &["python3", "-c", &script]).expect("resolve");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Sends `netns`'s pod a forged answer from UDP port 53: `evil.example.com` is `address`.
fn forge_answer(netns: &str, to: &str, address: &str) {
    let script = format!(
        "import socket\n\
         name = b'\\x04evil\\x07example\\x03com\\x00'\n\
         m = b'\\x55\\x55\\x81\\x80\\x00\\x01\\x00\\x01\\x00\\x00\\x00\\x00' + name + b'\\x00\\x01\\x00\\x01' + b'\\xc0\\x0c\\x00\\x01\\x00\\x01\\x00\\x00\\x0e\\x10\\x00\\x04' + socket.inet_aton('{address}')\n\
         s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('0.0.0.0', 53))\n\
         s.sendto(m, ('{to}', 33333))\n"
    );
    let out =
        dataplane_tests::topology::exec_in(netns, &["python3", "-c", &script]).expect("forge");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

const WILDCARD: &str = "\
---
apiVersion: v1
kind: Namespace
metadata: {name: app}
---
apiVersion: v1
kind: Namespace
metadata: {name: other}
---
apiVersion: v1
kind: Namespace
metadata: {name: targets}
---
apiVersion: v1
kind: Namespace
metadata: {name: kube-system}
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system}
spec: {clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10], ports: [{name: dns, port: 53, protocol: UDP, targetPort: 53}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: kube-dns-1, namespace: kube-system, labels: {kubernetes.io/service-name: kube-dns}}
addressType: IPv4
ports: [{name: dns, port: 53, protocol: UDP}]
endpoints:
- addresses: [10.244.2.2]
  conditions: {ready: true}
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: wildcard}
spec:
  priority: 5
  subject: {namespaces: {matchLabels: {kubernetes.io/metadata.name: app}}}
  egress:
  - action: Allow
    to: [{domainNames: ['*.example.com']}]
  - action: Allow
    to: [{namespaces: {matchLabels: {kubernetes.io/metadata.name: kube-system}}}]
  - action: Deny
    to: [{networks: [10.244.0.0/16]}]
";

#[test]
fn wildcard_domain_names_allow_what_the_cluster_dns_answered_and_nothing_forged() {
    let name = "wildcard_domain_names_allow_what_the_cluster_dns_answered_and_nothing_forged";
    if !privileged(name) {
        return;
    }
    let mut topology = Topology::build_with(2, 3, Mode::Overlay).expect("topology");
    for (node, pod, namespace) in [
        (0, 0, "app"),
        (0, 1, "other"),
        (0, 2, "targets"),
        (1, 0, "kube-system"),
        (1, 1, "targets"),
        (1, 2, "targets"),
    ] {
        topology
            .set_pod_namespace(node, pod, namespace)
            .expect("namespace");
    }
    topology
        .add_manifest("wildcard.yaml", WILDCARD)
        .expect("manifests");
    let client = topology.node(0).pods[0].clone();
    let forger = topology.node(0).pods[1].clone();
    let targets = [
        topology.node(0).pods[2].clone(),
        topology.node(1).pods[1].clone(),
        topology.node(1).pods[2].clone(),
    ];
    let dns = topology.node(1).pods[0].clone();
    assert_eq!(dns.ip.to_string(), "10.244.2.2");
    let _servers: Vec<Server> = targets
        .iter()
        .map(|p| echo_backend(p, false).expect("server"))
        .collect();
    let _dns_server: Server = std::process::Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", dns.netns))
        .args(["python3", "-c", DNS_SERVER])
        .spawn()
        .expect("DNS server")
        .into();
    let agents = [
        topology.node(0).start_agent().expect("agent 0"),
        topology.node(1).start_agent().expect("agent 1"),
    ];
    let connect = |target: &Pod| -> String {
        probe_in(
            &client.netns,
            &client.name,
            &[("tcp", &target.ip.to_string(), 8080)],
        )
        .expect("probe")[0]
            .clone()
    };
    let eventually = |target: &Pod, want: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut got = connect(target);
        while got != want && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(300));
            got = connect(target);
        }
        assert_eq!(got, want, "{}", agents[0].log());
    };
    // Nothing learned yet: the pod network is denied.
    assert_eq!(connect(&targets[0]), "timeout");
    // The cluster DNS (through its Service, on the other node) answers a name the wildcard
    // matches: its address is allowed from then on.
    let mut answer = resolve(&client.netns, "10.96.0.10", "api.example.com");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while answer != "10.244.1.4" && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(300));
        answer = resolve(&client.netns, "10.96.0.10", "api.example.com");
    }
    assert_eq!(answer, "10.244.1.4", "{}", agents[0].log());
    eventually(&targets[0], "10.244.1.4");
    // A name it does not match teaches nothing.
    assert_eq!(
        resolve(&client.netns, "10.96.0.10", "api.other.org"),
        "10.244.2.3"
    );
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(connect(&targets[1]), "timeout");
    // An answer forged by another pod (from port 53, but no cluster DNS server) is ignored.
    forge_answer(&forger.netns, &client.ip.to_string(), "10.244.2.4");
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(connect(&targets[2]), "timeout");
    let log = agents[0].log();
    assert!(
        log.contains("wildcard domain names learned new addresses"),
        "{log}"
    );
    assert!(
        log.contains("DNS answers to pods from addresses that are no cluster DNS server ignored"),
        "{log}"
    );
}
