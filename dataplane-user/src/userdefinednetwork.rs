//! The user-defined networks' status, written by the controller's leader as OVN-Kubernetes'
//! network controller writes it: one `NetworkCreated` condition on each UserDefinedNetwork and
//! ClusterUserDefinedNetwork, `True` once the network is carried, else `False` with reason
//! `SyncError` and a message that says why.
//!
//! This dataplane does not carry user-defined networks yet (the agent refuses the pods of
//! their namespaces, CNI error 105), so every network is `False` / `SyncError`; the message
//! says what an operator needs to know first: the field that does not validate (or the
//! cluster range a subnet overlaps, as upstream checks), the namespace label a primary
//! network needs, the namespaces a network selects, another
//! network that already gives a namespace its primary network. Each network's status is
//! written on its own, every call within [`crate::kubernetes::CALL_DEADLINE`], in a task of
//! its own beside the egress IP rounds.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    time::Duration,
};

use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::Timestamp,
};
use kube::{
    Api,
    api::{Patch, PatchParams},
    core::{Selector, SelectorExt as _},
};

use crate::{
    acl::pods::{NamespaceLabels, namespace_labels},
    api::userdefinednetwork::{
        ClusterUserDefinedNetwork, NetworkStatus, PRIMARY_NETWORK_LABEL, UserDefinedNetwork,
        clear_of_cluster, validate_cudn, validate_udn,
    },
    kubernetes::within,
    source::ClusterState,
};

/// The condition upstream writes on both kinds.
pub const NETWORK_CREATED: &str = "NetworkCreated";
/// The reason of a network that is not created.
pub const SYNC_ERROR: &str = "SyncError";
/// At most this many namespaces are named in one message (a selector may pick thousands).
const NAMED: usize = 10;
/// Rounds are at least this far apart: the leader's state changes with every object.
const PACE: Duration = Duration::from_secs(1);
/// A round with a failed write is tried again after this long, even if nothing changed.
const RETRY: Duration = Duration::from_secs(10);

/// A user-defined network by kind and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum NetworkKey {
    /// A UserDefinedNetwork: its namespace and name.
    Namespaced(String, String),
    /// A ClusterUserDefinedNetwork: its name.
    Cluster(String),
}

impl fmt::Display for NetworkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NetworkKey::Namespaced(namespace, name) => {
                write!(f, "UserDefinedNetwork {namespace}/{name}")
            }
            NetworkKey::Cluster(name) => write!(f, "ClusterUserDefinedNetwork {name}"),
        }
    }
}

/// What a round knows of one network: its generation, the status the API served, and why it
/// is not created.
#[derive(Clone, Debug, PartialEq)]
pub struct NotCreated {
    pub generation: Option<i64>,
    pub served: Option<NetworkStatus>,
    pub message: String,
}

/// The namespaces a valid ClusterUserDefinedNetwork selects, or why it is not valid.
type Selected<'a> = Result<Vec<&'a str>, String>;

