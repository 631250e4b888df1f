//! Kernel programs of the dataplane. Built for `bpfel-unknown-none` by dataplane-user's build
//! script; on the host this crate compiles to an empty binary so workspace-wide checks work.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
// The BPF target's `core` has no atomic read-modify-write (no compare-and-swap), and LLVM
// emits a fetching atomic add only for BPF v3 programs: the one such add
// (`lb::conntrack::fetch_increment`) is the instruction itself, in assembly.
#![cfg_attr(target_arch = "bpf", feature(asm_experimental_arch))]

#[cfg(target_arch = "bpf")]
mod acl;
#[cfg(target_arch = "bpf")]
mod clock;
#[cfg(target_arch = "bpf")]
mod copy;
#[cfg(target_arch = "bpf")]
mod csum;
#[cfg(target_arch = "bpf")]
mod egressip;
#[cfg(target_arch = "bpf")]
mod frag;
#[cfg(target_arch = "bpf")]
mod hybrid;
#[cfg(target_arch = "bpf")]
mod icmp;
#[cfg(target_arch = "bpf")]
mod lb;
#[cfg(target_arch = "bpf")]
mod lookup;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod multicast;
#[cfg(target_arch = "bpf")]
mod overlay;
#[cfg(target_arch = "bpf")]
mod parse;
#[cfg(target_arch = "bpf")]
mod pod;
#[cfg(target_arch = "bpf")]
mod port;
#[cfg(target_arch = "bpf")]
mod stage;
#[cfg(target_arch = "bpf")]
mod stats;
#[cfg(target_arch = "bpf")]
mod tunnel;
#[cfg(target_arch = "bpf")]
mod underlay;
#[cfg(target_arch = "bpf")]
mod work;

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
