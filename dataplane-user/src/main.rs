//! `dataplane`: the node agent and its operator commands.

use std::{
    path::PathBuf,
    process::ExitCode,
    sync::Arc,
    time::{Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use dataplane_common::maps::LAYOUT_VERSION;
use dataplane_user::{
    Dataplane, Pins,
    acl::{self, agent::Wake},
    attach::XdpModeChoice,
    cni::{
        self,
        protocol::{Reply, Request},
        server::{CniPods, Job, NodePods},
        spec::{CniError, code},
    },
    egressip::{self, node::EgressNode},
    inspect,
    kubernetes::{self, KubeSource},
    lb,
    metrics::{self, Metrics},
    netdev,
    pins::DEFAULT_PIN_ROOT,
    port, preflight, source,
    state::{self, AgentState, DEFAULT_RUN_DIR},
    status, trace, verify,
};
use tokio::signal::unix::{SignalKind, signal};

mod cluster;

use cluster::{Cluster, Source, warn_unrestricted};

/// Where OVN-Kubernetes nodes keep their ACL audit log.
const DEFAULT_AUDIT_LOG: &str = "/var/log/ovn/acl-audit-log.log";

#[derive(Parser)]
#[command(
    name = "dataplane",
    version,
    about = "eBPF/XDP node dataplane for Kubernetes"
)]
struct Cli {
    /// bpffs directory holding this node's pinned maps and programs.
    #[arg(long, global = true, default_value = DEFAULT_PIN_ROOT)]
    pin_root: PathBuf,
    /// Directory for the running agent's state file.
    #[arg(long, global = true, default_value = DEFAULT_RUN_DIR)]
    run_dir: PathBuf,
    /// Log lines as text (`key=value` fields) or as JSON objects.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// `dataplane run`'s options.
#[derive(clap::Args)]
struct RunOptions {
    /// The node's underlay NIC (XDP is attached here).
    #[arg(long)]
    underlay: String,
    /// Host-side veth of a local pod (tc is attached to its ingress); repeatable.
    #[arg(long = "pod-iface")]
    pod_ifaces: Vec<String>,
    /// XDP attach mode: auto tries offload, then native, then generic.
    #[arg(long, value_enum, default_value_t = XdpModeChoice::Auto)]
    xdp_mode: XdpModeChoice,
    /// Whether XDP sends NodePort packets of established flows to backends on other nodes
    /// itself (Geneve, then back out of the NIC). auto: on, except on a veth underlay,
    /// whose peer drops frames from XDP unless it runs GRO or XDP itself.
    #[arg(long, value_enum, default_value_t = XdpForward::Auto)]
    xdp_forward: XdpForward,
    /// Directory of Kubernetes YAML manifests (Nodes, Pods, Services, policies, ...): the
    /// cluster state, followed for changes. Local pods' veths are found and attached.
    #[arg(long, requires = "node_name", conflicts_with = "kubernetes")]
    manifests: Option<PathBuf>,
    /// Watch the cluster's API server instead (in-cluster service account, KUBECONFIG or
    /// ~/.kube/config; or --kubeconfig).
    #[arg(long, requires = "node_name")]
    kubernetes: bool,
    /// The kubeconfig for --kubernetes.
    #[arg(long, requires = "kubernetes")]
    kubeconfig: Option<PathBuf>,
    /// This node's name among the cluster's Nodes.
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// Name server for EgressFirewall dnsName rules (default: the node's
    /// /etc/resolv.conf).
    #[arg(long)]
    dns_server: Option<std::net::IpAddr>,
    /// The ACL audit log file (rotated as policyAuditConfig says).
    #[arg(long, default_value = DEFAULT_AUDIT_LOG)]
    audit_log: PathBuf,
    /// Serve Prometheus metrics on this address (`GET /metrics`), e.g. 0.0.0.0:9476.
    #[arg(long)]
    metrics_address: Option<std::net::SocketAddr>,
    /// The unix socket the CNI plugin (`dataplane-cni`) asks (default: `cni.sock` in the
    /// run directory). Served once the first sync is done, with a cluster state.
    #[arg(long)]
    cni_socket: Option<PathBuf>,
    /// Where the pods' address allocations are kept; on the node's disk, so they outlive
    /// agent restarts and reboots.
    #[arg(long, default_value = cni::DEFAULT_IPAM_FILE)]
    ipam_file: PathBuf,
    /// Networks in which Services' `spec.externalIPs` are honoured (comma-separated or
    /// repeated CIDRs). Empty, the default: no external IP is (CVE-2020-8554). Addresses in
    /// the cluster's own networks or of a node are refused whatever this says.
    #[arg(long, value_delimiter = ',')]
    external_ip_cidrs: Vec<ipnet::IpNet>,
    /// Directories where the container runtime keeps pods' named network namespaces
    /// (repeatable); `CNI_NETNS` is taken only from these and `/proc/<pid>/ns/net`.
    #[arg(long = "cni-netns-dir", default_values = cni::wire::DEFAULT_NETNS_DIRS)]
    cni_netns_dirs: Vec<PathBuf>,
    /// Write the plugin's network configuration list into this directory (the runtime's,
    /// e.g. /etc/cni/net.d) once the plugin is served: until then the node's network is
    /// not ready.
    #[arg(long)]
    cni_conf_dir: Option<PathBuf>,
    /// Map sizes (given to the kernel when the maps are created; pinned maps keep theirs).
    #[command(flatten)]
    capacities: dataplane_user::capacity::Capacities,
    /// How often the cluster state is looked at even without a reported change, in seconds
    /// (a lost event is found then). Tests set it long to see that events alone drive syncs.
    #[arg(long, default_value_t = 10, hide = true)]
    look_every_seconds: u64,
    /// How often everything is re-read and every sync stage run, in seconds, whatever
    /// changed: what it has to write is counted (`dataplane_full_sync_differences_total`) as
    /// changes the incremental syncs missed.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    full_sync_every_seconds: u64,
    /// Seconds between the general IGMP/MLD queries the agent sends the pods of
    /// multicast-enabled namespaces; a membership lasts twice this plus 10 s without a report.
    #[arg(long, default_value_t = 125, value_parser = clap::value_parser!(u64).range(1..=3600))]
    multicast_query_interval_seconds: u64,
    /// The UDP port agents announce their nodes' multicast groups to each other on.
    #[arg(long, default_value_t = 6083)]
    multicast_port: u16,
    /// The port the egress IP controller's probes are answered on, on this node's
    /// InternalIPs only (0: not answered, so this node holds no egress IP).
    #[arg(long, default_value_t = egressip::probe::DEFAULT_PROBE_PORT)]
    probe_port: u16,
    /// The key the controller signs its probes with (a Secret mounted there). Default: with
    /// --kubernetes /etc/dataplane/probe-key/key; with --manifests, the controller's key
    /// beside the status file (egressip-status/probe.key).
    #[arg(long)]
    probe_key_file: Option<PathBuf>,
}

/// `dataplane controller`'s options.
#[derive(clap::Args)]
struct ControllerOptions {
    /// The manifest directory (status written to its `egressip-status/status.json`).
    #[arg(
        long,
        conflicts_with = "kubernetes",
        required_unless_present = "kubernetes"
    )]
    manifests: Option<PathBuf>,
    /// Use the API server (in-cluster service account, KUBECONFIG or ~/.kube/config).
    #[arg(long)]
    kubernetes: bool,
    /// The kubeconfig for --kubernetes.
    #[arg(long, requires = "kubernetes")]
    kubeconfig: Option<PathBuf>,
    /// The port the agents answer the probes on (at their node's InternalIP).
    #[arg(long, default_value_t = egressip::probe::DEFAULT_PROBE_PORT)]
    probe_port: u16,
    /// The key probes are signed with (the agents hold the same). Default: with --kubernetes
    /// /etc/dataplane/probe-key/key (the Secret `dataplane-probe-key`); with --manifests,
    /// egressip-status/probe.key under them, made when missing.
    #[arg(long)]
    probe_key_file: Option<PathBuf>,
    /// Serve the controller's metrics on this address (`GET /metrics`).
    #[arg(long)]
    metrics_address: Option<std::net::SocketAddr>,
    /// The namespace of the leader election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "dataplane")]
    lease_namespace: String,
    /// This replica's name in the Lease (default: the host name).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// How long the Lease holds without renewal (the leader renews every third of it). A
    /// leader that dies stops the probes, so the agents withdraw their egress addresses
    /// until a standby takes the Lease: this bounds that outage.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u64).range(3..))]
    lease_duration_seconds: u64,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Load the programs, attach them (taking over the links a previous agent pinned), and run
    /// until SIGINT or SIGTERM. The attachments stay pinned: the data path keeps forwarding
    /// while no agent runs, and the next agent swaps its programs in. `cleanup` detaches.
    Run(Box<RunOptions>),
    /// Install the CNI plugin binary into the runtime's plugin directory (the DaemonSet's init
    /// container runs this).
    InstallCni {
        /// The runtime's plugin directory, e.g. /opt/cni/bin (mounted from the host).
        #[arg(long)]
        bin_dir: PathBuf,
        /// The plugin binary to install (default: `dataplane-cni` beside this binary).
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

fn main() -> ExitCode {
    let pages = dataplane_user::small_pages_only();
    let cli = Cli::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr);
    match cli.log_format {
        // One JSON object per event, its fields as keys: for log collectors.
        LogFormat::Json => logs.json().init(),
        // Colour codes only for a terminal: log files get plain text.
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
    if let Err(error) = pages {
        tracing::debug!(%error, "transparent huge pages stay as the kernel sets them");
    }
    match dispatch(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// The `crds` subcommand: every shipped CRD to standard output, or each to its file in `dir`.
fn print_or_write_crds(dir: Option<&std::path::Path>) -> anyhow::Result<()> {
    for (file, crd) in dataplane_user::crds::shipped() {
        let yaml =
            dataplane_user::crds::to_yaml(&crd).with_context(|| format!("encoding {file}"))?;
        match dir {
            Some(dir) => {
                let path = dir.join(&file);
                std::fs::write(&path, yaml)
                    .with_context(|| format!("writing {}", path.display()))?;
                println!("wrote {}", path.display());
            }
            None => print!("---\n{yaml}"),
        }
    }
    Ok(())
}

fn dispatch(cli: Cli) -> anyhow::Result<()> {
    let pins = Pins::new(&cli.pin_root);
    match cli.command {
        Command::Run(options) => {
            let RunOptions {
                underlay,
                pod_ifaces,
                xdp_mode,
                xdp_forward,
                manifests,
                kubernetes,
                kubeconfig,
                node_name,
                dns_server,
                audit_log,
                metrics_address,
                cni_socket,
                ipam_file,
                cni_netns_dirs,
                external_ip_cidrs,
                cni_conf_dir,
                capacities,
                look_every_seconds,
                full_sync_every_seconds,
                multicast_query_interval_seconds,
                multicast_port,
                probe_port,
                probe_key_file,
            } = *options;
            run(
                &pins,
                &cli.run_dir,
                &RunArgs {
                    underlay,
                    pod_ifaces,
                    xdp_mode,
                    xdp_forward,
                    probe_port,
                    probe_key_file: probe_key_file.unwrap_or_else(|| match &manifests {
                        Some(dir) => dir.join(egressip::probe::MANIFEST_KEY_FILE),
                        None => PathBuf::from(egressip::probe::DEFAULT_KEY_FILE),
                    }),
                    cluster: match (manifests, kubernetes) {
                        (Some(dir), _) => node_name.map(|node| (SourceArg::Manifests(dir), node)),
                        (None, true) => {
                            node_name.map(|node| (SourceArg::Kubernetes(kubeconfig), node))
                        }
                        (None, false) => None,
                    },
                    dns_server,
                    audit_log,
                    metrics_address,
                    cni_socket: cni_socket.unwrap_or_else(|| cli.run_dir.join(cni::SOCKET_FILE)),
                    ipam_file,
                    cni_netns_dirs,
                    external_ip_cidrs,
                    cni_conf_dir,
                    capacities,
                    look_every: std::time::Duration::from_secs(look_every_seconds.max(1)),
                    full_every: std::time::Duration::from_secs(full_sync_every_seconds),
                    multicast: dataplane_user::multicast::Settings {
                        query_interval: std::time::Duration::from_secs(
                            multicast_query_interval_seconds,
                        ),
                        peer_port: multicast_port,
                        ..Default::default()
                    },
                },
            )
        }
        Command::Controller(options) => run_controller(*options),
        Command::Crds { write } => print_or_write_crds(write.as_deref()),
        Command::InstallCni { bin_dir, plugin } => {
            let plugin = match plugin {
                Some(plugin) => plugin,
                None => std::env::current_exe()
                    .context("locating this binary")?
                    .with_file_name("dataplane-cni"),
            };
            let installed = cni::install_plugin(&plugin, &bin_dir).with_context(|| {
                format!("installing {} into {}", plugin.display(), bin_dir.display())
            })?;
            println!("installed {}", installed.display());
            Ok(())
        }
        Command::Status { json } => {
            let report = status::collect(&pins, &cli.run_dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", status::render(&report));
            }
            Ok(())
        }
        Command::Inspect { table, json } => {
            let rows = match table {
                inspect::Table::Multicast => inspect::multicast_rows(&pins, Some(&cli.run_dir))?,
                _ => inspect::read(&pins, table, &acl::explain::read(&cli.run_dir))?,
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&rows.to_json())?);
            } else {
                print!("{}", inspect::render(&rows));
            }
            Ok(())
        }
        Command::Trace {
            from,
            to,
            protocol,
            source_port,
            json,
        } => {
            let (to, port) = match to.parse::<std::net::SocketAddr>() {
                Ok(address) => (address.ip(), address.port()),
                Err(_) => match to.parse::<std::net::IpAddr>() {
                    Ok(ip) if protocol == trace::Protocol::Icmp => (ip, 0),
                    _ => anyhow::bail!(
                        "--to {to:?}: expected IP:port ([IPv6]:port), or an IP for ICMP"
                    ),
                },
            };
            let report = trace::trace(
                &pins,
                &trace::Described {
                    from,
                    to,
                    protocol,
                    source_port,
                    port,
                },
                &acl::explain::read(&cli.run_dir),
            )?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", trace::render(&report));
            }
            Ok(())
        }
        Command::Verify {
            json,
            max_budget_percent,
            max_stack,
        } => {
            let budgets = verify::measure()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&budgets)?);
            } else {
                print!("{}", verify::render(&budgets));
            }
            let over: Vec<String> = budgets
                .iter()
                .filter(|b| {
                    max_budget_percent.is_some_and(|max| b.budget_percent > max)
                        || max_stack.is_some_and(|max| b.stack_bytes > max)
                })
                .map(|b| {
                    format!(
                        "{} ({:.1}%, {} bytes of stack)",
                        b.name, b.budget_percent, b.stack_bytes
                    )
                })
                .collect();
            if !over.is_empty() {
                anyhow::bail!(
                    "over the verifier margin (at most {}% of the budget, {} bytes of stack): {}",
                    max_budget_percent.map_or("-".into(), |m| m.to_string()),
                    max_stack.map_or("-".into(), |m| m.to_string()),
                    over.join(", ")
                );
            }
            Ok(())
        }
        Command::Cleanup => {
            let cleaned = dataplane_user::attach::remove_pod_filters();
            if let Err(error) = dataplane_user::gateway::remove() {
                tracing::warn!(%error, "removing the gateway SNAT table");
            }
            pins.remove_all()?;
            state::remove(&cli.run_dir);
            println!(
                "removed pins under {} and the pod tc filters of {} interfaces",
                pins.root().display(),
                cleaned.len()
            );
            Ok(())
        }
    }
}

