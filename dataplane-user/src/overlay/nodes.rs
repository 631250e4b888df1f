//! The overlay maps' entries the cluster's nodes give: a tunnel route to each other node's pod
//! CIDRs and every node's address. At 5,000 nodes, building them is most of a node change's
//! work, so a compile changes the last one's entries node by node where it can
//! ([`NodeMaps::updated_for`]) and builds them from every node only where it must.

use std::{
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
};

use dataplane_common::overlay::{Addr, TunnelEndpoint, outside_bit_v4, outside_bit_v6};
use ipnet::IpNet;

use super::CompileError;
use crate::model::{first_v4, first_v6};
use crate::{
    api::network::overlaps,
    mapsync::addr16,
    model::{
        HybridView, NodeList, NodeSeq, NodeView, OverlayView, endpoint, hybrid, in_name_order,
        node_changes,
    },
};

/// A compile changes the last entries node by node while at most this fraction of the
/// nodes changed (one in four); past it, building them all again costs less.
const MOST_CHANGED_DIVISOR: usize = 4;

/// The nodes' entries, and what they were compiled from. Persistent maps (`imbl`): a node
/// change copies only the paths to its entries, where ordinary maps copied (and then freed)
/// every node's, 1.5 ms of a node added among 5,000; and what the last sync wrote is compared
/// without visiting what the two share.
#[derive(Clone, Debug, Default)]
pub struct NodeMaps {
    /// Other nodes' IPv4 pod CIDRs (and the hybrid nodes' subnets) and their tunnel endpoints.
    /// Changed through [`NodeMaps::insert_remote_v4`] and the like, which keep `outside`.
    pub remote_v4: imbl::OrdMap<(u32, [u8; 4]), TunnelEndpoint>,
    pub remote_v6: imbl::OrdMap<(u32, [u8; 16]), TunnelEndpoint>,
    /// The bits of the `OUTSIDE` bitmap the remote subnets clear.
    outside: OutsideBits,
    /// Every node's addresses (the value is unused).
    pub node_addrs: imbl::OrdMap<Addr, u32>,
    /// How many nodes name each address: one leaving takes it out only if no other has it.
    address_users: imbl::OrdMap<Addr, u32>,
    owners: PodCidrOwners,
    /// The node list, this node and hybrid view these entries are of.
    nodes: NodeList,
    /// Whether `nodes` is in strict name order (so a change can be followed node by node).
    nodes_in_order: bool,
    this_node: String,
    hybrid: Option<HybridView>,
    /// Nodes (and hybrid subnets) whose entries were refused, each with why: a node without
    /// an address, a pod CIDR another node holds first. One bad Node object costs only its
    /// own pods their routes; every other node's entries are made.
    pub rejected: imbl::OrdMap<String, String>,
}

/// How many remote pod subnets clear each bit of the `OUTSIDE` bitmap
/// (`overlay::outside_words`), kept with the entries: a node change moves the counts of its
/// own subnets' bits, where the bitmap was made from every remote subnet, twice (the wanted
/// and the last), at each node change: a tenth of a node added among 5,000.
#[derive(Clone, Debug, Default)]
struct OutsideBits {
    /// By the bit's word and mask.
    cleared: imbl::OrdMap<(u32, u64), u32>,
    /// IPv6 subnets shorter than /32, whose prefixes the bitmap's fold cannot list.
    short_v6: u32,
}

impl OutsideBits {
    /// Counts (`up`) or uncounts an IPv4 subnet: each /16 it spans.
    fn count_v4(&mut self, (prefix_len, network): (u32, [u8; 4]), up: bool) {
        let spanned: u32 = 1 << 16u32.saturating_sub(prefix_len);
        let first = (u32::from_be_bytes(network) >> 16) & !(spanned - 1);
        for high in first..first + spanned {
            self.count(outside_bit_v4((high << 16).to_be_bytes()), up);
        }
    }

    fn count_v6(&mut self, (prefix_len, network): (u32, [u8; 16]), up: bool) {
        if prefix_len < 32 {
            self.short_v6 = if up {
                self.short_v6 + 1
            } else {
                self.short_v6.saturating_sub(1)
            };
        } else {
            let first_four = [network[0], network[1], network[2], network[3]];
            self.count(outside_bit_v6(first_four), up);
        }
    }

