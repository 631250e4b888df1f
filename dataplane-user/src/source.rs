//! Cluster state from a directory of Kubernetes YAML manifests (the embedded default outside a
//! cluster): Nodes, Pods, Services and EndpointSlices as the API serves them (k8s-openapi
//! types), Namespaces, NetworkPolicies, OVN-Kubernetes' EgressFirewalls, and the OpenShift
//! network operator's `Network` for the overlay settings, decoded into k8s-openapi's types and
//! this project's (`api`), which validate them. Unknown kinds are skipped; an object
//! that does not parse is reported by file, kind and name and skipped, the rest still loads.
//! The directory is followed by its inotify events ([`ManifestWatch`]).

mod cache;
mod decode;
mod document;
mod manifests;
mod objects;
mod pod;
mod state;

pub use cache::{ObjectCache, ObjectKey, Parsed};
pub use decode::{SERVICE_NAME_LABEL, add_documents, add_object, slice_service};
pub use document::Document;
pub use manifests::{FirstChange, ManifestCache, ManifestWatch, SourceError, read_dir};
pub use objects::{Objects, ObjectsCursor, ObjectsIter};
pub use pod::{Container, Pod, PodSpec, PodStatus};
pub use state::ClusterState;

// What the tests below take from here with `use super::*`.
#[cfg(test)]
use {
    crate::api::network::{HybridSettings, OvnKubernetesConfig},
    ipnet::IpNet,
    k8s_openapi::api::core::v1::Node,
    manifests::{ParsedFile, parse_file, split_documents, text_hash},
    std::fs,
    std::{
        collections::{BTreeMap, BTreeSet},
        path::PathBuf,
        sync::Arc,
    },
};

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
            "networks.config.openshift.io" => format!(
                "apiVersion: config.openshift.io/v1\nkind: Network\nmetadata: {{name: {name}}}\nspec: {{clusterNetwork: [{{cidr: 10.{variant}.0.0/16, hostPrefix: 24}}]}}\n"
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
        let mut seen_platform = false;
        let (mut history, mut journalled) = (Vec::<ClusterState>::new(), 0);
        let mut rng = crate::test_rng::TestRng::new(7);
        let mut next = |bound: u64| rng.below(bound);
        for step in 0..600 {
            let (plural, namespace) = match next(5) {
                0 => ("nodes", ""),
                1 => ("namespaces", ""),
                2 => ("pods", ["a", "b", "c"][next(3) as usize]),
                3 => ("networks.config.openshift.io", ""),
                _ => ("networks", ""),
            };
            let name = match (plural, next(6)) {
                // Only the Networks named `cluster` have settings.
                ("networks" | "networks.config.openshift.io", 0..=2) => "cluster".to_owned(),
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
            seen_platform |= anew.platform.is_some() && anew.network.is_some();
            seen_rejected |= !anew.rejected.is_empty();
            seen_both |= anew.nodes.len() + anew.namespaces.len() > 6;
        }
        assert!(
            seen_settings && seen_platform && seen_rejected && seen_both && journalled > 900,
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
        assert!(!empty.allocated() && empty.is_empty() && empty.shares(&Objects::default()));
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

    /// Fields of the operator's Network the dataplane does not apply are named, and the rest
    /// of the Network applies.
    #[test]
    fn network_fields_not_applied_are_named_and_the_rest_applies() {
        let mut state = ClusterState::default();
        add_documents(
            &mut state,
            "network.yaml",
            "apiVersion: operator.openshift.io/v1\nkind: Network\nmetadata: {name: cluster}\n\
             spec:\n  serviceNetwork: [10.96.0.0/16]\n  defaultNetwork:\n    ovnKubernetesConfig:\n\
             \x20     mtu: 1400\n      ipsecConfig: {mode: Full}\n      gatewayConfig: {routingViaHost: false}\n",
        );
        assert_eq!(
            state.service_networks,
            vec!["10.96.0.0/16".parse::<IpNet>().unwrap()]
        );
        assert_eq!(state.network.map(|n| n.mtu), Some(Some(1400)));
        assert_eq!(
            state.rejected,
            vec![
                "network.yaml: Network cluster: spec.defaultNetwork.ovnKubernetesConfig.gatewayConfig: not applied: pods leave the cluster through the node's own routing and masquerade (as routingViaHost: true), whatever it says; the rest of the Network applies".to_owned(),
                "network.yaml: Network cluster: spec.defaultNetwork.ovnKubernetesConfig.ipsecConfig: IPsec is not supported (the kernels this dataplane runs on have no ESP): traffic between nodes is not encrypted; the rest of the Network applies".to_owned(),
            ]
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

    const OPERATOR: &str = "apiVersion: operator.openshift.io/v1\nkind: Network\nmetadata: {name: cluster}\n\
         spec:\n  clusterNetwork: [{cidr: 10.244.0.0/16, hostPrefix: 24}]\n  serviceNetwork: [10.96.0.0/16]\n\
         \x20 defaultNetwork: {ovnKubernetesConfig: {mtu: 1400, HYBRID}}\n";
    const CONFIG: &str = "apiVersion: config.openshift.io/v1\nkind: Network\nmetadata: {name: cluster}\n\
         spec: {clusterNetwork: [{cidr: 10.128.0.0/14, hostPrefix: 23}], serviceNetwork: [172.30.0.0/16], networkType: Dataplane}\n";

    fn nets(v: &[&str]) -> Vec<ipnet::IpNet> {
        v.iter().map(|c| c.parse().expect("cidr")).collect()
    }

    /// A directory holding `files`, read as the agent reads its manifests.
    fn read(files: &[(&str, &str)]) -> ClusterState {
        static READS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let read = READS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("platform-{}-{read}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("dir");
        for (name, text) in files {
            fs::write(dir.join(name), text).expect("write");
        }
        let state = read_dir(&dir).expect("read");
        fs::remove_dir_all(&dir).expect("remove");
        state
    }

    /// As on OpenShift: the installer's networks are in `config.openshift.io/v1 Network`, the
    /// overlay settings in the operator's; the former's networks apply in whichever order
    /// they come, the operator's differing copies are named, its settings stay.
    #[test]
    fn the_cluster_network_configuration_gives_the_networks_and_the_operator_the_settings() {
        let operator = OPERATOR.replace(", HYBRID", "");
        for files in [
            [("a.yaml", CONFIG), ("b.yaml", operator.as_str())],
            [("a.yaml", operator.as_str()), ("b.yaml", CONFIG)],
        ] {
            let state = read(&files);
            assert_eq!(state.cluster_networks, nets(&["10.128.0.0/14"]));
            assert_eq!(state.service_networks, nets(&["172.30.0.0/16"]));
            assert_eq!(
                state.subnet_pools,
                [crate::api::network::SubnetPool {
                    network: "10.128.0.0/14".parse().unwrap(),
                    host_prefix: 23
                }]
            );
            assert_eq!(state.network.map(|n| n.mtu), Some(Some(1400)));
            assert_eq!(
                state.rejected,
                [
                    "operator.openshift.io/v1 Network cluster: spec.clusterNetwork [\"10.244.0.0/16\"] differs from config.openshift.io/v1 Network cluster's [\"10.128.0.0/14\"]: the latter applies",
                    "operator.openshift.io/v1 Network cluster: spec.serviceNetwork [\"10.96.0.0/16\"] differs from config.openshift.io/v1 Network cluster's [\"172.30.0.0/16\"]: the latter applies",
                ]
            );
        }
        // The operator's Network without networks (they are the installer's): nothing to name.
        let bare = "apiVersion: operator.openshift.io/v1\nkind: Network\nmetadata: {name: cluster}\n\
                    spec: {defaultNetwork: {ovnKubernetesConfig: {genevePort: 6081}}}\n";
        let state = read(&[("a.yaml", bare), ("b.yaml", CONFIG)]);
        assert_eq!(state.cluster_networks, nets(&["10.128.0.0/14"]));
        assert!(
            state.network.is_some() && state.rejected.is_empty(),
            "{:?}",
            state.rejected
        );
        // The configuration alone: the networks are known, the node still waits for the
        // operator's settings (the agent refuses to sync without them).
        let state = read(&[("a.yaml", CONFIG)]);
        assert_eq!(state.cluster_networks, nets(&["10.128.0.0/14"]));
        assert!(state.network.is_none());
    }

    /// The hybrid overlay's network is checked against the networks that apply: one that
    /// overlaps the installer's networks refuses the operator's Network, named.
    #[test]
    fn a_hybrid_overlay_inside_the_configured_networks_refuses_the_network() {
        let operator = OPERATOR.replace(
            "HYBRID",
            "hybridOverlayConfig: {hybridClusterNetwork: [{cidr: 10.130.0.0/16}]}",
        );
        let state = read(&[("a.yaml", &operator)]);
        assert!(
            state.network.is_some() && state.hybrid.is_some(),
            "{:?}",
            state.rejected
        );
        let state = read(&[("a.yaml", &operator), ("b.yaml", CONFIG)]);
        assert!(state.network.is_none() && state.hybrid.is_none());
        assert_eq!(
            state.rejected.last().map(String::as_str),
            Some(
                "operator.openshift.io/v1 Network cluster: hybridOverlayConfig.hybridClusterNetwork[0].cidr: \
                 10.130.0.0/16 overlaps spec.clusterNetwork 10.128.0.0/14 (of config.openshift.io/v1 \
                 Network cluster); the Network is refused"
            )
        );
        // An invalid configuration is named and the operator's networks stay.
        let bad = CONFIG.replace("hostPrefix: 23", "hostPrefix: 7");
        let state = read(&[
            ("a.yaml", &bad),
            ("b.yaml", &OPERATOR.replace(", HYBRID", "")),
        ]);
        assert_eq!(state.cluster_networks, nets(&["10.244.0.0/16"]));
        assert_eq!(state.rejected.len(), 1);
        assert!(
            state.rejected[0].ends_with(
                "/a.yaml: Network.config.openshift.io cluster: spec.clusterNetwork[0].hostPrefix: 7 is not between 14 and 32"
            ),
            "{:?}",
            state.rejected
        );
    }

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
                host_prefix: Some(23),
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
