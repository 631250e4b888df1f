//! One object decoded by its `apiVersion` and `kind` into the store, or refused with the
//! file (or API path), kind, name and field named.

use std::sync::Arc;

use k8s_openapi::api::{
    core::v1::{Namespace, Node, Service},
    discovery::v1::EndpointSlice,
    networking::v1::NetworkPolicy,
};
use serde::Deserialize as _;

use super::{document::Document, pod::Pod, state::ClusterState};
use crate::api::{
    adminpolicy::{AdminNetworkPolicy, BaselineAdminNetworkPolicy, ClusterNetworkPolicy},
    egressfirewall::EgressFirewall,
    egressip::{self, EgressIP},
    egressrouter::EgressRouter,
    network::{NetworkConfig, NetworkOperator},
    userdefinednetwork::{self, ClusterUserDefinedNetwork, UserDefinedNetwork},
};

/// The label linking an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// The namespace and Service name an EndpointSlice belongs to (its
/// `kubernetes.io/service-name` label).
pub fn slice_service(slice: &EndpointSlice) -> Option<(&str, &str)> {
    let namespace = slice.metadata.namespace.as_deref().unwrap_or("default");
    let name = slice.metadata.labels.as_ref()?.get(SERVICE_NAME_LABEL)?;
    Some((namespace, name))
}

/// Adds every document of one manifest file to `state`.
pub fn add_documents(state: &mut ClusterState, file: &str, text: &str) {
    let mut last_fault = None;
    for document in serde_yaml::Deserializer::from_str(text) {
        // serde_yaml 0.9 panics on some malformed streams (an event it does not expect: the
        // object fuzzer found one); a manifest must never stop the agent. The rest of the
        // file is refused with it: the parser's state past a panic is not to be trusted.
        let parsed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            serde_yaml::Value::deserialize(document)
        }));
        let Ok(parsed) = parsed else {
            state.rejected.push(format!(
                "{file}: not YAML: the parser gave up; the rest of the file is skipped"
            ));
            break;
        };
        let value = match parsed {
            Ok(serde_yaml::Value::Null) => continue,
            Ok(value) => value,
            Err(e) => {
                let fault = format!("{file}: not YAML: {e}");
                // A document that is YAML but not a value (a key twice) leaves the parser
                // at the next one; a syntax fault stops it, and its iterator then yields the
                // same error for ever: taken as a new one each time, a broken manifest hung
                // the agent.
                if last_fault.as_ref() == Some(&fault) {
                    break;
                }
                state.rejected.push(fault.clone());
                last_fault = Some(fault);
                continue;
            }
        };
        add_object(state, file, value);
    }
}

/// How a refusal names an object's kind: by its kind, group-qualified where two groups' kinds
/// share the name (OpenShift's two `Network`s).
fn kind_label<'a>(api_version: &str, kind: &'a str) -> std::borrow::Cow<'a, str> {
    match api_version.split_once('/') {
        Some((group, _)) if kind == "Network" && group != "operator.openshift.io" => {
            format!("{kind}.{group}").into()
        }
        _ => kind.into(),
    }
}

