//! Multicast per namespace (`dataplane_common::multicast`).
//!
//! Leaving a pod (`tc_from_pod_multicast`, after port security): a pod of a namespace that has
//! not enabled multicast sends none (its IGMP and MLD go to the stack, as every pod's link
//! plumbing did before). IGMP and MLD messages of the others go to the agent,
//! which keeps the memberships; data to a group is copied with `bpf_clone_redirect` to each
//! local pod that joined it (as on a link: TTL untouched), then, TTL decremented as a router
//! would, once to each other node with members, in Geneve with the namespace option.
//! Arriving (`tc_underlay_multicast`): such a copy from a cluster node is unwrapped and copied
//! to this node's members of the sender's namespace; it is never sent on again.
//! To a pod (`tc_to_pod`): only those copies, IGMP/MLD (the agent's queries, the node's own
//! reports) and neighbour discovery pass.

// Keys are passed to the map helpers by reference on purpose: by value they would be copied
// to the BPF stack once more.
#![expect(
    clippy::needless_borrows_for_generic_args,
    reason = "keys stay where they are"
)]

use aya_ebpf::{
    bindings::{
        BPF_F_ADJ_ROOM_DECAP_L3_IPV4, BPF_F_ADJ_ROOM_DECAP_L3_IPV6, BPF_F_ADJ_ROOM_ENCAP_L2_ETH,
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV4, BPF_F_ADJ_ROOM_ENCAP_L3_IPV6, BPF_F_ADJ_ROOM_ENCAP_L4_UDP,
        BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_OK, TC_ACT_SHOT, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC,
        bpf_fib_lookup as FibParams,
    },
    helpers::{
        bpf_clone_redirect, bpf_get_hash_recalc, bpf_l3_csum_replace, bpf_redirect,
        bpf_skb_adjust_room, bpf_skb_load_bytes, bpf_skb_pull_data, bpf_skb_store_bytes,
    },
    macros::classifier,
    programs::TcContext,
};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    maps::TAIL_FROM_POD_MULTICAST,
    multicast::{
        GENEVE_OPTION_CLASS, GENEVE_OPTION_LEN, GENEVE_OPTION_TYPE, MAX_LOCAL_MEMBERS,
        MAX_REMOTE_MEMBERS, MULTICAST_COPY_MARK, McastGroup, McastKey, McastReport, REPORT_CAPTURE,
        is_group,
    },
    overlay::{
        ENCAP_OVERHEAD_V4, ENCAP_OVERHEAD_V6, FAMILY_IPV6, GENEVE_HEADER_LEN, OVERLAY_HAS_IPV4,
        OVERLAY_HAS_IPV6, OverlayConfig, TunnelEndpoint,
    },
};

use crate::lookup;
use crate::parse::{ETH_LEN, ETH_P_IP, ETH_P_IPV6, UDP_LEN};
use crate::{
    copy::{copy_bytes, set_ipv4_mapped},
    maps::{
        ADDR_SCRATCH, ENCAP_SCRATCH_LEN, FIB_SCRATCH, MCAST_GROUPS, MCAST_PODS, MCAST_REPORTS,
        NODE_ADDRS, PARSED, SCRATCH, TAILS,
    },
    overlay,
    parse::{IPPROTO_ICMPV6, Packet, read},
    stats::{count_drop, count_outcome},
    work::Parsed,
};

const IPPROTO_IGMP: u8 = 2;
const IGMP_QUERY: u8 = 0x11;
const MLD_QUERY: u8 = 130;
const MLD_REPORT: u8 = 131;
const MLD_DONE: u8 = 132;
const MLDV2_REPORT: u8 = 143;
/// ICMPv6 neighbour discovery (router and neighbour solicitations and advertisements,
/// redirects): to groups, but link plumbing rather than multicast traffic.
const ND_FIRST: u8 = 133;
const ND_LAST: u8 = 137;
/// The outer headers of a copy to another node: Ethernet, IP, UDP, Geneve with the namespace
/// option, then the inner Ethernet header.
const BLOCK_V4: usize = 14 + 20 + 8 + 8 + GENEVE_OPTION_LEN + 14;
const BLOCK_V6: usize = 14 + 40 + 8 + 8 + GENEVE_OPTION_LEN + 14;
const _: () = assert!(BLOCK_V6 <= ENCAP_SCRATCH_LEN);

