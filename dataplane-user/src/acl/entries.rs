//! A compiled set as map entries (address keys and values, port tables), and how an installed
//! set is changed in place into its next version.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use dataplane_common::acl::{
    ACL_ENTRY_FINAL, ACL_ENTRY_PORTS, ACL_FAMILY_V4, ACL_FAMILY_V6, ACL_PORT_BUCKET,
    ACL_PORT_EXACT, ACL_PORT_PROTOCOL, ACL_RULE_DEFAULT, ACL_VERDICT_NONE, AclAddrKey,
    AclAddrValue, AclLengths, AclPortKey, AclVerdict,
};
use ipnet::IpNet;

use super::{
    compile::CompiledSet,
    ports::{Decision, PortTable},
    rule::Outcome,
};
use crate::mapsync::addr16;

/// The address key of `prefix` in set `set`.
pub fn addr_key(set: u32, prefix: IpNet) -> AclAddrKey {
    AclAddrKey {
        set,
        family: match prefix {
            IpNet::V4(_) => ACL_FAMILY_V4,
            IpNet::V6(_) => ACL_FAMILY_V6,
        },
        len: prefix.prefix_len(),
        _pad: [0; 2],
        addr: addr16(prefix.trunc().addr()),
    }
}

/// The address entry of a decision, with the map ids of the set's tables.
pub(super) fn addr_value(
    compiled: &CompiledSet,
    table_ids: &[u32],
    decision: Decision,
) -> AclAddrValue {
    match decision {
        Decision::Final(outcome) => AclAddrValue {
            table: 0,
            rule: outcome.rule,
            verdict: outcome.verdict.code(),
            kind: ACL_ENTRY_FINAL,
            port_kinds: 0,
            _pad: 0,
        },
        Decision::Unmatched => AclAddrValue {
            table: 0,
            rule: ACL_RULE_DEFAULT,
            verdict: ACL_VERDICT_NONE,
            kind: ACL_ENTRY_FINAL,
            port_kinds: 0,
            _pad: 0,
        },
        Decision::Table(index) => {
            let table = &compiled.tables[index];
            let default = verdict_value(table.default);
            AclAddrValue {
                table: table_ids[index],
                rule: default.rule,
                verdict: default.verdict,
                kind: ACL_ENTRY_PORTS,
                port_kinds: table.kinds(),
                _pad: 0,
            }
        }
    }
}

/// Whether every prefix of `old` that takes its table `old_index` takes table `new_index` of
/// `new`, or is gone from it: only then may that new table be written over the old one.
pub(super) fn table_follows(
    old: &CompiledSet,
    old_index: usize,
    new: &CompiledSet,
    new_index: usize,
) -> bool {
    old.prefixes
        .iter()
        .filter(|(_, decision)| **decision == Decision::Table(old_index))
        .all(|(prefix, _)| {
            new.prefixes
                .get(prefix)
                .is_none_or(|decision| *decision == Decision::Table(new_index))
        })
}

/// Whether `new` is `old` with only the contents of some port tables changed: the same
/// prefixes (shared, see [`CompiledSet::prefixes`]) and tables, each table with the default
/// and kinds of entry its prefixes' entries carry, so that only port entries change.
pub(super) fn tables_alone_differ(old: &CompiledSet, new: &CompiledSet) -> bool {
    Arc::ptr_eq(&old.prefixes, &new.prefixes)
        && old.peers == new.peers
        && old.tables.len() == new.tables.len()
        && old
            .tables
            .iter()
            .zip(&new.tables)
            .all(|(a, b)| a.default == b.default && a.kinds() == b.kinds())
}

