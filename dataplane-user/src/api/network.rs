//! The cluster network configuration: the OpenShift network operator's `Network`
//! (`operator.openshift.io/v1`, the object named `cluster`) and the parts of its
//! `defaultNetwork.ovnKubernetesConfig` the dataplane reads: the overlay's MTU and Geneve port,
//! the audit log settings, the egress IP reachability timeout and the hybrid overlay; and
//! OpenShift's cluster configuration (`config.openshift.io/v1 Network`), where the installer
//! writes the cluster's networks and the external IP policy. Each part validates itself and
//! names the field it refuses.

use std::{net::SocketAddr, path::PathBuf};

use dataplane_common::{
    hybrid::HYBRID_DEFAULT_PORT,
    overlay::{
        DEFAULT_NETWORK_VNI, ENCAP_OVERHEAD_V6, GENEVE_DEFAULT_PORT, OVERLAY_DEFAULT_OVERHEAD,
        VXLAN_PORT,
    },
};
use ipnet::{IpNet, Ipv4Net};
use serde::Deserialize;

/// IPv6's minimum link MTU (RFC 8200): the pod MTU may not go below it.
pub const IPV6_MIN_MTU: u32 = 1280;

/// Why overlay settings were refused. Each message names the field as the operator wrote it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SettingsError {
    #[error("ovnKubernetesConfig.genevePort: 0 is not a port")]
    PortZero,
    #[error("ovnKubernetesConfig.genevePort: {VXLAN_PORT} is the VXLAN port; choose another")]
    PortIsVxlan,
    #[error("ovnKubernetesConfig.mtu: {mtu} is below IPv6's minimum link MTU of {IPV6_MIN_MTU}")]
    MtuTooSmall { mtu: u32 },
    #[error(
        "ovnKubernetesConfig.mtu: {mtu} does not fit the underlay MTU {underlay_mtu} with the \
         {overhead}-byte Geneve overhead"
    )]
    MtuTooLarge {
        mtu: u32,
        underlay_mtu: u32,
        overhead: u32,
    },
}

/// `defaultNetwork.ovnKubernetesConfig` of the OpenShift network operator, the overlay part.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OvnKubernetesConfig {
    pub mtu: Option<u32>,
    pub geneve_port: Option<u16>,
}

/// Validated overlay settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverlaySettings {
    pub geneve_port: u16,
    /// Largest IP packet a pod may send (its interface MTU).
    pub pod_mtu: u32,
    pub vni: u32,
}

impl OvnKubernetesConfig {
    /// Applies the defaults (port 6081, MTU = underlay MTU - 100) and the limits: the port is
    /// neither 0 nor VXLAN's, the MTU is at least 1280 and leaves room for encapsulation.
    pub fn validate(&self, underlay_mtu: u32) -> Result<OverlaySettings, SettingsError> {
        let geneve_port = self.geneve_port.unwrap_or(GENEVE_DEFAULT_PORT);
        if geneve_port == 0 {
            return Err(SettingsError::PortZero);
        }
        if geneve_port == VXLAN_PORT {
            return Err(SettingsError::PortIsVxlan);
        }
        let pod_mtu = self
            .mtu
            .unwrap_or(underlay_mtu.saturating_sub(OVERLAY_DEFAULT_OVERHEAD));
        if pod_mtu < IPV6_MIN_MTU {
            return Err(SettingsError::MtuTooSmall { mtu: pod_mtu });
        }
        // The largest encapsulation (IPv6 underlay) must still fit the underlay.
        if pod_mtu + ENCAP_OVERHEAD_V6 > underlay_mtu {
            return Err(SettingsError::MtuTooLarge {
                mtu: pod_mtu,
                underlay_mtu,
                overhead: ENCAP_OVERHEAD_V6,
            });
        }
        Ok(OverlaySettings {
            geneve_port,
            pod_mtu,
            vni: DEFAULT_NETWORK_VNI,
        })
    }
}

/// `ovnKubernetesConfig.policyAuditConfig` as the operator API spells it.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PolicyAuditConfig {
    pub rate_limit: Option<u32>,
    pub max_file_size: Option<u32>,
    pub max_log_files: Option<u32>,
    pub destination: Option<String>,
    pub syslog_facility: Option<String>,
}

