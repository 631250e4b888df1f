//! tc ingress on the host side of each pod veth: every packet a pod sends passes here first.
//! Parse (malformed packets dropped with their reason), service load-balancing, the
//! NetworkPolicy and the EgressFirewall of the pod's namespace, then the overlay (local
//! delivery or encapsulation). `tc_to_pod` on the same veth's egress judges what the stack
//! delivers to the pod.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::classifier,
    programs::TcContext,
};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    maps::{TAIL_FROM_POD_DELIVER, TAIL_FROM_POD_EGRESS, TAIL_FROM_POD_ICMP, TAIL_FROM_POD_SCTP},
};

use crate::lookup;
use crate::{
    acl, frag, lb,
    maps::{PARSED, TAILS},
    multicast, overlay,
    parse::{
        IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, Packet, parse_skb, parse_untagged_ipv4, stashed,
    },
    port,
    stage::{reverse_nat, routed_verdict},
    stats::{count_outcome, count_packet, count_pod_drop, count_pod_malformed},
};

/// `skb->cb` word carrying "this is a service reply" from the first half to the second.
const CB_REPLY: usize = 0;
/// `skb->cb` word carrying "the destination is not a local pod" (already looked up).
const CB_NOT_LOCAL: usize = 1;

#[classifier]
pub fn tc_from_pod(mut ctx: TcContext) -> i32 {
    // The common case first: an untagged IPv4 frame within the linear data, parsed by the
    // parser's own IPv4 branch; anything else (or a malformed frame, which the full parse
    // names) is parsed in full.
    let packet = Packet::new(ctx.data(), ctx.data_end(), ctx.len() as usize);
    let parsed = match parse_untagged_ipv4(&packet).map_or_else(|| parse_skb(&ctx), Ok) {
        Ok(parsed) => parsed,
        Err(reason) => {
            count_pod_malformed(crate::stats::device(&ctx), Hook::FromPod, reason);
            return TC_ACT_SHOT;
        }
    };
    count_packet(Hook::FromPod, parsed.class);
    // From here on the parse result is read back from this CPU's slot: one unknown value for
    // the verifier instead of the constants of each parse path, so what follows is walked
    // once rather than once per kind of packet.
    let Some(parsed) = stashed(&parsed) else {
        count_pod_drop(
            crate::stats::device(&ctx),
            Hook::FromPod,
            DropReason::ScratchUnavailable,
        );
        return TC_ACT_SHOT;
    };
    // With no pod under access control, a service flow's packets try the flow cache, which
    // makes the rest unnecessary on a hit: the common IPv4 case without a call. A hit needs
    // the veth and source MAC of the packet that filled the entry: one port security passed.
    let controlled = acl::active();
    if !controlled
        && lookup::may_be_service(parsed)
        && let Some(done) = lb::cache::replay_plain_v4(&ctx, parsed)
    {
        return match done {
            Ok((verdict, translation)) => {
                count_replayed(translation);
                verdict
            }
            Err(reason) => {
                count_pod_drop(crate::stats::device(&ctx), Hook::FromPod, reason);
                TC_ACT_SHOT
            }
        };
    }
    // Port security: nothing after this sees a packet the pod may not send.
    match port::from_pod(&ctx, parsed).into_value() {
        Ok(0) => {}
        // ARP the pod may send: for the stack, which answers it.
        Ok(_) => return TC_ACT_OK,
        Err(reason) => {
            count_pod_drop(crate::stats::device(&ctx), Hook::FromPod, reason);
            return TC_ACT_SHOT;
        }
    }
    // To a group: its own program, whatever the protocol (no service or policy applies).
    if multicast::to_group(&ctx, parsed) {
        return multicast::hand_on(&ctx);
    }
    // A later fragment gets its first fragment's ports, for the load-balancer and policy.
    if let Err(reason) = frag::follow_first(&ctx, parsed) {
        count_pod_drop(crate::stats::device(&ctx), Hook::FromPod, reason);
        return TC_ACT_SHOT;
    }
    // With no pod under access control, TCP and UDP to a pod of this node are delivered here
    // (the second half would only do the same, after a tail call and the hand-over of the
    // parse result), and the other service flows' packets try the flow cache.
    let direct = (parsed.protocol == IPPROTO_TCP || parsed.protocol == IPPROTO_UDP) && !controlled;
    // After the fragment stage: a later fragment's ports are its first's.
    let service = lookup::may_be_service(parsed);
    if direct && service {
        match lb::cache::replay(&ctx, parsed) {
            Ok(Some((verdict, translation))) => {
                count_replayed(translation);
                return verdict;
            }
            Ok(None) => {}
            Err(reason) => {
                count_pod_drop(crate::stats::device(&ctx), Hook::FromPod, reason);
                return TC_ACT_SHOT;
            }
        }
    }
    let mut reply = 0;
    let mut translated = false;
    let balanced = if service {
        lb::from_pod(&ctx, parsed).result()
    } else {
        Ok(None)
    };
    match balanced {
        Ok(Some((routed, outcome))) => {
            count_outcome(Hook::FromPod, outcome);
            // The load-balancer routed the packet out itself.
            if let Some(verdict) = routed_verdict(routed) {
                return verdict;
            }
            reply = (outcome == PacketClass::ServiceReverseNat) as u32;
            translated =
                outcome == PacketClass::ServiceDnat || outcome == PacketClass::ServiceReverseNat;
        }
        Ok(None) => {}
        Err(reason) if lb::answerable(reason) => {
            return lb::answer_counted(&ctx, parsed, reason, Hook::FromPod);
        }
        Err(reason) => {
            count_pod_drop(crate::stats::device(&ctx), Hook::FromPod, reason);
            return TC_ACT_SHOT;
        }
    }
    let mut not_local = false;
    if direct && overlay::outside_pod_networks(&ctx, parsed) {
        // Neither a pod here nor a remote pod subnet: the second half would only let it go
        // (after the tail call and its lookups), unless an egress IP may apply to its pod.
        if !lookup::egress_pods_selected() {
            return TC_ACT_OK;
        }
        not_local = true;
    } else if direct {
        match overlay::local_pod(&ctx, parsed) {
            Ok((pod, epoch)) => {
                if translated {
                    lb::cache::remember(&ctx, epoch, &pod);
                }
                count_outcome(Hook::FromPod, PacketClass::LocalRedirect);
                return overlay::to_local_pod(&ctx, &pod);
            }
            Err(looked_up) => not_local = looked_up,
        }
    }
    // The rest runs as its own program, verified on its own: one program holding the
    // load-balancer, access control and the overlay is more than the verifier walks.
    ctx.cb_mut()[CB_REPLY] = reply;
    ctx.cb_mut()[CB_NOT_LOCAL] = not_local as u32;
    // Each tail call with a constant slot: the JIT turns those into direct jumps, where a
    // slot chosen at run time costs an indirect one.
    if parsed.protocol == IPPROTO_SCTP {
        hand_on(&ctx, TAIL_FROM_POD_SCTP)
    } else if matches!(parsed.class, PacketClass::Icmp | PacketClass::Icmpv6) {
        hand_on(&ctx, TAIL_FROM_POD_ICMP)
    } else {
        hand_on(&ctx, TAIL_FROM_POD_DELIVER)
    }
}

