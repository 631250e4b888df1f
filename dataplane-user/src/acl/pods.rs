//! The cluster's pods as policies see them: each pod's namespace, labels, addresses and named
//! ports, indexed by namespace and label; the namespaces' labels; label selectors; and what
//! changed among them since the last compile.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

use ipnet::IpNet;
use k8s_openapi::{api::core::v1::Namespace, apimachinery::pkg::apis::meta::v1::LabelSelector};

use super::protocol_number;
use crate::{
    changes::{Changes, Kind},
    model::{in_pod_network, pod_addresses},
    source::{ClusterState, Pod},
};

/// Ingress or egress.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Direction {
    Ingress,
    Egress,
}

/// A pod as policies see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyPod {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub addresses: Vec<IpAddr>,
    /// Container ports by name: (protocol, port).
    pub named_ports: BTreeMap<String, Vec<(u8, u16)>>,
}

impl PolicyPod {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// The pods of one namespace, by name, and by label: a selector's `matchLabels` look at the
/// pods that have one of its labels rather than at every pod of the namespace (the label
/// index holds the pods themselves, shared: through their names, each candidate was one more
/// lookup, 1,200 of them to compile one pod's set of 300 peers under four policies).
/// Persistent maps (`imbl`): a copy shares everything, and a change to it copies only the
/// paths to what changed. Access control keeps a copy of the cluster's pods between syncs,
/// so each namespace a sync's pods touch is copied before it is changed: with ordinary maps
/// that copied its 300 pods and their label index for each one (a sync of 50 changed pods
/// spent 15 to 70 ms there).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespacePods {
    /// Each pod behind an `Arc`: a persistent map's node keeps room for 64 entries whatever it
    /// holds, so the pods themselves stay out of it.
    pods: imbl::OrdMap<String, Arc<PolicyPod>>,
    by_label: imbl::OrdMap<(String, String), imbl::OrdMap<String, Arc<PolicyPod>>>,
}

impl NamespacePods {
    /// The pods of one namespace, a later pod of a name replacing an earlier one as
    /// [`Self::insert`] would: sorted stably by name, the last of each name kept.
    fn from_pods(mut pods: Vec<PolicyPod>) -> Self {
        pods.sort_by(|a, b| a.name.cmp(&b.name));
        let mut named: Vec<PolicyPod> = Vec::with_capacity(pods.len());
        for pod in pods {
            match named.last_mut() {
                Some(last) if last.name == pod.name => *last = pod,
                _ => named.push(pod),
            }
        }
        let pods: imbl::OrdMap<String, Arc<PolicyPod>> = named
            .into_iter()
            .map(|pod| (pod.name.clone(), Arc::new(pod)))
            .collect();
        let mut labelled: Vec<(&String, &String, &Arc<PolicyPod>)> = pods
            .values()
            .flat_map(|pod| pod.labels.iter().map(move |(k, v)| (k, v, pod)))
            .collect();
        labelled.sort_unstable_by(|a, b| (a.0, a.1, &a.2.name).cmp(&(b.0, b.1, &b.2.name)));
        let mut by_label = Vec::new();
        for run in labelled.chunk_by(|a, b| (a.0, a.1) == (b.0, b.1)) {
            let (key, value, _) = run[0];
            let labelled: imbl::OrdMap<String, Arc<PolicyPod>> = run
                .iter()
                .map(|(_, _, pod)| (pod.name.clone(), Arc::clone(pod)))
                .collect();
            by_label.push(((key.clone(), value.clone()), labelled));
        }
        Self {
            by_label: by_label.into_iter().collect(),
            pods,
        }
    }

    /// Adds `pod`; returns whether it is new (not a replacement).
    fn insert(&mut self, pod: PolicyPod) -> bool {
        let name = pod.name.clone();
        let replaced = self.remove(&name);
        let pod = Arc::new(pod);
        for label in &pod.labels {
            let label = (label.0.clone(), label.1.clone());
            let mut labelled = self.by_label.get(&label).cloned().unwrap_or_default();
            labelled.insert(name.clone(), Arc::clone(&pod));
            self.by_label.insert(label, labelled);
        }
        self.pods.insert(name, pod);
        !replaced
    }

