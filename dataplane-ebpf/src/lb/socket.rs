//! Service translation at the socket (`--socket-lb`): cgroup programs on the node's cgroup v2
//! root. A pod of this node that connects, or sends an unconnected UDP datagram, to a service
//! port is given a backend's address there, once per connection (or datagram), chosen from
//! the same maps as the per-packet path (the service port's Maglev table, live backends); the
//! socket then talks to the backend directly, so no packet of the flow is translated, and
//! NetworkPolicy and the overlay see the backend's address as they see it after the
//! per-packet DNAT. `getpeername` and `recvmsg` give the service address back.
//!
//! A node's address and NodePort (any node's, as the per-packet path translates a pod's flow
//! there at the source) is served as a ClusterIP is, from the NodePort's key.
//!
//! Left to the per-packet path, unchanged: sockets of any other network namespace (other
//! nodes' pods in a test bed, host-network processes unless `--socket-lb-host`, other hosts'
//! containers), service ports with ClientIP affinity (its timer runs from the last packet,
//! which only the per-packet path sees), load-balancer addresses with source ranges, SCTP, and
//! everything from outside the node.
//!
//! Cost: one lookup of the socket's namespace on every connect and UDP send of the machine;
//! for this node's pods, one service lookup, and for a service port its table, backend and
//! the socket's own storage (where the way back to the service address is kept: it goes with
//! the socket, so no pod's sockets can push out another's). Nothing per packet.

#![expect(
    clippy::needless_borrows_for_generic_args,
    reason = "keys are small locals; by reference as the map helpers take them"
)]

use aya_ebpf::{
    EbpfContext,
    bindings::bpf_sock_addr,
    helpers::generated::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_set_retval},
    macros::cgroup_sock_addr,
    maps::lpm_trie::Key,
    programs::SockAddrContext,
};
use dataplane_common::{
    lb::{
        MAGLEV_TABLE_SIZE, NODEPORT_ANY_V4, SCOPE_CLUSTER, SCOPE_NODEPORT, SCOPE_NODEPORT_FROM_POD,
        SOURCE_RANGE_FULL_BITS, ServiceKey, ServiceValue, SourceRangeKey, maglev_slot,
        socket::{
            SOCK_REV_SLOTS, SOCK_STAT_CONNECT, SOCK_STAT_PASSED, SOCK_STAT_REFUSED,
            SOCK_STAT_REVERSED, SOCK_STAT_SENDMSG, SockRev, SockRevSlot, socket_hash,
        },
    },
    overlay::{Addr, FAMILY_IPV4, FAMILY_IPV6},
};

use super::backend::live_backend;
use crate::{
    maps::{
        LB_MAGLEV, LB_SERVICES, LB_SOURCE_RANGES, NODE_ADDRS, SOCK_LB_PODS, SOCK_LB_REV,
        SOCK_LB_STATS,
    },
    parse::{IPPROTO_TCP, IPPROTO_UDP},
};

/// The hook's verdict: the call goes on (with whatever address the program wrote).
const PROCEED: i32 = 1;
/// The hook's verdict: the call fails, with the error set by `bpf_set_retval`.
const REFUSE: i32 = 0;
const ECONNREFUSED: i32 = 111;

#[cgroup_sock_addr(connect4)]
pub fn sock_connect4(ctx: SockAddrContext) -> i32 {
    translate::<false>(&ctx, SOCK_STAT_CONNECT)
}

