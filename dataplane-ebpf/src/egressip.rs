//! Egress IPs: a selected pod's traffic to outside the cluster leaves from the node holding one
//! of its EgressIP's addresses, with that address as its source.
//!
//! On the pod's node (`tc_from_pod_egress`, after policy and the overlay found no pod to
//! deliver to): the flow's address is chosen once by its hash and pinned, so a flow keeps its
//! source while that address is held anywhere; the packet is translated here when this node
//! holds the address, or carried through Geneve to the node that does. On the holder
//! (`tc_underlay_egress`, after the load-balancer): other nodes' decapsulated egress traffic is
//! translated; replies to a held address are translated back and delivered like any pod
//! traffic (here, or through Geneve); anything else sent to a held address is dropped, so the
//! node's own sockets never answer on it. XDP answers ARP and neighbour solicitations for
//! held addresses, or tc where the underlay drops what XDP sends back out.
//!
//! ICMP and ICMPv6 echo requests are translated too, their identifier standing for the
//! source port; an error a router sends back about a translated flow (fragmentation needed,
//! unreachable) reaches the pod with its own address and port in the quoted packet.
//!
//! A selected pod's packet is never sent with its own address: no address assigned, an
//! address held by no programmed node, or a protocol without ports or identifier, and it is
//! dropped with its reason counted.

// Keys are passed to the map helpers by reference on purpose: by value they would be copied
// to the BPF stack.
#![expect(
    clippy::needless_borrows_for_generic_args,
    reason = "keys stay in per-CPU memory"
)]

use aya_ebpf::{
    bindings::{BPF_NOEXIST, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, xdp_action},
    helpers::{
        bpf_get_hash_recalc, bpf_redirect, bpf_redirect_neigh, bpf_skb_change_tail,
        bpf_xdp_adjust_tail,
    },
    macros::classifier,
    programs::{TcContext, XdpContext},
};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    egressip::{
        EGRESS_CT_CHOSEN, EGRESS_CT_IN, EGRESS_CT_OUT, EGRESS_HELD_HERE, EGRESS_PORT_MAX,
        EGRESS_PORT_MIN, EgressHolder, MAX_EGRESS_IPS_PER_POD,
    },
    overlay::{Addr, OVERLAY_XDP_FORWARD},
};

use crate::lookup;
use crate::parse::ETH_LEN;
use crate::{
    copy::{copy_addr, copy_bytes},
    lb,
    maps::{
        EGRESS_CT, EGRESS_INTERNAL, EGRESS_IPS, EGRESS_PODS, EGRESS_SCRATCH, EGRESS_SNAT, PARSED,
    },
    overlay,
    parse::{
        ETH_P_ARP, ETH_P_IP, ETH_P_IPV6, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP,
        read_addresses,
    },
    stats::{count_drop, count_outcome},
    work::{EgressWork, Parsed},
};

/// Ports tried on the egress address for a new flow: its own, then spread over the range.
const PORT_ATTEMPTS: u32 = 4;

/// `EgressWork::icmp`: no ICMP message, or one that is neither an echo nor its reply (an
/// error, when it arrives for a held address).
const ICMP_OTHER: u8 = 0;
/// `EgressWork::icmp`: an echo request; its identifier is read as the source port.
const ICMP_ECHO_REQUEST: u8 = 1;
/// `EgressWork::icmp`: an echo reply; its identifier is read as the destination port.
const ICMP_ECHO_REPLY: u8 = 2;

#[classifier]
pub fn tc_from_pod_egress(ctx: TcContext) -> i32 {
    let Some(parsed) = PARSED.get(0) else {
        count_drop(Hook::FromPod, DropReason::ScratchUnavailable);
        return TC_ACT_SHOT;
    };
    finish(Hook::FromPod, from_pod(&ctx, parsed))
}

#[classifier]
pub fn tc_underlay_egress(ctx: TcContext) -> i32 {
    let Some(parsed) = PARSED.get(0) else {
        return TC_ACT_OK;
    };
    finish(Hook::UnderlayTc, from_underlay(&ctx, parsed))
}

