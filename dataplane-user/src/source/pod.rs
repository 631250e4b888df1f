//! The parts of a Pod the dataplane reads, decoded without the rest.

use k8s_openapi::{
    api::core::v1::{ContainerPort, PodIP},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde::Deserialize;

use super::document::Document;

/// A Pod as the agent keeps it: its metadata, `spec.nodeName` and `hostNetwork`, the
/// containers' named ports (what policies' named ports resolve to), `status.phase` and the
/// pod's addresses, under the field names of k8s-openapi's `Pod`. Nothing reads the rest
/// (images, environment, volumes, conditions, container statuses): it is skipped as it is
/// read, never allocated. k8s-openapi's `Pod` is 2,176 bytes however little it holds: at
/// 150,000 pods that was 310 MiB, and touching that fresh memory a fifth of the first
/// decode; this one is a quarter of that size. The fields it has are checked as strictly
/// as the whole type checks them (`containers` is required, as there).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Pod {
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: Option<PodSpec>,
    pub status: Option<PodStatus>,
}

// The Pod resource (`v1`, `pods`), so that it is keyed and compared as the other kinds are.
impl k8s_openapi::Resource for Pod {
    const API_VERSION: &'static str = "v1";
    const GROUP: &'static str = "";
    const KIND: &'static str = "Pod";
    const VERSION: &'static str = "v1";
    const URL_PATH_SEGMENT: &'static str = "pods";
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::Metadata for Pod {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// The part of a Pod's `spec` the agent reads (see [`Pod`]).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    pub node_name: Option<String>,
    pub host_network: Option<bool>,
    /// Only the containers with a named port are kept (see [`Pod::decode`]).
    pub containers: Vec<Container>,
}

/// A container of a [`PodSpec`]: its name and ports.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Container {
    pub name: String,
    pub ports: Option<Vec<ContainerPort>>,
}

/// The part of a Pod's `status` the agent reads (see [`Pod`]).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct PodStatus {
    pub phase: Option<String>,
    #[serde(rename = "podIP")]
    pub pod_ip: Option<String>,
    #[serde(rename = "podIPs")]
    pub pod_ips: Option<Vec<PodIP>>,
}

impl Pod {
    /// The pod a document holds, without what the agent keeps no use for: its containers
    /// without a named port, its ports without a name, its `managedFields`.
    pub(super) fn decode(document: impl Document) -> Result<Self, String> {
        let mut pod: Pod = document.decode()?;
        pod.metadata.managed_fields = None;
        if let Some(spec) = &mut pod.spec {
            for container in &mut spec.containers {
                if let Some(ports) = &mut container.ports {
                    ports.retain(|port| port.name.is_some());
                }
            }
            spec.containers
                .retain(|container| container.ports.as_ref().is_some_and(|p| !p.is_empty()));
            spec.containers.shrink_to_fit();
        }
        Ok(pod)
    }
}
