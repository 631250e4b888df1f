//! Access control: NetworkPolicy for packets leaving and reaching pods, and the EgressFirewall
//! of the pod's namespace for packets leaving it.
//!
//! Per packet: a hash lookup of the source and of the destination among the local pods; for a
//! rule set that applies, one hash lookup per prefix length the set uses (at most
//! `ACL_MAX_LENGTHS`, longest first, stopping at the first hit) and, when the decision depends
//! on the port, at most three more (exact port, port bucket, protocol). Where no prefix of a
//! NetworkPolicy set allows and the set names peers by identity, two more: the peer's identity
//! (`ACL_PEERS`) and the set's entry for it, then its port table. The agent compiled the rules
//! into these entries, so the cost does not grow with the number of rules or peers and nothing
//! here scans a list.
//!
//! NetworkPolicy judges the first packet of a flow: allowed flows are tracked (`ACL_CT`) and
//! their later packets and replies pass whatever the policies say. A pod's egress is judged
//! where it sends (tc on its veth), its ingress where it receives: in the same program for a
//! sender on this node, on the veth's egress (`tc_to_pod`) for what the stack delivers, and in
//! `tc_underlay` for NodePort traffic handed straight to a local backend.
//!
//! One file (about 1,000 lines) on purpose: moving kernel functions between modules changes
//! what the optimizer inlines, and with it the verifier's walk and the stack (see
//! docs/architecture.md on `overlay.rs`); this stage is split when `cargo xtask verify` shows
//! the split costs nothing.

// Keys are passed to the map helpers by reference on purpose: by value they would be copied
// to the BPF stack, which the per-CPU working set is there to spare.
#![expect(
    clippy::needless_borrows_for_generic_args,
    reason = "keys stay in the per-CPU working set"
)]

use aya_ebpf::{
    helpers::{bpf_ktime_get_ns, bpf_skb_load_bytes},
    programs::{TcContext, XdpContext},
};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    acl::{
        ACL_CT_CLOSING, ACL_CT_INBOUND, ACL_DIRECTION_EGRESS, ACL_DIRECTION_INGRESS,
        ACL_DNS_CAPTURE, ACL_ENDPOINT_EGRESS_PEERS, ACL_ENDPOINT_INGRESS_PEERS,
        ACL_ENDPOINT_SNOOP_DNS, ACL_ENTRY_FINAL, ACL_FAMILY_V4, ACL_FAMILY_V6, ACL_KIND_FIREWALL,
        ACL_KIND_POLICY, ACL_LOG_ALLOW, ACL_LOG_DENY, ACL_MAX_LENGTHS, ACL_NO_LENGTH,
        ACL_PORT_BUCKET, ACL_PORT_EXACT, ACL_PORT_PROTOCOL, ACL_RULE_DEFAULT, ACL_RULE_EXEMPT,
        ACL_VERDICT_ALLOW, ACL_VERDICT_DENY, ACL_VERDICT_NONE, AclAddrValue, AclCtKey, AclCtValue,
        AclDnsEvent, AclEndpoint, AclEvent, AclLengths, AclLogBucket, AclPortKey,
        SERVICE_REPLY_MARK, peer_key,
    },
    lb::{CT_TIMEOUT_CLOSING, CT_TIMEOUT_OTHER, CT_TIMEOUT_TCP},
    overlay::Addr,
};

use crate::parse::{ETH_LEN, ETH_P_IP, ETH_P_IPV6};
use crate::{
    clock::now,
    copy::{copy_bytes, set_ipv4_mapped},
    maps::{
        ACL_ACTIVE, ACL_ADDRS, ACL_CT, ACL_DNS, ACL_ENDPOINTS, ACL_EVENTS, ACL_LOG_BUCKETS,
        ACL_LOG_CONFIG, ACL_NODE_ADDRS, ACL_PEERS, ACL_PORTS, ACL_SCRATCH,
    },
    parse::{IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, read_addresses},
    stage::Stage,
    stats::count_outcome,
    work::{AclWork, Parsed},
};

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
/// Highest audit rate a CPU honours (events per second).
const MAX_AUDIT_RATE: u32 = 1_000_000;
/// One audit event in the token bucket's units.
const NANOS_PER_EVENT: u64 = 1_000_000_000;

/// Whether any pod of this node is under access control (else the stage has nothing to do,
/// and its callers skip the call).
#[inline(always)]
pub fn active() -> bool {
    ACL_ACTIVE.get(0).is_some_and(|n| *n != 0)
}

/// The access-control stage for a packet leaving a pod (after the load-balancer, so a service
/// packet is judged by the backend it was sent to): the sender's egress policy, the receiver's
/// ingress policy when it is a pod on this node, then the sender's EgressFirewall. Outcomes
/// are counted here; `Err` is the drop.
#[inline(never)]
pub fn from_pod(ctx: &TcContext, parsed: &Parsed) -> Stage {
    let Some(work) = work(ctx, parsed) else {
        return Stage::new(Ok(None));
    };
    Stage::new(judge_from_pod(ctx, work).map(|()| None))
}

