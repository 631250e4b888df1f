//! The node's own way into the overlay, as OVN-Kubernetes' management port (`ovn-k8s-mp0`):
//! the Kubernetes network model has the node (its agents, host-network pods) reach every pod
//! on every node without NAT, and pods reach every node. A veth pair in the node's namespace,
//! `dp-mp0` (the host's side, routed to) and `dp-mp1` (the overlay's side, where
//! `tc_from_pod` runs as on a pod's veth); every other node's pod CIDRs are routed into
//! `dp-mp0` with this node's own address as the source. So the host's packets for a pod on
//! another node are wrapped in Geneve to that node like a pod's, and so are its answers to a
//! remote pod that reached it (a pod keeps its own address towards other nodes: their answers
//! come back this way, and policy judges the pod by its address).
//!
//! The routes' next hop is a link-local gateway with a permanent neighbour entry naming
//! `dp-mp1`, as the pods' own gateway: no ARP crosses the pair. The pair's MTU is the pod MTU,
//! so the host's packets leave room for the encapsulation as the pods' do. Replies from remote
//! pods to this node's address return over the underlay, beside the route that sends to them:
//! a strict reverse-path filter on the underlay would drop them, so it is made loose (2), as
//! OVN-Kubernetes has it.

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use futures_util::TryStreamExt as _;
use ipnet::IpNet;
use rtnetlink::{
    Handle, LinkMessageBuilder, LinkUnspec, LinkVeth, RouteMessageBuilder,
    packet_route::{
        AddressFamily,
        link::{InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags},
        neighbour::NeighbourState,
        route::{
            RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteType,
        },
    },
};

use crate::{
    api::network::OverlaySettings,
    error::AgentError,
    kernel::{netdev, netns},
    model::{OverlayView, hybrid::internal_networks},
};

/// The host's side of the pair: the routes to other nodes' pods point into it.
pub const HOST_SIDE: &str = "dp-mp0";
/// The overlay's side: `tc_from_pod` on its ingress takes what the host sends.
pub const OVERLAY_SIDE: &str = "dp-mp1";
/// The next hop of the routes (IPv4), answered by a permanent neighbour entry. Not the pods'
/// gateway (169.254.1.1), which the node holds on every pod veth: a route cannot go via a
/// local address.
const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 1);
/// The next hop of the routes (IPv6), likewise not the pods' (fe80::1).
const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0xd, 1);

/// What one sync made of the management port.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct MgmtSync {
    /// `ifindex` of [`OVERLAY_SIDE`].
    pub ifindex: u32,
    /// `ifindex` of [`HOST_SIDE`]: what is sent into it comes out at `tc_from_pod` on the
    /// overlay's side.
    pub host_ifindex: u32,
    pub routes_added: usize,
    pub routes_removed: usize,
}

/// The routes the host needs: every other node's pod CIDRs (hybrid nodes' subnets too) and the
/// service networks, of a family this node has an address in, with that address as the
/// source. The service networks make the node's own clients (the kubelet, host-network pods,
/// node daemons) reach ClusterIPs as kube-proxy's output chain has them do: their packets
/// enter `tc_from_pod` on the overlay's side, whose load-balancer translates them as a pod's.
pub fn wanted_routes(view: &OverlayView, service_networks: &[IpNet]) -> Vec<(IpNet, IpAddr)> {
    let Some(this) = view.this_node_view() else {
        return Vec::new();
    };
    let source = |v4: bool| this.addresses.iter().copied().find(|a| a.is_ipv4() == v4);
    let hybrid = internal_networks(view.hybrid.as_ref());
    view.nodes
        .iter()
        .filter(|n| n.name != view.this_node)
        .flat_map(|n| n.pod_cidrs.iter().copied())
        .chain(hybrid)
        .chain(service_networks.iter().copied())
        .filter_map(|cidr| {
            let cidr = cidr.trunc();
            source(matches!(cidr, IpNet::V4(_))).map(|src| (cidr, src))
        })
        .collect()
}

