//! Peer identities: the pods a NetworkPolicy peer can only pick together. A peer's selectors
//! look at a pod's namespace (its name and labels) and the pod's labels, nothing else, so
//! every pod of one namespace with the same labels is picked by the same peers. Such a group
//! is one identity: a policy set names it by one entry (`peer_key`), and `ACL_PEERS` maps
//! each of its pods' addresses to it. A local pod taking or leaving a policy whose peers are
//! 300 pods of one app then changes one entry of its set, not 300, and a pod added to the
//! group writes its address once, not once for every set that picks it.
//!
//! Identity numbers are this agent's own (the kernel maps are the node's) and stay with their
//! group for the agent's life, so that a set naming them keeps its entries.

use std::{
    cell::RefCell,
    cmp::Ordering,
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    sync::Arc,
};

use dataplane_common::overlay::Addr;

use super::{
    pod_rules::PolicySet,
    pods::{PolicyChanges, PolicyPods},
};
use crate::mapsync::addr16;

/// Identities no set names that are kept beyond as many as are named (see
/// [`PeerIdentities::named_by`]).
const UNNAMED_KEPT: usize = 1024;

/// Labels of a pod, as selectors see them.
type Labels = BTreeMap<String, String>;

/// The identities handed out, and the members of those asked for.
#[derive(Debug, Default)]
pub struct PeerIdentities {
    /// By namespace, then labels.
    ids: HashMap<String, HashMap<Labels, u32>>,
    /// What each identity stands for.
    groups: HashMap<u32, (String, Labels)>,
    last: u32,
    /// The addresses of each identity's pods, sorted, as last found: kept until a change of
    /// a pod of that namespace with those labels (before or after) may have moved them.
    members: HashMap<u32, Arc<[Addr]>>,
    /// The identities a set has named, not forgotten since.
    ever_named: BTreeSet<u32>,
}

impl PeerIdentities {
    /// The identity of the pods of `namespace` labelled `labels`, handed out when new.
    pub fn identity(&mut self, namespace: &str, labels: &Labels) -> u32 {
        if let Some(&id) = self.ids.get(namespace).and_then(|by| by.get(labels)) {
            return id;
        }
        self.last += 1;
        self.register(namespace, labels, self.last);
        self.last
    }

    /// Notes `id` as the identity of the pods of `namespace` labelled `labels`.
    fn register(&mut self, namespace: &str, labels: &Labels, id: u32) {
        self.ids
            .entry(namespace.to_owned())
            .or_default()
            .insert(labels.clone(), id);
        self.groups
            .insert(id, (namespace.to_owned(), labels.clone()));
    }

    /// Takes over the numbering a previous agent left in `ACL_PEERS` (`held`: address,
    /// identity), so that the sets it left in force keep meaning the same pods while this
    /// agent's first sync replaces them: an identity whose addresses are all pods of one
    /// namespace and labels (in `pods`) keeps its number for them. Others get new numbers,
    /// above every number held, which no set left in force names.
    pub fn adopt(&mut self, held: &[(Addr, u32)], pods: &PolicyPods) {
        let Some(highest) = held.iter().map(|(_, id)| *id).max() else {
            return;
        };
        self.last = self.last.max(highest);
        let mut by_address: HashMap<Addr, (&str, &Labels)> = HashMap::new();
        for (namespace, in_namespace) in pods.namespaces() {
            for pod in in_namespace.values() {
                for address in &pod.addresses {
                    by_address.insert(addr16(*address), (namespace, &pod.labels));
                }
            }
        }
        let mut groups: BTreeMap<u32, Option<(&str, &Labels)>> = BTreeMap::new();
        for (address, id) in held {
            let found = by_address.get(address).copied();
            groups
                .entry(*id)
                .and_modify(|group| {
                    if *group != found {
                        *group = None;
                    }
                })
                .or_insert(found);
        }
        for (id, group) in groups {
            let Some((namespace, labels)) = group else {
                continue;
            };
            let taken = self
                .ids
                .get(namespace)
                .is_some_and(|by| by.contains_key(labels));
            if !taken && !self.groups.contains_key(&id) {
                self.register(namespace, labels, id);
            }
        }
    }

