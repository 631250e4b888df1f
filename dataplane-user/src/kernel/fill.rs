//! How full each pinned map is: its type, its size and the entries holding data, read with
//! each map's own key and value types. `dataplane status` shows it; the metrics endpoint
//! exports it.

use aya::maps::{Array, HashMap, LpmTrie, Map, MapData, MapError, MapInfo, PerCpuArray};
use dataplane_common::{
    acl::{AclAddrKey, AclAddrValue, AclCtKey, AclCtValue, AclEndpoint, AclPortKey, AclVerdict},
    lb::{
        AffinityKey, AffinityValue, Backend, CtKey, CtValue, MaglevTable, MemberKey, ServiceKey,
        ServiceValue,
    },
    maps,
    overlay::{Addr, LocalPod, OVERLAY_ENABLED, OverlayConfig, TunnelEndpoint},
    port::PodPort,
};
use serde::Serialize;

use crate::{error::AgentError, kernel::capacity::map_err, kernel::pins::Pins};

#[derive(Clone, Debug, Serialize)]
pub struct MapFill {
    pub name: &'static str,
    pub map_type: String,
    pub max_entries: u32,
    /// Entries holding data (non-zero for arrays).
    pub used: u32,
}

/// The fill of the map `name` pinned under `pins`; `None` when it is not pinned.
pub fn map_fill(pins: &Pins, name: &'static str) -> Result<Option<MapFill>, AgentError> {
    let path = pins.map(name);
    if !path.exists() {
        return Ok(None);
    }
    let err = |action| map_err(name, action);
    let info = MapInfo::from_pin(&path).map_err(err("read info"))?;
    let map_type = info.map_type().map_err(err("read type"))?;
    let data = MapData::from_pin(&path).map_err(err("open pin"))?;
    let used = used_entries(name, data).map_err(err("read"))?;
    Ok(Some(MapFill {
        name,
        map_type: format!("{map_type:?}"),
        max_entries: info.max_entries(),
        used,
    }))
}

/// Entries holding data: non-zero slots of arrays, keys of hash and LPM maps. Each map is read
/// with its own key and value types from dataplane-common.
fn used_entries(name: &str, data: MapData) -> Result<u32, MapError> {
    fn count<T>(
        items: impl Iterator<Item = Result<T, MapError>>,
        keep: impl Fn(&T) -> bool,
    ) -> Result<u32, MapError> {
        let mut used = 0;
        for item in items {
            if keep(&item?) {
                used += 1;
            }
        }
        Ok(used)
    }
    match name {
        maps::DROPS | maps::PACKETS => {
            let map: PerCpuArray<MapData, u64> = PerCpuArray::try_from(Map::PerCpuArray(data))?;
            count(map.iter(), |v| v.iter().any(|c| *c != 0))
        }
        maps::META | maps::ACL_ACTIVE => {
            let map: Array<MapData, u32> = Array::try_from(Map::Array(data))?;
            count(map.iter(), |v| *v != 0)
        }
        maps::OVERLAY_CONFIG => {
            let map: Array<MapData, OverlayConfig> = Array::try_from(Map::Array(data))?;
            count(map.iter(), |c| c.flags & OVERLAY_ENABLED != 0)
        }
        maps::REMOTE_PODS_V4 => {
            let map: LpmTrie<MapData, [u8; 4], TunnelEndpoint> =
                LpmTrie::try_from(Map::LpmTrie(data))?;
            count(map.keys(), |_| true)
        }
        maps::REMOTE_PODS_V6 => {
            let map: LpmTrie<MapData, [u8; 16], TunnelEndpoint> =
                LpmTrie::try_from(Map::LpmTrie(data))?;
            count(map.keys(), |_| true)
        }
        maps::NODE_ADDRS | maps::ACL_NODE_ADDRS => {
            let map: HashMap<MapData, Addr, u32> = HashMap::try_from(Map::HashMap(data))?;
            count(map.keys(), |_| true)
        }
        maps::LB_NODEPORT_ADDRS => {
            let map: HashMap<MapData, Addr, u8> = HashMap::try_from(Map::HashMap(data))?;
            count(map.keys(), |_| true)
        }
        maps::LOCAL_PODS => {
            let map: HashMap<MapData, Addr, LocalPod> = HashMap::try_from(Map::HashMap(data))?;
            count(map.keys(), |_| true)
        }
        maps::LB_SERVICES => {
            let map: HashMap<MapData, ServiceKey, ServiceValue> =
                HashMap::try_from(Map::HashMap(data))?;
            count(map.keys(), |_| true)
        }
        maps::LB_PORTS | maps::LB_SNAT_NEXT => {
            let map: Array<MapData, u64> = Array::try_from(Map::Array(data))?;
            count(map.iter(), |w| *w != 0)
        }
        maps::LB_BACKENDS => {
            let map: Array<MapData, Backend> = Array::try_from(Map::Array(data))?;
            count(map.iter(), |b| b.is_live(b.id))
        }
        maps::LB_MAGLEV => {
            let map: HashMap<MapData, u32, MaglevTable> = HashMap::try_from(Map::HashMap(data))?;
            count(map.keys(), |_| true)
        }
        maps::LB_CT => {
            let map: HashMap<MapData, CtKey, CtValue> = HashMap::try_from(Map::LruHashMap(data))?;
            count(map.keys(), |_| true)
        }
        maps::LB_AFFINITY => {
            let map: HashMap<MapData, AffinityKey, AffinityValue> =
                HashMap::try_from(Map::LruHashMap(data))?;
            count(map.keys(), |_| true)
        }
        maps::LB_MEMBERS => {
            let map: HashMap<MapData, MemberKey, u32> = HashMap::try_from(Map::HashMap(data))?;
            count(map.keys(), |_| true)
        }
        maps::POD_PORTS => {
            let map: HashMap<MapData, u32, PodPort> = HashMap::try_from(Map::HashMap(data))?;
            count(map.keys(), |_| true)
        }
        maps::ACL_CT => {
            let map: HashMap<MapData, AclCtKey, AclCtValue> =
                HashMap::try_from(Map::LruHashMap(data))?;
            count(map.keys(), |_| true)
        }
        maps::ACL_ENDPOINTS => {
            let map: HashMap<MapData, Addr, AclEndpoint> = HashMap::try_from(Map::HashMap(data))?;
            count(map.keys(), |_| true)
        }
        maps::ACL_ADDRS => {
            let map: HashMap<MapData, AclAddrKey, AclAddrValue> =
                HashMap::try_from(Map::HashMap(data))?;
            count(map.keys(), |_| true)
        }
        maps::ACL_PORTS => {
            let map: HashMap<MapData, AclPortKey, AclVerdict> =
                HashMap::try_from(Map::HashMap(data))?;
            count(map.keys(), |_| true)
        }
        _ => Ok(0),
    }
}
