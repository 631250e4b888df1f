//! Node subnets where the cluster gives none: OVN-Kubernetes' cluster manager allocates each
//! node's pod subnets from the cluster networks and their `hostPrefix` and writes them in the
//! node's `k8s.ovn.org/node-subnets` annotation (OpenShift runs no kube-controller-manager
//! allocation for this), and a Windows node's hybrid overlay subnet from the hybrid cluster
//! network in `k8s.ovn.org/hybrid-overlay-node-subnet`. The egress IP controller's leader does
//! the same here (pure allocation in this module; the writes in the controller). What is
//! allocated lives only in the Nodes' annotations: a new leader reads it back, so allocations
//! survive a failover, and a deleted Node's subnets are free again with it.
//!
//! Nodes with `spec.podCIDRs` (kube-controller-manager's, or given by hand) keep them and
//! hold them against allocation; a node's annotation is kept while it is a whole subnet of
//! the right size inside a cluster network and no earlier node (by creation, then name) holds
//! it; otherwise the node gets the lowest free subnet of each family.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;

use super::hybrid::{NODE_SUBNET_ANNOTATION as HYBRID_SUBNET_ANNOTATION, is_hybrid_node};
pub use crate::api::network::SubnetPool;

/// The node's pod subnets as OVN-Kubernetes' cluster manager writes them.
pub const NODE_SUBNETS_ANNOTATION: &str = "k8s.ovn.org/node-subnets";

/// Candidate subnets tried per network and node before the network counts as full: bounds the
/// work of one round whatever a network's size (a /8 of /30s has four million).
const MAX_CANDIDATES: u64 = 1 << 20;

/// The subnets of a `k8s.ovn.org/node-subnets` value (`{"default":["10.244.1.0/24", ...]}`,
/// or one string as older releases wrote it).
pub fn parse_node_subnets(text: &str) -> Result<Vec<IpNet>, String> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("{NODE_SUBNETS_ANNOTATION}: {e}"))?;
    let texts: Vec<&str> = match &value["default"] {
        serde_json::Value::String(one) => vec![one.as_str()],
        serde_json::Value::Array(many) => many.iter().filter_map(|v| v.as_str()).collect(),
        _ => {
            return Err(format!(
                "{NODE_SUBNETS_ANNOTATION}: no \"default\" network subnets in {text:?}"
            ));
        }
    };
    texts
        .iter()
        .map(|t| {
            t.parse::<IpNet>()
                .map(|n| n.trunc())
                .map_err(|_| format!("{NODE_SUBNETS_ANNOTATION}: {t:?} is not a CIDR"))
        })
        .collect()
}

/// The annotation's value for `subnets`.
pub fn format_node_subnets(subnets: &[IpNet]) -> String {
    serde_json::json!({ "default": subnets.iter().map(|s| s.to_string()).collect::<Vec<_>>() })
        .to_string()
}

/// One annotation to write on a Node (a merge patch of that key alone).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NodeAnnotation {
    pub node: String,
    pub key: &'static str,
    pub value: String,
}

/// What one round decided: the annotations to write, and a line per node that could not get
/// a subnet (a full network), naming it.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Allocation {
    pub writes: Vec<NodeAnnotation>,
    pub problems: Vec<String>,
}

