//! What multicast this node serves (pure): the settings, and from the cluster state the
//! enabled namespaces' local pods and the peer nodes that may have members.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::PathBuf,
    time::Duration,
};

use dataplane_common::{multicast::namespace_id, overlay::TunnelEndpoint};

use crate::{
    model::{OverlayView, endpoint, in_pod_network},
    source::ClusterState,
};

/// The Namespace annotation that enables multicast for its pods (as in OVN-Kubernetes).
pub const ENABLED_ANNOTATION: &str = "k8s.ovn.org/multicast-enabled";
/// How long a pod is given to answer a query (IGMP's default: 10 s).
pub(super) const MAX_RESPONSE: Duration = Duration::from_secs(10);

/// The agent's multicast settings (command line).
#[derive(Clone, Debug)]
pub struct Settings {
    /// Between general queries (IGMP's default: 125 s).
    pub query_interval: Duration,
    /// The UDP port of the membership announcements between agents.
    pub peer_port: u16,
    /// Between two announcements of an unchanged list.
    pub announce_every: Duration,
    /// The cluster's key (the egress IP probes' Secret): announcements are signed with it,
    /// and, while it is there, only signed ones are believed.
    pub key_file: Option<PathBuf>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            query_interval: Duration::from_secs(125),
            peer_port: 6083,
            announce_every: Duration::from_secs(10),
            key_file: None,
        }
    }
}

impl Settings {
    /// How long a membership lasts without a report: robustness (2) query intervals plus the
    /// query response time (260 s by default).
    pub fn membership_timeout(&self) -> Duration {
        self.query_interval * 2 + MAX_RESPONSE
    }

    /// How long another node's groups last without an announcement.
    pub(super) fn peer_hold(&self) -> Duration {
        self.announce_every * 3
    }
}

/// A local pod of an enabled namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanPod {
    /// `namespace/name`.
    pub name: String,
    pub namespace: String,
    pub host_mac: [u8; 6],
    pub ipv4: bool,
    pub ipv6: bool,
}

/// Another node this node exchanges announcements with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub address: IpAddr,
    pub endpoint: TunnelEndpoint,
}

/// What the cluster state asks of multicast on this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Enabled namespaces and their ids.
    pub namespaces: BTreeMap<String, u32>,
    /// Local pods of enabled namespaces, by host-side veth.
    pub pods: BTreeMap<u32, PlanPod>,
    /// Enabled namespaces with pods on this node: the ones it sends or receives for.
    pub local_namespaces: BTreeSet<String>,
    /// Other nodes hosting pods of those namespaces.
    pub peers: BTreeMap<String, Peer>,
    /// Every node's underlay addresses (whose announcements are believed).
    pub node_addresses: BTreeMap<IpAddr, String>,
    /// Enabled namespaces refused, one line each.
    pub errors: Vec<String>,
}

/// Whether a Namespace has enabled multicast.
fn enabled(namespace: &k8s_openapi::api::core::v1::Namespace) -> bool {
    namespace
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ENABLED_ANNOTATION))
        .is_some_and(|v| v == "true")
}

/// What multicast needs on this node, from the cluster state and this node's view.
pub fn plan(state: &ClusterState, view: &OverlayView) -> Plan {
    let mut plan = Plan::default();
    let mut by_id: BTreeMap<u32, String> = BTreeMap::new();
    let mut names: Vec<&str> = state
        .namespaces
        .iter()
        .filter(|ns| enabled(ns))
        .filter_map(|ns| ns.metadata.name.as_deref())
        .collect();
    names.sort_unstable();
    for name in names {
        let id = namespace_id(name.as_bytes());
        if let Some(other) = by_id.get(&id) {
            // Two namespaces one id would mix their groups: the second (by name) stays off.
            plan.errors.push(format!(
                "namespace {name}: annotation {ENABLED_ANNOTATION} refused: its id {id:#x} is \
                 also that of enabled namespace {other}"
            ));
            continue;
        }
        by_id.insert(id, name.to_owned());
        plan.namespaces.insert(name.to_owned(), id);
    }
    for pod in &view.local_pods {
        let (namespace, _) = pod.name.split_once('/').unwrap_or(("default", &pod.name));
        if !plan.namespaces.contains_key(namespace) || pod.host_ifindex == 0 {
            continue;
        }
        plan.local_namespaces.insert(namespace.to_owned());
        plan.pods.insert(
            pod.host_ifindex,
            PlanPod {
                name: pod.name.clone(),
                namespace: namespace.to_owned(),
                host_mac: pod.host_mac,
                ipv4: pod.addresses.iter().any(IpAddr::is_ipv4),
                ipv6: pod.addresses.iter().any(IpAddr::is_ipv6),
            },
        );
    }
    // Nothing to send or receive for here: no peer to know (and no work per change that
    // grows with the cluster).
    if plan.local_namespaces.is_empty() {
        return plan;
    }
    let this_family_v4 = view
        .this_node_view()
        .is_none_or(|n| n.addresses.iter().any(IpAddr::is_ipv4));
    let mut hosting: BTreeSet<&str> = BTreeSet::new();
    for pod in &state.pods {
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
        if !plan.local_namespaces.contains(namespace) || !in_pod_network(pod) {
            continue;
        }
        if let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
            hosting.insert(node);
        }
    }
    for node in view.nodes.iter() {
        for address in &node.addresses {
            plan.node_addresses.insert(*address, node.name.clone());
        }
        if node.name == view.this_node || !hosting.contains(node.name.as_str()) {
            continue;
        }
        // The underlay family the overlay reaches the node in.
        let address = node
            .addresses
            .iter()
            .find(|a| a.is_ipv4() == this_family_v4)
            .or(node.addresses.first());
        if let Some(address) = address {
            plan.peers.insert(
                node.name.clone(),
                Peer {
                    address: *address,
                    endpoint: endpoint(*address),
                },
            );
        }
    }
    plan
}
