//! Access control for packets leaving pods: the EgressFirewall of the pod's namespace (and, in
//! the next step, NetworkPolicy).
//!
//! Per packet: one hash lookup of the source pod; for a pod under a firewall, one hash lookup
//! per prefix length the firewall uses (at most `ACL_MAX_LENGTHS`, longest first, stopping at
//! the first hit), and when the decision depends on the port, at most three more (exact port,
//! port bucket, protocol). The agent compiled the ordered rules into these entries, so the
//! cost does not grow with the number of rules and nothing here scans a list. The cluster's
//! own networks and the node's DNS are compiled into every firewall as exempt prefixes.

use aya_ebpf::{helpers::bpf_ktime_get_ns, programs::TcContext};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    acl::{
        ACL_DIRECTION_EGRESS, ACL_ENTRY_FINAL, ACL_FAMILY_V4, ACL_FAMILY_V6, ACL_KIND_FIREWALL,
        ACL_LOG_ALLOW, ACL_LOG_DENY, ACL_MAX_LENGTHS, ACL_NO_LENGTH, ACL_PORT_BUCKET,
        ACL_PORT_EXACT, ACL_PORT_PROTOCOL, ACL_RULE_DEFAULT, ACL_RULE_EXEMPT, ACL_VERDICT_ALLOW,
        ACL_VERDICT_DENY, AclAddrKey, AclAddrValue, AclEvent, AclLogBucket, AclPortKey,
    },
    overlay::{Addr, ipv4_mapped},
};

use crate::{
    maps::{ACL_ADDRS, ACL_ENDPOINTS, ACL_EVENTS, ACL_LOG_BUCKETS, ACL_LOG_CONFIG, ACL_PORTS},
    parse::{Parsed, read},
    stage::Stage,
    stats::count_outcome,
};

const IPPROTO_TCP: u8 = 6;
const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;
/// Highest audit rate a CPU honours (events per second).
const MAX_AUDIT_RATE: u32 = 1_000_000;
/// One audit event in the token bucket's units.
const NANOS_PER_EVENT: u64 = 1_000_000_000;

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
    let (verdict, rule) = match longest_match(endpoint.firewall, ipv4, &dst, &lengths) {
        // No prefix of the firewall covers the destination: no rule matches, the default
        // allows.
        None => (ACL_VERDICT_ALLOW, ACL_RULE_DEFAULT),
        Some(entry) if entry.kind == ACL_ENTRY_FINAL => (entry.verdict, entry.rule),
        Some(entry) => port_verdict(&entry, parsed),
    };
    let denied = verdict == ACL_VERDICT_DENY;
    let wanted = if denied { ACL_LOG_DENY } else { ACL_LOG_ALLOW };
    // The cluster's own traffic is never the firewall's business, nor its log's. Allowed TCP is
    // logged once per connection, at its SYN.
    if endpoint.log & wanted != 0
        && rule != ACL_RULE_EXEMPT
        && (denied || parsed.protocol != IPPROTO_TCP || opens_connection(ctx, parsed))
    {
        let verdict = if denied {
            ACL_VERDICT_DENY
        } else {
            ACL_VERDICT_ALLOW
        };
        let outcome = audit(ctx, parsed, endpoint.firewall, rule, verdict);
        count_outcome(Hook::FromPod, outcome);
    }
    if denied {
        Err(DropReason::FirewallDenied)
    } else {
        Ok(Some(PacketClass::FirewallAllowed))
    }
}

/// Whether a TCP segment is a connection's first (SYN without ACK).
#[inline(always)]
fn opens_connection(ctx: &TcContext, parsed: &Parsed) -> bool {
    if parsed.l4_offset == 0 {
        return false;
    }
    // A variable offset: the helper, which the verifier follows without help.
    let flags: u8 = ctx.load(parsed.l4_offset + 13).unwrap_or(0);
    flags & (TCP_SYN | TCP_ACK) == TCP_SYN
}

