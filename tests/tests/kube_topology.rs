//! The agents fed by an API server instead of a manifest directory: each node runs the real
//! agent with `--kubernetes` against a stand-in API server (`fake_apiserver`, list and watch
//! over HTTP, in the node's namespace) serving the topology's manifests. The test checks that
//! the watchers build the same cluster (a Service across nodes), that a bad object is named and
//! skipped while the rest applies, that a NetworkPolicy added through the API takes effect,
//! and that an API outage leaves the data path forwarding with the last good state until the
//! server is back, when the agent lists anew and catches up with what changed meanwhile.

use std::{
    collections::BTreeSet,
    thread,
    time::{Duration, Instant},
};

use dataplane_tests::{
    privileged::privileged,
    service_bed::{ServicePort, cluster_ip_manifests, echo_backend, probe},
    topology::{Mode, Pod, Topology},
};

const SERVICE_IP: &str = "10.96.0.60";

/// Probes the service from `client` until the answer is `want` or 30 s pass; returns the last
/// answer.
fn answer_becomes(client: &Pod, want: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let answer = probe(client, &[("tcp", SERVICE_IP, 80)])
            .expect("probe")
            .remove(0);
        if answer == want || Instant::now() > deadline {
            return answer;
        }
        thread::sleep(Duration::from_millis(300));
    }
}

fn isolate(backend: &Pod) -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
         metadata: {{name: isolate, namespace: default}}\n\
         spec: {{podSelector: {{matchLabels: {{pod: {}}}}}, policyTypes: [Ingress]}}\n",
        backend.name
    )
}