/// Tail-calls the program in `TAILS` slot `next` (give it a constant); the packet is dropped,
/// counted, if that fails.
#[inline(always)]
fn hand_on(ctx: &TcContext, next: u32) -> i32 {
    // SAFETY: a tail call either does not return or returns having done nothing.
    unsafe { TAILS.tail_call(ctx, next) };
    count_pod_drop(
        crate::stats::device(ctx),
        Hook::FromPod,
        DropReason::TailCallFailed,
    );
    TC_ACT_SHOT
}

/// Counts a packet the flow cache translated (`translation`) and delivered.
#[inline(always)]
fn count_replayed(translation: PacketClass) {
    count_outcome(Hook::FromPod, translation);
    count_outcome(Hook::FromPod, PacketClass::LocalRedirect);
    count_outcome(Hook::FromPod, PacketClass::ServiceFlowCached);
}

/// Between the halves of `tc_from_pod` for SCTP: the CRC32c after the load-balancer's port
/// rewrite (the ports as parsed and as they are now tell what changed; no change, nothing to
/// do), then on to the second half.
#[classifier]
pub fn tc_from_pod_sctp(ctx: TcContext) -> i32 {
    let Some(parsed) = PARSED.get(0) else {
        count_pod_drop(
            crate::stats::device(&ctx),
            Hook::FromPod,
            DropReason::ScratchUnavailable,
        );
        return TC_ACT_SHOT;
    };
    if let Err(reason) = lb::follow_sctp_ports(&ctx, parsed).into_value() {
        count_pod_drop(crate::stats::device(&ctx), Hook::FromPod, reason);
        return TC_ACT_SHOT;
    }
    // SAFETY: a tail call either does not return or returns having done nothing.
    unsafe { TAILS.tail_call(&ctx, TAIL_FROM_POD_DELIVER) };
    count_pod_drop(
        crate::stats::device(&ctx),
        Hook::FromPod,
        DropReason::TailCallFailed,
    );
    TC_ACT_SHOT
}