/// What a packet to a group is, as far as the pipeline cares.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Not to a group (or no IP at all).
    Unicast,
    /// An IGMP or MLD message.
    Control(u8),
    /// Neighbour discovery: left to the unicast pipeline.
    Neighbour,
    /// Anything else to a group.
    Data,
}

/// Reads what a packet whose IP header is at `parsed.l3_offset` sends to, and whether it is
/// multicast signalling.
#[inline(always)]
fn kind(ctx: &TcContext, parsed: &Parsed) -> Kind {
    let l3 = parsed.l3_offset;
    // The destination's first byte: straight from the linear data of an untagged frame (every
    // packet passes here; a helper call costs more), by helper otherwise.
    let dst = match parsed.ether_type {
        ETH_P_IP => 16,
        ETH_P_IPV6 => 24,
        _ => return Kind::Unicast,
    };
    let direct = if l3 == ETH_LEN {
        read::<u8>(ctx, ETH_LEN + dst)
    } else {
        None
    };
    let Some(first) = direct.or_else(|| ctx.load::<u8>(l3 + dst).ok()) else {
        return Kind::Unicast;
    };
    let group = if parsed.ether_type == ETH_P_IP {
        first & 0xF0 == 0xE0
    } else {
        first == 0xFF
    };
    if !group || l3 == 0 {
        return Kind::Unicast;
    }
    let signalling = if parsed.ether_type == ETH_P_IP {
        parsed.protocol == IPPROTO_IGMP
    } else {
        parsed.protocol == IPPROTO_ICMPV6
    };
    if !signalling || parsed.l4_offset == 0 {
        return Kind::Data;
    }
    let Ok(message) = ctx.load::<u8>(parsed.l4_offset) else {
        return Kind::Data;
    };
    if parsed.ether_type == ETH_P_IP {
        return Kind::Control(message);
    }
    match message {
        MLD_QUERY | MLD_REPORT | MLD_DONE | MLDV2_REPORT => Kind::Control(message),
        ND_FIRST..=ND_LAST => Kind::Neighbour,
        _ => Kind::Data,
    }
}

/// Whether a packet a pod sent goes to `tc_from_pod_multicast` (its destination is a group
/// and it is no neighbour discovery).
#[inline(always)]
pub fn to_group(ctx: &TcContext, parsed: &Parsed) -> bool {
    matches!(kind(ctx, parsed), Kind::Control(_) | Kind::Data)
}

/// Hands a pod's packet to a group on to `tc_from_pod_multicast`.
#[inline(always)]
pub fn hand_on(ctx: &TcContext) -> i32 {
    // SAFETY: a tail call either does not return or returns having done nothing.
    unsafe { TAILS.tail_call(ctx, TAIL_FROM_POD_MULTICAST) };
    count_drop(Hook::FromPod, DropReason::TailCallFailed);
    TC_ACT_SHOT
}

/// `tc_to_pod`'s judgement of a packet to a group: `None` when it is not one (or neighbour
/// discovery, judged as unicast); otherwise the verdict.
#[inline(always)]
pub fn to_pod(ctx: &TcContext, parsed: &Parsed) -> Option<i32> {
    match kind(ctx, parsed) {
        Kind::Unicast | Kind::Neighbour => None,
        // A copy the dataplane made for a member.
        // SAFETY: reading a field of our own context.
        _ if unsafe { (*ctx.skb.skb).mark } & MULTICAST_COPY_MARK != 0 => Some(TC_ACT_OK),
        Kind::Control(IGMP_QUERY) if parsed.ether_type == ETH_P_IP => {
            count_outcome(Hook::ToPod, PacketClass::MulticastQuery);
            Some(TC_ACT_OK)
        }
        Kind::Control(MLD_QUERY) if parsed.ether_type == ETH_P_IPV6 => {
            count_outcome(Hook::ToPod, PacketClass::MulticastQuery);
            Some(TC_ACT_OK)
        }
        // Other signalling the node's own stack sends on the link (the veth's MLD reports of
        // its link-local groups): link plumbing, as before.
        Kind::Control(_) => Some(TC_ACT_OK),
        Kind::Data => {
            count_drop(Hook::ToPod, DropReason::MulticastDisabled);
            Some(TC_ACT_SHOT)
        }
    }
}

