//! The dependency model of a sync: which kinds of cluster object each stage of the agent reads,
//! so that a change runs only the stages it can affect, and the load-balancer recompiles only
//! the Services it touches. The orchestration that follows it is the agent's `cluster` module.
//!
//! | stage | reads | work on a change |
//! |---|---|---|
//! | overlay (model, routes, management port, gateway SNAT, hybrid overlay) | Node, Pod of this node (before or after; not its labels), Network | the node's view is rebuilt from this node's pods (`model::HostedPods`, patched) and the node views (made again only for the Node objects that changed); the nodes' routes and addresses are changed node by node from the last compile's (`overlay::NodeMaps::updated_for`); the maps are written where they differ from what the last sync wrote |
//! | services | Service, EndpointSlice, Node, Network | the changed Services (a slice counts for its Service) are recompiled from the objects indexed by name (all of them when the addresses no Service may take as external ones changed: the nodes' addresses, the cluster's networks); only their keys are compared with the installed ports and written where they differ, backends counted by reference |
//! | access control (NetworkPolicy, admin policies, EgressFirewall, audit) | Node, Namespace, Pod (labels included), NetworkPolicy, AdminNetworkPolicy / BaselineAdminNetworkPolicy / ClusterNetworkPolicy, EgressFirewall, Network | the policy peers are patched with the changed pods; only the local pods the change can reach are compiled again (`acl::pods::PolicyChanges::from_changes`); only changed sets are written |
//! | egress IPs | Node, Namespace, Pod (labels included), EgressIP, Network | recompiled (a cheap pass; it also runs every 100 ms for the lease), the cluster's own prefixes kept while the nodes and networks stay, the pods not read without an EgressIP; written where it differs from what it last wrote |
//! | multicast | Node, Namespace, Pod (not its labels) | the enabled namespaces' local pods and peer nodes planned again; only changed pod records and groups are written (memberships follow IGMP/MLD and the other nodes' announcements between syncs) |
//!
//! "Network" stands for the operator's `Network` named `cluster` (MTU, Geneve port, cluster
//! and service networks, audit, egress IP and hybrid overlay settings). The node's own
//! addresses are read from the host at every sync, whatever changed. A full recompute (the
//! first sync, then periodically) runs every stage from a fresh read and counts what it had
//! to write: anything is a difference the dependency model missed.

use std::{
    collections::{BTreeMap, BTreeSet},
    ops::Range,
    sync::Arc,
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube::Resource;

use crate::source::{ClusterState, Objects, Pod, slice_service};

/// A namespaced object's namespace and name.
pub type ObjectName = (String, String);

/// The kinds of cluster object the stages read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Node,
    Namespace,
    Pod,
    /// A Pod of this node (before or after the change) changed, not only in its labels: what
    /// this node's own view reads (noted by the agent, which knows its node:
    /// `model::HostedPods::note_changes`). A pod coming or going elsewhere is not.
    HostedPod,
    /// A Pod whose labels alone changed: what selects pods reads it, the rest does not.
    PodLabels,
    Service,
    EndpointSlice,
    NetworkPolicy,
    EgressFirewall,
    EgressIP,
    /// AdminNetworkPolicy, BaselineAdminNetworkPolicy and ClusterNetworkPolicy.
    AdminPolicy,
    /// The operator's `Network` named `cluster`.
    Network,
}

/// The stages of a sync, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    Overlay,
    Services,
    AccessControl,
    EgressIps,
    Multicast,
}

impl Stage {
    /// The stage's name in logs and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Overlay => "overlay",
            Stage::Services => "services",
            Stage::AccessControl => "access_control",
            Stage::EgressIps => "egress_ips",
            Stage::Multicast => "multicast",
        }
    }
}

