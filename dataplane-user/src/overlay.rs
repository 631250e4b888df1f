//! The Geneve pod overlay, agent side: compile this node's view of the cluster (`model`, with
//! the settings `api::network` validated) into the exact contents of the overlay maps (pure),
//! and sync the maps.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

use aya::maps::{Array, DevMapHash, HashMap, LpmTrie, MapData};
use dataplane_common::{
    maps,
    overlay::{
        Addr, LocalPod, OUTSIDE_WORDS, OVERLAY_ENABLED, OVERLAY_HAS_IPV4, OVERLAY_HAS_IPV6,
        OVERLAY_NODEPORT_LISTED, OVERLAY_XDP_FORWARD, OverlayConfig, TunnelEndpoint,
        outside_bit_v4, outside_bit_v6,
    },
    port::PodPort,
};
use ipnet::IpNet;

use crate::kernel::capacity::map_err;
use crate::{
    error::AgentError,
    kernel::loader::Dataplane,
    mapsync::{SyncStats, addr16, ip_of, sync_hash_since, sync_lpm_since},
    model::OverlayView,
    port,
};

mod nodes;
pub use nodes::NodeMaps;

/// Why the overlay view could not be compiled.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CompileError {
    #[error("node {0}: this node is not among the cluster's nodes")]
    ThisNodeMissing(String),
    #[error("node {node}: status.addresses has no InternalIP")]
    NodeWithoutAddress { node: String },
    #[error("node {node}: spec.podCIDRs {cidr} is also the pod CIDR of node {other}")]
    OverlappingPodCidr {
        node: String,
        other: String,
        cidr: IpNet,
    },
}

/// The exact desired contents of every overlay map.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OverlayMaps {
    pub config: OverlayConfig,
    /// What the cluster's nodes give (routes to their pod CIDRs, their addresses): shared
    /// with the last compile's while no node changed, and changed node by node otherwise.
    pub node_maps: Arc<NodeMaps>,
    pub local_pods: BTreeMap<Addr, LocalPod>,
    /// Port security of the local pods, by host-side veth (`crate::port`).
    pub pod_ports: BTreeMap<u32, PodPort>,
    /// Host-side veths of the local pods whose end takes frames from XDP (`DP_XDP_PODS`).
    pub xdp_pods: BTreeSet<u32>,
}

/// Compiles this node's view into the overlay maps. Pure: no I/O.
pub fn compile(view: &OverlayView) -> Result<OverlayMaps, CompileError> {
    compile_since(view, None)
}

/// [`compile`], changing the node entries of `last` (the previous compile's maps) rather
/// than building them all again where only some nodes changed.
pub fn compile_since(
    view: &OverlayView,
    last: Option<&OverlayMaps>,
) -> Result<OverlayMaps, CompileError> {
    let this = view
        .this_node_view()
        .ok_or_else(|| CompileError::ThisNodeMissing(view.this_node.clone()))?;
    let mut maps = OverlayMaps::default();

    let mut config = OverlayConfig {
        underlay_ifindex: view.underlay.ifindex,
        vni: view.settings.vni,
        pod_mtu: view.settings.pod_mtu,
        geneve_port: view.settings.geneve_port,
        flags: OVERLAY_ENABLED
            | if view.underlay.xdp_forward {
                OVERLAY_XDP_FORWARD
            } else {
                0
            }
            | if view.underlay.nodeport_listed {
                OVERLAY_NODEPORT_LISTED
            } else {
                0
            },
        underlay_mac: view.underlay.mac,
        ..OverlayConfig::default()
    };
    if let Some(v4) = this.first_v4() {
        config.node_ipv4 = v4.octets();
        config.flags |= OVERLAY_HAS_IPV4;
    }
    if let Some(v6) = this.first_v6() {
        config.node_ipv6 = v6.octets();
        config.flags |= OVERLAY_HAS_IPV6;
    }
    maps.config = config;

    maps.node_maps = match last.and_then(|l| l.node_maps.updated_for(view)) {
        Some(kept) => kept,
        None => Arc::new(NodeMaps::compile(view)),
    };
    maps.pod_ports = port::compile(&view.local_pods);
    for ifindex in &view.unrestricted_ifindexes {
        maps.pod_ports
            .entry(*ifindex)
            .or_insert_with(port::unrestricted);
    }
    for pod in &view.local_pods {
        if pod.takes_xdp {
            maps.xdp_pods.insert(pod.host_ifindex);
        }
        for address in &pod.addresses {
            maps.local_pods.insert(
                addr16(*address),
                LocalPod {
                    ifindex: pod.host_ifindex,
                    pod_mac: pod.pod_mac,
                    host_mac: pod.host_mac,
                },
            );
        }
    }
    Ok(maps)
}

