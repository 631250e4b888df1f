//! Per-node IPAM: the pods' addresses, allocated from the node's `spec.podCIDRs` (IPv4, IPv6
//! or both) for the CNI plugin (issue 21), one allocation per container interface.
//!
//! - An allocation is keyed by container id and interface name: asking again for the same
//!   key gives the same addresses (a runtime retrying ADD), releasing is idempotent (DEL of a
//!   container never seen succeeds), and garbage collection releases every allocation the
//!   runtime no longer has.
//! - Never a duplicate: a free address is one no allocation holds; a full pool is an error
//!   naming it.
//! - The network address, the first address (the subnet's gateway by convention, as
//!   OVN-Kubernetes' node gateway router), IPv4's third address (the node's hybrid overlay
//!   router, `crate::hybrid`: kept whether or not the hybrid overlay is on, so turning it on
//!   never collides with a running pod), IPv4's broadcast address and any address the caller
//!   reserves are never given out.
//! - After a release the next allocation moves on rather than reusing the freed address at
//!   once (a packet in flight to the old pod should not reach a new one).
//! - Persistent: every change is written (aside, synced, renamed, the directory synced) to a
//!   file on the node's disk before it is taken, so allocations survive agent restarts and
//!   node reboots, and a change that could not be saved is not made (a full disk fails the
//!   ADD and leaves no allocation a retry could take unsaved). A file that does not parse is
//!   an error naming it, never a silent start from nothing (which would hand out addresses
//!   pods still hold); one damaged entry is quarantined with a warning, its addresses held.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::{Path, PathBuf},
};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// Why an allocation could not be made, or the state not kept.
#[derive(Debug, thiserror::Error)]
pub enum IpamError {
    #[error("no address left in pod CIDR {pool}: {allocated} allocated")]
    Exhausted { pool: IpNet, allocated: usize },
    #[error("this node has no pod CIDR (its Node object's spec.podCIDRs is empty)")]
    NoPool,
    #[error("{address} is held by container {holder}; DEL it (or let the runtime's GC) first")]
    Held { address: IpAddr, holder: String },
    #[error("{address} is not in this node's pod CIDRs ({pools})")]
    OutsidePools { address: IpAddr, pools: String },
    #[error("IPAM state {path}: {detail}")]
    State { path: PathBuf, detail: String },
}

/// The pod an allocation is for, as the runtime names it (`CNI_ARGS`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// One container interface's addresses, each with its pool's prefix length.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    pub container_id: String,
    pub ifname: String,
    pub pod: Option<PodRef>,
    pub addresses: Vec<IpNet>,
}

/// What the state file holds.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Stored {
    /// By `<container id>/<interface>`.
    allocations: BTreeMap<String, Allocation>,
    /// Per pool, the address after the last one given out: where the next search starts.
    next: BTreeMap<IpNet, IpAddr>,
    /// Entries found damaged when the file was read, kept as they were (for whoever repairs
    /// the node) with the addresses they name held: an address a damaged entry may stand for
    /// is never given to another pod.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    quarantined: Vec<Quarantined>,
}

/// A damaged allocation entry, set aside when the state file was read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quarantined {
    pub key: String,
    pub why: String,
    pub entry: serde_json::Value,
    /// Every address found in the entry, held until the entry is removed by hand.
    pub holds: Vec<IpAddr>,
}

/// The state file as read: entries one by one, so one damaged entry is set aside rather than
/// the whole file refused.
#[derive(Deserialize)]
struct StoredText {
    #[serde(default)]
    allocations: BTreeMap<String, serde_json::Value>,
    #[serde(default)]
    next: BTreeMap<IpNet, IpAddr>,
    #[serde(default)]
    quarantined: Vec<Quarantined>,
}

impl StoredText {
    /// The allocations that are whole and consistent; the others quarantined, each with a
    /// warning naming it.
    fn check(self, path: &Path) -> Stored {
        let mut stored = Stored {
            next: self.next,
            quarantined: self.quarantined,
            ..Stored::default()
        };
        for (key, entry) in self.allocations {
            match serde_json::from_value::<Allocation>(entry.clone())
                .map_err(|e| e.to_string())
                .and_then(|a| a.consistent_with(&key).map(|()| a))
            {
                Ok(allocation) => {
                    stored.allocations.insert(key, allocation);
                }
                Err(why) => {
                    tracing::warn!(
                        path = %path.display(),
                        entry = key,
                        why,
                        "damaged IPAM entry quarantined; its addresses stay held until it is removed by hand"
                    );
                    let holds = addresses_in(&entry);
                    stored.quarantined.push(Quarantined {
                        key,
                        why,
                        entry,
                        holds,
                    });
                }
            }
        }
        stored
    }
}