/// Each stage and the kinds it reads: the dependency model.
pub const READS: [(Stage, &[Kind]); 5] = [
    (
        Stage::Overlay,
        &[Kind::Node, Kind::HostedPod, Kind::Network],
    ),
    // Nodes and the Network: the addresses no Service may take as external ones.
    (
        Stage::Services,
        &[
            Kind::Service,
            Kind::EndpointSlice,
            Kind::Node,
            Kind::Network,
        ],
    ),
    (
        Stage::AccessControl,
        &[
            Kind::Node,
            Kind::Namespace,
            Kind::Pod,
            Kind::PodLabels,
            Kind::NetworkPolicy,
            Kind::EgressFirewall,
            Kind::AdminPolicy,
            Kind::Network,
        ],
    ),
    (
        Stage::EgressIps,
        &[
            Kind::Node,
            Kind::Namespace,
            Kind::Pod,
            Kind::PodLabels,
            Kind::EgressIP,
            Kind::Network,
        ],
    ),
    (Stage::Multicast, &[Kind::Node, Kind::Namespace, Kind::Pod]),
];

/// What changed between two reads of the cluster state.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Changes {
    /// Every stage runs, every Service is recompiled (the first sync, a full recompute).
    pub full: bool,
    pub kinds: BTreeSet<Kind>,
    /// The Services whose object or EndpointSlices changed (added, removed or modified).
    pub services: BTreeSet<ObjectName>,
    /// The Pods added, removed or modified, by namespace and name: each one as it is now
    /// (`None`: removed).
    pub pods: BTreeMap<(String, String), Option<Arc<Pod>>>,
    /// The namespaces where a NetworkPolicy was added, removed or modified.
    pub policy_namespaces: BTreeSet<String>,
    /// The Services and EndpointSlices added, removed or modified, by namespace and name:
    /// each as it is now (`None`: removed).
    pub service_objects: BTreeMap<ObjectName, Option<Arc<Service>>>,
    pub slices: BTreeMap<(String, String), Option<Arc<EndpointSlice>>>,
}

impl Changes {
    /// Everything, as for the first sync.
    pub fn full() -> Self {
        Self {
            full: true,
            ..Self::default()
        }
    }

    /// What differs between `old` and `new`, kind by kind; objects are matched by namespace
    /// and name, so a mere reordering (an API store lists in no fixed order) is no change.
    pub fn between(old: &ClusterState, new: &ClusterState) -> Self {
        let mut changes = Self::default();
        let mut kinds = BTreeSet::new();
        let mut note = |kind: Kind, same: bool| {
            if !same {
                kinds.insert(kind);
            }
        };
        note(Kind::Node, same_objects(&old.nodes, &new.nodes));
        note(
            Kind::Namespace,
            same_objects(&old.namespaces, &new.namespaces),
        );
        let pods = changed_keys(&old.pods, &new.pods);
        let relabelled = pods
            .iter()
            .filter(|(a, b)| a.zip(*b).is_some_and(|(a, b)| same_but_labels(a, b)))
            .count();
        note(Kind::Pod, relabelled == pods.len());
        note(Kind::PodLabels, relabelled == 0);
        changes.pods = now_by_key(pods);
        changes.policy_namespaces = changed_keys(&old.network_policies, &new.network_policies)
            .into_iter()
            .filter_map(|(a, b)| a.or(b))
            .map(|policy| key_of(&**policy).0.to_owned())
            .collect();
        note(Kind::NetworkPolicy, changes.policy_namespaces.is_empty());
        note(
            Kind::EgressFirewall,
            same_objects(&old.egress_firewalls, &new.egress_firewalls),
        );
        note(
            Kind::EgressIP,
            same_objects(&old.egress_ips, &new.egress_ips),
        );
        note(
            Kind::AdminPolicy,
            same_objects(&old.admin_network_policies, &new.admin_network_policies)
                && same_objects(
                    &old.baseline_admin_network_policies,
                    &new.baseline_admin_network_policies,
                )
                && same_objects(&old.cluster_network_policies, &new.cluster_network_policies),
        );
        note(Kind::Network, same_network(old, new));
        changes.service_objects = now_by_key(changed_keys(&old.services, &new.services));
        let slices = changed_keys(&old.endpoint_slices, &new.endpoint_slices);
        let slice_services = slice_services(&slices);
        note(Kind::Service, changes.service_objects.is_empty());
        note(Kind::EndpointSlice, slices.is_empty());
        changes.services = changes.service_objects.keys().cloned().collect();
        changes.services.extend(slice_services);
        changes.slices = now_by_key(slices);
        changes.kinds = kinds;
        changes
    }

    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        !self.full && self.kinds.is_empty()
    }

    /// Whether `stage` reads anything that changed.
    pub fn runs(&self, stage: Stage) -> bool {
        self.full
            || READS
                .iter()
                .filter(|(s, _)| *s == stage)
                .any(|(_, kinds)| kinds.iter().any(|k| self.kinds.contains(k)))
    }

    /// The stages that run, in order.
    pub fn stages(&self) -> Vec<Stage> {
        READS
            .iter()
            .map(|(stage, _)| *stage)
            .filter(|s| self.runs(*s))
            .collect()
    }
}

