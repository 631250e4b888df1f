//! The hybrid overlay, agent side: pods of nodes that do not run the dataplane (Windows nodes,
//! as OVN-Kubernetes' hybrid overlay has them) reached over VXLAN.
//!
//! - Settings: `ovnKubernetesConfig.hybridOverlayConfig` of the operator's `Network` (at most
//!   one `hybridClusterNetwork`, outside the cluster and service networks; the VXLAN port,
//!   default 4789, neither 0 nor the Geneve port), validated with the field named.
//! - Hybrid nodes: Nodes labelled `kubernetes.io/os=windows` that announce their pod subnet
//!   and router MAC in the `k8s.ovn.org/hybrid-overlay-*` annotations. A node whose
//!   annotations are missing or wrong is skipped with a warning naming it, and its routes go.
//! - This node: its router address is the third address of its IPv4 pod subnet (never a pod's:
//!   the IPAM keeps it), its router MAC `0a:58` and that address (OVN-Kubernetes' rule), unless
//!   its Node object names another. With `--kubernetes` the agent writes both annotations on
//!   its own Node, where hybrid nodes read them.
//! - Compile (pure): the hybrid nodes' subnets become routes of kind VXLAN beside the Geneve
//!   ones (`overlay::compile`), their MACs and the settings the hybrid maps.

use std::sync::Arc;
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
};

use aya::maps::{Array, HashMap, MapData};
use dataplane_common::{
    hybrid::{HYBRID_DEFAULT_PORT, HYBRID_ENABLED, HybridConfig, HybridNode, VXLAN_OVERHEAD},
    maps,
    overlay::{Addr, FAMILY_IPV4, TUNNEL_VXLAN, TunnelEndpoint},
};
use ipnet::{IpNet, Ipv4Net};
use k8s_openapi::api::core::v1::Node;
use serde::Deserialize;

use crate::{
    AgentError, Dataplane,
    mapsync::{SyncStats, addr16, sync_hash},
};

/// A hybrid node's pod subnet (and, on this dataplane's nodes, nothing: they have podCIDRs).
pub const NODE_SUBNET_ANNOTATION: &str = "k8s.ovn.org/hybrid-overlay-node-subnet";
/// A node's router MAC: the inner destination MAC its VXLAN accepts.
pub const ROUTER_MAC_ANNOTATION: &str = "k8s.ovn.org/hybrid-overlay-distributed-router-gateway-mac";
/// A dataplane node's router address (the third address of its pod subnet).
pub const ROUTER_IP_ANNOTATION: &str = "k8s.ovn.org/hybrid-overlay-distributed-router-gateway-ip";
/// The label that makes a node a hybrid one.
pub const OS_LABEL: &str = "kubernetes.io/os";
/// Its value on hybrid nodes.
pub const HYBRID_OS: &str = "windows";

/// `ovnKubernetesConfig.hybridOverlayConfig` as the operator writes it.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HybridOverlayConfig {
    #[serde(default)]
    pub hybrid_cluster_network: Vec<HybridNetworkEntry>,
    /// Read wide so that an out-of-range value is refused with the field named.
    #[serde(rename = "hybridOverlayVXLANPort")]
    pub vxlan_port: Option<u64>,
}

/// One `hybridClusterNetwork` entry.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HybridNetworkEntry {
    pub cidr: String,
    /// Each hybrid node's slice; hybrid nodes carry their own subnet, so it is only checked.
    pub host_prefix: Option<u8>,
}

/// Validated hybrid overlay settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HybridSettings {
    /// The hybrid nodes' pod subnets lie in it (any subnet outside the cluster's own networks
    /// when none is given).
    pub network: Option<Ipv4Net>,
    pub vxlan_port: u16,
}

/// Why the hybrid overlay settings were refused. Each message names the field.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HybridError {
    #[error("hybridOverlayConfig.hybridClusterNetwork: {count} networks; at most one is supported")]
    TooManyNetworks { count: usize },
    #[error("hybridOverlayConfig.hybridClusterNetwork[0].cidr: {cidr:?} is not an IPv4 CIDR")]
    BadCidr { cidr: String },
    #[error(
        "hybridOverlayConfig.hybridClusterNetwork[0].hostPrefix: {prefix} is not between the \
         network's prefix length {network} and 32"
    )]
    BadHostPrefix { prefix: u8, network: u8 },
    #[error("hybridOverlayConfig.hybridClusterNetwork[0].cidr: {cidr} overlaps {field} {other}")]
    Overlap {
        cidr: Ipv4Net,
        field: &'static str,
        other: IpNet,
    },
    #[error("hybridOverlayConfig.hybridOverlayVXLANPort: 0 is not a port")]
    PortZero,
    #[error("hybridOverlayConfig.hybridOverlayVXLANPort: {port} is not a port")]
    PortOutOfRange { port: u64 },
    #[error(
        "hybridOverlayConfig.hybridOverlayVXLANPort: {port} is the Geneve port \
         (ovnKubernetesConfig.genevePort); choose another"
    )]
    PortIsGeneve { port: u16 },
}

