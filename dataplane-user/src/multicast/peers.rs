//! The membership announcements agents send each other: which groups of which namespaces
//! have members on the sending node, so that a node with senders copies each packet once to
//! every node with members.
//!
//! One JSON datagram per part over UDP on the underlay (`--multicast-port`, 6083 by default),
//! sent when the node's groups change and again every refresh period (10 s); a receiver
//! forgets a node's groups three periods after its last complete announcement. Each
//! announcement is the node's whole list, split in parts of at most [`GROUPS_PER_PART`]
//! groups under one generation number; a receiver takes it once every part arrived. Only
//! datagrams from a cluster node's address, naming that node, are believed; with the
//! cluster's key (the egress IP probes' Secret, which every agent holds) only signed ones.
//! What one node can make another hold is bounded: [`MAX_PARTS`] parts of
//! [`GROUPS_PER_PART`] groups, assembled one generation at a time; and a generation from far
//! ahead stops a node's later announcements only while it is fresh (a node's groups expire
//! unless announced again, and an expired node's next generation is taken whatever it is).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use crate::egressip::probe::ProbeKey;

/// The version of the format below.
pub const VERSION: u32 = 1;
/// Groups per datagram: about 60 bytes each in JSON, so a part stays well under 64 KiB.
pub const GROUPS_PER_PART: usize = 500;

/// The most parts one announcement may have: a node holds at most `MAX_GROUPS` groups
/// (2,048), five parts; room to spare, and no more.
pub const MAX_PARTS: u32 = 8;

/// A namespace and one of its groups.
pub type Group = (String, IpAddr);

/// One datagram.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Announcement {
    pub version: u32,
    /// The sending node's name.
    pub node: String,
    /// Grows with every announcement of the node (its clock at sending, in nanoseconds).
    pub generation: u64,
    pub part: u32,
    pub parts: u32,
    pub groups: Vec<Group>,
    /// HMAC-SHA256 of the rest with the cluster's key (empty without one).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
}

impl Announcement {
    fn signed_text(&self) -> String {
        let groups: Vec<String> = self
            .groups
            .iter()
            .map(|(namespace, group)| format!("{namespace}={group}"))
            .collect();
        format!(
            "multicast\n{}\n{}\n{}\n{}\n{}\n{}",
            self.version,
            self.node,
            self.generation,
            self.part,
            self.parts,
            groups.join(",")
        )
    }
}

/// Why a datagram was refused.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("multicast announcement does not parse: {0}")]
    Parse(#[from] serde_json::Error),
    #[error("multicast announcement of version {0}: this agent speaks {VERSION}")]
    Version(u32),
    #[error("multicast announcement part {part} of {parts}")]
    Part { part: u32, parts: u32 },
    #[error("multicast announcement naming node {named} from {from}, which is {actual}")]
    WrongNode {
        named: String,
        from: IpAddr,
        actual: String,
    },
    #[error("multicast announcement from {0}, which is no cluster node")]
    UnknownSender(IpAddr),
    #[error("multicast announcement of node {0} not signed with the cluster's key")]
    Unsigned(String),
    #[error(
        "multicast announcement of {groups} groups in part {part} of {parts}: more than an announcement may hold"
    )]
    TooLarge {
        part: u32,
        parts: u32,
        groups: usize,
    },
}

/// The datagrams announcing `groups` under `generation`, signed with `key` when there is one.
pub fn encode(
    node: &str,
    generation: u64,
    groups: &BTreeSet<Group>,
    key: Option<&ProbeKey>,
) -> Vec<Vec<u8>> {
    let groups: Vec<Group> = groups.iter().cloned().collect();
    let chunks: Vec<&[Group]> = if groups.is_empty() {
        vec![&[]]
    } else {
        groups.chunks(GROUPS_PER_PART).collect()
    };
    let parts = chunks.len() as u32;
    chunks
        .into_iter()
        .enumerate()
        .map(|(part, groups)| {
            let mut announcement = Announcement {
                version: VERSION,
                node: node.to_owned(),
                generation,
                part: part as u32,
                parts,
                groups: groups.to_vec(),
                mac: String::new(),
            };
            if let Some(key) = key {
                announcement.mac = key.sign(&announcement.signed_text());
            }
            serde_json::to_vec(&announcement).expect("an announcement serializes")
        })
        .collect()
}

