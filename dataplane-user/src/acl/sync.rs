//! The access-control maps brought to the wanted sets: a changed set written under new ids,
//! each pod switched to it in one write, the old set deleted.
//!
//! One piece (about 900 lines): the order of these writes is what keeps every packet seeing
//! an old set or a new one, never a mix, and it reads best in one file; the entries it writes
//! are made in `entries`, the state it follows in `state`.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    sync::Arc,
};

use aya::maps::{HashMap as BpfHashMap, MapData};
use dataplane_common::{
    acl::{
        ACL_ENDPOINT_EGRESS_PEERS, ACL_ENDPOINT_INGRESS_PEERS, ACL_ENDPOINT_SNOOP_DNS,
        ACL_ENTRY_PORTS, AclAddrKey, AclAddrValue, AclEndpoint, AclLogConfig, AclPortKey,
        AclVerdict, peer_key,
    },
    maps,
    overlay::Addr,
};
use ipnet::IpNet;

use super::{
    compile::CompiledSet,
    entries::{
        InstalledSet, Moves, SetKeys, addr_key, addr_value, in_force_beside, table_entries,
        table_follows, tables_alone_differ,
    },
    ports::{Decision, PortTable},
    state::{AclPod, AclState, AclSyncStats, DesiredFirewalls},
};
use crate::kernel::capacity::map_err;
use crate::{
    error::AgentError,
    kernel::loader::Dataplane,
    mapsync::{addr16, sync_hash, sync_hash_since},
};

/// Writes `entries` to `map` in batch calls, counting what went in (also when a full map
/// stopped the batch).
fn write_batch<K: aya::Pod, V: aya::Pod>(
    map: &aya::maps::Map,
    entries: &[(K, V)],
    stats: &mut AclSyncStats,
) -> Result<(), aya::maps::MapError> {
    match crate::kernel::batch::update(map, entries) {
        Ok(()) => {
            stats.written += entries.len();
            Ok(())
        }
        Err(stopped) => {
            stats.written += stopped.done;
            Err(stopped.source)
        }
    }
}

/// Deletes `keys` from `map` (of values `V`) in batch calls, counting what went.
fn delete_batch<K: aya::Pod, V: aya::Pod>(
    map: &aya::maps::Map,
    keys: &[K],
    stats: &mut AclSyncStats,
) -> Result<(), aya::maps::MapError> {
    let mut rest = keys;
    loop {
        match crate::kernel::batch::delete::<K, V>(map, rest) {
            Ok(()) => {
                stats.deleted += rest.len();
                return Ok(());
            }
            // The key after those deleted is gone already (a sync that stopped midway took
            // it out): the rest still go.
            Err(stopped) if is_missing(&stopped.source) => {
                stats.deleted += stopped.done;
                rest = rest.get(stopped.done + 1..).unwrap_or_default();
            }
            Err(stopped) => {
                stats.deleted += stopped.done;
                return Err(stopped.source);
            }
        }
    }
}

/// Removes `key` from `map`; `false` when it was not there. An entry to remove may be gone
/// already when a sync that stopped midway (a map full) had removed it but not yet written
/// down the set's new version: failing on it would fail every later sync the same way.
fn remove_present<K: aya::Pod, V: aya::Pod>(
    map: &mut BpfHashMap<&mut MapData, K, V>,
    key: &K,
) -> Result<bool, aya::maps::MapError> {
    match map.remove(key) {
        Ok(()) => Ok(true),
        Err(error) if is_missing(&error) => Ok(false),
        Err(error) => Err(error),
    }
}

/// Whether a map error says the key was not in the map.
fn is_missing(error: &aya::maps::MapError) -> bool {
    match error {
        aya::maps::MapError::KeyNotFound => true,
        aya::maps::MapError::SyscallError(syscall) => {
            syscall.io_error.raw_os_error() == Some(libc::ENOENT)
        }
        _ => false,
    }
}

impl Dataplane {
    /// Makes `ACL_NODE_ADDRS` hold exactly this node's own addresses (what the node sends from
    /// them reaches its pods whatever their policies).
    pub fn sync_node_addresses(&mut self, addresses: &[IpAddr]) -> Result<usize, AgentError> {
        let mut map: BpfHashMap<&mut MapData, Addr, u32> = self.typed_map(maps::ACL_NODE_ADDRS)?;
        let wanted: BTreeMap<Addr, u32> = addresses.iter().map(|a| (addr16(*a), 0)).collect();
        let synced = sync_hash(&mut map, &wanted).map_err(map_err(maps::ACL_NODE_ADDRS, "sync"))?;
        Ok(synced.written + synced.deleted)
    }

