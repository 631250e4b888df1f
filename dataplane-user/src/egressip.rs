//! Egress IPs (OVN-Kubernetes' `EgressIP`, `k8s.ovn.org/v1`, cluster-scoped): the source
//! addresses that pods selected by namespace (and optionally pod) labels leave the cluster
//! with. The type and its validation are in `api::egressip`; here, the feature.
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

use std::sync::Arc;

use crate::api::egressip::{EgressIP, EgressIpStatus};

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