/// Every network of `state` with the reason it is not created.
pub fn not_created(state: &ClusterState) -> BTreeMap<NetworkKey, NotCreated> {
    let labels = namespace_labels(&state.namespaces);
    let (cluster_networks, service_networks) = (&state.cluster_networks, &state.service_networks);
    let udns: Vec<(NetworkKey, &UserDefinedNetwork, Result<(), String>)> = state
        .user_defined_networks
        .iter()
        .map(|udn| {
            let key = NetworkKey::Namespaced(
                udn.metadata
                    .namespace
                    .clone()
                    .unwrap_or_else(|| "default".into()),
                udn.metadata.name.clone().unwrap_or_default(),
            );
            let valid = validate_udn(udn).and_then(|network| {
                clear_of_cluster("spec", &network, cluster_networks, service_networks)
            });
            (key, &**udn, valid)
        })
        .collect();
    let cudns: Vec<(NetworkKey, &ClusterUserDefinedNetwork, Selected)> = state
        .cluster_user_defined_networks
        .iter()
        .map(|cudn| {
            let key = NetworkKey::Cluster(cudn.metadata.name.clone().unwrap_or_default());
            let selected = validate_cudn(cudn)
                .and_then(|network| {
                    clear_of_cluster("spec.network", &network, cluster_networks, service_networks)
                })
                .and_then(|()| selected(cudn, &labels));
            (key, &**cudn, selected)
        })
        .collect();
    // Which valid networks give each namespace its primary network: more than one is a
    // conflict that each of them reports.
    let mut givers: BTreeMap<&str, Vec<&NetworkKey>> = BTreeMap::new();
    for (key, _, valid) in &udns {
        if let (NetworkKey::Namespaced(namespace, _), Ok(())) = (key, valid) {
            givers.entry(namespace).or_default().push(key);
        }
    }
    for (key, _, selected) in &cudns {
        for namespace in selected.iter().flatten() {
            givers.entry(namespace).or_default().push(key);
        }
    }
    let others = |namespace: &str, key: &NetworkKey| -> Vec<String> {
        givers
            .get(namespace)
            .into_iter()
            .flatten()
            .filter(|other| **other != key)
            .map(|other| other.to_string())
            .collect()
    };
    let mut out = BTreeMap::new();
    for (key, udn, valid) in &udns {
        let NetworkKey::Namespaced(namespace, _) = key else {
            continue;
        };
        let message = match valid {
            Err(error) => format!("invalid: {error}"),
            Ok(()) => udn_message(
                namespace,
                labelled(&labels, namespace),
                &others(namespace, key),
            ),
        };
        out.insert(
            key.clone(),
            NotCreated {
                generation: udn.metadata.generation,
                served: udn.status.clone(),
                message,
            },
        );
    }
    for (key, cudn, selected) in &cudns {
        let message = match selected {
            Err(error) => format!("invalid: {error}"),
            Ok(namespaces) => cudn_message(namespaces, &labels, |namespace| others(namespace, key)),
        };
        out.insert(
            key.clone(),
            NotCreated {
                generation: cudn.metadata.generation,
                served: cudn.status.clone(),
                message,
            },
        );
    }
    out
}

fn labelled(labels: &NamespaceLabels, namespace: &str) -> bool {
    labels
        .get(namespace)
        .is_some_and(|l| l.contains_key(PRIMARY_NETWORK_LABEL))
}

/// The namespaces a ClusterUserDefinedNetwork's selector picks.
fn selected<'a>(
    cudn: &ClusterUserDefinedNetwork,
    labels: &'a NamespaceLabels,
) -> Result<Vec<&'a str>, String> {
    let selector = Selector::try_from(cudn.spec.namespace_selector.clone())
        .map_err(|error| format!("spec.namespaceSelector: {error}"))?;
    Ok(labels
        .iter()
        .filter(|(_, labels)| selector.matches(labels))
        .map(|(name, _)| name.as_str())
        .collect())
}

fn udn_message(namespace: &str, labelled: bool, others: &[String]) -> String {
    let mut parts = Vec::new();
    if !others.is_empty() {
        parts.push(format!(
            "namespace {namespace} also takes a primary network from {}: a namespace has one",
            others.join(", ")
        ));
    }
    if labelled {
        parts.push(format!(
            "primary user-defined networks are not carried by this dataplane yet: the pods of namespace {namespace} get no interface (CNI error 105) rather than the default network"
        ));
    } else {
        parts.push(format!(
            "namespace {namespace} lacks the label {PRIMARY_NETWORK_LABEL}, which a primary network needs from the namespace's creation: its pods stay on the default network"
        ));
    }
    parts.join("; ")
}

fn cudn_message(
    namespaces: &[&str],
    labels: &NamespaceLabels,
    others: impl Fn(&str) -> Vec<String>,
) -> String {
    if namespaces.is_empty() {
        return "its namespace selector selects no namespace".to_owned();
    }
    let mut parts = Vec::new();
    let conflicts: BTreeSet<String> = namespaces
        .iter()
        .flat_map(|namespace| {
            others(namespace)
                .into_iter()
                .map(move |other| format!("namespace {namespace} from {other}"))
        })
        .collect();
    if !conflicts.is_empty() {
        parts.push(format!(
            "other networks also give a primary network to {}: a namespace has one",
            named(conflicts.iter().map(String::as_str))
        ));
    }
    let (with, without): (Vec<&str>, Vec<&str>) = namespaces
        .iter()
        .partition(|namespace| labelled(labels, namespace));
    if !without.is_empty() {
        parts.push(format!(
            "namespaces {} lack the label {PRIMARY_NETWORK_LABEL}, which a primary network needs from the namespace's creation: their pods stay on the default network",
            named(without.iter().copied())
        ));
    }
    if !with.is_empty() {
        parts.push(format!(
            "primary user-defined networks are not carried by this dataplane yet: the pods of namespaces {} get no interface (CNI error 105) rather than the default network",
            named(with.iter().copied())
        ));
    }
    parts.join("; ")
}

