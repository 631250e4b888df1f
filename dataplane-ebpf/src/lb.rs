//! Service load-balancing (replacing kube-proxy) for traffic leaving pods.
//!
//! A packet to a service port is sent to one backend: the one its tracked flow already uses, or
//! for a new flow the client's affine backend (ClientIP affinity) or the service's Maglev table
//! at the flow's hash. The destination is rewritten there (DNAT) and the overlay stage then
//! delivers the packet to the backend's pod, on this node or through Geneve. Replies are given
//! the service address back (reverse NAT) wherever they reach the client's node: leaving a
//! local backend pod (tc on its veth) or decapsulated from the underlay (tc on the NIC).
//!
//! Per packet: one conntrack lookup for replies, else one service lookup, one conntrack lookup
//! and, for a new flow, one table and one backend lookup. Nothing scans a list. Timestamps in
//! the maps are refreshed in place at most once per clock second, so a busy flow or client
//! costs no map update per packet.

// Keys are passed to the map helpers by reference on purpose: by value they would be copied
// to the BPF stack, which the per-CPU working set is there to spare.
#![expect(
    clippy::needless_borrows_for_generic_args,
    reason = "keys stay in the per-CPU working set"
)]

use aya_ebpf::{
    bindings::{__sk_buff, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_NOEXIST},
    programs::TcContext,
};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    frag::FRAG_LATER,
    lb::{
        BACKEND_PORTS_BASE, Backend, CT_AFFINITY, CT_CLOSING, CT_ESTABLISHED, CT_NODEPORT,
        CT_ORIGINAL, CT_REPLY, CT_RESET, CT_SNAT, CT_TIMEOUT_CLOSING, CT_TIMEOUT_OPENING,
        CT_TIMEOUT_OTHER, CT_TIMEOUT_SCTP, CT_TIMEOUT_TCP, CtKey, CtValue, HAIRPIN_V4, HAIRPIN_V6,
        MAGLEV_TABLE_SIZE, NODEPORT_ANY_V4, SCOPE_CLUSTER, SCOPE_EXTERNAL, SCOPE_NODEPORT,
        SERVICE_PORTS_BASE, SNAT_LOW_PORT_MAX, SNAT_LOW_PORT_MIN, SNAT_PORT_MAX, SNAT_PORT_MIN,
        SNAT_PORT_REUSE_IDLE, ServiceValue, backend_slot, flow_hash, maglev_slot,
        sctp::port_rewrite_delta,
    },
    overlay::{Addr, OVERLAY_HAS_IPV4, OVERLAY_HAS_IPV6, OverlayConfig},
};

use crate::lookup;
use crate::parse::{ETH_LEN, ETH_P_IP, ETH_P_IPV6};
use crate::{
    clock::now,
    copy::{copy_addr, copy_bytes, set_ipv4_mapped},
    csum::{addr_diff, csum_add, fold, store_checksum, sum_words, updated, write_ipv4},
    frag, icmp,
    maps::{
        LB_AFFINITY, LB_BACKENDS, LB_CT, LB_MAGLEV, LB_MEMBERS, LB_SCRATCH, LB_SERVICES,
        LB_SNAT_NEXT, LOCAL_PODS,
    },
    overlay,
    parse::{
        IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, load_bytes,
        read_addresses,
    },
    stage::Stage,
    stats::{count_drop, count_outcome},
    work::{LbScratch, Parsed},
};

pub mod cache;
pub mod xdp;

/// SCTP chunk types that open and end an association (RFC 9260, 3.2).
const SCTP_INIT: u8 = 1;
const SCTP_ABORT: u8 = 6;
const SCTP_SHUTDOWN_COMPLETE: u8 = 14;
const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
/// Source ports tried for a masqueraded NodePort flow before giving up (in turn: sixteen
/// ports in a row all held by live flows means the ranges are nearly full).
const SNAT_PORT_ATTEMPTS: u32 = 16;
/// Deepest transport header the rewrite writes in place (a mask: one less than a power of two).
const MAX_DIRECT_L4: usize = 0xFF;
/// Deepest transport checksum field read and written in place (a mask, covering TCP's at
/// `MAX_DIRECT_L4 + 16`).
const MAX_DIRECT_CHECK: usize = 0x1FF;
/// What a UDP checksum that computes to zero is sent as (zero means "no checksum").
const CSUM_MANGLED_0: u16 = 0xFFFF;