/// Between the halves of `tc_from_pod` for ICMP and ICMPv6: an error a local backend sends
/// about a service flow is given the service's address back, and then passes as a reply of
/// that flow; then on to the second half.
#[classifier]
pub fn tc_from_pod_icmp(mut ctx: TcContext) -> i32 {
    let Some(parsed) = PARSED.get(0) else {
        count_pod_drop(
            crate::stats::device(&ctx),
            Hook::FromPod,
            DropReason::ScratchUnavailable,
        );
        return TC_ACT_SHOT;
    };
    // Neighbour discovery names the pod's own link-layer address and addresses.
    if let Err(reason) = port::nd_from_pod(&ctx, parsed) {
        count_pod_drop(crate::stats::device(&ctx), Hook::FromPod, reason);
        return TC_ACT_SHOT;
    }
    match lb::icmp_error_reverse_nat(&ctx, parsed).into_value() {
        Ok(reverse_nat::UNTOUCHED) => {}
        Ok(reverse_nat::TRANSLATED) => {
            count_outcome(Hook::FromPod, PacketClass::ServiceReverseNat);
            ctx.cb_mut()[CB_REPLY] = 1;
        }
        // Routed out to a NodePort client by the load-balancer itself.
        Ok(routed) => {
            count_outcome(Hook::FromPod, PacketClass::ServiceReverseNat);
            return reverse_nat::verdict_of(routed) as i32;
        }
        Err(reason) => {
            count_pod_drop(crate::stats::device(&ctx), Hook::FromPod, reason);
            return TC_ACT_SHOT;
        }
    }
    // SAFETY: a tail call either does not return or returns having done nothing.
    unsafe { TAILS.tail_call(&ctx, TAIL_FROM_POD_DELIVER) };
    count_pod_drop(
        crate::stats::device(&ctx),
        Hook::FromPod,
        DropReason::TailCallFailed,
    );
    TC_ACT_SHOT
}