/// The annotations that give every node without `spec.podCIDRs` its pod subnets from `pools`
/// (one per family that has a pool), and every Windows node its hybrid overlay subnet from
/// `hybrid`; only those whose value must change.
pub fn allocate(
    nodes: &[Arc<Node>],
    pools: &[SubnetPool],
    hybrid: Option<SubnetPool>,
) -> Allocation {
    let mut ordered: Vec<&Node> = nodes.iter().map(|n| &**n).collect();
    ordered.sort_by_key(|n| {
        (
            n.metadata
                .creation_timestamp
                .as_ref()
                .map_or(i64::MAX, |t| t.0.as_second()),
            n.metadata.name.clone().unwrap_or_default(),
        )
    });
    let mut pools: Vec<PoolTaken> = pools.iter().copied().map(PoolTaken::new).collect();
    let mut hybrid = hybrid.map(PoolTaken::new);
    for node in &ordered {
        for given in given_cidrs(node) {
            pools
                .iter_mut()
                .chain(hybrid.as_mut())
                .for_each(|p| p.hold(&given));
        }
    }
    let mut out = Allocation::default();
    // Kept first (in order, an earlier holder winning), so that no existing allocation moves
    // for a new node's sake.
    let mut kept: BTreeMap<String, Vec<IpNet>> = BTreeMap::new();
    for node in &ordered {
        let name = node.metadata.name.clone().unwrap_or_default();
        if is_hybrid_node(node) || !given_cidrs(node).is_empty() {
            continue;
        }
        let current = annotation(node, NODE_SUBNETS_ANNOTATION)
            .and_then(|t| parse_node_subnets(t).ok())
            .unwrap_or_default();
        let mut keep: Vec<IpNet> = Vec::new();
        for subnet in current {
            let family_kept = keep
                .iter()
                .any(|k| k.addr().is_ipv4() == subnet.addr().is_ipv4());
            if !family_kept && let Some(pool) = pools.iter_mut().find(|p| p.free(&subnet)) {
                pool.hold(&subnet);
                keep.push(subnet);
            }
        }
        kept.insert(name, keep);
    }
    for node in &ordered {
        let name = node.metadata.name.clone().unwrap_or_default();
        let Some(keep) = kept.get(&name) else {
            continue;
        };
        let mut subnets = keep.clone();
        for family_v4 in [true, false] {
            let has_pool = pools
                .iter()
                .any(|p| p.pool.network.addr().is_ipv4() == family_v4);
            if !has_pool || subnets.iter().any(|s| s.addr().is_ipv4() == family_v4) {
                continue;
            }
            let found = pools
                .iter_mut()
                .filter(|p| p.pool.network.addr().is_ipv4() == family_v4)
                .find_map(PoolTaken::take_lowest);
            match found {
                Some(subnet) => subnets.push(subnet),
                None => out.problems.push(format!(
                    "Node {name}: no free {} pod subnet left in the cluster networks; it gets none",
                    if family_v4 { "IPv4" } else { "IPv6" }
                )),
            }
        }
        subnets.sort_by_key(|s| !s.addr().is_ipv4());
        let value = format_node_subnets(&subnets);
        if !subnets.is_empty() && annotation(node, NODE_SUBNETS_ANNOTATION) != Some(value.as_str())
        {
            out.writes.push(NodeAnnotation {
                node: name,
                key: NODE_SUBNETS_ANNOTATION,
                value,
            });
        }
    }
    if let Some(pool) = &mut hybrid {
        allocate_hybrid(&ordered, pool, &mut out);
    }
    out.writes.sort();
    out
}

/// Windows nodes' hybrid overlay subnets: each keeps a valid one, the others get the lowest
/// free one.
fn allocate_hybrid(ordered: &[&Node], pool: &mut PoolTaken, out: &mut Allocation) {
    let mut needing = Vec::new();
    for node in ordered.iter().filter(|n| is_hybrid_node(n)) {
        let current = annotation(node, HYBRID_SUBNET_ANNOTATION)
            .and_then(|t| t.parse::<IpNet>().ok())
            .map(|n| n.trunc());
        match current {
            Some(subnet) if pool.free(&subnet) => pool.hold(&subnet),
            _ => needing.push(node),
        }
    }
    for node in needing {
        let name = node.metadata.name.clone().unwrap_or_default();
        match pool.take_lowest() {
            Some(subnet) => out.writes.push(NodeAnnotation {
                node: name,
                key: HYBRID_SUBNET_ANNOTATION,
                value: subnet.to_string(),
            }),
            None => out.problems.push(format!(
                "Node {name}: no free hybrid overlay subnet left in the hybrid cluster network; it gets none"
            )),
        }
    }
}

/// One pool's node subnets by index (the subnet's offset in the network over its size), the
/// held ones marked: a check or a hold is a set operation, and the lowest free one is found
/// from a cursor that only moves up within a round (nothing is freed during one), so a round
/// costs the number of subnets it looks at once, not that times the nodes.
struct PoolTaken {
    pool: SubnetPool,
    held: BTreeSet<u128>,
    /// No free subnet is below this index.
    cursor: u128,
}

impl PoolTaken {
    fn new(pool: SubnetPool) -> Self {
        Self {
            pool: SubnetPool {
                network: pool.network.trunc(),
                host_prefix: pool.host_prefix,
            },
            held: BTreeSet::new(),
            cursor: 0,
        }
    }

    /// How many node subnets the pool has (at most [`MAX_CANDIDATES`] looked at).
    fn size(&self) -> u128 {
        let bits = u32::from(
            self.pool
                .host_prefix
                .saturating_sub(self.pool.network.prefix_len()),
        );
        1u128
            .checked_shl(bits)
            .unwrap_or(u128::MAX)
            .min(u128::from(MAX_CANDIDATES))
    }

    fn width(&self) -> u32 {
        u32::from(self.pool.network.max_prefix_len() - self.pool.host_prefix)
    }

