//! Pod port security, agent side: the addresses each local pod may send as and be sent to,
//! compiled from the pods this node runs (pure) into the records the kernel keys by the pod's
//! host-side veth. Written with the overlay's maps (`Dataplane::sync_overlay`), before the
//! pods' addresses, so no pod is ever reachable without its record.

use std::{collections::BTreeMap, net::IpAddr};

use aya::maps::{HashMap, MapData};
use dataplane_common::{
    maps,
    port::{PORT_HAS_IPV4, PORT_HAS_IPV6, PORT_UNRESTRICTED, PodPort, link_local_of},
};

use crate::kernel::capacity::map_err;
use crate::{error::AgentError, kernel::loader::Dataplane, model::LocalPodView};

/// One record per local pod, keyed by the ifindex of its host-side veth: its MAC, its first
/// IPv4 and first IPv6 address (a pod has one of each at most), and the link-local address
/// its kernel derives from the MAC.
pub fn compile(pods: &[LocalPodView]) -> BTreeMap<u32, PodPort> {
    pods.iter()
        .map(|pod| (pod.host_ifindex, pod_port(pod)))
        .collect()
}

/// The record of a veth no pod is known behind (`PORT_UNRESTRICTED`): an interface the
/// operator named with `--pod-iface` that no Pod of the cluster state claims. The programs
/// attached to it let through what the pod sends and receives as they did before port
/// security; the agent says so in its log.
pub fn unrestricted() -> PodPort {
    PodPort {
        flags: PORT_UNRESTRICTED,
        ..PodPort::default()
    }
}

impl Dataplane {
    /// Writes `ports` into the port-security map, leaving other records alone (the overlay's
    /// sync owns the map when a cluster is followed; this is for interfaces named without one).
    pub fn write_ports(&mut self, ports: &BTreeMap<u32, PodPort>) -> Result<(), AgentError> {
        let mut map: HashMap<&mut MapData, u32, PodPort> = self.typed_map(maps::POD_PORTS)?;
        for (ifindex, port) in ports {
            map.insert(ifindex, port, 0)
                .map_err(map_err(maps::POD_PORTS, "write"))?;
        }
        Ok(())
    }
}

fn pod_port(pod: &LocalPodView) -> PodPort {
    let mut port = PodPort {
        mac: pod.pod_mac,
        ipv6_link_local: link_local_of(pod.pod_mac),
        ..PodPort::default()
    };
    for address in &pod.addresses {
        match address {
            IpAddr::V4(v4) if port.flags & PORT_HAS_IPV4 == 0 => {
                port.ipv4 = v4.octets();
                port.flags |= PORT_HAS_IPV4;
            }
            IpAddr::V6(v6) if port.flags & PORT_HAS_IPV6 == 0 => {
                port.ipv6 = v6.octets();
                port.flags |= PORT_HAS_IPV6;
            }
            _ => {}
        }
    }
    port
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(addresses: &[&str], ifindex: u32) -> LocalPodView {
        LocalPodView {
            name: format!("ns/pod{ifindex}"),
            addresses: addresses.iter().map(|a| a.parse().unwrap()).collect(),
            pod_mac: [0x0a, 0x58, 10, 244, 1, ifindex as u8],
            host_ifindex: ifindex,
            host_mac: [0xee; 6],
            takes_xdp: false,
        }
    }

    #[test]
    fn each_pod_gets_its_mac_addresses_and_link_local_under_its_veth() {
        let ports = compile(&[
            pod(&["10.244.1.7", "fd00:10:244:1::7"], 7),
            pod(&["10.244.1.8"], 8),
            pod(&["fd00:10:244:1::9"], 9),
        ]);
        assert_eq!(ports.len(), 3);
        let dual = ports[&7];
        assert_eq!(dual.mac, [0x0a, 0x58, 10, 244, 1, 7]);
        assert_eq!(dual.flags, PORT_HAS_IPV4 | PORT_HAS_IPV6);
        assert_eq!(dual.ipv4, [10, 244, 1, 7]);
        assert_eq!(
            dual.ipv6,
            "fd00:10:244:1::7"
                .parse::<std::net::Ipv6Addr>()
                .unwrap()
                .octets()
        );
        assert_eq!(
            dual.ipv6_link_local,
            "fe80::858:aff:fef4:107"
                .parse::<std::net::Ipv6Addr>()
                .unwrap()
                .octets()
        );
        assert_eq!(ports[&8].flags, PORT_HAS_IPV4);
        assert_eq!(ports[&8].ipv6, [0; 16]);
        assert_eq!(ports[&9].flags, PORT_HAS_IPV6);
        assert_eq!(ports[&9].ipv4, [0; 4]);
    }
}