    /// Sets the audit records each CPU may send per second.
    pub fn set_audit_rate(&mut self, rate_per_second: u32) -> Result<(), AgentError> {
        let mut config: aya::maps::Array<&mut MapData, AclLogConfig> =
            self.typed_map(maps::ACL_LOG_CONFIG)?;
        config
            .set(
                0,
                AclLogConfig {
                    rate_per_second,
                    _pad: 0,
                },
                0,
            )
            .map_err(map_err(maps::ACL_LOG_CONFIG, "write"))
    }

    /// Takes over what a previous agent left pinned: every existing set and table id stays
    /// reserved, and each namespace keeps the set its pods point at until a sync replaces it
    /// (so a namespace whose object is now invalid keeps its last good rules).
    pub fn adopt_acl(&mut self, state: &mut AclState, pods: &[AclPod]) -> Result<(), AgentError> {
        // Which set each table belongs to (tables are never shared between sets).
        let mut table_owner: HashMap<u32, u32> = HashMap::new();
        let addrs: BpfHashMap<&mut MapData, AclAddrKey, AclAddrValue> =
            self.typed_map(maps::ACL_ADDRS)?;
        for (key, value) in addrs.iter().filter_map(Result::ok) {
            state.next_set = state.next_set.max(key.set);
            let installed = state
                .sets
                .entry(key.set)
                .or_insert_with(InstalledSet::adopted);
            installed.prefixes.push(key);
            if value.kind == ACL_ENTRY_PORTS {
                table_owner.insert(value.table, key.set);
            }
        }
        let ports: BpfHashMap<&mut MapData, AclPortKey, AclVerdict> =
            self.typed_map(maps::ACL_PORTS)?;
        for key in ports.keys().filter_map(Result::ok) {
            state.next_table = state.next_table.max(key.table);
            // A table no prefix points at (an agent stopped mid-sync) goes with set 0, which
            // nothing uses: the next sync deletes it.
            let owner = table_owner.get(&key.table).copied().unwrap_or(0);
            state
                .sets
                .entry(owner)
                .or_insert_with(InstalledSet::adopted)
                .ports
                .push(key);
        }
        let endpoints: BpfHashMap<&mut MapData, Addr, AclEndpoint> =
            self.typed_map(maps::ACL_ENDPOINTS)?;
        for pod in pods {
            for address in &pod.addresses {
                let Ok(endpoint) = endpoints.get(&addr16(*address), 0) else {
                    continue;
                };
                if endpoint.firewall == 0 {
                    continue;
                }
                state
                    .firewalls
                    .entry(pod.namespace.clone())
                    .or_insert(endpoint.firewall);
                if let Some(set) = state.sets.get_mut(&endpoint.firewall) {
                    set.lengths = endpoint.firewall_lengths;
                }
            }
        }
        Ok(())
    }

