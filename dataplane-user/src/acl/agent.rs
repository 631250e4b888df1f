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
    acl::{ACL_KIND_POLICY, ACL_VERDICT_DENY, AclEvent},
    maps,
};
use k8s_openapi::api::{core::v1::Namespace, networking::v1::NetworkPolicy};
use tokio::io::{Interest, unix::AsyncFd};

use super::{
    AclPod, AclState, AclSyncStats,
    audit::{AuditLog, NamespaceLogging, PolicyAuditConfig, RecordSource, namespace_logging},
    dns::{self, DnsNames, Resolver},
    firewall::{CompiledFirewalls, EgressFirewall, FirewallContext, compile_firewalls_reusing},
    policy::{Direction, PolicyCluster, PolicyPod, namespace_labels, policy_sets},
};
use crate::{AgentError, Dataplane};

/// How long the first resolution of every name may take before the firewalls are installed
/// (names not answered by then match nothing until they are).
const FIRST_RESOLUTION_BUDGET: Duration = Duration::from_secs(5);

/// Everything the firewalls are compiled from.
pub struct FirewallInputs {
    pub objects: Vec<Arc<EgressFirewall>>,
    pub policies: Vec<Arc<NetworkPolicy>>,
    /// Every pod of the cluster, as policy peers.
    pub cluster_pods: Vec<PolicyPod>,
    pub namespaces: Vec<Arc<Namespace>>,
    pub context: FirewallContext,
    pub pods: Vec<AclPod>,
    pub dns_server: Option<IpAddr>,
    /// The file the names' last good addresses are kept in across agent restarts.
    pub dns_cache: PathBuf,
    pub audit: PolicyAuditConfig,
    /// The audit log file.
    pub audit_path: PathBuf,
}

impl FirewallInputs {
    /// Keeps only the EgressFirewalls and NetworkPolicies of namespaces with a pod on this
    /// node: a node judges its own pods' traffic only (a pod's egress at its veth, a packet to
    /// it at its veth), and both kinds apply to their own namespace's pods. So a node resolves,
    /// compiles and writes nothing for namespaces it does not host: at 5,000 nodes, a
    /// firewall's DNS names are resolved by the nodes of its namespace's pods, not by all.
    /// What stays cluster-wide is what a local pod's rules may name: every pod as a policy
    /// peer, and the namespaces' labels.
    pub fn keep_hosted_namespaces(&mut self) {
        let hosted: std::collections::BTreeSet<String> =
            self.pods.iter().map(|p| p.namespace.clone()).collect();
        let hosts =
            |namespace: &Option<String>| hosted.contains(namespace.as_deref().unwrap_or("default"));
        self.objects.retain(|f| hosts(&f.metadata.namespace));
        self.policies.retain(|p| hosts(&p.metadata.namespace));
    }
}

pub struct FirewallAgent {
    objects: Vec<Arc<EgressFirewall>>,
    policies: Vec<Arc<NetworkPolicy>>,
    cluster_pods: Vec<PolicyPod>,
    namespace_labels: BTreeMap<String, BTreeMap<String, String>>,
    /// Policy errors of the last compile (logged once).
    policy_errors: Vec<String>,
    context: FirewallContext,
    pods: Vec<AclPod>,
    /// Audit levels of the namespaces that log.
    levels: BTreeMap<String, NamespaceLogging>,
    state: AclState,
    names: DnsNames,
    dns_cache: PathBuf,
    resolver: Option<Resolver>,
    compiled: CompiledFirewalls,
    audit: Option<AuditLog>,
    events: Option<AsyncFd<RingBuf<MapData>>>,
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
}

impl FirewallAgent {
    /// How many EgressFirewalls and NetworkPolicies the last compile rejected.
    pub fn rejected(&self) -> (usize, usize) {
        (self.compiled.errors.len(), self.policy_errors.len())
    }

