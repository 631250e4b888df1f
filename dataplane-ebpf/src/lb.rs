//! Service load-balancing (replacing kube-proxy) for traffic leaving pods.
//!
//! A packet to a service port is sent to one backend: the one its tracked flow already uses, or
//! for a new flow the client's affine backend (ClientIP affinity) or the service's Maglev table
//! at the flow's hash. The destination is rewritten there (DNAT) and the overlay stage then
//! delivers the packet to the backend's pod, on this node or through Geneve. Replies are given
//! the service address back (reverse NAT) wherever they reach the client's node: leaving a
//! local backend pod (tc on its veth) or decapsulated from the underlay (tc on the NIC).
//!
//! Per packet: one conntrack lookup for replies, else one service lookup, one conntrack lookup
//! and, for a new flow, one table and one backend lookup. Nothing scans a list. Timestamps in
//! the maps are refreshed in place at most once per clock second, so a busy flow or client
//! costs no map update per packet.

// Keys are passed to the map helpers by reference on purpose: by value they would be copied
// to the BPF stack, which the per-CPU working set is there to spare.
#![expect(
    clippy::needless_borrows_for_generic_args,
    reason = "keys stay in the per-CPU working set"
)]

use aya_ebpf::programs::TcContext;
use dataplane_common::{
    DropReason, PacketClass,
    lb::{
        BACKEND_PORTS_BASE, CT_CLOSING, CT_ESTABLISHED, CT_LOCAL_CLIENT, CT_NODEPORT, CT_REPLY,
        CT_SNAT, CtValue, NODEPORT_ANY_V4, SCOPE_CLUSTER, SCOPE_EXTERNAL, SCOPE_NODEPORT,
        SCOPE_NODEPORT_FROM_POD, SERVICE_PORTS_BASE, SOURCE_RANGE_ALLOW, SOURCE_RANGE_FULL_BITS,
    },
    overlay::{OVERLAY_HAS_IPV4, OVERLAY_HAS_IPV6, OVERLAY_NODEPORT_LISTED, OverlayConfig},
};

use crate::lookup;
use crate::parse::{ETH_LEN, ETH_P_IP};
use crate::{
    clock::now,
    copy::{copy_addr, set_ipv4_mapped},
    maps::{LB_CT, LB_NODEPORT_ADDRS, LB_SERVICES, LB_SOURCE_RANGES, NODE_ADDRS},
    overlay,
    parse::{IPPROTO_TCP, IPPROTO_UDP},
    stage::{Stage, reverse_nat, routed_out},
    work::{LbScratch, Parsed},
};

mod backend;
pub mod cache;
mod conntrack;
mod icmp_error;
mod reject;
mod rewrite;
mod sctp;
mod socket;
pub mod xdp;

use backend::{new_flow, tracked_backend};
use conntrack::{TCP_SYN, expired, opening, original_key_of, read_flow, scratch, touch};
use rewrite::{Side, rewrite};

pub use icmp_error::{icmp_error_reverse_nat, untranslate_icmp_error};
pub use reject::{answer_counted, answerable};
pub use rewrite::rewrite_address;
pub use sctp::{follow_sctp, follow_sctp_ports};

/// The tc stage for a packet leaving a pod: reverse NAT of a local backend's reply, or DNAT of
/// a packet to a service port. `Ok(None)`: not service traffic.
///
/// The stage's value is 0 when the packet continues (rewritten or not), and [`routed_out`] of
/// the tc verdict when the load-balancer has routed it out itself. A service without
/// endpoints or a TCP flow whose backend is gone is the drop `LbNoEndpoints` or
/// `LbBackendGone`, which the caller answers with [`answer`].
#[inline(never)]
pub fn from_pod(ctx: &TcContext, parsed: &Parsed) -> Stage {
    let s = match unreplied_flow(ctx, parsed) {
        Ok(s) => s,
        Err(done) => return done,
    };
    dnat_stage(dnat::<false>(ctx, parsed, s, SCOPE_CLUSTER))
}

/// The stage on a pod veth's egress (`tc_to_pod`): reverse NAT of the replies of service
/// flows whose backend is this node itself (a host-network endpoint, such as the API server
/// behind the `kubernetes` Service): the node's stack sends those straight to the pod, past
/// every other place replies are translated. Values as for [`from_pod`]; nothing else done.
#[inline(never)]
pub fn to_pod(ctx: &TcContext, parsed: &Parsed) -> Stage {
    match unreplied_flow(ctx, parsed) {
        Ok(_) => Stage::new(Ok(None)),
        Err(done) => done,
    }
}