/// Where records go besides the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Destination {
    FileOnly,
    /// The local syslog socket (/dev/log).
    Libc,
    Udp(SocketAddr),
    Unix(PathBuf),
}

/// The validated audit settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditSettings {
    pub rate_limit: u32,
    pub max_file_bytes: u64,
    pub max_log_files: u32,
    pub destination: Destination,
    pub facility: u8,
}

const FACILITIES: &[&str] = &[
    "kern", "user", "mail", "daemon", "auth", "syslog", "lpr", "news", "uucp", "clock", "authpriv",
    "ftp", "ntp", "audit", "alert", "cron", "local0", "local1", "local2", "local3", "local4",
    "local5", "local6", "local7",
];

impl PolicyAuditConfig {
    /// OVN-Kubernetes' defaults for what is absent; an error names the invalid field.
    pub fn validate(&self) -> Result<AuditSettings, String> {
        let rate_limit = self.rate_limit.unwrap_or(20);
        if rate_limit == 0 {
            return Err("policyAuditConfig.rateLimit must be at least 1".into());
        }
        let max_file_size = self.max_file_size.unwrap_or(50);
        if max_file_size == 0 {
            return Err("policyAuditConfig.maxFileSize must be at least 1 (MB)".into());
        }
        let destination = match self.destination.as_deref().unwrap_or("null") {
            "null" => Destination::FileOnly,
            "libc" => Destination::Libc,
            other => match (other.strip_prefix("udp:"), other.strip_prefix("unix:")) {
                (Some(target), _) => Destination::Udp(target.parse().map_err(|_| {
                    format!("policyAuditConfig.destination {other:?}: not udp:<address>:<port>")
                })?),
                (_, Some(path)) if !path.is_empty() => Destination::Unix(path.into()),
                _ => {
                    return Err(format!(
                        "policyAuditConfig.destination {other:?}: not null, libc, udp:<host>:<port> or unix:<path>"
                    ));
                }
            },
        };
        let facility_name = self.syslog_facility.as_deref().unwrap_or("local0");
        let facility = FACILITIES
            .iter()
            .position(|f| *f == facility_name)
            .ok_or_else(|| {
                format!(
                    "policyAuditConfig.syslogFacility {facility_name:?} is not a syslog facility"
                )
            })? as u8;
        Ok(AuditSettings {
            rate_limit,
            max_file_bytes: u64::from(max_file_size) * 1024 * 1024,
            max_log_files: self.max_log_files.unwrap_or(5).max(1),
            destination,
            facility,
        })
    }
}

/// `ovnKubernetesConfig.hybridOverlayConfig` as the operator writes it.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HybridOverlayConfig {
    #[serde(default)]
    pub hybrid_cluster_network: Vec<HybridNetworkEntry>,
    /// Read wide so that an out-of-range value is refused with the field named.
    #[serde(rename = "hybridOverlayVXLANPort")]
    pub vxlan_port: Option<u64>,
}

/// A network nodes get subnets of: its CIDR and the subnets' prefix length (`hostPrefix`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubnetPool {
    pub network: IpNet,
    pub host_prefix: u8,
}

/// One `hybridClusterNetwork` entry.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HybridNetworkEntry {
    pub cidr: String,
    /// Each hybrid node's slice; hybrid nodes carry their own subnet, so it is only checked.
    pub host_prefix: Option<u8>,
}

/// Validated hybrid overlay settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HybridSettings {
    /// The hybrid nodes' pod subnets lie in it (any subnet outside the cluster's own networks
    /// when none is given).
    pub network: Option<Ipv4Net>,
    /// Each hybrid node's slice of `network` (`hostPrefix`), which the controller allocates.
    pub host_prefix: Option<u8>,
    pub vxlan_port: u16,
}

