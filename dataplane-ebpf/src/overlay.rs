//! The Geneve pod overlay (RFC 8926).
//!
//! Leaving a pod (tc): a packet for a pod on this node is handed straight to that pod's veth
//! (`bpf_redirect_peer`); a packet for a pod CIDR of another node is wrapped in outer
//! Ethernet / IP / UDP / Geneve and redirected out of the underlay NIC towards that node.
//! Arriving on the underlay (XDP): Geneve from a cluster node is checked as RFC 8926 requires,
//! unwrapped, and handed to the stack addressed to this node, which routes it to the pod.
//!
//! UDP checksum: zero for both underlay families. RFC 8926 §3.3 allows a zero checksum over
//! IPv4; over IPv6 it follows the tunnel rules of RFC 6935/6936 (zero checksums accepted by the
//! tunnel endpoints, which our receive path does). A computed checksum would need the whole
//! payload, which tc cannot do for GSO packets without the kernel's tunnel checksum offload.

use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        BPF_F_ADJ_ROOM_ENCAP_L2_ETH, BPF_F_ADJ_ROOM_ENCAP_L3_IPV4, BPF_F_ADJ_ROOM_ENCAP_L3_IPV6,
        BPF_F_ADJ_ROOM_ENCAP_L4_UDP, BPF_F_ADJ_ROOM_FIXED_GSO, BPF_FIB_LKUP_RET_FRAG_NEEDED,
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_OUTPUT,
        TC_ACT_REDIRECT, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, bpf_fib_lookup as FibParams,
        xdp_action,
    },
    helpers::{
        bpf_fib_lookup, bpf_get_hash_recalc, bpf_redirect, bpf_redirect_neigh, bpf_redirect_peer,
        bpf_skb_adjust_room, bpf_skb_store_bytes, bpf_xdp_adjust_head,
    },
    maps::lpm_trie::Key,
    programs::{TcContext, XdpContext},
};
use dataplane_common::{
    DropReason, PacketClass,
    overlay::{
        Addr, ENCAP_OVERHEAD_V4, ENCAP_OVERHEAD_V6, FAMILY_IPV6, GENEVE_HEADER_LEN,
        GENEVE_MAX_OPTIONS_LEN, GENEVE_PROTO_ETHERNET, LocalPod, OVERLAY_ENABLED, OVERLAY_HAS_IPV4,
        OVERLAY_HAS_IPV6, OverlayConfig, TunnelEndpoint, ipv4_mapped,
    },
};

use crate::{
    copy::{copy_bytes, zero},
    csum::write_ipv4,
    icmp,
    maps::{
        ENCAP_SCRATCH_LEN, FIB_SCRATCH, LOCAL_PODS, NODE_ADDRS, OVERLAY_CONFIG, REMOTE_PODS_V4,
        REMOTE_PODS_V6, SCRATCH,
    },
    parse::{IPPROTO_UDP, Packet, Parsed, read},
    stage::Stage,
};

const ETH_LEN: usize = 14;
const UDP_LEN: usize = 8;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const OUTER_TTL: u8 = 64;
/// Geneve options are walked one by one to find critical ones; each is at least 4 bytes.
const MAX_GENEVE_OPTIONS: usize = GENEVE_MAX_OPTIONS_LEN / 4;

/// The overlay settings, when an agent has configured the overlay on this node.
#[inline(always)]
pub fn config() -> Option<&'static OverlayConfig> {
    let config = OVERLAY_CONFIG.get(0)?;
    if config.flags & OVERLAY_ENABLED == 0 {
        return None;
    }
    Some(config)
}

/// Destination address of an untagged IP packet in 16-byte form. An IPv4 one is read straight
/// from the packet when its header is linear (nearly always; a helper call costs more).
#[inline(always)]
fn destination(ctx: &TcContext, parsed: &Parsed) -> Option<Addr> {
    match parsed.ether_type {
        ETH_P_IP => {
            let at = ETH_LEN + 16;
            let v4: [u8; 4] = match read(ctx, at) {
                Some(v4) => v4,
                None => ctx.load(at).ok()?,
            };
            Some(ipv4_mapped(v4))
        }
        ETH_P_IPV6 => ctx.load(ETH_LEN + 24).ok(),
        _ => None,
    }
}

