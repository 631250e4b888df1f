//! The store of one read of the cluster: each kind's objects, and the cluster network's
//! settings.

use ipnet::IpNet;
use k8s_openapi::api::{
    core::v1::{Namespace, Node, Service},
    discovery::v1::EndpointSlice,
    networking::v1::NetworkPolicy,
};

use super::{objects::Objects, pod::Pod};
use crate::api::{
    adminpolicy::{
        AdminNetworkPolicy, AdminObjects, BaselineAdminNetworkPolicy, ClusterNetworkPolicy,
    },
    egressfirewall::EgressFirewall,
    egressip::EgressIP,
    egressrouter::EgressRouter,
    network::{
        EgressIpConfig, HybridError, HybridSettings, OvnKubernetesConfig, PlatformNetwork,
        PolicyAuditConfig, overlaps,
    },
    userdefinednetwork::{ClusterUserDefinedNetwork, UserDefinedNetwork},
};

/// Everything read from the manifests. The objects are shared (`Arc`): the state assembled
/// for a sync, the last sync's state and the sources' parse caches hold the same objects, so
/// an unchanged object compares equal by its pointer. Each kind's list is shared too
/// ([`Objects`]): handing a sync the state copies no list, and only a changed kind's list is
/// copied when it is patched.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterState {
    pub nodes: Objects<Node>,
    pub namespaces: Objects<Namespace>,
    pub pods: Objects<Pod>,
    pub services: Objects<Service>,
    pub endpoint_slices: Objects<EndpointSlice>,
    /// `networking.k8s.io/v1` NetworkPolicies (a missing namespace reads as `default`).
    pub network_policies: Objects<NetworkPolicy>,
    /// `k8s.ovn.org/v1` EgressFirewalls (a missing namespace reads as `default`).
    pub egress_firewalls: Objects<EgressFirewall>,
    /// Validated EgressIPs: their status says which node holds each address.
    pub egress_ips: Objects<EgressIP>,
    /// OpenShift's EgressRouters (a missing namespace reads as `default`), validated where the
    /// controller makes their objects.
    pub egress_routers: Objects<EgressRouter>,
    /// Cluster-wide admin policies (validated by access control, which keeps an invalid
    /// one's last good version).
    pub admin_network_policies: Objects<AdminNetworkPolicy>,
    pub baseline_admin_network_policies: Objects<BaselineAdminNetworkPolicy>,
    pub cluster_network_policies: Objects<ClusterNetworkPolicy>,
    /// User-defined networks as served, valid or not (their users check them with
    /// `validate_udn` / `validate_cudn`; a missing namespace reads as `default`).
    pub user_defined_networks: Objects<UserDefinedNetwork>,
    pub cluster_user_defined_networks: Objects<ClusterUserDefinedNetwork>,
    /// `spec.defaultNetwork.ovnKubernetesConfig` of the `Network` named `cluster`, if any.
    pub network: Option<OvnKubernetesConfig>,
    /// `spec.clusterNetwork[].cidr` of that `Network`: the pod networks of the cluster.
    pub cluster_networks: Vec<IpNet>,
    /// `spec.serviceNetwork` of that `Network`: the service address ranges.
    pub service_networks: Vec<IpNet>,
    /// `ovnKubernetesConfig.policyAuditConfig` of that `Network`.
    pub policy_audit: PolicyAuditConfig,
    /// `ovnKubernetesConfig.egressIPConfig` of that `Network`.
    pub egress_ip_config: EgressIpConfig,
    /// `ovnKubernetesConfig.hybridOverlayConfig` of that `Network`, validated: the hybrid
    /// overlay is on when it is there.
    pub hybrid: Option<HybridSettings>,
    /// The cluster networks with a `hostPrefix` (node subnets the controller allocates).
    pub subnet_pools: Vec<crate::api::network::SubnetPool>,
    /// OpenShift's cluster network configuration (`config.openshift.io/v1 Network cluster`),
    /// if any: its networks replace the operator `Network`'s ([`Self::settle_networks`]).
    pub platform: Option<PlatformNetwork>,
    /// Objects skipped because they did not parse, one line each naming the object.
    pub rejected: Vec<String>,
}

impl ClusterState {
    /// How many objects of every kind it holds.
    pub(super) fn object_count(&self) -> usize {
        self.nodes.len()
            + self.namespaces.len()
            + self.pods.len()
            + self.services.len()
            + self.endpoint_slices.len()
            + self.network_policies.len()
            + self.egress_firewalls.len()
            + self.egress_ips.len()
            + self.egress_routers.len()
            + self.admin_network_policies.len()
            + self.baseline_admin_network_policies.len()
            + self.cluster_network_policies.len()
            + self.user_defined_networks.len()
            + self.cluster_user_defined_networks.len()
    }

    /// The cluster-wide admin policies, as access control takes them.
    pub fn admin_objects(&self) -> AdminObjects {
        AdminObjects {
            admin: self.admin_network_policies.to_vec(),
            baseline: self.baseline_admin_network_policies.to_vec(),
            cluster: self.cluster_network_policies.to_vec(),
        }
    }

