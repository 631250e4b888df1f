//! The EgressFirewalls as the running agent keeps them: compiled against this node, their DNS
//! names resolved and refreshed, the maps updated when a name's addresses change (in place,
//! touching only that name's entries, when the set allows it), and the kernel's audit records
//! written to the audit log.

mod hosted_lists;
mod names;
mod records;

pub use hosted_lists::HostedLists;
pub(crate) use records::{open_ring, readable};

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use aya::maps::{MapData, RingBuf};
use dataplane_common::maps;
use k8s_openapi::api::{core::v1::Namespace, networking::v1::NetworkPolicy};
use tokio::io::unix::AsyncFd;

use super::{
    AclPod, AclState, AclSyncStats,
    admin::{self, AdminNode, AdminPolicies, AdminPolicy, ObjectKey},
    audit::{AuditLog, NamespaceLogging, namespace_logging},
    dns::{self, DnsNames, Resolver, Snooped},
    firewall::{CompiledFirewalls, DnsAddresses, FirewallContext, compile_firewalls_reusing},
    peers::Registry,
    pods::{NamespaceLabels, PolicyChanges, PolicyPod, PolicyPods, namespace_labels},
    policy::{CompiledPolicies, EntryBudget, PodRulesCache, policy_sets_since},
    select::PolicyCluster,
};
use crate::{
    api::{adminpolicy::AdminObjects, egressfirewall::EgressFirewall, network::PolicyAuditConfig},
    error::AgentError,
    kernel::loader::Dataplane,
};

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
    /// What the local pods' policy sets may hold together (the maps' capacity).
    entry_budget: EntryBudget,
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
            entry_budget: EntryBudget(dataplane.capacities().acl_entries as usize),
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
            budget: self.entry_budget,
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
}

// What the tests below take from here with `use super::*`.
#[cfg(test)]
use {
    super::{pod_rules::PolicyKind, pods::Direction},
    dataplane_common::acl::{ACL_KIND_POLICY, AclEvent},
    hosted_lists::{hosted, slot_of},
    records::describe,
};

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