    /// Forgets the members of the identities `changes` may have moved pods into or out of.
    pub fn follow(&mut self, changes: &PolicyChanges) {
        if changes.everything {
            self.members.clear();
            return;
        }
        for (namespace, pods) in &changes.pods {
            let Some(by_labels) = self.ids.get(namespace) else {
                continue;
            };
            for labels in pods.iter().flat_map(|pod| &pod.labels) {
                if let Some(id) = by_labels.get(labels) {
                    self.members.remove(id);
                }
            }
        }
    }

    /// The members of every identity the sets name, and of those sets named before: a set
    /// naming one again (a pod relabelled back, a policy restored) then writes one entry,
    /// not one address per peer. Identities partition the pods, so `ACL_PEERS` never holds
    /// more than the cluster's pod addresses. Identities no set names are forgotten once
    /// they outnumber those named (pods labelled one by one, a Deployment's rollouts: each
    /// new group is an identity); their numbers are not handed out again.
    pub fn named_by(
        &mut self,
        sets: &BTreeMap<String, PolicySet>,
        pods: &PolicyPods,
    ) -> BTreeMap<u32, Arc<[Addr]>> {
        let named: BTreeSet<u32> = sets
            .values()
            .flat_map(|set| set.compiled.peers.keys().copied())
            .collect();
        if self.groups.len() > 2 * named.len() + UNNAMED_KEPT {
            self.keep_only(|id| named.contains(&id));
        }
        self.ever_named.extend(&named);
        let ever_named: Vec<u32> = self.ever_named.iter().copied().collect();
        ever_named
            .into_iter()
            .map(|id| (id, self.members(id, pods)))
            .collect()
    }

    /// Forgets the identities `kept` refuses.
    fn keep_only(&mut self, kept: impl Fn(u32) -> bool) {
        self.groups.retain(|id, _| kept(*id));
        self.members.retain(|id, _| kept(*id));
        self.ever_named.retain(|id| kept(*id));
        for by_labels in self.ids.values_mut() {
            by_labels.retain(|_, id| kept(*id));
        }
        self.ids.retain(|_, by_labels| !by_labels.is_empty());
    }

    /// The addresses of identity `id`'s pods, sorted.
    fn members(&mut self, id: u32, pods: &PolicyPods) -> Arc<[Addr]> {
        if let Some(members) = self.members.get(&id) {
            return Arc::clone(members);
        }
        let mut addresses: Vec<Addr> = match self.groups.get(&id) {
            Some((namespace, labels)) => pods
                .with_labels(namespace, labels)
                .flat_map(|pod| pod.addresses.iter().map(|a| addr16(*a)))
                .collect(),
            None => Vec::new(),
        };
        addresses.sort_unstable();
        addresses.dedup();
        let members: Arc<[Addr]> = addresses.into();
        self.members.insert(id, Arc::clone(&members));
        members
    }
}

/// The registry a compile hands identities out of, when it names peers by identity.
pub type Registry = RefCell<PeerIdentities>;

/// What `ACL_PEERS` needs to go from the identities' addresses as written to those wanted.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PeerMoves {
    /// Addresses new to their identity (sorted by identity, then address).
    pub write: Vec<(Addr, u32)>,
    /// Addresses no identity wanted has any more (sorted).
    pub remove: Vec<Addr>,
}