    /// Makes the access-control maps hold `desired` for `pods`. Order: new sets (port tables,
    /// then prefixes), then the pods' endpoint entries switch, then sets nobody uses are
    /// deleted. The sets in force are walked beside the wanted ones in name order, and only
    /// those that move are written down: rebuilding both maps of names (220 sets at 2,000
    /// policies) and sweeping every installed set was most of a sync that changed one set.
    pub fn sync_acl(
        &mut self,
        state: &mut AclState,
        desired: &DesiredFirewalls,
        pods: &[AclPod],
    ) -> Result<AclSyncStats, AgentError> {
        let mut stats = AclSyncStats::default();
        // Cleared until this sync ends well: orphans of a sync that stopped midway (sets it
        // installed that nothing points at) are found by the next one's full sweep.
        let full_sweep = !state.swept;
        state.swept = false;
        // The peers' addresses before the sets that name them, those gone after.
        let peer_moves = super::peers::moves(&state.peers, &desired.peers, &state.peers_left);
        self.write_peers(&peer_moves.write, &mut stats)?;
        let firewalls = self.install_firewall_sets(state, desired, &mut stats)?;
        let policies = self.install_policy_sets(state, desired, &mut stats)?;
        let mut displaced = firewalls.apply(&mut state.firewalls, &desired.rejected);
        displaced.extend(policies.apply(&mut state.policies, &BTreeSet::new()));
        stats.sets = state.firewalls.len() + state.policies.len();
        let lengths = |set: u32| state.sets.get(&set).map(|s| s.lengths).unwrap_or_default();
        let names_peers = |set: u32| {
            state
                .sets
                .get(&set)
                .and_then(|s| s.compiled.as_ref())
                .is_some_and(|c| c.names_peers())
        };
        let mut wanted_endpoints: BTreeMap<Addr, AclEndpoint> = BTreeMap::new();
        let mut pod_sets = BTreeMap::new();
        for pod in pods {
            let mut endpoint = AclEndpoint::default();
            if let Some(&set) = state.firewalls.get(&pod.namespace) {
                endpoint.firewall = set;
                endpoint.firewall_lengths = lengths(set);
            }
            let key = pod.key();
            let sets = desired.pod_policies.get(&key);
            let set_of = |name: Option<&String>| name.and_then(|n| state.policies.get(n)).copied();
            if let Some(set) = set_of(sets.and_then(|s| s.ingress.as_ref())) {
                endpoint.ingress = set;
                endpoint.ingress_lengths = lengths(set);
                if names_peers(set) {
                    endpoint.flags |= ACL_ENDPOINT_INGRESS_PEERS;
                }
            }
            if let Some(set) = set_of(sets.and_then(|s| s.egress.as_ref())) {
                endpoint.egress = set;
                endpoint.egress_lengths = lengths(set);
                if names_peers(set) {
                    endpoint.flags |= ACL_ENDPOINT_EGRESS_PEERS;
                }
            }
            if endpoint.policed() {
                pod_sets.insert(key, [endpoint.ingress, endpoint.egress]);
            }
            if endpoint.firewall == 0 && !endpoint.policed() {
                continue;
            }
            endpoint.log =
                desired.log.get(&pod.namespace).copied().unwrap_or(0) | sets.map_or(0, |s| s.log);
            if sets.is_some_and(|s| s.snoop_dns) {
                endpoint.flags |= ACL_ENDPOINT_SNOOP_DNS;
            }
            for address in &pod.addresses {
                wanted_endpoints.insert(addr16(*address), endpoint);
            }
        }
        let last = state.endpoints.take();
        self.sync_endpoints(&wanted_endpoints, last.as_ref(), &mut stats)?;
        state.endpoints = Some(wanted_endpoints);
        state.pod_sets = pod_sets;
        let stale = if full_sweep {
            state.unused_sets()
        } else {
            displaced.retain(|set| !state.uses(*set));
            displaced.sort_unstable();
            displaced.dedup();
            displaced
        };
        for set in stale {
            if state.policy_meta.remove(&set).is_some() {
                state.described_changes.insert(set);
                state.meta_version += 1;
            }
            if let Some(installed) = state.sets.remove(&set) {
                self.remove_set(&installed, &mut stats)?;
            }
        }
        self.remove_peers(&peer_moves.remove, &mut stats)?;
        state.peers.clone_from(&desired.peers);
        state.peers_left = Vec::new();
        state.swept = true;
        Ok(stats)
    }

    /// What `ACL_PEERS` holds (a previous agent's peers after a restart): address, identity.
    pub fn peers_held(&self) -> Result<Vec<(Addr, u32)>, AgentError> {
        let held: BpfHashMap<&MapData, Addr, u32> =
            BpfHashMap::try_from(self.map(maps::ACL_PEERS)?)
                .map_err(map_err(maps::ACL_PEERS, "open"))?;
        held.iter()
            .collect::<Result<_, _>>()
            .map_err(map_err(maps::ACL_PEERS, "read"))
    }

    /// Writes the addresses new to their peer identities (see [`super::peers::moves`]).
    fn write_peers(
        &mut self,
        entries: &[(Addr, u32)],
        stats: &mut AclSyncStats,
    ) -> Result<(), AgentError> {
        if entries.is_empty() {
            return Ok(());
        }
        write_batch(self.map(maps::ACL_PEERS)?, entries, stats)
            .map_err(map_err(maps::ACL_PEERS, "write peer address"))
    }

    /// Removes the addresses no peer identity named has any more (see [`super::peers::moves`]).
    fn remove_peers(&mut self, gone: &[Addr], stats: &mut AclSyncStats) -> Result<(), AgentError> {
        if gone.is_empty() {
            return Ok(());
        }
        delete_batch::<Addr, u32>(self.map(maps::ACL_PEERS)?, gone, stats)
            .map_err(map_err(maps::ACL_PEERS, "remove peer addresses"))
    }

