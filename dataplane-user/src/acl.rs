//! Access control: ordered rule lists compiled into the kernel's hash lookups (see
//! `dataplane_common::acl`), and the sync that switches them in.
//!
//! Compiling a rule set (pure):
//! 1. every destination CIDR of every rule is a prefix; the rules covering a prefix are those
//!    naming it or any shorter prefix containing it, found by truncating it to every shorter
//!    length (at most 129 hash lookups per prefix, whatever the number of rules);
//! 2. those rules, in order, paint the protocol/port space first-match-wins; one outcome
//!    everywhere becomes a final decision, anything else a port table of exact ports, 256-port
//!    buckets and whole protocols around a default. Identical tables are shared;
//! 3. when a family uses more than `ACL_MAX_LENGTHS` prefix lengths, the cheapest lengths are
//!    expanded into the next longer one (a prefix becomes its sub-prefixes there, more
//!    specific entries keep their own decision), so the kernel needs at most that many
//!    lookups.
//!
//! Sync: a changed rule set is written under a new set id with new table ids, then each pod's
//! endpoint entry switches to it (set id and prefix lengths together) in one write, then the
//! old set is deleted. A packet sees the old rules or the new ones, never a mix.

pub mod admin;
#[cfg(test)]
mod admin_tests;
pub mod agent;
pub mod audit;
pub mod dns;
pub mod explain;
pub mod firewall;
pub mod peers;
pub mod pods;
pub mod policy;
#[cfg(test)]
mod policy_tests;
pub mod rules;
pub mod select;
#[cfg(test)]
mod tests;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    sync::Arc,
};

use aya::maps::{HashMap as BpfHashMap, MapData};
use dataplane_common::{
    acl::{
        ACL_ENDPOINT_EGRESS_PEERS, ACL_ENDPOINT_INGRESS_PEERS, ACL_ENDPOINT_SNOOP_DNS,
        ACL_ENTRY_FINAL, ACL_ENTRY_PORTS, ACL_FAMILY_V4, ACL_FAMILY_V6, ACL_MAX_LENGTHS,
        ACL_PORT_BUCKET, ACL_PORT_EXACT, ACL_PORT_PROTOCOL, ACL_RULE_DEFAULT, ACL_VERDICT_ALLOW,
        ACL_VERDICT_DENY, ACL_VERDICT_NONE, AclAddrKey, AclAddrValue, AclEndpoint, AclLengths,
        AclLogConfig, AclPortKey, AclVerdict, peer_key,
    },
    maps,
    overlay::Addr,
};
use ipnet::IpNet;

use crate::{
    AgentError, Dataplane,
    mapsync::{addr16, map_err, sync_hash, sync_hash_since},
    model::OverlayView,
};

pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_SCTP: u8 = 132;

/// The IP protocol number of a Kubernetes protocol name (`TCP`, `UDP`, `SCTP`).
pub fn protocol_number(name: &str) -> Option<u8> {
    match name {
        "TCP" => Some(PROTO_TCP),
        "UDP" => Some(PROTO_UDP),
        "SCTP" => Some(PROTO_SCTP),
        _ => None,
    }
}

/// Largest point of the protocol/port space (`protocol << 16 | port`).
const PORT_SPACE_MAX: u32 = (1 << 24) - 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Verdict {
    Allow,
    Deny,
    /// Admin policies' `Pass`: the rest of the admin tier is skipped for what the rule
    /// matches, and the next tier decides. Never reaches the kernel: the painter hands the
    /// space to the next tier's rules (see [`compile_tiered`]).
    Pass,
}

impl Verdict {
    fn code(self) -> u8 {
        match self {
            Verdict::Allow => ACL_VERDICT_ALLOW,
            Verdict::Deny => ACL_VERDICT_DENY,
            Verdict::Pass => ACL_VERDICT_NONE,
        }
    }
}

/// Which traffic to a destination a rule matches.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Ports {
    /// Every protocol and port (ICMP included).
    Any,
    /// Only these.
    Only(Vec<PortMatch>),
}

/// One protocol and an inclusive port range (`0..=65535` for every port of the protocol).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PortMatch {
    pub protocol: u8,
    pub first: u16,
    pub last: u16,
}

impl PortMatch {
    pub fn all_ports(protocol: u8) -> Self {
        Self {
            protocol,
            first: 0,
            last: u16::MAX,
        }
    }

    pub fn port(protocol: u8, port: u16) -> Self {
        Self {
            protocol,
            first: port,
            last: port,
        }
    }

