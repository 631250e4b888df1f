//! The addresses the plugin gave pods, as the cluster state carries them.
//!
//! With an API server the kubelet reports a pod's addresses (`status.podIPs`, from the
//! plugin's result) and every agent watches them. A manifest directory has no kubelet: each
//! agent writes the attachments of its node to `pod-status/<node>.json` in the directory, and
//! every agent reads them back as the Pods' status, so a pod wired on one node is known, by
//! address, to the policies and services of the others.

use std::{net::IpAddr, path::Path, sync::Arc};

use k8s_openapi::{api::core::v1::PodIP, apimachinery::pkg::apis::meta::v1::ObjectMeta};
use serde::{Deserialize, Serialize};

use crate::source::{ClusterState, Objects, Pod, PodSpec, PodStatus};

/// The subdirectory of a manifest directory holding the nodes' pod status files.
pub const POD_STATUS_DIR: &str = "pod-status";

/// One wired pod: which, where, with which addresses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodStatusRecord {
    pub namespace: String,
    pub name: String,
    /// Empty when the runtime passed none.
    pub uid: String,
    pub node: String,
    pub addresses: Vec<IpAddr>,
}

/// The status file of `node` in manifest directory `dir`.
pub fn status_file(dir: &Path, node: &str) -> std::path::PathBuf {
    dir.join(POD_STATUS_DIR).join(format!("{node}.json"))
}

/// Writes `node`'s records (atomically), unless the file already says the same (or there are
/// none and no file): every write wakes the other agents.
pub fn write(dir: &Path, node: &str, records: &[PodStatusRecord]) -> std::io::Result<()> {
    let path = status_file(dir, node);
    let current = match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice::<Vec<PodStatusRecord>>(&bytes).ok(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(Vec::new()),
        Err(e) => return Err(e),
    };
    if current.as_deref() == Some(records) {
        return Ok(());
    }
    crate::kernel::state::write_json_atomically(&path, &records)
}

/// Every node's records in `dir`; a file that does not parse is named in the returned
/// rejections and skipped.
pub fn read(dir: &Path) -> (Vec<PodStatusRecord>, Vec<String>) {
    let mut records = Vec::new();
    let mut rejected = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(dir.join(POD_STATUS_DIR))
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    for file in files {
        let parsed = std::fs::read(&file)
            .map_err(|e| e.to_string())
            .and_then(|b| {
                serde_json::from_slice::<Vec<PodStatusRecord>>(&b).map_err(|e| e.to_string())
            });
        match parsed {
            Ok(mut more) => records.append(&mut more),
            Err(error) => rejected.push(format!("{}: {error}", file.display())),
        }
    }
    (records, rejected)
}

/// Puts `records` into `state` as the kubelet would: the Pod object (matched by namespace,
/// name and, when both have one, UID) gets the node and the addresses; a pod whose object has
/// not arrived (or is another pod of the same name) stands in without labels, so its
/// namespace's policies judge it as they judge such a pod.
pub fn merge(state: &mut ClusterState, records: &[PodStatusRecord]) {
    let mut index = PodIndex::default();
    for record in records {
        let pod_ips: Vec<PodIP> = record
            .addresses
            .iter()
            .map(|a| PodIP { ip: a.to_string() })
            .collect();
        let position = match index.find(&state.pods, &record.namespace, &record.name) {
            Some(position) => position,
            None => {
                state.pods.push(Arc::new(placeholder(record)));
                let position = state.pods.len() - 1;
                index.add(&record.namespace, &record.name, position);
                position
            }
        };
        let pod = &state.pods[position];
        let uid = pod.metadata.uid.as_deref().unwrap_or("");
        let same_pod = uid.is_empty() || record.uid.is_empty() || uid == record.uid;
        // The shared list and object are copied only when the record changes them.
        let node = Some(record.node.clone());
        let first_ip = pod_ips.first().map(|p| p.ip.clone());
        let status = pod.status.as_ref();
        let current = same_pod
            && pod.spec.as_ref().is_some_and(|s| s.node_name == node)
            && status.is_some_and(|s| {
                s.pod_ip == first_ip && s.pod_ips.as_ref() == Some(&pod_ips) && s.phase.is_some()
            });
        if current {
            continue;
        }
        let slot = &mut state.pods[position];
        if !same_pod {
            *slot = Arc::new(placeholder(record));
        }
        let pod = Arc::make_mut(slot);
        let spec = pod.spec.get_or_insert_with(PodSpec::default);
        spec.node_name = node;
        let status = pod.status.get_or_insert_with(PodStatus::default);
        status.pod_ip = first_ip;
        status.pod_ips = Some(pod_ips);
        if status.phase.is_none() {
            status.phase = Some("Running".into());
        }
    }
}

/// Finds the first Pod object of a namespace and name. The sources keep the pods sorted by
/// namespace and name, so a binary search finds it without indexing 150,000 pods at every
/// sync; a pod it misses (no object yet, no namespace, a list in another order) is looked
/// up in an index of every pod, made once at the first miss.
#[derive(Default)]
struct PodIndex {
    all: Option<std::collections::HashMap<(String, String), usize>>,
}

