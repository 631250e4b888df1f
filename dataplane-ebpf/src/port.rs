//! Port security at the pod edge, as OVN's `port_security` gives every pod: a pod sends only
//! as itself and receives only what is addressed to it.
//!
//! From a pod (`tc_from_pod`, before anything else looks at the packet): the source MAC is the
//! pod's; an IPv4 source is the pod's address (a DHCP discover from 0.0.0.0 to the broadcast
//! excepted); an IPv6 source is the pod's address or the link-local one its kernel derives
//! from its MAC (the unspecified address only for duplicate address detection, router
//! solicitations and MLD reports to a multicast group); ARP names the pod's MAC and address as
//! its sender (0.0.0.0 too: a probe claims nothing); neighbour discovery carries the pod's
//! link-layer address and, in an advertisement, a target the pod owns; router advertisements
//! and redirects never come from a pod. Anything else from a pod (VLAN tags, other ethertypes)
//! is dropped. So a spoofed packet never reaches the load-balancer, access control or another
//! pod, and never opens a tracked flow.
//!
//! Towards a pod (`tc_to_pod`, what the stack delivers): the destination MAC is the pod's,
//! broadcast or multicast; an IP destination is the pod's address, its link-local one, or a
//! multicast or broadcast address. Packets the dataplane hands to a pod itself are addressed
//! from the pod's own record and need no check.
//!
//! Per packet: this CPU's copy of the pod's record (an array read; a hash lookup by the veth's
//! ifindex when the local pods changed since) and a few word compares.

use aya_ebpf::programs::TcContext;
use dataplane_common::{
    DropReason,
    overlay::Addr,
    port::{PORT_CACHE_SLOTS, PORT_HAS_IPV4, PORT_HAS_IPV6, PORT_UNRESTRICTED, PodPort},
};

use crate::parse::ETH_LEN;
use crate::{
    copy::{copy_bytes, same_bytes},
    maps::{OVERLAY_CONFIG, POD_PORTS, PORT_CACHE},
    parse::{ETH_P_ARP, ETH_P_IP, ETH_P_IPV6, IPPROTO_ICMPV6, IPPROTO_UDP},
    stage::Stage,
    work::Parsed,
};

/// Where the fields this module reads lie in an untagged frame.
const IPV4_SRC: usize = ETH_LEN + 12;
const IPV4_DST: usize = ETH_LEN + 16;
const IPV6_SRC: usize = ETH_LEN + 8;
const IPV6_DST: usize = ETH_LEN + 24;
/// ARP for IPv4 over Ethernet: sender MAC and address, then target MAC and address.
const ARP_LEN: usize = 28;
const ARP_SENDER_MAC: usize = ETH_LEN + 8;
const ARP_SENDER_IP: usize = ETH_LEN + 14;

/// ICMPv6 types of neighbour discovery (RFC 4861) and MLD reports (RFC 2710, RFC 3810).
const MLD_REPORT: u8 = 131;
const MLD_DONE: u8 = 132;
const ROUTER_SOLICITATION: u8 = 133;
const ROUTER_ADVERTISEMENT: u8 = 134;
const NEIGHBOR_SOLICITATION: u8 = 135;
const NEIGHBOR_ADVERTISEMENT: u8 = 136;
const REDIRECT: u8 = 137;
const MLDV2_REPORT: u8 = 143;
/// ND options naming a link-layer address: source (1) and target (2).
const OPTION_SOURCE_LL: u8 = 1;
const OPTION_TARGET_LL: u8 = 2;
/// ND options walked; a solicitation or advertisement from a pod carries one or two.
const MAX_ND_OPTIONS: usize = 8;

