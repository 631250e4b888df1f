//! Simulated nodes and pods in network namespaces, all created here and removed on drop.
//!
//! ```text
//!   fabric netns: bridge br0 ── n0 ┄┄ eth0 [node 0: 10.99.0.1] ── vp0 ┄┄ eth0 [pod 10.244.1.2]
//!                            └─ n1 ┄┄ eth0 [node 1: 10.99.0.2] ── vp0 ┄┄ eth0 [pod 10.244.2.2]
//! ```
//! Each node routes its pods' /32s to their veths (each host-side veth holds the pods' gateway
//! address 169.254.1.1/32) and the other nodes' pod CIDRs through their underlay address. The agent of a
//! node runs inside the node's network namespace but in the host's mount namespace, so its
//! pins are visible to the test process.

use std::{
    fs,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use dataplane_user::{Pins, kernel::stats::Counters};

/// One simulated pod: its own netns behind a veth whose host side lives in the node netns.
#[derive(Clone, Debug)]
pub struct Pod {
    pub netns: String,
    pub name: String,
    /// The Kubernetes namespace its Pod object is in.
    pub namespace: String,
    pub ip: Ipv4Addr,
    /// Overlay mode: the pod's IPv6 address (the cluster is dual-stack).
    pub ip6: Option<Ipv6Addr>,
    pub mac: [u8; 6],
    /// Host-side veth in the node's netns.
    pub host_iface: String,
}

/// One simulated node: a netns with an underlay NIC `eth0` on the fabric bridge.
#[derive(Clone, Debug)]
pub struct Node {
    pub index: usize,
    pub netns: String,
    pub underlay_iface: String,
    pub underlay_ip: Ipv4Addr,
    pub pods: Vec<Pod>,
    /// Overlay mode: the manifest directory the agent reads the cluster from.
    pub manifests: Option<PathBuf>,
}

/// How pod traffic crosses between nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Nodes route each other's pod CIDRs over the underlay (no overlay; the agents are given
    /// the pod veths on the command line).
    Routed,
    /// No routes between nodes' pod CIDRs: only the Geneve overlay carries pod traffic. The
    /// cluster is written as Kubernetes manifests that the agents read.
    Overlay,
}

pub struct Topology {
    pub nodes: Vec<Node>,
    pub mode: Mode,
    /// The namespace of the bridge joining the nodes (port `n<i>` leads to node i).
    pub fabric: String,
    /// Every namespace created, removed in reverse order on drop.
    namespaces: Vec<String>,
    /// Overlay mode: the manifests, removed on drop.
    manifests: Option<PathBuf>,
    /// More `ovnKubernetesConfig` fields for the operator Network (`set_ovn_config`).
    ovn_config_extra: String,
    /// More metadata fields for each Node object (`set_node_metadata`), by node index.
    node_metadata_extra: Vec<String>,
    /// The operator Network is not among the manifests ([`Topology::network_elsewhere`]).
    network_elsewhere: bool,
    /// The networks are in OpenShift's cluster configuration, with this external IP policy
    /// ([`Topology::network_as_on_openshift`]).
    openshift_external_ips: Option<String>,
    /// The Nodes carry no `spec.podCIDRs` ([`Topology::subnets_allocated`]).
    subnets_allocated: bool,
    /// Files the topology wrote outside its directories, removed with it.
    extra_files: Vec<PathBuf>,
    /// Nodes whose Node object says NotReady (`set_node_ready`).
    not_ready: Vec<usize>,
    /// The namespaces of the hosts on the fabric (`add_host`).
    hosts: Vec<String>,
    /// The fabric forwards in XDP (`switch_in_xdp`).
    switched_in_xdp: bool,
}

/// The address of the host outside the cluster (`Topology::add_external_host`).
pub const EXTERNAL_HOST_IP: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 100);

/// A host outside the cluster, on the nodes' underlay subnet.
#[derive(Clone, Debug)]
pub struct ExternalHost {
    pub netns: String,
    pub ip: Ipv4Addr,
}

/// MTU of the nodes' underlay veths (and their fabric ports), as an Ethernet NIC's.
pub const UNDERLAY_MTU: u32 = 1500;

/// Pod MTU in overlay mode: OVN-Kubernetes' default, the underlay MTU minus 100.
pub const OVERLAY_POD_MTU: u32 = UNDERLAY_MTU - 100;

pub fn underlay_ip(node: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 99, 0, node as u8 + 1)
}

pub fn pod_ip(node: usize, pod: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, node as u8 + 1, pod as u8 + 2)
}

pub fn pod_cidr(node: usize) -> String {
    format!("10.244.{}.0/24", node + 1)
}

pub fn underlay_ip6(node: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd99, 0, 0, 0, 0, 0, 0, node as u16 + 1)
}

pub fn pod_ip6(node: usize, pod: usize) -> Ipv6Addr {
    Ipv6Addr::new(
        0xfd00,
        0x10,
        0x244,
        node as u16 + 1,
        0,
        0,
        0,
        pod as u16 + 2,
    )
}

pub fn pod_cidr6(node: usize) -> String {
    format!("fd00:10:244:{}::/64", node + 1)
}

/// The pods' IPv6 gateway: a link-local address every host-side veth holds.
const POD_GATEWAY6: &str = "fe80::1";

const POD_GATEWAY: &str = "169.254.1.1";

impl Topology {
    /// Builds `nodes` nodes with `pods_per_node` pods each, pod CIDRs routed between nodes.
    pub fn build(nodes: usize, pods_per_node: usize) -> anyhow::Result<Self> {
        Self::build_with(nodes, pods_per_node, Mode::Routed)
    }