    /// Compiles the firewalls, resolves their DNS names (within `FIRST_RESOLUTION_BUDGET`),
    /// adopts what a previous agent left pinned, syncs the maps and opens the audit log.
    pub async fn start(
        dataplane: &mut Dataplane,
        inputs: FirewallInputs,
    ) -> Result<Self, AgentError> {
        let (levels, warnings) = namespace_logging(&inputs.namespaces);
        for warning in &warnings {
            tracing::warn!(%warning, "audit logging");
        }
        let mut agent = Self {
            objects: inputs.objects,
            policies: inputs.policies,
            cluster_pods: inputs.cluster_pods,
            namespace_labels: namespace_labels(&inputs.namespaces),
            policy_errors: Vec::new(),
            context: inputs.context,
            pods: inputs.pods,
            levels: levels.into_iter().collect(),
            state: AclState::default(),
            names: DnsNames::default(),
            dns_cache: inputs.dns_cache.clone(),
            resolver: None,
            compiled: CompiledFirewalls::default(),
            audit: None,
            events: None,
        };
        agent.compile();
        for error in &agent.compiled.errors {
            tracing::warn!(%error, "egress firewall");
        }
        for error in &agent.policy_errors {
            tracing::warn!(%error, "network policy");
        }
        let wanted = agent.compiled.all_names();
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
        dataplane.adopt_acl(&mut agent.state, &agent.pods)?;
        let stats = dataplane.sync_acl(&mut agent.state, &agent.compiled.desired, &agent.pods)?;
        tracing::info!(
            sets = stats.sets,
            network_policies = agent.policies.len(),
            isolated_pods = agent.compiled.desired.pod_policies.len(),
            dns_names = wanted.len(),
            audited_namespaces = agent.levels.len(),
            exempt = ?agent.context.exempt,
            written = stats.written,
            deleted = stats.deleted,
            "access control configured"
        );
        Ok(agent)
    }

