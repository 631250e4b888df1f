//! The CNI plugin end to end: `dataplane-cni` run as a container runtime runs it (environment,
//! configuration on stdin, JSON on stdout, exit status) against network namespaces, with the
//! real agents of a two-node overlay cluster read from manifests. Pods wired by the plugin
//! reach each other across the Geneve overlay and through a Service, are isolated by a
//! NetworkPolicy, survive an agent restart, and GC reclaims a container killed without DEL;
//! an ADD whose state cannot be installed fails and leaves nothing behind.

use std::{net::IpAddr, time::Duration};

use dataplane_tests::{
    cni::{self, Container, add, allocations, conf, invoke},
    privileged::privileged,
    service_bed::{echo_backend, probe},
    topology::{Mode, Topology, dataplane_binary},
};
use serde_json::json;

const PODS: &str = "\
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: default, uid: uid-CLIENT, labels: {app: client}}
spec: {nodeName: node0, containers: [{name: app, image: registry.k8s.io/pause:3.9}]}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: default, uid: uid-SERVER, labels: {app: server}}
spec: {nodeName: node1, containers: [{name: app, image: registry.k8s.io/pause:3.9}]}
";

const SERVICE: &str = "\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec: {clusterIP: 10.96.0.80, clusterIPs: [10.96.0.80], ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [SERVER_IP]
  conditions: {ready: true}
";

const ISOLATE_SERVER: &str = "\
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: server-from-nobody, namespace: default}
spec:
  podSelector: {matchLabels: {app: server}}
  policyTypes: [Ingress]
";

