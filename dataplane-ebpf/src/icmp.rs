//! ICMP and ICMPv6 errors the dataplane answers with itself, sent straight back to the pod whose
//! packet caused them. The offending packet's own buffer is reused: shrunk, rewritten, and
//! redirected out of the veth it arrived on, so the pod sees the error arrive from its gateway.

use aya_ebpf::{
    bindings::{TC_ACT_REDIRECT, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC},
    helpers::{bpf_redirect, bpf_skb_adjust_room, bpf_skb_load_bytes, bpf_skb_store_bytes},
    programs::TcContext,
};
use dataplane_common::{
    DropReason,
    overlay::{Addr, OVERLAY_HAS_IPV4, OVERLAY_HAS_IPV6, OverlayConfig},
};

use crate::parse::ETH_LEN;
use crate::{
    copy::copy_bytes,
    csum::{store_checksum, sum_words, write_ipv4},
    maps::{ENCAP_SCRATCH_LEN, SCRATCH},
    stage::Stage,
};

const IPPROTO_ICMP: u8 = 1;
const IPPROTO_ICMPV6: u8 = 58;
/// Quoted bytes of the offending IPv4 packet: its header (with options, at most 60) and the
/// first 8 bytes of its payload (RFC 792).
const QUOTE_V4_MAX: usize = 60 + 8;
/// Quoted bytes of the offending IPv6 packet: its header and the start of its payload. RFC 4443
/// allows up to the minimum MTU; this is enough for the sender to match the flow.
const QUOTE_V6: usize = 64;
/// Ethernet + IPv6 + ICMPv6 + quote (+ a pad byte for the checksum): the longest ICMPv6 error.
const ERROR_V6_MAX_LEN: usize = ETH_LEN + 40 + 8 + QUOTE_V6 + 1;

const _: () = assert!(ERROR_V6_MAX_LEN <= ENCAP_SCRATCH_LEN);
const _: () = assert!(ETH_LEN + 20 + 8 + QUOTE_V4_MAX <= ENCAP_SCRATCH_LEN);

/// Answers a packet larger than `mtu` with ICMP "fragmentation needed" (IPv4, DF set) or
/// ICMPv6 "packet too big", carrying `mtu`. An IPv4 packet without DF cannot be fragmented
/// here and is dropped with `OverlayMtuExceeded`.
#[inline(never)]
pub fn too_big(ctx: &TcContext, ipv6: bool, mtu: u32, config: &OverlayConfig) -> Stage {
    Stage::value(answer_too_big(ctx, ipv6, mtu, config).map(|verdict| verdict as u32))
}

#[inline(always)]
fn answer_too_big(
    ctx: &TcContext,
    ipv6: bool,
    mtu: u32,
    config: &OverlayConfig,
) -> Result<i32, DropReason> {
    let failed = DropReason::OverlayMtuExceeded;
    let block = reply_block(ctx, failed)?;
    let length = if ipv6 {
        if config.flags & OVERLAY_HAS_IPV6 == 0 {
            return Err(failed);
        }
        build_error_v6(ctx, block, [2, 0], mtu.to_be_bytes(), &config.node_ipv6)?
    } else {
        let header: [u8; 20] = ctx.load(ETH_LEN).map_err(|_| DropReason::Ipv4Truncated)?;
        if header[6] & 0x40 == 0 || config.flags & OVERLAY_HAS_IPV4 == 0 {
            return Err(failed);
        }
        let mtu = (mtu as u16).to_be_bytes();
        build_error_v4(ctx, block, [3, 4], [0, 0, mtu[0], mtu[1]], config.node_ipv4)?
    };
    send_back(ctx, block, length, failed)
}

/// Answers a packet to a service port without endpoints with ICMP port unreachable (type 3
/// code 3) or ICMPv6 port unreachable (type 1 code 4), sent from the service address `source`
/// the client used.
#[inline(never)]
pub fn port_unreachable(ctx: &TcContext, ipv6: bool, source: &Addr) -> Stage {
    Stage::value(answer_unreachable(ctx, ipv6, source).map(|verdict| verdict as u32))
}

