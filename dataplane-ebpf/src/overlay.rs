//! The Geneve pod overlay (RFC 8926).
//!
//! Leaving a pod (tc): a packet for a pod on this node is handed straight to that pod's veth
//! (`bpf_redirect_peer`); a packet for a pod CIDR of another node is wrapped in outer
//! Ethernet / IP / UDP / Geneve and redirected out of the underlay NIC towards that node.
//! Arriving on the underlay (XDP): Geneve from a cluster node is checked as RFC 8926 requires,
//! unwrapped, and handed straight to the pod's veth when nothing on the stack's way would do
//! more than route it (`deliver_in_xdp`), else to the stack addressed to this node, which
//! routes it to the pod.
//! A pod CIDR of a hybrid node (`crate::hybrid`) is reached the same way in VXLAN.
//!
//! UDP checksum: zero for both underlay families. RFC 8926 §3.3 allows a zero checksum over
//! IPv4; over IPv6 it follows the tunnel rules of RFC 6935/6936 (zero checksums accepted by the
//! tunnel endpoints, which our receive path does). A computed checksum would need the whole
//! payload, which tc cannot do for GSO packets without the kernel's tunnel checksum offload.
//!
//! One file (about 1,550 lines) for now: splitting its decapsulation and routing into files of
//! their own changed what the optimizer inlined (16 % more instructions verified in
//! `tc_from_pod_deliver`, 32 bytes more stack in `tc_from_pod`), so the split waits for a
//! form that costs nothing in `cargo xtask verify`.

// Keys are passed to the map helpers by reference on purpose: by value they would be copied
// to the BPF stack, which the per-CPU lookup key is there to spare.
#![expect(
    clippy::needless_borrows_for_generic_args,
    reason = "keys stay in per-CPU memory"
)]

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
        bpf_csum_diff, bpf_fib_lookup, bpf_redirect, bpf_redirect_neigh, bpf_redirect_peer,
        bpf_skb_adjust_room, bpf_skb_load_bytes, bpf_skb_store_bytes, bpf_xdp_adjust_head,
        bpf_xdp_load_bytes,
    },
    maps::{PerCpuArray, lpm_trie::Key},
    programs::{TcContext, XdpContext},
};
use dataplane_common::{
    DropReason, PacketClass,
    frag::FRAG_NONE,
    multicast::is_group,
    overlay::{
        Addr, AddrCacheEntry, ENCAP_OVERHEAD_V4, ENCAP_OVERHEAD_V6, FAMILY_IPV6, GENEVE_HEADER_LEN,
        GENEVE_MAX_OPTIONS_LEN, GENEVE_PROTO_ETHERNET, LocalPod, OVERLAY_HAS_IPV4,
        OVERLAY_HAS_IPV6, OverlayConfig, RouteCacheEntry, TUNNEL_VXLAN, TunnelEndpoint,
        addr_cache_slot, outside_bit_v4, outside_bit_v6, route_cache_slot,
    },
};

