//! The command line of `dataplane`: the commands, and the options of the agent and the
//! controller (each flag with its default; the README's tables are checked against these).

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use dataplane_user::{
    cli::inspect,
    cli::trace,
    cni, egressip,
    kernel::attach::{UplinkHook, XdpModeChoice},
    kernel::pins::DEFAULT_PIN_ROOT,
    kernel::state::DEFAULT_RUN_DIR,
};

/// Where OVN-Kubernetes nodes keep their ACL audit log.
const DEFAULT_AUDIT_LOG: &str = "/var/log/ovn/acl-audit-log.log";

#[derive(Parser)]
#[command(
    name = "dataplane",
    version,
    about = "eBPF/XDP node dataplane for Kubernetes"
)]
pub(super) struct Cli {
    /// bpffs directory holding this node's pinned maps and programs.
    #[arg(long, global = true, default_value = DEFAULT_PIN_ROOT)]
    pub(super) pin_root: PathBuf,
    /// Directory for the running agent's state file.
    #[arg(long, global = true, default_value = DEFAULT_RUN_DIR)]
    pub(super) run_dir: PathBuf,
    /// Log lines as text (`key=value` fields) or as JSON objects.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub(super) log_format: LogFormat,
    #[command(subcommand)]
    pub(super) command: Command,
}