/// A pod's packet to a group (after port security, handed on by `tc_from_pod`). It is
/// consumed here in every case: the copies are the packet.
#[classifier]
pub fn tc_from_pod_multicast(ctx: TcContext) -> i32 {
    let Some(parsed) = PARSED.get(0) else {
        count_drop(Hook::FromPod, DropReason::ScratchUnavailable);
        return TC_ACT_SHOT;
    };
    match send(&ctx, parsed) {
        Ok(verdict) => verdict,
        Err(reason) => {
            count_drop(Hook::FromPod, reason);
            TC_ACT_SHOT
        }
    }
}

/// The verdict on a pod's packet to a group: consumed (`TC_ACT_SHOT` after its copies, or
/// the report handed to the agent), or let go to the stack.
#[inline(always)]
fn send(ctx: &TcContext, parsed: &Parsed) -> Result<i32, DropReason> {
    // SAFETY: reading a field of our own context.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let signalling = matches!(kind(ctx, parsed), Kind::Control(_));
    // SAFETY: the value is copied out at once.
    let Some(pod) = (unsafe { MCAST_PODS.get(&ifindex) }) else {
        // The IGMP/MLD of a pod whose namespace has no multicast (every pod's stack reports
        // its link-local groups) goes to the stack as before, which does nothing with it:
        // link plumbing, not multicast traffic, which is what is refused.
        if signalling {
            return Ok(TC_ACT_OK);
        }
        return Err(DropReason::MulticastDisabled);
    };
    let namespace = pod.namespace;
    if signalling {
        report(ctx, parsed, ifindex)?;
        count_outcome(Hook::FromPod, PacketClass::MulticastReport);
        return Ok(TC_ACT_SHOT);
    }
    let mut key = McastKey {
        namespace,
        group: [0; 16],
    };
    read_destination(ctx, parsed, &mut key.group)?;
    // SAFETY: map values stay valid under RCU for the program's run; only read.
    let group = unsafe { MCAST_GROUPS.get(&key) }.ok_or(DropReason::MulticastNoMembers)?;
    // With no other node to copy to, the last member takes the packet itself.
    if let Some(verdict) =
        copy_to_members(ctx, group, ifindex, Hook::FromPod, group.remote_count == 0)
    {
        return Ok(verdict);
    }
    if group.remote_count != 0 && decrement_ttl(ctx, parsed)? {
        copy_to_nodes(ctx, group, namespace)?;
    }
    Ok(TC_ACT_SHOT)
}

/// The packet's destination group in the 16-byte form.
#[inline(always)]
fn read_destination(
    ctx: &TcContext,
    parsed: &Parsed,
    group: &mut [u8; 16],
) -> Result<(), DropReason> {
    let l3 = parsed.l3_offset;
    if parsed.ether_type == ETH_P_IP {
        let v4: [u8; 4] = ctx.load(l3 + 16).map_err(|_| DropReason::Ipv4Truncated)?;
        set_ipv4_mapped(group, v4);
    } else {
        *group = ctx.load(l3 + 24).map_err(|_| DropReason::Ipv6Truncated)?;
    }
    Ok(())
}

/// Copies the packet as it is to every local member but `except` (its sender). With
/// `keep_last`, the last member gets the packet itself rather than a copy: its verdict
/// (`TC_ACT_REDIRECT`) is returned, one clone fewer. Otherwise (or with no member to
/// send to) the packet is left as it was and `None` returned.
#[inline(always)]
fn copy_to_members(
    ctx: &TcContext,
    group: &McastGroup,
    except: u32,
    hook: Hook,
    keep_last: bool,
) -> Option<i32> {
    let count = group.local_count as usize;
    // SAFETY: writing our own context's mark; the copies carry it to the members' veths.
    unsafe { (*ctx.skb.skb).mark |= MULTICAST_COPY_MARK };
    // Each member is sent to once the next one is known, so the last is still pending at the
    // end.
    let mut pending = 0u32;
    for i in 0..MAX_LOCAL_MEMBERS {
        if i >= count {
            break;
        }
        let target = group.local[i];
        if target == except || target == 0 {
            continue;
        }
        if pending != 0 {
            clone_to(ctx, pending, hook);
        }
        pending = target;
    }
    if pending != 0 && keep_last {
        // SAFETY: plain helper call; the packet goes out of the member's host veth.
        let verdict = unsafe { bpf_redirect(pending, 0) } as i32;
        count_outcome(hook, PacketClass::MulticastLocalCopy);
        return Some(verdict);
    }
    if pending != 0 {
        clone_to(ctx, pending, hook);
    }
    // SAFETY: as above.
    unsafe { (*ctx.skb.skb).mark &= !MULTICAST_COPY_MARK };
    None
}

