//! The address and port rewrite of a translated packet (DNAT, reverse NAT, masquerade), with
//! the IP and transport checksums kept right, in place where the headers are linear.

use aya_ebpf::{
    bindings::{__sk_buff, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use dataplane_common::{DropReason, PacketClass, overlay::Addr};

use crate::parse::ETH_LEN;
use crate::{
    copy::{copy_addr, copy_bytes},
    csum::{addr_diff, csum_add, fold, updated},
    frag,
    maps::LB_SCRATCH,
    parse::{IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP},
    stage::Stage,
    work::{LbScratch, Parsed},
};

/// Deepest transport header the rewrite writes in place (a mask: one less than a power of two).
pub(super) const MAX_DIRECT_L4: usize = 0xFF;

/// Deepest transport checksum field read and written in place (a mask, covering TCP's at
/// `MAX_DIRECT_L4 + 16`).
const MAX_DIRECT_CHECK: usize = 0x1FF;

/// What a UDP checksum that computes to zero is sent as (zero means "no checksum").
const CSUM_MANGLED_0: u16 = 0xFFFF;

/// Which address and port a rewrite replaces. Crosses the global BPF functions as its `u32`.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(super) enum Side {
    Source = 0,
    Destination = 1,
}

impl Side {
    /// How a rewrite of this side is counted: a destination rewritten is a DNAT (towards a
    /// backend), a source rewritten a reply's reverse NAT.
    #[inline(always)]
    pub(super) fn translation(self) -> PacketClass {
        match self {
            Side::Destination => PacketClass::ServiceDnat,
            Side::Source => PacketClass::ServiceReverseNat,
        }
    }

    #[inline(always)]
    pub(super) fn from_raw(raw: u32) -> Self {
        if raw == Side::Source as u32 {
            Side::Source
        } else {
            Side::Destination
        }
    }
}

/// Replaces the source or destination address and port with `s.new_addr/new_port`, keeping
/// the IPv4 header checksum and the TCP/UDP checksum (pseudo-header included) or SCTP's CRC32c
/// (ports only, no pseudo-header) right. A UDP checksum of zero (none, IPv4) stays zero.
#[inline(always)]
pub(super) fn rewrite(ctx: &TcContext, parsed: &Parsed, s: &mut LbScratch, side: Side) -> Stage {
    let l4 = parsed.l4_offset as u32;
    let protocol = parsed.protocol as u32;
    match lb_rewrite(ctx.skb.skb, s, l4, protocol, side as u32) {
        0 => {
            if l4 == 0 {
                frag::translated(side == Side::Source, s.new_port);
            }
            Stage::value(Ok(0))
        }
        _ => Stage::value(Err(DropReason::LbRewriteFailed)),
    }
}

/// Replaces the source (`source`) or destination address `old_addr` and port `old_port` of
/// a TCP or UDP packet with `new_addr`/`new_port`, checksums kept right: the load-balancer's
/// rewrite, lent to the egress IP stage (one verified copy of it serves both).
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "a translation is these eight things"
)]
pub fn rewrite_address(
    ctx: &TcContext,
    parsed: &Parsed,
    source: bool,
    ipv4: bool,
    old_addr: &Addr,
    new_addr: &Addr,
    old_port: [u8; 2],
    new_port: [u8; 2],
) -> Result<(), DropReason> {
    let failed = DropReason::EgressIpRewriteFailed;
    let s = LB_SCRATCH.get_ptr_mut(0).ok_or(failed)?;
    // SAFETY: this CPU's working set, used within this program run only.
    let s = unsafe { &mut *s };
    s.ipv4 = ipv4 as u8;
    copy_addr(&mut s.old_addr, old_addr);
    copy_addr(&mut s.new_addr, new_addr);
    s.old_port = old_port;
    s.new_port = new_port;
    let side = if source {
        Side::Source
    } else {
        Side::Destination
    };
    let l4 = parsed.l4_offset as u32;
    match lb_rewrite(ctx.skb.skb, s, l4, parsed.protocol as u32, side as u32) {
        0 => Ok(()),
        _ => Err(failed),
    }
}

/// [`rewrite`] as a global BPF function: the verifier checks it once on its own (with any
/// offset, protocol and side) instead of again at each of its call sites on every path that
/// reaches them, which kept `tc_from_pod` at the verifier's limit. 0 on success.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn lb_rewrite(
    skb: *mut __sk_buff,
    s: *mut LbScratch,
    l4: u32,
    protocol: u32,
    side: u32,
) -> i32 {
    if s.is_null() {
        return -1;
    }
    let ctx = TcContext::new(skb);
    // SAFETY: the caller's per-CPU working set (checked non-null above).
    let s = unsafe { &mut *s };
    match translate(&ctx, l4 as usize, protocol as u8, s, Side::from_raw(side)) {
        Ok(()) => 0,
        Err(_) => -1,
    }
}