#[inline(always)]
fn answer_unreachable(ctx: &TcContext, ipv6: bool, source: &Addr) -> Result<i32, DropReason> {
    let failed = DropReason::LbNoEndpoints;
    let block = reply_block(ctx, failed)?;
    let length = if ipv6 {
        build_error_v6(ctx, block, [1, 4], [0; 4], source)?
    } else {
        let v4 = [source[12], source[13], source[14], source[15]];
        build_error_v4(ctx, block, [3, 3], [0; 4], v4)?
    };
    send_back(ctx, block, length, failed)
}

/// The per-CPU block with the reply's Ethernet addresses filled: back to the pod, from its
/// gateway's MAC to its own.
#[inline(always)]
pub fn reply_block(
    ctx: &TcContext,
    failed: DropReason,
) -> Result<&'static mut [u8; ENCAP_SCRATCH_LEN], DropReason> {
    let block = SCRATCH.get_ptr_mut(0).ok_or(failed)?;
    // SAFETY: per-CPU map memory, used only by this program invocation.
    let block = unsafe { &mut *block };
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + 12 > end {
        return Err(DropReason::EthTruncated);
    }
    // SAFETY: the two MAC addresses lie within the linear packet (checked just above); copied
    // straight into the block, swapped.
    unsafe {
        copy_bytes::<6>(block.as_mut_ptr(), (start + 6) as *const u8);
        copy_bytes::<6>(block.as_mut_ptr().add(6), start as *const u8);
    }
    Ok(block)
}

/// Replaces the packet by the first `length` bytes of `block` and sends it back out of the
/// interface it arrived on. GSO packets are refused (a reply is one small packet).
#[inline(always)]
pub fn send_back(
    ctx: &TcContext,
    block: &[u8; ENCAP_SCRATCH_LEN],
    length: usize,
    failed: DropReason,
) -> Result<i32, DropReason> {
    // SAFETY: reading a field of our own context.
    if unsafe { (*ctx.skb.skb).gso_size } != 0 || length > ENCAP_SCRATCH_LEN {
        return Err(failed);
    }
    let diff = length as i32 - ctx.len() as i32;
    // SAFETY: plain helper calls on our own context; `length` bytes of the block are written.
    // adjust_room also resets the checksum-offload state the original packet carried.
    unsafe {
        if diff != 0 && bpf_skb_adjust_room(ctx.skb.skb, diff, BPF_ADJ_ROOM_MAC, 0) != 0 {
            return Err(failed);
        }
        if bpf_skb_store_bytes(ctx.skb.skb, 0, block.as_ptr().cast(), length as u32, 0) != 0 {
            return Err(failed);
        }
        let arrived_on = (*ctx.skb.skb).ifindex;
        if bpf_redirect(arrived_on, 0) != TC_ACT_REDIRECT as i64 {
            return Err(failed);
        }
    }
    Ok(TC_ACT_REDIRECT)
}

