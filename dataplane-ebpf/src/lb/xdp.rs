//! The NodePort fast path in XDP: packets of established flows to a NodePort, external or
//! load-balancer address are translated before the kernel allocates a socket buffer for them.
//!
//! Only what the conntrack already decided is done here: a flow's first packet (the backend
//! choice, the affinity entry, the masquerade port claim, the client's answer when there is no
//! backend) and anything unusual (VLAN tags, SCTP, a packet over the pod MTU, a next hop not
//! resolved yet) pass up untouched to `tc_underlay`, which handles every packet completely.
//! So this path can only ever take a shortcut that tc would have taken too:
//! - a backend on this node: the packet is translated and passed up; the stack routes it to
//!   the pod's veth, whose tc program applies the pod's ingress policy;
//! - a backend on another node: translated (masqueraded to this node's address, as tc did for
//!   the flow's first packet), wrapped in Geneve and sent back out of the NIC (XDP_TX) or
//!   redirected to the underlay device the route names. Allowed by `OVERLAY_XDP_FORWARD`.
//!
//! Checksums are updated incrementally (RFC 1624) from the one's-complement difference of the
//! changed words: XDP has no checksum helpers, and the payload is never read.

use aya_ebpf::{
    bindings::{xdp_action, xdp_md},
    helpers::{bpf_redirect, bpf_xdp_adjust_head},
    programs::XdpContext,
};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    lb::{
        CT_AFFINITY, CT_CLOSING, CT_ORIGINAL, CT_SNAT, CtKey, SERVICE_PORTS_BASE,
        XdpFlowCacheEntry, flow_cache_slot, flow_hash,
    },
    overlay::{
        ENCAP_OVERHEAD_V4, ENCAP_OVERHEAD_V6, FAMILY_IPV6, OVERLAY_HAS_IPV4, OVERLAY_HAS_IPV6,
        OVERLAY_XDP_FORWARD, OverlayConfig, RouteCacheEntry, TunnelEndpoint, encap_overhead,
    },
};

use super::{
    ETH_LEN, ETH_P_IP, IPPROTO_TCP, IPPROTO_UDP,
    backend::{live_backend, refresh_affinity},
    cache::same_flow,
    conntrack::{TCP_FIN, TCP_RST, TCP_SYN, expired, scratch, touch},
    outside_scope,
};
use crate::lookup;
use crate::{
    clock::{clock, now},
    copy::{copy_addr, copy_bytes, set_ipv4_mapped},
    csum::{addr_diff, csum_diff, updated},
    maps::{LB_CT, LB_XDP_FLOW_CACHE, LOCAL_PODS, ROUTE_CACHE, SCRATCH},
    overlay::{self, write_geneve_after_v4, write_geneve_v6, write_outer_v4},
    stage::Stage,
    stats::count_outcome,
    work::{LbScratch, Parsed},
};

/// Transport headers further in than this (deep IPv6 extension chains) are left to tc; the
/// bound also lets the verifier follow the variable offset.
const MAX_L4_OFFSET: usize = 128;
const UDP_HEADER: usize = 8;
const TCP_HEADER: usize = 20;

/// Translates and delivers a NodePort packet of a tracked flow. Nothing done (`Ok(None)`):
/// pass it up untouched. A value: the XDP action, with `ServiceDnat` (passed up to the local
/// backend) or `GeneveEncap` (sent to a remote backend). A drop only after the packet was
/// already changed and could not be finished.
#[inline(never)]
pub fn nodeport(ctx: &XdpContext, parsed: &Parsed) -> Stage {
    Stage::new(forward(ctx, parsed))
}

