//! The dataplane agent as a library: the binary `dataplane`, the packet tests, the topology
//! tests and the benchmarks all drive the kernel programs through these modules.

/// mimalloc for every program built on this library (the agent, the CNI plugin, the tests and
/// the benchmarks, so that these measure the agent's allocator). glibc's malloc made most of a
/// large cluster's first list: a list's objects are decoded on the watcher's thread and parsed
/// and freed on its parser's (`kubernetes::Listing`), and freeing across threads locked
/// glibc's arenas against each other (the watcher's side ran 2 to 3 times slower).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Turns transparent huge pages off for this process, to be called first thing in `main` (the
/// kernel checks the flag at each page fault, so memory mapped before is covered too).
/// mimalloc asks for huge pages on its arenas (`madvise`), and with the usual `defrag=madvise`
/// each first touch of 2 MiB then waited for the kernel to find and zero a huge page: at a
/// large cluster's first sync that was 46 % of the samples (`clear_page_erms`) and the first
/// sync 0.6 s longer. The agent's data is small objects reached by pointers, which gain
/// little from fewer TLB misses. An error (a kernel without the flag) leaves the kernel's
/// default in force.
pub fn small_pages_only() -> std::io::Result<()> {
    // SAFETY: PR_SET_THP_DISABLE takes an integer flag and no pointer.
    match unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

pub mod acl;
pub mod api;
pub mod changes;
pub mod cli;
pub mod cni;
pub mod crds;
pub mod egressip;
pub mod egressrouter;
pub mod error;
pub mod gateway;
pub mod http;
pub mod hybrid;
#[cfg(test)]
mod isolation_tests;
pub mod kernel;
pub mod kubernetes;
pub mod lb;
pub mod mapsync;
pub mod metrics;
pub mod mgmt;
pub mod model;
pub mod multicast;
pub mod overlay;
pub mod parallel;
pub mod pipeline;
pub mod port;
pub mod rejected;
pub mod seq;
pub mod source;
pub mod subnets;
#[cfg(test)]
mod test_rng;
pub mod userdefinednetwork;

pub use error::AgentError;
pub use kernel::{loader::Dataplane, pins::Pins};
