//! Packet builders for the tests (PKTGEN). Valid packets come from etherparse, an implementation
//! independent of our kernel parser; malformed ones are valid packets with one field broken.

use etherparse::{IpNumber, PacketBuilder};

pub const POD_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x01, 0x02];
pub const GW_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x01, 0x01];
pub const SRC_V4: [u8; 4] = [10, 244, 1, 2];
pub const DST_V4: [u8; 4] = [10, 244, 2, 2];
pub const SRC_V6: [u8; 16] = [0xfd, 0, 0x10, 0x2a, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2];
pub const DST_V6: [u8; 16] = [0xfd, 0, 0x10, 0x2a, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 2];
pub const PAYLOAD: &[u8] = b"dataplane-test-payload";

/// A MAC address as text (`0a:58:0a:f4:01:02`).
pub fn mac_text(mac: &[u8]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Offset of the network header in an untagged frame.
pub const L3: usize = 14;

pub const IPPROTO_SCTP: u8 = 132;

fn eth() -> etherparse::PacketBuilderStep<etherparse::Ethernet2Header> {
    PacketBuilder::ethernet2(POD_MAC, GW_MAC)
}

fn finish(
    write: impl FnOnce(&mut Vec<u8>) -> Result<(), etherparse::err::packet::BuildWriteError>,
) -> Vec<u8> {
    let mut out = Vec::new();
    write(&mut out).expect("etherparse builds the packet");
    out
}

pub fn ipv4_tcp() -> Vec<u8> {
    finish(|o| {
        eth()
            .ipv4(SRC_V4, DST_V4, 64)
            .tcp(40000, 80, 1, 64240)
            .write(o, PAYLOAD)
    })
}

pub fn ipv4_udp() -> Vec<u8> {
    finish(|o| {
        eth()
            .ipv4(SRC_V4, DST_V4, 64)
            .udp(40000, 53)
            .write(o, PAYLOAD)
    })
}

pub fn ipv4_icmp_echo() -> Vec<u8> {
    finish(|o| {
        eth()
            .ipv4(SRC_V4, DST_V4, 64)
            .icmpv4_echo_request(7, 1)
            .write(o, PAYLOAD)
    })
}

/// SCTP common header (ports 40000 -> 38412, tag, checksum left zero) and a short chunk.
pub fn sctp_payload() -> Vec<u8> {
    let mut sctp = Vec::new();
    sctp.extend_from_slice(&40000u16.to_be_bytes());
    sctp.extend_from_slice(&38412u16.to_be_bytes());
    sctp.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0]);
    sctp.extend_from_slice(&[1, 0, 0, 4]);
    sctp
}

pub fn ipv4_sctp() -> Vec<u8> {
    finish(|o| {
        eth()
            .ipv4(SRC_V4, DST_V4, 64)
            .write(o, IpNumber(IPPROTO_SCTP), &sctp_payload())
    })
}

pub fn ipv6_tcp() -> Vec<u8> {
    finish(|o| {
        eth()
            .ipv6(SRC_V6, DST_V6, 64)
            .tcp(40000, 80, 1, 64240)
            .write(o, PAYLOAD)
    })
}

pub fn ipv6_udp() -> Vec<u8> {
    finish(|o| {
        eth()
            .ipv6(SRC_V6, DST_V6, 64)
            .udp(40000, 53)
            .write(o, PAYLOAD)
    })
}

pub fn ipv6_sctp() -> Vec<u8> {
    finish(|o| {
        eth()
            .ipv6(SRC_V6, DST_V6, 64)
            .write(o, IpNumber(IPPROTO_SCTP), &sctp_payload())
    })
}

pub fn ipv6_icmp_echo() -> Vec<u8> {
    finish(|o| {
        eth()
            .ipv6(SRC_V6, DST_V6, 64)
            .icmpv6_echo_request(7, 1)
            .write(o, PAYLOAD)
    })
}

pub fn vlan_ipv4_udp() -> Vec<u8> {
    finish(|o| {
        eth()
            .single_vlan(etherparse::VlanId::try_new(100).expect("valid VLAN id"))
            .ipv4(SRC_V4, DST_V4, 64)
            .udp(40000, 53)
            .write(o, PAYLOAD)
    })
}

pub fn qinq_ipv4_tcp() -> Vec<u8> {
    finish(|o| {
        eth()
            .double_vlan(
                etherparse::VlanId::try_new(10).expect("valid VLAN id"),
                etherparse::VlanId::try_new(20).expect("valid VLAN id"),
            )
            .ipv4(SRC_V4, DST_V4, 64)
            .tcp(40000, 80, 1, 64240)
            .write(o, PAYLOAD)
    })
}