/// One copy of the packet out of host veth `target`, counted.
#[inline(always)]
fn clone_to(ctx: &TcContext, target: u32, hook: Hook) {
    // SAFETY: plain helper call; the copy goes out of the member's host veth into the pod.
    if unsafe { bpf_clone_redirect(ctx.skb.skb, target, 0) } == 0 {
        count_outcome(hook, PacketClass::MulticastLocalCopy);
    } else {
        count_drop(hook, DropReason::MulticastCopyFailed);
    }
}

/// Takes one from the TTL (hop limit) as a router does before copies leave the node; whether
/// any is left for them to arrive with.
#[inline(always)]
fn decrement_ttl(ctx: &TcContext, parsed: &Parsed) -> Result<bool, DropReason> {
    let l3 = parsed.l3_offset;
    if parsed.ether_type == ETH_P_IP {
        // TTL and protocol: the 16-bit word the header checksum sees.
        let word: [u8; 2] = ctx.load(l3 + 8).map_err(|_| DropReason::Ipv4Truncated)?;
        if word[0] <= 1 {
            return Ok(false);
        }
        let new = [word[0] - 1, word[1]];
        // SAFETY: plain helper calls on our own context, within the checked header.
        unsafe {
            if bpf_skb_store_bytes(ctx.skb.skb, (l3 + 8) as u32, new.as_ptr().cast(), 2, 0) != 0
                || bpf_l3_csum_replace(
                    ctx.skb.skb,
                    (l3 + 10) as u32,
                    u16::from_ne_bytes(word) as u64,
                    u16::from_ne_bytes(new) as u64,
                    2,
                ) != 0
            {
                return Err(DropReason::MulticastCopyFailed);
            }
        }
    } else {
        let hops: u8 = ctx.load(l3 + 7).map_err(|_| DropReason::Ipv6Truncated)?;
        if hops <= 1 {
            return Ok(false);
        }
        let new = [hops - 1];
        // SAFETY: as above.
        if unsafe { bpf_skb_store_bytes(ctx.skb.skb, (l3 + 7) as u32, new.as_ptr().cast(), 1, 0) }
            != 0
        {
            return Err(DropReason::MulticastCopyFailed);
        }
    }
    Ok(true)
}

