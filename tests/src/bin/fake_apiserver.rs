//! A stand-in Kubernetes API server for the agent's API source tests: it serves the objects of
//! a directory of YAML manifests over the API's list and watch protocol (JSON lists with a
//! resourceVersion; newline-delimited ADDED/MODIFIED/DELETED watch events), and turns every
//! change to the directory into watch events. Plain HTTP on the address given (tests bind it
//! to loopback inside a node's network namespace).
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
    let state = Arc::new(Mutex::new(State {
        first_version: start + 1,
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

/// Reads the directory and turns differences from the served objects into events.
fn reload(state: &Shared, dir: &Path) {
    let Some(current) = read_objects(dir) else {
        return;
    };
    let Ok(mut state) = state.lock() else {
        return;
    };
    let mut changes = Vec::new();
    for (key, object) in &current {
        match state.objects.get(key) {
            None => changes.push(("ADDED", key.clone(), object.clone())),
            Some(old) if old != object => changes.push(("MODIFIED", key.clone(), object.clone())),
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
            let Ok(value) = serde::Deserialize::deserialize(document) else {
                continue;
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
    let Some(&(_, api_version, kind)) = RESOURCES.iter().find(|(p, _, _)| *p == path) else {
        return Ok(status(StatusCode::NOT_FOUND, &format!("{path} not served")));
    };
    if query.get("watch").is_some_and(|w| w == "true" || w == "1") {
        let since = query
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        return Ok(watch(&state, api_version, kind, since));
    }
    let Ok(state) = state.lock() else {
        return Ok(status(StatusCode::INTERNAL_SERVER_ERROR, "poisoned"));
    };
    let items: Vec<Value> = state
        .objects
        .iter()
        .filter(|(key, _)| key.0 == api_version && key.1 == kind)
        .map(|(_, v)| v.clone())
        .collect();
    let list = json!({
        "apiVersion": api_version,
        "kind": format!("{kind}List"),
        "metadata": {"resourceVersion": state.resource_version.to_string()},
        "items": items,
    });
    Ok(json_response(StatusCode::OK, &list))
}

/// A watch: events after `since` from the history, then live ones, one JSON object per line.
fn watch(
    state: &Shared,
    api_version: &'static str,
    kind: &'static str,
    since: u64,
) -> Response<Body> {
    let (backlog, receiver) = match state.lock() {
        // A version from before this server (e.g. a previous process): as the API server does
        // for versions it no longer has, answer 410 Gone, which makes a client list anew.
        Ok(state) if since != 0 && since < state.first_version => {
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
        ),
        Err(_) => return status(StatusCode::INTERNAL_SERVER_ERROR, "poisoned"),
    };
    let matches = move |e: &Event| e.api_version == api_version && e.kind == kind;
    let backlog: Vec<Event> = backlog.into_iter().filter(|e| matches(e)).collect();
    let stream = futures_util::stream::unfold(
        (backlog.into_iter(), receiver),
        move |(mut backlog, mut receiver)| async move {
            let event = match backlog.next() {
                Some(event) => event,
                None => loop {
                    match receiver.recv().await {
                        Ok(event) if matches(&event) => break event,
                        Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => continue,
                        Err(broadcast::error::RecvError::Closed) => return None,
                    }
                },
            };
            let line = json!({"type": event.kind_of_event, "object": event.object});
            let mut bytes = serde_json::to_vec(&line).unwrap_or_default();
            bytes.push(b'\n');
            Some((
                Ok::<_, Infallible>(Frame::data(Bytes::from(bytes))),
                (backlog, receiver),
            ))
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

/// A `Status` object, as the API server answers errors.
fn status(code: StatusCode, message: &str) -> Response<Body> {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message,
        "reason": code.canonical_reason().unwrap_or_default(), "code": code.as_u16(),
    });
    json_response(code, &body)
}