/// Sends an audit record unless this CPU is over the rate limit or the ring is full; returns
/// what happened. The record is written in place in the ring buffer (nothing on the stack) and
/// carries how many records this CPU suppressed before it.
#[inline(never)]
fn audit(ctx: &TcContext, parsed: &Parsed, set: u32, rule: u32, verdict: u8) -> PacketClass {
    let Some(bucket) = ACL_LOG_BUCKETS.get_ptr_mut(0) else {
        return PacketClass::AuditSuppressed;
    };
    // SAFETY: this CPU's own slot of a per-CPU array, not shared with other CPUs.
    let bucket = unsafe { &mut *bucket };
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    if !take_token(bucket, now) {
        bucket.suppressed = bucket.suppressed.saturating_add(1);
        return PacketClass::AuditSuppressed;
    }
    let Some(mut entry) = ACL_EVENTS.reserve::<AclEvent>(0) else {
        bucket.suppressed = bucket.suppressed.saturating_add(1);
        return PacketClass::AuditSuppressed;
    };
    let event = entry.as_mut_ptr();
    let ipv4 = parsed.ether_type == ETH_P_IP;
    // SAFETY: `event` points at a reserved, exclusively owned AclEvent in the ring.
    unsafe {
        (*event).time_ns = now;
        (*event).set = set;
        (*event).rule = rule;
        (*event).src_port = u16::from_be_bytes(parsed.src_port);
        (*event).dst_port = u16::from_be_bytes(parsed.dst_port);
        (*event).protocol = parsed.protocol;
        (*event).verdict = verdict;
        (*event).direction = ACL_DIRECTION_EGRESS;
        (*event).kind = ACL_KIND_FIREWALL;
        (*event).suppressed = bucket.suppressed;
        match addresses(ctx, ipv4) {
            Some((src, dst)) => {
                (*event).src = src;
                (*event).dst = dst;
            }
            None => {
                (*event).src = [0; 16];
                (*event).dst = [0; 16];
            }
        }
    }
    entry.submit(0);
    bucket.suppressed = 0;
    PacketClass::AuditLogged
}

/// Takes one token of this CPU's bucket if it has one (refilled at the configured rate, up to
/// one second's worth).
#[inline(always)]
fn take_token(bucket: &mut AclLogBucket, now: u64) -> bool {
    // Bounded so that the products below cannot overflow (no 128-bit arithmetic in BPF).
    let rate = ACL_LOG_CONFIG
        .get(0)
        .map_or(0, |c| c.rate_per_second)
        .min(MAX_AUDIT_RATE) as u64;
    let burst = rate * NANOS_PER_EVENT;
    // A bucket is full after one second; longer idle times add nothing.
    let elapsed = now.saturating_sub(bucket.last_ns).min(NANOS_PER_EVENT);
    bucket.nano_tokens = bucket.nano_tokens.saturating_add(elapsed * rate).min(burst);
    bucket.last_ns = now;
    if bucket.nano_tokens < NANOS_PER_EVENT {
        return false;
    }
    bucket.nano_tokens -= NANOS_PER_EVENT;
    true
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

/// Writes `addr` with only its first `bits` bits kept into `out`: two 64-bit ANDs with a mask
/// from a table, no branch on the length (every branch here would multiply the states the
/// verifier walks through the lengths loop).
#[inline(always)]
fn mask_into(out: &mut Addr, addr: &Addr, bits: u32) {
    let Some(mask) = PREFIX_MASKS.get(bits as usize) else {
        return;
    };
    for half in 0..2 {
        let at = half * 8;
        let mut word = [0u8; 8];
        word.copy_from_slice(&addr[at..at + 8]);
        let mut keep = [0u8; 8];
        keep.copy_from_slice(&mask[at..at + 8]);
        let kept = u64::from_ne_bytes(word) & u64::from_ne_bytes(keep);
        out[at..at + 8].copy_from_slice(&kept.to_ne_bytes());
    }
}

/// The network mask of every prefix length of a 16-byte address.
static PREFIX_MASKS: [[u8; 16]; 129] = prefix_masks();

const fn prefix_masks() -> [[u8; 16]; 129] {
    let mut masks = [[0u8; 16]; 129];
    let mut len = 0;
    while len <= 128 {
        let mut byte = 0;
        while byte < 16 {
            let bits = len as i32 - byte as i32 * 8;
            masks[len][byte] = if bits >= 8 {
                0xFF
            } else if bits <= 0 {
                0
            } else {
                !(0xFFu8 >> bits)
            };
            byte += 1;
        }
        len += 1;
    }
    masks
}

/// The verdict and deciding rule of a port table for the packet's protocol and destination
/// port (port 0 for protocols without ports and for non-first fragments): an exact port, then
/// the port's 256-port bucket, then the protocol, then the table's default held in `entry`.
#[inline(always)]
fn port_verdict(entry: &AclAddrValue, parsed: &Parsed) -> (u8, u32) {
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
    (entry.verdict, entry.rule)
}

/// The verdict and rule stored under `key`, if any.
#[inline(always)]
fn port_entry(key: &AclPortKey) -> Option<(u8, u32)> {
    // SAFETY: the value is copied out before anything can change the map.
    unsafe { ACL_PORTS.get(key) }.map(|v| (v.verdict, v.rule))
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