use crate::lookup;
use crate::parse::{ETH_LEN, ETH_P_IP, ETH_P_IPV6, UDP_LEN};
use crate::{
    clock::clock,
    copy::{copy_addr, copy_bytes, same_bytes, set_ipv4_mapped, zero},
    csum::write_ipv4,
    hybrid, icmp,
    maps::{
        ACL_ENDPOINTS, ADDR_SCRATCH, ENCAP_SCRATCH_LEN, FIB_SCRATCH, LOCAL_POD_CACHE, LOCAL_PODS,
        NODE_ADDR_CACHE, NODE_ADDRS, OUTSIDE, ROUTE_CACHE, SCRATCH, SEGMENT_SCRATCH, XDP_PODS,
    },
    parse::{IPPROTO_TCP, IPPROTO_UDP, Packet, read},
    stage::Stage,
    tunnel,
    work::Parsed,
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const OUTER_TTL: u8 = 64;
/// Geneve options are walked one by one to find critical ones; each is at least 4 bytes.
const MAX_GENEVE_OPTIONS: usize = GENEVE_MAX_OPTIONS_LEN / 4;

/// Destination address of an untagged IP packet in 16-byte form, written into this CPU's
/// lookup key (prefix length 128): the pod lookups take it from there, not from copies on the
/// stack. An IPv4 one is read straight from the packet when its header is linear (nearly
/// always; a helper call costs more).
#[inline(always)]
fn destination(ctx: &TcContext, parsed: &Parsed) -> Option<&'static mut Key<Addr>> {
    let key = ADDR_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot, used within this program run only.
    let key = unsafe { &mut *key };
    key.prefix_len = 128;
    match parsed.ether_type {
        ETH_P_IP => {
            let at = ETH_LEN + 16;
            let v4: [u8; 4] = match read(ctx, at) {
                Some(v4) => v4,
                None => ctx.load(at).ok()?,
            };
            set_ipv4_mapped(&mut key.data, v4);
        }
        ETH_P_IPV6 => {
            let at = ctx.data() + ETH_LEN + 24;
            if at + 16 > ctx.data_end() {
                return None;
            }
            // SAFETY: the address lies within the linear packet (checked just above).
            unsafe { copy_bytes::<16>(key.data.as_mut_ptr(), at as *const u8) };
        }
        _ => return None,
    }
    Some(key)
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
    let Some(config) = lookup::overlay_config() else {
        return Ok(None);
    };
    let Some(dst) = destination(ctx, parsed) else {
        return Ok(None);
    };
    if !not_local && let Some(pod) = local_pod_at(&dst.data) {
        return Ok(Some((to_local_pod(ctx, pod), PacketClass::LocalRedirect)));
    }
    let Some(endpoint) = lookup::remote_endpoint_of(parsed.ether_type, dst) else {
        return Ok(None);
    };
    let vxlan = endpoint.kind == TUNNEL_VXLAN;
    // The hybrid network's own route (no node behind it): what no hybrid node announces is
    // dropped, never sent to where a node used to be.
    if vxlan && endpoint.addr[12..16] == [0; 4] {
        return Err(DropReason::HybridNoNode);
    }
    // Towards a hybrid node the limit is its VXLAN's (less overhead than Geneve's reserve).
    let mtu = if vxlan {
        match lookup::hybrid_settings() {
            Some(hybrid) if lookup::hybrid_on(hybrid) => hybrid.mtu,
            _ => config.pod_mtu,
        }
    } else {
        config.pod_mtu
    };
    // A single packet over the MTU is answered (ICMP fragmentation needed / packet too big)
    // so the sender's path MTU adapts; GSO packets are segmented to fit by the stack.
    // SAFETY: reading a field of our own context.
    let gso_size = unsafe { (*ctx.skb.skb).gso_size };
    if gso_size == 0 && ctx.len() - ETH_LEN as u32 > mtu {
        let ipv6 = parsed.ether_type == ETH_P_IPV6;
        let verdict = icmp::too_big(ctx, ipv6, mtu, config).into_value()? as i32;
        return Ok(Some((verdict, PacketClass::TooBigAnswered)));
    }
    let hash = inner_flow_hash(ctx, parsed);
    let verdict = encapsulate(ctx, config, endpoint, hash).into_value()? as i32;
    let class = if vxlan {
        PacketClass::VxlanEncap
    } else {
        PacketClass::GeneveEncap
    };
    Ok(Some((verdict, class)))
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
    let epoch = lookup::overlay_config().ok_or(false)?.pods_epoch;
    let dst = destination(ctx, parsed).ok_or(false)?;
    let pod = local_pod_at(&dst.data).ok_or(true)?;
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

/// Whether a packet that arrived on the underlay (decapsulated by XDP, merged by GRO) is for
/// a pod of this node and may be handed straight into it by tc ([`from_pod`] after the pod's
/// ingress policy), past what the stack would only do to it: route it to the pod's veth, lower
/// its TTL and pass the veth's egress. Its TTL (hop limit) is lowered here as that forwarding
/// would. `false`, nothing changed: what the stack does more than route stays the stack's (a
/// fragment, which it may reassemble; a TTL that runs out, which it answers; a single packet
/// over the pod's MTU). Skipping that pass is worth a route lookup, the forwarding, a queue
/// and a second receive for each merged packet: what GRO merged reaches the pod as one.
#[inline(always)]
pub fn forwarded_to_local_pod(ctx: &TcContext, parsed: &Parsed) -> bool {
    if parsed.l3_offset != ETH_LEN || parsed.fragment != FRAG_NONE {
        return false;
    }
    let Some(config) = lookup::overlay_config() else {
        return false;
    };
    let Some(dst) = destination(ctx, parsed) else {
        return false;
    };
    // SAFETY: only presence is checked.
    if unsafe { LOCAL_PODS.get(&dst.data) }.is_none() {
        return false;
    }
    // SAFETY: reading a field of our own context.
    let gso_size = unsafe { (*ctx.skb.skb).gso_size };
    if gso_size == 0 && ctx.len() - ETH_LEN as u32 > config.pod_mtu {
        return false;
    }
    let ipv4 = parsed.ether_type == ETH_P_IP;
    let packet = Packet::new(ctx.data(), ctx.data_end(), ctx.len() as usize);
    let ttl_at = if ipv4 { ETH_LEN + 8 } else { ETH_LEN + 7 };
    let Some(ttl) = packet.header::<u8>(ttl_at) else {
        return false;
    };
    // SAFETY: bounds-checked by header().
    if unsafe { *ttl } <= 1 {
        return false;
    }
    forward_hop(&packet, ipv4)
}

/// Length of the outer headers plus the inner Ethernet header, written in one store:
/// Ethernet (14), IPv4 (20) or IPv6 (40), UDP (8), Geneve (8), inner Ethernet (14).
const ENCAP_BLOCK_V4: usize = 14 + 20 + 8 + 8 + 14;
const ENCAP_BLOCK_V6: usize = 14 + 40 + 8 + 8 + 14;

/// Wraps the packet in Geneve (VXLAN towards a hybrid node) towards `endpoint` and redirects
/// it out of the underlay.
#[inline(never)]
pub(crate) fn encapsulate(
    ctx: &TcContext,
    config: &OverlayConfig,
    endpoint: &TunnelEndpoint,
    hash: u32,
) -> Stage {
    Stage::value(wrap(ctx, config, endpoint, hash).map(|verdict| verdict as u32))
}

/// `hash`: the inner flow's ([`inner_flow_hash`]), for the outer source port and flow label.
#[inline(always)]
fn wrap(
    ctx: &TcContext,
    config: &OverlayConfig,
    endpoint: &TunnelEndpoint,
    hash: u32,
) -> Result<i32, DropReason> {
    let ipv6 = endpoint.family == FAMILY_IPV6;
    let vxlan = endpoint.kind == TUNNEL_VXLAN;
    // The hybrid overlay is IPv4 only (`crate::hybrid`).
    if vxlan && ipv6 {
        return Err(DropReason::OverlayNoRoute);
    }
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
    // The pod's Ethernet header becomes the inner one, at the end of the block: copied
    // straight from the packet (a pod's frame always has it in the linear data).
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + ETH_LEN > end {
        return Err(DropReason::EthTruncated);
    }

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
    let slot = tunnel_route(ctx, config, endpoint, mtu_checked_len).into_value()?;
    let route = ROUTE_CACHE
        .get(slot)
        .ok_or(DropReason::OverlayEncapFailed)?;
    let source_port = tunnel_source_port(hash);
    let written = if ipv6 {
        let udp_len = (outer_len - 40) as u16;
        write_geneve_v6(
            block,
            &route.dmac,
            &route.smac,
            config,
            endpoint,
            udp_len,
            hash,
        );
        // SAFETY: 14 bytes of the linear packet (checked above) into the block.
        unsafe {
            copy_bytes::<14>(
                block[ENCAP_BLOCK_V6 - 14..].as_mut_ptr(),
                start as *const u8,
            )
        };
        ENCAP_BLOCK_V6
    } else {
        let udp_len = (outer_len - 20) as u16;
        // What `write_outer_v4` does, written out: called here, it cost this function 16 more
        // bytes of stack (the IPv6 header's function did not).
        let dst = [
            endpoint.addr[12],
            endpoint.addr[13],
            endpoint.addr[14],
            endpoint.addr[15],
        ];
        write_ethernet(block, &route.dmac, &route.smac, ETH_P_IP);
        write_ipv4(
            block,
            outer_len as u16,
            IPPROTO_UDP,
            true,
            &config.node_ipv4,
            &dst,
        );
        // SAFETY: 14 bytes of the linear packet (checked above) into the block.
        unsafe {
            copy_bytes::<14>(
                block[ENCAP_BLOCK_V4 - 14..].as_mut_ptr(),
                start as *const u8,
            )
        };
        if vxlan {
            let Some(hybrid) = lookup::hybrid_settings() else {
                return Err(DropReason::OverlayNoRoute);
            };
            if !lookup::hybrid_on(hybrid) {
                return Err(DropReason::OverlayNoRoute);
            }
            hybrid::write_udp_vxlan(block, source_port, hybrid.vxlan_port, udp_len);
            // A hybrid node takes only frames to its router MAC.
            hybrid::inner_macs(block, ENCAP_BLOCK_V4 - 14, endpoint)
                .ok_or(DropReason::OverlayNoRoute)?;
        } else {
            write_geneve_after_v4(block, config, udp_len, hash);
        }
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
    let verdict = if route.resolved != 0 {
        // SAFETY: plain helper call.
        unsafe { bpf_redirect(route.ifindex, 0) }
    } else {
        // The next hop's MAC is not resolved yet: let the kernel resolve it (and queue the
        // packet meanwhile) instead of dropping the first packets of every flow.
        // SAFETY: a null parameter block asks the kernel to do its own FIB lookup.
        unsafe { bpf_redirect_neigh(route.ifindex, core::ptr::null_mut(), 0, 0) }
    };
    if verdict != TC_ACT_REDIRECT as i64 {
        return Err(DropReason::OverlayNoRoute);
    }
    Ok(TC_ACT_REDIRECT)
}

/// The route to `endpoint` for an outer packet of `len` bytes (0: a GSO packet, not checked
/// against the route's MTU): this CPU's copy from the same clock second when it was checked
/// for at least `len` bytes, else the kernel's FIB lookup, copied. An unresolved next hop is
/// copied as such (`resolved` 0: `bpf_redirect_neigh` resolves it, the kernel's own lookup).
/// The lookup is made before the packet is touched, so a failure leaves it intact.
/// A subprogram, whose value is the entry's slot: inlined, its values crowded the
/// encapsulation's registers and took its stack from 128 to 224 bytes.
/// XDP's NodePort path uses it too (`lb::xdp`), which then needs the next hop resolved.
#[inline(never)]
pub(crate) fn tunnel_route<C: aya_ebpf::EbpfContext>(
    ctx: &C,
    config: &OverlayConfig,
    endpoint: &TunnelEndpoint,
    len: u32,
) -> Stage {
    Stage::value(route_slot(ctx, config, endpoint, len))
}

#[inline(always)]
fn route_slot<C: aya_ebpf::EbpfContext>(
    ctx: &C,
    config: &OverlayConfig,
    endpoint: &TunnelEndpoint,
    len: u32,
) -> Result<u32, DropReason> {
    let slot = route_cache_slot(
        address_word(&endpoint.addr, 2),
        address_word(&endpoint.addr, 3),
    );
    // A next hop not resolved at the fill is looked up again: the neighbour entry usually
    // follows within milliseconds, and XDP can only send to a resolved one.
    if let Some(entry) = ROUTE_CACHE.get(slot)
        && current_route(entry, config, endpoint)
        && len <= entry.fits_len
        && entry.resolved == 1
    {
        return Ok(slot);
    }
    let fib = FIB_SCRATCH
        .get_ptr_mut(0)
        .ok_or(DropReason::OverlayEncapFailed)?;
    // SAFETY: per-CPU map memory, used only by this program invocation.
    let fib = unsafe { &mut *fib };
    fill_fib_params(fib, config, endpoint, len);
    let rc = fib_lookup_output(ctx, fib);
    if rc == BPF_FIB_LKUP_RET_FRAG_NEEDED {
        return Err(DropReason::OverlayMtuExceeded);
    }
    if rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
        return Err(DropReason::OverlayNoRoute);
    }
    // Looked up again rather than kept across the call: fewer values for the stack.
    let entry = ROUTE_CACHE
        .get_ptr_mut(slot)
        .ok_or(DropReason::OverlayEncapFailed)?;
    // SAFETY: this CPU's slot, written only by this CPU's program runs.
    let entry = unsafe { &mut *entry };
    // A longer packet's check of the same second covers the shorter ones checked before.
    if !current_route(entry, config, endpoint) || entry.fits_len < len {
        entry.fits_len = len;
    }
    let (ticks, per_second) = clock();
    let mut i = 0;
    while i < 4 {
        entry.addr[i] = address_word(&endpoint.addr, i);
        i += 1;
    }
    entry.until = (ticks / per_second + 1) * per_second;
    entry.ifindex = fib.ifindex;
    entry.underlay_ifindex = config.underlay_ifindex;
    entry.resolved = (rc == BPF_FIB_LKUP_RET_SUCCESS) as u8;
    // SAFETY: six bytes each, distinct memory.
    unsafe {
        copy_bytes::<6>(entry.dmac.as_mut_ptr(), fib.dmac.as_ptr());
        copy_bytes::<6>(entry.smac.as_mut_ptr(), fib.smac.as_ptr());
    }
    Ok(slot)
}

/// Whether `entry` is this CPU's copy of the route to `endpoint`, filled in this clock second
/// for the same underlay device.
#[inline(always)]
fn current_route(
    entry: &RouteCacheEntry,
    config: &OverlayConfig,
    endpoint: &TunnelEndpoint,
) -> bool {
    let mut i = 0;
    while i < 4 {
        if entry.addr[i] != address_word(&endpoint.addr, i) {
            return false;
        }
        i += 1;
    }
    clock().0 < entry.until && entry.underlay_ifindex == config.underlay_ifindex
}

/// The `i`th four bytes of an address as a word (the bytes in their order in memory). Read
/// volatile: LLVM would otherwise keep the bytes it read for one use for the next, spilling
/// them across the calls in between (64 more bytes of stack).
#[inline(always)]
fn address_word(addr: &Addr, i: usize) -> u32 {
    let at = addr.as_ptr();
    // SAFETY: `i < 4`, within the 16 bytes.
    let byte = |k: usize| unsafe { core::ptr::read_volatile(at.add(4 * i + k)) };
    u32::from_ne_bytes([byte(0), byte(1), byte(2), byte(3)])
}

/// A hash of the inner flow (addresses, ports, protocol; the same both ways), for the outer
/// UDP source port: the kernel's own (`bpf_get_hash_recalc`) runs the flow dissector and
/// SipHash, about a fifth of an encapsulation's time. `parsed` is an untagged IP packet's.
#[inline(always)]
pub fn inner_flow_hash(ctx: &TcContext, parsed: &Parsed) -> u32 {
    let mut fold = u32::from_ne_bytes([
        parsed.src_port[0] ^ parsed.dst_port[0],
        parsed.src_port[1] ^ parsed.dst_port[1],
        parsed.protocol,
        0,
    ]);
    if parsed.ether_type == ETH_P_IPV6 {
        if let Some(words) = read::<[u32; 8]>(ctx, ETH_LEN + 8) {
            let mut i = 0;
            while i < 8 {
                fold ^= words[i];
                i += 1;
            }
        }
    } else if let Some([src, dst]) = read::<[u32; 2]>(ctx, ETH_LEN + 12) {
        fold ^= src ^ dst;
    }
    // The murmur3 finalizer: every input bit reaches every output bit.
    fold ^= fold >> 16;
    fold = fold.wrapping_mul(0x85eb_ca6b);
    fold ^= fold >> 13;
    fold = fold.wrapping_mul(0xc2b2_ae35);
    fold ^ (fold >> 16)
}

/// The pod of this node at `addr` (`LOCAL_PODS`), from this CPU's copy when it holds one of
/// the current epoch; a hit is kept. The reference is to this CPU's copy (or the map's value):
/// use it before the next lookup. A call of its own: inlined, its checks and copies added to
/// the stack of every caller's frame.
#[inline(never)]
pub(crate) fn local_pod_at(addr: &Addr) -> Option<&'static LocalPod> {
    let stamp = cache_stamp();
    if let Some(entry) = cached_addr(&LOCAL_POD_CACHE, addr, stamp) {
        return Some(&entry.pod);
    }
    // SAFETY: map values stay valid under RCU for the program's run.
    let pod = unsafe { LOCAL_PODS.get(addr) }?;
    let Some(entry) = cache_slot(&LOCAL_POD_CACHE, addr, stamp) else {
        return Some(pod);
    };
    // SAFETY: this CPU's slot of a per-CPU map, used by one program run at a time; whole
    // `LocalPod`s, distinct memory.
    unsafe {
        copy_bytes::<{ core::mem::size_of::<LocalPod>() }>(
            (&raw mut (*entry).pod).cast(),
            (pod as *const LocalPod).cast(),
        );
        Some(&(*entry).pod)
    }
}

