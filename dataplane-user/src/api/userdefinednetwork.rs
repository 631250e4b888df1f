//! OVN-Kubernetes' user-defined networks (`k8s.ovn.org/v1`): `UserDefinedNetwork` (a
//! namespace's own network) and `ClusterUserDefinedNetwork` (one network for the namespaces a
//! selector picks), as the API serves them, and what their validation checks beyond the API
//! server's schema. The CRDs under `deploy/crds/` are generated from these types; the schema
//! carries the upstream limits and rules (the topology and its section go together, the
//! network is immutable, CIDRs of two families at most), so that the API server refuses what
//! it can, and [`validate_udn`] / [`validate_cudn`] check the rest with the field named.
//!
//! This dataplane carries primary networks of topology Layer3 or Layer2. Secondary networks
//! and the Localnet topology are refused by name: the schema has no Localnet topology, and a
//! `Secondary` role fails validation.

use std::{collections::BTreeMap, net::IpAddr};

use ipnet::IpNet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{
    CustomResource, KubeSchema,
    core::{Selector, SelectorExt as _},
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::egressip::validate_selector;

/// The namespace label upstream requires, set when the namespace is made, for its pods to
/// take a primary user-defined network instead of the default one.
pub const PRIMARY_NETWORK_LABEL: &str = "k8s.ovn.org/primary-user-defined-network";

/// The MTU of a network that sets none: OVN-Kubernetes' default.
pub const DEFAULT_MTU: u32 = 1400;

/// `spec` of a UserDefinedNetwork: the network of the namespace it is in.
#[derive(CustomResource, KubeSchema, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[kube(
    group = "k8s.ovn.org",
    version = "v1",
    kind = "UserDefinedNetwork",
    plural = "userdefinednetworks",
    namespaced,
    status = "NetworkStatus",
    shortname = "udn",
    derive = "PartialEq",
    printcolumn = r#"{"name":"Topology","type":"string","jsonPath":".spec.topology"}"#,
    printcolumn = r#"{"name":"Created","type":"string","jsonPath":".status.conditions[?(@.type==\"NetworkCreated\")].status"}"#
)]
#[x_kube(validation = Rule::new("self == oldSelf").message("Spec is immutable"))]
#[x_kube(validation = Rule::new("self.topology == 'Layer3' ? has(self.layer3) : !has(self.layer3)").message("spec.layer3 is required when topology is Layer3 and forbidden otherwise"))]
#[x_kube(validation = Rule::new("self.topology == 'Layer2' ? has(self.layer2) : !has(self.layer2)").message("spec.layer2 is required when topology is Layer2 and forbidden otherwise"))]
#[serde(rename_all = "camelCase")]
pub struct UserDefinedNetworkSpec {
    /// `Layer3`: each node routes its own slice of the subnets; `Layer2`: one segment
    /// stretched over every node.
    pub topology: Topology,
    /// The Layer3 topology's settings (exactly when `topology` is `Layer3`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer3: Option<Layer3Config>,
    /// The Layer2 topology's settings (exactly when `topology` is `Layer2`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer2: Option<Layer2Config>,
}

/// `spec` of a ClusterUserDefinedNetwork: one network for every namespace its selector picks.
#[derive(CustomResource, KubeSchema, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[kube(
    group = "k8s.ovn.org",
    version = "v1",
    kind = "ClusterUserDefinedNetwork",
    plural = "clusteruserdefinednetworks",
    status = "NetworkStatus",
    shortname = "cudn",
    derive = "PartialEq",
    printcolumn = r#"{"name":"Topology","type":"string","jsonPath":".spec.network.topology"}"#,
    printcolumn = r#"{"name":"Created","type":"string","jsonPath":".status.conditions[?(@.type==\"NetworkCreated\")].status"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterUserDefinedNetworkSpec {
    /// The namespaces the network is for (those of them labelled for a primary network).
    pub namespace_selector: LabelSelector,
    /// The network; immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("Network spec is immutable"))]
    pub network: NetworkSpec,
}

/// `spec.network` of a ClusterUserDefinedNetwork: the same choices as a UserDefinedNetwork's.
#[derive(KubeSchema, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[x_kube(validation = Rule::new("self.topology == 'Layer3' ? has(self.layer3) : !has(self.layer3)").message("spec.network.layer3 is required when topology is Layer3 and forbidden otherwise"))]
#[x_kube(validation = Rule::new("self.topology == 'Layer2' ? has(self.layer2) : !has(self.layer2)").message("spec.network.layer2 is required when topology is Layer2 and forbidden otherwise"))]
#[serde(rename_all = "camelCase")]
pub struct NetworkSpec {
    pub topology: Topology,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer3: Option<Layer3Config>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer2: Option<Layer2Config>,
}

/// `topology` of a network.
#[derive(JsonSchema, Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub enum Topology {
    #[default]
    Layer3,
    Layer2,
}

/// `role` of a network in its pods.
#[derive(JsonSchema, Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub enum Role {
    /// The pods' own network, in place of the default one.
    #[default]
    Primary,
    /// An extra interface for the pods that ask for it (not carried by this dataplane yet).
    Secondary,
}

