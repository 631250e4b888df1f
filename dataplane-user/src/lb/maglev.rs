//! Maglev tables: each service port's backends spread over a fixed-size table, so that a
//! backend added or removed moves few flows.

use dataplane_common::lb::MAGLEV_TABLE_SIZE;

use super::{
    compile::{BackendAddr, ServicePort},
    state::LbState,
};

/// FNV-1a (64-bit) of `bytes` from `seed`: a hash stable across builds and restarts, so a
/// restarted agent rebuilds the same Maglev tables.
fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(seed, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The ids of `port`'s ready backends (allocated before).
fn ready_ids(state: &LbState, port: &ServicePort) -> Vec<u32> {
    port.ready.iter().map(|b| state.backend_ids[b]).collect()
}

/// The Maglev table of `port`, whose ready backends have the ids `ready`.
pub(super) fn port_table(ready: &[u32], port: &ServicePort) -> Vec<u32> {
    let pairs: Vec<(u32, BackendAddr)> = ready
        .iter()
        .copied()
        .zip(port.ready.iter().copied())
        .collect();
    maglev_table(&pairs)
}

/// One port of a plan as [`new_tables`] prepared it: its ready backends' ids, and their
/// Maglev table unless the port installed before the plan has the same ready backends (its
/// table stays).
pub(super) struct PreparedPort {
    pub(super) ready: Vec<u32>,
    pub(super) table: Option<Vec<u32>>,
}

/// [`PreparedPort`] of each of `ports`. Built on every core (`rayon`): a first sync builds
/// 10,000 tables, a fifth of it on one core.
pub(super) fn new_tables(state: &LbState, ports: &[&ServicePort]) -> Vec<PreparedPort> {
    let build = |port: &&ServicePort| {
        let ready = ready_ids(state, port);
        let same = state
            .installed
            .get(&port.key)
            .is_some_and(|installed| installed.ready == ready);
        let table = (!same).then(|| port_table(&ready, port));
        PreparedPort { ready, table }
    };
    // A table is about 30 us; handing work to the pool and waiting for it about as much.
    crate::parallel::map(ports, TABLES_PER_TASK, build)
}

/// Maglev tables built by one task of [`new_tables`].
const TABLES_PER_TASK: usize = 64;

/// The Maglev lookup table (Eisenbud et al., NSDI 2016) of `backends`: each backend walks its
/// own permutation of the slots and they take turns claiming free slots, so every backend gets
/// about M/N slots and removing one backend moves about 1/N of the slots. The result depends
/// only on the set of backends, not their order.
pub fn maglev_table(backends: &[(u32, BackendAddr)]) -> Vec<u32> {
    let m = MAGLEV_TABLE_SIZE as u64;
    let mut sorted: Vec<&(u32, BackendAddr)> = backends.iter().collect();
    sorted.sort_by_key(|(_, b)| *b);
    let mut table = vec![u32::MAX; MAGLEV_TABLE_SIZE];
    if sorted.is_empty() {
        return vec![0; MAGLEV_TABLE_SIZE];
    }
    let permutations: Vec<(u64, u64)> = sorted
        .iter()
        .map(|(_, backend)| maglev_permutation(backend))
        .collect();
    // Each backend's next slot of its permutation, `(offset + j * skip) % m` for its j-th
    // choice, moved on by one addition: a division a probe made the fill of 10,000 tables
    // a fifth of a large cluster's first sync.
    let mut slots: Vec<u64> = permutations.iter().map(|&(offset, _)| offset).collect();
    let mut filled = 0;
    'fill: loop {
        for (i, &(_, skip)) in permutations.iter().enumerate() {
            let mut slot = slots[i];
            while table[slot as usize] != u32::MAX {
                slot = next_slot(slot, skip, m);
            }
            table[slot as usize] = sorted[i].0;
            slots[i] = next_slot(slot, skip, m);
            filled += 1;
            if filled == MAGLEV_TABLE_SIZE {
                break 'fill;
            }
        }
    }
    table
}

/// A backend's Maglev permutation, `(offset, skip)`: its j-th choice of slot is
/// `(offset + j * skip) % MAGLEV_TABLE_SIZE`, both taken from hashes of its address.
pub(super) fn maglev_permutation(backend: &BackendAddr) -> (u64, u64) {
    let m = MAGLEV_TABLE_SIZE as u64;
    let name = backend.to_string();
    let offset = fnv1a(0xcbf2_9ce4_8422_2325, name.as_bytes()) % m;
    let skip = fnv1a(0x8422_2325_cbf2_9ce4, name.as_bytes()) % (m - 1) + 1;
    (offset, skip)
}

/// The slot after `slot` in a permutation of stride `skip` over `m` slots (both below `m`).
fn next_slot(slot: u64, skip: u64, m: u64) -> u64 {
    let next = slot + skip;
    if next >= m { next - m } else { next }
}