/// The port-security record of the pod behind this packet's veth: this CPU's copy when it is
/// of the current pods' epoch (one inlined array read), else looked up and copied.
#[inline(always)]
fn pod_port(ctx: &TcContext) -> Result<&'static PodPort, DropReason> {
    // SAFETY: reading a field of our own context.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let epoch = OVERLAY_CONFIG.get(0).map_or(0, |config| config.pods_epoch);
    let slot = PORT_CACHE
        .get_ptr_mut(ifindex % PORT_CACHE_SLOTS)
        .ok_or(DropReason::ScratchUnavailable)?;
    // SAFETY: this CPU's slot of a per-CPU map, used by one program run at a time.
    let slot = unsafe { &mut *slot };
    if slot.ifindex == ifindex && slot.epoch == epoch && ifindex != 0 {
        return Ok(&slot.port);
    }
    // SAFETY: map values stay valid under RCU for the program's run; copied at once.
    let port = unsafe { POD_PORTS.get(ifindex) }.ok_or(DropReason::PortUnknown)?;
    // SAFETY: both are whole `PodPort`s.
    unsafe {
        copy_bytes::<{ core::mem::size_of::<PodPort>() }>(
            (&mut slot.port as *mut PodPort).cast(),
            (port as *const PodPort).cast(),
        )
    };
    slot.ifindex = ifindex;
    slot.epoch = epoch;
    Ok(&slot.port)
}

/// Checks a packet leaving a pod: the stage's value is 1 for an ARP packet the pod may send,
/// which nothing after this stage has business with (the stack answers it), 0 for an IP
/// packet the pod may send, for the stages after this one. A subprogram: its compares would
/// otherwise hold registers across the whole entry program, whose frame is the deepest.
#[inline(always)]
pub fn from_pod(ctx: &TcContext, parsed: &Parsed) -> Stage {
    Stage::value(check_from_pod(ctx, parsed).map(u32::from))
}

#[inline(always)]
fn check_from_pod(ctx: &TcContext, parsed: &Parsed) -> Result<bool, DropReason> {
    let port = pod_port(ctx)?;
    if port.flags & PORT_UNRESTRICTED != 0 {
        return Ok(false);
    }
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + ETH_LEN > end {
        return Err(DropReason::EthTruncated);
    }
    // SAFETY: the Ethernet header lies within the packet (checked just above).
    if !unsafe { same_bytes::<6>((start + 6) as *const u8, &port.mac) } {
        return Err(DropReason::PortSrcMac);
    }
    // An untagged frame only: the parser reports the type inside any VLAN tags.
    if parsed.ether_type == ETH_P_ARP {
        // SAFETY: as above.
        let raw = u16::from_be_bytes(unsafe { *((start + 12) as *const [u8; 2]) });
        return if raw == ETH_P_ARP {
            check_arp(ctx, port).map(|()| true)
        } else {
            Err(DropReason::PortEthertype)
        };
    }
    if parsed.l3_offset != ETH_LEN {
        return Err(DropReason::PortEthertype);
    }
    match parsed.ether_type {
        ETH_P_IP => check_ipv4_source(ctx, parsed, port),
        ETH_P_IPV6 => check_ipv6_source(ctx, parsed, port),
        _ => Err(DropReason::PortEthertype),
    }
    .map(|()| false)
}

#[inline(always)]
fn check_ipv4_source(ctx: &TcContext, parsed: &Parsed, port: &PodPort) -> Result<(), DropReason> {
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + IPV4_DST + 4 > end {
        return Err(DropReason::Ipv4Truncated);
    }
    // SAFETY: both addresses lie within the packet (checked just above).
    let (src, dst) = unsafe {
        (
            *((start + IPV4_SRC) as *const [u8; 4]),
            *((start + IPV4_DST) as *const [u8; 4]),
        )
    };
    if port.flags & PORT_HAS_IPV4 != 0 && src == port.ipv4 {
        return Ok(());
    }
    // DHCP discover: from nobody to everybody, client port to server port.
    let dhcp = src == [0; 4]
        && dst == [0xff; 4]
        && parsed.protocol == IPPROTO_UDP
        && parsed.src_port == 68u16.to_be_bytes()
        && parsed.dst_port == 67u16.to_be_bytes();
    if dhcp {
        Ok(())
    } else {
        Err(DropReason::PortSrcIp)
    }
}

