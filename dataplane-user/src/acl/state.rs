//! What the access-control maps hold, as this agent knows it, and what it wants them to hold.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

use dataplane_common::{acl::AclEndpoint, overlay::Addr};

use super::{
    compile::CompiledSet,
    entries::{InstalledSet, SetKeys},
};
use crate::model::OverlayView;

/// What the access-control maps hold, as this agent knows it.
#[derive(Debug, Default)]
pub struct AclState {
    pub(super) next_set: u32,
    pub(super) next_table: u32,
    pub(super) sets: BTreeMap<u32, InstalledSet>,
    /// The firewall set in force for each namespace (its last good rules).
    pub(super) firewalls: BTreeMap<String, u32>,
    /// The NetworkPolicy sets in force by name.
    pub(super) policies: BTreeMap<String, u32>,
    /// What each policy set is (for audit records).
    pub(super) policy_meta: BTreeMap<u32, super::pod_rules::PolicySet>,
    /// Counts the changes to `policy_meta`: what is described for `inspect` is written again
    /// only when it moved.
    pub(super) meta_version: u64,
    /// The sets whose description moved since [`AclState::take_described_changes`] was last
    /// called (new, changed or gone): only those are described again.
    pub(super) described_changes: BTreeSet<u32>,
    /// The (ingress, egress) policy set ids each local pod's endpoint was last written with,
    /// by `<namespace>/<name>` (0: none): who sees a set changed in place.
    pub(super) pod_sets: BTreeMap<String, [u32; 2]>,
    /// The endpoints as the last sync wrote them (`None`: not known, compare with the
    /// kernel's), so that a sync reads none back (110 system calls).
    pub(super) endpoints: Option<BTreeMap<Addr, AclEndpoint>>,
    /// The last sync ended with every installed set in use (false after an adoption or a
    /// sync that stopped midway: the next one looks at every set).
    pub(super) swept: bool,
    /// The addresses written to `ACL_PEERS` for each peer identity.
    pub(super) peers: BTreeMap<u32, Arc<[Addr]>>,
    /// Addresses a previous agent left in `ACL_PEERS`, which the next sync removes where no
    /// identity it names has them.
    pub(super) peers_left: Vec<Addr>,
}

impl AclState {
    /// Whether the installed set `set` holds `compiled` (the same compile, shared).
    pub(super) fn holds(&self, set: u32, compiled: &Arc<CompiledSet>) -> bool {
        self.sets
            .get(&set)
            .is_some_and(|s| s.compiled.as_ref() == Some(compiled))
    }

    /// What an in-place update of `set` that stopped midway (a write failed) leaves: some
    /// entries old, some new, the record still the old version. Were the record kept, a later
    /// sync wanting the old rules again would find them in force and leave the new entries
    /// written so far (an address let through that no rule allows any more). The set's rules
    /// are unknown from now on: nothing holds it and nothing updates it in place, so the next
    /// sync replaces it whole, and its removal takes every key either version may have
    /// written (`tried`).
    pub(super) fn forget_rules(&mut self, set: u32, tried: SetKeys) {
        let Some(installed) = self.sets.get_mut(&set) else {
            return;
        };
        installed.compiled = None;
        installed.prefixes.extend(tried.prefixes);
        installed.prefixes.sort_unstable();
        installed.prefixes.dedup();
        installed.ports.extend(tried.ports);
        installed.ports.sort_unstable();
        installed.ports.dedup();
    }

    /// Notes what a previous agent left in `ACL_PEERS` (see [`Dataplane::peers_held`]).
    pub fn note_peers_left(&mut self, held: &[(Addr, u32)]) {
        self.peers_left = held.iter().map(|(addr, _)| *addr).collect();
    }

    /// Whether a namespace's firewall or a policy set in force is `set`.
    pub(super) fn uses(&self, set: u32) -> bool {
        self.firewalls
            .values()
            .chain(self.policies.values())
            .any(|s| *s == set)
    }

    /// The installed sets nothing is in force with.
    pub(super) fn unused_sets(&self) -> Vec<u32> {
        let used: BTreeSet<u32> = self
            .firewalls
            .values()
            .chain(self.policies.values())
            .copied()
            .collect();
        let mut unused: Vec<u32> = self
            .sets
            .keys()
            .copied()
            .filter(|s| !used.contains(s))
            .collect();
        // Described sets are installed ones, but a description never outlives its set.
        unused.extend(
            self.policy_meta
                .keys()
                .filter(|s| !used.contains(s) && !self.sets.contains_key(s)),
        );
        unused
    }

    /// The set in force for a namespace's firewall.
    pub fn firewall_set(&self, namespace: &str) -> Option<u32> {
        self.firewalls.get(namespace).copied()
    }

    /// The policy set with this id.
    pub fn policy_set(&self, set: u32) -> Option<&super::pod_rules::PolicySet> {
        self.policy_meta.get(&set)
    }

    /// Changes as the policy sets' descriptions do (see [`super::explain::set_rules`]).
    pub fn meta_version(&self) -> u64 {
        self.meta_version
    }

    /// The sets whose description moved since the last call (see
    /// [`super::explain::set_rules_since`]).
    pub fn take_described_changes(&mut self) -> BTreeSet<u32> {
        std::mem::take(&mut self.described_changes)
    }

    /// The namespace whose firewall a set is.
    pub fn namespace_of(&self, set: u32) -> Option<&str> {
        self.firewalls
            .iter()
            .find(|(_, s)| **s == set)
            .map(|(namespace, _)| namespace.as_str())
    }
}

/// The firewalls to install: compiled sets by namespace, and the namespaces whose object was
/// rejected (their last good set stays).
#[derive(Clone, Debug, Default)]
pub struct DesiredFirewalls {
    pub sets: BTreeMap<String, Arc<CompiledSet>>,
    pub rejected: BTreeSet<String>,
    /// `ACL_LOG_*` flags of the namespaces that audit their verdicts.
    pub log: BTreeMap<String, u8>,
    /// NetworkPolicy sets by name (see [`super::policy::policy_sets`]), shared by the local pods with
    /// the same rules.
    pub policy_sets: BTreeMap<String, super::pod_rules::PolicySet>,
    /// The policy sets of each isolated local pod, by `<namespace>/<name>`.
    pub pod_policies: BTreeMap<String, super::policy::PodSets>,
    /// The addresses of the pods of each peer identity the policy sets name (sorted).
    pub peers: BTreeMap<u32, Arc<[Addr]>>,
}

/// A local pod as access control sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AclPod {
    pub namespace: String,
    pub name: String,
    pub addresses: Vec<IpAddr>,
}

impl AclPod {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// The local pods of this node's view, by namespace.
pub fn pods_of(view: &OverlayView) -> Vec<AclPod> {
    view.local_pods
        .iter()
        .map(|pod| {
            let (namespace, name) = pod.name.split_once('/').unwrap_or(("default", &pod.name));
            AclPod {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                addresses: pod.addresses.clone(),
            }
        })
        .collect()
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AclSyncStats {
    pub sets: usize,
    pub written: usize,
    pub deleted: usize,
    /// Policy sets that could not be written (the maps full), each named: their pods are
    /// denied everything in that direction instead, and the next sync tries again.
    pub closed: Vec<String>,
}
