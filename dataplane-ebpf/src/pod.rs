//! tc ingress on the host side of each pod veth: every packet a pod sends passes here first.
//! Today: parse, count, drop malformed packets with their reason. Anti-spoofing, service
//! load-balancing, policy and encapsulation hook in after the parse.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::classifier,
    programs::TcContext,
};
use dataplane_common::Hook;

use crate::{
    overlay,
    parse::{Packet, Parsed, parse},
    stats::{count_drop, count_malformed, count_outcome, count_packet},
};

/// How much to pull into the linear area when headers straddle it: enough for Ethernet, two VLAN
/// tags, IPv4 with options or IPv6 with a deep extension chain, and a TCP header with options.
const PULL_LEN: u32 = 1024;

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
    match overlay::from_pod(&ctx, &parsed) {
        Ok(Some((verdict, outcome))) => {
            count_outcome(Hook::FromPod, outcome);
            verdict
        }
        Ok(None) => TC_ACT_OK,
        Err(reason) => {
            count_drop(Hook::FromPod, reason);
            TC_ACT_SHOT
        }
    }
}

/// Parses the linear part of the skb; if a header runs past it while the packet is longer, pulls
/// more into the linear area once and parses again, so only truly short packets are dropped.
#[inline(always)]
fn parse_skb(ctx: &TcContext) -> Result<Parsed, dataplane_common::DropReason> {
    let len = ctx.len() as usize;
    let first = parse(&Packet::new(ctx.data(), ctx.data_end(), len));
    match first {
        Err(reason) if ctx.data_end() - ctx.data() < len && is_truncation(reason) => {
            let want = if ctx.len() < PULL_LEN {
                ctx.len()
            } else {
                PULL_LEN
            };
            if ctx.pull_data(want).is_err() {
                return Err(reason);
            }
            parse(&Packet::new(ctx.data(), ctx.data_end(), len))
        }
        other => other,
    }
}

#[inline(always)]
fn is_truncation(reason: dataplane_common::DropReason) -> bool {
    use dataplane_common::DropReason::*;
    matches!(
        reason,
        EthTruncated
            | VlanTruncated
            | Ipv4Truncated
            | Ipv4OptionsTruncated
            | Ipv6Truncated
            | Ipv6ExtTruncated
            | TcpTruncated
            | TcpBadDataOffset
            | UdpTruncated
            | SctpTruncated
            | IcmpTruncated
            | Icmpv6Truncated
    )
}
