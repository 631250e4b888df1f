//! Every stage's pure compile, run as one node's agent runs it but without the kernel or the
//! host: the model and the overlay, the Services, NetworkPolicies, admin policies and
//! EgressFirewalls, egress IPs, multicast; with every refusal line the stages give. What the
//! property tests (one bad object fails alone) and the object fuzzer (`cargo xtask fuzz`)
//! drive: each stage's output in a comparable form.

use std::{collections::BTreeMap, net::IpAddr};

use crate::{
    acl::{
        admin::validate_all,
        firewall::{DnsAddresses, compile_firewalls, context},
        pods::{PolicyPods, namespace_labels},
        policy::policy_sets,
        select::PolicyCluster,
    },
    api::{adminpolicy::AdminObjects, network::OvnKubernetesConfig},
    egressip::compile::{EgressInputs, compile as compile_egress},
    lb::{self, AddressPolicy},
    model::Underlay,
    model::{self, HostInterface, HostedPods},
    multicast, overlay,
    source::ClusterState,
};

/// A policy set's prefix lengths (IPv4, IPv6), prefix count and table count.
type SetShape = (Vec<u8>, Vec<u8>, usize, usize);

/// What every stage compiles the cluster to, in comparable form.
#[derive(Debug, PartialEq)]
pub struct Desired {
    pub overlay: String,
    pub services: String,
    pub policies: String,
    pub firewalls: String,
    pub admin: String,
    pub egress: String,
    pub multicast: String,
}

/// Runs every stage's compile on `state` as the agent on node `node` would (each of its pods
/// behind a veth of its own); what each stage refused, too. `None` when `node` is not among
/// the cluster's nodes (the agent refuses to sync then).
pub fn compile_node(state: &ClusterState, node: &str) -> Option<(Desired, Vec<String>)> {
    let mut refused: Vec<String> = state.rejected.clone();
    let underlay = Underlay {
        ifindex: 2,
        mac: [2, 0, 0, 0, 0, 1],
        xdp_forward: false,
        nodeport_listed: false,
        mtu: 1500,
    };
    let settings = state
        .network
        .unwrap_or_default()
        .validate(1500)
        .unwrap_or_else(|_| OvnKubernetesConfig::default().validate(1500).unwrap());
    // Every local pod address behind a veth of its own, numbered from the address.
    let interface = |ip: IpAddr| {
        let index = match ip {
            IpAddr::V4(v4) => u32::from(v4) & 0xFFFF,
            IpAddr::V6(v6) => (u128::from(v6) & 0xFFFF) as u32,
        };
        Some(HostInterface {
            name: format!("vp{index}"),
            ifindex: 10 + index,
            mac: [2, 0, 0, 0, (index >> 8) as u8, index as u8],
            takes_xdp: false,
        })
    };
    let hosted = HostedPods::from_pods(&state.pods, node);
    let mut model = model::build(state, &hosted, None, node, underlay, settings, interface);
    refused.extend(model.warnings.iter().cloned());
    let overlay = overlay::compile(&model.view).ok()?;
    refused.extend(overlay.node_maps.rejected.values().cloned());
    overlay.node_maps.drop_rejected_from(&mut model.view);

    let services = lb::compile_services(
        &state.services,
        &state.endpoint_slices,
        &lb::LocalNode::from_nodes(&state.nodes, node),
        &AddressPolicy::default(),
    );
    refused.extend(services.errors.iter().cloned());

    let pods = PolicyPods::from_pods(&state.pods);
    let local: Vec<String> = model
        .view
        .local_pods
        .iter()
        .map(|p| p.name.clone())
        .collect();
    let labels = namespace_labels(&state.namespaces);
    let cluster = PolicyCluster::new(&pods, &labels);
    let admin_objects = AdminObjects {
        admin: state.admin_network_policies.to_vec(),
        baseline: state.baseline_admin_network_policies.to_vec(),
        cluster: state.cluster_network_policies.to_vec(),
    };
    let admin = validate_all(&admin_objects, &mut BTreeMap::new());
    refused.extend(admin.errors.iter().cloned());
    let policies = policy_sets(
        &state.network_policies.to_vec(),
        &cluster,
        &local,
        &BTreeMap::new(),
        &admin.policies,
    );
    refused.extend(policies.errors.iter().cloned());
    let firewalls = compile_firewalls(
        &state.egress_firewalls.to_vec(),
        &context(state, &model.view),
        &DnsAddresses::new(),
    );
    refused.extend(firewalls.errors.iter().cloned());
    let inputs = EgressInputs::from_state(state, state.egress_ips.to_vec(), &pods, &model);
    let egress = compile_egress(&inputs, |_| true);
    let plan = multicast::plan(state, &model.view);
    refused.extend(plan.errors.iter().cloned());

    // Each set's lengths and sizes (its whole decisions are in the egress and firewall
    // comparisons' kind of detail elsewhere; a set's name is the hash of its rules).
    let sets: BTreeMap<&String, SetShape> = policies
        .sets
        .iter()
        .map(|(name, set)| {
            let c = &set.compiled;
            (
                name,
                (
                    c.v4_lengths.clone(),
                    c.v6_lengths.clone(),
                    c.prefixes.len(),
                    c.tables.len(),
                ),
            )
        })
        .collect();
    let desired = Desired {
        overlay: format!(
            "{:?} {:?} {:?} {:?}",
            overlay.node_maps.remote_v4,
            overlay.node_maps.remote_v6,
            overlay.node_maps.node_addrs,
            overlay.local_pods
        ),
        services: format!("{:?}", services.ports),
        policies: format!("{:?} {sets:?}", policies.pods),
        firewalls: format!("{:?}", firewalls.desired.sets),
        admin: format!("{:?}", admin.policies),
        egress: format!("{egress:?}"),
        multicast: format!("{:?} {:?}", plan.namespaces, plan.pods),
    };
    Some((desired, refused))
}