/// Reads a datagram from `from`, checked against the cluster's nodes (address to name) and,
/// with the cluster's `key`, its signature.
pub fn decode(
    bytes: &[u8],
    from: IpAddr,
    nodes: &BTreeMap<IpAddr, String>,
    key: Option<&ProbeKey>,
) -> Result<Announcement, PeerError> {
    let actual = nodes.get(&from).ok_or(PeerError::UnknownSender(from))?;
    let announcement: Announcement = serde_json::from_slice(bytes)?;
    if announcement.version != VERSION {
        return Err(PeerError::Version(announcement.version));
    }
    if announcement.parts == 0 || announcement.part >= announcement.parts {
        return Err(PeerError::Part {
            part: announcement.part,
            parts: announcement.parts,
        });
    }
    if announcement.parts > MAX_PARTS || announcement.groups.len() > GROUPS_PER_PART {
        return Err(PeerError::TooLarge {
            part: announcement.part,
            parts: announcement.parts,
            groups: announcement.groups.len(),
        });
    }
    if let Some(key) = key
        && key
            .verify(&announcement.signed_text(), &announcement.mac)
            .is_err()
    {
        return Err(PeerError::Unsigned(announcement.node));
    }
    if &announcement.node != actual {
        return Err(PeerError::WrongNode {
            named: announcement.node,
            from,
            actual: actual.clone(),
        });
    }
    Ok(announcement)
}

/// An announcement being put together.
#[derive(Debug, Default)]
struct Assembly {
    generation: u64,
    parts: u32,
    received: BTreeMap<u32, Vec<Group>>,
}

/// What a node last announced completely.
#[derive(Debug)]
struct Known {
    generation: u64,
    groups: BTreeSet<Group>,
    expires: Instant,
}

/// The other nodes' groups, as announced.
#[derive(Debug, Default)]
pub struct Received {
    assembling: BTreeMap<String, Assembly>,
    known: BTreeMap<String, Known>,
}

impl Received {
    /// Takes one datagram; whether a node's groups changed.
    pub fn take(&mut self, announcement: Announcement, now: Instant, hold: Duration) -> bool {
        let node = announcement.node.clone();
        // An older generation than the node's last is a late datagram, unless what the node
        // last announced has expired: then whatever came before does not count (a forged
        // generation from far ahead silences a node no longer than it would stay fresh).
        if self
            .known
            .get(&node)
            .is_some_and(|known| known.expires > now && known.generation > announcement.generation)
        {
            return false;
        }
        let assembly = self.assembling.entry(node.clone()).or_default();
        let stale = self
            .known
            .get(&node)
            .is_none_or(|known| known.expires <= now);
        if announcement.generation < assembly.generation && !stale {
            return false;
        }
        if announcement.generation != assembly.generation {
            *assembly = Assembly {
                generation: announcement.generation,
                parts: announcement.parts,
                received: BTreeMap::new(),
            };
        }
        assembly
            .received
            .insert(announcement.part, announcement.groups);
        if assembly.received.len() as u32 != assembly.parts {
            return false;
        }
        let assembly = self.assembling.remove(&node).expect("just assembled");
        let groups: BTreeSet<Group> = assembly.received.into_values().flatten().collect();
        let changed = self.known.get(&node).is_none_or(|k| k.groups != groups);
        self.known.insert(
            node,
            Known {
                generation: assembly.generation,
                groups,
                expires: now + hold,
            },
        );
        changed
    }

    /// Takes `groups` as `node`'s, until `expires` or its first announcement (a restarted
    /// agent's view of what the previous one had learnt).
    pub fn adopt(&mut self, node: &str, groups: BTreeSet<Group>, expires: Instant) {
        self.known.entry(node.to_owned()).or_insert(Known {
            generation: 0,
            groups,
            expires,
        });
    }

    /// Forgets nodes not heard from in time, and nodes no longer in the cluster; whether any
    /// groups went.
    pub fn expire(&mut self, now: Instant, nodes: &BTreeSet<&str>) -> bool {
        let before = self.known.len();
        self.known
            .retain(|node, known| known.expires > now && nodes.contains(node.as_str()));
        self.assembling
            .retain(|node, _| nodes.contains(node.as_str()));
        self.known.len() != before
    }

