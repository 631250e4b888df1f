//! The Geneve pod overlay: map value layouts shared by the kernel programs and the agent.
//!
//! Addresses are stored as 16 bytes in network order; an IPv4 address is stored IPv4-mapped
//! (`::ffff:a.b.c.d`, RFC 4291 §2.5.5.2) so one key type serves both families.

/// Geneve's IANA port (RFC 8926), the default of `ovnKubernetesConfig.genevePort`.
pub const GENEVE_DEFAULT_PORT: u16 = 6081;
/// The VXLAN port: refused as a Geneve port so the two never share a socket.
pub const VXLAN_PORT: u16 = 4789;
/// Bytes the overlay reserves by default (OVN-Kubernetes: pod MTU = node MTU - 100), enough for
/// an IPv6 outer header, UDP, Geneve with options, and the inner Ethernet header.
pub const OVERLAY_DEFAULT_OVERHEAD: u32 = 100;
/// The VNI of the default pod network. One network per cluster today; the value is fixed and
/// documented so captures can be filtered on it.
pub const DEFAULT_NETWORK_VNI: u32 = 1;
/// Geneve protocol type of an Ethernet payload (Transparent Ethernet Bridging).
pub const GENEVE_PROTO_ETHERNET: u16 = 0x6558;
/// Geneve base header length.
pub const GENEVE_HEADER_LEN: usize = 8;
/// Longest Geneve options field (6-bit length in 4-byte words).
pub const GENEVE_MAX_OPTIONS_LEN: usize = 63 * 4;

/// Encapsulation overhead on the wire for an IPv4 underlay: outer IPv4 (20), UDP (8),
/// Geneve (8), inner Ethernet (14). The outer Ethernet header replaces the pod's.
pub const ENCAP_OVERHEAD_V4: u32 = 20 + 8 + 8 + 14;
/// The same for an IPv6 underlay (outer IPv6 is 40 bytes).
pub const ENCAP_OVERHEAD_V6: u32 = 40 + 8 + 8 + 14;

/// Address family tags used in map values (no enums in map types).
pub const FAMILY_IPV4: u8 = 4;
pub const FAMILY_IPV6: u8 = 6;

/// What encapsulation towards an endpoint of `family` (`FAMILY_*`) puts in front of the
/// inner frame: [`ENCAP_OVERHEAD_V6`] or [`ENCAP_OVERHEAD_V4`].
#[inline(always)]
pub const fn encap_overhead(family: u8) -> u32 {
    if family == FAMILY_IPV6 {
        ENCAP_OVERHEAD_V6
    } else {
        ENCAP_OVERHEAD_V4
    }
}

/// `OverlayConfig::flags`: the node has an IPv4 underlay address.
pub const OVERLAY_HAS_IPV4: u16 = 1 << 0;
/// `OverlayConfig::flags`: the node has an IPv6 underlay address.
pub const OVERLAY_HAS_IPV6: u16 = 1 << 1;
/// `OverlayConfig::flags`: the overlay is configured (maps filled by an agent).
pub const OVERLAY_ENABLED: u16 = 1 << 2;
/// `OverlayConfig::flags`: XDP may send frames back out of the underlay: NodePort packets of
/// established flows to backends on other nodes (Geneve, then XDP_TX or a redirect), answers
/// to ARP and neighbour solicitations for egress addresses. Off where the underlay cannot
/// take frames back from XDP (a veth whose peer runs no NAPI drops them): tc does both then.
pub const OVERLAY_XDP_FORWARD: u16 = 1 << 3;
/// `OverlayConfig::flags`: NodePorts are served on the addresses `LB_NODEPORT_ADDRS` holds
/// (`--nodeport-addresses` lists networks) rather than on the node's address of each family.
pub const OVERLAY_NODEPORT_LISTED: u16 = 1 << 4;

/// An address in the 16-byte form used by every overlay key.
pub type Addr = [u8; 16];

/// The IPv4-mapped form of an IPv4 address.
pub const fn ipv4_mapped(v4: [u8; 4]) -> Addr {
    [
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, v4[0], v4[1], v4[2], v4[3],
    ]
}

