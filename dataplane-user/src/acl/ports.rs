//! The protocol/port space painted first-match-wins by a prefix's rules, and the port tables
//! the kernel reads it as: an exact port, a 256-port bucket, a protocol, a default.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use dataplane_common::acl::{ACL_PORT_BUCKET, ACL_PORT_EXACT, ACL_PORT_PROTOCOL};
use ipnet::IpNet;

use super::rule::{Outcome, PORT_SPACE_MAX, Ports, Rule, Verdict};

/// Disjoint intervals of the protocol/port space, ascending, with the first rule covering each.
/// Space no rule covers is absent (no match: the set's default applies).
pub(super) type Painted = Vec<(u32, u32, Outcome)>;

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
    pub(super) fn kinds(&self) -> u8 {
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

/// What prefixes painted so take: nothing matched, one outcome over every port, or a port
/// table, which `table_index` finds or adds (each caller keeps its tables its own way).
pub(super) fn decision_of(
    painted: Painted,
    table_index: impl FnOnce(Painted) -> usize,
) -> Decision {
    match painted.as_slice() {
        [] => return Decision::Unmatched,
        [(0, PORT_SPACE_MAX, outcome)] => return Decision::Final(*outcome),
        _ => {}
    }
    Decision::Table(table_index(painted))
}

/// The kernel's form of a painted protocol/port space (see [`PortTable`]). Outcomes are
/// chosen at each level by how much space they cover, so that the fewest entries remain.
pub(super) fn port_table(painted: &Painted) -> PortTable {
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
pub(super) fn covering_rules(
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
pub(super) struct NamedLengths {
    pub(super) v4: BTreeSet<u8>,
    pub(super) v6: BTreeSet<u8>,
}

pub(super) fn named_lengths<'a>(prefixes: impl Iterator<Item = &'a IpNet>) -> NamedLengths {
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
pub(super) fn first_match<'a>(rules: impl Iterator<Item = (bool, &'a Rule)>) -> Painted {
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