#[test]
fn agents_follow_an_api_server_through_changes_bad_objects_and_outages() {
    if !privileged("agents_follow_an_api_server_through_changes_bad_objects_and_outages") {
        return;
    }
    let topology = Topology::build_with(2, 1, Mode::Overlay).expect("build topology");
    let (client, backend) = (&topology.node(0).pods[0], &topology.node(1).pods[0]);
    let ports = [ServicePort {
        name: "http",
        port: 80,
        protocol: "TCP",
        target: 8080,
    }];
    topology
        .add_manifest(
            "web.yaml",
            &cluster_ip_manifests("web", SERVICE_IP, &ports, &[backend]),
        )
        .expect("service");
    topology
        .add_manifest(
            "bad.yaml",
            "apiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\n\
             metadata: {name: default, namespace: default}\n\
             spec: {egress: [{type: Deny, to: {cidrSelector: 10.0.0.300/8}}]}\n",
        )
        .expect("bad object");
    let server = echo_backend(backend, false).expect("backend");
    let mut servers: Vec<_> = (0..2)
        .map(|n| topology.node(n).start_fake_apiserver().expect("API server"))
        .collect();
    let agents: Vec<_> = (0..2)
        .map(|n| {
            let mut args = servers[n].agent_args();
            // No periodic full recompute: every change below but the re-list's comes through
            // the watch events alone.
            args.extend(["--full-sync-every-seconds".into(), "3600".into()]);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            topology.node(n).start_agent_with(&args).expect("agent")
        })
        .collect();

    // The watchers' cluster: the Service across nodes works; the bad object is named.
    assert_eq!(
        answer_becomes(client, &backend.ip.to_string()),
        backend.ip.to_string()
    );
    let log = agents[0].log();
    assert!(log.contains("API server lists received"), "{log}");
    assert!(
        log.contains("EgressFirewall default/default: spec.egress[0]"),
        "{log}"
    );
    // And told to its owner: one Warning Event on the object, from each agent.
    let events = |netns: &str| -> Vec<serde_json::Value> {
        let script = "import urllib.request\nprint(urllib.request.urlopen('http://127.0.0.1:6443/apis/events.k8s.io/v1/events', timeout=5).read().decode())\n";
        let out = dataplane_tests::topology::exec_in(netns, &["python3", "-c", script]).unwrap();
        let list: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
        list["items"].as_array().cloned().unwrap_or_default()
    };
    let mut told = Vec::new();
    for _ in 0..50 {
        told = events(&topology.node(0).netns);
        if !told.is_empty() {
            break;
        }
        thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(told.len(), 1, "{told:?}");
    let event = &told[0];
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["reason"], "Rejected");
    assert_eq!(event["reportingController"], "dataplane");
    assert_eq!(
        event["reportingInstance"],
        dataplane_tests::topology::node_name(0)
    );
    assert_eq!(event["regarding"]["kind"], "EgressFirewall");
    assert_eq!(event["regarding"]["namespace"], "default");
    assert_eq!(event["regarding"]["name"], "default");
    assert!(
        event["note"]
            .as_str()
            .unwrap()
            .starts_with("EgressFirewall default/default: spec.egress[0]"),
        "{event}"
    );

    // A policy added through the API isolates the backend.
    topology
        .add_manifest("policy.yaml", &isolate(backend))
        .expect("policy");
    assert_eq!(answer_becomes(client, "timeout"), "timeout");

    // The API servers go away, and the policy is deleted meanwhile: the agents keep the last
    // good state (the backend stays isolated) and the data path keeps forwarding.
    servers.clear();
    topology
        .remove_manifest("policy.yaml")
        .expect("delete policy");
    thread::sleep(Duration::from_secs(2));
    assert_eq!(
        probe(client, &[("tcp", SERVICE_IP, 80)]).expect("probe"),
        ["timeout"]
    );
    // (The isolated backend may still open connections; their replies are tracked.)
    assert!(
        backend.ping(client.ip, 2).expect("ping"),
        "pod to pod across nodes during the outage"
    );
    assert!(
        agents[1]
            .log()
            .contains("watch failed; retrying with backoff"),
        "{}",
        agents[1].log()
    );

    // Back: the watchers list anew (the new server does not know their resource versions) and
    // the deletion they missed applies.
    let servers: Vec<_> = (0..2)
        .map(|n| topology.node(n).start_fake_apiserver().expect("API server"))
        .collect();
    assert_eq!(
        answer_becomes(client, &backend.ip.to_string()),
        backend.ip.to_string(),
        "policy deletion applied after the outage:\n{}",
        agents[1].log()
    );
    assert!(agents[1].log().contains("watch restored"));
    // A re-list is followed by a full recompute (every stage, from a fresh parse).
    assert!(
        agents[1]
            .log()
            .contains("listed again; a full recompute follows"),
        "{}",
        agents[1].log()
    );

    // With the watches up, an addition and a deletion arrive as events, and the agents take
    // in those objects only: no full recompute among their syncs. (Each resource's watcher
    // comes back on its own backoff and lists again: first every one that failed has, and
    // the recomputes that follow are done.)
    let full_syncs = || agents[1].log().matches("full recompute").count();
    let all_restored = || {
        let log = agents[1].log();
        let resources = |what: &str| -> BTreeSet<String> {
            log.lines()
                .filter(|l| l.contains(what))
                .filter_map(|l| l.split("resource=\"").nth(1)?.split('"').next())
                .map(str::to_owned)
                .collect()
        };
        resources("watch failed").is_subset(&resources("watch restored"))
    };
    // Quiet means: every failed watch restored, and for 3 s no watch restored and no full
    // recompute begun (a watcher logs its restore, then its re-list, then the recompute runs:
    // the state is read fresh before each decision, so a restore seen late still waits).
    let restores = || agents[1].log().matches("watch restored").count();
    let mut settled = ((full_syncs(), restores()), Instant::now());
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let now = (full_syncs(), restores());
        if now != settled.0 {
            settled = (now, Instant::now());
        }
        let quiet = all_restored() && settled.1.elapsed() >= Duration::from_secs(3);
        if quiet || Instant::now() >= deadline {
            break;
        }
        thread::sleep(Duration::from_millis(200));
    }
    assert!(all_restored(), "{}", agents[1].log());
    topology
        .add_manifest("policy.yaml", &isolate(backend))
        .expect("policy");
    assert_eq!(answer_becomes(client, "timeout"), "timeout");
    topology
        .remove_manifest("policy.yaml")
        .expect("delete policy");
    assert_eq!(
        answer_becomes(client, &backend.ip.to_string()),
        backend.ip.to_string(),
        "policy deletion applied from its watch event:\n{}",
        agents[1].log()
    );
    assert_eq!(full_syncs(), settled.0.0, "{}", agents[1].log());
    drop(servers);
    drop(server);
}