impl Dataplane {
    /// Makes the overlay maps equal `desired`, writing only differences. Each map gets its new
    /// and changed entries before its stale ones go; the maps packets are sent to (pods, nodes,
    /// remote CIDRs) are complete before the config that enables the overlay is written. The
    /// config's `pods_epoch` moves on when the local pods, their port records or the nodes
    /// (addresses, pod subnets) changed (the kernel's flow caches and port-security copies
    /// drop what they cached from them).
    /// `last`: what the previous call wrote, to compare with instead of reading every entry
    /// back (`None`: compared with what the kernel holds, as a first or full sync must).
    pub fn sync_overlay(
        &mut self,
        desired: &OverlayMaps,
        last: Option<&OverlayMaps>,
    ) -> Result<SyncStats, AgentError> {
        let mut stats = SyncStats::default();
        let sync_err = |name: &'static str| map_err(name, "sync");
        // Every node must fit before anything is written.
        let nodes = self.capacities().nodes;
        for (what, needed, map, limit) in [
            (
                "nodes' IPv4 pod subnets",
                desired.node_maps.remote_v4.len(),
                maps::REMOTE_PODS_V4,
                nodes,
            ),
            (
                "nodes' IPv6 pod subnets",
                desired.node_maps.remote_v6.len(),
                maps::REMOTE_PODS_V6,
                nodes,
            ),
            (
                "node addresses",
                desired.node_maps.node_addrs.len(),
                maps::NODE_ADDRS,
                nodes * 2,
            ),
        ] {
            if needed > limit as usize {
                return Err(AgentError::Capacity {
                    what,
                    needed,
                    map,
                    limit,
                    flag: "--max-nodes",
                });
            }
        }
        // The destinations known to lie outside the pod networks lose what becomes a pod
        // network before its pods and routes are written, and gain what stops being one only
        // after: a packet is never let go past a pod or subnet that is in the maps.
        let wanted_outside = outside_words(desired);
        let current_outside = match last {
            Some(last) => outside_words(last),
            None => self.read_outside()?,
        };
        let narrowed: Vec<u64> = current_outside
            .iter()
            .zip(&wanted_outside)
            .map(|(have, want)| have & want)
            .collect();
        stats.written += self.write_outside(&current_outside, &narrowed)?;
        // A pod's port-security record before its addresses: nothing is delivered to a pod, or
        // judged from it, that port security does not know.
        let mut ports: HashMap<&mut MapData, u32, PodPort> = self.typed_map(maps::POD_PORTS)?;
        let port_changes =
            sync_hash_since(&mut ports, &desired.pod_ports, last.map(|l| &l.pod_ports))
                .map_err(sync_err(maps::POD_PORTS))?;
        stats.add(port_changes);
        let mut pods: HashMap<&mut MapData, Addr, LocalPod> = self.typed_map(maps::LOCAL_PODS)?;
        let pod_changes =
            sync_hash_since(&mut pods, &desired.local_pods, last.map(|l| &l.local_pods))
                .map_err(sync_err(maps::LOCAL_PODS))?;
        // The kernel's per-CPU copies of port records are of an epoch too.
        let pods_changed = pod_changes.written + pod_changes.deleted > 0
            || port_changes.written + port_changes.deleted > 0;
        stats.add(pod_changes);
        stats.add(self.sync_xdp_pods(&desired.xdp_pods, last.map(|l| &l.xdp_pods))?);

        // The same shared node entries as last written: nothing to compare.
        let mut nodes_changed = false;
        if !last.is_some_and(|l| Arc::ptr_eq(&l.node_maps, &desired.node_maps)) {
            let node_changes =
                self.sync_node_maps(&desired.node_maps, last.map(|l| &*l.node_maps))?;
            nodes_changed = node_changes.written + node_changes.deleted > 0;
            stats.add(node_changes);
        }

        stats.written += self.write_outside(&narrowed, &wanted_outside)?;

        let mut config: Array<&mut MapData, OverlayConfig> =
            self.typed_map(maps::OVERLAY_CONFIG)?;
        let current = config.get(&0, 0).map_err(sync_err(maps::OVERLAY_CONFIG))?;
        // Written after the pods and nodes: what the kernel cached from the old ones is stale
        // from here (XDP's NodePort flow cache keeps a backend's node and route).
        let wanted = OverlayConfig {
            pods_epoch: current
                .pods_epoch
                .wrapping_add((pods_changed || nodes_changed) as u32),
            ..desired.config
        };
        if current != wanted {
            config
                .set(0, wanted, 0)
                .map_err(sync_err(maps::OVERLAY_CONFIG))?;
            stats.written += 1;
        }
        Ok(stats)
    }
}

