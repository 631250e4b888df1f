//! Per-CPU counters of packets by class and of drops by reason.

use dataplane_common::{
    DropReason, Hook, PacketClass,
    stats::{POD_DROP, POD_FLOW, PodCounters, counter_index},
};

use crate::maps::{DROPS, PACKETS, POD_STATS};

#[inline(always)]
fn bump(map: &aya_ebpf::maps::PerCpuArray<u64>, index: u32) {
    if let Some(slot) = map.get_ptr_mut(index) {
        // SAFETY: a valid pointer to this CPU's slot; no other CPU writes it, so a plain add is
        // race-free.
        unsafe { *slot += 1 };
    }
}

/// Counts one packet seen at `hook` as `class` (and in the hook's total).
#[inline(always)]
pub fn count_packet(hook: Hook, class: PacketClass) {
    bump(&PACKETS, counter_index(hook, PacketClass::Total));
    bump(&PACKETS, counter_index(hook, class));
}

/// Counts an outcome (encapsulated, decapsulated, redirected) without touching the total.
#[inline(always)]
pub fn count_outcome(hook: Hook, outcome: PacketClass) {
    bump(&PACKETS, counter_index(hook, outcome));
}

/// Counts one packet dropped at `hook` for `reason`.
#[inline(always)]
pub fn count_drop(hook: Hook, reason: DropReason) {
    count_outcome(hook, PacketClass::Dropped);
    bump(&DROPS, reason as u32);
}

/// Counts a packet the parser rejected: seen once (in the total) and dropped for `reason`.
#[inline(always)]
pub fn count_malformed(hook: Hook, reason: DropReason) {
    count_outcome(hook, PacketClass::Total);
    count_drop(hook, reason);
}

/// The ifindex of the device a tc program runs on (a pod's host-side veth).
#[inline(always)]
pub fn device(ctx: &aya_ebpf::programs::TcContext) -> u32 {
    // SAFETY: the program's own skb, valid for the run.
    unsafe { (*ctx.skb.skb).ifindex }
}

/// Counts one packet dropped at a pod's veth (`hook`, the veth's `ifindex`) for `reason`, also
/// against the pod ([`count_pod`]).
#[inline(always)]
pub fn count_pod_drop(ifindex: u32, hook: Hook, reason: DropReason) {
    count_drop(hook, reason);
    count_pod(ifindex, POD_DROP);
}

/// [`count_malformed`] at a pod's veth `ifindex`, also against the pod.
#[inline(always)]
pub fn count_pod_malformed(ifindex: u32, hook: Hook, reason: DropReason) {
    count_malformed(hook, reason);
    count_pod(ifindex, POD_DROP);
}

/// Counts one service flow opened by the pod behind `ifindex`.
#[inline(always)]
pub fn count_pod_flow(ifindex: u32) {
    count_pod(ifindex, POD_FLOW);
}

/// Adds one to `what` (`POD_DROP` or `POD_FLOW`) of the pod behind veth `ifindex`, in this
/// CPU's slot. A subprogram: called from many drop paths, inlined it would weigh on each.
#[inline(never)]
fn count_pod(ifindex: u32, what: u32) {
    if let Some(counters) = POD_STATS.get_ptr_mut(ifindex) {
        // SAFETY: this CPU's own value of a per-CPU map.
        unsafe {
            if what == POD_DROP {
                (*counters).drops += 1;
            } else {
                (*counters).flows += 1;
            }
        }
        return;
    }
    let first = PodCounters {
        drops: u64::from(what == POD_DROP),
        flows: u64::from(what == POD_FLOW),
    };
    // A full LRU map evicts the pod counted longest ago.
    let _ = POD_STATS.insert(ifindex, first, 0);
}
