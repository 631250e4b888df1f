//! Kubernetes NetworkPolicy (`networking.k8s.io/v1`) compiled, per local pod and direction,
//! into the ordered rule lists that [`super::compile_rules`] turns into constant-time lookups.
//!
//! Semantics as the API defines them:
//! - a pod is isolated for ingress (egress) once any policy of its namespace selects it with
//!   that policy type (`policyTypes` absent: Ingress, plus Egress when the policy has egress
//!   rules); an isolated pod accepts only what some rule of some selecting policy allows (the
//!   union); a pod no policy selects is not isolated;
//! - a rule's peers: `podSelector` (pods of the policy's namespace), `namespaceSelector` (all
//!   pods of the selected namespaces), both in one peer (those pods of those namespaces),
//!   `ipBlock` with `except`; no peers: every address. A rule's ports: protocol (TCP by
//!   default, UDP, SCTP), a number or a container port name, `endPort` for ranges; no ports:
//!   all traffic;
//! - named ports resolve against the pod that receives: the selected pod for ingress, each peer
//!   pod for egress (so an egress named port never matches an ipBlock peer).
//!
//! A policy with an invalid field (selector operator, CIDR, protocol, port range) is reported
//! naming it and the field; its pods stay isolated in its policy types but it allows nothing
//! (failing closed rather than open).
//!
//! Every rule compiles to an `Allow` rule; what no rule allows is denied (the kernel treats
//! "no rule matched" as a deny for policy sets). `Rule::index` points into [`PodRules::refs`],
//! which says which policy and rule allowed (for audit records).

use std::sync::Arc;
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    rc::Rc,
};

use ipnet::IpNet;
use k8s_openapi::{
    api::{
        core::v1::Namespace,
        networking::v1::{NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort},
    },
    apimachinery::pkg::{apis::meta::v1::LabelSelector, util::intstr::IntOrString},
};

use crate::{
    model::{in_pod_network, pod_addresses},
    source::{ClusterState, Pod},
    sync::Changes,
};

use dataplane_common::acl::ACL_RULE_EXEMPT;

use super::{
    CompiledSet, PortMatch, Ports, Rule, Verdict,
    admin::{AdminPolicies, TierNotes},
    compile_tiered,
    peers::Registry,
    protocol_number, recompile_hosts, repaint_ports,
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
    fn selected(&self, selector: Option<&LabelSelector>) -> Result<Vec<&PolicyPod>, String> {
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

    /// The namespaces labelled `key: value`, in name order.
    fn with_label(&self, key: &str, value: &str) -> &[String] {
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

/// The kind of object a rule comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PolicyKind {
    NetworkPolicy,
    AdminNetworkPolicy,
    BaselineAdminNetworkPolicy,
    ClusterNetworkPolicy,
}

impl PolicyKind {
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::NetworkPolicy => "NetworkPolicy",
            PolicyKind::AdminNetworkPolicy => "AdminNetworkPolicy",
            PolicyKind::BaselineAdminNetworkPolicy => "BaselineAdminNetworkPolicy",
            PolicyKind::ClusterNetworkPolicy => "ClusterNetworkPolicy",
        }
    }

    /// The prefix of audit record names (OVN-Kubernetes' `NP`, `ANP`, `BANP`; `CNP` here).
    pub fn audit_prefix(self) -> &'static str {
        match self {
            PolicyKind::NetworkPolicy => "NP",
            PolicyKind::AdminNetworkPolicy => "ANP",
            PolicyKind::BaselineAdminNetworkPolicy => "BANP",
            PolicyKind::ClusterNetworkPolicy => "CNP",
        }
    }
}

/// Which policy rule a decision came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleRef {
    pub kind: PolicyKind,
    /// The admin policies' tier; `None` for a NetworkPolicy.
    pub tier: Option<super::admin::Tier>,
    /// `<namespace>/<name>` of a NetworkPolicy, the name of a cluster-wide policy.
    pub policy: String,
    pub direction: Direction,
    /// Index in the policy's `ingress` or `egress` list.
    pub rule: usize,
    /// The rule's `name` (admin policies), empty when it has none.
    pub name: String,
}

impl RuleRef {
    /// The tier's name for people.
    pub fn tier_name(&self) -> &'static str {
        match self.tier {
            None => "NetworkPolicy tier",
            Some(super::admin::Tier::Admin) => "admin tier",
            Some(super::admin::Tier::Baseline) => "baseline tier",
        }
    }

    /// What decided, for people: `tier: kind name direction[rule] "rule name"`.
    pub fn describe(&self) -> String {
        let tier = self.tier_name();
        let direction = match self.direction {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        };
        let name = if self.name.is_empty() {
            String::new()
        } else {
            format!(" {:?}", self.name)
        };
        format!(
            "{tier}: {} {} {direction}[{}]{name}",
            self.kind.name(),
            self.policy,
            self.rule
        )
    }
}

/// One direction of one pod: the rules and where each came from. The first `admin_end`
/// rules are the admin tier's (a `Pass` among them hands over to the rest).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodRules {
    pub rules: Vec<Rule>,
    pub refs: Vec<RuleRef>,
    pub admin_end: usize,
}

/// A pod's isolation: `None` in a direction no policy selects it for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodPolicy {
    pub ingress: Option<PodRules>,
    pub egress: Option<PodRules>,
}

/// The cluster as the policies are compiled against.
pub struct PolicyCluster<'a> {
    /// Every pod by namespace: a peer's selectors look at the namespaces first and then only
    /// at the pods of those they pick.
    pub pods: &'a PolicyPods,
    /// The namespaces' labels, and their names by label: a `namespaceSelector`'s
    /// `matchLabels` look at the namespaces with one of its labels rather than at every one.
    pub namespaces: &'a NamespaceLabels,
    /// Whose pods the compile of one pod's rules looked at (see [`PodRulesCache`]).
    reads: std::cell::RefCell<Reads>,
    /// The peers picked so far in this compile, by the namespaces looked at and the pod
    /// selector ([`pods_among`]): policies often name the same peers (a namespace's
    /// policies taking the same clients, each selected pod compiled with them), and a pod
    /// picked by four policies of 300 such peers resolved the 300 four times.
    picked: std::cell::RefCell<HashMap<String, Rc<Picked<'a>>>>,
    /// Where peer pods are named by identity (no admin policy in force: their tiers are
    /// first-match lists the kernel's fallback to identities would not follow).
    identities: Option<&'a Registry>,
}