/// Wraps the packet once in Geneve with the namespace option, then for each other node with
/// members writes its outer headers and sends a copy out of the underlay.
#[inline(never)]
fn copy_to_nodes(ctx: &TcContext, group: &McastGroup, namespace: u32) -> Result<(), DropReason> {
    let config = lookup::overlay_config().ok_or(DropReason::MulticastCopyFailed)?;
    let ipv6 = group.remote[0].family == FAMILY_IPV6;
    let overhead = if ipv6 {
        ENCAP_OVERHEAD_V6
    } else {
        ENCAP_OVERHEAD_V4
    } as usize
        + GENEVE_OPTION_LEN;
    let block = SCRATCH
        .get_ptr_mut(0)
        .ok_or(DropReason::ScratchUnavailable)?;
    // SAFETY: per-CPU map memory, used only by this program invocation.
    let block = unsafe { &mut *block };
    let start = ctx.data();
    if start + ETH_LEN > ctx.data_end() {
        return Err(DropReason::EthTruncated);
    }
    // The pod's Ethernet header becomes the inner one, at the end of the block.
    let inner_at = if ipv6 { BLOCK_V6 } else { BLOCK_V4 } - ETH_LEN;
    // SAFETY: 14 bytes of the linear packet (checked above) into the block.
    unsafe { copy_bytes::<14>(block[inner_at..].as_mut_ptr(), start as *const u8) };
    let outer_len = ctx.len() as usize + overhead - ETH_LEN;
    let l3_flag = if ipv6 {
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV6
    } else {
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV4
    };
    let flags = (l3_flag | BPF_F_ADJ_ROOM_ENCAP_L4_UDP | BPF_F_ADJ_ROOM_ENCAP_L2_ETH) as u64
        | ((ETH_LEN as u64) << 56);
    // SAFETY: plain helper calls on our own context.
    let hash = unsafe { bpf_get_hash_recalc(ctx.skb.skb) };
    // SAFETY: as above.
    if unsafe { bpf_skb_adjust_room(ctx.skb.skb, overhead as i32, BPF_ADJ_ROOM_MAC, flags) } != 0 {
        return Err(DropReason::MulticastCopyFailed);
    }
    let fib = FIB_SCRATCH
        .get_ptr_mut(0)
        .ok_or(DropReason::ScratchUnavailable)?;
    // SAFETY: per-CPU map memory, used only by this program invocation.
    let fib = unsafe { &mut *fib };
    let count = group.remote_count as usize;
    for i in 0..MAX_REMOTE_MEMBERS {
        if i >= count {
            break;
        }
        let endpoint = &group.remote[i];
        if (endpoint.family == FAMILY_IPV6) != ipv6 {
            count_drop(Hook::FromPod, DropReason::MulticastCopyFailed);
            continue;
        }
        match copy_to_node(
            ctx, config, endpoint, block, fib, outer_len, hash, namespace,
        ) {
            Ok(()) => count_outcome(Hook::FromPod, PacketClass::MulticastRemoteCopy),
            Err(reason) => count_drop(Hook::FromPod, reason),
        }
    }
    Ok(())
}

/// One copy of the wrapped packet to `endpoint`: its route looked up, the outer headers
/// written for it, the copy sent out of the route's interface.
#[expect(clippy::too_many_arguments, reason = "the per-copy state of one loop")]
#[inline(always)]
fn copy_to_node(
    ctx: &TcContext,
    config: &OverlayConfig,
    endpoint: &TunnelEndpoint,
    block: &mut [u8; ENCAP_SCRATCH_LEN],
    fib: &mut FibParams,
    outer_len: usize,
    hash: u32,
    namespace: u32,
) -> Result<(), DropReason> {
    let ipv6 = endpoint.family == FAMILY_IPV6;
    let has_source = if ipv6 {
        config.flags & OVERLAY_HAS_IPV6 != 0
    } else {
        config.flags & OVERLAY_HAS_IPV4 != 0
    };
    if !has_source {
        return Err(DropReason::OverlayNoRoute);
    }
    overlay::fill_fib_params(fib, config, endpoint, outer_len as u32);
    let rc = overlay::fib_lookup_output(ctx, fib);
    // A copy cannot wait for the next hop's address to resolve: the node's own traffic to
    // the members' nodes (the agents' membership messages) keeps it resolved.
    if rc != BPF_FIB_LKUP_RET_SUCCESS {
        return Err(DropReason::MulticastCopyFailed);
    }
    let written = if ipv6 {
        let udp_len = (outer_len - 40) as u16;
        overlay::write_geneve_v6(block, &fib.dmac, &fib.smac, config, endpoint, udp_len, hash);
        write_option(block, 14 + 40 + UDP_LEN, namespace);
        BLOCK_V6
    } else {
        let udp_len = (outer_len - 20) as u16;
        overlay::write_outer_v4(
            block,
            &fib.dmac,
            &fib.smac,
            config,
            endpoint,
            outer_len as u16,
        );
        overlay::write_geneve_after_v4(block, config, udp_len, hash);
        write_option(block, 14 + 20 + UDP_LEN, namespace);
        BLOCK_V4
    };
    // SAFETY: plain helper calls on our own context; the block is `written` bytes long.
    unsafe {
        if bpf_skb_store_bytes(ctx.skb.skb, 0, block.as_ptr().cast(), written as u32, 0) != 0 {
            return Err(DropReason::MulticastCopyFailed);
        }
        if bpf_clone_redirect(ctx.skb.skb, fib.ifindex, 0) != 0 {
            return Err(DropReason::MulticastCopyFailed);
        }
    }
    Ok(())
}

