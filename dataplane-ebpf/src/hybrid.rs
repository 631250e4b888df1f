//! The hybrid overlay: pods of nodes that do not run the dataplane (Windows nodes) reached in
//! VXLAN, next to the Geneve among the dataplane's own nodes.
//!
//! Towards a hybrid pod, `overlay::encapsulate` builds the VXLAN frame when the route it found
//! is of kind `TUNNEL_VXLAN` ([`write_udp_vxlan`], [`inner_macs`]). From a hybrid node, XDP on
//! the underlay checks what OVN-Kubernetes' hybrid overlay sends — a hybrid node's address,
//! VNI 4097, this node's router MAC inside — unwraps it and passes the pod's packet to the
//! stack addressed to this node, as Geneve is: `tc_underlay` load-balances it (a hybrid pod
//! reaches services as a pod does) and the stack routes it to the pod, whose ingress policy
//! judges it.

// Keys are passed to the map helpers by reference on purpose: by value they would be copied
// to the BPF stack.
#![expect(
    clippy::needless_borrows_for_generic_args,
    reason = "keys stay in per-CPU memory"
)]

use aya_ebpf::{
    bindings::xdp_action,
    helpers::bpf_xdp_adjust_head,
    programs::{TcContext, XdpContext},
};
use dataplane_common::{
    DropReason, PacketClass,
    hybrid::{HYBRID_VNI, VXLAN_FLAG_VNI, VXLAN_HEADER_LEN},
    overlay::{OVERLAY_HAS_IPV4, OverlayConfig, TunnelEndpoint},
};

use crate::lookup;
use crate::parse::{ETH_LEN, ETH_P_IP, UDP_LEN};
use crate::{
    copy::{copy_bytes, set_ipv4_mapped},
    maps::{ADDR_SCRATCH, ENCAP_SCRATCH_LEN, HYBRID_NODES},
    parse::Packet,
    stage::Stage,
    tunnel,
    work::Parsed,
};

/// UDP (checksum zero, as RFC 7348 allows over IPv4) and the VXLAN header for the outer IPv4
/// header of `block`: the I flag and the hybrid overlay's VNI.
#[inline(always)]
pub fn write_udp_vxlan(
    block: &mut [u8; ENCAP_SCRATCH_LEN],
    source_port: u16,
    dest_port: u16,
    udp_len: u16,
) {
    const AT: usize = ETH_LEN + 20;
    block[AT..AT + 2].copy_from_slice(&source_port.to_be_bytes());
    block[AT + 2..AT + 4].copy_from_slice(&dest_port.to_be_bytes());
    block[AT + 4..AT + 6].copy_from_slice(&udp_len.to_be_bytes());
    block[AT + 6..AT + 8].copy_from_slice(&[0, 0]);
    let vni = (HYBRID_VNI << 8).to_be_bytes();
    block[AT + 8..AT + 16].copy_from_slice(&[VXLAN_FLAG_VNI, 0, 0, 0, vni[0], vni[1], vni[2], 0]);
}

/// The inner Ethernet addresses towards the hybrid node at `endpoint`, written over the 12
/// bytes at `at` of `block`: to its router MAC, from this node's. `None` when the node or the
/// settings are gone (its route is stale).
#[inline(always)]
pub fn inner_macs(
    block: &mut [u8; ENCAP_SCRATCH_LEN],
    at: usize,
    endpoint: &TunnelEndpoint,
) -> Option<()> {
    let config = lookup::hybrid_settings()?;
    if !lookup::hybrid_on(config) {
        return None;
    }
    // SAFETY: only read, before this program run ends.
    let node = unsafe { HYBRID_NODES.get(&endpoint.addr) }?;
    let at = if at == ETH_LEN + 20 + UDP_LEN + VXLAN_HEADER_LEN {
        at
    } else {
        return None;
    };
    block[at..at + 6].copy_from_slice(&node.router_mac);
    block[at + 6..at + 12].copy_from_slice(&config.router_mac);
    Some(())
}

/// Whether a parsed packet is UDP to this node's hybrid overlay port (what [`decapsulate`]
/// looks at).
#[inline(always)]
pub fn vxlan_port(parsed: &Parsed) -> bool {
    parsed.class == PacketClass::Udp
        && lookup::hybrid_settings().is_some_and(|config| {
            lookup::hybrid_on(config) && u16::from_be_bytes(parsed.dst_port) == config.vxlan_port
        })
}

/// The XDP stage for VXLAN arriving on the hybrid overlay's port: the XDP action when it was
/// a hybrid pod's packet for this node, nothing when it is no VXLAN to this node.
#[inline(never)]
pub fn decapsulate(ctx: &XdpContext, parsed: &Parsed) -> Stage {
    let packet = Packet::new(ctx.data(), ctx.data_end(), ctx.data_end() - ctx.data());
    Stage::new(
        unwrap_vxlan(ctx, &packet, parsed)
            .map(|done| done.map(|action| (action, PacketClass::VxlanDecap))),
    )
}