    /// When the next node's groups expire.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.known.values().map(|k| k.expires).min()
    }

    /// Every node with members, and its groups.
    pub fn nodes(&self) -> impl Iterator<Item = (&str, &BTreeSet<Group>)> {
        self.known
            .iter()
            .filter(|(_, known)| !known.groups.is_empty())
            .map(|(node, known)| (node.as_str(), &known.groups))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(ns: &str, addr: &str) -> Group {
        (ns.to_owned(), addr.parse().unwrap())
    }

    fn nodes() -> BTreeMap<IpAddr, String> {
        [("10.99.0.2".parse().unwrap(), "node-b".to_owned())].into()
    }

    /// The forgeries of the issue: a generation at its largest would have silenced the node
    /// for good, a count of parts without end grown memory; with the key, nothing unsigned
    /// is believed at all.
    #[test]
    fn forged_generations_are_bounded_parts_refused_and_keys_checked() {
        let from: IpAddr = "10.99.0.2".parse().unwrap();
        let now = Instant::now();
        let hold = Duration::from_secs(30);
        let mut received = Received::default();
        let forged = Announcement {
            version: VERSION,
            node: "node-b".into(),
            generation: u64::MAX,
            part: 0,
            parts: 1,
            groups: Vec::new(),
            mac: String::new(),
        };
        received.take(forged, now, hold);
        // While the forgery is fresh the real generations are older: refused...
        let real = encode("node-b", 5, &[group("team", "224.5.5.5")].into(), None);
        let taken = decode(&real[0], from, &nodes(), None).unwrap();
        assert!(!received.take(taken.clone(), now, hold));
        // ...once it has expired, taken.
        assert!(received.take(taken, now + hold + Duration::from_secs(1), hold));
        // Parts past the bound, and too many groups in a part.
        let mut many = real.clone();
        let mut text: serde_json::Value = serde_json::from_slice(&many[0]).unwrap();
        text["parts"] = serde_json::json!(1_000_000);
        many[0] = serde_json::to_vec(&text).unwrap();
        assert!(matches!(
            decode(&many[0], from, &nodes(), None),
            Err(PeerError::TooLarge { .. })
        ));
        // With the key: an unsigned or otherwise signed announcement is refused.
        let key = ProbeKey::from_bytes(b"0123456789abcdef0123456789abcdef").unwrap();
        let other = ProbeKey::from_bytes(b"another key of enough length!!").unwrap();
        assert!(matches!(
            decode(&real[0], from, &nodes(), Some(&key)),
            Err(PeerError::Unsigned(_))
        ));
        let signed = encode(
            "node-b",
            6,
            &[group("team", "224.5.5.5")].into(),
            Some(&key),
        );
        assert!(decode(&signed[0], from, &nodes(), Some(&key)).is_ok());
        assert!(decode(&signed[0], from, &nodes(), Some(&other)).is_err());
        let mut tampered: serde_json::Value = serde_json::from_slice(&signed[0]).unwrap();
        tampered["generation"] = serde_json::json!(u64::MAX);
        let tampered = serde_json::to_vec(&tampered).unwrap();
        assert!(decode(&tampered, from, &nodes(), Some(&key)).is_err());
    }

    #[test]
    fn a_large_announcement_is_taken_once_every_part_arrived() {
        let groups: BTreeSet<Group> = (0..1200)
            .map(|i| group("team", &format!("239.1.{}.{}", i / 250, i % 250)))
            .collect();
        let datagrams = encode("node-b", 7, &groups, None);
        assert_eq!(datagrams.len(), 3);
        assert!(datagrams.iter().all(|d| d.len() < 65_000));
        let from = "10.99.0.2".parse().unwrap();
        let mut received = Received::default();
        let now = Instant::now();
        let hold = Duration::from_secs(30);
        for (i, datagram) in datagrams.iter().enumerate() {
            let announcement = decode(datagram, from, &nodes(), None).unwrap();
            let changed = received.take(announcement, now, hold);
            assert_eq!(changed, i == 2, "part {i}");
        }
        let (node, got) = received.nodes().next().unwrap();
        assert_eq!((node, got), ("node-b", &groups));
        // An older generation arriving late changes nothing.
        let old = encode("node-b", 6, &BTreeSet::new(), None);
        assert!(!received.take(decode(&old[0], from, &nodes(), None).unwrap(), now, hold));
        // An empty newer one withdraws everything.
        let empty = encode("node-b", 8, &BTreeSet::new(), None);
        assert!(received.take(decode(&empty[0], from, &nodes(), None).unwrap(), now, hold));
        assert_eq!(received.nodes().count(), 0);
    }

    #[test]
    fn announcements_are_believed_only_from_the_node_they_name() {
        let datagrams = encode("node-c", 1, &[group("team", "224.5.5.5")].into(), None);
        let from: IpAddr = "10.99.0.2".parse().unwrap();
        assert!(matches!(
            decode(&datagrams[0], from, &nodes(), None),
            Err(PeerError::WrongNode { .. })
        ));
        let stranger: IpAddr = "10.99.0.9".parse().unwrap();
        assert!(matches!(
            decode(&datagrams[0], stranger, &nodes(), None),
            Err(PeerError::UnknownSender(_))
        ));
        assert!(matches!(
            decode(b"{", from, &nodes(), None),
            Err(PeerError::Parse(_))
        ));
    }

    #[test]
    fn a_silent_node_is_forgotten_after_the_hold_time() {
        let mut received = Received::default();
        let now = Instant::now();
        let hold = Duration::from_secs(30);
        let datagrams = encode("node-b", 1, &[group("team", "224.5.5.5")].into(), None);
        let from = "10.99.0.2".parse().unwrap();
        received.take(
            decode(&datagrams[0], from, &nodes(), None).unwrap(),
            now,
            hold,
        );
        let all: BTreeSet<&str> = ["node-b"].into();
        assert!(!received.expire(now + Duration::from_secs(29), &all));
        assert!(received.expire(now + Duration::from_secs(31), &all));
        assert_eq!(received.nodes().count(), 0);
    }
}
