//! The node's underlay NIC. Where XDP runs on it (`--uplink-hook xdp`) every packet arriving
//! at the node passes XDP first: parse (malformed packets dropped with their reason), then
//! Geneve decapsulation for local pods, then the NodePort fast path for established flows
//! (`lb::xdp`).
//!
//! tc ingress on the same NIC then sees what XDP passed up, decapsulated frames included, as
//! socket buffers, and works with the kernel's checksum and encapsulation helpers: tunnel
//! packets XDP did not unwrap (all of them where no XDP runs, `--uplink-hook tc`) are unwrapped
//! by `tc_underlay_decap`, replies of remote service backends get their service address back,
//! and NodePort packets are translated and delivered to their backend, here or through Geneve
//! on another node.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT, xdp_action},
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    acl::SERVICE_REPLY_MARK,
    maps::{
        TAIL_UNDERLAY_DECAP, TAIL_UNDERLAY_EGRESS, TAIL_UNDERLAY_ICMP, TAIL_UNDERLAY_MULTICAST,
        TAIL_UNDERLAY_NEIGHBOUR, TAIL_UNDERLAY_SCTP,
    },
};

use crate::lookup;
use crate::{
    acl, egressip, frag, hybrid, lb,
    maps::{PARSED, TAILS},
    overlay,
    parse::{ETH_LEN, Packet, parse, parse_skb, stash},
    stage::{Stage, reverse_nat, routed_verdict},
    stats::{count_drop, count_malformed, count_outcome, count_packet},
    work::Parsed,
};

#[xdp]
pub fn xdp_underlay(ctx: XdpContext) -> u32 {
    let packet = Packet::new(ctx.data(), ctx.data_end(), ctx.data_end() - ctx.data());
    let parsed = match parse(&packet) {
        Ok(parsed) => parsed,
        Err(reason) => {
            count_malformed(Hook::Underlay, reason);
            return xdp_action::XDP_DROP;
        }
    };
    count_packet(Hook::Underlay, parsed.class);
    if matches!(parsed.class, PacketClass::Arp | PacketClass::Icmpv6)
        && lookup::egress_holder()
        && let Some(action) = egressip::answer_in_xdp(&ctx, parsed.class)
    {
        return action;
    }
    // The calls into decapsulation only for what looks like a tunnel to this node.
    if hybrid::vxlan_port(&parsed) {
        return unwrapped(&ctx, &parsed, hybrid::decapsulate(&ctx, &parsed));
    }
    if !overlay::geneve_port(&parsed) {
        return nodeport_fast_path(&ctx, &parsed);
    }
    unwrapped(&ctx, &parsed, overlay::decapsulate(&ctx, &parsed))
}

/// The verdict on a tunnel packet after its decapsulation stage: unwrapped (counted as the
/// stage says), dropped with its reason, or no tunnel of ours after all.
#[inline(always)]
fn unwrapped(ctx: &XdpContext, parsed: &Parsed, stage: Stage) -> u32 {
    match stage.result() {
        Ok(Some((action, outcome))) => {
            count_outcome(Hook::Underlay, outcome);
            // Handed straight to a pod of this node (`overlay::deliver_in_xdp`).
            if action == xdp_action::XDP_REDIRECT {
                count_outcome(Hook::Underlay, PacketClass::LocalRedirect);
            }
            action
        }
        Ok(None) => nodeport_fast_path(ctx, parsed),
        Err(reason) => {
            count_drop(Hook::Underlay, reason);
            xdp_action::XDP_DROP
        }
    }
}

/// Established NodePort flows translated and delivered in XDP (`lb::xdp`); everything else
/// passes up to `tc_underlay` untouched.
#[inline(always)]
fn nodeport_fast_path(ctx: &XdpContext, parsed: &Parsed) -> u32 {
    match lb::xdp::nodeport(ctx, parsed).result() {
        Ok(Some((action, outcome))) => {
            count_outcome(Hook::Underlay, PacketClass::ServiceDnat);
            if outcome == PacketClass::GeneveEncap {
                count_outcome(Hook::Underlay, PacketClass::GeneveEncap);
            }
            action
        }
        Ok(None) => xdp_action::XDP_PASS,
        Err(reason) => {
            count_drop(Hook::Underlay, reason);
            xdp_action::XDP_DROP
        }
    }
}

/// Hands the packet (and its parse) on to the program in `TAILS` slot `next`. If that fails
/// the packet passes as it is, as before those programs existed.
#[inline(always)]
fn hand_on(ctx: &TcContext, parsed: &Parsed, next: u32) -> i32 {
    if !stash(parsed) {
        return TC_ACT_OK;
    }
    // SAFETY: a tail call either does not return or returns having done nothing.
    unsafe { TAILS.tail_call(ctx, next) };
    count_drop(Hook::UnderlayTc, DropReason::TailCallFailed);
    TC_ACT_OK
}