/// Counts what a stage did and returns its verdict.
#[inline(always)]
fn finish(hook: Hook, done: Result<(i32, Option<PacketClass>), DropReason>) -> i32 {
    match done {
        Ok((verdict, outcome)) => {
            if let Some(outcome) = outcome {
                count_outcome(hook, outcome);
            }
            verdict
        }
        Err(reason) => {
            count_drop(hook, reason);
            TC_ACT_SHOT
        }
    }
}

/// This CPU's working set.
#[inline(always)]
fn work() -> Result<&'static mut EgressWork, DropReason> {
    let w = EGRESS_SCRATCH
        .get_ptr_mut(0)
        .ok_or(DropReason::ScratchUnavailable)?;
    // SAFETY: this CPU's slot, used within this program run only.
    Ok(unsafe { &mut *w })
}

/// Fills `w.flow` with the packet's addresses, ports and protocol; false when it is no
/// untagged IP packet with its header in the linear data.
#[inline(always)]
fn read_flow(ctx: &TcContext, parsed: &Parsed, w: &mut EgressWork) -> bool {
    if parsed.l3_offset != ETH_LEN {
        return false;
    }
    let ipv4 = parsed.ether_type == ETH_P_IP;
    if !read_addresses(ctx, ipv4, &mut w.flow.src, &mut w.flow.dst) {
        return false;
    }
    w.flow.src_port_be = parsed.src_port;
    w.flow.dst_port_be = parsed.dst_port;
    w.flow.protocol = parsed.protocol;
    w.ipv4 = ipv4 as u8;
    w.icmp = ICMP_OTHER;
    if parsed.protocol == IPPROTO_ICMP || parsed.protocol == IPPROTO_ICMPV6 {
        read_echo(ctx, parsed, w);
    }
    true
}

/// For an ICMP or ICMPv6 echo or echo reply: its kind in `w.icmp`, and its identifier as the
/// port of the side that asked (the source of a request, the destination of a reply), so an
/// exchange is tracked and translated as a flow with one port.
#[inline(always)]
fn read_echo(ctx: &TcContext, parsed: &Parsed, w: &mut EgressWork) {
    if parsed.l4_offset == 0 {
        return;
    }
    let Ok(header) = ctx.load::<[u8; 6]>(parsed.l4_offset) else {
        return;
    };
    let (request, reply) = if parsed.protocol == IPPROTO_ICMP {
        (8, 0)
    } else {
        (128, 129)
    };
    let id = [header[4], header[5]];
    if header[0] == request {
        w.icmp = ICMP_ECHO_REQUEST;
        w.flow.src_port_be = id;
        w.flow.dst_port_be = [0; 2];
    } else if header[0] == reply {
        w.icmp = ICMP_ECHO_REPLY;
        w.flow.src_port_be = [0; 2];
        w.flow.dst_port_be = id;
    }
}

/// Whether a packet leaving for outside can be translated: TCP and UDP by their source port,
/// an echo request by its identifier.
#[inline(always)]
fn translatable_out(w: &EgressWork) -> bool {
    w.flow.protocol == IPPROTO_TCP || w.flow.protocol == IPPROTO_UDP || w.icmp == ICMP_ECHO_REQUEST
}

/// Whether the flow's destination lies inside the cluster (a cluster or service network, a
/// node address) or never leaves the link (link-local, multicast): not egress.
#[inline(always)]
fn internal(w: &mut EgressWork) -> bool {
    w.lpm.prefix_len = 128;
    copy_addr(&mut w.lpm.data, &w.flow.dst);
    EGRESS_INTERNAL.get(&w.lpm).is_some()
}

