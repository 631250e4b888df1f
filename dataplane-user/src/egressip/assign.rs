//! Which node holds which egress address (pure): the controller's decision, written to the
//! objects' `status.items`.
//!
//! Rules, in the order they are applied:
//! - an address that is a node's own address is rejected;
//! - an address already claimed by an earlier object (older `creationTimestamp`, then the
//!   order read) is not assigned to the later one;
//! - an address goes only to a node that is assignable (the `k8s.ovn.org/egress-assignable`
//!   label, Ready, answering its probes) and whose underlay subnet contains it;
//! - an object's addresses go to distinct nodes;
//! - a current holder that is still eligible keeps its address (no flow moves needlessly);
//!   the others go to the eligible node holding the fewest, ties broken by name.

use std::sync::Arc;
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;

use super::EgressIP;

/// A node as the assignment sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub name: String,
    /// The node's own addresses (`status.addresses`).
    pub addresses: Vec<IpAddr>,
    /// The node's underlay subnets (`k8s.ovn.org/node-primary-ifaddr`).
    pub subnets: Vec<IpNet>,
    /// `Ok`: may hold egress addresses; `Err`: why not (unlabelled, NotReady, unreachable).
    pub eligible: Result<(), String>,
}

/// Why an address was not assigned: the metric's `reason` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    /// The address is a node's own.
    NodeAddress,
    /// An earlier object has the same address.
    Duplicate,
    /// No node's underlay subnet contains it.
    NoSubnet,
    /// Nodes' subnets contain it, but none of them can take it (not assignable, not ready,
    /// unreachable, or already holding another address of the object).
    NoNode,
}

impl Reason {
    pub const ALL: [Reason; 4] = [
        Reason::NodeAddress,
        Reason::Duplicate,
        Reason::NoSubnet,
        Reason::NoNode,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Reason::NodeAddress => "node_address",
            Reason::Duplicate => "duplicate",
            Reason::NoSubnet => "no_subnet",
            Reason::NoNode => "no_node",
        }
    }
}

/// An address left unassigned, with the message the controller logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub object: String,
    pub ip: IpAddr,
    pub reason: Reason,
    pub message: String,
}

/// The decision: for each object (by name), its addresses and their nodes, in spec order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Assignment {
    pub items: BTreeMap<String, Vec<(IpAddr, String)>>,
    pub problems: Vec<Problem>,
}

/// The objects in the order they claim addresses: oldest first, then as read.
pub fn claim_order(objects: &[Arc<EgressIP>]) -> Vec<&EgressIP> {
    let mut ordered: Vec<&EgressIP> = objects.iter().map(|o| &**o).collect();
    ordered.sort_by(|a, b| {
        let created = |o: &EgressIP| o.metadata.creation_timestamp.as_ref().map(|t| t.0);
        match (created(a), created(b)) {
            (Some(x), Some(y)) => x.cmp(&y),
            _ => std::cmp::Ordering::Equal,
        }
    });
    ordered
}

