//! The API server source: one kube-rs watcher per watched resource, with backoff, applying
//! its events straight to the per-object cache ([`source::ObjectCache`]): each object is
//! parsed once per resource version, through the same per-object parsing and validation the
//! manifest directory uses, so an object that fails it is named and skipped exactly as from a
//! file. A sync reads the cache's assembled [`ClusterState`], patched object by object.
//!
//! No copy of the objects is kept besides what they parse into (no reflector store): at
//! 150,000 pods, a store of their JSON was hundreds of MiB on every node. Objects are watched
//! untyped ([`WatchedObject`]): a typed watcher fails its whole list when one object does not
//! decode, and that one bad object must not stop the others from applying. A lost connection
//! means the watcher backs off and re-lists while the cache (and the maps) keep the last good
//! state; the re-listed objects replace the cache's at once when the list is complete, and a
//! full resync follows.

mod object;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures_util::StreamExt as _;
use kube::{
    Api, Client, Config,
    api::{ApiResource, GroupVersionKind, Patch, PatchParams},
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{WatchStreamExt as _, watcher},
};

use tokio::sync::Notify;

use crate::source::{self, ClusterState, ObjectKey};

pub use object::WatchedObject;

/// How long the controller waits for one API call (a write, a read) before giving up on it
/// for this round: a slow API server delays a round, never stops it.
pub const CALL_DEADLINE: Duration = Duration::from_secs(5);

/// `call` within [`CALL_DEADLINE`]; its error or the missed deadline as text naming `what`.
pub async fn within<T, E: std::fmt::Display>(
    what: &str,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(CALL_DEADLINE, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(format!("{what}: {error}")),
        Err(_) => Err(format!("{what}: no answer within {CALL_DEADLINE:?}")),
    }
}

/// One resource the agent watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Watched {
    pub group: &'static str,
    pub version: &'static str,
    pub kind: &'static str,
    pub plural: &'static str,
    /// The agent's name for it (its object keys, readiness, logs): the plural, qualified by
    /// the group where two groups share one (OpenShift's two `networks`).
    pub resource: &'static str,
    /// Served only where OVN-Kubernetes (or OpenShift) installed its CRD; absent is empty.
    pub optional: bool,
}

/// Everything the agent watches: the deployment's ClusterRole grants exactly these (a test
/// checks it).
pub const WATCHED: &[Watched] = &[
    core("Node", "nodes"),
    core("Pod", "pods"),
    core("Namespace", "namespaces"),
    core("Service", "services"),
    Watched {
        group: "discovery.k8s.io",
        version: "v1",
        kind: "EndpointSlice",
        plural: "endpointslices",
        resource: "endpointslices",
        optional: false,
    },
    Watched {
        group: "networking.k8s.io",
        version: "v1",
        kind: "NetworkPolicy",
        plural: "networkpolicies",
        resource: "networkpolicies",
        optional: false,
    },
    Watched {
        group: "k8s.ovn.org",
        version: "v1",
        kind: "EgressFirewall",
        plural: "egressfirewalls",
        resource: "egressfirewalls",
        optional: true,
    },
    Watched {
        group: "k8s.ovn.org",
        version: "v1",
        kind: "EgressIP",
        plural: "egressips",
        resource: "egressips",
        optional: true,
    },
    Watched {
        group: "policy.networking.k8s.io",
        version: "v1alpha1",
        kind: "AdminNetworkPolicy",
        plural: "adminnetworkpolicies",
        resource: "adminnetworkpolicies",
        optional: true,
    },
    Watched {
        group: "policy.networking.k8s.io",
        version: "v1alpha1",
        kind: "BaselineAdminNetworkPolicy",
        plural: "baselineadminnetworkpolicies",
        resource: "baselineadminnetworkpolicies",
        optional: true,
    },
    Watched {
        group: "policy.networking.k8s.io",
        version: "v1alpha2",
        kind: "ClusterNetworkPolicy",
        plural: "clusternetworkpolicies",
        resource: "clusternetworkpolicies",
        optional: true,
    },
    Watched {
        group: "operator.openshift.io",
        version: "v1",
        kind: "Network",
        plural: "networks",
        resource: "networks",
        optional: true,
    },
    // OpenShift's egress router pods, made by the controller.
    Watched {
        group: "network.operator.openshift.io",
        version: "v1",
        kind: "EgressRouter",
        plural: "egressrouters",
        resource: "egressrouters",
        optional: true,
    },
    // User-defined networks: their namespaces' pods are refused until they are carried.
    Watched {
        group: "k8s.ovn.org",
        version: "v1",
        kind: "UserDefinedNetwork",
        plural: "userdefinednetworks",
        resource: "userdefinednetworks",
        optional: true,
    },
    Watched {
        group: "k8s.ovn.org",
        version: "v1",
        kind: "ClusterUserDefinedNetwork",
        plural: "clusteruserdefinednetworks",
        resource: "clusteruserdefinednetworks",
        optional: true,
    },
    // OpenShift's cluster network configuration: the networks the installer wrote.
    Watched {
        group: "config.openshift.io",
        version: "v1",
        kind: "Network",
        plural: "networks",
        resource: "networks.config.openshift.io",
        optional: true,
    },
];

const fn core(kind: &'static str, plural: &'static str) -> Watched {
    Watched {
        group: "",
        version: "v1",
        kind,
        plural,
        resource: plural,
        optional: false,
    }
}

