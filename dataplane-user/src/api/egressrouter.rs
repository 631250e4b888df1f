//! OpenShift's `EgressRouter` (`network.operator.openshift.io/v1`, namespaced) as the API
//! serves it: one egress router pod in redirect mode, from which the controller makes the
//! router's NetworkAttachmentDefinition, Deployment and Service (`egressrouter::resource`).
//! The schema carries the upstream type's limits (the mode, the protocols, the port range, the
//! macvlan modes, at least one address) so that the API server refuses what it can; the rest
//! is checked where the objects are made, which names the field in the router's status.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `spec` of an EgressRouter.
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[kube(
    group = "network.operator.openshift.io",
    version = "v1",
    kind = "EgressRouter",
    plural = "egressrouters",
    namespaced,
    status = "EgressRouterStatus",
    derive = "PartialEq",
    printcolumn = r#"{"name":"Condition","type":"string","jsonPath":".status.conditions[*].type"}"#,
    printcolumn = r#"{"name":"Status","type":"string","jsonPath":".status.conditions[*].status"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct EgressRouterSpec {
    /// How the router sends traffic on: `Redirect` (the only mode).
    #[serde(default)]
    pub mode: EgressRouterMode,
    /// The redirect mode's rules and fallback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redirect: Option<RedirectConfig>,
    /// The router's second interface (a macvlan on the node's NIC).
    #[serde(default)]
    pub network_interface: EgressRouterInterface,
    /// The reserved address with its prefix and the gateway of its network.
    #[schemars(length(min = 1))]
    pub addresses: Vec<EgressRouterAddress>,
}

/// `spec.mode`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
pub enum EgressRouterMode {
    #[default]
    Redirect,
}

/// `spec.redirect`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RedirectConfig {
    /// Per-port redirects: what arrives on `port` goes to `destinationIP:targetPort`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub redirect_rules: Vec<L4RedirectRule>,
    /// Where every other port goes; without it, other ports are refused.
    #[serde(
        rename = "fallbackIP",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub fallback_ip: Option<String>,
}

/// One of `spec.redirect.redirectRules`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct L4RedirectRule {
    #[serde(rename = "destinationIP")]
    pub destination_ip: String,
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    pub protocol: RedirectProtocol,
    /// The destination's port (`port` when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub target_port: Option<i32>,
}

/// `protocol` of a redirect rule.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
pub enum RedirectProtocol {
    #[default]
    #[serde(rename = "TCP")]
    Tcp,
    #[serde(rename = "UDP")]
    Udp,
    #[serde(rename = "SCTP")]
    Sctp,
}

/// `spec.networkInterface`: macvlan only.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct EgressRouterInterface {
    #[serde(default)]
    pub macvlan: MacvlanConfig,
}

/// `spec.networkInterface.macvlan`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct MacvlanConfig {
    #[serde(default)]
    pub mode: MacvlanMode,
    /// The node interface the macvlan sits on (the one of the node's default route when
    /// absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master: Option<String>,
}

/// `spec.networkInterface.macvlan.mode`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
pub enum MacvlanMode {
    #[default]
    Bridge,
    Private,
    #[serde(rename = "VEPA")]
    Vepa,
    Passthru,
}

/// One of `spec.addresses`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct EgressRouterAddress {
    /// The reserved address with the prefix of its network (`192.168.12.99/24`).
    pub ip: String,
    /// The next hop on that network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
}

/// `status` of an EgressRouter, written by the controller.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct EgressRouterStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<EgressRouterCondition>,
}

/// One of `status.conditions`: `Available`, `Progressing` or `Degraded`.
#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EgressRouterCondition {
    #[serde(rename = "type")]
    pub type_: ConditionType,
    pub status: ConditionStatus,
    pub last_transition_time: Time,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
pub enum ConditionType {
    Available,
    Progressing,
    Degraded,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}