    fn interval(self) -> (u32, u32) {
        let base = u32::from(self.protocol) << 16;
        (base | u32::from(self.first), base | u32::from(self.last))
    }
}

/// A validated rule of an ordered list.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rule {
    /// Index in its object (reported in audit records), or `ACL_RULE_EXEMPT`.
    pub index: u32,
    pub verdict: Verdict,
    pub destinations: Vec<IpNet>,
    /// Holes in `destinations` the rule does not match (NetworkPolicy's `ipBlock.except`).
    pub except: Vec<IpNet>,
    /// Peer identities whose pods the rule matches (ascending): the addresses of those pods
    /// are in `ACL_PEERS`, not among `destinations`. Only in rule lists that only allow and
    /// have no tiers (see `dataplane_common::acl`).
    pub peers: Vec<u32>,
    pub ports: Ports,
}

impl Rule {
    /// Whether one of the rule's holes (`except`) contains `prefix`.
    fn excepts(&self, prefix: &IpNet) -> bool {
        self.except.iter().any(|hole| hole.contains(prefix))
    }
}

/// The deciding rule and its verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Outcome {
    pub verdict: Verdict,
    pub rule: u32,
}

/// Disjoint intervals of the protocol/port space, ascending, with the first rule covering each.
/// Space no rule covers is absent (no match: the set's default applies).
type Painted = Vec<(u32, u32, Outcome)>;

/// A port table as the kernel reads it: an exact port, else the port's 256-port bucket
/// (keyed by the port with its low 8 bits cleared), else the protocol, else the default.
/// `None` outcomes are stored too: no rule matches there, whatever a wider entry says.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PortTable {
    pub default: Option<Outcome>,
    pub protocols: BTreeMap<u8, Option<Outcome>>,
    pub buckets: BTreeMap<(u8, u16), Option<Outcome>>,
    pub exact: BTreeMap<(u8, u16), Option<Outcome>>,
}

impl PortTable {
    /// The `ACL_PORT_*` kinds of entry the table has.
    fn kinds(&self) -> u8 {
        let mut kinds = 0;
        if !self.exact.is_empty() {
            kinds |= ACL_PORT_EXACT;
        }
        if !self.buckets.is_empty() {
            kinds |= ACL_PORT_BUCKET;
        }
        if !self.protocols.is_empty() {
            kinds |= ACL_PORT_PROTOCOL;
        }
        kinds
    }

    /// What the kernel decides for a protocol and port.
    pub fn lookup(&self, protocol: u8, port: u16) -> Option<Outcome> {
        if let Some(found) = self.exact.get(&(protocol, port)) {
            return *found;
        }
        if let Some(found) = self.buckets.get(&(protocol, port & 0xFF00)) {
            return *found;
        }
        if let Some(found) = self.protocols.get(&protocol) {
            return *found;
        }
        self.default
    }

    /// Map entries the table takes.
    pub fn entries(&self) -> usize {
        self.exact.len() + self.buckets.len() + self.protocols.len()
    }
}