    /// Builds `nodes` nodes with `pods_per_node` pods each, joined as `mode` says.
    pub fn build_with(nodes: usize, pods_per_node: usize, mode: Mode) -> anyhow::Result<Self> {
        ensure!(nodes <= 200 && pods_per_node <= 200, "topology too large");
        let mut topology = Topology {
            nodes: Vec::new(),
            mode,
            fabric: String::new(),
            namespaces: Vec::new(),
            manifests: None,
            ovn_config_extra: String::new(),
            node_metadata_extra: Vec::new(),
            network_elsewhere: false,
            openshift_external_ips: None,
            subnets_allocated: false,
            extra_files: Vec::new(),
            not_ready: Vec::new(),
            hosts: Vec::new(),
            switched_in_xdp: false,
        };
        let fabric = topology.add_namespace("fab")?;
        topology.fabric = fabric.clone();
        sh_in(&fabric, "ip link add br0 type bridge")?;
        sh_in(&fabric, "ip link set br0 up")?;
        // The fabric stands for the switch between the nodes: it forwards frames and runs no
        // firewall. With bridge netfilter on (this kernel's default), every bridged frame
        // went through the fabric's IP hooks and a route lookup: a quarter of a NodePort
        // packet's CPU time, charged to every path alike.
        sh_in(
            &fabric,
            "sysctl -qw net.bridge.bridge-nf-call-iptables=0 \
             net.bridge.bridge-nf-call-ip6tables=0 net.bridge.bridge-nf-call-arptables=0",
        )?;

        for n in 0..nodes {
            let netns = topology.add_namespace(&format!("n{n}"))?;
            ip(&format!(
                "link add eth0 netns {netns} mtu {UNDERLAY_MTU} type veth \
                 peer name n{n} netns {fabric} mtu {UNDERLAY_MTU}"
            ))?;
            sh_in(&fabric, &format!("ip link set n{n} master br0 up"))?;
            // A queue on the wire side, as a switch port has: veth then pushes back on the
            // sender when the node's XDP receive ring is full, instead of dropping the burst.
            sh_in(
                &fabric,
                &format!("tc qdisc replace dev n{n} root pfifo limit 1000"),
            )?;
            sh_in(
                &netns,
                &format!("ip addr add {}/24 dev eth0", underlay_ip(n)),
            )?;
            sh_in(&netns, "ip link set eth0 up")?;
            // Receive offload on, as NICs ship it (veth ships it off): the stack then merges
            // the wire-sized frames that XDP passes up, decapsulated or not.
            sh_in(&netns, "ethtool -K eth0 gro on")?;
            sh_in(&netns, "sysctl -qw net.ipv4.ip_forward=1")?;
            if mode == Mode::Overlay {
                let address = format!("ip addr add {}/64 dev eth0 nodad", underlay_ip6(n));
                sh_in(&netns, &address)?;
                sh_in(&netns, "sysctl -qw net.ipv6.conf.all.forwarding=1")?;
            }
            topology.nodes.push(Node {
                index: n,
                netns,
                underlay_iface: "eth0".into(),
                underlay_ip: underlay_ip(n),
                pods: Vec::new(),
                manifests: None,
            });
        }
        let ports: Vec<String> = (0..nodes).map(|n| format!("n{n}")).collect();
        attach_wire_xdp(&fabric, &ports)?;
        for n in 0..nodes {
            let netns = topology.nodes[n].netns.clone();
            for other in (0..nodes).filter(|o| *o != n && mode == Mode::Routed) {
                let route = format!(
                    "ip route add {} via {}",
                    pod_cidr(other),
                    underlay_ip(other)
                );
                sh_in(&netns, &route)?;
            }
            for p in 0..pods_per_node {
                let pod = topology.add_pod(n, p)?;
                topology.nodes[n].pods.push(pod);
            }
        }
        if mode == Mode::Overlay {
            let dir = std::env::temp_dir().join(crate::unique_name("manifests"));
            fs::create_dir_all(&dir)?;
            fs::write(dir.join("cluster.yaml"), topology.manifests_yaml())?;
            for node in &mut topology.nodes {
                node.manifests = Some(dir.clone());
            }
            topology.manifests = Some(dir);
        }
        Ok(topology)
    }

    /// Adds a host outside the cluster on the fabric (the nodes' underlay subnet) at
    /// 10.99.0.100: an external client for NodePorts. Its namespace goes with the topology.
    pub fn add_external_host(&mut self) -> anyhow::Result<ExternalHost> {
        self.add_host("ext", EXTERNAL_HOST_IP)
    }

    /// Adds a host named after `suffix` on the fabric at `address` (in the nodes' underlay
    /// subnet), with complete checksums on its wire. Its namespace goes with the topology.
    pub fn add_host(&mut self, suffix: &str, address: Ipv4Addr) -> anyhow::Result<ExternalHost> {
        ensure!(
            !self.switched_in_xdp,
            "hosts join the fabric before it switches in XDP"
        );
        let netns = self.add_namespace(suffix)?;
        let fabric = self.fabric.clone();
        let port = format!("{suffix}0");
        ip(&format!(
            "link add eth0 netns {netns} type veth peer name {port} netns {fabric}"
        ))?;
        sh_in(&fabric, &format!("ip link set {port} master br0 up"))?;
        sh_in(&netns, &format!("ip addr add {address}/24 dev eth0"))?;
        sh_in(&netns, "ip link set eth0 up")?;
        // Complete checksums, as every packet that crossed a real wire carries: over veth a
        // local sender would otherwise leave them to an offload that never happens, which
        // only the receiving host's own stack forgives.
        sh_in(&netns, "ethtool -K eth0 tx off")?;
        self.hosts.push(netns.clone());
        Ok(ExternalHost { netns, ip: address })
    }

    /// Makes the fabric's node ports ordinary bridge ports, as the host's side of a kind or
    /// k3d node's veth is: no XDP program and no GRO, so that a frame a node's XDP sends back
    /// out of its uplink (XDP_TX) is dropped there, as on those clusters.
    pub fn plain_fabric_ports(&self) -> anyhow::Result<()> {
        for node in &self.nodes {
            let port = format!("n{}", node.index);
            run_in(
                &self.fabric,
                &["ip", "link", "set", "dev", &port, "xdpdrv", "off"],
            )?;
            run_in(&self.fabric, &["ethtool", "-K", &port, "gro", "off"])?;
        }
        Ok(())
    }

