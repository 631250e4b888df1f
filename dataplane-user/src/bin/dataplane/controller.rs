//! `dataplane controller`: the cluster-wide controller (egress IP assignment, node subnets
//! where the cluster gives none, the egress routers' objects, the user-defined networks'
//! status), until SIGINT or SIGTERM.

use std::{path::PathBuf, sync::Arc};

use anyhow::Context as _;
use dataplane_user::{
    egressip, egressrouter, kernel::netdev, kubernetes, metrics, userdefinednetwork,
};
use tokio::signal::unix::{SignalKind, signal};

use super::args::ControllerOptions;

/// `dataplane controller`: the egress IP controller, until SIGINT or SIGTERM.
pub(super) fn run_controller(options: ControllerOptions) -> anyhow::Result<()> {
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
        network_config,
        egress_router_image,
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
                    // The EgressRouters' objects are made in their own task beside the egress
                    // IP rounds (its API calls never delay a move), on the leader's state.
                    let (leader_state, states) = tokio::sync::watch::channel(None);
                    // So are the user-defined networks' status writes.
                    let networks = userdefinednetwork::run(
                        states.clone(),
                        userdefinednetwork::KubeNetworks {
                            client: client.clone(),
                        },
                    );
                    let routers = egressrouter::controller::run(
                        states,
                        egress_router_image,
                        egressrouter::controller::KubeRouters {
                            client: client.clone(),
                        },
                    );
                    let egress_ips = controller::run_kubernetes(
                        client,
                        network_config,
                        lease,
                        probe_port,
                        Arc::new(key),
                        figures,
                        leader_state,
                    );
                    tokio::join!(egress_ips, routers, networks);
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
