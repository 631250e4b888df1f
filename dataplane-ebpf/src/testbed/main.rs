//! The test bed's kernel programs, an object of their own (`dataplane-testbed`) so that the
//! dataplane's object holds only what a node runs: the empty programs every benchmark is
//! measured against (`baseline`) and the XDP switch of the fabric that joins the simulated
//! nodes (`fabric`). Built beside the dataplane's object by dataplane-user's build script;
//! only the tests and benchmarks load it.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod baseline;
#[cfg(target_arch = "bpf")]
mod fabric;
#[cfg(target_arch = "bpf")]
mod maps;

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any path that could reach here; this only satisfies no_std.
    loop {}
}

#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";

#[cfg(not(target_arch = "bpf"))]
fn main() {}