    /// Makes the fabric forward unicast frames in XDP (`xdp_fabric_switch`, see its module),
    /// as a hardware switch would, at no cost to the nodes: a frame a node's XDP sends back
    /// reaches the next node as an XDP frame, which that node's XDP reads in place. The bridge
    /// stays for what the switch passes (broadcast, multicast, not yet learned). So that
    /// every frame on the wire is whole, as it is past a NIC, the nodes complete their
    /// checksums before sending (`tx off`: an XDP frame carries no checksum-offload state,
    /// which the bridge's socket buffers kept); the hosts' ends poll (GRO on) to take frames
    /// from XDP. Call after the last `add_host`.
    pub fn switch_in_xdp(&mut self) -> anyhow::Result<()> {
        for node in &self.nodes {
            sh_in(&node.netns, "ethtool -K eth0 tx off")?;
        }
        for host in &self.hosts {
            sh_in(host, "ethtool -K eth0 gro on")?;
        }
        let ports = bridge_ports(&self.fabric)?;
        let mut testbed = crate::testbed::Testbed::load()?;
        let mut devices: aya::maps::DevMapHash<_> =
            testbed.typed_map(dataplane_common::testbed::FABRIC_PORTS)?;
        // A device map resolves each ifindex in the namespace of the thread that writes it.
        in_netns(&self.fabric, || {
            for (_, ifindex) in &ports {
                devices
                    .insert(*ifindex, *ifindex, None, 0)
                    .with_context(|| format!("fabric port {ifindex} into the device map"))?;
            }
            Ok(())
        })?;
        let names: Vec<String> = ports.into_iter().map(|(name, _)| name).collect();
        attach_pinned_xdp(
            &mut testbed,
            dataplane_common::testbed::PROG_FABRIC_SWITCH,
            &self.fabric,
            &names,
        )?;
        self.switched_in_xdp = true;
        Ok(())
    }

    /// Adds `fields` (YAML flow-mapping entries, e.g. `policyAuditConfig: {rateLimit: 5}`) to
    /// the operator Network's `ovnKubernetesConfig`, rewriting the cluster manifest.
    pub fn set_ovn_config(&mut self, fields: &str) -> anyhow::Result<()> {
        self.ovn_config_extra = format!(", {fields}");
        self.rewrite_manifests()
    }

    /// Adds `fields` (YAML flow-mapping entries, e.g. `labels: {a: b}`) to every Node's
    /// metadata, `{ip}` and `{ip6}` standing for the node's underlay addresses; rewrites the cluster
    /// manifest. Overlay mode only.
    pub fn set_node_metadata(&mut self, fields: &str) -> anyhow::Result<()> {
        self.node_metadata_extra = vec![format!(", {fields}"); self.nodes.len()];
        self.rewrite_manifests()
    }

    /// As [`Topology::set_node_metadata`], for one node (`fields` may be empty).
    pub fn set_node_metadata_of(&mut self, node: usize, fields: &str) -> anyhow::Result<()> {
        self.node_metadata_extra
            .resize(self.nodes.len(), String::new());
        self.node_metadata_extra[node] = if fields.is_empty() {
            String::new()
        } else {
            format!(", {fields}")
        };
        self.rewrite_manifests()
    }

    /// Makes node `node`'s object say Ready or NotReady (its Ready condition); rewrites the
    /// cluster manifest. Overlay mode only.
    pub fn set_node_ready(&mut self, node: usize, ready: bool) -> anyhow::Result<()> {
        self.not_ready.retain(|n| *n != node);
        if !ready {
            self.not_ready.push(node);
        }
        self.rewrite_manifests()
    }

    /// Writes the cluster manifest again from the topology as it is now.
    pub fn rewrite_manifests(&self) -> anyhow::Result<()> {
        let dir = self
            .manifests
            .clone()
            .context("manifests exist in overlay mode only")?;
        fs::write(dir.join("cluster.yaml"), self.manifests_yaml())?;
        Ok(())
    }

    /// The operator `Network` of the cluster (its networks and overlay settings).
    fn network_yaml(&self) -> String {
        const NETWORKS: &str = "  clusterNetwork: [{cidr: 10.244.0.0/16, hostPrefix: 24}, {cidr: \"fd00:10:244::/48\", hostPrefix: 64}]\n\
             \x20 serviceNetwork: [10.96.0.0/16, \"fd00:10:96::/112\"]\n";
        let mut yaml = String::new();
        if let Some(external_ips) = &self.openshift_external_ips {
            // As OpenShift's installer writes them: the networks in the cluster configuration,
            // the operator's Network holding the plugin's settings only.
            yaml.push_str(&format!(
                "apiVersion: config.openshift.io/v1\nkind: Network\nmetadata: {{name: cluster}}\n\
                 spec:\n{NETWORKS}  networkType: Dataplane\n  externalIP: {{policy: {{allowedCIDRs: [{external_ips}]}}}}\n---\n"
            ));
        }
        yaml.push_str("apiVersion: operator.openshift.io/v1\nkind: Network\nmetadata: {name: cluster}\nspec:\n");
        if self.openshift_external_ips.is_none() {
            yaml.push_str(NETWORKS);
        }
        yaml.push_str("  defaultNetwork:\n    type: OVNKubernetes\n");
        yaml.push_str(&format!(
            "    ovnKubernetesConfig: {{genevePort: 6081{}}}\n",
            self.ovn_config_extra
        ));
        yaml
    }

    /// Writes the cluster's networks as OpenShift's installer does: in a
    /// `config.openshift.io/v1 Network` (with `external_ips` as its external IP policy's
    /// allowed CIDRs), the operator's `Network` holding only the overlay settings. Rewrites
    /// the cluster manifest. Overlay mode only.
    pub fn network_as_on_openshift(&mut self, external_ips: &str) -> anyhow::Result<()> {
        self.openshift_external_ips = Some(external_ips.to_owned());
        self.rewrite_manifests()
    }

    /// Writes the Nodes without `spec.podCIDRs`, as on OpenShift, where the cluster manager
    /// (here the controller) allocates them; rewrites the cluster manifest. Overlay mode only.
    pub fn subnets_allocated(&mut self) -> anyhow::Result<()> {
        self.subnets_allocated = true;
        self.rewrite_manifests()
    }

    /// Takes the operator `Network` out of the cluster's manifests (so an API server serving
    /// them has none, as on vanilla Kubernetes) and writes it to a file of its own, as
    /// deploy/network.yaml's ConfigMap is mounted; returns that file's path (it goes with the
    /// topology). Overlay mode only.
    pub fn network_elsewhere(&mut self) -> anyhow::Result<PathBuf> {
        let dir = self
            .manifests
            .clone()
            .context("manifests exist in overlay mode only")?;
        self.network_elsewhere = true;
        self.rewrite_manifests()?;
        let path = dir.with_extension("network.yaml");
        fs::write(&path, self.network_yaml())?;
        self.extra_files.push(path.clone());
        Ok(path)
    }

