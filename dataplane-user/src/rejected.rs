//! Objects a sync could not use. Every stage names what it refused in one line that starts
//! with the object's kind and name (`Service shop/web: spec.ports[0].port: ...`); this module
//! reads those lines back into the object they are about, so that each refusal is logged,
//! counted by kind (`dataplane_rejected_objects`) and, with the API server, told as a
//! Warning Event on the object itself ([`EventSender`]), where its owner looks.
//!
//! A refused object costs only itself: the stages skip it and sync the rest.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::mpsc;

/// The object a refusal names.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ObjectRef {
    pub api_version: &'static str,
    pub kind: &'static str,
    pub namespace: Option<String>,
    pub name: String,
}

/// One refused object: the metric's kind label, the object (when the line names one the
/// agent knows), the line itself.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rejection {
    pub kind: &'static str,
    pub object: Option<ObjectRef>,
    pub message: String,
}

/// How lines start, by kind: the words before the object's name, the metric's label, the
/// API version and kind, and whether the name is `namespace/name`.
const KINDS: &[(&str, &str, &str, &str, bool)] = &[
    ("Service ", "service", "v1", "Service", true),
    (
        "EndpointSlice ",
        "endpointslice",
        "discovery.k8s.io/v1",
        "EndpointSlice",
        true,
    ),
    (
        "NetworkPolicy ",
        "networkpolicy",
        "networking.k8s.io/v1",
        "NetworkPolicy",
        true,
    ),
    (
        "EgressFirewall ",
        "egressfirewall",
        "k8s.ovn.org/v1",
        "EgressFirewall",
        true,
    ),
    (
        "AdminNetworkPolicy ",
        "adminpolicy",
        "policy.networking.k8s.io/v1alpha1",
        "AdminNetworkPolicy",
        false,
    ),
    (
        "BaselineAdminNetworkPolicy ",
        "adminpolicy",
        "policy.networking.k8s.io/v1alpha1",
        "BaselineAdminNetworkPolicy",
        false,
    ),
    (
        "ClusterNetworkPolicy ",
        "adminpolicy",
        "policy.networking.k8s.io/v1alpha2",
        "ClusterNetworkPolicy",
        false,
    ),
    ("EgressIP ", "egressip", "k8s.ovn.org/v1", "EgressIP", false),
    ("hybrid node ", "node", "v1", "Node", false),
    ("node ", "node", "v1", "Node", false),
    ("pod ", "pod", "v1", "Pod", true),
    ("namespace ", "namespace", "v1", "Namespace", false),
    ("Namespace ", "namespace", "v1", "Namespace", false),
];

/// The metric's kinds, every one reported (0 when none is refused).
pub const METRIC_KINDS: &[&str] = &[
    "manifest",
    "service",
    "endpointslice",
    "networkpolicy",
    "egressfirewall",
    "adminpolicy",
    "egressip",
    "node",
    "pod",
    "namespace",
    "other",
];

impl Rejection {
    /// What `message` is about. A manifest file's line (`<file>: <Kind> <name>: ...`) is of
    /// kind `manifest`, a line of no known shape of kind `other`.
    pub fn of(message: &str) -> Self {
        let head = message.split(": ").next().unwrap_or_default();
        for &(prefix, kind, api_version, object_kind, namespaced) in KINDS {
            let Some(name) = head.strip_prefix(prefix) else {
                continue;
            };
            // "node a (hybrid)": the node's name is the first word.
            let name = name.split(' ').next().unwrap_or_default();
            let (namespace, name) = match (namespaced, name.split_once('/')) {
                (true, Some((namespace, name))) => (Some(namespace.to_owned()), name),
                (true, None) => (Some("default".to_owned()), name),
                (false, _) => (None, name),
            };
            let object = (!name.is_empty() && !name.starts_with('<')).then(|| ObjectRef {
                api_version,
                kind: object_kind,
                namespace,
                name: name.to_owned(),
            });
            return Rejection {
                kind,
                object,
                message: message.to_owned(),
            };
        }
        let kind = if [".yaml", ".yml", ".json"].iter().any(|e| head.ends_with(e))
            || head.starts_with("api:")
        {
            "manifest"
        } else {
            "other"
        };
        Rejection {
            kind,
            object: None,
            message: message.to_owned(),
        }
    }
}

/// How many of `rejections` each metric kind has (every kind listed).
pub fn counts(rejections: &[Rejection]) -> Vec<(&'static str, usize)> {
    METRIC_KINDS
        .iter()
        .map(|&kind| (kind, rejections.iter().filter(|r| r.kind == kind).count()))
        .collect()
}

/// Events waiting for the API server, at most: a burst of refusals beyond it is logged and
/// counted, not queued without end (the agent's loop never waits for the API server).
const EVENT_QUEUE: usize = 256;

