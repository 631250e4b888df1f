//! The API server source: one kube-rs watcher per watched resource, with backoff, feeding a
//! reflector store. A sync reads a snapshot of all stores into the same [`ClusterState`] the
//! manifest directory gives, through the same per-object parsing and validation, so an object
//! that fails it is named and skipped exactly as from a file.
//!
//! Objects are watched untyped (`DynamicObject`): a typed watcher fails its whole list when one
//! object does not decode, and that one bad object must not stop the others from applying. A
//! lost connection means the watcher backs off and re-lists while the stores (and the maps)
//! keep the last good state; the re-list marks the source changed, which brings a full resync.

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
    api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams},
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{
        WatchStreamExt as _,
        reflector::{self, ObjectRef, Store, store::Writer},
        watcher,
    },
};
use tokio::sync::Notify;

use crate::source::{self, ClusterState};

/// One resource the agent watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Watched {
    pub group: &'static str,
    pub version: &'static str,
    pub kind: &'static str,
    pub plural: &'static str,
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
        optional: false,
    },
    Watched {
        group: "networking.k8s.io",
        version: "v1",
        kind: "NetworkPolicy",
        plural: "networkpolicies",
        optional: false,
    },
    Watched {
        group: "k8s.ovn.org",
        version: "v1",
        kind: "EgressFirewall",
        plural: "egressfirewalls",
        optional: true,
    },
    Watched {
        group: "k8s.ovn.org",
        version: "v1",
        kind: "EgressIP",
        plural: "egressips",
        optional: true,
    },
    Watched {
        group: "policy.networking.k8s.io",
        version: "v1alpha1",
        kind: "AdminNetworkPolicy",
        plural: "adminnetworkpolicies",
        optional: true,
    },
    Watched {
        group: "policy.networking.k8s.io",
        version: "v1alpha1",
        kind: "BaselineAdminNetworkPolicy",
        plural: "baselineadminnetworkpolicies",
        optional: true,
    },
    Watched {
        group: "policy.networking.k8s.io",
        version: "v1alpha2",
        kind: "ClusterNetworkPolicy",
        plural: "clusternetworkpolicies",
        optional: true,
    },
    Watched {
        group: "operator.openshift.io",
        version: "v1",
        kind: "Network",
        plural: "networks",
        optional: true,
    },
];

const fn core(kind: &'static str, plural: &'static str) -> Watched {
    Watched {
        group: "",
        version: "v1",
        kind,
        plural,
        optional: false,
    }
}

impl Watched {
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

/// The watchers' stores and what they have seen.
pub struct KubeSource {
    client: Client,
    /// When the first watch event no snapshot has taken yet came.
    first: source::FirstChange,
    stores: Vec<(Watched, Store<DynamicObject>)>,
    /// Optional resources the API server does not serve.
    absent: Arc<Mutex<BTreeSet<&'static str>>>,
    changed: Arc<AtomicBool>,
    /// A watcher listed its resource again since the last [`Self::take_relisted`].
    relisted: Arc<AtomicBool>,
    /// Each object as last parsed, by resource, namespace and name, with its resource
    /// version, and the cluster state they make: a snapshot parses and places only what the
    /// watches said changed since the last one.
    parsed: Mutex<source::ObjectCache>,
    /// The objects the watch events named since the last snapshot.
    touched: Touched,
    /// A watcher received its resource's whole list since the last snapshot: the next one
    /// looks at every object of the stores (a list brings no event per object).
    listed: Arc<AtomicBool>,
    /// Woken at every change (a permit is kept when nobody waits, so none is lost).
    wake: Arc<Notify>,
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
        let absent = Arc::new(Mutex::new(BTreeSet::new()));
        let changed = Arc::new(AtomicBool::new(true));
        let relisted = Arc::new(AtomicBool::new(false));
        let first = source::FirstChange::default();
        let wake = Arc::new(Notify::new());
        let touched = Touched::default();
        let listed = Arc::new(AtomicBool::new(true));
        let mut stores = Vec::new();
        for &watched in WATCHED {
            let resource = watched.api_resource();
            let writer = Writer::new(resource.clone());
            stores.push((watched, writer.as_reader()));
            let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
            tokio::spawn(follow(
                watched,
                api,
                writer,
                Arc::clone(&absent),
                Flag {
                    changed: Arc::clone(&changed),
                    touched: touched.clone(),
                    listed: Arc::clone(&listed),
                    relisted: Arc::clone(&relisted),
                    wake: Arc::clone(&wake),
                    first: first.clone(),
                },
            ));
        }
        Self {
            client: client.clone(),
            stores,
            absent,
            changed,
            relisted,
            parsed: Mutex::new(source::ObjectCache::default()),
            touched,
            listed,
            wake,
            first,
        }
    }