/// The ingress policy of the pod a packet is delivered to (`tc_to_pod`, and NodePort packets
/// handed to a local backend by `tc_underlay`). Replies the underlay reverse-NATed pass.
#[inline(never)]
pub fn to_pod(ctx: &TcContext, parsed: &Parsed, hook: Hook) -> Stage {
    let reply = skb_mark(ctx) & SERVICE_REPLY_MARK != 0;
    // A DNS answer is looked at before anything lets it through: the cluster DNS answers as
    // a service reply, a node-local resolver from the node's own address.
    if reply && !(parsed.protocol == IPPROTO_UDP && parsed.src_port == 53u16.to_be_bytes()) {
        return Stage::new(Ok(None));
    }
    let Some(work) = work(ctx, parsed) else {
        return Stage::new(Ok(None));
    };
    // SAFETY: map values stay valid under RCU for the program's run; only read here.
    let receiver = unsafe { ACL_ENDPOINTS.get(&work.flow.dst) };
    snoop_dns(ctx, work, receiver);
    if reply {
        return Stage::new(Ok(None));
    }
    // What the node itself sends (kubelet probes, host-network pods): OVN-Kubernetes lets the
    // node reach its pods whatever their policies.
    // SAFETY: the value is only tested for presence.
    if unsafe { ACL_NODE_ADDRS.get(&work.flow.src) }.is_some() {
        return Stage::new(Ok(None));
    }
    if receiver.is_some_and(AclEndpoint::policed) {
        return Stage::new(checked(police(ctx, hook, None, receiver)).map(|()| None));
    }
    // A pod under an EgressFirewall only: the connection is tracked all the same, so that
    // the pod's answers are known as such (a NodePort client through another node is seen
    // here with that node's address, which the firewall would judge as new egress).
    if receiver.is_some_and(|r| r.firewall != 0) {
        track_inbound(ctx, work);
    }
    Stage::new(Ok(None))
}

/// What [`to_pod_in_xdp`] returns for a frame it cannot judge: tc is to have it.
pub const XDP_LEAVE_TO_TC: u32 = u32::MAX;

/// [`to_pod`] for a TCP or UDP frame XDP hands straight to a local pod
/// (`overlay::deliver_in_xdp`): untagged IPv4 without options (`ipv4`) or IPv6 without
/// extension headers, a whole transport header within the frame. The caller leaves to tc what
/// only tc does here: DNS answers (the copy for the agent needs the socket buffer) and
/// service replies (the underlay's reverse NAT marks them). Returns 0 (allowed), the drop
/// reason's code, or [`XDP_LEAVE_TO_TC`].
#[inline(never)]
pub fn to_pod_in_xdp(ctx: &XdpContext, ipv4: u32) -> u32 {
    if !active() {
        return 0;
    }
    let Some(slot) = ACL_SCRATCH.get_ptr_mut(0) else {
        return XDP_LEAVE_TO_TC;
    };
    // SAFETY: this CPU's own slot, written and read within this program run.
    let work = unsafe { &mut *slot };
    let l4 = if ipv4 != 0 {
        ETH_LEN + 20
    } else {
        ETH_LEN + 40
    };
    let Some(tcp_flags) = read_frame_flow(ctx, ipv4 != 0, l4, work) else {
        return XDP_LEAVE_TO_TC;
    };
    // SAFETY: map values stay valid under RCU for the program's run; only read here.
    let receiver = unsafe { ACL_ENDPOINTS.get(&work.flow.dst) };
    // SAFETY: the value is only tested for presence.
    if unsafe { ACL_NODE_ADDRS.get(&work.flow.src) }.is_some() {
        return 0;
    }
    if let Some(endpoint) = receiver
        && endpoint.policed()
    {
        if tracked(&mut work.flow, tcp_flags) {
            count_outcome(Hook::Underlay, PacketClass::PolicyTracked);
            return 0;
        }
        return match judge_new_flow(work, Hook::Underlay, None, receiver) {
            Ok(()) => 0,
            Err(reason) => reason as u32,
        };
    }
    if receiver.is_some_and(|r| r.firewall != 0) {
        track_inbound_flags(work, tcp_flags);
    }
    0
}