/// A pod's packet on its own node.
#[inline(always)]
fn from_pod(ctx: &TcContext, parsed: &Parsed) -> Result<(i32, Option<PacketClass>), DropReason> {
    let w = work()?;
    if !read_flow(ctx, parsed, w) {
        return Ok((TC_ACT_OK, None));
    }
    // SAFETY: read before this program run ends; the agent replaces values whole.
    let Some(pod) = (unsafe { EGRESS_PODS.get(&w.flow.src) }) else {
        return Ok((TC_ACT_OK, None));
    };
    if internal(w) {
        return Ok((TC_ACT_OK, None));
    }
    if !translatable_out(w) {
        return Err(DropReason::EgressIpProtocol);
    }
    // The flow's pinned address, as long as some node holds it; else one chosen by its hash.
    w.flow.direction = EGRESS_CT_CHOSEN;
    // SAFETY: map values stay valid under RCU for the program's run; only read.
    let pinned = match unsafe { EGRESS_CT.get(&w.flow) } {
        // SAFETY: only presence is checked.
        Some(chosen) if unsafe { EGRESS_IPS.get(&chosen.addr) }.is_some() => {
            copy_addr(&mut w.egress, &chosen.addr);
            true
        }
        _ => false,
    };
    if !pinned {
        let count = pod.count as usize;
        if count == 0 {
            return Err(DropReason::EgressIpUnassigned);
        }
        // SAFETY: plain helper call on our own context.
        let hash = unsafe { bpf_get_hash_recalc(ctx.skb.skb) } as usize;
        let index = hash % count.min(MAX_EGRESS_IPS_PER_POD);
        // Read back opaquely: the compiler knows the bound and would drop the check the
        // verifier needs to bound the offset.
        // SAFETY: a volatile read of a local.
        let index = unsafe { core::ptr::read_volatile(&index) };
        let Some(chosen) = pod.ips.get(index) else {
            return Err(DropReason::EgressIpUnassigned);
        };
        copy_addr(&mut w.egress, chosen);
        copy_addr(&mut w.value.addr, chosen);
        // Best effort: without the pin the next packet chooses the same by the same hash.
        let _ = EGRESS_CT.insert(&w.flow, &w.value, 0);
    }
    // SAFETY: read before this program run ends.
    let Some(holder) = (unsafe { EGRESS_IPS.get(&w.egress) }) else {
        return Err(DropReason::EgressIpUnassigned);
    };
    if holder.flags & EGRESS_HELD_HERE != 0 {
        return translate_out(ctx, parsed, w);
    }
    reroute(ctx, parsed, holder)
}

/// Carries a pod's packet through Geneve to the node holding its egress address.
#[inline(always)]
fn reroute(
    ctx: &TcContext,
    parsed: &Parsed,
    holder: &EgressHolder,
) -> Result<(i32, Option<PacketClass>), DropReason> {
    let config = lookup::overlay_config().ok_or(DropReason::OverlayNoRoute)?;
    let hash = overlay::inner_flow_hash(ctx, parsed);
    let verdict = overlay::encapsulate(ctx, config, &holder.node, hash).into_value()? as i32;
    Ok((verdict, Some(PacketClass::EgressRerouted)))
}

/// What arrives on the underlay and the load-balancer left alone.
#[inline(always)]
fn from_underlay(
    ctx: &TcContext,
    parsed: &Parsed,
) -> Result<(i32, Option<PacketClass>), DropReason> {
    let w = work()?;
    if !read_flow(ctx, parsed, w) {
        return Ok((TC_ACT_OK, None));
    }
    // SAFETY: only the flags are read, before this program run ends.
    if let Some(held) = unsafe { EGRESS_IPS.get(&w.flow.dst) }
        && held.flags & EGRESS_HELD_HERE != 0
    {
        return translate_in(ctx, parsed, w);
    }
    // SAFETY: copied out at once.
    if let Some(egress) = unsafe { EGRESS_SNAT.get(&w.flow.src) } {
        copy_addr(&mut w.egress, egress);
        if internal(w) {
            return Ok((TC_ACT_OK, None));
        }
        if !translatable_out(w) {
            return Err(DropReason::EgressIpProtocol);
        }
        return translate_out(ctx, parsed, w);
    }
    // Another node's pod bound for outside, and this node does not translate for it: it
    // came here as egress traffic and must not leave as the pod.
    if lookup::remote_endpoint(parsed.ether_type, &w.flow.src).is_some() && !internal(w) {
        return Err(DropReason::EgressIpNotHere);
    }
    Ok((TC_ACT_OK, None))
}

