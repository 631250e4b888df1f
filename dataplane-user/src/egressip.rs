//! OVN-Kubernetes' `EgressIP` (`k8s.ovn.org/v1`, cluster-scoped): the source addresses that
//! pods selected by namespace (and optionally pod) labels leave the cluster with. The type and
//! its validation live here so that the manifest and API sources accept or reject the objects,
//! naming the field, and the CRD under `deploy/crds/` is generated from it.
//!
//! The feature has three parts: `assign` is the cluster-wide decision of which node holds which
//! address (the controller writes it to `status.items`); `compile` turns the status, the pods
//! and the namespaces into one node's egress maps; the kernel side (`egressip` in
//! `dataplane-ebpf`) reroutes selected pods' external traffic to the holder, which translates
//! it to the egress address and answers ARP for it.

pub mod assign;
pub mod compile;
pub mod controller;
pub mod leader;
pub mod node;
pub mod probe;

/// Without an API server, the controller writes the objects' status here, under the manifest
/// directory (the agents read it; a status in the manifests themselves is replaced by it).
pub const STATUS_FILE: &str = "egressip-status/status.json";

/// The status file: each object's `status`, by object name.
pub type StatusFile = std::collections::BTreeMap<String, EgressIpStatus>;

/// The status file under `dir`; `None` when there is none (or it does not parse: it is
/// written whole by rename, so that means it is not ours).
pub fn read_status_file(dir: &std::path::Path) -> Option<StatusFile> {
    let text = std::fs::read_to_string(dir.join(STATUS_FILE)).ok()?;
    serde_json::from_str(&text).ok()
}

/// Writes the status file whole (a temporary file renamed over it), so a reader sees the old
/// or the new one, never a part.
pub fn write_status_file(dir: &std::path::Path, statuses: &StatusFile) -> std::io::Result<()> {
    let path = dir.join(STATUS_FILE);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let partial = path.with_extension("json.partial");
    std::fs::write(&partial, serde_json::to_vec_pretty(statuses)?)?;
    std::fs::rename(&partial, &path)
}

/// Gives each object the status the file has for it (none when the file names it not).
pub fn merge_status(objects: &mut [Arc<EgressIP>], statuses: &StatusFile) {
    for object in objects {
        let name = object.metadata.name.as_deref().unwrap_or_default();
        let status = statuses.get(name).cloned();
        if object.status != status {
            Arc::make_mut(object).status = status;
        }
    }
}