/// The tc stage on the underlay NIC: reverse NAT of replies from remote backends (XDP has
/// already decapsulated them) and of NodePort replies, and DNAT of NodePort packets to this
/// node's own addresses. Values as for [`from_pod`]; a DNAT'd packet continues to the overlay
/// stage, which delivers it to its backend here or on another node.
#[inline(never)]
pub fn from_underlay(ctx: &TcContext, parsed: &Parsed) -> Stage {
    let s = match unreplied_flow(ctx, parsed) {
        Ok(s) => s,
        Err(done) => return done,
    };
    let Some(config) = lookup::overlay_config() else {
        return Stage::new(Ok(None));
    };
    let mut scope = outside_scope(config, s);
    // A hybrid node's pod reaches cluster services through the node its VXLAN came to (the
    // replies come back here: masqueraded when the backend is elsewhere, as for a NodePort).
    // Looked up only for a service port: other packets pay nothing for it.
    if scope == SCOPE_EXTERNAL
        && lookup::port_marked(SERVICE_PORTS_BASE, s.flow.dst_port_be)
        && lookup::is_hybrid_pod(parsed.ether_type, &s.flow.src)
    {
        scope = SCOPE_CLUSTER;
    }
    s.nodeport = 1;
    dnat_stage(dnat::<true>(ctx, parsed, s, scope))
}

/// The DNAT result as the stage's outcome.
#[inline(always)]
fn dnat_stage(result: Result<Option<PacketClass>, DropReason>) -> Stage {
    Stage::new(result.map(|done| done.map(|class| (0, class))))
}

/// The scope of a packet from outside, with `s.node_addr` set to this node's address of its
/// family: to that address, a NodePort; to another, an external or load-balancer IP routed
/// to this node.
#[inline(always)]
fn outside_scope(config: &OverlayConfig, s: &mut LbScratch) -> u8 {
    let has_address = if s.ipv4 != 0 {
        set_ipv4_mapped(&mut s.node_addr, config.node_ipv4);
        config.flags & OVERLAY_HAS_IPV4 != 0
    } else {
        copy_addr(&mut s.node_addr, &config.node_ipv6);
        config.flags & OVERLAY_HAS_IPV6 != 0
    };
    if config.flags & OVERLAY_NODEPORT_LISTED != 0 {
        return listed_scope(s);
    }
    if has_address && s.flow.dst == s.node_addr {
        SCOPE_NODEPORT
    } else {
        SCOPE_EXTERNAL
    }
}

/// The scope of a packet from outside when `--nodeport-addresses` lists networks: a NodePort
/// on the addresses it gave, else an external or load-balancer IP.
// Not inlined: inlined, its lookup cost the callers' frames 16 bytes of stack.
#[inline(never)]
fn listed_scope(s: &LbScratch) -> u8 {
    // SAFETY: only presence is checked.
    if unsafe { LB_NODEPORT_ADDRS.get(&s.flow.dst) }.is_some() {
        SCOPE_NODEPORT
    } else {
        SCOPE_EXTERNAL
    }
}

/// `s.service`: the key of the service port the flow is addressed to in `scope` (NodePorts
/// are keyed by port alone).
#[inline(always)]
fn set_service_key(s: &mut LbScratch, scope: u8) {
    let addr = if scope == SCOPE_CLUSTER || scope == SCOPE_EXTERNAL {
        &s.flow.dst
    } else if s.ipv4 != 0 {
        &NODEPORT_ANY_V4
    } else {
        &[0; 16]
    };
    copy_addr(&mut s.service.addr, addr);
    s.service.port_be = s.flow.dst_port_be;
    s.service.protocol = s.flow.protocol;
    s.service.scope = scope;
}

/// The packet's flow in this CPU's working set, or the finished stage when the load-balancer
/// has nothing more to do: not TCP or UDP, or a reply that reverse NAT has just translated.
#[inline(always)]
fn unreplied_flow(ctx: &TcContext, parsed: &Parsed) -> Result<&'static mut LbScratch, Stage> {
    let s = scratch().ok_or(Stage::new(Ok(None)))?;
    if !read_flow(ctx, parsed, s) {
        return Err(Stage::new(Ok(None)));
    }
    match replied(ctx, parsed, s) {
        Some(done) => Err(done),
        None => Ok(s),
    }
}

