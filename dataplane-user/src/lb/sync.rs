//! The load-balancer maps brought to the compiled service ports in an order packets can never
//! see half-applied: backends first, then Maglev tables, then service ports; removals last.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use dataplane_common::{
    lb::{
        AffinityKey, AffinityValue, Backend, MAGLEV_TABLE_SIZE, MaglevTable, MemberKey,
        PORT_BITMAP_WORDS, SCOPE_EXTERNAL, ServiceKey, ServiceValue, backend_slot,
    },
    maps::{self, MAX_AFFINITY_MEMBERS},
};

use super::{
    compile::{BackendAddr, ServicePort},
    maglev::{PreparedPort, new_tables, port_table},
    ranges::{range_entries, ranges_of},
    state::{
        Installed, LbState, LbSyncStats, SyncPlan, backend_value, bitmap_words, count_port_bits,
        live_by_id, patched_words, port_bit_numbers, removed_backend,
    },
};
use crate::kernel::capacity::map_err;
use crate::{error::AgentError, kernel::loader::Dataplane};

impl Dataplane {
    /// Writes the words of the port bitmaps that differ from what the map holds.
    fn sync_port_bitmaps(
        &mut self,
        state: &mut LbState,
        wanted: Vec<u64>,
    ) -> Result<usize, AgentError> {
        let err = |action: &'static str| map_err(maps::LB_PORTS, action);
        let mut map: Array<&mut MapData, u64> = self.typed_map(maps::LB_PORTS)?;
        let current = match state.port_words.take() {
            Some(words) => words,
            None => (0..PORT_BITMAP_WORDS * 2)
                .map(|i| map.get(&i, 0))
                .collect::<Result<_, _>>()
                .map_err(err("read port bitmap"))?,
        };
        let mut written = 0;
        for (index, (&want, &have)) in wanted.iter().zip(&current).enumerate() {
            if want != have {
                map.set(index as u32, want, 0)
                    .map_err(err("write port bitmap"))?;
                written += 1;
            }
        }
        state.port_words = Some(wanted);
        Ok(written)
    }

    /// Takes over what a previous agent left in the pinned load-balancer maps: backend ids stay
    /// attached to the same backends (tracked flows keep them), service ports keep their ids
    /// and live tables until the first sync replaces or removes them.
    pub fn adopt_lb(&mut self, state: &mut LbState) -> Result<(), AgentError> {
        let slots = self.backend_slots()?;
        for (slot, backend) in &slots {
            state.adopt_slot(*slot, backend);
        }
        state.free_unused_slots();
        // What the first sync would otherwise read back once more.
        state.backends = Some(live_by_id(slots));
        let map = self.map(maps::LB_SERVICES)?;
        let services = crate::kernel::batch::read::<ServiceKey, ServiceValue>(map)
            .map_err(map_err(maps::LB_SERVICES, "read services"))?;
        for (key, value) in services {
            // The live table's backends are not known: the first sync rebuilds it aside.
            let unknown = vec![u32::MAX];
            state.mark_service_id_used(value.id);
            state.installed.insert(
                key,
                Installed {
                    value,
                    ready: unknown,
                    referenced: Vec::new(),
                    port: None,
                },
            );
        }
        Ok(())
    }

    /// Makes the load-balancer maps hold exactly `ports`, writing only what differs from the
    /// last sync: a service port equal to the one installed is not looked at again (so one
    /// changed endpoint costs its own port's work, not every port's). Order: the port bitmaps,
    /// then per changed service port its backends, its new Maglev table under its spare index
    /// and the service entry that switches to it in one write; then removals (old tables,
    /// gone service ports, members, and backends no service port uses any more).
    ///
    /// Everything the sync needs must fit before anything is written. After a failure (or
    /// on the first sync, or after adopting a previous agent's maps) the next sync reads the
    /// maps anew and sweeps what no installed port references.
    pub fn sync_lb(
        &mut self,
        state: &mut LbState,
        ports: &[ServicePort],
    ) -> Result<LbSyncStats, AgentError> {
        let sweep = state.backends.is_none() || state.members.is_none();
        // Unknown until this sync has installed `ports`: a failed one leaves them to be
        // counted again from the installed ports.
        state.bit_users = None;
        // Counted here, where every port is walked anyway, so that the next sync of a few
        // ports patches the bitmaps instead of counting every installed port's bits (about 2
        // ms at 10,000 ports, which the first change after a full sync paid).
        let users = count_port_bits(ports.iter());
        let wanted: HashSet<ServiceKey> = ports.iter().map(|p| p.key).collect();
        let plan = SyncPlan {
            changed: ports.iter().filter(|p| state.differs(p)).collect(),
            removed: state
                .installed
                .keys()
                .filter(|k| !wanted.contains(k))
                .copied()
                .collect(),
            ports: ports.len(),
            words: bitmap_words(&users),
        };
        state.range_ports = ports.iter().filter_map(ranges_of).collect();
        let ranges = range_entries(&state.range_ports);
        let added = self.add_source_ranges(&ranges, &mut state.ranges_written)?;
        let mut stats = self.sync_lb_planned(state, plan, sweep)?;
        stats.deleted += self.remove_source_ranges(&ranges, &mut state.ranges_written)?;
        stats.written += added;
        state.bit_users = Some(users);
        Ok(stats)
    }