    /// The manifest directory (overlay mode).
    pub fn manifest_dir(&self) -> Option<&std::path::Path> {
        self.manifests.as_deref()
    }

    /// Moves a pod's object to another Kubernetes namespace (rewriting the cluster manifest);
    /// agents started afterwards see it there. Overlay mode only.
    pub fn set_pod_namespace(
        &mut self,
        node: usize,
        pod: usize,
        namespace: &str,
    ) -> anyhow::Result<()> {
        self.nodes[node].pods[pod].namespace = namespace.to_owned();
        self.rewrite_manifests()
    }

    /// Routes every node's pod CIDR through that node on `external`, as the cluster's router
    /// would (so pods can be reached from outside and answered).
    pub fn route_pod_networks(&self, external: &ExternalHost) -> anyhow::Result<()> {
        for node in &self.nodes {
            let route = format!(
                "ip route add {} via {}",
                pod_cidr(node.index),
                node.underlay_ip
            );
            sh_in(&external.netns, &route)?;
        }
        Ok(())
    }

    /// Adds a manifest file (Services, EndpointSlices, ...) next to the generated cluster
    /// state; agents started afterwards read it. Overlay mode only.
    pub fn add_manifest(&self, file_name: &str, yaml: &str) -> anyhow::Result<()> {
        let dir = self
            .manifests
            .as_ref()
            .context("manifests exist in overlay mode only")?;
        fs::write(dir.join(file_name), yaml)?;
        Ok(())
    }

    /// Removes a manifest file added with [`Topology::add_manifest`].
    pub fn remove_manifest(&self, file_name: &str) -> anyhow::Result<()> {
        let dir = self
            .manifests
            .as_ref()
            .context("manifests exist in overlay mode only")?;
        fs::remove_file(dir.join(file_name))?;
        Ok(())
    }

    /// The cluster as Kubernetes objects: the operator Network, one Node per node (InternalIP,
    /// podCIDRs), one Pod per pod (nodeName, podIPs, OVN-Kubernetes' pod-networks annotation).
    fn manifests_yaml(&self) -> String {
        let mut yaml = if self.network_elsewhere {
            // Nodes' documents below start with a separator.
            String::from("apiVersion: v1\nkind: Namespace\nmetadata: {name: kube-system}\n")
        } else {
            self.network_yaml()
        };
        for node in &self.nodes {
            yaml.push_str(&format!(
                "---\napiVersion: v1\nkind: Node\nmetadata: {{name: {name}{extra}}}\n\
                 spec: {spec}\n\
                 status: {{addresses: [{{type: InternalIP, address: {ip}}}, {{type: InternalIP, address: \"{ip6}\"}}, {{type: Hostname, address: {name}}}]{conditions}}}\n",
                name = node_name(node.index),
                spec = if self.subnets_allocated {
                    "{}".to_owned()
                } else {
                    format!(
                        "{{podCIDR: {cidr}, podCIDRs: [{cidr}, \"{cidr6}\"]}}",
                        cidr = pod_cidr(node.index),
                        cidr6 = pod_cidr6(node.index)
                    )
                },
                ip = node.underlay_ip,
                ip6 = underlay_ip6(node.index),
                conditions = if self.not_ready.contains(&node.index) {
                    ", conditions: [{type: Ready, status: 'False', reason: KubeletNotReady}]"
                } else {
                    ""
                },
                extra = self
                    .node_metadata_extra
                    .get(node.index)
                    .map(|e| {
                        e.replace("{ip}", &node.underlay_ip.to_string())
                            .replace("{ip6}", &underlay_ip6(node.index).to_string())
                    })
                    .unwrap_or_default(),
            ));
            for pod in &node.pods {
                let mac = crate::packets::mac_text(&pod.mac);
                yaml.push_str(&format!(
                    "---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {namespace}\n  labels: {{pod: {name}}}\n\
                     \x20 annotations:\n    k8s.ovn.org/pod-networks: '{{\"default\":{{\"ip_addresses\":[\"{ip}/24\"],\"mac_address\":\"{mac}\"}}}}'\n\
                     spec: {{nodeName: {node}, containers: [{{name: app, image: registry.k8s.io/pause:3.9}}]}}\n\
                     status: {{phase: Running, podIP: {ip}, podIPs: [{{ip: {ip}}}{v6}]}}\n",
                    name = pod.name,
                    namespace = pod.namespace,
                    ip = pod.ip,
                    v6 = pod.ip6.map(|a| format!(", {{ip: \"{a}\"}}")).unwrap_or_default(),
                    node = node_name(node.index),
                ));
            }
        }
        yaml
    }

    /// A network namespace for a pod the CNI plugin wires (removed with the topology).
    pub fn add_pod_netns(&mut self, suffix: &str) -> anyhow::Result<String> {
        self.add_namespace(suffix)
    }

    fn add_namespace(&mut self, suffix: &str) -> anyhow::Result<String> {
        let name = crate::unique_name(suffix);
        ip(&format!("netns add {name}"))?;
        self.namespaces.push(name.clone());
        sh_in(&name, "ip link set lo up")?;
        Ok(name)
    }