    fn count(&mut self, bit: (u32, u64), up: bool) {
        let users = self.cleared.get(&bit).copied().unwrap_or(0);
        match (up, users) {
            (true, _) => {
                self.cleared.insert(bit, users + 1);
            }
            (false, 0 | 1) => {
                self.cleared.remove(&bit);
            }
            (false, _) => {
                self.cleared.insert(bit, users - 1);
            }
        }
    }
}

/// Entries are equal when the maps would hold the same.
impl PartialEq for NodeMaps {
    fn eq(&self, other: &Self) -> bool {
        self.remote_v4 == other.remote_v4
            && self.remote_v6 == other.remote_v6
            && self.node_addrs == other.node_addrs
            && self.rejected == other.rejected
    }
}

impl Eq for NodeMaps {}

impl NodeMaps {
    /// Routes the IPv4 subnet `key` (prefix length, network) to `endpoint`.
    pub fn insert_remote_v4(&mut self, key: (u32, [u8; 4]), endpoint: TunnelEndpoint) {
        if self.remote_v4.insert(key, endpoint).is_none() {
            self.outside.count_v4(key, true);
        }
    }

    pub fn remove_remote_v4(&mut self, key: (u32, [u8; 4])) {
        if self.remote_v4.remove(&key).is_some() {
            self.outside.count_v4(key, false);
        }
    }

    /// Routes the IPv6 subnet `key` (prefix length, network) to `endpoint`.
    pub fn insert_remote_v6(&mut self, key: (u32, [u8; 16]), endpoint: TunnelEndpoint) {
        if self.remote_v6.insert(key, endpoint).is_none() {
            self.outside.count_v6(key, true);
        }
    }

    pub fn remove_remote_v6(&mut self, key: (u32, [u8; 16])) {
        if self.remote_v6.remove(&key).is_some() {
            self.outside.count_v6(key, false);
        }
    }

    /// The `OUTSIDE` bitmap's bits (word, mask) that some remote subnet clears.
    pub fn outside_cleared(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.outside.cleared.keys().copied()
    }

    /// Whether a remote IPv6 subnet is shorter than /32 (every IPv6 bit is then clear).
    pub fn has_short_v6(&self) -> bool {
        self.outside.short_v6 > 0
    }

    /// The entries of every node of `view`, and of its hybrid nodes' subnets. A node that
    /// cannot be given entries is refused alone ([`NodeMaps::rejected`]). Where two nodes
    /// claim overlapping pod CIDRs, this node keeps its own, then the older Node object
    /// (then the first by name) keeps them: a Node made later cannot take another's pods'
    /// traffic by naming their CIDR.
    pub fn compile(view: &OverlayView) -> Self {
        let mut maps = NodeMaps {
            nodes: Arc::clone(&view.nodes),
            nodes_in_order: in_name_order(&view.nodes),
            this_node: view.this_node.clone(),
            hybrid: view.hybrid.clone(),
            ..NodeMaps::default()
        };
        let mut order: Vec<&Arc<NodeView>> = view.nodes.iter().collect();
        order.sort_by(|a, b| {
            (a.name != view.this_node, a.created, &a.name).cmp(&(
                b.name != view.this_node,
                b.created,
                &b.name,
            ))
        });
        for node in order {
            if let Err(error) = maps.add_node(node) {
                maps.rejected.insert(node.name.clone(), error.to_string());
            }
        }
        // Hybrid nodes' pod subnets, reached in VXLAN: never one of the nodes' own CIDRs.
        for ((prefix_len, network), endpoint) in hybrid::routes(view.hybrid.as_ref()) {
            let cidr = hybrid_cidr(prefix_len, network);
            if let Some(other) = maps.owners.overlapping(&cidr) {
                let node = format!("{} (hybrid)", hybrid_owner(view, &cidr));
                let error = CompileError::OverlappingPodCidr {
                    node: node.clone(),
                    other: other.to_owned(),
                    cidr,
                };
                maps.rejected.insert(node, error.to_string());
                continue;
            }
            maps.insert_remote_v4((prefix_len, network), endpoint);
        }
        maps
    }