    /// Installs each namespace's firewall set not in force as wanted.
    fn install_firewall_sets(
        &mut self,
        state: &mut AclState,
        desired: &DesiredFirewalls,
        stats: &mut AclSyncStats,
    ) -> Result<Moves, AgentError> {
        let (current, gone) = in_force_beside(&desired.sets, &state.firewalls);
        let mut moves = Moves {
            gone,
            ..Moves::default()
        };
        for ((namespace, compiled), current) in desired.sets.iter().zip(current) {
            if current.is_some_and(|set| state.holds(set, compiled)) {
                continue;
            }
            match self.install_set(state, compiled, stats) {
                Ok(set) => moves.moved.push((namespace.clone(), current, set)),
                // Refused alone (the maps full): the namespace keeps what is in force, and
                // the next sync tries again.
                Err(error) => stats.closed.push(format!(
                    "EgressFirewall {namespace}/default: its rules could not be written ({error}); its last good rules stay in force"
                )),
            }
        }
        Ok(moves)
    }

    /// Installs each policy set not in force as wanted, or changes in place one its pods
    /// leave ([`Morphs`]), and notes what each set is (audit records, `inspect`).
    fn install_policy_sets(
        &mut self,
        state: &mut AclState,
        desired: &DesiredFirewalls,
        stats: &mut AclSyncStats,
    ) -> Result<Moves, AgentError> {
        let (current, gone) = in_force_beside(&desired.policy_sets, &state.policies);
        let mut moves = Moves {
            gone,
            ..Moves::default()
        };
        let mut morphs = Morphs::default();
        for ((name, wanted), current) in desired.policy_sets.iter().zip(current) {
            let set = match current {
                Some(set) if state.holds(set, &wanted.compiled) => set,
                // A set not installed yet may take over one its pods leave.
                None => match morphs.take(state, desired, name, wanted.direction) {
                    Some(set) if self.morph_set(state, set, &wanted.compiled, stats)? => set,
                    _ => self.install_or_close(state, name, wanted, stats)?,
                },
                Some(_) => self.install_or_close(state, name, wanted, stats)?,
            };
            if Some(set) != current {
                moves.moved.push((name.clone(), current, set));
            }
            // Copied only when new: most sets are the last sync's (a clone each, every sync,
            // cost more than the change at 2,000 policies).
            if state.policy_meta.get(&set) != Some(wanted) {
                // A set changed in place for other peers is described as before.
                let described = state.policy_meta.get(&set).is_some_and(|before| {
                    (&before.namespace, before.direction, &before.refs)
                        == (&wanted.namespace, wanted.direction, &wanted.refs)
                });
                state.policy_meta.insert(set, wanted.clone());
                if !described {
                    state.meta_version += 1;
                    state.described_changes.insert(set);
                }
            }
        }
        Ok(moves)
    }

    /// Installs a policy set; one that cannot be written (the maps are full: other sets,
    /// perhaps another tenant's, took the room) is replaced by an empty set, which denies its
    /// pods everything in its direction: its namespace fails closed, alone, and the sync
    /// goes on for everyone else.
    fn install_or_close(
        &mut self,
        state: &mut AclState,
        name: &str,
        wanted: &super::pod_rules::PolicySet,
        stats: &mut AclSyncStats,
    ) -> Result<u32, AgentError> {
        let error = match self.install_set(state, &wanted.compiled, stats) {
            Ok(set) => return Ok(set),
            Err(error) => error,
        };
        let policies: BTreeSet<&str> = wanted.refs.iter().map(|r| r.policy.as_str()).collect();
        stats.closed.push(format!(
            "NetworkPolicy {}: the {:?} policy set {name} of its pods could not be written ({error}); they are denied everything in that direction until the maps have room (--max-acl-entries)",
            policies.into_iter().collect::<Vec<_>>().join(", "),
            wanted.direction,
        ));
        self.install_set(state, &Arc::new(CompiledSet::default()), stats)
    }

    /// Changes the installed set `set` in place into `compiled` (see [`Morphs`]); false,
    /// having written nothing, when it cannot be.
    fn morph_set(
        &mut self,
        state: &mut AclState,
        set: u32,
        compiled: &Arc<CompiledSet>,
        stats: &mut AclSyncStats,
    ) -> Result<bool, AgentError> {
        let Some(changed) = self.update_set_in_place(state, set, compiled)? else {
            return Ok(false);
        };
        stats.written += changed.written;
        stats.deleted += changed.deleted;
        Ok(true)
    }

