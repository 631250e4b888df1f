//! An ordered rule list compiled into the kernel's constant-time lookups: every destination
//! prefix with the rules covering it, at most `ACL_MAX_LENGTHS` prefix lengths per family;
//! admin tiers around NetworkPolicy; a set made again from its last version when only peer
//! hosts or ports moved.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    sync::Arc,
};

use dataplane_common::acl::{ACL_MAX_LENGTHS, AclLengths};
use ipnet::IpNet;

use super::{
    ports::{
        Decision, Painted, PortTable, covering_rules, decision_of, first_match, named_lengths,
        port_table,
    },
    rule::{Outcome, Rule},
};

/// A compiled rule set, with set-local table indexes.
#[derive(Clone, Debug, Default)]
pub struct CompiledSet {
    /// Prefix lengths in use per family, longest first (at most `ACL_MAX_LENGTHS` each).
    pub v4_lengths: Vec<u8>,
    pub v6_lengths: Vec<u8>,
    /// Every prefix has one of its family's lengths. Shared between versions of a set whose
    /// prefixes all keep their decisions (a port changed), so that the sync sees it at once.
    pub prefixes: Arc<BTreeMap<IpNet, Decision>>,
    /// The decision for the pods of each peer identity the rules name, where no prefix
    /// decides (a policy set's rules only allow).
    pub peers: Arc<BTreeMap<u32, Decision>>,
    pub tables: Vec<PortTable>,
    /// The prefixes by the rules that cover them, when they are the prefixes the rules name
    /// (`None` where a family had more lengths than the kernel looks up and some were
    /// expanded): a change of rules' ports paints each group once ([`repaint_ports`]).
    pub covers: Option<Vec<Cover>>,
}

/// Two sets are equal when they give the kernel the same entries: their covers are what
/// the compile learnt on the way, listed in the order it met them.
impl PartialEq for CompiledSet {
    fn eq(&self, other: &Self) -> bool {
        (
            &self.v4_lengths,
            &self.v6_lengths,
            &self.prefixes,
            &self.peers,
            &self.tables,
        ) == (
            &other.v4_lengths,
            &other.v6_lengths,
            &other.prefixes,
            &other.peers,
            &other.tables,
        )
    }
}

impl Eq for CompiledSet {}

/// Prefixes that the same rules cover (and whose holes leave them in), so that they have the
/// same decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cover {
    /// Positions in the rule list, ascending.
    pub rules: Vec<usize>,
    /// In address order.
    pub prefixes: Vec<IpNet>,
    pub decision: Decision,
}

impl CompiledSet {
    /// The entries the set takes in the maps (prefixes, peer identities, port table
    /// entries): what the agent's budget for policy sets counts.
    pub fn entries(&self) -> usize {
        let table_entries = |t: &PortTable| 1 + t.protocols.len() + t.buckets.len() + t.exact.len();
        self.prefixes.len()
            + self.peers.len()
            + self.tables.iter().map(table_entries).sum::<usize>()
    }

    /// What the kernel decides for a packet to `dst` (protocol, destination port): the
    /// longest of the lengths in use with an entry, then its table. `None`: no rule matches.
    pub fn lookup(&self, dst: IpAddr, protocol: u8, port: u16) -> Option<Outcome> {
        let lengths = match dst {
            IpAddr::V4(_) => &self.v4_lengths,
            IpAddr::V6(_) => &self.v6_lengths,
        };
        let decision = lengths.iter().find_map(|&len| {
            let prefix = IpNet::new(dst, len).ok()?.trunc();
            self.prefixes.get(&prefix)
        })?;
        match *decision {
            Decision::Final(outcome) => Some(outcome),
            Decision::Unmatched => None,
            Decision::Table(index) => self.tables[index].lookup(protocol, port),
        }
    }

