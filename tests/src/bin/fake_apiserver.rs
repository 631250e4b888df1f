//! A stand-in Kubernetes API server for the agent's API source tests: it serves the objects of
//! a directory of YAML manifests over the API's list and watch protocol (JSON lists with a
//! resourceVersion; newline-delimited ADDED/MODIFIED/DELETED watch events), and turns every
//! change to the directory into watch events. Plain HTTP on the address given (tests bind it
//! to loopback inside a node's network namespace).
//!
//! Writes: an EgressIP's status (`PATCH .../egressips/NAME/status`, a JSON merge patch of
//! `status`; kept over what the files say, as the API server keeps status apart from spec;
//! served as the other objects written by path, below) and `coordination.k8s.io/v1` Leases (get, create, replace with optimistic concurrency on
//! the resourceVersion), for the egress IP controller; a Node's annotations (`PATCH
//! /api/v1/nodes/NAME`, a JSON merge patch of `metadata.annotations`, kept over the files'),
//! for the agent's hybrid overlay annotations; `events.k8s.io/v1` Events (create and merge
//! patch under `/apis/events.k8s.io/v1/namespaces/NS/events`, listed at
//! `/apis/events.k8s.io/v1/events`), for the agent's refusals; for the controller's egress
//! routers and the user-defined networks' status, objects by path (`GET`, a server-side apply `PATCH` that creates or
//! replaces what the one manager applies, a merge `PATCH` of `.../status`; served in the lists
//! and watches like the files' objects, kept over them), and a Deployment's generation
//! counted up when its spec changes.
//!
//! As a real server does to its clients, on request (flags): lists in pages with `continue`
//! tokens whatever `limit` the client asks, a history compacted to its newest events (a watch
//! from a version it no longer has gets 410 Gone, as does one from before the server
//! started), watches ended after a timeout, and BOOKMARK events for clients that allow them.
//!
//! It is written from the API conventions, not from the agent's code, so that the agent's kube
//! watchers are checked against an independent server. Resource versions start at the
//! current time in milliseconds, so a restarted server never goes back in time.