/// The pods a peer's selectors picked, and their addresses or identities once asked for.
pub(super) struct Picked<'a> {
    pub(super) pods: Vec<&'a PolicyPod>,
    addresses: std::cell::OnceCell<Vec<IpNet>>,
    identities: std::cell::OnceCell<Vec<u32>>,
}

impl<'a> Picked<'a> {
    fn new(pods: Vec<&'a PolicyPod>) -> Rc<Self> {
        Rc::new(Self {
            pods,
            addresses: Default::default(),
            identities: Default::default(),
        })
    }

    fn addresses(&self) -> &[IpNet] {
        self.addresses.get_or_init(|| addresses(&self.pods))
    }

    /// The identities of the pods with addresses, ascending. A pod labelled as the one
    /// before it (of the same namespace) has its identity without a lookup: the pods a
    /// selector picks mostly come in runs of one app, and hashing 300 peers' labels was most
    /// of a peer pod added.
    fn identities(&self, registry: &Registry) -> &[u32] {
        self.identities.get_or_init(|| {
            let mut registry = registry.borrow_mut();
            let mut ids: Vec<u32> = Vec::new();
            let mut last: Option<&PolicyPod> = None;
            for &pod in self.pods.iter().filter(|pod| !pod.addresses.is_empty()) {
                let alike =
                    last.is_some_and(|l| l.namespace == pod.namespace && l.labels == pod.labels);
                if !alike {
                    ids.push(registry.identity(&pod.namespace, &pod.labels));
                }
                last = Some(pod);
            }
            ids.sort_unstable();
            ids.dedup();
            ids
        })
    }
}

/// The pods a pod's rules were compiled from, by namespace: a change to a pod none of them
/// picks, before or after it, leaves the rules as they are. In a namespace of 300 pods with
/// local pods, a pod added there recompiled each local pod of the namespace (and with it its
/// own peers, 1,200 of them at scale) although no rule of theirs picked it.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Reads {
    #[default]
    Nothing,
    Namespaces(BTreeMap<String, Vec<Read>>),
    /// Every namespace's pods (an egress rule to everywhere, a selector without labels).
    All,
}

/// One look at a namespace's pods.
#[derive(Clone, Debug, PartialEq)]
pub enum Read {
    /// The pods a pod selector picks (`None`: every one).
    Selected(Option<LabelSelector>),
    /// The pod of this name: the compiled pod itself (its labels pick its policies, its
    /// named ports resolve its ingress rules).
    Named(String),
}

impl Read {
    /// Whether a change of `pod` may change what this look saw: the pod picked, before the
    /// change or after it.
    fn touched_by(&self, pod: &ChangedPod) -> bool {
        match self {
            Read::Named(name) => *name == pod.name,
            Read::Selected(None) => true,
            // A selector that fails picked nothing; counted as picking, to be safe.
            Read::Selected(Some(selector)) => pod
                .labels
                .iter()
                .any(|labels| selects(selector, labels).unwrap_or(true)),
        }
    }
}

impl Reads {
    fn add(&mut self, namespace: &str, read: Read) {
        match self {
            Reads::Nothing => {
                *self = Reads::Namespaces(BTreeMap::from([(namespace.to_owned(), vec![read])]))
            }
            Reads::Namespaces(names) => {
                let reads = names.entry(namespace.to_owned()).or_default();
                if !reads.contains(&read) {
                    reads.push(read);
                }
            }
            Reads::All => {}
        }
    }

    /// Adds what `other` read.
    fn merge(&mut self, other: &Reads) {
        match other {
            Reads::Nothing => {}
            Reads::All => *self = Reads::All,
            Reads::Namespaces(names) => {
                for (namespace, reads) in names {
                    for read in reads {
                        self.add(namespace, read.clone());
                    }
                }
            }
        }
    }

    /// Whether one of the pod changes `pods` (by namespace) may change what was read.
    fn touched_by(&self, pods: &BTreeMap<String, Vec<ChangedPod>>) -> bool {
        match self {
            Reads::Nothing => false,
            // From the changes (a namespace or two) into the reads (all of 110 local pods'
            // are looked at for each change).
            Reads::Namespaces(names) => pods.iter().any(|(namespace, changed)| {
                names.get(namespace).is_some_and(|reads| {
                    changed
                        .iter()
                        .any(|pod| reads.iter().any(|read| read.touched_by(pod)))
                })
            }),
            Reads::All => !pods.is_empty(),
        }
    }
}

impl<'a> PolicyCluster<'a> {
    pub fn new(pods: &'a PolicyPods, namespaces: &'a NamespaceLabels) -> Self {
        Self {
            pods,
            namespaces,
            reads: Default::default(),
            picked: Default::default(),
            identities: None,
        }
    }

    /// The cluster with peer pods named by identity, handed out by `registry`.
    pub fn with_identities(mut self, registry: &'a Registry) -> Self {
        self.identities = Some(registry);
        self
    }

    /// How many distinct peers this compile has picked.
    #[cfg(test)]
    pub(super) fn peers_picked(&self) -> usize {
        self.picked.borrow().len()
    }

    fn read(&self, namespace: &str, read: Read) {
        self.reads.borrow_mut().add(namespace, read);
    }

    fn read_all(&self) {
        *self.reads.borrow_mut() = Reads::All;
    }

    /// The namespaces that may match `selector`, in name order: those with the rarest of its
    /// `matchLabels` (a namespace without labels matches none), or every one with pods.
    fn candidate_namespaces(&self, selector: &LabelSelector) -> Vec<&'a str> {
        let (namespaces, pods): (&'a NamespaceLabels, &'a PolicyPods) =
            (self.namespaces, self.pods);
        let rarest = selector
            .match_labels
            .iter()
            .flatten()
            .map(|(k, v)| namespaces.with_label(k, v))
            .min_by_key(|names| names.len());
        match rarest {
            Some(names) => names.iter().map(String::as_str).collect(),
            None => {
                // Any namespace's first pod may be picked.
                self.read_all();
                pods.namespaces().map(|(name, _)| name).collect()
            }
        }
    }
}