/// The moves from `written` to `wanted` (each identity's sorted addresses), `left` being
/// addresses a previous agent wrote that no record here names. Only identities whose
/// addresses differ are walked, side by side (an unchanged one is the same `Arc`): a pod
/// added to a group of 300 peers was a set of every address of the group hashed at each
/// sync. An address that left one identity is kept where a changed identity has it (it
/// moved: its entry was written over).
pub fn moves(
    written: &BTreeMap<u32, Arc<[Addr]>>,
    wanted: &BTreeMap<u32, Arc<[Addr]>>,
    left: &[Addr],
) -> PeerMoves {
    let mut moves = PeerMoves::default();
    let mut left_behind: Vec<Addr> = Vec::new();
    let mut claimants: Vec<&[Addr]> = Vec::new();
    for (identity, before, after) in changed_identities(written, wanted) {
        walk_sorted(
            before,
            after,
            |gone| left_behind.push(gone),
            |new| moves.write.push((new, identity)),
        );
        if !after.is_empty() {
            claimants.push(after);
        }
    }
    let mut gone = unclaimed(left_behind, &claimants);
    if !left.is_empty() {
        let named: HashSet<&Addr> = wanted.values().flat_map(|m| m.iter()).collect();
        gone.extend(left.iter().filter(|addr| !named.contains(addr)));
    }
    gone.sort_unstable();
    gone.dedup();
    moves.remove = gone;
    moves
}

/// An identity and its addresses as written and as wanted (empty: none).
type ChangedIdentity<'a> = (u32, &'a [Addr], &'a [Addr]);

/// Each identity whose addresses differ between `written` and `wanted`, by identity.
fn changed_identities<'a>(
    written: &'a BTreeMap<u32, Arc<[Addr]>>,
    wanted: &'a BTreeMap<u32, Arc<[Addr]>>,
) -> Vec<ChangedIdentity<'a>> {
    let addresses = |group: Option<&'a Arc<[Addr]>>| group.map_or(&[][..], |g| &**g);
    // `Arc` equality looks at the pointers first: an unchanged group is not compared.
    let mut changed: Vec<ChangedIdentity<'a>> = written
        .iter()
        .filter(|(identity, old)| wanted.get(*identity) != Some(*old))
        .map(|(identity, old)| (*identity, &**old, addresses(wanted.get(identity))))
        .chain(
            wanted
                .iter()
                .filter(|(identity, _)| !written.contains_key(*identity))
                .map(|(identity, new)| (*identity, &[][..], &**new)),
        )
        .collect();
    changed.sort_unstable_by_key(|(identity, _, _)| *identity);
    changed
}

/// Calls `gone` for each address only in `before` and `new` for each only in `after`, both
/// sorted.
fn walk_sorted(
    before: &[Addr],
    after: &[Addr],
    mut gone: impl FnMut(Addr),
    mut new: impl FnMut(Addr),
) {
    let (mut b, mut a) = (0, 0);
    while b < before.len() || a < after.len() {
        let order = match (before.get(b), after.get(a)) {
            (Some(x), Some(y)) => x.cmp(y),
            (Some(_), None) => Ordering::Less,
            _ => Ordering::Greater,
        };
        match order {
            Ordering::Less => {
                gone(before[b]);
                b += 1;
            }
            Ordering::Greater => {
                new(after[a]);
                a += 1;
            }
            Ordering::Equal => {
                b += 1;
                a += 1;
            }
        }
    }
}

