//! The hybrid overlay, agent side: pods of nodes that do not run the dataplane (Windows nodes,
//! as OVN-Kubernetes' hybrid overlay has them) reached over VXLAN.
//!
//! - Settings: `ovnKubernetesConfig.hybridOverlayConfig` of the operator's `Network` (at most
//!   one `hybridClusterNetwork`, outside the cluster and service networks; the VXLAN port,
//!   default 4789, neither 0 nor the Geneve port), validated with the field named
//!   (`api::network`).
//! - Hybrid nodes: Nodes labelled `kubernetes.io/os=windows` that announce their pod subnet
//!   and router MAC in the `k8s.ovn.org/hybrid-overlay-*` annotations. A node whose
//!   annotations are missing or wrong is skipped with a warning naming it, and its routes go
//!   (`model::hybrid` makes these views).
//! - This node: its router address is the third address of its IPv4 pod subnet (never a pod's:
//!   the IPAM keeps it), its router MAC `0a:58` and that address (OVN-Kubernetes' rule), unless
//!   its Node object names another. With `--kubernetes` the agent writes both annotations on
//!   its own Node, where hybrid nodes read them.
//! - Compile (pure): the hybrid nodes' subnets become routes of kind VXLAN beside the Geneve
//!   ones (`model::hybrid::routes`, which `overlay::compile` takes), their MACs and the
//!   settings the hybrid maps (here).

use std::{collections::BTreeMap, net::IpAddr};

use aya::maps::{Array, HashMap, MapData};
use dataplane_common::{
    hybrid::{HYBRID_ENABLED, HybridConfig, HybridNode, VXLAN_OVERHEAD},
    maps,
    overlay::Addr,
};

use crate::kernel::capacity::map_err;
use crate::{
    error::AgentError,
    kernel::loader::Dataplane,
    mapsync::{SyncStats, addr16, sync_hash},
    model::HybridView,
};

/// The exact desired contents of the hybrid maps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HybridMaps {
    pub config: HybridConfig,
    pub nodes: BTreeMap<Addr, HybridNode>,
}

/// Compiles the hybrid view into the hybrid maps (all zero without one). Pure.
pub fn compile(view: Option<&HybridView>) -> HybridMaps {
    let Some(view) = view else {
        return HybridMaps::default();
    };
    HybridMaps {
        config: HybridConfig {
            vxlan_port: view.settings.vxlan_port,
            flags: HYBRID_ENABLED,
            mtu: view.underlay_mtu.saturating_sub(VXLAN_OVERHEAD),
            mgmt_ifindex: view.mgmt_ifindex,
            router_mac: view.router_mac,
            _pad: [0; 2],
        },
        nodes: view
            .nodes
            .iter()
            .map(|n| {
                (
                    addr16(IpAddr::V4(n.address)),
                    HybridNode {
                        router_mac: n.router_mac,
                        _pad: [0; 2],
                    },
                )
            })
            .collect(),
    }
}

impl Dataplane {
    /// Makes the hybrid maps equal `desired`: the nodes first, so no VXLAN route leads to a
    /// node the kernel does not know, then the settings.
    pub fn sync_hybrid(&mut self, desired: &HybridMaps) -> Result<SyncStats, AgentError> {
        let sync_err = |name: &'static str| map_err(name, "sync");
        let mut stats = SyncStats::default();
        let mut nodes: HashMap<&mut MapData, Addr, HybridNode> =
            self.typed_map(maps::HYBRID_NODES)?;
        stats.add(sync_hash(&mut nodes, &desired.nodes).map_err(sync_err(maps::HYBRID_NODES))?);
        let mut config: Array<&mut MapData, HybridConfig> = self.typed_map(maps::HYBRID_CONFIG)?;
        let current = config.get(&0, 0).map_err(sync_err(maps::HYBRID_CONFIG))?;
        if current != desired.config {
            config
                .set(0, desired.config, 0)
                .map_err(sync_err(maps::HYBRID_CONFIG))?;
            stats.written += 1;
        }
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        api::network::HybridSettings,
        model::{HybridNodeView, hybrid::routes as hybrid_routes},
    };
    use dataplane_common::overlay::{FAMILY_IPV4, TUNNEL_VXLAN, TunnelEndpoint};

    #[test]
    fn compile_gives_vxlan_routes_the_nodes_macs_and_the_vxlan_mtu() {
        let view = HybridView {
            settings: HybridSettings {
                network: None,
                host_prefix: None,
                vxlan_port: 9898,
            },
            nodes: vec![HybridNodeView {
                name: "win-a".into(),
                address: "10.99.0.20".parse().unwrap(),
                subnet: "10.132.0.0/24".parse().unwrap(),
                router_mac: [0, 0x15, 0x5d, 1, 2, 3],
            }],
            router_ip: "10.244.1.3".parse().unwrap(),
            router_mac: [0x0a, 0x58, 10, 244, 1, 3],
            underlay_mtu: 1500,
            mgmt_ifindex: 9,
        };
        let maps = compile(Some(&view));
        assert_eq!(
            maps.config,
            HybridConfig {
                vxlan_port: 9898,
                flags: HYBRID_ENABLED,
                mtu: 1450,
                mgmt_ifindex: 9,
                router_mac: [0x0a, 0x58, 10, 244, 1, 3],
                _pad: [0; 2],
            }
        );
        let node = addr16("10.99.0.20".parse().unwrap());
        assert_eq!(maps.nodes[&node].router_mac, [0, 0x15, 0x5d, 1, 2, 3]);
        let routes = hybrid_routes(Some(&view));
        assert_eq!(
            routes[&(24, [10, 132, 0, 0])],
            TunnelEndpoint {
                addr: node,
                family: FAMILY_IPV4,
                kind: TUNNEL_VXLAN,
                _pad: [0; 2],
            }
        );
        assert_eq!(routes.len(), 1);
        assert_eq!(compile(None), HybridMaps::default());
        assert!(hybrid_routes(None).is_empty());
        // With a hybrid network, the rest of it leads to no node.
        let mut with_network = view.clone();
        with_network.settings.network = Some("10.132.0.0/14".parse().unwrap());
        let routes = hybrid_routes(Some(&with_network));
        assert_eq!(routes.len(), 2);
        assert_eq!(
            routes[&(14, [10, 132, 0, 0])].addr,
            addr16("0.0.0.0".parse().unwrap())
        );
    }
}