    /// Writes a compiled set under fresh set and table ids; returns the set id.
    fn install_set(
        &mut self,
        state: &mut AclState,
        compiled: &Arc<CompiledSet>,
        stats: &mut AclSyncStats,
    ) -> Result<u32, AgentError> {
        state.next_set = state.next_set.wrapping_add(1).max(1);
        let set = state.next_set;
        let mut written = SetKeys::default();
        if let Err(error) = self.write_set(state, set, compiled, &mut written, stats) {
            // What was written of it goes again: no entry points at the set, and left in
            // the maps its entries would take room from every later sync (a set too large
            // for the map is tried again at each one).
            self.discard(&written.prefixes, &written.ports);
            return Err(error);
        }
        state.sets.insert(
            set,
            InstalledSet {
                compiled: Some(Arc::clone(compiled)),
                lengths: compiled.lengths(),
                table_ids: written.table_ids,
                prefixes: written.prefixes,
                ports: written.ports,
            },
        );
        Ok(set)
    }

    /// Writes `compiled`'s port tables and prefixes under set id `set`, noting in `keys` each
    /// table's id and every key it tries to write (written or not, should a write fail).
    fn write_set(
        &mut self,
        state: &mut AclState,
        set: u32,
        compiled: &CompiledSet,
        keys: &mut SetKeys,
        stats: &mut AclSyncStats,
    ) -> Result<(), AgentError> {
        for table in &compiled.tables {
            let id = self.write_table(state, table, &mut keys.ports, stats)?;
            keys.table_ids.push(id);
        }
        // One batch call for the set's prefixes: a set of 300 peers written one call each
        // was a third of a label change's map work.
        let value = |decision: &Decision| addr_value(compiled, &keys.table_ids, *decision);
        let entries: Vec<(AclAddrKey, AclAddrValue)> = compiled
            .prefixes
            .iter()
            .map(|(&prefix, decision)| (addr_key(set, prefix), value(decision)))
            .chain(
                compiled
                    .peers
                    .iter()
                    .map(|(&identity, decision)| (peer_key(set, identity), value(decision))),
            )
            .collect();
        keys.prefixes.extend(entries.iter().map(|(key, _)| *key));
        write_batch(self.map(maps::ACL_ADDRS)?, &entries, stats)
            .map_err(map_err(maps::ACL_ADDRS, "write prefix"))
    }

    /// Removes these entries where they are (a set that could not be written whole).
    fn discard(&mut self, prefixes: &[AclAddrKey], ports: &[AclPortKey]) {
        if let Ok(mut addrs) =
            self.typed_map::<BpfHashMap<&mut MapData, AclAddrKey, AclAddrValue>>(maps::ACL_ADDRS)
        {
            for key in prefixes {
                let _ = addrs.remove(key);
            }
        }
        if let Ok(mut table) =
            self.typed_map::<BpfHashMap<&mut MapData, AclPortKey, AclVerdict>>(maps::ACL_PORTS)
        {
            for key in ports {
                let _ = table.remove(key);
            }
        }
    }

    /// Writes a port table under a fresh id; returns the id. Its keys are added to `keys`
    /// (before the write: all of them, should it stop midway).
    fn write_table(
        &mut self,
        state: &mut AclState,
        table: &PortTable,
        keys: &mut Vec<AclPortKey>,
        stats: &mut AclSyncStats,
    ) -> Result<u32, AgentError> {
        state.next_table = state.next_table.wrapping_add(1).max(1);
        let id = state.next_table;
        let entries: Vec<(AclPortKey, AclVerdict)> = table_entries(id, table).collect();
        // Noted before the write, which may stop midway: the caller knows what to take out.
        keys.extend(entries.iter().map(|(key, _)| *key));
        write_batch(self.map(maps::ACL_PORTS)?, &entries, stats)
            .map_err(map_err(maps::ACL_PORTS, "write port table"))?;
        Ok(id)
    }

    /// Rewrites the port table `id`, which holds `old`, into `new`: writes the entries that
    /// differ, then removes those `new` lacks. The table's keys are added to `keys`.
    fn rewrite_table(
        &mut self,
        id: u32,
        old: &PortTable,
        new: &PortTable,
        keys: &mut Vec<AclPortKey>,
        stats: &mut AclSyncStats,
    ) -> Result<(), AgentError> {
        let before: BTreeMap<AclPortKey, AclVerdict> = table_entries(id, old).collect();
        let mut ports: BpfHashMap<&mut MapData, AclPortKey, AclVerdict> =
            self.typed_map(maps::ACL_PORTS)?;
        let mut after = BTreeSet::new();
        for (key, verdict) in table_entries(id, new) {
            if before.get(&key) != Some(&verdict) {
                ports
                    .insert(key, verdict, 0)
                    .map_err(map_err(maps::ACL_PORTS, "write port table"))?;
                stats.written += 1;
            }
            after.insert(key);
            keys.push(key);
        }
        for key in before.keys().filter(|key| !after.contains(*key)) {
            if remove_present(&mut ports, key)
                .map_err(map_err(maps::ACL_PORTS, "remove port entry"))?
            {
                stats.deleted += 1;
            }
        }
        Ok(())
    }