#[test]
fn an_agent_announces_its_underlay_network_and_hybrid_router_on_its_own_node() {
    if !privileged("an_agent_announces_its_underlay_network_and_hybrid_router_on_its_own_node") {
        return;
    }
    let mut topology = Topology::build_with(1, 1, Mode::Overlay).expect("build topology");
    topology
        .set_ovn_config("hybridOverlayConfig: {hybridClusterNetwork: [{cidr: 10.132.0.0/14}]}")
        .expect("hybrid overlay on");
    let server = topology.node(0).start_fake_apiserver().expect("API server");
    let args = server.agent_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let agent = topology.node(0).start_agent_with(&args).expect("agent");
    // What the API server now says of node0 (read as any client would, over HTTP).
    let script = "import json, urllib.request\n\
                  nodes = json.load(urllib.request.urlopen('http://127.0.0.1:6443/api/v1/nodes'))\n\
                  node = [n for n in nodes['items'] if n['metadata']['name'] == 'node0'][0]\n\
                  print(json.dumps(node['metadata'].get('annotations', {}), sort_keys=True))\n";
    let deadline = Instant::now() + Duration::from_secs(15);
    let annotations = loop {
        let out =
            dataplane_tests::topology::exec_in(&topology.node(0).netns, &["python3", "-c", script])
                .expect("reading the Node");
        let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if text.contains("hybrid-overlay") || Instant::now() >= deadline {
            break text;
        }
        thread::sleep(Duration::from_millis(200));
    };
    // Node 0's pod subnet is 10.244.1.0/24: its router is the third address, its MAC 0a:58
    // and that address. Its underlay network and address, as OVN-Kubernetes writes them (the
    // egress IP controller assigns by them: no hand-made annotation needed).
    assert_eq!(
        annotations,
        "{\"k8s.ovn.org/hybrid-overlay-distributed-router-gateway-ip\": \"10.244.1.3\", \
         \"k8s.ovn.org/hybrid-overlay-distributed-router-gateway-mac\": \"0a:58:0a:f4:01:03\", \
         \"k8s.ovn.org/node-primary-ifaddr\": \"{\\\"ipv4\\\":\\\"10.99.0.1/24\\\",\\\"ipv6\\\":\\\"fd99::1/64\\\"}\"}",
        "{}",
        agent.log()
    );
    assert!(
        agent.log().contains("node annotations written"),
        "{}",
        agent.log()
    );
    drop(agent);
    drop(server);
}

#[test]
fn without_an_operator_network_agents_take_the_mounted_config_or_refuse_to_start() {
    if !privileged("without_an_operator_network_agents_take_the_mounted_config_or_refuse_to_start")
    {
        return;
    }
    let mut topology = Topology::build_with(2, 1, Mode::Overlay).expect("build topology");
    let (client, backend) = (
        topology.node(0).pods[0].clone(),
        topology.node(1).pods[0].clone(),
    );
    let ports = [ServicePort {
        name: "http",
        port: 80,
        protocol: "TCP",
        target: 8080,
    }];
    topology
        .add_manifest(
            "web.yaml",
            &cluster_ip_manifests("web", SERVICE_IP, &ports, &[&backend]),
        )
        .expect("service");
    // As on vanilla Kubernetes: the API server has no operator Network; deploy/network.yaml's
    // ConfigMap, mounted, holds it.
    let network = topology.network_elsewhere().expect("network file");
    let server = echo_backend(&backend, false).expect("backend");
    let servers: Vec<_> = (0..2)
        .map(|n| topology.node(n).start_fake_apiserver().expect("API server"))
        .collect();
    let args_of = |n: usize, config: bool| -> Vec<String> {
        let mut args = servers[n].agent_args();
        if config {
            args.extend(["--network-config".into(), network.display().to_string()]);
        }
        args
    };
    // Without it, the agent does not half work: it refuses to sync and says why.
    let name = dataplane_tests::unique_name("agent");
    let pins = dataplane_user::kernel::pins::Pins::new(format!("/sys/fs/bpf/{name}"));
    let run_dir = std::env::temp_dir().join(&name);
    let args = args_of(0, false);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let refused = topology
        .node(0)
        .start_agent_at_with(pins.clone(), run_dir.clone(), &args)
        .err()
        .expect("no configuration: the agent does not start");
    let _ = pins.remove_all();
    let _ = std::fs::remove_dir_all(&run_dir);
    assert!(
        format!("{refused:#}").contains(
            "no cluster network configuration: the API server has no operator.openshift.io/v1 Network and --network-config gives none"
        ),
        "{refused:#}"
    );
    // With it: the cluster's networks are known (the gateway masquerades pods leaving the
    // cluster) and pods reach a Service across nodes.
    let agents: Vec<_> = (0..2)
        .map(|n| {
            let args = args_of(n, true);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            topology.node(n).start_agent_with(&args).expect("agent")
        })
        .collect();
    assert_eq!(
        answer_becomes(&client, &backend.ip.to_string()),
        backend.ip.to_string()
    );
    let table = dataplane_tests::topology::exec_in(
        &topology.node(0).netns,
        &["nft", "list", "table", "inet", "dataplane_gateway"],
    )
    .expect("nft");
    assert!(
        String::from_utf8_lossy(&table.stdout).contains("10.244.0.0/16"),
        "{}",
        String::from_utf8_lossy(&table.stdout)
    );
    drop(agents);
    drop(servers);
    drop(server);
}

