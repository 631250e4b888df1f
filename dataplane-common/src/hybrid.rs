//! The hybrid overlay: pods of nodes that do not run the dataplane (Windows nodes, as
//! OVN-Kubernetes' hybrid overlay has them) reached over VXLAN, while the dataplane's own
//! nodes keep Geneve among themselves. Map value layouts shared by the kernel programs and
//! the agent.
//!
//! A hybrid node's pod subnet is a route of `REMOTE_PODS_V4` whose endpoint is of kind
//! `overlay::TUNNEL_VXLAN`; `HYBRID_NODES` holds its router MAC, the inner destination MAC it
//! accepts. Towards it: outer IPv4 / UDP to the configured port / VXLAN (VNI 4097) / inner
//! Ethernet from this node's router MAC to the hybrid node's. From it: VXLAN from a hybrid
//! node's address, with VNI 4097 and this node's router MAC as inner destination.

/// The VNI of the hybrid overlay (OVN-Kubernetes' `types.HybridOverlayVNI`).
pub const HYBRID_VNI: u32 = 4097;
/// `hybridOverlayVXLANPort` when the operator does not set it: VXLAN's IANA port.
pub const HYBRID_DEFAULT_PORT: u16 = 4789;
/// VXLAN header length (RFC 7348): flags, reserved, VNI, reserved.
pub const VXLAN_HEADER_LEN: usize = 8;
/// The VXLAN header's first byte: only the I flag (a valid VNI).
pub const VXLAN_FLAG_VNI: u8 = 0x08;
/// Encapsulation overhead towards a hybrid node (IPv4 only): outer IPv4 (20), UDP (8), VXLAN
/// (8), inner Ethernet (14). The outer Ethernet header replaces the pod's.
pub const VXLAN_OVERHEAD: u32 = 20 + 8 + 8 + 14;

/// `HybridConfig::flags`: the hybrid overlay is configured on this node.
pub const HYBRID_ENABLED: u16 = 1 << 0;

/// This node's hybrid overlay settings (one entry of `HYBRID_CONFIG`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HybridConfig {
    /// UDP port of the VXLAN both ways (host byte order).
    pub vxlan_port: u16,
    /// `HYBRID_*` flags.
    pub flags: u16,
    /// Largest inner IP packet towards a hybrid pod: the underlay MTU less `VXLAN_OVERHEAD`.
    pub mtu: u32,
    /// The management port's host side: a service reply to a hybrid pod, which the underlay's
    /// FIB cannot route, is sent into it and wrapped in VXLAN on the other side.
    pub mgmt_ifindex: u32,
    /// This node's router MAC: the inner source towards hybrid nodes, and the only inner
    /// destination accepted from them.
    pub router_mac: [u8; 6],
    pub _pad: [u8; 2],
}

/// A hybrid node (value of `HYBRID_NODES`, keyed by its underlay address).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HybridNode {
    /// The inner destination MAC it accepts (its distributed router gateway MAC).
    pub router_mac: [u8; 6],
    pub _pad: [u8; 2],
}

const _: () = {
    assert!(core::mem::size_of::<HybridConfig>() == 20);
    assert!(core::mem::size_of::<HybridNode>() == 8);
};

#[cfg(feature = "user")]
mod pod_impls {
    // SAFETY: plain #[repr(C)] data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::HybridConfig {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::HybridNode {}
}
