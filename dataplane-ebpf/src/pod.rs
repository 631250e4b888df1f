//! tc ingress on the host side of each pod veth: every packet a pod sends passes here first.
//! Parse (malformed packets dropped with their reason), service load-balancing, the
//! EgressFirewall of the pod's namespace, then the overlay (local delivery or encapsulation).

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::classifier,
    programs::TcContext,
};
use dataplane_common::{Hook, PacketClass};

use crate::{
    acl, lb, overlay,
    parse::parse_skb,
    stats::{count_drop, count_malformed, count_outcome, count_packet},
};

#[classifier]
pub fn tc_from_pod(ctx: TcContext) -> i32 {
    let parsed = match parse_skb(&ctx) {
        Ok(parsed) => parsed,
        Err(reason) => {
            count_malformed(Hook::FromPod, reason);
            return TC_ACT_SHOT;
        }
    };
    count_packet(Hook::FromPod, parsed.class);
    let mut reply = false;
    match lb::from_pod(&ctx, &parsed).result() {
        Ok(Some((answered, outcome))) => {
            count_outcome(Hook::FromPod, outcome);
            // The load-balancer answered the packet itself: its verdict, plus one.
            if answered != 0 {
                return (answered - 1) as i32;
            }
            reply = outcome == PacketClass::ServiceReverseNat;
        }
        Ok(None) => {}
        Err(reason) => {
            count_drop(Hook::FromPod, reason);
            return TC_ACT_SHOT;
        }
    }
    // Replies of service connections (NodePort clients outside included) are never judged by
    // the pod's EgressFirewall: the connection was accepted when it came in.
    if !reply {
        match acl::firewall(&ctx, &parsed).result() {
            Ok(Some((_, outcome))) => count_outcome(Hook::FromPod, outcome),
            Ok(None) => {}
            Err(reason) => {
                count_drop(Hook::FromPod, reason);
                return TC_ACT_SHOT;
            }
        }
    }
    match overlay::from_pod(&ctx, &parsed).result() {
        Ok(Some((verdict, outcome))) => {
            count_outcome(Hook::FromPod, outcome);
            verdict as i32
        }
        Ok(None) => TC_ACT_OK,
        Err(reason) => {
            count_drop(Hook::FromPod, reason);
            TC_ACT_SHOT
        }
    }
}