    /// Updates a namespace's firewall set in place to `compiled`, writing only the entries
    /// that differ: what a DNS name's new addresses change. Tables are matched by content, so
    /// unchanged ones keep their ids. Each entry changes in one write; while the update runs a
    /// packet may see some of the name's new addresses and some of its old ones, never a
    /// half-written entry. Returns `None`, having written nothing, when the set cannot be
    /// updated in place (no set yet, adopted without its rules, or other prefix lengths): the
    /// caller then syncs a new set with [`Dataplane::sync_acl`].
    pub fn update_acl_in_place(
        &mut self,
        state: &mut AclState,
        namespace: &str,
        compiled: &Arc<CompiledSet>,
    ) -> Result<Option<AclSyncStats>, AgentError> {
        let Some(set) = state.firewalls.get(namespace).copied() else {
            return Ok(None);
        };
        self.update_set_in_place(state, set, compiled)
    }

    /// Updates the installed set `set` in place to `compiled` (see
    /// [`Self::update_acl_in_place`]); `None`, having written nothing, when it cannot be.
    fn update_set_in_place(
        &mut self,
        state: &mut AclState,
        set: u32,
        compiled: &Arc<CompiledSet>,
    ) -> Result<Option<AclSyncStats>, AgentError> {
        let Some(installed) = state.sets.get(&set) else {
            return Ok(None);
        };
        let Some(old) = installed.compiled.clone() else {
            return Ok(None);
        };
        if installed.lengths != compiled.lengths() {
            return Ok(None);
        }
        let mut tried = SetKeys::default();
        let updated = if tables_alone_differ(&old, compiled) {
            self.rewrite_tables(state, set, &old, compiled, &mut tried.ports)
        } else {
            self.rewrite_entries(state, set, &old, compiled, &mut tried)
        };
        if updated.is_err() {
            state.forget_rules(set, tried);
        }
        updated.map(Some)
    }

    /// [`Self::update_set_in_place`] where prefixes change: writes the entries that differ
    /// and removes those gone, noting in `tried` every key it may have written.
    fn rewrite_entries(
        &mut self,
        state: &mut AclState,
        set: u32,
        old: &CompiledSet,
        compiled: &Arc<CompiledSet>,
        tried: &mut SetKeys,
    ) -> Result<AclSyncStats, AgentError> {
        let installed_table_ids = state.sets[&set].table_ids.clone();
        let mut stats = AclSyncStats {
            sets: 1,
            ..AclSyncStats::default()
        };
        let port_keys = &mut tried.ports;
        // Tables equal to an old one keep its id; the others take the id of an old table no
        // new one equals, rewritten entry by entry (a port changed: two entries, and no
        // prefix has to point elsewhere), when every prefix that took the old table takes the
        // new one (so no prefix sees rules that are neither its old nor its new ones);
        // otherwise a fresh id.
        let same: Vec<Option<usize>> = compiled
            .tables
            .iter()
            .map(|table| old.tables.iter().position(|t| t == table))
            .collect();
        let mut spare: Vec<usize> = (0..old.tables.len())
            .filter(|index| !same.contains(&Some(*index)))
            .collect();
        let mut rewritten: BTreeSet<u32> = BTreeSet::new();
        let mut table_ids = Vec::with_capacity(compiled.tables.len());
        for (new_index, (table, same)) in compiled.tables.iter().zip(same).enumerate() {
            let follows = spare
                .iter()
                .position(|old_index| table_follows(old, *old_index, compiled, new_index));
            let id = if let Some(index) = same {
                installed_table_ids[index]
            } else if let Some(index) = follows.map(|at| spare.remove(at)) {
                let id = installed_table_ids[index];
                self.rewrite_table(id, &old.tables[index], table, port_keys, &mut stats)?;
                rewritten.insert(id);
                id
            } else {
                self.write_table(state, table, port_keys, &mut stats)?
            };
            table_ids.push(id);
        }
        let prefixes: Vec<AclAddrKey> = compiled
            .prefixes
            .keys()
            .map(|p| addr_key(set, *p))
            .chain(compiled.peers.keys().map(|id| peer_key(set, *id)))
            .collect();
        tried.prefixes.clone_from(&prefixes);
        {
            let mut addrs: BpfHashMap<&mut MapData, AclAddrKey, AclAddrValue> =
                self.typed_map(maps::ACL_ADDRS)?;
            let values = EntryValues {
                new: compiled,
                new_tables: &table_ids,
                old,
                old_tables: &installed_table_ids,
            };
            let prefix_key = |prefix: &IpNet| addr_key(set, *prefix);
            let peer_key = |identity: &u32| peer_key(set, *identity);
            values.rewrite(
                &mut addrs,
                &compiled.prefixes,
                &old.prefixes,
                prefix_key,
                &mut stats,
            )?;
            values.rewrite(
                &mut addrs,
                &compiled.peers,
                &old.peers,
                peer_key,
                &mut stats,
            )?;
        }
        let kept: BTreeSet<u32> = table_ids.iter().copied().collect();
        let mut ports: BpfHashMap<&mut MapData, AclPortKey, AclVerdict> =
            self.typed_map(maps::ACL_PORTS)?;
        let installed = state.sets.get(&set).expect("looked up above");
        let mut kept_ports = Vec::new();
        for key in &installed.ports {
            if rewritten.contains(&key.table) {
                // Its entries are in `port_keys` already, the stale ones removed.
            } else if kept.contains(&key.table) {
                kept_ports.push(*key);
            } else if remove_present(&mut ports, key)
                .map_err(map_err(maps::ACL_PORTS, "remove port entry"))?
            {
                stats.deleted += 1;
            }
        }
        port_keys.append(&mut kept_ports);
        state.sets.insert(
            set,
            InstalledSet {
                compiled: Some(Arc::clone(compiled)),
                lengths: compiled.lengths(),
                table_ids,
                prefixes,
                ports: std::mem::take(port_keys),
            },
        );
        Ok(stats)
    }