    fn add_pod(&mut self, node: usize, index: usize) -> anyhow::Result<Pod> {
        let node_ns = self.nodes[node].netns.clone();
        let netns = self.add_namespace(&format!("n{node}p{index}"))?;
        let host_iface = format!("vp{index}");
        let ip_addr = pod_ip(node, index);
        let o = ip_addr.octets();
        // OVN-Kubernetes derives pod MACs from the IPv4 address.
        let mac = [0x0a, 0x58, o[0], o[1], o[2], o[3]];
        ip(&format!(
            "link add eth0 netns {netns} type veth peer name {host_iface} netns {node_ns}"
        ))?;
        if self.mode == Mode::Overlay {
            let mac_text = crate::packets::mac_text(&mac);
            sh_in(
                &netns,
                &format!("ip link set eth0 address {mac_text} mtu {OVERLAY_POD_MTU}"),
            )?;
        }
        sh_in(&netns, &format!("ip addr add {ip_addr}/32 dev eth0"))?;
        sh_in(&netns, "ip link set eth0 up")?;
        sh_in(
            &netns,
            &format!("ip route add {POD_GATEWAY} dev eth0 scope link"),
        )?;
        sh_in(
            &netns,
            &format!("ip route add default via {POD_GATEWAY} dev eth0"),
        )?;
        // The host side answers for the pods' gateway itself (the same /32 on every pod veth).
        sh_in(
            &node_ns,
            &format!("ip addr add {POD_GATEWAY}/32 dev {host_iface}"),
        )?;
        sh_in(&node_ns, &format!("ip link set {host_iface} up"))?;
        // As the CNI plugin wires a pod: GRO on at the pod's end (it then polls, and takes
        // frames the node's XDP hands it), said on the host side for the agent.
        sh_in(&netns, "ethtool -K eth0 gro on")?;
        let alias = dataplane_user::kernel::netdev::TAKES_XDP_ALIAS;
        sh_in(&node_ns, &format!("ip link set {host_iface} alias {alias}"))?;
        let ip6 = (self.mode == Mode::Overlay).then(|| pod_ip6(node, index));
        if let Some(ip6) = ip6 {
            sh_in(&netns, &format!("ip -6 addr add {ip6}/128 dev eth0 nodad"))?;
            let gateway6 = format!("ip -6 addr add {POD_GATEWAY6}/64 dev {host_iface} nodad");
            sh_in(&node_ns, &gateway6)?;
            sh_in(
                &netns,
                &format!("ip -6 route add default via {POD_GATEWAY6} dev eth0"),
            )?;
            sh_in(
                &node_ns,
                &format!("ip -6 route add {ip6}/128 dev {host_iface}"),
            )?;
        }
        sh_in(
            &node_ns,
            &format!("ip route add {ip_addr}/32 dev {host_iface}"),
        )?;
        Ok(Pod {
            netns,
            name: format!("pod-{node}-{index}"),
            namespace: "default".into(),
            ip: ip_addr,
            ip6,
            mac,
            host_iface,
        })
    }

    pub fn node(&self, index: usize) -> &Node {
        &self.nodes[index]
    }
}

/// The environment variable that runs the agents of the topology tests with
/// `--socket-lb on` (the service tests' second pass); unset or `off`: per packet only.
pub const SOCKET_LB_MODE: &str = "DATAPLANE_TEST_SOCKET_LB";

/// `--socket-lb` as [`SOCKET_LB_MODE`] asks.
pub fn socket_lb_mode() -> String {
    std::env::var(SOCKET_LB_MODE).unwrap_or_else(|_| "off".to_owned())
}

/// Whether the agents translate services at the socket in this run ([`SOCKET_LB_MODE`]).
pub fn socket_lb_on() -> bool {
    socket_lb_mode() == "on"
}

/// The environment variable that runs the agents of the topology tests with `--uplink-hook`
/// set to its value (the uplink tests' second pass runs `tc`); unset: `xdp`.
pub const UPLINK_HOOK: &str = "DATAPLANE_TEST_UPLINK_HOOK";

/// `--uplink-hook` as [`UPLINK_HOOK`] asks.
pub fn uplink_hook() -> String {
    std::env::var(UPLINK_HOOK).unwrap_or_else(|_| "xdp".to_owned())
}

/// Whether the agents' uplinks run tc alone in this run ([`UPLINK_HOOK`]).
pub fn uplink_tc() -> bool {
    uplink_hook() == "tc"
}

/// The hook that first counts what arrives on the uplink (tunnel packets unwrapped among
/// them): XDP's, or tc's where the uplink runs no XDP ([`uplink_tc`]).
pub fn arrival_hook() -> dataplane_common::Hook {
    if uplink_tc() {
        dataplane_common::Hook::UnderlayTc
    } else {
        dataplane_common::Hook::Underlay
    }
}

/// The Kubernetes name of node `index`.
pub fn node_name(index: usize) -> String {
    format!("node{index}")
}

impl Drop for Topology {
    fn drop(&mut self) {
        if let Some(dir) = &self.manifests {
            let _ = fs::remove_dir_all(dir);
        }
        for file in &self.extra_files {
            let _ = fs::remove_file(file);
        }
        for name in self.namespaces.iter().rev() {
            if let Err(e) = ip(&format!("netns del {name}")) {
                eprintln!("topology cleanup: {e:#}");
            }
        }
    }
}

impl Pod {
    /// Sends one raw Ethernet frame out of the pod's eth0 (AF_PACKET, as any pod with
    /// CAP_NET_RAW can), so the node sees exactly these bytes.
    pub fn send_raw_frame(&self, frame: &[u8]) -> anyhow::Result<()> {
        let hex = crate::scapy::hex(frame);
        let script = format!(
            "import socket; s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW); \
             s.bind(('eth0', 0)); s.send(bytes.fromhex('{hex}'))"
        );
        run_in(&self.netns, &["python3", "-c", &script])
    }

    /// Pings `target` (IPv4 or IPv6) `count` times from this pod; true when every echo was
    /// answered (ping itself succeeds when any one is).
    pub fn ping(&self, target: impl Into<IpAddr>, count: u32) -> anyhow::Result<bool> {
        let counted = count.to_string();
        let target = target.into().to_string();
        let out = exec_in(
            &self.netns,
            &[
                "ping", "-n", "-q", "-c", &counted, "-i", "0.2", "-W", "2", &target,
            ],
        )?;
        let summary = String::from_utf8_lossy(&out.stdout);
        let answered = format!(", {count} received,");
        Ok(out.status.success() && summary.contains(&answered))
    }
}

impl Node {
    /// Starts the stand-in API server (`fake_apiserver`) in this node's namespace, serving the
    /// topology's manifest directory on 127.0.0.1:6443, and writes a kubeconfig for it.
    pub fn start_fake_apiserver(&self) -> anyhow::Result<ApiServer> {
        self.start_fake_apiserver_with(&[])
    }

