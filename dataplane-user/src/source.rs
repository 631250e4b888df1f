//! Cluster state from a directory of Kubernetes YAML manifests (the embedded default outside a
//! cluster): Nodes, Pods, Services and EndpointSlices as the API serves them (k8s-openapi
//! types), Namespaces, NetworkPolicies, OVN-Kubernetes' EgressFirewalls, and the OpenShift
//! network operator's `Network` for the overlay settings, decoded into k8s-openapi's types and
//! this project's (`api`), which validate them. Unknown kinds are skipped; an object
//! that does not parse is reported by file, kind and name and skipped, the rest still loads.
//! The directory is followed by its inotify events ([`ManifestWatch`]).

use std::{
    borrow::Cow,
    collections::{BTreeMap, BTreeSet, HashMap},
    fs,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use ipnet::IpNet;
use k8s_openapi::{
    api::{
        core::v1::{ContainerPort, Namespace, Node, PodIP, Service},
        discovery::v1::EndpointSlice,
        networking::v1::NetworkPolicy,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde::Deserialize;

use crate::{
    api::{
        adminpolicy::{
            AdminNetworkPolicy, AdminObjects, BaselineAdminNetworkPolicy, ClusterNetworkPolicy,
        },
        egressfirewall::EgressFirewall,
        egressip::{self, EgressIP},
        network::{
            EgressIpConfig, HybridSettings, NetworkOperator, OvnKubernetesConfig, PolicyAuditConfig,
        },
    },
    seq::{self, Seq},
};

/// Everything read from the manifests. The objects are shared (`Arc`): the state assembled
/// for a sync, the last sync's state and the sources' parse caches hold the same objects, so
/// an unchanged object compares equal by its pointer. Each kind's list is shared too
/// ([`Objects`]): handing a sync the state copies no list, and only a changed kind's list is
/// copied when it is patched.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterState {
    pub nodes: Objects<Node>,
    pub namespaces: Objects<Namespace>,
    pub pods: Objects<Pod>,
    pub services: Objects<Service>,
    pub endpoint_slices: Objects<EndpointSlice>,
    /// `networking.k8s.io/v1` NetworkPolicies (a missing namespace reads as `default`).
    pub network_policies: Objects<NetworkPolicy>,
    /// `k8s.ovn.org/v1` EgressFirewalls (a missing namespace reads as `default`).
    pub egress_firewalls: Objects<EgressFirewall>,
    /// Validated EgressIPs: their status says which node holds each address.
    pub egress_ips: Objects<EgressIP>,
    /// Cluster-wide admin policies (validated by access control, which keeps an invalid
    /// one's last good version).
    pub admin_network_policies: Objects<AdminNetworkPolicy>,
    pub baseline_admin_network_policies: Objects<BaselineAdminNetworkPolicy>,
    pub cluster_network_policies: Objects<ClusterNetworkPolicy>,
    /// `spec.defaultNetwork.ovnKubernetesConfig` of the `Network` named `cluster`, if any.
    pub network: Option<OvnKubernetesConfig>,
    /// `spec.clusterNetwork[].cidr` of that `Network`: the pod networks of the cluster.
    pub cluster_networks: Vec<IpNet>,
    /// `spec.serviceNetwork` of that `Network`: the service address ranges.
    pub service_networks: Vec<IpNet>,
    /// `ovnKubernetesConfig.policyAuditConfig` of that `Network`.
    pub policy_audit: PolicyAuditConfig,
    /// `ovnKubernetesConfig.egressIPConfig` of that `Network`.
    pub egress_ip_config: EgressIpConfig,
    /// `ovnKubernetesConfig.hybridOverlayConfig` of that `Network`, validated: the hybrid
    /// overlay is on when it is there.
    pub hybrid: Option<HybridSettings>,
    /// Objects skipped because they did not parse, one line each naming the object.
    pub rejected: Vec<String>,
}

/// One kind's objects, in a persistent sequence ([`Seq`]): states share it, and a change
/// copies only the chunk it falls in and the list of chunks. At 150,000 pods, copying the
/// whole list for one changed pod cost more than the change itself. An empty list allocates
/// nothing (a parse holds one object of one kind).
pub struct Objects<T>(Option<Box<Listed<T>>>);

/// A list and the journal of what was placed in it.
struct Listed<T> {
    objects: Seq<Arc<T>>,
    journal: Journal,
}

/// The keys placed in a list ([`Objects::place`]) since its journal began, so that a later
/// version of the list tells what differs from an earlier one without walking both (one pod
/// added among 150,000 walked 2,344 chunks). Any other change to the list begins a new
/// journal, which the next comparison with a version from before it cannot use: that one
/// walks the lists.
#[derive(Clone)]
struct Journal {
    /// Unique to this journal's beginning.
    base: u64,
    /// Each placed key (namespace, empty for none, and name) with a number unique to that
    /// placing: two versions agree up to an entry when both hold its number there.
    entries: imbl::Vector<(u64, (String, String))>,
}

/// How many placings a journal holds before it begins anew (a comparison across that walks).
const JOURNAL_LIMIT: usize = 4096;

/// Numbers unique within the process, for journals' beginnings and entries.
fn journal_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Journal {
    fn new() -> Self {
        Self {
            base: journal_number(),
            entries: imbl::Vector::new(),
        }
    }

    fn note(&mut self, key: (&str, &str)) {
        if self.entries.len() >= JOURNAL_LIMIT {
            *self = Self::new();
        }
        let key = (key.0.to_owned(), key.1.to_owned());
        self.entries.push_back((journal_number(), key));
    }

    /// The keys noted here since `old`'s last entry, when this journal is `old`'s continued
    /// (`None`: it is not, or not known to be).
    fn since<'a>(&'a self, old: &Self) -> Option<impl Iterator<Item = (&'a str, &'a str)>> {
        let at = old.entries.len();
        let continued = self.base == old.base
            && self.entries.len() >= at
            && (at == 0
                || self.entries.get(at - 1).map(|e| e.0) == old.entries.back().map(|e| e.0));
        continued.then(|| {
            (at..self.entries.len())
                .filter_map(|i| self.entries.get(i))
                .map(|(_, (namespace, name))| (namespace.as_str(), name.as_str()))
        })
    }
}

impl<T> Listed<T> {
    fn new(objects: Seq<Arc<T>>) -> Self {
        Self {
            objects,
            journal: Journal::new(),
        }
    }
}

impl<T> Clone for Listed<T> {
    fn clone(&self) -> Self {
        Self {
            objects: self.objects.clone(),
            journal: self.journal.clone(),
        }
    }
}

impl<T> Objects<T> {
    fn listed_mut(&mut self) -> &mut Listed<T> {
        self.0
            .get_or_insert_with(|| Box::new(Listed::new(Seq::new())))
    }

    /// The list, to be changed other than by placing (which begins a new journal).
    fn vector_mut(&mut self) -> &mut Seq<Arc<T>> {
        let listed = self.listed_mut();
        listed.journal = Journal::new();
        &mut listed.objects
    }

    fn vector(&self) -> Option<&Seq<Arc<T>>> {
        self.0.as_ref().map(|listed| &listed.objects)
    }

    pub fn len(&self) -> usize {
        self.vector().map_or(0, |v| v.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn iter(&self) -> ObjectsIter<'_, T> {
        ObjectsIter(self.vector().map(|v| v.iter()))
    }

    pub fn get(&self, index: usize) -> Option<&Arc<T>> {
        self.vector()?.get(index)
    }

    pub fn first(&self) -> Option<&Arc<T>> {
        self.get(0)
    }

    pub fn to_vec(&self) -> Vec<Arc<T>> {
        self.iter().cloned().collect()
    }

    pub fn push(&mut self, object: Arc<T>) {
        self.vector_mut().push_back(object);
    }

    pub fn insert(&mut self, index: usize, object: Arc<T>) {
        self.vector_mut().insert(index, object);
    }

    pub fn remove(&mut self, index: usize) -> Arc<T> {
        self.vector_mut().remove(index)
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&Arc<T>) -> bool) {
        if self.0.is_some() {
            self.vector_mut().retain(|object| keep(object));
        }
    }

    pub fn binary_search_by(
        &self,
        compare: impl FnMut(&Arc<T>) -> std::cmp::Ordering,
    ) -> Result<usize, usize> {
        self.vector()
            .map_or(Err(0), |v| v.binary_search_by(compare))
    }

    /// A cursor for reading positions in order (cheap when each is near the last).
    pub fn cursor(&self) -> ObjectsCursor<'_, T> {
        ObjectsCursor(self.vector().map(|v| v.cursor()))
    }

    /// Whether both are the same shared list (so certainly equal).
    pub fn shares(&self, other: &Self) -> bool {
        match (self.vector(), other.vector()) {
            (Some(a), Some(b)) => a.ptr_eq(b),
            (a, b) => a.is_none() && b.is_none(),
        }
    }

    /// Whether both hold the same objects (shared, not copies) in the same order: the same
    /// shared list, or one made again of the same objects.
    pub fn holds_the_same(&self, other: &Self) -> bool {
        self.shares(other)
            || (self.len() == other.len()
                && self
                    .iter()
                    .zip(other.iter())
                    .all(|(a, b)| Arc::ptr_eq(a, b)))
    }
}