/// Makes the management port exist, up, at the pod MTU, with its gateway neighbours and
/// exactly the routes `view` needs; makes the underlay's reverse-path filter loose. Every
/// sync that touches a pod runs this, so it talks netlink from the agent (a few requests,
/// microseconds each) and changes only what differs.
pub fn sync(
    view: &OverlayView,
    settings: &OverlaySettings,
    underlay: &str,
    service_networks: &[IpNet],
) -> Result<MgmtSync, AgentError> {
    let wanted = wanted_routes(view, service_networks);
    let mtu = settings.pod_mtu;
    // A thread of its own: the agent's loop is async and cannot wait on another runtime.
    let result = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let failed = |detail: String| netlink_failed("connection", detail);
                netns::with_netlink(NETLINK_DEADLINE, failed, |handle| {
                    sync_port(handle, mtu, wanted)
                })
            })
            .join()
            .unwrap_or_else(|_| Err(netlink_failed("thread", "panicked".into())))
    })?;
    loosen_reverse_path_filter(underlay);
    Ok(result)
}

/// How long the management port's netlink exchange may take: the kernel answers in
/// microseconds; one that hangs must not hold the agent's loop for ever.
const NETLINK_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

async fn sync_port(
    handle: Handle,
    mtu: u32,
    wanted: Vec<(IpNet, IpAddr)>,
) -> Result<MgmtSync, AgentError> {
    if link(&handle, HOST_SIDE).await?.is_none() {
        let peer = LinkUnspec::new_with_name(OVERLAY_SIDE).build();
        let pair = LinkMessageBuilder::<LinkVeth>::new_with_info_kind(InfoKind::Veth)
            .name(HOST_SIDE.to_owned())
            .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
            .build();
        let add = handle.link().add(pair).execute();
        add.await
            .map_err(|e| netlink_failed("link add dp-mp0 type veth", e.to_string()))?;
        tracing::info!(
            host = HOST_SIDE,
            overlay = OVERLAY_SIDE,
            "management port created"
        );
    }
    let mut indexes = [0u32; 2];
    for (side, index) in [HOST_SIDE, OVERLAY_SIDE].into_iter().zip(&mut indexes) {
        let found = link(&handle, side)
            .await?
            .ok_or_else(|| netlink_failed(&format!("link get {side}"), "no such link".into()))?;
        *index = found.index;
        if found.mtu != Some(mtu) || !found.up {
            let set = LinkUnspec::new_with_index(found.index)
                .mtu(mtu)
                .up()
                .build();
            let set = handle.link().set(set).execute();
            set.await.map_err(|e| {
                netlink_failed(&format!("link set {side} mtu {mtu} up"), e.to_string())
            })?;
        }
    }
    let [host_ifindex, ifindex] = indexes;
    let overlay_mac = netdev::mac(OVERLAY_SIDE).map_err(|source| AgentError::Io {
        action: "reading the MAC of",
        path: OVERLAY_SIDE.into(),
        source,
    })?;
    for gateway in [IpAddr::V4(GATEWAY_V4), IpAddr::V6(GATEWAY_V6)] {
        let add = handle
            .neighbours()
            .add(host_ifindex, gateway)
            .link_layer_address(&overlay_mac)
            .state(NeighbourState::Permanent)
            .replace()
            .execute();
        add.await.map_err(|e| {
            netlink_failed(
                &format!("neigh replace {gateway} dev {HOST_SIDE}"),
                e.to_string(),
            )
        })?;
    }
    let mut result = MgmtSync {
        ifindex,
        host_ifindex,
        ..MgmtSync::default()
    };
    let present = present_routes(&handle, host_ifindex).await?;
    for &(cidr, source) in &wanted {
        if present.contains(&cidr) {
            continue;
        }
        let add = handle
            .route()
            .add(route_via_gateway(cidr, Some(source), host_ifindex))
            .replace();
        add.execute().await.map_err(|e| {
            netlink_failed(
                &format!("route replace {cidr} dev {HOST_SIDE}"),
                e.to_string(),
            )
        })?;
        result.routes_added += 1;
    }
    let wanted: BTreeSet<IpNet> = wanted.iter().map(|(cidr, _)| *cidr).collect();
    for &stale in present.difference(&wanted) {
        let route = route_via_gateway(stale, None, host_ifindex);
        let del = handle.route().del(route).execute();
        del.await.map_err(|e| {
            netlink_failed(&format!("route del {stale} dev {HOST_SIDE}"), e.to_string())
        })?;
        result.routes_removed += 1;
    }
    Ok(result)
}