    /// [`Node::start_fake_apiserver`] with more arguments (`--page-limit`, `--history-limit`,
    /// `--watch-timeout-seconds`, `--bookmark-every-ms`: the real server's behaviours).
    pub fn start_fake_apiserver_with(&self, extra: &[&str]) -> anyhow::Result<ApiServer> {
        let dir = self
            .manifests
            .as_ref()
            .context("an API server serves the manifests of overlay mode")?;
        spawn_fake_apiserver(&self.netns, dir, extra)
    }

    /// Starts the real agent binary in this node's netns, attached to the underlay NIC and
    /// every pod veth, and waits until it reports itself running.
    pub fn start_agent(&self) -> anyhow::Result<Agent> {
        self.start_agent_with(&[])
    }

    /// As [`Node::start_agent`], with more arguments for `dataplane run`.
    pub fn start_agent_with(&self, extra: &[&str]) -> anyhow::Result<Agent> {
        let name = crate::unique_name("agent");
        let pins = Pins::new(format!("/sys/fs/bpf/{name}"));
        let run_dir = std::env::temp_dir().join(&name);
        self.start_agent_at_with(pins, run_dir, extra)
    }

    /// Starts the agent with the given pin root and run directory (a restart passes the ones
    /// the previous agent used).
    pub fn start_agent_at(&self, pins: Pins, run_dir: PathBuf) -> anyhow::Result<Agent> {
        self.start_agent_at_with(pins, run_dir, &[])
    }

    /// [`Node::start_agent_at`] with more arguments for `dataplane run`.
    pub fn start_agent_at_with(
        &self,
        pins: Pins,
        run_dir: PathBuf,
        extra: &[&str],
    ) -> anyhow::Result<Agent> {
        fs::create_dir_all(&run_dir)?;
        let log_path = run_dir.join("agent.log");
        let log = fs::File::create(&log_path)?;
        let netns_path = format!("--net=/run/netns/{}", self.netns);
        let mut command = Command::new("nsenter");
        command
            .arg(&netns_path)
            .arg(dataplane_binary())
            .arg("--pin-root")
            .arg(pins.root())
            .arg("--run-dir")
            .arg(&run_dir)
            .args(["run", "--underlay", &self.underlay_iface]);
        // The fabric's side of eth0 polls (see `build_with`): XDP may send frames back, unless
        // the test says otherwise.
        if !extra.contains(&"--xdp-forward") {
            command.args(["--xdp-forward", "on"]);
        }
        // The uplink tests run once per hook: `UPLINK_HOOK` says which.
        if !extra.contains(&"--uplink-hook") {
            command.args(["--uplink-hook", &uplink_hook()]);
        }
        // The service tests run once per translation mode: `SOCKET_LB_MODE` says which.
        if !extra.contains(&"--socket-lb") {
            command.args(["--socket-lb", &socket_lb_mode()]);
        }
        let from_api = extra.contains(&"--kubernetes");
        match &self.manifests {
            // The cluster from an API server (see `Node::start_fake_apiserver`).
            Some(_) if from_api => {
                command.args(["--node-name", &node_name(self.index)]);
            }
            // The agent finds the pods' veths itself from the cluster state.
            Some(dir) => {
                command
                    .arg("--manifests")
                    .arg(dir)
                    .args(["--node-name", &node_name(self.index)]);
            }
            None => {
                for pod in &self.pods {
                    command.args(["--pod-iface", &pod.host_iface]);
                }
            }
        }
        if self.manifests.is_some() {
            // The CNI plugin's allocations: kept with the run directory, so a restarted
            // agent (given the same one) finds them.
            command.arg("--ipam-file").arg(run_dir.join("ipam.json"));
            // A full recompute every 2 s behind every test's changes: what it has to write is
            // a change the incremental syncs missed, and fails the test (`Agent`'s drop).
            // Benchmarks run the agent as deployed instead (`agents_as_deployed`).
            if !extra.contains(&"--full-sync-every-seconds") && !AS_DEPLOYED.load(Ordering::Relaxed)
            {
                command.args(["--full-sync-every-seconds", "2"]);
            }
        }
        command.args(extra);
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("spawning the agent")?;
        let mut agent = Agent {
            child: Some(child),
            pins,
            run_dir,
            log_path,
            netns: self.netns.clone(),
        };
        if let Err(e) = agent.wait_running() {
            // Leave the pins for the caller to inspect or reuse; only the process is gone.
            let _ = agent.child.take().map(|mut c| c.kill());
            let (pins, run_dir) = (agent.pins.clone(), agent.run_dir.clone());
            std::mem::forget(agent);
            return Err(e.context(format!(
                "agent with pins {} and run dir {}",
                pins.root().display(),
                run_dir.display()
            )));
        }
        Ok(agent)
    }
}

/// Removes the pins of stopped agents on drop, so that a test failing between stopping an
/// agent (`Agent::stop_keeping_pins`) and restarting it leaves nothing behind. Removing pins a
/// restarted agent already removed is harmless.
pub struct PinsCleanup(pub Vec<Pins>);

impl Drop for PinsCleanup {
    fn drop(&mut self) {
        for pins in &self.0 {
            if let Err(e) = pins.remove_all() {
                eprintln!("pin cleanup: {e}");
            }
        }
    }
}

/// The stand-in API server serving `dir`'s manifests on 127.0.0.1:6443 in network namespace
/// `netns`, with `extra` arguments; its kubeconfig is written beside the manifests.
pub fn spawn_fake_apiserver(netns: &str, dir: &Path, extra: &[&str]) -> anyhow::Result<ApiServer> {
    let binary = dataplane_binary().with_file_name("fake_apiserver");
    let child = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{netns}"))
        .arg(&binary)
        .arg("--manifests")
        .arg(dir)
        .args(["--listen", "127.0.0.1:6443"])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    // Beside the manifests (not a .yaml file, so not served) and removed with them.
    let kubeconfig = dir.join(format!("{netns}.kubeconfig"));
    fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\n\
         clusters: [{name: fake, cluster: {server: 'http://127.0.0.1:6443'}}]\n\
         users: [{name: agent, user: {}}]\n\
         contexts: [{name: fake, context: {cluster: fake, user: agent}}]\n\
         current-context: fake\n",
    )?;
    Ok(ApiServer { child, kubeconfig })
}