impl<T: kube::Resource> Objects<T> {
    /// The first object named `name` in `namespace` (`None`: none, a cluster-scoped one).
    /// The sources keep each list in that order, so a binary search finds it; in a list in
    /// another order (one assembled by hand) a scan does.
    pub fn find(&self, namespace: Option<&str>, name: &str) -> Option<&Arc<T>> {
        let at = (namespace.unwrap_or(""), name);
        match self.position_in_order(namespace, name) {
            Some(found) => self.get(found),
            None => self.iter().find(|object| order_key(&***object) == at),
        }
    }

    /// Where the first object named `name` in `namespace` is, found by binary search in
    /// the sources' order (namespace, then name); `None` also when the list is in another
    /// order and the search misses it.
    pub fn position_in_order(&self, namespace: Option<&str>, name: &str) -> Option<usize> {
        let at = (namespace.unwrap_or(""), name);
        let mut found = self
            .binary_search_by(|object| order_key(&**object).cmp(&at))
            .ok()?;
        while found > 0 && self.get(found - 1).is_some_and(|o| order_key(&**o) == at) {
            found -= 1;
        }
        Some(found)
    }
}

impl<T: kube::Resource> Objects<T> {
    /// Puts `new` in place of the object keyed `at` (namespace, empty for none, and name) in
    /// a list in key order (`None`: removes it), and notes the key in the list's journal.
    pub fn place(&mut self, at: (&str, &str), new: Option<&Arc<T>>) {
        let found = self.binary_search_by(|object| order_key(&**object).cmp(&at));
        let listed = self.listed_mut();
        match (found, new) {
            (Ok(index), Some(object)) => {
                if let Some(slot) = listed.objects.get_mut(index) {
                    *slot = Arc::clone(object);
                }
            }
            (Ok(index), None) => {
                listed.objects.remove(index);
            }
            (Err(index), Some(object)) => listed.objects.insert(index, Arc::clone(object)),
            (Err(_), None) => return,
        }
        listed.journal.note(at);
    }

    /// The keys placed in this list since `old`, an earlier version of it, was taken, when
    /// only placings changed it since (`None`: not known; the lists must be compared). Each
    /// key is the object's namespace (empty for none) and name, and may come more than once.
    pub fn placed_since<'a>(
        &'a self,
        old: &Self,
    ) -> Option<impl Iterator<Item = (&'a str, &'a str)>> {
        let (listed, old) = (self.0.as_ref()?, old.0.as_ref()?);
        listed.journal.since(&old.journal)
    }

    /// The object keyed `at` (namespace, empty for none, and name) of a list in key order,
    /// found by binary search.
    pub fn at_key(&self, (namespace, name): (&str, &str)) -> Option<&Arc<T>> {
        self.get(self.position_in_order(Some(namespace), name)?)
    }

    /// Whether the list is in the API source's order (namespace, then name), as
    /// `ObjectCache` keeps every list; a manifest directory's lists are in its files' order
    /// (there the first object of a file order wins where two claim one thing).
    pub fn is_in_key_order(&self) -> bool {
        let mut pairs = self.iter().zip(self.iter().skip(1));
        pairs.all(|(a, b)| order_key(&**a) <= order_key(&**b))
    }

    /// The objects of `namespace` (`""`: those without one): by binary search when
    /// `in_key_order` (what [`Self::is_in_key_order`] said of this list), else by a look at
    /// every object.
    pub fn of_namespace(&self, namespace: &str, in_key_order: bool) -> Vec<Arc<T>> {
        if in_key_order {
            return self.in_namespace(namespace);
        }
        self.iter()
            .filter(|object| order_key(&***object).0 == namespace)
            .cloned()
            .collect()
    }

    /// The objects of `namespace` (`""`: those without one), in name order, found by binary
    /// search: the list must be in key order ([`Self::is_in_key_order`]).
    pub fn in_namespace(&self, namespace: &str) -> Vec<Arc<T>> {
        let boundary = |inclusive: bool| {
            self.binary_search_by(|object| {
                let at = order_key(&**object).0;
                if at < namespace || (inclusive && at == namespace) {
                    std::cmp::Ordering::Less
                } else {
                    std::cmp::Ordering::Greater
                }
            })
            .unwrap_or_else(|index| index)
        };
        let mut cursor = self.cursor();
        (boundary(false)..boundary(true))
            .filter_map(|index| cursor.get(index).cloned())
            .collect()
    }
}

/// The key the sources keep each list in order of: namespace (empty for none), then name.
fn order_key<T: kube::Resource>(object: &T) -> (&str, &str) {
    let meta = object.meta();
    (
        meta.namespace.as_deref().unwrap_or(""),
        meta.name.as_deref().unwrap_or(""),
    )
}

/// Reads an [`Objects`] by position, keeping the last chunk at hand.
pub struct ObjectsCursor<'a, T>(Option<seq::Cursor<'a, Arc<T>>>);

impl<'a, T> ObjectsCursor<'a, T> {
    pub fn get(&mut self, index: usize) -> Option<&'a Arc<T>> {
        self.0.as_mut()?.get(index)
    }

    /// How many objects from position `i` here and `j` in `other` are the same objects. Read
    /// a chunk at a time: where both positions fall at one place of one shared chunk (two
    /// versions of a list share every chunk a change did not copy), the rest of the chunk
    /// is skipped at once, so that walking two versions of 150,000 pods costs a few thousand
    /// steps rather than 150,000.
    pub fn shared_run(&mut self, i: usize, other: &mut Self, j: usize) -> usize {
        let (Some(a), Some(b)) = (self.0.as_mut(), other.0.as_mut()) else {
            return 0;
        };
        seq::shared_run(a, i, b, j)
    }
}

/// The objects of an [`Objects`], in order.
pub struct ObjectsIter<'a, T>(Option<seq::Iter<'a, Arc<T>>>);

impl<'a, T> Iterator for ObjectsIter<'a, T> {
    type Item = &'a Arc<T>;

    fn next(&mut self) -> Option<Self::Item> {
        self.0.as_mut()?.next()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.0.as_ref().map_or((0, Some(0)), |i| i.size_hint())
    }
}

impl<T> DoubleEndedIterator for ObjectsIter<'_, T> {
    fn next_back(&mut self) -> Option<Self::Item> {
        self.0.as_mut()?.next_back()
    }
}

impl<T> ExactSizeIterator for ObjectsIter<'_, T> {}

impl<T> std::ops::Index<usize> for Objects<T> {
    type Output = Arc<T>;

    fn index(&self, index: usize) -> &Arc<T> {
        self.get(index).expect("index within the objects")
    }
}

impl<T> std::ops::IndexMut<usize> for Objects<T> {
    fn index_mut(&mut self, index: usize) -> &mut Arc<T> {
        self.vector_mut()
            .get_mut(index)
            .expect("index within the objects")
    }
}

