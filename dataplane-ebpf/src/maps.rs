//! Every map of the kernel programs, in one place. Names are spelled as in
//! `dataplane_common::maps` (the agent's tests check they match). All maps are pinned by name so
//! a restarted agent adopts them.

use aya_ebpf::{macros::map, maps::PerCpuArray};
use dataplane_common::{drop::DROP_REASON_SLOTS, stats::PACKET_COUNTER_SLOTS};

/// Drop counters by reason code.
#[map(name = "DP_DROPS")]
pub static DROPS: PerCpuArray<u64> = PerCpuArray::pinned(DROP_REASON_SLOTS, 0);

/// Packet counters by hook and class.
#[map(name = "DP_PACKETS")]
pub static PACKETS: PerCpuArray<u64> = PerCpuArray::pinned(PACKET_COUNTER_SLOTS, 0);

/// One entry: the `LAYOUT_VERSION` of the agent that created the pins. Written and checked by
/// the agent only; the programs never read it.
#[map(name = "DP_META")]
pub static META: aya_ebpf::maps::Array<u32> = aya_ebpf::maps::Array::pinned(1, 0);