    /// Takes the pod `name` out; returns whether it was there.
    fn remove(&mut self, name: &str) -> bool {
        let Some(pod) = self.pods.remove(name) else {
            return false;
        };
        for (key, value) in &pod.labels {
            let label = (key.clone(), value.clone());
            if let Some(labelled) = self.by_label.get_mut(&label) {
                labelled.remove(name);
                if labelled.is_empty() {
                    self.by_label.remove(&label);
                }
            }
        }
        true
    }

    pub fn get(&self, name: &str) -> Option<&PolicyPod> {
        self.pods.get(name).map(|pod| &**pod)
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    /// Every pod, by name.
    pub fn values(&self) -> impl Iterator<Item = &PolicyPod> {
        self.pods.values().map(|pod| &**pod)
    }

    /// The pods labelled exactly `labels`.
    fn with_labels<'a>(
        &'a self,
        labels: &'a BTreeMap<String, String>,
    ) -> Box<dyn Iterator<Item = &'a PolicyPod> + 'a> {
        let rarest = labels
            .iter()
            .map(|(k, v)| self.by_label.get(&(k.clone(), v.clone())))
            .min_by_key(|labelled| labelled.map_or(0, imbl::OrdMap::len));
        let candidates: Box<dyn Iterator<Item = &Arc<PolicyPod>>> = match rarest {
            None => Box::new(self.pods.values()),
            Some(None) => return Box::new(std::iter::empty()),
            Some(Some(labelled)) => Box::new(labelled.values()),
        };
        Box::new(
            candidates
                .map(|pod| &**pod)
                .filter(move |pod| pod.labels == *labels),
        )
    }

    /// The pods `selector` picks (every pod without one), by name. Validated selectors only:
    /// an error of [`selects`] is passed on.
    pub(super) fn selected(
        &self,
        selector: Option<&LabelSelector>,
    ) -> Result<Vec<&PolicyPod>, String> {
        let Some(selector) = selector else {
            return Ok(self.values().collect());
        };
        // The pods with the rarest of the selector's labels: the others cannot match.
        let rarest = selector
            .match_labels
            .iter()
            .flatten()
            .map(|(k, v)| {
                self.by_label
                    .get(&(k.clone(), v.clone()))
                    .map_or(0, imbl::OrdMap::len)
            })
            .min();
        let candidates: Box<dyn Iterator<Item = &PolicyPod>> = match rarest {
            Some(0) => return Ok(Vec::new()),
            Some(_) => {
                let labels = selector.match_labels.iter().flatten();
                let labelled = labels
                    .filter_map(|(k, v)| self.by_label.get(&(k.clone(), v.clone())))
                    .min_by_key(|labelled| labelled.len())
                    .into_iter()
                    .flat_map(|labelled| labelled.values());
                Box::new(labelled.map(|pod| &**pod))
            }
            None => Box::new(self.values()),
        };
        // A selector of that one label (or of none) picks every candidate: 300 peers were
        // each checked against it again.
        let expressions = selector
            .match_expressions
            .as_ref()
            .is_some_and(|e| !e.is_empty());
        let labels = selector.match_labels.as_ref().map_or(0, BTreeMap::len);
        if !expressions && labels <= 1 {
            return Ok(candidates.collect());
        }
        let mut chosen = Vec::new();
        for pod in candidates {
            if selects(selector, &pod.labels)? {
                chosen.push(pod);
            }
        }
        Ok(chosen)
    }
}

/// Every pod-network pod of the cluster as policies see it, by namespace and name. Kept
/// between syncs and patched with the pods that changed ([`PolicyPods::follow`]): at 150,000
/// pods, making them all again cost a sync 100 ms. Cheap to clone (access control and egress
/// IPs each hold one): a namespace's pods are shared until a change touches that namespace,
/// and then its persistent maps copy only the paths to the change (see [`NamespacePods`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyPods {
    namespaces: BTreeMap<String, Arc<NamespacePods>>,
    len: usize,
}

