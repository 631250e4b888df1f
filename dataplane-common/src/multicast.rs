//! Multicast per namespace: the maps' layouts and the constants both sides agree on.
//!
//! A pod may send and receive multicast only when its namespace carries
//! `k8s.ovn.org/multicast-enabled: "true"`. The agent writes the pods of enabled namespaces
//! ([`McastPod`], by host veth), and for each group that pods joined, the local pods and the
//! other nodes to copy its packets to ([`McastGroup`], by namespace and group). Copies to
//! other nodes travel in Geneve with an option naming the sender's namespace
//! ([`GENEVE_OPTION_CLASS`]), which the receiving node looks its own subscribers up by.

use crate::overlay::{Addr, TunnelEndpoint};

/// Local pods one group's packets are copied to, per node (a node runs about 110 pods).
pub const MAX_LOCAL_MEMBERS: usize = 64;
/// Other nodes one group's packets are copied to.
pub const MAX_REMOTE_MEMBERS: usize = 32;
/// Groups a node holds (namespace and group address pairs with members on this node or on
/// another node this node copies to). Past it, new joins are refused, counted and logged.
pub const MAX_GROUPS: u32 = 2048;

/// The Geneve option that carries the sender's namespace on a multicast copy: option class
/// 0xFF01 (RFC 8926's experimental range), type 0x01 (not critical), 4 bytes of data: the
/// namespace id.
pub const GENEVE_OPTION_CLASS: u16 = 0xFF01;
pub const GENEVE_OPTION_TYPE: u8 = 0x01;
/// The option's length on the wire: its 4-byte header and 4 bytes of data.
pub const GENEVE_OPTION_LEN: usize = 8;

/// `skb->mark` bit on a copy the dataplane made for a pod that joined its group: the pod's
/// veth lets it in (nothing else to a group passes there but queries and neighbour discovery).
pub const MULTICAST_COPY_MARK: u32 = 1 << 21;

/// Bytes of an IGMP or MLD message copied to the agent: a whole report of a pod whose MTU
/// is 1500 (up to 183 IGMPv3 or 73 MLDv2 group records without sources).
pub const REPORT_CAPTURE: usize = 1480;

/// What the agent knows of a local pod of a multicast-enabled namespace (value of
/// `DP_MCAST_PODS`, keyed by the host-side veth's ifindex).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct McastPod {
    /// The namespace's id ([`namespace_id`]), the same on every node.
    pub namespace: u32,
    pub _pad: u32,
}

/// Key of `DP_MCAST_GROUPS`: a group of one namespace.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct McastKey {
    pub namespace: u32,
    /// The group address (IPv4-mapped for IPv4).
    pub group: Addr,
}

/// Where one group's packets go from this node (value of `DP_MCAST_GROUPS`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct McastGroup {
    /// How many of `local` are in use.
    pub local_count: u32,
    /// How many of `remote` are in use.
    pub remote_count: u32,
    /// Host-side veths of the local pods that joined.
    pub local: [u32; MAX_LOCAL_MEMBERS],
    /// Other nodes with pods that joined (one copy each), all of the underlay family of the
    /// first.
    pub remote: [TunnelEndpoint; MAX_REMOTE_MEMBERS],
}

impl Default for McastGroup {
    fn default() -> Self {
        Self {
            local_count: 0,
            remote_count: 0,
            local: [0; MAX_LOCAL_MEMBERS],
            remote: [TunnelEndpoint::default(); MAX_REMOTE_MEMBERS],
        }
    }
}

/// An IGMP or MLD message a pod of an enabled namespace sent (ring `DP_MCAST_REPORTS`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct McastReport {
    /// The host-side veth it came from.
    pub ifindex: u32,
    /// 4 (IGMP) or 6 (MLD).
    pub family: u32,
    /// Bytes of `message` the kernel filled.
    pub len: u32,
    pub _pad: u32,
    /// The IGMP message, or the ICMPv6 message for MLD, from its type byte on.
    pub message: [u8; REPORT_CAPTURE],
}

/// The id of a namespace in the kernel's maps and on the wire: FNV-1a over its name, so every
/// node derives the same without talking. The agent refuses to enable a namespace whose id
/// another enabled namespace already has.
pub const fn namespace_id(name: &[u8]) -> u32 {
    let mut hash: u32 = 0x811c_9dc5;
    let mut i = 0;
    while i < name.len() {
        hash ^= name[i] as u32;
        hash = hash.wrapping_mul(0x0100_0193);
        i += 1;
    }
    // Zero is never an id: it marks "no namespace".
    if hash == 0 { 1 } else { hash }
}

/// Whether a 16-byte address (IPv4-mapped for IPv4) is a multicast group: 224.0.0.0/4 or
/// ff00::/8.
#[inline(always)]
pub const fn is_group(addr: &Addr) -> bool {
    if addr[0] == 0xff {
        return true;
    }
    addr[10] == 0xff && addr[11] == 0xff && addr[12] & 0xF0 == 0xE0 && addr[0] == 0
}

const _: () = {
    assert!(core::mem::size_of::<McastPod>() == 8);
    assert!(core::mem::size_of::<McastKey>() == 20);
    assert!(
        core::mem::size_of::<McastGroup>() == 8 + 4 * MAX_LOCAL_MEMBERS + 20 * MAX_REMOTE_MEMBERS
    );
    assert!(core::mem::size_of::<McastReport>() == 16 + REPORT_CAPTURE);
};

#[cfg(feature = "user")]
mod pod_impls {
    // SAFETY: plain #[repr(C)] data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::McastPod {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::McastKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::McastGroup {}
}