impl HybridOverlayConfig {
    /// Checks the settings against the cluster's networks and the Geneve port.
    pub fn validate(
        &self,
        cluster_networks: &[IpNet],
        service_networks: &[IpNet],
        geneve_port: u16,
    ) -> Result<HybridSettings, HybridError> {
        if self.hybrid_cluster_network.len() > 1 {
            return Err(HybridError::TooManyNetworks {
                count: self.hybrid_cluster_network.len(),
            });
        }
        let network = match self.hybrid_cluster_network.first() {
            Some(entry) => Some(checked_network(entry, cluster_networks, service_networks)?),
            None => None,
        };
        let vxlan_port = match self.vxlan_port {
            None => HYBRID_DEFAULT_PORT,
            Some(0) => return Err(HybridError::PortZero),
            Some(port) => u16::try_from(port).map_err(|_| HybridError::PortOutOfRange { port })?,
        };
        if vxlan_port == geneve_port {
            return Err(HybridError::PortIsGeneve { port: vxlan_port });
        }
        Ok(HybridSettings {
            network,
            vxlan_port,
        })
    }
}

fn checked_network(
    entry: &HybridNetworkEntry,
    cluster_networks: &[IpNet],
    service_networks: &[IpNet],
) -> Result<Ipv4Net, HybridError> {
    let cidr = entry
        .cidr
        .parse::<Ipv4Net>()
        .map_err(|_| HybridError::BadCidr {
            cidr: entry.cidr.clone(),
        })?
        .trunc();
    if let Some(prefix) = entry.host_prefix
        && (prefix < cidr.prefix_len() || prefix > 32)
    {
        return Err(HybridError::BadHostPrefix {
            prefix,
            network: cidr.prefix_len(),
        });
    }
    let fields = cluster_networks
        .iter()
        .map(|n| ("spec.clusterNetwork", n))
        .chain(service_networks.iter().map(|n| ("spec.serviceNetwork", n)));
    for (field, other) in fields {
        if overlaps(&IpNet::V4(cidr), other) {
            return Err(HybridError::Overlap {
                cidr,
                field,
                other: *other,
            });
        }
    }
    Ok(cidr)
}

fn overlaps(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

/// A hybrid node as the overlay needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HybridNodeView {
    pub name: String,
    /// Its underlay address: the outer destination of its VXLAN, and the only source accepted.
    pub address: Ipv4Addr,
    pub subnet: Ipv4Net,
    pub router_mac: [u8; 6],
}

/// Everything the hybrid compile needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HybridView {
    pub settings: HybridSettings,
    pub nodes: Vec<HybridNodeView>,
    /// This node's router address (the third of its IPv4 pod subnet; never a pod's).
    pub router_ip: Ipv4Addr,
    /// This node's router MAC (inner source out, inner destination in).
    pub router_mac: [u8; 6],
    /// The underlay's MTU: less the VXLAN overhead, the largest packet towards a hybrid pod.
    pub underlay_mtu: u32,
    /// The management port's host side (`crate::mgmt::HOST_SIDE`), once it exists.
    pub mgmt_ifindex: u32,
}

/// Whether `node` is a hybrid node (labelled `kubernetes.io/os=windows`).
pub fn is_hybrid_node(node: &Node) -> bool {
    node.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(OS_LABEL))
        .is_some_and(|os| os == HYBRID_OS)
}

