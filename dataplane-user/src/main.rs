//! `dataplane`: the node agent and its operator commands.

use std::{
    path::PathBuf,
    process::ExitCode,
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use dataplane_common::maps::LAYOUT_VERSION;
use dataplane_user::{
    Dataplane, Pins,
    acl::{
        self,
        agent::{FirewallAgent, FirewallInputs},
    },
    attach::XdpModeChoice,
    lb, model, netdev,
    overlay::{self, Underlay},
    pins::DEFAULT_PIN_ROOT,
    preflight, source,
    state::{self, AgentState, DEFAULT_RUN_DIR},
    status,
};
use tokio::signal::unix::{SignalKind, signal};

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
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load the programs, attach them, and run until SIGINT or SIGTERM; then detach.
    Run {
        /// The node's underlay NIC (XDP is attached here).
        #[arg(long)]
        underlay: String,
        /// Host-side veth of a local pod (tc is attached to its ingress); repeatable.
        #[arg(long = "pod-iface")]
        pod_ifaces: Vec<String>,
        /// XDP attach mode: auto tries offload, then native, then generic.
        #[arg(long, value_enum, default_value_t = XdpModeChoice::Auto)]
        xdp_mode: XdpModeChoice,
        /// Directory of Kubernetes YAML manifests (Nodes, Pods, the operator Network): the
        /// cluster state the overlay is built from. Local pods' veths are found and attached.
        #[arg(long, requires = "node_name")]
        manifests: Option<PathBuf>,
        /// This node's name among the manifests' Nodes.
        #[arg(long)]
        node_name: Option<String>,
        /// Name server for EgressFirewall dnsName rules (default: the node's
        /// /etc/resolv.conf).
        #[arg(long)]
        dns_server: Option<std::net::IpAddr>,
        /// The ACL audit log file (rotated as policyAuditConfig says).
        #[arg(long, default_value = DEFAULT_AUDIT_LOG)]
        audit_log: PathBuf,
    },
    /// Show what is attached where, map fill levels and packet/drop counters.
    Status {
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Remove every pin under the pin root (drops all adopted state).
    Cleanup,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: log files and collectors get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match dispatch(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn dispatch(cli: Cli) -> anyhow::Result<()> {
    let pins = Pins::new(&cli.pin_root);
    match cli.command {
        Command::Run {
            underlay,
            pod_ifaces,
            xdp_mode,
            manifests,
            node_name,
            dns_server,
            audit_log,
        } => run(
            &pins,
            &cli.run_dir,
            &RunArgs {
                underlay,
                pod_ifaces,
                xdp_mode,
                cluster: manifests.zip(node_name),
                dns_server,
                audit_log,
            },
        ),
        Command::Status { json } => {
            let report = status::collect(&pins, &cli.run_dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", status::render(&report));
            }
            Ok(())
        }
        Command::Cleanup => {
            pins.remove_all()?;
            state::remove(&cli.run_dir);
            println!("removed pins under {}", pins.root().display());
            Ok(())
        }
    }
}

struct RunArgs {
    underlay: String,
    pod_ifaces: Vec<String>,
    xdp_mode: XdpModeChoice,
    /// Manifest directory and this node's name.
    cluster: Option<(PathBuf, String)>,
    dns_server: Option<std::net::IpAddr>,
    audit_log: PathBuf,
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
    let mut dataplane = Dataplane::load(pins)?;
    let mut pod_ifaces = args.pod_ifaces.clone();
    let mut firewalls = None;
    if let Some((dir, node)) = &args.cluster {
        let configured = configure_cluster(
            &runtime,
            &mut dataplane,
            dir,
            node,
            &args.underlay,
            underlay_index,
            args,
        )?;
        for iface in configured.pod_interfaces {
            if !pod_ifaces.contains(&iface) {
                pod_ifaces.push(iface);
            }
        }
        firewalls = Some(configured.firewalls);
    }
    let mut attachments = vec![
        dataplane.attach_underlay(&args.underlay, args.xdp_mode)?,
        dataplane.attach_underlay_tc(&args.underlay)?,
    ];
    for iface in &pod_ifaces {
        attachments.extend(dataplane.attach_pod(iface)?);
    }
    let started_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    state::write(
        run_dir,
        &AgentState {
            pid: std::process::id(),
            pin_root: pins.root().to_owned(),
            layout_version: LAYOUT_VERSION,
            started_unix,
            attachments,
        },
    )?;
    tracing::info!(pin_root = %pins.root().display(), "dataplane running");

    runtime.block_on(serve(&mut dataplane, firewalls))?;

    // Dropping the loaded object detaches every program this agent attached; maps stay pinned
    // for the next agent.
    drop(dataplane);
    state::remove(run_dir);
    tracing::info!("detached, exiting");
    Ok(())
}

/// What configuring from the cluster's state left running.
struct Configured {
    /// Host-side interfaces of the local pods (tc is attached to each).
    pod_interfaces: Vec<String>,
    firewalls: FirewallAgent,
}

/// Reads the manifests, builds this node's view, and syncs the overlay, load-balancer and
/// firewall maps.
fn configure_cluster(
    runtime: &tokio::runtime::Runtime,
    dataplane: &mut Dataplane,
    dir: &std::path::Path,
    node: &str,
    underlay: &str,
    underlay_index: u32,
    args: &RunArgs,
) -> anyhow::Result<Configured> {
    preflight::check_forwarding()?;
    let state = source::read_dir(dir)?;
    for rejected in &state.rejected {
        tracing::warn!(%rejected, "manifest object skipped");
    }
    let mtu = netdev::mtu(underlay).with_context(|| format!("reading the MTU of {underlay}"))?;
    let mac = netdev::mac(underlay).with_context(|| format!("reading the MAC of {underlay}"))?;
    let settings = state.network.unwrap_or_default().validate(mtu)?;
    warn_without_gro(underlay);
    let underlay = Underlay {
        ifindex: underlay_index,
        mac,
    };
    let model = model::build(&state, node, underlay, settings, host_interface);
    for warning in &model.warnings {
        tracing::warn!(%warning, "cluster state");
    }
    let desired = overlay::compile(&model.view)?;
    let stats = dataplane.sync_overlay(&desired)?;
    tracing::info!(
        node,
        geneve_port = settings.geneve_port,
        pod_mtu = settings.pod_mtu,
        nodes = model.view.nodes.len(),
        local_pods = model.view.local_pods.len(),
        cluster_networks = ?state.cluster_networks,
        service_networks = ?state.service_networks,
        written = stats.written,
        deleted = stats.deleted,
        "overlay configured"
    );
    configure_services(dataplane, &state, node)?;
    let inputs = FirewallInputs {
        objects: state.egress_firewalls.clone(),
        policies: state.network_policies.clone(),
        cluster_pods: acl::policy::PolicyPod::from_pods(&state.pods),
        namespaces: state.namespaces.clone(),
        context: acl::firewall::context(&state, &model.view),
        pods: acl::pods_of(&model.view),
        dns_server: args.dns_server,
        audit: state.policy_audit.clone(),
        audit_path: args.audit_log.clone(),
    };
    let firewalls = runtime.block_on(FirewallAgent::start(dataplane, inputs))?;
    Ok(Configured {
        pod_interfaces: model.pod_interfaces,
        firewalls,
    })
}

/// Compiles the Services and EndpointSlices and syncs the load-balancer maps, taking over what a
/// previous agent left pinned.
fn configure_services(
    dataplane: &mut Dataplane,
    state: &source::ClusterState,
    node: &str,
) -> anyhow::Result<()> {
    let compiled = lb::compile_services(&state.services, &state.endpoint_slices, node);
    for error in &compiled.errors {
        tracing::warn!(%error, "service skipped");
    }
    let mut lb_state = lb::LbState::default();
    dataplane.adopt_lb(&mut lb_state)?;
    let stats = dataplane.sync_lb(&mut lb_state, &compiled.ports)?;
    tracing::info!(
        service_ports = stats.services,
        backends = stats.backends,
        written = stats.written,
        deleted = stats.deleted,
        "services configured"
    );
    Ok(())
}

/// The host interface a pod address is routed to, in this node's namespace.
fn host_interface(ip: std::net::IpAddr) -> Option<model::HostInterface> {
    let name = netdev::host_route_device(ip)?;
    Some(model::HostInterface {
        ifindex: preflight::interface_index(&name).ok()?,
        mac: netdev::mac(&name).ok()?,
        name,
    })
}

/// Runs until SIGINT or SIGTERM, refreshing the firewalls' DNS names when they are due and
/// writing audit records as they come.
async fn serve(
    dataplane: &mut Dataplane,
    mut firewalls: Option<FirewallAgent>,
) -> anyhow::Result<()> {
    let mut terminate = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    loop {
        let work = async {
            match firewalls.as_mut() {
                Some(agent) => agent.step(dataplane).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = terminate.recv() => {
                tracing::info!("SIGTERM received");
                return Ok(());
            }
            _ = interrupt.recv() => {
                tracing::info!("SIGINT received");
                return Ok(());
            }
            result = work => {
                if let Err(error) = result {
                    // The maps keep what they had; the next refresh tries again.
                    tracing::error!(error = %anyhow::Error::from(error), "updating the egress firewalls");
                }
            }
        }
    }
}

/// Decapsulated frames go up the stack one wire frame at a time; without GRO on the underlay
/// the receiving pods' TCP pays for each of them (measured here: 2.4 against 4.3 Gbit/s).
fn warn_without_gro(underlay: &str) {
    match netdev::gro_enabled(underlay) {
        Ok(true) => {}
        Ok(false) => tracing::warn!(
            underlay,
            "GRO is off on the underlay: decapsulated pod traffic will not be merged (ethtool -K {underlay} gro on)"
        ),
        Err(error) => tracing::debug!(underlay, %error, "cannot read the GRO setting"),
    }
}