/// Why the hybrid overlay settings were refused. Each message names the field.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HybridError {
    #[error("hybridOverlayConfig.hybridClusterNetwork: {count} networks; at most one is supported")]
    TooManyNetworks { count: usize },
    #[error("hybridOverlayConfig.hybridClusterNetwork[0].cidr: {cidr:?} is not an IPv4 CIDR")]
    BadCidr { cidr: String },
    #[error(
        "hybridOverlayConfig.hybridClusterNetwork[0].hostPrefix: {prefix} is not between the \
         network's prefix length {network} and 32"
    )]
    BadHostPrefix { prefix: u8, network: u8 },
    #[error("hybridOverlayConfig.hybridClusterNetwork[0].cidr: {cidr} overlaps {field} {other}")]
    Overlap {
        cidr: Ipv4Net,
        field: &'static str,
        other: IpNet,
    },
    #[error("hybridOverlayConfig.hybridOverlayVXLANPort: 0 is not a port")]
    PortZero,
    #[error("hybridOverlayConfig.hybridOverlayVXLANPort: {port} is not a port")]
    PortOutOfRange { port: u64 },
    #[error(
        "hybridOverlayConfig.hybridOverlayVXLANPort: {port} is the Geneve port \
         (ovnKubernetesConfig.genevePort); choose another"
    )]
    PortIsGeneve { port: u16 },
}

impl HybridOverlayConfig {
    /// Checks the settings against the cluster's networks and the Geneve port.
    pub fn validate(
        &self,
        cluster_networks: &[IpNet],
        service_networks: &[IpNet],
        geneve_port: u16,
    ) -> Result<HybridSettings, HybridError> {
        if self.hybrid_cluster_network.len() > 1 {
            return Err(HybridError::TooManyNetworks {
                count: self.hybrid_cluster_network.len(),
            });
        }
        let network = match self.hybrid_cluster_network.first() {
            Some(entry) => Some(checked_network(entry, cluster_networks, service_networks)?),
            None => None,
        };
        let vxlan_port = match self.vxlan_port {
            None => HYBRID_DEFAULT_PORT,
            Some(0) => return Err(HybridError::PortZero),
            Some(port) => u16::try_from(port).map_err(|_| HybridError::PortOutOfRange { port })?,
        };
        if vxlan_port == geneve_port {
            return Err(HybridError::PortIsGeneve { port: vxlan_port });
        }
        Ok(HybridSettings {
            network,
            host_prefix: self
                .hybrid_cluster_network
                .first()
                .and_then(|e| e.host_prefix),
            vxlan_port,
        })
    }
}

fn checked_network(
    entry: &HybridNetworkEntry,
    cluster_networks: &[IpNet],
    service_networks: &[IpNet],
) -> Result<Ipv4Net, HybridError> {
    let cidr = entry
        .cidr
        .parse::<Ipv4Net>()
        .map_err(|_| HybridError::BadCidr {
            cidr: entry.cidr.clone(),
        })?
        .trunc();
    if let Some(prefix) = entry.host_prefix
        && (prefix < cidr.prefix_len() || prefix > 32)
    {
        return Err(HybridError::BadHostPrefix {
            prefix,
            network: cidr.prefix_len(),
        });
    }
    let fields = cluster_networks
        .iter()
        .map(|n| ("spec.clusterNetwork", n))
        .chain(service_networks.iter().map(|n| ("spec.serviceNetwork", n)));
    for (field, other) in fields {
        if overlaps(&IpNet::V4(cidr), other) {
            return Err(HybridError::Overlap {
                cidr,
                field,
                other: *other,
            });
        }
    }
    Ok(cidr)
}

/// Whether two networks share an address.
pub fn overlaps(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

/// `ovnKubernetesConfig.egressIPConfig` of the operator's `Network`.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct EgressIpConfig {
    /// How long a node may go without answering the controller's probes before its
    /// addresses move (default 1 s; 0 turns the check off).
    pub reachability_total_timeout_seconds: Option<u32>,
}

impl EgressIpConfig {
    /// The reachability timeout; `None` when the check is off.
    pub fn reachability_timeout(&self) -> Option<std::time::Duration> {
        match self.reachability_total_timeout_seconds.unwrap_or(1) {
            0 => None,
            seconds => Some(std::time::Duration::from_secs(u64::from(seconds))),
        }
    }
}

/// The part of the operator's `Network` the dataplane reads.
#[derive(Deserialize)]
pub struct NetworkOperator {
    metadata: NetworkMetadata,
    #[serde(default)]
    spec: NetworkSpec,
}

