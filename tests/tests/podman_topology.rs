//! A real container runtime networks its containers through the plugin: podman 4.3 (CNI
//! backend) on two simulated nodes, each with its agent, the configuration the agent wrote
//! when it was ready, and the plugin binary. A web server container on node 1 is reached by
//! client containers on node 0 across the Geneve overlay, directly and through a Service, and
//! is isolated by a NetworkPolicy from the cluster state; removing a container releases its
//! address.

use std::time::Duration;

use dataplane_tests::{
    cni::{allocations, plugin_binary, start_agents_with_conf_dirs},
    podman::Podman,
    privileged::privileged,
    topology::{Mode, Topology, dataplane_binary},
    unique_name,
};

/// Retries a client container until `check` accepts what it printed (the agents follow
/// manifest changes within a second or two).
fn eventually(
    what: &str,
    mut attempt: impl FnMut() -> (bool, String),
    check: impl Fn(bool, &str) -> bool,
) {
    let mut last = String::new();
    for _ in 0..20 {
        let (ok, text) = attempt();
        if check(ok, &text) {
            return;
        }
        last = format!("success={ok} {text}");
        std::thread::sleep(Duration::from_millis(300));
    }
    panic!("{what}: last attempt gave {last}");
}

#[test]
fn podman_containers_are_networked_by_the_plugin_across_nodes() {
    if !privileged("podman_containers_are_networked_by_the_plugin_across_nodes") {
        return;
    }
    let _ = dataplane_binary();
    let topology = Topology::build_with(2, 0, Mode::Overlay).expect("topology");
    let web = unique_name("web");
    let client = unique_name("client");
    // podman names the pod after the container (K8S_POD_NAME) and no namespace: default.
    topology
        .add_manifest(
            "pods.yaml",
            &format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: {web}, namespace: default, labels: {{app: web}}}}\n\
                 spec: {{nodeName: node1, containers: [{{name: web, image: busybox}}]}}\n---\n\
                 apiVersion: v1\nkind: Pod\nmetadata: {{name: {client}, namespace: default, labels: {{app: client}}}}\n\
                 spec: {{nodeName: node0, containers: [{{name: client, image: busybox}}]}}\n"
            ),
        )
        .unwrap();
    let (agents, conf_dirs) = start_agents_with_conf_dirs(&topology, 2).expect("agents");
    let plugin_dir = plugin_binary().parent().unwrap().to_owned();
    let node0 = Podman::new(&conf_dirs[0], &plugin_dir).unwrap();
    let mut node1 = Podman::new(&conf_dirs[1], &plugin_dir).unwrap();

    node1
        .start(
            &web,
            "dataplane",
            &["/bin/httpd", "-f", "-p", "8080", "-h", "/www"],
        )
        .expect("web container");
    let web_ip = node1.address(&web, "dataplane").unwrap();
    assert_eq!(
        web_ip, "10.244.2.2",
        "the first free address of node 1's pod CIDR"
    );

    // An HTTP request from a client container on node 0 (busybox nc, 2 s to connect).
    let fetch = |address: &str, port: u16| {
        let request = format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {address} {port}");
        let out = node0
            .run(&client, "dataplane", &["/bin/sh", "-c", &request])
            .expect("client container");
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let served = |_: bool, text: &str| text.contains("hello from a container");
    let refused = |_: bool, text: &str| !text.contains("hello from a container");

    // Across the overlay, directly.
    eventually("client to web", || fetch(&web_ip, 8080), served);

    // Through a Service.
    topology
        .add_manifest(
            "service.yaml",
            &format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: default}}\n\
                 spec: {{clusterIP: 10.96.0.81, clusterIPs: [10.96.0.81], ports: [{{name: http, port: 80, protocol: TCP, targetPort: 8080}}]}}\n---\n\
                 apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
                 metadata: {{name: web-1, namespace: default, labels: {{kubernetes.io/service-name: web}}}}\n\
                 addressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}]\n\
                 endpoints:\n- addresses: [{web_ip}]\n  conditions: {{ready: true}}\n"
            ),
        )
        .unwrap();
    eventually(
        "client to the web Service",
        || fetch("10.96.0.81", 80),
        served,
    );

    // A NetworkPolicy admitting only pods labelled app=friend isolates the web server.
    topology
        .add_manifest(
            "policy.yaml",
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
             metadata: {name: web-from-friends, namespace: default}\n\
             spec:\n  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: friend}}}]\n",
        )
        .unwrap();
    eventually(
        "client to the isolated web",
        || fetch(&web_ip, 8080),
        refused,
    );
    eventually(
        "client to the isolated Service",
        || fetch("10.96.0.81", 80),
        refused,
    );
    topology.remove_manifest("policy.yaml").unwrap();
    eventually("client to web again", || fetch(&web_ip, 8080), served);

    // Every client container was removed (--rm: DEL); removing the web server releases its
    // address too.
    assert_eq!(allocations(&agents[0]).unwrap(), Vec::new());
    node1.remove(&web).unwrap();
    assert_eq!(allocations(&agents[1]).unwrap(), Vec::new());
    drop((node0, node1));
    drop(agents);
    for dir in conf_dirs {
        let _ = std::fs::remove_dir_all(dir);
    }
}