    /// Sets `annotations` on the Node `node` (a merge patch: other annotations stay). The
    /// agent's only write: what the hybrid overlay's other end reads (`crate::hybrid`).
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

    /// Waits until every store holds its first full list (or its resource proved absent),
    /// so that the first sync never applies a partial cluster: an agent taking over pinned
    /// maps must not drop, say, the firewalls because their list came late.
    pub async fn wait_ready(&self) {
        let mut next_report = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let pending: Vec<&str> = self
                .stores
                .iter()
                .filter(|(w, store)| !self.is_absent(w) && !is_ready(store))
                .map(|(w, _)| w.plural)
                .collect();
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
        self.first.take()
    }

    /// Whether a watcher listed its resource again (a lost watch, a 410 Gone) since the last
    /// call: the agent then runs a full recompute.
    pub fn take_relisted(&self) -> bool {
        self.relisted.swap(false, Ordering::AcqRel)
    }

    /// Whether anything changed since the last [`Self::snapshot`].
    pub fn changed(&self) -> bool {
        self.changed.load(Ordering::Acquire)
    }

    /// Returns once something changed (possibly before the last snapshot: check
    /// [`Self::changed`]).
    pub async fn wait_changed(&self) {
        self.wake.notified().await;
    }

    /// The cluster as the stores hold it now, through the manifest source's parsing. Only the
    /// objects the watch events named since the last snapshot are looked up, parsed (once per
    /// resource version) and placed; after a watcher received a whole list, every object of
    /// the stores is looked at (parsed again only where its version moved); `fresh` parses
    /// every object anew (a full recompute).
    pub fn snapshot(&self, fresh: bool) -> ClusterState {
        self.changed.store(false, Ordering::Release);
        let mut parsed = self.parsed.lock().unwrap_or_else(|e| e.into_inner());
        // Taken before the stores are read: an event after this is in the next snapshot.
        let touched = self.touched.take();
        let listed = self.listed.swap(false, Ordering::AcqRel);
        if fresh {
            parsed.clear();
        }
        if fresh || listed {
            let mut seen = BTreeSet::new();
            for (watched, store) in &self.stores {
                for object in store.state() {
                    let key = object_key(watched, &object);
                    let version = object.metadata.resource_version.clone();
                    parsed.put(key.clone(), version, || parse_object(watched, &object));
                    seen.insert(key);
                }
            }
            parsed.retain(|key| seen.contains(key));
            return parsed.assemble();
        }
        for key in touched {
            let Some((watched, store)) = self.stores.iter().find(|(w, _)| w.plural == key.0) else {
                continue;
            };
            let mut reference = ObjectRef::new_with(&key.2, watched.api_resource());
            if !key.1.is_empty() {
                reference = reference.within(&key.1);
            }
            match store.get(&reference) {
                Some(object) => {
                    let version = object.metadata.resource_version.clone();
                    parsed.put(key, version, || parse_object(watched, &object));
                }
                None => parsed.remove(&key),
            }
        }
        parsed.assemble()
    }

    fn is_absent(&self, watched: &Watched) -> bool {
        self.absent
            .lock()
            .map(|a| a.contains(watched.plural))
            .unwrap_or(false)
    }
}

/// The objects watch events named, by resource, namespace and name.
#[derive(Clone, Debug, Default)]
struct Touched(Arc<Mutex<BTreeSet<source::ObjectKey>>>);

impl Touched {
    fn note(&self, watched: &Watched, object: &DynamicObject) {
        let mut keys = self.0.lock().unwrap_or_else(|e| e.into_inner());
        keys.insert(object_key(watched, object));
    }