/// Namespace and name of an object (a missing namespace reads as `default`, as the sources
/// store them).
fn key_of<T: Resource>(object: &T) -> (&str, &str) {
    let meta = object.meta();
    (
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or(""),
    )
}

/// The same object: the same shared one (what an unchanged object of a parse cache is), or
/// equal.
fn same<T: PartialEq>(a: &Arc<T>, b: &Arc<T>) -> bool {
    Arc::ptr_eq(a, b) || a == b
}

/// Whether two lists hold the same objects, in any order.
fn same_objects<T: Resource + PartialEq>(old: &Objects<T>, new: &Objects<T>) -> bool {
    changed_keys(old, new).is_empty()
}

/// Whether the `Network`'s settings are the same.
fn same_network(old: &ClusterState, new: &ClusterState) -> bool {
    old.network == new.network
        && old.cluster_networks == new.cluster_networks
        && old.service_networks == new.service_networks
        && old.policy_audit == new.policy_audit
        && old.egress_ip_config == new.egress_ip_config
        && old.hybrid == new.hybrid
}

/// An object before and after a change (`None`: absent).
type Versions<'a, T> = (Option<&'a Arc<T>>, Option<&'a Arc<T>>);

/// How far past a difference the walk of two lists looks for them to agree again.
const RESYNC_WINDOW: usize = 32;

/// The objects that differ between `old` and `new` (added, removed or modified), before and
/// after. When `new` is `old` with objects placed by the object cache, the keys its journal
/// noted since are all that is looked at (`Objects::placed_since`). Otherwise the lists are
/// walked side by side (a source keeps its order, and a change leaves
/// the rest of the list as it was): past each difference the walk finds where they agree
/// again, and the objects in between are matched by key. Lists that do not agree again
/// within [`RESYNC_WINDOW`] are matched by key from there on. At 150,000 pods, matching
/// both whole lists by key when a pod was added took 230 ms.
fn changed_keys<'a, T: Resource + PartialEq>(
    old: &'a Objects<T>,
    new: &'a Objects<T>,
) -> Vec<Versions<'a, T>> {
    if old.shares(new) {
        return Vec::new();
    }
    if let Some(placed) = new.placed_since(old) {
        // Only these keys can differ: each is looked up in both lists.
        let keys: BTreeSet<(&str, &str)> = placed.collect();
        return keys
            .into_iter()
            .map(|at| (old.at_key(at), new.at_key(at)))
            .filter(|versions| differ(versions))
            .collect();
    }
    let mut between: BTreeMap<(&str, &str), Versions<'a, T>> = BTreeMap::new();
    for (olds, news) in differing_runs(old, new) {
        for object in olds.filter_map(|x| old.get(x)) {
            between.entry(key_of(&**object)).or_default().0 = Some(object);
        }
        for object in news.filter_map(|y| new.get(y)) {
            between.entry(key_of(&**object)).or_default().1 = Some(object);
        }
    }
    between.into_values().filter(differ).collect()
}

/// Whether an object's two versions differ (one missing counts; both missing does not).
fn differ<T: PartialEq>(versions: &Versions<'_, T>) -> bool {
    match versions {
        (Some(a), Some(b)) => !same(a, b),
        (a, b) => a.is_some() || b.is_some(),
    }
}

