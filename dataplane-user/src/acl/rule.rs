//! The rule model every access-control compile shares: protocols, ports, verdicts, rules and
//! the outcome of the rule that decides.

use dataplane_common::acl::{ACL_VERDICT_ALLOW, ACL_VERDICT_DENY, ACL_VERDICT_NONE};
use ipnet::IpNet;

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
pub(super) const PORT_SPACE_MAX: u32 = (1 << 24) - 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Verdict {
    Allow,
    Deny,
    /// Admin policies' `Pass`: the rest of the admin tier is skipped for what the rule
    /// matches, and the next tier decides. Never reaches the kernel: the painter hands the
    /// space to the next tier's rules (see `compile::compile_tiered`).
    Pass,
}

impl Verdict {
    pub(super) fn code(self) -> u8 {
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

    pub(super) fn interval(self) -> (u32, u32) {
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
    pub(super) fn excepts(&self, prefix: &IpNet) -> bool {
        self.except.iter().any(|hole| hole.contains(prefix))
    }
}

/// The deciding rule and its verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Outcome {
    pub verdict: Verdict,
    pub rule: u32,
}