#[inline(always)]
fn forward(ctx: &XdpContext, parsed: &Parsed) -> Result<Option<(u32, PacketClass)>, DropReason> {
    let l4 = parsed.l4_offset;
    // Fragments are tc's: it remembers a first fragment's ports for the later ones.
    if parsed.l3_offset != ETH_LEN || l4 == 0 || l4 > MAX_L4_OFFSET || parsed.fragment != 0 {
        return Ok(None);
    }
    if !matches!(parsed.protocol, IPPROTO_TCP | IPPROTO_UDP) {
        return Ok(None);
    }
    let Some(config) = lookup::overlay_config() else {
        return Ok(None);
    };
    let Some(s) = scratch() else {
        return Ok(None);
    };
    let ipv4 = parsed.ether_type == ETH_P_IP;
    if !read_flow(ctx, parsed, ipv4, s) {
        return Ok(None);
    }
    if !lookup::port_marked(SERVICE_PORTS_BASE, s.flow.dst_port_be) {
        return Ok(None);
    }
    // Sets `s.node_addr`, the masquerade source towards remote backends.
    outside_scope(config, s);
    s.flow.direction = CT_ORIGINAL;
    // Segments that open or end a connection take the full path, which tracks them.
    let cacheable = s.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) == 0;
    let frame_len = ctx.data_end() - ctx.data();
    let hit = if cacheable {
        cached_remote(config, frame_len, s)
    } else {
        None
    };
    let replayed = hit.is_some();
    let entry = match hit {
        Some(entry) => entry,
        None => match tracked(ctx, parsed, config, s)? {
            Tracked::Pass => return Ok(None),
            Tracked::Local => {
                translate(ctx, 0, l4, ipv4, s)?;
                return Ok(Some((xdp_action::XDP_PASS, PacketClass::ServiceDnat)));
            }
            Tracked::Remote(endpoint, route, backend_id) => {
                // Sent from the cache slot either way (a cacheable flow's entry is kept).
                let Some(entry) = remember(endpoint, route, backend_id, cacheable, config, s)
                else {
                    return Ok(None);
                };
                entry
            }
        },
    };
    // Within bounds: `l4 <= MAX_L4_OFFSET`, and an XDP frame is shorter than 64 KiB.
    let shape = (frame_len as u32) << 16 | (ipv4 as u32) << 8 | l4 as u32;
    let sent = lb_xdp_nodeport_send(ctx.ctx, s, entry, shape);
    if sent == SEND_UNTOUCHED {
        // Untouched still: tc does it all.
        return Ok(None);
    }
    if sent < 0 {
        let code = (SEND_UNTOUCHED - 1 - sent) as u32;
        return Err(DropReason::from_code(code).unwrap_or(DropReason::OverlayEncapFailed));
    }
    if replayed {
        count_outcome(Hook::Underlay, PacketClass::ServiceFlowCached);
    }
    Ok(Some((sent as u32, PacketClass::GeneveEncap)))
}

/// [`lb_xdp_nodeport_send`]: the frame could not be made room for and is untouched. Below it,
/// `SEND_UNTOUCHED - 1 - reason` for a frame changed and not finished.
const SEND_UNTOUCHED: i64 = -1;

/// The end of a NodePort packet's way to a remote backend, for both the cached and the full
/// path: room made in front of the frame, the translation in the working set written (`s`),
/// wrapped in Geneve to the cache entry's node and route (`entry`), sent. A global BPF
/// function, verified once on its own rather than once after each of the two paths (whose
/// states differ too much to be merged). `shape`: the frame's length `<< 16 | ipv4 << 8 |` its
/// transport offset (BPF functions take five arguments at most). Returns the XDP action, or
/// [`SEND_UNTOUCHED`] and what lies below it.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn lb_xdp_nodeport_send(
    xdp: *mut xdp_md,
    s: *mut LbScratch,
    entry: *const XdpFlowCacheEntry,
    shape: u32,
) -> i64 {
    if s.is_null() || entry.is_null() {
        return SEND_UNTOUCHED;
    }
    let ctx = XdpContext::new(xdp);
    // SAFETY: the caller's per-CPU working set and cache slot (checked non-null above).
    let (s, entry) = unsafe { (&mut *s, &*entry) };
    let Some(config) = lookup::overlay_config() else {
        return SEND_UNTOUCHED;
    };
    let (frame_len, ipv4, l4) = (shape >> 16, (shape >> 8) & 1 != 0, shape & 0xFF);
    match send(
        &ctx,
        config,
        entry,
        l4 as usize,
        ipv4,
        frame_len as usize,
        s,
    ) {
        Ok(Some(action)) => action as i64,
        Ok(None) => SEND_UNTOUCHED,
        Err(reason) => SEND_UNTOUCHED - 1 - reason as i64,
    }
}