/// An ARP request for 10.244.2.2.
pub fn arp() -> Vec<u8> {
    let mut frame = Vec::new();
    frame.extend_from_slice(&[0xff; 6]);
    frame.extend_from_slice(&POD_MAC);
    frame.extend_from_slice(&0x0806u16.to_be_bytes());
    frame.extend_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 1]);
    frame.extend_from_slice(&POD_MAC);
    frame.extend_from_slice(&SRC_V4);
    frame.extend_from_slice(&[0; 6]);
    frame.extend_from_slice(&DST_V4);
    frame
}

/// An LLDP frame: neither IP nor ARP.
pub fn lldp() -> Vec<u8> {
    let mut frame = Vec::new();
    frame.extend_from_slice(&[0x01, 0x80, 0xc2, 0, 0, 0x0e]);
    frame.extend_from_slice(&POD_MAC);
    frame.extend_from_slice(&0x88ccu16.to_be_bytes());
    frame.extend_from_slice(&[0x02, 0x07, 0x04, 2, 0, 0, 0, 1, 2, 0, 0]);
    frame
}

/// Pads a frame to the 60-byte Ethernet minimum, as a NIC does for short frames.
pub fn padded(mut frame: Vec<u8>) -> Vec<u8> {
    if frame.len() < 60 {
        frame.resize(60, 0);
    }
    frame
}

/// Prepends `count` extra 802.1Q tags after the MAC addresses.
pub fn with_extra_vlan_tags(frame: &[u8], count: usize) -> Vec<u8> {
    let mut out = frame[..12].to_vec();
    for i in 0..count {
        out.extend_from_slice(&0x8100u16.to_be_bytes());
        out.extend_from_slice(&(100 + i as u16).to_be_bytes());
    }
    out.extend_from_slice(&frame[12..]);
    out
}

