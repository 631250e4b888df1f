//! The EgressFirewalls as the running agent keeps them: compiled against this node, their DNS
//! names resolved and refreshed, the maps updated when a name's addresses change (in place,
//! touching only that name's entries, when the set allows it), and the kernel's audit records
//! written to the audit log.

use std::sync::Arc;
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::PathBuf,
    time::{Duration, Instant},
};

use aya::maps::{Map, MapData, RingBuf};
use dataplane_common::{
    acl::{ACL_KIND_POLICY, ACL_VERDICT_DENY, AclDnsEvent, AclEvent},
    maps,
};
use k8s_openapi::api::{core::v1::Namespace, networking::v1::NetworkPolicy};
use tokio::io::{Interest, unix::AsyncFd};

use crate::api::{
    adminpolicy::AdminObjects, egressfirewall::EgressFirewall, network::PolicyAuditConfig,
};

use super::{
    AclPod, AclState, AclSyncStats,
    admin::{self, AdminNode, AdminPolicies, AdminPolicy, ObjectKey},
    audit::{AuditLog, NamespaceLogging, RecordSource, namespace_logging},
    dns::{self, DnsNames, Resolver, Snooped},
    firewall::{CompiledFirewalls, DnsAddresses, FirewallContext, compile_firewalls_reusing},
    peers::Registry,
    pod_rules::PolicyKind,
    pods::{Direction, NamespaceLabels, PolicyChanges, PolicyPod, PolicyPods, namespace_labels},
    policy::{CompiledPolicies, PodRulesCache, policy_sets_since},
    select::PolicyCluster,
};
use crate::{AgentError, Dataplane};

/// How long the first resolution of every name may take before the firewalls are installed
/// (names not answered by then match nothing until they are).
const FIRST_RESOLUTION_BUDGET: Duration = Duration::from_secs(5);

/// Everything the firewalls are compiled from.
pub struct FirewallInputs {
    pub objects: Vec<Arc<EgressFirewall>>,
    pub policies: Vec<Arc<NetworkPolicy>>,
    /// AdminNetworkPolicies, the BaselineAdminNetworkPolicy, ClusterNetworkPolicies.
    pub admin: AdminObjects,
    /// Every node, as admin policies' `nodes` peers.
    pub nodes: Vec<AdminNode>,
    /// Every pod of the cluster, as policy peers.
    pub cluster_pods: PolicyPods,
    /// What changed for the NetworkPolicies since the last inputs.
    pub changes: PolicyChanges,
    pub namespaces: crate::source::Objects<Namespace>,
    pub context: FirewallContext,
    pub pods: Vec<AclPod>,
    pub dns_server: Option<IpAddr>,
    /// The file the names' last good addresses are kept in across agent restarts.
    pub dns_cache: PathBuf,
    /// The cluster DNS Service's addresses and endpoints (see [`admin::dns_servers`]).
    pub dns_servers: BTreeSet<IpAddr>,
    pub audit: PolicyAuditConfig,
    /// The audit log file.
    pub audit_path: PathBuf,
    /// The directory where what each policy set's rules stand for is written (see
    /// [`super::explain`]).
    pub rules_dir: PathBuf,
}

/// Where access control keeps its files, and the DNS server it asks.
#[derive(Clone, Debug, Default)]
pub struct FirewallFiles {
    pub dns_server: Option<IpAddr>,
    pub dns_cache: PathBuf,
    pub audit_path: PathBuf,
    pub rules_dir: PathBuf,
}

impl FirewallInputs {
    /// What access control reads of a sync's cluster state: every pod as a peer, the
    /// namespaces' labels, `changes` since the last inputs, and the EgressFirewalls and
    /// NetworkPolicies of the namespaces with a pod on this node only (see [`hosted`]). The
    /// nodes, which admin policies' `nodes` peers read, only while there is an admin policy.
    /// `lists_in_key_order`: the state's lists are in namespace and name order (the API
    /// source's: searched by namespace), not in a manifest directory's files' order (looked
    /// at whole; checking the order at each run cost 5 to 8 ms at 22,000 objects).
    /// `last` keeps what the last call took of the lists, for the next.
    pub fn from_state(
        state: &crate::source::ClusterState,
        view: &crate::model::OverlayView,
        cluster_pods: PolicyPods,
        changes: PolicyChanges,
        files: &FirewallFiles,
        lists_in_key_order: bool,
        last: &mut HostedLists,
    ) -> Self {
        let pods = super::pods_of(view);
        let namespaces: BTreeSet<&str> = pods.iter().map(|p| p.namespace.as_str()).collect();
        last.follow_namespaces(&namespaces, lists_in_key_order);
        let admin = state.admin_objects();
        let nodes = if admin.is_empty() {
            Vec::new()
        } else {
            admin::admin_nodes(&state.nodes)
        };
        Self {
            objects: last
                .firewalls
                .take(&state.egress_firewalls, &namespaces, lists_in_key_order),
            policies: last
                .policies
                .take(&state.network_policies, &namespaces, lists_in_key_order),
            admin,
            nodes,
            cluster_pods,
            changes,
            namespaces: state.namespaces.clone(),
            context: super::firewall::context(state, view),
            pods,
            dns_server: files.dns_server,
            dns_cache: files.dns_cache.clone(),
            dns_servers: admin::dns_servers(state, lists_in_key_order),
            audit: state.policy_audit.clone(),
            audit_path: files.audit_path.clone(),
            rules_dir: files.rules_dir.clone(),
        }
    }
}

/// The hosted namespaces' EgressFirewalls and NetworkPolicies as [`FirewallInputs::from_state`]
/// last took them: taken again from a list only when that list or the hosted namespaces
/// changed. A pod or node change leaves both as they were, and walking the 2,000 policies of
/// a large cluster for them was 5 to 8 % of such a change.
#[derive(Default)]
pub struct HostedLists {
    /// The hosted namespaces, and whether the lists were in key order, of the last call.
    namespaces: Vec<String>,
    in_key_order: bool,
    firewalls: Hosted<EgressFirewall>,
    policies: Hosted<NetworkPolicy>,
}

impl HostedLists {
    /// Forgets what was taken when the hosted namespaces are not those of the last call.
    fn follow_namespaces(&mut self, namespaces: &BTreeSet<&str>, in_key_order: bool) {
        if self.in_key_order == in_key_order
            && namespaces
                .iter()
                .copied()
                .eq(self.namespaces.iter().map(String::as_str))
        {
            return;
        }
        *self = Self {
            namespaces: namespaces.iter().map(|n| n.to_string()).collect(),
            in_key_order,
            ..Self::default()
        };
    }
}

/// One kind's hosted objects and the list they were taken from.
struct Hosted<T> {
    from: Option<crate::source::Objects<T>>,
    hosted: Vec<Arc<T>>,
}

