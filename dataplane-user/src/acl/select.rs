//! Which pods a policy's selectors pick: the namespaces a `namespaceSelector` picks (looked up
//! by their rarest label), then the pods of those namespaces a `podSelector` picks; each pick
//! kept for the rest of the compile, and each namespace looked at noted, so that a later pod
//! change recompiles only the pods whose rules may have picked it.

use std::{
    collections::{BTreeMap, HashMap},
    rc::Rc,
};

use ipnet::IpNet;
use k8s_openapi::{
    api::networking::v1::NetworkPolicyPeer, apimachinery::pkg::apis::meta::v1::LabelSelector,
};

use super::{
    peers::Registry,
    pods::{
        ChangedPod, NamespaceLabels, PolicyPod, PolicyPods, addresses, check_selector, selects,
    },
};

/// The cluster as the policies are compiled against.
pub struct PolicyCluster<'a> {
    /// Every pod by namespace: a peer's selectors look at the namespaces first and then only
    /// at the pods of those they pick.
    pub pods: &'a PolicyPods,
    /// The namespaces' labels, and their names by label: a `namespaceSelector`'s
    /// `matchLabels` look at the namespaces with one of its labels rather than at every one.
    pub namespaces: &'a NamespaceLabels,
    /// Whose pods the compile of one pod's rules looked at (see [`PodRulesCache`]).
    pub(super) reads: std::cell::RefCell<Reads>,
    /// The peers picked so far in this compile, by the namespaces looked at and the pod
    /// selector ([`pods_among`]): policies often name the same peers (a namespace's
    /// policies taking the same clients, each selected pod compiled with them), and a pod
    /// picked by four policies of 300 such peers resolved the 300 four times.
    picked: std::cell::RefCell<HashMap<String, Rc<Picked<'a>>>>,
    /// Where peer pods are named by identity (no admin policy in force: their tiers are
    /// first-match lists the kernel's fallback to identities would not follow).
    pub(super) identities: Option<&'a Registry>,
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

    pub(super) fn addresses(&self) -> &[IpNet] {
        self.addresses.get_or_init(|| addresses(&self.pods))
    }

    /// The identities of the pods with addresses, ascending. A pod labelled as the one
    /// before it (of the same namespace) has its identity without a lookup: the pods a
    /// selector picks mostly come in runs of one app, and hashing 300 peers' labels was most
    /// of a peer pod added.
    pub(super) fn identities(&self, registry: &Registry) -> &[u32] {
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
    pub(super) fn merge(&mut self, other: &Reads) {
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
    pub(super) fn touched_by(&self, pods: &BTreeMap<String, Vec<ChangedPod>>) -> bool {
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

    pub(super) fn read(&self, namespace: &str, read: Read) {
        self.reads.borrow_mut().add(namespace, read);
    }

    pub(super) fn read_all(&self) {
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

/// The pods a peer's selectors pick: the namespaces first (the policy's own without a
/// namespaceSelector), then the pods of those namespaces.
pub(super) fn peer_pods<'a>(
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