#[derive(Deserialize)]
struct NetworkMetadata {
    name: String,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NetworkSpec {
    #[serde(default)]
    default_network: DefaultNetwork,
    #[serde(default)]
    cluster_network: Vec<ClusterNetworkEntry>,
    #[serde(default)]
    service_network: Vec<String>,
}

/// One `spec.clusterNetwork` entry: the network and each node's slice of it (`hostPrefix`),
/// which the controller allocates to nodes the cluster gives no `spec.podCIDRs`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ClusterNetworkEntry {
    cidr: String,
    host_prefix: Option<u8>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DefaultNetwork {
    #[serde(default)]
    ovn_kubernetes_config: OvnConfigSpec,
}

/// `ovnKubernetesConfig`: what the dataplane applies, and every other field, reported by name
/// (never silently ignored).
#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct OvnConfigSpec {
    mtu: Option<u32>,
    geneve_port: Option<u16>,
    policy_audit_config: Option<PolicyAuditConfig>,
    #[serde(rename = "egressIPConfig")]
    egress_ip_config: Option<EgressIpConfig>,
    hybrid_overlay_config: Option<HybridOverlayConfig>,
    #[serde(flatten)]
    others: std::collections::BTreeMap<String, serde::de::IgnoredAny>,
}

/// Why a field of `ovnKubernetesConfig` the dataplane does not apply is not applied.
fn not_applied(field: &str) -> String {
    let why = match field {
        "ipsecConfig" => {
            "IPsec is not supported (the kernels this dataplane runs on have no ESP): traffic \
             between nodes is not encrypted"
        }
        "gatewayConfig" => {
            "not applied: pods leave the cluster through the node's own routing and masquerade \
             (as routingViaHost: true), whatever it says"
        }
        _ => "not supported by this dataplane",
    };
    format!(
        "spec.defaultNetwork.ovnKubernetesConfig.{field}: {why}; the rest of the Network applies"
    )
}

/// The cluster's `Network`, its networks parsed and its hybrid overlay checked against them.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterNetwork {
    pub overlay: OvnKubernetesConfig,
    pub cluster_networks: Vec<IpNet>,
    pub service_networks: Vec<IpNet>,
    pub policy_audit: PolicyAuditConfig,
    pub egress_ip: EgressIpConfig,
    pub hybrid: Option<HybridSettings>,
    /// The cluster networks with a `hostPrefix`: what node subnets are allocated from.
    pub subnet_pools: Vec<SubnetPool>,
    /// The fields given that the dataplane does not apply, each a line naming it and why.
    pub not_applied: Vec<String>,
}

impl NetworkOperator {
    /// Only the object named `cluster` configures the cluster; others are ignored.
    pub fn is_the_cluster_network(&self) -> bool {
        self.metadata.name == "cluster"
    }

    /// The networks parsed and the hybrid overlay validated; the error names the field. The
    /// audit and overlay settings are validated where they are used (against the node's
    /// underlay MTU, for one), so that a bad value there keeps the last good settings.
    pub fn validate(self) -> Result<ClusterNetwork, String> {
        let spec = self.spec;
        let (cluster_networks, subnet_pools) = parse_cluster_networks(&spec.cluster_network)?;
        let service_networks = parse_service_networks(&spec.service_network)?;
        let ovn = spec.default_network.ovn_kubernetes_config;
        let hybrid = match &ovn.hybrid_overlay_config {
            Some(config) => Some(
                config
                    .validate(
                        &cluster_networks,
                        &service_networks,
                        ovn.geneve_port.unwrap_or(GENEVE_DEFAULT_PORT),
                    )
                    .map_err(|error| error.to_string())?,
            ),
            None => None,
        };
        Ok(ClusterNetwork {
            overlay: OvnKubernetesConfig {
                mtu: ovn.mtu,
                geneve_port: ovn.geneve_port,
            },
            cluster_networks,
            service_networks,
            policy_audit: ovn.policy_audit_config.unwrap_or_default(),
            egress_ip: ovn.egress_ip_config.unwrap_or_default(),
            hybrid,
            subnet_pools,
            not_applied: ovn.others.keys().map(|field| not_applied(field)).collect(),
        })
    }
}

