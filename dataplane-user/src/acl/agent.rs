//! The EgressFirewalls as the running agent keeps them: compiled against this node, their DNS
//! names resolved and refreshed, and the maps updated when a name's addresses change (in place,
//! touching only that name's entries, when the set allows it).

use std::{
    collections::BTreeSet,
    net::IpAddr,
    time::{Duration, Instant},
};

use super::{
    AclPod, AclState, AclSyncStats,
    dns::{DnsNames, Resolver},
    firewall::{CompiledFirewalls, EgressFirewall, FirewallContext, compile_firewalls},
};
use crate::{AgentError, Dataplane};

/// How long the first resolution of every name may take before the firewalls are installed
/// (names not answered by then match nothing until they are).
const FIRST_RESOLUTION_BUDGET: Duration = Duration::from_secs(5);

pub struct FirewallAgent {
    objects: Vec<EgressFirewall>,
    context: FirewallContext,
    pods: Vec<AclPod>,
    state: AclState,
    names: DnsNames,
    resolver: Option<Resolver>,
    compiled: CompiledFirewalls,
}

impl FirewallAgent {
    /// Compiles the firewalls, resolves their DNS names (within `FIRST_RESOLUTION_BUDGET`),
    /// adopts what a previous agent left pinned and syncs the maps.
    pub async fn start(
        dataplane: &mut Dataplane,
        objects: Vec<EgressFirewall>,
        context: FirewallContext,
        pods: Vec<AclPod>,
        dns_server: Option<IpAddr>,
    ) -> Result<Self, AgentError> {
        let compiled = compile_firewalls(&objects, &context, &Default::default());
        for error in &compiled.errors {
            tracing::warn!(%error, "egress firewall");
        }
        let mut names = DnsNames::default();
        let wanted = compiled.all_names();
        names.track(&wanted, Instant::now());
        let resolver = if wanted.is_empty() {
            None
        } else {
            match Resolver::new(dns_server) {
                Ok(resolver) => Some(resolver),
                Err(error) => {
                    tracing::warn!(%error, "dnsName rules will match nothing");
                    None
                }
            }
        };
        let mut agent = Self {
            objects,
            context,
            pods,
            state: AclState::default(),
            names,
            resolver,
            compiled,
        };
        let budget = tokio::time::timeout(FIRST_RESOLUTION_BUDGET, agent.resolve_due());
        if budget.await.is_err() {
            tracing::warn!("DNS names not all resolved in time; their rules apply once they are");
        }
        agent.compiled =
            compile_firewalls(&agent.objects, &agent.context, &agent.names.addresses());
        dataplane.adopt_acl(&mut agent.state, &agent.pods)?;
        let stats = dataplane.sync_acl(&mut agent.state, &agent.compiled.desired, &agent.pods)?;
        tracing::info!(
            firewalls = stats.sets,
            dns_names = wanted.len(),
            exempt = ?agent.context.exempt,
            written = stats.written,
            deleted = stats.deleted,
            "egress firewalls configured"
        );
        Ok(agent)
    }

    /// When a DNS name is next due for a refresh.
    pub fn next_refresh(&self) -> Option<Instant> {
        self.resolver.as_ref()?;
        self.names.next_refresh()
    }

    /// Resolves the names that are due; where addresses changed, updates the firewalls that
    /// use them.
    pub async fn refresh(&mut self, dataplane: &mut Dataplane) -> Result<(), AgentError> {
        let changed = self.resolve_due().await;
        if changed.is_empty() {
            return Ok(());
        }
        self.compiled = compile_firewalls(&self.objects, &self.context, &self.names.addresses());
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
        changed
    }
}