    /// Writes over, in place under their ids, the tables of the installed set `set` that
    /// changed from `old` to `compiled`, which shares `old`'s prefixes ([`tables_alone_differ`]):
    /// no prefix entry changes (a NetworkPolicy's port changed: two port entries).
    fn rewrite_tables(
        &mut self,
        state: &mut AclState,
        set: u32,
        old: &CompiledSet,
        compiled: &Arc<CompiledSet>,
        port_keys: &mut Vec<AclPortKey>,
    ) -> Result<AclSyncStats, AgentError> {
        let mut stats = AclSyncStats {
            sets: 1,
            ..AclSyncStats::default()
        };
        let table_ids = state.sets[&set].table_ids.clone();
        let mut rewritten: BTreeSet<u32> = BTreeSet::new();
        for ((was, table), &id) in old.tables.iter().zip(&compiled.tables).zip(&table_ids) {
            if was != table {
                self.rewrite_table(id, was, table, port_keys, &mut stats)?;
                rewritten.insert(id);
            }
        }
        let installed = state.sets.get_mut(&set).expect("an installed set");
        installed
            .ports
            .retain(|key| !rewritten.contains(&key.table));
        installed.ports.append(port_keys);
        installed.compiled = Some(Arc::clone(compiled));
        Ok(stats)
    }

    /// Points every local pod at its sets (one write per address); removes entries of pods
    /// gone or no longer under any set.
    fn sync_endpoints(
        &mut self,
        wanted: &BTreeMap<Addr, AclEndpoint>,
        last: Option<&BTreeMap<Addr, AclEndpoint>>,
        stats: &mut AclSyncStats,
    ) -> Result<(), AgentError> {
        let mut endpoints: BpfHashMap<&mut MapData, Addr, AclEndpoint> =
            self.typed_map(maps::ACL_ENDPOINTS)?;
        let synced = sync_hash_since(&mut endpoints, wanted, last)
            .map_err(map_err(maps::ACL_ENDPOINTS, "sync"))?;
        stats.written += synced.written;
        stats.deleted += synced.deleted;
        // Last: the kernel looks endpoints up only while this says there are some.
        let mut active: aya::maps::Array<&mut MapData, u32> = self.typed_map(maps::ACL_ACTIVE)?;
        active
            .set(0, wanted.len() as u32, 0)
            .map_err(map_err(maps::ACL_ACTIVE, "write"))
    }

    /// Deletes a set's prefixes, then its port tables (no prefix points at them any more).
    fn remove_set(
        &mut self,
        installed: &InstalledSet,
        stats: &mut AclSyncStats,
    ) -> Result<(), AgentError> {
        // In batches: a set of 300 peers was 300 calls (a fifth of a local pod's label
        // changed at 5,000 nodes).
        delete_batch::<_, AclAddrValue>(self.map(maps::ACL_ADDRS)?, &installed.prefixes, stats)
            .map_err(map_err(maps::ACL_ADDRS, "remove prefixes"))?;
        delete_batch::<_, AclVerdict>(self.map(maps::ACL_PORTS)?, &installed.ports, stats)
            .map_err(map_err(maps::ACL_PORTS, "remove port entries"))
    }
}

