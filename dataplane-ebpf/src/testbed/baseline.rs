//! The programs every benchmark is measured against, in the same run: empty ones, and the
//! cheapest possible tc forwarding path (a redirect into a pod with no lookup, no rewrite).

use aya_ebpf::{
    bindings::{TC_ACT_OK, xdp_action},
    helpers::bpf_redirect_peer,
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};

use crate::maps::BASELINE_REDIRECT;

#[xdp]
pub fn xdp_baseline(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

#[classifier]
pub fn tc_baseline(_ctx: TcContext) -> i32 {
    TC_ACT_OK
}

/// Every packet into the pod behind the host-side veth `BASELINE_REDIRECT[0]` names, as the
/// load-balancer delivers to a local backend but without deciding anything: the floor under
/// any tc dataplane's cost on this kernel. Accepts when no target is set.
#[classifier]
pub fn tc_redirect_baseline(_ctx: TcContext) -> i32 {
    match BASELINE_REDIRECT.get(0) {
        // SAFETY: a helper call with plain integer arguments.
        Some(&ifindex) if ifindex != 0 => unsafe { bpf_redirect_peer(ifindex, 0) as i32 },
        _ => TC_ACT_OK,
    }
}
