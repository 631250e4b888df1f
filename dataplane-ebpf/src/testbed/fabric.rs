//! The testbed's switch, not part of the dataplane: the fabric namespace that joins the
//! simulated nodes can forward in XDP instead of through its Linux bridge. A hardware switch
//! costs the nodes nothing; the bridge costs the machine's two CPUs, which every benchmark
//! shares, a socket buffer per frame (and turns each XDP frame a node sends back into one).
//! Attached by `tests::topology::Topology::switch_in_xdp` to every port of the fabric.

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};

use crate::maps::{FABRIC_MACS, FABRIC_PORTS};

/// The group bit of a MAC address (the least significant bit of its first byte), in the
/// packed form [`mac_at`] returns.
const GROUP_BIT: u64 = 1;

/// A unicast frame to a MAC address seen before goes straight to the port it was seen on;
/// anything else (broadcast, multicast, an address not yet seen) goes on to the bridge,
/// which floods it. Each frame's source address is learned from the port it came in on.
#[xdp]
pub fn xdp_fabric_switch(ctx: XdpContext) -> u32 {
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + 12 > end {
        return xdp_action::XDP_PASS;
    }
    // SAFETY: both addresses lie within the 12 bytes just checked.
    let (destination, source) = unsafe { (mac_at(start), mac_at(start + 6)) };
    // SAFETY: the context the kernel passed.
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    if source & GROUP_BIT == 0 {
        learn(source, ingress);
    }
    if destination & GROUP_BIT != 0 {
        return xdp_action::XDP_PASS;
    }
    // SAFETY: the value is copied out at once.
    match unsafe { FABRIC_MACS.get(destination) }.copied() {
        Some(port) if port != ingress => FABRIC_PORTS
            .redirect(port, xdp_action::XDP_PASS as u64)
            .unwrap_or(xdp_action::XDP_PASS),
        _ => xdp_action::XDP_PASS,
    }
}

/// Records that `mac` is reached through `port`, when that is news.
fn learn(mac: u64, port: u32) {
    // SAFETY: the value is copied out at once.
    if unsafe { FABRIC_MACS.get(mac) }.copied() != Some(port) {
        let _ = FABRIC_MACS.insert(mac, port, 0);
    }
}

/// The six bytes of a MAC address at `at`, packed in wire order into the low bytes of a u64
/// (the first byte lowest).
///
/// # Safety
/// `at .. at + 6` must lie within the packet.
unsafe fn mac_at(at: usize) -> u64 {
    let bytes = at as *const u8;
    let mut mac = 0u64;
    for i in 0..6 {
        // SAFETY: within the six bytes the caller vouches for.
        mac |= (unsafe { *bytes.add(i) } as u64) << (8 * i);
    }
    mac
}