/// Every IP address written anywhere in `value` (bare or with a prefix length).
fn addresses_in(value: &serde_json::Value) -> Vec<IpAddr> {
    match value {
        serde_json::Value::String(text) => text
            .parse::<IpNet>()
            .map(|n| n.addr())
            .or_else(|_| text.parse::<IpAddr>())
            .into_iter()
            .collect(),
        serde_json::Value::Array(items) => items.iter().flat_map(addresses_in).collect(),
        serde_json::Value::Object(fields) => fields.values().flat_map(addresses_in).collect(),
        _ => Vec::new(),
    }
}

impl Allocation {
    /// Whether the entry stored under `key` is one the agent can act on: keyed by its own
    /// container and interface, valid names, at least one address and at most one per family.
    fn consistent_with(&self, key: &str) -> Result<(), String> {
        if key != self::key(&self.container_id, &self.ifname) {
            return Err(format!(
                "stored under {key:?} but names container {:?} interface {:?}",
                self.container_id, self.ifname
            ));
        }
        super::names::check_container_id(&self.container_id)?;
        super::names::check_ifname(&self.ifname)?;
        if self.addresses.is_empty() {
            return Err("no address".into());
        }
        let v4 = self.addresses.iter().filter(|a| a.addr().is_ipv4()).count();
        if v4 > 1 || self.addresses.len() - v4 > 1 {
            return Err(format!(
                "more than one address of a family: {:?}",
                self.addresses
            ));
        }
        Ok(())
    }
}

/// The node's allocations and the file they are kept in.
#[derive(Debug)]
pub struct Ipam {
    path: PathBuf,
    stored: Stored,
}

impl Ipam {
    /// The allocations kept in `path` (none if there is no file yet).
    pub fn open(path: &Path) -> Result<Self, IpamError> {
        let state_error = |detail: String| IpamError::State {
            path: path.to_owned(),
            detail,
        };
        let stored = match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice::<StoredText>(&bytes)
                .map_err(|e| {
                    state_error(format!(
                        "does not parse ({e}); move it aside only once no pod uses its addresses"
                    ))
                })?
                .check(path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Stored::default(),
            Err(e) => return Err(state_error(e.to_string())),
        };
        Ok(Self {
            path: path.to_owned(),
            stored,
        })
    }

    /// The addresses of container `container_id`'s interface `ifname`: the ones it has, or one
    /// new address from each of `pools` (at most one pool per family is used), skipping
    /// `reserved`.
    pub fn allocate(
        &mut self,
        pools: &[IpNet],
        reserved: &[IpAddr],
        container_id: &str,
        ifname: &str,
        pod: Option<PodRef>,
    ) -> Result<Allocation, IpamError> {
        let key = key(container_id, ifname);
        if let Some(existing) = self.stored.allocations.get(&key) {
            return Ok(existing.clone());
        }
        let pools = one_per_family(pools);
        if pools.is_empty() {
            return Err(IpamError::NoPool);
        }
        let used = self.used();
        let mut addresses = Vec::new();
        for pool in pools {
            let start = self.stored.next.get(&pool).copied();
            let address = free_address(pool, start, &used, reserved)?;
            addresses.push(IpNet::new(address, pool.prefix_len()).expect("a pool's prefix"));
        }
        let mut next = self.stored.clone();
        for address in &addresses {
            let pool = pool_of(address);
            next.next.insert(pool, successor(pool, address.addr()));
        }
        self.store(next, key, container_id, ifname, pod, addresses)
    }

    /// Every address an allocation or a quarantined entry holds.
    fn used(&self) -> BTreeSet<IpAddr> {
        self.stored
            .allocations
            .values()
            .flat_map(|a| a.addresses.iter().map(IpNet::addr))
            .chain(
                self.stored
                    .quarantined
                    .iter()
                    .flat_map(|q| q.holds.iter().copied()),
            )
            .collect()
    }

