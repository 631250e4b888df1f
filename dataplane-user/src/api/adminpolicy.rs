//! The cluster-wide admin policies as the API serves them: `AdminNetworkPolicy` and
//! `BaselineAdminNetworkPolicy` (`policy.networking.k8s.io/v1alpha1`) and their successor
//! `ClusterNetworkPolicy` (`policy.networking.k8s.io/v1alpha2`), with the API's limits. Their
//! validation turns them into the access-control compiler's tier model, so it lives with that
//! compiler (`acl::admin`), which names the object and the field of whatever it refuses.

use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Highest priority value (the API's range is 0 to 1000; OVN-Kubernetes takes 0 to 99 only).
pub const MAX_PRIORITY: i32 = 1000;
/// Most rules per direction of one object.
pub const MAX_RULES: usize = 100;
/// Most peers of one rule.
pub const MAX_PEERS: usize = 100;
/// Most CIDRs of one `networks` peer.
pub const MAX_NETWORKS: usize = 25;
/// The one BaselineAdminNetworkPolicy that counts.
pub const BASELINE_NAME: &str = "default";

/// `spec` of an AdminNetworkPolicy (cluster-scoped).
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[kube(
    group = "policy.networking.k8s.io",
    version = "v1alpha1",
    kind = "AdminNetworkPolicy",
    plural = "adminnetworkpolicies",
    shortname = "anp",
    derive = "PartialEq"
)]
pub struct AdminNetworkPolicySpec {
    /// 0 to 1000: lower values are evaluated first.
    pub priority: i32,
    pub subject: AdminSubject,
    /// Rules in evaluation order, at most 100.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ingress: Vec<AdminIngressRule>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<AdminEgressRule>,
}

/// `spec` of the BaselineAdminNetworkPolicy (a singleton named `default`).
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[kube(
    group = "policy.networking.k8s.io",
    version = "v1alpha1",
    kind = "BaselineAdminNetworkPolicy",
    plural = "baselineadminnetworkpolicies",
    shortname = "banp",
    derive = "PartialEq"
)]
pub struct BaselineAdminNetworkPolicySpec {
    pub subject: AdminSubject,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ingress: Vec<AdminIngressRule>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<AdminEgressRule>,
}

/// `spec` of a ClusterNetworkPolicy (cluster-scoped).
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[kube(
    group = "policy.networking.k8s.io",
    version = "v1alpha2",
    kind = "ClusterNetworkPolicy",
    plural = "clusternetworkpolicies",
    shortname = "cnp",
    derive = "PartialEq"
)]
pub struct ClusterNetworkPolicySpec {
    /// `Admin` or `Baseline`.
    pub tier: String,
    /// 0 to 1000 within the tier.
    pub priority: i32,
    pub subject: AdminSubject,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ingress: Vec<ClusterIngressRule>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<ClusterEgressRule>,
}

/// The pods a policy applies to: exactly one of the two. Host-network pods never are.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct AdminSubject {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
}

/// Pods by namespace and pod selectors together.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NamespacedPod {
    pub namespace_selector: LabelSelector,
    pub pod_selector: LabelSelector,
}

/// An ingress rule of an AdminNetworkPolicy or BaselineAdminNetworkPolicy.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct AdminIngressRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `Allow`, `Deny` or `Pass` (`Pass` in the admin tier only).
    pub action: String,
    pub from: Vec<AdminIngressPeer>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<AdminPort>>,
}

/// An egress rule of an AdminNetworkPolicy or BaselineAdminNetworkPolicy.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct AdminEgressRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub action: String,
    pub to: Vec<AdminEgressPeer>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<AdminPort>>,
}

/// Where ingress comes from: exactly one field.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct AdminIngressPeer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
}

/// Where egress goes: exactly one field.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AdminEgressPeer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
    /// The selected nodes' addresses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<LabelSelector>,
    /// Up to 25 CIDRs; they match pod addresses too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub networks: Option<Vec<String>>,
    /// Allow rules only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain_names: Option<Vec<String>>,
}

/// A port of a v1alpha1 rule: exactly one field.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AdminPort {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_number: Option<AdminPortNumber>,
    /// A container port name of the destination pod (any protocol).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub named_port: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_range: Option<AdminPortRange>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct AdminPortNumber {
    /// `TCP` (the default), `UDP` or `SCTP`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    pub port: i32,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct AdminPortRange {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    pub start: i32,
    pub end: i32,
}

/// An ingress rule of a ClusterNetworkPolicy.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct ClusterIngressRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `Accept`, `Deny` or `Pass` (`Pass` in the Admin tier only).
    pub action: String,
    pub from: Vec<AdminIngressPeer>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocols: Option<Vec<ClusterProtocol>>,
}

/// An egress rule of a ClusterNetworkPolicy.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct ClusterEgressRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub action: String,
    pub to: Vec<AdminEgressPeer>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocols: Option<Vec<ClusterProtocol>>,
}

/// What a ClusterNetworkPolicy rule matches beyond addresses: exactly one field.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterProtocol {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<ClusterTransport>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp: Option<ClusterTransport>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sctp: Option<ClusterTransport>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_named_port: Option<String>,
}

/// A transport's destination port; absent: every port of it.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterTransport {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_port: Option<ClusterPort>,
}

/// A port number or a range: exactly one field.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct ClusterPort {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub number: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range: Option<ClusterPortRange>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct ClusterPortRange {
    pub start: i32,
    pub end: i32,
}

/// The objects as the API and the manifests give them.
#[derive(Clone, Debug, Default)]
pub struct AdminObjects {
    pub admin: Vec<Arc<AdminNetworkPolicy>>,
    pub baseline: Vec<Arc<BaselineAdminNetworkPolicy>>,
    pub cluster: Vec<Arc<ClusterNetworkPolicy>>,
}

impl AdminObjects {
    pub fn is_empty(&self) -> bool {
        self.admin.is_empty() && self.baseline.is_empty() && self.cluster.is_empty()
    }
}