/// The two versions of a set changed in place, with their tables' ids.
struct EntryValues<'a> {
    new: &'a CompiledSet,
    new_tables: &'a [u32],
    old: &'a CompiledSet,
    old_tables: &'a [u32],
}

impl EntryValues<'_> {
    /// Writes the entries of `new` (prefixes or peers) whose value differs from `old`'s and
    /// removes those `new` lacks. Both versions are walked side by side in key order:
    /// looking each key up in the other version (1,200 peers each way) was most of a peer
    /// added. A decision is the same where it gives the kernel the same value (table ids
    /// differ).
    fn rewrite<K: Ord>(
        &self,
        addrs: &mut BpfHashMap<&mut MapData, AclAddrKey, AclAddrValue>,
        new: &BTreeMap<K, Decision>,
        old: &BTreeMap<K, Decision>,
        key: impl Fn(&K) -> AclAddrKey,
        stats: &mut AclSyncStats,
    ) -> Result<(), AgentError> {
        let value = |set: &CompiledSet, tables: &[u32], decision: Decision| {
            addr_value(set, tables, decision)
        };
        let (changed, gone) = crate::mapsync::sorted_difference_by(new, old, |n, o| {
            value(self.new, self.new_tables, *n) == value(self.old, self.old_tables, *o)
        });
        for (k, decision) in changed {
            addrs
                .insert(key(k), value(self.new, self.new_tables, *decision), 0)
                .map_err(map_err(maps::ACL_ADDRS, "write entry"))?;
            stats.written += 1;
        }
        for k in gone {
            if remove_present(addrs, &key(k)).map_err(map_err(maps::ACL_ADDRS, "remove entry"))? {
                stats.deleted += 1;
            }
        }
        Ok(())
    }
}

/// The installed policy sets a sync may change in place into a new set rather than write the
/// new one whole: a set whose content changed (a peer pod came, went or was relabelled, a
/// port changed) gets a new name, and writing it whole under a new id costs a write per
/// prefix twice over (300 peers: 600 writes) where the change is one prefix. An installed
/// set `S` may become the new set `N` only when every local pod whose endpoint points at `S`
/// wants `N` in that direction (a pod staying with other rules must never see `N`'s), no
/// pod wants `S`'s own name any more, and no other new set took `S` already. While the
/// entries change, `S`'s pods may see some of the old entries and some of the new ones (each
/// entry changes in one write), as during any policy update.
///
/// Looked up for each new set from what the maps hold and the sync wants, without building
/// an index of every pod and set first: a sync has a new set or two, and indexing 110 pods'
/// sets at each one cost a change reaching one pod more than the change.
#[derive(Default)]
struct Morphs {
    /// The installed sets a new set took already.
    taken: BTreeSet<u32>,
}

impl Morphs {
    /// An installed set that may become the new set `name` in place (see [`Morphs`]); taken,
    /// so that no other new set gets it too. The candidates are the sets the pods wanting
    /// `name` point at now, in the pods' order.
    fn take(
        &mut self,
        state: &AclState,
        desired: &DesiredFirewalls,
        name: &str,
        direction: super::pods::Direction,
    ) -> Option<u32> {
        let wants = |sets: &super::policy::PodSets| {
            [&sets.ingress, &sets.egress]
                .into_iter()
                .any(|n| n.as_deref() == Some(name))
        };
        let slot = match direction {
            super::pods::Direction::Ingress => 0,
            super::pods::Direction::Egress => 1,
        };
        let wanting = desired.pod_policies.iter().filter(|(_, sets)| wants(sets));
        let candidate = wanting
            .filter_map(|(pod, _)| state.pod_sets.get(pod).map(|ids| ids[slot]))
            .find(|id| {
                *id != 0
                    && !self.taken.contains(id)
                    && state
                        .policies
                        .iter()
                        .any(|(n, set)| set == id && !desired.policy_sets.contains_key(n))
                    && state
                        .pod_sets
                        .iter()
                        .filter(|(_, ids)| ids.contains(id))
                        .all(|(pod, _)| desired.pod_policies.get(pod).is_some_and(wants))
            })?;
        self.taken.insert(candidate);
        Some(candidate)
    }
}
