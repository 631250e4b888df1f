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
pub mod pod_rules;
pub mod pods;
pub mod policy;
#[cfg(test)]
mod policy_tests;
pub mod select;
#[cfg(test)]
mod tests;

mod compile;
mod entries;
mod ports;
mod rule;
mod state;
mod sync;

// What the tests beside this module take from here with `use super::*`.
#[cfg(test)]
use {
    compile::sorted_difference_of,
    entries::{Moves, in_force_beside, table_follows},
    std::collections::{BTreeMap, BTreeSet},
};

pub use compile::{
    CompiledSet, Cover, POLICY_MAX_PREFIXES, SET_MAX_PREFIXES, SetTooLarge, compile_rules,
    compile_tiered, estimated_entries, recompile_hosts, repaint_ports,
};
pub use entries::addr_key;
pub use ports::{Decision, PortTable};
pub use rule::{
    Outcome, PROTO_SCTP, PROTO_TCP, PROTO_UDP, PortMatch, Ports, Rule, Verdict, protocol_number,
};
pub use state::{AclPod, AclState, AclSyncStats, DesiredFirewalls, pods_of};
