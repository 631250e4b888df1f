//! Header parsing shared by every attach point. Every access is bounds-checked against the end
//! of the linear packet data; every length field is checked against the whole packet length;
//! every loop is bounded. A malformed packet yields the [`DropReason`] that names its defect.

use core::mem::size_of;

use aya_ebpf::programs::TcContext;

use crate::{
    copy::{copy_bytes, set_ipv4_mapped},
    maps::PARSED,
    work::Parsed,
};
use dataplane_common::{
    DropReason, PacketClass,
    frag::{FRAG_FIRST, FRAG_LAST, FRAG_LATER, FRAG_NONE},
    overlay::Addr,
};
use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
    sctp::SctpHdr,
    tcp::TcpHdr,
    udp::UdpHdr,
    vlan::VlanHdr,
};

/// VLAN tags accepted in front of the network header (802.1Q and 802.1ad QinQ).
const MAX_VLAN_TAGS: usize = 2;
/// IPv6 extension headers walked before giving up with `Ipv6ExtTooDeep`.
pub const MAX_IPV6_EXT_HEADERS: usize = 6;

/// The wire's fixed header sizes and EtherTypes, defined here once for every stage.
pub const ETH_LEN: usize = 14;
pub const UDP_LEN: usize = 8;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86DD;
pub const ETH_P_ARP: u16 = 0x0806;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88A8;

const IPPROTO_HOPOPTS: u8 = 0;
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_AH: u8 = 51;
pub const IPPROTO_ICMPV6: u8 = 58;
const IPPROTO_DSTOPTS: u8 = 60;
pub const IPPROTO_SCTP: u8 = 132;
const IPPROTO_MOBILITY: u8 = 135;
const IPPROTO_HIP: u8 = 139;
const IPPROTO_SHIM6: u8 = 140;

/// ICMP and ICMPv6 messages all start with an 8-byte header.
const ICMP_HEADER_LEN: usize = 8;
/// IPv4 flags and fragment offset: more fragments follow; the offset in 8-byte units.
const IPV4_MORE_FRAGMENTS: u16 = 0x2000;
const IPV4_OFFSET_MASK: u16 = 0x1FFF;

/// The packet as the program sees it: `start..end` is the directly readable (linear) data,
/// `len` the whole packet length (larger than `end - start` for non-linear skbs).
pub struct Packet {
    start: usize,
    end: usize,
    len: usize,
}

impl Packet {
    #[inline(always)]
    pub fn new(start: usize, end: usize, len: usize) -> Self {
        Self { start, end, len }
    }

    /// The whole packet length.
    #[inline(always)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// A pointer to a `T` at `offset`, if all of it lies within the linear data.
    #[inline(always)]
    pub fn header<T>(&self, offset: usize) -> Option<*const T> {
        let at = self.start + offset;
        if at + size_of::<T>() > self.end {
            return None;
        }
        Some(at as *const T)
    }
}

/// Parses Ethernet, VLAN tags, IPv4/IPv6 and the transport header.
#[inline(always)]
pub fn parse(packet: &Packet) -> Result<Parsed, DropReason> {
    let eth: *const EthHdr = packet.header(0).ok_or(DropReason::EthTruncated)?;
    // SAFETY: `Packet::header` checked that the whole header lies within the packet.
    let mut ether_type = u16::from_be(unsafe { (*eth).ether_type });
    let mut offset = EthHdr::LEN;

    for _ in 0..MAX_VLAN_TAGS {
        if ether_type != ETH_P_8021Q && ether_type != ETH_P_8021AD {
            break;
        }
        let vlan: *const VlanHdr = packet.header(offset).ok_or(DropReason::VlanTruncated)?;
        // SAFETY: `Packet::header` checked that the whole header lies within the packet.
        ether_type = u16::from_be(unsafe { (*vlan).ether_type });
        offset += VlanHdr::LEN;
    }

    match ether_type {
        ETH_P_IP => parse_ipv4(packet, offset, ether_type),
        ETH_P_IPV6 => parse_ipv6(packet, offset, ether_type),
        ETH_P_ARP => Ok(Parsed::l2(ether_type, PacketClass::Arp)),
        ETH_P_8021Q | ETH_P_8021AD => Err(DropReason::VlanTooDeep),
        _ => Ok(Parsed::l2(ether_type, PacketClass::OtherL2)),
    }
}

/// [`parse`] for an untagged IPv4 frame only, within the linear data: `None` for anything
/// else and for a malformed packet (which the full parse then names and drops).
#[inline(always)]
pub fn parse_untagged_ipv4(packet: &Packet) -> Option<Parsed> {
    let ether_type: *const [u8; 2] = packet.header(12)?;
    // SAFETY: the two bytes lie within the linear data (checked by `header`).
    if u16::from_be_bytes(unsafe { *ether_type }) != ETH_P_IP {
        return None;
    }
    parse_ipv4(packet, EthHdr::LEN, ETH_P_IP).ok()
}

