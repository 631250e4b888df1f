//! What decided a packet, for `dataplane inspect policy` and `dataplane trace`: the agent
//! writes what each installed policy set's rule indexes stand for (tier, kind, object,
//! direction, rule) to its run directory, and the lookups the kernel does are redone here
//! against the pinned maps, so another process can name the deciding policy and rule.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    path::{Path, PathBuf},
};

use aya::maps::{HashMap, MapData};
use dataplane_common::{
    acl::{
        ACL_ENDPOINT_EGRESS_PEERS, ACL_ENDPOINT_INGRESS_PEERS, ACL_ENTRY_PORTS, ACL_FAMILY_V4,
        ACL_FAMILY_V6, ACL_NO_LENGTH, ACL_PORT_BUCKET, ACL_PORT_EXACT, ACL_PORT_PROTOCOL,
        ACL_RULE_DEFAULT, ACL_RULE_EXEMPT, ACL_VERDICT_ALLOW, ACL_VERDICT_DENY, ACL_VERDICT_NONE,
        AclAddrKey, AclAddrValue, AclEndpoint, AclLengths, AclPortKey, AclVerdict, peer_key,
    },
    maps,
    overlay::Addr,
};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::{AclState, addr_key, pods::Direction};
use crate::{error::AgentError, kernel::pins::Pins, mapsync::addr16};

/// The directory in the agent's run directory: one file per installed set, `<set id>.json`,
/// so that a change writes the sets it changed and not every set's description (at 110
/// local pods whose sets have 300 peers each, writing them all took a label change 0.2 ms).
pub const RULES_DIR: &str = "acl-rules";

/// What one installed policy set's rule indexes stand for.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetRules {
    pub namespace: String,
    /// `ingress` or `egress`.
    pub direction: String,
    /// By rule index: who wrote the rule (see `RuleRef::describe`).
    pub rules: Vec<String>,
    /// The objects the rules come from, in evaluation order: `<tier>: <kind> <name>`.
    pub objects: Vec<String>,
}

/// The rule descriptions of every policy set in force, by set id.
pub fn set_rules(state: &AclState) -> BTreeMap<u32, SetRules> {
    state
        .policy_meta
        .iter()
        .map(|(&id, set)| (id, describe_set(set)))
        .collect()
}

/// `described` (what [`set_rules`] gave for an earlier state) brought to `state`, given the
/// sets whose description moved since (`changed`): only those are described again. At 110
/// local pods with a set each, describing every set at every change of one cost a sync about
/// 0.7 ms.
pub fn set_rules_since(
    state: &AclState,
    described: &mut BTreeMap<u32, SetRules>,
    changed: &std::collections::BTreeSet<u32>,
) {
    for id in changed {
        match state.policy_meta.get(id) {
            Some(set) => described.insert(*id, describe_set(set)),
            None => described.remove(id),
        };
    }
}

fn describe_set(set: &super::pod_rules::PolicySet) -> SetRules {
    SetRules {
        namespace: set.namespace.clone(),
        direction: match set.direction {
            Direction::Ingress => "ingress".into(),
            Direction::Egress => "egress".into(),
        },
        rules: set.refs.iter().map(|r| r.describe()).collect(),
        objects: objects(&set.refs),
    }
}

/// The distinct objects of `refs`, in order.
fn objects(refs: &[super::pod_rules::RuleRef]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for reference in refs {
        let object = format!(
            "{}: {} {}",
            reference.tier_name(),
            reference.kind.name(),
            reference.policy
        );
        if !out.contains(&object) {
            out.push(object);
        }
    }
    out
}

/// Writes the descriptions of the sets `changed` names (`None`: of every set, and removes the
/// files of sets not in `rules`, left by an earlier run). Each file is replaced atomically: a
/// reader sees a set's old description or its new one.
pub fn write(
    dir: &Path,
    rules: &BTreeMap<u32, SetRules>,
    changed: Option<&std::collections::BTreeSet<u32>>,
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let ids: Vec<u32> = match changed {
        Some(changed) => changed.iter().copied().collect(),
        None => {
            for entry in std::fs::read_dir(dir)? {
                let path = entry?.path();
                if set_of_file(&path).is_none_or(|id| !rules.contains_key(&id)) {
                    remove_if_there(&path)?;
                }
            }
            rules.keys().copied().collect()
        }
    };
    for id in ids {
        let path = dir.join(format!("{id}.json"));
        match rules.get(&id) {
            // Described again at every start: no need to wait for the disk.
            Some(set) => crate::kernel::state::write_json_replacing(&path, set, false)?,
            None => remove_if_there(&path)?,
        }
    }
    Ok(())
}

/// The set id a description file is named by (`None`: not a description).
fn set_of_file(path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_str()?;
    name.strip_suffix(".json")?.parse().ok()
}