/// `layer3`: each node gets a slice (`hostSubnet` long) of each subnet and routes it.
#[derive(KubeSchema, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[x_kube(validation = Rule::new("!has(self.joinSubnets) || self.role == 'Primary'").message("JoinSubnets is only supported for Primary network"))]
#[serde(rename_all = "camelCase")]
pub struct Layer3Config {
    pub role: Role,
    /// The pods' MTU (1400 when unset); at least 1280 with an IPv6 subnet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 576, max = 65536))]
    pub mtu: Option<u32>,
    /// The network's address ranges, split into node slices.
    #[schemars(length(min = 1, max = 400))]
    pub subnets: Vec<Layer3Subnet>,
    /// The ranges of the network's internal router links (one per family); the platform
    /// chooses when unset.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(min = 1, max = 2), inner(length(max = 43)))]
    pub join_subnets: Vec<String>,
}

/// One of `layer3.subnets`.
#[derive(KubeSchema, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Layer3Subnet {
    /// The range, in CIDR notation.
    #[schemars(length(max = 43))]
    pub cidr: String,
    /// The prefix length of each node's slice (24 for IPv4 and 64 for IPv6 when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 127))]
    pub host_subnet: Option<u8>,
}

/// `layer2`: one segment over every node, its addresses shared by all of them.
#[derive(KubeSchema, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[x_kube(validation = Rule::new("!has(self.joinSubnets) || self.role == 'Primary'").message("JoinSubnets is only supported for Primary network"))]
#[x_kube(validation = Rule::new("self.role != 'Primary' || has(self.subnets)").message("Subnets is required for Primary Layer2 topology"))]
#[x_kube(validation = Rule::new("!has(self.reservedSubnets) || self.role == 'Primary'").message("reservedSubnets is only supported for Primary network"))]
#[x_kube(validation = Rule::new("!has(self.infrastructureSubnets) || self.role == 'Primary'").message("infrastructureSubnets is only supported for Primary network"))]
#[x_kube(validation = Rule::new("!has(self.defaultGatewayIPs) || self.role == 'Primary'").message("defaultGatewayIPs is only supported for Primary network"))]
#[x_kube(validation = Rule::new("!has(self.reservedSubnets) && !has(self.infrastructureSubnets) || has(self.subnets)").message("reservedSubnets and infrastructureSubnets must be unset when subnets is unset"))]
#[x_kube(validation = Rule::new("!has(self.ipam) || has(self.ipam.mode) || has(self.ipam.lifecycle)").message("ipam must set mode or lifecycle"))]
#[x_kube(validation = Rule::new("!has(self.ipam) || !has(self.ipam.lifecycle) || !has(self.ipam.mode) || self.ipam.mode == 'Enabled'").message("lifecycle Persistent is only supported when ipam.mode is Enabled"))]
#[serde(rename_all = "camelCase")]
pub struct Layer2Config {
    pub role: Role,
    /// The pods' MTU (1400 when unset); at least 1280 with an IPv6 subnet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 576, max = 65536))]
    pub mtu: Option<u32>,
    /// The network's address ranges, one per family.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(min = 1, max = 2), inner(length(max = 43)))]
    pub subnets: Vec<String>,
    /// As for Layer3.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(min = 1, max = 2), inner(length(max = 43)))]
    pub join_subnets: Vec<String>,
    /// Ranges within `subnets` left out of automatic allocation (kept for addresses pods
    /// ask for by name).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(min = 1, max = 25), inner(length(max = 43)))]
    pub reserved_subnets: Vec<String>,
    /// Ranges within `subnets` kept for the network's own infrastructure (its gateway, its
    /// routers' ports), never given to workloads.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(min = 1, max = 4), inner(length(max = 43)))]
    pub infrastructure_subnets: Vec<String>,
    /// The pods' default gateway, one per family, within `subnets` (and within
    /// `infrastructureSubnets` when those are set); an address of `subnets` when unset.
    #[serde(
        default,
        rename = "defaultGatewayIPs",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(length(min = 1, max = 2), inner(length(max = 39)))]
    pub default_gateway_ips: Vec<String>,
    /// How addresses are managed on the network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipam: Option<IpamConfig>,
}

/// `layer2.ipam`.
#[derive(JsonSchema, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct IpamConfig {
    /// Who gives the pods their addresses (`Enabled` when unset): `Enabled`, `Disabled` or
    /// `DHCP`.
    // Both described as strings with a pattern: the generator's form of an optional enum
    // puts `null` among the values, which the API server may refuse.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>", regex(pattern = r"^(Enabled|Disabled|DHCP)$"))]
    pub mode: Option<IpamMode>,
    /// `Persistent`: a virtual machine's address outlives its pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>", regex(pattern = r"^Persistent$"))]
    pub lifecycle: Option<IpamLifecycle>,
}

/// `ipam.mode`.
#[derive(JsonSchema, Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub enum IpamMode {
    /// The network allocates the pods' addresses from its subnets.
    Enabled,
    /// Layer 2 only; the pods configure their own addresses (Secondary networks upstream).
    Disabled,
    /// A DHCP server on the physical network (Localnet networks upstream).
    #[serde(rename = "DHCP")]
    Dhcp,
}

/// `ipam.lifecycle`.
#[derive(JsonSchema, Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub enum IpamLifecycle {
    Persistent,
}