/// Recomputes the IPv4 header checksum of the header at `l3`.
pub fn fix_ipv4_checksum(frame: &mut [u8], l3: usize) {
    let ihl = usize::from(frame[l3] & 0x0f) * 4;
    frame[l3 + 10] = 0;
    frame[l3 + 11] = 0;
    let mut sum: u32 = 0;
    for chunk in frame[l3..l3 + ihl].chunks(2) {
        sum += u32::from(u16::from_be_bytes([chunk[0], chunk[1]]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    let check = !(sum as u16);
    frame[l3 + 10..l3 + 12].copy_from_slice(&check.to_be_bytes());
}

/// Inserts `words` 32-bit words of IPv4 options (NOPs ending in EOL) into an untagged IPv4
/// frame, updating IHL, total length and checksum.
pub fn with_ipv4_options(frame: &[u8], words: usize) -> Vec<u8> {
    assert!(words <= 10, "IHL tops out at 15 words");
    let mut options = vec![1u8; words * 4];
    if let Some(last) = options.last_mut() {
        *last = 0;
    }
    let mut out = frame[..L3 + 20].to_vec();
    out.extend_from_slice(&options);
    out.extend_from_slice(&frame[L3 + 20..]);
    out[L3] = 0x40 | (5 + words as u8);
    let total = u16::from_be_bytes([out[L3 + 2], out[L3 + 3]]) + (words * 4) as u16;
    out[L3 + 2..L3 + 4].copy_from_slice(&total.to_be_bytes());
    fix_ipv4_checksum(&mut out, L3);
    out
}

/// Sets the IPv4 fragment field (offset in 8-byte units, more-fragments flag).
pub fn as_ipv4_fragment(frame: &[u8], offset_units: u16, more: bool) -> Vec<u8> {
    let mut out = frame.to_vec();
    let field = offset_units & 0x1fff | if more { 0x2000 } else { 0 };
    out[L3 + 6..L3 + 8].copy_from_slice(&field.to_be_bytes());
    fix_ipv4_checksum(&mut out, L3);
    out
}

/// An IPv6 extension header to insert: its protocol number and its total length in bytes
/// (a multiple of 8; 8 for a fragment header).
#[derive(Clone, Copy)]
pub struct Ext {
    pub kind: u8,
    pub len: usize,
    /// Fragment offset in 8-byte units (fragment headers only).
    pub fragment_offset: u16,
}

pub const HOP_BY_HOP: u8 = 0;
pub const ROUTING: u8 = 43;
pub const FRAGMENT: u8 = 44;
pub const DEST_OPTS: u8 = 60;

impl Ext {
    pub const fn options(kind: u8, len: usize) -> Self {
        Self {
            kind,
            len,
            fragment_offset: 0,
        }
    }

    pub const fn fragment(offset: u16) -> Self {
        Self {
            kind: FRAGMENT,
            len: 8,
            fragment_offset: offset,
        }
    }
}

/// Inserts extension headers (in order) between the IPv6 header and its payload of an untagged
/// IPv6 frame, chaining next-header fields and updating the payload length.
pub fn with_ipv6_extensions(frame: &[u8], exts: &[Ext]) -> Vec<u8> {
    let final_next = frame[L3 + 6];
    let mut chain = Vec::new();
    for (i, ext) in exts.iter().enumerate() {
        let next = exts.get(i + 1).map_or(final_next, |e| e.kind);
        let mut bytes = vec![0u8; ext.len];
        bytes[0] = next;
        if ext.kind == FRAGMENT {
            let field = ext.fragment_offset << 3;
            bytes[2..4].copy_from_slice(&field.to_be_bytes());
            bytes[4..8].copy_from_slice(&0x1234_5678u32.to_be_bytes());
        } else {
            assert!(
                ext.len.is_multiple_of(8) && ext.len >= 8,
                "options headers are 8n bytes"
            );
            bytes[1] = (ext.len / 8 - 1) as u8;
            // PadN filling the rest of the header.
            bytes[2] = 1;
            bytes[3] = (ext.len - 4) as u8;
        }
        chain.extend_from_slice(&bytes);
    }
    let mut out = frame[..L3 + 40].to_vec();
    if let Some(first) = exts.first() {
        out[L3 + 6] = first.kind;
    }
    let payload_len = u16::from_be_bytes([out[L3 + 4], out[L3 + 5]]) + chain.len() as u16;
    out[L3 + 4..L3 + 6].copy_from_slice(&payload_len.to_be_bytes());
    out.extend_from_slice(&chain);
    out.extend_from_slice(&frame[L3 + 40..]);
    out
}

/// An IPv4 UDP packet of 8 payload bytes: below the Ethernet minimum before padding.
pub fn ipv4_udp_short() -> Vec<u8> {
    finish(|o| {
        eth()
            .ipv4(SRC_V4, DST_V4, 64)
            .udp(40000, 53)
            .write(o, &[1, 2])
    })
}

/// An IPv4 packet carrying `protocol` with a short payload.
pub fn ipv4_with_protocol(protocol: u8) -> Vec<u8> {
    finish(|o| {
        eth()
            .ipv4(SRC_V4, DST_V4, 64)
            .write(o, IpNumber(protocol), PAYLOAD)
    })
}

/// An IPv4 packet whose `protocol` header is only `l4_len` bytes long (lengths consistent, so
/// only the transport header is short).
pub fn ipv4_truncated_l4(protocol: u8, l4_len: usize) -> Vec<u8> {
    finish(|o| {
        eth()
            .ipv4(SRC_V4, DST_V4, 64)
            .write(o, IpNumber(protocol), &vec![0u8; l4_len])
    })
}

/// The IPv6 counterpart of [`ipv4_truncated_l4`].
pub fn ipv6_truncated_l4(protocol: u8, l4_len: usize) -> Vec<u8> {
    finish(|o| {
        eth()
            .ipv6(SRC_V6, DST_V6, 64)
            .write(o, IpNumber(protocol), &vec![0u8; l4_len])
    })
}

/// An IPv6 packet announcing a hop-by-hop header of which only one byte is present.
pub fn ipv6_truncated_extension() -> Vec<u8> {
    // Built with an unassigned protocol, then relabelled: etherparse will not write an
    // extension header it cannot fill itself.
    let mut frame = finish(|o| {
        eth()
            .ipv6(SRC_V6, DST_V6, 64)
            .write(o, IpNumber(253), &[17])
    });
    frame[L3 + 6] = HOP_BY_HOP;
    frame
}

/// A Geneve packet (no options, VNI 1, Ethernet payload) from `src` to `dst` on port 6081,
/// carrying `inner`. The outer headers come from etherparse; scapy checks the format in the
/// overlay tests.
pub fn geneve_v4(src: [u8; 4], dst: [u8; 4], inner: &[u8]) -> Vec<u8> {
    let mut payload = vec![0, 0, 0x65, 0x58, 0, 0, 1, 0];
    payload.extend_from_slice(inner);
    finish(|o| {
        PacketBuilder::ethernet2([2, 0, 0, 0, 0x99, 2], [2, 0, 0, 0, 0x99, 1])
            .ipv4(src, dst, 64)
            .udp(50000, 6081)
            .write(o, &payload)
    })
}

/// VXLAN over IPv4 from `src` to `dst` on UDP port `dport` (I flag, `vni`) around `inner`.
pub fn vxlan_v4(src: [u8; 4], dst: [u8; 4], dport: u16, vni: u32, inner: &[u8]) -> Vec<u8> {
    let v = (vni << 8).to_be_bytes();
    let mut payload = vec![0x08, 0, 0, 0, v[0], v[1], v[2], 0];
    payload.extend_from_slice(inner);
    finish(|o| {
        PacketBuilder::ethernet2([2, 0, 0, 0, 0x99, 0x20], [2, 0, 0, 0, 0x99, 1])
            .ipv4(src, dst, 64)
            .udp(51000, dport)
            .write(o, &payload)
    })
}

/// `frame` (untagged IPv4) with its destination address replaced.
pub fn with_ipv4_destination(frame: &[u8], dst: [u8; 4]) -> Vec<u8> {
    let mut out = frame.to_vec();
    out[L3 + 16..L3 + 20].copy_from_slice(&dst);
    fix_ipv4_checksum(&mut out, L3);
    out
}

/// An IPv4 TCP frame from `src:sport` to `dst:dport` (SYN when `syn`, else ACK), built here for
/// tests that need many flows quickly (scapy builds the frames whose bytes are compared).
pub fn tcp_v4_flow(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, syn: bool) -> Vec<u8> {
    finish(|o| {
        let tcp = eth().ipv4(src, dst, 64).tcp(sport, dport, 1, 64240);
        let tcp = if syn { tcp.syn() } else { tcp.ack(1) };
        tcp.write(o, PAYLOAD)
    })
}

/// An IPv4 UDP frame from `src:sport` to `dst:dport`.
pub fn udp_v4_flow(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16) -> Vec<u8> {
    finish(|o| eth().ipv4(src, dst, 64).udp(sport, dport).write(o, PAYLOAD))
}

/// An IPv4 ICMP echo request from `src` to `dst`.
pub fn icmp_v4_echo(src: [u8; 4], dst: [u8; 4]) -> Vec<u8> {
    finish(|o| {
        eth()
            .ipv4(src, dst, 64)
            .icmpv4_echo_request(7, 1)
            .write(o, PAYLOAD)
    })
}

/// An IPv4 SCTP packet from `src:40000` to `dst:dport`.
pub fn sctp_v4_flow(src: [u8; 4], dst: [u8; 4], dport: u16) -> Vec<u8> {
    let mut sctp = sctp_payload();
    sctp[2..4].copy_from_slice(&dport.to_be_bytes());
    finish(|o| {
        eth()
            .ipv4(src, dst, 64)
            .write(o, IpNumber(IPPROTO_SCTP), &sctp)
    })
}

/// An IPv6 TCP SYN from `src:sport` to `dst:dport`.
pub fn tcp_v6_flow(src: [u8; 16], sport: u16, dst: [u8; 16], dport: u16) -> Vec<u8> {
    finish(|o| {
        eth()
            .ipv6(src, dst, 64)
            .tcp(sport, dport, 1, 64240)
            .syn()
            .write(o, PAYLOAD)
    })
}

/// The source MAC and IP address of an Ethernet frame (as etherparse reads it).
pub fn source_of(frame: &[u8]) -> anyhow::Result<([u8; 6], std::net::IpAddr)> {
    let (mac, source, _) = addresses_of(frame)?;
    Ok((mac.0, source))
}

/// The destination MAC and IP address of an Ethernet frame.
pub fn destination_of(frame: &[u8]) -> anyhow::Result<([u8; 6], std::net::IpAddr)> {
    let (mac, _, destination) = addresses_of(frame)?;
    Ok((mac.1, destination))
}

type Macs = ([u8; 6], [u8; 6]);

fn addresses_of(frame: &[u8]) -> anyhow::Result<(Macs, std::net::IpAddr, std::net::IpAddr)> {
    use etherparse::{NetSlice, SlicedPacket};
    let sliced = SlicedPacket::from_ethernet(frame)?;
    let Some(etherparse::LinkSlice::Ethernet2(eth)) = &sliced.link else {
        anyhow::bail!("not an Ethernet II frame");
    };
    let macs = (eth.source(), eth.destination());
    match &sliced.net {
        Some(NetSlice::Ipv4(ip)) => Ok((
            macs,
            ip.header().source_addr().into(),
            ip.header().destination_addr().into(),
        )),
        Some(NetSlice::Ipv6(ip)) => Ok((
            macs,
            ip.header().source_addr().into(),
            ip.header().destination_addr().into(),
        )),
        _ => anyhow::bail!("not an IP frame"),
    }
}

/// `frame` as the node delivers it to the pod it is addressed to: from the pod's gateway MAC to
/// the pod's MAC.
pub fn delivered(frame: &[u8]) -> Vec<u8> {
    let mut out = frame.to_vec();
    out[0..6].copy_from_slice(&POD_MAC);
    out[6..12].copy_from_slice(&GW_MAC);
    out
}

/// A TCP segment from the test pod to `dst` port 80, checksums complete (a packet that
/// leaves the cluster network when `dst` is outside it).
pub fn ipv4_tcp_to(dst: [u8; 4]) -> Vec<u8> {
    finish(|o| {
        eth()
            .ipv4(SRC_V4, dst, 64)
            .tcp(40000, 80, 1, 64240)
            .write(o, PAYLOAD)
    })
}
