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

use std::{collections::BTreeSet, net::IpAddr};

use ipnet::IpNet;

use crate::{
    api::network::OverlaySettings,
    error::AgentError,
    kernel::netdev,
    kernel::preflight,
    model::{OverlayView, hybrid::internal_networks},
};

/// The host's side of the pair: the routes to other nodes' pods point into it.
pub const HOST_SIDE: &str = "dp-mp0";
/// The overlay's side: `tc_from_pod` on its ingress takes what the host sends.
pub const OVERLAY_SIDE: &str = "dp-mp1";
/// The next hop of the routes (IPv4), answered by a permanent neighbour entry. Not the pods'
/// gateway (169.254.1.1), which the node holds on every pod veth: a route cannot go via a
/// local address.
const GATEWAY_V4: &str = "169.254.0.1";
/// The next hop of the routes (IPv6), likewise not the pods' (fe80::1).
const GATEWAY_V6: &str = "fe80::d:1";

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
/// exactly the routes `view` needs; makes the underlay's reverse-path filter loose.
pub fn sync(
    view: &OverlayView,
    settings: &OverlaySettings,
    underlay: &str,
    service_networks: &[IpNet],
) -> Result<MgmtSync, AgentError> {
    if preflight::interface_index(HOST_SIDE).is_err() {
        ip(&[
            "link",
            "add",
            HOST_SIDE,
            "type",
            "veth",
            "peer",
            "name",
            OVERLAY_SIDE,
        ])?;
        tracing::info!(
            host = HOST_SIDE,
            overlay = OVERLAY_SIDE,
            "management port created"
        );
    }
    let mtu = settings.pod_mtu.to_string();
    for side in [HOST_SIDE, OVERLAY_SIDE] {
        ip(&["link", "set", side, "mtu", &mtu, "up"])?;
    }
    let overlay_mac = netdev::mac(OVERLAY_SIDE).map_err(|source| AgentError::Io {
        action: "reading the MAC of",
        path: OVERLAY_SIDE.into(),
        source,
    })?;
    let mac = netdev::mac_text(&overlay_mac);
    ip(&[
        "neigh",
        "replace",
        GATEWAY_V4,
        "lladdr",
        &mac,
        "dev",
        HOST_SIDE,
        "nud",
        "permanent",
    ])?;
    ip(&[
        "-6",
        "neigh",
        "replace",
        GATEWAY_V6,
        "lladdr",
        &mac,
        "dev",
        HOST_SIDE,
        "nud",
        "permanent",
    ])?;
    loosen_reverse_path_filter(underlay);

    let wanted = wanted_routes(view, service_networks);
    let mut result = MgmtSync {
        ifindex: preflight::interface_index(OVERLAY_SIDE)?,
        host_ifindex: preflight::interface_index(HOST_SIDE)?,
        ..MgmtSync::default()
    };
    let present = present_routes()?;
    for (cidr, source) in &wanted {
        if present.contains(cidr) {
            continue;
        }
        let (family, gateway) = match cidr {
            IpNet::V4(_) => ("-4", GATEWAY_V4),
            IpNet::V6(_) => ("-6", GATEWAY_V6),
        };
        ip(&[
            family,
            "route",
            "replace",
            &cidr.to_string(),
            "via",
            gateway,
            "dev",
            HOST_SIDE,
            "onlink",
            "src",
            &source.to_string(),
        ])?;
        result.routes_added += 1;
    }
    let wanted: BTreeSet<IpNet> = wanted.iter().map(|(cidr, _)| *cidr).collect();
    for stale in present.difference(&wanted) {
        let family = if stale.addr().is_ipv4() { "-4" } else { "-6" };
        ip(&[family, "route", "del", &stale.to_string(), "dev", HOST_SIDE])?;
        result.routes_removed += 1;
    }
    Ok(result)
}

/// The routes into the host's side of the pair that a sync put there (the kernel's own
/// link-local route is not ours).
fn present_routes() -> Result<BTreeSet<IpNet>, AgentError> {
    let mut present = BTreeSet::new();
    for family in ["-4", "-6"] {
        let out = ip_output(&[family, "-o", "route", "show", "dev", HOST_SIDE])?;
        present.extend(
            out.lines()
                .filter(|line| !line.contains("proto kernel"))
                .filter_map(|line| line.split_whitespace().next())
                .filter_map(|prefix| prefix.parse::<IpNet>().ok()),
        );
    }
    Ok(present)
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

/// Runs `ip` with `args`; an error names the command and what it said.
fn ip(args: &[&str]) -> Result<(), AgentError> {
    ip_output(args).map(|_| ())
}

fn ip_output(args: &[&str]) -> Result<String, AgentError> {
    netdev::run_ip(args, None).map_err(|detail| AgentError::IpCommand {
        args: args.join(" "),
        detail,
    })
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
