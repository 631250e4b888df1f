//! The service flow cache (kernel side of `FlowCacheEntry`): how `tc_from_pod` last
//! translated a flow's packet and which pod of this node it delivered it to, replayed for the
//! flow's next packets in the same clock second. A hit costs one per-CPU array read (inlined
//! by the verifier) where the full path pays the conntrack lookup, the pod lookup and two
//! function calls; on this machine every call's return is a measurable share of a packet.
//! IPv4 without options, the common case, is tried before the full parse (the parser's IPv4
//! branch checks it) and replayed from the packet's own fields (word compares and in-place
//! writes, no key assembled, no division for the clock, no BPF call); IPv6 after the parse,
//! through the working set, as the full path does.
//!
//! What keeps a replay equal to what the full path would do:
//! - an entry is used only within the clock second it was filled in, so each flow's first
//!   packet of every second takes the full path, which refreshes the conntrack and affinity
//!   timers (the full path too refreshes them at most once a second) and sees any change of
//!   the flow's tracked state;
//! - TCP segments that open or end a connection (SYN, FIN, RST) always take the full path,
//!   which tracks them;
//! - a flow to a service is replayed only while its backend is live (the same check as the
//!   full path's, an inlined array read);
//! - an entry filled under another `pods_epoch` is stale: the agent moves the epoch on every
//!   change of the local pods, so a recreated pod is never reached through its old veth;
//! - only single rewrites are cached: no masquerade (hairpin), nothing from outside the node.

use aya_ebpf::{bindings::__sk_buff, programs::TcContext};
use dataplane_common::{
    DropReason, PacketClass,
    lb::{CT_ORIGINAL, CtKey, FlowCacheEntry, flow_cache_slot, flow_cache_slot_v4},
    overlay::LocalPod,
};

use super::{
    ETH_LEN, ETH_P_IP,
    backend::live_backend,
    conntrack::{TCP_FIN, TCP_RST, TCP_SYN, scratch},
    rewrite::{MAX_DIRECT_L4, Side, follow_transport_checksum, translate},
};
use crate::lookup;
use crate::{
    clock::clock,
    copy::{copy_addr, copy_bytes},
    csum::{csum_diff, updated},
    maps::LB_FLOW_CACHE,
    overlay,
    parse::{IPPROTO_TCP, IPPROTO_UDP, read, read_addresses},
    port,
    work::{LbScratch, Parsed},
};

/// Translates and delivers a TCP or UDP packet as the cache says, if it holds a valid entry
/// for the packet's flow: `Ok(Some((verdict, translation)))`. `Ok(None)`: not cached (the
/// packet is untouched). An error: the packet was partly rewritten and must be dropped.
#[inline(always)]
pub fn replay(ctx: &TcContext, parsed: &Parsed) -> Result<Option<(i32, PacketClass)>, DropReason> {
    // Fragments take the full path, which remembers a first fragment's ports.
    if parsed.l3_offset != ETH_LEN || parsed.l4_offset == 0 || parsed.fragment != 0 {
        return Ok(None);
    }
    // Tried before parsing ([`replay_plain_v4`]); what it missed, this would miss too but for
    // headers outside the linear data, which the full path pulls in and handles alike.
    if parsed.ether_type == ETH_P_IP && parsed.l4_offset == V4_L4 {
        return Ok(None);
    }
    let flow = flow_ports(parsed);
    let ipv4 = (parsed.ether_type == ETH_P_IP) as u32;
    let done = lb_flow_cache_replay(
        ctx.skb.skb,
        parsed.l4_offset as u32,
        parsed.protocol as u32 | ipv4 << 8,
        flow,
    );
    match done {
        MISS => Ok(None),
        FAILED => Err(DropReason::LbRewriteFailed),
        _ => {
            let side = if done & 1 == 0 {
                Side::Destination
            } else {
                Side::Source
            };
            Ok(Some(((done >> 1) as i32, side.translation())))
        }
    }
}

/// [`lb_flow_cache_replay`]: the flow is not cached (the packet is untouched).
const MISS: i64 = -1;
/// [`lb_flow_cache_replay`]: the kernel refused a rewrite (the packet must be dropped).
const FAILED: i64 = -2;

/// [`replay`] as a global BPF function, verified once on its own: inlined, its rewrite and
/// checks multiplied the states of `tc_from_pod` past the verifier's limit. Returns
/// `verdict << 1 | reverse` (0: destination rewritten, 1: source), [`MISS`] or [`FAILED`].
/// `protocol` carries `ipv4 << 8`; `ports` the source and destination ports as on the wire.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn lb_flow_cache_replay(
    skb: *mut __sk_buff,
    l4: u32,
    protocol: u32,
    ports: u32,
) -> i64 {
    let ctx = TcContext::new(skb);
    match replay_flow(&ctx, l4 as usize, protocol, ports) {
        Ok(Some((verdict, side))) => (verdict as i64) << 1 | (side == Side::Source) as i64,
        Ok(None) => MISS,
        Err(_) => FAILED,
    }
}