fn remove_if_there(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The descriptions the agent last wrote under `run_dir` (empty without an agent; a file
/// that does not read, one being replaced, is left out).
pub fn read(run_dir: &Path) -> BTreeMap<u32, SetRules> {
    let dir: PathBuf = run_dir.join(RULES_DIR);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return BTreeMap::new();
    };
    entries
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            let id = set_of_file(&path)?;
            let text = std::fs::read(&path).ok()?;
            Some((id, serde_json::from_slice(&text).ok()?))
        })
        .collect()
}

/// A decision as the kernel takes it from one set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decided {
    pub set: u32,
    /// `ACL_VERDICT_*` (`NONE`: no rule matched).
    pub verdict: u8,
    pub rule: u32,
}

impl Decided {
    /// The decision in words, naming the rule from `rules`.
    pub fn describe(&self, rules: &BTreeMap<u32, SetRules>) -> String {
        let verdict = match self.verdict {
            ACL_VERDICT_ALLOW => "allow",
            ACL_VERDICT_DENY => "deny",
            _ => "deny",
        };
        let by = match self.rule {
            ACL_RULE_EXEMPT => "nothing matched: allowed by default".to_owned(),
            ACL_RULE_DEFAULT => "no rule allowed: NetworkPolicy isolation".to_owned(),
            rule => rules
                .get(&self.set)
                .and_then(|s| s.rules.get(rule as usize))
                .cloned()
                .unwrap_or_else(|| format!("rule {rule} of set {} (not described)", self.set)),
        };
        format!("{verdict} by {by}")
    }
}

/// The pinned maps a decision reads.
pub struct PolicyMaps {
    endpoints: HashMap<MapData, Addr, AclEndpoint>,
    addrs: HashMap<MapData, AclAddrKey, AclAddrValue>,
    ports: HashMap<MapData, AclPortKey, AclVerdict>,
    peers: HashMap<MapData, Addr, u32>,
}

fn open<K: aya::Pod, V: aya::Pod>(
    pins: &Pins,
    name: &'static str,
) -> Result<HashMap<MapData, K, V>, AgentError> {
    pins.open_hash(name, false)
}

impl PolicyMaps {
    pub fn open(pins: &Pins) -> Result<Self, AgentError> {
        Ok(Self {
            endpoints: open(pins, maps::ACL_ENDPOINTS)?,
            addrs: open(pins, maps::ACL_ADDRS)?,
            ports: open(pins, maps::ACL_PORTS)?,
            peers: open(pins, maps::ACL_PEERS)?,
        })
    }

    /// What the policy set of local pod `pod` for `direction` decides about traffic with
    /// `peer` (destination port `port`); `None` when no set judges that direction.
    pub fn decide(
        &self,
        pod: IpAddr,
        direction: Direction,
        peer: IpAddr,
        protocol: u8,
        port: u16,
    ) -> Option<Decided> {
        let endpoint = self.endpoints.get(&addr16(pod), 0).ok()?;
        let (set, lengths, peers) = match direction {
            Direction::Ingress => (
                endpoint.ingress,
                endpoint.ingress_lengths,
                ACL_ENDPOINT_INGRESS_PEERS,
            ),
            Direction::Egress => (
                endpoint.egress,
                endpoint.egress_lengths,
                ACL_ENDPOINT_EGRESS_PEERS,
            ),
        };
        if set == 0 {
            return None;
        }
        let decided = self.lookup(set, &lengths, peer, protocol, port);
        if decided.verdict != ACL_VERDICT_NONE || endpoint.flags & peers == 0 {
            return Some(decided);
        }
        Some(
            self.lookup_peer(set, peer, protocol, port)
                .unwrap_or(decided),
        )
    }

    /// The kernel's lookups: the set's prefix lengths longest first, then the port table.
    fn lookup(
        &self,
        set: u32,
        lengths: &AclLengths,
        peer: IpAddr,
        protocol: u8,
        port: u16,
    ) -> Decided {
        let (family, lengths) = match peer {
            IpAddr::V4(_) => (ACL_FAMILY_V4, &lengths.v4),
            IpAddr::V6(_) => (ACL_FAMILY_V6, &lengths.v6),
        };
        for &len in lengths.iter().take_while(|l| **l != ACL_NO_LENGTH) {
            let Ok(prefix) = IpNet::new(peer, len) else {
                continue;
            };
            let key = addr_key(set, prefix);
            debug_assert_eq!(key.family, family);
            if let Ok(value) = self.addrs.get(&key, 0) {
                return self.entry_decides(set, &value, protocol, port);
            }
        }
        Decided {
            set,
            verdict: ACL_VERDICT_NONE,
            rule: ACL_RULE_DEFAULT,
        }
    }