enum SourceArg {
    Manifests(PathBuf),
    /// The API server, with this kubeconfig or as inferred.
    Kubernetes(Option<PathBuf>),
}

struct RunArgs {
    underlay: String,
    pod_ifaces: Vec<String>,
    xdp_mode: XdpModeChoice,
    xdp_forward: XdpForward,
    /// Where the cluster state comes from, and this node's name.
    cluster: Option<(SourceArg, String)>,
    dns_server: Option<std::net::IpAddr>,
    audit_log: PathBuf,
    metrics_address: Option<std::net::SocketAddr>,
    cni_socket: PathBuf,
    ipam_file: PathBuf,
    cni_netns_dirs: Vec<PathBuf>,
    external_ip_cidrs: Vec<ipnet::IpNet>,
    cni_conf_dir: Option<PathBuf>,
    capacities: dataplane_user::capacity::Capacities,
    /// How often the cluster state is looked at without a reported change.
    look_every: std::time::Duration,
    /// How often everything is re-read and every stage run.
    full_every: std::time::Duration,
    multicast: dataplane_user::multicast::Settings,
    probe_port: u16,
    probe_key_file: PathBuf,
}

fn run(pins: &Pins, run_dir: &std::path::Path, args: &RunArgs) -> anyhow::Result<()> {
    // Name a missing interface before loading anything.
    let underlay_index = preflight::interface_index(&args.underlay)?;
    for iface in &args.pod_ifaces {
        preflight::interface_index(iface)?;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let mut dataplane = Dataplane::load_with(pins, &args.capacities)?;
    tracing::info!(capacities = ?dataplane.capacities(), "map sizes");
    let metrics = Arc::new(Metrics::new(pins));
    // The egress IP lease is renewed by the controller's probes, on a server of its own.
    let egress = args
        .cluster
        .as_ref()
        .map(|(_, node)| EgressNode::new(node, &args.underlay, args.probe_key_file.clone()));
    if let Some(address) = args.metrics_address {
        // Bound before anything is attached, so a taken port fails the start loudly.
        let listener = dataplane_user::http::bind(address)?;
        let figures = Arc::clone(&metrics);
        metrics::spawn(
            listener,
            metrics.clone(),
            Arc::new(move || figures.heartbeat.check()),
        )
        .context("starting the metrics server")?;
    }
    let mut pod_ifaces = args.pod_ifaces.clone();
    let mut cluster = None;
    if let (Some((source, node)), Some(egress)) = (&args.cluster, egress) {
        preflight::check_forwarding()?;
        dataplane_user::lb::reserve_snat_ports()?;
        let mut events = None;
        let source = match source {
            SourceArg::Manifests(dir) => {
                let _entered = runtime.enter();
                // The other nodes' pod status records go there: made now, so inotify follows
                // it from the start (a directory made later could be written into before its
                // watch is added).
                let status_dir = dir.join(cni::status::POD_STATUS_DIR);
                if let Err(error) = std::fs::create_dir_all(&status_dir) {
                    tracing::warn!(dir = %status_dir.display(), %error, "making the pod status directory");
                }
                let watch = match source::ManifestWatch::start(dir) {
                    Ok(watch) => Some(watch),
                    Err(error) => {
                        tracing::warn!(
                            error = format!("{error:#}"),
                            "manifest directory looked at every second instead"
                        );
                        None
                    }
                };
                Source::Manifests {
                    dir: dir.clone(),
                    own_status: cni::status::status_file(dir, node),
                    fingerprint: Vec::new(),
                    parsed: source::ManifestCache::default(),
                    watch,
                }
            }
            SourceArg::Kubernetes(kubeconfig) => {
                let client = runtime.block_on(kubernetes::client(kubeconfig.as_deref()))?;
                let _entered = runtime.enter();
                let source = KubeSource::start(&client);
                // Refusals told as Events on the objects, from a task of their own.
                events = Some(dataplane_user::rejected::EventSender::start(
                    client.clone(),
                    node,
                ));
                runtime.block_on(source.wait_ready());
                tracing::info!("API server lists received");
                Source::Kubernetes(Box::new(source))
            }
        };
        let cni = CniPods::open(&args.ipam_file)?.with_netns_dirs(args.cni_netns_dirs.clone());
        let mut watched = Cluster {
            cni,
            node_pods: NodePods::default(),
            warnings: Vec::new(),
            source,
            node: node.clone(),
            underlay: args.underlay.clone(),
            underlay_index,
            xdp_forward: xdp_forward_allowed(&args.underlay, args.xdp_forward),
            dns_server: args.dns_server,
            dns_cache: run_dir.join(acl::dns::CACHE_FILE),
            audit_log: args.audit_log.clone(),
            acl_rules: run_dir.join(acl::explain::RULES_DIR),
            named_ifaces: args.pod_ifaces.clone(),
            lb: lb::LbState::default(),
            firewalls: None,
            hosted_lists: Default::default(),
            rejected: Vec::new(),
            egress,
            gateway_script: None,
            egress_status: None,
            last: None,
            model: None,
            overlay_written: None,
            services: Default::default(),
            policy_pods: Default::default(),
            policy_pods_follow_last: false,
            hosted_pods: Default::default(),
            service_errors: Vec::new(),
            multicast_errors: Vec::new(),
            events,
            external_ip_cidrs: args.external_ip_cidrs.clone(),
            multicast_settings: dataplane_user::multicast::Settings {
                key_file: Some(args.probe_key_file.clone()),
                ..args.multicast.clone()
            },
            multicast: None,
            run_dir: run_dir.to_path_buf(),
        };
        let started = Instant::now();
        let synced = runtime.block_on(watched.sync(&mut dataplane, true));
        metrics.record_sync(started.elapsed(), synced.is_ok(), &watched.rejected);
        let synced = synced?;
        metrics.record_sync_work(true, &stage_names(&synced), None);
        for iface in synced.interfaces {
            if !pod_ifaces.contains(&iface) {
                pod_ifaces.push(iface);
            }
        }
        watched.publish_pod_status();
        serve_egress_probes(&watched, args.probe_port)?;
        cluster = Some(watched);
    } else {
        // No cluster state: no pod is known behind the named veths.
        let mut ports = std::collections::BTreeMap::new();
        for iface in &pod_ifaces {
            warn_unrestricted(iface);
            ports.insert(preflight::interface_index(iface)?, port::unrestricted());
        }
        dataplane.write_ports(&ports)?;
    }
    let mut agent = AgentState {
        pid: std::process::id(),
        pin_root: pins.root().to_owned(),
        layout_version: LAYOUT_VERSION,
        started_unix: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        attachments: vec![
            dataplane.attach_underlay(&args.underlay, args.xdp_mode)?,
            dataplane.attach_underlay_tc(&args.underlay)?,
        ],
        cni: cluster.as_ref().map(|_| state::CniPlaces {
            socket: args.cni_socket.clone(),
            ipam_file: args.ipam_file.clone(),
        }),
    };
    for iface in &pod_ifaces {
        agent.attachments.extend(dataplane.attach_pod(iface)?);
    }
    dataplane.unpin_vanished_links();
    dataplane.release_previous_tails();
    state::write(run_dir, &agent)?;
    // The CNI plugin is served once this node's state is in the maps: until then STATUS
    // says the network is not ready.
    let jobs = match &cluster {
        Some(_) => {
            let _entered = runtime.enter();
            let listener = cni::server::bind(&args.cni_socket).with_context(|| {
                format!(
                    "listening for the CNI plugin at {}",
                    args.cni_socket.display()
                )
            })?;
            let (queue, jobs) = tokio::sync::mpsc::unbounded_channel();
            runtime.spawn(cni::server::accept(listener, queue));
            tracing::info!(socket = %args.cni_socket.display(), "serving the CNI plugin");
            if let Some(dir) = &args.cni_conf_dir {
                let written = cni::write_conflist(dir, &args.cni_socket).with_context(|| {
                    format!("writing the CNI configuration into {}", dir.display())
                })?;
                tracing::info!(file = %written.display(), "CNI configuration written");
            }
            Some(jobs)
        }
        None => None,
    };
    tracing::info!(pin_root = %pins.root().display(), "dataplane running");

    let served = runtime.block_on(serve(
        &mut dataplane,
        cluster,
        jobs,
        &mut agent,
        run_dir,
        &metrics,
        Periods {
            look_every: args.look_every,
            full_every: args.full_every,
        },
    ));
    if args.cluster.is_some() {
        let _ = std::fs::remove_file(&args.cni_socket);
    }
    served?;

    // The links, maps and programs stay pinned: the programs keep forwarding with the last
    // state until the next agent takes them over (or `dataplane cleanup` detaches them).
    drop(dataplane);
    state::remove(run_dir);
    tracing::info!("exiting; programs stay attached through their pinned links");
    Ok(())
}

/// Answers the egress IP controller's probes on this node's InternalIPs (the controller
/// probes them there; pods' addresses are refused, and nothing else of the node listens).
fn serve_egress_probes(cluster: &Cluster, port: u16) -> anyhow::Result<()> {
    if port == 0 {
        tracing::info!("egress IP probes not answered (--probe-port 0)");
        return Ok(());
    }
    let addresses = cluster
        .model
        .as_ref()
        .and_then(|m| m.view.this_node_view())
        .map(|n| n.addresses.clone())
        .unwrap_or_default();
    if addresses.is_empty() {
        tracing::warn!("this node has no InternalIP: egress IP probes not answered");
    }
    for address in addresses {
        let listener = dataplane_user::http::bind(std::net::SocketAddr::new(address, port))?;
        egressip::node::serve_probes(listener, Arc::clone(&cluster.egress.lease))
            .context("starting the egress IP probe server")?;
    }
    Ok(())
}

/// `dataplane controller`: the egress IP controller, until SIGINT or SIGTERM.
fn run_controller(options: ControllerOptions) -> anyhow::Result<()> {
    let ControllerOptions {
        manifests,
        kubernetes: _,
        kubeconfig,
        probe_port,
        probe_key_file,
        metrics_address,
        lease_namespace,
        identity,
        lease_duration_seconds,
    } = options;
    use egressip::controller::{self, ControllerMetrics, LeaseOptions};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let figures = Arc::new(std::sync::Mutex::new(ControllerMetrics::new()));
        if let Some(address) = metrics_address {
            let listener = dataplane_user::http::bind(address)?;
            metrics::spawn(listener, figures.clone(), Arc::new(|| Ok(())))
                .context("starting the metrics server")?;
        }
        let work = async {
            match manifests {
                Some(dir) => {
                    tracing::info!(dir = %dir.display(), "egress IP controller on manifests");
                    let key_file = probe_key_file
                        .unwrap_or_else(|| dir.join(egressip::probe::MANIFEST_KEY_FILE));
                    if let Some(parent) = key_file.parent() {
                        std::fs::create_dir_all(parent)
                            .with_context(|| format!("making {}", parent.display()))?;
                    }
                    let key = egressip::probe::ProbeKey::read_or_make(&key_file)?;
                    let probe = controller::ProbeSettings {
                        port: probe_port,
                        key: Arc::new(key),
                        epoch: 0,
                    };
                    controller::run_manifests(dir, probe, figures)
                        .await
                        .map_err(anyhow::Error::msg)
                }
                None => {
                    let client = kubernetes::client(kubeconfig.as_deref()).await?;
                    let identity = match identity {
                        Some(identity) => identity,
                        None => netdev::host_name().context("reading the host name")?,
                    };
                    tracing::info!(identity, "egress IP controller on the API server");
                    let lease = LeaseOptions {
                        namespace: lease_namespace,
                        identity,
                        duration: std::time::Duration::from_secs(lease_duration_seconds),
                    };
                    let key_file = probe_key_file
                        .unwrap_or_else(|| PathBuf::from(egressip::probe::DEFAULT_KEY_FILE));
                    let key = egressip::probe::ProbeKey::read(&key_file).with_context(|| {
                        "the probe key (create the Secret dataplane-probe-key, as the README's install says)"
                    })?;
                    controller::run_kubernetes(client, lease, probe_port, Arc::new(key), figures)
                        .await;
                    Ok::<(), anyhow::Error>(())
                }
            }
        };
        let mut terminate =
            signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
        tokio::select! {
            done = work => done,
            _ = terminate.recv() => Ok(()),
            _ = interrupt.recv() => Ok(()),
        }
    })?;
    tracing::info!("controller stopping");
    Ok(())
}