/// `candidates` that none of `claimants` (sorted address lists) has. Few candidates (a pod
/// relabelled or gone) are looked up in each claimant; many (a namespace relabelled, whose
/// groups all changed) in one set of every claimant's addresses.
fn unclaimed(mut candidates: Vec<Addr>, claimants: &[&[Addr]]) -> Vec<Addr> {
    if candidates.is_empty() {
        return candidates;
    }
    if candidates.len().saturating_mul(claimants.len()) <= 4096 {
        candidates.retain(|addr| !claimants.iter().any(|c| c.binary_search(addr).is_ok()));
    } else {
        let claimed: HashSet<&Addr> = claimants.iter().flat_map(|c| c.iter()).collect();
        candidates.retain(|addr| !claimed.contains(addr));
    }
    candidates
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;
    use crate::acl::pods::PolicyPod;

    fn pod(namespace: &str, name: &str, app: &str, ip: [u8; 4]) -> PolicyPod {
        PolicyPod {
            namespace: namespace.into(),
            name: name.into(),
            labels: [("app".to_owned(), app.to_owned())].into(),
            addresses: vec![IpAddr::from(ip)],
            named_ports: BTreeMap::new(),
        }
    }

    fn labels(app: &str) -> Labels {
        [("app".to_owned(), app.to_owned())].into()
    }

    /// One identity per namespace and labels, the same each time asked; its members are the
    /// pods labelled exactly so (not those with more labels), kept until a change of one of
    /// their namespace with those labels, before or after, says they may have moved.
    #[test]
    fn an_identity_is_a_namespace_and_labels_and_its_members_follow_pod_changes() {
        let mut registry = PeerIdentities::default();
        let web = registry.identity("x", &labels("web"));
        assert_eq!(registry.identity("x", &labels("web")), web);
        let other = registry.identity("y", &labels("web"));
        assert_ne!(other, web);
        assert_ne!(registry.identity("x", &labels("db")), web);

        let mut more = pod("x", "w3", "web", [10, 0, 0, 3]);
        more.labels.insert("tier".into(), "front".into());
        let before: PolicyPods = [
            pod("x", "w2", "web", [10, 0, 0, 2]),
            pod("x", "w1", "web", [10, 0, 0, 1]),
            more,
            pod("y", "w4", "web", [10, 0, 0, 4]),
        ]
        .into_iter()
        .collect();
        let addr = |last: u8| addr16(IpAddr::from([10, 0, 0, last]));
        assert_eq!(&*registry.members(web, &before), &[addr(1), addr(2)]);
        assert_eq!(&*registry.members(other, &before), &[addr(4)]);

        // w1 relabelled: without a change noted, the members stay as found.
        let mut after = before.clone();
        after.insert(pod("x", "w1", "db", [10, 0, 0, 1]));
        assert_eq!(&*registry.members(web, &after), &[addr(1), addr(2)]);
        let mut changes = PolicyChanges::default();
        changes.note_pod("x", "w1");
        changes.label(&before, &after);
        registry.follow(&changes);
        assert_eq!(&*registry.members(web, &after), &[addr(2)]);
        assert_eq!(&*registry.members(other, &after), &[addr(4)]);
        let db = registry.identity("x", &labels("db"));
        assert_eq!(&*registry.members(db, &after), &[addr(1)]);
    }

    /// Identities no set names are forgotten once they outnumber the named ones by
    /// `UNNAMED_KEPT`, and their numbers are not handed out again.
    #[test]
    fn identities_no_set_names_are_forgotten_when_they_pile_up() {
        let mut registry = PeerIdentities::default();
        let pods = PolicyPods::default();
        let first = registry.identity("x", &labels("web"));
        for n in 1..UNNAMED_KEPT {
            registry.identity("x", &labels(&format!("app-{n}")));
        }
        registry.named_by(&BTreeMap::new(), &pods);
        assert_eq!(registry.groups.len(), UNNAMED_KEPT, "not yet");
        registry.identity("x", &labels("one-more"));
        registry.named_by(&BTreeMap::new(), &pods);
        assert!(registry.groups.is_empty() && registry.ids.is_empty());
        let again = registry.identity("x", &labels("web"));
        assert!(again > first + UNNAMED_KEPT as u32, "{again}");
    }

    /// A restarted agent keeps the numbers a previous one left for groups whose addresses all
    /// still are that group's pods; a number whose addresses are now pods of two groups is
    /// not kept (its old sets would let the other group's pods in), and new numbers start
    /// above every number left.
    #[test]
    fn a_restarted_agent_keeps_the_numbers_left_for_the_same_pods() {
        let pods: PolicyPods = [
            pod("x", "w1", "web", [10, 0, 0, 1]),
            pod("x", "w2", "web", [10, 0, 0, 2]),
            pod("x", "d1", "db", [10, 0, 0, 3]),
            pod("y", "w4", "web", [10, 0, 0, 4]),
        ]
        .into_iter()
        .collect();
        let addr = |last: u8| addr16(IpAddr::from([10, 0, 0, last]));
        // 7: x's web pods; 9: x's db pod and y's web pod (relabelled meanwhile).
        let held = [(addr(1), 7), (addr(2), 7), (addr(3), 9), (addr(4), 9)];
        let mut registry = PeerIdentities::default();
        registry.adopt(&held, &pods);
        assert_eq!(registry.identity("x", &labels("web")), 7);
        let db = registry.identity("x", &labels("db"));
        let web = registry.identity("y", &labels("web"));
        assert!(db > 9 && web > 9 && db != web, "{db} {web}");
    }

    fn group(lasts: &[u8]) -> Arc<[Addr]> {
        let mut addresses: Vec<Addr> = lasts
            .iter()
            .map(|last| addr16(IpAddr::from([10, 0, 0, *last])))
            .collect();
        addresses.sort_unstable();
        addresses.into()
    }

    fn addrs(lasts: &[u8]) -> Vec<Addr> {
        group(lasts).to_vec()
    }

    /// An unchanged group (the same `Arc`) moves nothing; a pod joining one writes its
    /// address alone; one moving between two changed groups is written for its new group
    /// and not removed; a group no set names any more takes its addresses with it, but not
    /// one another group has now; what a previous agent left goes where no group has it.
    #[test]
    fn peer_moves_write_what_joined_and_remove_what_no_group_has() {
        let (web, db, cache) = (group(&[1, 2, 3]), group(&[4, 5]), group(&[6, 7]));
        let written: BTreeMap<u32, Arc<[Addr]>> = [
            (1, Arc::clone(&web)),
            (2, Arc::clone(&db)),
            (3, Arc::clone(&cache)),
        ]
        .into();
        assert_eq!(moves(&written, &written.clone(), &[]), PeerMoves::default());

        let wanted = [
            (1, group(&[1, 2, 3, 9])),
            (2, db.clone()),
            (3, cache.clone()),
        ]
        .into();
        let expected = PeerMoves {
            write: vec![(addrs(&[9])[0], 1)],
            remove: Vec::new(),
        };
        assert_eq!(moves(&written, &wanted, &[]), expected);

        // 3 moves from web to db; cache is no set's any more, but 7 joined web.
        let wanted = [(1, group(&[1, 2, 7])), (2, group(&[3, 4, 5]))].into();
        let expected = PeerMoves {
            write: vec![(addrs(&[7])[0], 1), (addrs(&[3])[0], 2)],
            remove: addrs(&[6]),
        };
        assert_eq!(moves(&written, &wanted, &[]), expected);

        // A restart: 8 and 9 were left by the previous agent, 9 is a web pod now.
        let wanted: BTreeMap<u32, Arc<[Addr]>> = [(1, group(&[1, 2, 3, 9]))].into();
        let moved = moves(&BTreeMap::new(), &wanted, &addrs(&[8, 9]));
        assert_eq!(moved.remove, addrs(&[8]));
        assert_eq!(moved.write.len(), 4);
    }

    /// Many addresses leaving at once (a namespace relabelled) are checked against one set
    /// of the claimants' addresses, few each against every claimant: the same answer.
    #[test]
    fn unclaimed_addresses_are_the_same_whichever_way_they_are_looked_up() {
        let claimant_a: Vec<Addr> = (0..3000u32)
            .map(|i| addr16(IpAddr::from((i * 2).to_be_bytes())))
            .collect();
        let claimant_b: Vec<Addr> = (0..3000u32)
            .map(|i| addr16(IpAddr::from((i * 3).to_be_bytes())))
            .collect();
        let (mut a, mut b) = (claimant_a.clone(), claimant_b.clone());
        a.sort_unstable();
        b.sort_unstable();
        let claimants: [&[Addr]; 2] = [&a, &b];
        let candidates: Vec<Addr> = (0..6000u32)
            .map(|i| addr16(IpAddr::from(i.to_be_bytes())))
            .collect();
        let many = unclaimed(candidates.clone(), &claimants);
        let few: Vec<Addr> = candidates
            .chunks(100)
            .flat_map(|chunk| unclaimed(chunk.to_vec(), &claimants))
            .collect();
        assert_eq!(many, few);
        // Neither a multiple of 2 below 6000 nor of 3 below 9000.
        let expected: Vec<Addr> = (0..6000u32)
            .filter(|i| i % 2 != 0 && i % 3 != 0)
            .map(|i| addr16(IpAddr::from(i.to_be_bytes())))
            .collect();
        assert_eq!(many, expected);
    }
}
