//! The test bed's maps, named as in `dataplane_common::testbed`. None is pinned: each lives as
//! long as the test or benchmark that loaded the object holds it (or an attachment its
//! program).

use aya_ebpf::{
    macros::map,
    maps::{Array, DevMapHash, HashMap},
};
use dataplane_common::testbed::{MAX_FABRIC_MACS, MAX_FABRIC_PORTS};

/// The host-side veth `tc_redirect_baseline` sends every packet to (its pod's side). Set only
/// by benchmarks.
#[map(name = "DP_BASELINE_REDIRECT")]
pub static BASELINE_REDIRECT: Array<u32> = Array::with_max_entries(1, 0);

/// The testbed switch's ports (`fabric::xdp_fabric_switch`), by ifindex.
#[map(name = "DP_FABRIC_PORTS")]
pub static FABRIC_PORTS: DevMapHash = DevMapHash::with_max_entries(MAX_FABRIC_PORTS, 0);

/// The testbed switch's learned addresses: a MAC address (packed) -> the port it was last
/// seen on.
#[map(name = "DP_FABRIC_MACS")]
pub static FABRIC_MACS: HashMap<u64, u32> = HashMap::with_max_entries(MAX_FABRIC_MACS, 0);