/// The reverse-NAT outcome as a finished stage, or `None` when the packet is no reply.
#[inline(always)]
fn replied(ctx: &TcContext, parsed: &Parsed, s: &mut LbScratch) -> Option<Stage> {
    match reverse_nat(ctx, parsed, s).into_value() {
        Ok(reverse_nat::UNTOUCHED) => None,
        Ok(reverse_nat::TRANSLATED) => {
            Some(Stage::new(Ok(Some((0, PacketClass::ServiceReverseNat)))))
        }
        // Routed out by us: the stage says so with the verdict (`routed_out`).
        Ok(routed) => Some(Stage::new(Ok(Some((
            routed_out(reverse_nat::verdict_of(routed)),
            PacketClass::ServiceReverseNat,
        ))))),
        Err(reason) => Some(Stage::new(Err(reason))),
    }
}

#[inline(always)]
fn dnat<const FROM_OUTSIDE: bool>(
    ctx: &TcContext,
    parsed: &Parsed,
    s: &mut LbScratch,
    scope: u8,
) -> Result<Option<PacketClass>, DropReason> {
    if !lookup::port_marked(SERVICE_PORTS_BASE, s.flow.dst_port_be) {
        return Ok(None);
    }
    let now = now();
    // An established flow first: it needs no service lookup (its entry holds all it needs),
    // and keeps its backend even while its service changes.
    if tracked_backend(s, now).into_value()? == 0 {
        set_service_key(s, scope);
        // SAFETY: the value is copied out at once.
        let mut found = unsafe { LB_SERVICES.get(&s.service) }.copied();
        // A pod to a node's address and NodePort (its own node's or another's): translated
        // here at the source, as a ClusterIP is, so that the reply comes back the way the
        // request went (through the overlay) rather than from a node that never saw a pod.
        if !FROM_OUTSIDE && found.is_none() && to_a_node(s) {
            // An externalTrafficPolicy: Local NodePort has a key for pods (every endpoint,
            // as kube-proxy sends them); any other NodePort's own key has every endpoint.
            set_service_key(s, SCOPE_NODEPORT_FROM_POD);
            // SAFETY: the value is copied out at once.
            found = unsafe { LB_SERVICES.get(&s.service) }.copied();
            if found.is_none() {
                s.service.scope = SCOPE_NODEPORT;
                // SAFETY: the value is copied out at once.
                found = unsafe { LB_SERVICES.get(&s.service) }.copied();
            }
        }
        let Some(service) = found else {
            return Ok(None);
        };
        // A load-balancer address with source ranges takes new flows from those alone,
        // before anything else is decided (kube-proxy's firewall check comes first too);
        // NodePorts are not subject to them, as with kube-proxy.
        if scope != SCOPE_NODEPORT && !source_allowed(s) {
            return Err(DropReason::LbSourceRange);
        }
        // Only a connection's opening is given a backend and entries: a stray segment (or a
        // flood of spoofed ones) takes no room in the conntrack map and no masquerade port.
        // (A service without endpoints answers anything, as kube-proxy rejects it.)
        if service.backends != 0 && !opening(s) {
            return Err(DropReason::LbNotOpening);
        }
        new_flow::<FROM_OUTSIDE>(s, &service, now).into_value()?;
        if !FROM_OUTSIDE {
            // A pod's veth: the pod that opened it is known.
            crate::stats::count_pod_flow(crate::stats::device(ctx));
        }
    }
    copy_addr(&mut s.old_addr, &s.flow.dst);
    s.old_port = s.flow.dst_port_be;
    rewrite(ctx, parsed, s, Side::Destination).into_value()?;
    if s.snat != 0 {
        copy_addr(&mut s.old_addr, &s.flow.src);
        s.old_port = s.flow.src_port_be;
        copy_addr(&mut s.new_addr, &s.snat_addr);
        s.new_port = s.snat_port;
        rewrite(ctx, parsed, s, Side::Source).into_value()?;
    }
    s.cacheable = (s.snat == 0 && s.nodeport == 0) as u8;
    Ok(Some(PacketClass::ServiceDnat))
}

/// Whether the flow goes to a cluster node's underlay address.
#[inline(always)]
fn to_a_node(s: &LbScratch) -> bool {
    // SAFETY: only presence is checked.
    unsafe { NODE_ADDRS.get(&s.flow.dst) }.is_some()
}