#[inline(always)]
pub(super) fn translate(
    ctx: &TcContext,
    l4: usize,
    protocol: u8,
    s: &mut LbScratch,
    side: Side,
) -> Result<(), DropReason> {
    let diff = address_diff(s);
    let echo = protocol == IPPROTO_ICMP || protocol == IPPROTO_ICMPV6;
    // The headers are written in place (cheaper than a store helper per field); the helpers
    // that follow invalidate the packet pointers, so every direct write comes first.
    write_headers(ctx, l4, s, side, port_offset(echo, side), diff)?;
    // A later fragment (no transport header): the address alone; the transport checksum
    // travels in the first fragment, which was corrected for the whole datagram.
    if protocol == IPPROTO_SCTP || l4 == 0 {
        // Its CRC32c is corrected once all rewrites are done: `follow_sctp_ports`.
        return Ok(());
    }
    if echo {
        return follow_echo_checksum(ctx, l4, protocol, diff, s.old_port, s.new_port);
    }
    follow_transport_checksum(ctx, l4, protocol, diff, s.old_port, s.new_port)
}

/// Where the translated "port" lies in the transport header: the source or destination port
/// of TCP, UDP and SCTP; an ICMP or ICMPv6 echo's identifier, which stands for the port on
/// both sides (the querier's end of the exchange).
#[inline(always)]
fn port_offset(echo: bool, side: Side) -> usize {
    match (echo, side) {
        (true, _) => 4,
        (false, Side::Source) => 0,
        (false, Side::Destination) => 2,
    }
}

/// Corrects an ICMP or ICMPv6 echo's checksum at `l4 + 2` after the addresses changed by
/// `diff` (only ICMPv6 sums a pseudo-header) and its identifier `old_id` became `new_id` (the
/// identifier is already rewritten).
#[inline(always)]
fn follow_echo_checksum(
    ctx: &TcContext,
    l4: usize,
    protocol: u8,
    diff: u32,
    old_id: [u8; 2],
    new_id: [u8; 2],
) -> Result<(), DropReason> {
    let failed = |_| DropReason::LbRewriteFailed;
    let check = l4 + 2;
    if protocol == IPPROTO_ICMPV6 {
        ctx.l4_csum_replace(check, 0, diff as u64, BPF_F_PSEUDO_HDR as u64)
            .map_err(failed)?;
    }
    if old_id != new_id {
        let from = u16::from_ne_bytes(old_id) as u64;
        let to = u16::from_ne_bytes(new_id) as u64;
        ctx.l4_csum_replace(check, from, to, 2).map_err(failed)?;
    }
    Ok(())
}

/// Corrects the TCP or UDP checksum of the transport header at `l4` after the addresses
/// changed by `diff` (the pseudo-header) and the port `old_port` became `new_port`; the
/// headers themselves are already rewritten.
#[inline(always)]
pub(super) fn follow_transport_checksum(
    ctx: &TcContext,
    l4: usize,
    protocol: u8,
    diff: u32,
    old_port: [u8; 2],
    new_port: [u8; 2],
) -> Result<(), DropReason> {
    let check = if protocol == IPPROTO_TCP {
        l4 + 16
    } else {
        l4 + 6
    };
    let mangled = if protocol == IPPROTO_UDP {
        BPF_F_MARK_MANGLED_0 as u64
    } else {
        0
    };
    let failed = |_| DropReason::LbRewriteFailed;
    // The transport checksum goes through the kernel, which alone knows whether it is a full
    // checksum or an offload's pseudo-header seed (then only the addresses count).
    let before = checksum_field(ctx, check);
    // Through memory: compared as `Some(0)`, LLVM tests the bits of an absent value too,
    // taken from whatever register (once the context pointer, which the verifier refuses).
    let field = before.unwrap_or(1);
    // SAFETY: a volatile read of a local.
    if protocol == IPPROTO_UDP && unsafe { core::ptr::read_volatile(&field) } == 0 {
        // A datagram sent without a checksum: told `BPF_F_MARK_MANGLED_0`, the helper returns
        // at once on a zero field, touching neither it nor the skb's csum, so both calls
        // would cost their time (about 30 ns each here) for nothing.
        return Ok(());
    }
    ctx.l4_csum_replace(check, 0, diff as u64, BPF_F_PSEUDO_HDR as u64 | mangled)
        .map_err(failed)?;
    if old_port != new_port {
        let from = u16::from_ne_bytes(old_port);
        let to = u16::from_ne_bytes(new_port);
        let udp = protocol == IPPROTO_UDP;
        if !port_fixed_in_place(ctx, check, before, diff, udp, from, to) {
            ctx.l4_csum_replace(check, from as u64, to as u64, 2 | mangled)
                .map_err(failed)?;
        }
    }
    Ok(())
}