/// The agent's metrics, scraped in its node's namespace.
fn metrics_text(netns: &str) -> String {
    let script = "import urllib.request\n\
                  print(urllib.request.urlopen('http://127.0.0.1:9476/metrics', timeout=5).read().decode(), end='')\n";
    let out = dataplane_tests::topology::exec_in(netns, &["python3", "-c", script]).unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Retries `probe` until it gives `want` (the agents follow manifest changes within a second
/// or two).
fn eventually(what: &str, want: &[&str], mut probe: impl FnMut() -> Vec<String>) {
    let mut last = Vec::new();
    for _ in 0..40 {
        last = probe();
        if last == want {
            return;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    panic!("{what}: wanted {want:?}, last saw {last:?}");
}

#[test]
fn plugin_wires_pods_that_cross_the_overlay_reach_a_service_and_obey_policy() {
    if !privileged("plugin_wires_pods") {
        return;
    }
    let _ = dataplane_binary();
    let mut topology = Topology::build_with(2, 0, Mode::Overlay).expect("topology");
    topology.add_manifest("pods.yaml", PODS).unwrap();
    let agent0 = topology
        .node(0)
        .start_agent_with(&["--metrics-address", "127.0.0.1:9476"])
        .expect("agent 0");
    let agent1 = topology.node(1).start_agent().expect("agent 1");

    // The runtime passes the UIDs of the Pod objects.
    let mut client = cni::container(&mut topology, "default", "client").unwrap();
    client.uid = "uid-CLIENT".into();
    let mut server = cni::container(&mut topology, "default", "server").unwrap();
    server.uid = "uid-SERVER".into();

    // ADD in the newest version on node 0, the oldest on node 1.
    let conf0 = conf("1.1.0", &cni::socket(&agent0));
    let conf1 = conf("0.4.0", &cni::socket(&agent1));
    let (client_pod, client_result) = add(&client, &conf0).expect("ADD client");
    let (server_pod, server_result) = add(&server, &conf1).expect("ADD server");

    // The result, as the specification shapes it: the first free addresses of the node's
    // pod CIDRs (network and gateway skipped), the MAC OVN-Kubernetes derives, the pod MTU.
    let host = client_result["interfaces"][0]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(host.starts_with("dp") && host.len() == 15, "{host}");
    assert_eq!(
        client_result,
        json!({
            "cniVersion": "1.1.0",
            "interfaces": [
                {"name": host, "mac": client_result["interfaces"][0]["mac"]},
                {"name": "eth0", "mac": "0a:58:0a:f4:01:02", "sandbox": client.netns_path(), "mtu": 1400},
            ],
            "ips": [
                {"address": "10.244.1.2/32", "gateway": "169.254.1.1", "interface": 1},
                {"address": "fd00:10:244:1::2/128", "gateway": "fe80::1", "interface": 1},
            ],
            "routes": [
                {"dst": "0.0.0.0/0", "gw": "169.254.1.1"},
                {"dst": "::/0", "gw": "fe80::1"},
            ],
            "dns": {},
        })
    );
    assert_eq!(server_result["cniVersion"], "0.4.0");
    assert_eq!(server_result["ips"][0]["version"], "4");
    assert_eq!(server_result["ips"][0]["address"], "10.244.2.2/32");
    assert_eq!(server_result["ips"][1]["version"], "6");
    assert!(server_result["interfaces"][1].get("mtu").is_none());
    assert_eq!(
        allocations(&agent0).unwrap(),
        vec![(
            client.id.clone(),
            vec!["10.244.1.2/24".into(), "fd00:10:244:1::2/64".into()]
        )]
    );

    // `dataplane status` lists the pods the plugin wired.
    let status = agent0.status_json().unwrap();
    assert_eq!(status["cni_pods"][0]["pod"], "default/client", "{status}");
    assert_eq!(status["cni_pods"][0]["host_iface"], host.as_str());
    assert_eq!(
        status["cni_pods"][0]["addresses"],
        json!(["10.244.1.2", "fd00:10:244:1::2"])
    );

    // The pods reach each other across the overlay at once, both families.
    assert!(
        client_pod.ping(server_pod.ip, 2).unwrap(),
        "client -> server (IPv4)"
    );
    let server6 = server_pod.ip6.expect("dual stack");
    assert!(
        client_pod.ping(server6, 2).unwrap(),
        "client -> server (IPv6)"
    );
    assert!(
        server_pod.ping(client_pod.ip, 2).unwrap(),
        "server -> client"
    );

    // Directly and through a Service.
    let _backend = echo_backend(&server_pod, false).unwrap();
    let server_ip = server_pod.ip.to_string();
    topology
        .add_manifest("service.yaml", &SERVICE.replace("SERVER_IP", &server_ip))
        .unwrap();
    eventually(
        "client to the server and its Service",
        &[&server_ip, &server_ip],
        || {
            probe(
                &client_pod,
                &[("tcp", &server_ip, 8080), ("tcp", "10.96.0.80", 80)],
            )
            .unwrap_or_default()
        },
    );

    // A NetworkPolicy selecting the server by the labels of its Pod object isolates it.
    topology
        .add_manifest("policy.yaml", ISOLATE_SERVER)
        .unwrap();
    eventually(
        "client to the isolated server",
        &["timeout", "timeout"],
        || {
            probe(
                &client_pod,
                &[("tcp", &server_ip, 8080), ("tcp", "10.96.0.80", 80)],
            )
            .unwrap_or_default()
        },
    );
    topology.remove_manifest("policy.yaml").unwrap();
    eventually("client to the server again", &[&server_ip], || {
        probe(&client_pod, &[("tcp", &server_ip, 8080)]).unwrap_or_default()
    });

    // CHECK: the result ADD gave is what the pod has; a different one is an error.
    let mut check_conf = conf0.clone();
    check_conf["prevResult"] = client_result.clone();
    let checked = client.run("CHECK", &check_conf).unwrap();
    assert!(checked.success && checked.output.is_none(), "{checked:?}");
    check_conf["prevResult"]["ips"][0]["address"] = json!("10.244.1.99/32");
    let wrong = client.run("CHECK", &check_conf).unwrap();
    assert_eq!(wrong.code(), 103, "{wrong:?}");
    // CHECK sees a broken wiring: the pod's default route removed.
    dataplane_tests::topology::sh_in(&client.netns, "ip route del default").unwrap();
    check_conf["prevResult"] = client_result.clone();
    let broken = client.run("CHECK", &check_conf).unwrap();
    assert_eq!(broken.code(), 103, "{broken:?}");
    assert!(
        broken.message().contains("default route"),
        "{}",
        broken.message()
    );

    // The metrics count the requests by command and result, and time the answered ones.
    let metrics = metrics_text(&topology.node(0).netns);
    for (line, value) in [
        (
            "dataplane_cni_requests_total{command=\"ADD\",result=\"ok\"}",
            "1",
        ),
        // The wrong prevResult is the plugin's own finding: the agent's part of it held.
        (
            "dataplane_cni_requests_total{command=\"CHECK\",result=\"ok\"}",
            "2",
        ),
        (
            "dataplane_cni_requests_total{command=\"CHECK\",result=\"103\"}",
            "1",
        ),
        (
            "dataplane_cni_request_duration_seconds_count{command=\"ADD\"}",
            "1",
        ),
    ] {
        assert!(
            metrics.lines().any(|l| l == format!("{line} {value}")),
            "{line} {value} in {metrics}"
        );
    }

    // STATUS: ready. VERSION: the versions.
    let status = invoke(&[("CNI_COMMAND", "STATUS")], &conf0.to_string()).unwrap();
    assert!(status.success && status.output.is_none(), "{status:?}");
    let version = invoke(&[("CNI_COMMAND", "VERSION")], "{\"cniVersion\":\"1.1.0\"}").unwrap();
    assert_eq!(
        version.output.unwrap(),
        json!({"cniVersion": "1.1.0", "supportedVersions": ["0.4.0", "1.0.0", "1.1.0"]})
    );

    // DEL: the veth and the allocation go; again, and for a container never seen: success.
    for _ in 0..2 {
        let deleted = client.run("DEL", &conf0).unwrap();
        assert!(deleted.success && deleted.output.is_none(), "{deleted:?}");
    }
    assert!(allocations(&agent0).unwrap().is_empty());
    let veths = dataplane_tests::topology::exec_in(&topology.node(0).netns, &["ip", "-br", "link"])
        .unwrap();
    assert!(!String::from_utf8_lossy(&veths.stdout).contains(&host));
    let stranger = Container {
        id: "never-seen".into(),
        ..client.clone()
    };
    let deleted = stranger.run("DEL", &conf0).unwrap();
    assert!(deleted.success, "{deleted:?}");
    // The agents logged nothing alarming.
    for agent in [&agent0, &agent1] {
        assert!(!agent.log().contains("ERROR"), "{}", agent.log());
    }
}

/// What is run, the environment, stdin, the error code wanted, a word the message must have.
type ErrorCase = (
    &'static str,
    Vec<(&'static str, &'static str)>,
    String,
    u64,
    &'static str,
);

#[test]
fn plugin_errors_follow_the_specification() {
    // No agent needed: these fail before or at reaching it.
    let _ = dataplane_binary();
    let missing = std::path::Path::new("/nonexistent/dataplane/cni.sock");
    let good = conf("1.1.0", missing).to_string();
    let env = |command: &'static str| {
        vec![
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_NETNS", "/run/netns/none"),
            ("CNI_IFNAME", "eth0"),
        ]
    };
    let cases: Vec<ErrorCase> = vec![
        ("no command", vec![], good.clone(), 4, "CNI_COMMAND"),
        ("unknown command", vec![("CNI_COMMAND", "START")], good.clone(), 4, "CNI_COMMAND"),
        ("not JSON", env("ADD"), "{cniVersion".into(), 6, "not valid JSON"),
        (
            "old version",
            env("ADD"),
            json!({"cniVersion": "0.3.1", "name": "n", "type": "dataplane-cni"}).to_string(),
            1,
            "0.3.1",
        ),
        (
            "STATUS before 1.1.0",
            env("STATUS"),
            conf("1.0.0", missing).to_string(),
            1,
            "1.1.0",
        ),
        (
            "an ipam section",
            env("ADD"),
            json!({"cniVersion": "1.0.0", "name": "n", "type": "dataplane-cni", "ipam": {"type": "host-local"}}).to_string(),
            2,
            "ipam",
        ),
        (
            "no container id",
            vec![("CNI_COMMAND", "ADD"), ("CNI_NETNS", "/x"), ("CNI_IFNAME", "eth0")],
            good.clone(),
            4,
            "CNI_CONTAINERID",
        ),
        (
            "no netns for ADD",
            vec![("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", "c1"), ("CNI_IFNAME", "eth0")],
            good.clone(),
            4,
            "CNI_NETNS",
        ),
        ("malformed CNI_ARGS", {
            let mut e = env("ADD");
            e.push(("CNI_ARGS", "K8S_POD_NAME"));
            e
        }, good.clone(), 4, "CNI_ARGS"),
        ("agent unreachable (ADD)", env("ADD"), good.clone(), 11, "not reachable"),
        ("agent unreachable (DEL)", env("DEL"), good.clone(), 11, "not reachable"),
        ("agent unreachable (STATUS)", env("STATUS"), good.clone(), 50, "not reachable"),
        ("CHECK without prevResult", env("CHECK"), good.clone(), 7, "prevResult"),
    ];
    for (what, env, stdin, code, says) in cases {
        let answer = invoke(&env, &stdin).unwrap();
        assert!(!answer.success, "{what}: succeeded");
        let output = answer.output.as_ref().expect("an error document");
        assert_eq!(answer.code(), code, "{what}: {output}");
        assert!(
            output["msg"].as_str().unwrap().contains(says),
            "{what}: {output}"
        );
        assert!(output["cniVersion"].is_string(), "{what}: {output}");
        // Exactly the specification's keys.
        let keys: Vec<&String> = output.as_object().unwrap().keys().collect();
        assert!(
            keys.iter()
                .all(|k| ["cniVersion", "code", "msg", "details"].contains(&k.as_str())),
            "{what}: {output}"
        );
    }
}

#[test]
fn plugin_pods_survive_agent_restarts_and_gc_reclaims_killed_containers() {
    if !privileged("plugin_pods_survive_agent_restarts") {
        return;
    }
    let _ = dataplane_binary();
    let mut topology = Topology::build_with(1, 0, Mode::Overlay).expect("topology");
    let agent = topology.node(0).start_agent().expect("agent");
    let conf = conf("1.0.0", &cni::socket(&agent));
    // No Pod objects: the pods are judged as label-less pods of their namespace.
    let first = cni::container(&mut topology, "default", "first").unwrap();
    let second = cni::container(&mut topology, "default", "second").unwrap();
    let (first_pod, first_result) = add(&first, &conf).unwrap();
    let (second_pod, _) = add(&second, &conf).unwrap();
    assert_ne!(first_pod.ip, second_pod.ip);
    assert!(
        first_pod.ping(second_pod.ip, 2).unwrap(),
        "before the restart"
    );

    // ADD again for the same container (a runtime retrying): the same addresses.
    let (again, _) = add(&first, &conf).unwrap();
    assert_eq!((again.ip, again.ip6), (first_pod.ip, first_pod.ip6));
    assert!(
        first_pod.ping(second_pod.ip, 1).unwrap(),
        "after the repeated ADD"
    );

    // The agent stops: traffic keeps flowing on the pinned programs; ADD fails cleanly.
    let (pins, run_dir) = agent.stop_keeping_pins().unwrap();
    let _cleanup = dataplane_tests::topology::PinsCleanup(vec![pins.clone()]);
    assert!(
        first_pod.ping(second_pod.ip, 2).unwrap(),
        "while no agent runs"
    );
    let third = cni::container(&mut topology, "default", "third").unwrap();
    let refused = third.run("ADD", &conf).unwrap();
    assert_eq!(refused.code(), 11, "{refused:?}");
    let links = dataplane_tests::topology::exec_in(&third.netns, &["ip", "-br", "link"]).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&links.stdout).lines().count(),
        1,
        "the refused container got an interface"
    );

    // A new agent with the same state: the pods keep their addresses and their traffic.
    let agent = topology
        .node(0)
        .start_agent_at(pins, run_dir)
        .expect("restarted agent");
    let mut check = conf.clone();
    check["prevResult"] = first_result;
    let checked = first.run("CHECK", &check).unwrap();
    assert!(checked.success, "{checked:?}");
    assert!(
        first_pod.ping(second_pod.ip, 2).unwrap(),
        "after the restart"
    );
    let (third_pod, _) = add(&third, &conf).unwrap();
    assert!(![first_pod.ip, second_pod.ip].contains(&third_pod.ip));
    assert!(
        third_pod.ping(first_pod.ip, 1).unwrap(),
        "a pod added after the restart"
    );

    // The second container is killed without DEL (its namespace, and with it the veth
    // pair, is gone); GC with the attachments the runtime still has reclaims its address.
    let deleted = std::process::Command::new("ip")
        .args(["netns", "del", &second.netns])
        .status()
        .unwrap();
    assert!(deleted.success());
    let mut gc = conf.clone();
    gc["cniVersion"] = json!("1.1.0");
    gc["cni.dev/valid-attachments"] = json!([
        {"containerID": first.id, "ifname": "eth0"},
        {"containerID": third.id, "ifname": "eth0"},
    ]);
    let collected = invoke(
        &[("CNI_COMMAND", "GC"), ("CNI_PATH", "/opt/cni/bin")],
        &gc.to_string(),
    )
    .unwrap();
    assert!(collected.success, "{collected:?}");
    let mut held: Vec<String> = allocations(&agent)
        .unwrap()
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    held.sort();
    let mut want = vec![first.id.clone(), third.id.clone()];
    want.sort();
    assert_eq!(held, want);
    let second_ip = IpAddr::from(second_pod.ip).to_string();
    assert!(
        !allocations(&agent)
            .unwrap()
            .iter()
            .any(|(_, a)| a.iter().any(|a| a.starts_with(&format!("{second_ip}/")))),
        "the killed container's address is still held"
    );
    assert!(third_pod.ping(first_pod.ip, 1).unwrap(), "after GC");

    // A cluster state the agent cannot apply (a pod MTU the underlay cannot carry): the pod's
    // policy cannot be installed, so ADD is undone and fails; the container has no interface
    // and holds no address. Once the state is good again, the same ADD succeeds.
    topology.set_ovn_config("mtu: 9000").unwrap();
    let fourth = cni::container(&mut topology, "default", "fourth").unwrap();
    let refused = fourth.run("ADD", &conf).unwrap();
    assert_eq!(refused.code(), 102, "{refused:?}");
    assert!(refused.message().contains("mtu"), "{}", refused.message());
    let links = dataplane_tests::topology::exec_in(&fourth.netns, &["ip", "-br", "link"]).unwrap();
    assert_eq!(String::from_utf8_lossy(&links.stdout).lines().count(), 1);
    assert!(
        !allocations(&agent)
            .unwrap()
            .iter()
            .any(|(id, _)| *id == fourth.id)
    );
    topology.set_ovn_config("mtu: 1400").unwrap();
    let (fourth_pod, _) = add(&fourth, &conf).unwrap();
    assert!(
        fourth_pod.ping(first_pod.ip, 1).unwrap(),
        "after the state is good again"
    );
}

#[test]
fn plugin_wires_pods_with_the_cluster_from_an_api_server() {
    if !privileged("plugin_wires_pods_with_the_cluster_from_an_api_server") {
        return;
    }
    let _ = dataplane_binary();
    let mut topology = Topology::build_with(1, 0, Mode::Overlay).expect("topology");
    // Pod a's status still names the address of an earlier sandbox; b admits only app=a.
    topology
        .add_manifest(
            "pods.yaml",
            "apiVersion: v1\nkind: Pod\nmetadata: {name: a, namespace: default, labels: {app: a}}\n\
             spec: {nodeName: node0, containers: [{name: app, image: registry.k8s.io/pause:3.9}]}\n\
             status: {phase: Running, podIP: 10.244.1.77, podIPs: [{ip: 10.244.1.77}]}\n---\n\
             apiVersion: v1\nkind: Pod\nmetadata: {name: b, namespace: default, labels: {app: b}}\n\
             spec: {nodeName: node0, containers: [{name: app, image: registry.k8s.io/pause:3.9}]}\n---\n\
             apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
             metadata: {name: b-from-a, namespace: default}\n\
             spec: {podSelector: {matchLabels: {app: b}}, ingress: [{from: [{podSelector: {matchLabels: {app: a}}}]}]}\n",
        )
        .unwrap();
    let server = topology.node(0).start_fake_apiserver().expect("API server");
    let args = server.agent_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let agent = topology.node(0).start_agent_with(&args).expect("agent");
    let conf = conf("1.1.0", &cni::socket(&agent));

    let a = cni::container(&mut topology, "default", "a").unwrap();
    let b = cni::container(&mut topology, "default", "b").unwrap();
    // No Pod object: a pod without labels until one arrives.
    let c = cni::container(&mut topology, "default", "c").unwrap();
    let (a_pod, _) = add(&a, &conf).unwrap();
    let (b_pod, _) = add(&b, &conf).unwrap();
    let (c_pod, _) = add(&c, &conf).unwrap();
    // A new sandbox gets a new address: the stale status is not the pod's to keep.
    assert_eq!(a_pod.ip.to_string(), "10.244.1.2");
    // 10.244.1.3 is the node's hybrid overlay router (never a pod's).
    assert_eq!(b_pod.ip.to_string(), "10.244.1.4");
    assert!(a_pod.ping(b_pod.ip, 2).unwrap(), "a -> b: admitted");
    assert!(
        !c_pod.ping(b_pod.ip, 1).unwrap(),
        "c (no labels) -> b: isolated"
    );
    assert!(c_pod.ping(a_pod.ip, 1).unwrap(), "c -> a: not isolated");
    drop(agent);
    drop(server);
}

/// Sends `request` (the agent's socket protocol, JSON) straight to `socket`, as any local
/// client could without the plugin's own checks; the agent's reply.
fn ask_socket(socket: &std::path::Path, request: &[u8]) -> serde_json::Value {
    use std::io::{Read as _, Write as _};
    let mut stream = std::os::unix::net::UnixStream::connect(socket).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    // The agent stops reading a request that is too large and answers at once: the rest of
    // the write may find the socket closed.
    if stream.write_all(request).is_ok() {
        stream.shutdown(std::net::Shutdown::Write).unwrap();
    }
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).expect("read");
    serde_json::from_slice(&reply).expect("a JSON reply")
}