/// The tc stage for a packet leaving a pod: the verdict and what was done (encapsulated or
/// redirected to a local pod). `Ok(None)`: not overlay traffic, let it continue.
/// `not_local`: the destination is already known not to be a local pod.
#[inline(always)]
pub fn from_pod(ctx: &TcContext, parsed: &Parsed, not_local: bool) -> Stage {
    Stage::new(
        deliver(ctx, parsed, not_local)
            .map(|done| done.map(|(verdict, class)| (verdict as u32, class))),
    )
}

#[inline(always)]
fn deliver(
    ctx: &TcContext,
    parsed: &Parsed,
    not_local: bool,
) -> Result<Option<(i32, PacketClass)>, DropReason> {
    // Only untagged IP frames come from pods; anything else is left to the stack.
    if parsed.l3_offset != ETH_LEN {
        return Ok(None);
    }
    let Some(config) = config() else {
        return Ok(None);
    };
    let Some(dst) = destination(ctx, parsed) else {
        return Ok(None);
    };
    // SAFETY: the value is copied out before anything can change the map.
    if !not_local && let Some(pod) = unsafe { LOCAL_PODS.get(dst) } {
        return Ok(Some((to_local_pod(ctx, pod), PacketClass::LocalRedirect)));
    }
    let Some(endpoint) = remote_endpoint(parsed.ether_type, &dst) else {
        return Ok(None);
    };
    // A single packet over the pod MTU is answered (ICMP fragmentation needed / packet too
    // big) so the pod's path MTU adapts; GSO packets are segmented to fit by the stack.
    // SAFETY: reading a field of our own context.
    let gso_size = unsafe { (*ctx.skb.skb).gso_size };
    if gso_size == 0 && ctx.len() - ETH_LEN as u32 > config.pod_mtu {
        let ipv6 = parsed.ether_type == ETH_P_IPV6;
        let verdict = icmp::too_big(ctx, ipv6, config.pod_mtu, config).into_value()? as i32;
        return Ok(Some((verdict, PacketClass::TooBigAnswered)));
    }
    let verdict = encapsulate(ctx, config, &endpoint).into_value()? as i32;
    Ok(Some((verdict, PacketClass::GeneveEncap)))
}

/// The local half of [`from_pod`]'s lookup alone: `Ok((pod, epoch))` when the packet is for a
/// pod on this node (`epoch`: the pods' epoch read before the lookup, for the flow cache);
/// `Err(true)` when its destination is known not to be a local pod (so [`from_pod`] need not
/// look again), `Err(false)` when not looked up. Lets `tc_from_pod` deliver to a local pod
/// itself ([`to_local_pod`]) when no access control applies, without the tail call into its
/// second half.
#[inline(always)]
pub fn local_pod(ctx: &TcContext, parsed: &Parsed) -> Result<(LocalPod, u32), bool> {
    if parsed.l3_offset != ETH_LEN {
        return Err(false);
    }
    let epoch = config().ok_or(false)?.pods_epoch;
    let dst = destination(ctx, parsed).ok_or(false)?;
    // SAFETY: the value is copied out before anything can change the map.
    let pod = unsafe { LOCAL_PODS.get(dst) }.ok_or(true)?;
    Ok((*pod, epoch))
}

/// Hands a packet straight to a pod on this node: addressed as its gateway would, delivered
/// into the pod's namespace without a second pass through the host stack.
#[inline(always)]
pub fn to_local_pod(ctx: &TcContext, pod: &LocalPod) -> i32 {
    let start = ctx.data();
    if start + 12 > ctx.data_end() {
        return aya_ebpf::bindings::TC_ACT_SHOT;
    }
    // SAFETY: the 12 bytes of MAC addresses were bounds-checked just above.
    unsafe {
        copy_bytes::<6>(start as *mut u8, pod.pod_mac.as_ptr());
        copy_bytes::<6>((start + 6) as *mut u8, pod.host_mac.as_ptr());
    }
    // SAFETY: plain helper call.
    unsafe { bpf_redirect_peer(pod.ifindex, 0) as i32 }
}