/// `status` of both kinds: conditions, `NetworkCreated` first among them.
#[derive(JsonSchema, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct NetworkStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// A network's settings once validated: what the dataplane would carry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidNetwork {
    pub topology: Topology,
    pub mtu: u32,
    /// The subnets with each node slice's prefix length (Layer2: the subnet's own).
    pub subnets: Vec<(IpNet, u8)>,
    pub join_subnets: Vec<IpNet>,
}

/// Checks a UserDefinedNetwork beyond its schema; the error names the field.
pub fn validate_udn(object: &UserDefinedNetwork) -> Result<ValidNetwork, String> {
    validate_network(
        "spec",
        object.spec.topology,
        object.spec.layer3.as_ref(),
        object.spec.layer2.as_ref(),
    )
}

/// Checks a ClusterUserDefinedNetwork beyond its schema; the error names the field.
pub fn validate_cudn(object: &ClusterUserDefinedNetwork) -> Result<ValidNetwork, String> {
    validate_selector(&object.spec.namespace_selector)
        .map_err(|what| format!("spec.namespaceSelector: {what}"))?;
    let network = &object.spec.network;
    validate_network(
        "spec.network",
        network.topology,
        network.layer3.as_ref(),
        network.layer2.as_ref(),
    )
}

fn validate_network(
    at: &str,
    topology: Topology,
    layer3: Option<&Layer3Config>,
    layer2: Option<&Layer2Config>,
) -> Result<ValidNetwork, String> {
    match (topology, layer3, layer2) {
        (Topology::Layer3, Some(config), None) => validate_layer3(&format!("{at}.layer3"), config),
        (Topology::Layer2, None, Some(config)) => validate_layer2(&format!("{at}.layer2"), config),
        (Topology::Layer3, _, _) => Err(format!(
            "{at}: topology Layer3 takes a layer3 section and no layer2 section"
        )),
        (Topology::Layer2, _, _) => Err(format!(
            "{at}: topology Layer2 takes a layer2 section and no layer3 section"
        )),
    }
}

fn validate_layer3(at: &str, config: &Layer3Config) -> Result<ValidNetwork, String> {
    primary_only(at, config.role, !config.join_subnets.is_empty())?;
    if config.subnets.is_empty() {
        return Err(format!("{at}.subnets: at least one subnet is required"));
    }
    let mut subnets = Vec::new();
    for (i, subnet) in config.subnets.iter().enumerate() {
        let field = format!("{at}.subnets[{i}]");
        let cidr = parse_cidr(&format!("{field}.cidr"), &subnet.cidr)?;
        let longest = if cidr.addr().is_ipv4() { 31 } else { 127 };
        let host = subnet
            .host_subnet
            .unwrap_or(if cidr.addr().is_ipv4() { 24 } else { 64 });
        if host <= cidr.prefix_len() || host > longest {
            return Err(format!(
                "{field}.hostSubnet: {host} must be longer than the subnet's prefix /{} and at most {longest}",
                cidr.prefix_len()
            ));
        }
        if let Some(j) = subnets.iter().position(|(other, _)| overlap(other, &cidr)) {
            return Err(format!(
                "{field}.cidr: {cidr} overlaps {at}.subnets[{j}]; subnets must not overlap or contain each other"
            ));
        }
        subnets.push((cidr, host));
    }
    finish(
        at,
        Topology::Layer3,
        config.mtu,
        subnets,
        &config.join_subnets,
    )
}

fn validate_layer2(at: &str, config: &Layer2Config) -> Result<ValidNetwork, String> {
    primary_only(at, config.role, !config.join_subnets.is_empty())?;
    if config.subnets.is_empty() {
        return Err(format!(
            "{at}.subnets: a primary Layer2 network needs its subnets"
        ));
    }
    let cidrs = dual_stack(&format!("{at}.subnets"), &config.subnets)?;
    validate_ipam(at, config.ipam.as_ref())?;
    let reserved = within_subnets(
        &format!("{at}.reservedSubnets"),
        &config.reserved_subnets,
        &cidrs,
    )?;
    let infrastructure = within_subnets(
        &format!("{at}.infrastructureSubnets"),
        &config.infrastructure_subnets,
        &cidrs,
    )?;
    if let Some((i, j)) = infrastructure.iter().enumerate().find_map(|(i, infra)| {
        reserved
            .iter()
            .position(|r| overlap(infra, r))
            .map(|j| (i, j))
    }) {
        return Err(format!(
            "{at}.infrastructureSubnets[{i}]: overlaps {at}.reservedSubnets[{j}]; the two must not overlap"
        ));
    }
    validate_gateways(at, &config.default_gateway_ips, &cidrs, &infrastructure)?;
    let subnets = cidrs.into_iter().map(|c| (c, c.prefix_len())).collect();
    finish(
        at,
        Topology::Layer2,
        config.mtu,
        subnets,
        &config.join_subnets,
    )
}

/// `ipam` as upstream takes it for a primary Layer2 network: addresses managed by the network
/// (`Enabled`, the default), persistent or not.
fn validate_ipam(at: &str, ipam: Option<&IpamConfig>) -> Result<(), String> {
    let Some(ipam) = ipam else {
        return Ok(());
    };
    match (ipam.mode, ipam.lifecycle) {
        (None, None) => Err(format!(
            "{at}.ipam: set mode or lifecycle, or leave ipam out"
        )),
        (Some(IpamMode::Disabled), _) => Err(format!(
            "{at}.ipam.mode: Disabled is only supported for a Secondary network"
        )),
        (Some(IpamMode::Dhcp), _) => Err(format!(
            "{at}.ipam.mode: DHCP is not supported for the Layer2 topology (upstream's Localnet only)"
        )),
        (Some(IpamMode::Enabled) | None, _) => Ok(()),
    }
}