/// `spec.clusterNetwork` parsed: the networks, and the pools nodes get subnets of (the entries
/// with a `hostPrefix`, checked to lie within their network's length).
fn parse_cluster_networks(
    entries: &[ClusterNetworkEntry],
) -> Result<(Vec<IpNet>, Vec<SubnetPool>), String> {
    let mut networks = Vec::new();
    let mut pools = Vec::new();
    for (index, entry) in entries.iter().enumerate() {
        let network = parse_cidr("spec.clusterNetwork", &entry.cidr)?;
        networks.push(network);
        let Some(host_prefix) = entry.host_prefix else {
            continue;
        };
        if host_prefix < network.prefix_len() || host_prefix > network.max_prefix_len() {
            return Err(format!(
                "spec.clusterNetwork[{index}].hostPrefix: {host_prefix} is not between {} and {}",
                network.prefix_len(),
                network.max_prefix_len()
            ));
        }
        pools.push(SubnetPool {
            network: network.trunc(),
            host_prefix,
        });
    }
    Ok((networks, pools))
}

fn parse_service_networks(entries: &[String]) -> Result<Vec<IpNet>, String> {
    entries
        .iter()
        .map(|text| parse_cidr("spec.serviceNetwork", text))
        .collect()
}

fn parse_cidr(field: &str, text: &str) -> Result<IpNet, String> {
    text.parse::<IpNet>()
        .map_err(|_| format!("{field} {text:?} is not a CIDR"))
}

/// OpenShift's cluster network configuration, `config.openshift.io/v1 Network` named `cluster`:
/// where the installer writes the cluster's pod and service networks (the operator's `Network`
/// holds copies of them), the network type, and which external IPs Services may take.
#[derive(Deserialize)]
pub struct NetworkConfig {
    metadata: NetworkMetadata,
    #[serde(default)]
    spec: NetworkConfigSpec,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NetworkConfigSpec {
    #[serde(default)]
    cluster_network: Vec<ClusterNetworkEntry>,
    #[serde(default)]
    service_network: Vec<String>,
    network_type: Option<String>,
    #[serde(rename = "externalIP")]
    external_ip: Option<ExternalIpConfig>,
    #[serde(flatten)]
    others: std::collections::BTreeMap<String, serde::de::IgnoredAny>,
}

/// `spec.externalIP`.
#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ExternalIpConfig {
    policy: Option<ExternalIpPolicySpec>,
    #[serde(default, rename = "autoAssignCIDRs")]
    auto_assign_cidrs: Vec<String>,
}

#[derive(Default, Deserialize)]
struct ExternalIpPolicySpec {
    #[serde(default, rename = "allowedCIDRs")]
    allowed_cidrs: Vec<String>,
    #[serde(default, rename = "rejectedCIDRs")]
    rejected_cidrs: Vec<String>,
}

/// The network types for which the Cluster Network Operator installs a plugin of its own:
/// with one of them, that plugin would run beside this dataplane.
const OPERATOR_INSTALLED_TYPES: &[&str] = &["OVNKubernetes", "OpenShiftSDN"];

/// Fields of the cluster `Network` that others apply: the API server allocates NodePorts
/// within `serviceNodePortRange`, and the dataplane serves whatever port a Service was given.
const APPLIED_ELSEWHERE: &[&str] = &["serviceNodePortRange"];

/// Which external IPs Services may take, as OpenShift's cluster `Network` says
/// (`spec.externalIP.policy`): inside an allowed CIDR and no rejected one; none without a
/// policy, as OpenShift admits none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExternalIpPolicy {
    pub allowed: Vec<IpNet>,
    pub rejected: Vec<IpNet>,
}

/// OpenShift's cluster network configuration, parsed.
#[derive(Clone, Debug, PartialEq)]
pub struct PlatformNetwork {
    /// `spec.clusterNetwork` (empty: not given, the operator `Network`'s apply).
    pub cluster_networks: Vec<IpNet>,
    pub subnet_pools: Vec<SubnetPool>,
    /// `spec.serviceNetwork` (empty: not given, the operator `Network`'s apply).
    pub service_networks: Vec<IpNet>,
    pub external_ips: ExternalIpPolicy,
    /// The fields given that the dataplane does not apply, each a line naming it and why.
    pub not_applied: Vec<String>,
}

impl NetworkConfig {
    /// Only the object named `cluster` configures the cluster; others are ignored.
    pub fn is_the_cluster_network(&self) -> bool {
        self.metadata.name == "cluster"
    }