/// What the address lookup answers for one prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Decision {
    /// The same outcome for every protocol and port.
    Final(Outcome),
    /// No rule matches anything here (a hole in a rule's addresses): the set's default, even
    /// where a shorter prefix has rules.
    Unmatched,
    /// Look the protocol and port up in the set's table of this index.
    Table(usize),
}

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
fn sorted_difference_of(a: &[IpNet], b: &[IpNet]) -> Vec<IpNet> {
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

/// What prefixes painted so take: nothing matched, one outcome over every port, or a port
/// table, which `table_index` finds or adds (each caller keeps its tables its own way).
fn decision_of(painted: Painted, table_index: impl FnOnce(Painted) -> usize) -> Decision {
    match painted.as_slice() {
        [] => return Decision::Unmatched,
        [(0, PORT_SPACE_MAX, outcome)] => return Decision::Final(*outcome),
        _ => {}
    }
    Decision::Table(table_index(painted))
}

/// The kernel's form of a painted protocol/port space (see [`PortTable`]). Outcomes are
/// chosen at each level by how much space they cover, so that the fewest entries remain.
fn port_table(painted: &Painted) -> PortTable {
    // Rules name TCP, UDP and SCTP only; every other protocol (0 included) gets what rules
    // without ports say.
    let default = segments(painted, 0)
        .first()
        .and_then(|&(_, _, outcome)| outcome);
    let mut table = PortTable {
        default,
        ..PortTable::default()
    };
    let mut named: BTreeSet<u8> = BTreeSet::new();
    for &(first, last, _) in painted {
        named.insert((first >> 16) as u8);
        named.insert((last >> 16) as u8);
    }
    for protocol in named {
        let ports = segments(painted, protocol);
        if ports.iter().all(|&(_, _, o)| o == default) {
            continue;
        }
        let for_protocol = most_covering(&ports, 0, u16::MAX);
        if for_protocol != default {
            table.protocols.insert(protocol, for_protocol);
        }
        let mut at = 0;
        for bucket in 0..=0xFFu16 {
            let (low, high) = (bucket << 8, bucket << 8 | 0xFF);
            while ports[at].1 < low {
                at += 1;
            }
            // The segments overlapping this bucket start at `at`.
            let end = at + ports[at..].iter().take_while(|s| s.0 <= high).count();
            let inside = &ports[at..end];
            let for_bucket = most_covering(inside, low, high);
            if for_bucket != for_protocol {
                table.buckets.insert((protocol, low), for_bucket);
            }
            for &(first, last, outcome) in inside {
                if outcome != for_bucket {
                    for port in first.max(low)..=last.min(high) {
                        table.exact.insert((protocol, port), outcome);
                    }
                }
            }
        }
    }
    table
}

/// The ports of `protocol` as contiguous segments covering 0..=65535, each with its outcome
/// (`None` where no rule matches).
fn segments(painted: &Painted, protocol: u8) -> Vec<(u16, u16, Option<Outcome>)> {
    let (base, top) = (
        u32::from(protocol) << 16,
        u32::from(protocol) << 16 | 0xFFFF,
    );
    let mut out = Vec::new();
    let mut next = 0u32;
    let first = painted.partition_point(|(_, last, _)| *last < base);
    for &(start, end, outcome) in painted[first..].iter().take_while(|(s, _, _)| *s <= top) {
        let (start, end) = (start.max(base) - base, end.min(top) - base);
        if start > next {
            out.push((next as u16, (start - 1) as u16, None));
        }
        out.push((start as u16, end as u16, Some(outcome)));
        next = end + 1;
    }
    if next <= 0xFFFF {
        out.push((next as u16, u16::MAX, None));
    }
    out
}

/// The outcome covering most of `low..=high` among `segments` (the first of equals).
fn most_covering(segments: &[(u16, u16, Option<Outcome>)], low: u16, high: u16) -> Option<Outcome> {
    let mut covered: Vec<(Option<Outcome>, u32)> = Vec::new();
    for &(first, last, outcome) in segments {
        let (first, last) = (first.max(low), last.min(high));
        if first > last {
            continue;
        }
        let span = u32::from(last - first) + 1;
        match covered.iter_mut().find(|(o, _)| *o == outcome) {
            Some((_, n)) => *n += span,
            None => covered.push((outcome, span)),
        }
    }
    let mut best: Option<(Option<Outcome>, u32)> = None;
    for (outcome, n) in covered {
        if best.is_none_or(|(_, m)| n > m) {
            best = Some((outcome, n));
        }
    }
    best.and_then(|(outcome, _)| outcome)
}

/// Positions of the rules whose destinations contain `prefix`, ascending: those naming the
/// prefix itself or any shorter prefix containing it. Only the lengths some rule names are
/// looked up (`lengths`, see [`named_lengths`]): a set of peer pods names /32s and maybe a
/// few wider prefixes, and looking up all 33 (or 129) ancestors of each of its hundreds of
/// prefixes was most of the compile of a large peer set.
fn covering_rules(
    by_prefix: &HashMap<IpNet, Vec<usize>>,
    lengths: &NamedLengths,
    prefix: IpNet,
) -> Vec<usize> {
    let named = match prefix {
        IpNet::V4(_) => &lengths.v4,
        IpNet::V6(_) => &lengths.v6,
    };
    let mut positions: Vec<usize> = named
        .range(..=prefix.prefix_len())
        .filter_map(|&len| IpNet::new(prefix.addr(), len).ok())
        .filter_map(|ancestor| by_prefix.get(&ancestor.trunc()))
        .flatten()
        .copied()
        .collect();
    positions.sort_unstable();
    positions.dedup();
    positions
}

/// The prefix lengths named in a set's rules (destinations and holes), by family.
#[derive(Default)]
struct NamedLengths {
    v4: BTreeSet<u8>,
    v6: BTreeSet<u8>,
}

fn named_lengths<'a>(prefixes: impl Iterator<Item = &'a IpNet>) -> NamedLengths {
    let mut lengths = NamedLengths::default();
    for prefix in prefixes {
        match prefix {
            IpNet::V4(net) => lengths.v4.insert(net.prefix_len()),
            IpNet::V6(net) => lengths.v6.insert(net.prefix_len()),
        };
    }
    lengths
}

