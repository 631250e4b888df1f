//! Unwrapping a tunnel packet at tc, shared by the Geneve overlay (`crate::overlay`) and the
//! hybrid overlay's VXLAN (`crate::hybrid`): where the uplink runs no XDP (`--uplink-hook tc`)
//! every tunnel packet is unwrapped here, in the socket buffer, after the same checks XDP
//! makes.

use aya_ebpf::{
    bindings::{
        BPF_F_ADJ_ROOM_DECAP_L3_IPV4, BPF_F_ADJ_ROOM_DECAP_L3_IPV6, BPF_F_ADJ_ROOM_FIXED_GSO,
        bpf_adj_room_mode::BPF_ADJ_ROOM_MAC,
    },
    helpers::{bpf_skb_adjust_room, bpf_skb_vlan_pop},
    programs::TcContext,
};
use dataplane_common::overlay::{GENEVE_HEADER_LEN, GENEVE_MAX_OPTIONS_LEN};

use crate::{
    parse::{ETH_LEN, ETH_P_IP, ETH_P_IPV6, Packet, UDP_LEN},
    work::Parsed,
};

/// How much of a tunnel packet the tc decapsulation wants in the linear data: the outer
/// headers at their longest (IPv6, the longest Geneve options), the inner Ethernet header and
/// an inner IPv6 header.
const TUNNEL_PULL_LEN: u32 =
    (ETH_LEN + 40 + UDP_LEN + GENEVE_HEADER_LEN + GENEVE_MAX_OPTIONS_LEN + ETH_LEN + 40) as u32;

/// The VLAN id the kernel took out of the frame into the socket buffer, if any.
#[inline(always)]
pub fn skb_vid(ctx: &TcContext) -> Option<u16> {
    // SAFETY: reading fields of our own context.
    let (present, tci) = unsafe { ((*ctx.skb.skb).vlan_present, (*ctx.skb.skb).vlan_tci) };
    (present != 0).then_some((tci & 0x0FFF) as u16)
}

/// Makes the first `TUNNEL_PULL_LEN` bytes (or the whole packet) linear, and returns the
/// packet as direct access sees it. A pull that fails leaves the headers short, which the
/// checks after it find.
#[inline(always)]
pub fn pulled(ctx: &TcContext) -> Packet {
    let want = if ctx.len() < TUNNEL_PULL_LEN {
        ctx.len()
    } else {
        TUNNEL_PULL_LEN
    };
    let _ = ctx.pull_data(want);
    Packet::new(ctx.data(), ctx.data_end(), ctx.len() as usize)
}

/// Unwraps a tunnel packet at tc in place: everything between the outer Ethernet header and
/// the inner IP header goes (`bpf_skb_adjust_room`, the socket buffer's protocol following
/// the inner family), the VLAN tag the kernel kept aside with it, and the Ethernet header that
/// stays is addressed to this node (`mac`) with the inner frame's type, as XDP's unwrapping
/// leaves it. The segment size of a merged packet (GSO) stays: it is the inner flow's.
/// Whether it was unwrapped (not when the inner frame is no IP, or a helper refused).
#[inline(always)]
pub fn strip_outer(ctx: &TcContext, parsed: &Parsed, inner: usize, mac: &[u8; 6]) -> bool {
    if parsed.l3_offset != ETH_LEN {
        return false;
    }
    let Ok(inner_type) = ctx.load::<[u8; 2]>(inner + 12).map(u16::from_be_bytes) else {
        return false;
    };
    let family = match (parsed.ether_type, inner_type) {
        (ETH_P_IP, ETH_P_IPV6) => BPF_F_ADJ_ROOM_DECAP_L3_IPV6,
        (ETH_P_IPV6, ETH_P_IP) => BPF_F_ADJ_ROOM_DECAP_L3_IPV4,
        (_, ETH_P_IP | ETH_P_IPV6) => 0,
        _ => return false,
    };
    // SAFETY: plain helper calls on our own socket buffer.
    unsafe {
        if skb_vid(ctx).is_some() && bpf_skb_vlan_pop(ctx.skb.skb) != 0 {
            return false;
        }
        let flags = (BPF_F_ADJ_ROOM_FIXED_GSO | family) as u64;
        if bpf_skb_adjust_room(ctx.skb.skb, -(inner as i32), BPF_ADJ_ROOM_MAC, flags) != 0 {
            return false;
        }
    }
    ctx.store(0, mac, 0).is_ok() && ctx.store(12, &inner_type.to_be_bytes(), 0).is_ok()
}
