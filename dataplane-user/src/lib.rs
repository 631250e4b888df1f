//! The dataplane agent as a library: the binary `dataplane`, the packet tests, the topology
//! tests and the benchmarks all drive the kernel programs through these modules.

pub mod acl;
pub mod attach;
pub mod batch;
pub mod capacity;
pub mod cni;
pub mod ebpf;
pub mod egressip;
pub mod error;
pub mod gateway;
pub mod hybrid;
pub mod inspect;
pub mod ipam;
pub mod kubernetes;
pub mod lb;
pub mod loader;
pub mod metrics;
pub mod mgmt;
pub mod model;
pub mod multicast;
pub mod netdev;
pub mod overlay;
pub mod pins;
pub mod port;
pub mod preflight;
pub mod source;
pub mod state;
pub mod stats;
pub mod status;
pub mod sync;
#[cfg(test)]
mod test_rng;
pub mod testrun;
pub mod trace;
pub mod verify;

pub use error::AgentError;
pub use loader::Dataplane;
pub use pins::Pins;
