//! What the load-balancer answers instead of dropping: a TCP reset for a new flow to a service
//! port without endpoints (or a segment of a flow whose backend went), and the ICMP errors.

use super::conntrack::TCP_ACK;
use super::conntrack::TCP_FIN;
use super::conntrack::TCP_RST;
use super::conntrack::TCP_SYN;
use super::conntrack::scratch;
use aya_ebpf::programs::TcContext;
use dataplane_common::{DropReason, Hook, PacketClass};

use crate::{
    csum::{store_checksum, sum_words, write_ipv4},
    icmp,
    parse::IPPROTO_TCP,
    stage::Stage,
    stats::{count_drop, count_outcome},
    work::Parsed,
};

/// Whether a drop of the load-balancer is one it answers ([`answer`]).
#[inline(always)]
pub fn answerable(reason: DropReason) -> bool {
    matches!(
        reason,
        DropReason::LbNoEndpoints | DropReason::LbBackendGone
    )
}

/// Answers what the load-balancer refused (`reason`, see [`answerable`]) instead of dropping
/// it silently, so the client learns at once instead of timing out: a new flow to a service
/// port without endpoints, a TCP segment of a flow whose backend is gone. The stage's value is
/// the verdict, its class what was answered. Called by the programs after the load-balancer's
/// stage (not inside it), so the answer's frame is not stacked on the stage's.
#[inline(never)]
pub fn answer(ctx: &TcContext, parsed: &Parsed, reason: u32) -> Stage {
    match DropReason::from_code(reason) {
        Some(DropReason::LbNoEndpoints) => Stage::new(
            reject(ctx, parsed).map(|verdict| Some((verdict as u32, PacketClass::ServiceRejected))),
        ),
        Some(DropReason::LbBackendGone) => Stage::new(
            reject(ctx, parsed)
                .map(|verdict| Some((verdict as u32, PacketClass::ServiceResetBackendGone)))
                .map_err(|_| DropReason::LbBackendGone),
        ),
        _ => Stage::new(Err(DropReason::LbRewriteFailed)),
    }
}

/// [`answer`] with its outcome or drop counted at `hook`; the program's verdict.
#[inline(always)]
pub fn answer_counted(ctx: &TcContext, parsed: &Parsed, reason: DropReason, hook: Hook) -> i32 {
    match answer(ctx, parsed, reason as u32).result() {
        Ok(Some((verdict, outcome))) => {
            count_outcome(hook, outcome);
            verdict as i32
        }
        Ok(None) => aya_ebpf::bindings::TC_ACT_OK,
        Err(reason) => {
            count_drop(hook, reason);
            aya_ebpf::bindings::TC_ACT_SHOT
        }
    }
}

/// Answers a new flow to a service port without endpoints, or a TCP segment of a flow whose
/// backend is gone, so the client does not wait for a timeout: TCP with a reset, UDP with ICMP
/// port unreachable, both from the service address.
#[inline(always)]
fn reject(ctx: &TcContext, parsed: &Parsed) -> Result<i32, DropReason> {
    let s = scratch().ok_or(DropReason::LbNoEndpoints)?;
    let ipv6 = s.ipv4 == 0;
    if parsed.protocol == IPPROTO_TCP {
        // Never answer a reset with a reset.
        if s.tcp_flags & TCP_RST != 0 {
            return Err(DropReason::LbNoEndpoints);
        }
        tcp_reset(ctx, parsed).into_value().map(|v| v as i32)
    } else {
        icmp::port_unreachable(ctx, ipv6, &s.flow.dst)
            .into_value()
            .map(|v| v as i32)
    }
}

/// Replaces a TCP segment by the reset RFC 9293 (3.10.7.1) prescribes for a closed port and
/// sends it back: with the segment's ACK, `seq = SEG.ACK`; without, `seq = 0` and
/// `ack = SEG.SEQ + SEG.LEN` (SYN and FIN count one).
#[inline(never)]
fn tcp_reset(ctx: &TcContext, parsed: &Parsed) -> Stage {
    Stage::value(build_reset(ctx, parsed).map(|verdict| verdict as u32))
}

#[inline(always)]
fn build_reset(ctx: &TcContext, parsed: &Parsed) -> Result<i32, DropReason> {
    let failed = DropReason::LbNoEndpoints;
    let s = scratch().ok_or(failed)?;
    let l4 = parsed.l4_offset;
    let tcp: [u8; 14] = ctx.load(l4).map_err(|_| DropReason::TcpTruncated)?;
    let seq = u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]);
    let ack = u32::from_be_bytes([tcp[8], tcp[9], tcp[10], tcp[11]]);
    let data_offset = ((tcp[12] >> 4) as u32) * 4;
    let flags = tcp[13];
    let segment_len = (ctx.len() - l4 as u32).saturating_sub(data_offset)
        + u32::from(flags & TCP_SYN != 0)
        + u32::from(flags & TCP_FIN != 0);
    let (reset_seq, reset_ack, reset_flags) = if flags & TCP_ACK != 0 {
        (ack, 0, TCP_RST)
    } else {
        (0, seq.wrapping_add(segment_len), TCP_RST | TCP_ACK)
    };
    let block = icmp::reply_block(ctx, failed)?;
    let ipv6 = s.ipv4 == 0;
    let (tcp_at, ether_type) = if ipv6 { (54, 0x86DDu16) } else { (34, 0x0800) };
    block[12..14].copy_from_slice(&ether_type.to_be_bytes());
    let (q, a) = (reset_seq.to_be_bytes(), reset_ack.to_be_bytes());
    let sport = s.flow.dst_port_be;
    let dport = s.flow.src_port_be;
    let header = [
        sport[0],
        sport[1],
        dport[0],
        dport[1],
        q[0],
        q[1],
        q[2],
        q[3],
        a[0],
        a[1],
        a[2],
        a[3],
        0x50,
        reset_flags,
        0,
        0,
        0,
        0,
        0,
        0,
    ];
    if ipv6 {
        block[14..22].copy_from_slice(&[0x60, 0, 0, 0, 0, 20, IPPROTO_TCP, 64]);
        block[22..38].copy_from_slice(&s.flow.dst);
        block[38..54].copy_from_slice(&s.flow.src);
        block[54..74].copy_from_slice(&header);
        let pseudo = sum_words(block, 22, 32, 20 + IPPROTO_TCP as u32);
        store_checksum(block, 70, sum_words(block, 54, 20, pseudo));
    } else {
        let (src, dst) = (&s.flow.dst, &s.flow.src);
        let src4 = [src[12], src[13], src[14], src[15]];
        let dst4 = [dst[12], dst[13], dst[14], dst[15]];
        write_ipv4(block, 40, IPPROTO_TCP, true, &src4, &dst4);
        block[34..54].copy_from_slice(&header);
        let pseudo = sum_words(block, 26, 8, 20 + IPPROTO_TCP as u32);
        store_checksum(block, 50, sum_words(block, 34, 20, pseudo));
    }
    icmp::send_back(ctx, block, tcp_at + 20, failed)
}