/// `dataplane run`'s options.
#[derive(clap::Args)]
pub(super) struct RunOptions {
    /// The node's underlay NIC (the uplink: tc, and XDP where --uplink-hook says).
    #[arg(long)]
    pub(super) underlay: String,
    /// Host-side veth of a local pod (tc is attached to its ingress); repeatable.
    #[arg(long = "pod-iface")]
    pub(super) pod_ifaces: Vec<String>,
    /// Where the uplink's datapath runs: tc (peer and neighbour redirects, no XDP), or XDP
    /// then tc for what it passes up. auto: tc on veth, virtio_net and tun uplinks, where XDP
    /// costs a copy or a socket buffer build a frame, and where the driver refuses native XDP;
    /// native XDP elsewhere.
    #[arg(long, value_enum, default_value_t = UplinkHook::Auto)]
    pub(super) uplink_hook: UplinkHook,
    /// XDP attach mode (with --uplink-hook xdp): auto tries native, then generic (no hardware offload: see
    /// docs/features.md).
    #[arg(long, value_enum, default_value_t = XdpModeChoice::Auto)]
    pub(super) xdp_mode: XdpModeChoice,
    /// Whether XDP sends frames back out of the NIC itself: NodePort packets of established
    /// flows to backends on other nodes (Geneve), answers to ARP and neighbour solicitations
    /// for egress IPs (tc answers them when off). auto: on, except on a veth underlay, whose
    /// peer drops frames from XDP unless it runs GRO or XDP itself.
    #[arg(long, value_enum, default_value_t = XdpForward::Auto)]
    pub(super) xdp_forward: XdpForward,
    /// Directory of Kubernetes YAML manifests (Nodes, Pods, Services, policies, ...): the
    /// cluster state, followed for changes. Local pods' veths are found and attached.
    #[arg(long, requires = "node_name", conflicts_with = "kubernetes")]
    pub(super) manifests: Option<PathBuf>,
    /// Watch the cluster's API server instead (in-cluster service account, KUBECONFIG or
    /// ~/.kube/config; or --kubeconfig).
    #[arg(long, requires = "node_name")]
    pub(super) kubernetes: bool,
    /// The kubeconfig for --kubernetes.
    #[arg(long, requires = "kubernetes")]
    pub(super) kubeconfig: Option<PathBuf>,
    /// This node's name among the cluster's Nodes.
    #[arg(long, env = "NODE_NAME")]
    pub(super) node_name: Option<String>,
    /// Name server for EgressFirewall dnsName rules (default: the node's
    /// /etc/resolv.conf).
    #[arg(long)]
    pub(super) dns_server: Option<std::net::IpAddr>,
    /// The ACL audit log file (rotated as policyAuditConfig says).
    #[arg(long, default_value = DEFAULT_AUDIT_LOG)]
    pub(super) audit_log: PathBuf,
    /// Serve Prometheus metrics on this address (`GET /metrics`), e.g. 0.0.0.0:9476.
    #[arg(long)]
    pub(super) metrics_address: Option<std::net::SocketAddr>,
    /// Serve kube-proxy's node health (`GET /healthz`, `GET /livez`) on this address, as
    /// load balancers probe it.
    #[arg(long, default_value = "0.0.0.0:10256")]
    pub(super) healthz_address: std::net::SocketAddr,
    /// The unix socket the CNI plugin (`dataplane-cni`) asks (default: `cni.sock` in the
    /// run directory). Served once the first sync is done, with a cluster state.
    #[arg(long)]
    pub(super) cni_socket: Option<PathBuf>,
    /// Where the pods' address allocations are kept; on the node's disk, so they outlive
    /// agent restarts and reboots.
    #[arg(long, default_value = cni::DEFAULT_IPAM_FILE)]
    pub(super) ipam_file: PathBuf,
    /// Networks in which Services' `spec.externalIPs` are honoured (comma-separated or
    /// repeated CIDRs). Empty, the default: no external IP is (CVE-2020-8554), or on OpenShift
    /// those its cluster configuration's `spec.externalIP.policy` allows. Addresses in the
    /// cluster's own networks or of a node are refused whatever this says.
    #[arg(long, value_delimiter = ',')]
    pub(super) external_ip_cidrs: Vec<ipnet::IpNet>,
    /// Where NodePorts are served, as kube-proxy's flag (comma-separated or repeated):
    /// `primary` (the default), the node's address of each family; CIDRs, every address of
    /// the node inside them (loopback addresses never); both may be mixed.
    #[arg(long, value_delimiter = ',', default_value = "primary", value_parser = nodeport_address)]
    pub(super) nodeport_addresses: Vec<String>,
    /// With the API server: a file holding the cluster's network configuration as an
    /// `operator.openshift.io/v1 Network` (deploy/'s ConfigMap, mounted by the DaemonSet),
    /// used where the API server has no such `Network` (vanilla Kubernetes; OpenShift's own
    /// takes precedence). Re-read when it changes.
    #[arg(long)]
    pub(super) network_config: Option<PathBuf>,
    /// Where the node's sysctls are read and written: /proc/sys, or where the host's
    /// /proc/sys/net is mounted in a container that is not privileged (its own /proc/sys is
    /// read-only), as the DaemonSet mounts it.
    #[arg(long, default_value = dataplane_user::kernel::sysctl::DEFAULT_ROOT)]
    pub(super) proc_sys_dir: PathBuf,
    /// Directories where the container runtime keeps pods' named network namespaces
    /// (repeatable); `CNI_NETNS` is taken only from these and `/proc/<pid>/ns/net`.
    #[arg(long = "cni-netns-dir", default_values = cni::wire::DEFAULT_NETNS_DIRS)]
    pub(super) cni_netns_dirs: Vec<PathBuf>,
    /// Write the plugin's network configuration list into this directory (the runtime's,
    /// e.g. /etc/cni/net.d) once the plugin is served: until then the node's network is
    /// not ready.
    #[arg(long)]
    pub(super) cni_conf_dir: Option<PathBuf>,
    /// Addresses egress router pods may claim beyond their EgressRouters' (for routers
    /// written as NetworkAttachmentDefinitions by hand): NAMESPACE=CIDR, or a lone CIDR for
    /// every namespace (repeatable). The egress-router plugin claims no other address.
    #[arg(long = "egress-router-reservation")]
    pub(super) egress_router_reservations:
        Vec<dataplane_user::egressrouter::reservations::Reservation>,
    /// Translate this node's pods' connections (TCP, UDP connected or not) to ClusterIPs,
    /// external and load-balancer IPs and nodes' NodePorts at the socket (cgroup connect/
    /// sendmsg/recvmsg/getpeername programs), so no packet of them is translated; auto: where
    /// the kernel allows it, else per packet; off: per packet only. ClientIP affinity,
    /// source ranges and SCTP stay per packet either way.
    #[arg(long, value_enum, default_value_t = dataplane_user::lb::socket::SocketLb::Auto)]
    pub(super) socket_lb: dataplane_user::lb::socket::SocketLb,
    /// The cgroup v2 directory the socket-level programs attach to (default: the first
    /// cgroup2 mount, the node's root; a directory that is no cgroup v2 hierarchy's is looked
    /// into for its `unified` one).
    #[arg(long)]
    pub(super) socket_lb_cgroup: Option<PathBuf>,
    /// Serve the node's own (host-network) processes at the socket too: their connections
    /// to services get a backend when they connect, as pods' do.
    #[arg(long, value_enum, default_value_t = dataplane_user::lb::socket::SocketLbHost::Off)]
    pub(super) socket_lb_host: dataplane_user::lb::socket::SocketLbHost,
    /// Map sizes (given to the kernel when the maps are created; pinned maps keep theirs).
    #[command(flatten)]
    pub(super) capacities: dataplane_user::kernel::capacity::Capacities,
    /// How often the cluster state is looked at even without a reported change, in seconds
    /// (a lost event is found then). Tests set it long to see that events alone drive syncs.
    #[arg(long, default_value_t = 10, hide = true)]
    pub(super) look_every_seconds: u64,
    /// How often everything is re-read and every sync stage run, in seconds, whatever
    /// changed: what it has to write is counted (`dataplane_full_sync_differences_total`) as
    /// changes the incremental syncs missed.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    pub(super) full_sync_every_seconds: u64,
    /// Seconds between the general IGMP/MLD queries the agent sends the pods of
    /// multicast-enabled namespaces; a membership lasts twice this plus 10 s without a report.
    #[arg(long, default_value_t = 125, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub(super) multicast_query_interval_seconds: u64,
    /// The UDP port agents announce their nodes' multicast groups to each other on.
    #[arg(long, default_value_t = 6083)]
    pub(super) multicast_port: u16,
    /// The port the egress IP controller's probes are answered on, on this node's
    /// InternalIPs only (0: not answered, so this node holds no egress IP).
    #[arg(long, default_value_t = egressip::probe::DEFAULT_PROBE_PORT)]
    pub(super) probe_port: u16,
    /// The key the controller signs its probes with (a Secret mounted there). Default: with
    /// --kubernetes /etc/dataplane/probe-key/key; with --manifests, the controller's key
    /// beside the status file (egressip-status/probe.key).
    #[arg(long)]
    pub(super) probe_key_file: Option<PathBuf>,
}

