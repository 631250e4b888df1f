//! Many entries of one map written, read or deleted in one system call
//! (`BPF_MAP_UPDATE_BATCH`, `BPF_MAP_LOOKUP_BATCH`, `BPF_MAP_DELETE_BATCH`).
//!
//! aya reads and writes one entry per `bpf()` call, and on kernels with speculative-execution
//! mitigations the call costs more than the access itself: reading the 262,144 slots of the
//! backends array back and writing a large cluster's 100,000 backends one call each were a
//! third of the agent's first sync at 5,000 nodes. The kernel takes keys and values as two
//! arrays; a write goes in order and on a failure stops and says how many it wrote, so the
//! caller's record of what the map holds stays exact.

use std::os::fd::{AsFd as _, AsRawFd as _};

use aya::{
    Pod,
    maps::{Array, HashMap, Map, MapData, MapError},
    sys::SyscallError,
};
use aya_obj::generated::{bpf_attr, bpf_cmd, bpf_map_type};

/// At most this many entries per call: the kernel writes them one after the other anyway;
/// the bound only keeps one call (and the key and value arrays) short.
const CHUNK: usize = 4096;

/// A batch that stopped: how many of its entries were written (or deleted), and why it
/// stopped.
#[derive(Debug)]
pub struct Stopped {
    pub done: usize,
    pub source: MapError,
}

/// Writes `entries` (key, value) to `map`, an array (keys `u32` indexes) or a hash map, in
/// order, in as few calls as [`CHUNK`] allows.
pub fn update<K: Pod, V: Pod>(map: &Map, entries: &[(K, V)]) -> Result<(), Stopped> {
    let stop = |source| Stopped { done: 0, source };
    let data = checked_map_data::<K, V>(map).map_err(stop)?;
    let mut written = 0;
    for chunk in entries.chunks(CHUNK) {
        let keys: Vec<K> = chunk.iter().map(|(k, _)| *k).collect();
        let values: Vec<V> = chunk.iter().map(|(_, v)| *v).collect();
        match update_batch(data, &keys, &values) {
            Ok(()) => written += chunk.len(),
            Err((done, source)) => {
                return Err(Stopped {
                    done: written + done,
                    source,
                });
            }
        }
    }
    Ok(())
}

/// Deletes the entries of `keys` from `map`, a hash map, in order, in as few calls as
/// [`CHUNK`] allows. A key the map does not hold stops the batch (`ENOENT`), as a one-entry
/// delete fails: what was deleted before it is counted.
pub fn delete<K: Pod, V: Pod>(map: &Map, keys: &[K]) -> Result<(), Stopped> {
    let stop = |source| Stopped { done: 0, source };
    let data = match map {
        Map::HashMap(data) | Map::LruHashMap(data) => {
            HashMap::<&MapData, K, V>::try_from(map).map_err(stop)?;
            data
        }
        _ => {
            return Err(stop(MapError::Unsupported {
                name: "batch delete".into(),
                map_type: bpf_map_type::BPF_MAP_TYPE_UNSPEC,
            }));
        }
    };
    let mut deleted = 0;
    for chunk in keys.chunks(CHUNK) {
        // SAFETY: an all-zero bpf_attr is valid, and the kernel requires the unused bytes zero.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        attr.batch.map_fd = data.fd().as_fd().as_raw_fd() as u32;
        attr.batch.keys = chunk.as_ptr() as u64;
        attr.batch.count = chunk.len() as u32;
        // SAFETY: the attribute points at `chunk.len()` keys of the map's size (checked),
        // alive for the call; the kernel only reads them.
        if let Err(io_error) = unsafe { bpf(bpf_cmd::BPF_MAP_DELETE_BATCH, &mut attr) } {
            // SAFETY: the kernel wrote back how many it deleted in the same variant.
            let done = unsafe { attr.batch.count } as usize;
            return Err(Stopped {
                done: deleted + done,
                source: MapError::SyscallError(SyscallError {
                    call: "bpf_map_delete_batch",
                    io_error,
                }),
            });
        }
        deleted += chunk.len();
    }
    Ok(())
}