    /// What the kernel decides for a packet to a pod of peer identity `identity` where no
    /// prefix decided. `None`: no rule matches.
    pub fn lookup_peer(&self, identity: u32, protocol: u8, port: u16) -> Option<Outcome> {
        match *self.peers.get(&identity)? {
            Decision::Final(outcome) => Some(outcome),
            Decision::Unmatched => None,
            Decision::Table(index) => self.tables[index].lookup(protocol, port),
        }
    }

    /// Whether the set has entries for peer identities (the kernel then looks them up).
    pub fn names_peers(&self) -> bool {
        !self.peers.is_empty()
    }

    /// The lengths in the endpoint's form.
    pub fn lengths(&self) -> AclLengths {
        let mut lengths = AclLengths::default();
        for (slot, len) in lengths.v4.iter_mut().zip(&self.v4_lengths) {
            *slot = *len;
        }
        for (slot, len) in lengths.v6.iter_mut().zip(&self.v6_lengths) {
            *slot = *len;
        }
        lengths
    }
}

/// Most address entries (prefixes, once the lengths are limited) one compiled set may hold in
/// each family: a sixteenth of the default `--max-acl-entries`, so that no one set fills the
/// map, and the compile's own memory stays bounded whatever the rules name.
pub const SET_MAX_PREFIXES: usize = 65_536;
/// Most address entries one NetworkPolicy may need, counted alone, for one pod and direction.
pub const POLICY_MAX_PREFIXES: usize = 16_384;

/// A rule list whose compiled form would not fit [`SET_MAX_PREFIXES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "its addresses would need at least {needed} address entries in one family, more than the {limit} one set may hold"
)]
pub struct SetTooLarge {
    /// A lower bound (saturating): the compile stops at the first step past the limit.
    pub needed: u128,
    pub limit: usize,
}

/// Compiles an ordered rule list (first match wins) into prefixes and port tables. With
/// `host_lengths`, the lengths of single addresses (32, 128) are in use even without prefixes
/// of that length yet, so addresses can be added later without changing the lengths.
pub fn compile_rules(rules: &[Rule], host_lengths: bool) -> Result<CompiledSet, SetTooLarge> {
    compile_tiered(rules, 0, host_lengths)
}

