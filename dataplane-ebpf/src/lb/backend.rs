//! The backend of a flow: the tracked one, the client's affine one (ClientIP affinity, its timer
//! restarted by every packet), or the Maglev table's at the flow's hash; checked live.

#![expect(
    clippy::needless_borrows_for_generic_args,
    reason = "keys stay in the per-CPU working set"
)]

use super::conntrack::{TCP_SYN, claim_snat_port, expired, set_reply_key, touch};
use dataplane_common::{
    DropReason,
    lb::{
        Backend, CT_AFFINITY, CT_CLOSING, CT_LOCAL_CLIENT, CT_NODEPORT, CT_ORIGINAL, CT_SNAT,
        HAIRPIN_V4, HAIRPIN_V6, MAGLEV_TABLE_SIZE, SCOPE_CLUSTER, ServiceValue, backend_slot,
        flow_hash, maglev_slot,
    },
};

use crate::{
    copy::{copy_addr, set_ipv4_mapped},
    maps::{LB_AFFINITY, LB_BACKENDS, LB_CT, LB_MAGLEV, LB_MEMBERS, LOCAL_PODS},
    parse::IPPROTO_TCP,
    stage::Stage,
    work::LbScratch,
};

/// The backend `id` if it is still live (its slot not emptied or reused since).
#[inline(always)]
pub fn live_backend(id: u32) -> Option<&'static Backend> {
    LB_BACKENDS
        .get(backend_slot(id))
        .filter(|backend| backend.is_live(id))
}

/// Restarts a client's affinity timer from this packet (established flows count too).
#[inline(always)]
pub(super) fn refresh_affinity(s: &mut LbScratch, service_id: u32, backend_id: u32, now: u32) {
    copy_addr(&mut s.affinity.client, &s.flow.src);
    s.affinity.service_id = service_id;
    if let Some(entry) = LB_AFFINITY.get_ptr_mut(&s.affinity) {
        // SAFETY: a valid map value pointer; only the clock is written, and only when it moved.
        unsafe {
            if (*entry).backend_id == backend_id && (*entry).last_seen != now {
                (*entry).last_seen = now;
            }
        }
    }
}

/// Chooses the backend of a new flow (into `s.new_addr/new_port`) and records the flow in
/// both directions.
#[inline(never)]
pub(super) fn new_flow<const FROM_OUTSIDE: bool>(
    s: &mut LbScratch,
    service: &ServiceValue,
    now: u32,
) -> Stage {
    Stage::value(choose_backend::<FROM_OUTSIDE>(s, service, now).map(|()| 0))
}

/// `FROM_OUTSIDE`: the underlay's stage (NodePorts, external IPs), the only one whose flows
/// may be masqueraded to another node; the pods' programs are built without the port claim,
/// which the verifier would otherwise walk through all its attempts in them too.
#[inline(always)]
fn choose_backend<const FROM_OUTSIDE: bool>(
    s: &mut LbScratch,
    service: &ServiceValue,
    now: u32,
) -> Result<(), DropReason> {
    if service.backends == 0 {
        return Err(DropReason::LbNoEndpoints);
    }
    let backend_id = match affine_backend(s, service, now) {
        Some(id) => id,
        None => {
            let id = maglev_backend(s, service).into_value()?;
            if service.affinity_timeout != 0 {
                s.affinity_entry.backend_id = id;
                s.affinity_entry.last_seen = now;
                // A full LRU map evicts its oldest entry; an insert cannot fail otherwise.
                let _ = LB_AFFINITY.insert(&s.affinity, &s.affinity_entry, 0);
            }
            id
        }
    };
    let backend = live_backend(backend_id).ok_or(DropReason::LbNoEndpoints)?;
    copy_addr(&mut s.new_addr, &backend.addr);
    s.new_port = backend.port_be;
    s.backend_id = backend_id;
    // A pod reaching itself through its service (hairpin): its own address as the source
    // would make the pod drop the packet and answer itself locally, so the source becomes
    // the masquerade address and the replies come back here to be translated.
    let hairpin = s.new_addr == s.flow.src;
    // A NodePort packet for a backend on another node leaves with this node's address as its
    // source, so the reply comes back here to be translated (the client's address is kept
    // when the backend is local, and always with externalTrafficPolicy Local, whose table
    // holds local backends only).
    // SAFETY: only presence is checked.
    let remote =
        FROM_OUTSIDE && s.nodeport != 0 && unsafe { LOCAL_PODS.get(&s.new_addr) }.is_none();
    if hairpin {
        s.snat = 1;
        if s.ipv4 != 0 {
            set_ipv4_mapped(&mut s.snat_addr, HAIRPIN_V4);
        } else {
            copy_addr(&mut s.snat_addr, &HAIRPIN_V6);
        }
    } else if remote {
        s.snat = 1;
        copy_addr(&mut s.snat_addr, &s.node_addr);
    } else {
        copy_addr(&mut s.snat_addr, &[0; 16]);
    }
    let flags = if s.snat != 0 { CT_SNAT } else { 0 };
    let reply_flags = if s.nodeport != 0 {
        flags | CT_NODEPORT
    } else if !FROM_OUTSIDE && s.service.scope != SCOPE_CLUSTER {
        // A pod's flow to a node's NodePort (either NodePort scope).
        flags | CT_LOCAL_CLIENT
    } else {
        flags
    };

    let reply_entry = &mut s.reply_entry;
    copy_addr(&mut reply_entry.addr, &s.flow.dst);
    reply_entry.port_be = s.flow.dst_port_be;
    reply_entry.flags = reply_flags;
    reply_entry._pad = 0;
    reply_entry.backend_id = backend_id;
    reply_entry.service_id = service.id;
    reply_entry.last_seen = now;
    copy_addr(&mut reply_entry.nat_addr, &s.flow.src);
    reply_entry.nat_port_be = s.flow.src_port_be;
    reply_entry._pad2 = [0; 2];
    // The source port the translated packets leave with: the client's own, unless the flow is
    // masqueraded to this node's address; then one of the reserved range that no other flow to
    // the same backend holds, claimed by inserting the reply entry, so two CPUs never hand
    // out the same one.
    let claimed = remote && !hairpin;
    s.snat_port = s.flow.src_port_be;
    if claimed {
        s.snat_port = (claim_snat_port(s).into_value()? as u16).to_be_bytes();
    }
    let original = &mut s.original_entry;
    copy_addr(&mut original.addr, &s.new_addr);
    original.port_be = s.new_port;
    original.flags = if service.affinity_timeout != 0 {
        flags | CT_AFFINITY
    } else {
        flags
    };
    original._pad = 0;
    original.backend_id = backend_id;
    original.service_id = service.id;
    original.last_seen = now;
    copy_addr(&mut original.nat_addr, &s.snat_addr);
    original.nat_port_be = s.snat_port;
    original._pad2 = [0; 2];
    s.flow.direction = CT_ORIGINAL;
    if !claimed {
        set_reply_key(s, s.snat_port);
        // The reply entry first: a reply can never arrive before its original is sent.
        let _ = LB_CT.insert(&s.reply, &s.reply_entry, 0);
    }
    let _ = LB_CT.insert(&s.flow, &s.original_entry, 0);
    Ok(())
}

