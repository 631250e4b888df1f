//! Connection tracking of service flows: a packet's flow read into the working set, whether it
//! may open a flow, when a tracked entry expires, and the masquerade source ports a NodePort
//! flow claims (each by inserting its reply entry).

#![expect(
    clippy::needless_borrows_for_generic_args,
    reason = "keys stay in the per-CPU working set"
)]

use aya_ebpf::{bindings::BPF_NOEXIST, programs::TcContext};
use dataplane_common::{
    DropReason,
    frag::FRAG_LATER,
    lb::{
        CT_CLOSING, CT_ESTABLISHED, CT_ORIGINAL, CT_REPLY, CT_RESET, CT_TIMEOUT_CLOSING,
        CT_TIMEOUT_OPENING, CT_TIMEOUT_OTHER, CT_TIMEOUT_SCTP, CT_TIMEOUT_TCP, CtKey, CtValue,
        SNAT_LOW_PORT_MAX, SNAT_LOW_PORT_MIN, SNAT_PORT_MAX, SNAT_PORT_MIN, SNAT_PORT_REUSE_IDLE,
    },
};

use crate::lookup;
use crate::parse::{ETH_LEN, ETH_P_IP, ETH_P_IPV6};
use crate::{
    copy::{copy_addr, copy_bytes},
    maps::{LB_CT, LB_SCRATCH, LB_SNAT_NEXT},
    parse::{IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, read_addresses},
    stage::Stage,
    work::{LbScratch, Parsed},
};

/// SCTP chunk types that open and end an association (RFC 9260, 3.2).
const SCTP_INIT: u8 = 1;
const SCTP_ABORT: u8 = 6;
const SCTP_SHUTDOWN_COMPLETE: u8 = 14;
pub(super) const TCP_FIN: u8 = 0x01;
pub(super) const TCP_SYN: u8 = 0x02;
pub(super) const TCP_RST: u8 = 0x04;
pub(super) const TCP_ACK: u8 = 0x10;

/// Source ports tried for a masqueraded NodePort flow before giving up (in turn: sixteen
/// ports in a row all held by live flows means the ranges are nearly full).
const SNAT_PORT_ATTEMPTS: u32 = 16;

/// This CPU's working set.
#[inline(always)]
pub(super) fn scratch() -> Option<&'static mut LbScratch> {
    let s = LB_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: per-CPU map memory, used by one program run at a time on this CPU.
    Some(unsafe { &mut *s })
}

/// Reads the flow of a TCP, UDP or SCTP packet of an untagged frame into `s.flow`; false for
/// anything else.
#[inline(always)]
pub(super) fn read_flow(ctx: &TcContext, parsed: &Parsed, s: &mut LbScratch) -> bool {
    // A later fragment has no transport header but its first fragment's ports (`frag`).
    let later_fragment = parsed.fragment >= FRAG_LATER;
    if parsed.l3_offset != ETH_LEN || (parsed.l4_offset == 0 && !later_fragment) {
        return false;
    }
    if !matches!(parsed.protocol, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP) {
        return false;
    }
    let ipv4 = parsed.ether_type == ETH_P_IP;
    if !read_addresses(ctx, ipv4, &mut s.flow.src, &mut s.flow.dst) {
        return false;
    }
    // Variable offsets: the helper, which the verifier follows without help.
    s.tcp_flags = match parsed.protocol {
        _ if later_fragment => 0,
        IPPROTO_TCP => ctx.load::<u8>(parsed.l4_offset + 13).unwrap_or(0),
        IPPROTO_SCTP => sctp_flags(ctx.load::<u8>(parsed.l4_offset + 12).unwrap_or(0)),
        _ => 0,
    };
    s.flow.src_port_be = parsed.src_port;
    s.flow.dst_port_be = parsed.dst_port;
    s.flow.protocol = parsed.protocol;
    s.flow._pad = [0; 2];
    s.ipv4 = ipv4 as u8;
    s.snat = 0;
    s.nodeport = 0;
    s.cacheable = 0;
    true
}

/// Whether the packet may open a flow: a TCP SYN (without ACK), an SCTP INIT, anything of
/// another protocol.
#[inline(always)]
pub(super) fn opening(s: &LbScratch) -> bool {
    match s.flow.protocol {
        IPPROTO_TCP | IPPROTO_SCTP => s.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN,
        _ => true,
    }
}