/// Compiles the rules of every policy that selects `pod`. Errors name a policy and field; such a
/// policy still isolates what it selects.
pub fn pod_policy(
    policies: &[Arc<NetworkPolicy>],
    cluster: &PolicyCluster<'_>,
    pod: &PolicyPod,
) -> (PodPolicy, Vec<String>) {
    let parts = parts_reusing(
        policies,
        cluster,
        pod,
        Vec::new(),
        &PolicyChanges::default(),
    );
    assemble_parts(&parts)
}

/// What one NetworkPolicy of a pod's namespace gives the pod, compiled alone, so that a pod
/// recompiled because one of its policies changed (or a peer of one) takes the others' parts
/// as they were ([`parts_reusing`]): at 1,200 peers over four policies, resolving every
/// policy's peers again was most of a policy's port changed.
#[derive(Clone, Debug)]
pub struct PolicyPart {
    policy: Arc<NetworkPolicy>,
    /// Whether the policy selects the pod, and its rules (rule indexes from 0) or error in
    /// each direction it isolates; `Err`: the policy's pod selector fails.
    selected: Result<Option<Vec<DirectionPart>>, String>,
    /// The pods its peers' selectors looked at.
    reads: Reads,
}

/// A policy's rules in one direction (rule indexes from 0), or why it has none.
type DirectionPart = (Direction, Result<PodRules, String>);

/// The part of `policy` (of the pod's namespace) for `pod`.
fn policy_part(
    policy: &Arc<NetworkPolicy>,
    cluster: &PolicyCluster<'_>,
    pod: &PolicyPod,
) -> PolicyPart {
    let namespace = pod.namespace.as_str();
    let name = format!(
        "{namespace}/{}",
        policy.metadata.name.as_deref().unwrap_or("")
    );
    // This part's reads alone, then added back to the pod's.
    let outer = cluster.reads.take();
    let selected = policy_directions(policy, &name, namespace, cluster, pod);
    let reads = cluster.reads.replace(outer);
    cluster.reads.borrow_mut().merge(&reads);
    PolicyPart {
        policy: Arc::clone(policy),
        selected,
        reads,
    }
}

/// Whether `policy` (named `name`) selects `pod`, and its rules in each direction it isolates.
fn policy_directions(
    policy: &NetworkPolicy,
    name: &str,
    namespace: &str,
    cluster: &PolicyCluster<'_>,
    pod: &PolicyPod,
) -> Result<Option<Vec<DirectionPart>>, String> {
    let Some(spec) = &policy.spec else {
        return Ok(None);
    };
    let everything = LabelSelector::default();
    match selects(
        spec.pod_selector.as_ref().unwrap_or(&everything),
        &pod.labels,
    ) {
        Ok(true) => {}
        Ok(false) => return Ok(None),
        Err(e) => return Err(format!("NetworkPolicy {name}: spec.podSelector: {e}")),
    }
    let mut directions = Vec::new();
    for direction in policy_types(spec) {
        let mut rules = PodRules::default();
        let added = add_direction(&mut rules, spec, direction, name, namespace, cluster, pod)
            .and_then(|()| fits_alone(&rules, direction).map(|()| rules))
            .map_err(|e| {
                format!("NetworkPolicy {name}: {e}; it isolates its pods and allows nothing")
            });
        directions.push((direction, added));
    }
    Ok(Some(directions))
}

/// Whether one policy's rules for one pod and direction stay within
/// [`super::POLICY_MAX_PREFIXES`] address entries per family, counted alone: a policy of many
/// networks over many prefix lengths expands into more entries than any set may hold.
fn fits_alone(rules: &PodRules, direction: Direction) -> Result<(), String> {
    for ipv4 in [true, false] {
        let nets = rules
            .rules
            .iter()
            .flat_map(|r| r.destinations.iter().chain(&r.except))
            .filter(|n| matches!(n, IpNet::V4(_)) == ipv4)
            .copied();
        let needed = super::estimated_entries(nets);
        if needed > super::POLICY_MAX_PREFIXES as u128 {
            let field = match direction {
                Direction::Ingress => "spec.ingress[].from[].ipBlock",
                Direction::Egress => "spec.egress[].to[].ipBlock",
            };
            return Err(format!(
                "{field}: its {} networks would need about {needed} address entries for one pod, more than the {} one policy may have (fewer prefix lengths, or fewer networks)",
                if ipv4 { "IPv4" } else { "IPv6" },
                super::POLICY_MAX_PREFIXES
            ));
        }
    }
    Ok(())
}

/// The part whose rules in `direction` need the most address entries: what is refused when
/// a pod's policies fit alone but not together.
fn largest_part(parts: &[PolicyPart], direction: Direction) -> Option<usize> {
    parts
        .iter()
        .enumerate()
        .filter_map(|(index, part)| {
            let directions = part.selected.as_ref().ok()?.as_ref()?;
            let (_, rules) = directions.iter().find(|(d, _)| *d == direction)?;
            let rules = rules.as_ref().ok()?;
            let nets = rules
                .rules
                .iter()
                .flat_map(|r| r.destinations.iter().chain(&r.except))
                .copied();
            Some((index, super::estimated_entries(nets)))
        })
        .max_by_key(|&(index, entries)| (entries, std::cmp::Reverse(index)))
        .map(|(index, _)| index)
}

/// `parts` with the rules of `parts[index]` in `direction` refused for `why`: the policy
/// still isolates the pod and allows nothing there, as an invalid policy does.
fn refuse_part(parts: &mut [PolicyPart], index: usize, direction: Direction, why: &str) {
    let part = &mut parts[index];
    let name = format!(
        "{}/{}",
        part.policy
            .metadata
            .namespace
            .as_deref()
            .unwrap_or("default"),
        part.policy.metadata.name.as_deref().unwrap_or("")
    );
    if let Ok(Some(directions)) = &mut part.selected {
        for (d, rules) in directions.iter_mut() {
            if *d == direction {
                *rules = Err(format!(
                    "NetworkPolicy {name}: {why}; it isolates its pods and allows nothing"
                ));
            }
        }
    }
}

