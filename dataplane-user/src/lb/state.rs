//! What the load-balancer maps hold, as this agent knows it: the installed service ports and
//! backends, the backend ids, and the port bitmaps the kernel checks first.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque},
    net::IpAddr,
};

use dataplane_common::{
    lb::{
        BACKEND_PORTS_BASE, Backend, MemberKey, PORT_BITMAP_WORDS, SERVICE_PORTS_BASE, ServiceKey,
        ServiceValue, backend_slot, next_backend_id, port_bit,
    },
    maps,
    overlay::{FAMILY_IPV4, FAMILY_IPV6},
};

use ipnet::IpNet;

use super::{
    compile::{BackendAddr, ServicePort},
    ranges::RangeEntries,
};
use crate::{error::AgentError, mapsync::addr16};

/// The live backends of the array's `slots`, by id.
pub(super) fn live_by_id(slots: Vec<(u32, Backend)>) -> HashMap<u32, Backend> {
    slots
        .into_iter()
        .map(|(_, b)| b)
        .filter(|b| b.is_live(b.id))
        .map(|b| (b.id, b))
        .collect()
}

/// What this agent has written to the load-balancer maps, so a sync writes only differences.
#[derive(Debug, Default)]
pub struct LbState {
    pub(super) backend_ids: HashMap<BackendAddr, u32>,
    /// The last id each slot of the backends array held (index: slot), live or removed, for
    /// every slot used so far.
    slot_ids: Vec<u32>,
    /// Slots free again, longest free first. Reused only once every slot has been used, and
    /// then in that order, so each slot's generation turns over as slowly as it can.
    pub(super) free_slots: VecDeque<u32>,
    pub(super) installed: BTreeMap<ServiceKey, Installed>,
    /// Service-port ids below `next_service_id` given back by removed service ports.
    pub(super) free_service_ids: Vec<u32>,
    next_service_id: u32,
    /// The port bitmaps as last written (read from the map on the first sync).
    pub(super) port_words: Option<Vec<u64>>,
    /// The backends map as last written (read from the map on the first sync), so that a
    /// sync compares in memory instead of reading every backend back.
    pub(super) backends: Option<HashMap<u32, Backend>>,
    /// The membership map as last written (read from the map on the first sync).
    pub(super) members: Option<BTreeSet<MemberKey>>,
    /// How many installed service ports reference each backend id (ready or terminating):
    /// a backend goes when its count does.
    pub(super) backend_refs: HashMap<u32, u32>,
    /// How many times the installed service ports mark each bit of the port bitmaps (by bit
    /// number, `word * 64 + bit`), so that a sync of a few ports makes the bitmaps from
    /// theirs instead of from every port and backend (10,000 ports, 100,000 backends: most
    /// of an endpoint change's time). `None`: counted again from the installed ports (after a
    /// full sync or a failed one).
    pub(super) bit_users: Option<HashMap<u32, u32>>,
    /// The load-balancer keys reached from outside that have source ranges, with them.
    pub(super) range_ports: BTreeMap<ServiceKey, Vec<IpNet>>,
    /// `LB_SOURCE_RANGES` as last written (`None`: read it at the next sync).
    pub(super) ranges_written: Option<RangeEntries>,
    /// How many times a backend has left a service port (or a port with backends has gone):
    /// what says the socket-level translation's connected sockets need a look.
    pub(super) departures: u64,
}

/// What one load-balancer sync writes: the ports to install (new or different), the keys to
/// remove, how many ports there are in all, and the port bitmaps of them all.
pub(super) struct SyncPlan<'a> {
    pub(super) changed: Vec<&'a ServicePort>,
    pub(super) removed: Vec<ServiceKey>,
    pub(super) ports: usize,
    pub(super) words: Vec<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Installed {
    pub(super) value: ServiceValue,
    /// Ready backend ids in the live table.
    pub(super) ready: Vec<u32>,
    /// Every backend id the port references (ready and terminating).
    pub(super) referenced: Vec<u32>,
    /// The port as installed; `None` when adopted from a previous agent (unknown: the first
    /// sync installs it again).
    pub(super) port: Option<ServicePort>,
}

impl Installed {
    /// The port's (service, backend) members: its ready backends, with ClientIP affinity.
    pub(super) fn members(&self) -> impl Iterator<Item = MemberKey> + '_ {
        let service_id = self.value.id;
        self.ready
            .iter()
            .filter(move |_| self.value.affinity_timeout != 0)
            .map(move |&backend_id| MemberKey {
                service_id,
                backend_id,
            })
    }
}

/// Entries written and removed by one sync.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LbSyncStats {
    pub services: usize,
    pub backends: usize,
    pub written: usize,
    pub deleted: usize,
}