/// This node's overlay settings (one entry of `OVERLAY_CONFIG`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OverlayConfig {
    /// The underlay NIC encapsulated packets leave by.
    pub underlay_ifindex: u32,
    /// VNI written into every Geneve header.
    pub vni: u32,
    /// Largest inner IP packet (L3 length) that fits the underlay after encapsulation.
    pub pod_mtu: u32,
    /// UDP destination port of Geneve (host byte order).
    pub geneve_port: u16,
    /// `OVERLAY_*` flags.
    pub flags: u16,
    /// MAC of the underlay NIC: decapsulated frames are addressed to it before the stack
    /// routes them to the pod.
    pub underlay_mac: [u8; 6],
    /// The VLAN the underlay carries Geneve in (0: untagged). Geneve tagged otherwise is not
    /// this node's overlay traffic.
    pub underlay_vlan: u16,
    /// This node's IPv4 underlay address (valid with `OVERLAY_HAS_IPV4`).
    pub node_ipv4: [u8; 4],
    /// This node's IPv6 underlay address (valid with `OVERLAY_HAS_IPV6`).
    pub node_ipv6: [u8; 16],
    /// Moves on (wrapping) with every change of `LOCAL_PODS`, `POD_PORTS` or the node maps
    /// (`NODE_ADDRS`, the remote pod subnets): what the kernel cached from those maps under
    /// another epoch is stale (`crate::lb::FlowCacheEntry`, `crate::lb::XdpFlowCacheEntry`).
    pub pods_epoch: u32,
}

/// `TunnelEndpoint::kind`: a node of the dataplane, reached in Geneve.
pub const TUNNEL_GENEVE: u8 = 0;
/// `TunnelEndpoint::kind`: a hybrid node (Windows, or any node without the dataplane), reached
/// in VXLAN (`crate::hybrid`).
pub const TUNNEL_VXLAN: u8 = 1;

/// Where a remote pod CIDR lives: the underlay address of its node (value of the pod-CIDR
/// LPM maps).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TunnelEndpoint {
    /// The node's underlay address (IPv4-mapped for IPv4).
    pub addr: Addr,
    /// `FAMILY_IPV4` or `FAMILY_IPV6`: which outer header to build.
    pub family: u8,
    /// `TUNNEL_GENEVE` or `TUNNEL_VXLAN`: which tunnel header.
    pub kind: u8,
    pub _pad: [u8; 2],
}

/// A pod running on this node (value of `LOCAL_PODS`, keyed by the pod's address).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LocalPod {
    /// Host-side veth of the pod.
    pub ifindex: u32,
    /// The pod's own MAC (eth0 inside the pod).
    pub pod_mac: [u8; 6],
    /// MAC of the host-side veth (the pod's gateway as the pod sees it).
    pub host_mac: [u8; 6],
}

/// Words of the bitmap of destinations known to lie outside every pod network (`OUTSIDE`):
/// one bit per IPv4 /16, then one per 16-bit fold of an IPv6 address's first 32 bits. A set
/// bit means no local pod and no remote pod subnet lies there, so a pod's packet to it needs
/// neither lookup; a clear bit (the map as created, before an agent's first sync) means look.
pub const OUTSIDE_WORDS: u32 = 2 * 65_536 / 64;

/// The bit of the IPv4 /16 `a` lies in: `(word, mask)`.
#[inline(always)]
pub const fn outside_bit_v4(a: [u8; 4]) -> (u32, u64) {
    outside_bit((a[0] as u32) << 8 | a[1] as u32)
}

/// The bit of an IPv6 address whose first four bytes are `a`: their two 16-bit halves folded
/// by XOR (pod networks differ from the Internet's addresses in those bytes; a collision only
/// costs the lookups).
#[inline(always)]
pub const fn outside_bit_v6(a: [u8; 4]) -> (u32, u64) {
    outside_bit(65_536 + (((a[0] ^ a[2]) as u32) << 8 | (a[1] ^ a[3]) as u32))
}