/// Whether `addr` is a node's underlay address (`NODE_ADDRS`), from this CPU's copy when it
/// holds one of the current epoch; a hit is kept. A call of its own, as [`local_pod_at`].
#[inline(never)]
pub(crate) fn known_node(addr: &Addr) -> bool {
    let stamp = cache_stamp();
    if cached_addr(&NODE_ADDR_CACHE, addr, stamp).is_some() {
        return true;
    }
    // SAFETY: only presence is checked.
    if unsafe { NODE_ADDRS.get(addr) }.is_none() {
        return false;
    }
    let _ = cache_slot(&NODE_ADDR_CACHE, addr, stamp);
    true
}

/// What an address cache entry of the current epoch carries: the epoch plus one (0, never
/// used: no overlay config, or the epoch about to wrap to where unfilled slots are).
#[inline(always)]
fn cache_stamp() -> u32 {
    lookup::overlay_config().map_or(0, |config| config.pods_epoch.wrapping_add(1))
}

/// This CPU's entry for `addr` in `cache`, if it was filled under `stamp`.
#[inline(always)]
fn cached_addr(
    cache: &'static PerCpuArray<AddrCacheEntry>,
    addr: &Addr,
    stamp: u32,
) -> Option<&'static AddrCacheEntry> {
    if stamp == 0 {
        return None;
    }
    let entry = cache.get(addr_cache_slot(addr))?;
    // SAFETY: both are whole 16-byte addresses at even offsets.
    (entry.epoch_plus_one == stamp && unsafe { same_bytes::<16>(entry.addr.as_ptr(), addr) })
        .then_some(entry)
}

