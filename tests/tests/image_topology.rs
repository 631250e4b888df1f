//! The agent from its container image, run the way deploy/daemonset.yaml runs it: on each of
//! two simulated nodes, podman runs the image's init container (`install-cni` into the node's
//! plugin directory) and then the agent container with the DaemonSet's own arguments,
//! environment, privilege, host PID and mounts (read from the manifest, so the test follows
//! it), in the node's network namespace, against a stand-in API server. Pods are then created
//! by a real runtime (podman) through the plugin the init container installed, and reach each
//! other across the overlay. `cargo xtask test` builds the image first (`cargo xtask image`).
//!
//! What differs from a real node, and why: the two nodes share this machine's filesystem, so
//! each node's host paths are directories of its own (its bpffs directory, run directory,
//! plugin and configuration directories), and the plugin configuration's socket path is
//! translated to where that node's run directory is on the host; the agent reaches the
//! stand-in API server by a kubeconfig (`KUBECONFIG`) rather than a service account; and the
//! bpffs mount is a plain bind (Bidirectional needs the host's /sys/fs/bpf to be a shared
//! mount, and this machine's is private; its bpffs is mounted already).

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use dataplane_tests::{
    podman::Podman,
    privileged::privileged,
    topology::{Mode, Topology, node_name},
    unique_name,
};
use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::Container};

/// The image `cargo xtask image` builds.
const IMAGE: &str = "localhost/dataplane:dev";

fn daemonset() -> DaemonSet {
    let text = fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/daemonset.yaml"
    ))
    .expect("deploy/daemonset.yaml");
    serde_yaml::from_str(&text).expect("a DaemonSet")
}

/// podman as the tests run it (runc, cgroupfs, this machine's ulimits).
fn podman(conf: &Path) -> Command {
    dataplane_tests::podman::command(conf)
}

fn checked(command: &mut Command, what: &str) -> String {
    let out = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// podman's flags for `container`'s security context: privileged, or the capabilities it
/// drops and adds and its seccomp and AppArmor profiles.
fn security(container: &Container) -> Vec<String> {
    let Some(context) = &container.security_context else {
        return Vec::new();
    };
    if context.privileged == Some(true) {
        return vec!["--privileged".into()];
    }
    let mut out = Vec::new();
    if let Some(capabilities) = &context.capabilities {
        for drop in capabilities.drop.iter().flatten() {
            out.extend(["--cap-drop".into(), drop.clone()]);
        }
        for add in capabilities.add.iter().flatten() {
            out.extend(["--cap-add".into(), add.clone()]);
        }
    }
    if context.allow_privilege_escalation == Some(false) {
        out.extend(["--security-opt".into(), "no-new-privileges".into()]);
    }
    let unconfined = |kind: Option<&str>| kind == Some("Unconfined");
    if unconfined(context.seccomp_profile.as_ref().map(|p| p.type_.as_str())) {
        out.extend(["--security-opt".into(), "seccomp=unconfined".into()]);
    }
    if unconfined(context.app_armor_profile.as_ref().map(|p| p.type_.as_str())) {
        out.extend(["--security-opt".into(), "apparmor=unconfined".into()]);
    }
    out
}

/// One node's host paths standing for the DaemonSet's hostPath volumes.
struct NodeHost {
    base: PathBuf,
    /// hostPath -> this node's directory (or the machine's own, where nodes may share it).
    paths: BTreeMap<String, PathBuf>,
    bpffs: PathBuf,
}

impl NodeHost {
    fn new(index: usize) -> Self {
        let base = std::env::temp_dir().join(unique_name(&format!("image-node{index}")));
        let bpffs = PathBuf::from("/sys/fs/bpf").join(unique_name(&format!("image-node{index}")));
        fs::create_dir_all(&bpffs).expect("bpffs directory");
        let mut paths = BTreeMap::new();
        for (host, own) in [
            ("/run/dataplane", "run"),
            ("/var/log/ovn", "log"),
            ("/var/lib/dataplane", "state"),
            ("/opt/cni/bin", "cni-bin"),
            ("/etc/cni/net.d", "net.d"),
        ] {
            let dir = base.join(own);
            fs::create_dir_all(&dir).expect("node directory");
            paths.insert(host.to_owned(), dir);
        }
        paths.insert("/sys/fs/bpf".into(), bpffs.clone());
        // The machine's own: the kernel's view, the net sysctls (of the reader's namespace, the
        // node's) and the runtime's namespaces.
        for shared in [
            "/sys",
            "/sys/fs/cgroup",
            "/proc/sys/net",
            "/run/netns",
            "/var/run/netns",
        ] {
            paths.insert(shared.into(), PathBuf::from(shared));
        }
        Self { base, paths, bpffs }
    }

    /// podman's `-v` for each of `container`'s mounts of a hostPath volume of `set`.
    fn volumes(&self, set: &DaemonSet, container: &Container) -> Vec<String> {
        let pod = set
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .expect("pod spec");
        let mut out = Vec::new();
        for mount in container.volume_mounts.iter().flatten() {
            let volume = pod
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == mount.name)
                .expect("the mount's volume");
            let Some(host_path) = &volume.host_path else {
                // ConfigMap and Secret volumes are optional ones (the network configuration,
                // the probe key): the stand-in API server serves the Network, no egress IPs.
                continue;
            };
            let host = self
                .paths
                .get(&host_path.path)
                .unwrap_or_else(|| panic!("a node directory for hostPath {}", host_path.path));
            let propagation = match mount.mount_propagation.as_deref() {
                Some("HostToContainer") => ":rslave",
                _ => "",
            };
            let read_only = if mount.read_only == Some(true) {
                ":ro"
            } else {
                ""
            };
            out.push(format!(
                "{}:{}{read_only}{propagation}",
                host.display(),
                mount.mount_path
            ));
        }
        out
    }
}