/// `reservedSubnets` or `infrastructureSubnets`: masked CIDRs (no host bits), each within
/// one of the network's subnets.
fn within_subnets(field: &str, texts: &[String], subnets: &[IpNet]) -> Result<Vec<IpNet>, String> {
    let mut out = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let item = format!("{field}[{i}]");
        let cidr = parse_cidr(&item, text)?;
        if text.parse::<IpNet>().is_ok_and(|raw| raw != cidr) {
            return Err(format!(
                "{item}: {text} has host bits set; it must be a masked network address ({cidr})"
            ));
        }
        if !subnets.iter().any(|subnet| subnet.contains(&cidr)) {
            return Err(format!(
                "{item}: {cidr} is not within the network's subnets"
            ));
        }
        out.push(cidr);
    }
    Ok(out)
}

/// `defaultGatewayIPs`: one address for each subnet's family, each within its subnet and,
/// where infrastructure subnets are set, within one of them.
fn validate_gateways(
    at: &str,
    texts: &[String],
    subnets: &[IpNet],
    infrastructure: &[IpNet],
) -> Result<(), String> {
    if texts.is_empty() {
        return Ok(());
    }
    let field = format!("{at}.defaultGatewayIPs");
    if texts.len() != subnets.len() {
        return Err(format!(
            "{field}: one address for each IP family of the subnets ({} subnets, {} addresses)",
            subnets.len(),
            texts.len()
        ));
    }
    for (i, text) in texts.iter().enumerate() {
        let item = format!("{field}[{i}]");
        let ip: IpAddr = text
            .parse()
            .map_err(|_| format!("{item}: {text:?} is not an IP address"))?;
        if !subnets.iter().any(|subnet| subnet.contains(&ip)) {
            return Err(format!("{item}: {ip} is not within the network's subnets"));
        }
        if !infrastructure.is_empty() && !infrastructure.iter().any(|infra| infra.contains(&ip)) {
            return Err(format!(
                "{item}: {ip} is not within {at}.infrastructureSubnets, where the gateway must be when they are set"
            ));
        }
    }
    Ok(())
}

/// The checks both topologies share: the join subnets and the MTU against the families.
fn finish(
    at: &str,
    topology: Topology,
    mtu: Option<u32>,
    subnets: Vec<(IpNet, u8)>,
    join_subnets: &[String],
) -> Result<ValidNetwork, String> {
    let join_subnets = if join_subnets.is_empty() {
        Vec::new()
    } else {
        dual_stack(&format!("{at}.joinSubnets"), join_subnets)?
    };
    if let Some((j, (i, _))) = join_subnets.iter().enumerate().find_map(|(j, join)| {
        subnets
            .iter()
            .enumerate()
            .find(|(_, (subnet, _))| overlap(subnet, join))
            .map(|found| (j, found))
    }) {
        return Err(format!("{at}.joinSubnets[{j}]: overlaps {at}.subnets[{i}]"));
    }
    let mtu = mtu.unwrap_or(DEFAULT_MTU);
    if !(576..=65536).contains(&mtu) {
        return Err(format!("{at}.mtu: {mtu} is not within 576-65536"));
    }
    if mtu < 1280 && subnets.iter().any(|(s, _)| s.addr().is_ipv6()) {
        return Err(format!(
            "{at}.mtu: {mtu} is under 1280, the least an IPv6 subnet takes"
        ));
    }
    Ok(ValidNetwork {
        topology,
        mtu,
        subnets,
        join_subnets,
    })
}

/// Secondary networks are refused by name; join subnets need a primary network anyway.
fn primary_only(at: &str, role: Role, has_join_subnets: bool) -> Result<(), String> {
    match role {
        Role::Primary => Ok(()),
        Role::Secondary if has_join_subnets => Err(format!(
            "{at}.joinSubnets: only a Primary network takes join subnets"
        )),
        Role::Secondary => Err(format!(
            "{at}.role: Secondary networks are not carried by this dataplane yet (only Primary)"
        )),
    }
}

/// One or two CIDRs, two only of different families.
fn dual_stack(field: &str, texts: &[String]) -> Result<Vec<IpNet>, String> {
    if texts.len() > 2 {
        return Err(format!("{field}: at most two, one per IP family"));
    }
    let cidrs: Vec<IpNet> = texts
        .iter()
        .enumerate()
        .map(|(i, text)| parse_cidr(&format!("{field}[{i}]"), text))
        .collect::<Result<_, _>>()?;
    if let [a, b] = cidrs.as_slice()
        && a.addr().is_ipv4() == b.addr().is_ipv4()
    {
        return Err(format!(
            "{field}: when two are set they must be of different IP families"
        ));
    }
    Ok(cidrs)
}