/// Fills the working set from an untagged IPv4 (`ipv4`) or IPv6 frame in XDP whose TCP or UDP
/// header is at `l4`, as [`work`] does from a socket buffer; the TCP flags (0 for UDP).
#[inline(always)]
fn read_frame_flow(ctx: &XdpContext, ipv4: bool, l4: usize, work: &mut AclWork) -> Option<u8> {
    let (start, end) = (ctx.data(), ctx.data_end());
    let ip = start + ETH_LEN;
    let protocol;
    if ipv4 {
        if ip + 20 > end {
            return None;
        }
        // SAFETY: within the 20 bytes checked above.
        let header = unsafe { core::ptr::read_unaligned(ip as *const [u8; 20]) };
        protocol = header[9];
        set_ipv4_mapped(
            &mut work.flow.src,
            [header[12], header[13], header[14], header[15]],
        );
        set_ipv4_mapped(
            &mut work.flow.dst,
            [header[16], header[17], header[18], header[19]],
        );
    } else {
        if ip + 40 > end {
            return None;
        }
        // SAFETY: within the 40 bytes checked above; copied straight into place.
        unsafe {
            protocol = *((ip + 6) as *const u8);
            copy_bytes::<16>(work.flow.src.as_mut_ptr(), (ip + 8) as *const u8);
            copy_bytes::<16>(work.flow.dst.as_mut_ptr(), (ip + 24) as *const u8);
        }
    }
    if start + l4 + 4 > end {
        return None;
    }
    // SAFETY: the ports were bounds-checked just above.
    let head = unsafe { core::ptr::read_unaligned((start + l4) as *const [u8; 4]) };
    let tcp_flags = if protocol == IPPROTO_TCP {
        if start + l4 + 14 > end {
            return None;
        }
        // SAFETY: the flags byte was bounds-checked just above.
        unsafe { *((start + l4 + 13) as *const u8) }
    } else {
        0
    };
    // Field by field, volatile, straight into the slot (as [`work`] copies the parse result:
    // one unknown value for the verifier, and no copy on the stack).
    let parsed = &mut work.parsed;
    // SAFETY: plain stores into this CPU's slot.
    unsafe {
        core::ptr::write_volatile(
            &mut parsed.ether_type,
            if ipv4 { ETH_P_IP } else { ETH_P_IPV6 },
        );
        core::ptr::write_volatile(&mut parsed.l3_offset, ETH_LEN);
        core::ptr::write_volatile(&mut parsed.l4_offset, l4);
        core::ptr::write_volatile(&mut parsed.protocol, protocol);
        core::ptr::write_volatile(&mut parsed.src_port, [head[0], head[1]]);
        core::ptr::write_volatile(&mut parsed.dst_port, [head[2], head[3]]);
        let class = if protocol == IPPROTO_TCP {
            PacketClass::Tcp
        } else {
            PacketClass::Udp
        };
        core::ptr::write_volatile(&mut parsed.class, class);
        core::ptr::write_volatile(&mut parsed.fragment, 0);
        core::ptr::write_volatile(&mut parsed.frag_id, [0; 4]);
    }
    work.flow.src_port = u16::from_be_bytes([head[0], head[1]]);
    work.flow.dst_port = u16::from_be_bytes([head[2], head[3]]);
    work.flow.protocol = protocol;
    // SAFETY: the three padding bytes of the key.
    unsafe { copy_bytes::<3>(work.flow._pad.as_mut_ptr(), [0u8; 3].as_ptr()) };
    Some(tcp_flags)
}

/// Copies a DNS answer (UDP from port 53) to a pod whose admin policies name wildcard
/// domains to the agent, which learns the names' addresses from it. The packet itself goes
/// on to be judged as any other; a full ring loses the copy, not the packet.
#[inline(always)]
fn snoop_dns(ctx: &TcContext, work: &AclWork, receiver: Option<&AclEndpoint>) {
    if work.parsed.protocol != IPPROTO_UDP
        || work.flow.src_port != 53
        || receiver.is_none_or(|r| r.flags & ACL_ENDPOINT_SNOOP_DNS == 0)
    {
        return;
    }
    let Some(mut entry) = ACL_DNS.reserve::<AclDnsEvent>(0) else {
        return;
    };
    let event = entry.as_mut_ptr();
    let payload = work.parsed.l4_offset + 8;
    // SAFETY: reading a field of our own context.
    let total = unsafe { (*ctx.skb.skb).len } as usize;
    let wanted = total.saturating_sub(payload).min(ACL_DNS_CAPTURE) as u32;
    // SAFETY: `event` points at a reserved, exclusively owned AclDnsEvent in the ring. The
    // length goes through it (volatile) so that the bounds below stay in the program: the
    // verifier must see a length it knows to be within 1..=ACL_DNS_CAPTURE.
    let len = unsafe {
        (*event).src = work.flow.src;
        (*event)._pad = 0;
        core::ptr::write_volatile(&mut (*event).len, wanted);
        core::ptr::read_volatile(&(*event).len)
    };
    if len == 0 || len > ACL_DNS_CAPTURE as u32 {
        entry.discard(0);
        return;
    }
    // SAFETY: the helper writes `len` bytes into the event's message, which holds
    // ACL_DNS_CAPTURE.
    let loaded = unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb as *const _,
            payload as u32,
            (*event).message.as_mut_ptr() as *mut core::ffi::c_void,
            len,
        )
    };
    if loaded != 0 {
        entry.discard(0);
        return;
    }
    entry.submit(0);
}