/// The transport checksum field at `at` as a pointer into the packet, bounds-checked (`None`
/// when not directly reachable).
#[inline(always)]
fn checksum_field_ptr(ctx: &TcContext, at: usize) -> Option<*mut [u8; 2]> {
    if at > MAX_DIRECT_CHECK {
        return None;
    }
    // SAFETY: a volatile read of a local (the mask must survive: see `write_headers`).
    let at = ctx.data() + (unsafe { core::ptr::read_volatile(&at) } & MAX_DIRECT_CHECK);
    if at + 2 > ctx.data_end() {
        return None;
    }
    Some(at as *mut [u8; 2])
}

/// The transport checksum field at `at`, read in place (`None` when not directly readable).
#[inline(always)]
fn checksum_field(ctx: &TcContext, at: usize) -> Option<u16> {
    let field = checksum_field_ptr(ctx, at)?;
    // SAFETY: the two bytes were bounds-checked by `checksum_field_ptr`.
    Some(u16::from_ne_bytes(unsafe {
        core::ptr::read_unaligned(field)
    }))
}

/// What `bpf_l4_csum_replace` made of a pseudo-header change, told by the value it wrote.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ChecksumKind {
    /// A full checksum: the ports count too.
    Full,
    /// An offload's pseudo-header seed (`CHECKSUM_PARTIAL`): only the addresses count.
    Seed,
    /// Cannot tell.
    Unknown,
}

/// Corrects the checksum field at `check` for a port change in place, when the address
/// change's result (`before` the helper applied `diff`, and now) tells which kind of field it
/// is: a seed needs nothing, a full checksum the port's difference. `false`: could not tell
/// (or the field is not directly writable); the caller's helper call decides then. Saves a
/// helper call per translated packet, whose internal calls and returns cost about 40 ns here.
#[inline(always)]
fn port_fixed_in_place(
    ctx: &TcContext,
    check: usize,
    before: Option<u16>,
    diff: u32,
    udp: bool,
    from: u16,
    to: u16,
) -> bool {
    let (Some(before), Some(after)) = (before, checksum_field(ctx, check)) else {
        return false;
    };
    match checksum_kind(before, after, diff, udp) {
        ChecksumKind::Seed => true,
        ChecksumKind::Full => {
            // RFC 1624 over the port's one word.
            let mut fixed =
                u16::from_ne_bytes(updated(after.to_ne_bytes(), (!from) as u32 + to as u32));
            if udp && fixed == 0 {
                fixed = CSUM_MANGLED_0;
            }
            write_checksum_field(ctx, check, fixed)
        }
        ChecksumKind::Unknown => false,
    }
}

/// Which kind of field `bpf_l4_csum_replace(BPF_F_PSEUDO_HDR)` found, from its result: a full
/// checksum moves by `-diff`, a seed by `+diff` (its formulas reproduced bit for bit, UDP's
/// zero rule included). An address change that leaves the sum's residue unchanged moves
/// neither, and then nothing can be told.
#[inline(always)]
fn checksum_kind(before: u16, after: u16, diff: u32, udp: bool) -> ChecksumKind {
    let residue = !fold(diff);
    if residue == 0 || residue == 0xFFFF || (udp && before == 0) {
        return ChecksumKind::Unknown;
    }
    let mangled = |v: u16| if udp && v == 0 { CSUM_MANGLED_0 } else { v };
    let full = mangled(fold(csum_add(diff, !(before as u32))));
    let seed = mangled(!fold(csum_add(before as u32, diff)));
    if after == full && after != seed {
        ChecksumKind::Full
    } else if after == seed && after != full {
        ChecksumKind::Seed
    } else {
        ChecksumKind::Unknown
    }
}

/// Writes the transport checksum field at `at` in place; false if not directly writable.
#[inline(always)]
fn write_checksum_field(ctx: &TcContext, at: usize, value: u16) -> bool {
    let Some(field) = checksum_field_ptr(ctx, at) else {
        return false;
    };
    // SAFETY: the two bytes were bounds-checked by `checksum_field_ptr`.
    unsafe { core::ptr::write_unaligned(field, value.to_ne_bytes()) };
    true
}

