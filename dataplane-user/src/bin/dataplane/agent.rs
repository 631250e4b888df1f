//! `dataplane run`: the node agent. It loads and attaches the programs, then serves: each
//! change of the cluster state (and a periodic full recompute) synced to the maps, the CNI
//! plugin's requests answered, the egress IP lease applied, the HTTP servers running.

use std::{
    path::PathBuf,
    sync::Arc,
    time::{Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use dataplane_common::maps::{LAYOUT_VERSION, PROG_UNDERLAY};
use dataplane_user::{
    Dataplane, Pins,
    acl::{self, agent::Wake},
    cni::{
        self,
        protocol::{Reply, Request},
        server::{CniPods, Job, NodePods},
        spec::{CniError, code},
    },
    egressip::{self, node::EgressNode},
    kernel::attach::{Attachment, UplinkHook, XdpModeChoice},
    kernel::netdev,
    kernel::preflight,
    kernel::state::{self, AgentState},
    kubernetes::{self, KubeSource},
    lb,
    metrics::{self, Metrics},
    port, source,
};
use tokio::signal::unix::{SignalKind, signal};

use super::args::XdpForward;
use crate::cluster::{Cluster, Source, warn_unrestricted};

pub(super) enum SourceArg {
    Manifests(PathBuf),
    /// The API server, with this kubeconfig or as inferred.
    Kubernetes(Option<PathBuf>),
}

pub(super) struct RunArgs {
    pub(super) underlay: String,
    pub(super) pod_ifaces: Vec<String>,
    pub(super) uplink_hook: UplinkHook,
    pub(super) xdp_mode: XdpModeChoice,
    pub(super) xdp_forward: XdpForward,
    /// Where the cluster state comes from, and this node's name.
    pub(super) cluster: Option<(SourceArg, String)>,
    pub(super) dns_server: Option<std::net::IpAddr>,
    pub(super) audit_log: PathBuf,
    pub(super) metrics_address: Option<std::net::SocketAddr>,
    pub(super) healthz_address: std::net::SocketAddr,
    pub(super) cni_socket: PathBuf,
    pub(super) ipam_file: PathBuf,
    pub(super) cni_netns_dirs: Vec<PathBuf>,
    pub(super) network_config: Option<PathBuf>,
    pub(super) external_ip_cidrs: Vec<ipnet::IpNet>,
    pub(super) nodeport_addresses: dataplane_user::lb::NodePortAddresses,
    pub(super) cni_conf_dir: Option<PathBuf>,
    pub(super) egress_router_reservations:
        Vec<dataplane_user::egressrouter::reservations::Reservation>,
    pub(super) socket_lb: lb::socket::SocketLb,
    pub(super) socket_lb_cgroup: Option<PathBuf>,
    pub(super) socket_lb_host: lb::socket::SocketLbHost,
    pub(super) capacities: dataplane_user::kernel::capacity::Capacities,
    /// How often the cluster state is looked at without a reported change.
    pub(super) look_every: std::time::Duration,
    /// How often everything is re-read and every stage run.
    pub(super) full_every: std::time::Duration,
    pub(super) multicast: dataplane_user::multicast::Settings,
    pub(super) probe_port: u16,
    pub(super) probe_key_file: PathBuf,
}

pub(super) fn run(pins: &Pins, run_dir: &std::path::Path, args: &RunArgs) -> anyhow::Result<()> {
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
    let forward = xdp_forward_decision(&args.underlay, args.xdp_forward);
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
    let proxy_health = Arc::new(lb::ProxyHealth::default());
    let figures = Arc::clone(&metrics);
    lb::serve_proxy_health(
        args.healthz_address,
        &proxy_health,
        Arc::new(move || figures.heartbeat.check()),
    );
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
                let mut source = KubeSource::start(&client);
                if let Some(path) = &args.network_config {
                    source = source.with_network_file(path.clone());
                }
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
            xdp_forward: forward.0,
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
            host_services_script: None,
            services_described: None,
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
            nodeport_addresses: args.nodeport_addresses.clone(),
            nodeport_written: None,
            router_reservations: args.egress_router_reservations.clone(),
            reservations_written: None,
            socket_scope: None,
            multicast_settings: dataplane_user::multicast::Settings {
                key_file: Some(args.probe_key_file.clone()),
                ..args.multicast.clone()
            },
            multicast: None,
            run_dir: run_dir.to_path_buf(),
            health_checks: lb::HealthServers::new().context("the health-check ports' runtime")?,
            proxy_health: Arc::clone(&proxy_health),
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
        attachments: dataplane
            .attach_uplink(&args.underlay, args.uplink_hook, args.xdp_mode)?
            .into_iter()
            .map(|a| {
                if a.program == PROG_UNDERLAY {
                    with_reason(a, &forward.1)
                } else {
                    a
                }
            })
            .collect(),
        cni: cluster.as_ref().map(|_| state::CniPlaces {
            socket: args.cni_socket.clone(),
            ipam_file: args.ipam_file.clone(),
        }),
    };
    for iface in &pod_ifaces {
        agent.attachments.extend(dataplane.attach_pod(iface)?);
    }
    let socket_scope = match cluster.as_ref() {
        Some(_) => start_socket_lb(args, &mut dataplane, &mut agent)?,
        None => None,
    };
    match (socket_scope, cluster.as_mut()) {
        (Some(scope), Some(cluster)) => cluster.socket_scope = Some(scope),
        _ => {
            dataplane.detach_socket_lb();
            lb::socket::clear_scope(&mut dataplane)?;
        }
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
    /// The pods whose DELs were answered are due to leave the maps.
    CniReleasedSync,
    /// The veths of a batch of DELs are gone (or could not be removed).
    CniRemoved(Removed),
    Firewalls(Wake),
    Multicast(dataplane_user::multicast::Wake),
    /// Time to look whether the cluster changed (and sync if it did).
    Tick,
    /// The source reported a change: a look follows once the burst settles.
    SourceChanged,
    /// Time to look at the egress IP lease and status.
    Egress,
    /// Time to try again a look at stale sockets that came due while another ran.
    StaleSockets,
    /// Time to re-read everything and run every stage.
    FullSync,
}

/// Runs until SIGINT or SIGTERM: refreshes the firewalls' DNS names when they are due, writes
/// audit records as they come, and when the source reports a change looks at it, syncing what
/// they say (tc is attached to new pods' veths). A failed sync is logged; the maps keep the
/// last good state and the next change is tried again.
/// How long a burst of source events is let settle before the sync they cause.
const DEBOUNCE: std::time::Duration = std::time::Duration::from_millis(100);
/// How soon a look at stale sockets that came due while another ran is tried again.
const STALE_LOOK_RETRY: std::time::Duration = std::time::Duration::from_millis(250);
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
    // DELs' veth removals, which run off the loop (and may overlap), report here.
    let (report, mut removed) = tokio::sync::mpsc::unbounded_channel();
    let mut removals = Removals::new(report);
    // A full recompute that came due while removals were under way (see `Event::FullSync`).
    let mut full_due = false;
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
        // A look at stale sockets that came due while another ran is tried again shortly.
        let stale_look_due = cluster.as_ref().is_some_and(|c| {
            c.socket_scope
                .as_ref()
                .is_some_and(|scope| scope.look_pending(c.lb.departures()))
        });
        let stale_retry = async {
            if stale_look_due {
                tokio::time::sleep(STALE_LOOK_RETRY).await
            } else {
                std::future::pending().await
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
            Some(done) = removed.recv() => Event::CniRemoved(done),
            _ = removals.sync_due() => Event::CniReleasedSync,
            _ = interrupt.recv() => Event::Stop,
            wake = wake => Event::Firewalls(wake),
            wake = multicast_wake => Event::Multicast(wake),
            _ = source_changed => Event::SourceChanged,
            _ = settled => Event::Tick,
            _ = tick.tick() => Event::Tick,
            _ = egress_tick.tick() => Event::Egress,
            _ = stale_retry => Event::StaleSockets,
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
                handle_cni(
                    dataplane,
                    cluster,
                    agent,
                    run_dir,
                    metrics,
                    &mut removals,
                    batch,
                )
                .await;
            }
            Event::CniReleasedSync => {
                removals.synced();
                let synced = sync_and_attach(dataplane, cluster, agent, run_dir, metrics, false);
                if let Err(error) = synced.await {
                    tracing::error!(error = format!("{error:#}"), "sync after CNI DELs");
                }
                cluster.publish_pod_status();
            }
            Event::CniRemoved(done) => {
                removals.finished(&done.targets);
                if finish_removed(cluster, metrics, done) {
                    removals.sync_soon();
                }
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
            // Waits while DELs' veths are being removed or wait to be: their pods are no
            // longer wired but not yet released, which a full recompute would take for a
            // change the incremental syncs missed.
            Event::FullSync => full_due = true,
            Event::StaleSockets => end_stale_sockets(dataplane, cluster),
            Event::Egress => {
                if let Err(error) = cluster.refresh_egress(dataplane) {
                    tracing::error!(error = format!("{error:#}"), "applying the egress IPs");
                }
            }
        }
        if full_due && removals.idle() {
            full_due = false;
            sync_taking_lag(dataplane, cluster, agent, run_dir, metrics, true).await;
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
    if let Some(scope) = cluster.socket_scope.as_mut()
        && let Err(error) = scope.refresh(dataplane, &pod_veths(agent))
    {
        tracing::warn!(%error, "updating the pods served by the socket-level translation");
    }
    end_stale_sockets(dataplane, cluster);
    tracing::debug!(
        sync_ms = sync_took.as_millis(),
        attach_ms = (started.elapsed() - sync_took).as_millis(),
        "synced and attached"
    );
    Ok(interfaces)
}

/// Ends the sockets sent to backends that left, on a thread of its own, when backends left
/// since the last look (after every sync, not only the services stage's, and while a look
/// that came due while another ran is pending).
fn end_stale_sockets(dataplane: &Dataplane, cluster: &mut Cluster) {
    let lb = &cluster.lb;
    if let Some(scope) = cluster.socket_scope.as_mut()
        && let Err(error) = scope.end_stale(dataplane.pins(), lb.departures(), || lb.members())
    {
        tracing::warn!(%error, "ending sockets sent to removed backends");
    }
}

/// Attaches the socket-level translation as `--socket-lb` asks and puts this node's pods in
/// its scope; `None`: per packet only (asked for, or `auto` where the kernel does not allow
/// it, said in a warning).
fn start_socket_lb(
    args: &RunArgs,
    dataplane: &mut Dataplane,
    agent: &mut AgentState,
) -> anyhow::Result<Option<lb::socket::SocketScope>> {
    let required = match args.socket_lb {
        lb::socket::SocketLb::Off => return Ok(None),
        lb::socket::SocketLb::On => true,
        lb::socket::SocketLb::Auto => false,
    };
    let attached = lb::socket::cgroup_for_attach(args.socket_lb_cgroup.as_deref())
        .context("no cgroup v2 hierarchy found to attach to (give --socket-lb-cgroup)")
        .and_then(|cgroup| Ok(dataplane.attach_socket_lb(&cgroup)?));
    match attached {
        Ok(attachments) => agent.attachments.extend(attachments),
        Err(error) if required => return Err(error.context("--socket-lb on")),
        Err(error) => {
            tracing::warn!(
                error = format!("{error:#}"),
                "--socket-lb auto: services translated per packet only"
            );
            return Ok(None);
        }
    }
    let mut scope = lb::socket::SocketScope::new(args.cni_netns_dirs.clone(), args.socket_lb_host)?;
    scope.refresh(dataplane, &pod_veths(agent))?;
    Ok(Some(scope))
}

fn stage_names(synced: &crate::cluster::Synced) -> Vec<&'static str> {
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

/// Serves a batch of CNI requests: wires every ADD, starts the removal of every DEL's veths
/// off the loop (finished by [`finish_removed`]), then syncs once, so the new pods' overlay
/// entries, policies and services are in the maps and their programs attached; only then
/// are ADDs answered. An ADD whose pod did not make it into the maps is undone and fails,
/// naming why.
async fn handle_cni(
    dataplane: &mut Dataplane,
    cluster: &mut Cluster,
    agent: &mut AgentState,
    run_dir: &std::path::Path,
    metrics: &Metrics,
    removals: &mut Removals,
    batch: Vec<Job>,
) {
    let batch_started = Instant::now();
    let mut deleted = Vec::new();
    let mut added = Vec::new();
    let mut answered_after_sync = Vec::new();
    let mut changed = false;
    let mut adds = Vec::new();
    for job in batch {
        match job.request.clone() {
            Request::Status => answer(metrics, job, Reply::Done),
            Request::Add(target) => adds.push((job, target)),
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
    // The batch's ADDs, wired side by side.
    let targets: Vec<cni::protocol::Target> = adds.iter().map(|(_, t)| t.clone()).collect();
    let results = cluster.cni.add_many(&targets, &cluster.node_pods);
    for ((job, target), result) in adds.into_iter().zip(results) {
        match result {
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
        }
    }
    // The batch's DELs go to the removal off the loop ([`Removals`]), answered, and their
    // addresses released, when it reports back ([`finish_removed`]).
    removals.start(deleted);
    if changed {
        tracing::debug!(
            requests = added.len() + answered_after_sync.len(),
            wiring_ms = batch_started.elapsed().as_millis(),
            "CNI batch wired"
        );
        removals.synced();
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

/// How long the maps may keep pods whose DELs were answered: the sync that clears them
/// (10-20 ms with 100 pods) then runs once for a burst's DELs, while the kernel removes the
/// next veths, instead of holding up the next DELs.
const REMOVED_SYNC_DELAY: std::time::Duration = std::time::Duration::from_millis(20);

/// The DELs' veth removals, run off the loop as they come: a removal costs the kernel 35-45
/// ms whether it takes one veth or ten (grace periods), so a batch's DELs go in one group
/// removal, and removals overlap (each takes its own group; their waits overlap too), so the
/// next DELs and ADDs need not wait for the kernel. (Gathering a burst's DELs for a few
/// milliseconds before removing them together measured slower: the overlap already pays the
/// grace periods once.)
struct Removals {
    report: tokio::sync::mpsc::UnboundedSender<Removed>,
    /// The targets (container id, interface) of the removals running or whose report has
    /// not been handled yet: a DEL of one of them waits for that removal to report (the
    /// address is released only once its veth is surely gone).
    removing: std::collections::BTreeSet<(String, String)>,
    /// DELs of targets being removed, held until that removal reports.
    held: Vec<(Job, cni::protocol::Target)>,
    /// When the maps are cleared of the pods whose DELs were answered, unless a sync runs
    /// before.
    sync_at: Option<tokio::time::Instant>,
}

impl Removals {
    fn new(report: tokio::sync::mpsc::UnboundedSender<Removed>) -> Self {
        Self {
            report,
            removing: std::collections::BTreeSet::new(),
            held: Vec::new(),
            sync_at: None,
        }
    }

    /// Waits until the released pods are due to leave the maps (forever when none are).
    async fn sync_due(&self) {
        match self.sync_at {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    }

    /// Pods were released: the maps are cleared of them shortly, in one sync with those of
    /// the DELs that follow (an address can only go to a new pod through an ADD, and every
    /// ADD is answered after a sync).
    fn sync_soon(&mut self) {
        self.sync_at
            .get_or_insert_with(|| tokio::time::Instant::now() + REMOVED_SYNC_DELAY);
    }

    /// A sync ran: it cleared the maps of every pod released before it.
    fn synced(&mut self) {
        self.sync_at = None;
    }

    /// A removal reported back: DELs held for its targets start.
    fn finished(&mut self, targets: &[(String, String)]) {
        for target in targets {
            self.removing.remove(target);
        }
        let held = std::mem::take(&mut self.held);
        self.start(held);
    }

    /// No DEL is being removed or waits to be, and the maps hold no released pod.
    fn idle(&self) -> bool {
        self.removing.is_empty() && self.held.is_empty() && self.sync_at.is_none()
    }

    /// Starts removing `dels` off the loop (those of targets being removed are held).
    fn start(&mut self, dels: Vec<(Job, cni::protocol::Target)>) {
        let key = |t: &cni::protocol::Target| (t.container_id.clone(), t.ifname.clone());
        // A target being removed waits (held in the queue); so does a second DEL of one.
        let mut deleted = Vec::new();
        for (job, target) in dels {
            if self.removing.insert(key(&target)) {
                deleted.push((job, target));
            } else {
                self.held.push((job, target));
            }
        }
        if deleted.is_empty() {
            return;
        }
        let targets: Vec<(String, String)> = deleted.iter().map(|(_, t)| key(t)).collect();
        let report = self.report.clone();
        tokio::task::spawn_blocking(move || {
            let removed = cni::server::remove_veths(&targets);
            let jobs = deleted.into_iter().map(|(job, _)| job).collect();
            let _ = report.send(Removed {
                jobs,
                targets,
                removed,
            });
        });
    }
}

/// DELs whose veths a removal off the loop has dealt with.
struct Removed {
    jobs: Vec<Job>,
    /// Container id and interface name of each job.
    targets: Vec<(String, String)>,
    /// The host-side veths removed, or why they could not be.
    removed: Result<Vec<String>, CniError>,
}

/// Finishes DELs once their veths are gone: releases their addresses and answers; says
/// whether pods were released, whose entries a sync must then clear ([`Removals::sync_soon`]).
fn finish_removed(cluster: &mut Cluster, metrics: &Metrics, done: Removed) -> bool {
    let Removed {
        jobs,
        targets,
        removed,
    } = done;
    match cluster.cni.release(&targets, removed) {
        Ok(removed) => {
            let changed = removed.contains(&true);
            for ((job, (container, _)), removed) in jobs.into_iter().zip(&targets).zip(removed) {
                tracing::info!(container, removed, "CNI DEL");
                answer(metrics, job, Reply::Done);
            }
            changed
        }
        Err(error) => {
            for job in jobs {
                answer(metrics, job, Reply::Failed(error.clone()));
            }
            false
        }
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

/// The ifindexes of the pod veths the pod programs are attached to.
fn pod_veths(agent: &AgentState) -> std::collections::BTreeSet<u32> {
    agent
        .attachments
        .iter()
        .filter(|a| a.hook == dataplane_common::Hook::FromPod.name())
        .map(|a| a.ifindex)
        .collect()
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

/// Resolves `--xdp-forward` for `underlay`: whether XDP may send frames back out of it, and
/// why (logged, and shown by `dataplane status` beside the XDP attachment).
fn xdp_forward_decision(underlay: &str, choice: XdpForward) -> (bool, String) {
    let (allowed, why) = match choice {
        XdpForward::On => (true, "--xdp-forward on".to_owned()),
        XdpForward::Off => (false, "--xdp-forward off".to_owned()),
        // A veth hands XDP_TX frames to its peer only when the peer polls (NAPI: GRO or an
        // XDP program on it), which this node cannot see or change.
        XdpForward::Auto => match netdev::driver(underlay) {
            Ok(driver) if driver == "veth" => (
                false,
                "a veth uplink, whose peer may drop what XDP sends back".to_owned(),
            ),
            Ok(driver) => (true, format!("driver {driver}")),
            Err(error) => {
                tracing::warn!(underlay, %error, "cannot read the underlay's driver");
                (false, format!("the driver is unknown: {error}"))
            }
        },
    };
    tracing::info!(
        underlay,
        choice = ?choice,
        allowed,
        why,
        "frames sent back out of the underlay from XDP (NodePort forwarding, egress IP neighbour answers)"
    );
    let said = if allowed {
        format!("sends NodePort frames and egress IP neighbour answers back out itself: {why}")
    } else {
        format!("tc sends NodePort frames and egress IP neighbour answers back out: {why}")
    };
    (allowed, said)
}

/// `attachment` with `reason` added to why it is as it is.
fn with_reason(mut attachment: Attachment, reason: &str) -> Attachment {
    attachment.why = Some(match attachment.why.take() {
        Some(why) => format!("{why}; {reason}"),
        None => reason.to_owned(),
    });
    attachment
}