#[inline(always)]
fn check_ipv6_source(ctx: &TcContext, parsed: &Parsed, port: &PodPort) -> Result<(), DropReason> {
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + IPV6_DST + 16 > end {
        return Err(DropReason::Ipv6Truncated);
    }
    let src = (start + IPV6_SRC) as *const u8;
    // SAFETY: the source address lies within the packet (checked above).
    if port.flags & PORT_HAS_IPV6 != 0 && unsafe { same_bytes::<16>(src, &port.ipv6) } {
        return Ok(());
    }
    // SAFETY: as above.
    if unsafe { same_bytes::<16>(src, &port.ipv6_link_local) } {
        return Ok(());
    }
    // SAFETY: as above.
    if !unsafe { all_zero::<16>(src) } {
        return Err(DropReason::PortSrcIp);
    }
    // The unspecified source: only what a pod sends before it has an address of its own,
    // and only to a multicast group.
    // SAFETY: the destination lies within the packet (checked above).
    let multicast = unsafe { *((start + IPV6_DST) as *const u8) } == 0xff;
    let kind = icmpv6_type(ctx, parsed);
    let before_address = matches!(
        kind,
        Some(NEIGHBOR_SOLICITATION | ROUTER_SOLICITATION | MLD_REPORT | MLD_DONE | MLDV2_REPORT)
    );
    if multicast && before_address {
        Ok(())
    } else {
        Err(DropReason::PortSrcIp)
    }
}

/// The ICMPv6 type of an ICMPv6 packet.
#[inline(always)]
fn icmpv6_type(ctx: &TcContext, parsed: &Parsed) -> Option<u8> {
    if parsed.protocol != IPPROTO_ICMPV6 || parsed.l4_offset == 0 {
        return None;
    }
    ctx.load::<u8>(parsed.l4_offset).ok()
}

#[inline(always)]
fn check_arp(ctx: &TcContext, port: &PodPort) -> Result<(), DropReason> {
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + ETH_LEN + ARP_LEN > end {
        return Err(DropReason::PortArp);
    }
    // SAFETY: the ARP body lies within the packet (checked just above).
    let (header, sender_ip) = unsafe {
        (
            *((start + ETH_LEN) as *const [u8; 6]),
            *((start + ARP_SENDER_IP) as *const [u8; 4]),
        )
    };
    // Ethernet hardware (1), IPv4 protocol, 6- and 4-byte addresses: the only ARP a pod has.
    if header != [0, 1, 0x08, 0x00, 6, 4] {
        return Err(DropReason::PortArp);
    }
    // SAFETY: as above.
    let mac_ok = unsafe { same_bytes::<6>((start + ARP_SENDER_MAC) as *const u8, &port.mac) };
    let ip_ok = (port.flags & PORT_HAS_IPV4 != 0 && sender_ip == port.ipv4) || sender_ip == [0; 4];
    if mac_ok && ip_ok {
        Ok(())
    } else {
        Err(DropReason::PortArp)
    }
}

/// Neighbour discovery from a pod: solicitations and advertisements carry the pod's own
/// link-layer address; an advertisement's target is an address the pod owns; routers'
/// messages (advertisements, redirects) never come from a pod. Other packets pass.
#[inline(always)]
pub fn nd_from_pod(ctx: &TcContext, parsed: &Parsed) -> Result<(), DropReason> {
    let Some(kind) = icmpv6_type(ctx, parsed) else {
        return Ok(());
    };
    let options = match kind {
        ROUTER_ADVERTISEMENT | REDIRECT => return Err(DropReason::PortNd),
        ROUTER_SOLICITATION => parsed.l4_offset + 8,
        NEIGHBOR_SOLICITATION | NEIGHBOR_ADVERTISEMENT => parsed.l4_offset + 24,
        _ => return Ok(()),
    };
    let port = pod_port(ctx)?;
    if port.flags & PORT_UNRESTRICTED != 0 {
        return Ok(());
    }
    if kind == NEIGHBOR_ADVERTISEMENT {
        let target: Addr = ctx
            .load(parsed.l4_offset + 8)
            .map_err(|_| DropReason::PortNd)?;
        let owned = (port.flags & PORT_HAS_IPV6 != 0 && target == port.ipv6)
            || target == port.ipv6_link_local;
        if !owned {
            return Err(DropReason::PortNd);
        }
    }
    check_nd_options(ctx, options, &port.mac)
}

