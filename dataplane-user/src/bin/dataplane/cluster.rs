//! The agent's sync orchestration: where the cluster state is read from, and how each read
//! reaches the maps, stage by stage, as the dependency model (`dataplane_user::changes`) says.

use std::{collections::BTreeSet, path::PathBuf, time::SystemTime};

use anyhow::Context as _;
use dataplane_user::{
    Dataplane,
    acl::{
        self,
        agent::{FirewallAgent, FirewallFiles, FirewallInputs, HostedLists},
        pods::PolicyChanges,
    },
    changes::{Changes, Kind, Stage},
    cni::{
        self,
        server::{CniPods, NodePods},
    },
    egressip::{self, compile::EgressInputs, node::EgressNode},
    hybrid,
    kernel::netdev,
    kernel::preflight,
    kubernetes::KubeSource,
    lb::{self, ServiceCache},
    mgmt, model,
    model::Underlay,
    multicast, overlay,
    rejected::{self, Rejection},
    source,
};

/// Says that port security does not apply to a veth named on the command line that no pod
/// of the cluster state claims.
pub fn warn_unrestricted(iface: &str) {
    tracing::warn!(
        iface,
        "no pod is known behind this --pod-iface: port security does not apply to it"
    );
}

/// The cluster as this agent keeps it in sync: where it is read from, and what the syncs need
/// to remember between reads.
pub struct Cluster {
    /// The pods the CNI plugin had this agent wire.
    pub cni: CniPods,
    /// What the last good sync said about this node's pods, for the CNI.
    pub node_pods: NodePods,
    /// The last sync's warnings about the cluster state.
    pub warnings: Vec<String>,
    pub source: Source,
    pub node: String,
    pub underlay: String,
    pub underlay_index: u32,
    pub xdp_forward: bool,
    pub dns_server: Option<std::net::IpAddr>,
    /// Where the DNS names' last good addresses outlive the agent (`acl::dns::CACHE_FILE`).
    pub dns_cache: PathBuf,
    pub audit_log: PathBuf,
    /// Where access control describes its policy sets' rules (`inspect`, `trace`).
    pub acl_rules: PathBuf,
    /// The pod veths named on the command line (`--pod-iface`).
    pub named_ifaces: Vec<String>,
    pub lb: lb::LbState,
    /// Started at the first sync.
    pub firewalls: Option<FirewallAgent>,
    /// What access control's inputs took of the EgressFirewall and NetworkPolicy lists.
    pub hosted_lists: HostedLists,
    /// Objects the last sync rejected, by kind (for the metrics).
    pub rejected: Vec<(&'static str, usize)>,
    pub egress: EgressNode,
    /// The gateway SNAT table as last written.
    pub gateway_script: Option<String>,
    /// What the host services table was last written with (`None`: not yet by this agent).
    pub host_services_script: Option<String>,
    /// What `inspect services` was last given (`None`: not yet written).
    pub services_described: Option<lb::Described>,
    /// Manifest mode: the egress IP status file (size, modification time) as last read.
    pub egress_status: Option<(u64, SystemTime)>,
    /// The cluster state of the last good sync: the next one runs what differs from it.
    pub last: Option<source::ClusterState>,
    /// The overlay maps as the overlay stage last wrote them (`None`: compare with the
    /// kernel's entries, as a full sync does).
    pub overlay_written: Option<overlay::OverlayMaps>,
    /// This node's view as the overlay stage last built it.
    pub model: Option<model::NodeModel>,
    /// Every Service's compiled ports.
    pub services: ServiceCache,
    /// Every pod of the cluster as policies and egress IPs select them, patched with the
    /// pods each sync finds changed.
    pub policy_pods: acl::pods::PolicyPods,
    /// Whether `policy_pods` holds `last`'s pods (a sync that failed after patching them
    /// leaves them ahead of it: the next one makes them anew).
    pub policy_pods_follow_last: bool,
    /// This node's pods, patched like `policy_pods` (and made anew with them).
    pub hosted_pods: model::HostedPods,
    /// What the services stage last refused, one line each.
    pub service_errors: Vec<String>,
    /// What the multicast stage last refused, one line each.
    pub multicast_errors: Vec<String>,
    /// Tells refusals to the API server as Events (with the API server only).
    pub events: Option<dataplane_user::rejected::EventSender>,
    /// Where Services' `spec.externalIPs` are honoured (`--external-ip-cidrs`).
    pub external_ip_cidrs: Vec<ipnet::IpNet>,
    /// Where NodePorts are served (`--nodeport-addresses`).
    pub nodeport_addresses: lb::NodePortAddresses,
    /// The addresses last written to the NodePort addresses map (`None`: not yet).
    pub nodeport_written: Option<Vec<std::net::IpAddr>>,
    /// What egress router pods may claim beyond the EgressRouters'
    /// (`--egress-router-reservation`).
    pub router_reservations: Vec<dataplane_user::egressrouter::reservations::Reservation>,
    /// The reservations last written for the plugin (`None`: not yet).
    pub reservations_written: Option<dataplane_user::egressrouter::reservations::Reservations>,
    /// The pods the socket-level translation serves (`--socket-lb on`).
    pub socket_scope: Option<dataplane_user::lb::socket::SocketScope>,
    pub multicast_settings: multicast::Settings,
    /// Started at the first sync.
    pub multicast: Option<multicast::MulticastAgent>,
    /// Where the agent describes its state for `inspect`.
    pub run_dir: PathBuf,
    /// The health-check node ports of `externalTrafficPolicy: Local` LoadBalancer Services.
    pub health_checks: lb::HealthServers,
    /// kube-proxy's node health: when the service maps were last brought to the cluster.
    pub proxy_health: std::sync::Arc<lb::ProxyHealth>,
}

/// What one sync did.
#[derive(Debug, Default)]
pub struct Synced {
    /// Everything re-read and every stage run.
    pub full: bool,
    /// A full sync whose read differed from the last sync's (or the first): what it wrote
    /// includes those changes.
    pub unsynced: bool,
    pub stages: Vec<Stage>,
    /// Map entries, routes and tables written or deleted (after a full recompute, each is a
    /// difference the dependency model missed).
    pub written: usize,
    /// The host-side interfaces of the local pods.
    pub interfaces: Vec<String>,
}

impl Cluster {
    /// Reads the cluster state and brings the maps to it, running only the stages that read
    /// what changed since the last good sync ([`changes::READS`]); `full` re-reads everything
    /// from scratch and runs every stage (the first sync takes over what a previous agent
    /// pinned). Returns what ran and what it wrote.
    pub async fn sync(&mut self, dataplane: &mut Dataplane, full: bool) -> anyhow::Result<Synced> {
        let full = full || self.last.is_none() || self.source.take_relisted();
        let mut state = self.source.read(full)?;
        // Without the cluster's networks a node would half work (no masquerade, no node
        // subnets to check pods against): no sync until they are known.
        if matches!(self.source, Source::Kubernetes(_)) && state.network.is_none() {
            let why: Vec<&str> = state
                .rejected
                .iter()
                .filter(|r| r.contains("Network"))
                .map(String::as_str)
                .collect();
            anyhow::bail!(
                "no cluster network configuration: the API server has no operator.openshift.io/v1 Network \
                 and --network-config gives none{}",
                if why.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", why.join("; "))
                }
            );
        }
        // What the Pod objects themselves say (a manifest's own addresses), before the
        // attachments' addresses are merged in.
        let declared = state.clone();
        if let Source::Manifests { dir, .. } = &self.source {
            // Other nodes' pods wired by their plugins (this node's come from memory).
            let (mut records, rejected) = cni::status::read(dir);
            records.retain(|r| r.node != self.node);
            cni::status::merge(&mut state, &records);
            state.rejected.extend(rejected);
        }
        self.cni.merge_into(&mut state, &self.node);
        for rejected in &state.rejected {
            tracing::warn!(%rejected, "manifest object skipped");
        }
        let mut changes = match &self.last {
            Some(last) if !full => Changes::between(last, &state),
            _ => Changes::full(),
        };
        // A full recompute over a state that also changed: its writes are not all misses.
        let unsynced = full
            && self
                .last
                .as_ref()
                .is_none_or(|last| !Changes::between(last, &state).is_empty());
        if self.policy_pods_follow_last {
            self.hosted_pods.note_changes(&mut changes);
            self.policy_pods.follow(&state, &changes);
            self.hosted_pods.follow(&state, &changes);
        } else {
            // Not knowing which pods were this node's, any pod change may be one of them.
            if changes.kinds.contains(&Kind::Pod) {
                changes.kinds.insert(Kind::HostedPod);
            }
            self.policy_pods = acl::pods::PolicyPods::from_pods(&state.pods);
            self.hosted_pods = model::HostedPods::from_pods(&state.pods, &self.node);
        }
        self.policy_pods_follow_last = false;
        // A pod waiting for its host route is looked for again at every sync.
        if self.model.as_ref().is_some_and(|m| m.unrouted != 0) {
            changes.kinds.insert(Kind::HostedPod);
        }
        let mut synced = Synced {
            full,
            unsynced,
            stages: changes.stages(),
            ..Synced::default()
        };
        tracing::debug!(?changes.kinds, services = changes.services.len(), stages = ?synced.stages, "sync planned");
        if full {
            self.overlay_written = None;
        }
        if changes.runs(Stage::Overlay) {
            synced.written += self.sync_overlay(dataplane, &state, &declared).await?;
        }
        if self.model.is_none() {
            anyhow::bail!("no overlay view: the first sync runs every stage");
        }
        let own = netdev::local_addresses().context("listing this node's addresses")?;
        dataplane.sync_node_addresses(&own)?;
        if changes.runs(Stage::Services) {
            synced.written += self.sync_services(dataplane, &state, &changes)?;
        }
        if let Some(model) = &self.model
            && changes.runs(Stage::AccessControl)
        {
            let files = FirewallFiles {
                dns_server: self.dns_server,
                dns_cache: self.dns_cache.clone(),
                audit_path: self.audit_log.clone(),
                rules_dir: self.acl_rules.clone(),
            };
            let inputs = FirewallInputs::from_state(
                &state,
                &model.view,
                self.policy_pods.clone(),
                PolicyChanges::from_changes(&changes),
                &files,
                // The API source's lists are in key order (`ObjectCache`); after the read only
                // pods are merged in. A manifest directory's are in its files' order.
                matches!(self.source, Source::Kubernetes(_)),
                &mut self.hosted_lists,
            );
            match &mut self.firewalls {
                Some(firewalls) => {
                    let updated = firewalls.update(dataplane, inputs).await?;
                    synced.written += updated.stats.written + updated.stats.deleted;
                    // New DNS answers are no cluster change the incremental syncs missed.
                    synced.unsynced |= updated.dns_changed;
                }
                None => {
                    let (firewalls, stats) = FirewallAgent::start(dataplane, inputs).await?;
                    synced.written += stats.written + stats.deleted;
                    self.firewalls = Some(firewalls);
                }
            }
        }
        if let Some(model) = &self.model
            && changes.runs(Stage::Multicast)
        {
            let plan = multicast::plan(&state, &model.view);
            if self.multicast.is_none() {
                self.multicast = Some(multicast::MulticastAgent::start(
                    dataplane,
                    self.multicast_settings.clone(),
                    &self.node,
                    &self.run_dir,
                )?);
            }
            self.multicast_errors = plan.errors.clone();
            if let Some(agent) = self.multicast.as_mut() {
                synced.written += agent.configure(dataplane, plan)?;
            }
        }
        if changes.runs(Stage::EgressIps) {
            // The model is lent, not copied (5,000 nodes at scale).
            if let Some(model) = self.model.take() {
                let egress = self.sync_egress(dataplane, &state, &model);
                self.model = Some(model);
                egress?;
            }
        }
        let rejections = self.rejections(&state);
        self.rejected = rejected::counts(&rejections);
        if let Some(events) = &mut self.events {
            events.tell(&rejections);
        }
        synced.interfaces = self
            .model
            .as_ref()
            .map(|m| m.pod_interfaces.clone())
            .unwrap_or_default();
        self.write_router_reservations(&state);
        self.last = Some(state);
        self.policy_pods_follow_last = true;
        Ok(synced)
    }