    /// Adds what `later` holds, as if its documents came after this state's: objects are
    /// appended, and a `Network` in it replaces this one's settings.
    pub fn absorb(&mut self, later: &ClusterState) {
        self.nodes.append(&later.nodes);
        self.namespaces.append(&later.namespaces);
        self.pods.append(&later.pods);
        self.services.append(&later.services);
        self.endpoint_slices.append(&later.endpoint_slices);
        self.network_policies.append(&later.network_policies);
        self.egress_firewalls.append(&later.egress_firewalls);
        self.egress_ips.append(&later.egress_ips);
        self.egress_routers.append(&later.egress_routers);
        self.user_defined_networks
            .append(&later.user_defined_networks);
        self.cluster_user_defined_networks
            .append(&later.cluster_user_defined_networks);
        self.admin_network_policies
            .append(&later.admin_network_policies);
        self.baseline_admin_network_policies
            .append(&later.baseline_admin_network_policies);
        self.cluster_network_policies
            .append(&later.cluster_network_policies);
        self.absorb_settings(later);
        self.rejected.extend(later.rejected.iter().cloned());
    }

    /// Takes `later`'s operator `Network` settings if it has that `Network`, and its cluster
    /// network configuration if it has that.
    pub fn absorb_settings(&mut self, later: &ClusterState) {
        if later.network.is_some() {
            self.copy_operator_settings(later);
        }
        if later.platform.is_some() {
            self.platform.clone_from(&later.platform);
        }
    }

    /// Whether it holds either `Network`.
    pub(super) fn has_settings(&self) -> bool {
        self.network.is_some() || self.platform.is_some()
    }

    /// Takes `other`'s settings of both `Network`s, none included.
    pub(super) fn copy_settings(&mut self, other: &ClusterState) {
        self.copy_operator_settings(other);
        self.platform.clone_from(&other.platform);
    }

    /// Where OpenShift's cluster network configuration is there, its networks are the
    /// cluster's: the installer writes them there, and the operator `Network` holds copies
    /// (a difference is named). The hybrid overlay's network is checked against them again.
    /// Run on each state a source assembles; running it twice changes nothing more.
    pub fn settle_networks(&mut self) {
        let Some(platform) = &self.platform else {
            return;
        };
        let config = "config.openshift.io/v1 Network cluster";
        if take_networks(
            &mut self.cluster_networks,
            &platform.cluster_networks,
            "spec.clusterNetwork",
            &mut self.rejected,
        ) {
            self.subnet_pools.clone_from(&platform.subnet_pools);
        }
        take_networks(
            &mut self.service_networks,
            &platform.service_networks,
            "spec.serviceNetwork",
            &mut self.rejected,
        );
        let hybrid_network = self.hybrid.and_then(|h| h.network);
        let fields = (self
            .cluster_networks
            .iter()
            .map(|n| ("spec.clusterNetwork", n)))
        .chain(
            self.service_networks
                .iter()
                .map(|n| ("spec.serviceNetwork", n)),
        );
        for (field, other) in fields {
            if let Some(cidr) = hybrid_network
                && overlaps(&ipnet::IpNet::V4(cidr), other)
            {
                // As an invalid hybrid overlay in the operator's `Network` does: that
                // `Network` is refused, and the node keeps its last good state.
                let error = HybridError::Overlap {
                    cidr,
                    field,
                    other: *other,
                };
                self.rejected.push(format!(
                    "operator.openshift.io/v1 Network cluster: {error} (of {config}); the Network is refused"
                ));
                self.network = None;
                self.hybrid = None;
                return;
            }
        }
    }

    /// Takes `other`'s operator `Network` settings, none included.
    fn copy_operator_settings(&mut self, other: &ClusterState) {
        self.network = other.network;
        self.cluster_networks = other.cluster_networks.clone();
        self.service_networks = other.service_networks.clone();
        self.policy_audit = other.policy_audit.clone();
        self.egress_ip_config = other.egress_ip_config;
        self.hybrid = other.hybrid;
        self.subnet_pools = other.subnet_pools.clone();
    }
}

/// Replaces the operator `Network`'s `ours` (its `field`) by the cluster configuration's
/// `theirs` where that gives any, naming a difference in `rejected`; whether it did.
fn take_networks(
    ours: &mut Vec<ipnet::IpNet>,
    theirs: &[ipnet::IpNet],
    field: &str,
    rejected: &mut Vec<String>,
) -> bool {
    if theirs.is_empty() {
        return false;
    }
    if !ours.is_empty() && ours.as_slice() != theirs {
        rejected.push(format!(
            "operator.openshift.io/v1 Network cluster: {field} {:?} differs from \
             config.openshift.io/v1 Network cluster's {:?}: the latter applies",
            display(ours),
            display(theirs)
        ));
    }
    *ours = theirs.to_vec();
    true
}

fn display(networks: &[ipnet::IpNet]) -> Vec<String> {
    networks.iter().map(ToString::to_string).collect()
}