impl<T> Default for Hosted<T> {
    fn default() -> Self {
        Self {
            from: None,
            hosted: Vec::new(),
        }
    }
}

impl<T: kube::Resource> Hosted<T> {
    /// [`hosted`] of `objects`, the last result when `objects` is the list it came from.
    fn take(
        &mut self,
        objects: &crate::source::Objects<T>,
        namespaces: &BTreeSet<&str>,
        ordered: bool,
    ) -> Vec<Arc<T>> {
        let kept = match &self.from {
            Some(from) if from.shares(objects) => true,
            // A list the object cache changed at a few keys since (a policy's port, say):
            // only those keys are looked at, where walking the 2,000 policies again was a
            // tenth of such a change.
            Some(from) if ordered => objects.placed_since(from).is_some_and(|placed| {
                let keys: BTreeSet<(&str, &str)> = placed.collect();
                keys.len() <= FEW_PLACED && {
                    patch_hosted(&mut self.hosted, objects, namespaces, &keys);
                    true
                }
            }),
            _ => false,
        };
        if !kept {
            self.hosted = hosted(objects, namespaces, ordered);
        }
        self.from = Some(objects.clone());
        self.hosted.clone()
    }
}

/// Up to this many keys placed since the last list, [`hosted`]'s result is patched.
const FEW_PLACED: usize = 64;

/// Where an object of `hosted`'s result sorts: by namespace (one without sorts where
/// `default` does, before `default`'s own objects), then name.
fn hosted_slot<'a>(namespace: &'a str, name: &'a str) -> (&'a str, bool, &'a str) {
    if namespace.is_empty() {
        ("default", false, name)
    } else {
        (namespace, true, name)
    }
}

/// Where `object` sorts in [`hosted`]'s result (see [`hosted_slot`]).
fn slot_of<T: kube::Resource>(object: &T) -> (&str, bool, &str) {
    let meta = object.meta();
    hosted_slot(
        meta.namespace.as_deref().unwrap_or(""),
        meta.name.as_deref().unwrap_or(""),
    )
}

/// Brings `hosted`, [`hosted`]'s result for an earlier version of `objects` (in key order),
/// to `objects` at the `placed` keys: each is taken out, and put back where it sorts if the
/// list holds it and its namespace is hosted.
fn patch_hosted<T: kube::Resource>(
    hosted: &mut Vec<Arc<T>>,
    objects: &crate::source::Objects<T>,
    namespaces: &BTreeSet<&str>,
    placed: &BTreeSet<(&str, &str)>,
) {
    for &(namespace, name) in placed {
        let slot = hosted_slot(namespace, name);
        if !namespaces.contains(slot.0) {
            continue;
        }
        if let Some(at) = hosted.iter().position(|o| slot_of(&**o) == slot) {
            hosted.remove(at);
        }
        if let Some(object) = objects.at_key((namespace, name)) {
            let at = hosted.partition_point(|o| slot_of(&**o) < slot);
            hosted.insert(at, Arc::clone(object));
        }
    }
}

/// The objects of `namespaces` (an object without a namespace is in `default`), by namespace
/// and, within one, in the list's order. A node judges its own pods' traffic only (a pod's
/// egress at its veth, a packet to it at its veth), and EgressFirewalls and NetworkPolicies
/// apply to their own namespace's pods: so a node resolves, compiles and writes nothing for
/// namespaces it does not host (at 5,000 nodes, a firewall's DNS names are resolved by the
/// nodes of its namespace's pods, not by all). What stays cluster-wide is what a local pod's
/// rules may name: every pod as a policy peer, and the namespaces' labels. A list in key order
/// (the API source's) is walked once, its runs of one namespace kept or skipped whole: a
/// binary search per hosted namespace into the persistent list cost every access-control
/// sync 0.4 ms at 2,000 policies and 110 namespaces, against tens of microseconds for the walk.
fn hosted<T: kube::Resource>(
    objects: &crate::source::Objects<T>,
    namespaces: &BTreeSet<&str>,
    ordered: bool,
) -> Vec<Arc<T>> {
    if !ordered {
        let mut out = Vec::new();
        for namespace in namespaces {
            if *namespace == "default" {
                out.extend(objects.of_namespace("", false));
            }
            out.extend(objects.of_namespace(namespace, false));
        }
        return out;
    }
    let hosts_default = namespaces.contains("default");
    // Objects without a namespace sort first in the list but belong where `default` sorts.
    let mut unnamespaced = Vec::new();
    let mut out = Vec::new();
    let mut run: Option<(&str, bool)> = None;
    for object in objects.iter() {
        let namespace = object.meta().namespace.as_deref().unwrap_or("");
        if namespace.is_empty() {
            if hosts_default {
                unnamespaced.push(Arc::clone(object));
            }
            continue;
        }
        let kept = match run {
            Some((current, kept)) if current == namespace => kept,
            _ => {
                let kept = namespaces.contains(namespace);
                run = Some((namespace, kept));
                kept
            }
        };
        if !kept {
            continue;
        }
        if namespace >= "default" && !unnamespaced.is_empty() {
            out.append(&mut unnamespaced);
        }
        out.push(Arc::clone(object));
    }
    out.append(&mut unnamespaced);
    out
}

pub struct FirewallAgent {
    objects: Vec<Arc<EgressFirewall>>,
    policies: Vec<Arc<NetworkPolicy>>,
    /// The admin policies in force (validated, ordered; their domains' addresses filled in
    /// at each compile).
    admin: AdminPolicies,
    /// The last good version of each admin policy object.
    admin_last_good: BTreeMap<ObjectKey, AdminPolicy>,
    /// Admin policy objects rejected by the last validation.
    admin_errors: Vec<String>,
    cluster_pods: PolicyPods,
    /// Each local pod's policy sets as last compiled, and the changes since.
    pod_rules: PodRulesCache,
    pending: PolicyChanges,
    /// The peer identities handed out (see [`super::peers`]).
    identities: Registry,
    /// The namespaces as last given, and what is read of them: their labels, and the audit
    /// levels of those that log (made again only when a namespace changed).
    namespaces: crate::source::Objects<Namespace>,
    namespace_labels: NamespaceLabels,
    /// Policy errors of the last compile (logged once).
    policy_errors: Vec<String>,
    context: FirewallContext,
    pods: Vec<AclPod>,
    /// Audit levels of the namespaces that log.
    levels: BTreeMap<String, NamespaceLogging>,
    state: AclState,
    /// Whether the maps hold the last compile: its sync succeeded and nothing it reads
    /// moved since (see [`Self::update`]).
    in_sync: bool,
    /// `state.meta_version()` when the sets were last described (`None`: not yet), and what
    /// they were described as then.
    described: Option<u64>,
    descriptions: BTreeMap<u32, super::explain::SetRules>,
    names: DnsNames,
    dns_cache: PathBuf,
    rules_dir: PathBuf,
    resolver: Option<Resolver>,
    compiled: CompiledFirewalls,
    /// The EgressFirewall objects and DNS addresses `compiled`'s firewalls were compiled
    /// from (with `compiled.context`).
    firewalls_read: Option<(Vec<Arc<EgressFirewall>>, DnsAddresses)>,
    audit: Option<AuditLog>,
    events: Option<AsyncFd<RingBuf<MapData>>>,
    /// Wildcard names' addresses learned from DNS answers, and the ring the kernel copies
    /// those answers to.
    snooped: Snooped,
    dns_answers: Option<AsyncFd<RingBuf<MapData>>>,
    /// Where DNS answers are trusted from (the cluster DNS Service and its endpoints).
    dns_servers: BTreeSet<IpAddr>,
}