    /// Tells the node's `egress-router` plugin which addresses router pods may claim (the
    /// EgressRouters' and `--egress-router-reservation`), when that changed. A failed write is
    /// logged and tried again at the next sync; the plugin keeps the last file meanwhile.
    fn write_router_reservations(&mut self, state: &source::ClusterState) {
        use dataplane_user::egressrouter::reservations::Reservations;
        let reservations = Reservations::of(state, &self.router_reservations);
        if self.reservations_written.as_ref() == Some(&reservations) {
            return;
        }
        match reservations.write(&self.run_dir) {
            Ok(path) => {
                tracing::info!(
                    path = %path.display(),
                    count = reservations.reservations.len(),
                    "egress router reservations written"
                );
                self.reservations_written = Some(reservations);
            }
            Err(error) => tracing::error!(%error, "writing the egress router reservations"),
        }
    }

    /// Every object this sync could not use, each named: what the source refused, what the
    /// model and the overlay refused of the nodes and pods, and what each stage refused.
    /// (A state that passes, such as a pod whose route is not there yet, is no refusal.)
    fn rejections(&self, state: &source::ClusterState) -> Vec<Rejection> {
        let transient = |line: &&String| line.ends_with(" yet") || line.contains(" yet;");
        let model_lines = self.warnings.iter().filter(|l| !transient(l));
        let node_lines = self
            .overlay_written
            .iter()
            .flat_map(|maps| maps.node_maps.rejected.values());
        let access_lines = self.firewalls.iter().flat_map(|f| f.rejections());
        state
            .rejected
            .iter()
            .chain(model_lines)
            .chain(node_lines)
            .chain(&self.service_errors)
            .chain(access_lines)
            .chain(&self.multicast_errors)
            .map(|line| Rejection::of(line))
            .collect()
    }