/// The runs of positions where `old` and `new` differ, each paired with the run it stands
/// for in the other list (either may be empty: added or removed objects).
fn differing_runs<T: Resource + PartialEq>(
    old: &Objects<T>,
    new: &Objects<T>,
) -> Vec<(Range<usize>, Range<usize>)> {
    let matches = |a: Option<&Arc<T>>, b: Option<&Arc<T>>| {
        a.zip(b)
            .is_some_and(|(a, b)| Arc::ptr_eq(a, b) || (key_of(&**a) == key_of(&**b) && a == b))
    };
    let (n, m) = (old.len(), new.len());
    let (mut a, mut b) = (old.cursor(), new.cursor());
    let mut runs = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < n && j < m {
        let shared = a.shared_run(i, &mut b, j);
        if shared > 0 {
            i += shared;
            j += shared;
            continue;
        }
        if matches(a.get(i), b.get(j)) {
            i += 1;
            j += 1;
            continue;
        }
        // The nearest positions past the difference where the lists agree again.
        let agree = (1..=2 * RESYNC_WINDOW).find_map(|d| {
            (d.saturating_sub(RESYNC_WINDOW)..=d.min(RESYNC_WINDOW))
                .map(|k| (k, d - k))
                .find(|&(k, l)| matches(a.get(i + k), b.get(j + l)))
        });
        let (k, l) = agree.unwrap_or((n - i, m - j));
        runs.push((i..i + k, j..j + l));
        i += k;
        j += l;
    }
    if i < n || j < m {
        runs.push((i..n, j..m));
    }
    runs
}

/// Whether two versions of a Pod differ in their labels alone (and what every update moves:
/// resource version, managed fields).
fn same_but_labels(a: &Pod, b: &Pod) -> bool {
    let bare = |pod: &Pod| {
        let mut pod = pod.clone();
        pod.metadata.labels = None;
        pod.metadata.resource_version = None;
        pod.metadata.managed_fields = None;
        pod
    };
    bare(a) == bare(b)
}

/// An object's namespace (`default` when it has none) and name, as [`Changes`] keys them.
pub(crate) fn object_key<T: Resource>(object: &T) -> (String, String) {
    owned(key_of(object))
}

pub(crate) fn owned((namespace, name): (&str, &str)) -> ObjectName {
    (namespace.to_owned(), name.to_owned())
}

/// Changed objects by namespace and name, each as it is now (`None`: removed).
fn now_by_key<T: Resource>(
    versions: Vec<Versions<'_, T>>,
) -> BTreeMap<(String, String), Option<Arc<T>>> {
    versions
        .into_iter()
        .filter_map(|(a, b)| Some((object_key(&**a.or(b)?), b.cloned())))
        .collect()
}