/// The Geneve header at `at` gets its options length (one option of 8 bytes), and the option
/// naming the namespace follows it.
#[inline(always)]
fn write_option(block: &mut [u8; ENCAP_SCRATCH_LEN], at: usize, namespace: u32) {
    let at = if at == 14 + 40 + UDP_LEN { 62 } else { 42 };
    block[at] = (GENEVE_OPTION_LEN / 4) as u8;
    let class = GENEVE_OPTION_CLASS.to_be_bytes();
    let id = namespace.to_be_bytes();
    let option = at + GENEVE_HEADER_LEN;
    block[option..option + 8].copy_from_slice(&[
        class[0],
        class[1],
        GENEVE_OPTION_TYPE,
        1,
        id[0],
        id[1],
        id[2],
        id[3],
    ]);
}

/// Hands an IGMP or MLD message (from its type byte) to the agent.
#[inline(always)]
fn report(ctx: &TcContext, parsed: &Parsed, ifindex: u32) -> Result<(), DropReason> {
    let Some(mut entry) = MCAST_REPORTS.reserve::<McastReport>(0) else {
        return Err(DropReason::MulticastReportLost);
    };
    let event = entry.as_mut_ptr();
    let at = parsed.l4_offset;
    // SAFETY: reading a field of our own context.
    let total = unsafe { (*ctx.skb.skb).len } as usize;
    let wanted = total.saturating_sub(at).min(REPORT_CAPTURE) as u32;
    // SAFETY: `event` points at a reserved, exclusively owned McastReport in the ring. The
    // length goes through it (volatile) so that its bounds stay in the program.
    let len = unsafe {
        (*event).ifindex = ifindex;
        (*event).family = if parsed.ether_type == ETH_P_IP { 4 } else { 6 };
        (*event)._pad = 0;
        core::ptr::write_volatile(&mut (*event).len, wanted);
        core::ptr::read_volatile(&(*event).len)
    };
    if len == 0 || len > REPORT_CAPTURE as u32 {
        entry.discard(0);
        return Err(DropReason::MulticastReportLost);
    }
    // SAFETY: the helper writes `len` bytes into the event's message, which holds
    // REPORT_CAPTURE.
    let loaded = unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb as *const _,
            at as u32,
            (*event).message.as_mut_ptr().cast(),
            len,
        )
    };
    if loaded != 0 {
        entry.discard(0);
        return Err(DropReason::MulticastReportLost);
    }
    entry.submit(0);
    Ok(())
}

/// Geneve to this node that XDP left whole (handed on by `tc_underlay`): a multicast copy
/// from another node, unwrapped and copied to this node's members of the sender's namespace.
/// Anything else that is no copy for this node passes.
#[classifier]
pub fn tc_underlay_multicast(ctx: TcContext) -> i32 {
    match receive(&ctx) {
        Ok(Some(verdict)) => verdict,
        Ok(None) => TC_ACT_OK,
        Err(reason) => {
            count_drop(Hook::UnderlayTc, reason);
            TC_ACT_SHOT
        }
    }
}

