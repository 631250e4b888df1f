//! The flow clock: seconds since boot on the kernel's monotonic clock, the clock of every
//! tracked flow (conntrack, affinity, access control, the flow cache).

use aya_ebpf::helpers::{bpf_jiffies64, bpf_ktime_get_coarse_ns};
use dataplane_common::lb::jiffies_at_boot;

/// The kernel's tick rate, set by the loader (`CLOCK_HZ_GLOBAL`); 0 until then.
#[unsafe(no_mangle)]
static CLOCK_HZ: u32 = 0;

/// Seconds since boot on the kernel's monotonic clock (the clock of every tracked flow). From
/// `jiffies_64` when the loader gave the tick rate: the verifier inlines that read, where the
/// coarse clock is a helper call (about 6% of a tracked packet's time on this path).
#[inline(always)]
pub fn now() -> u32 {
    let (ticks, per_second) = clock();
    (ticks / per_second) as u32
}

/// The clock behind [`now`] as ticks since boot and ticks per second, for comparisons that
/// must not pay a division on every packet (the flow cache's).
#[inline(always)]
pub fn clock() -> (u64, u64) {
    // SAFETY: a read of a global the loader sets; volatile, or LLVM folds its initial 0.
    let hz = unsafe { core::ptr::read_volatile(&CLOCK_HZ) } as u64;
    if hz == 0 {
        // SAFETY: plain helper call.
        return (unsafe { bpf_ktime_get_coarse_ns() }, 1_000_000_000);
    }
    // SAFETY: plain helper call (inlined by the verifier).
    let jiffies = unsafe { bpf_jiffies64() };
    (jiffies.wrapping_sub(jiffies_at_boot(hz)), hz)
}