/// The TCP flags an SCTP packet's first chunk amounts to for connection tracking: INIT opens
/// (as SYN), ABORT and SHUTDOWN COMPLETE end the association (as RST and FIN).
#[inline(always)]
fn sctp_flags(chunk_type: u8) -> u8 {
    match chunk_type {
        SCTP_INIT => TCP_SYN,
        SCTP_ABORT => TCP_RST,
        SCTP_SHUTDOWN_COMPLETE => TCP_FIN,
        _ => 0,
    }
}

/// Whether a tracked entry has been idle longer than its protocol and state allow: a TCP
/// connection or SCTP association that never got past its opening in this direction lives a
/// minute (`CT_TIMEOUT_OPENING`), not its protocol's established timeout.
#[inline(always)]
pub(super) fn expired(entry: &CtValue, protocol: u8, now: u32) -> bool {
    let handshaking = protocol == IPPROTO_TCP || protocol == IPPROTO_SCTP;
    let timeout = if entry.flags & CT_CLOSING != 0 {
        CT_TIMEOUT_CLOSING
    } else if handshaking && entry.flags & CT_ESTABLISHED == 0 {
        CT_TIMEOUT_OPENING
    } else if protocol == IPPROTO_TCP {
        CT_TIMEOUT_TCP
    } else if protocol == IPPROTO_SCTP {
        CT_TIMEOUT_SCTP
    } else {
        CT_TIMEOUT_OTHER
    };
    now.wrapping_sub(entry.last_seen) > timeout
}

/// Refreshes a tracked entry in place: the clock at most once a second, the established flag
/// when a packet other than an opening one passes, the closing flag when a FIN or RST passes
/// (and the reset flag with an RST).
#[inline(always)]
pub(super) fn touch(entry: &mut CtValue, tcp_flags: u8, now: u32) {
    if entry.last_seen != now {
        entry.last_seen = now;
    }
    if tcp_flags & TCP_SYN == 0 && entry.flags & CT_ESTABLISHED == 0 {
        entry.flags |= CT_ESTABLISHED;
    }
    if tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        let ended = if tcp_flags & TCP_RST != 0 {
            CT_CLOSING | CT_RESET
        } else {
            CT_CLOSING
        };
        if entry.flags & ended != ended {
            entry.flags |= ended;
        }
    }
}

/// `s.reply`: the reply direction of the new flow, from the backend to the client or, when
/// masqueraded, to `s.snat_addr` at `port`.
#[inline(always)]
pub(super) fn set_reply_key(s: &mut LbScratch, port: [u8; 2]) {
    let reply = &mut s.reply;
    copy_addr(&mut reply.src, &s.new_addr);
    copy_addr(
        &mut reply.dst,
        if s.snat != 0 {
            &s.snat_addr
        } else {
            &s.flow.src
        },
    );
    reply.src_port_be = s.new_port;
    reply.dst_port_be = port;
    reply.protocol = s.flow.protocol;
    reply.direction = CT_REPLY;
    reply._pad = [0; 2];
}

/// Claims a source port for a masqueraded flow by inserting its reply entry (`s.reply_entry`)
/// under the reply key only if no flow holds that key (atomic: `BPF_NOEXIST`), or by taking
/// over the entry of a flow that has ended there: up to sixteen ports of the reserved ranges,
/// in turn from the index every CPU shares (`LB_SNAT_NEXT`).
#[inline(never)]
pub(super) fn claim_snat_port(s: &mut LbScratch) -> Stage {
    Stage::value(
        claimed_port(s)
            .map(u32::from)
            .ok_or(DropReason::LbSnatPortsExhausted),
    )
}