/// Whether the flow's source may open a flow to its destination: an address without source
/// ranges has no entry (a miss), one with ranges answers allow or deny in one lookup.
#[inline(always)]
fn source_allowed(s: &mut LbScratch) -> bool {
    // Field by field: the key is packed (no references into it) and lives in the per-CPU
    // working set, not on the stack.
    s.range.prefix_len = SOURCE_RANGE_FULL_BITS;
    s.range.data.addr = s.flow.dst;
    s.range.data.port_be = s.flow.dst_port_be;
    s.range.data.protocol = s.flow.protocol;
    s.range.data._pad = 0;
    s.range.data.source = s.flow.src;
    LB_SOURCE_RANGES
        .get(&s.range)
        .is_none_or(|verdict| *verdict == SOURCE_RANGE_ALLOW)
}

/// Removes a finished flow's two entries, from its reply entry (`s.flow`, the reply key):
/// the new connection on its tuple must meet neither.
#[inline(always)]
fn forget_flow(s: &mut LbScratch, reply: &CtValue) {
    original_key_of(&mut s.reply, reply, s.flow.protocol);
    let _ = LB_CT.remove(&s.reply);
    let _ = LB_CT.remove(&s.flow);
}

/// Gives a reply the service address and port its client sent to, if the flow is tracked.
#[inline(always)]
fn reverse_nat(ctx: &TcContext, parsed: &Parsed, s: &mut LbScratch) -> Stage {
    Stage::value(reverse_nat_flow(ctx, parsed, s))
}

#[inline(always)]
fn reverse_nat_flow(
    ctx: &TcContext,
    parsed: &Parsed,
    s: &mut LbScratch,
) -> Result<u32, DropReason> {
    // Only a backend's port can be the source of a reply.
    if !lookup::port_marked(BACKEND_PORTS_BASE, s.flow.src_port_be) {
        return Ok(0);
    }
    s.flow.direction = CT_REPLY;
    let Some(entry) = LB_CT.get_ptr_mut(&s.flow) else {
        return Ok(0);
    };
    // SAFETY: a valid map value pointer for this program run.
    let entry = unsafe { &mut *entry };
    let now = now();
    if expired(entry, s.flow.protocol, now) {
        return Ok(0);
    }
    // A SYN-ACK on the tuple of a service flow whose backend has sent more than its own
    // SYN-ACK (or has closed) answers a new connection the client made straight to the
    // backend's address from the same port (one through the service would have renewed the
    // entries with its SYN): the service flow is over, and this is not its reply.
    if s.tcp_flags & TCP_SYN != 0 && entry.flags & (CT_ESTABLISHED | CT_CLOSING) != 0 {
        cache::forget_reply(s);
        forget_flow(s, entry);
        return Ok(0);
    }
    touch(entry, s.tcp_flags, now);
    copy_addr(&mut s.old_addr, &s.flow.src);
    s.old_port = s.flow.src_port_be;
    copy_addr(&mut s.new_addr, &entry.addr);
    s.new_port = entry.port_be;
    rewrite(ctx, parsed, s, Side::Source).into_value()?;
    s.cacheable = (entry.flags & (CT_SNAT | CT_NODEPORT) == 0) as u8;
    s.backend_id = entry.backend_id;
    if entry.flags & CT_SNAT != 0 {
        // A hairpin reply: addressed to the masquerade address, it goes back to the client.
        copy_addr(&mut s.old_addr, &s.flow.dst);
        s.old_port = s.flow.dst_port_be;
        copy_addr(&mut s.new_addr, &entry.nat_addr);
        s.new_port = entry.nat_port_be;
        rewrite(ctx, parsed, s, Side::Destination).into_value()?;
    }
    if entry.flags & CT_NODEPORT != 0 {
        // Its source is now this node's address: the stack would refuse to forward it, so
        // it is routed out of the underlay here.
        let verdict = overlay::route_out(ctx, parsed).into_value()?;
        return Ok(reverse_nat::routed(verdict));
    }
    if entry.flags & CT_LOCAL_CLIENT != 0 {
        // To a pod of this node from a node's address (a NodePort it sent to): handed to the
        // pod here, as the stack would not forward it when the address is this node's.
        let Ok((pod, _)) = overlay::local_pod(ctx, parsed) else {
            return Err(DropReason::OverlayNoRoute);
        };
        return Ok(reverse_nat::routed(overlay::to_local_pod(ctx, &pod) as u32));
    }
    Ok(reverse_nat::TRANSLATED)
}