    /// Gives `container_id`'s `ifname` exactly `addresses` (a pod whose manifest names its
    /// own), each within one of `pools` and held by no other allocation.
    pub fn claim(
        &mut self,
        pools: &[IpNet],
        addresses: &[IpAddr],
        container_id: &str,
        ifname: &str,
        pod: Option<PodRef>,
    ) -> Result<Allocation, IpamError> {
        let key = key(container_id, ifname);
        if let Some(existing) = self.stored.allocations.get(&key) {
            return Ok(existing.clone());
        }
        let mut claimed = Vec::new();
        for address in addresses {
            let Some(pool) = pools.iter().find(|p| p.contains(address)) else {
                return Err(IpamError::OutsidePools {
                    address: *address,
                    pools: pools
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            };
            if let Some(holder) = self
                .stored
                .allocations
                .values()
                .find(|a| a.addresses.iter().any(|h| h.addr() == *address))
            {
                return Err(IpamError::Held {
                    address: *address,
                    holder: holder.container_id.clone(),
                });
            }
            if let Some(damaged) = self
                .stored
                .quarantined
                .iter()
                .find(|q| q.holds.contains(address))
            {
                return Err(IpamError::Held {
                    address: *address,
                    holder: format!("(quarantined entry {})", damaged.key),
                });
            }
            claimed.push(IpNet::new(*address, pool.prefix_len()).expect("a pool's prefix"));
        }
        let next = self.stored.clone();
        self.store(next, key, container_id, ifname, pod, claimed)
    }

    /// Records one allocation in `next` (the state as it is to be), saves it, and only then
    /// takes it as the state: an allocation that is not on disk is not made.
    fn store(
        &mut self,
        mut next: Stored,
        key: String,
        container_id: &str,
        ifname: &str,
        pod: Option<PodRef>,
        addresses: Vec<IpNet>,
    ) -> Result<Allocation, IpamError> {
        let allocation = Allocation {
            container_id: container_id.to_owned(),
            ifname: ifname.to_owned(),
            pod,
            addresses,
        };
        next.allocations.insert(key, allocation.clone());
        self.commit(next)?;
        Ok(allocation)
    }

    /// Saves `next` and takes it as the state; on a failed save the state stays as it was.
    fn commit(&mut self, next: Stored) -> Result<(), IpamError> {
        crate::kernel::state::write_json_atomically(&self.path, &next).map_err(|e| {
            IpamError::State {
                path: self.path.clone(),
                detail: e.to_string(),
            }
        })?;
        self.stored = next;
        Ok(())
    }

    /// The allocation of `container_id`'s `ifname`, if any.
    pub fn get(&self, container_id: &str, ifname: &str) -> Option<&Allocation> {
        self.stored.allocations.get(&key(container_id, ifname))
    }

    /// Releases the addresses of `container_id`'s `ifname`, if it has any.
    pub fn release(
        &mut self,
        container_id: &str,
        ifname: &str,
    ) -> Result<Option<Allocation>, IpamError> {
        let key = key(container_id, ifname);
        let Some(released) = self.stored.allocations.get(&key).cloned() else {
            return Ok(None);
        };
        let mut next = self.stored.clone();
        next.allocations.remove(&key);
        self.commit(next)?;
        Ok(Some(released))
    }

    /// Releases every allocation whose (container id, interface) is not in `attachments` (the
    /// runtime's CNI GC: the attachments it still has); returns what was released.
    pub fn gc(
        &mut self,
        attachments: &BTreeSet<(String, String)>,
    ) -> Result<Vec<Allocation>, IpamError> {
        let stale: Vec<String> = self
            .stored
            .allocations
            .iter()
            .filter(|(_, a)| !attachments.contains(&(a.container_id.clone(), a.ifname.clone())))
            .map(|(k, _)| k.clone())
            .collect();
        if stale.is_empty() {
            return Ok(Vec::new());
        }
        let mut next = self.stored.clone();
        let released: Vec<Allocation> = stale
            .iter()
            .filter_map(|k| next.allocations.remove(k))
            .collect();
        self.commit(next)?;
        Ok(released)
    }

    /// The entries set aside as damaged when the state was read.
    pub fn quarantined(&self) -> &[Quarantined] {
        &self.stored.quarantined
    }

    /// Every allocation, by container id and interface.
    pub fn allocations(&self) -> impl Iterator<Item = &Allocation> {
        self.stored.allocations.values()
    }
}

fn key(container_id: &str, ifname: &str) -> String {
    format!("{container_id}/{ifname}")
}

/// The first pool of each family, truncated to its network.
fn one_per_family(pools: &[IpNet]) -> Vec<IpNet> {
    let mut chosen: Vec<IpNet> = Vec::new();
    for pool in pools.iter().map(IpNet::trunc) {
        if !chosen
            .iter()
            .any(|c| c.addr().is_ipv4() == pool.addr().is_ipv4())
        {
            chosen.push(pool);
        }
    }
    chosen
}

fn pool_of(address: &IpNet) -> IpNet {
    address.trunc()
}

/// Whether `address` of `pool` may never be given out: the network address, the first
/// address (the gateway by convention), IPv4's third (the hybrid overlay router) and
/// broadcast addresses, or one the caller reserves.
fn is_reserved(pool: IpNet, address: IpAddr, reserved: &[IpAddr]) -> bool {
    let offset = offset_in(pool, address);
    let last = pool_size(pool).saturating_sub(1);
    offset == 0
        || offset == 1
        || (pool.addr().is_ipv4() && (offset == HYBRID_ROUTER_OFFSET || offset == last))
        || reserved.contains(&address)
}

/// Where a node's hybrid overlay router address lies in its IPv4 pod subnet
/// (`crate::hybrid::router_ip`).
const HYBRID_ROUTER_OFFSET: u128 = 3;

/// A free address of `pool`, searched from `start` (wrapping around): at most as many
/// candidates as there are addresses taken or reserved, plus the network's own, are looked
/// at before one is free, so the search is short even in an IPv6 /64.
fn free_address(
    pool: IpNet,
    start: Option<IpAddr>,
    used: &BTreeSet<IpAddr>,
    reserved: &[IpAddr],
) -> Result<IpAddr, IpamError> {
    let size = pool_size(pool);
    let taken_here = used.iter().filter(|a| pool.contains(*a)).count() as u128;
    let usable = size.saturating_sub(if pool.addr().is_ipv4() { 3 } else { 2 });
    if taken_here >= usable {
        return Err(IpamError::Exhausted {
            pool,
            allocated: taken_here as usize,
        });
    }
    let first = start
        .filter(|s| pool.contains(s))
        .map_or(0, |s| offset_in(pool, s));
    let budget = (taken_here + reserved.len() as u128 + 4).min(size);
    for step in 0..budget {
        let candidate = at_offset(pool, (first + step) % size);
        if !is_reserved(pool, candidate, reserved) && !used.contains(&candidate) {
            return Ok(candidate);
        }
    }
    Err(IpamError::Exhausted {
        pool,
        allocated: taken_here as usize,
    })
}

fn pool_size(pool: IpNet) -> u128 {
    let host_bits = u32::from(pool.max_prefix_len() - pool.prefix_len());
    1u128.checked_shl(host_bits).unwrap_or(u128::MAX)
}

fn offset_in(pool: IpNet, address: IpAddr) -> u128 {
    to_u128(address).wrapping_sub(to_u128(pool.network()))
}

fn at_offset(pool: IpNet, offset: u128) -> IpAddr {
    let value = to_u128(pool.network()).wrapping_add(offset);
    match pool {
        IpNet::V4(_) => IpAddr::from((value as u32).to_be_bytes()),
        IpNet::V6(_) => IpAddr::from(value.to_be_bytes()),
    }
}

/// The address after `address` in `pool`, wrapping to the network's start.
fn successor(pool: IpNet, address: IpAddr) -> IpAddr {
    at_offset(pool, (offset_in(pool, address) + 1) % pool_size(pool))
}

fn to_u128(address: IpAddr) -> u128 {
    match address {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(text: &str) -> IpNet {
        text.parse().expect("CIDR")
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("address")
    }

    fn fresh(name: &str) -> (Ipam, PathBuf) {
        let dir = std::env::temp_dir().join(format!("ipam-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("ipam.json");
        (Ipam::open(&path).expect("open"), path)
    }

    #[test]
    fn dual_stack_addresses_skip_the_network_the_gateway_the_hybrid_router_and_reserved_ones() {
        let (mut ipam, _) = fresh("dual");
        let pools = [net("10.244.1.0/24"), net("fd00:10:244:1::/64")];
        let reserved = [ip("10.244.1.2")];
        let first = ipam
            .allocate(&pools, &reserved, "c1", "eth0", None)
            .expect("first");
        // 10.244.1.3 is the node's hybrid overlay router, whether or not the overlay is on.
        assert_eq!(
            first.addresses,
            vec![net("10.244.1.4/24"), net("fd00:10:244:1::2/64")]
        );
        let second = ipam
            .allocate(&pools, &reserved, "c2", "eth0", None)
            .expect("second");
        assert_eq!(
            second.addresses,
            vec![net("10.244.1.5/24"), net("fd00:10:244:1::3/64")]
        );
        // The same container and interface again: the same addresses (a retried ADD).
        assert_eq!(
            ipam.allocate(&pools, &reserved, "c1", "eth0", None)
                .expect("again"),
            first
        );
        // Another interface of the same container gets its own.
        let other = ipam
            .allocate(&pools, &reserved, "c1", "net1", None)
            .expect("net1");
        assert_ne!(other.addresses, first.addresses);
    }

    #[test]
    fn a_released_address_is_not_reused_at_once_and_a_full_pool_is_an_error() {
        let (mut ipam, _) = fresh("full");
        // A /29: 8 addresses, minus network, gateway, hybrid router and broadcast: 4 usable.
        let pools = [net("10.0.0.0/29")];
        let got: Vec<IpNet> = (0..4)
            .map(|i| {
                ipam.allocate(&pools, &[], &format!("c{i}"), "eth0", None)
                    .expect("allocate")
                    .addresses[0]
            })
            .collect();
        assert_eq!(
            got,
            ["10.0.0.2", "10.0.0.4", "10.0.0.5", "10.0.0.6"]
                .iter()
                .map(|a| net(&format!("{a}/29")))
                .collect::<Vec<_>>()
        );
        let full = ipam.allocate(&pools, &[], "c5", "eth0", None);
        assert!(
            matches!(full, Err(IpamError::Exhausted { allocated: 4, .. })),
            "{full:?}"
        );
        assert_eq!(
            full.unwrap_err().to_string(),
            "no address left in pod CIDR 10.0.0.0/29: 4 allocated"
        );
        // Release the second; the next allocation takes it (the only one free), after a
        // search that wrapped around.
        ipam.release("c1", "eth0").expect("release");
        assert_eq!(
            ipam.allocate(&pools, &[], "c6", "eth0", None)
                .expect("after release")
                .addresses,
            vec![net("10.0.0.4/29")]
        );
        // With room, a freed address waits its turn.
        let (mut ipam, _) = fresh("turn");
        let pools = [net("10.0.1.0/24")];
        let a = ipam.allocate(&pools, &[], "a", "eth0", None).expect("a");
        ipam.release("a", "eth0").expect("release");
        let b = ipam.allocate(&pools, &[], "b", "eth0", None).expect("b");
        assert_ne!(a.addresses, b.addresses);
    }

    #[test]
    fn release_is_idempotent_gc_keeps_only_the_runtimes_attachments_and_state_persists() {
        let (mut ipam, path) = fresh("persist");
        let pools = [net("10.244.2.0/24")];
        let pod = PodRef {
            namespace: "default".into(),
            name: "web".into(),
            uid: "u-1".into(),
        };
        for id in ["a", "b", "c"] {
            ipam.allocate(&pools, &[], id, "eth0", Some(pod.clone()))
                .expect("allocate");
        }
        assert_eq!(ipam.release("never-seen", "eth0").expect("release"), None);
        // Reopened from disk: the same allocations, and the search goes on where it was.
        let mut reopened = Ipam::open(&path).expect("reopen");
        assert_eq!(reopened.allocations().count(), 3);
        let d = reopened
            .allocate(&pools, &[], "d", "eth0", None)
            .expect("d");
        assert_eq!(d.addresses, vec![net("10.244.2.6/24")]);
        let keep: BTreeSet<(String, String)> = [("a", "eth0"), ("d", "eth0")]
            .iter()
            .map(|(c, i)| (c.to_string(), i.to_string()))
            .collect();
        let released = reopened.gc(&keep).expect("gc");
        let mut names: Vec<&str> = released.iter().map(|a| a.container_id.as_str()).collect();
        names.sort();
        assert_eq!(names, vec!["b", "c"]);
        assert_eq!(Ipam::open(&path).expect("reopen").allocations().count(), 2);
        // A state file that does not parse is an error naming it.
        std::fs::write(&path, "{not json").expect("corrupt");
        let error = Ipam::open(&path).expect_err("corrupt state");
        assert!(
            error.to_string().contains(&path.display().to_string()),
            "{error}"
        );
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    #[test]
    fn no_address_is_ever_given_twice_under_random_allocations_and_releases() {
        let (mut ipam, _) = fresh("random");
        let pools = [net("10.9.0.0/26"), net("fd00:9::/120")];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut live: BTreeSet<String> = BTreeSet::new();
        for step in 0..600 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let id = format!("c{}", state % 80);
            if state.is_multiple_of(3) {
                ipam.release(&id, "eth0").expect("release");
                live.remove(&id);
            } else {
                match ipam.allocate(&pools, &[], &id, "eth0", None) {
                    Ok(_) => {
                        live.insert(id);
                    }
                    Err(IpamError::Exhausted { .. }) => {}
                    Err(other) => panic!("step {step}: {other}"),
                }
            }
            let mut seen = BTreeSet::new();
            for allocation in ipam.allocations() {
                for address in &allocation.addresses {
                    assert!(seen.insert(address.addr()), "step {step}: {address} twice");
                    assert!(!is_reserved(address.trunc(), address.addr(), &[]));
                }
            }
            assert_eq!(ipam.allocations().count(), live.len());
        }
    }

    #[test]
    fn an_allocation_that_cannot_be_saved_is_not_made_and_a_retry_does_not_take_it_unsaved() {
        let (mut ipam, path) = fresh("unsaved");
        let pools = [net("10.244.7.0/24")];
        // The file's place taken by a directory: every save fails, as on a full disk.
        std::fs::create_dir_all(&path).unwrap();
        for attempt in 0..2 {
            let error = ipam
                .allocate(&pools, &[], "c1", "eth0", None)
                .expect_err("no save, no allocation");
            assert!(
                matches!(error, IpamError::State { .. }),
                "{attempt}: {error}"
            );
            assert_eq!(ipam.allocations().count(), 0, "attempt {attempt}");
        }
        std::fs::remove_dir(&path).unwrap();
        let saved = ipam.allocate(&pools, &[], "c1", "eth0", None).unwrap();
        assert_eq!(saved.addresses, vec![net("10.244.7.2/24")]);
        // A release that cannot be saved keeps the allocation too.
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir_all(&path).unwrap();
        assert!(ipam.release("c1", "eth0").is_err());
        assert_eq!(ipam.allocations().count(), 1);
        assert!(ipam.gc(&BTreeSet::new()).is_err());
        assert_eq!(ipam.allocations().count(), 1);
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn damaged_entries_are_quarantined_with_their_addresses_held() {
        let (_, path) = fresh("damaged");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let text = serde_json::json!({
            "allocations": {
                "good/eth0": {"container_id": "good", "ifname": "eth0", "pod": null,
                              "addresses": ["10.244.8.2/24"]},
                "empty/eth0": {"container_id": "empty", "ifname": "eth0", "pod": null,
                               "addresses": []},
                "moved/eth0": {"container_id": "other", "ifname": "eth0", "pod": null,
                               "addresses": ["10.244.8.4/24"]},
                "torn/eth0": {"container_id": "torn", "addresses": ["10.244.8.5/24"]},
                "bad/eth0\nlink": {"container_id": "bad", "ifname": "eth0\nlink",
                                    "pod": null, "addresses": ["10.244.8.6/24"]},
            },
            "next": {},
        });
        std::fs::write(&path, text.to_string()).unwrap();
        let mut ipam = Ipam::open(&path).expect("a damaged entry does not refuse the file");
        let kept: Vec<&str> = ipam
            .allocations()
            .map(|a| a.container_id.as_str())
            .collect();
        assert_eq!(kept, vec!["good"]);
        let mut quarantined: Vec<&str> =
            ipam.quarantined().iter().map(|q| q.key.as_str()).collect();
        quarantined.sort();
        assert_eq!(
            quarantined,
            vec!["bad/eth0\nlink", "empty/eth0", "moved/eth0", "torn/eth0"]
        );
        // Their addresses are never handed out, nor claimed.
        let pools = [net("10.244.8.0/28")];
        let given = ipam.allocate(&pools, &[], "new", "eth0", None).unwrap();
        assert_eq!(given.addresses, vec![net("10.244.8.7/28")]);
        assert!(matches!(
            ipam.claim(&pools, &[ip("10.244.8.5")], "x", "eth0", None),
            Err(IpamError::Held { .. })
        ));
        // Saved and read again, the quarantine stays.
        let reopened = Ipam::open(&path).unwrap();
        assert_eq!(reopened.quarantined().len(), 4);
        assert_eq!(reopened.allocations().count(), 2);
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn a_node_without_pod_cidrs_gets_a_clear_error() {
        let (mut ipam, _) = fresh("none");
        let error = ipam
            .allocate(&[], &[], "c", "eth0", None)
            .expect_err("no pool");
        assert!(error.to_string().contains("spec.podCIDRs"), "{error}");
    }
}
