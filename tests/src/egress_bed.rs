//! Egress IP maps for the overlay bed ([`crate::overlay_bed`]): the pod the test frames come
//! from (10.244.1.2 and fd00:102a:0:1::2, namespace `default`) selected by one EgressIP whose
//! addresses 10.99.0.50 and fd99::50 are held by this node (a), by node b, or by nobody yet.
//! Compiled by the agent's own code.

use std::collections::{BTreeMap, BTreeSet};

use dataplane_user::{
    acl::pods::PolicyPod,
    api::egressip::{EgressIP, EgressIpSpec, EgressIpStatus, EgressIpStatusItem},
    egressip::compile::{EgressInputs, EgressMaps, compile},
    model::OverlayView,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::packets::{SRC_V4, SRC_V6};

pub const EGRESS_IP: [u8; 4] = [10, 99, 0, 50];
/// The object's IPv6 address, held by the same node (fd99::50).
pub const EGRESS_IP6: [u8; 16] = [0xfd, 0x99, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x50];

/// Who holds the egress address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holder {
    /// This node: it translates and sends the packet out of its underlay.
    Here,
    /// Node b: this node sends the packet there through Geneve.
    NodeB,
    /// No node yet: the selected pod's packets out are dropped.
    Nobody,
    /// No EgressIP at all: the maps are empty.
    NoEgressIp,
}

/// The egress maps of node a for `holder`.
pub fn egress_maps(view: &OverlayView, holder: Holder) -> EgressMaps {
    if holder == Holder::NoEgressIp {
        return EgressMaps::default();
    }
    let address = std::net::Ipv4Addr::from(EGRESS_IP).to_string();
    let address6 = std::net::Ipv6Addr::from(EGRESS_IP6).to_string();
    let mut object = EgressIP::new(
        "bench",
        EgressIpSpec {
            egress_ips: vec![address.clone(), address6.clone()],
            namespace_selector: LabelSelector {
                match_labels: Some(BTreeMap::from([(
                    "kubernetes.io/metadata.name".to_owned(),
                    "default".to_owned(),
                )])),
                ..Default::default()
            },
            pod_selector: None,
        },
    );
    let node = match holder {
        Holder::Here => Some("a"),
        Holder::NodeB => Some("b"),
        Holder::Nobody | Holder::NoEgressIp => None,
    };
    object.status = Some(EgressIpStatus {
        items: node
            .into_iter()
            .flat_map(|node| {
                [address.clone(), address6.clone()].map(|egress_ip| EgressIpStatusItem {
                    node: node.to_owned(),
                    egress_ip,
                })
            })
            .collect(),
    });
    let inputs = EgressInputs {
        objects: vec![std::sync::Arc::new(object)],
        pods: vec![PolicyPod {
            namespace: "default".into(),
            name: "sender".into(),
            labels: BTreeMap::new(),
            addresses: vec![
                std::net::IpAddr::from(SRC_V4),
                std::net::IpAddr::from(SRC_V6),
            ],
            named_ports: BTreeMap::new(),
        }]
        .into_iter()
        .collect(),
        namespaces: Vec::new(),
        nodes: view.nodes.clone(),
        cluster_networks: vec![
            "10.244.0.0/16".parse().expect("cidr"),
            "fd00:102a::/48".parse().expect("cidr"),
        ],
        service_networks: vec!["10.96.0.0/16".parse().expect("cidr")],
        this_node: view.this_node.clone(),
        local_pods: BTreeSet::from(["default/sender".to_owned()]),
    };
    compile(&inputs, |_| true)
}