/// Compiles two tiers of one ordered list: `rules[..first_tier_end]` (which may hold `Pass`
/// rules) first-match-wins, then, for whatever no rule of the first tier decided or a `Pass`
/// rule matched, the rest of the list first-match-wins. The kernel still does one lookup
/// chain: the tiers are resolved here, prefix by prefix and port by port.
pub fn compile_tiered(
    rules: &[Rule],
    first_tier_end: usize,
    host_lengths: bool,
) -> Result<CompiledSet, SetTooLarge> {
    // Rule positions by the prefixes they name.
    let mut by_prefix: HashMap<IpNet, Vec<usize>> = HashMap::new();
    for (position, rule) in rules.iter().enumerate() {
        for net in &rule.destinations {
            let positions = by_prefix.entry(net.trunc()).or_default();
            if positions.last() != Some(&position) {
                positions.push(position);
            }
        }
        // A hole is a prefix of its own, so that its addresses get an entry without the rule.
        for hole in &rule.except {
            by_prefix.entry(hole.trunc()).or_default();
        }
    }
    let mut compiled = CompiledSet::default();
    let mut tables = SetTables::default();
    // Prefixes the same rules cover are painted once.
    let mut covers: Vec<Cover> = Vec::new();
    let mut cover_index: HashMap<Vec<usize>, usize> = HashMap::new();
    let mut decided: BTreeMap<IpNet, Decision> = BTreeMap::new();
    // In address order, so that the same rules always give the same table indexes.
    let ordered: BTreeSet<IpNet> = by_prefix.keys().copied().collect();
    let lengths = named_lengths(ordered.iter());
    for prefix in ordered {
        // The rules with a destination containing the prefix (found through the prefix's
        // ancestors, not by scanning each rule's destinations), less those whose holes take
        // it out.
        let mut covering = covering_rules(&by_prefix, &lengths, prefix);
        covering.retain(|&position| !rules[position].excepts(&prefix));
        let cover = match cover_index.get(&covering) {
            Some(&index) => &mut covers[index],
            None => {
                let painted =
                    first_match(covering.iter().map(|&p| (p < first_tier_end, &rules[p])));
                let decision = decision_of(painted, |painted| tables.index_of(painted));
                cover_index.insert(covering.clone(), covers.len());
                covers.push(Cover {
                    rules: covering,
                    prefixes: Vec::new(),
                    decision,
                });
                covers.last_mut().expect("just pushed")
            }
        };
        cover.prefixes.push(prefix);
        decided.insert(prefix, cover.decision);
    }
    // Each peer identity decided by the rules that name it, painted once per such group.
    let mut by_peer: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (position, rule) in rules.iter().enumerate() {
        for &identity in &rule.peers {
            let positions = by_peer.entry(identity).or_default();
            if positions.last() != Some(&position) {
                positions.push(position);
            }
        }
    }
    let mut peer_covers: HashMap<Vec<usize>, Decision> = HashMap::new();
    let mut peers = BTreeMap::new();
    for (identity, covering) in by_peer {
        let decision = match peer_covers.get(&covering) {
            Some(&decision) => decision,
            None => {
                let painted =
                    first_match(covering.iter().map(|&p| (p < first_tier_end, &rules[p])));
                let decision = decision_of(painted, |painted| tables.index_of(painted));
                peer_covers.insert(covering, decision);
                decision
            }
        };
        peers.insert(identity, decision);
    }
    compiled.peers = Arc::new(peers);
    compiled.tables = tables.tables;
    let keep = |len: u8| host_lengths.then_some(len);
    // Past the kernel's lengths, some prefixes are expanded into longer ones: the covers no
    // longer list the set's prefixes.
    let fits = |named: &BTreeSet<u8>, host: u8| {
        named.len() + usize::from(host_lengths && !named.contains(&host)) <= ACL_MAX_LENGTHS
    };
    if fits(&lengths.v4, 32) && fits(&lengths.v6, 128) {
        compiled.covers = Some(covers);
    }
    let (v4, v6): (BTreeMap<IpNet, Decision>, BTreeMap<IpNet, Decision>) = decided
        .into_iter()
        .partition(|(p, _)| matches!(p, IpNet::V4(_)));
    let (lengths, mut prefixes) = limit_lengths(v4, keep(32), SET_MAX_PREFIXES)?;
    compiled.v4_lengths = lengths;
    let (lengths, mut v6_prefixes) = limit_lengths(v6, keep(128), SET_MAX_PREFIXES)?;
    compiled.v6_lengths = lengths;
    prefixes.append(&mut v6_prefixes);
    compiled.prefixes = Arc::new(prefixes);
    Ok(compiled)
}

/// Whether a rule of `rules` names peer identities.
fn name_peers(rules: &[Rule]) -> bool {
    rules.iter().any(|rule| !rule.peers.is_empty())
}

/// The port tables of a set being compiled, each once.
#[derive(Default)]
struct SetTables {
    tables: Vec<PortTable>,
    by_table: HashMap<PortTable, usize>,
    /// Prefixes painted alike share their table: many prefixes (a policy's peer pods) name
    /// the same rules, and building a table walks every 256-port bucket of each protocol.
    by_painted: HashMap<Painted, usize>,
}

impl SetTables {
    /// The index of the table of a port space painted so, added if new.
    fn index_of(&mut self, painted: Painted) -> usize {
        if let Some(&index) = self.by_painted.get(&painted) {
            return index;
        }
        let table = port_table(&painted);
        let next = self.tables.len();
        let index = *self.by_table.entry(table.clone()).or_insert(next);
        if index == next {
            self.tables.push(table);
        }
        self.by_painted.insert(painted, index);
        index
    }
}