impl<T> Clone for Objects<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T> Default for Objects<T> {
    fn default() -> Self {
        Self(None)
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Objects<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: PartialEq> PartialEq for Objects<T> {
    fn eq(&self, other: &Self) -> bool {
        self.shares(other) || (self.len() == other.len() && self.iter().eq(other.iter()))
    }
}

impl<T> From<Vec<Arc<T>>> for Objects<T> {
    fn from(list: Vec<Arc<T>>) -> Self {
        list.into_iter().collect()
    }
}

impl<T> FromIterator<Arc<T>> for Objects<T> {
    fn from_iter<I: IntoIterator<Item = Arc<T>>>(iter: I) -> Self {
        let vector: Seq<Arc<T>> = iter.into_iter().collect();
        Self((!vector.is_empty()).then(|| Box::new(Listed::new(vector))))
    }
}

impl<T> Objects<T> {
    /// Puts `other`'s objects after these, sharing its chunks ([`Seq::append`]).
    pub fn append(&mut self, other: &Self) {
        if let Some(objects) = other.vector().filter(|objects| !objects.is_empty()) {
            self.vector_mut().append(objects);
        }
    }
}

impl<T> Extend<Arc<T>> for Objects<T> {
    fn extend<I: IntoIterator<Item = Arc<T>>>(&mut self, iter: I) {
        let mut iter = iter.into_iter().peekable();
        if iter.peek().is_some() {
            self.vector_mut().extend(iter);
        }
    }
}

impl<'a, T> IntoIterator for &'a Objects<T> {
    type Item = &'a Arc<T>;
    type IntoIter = ObjectsIter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("reading manifests from {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("following {path} with inotify")]
    Watch {
        path: String,
        #[source]
        source: notify::Error,
    },
}

/// When a source first saw a change that no sync has taken yet: the start of the sync lag
/// (from the change to the maps holding it). Shared between the source's event handlers and
/// the agent.
#[derive(Clone, Debug, Default)]
pub struct FirstChange(Arc<std::sync::Mutex<Option<std::time::Instant>>>);

impl FirstChange {
    /// Notes a change now, unless an earlier one is still pending.
    pub fn note(&self) {
        if let Ok(mut first) = self.0.lock() {
            first.get_or_insert_with(std::time::Instant::now);
        }
    }

    /// The pending change's time, which is then no longer pending.
    pub fn take(&self) -> Option<std::time::Instant> {
        self.0.lock().ok().and_then(|mut first| first.take())
    }
}

/// A manifest directory (and its subdirectories: the other nodes' pod status records)
/// followed by its inotify events: a change wakes the agent at once instead of at its next
/// look. Reads (which the agent's own syncs cause) are not changes; its own writes are, and
/// the caller tells them apart by what the files say.
pub struct ManifestWatch {
    _watcher: notify::RecommendedWatcher,
    events: Arc<AtomicU64>,
    wake: Arc<tokio::sync::Notify>,
    first: FirstChange,
    named: Arc<std::sync::Mutex<Named>>,
}

/// The paths inotify named since they were last taken, or that it may have missed some.
#[derive(Debug, Default)]
struct Named {
    paths: BTreeSet<PathBuf>,
    /// An error or an event without paths (an overflowed queue): the directory must be read
    /// whole.
    unknown: bool,
}

impl ManifestWatch {
    /// Starts following `dir`.
    pub fn start(dir: &Path) -> Result<Self, SourceError> {
        use notify::Watcher as _;
        let events = Arc::new(AtomicU64::new(0));
        let wake = Arc::new(tokio::sync::Notify::new());
        let first = FirstChange::default();
        let named = Arc::new(std::sync::Mutex::new(Named::default()));
        let (counted, woken, noted) = (Arc::clone(&events), Arc::clone(&wake), first.clone());
        let naming = Arc::clone(&named);
        let watch_err = |source| SourceError::Watch {
            path: dir.display().to_string(),
            source,
        };
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                // An error (an overflowed event queue, say) may hide a change: look again.
                if event
                    .as_ref()
                    .is_ok_and(|e| matches!(e.kind, notify::EventKind::Access(_)))
                {
                    return;
                }
                if let Ok(mut named) = naming.lock() {
                    match &event {
                        Ok(event) if !event.paths.is_empty() && !event.need_rescan() => {
                            named.paths.extend(event.paths.iter().cloned());
                        }
                        _ => named.unknown = true,
                    }
                }
                counted.fetch_add(1, Ordering::Relaxed);
                noted.note();
                // A permit is kept when nobody waits, so no change is lost.
                woken.notify_one();
            })
            .map_err(watch_err)?;
        watcher
            .watch(dir, notify::RecursiveMode::Recursive)
            .map_err(watch_err)?;
        Ok(Self {
            _watcher: watcher,
            events,
            wake,
            first,
            named,
        })
    }

    /// The paths changed since the last call (files written, created, removed or renamed),
    /// or `None` when the events may not have named every change: read the directory whole.
    pub fn take_named(&self) -> Option<BTreeSet<PathBuf>> {
        let mut named = self.named.lock().ok()?;
        let Named { paths, unknown } = std::mem::take(&mut *named);
        (!unknown).then_some(paths)
    }

    /// When the first change no sync has taken yet came (taken: the next one starts anew).
    pub fn take_first_change(&self) -> Option<std::time::Instant> {
        self.first.take()
    }

    /// Returns at the next change (or at once if one came since the last wait).
    pub async fn wait_changed(&self) {
        self.wake.notified().await;
    }

    /// Changes seen since the start.
    pub fn events(&self) -> u64 {
        self.events.load(Ordering::Relaxed)
    }
}

/// Reads every `*.yaml` / `*.yml` file of `dir` (sorted by name; multi-document files allowed).
pub fn read_dir(dir: &Path) -> Result<ClusterState, SourceError> {
    ManifestCache::default().read_dir(dir)
}

/// Each manifest file as last parsed, by a hash of its text, so that reading the directory
/// again parses only the files whose text changed (reading and hashing is cheap; parsing
/// is most of a read's cost; a modification time can miss a quick rewrite of the same size),
/// and in a changed file only the documents whose text changed: one EndpointSlice changed in
/// a file of a namespace's 100 Services and their slices parsed 200 documents (5 ms).
#[derive(Debug, Default)]
pub struct ManifestCache {
    files: BTreeMap<PathBuf, ParsedFile>,
    /// The directory was listed once (later reads may take inotify's word for what changed).
    listed: bool,
}

#[derive(Debug)]
struct ParsedFile {
    text_hash: u64,
    /// Each document as parsed, in the file's order.
    documents: Vec<ParsedDocument>,
    state: ClusterState,
}

#[derive(Debug)]
struct ParsedDocument {
    text_hash: u64,
    /// The document's first line in its file (0-based): a document that did not parse is
    /// named by the line and column of the fault, counted from the file's start.
    first_line: usize,
    state: ClusterState,
}

impl ManifestCache {
    /// Reads `dir` as [`read_dir`] does, parsing again only the files whose text changed
    /// since the last read, and in those only the documents whose text changed.
    pub fn read_dir(&mut self, dir: &Path) -> Result<ClusterState, SourceError> {
        let read_err = |source| SourceError::Read {
            path: dir.display().to_string(),
            source,
        };
        let files: BTreeSet<PathBuf> = fs::read_dir(dir)
            .map_err(read_err)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|path| is_manifest(path))
            .collect();
        self.files.retain(|path, _| files.contains(path));
        for file in files {
            self.refresh(&file)?;
        }
        self.listed = true;
        Ok(self.assemble())
    }

    /// Reads `dir` again where only the files `named` may have changed (inotify named every
    /// change since the last read): a change reads, hashes and parses its own file, not the
    /// directory's hundred. The first read lists the directory.
    pub fn read_named(
        &mut self,
        dir: &Path,
        named: &BTreeSet<PathBuf>,
    ) -> Result<ClusterState, SourceError> {
        if !self.listed {
            return self.read_dir(dir);
        }
        for path in named {
            if path.parent() == Some(dir) && is_manifest(path) {
                self.refresh(path)?;
            }
        }
        Ok(self.assemble())
    }

    /// Reads `file` again, parsing what changed in it (gone: forgotten).
    fn refresh(&mut self, file: &Path) -> Result<(), SourceError> {
        let text = match fs::read_to_string(file) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.files.remove(file);
                return Ok(());
            }
            Err(source) => {
                return Err(SourceError::Read {
                    path: file.display().to_string(),
                    source,
                });
            }
        };
        let text_hash = text_hash(&text);
        let parsed = match self.files.remove(file) {
            Some(old) if old.text_hash == text_hash => old,
            old => parse_file(&file.display().to_string(), &text, text_hash, old),
        };
        self.files.insert(file.to_path_buf(), parsed);
        Ok(())
    }

    /// The objects of every file, in the files' order (by name).
    fn assemble(&self) -> ClusterState {
        let mut state = ClusterState::default();
        for parsed in self.files.values() {
            state.absorb(&parsed.state);
        }
        state
    }
}

/// A manifest's name: `*.yaml` or `*.yml`.
fn is_manifest(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "yaml" || e == "yml")
}

fn text_hash(text: &str) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(text, &mut hasher);
    std::hash::Hasher::finish(&hasher)
}

/// Parses a manifest file's `text` (whose hash is `text_hash`) document by document, taking
/// each document whose text `old`, the file's last parse, had unchanged from it.
fn parse_file(file: &str, text: &str, text_hash: u64, old: Option<ParsedFile>) -> ParsedFile {
    let mut reusable: HashMap<u64, ParsedDocument> = old
        .into_iter()
        .flat_map(|old| old.documents)
        .map(|document| (document.text_hash, document))
        .collect();
    let mut state = ClusterState::default();
    let mut documents = Vec::new();
    for (first_line, document) in split_documents(text) {
        let document_hash = self::text_hash(document);
        let parsed = match reusable.remove(&document_hash) {
            // A fault's line is the file's: a faulty document that moved is parsed again.
            Some(old) if old.state.rejected.is_empty() || old.first_line == first_line => {
                ParsedDocument { first_line, ..old }
            }
            _ => ParsedDocument {
                text_hash: document_hash,
                first_line,
                state: parse_document(file, document, first_line),
            },
        };
        state.absorb(&parsed.state);
        documents.push(parsed);
    }
    ParsedFile {
        text_hash,
        documents,
        state,
    }
}