impl Dataplane {
    /// Makes the node addresses and the routes to other nodes' pod CIDRs equal `desired`,
    /// compared with `last` (`None`: with the kernel's entries).
    fn sync_node_maps(
        &mut self,
        desired: &NodeMaps,
        last: Option<&NodeMaps>,
    ) -> Result<SyncStats, AgentError> {
        let sync_err = |name: &'static str| map_err(name, "sync");
        let mut stats = SyncStats::default();
        let mut nodes: HashMap<&mut MapData, Addr, u32> = self.typed_map(maps::NODE_ADDRS)?;
        stats.add(
            sync_hash_since(&mut nodes, &desired.node_addrs, last.map(|l| &l.node_addrs))
                .map_err(sync_err(maps::NODE_ADDRS))?,
        );
        let mut remote_v4: LpmTrie<&mut MapData, [u8; 4], TunnelEndpoint> =
            self.typed_map(maps::REMOTE_PODS_V4)?;
        sync_lpm_since(
            &mut remote_v4,
            &desired.remote_v4,
            last.map(|l| &l.remote_v4),
            &mut stats,
        )
        .map_err(sync_err(maps::REMOTE_PODS_V4))?;
        let mut remote_v6: LpmTrie<&mut MapData, [u8; 16], TunnelEndpoint> =
            self.typed_map(maps::REMOTE_PODS_V6)?;
        sync_lpm_since(
            &mut remote_v6,
            &desired.remote_v6,
            last.map(|l| &l.remote_v6),
            &mut stats,
        )
        .map_err(sync_err(maps::REMOTE_PODS_V6))?;
        Ok(stats)
    }
}

impl Dataplane {
    /// Makes `DP_XDP_PODS` hold exactly `desired` (each veth keyed and valued by its ifindex),
    /// compared with `last` or, without it, with the map's keys.
    fn sync_xdp_pods(
        &mut self,
        desired: &BTreeSet<u32>,
        last: Option<&BTreeSet<u32>>,
    ) -> Result<SyncStats, AgentError> {
        let map_err = |action: &'static str| map_err(maps::XDP_PODS, action);
        let mut map: DevMapHash<&mut MapData> = self.typed_map(maps::XDP_PODS)?;
        let current: BTreeSet<u32> = match last {
            Some(last) => last.clone(),
            None => map
                .keys()
                .collect::<Result<_, _>>()
                .map_err(map_err("read"))?,
        };
        let mut stats = SyncStats::default();
        for ifindex in desired.difference(&current) {
            // No program runs on the way in, so chaining support is never asked for.
            map.insert(*ifindex, *ifindex, None, 0)
                .map_err(|error| match error {
                    aya::maps::xdp::XdpMapError::MapError(source) => map_err("write")(source),
                    other => AgentError::XdpMap {
                        name: maps::XDP_PODS,
                        action: "write",
                        source: other,
                    },
                })?;
            stats.written += 1;
        }
        for ifindex in current.difference(desired) {
            match map.remove(*ifindex) {
                Ok(()) => stats.deleted += 1,
                // The kernel drops a device's entry when the device goes (the delete then
                // answers ENOENT).
                Err(aya::maps::MapError::KeyNotFound) => {}
                Err(aya::maps::MapError::SyscallError(error))
                    if error.io_error.raw_os_error() == Some(libc::ENOENT) => {}
                Err(source) => return Err(map_err("delete")(source)),
            }
        }
        Ok(stats)
    }

