//! What this node's egress maps must hold (pure), from the EgressIP objects' `status.items`
//! (written by the controller), the cluster's pods and namespaces, and whether this node may
//! hold addresses right now; and the sync that writes it.

use std::sync::Arc;
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use aya::maps::{Array, HashMap, LpmTrie, MapData};
use dataplane_common::{
    egressip::{
        EGRESS_ACTIVE_HOLDER, EGRESS_ACTIVE_PODS, EGRESS_HELD_HERE, EgressHolder, EgressPod,
        MAX_EGRESS_IPS_PER_POD,
    },
    maps,
    overlay::Addr,
};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Namespace;

use super::EgressIP;
use crate::kernel::capacity::map_err;
use crate::{
    acl::pods::{PolicyPods, namespace_labels, selects},
    error::AgentError,
    kernel::loader::Dataplane,
    mapsync::{SyncStats, addr16, sync_hash_since, sync_lpm_since},
    model::NodeModel,
    model::{NodeList, NodeView, endpoint, in_name_order, node_changes},
    source::ClusterState,
};

/// Everything the egress maps are compiled from.
#[derive(Clone, Debug, Default)]
pub struct EgressInputs {
    pub objects: Vec<Arc<EgressIP>>,
    /// Every pod-network pod of the cluster.
    pub pods: PolicyPods,
    pub namespaces: Vec<Arc<Namespace>>,
    pub nodes: NodeList,
    pub cluster_networks: Vec<IpNet>,
    pub service_networks: Vec<IpNet>,
    pub this_node: String,
    /// Names of this node's pods (`namespace/name`).
    pub local_pods: BTreeSet<String>,
}

impl EgressInputs {
    /// The inputs from a cluster state; `objects` are its EgressIPs with the status in force
    /// (the manifest mode's status file merged in).
    pub fn from_state(
        state: &ClusterState,
        objects: Vec<Arc<EgressIP>>,
        pods: &PolicyPods,
        model: &NodeModel,
    ) -> Self {
        // Without an EgressIP no pod is selected: the pods and namespaces are left out (a
        // copy of them at every pod change cost 5,000 nodes' agents a millisecond each).
        let selecting = !objects.is_empty();
        EgressInputs {
            objects,
            pods: if selecting {
                pods.clone()
            } else {
                PolicyPods::default()
            },
            namespaces: if selecting {
                state.namespaces.to_vec()
            } else {
                Vec::new()
            },
            nodes: model.view.nodes.clone(),
            cluster_networks: state.cluster_networks.clone(),
            service_networks: state.service_networks.clone(),
            this_node: model.view.this_node.clone(),
            // Found by the model's one pass over the pods (150,000 of them at scale).
            local_pods: model.hosted_pods.clone(),
        }
    }
}

/// The egress maps' contents.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EgressMaps {
    pub pods: BTreeMap<Addr, EgressPod>,
    pub ips: BTreeMap<Addr, EgressHolder>,
    pub snat: BTreeMap<Addr, Addr>,
    /// Shared: it depends on the nodes and networks only (see [`internal_prefixes`]).
    pub internal: Arc<InternalPrefixes>,
    pub active: u32,
    /// The addresses this node holds (answers ARP for, translates to).
    pub held: BTreeSet<IpAddr>,
}

/// One selected pod: its addresses, the object selecting it, and whether it runs here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selected {
    pub pod: String,
    pub object: String,
    pub addresses: Vec<IpAddr>,
    pub local: bool,
}