/// Tracks a flow coming in to a pod that is not isolated for ingress (nothing to judge): a
/// TCP connection from its SYN, other protocols from any packet of a flow not tracked yet.
#[inline(always)]
fn track_inbound(ctx: &TcContext, work: &mut AclWork) {
    track_inbound_flags(work, tcp_flags(ctx, &work.parsed));
}

/// [`track_inbound`] for a packet with `tcp_flags`.
#[inline(always)]
fn track_inbound_flags(work: &mut AclWork, tcp_flags: u8) {
    if tracked(&mut work.flow, tcp_flags) {
        return;
    }
    if work.parsed.protocol == IPPROTO_TCP && !opens_connection(tcp_flags) {
        return;
    }
    let entry = AclCtValue {
        last_seen: now(),
        flags: ACL_CT_INBOUND,
    };
    let _ = ACL_CT.insert(&work.flow, &entry, 0);
}

/// Whether the packet answers a tracked flow that came in to the pod sending it: the reverse
/// of its flow is tracked and marked inbound (the entry is refreshed).
#[inline(always)]
fn answers_inbound(ctx: &TcContext, work: &mut AclWork) -> bool {
    let tcp_flags = tcp_flags(ctx, &work.parsed);
    reverse(&mut work.flow);
    // SAFETY: the flags are read at once.
    let inbound = unsafe { ACL_CT.get(&work.flow) }.is_some_and(|e| e.flags & ACL_CT_INBOUND != 0)
        && refresh(&work.flow, tcp_flags);
    reverse(&mut work.flow);
    inbound
}

/// What the stage works on, in this CPU's scratch slot: a copy of the parse result and the
/// packet's flow. Read back from there, the parse result is one unknown value for the verifier
/// instead of the constants of each parse path (which would have it walk everything after once
/// per kind of packet), and the stage's frames stay small. `None`: not an untagged IP packet.
#[inline(always)]
fn work(ctx: &TcContext, parsed: &Parsed) -> Option<&'static mut AclWork> {
    // Only untagged IP frames come from pods (the overlay leaves anything else to the stack).
    // With no pod under access control, nothing to look up.
    if parsed.l3_offset != ETH_LEN || ACL_ACTIVE.get(0).is_none_or(|n| *n == 0) {
        return None;
    }
    let ipv4 = family(parsed)?;
    let slot = ACL_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's own slot, written and read within this program run.
    let work = unsafe { &mut *slot };
    // SAFETY: as above; volatile so the copy is really made and read back.
    unsafe { core::ptr::write_volatile(&mut work.parsed, *parsed) };
    // Written field by field, straight into the slot (a whole key built first would take
    // stack the program does not have).
    if !read_addresses(ctx, ipv4, &mut work.flow.src, &mut work.flow.dst) {
        return None;
    }
    // The ports as they are now: the load-balancer may have rewritten them after the parse.
    if parsed.l4_offset != 0 && matches!(parsed.protocol, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP)
    {
        let ports: [u8; 4] = ctx.load(parsed.l4_offset).ok()?;
        work.parsed.src_port = [ports[0], ports[1]];
        work.parsed.dst_port = [ports[2], ports[3]];
    }
    work.flow.src_port = u16::from_be_bytes(work.parsed.src_port);
    work.flow.dst_port = u16::from_be_bytes(work.parsed.dst_port);
    work.flow.protocol = parsed.protocol;
    // SAFETY: the three padding bytes of the key (a plain store of the array would become a
    // call to `memset`).
    unsafe { copy_bytes::<3>(work.flow._pad.as_mut_ptr(), [0u8; 3].as_ptr()) };
    Some(work)
}

/// This CPU's work slot, as [`work`] filled it.
#[inline(always)]
fn current_work() -> Option<&'static mut AclWork> {
    // SAFETY: this CPU's own slot, filled earlier in this program run.
    ACL_SCRATCH.get_ptr_mut(0).map(|slot| unsafe { &mut *slot })
}

#[inline(always)]
fn judge_from_pod(ctx: &TcContext, work: &AclWork) -> Result<(), DropReason> {
    // SAFETY: map values stay valid under RCU for the program's run; only read here.
    let sender = unsafe { ACL_ENDPOINTS.get(&work.flow.src) };
    // SAFETY: as above.
    let receiver = unsafe { ACL_ENDPOINTS.get(&work.flow.dst) };
    snoop_dns(ctx, work, receiver);
    if sender.is_some_and(AclEndpoint::policed) || receiver.is_some_and(AclEndpoint::policed) {
        checked(police(ctx, Hook::FromPod, sender, receiver))?;
    }
    match sender {
        Some(endpoint) if endpoint.firewall != 0 => {
            // Answers to connections that came in to the pod are not its egress.
            if current_work().is_some_and(|work| answers_inbound(ctx, work)) {
                return Ok(());
            }
            checked(firewall(ctx, endpoint))
        }
        _ => Ok(()),
    }
}