    /// [`Self::sync_lb`] for the service ports that may have changed since the last sync:
    /// each key with its port now (`None`: no Service holds it). The others stay as installed,
    /// untouched and not compared. After a sync that failed (and at the first), every port is
    /// needed: `Ok(None)` says so, and nothing was done.
    pub fn sync_lb_changed(
        &mut self,
        state: &mut LbState,
        updates: &[(ServiceKey, Option<ServicePort>)],
    ) -> Result<Option<LbSyncStats>, AgentError> {
        if state.backends.is_none() || state.members.is_none() {
            return Ok(None);
        }
        let now = || updates.iter().filter_map(|(_, port)| port.as_ref());
        // Each key's port after this sync (the last update of a key is the one installed).
        let after: BTreeMap<ServiceKey, Option<&ServicePort>> = updates
            .iter()
            .map(|(key, port)| (*key, port.as_ref()))
            .collect();
        // The bitmaps of every port after this sync: the installed ports' bit counts, less
        // the updated ports' old bits, plus their new ones. Only the bits whose count
        // reaches or leaves zero change a word, so the words as last written are patched
        // (a walk of every bit user was most of an endpoint change's time at 10,000 ports).
        let counted = state.bit_users.is_some();
        let mut users = state.bit_users.take().unwrap_or_else(|| {
            count_port_bits(state.installed.values().filter_map(|i| i.port.as_ref()))
        });
        let mut flipped = BTreeSet::new();
        let installed_port = |key: &ServiceKey| state.installed.get(key)?.port.as_ref();
        for (key, port) in &after {
            for bit in installed_port(key).into_iter().flat_map(port_bit_numbers) {
                if let Some(n) = users.get_mut(&bit) {
                    *n -= 1;
                    if *n == 0 {
                        users.remove(&bit);
                        flipped.insert(bit);
                    }
                }
            }
            for bit in port.iter().flat_map(|p| port_bit_numbers(p)) {
                let n = users.entry(bit).or_default();
                if *n == 0 {
                    flipped.insert(bit);
                }
                *n += 1;
            }
        }
        let words = match &state.port_words {
            Some(written) if counted => patched_words(written, &users, &flipped),
            _ => bitmap_words(&users),
        };
        // Every installed port is known here (a full sync installed them all: adopted ones
        // without a port lead to `Ok(None)` above), so the count needs no walk.
        let replaced = after
            .keys()
            .filter(|k| state.installed.contains_key(k))
            .count();
        let ports = state.installed.len() - replaced + after.values().flatten().count();
        let plan = SyncPlan {
            changed: now().filter(|p| state.differs(p)).collect(),
            removed: updates
                .iter()
                .filter(|(key, port)| port.is_none() && state.installed.contains_key(key))
                .map(|(key, _)| *key)
                .collect(),
            ports,
            words,
        };
        // The source ranges of the keys reached from outside that changed.
        let mut ranges_changed = state.ranges_written.is_none();
        for (key, port) in &after {
            if key.scope != SCOPE_EXTERNAL {
                continue;
            }
            let old = state.range_ports.remove(key);
            let new = port.and_then(ranges_of);
            ranges_changed |= old.as_ref() != new.as_ref().map(|(_, ranges)| ranges);
            if let Some((key, ranges)) = new {
                state.range_ports.insert(key, ranges);
            }
        }
        let ranges = ranges_changed.then(|| range_entries(&state.range_ports));
        let added = match &ranges {
            Some(ranges) => self.add_source_ranges(ranges, &mut state.ranges_written)?,
            None => 0,
        };
        let mut stats = self.sync_lb_planned(state, plan, false)?;
        if let Some(ranges) = &ranges {
            stats.deleted += self.remove_source_ranges(ranges, &mut state.ranges_written)?;
        }
        stats.written += added;
        // The installed ports are now those the counts were made for.
        state.bit_users = Some(users);
        Ok(Some(stats))
    }