#[inline(always)]
fn replay_flow(
    ctx: &TcContext,
    l4: usize,
    protocol: u32,
    ports: u32,
) -> Result<Option<(i32, Side)>, DropReason> {
    let ipv4 = protocol >> 8 != 0;
    let protocol = protocol as u8;
    if protocol == IPPROTO_TCP && opens_or_closes(ctx, l4) {
        return Ok(None);
    }
    let Some(config) = lookup::overlay_config() else {
        return Ok(None);
    };
    let Some(s) = scratch() else {
        return Ok(None);
    };
    if !read_addresses(ctx, ipv4, &mut s.flow.src, &mut s.flow.dst) {
        return Ok(None);
    }
    let ports = ports.to_ne_bytes();
    s.flow.src_port_be = [ports[0], ports[1]];
    s.flow.dst_port_be = [ports[2], ports[3]];
    s.flow.protocol = protocol;
    s.flow.direction = 0;
    s.flow._pad = [0; 2];
    let Some(entry) = LB_FLOW_CACHE.get(flow_cache_slot(&s.flow)) else {
        return Ok(None);
    };
    if !same_flow(&entry.flow, &s.flow) || !current(entry) {
        return Ok(None);
    }
    if entry.epoch != config.pods_epoch {
        return Ok(None);
    }
    let side = if entry.direction == CT_ORIGINAL {
        if live_backend(entry.backend_id).is_none() {
            return Ok(None);
        }
        copy_addr(&mut s.old_addr, &s.flow.dst);
        s.old_port = s.flow.dst_port_be;
        Side::Destination
    } else {
        copy_addr(&mut s.old_addr, &s.flow.src);
        s.old_port = s.flow.src_port_be;
        Side::Source
    };
    copy_addr(&mut s.new_addr, &entry.addr);
    s.new_port = entry.port_be;
    s.ipv4 = ipv4 as u8;
    let pod = entry.pod;
    translate(ctx, l4, protocol, s, side)?;
    Ok(Some((overlay::to_local_pod(ctx, &pod), side)))
}

/// Drops this CPU's cached translation of the reply flow `s.flow` (its tuple as it leaves
/// the backend), if it holds one: a new connection on that tuple must take the full path.
/// (Another CPU's entry lasts at most to the end of its clock second.)
#[inline(always)]
pub fn forget_reply(s: &mut LbScratch) {
    let direction = s.flow.direction;
    s.flow.direction = 0;
    if let Some(entry) = LB_FLOW_CACHE.get_ptr_mut(flow_cache_slot(&s.flow)) {
        // SAFETY: this CPU's own slot of a per-CPU array.
        unsafe {
            if same_flow(&(*entry).flow, &s.flow) {
                (*entry).until = 0;
            }
        }
    }
    s.flow.direction = direction;
}

/// A replayed packet's verdict and translation, or the reason to drop it (partly rewritten).
pub type Replayed = Result<(i32, PacketClass), DropReason>;

/// [`replay`] for an untagged IPv4 TCP or UDP packet without options (`parsed` by the
/// parser's IPv4 branch alone), tried before anything else: [`replay_v4`] is inlined into the
/// caller, so a hit costs no BPF-to-BPF call (whose return, under the SRSO mitigation, costs
/// tens of nanoseconds here). `None`: anything else, or not cached (the packet is untouched,
/// for the full path). `Some(done)`: the verdict with the translation, or the reason to drop
/// a packet partly rewritten.
#[inline(always)]
pub fn replay_plain_v4(ctx: &TcContext, parsed: &Parsed) -> Option<Replayed> {
    if parsed.ether_type != ETH_P_IP
        || parsed.l4_offset != V4_L4
        || parsed.fragment != 0
        || !matches!(parsed.protocol, IPPROTO_TCP | IPPROTO_UDP)
    {
        return None;
    }
    match replay_v4(ctx, parsed.protocol, flow_ports(parsed)) {
        Ok(None) => None,
        Ok(Some((verdict, side))) => Some(Ok((verdict, side.translation()))),
        Err(reason) => Some(Err(reason)),
    }
}

/// The source and destination ports as parsed, in one word as on the wire.
#[inline(always)]
fn flow_ports(parsed: &Parsed) -> u32 {
    u32::from_ne_bytes([
        parsed.src_port[0],
        parsed.src_port[1],
        parsed.dst_port[0],
        parsed.dst_port[1],
    ])
}