/// The hybrid nodes of the cluster, each with its subnet, router MAC and IPv4 address; one
/// warning (naming node and annotation) per hybrid node that cannot be used. Its subnet must
/// lie in the hybrid network, when one is configured, and overlap no other's.
pub fn hybrid_nodes<'a>(
    nodes: impl IntoIterator<Item = &'a Arc<Node>>,
    settings: &HybridSettings,
    warnings: &mut Vec<String>,
) -> Vec<HybridNodeView> {
    let mut views: Vec<HybridNodeView> = Vec::new();
    for node in nodes.into_iter().filter(|n| is_hybrid_node(n)) {
        let Some(view) = hybrid_node(node, settings, warnings) else {
            continue;
        };
        if let Some(other) = views
            .iter()
            .find(|v| overlaps(&IpNet::V4(v.subnet), &IpNet::V4(view.subnet)))
        {
            warnings.push(format!(
                "node {}: annotation {NODE_SUBNET_ANNOTATION} {} overlaps node {}'s {}; not routed",
                view.name, view.subnet, other.name, other.subnet
            ));
            continue;
        }
        views.push(view);
    }
    views
}

fn hybrid_node(
    node: &Node,
    settings: &HybridSettings,
    warnings: &mut Vec<String>,
) -> Option<HybridNodeView> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let annotation = |key: &str| {
        node.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(key))
            .map(|v| v.trim().to_owned())
    };
    let mut warn = |what: String| {
        warnings.push(format!("hybrid node {name}: {what}; not routed"));
        None
    };
    let Some(subnet_text) = annotation(NODE_SUBNET_ANNOTATION) else {
        return warn(format!("no annotation {NODE_SUBNET_ANNOTATION} yet"));
    };
    let Ok(subnet) = subnet_text.parse::<Ipv4Net>() else {
        return warn(format!(
            "annotation {NODE_SUBNET_ANNOTATION} {subnet_text:?} is not an IPv4 CIDR"
        ));
    };
    let subnet = subnet.trunc();
    if let Some(network) = settings.network
        && !network.contains(&subnet)
    {
        return warn(format!(
            "annotation {NODE_SUBNET_ANNOTATION} {subnet} is outside \
             hybridOverlayConfig.hybridClusterNetwork {network}"
        ));
    }
    let Some(mac_text) = annotation(ROUTER_MAC_ANNOTATION) else {
        return warn(format!("no annotation {ROUTER_MAC_ANNOTATION} yet"));
    };
    let Some(router_mac) = crate::netdev::parse_mac(&mac_text) else {
        return warn(format!(
            "annotation {ROUTER_MAC_ANNOTATION} {mac_text:?} is not a MAC address"
        ));
    };
    let address = crate::model::internal_ips(node).find_map(|a| a.parse::<Ipv4Addr>().ok());
    let Some(address) = address else {
        return warn("status.addresses has no IPv4 InternalIP".to_owned());
    };
    Some(HybridNodeView {
        name,
        address,
        subnet,
        router_mac,
    })
}

/// This node's router address on the hybrid overlay: the third address of its IPv4 pod subnet
/// (after the network address, the gateway and the management port), never a pod's.
pub fn router_ip(pod_cidrs: &[IpNet]) -> Option<Ipv4Addr> {
    pod_cidrs.iter().find_map(|cidr| match cidr.trunc() {
        IpNet::V4(net) if net.prefix_len() <= 29 => {
            Some(Ipv4Addr::from(u32::from(net.network()) + 3))
        }
        _ => None,
    })
}

/// The MAC derived from an IPv4 address as OVN-Kubernetes derives its ports' (`0a:58` and the
/// address), so it is the same on every start.
pub fn router_mac(ip: Ipv4Addr) -> [u8; 6] {
    let o = ip.octets();
    [0x0a, 0x58, o[0], o[1], o[2], o[3]]
}

/// This node's router MAC: what its Node object announces, else the derived one.
pub fn own_router_mac(node: Option<&Node>, router_ip: Ipv4Addr) -> [u8; 6] {
    node.and_then(|n| n.metadata.annotations.as_ref())
        .and_then(|a| a.get(ROUTER_MAC_ANNOTATION))
        .and_then(|m| crate::netdev::parse_mac(m))
        .unwrap_or_else(|| router_mac(router_ip))
}

/// The annotations this node announces (with `--kubernetes` the agent writes them on its Node).
pub fn own_annotations(router_ip: Ipv4Addr, router_mac: &[u8; 6]) -> BTreeMap<String, String> {
    BTreeMap::from([
        (ROUTER_IP_ANNOTATION.to_owned(), router_ip.to_string()),
        (
            ROUTER_MAC_ANNOTATION.to_owned(),
            crate::netdev::mac_text(router_mac),
        ),
    ])
}

