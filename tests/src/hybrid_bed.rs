//! The hybrid overlay on the overlay bed ([`crate::overlay_bed`]): one hybrid (Windows) node,
//! 10.99.0.20 on the underlay (MAC 02:00:00:00:99:20), announcing the pod subnet
//! 10.132.0.0/24 of the hybrid network 10.132.0.0/14 and the router MAC 00:15:5d:00:00:20.
//! Compiled and synced by the agent's own code.

use dataplane_user::{
    api::network::HybridSettings,
    hybrid,
    model::{HybridNodeView, HybridView},
    overlay::compile,
};

use crate::overlay_bed::Bed;

pub const HYBRID_NODE_IP: &str = "10.99.0.20";
pub const HYBRID_NODE_MAC: &str = "02:00:00:00:99:20";
/// The hybrid node's router MAC: the inner destination it accepts.
pub const HYBRID_ROUTER_MAC: [u8; 6] = [0x00, 0x15, 0x5d, 0, 0, 0x20];
/// Node a's router MAC on the hybrid overlay.
pub const ROUTER_MAC: [u8; 6] = [0x0a, 0x58, 10, 244, 1, 0x33];
/// A pod of the hybrid node.
pub const HYBRID_POD: [u8; 4] = [10, 132, 0, 5];

/// The hybrid view of node a with VXLAN on `port`; `with_node`: whether the hybrid node
/// announces its subnet (without, its subnet is the hybrid network's, of no node).
pub fn hybrid_view(port: u16, with_node: bool) -> HybridView {
    HybridView {
        settings: HybridSettings {
            network: Some("10.132.0.0/14".parse().expect("cidr")),
            host_prefix: None,
            vxlan_port: port,
        },
        nodes: with_node
            .then(|| HybridNodeView {
                name: "win".into(),
                address: HYBRID_NODE_IP.parse().expect("address"),
                subnet: "10.132.0.0/24".parse().expect("cidr"),
                router_mac: HYBRID_ROUTER_MAC,
            })
            .into_iter()
            .collect(),
        router_ip: "10.244.1.3".parse().expect("address"),
        router_mac: ROUTER_MAC,
        underlay_mtu: 1500,
        mgmt_ifindex: 0,
    }
}

/// Turns the bed's hybrid overlay to `view` (or off), as an agent's sync would.
pub fn set_hybrid(bed: &mut Bed, view: Option<HybridView>) -> anyhow::Result<()> {
    bed.view.hybrid = view;
    bed.fixture
        .sync_hybrid(&hybrid::compile(bed.view.hybrid.as_ref()))?;
    bed.fixture.sync_overlay(&compile(&bed.view)?, None)?;
    Ok(())
}