#[inline(always)]
pub(crate) fn remote_endpoint(ether_type: u16, dst: &Addr) -> Option<TunnelEndpoint> {
    if ether_type == ETH_P_IP {
        let v4 = [dst[12], dst[13], dst[14], dst[15]];
        REMOTE_PODS_V4.get(Key::new(32, v4)).copied()
    } else {
        REMOTE_PODS_V6.get(Key::new(128, *dst)).copied()
    }
}

/// Length of the outer headers plus the inner Ethernet header, written in one store:
/// Ethernet (14), IPv4 (20) or IPv6 (40), UDP (8), Geneve (8), inner Ethernet (14).
const ENCAP_BLOCK_V4: usize = 14 + 20 + 8 + 8 + 14;
const ENCAP_BLOCK_V6: usize = 14 + 40 + 8 + 8 + 14;

/// Wraps the packet in Geneve towards `endpoint` and redirects it out of the underlay.
#[inline(never)]
fn encapsulate(ctx: &TcContext, config: &OverlayConfig, endpoint: &TunnelEndpoint) -> Stage {
    Stage::value(wrap(ctx, config, endpoint).map(|verdict| verdict as u32))
}

#[inline(always)]
fn wrap(
    ctx: &TcContext,
    config: &OverlayConfig,
    endpoint: &TunnelEndpoint,
) -> Result<i32, DropReason> {
    let ipv6 = endpoint.family == FAMILY_IPV6;
    let has_source = if ipv6 {
        config.flags & OVERLAY_HAS_IPV6 != 0
    } else {
        config.flags & OVERLAY_HAS_IPV4 != 0
    };
    if !has_source {
        return Err(DropReason::OverlayNoRoute);
    }
    // The headers are assembled in a per-CPU buffer: the BPF stack (512 bytes) is too small
    // for them next to the FIB lookup parameters.
    let block = SCRATCH
        .get_ptr_mut(0)
        .ok_or(DropReason::OverlayEncapFailed)?;
    // SAFETY: per-CPU map memory, used only by this program invocation.
    let block = unsafe { &mut *block };
    // The pod's Ethernet header becomes the inner one; it sits at the end of the block.
    let inner_eth: [u8; 14] = ctx.load(0).map_err(|_| DropReason::EthTruncated)?;

    // The route to the remote node is looked up before the packet is touched, so a failure
    // leaves it intact.
    let overhead = if ipv6 {
        ENCAP_OVERHEAD_V6
    } else {
        ENCAP_OVERHEAD_V4
    };
    let outer_len = ctx.len() + overhead - ETH_LEN as u32;
    // A GSO packet is checked by its segments, which the stack sizes from the pod MTU; only
    // a single packet's own length is compared with the route's MTU (0 skips the check).
    // SAFETY: reading a field of our own context.
    let gso_size = unsafe { (*ctx.skb.skb).gso_size };
    let mtu_checked_len = if gso_size != 0 { 0 } else { outer_len };
    let fib = FIB_SCRATCH
        .get_ptr_mut(0)
        .ok_or(DropReason::OverlayEncapFailed)?;
    // SAFETY: per-CPU map memory, used only by this program invocation.
    let fib = unsafe { &mut *fib };
    fill_fib_params(fib, config, endpoint, mtu_checked_len);
    // SAFETY: fib is a valid bpf_fib_lookup in map memory and its size is passed.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.as_ptr(),
            fib,
            core::mem::size_of::<FibParams>() as i32,
            BPF_FIB_LOOKUP_OUTPUT,
        )
    } as u32;
    if rc == BPF_FIB_LKUP_RET_FRAG_NEEDED {
        return Err(DropReason::OverlayMtuExceeded);
    }
    if rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
        return Err(DropReason::OverlayNoRoute);
    }
    // Spread flows over ECMP paths and receive queues: the source port follows the inner flow.
    // SAFETY: plain helper call on our own context.
    let hash = unsafe { bpf_get_hash_recalc(ctx.skb.skb) };
    let source_port = 0xC000u16 | (hash as u16 & 0x3FFF);

    let written = if ipv6 {
        let udp_len = (outer_len - 40) as u16;
        write_ethernet(block, &fib.dmac, &fib.smac, ETH_P_IPV6);
        write_ipv6(block, udp_len, &config.node_ipv6, &endpoint.addr, hash);
        write_udp_geneve(
            block,
            14 + 40,
            source_port,
            config.geneve_port,
            udp_len,
            config.vni,
        );
        block[ENCAP_BLOCK_V6 - 14..ENCAP_BLOCK_V6].copy_from_slice(&inner_eth);
        ENCAP_BLOCK_V6
    } else {
        let udp_len = (outer_len - 20) as u16;
        let dst = [
            endpoint.addr[12],
            endpoint.addr[13],
            endpoint.addr[14],
            endpoint.addr[15],
        ];
        write_ethernet(block, &fib.dmac, &fib.smac, ETH_P_IP);
        // DF set: the overlay answers oversize packets itself rather than letting the
        // underlay fragment.
        write_ipv4(
            block,
            outer_len as u16,
            IPPROTO_UDP,
            true,
            &config.node_ipv4,
            &dst,
        );
        write_udp_geneve(
            block,
            14 + 20,
            source_port,
            config.geneve_port,
            udp_len,
            config.vni,
        );
        block[ENCAP_BLOCK_V4 - 14..ENCAP_BLOCK_V4].copy_from_slice(&inner_eth);
        ENCAP_BLOCK_V4
    };

    let l3_flag = if ipv6 {
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV6
    } else {
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV4
    };
    // These flags tell the stack how to segment encapsulated GSO packets (UDP tunnel with an
    // Ethernet payload); the inner L2 length sits in the top byte. FIXED_GSO keeps the segment
    // size: the pod MTU already leaves room for the overhead (checked when the settings are
    // validated), so shrinking every segment would only add packets.
    let flags = (l3_flag
        | BPF_F_ADJ_ROOM_ENCAP_L4_UDP
        | BPF_F_ADJ_ROOM_ENCAP_L2_ETH
        | BPF_F_ADJ_ROOM_FIXED_GSO) as u64
        | ((ETH_LEN as u64) << 56);
    // SAFETY: plain helper calls on our own context; the block is `written` bytes long.
    unsafe {
        if bpf_skb_adjust_room(ctx.skb.skb, overhead as i32, BPF_ADJ_ROOM_MAC, flags) != 0 {
            return Err(DropReason::OverlayEncapFailed);
        }
        if bpf_skb_store_bytes(ctx.skb.skb, 0, block.as_ptr().cast(), written as u32, 0) != 0 {
            return Err(DropReason::OverlayEncapFailed);
        }
    }
    let verdict = if rc == BPF_FIB_LKUP_RET_SUCCESS {
        // SAFETY: plain helper call.
        unsafe { bpf_redirect(fib.ifindex, 0) }
    } else {
        // The next hop's MAC is not resolved yet: let the kernel resolve it (and queue the
        // packet meanwhile) instead of dropping the first packets of every flow.
        // SAFETY: a null parameter block asks the kernel to do its own FIB lookup.
        unsafe { bpf_redirect_neigh(fib.ifindex, core::ptr::null_mut(), 0, 0) }
    };
    if verdict != TC_ACT_REDIRECT as i64 {
        return Err(DropReason::OverlayNoRoute);
    }
    Ok(TC_ACT_REDIRECT)
}