/// The packet's `skb->mark`.
#[inline(always)]
pub fn skb_mark(ctx: &TcContext) -> u32 {
    // SAFETY: reading a field of our own context.
    unsafe { (*ctx.skb.skb).mark }
}

#[inline(always)]
fn family(parsed: &Parsed) -> Option<bool> {
    match parsed.ether_type {
        ETH_P_IP => Some(true),
        ETH_P_IPV6 => Some(false),
        _ => None,
    }
}

/// A subprogram's drop code (0: pass) as a `Result`.
#[inline(always)]
fn checked(code: u32) -> Result<(), DropReason> {
    match DropReason::from_code(code) {
        None => Ok(()),
        Some(reason) => Err(reason),
    }
}

/// NetworkPolicy for one packet: a tracked flow passes; a new one needs the sender's egress
/// set (if it is isolated) and the receiver's ingress set (if it is isolated, and on this node)
/// to allow it, and is then tracked. Returns 0 or the drop reason's code (a plain integer: a
/// subprogram's `Result` can leave register bits undefined for the verifier).
#[inline(always)]
fn police(
    ctx: &TcContext,
    hook: Hook,
    sender: Option<&AclEndpoint>,
    receiver: Option<&AclEndpoint>,
) -> u32 {
    let Some(work) = current_work() else {
        return 0;
    };
    match police_flow(ctx, work, hook, sender, receiver) {
        Ok(()) => 0,
        Err(reason) => reason as u32,
    }
}

#[inline(always)]
fn police_flow(
    ctx: &TcContext,
    work: &mut AclWork,
    hook: Hook,
    sender: Option<&AclEndpoint>,
    receiver: Option<&AclEndpoint>,
) -> Result<(), DropReason> {
    let tcp_flags = tcp_flags(ctx, &work.parsed);
    if tracked(&mut work.flow, tcp_flags) {
        count_outcome(hook, PacketClass::PolicyTracked);
        return Ok(());
    }
    // An ICMP error about a tracked flow belongs to it, as the kernel's conntrack has it
    // (RELATED): a router's fragmentation needed, a peer's port unreachable.
    if is_icmp_error(ctx, &work.parsed) && related(ctx) != 0 {
        count_outcome(hook, PacketClass::PolicyTracked);
        return Ok(());
    }
    judge_new_flow(work, hook, sender, receiver)
}

/// A flow policy has not allowed yet: the sender's egress set and the receiver's ingress set,
/// where they isolate, must allow it; it is then tracked.
#[inline(always)]
fn judge_new_flow(
    work: &mut AclWork,
    hook: Hook,
    sender: Option<&AclEndpoint>,
    receiver: Option<&AclEndpoint>,
) -> Result<(), DropReason> {
    if let Some(endpoint) = sender
        && endpoint.egress != 0
    {
        judge_direction(work, hook, endpoint, ACL_DIRECTION_EGRESS)?;
    }
    if let Some(endpoint) = receiver
        && endpoint.ingress != 0
    {
        judge_direction(work, hook, endpoint, ACL_DIRECTION_INGRESS)?;
    }
    // Judged for its receiver alone (`to_pod`): the flow came in to the pod.
    let entry = AclCtValue {
        last_seen: now(),
        flags: if sender.is_none() { ACL_CT_INBOUND } else { 0 },
    };
    let _ = ACL_CT.insert(&work.flow, &entry, 0);
    count_outcome(hook, PacketClass::PolicyAllowed);
    Ok(())
}

/// Whether the packet is an ICMP error (IPv4: destination unreachable, time exceeded,
/// parameter problem; ICMPv6: destination unreachable, packet too big, time exceeded,
/// parameter problem), which quotes the packet it is about.
#[inline(always)]
fn is_icmp_error(ctx: &TcContext, parsed: &Parsed) -> bool {
    if parsed.l4_offset == 0 {
        return false;
    }
    let ipv4 = parsed.ether_type == ETH_P_IP;
    let icmp = if ipv4 { IPPROTO_ICMP } else { IPPROTO_ICMPV6 };
    if parsed.protocol != icmp {
        return false;
    }
    let Ok(icmp_type) = ctx.load::<u8>(parsed.l4_offset) else {
        return false;
    };
    if ipv4 {
        matches!(icmp_type, 3 | 11 | 12)
    } else {
        (1..=4).contains(&icmp_type)
    }
}

/// Whether the ICMP error in this CPU's work slot quotes a packet of a tracked flow (either
/// direction): 1 or 0. A subprogram: rare, and its loads stay out of the common path.
#[inline(never)]
fn related(ctx: &TcContext) -> u32 {
    let Some(work) = current_work() else {
        return 0;
    };
    (read_quoted(ctx, work) && tracked(&mut work.quoted, 0)) as u32
}