#[test]
fn the_controller_gives_nodes_without_pod_cidrs_their_subnets_and_their_pods_a_network() {
    if !privileged(
        "the_controller_gives_nodes_without_pod_cidrs_their_subnets_and_their_pods_a_network",
    ) {
        return;
    }
    let mut topology = Topology::build_with(1, 2, Mode::Overlay).expect("build topology");
    // As on OpenShift: Nodes without spec.podCIDRs. A node given its subnets by hand holds
    // the lowest ones; a Windows node takes a hybrid overlay subnet. The networks are where
    // the installer writes them (config.openshift.io/v1 Network), with its external IP
    // policy; the operator's Network holds only the overlay settings.
    topology
        .subnets_allocated()
        .expect("nodes without pod CIDRs");
    topology
        .network_as_on_openshift("192.0.2.0/24")
        .expect("OpenShift's networks");
    topology
        .set_ovn_config(
            "hybridOverlayConfig: {hybridClusterNetwork: [{cidr: 10.132.0.0/14, hostPrefix: 24}]}",
        )
        .expect("hybrid overlay");
    topology
        .add_manifest(
            "other-nodes.yaml",
            "apiVersion: v1\nkind: Node\nmetadata: {name: by-hand}\n\
             spec: {podCIDRs: [10.244.0.0/24, \"fd00:10:244::/64\"]}\n\
             ---\napiVersion: v1\nkind: Node\n\
             metadata: {name: win0, labels: {kubernetes.io/os: windows}}\n",
        )
        .expect("nodes");
    let (client, backend) = (&topology.node(0).pods[0], &topology.node(0).pods[1]);
    let ports = [ServicePort {
        name: "http",
        port: 80,
        protocol: "TCP",
        target: 8080,
    }];
    let web = cluster_ip_manifests("web", SERVICE_IP, &ports, &[backend]).replacen(
        "ports: [",
        "externalIPs: [192.0.2.80, 198.51.100.80], ports: [",
        1,
    );
    topology.add_manifest("web.yaml", &web).expect("service");
    let server = echo_backend(backend, false).expect("backend");
    let api = topology.node(0).start_fake_apiserver().expect("API server");
    let key = std::env::temp_dir().join(dataplane_tests::unique_name("probe-key"));
    std::fs::write(&key, "0123456789abcdef0123456789abcdef").expect("probe key");
    let controller_args = api.agent_args();
    let mut controller_args: Vec<&std::ffi::OsStr> =
        controller_args.iter().map(std::ffi::OsStr::new).collect();
    controller_args.extend(
        [
            "--probe-key-file".as_ref(),
            key.as_os_str(),
            "--identity".as_ref(),
            "controller-0".as_ref(),
            "--lease-namespace".as_ref(),
            "dataplane".as_ref(),
        ]
        .iter(),
    );
    let controller = dataplane_tests::egress_topology::spawn_controller_in(
        &topology.node(0).netns,
        &controller_args,
    );
    let args = api.agent_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let agent = topology.node(0).start_agent_with(&args).expect("agent");
    // The pods are in the subnet the controller gives node0 (10.244.1.0/24, the lowest free
    // one): once it is written, the agent wires them and the Service answers.
    assert_eq!(
        answer_becomes(client, &backend.ip.to_string()),
        backend.ip.to_string(),
        "{}\n{}",
        agent.log(),
        controller.log()
    );
    // The external IP the cluster Network's policy allows is served; the other is refused,
    // and the refusal says whose policy refused it.
    assert_eq!(
        probe(client, &[("tcp", "192.0.2.80", 80)]).expect("probe"),
        [backend.ip.to_string()]
    );
    assert!(
        agent.log().contains(
            "198.51.100.80 is outside the cluster Network's (config.openshift.io/v1) spec.externalIP.policy.allowedCIDRs"
        ) && !agent.log().contains("192.0.2.80 is"),
        "{}",
        agent.log()
    );
    let script = "import json, urllib.request\n\
                  nodes = json.load(urllib.request.urlopen('http://127.0.0.1:6443/api/v1/nodes'))\n\
                  for n in sorted(nodes['items'], key=lambda n: n['metadata']['name']):\n\
                  \x20   a = n['metadata'].get('annotations', {})\n\
                  \x20   print(n['metadata']['name'], a.get('k8s.ovn.org/node-subnets', '-'), a.get('k8s.ovn.org/hybrid-overlay-node-subnet', '-'))\n";
    let out =
        dataplane_tests::topology::exec_in(&topology.node(0).netns, &["python3", "-c", script])
            .expect("reading the Nodes");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .collect::<Vec<_>>(),
        [
            "by-hand - -",
            "node0 {\"default\":[\"10.244.1.0/24\",\"fd00:10:244:1::/64\"]} -",
            "win0 - 10.132.0.0/24",
        ],
        "{}",
        controller.log()
    );
    drop(controller);
    let _ = std::fs::remove_file(&key);
    drop(agent);
    drop(api);
    drop(server);
}

