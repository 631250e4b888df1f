//! The kernel programs, built by build.rs: the dataplane's object, embedded in the agent, and
//! the test bed's, which only the tests and benchmarks load (a binary that never calls
//! [`testbed_object`] does not carry it: the linker drops what nothing reaches).

/// The eBPF object (ELF) with every program and map of `dataplane-ebpf`.
pub fn object() -> &'static [u8] {
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/dataplane-ebpf"))
}

/// The test bed's object (`dataplane-testbed`): the benchmarks' baseline programs and the
/// fabric's XDP switch (`dataplane_common::testbed`).
pub fn testbed_object() -> &'static [u8] {
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/dataplane-testbed"))
}