/// A running stand-in API server; killed on drop.
pub struct ApiServer {
    child: Child,
    pub kubeconfig: PathBuf,
}

impl ApiServer {
    /// The agent arguments that make it watch this server.
    pub fn agent_args(&self) -> Vec<String> {
        vec![
            "--kubernetes".into(),
            "--kubeconfig".into(),
            self.kubeconfig.display().to_string(),
        ]
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running agent; stopped with SIGTERM and its pins removed (which detaches its programs)
/// on drop.
pub struct Agent {
    child: Option<Child>,
    pub pins: Pins,
    pub run_dir: PathBuf,
    log_path: PathBuf,
    /// The node's network namespace (where its pod veths' tc filters are).
    netns: String,
}

impl Agent {
    fn wait_running(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let state = dataplane_user::kernel::state::state_path(&self.run_dir);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!("agent exited with {status} before running:\n{}", self.log());
            }
            if state.exists() {
                return Ok(());
            }
            thread::sleep(Duration::from_millis(50));
        }
        bail!("agent did not report running within 30 s:\n{}", self.log())
    }

    /// The agent's process id (nsenter runs the agent in its own place).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// What the agent logged so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// The counters in the agent's pinned maps.
    pub fn counters(&self) -> anyhow::Result<Counters> {
        Ok(dataplane_user::kernel::stats::read(&self.pins)?)
    }

    /// `dataplane status --json` for this agent, parsed.
    pub fn status_json(&self) -> anyhow::Result<serde_json::Value> {
        let out = Command::new(dataplane_binary())
            .arg("--pin-root")
            .arg(self.pins.root())
            .arg("--run-dir")
            .arg(&self.run_dir)
            .args(["status", "--json"])
            .output()?;
        ensure!(
            out.status.success(),
            "status failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    /// Stops the agent but leaves its pins and run directory for a successor.
    pub fn stop_keeping_pins(mut self) -> anyhow::Result<(Pins, PathBuf)> {
        self.stop()?;
        assert_no_missed_change(&self.log());
        let pins = self.pins.clone();
        let run_dir = self.run_dir.clone();
        std::mem::forget(self);
        Ok((pins, run_dir))
    }

    /// Stops the agent with SIGTERM and returns its exit status.
    pub fn stop(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        let mut child = self.child.take().context("agent already stopped")?;
        let pid = libc::pid_t::try_from(child.id())?;
        // SAFETY: pid is our own child; SIGTERM asks it to exit (its pinned links stay).
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            thread::sleep(Duration::from_millis(20));
        }
        child.kill()?;
        bail!("agent ignored SIGTERM for 10 s:\n{}", self.log())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.child.is_some()
            && let Err(e) = self.stop()
        {
            eprintln!("agent cleanup: {e:#}");
        }
        // `dataplane cleanup` in the node's namespace: the pins (which detaches the underlay's
        // programs) and the pods' tc filters, which outlive the pins otherwise.
        let cleaned = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.netns))
            .arg(dataplane_binary())
            .arg("--pin-root")
            .arg(self.pins.root())
            .arg("--run-dir")
            .arg(&self.run_dir)
            .arg("cleanup")
            .env("RUST_LOG", "warn")
            .output();
        if !cleaned.is_ok_and(|o| o.status.success())
            && let Err(e) = self.pins.remove_all()
        {
            eprintln!("agent pin cleanup: {e}");
        }
        let log = self.log();
        let _ = fs::remove_dir_all(&self.run_dir);
        // After the cleanup: a full recompute that had to write means an incremental sync
        // missed a change (the dependency model is wrong somewhere).
        if !thread::panicking() {
            assert_no_missed_change(&log);
        }
    }
}

/// Fails when the agent's log says a full recompute had to write.
fn assert_no_missed_change(log: &str) {
    let missed: Vec<&str> = log.lines().filter(|l| l.contains(MISSED_CHANGE)).collect();
    assert!(
        missed.is_empty(),
        "the agent's full recompute found changes the incremental syncs missed:\n{}\n\nlog:\n{log}",
        missed.join("\n")
    );
}

/// Set by [`agents_as_deployed`].
static AS_DEPLOYED: AtomicBool = AtomicBool::new(false);

/// From now on this process's agents run with the production full-recompute period (the
/// default, every 10 minutes) instead of the test bed's 2 s. Benchmarks call it first: a full
/// recompute re-reads and re-runs everything, and every 2 s on both nodes it takes CPU time
/// from, and stalls, the paths they compare against baselines that run no agent.
pub fn agents_as_deployed() {
    AS_DEPLOYED.store(true, Ordering::Relaxed);
}

/// What the agent logs when a full recompute had to write.
pub const MISSED_CHANGE: &str = "the incremental syncs had missed a change";

/// The agent binary: `$DATAPLANE_BIN`, or `dataplane` next to the running test's target dir
/// (`cargo xtask test` builds it first).
pub fn dataplane_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("DATAPLANE_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("current executable path");
    let dir = exe.parent().expect("executable has a directory");
    // target/<profile>/deps/<test>  or  target/<profile>/<binary>
    let profile_dir = if dir.ends_with("deps") {
        dir.parent().unwrap_or(dir)
    } else {
        dir
    };
    let path = profile_dir.join("dataplane");
    assert!(
        path.exists(),
        "agent binary {} not built: run `cargo build -p dataplane-user` (cargo xtask test does)",
        path.display()
    );
    path
}

/// Attaches a pass-everything XDP program to the fabric's end of each node's underlay veth. A
/// veth hands the frames its XDP program sends back (XDP_TX) to its peer's receive ring, and
/// wakes the peer only when the peer runs XDP itself; without this, the frames a node's XDP
/// fast path sends would wait in that ring. A NIC's wire takes them at once.
fn attach_wire_xdp(fabric: &str, ports: &[String]) -> anyhow::Result<()> {
    let mut testbed = crate::testbed::Testbed::load()?;
    attach_pinned_xdp(
        &mut testbed,
        dataplane_common::testbed::PROG_BASELINE,
        fabric,
        ports,
    )
}