#[test]
fn agents_follow_paged_lists_expired_versions_and_ended_watches_without_losing_a_change() {
    if !privileged(
        "agents_follow_paged_lists_expired_versions_and_ended_watches_without_losing_a_change",
    ) {
        return;
    }
    let topology = Topology::build_with(2, 2, Mode::Overlay).expect("build topology");
    let (client, backend) = (&topology.node(0).pods[0], &topology.node(1).pods[0]);
    let ports = [ServicePort {
        name: "http",
        port: 80,
        protocol: "TCP",
        target: 8080,
    }];
    topology
        .add_manifest(
            "web.yaml",
            &cluster_ip_manifests("web", SERVICE_IP, &ports, &[backend]),
        )
        .expect("service");
    let server = echo_backend(backend, false).expect("backend");
    // As a real API server under load: lists one item a page (continue tokens), only the two
    // newest events kept (an older version is 410 Gone), every watch ended after a second.
    // First without bookmarks, so that watchers come back with versions the server has lost.
    let behaviour = [
        "--page-limit",
        "1",
        "--history-limit",
        "2",
        "--watch-timeout-seconds",
        "1",
    ];
    let servers: Vec<_> = (0..2)
        .map(|n| {
            topology
                .node(n)
                .start_fake_apiserver_with(&behaviour)
                .expect("API server")
        })
        .collect();
    let agents: Vec<_> = (0..2)
        .map(|n| {
            let mut args = servers[n].agent_args();
            args.extend(["--full-sync-every-seconds".into(), "3600".into()]);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            topology.node(n).start_agent_with(&args).expect("agent")
        })
        .collect();
    // Every list came in pages: the cluster is whole (two nodes, four pods, the Service).
    assert_eq!(
        answer_becomes(client, &backend.ip.to_string()),
        backend.ip.to_string(),
        "{}",
        agents[0].log()
    );
    // Churn elsewhere pushes every watcher's version out of the history: their next watch is
    // 410 Gone, and they list again.
    for round in 0..6 {
        topology
            .add_manifest(
                "churn.yaml",
                &format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: churn-{round}}}\n"),
            )
            .expect("churn");
        thread::sleep(Duration::from_millis(300));
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while !agents[0]
        .log()
        .contains("listed again; a full recompute follows")
        && Instant::now() < deadline
    {
        thread::sleep(Duration::from_millis(200));
    }
    assert!(
        agents[0]
            .log()
            .contains("listed again; a full recompute follows"),
        "{}",
        agents[0].log()
    );
    // A change made now is in force within 5 s, and so is its undoing: nothing lost among
    // the re-lists (and the agents' drop checks that no full recompute had anything to
    // write: nothing doubled or missed by the incremental syncs).
    topology
        .add_manifest("policy.yaml", &isolate(backend))
        .expect("policy");
    let started = Instant::now();
    assert_eq!(answer_becomes(client, "timeout"), "timeout");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    topology
        .remove_manifest("policy.yaml")
        .expect("delete policy");
    let started = Instant::now();
    assert_eq!(
        answer_becomes(client, &backend.ip.to_string()),
        backend.ip.to_string()
    );
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    drop(agents);
    drop(servers);

    // With bookmarks, a watcher's version keeps up with the server's even when its own
    // resource is quiet: ended watches come back where they were, with no re-list.
    let behaviour = [
        "--page-limit",
        "1",
        "--history-limit",
        "2",
        "--watch-timeout-seconds",
        "1",
        "--bookmark-every-ms",
        "100",
    ];
    let servers: Vec<_> = (0..2)
        .map(|n| {
            topology
                .node(n)
                .start_fake_apiserver_with(&behaviour)
                .expect("API server")
        })
        .collect();
    let agent = {
        let mut args = servers[0].agent_args();
        args.extend(["--full-sync-every-seconds".into(), "3600".into()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        topology.node(0).start_agent_with(&args).expect("agent")
    };
    thread::sleep(Duration::from_secs(3));
    assert!(
        !agent.log().contains("listed again"),
        "bookmarks keep the watches' versions current:\n{}",
        agent.log()
    );
    drop(agent);
    drop(servers);
    drop(server);
}

/// `GET` of `path` on the stand-in API server in `netns`: the object, or null when absent.
fn api_get(netns: &str, path: &str) -> serde_json::Value {
    let script = "import sys, urllib.request, urllib.error\n\
                  try:\n\
                  \x20   print(urllib.request.urlopen('http://127.0.0.1:6443' + sys.argv[1], timeout=3).read().decode())\n\
                  except urllib.error.HTTPError:\n\
                  \x20   print('null')\n";
    let out =
        dataplane_tests::topology::exec_in(netns, &["python3", "-c", script, path]).expect("GET");
    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
}

/// The `NetworkCreated` condition of the network at `path` once its message contains `want`
/// (waiting up to 20 s): (status, reason, message, observedGeneration); the last read if never.
fn network_created(netns: &str, path: &str, want: &str) -> (String, String, String, i64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let network = api_get(netns, path);
        let condition = network["status"]["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "NetworkCreated"))
            .cloned()
            .unwrap_or_default();
        let text = |field: &str| condition[field].as_str().unwrap_or_default().to_owned();
        let found = (
            text("status"),
            text("reason"),
            text("message"),
            condition["observedGeneration"].as_i64().unwrap_or(-1),
        );
        if found.2.contains(want) || Instant::now() > deadline {
            return found;
        }
        thread::sleep(Duration::from_millis(200));
    }
}

/// The controller's leader writes every user-defined network's `NetworkCreated` condition as
/// OVN-Kubernetes does (False / SyncError while this dataplane does not carry them), saying
/// why: the invalid field, the namespace label, the namespaces a selector picks; and writes it
/// again when that changes.
#[test]
fn the_controller_writes_why_each_user_defined_network_is_not_created() {
    if !privileged("the_controller_writes_why_each_user_defined_network_is_not_created") {
        return;
    }
    let topology = Topology::build_with(1, 0, Mode::Overlay).expect("build topology");
    let networks = "apiVersion: v1\nkind: Namespace\n\
                    metadata: {name: blue, labels: {k8s.ovn.org/primary-user-defined-network: ''}}\n\
                    ---\napiVersion: v1\nkind: Namespace\nmetadata: {name: green}\n\
                    ---\napiVersion: v1\nkind: Namespace\nmetadata: {name: red-1, labels: {tenant: red}}\n\
                    ---\napiVersion: k8s.ovn.org/v1\nkind: UserDefinedNetwork\n\
                    metadata: {name: tenant-blue, namespace: blue, generation: 1}\n\
                    spec: {topology: Layer3, layer3: {role: Primary, subnets: [{cidr: 10.20.0.0/16}]}}\n\
                    ---\napiVersion: k8s.ovn.org/v1\nkind: UserDefinedNetwork\n\
                    metadata: {name: secondary, namespace: green, generation: 1}\n\
                    spec: {topology: Layer2, layer2: {role: Secondary, subnets: [10.30.0.0/16]}}\n\
                    ---\napiVersion: k8s.ovn.org/v1\nkind: ClusterUserDefinedNetwork\n\
                    metadata: {name: red, generation: 2}\n\
                    spec:\n  namespaceSelector: {matchLabels: {tenant: red}}\n\
                    \x20 network: {topology: Layer2, layer2: {role: Primary, subnets: [10.50.0.0/16]}}\n";
    topology
        .add_manifest("networks.yaml", networks)
        .expect("networks");
    let node = topology.node(0);
    let api = node.start_fake_apiserver().expect("API server");
    let key = std::env::temp_dir().join(dataplane_tests::unique_name("probe-key"));
    std::fs::write(&key, "0123456789abcdef0123456789abcdef").expect("probe key");
    let args = api.agent_args();
    let mut args: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsStr::new).collect();
    args.extend(
        [
            "--probe-key-file".as_ref(),
            key.as_os_str(),
            "--identity".as_ref(),
            "controller-0".as_ref(),
            "--lease-namespace".as_ref(),
            "dataplane".as_ref(),
        ]
        .iter(),
    );
    let controller = dataplane_tests::egress_topology::spawn_controller_in(&node.netns, &args);
    let blue = "/apis/k8s.ovn.org/v1/namespaces/blue/userdefinednetworks/tenant-blue";
    let green = "/apis/k8s.ovn.org/v1/namespaces/green/userdefinednetworks/secondary";
    let red = "/apis/k8s.ovn.org/v1/clusteruserdefinednetworks/red";
    let not_carried = |namespaces: &str| {
        format!(
            "primary user-defined networks are not carried by this dataplane yet: the pods of {namespaces} get no interface (CNI error 105) rather than the default network"
        )
    };
    let sync_error = |message: String, generation: i64| {
        (
            "False".to_owned(),
            "SyncError".to_owned(),
            message,
            generation,
        )
    };
    assert_eq!(
        network_created(&node.netns, blue, "not carried"),
        sync_error(not_carried("namespace blue"), 1),
        "{}",
        controller.log()
    );
    assert_eq!(
        network_created(&node.netns, green, "invalid"),
        sync_error(
            "invalid: spec.layer2.role: Secondary networks are not carried by this dataplane yet (only Primary)".to_owned(),
            1
        ),
        "{}",
        controller.log()
    );
    let unlabelled = "namespaces red-1 lack the label k8s.ovn.org/primary-user-defined-network, which a primary network needs from the namespace's creation: their pods stay on the default network";
    assert_eq!(
        network_created(&node.netns, red, "lack the label"),
        sync_error(unlabelled.to_owned(), 2),
        "{}",
        controller.log()
    );
    // A second namespace selected, labelled: named as refused, beside the first.
    topology
        .add_manifest(
            "red-2.yaml",
            "apiVersion: v1\nkind: Namespace\n\
             metadata: {name: red-2, labels: {tenant: red, k8s.ovn.org/primary-user-defined-network: ''}}\n",
        )
        .expect("namespace");
    assert_eq!(
        network_created(&node.netns, red, "red-2"),
        sync_error(
            format!("{unlabelled}; {}", not_carried("namespaces red-2")),
            2
        ),
        "{}",
        controller.log()
    );
    drop(controller);
    let _ = std::fs::remove_file(&key);
    drop(api);
}