/// [`compile_tiered`] of `rules` made from `old`, the compile of `old_rules`, when the two
/// lists differ only in host prefixes (/32, /128) among the rules' destinations: a peer pod
/// added to or gone from a policy's peers. A host prefix contains no other prefix, so every
/// other prefix keeps its covering rules and its decision; only the changed hosts' entries
/// are decided again (from the rules whose destinations contain them), or taken out when no
/// rule names them any more. `None` where that does not hold and the set must be compiled
/// whole: other differences, a family's named lengths changing, or a family over
/// `ACL_MAX_LENGTHS` lengths (whose expanded entries a host may stand behind). The result
/// decides every address, protocol and port as the whole compile does; a table the changed
/// hosts need is appended, and one no prefix uses any more stays (indexes are set-local).
pub fn recompile_hosts(
    old_rules: &[Rule],
    old: &CompiledSet,
    rules: &[Rule],
    first_tier_end: usize,
    host_lengths: bool,
) -> Option<CompiledSet> {
    if old_rules.len() != rules.len()
        || old.v4_lengths.len() >= ACL_MAX_LENGTHS
        || old.v6_lengths.len() >= ACL_MAX_LENGTHS
        || name_peers(old_rules)
        || name_peers(rules)
    {
        // Under the limit, the set's lengths are those its rules name (no expansion).
        return None;
    }
    let is_host = |net: &IpNet| net.prefix_len() == net.max_prefix_len();
    let lengths_of = |net: &IpNet| match net {
        IpNet::V4(_) => &old.v4_lengths,
        IpNet::V6(_) => &old.v6_lengths,
    };
    let mut changed: BTreeSet<IpNet> = BTreeSet::new();
    for (a, b) in old_rules.iter().zip(rules) {
        if a.index != b.index
            || a.verdict != b.verdict
            || a.except != b.except
            || a.ports != b.ports
        {
            return None;
        }
        if a.destinations == b.destinations {
            continue;
        }
        for net in sorted_difference_of(&a.destinations, &b.destinations) {
            // Only hosts, of a length the set already has.
            if !is_host(&net) || !lengths_of(&net).contains(&net.prefix_len()) {
                return None;
            }
            changed.insert(net);
        }
    }
    let mut compiled = old.clone();
    for host in changed {
        if let Some(covers) = &mut compiled.covers {
            leave_cover(covers, host);
        }
        let (named_here, covering) = host_covered(rules, host);
        if !named_here {
            Arc::make_mut(&mut compiled.prefixes).remove(&host);
            continue;
        }
        if let Some(cover) = compiled
            .covers
            .as_mut()
            .and_then(|covers| covers.iter_mut().find(|c| c.rules == covering))
        {
            // Covered as other prefixes are: their decision.
            let at = cover.prefixes.partition_point(|p| *p < host);
            cover.prefixes.insert(at, host);
            Arc::make_mut(&mut compiled.prefixes).insert(host, cover.decision);
            continue;
        }
        let painted = first_match(covering.iter().map(|&p| (p < first_tier_end, &rules[p])));
        let decision = decision_of(painted, |painted| {
            let table = port_table(&painted);
            match compiled.tables.iter().position(|t| *t == table) {
                Some(index) => index,
                None => {
                    compiled.tables.push(table);
                    compiled.tables.len() - 1
                }
            }
        });
        Arc::make_mut(&mut compiled.prefixes).insert(host, decision);
        if let Some(covers) = &mut compiled.covers {
            covers.push(Cover {
                rules: covering,
                prefixes: vec![host],
                decision,
            });
        }
    }
    // A host taken out may have been the last of its length: the lengths would change.
    let has_hosts = |v4: bool| {
        compiled
            .prefixes
            .keys()
            .any(|p| matches!(p, IpNet::V4(_)) == v4 && is_host(p))
    };
    if !host_lengths
        && (old.v4_lengths.contains(&32) && !has_hosts(true)
            || old.v6_lengths.contains(&128) && !has_hosts(false))
    {
        return None;
    }
    Some(compiled)
}

