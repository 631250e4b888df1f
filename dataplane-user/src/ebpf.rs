//! The kernel programs, built by build.rs and embedded in the agent.

/// The eBPF object (ELF) with every program and map of `dataplane-ebpf`.
pub fn object() -> &'static [u8] {
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/dataplane-ebpf"))
}
