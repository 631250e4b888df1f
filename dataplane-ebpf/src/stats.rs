//! Per-CPU counters of packets by class and of drops by reason.

use dataplane_common::{DropReason, Hook, PacketClass, stats::counter_index};

use crate::maps::{DROPS, PACKETS};

#[inline(always)]
fn bump(map: &aya_ebpf::maps::PerCpuArray<u64>, index: u32) {
    if let Some(slot) = map.get_ptr_mut(index) {
        // Per-CPU slot: no other CPU writes it, so a plain add is race-free.
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