#[inline(always)]
pub(crate) fn write_ethernet(
    block: &mut [u8; ENCAP_SCRATCH_LEN],
    dst: &[u8; 6],
    src: &[u8; 6],
    ty: u16,
) {
    block[0..6].copy_from_slice(dst);
    block[6..12].copy_from_slice(src);
    block[12..14].copy_from_slice(&ty.to_be_bytes());
}

/// Outer IPv6 header at offset 14: traffic class 0, flow label from the inner flow hash,
/// hop limit 64.
#[inline(always)]
pub(crate) fn write_ipv6(
    block: &mut [u8; ENCAP_SCRATCH_LEN],
    payload_len: u16,
    src: &Addr,
    dst: &Addr,
    hash: u32,
) {
    let flow = (hash & 0x000F_FFFF).to_be_bytes();
    let len = payload_len.to_be_bytes();
    block[14..22].copy_from_slice(&[
        0x60,
        flow[1],
        flow[2],
        flow[3],
        len[0],
        len[1],
        IPPROTO_UDP,
        OUTER_TTL,
    ]);
    block[22..38].copy_from_slice(src);
    block[38..54].copy_from_slice(dst);
}

/// UDP (checksum zero, see the module comment) and the Geneve base header at `at`: version 0,
/// no options, O and C clear, Ethernet payload, the VNI.
#[inline(always)]
pub(crate) fn write_udp_geneve(
    block: &mut [u8; ENCAP_SCRATCH_LEN],
    at: usize,
    source_port: u16,
    dest_port: u16,
    udp_len: u16,
    vni: u32,
) {
    let (s, d, l) = (
        source_port.to_be_bytes(),
        dest_port.to_be_bytes(),
        udp_len.to_be_bytes(),
    );
    let p = GENEVE_PROTO_ETHERNET.to_be_bytes();
    let v = (vni << 8).to_be_bytes();
    let header = [
        s[0], s[1], d[0], d[1], l[0], l[1], 0, 0, 0, 0, p[0], p[1], v[0], v[1], v[2], 0,
    ];
    if at == 14 + 40 {
        block[54..70].copy_from_slice(&header);
    } else {
        block[34..50].copy_from_slice(&header);
    }
}