/// The pod's rules from its policies' parts, in order: each part's rules numbered after
/// those before it in its direction.
fn assemble_parts(parts: &[PolicyPart]) -> (PodPolicy, Vec<String>) {
    let mut result = PodPolicy::default();
    let mut errors = Vec::new();
    for part in parts {
        let directions = match &part.selected {
            Ok(Some(directions)) => directions,
            Ok(None) => continue,
            Err(e) => {
                errors.push(e.clone());
                continue;
            }
        };
        for (direction, added) in directions {
            let slot = match direction {
                Direction::Ingress => &mut result.ingress,
                Direction::Egress => &mut result.egress,
            };
            let rules = slot.get_or_insert_with(PodRules::default);
            match added {
                Ok(added) => {
                    let first = rules.refs.len() as u32;
                    rules.rules.extend(added.rules.iter().map(|rule| Rule {
                        index: rule.index + first,
                        ..rule.clone()
                    }));
                    rules.refs.extend(added.refs.iter().cloned());
                }
                Err(e) => errors.push(e.clone()),
            }
        }
    }
    (result, errors)
}

/// The parts of `policies` for `pod`, taking from `last` (the pod's parts of its last
/// compile) those of the same policy object whose reads `changes` leaves alone. `last` is
/// of no use when the pod itself changed (its labels pick its policies, its named ports
/// resolve their ports): the caller passes none then.
fn parts_reusing(
    policies: &[Arc<NetworkPolicy>],
    cluster: &PolicyCluster<'_>,
    pod: &PolicyPod,
    mut last: Vec<PolicyPart>,
    changes: &PolicyChanges,
) -> Vec<PolicyPart> {
    let mut parts = Vec::new();
    for policy in policies {
        if policy.metadata.namespace.as_deref().unwrap_or("default") != pod.namespace {
            continue;
        }
        // A part holds its policy: the object's address is not taken by another meanwhile.
        let kept = last
            .iter()
            .position(|part| Arc::ptr_eq(&part.policy, policy))
            .map(|at| last.swap_remove(at))
            .filter(|part| !part.reads.touched_by(&changes.pods));
        match kept {
            Some(part) => {
                cluster.reads.borrow_mut().merge(&part.reads);
                parts.push(part);
            }
            None => parts.push(policy_part(policy, cluster, pod)),
        }
    }
    parts
}

fn policy_types(spec: &k8s_openapi::api::networking::v1::NetworkPolicySpec) -> BTreeSet<Direction> {
    match &spec.policy_types {
        Some(types) => types
            .iter()
            .filter_map(|t| match t.as_str() {
                "Ingress" => Some(Direction::Ingress),
                "Egress" => Some(Direction::Egress),
                _ => None,
            })
            .collect(),
        None => {
            let mut types = BTreeSet::from([Direction::Ingress]);
            if spec.egress.is_some() {
                types.insert(Direction::Egress);
            }
            types
        }
    }
}

/// A rule's peers and ports, whichever direction.
type RuleParts<'a> = (
    Option<&'a Vec<NetworkPolicyPeer>>,
    Option<&'a Vec<NetworkPolicyPort>>,
);

