//! What the stages look up about this node and the cluster, below every feature: the settings
//! each feature's agent wrote (overlay, hybrid overlay, egress IPs), the routes to other nodes'
//! pods, and the load-balancer's port bitmaps. Features and entry programs call these; these
//! call no feature, so the features need not call each other to ask.

use aya_ebpf::maps::lpm_trie::Key;
use dataplane_common::{
    egressip::{EGRESS_ACTIVE_HOLDER, EGRESS_ACTIVE_PODS},
    hybrid::{HYBRID_ENABLED, HybridConfig},
    lb::{BACKEND_PORTS_BASE, SERVICE_PORTS_BASE, port_bit},
    overlay::{Addr, OVERLAY_ENABLED, OverlayConfig, TUNNEL_VXLAN, TunnelEndpoint},
};

use crate::{
    copy::copy_addr,
    maps::{
        ADDR_SCRATCH, EGRESS_ACTIVE, EGRESS_SNAT, HYBRID_CONFIG, LB_PORTS, OVERLAY_CONFIG,
        REMOTE_PODS_V4, REMOTE_PODS_V6,
    },
    parse::ETH_P_IP,
    work::Parsed,
};

/// The overlay settings, when an agent has configured the overlay on this node.
#[inline(always)]
pub fn overlay_config() -> Option<&'static OverlayConfig> {
    let config = OVERLAY_CONFIG.get(0)?;
    if config.flags & OVERLAY_ENABLED == 0 {
        return None;
    }
    Some(config)
}

/// The node hosting the pod CIDR `dst` lies in, if it is a remote pod's address. The IPv6
/// key is built in per-CPU memory: 20 more bytes on the stack would not fit the deepest paths.
#[inline(always)]
pub fn remote_endpoint(ether_type: u16, dst: &Addr) -> Option<&'static TunnelEndpoint> {
    let key = ADDR_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot, used within this program run only.
    let key = unsafe { &mut *key };
    key.prefix_len = 128;
    copy_addr(&mut key.data, dst);
    remote_endpoint_of(ether_type, key)
}

/// [`remote_endpoint`] for an address already in this CPU's lookup key.
#[inline(always)]
#[expect(
    clippy::needless_borrows_for_generic_args,
    reason = "by reference, the key is not copied to the BPF stack"
)]
pub fn remote_endpoint_of(ether_type: u16, key: &Key<Addr>) -> Option<&'static TunnelEndpoint> {
    if ether_type == ETH_P_IP {
        let d = &key.data;
        REMOTE_PODS_V4.get(&Key::new(32, [d[12], d[13], d[14], d[15]]))
    } else {
        REMOTE_PODS_V6.get(key)
    }
}

/// The hybrid overlay settings as the agent wrote them; callers check [`hybrid_on`]. (Checked here,
/// the result would be an `Option` the compiler builds by masking the pointer, which the
/// verifier refuses.)
#[inline(always)]
pub fn hybrid_settings() -> Option<&'static HybridConfig> {
    HYBRID_CONFIG.get(0)
}

/// Whether `settings` say the hybrid overlay is configured on this node.
#[inline(always)]
pub fn hybrid_on(settings: &HybridConfig) -> bool {
    settings.flags & HYBRID_ENABLED != 0
}

/// Whether the hybrid overlay is configured on this node.
#[inline(always)]
pub fn hybrid_enabled() -> bool {
    hybrid_settings().is_some_and(hybrid_on)
}

/// Whether `addr` (of a packet of `ether_type`) is a hybrid node's pod: its subnet's route
/// leads into VXLAN.
#[inline(always)]
pub fn is_hybrid_pod(ether_type: u16, addr: &Addr) -> bool {
    ether_type == ETH_P_IP
        && hybrid_enabled()
        && remote_endpoint(ether_type, addr).is_some_and(|e| e.kind == TUNNEL_VXLAN)
}

/// The `EGRESS_ACTIVE_*` bits (zero: no egress IP concerns this node).
#[inline(always)]
pub fn egress_active() -> u32 {
    EGRESS_ACTIVE.get(0).copied().unwrap_or(0)
}

/// Whether a local pod is selected by an EgressIP (the pod stage hands on to
/// `tc_from_pod_egress` then).
#[inline(always)]
pub fn egress_pods_selected() -> bool {
    egress_active() & EGRESS_ACTIVE_PODS != 0
}

/// Whether this node may hold egress addresses (the underlay stages look further then).
#[inline(always)]
pub fn egress_holder() -> bool {
    egress_active() & EGRESS_ACTIVE_HOLDER != 0
}

/// Whether this node translates the traffic of the pod `src` (Geneve from another node whose
/// inner destination is no local pod is accepted for it).
#[inline(always)]
pub fn egress_translates_for(src: &Addr) -> bool {
    // SAFETY: only presence is checked.
    unsafe { EGRESS_SNAT.get(src) }.is_some()
}

/// Whether the load-balancer may have work for a packet: its destination port is some
/// service's, or its source port some backend's (a reply). Two inlined array reads; a
/// packet of neither skips the stage and the flow cache, which would find nothing.
#[inline(always)]
pub fn may_be_service(parsed: &Parsed) -> bool {
    port_marked(SERVICE_PORTS_BASE, parsed.dst_port)
        || port_marked(BACKEND_PORTS_BASE, parsed.src_port)
}

/// Whether `port_be` is some backend's port: a packet from it may be the reply of a service
/// flow, which the load-balancer gives its service address back.
#[inline(always)]
pub fn backend_port(port_be: [u8; 2]) -> bool {
    port_marked(BACKEND_PORTS_BASE, port_be)
}

/// Whether `port` is marked in the bitmap at `base` (a service port or a backend port).
#[inline(always)]
pub fn port_marked(base: u32, port_be: [u8; 2]) -> bool {
    let (word, bit) = port_bit(base, u16::from_be_bytes(port_be));
    LB_PORTS.get(word).is_some_and(|w| *w & bit != 0)
}
