//! OVN-Kubernetes' `EgressIP` (`k8s.ovn.org/v1`, cluster-scoped) as the API serves it, and
//! what its validation checks beyond the API server's schema: the manifest and API sources
//! accept or reject each object with the field named, and the CRD under `deploy/crds/` is
//! generated from this type.

use std::{collections::BTreeSet, net::IpAddr};

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