/// Assigns every address of `objects` to a node of `nodes`; `current` is who holds what now.
pub fn assign(
    objects: &[Arc<EgressIP>],
    nodes: &[Candidate],
    current: &BTreeMap<IpAddr, String>,
) -> Assignment {
    let mut assignment = Assignment::default();
    // (object, address) pairs that passed the object-independent checks, in claim order.
    let mut wanted: Vec<(String, IpAddr)> = Vec::new();
    let mut claimed: BTreeMap<IpAddr, String> = BTreeMap::new();
    for object in claim_order(objects) {
        let name = object.metadata.name.clone().unwrap_or_default();
        assignment.items.entry(name.clone()).or_default();
        for ip in object.spec.egress_ips.iter().filter_map(|t| t.parse().ok()) {
            let problem = |reason, message| Problem {
                object: name.clone(),
                ip,
                reason,
                message,
            };
            if let Some(node) = nodes.iter().find(|n| n.addresses.contains(&ip)) {
                assignment.problems.push(problem(
                    Reason::NodeAddress,
                    format!("{ip} is node {}'s own address; rejected", node.name),
                ));
                continue;
            }
            if let Some(first) = claimed.get(&ip) {
                assignment.problems.push(problem(
                    Reason::Duplicate,
                    format!("{ip} is already EgressIP {first}'s; not assigned"),
                ));
                continue;
            }
            claimed.insert(ip, name.clone());
            wanted.push((name.clone(), ip));
        }
    }
    let mut load: BTreeMap<&str, usize> = BTreeMap::new();
    let mut used: BTreeSet<(String, &str)> = BTreeSet::new();
    let mut chosen: BTreeMap<(String, IpAddr), &str> = BTreeMap::new();
    let fits = |node: &Candidate, ip: &IpAddr| {
        node.eligible.is_ok() && node.subnets.iter().any(|s| s.contains(ip))
    };
    // Current holders first: an address stays where it is while that node can hold it.
    for (object, ip) in &wanted {
        let Some(holder) = current.get(ip) else {
            continue;
        };
        if let Some(node) = nodes.iter().find(|n| &n.name == holder)
            && fits(node, ip)
            && !used.contains(&(object.clone(), node.name.as_str()))
        {
            used.insert((object.clone(), node.name.as_str()));
            *load.entry(node.name.as_str()).or_default() += 1;
            chosen.insert((object.clone(), *ip), node.name.as_str());
        }
    }
    for (object, ip) in &wanted {
        if chosen.contains_key(&(object.clone(), *ip)) {
            continue;
        }
        let best = nodes
            .iter()
            .filter(|n| fits(n, ip) && !used.contains(&(object.clone(), n.name.as_str())))
            .min_by_key(|n| (load.get(n.name.as_str()).copied().unwrap_or(0), &n.name));
        match best {
            Some(node) => {
                used.insert((object.clone(), node.name.as_str()));
                *load.entry(node.name.as_str()).or_default() += 1;
                chosen.insert((object.clone(), *ip), node.name.as_str());
            }
            None => assignment
                .problems
                .push(unplaced(object, *ip, nodes, &used)),
        }
    }
    for (object, ip) in &wanted {
        if let Some(node) = chosen.get(&(object.clone(), *ip)) {
            assignment
                .items
                .entry(object.clone())
                .or_default()
                .push((*ip, (*node).to_owned()));
        }
    }
    assignment
}