    fn sync_lb_planned(
        &mut self,
        state: &mut LbState,
        plan: SyncPlan<'_>,
        sweep: bool,
    ) -> Result<LbSyncStats, AgentError> {
        let result = self.sync_lb_changes(state, plan, sweep);
        if result.is_err() {
            // The maps may hold part of this sync: read them again next time.
            state.backends = None;
            state.members = None;
        }
        result
    }

    fn sync_lb_changes(
        &mut self,
        state: &mut LbState,
        plan: SyncPlan<'_>,
        sweep: bool,
    ) -> Result<LbSyncStats, AgentError> {
        let capacities = *self.capacities();
        let SyncPlan {
            changed,
            removed,
            ports,
            words,
        } = plan;
        let new_ports = changed
            .iter()
            .filter(|p| !state.installed.contains_key(&p.key))
            .count();
        let needed_ports = state.installed.len() + new_ports;
        if needed_ports > capacities.service_ports as usize {
            return Err(AgentError::Capacity {
                what: "service ports",
                needed: needed_ports,
                map: maps::LB_SERVICES,
                limit: capacities.service_ports,
                flag: "--max-service-ports",
            });
        }
        state.allocate_backend_ids(&changed, capacities.backends)?;
        if sweep {
            state.count_backend_refs();
        }
        let mut stats = LbSyncStats {
            services: ports,
            ..LbSyncStats::default()
        };
        stats.written += self.sync_port_bitmaps(state, words)?;
        let mut have = match state.backends.take() {
            Some(have) => have,
            None => self.live_backends()?,
        };
        let mut have_members = match state.members.take() {
            Some(have) => have,
            None if self.first_read_of_created(maps::LB_MEMBERS) => BTreeSet::new(),
            None => {
                let members: BpfHashMap<&mut MapData, MemberKey, u32> =
                    self.typed_map(maps::LB_MEMBERS)?;
                members.keys().filter_map(Result::ok).collect()
            }
        };
        let mut gone_members = BTreeSet::new();
        let mut stale_tables = Vec::new();
        let mut unreferenced = Vec::new();
        let tables = new_tables(state, &changed);
        for (port, prepared) in changed.into_iter().zip(tables) {
            let referenced = state.referenced_ids(port);
            stats.written += self.write_backends(&referenced, &mut have)?;
            let old = state.installed.get(&port.key).cloned();
            let installed = self.install_port(
                state,
                port,
                prepared,
                old.as_ref(),
                &mut have_members,
                &mut gone_members,
                &mut stale_tables,
                &mut stats,
            )?;
            state.add_refs(&referenced);
            if let Some(old) = &old {
                let kept: HashSet<u32> = installed.referenced.iter().copied().collect();
                if old.referenced.iter().any(|id| !kept.contains(id)) {
                    state.departures += 1;
                }
                unreferenced.extend(state.drop_refs(&old.referenced));
            }
            state.installed.insert(port.key, installed);
        }
        // Removals, after every addition.
        {
            let mut services: BpfHashMap<&mut MapData, ServiceKey, ServiceValue> =
                self.typed_map(maps::LB_SERVICES)?;
            for key in &removed {
                let Some(installed) = state.installed.remove(key) else {
                    continue;
                };
                services
                    .remove(key)
                    .map_err(map_err(maps::LB_SERVICES, "remove service"))?;
                stats.deleted += 1;
                stale_tables.push(installed.value.table);
                state.free_service_ids.push(installed.value.id);
                gone_members.extend(installed.members());
                if !installed.referenced.is_empty() {
                    state.departures += 1;
                }
                unreferenced.extend(state.drop_refs(&installed.referenced));
            }
        }
        {
            let mut tables: BpfHashMap<&mut MapData, u32, MaglevTable> =
                self.typed_map(maps::LB_MAGLEV)?;
            for table in stale_tables {
                if tables.remove(&table).is_ok() {
                    stats.deleted += 1;
                }
            }
        }
        if sweep {
            // What a previous agent (or a failed sync) left that no installed port has.
            let wanted: BTreeSet<MemberKey> = state
                .installed
                .values()
                .flat_map(Installed::members)
                .collect();
            gone_members.extend(have_members.difference(&wanted).copied());
            unreferenced.extend(have.keys().copied());
        }
        stats.deleted += self.remove_members(&mut have_members, &gone_members)?;
        state.members = Some(have_members);
        stats.deleted += self.remove_backends(state, &unreferenced, &mut have)?;
        state.backends = Some(have);
        if sweep {
            state.release_backends_without_refs();
        }
        stats.backends = state.backend_refs.len();
        Ok(stats)
    }