/// What the agent needs of a link: its index, MTU and whether it is up.
struct Link {
    index: u32,
    mtu: Option<u32>,
    up: bool,
}

/// Link `name` in this namespace, or `None` when there is none.
async fn link(handle: &Handle, name: &str) -> Result<Option<Link>, AgentError> {
    let mut links = handle.link().get().match_name(name.to_owned()).execute();
    match links.try_next().await {
        Ok(Some(link)) => Ok(Some(Link {
            index: link.header.index,
            mtu: link.attributes.iter().find_map(|a| match a {
                LinkAttribute::Mtu(mtu) => Some(*mtu),
                _ => None,
            }),
            up: link.header.flags.contains(LinkFlags::Up),
        })),
        Ok(None) | Err(rtnetlink::Error::NetlinkError(_)) => Ok(None),
        Err(error) => Err(netlink_failed(
            &format!("link get {name}"),
            error.to_string(),
        )),
    }
}

/// A route to `cidr` through the family's gateway, on-link out of `index`, from `source` when
/// given and of the family (protocol boot, as `ip route` makes them).
fn route_via_gateway(cidr: IpNet, source: Option<IpAddr>, index: u32) -> RouteMessage {
    let mut route = match cidr {
        IpNet::V4(net) => {
            let mut route = RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(net.addr(), net.prefix_len())
                .gateway(GATEWAY_V4);
            if let Some(IpAddr::V4(source)) = source {
                route = route.pref_source(source);
            }
            route.output_interface(index).onlink().build()
        }
        IpNet::V6(net) => {
            let mut route = RouteMessageBuilder::<Ipv6Addr>::new()
                .destination_prefix(net.addr(), net.prefix_len())
                .gateway(GATEWAY_V6);
            if let Some(IpAddr::V6(source)) = source {
                route = route.pref_source(source);
            }
            route.output_interface(index).onlink().build()
        }
    };
    route.header.protocol = RouteProtocol::Boot;
    route
}

/// The main table's unicast routes out of the host's side of the pair that a sync put there
/// (the kernel's own link-local route is not ours).
async fn present_routes(handle: &Handle, host_ifindex: u32) -> Result<BTreeSet<IpNet>, AgentError> {
    let mut present = BTreeSet::new();
    for dump in [
        RouteMessageBuilder::<Ipv4Addr>::new().build(),
        RouteMessageBuilder::<Ipv6Addr>::new().build(),
    ] {
        let mut routes = handle.route().get(dump).execute();
        while let Some(route) = routes
            .try_next()
            .await
            .map_err(|e| netlink_failed("route show", e.to_string()))?
        {
            if let Some(cidr) = ours(&route, host_ifindex) {
                present.insert(cidr);
            }
        }
    }
    Ok(present)
}

/// The destination of `route` when it is one of the management port's: main table,
/// unicast, out of `host_ifindex`, not the kernel's.
fn ours(route: &RouteMessage, host_ifindex: u32) -> Option<IpNet> {
    let header = &route.header;
    let table = route
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(table) => Some(*table),
            _ => None,
        })
        .unwrap_or(u32::from(header.table));
    if table != u32::from(RouteHeader::RT_TABLE_MAIN)
        || header.kind != RouteType::Unicast
        || header.protocol == RouteProtocol::Kernel
    {
        return None;
    }
    let mut out = None;
    let mut destination = None;
    for attribute in &route.attributes {
        match attribute {
            RouteAttribute::Oif(index) => out = Some(*index),
            RouteAttribute::Destination(RouteAddress::Inet(a)) => {
                destination = Some(IpAddr::V4(*a))
            }
            RouteAttribute::Destination(RouteAddress::Inet6(a)) => {
                destination = Some(IpAddr::V6(*a))
            }
            _ => {}
        }
    }
    if out != Some(host_ifindex) {
        return None;
    }
    let destination = destination.unwrap_or(if header.address_family == AddressFamily::Inet {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    });
    IpNet::new(destination, header.destination_prefix_length).ok()
}

