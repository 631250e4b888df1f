//! Which addresses a Service may take: the kinds of service address, and the policy that
//! refuses external and load-balancer addresses in the cluster's own networks or outside the
//! operator's allowed CIDRs (CVE-2020-8554).

use std::{collections::BTreeSet, net::IpAddr};

use ipnet::IpNet;

/// What kind of Service address a port was compiled for: when two Services claim one key, the
/// lower kind holds it (a ClusterIP, which the API server allocates, over an external or
/// load-balancer address a Service names for itself), then the first Service by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AddressKind {
    ClusterIp,
    NodePort,
    /// `spec.externalIPs` and `status.loadBalancer.ingress[].ip`.
    External,
}

/// Which addresses, besides its cluster IPs, a Service may take (CVE-2020-8554: a tenant who
/// may create Services could otherwise name another's address as an external IP and take its
/// traffic, the cluster DNS's say).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AddressPolicy {
    /// `spec.externalIPs` are honoured only inside these; none by default, as the API
    /// server's DenyServiceExternalIPs admission plugin advises.
    pub external_ip_cidrs: Vec<IpNet>,
    /// ... and outside these.
    pub external_ip_rejected_cidrs: Vec<IpNet>,
    /// Who said so (named in refusals).
    pub external_ip_source: ExternalIpSource,
    /// No external or load-balancer address may be inside these: the service networks, the
    /// cluster (pod) networks, the hybrid overlay's.
    pub reserved_networks: Vec<IpNet>,
    /// No external IP may be a node's address (it would take the node's own ports, the
    /// kubelet's among them). Load-balancer addresses may: some load balancers (k3s'
    /// ServiceLB) publish the nodes' addresses.
    pub node_addresses: BTreeSet<IpAddr>,
}

/// Where the external IP allow-list comes from: the agent's flag, which overrides, or
/// OpenShift's cluster `Network` (`spec.externalIP.policy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExternalIpSource {
    #[default]
    Flag,
    ClusterNetwork,
}

impl AddressPolicy {
    /// Why `ip`, given as `field` of a Service, is not honoured; `None` when it is.
    pub(super) fn refuses(&self, ip: IpAddr, field: &str) -> Option<String> {
        let external_ip = field == EXTERNAL_IPS;
        if special_address(ip) {
            return Some(format!(
                "{ip} is an unspecified, loopback, link-local, multicast or broadcast address"
            ));
        }
        if let Some(net) = self.reserved_networks.iter().find(|n| n.contains(&ip)) {
            return Some(format!(
                "{ip} is inside the cluster's own network {net} (service or pod addresses)"
            ));
        }
        if external_ip && self.node_addresses.contains(&ip) {
            return Some(format!("{ip} is a node's address"));
        }
        if external_ip {
            return self.refuses_external_ip(ip);
        }
        None
    }

    fn refuses_external_ip(&self, ip: IpAddr) -> Option<String> {
        let policy = "the cluster Network's (config.openshift.io/v1) spec.externalIP.policy";
        if let Some(net) = self
            .external_ip_rejected_cidrs
            .iter()
            .find(|n| n.contains(&ip))
        {
            return Some(format!("{ip} is inside {net} of {policy}.rejectedCIDRs"));
        }
        if self.external_ip_cidrs.iter().any(|n| n.contains(&ip)) {
            return None;
        }
        Some(
            match (self.external_ip_source, self.external_ip_cidrs.is_empty()) {
                (ExternalIpSource::Flag, true) => format!(
                    "{ip}: external IPs are not honoured on this cluster (the agent's --external-ip-cidrs is empty)"
                ),
                (ExternalIpSource::Flag, false) => {
                    format!("{ip} is outside the agent's --external-ip-cidrs")
                }
                (ExternalIpSource::ClusterNetwork, true) => format!(
                    "{ip}: external IPs are not honoured on this cluster ({policy} allows none)"
                ),
                (ExternalIpSource::ClusterNetwork, false) => {
                    format!("{ip} is outside {policy}.allowedCIDRs")
                }
            },
        )
    }
}

/// Addresses no Service may claim but as a cluster IP.
fn special_address(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            v4.is_unspecified()
                || v4.is_loopback()
                || v4.is_link_local()
                || v4.is_multicast()
                || v4.is_broadcast()
        }
        IpAddr::V6(v6) => {
            v6.is_unspecified()
                || v6.is_loopback()
                || v6.is_multicast()
                || v6.is_unicast_link_local()
                || v6.to_ipv4_mapped().is_some()
        }
    }
}

pub(super) const EXTERNAL_IPS: &str = "spec.externalIPs";
pub(super) const CLUSTER_IPS: &str = "spec.clusterIPs";
pub(super) const INGRESS_IPS: &str = "status.loadBalancer.ingress[].ip";