/// The objects of one document of a file (or of several, where the file could not be split),
/// whose first line is the file's line `first_line`.
fn parse_document(file: &str, document: &str, first_line: usize) -> ClusterState {
    let mut state = ClusterState::default();
    add_documents(&mut state, file, document);
    if !state.rejected.is_empty() && first_line > 0 {
        // Parsed again behind as many empty lines, so that a fault is named by the file's
        // line (rare: only documents with a fault pay for it).
        state = ClusterState::default();
        add_documents(&mut state, file, &("\n".repeat(first_line) + document));
    }
    state
}

/// The documents of a manifest's text, each with its first line (0-based), split before each
/// line that starts a document (`---` alone or followed by a blank): such a line starts one
/// wherever it is, even inside a block scalar, so each part parses as it would in the whole.
/// A text with directives (`%YAML`, whose document follows the next marker) is one part.
fn split_documents(text: &str) -> Vec<(usize, &str)> {
    let starts_document = |line: &str| {
        line.strip_prefix("---")
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\r']))
    };
    if text.lines().any(|line| line.starts_with('%')) {
        return vec![(0, text)];
    }
    let mut parts = Vec::new();
    let (mut start, mut start_line, mut offset) = (0, 0, 0);
    for (number, line) in text.split_inclusive('\n').enumerate() {
        if number > 0 && starts_document(line.trim_end_matches('\n')) {
            parts.push((start_line, &text[start..offset]));
            (start, start_line) = (offset, number);
        }
        offset += line.len();
    }
    parts.push((start_line, &text[start..]));
    parts
}

/// A watched resource's name (its plural), and an object's namespace and name.
pub type ObjectKey = (&'static str, String, String);

/// Each object of an API source as last parsed, with the version it was parsed at, and the
/// cluster state they make together, patched object by object: a change parses and places only
/// its own object (at 183,000 objects, assembling the state anew took each sync 40 ms).
#[derive(Debug, Default)]
pub struct ObjectCache {
    /// In key order, as [`Self::assemble`] takes them. A Pod, most of a cluster's objects, is
    /// kept as the object alone (a whole state per Pod cost 60 MiB at 150,000 pods).
    objects: BTreeMap<ObjectKey, (Option<String>, Parsed)>,
    /// Every object held, each list in key order (namespace, name), as [`Self::assemble`]
    /// gives it.
    assembled: ClusterState,
    /// Whether `assembled` follows the objects. Not after [`Self::clear`] (nor at first): a
    /// whole list of puts would place each object in the middle of its list, moving the rest
    /// (at 150,000 pods, seconds); the next assemble makes it anew, and from then on each
    /// change is placed.
    placed: bool,
    /// The rejection lines of the objects that have some.
    rejected: BTreeMap<ObjectKey, Vec<String>>,
}

impl ObjectCache {
    /// The object `key` at `version`: parsed by `parse` unless it was parsed at that version
    /// (an object without a version is parsed every time).
    pub fn put(
        &mut self,
        key: ObjectKey,
        version: Option<String>,
        parse: impl FnOnce() -> ClusterState,
    ) {
        if !self.holds(&key, version.as_deref()) {
            let parsed = parse();
            if self.placed {
                self.place(&key, Some(&parsed));
            }
            self.objects.insert(key, (version, Parsed::from(parsed)));
        }
    }

    /// Puts `parsed`, the object `key` at `version`, whatever the cache held.
    fn put_parsed(&mut self, key: ObjectKey, version: Option<String>, parsed: Parsed) {
        if self.placed {
            self.place(&key, Some(&parsed.state()));
        }
        self.objects.insert(key, (version, parsed));
    }

    /// A list's objects, parsed: put as [`Self::put`] puts each, but while the state is
    /// not yet assembled (the first lists), merged in at once: 177,000 objects put one by
    /// one searched the tree for each twice.
    pub fn put_listed(&mut self, objects: Vec<(ObjectKey, Option<String>, Parsed)>) {
        if self.placed {
            for (key, version, parsed) in objects {
                if !self.holds(&key, version.as_deref()) {
                    self.put_parsed(key, version, parsed);
                }
            }
            return;
        }
        // Collecting sorts (stably: of two puts of one key, the later stays) and builds the
        // tree in one pass; appending merges two sorted trees the same way.
        let mut listed: BTreeMap<_, _> = objects
            .into_iter()
            .map(|(key, version, parsed)| (key, (version, parsed)))
            .collect();
        self.objects.append(&mut listed);
    }

    /// Whether the object `key` is held as parsed at `version` (an object without a version
    /// never is).
    pub fn holds(&self, key: &ObjectKey, version: Option<&str>) -> bool {
        version.is_some()
            && self
                .objects
                .get(key)
                .is_some_and(|(v, _)| v.as_deref() == version)
    }

    /// Forgets the object `key` (deleted).
    pub fn remove(&mut self, key: &ObjectKey) {
        if self.placed && self.objects.contains_key(key) {
            self.place(key, None);
        }
        self.objects.remove(key);
    }

    /// Forgets every object `keep` does not want (deleted ones).
    pub fn retain(&mut self, keep: impl Fn(&ObjectKey) -> bool) {
        let gone: Vec<ObjectKey> = self.objects.keys().filter(|k| !keep(k)).cloned().collect();
        for key in &gone {
            self.remove(key);
        }
    }

    /// Forgets everything: the next puts parse anew.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Has the next [`Self::assemble`] build the state anew from every object's parse (a
    /// full recompute) instead of returning the one patched change by change.
    pub fn reassemble(&mut self) {
        self.placed = false;
    }

    /// The cluster state of every object held.
    pub fn assemble(&mut self) -> ClusterState {
        if !self.placed {
            let mut state = ClusterState::default();
            self.rejected.clear();
            for (key, (_, parsed)) in &self.objects {
                let parsed = parsed.state();
                state.absorb(&parsed);
                if !parsed.rejected.is_empty() {
                    self.rejected.insert(key.clone(), parsed.rejected.clone());
                }
            }
            self.assembled = state;
            self.placed = true;
        }
        self.assembled.clone()
    }

    /// Puts the objects of `key`'s new parse (`None`: removed) into the assembled state in
    /// place of its last one's.
    fn place(&mut self, key: &ObjectKey, new: Option<&ClusterState>) {
        let empty = ClusterState::default();
        let old = self
            .objects
            .get(key)
            .map_or(Cow::Borrowed(&empty), |(_, parsed)| parsed.state());
        let new = new.unwrap_or(&empty);
        let at = (key.1.as_str(), key.2.as_str());
        let state = &mut self.assembled;
        macro_rules! place_in {
            ($($list:ident),*) => {$(
                // Only the list the object's kind goes to: another kind's object may have the
                // same namespace and name (a Node and a Namespace both called `worker-1`).
                if !old.$list.is_empty() || !new.$list.is_empty() {
                    // One object at most: one API object's parse.
                    state.$list.place(at, new.$list.first());
                }
            )*};
        }
        place_in!(
            nodes,
            namespaces,
            pods,
            services,
            endpoint_slices,
            network_policies,
            egress_firewalls,
            egress_ips,
            admin_network_policies,
            baseline_admin_network_policies,
            cluster_network_policies
        );
        let settings_changed = old.network.is_some() || new.network.is_some();
        if !old.rejected.is_empty() || !new.rejected.is_empty() {
            if new.rejected.is_empty() {
                self.rejected.remove(key);
            } else {
                self.rejected.insert(key.clone(), new.rejected.clone());
            }
            self.assembled.rejected = self.rejected.values().flatten().cloned().collect();
        }
        if settings_changed {
            self.take_settings(key, new);
        }
    }

    /// The `Network` settings after `key` became `new`: those of the last object in key
    /// order that has a `Network` (as assembling every object in order gives them), or none.
    fn take_settings(&mut self, key: &ObjectKey, new: &ClusterState) {
        let mut holders: Vec<(&ObjectKey, &ClusterState)> = self
            .objects
            .iter()
            .filter_map(|(k, (_, parsed))| match parsed {
                Parsed::State(state) if k != key && state.network.is_some() => Some((k, &**state)),
                _ => None,
            })
            .collect();
        holders.push((key, new));
        holders.sort_by(|a, b| a.0.cmp(b.0));
        let mut settings = ClusterState::default();
        for (_, parsed) in holders {
            settings.absorb_settings(parsed);
        }
        self.assembled.copy_settings(&settings);
    }
}

/// One API object's parse as [`ObjectCache`] keeps it: a Pod alone, anything else (another
/// kind, a rejection, the `Network`'s settings) as the state it made. Made from the parse's
/// state (`Parsed::from`) where the object was parsed, which may be another thread.
#[derive(Debug)]
pub enum Parsed {
    Pod(Arc<Pod>),
    State(Box<ClusterState>),
}

impl From<ClusterState> for Parsed {
    fn from(state: ClusterState) -> Self {
        let lone_pod = state.pods.len() == 1
            && state.object_count() == 1
            && state.network.is_none()
            && state.rejected.is_empty();
        match state.pods.first() {
            Some(pod) if lone_pod => Parsed::Pod(Arc::clone(pod)),
            _ => Parsed::State(Box::new(state)),
        }
    }
}

impl Parsed {
    /// The state the object made.
    fn state(&self) -> Cow<'_, ClusterState> {
        match self {
            Parsed::Pod(pod) => {
                let mut state = ClusterState::default();
                state.pods.push(Arc::clone(pod));
                Cow::Owned(state)
            }
            Parsed::State(state) => Cow::Borrowed(state),
        }
    }
}