/// `dataplane controller`'s options.
#[derive(clap::Args)]
pub(super) struct ControllerOptions {
    /// The manifest directory (status written to its `egressip-status/status.json`).
    #[arg(
        long,
        conflicts_with = "kubernetes",
        required_unless_present = "kubernetes"
    )]
    pub(super) manifests: Option<PathBuf>,
    /// Use the API server (in-cluster service account, KUBECONFIG or ~/.kube/config).
    #[arg(long)]
    pub(super) kubernetes: bool,
    /// The kubeconfig for --kubernetes.
    #[arg(long, requires = "kubernetes")]
    pub(super) kubeconfig: Option<PathBuf>,
    /// The port the agents answer the probes on (at their node's InternalIP).
    #[arg(long, default_value_t = egressip::probe::DEFAULT_PROBE_PORT)]
    pub(super) probe_port: u16,
    /// The key probes are signed with (the agents hold the same). Default: with --kubernetes
    /// /etc/dataplane/probe-key/key (the Secret `dataplane-probe-key`); with --manifests,
    /// egressip-status/probe.key under them, made when missing.
    #[arg(long)]
    pub(super) probe_key_file: Option<PathBuf>,
    /// Serve the controller's metrics on this address (`GET /metrics`).
    #[arg(long)]
    pub(super) metrics_address: Option<std::net::SocketAddr>,
    /// The namespace of the leader election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "dataplane")]
    pub(super) lease_namespace: String,
    /// This replica's name in the Lease (default: the host name).
    #[arg(long, env = "POD_NAME")]
    pub(super) identity: Option<String>,
    /// How long the Lease holds without renewal (the leader renews every third of it). A
    /// leader that dies stops the probes, so the agents withdraw their egress addresses
    /// until a standby takes the Lease: this bounds that outage.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u64).range(3..))]
    pub(super) lease_duration_seconds: u64,
    /// With the API server: the cluster's network configuration as an
    /// `operator.openshift.io/v1 Network` file (deploy/network.yaml's ConfigMap), where the API
    /// server has none; its `hostPrefix` sizes the node subnets the leader allocates.
    #[arg(long, requires = "kubernetes")]
    pub(super) network_config: Option<PathBuf>,
    /// With the API server: the image of the egress router pods made for EgressRouters (the
    /// pod only holds its network namespace; the egress-router plugin does the rest).
    #[arg(long, default_value = dataplane_user::egressrouter::resource::DEFAULT_IMAGE)]
    pub(super) egress_router_image: String,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(super) enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