    /// Takes the nodes these entries refused out of `view`, so that the stages after the
    /// overlay (egress IPs, access control, multicast) see the nodes the overlay accepted and
    /// nothing of a refused Node object. Nothing is copied when none was refused.
    pub fn drop_rejected_from(&self, view: &mut OverlayView) {
        if self.rejected.is_empty() {
            return;
        }
        let accepted: NodeSeq = view
            .nodes
            .iter()
            .filter(|n| !self.rejected.contains_key(&n.name))
            .cloned()
            .collect();
        view.nodes = Arc::new(accepted);
    }

    /// These entries changed to `view`'s nodes, one node at a time: `None` when that cannot
    /// be done (another node or hybrid view, lists out of name order, too many changes) or
    /// would fail (a node without address, an overlap), for [`NodeMaps::compile`] to do
    /// (and name the error) instead.
    pub fn updated_for(self: &Arc<Self>, view: &OverlayView) -> Option<Arc<Self>> {
        if self.this_node != view.this_node || self.hybrid != view.hybrid {
            return None;
        }
        if Arc::ptr_eq(&self.nodes, &view.nodes) {
            return Some(Arc::clone(self));
        }
        // With a node refused, who holds what depends on every node: compiled whole.
        if !self.nodes_in_order || !self.rejected.is_empty() {
            return None;
        }
        let (gone, come) = node_changes(&self.nodes, &view.nodes)?;
        if gone.is_empty() && come.is_empty() {
            return Some(Arc::clone(self));
        }
        if gone.len() + come.len() > view.nodes.len() / MOST_CHANGED_DIVISOR {
            return None;
        }
        let mut next = (**self).clone();
        next.nodes = Arc::clone(&view.nodes);
        for node in gone {
            next.remove_node(node);
        }
        let hybrid_routes = hybrid::routes(view.hybrid.as_ref());
        for node in come {
            let meets_hybrid = node.pod_cidrs.iter().any(|cidr| {
                hybrid_routes
                    .keys()
                    .any(|&(len, network)| overlaps(&hybrid_cidr(len, network), cidr))
            });
            if meets_hybrid {
                return None;
            }
            next.add_node(node).ok()?;
        }
        Some(Arc::new(next))
    }

    /// Adds `node`'s addresses, CIDRs and (for another node) routes; a node that cannot be
    /// added (no address, a CIDR another node holds) is refused whole, nothing of it added.
    fn add_node(&mut self, node: &Arc<NodeView>) -> Result<(), CompileError> {
        if node.addresses.is_empty() {
            return Err(CompileError::NodeWithoutAddress {
                node: node.name.clone(),
            });
        }
        for (index, cidr) in node.pod_cidrs.iter().enumerate() {
            let cidr = cidr.trunc();
            let other = self
                .owners
                .overlapping(&cidr)
                .map(str::to_owned)
                .or_else(|| {
                    // Its own CIDRs overlapping each other.
                    node.pod_cidrs[..index]
                        .iter()
                        .any(|earlier| overlaps(&earlier.trunc(), &cidr))
                        .then(|| node.name.clone())
                });
            if let Some(other) = other {
                return Err(CompileError::OverlappingPodCidr {
                    node: node.name.clone(),
                    other,
                    cidr,
                });
            }
        }
        for address in &node.addresses {
            let address = addr16(*address);
            self.node_addrs.insert(address, 0);
            *self.address_users.entry(address).or_insert(0) += 1;
        }
        for cidr in &node.pod_cidrs {
            let cidr = cidr.trunc();
            self.owners.insert(cidr, Arc::from(node.name.as_str()));
            if node.name == self.this_node {
                continue;
            }
            // Same family underlay if the node has one, else the other family.
            let endpoint = match cidr {
                IpNet::V4(_) => first_v4(&node.addresses)
                    .map(|a| endpoint(IpAddr::V4(a)))
                    .or_else(|| first_v6(&node.addresses).map(|a| endpoint(IpAddr::V6(a)))),
                IpNet::V6(_) => first_v6(&node.addresses)
                    .map(|a| endpoint(IpAddr::V6(a)))
                    .or_else(|| first_v4(&node.addresses).map(|a| endpoint(IpAddr::V4(a)))),
            };
            let Some(endpoint) = endpoint else { continue };
            match cidr {
                IpNet::V4(net) => {
                    self.insert_remote_v4(
                        (u32::from(net.prefix_len()), net.addr().octets()),
                        endpoint,
                    );
                }
                IpNet::V6(net) => {
                    self.insert_remote_v6(
                        (u32::from(net.prefix_len()), net.addr().octets()),
                        endpoint,
                    );
                }
            }
        }
        Ok(())
    }