#[inline(always)]
fn send(
    ctx: &XdpContext,
    config: &OverlayConfig,
    entry: &XdpFlowCacheEntry,
    l4: usize,
    ipv4: bool,
    frame_len: usize,
    s: &mut LbScratch,
) -> Result<Option<u32>, DropReason> {
    let overhead = encap_overhead(entry.endpoint.family) as usize;
    // SAFETY: plain helper call; the headroom XDP keeps in front of every frame is 256 bytes.
    if unsafe { bpf_xdp_adjust_head(ctx.ctx, -(overhead as i32)) } != 0 {
        return Ok(None);
    }
    translate(ctx, overhead, l4, ipv4, s).map_err(|_| DropReason::OverlayEncapFailed)?;
    encapsulate(ctx, config, &entry.endpoint, &entry.route, frame_len, s).map(Some)
}

/// What the conntrack says of a NodePort packet (the translation is in the working set).
enum Tracked {
    /// Not this path's (untracked, expired, reopened, backend gone, no route yet): pass up.
    Pass,
    /// To a backend on this node.
    Local,
    /// To a backend on another node: its tunnel endpoint, this CPU's route to it, its id.
    Remote(&'static TunnelEndpoint, &'static RouteCacheEntry, u32),
}

/// The full path: the flow's conntrack entry (refreshed: this packet is the path's from now
/// on unless it passes), its backend and where that backend lives.
#[inline(always)]
fn tracked(
    ctx: &XdpContext,
    parsed: &Parsed,
    config: &OverlayConfig,
    s: &mut LbScratch,
) -> Result<Tracked, DropReason> {
    let Some(entry) = LB_CT.get_ptr_mut(&s.flow) else {
        return Ok(Tracked::Pass);
    };
    // SAFETY: a valid map value pointer for this program run.
    let entry = unsafe { &mut *entry };
    let now = now();
    let reopened = s.tcp_flags & TCP_SYN != 0 && entry.flags & CT_CLOSING != 0;
    if expired(entry, s.flow.protocol, now) || reopened {
        return Ok(Tracked::Pass);
    }
    // A backend that went away: tc resets TCP and re-picks for the others.
    if live_backend(entry.backend_id).is_none() {
        return Ok(Tracked::Pass);
    }
    copy_addr(&mut s.new_addr, &entry.addr);
    s.new_port = entry.port_be;
    let snat = entry.flags & CT_SNAT != 0;
    copy_addr(
        &mut s.snat_addr,
        if snat { &entry.nat_addr } else { &s.flow.src },
    );
    s.snat_port = if snat {
        entry.nat_port_be
    } else {
        s.flow.src_port_be
    };
    // SAFETY: only presence is checked.
    let local = unsafe { LOCAL_PODS.get(&s.new_addr) }.is_some();
    let remote = if local {
        None
    } else {
        match remote_route(ctx, parsed, config, s) {
            Some(remote) => Some(remote),
            None => return Ok(Tracked::Pass),
        }
    };
    // Decided: from here on the packet is this path's.
    touch(entry, s.tcp_flags, now);
    if entry.flags & CT_AFFINITY != 0 {
        refresh_affinity(s, entry.service_id, entry.backend_id, now);
    }
    Ok(match remote {
        Some((endpoint, route)) => Tracked::Remote(endpoint, route, entry.backend_id),
        None => Tracked::Local,
    })
}

/// This CPU's NodePort flow cache entry for the flow in `s.flow` (its tunnel endpoint and
/// route), with its translation put in the working set, when the cache holds it for now:
/// filled in this clock second under the current local pods and nodes, forwarding in XDP
/// still allowed, its backend live, and this frame within the pod MTU and the length the
/// route was checked for (as [`remote_route`] requires).
#[inline(always)]
fn cached_remote(
    config: &OverlayConfig,
    frame_len: usize,
    s: &mut LbScratch,
) -> Option<&'static XdpFlowCacheEntry> {
    // Forwarding in XDP turned off: at once, not at the end of the second.
    if config.flags & OVERLAY_XDP_FORWARD == 0 {
        return None;
    }
    let entry = LB_XDP_FLOW_CACHE.get(flow_cache_slot(&s.flow))?;
    if !same_flow(&entry.flow, &s.flow)
        || clock().0 >= entry.until
        || entry.epoch != config.pods_epoch
    {
        return None;
    }
    let overhead = encap_overhead(entry.endpoint.family) as usize;
    let inner = frame_len.checked_sub(ETH_LEN)?;
    if inner > config.pod_mtu as usize || inner + overhead > entry.route.fits_len as usize {
        return None;
    }
    live_backend(entry.backend_id)?;
    copy_addr(&mut s.new_addr, &entry.new_addr);
    copy_addr(&mut s.snat_addr, &entry.snat_addr);
    s.new_port = entry.new_port;
    s.snat_port = entry.snat_port;
    Some(entry)
}

