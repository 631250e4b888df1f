//! The firewalls' DNS names kept resolved: each refreshed when its answer's TTL runs out, a
//! few lookups at a time under one deadline, the maps changed in place where the set allows.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use dataplane_common::acl::AclDnsEvent;

use super::{
    super::{AclSyncStats, dns},
    FirewallAgent,
};
use crate::{error::AgentError, kernel::loader::Dataplane};

/// How long one DNS name's lookup may take.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// How long one refresh of the due names may take in all.
const REFRESH_BUDGET: Duration = Duration::from_secs(3);

/// Lookups in flight at once.
const LOOKUPS_AT_ONCE: usize = 16;

impl FirewallAgent {
    /// When a DNS name is next due for a refresh, or a learned address expires.
    pub(super) fn next_refresh(&self) -> Option<Instant> {
        let resolved = self.resolver.as_ref().and(self.names.next_refresh());
        [resolved, self.snooped.next_expiry()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Learns wildcard names' addresses from the DNS answers the kernel copied (those from
    /// a trusted DNS server only); switches in the sets that use new ones.
    pub(super) fn learn_dns_answers(
        &mut self,
        dataplane: &mut Dataplane,
    ) -> Result<(), AgentError> {
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

    /// Resolves the names that are due; where addresses changed, updates the firewalls that
    /// use them.
    pub(super) async fn refresh(&mut self, dataplane: &mut Dataplane) -> Result<(), AgentError> {
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
    pub(super) async fn resolve_due(&mut self) -> BTreeSet<String> {
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