/// Attaches the test bed's XDP program `name` to `ports` in `netns` (replacing what they ran:
/// `-force`) by way of a pin, so that the attachments outlive the loaded object: each interface
/// keeps its own reference to the program, and the program to its maps.
fn attach_pinned_xdp(
    testbed: &mut crate::testbed::Testbed,
    name: &'static str,
    netns: &str,
    ports: &[String],
) -> anyhow::Result<()> {
    // The first pin of a fresh machine may come before any agent has mounted the filesystem.
    dataplane_user::kernel::pins::ensure_bpffs()?;
    let pin = PathBuf::from(format!("/sys/fs/bpf/{}", crate::unique_name("wire")));
    let program = testbed.xdp(name)?;
    program
        .pin(&pin)
        .with_context(|| format!("pinning {name} at {}", pin.display()))?;
    let pinned = pin.display().to_string();
    let attached = ports.iter().try_for_each(|port| {
        run_in(
            netns,
            &[
                "ip", "-force", "link", "set", "dev", port, "xdpdrv", "pinned", &pinned,
            ],
        )
    });
    let _ = fs::remove_file(&pin);
    attached
}

/// The ports of the fabric's bridge: name and ifindex.
fn bridge_ports(fabric: &str) -> anyhow::Result<Vec<(String, u32)>> {
    let out = exec_in(fabric, &["ip", "-o", "link", "show", "master", "br0"])?;
    // Lines start with "<index>: <name>@<peer>:".
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| {
            let mut fields = line.split(": ");
            let index = fields.next().unwrap_or("").trim().parse()?;
            let name = fields.next().unwrap_or("").split('@').next().unwrap_or("");
            ensure!(!name.is_empty(), "no port name in {line:?}");
            Ok((name.to_owned(), index))
        })
        .collect()
}

/// Runs `work` on a thread that has entered `netns` (for what resolves interfaces in the
/// caller's namespace: attaching by name, device-map entries).
pub fn in_netns<T: Send>(
    netns: &str,
    work: impl FnOnce() -> anyhow::Result<T> + Send,
) -> anyhow::Result<T> {
    use std::os::fd::AsRawFd as _;
    let target = fs::File::open(format!("/run/netns/{netns}"))
        .with_context(|| format!("opening netns {netns}"))?;
    thread::scope(|scope| {
        scope
            .spawn(move || {
                // SAFETY: a valid namespace descriptor; setns affects only this thread.
                if unsafe { libc::setns(target.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    bail!("setns into {netns}: {}", std::io::Error::last_os_error());
                }
                work()
            })
            .join()
            .map_err(|_| anyhow::anyhow!("the thread in {netns} panicked"))?
    })
}

/// Runs `ip` with whitespace-separated `args` in the host netns (for `ip netns` and
/// cross-namespace `ip link`).
fn ip(args: &str) -> anyhow::Result<()> {
    let args: Vec<&str> = args.split_whitespace().collect();
    ip_args(&args)
}

/// Runs `ip args...` in the caller's netns and fails on a non-zero exit.
pub(crate) fn ip_args(args: &[&str]) -> anyhow::Result<()> {
    checked(Command::new("ip").args(args).output()?, "ip", args)
}

/// Runs a whitespace-separated command line inside `netns` and fails on a non-zero exit.
pub fn sh_in(netns: &str, command: &str) -> anyhow::Result<()> {
    let args: Vec<&str> = command.split_whitespace().collect();
    run_in(netns, &args)
}

/// `dataplane <args> --json` against `agent`'s pins and run directory, run in `node`'s
/// namespace; the output parsed (the command must succeed).
pub fn dataplane_json(node: &Node, agent: &Agent, args: &[&str]) -> serde_json::Value {
    let out = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", node.netns))
        .arg(dataplane_binary())
        .arg("--pin-root")
        .arg(agent.pins.root())
        .arg("--run-dir")
        .arg(&agent.run_dir)
        .args(args)
        .arg("--json")
        .env("RUST_LOG", "warn")
        .output()
        .expect("run dataplane");
    assert!(
        out.status.success(),
        "dataplane {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// Runs a command inside `netns` and fails on a non-zero exit.
pub fn run_in(netns: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = exec_in(netns, args)?;
    checked(out, netns, args)
}

/// Runs a command inside `netns` and returns its output whatever the exit status.
pub fn exec_in(netns: &str, args: &[&str]) -> anyhow::Result<Output> {
    Command::new("nsenter")
        .arg(format!("--net=/run/netns/{netns}"))
        .args(args)
        .output()
        .with_context(|| format!("running {args:?} in {netns}"))
}

fn checked(out: Output, place: &str, args: &[&str]) -> anyhow::Result<()> {
    if out.status.success() {
        return Ok(());
    }
    bail!(
        "{place}: {} failed ({}): {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    )
}

/// A VXLAN device on each node, addressed 10.245.0.<n+1>/24, carrying the other node's pod
/// CIDR: the kernel's own overlay for the same pods.
pub fn kernel_vxlan_up(nodes: &[Node]) -> anyhow::Result<()> {
    for node in nodes {
        let peer = &nodes[1 - node.index];
        let ns = &node.netns;
        // The kernel's overlay alone: the agent's management port (and its routes to the other
        // node's pods), which outlives the agent, goes first.
        let _ = sh_in(
            ns,
            &format!("ip link del {}", dataplane_user::mgmt::HOST_SIDE),
        );
        sh_in(
            ns,
            &format!(
                "ip link add vxlan0 type vxlan id 42 local {} remote {} dstport 4789 dev eth0",
                underlay_ip(node.index),
                underlay_ip(peer.index)
            ),
        )?;
        sh_in(
            ns,
            &format!("ip addr add 10.245.0.{}/24 dev vxlan0", node.index + 1),
        )?;
        sh_in(ns, "ip link set vxlan0 up")?;
        sh_in(
            ns,
            &format!(
                "ip route add {} via 10.245.0.{} dev vxlan0",
                pod_cidr(peer.index),
                peer.index + 1
            ),
        )?;
    }
    Ok(())
}

/// Removes what [`kernel_vxlan_up`] added (the devices, with their addresses and routes).
pub fn kernel_vxlan_down(nodes: &[Node]) -> anyhow::Result<()> {
    for node in nodes {
        sh_in(&node.netns, "ip link del vxlan0")?;
    }
    Ok(())
}