    /// The live entries of the backends array, by id.
    fn live_backends(&mut self) -> Result<HashMap<u32, Backend>, AgentError> {
        Ok(live_by_id(self.backend_slots()?))
    }

    /// Every slot of the backends array, read in batches (262,144 slots one call each took
    /// most of a second).
    fn backend_slots(&mut self) -> Result<Vec<(u32, Backend)>, AgentError> {
        if self.first_read_of_created(maps::LB_BACKENDS) {
            return Ok(Vec::new());
        }
        let map = self.map(maps::LB_BACKENDS)?;
        crate::kernel::batch::read::<u32, Backend>(map)
            .map_err(map_err(maps::LB_BACKENDS, "read backends"))
    }

    /// Writes the backends of `ids` that the array does not hold as they should be.
    fn write_backends(
        &mut self,
        ids: &[(u32, BackendAddr)],
        have: &mut HashMap<u32, Backend>,
    ) -> Result<usize, AgentError> {
        // One batch per port (its ten or a thousand backends in one call).
        let wanted: Vec<(u32, Backend)> = ids
            .iter()
            .map(|&(id, backend)| (id, backend_value(backend, id)))
            .filter(|(id, value)| have.get(id) != Some(value))
            .collect();
        let map = self.map(maps::LB_BACKENDS)?;
        let slots: Vec<(u32, Backend)> = wanted
            .iter()
            .map(|&(id, value)| (backend_slot(id), value))
            .collect();
        let result = crate::kernel::batch::update(map, &slots);
        let written = match &result {
            Ok(()) => wanted.len(),
            Err(stopped) => stopped.done,
        };
        have.extend(wanted.into_iter().take(written));
        result.map_err(|stopped| map_err(maps::LB_BACKENDS, "write backend")(stopped.source))?;
        Ok(written)
    }

    /// Marks removed the backends of `candidates` no installed service port references, and
    /// gives their slots back.
    fn remove_backends(
        &mut self,
        state: &mut LbState,
        candidates: &[u32],
        have: &mut HashMap<u32, Backend>,
    ) -> Result<usize, AgentError> {
        let mut backends: Array<&mut MapData, Backend> = self.typed_map(maps::LB_BACKENDS)?;
        let mut deleted = 0;
        for &id in candidates {
            if state.backend_refs.contains_key(&id) || have.remove(&id).is_none() {
                continue;
            }
            backends
                .set(backend_slot(id), removed_backend(id), 0)
                .map_err(map_err(maps::LB_BACKENDS, "remove backend"))?;
            deleted += 1;
            state.release_backend(id);
        }
        Ok(deleted)
    }