/// This CPU's slot for `addr` in `cache`, claimed for it under `stamp` (the caller fills in
/// what it found); `None` when nothing may be cached.
#[inline(always)]
fn cache_slot(
    cache: &'static PerCpuArray<AddrCacheEntry>,
    addr: &Addr,
    stamp: u32,
) -> Option<*mut AddrCacheEntry> {
    if stamp == 0 {
        return None;
    }
    let slot = cache.get_ptr_mut(addr_cache_slot(addr))?;
    // SAFETY: this CPU's slot of a per-CPU map, used by one program run at a time.
    let entry = unsafe { &mut *slot };
    copy_addr(&mut entry.addr, addr);
    entry.epoch_plus_one = stamp;
    Some(slot)
}

/// Whether a packet's destination is known to lie outside every pod network, this node's
/// pods and every remote pod subnet (`OUTSIDE`, kept by the agent): then neither local
/// delivery nor the overlay applies, and their lookups are skipped. `false` when unknown.
#[inline(always)]
pub fn outside_pod_networks(ctx: &TcContext, parsed: &Parsed) -> bool {
    if parsed.l3_offset != ETH_LEN {
        return false;
    }
    let (word, bit) = if parsed.ether_type == ETH_P_IP {
        match read::<[u8; 4]>(ctx, ETH_LEN + 16) {
            Some(dst) => outside_bit_v4(dst),
            None => return false,
        }
    } else if parsed.ether_type == ETH_P_IPV6 {
        match read::<[u8; 4]>(ctx, ETH_LEN + 24) {
            Some(dst) => outside_bit_v6(dst),
            None => return false,
        }
    } else {
        return false;
    };
    OUTSIDE.get(word).is_some_and(|w| *w & bit != 0)
}

/// The outer UDP source port of a flow's encapsulated packets: from the inner flow's hash, so
/// that ECMP paths and receive queues spread flows and keep each one in order.
#[inline(always)]
pub(crate) fn tunnel_source_port(hash: u32) -> u16 {
    0xC000u16 | (hash as u16 & 0x3FFF)
}

/// The outer headers of a Geneve packet over IPv6 to `endpoint`, at the start of `block`:
/// Ethernet (`dmac`, `smac`), IPv6 from this node's address with the flow label from `hash`,
/// UDP from the flow's source port ([`tunnel_source_port`]) to the Geneve port, and the Geneve
/// base header with the overlay's VNI. `udp_len` counts the UDP header and everything after
/// it. The one place the IPv6 outer header is built: the overlay's encapsulation, the NodePort
/// fast path's and multicast's copies all call it. (The MACs come apart: passed as a pair,
/// they cost `encapsulate` 16 more bytes of stack.)
#[inline(always)]
pub(crate) fn write_geneve_v6(
    block: &mut [u8; ENCAP_SCRATCH_LEN],
    dmac: &[u8; 6],
    smac: &[u8; 6],
    config: &OverlayConfig,
    endpoint: &TunnelEndpoint,
    udp_len: u16,
    hash: u32,
) {
    write_ethernet(block, dmac, smac, ETH_P_IPV6);
    write_ipv6(block, udp_len, &config.node_ipv6, &endpoint.addr, hash);
    write_udp_geneve(
        block,
        14 + 40,
        tunnel_source_port(hash),
        config.geneve_port,
        udp_len,
        config.vni,
    );
}

/// The outer Ethernet and IPv4 headers of a tunnel packet to `endpoint` (`total_len` bytes
/// from the IPv4 header on), with DF set: the overlay answers oversize packets itself rather
/// than letting the underlay fragment. The UDP and tunnel headers follow at 34. (`encapsulate`
/// writes the same two headers itself, for its stack's sake.)
#[inline(always)]
pub(crate) fn write_outer_v4(
    block: &mut [u8; ENCAP_SCRATCH_LEN],
    dmac: &[u8; 6],
    smac: &[u8; 6],
    config: &OverlayConfig,
    endpoint: &TunnelEndpoint,
    total_len: u16,
) {
    let dst = [
        endpoint.addr[12],
        endpoint.addr[13],
        endpoint.addr[14],
        endpoint.addr[15],
    ];
    write_ethernet(block, dmac, smac, ETH_P_IP);
    write_ipv4(block, total_len, IPPROTO_UDP, true, &config.node_ipv4, &dst);
}

/// The UDP and Geneve headers of an IPv4 tunnel packet (after [`write_outer_v4`]).
#[inline(always)]
pub(crate) fn write_geneve_after_v4(
    block: &mut [u8; ENCAP_SCRATCH_LEN],
    config: &OverlayConfig,
    udp_len: u16,
    hash: u32,
) {
    write_udp_geneve(
        block,
        14 + 20,
        tunnel_source_port(hash),
        config.geneve_port,
        udp_len,
        config.vni,
    );
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
    // Field by field (see `write_ipv4`).
    let at = if at == 14 + 40 { 54 } else { 34 };
    block[at..at + 2].copy_from_slice(&source_port.to_be_bytes());
    block[at + 2..at + 4].copy_from_slice(&dest_port.to_be_bytes());
    block[at + 4..at + 6].copy_from_slice(&udp_len.to_be_bytes());
    block[at + 6..at + 12].copy_from_slice(&[0, 0, 0, 0, 0, 0]);
    block[at + 10..at + 12].copy_from_slice(&GENEVE_PROTO_ETHERNET.to_be_bytes());
    block[at + 12..at + 16].copy_from_slice(&(vni << 8).to_be_bytes());
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
    let config = lookup::overlay_config().ok_or(DropReason::OverlayNoRoute)?;
    // A hybrid pod (a service reply to it) is behind its node's VXLAN, not a next hop of the
    // underlay (the FIB lookup, bound to the underlay, finds no route to it): sent into the
    // management port, it is wrapped in VXLAN on the other side like any pod's packet (an
    // extra veth hop for these replies, rather than the encapsulation's stack frame on top of
    // every load-balancer path).
    if parsed.l3_offset == ETH_LEN
        && parsed.ether_type == ETH_P_IP
        && let Some(mgmt) = lookup::hybrid_settings()
        && lookup::hybrid_on(mgmt)
        && let Some(dst) = destination(ctx, parsed)
        && lookup::remote_endpoint_of(parsed.ether_type, dst)
            .is_some_and(|e| e.kind == TUNNEL_VXLAN)
    {
        // SAFETY: plain helper call.
        let verdict = unsafe { bpf_redirect(mgmt.mgmt_ifindex, 0) };
        if mgmt.mgmt_ifindex == 0 || verdict != TC_ACT_REDIRECT as i64 {
            return Err(DropReason::OverlayNoRoute);
        }
        return Ok(TC_ACT_REDIRECT);
    }
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
        fib.family = AF_INET6;
        // Loaded by the helper straight into the parameters (a variable offset; no copy on
        // the stack).
        // SAFETY: each destination is a [u32; 4] of 16 bytes in map memory.
        let loaded = unsafe {
            bpf_skb_load_bytes(
                ctx.as_ptr(),
                (l3 + 8) as u32,
                fib.__bindgen_anon_3.ipv6_src.as_mut_ptr().cast(),
                16,
            ) | bpf_skb_load_bytes(
                ctx.as_ptr(),
                (l3 + 24) as u32,
                fib.__bindgen_anon_4.ipv6_dst.as_mut_ptr().cast(),
                16,
            )
        };
        if loaded != 0 {
            return Err(DropReason::Ipv6Truncated);
        }
    }
    fib.l4_protocol = parsed.protocol;
    let rc = fib_lookup_output(ctx, fib);
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

