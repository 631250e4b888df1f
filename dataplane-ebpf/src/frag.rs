//! IP fragments: the ports of a datagram's first fragment, remembered per (source,
//! destination, identification, protocol) as Cilium does, so that its later fragments, which
//! carry no transport header, are judged and load-balanced like the first.

use aya_ebpf::programs::TcContext;
use dataplane_common::{
    DropReason,
    frag::{FRAG_FIRST, FRAG_LAST, FRAG_LATER, FRAG_NONE, FragKey, FragPorts},
};

use crate::parse::ETH_LEN;
use crate::{
    maps::{FRAG_KEY, FRAGS, PARSED},
    parse::{ETH_P_IP, read_addresses},
    stage::Stage,
    work::Parsed,
};

/// After the parse (and port security): a first fragment's ports are remembered; a later
/// fragment is given its first's ports in this CPU's parse slot (`parsed` is that slot), or
/// is refused when its first was not seen here (`fragment_without_first`); the last one's
/// entry goes at this CPU's next fragment ([`forget_last_datagram`]).
#[inline(always)]
pub fn follow_first(ctx: &TcContext, parsed: &Parsed) -> Result<(), DropReason> {
    if parsed.fragment == FRAG_NONE {
        return Ok(());
    }
    follow(ctx).into_value().map(|_| ())
}

/// [`follow_first`]'s work, as a subprogram: fragments are rare, and its key building would
/// otherwise weigh on the common path's registers.
#[inline(never)]
fn follow(ctx: &TcContext) -> Stage {
    Stage::value(remember_or_fill(ctx).map(|()| 0))
}

#[inline(always)]
fn remember_or_fill(ctx: &TcContext) -> Result<(), DropReason> {
    let parsed = PARSED
        .get_ptr_mut(0)
        .ok_or(DropReason::ScratchUnavailable)?;
    // SAFETY: this CPU's own parse slot, used by one program run at a time.
    let parsed = unsafe { &mut *parsed };
    let key = FRAG_KEY
        .get_ptr_mut(0)
        .ok_or(DropReason::ScratchUnavailable)?;
    // SAFETY: as above, this CPU's own key slot.
    let key = unsafe { &mut *key };
    // Tagged frames are left alone: no stage after this one translates or judges them.
    let known = parsed.l3_offset == ETH_LEN
        && read_addresses(
            ctx,
            parsed.ether_type == ETH_P_IP,
            &mut key.src,
            &mut key.dst,
        );
    if !known {
        return if parsed.fragment >= FRAG_LATER && parsed.l3_offset == ETH_LEN {
            Err(DropReason::FragmentWithoutFirst)
        } else {
            Ok(())
        };
    }
    key.id = parsed.frag_id;
    key.protocol = parsed.protocol;
    key._pad = [0; 3];
    forget_last_datagram(key);
    if parsed.fragment == FRAG_FIRST {
        let ports = FragPorts {
            src_port: parsed.src_port,
            dst_port: parsed.dst_port,
        };
        // LRU: when full, the datagram seen longest ago makes room.
        let _ = FRAGS.insert(key, ports, 0);
        return Ok(());
    }
    // SAFETY: the value is copied out at once.
    let ports = *unsafe { FRAGS.get(*key) }.ok_or(DropReason::FragmentWithoutFirst)?;
    parsed.src_port = ports.src_port;
    parsed.dst_port = ports.dst_port;
    if parsed.fragment == FRAG_LAST
        && let Some(pending) = FRAG_KEY.get_ptr_mut(1)
    {
        // SAFETY: this CPU's own slot.
        let pending = unsafe { &mut *pending };
        *pending = *key;
        pending._pad[0] = PENDING;
    }
    Ok(())
}

/// Slot 1 of `FRAG_KEY` holds a last fragment's key whose entry is still to go.
const PENDING: u8 = 1;

/// Removes the entry of the datagram whose last fragment this CPU saw before, unless `key`
/// is that datagram's (the same last fragment passing a second program of this node, one
/// after the other on this CPU: a pod's veth, then the receiving pod's). A datagram's entry
/// so goes with its last fragment, rather than waiting for the LRU map to push it out (a
/// sender of many fragmented datagrams filled it with dead ones); at most one waits per CPU.
#[inline(always)]
fn forget_last_datagram(key: &FragKey) {
    let Some(pending) = FRAG_KEY.get_ptr_mut(1) else {
        return;
    };
    // SAFETY: this CPU's own slot, used by one program run at a time.
    let pending = unsafe { &mut *pending };
    if pending._pad[0] != PENDING {
        return;
    }
    pending._pad[0] = 0;
    if pending.src == key.src
        && pending.dst == key.dst
        && pending.id == key.id
        && pending.protocol == key.protocol
    {
        pending._pad[0] = PENDING;
        return;
    }
    let _ = FRAGS.remove(pending);
}

/// After the load-balancer rewrote a later fragment's address: the port its flow was
/// translated to, for the stages after it (which read a fragment's ports from the parse slot,
/// there being none in the packet).
#[inline(always)]
pub fn translated(source: bool, port: [u8; 2]) {
    let Some(parsed) = PARSED.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's own parse slot, used by one program run at a time.
    let parsed = unsafe { &mut *parsed };
    if source {
        parsed.src_port = port;
    } else {
        parsed.dst_port = port;
    }
}