/// Why no node could take `ip` of `object`.
fn unplaced(
    object: &str,
    ip: IpAddr,
    nodes: &[Candidate],
    used: &BTreeSet<(String, &str)>,
) -> Problem {
    let in_subnet: Vec<&Candidate> = nodes
        .iter()
        .filter(|n| n.subnets.iter().any(|s| s.contains(&ip)))
        .collect();
    let (reason, message) = if in_subnet.is_empty() {
        (
            Reason::NoSubnet,
            format!("{ip} is in no node's subnet; not assigned"),
        )
    } else {
        let why: Vec<String> = in_subnet
            .iter()
            .map(|n| match &n.eligible {
                Err(why) => format!("{}: {why}", n.name),
                Ok(()) if used.contains(&(object.to_owned(), n.name.as_str())) => {
                    format!("{}: holds another of its addresses", n.name)
                }
                Ok(()) => format!("{}: available", n.name),
            })
            .collect();
        (
            Reason::NoNode,
            format!(
                "{ip}: more addresses than assignable nodes in its subnet ({}); not assigned",
                why.join(", ")
            ),
        )
    };
    Problem {
        object: object.to_owned(),
        ip,
        reason,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(name: &str, ips: &[&str]) -> Arc<EgressIP> {
        let mut object = EgressIP::new(
            name,
            crate::api::egressip::EgressIpSpec {
                egress_ips: ips.iter().map(|s| (*s).to_owned()).collect(),
                ..Default::default()
            },
        );
        object.metadata.name = Some(name.to_owned());
        Arc::new(object)
    }

    fn node(name: &str, address: &str, subnet: &str) -> Candidate {
        Candidate {
            name: name.to_owned(),
            addresses: vec![address.parse().unwrap()],
            subnets: vec![subnet.parse().unwrap()],
            eligible: Ok(()),
        }
    }

    fn three_nodes() -> Vec<Candidate> {
        vec![
            node("a", "10.99.0.1", "10.99.0.0/24"),
            node("b", "10.99.0.2", "10.99.0.0/24"),
            node("c", "10.99.0.3", "10.99.0.0/24"),
        ]
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn an_objects_addresses_go_to_distinct_nodes_balanced_by_count() {
        let objects = [
            object("one", &["10.99.0.50", "10.99.0.51"]),
            object("two", &["10.99.0.60"]),
        ];
        let assignment = assign(&objects, &three_nodes(), &BTreeMap::new());
        assert_eq!(assignment.problems, []);
        assert_eq!(
            assignment.items["one"],
            [
                (ip("10.99.0.50"), "a".into()),
                (ip("10.99.0.51"), "b".into())
            ]
        );
        assert_eq!(assignment.items["two"], [(ip("10.99.0.60"), "c".into())]);
    }

    #[test]
    fn a_holder_keeps_its_address_and_a_lost_node_is_replaced() {
        let objects = [object("one", &["10.99.0.50"])];
        let current = BTreeMap::from([(ip("10.99.0.50"), "c".to_owned())]);
        let kept = assign(&objects, &three_nodes(), &current);
        assert_eq!(kept.items["one"], [(ip("10.99.0.50"), "c".into())]);
        let mut nodes = three_nodes();
        nodes[2].eligible = Err("not answering its probes".into());
        let moved = assign(&objects, &nodes, &current);
        assert_eq!(moved.items["one"], [(ip("10.99.0.50"), "a".into())]);
    }

    #[test]
    fn bad_addresses_are_named_and_left_unassigned() {
        let objects = [
            object("first", &["10.99.0.50"]),
            object("second", &["10.99.0.50", "192.168.7.7", "10.99.0.2"]),
        ];
        let assignment = assign(&objects, &three_nodes(), &BTreeMap::new());
        assert_eq!(assignment.items["first"], [(ip("10.99.0.50"), "a".into())]);
        assert_eq!(assignment.items["second"], []);
        let reasons: Vec<(&str, Reason)> = assignment
            .problems
            .iter()
            .map(|p| (p.object.as_str(), p.reason))
            .collect();
        assert_eq!(
            reasons,
            [
                ("second", Reason::Duplicate),
                ("second", Reason::NodeAddress),
                ("second", Reason::NoSubnet),
            ]
        );
        assert!(
            assignment.problems[1]
                .message
                .contains("node b's own address")
        );
    }

    #[test]
    fn more_addresses_than_assignable_nodes_leaves_the_rest_with_a_message() {
        let objects = [object("many", &["10.99.0.50", "10.99.0.51", "10.99.0.52"])];
        let mut nodes = three_nodes();
        nodes[1].eligible = Err("not labelled k8s.ovn.org/egress-assignable".into());
        let assignment = assign(&objects, &nodes, &BTreeMap::new());
        assert_eq!(
            assignment.items["many"],
            [
                (ip("10.99.0.50"), "a".into()),
                (ip("10.99.0.51"), "c".into())
            ]
        );
        assert_eq!(assignment.problems.len(), 1);
        let problem = &assignment.problems[0];
        assert_eq!(problem.reason, Reason::NoNode);
        assert!(
            problem.message.contains("b: not labelled"),
            "{}",
            problem.message
        );
        assert!(
            problem.message.contains("a: holds another"),
            "{}",
            problem.message
        );
    }
}