/// Sends a packet this node originates in effect (a NodePort reply, its source now this node's
/// address) straight out of the underlay towards its destination's next hop, bypassing the
/// stack, which would not forward a packet with a local source address.
#[inline(never)]
pub fn route_out(ctx: &TcContext, parsed: &Parsed) -> Stage {
    Stage::value(route(ctx, parsed).map(|verdict| verdict as u32))
}

#[inline(always)]
fn route(ctx: &TcContext, parsed: &Parsed) -> Result<i32, DropReason> {
    let config = config().ok_or(DropReason::OverlayNoRoute)?;
    let fib = FIB_SCRATCH
        .get_ptr_mut(0)
        .ok_or(DropReason::OverlayNoRoute)?;
    // SAFETY: per-CPU map memory, used only by this program invocation.
    let fib = unsafe { &mut *fib };
    // An all-zero bpf_fib_lookup is a valid starting point.
    zero(fib);
    fib.ifindex = config.underlay_ifindex;
    let l3 = parsed.l3_offset;
    if parsed.ether_type == ETH_P_IP {
        let a: [u8; 8] = ctx.load(l3 + 12).map_err(|_| DropReason::Ipv4Truncated)?;
        fib.family = AF_INET;
        fib.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes([a[0], a[1], a[2], a[3]]);
        fib.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes([a[4], a[5], a[6], a[7]]);
    } else {
        let src: Addr = ctx.load(l3 + 8).map_err(|_| DropReason::Ipv6Truncated)?;
        let dst: Addr = ctx.load(l3 + 24).map_err(|_| DropReason::Ipv6Truncated)?;
        fib.family = AF_INET6;
        fib.__bindgen_anon_3.ipv6_src = words(&src);
        fib.__bindgen_anon_4.ipv6_dst = words(&dst);
    }
    fib.l4_protocol = parsed.protocol;
    // SAFETY: fib is a valid bpf_fib_lookup in map memory and its size is passed.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.as_ptr(),
            fib,
            core::mem::size_of::<FibParams>() as i32,
            BPF_FIB_LOOKUP_OUTPUT,
        )
    } as u32;
    let verdict = if rc == BPF_FIB_LKUP_RET_SUCCESS {
        let mut macs = [0u8; 12];
        macs[..6].copy_from_slice(&fib.dmac);
        macs[6..].copy_from_slice(&fib.smac);
        ctx.store(0, &macs, 0)
            .map_err(|_| DropReason::OverlayNoRoute)?;
        // SAFETY: plain helper call.
        unsafe { bpf_redirect(fib.ifindex, 0) }
    } else if rc == BPF_FIB_LKUP_RET_NO_NEIGH {
        // SAFETY: a null parameter block asks the kernel to do its own FIB lookup.
        unsafe { bpf_redirect_neigh(fib.ifindex, core::ptr::null_mut(), 0, 0) }
    } else {
        return Err(DropReason::OverlayNoRoute);
    };
    if verdict != TC_ACT_REDIRECT as i64 {
        return Err(DropReason::OverlayNoRoute);
    }
    Ok(TC_ACT_REDIRECT)
}

