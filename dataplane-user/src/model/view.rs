//! The node views every feature compiles from: the cluster's nodes as the overlay needs them,
//! this node's pods and its underlay NIC.

use std::{net::IpAddr, sync::Arc};

use dataplane_common::overlay::{FAMILY_IPV4, FAMILY_IPV6, TUNNEL_GENEVE, TunnelEndpoint};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;

use crate::{
    mapsync::addr16,
    seq::{Seq, shared_run},
};

/// A cluster node as the overlay needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeView {
    pub name: String,
    /// Underlay addresses (Node status InternalIP), at most one per family used.
    pub addresses: Vec<IpAddr>,
    /// Node spec.podCIDRs.
    pub pod_cidrs: Vec<IpNet>,
    /// When the Node object was made (`metadata.creationTimestamp`, seconds since the epoch;
    /// `i64::MAX` unknown): of two nodes claiming one pod CIDR, the older keeps it.
    pub created: i64,
}

impl NodeView {
    /// The node's underlay address of IPv4 (the first, as every feature takes it).
    pub fn first_v4(&self) -> Option<std::net::Ipv4Addr> {
        first_v4(&self.addresses)
    }

    /// The node's underlay address of IPv6 (the first, as every feature takes it).
    pub fn first_v6(&self) -> Option<std::net::Ipv6Addr> {
        first_v6(&self.addresses)
    }

    /// Its first address of each family: where this node serves its NodePorts by default and
    /// what its overlay sends from.
    pub fn primary_addresses(&self) -> Vec<IpAddr> {
        let v4 = self.first_v4().map(IpAddr::V4);
        let v6 = self.first_v6().map(IpAddr::V6);
        v4.into_iter().chain(v6).collect()
    }
}

/// The first IPv4 address of `addresses`.
pub fn first_v4(addresses: &[IpAddr]) -> Option<std::net::Ipv4Addr> {
    addresses.iter().find_map(|a| match a {
        IpAddr::V4(v4) => Some(*v4),
        IpAddr::V6(_) => None,
    })
}

/// The first IPv6 address of `addresses`.
pub fn first_v6(addresses: &[IpAddr]) -> Option<std::net::Ipv6Addr> {
    addresses.iter().find_map(|a| match a {
        IpAddr::V6(v6) => Some(*v6),
        IpAddr::V4(_) => None,
    })
}

/// A pod on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalPodView {
    pub name: String,
    pub addresses: Vec<IpAddr>,
    pub pod_mac: [u8; 6],
    pub host_ifindex: u32,
    pub host_mac: [u8; 6],
    /// The pod's end takes frames from XDP: decapsulated frames may go straight in.
    pub takes_xdp: bool,
}

/// This node's underlay NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Underlay {
    pub ifindex: u32,
    pub mac: [u8; 6],
    /// Whether XDP may send NodePort packets to remote backends itself (`--xdp-forward`).
    pub xdp_forward: bool,
    /// NodePorts are served on the addresses `--nodeport-addresses` selects (the services
    /// stage writes them), not on the node's address of each family.
    pub nodeport_listed: bool,
    pub mtu: u32,
}

/// The cluster's nodes' views, in the sources' order (by name; a manifest directory's in its
/// files' order). A persistent sequence, shared: a Node added among 5,000 copies the chunk of
/// its slot, where an ordinary vector was copied whole (touching every view's count) and
/// `imbl::Vector` joined two trees (node names are not added at the end).
pub type NodeSeq = Seq<Arc<NodeView>>;
pub type NodeList = Arc<NodeSeq>;

/// The node named `name` among `nodes`: a binary search where the list is in name order (the
/// API source's), a walk where that search misses (a manifest directory's order, or no such
/// node). A sync looks this node up several times, and walking 5,000 names each time was a
/// tenth of a node change.
pub fn node_named<'a>(nodes: &'a NodeSeq, name: &str) -> Option<&'a Arc<NodeView>> {
    match nodes.binary_search_by(|n| n.name.as_str().cmp(name)) {
        Ok(i) if nodes[i].name == name => Some(&nodes[i]),
        _ => nodes.iter().find(|n| n.name == name),
    }
}