/// Every entry of `map`, an array (keys `u32` indexes) or a hash map, read [`CHUNK`] at a
/// time.
pub fn read<K: Pod, V: Pod>(map: &Map) -> Result<Vec<(K, V)>, MapError> {
    let data = checked_map_data::<K, V>(map)?;
    let mut entries = Vec::new();
    // The kernel's position between calls (an index or a bucket: four bytes for both kinds).
    let mut position = 0u32;
    let mut first = true;
    loop {
        let mut keys: Vec<K> = Vec::with_capacity(CHUNK);
        let mut values: Vec<V> = Vec::with_capacity(CHUNK);
        let mut next = 0u32;
        // SAFETY: an all-zero bpf_attr is valid, and the kernel requires the unused bytes zero.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        attr.batch.map_fd = data.fd().as_fd().as_raw_fd() as u32;
        attr.batch.in_batch = if first {
            0
        } else {
            &position as *const u32 as u64
        };
        attr.batch.out_batch = &mut next as *mut u32 as u64;
        attr.batch.keys = keys.as_mut_ptr() as u64;
        attr.batch.values = values.as_mut_ptr() as u64;
        attr.batch.count = CHUNK as u32;
        // SAFETY: room for `CHUNK` keys and values of the map's sizes (checked) and a
        // four-byte position, all alive for the call.
        let result = unsafe { bpf(bpf_cmd::BPF_MAP_LOOKUP_BATCH, &mut attr) };
        let end = match result {
            Ok(()) => false,
            // The last entries come with ENOENT (or none are left).
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => true,
            Err(io_error) => {
                return Err(MapError::SyscallError(SyscallError {
                    call: "bpf_map_lookup_batch",
                    io_error,
                }));
            }
        };
        // SAFETY: the kernel wrote back how many entries it filled in.
        let count = (unsafe { attr.batch.count } as usize).min(CHUNK);
        // SAFETY: the kernel wrote `count` keys and values, plain data of their types.
        unsafe {
            keys.set_len(count);
            values.set_len(count);
        }
        entries.extend(keys.into_iter().zip(values));
        if end {
            return Ok(entries);
        }
        position = next;
        first = false;
    }
}

/// One `bpf()` call of `command` with `attr`.
///
/// # Safety
/// `attr` must be valid for `command`: every pointer in it valid for what the kernel reads
/// or writes there.
unsafe fn bpf(command: bpf_cmd, attr: &mut bpf_attr) -> std::io::Result<()> {
    // SAFETY: as the caller promises.
    let result = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command as libc::c_long,
            attr as *mut bpf_attr,
            size_of::<bpf_attr>() as libc::c_uint,
        )
    };
    if result == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The map's data, once its key and value sizes are checked against `K` and `V` as aya's
/// typed maps check them.
fn checked_map_data<K: Pod, V: Pod>(map: &Map) -> Result<&MapData, MapError> {
    match map {
        Map::Array(data) => {
            if size_of::<K>() != size_of::<u32>() {
                return Err(MapError::InvalidKeySize {
                    size: size_of::<K>(),
                    expected: size_of::<u32>(),
                });
            }
            Array::<&MapData, V>::try_from(map)?;
            Ok(data)
        }
        Map::HashMap(data) | Map::LruHashMap(data) => {
            HashMap::<&MapData, K, V>::try_from(map)?;
            Ok(data)
        }
        _ => Err(MapError::Unsupported {
            name: "batch update".into(),
            map_type: bpf_map_type::BPF_MAP_TYPE_UNSPEC,
        }),
    }
}

/// One `BPF_MAP_UPDATE_BATCH` call; on failure, how many entries it wrote.
fn update_batch<K: Pod, V: Pod>(
    data: &MapData,
    keys: &[K],
    values: &[V],
) -> Result<(), (usize, MapError)> {
    debug_assert_eq!(keys.len(), values.len());
    // SAFETY: an all-zero bpf_attr is valid, and the kernel requires the unused bytes zero.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // The union's batch variant, the one this command reads.
    attr.batch.map_fd = data.fd().as_fd().as_raw_fd() as u32;
    attr.batch.keys = keys.as_ptr() as u64;
    attr.batch.values = values.as_ptr() as u64;
    attr.batch.count = keys.len() as u32;
    // SAFETY: the attribute points at `keys.len()` keys and values of the map's sizes
    // (checked), alive for the call; the kernel only reads them.
    let Err(io_error) = (unsafe { bpf(bpf_cmd::BPF_MAP_UPDATE_BATCH, &mut attr) }) else {
        return Ok(());
    };
    // SAFETY: the kernel wrote back how many it wrote in the same variant.
    let done = unsafe { attr.batch.count } as usize;
    Err((
        done,
        MapError::SyscallError(SyscallError {
            call: "bpf_map_update_batch",
            io_error,
        }),
    ))
}