/// The hybrid pods' addresses, inside the cluster as the pods' own are (no gateway SNAT, no
/// egress IP towards them): the hybrid network, or without one each hybrid node's subnet.
pub fn internal_networks(view: Option<&HybridView>) -> Vec<IpNet> {
    let Some(view) = view else {
        return Vec::new();
    };
    match view.settings.network {
        Some(network) => vec![IpNet::V4(network)],
        None => view.nodes.iter().map(|n| IpNet::V4(n.subnet)).collect(),
    }
}

/// The exact desired contents of the hybrid maps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HybridMaps {
    pub config: HybridConfig,
    pub nodes: BTreeMap<Addr, HybridNode>,
}

/// Compiles the hybrid view into the hybrid maps (all zero without one). Pure.
pub fn compile(view: Option<&HybridView>) -> HybridMaps {
    let Some(view) = view else {
        return HybridMaps::default();
    };
    HybridMaps {
        config: HybridConfig {
            vxlan_port: view.settings.vxlan_port,
            flags: HYBRID_ENABLED,
            mtu: view.underlay_mtu.saturating_sub(VXLAN_OVERHEAD),
            mgmt_ifindex: view.mgmt_ifindex,
            router_mac: view.router_mac,
            _pad: [0; 2],
        },
        nodes: view
            .nodes
            .iter()
            .map(|n| {
                (
                    addr16(IpAddr::V4(n.address)),
                    HybridNode {
                        router_mac: n.router_mac,
                        _pad: [0; 2],
                    },
                )
            })
            .collect(),
    }
}

/// The hybrid nodes' subnets as routes of the IPv4 pod-CIDR map, of kind VXLAN; and the
/// hybrid network itself, when configured, as a route to no node (address 0.0.0.0): the
/// kernel drops what no hybrid node announces (`hybrid_no_node`) instead of letting it out.
pub fn routes(view: Option<&HybridView>) -> BTreeMap<(u32, [u8; 4]), TunnelEndpoint> {
    let Some(view) = view else {
        return BTreeMap::new();
    };
    let route = |net: Ipv4Net, node: Ipv4Addr| {
        (
            (u32::from(net.prefix_len()), net.network().octets()),
            TunnelEndpoint {
                addr: addr16(IpAddr::V4(node)),
                family: FAMILY_IPV4,
                kind: TUNNEL_VXLAN,
                _pad: [0; 2],
            },
        )
    };
    view.settings
        .network
        .map(|network| route(network, Ipv4Addr::UNSPECIFIED))
        .into_iter()
        .chain(view.nodes.iter().map(|n| route(n.subnet, n.address)))
        .collect()
}

impl Dataplane {
    /// Makes the hybrid maps equal `desired`: the nodes first, so no VXLAN route leads to a
    /// node the kernel does not know, then the settings.
    pub fn sync_hybrid(&mut self, desired: &HybridMaps) -> Result<SyncStats, AgentError> {
        let sync_err = |name: &'static str| {
            move |source| AgentError::Map {
                name: name.into(),
                action: "sync",
                source,
            }
        };
        let mut stats = SyncStats::default();
        let mut nodes: HashMap<&mut MapData, Addr, HybridNode> =
            self.typed_map(maps::HYBRID_NODES)?;
        stats.add(sync_hash(&mut nodes, &desired.nodes).map_err(sync_err(maps::HYBRID_NODES))?);
        let mut config: Array<&mut MapData, HybridConfig> = self.typed_map(maps::HYBRID_CONFIG)?;
        let current = config.get(&0, 0).map_err(sync_err(maps::HYBRID_CONFIG))?;
        if current != desired.config {
            config
                .set(0, desired.config, 0)
                .map_err(sync_err(maps::HYBRID_CONFIG))?;
            stats.written += 1;
        }
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(v: &[&str]) -> Vec<IpNet> {
        v.iter().map(|c| c.parse().expect("cidr")).collect()
    }

    fn config(cidrs: &[&str], port: Option<u64>) -> HybridOverlayConfig {
        HybridOverlayConfig {
            hybrid_cluster_network: cidrs
                .iter()
                .map(|c| HybridNetworkEntry {
                    cidr: (*c).to_owned(),
                    host_prefix: Some(26),
                })
                .collect(),
            vxlan_port: port,
        }
    }

    fn validate(config: &HybridOverlayConfig) -> Result<HybridSettings, String> {
        config
            .validate(
                &nets(&["10.128.0.0/14", "fd00:10:128::/48"]),
                &nets(&["172.30.0.0/16"]),
                6081,
            )
            .map_err(|e| e.to_string())
    }