/// The kernel's FIB lookup for a packet this node sends out (`BPF_FIB_LOOKUP_OUTPUT`) with
/// the parameters in `fib`, which it fills with the result: the lookup's return code.
#[inline(always)]
pub(crate) fn fib_lookup_output<C: aya_ebpf::EbpfContext>(ctx: &C, fib: &mut FibParams) -> u32 {
    // SAFETY: fib is a valid bpf_fib_lookup and its size is passed.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.as_ptr(),
            fib,
            core::mem::size_of::<FibParams>() as i32,
            BPF_FIB_LOOKUP_OUTPUT,
        )
    };
    rc as u32
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
        // SAFETY: the union fields are [u32; 4], 16 bytes each.
        unsafe {
            set_words(&mut fib.__bindgen_anon_3.ipv6_src, &config.node_ipv6);
            set_words(&mut fib.__bindgen_anon_4.ipv6_dst, &endpoint.addr);
        }
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

/// Writes 16 network-order bytes into the four u32 words the kernel's structures hold them
/// in, byte by byte (no array of words assembled on the stack).
#[inline(always)]
fn set_words(words: &mut [u32; 4], addr: &Addr) {
    // SAFETY: 16 bytes each, distinct.
    unsafe { copy_bytes::<16>(words.as_mut_ptr().cast(), addr.as_ptr()) }
}

/// Whether a parsed packet is UDP to this node's Geneve port (what [`decapsulate`] looks at).
#[inline(always)]
pub fn geneve_port(parsed: &Parsed) -> bool {
    parsed.class == PacketClass::Udp
        && lookup::overlay_config()
            .is_some_and(|config| u16::from_be_bytes(parsed.dst_port) == config.geneve_port)
}

/// The XDP stage for Geneve arriving on the underlay: the XDP action when the packet was
/// Geneve for a pod of this node, nothing when it is no Geneve for this node.
#[inline(always)]
pub fn decapsulate(ctx: &XdpContext, parsed: &Parsed) -> Stage {
    let packet = Packet::new(ctx.data(), ctx.data_end(), ctx.data_end() - ctx.data());
    Stage::new(
        unwrap_geneve(ctx, &packet, parsed)
            .map(|done| done.map(|action| (action, PacketClass::GeneveDecap))),
    )
}

/// RFC 8926's receive checks on a parsed packet, the same at either hook: `Ok(None)` when it
/// is no Geneve for this node (not to its port or address, or a multicast copy, which
/// `tc_underlay_multicast` takes whole); else the offset of the inner Ethernet frame and the
/// local pod it is for (`None`: a pod's traffic this node sends out from an egress address).
/// `metadata_vid`: the VLAN id the kernel took out of the frame into the socket buffer (tc),
/// `None` where the tag stays in the frame (XDP). `key` holds the inner destination after.
#[inline(always)]
fn geneve_inner(
    packet: &Packet,
    parsed: &Parsed,
    config: &OverlayConfig,
    metadata_vid: Option<u16>,
    key: &mut Key<Addr>,
) -> Result<Option<(usize, Option<LocalPod>)>, DropReason> {
    if parsed.class != PacketClass::Udp || u16::from_be_bytes(parsed.dst_port) != config.geneve_port
    {
        return Ok(None);
    }
    if !outer_addresses(packet, parsed, config, &mut key.data)? {
        return Ok(None);
    }
    check_vlan(packet, parsed, config, metadata_vid)?;
    if !known_node(&key.data) {
        return Err(DropReason::GeneveUnknownNode);
    }
    let geneve = parsed.l4_offset + UDP_LEN;
    let options_len = check_geneve(packet, geneve, config.vni)?;
    let inner = geneve + GENEVE_HEADER_LEN + options_len;
    inner_address(packet, inner, false, &mut key.data)?;
    // A copy to a multicast group goes up whole: `tc_underlay_multicast` reads the sender's
    // namespace from its options and copies it to the group's pods.
    if is_group(&key.data) {
        return Ok(None);
    }
    let pod = local_pod_at(&key.data).copied();
    if pod.is_none() && !egress_bound(packet, inner, key)? {
        return Err(DropReason::GeneveNoLocalPod);
    }
    Ok(Some((inner, pod)))
}