    /// Compiles the firewalls with the names' last good addresses, the NetworkPolicies of the
    /// local pods and the audit flags.
    fn compile(&mut self) {
        // The last compile: its firewall and policy sets still wanted are not compiled again.
        let previous = std::mem::take(&mut self.compiled);
        self.compiled = compile_firewalls_reusing(
            &self.objects,
            &self.context,
            &self.names.addresses(),
            &previous,
        );
        let cluster = PolicyCluster::new(&self.cluster_pods, &self.namespace_labels);
        let local: Vec<String> = self.pods.iter().map(AclPod::key).collect();
        let policies = policy_sets(
            &self.policies,
            &cluster,
            &local,
            &previous.desired.policy_sets,
        );
        self.compiled.desired.policy_sets = policies.sets;
        self.compiled.desired.pod_policies = policies.pods;
        self.policy_errors = policies.errors;
        self.compiled.desired.log = self
            .levels
            .iter()
            .map(|(namespace, levels)| (namespace.clone(), levels.flags()))
            .collect();
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
        if self.levels.is_empty() {
            return Ok(());
        }
        match AuditLog::open(settings, path) {
            Ok(log) => self.audit = Some(log),
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "audit log not writable; no audit records");
                return Ok(());
            }
        }
        let pin = dataplane.pins().map(maps::ACL_EVENTS);
        let ring = MapData::from_pin(&pin)
            .map_err(|e| AgentError::Map {
                name: maps::ACL_EVENTS.into(),
                action: "open pin",
                source: e,
            })
            .and_then(|data| {
                RingBuf::try_from(Map::RingBuf(data)).map_err(|source| AgentError::Map {
                    name: maps::ACL_EVENTS.into(),
                    action: "open",
                    source,
                })
            })?;
        // SAFETY: the ring buffer owns its map's descriptor, which stays open and the same
        // for as long as the ring (moved into the AsyncFd) lives.
        match unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) } {
            Ok(fd) => self.events = Some(fd),
            Err(error) => {
                tracing::warn!(%error, "audit ring buffer not pollable; no audit records");
            }
        }
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
        let events = async {
            match &self.events {
                Some(fd) => match fd.readable().await {
                    Ok(mut guard) => guard.clear_ready(),
                    Err(_) => std::future::pending().await,
                },
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = refresh => Wake::Refresh,
            () = events => Wake::Events,
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
        let (levels, warnings) = namespace_logging(&inputs.namespaces);
        for warning in &warnings {
            tracing::warn!(%warning, "audit logging");
        }
        self.objects = inputs.objects;
        self.policies = inputs.policies;
        self.cluster_pods = inputs.cluster_pods;
        self.namespace_labels = namespace_labels(&inputs.namespaces);
        self.context = inputs.context;
        self.pods = inputs.pods;
        self.levels = levels.into_iter().collect();
        self.compile();
        let wanted = self.compiled.all_names();
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
        self.compile();
        for error in self.compiled.errors.iter().chain(&self.policy_errors) {
            tracing::warn!(%error, "access control");
        }
        let stats = dataplane.sync_acl(&mut self.state, &self.compiled.desired, &self.pods)?;
        tracing::info!(
            sets = stats.sets,
            isolated_pods = self.compiled.desired.pod_policies.len(),
            written = stats.written,
            deleted = stats.deleted,
            "access control updated"
        );
        Ok(Updated { stats, dns_changed })
    }

    /// When a DNS name is next due for a refresh.
    fn next_refresh(&self) -> Option<Instant> {
        self.resolver.as_ref()?;
        self.names.next_refresh()
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
            let Some((namespace, acl_name)) = describe(&self.state, &event) else {
                continue;
            };
            let Some(levels) = self.levels.get(&namespace) else {
                continue;
            };
            let severity = if event.verdict == ACL_VERDICT_DENY {
                levels.deny
            } else {
                levels.allow
            };
            let Some(severity) = severity else { continue };
            let source = RecordSource {
                namespace,
                acl_name,
                severity,
            };
            if let Err(error) = log.record(&event, &source) {
                tracing::warn!(%error, "writing the audit log");
            }
        }
    }

    /// Resolves the names that are due; where addresses changed, updates the firewalls that
    /// use them.
    async fn refresh(&mut self, dataplane: &mut Dataplane) -> Result<(), AgentError> {
        let changed = self.resolve_due().await;
        if changed.is_empty() {
            return Ok(());
        }
        self.compile();
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
                    let stats =
                        dataplane.sync_acl(&mut self.state, &self.compiled.desired, &self.pods)?;
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

    /// Looks up every due name; returns those whose addresses changed.
    async fn resolve_due(&mut self) -> BTreeSet<String> {
        let mut changed = BTreeSet::new();
        let Some(resolver) = &self.resolver else {
            return changed;
        };
        for name in self.names.due(Instant::now()) {
            let result = resolver.lookup(&name).await;
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

/// The namespace a record belongs to and the ACL name it is logged under, as OVN-Kubernetes
/// names them: `EF:<namespace>:default` for the EgressFirewall, `NP:<namespace>:<policy>:
/// <Ingress|Egress>` for a NetworkPolicy (its rule index follows in the record).
fn describe(state: &AclState, event: &AclEvent) -> Option<(String, String)> {
    if event.kind == ACL_KIND_POLICY {
        let set = state.policy_set(event.set)?;
        let direction = match set.direction {
            Direction::Ingress => "Ingress",
            Direction::Egress => "Egress",
        };
        let name = match set.refs.get(event.rule as usize) {
            Some(reference) => {
                let policy = reference.policy.rsplit('/').next().unwrap_or_default();
                format!("NP:{}:{policy}:{direction}", set.namespace)
            }
            // No rule allowed: the isolation itself denied.
            None => format!("NP:{}:isolation:{direction}", set.namespace),
        };
        return Some((set.namespace.clone(), name));
    }
    let namespace = state.namespace_of(event.set)?;
    Some((namespace.to_owned(), format!("EF:{namespace}:default")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named<T: serde::de::DeserializeOwned>(kind: &str, namespace: &str) -> T {
        serde_json::from_value(serde_json::json!({
            "apiVersion": if kind == "EgressFirewall" { "k8s.ovn.org/v1" } else { "networking.k8s.io/v1" },
            "kind": kind,
            "metadata": {"name": "default", "namespace": namespace},
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
        let mut inputs = FirewallInputs {
            objects: vec![
                Arc::new(named("EgressFirewall", "web")),
                Arc::new(named("EgressFirewall", "db")),
            ],
            policies: vec![
                Arc::new(named("NetworkPolicy", "web")),
                Arc::new(named("NetworkPolicy", "batch")),
            ],
            cluster_pods: Vec::new(),
            namespaces: Vec::new(),
            context: FirewallContext::default(),
            pods: vec![AclPod {
                namespace: "web".into(),
                name: "a".into(),
                addresses: vec!["10.244.1.2".parse().unwrap()],
            }],
            dns_server: None,
            dns_cache: PathBuf::new(),
            audit: PolicyAuditConfig::default(),
            audit_path: PathBuf::new(),
        };
        inputs.keep_hosted_namespaces();
        let namespaces = |names: Vec<Option<String>>| -> Vec<String> {
            names.into_iter().map(|n| n.unwrap_or_default()).collect()
        };
        assert_eq!(
            namespaces(
                inputs
                    .objects
                    .iter()
                    .map(|f| f.metadata.namespace.clone())
                    .collect()
            ),
            ["web"]
        );
        assert_eq!(
            namespaces(
                inputs
                    .policies
                    .iter()
                    .map(|p| p.metadata.namespace.clone())
                    .collect()
            ),
            ["web"]
        );
    }
}