/// Fills `block` after the Ethernet addresses with IPv4 + an ICMP error of `type_code` with
/// `rest` (the second word), from `source` to the offending packet's source, quoting its header
/// and 8 bytes of its payload; returns the frame length.
#[inline(always)]
fn build_error_v4(
    ctx: &TcContext,
    block: &mut [u8; ENCAP_SCRATCH_LEN],
    type_code: [u8; 2],
    rest: [u8; 4],
    source: [u8; 4],
) -> Result<usize, DropReason> {
    let version_ihl: u8 = ctx.load(ETH_LEN).map_err(|_| DropReason::Ipv4Truncated)?;
    let quote_len = ((version_ihl & 0x0F) as usize) * 4 + 8;
    if !(28..=QUOTE_V4_MAX).contains(&quote_len) {
        return Err(DropReason::Ipv4BadIhl);
    }
    // The parser saw the transport header, so the header and 8 payload bytes are present.
    load_into(ctx, block, 42, quote_len).map_err(|_| DropReason::Ipv4Truncated)?;
    block[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let icmp_len = 8 + quote_len;
    let ip_len = 20 + icmp_len;
    write_icmp_header(block, 34, type_code, rest);
    store_checksum(block, 36, sum_words(block, 34, icmp_len, 0));
    // The destination is the offending packet's source (quoted at 42, source at +12).
    let destination = [block[54], block[55], block[56], block[57]];
    write_ipv4(
        block,
        ip_len as u16,
        IPPROTO_ICMP,
        false,
        &source,
        &destination,
    );
    Ok(ETH_LEN + ip_len)
}

/// Fills `block` after the Ethernet addresses with IPv6 + an ICMPv6 error of `type_code` with
/// `rest` (the second word), from `source` to the offending packet's source, quoting up to
/// `QUOTE_V6` bytes of it; returns the frame length.
#[inline(always)]
fn build_error_v6(
    ctx: &TcContext,
    block: &mut [u8; ENCAP_SCRATCH_LEN],
    type_code: [u8; 2],
    rest: [u8; 4],
    source: &Addr,
) -> Result<usize, DropReason> {
    let available = ctx.len() as usize - ETH_LEN;
    let quote = if available < QUOTE_V6 {
        available
    } else {
        QUOTE_V6
    };
    if quote < 40 {
        return Err(DropReason::Ipv6Truncated);
    }
    load_into(ctx, block, 62, quote).map_err(|_| DropReason::Ipv6Truncated)?;
    // An odd quote is summed with a zero pad byte, which is not sent.
    if 62 + quote < ENCAP_SCRATCH_LEN {
        block[62 + quote] = 0;
    }
    block[12..14].copy_from_slice(&0x86DDu16.to_be_bytes());
    let payload_len = ((8 + quote) as u16).to_be_bytes();
    block[14..22].copy_from_slice(&[
        0x60,
        0,
        0,
        0,
        payload_len[0],
        payload_len[1],
        IPPROTO_ICMPV6,
        64,
    ]);
    block[22..38].copy_from_slice(source);
    // The destination is the offending packet's source (quoted at 62, source at +8).
    block.copy_within(70..86, 38);
    write_icmp_header(block, 54, type_code, rest);
    // Pseudo-header (RFC 8200 §8.1): addresses, upper-layer length, next header.
    let pseudo = sum_words(block, 22, 32, (8 + quote) as u32 + IPPROTO_ICMPV6 as u32);
    store_checksum(
        block,
        56,
        sum_words(block, 54, (8 + quote + 1) & !1, pseudo),
    );
    Ok(ETH_LEN + 40 + 8 + quote)
}

/// An ICMP or ICMPv6 error header at `at`: type and code, checksum zero (filled in later),
/// and the type's second word.
#[inline(always)]
fn write_icmp_header(
    block: &mut [u8; ENCAP_SCRATCH_LEN],
    at: usize,
    type_code: [u8; 2],
    rest: [u8; 4],
) {
    let header = [
        type_code[0],
        type_code[1],
        0,
        0,
        rest[0],
        rest[1],
        rest[2],
        rest[3],
    ];
    block[at..at + 8].copy_from_slice(&header);
}

/// Copies `len` bytes of the packet, from its network header on, into `block[at..]` without a
/// stack copy (the BPF stack is too small for the quote next to the other stages' state).
#[inline(always)]
fn load_into(
    ctx: &TcContext,
    block: &mut [u8; ENCAP_SCRATCH_LEN],
    at: usize,
    len: usize,
) -> Result<(), i64> {
    // Read back through a volatile load: the compiler would otherwise fold this check into
    // the callers' and the verifier would not see the length bounded on the helper's argument.
    // SAFETY: reading a local variable.
    let len = unsafe { core::ptr::read_volatile(&len) };
    if len == 0 || len > QUOTE_V4_MAX + 8 || at + len > ENCAP_SCRATCH_LEN {
        return Err(-1);
    }
    // SAFETY: the destination range lies within the block (checked above).
    let rc = unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb.cast(),
            ETH_LEN as u32,
            block.as_mut_ptr().add(at).cast(),
            len as u32,
        )
    };
    if rc == 0 { Ok(()) } else { Err(rc) }
}