/// Adds one policy's rules of one direction, all or nothing.
fn add_direction(
    out: &mut PodRules,
    spec: &k8s_openapi::api::networking::v1::NetworkPolicySpec,
    direction: Direction,
    policy: &str,
    namespace: &str,
    cluster: &PolicyCluster<'_>,
    pod: &PolicyPod,
) -> Result<(), String> {
    let mut added = PodRules::default();
    let (field, rules): (&str, Vec<RuleParts<'_>>) = match direction {
        Direction::Ingress => (
            "ingress",
            spec.ingress
                .iter()
                .flatten()
                .map(|r| (r.from.as_ref(), r.ports.as_ref()))
                .collect(),
        ),
        Direction::Egress => (
            "egress",
            spec.egress
                .iter()
                .flatten()
                .map(|r| (r.to.as_ref(), r.ports.as_ref()))
                .collect(),
        ),
    };
    for (index, (peers, ports)) in rules.into_iter().enumerate() {
        let at = |what: &str, e: String| format!("spec.{field}[{index}].{what}: {e}");
        let ports = ports.map(Vec::as_slice).unwrap_or_default();
        let specs: Vec<PortSpec> = ports
            .iter()
            .enumerate()
            .map(|(i, p)| port_spec(p).map_err(|e| at(&format!("ports[{i}]"), e)))
            .collect::<Result<_, _>>()?;
        let reference = (out.refs.len() + added.refs.len()) as u32;
        let mut push =
            |destinations: Vec<IpNet>, except: Vec<IpNet>, peers: Vec<u32>, ports: Ports| {
                if destinations.is_empty() && peers.is_empty() {
                    return;
                }
                added.rules.push(Rule {
                    index: reference,
                    verdict: Verdict::Allow,
                    destinations,
                    except,
                    peers,
                    ports,
                });
            };
        let peers = peers.map(Vec::as_slice).unwrap_or_default();
        // Named ports of ingress rules resolve against this pod, for every peer alike.
        let own_ports = resolve(&specs, &pod.named_ports);
        if peers.is_empty() {
            let everything = vec![
                "0.0.0.0/0".parse().expect("valid"),
                "::/0".parse().expect("valid"),
            ];
            match direction {
                Direction::Ingress => push(everything, Vec::new(), Vec::new(), own_ports.clone()),
                // Every address: pods by their own named ports, the rest by numbers only
                // (with numbers only, every pod too: nothing to name by identity).
                Direction::Egress => {
                    cluster.read_all();
                    if cluster.identities.is_none() || names_ports(&specs) {
                        add_pod_peers(cluster.pods.iter().collect(), &specs, &mut |d, e, p| {
                            push(d, e, Vec::new(), p)
                        });
                    }
                    let ports = resolve(&specs, &BTreeMap::new());
                    push(everything, Vec::new(), Vec::new(), ports);
                }
            }
        }
        for (p, peer) in peers.iter().enumerate() {
            if let Some(block) = &peer.ip_block {
                let cidr: IpNet = block.cidr.parse().map_err(|_| {
                    at(
                        &format!("{}[{p}].ipBlock.cidr", peer_field(direction)),
                        format!("{:?} is not a CIDR", block.cidr),
                    )
                })?;
                let except = block
                    .except
                    .iter()
                    .flatten()
                    .map(|e| {
                        e.parse::<IpNet>().map_err(|_| {
                            at(
                                &format!("{}[{p}].ipBlock.except", peer_field(direction)),
                                format!("{e:?} is not a CIDR"),
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let ports = match direction {
                    Direction::Ingress => own_ports.clone(),
                    Direction::Egress => resolve(&specs, &BTreeMap::new()),
                };
                push(vec![cidr], except, Vec::new(), ports);
                continue;
            }
            let selected = peer_pods(peer, namespace, cluster)
                .map_err(|e| at(&format!("{}[{p}]", peer_field(direction)), e))?;
            // By identity where the ports are the same for every peer pod: ingress ports
            // resolve on this pod, egress numbers on none.
            let same_ports = match direction {
                Direction::Ingress => Some(own_ports.clone()),
                Direction::Egress => {
                    (!names_ports(&specs)).then(|| resolve(&specs, &BTreeMap::new()))
                }
            };
            match (cluster.identities, same_ports) {
                (Some(registry), Some(ports)) => {
                    let ids = selected.identities(registry).to_vec();
                    push(Vec::new(), Vec::new(), ids, ports);
                }
                (None, Some(ports)) if direction == Direction::Ingress => {
                    push(selected.addresses().to_vec(), Vec::new(), Vec::new(), ports)
                }
                _ => add_pod_peers(selected.pods.clone(), &specs, &mut |d, e, p| {
                    push(d, e, Vec::new(), p)
                }),
            }
        }
        added.refs.push(RuleRef {
            kind: PolicyKind::NetworkPolicy,
            tier: None,
            policy: policy.to_owned(),
            direction,
            rule: index,
            name: String::new(),
        });
    }
    out.rules.extend(added.rules);
    out.refs.extend(added.refs);
    Ok(())
}

/// Whether a rule's ports name container ports (which resolve on each peer pod).
fn names_ports(specs: &[PortSpec]) -> bool {
    specs.iter().any(|spec| matches!(spec, PortSpec::Named(..)))
}

fn peer_field(direction: Direction) -> &'static str {
    match direction {
        Direction::Ingress => "from",
        Direction::Egress => "to",
    }
}

/// Egress to pods: grouped by how the rule's named ports resolve on each, one rule per group.
pub(super) fn add_pod_peers(
    pods: Vec<&PolicyPod>,
    specs: &[PortSpec],
    push: &mut impl FnMut(Vec<IpNet>, Vec<IpNet>, Ports),
) {
    let mut groups: Vec<(Ports, Vec<IpNet>)> = Vec::new();
    for pod in pods {
        let ports = resolve(specs, &pod.named_ports);
        let nets = pod.addresses.iter().map(|a| IpNet::from(*a));
        match groups.iter_mut().find(|(p, _)| *p == ports) {
            Some((_, list)) => list.extend(nets),
            None => groups.push((ports, nets.collect())),
        }
    }
    for (ports, nets) in groups {
        push(nets, Vec::new(), ports);
    }
}

fn addresses(pods: &[&PolicyPod]) -> Vec<IpNet> {
    pods.iter()
        .flat_map(|p| p.addresses.iter().map(|a| IpNet::from(*a)))
        .collect()
}

/// The pods a peer's selectors pick: the namespaces first (the policy's own without a
/// namespaceSelector), then the pods of those namespaces.
fn peer_pods<'a>(
    peer: &NetworkPolicyPeer,
    namespace: &str,
    cluster: &PolicyCluster<'a>,
) -> Result<Rc<Picked<'a>>, String> {
    if cluster.pods.is_empty() {
        return Ok(Picked::new(Vec::new()));
    }
    if let Some(selector) = &peer.namespace_selector {
        check_selector(selector).map_err(|e| format!("namespaceSelector: {e}"))?;
    }
    if let Some(selector) = &peer.pod_selector {
        check_selector(selector).map_err(|e| format!("podSelector: {e}"))?;
    }
    let namespaces: Vec<&str> = match &peer.namespace_selector {
        None => vec![namespace],
        Some(selector) => namespaces_picked(cluster, selector)?,
    };
    pods_among(cluster, &namespaces, peer.pod_selector.as_ref())
}

/// The namespaces `selector` picks, with pods or not yet, in name order.
fn namespaces_picked<'a>(
    cluster: &PolicyCluster<'a>,
    selector: &LabelSelector,
) -> Result<Vec<&'a str>, String> {
    let empty = BTreeMap::new();
    let mut picked = Vec::new();
    for name in cluster.candidate_namespaces(selector) {
        let labels = cluster.namespaces.get(name).unwrap_or(&empty);
        if selects(selector, labels)? {
            picked.push(name);
        }
    }
    Ok(picked)
}

/// The pods among `namespaces`' that `pod_selector` picks (all without one), each
/// namespace's look noted for [`PodRulesCache`] (also where it has no pods yet: one added
/// there may be picked).
fn pods_among<'a>(
    cluster: &PolicyCluster<'a>,
    namespaces: &[&str],
    pod_selector: Option<&LabelSelector>,
) -> Result<Rc<Picked<'a>>, String> {
    for namespace in namespaces {
        cluster.read(namespace, Read::Selected(pod_selector.cloned()));
    }
    let key = format!("{namespaces:?} {pod_selector:?}");
    if let Some(picked) = cluster.picked.borrow().get(&key) {
        return Ok(Rc::clone(picked));
    }
    let pods: &'a PolicyPods = cluster.pods;
    let mut chosen = Vec::new();
    for namespace in namespaces {
        if let Some(in_namespace) = pods.of_namespace(namespace) {
            chosen.extend(in_namespace.selected(pod_selector)?);
        }
    }
    let picked = Picked::new(chosen);
    cluster.picked.borrow_mut().insert(key, Rc::clone(&picked));
    Ok(picked)
}