#[inline(always)]
fn unwrap_geneve(
    ctx: &XdpContext,
    packet: &Packet,
    parsed: &Parsed,
) -> Result<Option<u32>, DropReason> {
    let Some(config) = lookup::overlay_config() else {
        return Ok(None);
    };
    let key = ADDR_SCRATCH
        .get_ptr_mut(0)
        .ok_or(DropReason::ScratchUnavailable)?;
    // SAFETY: this CPU's slot, used within this program run only.
    let key = unsafe { &mut *key };
    let Some((inner, pod)) = geneve_inner(packet, parsed, config, None, key)? else {
        return Ok(None);
    };
    // SAFETY: plain helper call; shrinking from the front by a length checked above.
    if unsafe { bpf_xdp_adjust_head(ctx.ctx, inner as i32) } != 0 {
        return Err(DropReason::GeneveInnerMalformed);
    }
    // `key` still holds the inner destination: it was overwritten only when no pod was found.
    if let Some(pod) = pod
        && let Some((action, _)) = deliver_in_xdp(ctx, &pod, &key.data).result()?
    {
        return Ok(Some(action));
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

/// The tc stage for Geneve arriving on the underlay (what XDP left whole, and every Geneve
/// packet where the uplink runs no XDP, `--uplink-hook tc`): the same checks as XDP's, then
/// the packet unwrapped in place ([`tunnel::strip_outer`]). `Ok(false)`: no Geneve for this node
/// (a multicast copy included), untouched.
#[inline(always)]
pub fn decapsulate_skb(ctx: &TcContext, parsed: &Parsed) -> Result<bool, DropReason> {
    let Some(config) = lookup::overlay_config() else {
        return Ok(false);
    };
    let packet = tunnel::pulled(ctx);
    let key = ADDR_SCRATCH
        .get_ptr_mut(0)
        .ok_or(DropReason::ScratchUnavailable)?;
    // SAFETY: this CPU's slot, used within this program run only.
    let key = unsafe { &mut *key };
    let Some((inner, _)) = geneve_inner(&packet, parsed, config, tunnel::skb_vid(ctx), key)? else {
        return Ok(false);
    };
    if !tunnel::strip_outer(ctx, parsed, inner, &config.underlay_mac) {
        return Err(DropReason::GeneveInnerMalformed);
    }
    Ok(true)
}

/// Inner frames whose transport segment is longer than this go up the stack: GRO merges them
/// there, and verifying their checksum here would cost more than the stack's pass saves.
const XDP_DELIVER_MAX_L4: usize = 512;

/// Hands a decapsulated frame (now at the packet's start) for the local pod `pod` (address
/// `dst`, 16-byte form) straight into the pod's veth through `XDP_PODS`, past this node's
/// stack, `tc_underlay` and `tc_to_pod`, when none of them would do more than route it:
/// - the pod's end takes frames from XDP (its host veth is in `XDP_PODS`);
/// - not from a backend's port (a service reply, which the load-balancer translates), nor a
///   DNS answer to a pod under access control (the agent gets a copy of those from tc);
/// - UDP, or TCP without data (see [`tcp_carries_data`]), in IPv4 without options or
///   fragmentation, or in IPv6 without extension headers, as long as its IP header says,
///   with a hop limit above 1;
/// - its transport checksum verifies, or holds the pseudo-header's sum a sender with checksum
///   offload leaves to its receiver (as a veth underlay carries such frames): that one is
///   completed here, since an XDP frame cannot tell the pod to trust it as the stack would.
///
/// Then the pod's ingress policy judges it as `tc_to_pod` would (`acl::to_pod_in_xdp`: a
/// denied frame is dropped here, with its reason), and it is addressed as the pod's gateway
/// would, its hop limit lowered by one as the stack's forwarding does, and redirected.
/// Nothing (`Ok(None)`): the frame was not changed and goes up. A call of its own: its frame
/// is not added to the decapsulation's.
#[inline(never)]
fn deliver_in_xdp(ctx: &XdpContext, pod: &LocalPod, dst: &Addr) -> Stage {
    Stage::new(deliver_frame(ctx, pod, dst))
}

#[inline(always)]
fn deliver_frame(
    ctx: &XdpContext,
    pod: &LocalPod,
    dst: &Addr,
) -> Result<Option<(u32, PacketClass)>, DropReason> {
    // Only sets where the frame goes if the program returns XDP_REDIRECT.
    if XDP_PODS.redirect(pod.ifindex, 0).is_err() {
        return Ok(None);
    }
    let (start, end) = (ctx.data(), ctx.data_end());
    let packet = Packet::new(start, end, end - start);
    let Some(eth) = packet.header::<[u8; 14]>(0) else {
        return Ok(None);
    };
    // SAFETY: bounds-checked by header().
    let ether_type = unsafe { u16::from_be_bytes([(*eth)[12], (*eth)[13]]) };
    let ipv4 = ether_type == ETH_P_IP;
    let verdict = match ether_type {
        ETH_P_IP => inner_ipv4(&packet).map_or(SEGMENT_REFUSED, |seg| seg.accepted(ctx)),
        ETH_P_IPV6 => inner_ipv6(&packet).map_or(SEGMENT_REFUSED, |seg| seg.accepted(ctx)),
        _ => SEGMENT_REFUSED,
    };
    if verdict == SEGMENT_REFUSED {
        return Ok(None);
    }
    if crate::acl::active() {
        // SAFETY: only presence is checked.
        let controlled = unsafe { ACL_ENDPOINTS.get(dst) }.is_some();
        if controlled && dns_answer(&packet, ipv4) {
            return Ok(None);
        }
        match crate::acl::to_pod_in_xdp(ctx, ipv4 as u32) {
            0 => {}
            crate::acl::XDP_LEAVE_TO_TC => return Ok(None),
            code => {
                return Err(DropReason::from_code(code).unwrap_or(DropReason::PolicyDeniedIngress));
            }
        }
    }
    if !forward_hop(&packet, ipv4) {
        return Ok(None);
    }
    if verdict & SEGMENT_COMPLETE != 0 && !complete_checksum(&packet, ipv4, verdict) {
        return Ok(None);
    }
    // SAFETY: the Ethernet header was bounds-checked above.
    unsafe {
        copy_bytes::<6>(start as *mut u8, pod.pod_mac.as_ptr());
        copy_bytes::<6>((start + 6) as *mut u8, pod.host_mac.as_ptr());
    }
    Ok(Some((xdp_action::XDP_REDIRECT, PacketClass::LocalRedirect)))
}

/// Writes the checksum a [`SEGMENT_COMPLETE`] verdict carries into the segment's field (TCP's
/// or UDP's, after an IPv4 header without options or a bare IPv6 header).
#[inline(always)]
fn complete_checksum(packet: &Packet, ipv4: bool, verdict: u32) -> bool {
    let l4 = if ipv4 { ETH_LEN + 20 } else { ETH_LEN + 40 };
    let at = if verdict & SEGMENT_TCP != 0 {
        l4 + 16
    } else {
        l4 + 6
    };
    let Some(field) = packet.header::<[u8; 2]>(at) else {
        return false;
    };
    // SAFETY: bounds-checked by header(); the frame is writable in XDP.
    unsafe { *(field as *mut [u8; 2]) = (verdict as u16).to_ne_bytes() };
    true
}

/// Whether the inner frame (IPv4 without options or IPv6 without extension headers) is UDP
/// from port 53.
#[inline(always)]
fn dns_answer(packet: &Packet, ipv4: bool) -> bool {
    let (protocol_at, l4) = if ipv4 {
        (ETH_LEN + 9, ETH_LEN + 20)
    } else {
        (ETH_LEN + 6, ETH_LEN + 40)
    };
    let (Some(protocol), Some(port)) = (
        packet.header::<u8>(protocol_at),
        packet.header::<[u8; 2]>(l4),
    ) else {
        return true;
    };
    // SAFETY: both bounds-checked by header().
    unsafe { *protocol == IPPROTO_UDP && *port == 53u16.to_be_bytes() }
}

/// The transport segment of an inner frame, as its IP header describes it.
struct Segment<const L4: usize> {
    len: usize,
    protocol: u8,
    /// One's-complement sum (unfolded, native word order) of the pseudo-header.
    pseudo: u64,
}

impl<const L4: usize> Segment<L4> {
    /// [`segment_accepted`], its fields passed in registers (not a frame on the caller's
    /// stack).
    #[inline(always)]
    fn accepted(&self, ctx: &XdpContext) -> u32 {
        segment_accepted::<L4>(ctx, self.len, self.protocol as u32, self.pseudo)
    }
}

/// Whether the TCP segment of `len` bytes at `L4` carries data (or its header cannot be read).
/// Only segments without data are delivered in XDP: a flow's longer segments go up the stack
/// (GRO holds them until the poll ends), and a short one delivered here overtook them (the
/// last segment of a burst: the receiver saw the flow reordered and the sender retransmitted
/// five times as often as over the kernel's VXLAN device). Segments without data (ACKs, and a
/// SYN, FIN or RST without any) reorder no data.
#[inline(always)]
fn tcp_carries_data<const L4: usize>(packet: &Packet, len: usize) -> bool {
    let Some(offset) = packet.header::<u8>(L4 + 12) else {
        return true;
    };
    // SAFETY: bounds-checked by header().
    let header = (unsafe { *offset } >> 4) as usize * 4;
    len > header
}

/// Sum of the `WORDS` 4-byte words of `header` from byte `AT` on, read in native order (see
/// [`segment_accepted`]), straight from the packet.
#[inline(always)]
fn word_sum<const N: usize, const AT: usize, const WORDS: usize>(header: &[u8; N]) -> u64 {
    let mut sum = 0u64;
    for w in 0..WORDS {
        let i = AT + w * 4;
        sum += u32::from_ne_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]) as u64;
    }
    sum
}