/// Whether two lists hold the same objects (shared, not copies) in the same order.
fn same_objects<T>(a: &[Arc<T>], b: &[Arc<T>]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| Arc::ptr_eq(a, b))
}

/// What [`FirewallAgent::update`] did.
pub struct Updated {
    pub stats: AclSyncStats,
    /// Some DNS name's addresses changed (or were not all answered in time) during the
    /// update: not everything it wrote came from the cluster state.
    pub dns_changed: bool,
}

/// What woke the agent up.
pub enum Wake {
    Refresh,
    Events,
    DnsAnswers,
}

impl FirewallAgent {
    /// How many EgressFirewalls, NetworkPolicies and admin policies the last compile
    /// rejected.
    /// Every refusal line of the last update: EgressFirewalls, NetworkPolicies, admin
    /// policies.
    pub fn rejections(&self) -> impl Iterator<Item = &String> {
        self.compiled
            .errors
            .iter()
            .chain(&self.policy_errors)
            .chain(&self.admin_errors)
    }

    pub fn rejected(&self) -> (usize, usize, usize) {
        (
            self.compiled.errors.len(),
            self.policy_errors.len(),
            self.admin_errors.len(),
        )
    }

    /// Validates the admin policy objects (an invalid one keeps its last good version) and
    /// logs what was rejected or is ambiguous.
    fn take_admin(&mut self, objects: &AdminObjects, nodes: Vec<AdminNode>) {
        let validated = admin::validate_all(objects, &mut self.admin_last_good);
        for error in &validated.errors {
            tracing::warn!(%error, "admin network policy rejected");
        }
        for warning in &validated.warnings {
            tracing::warn!(%warning, "admin network policy");
        }
        self.admin = validated.policies;
        self.admin.nodes = nodes;
        self.admin_errors = validated.errors;
    }

    /// Writes what the installed policy sets' rules stand for, for `inspect` and `trace`,
    /// when it changed since it was last written.
    fn describe_sets(&mut self) {
        let version = self.state.meta_version();
        if self.described == Some(version) {
            return;
        }
        let changed = self.state.take_described_changes();
        let written = match self.described {
            Some(_) => {
                super::explain::set_rules_since(&self.state, &mut self.descriptions, &changed);
                Some(&changed)
            }
            None => {
                self.descriptions = super::explain::set_rules(&self.state);
                None
            }
        };
        self.described = Some(version);
        if let Err(error) = super::explain::write(&self.rules_dir, &self.descriptions, written) {
            tracing::warn!(path = %self.rules_dir.display(), %error, "writing the policy rule names");
            // Written whole at the next change, whichever sets it changes.
            self.described = None;
        }
    }

    /// Whether a namespace or an admin policy asks for audit records.
    fn wants_audit(&self) -> bool {
        !self.levels.is_empty() || self.admin.all().any(|p| p.log.is_some())
    }

    /// Every DNS name the firewalls and the admin policies of this node's pods use.
    fn wanted_names(&self) -> BTreeSet<String> {
        let mut names = self.compiled.all_names();
        names.extend(self.admin_names().0);
        names
    }

    /// The `domainNames` of the admin policies that apply to a pod of this node: the names
    /// to resolve and the wildcard patterns to learn from DNS answers.
    fn admin_names(&self) -> (BTreeSet<String>, BTreeSet<String>) {
        if self.admin.all().next().is_none() {
            return Default::default();
        }
        let cluster = PolicyCluster::new(&self.cluster_pods, &self.namespace_labels);
        let local: Vec<&PolicyPod> = self
            .pods
            .iter()
            .filter_map(|p| self.cluster_pods.get(&p.namespace, &p.name))
            .collect();
        admin::domain_names(&self.admin, &cluster, &local)
    }

    /// Compiles the firewalls, resolves their DNS names (within `FIRST_RESOLUTION_BUDGET`),
    /// adopts what a previous agent left pinned, syncs the maps and opens the audit log.
    /// Returns the agent and what its first sync wrote.
    pub async fn start(
        dataplane: &mut Dataplane,
        inputs: FirewallInputs,
    ) -> Result<(Self, AclSyncStats), AgentError> {
        let (levels, warnings) = namespace_logging(&inputs.namespaces);
        for warning in &warnings {
            tracing::warn!(%warning, "audit logging");
        }
        let mut agent = Self {
            objects: inputs.objects,
            policies: inputs.policies,
            admin: AdminPolicies::default(),
            admin_last_good: BTreeMap::new(),
            admin_errors: Vec::new(),
            cluster_pods: inputs.cluster_pods,
            pod_rules: PodRulesCache::default(),
            pending: PolicyChanges::everything(),
            identities: Registry::default(),
            namespace_labels: namespace_labels(&inputs.namespaces),
            namespaces: inputs.namespaces,
            policy_errors: Vec::new(),
            context: inputs.context,
            pods: inputs.pods,
            levels: levels.into_iter().collect(),
            state: AclState::default(),
            in_sync: false,
            described: None,
            descriptions: BTreeMap::new(),
            names: DnsNames::default(),
            dns_cache: inputs.dns_cache.clone(),
            rules_dir: inputs.rules_dir.clone(),
            resolver: None,
            compiled: CompiledFirewalls::default(),
            firewalls_read: None,
            audit: None,
            events: None,
            snooped: Snooped::default(),
            dns_answers: None,
            dns_servers: inputs.dns_servers.clone(),
        };
        // Before the first compile hands identities out: a previous agent's sets stay in
        // force until this one's replace them, and name its numbers.
        let held = dataplane.peers_held()?;
        agent
            .identities
            .borrow_mut()
            .adopt(&held, &agent.cluster_pods);
        agent.state.note_peers_left(&held);
        agent.take_admin(&inputs.admin, inputs.nodes);
        agent.compile();
        for error in &agent.compiled.errors {
            tracing::warn!(%error, "egress firewall");
        }
        for error in &agent.policy_errors {
            tracing::warn!(%error, "network policy");
        }
        let wanted = agent.wanted_names();
        agent.names.track(&wanted, Instant::now());
        // What a previous agent last resolved stays in force until a lookup answers: a restart
        // while DNS fails must not take addresses away from the rules.
        let kept = agent.names.seed(&dns::load_cache(&agent.dns_cache));
        if kept != 0 {
            tracing::info!(names = kept, path = %agent.dns_cache.display(), "DNS names start from the last good addresses");
        }
        if !wanted.is_empty() {
            match Resolver::new(inputs.dns_server) {
                Ok(resolver) => agent.resolver = Some(resolver),
                Err(error) => tracing::warn!(%error, "dnsName rules will match nothing"),
            }
        }
        let budget = tokio::time::timeout(FIRST_RESOLUTION_BUDGET, agent.resolve_due());
        if budget.await.is_err() {
            tracing::warn!("DNS names not all resolved in time; their rules apply once they are");
        }
        agent.compile();
        agent.open_audit(dataplane, &inputs.audit, &inputs.audit_path)?;
        agent.dns_answers = open_ring(dataplane, maps::ACL_DNS)?;
        dataplane.adopt_acl(&mut agent.state, &agent.pods)?;
        let stats = agent.sync_maps(dataplane)?;
        agent.describe_sets();
        tracing::info!(
            sets = stats.sets,
            network_policies = agent.policies.len(),
            admin_policies = agent.admin.admin.len() + agent.admin.baseline.len(),
            isolated_pods = agent.compiled.desired.pod_policies.len(),
            dns_names = wanted.len(),
            audited_namespaces = agent.levels.len(),
            exempt = ?agent.context.exempt,
            written = stats.written,
            deleted = stats.deleted,
            "access control configured"
        );
        Ok((agent, stats))
    }