    /// The kernel's `OUTSIDE` bitmap, word by word.
    fn read_outside(&mut self) -> Result<Vec<u64>, AgentError> {
        let map: Array<&mut MapData, u64> = self.typed_map(maps::OUTSIDE)?;
        (0..OUTSIDE_WORDS)
            .map(|i| map.get(&i, 0))
            .collect::<Result<_, _>>()
            .map_err(map_err(maps::OUTSIDE, "read"))
    }

    /// Writes the words of `wanted` that differ from `have`; returns how many.
    fn write_outside(&mut self, have: &[u64], wanted: &[u64]) -> Result<usize, AgentError> {
        let mut map: Array<&mut MapData, u64> = self.typed_map(maps::OUTSIDE)?;
        let mut written = 0;
        for (index, (have, want)) in have.iter().zip(wanted).enumerate() {
            if have != want {
                map.set(index as u32, *want, 0)
                    .map_err(map_err(maps::OUTSIDE, "write"))?;
                written += 1;
            }
        }
        Ok(written)
    }
}

/// The `OUTSIDE` bitmap `maps` call for: every bit set but those of the local pods' addresses
/// and of the remote pod subnets (each /16 an IPv4 subnet spans; an IPv6 subnet shorter than
/// /32, whose prefixes the bitmap's fold cannot list, clears every IPv6 bit). The remote
/// subnets' bits are the ones their entries keep counted (`NodeMaps::outside_cleared`).
pub fn outside_words(maps: &OverlayMaps) -> Vec<u64> {
    let mut words = vec![u64::MAX; OUTSIDE_WORDS as usize];
    let mut clear = |(word, bit): (u32, u64)| words[word as usize] &= !bit;
    for addr in maps.local_pods.keys() {
        match ip_of(addr) {
            IpAddr::V4(v4) => clear(outside_bit_v4(v4.octets())),
            IpAddr::V6(v6) => clear(outside_bit_v6(first_four(&v6.octets()))),
        }
    }
    maps.node_maps.outside_cleared().for_each(&mut clear);
    if maps.node_maps.has_short_v6() {
        words[OUTSIDE_WORDS as usize / 2..].fill(0);
    }
    words
}