/// Gives the packet the egress address `w.egress` (and a port free on it) as its source and
/// sends it out of the underlay.
#[inline(always)]
fn translate_out(
    ctx: &TcContext,
    parsed: &Parsed,
    w: &mut EgressWork,
) -> Result<(i32, Option<PacketClass>), DropReason> {
    w.flow.direction = EGRESS_CT_OUT;
    // SAFETY: copied out at once.
    let tracked = match unsafe { EGRESS_CT.get(&w.flow) } {
        Some(out) if out.addr == w.egress => {
            w.port = out.port_be;
            true
        }
        _ => false,
    };
    if !tracked {
        claim_port(w)?;
        copy_addr(&mut w.value.addr, &w.egress);
        w.value.port_be = w.port;
        EGRESS_CT
            .insert(&w.flow, &w.value, 0)
            .map_err(|_| DropReason::EgressIpPortsExhausted)?;
    }
    lb::rewrite_address(
        ctx,
        parsed,
        true,
        w.ipv4 != 0,
        &w.flow.src,
        &w.egress,
        w.flow.src_port_be,
        w.port,
    )?;
    send_out()?;
    Ok((TC_ACT_REDIRECT, Some(PacketClass::EgressSnat)))
}

/// Finds a source port free on `w.egress` towards the flow's destination and records the
/// reply direction under it: the flow's own port first, then ports of the range spread by the
/// flow. The address is no address of the node's, so only other translated flows compete.
#[inline(always)]
fn claim_port(w: &mut EgressWork) -> Result<(), DropReason> {
    copy_addr(&mut w.reply.src, &w.flow.dst);
    copy_addr(&mut w.reply.dst, &w.egress);
    w.reply.src_port_be = w.flow.dst_port_be;
    w.reply.protocol = w.flow.protocol;
    w.reply.direction = EGRESS_CT_IN;
    copy_addr(&mut w.value.addr, &w.flow.src);
    w.value.port_be = w.flow.src_port_be;
    let s = &w.flow.src;
    let seed = u32::from_ne_bytes([s[12], s[13], s[14], s[15]])
        ^ (u16::from_ne_bytes(w.flow.src_port_be) as u32) << 16;
    let seed = seed.wrapping_mul(0x9e37_79b1);
    const RANGE: u32 = (EGRESS_PORT_MAX - EGRESS_PORT_MIN) as u32 + 1;
    for attempt in 0..PORT_ATTEMPTS {
        let port = if attempt == 0 {
            w.flow.src_port_be
        } else {
            let offset = seed.wrapping_add(attempt.wrapping_mul(0x6a09_e667)) % RANGE;
            (EGRESS_PORT_MIN + offset as u16).to_be_bytes()
        };
        w.reply.dst_port_be = port;
        if EGRESS_CT
            .insert(&w.reply, &w.value, BPF_NOEXIST as u64)
            .is_ok()
        {
            w.port = port;
            return Ok(());
        }
    }
    Err(DropReason::EgressIpPortsExhausted)
}

/// A reply to an egress address held here: the pod's address and port back, then delivered
/// as the overlay delivers to pods (here, or through Geneve to the pod's node).
#[inline(always)]
fn translate_in(
    ctx: &TcContext,
    parsed: &Parsed,
    w: &mut EgressWork,
) -> Result<(i32, Option<PacketClass>), DropReason> {
    let icmp = w.flow.protocol == IPPROTO_ICMP || w.flow.protocol == IPPROTO_ICMPV6;
    if icmp && w.icmp != ICMP_ECHO_REPLY {
        return translate_error_in(ctx, parsed);
    }
    w.flow.direction = EGRESS_CT_IN;
    // SAFETY: copied out at once.
    let Some(pod) = (unsafe { EGRESS_CT.get(&w.flow) }) else {
        return Err(DropReason::EgressIpNoFlow);
    };
    copy_addr(&mut w.value.addr, &pod.addr);
    w.port = pod.port_be;
    lb::rewrite_address(
        ctx,
        parsed,
        false,
        w.ipv4 != 0,
        &w.flow.dst,
        &w.value.addr,
        w.flow.dst_port_be,
        w.port,
    )?;
    deliver_to_pod(ctx, parsed)
}