/// The `ACL_PORTS` entries of `table` written under the id `id`.
pub(super) fn table_entries(
    id: u32,
    table: &PortTable,
) -> impl Iterator<Item = (AclPortKey, AclVerdict)> + '_ {
    let exact = table
        .exact
        .iter()
        .map(|(&(protocol, port), o)| (protocol, ACL_PORT_EXACT, port, *o));
    let buckets = table
        .buckets
        .iter()
        .map(|(&(protocol, port), o)| (protocol, ACL_PORT_BUCKET, port, *o));
    let protocols = table
        .protocols
        .iter()
        .map(|(&protocol, o)| (protocol, ACL_PORT_PROTOCOL, 0, *o));
    exact
        .chain(buckets)
        .chain(protocols)
        .map(move |(protocol, kind, port, outcome)| {
            let key = AclPortKey {
                table: id,
                protocol,
                kind,
                port,
            };
            (key, verdict_value(outcome))
        })
}

fn verdict_value(outcome: Option<Outcome>) -> AclVerdict {
    AclVerdict {
        rule: outcome.map_or(ACL_RULE_DEFAULT, |o| o.rule),
        verdict: outcome.map_or(ACL_VERDICT_NONE, |o| o.verdict.code()),
        _pad: [0; 3],
    }
}

/// A rule set written to the maps.
#[derive(Clone, Debug)]
pub(super) struct InstalledSet {
    /// What was compiled into it; `None` for a set adopted from a previous agent.
    pub(super) compiled: Option<Arc<CompiledSet>>,
    pub(super) lengths: AclLengths,
    /// Map id of each of `compiled`'s tables.
    pub(super) table_ids: Vec<u32>,
    pub(super) prefixes: Vec<AclAddrKey>,
    pub(super) ports: Vec<AclPortKey>,
}

impl InstalledSet {
    pub(super) fn adopted() -> Self {
        Self {
            compiled: None,
            lengths: AclLengths::default(),
            table_ids: Vec::new(),
            prefixes: Vec::new(),
            ports: Vec::new(),
        }
    }
}

/// A set's table ids and the keys of its entries, as written (or tried).
#[derive(Default)]
pub(super) struct SetKeys {
    pub(super) table_ids: Vec<u32>,
    pub(super) ports: Vec<AclPortKey>,
    pub(super) prefixes: Vec<AclAddrKey>,
}

/// How a sync changes a map of the sets in force by name: the names whose set moves (with
/// the set before, if any, and after), and the names no longer wanted.
#[derive(Default)]
pub(super) struct Moves {
    pub(super) moved: Vec<(String, Option<u32>, u32)>,
    pub(super) gone: Vec<String>,
}

impl Moves {
    /// Changes `in_force` as these moves say; a name no longer wanted keeps its set while
    /// `keep` names it (a namespace whose firewall is now invalid keeps its last good
    /// rules). Returns the sets that names left (which may be unused now).
    pub(super) fn apply(
        self,
        in_force: &mut BTreeMap<String, u32>,
        keep: &BTreeSet<String>,
    ) -> Vec<u32> {
        let mut displaced = Vec::new();
        for name in self.gone.into_iter().filter(|n| !keep.contains(n)) {
            displaced.extend(in_force.remove(&name));
        }
        for (name, before, after) in self.moved {
            displaced.extend(before);
            in_force.insert(name, after);
        }
        displaced
    }
}

/// The set in force for each of `wanted`'s names, in `wanted`'s order, and the names in
/// force that `wanted` lacks: one walk down both maps, both in name order.
pub(super) fn in_force_beside<V>(
    wanted: &BTreeMap<String, V>,
    in_force: &BTreeMap<String, u32>,
) -> (Vec<Option<u32>>, Vec<String>) {
    let mut current = Vec::with_capacity(wanted.len());
    let mut gone = Vec::new();
    let mut held = in_force.iter().peekable();
    for name in wanted.keys() {
        while let Some((other, _)) = held.next_if(|(other, _)| *other < name) {
            gone.push(other.clone());
        }
        current.push(
            held.next_if(|(other, _)| *other == name)
                .map(|(_, set)| *set),
        );
    }
    gone.extend(held.map(|(name, _)| name.clone()));
    (current, gone)
}
