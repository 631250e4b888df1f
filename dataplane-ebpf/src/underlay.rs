//! XDP on the node's underlay NIC: every packet arriving at the node passes here first.
//! Parse (malformed packets dropped with their reason), then Geneve decapsulation for local
//! pods. NodePort load-balancing hooks in after the overlay stage.

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use dataplane_common::{Hook, PacketClass};

use crate::{
    overlay,
    parse::{Packet, parse},
    stats::{count_drop, count_malformed, count_outcome, count_packet},
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
    match overlay::decapsulate(&ctx, &packet, &parsed) {
        Ok(Some(action)) => {
            count_outcome(Hook::Underlay, PacketClass::GeneveDecap);
            action
        }
        Ok(None) => xdp_action::XDP_PASS,
        Err(reason) => {
            count_drop(Hook::Underlay, reason);
            xdp_action::XDP_DROP
        }
    }
}