/// An ICMP or ICMPv6 message to an egress address held here that is no echo reply: an error
/// about a translated flow is translated back like its replies; anything else (an echo
/// request to the address, an error about no such flow) is dropped.
#[inline(always)]
fn translate_error_in(
    ctx: &TcContext,
    parsed: &Parsed,
) -> Result<(i32, Option<PacketClass>), DropReason> {
    let found = lb::untranslate_icmp_error(ctx, parsed, EGRESS_CT_IN, |flow, addr, port| {
        // SAFETY: copied out at once.
        match unsafe { EGRESS_CT.get(flow) } {
            Some(pod) => {
                copy_addr(addr, &pod.addr);
                *port = pod.port_be;
                true
            }
            None => false,
        }
    })?;
    if !found {
        return Err(DropReason::EgressIpNoFlow);
    }
    deliver_to_pod(ctx, parsed)
}

/// Delivers a packet translated back to its pod as the overlay delivers to pods (here, or
/// through Geneve to the pod's node).
#[inline(always)]
fn deliver_to_pod(
    ctx: &TcContext,
    parsed: &Parsed,
) -> Result<(i32, Option<PacketClass>), DropReason> {
    count_outcome(Hook::UnderlayTc, PacketClass::EgressReverseNat);
    match overlay::from_pod(ctx, parsed, false).result()? {
        Some((verdict, outcome)) => Ok((verdict as i32, Some(outcome))),
        // The pod is gone from the cluster's pod networks.
        None => Err(DropReason::EgressIpNoFlow),
    }
}

/// Sends a translated packet out of the underlay towards its destination's next hop (the
/// kernel resolves both). Its source is no address of this node, which the stack would not
/// forward from a pod's veth.
#[inline(always)]
fn send_out() -> Result<(), DropReason> {
    let config = lookup::overlay_config().ok_or(DropReason::OverlayNoRoute)?;
    // SAFETY: a null parameter block asks the kernel to do its own FIB lookup.
    let verdict =
        unsafe { bpf_redirect_neigh(config.underlay_ifindex, core::ptr::null_mut(), 0, 0) };
    if verdict != TC_ACT_REDIRECT as i64 {
        return Err(DropReason::EgressIpRewriteFailed);
    }
    Ok(())
}

/// A frame the neighbour answers are written into, in place: XDP's buffer, or a socket
/// buffer at tc (made linear first).
trait Frame {
    fn bounds(&self) -> (usize, usize);
    /// Makes the frame `len` bytes long; false when the kernel refused.
    fn set_len(&self, len: usize) -> bool;
}

impl Frame for XdpContext {
    fn bounds(&self) -> (usize, usize) {
        (self.data(), self.data_end())
    }

    fn set_len(&self, len: usize) -> bool {
        let delta = len as i32 - (self.data_end() - self.data()) as i32;
        // SAFETY: this program's own context; the caller re-checks the bounds after.
        delta == 0 || unsafe { bpf_xdp_adjust_tail(self.ctx, delta) } == 0
    }
}

impl Frame for TcContext {
    fn bounds(&self) -> (usize, usize) {
        (self.data(), self.data_end())
    }

    fn set_len(&self, len: usize) -> bool {
        // SAFETY: this program's own socket buffer; the caller re-checks the bounds after.
        let resized = unsafe { bpf_skb_change_tail(self.skb.skb, len as u32, 0) } == 0;
        resized && self.pull_data(len as u32).is_ok()
    }
}

/// XDP on the underlay: answers an ARP request or a neighbour solicitation for an egress
/// address held here (`answer_arp`, `answer_ns`) and sends the answer back out, where the
/// underlay takes frames from XDP (`OVERLAY_XDP_FORWARD`; a veth whose peer does not poll
/// drops them, and `tc_underlay_neighbour` answers there instead). `None`: not such a
/// request, or answered at tc.
#[inline(always)]
pub fn answer_in_xdp(ctx: &XdpContext, class: PacketClass) -> Option<u32> {
    if lookup::overlay_config().is_none_or(|c| c.flags & OVERLAY_XDP_FORWARD == 0) {
        return None;
    }
    let answered = match class {
        PacketClass::Arp => answer_arp(ctx, Hook::Underlay),
        _ => answer_ns(ctx, Hook::Underlay),
    };
    answered.then_some(xdp_action::XDP_TX)
}