/// The verdict on a copy for this node (its members served); `None` when it is none.
#[inline(always)]
fn receive(ctx: &TcContext) -> Result<Option<i32>, DropReason> {
    let Some(parsed) = PARSED.get(0) else {
        return Ok(None);
    };
    let Some(config) = lookup::overlay_config() else {
        return Ok(None);
    };
    // Only untagged underlay frames carry copies (a tagged underlay keeps unicast). The
    // offsets read back from the map are bounded again for the verifier: the outer IP header
    // right after Ethernet, the UDP header within the longest IPv4 or plain IPv6 header.
    if parsed.l3_offset != ETH_LEN || parsed.l4_offset > ETH_LEN + 60 {
        return Ok(None);
    }
    let mut parsed = *parsed;
    parsed.l3_offset = ETH_LEN;
    parsed.l4_offset &= 0x7F;
    let parsed = &parsed;
    // The headers up to the inner IP destination in the linear data.
    // SAFETY: plain helper call on our own context.
    if unsafe { bpf_skb_pull_data(ctx.skb.skb, ctx.len()) } != 0 {
        return Err(DropReason::MulticastBadTunnel);
    }
    let packet = Packet::new(ctx.data(), ctx.data_end(), ctx.len() as usize);
    let key = ADDR_SCRATCH
        .get_ptr_mut(0)
        .ok_or(DropReason::ScratchUnavailable)?;
    // SAFETY: this CPU's slot, used within this program run only.
    let key = unsafe { &mut *key };
    if !overlay::outer_addresses(&packet, parsed, config, &mut key.data)? {
        return Ok(None);
    }
    // SAFETY: only presence is checked.
    if unsafe { NODE_ADDRS.get(&key.data) }.is_none() {
        return Err(DropReason::GeneveUnknownNode);
    }
    let geneve = parsed.l4_offset + UDP_LEN;
    let options_len = overlay::check_geneve(&packet, geneve, config.vni)?;
    let inner = geneve + GENEVE_HEADER_LEN + options_len;
    let mut lookup = McastKey {
        namespace: 0,
        group: [0; 16],
    };
    overlay::inner_address(&packet, inner, false, &mut lookup.group)?;
    // XDP unwraps the rest itself; whatever else reaches here is left as it is.
    if !is_group(&lookup.group) {
        return Ok(None);
    }
    lookup.namespace = namespace_option(ctx, geneve, options_len)?;
    let inner_eth: *const [u8; 14] = packet.header(inner).ok_or(DropReason::MulticastBadTunnel)?;
    // SAFETY: bounds-checked by header(); copied before the packet changes.
    let inner_eth = unsafe { *inner_eth };
    // SAFETY: map values stay valid under RCU for the program's run; only read.
    let group = unsafe { MCAST_GROUPS.get(&lookup) }.ok_or(DropReason::MulticastNoMembers)?;
    let family = if u16::from_be_bytes([inner_eth[12], inner_eth[13]]) == ETH_P_IP {
        BPF_F_ADJ_ROOM_DECAP_L3_IPV4
    } else {
        BPF_F_ADJ_ROOM_DECAP_L3_IPV6
    };
    // Everything from the outer IP header to the inner Ethernet header goes; the inner
    // Ethernet header is then written over the outer one.
    // SAFETY: plain helper calls on our own context.
    unsafe {
        if bpf_skb_adjust_room(
            ctx.skb.skb,
            -(inner as i32),
            BPF_ADJ_ROOM_MAC,
            family as u64,
        ) != 0
            || bpf_skb_store_bytes(ctx.skb.skb, 0, inner_eth.as_ptr().cast(), 14, 0) != 0
        {
            return Err(DropReason::MulticastBadTunnel);
        }
    }
    if let Some(verdict) = copy_to_members(ctx, group, 0, Hook::UnderlayTc, true) {
        return Ok(Some(verdict));
    }
    Ok(Some(TC_ACT_SHOT))
}

/// The namespace id the sending node put in the options (the first option of our class).
#[inline(always)]
fn namespace_option(ctx: &TcContext, geneve: usize, options_len: usize) -> Result<u32, DropReason> {
    let mut offset = geneve + GENEVE_HEADER_LEN;
    let end = offset + options_len;
    for _ in 0..8 {
        if offset + GENEVE_OPTION_LEN > end {
            break;
        }
        // Read by helper: a direct read's bounds check would be merged with the options'
        // (already checked), which the verifier cannot follow.
        let option: [u8; 8] = ctx
            .load(offset)
            .map_err(|_| DropReason::MulticastBadTunnel)?;
        let length = (option[3] & 0x1F) as usize * 4;
        if u16::from_be_bytes([option[0], option[1]]) == GENEVE_OPTION_CLASS
            && option[2] == GENEVE_OPTION_TYPE
            && length == 4
        {
            let id = u32::from_be_bytes([option[4], option[5], option[6], option[7]]);
            if id != 0 {
                return Ok(id);
            }
        }
        offset += 4 + length;
    }
    Err(DropReason::MulticastBadTunnel)
}
