//! Reading the per-CPU packet and drop counters from the pinned maps.

use aya::maps::{Map, MapData, PerCpuArray};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    lb::socket::SOCK_STAT_NAMES,
    maps::{DROPS, PACKETS, SOCK_LB_STATS},
    stats::counter_index,
};
use serde::Serialize;

use crate::kernel::capacity::map_err;
use crate::{error::AgentError, kernel::pins::Pins};

#[derive(Clone, Debug, Default, Serialize)]
pub struct Counters {
    /// Packets seen by hook and class (zero rows left out).
    pub packets: Vec<PacketCount>,
    /// Drops by reason (zero rows left out).
    pub drops: Vec<DropCount>,
    /// What the socket-level service translation did (`--socket-lb`; zero rows left out).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub socket: Vec<SocketCount>,
}

/// One counter of the socket-level translation: `connect` and `sendmsg` (calls given a
/// backend), `refused` (a service without endpoints), `reversed` (a service address given
/// back to `getpeername`/`recvmsg`), `passed` (left to the per-packet path).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SocketCount {
    pub event: &'static str,
    pub count: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PacketCount {
    pub hook: &'static str,
    pub class: &'static str,
    pub count: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DropCount {
    pub reason: &'static str,
    pub code: u32,
    pub description: &'static str,
    pub count: u64,
}

impl Counters {
    /// Packets of `class` seen at `hook`.
    pub fn packets(&self, hook: Hook, class: PacketClass) -> u64 {
        self.packets
            .iter()
            .find(|p| p.hook == hook.name() && p.class == class.name())
            .map_or(0, |p| p.count)
    }

    /// The socket-level counter `event` (a name of `SOCK_STAT_NAMES`).
    pub fn socket(&self, event: &str) -> u64 {
        self.socket
            .iter()
            .find(|c| c.event == event)
            .map_or(0, |c| c.count)
    }

    /// Packets dropped for `reason`, at any hook.
    pub fn drops(&self, reason: DropReason) -> u64 {
        self.drops
            .iter()
            .find(|d| d.code == reason as u32)
            .map_or(0, |d| d.count)
    }
}

/// Reads the counters from the maps pinned under `pins`.
pub fn read(pins: &Pins) -> Result<Counters, AgentError> {
    let packets = open_counter_map(pins, PACKETS)?;
    let drops = open_counter_map(pins, DROPS)?;
    let mut counters = Counters::default();
    for &hook in Hook::ALL {
        for &class in PacketClass::ALL {
            let count = sum(&packets, counter_index(hook, class), PACKETS)?;
            if count > 0 {
                counters.packets.push(PacketCount {
                    hook: hook.name(),
                    class: class.name(),
                    count,
                });
            }
        }
    }
    for &reason in DropReason::ALL {
        let count = sum(&drops, reason as u32, DROPS)?;
        if count > 0 {
            counters.drops.push(DropCount {
                reason: reason.name(),
                code: reason as u32,
                description: reason.description(),
                count,
            });
        }
    }
    // Pins of an agent that predates the socket-level programs have no such map.
    if pins.map(SOCK_LB_STATS).exists() {
        let socket = open_counter_map(pins, SOCK_LB_STATS)?;
        for (slot, &event) in SOCK_STAT_NAMES.iter().enumerate() {
            let count = sum(&socket, slot as u32, SOCK_LB_STATS)?;
            if count > 0 {
                counters.socket.push(SocketCount { event, count });
            }
        }
    }
    Ok(counters)
}

fn open_counter_map(
    pins: &Pins,
    name: &'static str,
) -> Result<PerCpuArray<MapData, u64>, AgentError> {
    let data = pins.open_map(name)?;
    PerCpuArray::try_from(Map::PerCpuArray(data)).map_err(map_err(name, "open"))
}

fn sum(map: &PerCpuArray<MapData, u64>, index: u32, name: &'static str) -> Result<u64, AgentError> {
    let values = map.get(&index, 0).map_err(map_err(name, "read"))?;
    Ok(values.iter().sum())
}
