//! Which endpoints this node's flows go to when the endpoints carry topology hints (written by
//! the EndpointSlice controller for `trafficDistribution: PreferClose` and topology-aware
//! routing): the node as the compile sees it, and kube-proxy's choice of same-node, same-zone
//! or all endpoints.

use std::sync::Arc;

use k8s_openapi::api::{core::v1::Node, discovery::v1::Endpoint};

/// This node as the Service compile reads it: its name (the endpoints that `Local` traffic
/// policies keep, same-node hints) and its `topology.kubernetes.io/zone` (same-zone hints).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalNode {
    pub name: String,
    pub zone: Option<String>,
}

impl LocalNode {
    /// A node without a zone.
    pub fn named(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            zone: None,
        }
    }

    /// Node `name` as `nodes` has it (no zone when it is not there, or has no zone label).
    pub fn from_nodes<'a>(nodes: impl IntoIterator<Item = &'a Arc<Node>>, name: &str) -> Self {
        let zone = nodes
            .into_iter()
            .find(|node| node.metadata.name.as_deref() == Some(name))
            .and_then(|node| node.metadata.labels.as_ref()?.get(ZONE_LABEL).cloned());
        Self {
            name: name.to_owned(),
            zone,
        }
    }
}

/// The label that names a node's zone, which same-zone hints are matched against.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// Which of a service port's ready endpoints this node uses, from their hints.
pub(super) enum Topology {
    /// Those hinted for this node (`hints.forNodes`).
    SameNode,
    /// Those hinted for this node's zone (`hints.forZones`).
    SameZone(String),
}

/// kube-proxy's choice: the same node when every ready endpoint has a node hint and one names
/// this node; else the same zone when every ready endpoint has a zone hint and one names this
/// node's zone; else none (every ready endpoint), which is also what a node without a zone
/// label gets. Endpoints without hints (a slice controller that wrote none, a Service without
/// `trafficDistribution`) leave every endpoint in use.
pub(super) fn topology_of<T>(
    hinted: &[(T, Vec<&str>, Vec<&str>)],
    node: &LocalNode,
) -> Option<Topology> {
    let all_node_hinted = hinted.iter().all(|(_, _, nodes)| !nodes.is_empty());
    if all_node_hinted
        && hinted
            .iter()
            .any(|(_, _, nodes)| nodes.contains(&node.name.as_str()))
    {
        return Some(Topology::SameNode);
    }
    let zone = node.zone.as_deref()?;
    let all_zone_hinted = hinted.iter().all(|(_, zones, _)| !zones.is_empty());
    (all_zone_hinted && hinted.iter().any(|(_, zones, _)| zones.contains(&zone)))
        .then(|| Topology::SameZone(zone.to_owned()))
}

/// The zones an endpoint is hinted for.
pub(super) fn zone_hints(endpoint: &Endpoint) -> Vec<&str> {
    endpoint
        .hints
        .as_ref()
        .and_then(|h| h.for_zones.as_ref())
        .into_iter()
        .flatten()
        .map(|z| z.name.as_str())
        .collect()
}

/// The nodes an endpoint is hinted for.
pub(super) fn node_hints(endpoint: &Endpoint) -> Vec<&str> {
    endpoint
        .hints
        .as_ref()
        .and_then(|h| h.for_nodes.as_ref())
        .into_iter()
        .flatten()
        .map(|n| n.name.as_str())
        .collect()
}
