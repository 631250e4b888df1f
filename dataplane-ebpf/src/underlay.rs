//! XDP on the node's underlay NIC: every packet arriving at the node passes here first.
//! Today: parse, count, drop malformed packets with their reason. Geneve decapsulation and
//! NodePort load-balancing hook in after the parse.

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use dataplane_common::Hook;

use crate::{
    parse::{Packet, parse},
    stats::{count_drop, count_packet},
};

#[xdp]
pub fn xdp_underlay(ctx: XdpContext) -> u32 {
    let packet = Packet::new(ctx.data(), ctx.data_end(), ctx.data_end() - ctx.data());
    match parse(&packet) {
        Ok(parsed) => {
            count_packet(Hook::Underlay, parsed.class);
            xdp_action::XDP_PASS
        }
        Err(reason) => {
            count_drop(Hook::Underlay, reason);
            xdp_action::XDP_DROP
        }
    }
}