impl PodIndex {
    fn find(&mut self, pods: &Objects<Pod>, namespace: &str, name: &str) -> Option<usize> {
        if let Some(found) = pods.position_in_order(Some(namespace), name) {
            return Some(found);
        }
        self.all
            .get_or_insert_with(|| {
                let mut all = std::collections::HashMap::new();
                for (position, pod) in pods.iter().enumerate() {
                    let namespace = pod
                        .metadata
                        .namespace
                        .as_deref()
                        .filter(|n| !n.is_empty())
                        .unwrap_or("default");
                    let name = pod.metadata.name.as_deref().unwrap_or("");
                    all.entry((namespace.to_owned(), name.to_owned()))
                        .or_insert(position);
                }
                all
            })
            .get(&(namespace.to_owned(), name.to_owned()))
            .copied()
    }

    /// Notes a pod added at `position`.
    fn add(&mut self, namespace: &str, name: &str, position: usize) {
        if let Some(all) = &mut self.all {
            all.insert((namespace.to_owned(), name.to_owned()), position);
        }
    }
}

/// A Pod object for a pod whose own has not arrived.
fn placeholder(record: &PodStatusRecord) -> Pod {
    Pod {
        metadata: ObjectMeta {
            namespace: Some(record.namespace.clone()),
            name: Some(record.name.clone()),
            uid: (!record.uid.is_empty()).then(|| record.uid.clone()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec::default()),
        status: Some(PodStatus::default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, address: &str) -> PodStatusRecord {
        PodStatusRecord {
            namespace: "web".into(),
            name: name.into(),
            uid: String::new(),
            node: "node0".into(),
            addresses: vec![address.parse().unwrap()],
        }
    }

    #[test]
    fn records_give_their_pods_addresses_or_stand_in_for_missing_objects() {
        let mut state = ClusterState::default();
        let mut known = placeholder(&record("known", "10.0.0.1"));
        known.metadata.labels = Some([("app".to_owned(), "a".to_owned())].into());
        state.pods.push(Arc::new(known));
        merge(
            &mut state,
            &[
                record("known", "10.244.1.2"),
                record("arriving", "10.244.1.3"),
            ],
        );
        assert_eq!(state.pods.len(), 2);
        let ips = |p: &Pod| {
            p.status.as_ref().unwrap().pod_ips.as_ref().unwrap()[0]
                .ip
                .clone()
        };
        assert_eq!(state.pods[0].metadata.labels.as_ref().unwrap()["app"], "a");
        assert_eq!(ips(&state.pods[0]), "10.244.1.2");
        assert_eq!(state.pods[1].metadata.name.as_deref(), Some("arriving"));
        assert_eq!(state.pods[1].metadata.labels, None);
        assert_eq!(ips(&state.pods[1]), "10.244.1.3");
        assert_eq!(
            state.pods[1].spec.as_ref().unwrap().node_name.as_deref(),
            Some("node0")
        );
    }

    /// Pods sorted as the sources keep them are found by binary search (the first of equal
    /// names), a pod without a namespace as `default`'s, and a merge that changes nothing
    /// leaves the shared list uncopied.
    #[test]
    fn records_find_their_pods_in_a_sorted_list_and_a_merge_without_change_copies_nothing() {
        let pod = |namespace: Option<&str>, name: &str, address: &str| {
            let mut record = record(name, address);
            record.namespace = namespace.unwrap_or("default").into();
            let mut pod = placeholder(&record);
            pod.metadata.namespace = namespace.map(Into::into);
            pod.metadata.labels = Some([("app".to_owned(), name.to_owned())].into());
            pod.status.as_mut().unwrap().pod_ip = Some(address.into());
            Arc::new(pod)
        };
        let mut pods = vec![
            pod(None, "bare", "10.0.0.9"),
            pod(Some("a"), "x", "10.0.0.1"),
            pod(Some("web"), "m", "10.0.0.2"),
            pod(Some("web"), "n", "10.0.0.3"),
            pod(Some("web"), "n", "10.0.0.4"),
            pod(Some("z"), "y", "10.0.0.5"),
        ];
        // Enough pods after them that the list is shared by pointer, not held inline.
        pods.extend((100..300).map(|i| pod(Some("zz"), &format!("p{i}"), "10.0.1.1")));
        let mut state = ClusterState {
            pods: pods.into(),
            ..ClusterState::default()
        };
        let mut to_default = record("bare", "10.244.1.9");
        to_default.namespace = "default".into();
        let records = [record("n", "10.244.1.3"), to_default];
        merge(&mut state, &records);
        let ip = |p: &Pod| p.status.as_ref().unwrap().pod_ip.clone().unwrap();
        let ips: Vec<String> = state.pods.iter().take(6).map(|p| ip(p)).collect();
        assert_eq!(
            ips,
            [
                "10.244.1.9",
                "10.0.0.1",
                "10.0.0.2",
                "10.244.1.3",
                "10.0.0.4",
                "10.0.0.5"
            ]
        );
        let before = state.clone();
        merge(&mut state, &records);
        assert!(state.pods.shares(&before.pods), "nothing changed: no copy");
    }

    #[test]
    fn status_files_round_trip_and_bad_ones_are_named() {
        let dir = std::env::temp_dir().join(format!("pod-status-{}", std::process::id()));
        // Nothing to say and no file: nothing written.
        write(&dir, "node2", &[]).unwrap();
        assert!(!status_file(&dir, "node2").exists());
        write(&dir, "node0", &[record("a", "10.244.1.2")]).unwrap();
        std::fs::write(dir.join(POD_STATUS_DIR).join("node1.json"), "not json").unwrap();
        let (records, rejected) = read(&dir);
        assert_eq!(records, vec![record("a", "10.244.1.2")]);
        assert_eq!(rejected.len(), 1);
        assert!(rejected[0].contains("node1.json"), "{rejected:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