use std::{
    collections::BTreeMap,
    convert::Infallible,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use clap::Parser;
use http_body_util::{BodyExt as _, Full, StreamBody, combinators::BoxBody};
use hyper::{
    Request, Response, StatusCode,
    body::{Bytes, Frame},
    service::service_fn,
};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::sync::broadcast;

#[derive(Parser)]
struct Args {
    /// Directory of YAML manifests to serve.
    #[arg(long)]
    manifests: PathBuf,
    /// Address to listen on.
    #[arg(long)]
    listen: SocketAddr,
    /// At most this many items per list page, whatever `limit` the client asks (the real
    /// server may return fewer): the rest follows with `continue` tokens.
    #[arg(long)]
    page_limit: Option<usize>,
    /// Keep only the newest this many events: a watch from an older version gets 410 Gone,
    /// as after etcd's compaction, and the client must list anew.
    #[arg(long)]
    history_limit: Option<usize>,
    /// End every watch after this many seconds (the real server ends them after its
    /// `--min-request-timeout`, or the client's `timeoutSeconds`): the client watches again
    /// from the last version it saw.
    #[arg(long)]
    watch_timeout_seconds: Option<u64>,
    /// Send a BOOKMARK (the current resource version) this often on watches that allow them.
    #[arg(long)]
    bookmark_every_ms: Option<u64>,
}

/// The settings of the behaviours above, as the handlers read them.
#[derive(Clone, Copy, Debug, Default)]
struct Behaviour {
    page_limit: Option<usize>,
    history_limit: Option<usize>,
    watch_timeout: Option<Duration>,
    bookmark_every: Option<Duration>,
}

/// The resources served: URL path (cluster-wide list), apiVersion, kind.
const RESOURCES: &[(&str, &str, &str)] = &[
    ("/api/v1/nodes", "v1", "Node"),
    ("/api/v1/pods", "v1", "Pod"),
    ("/api/v1/namespaces", "v1", "Namespace"),
    ("/api/v1/services", "v1", "Service"),
    (
        "/apis/discovery.k8s.io/v1/endpointslices",
        "discovery.k8s.io/v1",
        "EndpointSlice",
    ),
    (
        "/apis/networking.k8s.io/v1/networkpolicies",
        "networking.k8s.io/v1",
        "NetworkPolicy",
    ),
    (
        "/apis/k8s.ovn.org/v1/egressfirewalls",
        "k8s.ovn.org/v1",
        "EgressFirewall",
    ),
    (
        "/apis/k8s.ovn.org/v1/egressips",
        "k8s.ovn.org/v1",
        "EgressIP",
    ),
    (
        "/apis/operator.openshift.io/v1/networks",
        "operator.openshift.io/v1",
        "Network",
    ),
    (
        "/apis/config.openshift.io/v1/networks",
        "config.openshift.io/v1",
        "Network",
    ),
    (
        "/apis/network.operator.openshift.io/v1/egressrouters",
        "network.operator.openshift.io/v1",
        "EgressRouter",
    ),
    (
        "/apis/k8s.ovn.org/v1/userdefinednetworks",
        "k8s.ovn.org/v1",
        "UserDefinedNetwork",
    ),
    (
        "/apis/k8s.ovn.org/v1/clusteruserdefinednetworks",
        "k8s.ovn.org/v1",
        "ClusterUserDefinedNetwork",
    ),
];

/// The resources written by path: (path prefix, plural, apiVersion, kind, namespaced).
const WRITABLE: &[(&str, &str, &str, &str, bool)] = &[
    (
        "/apis/apps/v1",
        "deployments",
        "apps/v1",
        "Deployment",
        true,
    ),
    ("/api/v1", "services", "v1", "Service", true),
    (
        "/apis/k8s.cni.cncf.io/v1",
        "network-attachment-definitions",
        "k8s.cni.cncf.io/v1",
        "NetworkAttachmentDefinition",
        true,
    ),
    (
        "/apis/network.operator.openshift.io/v1",
        "egressrouters",
        "network.operator.openshift.io/v1",
        "EgressRouter",
        true,
    ),
    (
        "/apis/k8s.ovn.org/v1",
        "egressips",
        "k8s.ovn.org/v1",
        "EgressIP",
        false,
    ),
    (
        "/apis/k8s.ovn.org/v1",
        "userdefinednetworks",
        "k8s.ovn.org/v1",
        "UserDefinedNetwork",
        true,
    ),
    (
        "/apis/k8s.ovn.org/v1",
        "clusteruserdefinednetworks",
        "k8s.ovn.org/v1",
        "ClusterUserDefinedNetwork",
        false,
    ),
];

/// (apiVersion, kind, namespace, name)
type ObjectKey = (String, String, String, String);

#[derive(Clone, Debug)]
struct Event {
    resource_version: u64,
    api_version: String,
    kind: String,
    kind_of_event: &'static str,
    object: Value,
}

struct State {
    /// The first resource version this server handed out: older ones are unknown to it.
    first_version: u64,
    /// Events up to this version were dropped from the history (compacted).
    compacted: u64,
    behaviour: Behaviour,
    /// Statuses written through the API, over the files' objects.
    statuses: BTreeMap<ObjectKey, Value>,
    /// Objects made through the API (server-side apply), served beside the files' objects.
    applied: BTreeMap<ObjectKey, Value>,
    /// Annotations written through the API, merged over the files' objects.
    annotations: BTreeMap<ObjectKey, serde_json::Map<String, Value>>,
    /// Leases by (namespace, name).
    leases: BTreeMap<(String, String), Value>,
    /// `events.k8s.io/v1` Events by (namespace, name).
    kube_events: BTreeMap<(String, String), Value>,
    resource_version: u64,
    objects: BTreeMap<ObjectKey, Value>,
    history: Vec<Event>,
    events: broadcast::Sender<Event>,
}

type Shared = Arc<Mutex<State>>;

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let start = SystemTime::now()
        .duration_since(UNIX_EPOCH)?
        .as_millis()
        .try_into()?;
    let (events, _) = broadcast::channel(4096);
    let behaviour = Behaviour {
        page_limit: args.page_limit,
        history_limit: args.history_limit,
        watch_timeout: args.watch_timeout_seconds.map(Duration::from_secs),
        bookmark_every: args.bookmark_every_ms.map(Duration::from_millis),
    };
    let state = Arc::new(Mutex::new(State {
        first_version: start + 1,
        compacted: 0,
        behaviour,
        statuses: BTreeMap::new(),
        applied: BTreeMap::new(),
        annotations: BTreeMap::new(),
        leases: BTreeMap::new(),
        kube_events: BTreeMap::new(),
        resource_version: start,
        objects: BTreeMap::new(),
        history: Vec::new(),
        events,
    }));
    reload(&state, &args.manifests);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let watcher_state = Arc::clone(&state);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            reload(&watcher_state, &args.manifests);
            compact(&watcher_state);
        }
    });
    loop {
        let (stream, _) = listener.accept().await?;
        let state = Arc::clone(&state);
        tokio::spawn(async move {
            let service = service_fn(move |request| answer(request, Arc::clone(&state)));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Drops the oldest events past `--history-limit`, remembering the newest version dropped.
fn compact(state: &Shared) {
    let Ok(mut state) = state.lock() else {
        return;
    };
    let Some(limit) = state.behaviour.history_limit else {
        return;
    };
    let excess = state.history.len().saturating_sub(limit);
    if excess > 0 {
        let dropped: Vec<Event> = state.history.drain(..excess).collect();
        if let Some(last) = dropped.last() {
            state.compacted = state.compacted.max(last.resource_version);
        }
    }
}

/// Reads the directory and turns differences from the served objects into events.
fn reload(state: &Shared, dir: &Path) {
    let Some(mut current) = read_objects(dir) else {
        return;
    };
    let Ok(mut state) = state.lock() else {
        return;
    };
    for (key, object) in &state.applied {
        current.insert(key.clone(), object.clone());
    }
    for (key, status) in &state.statuses {
        if let Some(object) = current.get_mut(key) {
            object["status"] = status.clone();
        }
    }
    for (key, annotations) in &state.annotations {
        if let Some(object) = current.get_mut(key) {
            merge_annotations(object, annotations);
        }
    }
    let mut changes = Vec::new();
    for (key, object) in &current {
        match state.objects.get(key) {
            None => changes.push(("ADDED", key.clone(), object.clone())),
            Some(old) if !same_but_version(old, object) => {
                changes.push(("MODIFIED", key.clone(), object.clone()))
            }
            Some(_) => {}
        }
    }
    for (key, old) in &state.objects {
        if !current.contains_key(key) {
            changes.push(("DELETED", key.clone(), old.clone()));
        }
    }
    for (kind_of_event, key, mut object) in changes {
        state.resource_version += 1;
        let resource_version = state.resource_version;
        object["metadata"]["resourceVersion"] = json!(resource_version.to_string());
        if kind_of_event == "DELETED" {
            state.objects.remove(&key);
        } else {
            state.objects.insert(key.clone(), object.clone());
        }
        let event = Event {
            resource_version,
            api_version: key.0,
            kind: key.1,
            kind_of_event,
            object,
        };
        state.history.push(event.clone());
        let _ = state.events.send(event);
    }
}

/// Whether a served object (which carries a resourceVersion) is `file`'s object.
fn same_but_version(served: &Value, file: &Value) -> bool {
    let mut served = served.clone();
    if let Some(metadata) = served["metadata"].as_object_mut() {
        metadata.remove("resourceVersion");
    }
    &served == file
}

/// Every object of the directory by key, without resource versions (so that unchanged files
/// compare equal); None when the directory cannot be read.
fn read_objects(dir: &Path) -> Option<BTreeMap<ObjectKey, Value>> {
    let mut objects = BTreeMap::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    for file in files {
        let text = std::fs::read_to_string(&file).ok()?;
        for document in serde_yaml::Deserializer::from_str(&text) {
            // A syntax fault leaves serde_yaml yielding the same error for ever: the rest
            // of that file is skipped (as a real API server refuses what does not parse).
            let Ok(value) = serde::Deserialize::deserialize(document) else {
                eprintln!(
                    "fake_apiserver: {}: not YAML; the rest of it is skipped",
                    file.display()
                );
                break;
            };
            let value: Value = value;
            let field = |v: &Value, k: &str| v[k].as_str().unwrap_or_default().to_owned();
            let metadata = &value["metadata"];
            let key = (
                field(&value, "apiVersion"),
                field(&value, "kind"),
                field(metadata, "namespace"),
                field(metadata, "name"),
            );
            objects.insert(key, value);
        }
    }
    // Objects stored in the served form, resource version aside.
    let with_versions = objects
        .into_iter()
        .map(|(key, mut value)| {
            if let Some(metadata) = value["metadata"].as_object_mut() {
                metadata.remove("resourceVersion");
            }
            (key, value)
        })
        .collect();
    Some(with_versions)
}

type Body = BoxBody<Bytes, Infallible>;

async fn answer(
    request: Request<hyper::body::Incoming>,
    state: Shared,
) -> Result<Response<Body>, Infallible> {
    let path = request.uri().path().to_owned();
    let query: BTreeMap<String, String> = request
        .uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    if let Some(rest) = path.strip_prefix("/apis/events.k8s.io/v1/namespaces/") {
        let method = request.method().clone();
        let body = read_body(request).await;
        return Ok(kube_event(&state, &method, rest, body));
    }
    if path == "/apis/events.k8s.io/v1/events" {
        let Ok(state) = state.lock() else {
            return Ok(status(StatusCode::INTERNAL_SERVER_ERROR, "poisoned"));
        };
        let items: Vec<Value> = state.kube_events.values().cloned().collect();
        let list = json!({
            "apiVersion": "events.k8s.io/v1",
            "kind": "EventList",
            "metadata": {"resourceVersion": state.resource_version.to_string()},
            "items": items,
        });
        return Ok(json_response(StatusCode::OK, &list));
    }
    if let Some(rest) = path.strip_prefix("/apis/coordination.k8s.io/v1/namespaces/") {
        let method = request.method().clone();
        let body = read_body(request).await;
        return Ok(lease(&state, &method, rest, body));
    }
    if request.method() == hyper::Method::PATCH
        && let Some(name) = path.strip_prefix("/api/v1/nodes/")
    {
        let name = name.to_owned();
        let body = read_body(request).await;
        return Ok(patch_node(&state, &name, body));
    }
    if let Some((key, subresource)) = object_path(&path) {
        let method = request.method().clone();
        let apply = request
            .headers()
            .get(hyper::header::CONTENT_TYPE)
            .is_some_and(|t| t.as_bytes().starts_with(b"application/apply-patch"));
        let body = read_body(request).await;
        return Ok(write_object(&state, &method, key, subresource, apply, body));
    }
    let Some(&(_, api_version, kind)) = RESOURCES.iter().find(|(p, _, _)| *p == path) else {
        return Ok(status(StatusCode::NOT_FOUND, &format!("{path} not served")));
    };
    if query.get("watch").is_some_and(|w| w == "true" || w == "1") {
        let since = query
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let bookmarks = query
            .get("allowWatchBookmarks")
            .is_some_and(|b| b == "true" || b == "1");
        let timeout = query
            .get("timeoutSeconds")
            .and_then(|t| t.parse().ok())
            .map(Duration::from_secs);
        return Ok(watch(&state, api_version, kind, since, bookmarks, timeout));
    }
    let Ok(state) = state.lock() else {
        return Ok(status(StatusCode::INTERNAL_SERVER_ERROR, "poisoned"));
    };
    // A page: after the continue token's last key (at its list's version), at most the
    // smaller of the client's `limit` and `--page-limit` items.
    let (version, after) = match query.get("continue").map(|t| decode_continue(t)) {
        Some(Some((version, after))) => (version, Some(after)),
        Some(None) => return Ok(status(StatusCode::BAD_REQUEST, "bad continue token")),
        None => (state.resource_version, None),
    };
    let limit = [
        query
            .get("limit")
            .and_then(|l| l.parse::<usize>().ok())
            .filter(|l| *l > 0),
        state.behaviour.page_limit,
    ]
    .into_iter()
    .flatten()
    .min();
    let mut matching = state
        .objects
        .iter()
        .filter(|(key, _)| key.0 == api_version && key.1 == kind)
        .filter(|(key, _)| {
            after
                .as_ref()
                .is_none_or(|a| (&key.2, &key.3) > (&a.0, &a.1))
        });
    let mut items = Vec::new();
    let mut last = None;
    for (key, value) in matching.by_ref() {
        items.push(value.clone());
        last = Some((key.2.clone(), key.3.clone()));
        if limit.is_some_and(|l| items.len() >= l) {
            break;
        }
    }
    let more = limit.is_some_and(|l| items.len() >= l) && matching.next().is_some();
    let mut metadata = json!({"resourceVersion": version.to_string()});
    if more && let Some(last) = last {
        metadata["continue"] = json!(encode_continue(version, &last));
    }
    let list = json!({
        "apiVersion": api_version,
        "kind": format!("{kind}List"),
        "metadata": metadata,
        "items": items,
    });
    Ok(json_response(StatusCode::OK, &list))
}

/// A continue token: the list's version and the last key returned, as hex (URL-safe).
fn encode_continue(version: u64, last: &(String, String)) -> String {
    let text = json!([version, last.0, last.1]).to_string();
    text.bytes().map(|b| format!("{b:02x}")).collect()
}

fn decode_continue(token: &str) -> Option<(u64, (String, String))> {
    let bytes: Option<Vec<u8>> = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(token.get(i..i + 2)?, 16).ok())
        .collect();
    let value: Value = serde_json::from_slice(&bytes?).ok()?;
    Some((
        value[0].as_u64()?,
        (value[1].as_str()?.to_owned(), value[2].as_str()?.to_owned()),
    ))
}

async fn read_body(request: Request<hyper::body::Incoming>) -> Option<Value> {
    let bytes = request.into_body().collect().await.ok()?.to_bytes();
    serde_json::from_slice(&bytes).ok()
}

/// Stores a new version of `key`'s object and tells the watchers.
fn publish(state: &mut State, key: ObjectKey, mut object: Value) -> Value {
    state.resource_version += 1;
    let resource_version = state.resource_version;
    object["metadata"]["resourceVersion"] = json!(resource_version.to_string());
    state.objects.insert(key.clone(), object.clone());
    let event = Event {
        resource_version,
        api_version: key.0,
        kind: key.1,
        kind_of_event: "MODIFIED",
        object: object.clone(),
    };
    state.history.push(event.clone());
    let _ = state.events.send(event);
    object
}

/// The object a path names (`PREFIX/namespaces/NS/PLURAL/NAME[/status]`, or
/// `PREFIX/PLURAL/NAME[/status]` for a cluster-scoped resource), and whether it is the status
/// subresource.
fn object_path(path: &str) -> Option<(ObjectKey, bool)> {
    WRITABLE
        .iter()
        .find_map(|(prefix, plural, api_version, kind, namespaced)| {
            let rest = path.strip_prefix(prefix)?;
            let (namespace, rest) = if *namespaced {
                rest.strip_prefix("/namespaces/")?.split_once('/')?
            } else {
                ("", rest.strip_prefix('/')?)
            };
            let parts: Vec<&str> = rest.split('/').collect();
            let (name, subresource) = match parts.as_slice() {
                [p, name] if p == plural => (name, false),
                [p, name, "status"] if p == plural => (name, true),
                _ => return None,
            };
            let key = (
                (*api_version).to_owned(),
                (*kind).to_owned(),
                namespace.to_owned(),
                (*name).to_owned(),
            );
            Some((key, subresource))
        })
}

/// `GET` of an object; a server-side apply (the applied object replaces what the
/// one manager applied before, its status and generation kept, the generation counted up
/// when the spec changes); a merge patch of `status` on the status subresource.
fn write_object(
    state: &Shared,
    method: &hyper::Method,
    key: ObjectKey,
    subresource: bool,
    apply: bool,
    body: Option<Value>,
) -> Response<Body> {
    let Ok(mut state) = state.lock() else {
        return status(StatusCode::INTERNAL_SERVER_ERROR, "poisoned");
    };
    let current = state.objects.get(&key).cloned();
    let what = format!("{} {}/{}", key.1, key.2, key.3);
    match (method, subresource, current, body) {
        (&hyper::Method::GET, _, Some(object), _) => json_response(StatusCode::OK, &object),
        (&hyper::Method::GET, _, None, _) => {
            status(StatusCode::NOT_FOUND, &format!("{what} not found"))
        }
        (&hyper::Method::PATCH, _, _, None) => {
            status(StatusCode::BAD_REQUEST, "the body is not JSON")
        }
        (&hyper::Method::PATCH, false, current, Some(mut object)) if apply => {
            let generation = current
                .as_ref()
                .map_or(0, |c| c["metadata"]["generation"].as_i64().unwrap_or(0));
            let changed = current.as_ref().is_none_or(|c| c["spec"] != object["spec"]);
            object["metadata"]["generation"] = json!(generation + i64::from(changed));
            if let Some(status) = current.as_ref().map(|c| c["status"].clone())
                && !status.is_null()
            {
                object["status"] = status;
            }
            state.applied.insert(key.clone(), object.clone());
            let object = publish(&mut state, key, object);
            json_response(StatusCode::OK, &object)
        }
        (&hyper::Method::PATCH, true, Some(mut object), Some(patch)) => {
            object["status"] = patch["status"].clone();
            state.statuses.insert(key.clone(), patch["status"].clone());
            if let Some(applied) = state.applied.get_mut(&key) {
                applied["status"] = patch["status"].clone();
            }
            let object = publish(&mut state, key, object);
            json_response(StatusCode::OK, &object)
        }
        (&hyper::Method::PATCH, true, None, _) => {
            status(StatusCode::NOT_FOUND, &format!("{what} not found"))
        }
        _ => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET, a server-side apply and a status merge patch are served",
        ),
    }
}

/// Sets `annotations` (a JSON object) into `object`'s `metadata.annotations`; a null value
/// removes its key, as a merge patch does.
fn merge_annotations(object: &mut Value, annotations: &serde_json::Map<String, Value>) {
    if !object["metadata"]["annotations"].is_object() {
        object["metadata"]["annotations"] = json!({});
    }
    let Some(current) = object["metadata"]["annotations"].as_object_mut() else {
        return;
    };
    for (key, value) in annotations {
        if value.is_null() {
            current.remove(key);
        } else {
            current.insert(key.clone(), value.clone());
        }
    }
}

/// `PATCH /api/v1/nodes/NAME` with a merge patch of `metadata.annotations`.
fn patch_node(state: &Shared, name: &str, body: Option<Value>) -> Response<Body> {
    let Some(annotations) = body
        .as_ref()
        .and_then(|b| b["metadata"]["annotations"].as_object())
        .cloned()
    else {
        return status(
            StatusCode::BAD_REQUEST,
            "only a merge patch of metadata.annotations is served",
        );
    };
    let Ok(mut state) = state.lock() else {
        return status(StatusCode::INTERNAL_SERVER_ERROR, "poisoned");
    };
    let key: ObjectKey = ("v1".into(), "Node".into(), String::new(), name.to_owned());
    let Some(mut object) = state.objects.get(&key).cloned() else {
        return status(StatusCode::NOT_FOUND, &format!("nodes {name} not found"));
    };
    merge_annotations(&mut object, &annotations);
    state
        .annotations
        .entry(key.clone())
        .or_default()
        .extend(annotations);
    let object = publish(&mut state, key, object);
    json_response(StatusCode::OK, &object)
}

/// Events under `/apis/events.k8s.io/v1/namespaces/`: `rest` is `NS/events[/NAME]`; created
/// (a `generateName` completed) or merge-patched.
fn kube_event(
    state: &Shared,
    method: &hyper::Method,
    rest: &str,
    body: Option<Value>,
) -> Response<Body> {
    let parts: Vec<&str> = rest.split('/').collect();
    let Ok(mut state) = state.lock() else {
        return status(StatusCode::INTERNAL_SERVER_ERROR, "poisoned");
    };
    state.resource_version += 1;
    let version = state.resource_version;
    match (method, parts.as_slice(), body) {
        (&hyper::Method::POST, [namespace, "events"], Some(mut event)) => {
            let name = match event["metadata"]["name"].as_str() {
                Some(name) => name.to_owned(),
                None => format!(
                    "{}{version:x}",
                    event["metadata"]["generateName"]
                        .as_str()
                        .unwrap_or("event.")
                ),
            };
            event["metadata"]["name"] = json!(name);
            event["metadata"]["namespace"] = json!(namespace);
            event["metadata"]["resourceVersion"] = json!(version.to_string());
            state
                .kube_events
                .insert(((*namespace).to_owned(), name), event.clone());
            json_response(StatusCode::CREATED, &event)
        }
        (&hyper::Method::PATCH, [namespace, "events", name], Some(patch)) => {
            let key = ((*namespace).to_owned(), (*name).to_owned());
            let Some(event) = state.kube_events.get_mut(&key) else {
                return status(StatusCode::NOT_FOUND, &format!("events {name} not found"));
            };
            if let (Some(event), Some(patch)) = (event.as_object_mut(), patch.as_object()) {
                for (field, value) in patch {
                    event.insert(field.clone(), value.clone());
                }
            }
            let event = event.clone();
            json_response(StatusCode::OK, &event)
        }
        _ => status(StatusCode::METHOD_NOT_ALLOWED, &format!("{method} {rest}")),
    }
}

/// Leases under `/apis/coordination.k8s.io/v1/namespaces/`: `rest` is `NS/leases[/NAME]`.
fn lease(
    state: &Shared,
    method: &hyper::Method,
    rest: &str,
    body: Option<Value>,
) -> Response<Body> {
    let parts: Vec<&str> = rest.split('/').collect();
    let (namespace, name) = match parts.as_slice() {
        [namespace, "leases"] => (*namespace, None),
        [namespace, "leases", name] => (*namespace, Some(*name)),
        _ => return status(StatusCode::NOT_FOUND, &format!("{rest} not served")),
    };
    let Ok(mut state) = state.lock() else {
        return status(StatusCode::INTERNAL_SERVER_ERROR, "poisoned");
    };
    let key = |name: &str| (namespace.to_owned(), name.to_owned());
    match (method, name, body) {
        (&hyper::Method::GET, Some(name), _) => match state.leases.get(&key(name)) {
            Some(lease) => json_response(StatusCode::OK, lease),
            None => status(StatusCode::NOT_FOUND, &format!("leases {name} not found")),
        },
        (&hyper::Method::POST, None, Some(mut lease)) => {
            let name = lease["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            if state.leases.contains_key(&key(&name)) {
                return status(
                    StatusCode::CONFLICT,
                    &format!("leases {name} already exists"),
                );
            }
            state.resource_version += 1;
            lease["metadata"]["namespace"] = json!(namespace);
            lease["metadata"]["resourceVersion"] = json!(state.resource_version.to_string());
            state.leases.insert(key(&name), lease.clone());
            json_response(StatusCode::CREATED, &lease)
        }
        (&hyper::Method::PUT, Some(name), Some(mut lease)) => {
            let stored = state
                .leases
                .get(&key(name))
                .map(|l| l["metadata"]["resourceVersion"].clone());
            if stored != Some(lease["metadata"]["resourceVersion"].clone()) {
                return status(
                    StatusCode::CONFLICT,
                    &format!("leases {name}: the object has been modified"),
                );
            }
            state.resource_version += 1;
            lease["metadata"]["resourceVersion"] = json!(state.resource_version.to_string());
            state.leases.insert(key(name), lease.clone());
            json_response(StatusCode::OK, &lease)
        }
        _ => status(StatusCode::METHOD_NOT_ALLOWED, &format!("{method} {rest}")),
    }
}

/// A watch: events after `since` from the history, then live ones, one JSON object per line;
/// BOOKMARKs when the client allows them and `--bookmark-every-ms` is set; ended after the
/// shorter of the client's `timeoutSeconds` and `--watch-timeout-seconds`.
fn watch(
    state: &Shared,
    api_version: &'static str,
    kind: &'static str,
    since: u64,
    bookmarks: bool,
    timeout: Option<Duration>,
) -> Response<Body> {
    let (backlog, receiver, behaviour) = match state.lock() {
        // A version from before this server (e.g. a previous process) or compacted away: as
        // the API server does for versions it no longer has, answer 410 Gone, which makes a
        // client list anew.
        Ok(state) if since != 0 && (since < state.first_version || since < state.compacted) => {
            let gone = json!({"type": "ERROR", "object": {
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": format!("too old resource version: {since}"),
                "reason": "Expired", "code": 410,
            }});
            let mut line = serde_json::to_vec(&gone).unwrap_or_default();
            line.push(b'\n');
            return Response::new(Full::new(Bytes::from(line)).boxed());
        }
        Ok(state) => (
            state
                .history
                .iter()
                .filter(|e| e.resource_version > since)
                .cloned()
                .collect::<Vec<_>>(),
            state.events.subscribe(),
            state.behaviour,
        ),
        Err(_) => return status(StatusCode::INTERNAL_SERVER_ERROR, "poisoned"),
    };
    let matches = move |e: &Event| e.api_version == api_version && e.kind == kind;
    let backlog: Vec<Event> = backlog.into_iter().filter(|e| matches(e)).collect();
    let ends = [timeout, behaviour.watch_timeout]
        .into_iter()
        .flatten()
        .min()
        .map(|t| tokio::time::Instant::now() + t);
    let bookmark_every = behaviour.bookmark_every.filter(|_| bookmarks);
    let shared = Arc::clone(state);
    let stream = futures_util::stream::unfold(
        (backlog.into_iter(), receiver),
        move |(mut backlog, mut receiver)| {
            let shared = Arc::clone(&shared);
            async move {
                let line = match backlog.next() {
                    Some(event) => json!({"type": event.kind_of_event, "object": event.object}),
                    None => loop {
                        let tick = async {
                            match bookmark_every {
                                Some(every) => tokio::time::sleep(every).await,
                                None => std::future::pending().await,
                            }
                        };
                        let end = async {
                            match ends {
                                Some(at) => tokio::time::sleep_until(at).await,
                                None => std::future::pending().await,
                            }
                        };
                        tokio::select! {
                            received = receiver.recv() => match received {
                                Ok(event) if matches(&event) => break json!({
                                    "type": event.kind_of_event, "object": event.object,
                                }),
                                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => continue,
                                Err(broadcast::error::RecvError::Closed) => return None,
                            },
                            () = tick => {
                                let version = shared.lock().ok()?.resource_version;
                                break json!({"type": "BOOKMARK", "object": {
                                    "apiVersion": api_version, "kind": kind,
                                    "metadata": {"resourceVersion": version.to_string()},
                                }});
                            }
                            () = end => return None,
                        }
                    },
                };
                let mut bytes = serde_json::to_vec(&line).unwrap_or_default();
                bytes.push(b'\n');
                Some((
                    Ok::<_, Infallible>(Frame::data(Bytes::from(bytes))),
                    (backlog, receiver),
                ))
            }
        },
    );
    let mut response = Response::new(StreamBody::new(stream).boxed());
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

fn json_response(code: StatusCode, value: &Value) -> Response<Body> {
    let mut response = Response::new(
        Full::new(Bytes::from(serde_json::to_vec(value).unwrap_or_default())).boxed(),
    );
    *response.status_mut() = code;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

/// The API's `StatusReason` for a code (what clients such as kube-rs match on).
fn reason(code: StatusCode) -> &'static str {
    match code {
        StatusCode::NOT_FOUND => "NotFound",
        StatusCode::CONFLICT => "Conflict",
        StatusCode::BAD_REQUEST => "BadRequest",
        StatusCode::METHOD_NOT_ALLOWED => "MethodNotAllowed",
        StatusCode::GONE => "Expired",
        _ => "InternalError",
    }
}

/// A `Status` object, as the API server answers errors.
fn status(code: StatusCode, message: &str) -> Response<Body> {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message,
        "reason": reason(code), "code": code.as_u16(),
    });
    json_response(code, &body)
}