/// Tells refusals to the API server as Warning Events, from a task of its own: the agent
/// hands each new refusal over without waiting, and the task publishes them one by one.
pub struct EventSender {
    queue: mpsc::Sender<Rejection>,
    /// What the last sync refused: only a refusal new since then is told again.
    told: BTreeSet<Rejection>,
}

impl EventSender {
    /// Starts the publishing task on the current runtime; events name this agent's node as
    /// the reporting instance.
    pub fn start(client: kube::Client, node: &str) -> Self {
        let (queue, mut waiting) = mpsc::channel::<Rejection>(EVENT_QUEUE);
        let recorder = Recorder::new(
            client,
            Reporter {
                controller: "dataplane".into(),
                instance: Some(node.to_owned()),
            },
        );
        tokio::spawn(async move {
            while let Some(rejection) = waiting.recv().await {
                let Some(object) = &rejection.object else {
                    continue;
                };
                let reference = ObjectReference {
                    api_version: Some(object.api_version.to_owned()),
                    kind: Some(object.kind.to_owned()),
                    namespace: object.namespace.clone(),
                    name: Some(object.name.clone()),
                    ..ObjectReference::default()
                };
                let event = Event {
                    type_: EventType::Warning,
                    reason: "Rejected".into(),
                    note: Some(truncated(&rejection.message, 1024)),
                    action: "Sync".into(),
                    secondary: None,
                };
                let publish = recorder.publish(&event, &reference);
                match tokio::time::timeout(std::time::Duration::from_secs(5), publish).await {
                    Ok(Ok(())) => {}
                    Ok(Err(error)) => tracing::debug!(%error, "publishing an event"),
                    Err(_) => tracing::debug!("publishing an event: no answer within 5 s"),
                }
            }
        });
        EventSender {
            queue,
            told: BTreeSet::new(),
        }
    }

    /// Hands over the refusals of `rejections` not refused at the last call (a refusal that
    /// stays is one Event, not one each sync).
    pub fn tell(&mut self, rejections: &[Rejection]) {
        let now: BTreeSet<Rejection> = rejections
            .iter()
            .filter(|r| r.object.is_some())
            .cloned()
            .collect();
        for rejection in now.difference(&self.told) {
            if self.queue.try_send(rejection.clone()).is_err() {
                tracing::debug!(
                    message = rejection.message,
                    "event queue full; the refusal is logged only"
                );
            }
        }
        self.told = now;
    }
}

/// `text` cut to at most `max` bytes, on a character boundary.
fn truncated(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_read_back_into_their_objects() {
        let cases = [
            (
                "Service shop/web: spec.ports[0].port: 0 is not a port",
                "service",
                Some(("Service", Some("shop"), "web")),
            ),
            (
                "NetworkPolicy x/huge: spec.ingress[].from[].ipBlock: too large",
                "networkpolicy",
                Some(("NetworkPolicy", Some("x"), "huge")),
            ),
            (
                "node node-b: status.addresses has no InternalIP",
                "node",
                Some(("Node", None, "node-b")),
            ),
            (
                "node win-1 (hybrid): spec.podCIDRs 10.0.0.0/24 is also the pod CIDR of node a",
                "node",
                Some(("Node", None, "win-1")),
            ),
            (
                "hybrid node win-2: no annotation x yet; not routed",
                "node",
                Some(("Node", None, "win-2")),
            ),
            (
                "pod default/web: status.podIPs \"x\" is not an address",
                "pod",
                Some(("Pod", Some("default"), "web")),
            ),
            (
                "AdminNetworkPolicy deny-all: spec.priority: 1001 is outside 0..=1000",
                "adminpolicy",
                Some(("AdminNetworkPolicy", None, "deny-all")),
            ),
            ("pods.yaml: Pod web: missing field `spec`", "manifest", None),
            ("api:nodes: Node <unnamed>: bad", "manifest", None),
            ("something else entirely", "other", None),
        ];
        for (message, kind, object) in cases {
            let rejection = Rejection::of(message);
            assert_eq!(rejection.kind, kind, "{message}");
            let got = rejection
                .object
                .as_ref()
                .map(|o| (o.kind, o.namespace.as_deref(), o.name.as_str()));
            assert_eq!(got, object, "{message}");
            assert_eq!(rejection.message, message);
        }
        let counted = counts(&[Rejection::of("node a: x"), Rejection::of("node b: y")]);
        assert!(counted.contains(&("node", 2)));
        assert!(counted.contains(&("service", 0)));
        assert_eq!(counted.len(), METRIC_KINDS.len());
    }

    #[test]
    fn long_notes_are_cut_on_a_character_boundary() {
        assert_eq!(truncated("abc", 10), "abc");
        assert_eq!(truncated("ééé", 3), "é");
    }
}