/// Writes the full path's decision for the flow in `s.flow` (its translation in the working
/// set) into its slot of this CPU's NodePort flow cache, and returns the slot: valid until the
/// end of this clock second or of the route's validity, whichever comes first, if `cacheable`;
/// otherwise only this packet's (never replayed).
#[inline(always)]
fn remember(
    endpoint: &TunnelEndpoint,
    route: &RouteCacheEntry,
    backend_id: u32,
    cacheable: bool,
    config: &OverlayConfig,
    s: &LbScratch,
) -> Option<&'static XdpFlowCacheEntry> {
    let entry = LB_XDP_FLOW_CACHE.get_ptr_mut(flow_cache_slot(&s.flow))?;
    // SAFETY: this CPU's slot of a per-CPU map, used by one program run at a time.
    let entry = unsafe { &mut *entry };
    // SAFETY: whole values of the same types on both sides.
    unsafe {
        copy_bytes::<{ core::mem::size_of::<CtKey>() }>(
            (&mut entry.flow as *mut CtKey).cast(),
            (&s.flow as *const CtKey).cast(),
        );
        copy_bytes::<{ core::mem::size_of::<TunnelEndpoint>() }>(
            (&mut entry.endpoint as *mut TunnelEndpoint).cast(),
            (endpoint as *const TunnelEndpoint).cast(),
        );
        copy_bytes::<{ core::mem::size_of::<RouteCacheEntry>() }>(
            (&mut entry.route as *mut RouteCacheEntry).cast(),
            (route as *const RouteCacheEntry).cast(),
        );
    }
    copy_addr(&mut entry.new_addr, &s.new_addr);
    copy_addr(&mut entry.snat_addr, &s.snat_addr);
    entry.new_port = s.new_port;
    entry.snat_port = s.snat_port;
    entry.backend_id = backend_id;
    entry.epoch = config.pods_epoch;
    entry.until = if cacheable {
        let (ticks, per_second) = clock();
        ((ticks / per_second + 1) * per_second).min(route.until)
    } else {
        0
    };
    Some(entry)
}

/// Reads the packet's flow into `s.flow` (direction unset) straight from the packet.
#[inline(always)]
fn read_flow(ctx: &XdpContext, parsed: &Parsed, ipv4: bool, s: &mut LbScratch) -> bool {
    let (start, end) = (ctx.data(), ctx.data_end());
    if ipv4 {
        if start + ETH_LEN + 20 > end {
            return false;
        }
        // SAFETY: within the 20 bytes checked above.
        let a = unsafe { core::ptr::read_unaligned((start + ETH_LEN + 12) as *const [u8; 8]) };
        set_ipv4_mapped(&mut s.flow.src, [a[0], a[1], a[2], a[3]]);
        set_ipv4_mapped(&mut s.flow.dst, [a[4], a[5], a[6], a[7]]);
    } else {
        if start + ETH_LEN + 40 > end {
            return false;
        }
        // SAFETY: within the 40 bytes checked above.
        unsafe {
            copy_bytes::<16>(s.flow.src.as_mut_ptr(), (start + ETH_LEN + 8) as *const u8);
            copy_bytes::<16>(s.flow.dst.as_mut_ptr(), (start + ETH_LEN + 24) as *const u8);
        }
    }
    s.tcp_flags = 0;
    if parsed.protocol == IPPROTO_TCP {
        let at = start + (parsed.l4_offset & 0xFF) + 13;
        if at + 1 > end {
            return false;
        }
        // SAFETY: the byte was bounds-checked just above.
        s.tcp_flags = unsafe { *(at as *const u8) };
    }
    s.flow.src_port_be = parsed.src_port;
    s.flow.dst_port_be = parsed.dst_port;
    s.flow.protocol = parsed.protocol;
    s.flow._pad = [0; 2];
    s.ipv4 = ipv4 as u8;
    s.snat = 0;
    s.nodeport = 1;
    true
}