impl ClusterState {
    /// How many objects of every kind it holds.
    fn object_count(&self) -> usize {
        self.nodes.len()
            + self.namespaces.len()
            + self.pods.len()
            + self.services.len()
            + self.endpoint_slices.len()
            + self.network_policies.len()
            + self.egress_firewalls.len()
            + self.egress_ips.len()
            + self.admin_network_policies.len()
            + self.baseline_admin_network_policies.len()
            + self.cluster_network_policies.len()
    }

    /// The cluster-wide admin policies, as access control takes them.
    pub fn admin_objects(&self) -> AdminObjects {
        AdminObjects {
            admin: self.admin_network_policies.to_vec(),
            baseline: self.baseline_admin_network_policies.to_vec(),
            cluster: self.cluster_network_policies.to_vec(),
        }
    }

    /// Adds what `later` holds, as if its documents came after this state's: objects are
    /// appended, and a `Network` in it replaces this one's settings.
    pub fn absorb(&mut self, later: &ClusterState) {
        self.nodes.append(&later.nodes);
        self.namespaces.append(&later.namespaces);
        self.pods.append(&later.pods);
        self.services.append(&later.services);
        self.endpoint_slices.append(&later.endpoint_slices);
        self.network_policies.append(&later.network_policies);
        self.egress_firewalls.append(&later.egress_firewalls);
        self.egress_ips.append(&later.egress_ips);
        self.admin_network_policies
            .append(&later.admin_network_policies);
        self.baseline_admin_network_policies
            .append(&later.baseline_admin_network_policies);
        self.cluster_network_policies
            .append(&later.cluster_network_policies);
        self.absorb_settings(later);
        self.rejected.extend(later.rejected.iter().cloned());
    }

    /// Takes `later`'s `Network` settings if it has a `Network`.
    fn absorb_settings(&mut self, later: &ClusterState) {
        if later.network.is_some() {
            self.copy_settings(later);
        }
    }

