//! IGMP (RFC 2236, RFC 3376) and MLD (RFC 2710, RFC 3810) as the agent needs them: the
//! membership changes a pod's report or leave says, and the queries the agent sends pods.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use etherparse::checksum::Sum16BitWords;

const IGMP_QUERY: u8 = 0x11;
const IGMPV1_REPORT: u8 = 0x12;
const IGMPV2_REPORT: u8 = 0x16;
const IGMPV2_LEAVE: u8 = 0x17;
const IGMPV3_REPORT: u8 = 0x22;
const MLD_QUERY: u8 = 130;
const MLDV1_REPORT: u8 = 131;
const MLDV1_DONE: u8 = 132;
const MLDV2_REPORT: u8 = 143;

/// IGMPv3 / MLDv2 group record types (RFC 3376 §4.2.12).
const MODE_IS_INCLUDE: u8 = 1;
const MODE_IS_EXCLUDE: u8 = 2;
const CHANGE_TO_INCLUDE: u8 = 3;
const CHANGE_TO_EXCLUDE: u8 = 4;
const ALLOW_NEW_SOURCES: u8 = 5;
const BLOCK_OLD_SOURCES: u8 = 6;

/// What a message says about one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    Join(IpAddr),
    Leave(IpAddr),
}

/// Why a message was not understood.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("{0}: message too short")]
    Truncated(&'static str),
    #[error("IGMP checksum does not match")]
    Checksum,
    #[error("{kind} type {ty} is no membership report or leave")]
    NotAReport { kind: &'static str, ty: u8 },
    #[error("{kind}: group {group} is no multicast address")]
    NotAGroup { kind: &'static str, group: IpAddr },
}

/// The membership changes of an IGMP message (`family` 4, from its type byte on) or an MLD
/// one (`family` 6, the ICMPv6 message). Groups the dataplane does not track (the all-hosts
/// group, neighbour discovery's solicited-node groups) are left out.
pub fn changes(family: u32, message: &[u8]) -> Result<Vec<Change>, WireError> {
    let changes = if family == 4 {
        igmp(message)?
    } else {
        mld(message)?
    };
    Ok(changes
        .into_iter()
        .filter(|change| {
            let (Change::Join(group) | Change::Leave(group)) = *change;
            tracked(group)
        })
        .collect())
}

/// Whether the dataplane keeps members of `group`: every group but all-hosts (224.0.0.1,
/// ff02::1), which every host is in, and the solicited-node groups (ff02::1:ff00:0/104) of
/// neighbour discovery, which it delivers as unicast plumbing.
pub fn tracked(group: IpAddr) -> bool {
    match group {
        IpAddr::V4(v4) => v4.is_multicast() && v4 != Ipv4Addr::new(224, 0, 0, 1),
        IpAddr::V6(v6) => {
            let s = v6.segments();
            let solicited = s[0] == 0xff02 && s[1..5] == [0; 4] && s[5] == 1 && s[6] >> 8 == 0xff;
            v6.is_multicast() && v6 != Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1) && !solicited
        }
    }
}

fn igmp(message: &[u8]) -> Result<Vec<Change>, WireError> {
    if message.len() < 8 {
        return Err(WireError::Truncated("IGMP"));
    }
    if Sum16BitWords::new().add_slice(message).ones_complement() != 0 {
        return Err(WireError::Checksum);
    }
    let group = |at: usize| -> Result<IpAddr, WireError> {
        let bytes: [u8; 4] = message
            .get(at..at + 4)
            .and_then(|b| b.try_into().ok())
            .ok_or(WireError::Truncated("IGMP"))?;
        let group = IpAddr::V4(Ipv4Addr::from(bytes));
        if !group.is_multicast() {
            return Err(WireError::NotAGroup {
                kind: "IGMP",
                group,
            });
        }
        Ok(group)
    };
    match message[0] {
        IGMPV1_REPORT | IGMPV2_REPORT => Ok(vec![Change::Join(group(4)?)]),
        IGMPV2_LEAVE => Ok(vec![Change::Leave(group(4)?)]),
        IGMPV3_REPORT => records(message, 8, 4, "IGMPv3"),
        ty => Err(WireError::NotAReport { kind: "IGMP", ty }),
    }
}

fn mld(message: &[u8]) -> Result<Vec<Change>, WireError> {
    if message.len() < 8 {
        return Err(WireError::Truncated("MLD"));
    }
    let group = |at: usize| -> Result<IpAddr, WireError> {
        let bytes: [u8; 16] = message
            .get(at..at + 16)
            .and_then(|b| b.try_into().ok())
            .ok_or(WireError::Truncated("MLD"))?;
        let group = IpAddr::V6(Ipv6Addr::from(bytes));
        if !group.is_multicast() {
            return Err(WireError::NotAGroup { kind: "MLD", group });
        }
        Ok(group)
    };
    match message[0] {
        MLDV1_REPORT => Ok(vec![Change::Join(group(8)?)]),
        MLDV1_DONE => Ok(vec![Change::Leave(group(8)?)]),
        MLDV2_REPORT => records(message, 8, 16, "MLDv2"),
        ty => Err(WireError::NotAReport { kind: "MLD", ty }),
    }
}

/// The group records of an IGMPv3 or MLDv2 report: the number of records in bytes 6..8, the
/// records from `first` on, addresses of `width` bytes. A record in exclude mode (or one
/// allowing sources) joins; a change to include mode with no source leaves. Sources are not
/// filtered: a member gets the group's traffic from every sender of its namespace.
fn records(
    message: &[u8],
    first: usize,
    width: usize,
    kind: &'static str,
) -> Result<Vec<Change>, WireError> {
    let count = u16::from_be_bytes([message[6], message[7]]) as usize;
    let mut at = first;
    let mut changes = Vec::with_capacity(count);
    for _ in 0..count {
        let header = message
            .get(at..at + 4 + width)
            .ok_or(WireError::Truncated(kind))?;
        let (ty, aux_words, sources) = (
            header[0],
            header[1] as usize,
            u16::from_be_bytes([header[2], header[3]]) as usize,
        );
        let group = if width == 4 {
            IpAddr::V4(Ipv4Addr::from(
                <[u8; 4]>::try_from(&header[4..8]).expect("4 bytes"),
            ))
        } else {
            IpAddr::V6(Ipv6Addr::from(
                <[u8; 16]>::try_from(&header[4..20]).expect("16 bytes"),
            ))
        };
        if !group.is_multicast() {
            return Err(WireError::NotAGroup { kind, group });
        }
        at += 4 + width + sources * width + aux_words * 4;
        if at > message.len() {
            return Err(WireError::Truncated(kind));
        }
        match ty {
            MODE_IS_EXCLUDE | CHANGE_TO_EXCLUDE => changes.push(Change::Join(group)),
            MODE_IS_INCLUDE | CHANGE_TO_INCLUDE | ALLOW_NEW_SOURCES if sources > 0 => {
                changes.push(Change::Join(group))
            }
            MODE_IS_INCLUDE | CHANGE_TO_INCLUDE => changes.push(Change::Leave(group)),
            // Blocking some sources keeps the membership.
            BLOCK_OLD_SOURCES | ALLOW_NEW_SOURCES => {}
            _ => {}
        }
    }
    Ok(changes)
}

/// The query the agent sends into a pod: general (`group` None) or for one group after a
/// leave; IGMPv3 or MLDv2 by the family of `source`, which is the pods' gateway address.
pub struct Query {
    pub source: IpAddr,
    pub group: Option<IpAddr>,
    /// Maximum response time, in tenths of a second (under 128 for IGMPv3's plain encoding).
    pub max_response_tenths: u8,
    /// Query interval announced to members, in seconds (QQIC, under 128).
    pub interval_secs: u8,
}

/// The Ethernet frame of `query`, from `host_mac` (the pod veth's host side).
pub fn query_frame(query: &Query, host_mac: [u8; 6]) -> Vec<u8> {
    match query.source {
        IpAddr::V4(source) => igmp_query(query, source, host_mac),
        IpAddr::V6(source) => mld_query(query, source, host_mac),
    }
}

fn igmp_query(query: &Query, source: Ipv4Addr, host_mac: [u8; 6]) -> Vec<u8> {
    let group = match query.group {
        Some(IpAddr::V4(group)) => group,
        _ => Ipv4Addr::UNSPECIFIED,
    };
    // A general query goes to all-hosts, a group's query to the group.
    let destination = if group.is_unspecified() {
        Ipv4Addr::new(224, 0, 0, 1)
    } else {
        group
    };
    // IGMPv3 query: type, max resp code, checksum, group, S/QRV (robustness 2), QQIC, no
    // sources.
    let mut igmp = vec![IGMP_QUERY, query.max_response_tenths, 0, 0];
    igmp.extend_from_slice(&group.octets());
    igmp.extend_from_slice(&[2, query.interval_secs, 0, 0]);
    let sum = Sum16BitWords::new().add_slice(&igmp).ones_complement();
    igmp[2..4].copy_from_slice(&sum.to_ne_bytes());
    // IPv4 with the Router Alert option (RFC 2113), TTL 1, as RFC 3376 asks.
    let total = (24 + igmp.len()) as u16;
    let mut ip = vec![0x46, 0xC0];
    ip.extend_from_slice(&total.to_be_bytes());
    ip.extend_from_slice(&[0, 0, 0, 0, 1, 2, 0, 0]);
    ip.extend_from_slice(&source.octets());
    ip.extend_from_slice(&destination.octets());
    ip.extend_from_slice(&[0x94, 0x04, 0, 0]);
    let sum = Sum16BitWords::new().add_slice(&ip).ones_complement();
    ip[10..12].copy_from_slice(&sum.to_ne_bytes());
    let o = destination.octets();
    let mut frame = vec![0x01, 0x00, 0x5e, o[1] & 0x7f, o[2], o[3]];
    frame.extend_from_slice(&host_mac);
    frame.extend_from_slice(&0x0800u16.to_be_bytes());
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&igmp);
    frame
}