/// Fills the FIB lookup parameters in place (they live in a per-CPU map: 64 bytes the BPF
/// stack cannot spare).
#[inline(always)]
pub(crate) fn fill_fib_params(
    fib: &mut FibParams,
    config: &OverlayConfig,
    endpoint: &TunnelEndpoint,
    tot_len: u32,
) {
    // An all-zero bpf_fib_lookup is a valid starting point.
    zero(fib);
    fib.l4_protocol = IPPROTO_UDP;
    fib.ifindex = config.underlay_ifindex;
    fib.__bindgen_anon_1.tot_len = tot_len as u16;
    if endpoint.family == FAMILY_IPV6 {
        fib.family = AF_INET6;
        fib.__bindgen_anon_3.ipv6_src = words(&config.node_ipv6);
        fib.__bindgen_anon_4.ipv6_dst = words(&endpoint.addr);
    } else {
        fib.family = AF_INET;
        fib.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(config.node_ipv4);
        fib.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes([
            endpoint.addr[12],
            endpoint.addr[13],
            endpoint.addr[14],
            endpoint.addr[15],
        ]);
    }
}

/// 16 network-order bytes as the four u32 words the kernel's structures hold them in.
#[inline(always)]
fn words(addr: &Addr) -> [u32; 4] {
    [
        u32::from_ne_bytes([addr[0], addr[1], addr[2], addr[3]]),
        u32::from_ne_bytes([addr[4], addr[5], addr[6], addr[7]]),
        u32::from_ne_bytes([addr[8], addr[9], addr[10], addr[11]]),
        u32::from_ne_bytes([addr[12], addr[13], addr[14], addr[15]]),
    ]
}

/// The XDP stage for Geneve arriving on the underlay. `Ok(None)`: not Geneve for this node.
#[inline(always)]
pub fn decapsulate(
    ctx: &XdpContext,
    packet: &Packet,
    parsed: &Parsed,
) -> Result<Option<u32>, DropReason> {
    if parsed.class != PacketClass::Udp {
        return Ok(None);
    }
    let Some(config) = config() else {
        return Ok(None);
    };
    if u16::from_be_bytes(parsed.dst_port) != config.geneve_port {
        return Ok(None);
    }
    let (src, dst_is_ours) = outer_addresses(packet, parsed, config)?;
    if !dst_is_ours {
        return Ok(None);
    }
    // SAFETY: only presence is checked.
    if unsafe { NODE_ADDRS.get(src) }.is_none() {
        return Err(DropReason::GeneveUnknownNode);
    }
    let geneve = parsed.l4_offset + UDP_LEN;
    let options_len = check_geneve(packet, geneve)?;
    let inner = geneve + GENEVE_HEADER_LEN + options_len;
    let inner_dst = inner_destination(packet, inner)?;
    // SAFETY: only presence is checked.
    if unsafe { LOCAL_PODS.get(inner_dst) }.is_none() {
        return Err(DropReason::GeneveNoLocalPod);
    }
    // SAFETY: plain helper call; shrinking from the front by a length checked above.
    if unsafe { bpf_xdp_adjust_head(ctx.ctx, inner as i32) } != 0 {
        return Err(DropReason::GeneveInnerMalformed);
    }
    // Address the inner frame to this node so the stack accepts it and routes it to the pod.
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + 6 > end {
        return Err(DropReason::GeneveInnerMalformed);
    }
    // SAFETY: the 6 bytes at start were bounds-checked just above.
    unsafe { copy_bytes::<6>(start as *mut u8, config.underlay_mac.as_ptr()) };
    Ok(Some(xdp_action::XDP_PASS))
}