pub(super) enum Command {
    /// Load the programs, attach them (taking over the links a previous agent pinned), and run
    /// until SIGINT or SIGTERM. The attachments stay pinned: the data path keeps forwarding
    /// while no agent runs, and the next agent swaps its programs in. `cleanup` detaches.
    Run(Box<RunOptions>),
    /// Make sure the pin root lies on a bpf filesystem (mounting one at /sys/fs/bpf when none
    /// is) and create its directories: the DaemonSet's one privileged step, an init container,
    /// so that the agent itself runs with capabilities only.
    PreparePins,
    /// Install the CNI plugin binaries into the runtime's plugin directory (the DaemonSet's init
    /// container runs this): `dataplane-cni`, and `egress-router` for egress router pods.
    InstallCni {
        /// The runtime's plugin directory, e.g. /opt/cni/bin (mounted from the host).
        #[arg(long)]
        bin_dir: PathBuf,
        /// The plugin binary to install as `dataplane-cni` (default: `dataplane-cni` and
        /// `egress-router` beside this binary).
        #[arg(long)]
        plugin: Option<PathBuf>,
    },
    /// Print the custom resource definitions the agent reads (EgressFirewall, EgressIP and the
    /// admin network policies), generated from its own types, as one YAML stream for
    /// `kubectl apply -f -`; or write each to its file in a directory (`deploy/crds`).
    Crds {
        /// Write `<group>_<plural>.yaml` files here instead of printing.
        #[arg(long)]
        write: Option<PathBuf>,
    },
    /// Show what is attached where, map fill levels and packet/drop counters.
    Status {
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// What the pinned maps hold, decoded (the `cilium bpf ... list` of this dataplane).
    Inspect {
        #[arg(value_enum)]
        table: inspect::Table,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Run a described packet through the loaded programs (BPF_PROG_TEST_RUN) against copies
    /// of this node's maps, so nothing live changes; print each program's verdict, the
    /// counters it hit, the entries it created and the packet as it left.
    Trace {
        /// Source address: a local pod's (runs tc_from_pod), or any other (runs the underlay
        /// programs, as traffic arriving at this node).
        #[arg(long)]
        from: std::net::IpAddr,
        /// Destination, `IP:port` (`[IPv6]:port`), or just the IP for ICMP.
        #[arg(long)]
        to: String,
        #[arg(long, value_enum, default_value_t = trace::Protocol::Tcp)]
        protocol: trace::Protocol,
        #[arg(long, default_value_t = 40000)]
        source_port: u16,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// The cluster-wide egress IP controller: assigns each EgressIP address to a node, probes
    /// the nodes' agents (signed `/egressip/probe` requests to their probe port at their
    /// InternalIP) and moves the addresses of a node that stops answering; writes the objects'
    /// status. Run one per cluster (as a Deployment; replicas elect a leader on a Lease).
    Controller(Box<ControllerOptions>),
    /// Remove every pin under the pin root and the pod tc filters of this network namespace:
    /// detaches the programs and drops all adopted state.
    Cleanup,
    /// Load every program into this kernel (nothing attached, private pins) and show the room
    /// each leaves: verified instructions against the 1M budget, the stack of its deepest
    /// call chain against 512 bytes, the tail-call stages after it.
    Verify {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Fail when a program verifies at more than this share of the budget (percent).
        #[arg(long)]
        max_budget_percent: Option<f64>,
        /// Fail when a program's deepest call chain needs more stack than this (bytes).
        #[arg(long)]
        max_stack: Option<u32>,
    },
}

/// `--xdp-forward`: whether XDP may send frames back out of the underlay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum XdpForward {
    Auto,
    On,
    Off,
}

/// One `--nodeport-addresses` value: `primary` or a CIDR.
fn nodeport_address(value: &str) -> Result<String, String> {
    dataplane_user::lb::NodePortAddresses::parse(&[value.to_owned()])?;
    Ok(value.to_owned())
}