/// The tunnel endpoint of a remote backend when this path may send to it now, with this
/// CPU's copy of the route to its node (`ROUTE_CACHE`, as tc's encapsulation keeps it: one
/// FIB lookup a second rather than one a packet): forwarding allowed, the packet within the
/// pod MTU, and the route resolved down to its next hop's MAC. Otherwise `None`, and tc takes
/// the packet.
#[inline(always)]
fn remote_route(
    ctx: &XdpContext,
    parsed: &Parsed,
    config: &OverlayConfig,
    s: &LbScratch,
) -> Option<(&'static TunnelEndpoint, &'static RouteCacheEntry)> {
    if config.flags & OVERLAY_XDP_FORWARD == 0 {
        return None;
    }
    let endpoint = lookup::remote_endpoint(parsed.ether_type, &s.new_addr)?;
    let has_source = if endpoint.family == FAMILY_IPV6 {
        config.flags & OVERLAY_HAS_IPV6 != 0
    } else {
        config.flags & OVERLAY_HAS_IPV4 != 0
    };
    if !has_source {
        return None;
    }
    let frame_len = (ctx.data_end() - ctx.data()) as u32;
    // Over the pod MTU: tc answers it (fragmentation needed / packet too big).
    if frame_len - ETH_LEN as u32 > config.pod_mtu {
        return None;
    }
    let overhead = encap_overhead(endpoint.family);
    let len = frame_len + overhead - ETH_LEN as u32;
    // No neighbour yet, a smaller route MTU, no route: tc's path knows what to do.
    let slot = overlay::tunnel_route(ctx, config, endpoint, len)
        .into_value()
        .ok()?;
    let route = ROUTE_CACHE.get(slot)?;
    (route.resolved == 1).then_some((endpoint, route))
}

/// Writes the flow's translation into the packet whose Ethernet header starts at `base`:
/// destination to the backend (`s.new_addr/new_port`), source to `s.snat_addr/snat_port`
/// (the client's own unless masqueraded), and both checksums updated for what changed.
#[inline(always)]
fn translate(
    ctx: &XdpContext,
    base: usize,
    l4: usize,
    ipv4: bool,
    s: &mut LbScratch,
) -> Result<(), DropReason> {
    let failed = DropReason::LbRewriteFailed;
    // SAFETY: all four lie 4-aligned in the working set (asserted with its layout).
    let addresses = unsafe {
        let addresses = addr_diff(&s.flow.dst, &s.new_addr, ipv4, 0);
        addr_diff(&s.flow.src, &s.snat_addr, ipv4, addresses)
    };
    let old_ports = [
        s.flow.src_port_be[0],
        s.flow.src_port_be[1],
        s.flow.dst_port_be[0],
        s.flow.dst_port_be[1],
    ];
    let new_ports = [s.snat_port[0], s.snat_port[1], s.new_port[0], s.new_port[1]];
    let transport = csum_diff(&old_ports, &new_ports, 0, addresses);

    let (start, end) = (ctx.data(), ctx.data_end());
    let ip = start + base + ETH_LEN;
    if ipv4 {
        if ip + 20 > end {
            return Err(failed);
        }
        // SAFETY: the 20-byte header was bounds-checked just above.
        unsafe {
            let src = &s.snat_addr;
            let dst = &s.new_addr;
            core::ptr::write_unaligned(
                (ip + 12) as *mut [u8; 4],
                [src[12], src[13], src[14], src[15]],
            );
            core::ptr::write_unaligned(
                (ip + 16) as *mut [u8; 4],
                [dst[12], dst[13], dst[14], dst[15]],
            );
            let check = (ip + 10) as *mut [u8; 2];
            core::ptr::write_unaligned(check, updated(core::ptr::read_unaligned(check), addresses));
        }
    } else {
        if ip + 40 > end {
            return Err(failed);
        }
        // SAFETY: the 40-byte header was bounds-checked just above.
        unsafe {
            copy_bytes::<16>((ip + 8) as *mut u8, s.snat_addr.as_ptr());
            copy_bytes::<16>((ip + 24) as *mut u8, s.new_addr.as_ptr());
        }
    }
    // One branch per protocol, each with its own constant bounds: the verifier cannot relate
    // a length chosen in one place to an offset chosen in another.
    let at = start + base + (l4 & 0xFF);
    if s.flow.protocol == IPPROTO_TCP {
        if at + TCP_HEADER > end {
            return Err(failed);
        }
        // SAFETY: the 20-byte TCP header was bounds-checked just above.
        unsafe {
            core::ptr::write_unaligned(at as *mut [u8; 4], new_ports);
            let check = (at + 16) as *mut [u8; 2];
            core::ptr::write_unaligned(check, updated(core::ptr::read_unaligned(check), transport));
        }
    } else {
        if at + UDP_HEADER > end {
            return Err(failed);
        }
        // SAFETY: the 8-byte UDP header was bounds-checked just above.
        unsafe {
            core::ptr::write_unaligned(at as *mut [u8; 4], new_ports);
            let check = (at + 6) as *mut [u8; 2];
            let before = core::ptr::read_unaligned(check);
            // An IPv4 UDP checksum of zero means none was computed: it stays so.
            if before != [0, 0] {
                let mut after = updated(before, transport);
                // In UDP zero means "no checksum": a computed zero is sent as its other form.
                if after == [0, 0] {
                    after = [0xFF, 0xFF];
                }
                core::ptr::write_unaligned(check, after);
            }
        }
    }
    Ok(())
}