/// An inner IPv4 frame XDP may deliver: no options, no fragment, TTL above 1, TCP or UDP,
/// its total length that of the frame.
#[inline(always)]
fn inner_ipv4(packet: &Packet) -> Option<Segment<{ ETH_LEN + 20 }>> {
    let ip: *const [u8; 20] = packet.header(ETH_LEN)?;
    // SAFETY: bounds-checked by header().
    let ip = unsafe { &*ip };
    // Fragments (MF or an offset; DF may be set) are tc's, which remembers their ports.
    if ip[0] != 0x45 || ip[6] & 0x3F != 0 || ip[7] != 0 || ip[8] <= 1 {
        return None;
    }
    let protocol = ip[9];
    if !matches!(protocol, IPPROTO_TCP | IPPROTO_UDP) {
        return None;
    }
    let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    if ETH_LEN + total != packet.len() {
        return None;
    }
    let len = total.checked_sub(20)?;
    let tail = [0, protocol, (len >> 8) as u8, len as u8];
    Some(Segment {
        len,
        protocol,
        pseudo: word_sum::<20, 12, 2>(ip) + u32::from_ne_bytes(tail) as u64,
    })
}

/// An inner IPv6 frame XDP may deliver: TCP or UDP right after the fixed header, hop limit
/// above 1, its payload length that of the frame.
#[inline(always)]
fn inner_ipv6(packet: &Packet) -> Option<Segment<{ ETH_LEN + 40 }>> {
    let ip: *const [u8; 40] = packet.header(ETH_LEN)?;
    // SAFETY: bounds-checked by header().
    let ip = unsafe { &*ip };
    let protocol = ip[6];
    if ip[0] >> 4 != 6 || !matches!(protocol, IPPROTO_TCP | IPPROTO_UDP) || ip[7] <= 1 {
        return None;
    }
    let len = u16::from_be_bytes([ip[4], ip[5]]) as usize;
    if ETH_LEN + 40 + len != packet.len() {
        return None;
    }
    let tail = [0, 0, (len >> 8) as u8, len as u8];
    Some(Segment {
        len,
        protocol,
        pseudo: word_sum::<40, 8, 8>(ip)
            + u32::from_ne_bytes(tail) as u64
            + u32::from_ne_bytes([0, 0, 0, protocol]) as u64,
    })
}

/// [`segment_accepted`]: not a segment to deliver in XDP.
const SEGMENT_REFUSED: u32 = 0;
/// [`segment_accepted`]: deliver as it is.
const SEGMENT_VERIFIED: u32 = 1;
/// [`segment_accepted`]: deliver with the checksum in the low 16 bits (native order) written
/// into the segment's checksum field, TCP's if [`SEGMENT_TCP`] is set, else UDP's.
const SEGMENT_COMPLETE: u32 = 1 << 16;
const SEGMENT_TCP: u32 = 1 << 17;

/// Whether `seg` is a TCP or UDP segment the pod's stack accepts: whole headers, a UDP length
/// that matches, a checksum that verifies (or a zero UDP checksum over IPv4), and no backend's
/// source port ([`SEGMENT_VERIFIED`], else [`SEGMENT_REFUSED`]). A segment whose checksum field
/// holds the pseudo-header's sum is one its sender left to checksum offload (a veth underlay
/// carries such segments as they were sent): the stack would trust it from the skb's offload
/// state, which an XDP frame cannot carry, so its checksum is completed here
/// ([`SEGMENT_COMPLETE`]). Any other checksum that does not verify goes up to the stack, which
/// drops it. One's-complement sums do not depend on byte order: the words are added as the
/// CPU reads them, and a correct sum folds to all ones either way.
#[inline(never)]
fn segment_accepted<const L4: usize>(
    ctx: &XdpContext,
    len: usize,
    protocol: u32,
    pseudo: u64,
) -> u32 {
    let seg = Segment::<L4> {
        len,
        protocol: protocol as u8,
        pseudo,
    };
    let (start, end) = (ctx.data(), ctx.data_end());
    let packet = Packet::new(start, end, end - start);
    if seg.len > XDP_DELIVER_MAX_L4 {
        return SEGMENT_REFUSED;
    }
    let Some(head) = packet.header::<[u8; 8]>(L4) else {
        return SEGMENT_REFUSED;
    };
    // SAFETY: bounds-checked by header().
    let head = unsafe { *head };
    if lookup::backend_port([head[0], head[1]]) {
        return SEGMENT_REFUSED;
    }
    if seg.protocol == IPPROTO_UDP {
        if u16::from_be_bytes([head[4], head[5]]) as usize != seg.len {
            return SEGMENT_REFUSED;
        }
        if head[6] == 0 && head[7] == 0 {
            // No checksum: accepted over IPv4, refused over IPv6 (the stack drops it).
            return if L4 == ETH_LEN + 20 {
                SEGMENT_VERIFIED
            } else {
                SEGMENT_REFUSED
            };
        }
    } else if seg.len < 20 || tcp_carries_data::<L4>(&packet, seg.len) {
        return SEGMENT_REFUSED;
    }
    // Copied out in one helper call and summed in one more: the segment's length varies, and
    // a loop reading the packet itself costs a bounds check a word.
    let len = seg.len;
    if len == 0 || len > XDP_DELIVER_MAX_L4 {
        return SEGMENT_REFUSED;
    }
    let Some(buf) = SEGMENT_SCRATCH.get_ptr_mut(0) else {
        return SEGMENT_REFUSED;
    };
    // SAFETY: this CPU's slot, used within this program run only.
    let buf = unsafe { &mut *buf };
    // SAFETY: at most `len` (checked above) bytes into a buffer of `XDP_DELIVER_MAX_L4 + 4`.
    if unsafe { bpf_xdp_load_bytes(ctx.ctx, L4 as u32, buf.as_mut_ptr().cast(), len as u32) } != 0 {
        return SEGMENT_REFUSED;
    }
    // The last one to three bytes are summed padded with zeros to a word.
    let padded = (len + 3) & !3;
    for i in 0..3 {
        let at = len + i;
        if at >= padded || at >= buf.len() {
            break;
        }
        buf[at] = 0;
    }
    if padded > XDP_DELIVER_MAX_L4 {
        return SEGMENT_REFUSED;
    }
    let mut seed = seg.pseudo;
    seed = (seed & 0xFFFF_FFFF) + (seed >> 32);
    seed = (seed & 0xFFFF_FFFF) + (seed >> 32);
    // SAFETY: `padded` bytes of the buffer, a multiple of 4 within it; nothing to diff from.
    let sum = unsafe {
        bpf_csum_diff(
            core::ptr::null_mut(),
            0,
            buf.as_mut_ptr().cast(),
            padded as u32,
            seed as u32,
        )
    };
    if sum < 0 {
        return SEGMENT_REFUSED;
    }
    if fold_sum(sum as u64) == 0xFFFF {
        return SEGMENT_VERIFIED;
    }
    let (field_at, tcp) = if seg.protocol == IPPROTO_TCP {
        (16, SEGMENT_TCP)
    } else {
        (6, 0)
    };
    // Within the copy: TCP is at least 20 bytes and UDP 8 (both checked above).
    let field = u16::from_ne_bytes([buf[field_at], buf[field_at + 1]]);
    if field != fold_sum(seg.pseudo) {
        return SEGMENT_REFUSED;
    }
    // The sum without the field's seed, complemented; UDP writes a zero result as all ones
    // (zero there means no checksum).
    let mut checksum = !fold_sum(sum as u64 + (!field) as u64);
    if checksum == 0 && tcp == 0 {
        checksum = 0xFFFF;
    }
    SEGMENT_COMPLETE | tcp | checksum as u32
}