#[inline(always)]
fn parse_ipv4(packet: &Packet, l3: usize, ether_type: u16) -> Result<Parsed, DropReason> {
    let ip: *const Ipv4Hdr = packet.header(l3).ok_or(DropReason::Ipv4Truncated)?;
    // SAFETY: `Packet::header` checked that the whole header lies within the packet.
    let vihl = unsafe { (*ip).vihl };
    if vihl >> 4 != 4 {
        return Err(DropReason::Ipv4BadVersion);
    }
    let header_len = ((vihl & 0x0F) as usize) * 4;
    if header_len < Ipv4Hdr::LEN {
        return Err(DropReason::Ipv4BadIhl);
    }
    if l3 + header_len > packet.len {
        return Err(DropReason::Ipv4OptionsTruncated);
    }
    // SAFETY: `Packet::header` checked that the whole header lies within the packet.
    let total_len = u16::from_be_bytes(unsafe { (*ip).tot_len }) as usize;
    if total_len < header_len || l3 + total_len > packet.len {
        return Err(DropReason::Ipv4BadTotalLength);
    }
    // SAFETY: `Packet::header` checked that the whole header lies within the packet.
    let protocol = unsafe { (*ip).proto };
    // SAFETY: `Packet::header` checked that the whole header lies within the packet.
    let frags = u16::from_be_bytes(unsafe { (*ip).frags });
    let mut parsed = Parsed {
        ether_type,
        l3_offset: l3,
        l4_offset: 0,
        protocol,
        src_port: [0; 2],
        dst_port: [0; 2],
        class: PacketClass::Fragment,
        fragment: FRAG_NONE,
        frag_id: [0; 4],
    };
    if frags & (IPV4_MORE_FRAGMENTS | IPV4_OFFSET_MASK) != 0 {
        // SAFETY: `Packet::header` checked that the whole header lies within the packet.
        let id = unsafe { (*ip).id };
        parsed.frag_id = [id[0], id[1], 0, 0];
        // A non-first fragment carries no transport header: recognise it, do not parse it.
        if frags & IPV4_OFFSET_MASK != 0 {
            parsed.fragment = if frags & IPV4_MORE_FRAGMENTS != 0 {
                FRAG_LATER
            } else {
                FRAG_LAST
            };
            return Ok(parsed);
        }
        parsed.fragment = FRAG_FIRST;
    }
    parse_l4(packet, l3 + header_len, protocol, &mut parsed)?;
    Ok(parsed)
}

#[inline(always)]
fn parse_ipv6(packet: &Packet, l3: usize, ether_type: u16) -> Result<Parsed, DropReason> {
    let ip: *const Ipv6Hdr = packet.header(l3).ok_or(DropReason::Ipv6Truncated)?;
    // SAFETY: `Packet::header` checked that the whole header lies within the packet.
    if unsafe { (*ip).vcf[0] } >> 4 != 6 {
        return Err(DropReason::Ipv6BadVersion);
    }
    // SAFETY: `Packet::header` checked that the whole header lies within the packet.
    let payload_len = u16::from_be_bytes(unsafe { (*ip).payload_len }) as usize;
    if l3 + Ipv6Hdr::LEN + payload_len > packet.len {
        return Err(DropReason::Ipv6BadPayloadLength);
    }
    // SAFETY: `Packet::header` checked that the whole header lies within the packet.
    let mut next = unsafe { (*ip).next_hdr };
    let mut offset = l3 + Ipv6Hdr::LEN;
    let mut parsed = Parsed {
        ether_type,
        l3_offset: l3,
        l4_offset: 0,
        protocol: next,
        src_port: [0; 2],
        dst_port: [0; 2],
        class: PacketClass::OtherL4,
        fragment: FRAG_NONE,
        frag_id: [0; 4],
    };

    // One iteration per extension header plus the one that reaches the transport header.
    for _ in 0..=MAX_IPV6_EXT_HEADERS {
        match next {
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_MOBILITY
            | IPPROTO_HIP | IPPROTO_SHIM6 => {
                // Generic layout: next header, length in 8-octet units not counting the first.
                let ext: *const [u8; 2] =
                    packet.header(offset).ok_or(DropReason::Ipv6ExtTruncated)?;
                // SAFETY: `Packet::header` checked that the whole header lies within the packet.
                let [ext_next, ext_len] = unsafe { *ext };
                next = ext_next;
                offset += (ext_len as usize + 1) * 8;
            }
            IPPROTO_AH => {
                // AH counts its length in 4-octet units minus 2 (RFC 4302).
                let ext: *const [u8; 2] =
                    packet.header(offset).ok_or(DropReason::Ipv6ExtTruncated)?;
                // SAFETY: `Packet::header` checked that the whole header lies within the packet.
                let [ext_next, ext_len] = unsafe { *ext };
                next = ext_next;
                offset += (ext_len as usize + 2) * 4;
            }
            IPPROTO_FRAGMENT => {
                let ext: *const [u8; 8] =
                    packet.header(offset).ok_or(DropReason::Ipv6ExtTruncated)?;
                // SAFETY: `Packet::header` checked that the whole header lies within the packet.
                let frag = unsafe { *ext };
                next = frag[0];
                offset += 8;
                let fragment_offset = u16::from_be_bytes([frag[2], frag[3]]) >> 3;
                parsed.frag_id = [frag[4], frag[5], frag[6], frag[7]];
                if fragment_offset != 0 {
                    parsed.protocol = next;
                    parsed.class = PacketClass::Fragment;
                    parsed.fragment = if frag[3] & 1 != 0 {
                        FRAG_LATER
                    } else {
                        FRAG_LAST
                    };
                    return Ok(parsed);
                }
                // An atomic fragment (offset 0, no more) is a whole datagram (RFC 6946).
                if frag[3] & 1 != 0 {
                    parsed.fragment = FRAG_FIRST;
                }
            }
            _ => {
                parsed.protocol = next;
                parse_l4(packet, offset, next, &mut parsed)?;
                return Ok(parsed);
            }
        }
        if offset > packet.len {
            return Err(DropReason::Ipv6ExtTruncated);
        }
    }
    Err(DropReason::Ipv6ExtTooDeep)
}

