//! Writing wanted map contents into the kernel's maps: the difference between what a compile
//! wants and what a map holds (or what this agent last wrote there), written as inserts and
//! deletes, and the 16-byte address form the maps key on. Every feature's sync uses these;
//! none of them knows a feature. Their errors come from `kernel::capacity::map_err`, the one
//! place a map error is made.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv6Addr},
};

use aya::maps::{HashMap, LpmTrie, MapData, lpm_trie::Key};
use dataplane_common::overlay::{Addr, ipv4_mapped};

/// Map writes made by one sync.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncStats {
    pub written: usize,
    pub deleted: usize,
}

impl SyncStats {
    pub fn add(&mut self, other: SyncStats) {
        self.written += other.written;
        self.deleted += other.deleted;
    }
}

/// The address a 16-byte form stands for (IPv4-mapped read as IPv4).
pub fn ip_of(addr: &Addr) -> IpAddr {
    let v6 = Ipv6Addr::from(*addr);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

/// The 16-byte form of an address (IPv4-mapped for IPv4); [`ip_of`] is its inverse.
pub fn addr16(ip: IpAddr) -> Addr {
    match ip {
        IpAddr::V4(v4) => ipv4_mapped(v4.octets()),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// Makes a hash map keyed by address hold exactly `desired`: new and changed entries first,
/// then stale ones removed. Returns what was written and deleted.
pub fn sync_hash<K: aya::Pod + Ord, V: aya::Pod + PartialEq>(
    map: &mut HashMap<&mut MapData, K, V>,
    desired: &impl SortedMap<K, V>,
) -> Result<SyncStats, aya::maps::MapError> {
    let mut stats = SyncStats::default();
    for (key, value) in desired.entries() {
        if map.get(key, 0).ok().as_ref() != Some(value) {
            map.insert(key, value, 0)?;
            stats.written += 1;
        }
    }
    let stale: Vec<K> = map
        .keys()
        .filter_map(Result::ok)
        .filter(|k| !desired.holds(k))
        .collect();
    for key in stale {
        map.remove(&key)?;
        stats.deleted += 1;
    }
    Ok(stats)
}

/// As [`sync_hash`], against what this agent last wrote there (`last`, when it knows) rather
/// than what the kernel holds: a change costs the system calls of its own entries, not one per
/// entry of the map (at 5,000 nodes, reading every node back took a sync 40 ms).
pub fn sync_hash_since<K: aya::Pod + Ord, V: aya::Pod + PartialEq, M: SortedMap<K, V>>(
    map: &mut HashMap<&mut MapData, K, V>,
    desired: &M,
    last: Option<&M>,
) -> Result<SyncStats, aya::maps::MapError> {
    let Some(last) = last else {
        return sync_hash(map, desired);
    };
    let mut stats = SyncStats::default();
    let (changed, gone) = desired.changes_since(last);
    for (key, value) in changed {
        map.insert(key, value, 0)?;
        stats.written += 1;
    }
    for key in gone {
        map.remove(key)?;
        stats.deleted += 1;
    }
    Ok(stats)
}

/// What differs between two sorted maps: the entries of `desired` that `last` lacks or holds
/// otherwise, and the keys only `last` has. One walk down both side by side, no lookups: a
/// node added among 5,000 compared each entry by searching for it, a tenth of its sync.
pub fn sorted_difference<'a, K: Ord, V: PartialEq>(
    desired: &'a BTreeMap<K, V>,
    last: &'a BTreeMap<K, V>,
) -> Difference<'a, K, V> {
    sorted_difference_by(desired, last, |new, old| new == old)
}

/// [`sorted_difference`] with values of two kinds, `same` saying whether a desired value
/// stands for a last one (values that mean something only with their map's context).
pub fn sorted_difference_by<'a, K: Ord, V, W>(
    desired: &'a BTreeMap<K, V>,
    last: &'a BTreeMap<K, W>,
    same: impl Fn(&V, &W) -> bool,
) -> Difference<'a, K, V> {
    let (mut changed, mut gone) = (Vec::new(), Vec::new());
    let mut old = last.iter().peekable();
    for (key, value) in desired {
        while let Some((old_key, _)) = old.next_if(|(k, _)| *k < key) {
            gone.push(old_key);
        }
        match old.next_if(|(k, _)| *k == key) {
            Some((_, old_value)) if same(value, old_value) => {}
            _ => changed.push((key, value)),
        }
    }
    gone.extend(old.map(|(k, _)| k));
    (changed, gone)
}

/// What the entries to write are kept in: a sorted map, ordinary or persistent. What differs
/// between two of them is found by one walk down both ([`sorted_difference`]); between two
/// persistent maps, one the other changed, without visiting what they share (at 5,000 nodes,
/// a node added compared every node's entries).
pub trait SortedMap<K, V> {
    fn entries<'a>(&'a self) -> impl Iterator<Item = (&'a K, &'a V)>
    where
        K: 'a,
        V: 'a;
    fn holds(&self, key: &K) -> bool;
    /// The entries of `self` that `last` lacks or holds otherwise, and the keys only `last`
    /// has.
    fn changes_since<'a>(&'a self, last: &'a Self) -> Difference<'a, K, V>;
}

/// Entries new or changed, and keys gone.
pub type Difference<'a, K, V> = (Vec<(&'a K, &'a V)>, Vec<&'a K>);