/// A CIDR as the API server's `isCIDR` takes it (host bits may be set; the network is
/// what counts), and not one a pod network cannot be.
fn parse_cidr(field: &str, text: &str) -> Result<IpNet, String> {
    let cidr: IpNet = text
        .parse()
        .map_err(|_| format!("{field}: {text:?} is not a CIDR"))?;
    let cidr = cidr.trunc();
    let unusable = match cidr.addr() {
        IpAddr::V4(a) => a.is_loopback() || a.is_multicast() || a.is_broadcast(),
        IpAddr::V6(a) => a.is_loopback() || a.is_multicast(),
    } || cidr.addr().is_unspecified() && cidr.prefix_len() == 0;
    if unusable {
        return Err(format!("{field}: {cidr} cannot hold pod addresses"));
    }
    Ok(cidr)
}

/// The join subnets of a primary network that sets none: upstream's defaults.
pub const DEFAULT_JOIN_SUBNETS: [&str; 2] = ["100.65.0.0/16", "fd99::/64"];

/// Ranges of the default network that a user-defined network's subnets and join subnets must
/// stay clear of, as upstream's defaults have them: (what, CIDR, Layer3 only). The pod
/// gateway this dataplane gives every pod (169.254.1.1) lies in the masquerade subnet.
pub const RESERVED_SUBNETS: [(&str, &str, bool); 6] = [
    ("the default network's join subnet", "100.64.0.0/16", false),
    ("the default network's join subnet", "fd98::/64", false),
    ("the masquerade subnet", "169.254.0.0/17", false),
    ("the masquerade subnet", "fd69::/112", false),
    ("the transit subnet", "100.88.0.0/16", true),
    ("the transit subnet", "fd97::/64", true),
];

/// Checks a valid network (`at` its spec's path: `spec`, or `spec.network` of a
/// ClusterUserDefinedNetwork) against the cluster's own ranges, as upstream does before it
/// makes a network: no subnet or join subnet (the defaults where none are set) may overlap a
/// cluster network, a service network or a reserved range; the error names the field and
/// the range.
pub fn clear_of_cluster(
    at: &str,
    network: &ValidNetwork,
    cluster_networks: &[IpNet],
    service_networks: &[IpNet],
) -> Result<(), String> {
    let section = match network.topology {
        Topology::Layer3 => "layer3",
        Topology::Layer2 => "layer2",
    };
    let mut taken: Vec<(String, IpNet)> = Vec::new();
    taken.extend(
        cluster_networks
            .iter()
            .map(|n| (format!("the cluster network {n}"), *n)),
    );
    taken.extend(
        service_networks
            .iter()
            .map(|n| (format!("the service network {n}"), *n)),
    );
    for (what, cidr, layer3_only) in RESERVED_SUBNETS {
        if layer3_only && network.topology != Topology::Layer3 {
            continue;
        }
        if let Ok(cidr) = cidr.parse::<IpNet>() {
            taken.push((format!("{what} {cidr}"), cidr));
        }
    }
    let subnet_field = |i: usize| match network.topology {
        Topology::Layer3 => format!("{at}.{section}.subnets[{i}].cidr"),
        Topology::Layer2 => format!("{at}.{section}.subnets[{i}]"),
    };
    let join_subnets: Vec<(String, IpNet)> = if network.join_subnets.is_empty() {
        DEFAULT_JOIN_SUBNETS
            .iter()
            .filter_map(|cidr| cidr.parse().ok())
            .map(|cidr| {
                (
                    format!("the default join subnet {cidr} (no {at}.{section}.joinSubnets set)"),
                    cidr,
                )
            })
            .collect()
    } else {
        network
            .join_subnets
            .iter()
            .enumerate()
            .map(|(i, cidr)| (format!("{at}.{section}.joinSubnets[{i}]"), *cidr))
            .collect()
    };
    let own = network
        .subnets
        .iter()
        .enumerate()
        .map(|(i, (cidr, _))| (subnet_field(i), *cidr))
        .chain(join_subnets.iter().cloned());
    for (field, cidr) in own {
        if let Some((what, _)) = taken.iter().find(|(_, range)| overlap(range, &cidr)) {
            return Err(format!("{field}: {cidr} overlaps {what}"));
        }
    }
    // A default join subnet may not take the network's own addresses either.
    if network.join_subnets.is_empty()
        && let Some((what, cidr, i)) = join_subnets.iter().find_map(|(what, join)| {
            network
                .subnets
                .iter()
                .position(|(subnet, _)| overlap(subnet, join))
                .map(|i| (what, network.subnets[i].0, i))
        })
    {
        return Err(format!("{}: {cidr} overlaps {what}", subnet_field(i)));
    }
    Ok(())
}

