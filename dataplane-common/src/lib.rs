//! Types and constants shared by the kernel programs (`dataplane-ebpf`) and the agent
//! (`dataplane-user`). Everything that crosses the kernel/user boundary is defined here once:
//! map names, program names, drop reasons, counter indices and map value layouts.
#![no_std]

pub mod acl;
pub mod drop;
pub mod egressip;
pub mod frag;
pub mod hybrid;
pub mod lb;
pub mod maps;
pub mod multicast;
pub mod overlay;
pub mod port;
pub mod stats;
pub mod testbed;

pub use drop::DropReason;
pub use stats::{Hook, PacketClass};
