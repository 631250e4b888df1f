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
    attach::XdpModeChoice,
    lb, model, netdev,
    overlay::{self, Underlay},
    pins::DEFAULT_PIN_ROOT,
    preflight, source,
    state::{self, AgentState, DEFAULT_RUN_DIR},
    status,
};
use tokio::signal::unix::{SignalKind, signal};

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
        } => run(
            &pins,
            &cli.run_dir,
            &RunArgs {
                underlay,
                pod_ifaces,
                xdp_mode,
                cluster: manifests.zip(node_name),
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
}

fn run(pins: &Pins, run_dir: &std::path::Path, args: &RunArgs) -> anyhow::Result<()> {
    // Name a missing interface before loading anything.
    let underlay_index = preflight::interface_index(&args.underlay)?;
    for iface in &args.pod_ifaces {
        preflight::interface_index(iface)?;
    }
    let mut dataplane = Dataplane::load(pins)?;
    let mut pod_ifaces = args.pod_ifaces.clone();
    if let Some((dir, node)) = &args.cluster {
        for iface in configure_overlay(&mut dataplane, dir, node, &args.underlay, underlay_index)? {
            if !pod_ifaces.contains(&iface) {
                pod_ifaces.push(iface);
            }
        }
    }
    let mut attachments = vec![
        dataplane.attach_underlay(&args.underlay, args.xdp_mode)?,
        dataplane.attach_underlay_tc(&args.underlay)?,
    ];
    for iface in &pod_ifaces {
        attachments.push(dataplane.attach_pod(iface)?);
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

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(wait_for_shutdown())?;

    // Dropping the loaded object detaches every program this agent attached; maps stay pinned
    // for the next agent.
    drop(dataplane);
    state::remove(run_dir);
    tracing::info!("detached, exiting");
    Ok(())
}

/// Reads the manifests, builds this node's overlay view, and syncs the overlay maps. Returns
/// the host-side interfaces of the local pods.
fn configure_overlay(
    dataplane: &mut Dataplane,
    dir: &std::path::Path,
    node: &str,
    underlay: &str,
    underlay_index: u32,
) -> anyhow::Result<Vec<String>> {
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
    Ok(model.pod_interfaces)
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

async fn wait_for_shutdown() -> anyhow::Result<()> {
    let mut terminate = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    tokio::select! {
        _ = terminate.recv() => tracing::info!("SIGTERM received"),
        _ = interrupt.recv() => tracing::info!("SIGINT received"),
    }
    Ok(())
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