/// Why the pods of a namespace get no interface from this dataplane, if they do not: the
/// namespace is labelled for a primary user-defined network ([`PRIMARY_NETWORK_LABEL`]), and
/// such pods must never land on the default network (their network's isolation is the
/// point). Upstream refuses them too while no network selects the namespace; a network that
/// does is not carried by this dataplane yet, so they wait for it.
pub fn unwired_namespace<'a>(
    namespace: &str,
    labels: &BTreeMap<String, String>,
    udns: impl IntoIterator<Item = &'a UserDefinedNetwork>,
    cudns: impl IntoIterator<Item = &'a ClusterUserDefinedNetwork>,
) -> Option<String> {
    if !labels.contains_key(PRIMARY_NETWORK_LABEL) {
        return None;
    }
    let own = udns
        .into_iter()
        .find(|udn| {
            udn.metadata.namespace.as_deref().unwrap_or("default") == namespace
                && validate_udn(udn).is_ok()
        })
        .map(|udn| {
            format!(
                "UserDefinedNetwork {namespace}/{}",
                udn.metadata.name.as_deref().unwrap_or_default()
            )
        });
    let selected = || {
        cudns
            .into_iter()
            .find(|cudn| {
                Selector::try_from(cudn.spec.namespace_selector.clone())
                    .is_ok_and(|selector| selector.matches(labels))
                    && validate_cudn(cudn).is_ok()
            })
            .map(|cudn| {
                format!(
                    "ClusterUserDefinedNetwork {}",
                    cudn.metadata.name.as_deref().unwrap_or_default()
                )
            })
    };
    Some(match own.or_else(selected) {
        Some(network) => format!(
            "namespace {namespace} takes the primary network {network}, which this dataplane does not carry yet; its pods get no interface rather than the default network"
        ),
        None => format!(
            "namespace {namespace} is labelled {PRIMARY_NETWORK_LABEL} but no valid UserDefinedNetwork or ClusterUserDefinedNetwork gives it a primary network; its pods get no interface until one does"
        ),
    })
}