    /// The overlay stage: this node's view from the nodes and pods, the management port and
    /// its routes, the gateway SNAT, the overlay and hybrid overlay maps. Returns the map
    /// entries, routes and tables it wrote.
    async fn sync_overlay(
        &mut self,
        dataplane: &mut Dataplane,
        state: &source::ClusterState,
        declared: &source::ClusterState,
    ) -> anyhow::Result<usize> {
        let underlay = &self.underlay;
        let mtu =
            netdev::mtu(underlay).with_context(|| format!("reading the MTU of {underlay}"))?;
        let mac =
            netdev::mac(underlay).with_context(|| format!("reading the MAC of {underlay}"))?;
        let settings = state.network.unwrap_or_default().validate(mtu)?;
        if self.firewalls.is_none() {
            warn_without_gro(underlay);
        }
        let underlay = Underlay {
            ifindex: self.underlay_index,
            xdp_forward: self.xdp_forward,
            nodeport_listed: self.nodeport_addresses.listed(),
            mac,
            mtu,
        };
        // The host routes once for every pod's lookup.
        let routes = netdev::host_route_devices();
        let mut model = model::build(
            state,
            &self.hosted_pods,
            self.model.as_ref(),
            &self.node,
            underlay,
            settings,
            |ip| host_interface(&routes, ip),
        );
        for warning in &model.warnings {
            tracing::warn!(%warning, "cluster state");
        }
        self.warnings = model.warnings.clone();
        let pools = dataplane_user::model::node_named(&model.view.nodes, &self.node)
            .map(|n| n.pod_cidrs.clone())
            .unwrap_or_default();
        // The Pod objects as declared (before the attachments' addresses were merged in) of
        // the pods now on this node: a merged pod is on this node if its object is.
        let declared_here = self.hosted_pods.iter().filter_map(|pod| {
            let name = pod.metadata.name.as_deref().unwrap_or_default();
            declared.pods.find(pod.metadata.namespace.as_deref(), name)
        });
        let node_pods = NodePods::from_pods(
            declared_here,
            &self.node,
            pools,
            settings.pod_mtu,
            // A manifest's status.podIPs are the pod's own to keep; the API server's are the
            // last sandbox's.
            matches!(self.source, Source::Manifests { .. }),
        )
        .unwiring(unwired_namespaces(declared));
        for iface in &self.named_ifaces {
            if !model.pod_interfaces.contains(iface) {
                warn_unrestricted(iface);
                let ifindex = preflight::interface_index(iface)?;
                model.view.unrestricted_ifindexes.push(ifindex);
            }
        }
        // The node's own way to other nodes' pods: its packets enter the overlay as a pod's.
        let port = mgmt::sync(
            &model.view,
            &settings,
            &self.underlay,
            &state.service_networks,
        )?;
        let mut written = port.routes_added + port.routes_removed;
        if written != 0 {
            tracing::info!(
                added = port.routes_added,
                removed = port.routes_removed,
                "routes to other nodes' pods through the management port"
            );
        }
        model.view.unrestricted_ifindexes.push(port.ifindex);
        if let Some(hybrid) = &mut model.view.hybrid {
            hybrid.mgmt_ifindex = port.host_ifindex;
        }
        if self.sync_gateway(state, &model.view)? {
            written += 1;
        }
        model.pod_interfaces.push(mgmt::OVERLAY_SIDE.to_owned());
        // Node by node from what the last sync wrote (after a full recompute's reset, from
        // every node).
        let desired = overlay::compile_since(&model.view, self.overlay_written.as_ref())?;
        for (node, why) in desired.node_maps.rejected.iter() {
            tracing::warn!(
                node,
                error = why.as_str(),
                "node refused; the other nodes are synced"
            );
        }
        desired.node_maps.drop_rejected_from(&mut model.view);
        // The hybrid nodes before the VXLAN routes that lead to them.
        let hybrid_stats = dataplane.sync_hybrid(&hybrid::compile(model.view.hybrid.as_ref()))?;
        // Taken: a sync that fails midway leaves the next one comparing with the kernel.
        let last = self.overlay_written.take();
        let mut stats = dataplane.sync_overlay(&desired, last.as_ref())?;
        self.overlay_written = Some(desired);
        stats.add(hybrid_stats);
        self.announce_node(state, &model.view).await;
        tracing::info!(
            node = self.node,
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
        self.node_pods = node_pods;
        self.model = Some(model);
        Ok(written + stats.written + stats.deleted)
    }

    /// The services stage: recompiles the Services `changes` names (all when full) and
    /// syncs the load-balancer maps, taking over what a previous agent left pinned at the
    /// first sync. Returns the entries written and deleted, and how many Services are refused.
    fn sync_services(
        &mut self,
        dataplane: &mut Dataplane,
        state: &source::ClusterState,
        changes: &Changes,
    ) -> anyhow::Result<usize> {
        let policy = self.address_policy(state);
        let node = lb::LocalNode::from_nodes(&state.nodes, &self.node);
        let recompiled = self.services.update(
            &state.services,
            &state.endpoint_slices,
            &node,
            &policy,
            changes,
        );
        let mut errors = self.services.errors();
        // The health-check ports follow the compile: opened, answered, closed here.
        let (checks, refused) = self.services.health_checks();
        errors.extend(refused);
        errors.extend(self.health_checks.sync(checks));
        for error in &errors {
            tracing::warn!(%error, "service skipped");
        }
        if self.firewalls.is_none() {
            dataplane.adopt_lb(&mut self.lb)?;
        }
        self.proxy_health
            .set_node_eligible(lb::node_eligible(&state.nodes, &self.node));
        let stats = self.services.sync_maps(dataplane, &mut self.lb)?;
        let host_written = self.sync_host_services(dataplane)?;
        self.describe_services();
        self.proxy_health.updated();
        tracing::info!(
            recompiled,
            service_ports = stats.services,
            backends = stats.backends,
            written = stats.written,
            deleted = stats.deleted,
            "services configured"
        );
        self.service_errors = errors;
        Ok(stats.written + stats.deleted + usize::from(host_written))
    }

    /// Makes the node's own connections to its NodePorts and to the Services' external and
    /// load-balancer addresses go to the Services (kube-proxy's output chain): the host
    /// services table follows the service ports, written only when it changes.
    fn sync_host_services(&mut self, dataplane: &mut Dataplane) -> anyhow::Result<bool> {
        let addresses = self.nodeport_addresses();
        let mut written = false;
        if self.nodeport_written.as_ref() != Some(&addresses) {
            dataplane.sync_nodeport_addresses(&addresses)?;
            if self.nodeport_addresses.listed() {
                tracing::info!(
                    ?addresses,
                    "NodePorts served on the listed networks' addresses"
                );
            }
            self.nodeport_written = Some(addresses.clone());
            written = true;
        }
        let entries = lb::host_entries(self.services.host_redirects(), &addresses);
        let script = lb::host_script(&entries);
        if self.host_services_script.as_deref() == Some(script.as_str()) {
            return Ok(written);
        }
        lb::apply_host_table(&script)?;
        tracing::info!(
            table = lb::HOST_TABLE,
            entries = entries.len(),
            "the node's own connections to NodePorts and external addresses go to their Services"
        );
        self.host_services_script = Some(script);
        Ok(true)
    }

    /// Which addresses Services may take besides their cluster IPs: the external IPs the
    /// operator allows, never the cluster's own networks or a node's address.
    fn address_policy(&self, state: &source::ClusterState) -> lb::AddressPolicy {
        let mut reserved_networks = state.cluster_networks.clone();
        reserved_networks.extend(state.service_networks.iter().copied());
        if let Some(model) = &self.model {
            reserved_networks.extend(model::hybrid::internal_networks(model.view.hybrid.as_ref()));
        }
        let node_addresses = state
            .nodes
            .iter()
            .flat_map(|node| {
                node.status
                    .iter()
                    .flat_map(|s| s.addresses.iter().flatten())
            })
            .filter_map(|a| a.address.parse().ok())
            .collect();
        // The agent's flag overrides; OpenShift's cluster Network says it otherwise.
        let (external_ip_cidrs, external_ip_rejected_cidrs, external_ip_source) =
            match &state.platform {
                Some(platform) if self.external_ip_cidrs.is_empty() => (
                    platform.external_ips.allowed.clone(),
                    platform.external_ips.rejected.clone(),
                    lb::ExternalIpSource::ClusterNetwork,
                ),
                _ => (
                    self.external_ip_cidrs.clone(),
                    Vec::new(),
                    lb::ExternalIpSource::Flag,
                ),
            };
        lb::AddressPolicy {
            external_ip_cidrs,
            external_ip_rejected_cidrs,
            external_ip_source,
            reserved_networks,
            node_addresses,
        }
    }

    /// Writes what `dataplane inspect services` shows beside the maps, when it changed.
    fn describe_services(&mut self) {
        let described = self.services.describe();
        if self.services_described.as_ref() == Some(&described) {
            return;
        }
        let path = self.run_dir.join(lb::DESCRIBED_FILE);
        match dataplane_user::kernel::state::write_json_replacing(&path, &described, false) {
            Ok(()) => self.services_described = Some(described),
            Err(error) => tracing::debug!(%error, "writing the services description"),
        }
    }

    /// The addresses this node serves NodePorts on: its first address of each family (as the
    /// kernel's `OverlayConfig` has them) and, with `--nodeport-addresses` networks, its own
    /// addresses inside them.
    fn nodeport_addresses(&self) -> Vec<std::net::IpAddr> {
        let primary: Vec<std::net::IpAddr> = self
            .model
            .as_ref()
            .and_then(|model| model.view.this_node_view())
            .map(|node| node.primary_addresses())
            .unwrap_or_default();
        let local = if self.nodeport_addresses.listed() {
            dataplane_user::kernel::netdev::local_addresses().unwrap_or_else(|error| {
                tracing::warn!(%error, "reading the node's addresses for --nodeport-addresses");
                Vec::new()
            })
        } else {
            Vec::new()
        };
        self.nodeport_addresses.select(&primary, &local)
    }

    /// Makes the gateway SNAT (pods to outside the cluster take the node's address) follow
    /// the cluster's networks and nodes; written only when it changes.
    fn sync_gateway(
        &mut self,
        state: &source::ClusterState,
        view: &model::OverlayView,
    ) -> anyhow::Result<bool> {
        let mut inputs = dataplane_user::gateway::GatewayInputs {
            underlay: self.underlay.clone(),
            cluster_networks: state.cluster_networks.clone(),
            service_networks: state.service_networks.clone(),
            node_addresses: view
                .nodes
                .iter()
                .flat_map(|n| n.addresses.clone())
                .collect(),
        };
        inputs
            .cluster_networks
            .extend(model::hybrid::internal_networks(view.hybrid.as_ref()));
        let script = dataplane_user::gateway::script(&inputs);
        if self.gateway_script.as_deref() != Some(script.as_str()) {
            dataplane_user::gateway::apply(&script)?;
            tracing::info!(
                table = dataplane_user::gateway::TABLE,
                "gateway SNAT configured: pods leaving the cluster take the node's address"
            );
            self.gateway_script = Some(script);
            return Ok(true);
        }
        Ok(false)
    }

    /// With the API server: writes on this node's Node the annotations others read of it when
    /// they are not there yet: its underlay network and address (`node-primary-ifaddr`, which
    /// the egress IP controller assigns by) and, with the hybrid overlay, its router's address
    /// and MAC (hybrid nodes read them). A failure is logged and tried again at the next sync
    /// that runs the overlay stage (a Node or Pod change, the periodic full recompute).
    async fn announce_node(&self, state: &source::ClusterState, view: &model::OverlayView) {
        let Source::Kubernetes(kube) = &self.source else {
            return;
        };
        let current = state
            .nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(self.node.as_str()))
            .and_then(|n| n.metadata.annotations.clone())
            .unwrap_or_default();
        let mut wanted = std::collections::BTreeMap::new();
        let ifaddr = egressip::controller::PRIMARY_IFADDR;
        if let Some(this) = view.this_node_view() {
            // The interface is asked (a process spawned) only when the annotation is missing
            // or does not name each of the node's addresses, not at every sync.
            let named = current.get(ifaddr).is_some_and(|text| {
                this.addresses
                    .iter()
                    .all(|a| text.contains(&format!("\"{a}/")))
            });
            let written = if named {
                current.get(ifaddr).cloned()
            } else {
                egressip::controller::primary_ifaddr(
                    &netdev::interface_networks(&self.underlay),
                    &this.addresses,
                )
            };
            if let Some(written) = written {
                wanted.insert(ifaddr.to_owned(), written);
            }
        }
        if let Some(hybrid) = &view.hybrid {
            wanted.extend(model::hybrid::own_annotations(
                hybrid.router_ip,
                &hybrid.router_mac,
            ));
        }
        if wanted.iter().all(|(k, v)| current.get(k) == Some(v)) {
            return;
        }
        match kube.annotate_node(&self.node, &wanted).await {
            Ok(()) => tracing::info!(node = self.node, ?wanted, "node annotations written"),
            Err(error) => tracing::warn!(%error, "node annotations not written"),
        }
    }

