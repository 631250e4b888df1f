//! OVN-Kubernetes' `EgressFirewall` (`k8s.ovn.org/v1`, namespaced) as the API serves it. Its
//! rules are checked where they are translated (`acl::firewall`), which rejects an object
//! whole and names the rule.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The name of the one EgressFirewall per namespace that counts.
pub const FIREWALL_NAME: &str = "default";

/// `spec` of an EgressFirewall.
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[kube(
    group = "k8s.ovn.org",
    version = "v1",
    kind = "EgressFirewall",
    plural = "egressfirewalls",
    namespaced,
    status = "EgressFirewallStatus",
    shortname = "egressfirewall",
    derive = "PartialEq"
)]
pub struct EgressFirewallSpec {
    /// Rules in evaluation order; the first one matching a packet decides.
    pub egress: Vec<EgressFirewallRule>,
}

/// One rule of `spec.egress`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct EgressFirewallRule {
    /// `Allow` or `Deny`.
    #[serde(rename = "type")]
    pub type_: String,
    pub to: EgressFirewallDestination,
    /// Protocols and ports the rule is limited to; empty or absent: all traffic.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<EgressFirewallPort>,
}

/// Where a rule applies: exactly one of `cidrSelector` and `dnsName` (resolved by each agent
/// with its node's resolver, and again when the answer's TTL runs out).
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EgressFirewallDestination {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cidr_selector: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_name: Option<String>,
}

/// A protocol (`TCP`, `UDP` or `SCTP`) and optionally one port of it.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct EgressFirewallPort {
    pub protocol: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
}

/// What the agent reports about the object.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct EgressFirewallStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub messages: Vec<String>,
}