#[cgroup_sock_addr(connect6)]
pub fn sock_connect6(ctx: SockAddrContext) -> i32 {
    translate::<true>(&ctx, SOCK_STAT_CONNECT)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn sock_sendmsg4(ctx: SockAddrContext) -> i32 {
    translate::<false>(&ctx, SOCK_STAT_SENDMSG)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn sock_sendmsg6(ctx: SockAddrContext) -> i32 {
    translate::<true>(&ctx, SOCK_STAT_SENDMSG)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn sock_recvmsg4(ctx: SockAddrContext) -> i32 {
    restore_service::<false>(&ctx)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn sock_recvmsg6(ctx: SockAddrContext) -> i32 {
    restore_service::<true>(&ctx)
}

#[cgroup_sock_addr(getpeername4)]
pub fn sock_peername4(ctx: SockAddrContext) -> i32 {
    restore_service::<false>(&ctx)
}

#[cgroup_sock_addr(getpeername6)]
pub fn sock_peername6(ctx: SockAddrContext) -> i32 {
    restore_service::<true>(&ctx)
}

/// Gives a pod's connect or send to a service port a backend's address. `V6`: the socket's
/// call is IPv6 (an IPv4 service reached through a v4-mapped address on a dual-stack
/// socket is looked up as such: service keys hold IPv4 in that form).
#[inline(always)]
fn translate<const V6: bool>(ctx: &SockAddrContext, counter: u32) -> i32 {
    // SAFETY: the helper only reads the context the kernel passed.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    // SAFETY: only presence is checked.
    if unsafe { SOCK_LB_PODS.get(&netns) }.is_none() {
        return PROCEED;
    }
    let sa = ctx.sock_addr;
    let protocol = read(sa, |a| &a.protocol) as u8;
    if protocol != IPPROTO_TCP && protocol != IPPROTO_UDP {
        return PROCEED;
    }
    // The address and port the socket asked for, given back by getpeername and recvmsg.
    let asked = destination::<V6>(sa);
    let mut key = ServiceKey {
        addr: asked,
        port_be: (read(sa, |a| &a.user_port) as u16).to_ne_bytes(),
        protocol,
        scope: SCOPE_CLUSTER,
    };
    let Some(service) = service_of(&mut key) else {
        return PROCEED;
    };
    if service.backends == 0 {
        bump(SOCK_STAT_REFUSED);
        // SAFETY: a helper of cgroup programs; the error is what the caller gets.
        unsafe { bpf_set_retval(-ECONNREFUSED) };
        return REFUSE;
    }
    if service.affinity_timeout != 0 || (key.scope == SCOPE_CLUSTER && has_source_ranges(&key)) {
        bump(SOCK_STAT_PASSED);
        return PROCEED;
    }
    // SAFETY: the helper only reads the context the kernel passed.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // SAFETY: the table is read before this run ends; updates replace whole tables under
    // another index, never this one in place.
    let Some(table) = (unsafe { LB_MAGLEV.get(&service.table) }) else {
        return PROCEED;
    };
    let slot = maglev_slot(socket_hash(cookie));
    // The verifier cannot bound a modulo the compiler turned into multiplications.
    // SAFETY: reading a local variable.
    let slot = unsafe { core::ptr::read_volatile(&slot) };
    if slot >= MAGLEV_TABLE_SIZE {
        return PROCEED;
    }
    let backend_id = table[slot];
    let Some(backend) = live_backend(backend_id) else {
        return PROCEED;
    };
    let family = if V6 && !is_ipv4_mapped(&asked) {
        FAMILY_IPV6
    } else {
        FAMILY_IPV4
    };
    if backend.family != family {
        bump(SOCK_STAT_PASSED);
        return PROCEED;
    }
    // SAFETY: the helper reads the context's own socket; the storage is zeroed when created.
    let rev = unsafe { SOCK_LB_REV.get_or_insert_ptr_mut(ctx, None) };
    if rev.is_null() {
        // No storage for this socket (its memory allowance is spent): without a way back to
        // the service address, it stays on the per-packet path.
        bump(SOCK_STAT_PASSED);
        return PROCEED;
    }
    // SAFETY: this socket's storage, valid while this run holds the socket.
    let rev = unsafe { &mut *rev };
    let index = slot_for(rev, &backend.addr, backend.port_be);
    rev.slots[index] = SockRevSlot {
        backend: backend.addr,
        service: asked,
        backend_port_be: backend.port_be,
        service_port_be: key.port_be,
        backend_id,
        scope: key.scope,
        _pad: [0; 7],
    };
    set_destination::<V6>(sa, &backend.addr, backend.port_be);
    bump(counter);
    PROCEED
}

/// Gives `getpeername` and `recvmsg` of a translated socket the service address back for
/// its backend's. These hooks must let the call go on whatever they do.
#[inline(always)]
fn restore_service<const V6: bool>(ctx: &SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: the helper reads the context's own socket; no storage is created here.
    let rev = unsafe { SOCK_LB_REV.get_ptr_mut(ctx) };
    if rev.is_null() {
        return PROCEED;
    }
    // SAFETY: this socket's storage, valid while this run holds the socket.
    let rev = unsafe { &*rev };
    let backend = destination::<V6>(sa);
    let port_be = (read(sa, |a| &a.user_port) as u16).to_ne_bytes();
    let mut i = 0;
    while i < SOCK_REV_SLOTS {
        let slot = &rev.slots[i];
        if slot.backend_port_be == port_be && slot.backend == backend {
            set_destination::<V6>(sa, &slot.service, slot.service_port_be);
            bump(SOCK_STAT_REVERSED);
            break;
        }
        i += 1;
    }
    PROCEED
}

/// The service port `key` (a ClusterIP, external or load-balancer address as asked) names;
/// failing that, when the address is a node's, its NodePort, keyed as the per-packet path keys
/// a pod's flow to a node's address and NodePort (any node's: translated at the source, as a
/// ClusterIP is). `key` is left as the key found.
#[inline(always)]
fn service_of(key: &mut ServiceKey) -> Option<ServiceValue> {
    // SAFETY: the value is copied out at once.
    if let Some(found) = unsafe { LB_SERVICES.get(&*key) }.copied() {
        return Some(found);
    }
    // SAFETY: only presence is checked.
    unsafe { NODE_ADDRS.get(&key.addr) }?;
    key.addr = if is_ipv4_mapped(&key.addr) {
        NODEPORT_ANY_V4
    } else {
        [0; 16]
    };
    // An externalTrafficPolicy: Local NodePort has a key for pods (every endpoint); any other
    // NodePort's own key has every endpoint.
    key.scope = SCOPE_NODEPORT_FROM_POD;
    // SAFETY: the value is copied out at once.
    if let Some(found) = unsafe { LB_SERVICES.get(&*key) }.copied() {
        return Some(found);
    }
    key.scope = SCOPE_NODEPORT;
    // SAFETY: the value is copied out at once.
    unsafe { LB_SERVICES.get(&*key) }.copied()
}

/// The slot of `rev` that `backend` takes: the one that already remembers it, else the next
/// in turn (the oldest, once all are used).
#[inline(always)]
fn slot_for(rev: &mut SockRev, backend: &Addr, port_be: [u8; 2]) -> usize {
    let mut i = 0;
    while i < SOCK_REV_SLOTS {
        if rev.slots[i].backend_port_be == port_be && rev.slots[i].backend == *backend {
            return i;
        }
        i += 1;
    }
    let next = rev.next as usize % SOCK_REV_SLOTS;
    rev.next = ((next + 1) % SOCK_REV_SLOTS) as u32;
    next
}

/// Whether the load-balancer address has source ranges (it then has an entry for every
/// source, the deny-all one at least): the per-packet path judges its flows.
#[inline(always)]
fn has_source_ranges(service: &ServiceKey) -> bool {
    let key = Key::new(
        SOURCE_RANGE_FULL_BITS,
        SourceRangeKey {
            addr: service.addr,
            port_be: service.port_be,
            protocol: service.protocol,
            _pad: 0,
            source: [0; 16],
        },
    );
    LB_SOURCE_RANGES.get(&key).is_some()
}

/// The call's address (`user_ip4` as `::ffff:a.b.c.d`, or `user_ip6`).
#[inline(always)]
fn destination<const V6: bool>(sa: *mut bpf_sock_addr) -> Addr {
    let mut addr = [0u8; 16];
    if V6 {
        let mut i = 0;
        while i < 4 {
            let word = read(sa, |a| &a.user_ip6[i]).to_ne_bytes();
            addr[i * 4..i * 4 + 4].copy_from_slice(&word);
            i += 1;
        }
    } else {
        addr[10] = 0xff;
        addr[11] = 0xff;
        addr[12..].copy_from_slice(&read(sa, |a| &a.user_ip4).to_ne_bytes());
    }
    addr
}

/// Writes the call's address and port (`addr` IPv4 as `::ffff:a.b.c.d` when not `V6`).
#[inline(always)]
fn set_destination<const V6: bool>(sa: *mut bpf_sock_addr, addr: &Addr, port_be: [u8; 2]) {
    // SAFETY: the kernel's context for this run; the fields written are writable for these
    // hooks, as whole words.
    unsafe {
        if V6 {
            let mut i = 0;
            while i < 4 {
                let word = u32::from_ne_bytes([
                    addr[i * 4],
                    addr[i * 4 + 1],
                    addr[i * 4 + 2],
                    addr[i * 4 + 3],
                ]);
                core::ptr::write_volatile(&mut (*sa).user_ip6[i], word);
                i += 1;
            }
        } else {
            let word = u32::from_ne_bytes([addr[12], addr[13], addr[14], addr[15]]);
            core::ptr::write_volatile(&mut (*sa).user_ip4, word);
        }
        core::ptr::write_volatile(&mut (*sa).user_port, u32::from(u16::from_ne_bytes(port_be)));
    }
}

/// One whole word of the context (the verifier checks the access's size and offset).
#[inline(always)]
fn read(sa: *mut bpf_sock_addr, field: impl Fn(&bpf_sock_addr) -> &u32) -> u32 {
    // SAFETY: the kernel's context for this run, read as a whole word.
    unsafe { core::ptr::read_volatile(field(&*sa)) }
}

#[inline(always)]
fn is_ipv4_mapped(addr: &Addr) -> bool {
    addr[..10] == [0; 10] && addr[10] == 0xff && addr[11] == 0xff
}

#[inline(always)]
fn bump(counter: u32) {
    if let Some(slot) = SOCK_LB_STATS.get_ptr_mut(counter) {
        // SAFETY: this CPU's own slot of a per-CPU array.
        unsafe { *slot += 1 };
    }
}