/// The first [`NAMED`] of `names`, and how many more.
fn named<'a>(names: impl ExactSizeIterator<Item = &'a str>) -> String {
    let total = names.len();
    let shown: Vec<&str> = names.take(NAMED).collect();
    match total - shown.len() {
        0 => shown.join(", "),
        more => format!("{} and {more} more", shown.join(", ")),
    }
}

/// The status of a network not created with `message`, keeping the condition's
/// `lastTransitionTime` from `previous` where its status did not change.
pub fn status(
    previous: Option<&NetworkStatus>,
    message: String,
    generation: Option<i64>,
    now: Timestamp,
) -> NetworkStatus {
    let since = previous
        .into_iter()
        .flat_map(|status| &status.conditions)
        .find(|c| c.type_ == NETWORK_CREATED && c.status == "False")
        .map_or(now, |c| c.last_transition_time.0);
    NetworkStatus {
        conditions: vec![Condition {
            type_: NETWORK_CREATED.to_owned(),
            status: "False".to_owned(),
            reason: SYNC_ERROR.to_owned(),
            message,
            observed_generation: generation,
            last_transition_time: Time(since),
        }],
    }
}

/// Where the networks' status is written.
pub trait NetworkApi {
    fn write_status(
        &mut self,
        network: &NetworkKey,
        status: &NetworkStatus,
    ) -> impl Future<Output = Result<(), String>>;
}

/// The API server: a merge patch of the status subresource.
pub struct KubeNetworks {
    pub client: kube::Client,
}

impl NetworkApi for KubeNetworks {
    async fn write_status(
        &mut self,
        network: &NetworkKey,
        status: &NetworkStatus,
    ) -> Result<(), String> {
        let patch = Patch::Merge(serde_json::json!({ "status": status }));
        let params = PatchParams::default();
        let what = format!("{network} status");
        match network {
            NetworkKey::Namespaced(namespace, name) => {
                let api: Api<UserDefinedNetwork> = Api::namespaced(self.client.clone(), namespace);
                within(&what, api.patch_status(name, &params, &patch))
                    .await
                    .map(|_| ())
            }
            NetworkKey::Cluster(name) => {
                let api: Api<ClusterUserDefinedNetwork> = Api::all(self.client.clone());
                within(&what, api.patch_status(name, &params, &patch))
                    .await
                    .map(|_| ())
            }
        }
    }
}

/// The leader's status writer: what it wrote last of each network (newer than what the watch
/// brought back).
#[derive(Default)]
pub struct Reconciler {
    written: BTreeMap<NetworkKey, NetworkStatus>,
}

impl Reconciler {
    /// Writes each network's status where it differs from what it has; whether every write
    /// went through.
    pub async fn round(
        &mut self,
        state: &ClusterState,
        api: &mut impl NetworkApi,
        now: Timestamp,
    ) -> bool {
        let networks = not_created(state);
        let mut all_written = true;
        for (key, network) in &networks {
            let previous = self.written.get(key).or(network.served.as_ref());
            let wanted = status(previous, network.message.clone(), network.generation, now);
            if previous == Some(&wanted) {
                continue;
            }
            match api.write_status(key, &wanted).await {
                Ok(()) => {
                    tracing::info!(network = %key, message = network.message, "network status written");
                    self.written.insert(key.clone(), wanted);
                }
                Err(error) => {
                    tracing::warn!(network = %key, %error, "writing the network's status");
                    all_written = false;
                }
            }
        }
        self.written.retain(|key, _| networks.contains_key(key));
        all_written
    }
}