/// Whether a frame at tc is a neighbour question `tc_underlay_neighbour` answers there: an
/// ARP request or an ICMPv6 neighbour solicitation (type 135 right after the IPv6 header),
/// on a node holding egress addresses. Where XDP sends frames back out it has answered the
/// questions for held addresses already; this answers them where it may not, and where the
/// uplink runs no XDP (`--uplink-hook tc`).
#[inline(always)]
pub fn answered_at_tc(ctx: &TcContext, class: PacketClass) -> bool {
    let asked = match class {
        PacketClass::Arp => true,
        PacketClass::Icmpv6 => {
            ctx.load::<u8>(ETH_LEN + 6).ok() == Some(IPPROTO_ICMPV6)
                && ctx.load::<u8>(ETH_LEN + 40).ok() == Some(135)
        }
        _ => false,
    };
    asked && lookup::egress_holder()
}

/// tc ingress on the underlay, where XDP may not send frames back out (`answered_at_tc`):
/// answers an ARP request or neighbour solicitation for an egress address held here, out of
/// the underlay again by redirect, which any peer takes. Anything else passes to the stack.
#[classifier]
pub fn tc_underlay_neighbour(ctx: TcContext) -> i32 {
    // The answers are written in place: the longest, an advertisement, made linear.
    if ctx.pull_data(NA_LEN as u32).is_err() && ctx.pull_data(ETH_LEN as u32 + 28).is_err() {
        return TC_ACT_OK;
    }
    let answered = answer_arp(&ctx, Hook::UnderlayTc) || answer_ns(&ctx, Hook::UnderlayTc);
    if !answered {
        return TC_ACT_OK;
    }
    // SAFETY: plain helper call; back out of the device the question came in by.
    unsafe { bpf_redirect((*ctx.skb.skb).ifindex, 0) as i32 }
}

/// Answers an ARP request for an egress address held here with the underlay's MAC, in place
/// (the node has no such address of its own, so nothing else answers). False: not such a
/// request.
#[inline(always)]
fn answer_arp(ctx: &impl Frame, hook: Hook) -> bool {
    const ARP_LEN: usize = 28;
    let (start, end) = ctx.bounds();
    if start + ETH_LEN + ARP_LEN > end {
        return false;
    }
    let frame = start as *mut [u8; ETH_LEN + ARP_LEN];
    // SAFETY: the 42 bytes were bounds-checked just above.
    let frame = unsafe { &mut *frame };
    // Untagged Ethernet/IPv4 ARP request.
    if u16::from_be_bytes([frame[12], frame[13]]) != ETH_P_ARP
        || frame[14..22] != [0, 1, 8, 0, 6, 4, 0, 1]
    {
        return false;
    }
    let Ok(w) = work() else {
        return false;
    };
    let mut target = [0u8; 4];
    target.copy_from_slice(&frame[38..42]);
    crate::copy::set_ipv4_mapped(&mut w.egress, target);
    // SAFETY: only the flags are read.
    let held = unsafe { EGRESS_IPS.get(&w.egress) };
    if held.is_none_or(|h| h.flags & EGRESS_HELD_HERE == 0) {
        return false;
    }
    let Some(config) = lookup::overlay_config() else {
        return false;
    };
    let mut sender = [0u8; 10];
    sender.copy_from_slice(&frame[22..32]);
    // Reply: to the requester, from the underlay's MAC, the target now the sender.
    frame[20..22].copy_from_slice(&[0, 2]);
    frame[32..42].copy_from_slice(&sender);
    frame[22..28].copy_from_slice(&config.underlay_mac);
    frame[28..32].copy_from_slice(&target);
    // SAFETY: within the checked frame.
    unsafe {
        copy_bytes::<6>(frame.as_mut_ptr(), sender.as_ptr());
        copy_bytes::<6>(frame[6..].as_mut_ptr(), config.underlay_mac.as_ptr());
    }
    count_outcome(hook, PacketClass::EgressArpAnswered);
    true
}