/// How often the agent applies the egress IP lease and status between syncs.
const EGRESS_TICK: std::time::Duration = std::time::Duration::from_millis(100);

/// How often the serving loop looks at the cluster without a reported change, and runs a
/// full recompute.
struct Periods {
    look_every: std::time::Duration,
    full_every: std::time::Duration,
}

/// What woke the serving loop.
enum Event {
    Stop,
    /// A CNI request, and any others queued behind it.
    Cni(Job),
    Firewalls(Wake),
    Multicast(dataplane_user::multicast::Wake),
    /// Time to look whether the cluster changed (and sync if it did).
    Tick,
    /// The source reported a change: a look follows once the burst settles.
    SourceChanged,
    /// Time to look at the egress IP lease and status.
    Egress,
    /// Time to re-read everything and run every stage.
    FullSync,
}

/// Runs until SIGINT or SIGTERM: refreshes the firewalls' DNS names when they are due, writes
/// audit records as they come, and when the source reports a change looks at it, syncing what
/// they say (tc is attached to new pods' veths). A failed sync is logged; the maps keep the
/// last good state and the next change is tried again.
/// How long a burst of source events is let settle before the sync they cause.
const DEBOUNCE: std::time::Duration = std::time::Duration::from_millis(100);
/// How often a manifest directory is looked at when inotify is not available.
const POLL: std::time::Duration = std::time::Duration::from_secs(1);

