//! One node ("a") of the overlay in a namespace of the calling thread, with its maps synced:
//! the packet tests and the benchmarks run the overlay programs against it.
//!
//! Node a is 10.99.0.1 / fd99::1 on underlay veth `ul0`; node b (10.99.0.2, IPv4 underlay)
//! hosts 10.244.2.0/24 and fd00:102a:0:2::/64; node c (fd99::3, IPv6 underlay) hosts
//! 10.244.3.0/24; the local pod 10.244.1.3 sits behind `vp1`, the pod the test frames come
//! from (10.244.1.2, fd00:102a:0:1::2) behind the test runs' device. Static neighbours make
//! the FIB lookups deterministic.

use std::net::IpAddr;

use dataplane_user::{
    api::network::OvnKubernetesConfig,
    model::{LocalPodView, NodeView, OverlayView, Underlay},
    overlay::compile,
};

use crate::{
    fixture::{Fixture, TEST_RUN_IFINDEX},
    netns::ThreadNetns,
    packets::{GW_MAC, POD_MAC, SRC_V4, SRC_V6},
};

pub const UNDERLAY_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x99, 0x01];
pub const NODE_B_MAC: &str = "02:00:00:00:99:02";
pub const NODE_C_MAC: &str = "02:00:00:00:99:03";
pub const LOCAL_POD_MAC: [u8; 6] = [0x0a, 0x58, 10, 244, 1, 3];
pub const LOCAL_HOST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x01, 0x03];

/// The loaded programs with the overlay configured, inside the bed's namespace.
pub struct Bed {
    pub fixture: Fixture,
    /// What the overlay maps were compiled from (change and sync it again to move pods).
    pub view: OverlayView,
    _netns: ThreadNetns,
}

impl Bed {
    /// Runs `ip <line>` in the bed's namespace.
    pub fn ip(&self, line: &str) -> anyhow::Result<()> {
        self._netns.sh(line)
    }

    /// Adds a pod veth pair (`host` on the node's side) to the bed's namespace; returns the
    /// host side's ifindex, for a pod's view and for test runs on that device.
    pub fn add_pod_veth(&self, host: &str, pod: &str) -> anyhow::Result<u32> {
        self._netns
            .sh(&format!("link add {host} type veth peer name {pod}"))?;
        Ok(dataplane_user::kernel::preflight::interface_index(host)?)
    }
}

/// Builds the bed; the calling thread stays in its namespace until the bed drops.
pub fn bed() -> anyhow::Result<Bed> {
    let netns = ThreadNetns::enter()?;
    // A node forwards (the kernel's FIB lookup for BPF requires it on the egress device).
    for setting in [
        "net.ipv4.conf.all.forwarding=1",
        "net.ipv6.conf.all.forwarding=1",
    ] {
        netns.sysctl(setting)?;
    }
    for line in [
        "link add ul0 type veth peer name ul1",
        "link set ul0 address 02:00:00:00:99:01",
        "addr add 10.99.0.1/24 dev ul0",
        "addr add fd99::1/64 dev ul0 nodad",
        "link set ul0 up",
        "link set ul1 up",
        "neigh add 10.99.0.2 lladdr 02:00:00:00:99:02 dev ul0 nud permanent",
        "neigh add fd99::3 lladdr 02:00:00:00:99:03 dev ul0 nud permanent",
        "neigh add 10.99.0.20 lladdr 02:00:00:00:99:20 dev ul0 nud permanent",
        "link add vp1 type veth peer name pod1",
    ] {
        netns.sh(line)?;
    }
    let ifindex = dataplane_user::kernel::preflight::interface_index;
    let ip = |s: &str| s.parse::<IpAddr>().expect("address");
    let net = |s: &str| s.parse::<ipnet::IpNet>().expect("cidr");
    let view = OverlayView {
        this_node: "a".into(),
        nodes: std::sync::Arc::new(
            vec![
                std::sync::Arc::new(NodeView {
                    created: i64::MAX,
                    name: "a".into(),
                    addresses: vec![ip("10.99.0.1"), ip("fd99::1")],
                    pod_cidrs: vec![net("10.244.1.0/24"), net("fd00:102a:0:1::/64")],
                }),
                std::sync::Arc::new(NodeView {
                    created: i64::MAX,
                    name: "b".into(),
                    addresses: vec![ip("10.99.0.2")],
                    pod_cidrs: vec![net("10.244.2.0/24"), net("fd00:102a:0:2::/64")],
                }),
                std::sync::Arc::new(NodeView {
                    created: i64::MAX,
                    name: "c".into(),
                    addresses: vec![ip("fd99::3")],
                    pod_cidrs: vec![net("10.244.3.0/24")],
                }),
            ]
            .into(),
        ),
        local_pods: vec![
            LocalPodView {
                name: "default/local".into(),
                addresses: vec![ip("10.244.1.3")],
                pod_mac: LOCAL_POD_MAC,
                host_ifindex: ifindex("vp1")?,
                host_mac: LOCAL_HOST_MAC,
                takes_xdp: false,
            },
            // The pod the test frames come from (`crate::packets`), behind the device test
            // runs use.
            LocalPodView {
                name: "default/sender".into(),
                addresses: vec![IpAddr::from(SRC_V4), IpAddr::from(SRC_V6)],
                pod_mac: POD_MAC,
                host_ifindex: TEST_RUN_IFINDEX,
                host_mac: GW_MAC,
                takes_xdp: false,
            },
        ],
        unrestricted_ifindexes: Vec::new(),
        underlay: Underlay {
            ifindex: ifindex("ul0")?,
            mac: UNDERLAY_MAC,
            xdp_forward: true,
            nodeport_listed: false,
            mtu: 1500,
        },
        settings: OvnKubernetesConfig::default().validate(1500)?,
        hybrid: None,
    };
    let mut fixture = Fixture::load()?;
    fixture.sync_overlay(&compile(&view)?, None)?;
    Ok(Bed {
        fixture,
        view,
        _netns: netns,
    })
}