impl PolicyPods {
    /// The pod-network pods of `pods` that are not finished, with their labels and named ports.
    /// Read on every core (`rayon`): at 150,000 pods, copying their labels, addresses and
    /// ports and indexing each namespace's is a tenth of a first sync on one.
    pub fn from_pods<'a>(pods: impl IntoIterator<Item = &'a Arc<Pod>>) -> Self {
        let pods: Vec<&Arc<Pod>> = pods.into_iter().collect();
        crate::parallel::map(&pods, PODS_PER_TASK, |pod| policy_pod(pod))
            .into_iter()
            .flatten()
            .collect()
    }

    /// Brings the pods to `state` as `changes` says it differs from the last state they
    /// followed: the changed pods only, or all of them anew after a full read.
    pub fn follow(&mut self, state: &ClusterState, changes: &Changes) {
        if changes.full {
            *self = Self::from_pods(&state.pods);
            return;
        }
        for ((namespace, name), pod) in &changes.pods {
            self.remove(namespace, name);
            if let Some(pod) = pod.as_deref().and_then(policy_pod) {
                self.insert(pod);
            }
        }
    }

    /// Adds `pod`, replacing a pod of the same namespace and name.
    pub fn insert(&mut self, pod: PolicyPod) {
        let pods = Arc::make_mut(self.namespaces.entry(pod.namespace.clone()).or_default());
        if pods.insert(pod) {
            self.len += 1;
        }
    }

    pub fn remove(&mut self, namespace: &str, name: &str) {
        let Some(pods) = self.namespaces.get_mut(namespace) else {
            return;
        };
        if pods.get(name).is_none() {
            return;
        }
        Arc::make_mut(pods).remove(name);
        self.len -= 1;
        if pods.is_empty() {
            self.namespaces.remove(namespace);
        }
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<&PolicyPod> {
        self.namespaces.get(namespace)?.get(name)
    }

    /// The pods of `namespace`, if it has any.
    pub fn of_namespace(&self, namespace: &str) -> Option<&NamespacePods> {
        self.namespaces.get(namespace).map(|pods| &**pods)
    }

    /// The pods of `namespace` labelled exactly `labels`.
    pub fn with_labels<'a>(
        &'a self,
        namespace: &str,
        labels: &'a BTreeMap<String, String>,
    ) -> impl Iterator<Item = &'a PolicyPod> + 'a {
        self.of_namespace(namespace)
            .into_iter()
            .flat_map(move |pods| pods.with_labels(labels))
    }

    /// Each namespace with pods, and its pods.
    pub fn namespaces(&self) -> impl Iterator<Item = (&str, &NamespacePods)> {
        self.namespaces
            .iter()
            .map(|(name, pods)| (name.as_str(), &**pods))
    }

    /// Every pod, by namespace and name.
    pub fn iter(&self) -> impl Iterator<Item = &PolicyPod> {
        self.namespaces.values().flat_map(|pods| pods.values())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// As if inserted one by one (a later pod of a namespace and name replaces an earlier one),
/// but each namespace's maps built at once from sorted runs: at 150,000 pods, inserting each
/// pod and each of its labels on its own was a quarter of a large cluster's first sync.
impl FromIterator<PolicyPod> for PolicyPods {
    fn from_iter<I: IntoIterator<Item = PolicyPod>>(pods: I) -> Self {
        let mut by_namespace: BTreeMap<String, Vec<PolicyPod>> = BTreeMap::new();
        for pod in pods {
            match by_namespace.get_mut(&pod.namespace) {
                Some(list) => list.push(pod),
                None => {
                    by_namespace.insert(pod.namespace.clone(), vec![pod]);
                }
            }
        }
        let index = |(namespace, pods): (String, Vec<PolicyPod>)| {
            (namespace, Arc::new(NamespacePods::from_pods(pods)))
        };
        // Each namespace indexed on its own, on every core when there are many pods.
        let many = by_namespace.values().map(Vec::len).sum::<usize>() >= PODS_PER_TASK;
        let by_namespace: Vec<_> = by_namespace.into_iter().collect();
        let namespaces: BTreeMap<String, Arc<NamespacePods>> =
            crate::parallel::map_owned(by_namespace, many, index)
                .into_iter()
                .collect();
        let len = namespaces.values().map(|pods| pods.pods.len()).sum();
        Self { namespaces, len }
    }
}

/// Pods read by one task of [`PolicyPods::from_pods`]: a pod is about 1 us.
const PODS_PER_TASK: usize = 1024;

fn policy_pod(pod: &Pod) -> Option<PolicyPod> {
    if !in_pod_network(pod) {
        return None;
    }
    let spec = pod.spec.as_ref()?;
    let mut named_ports: BTreeMap<String, Vec<(u8, u16)>> = BTreeMap::new();
    for container in &spec.containers {
        for port in container.ports.iter().flatten() {
            let (Some(name), Some(protocol)) = (
                port.name.as_ref(),
                protocol_number(port.protocol.as_deref().unwrap_or("TCP")),
            ) else {
                continue;
            };
            if let Ok(number) = u16::try_from(port.container_port) {
                named_ports
                    .entry(name.clone())
                    .or_default()
                    .push((protocol, number));
            }
        }
    }
    Some(PolicyPod {
        namespace: pod
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into()),
        name: pod.metadata.name.clone().unwrap_or_default(),
        labels: pod.metadata.labels.clone().unwrap_or_default(),
        // Unparsable addresses are skipped here; the pod's own node reports them.
        addresses: pod_addresses(pod, &mut Vec::new()),
        named_ports,
    })
}