/// Reads the flow of the packet an ICMP error quotes (its IP header and the first bytes of
/// its transport header, RFC 792 and RFC 4443) into `work.quoted`; false if it is not there.
#[inline(always)]
fn read_quoted(ctx: &TcContext, work: &mut AclWork) -> bool {
    let inner = work.parsed.l4_offset + 8;
    let quoted = &mut work.quoted;
    let inner_l4 = if work.parsed.ether_type == ETH_P_IP {
        let Ok(head) = ctx.load::<[u8; 4]>(inner) else {
            return false;
        };
        let Ok(rest) = ctx.load::<[u8; 16]>(inner + 4) else {
            return false;
        };
        if head[0] >> 4 != 4 {
            return false;
        }
        quoted.protocol = rest[5];
        set_ipv4_mapped(&mut quoted.src, [rest[8], rest[9], rest[10], rest[11]]);
        set_ipv4_mapped(&mut quoted.dst, [rest[12], rest[13], rest[14], rest[15]]);
        inner + ((head[0] & 0x0F) as usize) * 4
    } else {
        let Ok(head) = ctx.load::<[u8; 8]>(inner) else {
            return false;
        };
        if head[0] >> 4 != 6 {
            return false;
        }
        quoted.protocol = head[6];
        // Fixed-size loads (the helper with a slice may be asked for zero bytes, which the
        // verifier refuses).
        let Ok(src) = ctx.load::<Addr>(inner + 8) else {
            return false;
        };
        quoted.src = src;
        let Ok(dst) = ctx.load::<Addr>(inner + 24) else {
            return false;
        };
        quoted.dst = dst;
        inner + 40
    };
    let (src_port, dst_port) =
        if matches!(quoted.protocol, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP) {
            let Ok(ports) = ctx.load::<[u8; 4]>(inner_l4) else {
                return false;
            };
            (
                u16::from_be_bytes([ports[0], ports[1]]),
                u16::from_be_bytes([ports[2], ports[3]]),
            )
        } else {
            (0, 0)
        };
    quoted.src_port = src_port;
    quoted.dst_port = dst_port;
    quoted._pad = [0; 3];
    true
}

/// One end's policy set for a new flow: the sender's egress set judges the destination, the
/// receiver's ingress set the source. The decision is audited when the namespace asks.
#[inline(always)]
fn judge_direction(
    work: &mut AclWork,
    hook: Hook,
    endpoint: &AclEndpoint,
    direction: u8,
) -> Result<(), DropReason> {
    let ipv4 = work.parsed.ether_type == ETH_P_IP;
    let egress = direction == ACL_DIRECTION_EGRESS;
    let (set, lengths, peers, denied) = if egress {
        (
            endpoint.egress,
            &endpoint.egress_lengths,
            ACL_ENDPOINT_EGRESS_PEERS,
            DropReason::PolicyDeniedEgress,
        )
    } else {
        (
            endpoint.ingress,
            &endpoint.ingress_lengths,
            ACL_ENDPOINT_INGRESS_PEERS,
            DropReason::PolicyDeniedIngress,
        )
    };
    work.lengths = family_lengths(lengths, ipv4);
    let (mut verdict, mut rule) = decide(set, !egress);
    // No prefix allowed it: the peer's identity may (a policy set's rules only allow, so
    // either lookup allowing is the set allowing).
    if verdict == ACL_VERDICT_NONE && endpoint.flags & peers != 0 {
        let packed = lookup_peer(set, !egress as u32);
        (verdict, rule) = ((packed >> 32) as u8, packed as u32);
    }
    let allowed = verdict == ACL_VERDICT_ALLOW;
    let packed = pack(verdict_of(allowed), direction, ACL_KIND_POLICY);
    log_policy(endpoint, set, rule, packed, hook);
    if allowed { Ok(()) } else { Err(denied) }
}

#[inline(always)]
const fn verdict_of(allowed: bool) -> u8 {
    if allowed {
        ACL_VERDICT_ALLOW
    } else {
        ACL_VERDICT_DENY
    }
}

/// Sends an audit record of a policy decision when the pod's namespace asks for it.
#[inline(always)]
fn log_policy(endpoint: &AclEndpoint, set: u32, rule: u32, packed: u32, hook: Hook) {
    let wanted = if packed as u8 == ACL_VERDICT_ALLOW {
        ACL_LOG_ALLOW
    } else {
        ACL_LOG_DENY
    };
    if endpoint.log & wanted != 0 && rule != ACL_RULE_EXEMPT {
        count_outcome(hook, audit(set, rule, packed));
    }
}

/// Whether the packet belongs to a flow policy already allowed, in either direction. `key` is
/// the packet's flow; it is reversed for the reply lookup and restored.
#[inline(always)]
fn tracked(key: &mut AclCtKey, tcp_flags: u8) -> bool {
    if refresh(key, tcp_flags) {
        return true;
    }
    reverse(key);
    let reply = refresh(key, tcp_flags);
    reverse(key);
    reply
}