/// The pods each object selects: a pod selected by two objects goes with the first in claim
/// order (OVN-Kubernetes leaves that case undefined).
pub fn selected_pods(inputs: &EgressInputs) -> Vec<Selected> {
    if inputs.objects.is_empty() {
        return Vec::new();
    }
    let labels = namespace_labels(&inputs.namespaces);
    let mut taken = BTreeSet::new();
    let mut selected = Vec::new();
    for object in super::assign::claim_order(&inputs.objects) {
        let name = object.metadata.name.clone().unwrap_or_default();
        for (namespace, pods) in inputs.pods.namespaces() {
            let mut ns_labels = labels.get(namespace).cloned().unwrap_or_default();
            ns_labels
                .entry("kubernetes.io/metadata.name".into())
                .or_insert_with(|| namespace.to_owned());
            if !selects(&object.spec.namespace_selector, &ns_labels).unwrap_or(false) {
                continue;
            }
            for pod in pods.values() {
                let pod_matches = object
                    .spec
                    .pod_selector
                    .as_ref()
                    .is_none_or(|s| selects(s, &pod.labels).unwrap_or(false));
                if pod_matches && taken.insert(pod.key()) {
                    selected.push(Selected {
                        pod: pod.key(),
                        object: name.clone(),
                        addresses: pod.addresses.clone(),
                        local: inputs.local_pods.contains(&pod.key()),
                    });
                }
            }
        }
    }
    selected
}

/// The assigned addresses as the objects' status says: (object, address, node), only for
/// addresses still in the object's spec and nodes that exist, each address once.
pub fn assigned(inputs: &EgressInputs) -> Vec<(String, IpAddr, String)> {
    let mut seen = BTreeSet::new();
    let mut assigned = Vec::new();
    for object in super::assign::claim_order(&inputs.objects) {
        let name = object.metadata.name.clone().unwrap_or_default();
        let spec: BTreeSet<IpAddr> = object
            .spec
            .egress_ips
            .iter()
            .filter_map(|t| t.parse().ok())
            .collect();
        for item in object.status.iter().flat_map(|s| &s.items) {
            let Ok(ip) = item.egress_ip.parse::<IpAddr>() else {
                continue;
            };
            if spec.contains(&ip)
                && inputs.nodes.iter().any(|n| n.name == item.node)
                && seen.insert(ip)
            {
                assigned.push((name.clone(), ip, item.node.clone()));
            }
        }
    }
    assigned
}

/// This node's egress maps. `may_hold`: whether this node may hold an address assigned to it
/// now (a fresh probe of the controller granted it); one it may not is left out altogether,
/// so traffic through it is dropped rather than sent to itself or as the pod.
pub fn compile(inputs: &EgressInputs, may_hold: impl Fn(&IpAddr) -> bool) -> EgressMaps {
    compile_with(inputs, internal_prefixes(inputs), may_hold)
}

/// The destinations that are the cluster's own, by LPM key: what the egress maps never send
/// through an egress IP. A persistent map: a node change copies the path to its own entries
/// (an ordinary map was copied whole, 5,000 nodes' addresses), and the sync compares it with
/// what it last wrote without visiting what the two share.
pub type InternalPrefixes = imbl::OrdMap<(u32, Addr), u32>;

/// [`InternalPrefixes`] of `inputs`: the cluster and service networks, every node's address,
/// and what never leaves the link. It reads only the nodes and networks, so the agent keeps
/// it while they stay (`EgressNode`, which follows node changes with [`InternalCounts`])
/// rather than building it from 5,000 nodes again at every pod change and every lease tick.
pub fn internal_prefixes(inputs: &EgressInputs) -> Arc<InternalPrefixes> {
    InternalCounts::of(inputs).prefixes
}

/// The internal prefixes with how many of the networks, nodes and link-local constants give
/// each: a node change then adds and takes away its own addresses' counts, where building
/// the prefixes again sorted 5,000 nodes' addresses (a quarter of a node change's time).
#[derive(Clone, Debug, Default)]
pub struct InternalCounts {
    counts: imbl::OrdMap<(u32, Addr), u32>,
    prefixes: Arc<InternalPrefixes>,
    /// The nodes counted, and whether they are in strict name order (so that a change to
    /// them can be followed node by node).
    nodes: NodeList,
    nodes_in_order: bool,
}

