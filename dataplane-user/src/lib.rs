//! The dataplane agent as a library: the binary `dataplane`, the packet tests, the topology
//! tests and the benchmarks all drive the kernel programs through these modules.

/// mimalloc for every program built on this library (the agent, the CNI plugin, the tests and
/// the benchmarks, so that these measure the agent's allocator). glibc's malloc made most of a
/// large cluster's first list: a list's objects are decoded on the watcher's thread and parsed
/// and freed on its parser's (`kubernetes::Listing`), and freeing across threads locked
/// glibc's arenas against each other (the watcher's side ran 2 to 3 times slower).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
pub mod parallel;
pub mod pins;
pub mod port;
pub mod preflight;
pub mod seq;
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