    /// Compiles the firewalls with the names' last good addresses, the NetworkPolicies of the
    /// local pods and the audit flags. Returns whether what the maps' sync reads of it may
    /// differ from the last compile's.
    fn compile(&mut self) -> bool {
        // The last compile: its firewall and policy sets still wanted are not compiled again.
        let mut previous = std::mem::take(&mut self.compiled);
        let mut policies = CompiledPolicies {
            sets: std::mem::take(&mut previous.desired.policy_sets),
            pods: std::mem::take(&mut previous.desired.pod_policies),
            errors: std::mem::take(&mut self.policy_errors),
        };
        let last_log = std::mem::take(&mut previous.desired.log);
        let previous_peers = std::mem::take(&mut previous.desired.peers);
        let addresses = self.names.addresses();
        // The firewalls read their objects, this node's context and their names' addresses
        // only: when those are the last compile's, so is every firewall (a pod or policy
        // change then compiles the policies alone; walking 100 firewalls to keep each was
        // 7 % of such a change).
        let firewalls_hold = self.firewalls_read.as_ref().is_some_and(|(objects, read)| {
            same_objects(objects, &self.objects)
                && previous.context == self.context
                && *read == addresses
        });
        self.admin.domains = addresses.clone();
        self.admin.domains.extend(self.snooped.addresses());
        self.compiled = if firewalls_hold {
            previous
        } else {
            let compiled =
                compile_firewalls_reusing(&self.objects, &self.context, &addresses, &previous);
            self.firewalls_read = Some((self.objects.clone(), addresses));
            compiled
        };
        let changes = std::mem::take(&mut self.pending);
        let mut cluster = PolicyCluster::new(&self.cluster_pods, &self.namespace_labels);
        // Admin policies' tiers are first-match lists: their sets name every peer address.
        if self.admin.all().next().is_none() {
            cluster = cluster.with_identities(&self.identities);
        }
        let local: Vec<String> = self.pods.iter().map(AclPod::key).collect();
        let recompiled = policy_sets_since(
            &self.policies,
            &cluster,
            &local,
            &mut policies,
            &self.admin,
            &mut self.pod_rules,
            &changes,
        );
        let peers = {
            let mut identities = self.identities.borrow_mut();
            identities.follow(&changes);
            identities.named_by(&policies.sets, &self.cluster_pods)
        };
        let peers_moved = peers != previous_peers;
        self.compiled.desired.peers = peers;
        self.compiled.desired.policy_sets = policies.sets;
        self.compiled.desired.pod_policies = policies.pods;
        self.policy_errors = policies.errors;
        self.compiled.desired.log = self
            .levels
            .iter()
            .map(|(namespace, levels)| (namespace.clone(), levels.flags()))
            .collect();
        let moved = !firewalls_hold
            || recompiled.changed
            || peers_moved
            || self.compiled.desired.log != last_log;
        // The maps hold this compile only once a sync wrote it.
        self.in_sync &= !moved;
        moved
    }