/// Reads the transport header at `l4` and fills ports and class.
#[inline(always)]
fn parse_l4(
    packet: &Packet,
    l4: usize,
    protocol: u8,
    parsed: &mut Parsed,
) -> Result<(), DropReason> {
    parsed.l4_offset = l4;
    match protocol {
        IPPROTO_TCP => {
            let tcp: *const TcpHdr = packet.header(l4).ok_or(DropReason::TcpTruncated)?;
            // Data offset: high nibble of byte 12, in 32-bit words. Read through the checked
            // header pointer: a second bounds check would be merged away by the compiler and
            // the verifier would no longer see it.
            // SAFETY: byte 12 lies within the 20 checked bytes of the TCP header.
            let data_offset = unsafe { *(tcp as *const u8).add(12) };
            let header_len = ((data_offset >> 4) as usize) * 4;
            if header_len < TcpHdr::LEN || l4 + header_len > packet.len {
                return Err(DropReason::TcpBadDataOffset);
            }
            // SAFETY: `Packet::header` checked that the whole header lies within the packet.
            parsed.src_port = unsafe { (*tcp).source };
            // SAFETY: `Packet::header` checked that the whole header lies within the packet.
            parsed.dst_port = unsafe { (*tcp).dest };
            parsed.class = PacketClass::Tcp;
        }
        IPPROTO_UDP => {
            let udp: *const UdpHdr = packet.header(l4).ok_or(DropReason::UdpTruncated)?;
            // SAFETY: `Packet::header` checked that the whole header lies within the packet.
            parsed.src_port = unsafe { (*udp).src };
            // SAFETY: `Packet::header` checked that the whole header lies within the packet.
            parsed.dst_port = unsafe { (*udp).dst };
            parsed.class = PacketClass::Udp;
        }
        IPPROTO_SCTP => {
            let sctp: *const SctpHdr = packet.header(l4).ok_or(DropReason::SctpTruncated)?;
            // SAFETY: `Packet::header` checked that the whole header lies within the packet.
            parsed.src_port = unsafe { (*sctp).src };
            // SAFETY: `Packet::header` checked that the whole header lies within the packet.
            parsed.dst_port = unsafe { (*sctp).dst };
            parsed.class = PacketClass::Sctp;
        }
        IPPROTO_ICMP => {
            packet
                .header::<[u8; ICMP_HEADER_LEN]>(l4)
                .ok_or(DropReason::IcmpTruncated)?;
            parsed.class = PacketClass::Icmp;
        }
        IPPROTO_ICMPV6 => {
            packet
                .header::<[u8; ICMP_HEADER_LEN]>(l4)
                .ok_or(DropReason::Icmpv6Truncated)?;
            parsed.class = PacketClass::Icmpv6;
        }
        _ => {
            parsed.class = PacketClass::OtherL4;
        }
    }
    Ok(())
}