#[inline(always)]
fn claimed_port(s: &mut LbScratch) -> Option<u16> {
    const HIGH: u32 = (SNAT_PORT_MAX - SNAT_PORT_MIN) as u32 + 1;
    const LOW: u32 = (SNAT_LOW_PORT_MAX - SNAT_LOW_PORT_MIN) as u32 + 1;
    // The wrap below relies on the high range ending at 65535.
    const { assert!(SNAT_PORT_MAX == u16::MAX) };
    // The low range only towards a pod subnet of another node (`SNAT_LOW_PORT_MIN`).
    let ether_type = if s.ipv4 != 0 { ETH_P_IP } else { ETH_P_IPV6 };
    let range = if lookup::remote_endpoint(ether_type, &s.new_addr).is_some() {
        HIGH + LOW
    } else {
        HIGH
    };
    let next = LB_SNAT_NEXT.get_ptr_mut(0)?;
    for _ in 0..SNAT_PORT_ATTEMPTS {
        // Ports in turn, not at random: a port comes round again only after every other one
        // has, so the flow that held it last is as old as the range allows (at 9,000 new
        // flows a second, four seconds). Drawn at random, sixteen draws all found young
        // flows' ports once a few thousand connections a second had half the range
        // closing: one SYN in 16,000 to 70,000 was dropped, and its client waited a second.
        let offset = (fetch_increment(next) % range as u64) as u32;
        // Offsets past the high range wrap past 65535 into the low one, without a branch
        // (each would double the paths the verifier walks through the attempts).
        let past = SNAT_PORT_MIN as u32 + offset;
        let port = ((past + (past >> 16) * SNAT_LOW_PORT_MIN as u32) & 0xFFFF) as u16;
        let port_be = port.to_be_bytes();
        set_reply_key(s, port_be);
        if LB_CT
            .insert(&s.reply, &s.reply_entry, BPF_NOEXIST as u64)
            .is_ok()
        {
            return Some(port);
        }
        // Held by a flow that has ended: taken over, in place. Waiting for the LRU map to
        // evict it kept short connections' ports for good.
        if let Some(held) = LB_CT.get_ptr_mut(&s.reply) {
            // SAFETY: a valid map value pointer for this program run.
            let held = unsafe { &mut *held };
            let now = s.reply_entry.last_seen;
            if expired(held, s.flow.protocol, now) || ended(s, held, port_be, now) {
                // SAFETY: both are whole `CtValue`s, distinct memory.
                unsafe {
                    copy_bytes::<{ core::mem::size_of::<CtValue>() }>(
                        (held as *mut CtValue).cast(),
                        (&s.reply_entry as *const CtValue).cast(),
                    )
                };
                return Some(port);
            }
        }
    }
    None
}

/// Adds one to `*at` atomically (every CPU at once) and returns what it held before. In
/// assembly: the target's `core` has no atomic read-modify-write, and LLVM emits the fetching
/// add only when building for BPF v3 (the kernel has run it since 5.12).
#[inline(always)]
fn fetch_increment(at: *mut u64) -> u64 {
    let mut value: u64 = 1;
    // SAFETY: `at` points to an aligned 8-byte map value; the instruction reads and writes
    // only there, and leaves the old value in the register it added from.
    unsafe {
        core::arch::asm!(
            "{value} = atomic_fetch_add((u64 *)({at} + 0), {value})",
            at = in(reg) at,
            value = inout(reg) value,
            options(nostack),
        );
    }
    value
}

/// Writes into `key` the original direction's key of the flow whose reply entry is `reply`:
/// the client's address and port (`nat_*`) to the service's (`addr`, `port_be`).
#[inline(always)]
pub(super) fn original_key_of(key: &mut CtKey, reply: &CtValue, protocol: u8) {
    copy_addr(&mut key.src, &reply.nat_addr);
    copy_addr(&mut key.dst, &reply.addr);
    key.src_port_be = reply.nat_port_be;
    key.dst_port_be = reply.port_be;
    key.protocol = protocol;
    key.direction = CT_ORIGINAL;
    key._pad = [0; 2];
}

/// Whether the flow whose reply entry `held` holds masquerade port `port_be` has ended at both
/// ends, both directions idle for `SNAT_PORT_REUSE_IDLE`: an RST either way, or a FIN each
/// way (one FIN is a half-close: the other side may still send). Its original direction is
/// looked up from what the reply entry restores (the client and the address it sent to); a
/// client whose entry is gone, or now serves a newer flow from the same port, has left this
/// one. Without this, a closed flow's port stayed `CT_TIMEOUT_CLOSING` (10 s), which at a few
/// thousand connections a second to one backend is more ports than the ranges have; and a
/// flow its client reset held its port for `CT_TIMEOUT_TCP`, the backend sending nothing more.
#[inline(always)]
fn ended(s: &mut LbScratch, held: &CtValue, port_be: [u8; 2], now: u32) -> bool {
    if now.wrapping_sub(held.last_seen) < SNAT_PORT_REUSE_IDLE {
        return false;
    }
    original_key_of(&mut s.holder, held, s.flow.protocol);
    // SAFETY: read within this program run.
    let Some(original) = (unsafe { LB_CT.get(&s.holder) }) else {
        return true;
    };
    if original.nat_port_be != port_be || original.addr != s.reply.src {
        return true;
    }
    if now.wrapping_sub(original.last_seen) < SNAT_PORT_REUSE_IDLE {
        return false;
    }
    (held.flags | original.flags) & CT_RESET != 0 || held.flags & original.flags & CT_CLOSING != 0
}