impl InternalCounts {
    pub fn of(inputs: &EgressInputs) -> Self {
        let networks = inputs
            .cluster_networks
            .iter()
            .chain(&inputs.service_networks)
            .copied();
        // What never leaves the link (neighbour discovery to the pod's gateway, multicast,
        // link-local) is not egress: it goes its usual way.
        let local = NOT_EGRESS
            .iter()
            .map(|net| net.parse::<IpNet>().expect("a valid constant prefix"));
        // Sorted first and built at once: inserted one by one in the nodes' name order (not
        // their addresses'), 5,000 nodes cost a node change 0.9 ms.
        let mut keys: Vec<(u32, Addr)> = networks
            .chain(inputs.nodes.iter().flat_map(|n| node_prefixes(n)))
            .chain(local)
            .map(|net| prefix_key(&net))
            .collect();
        keys.sort_unstable();
        let sorted: Vec<((u32, Addr), u32)> = keys
            .chunk_by(|a, b| a == b)
            .map(|run| (run[0], run.len() as u32))
            .collect();
        let prefixes = Arc::new(sorted.iter().map(|(key, _)| (*key, 1u32)).collect());
        let counts = sorted.into_iter().collect();
        InternalCounts {
            counts,
            prefixes,
            nodes: Arc::clone(&inputs.nodes),
            nodes_in_order: in_name_order(&inputs.nodes),
        }
    }

    /// The prefixes, shared.
    pub fn prefixes(&self) -> Arc<InternalPrefixes> {
        Arc::clone(&self.prefixes)
    }

    /// Follows the nodes counted to `new`: the nodes that left and came
    /// (`overlay::node_changes`, one walk down both lists in name order) are taken away and
    /// added. Lists out of name order (a manifest directory's) take every old node away and
    /// add every new one: the counts still end those of `new`.
    pub fn follow_nodes(&mut self, new: &NodeList) {
        if Arc::ptr_eq(&self.nodes, new) {
            return;
        }
        let old = std::mem::replace(&mut self.nodes, Arc::clone(new));
        let changes = self
            .nodes_in_order
            .then(|| node_changes(&old, new))
            .flatten();
        self.nodes_in_order = changes.is_some() || in_name_order(new);
        let (gone, come) = changes.unwrap_or_else(|| (old.iter().collect(), new.iter().collect()));
        for node in gone {
            self.take(node);
        }
        for node in come {
            self.add(node);
        }
    }

    fn add(&mut self, node: &NodeView) {
        for key in node_prefixes(node).map(|net| prefix_key(&net)) {
            let count = self.counts.entry(key).or_default();
            *count += 1;
            if *count == 1 {
                Arc::make_mut(&mut self.prefixes).insert(key, 1);
            }
        }
    }

    fn take(&mut self, node: &NodeView) {
        for key in node_prefixes(node).map(|net| prefix_key(&net)) {
            let Some(count) = self.counts.get_mut(&key) else {
                continue;
            };
            *count -= 1;
            if *count == 0 {
                self.counts.remove(&key);
                Arc::make_mut(&mut self.prefixes).remove(&key);
            }
        }
    }
}

/// A node's addresses, each a prefix of its full length.
fn node_prefixes(node: &NodeView) -> impl Iterator<Item = IpNet> + '_ {
    node.addresses.iter().map(|address| IpNet::from(*address))
}

/// [`compile`] with the internal prefixes given (those of the same nodes and networks).
pub fn compile_with(
    inputs: &EgressInputs,
    internal: Arc<InternalPrefixes>,
    may_hold: impl Fn(&IpAddr) -> bool,
) -> EgressMaps {
    let mut maps = EgressMaps {
        internal,
        ..EgressMaps::default()
    };
    let assigned = assigned(inputs);
    let node_address = |node: &str, ip: &IpAddr| {
        let view = inputs.nodes.iter().find(|n| n.name == node)?;
        view.addresses
            .iter()
            .find(|a| a.is_ipv4() == ip.is_ipv4())
            .or(view.addresses.first())
            .copied()
    };
    // object -> its live addresses (and whether held here).
    let mut by_object: BTreeMap<&str, Vec<(IpAddr, bool)>> = BTreeMap::new();
    for (object, ip, node) in &assigned {
        let here = node == &inputs.this_node;
        if here && !may_hold(ip) {
            continue;
        }
        let Some(address) = node_address(node, ip) else {
            continue;
        };
        maps.ips.insert(
            addr16(*ip),
            EgressHolder {
                node: endpoint(address),
                flags: if here { EGRESS_HELD_HERE } else { 0 },
            },
        );
        if here {
            maps.held.insert(*ip);
        }
        by_object.entry(object).or_default().push((*ip, here));
    }
    for pod in selected_pods(inputs) {
        let addresses = by_object.get(pod.object.as_str());
        for address in &pod.addresses {
            let family: Vec<&(IpAddr, bool)> = addresses
                .into_iter()
                .flatten()
                .filter(|(ip, _)| ip.is_ipv4() == address.is_ipv4())
                .collect();
            if pod.local {
                let mut entry = EgressPod::default();
                for (slot, (ip, _)) in family.iter().take(MAX_EGRESS_IPS_PER_POD).enumerate() {
                    entry.ips[slot] = addr16(*ip);
                    entry.count += 1;
                }
                maps.pods.insert(addr16(*address), entry);
            }
            if let Some((ip, _)) = family.iter().find(|(_, here)| *here) {
                maps.snat.insert(addr16(*address), addr16(*ip));
            }
        }
    }
    if !maps.pods.is_empty() {
        maps.active |= EGRESS_ACTIVE_PODS;
    }
    if !maps.held.is_empty() || !maps.snat.is_empty() {
        maps.active |= EGRESS_ACTIVE_HOLDER;
    }
    maps
}

