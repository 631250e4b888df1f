//! The hybrid overlay's view of the cluster: the nodes that do not run the dataplane (Windows
//! nodes, labelled `kubernetes.io/os=windows`) with the subnet and router MAC they announce,
//! and this node's own router address and MAC on it.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
};

use ipnet::{IpNet, Ipv4Net};
use k8s_openapi::api::core::v1::Node;

use dataplane_common::overlay::{FAMILY_IPV4, TUNNEL_VXLAN, TunnelEndpoint};

use crate::{
    api::network::{HybridSettings, overlaps},
    kernel::netdev::{mac_text, parse_mac},
    mapsync::addr16,
};

use super::view::internal_ips;

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
    let Some(router_mac) = parse_mac(&mac_text) else {
        return warn(format!(
            "annotation {ROUTER_MAC_ANNOTATION} {mac_text:?} is not a MAC address"
        ));
    };
    let address = internal_ips(node).find_map(|a| a.parse::<Ipv4Addr>().ok());
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
        .and_then(|m| parse_mac(m))
        .unwrap_or_else(|| router_mac(router_ip))
}

/// The annotations this node announces (with `--kubernetes` the agent writes them on its Node).
pub fn own_annotations(router_ip: Ipv4Addr, router_mac: &[u8; 6]) -> BTreeMap<String, String> {
    BTreeMap::from([
        (ROUTER_IP_ANNOTATION.to_owned(), router_ip.to_string()),
        (ROUTER_MAC_ANNOTATION.to_owned(), mac_text(router_mac)),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(v: &[&str]) -> Vec<IpNet> {
        v.iter().map(|c| c.parse().expect("cidr")).collect()
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
            host_prefix: None,
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
}