/// The checks on VXLAN from a hybrid node, the same at either hook: `Ok(None)` when it is no
/// VXLAN for this node; else the offset of the inner Ethernet frame, and the overlay's
/// settings.
#[inline(always)]
fn vxlan_inner(
    packet: &Packet,
    parsed: &Parsed,
) -> Result<Option<(usize, &'static OverlayConfig)>, DropReason> {
    // The hybrid overlay runs over an untagged IPv4 underlay only.
    if parsed.ether_type != ETH_P_IP || parsed.l3_offset != ETH_LEN || parsed.l4_offset == 0 {
        return Ok(None);
    }
    let (Some(config), Some(overlay)) = (lookup::hybrid_settings(), lookup::overlay_config())
    else {
        return Ok(None);
    };
    if !lookup::hybrid_on(config) {
        return Ok(None);
    }
    let addresses: *const [u8; 8] = packet
        .header(ETH_LEN + 12)
        .ok_or(DropReason::Ipv4Truncated)?;
    // SAFETY: bounds-checked by header().
    let a = unsafe { *addresses };
    if overlay.flags & OVERLAY_HAS_IPV4 == 0 || a[4..8] != overlay.node_ipv4 {
        return Ok(None);
    }
    let key = ADDR_SCRATCH
        .get_ptr_mut(0)
        .ok_or(DropReason::ScratchUnavailable)?;
    // SAFETY: this CPU's slot, used within this program run only.
    let key = unsafe { &mut *key };
    set_ipv4_mapped(&mut key.data, [a[0], a[1], a[2], a[3]]);
    // SAFETY: only presence is checked.
    if unsafe { HYBRID_NODES.get(&key.data) }.is_none() {
        return Err(DropReason::HybridUnknownNode);
    }
    let vxlan = parsed.l4_offset + UDP_LEN;
    let header: *const [u8; VXLAN_HEADER_LEN] =
        packet.header(vxlan).ok_or(DropReason::HybridMalformed)?;
    // SAFETY: bounds-checked by header().
    let header = unsafe { *header };
    if header[0] & VXLAN_FLAG_VNI == 0
        || u32::from_be_bytes([0, header[4], header[5], header[6]]) != HYBRID_VNI
    {
        return Err(DropReason::HybridWrongVni);
    }
    let inner = vxlan + VXLAN_HEADER_LEN;
    // The inner Ethernet header and the start of an IPv4 header (version and length).
    let frame: *const [u8; ETH_LEN + 1] =
        packet.header(inner).ok_or(DropReason::HybridMalformed)?;
    // SAFETY: bounds-checked by header().
    let frame = unsafe { &*frame };
    if frame[0..6] != config.router_mac {
        return Err(DropReason::HybridWrongMac);
    }
    if u16::from_be_bytes([frame[12], frame[13]]) != ETH_P_IP || frame[14] >> 4 != 4 {
        return Err(DropReason::HybridMalformed);
    }
    if packet.header::<[u8; 20]>(inner + ETH_LEN).is_none() {
        return Err(DropReason::HybridMalformed);
    }
    Ok(Some((inner, overlay)))
}

/// The tc stage for VXLAN from a hybrid node where the uplink runs no XDP (`--uplink-hook
/// tc`): the same checks as XDP's, then the packet unwrapped in place
/// (`tunnel::strip_outer`). `Ok(false)`: no VXLAN for this node, untouched.
#[inline(always)]
pub fn decapsulate_skb(ctx: &TcContext, parsed: &Parsed) -> Result<bool, DropReason> {
    // The hybrid overlay runs over an untagged underlay only.
    if tunnel::skb_vid(ctx).is_some() {
        return Ok(false);
    }
    let packet = tunnel::pulled(ctx);
    let Some((inner, config)) = vxlan_inner(&packet, parsed)? else {
        return Ok(false);
    };
    if !tunnel::strip_outer(ctx, parsed, inner, &config.underlay_mac) {
        return Err(DropReason::HybridMalformed);
    }
    Ok(true)
}

#[inline(always)]
fn unwrap_vxlan(
    ctx: &XdpContext,
    packet: &Packet,
    parsed: &Parsed,
) -> Result<Option<u32>, DropReason> {
    let Some((inner, overlay)) = vxlan_inner(packet, parsed)? else {
        return Ok(None);
    };
    // SAFETY: plain helper call; shrinking from the front by a length checked above.
    if unsafe { bpf_xdp_adjust_head(ctx.ctx, inner as i32) } != 0 {
        return Err(DropReason::HybridMalformed);
    }
    // Address the inner frame to this node so the stack accepts it and routes it on.
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + 6 > end {
        return Err(DropReason::HybridMalformed);
    }
    // SAFETY: the 6 bytes at start were bounds-checked just above.
    unsafe { copy_bytes::<6>(start as *mut u8, overlay.underlay_mac.as_ptr()) };
    Ok(Some(xdp_action::XDP_PASS))
}