async fn serve(
    dataplane: &mut Dataplane,
    mut cluster: Option<Cluster>,
    mut jobs: Option<tokio::sync::mpsc::UnboundedReceiver<Job>>,
    agent: &mut AgentState,
    run_dir: &std::path::Path,
    metrics: &Metrics,
    periods: Periods,
) -> anyhow::Result<()> {
    let Periods {
        look_every,
        full_every,
    } = periods;
    let mut terminate = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    // The sources say when they change; the tick is the safety net (and, where inotify was
    // refused, the way a manifest directory is followed).
    let followed = match cluster.as_ref().map(|c| &c.source) {
        Some(Source::Manifests { watch, .. }) => watch.is_some(),
        _ => true,
    };
    let period = if followed { look_every } else { POLL };
    let mut tick = tokio::time::interval(period);
    // When a reported change is looked at (its burst settled).
    let mut settle: Option<tokio::time::Instant> = None;
    // A lapsed lease must withdraw the egress IPs well within the controller's margin.
    let mut egress_tick = tokio::time::interval(EGRESS_TICK);
    // The safety net of the dependency model: everything re-read, every stage run (the first
    // tick, at once, is skipped: the start was a full sync).
    let mut full_tick = tokio::time::interval(full_every);
    full_tick.tick().await;
    loop {
        let firewalls = cluster.as_ref().and_then(|c| c.firewalls.as_ref());
        let wake = async {
            match firewalls {
                Some(agent) => agent.wait().await,
                None => std::future::pending().await,
            }
        };
        let multicast = cluster.as_ref().and_then(|c| c.multicast.as_ref());
        let multicast_wake = async {
            match multicast {
                Some(agent) => agent.wait().await,
                None => std::future::pending().await,
            }
        };
        // The API's watches and the manifest directory's inotify events say when it changed.
        // (Only the wait itself may be cancelled by another event: the debounce is a deadline
        // of its own, which no other event can lose.)
        let source_changed = async {
            match cluster.as_ref().map(|c| &c.source) {
                Some(Source::Kubernetes(kube)) => kube.wait_changed().await,
                Some(Source::Manifests {
                    watch: Some(watch), ..
                }) => watch.wait_changed().await,
                _ => std::future::pending().await,
            }
        };
        // A burst of events (a rollout, a re-list, a file written in steps) becomes one look.
        let settled = async {
            match settle {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let job = async {
            match jobs.as_mut() {
                Some(jobs) => jobs.recv().await,
                None => std::future::pending().await,
            }
        };
        let event = tokio::select! {
            _ = terminate.recv() => Event::Stop,
            Some(job) = job => Event::Cni(job),
            _ = interrupt.recv() => Event::Stop,
            wake = wake => Event::Firewalls(wake),
            wake = multicast_wake => Event::Multicast(wake),
            _ = source_changed => Event::SourceChanged,
            _ = settled => Event::Tick,
            _ = tick.tick() => Event::Tick,
            _ = egress_tick.tick() => Event::Egress,
            _ = full_tick.tick() => Event::FullSync,
        };
        metrics.heartbeat.beat();
        if let Event::SourceChanged = event {
            settle.get_or_insert_with(|| tokio::time::Instant::now() + DEBOUNCE);
            continue;
        }
        if let Event::Tick = event {
            settle = None;
        }
        let Some(cluster) = cluster.as_mut() else {
            if let Event::Stop = event {
                tracing::info!("stopping");
                return Ok(());
            }
            continue;
        };
        match event {
            Event::Stop => {
                tracing::info!("stopping");
                return Ok(());
            }
            Event::Firewalls(wake) => {
                if let Some(firewalls) = cluster.firewalls.as_mut()
                    && let Err(error) = firewalls.handle(dataplane, wake).await
                {
                    // The maps keep what they had; the next refresh tries again.
                    tracing::error!(error = %anyhow::Error::from(error), "updating the access control");
                }
            }
            Event::Multicast(wake) => {
                if let Some(multicast) = cluster.multicast.as_mut()
                    && let Err(error) = multicast.handle(dataplane, wake)
                {
                    tracing::error!(error = %anyhow::Error::from(error), "updating multicast groups");
                }
            }
            Event::Cni(job) => {
                let mut batch = vec![job];
                if let Some(jobs) = jobs.as_mut() {
                    while let Ok(job) = jobs.try_recv() {
                        batch.push(job);
                    }
                }
                handle_cni(dataplane, cluster, agent, run_dir, metrics, batch).await;
            }
            Event::Tick if cluster.changed() => {
                tracing::info!(
                    source = cluster.source.describe(),
                    "cluster changed; syncing"
                );
                sync_taking_lag(dataplane, cluster, agent, run_dir, metrics, false).await;
            }
            // What woke the agent changed nothing it reads (its own writes, say): its time
            // is no start of a later change's lag.
            Event::Tick => {
                cluster.source.take_first_change();
            }
            // Handled before: it only sets when to look.
            Event::SourceChanged => {}
            Event::FullSync => {
                sync_taking_lag(dataplane, cluster, agent, run_dir, metrics, true).await;
            }
            Event::Egress => {
                if let Err(error) = cluster.refresh_egress(dataplane) {
                    tracing::error!(error = format!("{error:#}"), "applying the egress IPs");
                }
            }
        }
    }
}

/// A sync the serving loop runs (`full`: the periodic full recompute): the source's first
/// unsynced change starts its lag; a failure is logged and the last good state stays.
async fn sync_taking_lag(
    dataplane: &mut Dataplane,
    cluster: &mut Cluster,
    agent: &mut AgentState,
    run_dir: &std::path::Path,
    metrics: &Metrics,
    full: bool,
) {
    let first_change = cluster.source.take_first_change();
    match sync_and_attach(dataplane, cluster, agent, run_dir, metrics, full).await {
        Ok(_) => {
            if let Some(first) = first_change {
                metrics.record_sync_lag(first.elapsed());
            }
        }
        Err(error) => tracing::error!(
            error = format!("{error:#}"),
            full,
            "sync failed; the last good state stays in force"
        ),
    }
}

/// Syncs the maps with the cluster state (`full`: everything re-read, every stage run) and
/// attaches tc to new pods' veths; returns the local pods' host-side veths. What a full sync
/// had to write is counted as changes the incremental syncs missed.
async fn sync_and_attach(
    dataplane: &mut Dataplane,
    cluster: &mut Cluster,
    agent: &mut AgentState,
    run_dir: &std::path::Path,
    metrics: &Metrics,
    full: bool,
) -> anyhow::Result<Vec<String>> {
    let started = Instant::now();
    let synced = cluster.sync(dataplane, full).await;
    let sync_took = started.elapsed();
    metrics.record_sync(sync_took, synced.is_ok(), &cluster.rejected);
    let synced = synced?;
    // Differences count only when the cluster read the same as at the last sync: then the
    // maps should have held it already.
    let differences = (full && !synced.unsynced).then_some(synced.written);
    match differences {
        Some(0) => tracing::info!("full recompute: the maps already held the cluster state"),
        Some(written) => tracing::warn!(
            differences = written,
            "the full recompute changed the maps: the incremental syncs had missed a change"
        ),
        None if full => tracing::info!(
            written = synced.written,
            "full recompute, with changes not yet synced"
        ),
        None => {}
    }
    metrics.record_sync_work(synced.full, &stage_names(&synced), differences);
    let interfaces = synced.interfaces;
    attach_new_pods(dataplane, agent, run_dir, &interfaces);
    tracing::debug!(
        sync_ms = sync_took.as_millis(),
        attach_ms = (started.elapsed() - sync_took).as_millis(),
        "synced and attached"
    );
    Ok(interfaces)
}

fn stage_names(synced: &cluster::Synced) -> Vec<&'static str> {
    synced.stages.iter().map(|s| s.name()).collect()
}

/// Whether both of the pod programs are attached to `iface`.
fn programs_attached(agent: &AgentState, iface: &str) -> bool {
    agent
        .attachments
        .iter()
        .filter(|a| a.interface == iface)
        .count()
        >= 2
}

/// Serves a batch of CNI requests: wires every ADD, removes every DEL, then syncs once, so
/// the new pods' overlay entries, policies and services are in the maps and their programs
/// attached; only then are ADDs answered. An ADD whose pod did not make it into the maps is
/// undone and fails, naming why.
async fn handle_cni(
    dataplane: &mut Dataplane,
    cluster: &mut Cluster,
    agent: &mut AgentState,
    run_dir: &std::path::Path,
    metrics: &Metrics,
    batch: Vec<Job>,
) {
    let batch_started = Instant::now();
    let mut deleted = Vec::new();
    let mut added = Vec::new();
    let mut answered_after_sync = Vec::new();
    let mut changed = false;
    for job in batch {
        match job.request.clone() {
            Request::Status => answer(metrics, job, Reply::Done),
            Request::Add(target) => match cluster.cni.add(&target, &cluster.node_pods) {
                Ok(attachment) => {
                    tracing::info!(
                        container = target.container_id,
                        pod = ?target.pod,
                        host_iface = attachment.host_iface,
                        addresses = ?attachment.addresses,
                        "CNI ADD wired"
                    );
                    added.push((job, target, attachment));
                    changed = true;
                }
                Err(error) => {
                    tracing::warn!(container = target.container_id, %error, "CNI ADD failed");
                    answer(metrics, job, Reply::Failed(error));
                }
            },
            Request::Del(target) => deleted.push((job, target)),
            Request::Check(target) => {
                let reply = match cluster.cni.check(&target, &cluster.node_pods) {
                    Ok(attachment) if !programs_attached(agent, &attachment.host_iface) => {
                        Reply::Failed(CniError::new(
                            code::CHECK_FAILED,
                            format!(
                                "the dataplane programs are not attached to {}",
                                attachment.host_iface
                            ),
                        ))
                    }
                    Ok(attachment) => Reply::Attached(attachment),
                    Err(error) => Reply::Failed(error),
                };
                answer(metrics, job, reply);
            }
            Request::Gc(valid) => match cluster.cni.gc(&valid) {
                Ok(released) => {
                    changed |= released > 0;
                    answered_after_sync.push((job, Reply::Done));
                }
                Err(error) => answer(metrics, job, Reply::Failed(error)),
            },
        }
    }
    // The batch's DELs together: their veths go in one kernel operation.
    if !deleted.is_empty() {
        let targets: Vec<(String, String)> = deleted
            .iter()
            .map(|(_, t)| (t.container_id.clone(), t.ifname.clone()))
            .collect();
        match cluster.cni.del_many(&targets) {
            Ok(removed) => {
                for ((job, target), removed) in deleted.into_iter().zip(removed) {
                    tracing::info!(container = target.container_id, removed, "CNI DEL");
                    changed |= removed;
                    answered_after_sync.push((job, Reply::Done));
                }
            }
            Err(error) => {
                for (job, _) in deleted {
                    answer(metrics, job, Reply::Failed(error.clone()));
                }
            }
        }
    }
    if changed {
        tracing::debug!(
            requests = added.len() + answered_after_sync.len(),
            wiring_ms = batch_started.elapsed().as_millis(),
            "CNI batch wired"
        );
        let synced = sync_and_attach(dataplane, cluster, agent, run_dir, metrics, false).await;
        cluster.publish_pod_status();
        let mut undone = false;
        for (job, target, attachment) in added {
            let installed = match &synced {
                Ok(interfaces) => {
                    interfaces.contains(&attachment.host_iface)
                        && programs_attached(agent, &attachment.host_iface)
                }
                Err(_) => false,
            };
            if installed {
                answer(metrics, job, Reply::Attached(attachment));
                continue;
            }
            let why = match &synced {
                Err(error) => format!("the sync failed: {error:#}"),
                Ok(_) => {
                    let name = target
                        .pod
                        .as_ref()
                        .map(|p| format!("{}/{}", p.namespace, p.name))
                        .unwrap_or_default();
                    let related: Vec<&str> = cluster
                        .warnings
                        .iter()
                        .filter(|w| !name.is_empty() && w.contains(&name))
                        .map(String::as_str)
                        .collect();
                    format!(
                        "the pod is not among the node's wired pods ({})",
                        related.join("; ")
                    )
                }
            };
            tracing::error!(container = target.container_id, why, "CNI ADD undone");
            if let Err(error) = cluster.cni.del(&target.container_id, &target.ifname) {
                tracing::error!(%error, "undoing a CNI ADD");
            }
            undone = true;
            answer(
                metrics,
                job,
                Reply::Failed(CniError::new(
                    code::NOT_INSTALLED,
                    format!(
                        "the pod's dataplane state could not be installed, so it gets no interface: {why}"
                    ),
                )),
            );
        }
        if undone {
            cluster.publish_pod_status();
            if let Err(error) =
                sync_and_attach(dataplane, cluster, agent, run_dir, metrics, false).await
            {
                tracing::error!(error = format!("{error:#}"), "sync after undoing an ADD");
            }
        }
    }
    for (job, reply) in answered_after_sync {
        answer(metrics, job, reply);
    }
}

/// Answers a CNI request and counts it in the metrics.
fn answer(metrics: &Metrics, job: Job, reply: Reply) {
    let error = match &reply {
        Reply::Failed(error) => Some(error.code),
        _ => None,
    };
    metrics.record_cni(job.command(), error, job.received.elapsed());
    job.answer(reply);
}

/// Attaches tc to the veths of pods that appeared, and records them in the state file.
fn attach_new_pods(
    dataplane: &mut Dataplane,
    agent: &mut AgentState,
    run_dir: &std::path::Path,
    interfaces: &[String],
) {
    // Veths that went away (their pods deleted) or were recreated under the same name.
    let before = agent.attachments.len();
    agent
        .attachments
        .retain(|a| preflight::interface_index(&a.interface).ok() == Some(a.ifindex));
    let mut added = agent.attachments.len() != before;
    dataplane.unpin_vanished_links();
    for iface in interfaces {
        if agent.attachments.iter().any(|a| &a.interface == iface) {
            continue;
        }
        match dataplane.attach_pod(iface) {
            Ok(attachments) => {
                agent.attachments.extend(attachments);
                added = true;
            }
            Err(error) => tracing::error!(iface, %error, "attaching to a new pod"),
        }
    }
    if added && let Err(error) = state::write(run_dir, agent) {
        tracing::warn!(%error, "updating the state file");
    }
}

/// `--xdp-forward`: whether XDP may send frames back out of the underlay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum XdpForward {
    Auto,
    On,
    Off,
}

