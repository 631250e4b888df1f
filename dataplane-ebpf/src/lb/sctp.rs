//! SCTP's ports rewritten with the CRC32c kept right (`dataplane_common::lb::sctp`), in a
//! tail-call stage of its own.

use aya_ebpf::programs::TcContext;
use dataplane_common::{DropReason, PacketClass, lb::sctp::port_rewrite_delta};

use crate::parse::ETH_P_IP;
use crate::{parse::IPPROTO_SCTP, stage::Stage, work::Parsed};

/// SCTP's CRC32c after the load-balancer translated the packet (not when it answered it).
#[inline(always)]
pub fn follow_sctp(
    ctx: &TcContext,
    parsed: &Parsed,
    outcome: PacketClass,
) -> Result<(), DropReason> {
    if !matches!(
        outcome,
        PacketClass::ServiceDnat | PacketClass::ServiceReverseNat
    ) {
        return Ok(());
    }
    follow_sctp_ports(ctx, parsed).into_value().map(|_| ())
}

/// Keeps an SCTP packet's CRC32c right after the load-balancer changed its ports (the hooks
/// call it once, after all rewrites: inside each rewrite it would multiply the paths the
/// verifier walks). The change comes from the ports as parsed and as they are now, and the
/// packet's length: the payload is never read. A zero field is a CRC the sender's stack left
/// to be computed on the way out (offloaded, as over veth): that happens later over the
/// rewritten bytes, so the field is left alone.
#[inline(never)]
pub fn follow_sctp_ports(ctx: &TcContext, parsed: &Parsed) -> Stage {
    Stage::value(sctp_follow_ports(ctx, parsed).map(|()| 0))
}

#[inline(always)]
fn sctp_follow_ports(ctx: &TcContext, parsed: &Parsed) -> Result<(), DropReason> {
    if parsed.protocol != IPPROTO_SCTP || parsed.l4_offset == 0 {
        return Ok(());
    }
    let failed = |_| DropReason::LbRewriteFailed;
    let (l3, l4) = (parsed.l3_offset, parsed.l4_offset);
    let ports: [u8; 4] = ctx.load(l4).map_err(failed)?;
    let (s, d) = (parsed.src_port, parsed.dst_port);
    let delta = u32::from_ne_bytes([
        s[0] ^ ports[0],
        s[1] ^ ports[1],
        d[0] ^ ports[2],
        d[1] ^ ports[3],
    ]);
    let field: [u8; 4] = ctx.load(l4 + 8).map_err(failed)?;
    if delta == 0 || field == [0; 4] {
        return Ok(());
    }
    // The IP packet's end, from its header: frame padding is not SCTP's.
    let ip_len = if parsed.ether_type == ETH_P_IP {
        u16::from_be_bytes(ctx.load(l3 + 2).map_err(failed)?) as u32
    } else {
        u16::from_be_bytes(ctx.load(l3 + 4).map_err(failed)?) as u32 + 40
    };
    let sctp_len = ip_len
        .checked_sub((l4 - l3) as u32)
        .filter(|len| (4..=0xFFFF).contains(len))
        .ok_or(DropReason::LbRewriteFailed)?;
    let change = sctp_crc_change(delta, sctp_len).to_ne_bytes();
    let updated = [
        field[0] ^ change[0],
        field[1] ^ change[1],
        field[2] ^ change[2],
        field[3] ^ change[3],
    ];
    ctx.store(l4 + 8, &updated, 0).map_err(failed)
}

/// The CRC32c change of an SCTP packet of `len` bytes whose ports changed by `delta` (see
/// `dataplane_common::lb::sctp`). A global BPF function: the verifier checks its arithmetic
/// once on its own, not again on every path that reaches it.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn sctp_crc_change(delta: u32, len: u32) -> u32 {
    u32::from_ne_bytes(port_rewrite_delta(
        delta.to_ne_bytes(),
        (len & 0xFFFF) as u16,
    ))
}
