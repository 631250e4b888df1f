//! Egress IPs: map layouts shared by the kernel programs and the agent.
//!
//! A pod an `EgressIP` object selects leaves the cluster with one of the object's addresses as
//! its source. The pod's node picks the address per flow (`EgressPod`), finds which node holds
//! it (`EgressHolder`) and sends the packet there, through Geneve when that is another node;
//! the holder translates the source (`EGRESS_SNAT`, tracked in `EGRESS_CT`), answers ARP for
//! the address and translates the replies back. Flows and their translations are keyed by
//! `crate::lb::CtKey` with the `EGRESS_CT_*` directions below.

use crate::overlay::{Addr, TunnelEndpoint};

/// Most egress addresses of one family a pod can leave by (an object's addresses, which go
/// to distinct nodes; more are not spread over).
pub const MAX_EGRESS_IPS_PER_POD: usize = 8;

/// A local pod some EgressIP selects (value of `EGRESS_PODS`, keyed by the pod's address):
/// the assigned egress addresses of the key's family. `count == 0`: selected but nothing
/// assigned yet, so its traffic to outside the cluster is dropped, never sent as the pod.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EgressPod {
    pub count: u32,
    pub ips: [Addr; MAX_EGRESS_IPS_PER_POD],
}

/// `EgressHolder::flags`: this node holds the address (translates to it and answers ARP).
pub const EGRESS_HELD_HERE: u32 = 1 << 0;

/// Where an egress address is held (value of `EGRESS_IPS`, keyed by the address).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EgressHolder {
    /// The holding node's underlay address (the Geneve destination when it is not this node).
    pub node: TunnelEndpoint,
    /// `EGRESS_*` flags.
    pub flags: u32,
}

/// `CtKey::direction` of the choice a pod's node made for a flow (value: the egress address).
/// Pinned so a flow keeps its source while its address is held, whatever else changes.
pub const EGRESS_CT_CHOSEN: u8 = 1;
/// `CtKey::direction` of a translated flow as the pod sent it (value: egress address and port).
pub const EGRESS_CT_OUT: u8 = 2;
/// `CtKey::direction` of a translated flow's replies, keyed as they arrive (value: the pod's
/// address and port).
pub const EGRESS_CT_IN: u8 = 3;

/// A tracked egress flow's translation (value of `EGRESS_CT`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EgressCtValue {
    /// `EGRESS_CT_CHOSEN`, `EGRESS_CT_OUT`: the egress address; `EGRESS_CT_IN`: the pod's.
    pub addr: Addr,
    /// `EGRESS_CT_OUT`: the source port after translation; `EGRESS_CT_IN`: the pod's port
    /// (network byte order).
    pub port_be: [u8; 2],
    pub _pad: [u8; 2],
}

/// `EGRESS_ACTIVE` bit: some local pod is selected by an EgressIP.
pub const EGRESS_ACTIVE_PODS: u32 = 1 << 0;
/// `EGRESS_ACTIVE` bit: this node holds some egress address, or the cluster has egress pods
/// whose traffic may be sent here.
pub const EGRESS_ACTIVE_HOLDER: u32 = 1 << 1;

/// First source port tried when a flow's own port is taken on its egress address.
pub const EGRESS_PORT_MIN: u16 = 32768;
/// Last such port.
pub const EGRESS_PORT_MAX: u16 = 60999;

const _: () = {
    assert!(core::mem::size_of::<EgressPod>() == 4 + 16 * MAX_EGRESS_IPS_PER_POD);
    assert!(core::mem::size_of::<EgressHolder>() == 24);
    assert!(core::mem::size_of::<EgressCtValue>() == 20);
};

#[cfg(feature = "user")]
mod pod_impls {
    // SAFETY: plain #[repr(C)] data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::EgressPod {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::EgressHolder {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::EgressCtValue {}
}