/// The Services changed EndpointSlices belong to (before and after a relabelling, both).
fn slice_services(slices: &[Versions<'_, EndpointSlice>]) -> BTreeSet<ObjectName> {
    slices
        .iter()
        .flat_map(|(a, b)| [a, b])
        .flatten()
        .filter_map(|slice| slice_service(slice))
        .map(owned)
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::source::add_documents;
    use k8s_openapi::api::core::v1::Namespace;

    /// What differs, found by matching every object of both lists by key (what the walk must
    /// agree with).
    fn keyed_diff(
        old: &Objects<Namespace>,
        new: &Objects<Namespace>,
    ) -> Vec<(Option<String>, Option<String>)> {
        let by_key = |list: &Objects<Namespace>| -> BTreeMap<String, Arc<Namespace>> {
            list.iter()
                .map(|o| (key_of(&**o).1.to_owned(), Arc::clone(o)))
                .collect()
        };
        let (old, new) = (by_key(old), by_key(new));
        let keys: BTreeSet<&String> = old.keys().chain(new.keys()).collect();
        keys.into_iter()
            .map(|k| (old.get(k), new.get(k)))
            .filter(|(a, b)| !matches!((a, b), (Some(a), Some(b)) if same(a, b)))
            .map(|(a, b)| (a.map(|a| label(a)), b.map(|b| label(b))))
            .collect()
    }

    fn label(namespace: &Namespace) -> String {
        let labels = namespace.metadata.labels.as_ref();
        let version = labels.and_then(|l| l.get("v")).cloned().unwrap_or_default();
        format!(
            "{}@{version}",
            namespace.metadata.name.as_deref().unwrap_or("")
        )
    }

    /// Walked side by side, two lists give the changes that matching every object by key
    /// gives: over random inserts, removals, modifications, copies equal by value and
    /// reorderings, single and many at once, in lists long enough to be trees.
    #[test]
    fn the_walk_of_two_lists_finds_what_matching_by_key_finds() {
        let mut rng = crate::test_rng::TestRng::new(11);
        let mut next = |n: usize| rng.below(n as u64) as usize;
        let namespace = |name: usize, version: usize| {
            let mut ns = Namespace::default();
            ns.metadata.name = Some(format!("ns-{name:05}"));
            ns.metadata.labels = Some([("v".to_owned(), version.to_string())].into());
            Arc::new(ns)
        };
        let mut seen = BTreeSet::new();
        for round in 0..300 {
            let size = [0, 3, 70, 700][round % 4];
            let old: Vec<Arc<Namespace>> = (0..size).map(|i| namespace(i * 2, 0)).collect();
            let mut new = old.clone();
            for _ in 0..1 + next(if round % 5 == 0 { 80 } else { 3 }) {
                match next(6) {
                    0 => {
                        let at = next(new.len() + 1);
                        new.insert(at, namespace(size * 2 + next(1000), 1));
                        seen.insert("insert");
                    }
                    1 if !new.is_empty() => {
                        new.remove(next(new.len()));
                        seen.insert("remove");
                    }
                    2 if !new.is_empty() => {
                        let at = next(new.len());
                        let name = new[at].metadata.name.clone();
                        let mut changed = (*new[at]).clone();
                        changed.metadata.labels = Some([("v".to_owned(), "2".to_owned())].into());
                        changed.metadata.name = name;
                        new[at] = Arc::new(changed);
                        seen.insert("modify");
                    }
                    3 if !new.is_empty() => {
                        let at = next(new.len());
                        new[at] = Arc::new((*new[at]).clone());
                        seen.insert("equal copy");
                    }
                    4 if new.len() > 1 => {
                        let (x, y) = (next(new.len()), next(new.len()));
                        new.swap(x, y);
                        seen.insert("reorder");
                    }
                    _ => {}
                }
            }
            let (old, new): (Objects<Namespace>, Objects<Namespace>) = (old.into(), new.into());
            let walked: Vec<_> = changed_keys(&old, &new)
                .into_iter()
                .map(|(a, b)| (a.map(|a| label(a)), b.map(|b| label(b))))
                .collect();
            assert_eq!(walked, keyed_diff(&old, &new), "round {round}");
            assert_eq!(same_objects(&old, &new), walked.is_empty());
        }
        assert_eq!(seen.len(), 5, "every kind of edit happened: {seen:?}");
    }

    pub(crate) const BASE: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-a}
spec: {podCIDRs: [10.244.1.0/24]}
---
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {team: a}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop, labels: {app: web}}
spec: {nodeName: node-a, containers: [{name: app, image: nginx}]}
status: {podIPs: [{ip: 10.244.1.5}]}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80, targetPort: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.244.1.5], conditions: {ready: true}}]
ports: [{name: http, port: 8080, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {name: db, namespace: shop}
spec: {clusterIP: 10.96.0.11, ports: [{name: pg, port: 5432}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny, namespace: shop}
spec: {podSelector: {}, policyTypes: [Ingress]}
"#;

    pub(crate) fn state(text: &str) -> ClusterState {
        let mut state = ClusterState::default();
        add_documents(&mut state, "test.yaml", text);
        assert!(state.rejected.is_empty(), "{:?}", state.rejected);
        state
    }

    fn changed(edit: impl Fn(&str) -> String) -> Changes {
        Changes::between(&state(BASE), &state(&edit(BASE)))
    }

    fn names(services: &[(&str, &str)]) -> BTreeSet<ObjectName> {
        services.iter().map(|&k| owned(k)).collect()
    }

    #[test]
    fn the_same_state_read_again_or_reordered_is_no_change() {
        assert!(Changes::between(&state(BASE), &state(BASE)).is_empty());
        let mut documents: Vec<&str> = BASE.split("\n---\n").collect();
        documents.reverse();
        let reordered = documents.join("\n---\n");
        let changes = Changes::between(&state(BASE), &state(&reordered));
        assert!(changes.is_empty(), "{changes:?}");
        assert!(changes.stages().is_empty());
    }

    #[test]
    fn an_endpoint_change_recompiles_its_service_alone_and_runs_the_services_stage_only() {
        let changes = changed(|t| t.replace("addresses: [10.244.1.5]", "addresses: [10.244.1.6]"));
        assert_eq!(changes.kinds, BTreeSet::from([Kind::EndpointSlice]));
        assert_eq!(changes.services, names(&[("shop", "web")]));
        assert_eq!(changes.stages(), vec![Stage::Services]);
    }

    #[test]
    fn a_slice_moved_to_another_service_recompiles_both() {
        let changes = changed(|t| {
            t.replace(
                "kubernetes.io/service-name: web",
                "kubernetes.io/service-name: db",
            )
        });
        assert_eq!(changes.services, names(&[("shop", "db"), ("shop", "web")]));
    }

    #[test]
    fn a_service_removed_is_a_change_of_that_service() {
        let changes =
            changed(|t| t.replace("name: db, namespace: shop", "name: db2, namespace: shop"));
        assert_eq!(changes.kinds, BTreeSet::from([Kind::Service]));
        assert_eq!(changes.services, names(&[("shop", "db"), ("shop", "db2")]));
    }

    #[test]
    fn a_pod_label_change_runs_access_control_and_egress_ips_only() {
        let changes = changed(|t| t.replace("labels: {app: web}", "labels: {app: shop}"));
        assert_eq!(changes.kinds, BTreeSet::from([Kind::PodLabels]));
        assert_eq!(changes.pods.len(), 1);
        assert_eq!(
            changes.stages(),
            vec![Stage::AccessControl, Stage::EgressIps]
        );
    }

    #[test]
    fn a_pod_address_change_runs_every_stage_that_reads_other_nodes_pods() {
        let changes = changed(|t| {
            t.replace("podIPs: [{ip: 10.244.1.5}]", "podIPs: [{ip: 10.244.1.7}]")
                .replace("labels: {app: web}", "labels: {app: shop}")
        });
        assert_eq!(changes.kinds, BTreeSet::from([Kind::Pod]));
        let pod = changes
            .pods
            .values()
            .next()
            .cloned()
            .flatten()
            .expect("pod");
        assert_eq!(pod.metadata.labels.as_ref().expect("labels")["app"], "shop");
        assert_eq!(
            changes.stages(),
            vec![Stage::AccessControl, Stage::EgressIps, Stage::Multicast]
        );
    }

    #[test]
    fn a_namespace_label_change_runs_access_control_egress_and_multicast_only() {
        let changes = changed(|t| t.replace("labels: {team: a}", "labels: {team: b}"));
        assert_eq!(
            changes.stages(),
            vec![Stage::AccessControl, Stage::EgressIps, Stage::Multicast]
        );
    }

    #[test]
    fn a_policy_change_runs_access_control_only() {
        let changes = changed(|t| t.replace("policyTypes: [Ingress]", "policyTypes: [Egress]"));
        assert_eq!(changes.kinds, BTreeSet::from([Kind::NetworkPolicy]));
        assert_eq!(changes.stages(), vec![Stage::AccessControl]);
    }

    /// Services read the nodes for the addresses no Service may take as external ones (an
    /// unchanged set of addresses recompiles no Service).
    #[test]
    fn a_node_change_runs_every_stage() {
        let changes =
            changed(|t| t.replace("podCIDRs: [10.244.1.0/24]", "podCIDRs: [10.244.2.0/24]"));
        assert_eq!(
            changes.stages(),
            vec![
                Stage::Overlay,
                Stage::Services,
                Stage::AccessControl,
                Stage::EgressIps,
                Stage::Multicast
            ]
        );
    }

    #[test]
    fn a_full_recompute_runs_every_stage() {
        assert_eq!(
            Changes::full().stages(),
            vec![
                Stage::Overlay,
                Stage::Services,
                Stage::AccessControl,
                Stage::EgressIps,
                Stage::Multicast
            ]
        );
    }
}
