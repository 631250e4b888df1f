//! The cluster-wide egress IP controller (`dataplane controller`): decides which node holds
//! each address ([`super::assign`]), probes the nodes that may hold them, and publishes the
//! decision as the objects' `status.items` (the API server, or a status file beside the
//! manifests) for every node agent to program.
//!
//! A move is made in two phases, so that no two nodes ever hold one address: the address
//! first leaves the status (and with it the old holder's grants); it is published for the new
//! holder only once the old holder's probe reply shows it let go, or once the reachability
//! timeout plus [`MARGIN`] passed since a probe last granted it to the old holder (a node cut
//! off from the controller withdraws it by itself when its grant lapses: [`super::node`]).
//! The same wait applies to every node after the controller starts or becomes leader, since
//! it cannot know what a predecessor granted.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use http_body_util::{BodyExt as _, Empty};
use hyper::{Request, StatusCode, body::Bytes};
use hyper_util::rt::TokioIo;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use prometheus_client::{
    encoding::text,
    metrics::{family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::api::egressip::{EgressIP, EgressIpStatus, EgressIpStatusItem};

use super::{
    StatusFile,
    assign::{Assignment, Candidate, Problem, assign},
    probe::{Order, PROBE_PATH, Probe, ProbeKey, ProbeReply},
};
use crate::{http::Exposition, source::ClusterState};

/// The label that lets a node hold egress IPs.
pub const ASSIGNABLE_LABEL: &str = "k8s.ovn.org/egress-assignable";
/// The node annotation naming its underlay addresses with their prefixes.
pub const PRIMARY_IFADDR: &str = "k8s.ovn.org/node-primary-ifaddr";
/// What the controller adds to the reachability timeout before it counts a grant as lapsed:
/// the agent's apply period (100 ms) and the probe's way there, with room.
pub const MARGIN: Duration = Duration::from_millis(300);
/// How long one probe may take; its socket is reset after that, so a late request is not
/// delivered afterwards.
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(200);

/// Why an assignable node cannot hold addresses while it does not answer.
const UNREACHABLE: &str = "not answering its probes";

/// Where the controller reads the cluster and writes the status.
pub trait StatusStore {
    /// Writes the status of every object whose status changed.
    fn publish(
        &mut self,
        objects: &[Arc<EgressIP>],
        statuses: &StatusFile,
    ) -> impl Future<Output = Result<(), String>>;
}

/// The manifest directory's status file.
pub struct FileStore {
    pub dir: PathBuf,
}

impl StatusStore for FileStore {
    async fn publish(&mut self, _: &[Arc<EgressIP>], statuses: &StatusFile) -> Result<(), String> {
        super::write_status_file(&self.dir, statuses).map_err(|e| {
            format!(
                "writing {}: {e}",
                self.dir.join(super::STATUS_FILE).display()
            )
        })
    }
}

/// The API server: a status patch per changed object.
pub struct ApiStore {
    pub client: kube::Client,
}

impl StatusStore for ApiStore {
    async fn publish(
        &mut self,
        objects: &[Arc<EgressIP>],
        statuses: &StatusFile,
    ) -> Result<(), String> {
        let api: kube::Api<EgressIP> = kube::Api::all(self.client.clone());
        for object in objects {
            let name = object.metadata.name.clone().unwrap_or_default();
            let status = statuses.get(&name).cloned().unwrap_or_default();
            if object.status.clone().unwrap_or_default() == status {
                continue;
            }
            let patch = serde_json::json!({ "status": status });
            api.patch_status(
                &name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .map_err(|e| format!("EgressIP {name}: writing status: {e}"))?;
        }
        Ok(())
    }
}

/// A node's grant of one address, as far as the controller knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Grant {
    /// Last granted by a probe sent at this time.
    Sent(Instant),
    /// The node said it let go after a probe that no longer granted it.
    Released,
}

/// The controller's figures (`dataplane_egressip_*`).
pub struct ControllerMetrics {
    registry: Registry,
    unassigned: Family<[(&'static str, String); 3], Gauge>,
    held: Family<[(&'static str, String); 1], Gauge>,
}

impl ControllerMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("dataplane");
        let unassigned = Family::default();
        registry.register(
            "egressip_unassigned",
            "Egress IPs the controller could not assign (the log says why), by object, address and reason",
            unassigned.clone(),
        );
        let held = Family::default();
        registry.register(
            "egressip_assigned",
            "Egress IPs published for each node",
            held.clone(),
        );
        Self {
            registry,
            unassigned,
            held,
        }
    }
}

impl Default for ControllerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Exposition for ControllerMetrics {
    fn render(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// How the controller probes: the agents' port, the shared key, and the epoch its probes
/// are ordered in (see [`super::probe`]).
pub struct ProbeSettings {
    pub port: u16,
    pub key: Arc<ProbeKey>,
    pub epoch: u64,
}

/// The controller's memory between rounds.
pub struct Controller {
    probe: ProbeSettings,
    /// Probes sent in this epoch: the next one's counter.
    counter: u64,
    /// When it started (or became leader): what it cannot know was granted before.
    started: Instant,
    /// Last successful probe of each node.
    answered: BTreeMap<String, Instant>,
    grants: BTreeMap<(String, IpAddr), Grant>,
    /// The published status: address -> (object, node).
    published: BTreeMap<IpAddr, (String, String)>,
    /// Whether `published` was read from the objects yet.
    adopted: bool,
    last_written: Option<StatusFile>,
    /// Assignable nodes that stopped answering (logged once when they stop, once when back).
    silent: BTreeSet<String>,
    problems: Vec<Problem>,
    metrics: Arc<Mutex<ControllerMetrics>>,
}

impl Controller {
    pub fn new(probe: ProbeSettings, metrics: Arc<Mutex<ControllerMetrics>>) -> Self {
        Controller {
            probe,
            counter: 0,
            started: Instant::now(),
            answered: BTreeMap::new(),
            grants: BTreeMap::new(),
            published: BTreeMap::new(),
            adopted: false,
            last_written: None,
            silent: BTreeSet::new(),
            problems: Vec::new(),
            metrics,
        }
    }

    /// One round: probe every node with its grants, decide, publish what may be published.
    pub async fn round(
        &mut self,
        state: &ClusterState,
        store: &mut impl StatusStore,
    ) -> Result<(), String> {
        let timeout = state.egress_ip_config.reachability_timeout();
        if !self.adopted {
            self.adopt(state);
        }
        // Probe first (granting what the status gives each node), so that the decision sees
        // who answers now: the first round decides on answers, not on silence.
        let nodes = state.nodes.to_vec();
        let egress_ips = state.egress_ips.to_vec();
        if timeout.is_some() {
            self.probe_all(&nodes).await;
        }
        let candidates = candidates(&nodes, |node| self.reachable(node, timeout));
        self.note_reachability(&candidates);
        let current: BTreeMap<IpAddr, String> = self
            .published
            .iter()
            .map(|(ip, (_, node))| (*ip, node.clone()))
            .collect();
        let decision = assign(&egress_ips, &candidates, &current);
        self.report(&decision);
        self.advance(&decision, state, timeout);
        let statuses = self.statuses(&egress_ips);
        if self.last_written.as_ref() != Some(&statuses) {
            store.publish(&egress_ips, &statuses).await?;
            tracing::info!(status = ?statuses, "egress IP status published");
            self.last_written = Some(statuses);
            self.record_held();
        }
        Ok(())
    }

    /// Starts from the status the objects carry (a restarted controller keeps what holds).
    fn adopt(&mut self, state: &ClusterState) {
        for object in &state.egress_ips {
            let name = object.metadata.name.clone().unwrap_or_default();
            for item in object.status.iter().flat_map(|s| &s.items) {
                if let Ok(ip) = item.egress_ip.parse() {
                    self.published.insert(ip, (name.clone(), item.node.clone()));
                }
            }
        }
        self.adopted = true;
    }

    /// Logs the assignable nodes that stopped or started answering their probes.
    fn note_reachability(&mut self, candidates: &[Candidate]) {
        for candidate in candidates {
            let silent = candidate.eligible == Err(UNREACHABLE.into());
            if silent && self.silent.insert(candidate.name.clone()) {
                if self.answered.contains_key(&candidate.name) {
                    tracing::warn!(node = candidate.name, "node stopped answering its probes");
                } else {
                    tracing::warn!(
                        node = candidate.name,
                        "assignable node does not answer its probes"
                    );
                }
            } else if !silent && self.silent.remove(&candidate.name) {
                tracing::info!(node = candidate.name, "node answers its probes again");
            }
        }
    }

    /// Whether `node` answered a probe within the timeout (always, with the check off).
    fn reachable(&self, node: &str, timeout: Option<Duration>) -> bool {
        let Some(timeout) = timeout else { return true };
        self.answered
            .get(node)
            .is_some_and(|at| at.elapsed() < timeout)
    }

    /// Moves the published status one step towards `decision`: withdraws what moves or goes,
    /// publishes what no other node may still hold.
    fn advance(&mut self, decision: &Assignment, state: &ClusterState, timeout: Option<Duration>) {
        let wanted: BTreeMap<IpAddr, (String, String)> = decision
            .items
            .iter()
            .flat_map(|(object, items)| {
                items
                    .iter()
                    .map(move |(ip, node)| (*ip, (object.clone(), node.clone())))
            })
            .collect();
        self.published.retain(|ip, holder| {
            let keep = wanted.get(ip) == Some(holder);
            if !keep {
                tracing::info!(egress_ip = %ip, object = holder.0, node = holder.1, "egress IP withdrawn");
            }
            keep
        });
        for (ip, holder) in wanted {
            if self.published.contains_key(&ip) {
                continue;
            }
            let others: Vec<&str> = state
                .nodes
                .iter()
                .filter_map(|n| n.metadata.name.as_deref())
                .filter(|n| *n != holder.1)
                .collect();
            if others.iter().all(|n| self.let_go(n, ip, timeout)) {
                tracing::info!(egress_ip = %ip, object = holder.0, node = holder.1, "egress IP assigned");
                self.published.insert(ip, holder);
            }
        }
    }

    /// Whether `node` cannot hold `ip` any more: it said so, or its last grant lapsed.
    fn let_go(&self, node: &str, ip: IpAddr, timeout: Option<Duration>) -> bool {
        // With the check off the agents hold from the status alone: nothing to wait for.
        let Some(timeout) = timeout else { return true };
        let lapsed = |at: Instant| at.elapsed() >= timeout + MARGIN;
        match self.grants.get(&(node.to_owned(), ip)) {
            Some(Grant::Released) => true,
            Some(Grant::Sent(at)) => lapsed(*at),
            None => lapsed(self.started),
        }
    }

    /// The objects' statuses from the published holders, in each object's spec order.
    fn statuses(&self, objects: &[Arc<EgressIP>]) -> StatusFile {
        let mut statuses = StatusFile::new();
        for object in objects {
            let name = object.metadata.name.clone().unwrap_or_default();
            let items = object
                .spec
                .egress_ips
                .iter()
                .filter_map(|t| t.parse::<IpAddr>().ok())
                .filter_map(|ip| {
                    let (owner, node) = self.published.get(&ip)?;
                    (owner == &name).then(|| EgressIpStatusItem {
                        node: node.clone(),
                        egress_ip: ip.to_string(),
                    })
                })
                .collect();
            statuses.insert(name, EgressIpStatus { items });
        }
        statuses
    }

    /// Logs the problems that are new, and sets the metric to the current ones.
    fn report(&mut self, decision: &Assignment) {
        for problem in &decision.problems {
            if !self.problems.contains(problem) {
                tracing::warn!(
                    egressip = problem.object,
                    egress_ip = %problem.ip,
                    reason = problem.reason.name(),
                    "{}",
                    problem.message
                );
            }
        }
        if self.problems != decision.problems {
            let metrics = self.metrics.lock().unwrap_or_else(|p| p.into_inner());
            metrics.unassigned.clear();
            for problem in &decision.problems {
                metrics
                    .unassigned
                    .get_or_create(&[
                        ("egressip", problem.object.clone()),
                        ("ip", problem.ip.to_string()),
                        ("reason", problem.reason.name().to_owned()),
                    ])
                    .set(1);
            }
            self.problems = decision.problems.clone();
        }
    }

    fn record_held(&self) {
        let metrics = self.metrics.lock().unwrap_or_else(|p| p.into_inner());
        metrics.held.clear();
        for (_, node) in self.published.values() {
            metrics.held.get_or_create(&[("node", node.clone())]).inc();
        }
    }

    /// Probes every node with an address at the same time, each granted what the status
    /// gives it; records the answers and the grants sent.
    async fn probe_all(&mut self, nodes: &[Arc<Node>]) {
        // One count a round, for every node: later than every probe of this epoch before.
        self.counter += 1;
        let order = Order {
            epoch: self.probe.epoch,
            counter: self.counter,
        };
        let mut probes = Vec::new();
        for node in nodes {
            let (Some(name), Some(address)) = (node.metadata.name.clone(), internal_ip(node))
            else {
                continue;
            };
            let granted: BTreeSet<IpAddr> = self
                .published
                .iter()
                .filter(|(_, (_, holder))| *holder == name)
                .map(|(ip, _)| *ip)
                .collect();
            let target = SocketAddr::new(address, self.probe.port);
            let key = Arc::clone(&self.probe.key);
            probes.push(async move {
                let sent = Instant::now();
                let message = Probe {
                    node: name.clone(),
                    order,
                    grants: granted.clone(),
                };
                let reply = probe(target, &message, &key).await;
                (name, granted, sent, reply)
            });
        }
        for (name, granted, sent, reply) in futures_util::future::join_all(probes).await {
            for ip in &granted {
                self.grants.insert((name.clone(), *ip), Grant::Sent(sent));
            }
            match reply {
                Ok(reply) => {
                    self.answered.insert(name.clone(), Instant::now());
                    // What this probe no longer granted and the node no longer holds is let go,
                    // if no later probe granted it since.
                    for ((node, ip), grant) in &mut self.grants {
                        if node == &name
                            && !granted.contains(ip)
                            && !reply.held.contains(ip)
                            && matches!(grant, Grant::Sent(at) if *at <= sent)
                        {
                            *grant = Grant::Released;
                        }
                    }
                }
                Err(error) => {
                    tracing::debug!(node = name, %error, "probe failed");
                }
            }
        }
    }
}

/// How often the controller decides and probes.
pub const ROUND: Duration = Duration::from_millis(200);
/// How often a manifest directory is read again.
const REREAD: Duration = Duration::from_secs(1);
/// The Lease the controller replicas elect their leader on.
pub const LEASE_NAME: &str = "dataplane-egressip-controller";

/// Runs against a manifest directory (status in its status file) until dropped; `probe` says
/// the agents' port and the key (its epoch is counted in the directory here).
pub async fn run_manifests(
    dir: PathBuf,
    mut probe: ProbeSettings,
    metrics: Arc<Mutex<ControllerMetrics>>,
) -> Result<(), String> {
    let epoch_file = dir.join(super::probe::MANIFEST_EPOCH_FILE);
    probe.epoch = super::probe::next_manifest_epoch(&epoch_file)
        .map_err(|e| format!("{}: {e}", epoch_file.display()))?;
    tracing::info!(epoch = probe.epoch, "egress IP probes of this start");
    let mut controller = Controller::new(probe, metrics);
    let mut store = FileStore { dir: dir.clone() };
    let mut state: Option<ClusterState> = None;
    let mut read_at: Option<Instant> = None;
    let mut rounds = tokio::time::interval(ROUND);
    loop {
        rounds.tick().await;
        if read_at.is_none_or(|at| at.elapsed() >= REREAD) {
            read_at = Some(Instant::now());
            match crate::source::read_dir(&dir) {
                Ok(mut read) => {
                    if let Some(statuses) = super::read_status_file(&dir) {
                        let mut objects = read.egress_ips.to_vec();
                        super::merge_status(&mut objects, &statuses);
                        read.egress_ips = objects.into();
                    }
                    state = Some(read);
                }
                // The last good state stays in force.
                Err(error) => tracing::warn!(error = %error, "reading the manifests"),
            }
        }
        if let Some(state) = &state
            && let Err(error) = controller.round(state, &mut store).await
        {
            tracing::warn!(%error, "egress IP round");
        }
    }
}

/// The leader election's Lease: where, who, for how long.
pub struct LeaseOptions {
    pub namespace: String,
    pub identity: String,
    pub duration: Duration,
}

/// Runs against the API server until dropped: leads when it holds the Lease `LEASE_NAME` in
/// `namespace`, and waits otherwise; `leader_state` gets the cluster state while it leads
/// (None while it stands by) for the leader's other work.
pub async fn run_kubernetes(
    client: kube::Client,
    network_config: Option<std::path::PathBuf>,
    lease: LeaseOptions,
    probe_port: u16,
    key: Arc<ProbeKey>,
    metrics: Arc<Mutex<ControllerMetrics>>,
    leader_state: tokio::sync::watch::Sender<Option<ClusterState>>,
) {
    let LeaseOptions {
        namespace,
        identity,
        duration,
    } = lease;
    let mut source = crate::kubernetes::KubeSource::start(&client);
    if let Some(path) = network_config {
        source = source.with_network_file(path);
    }
    source.wait_ready().await;
    let mut leadership =
        super::leader::Leadership::new(client.clone(), &namespace, LEASE_NAME, &identity, duration);
    let mut store = ApiStore { client };
    let mut state = source.snapshot(false);
    let mut state_changed = true;
    let mut leading: Option<Controller> = None;
    let mut subnets = crate::subnets::SubnetAllocator::default();
    let mut attempted: Option<Instant> = None;
    let mut renewed: Option<Instant> = None;
    let mut rounds = tokio::time::interval(ROUND);
    loop {
        rounds.tick().await;
        if attempted.is_none_or(|at| at.elapsed() >= leadership.renew_every()) {
            attempted = Some(Instant::now());
            match leadership.acquire_or_renew().await {
                Ok(Some(epoch)) => {
                    renewed = Some(Instant::now());
                    if leading.is_none() {
                        tracing::info!(
                            identity,
                            lease = LEASE_NAME,
                            epoch,
                            "leading the egress IP controller"
                        );
                        // A new leader cannot know what the last one granted: it waits a
                        // whole grant before moving anything (Controller::let_go).
                        let probe = ProbeSettings {
                            port: probe_port,
                            key: Arc::clone(&key),
                            epoch,
                        };
                        leading = Some(Controller::new(probe, Arc::clone(&metrics)));
                    }
                }
                Ok(None) => {
                    if leading.take().is_some() {
                        tracing::warn!(identity, "another replica holds the lease; standing by");
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "renewing the controller lease");
                    // Step down before the Lease can pass to another replica.
                    if renewed.is_none_or(|at| at.elapsed() >= leadership.step_down_after())
                        && leading.take().is_some()
                    {
                        tracing::warn!(identity, "lease not renewed in time; standing by");
                    }
                }
            }
        }
        if source.changed() {
            state = source.snapshot(false);
            state_changed = true;
        }
        // What else the leader does (the egress routers) follows the state in its own task.
        let leads = leading.is_some();
        if state_changed || leads != leader_state.borrow().is_some() {
            leader_state.send_replace(leads.then(|| state.clone()));
            state_changed = false;
        }
        if let Some(controller) = &mut leading
            && let Err(error) = controller.round(&state, &mut store).await
        {
            tracing::warn!(%error, "egress IP round");
        }
        // The leader also gives nodes their pod subnets where the cluster gives none.
        if leading.is_some() {
            subnets.round(&state, &source).await;
        }
    }
}

/// One probe: `GET /egressip/probe` on the node's agent, signed with `key`; its reply, if the
/// node signed it and it answers this probe.
pub async fn probe(
    target: SocketAddr,
    message: &Probe,
    key: &ProbeKey,
) -> Result<ProbeReply, String> {
    let query = message.to_query(key);
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(target)
            .await
            .map_err(|e| format!("connecting to {target}: {e}"))?;
        // Reset, not closed, when given up on: a request left in the socket must not reach
        // the node later and renew what the controller counts as lapsed. (The deprecation is
        // about a non-zero linger blocking on drop; a zero one resets at once.)
        #[expect(deprecated, reason = "a zero linger resets at once, it never blocks")]
        stream.set_linger(Some(Duration::ZERO)).ok();
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("{target}: {e}"))?;
        tokio::spawn(connection);
        let request = Request::get(format!("{PROBE_PATH}?{query}"))
            .header(hyper::header::HOST, target.to_string())
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| format!("{target}: {e}"))?;
        let status = response.status();
        // At most a page of answer: a node's reply is a few addresses.
        let body = http_body_util::Limited::new(response.into_body(), 64 * 1024)
            .collect()
            .await
            .map_err(|e| format!("{target}: {e}"))?
            .to_bytes();
        if status != StatusCode::OK {
            return Err(format!(
                "{target}: {status}: {}",
                String::from_utf8_lossy(&body).trim()
            ));
        }
        let reply =
            serde_json::from_slice::<ProbeReply>(&body).map_err(|e| format!("{target}: {e}"))?;
        reply
            .check(key, message)
            .map_err(|e| format!("{target}: the answer: {e}"))?;
        Ok(reply)
    };
    tokio::time::timeout(PROBE_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("{target}: no answer within {PROBE_TIMEOUT:?}"))?
}

/// The nodes as the assignment sees them; `reachable` says whether a node answers probes.
pub fn candidates(nodes: &[Arc<Node>], reachable: impl Fn(&str) -> bool) -> Vec<Candidate> {
    nodes
        .iter()
        .filter_map(|node| {
            let name = node.metadata.name.clone()?;
            let eligible = eligibility(node, reachable(&name));
            Some(Candidate {
                addresses: node_addresses(node),
                subnets: primary_subnets(node),
                eligible,
                name,
            })
        })
        .collect()
}

/// Why a node may not hold egress IPs, if it may not.
fn eligibility(node: &Node, reachable: bool) -> Result<(), String> {
    let labels = node.metadata.labels.as_ref();
    if !labels.is_some_and(|l| l.contains_key(ASSIGNABLE_LABEL)) {
        return Err(format!("not labelled {ASSIGNABLE_LABEL}"));
    }
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .is_none_or(|c| c.status == "True");
    if !ready {
        return Err("NotReady".into());
    }
    if !reachable {
        return Err(UNREACHABLE.into());
    }
    Ok(())
}

/// The node's addresses of every type (InternalIP, ExternalIP).
fn node_addresses(node: &Node) -> Vec<IpAddr> {
    node.status
        .iter()
        .flat_map(|s| s.addresses.iter().flatten())
        .filter_map(|a| a.address.parse().ok())
        .collect()
}

/// The node's first InternalIP, where its agent answers probes.
fn internal_ip(node: &Node) -> Option<IpAddr> {
    node.status
        .iter()
        .flat_map(|s| s.addresses.iter().flatten())
        .filter(|a| a.type_ == "InternalIP")
        .find_map(|a| a.address.parse().ok())
}

/// This node's `k8s.ovn.org/node-primary-ifaddr`, as OVN-Kubernetes writes it: per family,
/// the underlay network (`networks`, the underlay interface's) holding the node's own address
/// (`addresses`, its InternalIPs), as `address/prefix`. `None` when no address is on the
/// underlay (nothing to announce).
pub fn primary_ifaddr(networks: &[IpNet], addresses: &[std::net::IpAddr]) -> Option<String> {
    let mut fields = BTreeMap::new();
    for address in addresses {
        let family = if address.is_ipv4() { "ipv4" } else { "ipv6" };
        if fields.contains_key(family) {
            continue;
        }
        if let Some(net) = networks.iter().find(|n| n.addr() == *address) {
            fields.insert(family, net.to_string());
        }
    }
    (!fields.is_empty()).then(|| serde_json::json!(fields).to_string())
}

/// The node's underlay subnets from `k8s.ovn.org/node-primary-ifaddr`
/// (`{"ipv4":"10.99.0.2/24","ipv6":"fd99::2/64"}`); none when absent or malformed.
pub fn primary_subnets(node: &Node) -> Vec<IpNet> {
    let Some(text) = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(PRIMARY_IFADDR))
    else {
        return Vec::new();
    };
    let Ok(fields) = serde_json::from_str::<BTreeMap<String, String>>(text) else {
        tracing::warn!(
            node = node.metadata.name.as_deref().unwrap_or_default(),
            annotation = PRIMARY_IFADDR,
            "not a JSON object of strings; the node gets no egress IPs"
        );
        return Vec::new();
    };
    fields
        .values()
        .filter_map(|cidr| cidr.parse::<IpNet>().ok())
        .map(|net| net.trunc())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_primary_ifaddr_names_the_underlay_network_of_each_own_address() {
        let nets: Vec<IpNet> = ["10.99.0.1/24", "192.0.2.9/28", "fd99::1/64"]
            .iter()
            .map(|n| n.parse().unwrap())
            .collect();
        let own = ["10.99.0.1".parse().unwrap(), "fd99::1".parse().unwrap()];
        let text = primary_ifaddr(&nets, &own).expect("annotation");
        assert_eq!(text, r#"{"ipv4":"10.99.0.1/24","ipv6":"fd99::1/64"}"#);
        // What the controller reads back: the networks themselves.
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "a", "annotations": {PRIMARY_IFADDR: text}}
        }))
        .unwrap();
        assert_eq!(
            primary_subnets(&node),
            vec![
                "10.99.0.0/24".parse::<IpNet>().unwrap(),
                "fd99::/64".parse().unwrap()
            ]
        );
        // No own address on the underlay: nothing to write.
        assert_eq!(primary_ifaddr(&nets, &["10.0.0.1".parse().unwrap()]), None);
    }

    fn node(yaml: &str) -> Node {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn eligibility_names_the_label_readiness_and_probes() {
        let labelled = node(
            "metadata: {name: a, labels: {k8s.ovn.org/egress-assignable: ''}, annotations: {k8s.ovn.org/node-primary-ifaddr: '{\"ipv4\":\"10.99.0.1/24\"}'}}\n\
             status: {addresses: [{type: InternalIP, address: 10.99.0.1}], conditions: [{type: Ready, status: 'True'}]}",
        );
        let found = candidates(&[Arc::new(labelled.clone())], |_| true);
        assert_eq!(found[0].eligible, Ok(()));
        assert_eq!(found[0].subnets, ["10.99.0.0/24".parse::<IpNet>().unwrap()]);
        assert_eq!(found[0].addresses, ["10.99.0.1".parse::<IpAddr>().unwrap()]);
        let unreachable = candidates(&[Arc::new(labelled.clone())], |_| false);
        assert_eq!(
            unreachable[0].eligible,
            Err("not answering its probes".into())
        );
        let not_ready = node(
            "metadata: {name: a, labels: {k8s.ovn.org/egress-assignable: ''}}\n\
             status: {conditions: [{type: Ready, status: 'False'}]}",
        );
        assert_eq!(eligibility(&not_ready, true), Err("NotReady".into()));
        let unlabelled = node("metadata: {name: a}");
        assert!(
            eligibility(&unlabelled, true)
                .unwrap_err()
                .contains("not labelled")
        );
    }
}
