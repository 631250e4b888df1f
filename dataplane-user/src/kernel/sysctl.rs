//! Where the agent reads and writes sysctls. `/proc/sys` by default; in a container that is
//! not privileged, where the runtime mounts `/proc/sys` read-only, the host's `/proc/sys/net`
//! mounted at another place (`--proc-sys-dir`, the DaemonSet mounts it at
//! `/host/proc/sys/net`). Network sysctls resolve in the network namespace of the thread that
//! opens them, so that one mount serves the node's namespace and, from a thread that entered
//! it, a pod's.

use std::{
    path::{Path, PathBuf},
    sync::OnceLock,
};

/// The default root.
pub const DEFAULT_ROOT: &str = "/proc/sys";

static ROOT: OnceLock<PathBuf> = OnceLock::new();

/// Sets the root for the life of the process (once, before anything reads a sysctl); later
/// calls change nothing.
pub fn set_root(root: &Path) {
    let _ = ROOT.set(root.to_owned());
}

/// The file of sysctl `key` (`net/ipv4/ip_local_reserved_ports`).
pub fn path(key: &str) -> PathBuf {
    ROOT.get()
        .map_or_else(|| PathBuf::from(DEFAULT_ROOT), Clone::clone)
        .join(key)
}