/// Sets the underlay's IPv4 reverse-path filter to loose when it is strict (the effective
/// value is the larger of `all` and the interface's, so loose on the interface suffices).
fn loosen_reverse_path_filter(underlay: &str) {
    let path = crate::kernel::sysctl::path(&format!("net/ipv4/conf/{underlay}/rp_filter"));
    let all = std::fs::read_to_string(crate::kernel::sysctl::path("net/ipv4/conf/all/rp_filter"))
        .unwrap_or_default();
    let own = std::fs::read_to_string(&path).unwrap_or_default();
    if all.trim() != "1" && own.trim() != "1" {
        return;
    }
    match std::fs::write(&path, "2") {
        Ok(()) => tracing::info!(
            interface = underlay,
            "reverse-path filter made loose: replies of remote pods to this node arrive on the underlay"
        ),
        Err(error) => tracing::warn!(
            %error,
            interface = underlay,
            "could not make the reverse-path filter loose; remote pods' replies to this node may be dropped"
        ),
    }
}

fn netlink_failed(request: &str, detail: String) -> AgentError {
    AgentError::Netlink {
        request: request.to_owned(),
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        api::network::OvnKubernetesConfig,
        model::{NodeSeq, NodeView, Underlay},
    };

    #[test]
    fn every_other_nodes_pod_cidrs_are_routed_from_this_nodes_address_of_their_family() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let net = |s: &str| s.parse::<IpNet>().unwrap();
        let view = OverlayView {
            this_node: "a".into(),
            nodes: std::sync::Arc::new(NodeSeq::from_iter([
                std::sync::Arc::new(NodeView {
                    created: i64::MAX,
                    name: "a".into(),
                    addresses: vec![ip("10.99.0.1"), ip("fd99::1")],
                    pod_cidrs: vec![net("10.244.1.0/24"), net("fd00:10:244:1::/64")],
                }),
                std::sync::Arc::new(NodeView {
                    created: i64::MAX,
                    name: "b".into(),
                    addresses: vec![ip("10.99.0.2")],
                    pod_cidrs: vec![net("10.244.2.0/24"), net("fd00:10:244:2::/64")],
                }),
                std::sync::Arc::new(NodeView {
                    created: i64::MAX,
                    name: "c".into(),
                    addresses: vec![ip("10.99.0.3")],
                    pod_cidrs: vec![net("10.244.3.7/24")],
                }),
            ])),
            local_pods: Vec::new(),
            unrestricted_ifindexes: Vec::new(),
            underlay: Underlay {
                ifindex: 2,
                mac: [2, 0, 0, 0, 0, 1],
                xdp_forward: false,
                nodeport_listed: false,
                mtu: 1500,
            },
            settings: OvnKubernetesConfig::default().validate(1500).unwrap(),
            hybrid: None,
        };
        assert_eq!(
            wanted_routes(&view, &[]),
            vec![
                (net("10.244.2.0/24"), ip("10.99.0.1")),
                (net("fd00:10:244:2::/64"), ip("fd99::1")),
                (net("10.244.3.0/24"), ip("10.99.0.1")),
            ]
        );
        // A node without an IPv6 address routes no IPv6 CIDR.
        let mut v4_only = view.clone();
        std::sync::Arc::make_mut(&mut std::sync::Arc::make_mut(&mut v4_only.nodes)[0])
            .addresses
            .truncate(1);
        assert!(
            wanted_routes(&v4_only, &[])
                .iter()
                .all(|(c, _)| c.addr().is_ipv4())
        );
    }
}
