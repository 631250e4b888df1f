//! The names of the test bed's kernel programs and maps: a separate object
//! (`dataplane-testbed`, built beside the dataplane's) that the agent never loads. The
//! benchmarks measure against its empty programs; the topology tests switch their fabric with
//! its XDP switch.

/// An XDP program that does nothing but pass: the baseline XDP benchmarks are measured against.
pub const PROG_BASELINE: &str = "xdp_baseline";
/// A tc program that does nothing but accept: the baseline of tc benchmarks.
pub const PROG_TC_BASELINE: &str = "tc_baseline";
/// A tc program that redirects every packet into one pod, deciding nothing: the floor of the
/// service packet-rate benchmark.
pub const PROG_TC_REDIRECT_BASELINE: &str = "tc_redirect_baseline";
/// One entry: the host-side veth [`PROG_TC_REDIRECT_BASELINE`] redirects to (its peer).
pub const BASELINE_REDIRECT: &str = "DP_BASELINE_REDIRECT";
/// The testbed's switch, an XDP program for the ports of the fabric joining simulated nodes
/// (tests and benchmarks only; the agent never attaches it).
pub const PROG_FABRIC_SWITCH: &str = "xdp_fabric_switch";
/// The switch's ports by ifindex (a device map).
pub const FABRIC_PORTS: &str = "DP_FABRIC_PORTS";
pub const MAX_FABRIC_PORTS: u32 = 64;
/// The switch's learned MAC addresses -> port.
pub const FABRIC_MACS: &str = "DP_FABRIC_MACS";
pub const MAX_FABRIC_MACS: u32 = 1024;

/// Every program of the test-bed object.
pub const TESTBED_PROGRAMS: &[&str] = &[
    PROG_BASELINE,
    PROG_TC_BASELINE,
    PROG_TC_REDIRECT_BASELINE,
    PROG_FABRIC_SWITCH,
];
