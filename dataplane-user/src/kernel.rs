//! The kernel side as the agent sees it: the embedded object, loading it through the verifier
//! and pinning its maps and programs, attaching the programs to devices, the maps' sizes and
//! batched access, the counters, test runs of the loaded programs, the verifier's margins, the
//! checks before any of it, and the record of what is attached where. Features write their
//! maps through [`loader::Dataplane`]; nothing here knows a feature's map contents.

pub mod attach;
pub mod batch;
pub mod capacity;
pub mod ebpf;
pub mod fill;
pub mod loader;
pub mod netdev;
pub mod netns;
pub mod pins;
pub mod preflight;
pub mod sockdiag;
pub mod sockfd;
pub mod state;
pub mod stats;
pub mod sysctl;
pub mod testrun;
pub mod verify;