    /// Takes out what [`NodeMaps::add_node`] put in for `node` (which it had accepted: its
    /// CIDRs were its own).
    fn remove_node(&mut self, node: &NodeView) {
        for address in &node.addresses {
            let address = addr16(*address);
            let users = self.address_users.get(&address).copied().unwrap_or(0);
            if users > 1 {
                self.address_users.insert(address, users - 1);
            } else {
                self.address_users.remove(&address);
                self.node_addrs.remove(&address);
            }
        }
        for cidr in &node.pod_cidrs {
            let cidr = cidr.trunc();
            self.owners.remove(&cidr);
            match cidr {
                IpNet::V4(net) => {
                    self.remove_remote_v4((u32::from(net.prefix_len()), net.addr().octets()));
                }
                IpNet::V6(net) => {
                    self.remove_remote_v6((u32::from(net.prefix_len()), net.addr().octets()));
                }
            }
        }
    }
}

/// A hybrid route's subnet.
fn hybrid_cidr(prefix_len: u32, network: [u8; 4]) -> IpNet {
    IpNet::V4(
        ipnet::Ipv4Net::new(Ipv4Addr::from(network), prefix_len as u8)
            .expect("a route's prefix length fits IPv4"),
    )
}

/// The hybrid node whose subnet is `cidr`.
fn hybrid_owner(view: &OverlayView, cidr: &IpNet) -> String {
    view.hybrid
        .iter()
        .flat_map(|h| h.nodes.iter())
        .find(|n| IpNet::V4(n.subnet) == *cidr)
        .map_or_else(String::new, |n| n.name.clone())
}

/// The nodes' pod CIDRs by their first address, so that an overlap is found in a few
/// lookups rather than by comparing with every node's (5,000 nodes made that 12.5 million
/// comparisons a compile).
#[derive(Clone, Debug, Default)]
pub(super) struct PodCidrOwners {
    /// (IPv6, first address) -> the CIDR and its node. Accepted CIDRs never overlap, so no two
    /// share a first address.
    by_start: imbl::OrdMap<(bool, u128), (IpNet, Arc<str>)>,
}

impl PodCidrOwners {
    /// The node owning a CIDR that overlaps `cidr`: one that starts inside it, or one that
    /// contains it. Only the last CIDR starting before `cidr` can contain it: any later one
    /// would start inside that one, and accepted CIDRs never overlap.
    pub(super) fn overlapping(&self, cidr: &IpNet) -> Option<&str> {
        let (v6, first, last) = span(cidr);
        if let Some((_, (_, owner))) = self.by_start.range((v6, first)..=(v6, last)).next() {
            return Some(owner);
        }
        self.by_start
            .range((v6, 0)..(v6, first))
            .next_back()
            .filter(|(_, (owned, _))| owned.contains(cidr))
            .map(|(_, (_, owner))| &**owner)
    }

    pub(super) fn insert(&mut self, cidr: IpNet, owner: Arc<str>) {
        let (v6, first, _) = span(&cidr);
        self.by_start.insert((v6, first), (cidr, owner));
    }

    fn remove(&mut self, cidr: &IpNet) {
        let (v6, first, _) = span(cidr);
        self.by_start.remove(&(v6, first));
    }
}