    fn take(&self) -> BTreeSet<source::ObjectKey> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// A watched object's resource, namespace (empty for a cluster-scoped one) and name.
fn object_key(watched: &Watched, object: &DynamicObject) -> source::ObjectKey {
    (
        watched.plural,
        object.metadata.namespace.clone().unwrap_or_default(),
        object.metadata.name.clone().unwrap_or_default(),
    )
}

/// One watched object through the manifest source's checks, decoded from its JSON.
fn parse_object(watched: &Watched, object: &DynamicObject) -> ClusterState {
    parse_watched(watched.plural, &watched.api_version(), watched.kind, object)
}

/// A watched object of resource `plural` (`apiVersion`, `kind`) decoded into the cluster state
/// as the API source does: its JSON straight into its type. Public for the scale benchmark.
pub fn parse_watched(
    plural: &str,
    api_version: &str,
    kind: &str,
    object: &DynamicObject,
) -> ClusterState {
    let mut state = ClusterState::default();
    let Ok(mut value) = serde_json::to_value(object) else {
        return state;
    };
    // List items come without their type; the resource says what they are.
    if let Some(map) = value.as_object_mut() {
        map.insert("apiVersion".into(), api_version.into());
        map.insert("kind".into(), kind.into());
    }
    source::add_object(&mut state, &format!("api:{plural}"), value);
    state
}

fn is_ready(store: &Store<DynamicObject>) -> bool {
    futures_util::FutureExt::now_or_never(store.wait_until_ready()).is_some()
}

/// How a watcher says the cluster changed.
struct Flag {
    changed: Arc<AtomicBool>,
    /// The objects added, modified or deleted since the last snapshot took them.
    touched: Touched,
    /// Raised when a watcher has its resource's whole list (the first or again).
    listed: Arc<AtomicBool>,
    /// Raised when a watcher lists its resource again (after a lost watch).
    relisted: Arc<AtomicBool>,
    wake: Arc<Notify>,
    first: source::FirstChange,
}

impl Flag {
    fn raise(&self) {
        self.first.note();
        self.changed.store(true, Ordering::Release);
        self.wake.notify_one();
    }
}

/// kubectl's copy of the object as last applied (`kubectl apply`).
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Runs one resource's watcher into its store for as long as the runtime runs, marking the
/// source changed on every event. Errors are logged and retried with backoff; an optional
/// resource the server does not serve (404) counts as empty.
async fn follow(
    watched: Watched,
    api: Api<DynamicObject>,
    writer: Writer<DynamicObject>,
    absent: Arc<Mutex<BTreeSet<&'static str>>>,
    changed: Flag,
) {
    // The store keeps each object as its JSON; the field managers' bookkeeping and kubectl's
    // copy of the last applied object are read by nothing here and often are most of it.
    let stream = reflector::reflector(
        writer,
        watcher(api, watcher::Config::default())
            .default_backoff()
            .modify(|object| {
                object.metadata.managed_fields = None;
                if let Some(annotations) = &mut object.metadata.annotations {
                    annotations.remove(LAST_APPLIED);
                }
            }),
    );
    let mut stream = std::pin::pin!(stream);
    let mut failing = false;
    let mut listed = false;
    while let Some(event) = stream.next().await {
        match event {
            Ok(event) => {
                // The reflector has applied the event to the store: the next snapshot finds it
                // there. A relist's objects are taken whole by the full recompute it causes.
                if let watcher::Event::Apply(object) | watcher::Event::Delete(object) = &event {
                    changed.touched.note(&watched, object);
                }
                if let watcher::Event::InitDone = event {
                    changed.listed.store(true, Ordering::Release);
                    if listed {
                        tracing::info!(
                            resource = watched.plural,
                            "listed again; a full recompute follows"
                        );
                        changed.relisted.store(true, Ordering::Release);
                    }
                    listed = true;
                }
                if failing {
                    tracing::info!(resource = watched.plural, "watch restored");
                    failing = false;
                }
                changed.raise();
            }
            Err(watcher::Error::InitialListFailed(kube::Error::Api(status)))
                if watched.optional && status.code == 404 =>
            {
                let newly = absent
                    .lock()
                    .map(|mut a| a.insert(watched.plural))
                    .unwrap_or(false);
                if newly {
                    changed.raise();
                    tracing::info!(
                        resource = watched.plural,
                        "not served by this API server (CRD not installed); taken as empty"
                    );
                }
            }
            Err(error) => {
                if !failing {
                    tracing::warn!(resource = watched.plural, %error, "watch failed; retrying with backoff, the maps keep the last good state");
                }
                failing = true;
            }
        }
    }
}

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
        let good: DynamicObject = serde_json::from_str(
            r#"{"metadata": {"name": "web", "namespace": "shop", "resourceVersion": "7"},
                "spec": {"nodeName": "node0", "containers": [{"name": "app"}]},
                "status": {"podIP": "10.244.1.5"}}"#,
        )
        .expect("object");
        let state = parse_watched("pods", "v1", "Pod", &good);
        assert!(state.rejected.is_empty(), "{:?}", state.rejected);
        assert_eq!(state.pods.len(), 1);
        let pod = &state.pods[0];
        assert_eq!(pod.metadata.namespace.as_deref(), Some("shop"));
        assert_eq!(
            pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
            Some("node0")
        );
        let bad: DynamicObject =
            serde_json::from_str(r#"{"metadata": {"name": "web"}, "spec": {"containers": "app"}}"#)
                .expect("object");
        let state = parse_watched("pods", "v1", "Pod", &bad);
        assert!(state.pods.is_empty());
        assert_eq!(state.rejected.len(), 1);
        let rejected = &state.rejected[0];
        assert!(
            rejected.starts_with("api:pods: Pod web: invalid type: string \"app\""),
            "{rejected}"
        );
    }

    #[test]
    fn the_cluster_role_reads_exactly_the_watched_resources_and_patches_only_nodes() {
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
                        verbs => panic!("unexpected verbs {verbs:?}"),
                    };
                }
            }
        }
        // Its one write: its own Node's hybrid overlay annotations.
        assert_eq!(
            written,
            BTreeSet::from([(String::new(), "nodes".to_owned())])
        );
        let watched: BTreeSet<(String, String)> = WATCHED
            .iter()
            .map(|w| (w.group.to_owned(), w.plural.to_owned()))
            .collect();
        assert_eq!(granted, watched);
    }

    #[test]
    fn the_controller_reads_what_the_agents_read_and_writes_only_egressip_status_and_its_lease() {
        let text = deploy_file("controller.yaml");
        let roles: Vec<ClusterRole> = objects(&text, "ClusterRole");
        let mut read = BTreeSet::new();
        let mut written = BTreeSet::new();
        for rule in roles[0].rules.iter().flatten() {
            for group in rule.api_groups.iter().flatten() {
                for resource in rule.resources.iter().flatten() {
                    let entry = (group.clone(), resource.clone());
                    match rule.verbs.as_slice() {
                        [list, watch] if list == "list" && watch == "watch" => read.insert(entry),
                        [patch] if patch == "patch" => written.insert(entry),
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
            BTreeSet::from([("k8s.ovn.org".to_owned(), "egressips/status".to_owned())])
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
        // It probes the agents where the DaemonSet serves their metrics.
        assert!(args.iter().any(|a| a == "--probe-port=9476"), "{args:?}");
        assert!(deploy_file("daemonset.yaml").contains("--metrics-address=0.0.0.0:9476"));
    }

    #[test]
    fn the_daemonset_runs_a_privileged_host_network_agent_with_bpffs_on_every_node() {
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
        let agent = &pod.containers[0];
        assert_eq!(
            agent.security_context.as_ref().and_then(|s| s.privileged),
            Some(true)
        );
        let args = agent.args.as_deref().unwrap_or_default();
        assert!(args.iter().any(|a| a == "--kubernetes"), "{args:?}");
        let mounts: Vec<(&str, Option<&str>)> = agent
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| (m.mount_path.as_str(), m.mount_propagation.as_deref()))
            .collect();
        assert!(
            mounts.contains(&("/sys/fs/bpf", Some("Bidirectional"))),
            "{mounts:?}"
        );
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
        let init = &pod.init_containers.as_deref().unwrap_or_default()[0];
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