/// The second half of `tc_from_pod`: NetworkPolicy and the EgressFirewall (not for replies of
/// service connections, judged when they opened), then local delivery or encapsulation.
#[classifier]
pub fn tc_from_pod_deliver(ctx: TcContext) -> i32 {
    // The first half's parse result (offsets and protocol still hold: the load-balancer only
    // rewrites addresses and ports in place).
    let Some(parsed) = PARSED.get(0) else {
        count_pod_drop(
            crate::stats::device(&ctx),
            Hook::FromPod,
            DropReason::ScratchUnavailable,
        );
        return TC_ACT_SHOT;
    };
    let reply = ctx.cb()[CB_REPLY] != 0;
    if !reply
        && acl::active()
        && let Err(reason) = acl::from_pod(&ctx, parsed).result()
    {
        count_pod_drop(crate::stats::device(&ctx), Hook::FromPod, reason);
        return TC_ACT_SHOT;
    }
    // Only `tc_from_pod` sets it; the SCTP and ICMP halves pass it on as cleared.
    let not_local = ctx.cb()[CB_NOT_LOCAL] != 0;
    match overlay::from_pod(&ctx, parsed, not_local).result() {
        Ok(Some((verdict, outcome))) => {
            count_outcome(Hook::FromPod, outcome);
            verdict as i32
        }
        // Leaving by the stack: outside the overlay, where a pod an EgressIP selects must
        // take its egress address (a service reply keeps the address the client reached).
        Ok(None) if !reply && lookup::egress_pods_selected() => {
            // SAFETY: a tail call either does not return or returns having done nothing.
            unsafe { TAILS.tail_call(&ctx, TAIL_FROM_POD_EGRESS) };
            count_pod_drop(
                crate::stats::device(&ctx),
                Hook::FromPod,
                DropReason::TailCallFailed,
            );
            TC_ACT_SHOT
        }
        Ok(None) => TC_ACT_OK,
        Err(reason) => {
            count_pod_drop(crate::stats::device(&ctx), Hook::FromPod, reason);
            TC_ACT_SHOT
        }
    }
}

/// tc egress on the host side of each pod veth: what the stack delivers to the pod (from other
/// nodes, from outside, from the node itself) passes the pod's ingress NetworkPolicy here.
/// Packets from pods of this node are judged in `tc_from_pod` and never pass here.
#[classifier]
pub fn tc_to_pod(ctx: TcContext) -> i32 {
    let parsed = match parse_skb(&ctx) {
        Ok(parsed) => parsed,
        Err(reason) => {
            count_pod_malformed(crate::stats::device(&ctx), Hook::ToPod, reason);
            return TC_ACT_SHOT;
        }
    };
    count_packet(Hook::ToPod, parsed.class);
    let Some(parsed) = stashed(&parsed) else {
        count_pod_drop(
            crate::stats::device(&ctx),
            Hook::ToPod,
            DropReason::ScratchUnavailable,
        );
        return TC_ACT_SHOT;
    };
    // Port security: only what is addressed to the pod (or a group) reaches it.
    if let Err(reason) = port::to_pod(&ctx, parsed).into_value() {
        count_pod_drop(crate::stats::device(&ctx), Hook::ToPod, reason);
        return TC_ACT_SHOT;
    }
    // To a group: only the dataplane's copies for members, and queries.
    if let Some(verdict) = multicast::to_pod(&ctx, parsed) {
        return verdict;
    }
    // A later fragment is judged by its first fragment's ports.
    if let Err(reason) = frag::follow_first(&ctx, parsed) {
        count_pod_drop(crate::stats::device(&ctx), Hook::ToPod, reason);
        return TC_ACT_SHOT;
    }
    // A reply of a service flow whose backend is this node: the service's address back. It
    // answers a connection the pod opened (judged at its egress), so no policy judges it.
    match lb::to_pod(&ctx, parsed).result() {
        Ok(Some((routed, outcome))) => {
            count_outcome(Hook::ToPod, outcome);
            return routed_verdict(routed).unwrap_or(TC_ACT_OK);
        }
        Ok(None) => {}
        Err(reason) => {
            count_pod_drop(crate::stats::device(&ctx), Hook::ToPod, reason);
            return TC_ACT_SHOT;
        }
    }
    match acl::to_pod(&ctx, parsed, Hook::ToPod).result() {
        Ok(_) => TC_ACT_OK,
        Err(reason) => {
            count_pod_drop(crate::stats::device(&ctx), Hook::ToPod, reason);
            TC_ACT_SHOT
        }
    }
}
