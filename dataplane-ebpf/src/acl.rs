//! Access control for packets leaving pods: the EgressFirewall of the pod's namespace (and, in
//! the next step, NetworkPolicy).
//!
//! Per packet: one hash lookup of the source pod; for a pod under a firewall, one hash lookup
//! per prefix length the firewall uses (at most `ACL_MAX_LENGTHS`, longest first, stopping at
//! the first hit), and when the decision depends on the port, at most three more (exact port,
//! port bucket, protocol). The agent compiled the ordered rules into these entries, so the
//! cost does not grow with the number of rules and nothing here scans a list. The cluster's
//! own networks and the node's DNS are compiled into every firewall as exempt prefixes.

use aya_ebpf::programs::TcContext;
use dataplane_common::{
    DropReason, PacketClass,
    acl::{
        ACL_ENTRY_FINAL, ACL_FAMILY_V4, ACL_FAMILY_V6, ACL_MAX_LENGTHS, ACL_NO_LENGTH,
        ACL_PORT_BUCKET, ACL_PORT_EXACT, ACL_PORT_PROTOCOL, ACL_VERDICT_DENY, AclAddrKey,
        AclAddrValue, AclPortKey,
    },
    overlay::{Addr, ipv4_mapped},
};

use crate::{
    maps::{ACL_ADDRS, ACL_ENDPOINTS, ACL_PORTS},
    parse::{Parsed, read},
    stage::Stage,
};

const ETH_LEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;

/// The EgressFirewall stage for a packet leaving a pod (after the load-balancer, so a service
/// packet is judged by the backend it was sent to). `Ok(None)`: the pod's namespace has no
/// firewall; `Ok(Some(FirewallAllowed))` or `Err(FirewallDenied)` otherwise.
#[inline(never)]
pub fn firewall(ctx: &TcContext, parsed: &Parsed) -> Stage {
    Stage::new(judge(ctx, parsed).map(|done| done.map(|class| (0, class))))
}

#[inline(always)]
fn judge(ctx: &TcContext, parsed: &Parsed) -> Result<Option<PacketClass>, DropReason> {
    // Only untagged IP frames come from pods (the overlay leaves anything else to the stack).
    if parsed.l3_offset != ETH_LEN {
        return Ok(None);
    }
    let ipv4 = match parsed.ether_type {
        ETH_P_IP => true,
        ETH_P_IPV6 => false,
        _ => return Ok(None),
    };
    let Some((src, dst)) = addresses(ctx, ipv4) else {
        return Ok(None);
    };
    // SAFETY: the value is copied out before anything can change the map.
    let Some(endpoint) = (unsafe { ACL_ENDPOINTS.get(src) }).copied() else {
        return Ok(None);
    };
    if endpoint.firewall == 0 {
        return Ok(None);
    }
    let lengths = if ipv4 {
        endpoint.firewall_lengths.v4
    } else {
        endpoint.firewall_lengths.v6
    };
    let verdict = match longest_match(endpoint.firewall, ipv4, &dst, &lengths) {
        // No prefix of the firewall covers the destination: no rule matches, the default
        // allows.
        None => return Ok(Some(PacketClass::FirewallAllowed)),
        Some(entry) if entry.kind == ACL_ENTRY_FINAL => entry.verdict,
        Some(entry) => port_verdict(&entry, parsed),
    };
    if verdict == ACL_VERDICT_DENY {
        Err(DropReason::FirewallDenied)
    } else {
        Ok(Some(PacketClass::FirewallAllowed))
    }
}

/// The entry of the longest of the set's prefix lengths that has one for `dst`.
#[inline(always)]
fn longest_match(
    set: u32,
    ipv4: bool,
    dst: &Addr,
    lengths: &[u8; ACL_MAX_LENGTHS],
) -> Option<AclAddrValue> {
    let mut key = AclAddrKey {
        set,
        family: if ipv4 { ACL_FAMILY_V4 } else { ACL_FAMILY_V6 },
        len: 0,
        _pad: [0; 2],
        addr: *dst,
    };
    // IPv4 is IPv4-mapped: its prefix starts after the 96 leading bits.
    let offset: u32 = if ipv4 { 96 } else { 0 };
    for &len in lengths {
        if len == ACL_NO_LENGTH {
            break;
        }
        key.len = len;
        mask_into(&mut key.addr, dst, offset + u32::from(len));
        // SAFETY: the value is copied out before anything can change the map.
        if let Some(entry) = unsafe { ACL_ADDRS.get(key) } {
            return Some(*entry);
        }
    }
    None
}

/// Writes `addr` with only its first `bits` bits kept into `out`, a 32-bit word at a time.
#[inline(always)]
fn mask_into(out: &mut Addr, addr: &Addr, bits: u32) {
    for word in 0..4 {
        let at = word * 4;
        let value = u32::from_be_bytes([addr[at], addr[at + 1], addr[at + 2], addr[at + 3]]);
        let start = (word * 32) as u32;
        let kept = if bits >= start + 32 {
            value
        } else if bits <= start {
            0
        } else {
            value & (u32::MAX << (32 - (bits - start)))
        };
        out[at..at + 4].copy_from_slice(&kept.to_be_bytes());
    }
}

/// The verdict of a port table for the packet's protocol and destination port (port 0 for
/// protocols without ports and for non-first fragments): an exact port, then the port's
/// 256-port bucket, then the protocol, then the table's default held in `entry`.
#[inline(always)]
fn port_verdict(entry: &AclAddrValue, parsed: &Parsed) -> u8 {
    let port = u16::from_be_bytes(parsed.dst_port);
    let mut key = AclPortKey {
        table: entry.table,
        protocol: parsed.protocol,
        kind: ACL_PORT_EXACT,
        port,
    };
    if entry.port_kinds & ACL_PORT_EXACT != 0
        && let Some(found) = port_entry(&key)
    {
        return found;
    }
    if entry.port_kinds & ACL_PORT_BUCKET != 0 {
        key.kind = ACL_PORT_BUCKET;
        key.port = port & 0xFF00;
        if let Some(found) = port_entry(&key) {
            return found;
        }
    }
    if entry.port_kinds & ACL_PORT_PROTOCOL != 0 {
        key.kind = ACL_PORT_PROTOCOL;
        key.port = 0;
        if let Some(found) = port_entry(&key) {
            return found;
        }
    }
    entry.verdict
}

/// The verdict stored under `key`, if any.
#[inline(always)]
fn port_entry(key: &AclPortKey) -> Option<u8> {
    // SAFETY: the value is copied out before anything can change the map.
    unsafe { ACL_PORTS.get(key) }.map(|v| v.verdict)
}

/// Source and destination of an IP packet in the 16-byte form, read straight from the packet.
#[inline(always)]
fn addresses(ctx: &TcContext, ipv4: bool) -> Option<(Addr, Addr)> {
    if ipv4 {
        let a: [u8; 8] = read(ctx, ETH_LEN + 12)?;
        Some((
            ipv4_mapped([a[0], a[1], a[2], a[3]]),
            ipv4_mapped([a[4], a[5], a[6], a[7]]),
        ))
    } else {
        Some((read(ctx, ETH_LEN + 8)?, read(ctx, ETH_LEN + 24)?))
    }
}