/// Whether a rule names `host` (a destination or a hole), and the positions of the rules
/// that cover it (a destination contains it and no hole takes it out). One walk of every
/// rule's destinations (1,200 peers in a large policy set), where the host destinations are
/// compared rather than asked whether they contain it.
fn host_covered(rules: &[Rule], host: IpNet) -> (bool, Vec<usize>) {
    let mut named = false;
    let mut covering = Vec::new();
    for (position, rule) in rules.iter().enumerate() {
        let mut covered = false;
        for destination in &rule.destinations {
            if destination.prefix_len() == destination.max_prefix_len() {
                if *destination == host {
                    covered = true;
                    named = true;
                }
            } else if destination.contains(&host) {
                covered = true;
            }
        }
        named |= rule.except.iter().any(|hole| hole.trunc() == host);
        if covered && !rule.excepts(&host) {
            covering.push(position);
        }
    }
    (named, covering)
}

/// Takes `prefix` out of the cover that lists it (and the cover out, when it was its last).
fn leave_cover(covers: &mut Vec<Cover>, prefix: IpNet) {
    for (index, cover) in covers.iter_mut().enumerate() {
        if let Ok(at) = cover.prefixes.binary_search(&prefix) {
            cover.prefixes.remove(at);
            if cover.prefixes.is_empty() {
                covers.swap_remove(index);
            }
            return;
        }
    }
}

/// [`compile_tiered`] of `rules` made from `old`, the compile of `old_rules`, when the two
/// lists differ only in some rules' ports (a NetworkPolicy's port changed): every prefix
/// keeps the rules that cover it, so each of `old`'s covers is painted again once if one of
/// its rules changed, and its prefixes take the new decision. A table only that cover used is
/// written over in place, so that its prefixes keep pointing at it (the kernel's entries for
/// them stay). `None` where that does not hold, or `old` has no covers.
pub fn repaint_ports(
    old_rules: &[Rule],
    old: &CompiledSet,
    rules: &[Rule],
    first_tier_end: usize,
) -> Option<CompiledSet> {
    old.covers.as_ref()?;
    // A set naming peer identities has a few entries: compiled whole.
    if old_rules.len() != rules.len() || name_peers(old_rules) || name_peers(rules) {
        return None;
    }
    let mut repainted = vec![false; rules.len()];
    for ((a, b), repaint) in old_rules.iter().zip(rules).zip(&mut repainted) {
        if a.index != b.index
            || a.verdict != b.verdict
            || a.except != b.except
            || a.destinations != b.destinations
        {
            return None;
        }
        *repaint = a.ports != b.ports;
    }
    let mut compiled = old.clone();
    let CompiledSet {
        prefixes,
        tables,
        covers,
        ..
    } = &mut compiled;
    let covers = covers.as_mut().expect("checked above");
    // How many covers take each table.
    let mut users = vec![0usize; tables.len()];
    for cover in covers.iter() {
        if let Decision::Table(index) = cover.decision {
            users[index] += 1;
        }
    }
    for cover in covers.iter_mut() {
        if !cover.rules.iter().any(|&position| repainted[position]) {
            continue;
        }
        let painted = first_match(cover.rules.iter().map(|&p| (p < first_tier_end, &rules[p])));
        let decision = decision_of(painted, |painted| {
            let table = port_table(&painted);
            match (tables.iter().position(|t| *t == table), cover.decision) {
                (Some(index), _) => index,
                // A table only this cover takes is overwritten in place.
                (None, Decision::Table(index)) if users[index] == 1 => {
                    tables[index] = table;
                    index
                }
                (None, _) => {
                    tables.push(table);
                    users.push(0);
                    tables.len() - 1
                }
            }
        });
        if decision == cover.decision {
            continue;
        }
        if let Decision::Table(index) = cover.decision {
            users[index] -= 1;
        }
        if let Decision::Table(index) = decision {
            users[index] += 1;
        }
        cover.decision = decision;
        let prefixes = Arc::make_mut(prefixes);
        for prefix in &cover.prefixes {
            prefixes.insert(*prefix, decision);
        }
    }
    drop_unused_tables(prefixes, tables, covers, &users);
    Some(compiled)
}