/// The outer source (16-byte form) and whether the outer destination is this node.
#[inline(always)]
fn outer_addresses(
    packet: &Packet,
    parsed: &Parsed,
    config: &OverlayConfig,
) -> Result<(Addr, bool), DropReason> {
    let l3 = parsed.l3_offset;
    if parsed.ether_type == ETH_P_IP {
        let addrs: *const [u8; 8] = packet.header(l3 + 12).ok_or(DropReason::Ipv4Truncated)?;
        // SAFETY: bounds-checked by header().
        let a = unsafe { *addrs };
        let src = ipv4_mapped([a[0], a[1], a[2], a[3]]);
        let ours = config.flags & OVERLAY_HAS_IPV4 != 0 && a[4..8] == config.node_ipv4;
        Ok((src, ours))
    } else {
        let addrs: *const [u8; 32] = packet.header(l3 + 8).ok_or(DropReason::Ipv6Truncated)?;
        // SAFETY: bounds-checked by header().
        let a = unsafe { &*addrs };
        let mut src = [0u8; 16];
        src.copy_from_slice(&a[..16]);
        let ours = config.flags & OVERLAY_HAS_IPV6 != 0 && a[16..32] == config.node_ipv6;
        Ok((src, ours))
    }
}

/// Applies RFC 8926's receive rules to the Geneve header at `at`; returns the options length.
#[inline(always)]
fn check_geneve(packet: &Packet, at: usize) -> Result<usize, DropReason> {
    let base: *const [u8; 8] = packet
        .header(at)
        .ok_or(DropReason::GeneveOptionsTruncated)?;
    // SAFETY: bounds-checked by header().
    let base = unsafe { *base };
    if base[0] >> 6 != 0 {
        return Err(DropReason::GeneveBadVersion);
    }
    if base[1] & 0x80 != 0 {
        return Err(DropReason::GeneveControl);
    }
    // No option is understood here, so a declared critical option is an unknown one.
    if base[1] & 0x40 != 0 {
        return Err(DropReason::GeneveCriticalOption);
    }
    if u16::from_be_bytes([base[2], base[3]]) != GENEVE_PROTO_ETHERNET {
        return Err(DropReason::GeneveBadProtocol);
    }
    let options_len = ((base[0] & 0x3F) as usize) * 4;
    let options_start = at + GENEVE_HEADER_LEN;
    let options_end = options_start + options_len;
    if packet.header::<u8>(options_end).is_none() {
        return Err(DropReason::GeneveOptionsTruncated);
    }
    // Walk the options too: an option with its critical bit set while C is clear is still an
    // unknown critical option.
    let mut offset = options_start;
    for _ in 0..MAX_GENEVE_OPTIONS {
        if offset >= options_end {
            break;
        }
        let option: *const [u8; 4] = packet
            .header(offset)
            .ok_or(DropReason::GeneveOptionsTruncated)?;
        // SAFETY: bounds-checked by header().
        let option = unsafe { *option };
        if option[2] & 0x80 != 0 {
            return Err(DropReason::GeneveCriticalOption);
        }
        offset += 4 + ((option[3] & 0x1F) as usize) * 4;
    }
    if offset != options_end {
        return Err(DropReason::GeneveOptionsTruncated);
    }
    Ok(options_len)
}

/// Destination address of the inner frame at `at` (Ethernet, then IPv4 or IPv6).
#[inline(always)]
fn inner_destination(packet: &Packet, at: usize) -> Result<Addr, DropReason> {
    let eth: *const [u8; 14] = packet.header(at).ok_or(DropReason::GeneveInnerMalformed)?;
    // SAFETY: bounds-checked by header().
    let ether_type = unsafe { u16::from_be_bytes([(*eth)[12], (*eth)[13]]) };
    let l3 = at + ETH_LEN;
    match ether_type {
        ETH_P_IP => {
            let ip: *const [u8; 20] = packet.header(l3).ok_or(DropReason::GeneveInnerMalformed)?;
            // SAFETY: bounds-checked by header().
            let ip = unsafe { *ip };
            if ip[0] >> 4 != 4 {
                return Err(DropReason::GeneveInnerMalformed);
            }
            Ok(ipv4_mapped([ip[16], ip[17], ip[18], ip[19]]))
        }
        ETH_P_IPV6 => {
            let ip: *const [u8; 40] = packet.header(l3).ok_or(DropReason::GeneveInnerMalformed)?;
            // SAFETY: bounds-checked by header().
            let ip = unsafe { &*ip };
            if ip[0] >> 4 != 6 {
                return Err(DropReason::GeneveInnerMalformed);
            }
            let mut dst = [0u8; 16];
            dst.copy_from_slice(&ip[24..40]);
            Ok(dst)
        }
        _ => Err(DropReason::GeneveInnerMalformed),
    }
}