/// How much to pull into the linear area when headers straddle it: enough for Ethernet, two VLAN
/// tags, IPv4 with options or IPv6 with a deep extension chain, and a TCP header with options.
const PULL_LEN: u32 = 1024;

/// Parses the linear part of the skb; if a header runs past it while the packet is longer, pulls
/// more into the linear area once and parses again, so only truly short packets are dropped.
#[inline(always)]
pub fn parse_skb(ctx: &TcContext) -> Result<Parsed, DropReason> {
    let len = ctx.len() as usize;
    let first = parse(&Packet::new(ctx.data(), ctx.data_end(), len));
    match first {
        Err(reason) if ctx.data_end() - ctx.data() < len && is_truncation(reason) => {
            let want = if ctx.len() < PULL_LEN {
                ctx.len()
            } else {
                PULL_LEN
            };
            if ctx.pull_data(want).is_err() {
                return Err(reason);
            }
            parse(&Packet::new(ctx.data(), ctx.data_end(), len))
        }
        other => other,
    }
}

#[inline(always)]
fn is_truncation(reason: DropReason) -> bool {
    use DropReason::*;
    matches!(
        reason,
        EthTruncated
            | VlanTruncated
            | Ipv4Truncated
            | Ipv4OptionsTruncated
            | Ipv6Truncated
            | Ipv6ExtTruncated
            | TcpTruncated
            | TcpBadDataOffset
            | UdpTruncated
            | SctpTruncated
            | IcmpTruncated
            | Icmpv6Truncated
    )
}

/// Reads a `T` at a fixed `offset` straight from the packet's linear data (the parser made
/// sure the headers are there): direct packet access instead of a helper call per field.
#[inline(always)]
pub fn read<T: Copy>(ctx: &TcContext, offset: usize) -> Option<T> {
    let at = ctx.data() + offset;
    if at + core::mem::size_of::<T>() > ctx.data_end() {
        return None;
    }
    // SAFETY: the bytes lie within the packet (checked just above).
    Some(unsafe { core::ptr::read_unaligned(at as *const T) })
}

/// Stores the parse result in this CPU's `PARSED` slot, where a tail-called program or a later
/// stage of this run reads it; false if the slot is missing.
#[inline(always)]
pub fn stash(parsed: &Parsed) -> bool {
    let Some(slot) = PARSED.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's own slot; volatile, so the compiler cannot forward the stored
    // values to what reads the slot back (see `stashed`).
    unsafe { core::ptr::write_volatile(slot, *parsed) };
    true
}

/// [`stash`], then the slot itself: read back from map memory, the parse result is one
/// unknown value to the verifier, not the constants of each parse path, so the stages after
/// it are walked once rather than once per kind of packet.
#[inline(always)]
pub fn stashed(parsed: &Parsed) -> Option<&'static Parsed> {
    if !stash(parsed) {
        return None;
    }
    PARSED.get(0)
}

/// Reads the source and destination of an untagged IP packet into `src` and `dst`, in the
/// 16-byte form (IPv4-mapped for IPv4), straight from the packet; false if the header is not
/// in the linear data. Written in place, so callers can fill a per-CPU working set without a
/// copy on the stack.
#[inline(always)]
pub fn read_addresses(ctx: &TcContext, ipv4: bool, src: &mut Addr, dst: &mut Addr) -> bool {
    if ipv4 {
        let Some(a) = read::<[u8; 8]>(ctx, ETH_LEN + 12) else {
            return false;
        };
        set_ipv4_mapped(src, [a[0], a[1], a[2], a[3]]);
        set_ipv4_mapped(dst, [a[4], a[5], a[6], a[7]]);
    } else {
        let at = ctx.data() + ETH_LEN + 8;
        if at + 32 > ctx.data_end() {
            return false;
        }
        // SAFETY: both addresses lie within the packet (checked just above); copied straight
        // into place, not through the stack.
        unsafe {
            copy_bytes::<16>(src.as_mut_ptr(), at as *const u8);
            copy_bytes::<16>(dst.as_mut_ptr(), (at + 16) as *const u8);
        }
    }
    true
}

/// Copies `N` bytes of the packet from `offset` (anywhere, linear or not) straight into `dst`
/// with the load helper: no copy through the stack. False if the packet is shorter.
#[inline(always)]
pub fn load_bytes<const N: usize>(ctx: &TcContext, offset: usize, dst: &mut [u8; N]) -> bool {
    // SAFETY: `dst` is N writable bytes; the helper checks the packet side.
    unsafe {
        aya_ebpf::helpers::bpf_skb_load_bytes(
            ctx.skb.skb.cast(),
            offset as u32,
            dst.as_mut_ptr().cast(),
            N as u32,
        ) == 0
    }
}