/// The pods of the namespaces `namespaces` picks that `pods` picks (validated selectors:
/// one that fails picks nothing).
pub(super) fn select_pods<'a>(
    cluster: &PolicyCluster<'a>,
    namespaces: &LabelSelector,
    pods: Option<&LabelSelector>,
) -> Vec<&'a PolicyPod> {
    namespaces_picked(cluster, namespaces)
        .and_then(|picked| pods_among(cluster, &picked, pods))
        .map(|picked| picked.pods.clone())
        .unwrap_or_default()
}

/// A selector's operators are all ones [`selects`] knows, whatever labels it meets.
fn check_selector(selector: &LabelSelector) -> Result<(), String> {
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

/// A validated port of a rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortSpec {
    Range(PortMatch),
    /// A container port name, of one protocol (NetworkPolicy) or of any (admin policies).
    Named(Option<u8>, String),
}

fn port_spec(port: &NetworkPolicyPort) -> Result<PortSpec, String> {
    let protocol = protocol_number(port.protocol.as_deref().unwrap_or("TCP")).ok_or_else(|| {
        format!(
            "protocol {:?} is not TCP, UDP or SCTP",
            port.protocol.as_deref().unwrap_or_default()
        )
    })?;
    match (&port.port, port.end_port) {
        (None, None) => Ok(PortSpec::Range(PortMatch::all_ports(protocol))),
        (None, Some(_)) => Err("endPort without port".into()),
        (Some(IntOrString::Int(first)), end) => {
            let last = end.unwrap_or(*first);
            let valid = |p: i32| (1..=65535).contains(&p);
            if !valid(*first) || !valid(last) || last < *first {
                return Err(format!(
                    "port {first} to endPort {last} is not a range within 1-65535"
                ));
            }
            Ok(PortSpec::Range(PortMatch {
                protocol,
                first: *first as u16,
                last: last as u16,
            }))
        }
        (Some(IntOrString::String(_)), Some(_)) => Err("endPort with a named port".into()),
        (Some(IntOrString::String(name)), None) => {
            Ok(PortSpec::Named(Some(protocol), name.clone()))
        }
    }
}

/// A rule's ports with named ones resolved against `named` (a name that resolves to nothing
/// matches nothing). No ports at all: everything.
pub(super) fn resolve(specs: &[PortSpec], named: &BTreeMap<String, Vec<(u8, u16)>>) -> Ports {
    if specs.is_empty() {
        return Ports::Any;
    }
    let mut matches = Vec::new();
    for spec in specs {
        match spec {
            PortSpec::Range(m) => matches.push(*m),
            PortSpec::Named(protocol, name) => matches.extend(
                named
                    .get(name)
                    .into_iter()
                    .flatten()
                    .filter(|(p, _)| protocol.is_none_or(|wanted| *p == wanted))
                    .map(|(p, port)| PortMatch::port(*p, *port)),
            ),
        }
    }
    Ports::Only(matches)
}

/// One isolated direction of one or more local pods of a namespace: what the kernel holds as a
/// policy set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicySet {
    pub namespace: String,
    pub direction: Direction,
    /// What each rule index of the set stands for (audit records). Shared, as `compiled`
    /// is: the set as last installed is compared with the wanted one at every sync, and
    /// comparing 110 sets' references string by string was a tenth of the ACL sync.
    pub refs: Arc<Vec<RuleRef>>,
    pub compiled: Arc<CompiledSet>,
    /// The rules `compiled` was made from: a later set of the same pod that differs only in
    /// peer hosts is made from this one (`acl::recompile_hosts`).
    pub rules: Arc<Vec<Rule>>,
}

/// The policy set names of a pod; `None` where nothing judges that direction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodSets {
    pub ingress: Option<String>,
    pub egress: Option<String>,
    /// `ACL_LOG_*` flags of the admin policies whose rules the sets hold.
    pub log: u8,
    /// Its admin policies name wildcard domains: its DNS answers are snooped.
    pub snoop_dns: bool,
}

/// Every local pod's policy sets, the distinct sets by name, and one line per invalid policy.
#[derive(Clone, Debug, Default)]
pub struct CompiledPolicies {
    pub sets: BTreeMap<String, PolicySet>,
    pub pods: BTreeMap<String, PodSets>,
    pub errors: Vec<String>,
}

/// Compiles the policies for the pods of this node (`local`: `<namespace>/<name>` keys) against
/// every pod of the cluster. Pods of one namespace with the same rules share a set, named after
/// its contents so that an unchanged set keeps its name (and its maps) across syncs; a set of
/// `previous` (the last compile's) keeps its compiled lookups too, and only new sets are
/// compiled.
pub fn policy_sets(
    policies: &[Arc<NetworkPolicy>],
    cluster: &PolicyCluster<'_>,
    local: &[String],
    previous: &BTreeMap<String, PolicySet>,
    admin: &AdminPolicies,
) -> CompiledPolicies {
    let mut compiled = CompiledPolicies {
        sets: previous.clone(),
        ..CompiledPolicies::default()
    };
    policy_sets_since(
        policies,
        cluster,
        local,
        &mut compiled,
        admin,
        &mut PodRulesCache::default(),
        &PolicyChanges::everything(),
    );
    compiled
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

/// Each local pod's policy sets as the last compile gave them, and whose pods they were
/// compiled from: a change recompiles only the local pods it can affect (those of a namespace
/// whose policies changed, and those whose rules picked a changed pod). At 110 local pods
/// each taking 1,200 peers, compiling them all took a change 25 ms. Not kept with admin
/// policies in force: their rules read every pod, the nodes and DNS answers.
#[derive(Clone, Debug, Default)]
pub struct PodRulesCache {
    /// By `<namespace>/<name>`.
    pods: BTreeMap<String, CachedPod>,
}

#[derive(Clone, Debug)]
struct CachedPod {
    sets: PodSets,
    errors: Vec<String>,
    reads: Reads,
    /// Its policies' parts.
    parts: Vec<PolicyPart>,
}

impl CachedPod {
    /// Whether the last compile of the pod, of `namespace`, still holds after `changes`.
    fn still_holds(&self, namespace: &str, changes: &PolicyChanges) -> bool {
        // The reads include the pod itself.
        !changes.policies.contains(namespace) && !self.reads.touched_by(&changes.pods)
    }
}

/// What [`policy_sets_since`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recompiled {
    /// Local pods compiled anew (the others kept their last compile's sets).
    pub pods: usize,
    /// Whether a local pod's sets changed, or a pod's came or went.
    pub changed: bool,
}