    #[test]
    fn settings_default_to_the_vxlan_port_and_name_the_field_they_refuse() {
        assert_eq!(
            validate(&config(&["10.132.0.0/14"], None)),
            Ok(HybridSettings {
                network: Some("10.132.0.0/14".parse().unwrap()),
                vxlan_port: 4789
            })
        );
        assert_eq!(
            validate(&config(&["10.132.0.0/14"], Some(9898))).map(|s| s.vxlan_port),
            Ok(9898)
        );
        assert_eq!(
            validate(&config(&["10.132.0.0/14", "10.140.0.0/14"], None)),
            Err(
                "hybridOverlayConfig.hybridClusterNetwork: 2 networks; at most one is supported"
                    .to_owned()
            )
        );
        assert_eq!(
            validate(&config(&["10.130.0.0/16"], None)),
            Err(
                "hybridOverlayConfig.hybridClusterNetwork[0].cidr: 10.130.0.0/16 overlaps \
                 spec.clusterNetwork 10.128.0.0/14"
                    .to_owned()
            )
        );
        assert_eq!(
            validate(&config(&["172.30.5.0/24"], None)),
            Err(
                "hybridOverlayConfig.hybridClusterNetwork[0].cidr: 172.30.5.0/24 overlaps \
                 spec.serviceNetwork 172.30.0.0/16"
                    .to_owned()
            )
        );
        assert_eq!(
            validate(&config(&["10.132.0.0/14"], Some(0))),
            Err("hybridOverlayConfig.hybridOverlayVXLANPort: 0 is not a port".to_owned())
        );
        assert_eq!(
            validate(&config(&["10.132.0.0/14"], Some(70000))),
            Err("hybridOverlayConfig.hybridOverlayVXLANPort: 70000 is not a port".to_owned())
        );
        assert_eq!(
            validate(&config(&["10.132.0.0/14"], Some(6081))),
            Err(
                "hybridOverlayConfig.hybridOverlayVXLANPort: 6081 is the Geneve port \
                 (ovnKubernetesConfig.genevePort); choose another"
                    .to_owned()
            )
        );
        assert_eq!(
            validate(&config(&["fd00::/64"], None)),
            Err("hybridOverlayConfig.hybridClusterNetwork[0].cidr: \"fd00::/64\" is not an IPv4 CIDR"
                .to_owned())
        );
        let mut wide = config(&["10.132.0.0/14"], None);
        wide.hybrid_cluster_network[0].host_prefix = Some(12);
        assert_eq!(
            validate(&wide),
            Err(
                "hybridOverlayConfig.hybridClusterNetwork[0].hostPrefix: 12 is not between the \
                 network's prefix length 14 and 32"
                    .to_owned()
            )
        );
    }