/// The code and message of a `Failed` reply.
fn refusal(reply: &serde_json::Value) -> (u64, String) {
    let failed = &reply["Failed"];
    assert!(failed.is_object(), "not refused: {reply}");
    (
        failed["code"].as_u64().unwrap(),
        failed["msg"].as_str().unwrap().to_owned(),
    )
}

fn link_exists(netns: &str, name: &str) -> bool {
    dataplane_tests::topology::exec_in(netns, &["ip", "link", "show", "dev", name])
        .unwrap()
        .status
        .success()
}

#[test]
fn hostile_requests_on_the_plugin_socket_are_refused_and_change_nothing() {
    if !privileged("hostile_requests_on_the_plugin_socket") {
        return;
    }
    let _ = dataplane_binary();
    let mut topology = Topology::build_with(1, 0, Mode::Overlay).expect("topology");
    topology.add_manifest("pods.yaml", PODS).unwrap();
    let agent = topology.node(0).start_agent().expect("agent");
    let socket = cni::socket(&agent);
    let node_netns = topology.node(0).netns.clone();
    let container = cni::container(&mut topology, "default", "client").unwrap();
    let add_request = |netns: &str, ifname: &str| {
        json!({"Add": {"container_id": "hostile", "netns": netns, "ifname": ifname, "pod": null}})
            .to_string()
    };

    // A newline in the interface name would be a second `ip` command in the node's namespace.
    let reply = ask_socket(
        &socket,
        add_request(&container.netns_path(), "eth0\nlink add evil0 type dummy").as_bytes(),
    );
    let (code, msg) = refusal(&reply);
    assert_eq!(code, 4, "{msg}");
    assert!(msg.contains("CNI_IFNAME"), "{msg}");
    assert!(
        !link_exists(&node_netns, "evil0"),
        "the injected command ran"
    );

    // The node's own namespace, by /proc and by its name: no "pod" interface lands there.
    let agent_pid = agent.pid().expect("agent pid");
    for netns in [
        format!("/proc/{agent_pid}/ns/net"),
        format!("/run/netns/{node_netns}"),
    ] {
        let (code, msg) = refusal(&ask_socket(&socket, add_request(&netns, "eth9").as_bytes()));
        assert_eq!(code, 4, "{netns}: {msg}");
        assert!(
            msg.contains("node's own network namespace"),
            "{netns}: {msg}"
        );
        assert!(
            !link_exists(&node_netns, "eth9"),
            "{netns}: wired into the node"
        );
    }
    // Any other file is no pod's namespace.
    for netns in [
        "/etc/hostname",
        "/run/netns/../../etc/hostname",
        "/proc/1/ns/mnt",
    ] {
        let (code, msg) = refusal(&ask_socket(&socket, add_request(netns, "eth0").as_bytes()));
        assert_eq!(code, 4, "{netns}: {msg}");
    }
    assert!(
        allocations(&agent).map(|a| a.is_empty()).unwrap_or(true),
        "a refused ADD kept an allocation"
    );

    // An oversized request is refused whole, not read into memory without end.
    let mut huge = br#"{"Gc": [["a", ""#.to_vec();
    huge.extend(std::iter::repeat_n(b'x', 2 << 20));
    huge.extend(br#""]]}"#);
    let (code, msg) = refusal(&ask_socket(&socket, &huge));
    assert_eq!(code, 6, "{msg}");
    assert!(msg.contains("larger than"), "{msg}");

    // A client that connects and says nothing holds nobody up, and is let go.
    let slow = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    let started = std::time::Instant::now();
    let status = ask_socket(&socket, br#""Status""#);
    assert_eq!(status, json!("Done"));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    {
        use std::io::Read as _;
        let mut slow = slow;
        slow.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut reply = Vec::new();
        slow.read_to_end(&mut reply).unwrap();
        let reply: serde_json::Value = serde_json::from_slice(&reply).unwrap();
        let (code, msg) = refusal(&reply);
        assert_eq!(code, 6, "{msg}");
        assert!(msg.contains("did not arrive whole"), "{msg}");
    }

    // A client that is not root is refused even where the socket's mode would let it in.
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let script = format!(
        "import os, socket\nos.setgid(65534)\nos.setuid(65534)\n\
         s = socket.socket(socket.AF_UNIX)\ns.connect({:?})\n\
         try:\n    s.sendall(b'\"Status\"')\n    s.shutdown(socket.SHUT_WR)\n\
         except BrokenPipeError:\n    pass\n\
         print(s.makefile('rb').read().decode())\n",
        socket.display().to_string()
    );
    let out = std::process::Command::new("python3")
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reply: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (code, msg) = refusal(&reply);
    assert_eq!(code, 4, "{msg}");
    assert!(msg.contains("only root"), "{msg}");

    // The agent is still serving: a proper ADD through the plugin wires the pod.
    let conf = conf("1.1.0", &socket);
    let (pod, _) = add(&container, &conf).expect("ADD after the hostile requests");
    assert_eq!(pod.ip, "10.244.1.2".parse::<std::net::Ipv4Addr>().unwrap());
    let log = agent.log();
    assert!(!log.contains("panicked"), "{log}");
}

/// Two bad Node objects (one without an address, one naming another node's pod CIDR): each is
/// refused alone, named and counted; every other node keeps its routes, and the plugin wires
/// pods on both good nodes, which reach each other across the overlay.
#[test]
fn bad_node_objects_are_refused_alone_and_pods_are_still_wired_everywhere() {
    if !privileged("bad_node_objects_are_refused_alone") {
        return;
    }
    let _ = dataplane_binary();
    let mut topology = Topology::build_with(2, 0, Mode::Overlay).expect("topology");
    topology.add_manifest("pods.yaml", PODS).unwrap();
    topology
        .add_manifest(
            "bad-nodes.yaml",
            "apiVersion: v1\nkind: Node\nmetadata: {name: zz-bare}\n\
             spec: {podCIDRs: [10.244.9.0/24]}\nstatus: {addresses: [{type: Hostname, address: bare}]}\n\
             ---\napiVersion: v1\nkind: Node\nmetadata: {name: zz-thief}\n\
             spec: {podCIDRs: [10.244.2.0/25]}\n\
             status: {addresses: [{type: InternalIP, address: 10.99.0.250}]}\n",
        )
        .unwrap();
    let agent0 = topology
        .node(0)
        .start_agent_with(&["--metrics-address", "127.0.0.1:9476"])
        .expect("agent 0");
    let agent1 = topology.node(1).start_agent().expect("agent 1");
    let mut client = cni::container(&mut topology, "default", "client").unwrap();
    client.uid = "uid-CLIENT".into();
    let mut server = cni::container(&mut topology, "default", "server").unwrap();
    server.uid = "uid-SERVER".into();
    let (client_pod, _) =
        add(&client, &conf("1.1.0", &cni::socket(&agent0))).expect("ADD on node 0");
    let (server_pod, _) =
        add(&server, &conf("1.1.0", &cni::socket(&agent1))).expect("ADD on node 1");
    assert!(
        client_pod.ping(server_pod.ip, 2).unwrap(),
        "client -> server"
    );
    assert!(
        server_pod.ping(client_pod.ip, 2).unwrap(),
        "server -> client"
    );
    for agent in [&agent0, &agent1] {
        let log = agent.log();
        assert!(
            log.contains("node zz-bare: status.addresses has no InternalIP"),
            "{log}"
        );
        assert!(
            log.contains("node zz-thief: spec.podCIDRs 10.244.2.0/25 is also the pod CIDR of node"),
            "{log}"
        );
    }
    let metrics = metrics_text(&topology.node(0).netns);
    assert!(
        metrics.contains("dataplane_rejected_objects{kind=\"node\"} 2"),
        "{metrics}"
    );
}

const SEGMENTED: &str = "\
apiVersion: v1
kind: Namespace
metadata: {name: blue, labels: {k8s.ovn.org/primary-user-defined-network: ''}}
---
apiVersion: k8s.ovn.org/v1
kind: UserDefinedNetwork
metadata: {name: tenant-blue, namespace: blue}
spec:
  topology: Layer3
  layer3:
    role: Primary
    subnets: [{cidr: 10.100.0.0/16, hostSubnet: 24}]
---
apiVersion: v1
kind: Namespace
metadata: {name: red, labels: {k8s.ovn.org/primary-user-defined-network: ''}}
---
apiVersion: v1
kind: Namespace
metadata: {name: green, labels: {k8s.ovn.org/primary-user-defined-network: ''}}
---
apiVersion: k8s.ovn.org/v1
kind: ClusterUserDefinedNetwork
metadata: {name: tenants}
spec:
  namespaceSelector:
    matchExpressions: [{key: kubernetes.io/metadata.name, operator: In, values: [green]}]
  network:
    topology: Layer2
    layer2: {role: Primary, subnets: [10.200.0.0/16]}
---
apiVersion: k8s.ovn.org/v1
kind: UserDefinedNetwork
metadata: {name: secondary, namespace: red}
spec:
  topology: Layer2
  layer2: {role: Secondary, subnets: [10.201.0.0/16]}
---
apiVersion: v1
kind: Namespace
metadata: {name: plain}
";

/// A namespace labelled for a primary user-defined network never gets a default-network
/// interface: its pods are refused, naming the network that selects it (not carried by this
/// dataplane yet) or its absence; an invalid network is rejected with its field named, and
/// the other namespaces' pods are wired as ever.
#[test]
fn pods_of_namespaces_labelled_for_a_user_defined_network_are_refused_by_name() {
    if !privileged("pods_of_namespaces_labelled_for_a_user_defined_network_are_refused") {
        return;
    }
    let _ = dataplane_binary();
    let mut topology = Topology::build_with(1, 0, Mode::Overlay).expect("topology");
    topology.add_manifest("segmented.yaml", SEGMENTED).unwrap();
    let agent = topology.node(0).start_agent().expect("agent");
    let conf = conf("1.1.0", &cni::socket(&agent));
    let cases = [
        (
            "blue",
            "takes the primary network UserDefinedNetwork blue/tenant-blue",
        ),
        (
            "green",
            "takes the primary network ClusterUserDefinedNetwork tenants",
        ),
        // Its only network is a Secondary one, rejected: nothing gives it a primary network.
        (
            "red",
            "no valid UserDefinedNetwork or ClusterUserDefinedNetwork",
        ),
    ];
    for (namespace, says) in cases {
        let pod = cni::container(&mut topology, namespace, "app").unwrap();
        let answer = pod.run("ADD", &conf).unwrap();
        assert_eq!(answer.code(), 105, "{namespace}: {answer:?}");
        let output = answer.output.expect("an error document");
        assert!(
            output["msg"].as_str().unwrap().contains(says),
            "{namespace}: {output}"
        );
    }
    // A pod of an unlabelled namespace is wired, and its allocation is the only one: the
    // refused pods took no address.
    let plain = cni::container(&mut topology, "plain", "app").unwrap();
    add(&plain, &conf).expect("ADD in an unlabelled namespace");
    assert_eq!(allocations(&agent).unwrap().len(), 1);
    // The Secondary network was refused by name, the valid ones were not.
    let log = agent.log();
    assert!(
        log.contains("spec.layer2.role: Secondary networks are not carried by this dataplane yet"),
        "{log}"
    );
    assert!(
        log.lines()
            .filter(|l| l.contains("manifest object rejected"))
            .all(|l| l.contains("name=\"secondary\"")),
        "{log}"
    );
}