/// [`policy_sets`], changing `last` (the last compile's, of the same local pods or others)
/// in place: only the local pods `changes` can affect since the compile `cache` holds are
/// compiled again, the sets no local pod names any more dropped. When a change reaches no
/// local pod, nothing is copied or rebuilt: at 110 local pods, making every pod's entry and
/// moving every set again cost a change elsewhere in a large cluster more than the rest of
/// access control.
pub fn policy_sets_since(
    policies: &[Arc<NetworkPolicy>],
    cluster: &PolicyCluster<'_>,
    local: &[String],
    last: &mut CompiledPolicies,
    admin: &AdminPolicies,
    cache: &mut PodRulesCache,
    changes: &PolicyChanges,
) -> Recompiled {
    let admin_in_force = admin.all().next().is_some();
    if changes.everything || admin_in_force {
        cache.pods.clear();
    }
    let mut stale: BTreeSet<&str> = BTreeSet::new();
    let mut cached = 0;
    for key in local {
        let holds = cache.pods.get(key.as_str()).is_some_and(|pod| {
            let namespace = key.split_once('/').map_or("", |(namespace, _)| namespace);
            pod.still_holds(namespace, changes) && sets_present(&pod.sets, &last.sets)
        });
        if holds {
            cached += 1;
        } else {
            stale.insert(key);
        }
    }
    let none_gone = cached == local.len() && cache.pods.len() == local.len();
    if stale.is_empty() && none_gone {
        return Recompiled::default();
    }
    let mut done = Recompiled::default();
    let local_keys: BTreeSet<&str> = local.iter().map(String::as_str).collect();
    let gone: Vec<String> = cache
        .pods
        .keys()
        .filter(|key| !local_keys.contains(key.as_str()))
        .cloned()
        .collect();
    for key in gone {
        cache.pods.remove(&key);
        done.changed |= last.pods.remove(&key).is_some();
    }
    // Errors of the pods compiled but not cached (admin policies in force).
    let mut uncached_errors = Vec::new();
    for key in stale {
        // The pod's sets of the last compile, which a set that moved by a few peers is made
        // from.
        let (prior, parts) = match cache.pods.remove(key) {
            Some(pod) => (pod.sets, pod.parts),
            None => (last.pods.get(key).cloned().unwrap_or_default(), Vec::new()),
        };
        let found = key
            .split_once('/')
            .and_then(|(namespace, name)| cluster.pods.get(namespace, name));
        let Some(pod) = found else {
            done.changed |= last.pods.remove(key).is_some();
            continue;
        };
        done.pods += 1;
        // The pod itself changed: its labels pick its policies, its named ports resolve them.
        let itself = changes
            .pods
            .get(&pod.namespace)
            .is_some_and(|changed| changed.iter().any(|c| c.name == pod.name));
        let parts = if itself { Vec::new() } else { parts };
        let (sets, errors, reads, parts) =
            compile_pod(policies, cluster, admin, pod, &prior, parts, changes, last);
        let before = if sets == PodSets::default() {
            last.pods.remove(key)
        } else {
            last.pods.insert(key.to_owned(), sets.clone())
        };
        done.changed |= before.unwrap_or_default() != sets;
        if admin_in_force {
            uncached_errors.extend(errors);
        } else {
            cache.pods.insert(
                key.to_owned(),
                CachedPod {
                    sets,
                    errors,
                    reads,
                    parts,
                },
            );
        }
    }
    // The sets no local pod names any more.
    let named: BTreeSet<&str> = last
        .pods
        .values()
        .flat_map(|sets| [&sets.ingress, &sets.egress])
        .flatten()
        .map(String::as_str)
        .collect();
    last.sets.retain(|name, _| named.contains(name.as_str()));
    let errors: BTreeSet<String> = cache
        .pods
        .values()
        .flat_map(|pod| pod.errors.iter().cloned())
        .chain(uncached_errors)
        .collect();
    last.errors = errors.into_iter().collect();
    done
}

/// Whether the sets `sets` names are all in `sets_by_name`.
fn sets_present(sets: &PodSets, sets_by_name: &BTreeMap<String, PolicySet>) -> bool {
    [&sets.ingress, &sets.egress]
        .into_iter()
        .flatten()
        .all(|name| sets_by_name.contains_key(name))
}