#[inline(always)]
fn reverse(key: &mut AclCtKey) {
    core::mem::swap(&mut key.src, &mut key.dst);
    core::mem::swap(&mut key.src_port, &mut key.dst_port);
}

/// Whether `key` is a live tracked flow; refreshes it (at most once per clock second) and
/// notes a FIN or RST. A SYN on a closing flow starts a new one, judged again.
#[inline(always)]
fn refresh(key: &AclCtKey, tcp_flags: u8) -> bool {
    let Some(entry) = ACL_CT.get_ptr_mut(key) else {
        return false;
    };
    // SAFETY: an LRU map value, valid for the program's run; only this flow's packets write it
    // and a lost update is harmless.
    let entry = unsafe { &mut *entry };
    let now = now();
    let closing = entry.flags & ACL_CT_CLOSING != 0;
    let timeout = if closing {
        CT_TIMEOUT_CLOSING
    } else if key.protocol == IPPROTO_TCP {
        CT_TIMEOUT_TCP
    } else {
        CT_TIMEOUT_OTHER
    };
    if now.wrapping_sub(entry.last_seen) > timeout || (closing && opens_connection(tcp_flags)) {
        return false;
    }
    if entry.last_seen != now {
        entry.last_seen = now;
    }
    if tcp_flags & (TCP_FIN | TCP_RST) != 0 && !closing {
        entry.flags |= ACL_CT_CLOSING;
    }
    true
}

/// The TCP flags of a TCP segment, 0 otherwise.
#[inline(always)]
fn tcp_flags(ctx: &TcContext, parsed: &Parsed) -> u8 {
    if parsed.protocol != IPPROTO_TCP || parsed.l4_offset == 0 {
        return 0;
    }
    // A variable offset: the helper, which the verifier follows without help.
    ctx.load(parsed.l4_offset + 13).unwrap_or(0)
}

#[inline(always)]
fn family_lengths(lengths: &AclLengths, ipv4: bool) -> [u8; ACL_MAX_LENGTHS] {
    if ipv4 { lengths.v4 } else { lengths.v6 }
}

/// The verdict and deciding rule of `set` for the packet in the working set, whose peer is
/// its source (`from_source`) or destination, looked up with the prefix lengths in
/// `work.lengths`: the longest prefix, then its port table. `ACL_VERDICT_NONE`: no rule
/// matched.
#[inline(always)]
fn decide(set: u32, from_source: bool) -> (u8, u32) {
    let packed = lookup_set(set, from_source as u32);
    ((packed >> 32) as u8, packed as u32)
}

/// [`decide`] as a subprogram returning `verdict << 32 | rule`: each caller then continues
/// from one unknown result instead of one state per path through the lengths loop, which
/// keeps the verifier's work linear in the number of rule sets a packet meets. Its keys are
/// built in the working set, not on the stack.
#[inline(never)]
fn lookup_set(set: u32, from_source: u32) -> u64 {
    let (verdict, rule) = match current_work() {
        None => (ACL_VERDICT_NONE, ACL_RULE_DEFAULT),
        Some(work) => match longest_match(work, set, from_source != 0) {
            None => (ACL_VERDICT_NONE, ACL_RULE_DEFAULT),
            Some(entry) if entry.kind == ACL_ENTRY_FINAL => (entry.verdict, entry.rule),
            Some(entry) => port_verdict(work, entry),
        },
    };
    (verdict as u64) << 32 | rule as u64
}

/// The verdict and rule of `set`'s entry for the identity of the packet's peer (its source
/// when `from_source`), as [`lookup_set`] packs them; `ACL_VERDICT_NONE` when the peer has no
/// identity or the set no entry for it. A subprogram, as [`lookup_set`] is.
#[inline(never)]
fn lookup_peer(set: u32, from_source: u32) -> u64 {
    let (verdict, rule) = match current_work() {
        None => (ACL_VERDICT_NONE, ACL_RULE_DEFAULT),
        Some(work) => match peer_entry(work, set, from_source != 0) {
            None => (ACL_VERDICT_NONE, ACL_RULE_DEFAULT),
            Some(entry) if entry.kind == ACL_ENTRY_FINAL => (entry.verdict, entry.rule),
            Some(entry) => port_verdict(work, entry),
        },
    };
    (verdict as u64) << 32 | rule as u64
}

/// `set`'s entry for the identity `ACL_PEERS` gives the packet's peer, if both exist.
#[inline(always)]
fn peer_entry(work: &mut AclWork, set: u32, from_source: bool) -> Option<&'static AclAddrValue> {
    let peer = if from_source {
        &work.flow.src
    } else {
        &work.flow.dst
    };
    // SAFETY: the identity is copied out at once.
    let identity = *unsafe { ACL_PEERS.get(peer) }?;
    work.addr_key = peer_key(set, identity);
    // SAFETY: map values stay valid under RCU for the program's run; only read.
    unsafe { ACL_ADDRS.get(&work.addr_key) }
}

