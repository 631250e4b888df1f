//! Service translation at the socket (issue 73): map layouts shared by the cgroup programs
//! (`lb/socket.rs` in the kernel crate) and the agent (`lb/socket.rs` in dataplane-user).
//!
//! A socket of a pod of this node that connects (or sends an unconnected UDP datagram) to a
//! service port is given a backend's address there, once, and then talks to the backend
//! directly: no packet of the flow is translated afterwards. The socket's network namespace
//! (its cookie) says whether it belongs to a pod of this node
//! ([`crate::maps::SOCK_LB_PODS`]); the reverse
//! map ([`SockRevKey`]) gives `getpeername` and `recvmsg` the service address back.

use crate::overlay::Addr;

/// Entries of the reverse map (an LRU map: a socket's entry is needed while it lives, and
/// the least recently used go first when sockets outnumber it).
pub const SOCK_REV_ENTRIES: u32 = 65_536;
/// Pod network namespaces one node holds at most in the scope map (as many as local pods).
pub const SOCK_LB_MAX_PODS: u32 = crate::maps::MAX_LOCAL_PODS;

/// `SOCK_LB_STATS` slots (per-CPU counters).
pub const SOCK_STAT_CONNECT: u32 = 0;
/// An unconnected UDP datagram sent to a backend.
pub const SOCK_STAT_SENDMSG: u32 = 1;
/// A connect or send to a service without endpoints, refused (`ECONNREFUSED`).
pub const SOCK_STAT_REFUSED: u32 = 2;
/// A service address given back to `getpeername` or `recvmsg`.
pub const SOCK_STAT_REVERSED: u32 = 3;
/// A connect or send to a service port left to the per-packet path (ClientIP affinity,
/// load-balancer source ranges, or a backend of the other family).
pub const SOCK_STAT_PASSED: u32 = 4;
pub const SOCK_STAT_SLOTS: u32 = 5;
/// The counters' names, by slot (`dataplane status`, metrics).
pub const SOCK_STAT_NAMES: [&str; SOCK_STAT_SLOTS as usize] =
    ["connect", "sendmsg", "refused", "reversed", "passed"];

/// Value of the scope map (`DP_SOCK_LB_PODS`, keyed by a network namespace's cookie): the
/// pod's host-side veth, for inspection.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockPod {
    pub ifindex: u32,
    pub _pad: u32,
}

/// Key of the reverse map: a socket (its cookie) and the backend it was sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevKey {
    pub cookie: u64,
    /// The backend's address (IPv4 as `::ffff:a.b.c.d`).
    pub addr: Addr,
    pub port_be: [u8; 2],
    pub _pad: [u8; 6],
}

/// Value of the reverse map: the service address and port the socket asked for, the
/// backend it was given (by id, so the agent can tell when it leaves its service and end the
/// connected sockets still sent to it) and the socket's network namespace (where to look
/// for the socket then).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevValue {
    pub addr: Addr,
    pub port_be: [u8; 2],
    pub _pad: [u8; 2],
    pub backend_id: u32,
    pub netns: u64,
}

/// The hash a socket's backend is chosen by (its Maglev slot, see
/// [`super::maglev_slot`]): the socket's cookie, unique for the kernel's uptime, so each
/// connection is spread as a flow's tuple spreads it on the per-packet path (the source port
/// is not yet chosen when `connect` runs). Defined once so tests can predict the choice.
#[inline(always)]
pub const fn socket_hash(cookie: u64) -> u32 {
    super::finalize((cookie as u32) ^ super::finalize((cookie >> 32) as u32 ^ 0x50c4_e7b1))
}

#[cfg(feature = "user")]
mod pod_impls {
    // SAFETY: plain #[repr(C)] data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::SockPod {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::SockRevKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::SockRevValue {}
}
