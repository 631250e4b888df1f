//! The test bed: what the packet tests, the topology tests, the benchmarks and the demo share.
//! - [`privileged`]: the gate every kernel-touching test passes (fails under CI=true when it
//!   cannot run, never skips there);
//! - [`cni`]: the CNI plugin run as a container runtime runs it;
//! - [`cpu`]: the machine's busy CPU time over a run, from `/proc/stat`;
//! - [`fixture`]: the real programs loaded under a private pin root, removed on drop;
//! - [`podman`]: a real container runtime calling the plugin;
//! - [`packets`]: packet builders (etherparse) and the byte surgery for malformed packets;
//! - [`netns`]: a namespace entered by the current thread only (route lookups in test runs);
//! - [`multicast_bed`]: group members and senders with real sockets in pods;
//! - [`request_response`]: TCP round trips and short connections timed between pods;
//! - [`scapy`]: the independent Geneve encoder/decoder;
//! - [`service_bed`]: echoing service backends and clients in pods;
//! - [`testbed`]: the test bed's own programs (benchmark baselines, the fabric's switch);
//! - [`topology`]: simulated nodes and pods in network namespaces, with the real agent.

pub mod capture;
pub mod cni;
pub mod cpu;
pub mod egress_bed;
pub mod egress_topology;
pub mod fixture;
pub mod fuzz;
pub mod hybrid_bed;
pub mod multicast_bed;
pub mod netns;
pub mod object_fuzz;
pub mod overlay_bed;
pub mod packets;
pub mod podman;
pub mod privileged;
pub mod request_response;
pub mod scapy;
pub mod service_bed;
pub mod testbed;
pub mod topology;

use std::sync::atomic::{AtomicU32, Ordering};

/// A name unique to this process and call, short enough for netns and bpffs paths.
pub fn unique_name(kind: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("dpt{}-{kind}{n}", std::process::id())
}

/// The median of benchmark samples (the upper one of an even count).
pub fn median(samples: &[f64]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// Whether `check` holds within ten seconds, tried every half second (agents see a rewritten
/// manifest at their next sync).
pub fn eventually(mut check: impl FnMut() -> bool) -> bool {
    for _ in 0..20 {
        if check() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    false
}