/// The `InternalIP` entries of a Node's `status.addresses`, as written.
pub fn internal_ips(node: &Node) -> impl Iterator<Item = &str> {
    node.status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP")
        .map(|a| a.address.as_str())
}

/// The tunnel endpoint of a node at `address` (Geneve, the family of the address).
pub fn endpoint(address: IpAddr) -> TunnelEndpoint {
    TunnelEndpoint {
        addr: addr16(address),
        family: if address.is_ipv4() {
            FAMILY_IPV4
        } else {
            FAMILY_IPV6
        },
        kind: TUNNEL_GENEVE,
        _pad: [0; 2],
    }
}

/// The views that left `old` and those that came in `new` (a changed node is in both), found
/// by one walk down both lists in name order, the views kept from one build to the next
/// being the same objects. `old` must be in strict name order ([`in_name_order`]: its user
/// knows from when it took it); `None` if `new` is not. That is checked on the way, where it
/// is not already known: two views of `new` that are views of `old` follow each other in
/// `old`'s order, so only the pairs with a new or changed view are compared (5,000 names
/// compared twice a node change, for both lists, was a tenth of it).
pub type NodeChanges<'a> = (Vec<&'a Arc<NodeView>>, Vec<&'a Arc<NodeView>>);

pub fn node_changes<'a>(old: &'a NodeSeq, new: &'a NodeSeq) -> Option<NodeChanges<'a>> {
    let (mut gone, mut come) = (Vec::new(), Vec::new());
    // Runs of views both lists share are passed a chunk at a time (`seq::shared_run`):
    // two versions of 5,000 nodes share all but the chunk a change copied. The few views
    // between are looked up by position.
    let (mut old_cursor, mut new_cursor) = (old.cursor(), new.cursor());
    let (mut i, mut j) = (0, 0);
    // The last view of `new` walked, and whether it was `old`'s.
    let mut previous: Option<(&Arc<NodeView>, bool)> = None;
    let mut step = |view: &'a Arc<NodeView>, kept: bool| {
        let ordered = match previous {
            Some((_, true)) if kept => true,
            Some((before, _)) => before.name < view.name,
            None => true,
        };
        previous = Some((view, kept));
        ordered
    };
    loop {
        let shared = shared_run(&mut old_cursor, i, &mut new_cursor, j);
        if shared > 0 {
            // The run's first view is ordered after what came before it; the rest follow
            // `old`'s order, and the last is what the next view is ordered after.
            let (first, last) = (&new[j], &new[j + shared - 1]);
            if !step(first, true) || !step(last, true) {
                return None;
            }
            i += shared;
            j += shared;
            continue;
        }
        match (old.get(i), new.get(j)) {
            (Some(a), Some(b)) if a.name == b.name => {
                if !step(b, false) {
                    return None;
                }
                if a != b {
                    gone.push(a);
                    come.push(b);
                }
                i += 1;
                j += 1;
            }
            (Some(a), Some(b)) if a.name < b.name => {
                gone.push(a);
                i += 1;
            }
            (Some(a), None) => {
                gone.push(a);
                i += 1;
            }
            (_, Some(b)) => {
                if !step(b, false) {
                    return None;
                }
                come.push(b);
                j += 1;
            }
            (None, None) => break,
        }
    }
    Some((gone, come))
}

/// Whether `nodes` is in strict name order (the sources' order; a manifest directory's lists
/// are in its files' order).
pub fn in_name_order(nodes: &NodeSeq) -> bool {
    nodes
        .iter()
        .zip(nodes.iter().skip(1))
        .all(|(a, b)| a.name < b.name)
}