/// Walks the ND options from `at` to the end of the packet: each link-layer address option
/// must name `mac`.
#[inline(always)]
fn check_nd_options(ctx: &TcContext, mut at: usize, mac: &[u8; 6]) -> Result<(), DropReason> {
    let len = ctx.len() as usize;
    for _ in 0..MAX_ND_OPTIONS {
        if at >= len {
            return Ok(());
        }
        let option: [u8; 8] = ctx.load(at).map_err(|_| DropReason::PortNd)?;
        // A zero length is invalid (RFC 4861, 4.6) and would never end the walk.
        if option[1] == 0 {
            return Err(DropReason::PortNd);
        }
        if matches!(option[0], OPTION_SOURCE_LL | OPTION_TARGET_LL)
            && (option[1] != 1 || option[2..8] != *mac)
        {
            return Err(DropReason::PortNd);
        }
        at += option[1] as usize * 8;
    }
    // More options than a pod's solicitation or advertisement has: not one of those.
    Err(DropReason::PortNd)
}

/// Checks a packet the stack delivers to a pod: addressed to the pod, or to a group. A
/// subprogram, as [`from_pod`].
#[inline(never)]
pub fn to_pod(ctx: &TcContext, parsed: &Parsed) -> Stage {
    Stage::value(check_to_pod(ctx, parsed).map(|()| 0))
}

#[inline(always)]
fn check_to_pod(ctx: &TcContext, parsed: &Parsed) -> Result<(), DropReason> {
    let port = pod_port(ctx)?;
    if port.flags & PORT_UNRESTRICTED != 0 {
        return Ok(());
    }
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + ETH_LEN > end {
        return Err(DropReason::EthTruncated);
    }
    // SAFETY: the Ethernet header lies within the packet (checked just above).
    let group = unsafe { *(start as *const u8) } & 1 != 0;
    // SAFETY: as above.
    if !group && !unsafe { same_bytes::<6>(start as *const u8, &port.mac) } {
        return Err(DropReason::PortDstMac);
    }
    if parsed.ether_type == ETH_P_ARP {
        // SAFETY: as above.
        let raw = u16::from_be_bytes(unsafe { *((start + 12) as *const [u8; 2]) });
        return if raw == ETH_P_ARP {
            Ok(())
        } else {
            Err(DropReason::PortEthertype)
        };
    }
    if parsed.l3_offset != ETH_LEN {
        return Err(DropReason::PortEthertype);
    }
    let ours = match parsed.ether_type {
        ETH_P_IP => {
            if start + IPV4_DST + 4 > end {
                return Err(DropReason::Ipv4Truncated);
            }
            // SAFETY: the destination lies within the packet (checked just above).
            let dst = unsafe { *((start + IPV4_DST) as *const [u8; 4]) };
            (port.flags & PORT_HAS_IPV4 != 0 && dst == port.ipv4)
                || dst[0] & 0xf0 == 0xe0
                || dst == [0xff; 4]
        }
        ETH_P_IPV6 => {
            if start + IPV6_DST + 16 > end {
                return Err(DropReason::Ipv6Truncated);
            }
            let dst = (start + IPV6_DST) as *const u8;
            // SAFETY: the destination lies within the packet (checked above).
            let multicast = unsafe { *dst == 0xff };
            // Short-circuited as written: evaluating every comparison on every path costs
            // `tc_to_pod` the verifier's whole budget.
            multicast
                || (port.flags & PORT_HAS_IPV6 != 0
                    // SAFETY: as above.
                    && unsafe { same_bytes::<16>(dst, &port.ipv6) })
                // SAFETY: as above.
                || unsafe { same_bytes::<16>(dst, &port.ipv6_link_local) }
        }
        _ => return Err(DropReason::PortEthertype),
    };
    if ours {
        Ok(())
    } else {
        Err(DropReason::PortDstIp)
    }
}

/// Whether the `N` bytes at `at` are all zero (the unspecified address).
///
/// # Safety
/// `at` must be valid for reading `N` bytes.
#[inline(always)]
unsafe fn all_zero<const N: usize>(at: *const u8) -> bool {
    let mut any = 0u8;
    let mut i = 0;
    while i < N {
        // SAFETY: the caller's contract; `i < N`.
        any |= unsafe { core::ptr::read_volatile(at.add(i)) };
        i += 1;
    }
    any == 0
}

/// Whether the 6-byte MAC at `at` is `expected`, compared as 16-bit words (see
/// [`same_bytes`]).
///
/// # Safety
/// `at` must be valid for reading 6 bytes, at an even offset as `expected` is.
#[inline(always)]
pub unsafe fn same_mac(at: *const u8, expected: &[u8; 6]) -> bool {
    // SAFETY: the caller's contract.
    unsafe { same_bytes(at, expected) }
}