fn first_four(addr: &Addr) -> [u8; 4] {
    [addr[0], addr[1], addr[2], addr[3]]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        api::network::OvnKubernetesConfig,
        model::{LocalPodView, NodeSeq, NodeView, Underlay, endpoint, node_named},
    };

    /// In name order (found by the search) or not (by the walk), a node is found, and a
    /// name no node has is not.
    #[test]
    fn a_node_is_found_by_name_whatever_the_list_order() {
        let node = |name: &str| {
            Arc::new(NodeView {
                created: i64::MAX,
                name: name.into(),
                addresses: Vec::new(),
                pod_cidrs: Vec::new(),
            })
        };
        let sorted: NodeSeq = ["a", "b", "c", "d", "e"].map(node).into_iter().collect();
        let shuffled: NodeSeq = ["d", "a", "e", "c", "b"].map(node).into_iter().collect();
        for nodes in [&sorted, &shuffled] {
            for name in ["a", "b", "c", "d", "e"] {
                assert_eq!(node_named(nodes, name).map(|n| n.name.as_str()), Some(name));
            }
            assert!(node_named(nodes, "f").is_none());
            assert!(node_named(nodes, "").is_none());
        }
        assert!(node_named(&NodeSeq::new(), "a").is_none());
    }

    fn net(s: &str) -> IpNet {
        s.parse().expect("valid CIDR")
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("valid address")
    }

    /// Whether `OUTSIDE` says a destination is outside every pod network.
    fn outside(words: &[u64], addr: &str) -> bool {
        let (word, bit) = match ip(addr) {
            IpAddr::V4(v4) => outside_bit_v4(v4.octets()),
            IpAddr::V6(v6) => outside_bit_v6(first_four(&v6.octets())),
        };
        words[word as usize] & bit != 0
    }

    #[test]
    fn outside_bitmap_never_covers_a_pod_or_a_remote_subnet() {
        let mut maps = OverlayMaps::default();
        let endpoint = endpoint(ip("192.168.0.2"));
        maps.local_pods
            .insert(addr16(ip("10.244.1.3")), LocalPod::default());
        maps.local_pods
            .insert(addr16(ip("fd00:10:244:1::3")), LocalPod::default());
        Arc::make_mut(&mut maps.node_maps).insert_remote_v4((24, [10, 245, 7, 0]), endpoint);
        // Shorter than the bitmap's /16: every /16 it spans (a hybrid cluster network).
        Arc::make_mut(&mut maps.node_maps).insert_remote_v4((14, [172, 16, 0, 0]), endpoint);
        let v6_subnet: std::net::Ipv6Addr = "fd00:20:244:2::".parse().expect("address");
        Arc::make_mut(&mut maps.node_maps).insert_remote_v6((64, v6_subnet.octets()), endpoint);
        let words = outside_words(&maps);
        for inside in [
            "10.244.1.3",
            "10.244.200.1",
            "10.245.7.9",
            "172.16.0.1",
            "172.19.255.254",
            "fd00:10:244:1::3",
            "fd00:20:244:2::9",
        ] {
            assert!(!outside(&words, inside), "{inside} must be looked up");
        }
        for far in [
            "192.0.2.1",
            "10.243.0.1",
            "172.20.0.1",
            "8.8.8.8",
            "2001:db8::1",
        ] {
            assert!(outside(&words, far), "{far} is known to be outside");
        }
        // The only clear bits: two IPv4 /16s (10.244, 10.245), the four of 172.16.0.0/14, and
        // two IPv6 folds.
        let clear: u32 = words.iter().map(|w| w.count_zeros()).sum();
        assert_eq!(clear, 2 + 4 + 2);
        // An IPv6 subnet shorter than /32 cannot be listed: every IPv6 destination is looked up.
        let short = (24, [0xfd, 0, 0x30, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        Arc::make_mut(&mut maps.node_maps).insert_remote_v6(short, endpoint);
        let words = outside_words(&maps);
        assert!(!outside(&words, "2001:db8::1"));
        assert!(outside(&words, "192.0.2.1"));
        // Subnets taken out give their bits back; a /16 two subnets clear stays clear while
        // one of them is left.
        let node_maps = Arc::make_mut(&mut maps.node_maps);
        node_maps.insert_remote_v4((24, [10, 245, 8, 0]), endpoint);
        node_maps.remove_remote_v6(short);
        node_maps.remove_remote_v4((14, [172, 16, 0, 0]));
        node_maps.remove_remote_v4((24, [10, 245, 7, 0]));
        let words = outside_words(&maps);
        assert!(outside(&words, "2001:db8::1"));
        assert!(outside(&words, "172.16.0.1"));
        assert!(
            !outside(&words, "10.245.7.9"),
            "10.245.8.0/24 is still there"
        );
        let clear: u32 = words.iter().map(|w| w.count_zeros()).sum();
        assert_eq!(clear, 2 + 2);
    }

    fn view() -> OverlayView {
        OverlayView {
            this_node: "node-a".into(),
            nodes: Arc::new(NodeSeq::from_iter([
                Arc::new(NodeView {
                    created: i64::MAX,
                    name: "node-a".into(),
                    addresses: vec![ip("10.99.0.1"), ip("fd99::1")],
                    pod_cidrs: vec![net("10.244.1.0/24"), net("fd00:10:244:1::/64")],
                }),
                Arc::new(NodeView {
                    created: i64::MAX,
                    name: "node-b".into(),
                    addresses: vec![ip("10.99.0.2"), ip("fd99::2")],
                    pod_cidrs: vec![net("10.244.2.0/24"), net("fd00:10:244:2::/64")],
                }),
                Arc::new(NodeView {
                    created: i64::MAX,
                    name: "node-c".into(),
                    addresses: vec![ip("fd99::3")],
                    pod_cidrs: vec![net("10.244.3.0/24")],
                }),
            ])),
            local_pods: vec![LocalPodView {
                name: "default/a".into(),
                addresses: vec![ip("10.244.1.2"), ip("fd00:10:244:1::2")],
                pod_mac: [0x0a, 0x58, 10, 244, 1, 2],
                host_ifindex: 7,
                host_mac: [2, 0, 0, 0, 0, 7],
                takes_xdp: false,
            }],
            unrestricted_ifindexes: Vec::new(),
            underlay: Underlay {
                ifindex: 2,
                mac: [2, 0, 0, 0, 0, 2],
                xdp_forward: false,
                nodeport_listed: false,
                mtu: 1500,
            },
            settings: OvnKubernetesConfig::default()
                .validate(1500)
                .expect("defaults"),
            hybrid: None,
        }
    }

    #[test]
    fn compile_fills_every_overlay_map() {
        let maps = compile(&view()).expect("compiles");
        assert_eq!(
            maps.config.flags,
            OVERLAY_ENABLED | OVERLAY_HAS_IPV4 | OVERLAY_HAS_IPV6
        );
        assert_eq!(maps.config.node_ipv4, [10, 99, 0, 1]);
        assert_eq!(maps.config.pod_mtu, 1400);
        assert_eq!(maps.config.underlay_ifindex, 2);
        // Remote CIDRs only, tunnelled over the same family when the node has it.
        assert_eq!(
            maps.node_maps.remote_v4.keys().copied().collect::<Vec<_>>(),
            vec![(24, [10, 244, 2, 0]), (24, [10, 244, 3, 0])]
        );
        assert_eq!(
            maps.node_maps.remote_v4[&(24, [10, 244, 2, 0])],
            endpoint(ip("10.99.0.2"))
        );
        assert_eq!(
            maps.node_maps.remote_v4[&(24, [10, 244, 3, 0])],
            endpoint(ip("fd99::3"))
        );
        assert_eq!(maps.node_maps.remote_v6.len(), 1);
        assert_eq!(maps.node_maps.node_addrs.len(), 5);
        assert_eq!(maps.local_pods.len(), 2);
        assert_eq!(maps.local_pods[&addr16(ip("10.244.1.2"))].ifindex, 7);
    }

    #[test]
    fn a_missing_node_is_refused_and_bad_nodes_fail_alone() {
        let mut missing = view();
        missing.this_node = "node-z".into();
        assert_eq!(
            compile(&missing),
            Err(CompileError::ThisNodeMissing("node-z".into()))
        );
        let good = compile(&view()).unwrap().node_maps;
        assert!(good.rejected.is_empty());
        // node-c claims part of node-b's CIDR: node-c alone is refused (node-b's entries and
        // every other node's stay as they were).
        let mut overlapping = view();
        Arc::make_mut(&mut Arc::make_mut(&mut overlapping.nodes)[2]).pod_cidrs =
            vec![net("10.244.2.128/25")];
        let maps = compile(&overlapping).unwrap().node_maps;
        assert_eq!(
            maps.rejected.get("node-c").map(String::as_str),
            Some("node node-c: spec.podCIDRs 10.244.2.128/25 is also the pod CIDR of node node-b")
        );
        assert_eq!(
            maps.remote_v4.get(&(24, [10, 244, 2, 0])),
            good.remote_v4.get(&(24, [10, 244, 2, 0]))
        );
        assert!(!maps.remote_v4.contains_key(&(25, [10, 244, 2, 128])));
        assert!(
            !maps.node_addrs.contains_key(&addr16(ip("fd99::3"))),
            "nothing of node-c"
        );
        // The older Node keeps a CIDR two claim, whichever comes first by name.
        let mut older = overlapping.clone();
        Arc::make_mut(&mut Arc::make_mut(&mut older.nodes)[2]).created = 100;
        Arc::make_mut(&mut Arc::make_mut(&mut older.nodes)[1]).created = 200;
        let maps = compile(&older).unwrap().node_maps;
        assert!(maps.rejected.contains_key("node-b"), "{:?}", maps.rejected);
        assert!(maps.remote_v4.contains_key(&(25, [10, 244, 2, 128])));
        // This node keeps its own CIDRs, whatever claims them.
        let mut claimed = view();
        Arc::make_mut(&mut Arc::make_mut(&mut claimed.nodes)[1]).pod_cidrs =
            vec![net("10.244.1.0/24")];
        Arc::make_mut(&mut Arc::make_mut(&mut claimed.nodes)[1]).created = 0;
        let maps = compile(&claimed).unwrap().node_maps;
        assert!(maps.rejected.contains_key("node-b"), "{:?}", maps.rejected);
        // A node without an address: refused alone.
        let mut bare = view();
        Arc::make_mut(&mut Arc::make_mut(&mut bare.nodes)[1])
            .addresses
            .clear();
        let maps = compile(&bare).unwrap().node_maps;
        assert_eq!(
            maps.rejected.get("node-b").map(String::as_str),
            Some("node node-b: status.addresses has no InternalIP")
        );
        assert!(
            maps.remote_v4.contains_key(&(24, [10, 244, 3, 0])),
            "node-c still routed"
        );
        assert!(!maps.remote_v4.contains_key(&(24, [10, 244, 2, 0])));
    }
}