    /// Sets the kernel's per-CPU rate and, when a namespace logs, opens the log file and the
    /// ring buffer. An invalid `policyAuditConfig` is reported and the defaults are used.
    fn open_audit(
        &mut self,
        dataplane: &mut Dataplane,
        config: &PolicyAuditConfig,
        path: &std::path::Path,
    ) -> Result<(), AgentError> {
        let settings = config.validate().unwrap_or_else(|error| {
            tracing::warn!(%error, "policyAuditConfig invalid; using the defaults");
            PolicyAuditConfig::default()
                .validate()
                .expect("the defaults are valid")
        });
        dataplane.set_audit_rate(settings.rate_limit)?;
        if !self.wants_audit() {
            return Ok(());
        }
        match AuditLog::open(settings, path) {
            Ok(log) => self.audit = Some(log),
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "audit log not writable; no audit records");
                return Ok(());
            }
        }
        self.events = open_ring(dataplane, maps::ACL_EVENTS)?;
        tracing::info!(path = %path.display(), "audit log open");
        Ok(())
    }

    /// Waits until there is something to do: a DNS name is due, or audit records wait.
    pub async fn wait(&self) -> Wake {
        let due = self.next_refresh();
        let refresh = async {
            match due {
                Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = refresh => Wake::Refresh,
            () = readable(self.events.as_ref()) => Wake::Events,
            () = readable(self.dns_answers.as_ref()) => Wake::DnsAnswers,
        }
    }

    /// Does what [`FirewallAgent::wait`] woke up for.
    pub async fn handle(
        &mut self,
        dataplane: &mut Dataplane,
        wake: Wake,
    ) -> Result<(), AgentError> {
        match wake {
            Wake::Refresh => self.refresh(dataplane).await,
            Wake::Events => {
                self.drain_events();
                Ok(())
            }
            Wake::DnsAnswers => self.learn_dns_answers(dataplane),
        }
    }

    /// Takes new cluster state (the manifests changed): compiles everything again, resolves
    /// new DNS names and syncs. Selectors are evaluated anew, so label changes take effect;
    /// changed sets are switched in whole, unchanged ones keep their maps. Returns what the
    /// sync wrote.
    pub async fn update(
        &mut self,
        dataplane: &mut Dataplane,
        inputs: FirewallInputs,
    ) -> Result<Updated, AgentError> {
        let unchanged = self.reads_the_same(&inputs);
        if !self.namespaces.holds_the_same(&inputs.namespaces) {
            let (levels, warnings) = namespace_logging(&inputs.namespaces);
            for warning in &warnings {
                tracing::warn!(%warning, "audit logging");
            }
            self.levels = levels.into_iter().collect();
            self.namespace_labels = namespace_labels(&inputs.namespaces);
            self.namespaces = inputs.namespaces;
        }
        self.objects = inputs.objects;
        self.policies = inputs.policies;
        let mut changes = inputs.changes;
        // Which local pods a pod change recompiles depends on the labels it had and has.
        changes.label(&self.cluster_pods, &inputs.cluster_pods);
        self.cluster_pods = inputs.cluster_pods;
        self.pending.merge(changes);
        self.context = inputs.context;
        let pods_moved = self.pods != inputs.pods;
        self.pods = inputs.pods;
        self.dns_servers = inputs.dns_servers;
        if unchanged {
            // Another node came or went, say: nothing access control compiles from moved.
            return Ok(Updated {
                stats: AclSyncStats::default(),
                dns_changed: false,
            });
        }
        self.take_admin(&inputs.admin, inputs.nodes);
        if self.audit.is_none() && self.wants_audit() {
            // The first namespace or admin policy asking for records since the start.
            self.open_audit(dataplane, &inputs.audit, &inputs.audit_path)?;
        }
        let mut moved = self.compile();
        let wanted = self.wanted_names();
        self.names.track(&wanted, Instant::now());
        if !wanted.is_empty() && self.resolver.is_none() {
            match Resolver::new(inputs.dns_server) {
                Ok(resolver) => self.resolver = Some(resolver),
                Err(error) => tracing::warn!(%error, "dnsName rules will match nothing"),
            }
        }
        let budget = tokio::time::timeout(FIRST_RESOLUTION_BUDGET, self.resolve_due());
        let dns_changed = match budget.await {
            Ok(changed) => !changed.is_empty(),
            Err(_) => {
                tracing::warn!(
                    "DNS names not all resolved in time; their rules apply once they are"
                );
                true
            }
        };
        // With the same addresses the compile above stands.
        if dns_changed {
            moved |= self.compile();
        }
        for error in self.compiled.errors.iter().chain(&self.policy_errors) {
            tracing::warn!(%error, "access control");
        }
        if self.in_sync && !moved && !pods_moved {
            // The maps hold what this compile gives (a pod added elsewhere that no local
            // pod's rules pick, say): their sync would walk every set and pod to write
            // nothing.
            return Ok(Updated {
                stats: AclSyncStats::default(),
                dns_changed,
            });
        }
        let stats = self.sync_maps(dataplane)?;
        self.describe_sets();
        tracing::info!(
            sets = stats.sets,
            isolated_pods = self.compiled.desired.pod_policies.len(),
            written = stats.written,
            deleted = stats.deleted,
            "access control updated"
        );
        Ok(Updated { stats, dns_changed })
    }

    /// Writes the last compile to the maps.
    fn sync_maps(&mut self, dataplane: &mut Dataplane) -> Result<AclSyncStats, AgentError> {
        self.in_sync = false;
        let stats = dataplane.sync_acl(&mut self.state, &self.compiled.desired, &self.pods)?;
        // A set closed for want of room is tried again at the next sync.
        self.in_sync = stats.closed.is_empty();
        for error in &stats.closed {
            tracing::error!(%error, "access control");
        }
        self.policy_errors.extend(stats.closed.iter().cloned());
        Ok(stats)
    }

    /// Whether `inputs` hold what the last compile read: the same objects (shared, not
    /// copies), this node's pods and context, no pod or policy change since, and no admin
    /// policy (those read every node and pod).
    fn reads_the_same(&self, inputs: &FirewallInputs) -> bool {
        self.pending.is_none()
            && inputs.changes.is_none()
            && inputs.admin.is_empty()
            && self.admin.all().next().is_none()
            && self.namespaces.holds_the_same(&inputs.namespaces)
            && same_objects(&self.objects, &inputs.objects)
            && same_objects(&self.policies, &inputs.policies)
            && self.context == inputs.context
            && self.pods == inputs.pods
            && self.dns_servers == inputs.dns_servers
    }

    /// When a DNS name is next due for a refresh, or a learned address expires.
    fn next_refresh(&self) -> Option<Instant> {
        let resolved = self.resolver.as_ref().and(self.names.next_refresh());
        [resolved, self.snooped.next_expiry()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Learns wildcard names' addresses from the DNS answers the kernel copied (those from
    /// a trusted DNS server only); switches in the sets that use new ones.
    fn learn_dns_answers(&mut self, dataplane: &mut Dataplane) -> Result<(), AgentError> {
        let patterns = self.admin_names().1;
        let mut trusted = self.dns_servers.clone();
        trusted.extend(self.context.node_addresses.iter().copied());
        let Some(fd) = self.dns_answers.as_mut() else {
            return Ok(());
        };
        let ring = fd.get_mut();
        let now = Instant::now();
        let (mut learned, mut untrusted) = (false, 0usize);
        while let Some(item) = ring.next() {
            if item.len() < std::mem::size_of::<AclDnsEvent>() {
                continue;
            }
            // SAFETY: the kernel wrote an AclDnsEvent (plain data) of at least this size.
            let event: AclDnsEvent = unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
            drop(item);
            if !trusted.contains(&crate::mapsync::ip_of(&event.src)) {
                untrusted += 1;
                continue;
            }
            let len = (event.len as usize).min(event.message.len());
            learned |= self.snooped.learn(&event.message[..len], &patterns, now);
        }
        if untrusted > 0 {
            tracing::warn!(
                answers = untrusted,
                "DNS answers to pods from addresses that are no cluster DNS server ignored"
            );
        }
        if !learned {
            return Ok(());
        }
        self.compile();
        let stats = self.sync_maps(dataplane)?;
        self.describe_sets();
        tracing::info!(
            learned = ?self.snooped.addresses(),
            written = stats.written,
            deleted = stats.deleted,
            "wildcard domain names learned new addresses; access control updated"
        );
        Ok(())
    }

    /// Writes every record waiting in the ring buffer.
    fn drain_events(&mut self) {
        let (Some(fd), Some(log)) = (self.events.as_mut(), self.audit.as_mut()) else {
            return;
        };
        let ring = fd.get_mut();
        while let Some(item) = ring.next() {
            if item.len() < std::mem::size_of::<AclEvent>() {
                continue;
            }
            // SAFETY: the kernel wrote an AclEvent (plain data) of at least this size.
            let event: AclEvent = unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
            drop(item);
            let Some(described) = describe(&self.state, &event) else {
                continue;
            };
            let levels = match &described.admin {
                Some((kind, name)) => admin_logging(&self.admin, *kind, name),
                None => self.levels.get(&described.namespace).copied(),
            };
            let Some(levels) = levels else {
                continue;
            };
            let severity = if event.verdict == ACL_VERDICT_DENY {
                levels.deny
            } else {
                levels.allow
            };
            let Some(severity) = severity else { continue };
            let source = RecordSource {
                namespace: described.namespace,
                acl_name: described.acl_name,
                severity,
                rule: described.rule,
            };
            if let Err(error) = log.record(&event, &source) {
                tracing::warn!(%error, "writing the audit log");
            }
        }
    }

    /// Resolves the names that are due; where addresses changed, updates the firewalls that
    /// use them.
    async fn refresh(&mut self, dataplane: &mut Dataplane) -> Result<(), AgentError> {
        let patterns = self.admin_names().1;
        if self.snooped.expire(&patterns, Instant::now()) {
            self.compile();
            let stats = self.sync_maps(dataplane)?;
            self.describe_sets();
            tracing::info!(
                written = stats.written,
                deleted = stats.deleted,
                "learned addresses of wildcard domain names expired; access control updated"
            );
        }
        let changed = self.resolve_due().await;
        if changed.is_empty() {
            return Ok(());
        }
        self.compile();
        if !self.admin_names().0.is_disjoint(&changed) {
            // Admin policies' sets are per pod: switch in whatever they changed.
            let stats = self.sync_maps(dataplane)?;
            self.describe_sets();
            tracing::info!(
                names = ?changed,
                written = stats.written,
                deleted = stats.deleted,
                "DNS names changed; access control updated"
            );
            return Ok(());
        }
        let affected: Vec<String> = self
            .compiled
            .names
            .iter()
            .filter(|(_, names)| !names.is_disjoint(&changed))
            .map(|(namespace, _)| namespace.clone())
            .collect();
        let mut total = AclSyncStats::default();
        for namespace in &affected {
            let Some(set) = self.compiled.desired.sets.get(namespace) else {
                continue;
            };
            match dataplane.update_acl_in_place(&mut self.state, namespace, set)? {
                Some(stats) => {
                    total.sets += 1;
                    total.written += stats.written;
                    total.deleted += stats.deleted;
                }
                None => {
                    // A new set for everything that changed (the lengths moved, say).
                    let stats = self.sync_maps(dataplane)?;
                    self.describe_sets();
                    tracing::info!(
                        written = stats.written,
                        deleted = stats.deleted,
                        "egress firewalls rebuilt for changed DNS names"
                    );
                    return Ok(());
                }
            }
        }
        tracing::info!(
            names = ?changed,
            firewalls = total.sets,
            written = total.written,
            deleted = total.deleted,
            "DNS names changed; egress firewalls updated in place"
        );
        Ok(())
    }

    /// Looks up the due names, [`LOOKUPS_AT_ONCE`] at a time, each within
    /// [`LOOKUP_TIMEOUT`] and all within [`REFRESH_BUDGET`]: a slow or silent name server
    /// costs the agent's loop that long at most (names not looked up in time stay due, and
    /// keep their last good addresses). Returns the names whose addresses changed.
    async fn resolve_due(&mut self) -> BTreeSet<String> {
        use futures_util::StreamExt as _;
        let mut changed = BTreeSet::new();
        let Some(resolver) = &self.resolver else {
            return changed;
        };
        let due = self.names.due(Instant::now());
        let lookups = futures_util::stream::iter(due)
            .map(|name| async move {
                let result = tokio::time::timeout(LOOKUP_TIMEOUT, resolver.lookup(&name))
                    .await
                    .unwrap_or_else(|_| Err(format!("no answer within {LOOKUP_TIMEOUT:?}")));
                (name, result)
            })
            .buffer_unordered(LOOKUPS_AT_ONCE);
        let deadline = tokio::time::sleep(REFRESH_BUDGET);
        tokio::pin!(lookups, deadline);
        loop {
            let (name, result) = tokio::select! {
                next = lookups.next() => match next {
                    Some(done) => done,
                    None => break,
                },
                () = &mut deadline => {
                    tracing::warn!(budget = ?REFRESH_BUDGET, "DNS names not all looked up in time; the rest are tried at the next refresh");
                    break;
                }
            };
            if let Err(error) = &result {
                tracing::warn!(name, %error, "DNS lookup failed; keeping the last good addresses");
            }
            if self.names.record(&name, result, Instant::now()) {
                tracing::info!(
                    name,
                    addresses = ?self.names.addresses().get(&name),
                    "DNS name resolved to new addresses"
                );
                changed.insert(name);
            }
        }
        if !changed.is_empty()
            && let Err(error) = dns::save_cache(&self.dns_cache, &self.names.addresses())
        {
            tracing::warn!(%error, "keeping the DNS names' addresses for the next agent");
        }
        changed
    }
}

/// How long one DNS name's lookup may take.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one refresh of the due names may take in all.
const REFRESH_BUDGET: Duration = Duration::from_secs(3);
/// Lookups in flight at once.
const LOOKUPS_AT_ONCE: usize = 16;

/// Waits until `fd` is readable (forever without one).
pub(crate) async fn readable(fd: Option<&AsyncFd<RingBuf<MapData>>>) {
    match fd {
        Some(fd) => match fd.readable().await {
            Ok(mut guard) => guard.clear_ready(),
            Err(_) => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

/// Opens a pinned ring buffer for polling; `None` (with a warning) where it cannot be polled.
pub(crate) fn open_ring(
    dataplane: &Dataplane,
    name: &'static str,
) -> Result<Option<AsyncFd<RingBuf<MapData>>>, AgentError> {
    let pin = dataplane.pins().map(name);
    let ring = MapData::from_pin(&pin)
        .map_err(|e| AgentError::Map {
            name: name.into(),
            action: "open pin",
            source: e,
        })
        .and_then(|data| {
            RingBuf::try_from(Map::RingBuf(data)).map_err(|source| AgentError::Map {
                name: name.into(),
                action: "open",
                source,
            })
        })?;
    // SAFETY: the ring buffer owns its map's descriptor, which stays open and the same for as
    // long as the ring (moved into the AsyncFd) lives.
    match unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) } {
        Ok(fd) => Ok(Some(fd)),
        Err(error) => {
            tracing::warn!(%error, ring = name, "ring buffer not pollable");
            Ok(None)
        }
    }
}

/// The audit levels of an admin policy in force.
fn admin_logging(admin: &AdminPolicies, kind: PolicyKind, name: &str) -> Option<NamespaceLogging> {
    admin
        .all()
        .find(|p| p.kind == kind && p.name == name)
        .and_then(|p| p.log)
}

/// Who a record is about and the name it is logged under.
struct Described {
    /// The namespace of the pod whose rules decided.
    namespace: String,
    acl_name: String,
    /// The rule index the record names (the event's own when `None`).
    rule: Option<u32>,
    /// The cluster-wide policy that decided: its levels apply, not the namespace's.
    admin: Option<(PolicyKind, String)>,
}

/// The ACL name a record is logged under, as OVN-Kubernetes names them:
/// `EF:<namespace>:default` for the EgressFirewall, `NP:<namespace>:<policy>:<Ingress|Egress>`
/// for a NetworkPolicy (the record's rule index follows), `ANP:<name>:<Ingress|Egress>` and
/// `BANP:default:<Ingress|Egress>` (with the rule's index in the policy), and `CNP:<name>:...`
/// for a ClusterNetworkPolicy.
fn describe(state: &AclState, event: &AclEvent) -> Option<Described> {
    if event.kind == ACL_KIND_POLICY {
        let set = state.policy_set(event.set)?;
        let direction = match set.direction {
            Direction::Ingress => "Ingress",
            Direction::Egress => "Egress",
        };
        let namespace = set.namespace.clone();
        return Some(match set.refs.get(event.rule as usize) {
            Some(reference) if reference.kind == PolicyKind::NetworkPolicy => {
                let policy = reference.policy.rsplit('/').next().unwrap_or_default();
                Described {
                    acl_name: format!("NP:{namespace}:{policy}:{direction}"),
                    namespace,
                    rule: None,
                    admin: None,
                }
            }
            Some(reference) => Described {
                acl_name: format!(
                    "{}:{}:{direction}",
                    reference.kind.audit_prefix(),
                    reference.policy
                ),
                namespace,
                rule: Some(reference.rule as u32),
                admin: Some((reference.kind, reference.policy.clone())),
            },
            // No rule allowed: the isolation itself denied.
            None => Described {
                acl_name: format!("NP:{namespace}:isolation:{direction}"),
                namespace,
                rule: None,
                admin: None,
            },
        });
    }
    let namespace = state.namespace_of(event.set)?;
    Some(Described {
        acl_name: format!("EF:{namespace}:default"),
        namespace: namespace.to_owned(),
        rule: None,
        admin: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named<T: serde::de::DeserializeOwned>(kind: &str, namespace: &str) -> T {
        serde_json::from_value(serde_json::json!({
            "apiVersion": if kind == "EgressFirewall" { "k8s.ovn.org/v1" } else { "networking.k8s.io/v1" },
            "kind": kind,
            "metadata": if namespace.is_empty() {
                serde_json::json!({"name": "default"})
            } else {
                serde_json::json!({"name": "default", "namespace": namespace})
            },
            "spec": if kind == "EgressFirewall" {
                serde_json::json!({"egress": [{"type": "Allow", "to": {"dnsName": format!("{namespace}.example.com")}}]})
            } else {
                serde_json::json!({"podSelector": {}})
            },
        }))
        .expect(kind)
    }

    #[test]
    fn a_node_keeps_the_firewalls_and_policies_of_the_namespaces_it_hosts_only() {
        // In the sources' order: namespace (none first), then name.
        let firewalls: crate::source::Objects<EgressFirewall> = vec![
            Arc::new(named("EgressFirewall", "")),
            Arc::new(named("EgressFirewall", "batch")),
            Arc::new(named("EgressFirewall", "db")),
            Arc::new(named("EgressFirewall", "web")),
            Arc::new(named("EgressFirewall", "zeta")),
        ]
        .into();
        let policies: crate::source::Objects<NetworkPolicy> = vec![
            Arc::new(named("NetworkPolicy", "batch")),
            Arc::new(named("NetworkPolicy", "web")),
            Arc::new(named("NetworkPolicy", "web")),
        ]
        .into();
        let namespaces_of = |objects: Vec<Option<String>>| -> Vec<String> {
            objects.into_iter().map(|n| n.unwrap_or_default()).collect()
        };
        let web = BTreeSet::from(["web"]);
        let kept = hosted(&firewalls, &web, true);
        assert_eq!(
            namespaces_of(kept.iter().map(|f| f.metadata.namespace.clone()).collect()),
            ["web"]
        );
        assert!(Arc::ptr_eq(&kept[0], firewalls.get(3).unwrap()));
        let kept = hosted(&policies, &web, true);
        assert_eq!(kept.len(), 2);
        // An object without a namespace is in `default`.
        let kept = hosted(&firewalls, &BTreeSet::from(["default", "zeta"]), true);
        assert_eq!(
            namespaces_of(kept.iter().map(|f| f.metadata.namespace.clone()).collect()),
            ["", "zeta"]
        );
        assert!(hosted(&policies, &BTreeSet::from(["db", "default"]), true).is_empty());
        // The walk of a list in key order finds what a look per namespace finds, in the same
        // order: objects without a namespace where `default` sorts, between `batch` and `web`.
        let kept = hosted(
            &firewalls,
            &BTreeSet::from(["batch", "default", "web"]),
            true,
        );
        assert_eq!(
            namespaces_of(kept.iter().map(|f| f.metadata.namespace.clone()).collect()),
            ["batch", "", "web"]
        );
        let all = ["batch", "db", "default", "web", "zeta", "other"];
        for chosen in 0..1u32 << all.len() {
            let namespaces: BTreeSet<&str> = (0..all.len())
                .filter(|i| chosen & (1 << i) != 0)
                .map(|i| all[i])
                .collect();
            let walked = hosted(&firewalls, &namespaces, true);
            let searched = hosted(&firewalls, &namespaces, false);
            assert_eq!(walked.len(), searched.len(), "{namespaces:?}");
            assert!(
                walked.iter().zip(&searched).all(|(a, b)| Arc::ptr_eq(a, b)),
                "{namespaces:?}"
            );
        }
        // A manifest directory's list, in its files' order: found all the same, in that order.
        let unordered: crate::source::Objects<EgressFirewall> = ["zeta", "web", "", "web", "db"]
            .map(|namespace| Arc::new(named("EgressFirewall", namespace)))
            .to_vec()
            .into();
        assert!(!unordered.is_in_key_order());
        let kept = hosted(
            &unordered,
            &BTreeSet::from(["default", "web", "zeta"]),
            false,
        );
        assert_eq!(
            namespaces_of(kept.iter().map(|f| f.metadata.namespace.clone()).collect()),
            ["", "web", "web", "zeta"]
        );
        assert!(Arc::ptr_eq(&kept[1], unordered.get(1).unwrap()));
    }

    #[test]
    fn hosted_objects_are_taken_again_when_their_list_or_the_hosted_namespaces_change() {
        // Long enough not to be held inline (a persistent vector shares only its chunks), in
        // key order.
        let list = |namespaces: &[&str]| -> crate::source::Objects<EgressFirewall> {
            let mut namespaces = namespaces.to_vec();
            namespaces.extend(["other"; 40]);
            namespaces.sort();
            namespaces
                .iter()
                .map(|namespace| Arc::new(named("EgressFirewall", namespace)))
                .collect::<Vec<_>>()
                .into()
        };
        let same = |a: &[Arc<EgressFirewall>], b: &[Arc<EgressFirewall>]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| Arc::ptr_eq(x, y))
        };
        let mut last = HostedLists::default();
        let mut take = |objects: &crate::source::Objects<EgressFirewall>,
                        namespaces: &BTreeSet<&str>| {
            last.follow_namespaces(namespaces, true);
            let taken = last.firewalls.take(objects, namespaces, true);
            assert!(same(&taken, &hosted(objects, namespaces, true)));
            assert!(
                last.firewalls
                    .from
                    .as_ref()
                    .is_some_and(|f| f.shares(objects))
            );
            taken
        };
        let web = BTreeSet::from(["web"]);
        let first = list(&["batch", "web", "zeta"]);
        let taken = take(&first, &web);
        assert_eq!(taken.len(), 1);
        // The same list (a sync where no firewall changed) gives the same objects.
        assert!(same(&take(&first.clone(), &web), &taken));
        // A changed list is walked again, though as long.
        let second = list(&["batch", "web", "web"]);
        assert_eq!(take(&second, &web).len(), 2);
        // So is the same list for other namespaces.
        assert_eq!(take(&second, &BTreeSet::from(["batch", "web"])).len(), 3);
        assert!(take(&second, &BTreeSet::from(["zeta"])).is_empty());
        assert_eq!(take(&first, &BTreeSet::from(["zeta"])).len(), 1);
        // An empty list after a full one.
        assert!(take(&list(&[]), &BTreeSet::from(["zeta"])).is_empty());
    }

    /// A list the object cache changes a few keys at a time (objects added, replaced,
    /// removed, some without a namespace, some in `default`): the hosted objects patched at
    /// the placed keys are those taken from the whole list, the same objects in the same
    /// order, whatever namespaces are hosted; a step placing many keys takes them anew.
    #[test]
    fn hosted_objects_patched_at_the_placed_keys_equal_those_taken_anew() {
        use crate::source::Objects;
        let mut rng = crate::test_rng::TestRng::new(7);
        let spaces = ["", "alpha", "default", "delta", "web", "zeta"];
        let policy = |namespace: &str, name: u64, version: u64| -> Arc<NetworkPolicy> {
            let mut object: NetworkPolicy = named("NetworkPolicy", namespace);
            object.metadata.name = Some(format!("p{name}"));
            object.metadata.resource_version = Some(version.to_string());
            Arc::new(object)
        };
        let mut list: Objects<NetworkPolicy> = Objects::default();
        let mut last = HostedLists::default();
        for step in 0..600u64 {
            let hosting: BTreeSet<&str> = spaces
                .iter()
                .copied()
                .filter(|_| rng.below(2) == 0)
                .collect();
            let placings = if rng.below(20) == 0 {
                80
            } else {
                1 + rng.below(4)
            };
            for _ in 0..placings {
                let namespace = spaces[rng.below(spaces.len() as u64) as usize];
                let name = rng.below(12);
                let key = format!("p{name}");
                if rng.below(3) == 0 {
                    list.place((namespace, &key), None);
                } else {
                    list.place((namespace, &key), Some(&policy(namespace, name, step)));
                }
            }
            // The hosted namespaces change now and then (then everything is taken anew).
            let hosted_now: BTreeSet<&str> = if step % 7 == 0 {
                hosting
            } else {
                last.namespaces.iter().map(String::as_str).collect()
            };
            let namespaces: Vec<String> = hosted_now.iter().map(|n| n.to_string()).collect();
            let hosted_now: BTreeSet<&str> = namespaces.iter().map(String::as_str).collect();
            last.follow_namespaces(&hosted_now, true);
            let taken = last.policies.take(&list, &hosted_now, true);
            let anew = hosted(&list, &hosted_now, true);
            assert_eq!(taken.len(), anew.len(), "step {step}");
            assert!(
                taken.iter().zip(&anew).all(|(a, b)| Arc::ptr_eq(a, b)),
                "step {step}: {:?} against {:?}",
                taken.iter().map(|o| slot_of(&**o)).collect::<Vec<_>>(),
                anew.iter().map(|o| slot_of(&**o)).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn records_of_cluster_wide_policies_are_named_as_ovn_kubernetes_names_them() {
        use super::super::{pod_rules::RuleRef, pod_rules::Tier};
        let reference = |kind, tier, policy: &str, rule| RuleRef {
            kind,
            tier: Some(tier),
            policy: policy.into(),
            direction: Direction::Egress,
            rule,
            name: String::new(),
        };
        let mut state = AclState::default();
        state.policy_meta.insert(
            7,
            super::super::pod_rules::PolicySet {
                namespace: "web".into(),
                direction: Direction::Egress,
                refs: Arc::new(vec![
                    reference(PolicyKind::AdminNetworkPolicy, Tier::Admin, "guard", 3),
                    reference(
                        PolicyKind::BaselineAdminNetworkPolicy,
                        Tier::Baseline,
                        "default",
                        1,
                    ),
                    reference(PolicyKind::ClusterNetworkPolicy, Tier::Admin, "edge", 0),
                ]),
                compiled: Default::default(),
                rules: Default::default(),
            },
        );
        let named = |rule: u32| {
            let event = AclEvent {
                set: 7,
                rule,
                kind: ACL_KIND_POLICY,
                ..AclEvent::default()
            };
            let described = describe(&state, &event).expect("described");
            (described.acl_name, described.rule, described.admin)
        };
        assert_eq!(
            named(0),
            (
                "ANP:guard:Egress".to_owned(),
                Some(3),
                Some((PolicyKind::AdminNetworkPolicy, "guard".to_owned()))
            )
        );
        assert_eq!(named(1).0, "BANP:default:Egress");
        assert_eq!(named(1).1, Some(1));
        assert_eq!(named(2).0, "CNP:edge:Egress");
    }
}