    fn offset(&self, addr: std::net::IpAddr) -> Option<u128> {
        let value = |a: std::net::IpAddr| match a {
            std::net::IpAddr::V4(v4) => u128::from(u32::from(v4)),
            std::net::IpAddr::V6(v6) => u128::from(v6),
        };
        let base = value(self.pool.network.network());
        value(addr)
            .checked_sub(base)
            .map(|o| o.checked_shr(self.width()).unwrap_or(0))
    }

    fn subnet(&self, index: u128) -> Option<IpNet> {
        let shifted = index.checked_shl(self.width())?;
        let addr = match self.pool.network.network() {
            std::net::IpAddr::V4(v4) => {
                let raw = u32::from(v4).checked_add(u32::try_from(shifted).ok()?)?;
                std::net::IpAddr::V4(raw.into())
            }
            std::net::IpAddr::V6(v6) => {
                std::net::IpAddr::V6(u128::from(v6).checked_add(shifted)?.into())
            }
        };
        IpNet::new(addr, self.pool.host_prefix).ok()
    }

    /// Whether `subnet` is one of this pool's node subnets and nobody holds it.
    fn free(&self, subnet: &IpNet) -> bool {
        fits(&self.pool, subnet)
            && self
                .offset(subnet.network())
                .is_some_and(|i| !self.held.contains(&i))
    }

    /// Marks every node subnet of this pool that `net` overlaps as held.
    fn hold(&mut self, net: &IpNet) {
        let net = net.trunc();
        if net.addr().is_ipv4() != self.pool.network.addr().is_ipv4() {
            return;
        }
        if !(self.pool.network.contains(&net) || net.contains(&self.pool.network)) {
            return;
        }
        let first = if net.contains(&self.pool.network) {
            0
        } else {
            self.offset(net.network()).unwrap_or(0)
        };
        // A net wider than one node subnet covers several of them.
        let covered = if net.prefix_len() >= self.pool.host_prefix {
            1
        } else {
            1u128
                .checked_shl(u32::from(self.pool.host_prefix - net.prefix_len()))
                .unwrap_or(u128::MAX)
        };
        let end = first.saturating_add(covered).min(self.size());
        let mut index = first;
        while index < end {
            self.held.insert(index);
            index += 1;
        }
    }

    /// The lowest free node subnet, now held.
    fn take_lowest(&mut self) -> Option<IpNet> {
        let size = self.size();
        while self.cursor < size {
            let index = self.cursor;
            self.cursor += 1;
            if self.held.insert(index) {
                return self.subnet(index);
            }
        }
        None
    }
}

/// `spec.podCIDRs` (or `spec.podCIDR`) as given to the node, truncated.
fn given_cidrs(node: &Node) -> Vec<IpNet> {
    let spec = node.spec.as_ref();
    let texts: Vec<String> = match spec.and_then(|s| s.pod_cidrs.clone()) {
        Some(cidrs) if !cidrs.is_empty() => cidrs,
        _ => spec.and_then(|s| s.pod_cidr.clone()).into_iter().collect(),
    };
    texts
        .iter()
        .filter_map(|t| t.parse::<IpNet>().ok())
        .map(|n| n.trunc())
        .collect()
}

fn annotation<'a>(node: &'a Node, key: &str) -> Option<&'a str> {
    node.metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