/// Where the fields of an IPv4 header without options lie in an untagged frame.
const V4_CHECK: usize = ETH_LEN + 10;
const V4_SRC: usize = ETH_LEN + 12;
const V4_DST: usize = ETH_LEN + 16;
const V4_L4: usize = ETH_LEN + 20;

/// [`replay_flow`] for IPv4 without options, the common case, cut to what it needs: the flow
/// compared word by word with the packet's fields (no key assembled in the working set), the
/// address, its header checksum and the port written in place. What it decides is the same.
/// Called by [`replay_plain_v4`], before the full parse.
#[inline(always)]
fn replay_v4(ctx: &TcContext, protocol: u8, ports: u32) -> Result<Option<(i32, Side)>, DropReason> {
    if protocol == IPPROTO_TCP && opens_or_closes(ctx, V4_L4) {
        return Ok(None);
    }
    // The ports too must be directly writable.
    if ctx.data() + V4_L4 + 4 > ctx.data_end() {
        return Ok(None);
    }
    let Some(addresses) = read::<[u8; 8]>(ctx, V4_SRC) else {
        return Ok(None);
    };
    let [a, b, c, d, e, f, g, h] = addresses;
    let (src, dst) = ([a, b, c, d], [e, f, g, h]);
    let Some(entry) = LB_FLOW_CACHE.get(flow_cache_slot_v4(src, dst, ports, protocol)) else {
        return Ok(None);
    };
    if !same_v4_flow(&entry.flow, src, dst, ports, protocol) || !current(entry) {
        return Ok(None);
    }
    if !same_sender(ctx, entry) {
        return Ok(None);
    }
    let Some(config) = lookup::overlay_config() else {
        return Ok(None);
    };
    if entry.epoch != config.pods_epoch {
        return Ok(None);
    }
    // The backend check first: its lookup would have the values read below spilled.
    let original = entry.direction == CT_ORIGINAL;
    if original && live_backend(entry.backend_id).is_none() {
        return Ok(None);
    }
    let ports = ports.to_ne_bytes();
    let a = &entry.addr;
    let new = [a[12], a[13], a[14], a[15]];
    let new_port = entry.port_be;
    let (side, old, old_port) = if original {
        (Side::Destination, dst, [ports[2], ports[3]])
    } else {
        (Side::Source, src, [ports[0], ports[1]])
    };
    // Read from the entry at delivery (this CPU's slot, written only by this CPU's runs):
    // a copy would take stack the caller's frame has no room for.
    let pod = &entry.pod;
    let diff = csum_diff(&old, &new, 0, 0);
    rewrite_v4(
        ctx,
        side,
        new,
        diff,
        (old_port != new_port).then_some(new_port),
    )?;
    follow_transport_checksum(ctx, V4_L4, protocol, diff, old_port, new_port)?;
    Ok(Some((overlay::to_local_pod(ctx, pod), side)))
}

/// Whether `key` (direction 0) is the IPv4 flow of these packet fields, compared as words.
#[inline(always)]
fn same_v4_flow(key: &CtKey, src: [u8; 4], dst: [u8; 4], ports: u32, protocol: u8) -> bool {
    // The third word of an IPv4-mapped address; the first two are zero.
    const MAPPED: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);
    let expected = [
        0,
        0,
        MAPPED,
        u32::from_ne_bytes(src),
        0,
        0,
        MAPPED,
        u32::from_ne_bytes(dst),
        ports,
        // Protocol, direction 0 and the zero padding.
        u32::from_ne_bytes([protocol, 0, 0, 0]),
    ];
    let words = (key as *const CtKey).cast::<u32>();
    let mut differ = 0;
    let mut i = 0;
    while i < expected.len() {
        // SAFETY: `CtKey` is ten words, 4-aligned.
        differ |= unsafe { *words.add(i) } ^ expected[i];
        i += 1;
    }
    differ == 0
}

/// Writes the IPv4 address `new` over the `side` one, the header checksum by `diff`, and the
/// port when it changes (`new_port`).
#[inline(always)]
fn rewrite_v4(
    ctx: &TcContext,
    side: Side,
    new: [u8; 4],
    diff: u32,
    new_port: Option<[u8; 2]>,
) -> Result<(), DropReason> {
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + V4_L4 + 4 > end {
        return Err(DropReason::LbRewriteFailed);
    }
    let (at, port_at) = match side {
        Side::Destination => (V4_DST, V4_L4 + 2),
        Side::Source => (V4_SRC, V4_L4),
    };
    // SAFETY: all within the IPv4 header and the ports, bounds-checked just above.
    unsafe {
        core::ptr::write_unaligned((start + at) as *mut [u8; 4], new);
        let check = (start + V4_CHECK) as *mut [u8; 2];
        core::ptr::write_unaligned(check, updated(core::ptr::read_unaligned(check), diff));
        if let Some(port) = new_port {
            core::ptr::write_unaligned((start + port_at) as *mut [u8; 2], port);
        }
    }
    Ok(())
}