/// Writes `s.new_addr` (and `s.new_port` when it differs, at `port_at` in the transport
/// header) over the source or destination in place, and the IPv4 header checksum by the address change `diff` (RFC 1624). Headers
/// outside the skb's linear data are pulled in first.
#[inline(always)]
fn write_headers(
    ctx: &TcContext,
    l4: usize,
    s: &LbScratch,
    side: Side,
    port_at: usize,
    diff: u32,
) -> Result<(), DropReason> {
    let failed = DropReason::LbRewriteFailed;
    // Ports live in the first 4 bytes of TCP, UDP and SCTP alike, an echo's identifier in
    // bytes 4 and 5 of ICMP; every such header has 8 bytes. Offsets are masked so the
    // verifier sees them bounded; a header deeper than that takes the helper path below.
    if l4 > MAX_DIRECT_L4 {
        return store_headers(ctx, l4, s, side, port_at);
    }
    let needed = (l4 + 8) as u32;
    if ctx.data() + needed as usize > ctx.data_end() {
        ctx.pull_data(needed).map_err(|_| failed)?;
    }
    let (start, end) = (ctx.data(), ctx.data_end());
    let ip = start + ETH_LEN;
    // Read back opaquely: LLVM knows `l4 <= MAX_DIRECT_L4` from the check above and would
    // drop the mask the verifier needs to bound the pointer.
    // SAFETY: a volatile read of a local.
    let ports = start + (unsafe { core::ptr::read_volatile(&l4) } & MAX_DIRECT_L4);
    if ports + 8 > end {
        return Err(failed);
    }
    if s.ipv4 != 0 {
        if ip + 20 > end {
            return Err(failed);
        }
        let at = if side == Side::Source {
            ip + 12
        } else {
            ip + 16
        };
        let a = &s.new_addr;
        // SAFETY: the 20-byte IPv4 header was bounds-checked just above.
        unsafe {
            core::ptr::write_unaligned(at as *mut [u8; 4], [a[12], a[13], a[14], a[15]]);
            let check = (ip + 10) as *mut [u8; 2];
            core::ptr::write_unaligned(check, updated(core::ptr::read_unaligned(check), diff));
        }
    } else {
        if ip + 40 > end {
            return Err(failed);
        }
        let at = if side == Side::Source {
            ip + 8
        } else {
            ip + 24
        };
        // SAFETY: the 40-byte IPv6 header was bounds-checked just above.
        unsafe { copy_bytes::<16>(at as *mut u8, s.new_addr.as_ptr()) };
    }
    if s.old_port != s.new_port && l4 != 0 {
        // Masked (and read opaquely, as above) so the verifier sees the write within the 8
        // checked bytes.
        // SAFETY: a volatile read of a local.
        let at = ports + (unsafe { core::ptr::read_volatile(&port_at) } & 6);
        // SAFETY: the 8 bytes of the transport header were bounds-checked above.
        unsafe { core::ptr::write_unaligned(at as *mut [u8; 2], s.new_port) };
    }
    Ok(())
}

/// [`write_headers`] through the store helpers, for a transport header deeper than
/// `MAX_DIRECT_L4` (IPv6 with long extension headers).
#[inline(never)]
fn store_headers(
    ctx: &TcContext,
    l4: usize,
    s: &LbScratch,
    side: Side,
    port_at: usize,
) -> Result<(), DropReason> {
    let failed = |_| DropReason::LbRewriteFailed;
    let l3 = ETH_LEN;
    // Recomputed rather than passed: a BPF call takes at most five arguments.
    let diff = address_diff(s);
    if s.ipv4 != 0 {
        let at = if side == Side::Source {
            l3 + 12
        } else {
            l3 + 16
        };
        let a = &s.new_addr;
        ctx.store(at, &[a[12], a[13], a[14], a[15]], 0)
            .map_err(failed)?;
        ctx.l3_csum_replace(l3 + 10, 0, diff as u64, 0)
            .map_err(failed)?;
    } else {
        let at = if side == Side::Source {
            l3 + 8
        } else {
            l3 + 24
        };
        ctx.store(at, &s.new_addr, 0).map_err(failed)?;
    }
    if s.old_port != s.new_port {
        ctx.store(l4 + port_at, &s.new_port, 0).map_err(failed)?;
    }
    Ok(())
}

/// The one's-complement difference from `s.old_addr` to `s.new_addr` (the last four bytes for
/// IPv4).
#[inline(always)]
pub(super) fn address_diff(s: &LbScratch) -> u32 {
    // SAFETY: both lie 4-aligned in the working set (asserted with its layout).
    unsafe { addr_diff(&s.old_addr, &s.new_addr, s.ipv4 != 0, 0) }
}