/// A CIDR's family and first and last addresses as numbers.
fn span(cidr: &IpNet) -> (bool, u128, u128) {
    match cidr {
        IpNet::V4(net) => (
            false,
            u128::from(u32::from(net.network())),
            u128::from(u32::from(net.broadcast())),
        ),
        IpNet::V6(net) => (true, u128::from(net.network()), u128::from(net.broadcast())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        api::network::OvnKubernetesConfig,
        model::Underlay,
        overlay::{compile, compile_since, outside_words},
        test_rng::TestRng,
    };

    /// An overlap is found whichever of the two is wider and whichever came first; adjacent
    /// CIDRs and other families do not overlap.
    #[test]
    fn pod_cidr_overlaps_are_found_both_ways() {
        let net = |text: &str| text.parse::<IpNet>().expect("CIDR");
        let mut owners = PodCidrOwners::default();
        owners.insert(net("10.244.0.0/16"), "wide".into());
        owners.insert(net("10.1.2.0/24"), "narrow".into());
        owners.insert(net("fd00::/64"), "six".into());
        for (cidr, owner) in [
            ("10.244.7.0/24", Some("wide")),
            ("10.0.0.0/8", Some("narrow")),
            ("10.1.2.128/25", Some("narrow")),
            ("10.1.2.0/24", Some("narrow")),
            ("10.1.3.0/24", None),
            ("10.1.3.5/32", None),
            ("10.1.2.255/32", Some("narrow")),
            ("10.244.255.255/32", Some("wide")),
            ("10.245.0.0/16", None),
            ("fd00::/48", Some("six")),
            ("fd00:0:0:1::/64", None),
            ("0.0.0.0/0", Some("narrow")),
        ] {
            assert_eq!(owners.overlapping(&net(cidr)), owner, "{cidr}");
        }
    }

    /// Node `i` (names sort as the numbers do), at underlay address `address`, with the
    /// pod CIDR 10.(128 + cidr / 256).(cidr % 256).0/24.
    fn node(i: u64, address: u64, cidr: u64) -> Arc<NodeView> {
        Arc::new(NodeView {
            created: i64::MAX,
            name: format!("n{i:04}"),
            addresses: vec![
                format!("10.99.{}.{}", address / 250, address % 250 + 1)
                    .parse()
                    .expect("address"),
            ],
            pod_cidrs: vec![
                format!("10.{}.{}.0/24", 128 + cidr / 256, cidr % 256)
                    .parse()
                    .expect("CIDR"),
            ],
        })
    }

    fn view_of(nodes: &NodeSeq) -> OverlayView {
        OverlayView {
            this_node: "n0000".into(),
            nodes: Arc::new(nodes.clone()),
            local_pods: Vec::new(),
            unrestricted_ifindexes: Vec::new(),
            underlay: Underlay {
                ifindex: 2,
                mac: [2, 0, 0, 0, 0, 1],
                xdp_forward: false,
                nodeport_listed: false,
                mtu: 1500,
            },
            settings: OvnKubernetesConfig::default()
                .validate(1500)
                .expect("settings"),
            hybrid: None,
        }
    }

    /// A new list out of name order is found while walking it, wherever the misplaced view
    /// is (one of the old list's, or a new one); a list in order gives its changes.
    #[test]
    fn a_new_list_out_of_name_order_is_found_on_the_way() {
        let nodes: NodeSeq = (0..6).map(|i| node(i, i, i)).collect();
        let mut swapped = nodes.clone();
        let fourth = swapped.remove(4);
        let second = std::mem::replace(swapped.get_mut(2).expect("a node"), fourth);
        swapped.insert(4, second);
        assert!(node_changes(&nodes, &swapped).is_none());
        let mut moved = nodes.clone();
        let last = moved.remove(moved.len() - 1);
        moved.insert(0, last);
        assert!(node_changes(&nodes, &moved).is_none());
        let mut misplaced = nodes.clone();
        misplaced.insert(1, node(9, 9, 9));
        assert!(node_changes(&nodes, &misplaced).is_none());
        let mut changed = nodes.clone();
        changed.remove(3);
        changed.push_back(node(7, 7, 7));
        let (gone, come) = node_changes(&nodes, &changed).expect("in order");
        assert_eq!(gone, vec![&nodes[3]]);
        assert_eq!(come, vec![&changed[5]]);
    }

    /// One node added to 200 changes the last entries (it does not build them all), and
    /// gives what building them all gives; a list with no change shares the last entries.
    #[test]
    fn one_node_added_changes_the_last_entries() {
        let mut nodes: NodeSeq = (0..200).map(|i| node(i, i, i)).collect();
        let first = compile(&view_of(&nodes)).expect("compiles");
        // Another list of the same views.
        let same = compile_since(&view_of(&nodes), Some(&first)).expect("compiles");
        assert!(Arc::ptr_eq(&first.node_maps, &same.node_maps));
        nodes.push_back(node(200, 200, 200));
        let view = view_of(&nodes);
        let updated = first
            .node_maps
            .updated_for(&view)
            .expect("changed in place");
        assert_eq!(*updated, *compile(&view).expect("compiles").node_maps);
        assert_eq!(updated.remote_v4.len(), 200);
        assert_eq!(updated.node_addrs.len(), 201);
    }

    /// Random changes to a cluster's nodes (added, removed, moved to another address, possibly
    /// one another node has, given another CIDR, possibly one another node has): each compile
    /// from the last one gives exactly what a compile from nothing gives, refused nodes
    /// included, and a refused node costs no other node its routes.
    #[test]
    fn node_by_node_changes_equal_a_full_compile() {
        let mut rng = TestRng::new(7);
        // Long enough for the persistent vector to hold chunks: a changed list shares all
        // but the chunks a change copied, as the model's lists do (every fifth step gives
        // the compile a list rebuilt anew, sharing views but no chunk).
        let mut nodes: NodeSeq = (0..200).map(|i| node(i, i, i)).collect();
        let mut last = compile(&view_of(&nodes)).expect("compiles");
        let mut next_node = 200;
        let (mut kept, mut refused) = (0, 0);
        for step in 0..2_000 {
            let mut changed = nodes.clone();
            for _ in 0..=rng.below(3) {
                let at = 1 + rng.below(changed.len() as u64 - 1) as usize;
                match rng.below(4) {
                    0 => {
                        let i = next_node;
                        next_node += 1;
                        let name = format!("n{i:04}");
                        let at = changed
                            .iter()
                            .position(|n| n.name >= name)
                            .unwrap_or(changed.len());
                        changed.insert(at, node(i, i, i));
                    }
                    1 if changed.len() > 2 => {
                        changed.remove(at);
                    }
                    2 => {
                        let mut moved = (*changed[at]).clone();
                        moved.addresses = node(0, rng.below(60), 0).addresses.clone();
                        *changed.get_mut(at).expect("within") = Arc::new(moved);
                    }
                    _ => {
                        let mut moved = (*changed[at]).clone();
                        moved.pod_cidrs = node(0, 0, rng.below(100)).pod_cidrs.clone();
                        *changed.get_mut(at).expect("within") = Arc::new(moved);
                    }
                }
            }
            let mut view = view_of(&changed);
            if step % 5 == 0 {
                view.nodes = Arc::new(changed.iter().cloned().collect());
            }
            let full = compile(&view).expect("this node is there");
            let since = compile_since(&view, Some(&last)).expect("this node is there");
            assert_eq!(since, full, "step {step}");
            assert_eq!(
                since.node_maps.rejected, full.node_maps.rejected,
                "step {step}"
            );
            // The bitmap of what lies outside the pod networks, from the counts each way
            // kept, is the same.
            assert_eq!(outside_words(&since), outside_words(&full), "step {step}");
            // A refused node refuses nothing else: every node not refused has its routes.
            for node in view.nodes.iter().filter(|n| n.name != view.this_node) {
                if full.node_maps.rejected.contains_key(&node.name) {
                    continue;
                }
                for cidr in &node.pod_cidrs {
                    if let IpNet::V4(net) = cidr.trunc() {
                        let key = (u32::from(net.prefix_len()), net.addr().octets());
                        assert!(full.node_maps.remote_v4.contains_key(&key), "step {step}");
                    }
                }
            }
            if full.node_maps.rejected.is_empty() {
                kept += 1;
                nodes = changed;
            } else {
                refused += 1;
            }
            // Half the time the next change starts from a compile that refused a node.
            if full.node_maps.rejected.is_empty() || rng.below(2) == 0 {
                last = full;
            }
        }
        // Both ways were taken many times.
        assert!(
            kept > 500 && refused > 100,
            "{kept} kept, {refused} refused"
        );
    }
}
