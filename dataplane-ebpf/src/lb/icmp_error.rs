//! ICMP and ICMPv6 errors about translated flows: the quoted packet and the error's own
//! addresses given back the service's (or the client's) address, as the flow's replies are.

#![expect(
    clippy::needless_borrows_for_generic_args,
    reason = "keys stay in the per-CPU working set"
)]

use super::conntrack::expired;
use super::conntrack::scratch;
use super::rewrite::Side;
use super::rewrite::address_diff;
use aya_ebpf::{
    bindings::{__sk_buff, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use dataplane_common::{
    DropReason,
    lb::{CT_NODEPORT, CT_REPLY, CT_SNAT, CtKey},
    overlay::Addr,
};

use crate::parse::{ETH_LEN, ETH_P_IP};
use crate::{
    clock::now,
    copy::{copy_addr, set_ipv4_mapped},
    maps::LB_CT,
    overlay,
    parse::{IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, load_bytes},
    stage::{Stage, reverse_nat},
    work::{LbScratch, Parsed},
};

/// ICMP error types that quote the packet they are about (RFC 792, RFC 4443).
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETER_PROBLEM: u8 = 12;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PARAMETER_PROBLEM: u8 = 4;

/// An ICMP or ICMPv6 error from a backend about a packet of a service flow (port unreachable,
/// packet too big, ...), given the service's address back: the quoted packet's destination
/// address and port become the service's, and so does the error's source when it is the
/// backend. Without this the client's stack, which sent to the service, matches the error to
/// no socket. A flow the load-balancer also masqueraded (hairpin, NodePort through another
/// node) gets its client back too: the quoted source and the error's destination. An error
/// about a NodePort flow is routed out to its client here (its source may now be this node's
/// address, which the stack would not forward).
///
/// The value: one of [`reverse_nat`]'s (untouched, translated, or translated and routed out).
#[inline(never)]
pub fn icmp_error_reverse_nat(ctx: &TcContext, parsed: &Parsed) -> Stage {
    Stage::value(match translate_icmp_error(ctx, parsed) {
        Ok(Translated::No) => Ok(reverse_nat::UNTOUCHED),
        Ok(Translated::Yes) => Ok(reverse_nat::TRANSLATED),
        Ok(Translated::RouteOut) => overlay::route_out(ctx, parsed)
            .into_value()
            .map(reverse_nat::routed),
        Err(reason) => Err(reason),
    })
}

/// What [`translate_icmp_error`] did.
enum Translated {
    No,
    Yes,
    RouteOut,
}

#[inline(always)]
fn translate_icmp_error(ctx: &TcContext, parsed: &Parsed) -> Result<Translated, DropReason> {
    let ipv4 = parsed.ether_type == ETH_P_IP;
    let Some((s, icmp, quoted_l4)) = quoted_error(ctx, parsed) else {
        return Ok(Translated::No);
    };
    // SAFETY: only read, within this program run.
    let Some(entry) = (unsafe { LB_CT.get(&s.flow) }) else {
        return Ok(Translated::No);
    };
    if expired(entry, s.flow.protocol, now()) {
        return Ok(Translated::No);
    }
    // The quoted destination: the backend becomes the service.
    copy_addr(&mut s.old_addr, &s.flow.src);
    s.old_port = s.flow.src_port_be;
    copy_addr(&mut s.new_addr, &entry.addr);
    s.new_port = entry.port_be;
    quoted_rewrite(ctx, s, icmp, quoted_l4, Side::Destination)?;
    // The error's source, when the backend itself sent it (a router on the way keeps its own).
    if sent_by(ctx, ipv4, &s.old_addr) {
        error_rewrite(ctx, s, icmp, Side::Source)?;
    }
    if entry.flags & CT_SNAT != 0 {
        // The quoted source and the error's destination: the masquerade address and port
        // become the client's.
        copy_addr(&mut s.old_addr, &s.flow.dst);
        s.old_port = s.flow.dst_port_be;
        copy_addr(&mut s.new_addr, &entry.nat_addr);
        s.new_port = entry.nat_port_be;
        quoted_rewrite(ctx, s, icmp, quoted_l4, Side::Source)?;
        if addressed_to(ctx, ipv4, &s.old_addr) {
            error_rewrite(ctx, s, icmp, Side::Destination)?;
        }
    }
    if entry.flags & CT_NODEPORT != 0 {
        return Ok(Translated::RouteOut);
    }
    Ok(Translated::Yes)
}

/// An ICMP or ICMPv6 error quoting a TCP, UDP or SCTP packet with its ports: the working set
/// with the quoted flow read into its `flow` in the reply direction, the error's offset and
/// the quoted transport header's. `None` for anything else.
#[inline(always)]
fn quoted_error(ctx: &TcContext, parsed: &Parsed) -> Option<(&'static mut LbScratch, u32, u32)> {
    if parsed.l3_offset != ETH_LEN || parsed.l4_offset == 0 {
        return None;
    }
    let ipv4 = parsed.ether_type == ETH_P_IP;
    let icmp = parsed.l4_offset;
    let kind = ctx.load::<u8>(icmp).ok()?;
    let is_error = if ipv4 {
        parsed.protocol == IPPROTO_ICMP
            && matches!(
                kind,
                ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAMETER_PROBLEM
            )
    } else {
        parsed.protocol == IPPROTO_ICMPV6
            && (ICMPV6_DEST_UNREACH..=ICMPV6_PARAMETER_PROBLEM).contains(&kind)
    };
    if !is_error {
        return None;
    }
    let s = scratch()?;
    let quoted_l4 = read_quoted_reply_flow(ctx, icmp + 8, ipv4, s)?;
    Some((s, icmp as u32, quoted_l4 as u32))
}

/// An ICMP or ICMPv6 error addressed to a source another stage translated (egress IPs): the
/// flow it quotes, in its reply direction with `direction` set, is given to `original`, which
/// fills in the address and port the flow had before translation. The quoted source and the
/// error's destination get them back, every checksum following, so the sender's stack matches
/// the error (a path MTU, an unreachable port) to its socket. `Ok(false)`: no such error, or
/// `original` knows no such flow.
#[inline(always)]
pub fn untranslate_icmp_error(
    ctx: &TcContext,
    parsed: &Parsed,
    direction: u8,
    original: impl FnOnce(&CtKey, &mut Addr, &mut [u8; 2]) -> bool,
) -> Result<bool, DropReason> {
    let Some((s, icmp, quoted_l4)) = quoted_error(ctx, parsed) else {
        return Ok(false);
    };
    s.flow.direction = direction;
    // The error must be addressed to the source it quotes.
    if !addressed_to(ctx, s.ipv4 != 0, &s.flow.dst)
        || !original(&s.flow, &mut s.new_addr, &mut s.new_port)
    {
        return Ok(false);
    }
    copy_addr(&mut s.old_addr, &s.flow.dst);
    s.old_port = s.flow.dst_port_be;
    quoted_rewrite(ctx, s, icmp, quoted_l4, Side::Source)?;
    error_rewrite(ctx, s, icmp, Side::Destination)?;
    Ok(true)
}

/// Inside an ICMP error at `icmp` quoting a packet whose transport header is at `quoted_l4`:
/// replaces the quoted source or destination address and port, `s.old_*` by `s.new_*`, with
/// every checksum the change touches (the quoted IPv4 header's, the quoted transport one when
/// it is quoted, and the error's own). A global BPF function, verified once. 0 on success.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn quoted_rewrite_at(
    skb: *mut __sk_buff,
    s: *mut LbScratch,
    icmp: u32,
    quoted_l4: u32,
    side: u32,
) -> i32 {
    if s.is_null() {
        return -1;
    }
    let ctx = TcContext::new(skb);
    // SAFETY: the caller's per-CPU working set (checked non-null above).
    let s = unsafe { &mut *s };
    match rewrite_quoted(
        &ctx,
        s,
        icmp as usize,
        quoted_l4 as usize,
        Side::from_raw(side),
    ) {
        Ok(()) => 0,
        Err(_) => -1,
    }
}

#[inline(always)]
fn quoted_rewrite(
    ctx: &TcContext,
    s: &mut LbScratch,
    icmp: u32,
    quoted_l4: u32,
    side: Side,
) -> Result<(), DropReason> {
    match quoted_rewrite_at(ctx.skb.skb, s, icmp, quoted_l4, side as u32) {
        0 => Ok(()),
        _ => Err(DropReason::LbRewriteFailed),
    }
}

#[inline(always)]
fn rewrite_quoted(
    ctx: &TcContext,
    s: &mut LbScratch,
    icmp: usize,
    quoted_l4: usize,
    side: Side,
) -> Result<(), DropReason> {
    let failed = |_| DropReason::LbRewriteFailed;
    let ipv4 = s.ipv4 != 0;
    let check = icmp + 2;
    let quoted = icmp + 8;
    let source = side == Side::Source;
    let diff = address_diff(s);
    if ipv4 {
        let at = if source { quoted + 12 } else { quoted + 16 };
        ctx.store(at, &v4_of(&s.new_addr), 0).map_err(failed)?;
        // The quoted header's own checksum moves opposite to the address, so the ICMP
        // checksum over both stays as it was.
        ctx.l3_csum_replace(quoted + 10, 0, diff as u64, 0)
            .map_err(failed)?;
    } else {
        let at = if source { quoted + 8 } else { quoted + 24 };
        ctx.store(at, &s.new_addr, 0).map_err(failed)?;
        ctx.l4_csum_replace(check, 0, diff as u64, 0)
            .map_err(failed)?;
    }
    // The quoted port, and the quoted transport checksum when it is quoted.
    let port_at = if source { quoted_l4 } else { quoted_l4 + 2 };
    ctx.store(port_at, &s.new_port, 0).map_err(failed)?;
    let from = u16::from_ne_bytes(s.old_port) as u64;
    let to = u16::from_ne_bytes(s.new_port) as u64;
    ctx.l4_csum_replace(check, from, to, 2).map_err(failed)?;
    let quoted_check = match s.flow.protocol {
        IPPROTO_TCP => quoted_l4 + 16,
        IPPROTO_UDP => quoted_l4 + 6,
        _ => 0,
    };
    if quoted_check != 0
        && let Ok(before) = ctx.load::<u16>(quoted_check)
        && before != 0
    {
        let mangled = if s.flow.protocol == IPPROTO_UDP {
            BPF_F_MARK_MANGLED_0 as u64
        } else {
            0
        };
        ctx.l4_csum_replace(quoted_check, 0, diff as u64, mangled)
            .map_err(failed)?;
        ctx.l4_csum_replace(quoted_check, from, to, 2 | mangled)
            .map_err(failed)?;
        let after = ctx.load::<u16>(quoted_check).map_err(failed)?;
        ctx.l4_csum_replace(check, before as u64, after as u64, 2)
            .map_err(failed)?;
    }
    Ok(())
}

/// The ICMP error's own source or destination address, `s.old_addr` to `s.new_addr`, with the
/// IPv4 header checksum or the ICMPv6 checksum (its pseudo-header) following.
#[inline(never)]
fn error_rewrite(
    ctx: &TcContext,
    s: &mut LbScratch,
    icmp: u32,
    side: Side,
) -> Result<(), DropReason> {
    let failed = |_| DropReason::LbRewriteFailed;
    let source = side == Side::Source;
    let diff = address_diff(s);
    if s.ipv4 != 0 {
        let at = if source { ETH_LEN + 12 } else { ETH_LEN + 16 };
        ctx.store(at, &v4_of(&s.new_addr), 0).map_err(failed)?;
        ctx.l3_csum_replace(ETH_LEN + 10, 0, diff as u64, 0)
            .map_err(failed)
    } else {
        let at = if source { ETH_LEN + 8 } else { ETH_LEN + 24 };
        ctx.store(at, &s.new_addr, 0).map_err(failed)?;
        ctx.l4_csum_replace(icmp as usize + 2, 0, diff as u64, BPF_F_PSEUDO_HDR as u64)
            .map_err(failed)
    }
}

/// Whether the packet's destination address is `addr`.
#[inline(always)]
fn addressed_to(ctx: &TcContext, ipv4: bool, addr: &Addr) -> bool {
    let at = if ipv4 { ETH_LEN + 16 } else { ETH_LEN + 24 };
    address_at(ctx, ipv4, at, addr)
}

/// Whether the packet's source address is `addr`.
#[inline(always)]
fn sent_by(ctx: &TcContext, ipv4: bool, addr: &Addr) -> bool {
    let at = if ipv4 { ETH_LEN + 12 } else { ETH_LEN + 8 };
    address_at(ctx, ipv4, at, addr)
}

/// Whether the address at `at` in the packet is `addr`.
#[inline(always)]
fn address_at(ctx: &TcContext, ipv4: bool, at: usize, addr: &Addr) -> bool {
    if ipv4 {
        ctx.load::<u32>(at)
            .is_ok_and(|a| a == u32::from_ne_bytes(v4_of(addr)))
    } else {
        let (Ok(high), Ok(low)) = (ctx.load::<u64>(at), ctx.load::<u64>(at + 8)) else {
            return false;
        };
        let (a, b) = addr.split_at(8);
        high == u64::from_ne_bytes(a.try_into().unwrap_or_default())
            && low == u64::from_ne_bytes(b.try_into().unwrap_or_default())
    }
}

/// Reads the packet an ICMP error quotes (its IP header at `quoted`) as the reply direction of
/// its flow into `s.flow`: from the backend it was sent to back to the client. Returns the
/// offset of its transport header; `None` when it is not a TCP, UDP or SCTP packet quoted
/// with its ports.
#[inline(always)]
fn read_quoted_reply_flow(
    ctx: &TcContext,
    quoted: usize,
    ipv4: bool,
    s: &mut LbScratch,
) -> Option<usize> {
    let (protocol, quoted_l4) = if ipv4 {
        let Ok(first) = ctx.load::<u8>(quoted) else {
            return None;
        };
        let header_len = ((first & 0x0F) as usize) * 4;
        if first >> 4 != 4 || header_len < 20 {
            return None;
        }
        let (Ok(protocol), Ok(a)) = (ctx.load::<u8>(quoted + 9), ctx.load::<[u8; 8]>(quoted + 12))
        else {
            return None;
        };
        set_ipv4_mapped(&mut s.flow.dst, [a[0], a[1], a[2], a[3]]);
        set_ipv4_mapped(&mut s.flow.src, [a[4], a[5], a[6], a[7]]);
        (protocol, quoted + header_len)
    } else {
        let Ok(protocol) = ctx.load::<u8>(quoted + 6) else {
            return None;
        };
        // The quoted source is the flow's destination and the other way round.
        if !load_bytes(ctx, quoted + 8, &mut s.flow.dst)
            || !load_bytes(ctx, quoted + 24, &mut s.flow.src)
        {
            return None;
        }
        (protocol, quoted + 40)
    };
    if !matches!(protocol, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP) {
        return None;
    }
    let Ok(ports) = ctx.load::<[u8; 4]>(quoted_l4) else {
        return None;
    };
    s.flow.src_port_be = [ports[2], ports[3]];
    s.flow.dst_port_be = [ports[0], ports[1]];
    s.flow.protocol = protocol;
    s.flow.direction = CT_REPLY;
    s.flow._pad = [0; 2];
    s.ipv4 = ipv4 as u8;
    Some(quoted_l4)
}

/// The IPv4 address of an IPv4-mapped one.
#[inline(always)]
fn v4_of(addr: &Addr) -> [u8; 4] {
    [addr[12], addr[13], addr[14], addr[15]]
}