    fn windows_node(name: &str, address: &str, annotations: &[(&str, &str)]) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name,
                "labels": {"kubernetes.io/os": "windows"},
                "annotations": annotations.iter().map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>(),
            },
            "status": {"addresses": [{"type": "InternalIP", "address": address}]},
        }))
        .expect("node")
    }

    #[test]
    fn hybrid_nodes_need_their_annotations_and_a_subnet_of_the_hybrid_network() {
        let settings = HybridSettings {
            network: Some("10.132.0.0/14".parse().unwrap()),
            vxlan_port: 4789,
        };
        let nodes = vec![
            windows_node(
                "win-a",
                "10.99.0.20",
                &[
                    (NODE_SUBNET_ANNOTATION, "10.132.0.0/24"),
                    (ROUTER_MAC_ANNOTATION, "00:15:5d:01:02:03"),
                ],
            ),
            windows_node(
                "win-b",
                "10.99.0.21",
                &[(NODE_SUBNET_ANNOTATION, "10.132.1.0/24")],
            ),
            windows_node(
                "win-c",
                "10.99.0.22",
                &[
                    (NODE_SUBNET_ANNOTATION, "10.140.0.0/24"),
                    (ROUTER_MAC_ANNOTATION, "00:15:5d:01:02:04"),
                ],
            ),
            windows_node(
                "win-d",
                "10.99.0.23",
                &[
                    (NODE_SUBNET_ANNOTATION, "10.132.0.128/25"),
                    (ROUTER_MAC_ANNOTATION, "00:15:5d:01:02:05"),
                ],
            ),
            windows_node(
                "win-e",
                "10.99.0.24",
                &[
                    (NODE_SUBNET_ANNOTATION, "10.132.2.0/24"),
                    (ROUTER_MAC_ANNOTATION, "not-a-mac"),
                ],
            ),
        ];
        let mut warnings = Vec::new();
        let nodes: Vec<Arc<Node>> = nodes.into_iter().map(Arc::new).collect();
        let views = hybrid_nodes(&nodes, &settings, &mut warnings);
        assert_eq!(
            views,
            vec![HybridNodeView {
                name: "win-a".into(),
                address: "10.99.0.20".parse().unwrap(),
                subnet: "10.132.0.0/24".parse().unwrap(),
                router_mac: [0x00, 0x15, 0x5d, 1, 2, 3],
            }]
        );
        assert_eq!(
            warnings,
            vec![
                format!("hybrid node win-b: no annotation {ROUTER_MAC_ANNOTATION} yet; not routed"),
                format!(
                    "hybrid node win-c: annotation {NODE_SUBNET_ANNOTATION} 10.140.0.0/24 is \
                     outside hybridOverlayConfig.hybridClusterNetwork 10.132.0.0/14; not routed"
                ),
                format!(
                    "node win-d: annotation {NODE_SUBNET_ANNOTATION} 10.132.0.128/25 overlaps \
                     node win-a's 10.132.0.0/24; not routed"
                ),
                format!(
                    "hybrid node win-e: annotation {ROUTER_MAC_ANNOTATION} \"not-a-mac\" is not a \
                     MAC address; not routed"
                ),
            ]
        );
    }

    #[test]
    fn the_router_address_is_the_third_of_the_pod_subnet_and_its_mac_follows_it() {
        let ip = router_ip(&nets(&["fd00:10:244:1::/64", "10.244.1.0/24"])).unwrap();
        assert_eq!(ip, "10.244.1.3".parse::<Ipv4Addr>().unwrap());
        assert_eq!(router_mac(ip), [0x0a, 0x58, 10, 244, 1, 3]);
        assert_eq!(
            own_annotations(ip, &router_mac(ip)),
            BTreeMap::from([
                (ROUTER_IP_ANNOTATION.to_owned(), "10.244.1.3".to_owned()),
                (
                    ROUTER_MAC_ANNOTATION.to_owned(),
                    "0a:58:0a:f4:01:03".to_owned()
                ),
            ])
        );
        assert_eq!(router_ip(&nets(&["fd00:10:244:1::/64"])), None);
    }

    #[test]
    fn compile_gives_vxlan_routes_the_nodes_macs_and_the_vxlan_mtu() {
        let view = HybridView {
            settings: HybridSettings {
                network: None,
                vxlan_port: 9898,
            },
            nodes: vec![HybridNodeView {
                name: "win-a".into(),
                address: "10.99.0.20".parse().unwrap(),
                subnet: "10.132.0.0/24".parse().unwrap(),
                router_mac: [0, 0x15, 0x5d, 1, 2, 3],
            }],
            router_ip: "10.244.1.3".parse().unwrap(),
            router_mac: [0x0a, 0x58, 10, 244, 1, 3],
            underlay_mtu: 1500,
            mgmt_ifindex: 9,
        };
        let maps = compile(Some(&view));
        assert_eq!(
            maps.config,
            HybridConfig {
                vxlan_port: 9898,
                flags: HYBRID_ENABLED,
                mtu: 1450,
                mgmt_ifindex: 9,
                router_mac: [0x0a, 0x58, 10, 244, 1, 3],
                _pad: [0; 2],
            }
        );
        let node = addr16("10.99.0.20".parse().unwrap());
        assert_eq!(maps.nodes[&node].router_mac, [0, 0x15, 0x5d, 1, 2, 3]);
        let routes = routes(Some(&view));
        assert_eq!(
            routes[&(24, [10, 132, 0, 0])],
            TunnelEndpoint {
                addr: node,
                family: FAMILY_IPV4,
                kind: TUNNEL_VXLAN,
                _pad: [0; 2],
            }
        );
        assert_eq!(routes.len(), 1);
        assert_eq!(compile(None), HybridMaps::default());
        assert!(super::routes(None).is_empty());
        // With a hybrid network, the rest of it leads to no node.
        let mut with_network = view.clone();
        with_network.settings.network = Some("10.132.0.0/14".parse().unwrap());
        let routes = super::routes(Some(&with_network));
        assert_eq!(routes.len(), 2);
        assert_eq!(
            routes[&(14, [10, 132, 0, 0])].addr,
            addr16("0.0.0.0".parse().unwrap())
        );
    }
}