/// Paints the protocol/port space with `rules` in order: each point takes the outcome of the
/// first rule that covers it. Adjacent intervals of one outcome are merged. Each rule comes
/// with whether it is of the first tier: where a first-tier `Pass` rule painted, the next
/// tier's rules paint again, and what is still `Pass` at the end is left unmatched.
fn first_match<'a>(rules: impl Iterator<Item = (bool, &'a Rule)>) -> Painted {
    // start -> (end, outcome); disjoint.
    let mut painted: BTreeMap<u32, (u32, Outcome)> = BTreeMap::new();
    let mut in_first_tier = true;
    // The space is all painted: the rest of the tier is shadowed.
    let mut full = false;
    for (first_tier, rule) in rules {
        if in_first_tier && !first_tier {
            in_first_tier = false;
            painted.retain(|_, (_, outcome)| outcome.verdict != Verdict::Pass);
            full = false;
        }
        if full {
            if in_first_tier {
                continue;
            }
            break;
        }
        let outcome = Outcome {
            verdict: rule.verdict,
            rule: rule.index,
        };
        match &rule.ports {
            Ports::Any => {
                paint_gaps(&mut painted, 0, PORT_SPACE_MAX, outcome);
                full = true;
            }
            Ports::Only(matches) => {
                for m in matches {
                    let (first, last) = m.interval();
                    paint_gaps(&mut painted, first, last, outcome);
                }
            }
        }
    }
    painted.retain(|_, (_, outcome)| outcome.verdict != Verdict::Pass);
    let mut merged: Painted = Vec::with_capacity(painted.len());
    for (start, (end, outcome)) in painted {
        match merged.last_mut() {
            Some((_, last, previous)) if *last + 1 == start && *previous == outcome => {
                *last = end;
            }
            _ => merged.push((start, end, outcome)),
        }
    }
    merged
}