/// After `tc_underlay` for ICMP and ICMPv6: an error a remote backend sent about a service flow
/// (decapsulated by XDP) is given the service's address back and passes as a reply of that
/// flow, so the client pod's ingress policy lets it in. Anything else goes on to the egress IP
/// stage where this node may hold egress addresses (echo replies and errors for translated
/// flows, other nodes' pods pinging outside).
#[classifier]
pub fn tc_underlay_icmp(ctx: TcContext) -> i32 {
    let Some(parsed) = PARSED.get(0) else {
        return TC_ACT_OK;
    };
    match lb::icmp_error_reverse_nat(&ctx, parsed).into_value() {
        Ok(reverse_nat::UNTOUCHED) if lookup::egress_holder() => {
            // SAFETY: a tail call either does not return or returns having done nothing.
            unsafe { TAILS.tail_call(&ctx, TAIL_UNDERLAY_EGRESS) };
            count_drop(Hook::UnderlayTc, DropReason::TailCallFailed);
            TC_ACT_OK
        }
        Ok(reverse_nat::UNTOUCHED) => TC_ACT_OK,
        Ok(reverse_nat::TRANSLATED) => {
            count_outcome(Hook::UnderlayTc, PacketClass::ServiceReverseNat);
            ctx.set_mark(acl::skb_mark(&ctx) | SERVICE_REPLY_MARK);
            TC_ACT_OK
        }
        // Routed out to a NodePort client by the load-balancer itself.
        Ok(routed) => {
            count_outcome(Hook::UnderlayTc, PacketClass::ServiceReverseNat);
            reverse_nat::verdict_of(routed) as i32
        }
        Err(reason) => {
            count_drop(Hook::UnderlayTc, reason);
            TC_ACT_SHOT
        }
    }
}

/// tc ingress on the underlay: Geneve and hybrid VXLAN to this node go on to
/// `tc_underlay_decap`, ICMP and SCTP to their own programs (each verified on its own: in one
/// program the load-balancer's paths times theirs are more than the verifier walks);
/// everything else is load-balanced here.
#[classifier]
pub fn tc_underlay(ctx: TcContext) -> i32 {
    underlay_tc(&ctx, false)
}

/// Unwraps Geneve and hybrid VXLAN to this node in the socket buffer, with the checks XDP
/// makes (where the uplink runs no XDP every tunnel packet comes here; otherwise only what
/// XDP left whole, a multicast copy), then takes the packet on as `tc_underlay` takes what
/// XDP unwrapped.
#[classifier]
pub fn tc_underlay_decap(ctx: TcContext) -> i32 {
    match unwrap_tunnel(&ctx).result() {
        Ok(Some((_, outcome))) => count_outcome(Hook::UnderlayTc, outcome),
        // No tunnel of ours: a multicast copy, or a packet to someone else's port.
        Ok(None) => {}
        Err(reason) => {
            count_drop(Hook::UnderlayTc, reason);
            return TC_ACT_SHOT;
        }
    }
    underlay_tc(&ctx, true)
}

/// Unwraps the Geneve or VXLAN packet `tc_underlay` stashed the parse of: its outcome
/// (`GeneveDecap`, `VxlanDecap`), nothing when it is no tunnel of ours, or a drop. A call of
/// its own: its frame (a bounded copy of the parse) is not added to the load-balancer's
/// below `underlay_tc`.
#[inline(never)]
fn unwrap_tunnel(ctx: &TcContext) -> Stage {
    let Some(stashed) = PARSED.get(0) else {
        return Stage::new(Ok(None));
    };
    // Offsets read back from map memory are unknown to the verifier: bounded here. At tc a
    // tunnel packet's tag is the kernel's (taken out of the frame), so its IP header follows
    // the Ethernet header; anything else is no tunnel of ours.
    let l4_offset = stashed.l4_offset;
    if stashed.l3_offset != ETH_LEN || l4_offset > MAX_TUNNEL_L4_OFFSET {
        return Stage::new(Ok(None));
    }
    let parsed = &Parsed {
        l3_offset: ETH_LEN,
        l4_offset,
        ..*stashed
    };
    let unwrapped = if hybrid::vxlan_port(parsed) {
        hybrid::decapsulate_skb(ctx, parsed).map(|done| done.then_some(PacketClass::VxlanDecap))
    } else {
        overlay::decapsulate_skb(ctx, parsed).map(|done| done.then_some(PacketClass::GeneveDecap))
    };
    Stage::new(unwrapped.map(|outcome| outcome.map(|class| (0, class))))
}

/// The furthest a tunnel's UDP header can start: after an IPv6 header and extension headers
/// (the parser's own bound is lower).
const MAX_TUNNEL_L4_OFFSET: usize = ETH_LEN + 40 + 256;

