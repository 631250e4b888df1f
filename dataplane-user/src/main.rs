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
    pins::DEFAULT_PIN_ROOT,
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
        } => run(&pins, &cli.run_dir, &underlay, &pod_ifaces, xdp_mode),
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

fn run(
    pins: &Pins,
    run_dir: &std::path::Path,
    underlay: &str,
    pod_ifaces: &[String],
    xdp_mode: XdpModeChoice,
) -> anyhow::Result<()> {
    // Name a missing interface before loading anything.
    dataplane_user::preflight::interface_index(underlay)?;
    for iface in pod_ifaces {
        dataplane_user::preflight::interface_index(iface)?;
    }
    let mut dataplane = Dataplane::load(pins)?;
    let mut attachments = vec![dataplane.attach_underlay(underlay, xdp_mode)?];
    for iface in pod_ifaces {
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

async fn wait_for_shutdown() -> anyhow::Result<()> {
    let mut terminate = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    tokio::select! {
        _ = terminate.recv() => tracing::info!("SIGTERM received"),
        _ = interrupt.recv() => tracing::info!("SIGINT received"),
    }
    Ok(())
}
