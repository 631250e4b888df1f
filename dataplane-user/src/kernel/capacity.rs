//! The sizes of the maps that grow with the cluster: service ports, backends, tracked service
//! flows, access-control entries, nodes. Set on the command line (`--max-*`, defaults below) and
//! given to the kernel when the maps are created; maps already pinned keep the size they were
//! created with (the agent says so when asked for another, and works within what it has).
//! When a sync needs more than a map holds, the error names the map and the flag to raise, and
//! nothing of that sync's change is half-written.

use crate::error::AgentError;
use dataplane_common::{
    lb::MAX_BACKEND_SLOTS,
    maps::{
        ACL_ADDRS, ACL_PEERS, ACL_PORTS, DEFAULT_ACL_ENTRIES, DEFAULT_BACKENDS, DEFAULT_CT_ENTRIES,
        DEFAULT_SERVICE_PORTS, LB_BACKENDS, LB_CT, LB_MAGLEV, LB_SERVICES, LB_SOURCE_RANGES,
        MAX_NODES, NODE_ADDRS, REMOTE_PODS_V4, REMOTE_PODS_V6,
    },
};

/// The map sizes an agent asks for, or found pinned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::Args)]
pub struct Capacities {
    /// Service ports the node can hold (`DP_LB_SERVICES`, and twice as many Maglev tables in
    /// `DP_LB_MAGLEV`: 256 KiB of memory each, allocated as used).
    #[arg(long = "max-service-ports", default_value_t = DEFAULT_SERVICE_PORTS,
          value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub service_ports: u32,
    /// Service backends the node can hold, all services together (`DP_LB_BACKENDS`, 24 bytes
    /// each, preallocated; at most 1,048,576).
    #[arg(long = "max-backends", default_value_t = DEFAULT_BACKENDS,
          value_parser = clap::value_parser!(u32).range(1..=MAX_BACKEND_SLOTS as i64))]
    pub backends: u32,
    /// Tracked service flows, each direction one entry (`DP_LB_CT`, an LRU map: the least
    /// recently used flow goes when it is full).
    #[arg(long = "max-conntrack", default_value_t = DEFAULT_CT_ENTRIES,
          value_parser = clap::value_parser!(u32).range(1024..))]
    pub conntrack: u32,
    /// NetworkPolicy and EgressFirewall entries: address prefixes and peer identities
    /// (`DP_ACL_ADDRS`), port entries (`DP_ACL_PORTS`) and peer addresses (`DP_ACL_PEERS`),
    /// each; two generations of a namespace's rules coexist while its update is switched in.
    #[arg(long = "max-acl-entries", default_value_t = DEFAULT_ACL_ENTRIES,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub acl_entries: u32,
    /// Nodes of the cluster: their pod subnets (`DP_OVL_REMOTE4`, `DP_OVL_REMOTE6`, allocated
    /// as used) and addresses (`DP_OVL_NODES`, two per node).
    #[arg(long = "max-nodes", default_value_t = MAX_NODES,
          value_parser = clap::value_parser!(u32).range(2..=65_536))]
    pub nodes: u32,
}

impl Default for Capacities {
    fn default() -> Self {
        Self {
            service_ports: DEFAULT_SERVICE_PORTS,
            backends: DEFAULT_BACKENDS,
            conntrack: DEFAULT_CT_ENTRIES,
            acl_entries: DEFAULT_ACL_ENTRIES,
            nodes: MAX_NODES,
        }
    }
}

impl Capacities {
    /// Each sized map with the size these capacities give it and the flag that sets it.
    pub fn map_sizes(&self) -> [(&'static str, u32, &'static str); 11] {
        [
            (LB_SERVICES, self.service_ports, "--max-service-ports"),
            (LB_MAGLEV, self.service_ports * 2, "--max-service-ports"),
            (
                LB_SOURCE_RANGES,
                self.service_ports * 2,
                "--max-service-ports",
            ),
            (LB_BACKENDS, self.backends, "--max-backends"),
            (LB_CT, self.conntrack, "--max-conntrack"),
            (ACL_ADDRS, self.acl_entries, "--max-acl-entries"),
            (ACL_PORTS, self.acl_entries, "--max-acl-entries"),
            (ACL_PEERS, self.acl_entries, "--max-acl-entries"),
            (REMOTE_PODS_V4, self.nodes, "--max-nodes"),
            (REMOTE_PODS_V6, self.nodes, "--max-nodes"),
            (NODE_ADDRS, self.nodes * 2, "--max-nodes"),
        ]
    }