/// Resolves `--xdp-forward` for `underlay`, saying what was decided and why.
fn xdp_forward_allowed(underlay: &str, choice: XdpForward) -> bool {
    let allowed = match choice {
        XdpForward::On => true,
        XdpForward::Off => false,
        // A veth hands XDP_TX frames to its peer only when the peer polls (NAPI: GRO or an
        // XDP program on it), which this node cannot see or change.
        XdpForward::Auto => match netdev::driver(underlay) {
            Ok(driver) => driver != "veth",
            Err(error) => {
                tracing::warn!(underlay, %error, "cannot read the underlay's driver");
                false
            }
        },
    };
    tracing::info!(
        underlay,
        choice = ?choice,
        allowed,
        "NodePort forwarding to remote backends in XDP"
    );
    allowed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The DaemonSet's agent arguments are ones this binary takes, the map sizes at their
    /// stated defaults.
    #[test]
    fn the_daemonsets_agent_arguments_parse_with_the_map_sizes_at_their_defaults() {
        let text = include_str!("../../deploy/daemonset.yaml");
        let daemonset: k8s_openapi::api::apps::v1::DaemonSet =
            serde_yaml::from_str(text).expect("DaemonSet");
        let spec = daemonset
            .spec
            .expect("spec")
            .template
            .spec
            .expect("pod spec");
        let agent = spec
            .containers
            .iter()
            .find(|c| c.name == "agent")
            .expect("agent container");
        let args = agent.args.iter().flatten().map(|a| {
            a.replace("$(NODE_NAME)", "node0")
                .replace("$(UNDERLAY)", "eth0")
        });
        let cli = Cli::try_parse_from(std::iter::once("dataplane".to_owned()).chain(args))
            .unwrap_or_else(|e| panic!("{e}"));
        let Command::Run(options) = cli.command else {
            panic!("the agent runs `dataplane run`");
        };
        assert_eq!(
            options.capacities,
            dataplane_user::capacity::Capacities::default()
        );
    }

    /// The init container's and the controller's arguments parse whole too, each as the
    /// subcommand it is meant to run.
    #[test]
    fn the_install_and_controller_arguments_parse() {
        let parse = |args: &[String]| {
            Cli::try_parse_from(std::iter::once("dataplane").chain(args.iter().map(String::as_str)))
                .unwrap_or_else(|e| panic!("{args:?}: {e}"))
        };
        let daemonset: k8s_openapi::api::apps::v1::DaemonSet =
            serde_yaml::from_str(include_str!("../../deploy/daemonset.yaml")).expect("DaemonSet");
        let pod = daemonset
            .spec
            .expect("spec")
            .template
            .spec
            .expect("pod spec");
        let install = pod
            .init_containers
            .iter()
            .flatten()
            .find(|c| c.name == "install-cni")
            .and_then(|c| c.args.clone())
            .expect("install-cni args");
        assert!(matches!(
            parse(&install).command,
            Command::InstallCni { bin_dir, plugin: None } if bin_dir == std::path::Path::new("/host/opt/cni/bin")
        ));
        let controller_yaml = include_str!("../../deploy/controller.yaml");
        let deployment = serde_yaml::Deserializer::from_str(controller_yaml)
            .filter_map(|document| {
                let value =
                    <serde_yaml::Value as serde::Deserialize>::deserialize(document).ok()?;
                (value["kind"] == "Deployment").then_some(value)
            })
            .next()
            .expect("the controller's Deployment");
        let deployment: k8s_openapi::api::apps::v1::Deployment =
            serde_yaml::from_value(deployment).expect("Deployment");
        let args = deployment
            .spec
            .and_then(|s| s.template.spec)
            .and_then(|p| p.containers.into_iter().next())
            .and_then(|c| c.args)
            .expect("controller args");
        assert!(matches!(parse(&args).command, Command::Controller(_)));
    }
}