/// Adds one object (any kind; kinds the dataplane does not use are skipped) to `state`,
/// rejecting it by `origin`, kind and name when it does not parse or validate.
pub fn add_object<D: Document>(state: &mut ClusterState, file: &str, value: D) {
    let field = |key: &str| value.text(&[key]).unwrap_or_default().to_owned();
    let (api_version, kind) = (field("apiVersion"), field("kind"));
    let name = value
        .text(&["metadata", "name"])
        .unwrap_or("<unnamed>")
        .to_owned();
    let reject = |state: &mut ClusterState, error: String| {
        tracing::warn!(
            file,
            api_version,
            kind,
            name,
            error,
            "manifest object rejected"
        );
        let kind = kind_label(&api_version, &kind);
        state
            .rejected
            .push(format!("{file}: {kind} {name}: {error}"));
    };
    match (api_version.as_str(), kind.as_str()) {
        ("v1", "Node") => match value.decode::<Node>() {
            Ok(node) => state.nodes.push(Arc::new(node)),
            Err(e) => reject(state, e),
        },
        ("v1", "Namespace") => match value.decode::<Namespace>() {
            Ok(namespace) => state.namespaces.push(Arc::new(namespace)),
            Err(e) => reject(state, e),
        },
        ("v1", "Pod") => match Pod::decode(value) {
            Ok(pod) => state.pods.push(Arc::new(pod)),
            Err(e) => reject(state, e),
        },
        ("v1", "Service") => match value.decode::<Service>() {
            Ok(service) => state.services.push(Arc::new(service)),
            Err(e) => reject(state, e),
        },
        ("discovery.k8s.io/v1", "EndpointSlice") => match value.decode::<EndpointSlice>() {
            Ok(slice) => state.endpoint_slices.push(Arc::new(slice)),
            Err(e) => reject(state, e),
        },
        ("networking.k8s.io/v1", "NetworkPolicy") => match value.decode::<NetworkPolicy>() {
            Ok(mut policy) => {
                policy
                    .metadata
                    .namespace
                    .get_or_insert_with(|| "default".into());
                state.network_policies.push(Arc::new(policy));
            }
            Err(e) => reject(state, e),
        },
        ("k8s.ovn.org/v1", "EgressFirewall") => match value.decode::<EgressFirewall>() {
            Ok(mut firewall) => {
                firewall
                    .metadata
                    .namespace
                    .get_or_insert_with(|| "default".into());
                state.egress_firewalls.push(Arc::new(firewall));
            }
            Err(e) => reject(state, e),
        },
        ("policy.networking.k8s.io/v1alpha1", "AdminNetworkPolicy") => {
            match value.decode::<AdminNetworkPolicy>() {
                Ok(policy) => state.admin_network_policies.push(Arc::new(policy)),
                Err(e) => reject(state, e),
            }
        }
        ("policy.networking.k8s.io/v1alpha1", "BaselineAdminNetworkPolicy") => {
            match value.decode::<BaselineAdminNetworkPolicy>() {
                Ok(policy) => state.baseline_admin_network_policies.push(Arc::new(policy)),
                Err(e) => reject(state, e),
            }
        }
        ("policy.networking.k8s.io/v1alpha2", "ClusterNetworkPolicy") => {
            match value.decode::<ClusterNetworkPolicy>() {
                Ok(policy) => state.cluster_network_policies.push(Arc::new(policy)),
                Err(e) => reject(state, e),
            }
        }
        ("k8s.ovn.org/v1", "EgressIP") => match value.decode::<EgressIP>() {
            Ok(egress_ip) => match egressip::validate(&egress_ip) {
                Ok(()) => state.egress_ips.push(Arc::new(egress_ip)),
                Err(error) => reject(state, error),
            },
            Err(e) => reject(state, e),
        },
        // Checked where the controller makes the router's objects: its status names the field.
        ("network.operator.openshift.io/v1", "EgressRouter") => {
            match value.decode::<EgressRouter>() {
                Ok(mut router) => {
                    router
                        .metadata
                        .namespace
                        .get_or_insert_with(|| "default".into());
                    state.egress_routers.push(Arc::new(router));
                }
                Err(e) => reject(state, e),
            }
        }
        // Kept when they do not validate too (refused by name all the same): the controller
        // writes why into their status; what uses a network checks it first.
        ("k8s.ovn.org/v1", "UserDefinedNetwork") => match value.decode::<UserDefinedNetwork>() {
            Ok(mut network) => {
                if let Err(error) = userdefinednetwork::validate_udn(&network) {
                    reject(state, error);
                }
                network
                    .metadata
                    .namespace
                    .get_or_insert_with(|| "default".into());
                state.user_defined_networks.push(Arc::new(network));
            }
            Err(e) => reject(state, e),
        },
        ("k8s.ovn.org/v1", "ClusterUserDefinedNetwork") => {
            match value.decode::<ClusterUserDefinedNetwork>() {
                Ok(network) => {
                    if let Err(error) = userdefinednetwork::validate_cudn(&network) {
                        reject(state, error);
                    }
                    state.cluster_user_defined_networks.push(Arc::new(network));
                }
                Err(e) => reject(state, e),
            }
        }
        ("operator.openshift.io/v1", "Network") => match value.decode::<NetworkOperator>() {
            Ok(network) if network.is_the_cluster_network() => match network.validate() {
                Ok(network) => {
                    for line in &network.not_applied {
                        reject(state, line.clone());
                    }
                    state.hybrid = network.hybrid;
                    state.policy_audit = network.policy_audit;
                    state.egress_ip_config = network.egress_ip;
                    state.network = Some(network.overlay);
                    state.cluster_networks = network.cluster_networks;
                    state.subnet_pools = network.subnet_pools;
                    state.service_networks = network.service_networks;
                }
                Err(error) => reject(state, error),
            },
            Ok(_) => tracing::info!(file, name, "Network other than `cluster` ignored"),
            Err(e) => reject(state, e),
        },
        ("config.openshift.io/v1", "Network") => match value.decode::<NetworkConfig>() {
            Ok(config) if config.is_the_cluster_network() => match config.validate() {
                Ok(platform) => {
                    for line in &platform.not_applied {
                        reject(state, line.clone());
                    }
                    state.platform = Some(platform);
                }
                Err(error) => reject(state, error),
            },
            Ok(_) => tracing::info!(file, name, "Network other than `cluster` ignored"),
            Err(e) => reject(state, e),
        },
        _ => tracing::info!(
            file,
            api_version,
            kind,
            name,
            "kind not used by the dataplane, skipped"
        ),
    }
}
