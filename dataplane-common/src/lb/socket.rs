//! Service translation at the socket (issue 73): map layouts shared by the cgroup programs
//! (`lb/socket.rs` in the kernel crate) and the agent (`lb/socket.rs` in dataplane-user).
//!
//! A socket of a pod of this node that connects (or sends an unconnected UDP datagram) to a
//! service port is given a backend's address there, once, and then talks to the backend
//! directly: no packet of the flow is translated afterwards. The socket's network namespace
//! (its cookie) says whether it belongs to a pod of this node
//! ([`crate::maps::SOCK_LB_PODS`]); the socket's own storage ([`SockRev`], in
//! [`crate::maps::SOCK_LB_REV`]) gives `getpeername` and `recvmsg` the service address back.

use crate::overlay::Addr;

/// The backends one socket remembers (see [`SockRev`]).
pub const SOCK_REV_SLOTS: usize = 4;
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
/// load-balancer source ranges, a backend of the other family, or a socket the kernel gave no
/// storage).
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

/// One backend a socket was sent to, and the service address it asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevSlot {
    /// The backend's address (IPv4 as `::ffff:a.b.c.d`); all zero: a slot not yet used.
    pub backend: Addr,
    /// The service address the socket asked for.
    pub service: Addr,
    pub backend_port_be: [u8; 2],
    pub service_port_be: [u8; 2],
    /// The backend's id in the load-balancer maps, so the agent can tell when it has left
    /// the service and end the connected sockets still sent to it.
    pub backend_id: u32,
    /// The scope of the service key the backend came from (`SCOPE_CLUSTER`, or a NodePort's
    /// `SCOPE_NODEPORT_FROM_POD` / `SCOPE_NODEPORT`, whose key holds no address: see
    /// [`SockRevSlot::service_key`]).
    pub scope: u8,
    pub _pad: [u8; 7],
}

impl SockRevSlot {
    /// The service key the backend came from, for a socket of `protocol`.
    pub fn service_key(&self, protocol: u8) -> super::ServiceKey {
        let addr = match self.scope {
            super::SCOPE_CLUSTER => self.service,
            _ if self.service[..12] == super::NODEPORT_ANY_V4[..12] => super::NODEPORT_ANY_V4,
            _ => [0; 16],
        };
        super::ServiceKey {
            addr,
            port_be: self.service_port_be,
            protocol,
            scope: self.scope,
        }
    }
}

/// The reverse translation of one socket, kept in the socket's own storage
/// (`DP_SOCK_LB_REV`, a socket-storage map): it lives and dies with the socket and is charged
/// to it, so no pod's sockets can push another pod's out (as they could from a shared LRU
/// map). A connected socket uses one slot; an unconnected UDP socket one per backend it sends
/// to, the oldest replaced when it has sent to more than [`SOCK_REV_SLOTS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRev {
    pub slots: [SockRevSlot; SOCK_REV_SLOTS],
    /// The slot the next new backend takes.
    pub next: u32,
    pub _pad: u32,
}

impl SockRev {
    /// The slot that remembers `backend` at `port_be`.
    #[inline(always)]
    pub fn find(&self, backend: &Addr, port_be: [u8; 2]) -> Option<&SockRevSlot> {
        self.slots
            .iter()
            .find(|s| s.backend_port_be == port_be && s.backend == *backend)
    }
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
    unsafe impl aya::Pod for super::SockRevSlot {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::SockRev {}
}