    /// Gives the egress IP state what this sync read, and applies it.
    fn sync_egress(
        &mut self,
        dataplane: &mut Dataplane,
        state: &source::ClusterState,
        model: &model::NodeModel,
    ) -> anyhow::Result<()> {
        let mut objects = state.egress_ips.to_vec();
        if let Source::Manifests { dir, .. } = &self.source {
            self.egress_status = egress_status_stamp(dir);
            if let Some(statuses) = egressip::read_status_file(dir) {
                egressip::merge_status(&mut objects, &statuses);
            }
        }
        let mut inputs = EgressInputs::from_state(state, objects, &self.policy_pods, model);
        inputs
            .cluster_networks
            .extend(model::hybrid::internal_networks(model.view.hybrid.as_ref()));
        let timeout = state.egress_ip_config.reachability_timeout();
        self.egress.set_inputs(inputs, timeout);
        self.egress.apply(dataplane)?;
        Ok(())
    }

    /// Between syncs: re-reads the controller's status file when it changed and applies the
    /// egress state as the lease now allows (a lapsed lease withdraws the addresses).
    pub fn refresh_egress(&mut self, dataplane: &mut Dataplane) -> anyhow::Result<()> {
        if let Source::Manifests { dir, .. } = &self.source {
            let stamp = egress_status_stamp(dir);
            if stamp != self.egress_status {
                self.egress_status = stamp;
                self.egress
                    .set_status(&egressip::read_status_file(dir).unwrap_or_default());
            }
        }
        self.egress.apply(dataplane)?;
        Ok(())
    }

