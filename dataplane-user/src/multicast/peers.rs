//! The membership announcements agents send each other: which groups of which namespaces
//! have members on the sending node, so that a node with senders copies each packet once to
//! every node with members.
//!
//! One JSON datagram per part over UDP on the underlay (`--multicast-port`, 6083 by default),
//! sent when the node's groups change and again every refresh period (10 s); a receiver
//! forgets a node's groups three periods after its last complete announcement. Each
//! announcement is the node's whole list, split in parts of at most [`GROUPS_PER_PART`]
//! groups under one generation number; a receiver takes it once every part arrived. Only
//! datagrams from a cluster node's address, naming that node, are believed.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

/// The version of the format below.
pub const VERSION: u32 = 1;
/// Groups per datagram: about 60 bytes each in JSON, so a part stays well under 64 KiB.
pub const GROUPS_PER_PART: usize = 500;

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
}

/// The datagrams announcing `groups` under `generation`.
pub fn encode(node: &str, generation: u64, groups: &BTreeSet<Group>) -> Vec<Vec<u8>> {
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
            serde_json::to_vec(&Announcement {
                version: VERSION,
                node: node.to_owned(),
                generation,
                part: part as u32,
                parts,
                groups: groups.to_vec(),
            })
            .expect("an announcement serializes")
        })
        .collect()
}

/// Reads a datagram from `from`, checked against the cluster's nodes (address to name).
pub fn decode(
    bytes: &[u8],
    from: IpAddr,
    nodes: &BTreeMap<IpAddr, String>,
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
        if self
            .known
            .get(&node)
            .is_some_and(|known| known.generation > announcement.generation)
        {
            return false;
        }
        let assembly = self.assembling.entry(node.clone()).or_default();
        if announcement.generation < assembly.generation {
            return false;
        }
        if announcement.generation > assembly.generation {
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

    #[test]
    fn a_large_announcement_is_taken_once_every_part_arrived() {
        let groups: BTreeSet<Group> = (0..1200)
            .map(|i| group("team", &format!("239.1.{}.{}", i / 250, i % 250)))
            .collect();
        let datagrams = encode("node-b", 7, &groups);
        assert_eq!(datagrams.len(), 3);
        assert!(datagrams.iter().all(|d| d.len() < 65_000));
        let from = "10.99.0.2".parse().unwrap();
        let mut received = Received::default();
        let now = Instant::now();
        let hold = Duration::from_secs(30);
        for (i, datagram) in datagrams.iter().enumerate() {
            let announcement = decode(datagram, from, &nodes()).unwrap();
            let changed = received.take(announcement, now, hold);
            assert_eq!(changed, i == 2, "part {i}");
        }
        let (node, got) = received.nodes().next().unwrap();
        assert_eq!((node, got), ("node-b", &groups));
        // An older generation arriving late changes nothing.
        let old = encode("node-b", 6, &BTreeSet::new());
        assert!(!received.take(decode(&old[0], from, &nodes()).unwrap(), now, hold));
        // An empty newer one withdraws everything.
        let empty = encode("node-b", 8, &BTreeSet::new());
        assert!(received.take(decode(&empty[0], from, &nodes()).unwrap(), now, hold));
        assert_eq!(received.nodes().count(), 0);
    }

    #[test]
    fn announcements_are_believed_only_from_the_node_they_name() {
        let datagrams = encode("node-c", 1, &[group("team", "224.5.5.5")].into());
        let from: IpAddr = "10.99.0.2".parse().unwrap();
        assert!(matches!(
            decode(&datagrams[0], from, &nodes()),
            Err(PeerError::WrongNode { .. })
        ));
        let stranger: IpAddr = "10.99.0.9".parse().unwrap();
        assert!(matches!(
            decode(&datagrams[0], stranger, &nodes()),
            Err(PeerError::UnknownSender(_))
        ));
        assert!(matches!(
            decode(b"{", from, &nodes()),
            Err(PeerError::Parse(_))
        ));
    }

    #[test]
    fn a_silent_node_is_forgotten_after_the_hold_time() {
        let mut received = Received::default();
        let now = Instant::now();
        let hold = Duration::from_secs(30);
        let datagrams = encode("node-b", 1, &[group("team", "224.5.5.5")].into());
        let from = "10.99.0.2".parse().unwrap();
        received.take(decode(&datagrams[0], from, &nodes()).unwrap(), now, hold);
        let all: BTreeSet<&str> = ["node-b"].into();
        assert!(!received.expire(now + Duration::from_secs(29), &all));
        assert!(received.expire(now + Duration::from_secs(31), &all));
        assert_eq!(received.nodes().count(), 0);
    }
}