/// The underlay's tc ingress for one packet; `unwrapped`: it came through `tc_underlay_decap`
/// (its tunnel ports are then its own: Geneve left whole is a multicast copy), and was counted
/// on arrival.
#[inline(always)]
fn underlay_tc(ctx: &TcContext, unwrapped: bool) -> i32 {
    let parsed = match parse_skb(ctx) {
        Ok(parsed) => parsed,
        // A malformed inner packet was counted as a packet when it arrived wrapped.
        Err(reason) if unwrapped => {
            count_drop(Hook::UnderlayTc, reason);
            return TC_ACT_SHOT;
        }
        Err(reason) => {
            count_malformed(Hook::UnderlayTc, reason);
            return TC_ACT_SHOT;
        }
    };
    if !unwrapped {
        count_packet(Hook::UnderlayTc, parsed.class);
        if overlay::geneve_port(&parsed) || hybrid::vxlan_port(&parsed) {
            return hand_on(ctx, &parsed, TAIL_UNDERLAY_DECAP);
        }
    } else if overlay::geneve_port(&parsed) {
        return hand_on(ctx, &parsed, TAIL_UNDERLAY_MULTICAST);
    }
    // Neighbour questions for egress addresses, where XDP may not answer them.
    if egressip::answered_at_tc(ctx, parsed.class) {
        return hand_on(ctx, &parsed, TAIL_UNDERLAY_NEIGHBOUR);
    }
    match parsed.class {
        PacketClass::Icmp | PacketClass::Icmpv6 => hand_on(ctx, &parsed, TAIL_UNDERLAY_ICMP),
        PacketClass::Sctp => hand_on(ctx, &parsed, TAIL_UNDERLAY_SCTP),
        _ => match opaque(&parsed) {
            // A later fragment whose first was not seen here is not ours to judge: the node's
            // own traffic, or a pod's, whose veth judges it.
            Some(parsed) => match frag::follow_first(ctx, parsed) {
                Ok(()) => underlay_services(ctx, parsed, false),
                Err(_) => TC_ACT_OK,
            },
            None => TC_ACT_OK,
        },
    }
}

/// The parse result passed through this CPU's `PARSED` slot: read back from map memory (a
/// second lookup, so the compiler cannot forward what was stored) it is one unknown value to
/// the verifier, not the constants of each parse path, so the stages after it are walked once
/// rather than once per kind of packet.
#[inline(always)]
fn opaque(parsed: &Parsed) -> Option<&'static Parsed> {
    if !stash(parsed) {
        return None;
    }
    PARSED.get(0)
}

/// `tc_underlay` for SCTP: the same, with the CRC32c corrected after a port rewrite.
#[classifier]
pub fn tc_underlay_sctp(ctx: TcContext) -> i32 {
    let Some(parsed) = PARSED.get(0) else {
        return TC_ACT_OK;
    };
    underlay_services(&ctx, parsed, true)
}

/// Reverse NAT of replies from remote backends and NodePort DNAT, then delivery of what was
/// DNAT'd; `sctp`: the packet is SCTP.
#[inline(always)]
fn underlay_services(ctx: &TcContext, parsed: &Parsed, sctp: bool) -> i32 {
    match lb::from_underlay(ctx, parsed).result() {
        Ok(Some((routed, outcome))) => {
            count_outcome(Hook::UnderlayTc, outcome);
            if sctp && let Err(reason) = lb::follow_sctp(ctx, parsed, outcome) {
                count_drop(Hook::UnderlayTc, reason);
                return TC_ACT_SHOT;
            }
            // Routed out by the load-balancer.
            if let Some(verdict) = routed_verdict(routed) {
                return verdict;
            }
            if outcome == PacketClass::ServiceReverseNat {
                // The client pod's ingress policy lets replies of its own connections pass.
                ctx.set_mark(acl::skb_mark(ctx) | SERVICE_REPLY_MARK);
            }
            if outcome != PacketClass::ServiceDnat {
                return TC_ACT_OK;
            }
        }
        // For a pod of this node (decapsulated by XDP, merged by GRO): handed straight into
        // the pod below, past this node's forwarding and the pod veth's egress, whose checks
        // (the pod's ingress policy) are made here instead.
        Ok(None) if overlay::forwarded_to_local_pod(ctx, parsed) => {}
        // Egress IP traffic: replies to an address held here, other nodes' pods to outside.
        Ok(None) if lookup::egress_holder() => return hand_on(ctx, parsed, TAIL_UNDERLAY_EGRESS),
        Ok(None) => return TC_ACT_OK,
        Err(reason) if lb::answerable(reason) => {
            return lb::answer_counted(ctx, parsed, reason, Hook::UnderlayTc);
        }
        Err(reason) => {
            count_drop(Hook::UnderlayTc, reason);
            return TC_ACT_SHOT;
        }
    }
    // A NodePort packet now addressed to its backend, or a packet for a pod of this node: a
    // pod here is handed over without passing its veth's egress, so its ingress policy is
    // applied now.
    if let Err(reason) = acl::to_pod(ctx, parsed, Hook::UnderlayTc).result() {
        count_drop(Hook::UnderlayTc, reason);
        return TC_ACT_SHOT;
    }
    // Delivered to the pod here or wrapped in Geneve towards the backend's node, as the
    // overlay does for pods.
    match overlay::from_pod(ctx, parsed, false).result() {
        Ok(Some((verdict, outcome))) => {
            count_outcome(Hook::UnderlayTc, outcome);
            verdict as i32
        }
        Ok(None) => TC_ACT_OK,
        Err(reason) => {
            count_drop(Hook::UnderlayTc, reason);
            TC_ACT_SHOT
        }
    }
}