    pub fn changed(&self) -> bool {
        self.source.changed()
    }

    /// With a manifest directory, writes this node's wired pods and their addresses where the
    /// other agents read them (what the kubelet reports to an API server).
    pub fn publish_pod_status(&self) {
        if let Source::Manifests { dir, .. } = &self.source
            && let Err(error) =
                cni::status::write(dir, &self.node, &self.cni.status_records(&self.node))
        {
            tracing::warn!(dir = %dir.display(), %error, "writing this node's pod status");
        }
    }
}

/// Size and modification time of the egress IP status file under `dir`, if there is one.
fn egress_status_stamp(dir: &std::path::Path) -> Option<(u64, SystemTime)> {
    let metadata = std::fs::metadata(dir.join(egressip::STATUS_FILE)).ok()?;
    Some((metadata.len(), metadata.modified().ok()?))
}

/// Where the cluster state is read from.
pub enum Source {
    Manifests {
        dir: PathBuf,
        /// This node's pod status file (written by this agent: not a change to follow).
        own_status: PathBuf,
        /// The manifest files (name, size, modification time) as last read.
        fingerprint: Vec<(PathBuf, u64, SystemTime)>,
        /// Each manifest file as last parsed: a change re-parses only the files it touched.
        parsed: source::ManifestCache,
        /// The directory's inotify events (`None`: inotify refused, the directory is looked
        /// at every second).
        watch: Option<source::ManifestWatch>,
    },
    Kubernetes(Box<KubeSource>),
}