impl Watched {
    /// The watched resource of this name (`pods`, `egressfirewalls`,
    /// `networks.config.openshift.io`), if watched.
    pub fn by_resource(resource: &str) -> Option<Watched> {
        WATCHED.iter().find(|w| w.resource == resource).copied()
    }

    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_owned()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    fn api_resource(&self) -> ApiResource {
        let gvk = GroupVersionKind::gvk(self.group, self.version, self.kind);
        ApiResource::from_gvk_with_plural(&gvk, self.plural)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KubeSourceError {
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        path: String,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error(
        "no Kubernetes configuration found (in-cluster service account, KUBECONFIG, ~/.kube/config): {0}"
    )]
    Infer(#[source] kube::config::InferConfigError),
    #[error("Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    #[error("annotating node {node}: {source}")]
    Annotate {
        node: String,
        #[source]
        source: kube::Error,
    },
}

/// What the watchers and the agent share: the parsed objects and what changed.
struct Shared {
    /// Each object as last parsed, by resource, namespace and name, with its resource
    /// version, and the cluster state they make.
    parsed: Mutex<source::ObjectCache>,
    /// Resources whose first list is complete, or that the API server does not serve.
    ready: Mutex<BTreeSet<&'static str>>,
    /// Optional resources the API server does not serve.
    absent: Mutex<BTreeSet<&'static str>>,
    changed: AtomicBool,
    /// A watcher listed its resource again since the last [`KubeSource::take_relisted`].
    relisted: AtomicBool,
    /// Woken at every change (a permit is kept when nobody waits, so none is lost).
    wake: Notify,
    /// When the first change no snapshot has taken yet came.
    first: source::FirstChange,
}

impl Shared {
    fn new() -> Self {
        Self {
            parsed: Mutex::new(source::ObjectCache::default()),
            ready: Mutex::new(BTreeSet::new()),
            absent: Mutex::new(BTreeSet::new()),
            changed: AtomicBool::new(true),
            relisted: AtomicBool::new(false),
            wake: Notify::new(),
            first: source::FirstChange::default(),
        }
    }

    fn raise(&self) {
        self.first.note();
        self.changed.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    fn parsed(&self) -> std::sync::MutexGuard<'_, source::ObjectCache> {
        self.parsed.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The watchers and the objects they brought.
pub struct KubeSource {
    client: Client,
    shared: Arc<Shared>,
    /// Where the cluster's network configuration comes from when the API server has no
    /// `operator.openshift.io/v1 Network` (vanilla Kubernetes): a file, the DaemonSet's
    /// mounted ConfigMap.
    network_file: Option<NetworkFile>,
}

/// The cluster network configuration of a file holding an `operator.openshift.io/v1 Network`
/// (the same schema as OpenShift's): read again when its size or time moves.
struct NetworkFile {
    path: std::path::PathBuf,
    /// The file's stamp (`None`: unreadable) and what it parsed into, as last read.
    last: Mutex<Option<(Option<FileStamp>, ClusterState)>>,
}

/// A file's size and modification time.
type FileStamp = (u64, std::time::SystemTime);

impl NetworkFile {
    fn stamp(&self) -> Option<FileStamp> {
        let metadata = std::fs::metadata(&self.path).ok()?;
        Some((metadata.len(), metadata.modified().ok()?))
    }

    /// Whether the file moved since it was last read.
    fn changed(&self) -> bool {
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        last.as_ref()
            .is_none_or(|(stamp, _)| *stamp != self.stamp())
    }

    /// The file's `Network` settings (none: its faults, named, in `rejected`).
    fn read(&self) -> ClusterState {
        let stamp = self.stamp();
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((seen, parsed)) = last.as_ref()
            && *seen == stamp
        {
            return parsed.clone();
        }
        let name = self.path.display().to_string();
        let mut parsed = ClusterState::default();
        match std::fs::read_to_string(&self.path) {
            Ok(text) => {
                source::add_documents(&mut parsed, &name, &text);
                if parsed.network.is_none() {
                    parsed.rejected.push(format!(
                        "{name}: no operator.openshift.io/v1 Network in it: the cluster's networks are unknown"
                    ));
                }
            }
            Err(error) => parsed.rejected.push(format!(
                "{name}: {error}: the cluster's networks are unknown"
            )),
        }
        *last = Some((stamp, parsed.clone()));
        parsed
    }
}

/// The client for `kubeconfig`, or as inferred: in-cluster service account, `KUBECONFIG`,
/// `~/.kube/config`.
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client, KubeSourceError> {
    let config = match kubeconfig {
        Some(path) => {
            let error = |source| KubeSourceError::Kubeconfig {
                path: path.display().to_string(),
                source,
            };
            let kubeconfig = Kubeconfig::read_from(path).map_err(error)?;
            Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(error)?
        }
        None => Config::infer().await.map_err(KubeSourceError::Infer)?,
    };
    Client::try_from(config).map_err(KubeSourceError::Client)
}

impl KubeSource {
    /// Starts one watcher per watched resource on the current runtime.
    pub fn start(client: &Client) -> Self {
        let shared = Arc::new(Shared::new());
        for &watched in WATCHED {
            let api: Api<WatchedObject> = Api::all_with(client.clone(), &watched.api_resource());
            tokio::spawn(follow(watched, api, Arc::clone(&shared)));
        }
        Self {
            client: client.clone(),
            shared,
            network_file: None,
        }
    }

    /// Reads the cluster's network configuration from `path` (an `operator.openshift.io/v1
    /// Network`, as the DaemonSet mounts the deploy/ ConfigMap) wherever the API server has no
    /// `Network` of its own; one in the API server (OpenShift's) takes precedence.
    pub fn with_network_file(mut self, path: std::path::PathBuf) -> Self {
        self.network_file = Some(NetworkFile {
            path,
            last: Mutex::new(None),
        });
        self
    }

    /// Sets `annotations` on the Node `node` (a merge patch: other annotations stay). The
    /// agent's only write of cluster objects: what others read of its node (its underlay
    /// network for the egress IP controller, its router for the hybrid overlay's other end).
    pub async fn annotate_node(
        &self,
        node: &str,
        annotations: &BTreeMap<String, String>,
    ) -> Result<(), KubeSourceError> {
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(self.client.clone());
        let patch = serde_json::json!({"metadata": {"annotations": annotations}});
        nodes
            .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|source| KubeSourceError::Annotate {
                node: node.to_owned(),
                source,
            })?;
        Ok(())
    }

    /// Waits until every watcher has its first full list (or its resource proved absent),
    /// so that the first sync never applies a partial cluster: an agent taking over pinned
    /// maps must not drop, say, the firewalls because their list came late.
    pub async fn wait_ready(&self) {
        let mut next_report = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let pending: Vec<&str> = {
                let ready = self.shared.ready.lock().unwrap_or_else(|e| e.into_inner());
                WATCHED
                    .iter()
                    .map(|w| w.resource)
                    .filter(|resource| !ready.contains(resource))
                    .collect()
            };
            if pending.is_empty() {
                return;
            }
            if tokio::time::Instant::now() >= next_report {
                tracing::info!(?pending, "waiting for the API server's first lists");
                next_report += Duration::from_secs(5);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// When the first change no sync has taken yet came (taken: the next one starts anew).
    pub fn take_first_change(&self) -> Option<std::time::Instant> {
        self.shared.first.take()
    }

    /// Whether a watcher listed its resource again (a lost watch, a 410 Gone) since the last
    /// call: the agent then runs a full recompute.
    pub fn take_relisted(&self) -> bool {
        self.shared.relisted.swap(false, Ordering::AcqRel)
    }

    /// Whether anything changed since the last [`Self::snapshot`].
    pub fn changed(&self) -> bool {
        self.shared.changed.load(Ordering::Acquire)
            || self.network_file.as_ref().is_some_and(NetworkFile::changed)
    }

    /// Returns once something changed (possibly before the last snapshot: check
    /// [`Self::changed`]).
    pub async fn wait_changed(&self) {
        self.shared.wake.notified().await;
    }

    /// The cluster as the watchers brought it, each object parsed once per resource version
    /// as it arrived and placed in the assembled state; `fresh` assembles the state anew from
    /// every object's parse (a full recompute) instead of patching the last one.
    pub fn snapshot(&self, fresh: bool) -> ClusterState {
        self.shared.changed.store(false, Ordering::Release);
        let mut parsed = self.shared.parsed();
        if fresh {
            parsed.reassemble();
        }
        let mut state = parsed.assemble();
        drop(parsed);
        if let Some(file) = &self.network_file
            && state.network.is_none()
        {
            let configured = file.read();
            state.absorb_settings(&configured);
            state.rejected.extend(configured.rejected);
        }
        state.settle_networks();
        state
    }
}

/// A watched object's resource, namespace (empty for a cluster-scoped one) and name.
fn object_key(watched: &Watched, object: &WatchedObject) -> ObjectKey {
    (
        watched.resource,
        object.metadata.namespace.clone().unwrap_or_default(),
        object.metadata.name.clone().unwrap_or_default(),
    )
}

/// A watched object of `resource` (`apiVersion`, `kind`) decoded into the cluster state as the
/// API source does: its fields straight into its type. Public for the scale benchmark.
pub fn parse_watched(
    resource: &str,
    api_version: &str,
    kind: &str,
    object: WatchedObject,
) -> ClusterState {
    let mut state = ClusterState::default();
    // List items come without their type; the resource says what they are.
    let document = WatchedDocument {
        api_version,
        kind,
        name: object.metadata.name.as_deref(),
        json: &object.json,
    };
    source::add_object(&mut state, &format!("api:{resource}"), document);
    state
}

/// A watched object's JSON text, of the type its resource names.
struct WatchedDocument<'a> {
    api_version: &'a str,
    kind: &'a str,
    name: Option<&'a str>,
    json: &'a str,
}

impl source::Document for WatchedDocument<'_> {
    fn text(&self, path: &[&str]) -> Option<&str> {
        match path {
            ["apiVersion"] => Some(self.api_version),
            ["kind"] => Some(self.kind),
            ["metadata", "name"] => self.name,
            _ => None,
        }
    }

    fn decode<T: serde::de::DeserializeOwned>(self) -> Result<T, String> {
        serde_json::from_str(self.json).map_err(|e| e.to_string())
    }
}

/// A listed object: its key, resource version and the object, `None` when the cache holds it
/// at that version (not parsed again).
type ListItem = (ObjectKey, Option<String>, Option<WatchedObject>);

/// A listed object parsed, as the cache takes it (`source::ObjectCache::put_listed`).
pub type ParsedItem = (ObjectKey, Option<String>, source::Parsed);

/// What one list brought: its objects parsed and every key it listed.
#[derive(Default)]
pub struct Listed {
    /// In list order.
    pub parsed: Vec<ParsedItem>,
    /// Sorted (the objects the list did not name are gone).
    pub seen: Vec<ObjectKey>,
}

impl Listed {
    /// Parses `items` (those the cache does not hold) and notes their keys.
    fn take(&mut self, watched: &Watched, items: Vec<ListItem>) {
        let parsed = items.into_iter().map(|(key, version, object)| {
            let parsed = object.map(|o| parse_watched_item(watched, o));
            (key, version, parsed)
        });
        self.take_parsed(parsed);
    }

    fn take_parsed(
        &mut self,
        items: impl IntoIterator<Item = (ObjectKey, Option<String>, Option<source::Parsed>)>,
    ) {
        for (key, version, parsed) in items {
            if let Some(parsed) = parsed {
                self.parsed.push((key.clone(), version, parsed));
            }
            self.seen.push(key);
        }
    }
}

/// One watcher's list in progress, its objects parsed as they arrive on a thread of the
/// list's own: the watcher decodes the next items while that thread parses the last ones into
/// their types (the larger part of a list's cost: at 150,000 pods 0.7 s against 0.4 s, one
/// after the other on one thread before) and keeps their keys. Applied at once when the list
/// is complete, so that a sync never sees half a list.
pub struct Listing {
    watched: Watched,
    parser: Option<ListParser>,
    /// The items not yet sent to the parser: sent a batch at a time, as waking the thread
    /// for each item cost more than the parse gained.
    batch: Vec<ListItem>,
    /// Taken on the watcher's thread: when no thread could be started.
    here: Listed,
}

/// Items sent to a list's parser at once.
const LIST_BATCH: usize = 256;

/// The thread parsing one list and the channel feeding it.
struct ListParser {
    items: std::sync::mpsc::Sender<Vec<ListItem>>,
    thread: std::thread::JoinHandle<Listed>,
}

impl Listing {
    pub fn new(watched: Watched) -> Self {
        Self {
            watched,
            parser: None,
            batch: Vec::with_capacity(LIST_BATCH),
            here: Listed::default(),
        }
    }

    /// The listed object `key` at `version`; `object` is to be parsed, or `None` when the
    /// cache holds it at that version.
    pub fn add(&mut self, key: ObjectKey, version: Option<String>, object: Option<WatchedObject>) {
        self.batch.push((key, version, object));
        if self.batch.len() == LIST_BATCH {
            self.send_batch();
        }
    }

    /// Hands the batch to the parser (started at the first), or parses it here without one.
    fn send_batch(&mut self) {
        let batch = std::mem::replace(&mut self.batch, Vec::with_capacity(LIST_BATCH));
        if self.parser.is_none() {
            self.parser = ListParser::start(self.watched);
        }
        let batch = match &self.parser {
            Some(parser) => match parser.items.send(batch) {
                Ok(()) => return,
                // The thread is gone (it panicked): `finish` says so.
                Err(std::sync::mpsc::SendError(batch)) => batch,
            },
            None => batch,
        };
        self.here.take(&self.watched, batch);
    }

    /// The list as it came: every object parsed, in list order, and every key listed.
    pub fn finish(mut self) -> Listed {
        if !self.batch.is_empty() {
            self.send_batch();
        }
        let mut listed = match self.parser {
            Some(ListParser { items, thread }) => {
                drop(items);
                thread
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            }
            None => Listed::default(),
        };
        listed.parsed.append(&mut self.here.parsed);
        listed.seen.append(&mut self.here.seen);
        // In key order already from an API server: the sort only checks it.
        listed.seen.sort_unstable();
        listed.seen.dedup();
        listed
    }
}

impl ListParser {
    /// A thread parsing what it is sent until the sender is dropped; `None` if the system
    /// would not start one (the watcher then parses the list itself).
    fn start(watched: Watched) -> Option<Self> {
        let (items, received) = std::sync::mpsc::channel::<Vec<ListItem>>();
        let thread = std::thread::Builder::new()
            .name(format!("list-{}", watched.resource))
            .spawn(move || {
                let mut listed = Listed::default();
                for batch in received {
                    // Parsed on every core while the watcher decodes the next batch.
                    let parsed =
                        crate::parallel::map_owned(batch, true, |(key, version, object)| {
                            let parsed = object.map(|o| parse_watched_item(&watched, o));
                            (key, version, parsed)
                        });
                    listed.take_parsed(parsed);
                }
                listed
            });
        match thread {
            Ok(thread) => Some(Self { items, thread }),
            Err(error) => {
                tracing::warn!(resource = watched.resource, %error, "no thread to parse the list: parsed by its watcher");
                None
            }
        }
    }
}

/// Parses one listed object of `watched` as the cache keeps it.
fn parse_watched_item(watched: &Watched, object: WatchedObject) -> source::Parsed {
    parse_watched(
        watched.resource,
        &watched.api_version(),
        watched.kind,
        object,
    )
    .into()
}

/// Applies one watcher event of `watched` to the shared cache; whether it changed what a sync
/// reads.
fn apply_event(
    watched: &Watched,
    event: watcher::Event<WatchedObject>,
    listing: &mut Option<Listing>,
    shared: &Shared,
) -> bool {
    let api_version = watched.api_version();
    let parse =
        |object: WatchedObject| parse_watched(watched.resource, &api_version, watched.kind, object);
    match event {
        watcher::Event::Apply(object) => {
            let key = object_key(watched, &object);
            let version = object.metadata.resource_version.clone();
            shared.parsed().put(key, version, || parse(object));
            true
        }
        watcher::Event::Delete(object) => {
            shared.parsed().remove(&object_key(watched, &object));
            true
        }
        watcher::Event::Init => {
            *listing = Some(Listing::new(*watched));
            false
        }
        watcher::Event::InitApply(object) => {
            let listing = listing.get_or_insert_with(|| Listing::new(*watched));
            let key = object_key(watched, &object);
            let version = object.metadata.resource_version.clone();
            let held = shared.parsed().holds(&key, version.as_deref());
            listing.add(key, version, (!held).then_some(object));
            false
        }
        watcher::Event::InitDone => {
            let Listed { parsed, seen } = listing
                .take()
                .unwrap_or_else(|| Listing::new(*watched))
                .finish();
            let mut cache = shared.parsed();
            cache.retain(|key| key.0 != watched.resource || seen.binary_search(key).is_ok());
            cache.put_listed(parsed);
            drop(cache);
            let first = shared
                .ready
                .lock()
                .map(|mut ready| ready.insert(watched.resource))
                .unwrap_or(false);
            if !first {
                tracing::info!(
                    resource = watched.resource,
                    "listed again; a full recompute follows"
                );
                shared.relisted.store(true, Ordering::Release);
            }
            true
        }
    }
}

/// Runs one resource's watcher into the shared cache for as long as the runtime runs,
/// marking the source changed on every event that changed it. Errors are logged and retried
/// with backoff; an optional resource the server does not serve (404) counts as empty.
async fn follow(watched: Watched, api: Api<WatchedObject>, shared: Arc<Shared>) {
    let stream = watcher(api, watcher::Config::default()).default_backoff();
    let mut stream = std::pin::pin!(stream);
    let mut failing = false;
    let mut listing = None;
    while let Some(event) = stream.next().await {
        match event {
            Ok(event) => {
                if failing {
                    tracing::info!(resource = watched.resource, "watch restored");
                    failing = false;
                }
                if apply_event(&watched, event, &mut listing, &shared) {
                    shared.raise();
                }
            }
            Err(watcher::Error::InitialListFailed(kube::Error::Api(status)))
                if watched.optional && status.code == 404 =>
            {
                let newly = shared
                    .absent
                    .lock()
                    .map(|mut a| a.insert(watched.resource))
                    .unwrap_or(false);
                if newly {
                    if let Ok(mut ready) = shared.ready.lock() {
                        ready.insert(watched.resource);
                    }
                    shared.raise();
                    tracing::info!(
                        resource = watched.resource,
                        "not served by this API server (CRD not installed); taken as empty"
                    );
                }
            }
            Err(error) => {
                if !failing {
                    tracing::warn!(resource = watched.resource, %error, "watch failed; retrying with backoff, the maps keep the last good state");
                }
                failing = true;
            }
        }
    }
}

// What the tests below take from here with `use super::*`.
#[cfg(test)]
use {object::LAST_APPLIED, serde_json::Value};

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use k8s_openapi::api::{apps::v1::DaemonSet, rbac::v1::ClusterRole};
    use serde::Deserialize as _;

    use super::*;

    fn deploy_file(name: &str) -> String {
        let path = format!("{}/../deploy/{name}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// The documents of a multi-document YAML file of kind `kind`, as `T`.
    fn objects<T: serde::de::DeserializeOwned>(text: &str, kind: &str) -> Vec<T> {
        serde_yaml::Deserializer::from_str(text)
            .map(|d| serde_yaml::Value::deserialize(d).expect("YAML"))
            .filter(|v| v.get("kind").and_then(|k| k.as_str()) == Some(kind))
            .map(|v| serde_yaml::from_value(v).expect(kind))
            .collect()
    }

    #[test]
    fn a_watched_object_is_decoded_from_its_json_and_a_bad_one_rejected_by_name_and_field() {
        // A list item: no apiVersion or kind of its own, as the watcher hands them.
        let good: WatchedObject = serde_json::from_str(
            r#"{"metadata": {"name": "web", "namespace": "shop", "resourceVersion": "7"},
                "spec": {"nodeName": "node0", "containers": [{"name": "app"}]},
                "status": {"podIP": "10.244.1.5"}}"#,
        )
        .expect("object");
        assert_eq!(good.metadata.resource_version.as_deref(), Some("7"));
        let state = parse_watched("pods", "v1", "Pod", good);
        assert!(state.rejected.is_empty(), "{:?}", state.rejected);
        assert_eq!(state.pods.len(), 1);
        let pod = &state.pods[0];
        assert_eq!(pod.metadata.namespace.as_deref(), Some("shop"));
        assert_eq!(
            pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
            Some("node0")
        );
        let bad: WatchedObject =
            serde_json::from_str(r#"{"metadata": {"name": "web"}, "spec": {"containers": "app"}}"#)
                .expect("object");
        let state = parse_watched("pods", "v1", "Pod", bad);
        assert!(state.pods.is_empty());
        assert_eq!(state.rejected.len(), 1);
        let rejected = &state.rejected[0];
        assert!(
            rejected.starts_with("api:pods: Pod web: invalid type: string \"app\""),
            "{rejected}"
        );
    }

    /// As kube decodes them: a watch event whether its object comes before its type (serde
    /// buffers it) or after, and a list whose one bad item does not fail the others.
    #[test]
    fn watch_events_and_lists_decode_in_any_field_order_and_a_bad_item_fails_alone() {
        use kube::core::{ObjectList, WatchEvent};
        let object = r#"{"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web", "namespace": "shop", "resourceVersion": "3"},
            "spec": {"nodeName": "node0", "containers": [{"name": "app"}]}}"#;
        for event in [
            format!(r#"{{"type": "ADDED", "object": {object}}}"#),
            format!(r#"{{"object": {object}, "type": "ADDED"}}"#),
        ] {
            let event: WatchEvent<WatchedObject> = serde_json::from_str(&event).expect(&event);
            let WatchEvent::Added(object) = event else {
                panic!("not an added object");
            };
            assert_eq!(object.metadata.name.as_deref(), Some("web"));
            let state = parse_watched("pods", "v1", "Pod", object);
            assert!(state.rejected.is_empty(), "{:?}", state.rejected);
            let spec = state.pods[0].spec.as_ref().expect("spec");
            assert_eq!(spec.node_name.as_deref(), Some("node0"));
        }
        let list: ObjectList<WatchedObject> = serde_json::from_str(
            r#"{"metadata": {"resourceVersion": "9"}, "items": [
                {"metadata": {"name": 7, "namespace": "shop", "annotations": {"a": 1}}},
                {"metadata": {"name": "db", "namespace": "shop"}, "spec": {"containers": []}}]}"#,
        )
        .expect("list");
        let [bad, good] = <[WatchedObject; 2]>::try_from(list.items).expect("two items");
        assert_eq!(bad.metadata.name, None);
        let state = parse_watched("pods", "v1", "Pod", bad);
        assert!(state.pods.is_empty());
        assert!(
            state.rejected[0].starts_with("api:pods: Pod <unnamed>: invalid type: integer `7`"),
            "{:?}",
            state.rejected
        );
        let state = parse_watched("pods", "v1", "Pod", good);
        assert!(state.rejected.is_empty(), "{:?}", state.rejected);
        assert_eq!(state.pods[0].metadata.name.as_deref(), Some("db"));
    }

    fn pod(name: &str, version: &str, app: &str) -> WatchedObject {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "shop", "resourceVersion": version,
                         "labels": {"app": app}},
            "spec": {"containers": [{"name": "app"}]},
        }))
        .expect("object")
    }

    fn pod_apps(shared: &Shared) -> Vec<(String, String)> {
        let state = shared.parsed().assemble();
        state
            .pods
            .iter()
            .map(|p| {
                let app = p.metadata.labels.as_ref().and_then(|l| l.get("app"));
                let name = p.metadata.name.clone().unwrap_or_default();
                (name, app.cloned().unwrap_or_default())
            })
            .collect()
    }

    /// A list of pods across several namespaces, in list (key) order, some of them held by
    /// the cache already (`None`): what the API server's list and the cache's check give a
    /// `Listing`.
    fn listed_pods(count: usize) -> Vec<(ObjectKey, Option<String>, Option<WatchedObject>)> {
        let mut pods: Vec<_> = (0..count)
            .map(|i| {
                let object: WatchedObject = serde_json::from_value(serde_json::json!({
                    "metadata": {"name": format!("pod-{i}"), "namespace": format!("ns-{}", i % 7),
                                 "resourceVersion": i.to_string(),
                                 "labels": {"app": format!("app-{}", i % 3)}},
                    "spec": {"nodeName": "n1", "containers": [{"name": "app",
                             "ports": [{"name": "http", "containerPort": 8000 + i % 50}]}]},
                    "status": {"podIP": format!("10.0.{}.{}", i / 250, i % 250 + 1)},
                }))
                .expect("pod");
                let key = object_key(&watched("pods"), &object);
                let version = object.metadata.resource_version.clone();
                (key, version, (i % 9 != 4).then_some(object))
            })
            .collect();
        pods.sort_by(|a, b| a.0.cmp(&b.0));
        pods
    }

    fn watched(plural: &str) -> Watched {
        Watched::by_resource(plural).expect("watched")
    }

    #[test]
    fn a_list_parsed_on_its_own_thread_gives_what_parsing_each_item_in_place_gives() {
        // Several batches and a partial last one.
        let items = listed_pods(3 * LIST_BATCH + 17);
        let pods = watched("pods");
        let mut in_place = source::ObjectCache::default();
        let mut expected_parsed = Vec::new();
        for (key, version, object) in items.clone() {
            if let Some(object) = object {
                expected_parsed.push(key.clone());
                in_place.put(key, version, || {
                    parse_watched(pods.resource, &pods.api_version(), pods.kind, object)
                });
            }
        }
        let mut listing = Listing::new(pods);
        for (key, version, object) in items.clone() {
            listing.add(key, version, object);
        }
        let listed = listing.finish();
        let every_key: Vec<ObjectKey> = items.iter().map(|(key, _, _)| key.clone()).collect();
        assert_eq!(listed.seen, every_key, "every key listed, held or not");
        let parsed_keys: Vec<ObjectKey> = listed.parsed.iter().map(|p| p.0.clone()).collect();
        assert_eq!(
            parsed_keys, expected_parsed,
            "the parsed ones, in list order"
        );
        assert!(
            listed
                .parsed
                .iter()
                .zip(items.iter().filter(|i| i.2.is_some()))
                .all(|(parsed, item)| parsed.1 == item.1),
            "each with its version"
        );
        let mut threaded = source::ObjectCache::default();
        threaded.put_listed(listed.parsed);
        let (threaded, in_place) = (threaded.assemble(), in_place.assemble());
        assert_eq!(threaded.pods.len(), expected_parsed.len());
        assert_eq!(threaded, in_place);
    }

    #[test]
    fn a_list_of_objects_the_cache_holds_parses_nothing_and_names_every_key() {
        let items: Vec<_> = listed_pods(LIST_BATCH + 1)
            .into_iter()
            .map(|(key, version, _)| (key, version, None))
            .collect();
        let mut listing = Listing::new(watched("pods"));
        for (key, version, object) in items.clone() {
            listing.add(key, version, object);
        }
        let listed = listing.finish();
        assert!(listed.parsed.is_empty());
        assert_eq!(listed.seen.len(), items.len());
        assert!(listed.seen.is_sorted());
    }

    #[test]
    fn a_watched_object_keeps_its_fields_without_managed_fields_or_the_last_applied_copy() {
        let object: WatchedObject = serde_json::from_str(&format!(
            r#"{{"metadata": {{"name": "web", "namespace": "shop", "resourceVersion": "9",
                 "managedFields": [{{"manager": "kubectl", "fieldsV1": {{"f:spec": {{}}}}}}],
                 "annotations": {{"{LAST_APPLIED}": "{{}}", "keep": "me"}}}},
                "spec": {{"nodeName": "n1"}}}}"#
        ))
        .expect("object");
        assert_eq!(object.metadata.name.as_deref(), Some("web"));
        assert_eq!(object.metadata.namespace.as_deref(), Some("shop"));
        assert_eq!(object.metadata.resource_version.as_deref(), Some("9"));
        assert_eq!(
            serde_json::from_str::<Value>(&object.json).expect("JSON"),
            serde_json::json!({
                "metadata": {"name": "web", "namespace": "shop", "resourceVersion": "9",
                             "annotations": {"keep": "me"}},
                "spec": {"nodeName": "n1"},
            })
        );
        let bad = serde_json::from_str::<WatchedObject>(r#"{"metadata": {"name": 7"#);
        assert!(bad.is_err());
    }

    /// A field is copied as the server wrote it when serde_json reads it straight from its
    /// input (a list's items, an event whose type comes first), and written out again when
    /// serde buffered it (an event whose object comes first): the same object either way.
    #[test]
    fn a_watched_objects_fields_are_copied_verbatim_or_written_again_when_buffered() {
        use kube::core::{ObjectList, WatchEvent};
        let object = r#"{"metadata": {"name": "web", "labels": {"app":  "x"}},
            "spec": {"nodeName":   "n1", "containers": [ {"name": "app"} ]}, "status": 7}"#;
        let verbatim: WatchedObject = serde_json::from_str(object).expect("object");
        assert!(
            verbatim.json.contains(
                r#""spec":{"nodeName":   "n1", "containers": [ {"name": "app"} ]},"status":7"#
            ),
            "{}",
            verbatim.json
        );
        assert!(
            verbatim.json.contains(r#""labels":{"app":  "x"}"#),
            "{}",
            verbatim.json
        );
        let list: ObjectList<WatchedObject> =
            serde_json::from_str(&format!(r#"{{"metadata": {{}}, "items": [{object}]}}"#))
                .expect("list");
        assert_eq!(list.items[0].json, verbatim.json);
        let first: WatchEvent<WatchedObject> =
            serde_json::from_str(&format!(r#"{{"type": "ADDED", "object": {object}}}"#))
                .expect("event");
        let WatchEvent::Added(first) = first else {
            panic!("not added");
        };
        assert_eq!(first.json, verbatim.json);
        let buffered: WatchEvent<WatchedObject> =
            serde_json::from_str(&format!(r#"{{"object": {object}, "type": "ADDED"}}"#))
                .expect("event");
        let WatchEvent::Added(buffered) = buffered else {
            panic!("not added");
        };
        assert!(
            buffered
                .json
                .contains(r#""spec":{"nodeName":"n1","containers":[{"name":"app"}]},"status":7"#),
            "{}",
            buffered.json
        );
        let value = |json: &str| serde_json::from_str::<Value>(json).expect("JSON");
        assert_eq!(value(&buffered.json), value(&verbatim.json));
        assert_eq!(buffered.metadata.name.as_deref(), Some("web"));
    }

    /// Events go straight to the cache; a list replaces its resource's objects only when it
    /// is complete (a sync in between sees the last list), drops what it no longer has, makes
    /// the resource ready, and a second list asks for a full recompute.
    #[test]
    fn watch_events_patch_the_cache_and_a_relist_replaces_it_at_once() {
        let shared = Shared::new();
        let pods = &watched("pods");
        let mut listing = None;
        let mut apply = |event| apply_event(pods, event, &mut listing, &shared);
        assert!(!apply(watcher::Event::Init));
        assert!(!apply(watcher::Event::InitApply(pod("a", "1", "x"))));
        assert!(!apply(watcher::Event::InitApply(pod("b", "1", "x"))));
        assert!(pod_apps(&shared).is_empty(), "half a list is not applied");
        assert!(apply(watcher::Event::InitDone));
        assert_eq!(
            pod_apps(&shared),
            [("a".into(), "x".into()), ("b".into(), "x".into())]
        );
        assert!(shared.ready.lock().expect("ready").contains("pods"));
        assert!(!shared.relisted.load(Ordering::Acquire));

        assert!(apply(watcher::Event::Apply(pod("c", "2", "y"))));
        assert!(apply(watcher::Event::Apply(pod("a", "3", "z"))));
        assert!(apply(watcher::Event::Delete(pod("b", "1", "x"))));
        assert_eq!(
            pod_apps(&shared),
            [("a".into(), "z".into()), ("c".into(), "y".into())]
        );

        // A re-list after a lost watch: `c` is gone, `d` is new, `a` changed meanwhile.
        assert!(!apply(watcher::Event::Init));
        assert!(!apply(watcher::Event::InitApply(pod("a", "5", "w"))));
        assert!(!apply(watcher::Event::InitApply(pod("d", "4", "v"))));
        assert_eq!(
            pod_apps(&shared).len(),
            2,
            "the last state until the list is whole"
        );
        assert!(apply(watcher::Event::InitDone));
        assert_eq!(
            pod_apps(&shared),
            [("a".into(), "w".into()), ("d".into(), "v".into())]
        );
        assert!(shared.relisted.load(Ordering::Acquire));
    }

    #[test]
    fn the_cluster_role_reads_exactly_the_watched_resources_and_writes_only_nodes_and_events() {
        let roles: Vec<ClusterRole> = objects(&deploy_file("rbac.yaml"), "ClusterRole");
        assert_eq!(roles.len(), 1);
        let mut granted = BTreeSet::new();
        let mut written = BTreeSet::new();
        for rule in roles[0].rules.iter().flatten() {
            for group in rule.api_groups.iter().flatten() {
                for resource in rule.resources.iter().flatten() {
                    let entry = (group.clone(), resource.clone());
                    match rule.verbs.as_slice() {
                        [list, watch] if list == "list" && watch == "watch" => {
                            granted.insert(entry)
                        }
                        [patch] if patch == "patch" => written.insert(entry),
                        [create, patch] if create == "create" && patch == "patch" => {
                            written.insert(entry)
                        }
                        verbs => panic!("unexpected verbs {verbs:?}"),
                    };
                }
            }
        }
        // Its writes: its own Node's annotations (underlay network, hybrid overlay router),
        // the Events of refusals.
        assert_eq!(
            written,
            BTreeSet::from([
                (String::new(), "nodes".to_owned()),
                ("events.k8s.io".to_owned(), "events".to_owned())
            ])
        );
        let watched: BTreeSet<(String, String)> = WATCHED
            .iter()
            .map(|w| (w.group.to_owned(), w.plural.to_owned()))
            .collect();
        assert_eq!(granted, watched);
    }

    /// The agents' node writes are held to their own Node and their own annotations by an
    /// admission policy (RBAC cannot say so): the policy names the agents' service account
    /// and exactly the annotations the agent writes, and is bound to deny.
    #[test]
    fn an_admission_policy_holds_each_agent_to_its_own_node_and_annotations() {
        use k8s_openapi::api::admissionregistration::v1::{
            ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
        };
        let text = deploy_file("rbac.yaml");
        let policies: Vec<ValidatingAdmissionPolicy> = objects(&text, "ValidatingAdmissionPolicy");
        let bindings: Vec<ValidatingAdmissionPolicyBinding> =
            objects(&text, "ValidatingAdmissionPolicyBinding");
        assert_eq!(policies.len(), 1);
        let name = policies[0].metadata.name.clone().unwrap();
        let binding = bindings[0].spec.as_ref().unwrap();
        assert_eq!(binding.policy_name.as_deref(), Some(name.as_str()));
        assert_eq!(
            binding.validation_actions.as_deref(),
            Some(&["Deny".to_owned()][..])
        );
        let spec = policies[0].spec.as_ref().unwrap();
        assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));
        let condition = &spec.match_conditions.as_ref().unwrap()[0].expression;
        assert!(
            condition.contains("'system:serviceaccount:dataplane:dataplane-agent'"),
            "{condition}"
        );
        let owned = spec
            .variables
            .iter()
            .flatten()
            .find(|v| v.name == "owned")
            .expect("the owned annotations");
        for annotation in [
            crate::egressip::controller::PRIMARY_IFADDR,
            crate::model::hybrid::ROUTER_IP_ANNOTATION,
            crate::model::hybrid::ROUTER_MAC_ANNOTATION,
        ] {
            assert!(
                owned.expression.contains(&format!("'{annotation}'")),
                "{annotation}"
            );
        }
        assert_eq!(owned.expression.matches("'k8s.ovn.org/").count(), 3);
        let checks: Vec<&str> = spec
            .validations
            .iter()
            .flatten()
            .map(|v| v.expression.as_str())
            .collect();
        assert!(
            checks
                .iter()
                .any(|c| c.contains("object.metadata.name == variables.ownNode"))
        );
        assert!(
            checks
                .iter()
                .any(|c| c.contains("object.spec == oldObject.spec"))
        );
    }

    /// The controller needs no privilege and has none.
    #[test]
    fn the_controller_runs_unprivileged() {
        let deployments: Vec<k8s_openapi::api::apps::v1::Deployment> =
            objects(&deploy_file("controller.yaml"), "Deployment");
        let pod = deployments[0]
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .expect("pod spec");
        let context = pod.security_context.as_ref().expect("pod security context");
        assert_eq!(context.run_as_non_root, Some(true));
        assert!(context.run_as_user.is_some_and(|u| u != 0));
        let container = pod.containers[0]
            .security_context
            .as_ref()
            .expect("context");
        assert_eq!(container.allow_privilege_escalation, Some(false));
        assert_eq!(container.privileged, None);
        let dropped = container
            .capabilities
            .as_ref()
            .and_then(|c| c.drop.clone())
            .unwrap_or_default();
        assert_eq!(dropped, vec!["ALL".to_owned()]);
        assert!(
            container
                .capabilities
                .as_ref()
                .and_then(|c| c.add.as_ref())
                .is_none()
        );
    }

    #[test]
    fn the_controller_reads_what_the_agents_read_and_writes_only_egressip_status_node_subnets_its_lease_and_egress_routers()
     {
        let text = deploy_file("controller.yaml");
        let roles: Vec<ClusterRole> = objects(&text, "ClusterRole");
        let mut read = BTreeSet::new();
        let mut written = BTreeSet::new();
        let mut applied = BTreeSet::new();
        for rule in roles[0].rules.iter().flatten() {
            for group in rule.api_groups.iter().flatten() {
                for resource in rule.resources.iter().flatten() {
                    let entry = (group.clone(), resource.clone());
                    let verbs: Vec<&str> = rule.verbs.iter().map(String::as_str).collect();
                    match verbs.as_slice() {
                        ["list", "watch"] => read.insert(entry),
                        ["patch"] => written.insert(entry),
                        ["get", "create", "patch"] => applied.insert(entry),
                        verbs => panic!("unexpected verbs {verbs:?}"),
                    };
                }
            }
        }
        let watched: BTreeSet<(String, String)> = WATCHED
            .iter()
            .map(|w| (w.group.to_owned(), w.plural.to_owned()))
            .collect();
        assert_eq!(read, watched);
        assert_eq!(
            written,
            BTreeSet::from([
                (String::new(), "nodes".to_owned()),
                ("k8s.ovn.org".to_owned(), "egressips/status".to_owned()),
                (
                    "k8s.ovn.org".to_owned(),
                    "userdefinednetworks/status".to_owned()
                ),
                (
                    "k8s.ovn.org".to_owned(),
                    "clusteruserdefinednetworks/status".to_owned()
                ),
                (
                    "network.operator.openshift.io".to_owned(),
                    "egressrouters/status".to_owned()
                ),
            ])
        );
        // What it makes for EgressRouters (server-side applies), held by the admission
        // policy to objects an EgressRouter owns.
        assert_eq!(
            applied,
            BTreeSet::from([
                ("apps".to_owned(), "deployments".to_owned()),
                (String::new(), "services".to_owned()),
                (
                    "k8s.cni.cncf.io".to_owned(),
                    "network-attachment-definitions".to_owned()
                ),
            ])
        );
        // Its Node writes are held to the annotations the allocation writes.
        let policies: Vec<k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy> =
            objects(&text, "ValidatingAdmissionPolicy");
        let owned = policies[0]
            .spec
            .as_ref()
            .and_then(|s| s.variables.as_ref())
            .and_then(|v| v.iter().find(|v| v.name == "owned"))
            .map(|v| v.expression.clone())
            .expect("owned annotations");
        assert_eq!(
            owned,
            format!(
                "['{}', '{}']",
                crate::model::subnets::NODE_SUBNETS_ANNOTATION,
                crate::model::hybrid::NODE_SUBNET_ANNOTATION
            )
        );
        let leases: Vec<k8s_openapi::api::rbac::v1::Role> = objects(&text, "Role");
        let rule = &leases[0].rules.as_deref().unwrap_or_default()[0];
        assert_eq!(rule.resources.as_deref(), Some(&["leases".to_owned()][..]));
        let deployments: Vec<k8s_openapi::api::apps::v1::Deployment> = objects(&text, "Deployment");
        let pod = deployments[0]
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .expect("pod spec");
        let args = pod.containers[0].args.as_deref().unwrap_or_default();
        assert_eq!(args[..2], ["controller", "--kubernetes"]);
        // It probes the agents where they answer by default, signed with the key the
        // DaemonSet's agents hold too (the same Secret, mounted at the same path).
        assert!(
            args.iter().any(|a| *a
                == format!(
                    "--probe-port={}",
                    crate::egressip::probe::DEFAULT_PROBE_PORT
                )),
            "{args:?}"
        );
        let key_flag = format!(
            "--probe-key-file={}",
            crate::egressip::probe::DEFAULT_KEY_FILE
        );
        assert!(args.contains(&key_flag), "{args:?}");
        let mounted = |pod: &k8s_openapi::api::core::v1::PodSpec| {
            let mount = pod.containers[0]
                .volume_mounts
                .iter()
                .flatten()
                .find(|m| m.mount_path == "/etc/dataplane/probe-key")?;
            let volume = pod
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == mount.name)?;
            volume.secret.as_ref()?.secret_name.clone()
        };
        assert_eq!(mounted(pod).as_deref(), Some("dataplane-probe-key"));
        let sets: Vec<DaemonSet> = objects(&deploy_file("daemonset.yaml"), "DaemonSet");
        let agent = sets[0]
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .expect("pod spec");
        assert_eq!(mounted(agent).as_deref(), Some("dataplane-probe-key"));
    }

    /// deploy/network.yaml is a ConfigMap whose `network.yaml` the agent reads as its
    /// configuration, the DaemonSet mounts it where `--network-config` points, and a snapshot
    /// takes it where the API server has no Network (its faults named when it is unusable).
    #[test]
    fn the_network_config_map_is_mounted_where_the_agent_reads_it_and_configures_the_cluster() {
        use k8s_openapi::api::core::v1::ConfigMap;
        let maps: Vec<ConfigMap> = objects(&deploy_file("network.yaml"), "ConfigMap");
        let data = maps[0].data.as_ref().expect("data");
        let text = &data["network.yaml"];
        let file = NetworkFile {
            path: std::env::temp_dir()
                .join(format!("dataplane-network-{}.yaml", std::process::id())),
            last: Mutex::new(None),
        };
        std::fs::write(&file.path, text).expect("write");
        assert!(file.changed());
        let configured = file.read();
        assert!(configured.rejected.is_empty(), "{:?}", configured.rejected);
        assert!(configured.network.is_some());
        let nets = |n: &[ipnet::IpNet]| n.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(nets(&configured.cluster_networks), ["10.244.0.0/16"]);
        assert_eq!(nets(&configured.service_networks), ["10.96.0.0/12"]);
        assert!(!file.changed(), "read once until it moves");
        // Unusable: named, and the networks stay unknown.
        std::fs::write(
            &file.path,
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n",
        )
        .expect("write");
        let configured = file.read();
        assert!(configured.network.is_none());
        assert!(
            configured
                .rejected
                .iter()
                .any(|r| r.contains("no operator.openshift.io/v1 Network in it")),
            "{:?}",
            configured.rejected
        );
        std::fs::remove_file(&file.path).expect("remove");
        assert!(file.read().rejected[0].contains("the cluster's networks are unknown"));

        let sets: Vec<DaemonSet> = objects(&deploy_file("daemonset.yaml"), "DaemonSet");
        let pod = sets[0]
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .expect("pod spec");
        let agent = &pod.containers[0];
        let args = agent.args.as_deref().unwrap_or_default();
        let path = args
            .iter()
            .find_map(|a| a.strip_prefix("--network-config="))
            .expect("--network-config");
        let mount = agent
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| path.starts_with(&format!("{}/", m.mount_path)))
            .expect("a mount holding the file");
        let volume = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == mount.name)
            .expect("volume");
        let config_map = volume.config_map.as_ref().expect("a ConfigMap volume");
        assert_eq!(config_map.name, "dataplane-network");
        assert_eq!(config_map.optional, Some(true));
        assert_eq!(
            path.strip_prefix(&format!("{}/", mount.mount_path)),
            Some("network.yaml"),
            "the key the ConfigMap has"
        );
    }

    #[test]
    fn the_daemonset_runs_a_host_network_agent_with_capabilities_and_bpffs_on_every_node() {
        let sets: Vec<DaemonSet> = objects(&deploy_file("daemonset.yaml"), "DaemonSet");
        let pod = sets[0]
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .expect("pod spec");
        assert_eq!(pod.host_network, Some(true));
        assert_eq!(pod.service_account_name.as_deref(), Some("dataplane-agent"));
        let tolerations = pod.tolerations.as_deref().unwrap_or_default();
        assert!(
            tolerations
                .iter()
                .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()),
            "tolerates every taint"
        );
        // The agent: capabilities, every other one dropped, never privileged; its sysctls
        // through the host's /proc/sys/net (its own /proc/sys is read-only).
        let agent = &pod.containers[0];
        let context = agent.security_context.as_ref().expect("security context");
        assert_eq!(context.privileged, Some(false));
        assert_eq!(context.allow_privilege_escalation, Some(false));
        let capabilities = context.capabilities.as_ref().expect("capabilities");
        assert_eq!(capabilities.drop.as_deref(), Some(&["ALL".to_owned()][..]));
        assert_eq!(
            capabilities.add.clone().unwrap_or_default(),
            [
                "BPF",
                "PERFMON",
                "SYS_ADMIN",
                "NET_ADMIN",
                "NET_RAW",
                "SYS_RESOURCE",
                "SYS_PTRACE"
            ]
        );
        let args = agent.args.as_deref().unwrap_or_default();
        assert!(args.iter().any(|a| a == "--kubernetes"), "{args:?}");
        assert!(
            args.iter().any(|a| a == "--proc-sys-dir=/host/proc/sys"),
            "{args:?}"
        );
        let mounts: Vec<(&str, Option<&str>)> = agent
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| (m.mount_path.as_str(), m.mount_propagation.as_deref()))
            .collect();
        assert!(
            mounts.contains(&("/sys/fs/bpf", Some("HostToContainer"))),
            "{mounts:?}"
        );
        assert!(mounts.iter().any(|(path, _)| *path == "/host/proc/sys/net"));
        // The one privileged step: the pin root on the host's bpf filesystem.
        let inits = pod.init_containers.as_deref().unwrap_or_default();
        let prepare = &inits[0];
        assert_eq!(
            prepare.args.as_deref().unwrap_or_default(),
            ["prepare-pins", "--pin-root=/sys/fs/bpf/dataplane"]
        );
        assert_eq!(
            prepare.security_context.as_ref().and_then(|s| s.privileged),
            Some(true)
        );
        assert!(args.iter().any(|a| a == "--pin-root=/sys/fs/bpf/dataplane"));
        assert!(mounts.iter().any(|(path, _)| *path == "/sys"));
        let host_paths: Vec<&str> = pod
            .volumes
            .iter()
            .flatten()
            .filter_map(|v| v.host_path.as_ref().map(|h| h.path.as_str()))
            .collect();
        assert!(host_paths.contains(&"/sys/fs/bpf") && host_paths.contains(&"/sys"));
        // It is the network plugin: the init container installs the plugin into the host's
        // /opt/cni/bin; the agent writes the configuration into the host's /etc/cni/net.d,
        // keeps the allocations on the host's disk and sees the pods' namespaces.
        assert_eq!(pod.host_pid, Some(true));
        let init = &pod.init_containers.as_deref().unwrap_or_default()[1];
        let init_args = init.args.as_deref().unwrap_or_default();
        assert_eq!(init_args, ["install-cni", "--bin-dir=/host/opt/cni/bin"]);
        let mounted_from = |container: &k8s_openapi::api::core::v1::Container, path: &str| {
            let mount = container
                .volume_mounts
                .iter()
                .flatten()
                .find(|m| m.mount_path == path)?;
            pod.volumes
                .iter()
                .flatten()
                .find(|v| v.name == mount.name)?
                .host_path
                .as_ref()
                .map(|h| h.path.clone())
        };
        assert_eq!(
            mounted_from(init, "/host/opt/cni/bin").as_deref(),
            Some("/opt/cni/bin")
        );
        assert!(
            args.iter()
                .any(|a| a == "--cni-conf-dir=/host/etc/cni/net.d")
        );
        assert_eq!(
            mounted_from(agent, "/host/etc/cni/net.d").as_deref(),
            Some("/etc/cni/net.d")
        );
        assert!(
            args.iter()
                .any(|a| a == "--ipam-file=/var/lib/dataplane/ipam.json")
        );
        assert_eq!(
            mounted_from(agent, "/var/lib/dataplane").as_deref(),
            Some("/var/lib/dataplane")
        );
        assert_eq!(
            mounted_from(agent, "/run/netns").as_deref(),
            Some("/run/netns")
        );
        assert_eq!(
            mounted_from(agent, "/run/dataplane").as_deref(),
            Some("/run/dataplane")
        );
        // The ServiceAccount and binding it names exist.
        let rbac = deploy_file("rbac.yaml");
        assert!(rbac.contains("kind: ServiceAccount\nmetadata:\n  name: dataplane-agent"));
    }
}