/// Ethernet, IPv6 and ICMPv6 neighbour solicitation up to its target (RFC 4861 4.3).
const NS_LEN: usize = ETH_LEN + 40 + 24;
/// The advertisement that answers it: with the target link-layer address option (4.4).
const NA_LEN: usize = ETH_LEN + 40 + 32;

/// Answers a neighbour solicitation for an egress address held here with a neighbour
/// advertisement carrying the underlay's MAC (solicited, override; to the solicitor, or to
/// all nodes when it is duplicate address detection from `::`), in place. False: not such a
/// solicitation (one behind extension headers is left to the stack, which ignores it).
#[inline(never)]
fn answer_ns(ctx: &impl Frame, hook: Hook) -> bool {
    let (start, end) = ctx.bounds();
    if start + NS_LEN > end {
        return false;
    }
    // SAFETY: the bytes were bounds-checked just above.
    let frame = unsafe { &mut *(start as *mut [u8; NS_LEN]) };
    // Untagged IPv6, ICMPv6 right after the header, hop limit 255, type 135 code 0.
    if u16::from_be_bytes([frame[12], frame[13]]) != ETH_P_IPV6
        || frame[20] != IPPROTO_ICMPV6
        || frame[21] != 255
        || frame[54] != 135
        || frame[55] != 0
    {
        return false;
    }
    let Ok(w) = work() else {
        return false;
    };
    w.egress.copy_from_slice(&frame[62..78]);
    // SAFETY: only the flags are read.
    let held = unsafe { EGRESS_IPS.get(&w.egress) };
    if held.is_none_or(|h| h.flags & EGRESS_HELD_HERE == 0) {
        return false;
    }
    let Some(config) = lookup::overlay_config() else {
        return false;
    };
    let mut solicitor_mac = [0u8; 6];
    solicitor_mac.copy_from_slice(&frame[6..12]);
    w.egress_peer.copy_from_slice(&frame[22..38]);
    let dad = w.egress_peer == [0u8; 16];
    if !ctx.set_len(NA_LEN) {
        return false;
    }
    let (start, end) = ctx.bounds();
    if start + NA_LEN > end {
        return false;
    }
    // SAFETY: bounds-checked just above.
    let frame = unsafe { &mut *(start as *mut [u8; NA_LEN]) };
    if dad {
        frame[0..6].copy_from_slice(&[0x33, 0x33, 0, 0, 0, 1]);
        w.egress_peer = ALL_NODES;
    } else {
        frame[0..6].copy_from_slice(&solicitor_mac);
    }
    frame[6..12].copy_from_slice(&config.underlay_mac);
    frame[14..22].copy_from_slice(&[0x60, 0, 0, 0, 0, 32, IPPROTO_ICMPV6, 255]);
    frame[22..38].copy_from_slice(&w.egress);
    frame[38..54].copy_from_slice(&w.egress_peer);
    // Solicited and override, unless it answers DAD (no solicitor to confirm to).
    let flags = if dad { 0x20 } else { 0x60 };
    frame[54..62].copy_from_slice(&[136, 0, 0, 0, flags, 0, 0, 0]);
    frame[62..78].copy_from_slice(&w.egress);
    frame[78] = 2;
    frame[79] = 1;
    frame[80..86].copy_from_slice(&config.underlay_mac);
    // Checksum over the pseudo-header (addresses, length 32, next header 58) and the message.
    let mut sum: u32 = 32 + IPPROTO_ICMPV6 as u32;
    let mut i = 22;
    while i < NA_LEN {
        sum += u32::from(u16::from_be_bytes([frame[i], frame[i + 1]]));
        i += 2;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    frame[56..58].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    count_outcome(hook, PacketClass::EgressArpAnswered);
    true
}

/// ff02::1, where an answer to duplicate address detection goes.
const ALL_NODES: Addr = [0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