impl Source {
    /// The cluster state as the source holds it now; `fresh`: nothing taken from what earlier
    /// reads parsed (a full recompute).
    pub fn read(&mut self, fresh: bool) -> anyhow::Result<source::ClusterState> {
        match self {
            Source::Manifests {
                dir,
                own_status,
                fingerprint: seen,
                parsed,
                watch,
            } => {
                let now = fingerprint(dir, own_status);
                // Taken before the files are read: a change during the read is named again.
                // The files whose name, size or time moved are read too, in case inotify
                // lost an event without saying so (the periodic look's safety net).
                let named = watch
                    .as_ref()
                    .and_then(source::ManifestWatch::take_named)
                    .map(|mut named| {
                        named.extend(moved_files(seen, &now));
                        named
                    });
                *seen = now;
                if fresh {
                    *parsed = source::ManifestCache::default();
                }
                match named {
                    Some(named) => Ok(parsed.read_named(dir, &named)?),
                    None => Ok(parsed.read_dir(dir)?),
                }
            }
            Source::Kubernetes(kube) => Ok(kube.snapshot(fresh)),
        }
    }

    /// Whether a manifest file was added, removed or changed, or a watch saw an event, since
    /// the last read.
    pub fn changed(&self) -> bool {
        match self {
            Source::Manifests {
                dir,
                own_status,
                fingerprint: seen,
                ..
            } => fingerprint(dir, own_status) != *seen,
            Source::Kubernetes(kube) => kube.changed(),
        }
    }