/// Writes the outer Ethernet, IP, UDP and Geneve headers in the room made in front of the
/// translated frame (`frame_len` bytes) and sends it: back out of the NIC it came in by, or
/// redirected to the device the route to the backend's node leaves by.
#[inline(always)]
fn encapsulate(
    ctx: &XdpContext,
    config: &OverlayConfig,
    endpoint: &TunnelEndpoint,
    route: &RouteCacheEntry,
    frame_len: usize,
    s: &LbScratch,
) -> Result<u32, DropReason> {
    let failed = DropReason::OverlayEncapFailed;
    let block = SCRATCH.get_ptr_mut(0).ok_or(failed)?;
    // SAFETY: per-CPU map memory, used only by this program run.
    let block = unsafe { &mut *block };
    // The same flow always leaves by the same source port: ECMP and receive queues keep it
    // in order.
    let hash = flow_hash(&s.flow);
    let ipv6 = endpoint.family == FAMILY_IPV6;
    let (start, end) = (ctx.data(), ctx.data_end());
    if ipv6 {
        const LEN: usize = ENCAP_OVERHEAD_V6 as usize - ETH_LEN;
        let udp_len = (frame_len + LEN - 40) as u16;
        write_geneve_v6(
            block,
            &route.dmac,
            &route.smac,
            config,
            endpoint,
            udp_len,
            hash,
        );
        if start + ENCAP_OVERHEAD_V6 as usize > end {
            return Err(failed);
        }
        // SAFETY: the room was bounds-checked just above; the block is longer.
        unsafe {
            core::ptr::copy_nonoverlapping(
                block.as_ptr(),
                start as *mut u8,
                ENCAP_OVERHEAD_V6 as usize,
            )
        };
    } else {
        const LEN: usize = ENCAP_OVERHEAD_V4 as usize - ETH_LEN;
        let total_len = (frame_len + LEN) as u16;
        write_outer_v4(block, &route.dmac, &route.smac, config, endpoint, total_len);
        write_geneve_after_v4(block, config, total_len - 20, hash);
        if start + ENCAP_OVERHEAD_V4 as usize > end {
            return Err(failed);
        }
        // SAFETY: the room was bounds-checked just above; the block is longer.
        unsafe {
            core::ptr::copy_nonoverlapping(
                block.as_ptr(),
                start as *mut u8,
                ENCAP_OVERHEAD_V4 as usize,
            )
        };
    }
    // SAFETY: reading a field of our own context.
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    if route.ifindex == ingress {
        return Ok(xdp_action::XDP_TX);
    }
    // SAFETY: plain helper call.
    let action = unsafe { bpf_redirect(route.ifindex, 0) } as u32;
    if action != xdp_action::XDP_REDIRECT {
        return Err(DropReason::OverlayNoRoute);
    }
    Ok(action)
}