impl Drop for NodeHost {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.base);
        let _ = Command::new("rm").arg("-rf").arg(&self.bpffs).status();
    }
}

/// A running agent container, removed on drop.
struct AgentContainer {
    name: String,
    conf: PathBuf,
}

impl AgentContainer {
    fn logs(&self) -> String {
        let out = podman(&self.conf)
            .args(["logs", &self.name])
            .output()
            .expect("podman logs");
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }
}

impl Drop for AgentContainer {
    fn drop(&mut self) {
        let _ = podman(&self.conf)
            .args(["rm", "--force", "--time", "5", &self.name])
            .output();
    }
}

#[test]
fn the_image_runs_as_the_daemonset_says_and_its_plugin_networks_pods_across_nodes() {
    if !privileged("the_image_runs_as_the_daemonset_says_and_its_plugin_networks_pods_across_nodes")
    {
        return;
    }
    let conf_dir = std::env::temp_dir().join(unique_name("image-podman"));
    fs::create_dir_all(&conf_dir).unwrap();
    let conf = conf_dir.join("containers.conf");
    fs::write(
        &conf,
        "[containers]\ndefault_ulimits = [\"nofile=1024:1024\", \"nproc=1024:1024\"]\n",
    )
    .unwrap();
    let exists = podman(&conf)
        .args(["image", "exists", IMAGE])
        .status()
        .expect("podman");
    assert!(exists.success(), "{IMAGE}: run `cargo xtask image` first");

    let set = daemonset();
    let pod_spec = set
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec")
        .clone();
    assert_eq!(pod_spec.host_network, Some(true));
    assert_eq!(pod_spec.host_pid, Some(true));
    let inits = pod_spec.init_containers.clone().unwrap_or_default();
    let agent = &pod_spec.containers[0];

    let topology = Topology::build_with(2, 0, Mode::Overlay).expect("topology");
    let web = unique_name("web");
    let client = unique_name("client");
    topology
        .add_manifest(
            "pods.yaml",
            &format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: {web}, namespace: default}}\n\
                 spec: {{nodeName: node1, containers: [{{name: web, image: busybox}}]}}\n---\n\
                 apiVersion: v1\nkind: Pod\nmetadata: {{name: {client}, namespace: default}}\n\
                 spec: {{nodeName: node0, containers: [{{name: client, image: busybox}}]}}\n"
            ),
        )
        .unwrap();
    let servers: Vec<_> = (0..2)
        .map(|n| topology.node(n).start_fake_apiserver().expect("API server"))
        .collect();
    let hosts: Vec<NodeHost> = (0..2).map(NodeHost::new).collect();
    let mut agents = Vec::new();
    for n in 0..2 {
        let node = topology.node(n);
        let network = format!("ns:/run/netns/{}", node.netns);
        // The init containers, in order: the pin root on a bpf filesystem (privileged), the
        // plugin into the node's plugin directory.
        for init in &inits {
            let mut run = podman(&conf);
            run.args(["run", "--rm", "--network", &network])
                .args(security(init));
            for volume in hosts[n].volumes(&set, init) {
                run.args(["-v", &volume]);
            }
            run.arg(IMAGE).args(init.args.iter().flatten());
            checked(&mut run, &format!("init container {}", init.name));
        }
        for plugin in ["dataplane-cni", "egress-router"] {
            assert!(
                hosts[n].paths["/opt/cni/bin"].join(plugin).exists(),
                "{plugin} installed"
            );
        }
        assert!(
            hosts[n].bpffs.join("dataplane").is_dir(),
            "the pin root prepared"
        );

        // The agent, with the DaemonSet's arguments ($(VAR) as the kubelet expands them).
        let mut env: BTreeMap<String, String> = BTreeMap::new();
        for var in agent.env.iter().flatten() {
            let value = match (&var.value, &var.value_from) {
                (Some(value), _) => value.clone(),
                (None, Some(from))
                    if from.field_ref.as_ref().map(|f| f.field_path.as_str())
                        == Some("spec.nodeName") =>
                {
                    node_name(n)
                }
                _ => panic!("env {} has a source this test does not know", var.name),
            };
            env.insert(var.name.clone(), value);
        }
        assert_eq!(
            env["UNDERLAY"], node.underlay_iface,
            "the test bed's uplink"
        );
        let args: Vec<String> = agent
            .args
            .iter()
            .flatten()
            .map(|a| {
                env.iter()
                    .fold(a.clone(), |a, (k, v)| a.replace(&format!("$({k})"), v))
            })
            .collect();
        let kubeconfig = servers[n].agent_args()[2].clone();
        let name = unique_name(&format!("agent{n}"));
        let mut run = podman(&conf);
        run.args(["run", "--detach", "--name", &name, "--network", &network])
            .args(["--pid", "host"])
            .args(security(agent))
            .args(["-v", &format!("{kubeconfig}:/kubeconfig:ro")])
            .args(["-e", "KUBECONFIG=/kubeconfig"]);
        for (k, v) in &env {
            run.args(["-e", &format!("{k}={v}")]);
        }
        for volume in hosts[n].volumes(&set, agent) {
            run.args(["-v", &volume]);
        }
        run.arg(IMAGE).args(&args);
        checked(&mut run, "the agent container");
        agents.push(AgentContainer {
            name,
            conf: conf.clone(),
        });
    }
    // Each agent writes the plugin's configuration once it serves it (its node is ready).
    for (n, host) in hosts.iter().enumerate() {
        let file = host.paths["/etc/cni/net.d"].join("10-dataplane.conflist");
        for _ in 0..300 {
            if file.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(file.exists(), "node {n}: {}", agents[n].logs());
        // The socket where this node's run directory is on the host.
        let text = fs::read_to_string(&file).unwrap();
        let host_socket = host.paths["/run/dataplane"].join("cni.sock");
        assert!(text.contains("/run/dataplane/cni.sock"), "{text}");
        fs::write(
            &file,
            text.replace(
                "/run/dataplane/cni.sock",
                &host_socket.display().to_string(),
            ),
        )
        .unwrap();
    }

    let node0 = Podman::new(
        &hosts[0].paths["/etc/cni/net.d"],
        &hosts[0].paths["/opt/cni/bin"],
    )
    .unwrap();
    let mut node1 = Podman::new(
        &hosts[1].paths["/etc/cni/net.d"],
        &hosts[1].paths["/opt/cni/bin"],
    )
    .unwrap();
    node1
        .start(
            &web,
            "dataplane",
            &["/bin/httpd", "-f", "-p", "8080", "-h", "/www"],
        )
        .unwrap_or_else(|e| panic!("web container: {e:#}\n{}", agents[1].logs()));
    let web_ip = node1.address(&web, "dataplane").unwrap();
    assert_eq!(web_ip, "10.244.2.2", "node 1's first pod address");
    let request = format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {web_ip} 8080");
    let mut last = String::new();
    for _ in 0..20 {
        let out = node0
            .run(&client, "dataplane", &["/bin/sh", "-c", &request])
            .expect("client container");
        last = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if last.contains("hello from a container") {
            break;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(
        last.contains("hello from a container"),
        "client on node 0 to the web server on node 1: {last}\n{}\n{}",
        agents[0].logs(),
        agents[1].logs()
    );
    drop(node0);
    drop(node1);
    drop(agents);
    drop(servers);
    let _ = fs::remove_dir_all(&conf_dir);
}