    /// Whether the source listed everything again since the last call (its watches were lost).
    pub fn take_relisted(&self) -> bool {
        match self {
            Source::Kubernetes(kube) => kube.take_relisted(),
            Source::Manifests { .. } => false,
        }
    }

    /// When the first change no sync has taken yet came, as the source's events say.
    pub fn take_first_change(&self) -> Option<std::time::Instant> {
        match self {
            Source::Manifests {
                watch: Some(watch), ..
            } => watch.take_first_change(),
            Source::Manifests { watch: None, .. } => None,
            Source::Kubernetes(kube) => kube.take_first_change(),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Source::Manifests { dir, .. } => format!("manifests in {}", dir.display()),
            Source::Kubernetes(_) => "the API server".into(),
        }
    }
}

/// Name, size and modification time of every manifest file of `dir`, and of the other nodes'
/// pod status files (not `own_status`).
fn fingerprint(
    dir: &std::path::Path,
    own_status: &std::path::Path,
) -> Vec<(PathBuf, u64, SystemTime)> {
    let listed = |dir: &std::path::Path, extensions: &[&str]| -> Vec<(PathBuf, u64, SystemTime)> {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .filter_map(|entry| {
                let metadata = entry.metadata().ok()?;
                Some((entry.path(), metadata.len(), metadata.modified().ok()?))
            })
            .filter(|(path, _, _)| {
                path.extension()
                    .is_some_and(|e| extensions.iter().any(|x| e == *x))
            })
            .collect()
    };
    let mut files = listed(dir, &["yaml", "yml"]);
    files.extend(
        listed(&dir.join(cni::status::POD_STATUS_DIR), &["json"])
            .into_iter()
            .filter(|(path, _, _)| path != own_status),
    );
    files.sort();
    files
}