/// A 64-bit one's-complement sum folded to 16 bits.
#[inline(always)]
fn fold_sum(mut sum: u64) -> u16 {
    for _ in 0..4 {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    sum as u16
}

/// Lowers the inner frame's TTL (IPv4, its header checksum updated as RFC 1624 does for one
/// changed word) or hop limit by one, as the stack's forwarding to the pod would.
#[inline(always)]
fn forward_hop(packet: &Packet, ipv4: bool) -> bool {
    if ipv4 {
        let Some(ip) = packet.header::<[u8; 20]>(ETH_LEN) else {
            return false;
        };
        let ip = ip as *mut [u8; 20];
        // SAFETY: bounds-checked by header(); the frame is writable in XDP.
        let ip = unsafe { &mut *ip };
        ip[8] -= 1;
        let check = u16::from_be_bytes([ip[10], ip[11]]) as u32 + 0x0100;
        let check = (check + (check >= 0xFFFF) as u32) as u16;
        [ip[10], ip[11]] = check.to_be_bytes();
    } else {
        let Some(ip) = packet.header::<[u8; 8]>(ETH_LEN) else {
            return false;
        };
        let ip = ip as *mut [u8; 8];
        // SAFETY: as above.
        unsafe { (*ip)[7] -= 1 };
    }
    true
}

/// Writes the outer source (16-byte form) into `src`; whether the outer destination is this
/// node.
#[inline(always)]
pub(crate) fn outer_addresses(
    packet: &Packet,
    parsed: &Parsed,
    config: &OverlayConfig,
    src: &mut Addr,
) -> Result<bool, DropReason> {
    let l3 = parsed.l3_offset;
    if parsed.ether_type == ETH_P_IP {
        let addrs: *const [u8; 8] = packet.header(l3 + 12).ok_or(DropReason::Ipv4Truncated)?;
        // SAFETY: bounds-checked by header().
        let a = unsafe { *addrs };
        set_ipv4_mapped(src, [a[0], a[1], a[2], a[3]]);
        Ok(config.flags & OVERLAY_HAS_IPV4 != 0 && a[4..8] == config.node_ipv4)
    } else {
        let addrs: *const [u8; 32] = packet.header(l3 + 8).ok_or(DropReason::Ipv6Truncated)?;
        // SAFETY: bounds-checked by header(); copied straight into place.
        unsafe { copy_bytes::<16>(src.as_mut_ptr(), addrs.cast()) };
        // SAFETY: as above.
        let dst = unsafe { &(&*addrs)[16..32] };
        Ok(config.flags & OVERLAY_HAS_IPV6 != 0 && *dst == config.node_ipv6)
    }
}

/// Geneve to this node counts as its overlay traffic only in the VLAN the underlay carries
/// it in (untagged unless configured): a tag the underlay does not use is someone else's
/// network, however the packet is addressed. At tc the kernel has taken the tag out of the
/// frame into the socket buffer (`metadata_vid`).
#[inline(always)]
fn check_vlan(
    packet: &Packet,
    parsed: &Parsed,
    config: &OverlayConfig,
    metadata_vid: Option<u16>,
) -> Result<(), DropReason> {
    if parsed.l3_offset == ETH_LEN {
        let vid = metadata_vid.unwrap_or(0);
        return if vid == config.underlay_vlan {
            Ok(())
        } else {
            Err(DropReason::GeneveWrongVlan)
        };
    }
    if metadata_vid.is_some() {
        // A second tag (QinQ): never the underlay's.
        return Err(DropReason::GeneveWrongVlan);
    }
    // One tag, carrying the underlay's VLAN id; QinQ never.
    let tag: *const [u8; 2] = packet.header(ETH_LEN).ok_or(DropReason::VlanTruncated)?;
    // SAFETY: bounds-checked by header().
    let vid = u16::from_be_bytes(unsafe { *tag }) & 0x0FFF;
    if parsed.l3_offset == ETH_LEN + 4 && config.underlay_vlan != 0 && vid == config.underlay_vlan {
        Ok(())
    } else {
        Err(DropReason::GeneveWrongVlan)
    }
}

/// Applies RFC 8926's receive rules to the Geneve header at `at`; returns the options length.
#[inline(always)]
pub(crate) fn check_geneve(packet: &Packet, at: usize, vni: u32) -> Result<usize, DropReason> {
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
    // Only the default pod network's segment is delivered into it.
    if u32::from_be_bytes([0, base[4], base[5], base[6]]) != vni {
        return Err(DropReason::GeneveUnknownVni);
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

/// Whether a Geneve frame whose inner destination is no local pod is a pod's traffic this
/// node translates to an egress address (the frame's inner source is read into `key`).
#[inline(always)]
fn egress_bound(packet: &Packet, inner: usize, key: &mut Key<Addr>) -> Result<bool, DropReason> {
    if !lookup::egress_holder() {
        return Ok(false);
    }
    inner_address(packet, inner, true, &mut key.data)?;
    Ok(lookup::egress_translates_for(&key.data))
}

/// Writes the source (`source`) or destination address of the inner frame at `at` (Ethernet,
/// then IPv4 or IPv6) into `dst`, in the 16-byte form.
#[inline(always)]
pub(crate) fn inner_address(
    packet: &Packet,
    at: usize,
    source: bool,
    dst: &mut Addr,
) -> Result<(), DropReason> {
    let eth: *const [u8; 14] = packet.header(at).ok_or(DropReason::GeneveInnerMalformed)?;
    // SAFETY: bounds-checked by header().
    let ether_type = unsafe { u16::from_be_bytes([(*eth)[12], (*eth)[13]]) };
    let l3 = at + ETH_LEN;
    match ether_type {
        ETH_P_IP => {
            let ip: *const [u8; 20] = packet.header(l3).ok_or(DropReason::GeneveInnerMalformed)?;
            // SAFETY: bounds-checked by header().
            let ip = unsafe { &*ip };
            if ip[0] >> 4 != 4 {
                return Err(DropReason::GeneveInnerMalformed);
            }
            let a = if source { 12 } else { 16 };
            set_ipv4_mapped(dst, [ip[a], ip[a + 1], ip[a + 2], ip[a + 3]]);
            Ok(())
        }
        ETH_P_IPV6 => {
            let ip: *const [u8; 40] = packet.header(l3).ok_or(DropReason::GeneveInnerMalformed)?;
            // SAFETY: bounds-checked by header().
            let ip = unsafe { &*ip };
            if ip[0] >> 4 != 6 {
                return Err(DropReason::GeneveInnerMalformed);
            }
            let a = if source { 8 } else { 24 };
            // SAFETY: the 16 bytes lie within the checked header.
            unsafe { copy_bytes::<16>(dst.as_mut_ptr(), ip[a..].as_ptr()) };
            Ok(())
        }
        _ => Err(DropReason::GeneveInnerMalformed),
    }
}