/// Every namespace's labels (`kubernetes.io/metadata.name` included) and the namespaces by
/// label, in name order: what namespace selectors read. Built once per change of the
/// namespaces (500 of them at scale), not at every compile.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespaceLabels {
    labels: BTreeMap<String, BTreeMap<String, String>>,
    /// key -> value -> namespaces with that label.
    by_label: BTreeMap<String, BTreeMap<String, Vec<String>>>,
}

impl NamespaceLabels {
    /// A namespace's labels.
    pub fn get(&self, namespace: &str) -> Option<&BTreeMap<String, String>> {
        self.labels.get(namespace)
    }

    /// Every namespace with its labels, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &BTreeMap<String, String>)> {
        self.labels.iter()
    }

    /// The namespaces labelled `key: value`, in name order.
    pub(super) fn with_label(&self, key: &str, value: &str) -> &[String] {
        self.by_label
            .get(key)
            .and_then(|values| values.get(value))
            .map_or(&[][..], Vec::as_slice)
    }
}

impl FromIterator<(String, BTreeMap<String, String>)> for NamespaceLabels {
    fn from_iter<I: IntoIterator<Item = (String, BTreeMap<String, String>)>>(iter: I) -> Self {
        let labels: BTreeMap<String, BTreeMap<String, String>> = iter.into_iter().collect();
        let mut by_label: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
        for (name, namespace_labels) in &labels {
            for (key, value) in namespace_labels {
                by_label
                    .entry(key.clone())
                    .or_default()
                    .entry(value.clone())
                    .or_default()
                    .push(name.clone());
            }
        }
        Self { labels, by_label }
    }
}

/// The labels of `namespaces`, each with its `kubernetes.io/metadata.name`.
pub fn namespace_labels<'a>(
    namespaces: impl IntoIterator<Item = &'a Arc<Namespace>>,
) -> NamespaceLabels {
    namespaces
        .into_iter()
        .filter_map(|ns| {
            let name = ns.metadata.name.clone()?;
            let mut labels = ns.metadata.labels.clone().unwrap_or_default();
            labels
                .entry("kubernetes.io/metadata.name".into())
                .or_insert_with(|| name.clone());
            Some((name, labels))
        })
        .collect()
}

pub(super) fn addresses(pods: &[&PolicyPod]) -> Vec<IpNet> {
    pods.iter()
        .flat_map(|p| p.addresses.iter().map(|a| IpNet::from(*a)))
        .collect()
}

/// A selector's operators are all ones [`selects`] knows, whatever labels it meets.
pub(super) fn check_selector(selector: &LabelSelector) -> Result<(), String> {
    for requirement in selector.match_expressions.iter().flatten() {
        let alone = LabelSelector {
            match_expressions: Some(vec![requirement.clone()]),
            ..LabelSelector::default()
        };
        selects(&alone, &BTreeMap::new())?;
    }
    Ok(())
}