    /// The capacities maps of these sizes give (`size_of(name)`: a map's actual size).
    pub fn from_map_sizes(size_of: impl Fn(&'static str) -> u32) -> Self {
        Self {
            service_ports: size_of(LB_SERVICES)
                .min(size_of(LB_MAGLEV) / 2)
                .min(size_of(LB_SOURCE_RANGES) / 2),
            backends: size_of(LB_BACKENDS),
            conntrack: size_of(LB_CT),
            acl_entries: size_of(ACL_ADDRS)
                .min(size_of(ACL_PORTS))
                .min(size_of(ACL_PEERS)),
            nodes: size_of(REMOTE_PODS_V4)
                .min(size_of(REMOTE_PODS_V6))
                .min(size_of(NODE_ADDRS) / 2),
        }
    }
}

/// The flag that sizes map `name`, if it is one of the sized maps.
pub fn flag_for(name: &str) -> Option<&'static str> {
    Capacities::default()
        .map_sizes()
        .into_iter()
        .find(|(map, _, _)| *map == name)
        .map(|(_, _, flag)| flag)
}

/// Whether a map write failed because the map is full (`E2BIG` from an array or preallocated
/// hash, `ENOSPC` from one allocated as used).
pub fn is_full(error: &aya::maps::MapError) -> bool {
    match error {
        aya::maps::MapError::SyscallError(error) => matches!(
            error.io_error.raw_os_error(),
            Some(libc::E2BIG) | Some(libc::ENOSPC)
        ),
        _ => false,
    }
}

/// Names a map and what was done to it in a map error: every map error of the agent is made
/// here, so that a sized map that is full always names the flag that raises it.
pub fn map_err(
    name: &'static str,
    action: &'static str,
) -> impl Fn(aya::maps::MapError) -> AgentError {
    move |source| match flag_for(name) {
        Some(flag) if is_full(&source) => AgentError::MapFull {
            name: name.into(),
            action,
            flag,
        },
        _ => AgentError::Map {
            name: name.into(),
            action,
            source,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        capacities: Capacities,
    }

    #[test]
    fn flags_default_to_the_stated_sizes_and_refuse_what_the_maps_cannot_be() {
        let defaults = Cli::try_parse_from(["x"]).expect("defaults").capacities;
        assert_eq!(defaults, Capacities::default());
        assert_eq!(defaults.backends, 262_144);
        let set = Cli::try_parse_from([
            "x",
            "--max-backends",
            "524288",
            "--max-service-ports",
            "32768",
        ])
        .expect("set")
        .capacities;
        assert_eq!((set.backends, set.service_ports), (524_288, 32_768));
        assert_eq!(
            set.map_sizes()[1],
            (LB_MAGLEV, 65_536, "--max-service-ports")
        );
        for bad in [
            ["x", "--max-backends", "2000000"],
            ["x", "--max-backends", "0"],
        ] {
            let error = Cli::try_parse_from(bad).err().expect("refused").to_string();
            assert!(error.contains("--max-backends"), "{error}");
        }
        assert_eq!(flag_for(ACL_PORTS), Some("--max-acl-entries"));
        assert_eq!(flag_for("DP_OVL_PODS"), None);
        let found = Capacities::from_map_sizes(|name| match name {
            LB_MAGLEV | LB_SOURCE_RANGES => 100,
            _ => 80,
        });
        assert_eq!((found.service_ports, found.backends), (50, 80));
        // The source ranges sized with the service ports: a smaller one lowers them too.
        let found = Capacities::from_map_sizes(|name| match name {
            LB_MAGLEV => 100,
            LB_SOURCE_RANGES => 60,
            _ => 80,
        });
        assert_eq!(found.service_ports, 30);
    }
}