/// Compiles one local pod's sets, adding those not in `last` (made from the pod's `prior`
/// sets where they moved by a few peers, from its policies' `parts` of the last compile
/// where `changes` leaves them); also its errors, what it read and its policies' parts.
#[expect(
    clippy::too_many_arguments,
    reason = "the pod, its cluster, its policies and what the last compile left, passed down"
)]
fn compile_pod(
    policies: &[Arc<NetworkPolicy>],
    cluster: &PolicyCluster<'_>,
    admin: &AdminPolicies,
    pod: &PolicyPod,
    prior: &PodSets,
    parts: Vec<PolicyPart>,
    changes: &PolicyChanges,
    last: &mut CompiledPolicies,
) -> (PodSets, Vec<String>, Reads, Vec<PolicyPart>) {
    *cluster.reads.borrow_mut() = Reads::Nothing;
    cluster.read(&pod.namespace, Read::Named(pod.name.clone()));
    let parts = parts_reusing(policies, cluster, pod, parts, changes);
    // The parts with those refused for size (a copy, made at the first refusal): the parts
    // themselves are kept for the next compile, which may find room for them.
    let mut refused: Option<Vec<PolicyPart>> = None;
    let mut sets = PodSets::default();
    let mut errors = Vec::new();
    for direction in [Direction::Ingress, Direction::Egress] {
        // Policies that fit alone may not fit together: the largest is refused (it allows
        // nothing for this pod), and the rest compiled again, until what is left fits.
        let (name, notes) = loop {
            let working = refused.as_deref().unwrap_or(&parts);
            let (policy, _) = assemble_parts(working);
            let rules = match direction {
                Direction::Ingress => policy.ingress,
                Direction::Egress => policy.egress,
            };
            let (rules, notes) = with_tiers(rules, direction, cluster, admin, pod);
            let Some(rules) = rules else {
                break (None, notes);
            };
            match compile_set(&pod.namespace, direction, rules, prior, last) {
                Ok(name) => break (Some(name), notes),
                Err(too_large) => match largest_part(working, direction) {
                    Some(index) => refuse_part(
                        refused.get_or_insert_with(|| parts.clone()),
                        index,
                        direction,
                        &format!("with the pod {}'s other policies, {too_large}", pod.key()),
                    ),
                    // Nothing of the namespace's own to refuse: the cluster-wide tiers alone
                    // are too large, and the pod's direction is closed.
                    None => {
                        errors.push(format!(
                            "pod {}: its admin network policies' {direction:?} rules: {too_large}; it is denied everything in that direction",
                            pod.key()
                        ));
                        let closed = PodRules::default();
                        let name = compile_set(&pod.namespace, direction, closed, prior, last)
                            .expect("an empty rule list fits");
                        break (Some(name), notes);
                    }
                },
            }
        };
        sets.log |= notes.log;
        sets.snoop_dns |= notes.snoop_dns;
        match direction {
            Direction::Ingress => sets.ingress = name,
            Direction::Egress => sets.egress = name,
        }
    }
    let (_, part_errors) = assemble_parts(refused.as_deref().unwrap_or(&parts));
    errors.splice(0..0, part_errors);
    (sets, errors, cluster.reads.take(), parts)
}

/// The name of the set of `rules` (one pod's, in `direction`), compiled into `last` unless it
/// is there already: made from the pod's `prior` set where it moved by a few peers or ports.
fn compile_set(
    namespace: &str,
    direction: Direction,
    rules: PodRules,
    prior: &PodSets,
    last: &mut CompiledPolicies,
) -> Result<String, super::SetTooLarge> {
    let name = set_name(namespace, direction, &rules);
    if last.sets.contains_key(&name) {
        return Ok(name);
    }
    let prior = match direction {
        Direction::Ingress => prior.ingress.as_ref(),
        Direction::Egress => prior.egress.as_ref(),
    };
    let base = prior.and_then(|n| last.sets.get(n));
    let reused = base.and_then(|base| {
        recompile_hosts(
            &base.rules,
            &base.compiled,
            &rules.rules,
            rules.admin_end,
            false,
        )
        .or_else(|| repaint_ports(&base.rules, &base.compiled, &rules.rules, rules.admin_end))
    });
    let compiled = match reused {
        Some(compiled) => compiled,
        None => compile_tiered(&rules.rules, rules.admin_end, false)?,
    };
    let set = PolicySet {
        namespace: namespace.to_owned(),
        direction,
        compiled: Arc::new(compiled),
        refs: Arc::new(rules.refs),
        rules: Arc::new(rules.rules),
    };
    last.sets.insert(name.clone(), set);
    Ok(name)
}

/// One direction of a pod with the cluster-wide tiers around its NetworkPolicy rules (`np`,
/// `None` where no NetworkPolicy isolates it): the admin tier's rules first, then the
/// NetworkPolicy rules (what none allows is denied: the kernel's default for a policy set),
/// or, for a pod no NetworkPolicy isolates, the baseline tier's rules and an allow for
/// everything else. `None`: nothing judges that direction. Also what the admin policies
/// that contributed ask of the pod's endpoint.
fn with_tiers(
    np: Option<PodRules>,
    direction: Direction,
    cluster: &PolicyCluster<'_>,
    admin: &AdminPolicies,
    pod: &PolicyPod,
) -> (Option<PodRules>, TierNotes) {
    let mut tiered = PodRules::default();
    let mut notes =
        super::admin::tier_rules(&admin.admin, direction, cluster, admin, pod, &mut tiered);
    tiered.admin_end = tiered.rules.len();
    let rest = match np {
        Some(np) => np,
        None => {
            let mut baseline = PodRules::default();
            notes.merge(super::admin::tier_rules(
                &admin.baseline,
                direction,
                cluster,
                admin,
                pod,
                &mut baseline,
            ));
            if tiered.rules.is_empty() && baseline.rules.is_empty() {
                return (None, notes);
            }
            // Nothing matched: allowed (not a rule anyone wrote, so never audited).
            baseline.rules.push(Rule {
                index: ACL_RULE_EXEMPT,
                verdict: Verdict::Allow,
                destinations: vec![
                    "0.0.0.0/0".parse().expect("valid"),
                    "::/0".parse().expect("valid"),
                ],
                except: Vec::new(),
                peers: Vec::new(),
                ports: Ports::Any,
            });
            baseline
        }
    };
    if tiered.rules.is_empty() {
        return (Some(rest), notes);
    }
    let offset = tiered.refs.len() as u32;
    tiered.rules.extend(rest.rules.into_iter().map(|mut rule| {
        if rule.index != ACL_RULE_EXEMPT {
            rule.index += offset;
        }
        rule
    }));
    tiered.refs.extend(rest.refs);
    (Some(tiered), notes)
}

/// `<namespace>:<direction>:<hash of the rules>`.
fn set_name(namespace: &str, direction: Direction, rules: &PodRules) -> String {
    use std::hash::{BuildHasher, Hash, Hasher};
    // A fixed seed: the same rules have the same name in every agent and every run. Not
    // SipHash: hashing a set of 1,200 peers with it was a tenth of a peer added.
    let mut hasher = foldhash::quality::FixedState::with_seed(0).build_hasher();
    rules.rules.hash(&mut hasher);
    rules.admin_end.hash(&mut hasher);
    for reference in &rules.refs {
        (
            reference.kind,
            &reference.policy,
            reference.rule,
            &reference.name,
        )
            .hash(&mut hasher);
    }
    let direction = match direction {
        Direction::Ingress => "ingress",
        Direction::Egress => "egress",
    };
    format!("{namespace}:{direction}:{:016x}", hasher.finish())
}