/// The EgressFirewall of the sender's namespace: no rule matching allows. Returns 0 or the
/// drop reason's code.
#[inline(never)]
fn firewall(ctx: &TcContext, endpoint: &AclEndpoint) -> u32 {
    let Some(work) = current_work() else {
        return 0;
    };
    let ipv4 = work.parsed.ether_type == ETH_P_IP;
    work.lengths = family_lengths(&endpoint.firewall_lengths, ipv4);
    let (verdict, rule) = decide(endpoint.firewall, false);
    let denied = verdict == ACL_VERDICT_DENY;
    let wanted = if denied { ACL_LOG_DENY } else { ACL_LOG_ALLOW };
    // The cluster's own traffic is never the firewall's business, nor its log's. Allowed TCP is
    // logged once per connection, at its SYN.
    if endpoint.log & wanted != 0
        && rule != ACL_RULE_EXEMPT
        && (denied
            || work.parsed.protocol != IPPROTO_TCP
            || opens_connection(tcp_flags(ctx, &work.parsed)))
    {
        let packed = pack(verdict_of(!denied), ACL_DIRECTION_EGRESS, ACL_KIND_FIREWALL);
        count_outcome(Hook::FromPod, audit(endpoint.firewall, rule, packed));
    }
    if denied {
        return DropReason::FirewallDenied as u32;
    }
    count_outcome(Hook::FromPod, PacketClass::FirewallAllowed);
    0
}

/// Verdict, direction and kind of an audit record in one argument (BPF calls take five).
#[inline(always)]
const fn pack(verdict: u8, direction: u8, kind: u8) -> u32 {
    verdict as u32 | (direction as u32) << 8 | (kind as u32) << 16
}

/// Whether TCP flags open a connection (SYN without ACK).
#[inline(always)]
const fn opens_connection(tcp_flags: u8) -> bool {
    tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
}

/// Sends an audit record unless this CPU is over the rate limit or the ring is full; returns
/// what happened. The record is written in place in the ring buffer (nothing on the stack) and
/// carries how many records this CPU suppressed before it.
#[inline(never)]
fn audit(set: u32, rule: u32, packed: u32) -> PacketClass {
    let Some(work) = current_work() else {
        return PacketClass::AuditSuppressed;
    };
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
    // SAFETY: `event` points at a reserved, exclusively owned AclEvent in the ring.
    unsafe {
        (*event).time_ns = now;
        (*event).set = set;
        (*event).rule = rule;
        (*event).src_port = work.flow.src_port;
        (*event).dst_port = work.flow.dst_port;
        (*event).protocol = work.flow.protocol;
        (*event).verdict = packed as u8;
        (*event).direction = (packed >> 8) as u8;
        (*event).kind = (packed >> 16) as u8;
        (*event).suppressed = bucket.suppressed;
        (*event).src = work.flow.src;
        (*event).dst = work.flow.dst;
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

/// The entry of the longest of `work.lengths` that has one for the packet's peer (its source
/// when `from_source`, else its destination) in `set`.
#[inline(always)]
fn longest_match(work: &mut AclWork, set: u32, from_source: bool) -> Option<&'static AclAddrValue> {
    let ipv4 = work.parsed.ether_type == ETH_P_IP;
    let key = &mut work.addr_key;
    key.set = set;
    key.family = if ipv4 { ACL_FAMILY_V4 } else { ACL_FAMILY_V6 };
    key._pad = [0; 2];
    let peer = if from_source {
        &work.flow.src
    } else {
        &work.flow.dst
    };
    // IPv4 is IPv4-mapped: its prefix starts after the 96 leading bits.
    let offset: u32 = if ipv4 { 96 } else { 0 };
    for &len in &work.lengths {
        if len == ACL_NO_LENGTH {
            break;
        }
        key.len = len;
        mask_into(&mut key.addr, peer, offset + u32::from(len));
        // SAFETY: map values stay valid under RCU for the program's run; only read.
        if let Some(entry) = unsafe { ACL_ADDRS.get(&*key) } {
            return Some(entry);
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
fn port_verdict(work: &mut AclWork, entry: &AclAddrValue) -> (u8, u32) {
    let port = u16::from_be_bytes(work.parsed.dst_port);
    let key = &mut work.port_key;
    key.table = entry.table;
    key.protocol = work.parsed.protocol;
    key.kind = ACL_PORT_EXACT;
    key.port = port;
    if entry.port_kinds & ACL_PORT_EXACT != 0
        && let Some(found) = port_entry(key)
    {
        return found;
    }
    if entry.port_kinds & ACL_PORT_BUCKET != 0 {
        key.kind = ACL_PORT_BUCKET;
        key.port = port & 0xFF00;
        if let Some(found) = port_entry(key) {
            return found;
        }
    }
    if entry.port_kinds & ACL_PORT_PROTOCOL != 0 {
        key.kind = ACL_PORT_PROTOCOL;
        key.port = 0;
        if let Some(found) = port_entry(key) {
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