/// Destinations that are never egress, whatever the cluster's networks.
const NOT_EGRESS: [&str; 5] = [
    "169.254.0.0/16",
    "224.0.0.0/4",
    "255.255.255.255/32",
    "fe80::/10",
    "ff00::/8",
];

/// An LPM key over the 16-byte form (IPv4 prefixes IPv4-mapped: 96 more bits).
fn prefix_key(net: &IpNet) -> (u32, Addr) {
    let extra = if net.addr().is_ipv4() { 96 } else { 0 };
    (u32::from(net.prefix_len()) + extra, addr16(net.network()))
}

impl Dataplane {
    /// Makes the egress maps equal `desired`: the cluster's prefixes and the addresses'
    /// holders before the translations and the pods that use them, the active bits last (and
    /// first when they go). `last` is what the previous sync wrote, compared with instead of
    /// the kernel's entries (the internal prefixes hold every node's address: reading 5,000
    /// entries back at each change cost more than the change); `None` reads the kernel.
    pub fn sync_egress(
        &mut self,
        desired: &EgressMaps,
        last: Option<&EgressMaps>,
    ) -> Result<SyncStats, AgentError> {
        let mut stats = SyncStats::default();
        let sync_err = |name: &'static str| map_err(name, "sync");
        let mut active: Array<&mut MapData, u32> = self.typed_map(maps::EGRESS_ACTIVE)?;
        let current = active.get(&0, 0).map_err(sync_err(maps::EGRESS_ACTIVE))?;
        if current & !desired.active != 0 {
            active
                .set(0, current & desired.active, 0)
                .map_err(sync_err(maps::EGRESS_ACTIVE))?;
        }
        // The same shared prefixes as last written: nothing to compare.
        if !last.is_some_and(|l| Arc::ptr_eq(&l.internal, &desired.internal)) {
            let mut internal: LpmTrie<&mut MapData, Addr, u32> =
                self.typed_map(maps::EGRESS_INTERNAL)?;
            sync_lpm_since(
                &mut internal,
                &*desired.internal,
                last.map(|l| &*l.internal),
                &mut stats,
            )
            .map_err(sync_err(maps::EGRESS_INTERNAL))?;
        }
        let mut ips: HashMap<&mut MapData, Addr, EgressHolder> =
            self.typed_map(maps::EGRESS_IPS)?;
        stats.add(
            sync_hash_since(&mut ips, &desired.ips, last.map(|l| &l.ips))
                .map_err(sync_err(maps::EGRESS_IPS))?,
        );
        let mut snat: HashMap<&mut MapData, Addr, Addr> = self.typed_map(maps::EGRESS_SNAT)?;
        stats.add(
            sync_hash_since(&mut snat, &desired.snat, last.map(|l| &l.snat))
                .map_err(sync_err(maps::EGRESS_SNAT))?,
        );
        let mut pods: HashMap<&mut MapData, Addr, EgressPod> = self.typed_map(maps::EGRESS_PODS)?;
        stats.add(
            sync_hash_since(&mut pods, &desired.pods, last.map(|l| &l.pods))
                .map_err(sync_err(maps::EGRESS_PODS))?,
        );
        let mut active: Array<&mut MapData, u32> = self.typed_map(maps::EGRESS_ACTIVE)?;
        if active.get(&0, 0).map_err(sync_err(maps::EGRESS_ACTIVE))? != desired.active {
            active
                .set(0, desired.active, 0)
                .map_err(sync_err(maps::EGRESS_ACTIVE))?;
            stats.written += 1;
        }
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::acl::pods::PolicyPod;
    use crate::api::egressip::{EgressIpSpec, EgressIpStatus, EgressIpStatusItem};
    use dataplane_common::overlay::ipv4_mapped;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

    fn pod(namespace: &str, name: &str, address: &str) -> PolicyPod {
        PolicyPod {
            namespace: namespace.into(),
            name: name.into(),
            labels: BTreeMap::from([("app".into(), name.into())]),
            addresses: vec![address.parse().unwrap()],
            named_ports: BTreeMap::new(),
        }
    }

    fn node(name: &str, address: &str, cidr: &str) -> Arc<NodeView> {
        Arc::new(NodeView {
            created: i64::MAX,
            name: name.into(),
            addresses: vec![address.parse().unwrap()],
            pod_cidrs: vec![cidr.parse().unwrap()],
        })
    }

    fn inputs(items: &[(&str, &str)]) -> EgressInputs {
        let mut object = EgressIP::new(
            "prod",
            EgressIpSpec {
                egress_ips: vec!["10.99.0.50".into(), "10.99.0.51".into()],
                namespace_selector: LabelSelector {
                    match_labels: Some(BTreeMap::from([(
                        "kubernetes.io/metadata.name".into(),
                        "prod".into(),
                    )])),
                    ..Default::default()
                },
                pod_selector: None,
            },
        );
        object.status = Some(EgressIpStatus {
            items: items
                .iter()
                .map(|(ip, node)| EgressIpStatusItem {
                    node: (*node).into(),
                    egress_ip: (*ip).into(),
                })
                .collect(),
        });
        EgressInputs {
            objects: vec![Arc::new(object)],
            pods: vec![
                pod("prod", "web", "10.244.1.2"),
                pod("prod", "db", "10.244.2.2"),
                pod("other", "web", "10.244.1.3"),
            ]
            .into_iter()
            .collect(),
            namespaces: Vec::new(),
            nodes: Arc::new(crate::model::NodeSeq::from_iter([
                node("node-0", "10.99.0.1", "10.244.1.0/24"),
                node("node-1", "10.99.0.2", "10.244.2.0/24"),
            ])),
            cluster_networks: vec!["10.244.0.0/16".parse().unwrap()],
            service_networks: vec!["10.96.0.0/16".parse().unwrap()],
            this_node: "node-0".into(),
            local_pods: BTreeSet::from(["prod/web".into(), "other/web".into()]),
        }
    }

    fn a(text: &str) -> Addr {
        addr16(text.parse().unwrap())
    }

    #[test]
    fn local_selected_pods_get_every_assigned_address_and_the_holder_translates_all_of_them() {
        let maps = compile(
            &inputs(&[("10.99.0.50", "node-0"), ("10.99.0.51", "node-1")]),
            |_| true,
        );
        assert_eq!(maps.pods.len(), 1, "only the local selected pod");
        let web = maps.pods[&a("10.244.1.2")];
        assert_eq!(web.count, 2);
        assert_eq!(web.ips[..2], [a("10.99.0.50"), a("10.99.0.51")]);
        assert_eq!(maps.ips[&a("10.99.0.50")].flags, EGRESS_HELD_HERE);
        assert_eq!(maps.ips[&a("10.99.0.51")].flags, 0);
        assert_eq!(
            maps.ips[&a("10.99.0.51")].node.addr,
            ipv4_mapped([10, 99, 0, 2])
        );
        // Both selected pods (this node's and node-1's) are translated here, to the held one.
        assert_eq!(
            maps.snat,
            BTreeMap::from([
                (a("10.244.1.2"), a("10.99.0.50")),
                (a("10.244.2.2"), a("10.99.0.50")),
            ])
        );
        assert_eq!(maps.held, BTreeSet::from(["10.99.0.50".parse().unwrap()]));
        assert_eq!(maps.active, EGRESS_ACTIVE_PODS | EGRESS_ACTIVE_HOLDER);
        assert!(maps.internal.contains_key(&(96 + 16, a("10.244.0.0"))));
        assert!(maps.internal.contains_key(&(128, a("10.99.0.2"))));
        assert!(
            maps.internal.contains_key(&(8, a("ff00::"))),
            "neighbour discovery"
        );
    }

    #[test]
    fn without_status_a_selected_pod_is_held_back_and_without_the_probes_nothing_is_held() {
        let unassigned = compile(&inputs(&[]), |_| true);
        assert_eq!(unassigned.pods[&a("10.244.1.2")].count, 0);
        assert_eq!(unassigned.active, EGRESS_ACTIVE_PODS);
        let fenced = compile(&inputs(&[("10.99.0.50", "node-0")]), |_| false);
        assert!(fenced.ips.is_empty() && fenced.snat.is_empty() && fenced.held.is_empty());
        assert_eq!(fenced.pods[&a("10.244.1.2")].count, 0);
    }

    #[test]
    fn status_items_for_unknown_nodes_or_addresses_not_in_the_spec_are_ignored() {
        let maps = compile(
            &inputs(&[("10.99.0.50", "node-9"), ("10.99.0.77", "node-0")]),
            |_| true,
        );
        assert!(maps.ips.is_empty());
        assert_eq!(maps.pods[&a("10.244.1.2")].count, 0);
    }

    /// Following node changes gives exactly the prefixes built from the new list: a node
    /// gone, one whose address changed, one added, the list in another order, an address
    /// two nodes share (it stays while either has it), and every node gone.
    #[test]
    fn internal_prefixes_followed_through_node_changes_equal_those_built_anew() {
        let mut inputs = inputs(&[]);
        let shared = node("node-2", "10.99.0.9", "10.244.3.0/24");
        let nodes = [
            node("node-0", "10.99.0.1", "10.244.1.0/24"),
            node("node-1", "10.99.0.2", "10.244.2.0/24"),
            Arc::clone(&shared),
            node("node-3", "10.99.0.9", "10.244.4.0/24"),
            node("node-4", "169.254.0.0", "10.244.5.0/24"),
        ];
        inputs.nodes = Arc::new(nodes.iter().cloned().collect());
        let mut counts = InternalCounts::of(&inputs);
        assert_eq!(counts.prefixes(), internal_prefixes(&inputs));
        let steps: Vec<Vec<Arc<NodeView>>> = vec![
            // node-1 gone, node-3 (sharing node-2's address) gone, node-5 added.
            vec![
                nodes[0].clone(),
                shared.clone(),
                nodes[4].clone(),
                node("node-5", "10.99.0.5", "10.244.6.0/24"),
            ],
            // node-0's address changed; node-4 (the link-local one) gone.
            vec![
                node("node-0", "10.99.0.7", "10.244.1.0/24"),
                shared.clone(),
                node("node-5", "10.99.0.5", "10.244.6.0/24"),
            ],
            // The same nodes in another order (a manifest directory's), one more added first.
            vec![
                node("node-9", "fd00::9", "fd00:10:244::/64"),
                node("node-5", "10.99.0.5", "10.244.6.0/24"),
                shared.clone(),
                node("node-0", "10.99.0.7", "10.244.1.0/24"),
            ],
            // Every node gone.
            Vec::new(),
        ];
        for step in steps {
            inputs.nodes = Arc::new(step.iter().cloned().collect());
            counts.follow_nodes(&inputs.nodes);
            assert_eq!(*counts.prefixes(), *internal_prefixes(&inputs), "{step:?}");
        }
        let links_and_networks = internal_prefixes(&inputs).len();
        assert_eq!(links_and_networks, NOT_EGRESS.len() + 2);
    }
}