fn overlap(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

#[cfg(test)]
mod tests {
    use super::*;

    const UDN: &str = r"apiVersion: k8s.ovn.org/v1
kind: UserDefinedNetwork
metadata: {name: tenant-blue, namespace: blue}
spec:
  topology: Layer3
  layer3:
    role: Primary
    subnets:
    - {cidr: 10.100.0.0/16, hostSubnet: 24}
    - {cidr: 'fd00:100::/48'}
";

    const CUDN: &str = r"apiVersion: k8s.ovn.org/v1
kind: ClusterUserDefinedNetwork
metadata: {name: tenants}
spec:
  namespaceSelector:
    matchExpressions: [{key: kubernetes.io/metadata.name, operator: In, values: [red, green]}]
  network:
    topology: Layer2
    layer2:
      role: Primary
      mtu: 1300
      subnets: [10.200.0.0/16, 'fd00:200::/64']
";

    fn udn(yaml: &str) -> UserDefinedNetwork {
        serde_yaml::from_str(yaml).expect("UserDefinedNetwork parses")
    }

    fn cudn(yaml: &str) -> ClusterUserDefinedNetwork {
        serde_yaml::from_str(yaml).expect("ClusterUserDefinedNetwork parses")
    }

    #[test]
    fn the_upstream_examples_parse_and_validate() {
        let network = validate_udn(&udn(UDN)).expect("valid");
        assert_eq!(network.topology, Topology::Layer3);
        assert_eq!(network.mtu, DEFAULT_MTU);
        assert_eq!(
            network.subnets,
            [
                ("10.100.0.0/16".parse().unwrap(), 24),
                ("fd00:100::/48".parse().unwrap(), 64)
            ]
        );
        let network = validate_cudn(&cudn(CUDN)).expect("valid");
        assert_eq!(network.topology, Topology::Layer2);
        assert_eq!(network.mtu, 1300);
        assert_eq!(
            network.subnets,
            [
                ("10.200.0.0/16".parse().unwrap(), 16),
                ("fd00:200::/64".parse().unwrap(), 64)
            ]
        );
    }

    #[test]
    fn bad_fields_are_named() {
        let udn_cases = [
            (
                "role: Primary",
                "role: Secondary",
                "spec.layer3.role: Secondary networks are not carried",
            ),
            (
                "10.100.0.0/16, hostSubnet: 24",
                "10.100.0.0/16, hostSubnet: 16",
                "spec.layer3.subnets[0].hostSubnet: 16 must be longer",
            ),
            (
                "10.100.0.0/16, hostSubnet: 24",
                "10.100.0.0/16, hostSubnet: 32",
                "spec.layer3.subnets[0].hostSubnet: 32 must be longer than the subnet's prefix /16 and at most 31",
            ),
            (
                "10.100.0.0/16, hostSubnet: 24",
                "10.100.0.0/33",
                "spec.layer3.subnets[0].cidr: \"10.100.0.0/33\" is not a CIDR",
            ),
            (
                "cidr: 'fd00:100::/48'",
                "cidr: 10.100.128.0/17",
                "spec.layer3.subnets[1].cidr: 10.100.128.0/17 overlaps spec.layer3.subnets[0]",
            ),
            (
                "    role: Primary",
                "    role: Primary\n    mtu: 1200",
                "spec.layer3.mtu: 1200 is under 1280",
            ),
            (
                "    role: Primary",
                "    role: Primary\n    joinSubnets: [10.100.1.0/24]",
                "spec.layer3.joinSubnets[0]: overlaps spec.layer3.subnets[0]",
            ),
            (
                "  topology: Layer3",
                "  topology: Layer2",
                "spec: topology Layer2 takes a layer2 section",
            ),
            (
                "    subnets:",
                "    subnets: [{cidr: 224.0.0.0/8}]\n    x:",
                "spec.layer3.subnets[0].cidr: 224.0.0.0/8 cannot hold pod addresses",
            ),
        ];
        for (from, to, expected) in udn_cases {
            let yaml = UDN.replace(from, to);
            let error = validate_udn(&udn(&yaml)).expect_err(to);
            assert!(error.starts_with(expected), "{error} is not {expected}...");
        }
        let cudn_cases = [
            (
                "[10.200.0.0/16, 'fd00:200::/64']",
                "[10.200.0.0/16, 10.201.0.0/16]",
                "spec.network.layer2.subnets: when two are set they must be of different IP families",
            ),
            (
                "      subnets: [10.200.0.0/16, 'fd00:200::/64']\n",
                "",
                "spec.network.layer2.subnets: a primary Layer2 network needs its subnets",
            ),
            (
                "operator: In, values: [red, green]",
                "operator: In",
                "spec.namespaceSelector: matchExpressions[0]: operator \"In\" needs values",
            ),
        ];
        for (from, to, expected) in cudn_cases {
            let yaml = CUDN.replace(from, to);
            let error = validate_cudn(&cudn(&yaml)).expect_err(to);
            assert!(error.starts_with(expected), "{error} is not {expected}...");
        }
    }

    /// Layer2's address fields as upstream validates them: reserved and infrastructure
    /// ranges masked, within the subnets and apart; gateways one per family, within the
    /// subnets and the infrastructure ranges; IPAM managed by the network. Each refusal
    /// names its field; a full example validates.
    #[test]
    fn layer2_address_fields_are_checked_by_field() {
        let full = CUDN.replace(
            "      subnets: [10.200.0.0/16, 'fd00:200::/64']\n",
            "      subnets: [10.200.0.0/16, 'fd00:200::/64']\n\
             \x20     reservedSubnets: [10.200.1.0/24, 'fd00:200::100/120']\n\
             \x20     infrastructureSubnets: [10.200.0.0/28, 'fd00:200::/124']\n\
             \x20     defaultGatewayIPs: [10.200.0.1, 'fd00:200::1']\n\
             \x20     ipam: {lifecycle: Persistent}\n",
        );
        let network = cudn(&full);
        let layer2 = network.spec.network.layer2.as_ref().unwrap();
        assert_eq!(layer2.default_gateway_ips, ["10.200.0.1", "fd00:200::1"]);
        assert_eq!(
            layer2.ipam.as_ref().and_then(|i| i.lifecycle),
            Some(IpamLifecycle::Persistent)
        );
        assert!(
            validate_cudn(&network).is_ok(),
            "{:?}",
            validate_cudn(&network)
        );
        // Written back as the API spells them.
        let json = serde_json::to_value(&network).unwrap();
        assert_eq!(
            json["spec"]["network"]["layer2"]["defaultGatewayIPs"][0],
            "10.200.0.1"
        );
        let cases = [
            (
                "reservedSubnets: [10.200.1.0/24",
                "reservedSubnets: [10.200.1.1/24",
                "spec.network.layer2.reservedSubnets[0]: 10.200.1.1/24 has host bits set",
            ),
            (
                "reservedSubnets: [10.200.1.0/24",
                "reservedSubnets: [10.201.1.0/24",
                "spec.network.layer2.reservedSubnets[0]: 10.201.1.0/24 is not within the network's subnets",
            ),
            (
                "infrastructureSubnets: [10.200.0.0/28",
                "infrastructureSubnets: [10.200.1.0/28",
                "spec.network.layer2.infrastructureSubnets[0]: overlaps spec.network.layer2.reservedSubnets[0]",
            ),
            (
                "defaultGatewayIPs: [10.200.0.1, 'fd00:200::1']",
                "defaultGatewayIPs: [10.200.0.1]",
                "spec.network.layer2.defaultGatewayIPs: one address for each IP family of the subnets (2 subnets, 1 addresses)",
            ),
            (
                "defaultGatewayIPs: [10.200.0.1",
                "defaultGatewayIPs: [10.200.2.1",
                "spec.network.layer2.defaultGatewayIPs[0]: 10.200.2.1 is not within spec.network.layer2.infrastructureSubnets",
            ),
            (
                "defaultGatewayIPs: [10.200.0.1",
                "defaultGatewayIPs: [10.9.0.1",
                "spec.network.layer2.defaultGatewayIPs[0]: 10.9.0.1 is not within the network's subnets",
            ),
            (
                "ipam: {lifecycle: Persistent}",
                "ipam: {mode: Disabled}",
                "spec.network.layer2.ipam.mode: Disabled is only supported for a Secondary network",
            ),
            (
                "ipam: {lifecycle: Persistent}",
                "ipam: {mode: DHCP}",
                "spec.network.layer2.ipam.mode: DHCP is not supported for the Layer2 topology",
            ),
            (
                "ipam: {lifecycle: Persistent}",
                "ipam: {}",
                "spec.network.layer2.ipam: set mode or lifecycle",
            ),
        ];
        for (from, to, expected) in cases {
            let yaml = full.replace(from, to);
            assert_ne!(yaml, full, "{from}");
            let error = validate_cudn(&cudn(&yaml)).expect_err(to);
            assert!(error.starts_with(expected), "{error} is not {expected}...");
        }
    }

    #[test]
    fn localnet_and_unknown_topologies_are_refused_by_name() {
        let yaml = CUDN.replace("topology: Layer2", "topology: Localnet");
        let error = serde_yaml::from_str::<ClusterUserDefinedNetwork>(&yaml)
            .expect_err("Localnet is not a topology here")
            .to_string();
        assert!(error.contains("unknown variant `Localnet`"), "{error}");
    }

    #[test]
    fn labelled_namespaces_are_unwired_naming_their_network_or_its_absence() {
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let (blue, tenants) = (udn(UDN), cudn(CUDN));
        let none: [&UserDefinedNetwork; 0] = [];
        // Unlabelled: the default network, whatever selects it.
        let plain = labels(&[("kubernetes.io/metadata.name", "red")]);
        assert_eq!(unwired_namespace("red", &plain, [&blue], [&tenants]), None);
        let labelled = |name: &str| {
            labels(&[
                ("kubernetes.io/metadata.name", name),
                (PRIMARY_NETWORK_LABEL, ""),
            ])
        };
        let why = unwired_namespace("blue", &labelled("blue"), [&blue], [&tenants]).unwrap();
        assert!(why.contains("UserDefinedNetwork blue/tenant-blue"), "{why}");
        let why = unwired_namespace("red", &labelled("red"), [&blue], [&tenants]).unwrap();
        assert!(why.contains("ClusterUserDefinedNetwork tenants"), "{why}");
        let why = unwired_namespace("gray", &labelled("gray"), none, [&tenants]).unwrap();
        assert!(why.contains("no valid UserDefinedNetwork"), "{why}");
    }

    #[test]
    fn the_schema_carries_the_upstream_rules() {
        use kube::CustomResourceExt as _;
        let udn = serde_json::to_string(&UserDefinedNetwork::crd()).expect("serializes");
        for rule in [
            "self == oldSelf",
            "self.topology == 'Layer3' ? has(self.layer3) : !has(self.layer3)",
            "!has(self.joinSubnets) || self.role == 'Primary'",
        ] {
            assert!(udn.contains(rule), "{rule} missing from the UDN CRD");
        }
        let cudn = serde_json::to_string(&ClusterUserDefinedNetwork::crd()).expect("serializes");
        assert!(cudn.contains("Network spec is immutable"));
        assert!(cudn.contains(r#""scope":"Cluster""#));
        assert!(udn.contains(r#""scope":"Namespaced""#));
        assert!(!udn.contains("Localnet"));
    }

    /// A network's subnets and join subnets stay clear of the cluster's own ranges, each
    /// refusal naming the field and the range, the default join subnet included.
    #[test]
    fn subnets_overlapping_the_clusters_ranges_are_refused_by_field() {
        let cluster: Vec<IpNet> = vec!["10.128.0.0/14".parse().unwrap()];
        let services: Vec<IpNet> = vec!["172.30.0.0/16".parse().unwrap()];
        let layer3 = |cidr: &str, join: &str| {
            let joins = if join.is_empty() {
                String::new()
            } else {
                format!(", joinSubnets: [{join}]")
            };
            let udn: UserDefinedNetwork = serde_yaml::from_str(&format!(
                "apiVersion: k8s.ovn.org/v1\nkind: UserDefinedNetwork\nmetadata: {{name: n, namespace: a}}\n\
                 spec: {{topology: Layer3, layer3: {{role: Primary, subnets: [{{cidr: 10.20.0.0/16}}, {{cidr: {cidr}}}]{joins}}}}}\n"
            ))
            .unwrap();
            let valid = validate_udn(&udn).unwrap();
            clear_of_cluster("spec", &valid, &cluster, &services)
        };
        assert_eq!(layer3("fd00:20::/48", ""), Ok(()));
        assert_eq!(
            layer3("10.130.0.0/16", ""),
            Err("spec.layer3.subnets[1].cidr: 10.130.0.0/16 overlaps the cluster network 10.128.0.0/14".into())
        );
        assert_eq!(
            layer3("172.30.8.0/21", ""),
            Err("spec.layer3.subnets[1].cidr: 172.30.8.0/21 overlaps the service network 172.30.0.0/16".into())
        );
        assert_eq!(
            layer3("100.88.0.0/20", ""),
            Err("spec.layer3.subnets[1].cidr: 100.88.0.0/20 overlaps the transit subnet 100.88.0.0/16".into())
        );
        assert_eq!(
            layer3("169.254.0.0/20", ""),
            Err("spec.layer3.subnets[1].cidr: 169.254.0.0/20 overlaps the masquerade subnet 169.254.0.0/17".into())
        );
        assert_eq!(
            layer3("fd00:20::/48", "100.64.0.0/20"),
            Err("spec.layer3.joinSubnets[0]: 100.64.0.0/20 overlaps the default network's join subnet 100.64.0.0/16".into())
        );
        assert_eq!(
            layer3("100.65.4.0/22", ""),
            Err("spec.layer3.subnets[1].cidr: 100.65.4.0/22 overlaps the default join subnet 100.65.0.0/16 (no spec.layer3.joinSubnets set)".into())
        );
        // With join subnets of its own, the default one is not taken.
        assert_eq!(layer3("100.65.4.0/22", "100.66.0.0/16"), Ok(()));
        // The transit subnet is Layer3's alone.
        let layer2: ClusterUserDefinedNetwork = serde_yaml::from_str(
            "apiVersion: k8s.ovn.org/v1\nkind: ClusterUserDefinedNetwork\nmetadata: {name: n}\n\
             spec: {namespaceSelector: {}, network: {topology: Layer2, layer2: {role: Primary, subnets: [100.88.0.0/24]}}}\n",
        )
        .unwrap();
        let valid = validate_cudn(&layer2).unwrap();
        assert_eq!(
            clear_of_cluster("spec.network", &valid, &cluster, &services),
            Ok(())
        );
    }
}