fn mld_query(query: &Query, source: Ipv6Addr, host_mac: [u8; 6]) -> Vec<u8> {
    let group = match query.group {
        Some(IpAddr::V6(group)) => group,
        _ => Ipv6Addr::UNSPECIFIED,
    };
    let destination = if group.is_unspecified() {
        Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1)
    } else {
        group
    };
    // MLDv2 query: type, code, checksum, max response code (ms), reserved, group, S/QRV,
    // QQIC, no sources.
    let max_response_ms = u16::from(query.max_response_tenths) * 100;
    let mut mld = vec![MLD_QUERY, 0, 0, 0];
    mld.extend_from_slice(&max_response_ms.to_be_bytes());
    mld.extend_from_slice(&[0, 0]);
    mld.extend_from_slice(&group.octets());
    mld.extend_from_slice(&[2, query.interval_secs, 0, 0]);
    // The ICMPv6 checksum covers the pseudo-header (RFC 8200 §8.1).
    let sum = Sum16BitWords::new()
        .add_slice(&source.octets())
        .add_slice(&destination.octets())
        .add_slice(&(mld.len() as u32).to_be_bytes())
        .add_slice(&[0, 0, 0, 58])
        .add_slice(&mld)
        .ones_complement();
    mld[2..4].copy_from_slice(&sum.to_ne_bytes());
    // Hop-by-Hop header with Router Alert (MLD) and padding, then the message; hop limit 1.
    let hop_by_hop = [58, 0, 5, 2, 0, 0, 1, 0];
    let payload = (hop_by_hop.len() + mld.len()) as u16;
    let mut ip = vec![0x60, 0, 0, 0];
    ip.extend_from_slice(&payload.to_be_bytes());
    ip.extend_from_slice(&[0, 1]);
    ip.extend_from_slice(&source.octets());
    ip.extend_from_slice(&destination.octets());
    let o = destination.octets();
    let mut frame = vec![0x33, 0x33, o[12], o[13], o[14], o[15]];
    frame.extend_from_slice(&host_mac);
    frame.extend_from_slice(&0x86DDu16.to_be_bytes());
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&hop_by_hop);
    frame.extend_from_slice(&mld);
    frame
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn with_igmp_checksum(mut message: Vec<u8>) -> Vec<u8> {
        message[2..4].copy_from_slice(&[0, 0]);
        let sum = Sum16BitWords::new().add_slice(&message).ones_complement();
        message[2..4].copy_from_slice(&sum.to_ne_bytes());
        message
    }

    #[test]
    fn igmpv2_reports_and_leaves_name_their_group() {
        let report = with_igmp_checksum(vec![0x16, 0, 0, 0, 224, 5, 5, 5]);
        assert_eq!(changes(4, &report), Ok(vec![Change::Join(v4("224.5.5.5"))]));
        let leave = with_igmp_checksum(vec![0x17, 0, 0, 0, 224, 5, 5, 5]);
        assert_eq!(changes(4, &leave), Ok(vec![Change::Leave(v4("224.5.5.5"))]));
        let mut bad = report.clone();
        bad[7] = 6;
        assert_eq!(changes(4, &bad), Err(WireError::Checksum));
        let unicast = with_igmp_checksum(vec![0x16, 0, 0, 0, 10, 0, 0, 1]);
        assert!(matches!(
            changes(4, &unicast),
            Err(WireError::NotAGroup { .. })
        ));
        let query = with_igmp_checksum(vec![0x11, 100, 0, 0, 0, 0, 0, 0]);
        assert!(matches!(
            changes(4, &query),
            Err(WireError::NotAReport { ty: 0x11, .. })
        ));
    }

    #[test]
    fn igmpv3_records_join_in_exclude_mode_and_leave_to_empty_include() {
        // Two records: CHANGE_TO_EXCLUDE 224.5.5.5 (join), CHANGE_TO_INCLUDE 224.3.3.3 with
        // no sources (leave); then an all-hosts record that is not tracked.
        let report = with_igmp_checksum(vec![
            0x22, 0, 0, 0, 0, 0, 0, 3, //
            4, 0, 0, 0, 224, 5, 5, 5, //
            3, 0, 0, 0, 224, 3, 3, 3, //
            2, 0, 0, 0, 224, 0, 0, 1,
        ]);
        assert_eq!(
            changes(4, &report),
            Ok(vec![
                Change::Join(v4("224.5.5.5")),
                Change::Leave(v4("224.3.3.3"))
            ])
        );
        let cut = with_igmp_checksum(report[..14].to_vec());
        assert_eq!(changes(4, &cut), Err(WireError::Truncated("IGMPv3")));
    }

    #[test]
    fn mld_reports_skip_neighbour_discovery_groups() {
        let group: Ipv6Addr = "ff0e::5".parse().unwrap();
        let solicited: Ipv6Addr = "ff02::1:ff00:2".parse().unwrap();
        let mut report = vec![143, 0, 0, 0, 0, 0, 0, 2];
        report.extend_from_slice(&[4, 0, 0, 0]);
        report.extend_from_slice(&group.octets());
        report.extend_from_slice(&[4, 0, 0, 0]);
        report.extend_from_slice(&solicited.octets());
        assert_eq!(
            changes(6, &report),
            Ok(vec![Change::Join(IpAddr::V6(group))])
        );
        let mut done = vec![132, 0, 0, 0, 0, 0, 0, 0];
        done.extend_from_slice(&group.octets());
        assert_eq!(
            changes(6, &done),
            Ok(vec![Change::Leave(IpAddr::V6(group))])
        );
    }

    #[test]
    fn queries_carry_valid_checksums_and_link_scope() {
        let query = Query {
            source: v4("169.254.1.1"),
            group: None,
            max_response_tenths: 100,
            interval_secs: 125,
        };
        let frame = query_frame(&query, [2, 0, 0, 0, 0, 1]);
        assert_eq!(&frame[0..6], &[0x01, 0x00, 0x5e, 0, 0, 1]);
        let ip = &frame[14..38];
        assert_eq!(Sum16BitWords::new().add_slice(ip).ones_complement(), 0);
        assert_eq!(ip[8], 1, "TTL 1");
        let igmp = &frame[38..];
        assert_eq!(igmp.len(), 12);
        assert_eq!(Sum16BitWords::new().add_slice(igmp).ones_complement(), 0);
        let leave = Query {
            source: "fe80::1".parse().unwrap(),
            group: Some("ff0e::5".parse().unwrap()),
            max_response_tenths: 10,
            interval_secs: 125,
        };
        let frame = query_frame(&leave, [2, 0, 0, 0, 0, 1]);
        assert_eq!(&frame[0..6], &[0x33, 0x33, 0, 0, 0, 5]);
        let headers = etherparse::SlicedPacket::from_ethernet(&frame).unwrap();
        let Some(etherparse::NetSlice::Ipv6(ip)) = headers.net else {
            panic!("no IPv6")
        };
        assert_eq!(ip.header().hop_limit(), 1);
        assert_eq!(
            ip.header().destination_addr(),
            "ff0e::5".parse::<Ipv6Addr>().unwrap()
        );
    }
}