    /// Takes `other`'s `Network` settings, none included.
    fn copy_settings(&mut self, other: &ClusterState) {
        self.network = other.network;
        self.cluster_networks = other.cluster_networks.clone();
        self.service_networks = other.service_networks.clone();
        self.policy_audit = other.policy_audit.clone();
        self.egress_ip_config = other.egress_ip_config;
        self.hybrid = other.hybrid;
    }
}

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
    fn decode(document: impl Document) -> Result<Self, String> {
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

/// An object before its kind is known: a manifest's YAML document, or a watched object's JSON
/// (decoded straight into its type: through a YAML value it cost the API source most of a
/// large cluster's first sync).
pub trait Document: Sized {
    /// The string at `path` (`["metadata", "name"]`), if there is one.
    fn text(&self, path: &[&str]) -> Option<&str>;
    /// The object as `T`, or why not (naming the field where the format can).
    fn decode<T: serde::de::DeserializeOwned>(self) -> Result<T, String>;
}

impl Document for serde_yaml::Value {
    fn text(&self, path: &[&str]) -> Option<&str> {
        path.iter()
            .try_fold(self, |value, key| value.get(key))?
            .as_str()
    }

    fn decode<T: serde::de::DeserializeOwned>(self) -> Result<T, String> {
        serde_yaml::from_value(self).map_err(|e| e.to_string())
    }
}

impl Document for serde_json::Value {
    fn text(&self, path: &[&str]) -> Option<&str> {
        path.iter()
            .try_fold(self, |value, key| value.get(key))?
            .as_str()
    }

    fn decode<T: serde::de::DeserializeOwned>(self) -> Result<T, String> {
        serde_json::from_value(self).map_err(|e| e.to_string())
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
        tracing::warn!(file, kind, name, error, "manifest object rejected");
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
        ("operator.openshift.io/v1", "Network") => match value.decode::<NetworkOperator>() {
            Ok(network) if network.is_the_cluster_network() => match network.validate() {
                Ok(network) => {
                    state.hybrid = network.hybrid;
                    state.policy_audit = network.policy_audit;
                    state.egress_ip_config = network.egress_ip;
                    state.network = Some(network.overlay);
                    state.cluster_networks = network.cluster_networks;
                    state.service_networks = network.service_networks;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The object fuzzer's find: an alias to no anchor inside a flow mapping made serde_yaml
    /// panic ("unexpected end of mapping"), which would have stopped the agent. Refused, named
    /// by file, the documents before it kept.
    #[test]
    fn a_manifest_that_makes_the_yaml_parser_panic_is_refused_not_fatal() {
        let mut state = ClusterState::default();
        add_documents(
            &mut state,
            "nodes.yaml",
            "apiVersion: v1\nkind: Node\nmetadata: {name: a}\n---\n\
             metadata: {name: b, labels: {kubernetes.io/os: *inux}}\n",
        );
        assert_eq!(state.nodes.len(), 1);
        assert!(
            state
                .rejected
                .iter()
                .any(|r| r.starts_with("nodes.yaml: not YAML")),
            "{:?}",
            state.rejected
        );
    }

    /// One object's parse, as the API source makes it: key and state.
    fn parsed(
        plural: &'static str,
        namespace: &str,
        name: &str,
        variant: u32,
    ) -> (ObjectKey, ClusterState) {
        let yaml = match plural {
            "nodes" => format!(
                "apiVersion: v1\nkind: Node\nmetadata: {{name: {name}, labels: {{v: \"{variant}\"}}}}\n"
            ),
            "namespaces" => format!(
                "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}, labels: {{v: \"{variant}\"}}}}\n"
            ),
            // Variant 3 is not a Pod the agent takes (a rejected object).
            "pods" if variant == 3 => format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {namespace}}}\nspec: 7\n"
            ),
            "pods" => format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {namespace}, labels: {{v: \"{variant}\"}}}}\nspec: {{containers: []}}\n"
            ),
            _ => format!(
                "apiVersion: operator.openshift.io/v1\nkind: Network\nmetadata: {{name: {name}}}\nspec: {{clusterNetwork: [{{cidr: 10.{variant}.0.0/16}}], serviceNetwork: [10.96.0.0/16]}}\n"
            ),
        };
        let mut state = ClusterState::default();
        add_documents(&mut state, &format!("api:{plural}"), &yaml);
        ((plural, namespace.to_owned(), name.to_owned()), state)
    }

    /// Objects put, changed, rejected and removed one at a time: the state patched in place is
    /// always the one every object assembled in key order makes (a Node and a Namespace of the
    /// same name stay apart; the `Network` settings follow their objects).
    #[test]
    fn the_state_patched_object_by_object_equals_the_state_assembled_anew() {
        let mut cache = ObjectCache::default();
        let mut model: BTreeMap<ObjectKey, ClusterState> = BTreeMap::new();
        let (mut seen_settings, mut seen_rejected, mut seen_both) = (false, false, false);
        let (mut history, mut journalled) = (Vec::<ClusterState>::new(), 0);
        let mut rng = crate::test_rng::TestRng::new(7);
        let mut next = |bound: u64| rng.below(bound);
        for step in 0..600 {
            let (plural, namespace) = match next(4) {
                0 => ("nodes", ""),
                1 => ("namespaces", ""),
                2 => ("pods", ["a", "b", "c"][next(3) as usize]),
                _ => ("networks", ""),
            };
            let name = match (plural, next(6)) {
                // Only the Network named `cluster` has settings.
                ("networks", 0..=2) => "cluster".to_owned(),
                (_, n) => format!("n{n}"),
            };
            let (key, state) = parsed(plural, namespace, &name, next(4) as u32);
            if next(4) == 0 {
                cache.remove(&key);
                model.remove(&key);
            } else {
                cache.put(key.clone(), Some(step.to_string()), || state.clone());
                model.insert(key, state);
            }
            if step == 150 {
                // A fresh read puts every object again, in no order: made anew, then patched.
                cache.clear();
                for (key, parsed) in model.iter().rev() {
                    cache.put(key.clone(), None, || parsed.clone());
                }
            }
            if step == 300 || step == 450 {
                // A whole list at once: merged into a cache not yet assembled (after a
                // clear), put object by object into an assembled one.
                if step == 300 {
                    cache.clear();
                }
                let listed = model.iter().rev();
                cache.put_listed(
                    listed
                        .map(|(k, p)| (k.clone(), None, p.clone().into()))
                        .collect(),
                );
            }
            let mut anew = ClusterState::default();
            for parsed in model.values() {
                anew.absorb(parsed);
            }
            let now = cache.assemble();
            assert_eq!(now, anew, "after step {step}");
            // What changed since the last sync and since one five syncs ago, found by the
            // lists' journals where they tell it, is what walking the lists finds.
            for earlier in [history.last(), history.iter().rev().nth(4)]
                .into_iter()
                .flatten()
            {
                journalled += usize::from(now.pods.placed_since(&earlier.pods).is_some());
                assert_eq!(
                    crate::changes::Changes::between(earlier, &now),
                    crate::changes::Changes::between(earlier, &anew),
                    "after step {step}"
                );
            }
            history.push(now);
            seen_settings |= anew.network.is_some();
            seen_rejected |= !anew.rejected.is_empty();
            seen_both |= anew.nodes.len() + anew.namespaces.len() > 6;
        }
        assert!(
            seen_settings && seen_rejected && seen_both && journalled > 900,
            "every case met ({journalled} comparisons by journal)"
        );
    }

    /// Reading a directory again parses only the changed files and gives what a fresh read
    /// gives; a file removed takes its objects with it.
    #[test]
    fn a_cached_read_equals_a_fresh_read_after_files_change() {
        let dir = std::env::temp_dir().join(format!("dataplane-cache-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("dir");
        fs::write(dir.join("a.yaml"), MANIFESTS).expect("write");
        let network = "apiVersion: operator.openshift.io/v1\nkind: Network\nmetadata: {name: cluster}\nspec: {clusterNetwork: [{cidr: 10.244.0.0/16}], serviceNetwork: [10.97.0.0/16]}\n";
        fs::write(dir.join("b.yaml"), network).expect("write");
        let mut cache = ManifestCache::default();
        assert_eq!(
            cache.read_dir(&dir).expect("read"),
            read_dir(&dir).expect("read")
        );
        // Same size, written at once: the text is what tells.
        fs::write(
            dir.join("a.yaml"),
            MANIFESTS.replace("name: web", "name: wab"),
        )
        .expect("write");
        let cached = cache.read_dir(&dir).expect("read");
        assert_eq!(cached, read_dir(&dir).expect("read"));
        assert!(
            cached
                .pods
                .iter()
                .any(|p| p.metadata.name.as_deref() == Some("wab"))
        );
        fs::remove_file(dir.join("b.yaml")).expect("remove");
        let cached = cache.read_dir(&dir).expect("read");
        // The Network of a.yaml is the one in force again.
        assert_eq!(
            cached.service_networks,
            vec!["10.96.0.0/16".parse::<IpNet>().expect("net")]
        );
        assert_eq!(cached, read_dir(&dir).expect("read"));
        let _ = fs::remove_dir_all(&dir);
    }

    /// Told which files changed (inotify's names), a read looks at those alone: a named
    /// file changed or removed is read as a fresh read would; one not named is taken as it
    /// was. A cache that never listed the directory lists it.
    #[test]
    fn a_read_of_named_files_looks_at_those_alone() {
        let dir = std::env::temp_dir().join(format!("dataplane-named-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("dir");
        let namespace =
            |name: &str| format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}}}\n");
        for file in ["a", "b", "c"] {
            fs::write(dir.join(format!("{file}.yaml")), namespace(file)).expect("write");
        }
        let names = |state: &ClusterState| -> Vec<String> {
            state
                .namespaces
                .iter()
                .filter_map(|n| n.metadata.name.clone())
                .collect()
        };
        let mut cache = ManifestCache::default();
        let first = cache.read_named(&dir, &BTreeSet::new()).expect("read");
        assert_eq!(names(&first), ["a", "b", "c"]);

        fs::write(dir.join("a.yaml"), namespace("a2")).expect("write");
        fs::remove_file(dir.join("b.yaml")).expect("remove");
        fs::write(dir.join("c.yaml"), namespace("c2")).expect("write");
        fs::write(dir.join("notes.txt"), "not a manifest").expect("write");
        let named: BTreeSet<PathBuf> = ["a.yaml", "b.yaml", "notes.txt", "pod-status/x.json"]
            .iter()
            .map(|file| dir.join(file))
            .collect();
        // c.yaml was not named: as it was.
        assert_eq!(
            names(&cache.read_named(&dir, &named).expect("read")),
            ["a2", "c"]
        );
        let named = BTreeSet::from([dir.join("c.yaml")]);
        let read = cache.read_named(&dir, &named).expect("read");
        assert_eq!(read, read_dir(&dir).expect("read"));
        assert_eq!(names(&read), ["a2", "c2"]);
        let _ = fs::remove_dir_all(&dir);
    }

    /// A manifest is cut before each line that starts a document (`---` alone or before a
    /// blank), also inside a block scalar, and not at `---` inside a line or a word; a text
    /// with directives is not cut.
    #[test]
    fn a_manifest_is_split_before_each_line_that_starts_a_document() {
        let text = "---\na: 1\n--- # two\nb: |\n  x\n---\nc: 3 ---\n---x: 4\n---\n";
        assert_eq!(
            split_documents(text),
            vec![
                (0, "---\na: 1\n"),
                (2, "--- # two\nb: |\n  x\n"),
                (5, "---\nc: 3 ---\n---x: 4\n"),
                (8, "---\n"),
            ]
        );
        let directives = "%YAML 1.2\n---\na: 1\n---\nb: 2\n";
        assert_eq!(split_documents(directives), vec![(0, directives)]);
        assert_eq!(split_documents(""), vec![(0, "")]);
    }

    /// Parsed document by document, a file gives what the whole file parsed at once gives:
    /// its objects in order, an invalid object rejected by name, a `Network`'s settings.
    #[test]
    fn a_file_parsed_by_document_gives_what_the_whole_file_gives() {
        let invalid_pod =
            "---\napiVersion: v1\nkind: Pod\nmetadata: {name: bad, namespace: default}\nspec: 7\n";
        let block = "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: team\n  annotations:\n    note: |\n      a --- b\n      ---not a marker\n";
        for text in [
            MANIFESTS.to_owned(),
            format!("{MANIFESTS}{invalid_pod}{block}"),
            format!("{block}{MANIFESTS}"),
        ] {
            let mut whole = ClusterState::default();
            add_documents(&mut whole, "f.yaml", &text);
            assert_eq!(
                parse_file("f.yaml", &text, text_hash(&text), None).state,
                whole,
                "{text}"
            );
        }
    }

    /// A document with a syntax fault is named once, and the read ends (it looped for ever,
    /// the parser's iterator yielding the same error again); split by document, the file's
    /// other documents are kept.
    #[test]
    fn a_syntax_fault_is_named_once_and_the_other_documents_are_kept() {
        let text = "apiVersion: v1\nkind: Namespace\nmetadata: {name: [\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: kept}\n";
        let mut whole = ClusterState::default();
        add_documents(&mut whole, "f.yaml", text);
        assert_eq!(whole.rejected.len(), 1, "{:?}", whole.rejected);
        assert!(whole.rejected[0].starts_with("f.yaml: not YAML: "));
        let parsed = parse_file("f.yaml", text, text_hash(text), None).state;
        assert_eq!(parsed.rejected, whole.rejected);
        let names: Vec<_> = parsed
            .namespaces
            .iter()
            .filter_map(|n| n.metadata.name.clone())
            .collect();
        assert_eq!(names, ["kept"]);
    }

    /// A file changed in one document parses that document alone (the others' objects are
    /// the last parse's, shared); a document that does not parse is named by the file's line
    /// of the fault, also when it was taken from the last parse and moved.
    #[test]
    fn a_changed_document_is_parsed_alone_and_a_fault_is_named_by_the_files_line() {
        let first = parse_file("f.yaml", MANIFESTS, text_hash(MANIFESTS), None);
        let changed = MANIFESTS.replace("name: web", "name: wab");
        let second = parse_file("f.yaml", &changed, text_hash(&changed), Some(first));
        let mut whole = ClusterState::default();
        add_documents(&mut whole, "f.yaml", &changed);
        assert_eq!(second.state, whole);
        let third = parse_file("f.yaml", &changed, text_hash(&changed), None);
        let node =
            |parsed: &ParsedFile| Arc::clone(parsed.state.nodes.iter().next().expect("node"));
        let wub = MANIFESTS.replace("name: web", "name: wub");
        let again = parse_file("f.yaml", &wub, text_hash(&wub), Some(second));
        assert!(Arc::ptr_eq(
            &node(&again),
            &node(&parse_file(
                "f.yaml",
                &changed,
                text_hash(&changed),
                Some(again)
            ))
        ));
        assert!(!Arc::ptr_eq(
            &node(&third),
            &node(&parse_file("f.yaml", &changed, text_hash(&changed), None))
        ));

        let broken = "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: [\n";
        let fault = |text: &str, old: Option<ParsedFile>| {
            let parsed = parse_file("f.yaml", text, text_hash(text), old);
            let rejected = parsed.state.rejected.clone();
            (parsed, rejected)
        };
        let (parsed, rejected) = fault(&format!("{MANIFESTS}{broken}"), None);
        let mut whole = ClusterState::default();
        add_documents(&mut whole, "f.yaml", &format!("{MANIFESTS}{broken}"));
        assert_eq!(rejected, whole.rejected);
        let fault_line = |rejected: &[String]| {
            let fault = rejected
                .iter()
                .find(|r| r.contains("did not find expected node content"));
            fault
                .expect("the syntax fault")
                .split(" at line ")
                .nth(1)
                .map(str::to_owned)
        };
        let line = fault_line(&rejected);
        // Two lines more before it: the same document, named by its new line.
        let moved = format!("# one\n# two\n{MANIFESTS}{broken}");
        let (_, moved_rejected) = fault(&moved, Some(parsed));
        let mut whole = ClusterState::default();
        add_documents(&mut whole, "f.yaml", &moved);
        assert_eq!(moved_rejected, whole.rejected);
        assert_ne!(fault_line(&moved_rejected), line);
    }

    const MANIFESTS: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-a}
spec: {podCIDRs: [10.244.1.0/24]}
status: {addresses: [{type: InternalIP, address: 10.99.0.1}]}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: default}
spec: {nodeName: node-a, containers: [{name: app, image: nginx}]}
status: {podIPs: [{ip: 10.244.1.2}]}
---
apiVersion: operator.openshift.io/v1
kind: Network
metadata: {name: cluster}
spec:
  clusterNetwork: [{cidr: 10.244.0.0/16, hostPrefix: 24}, {cidr: "fd00:10:244::/48", hostPrefix: 64}]
  serviceNetwork: [10.96.0.0/16]
  defaultNetwork:
    type: OVNKubernetes
    ovnKubernetesConfig: {mtu: 1400, genevePort: 6082}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: ignored}
---
apiVersion: v1
kind: Node
metadata: {name: broken}
spec: {podCIDRs: "not-a-list"}
---
apiVersion: k8s.ovn.org/v1
kind: EgressIP
metadata: {name: prod}
spec: {egressIPs: [172.18.0.33], namespaceSelector: {matchLabels: {env: prod}}}
---
apiVersion: k8s.ovn.org/v1
kind: EgressIP
metadata: {name: typo}
spec: {egressIPs: [172.18.0.333], namespaceSelector: {}}
"#;

    /// A copy shares the list until one of them changes; a change leaves the other as it
    /// was; equal lists compare equal whether shared or not; an empty list holds nothing.
    #[test]
    fn objects_are_shared_until_changed() {
        let node = |name: &str| {
            let mut node = Node::default();
            node.metadata.name = Some(name.into());
            Arc::new(node)
        };
        let empty: Objects<Node> = Objects::default();
        assert!(empty.0.is_none() && empty.is_empty() && empty.shares(&Objects::default()));
        let mut list: Objects<Node> = (0..500).map(|i| node(&format!("n{i:03}"))).collect();
        let copy = list.clone();
        assert!(list.shares(&copy) && list == copy);
        list.insert(10, node("n009a"));
        assert!(!list.shares(&copy));
        assert_eq!((list.len(), copy.len()), (501, 500));
        assert_eq!(list[10].metadata.name.as_deref(), Some("n009a"));
        assert_eq!(copy[10].metadata.name.as_deref(), Some("n010"));
        let found = list.binary_search_by(|n| n.metadata.name.as_deref().cmp(&Some("n009a")));
        assert_eq!(found, Ok(10));
        assert_eq!(list.remove(10).metadata.name.as_deref(), Some("n009a"));
        assert!(
            list == copy && !list.shares(&copy),
            "equal, though no longer shared"
        );
        list.retain(|n| n.metadata.name.as_deref() != Some("n499"));
        list.push(node("n500"));
        assert_eq!(
            list.iter().next_back().unwrap().metadata.name.as_deref(),
            Some("n500")
        );
        assert_eq!(list.to_vec().len(), 500);
    }

    fn pod(namespace: Option<&str>, name: &str, uid: &str) -> Arc<Pod> {
        let mut pod = Pod::default();
        pod.metadata.namespace = namespace.map(Into::into);
        pod.metadata.name = Some(name.into());
        pod.metadata.uid = Some(uid.into());
        Arc::new(pod)
    }

    /// An object is found by namespace and name in a list in the sources' order (the first
    /// of equal names), and in a list in another order.
    #[test]
    fn objects_are_found_by_namespace_and_name() {
        let mut sorted = vec![pod(None, "bare", "0")];
        sorted.extend((0..200).map(|i| pod(Some("a"), &format!("p{i:03}"), "1")));
        sorted.push(pod(Some("b"), "x", "first"));
        sorted.push(pod(Some("b"), "x", "second"));
        let sorted: Objects<Pod> = sorted.into();
        let uid = |found: Option<&Arc<Pod>>| found.and_then(|p| p.metadata.uid.clone());
        assert_eq!(uid(sorted.find(Some("b"), "x")).as_deref(), Some("first"));
        assert_eq!(uid(sorted.find(None, "bare")).as_deref(), Some("0"));
        assert!(sorted.find(Some("a"), "p150").is_some());
        assert!(sorted.find(Some("a"), "p999").is_none());
        let mut shuffled = sorted.to_vec();
        shuffled.reverse();
        let shuffled: Objects<Pod> = shuffled.into();
        assert_eq!(uid(shuffled.find(None, "bare")).as_deref(), Some("0"));
        assert!(shuffled.find(Some("a"), "p007").is_some());
    }

    /// A namespace's objects come by binary search from a list in the sources' order, across
    /// the persistent vector's chunks of 64.
    #[test]
    fn a_namespaces_objects_are_found_without_a_look_at_the_others() {
        let mut sorted = vec![pod(None, "bare", "0")];
        sorted.extend((0..200).map(|i| pod(Some("a"), &format!("p{i:03}"), "1")));
        sorted.extend((0..3).map(|i| pod(Some("b"), &format!("q{i}"), "2")));
        sorted.extend((0..100).map(|i| pod(Some("d"), &format!("r{i:03}"), "3")));
        let sorted: Objects<Pod> = sorted.into();
        let names = |namespace: &str| -> Vec<String> {
            sorted
                .in_namespace(namespace)
                .iter()
                .map(|p| p.metadata.name.clone().unwrap_or_default())
                .collect()
        };
        assert_eq!(names(""), ["bare"]);
        assert_eq!(names("b"), ["q0", "q1", "q2"]);
        assert_eq!(names("a").len(), 200);
        assert_eq!(names("a")[0], "p000");
        assert_eq!(names("d").last().map(String::as_str), Some("r099"));
        assert!(names("c").is_empty());
        assert!(names("e").is_empty());
        assert!(Objects::<Pod>::default().in_namespace("a").is_empty());
        assert!(sorted.is_in_key_order());
        assert_eq!(sorted.of_namespace("b", true).len(), 3);
        // Out of order (a manifest directory's files): found by a look at each.
        let mut shuffled = sorted.to_vec();
        shuffled.swap(0, 250);
        let shuffled: Objects<Pod> = shuffled.into();
        assert!(!shuffled.is_in_key_order());
        assert_eq!(shuffled.of_namespace("b", false).len(), 3);
        assert_eq!(shuffled.of_namespace("", false).len(), 1);
        assert_eq!(shuffled.of_namespace("d", false).len(), 100);
    }

    /// A parsed Pod keeps what the stages read (the named ports, node, host network, phase,
    /// addresses, labels and annotations) and drops the rest.
    #[test]
    fn a_parsed_pod_keeps_what_the_stages_read_and_drops_the_rest() {
        let mut state = ClusterState::default();
        add_documents(
            &mut state,
            "pod.yaml",
            r#"
apiVersion: v1
kind: Pod
metadata:
  name: web
  namespace: shop
  labels: {app: web}
  annotations: {k8s.ovn.org/pod-networks: "{}"}
  managedFields: [{manager: kubectl, operation: Apply}]
spec:
  nodeName: node-a
  hostNetwork: false
  serviceAccountName: web
  containers:
  - name: app
    image: app:1
    env: [{name: A, value: b}]
    ports: [{name: http, containerPort: 8080}, {containerPort: 9090}]
  - name: sidecar
    image: proxy:1
    ports: [{containerPort: 15000}]
status:
  phase: Running
  podIP: 10.244.1.2
  podIPs: [{ip: 10.244.1.2}]
  hostIP: 10.99.0.1
  conditions: [{type: Ready, status: "True"}]
"#,
        );
        assert!(state.rejected.is_empty(), "{:?}", state.rejected);
        let pod = &state.pods[0];
        assert_eq!(pod.metadata.labels.as_ref().unwrap()["app"], "web");
        assert!(
            pod.metadata
                .annotations
                .as_ref()
                .unwrap()
                .contains_key("k8s.ovn.org/pod-networks")
        );
        assert_eq!(pod.metadata.managed_fields, None);
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("node-a"));
        assert_eq!(spec.host_network, Some(false));
        assert_eq!(
            spec.containers.len(),
            1,
            "only the container with a named port"
        );
        let app = &spec.containers[0];
        assert_eq!(app.name, "app");
        let ports = app.ports.as_ref().unwrap();
        assert_eq!(ports.len(), 1);
        assert_eq!(
            (ports[0].name.as_deref(), ports[0].container_port),
            (Some("http"), 8080)
        );
        let status = pod.status.as_ref().unwrap();
        assert_eq!(status.phase.as_deref(), Some("Running"));
        assert_eq!(status.pod_ip.as_deref(), Some("10.244.1.2"));
        assert_eq!(status.pod_ips.as_ref().unwrap().len(), 1);
        // What is not read has no field to be kept in (k8s-openapi's Pod is 2,176 bytes).
        assert!(
            std::mem::size_of::<Pod>() < 700,
            "{}",
            std::mem::size_of::<Pod>()
        );
    }

    #[test]
    fn reads_nodes_pods_and_network_and_names_what_it_rejects() {
        let mut state = ClusterState::default();
        add_documents(&mut state, "cluster.yaml", MANIFESTS);
        assert_eq!(state.nodes.len(), 1);
        assert_eq!(state.nodes[0].metadata.name.as_deref(), Some("node-a"));
        assert_eq!(state.pods.len(), 1);
        assert_eq!(
            state.network,
            Some(OvnKubernetesConfig {
                mtu: Some(1400),
                geneve_port: Some(6082)
            })
        );
        let nets = |v: &[&str]| {
            v.iter()
                .map(|c| c.parse::<IpNet>().unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            state.cluster_networks,
            nets(&["10.244.0.0/16", "fd00:10:244::/48"])
        );
        assert_eq!(state.service_networks, nets(&["10.96.0.0/16"]));
        assert_eq!(state.rejected.len(), 2, "{:?}", state.rejected);
        assert!(
            state.rejected[0].starts_with("cluster.yaml: Node broken:"),
            "{:?}",
            state.rejected
        );
        assert_eq!(state.egress_ips.len(), 1);
        assert_eq!(
            state.rejected[1],
            "cluster.yaml: EgressIP typo: spec.egressIPs[0]: \"172.18.0.333\" is not an IP address"
        );
    }

    #[test]
    fn an_out_of_range_geneve_port_is_rejected_naming_the_object() {
        let mut state = ClusterState::default();
        add_documents(
            &mut state,
            "net.yaml",
            "apiVersion: operator.openshift.io/v1\nkind: Network\nmetadata: {name: cluster}\n\
             spec: {defaultNetwork: {ovnKubernetesConfig: {genevePort: 70000}}}\n",
        );
        assert!(state.network.is_none());
        assert!(
            state.rejected[0].starts_with("net.yaml: Network cluster:"),
            "{:?}",
            state.rejected
        );
    }
}

#[cfg(test)]
mod network_tests {
    use super::*;

    #[test]
    fn an_invalid_service_network_rejects_the_network_object() {
        let mut state = ClusterState::default();
        add_documents(
            &mut state,
            "net.yaml",
            "apiVersion: operator.openshift.io/v1\nkind: Network\nmetadata: {name: cluster}\n\
             spec: {serviceNetwork: [10.96.0.0/33]}\n",
        );
        assert!(state.network.is_none() && state.service_networks.is_empty());
        assert_eq!(
            state.rejected,
            vec!["net.yaml: Network cluster: spec.serviceNetwork \"10.96.0.0/33\" is not a CIDR"]
        );
    }
}

#[cfg(test)]
mod watch_tests {
    use super::*;

    #[tokio::test]
    async fn a_written_manifest_wakes_the_watch_and_a_read_does_not() {
        let dir = std::env::temp_dir().join(format!("watch-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("pod-status")).expect("dir");
        fs::write(dir.join("a.yaml"), "kind: Namespace\n").expect("file");
        let watch = ManifestWatch::start(&dir).expect("watch");
        let wait = |what: &'static str| {
            let watch = &watch;
            async move {
                tokio::time::timeout(std::time::Duration::from_secs(5), watch.wait_changed())
                    .await
                    .unwrap_or_else(|_| panic!("{what}: no event"));
            }
        };
        // Reading is no change.
        let _ = read_dir(&dir).expect("read");
        let quiet =
            tokio::time::timeout(std::time::Duration::from_millis(300), watch.wait_changed()).await;
        assert!(quiet.is_err(), "a read woke the watch");
        fs::write(dir.join("b.yaml"), "kind: Namespace\n").expect("new file");
        wait("a new manifest").await;
        // Drain what the write caused (create, modify, close).
        while tokio::time::timeout(std::time::Duration::from_millis(200), watch.wait_changed())
            .await
            .is_ok()
        {}
        fs::write(dir.join("pod-status/node1.json"), "{}").expect("status file");
        wait("a file in a subdirectory").await;
        fs::remove_file(dir.join("a.yaml")).expect("remove");
        wait("a removed manifest").await;
        assert!(watch.events() >= 3);
        // Each changed path was named (the last events may come after the wake a stale
        // permit gave), and taking them starts anew.
        let expected = ["b.yaml", "pod-status/node1.json", "a.yaml"].map(|file| dir.join(file));
        let mut named = BTreeSet::new();
        for _ in 0..50 {
            named.extend(watch.take_named().expect("no event was lost"));
            if expected.iter().all(|path| named.contains(path)) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert!(
            expected.iter().all(|path| named.contains(path)),
            "{named:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let _ = watch.take_named();
        assert_eq!(watch.take_named(), Some(BTreeSet::new()));
        let _ = fs::remove_dir_all(&dir);
    }
}

#[cfg(test)]
mod hybrid_tests {
    use super::*;

    fn network(hybrid: &str) -> ClusterState {
        let mut state = ClusterState::default();
        add_documents(
            &mut state,
            "net.yaml",
            &format!(
                "apiVersion: operator.openshift.io/v1\nkind: Network\nmetadata: {{name: cluster}}\n\
                 spec:\n  clusterNetwork: [{{cidr: 10.128.0.0/14, hostPrefix: 23}}]\n  \
                 serviceNetwork: [172.30.0.0/16]\n  defaultNetwork:\n    ovnKubernetesConfig:\n      \
                 hybridOverlayConfig: {hybrid}\n"
            ),
        );
        state
    }

    #[test]
    fn the_hybrid_overlay_config_is_read_and_an_invalid_one_rejects_the_network_naming_the_field() {
        let state = network(
            "{hybridClusterNetwork: [{cidr: 10.132.0.0/14, hostPrefix: 23}], hybridOverlayVXLANPort: 9898}",
        );
        assert_eq!(state.rejected, Vec::<String>::new());
        assert_eq!(
            state.hybrid,
            Some(HybridSettings {
                network: Some("10.132.0.0/14".parse().unwrap()),
                vxlan_port: 9898
            })
        );
        let state = network("{hybridClusterNetwork: [{cidr: 10.128.0.0/16}]}");
        assert_eq!(state.hybrid, None);
        assert!(state.network.is_none());
        assert_eq!(
            state.rejected,
            vec![
                "net.yaml: Network cluster: hybridOverlayConfig.hybridClusterNetwork[0].cidr: \
                 10.128.0.0/16 overlaps spec.clusterNetwork 10.128.0.0/14"
            ]
        );
        let state = network("{hybridOverlayVXLANPort: 6081}");
        assert_eq!(
            state.rejected,
            vec![
                "net.yaml: Network cluster: hybridOverlayConfig.hybridOverlayVXLANPort: 6081 is \
                 the Geneve port (ovnKubernetesConfig.genevePort); choose another"
            ]
        );
    }
}

#[cfg(test)]
mod readme_tests {
    use super::*;

    /// The README's install guide shows one object of every kind the agent reads: each must
    /// be one the agent takes, unchanged.
    #[test]
    fn the_readmes_example_objects_are_all_accepted() {
        let readme = include_str!("../../README.md");
        let start = readme
            .find("What the agent reads")
            .expect("the install guide's object list");
        let block = &readme[start..];
        let yaml_start = block.find("```yaml\n").expect("a yaml block") + "```yaml\n".len();
        let yaml = &block[yaml_start..];
        let yaml = &yaml[..yaml.find("```").expect("the block's end")];
        let mut state = ClusterState::default();
        add_documents(&mut state, "README.md", yaml);
        assert_eq!(state.rejected, Vec::<String>::new());
        assert!(state.network.is_some());
        assert_eq!(state.cluster_networks.len(), 2);
        let counts = [
            state.nodes.len(),
            state.namespaces.len(),
            state.pods.len(),
            state.services.len(),
            state.endpoint_slices.len(),
            state.network_policies.len(),
            state.egress_firewalls.len(),
            state.egress_ips.len(),
        ];
        assert_eq!(counts, [1; 8]);
    }
}