    /// One changed service port: its Maglev table (a new one under the spare index when its
    /// ready backends changed), its members (before the service entry: new backends are
    /// members from their first flow), then the service entry. Returns what is installed.
    #[expect(
        clippy::too_many_arguments,
        reason = "the sync's working sets, passed down"
    )]
    fn install_port(
        &mut self,
        state: &mut LbState,
        port: &ServicePort,
        // `port`'s ready ids, and their Maglev table if built already.
        prepared: PreparedPort,
        current: Option<&Installed>,
        have_members: &mut BTreeSet<MemberKey>,
        gone_members: &mut BTreeSet<MemberKey>,
        stale_tables: &mut Vec<u32>,
        stats: &mut LbSyncStats,
    ) -> Result<Installed, AgentError> {
        let capacities = *self.capacities();
        let PreparedPort {
            ready,
            table: new_table,
        } = prepared;
        let id =
            match current {
                Some(installed) => installed.value.id,
                None => state.allocate_service_id(capacities.service_ports).ok_or(
                    AgentError::Capacity {
                        what: "service ports",
                        needed: state.installed.len() + 1,
                        map: maps::LB_SERVICES,
                        limit: capacities.service_ports,
                        flag: "--max-service-ports",
                    },
                )?,
            };
        let same_backends = current.is_some_and(|c| c.ready == ready);
        let table = match current {
            Some(installed) if same_backends => installed.value.table,
            // The spare index of this service port: the live table stays intact until the
            // service entry switches.
            Some(installed) => installed.value.table ^ 1,
            None => id * 2,
        };
        if !same_backends {
            // Built before for these ready backends (`new_tables`), unless an earlier port
            // of the same plan, of the same key, made them the installed ones.
            let built = new_table.unwrap_or_else(|| port_table(&ready, port));
            let mut value: MaglevTable = [0; MAGLEV_TABLE_SIZE];
            value.copy_from_slice(&built);
            let mut tables: BpfHashMap<&mut MapData, u32, MaglevTable> =
                self.typed_map(maps::LB_MAGLEV)?;
            tables
                .insert(table, value, 0)
                .map_err(map_err(maps::LB_MAGLEV, "write Maglev table"))?;
            stats.written += 1;
            if let Some(installed) = current {
                stale_tables.push(installed.value.table);
            }
        }
        let value = ServiceValue {
            id,
            table,
            backends: ready.len() as u32,
            affinity_timeout: port.affinity_timeout,
        };
        let installed = Installed {
            value,
            ready,
            referenced: state
                .referenced_ids(port)
                .iter()
                .map(|(id, _)| *id)
                .collect(),
            port: Some(port.clone()),
        };
        let members: BTreeSet<MemberKey> = installed.members().collect();
        if !members.is_empty() {
            let mut map: BpfHashMap<&mut MapData, MemberKey, u32> =
                self.typed_map(maps::LB_MEMBERS)?;
            for &member in &members {
                if have_members.insert(member) {
                    if have_members.len() > MAX_AFFINITY_MEMBERS as usize {
                        return Err(AgentError::Capacity {
                            what: "backends of service ports with ClientIP affinity",
                            needed: have_members.len(),
                            map: maps::LB_MEMBERS,
                            limit: MAX_AFFINITY_MEMBERS,
                            flag: "(fixed size)",
                        });
                    }
                    map.insert(member, 1, 0)
                        .map_err(map_err(maps::LB_MEMBERS, "write member"))?;
                    stats.written += 1;
                }
            }
        }
        if let Some(old) = current {
            gone_members.extend(old.members().filter(|m| !members.contains(m)));
        }
        if current.map(|c| c.value) != Some(value) {
            let mut services: BpfHashMap<&mut MapData, ServiceKey, ServiceValue> =
                self.typed_map(maps::LB_SERVICES)?;
            services
                .insert(port.key, value, 0)
                .map_err(map_err(maps::LB_SERVICES, "write service"))?;
            stats.written += 1;
        }
        Ok(installed)
    }
}

impl Dataplane {
    /// Removes the members no service port has any more, then the affinity entries that name
    /// them: a client stuck to a backend that left the service port starts afresh (the
    /// programs would not use the entry, and `inspect affinity` must not show it).
    fn remove_members(
        &mut self,
        have: &mut BTreeSet<MemberKey>,
        gone: &BTreeSet<MemberKey>,
    ) -> Result<usize, AgentError> {
        let gone: Vec<MemberKey> = gone.intersection(have).copied().collect();
        if gone.is_empty() {
            return Ok(0);
        }
        let mut deleted = 0;
        {
            let mut members: BpfHashMap<&mut MapData, MemberKey, u32> =
                self.typed_map(maps::LB_MEMBERS)?;
            for member in &gone {
                members
                    .remove(member)
                    .map_err(map_err(maps::LB_MEMBERS, "remove member"))?;
                have.remove(member);
                deleted += 1;
            }
        }
        let gone: BTreeSet<MemberKey> = gone.into_iter().collect();
        let mut affinity: BpfHashMap<&mut MapData, AffinityKey, AffinityValue> =
            self.typed_map(maps::LB_AFFINITY)?;
        let stale: Vec<AffinityKey> = affinity
            .iter()
            .filter_map(Result::ok)
            .filter(|(key, value)| {
                gone.contains(&MemberKey {
                    service_id: key.service_id,
                    backend_id: value.backend_id,
                })
            })
            .map(|(key, _)| key)
            .collect();
        for key in stale {
            // Gone already if the client's entry aged out of the LRU meanwhile.
            if affinity.remove(&key).is_ok() {
                deleted += 1;
            }
        }
        Ok(deleted)
    }
}