/// The backend `id` if it is still live (its slot not emptied or reused since).
#[inline(always)]
pub fn live_backend(id: u32) -> Option<&'static Backend> {
    LB_BACKENDS
        .get(backend_slot(id))
        .filter(|backend| backend.is_live(id))
}

/// This CPU's working set.
#[inline(always)]
fn scratch() -> Option<&'static mut LbScratch> {
    let s = LB_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: per-CPU map memory, used by one program run at a time on this CPU.
    Some(unsafe { &mut *s })
}

/// Reads the flow of a TCP, UDP or SCTP packet of an untagged frame into `s.flow`; false for
/// anything else.
#[inline(always)]
fn read_flow(ctx: &TcContext, parsed: &Parsed, s: &mut LbScratch) -> bool {
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
fn opening(s: &LbScratch) -> bool {
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
fn expired(entry: &CtValue, protocol: u8, now: u32) -> bool {
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
fn touch(entry: &mut CtValue, tcp_flags: u8, now: u32) {
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

/// The tc stage for a packet leaving a pod: reverse NAT of a local backend's reply, or DNAT of
/// a packet to a service port. `Ok(None)`: not service traffic.
///
/// The stage's value is 0 when the packet continues (rewritten or not) and `verdict + 1` when
/// the load-balancer has routed it out itself. A service without endpoints or a TCP flow
/// whose backend is gone is the drop `LbNoEndpoints` or `LbBackendGone`, which the caller
/// answers with [`answer`].
#[inline(never)]
pub fn from_pod(ctx: &TcContext, parsed: &Parsed) -> Stage {
    let s = match unreplied_flow(ctx, parsed) {
        Ok(s) => s,
        Err(done) => return done,
    };
    dnat_stage(dnat::<false>(ctx, parsed, s, SCOPE_CLUSTER))
}

/// The stage on a pod veth's egress (`tc_to_pod`): reverse NAT of the replies of service
/// flows whose backend is this node itself (a host-network endpoint, such as the API server
/// behind the `kubernetes` Service): the node's stack sends those straight to the pod, past
/// every other place replies are translated. Values as for [`from_pod`]; nothing else done.
#[inline(never)]
pub fn to_pod(ctx: &TcContext, parsed: &Parsed) -> Stage {
    match unreplied_flow(ctx, parsed) {
        Ok(_) => Stage::new(Ok(None)),
        Err(done) => done,
    }
}

/// The tc stage on the underlay NIC: reverse NAT of replies from remote backends (XDP has
/// already decapsulated them) and of NodePort replies, and DNAT of NodePort packets to this
/// node's own addresses. Values as for [`from_pod`]; a DNAT'd packet continues to the overlay
/// stage, which delivers it to its backend here or on another node.
#[inline(never)]
pub fn from_underlay(ctx: &TcContext, parsed: &Parsed) -> Stage {
    let s = match unreplied_flow(ctx, parsed) {
        Ok(s) => s,
        Err(done) => return done,
    };
    let Some(config) = lookup::overlay_config() else {
        return Stage::new(Ok(None));
    };
    let mut scope = outside_scope(config, s);
    // A hybrid node's pod reaches cluster services through the node its VXLAN came to (the
    // replies come back here: masqueraded when the backend is elsewhere, as for a NodePort).
    // Looked up only for a service port: other packets pay nothing for it.
    if scope == SCOPE_EXTERNAL
        && lookup::port_marked(SERVICE_PORTS_BASE, s.flow.dst_port_be)
        && lookup::is_hybrid_pod(parsed.ether_type, &s.flow.src)
    {
        scope = SCOPE_CLUSTER;
    }
    s.nodeport = 1;
    dnat_stage(dnat::<true>(ctx, parsed, s, scope))
}

/// The DNAT result as the stage's outcome.
#[inline(always)]
fn dnat_stage(result: Result<Option<PacketClass>, DropReason>) -> Stage {
    Stage::new(result.map(|done| done.map(|class| (0, class))))
}

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

/// The scope of a packet from outside, with `s.node_addr` set to this node's address of its
/// family: to that address, a NodePort; to another, an external or load-balancer IP routed
/// to this node.
#[inline(always)]
fn outside_scope(config: &OverlayConfig, s: &mut LbScratch) -> u8 {
    let has_address = if s.ipv4 != 0 {
        set_ipv4_mapped(&mut s.node_addr, config.node_ipv4);
        config.flags & OVERLAY_HAS_IPV4 != 0
    } else {
        copy_addr(&mut s.node_addr, &config.node_ipv6);
        config.flags & OVERLAY_HAS_IPV6 != 0
    };
    if has_address && s.flow.dst == s.node_addr {
        SCOPE_NODEPORT
    } else {
        SCOPE_EXTERNAL
    }
}

/// `s.service`: the key of the service port the flow is addressed to in `scope` (NodePorts
/// are keyed by port alone).
#[inline(always)]
fn set_service_key(s: &mut LbScratch, scope: u8) {
    let addr = if scope != SCOPE_NODEPORT {
        &s.flow.dst
    } else if s.ipv4 != 0 {
        &NODEPORT_ANY_V4
    } else {
        &[0; 16]
    };
    copy_addr(&mut s.service.addr, addr);
    s.service.port_be = s.flow.dst_port_be;
    s.service.protocol = s.flow.protocol;
    s.service.scope = scope;
}

/// The packet's flow in this CPU's working set, or the finished stage when the load-balancer
/// has nothing more to do: not TCP or UDP, or a reply that reverse NAT has just translated.
#[inline(always)]
fn unreplied_flow(ctx: &TcContext, parsed: &Parsed) -> Result<&'static mut LbScratch, Stage> {
    let s = scratch().ok_or(Stage::new(Ok(None)))?;
    if !read_flow(ctx, parsed, s) {
        return Err(Stage::new(Ok(None)));
    }
    match replied(ctx, parsed, s) {
        Some(done) => Err(done),
        None => Ok(s),
    }
}

/// The reverse-NAT outcome as a finished stage, or `None` when the packet is no reply.
#[inline(always)]
fn replied(ctx: &TcContext, parsed: &Parsed, s: &mut LbScratch) -> Option<Stage> {
    match reverse_nat(ctx, parsed, s).into_value() {
        Ok(0) => None,
        Ok(1) => Some(Stage::new(Ok(Some((0, PacketClass::ServiceReverseNat))))),
        // Routed out by us: `verdict + 2` becomes the stage's `verdict + 1`.
        Ok(routed) => Some(Stage::new(Ok(Some((
            routed - 1,
            PacketClass::ServiceReverseNat,
        ))))),
        Err(reason) => Some(Stage::new(Err(reason))),
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

#[inline(always)]
fn dnat<const FROM_OUTSIDE: bool>(
    ctx: &TcContext,
    parsed: &Parsed,
    s: &mut LbScratch,
    scope: u8,
) -> Result<Option<PacketClass>, DropReason> {
    if !lookup::port_marked(SERVICE_PORTS_BASE, s.flow.dst_port_be) {
        return Ok(None);
    }
    let now = now();
    // An established flow first: it needs no service lookup (its entry holds all it needs),
    // and keeps its backend even while its service changes.
    if tracked_backend(s, now).into_value()? == 0 {
        set_service_key(s, scope);
        // SAFETY: the value is copied out at once.
        let Some(service) = (unsafe { LB_SERVICES.get(&s.service) }).copied() else {
            return Ok(None);
        };
        // Only a connection's opening is given a backend and entries: a stray segment (or a
        // flood of spoofed ones) takes no room in the conntrack map and no masquerade port.
        // (A service without endpoints answers anything, as kube-proxy rejects it.)
        if service.backends != 0 && !opening(s) {
            return Err(DropReason::LbNotOpening);
        }
        new_flow::<FROM_OUTSIDE>(s, &service, now).into_value()?;
        if !FROM_OUTSIDE {
            // A pod's veth: the pod that opened it is known.
            crate::stats::count_pod_flow(crate::stats::device(ctx));
        }
    }
    copy_addr(&mut s.old_addr, &s.flow.dst);
    s.old_port = s.flow.dst_port_be;
    rewrite(ctx, parsed, s, Side::Destination).into_value()?;
    if s.snat != 0 {
        copy_addr(&mut s.old_addr, &s.flow.src);
        s.old_port = s.flow.src_port_be;
        copy_addr(&mut s.new_addr, &s.snat_addr);
        s.new_port = s.snat_port;
        rewrite(ctx, parsed, s, Side::Source).into_value()?;
    }
    s.cacheable = (s.snat == 0 && s.nodeport == 0) as u8;
    Ok(Some(PacketClass::ServiceDnat))
}

/// Gives a reply the service address and port its client sent to, if the flow is tracked.
#[inline(always)]
fn reverse_nat(ctx: &TcContext, parsed: &Parsed, s: &mut LbScratch) -> Stage {
    Stage::value(reverse_nat_flow(ctx, parsed, s))
}

#[inline(always)]
fn reverse_nat_flow(
    ctx: &TcContext,
    parsed: &Parsed,
    s: &mut LbScratch,
) -> Result<u32, DropReason> {
    // Only a backend's port can be the source of a reply.
    if !lookup::port_marked(BACKEND_PORTS_BASE, s.flow.src_port_be) {
        return Ok(0);
    }
    s.flow.direction = CT_REPLY;
    let Some(entry) = LB_CT.get_ptr_mut(&s.flow) else {
        return Ok(0);
    };
    // SAFETY: a valid map value pointer for this program run.
    let entry = unsafe { &mut *entry };
    let now = now();
    if expired(entry, s.flow.protocol, now) {
        return Ok(0);
    }
    touch(entry, s.tcp_flags, now);
    copy_addr(&mut s.old_addr, &s.flow.src);
    s.old_port = s.flow.src_port_be;
    copy_addr(&mut s.new_addr, &entry.addr);
    s.new_port = entry.port_be;
    rewrite(ctx, parsed, s, Side::Source).into_value()?;
    s.cacheable = (entry.flags & (CT_SNAT | CT_NODEPORT) == 0) as u8;
    s.backend_id = entry.backend_id;
    if entry.flags & CT_SNAT != 0 {
        // A hairpin reply: addressed to the masquerade address, it goes back to the client.
        copy_addr(&mut s.old_addr, &s.flow.dst);
        s.old_port = s.flow.dst_port_be;
        copy_addr(&mut s.new_addr, &entry.nat_addr);
        s.new_port = entry.nat_port_be;
        rewrite(ctx, parsed, s, Side::Destination).into_value()?;
    }
    if entry.flags & CT_NODEPORT != 0 {
        // Its source is now this node's address: the stack would refuse to forward it, so
        // it is routed out of the underlay here.
        let verdict = overlay::route_out(ctx, parsed).into_value()?;
        return Ok(verdict + 2);
    }
    Ok(1)
}

/// Whether the flow is tracked with a still valid backend (then in `s.new_addr/new_port`):
/// not expired, not a new TCP connection reusing the ports of a closed one, and its backend
/// still present. A TCP flow whose backend went away is ended (`LbBackendGone`: the client
/// gets a reset); other protocols fall through to a fresh choice.
#[inline(always)]
fn tracked_backend(s: &mut LbScratch, now: u32) -> Stage {
    Stage::value(tracked(s, now).map(u32::from))
}

#[inline(always)]
fn tracked(s: &mut LbScratch, now: u32) -> Result<bool, DropReason> {
    s.flow.direction = CT_ORIGINAL;
    let Some(entry) = LB_CT.get_ptr_mut(&s.flow) else {
        return Ok(false);
    };
    // SAFETY: a valid map value pointer for this program run.
    let entry = unsafe { &mut *entry };
    let reopened = s.tcp_flags & TCP_SYN != 0 && entry.flags & CT_CLOSING != 0;
    if expired(entry, s.flow.protocol, now) || reopened {
        return Ok(false);
    }
    if live_backend(entry.backend_id).is_none() {
        if s.flow.protocol == IPPROTO_TCP {
            return Err(DropReason::LbBackendGone);
        }
        return Ok(false);
    }
    touch(entry, s.tcp_flags, now);
    if entry.flags & CT_AFFINITY != 0 {
        refresh_affinity(s, entry.service_id, entry.backend_id, now);
    }
    copy_addr(&mut s.new_addr, &entry.addr);
    s.new_port = entry.port_be;
    s.backend_id = entry.backend_id;
    if entry.flags & CT_SNAT != 0 {
        s.snat = 1;
        copy_addr(&mut s.snat_addr, &entry.nat_addr);
        s.snat_port = entry.nat_port_be;
    }
    Ok(true)
}

/// Restarts a client's affinity timer from this packet (established flows count too).
#[inline(always)]
fn refresh_affinity(s: &mut LbScratch, service_id: u32, backend_id: u32, now: u32) {
    copy_addr(&mut s.affinity.client, &s.flow.src);
    s.affinity.service_id = service_id;
    if let Some(entry) = LB_AFFINITY.get_ptr_mut(&s.affinity) {
        // SAFETY: a valid map value pointer; only the clock is written, and only when it moved.
        unsafe {
            if (*entry).backend_id == backend_id && (*entry).last_seen != now {
                (*entry).last_seen = now;
            }
        }
    }
}

/// Chooses the backend of a new flow (into `s.new_addr/new_port`) and records the flow in
/// both directions.
#[inline(never)]
fn new_flow<const FROM_OUTSIDE: bool>(
    s: &mut LbScratch,
    service: &ServiceValue,
    now: u32,
) -> Stage {
    Stage::value(choose_backend::<FROM_OUTSIDE>(s, service, now).map(|()| 0))
}

/// `FROM_OUTSIDE`: the underlay's stage (NodePorts, external IPs), the only one whose flows
/// may be masqueraded to another node; the pods' programs are built without the port claim,
/// which the verifier would otherwise walk through all its attempts in them too.
#[inline(always)]
fn choose_backend<const FROM_OUTSIDE: bool>(
    s: &mut LbScratch,
    service: &ServiceValue,
    now: u32,
) -> Result<(), DropReason> {
    if service.backends == 0 {
        return Err(DropReason::LbNoEndpoints);
    }
    let backend_id = match affine_backend(s, service, now) {
        Some(id) => id,
        None => {
            let id = maglev_backend(s, service).into_value()?;
            if service.affinity_timeout != 0 {
                s.affinity_entry.backend_id = id;
                s.affinity_entry.last_seen = now;
                // A full LRU map evicts its oldest entry; an insert cannot fail otherwise.
                let _ = LB_AFFINITY.insert(&s.affinity, &s.affinity_entry, 0);
            }
            id
        }
    };
    let backend = live_backend(backend_id).ok_or(DropReason::LbNoEndpoints)?;
    copy_addr(&mut s.new_addr, &backend.addr);
    s.new_port = backend.port_be;
    s.backend_id = backend_id;
    // A pod reaching itself through its service (hairpin): its own address as the source
    // would make the pod drop the packet and answer itself locally, so the source becomes
    // the masquerade address and the replies come back here to be translated.
    let hairpin = s.new_addr == s.flow.src;
    // A NodePort packet for a backend on another node leaves with this node's address as its
    // source, so the reply comes back here to be translated (the client's address is kept
    // when the backend is local, and always with externalTrafficPolicy Local, whose table
    // holds local backends only).
    // SAFETY: only presence is checked.
    let remote =
        FROM_OUTSIDE && s.nodeport != 0 && unsafe { LOCAL_PODS.get(&s.new_addr) }.is_none();
    if hairpin {
        s.snat = 1;
        if s.ipv4 != 0 {
            set_ipv4_mapped(&mut s.snat_addr, HAIRPIN_V4);
        } else {
            copy_addr(&mut s.snat_addr, &HAIRPIN_V6);
        }
    } else if remote {
        s.snat = 1;
        copy_addr(&mut s.snat_addr, &s.node_addr);
    } else {
        copy_addr(&mut s.snat_addr, &[0; 16]);
    }
    let flags = if s.snat != 0 { CT_SNAT } else { 0 };
    let reply_flags = if s.nodeport != 0 {
        flags | CT_NODEPORT
    } else {
        flags
    };

    let reply_entry = &mut s.reply_entry;
    copy_addr(&mut reply_entry.addr, &s.flow.dst);
    reply_entry.port_be = s.flow.dst_port_be;
    reply_entry.flags = reply_flags;
    reply_entry._pad = 0;
    reply_entry.backend_id = backend_id;
    reply_entry.service_id = service.id;
    reply_entry.last_seen = now;
    copy_addr(&mut reply_entry.nat_addr, &s.flow.src);
    reply_entry.nat_port_be = s.flow.src_port_be;
    reply_entry._pad2 = [0; 2];
    // The source port the translated packets leave with: the client's own, unless the flow is
    // masqueraded to this node's address; then one of the reserved range that no other flow to
    // the same backend holds, claimed by inserting the reply entry, so two CPUs never hand
    // out the same one.
    let claimed = remote && !hairpin;
    s.snat_port = s.flow.src_port_be;
    if claimed {
        s.snat_port = (claim_snat_port(s).into_value()? as u16).to_be_bytes();
    }
    let original = &mut s.original_entry;
    copy_addr(&mut original.addr, &s.new_addr);
    original.port_be = s.new_port;
    original.flags = if service.affinity_timeout != 0 {
        flags | CT_AFFINITY
    } else {
        flags
    };
    original._pad = 0;
    original.backend_id = backend_id;
    original.service_id = service.id;
    original.last_seen = now;
    copy_addr(&mut original.nat_addr, &s.snat_addr);
    original.nat_port_be = s.snat_port;
    original._pad2 = [0; 2];
    s.flow.direction = CT_ORIGINAL;
    if !claimed {
        set_reply_key(s, s.snat_port);
        // The reply entry first: a reply can never arrive before its original is sent.
        let _ = LB_CT.insert(&s.reply, &s.reply_entry, 0);
    }
    let _ = LB_CT.insert(&s.flow, &s.original_entry, 0);
    Ok(())
}

/// `s.reply`: the reply direction of the new flow, from the backend to the client or, when
/// masqueraded, to `s.snat_addr` at `port`.
#[inline(always)]
fn set_reply_key(s: &mut LbScratch, port: [u8; 2]) {
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
fn claim_snat_port(s: &mut LbScratch) -> Stage {
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
    let holder = &mut s.holder;
    copy_addr(&mut holder.src, &held.nat_addr);
    copy_addr(&mut holder.dst, &held.addr);
    holder.src_port_be = held.nat_port_be;
    holder.dst_port_be = held.port_be;
    holder.protocol = s.flow.protocol;
    holder.direction = CT_ORIGINAL;
    holder._pad = [0; 2];
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

/// The client's affine backend, if it sent within the timeout and the backend still serves.
/// Leaves `s.affinity` keyed for this client either way.
#[inline(always)]
fn affine_backend(s: &mut LbScratch, service: &ServiceValue, now: u32) -> Option<u32> {
    if service.affinity_timeout == 0 {
        return None;
    }
    copy_addr(&mut s.affinity.client, &s.flow.src);
    s.affinity.service_id = service.id;
    let entry = LB_AFFINITY.get_ptr_mut(&s.affinity)?;
    // SAFETY: a valid map value pointer for this program run.
    let entry = unsafe { &mut *entry };
    if now.wrapping_sub(entry.last_seen) > service.affinity_timeout {
        return None;
    }
    live_backend(entry.backend_id)?;
    s.member.service_id = service.id;
    s.member.backend_id = entry.backend_id;
    LB_MEMBERS.get_ptr(&s.member)?;
    if entry.last_seen != now {
        entry.last_seen = now;
    }
    Some(entry.backend_id)
}

/// The Maglev table's backend for this flow's hash.
#[inline(never)]
fn maglev_backend(s: &LbScratch, service: &ServiceValue) -> Stage {
    Stage::value(maglev_lookup(s, service))
}

#[inline(always)]
fn maglev_lookup(s: &LbScratch, service: &ServiceValue) -> Result<u32, DropReason> {
    // SAFETY: the table is read before this program run ends; updates replace whole tables
    // under another index, never this one in place.
    let table = unsafe { LB_MAGLEV.get(&service.table) }.ok_or(DropReason::LbNoEndpoints)?;
    // After the lookup: its call would have every word of the hash's input spilled.
    let hash = flow_hash(&s.flow);
    // The verifier cannot bound a modulo that the compiler turned into multiplications: read
    // the slot back through a volatile load so the bounds check below stays in the program.
    let slot = maglev_slot(hash);
    // SAFETY: reading a local variable.
    let slot = unsafe { core::ptr::read_volatile(&slot) };
    if slot >= MAGLEV_TABLE_SIZE {
        return Err(DropReason::LbNoEndpoints);
    }
    Ok(table[slot])
}

/// Which address and port a rewrite replaces. Crosses the global BPF functions as its `u32`.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
enum Side {
    Source = 0,
    Destination = 1,
}

impl Side {
    /// How a rewrite of this side is counted: a destination rewritten is a DNAT (towards a
    /// backend), a source rewritten a reply's reverse NAT.
    #[inline(always)]
    fn translation(self) -> PacketClass {
        match self {
            Side::Destination => PacketClass::ServiceDnat,
            Side::Source => PacketClass::ServiceReverseNat,
        }
    }

    #[inline(always)]
    fn from_raw(raw: u32) -> Self {
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
fn rewrite(ctx: &TcContext, parsed: &Parsed, s: &mut LbScratch, side: Side) -> Stage {
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
fn translate(
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
fn follow_transport_checksum(
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
/// The value: 0 untouched, 1 translated, `verdict + 2` translated and routed out.
#[inline(never)]
pub fn icmp_error_reverse_nat(ctx: &TcContext, parsed: &Parsed) -> Stage {
    Stage::value(match translate_icmp_error(ctx, parsed) {
        Ok(Translated::No) => Ok(0),
        Ok(Translated::Yes) => Ok(1),
        Ok(Translated::RouteOut) => overlay::route_out(ctx, parsed)
            .into_value()
            .map(|verdict| verdict + 2),
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

/// The one's-complement difference from `s.old_addr` to `s.new_addr` (the last four bytes for
/// IPv4).
#[inline(always)]
fn address_diff(s: &LbScratch) -> u32 {
    // SAFETY: both lie 4-aligned in the working set (asserted with its layout).
    unsafe { addr_diff(&s.old_addr, &s.new_addr, s.ipv4 != 0, 0) }
}

/// The IPv4 address of an IPv4-mapped one.
#[inline(always)]
fn v4_of(addr: &Addr) -> [u8; 4] {
    [addr[12], addr[13], addr[14], addr[15]]
}