/// The files whose entry (name, size, modification time) is in one fingerprint and not the
/// other: added, removed or changed.
fn moved_files(
    before: &[(PathBuf, u64, SystemTime)],
    after: &[(PathBuf, u64, SystemTime)],
) -> BTreeSet<PathBuf> {
    let (before, after): (BTreeSet<_>, BTreeSet<_>) =
        (before.iter().collect(), after.iter().collect());
    before
        .symmetric_difference(&after)
        .map(|(path, _, _)| path.clone())
        .collect()
}

/// The host interface a pod address is routed to, in this node's namespace.
/// The namespaces whose pods get no interface, with why: those labelled for a primary
/// user-defined network (see `api::userdefinednetwork::unwired_namespace`).
fn unwired_namespaces(state: &source::ClusterState) -> std::collections::BTreeMap<String, String> {
    use dataplane_user::api::userdefinednetwork::unwired_namespace;
    dataplane_user::acl::pods::namespace_labels(&state.namespaces)
        .iter()
        .filter_map(|(name, labels)| {
            let why = unwired_namespace(
                name,
                labels,
                state.user_defined_networks.iter().map(|n| &**n),
                state.cluster_user_defined_networks.iter().map(|n| &**n),
            )?;
            Some((name.clone(), why))
        })
        .collect()
}

fn host_interface(
    routes: &std::collections::HashMap<std::net::IpAddr, String>,
    ip: std::net::IpAddr,
) -> Option<model::HostInterface> {
    let name = routes.get(&ip)?.clone();
    let ifindex = preflight::interface_index(&name).ok()?;
    Some(model::HostInterface {
        ifindex,
        mac: netdev::mac(&name).ok()?,
        takes_xdp: netdev::takes_xdp(ifindex),
        name,
    })
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A file added, removed, grown or touched is named; one unchanged is not.
    #[test]
    fn the_files_whose_entry_moved_are_named() {
        let at = |seconds: u64| SystemTime::UNIX_EPOCH + Duration::from_secs(seconds);
        let entry = |name: &str, size: u64, time: u64| (PathBuf::from(name), size, at(time));
        let before = [
            entry("a.yaml", 10, 1),
            entry("b.yaml", 10, 1),
            entry("c.yaml", 10, 1),
            entry("d.yaml", 10, 1),
        ];
        let after = [
            entry("a.yaml", 10, 1),
            entry("b.yaml", 11, 1),
            entry("c.yaml", 10, 2),
            entry("e.yaml", 10, 1),
        ];
        let moved: Vec<PathBuf> = moved_files(&before, &after).into_iter().collect();
        let expected: Vec<PathBuf> = ["b.yaml", "c.yaml", "d.yaml", "e.yaml"]
            .iter()
            .map(PathBuf::from)
            .collect();
        assert_eq!(moved, expected);
    }
}