/// Whether a label selector selects `labels` (the empty selector selects everything).
pub fn selects(
    selector: &LabelSelector,
    labels: &BTreeMap<String, String>,
) -> Result<bool, String> {
    for (key, value) in selector.match_labels.iter().flatten() {
        if labels.get(key) != Some(value) {
            return Ok(false);
        }
    }
    for requirement in selector.match_expressions.iter().flatten() {
        let values = requirement.values.as_deref().unwrap_or_default();
        let present = labels.get(&requirement.key);
        let matched = match requirement.operator.as_str() {
            "In" => present.is_some_and(|v| values.contains(v)),
            "NotIn" => present.is_none_or(|v| !values.contains(v)),
            "Exists" => present.is_some(),
            "DoesNotExist" => present.is_none(),
            other => {
                return Err(format!(
                    "operator {other:?} is not In, NotIn, Exists or DoesNotExist"
                ));
            }
        };
        if !matched {
            return Ok(false);
        }
    }
    Ok(true)
}

/// What changed for the NetworkPolicies since the last compile (see [`PodRulesCache`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyChanges {
    /// Anything may have (the first compile, a full recompute, a Namespace's labels, the
    /// cluster's `Network`).
    pub everything: bool,
    /// The Pods added, removed or changed, by namespace.
    pub pods: BTreeMap<String, Vec<ChangedPod>>,
    /// Namespaces where a NetworkPolicy was added, removed or changed.
    pub policies: BTreeSet<String>,
}

/// A Pod added, removed or changed, with the labels of its versions that policies see
/// (see [`PolicyChanges::label`]): a rule picks it if one of them is picked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChangedPod {
    pub name: String,
    pub labels: Vec<BTreeMap<String, String>>,
}

impl ChangedPod {
    /// Notes one more version's labels (each set of labels once).
    fn add_labels(&mut self, labels: &BTreeMap<String, String>) {
        if !self.labels.contains(labels) {
            self.labels.push(labels.clone());
        }
    }
}

impl PolicyChanges {
    /// What the NetworkPolicies' compile must look at again (`acl::policy::PodRulesCache`):
    /// the namespaces where pods or policies changed, or everything when a Namespace or the
    /// `Network` changed (a namespace selector may pick other namespaces now).
    pub fn from_changes(changes: &Changes) -> Self {
        let everything = changes.full
            || changes.kinds.contains(&Kind::Namespace)
            || changes.kinds.contains(&Kind::Network);
        let mut wanted = PolicyChanges {
            everything,
            policies: changes.policy_namespaces.clone(),
            ..PolicyChanges::default()
        };
        for (namespace, name) in changes.pods.keys() {
            wanted.note_pod(namespace, name);
        }
        wanted
    }

    pub fn everything() -> Self {
        Self {
            everything: true,
            ..Self::default()
        }
    }

    /// Whether nothing changed for the NetworkPolicies.
    pub fn is_none(&self) -> bool {
        !self.everything && self.pods.is_empty() && self.policies.is_empty()
    }

    /// Notes a change of the pod `name` of `namespace`.
    pub fn note_pod(&mut self, namespace: &str, name: &str) {
        let changed = self.pods.entry(namespace.to_owned()).or_default();
        if !changed.iter().any(|pod| pod.name == name) {
            changed.push(ChangedPod {
                name: name.to_owned(),
                labels: Vec::new(),
            });
        }
    }

    /// Gives each changed pod the labels it has among `before` (the pods the last compile
    /// read) and `after` (those of now), where it is there.
    pub fn label(&mut self, before: &PolicyPods, after: &PolicyPods) {
        for (namespace, changed) in &mut self.pods {
            for pod in changed {
                for pods in [before, after] {
                    if let Some(found) = pods.get(namespace, &pod.name) {
                        pod.add_labels(&found.labels);
                    }
                }
            }
        }
    }

    /// These changes and then `later`'s.
    pub fn merge(&mut self, later: PolicyChanges) {
        self.everything |= later.everything;
        for (namespace, changed) in later.pods {
            let mine = self.pods.entry(namespace).or_default();
            for pod in changed {
                match mine.iter_mut().find(|p| p.name == pod.name) {
                    Some(known) => {
                        for labels in &pod.labels {
                            known.add_labels(labels);
                        }
                    }
                    None => mine.push(pod),
                }
            }
        }
        self.policies.extend(later.policies);
    }
}