#[inline(always)]
const fn outside_bit(index: u32) -> (u32, u64) {
    (index >> 6, 1u64 << (index & 63))
}

/// Slots of the per-CPU cache of underlay routes to tunnel endpoints (`ROUTE_CACHE`).
pub const ROUTE_CACHE_SLOTS: u32 = 64;

/// A CPU's copy of the route the kernel's FIB gave for a tunnel endpoint (value of
/// `ROUTE_CACHE`), reused by the encapsulations of the same clock second: the lookup is a
/// fifth of an encapsulation's time.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteCacheEntry {
    /// The endpoint's underlay address (16-byte form), as four words of its bytes in order
    /// (compared a word at a time).
    pub addr: [u32; 4],
    /// The end of the fill's clock second, in the flow clock's ticks: valid while the clock is
    /// below it (so a route or neighbour change takes effect within a second).
    pub until: u64,
    /// The longest outer packet the route's MTU was checked for (0: none, only GSO packets,
    /// which the stack segments, may use the entry).
    pub fits_len: u32,
    /// The device the route leaves by.
    pub ifindex: u32,
    /// `OverlayConfig::underlay_ifindex` at the fill (the lookup's input besides the address).
    pub underlay_ifindex: u32,
    /// 1: the next hop's MAC is `dmac`; 0: not resolved (sent by `bpf_redirect_neigh`).
    pub resolved: u8,
    pub dmac: [u8; 6],
    pub smac: [u8; 6],
    pub _pad: [u8; 7],
}

/// The route cache slot of an endpoint address from its last eight bytes, as two words
/// (each four bytes in memory order): folded, then Fibonacci hashing.
#[inline(always)]
pub const fn route_cache_slot(third: u32, fourth: u32) -> u32 {
    (third ^ fourth).wrapping_mul(0x9E37_79B9) >> 26
}

/// Slots (per CPU) of each address cache: [`AddrCacheEntry`].
pub const ADDR_CACHE_SLOTS: u32 = 256;

/// A per-CPU copy of what a hash lookup by address found (a node's underlay address in
/// `NODE_ADDRS`, a pod of this node in `LOCAL_PODS`), direct-mapped by [`addr_cache_slot`]:
/// one inlined array read and a compare where the hash lookup hashes 16 bytes and walks a
/// bucket. Valid under the `OverlayConfig::pods_epoch` it was filled in, which the agent
/// moves on every change of either map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AddrCacheEntry {
    pub addr: Addr,
    /// The epoch at the fill, plus one (0: never filled).
    pub epoch_plus_one: u32,
    /// The pod found (the local pods' cache only).
    pub pod: LocalPod,
}

/// The address cache slot of `addr`: its four words folded, then Fibonacci hashing.
#[inline(always)]
pub fn addr_cache_slot(addr: &Addr) -> u32 {
    let mut folded = 0u32;
    let mut i = 0;
    while i < 16 {
        folded ^= u32::from_ne_bytes([addr[i], addr[i + 1], addr[i + 2], addr[i + 3]]);
        i += 4;
    }
    folded.wrapping_mul(0x9E37_79B9) >> (32 - ADDR_CACHE_SLOTS.trailing_zeros())
}

const _: () = {
    assert!(core::mem::size_of::<OverlayConfig>() == 48);
    assert!(core::mem::size_of::<RouteCacheEntry>() == 56);
    assert!(1 << (32 - 26) == ROUTE_CACHE_SLOTS);
    assert!(core::mem::size_of::<TunnelEndpoint>() == 20);
    assert!(core::mem::size_of::<LocalPod>() == 16);
    assert!(core::mem::size_of::<AddrCacheEntry>() == 36);
    assert!(ADDR_CACHE_SLOTS.is_power_of_two());
    assert!(core::mem::align_of::<OverlayConfig>() == 4);
};

#[cfg(feature = "user")]
mod pod_impls {
    // SAFETY: plain #[repr(C)] data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::OverlayConfig {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::TunnelEndpoint {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::LocalPod {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::AddrCacheEntry {}
}