/// Removes the tables no cover takes (`users` of each), renumbering the decisions of the
/// prefixes that take a later one: tables are set-local, and a set's tables are all written
/// to the kernel.
fn drop_unused_tables(
    prefixes: &mut Arc<BTreeMap<IpNet, Decision>>,
    tables: &mut Vec<PortTable>,
    covers: &mut [Cover],
    users: &[usize],
) {
    if !users.contains(&0) {
        return;
    }
    let mut renumbered = Vec::with_capacity(users.len());
    let mut next = 0;
    for &count in users {
        renumbered.push(next);
        next += usize::from(count > 0);
    }
    let mut index = 0;
    tables.retain(|_| {
        index += 1;
        users[index - 1] > 0
    });
    for cover in covers {
        if let Decision::Table(index) = cover.decision
            && renumbered[index] != index
        {
            cover.decision = Decision::Table(renumbered[index]);
            let prefixes = Arc::make_mut(prefixes);
            for prefix in &cover.prefixes {
                prefixes.insert(*prefix, cover.decision);
            }
        }
    }
}

/// The networks (truncated) in one of `a` and `b` but not in the other, in order. Two
/// versions of a rule's destinations are mostly the same list with a peer more or less: the
/// entries both begin and end with are set aside first, and only the differing middles are
/// sorted (sorting two lists of 300 networks was most of recompiling a set for one peer).
pub(super) fn sorted_difference_of(a: &[IpNet], b: &[IpNet]) -> Vec<IpNet> {
    /// Up to this many differing networks are each looked for among the common entries.
    const FEW_DIFFERING: usize = 8;
    let prefix = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let (a_rest, b_rest) = (&a[prefix..], &b[prefix..]);
    let suffix = a_rest
        .iter()
        .rev()
        .zip(b_rest.iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    let common = a[..prefix].iter().chain(&a[a.len() - suffix..]);
    let (a_mid, b_mid) = (
        &a_rest[..a_rest.len() - suffix],
        &b_rest[..b_rest.len() - suffix],
    );
    let sorted = |nets: &[IpNet]| {
        let mut nets: Vec<IpNet> = nets.iter().map(IpNet::trunc).collect();
        nets.sort_unstable();
        nets.dedup();
        nets
    };
    let (a, b) = (sorted(a_mid), sorted(b_mid));
    let only_in = |one: &[IpNet], other: &[IpNet]| -> Vec<IpNet> {
        one.iter()
            .filter(|net| other.binary_search(net).is_err())
            .copied()
            .collect()
    };
    let mut differ = only_in(&a, &b);
    differ.extend(only_in(&b, &a));
    differ.sort_unstable();
    // A network both lists also hold outside the middles is in both. A peer more or less
    // leaves one or two networks to look for: a walk of the common entries for each costs
    // less than sorting them (which was a tenth of a pod added).
    if differ.len() <= FEW_DIFFERING {
        differ.retain(|net| !common.clone().any(|c| c.trunc() == *net));
    } else {
        let shared = sorted(&common.copied().collect::<Vec<_>>());
        differ.retain(|net| shared.binary_search(net).is_err());
    }
    differ
}

/// Brings one family's prefixes down to at most `ACL_MAX_LENGTHS` lengths: while there are
/// more, the length whose prefixes cost the fewest entries to expand into the next longer
/// length is expanded there (existing, more specific entries keep their decisions). Returns
/// the lengths, longest first, and the prefixes. `keep` is in use even without prefixes (it is
/// the family's longest, so never expanded). An expansion that would take the family past
/// `limit` entries is not made: the set is too large (counted before anything is expanded,
/// so the compile never holds more than `limit` entries).
fn limit_lengths(
    mut prefixes: BTreeMap<IpNet, Decision>,
    keep: Option<u8>,
    limit: usize,
) -> Result<(Vec<u8>, BTreeMap<IpNet, Decision>), SetTooLarge> {
    if prefixes.len() > limit {
        return Err(SetTooLarge {
            needed: prefixes.len() as u128,
            limit,
        });
    }
    loop {
        let mut lengths: Vec<u8> = prefixes.keys().map(IpNet::prefix_len).chain(keep).collect();
        lengths.sort_unstable();
        lengths.dedup();
        if lengths.len() <= ACL_MAX_LENGTHS {
            lengths.reverse();
            return Ok((lengths, prefixes));
        }
        let count = |len: u8| prefixes.keys().filter(|p| p.prefix_len() == len).count() as u128;
        let (from, to, cost) = cheapest_expansion(&lengths, count);
        let after = (prefixes.len() as u128 - count(from)).saturating_add(cost);
        if after > limit as u128 {
            return Err(SetTooLarge {
                needed: after,
                limit,
            });
        }
        let expanded: Vec<(IpNet, Decision)> = prefixes
            .iter()
            .filter(|(p, _)| p.prefix_len() == from)
            .map(|(p, d)| (*p, *d))
            .collect();
        for (prefix, decision) in expanded {
            prefixes.remove(&prefix);
            for sub in prefix.subnets(to).expect("a longer length") {
                prefixes.entry(sub).or_insert(decision);
            }
        }
    }
}

/// Of neighbouring `lengths` (ascending, more than one), the pair whose expansion from the
/// shorter into the longer costs the fewest entries (`count` prefixes of a length), with that
/// cost. Saturating: expanding a /8 into /128 is 2^120 entries per prefix, which no `u128`
/// product of counts may wrap into a small number.
fn cheapest_expansion(lengths: &[u8], count: impl Fn(u8) -> u128) -> (u8, u8, u128) {
    lengths
        .windows(2)
        .map(|w| (w[0], w[1], expansion_cost(count(w[0]), w[1] - w[0])))
        .min_by_key(|&(_, _, cost)| cost)
        .expect("more than one length")
}

/// Entries `count` prefixes become when lengthened by `gap` bits (saturating).
fn expansion_cost(count: u128, gap: u8) -> u128 {
    1u128
        .checked_shl(u32::from(gap))
        .and_then(|each| count.checked_mul(each))
        .unwrap_or(u128::MAX)
}

/// How many address entries `prefixes` (of one family) would take in a compiled set once its
/// lengths are limited, counted without expanding anything: an upper bound (prefixes an
/// expansion meets are counted twice), saturating. What one policy's addresses cost alone.
pub fn estimated_entries(prefixes: impl IntoIterator<Item = IpNet>) -> u128 {
    let mut by_length: BTreeMap<u8, u128> = BTreeMap::new();
    let distinct: BTreeSet<IpNet> = prefixes.into_iter().map(|p| p.trunc()).collect();
    for prefix in distinct {
        *by_length.entry(prefix.prefix_len()).or_default() += 1;
    }
    while by_length.len() > ACL_MAX_LENGTHS {
        let lengths: Vec<u8> = by_length.keys().copied().collect();
        let (from, to, cost) = cheapest_expansion(&lengths, |len| by_length[&len]);
        by_length.remove(&from);
        let into = by_length.entry(to).or_default();
        *into = into.saturating_add(cost);
    }
    by_length
        .values()
        .fold(0u128, |sum, c| sum.saturating_add(*c))
}