    /// The kernel's fallback where no prefix decided: the set's entry for the peer's
    /// identity, if the peer has one and the set an entry for it.
    fn lookup_peer(&self, set: u32, peer: IpAddr, protocol: u8, port: u16) -> Option<Decided> {
        let identity = self.peers.get(&addr16(peer), 0).ok()?;
        let value = self.addrs.get(&peer_key(set, identity), 0).ok()?;
        Some(self.entry_decides(set, &value, protocol, port))
    }

    /// What an address entry decides for the protocol and port: its own outcome, or its port
    /// table's (exact port, bucket, protocol, then the table's default in the entry).
    fn entry_decides(&self, set: u32, value: &AclAddrValue, protocol: u8, port: u16) -> Decided {
        let decided = |verdict, rule| Decided { set, verdict, rule };
        if value.kind != ACL_ENTRY_PORTS {
            return decided(value.verdict, value.rule);
        }
        let kinds = [
            (ACL_PORT_EXACT, port),
            (ACL_PORT_BUCKET, port & 0xFF00),
            (ACL_PORT_PROTOCOL, 0),
        ];
        for (kind, port) in kinds {
            if value.port_kinds & kind == 0 {
                continue;
            }
            let key = AclPortKey {
                table: value.table,
                protocol,
                kind,
                port,
            };
            if let Ok(found) = self.ports.get(&key, 0) {
                return decided(found.verdict, found.rule);
            }
        }
        decided(value.verdict, value.rule)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::acl::pod_rules::{PolicyKind, PolicySet, RuleRef};

    /// A change writes the files of the sets it names and no other; a whole write removes
    /// the files of sets gone since an earlier run; reading gives every set's description.
    #[test]
    fn each_set_is_described_in_a_file_of_its_own() {
        let run_dir = std::env::temp_dir().join(format!("explain-{}", std::process::id()));
        let dir = run_dir.join(RULES_DIR);
        let rules = |namespace: &str| SetRules {
            namespace: namespace.into(),
            direction: "ingress".into(),
            rules: vec![format!("policy {namespace}/p")],
            objects: Vec::new(),
        };
        let inode = |id: u32| {
            std::os::unix::fs::MetadataExt::ino(
                &std::fs::metadata(dir.join(format!("{id}.json"))).expect("file"),
            )
        };
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("9.json"), "{}").unwrap();
        let mut described: BTreeMap<u32, SetRules> =
            [(1, rules("a")), (2, rules("b"))].into_iter().collect();
        write(&dir, &described, None).unwrap();
        assert_eq!(read(&run_dir), described, "the earlier run's set 9 is gone");
        let kept = inode(1);

        described.insert(2, rules("c"));
        described.insert(3, rules("d"));
        write(&dir, &described, Some(&BTreeSet::from([2, 3]))).unwrap();
        assert_eq!(read(&run_dir), described);
        assert_eq!(inode(1), kept, "set 1 was not written again");

        described.remove(&2);
        write(&dir, &described, Some(&BTreeSet::from([2]))).unwrap();
        assert_eq!(read(&run_dir), described);
        let _ = std::fs::remove_dir_all(&run_dir);
    }

    fn set(namespace: &str, policies: &[&str]) -> PolicySet {
        PolicySet {
            namespace: namespace.into(),
            direction: Direction::Ingress,
            refs: std::sync::Arc::new(
                policies
                    .iter()
                    .map(|policy| RuleRef {
                        kind: PolicyKind::NetworkPolicy,
                        tier: None,
                        policy: format!("{namespace}/{policy}"),
                        direction: Direction::Ingress,
                        rule: 0,
                        name: String::new(),
                    })
                    .collect(),
            ),
            compiled: Default::default(),
            rules: Default::default(),
        }
    }

    #[test]
    fn describing_only_the_sets_that_moved_gives_what_describing_all_gives() {
        let mut state = AclState::default();
        state.policy_meta.insert(1, set("web", &["a"]));
        state.policy_meta.insert(2, set("web", &["b"]));
        state.policy_meta.insert(3, set("db", &["c"]));
        let mut described = set_rules(&state);
        // One set gone, one changed, one new, one as it was.
        state.policy_meta.remove(&1);
        state.policy_meta.insert(2, set("web", &["b", "d"]));
        state.policy_meta.insert(4, set("db", &["e"]));
        set_rules_since(&state, &mut described, &BTreeSet::from([1, 2, 4]));
        assert_eq!(described, set_rules(&state));
        assert_eq!(
            described[&2].rules,
            [
                "NetworkPolicy tier: NetworkPolicy web/b ingress[0]",
                "NetworkPolicy tier: NetworkPolicy web/d ingress[0]"
            ]
        );
    }
}