impl LbState {
    /// The id of a backend, allocated on first use: a slot of the backends array and that
    /// slot's next generation, so a conntrack or affinity entry naming an earlier backend of
    /// the slot never matches it. None when every one of the `capacity` slots is taken.
    pub(super) fn backend_id(&mut self, backend: BackendAddr, capacity: u32) -> Option<u32> {
        if let Some(&id) = self.backend_ids.get(&backend) {
            return Some(id);
        }
        let used = self.slot_ids.len() as u32;
        let id = if used < capacity {
            let id = next_backend_id(used, 0);
            self.slot_ids.push(id);
            id
        } else {
            let slot = self.free_slots.pop_front()?;
            let id = next_backend_id(slot, self.slot_ids[slot as usize]);
            self.slot_ids[slot as usize] = id;
            id
        };
        self.backend_ids.insert(backend, id);
        Some(id)
    }

    /// Gives ids to the backends of `changed` that have none, before anything is written.
    /// When the slots run out, the ids given here are taken back and the error says how many
    /// backends `all` needs.
    pub(super) fn allocate_backend_ids(
        &mut self,
        changed: &[&ServicePort],
        capacity: u32,
    ) -> Result<(), AgentError> {
        let mut fresh = Vec::new();
        for port in changed {
            for &backend in port.ready.iter().chain(&port.terminating) {
                if self.backend_ids.contains_key(&backend) {
                    continue;
                }
                match self.backend_id(backend, capacity) {
                    Some(id) => fresh.push((backend, id)),
                    None => {
                        for (backend, id) in fresh {
                            self.backend_ids.remove(&backend);
                            self.free_slots.push_front(backend_slot(id));
                        }
                        // Those of the kept ports and those of the changed ones.
                        let mut needed: BTreeSet<BackendAddr> =
                            self.backend_ids.keys().copied().collect();
                        needed.extend(
                            changed
                                .iter()
                                .flat_map(|p| p.ready.iter().chain(&p.terminating)),
                        );
                        return Err(AgentError::Capacity {
                            what: "backends",
                            needed: needed.len(),
                            map: maps::LB_BACKENDS,
                            limit: capacity,
                            flag: "--max-backends",
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether `port` is not installed as it is.
    pub(super) fn differs(&self, port: &ServicePort) -> bool {
        self.installed
            .get(&port.key)
            .and_then(|i| i.port.as_ref())
            .is_none_or(|installed| installed != port)
    }

    /// The ids (given) and addresses of every backend a port references.
    pub(super) fn referenced_ids(&self, port: &ServicePort) -> Vec<(u32, BackendAddr)> {
        port.ready
            .iter()
            .chain(&port.terminating)
            .map(|b| (self.backend_ids[b], *b))
            .collect()
    }

    pub(super) fn add_refs(&mut self, referenced: &[(u32, BackendAddr)]) {
        for (id, _) in referenced {
            *self.backend_refs.entry(*id).or_default() += 1;
        }
    }

    /// Takes back one reference to each of `ids`; returns those nothing references now.
    pub(super) fn drop_refs(&mut self, ids: &[u32]) -> Vec<u32> {
        let mut unreferenced = Vec::new();
        for id in ids {
            if let Some(count) = self.backend_refs.get_mut(id) {
                *count -= 1;
                if *count == 0 {
                    self.backend_refs.remove(id);
                    unreferenced.push(*id);
                }
            }
        }
        unreferenced
    }

    /// Counts the references again from what is installed (after adoption or a failure).
    pub(super) fn count_backend_refs(&mut self) {
        self.backend_refs.clear();
        for id in self.installed.values().flat_map(|i| &i.referenced) {
            *self.backend_refs.entry(*id).or_default() += 1;
        }
    }

    /// Forgets a backend's id: its slot is free from now on.
    pub(super) fn release_backend(&mut self, id: u32) {
        self.backend_ids.retain(|_, held| *held != id);
        self.free_slots.push_back(backend_slot(id));
    }

    /// Forgets every id no installed port references.
    pub(super) fn release_backends_without_refs(&mut self) {
        let (refs, free_slots) = (&self.backend_refs, &mut self.free_slots);
        self.backend_ids.retain(|_, &mut id| {
            let keep = refs.contains_key(&id);
            if !keep {
                free_slots.push_back(backend_slot(id));
            }
            keep
        });
    }

    /// Records a backends array slot as read from the pinned map.
    pub(super) fn adopt_slot(&mut self, slot: u32, backend: &Backend) {
        if backend.id == 0 {
            return;
        }
        let slot = slot as usize;
        if self.slot_ids.len() <= slot {
            self.slot_ids.resize(slot + 1, 0);
        }
        self.slot_ids[slot] = backend.id;
        if backend.is_live(backend.id) {
            self.backend_ids.insert(backend_addr(backend), backend.id);
        }
    }

    /// After adoption: every used slot that holds no live backend is free.
    pub(super) fn free_unused_slots(&mut self) {
        let live: HashSet<u32> = self.backend_ids.values().copied().collect();
        self.free_slots = (0..self.slot_ids.len() as u32)
            .filter(|&slot| !live.contains(&self.slot_ids[slot as usize]))
            .collect();
    }

    /// How many times a backend has left a service port this agent installed (a count that
    /// only grows).
    pub fn departures(&self) -> u64 {
        self.departures
    }

    /// The backend ids each installed service port references (ready or terminating).
    pub fn members(&self) -> HashMap<ServiceKey, HashSet<u32>> {
        self.installed
            .iter()
            .map(|(key, installed)| (*key, installed.referenced.iter().copied().collect()))
            .collect()
    }

    /// The id of the backend `backend` in the maps, if this agent wrote it.
    pub fn id_of(&self, backend: BackendAddr) -> Option<u32> {
        self.backend_ids.get(&backend).copied()
    }

    /// An unused service-port id of the `capacity` (its tables are at `2 * id` and
    /// `2 * id + 1`).
    pub(super) fn allocate_service_id(&mut self, capacity: u32) -> Option<u32> {
        if let Some(id) = self.free_service_ids.pop() {
            return Some(id);
        }
        let id = self.next_service_id;
        if id >= capacity {
            return None;
        }
        self.next_service_id += 1;
        Some(id)
    }

    /// Records an id found in use (adopted from pins).
    pub(super) fn mark_service_id_used(&mut self, id: u32) {
        while self.next_service_id <= id {
            self.free_service_ids.push(self.next_service_id);
            self.next_service_id += 1;
        }
        self.free_service_ids.retain(|&free| free != id);
    }
}

pub(super) fn backend_value(backend: BackendAddr, id: u32) -> Backend {
    Backend {
        addr: addr16(backend.ip),
        port_be: backend.port.to_be_bytes(),
        family: if backend.ip.is_ipv4() {
            FAMILY_IPV4
        } else {
            FAMILY_IPV6
        },
        _pad: 0,
        id,
    }
}

/// The slot of a removed backend: its id kept (its generation is remembered), marked gone.
pub(super) fn removed_backend(id: u32) -> Backend {
    Backend {
        id,
        ..Backend::default()
    }
}

/// The address and port a live backends-array entry holds.
fn backend_addr(backend: &Backend) -> BackendAddr {
    let ip = if backend.family == FAMILY_IPV4 {
        let a = backend.addr;
        IpAddr::from([a[12], a[13], a[14], a[15]])
    } else {
        IpAddr::from(backend.addr)
    };
    BackendAddr {
        ip,
        port: u16::from_be_bytes(backend.port_be),
    }
}

/// The bits (`word * 64 + bit`) a service port marks in the port bitmaps: its own port's, and
/// each of its backends' (once per backend).
pub(super) fn port_bit_numbers(port: &ServicePort) -> impl Iterator<Item = u32> + '_ {
    let own = port_bit(SERVICE_PORTS_BASE, u16::from_be_bytes(port.key.port_be));
    let backends = port
        .ready
        .iter()
        .chain(&port.terminating)
        .map(|backend| port_bit(BACKEND_PORTS_BASE, backend.port));
    std::iter::once(own)
        .chain(backends)
        .map(|(word, bit)| word * 64 + bit.trailing_zeros())
}

/// How many times `ports` mark each bit of the port bitmaps.
pub(super) fn count_port_bits<'a>(
    ports: impl Iterator<Item = &'a ServicePort>,
) -> HashMap<u32, u32> {
    let mut users = HashMap::new();
    for port in ports {
        for bit in port_bit_numbers(port) {
            *users.entry(bit).or_default() += 1;
        }
    }
    users
}

/// The port bitmaps' words with `bits` set.
fn words_with(bits: impl Iterator<Item = u32>) -> Vec<u64> {
    let mut words = vec![0u64; (PORT_BITMAP_WORDS * 2) as usize];
    for bit in bits {
        words[(bit / 64) as usize] |= 1 << (bit % 64);
    }
    words
}

/// The port bitmaps' words with the bits `users` counts set.
pub(super) fn bitmap_words(users: &HashMap<u32, u32>) -> Vec<u64> {
    words_with(users.iter().filter(|(_, n)| **n > 0).map(|(bit, _)| *bit))
}

/// `written` with each bit of `flipped` set or cleared as `users` counts it.
pub(super) fn patched_words(
    written: &[u64],
    users: &HashMap<u32, u32>,
    flipped: &BTreeSet<u32>,
) -> Vec<u64> {
    let mut words = written.to_vec();
    for &bit in flipped {
        let (word, mask) = ((bit / 64) as usize, 1u64 << (bit % 64));
        if users.contains_key(&bit) {
            words[word] |= mask;
        } else {
            words[word] &= !mask;
        }
    }
    words
}

/// The two port bitmaps `ports` need: their service ports, then their backends' ports.
pub fn port_bitmaps<'a>(ports: impl Iterator<Item = &'a ServicePort>) -> Vec<u64> {
    words_with(ports.flat_map(port_bit_numbers))
}
