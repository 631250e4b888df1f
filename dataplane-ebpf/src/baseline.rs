//! The empty programs every benchmark is measured against, in the same run.

use aya_ebpf::{
    bindings::{TC_ACT_OK, xdp_action},
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};

#[xdp]
pub fn xdp_baseline(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

#[classifier]
pub fn tc_baseline(_ctx: TcContext) -> i32 {
    TC_ACT_OK
}