/// Gives `outcome` to the parts of `first..=last` no earlier rule painted.
fn paint_gaps(
    painted: &mut BTreeMap<u32, (u32, Outcome)>,
    first: u32,
    last: u32,
    outcome: Outcome,
) {
    let mut taken: Vec<(u32, u32)> = painted
        .range(..=last)
        .rev()
        .take_while(|(_, (end, _))| *end >= first)
        .map(|(&start, &(end, _))| (start, end))
        .collect();
    taken.reverse();
    let mut cursor = first;
    let mut gaps = Vec::new();
    for (start, end) in taken {
        if start > cursor {
            gaps.push((cursor, start - 1));
        }
        cursor = cursor.max(end.saturating_add(1));
    }
    if cursor <= last {
        gaps.push((cursor, last));
    }
    for (start, end) in gaps {
        painted.insert(start, (end, outcome));
    }
}

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
fn addr_value(compiled: &CompiledSet, table_ids: &[u32], decision: Decision) -> AclAddrValue {
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
fn table_follows(old: &CompiledSet, old_index: usize, new: &CompiledSet, new_index: usize) -> bool {
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
fn tables_alone_differ(old: &CompiledSet, new: &CompiledSet) -> bool {
    Arc::ptr_eq(&old.prefixes, &new.prefixes)
        && old.peers == new.peers
        && old.tables.len() == new.tables.len()
        && old
            .tables
            .iter()
            .zip(&new.tables)
            .all(|(a, b)| a.default == b.default && a.kinds() == b.kinds())
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

/// The `ACL_PORTS` entries of `table` written under the id `id`.
fn table_entries(
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
struct InstalledSet {
    /// What was compiled into it; `None` for a set adopted from a previous agent.
    compiled: Option<Arc<CompiledSet>>,
    lengths: AclLengths,
    /// Map id of each of `compiled`'s tables.
    table_ids: Vec<u32>,
    prefixes: Vec<AclAddrKey>,
    ports: Vec<AclPortKey>,
}

impl InstalledSet {
    fn adopted() -> Self {
        Self {
            compiled: None,
            lengths: AclLengths::default(),
            table_ids: Vec::new(),
            prefixes: Vec::new(),
            ports: Vec::new(),
        }
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
        direction: pods::Direction,
    ) -> Option<u32> {
        let wants = |sets: &policy::PodSets| {
            [&sets.ingress, &sets.egress]
                .into_iter()
                .any(|n| n.as_deref() == Some(name))
        };
        let slot = match direction {
            pods::Direction::Ingress => 0,
            pods::Direction::Egress => 1,
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

/// A set's table ids and the keys of its entries, as written (or tried).
#[derive(Default)]
struct SetKeys {
    table_ids: Vec<u32>,
    ports: Vec<AclPortKey>,
    prefixes: Vec<AclAddrKey>,
}

/// How a sync changes a map of the sets in force by name: the names whose set moves (with
/// the set before, if any, and after), and the names no longer wanted.
#[derive(Default)]
struct Moves {
    moved: Vec<(String, Option<u32>, u32)>,
    gone: Vec<String>,
}

impl Moves {
    /// Changes `in_force` as these moves say; a name no longer wanted keeps its set while
    /// `keep` names it (a namespace whose firewall is now invalid keeps its last good
    /// rules). Returns the sets that names left (which may be unused now).
    fn apply(self, in_force: &mut BTreeMap<String, u32>, keep: &BTreeSet<String>) -> Vec<u32> {
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
fn in_force_beside<V>(
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

/// What the access-control maps hold, as this agent knows it.
#[derive(Debug, Default)]
pub struct AclState {
    next_set: u32,
    next_table: u32,
    sets: BTreeMap<u32, InstalledSet>,
    /// The firewall set in force for each namespace (its last good rules).
    firewalls: BTreeMap<String, u32>,
    /// The NetworkPolicy sets in force by name.
    policies: BTreeMap<String, u32>,
    /// What each policy set is (for audit records).
    policy_meta: BTreeMap<u32, rules::PolicySet>,
    /// Counts the changes to `policy_meta`: what is described for `inspect` is written again
    /// only when it moved.
    meta_version: u64,
    /// The sets whose description moved since [`AclState::take_described_changes`] was last
    /// called (new, changed or gone): only those are described again.
    described_changes: BTreeSet<u32>,
    /// The (ingress, egress) policy set ids each local pod's endpoint was last written with,
    /// by `<namespace>/<name>` (0: none): who sees a set changed in place.
    pod_sets: BTreeMap<String, [u32; 2]>,
    /// The endpoints as the last sync wrote them (`None`: not known, compare with the
    /// kernel's), so that a sync reads none back (110 system calls).
    endpoints: Option<BTreeMap<Addr, AclEndpoint>>,
    /// The last sync ended with every installed set in use (false after an adoption or a
    /// sync that stopped midway: the next one looks at every set).
    swept: bool,
    /// The addresses written to `ACL_PEERS` for each peer identity.
    peers: BTreeMap<u32, Arc<[Addr]>>,
    /// Addresses a previous agent left in `ACL_PEERS`, which the next sync removes where no
    /// identity it names has them.
    peers_left: Vec<Addr>,
}

impl AclState {
    /// Whether the installed set `set` holds `compiled` (the same compile, shared).
    fn holds(&self, set: u32, compiled: &Arc<CompiledSet>) -> bool {
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
    fn forget_rules(&mut self, set: u32, tried: SetKeys) {
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
    fn uses(&self, set: u32) -> bool {
        self.firewalls
            .values()
            .chain(self.policies.values())
            .any(|s| *s == set)
    }

    /// The installed sets nothing is in force with.
    fn unused_sets(&self) -> Vec<u32> {
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
    pub fn policy_set(&self, set: u32) -> Option<&rules::PolicySet> {
        self.policy_meta.get(&set)
    }

    /// Changes as the policy sets' descriptions do (see [`explain::set_rules`]).
    pub fn meta_version(&self) -> u64 {
        self.meta_version
    }

    /// The sets whose description moved since the last call (see
    /// [`explain::set_rules_since`]).
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
    /// NetworkPolicy sets by name (see [`policy::policy_sets`]), shared by the local pods with
    /// the same rules.
    pub policy_sets: BTreeMap<String, rules::PolicySet>,
    /// The policy sets of each isolated local pod, by `<namespace>/<name>`.
    pub pod_policies: BTreeMap<String, policy::PodSets>,
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

/// Writes `entries` to `map` in batch calls, counting what went in (also when a full map
/// stopped the batch).
fn write_batch<K: aya::Pod, V: aya::Pod>(
    map: &aya::maps::Map,
    entries: &[(K, V)],
    stats: &mut AclSyncStats,
) -> Result<(), aya::maps::MapError> {
    match crate::batch::update(map, entries) {
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
        match crate::batch::delete::<K, V>(map, rest) {
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
        let peer_moves = peers::moves(&state.peers, &desired.peers, &state.peers_left);
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

    /// Writes the addresses new to their peer identities (see [`peers::moves`]).
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

    /// Removes the addresses no peer identity named has any more (see [`peers::moves`]).
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
        wanted: &rules::PolicySet,
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