/// The client's affine backend, if it sent within the timeout and the backend still serves.
/// Leaves `s.affinity` keyed for this client either way.
#[inline(always)]
fn affine_backend(s: &mut LbScratch, service: &ServiceValue, now: u32) -> Option<u32> {
    if service.affinity_timeout == 0 {
        return None;
    }
    copy_addr(&mut s.affinity.client, &s.flow.src);
    s.affinity.service_id = service.id;
    let entry = LB_AFFINITY.get_ptr_mut(&s.affinity)?;
    // SAFETY: a valid map value pointer for this program run.
    let entry = unsafe { &mut *entry };
    if now.wrapping_sub(entry.last_seen) > service.affinity_timeout {
        return None;
    }
    live_backend(entry.backend_id)?;
    s.member.service_id = service.id;
    s.member.backend_id = entry.backend_id;
    LB_MEMBERS.get_ptr(&s.member)?;
    if entry.last_seen != now {
        entry.last_seen = now;
    }
    Some(entry.backend_id)
}

/// The Maglev table's backend for this flow's hash.
#[inline(never)]
fn maglev_backend(s: &LbScratch, service: &ServiceValue) -> Stage {
    Stage::value(maglev_lookup(s, service))
}

#[inline(always)]
fn maglev_lookup(s: &LbScratch, service: &ServiceValue) -> Result<u32, DropReason> {
    // SAFETY: the table is read before this program run ends; updates replace whole tables
    // under another index, never this one in place.
    let table = unsafe { LB_MAGLEV.get(&service.table) }.ok_or(DropReason::LbNoEndpoints)?;
    // After the lookup: its call would have every word of the hash's input spilled.
    let hash = flow_hash(&s.flow);
    // The verifier cannot bound a modulo that the compiler turned into multiplications: read
    // the slot back through a volatile load so the bounds check below stays in the program.
    let slot = maglev_slot(hash);
    // SAFETY: reading a local variable.
    let slot = unsafe { core::ptr::read_volatile(&slot) };
    if slot >= MAGLEV_TABLE_SIZE {
        return Err(DropReason::LbNoEndpoints);
    }
    Ok(table[slot])
}

/// Whether the flow is tracked with a still valid backend (then in `s.new_addr/new_port`):
/// not expired, not a new TCP connection reusing the ports of a closed one, and its backend
/// still present. A TCP flow whose backend went away is ended (`LbBackendGone`: the client
/// gets a reset); other protocols fall through to a fresh choice.
#[inline(always)]
pub(super) fn tracked_backend(s: &mut LbScratch, now: u32) -> Stage {
    Stage::value(tracked(s, now).map(u32::from))
}

#[inline(always)]
fn tracked(s: &mut LbScratch, now: u32) -> Result<bool, DropReason> {
    s.flow.direction = CT_ORIGINAL;
    let Some(entry) = LB_CT.get_ptr_mut(&s.flow) else {
        return Ok(false);
    };
    // SAFETY: a valid map value pointer for this program run.
    let entry = unsafe { &mut *entry };
    let reopened = s.tcp_flags & TCP_SYN != 0 && entry.flags & CT_CLOSING != 0;
    if expired(entry, s.flow.protocol, now) || reopened {
        return Ok(false);
    }
    if live_backend(entry.backend_id).is_none() {
        if s.flow.protocol == IPPROTO_TCP {
            return Err(DropReason::LbBackendGone);
        }
        return Ok(false);
    }
    touch(entry, s.tcp_flags, now);
    if entry.flags & CT_AFFINITY != 0 {
        refresh_affinity(s, entry.service_id, entry.backend_id, now);
    }
    copy_addr(&mut s.new_addr, &entry.addr);
    s.new_port = entry.port_be;
    s.backend_id = entry.backend_id;
    if entry.flags & CT_SNAT != 0 {
        s.snat = 1;
        copy_addr(&mut s.snat_addr, &entry.nat_addr);
        s.snat_port = entry.nat_port_be;
    }
    Ok(true)
}