    /// The networks and the external IP policy parsed; the error names the field.
    pub fn validate(self) -> Result<PlatformNetwork, String> {
        let spec = self.spec;
        let (cluster_networks, subnet_pools) = parse_cluster_networks(&spec.cluster_network)?;
        let service_networks = parse_service_networks(&spec.service_network)?;
        let mut not_applied = Vec::new();
        if let Some(network_type) = spec
            .network_type
            .as_deref()
            .filter(|t| OPERATOR_INSTALLED_TYPES.contains(t))
        {
            not_applied.push(format!(
                "spec.networkType: {network_type}: the Cluster Network Operator installs its own \
                 plugin for this type, beside this dataplane; install with a type it does not \
                 know (README: OpenShift)"
            ));
        }
        let external_ip = spec.external_ip.unwrap_or_default();
        if !external_ip.auto_assign_cidrs.is_empty() {
            not_applied.push(
                "spec.externalIP.autoAssignCIDRs: not applied: nothing here assigns external IPs \
                 to LoadBalancer Services; the rest of the Network applies"
                    .to_owned(),
            );
        }
        let policy = external_ip.policy.unwrap_or_default();
        let cidrs = |field: &str, texts: &[String]| {
            texts
                .iter()
                .map(|text| parse_cidr(field, text))
                .collect::<Result<Vec<_>, _>>()
        };
        let external_ips = ExternalIpPolicy {
            allowed: cidrs("spec.externalIP.policy.allowedCIDRs", &policy.allowed_cidrs)?,
            rejected: cidrs(
                "spec.externalIP.policy.rejectedCIDRs",
                &policy.rejected_cidrs,
            )?,
        };
        let others = spec.others.keys();
        let ours = others.filter(|field| !APPLIED_ELSEWHERE.contains(&field.as_str()));
        not_applied.extend(ours.map(|field| {
            format!(
                "spec.{field}: not supported by this dataplane; the rest of the Network applies"
            )
        }));
        Ok(PlatformNetwork {
            cluster_networks,
            subnet_pools,
            service_networks,
            external_ips,
            not_applied,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(v: &[&str]) -> Vec<IpNet> {
        v.iter().map(|c| c.parse().expect("cidr")).collect()
    }

    #[test]
    fn settings_defaults_and_limits() {
        let defaults = OvnKubernetesConfig::default()
            .validate(1500)
            .expect("defaults");
        assert_eq!(
            defaults,
            OverlaySettings {
                geneve_port: 6081,
                pod_mtu: 1400,
                vni: 1
            }
        );
        let custom = OvnKubernetesConfig {
            mtu: Some(1350),
            geneve_port: Some(6082),
        };
        assert_eq!(custom.validate(1500).expect("custom").geneve_port, 6082);
        let cases = [
            (Some(0), None, 1500, SettingsError::PortZero),
            (Some(4789), None, 1500, SettingsError::PortIsVxlan),
            (
                None,
                Some(1279),
                1500,
                SettingsError::MtuTooSmall { mtu: 1279 },
            ),
            (None, None, 1300, SettingsError::MtuTooSmall { mtu: 1200 }),
            (
                None,
                Some(1450),
                1500,
                SettingsError::MtuTooLarge {
                    mtu: 1450,
                    underlay_mtu: 1500,
                    overhead: 70,
                },
            ),
        ];
        for (geneve_port, mtu, underlay, expected) in cases {
            let config = OvnKubernetesConfig { mtu, geneve_port };
            assert_eq!(config.validate(underlay), Err(expected));
        }
        assert!(
            SettingsError::PortIsVxlan
                .to_string()
                .contains("ovnKubernetesConfig.genevePort")
        );
    }

    fn config(cidrs: &[&str], port: Option<u64>) -> HybridOverlayConfig {
        HybridOverlayConfig {
            hybrid_cluster_network: cidrs
                .iter()
                .map(|c| HybridNetworkEntry {
                    cidr: (*c).to_owned(),
                    host_prefix: Some(26),
                })
                .collect(),
            vxlan_port: port,
        }
    }

    fn validate(config: &HybridOverlayConfig) -> Result<HybridSettings, String> {
        config
            .validate(
                &nets(&["10.128.0.0/14", "fd00:10:128::/48"]),
                &nets(&["172.30.0.0/16"]),
                6081,
            )
            .map_err(|e| e.to_string())
    }

    #[test]
    fn settings_default_to_the_vxlan_port_and_name_the_field_they_refuse() {
        assert_eq!(
            validate(&config(&["10.132.0.0/14"], None)),
            Ok(HybridSettings {
                network: Some("10.132.0.0/14".parse().unwrap()),
                host_prefix: Some(26),
                vxlan_port: 4789
            })
        );
        assert_eq!(
            validate(&config(&["10.132.0.0/14"], Some(9898))).map(|s| s.vxlan_port),
            Ok(9898)
        );
        assert_eq!(
            validate(&config(&["10.132.0.0/14", "10.140.0.0/14"], None)),
            Err(
                "hybridOverlayConfig.hybridClusterNetwork: 2 networks; at most one is supported"
                    .to_owned()
            )
        );
        assert_eq!(
            validate(&config(&["10.130.0.0/16"], None)),
            Err(
                "hybridOverlayConfig.hybridClusterNetwork[0].cidr: 10.130.0.0/16 overlaps \
                 spec.clusterNetwork 10.128.0.0/14"
                    .to_owned()
            )
        );
        assert_eq!(
            validate(&config(&["172.30.5.0/24"], None)),
            Err(
                "hybridOverlayConfig.hybridClusterNetwork[0].cidr: 172.30.5.0/24 overlaps \
                 spec.serviceNetwork 172.30.0.0/16"
                    .to_owned()
            )
        );
        assert_eq!(
            validate(&config(&["10.132.0.0/14"], Some(0))),
            Err("hybridOverlayConfig.hybridOverlayVXLANPort: 0 is not a port".to_owned())
        );
        assert_eq!(
            validate(&config(&["10.132.0.0/14"], Some(70000))),
            Err("hybridOverlayConfig.hybridOverlayVXLANPort: 70000 is not a port".to_owned())
        );
        assert_eq!(
            validate(&config(&["10.132.0.0/14"], Some(6081))),
            Err(
                "hybridOverlayConfig.hybridOverlayVXLANPort: 6081 is the Geneve port \
                 (ovnKubernetesConfig.genevePort); choose another"
                    .to_owned()
            )
        );
        assert_eq!(
            validate(&config(&["fd00::/64"], None)),
            Err("hybridOverlayConfig.hybridClusterNetwork[0].cidr: \"fd00::/64\" is not an IPv4 CIDR"
                .to_owned())
        );
        let mut wide = config(&["10.132.0.0/14"], None);
        wide.hybrid_cluster_network[0].host_prefix = Some(12);
        assert_eq!(
            validate(&wide),
            Err(
                "hybridOverlayConfig.hybridClusterNetwork[0].hostPrefix: 12 is not between the \
                 network's prefix length 14 and 32"
                    .to_owned()
            )
        );
    }

    fn platform(yaml: &str) -> Result<PlatformNetwork, String> {
        let config: NetworkConfig = serde_yaml::from_str(yaml).expect("yaml");
        assert!(config.is_the_cluster_network());
        config.validate()
    }

    #[test]
    fn the_platform_network_gives_networks_pools_and_the_external_ip_policy() {
        let parsed = platform(
            "metadata: {name: cluster}\n\
             spec:\n  clusterNetwork: [{cidr: 10.128.0.0/14, hostPrefix: 23}, {cidr: \"fd01::/48\", hostPrefix: 64}]\n\
             \x20 serviceNetwork: [172.30.0.0/16, \"fd02::/112\"]\n\
             \x20 networkType: Dataplane\n\
             \x20 serviceNodePortRange: 30000-32767\n\
             \x20 externalIP: {policy: {allowedCIDRs: [192.0.2.0/24], rejectedCIDRs: [192.0.2.128/25]}}\n",
        )
        .expect("valid");
        assert_eq!(
            parsed.cluster_networks,
            nets(&["10.128.0.0/14", "fd01::/48"])
        );
        assert_eq!(
            parsed.subnet_pools,
            [
                SubnetPool {
                    network: "10.128.0.0/14".parse().unwrap(),
                    host_prefix: 23
                },
                SubnetPool {
                    network: "fd01::/48".parse().unwrap(),
                    host_prefix: 64
                }
            ]
        );
        assert_eq!(
            parsed.service_networks,
            nets(&["172.30.0.0/16", "fd02::/112"])
        );
        assert_eq!(
            parsed.external_ips,
            ExternalIpPolicy {
                allowed: nets(&["192.0.2.0/24"]),
                rejected: nets(&["192.0.2.128/25"])
            }
        );
        assert_eq!(parsed.not_applied, Vec::<String>::new());
        // No policy: no external IP, as OpenShift admits none.
        let bare = platform(
            "metadata: {name: cluster}\nspec: {clusterNetwork: [{cidr: 10.128.0.0/14}]}\n",
        )
        .expect("valid");
        assert_eq!(bare.external_ips, ExternalIpPolicy::default());
        assert!(bare.subnet_pools.is_empty() && bare.service_networks.is_empty());
    }

    #[test]
    fn the_platform_network_names_what_it_does_not_apply_and_what_it_refuses() {
        let parsed = platform(
            "metadata: {name: cluster}\nspec: {networkType: OVNKubernetes, \
             externalIP: {autoAssignCIDRs: [198.51.100.0/24]}, networkDiagnostics: {mode: All}}\n",
        )
        .expect("valid");
        assert_eq!(
            parsed.not_applied,
            [
                "spec.networkType: OVNKubernetes: the Cluster Network Operator installs its own \
                 plugin for this type, beside this dataplane; install with a type it does not \
                 know (README: OpenShift)",
                "spec.externalIP.autoAssignCIDRs: not applied: nothing here assigns external IPs \
                 to LoadBalancer Services; the rest of the Network applies",
                "spec.networkDiagnostics: not supported by this dataplane; the rest of the Network applies",
            ]
        );
        for (spec, error) in [
            (
                "{clusterNetwork: [{cidr: 10.128.0.0/33}]}",
                "spec.clusterNetwork \"10.128.0.0/33\" is not a CIDR",
            ),
            (
                "{clusterNetwork: [{cidr: 10.128.0.0/14, hostPrefix: 8}]}",
                "spec.clusterNetwork[0].hostPrefix: 8 is not between 14 and 32",
            ),
            (
                "{serviceNetwork: [nowhere]}",
                "spec.serviceNetwork \"nowhere\" is not a CIDR",
            ),
            (
                "{externalIP: {policy: {rejectedCIDRs: [x]}}}",
                "spec.externalIP.policy.rejectedCIDRs \"x\" is not a CIDR",
            ),
        ] {
            assert_eq!(
                platform(&format!("metadata: {{name: cluster}}\nspec: {spec}\n")),
                Err(error.to_owned())
            );
        }
    }

    #[test]
    fn policy_audit_config_defaults_and_errors() {
        let defaults = PolicyAuditConfig::default().validate().expect("defaults");
        assert_eq!(
            defaults,
            AuditSettings {
                rate_limit: 20,
                max_file_bytes: 50 * 1024 * 1024,
                max_log_files: 5,
                destination: Destination::FileOnly,
                facility: 16,
            }
        );
        let udp = PolicyAuditConfig {
            destination: Some("udp:10.0.0.1:514".into()),
            syslog_facility: Some("local7".into()),
            ..PolicyAuditConfig::default()
        }
        .validate()
        .expect("udp");
        assert_eq!(
            udp.destination,
            Destination::Udp("10.0.0.1:514".parse().unwrap())
        );
        assert_eq!(udp.facility, 23);
        for (bad, field) in [
            (
                PolicyAuditConfig {
                    rate_limit: Some(0),
                    ..Default::default()
                },
                "rateLimit",
            ),
            (
                PolicyAuditConfig {
                    destination: Some("tcp:x".into()),
                    ..Default::default()
                },
                "destination",
            ),
            (
                PolicyAuditConfig {
                    destination: Some("udp:nowhere".into()),
                    ..Default::default()
                },
                "destination",
            ),
            (
                PolicyAuditConfig {
                    syslog_facility: Some("local9".into()),
                    ..Default::default()
                },
                "syslogFacility",
            ),
        ] {
            assert!(bad.validate().unwrap_err().contains(field), "{bad:?}");
        }
    }
}