/// Runs the status writer on the states `states` brings while it brings `Some` (the leader's
/// state), a round per change at most every [`PACE`], failed writes tried again after
/// [`RETRY`]; stands by on `None`.
pub async fn run(
    mut states: tokio::sync::watch::Receiver<Option<ClusterState>>,
    mut api: impl NetworkApi,
) {
    let mut reconciler: Option<Reconciler> = None;
    loop {
        let state = states.borrow_and_update().clone();
        let mut retry = false;
        match state {
            Some(state) => {
                let reconciler = reconciler.get_or_insert_with(Reconciler::default);
                retry = !reconciler.round(&state, &mut api, Timestamp::now()).await;
            }
            // A new leader starts from what the objects say.
            None => reconciler = None,
        }
        tokio::time::sleep(PACE).await;
        let changed = states.changed();
        let stopped = if retry {
            matches!(tokio::time::timeout(RETRY, changed).await, Ok(Err(_)))
        } else {
            changed.await.is_err()
        };
        // The sender gone: the controller is stopping.
        if stopped {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::add_documents;

    const CLUSTER: &str = r"
apiVersion: v1
kind: Namespace
metadata: {name: blue, labels: {k8s.ovn.org/primary-user-defined-network: ''}}
---
apiVersion: v1
kind: Namespace
metadata: {name: plain}
---
apiVersion: v1
kind: Namespace
metadata: {name: red-1, labels: {tenant: red, k8s.ovn.org/primary-user-defined-network: ''}}
---
apiVersion: v1
kind: Namespace
metadata: {name: red-2, labels: {tenant: red}}
---
apiVersion: k8s.ovn.org/v1
kind: UserDefinedNetwork
metadata: {name: tenant-blue, namespace: blue, generation: 1}
spec:
  topology: Layer3
  layer3: {role: Primary, subnets: [{cidr: 10.20.0.0/16}]}
---
apiVersion: k8s.ovn.org/v1
kind: UserDefinedNetwork
metadata: {name: unlabelled, namespace: plain, generation: 2}
spec:
  topology: Layer2
  layer2: {role: Primary, subnets: [10.30.0.0/16]}
---
apiVersion: k8s.ovn.org/v1
kind: UserDefinedNetwork
metadata: {name: overlapping, namespace: red-1, generation: 1}
spec:
  topology: Layer3
  layer3: {role: Primary, subnets: [{cidr: 10.40.0.0/16}, {cidr: 10.40.1.0/24}]}
---
apiVersion: k8s.ovn.org/v1
kind: ClusterUserDefinedNetwork
metadata: {name: red, generation: 3}
spec:
  namespaceSelector: {matchLabels: {tenant: red}}
  network:
    topology: Layer2
    layer2: {role: Primary, subnets: [10.50.0.0/16]}
---
apiVersion: k8s.ovn.org/v1
kind: ClusterUserDefinedNetwork
metadata: {name: nobody}
spec:
  namespaceSelector: {matchLabels: {tenant: green}}
  network:
    topology: Layer2
    layer2: {role: Primary, subnets: [10.60.0.0/16]}
";

    fn cluster() -> ClusterState {
        let mut state = ClusterState::default();
        add_documents(&mut state, "cluster.yaml", CLUSTER);
        state
    }

    fn udn(namespace: &str, name: &str) -> NetworkKey {
        NetworkKey::Namespaced(namespace.into(), name.into())
    }

    /// Every network gets its reason: the invalid one its field, the unlabelled namespace's
    /// its label, the selector's namespaces by label, and none is said to be created.
    #[test]
    fn each_network_is_told_why_it_is_not_created() {
        let networks = not_created(&cluster());
        let message = |key: &NetworkKey| networks[key].message.clone();
        assert_eq!(networks.len(), 5);
        assert_eq!(
            message(&udn("blue", "tenant-blue")),
            "primary user-defined networks are not carried by this dataplane yet: the pods of namespace blue get no interface (CNI error 105) rather than the default network"
        );
        assert_eq!(
            message(&udn("plain", "unlabelled")),
            "namespace plain lacks the label k8s.ovn.org/primary-user-defined-network, which a primary network needs from the namespace's creation: its pods stay on the default network"
        );
        assert!(
            message(&udn("red-1", "overlapping")).starts_with("invalid: spec.layer3.subnets[1]"),
            "{}",
            message(&udn("red-1", "overlapping"))
        );
        assert_eq!(
            message(&NetworkKey::Cluster("red".into())),
            "namespaces red-2 lack the label k8s.ovn.org/primary-user-defined-network, which a primary network needs from the namespace's creation: their pods stay on the default network; primary user-defined networks are not carried by this dataplane yet: the pods of namespaces red-1 get no interface (CNI error 105) rather than the default network"
        );
        assert_eq!(
            message(&NetworkKey::Cluster("nobody".into())),
            "its namespace selector selects no namespace"
        );
        assert_eq!(
            networks[&NetworkKey::Cluster("red".into())].generation,
            Some(3)
        );
    }

    /// A namespace given a primary network by its own network and a cluster one: both say so.
    #[test]
    fn two_networks_for_one_namespace_both_name_the_other() {
        let mut state = cluster();
        add_documents(
            &mut state,
            "more.yaml",
            r"
apiVersion: k8s.ovn.org/v1
kind: ClusterUserDefinedNetwork
metadata: {name: blue-too}
spec:
  namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: blue}}
  network:
    topology: Layer2
    layer2: {role: Primary, subnets: [10.70.0.0/16]}
",
        );
        let networks = not_created(&state);
        let own = &networks[&udn("blue", "tenant-blue")].message;
        assert!(
            own.starts_with(
                "namespace blue also takes a primary network from ClusterUserDefinedNetwork blue-too: a namespace has one; "
            ),
            "{own}"
        );
        let cluster = &networks[&NetworkKey::Cluster("blue-too".into())].message;
        assert!(
            cluster.starts_with(
                "other networks also give a primary network to namespace blue from UserDefinedNetwork blue/tenant-blue: a namespace has one; "
            ),
            "{cluster}"
        );
    }

    /// A round writes each status once, keeps the transition time, rewrites what changed, and
    /// tries a failed write again at the next round.
    #[tokio::test]
    async fn a_round_writes_what_changed_and_retries_what_failed() {
        #[derive(Default)]
        struct Memory {
            written: Vec<(NetworkKey, NetworkStatus)>,
            refuse: Option<NetworkKey>,
        }
        impl NetworkApi for Memory {
            async fn write_status(
                &mut self,
                network: &NetworkKey,
                status: &NetworkStatus,
            ) -> Result<(), String> {
                if self.refuse.as_ref() == Some(network) {
                    return Err("refused".into());
                }
                self.written.push((network.clone(), status.clone()));
                Ok(())
            }
        }
        let state = cluster();
        let mut api = Memory {
            refuse: Some(NetworkKey::Cluster("red".into())),
            ..Memory::default()
        };
        let mut reconciler = Reconciler::default();
        let first: Timestamp = "2026-12-07T10:00:00Z".parse().unwrap();
        assert!(!reconciler.round(&state, &mut api, first).await);
        assert_eq!(api.written.len(), 4);
        let (_, blue) = api
            .written
            .iter()
            .find(|(key, _)| *key == udn("blue", "tenant-blue"))
            .unwrap();
        let condition = &blue.conditions[0];
        assert_eq!(
            (
                condition.type_.as_str(),
                condition.status.as_str(),
                condition.reason.as_str()
            ),
            ("NetworkCreated", "False", "SyncError")
        );
        assert_eq!(condition.observed_generation, Some(1));
        assert_eq!(condition.last_transition_time.0, first);

        // Nothing changed: only the refused one is written, once the API takes it.
        api.refuse = None;
        let later: Timestamp = "2026-12-07T10:05:00Z".parse().unwrap();
        assert!(reconciler.round(&state, &mut api, later).await);
        assert_eq!(api.written.len(), 5);
        assert_eq!(api.written[4].0, NetworkKey::Cluster("red".into()));
        assert!(reconciler.round(&state, &mut api, later).await);
        assert_eq!(api.written.len(), 5);

        // The namespace labelled: the message changes, the transition time stays.
        let mut relabelled = ClusterState::default();
        add_documents(
            &mut relabelled,
            "cluster.yaml",
            &CLUSTER.replace(
                "metadata: {name: plain}",
                "metadata: {name: plain, labels: {k8s.ovn.org/primary-user-defined-network: ''}}",
            ),
        );
        assert!(reconciler.round(&relabelled, &mut api, later).await);
        assert_eq!(api.written.len(), 6);
        let (key, plain) = &api.written[5];
        assert_eq!(*key, udn("plain", "unlabelled"));
        assert!(
            plain.conditions[0]
                .message
                .contains("the pods of namespace plain get no interface")
        );
        assert_eq!(plain.conditions[0].last_transition_time.0, first);
    }

    /// A network overlapping the cluster's pod network is invalid, named with the range.
    #[test]
    fn a_network_overlapping_the_cluster_network_says_which() {
        let mut state = cluster();
        state.cluster_networks = vec!["10.48.0.0/12".parse().unwrap()];
        let networks = not_created(&state);
        assert_eq!(
            networks[&NetworkKey::Cluster("red".into())].message,
            "invalid: spec.network.layer2.subnets[0]: 10.50.0.0/16 overlaps the cluster network 10.48.0.0/12"
        );
    }
}