/// Whether `subnet` is one of `pool`'s node subnets.
fn fits(pool: &SubnetPool, subnet: &IpNet) -> bool {
    subnet.prefix_len() == pool.host_prefix && pool.network.contains(subnet)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, created: i64, yaml_extra: &str) -> Arc<Node> {
        let text = format!(
            "metadata: {{name: {name}, creationTimestamp: '{}'{yaml_extra}}}\n",
            jiff_time(created)
        );
        Arc::new(serde_yaml::from_str(&text).expect("node"))
    }

    fn jiff_time(second: i64) -> String {
        format!("2026-01-01T00:00:{:02}Z", second)
    }

    fn pool(network: &str, host_prefix: u8) -> SubnetPool {
        SubnetPool {
            network: network.parse().unwrap(),
            host_prefix,
        }
    }

    #[test]
    fn nodes_without_pod_cidrs_get_the_lowest_free_subnets_and_keep_them() {
        let pools = [pool("10.128.0.0/14", 23), pool("fd01::/48", 64)];
        let nodes = vec![
            // Given by kube-controller-manager: held, never annotated.
            Arc::new(
                serde_yaml::from_str::<Node>(
                    "metadata: {name: a, creationTimestamp: '2026-01-01T00:00:01Z'}\nspec: {podCIDRs: [10.128.0.0/23]}\n",
                )
                .unwrap(),
            ),
            // Keeps its valid annotation.
            node(
                "b",
                2,
                ", annotations: {k8s.ovn.org/node-subnets: '{\"default\":[\"10.128.4.0/23\",\"fd01:0:0:4::/64\"]}'}",
            ),
            node("c", 3, ""),
            // A wrong size: replaced.
            node(
                "d",
                4,
                ", annotations: {k8s.ovn.org/node-subnets: '{\"default\":\"10.128.8.0/24\"}'}",
            ),
        ];
        let allocation = allocate(&nodes, &pools, None);
        assert!(allocation.problems.is_empty(), "{:?}", allocation.problems);
        let written: Vec<(String, String)> = allocation
            .writes
            .iter()
            .map(|w| (w.node.clone(), w.value.clone()))
            .collect();
        assert_eq!(
            written,
            [
                (
                    "c".to_owned(),
                    "{\"default\":[\"10.128.2.0/23\",\"fd01::/64\"]}".to_owned()
                ),
                (
                    "d".to_owned(),
                    "{\"default\":[\"10.128.6.0/23\",\"fd01:0:0:1::/64\"]}".to_owned()
                ),
            ]
        );
        // Written back, the next round writes nothing (and a new leader would agree).
        let settled: Vec<Arc<Node>> = nodes
            .iter()
            .map(|n| {
                let mut n = (**n).clone();
                if let Some(w) = allocation
                    .writes
                    .iter()
                    .find(|w| Some(&w.node) == n.metadata.name.as_ref())
                {
                    n.metadata
                        .annotations
                        .get_or_insert_with(Default::default)
                        .insert(w.key.to_owned(), w.value.clone());
                }
                Arc::new(n)
            })
            .collect();
        assert_eq!(allocate(&settled, &pools, None), Allocation::default());
        // A deleted node's subnets go to the next node that needs one.
        let mut after: Vec<Arc<Node>> = settled
            .iter()
            .filter(|n| n.metadata.name.as_deref() != Some("c"))
            .cloned()
            .collect();
        after.push(node("e", 9, ""));
        let allocation = allocate(&after, &pools, None);
        assert_eq!(
            allocation.writes[0].value,
            "{\"default\":[\"10.128.2.0/23\",\"fd01::/64\"]}"
        );
    }

    #[test]
    fn a_full_network_is_named_and_two_claims_of_one_subnet_go_to_the_older_node() {
        let pools = [pool("10.0.0.0/24", 25)];
        let claim = ", annotations: {k8s.ovn.org/node-subnets: '{\"default\":[\"10.0.0.0/25\"]}'}";
        let nodes = vec![
            node("old", 1, claim),
            node("new", 2, claim),
            node("third", 3, ""),
        ];
        let allocation = allocate(&nodes, &pools, None);
        assert_eq!(allocation.writes.len(), 1);
        assert_eq!(allocation.writes[0].node, "new");
        assert_eq!(
            allocation.writes[0].value,
            "{\"default\":[\"10.0.0.128/25\"]}"
        );
        assert_eq!(
            allocation.problems,
            ["Node third: no free IPv4 pod subnet left in the cluster networks; it gets none"]
        );
    }

    #[test]
    fn windows_nodes_get_hybrid_overlay_subnets() {
        let windows = ", labels: {kubernetes.io/os: windows}";
        let nodes = vec![
            node("linux", 1, ""),
            node(
                "win1",
                2,
                ", labels: {kubernetes.io/os: windows}, annotations: {k8s.ovn.org/hybrid-overlay-node-subnet: 10.132.0.0/24}",
            ),
            node("win2", 3, windows),
        ];
        let allocation = allocate(
            &nodes,
            &[pool("10.128.0.0/14", 23)],
            Some(pool("10.132.0.0/14", 24)),
        );
        let written: Vec<(&str, &str, &str)> = allocation
            .writes
            .iter()
            .map(|w| (w.node.as_str(), w.key, w.value.as_str()))
            .collect();
        assert_eq!(
            written,
            [
                (
                    "linux",
                    NODE_SUBNETS_ANNOTATION,
                    "{\"default\":[\"10.128.0.0/23\"]}"
                ),
                ("win2", HYBRID_SUBNET_ANNOTATION, "10.132.1.0/24"),
            ]
        );
        assert_eq!(
            parse_node_subnets("{\"default\":\"10.1.0.0/24\"}").unwrap(),
            ["10.1.0.0/24".parse::<IpNet>().unwrap()]
        );
        assert!(parse_node_subnets("{}").is_err());
    }
}