/// Caches the translation the load-balancer just applied to this packet (its working set
/// still holds it) with the pod the packet is delivered to, found in `LOCAL_PODS` under
/// `epoch`. Only when the load-balancer translated this very packet (`ServiceDnat` or
/// `ServiceReverseNat`): the working set's flag is from the last translation on this CPU.
#[inline(always)]
pub fn remember(ctx: &TcContext, epoch: u32, pod: &LocalPod) {
    let Some(s) = scratch() else {
        return;
    };
    if s.cacheable == 0 {
        return;
    }
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + 12 > end {
        return;
    }
    let direction = s.flow.direction;
    s.flow.direction = 0;
    let Some(entry) = LB_FLOW_CACHE.get_ptr_mut(flow_cache_slot(&s.flow)) else {
        return;
    };
    // SAFETY: this CPU's slot of a per-CPU map, used by one program run at a time.
    let entry = unsafe { &mut *entry };
    // SAFETY: both are whole `CtKey`s.
    unsafe {
        copy_bytes::<{ core::mem::size_of::<CtKey>() }>(
            (&mut entry.flow as *mut CtKey).cast(),
            (&s.flow as *const CtKey).cast(),
        )
    };
    copy_addr(&mut entry.addr, &s.new_addr);
    entry.port_be = s.new_port;
    entry.direction = direction;
    entry.backend_id = s.backend_id;
    let (ticks, per_second) = clock();
    entry.until = (ticks / per_second + 1) * per_second;
    entry.epoch = epoch;
    entry.pod.ifindex = pod.ifindex;
    // SAFETY: 6-byte MAC addresses on both sides.
    unsafe {
        copy_bytes::<6>(entry.pod.pod_mac.as_mut_ptr(), pod.pod_mac.as_ptr());
        copy_bytes::<6>(entry.pod.host_mac.as_mut_ptr(), pod.host_mac.as_ptr());
    }
    // SAFETY: reading a field of our own context.
    entry.from_ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: the source MAC lies within the packet (checked above).
    unsafe { copy_bytes::<6>(entry.from_mac.as_mut_ptr(), (start + 6) as *const u8) };
}

/// Whether the packet comes from where the entry's did: the same veth and source MAC. With
/// the flow's source address (part of the key) that is what port security checked when the
/// entry was filled, so a replayed packet is one port security would pass.
#[inline(always)]
fn same_sender(ctx: &TcContext, entry: &FlowCacheEntry) -> bool {
    // SAFETY: reading a field of our own context.
    if unsafe { (*ctx.skb.skb).ifindex } != entry.from_ifindex {
        return false;
    }
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + 12 > end {
        return false;
    }
    // SAFETY: the source MAC lies within the packet (checked above); both sides at even
    // offsets.
    unsafe { port::same_mac((start + 6) as *const u8, &entry.from_mac) }
}

/// Whether the entry was filled in the clock's current second: a comparison, where the
/// second itself would cost a division on every packet.
#[inline(always)]
fn current(entry: &FlowCacheEntry) -> bool {
    clock().0 < entry.until
}

/// Whether a TCP segment opens or ends a connection (or its flags are not directly
/// readable): such segments take the full path, which tracks them.
#[inline(always)]
fn opens_or_closes(ctx: &TcContext, l4: usize) -> bool {
    if l4 > MAX_DIRECT_L4 {
        return true;
    }
    // Read back opaquely, as in `write_headers`: the mask is what bounds the pointer for the
    // verifier, and LLVM would drop it knowing `l4 <= MAX_DIRECT_L4`.
    // SAFETY: a volatile read of a local.
    let at = ctx.data() + (unsafe { core::ptr::read_volatile(&l4) } & MAX_DIRECT_L4) + 13;
    if at + 1 > ctx.data_end() {
        return true;
    }
    // SAFETY: the byte was bounds-checked just above.
    let flags = unsafe { *(at as *const u8) };
    flags & (TCP_SYN | TCP_FIN | TCP_RST) != 0
}

/// Whether two flow keys are equal, compared as ten words (`CtKey` is 4-aligned).
#[inline(always)]
pub(super) fn same_flow(a: &CtKey, b: &CtKey) -> bool {
    let (a, b) = (
        (a as *const CtKey).cast::<u32>(),
        (b as *const CtKey).cast::<u32>(),
    );
    let mut differ = 0;
    let mut i = 0;
    while i < core::mem::size_of::<CtKey>() / 4 {
        // SAFETY: in bounds of both keys, 4-aligned.
        differ |= unsafe { *a.add(i) ^ *b.add(i) };
        i += 1;
    }
    differ == 0
}