impl<K: Ord, V: PartialEq> SortedMap<K, V> for BTreeMap<K, V> {
    fn entries<'a>(&'a self) -> impl Iterator<Item = (&'a K, &'a V)>
    where
        K: 'a,
        V: 'a,
    {
        self.iter()
    }

    fn holds(&self, key: &K) -> bool {
        self.contains_key(key)
    }

    fn changes_since<'a>(&'a self, last: &'a Self) -> Difference<'a, K, V> {
        sorted_difference(self, last)
    }
}

impl<K: Ord + Clone, V: PartialEq + Clone> SortedMap<K, V> for imbl::OrdMap<K, V> {
    fn entries<'a>(&'a self) -> impl Iterator<Item = (&'a K, &'a V)>
    where
        K: 'a,
        V: 'a,
    {
        self.iter()
    }

    fn holds(&self, key: &K) -> bool {
        self.contains_key(key)
    }

    fn changes_since<'a>(&'a self, last: &'a Self) -> Difference<'a, K, V> {
        let (mut changed, mut gone) = (Vec::new(), Vec::new());
        for item in last.diff(self) {
            match item {
                imbl::ordmap::DiffItem::Add(key, value)
                | imbl::ordmap::DiffItem::Update {
                    new: (key, value), ..
                } => changed.push((key, value)),
                imbl::ordmap::DiffItem::Remove(key, _) => gone.push(key),
            }
        }
        (changed, gone)
    }
}

/// As [`sync_lpm`], against what this agent last wrote there (`None`: against the kernel's
/// entries, as [`sync_lpm`]).
pub fn sync_lpm_since<const N: usize, V: aya::Pod + PartialEq, M>(
    map: &mut LpmTrie<&mut MapData, [u8; N], V>,
    desired: &M,
    last: Option<&M>,
    stats: &mut SyncStats,
) -> Result<(), aya::maps::MapError>
where
    [u8; N]: aya::Pod,
    M: SortedMap<(u32, [u8; N]), V>,
{
    let Some(last) = last else {
        return sync_lpm(map, desired, stats);
    };
    let (changed, gone) = desired.changes_since(last);
    for ((prefix_len, data), value) in changed {
        map.insert(&Key::new(*prefix_len, *data), value, 0)?;
        stats.written += 1;
    }
    for (prefix_len, data) in gone {
        map.remove(&Key::new(*prefix_len, *data))?;
        stats.deleted += 1;
    }
    Ok(())
}

/// Makes an LPM trie keyed by `N`-byte prefixes hold exactly `desired` (keyed by prefix length
/// and data), new and changed entries first.
pub fn sync_lpm<const N: usize, V: aya::Pod + PartialEq>(
    map: &mut LpmTrie<&mut MapData, [u8; N], V>,
    desired: &impl SortedMap<(u32, [u8; N]), V>,
    stats: &mut SyncStats,
) -> Result<(), aya::maps::MapError>
where
    [u8; N]: aya::Pod,
{
    for ((prefix_len, data), value) in desired.entries() {
        let key = Key::new(*prefix_len, *data);
        if map.get(&key, 0).ok().as_ref() != Some(value) {
            map.insert(&key, value, 0)?;
            stats.written += 1;
        }
    }
    let stale: Vec<Key<[u8; N]>> = map
        .keys()
        .filter_map(Result::ok)
        .filter(|k| !desired.holds(&(k.prefix_len(), k.data())))
        .collect();
    for key in stale {
        map.remove(&key)?;
        stats.deleted += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The side-by-side walk finds exactly what looking each key up finds.
    #[test]
    fn the_sorted_difference_equals_the_lookups() {
        let mut rng = crate::test_rng::TestRng::new(7);
        for _ in 0..200 {
            let mut random_map = || -> BTreeMap<u64, u64> {
                (0..rng.below(40))
                    .map(|_| (rng.below(50), rng.below(3)))
                    .collect()
            };
            let (desired, last) = (random_map(), random_map());
            let (changed, gone) = sorted_difference(&desired, &last);
            let expected_changed: Vec<_> = desired
                .iter()
                .filter(|(k, v)| last.get(k) != Some(v))
                .collect();
            let expected_gone: Vec<_> = last.keys().filter(|k| !desired.contains_key(k)).collect();
            assert_eq!(changed, expected_changed);
            assert_eq!(gone, expected_gone);
            // The persistent maps' difference, between unrelated maps and between a map and
            // a changed copy of it (sharing most of its nodes), is the same.
            let (desired_p, last_p): (imbl::OrdMap<u64, u64>, imbl::OrdMap<u64, u64>) = (
                desired.clone().into_iter().collect(),
                last.clone().into_iter().collect(),
            );
            assert_eq!(desired_p.changes_since(&last_p), (changed, gone));
            let big: imbl::OrdMap<u64, u64> = (0..5_000u64).map(|k| (k * 3, k)).collect();
            let mut edited = big.clone();
            for (key, value) in &desired {
                edited.insert(key * 1_000, *value);
            }
            for key in last.keys() {
                edited.remove(&(key * 3));
            }
            let (changed, gone) = edited.changes_since(&big);
            let expected_changed: Vec<_> = edited
                .iter()
                .filter(|&(k, v)| big.get(k) != Some(v))
                .collect();
            let expected_gone: Vec<_> = big.keys().filter(|&k| !edited.contains_key(k)).collect();
            assert_eq!(changed, expected_changed);
            assert_eq!(gone, expected_gone);
        }
    }
}
