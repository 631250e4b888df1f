//! The custom resource definitions the project ships in `deploy/crds/`, generated from the Rust
//! types the agent decodes, so that what the API server validates and what the agent reads
//! cannot drift apart. `dataplane crds --write deploy/crds` (run by `cargo xtask crds`) writes
//! them; a test checks the committed files against them and never writes.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt as _;

use crate::api::{
    adminpolicy::{AdminNetworkPolicy, BaselineAdminNetworkPolicy, ClusterNetworkPolicy},
    egressfirewall::EgressFirewall,
    egressip::EgressIP,
    egressrouter::EgressRouter,
    userdefinednetwork::{ClusterUserDefinedNetwork, UserDefinedNetwork},
};

/// Every shipped CRD with its file name under `deploy/crds/` (`<group>_<plural>.yaml`).
pub fn shipped() -> Vec<(String, CustomResourceDefinition)> {
    [
        EgressFirewall::crd(),
        EgressIP::crd(),
        EgressRouter::crd(),
        AdminNetworkPolicy::crd(),
        BaselineAdminNetworkPolicy::crd(),
        ClusterNetworkPolicy::crd(),
        UserDefinedNetwork::crd(),
        ClusterUserDefinedNetwork::crd(),
    ]
    .into_iter()
    .map(|crd| (file_name(&crd), crd))
    .collect()
}

/// `<group>_<plural>.yaml`, as controller-gen and the upstream projects name theirs.
fn file_name(crd: &CustomResourceDefinition) -> String {
    format!("{}_{}.yaml", crd.spec.group, crd.spec.names.plural)
}

/// A CRD as the file holds it.
pub fn to_yaml(crd: &CustomResourceDefinition) -> Result<String, serde_yaml::Error> {
    serde_yaml::to_string(crd)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The committed files are the generated ones. This only reads: `cargo xtask crds`
    /// rewrites them, and a run that regenerates never checks its own output.
    #[test]
    fn the_shipped_crds_are_the_ones_generated_from_the_types() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/crds");
        let mut stale = Vec::new();
        let mut names = Vec::new();
        for (file, crd) in shipped() {
            let generated = to_yaml(&crd).expect("CRD serializes");
            let path = format!("{dir}/{file}");
            let committed = std::fs::read_to_string(&path)
                .unwrap_or_else(|error| panic!("{path}: {error}; run cargo xtask crds"));
            if committed != generated {
                stale.push(path);
            }
            names.push(file);
        }
        assert!(
            stale.is_empty(),
            "stale: {stale:?}; regenerate them with cargo xtask crds"
        );
        // Nothing in the directory that is no longer generated.
        let mut present: Vec<String> = std::fs::read_dir(dir)
            .expect("deploy/crds")
            .map(|entry| {
                entry
                    .expect("entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        present.sort();
        names.sort();
        assert_eq!(
            present, names,
            "deploy/crds holds exactly the generated CRDs"
        );
    }

    #[test]
    fn file_names_follow_group_and_plural() {
        let names: Vec<String> = shipped().into_iter().map(|(file, _)| file).collect();
        assert_eq!(
            names,
            [
                "k8s.ovn.org_egressfirewalls.yaml",
                "k8s.ovn.org_egressips.yaml",
                "network.operator.openshift.io_egressrouters.yaml",
                "policy.networking.k8s.io_adminnetworkpolicies.yaml",
                "policy.networking.k8s.io_baselineadminnetworkpolicies.yaml",
                "policy.networking.k8s.io_clusternetworkpolicies.yaml",
                "k8s.ovn.org_userdefinednetworks.yaml",
                "k8s.ovn.org_clusteruserdefinednetworks.yaml",
            ]
        );
    }
}