use std::{collections::BTreeSet, net::IpAddr, sync::Arc};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `spec` of an EgressIP.
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[kube(
    group = "k8s.ovn.org",
    version = "v1",
    kind = "EgressIP",
    plural = "egressips",
    status = "EgressIpStatus",
    shortname = "eip",
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase")]
pub struct EgressIpSpec {
    /// The addresses the selected pods' traffic leaves the cluster with (IPv4 or IPv6).
    #[serde(rename = "egressIPs")]
    pub egress_ips: Vec<String>,
    /// Namespaces whose pods use these addresses.
    pub namespace_selector: LabelSelector,
    /// Within those namespaces, only the pods it selects (all when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
}

/// `status` of an EgressIP: which node holds which address.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct EgressIpStatus {
    #[serde(default)]
    pub items: Vec<EgressIpStatusItem>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EgressIpStatusItem {
    pub node: String,
    #[serde(rename = "egressIP")]
    pub egress_ip: String,
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

/// Checks what the API server's schema cannot: the addresses parse and are unique, and the
/// selectors use known operators with values where they need them. The error names the field;
/// the caller names the object (file and name, or API path).
pub fn validate(object: &EgressIP) -> Result<(), String> {
    let fail = |field: String, what: String| Err(format!("{field}: {what}"));
    if object.spec.egress_ips.is_empty() {
        return fail(
            "spec.egressIPs".into(),
            "at least one address is required".into(),
        );
    }
    let mut seen = BTreeSet::new();
    for (i, text) in object.spec.egress_ips.iter().enumerate() {
        let field = format!("spec.egressIPs[{i}]");
        match text.parse::<IpAddr>() {
            Err(_) => return fail(field, format!("{text:?} is not an IP address")),
            Ok(ip) if ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() => {
                return fail(field, format!("{ip} cannot be a source address"));
            }
            Ok(ip) if !seen.insert(ip) => return fail(field, format!("{ip} is listed twice")),
            Ok(_) => {}
        }
    }
    validate_selector(&object.spec.namespace_selector)
        .or_else(|what| fail("spec.namespaceSelector".into(), what))?;
    if let Some(selector) = &object.spec.pod_selector {
        validate_selector(selector).or_else(|what| fail("spec.podSelector".into(), what))?;
    }
    Ok(())
}

/// A label selector's expressions: a known operator, values exactly where it needs them.
pub fn validate_selector(selector: &LabelSelector) -> Result<(), String> {
    for (i, requirement) in selector.match_expressions.iter().flatten().enumerate() {
        let values = requirement.values.as_deref().unwrap_or_default();
        let problem = match requirement.operator.as_str() {
            "In" | "NotIn" if values.is_empty() => Some("needs values"),
            "Exists" | "DoesNotExist" if !values.is_empty() => Some("takes no values"),
            "In" | "NotIn" | "Exists" | "DoesNotExist" => None,
            _ => Some("is not In, NotIn, Exists or DoesNotExist"),
        };
        if let Some(problem) = problem {
            return Err(format!(
                "matchExpressions[{i}]: operator {:?} {problem}",
                requirement.operator
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> EgressIP {
        serde_yaml::from_str(yaml).expect("EgressIP parses")
    }

    const GOOD: &str = r"apiVersion: k8s.ovn.org/v1
kind: EgressIP
metadata: {name: egressip-prod}
spec:
  egressIPs: [172.18.0.33, 'fd00::33']
  namespaceSelector:
    matchLabels: {env: prod}
  podSelector:
    matchExpressions: [{key: app, operator: In, values: [web]}]
status:
  items: [{node: node-1, egressIP: 172.18.0.33}]
";

    #[test]
    fn the_upstream_example_parses_and_validates() {
        let object = parse(GOOD);
        assert_eq!(object.spec.egress_ips, ["172.18.0.33", "fd00::33"]);
        assert_eq!(
            object.status.as_ref().map(|s| s.items[0].node.as_str()),
            Some("node-1")
        );
        assert_eq!(validate(&object), Ok(()));
    }

    #[test]
    fn bad_fields_are_named() {
        let cases = [
            (
                "egressIPs: [172.18.0.33, 'fd00::33']",
                "egressIPs: []",
                "spec.egressIPs: at least one",
            ),
            (
                "egressIPs: [172.18.0.33, 'fd00::33']",
                "egressIPs: [172.18.0.333]",
                "spec.egressIPs[0]: \"172.18.0.333\" is not an IP",
            ),
            (
                "egressIPs: [172.18.0.33, 'fd00::33']",
                "egressIPs: [172.18.0.33, 172.18.0.33]",
                "spec.egressIPs[1]: 172.18.0.33 is listed twice",
            ),
            (
                "egressIPs: [172.18.0.33, 'fd00::33']",
                "egressIPs: ['::']",
                "spec.egressIPs[0]: :: cannot be a source address",
            ),
            (
                "operator: In, values: [web]",
                "operator: In",
                "spec.podSelector: matchExpressions[0]: operator \"In\" needs values",
            ),
            (
                "operator: In, values: [web]",
                "operator: Has, values: [web]",
                "spec.podSelector: matchExpressions[0]: operator \"Has\" is not In",
            ),
        ];
        for (from, to, expected) in cases {
            let error = validate(&parse(&GOOD.replace(from, to))).expect_err(to);
            assert!(error.starts_with(expected), "{error} is not {expected}...");
        }
    }
}
