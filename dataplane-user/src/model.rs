//! Typed cluster state for this node, built from Kubernetes objects: which nodes exist and
//! where their pods live, which pods run here and behind which host veth.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;

use crate::{
    api::network::OverlaySettings,
    changes::{Changes, Kind, object_key},
    seq::Seq,
    source::{ClusterState, Objects, Pod},
};

pub mod hybrid;
pub mod subnets;
mod view;

pub use hybrid::{HybridNodeView, HybridView};
pub use view::{
    LocalPodView, NodeChanges, NodeList, NodeSeq, NodeView, Underlay, endpoint, first_v4, first_v6,
    in_name_order, internal_ips, node_changes, node_named,
};

/// Everything the overlay compile needs.
#[derive(Clone, Debug)]
pub struct OverlayView {
    pub this_node: String,
    /// Shared: the egress stage reads the same list, and a sync that changed no Node keeps it.
    pub nodes: NodeList,
    pub local_pods: Vec<LocalPodView>,
    /// Veths named on the command line that no local pod claims: port security does not
    /// apply to them (port security's `unrestricted`).
    pub unrestricted_ifindexes: Vec<u32>,
    pub underlay: Underlay,
    pub settings: OverlaySettings,
    /// The hybrid overlay, when the `Network` configures it.
    pub hybrid: Option<HybridView>,
}

impl OverlayView {
    /// This node's view, if it is among the nodes (see [`node_named`]).
    pub fn this_node_view(&self) -> Option<&Arc<NodeView>> {
        node_named(&self.nodes, &self.this_node)
    }
}

/// OVN-Kubernetes' per-pod network annotation, carrying the pod's MAC.
pub const POD_NETWORKS_ANNOTATION: &str = "k8s.ovn.org/pod-networks";

/// A pod's host-side interface as found in this node's namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostInterface {
    pub name: String,
    pub ifindex: u32,
    pub mac: [u8; 6],
    /// The pod's end takes frames XDP redirects to it (`netdev::takes_xdp`).
    pub takes_xdp: bool,
}

/// The overlay view of this node, and one line per object that could not be used.
pub struct NodeModel {
    pub view: OverlayView,
    /// Host-side interfaces of the local pods (tc is attached to each).
    pub pod_interfaces: Vec<String>,
    /// Local pods not wired for want of a host route to their address (yet): each sync
    /// looks for them again.
    pub unrouted: usize,
    /// Every pod whose `spec.nodeName` is this node (`namespace/name`), wired or not: what
    /// egress IPs call local.
    pub hosted_pods: std::collections::BTreeSet<String>,
    pub warnings: Vec<String>,
    /// The Node objects `view.nodes` was built from, and what each gave.
    node_views: NodeViews,
}

/// The views of a list of Node objects, and what each object gave (in the list's order): a
/// build over a changed list makes views only for the objects that are not in the last
/// (one Node added to 5,000 made 5,000 views), and changes the last lists in place of the
/// objects that came, went or changed. Persistent vectors: copying 5,000 views' handles (each
/// a count in memory of its own to touch) was a sixth of a node added.
#[derive(Clone, Default)]
struct NodeViews {
    from: Objects<Node>,
    /// One per object of `from`.
    built: Seq<BuiltNode>,
    views: NodeList,
    /// How many objects gave warnings.
    warned: usize,
    warnings: Vec<String>,
}

/// What one Node object gave the model.
#[derive(Clone)]
struct BuiltNode {
    view: Option<Arc<NodeView>>,
    warnings: Vec<String>,
}

impl BuiltNode {
    fn of(node: &Node) -> Self {
        let mut warnings = Vec::new();
        let view = node_view(node, &mut warnings).map(Arc::new);
        BuiltNode { view, warnings }
    }
}

/// The last build's lists being changed into the next's: slots before `at` are the new
/// list's, slots from `at` on the last list's still to be walked.
struct NodeEdits {
    built: Seq<BuiltNode>,
    /// `None` once an object without a view makes the slots differ from `built`'s.
    views: Option<NodeSeq>,
    warned: usize,
    at: usize,
}

impl NodeEdits {
    fn of(last: &NodeViews) -> Self {
        NodeEdits {
            built: last.built.clone(),
            views: last.all_viewed().then(|| (*last.views).clone()),
            warned: last.warned,
            at: 0,
        }
    }

    fn keep(&mut self, count: usize) {
        self.at += count;
    }

    fn remove(&mut self) {
        let gone = self.built.remove(self.at);
        self.warned -= usize::from(!gone.warnings.is_empty());
        if let Some(views) = &mut self.views {
            views.remove(self.at);
        }
    }

    fn replace(&mut self, node: &Node) {
        self.remove();
        self.insert(node);
    }

    fn insert(&mut self, node: &Node) {
        let built = BuiltNode::of(node);
        self.warned += usize::from(!built.warnings.is_empty());
        match (&mut self.views, &built.view) {
            (Some(views), Some(view)) => views.insert(self.at, Arc::clone(view)),
            _ => self.views = None,
        }
        self.built.insert(self.at, built);
        self.at += 1;
    }

    /// The lists with the last list's objects the walk did not reach taken out.
    fn finish(mut self, from: &Objects<Node>) -> NodeViews {
        let left = self.built.iter().skip(self.at);
        self.warned -= left.filter(|b| !b.warnings.is_empty()).count();
        self.built.truncate(self.at);
        if let Some(views) = &mut self.views {
            views.truncate(self.at);
        }
        // Made from every object when a slot has no view (rare: a Node without a name), until
        // every object gives one again.
        let views: NodeSeq = self
            .views
            .unwrap_or_else(|| self.built.iter().filter_map(|b| b.view.clone()).collect());
        let warnings = if self.warned == 0 {
            Vec::new()
        } else {
            self.built.iter().flat_map(|b| b.warnings.clone()).collect()
        };
        NodeViews {
            from: from.clone(),
            built: self.built,
            views: Arc::new(views),
            warned: self.warned,
            warnings,
        }
    }
}

impl NodeViews {
    /// Whether every object gave a view (then `views` is `built`'s views, slot for slot).
    fn all_viewed(&self) -> bool {
        self.views.len() == self.built.len()
    }

    /// The views of `nodes`, taking from `last` what it built from the same objects. Both
    /// lists are walked side by side: runs of shared objects are kept at once, and past a
    /// difference the names (the sources' order) say which list moves on.
    fn build(nodes: &Objects<Node>, last: Option<&NodeViews>) -> NodeViews {
        let empty = NodeViews::default();
        let last = last.unwrap_or(&empty);
        if last.from.shares(nodes) {
            return last.clone();
        }
        let mut edits = NodeEdits::of(last);
        let (mut old, mut new) = (last.from.cursor(), nodes.cursor());
        let (mut i, mut j) = (0, 0);
        while let Some(node) = new.get(j).cloned() {
            let shared = old.shared_run(i, &mut new, j);
            if shared > 0 {
                edits.keep(shared);
                i += shared;
                j += shared;
                continue;
            }
            match old.get(i).map(|o| o.metadata.name.cmp(&node.metadata.name)) {
                // Gone from the list.
                Some(std::cmp::Ordering::Less) => {
                    edits.remove();
                    i += 1;
                }
                // Changed.
                Some(std::cmp::Ordering::Equal) => {
                    edits.replace(&node);
                    i += 1;
                    j += 1;
                }
                // New.
                _ => {
                    edits.insert(&node);
                    j += 1;
                }
            }
        }
        edits.finish(nodes)
    }
}

/// The pods whose `spec.nodeName` is this node, kept between syncs and patched with each
/// sync's changed pods: the model looks at these instead of walking every pod of the cluster
/// (at 150,000 pods, that walk was most of a change's overlay stage).
#[derive(Clone, Debug, Default)]
pub struct HostedPods {
    node: String,
    /// By namespace and name (the order the sources keep pods in).
    pods: BTreeMap<(String, String), Arc<Pod>>,
}

impl HostedPods {
    /// `node`'s pods among `pods` (the first object of a namespace and name).
    pub fn from_pods<'a>(pods: impl IntoIterator<Item = &'a Arc<Pod>>, node: &str) -> Self {
        let mut hosted = Self {
            node: node.to_owned(),
            pods: BTreeMap::new(),
        };
        for pod in pods.into_iter().filter(|p| runs_on(p, node)) {
            hosted
                .pods
                .entry(object_key(&**pod))
                .or_insert_with(|| Arc::clone(pod));
        }
        hosted
    }

    /// Brings the pods to `state` as `changes` says it differs from the last state they
    /// followed: the changed pods only, or all of them anew after a full read.
    pub fn follow(&mut self, state: &ClusterState, changes: &Changes) {
        if changes.full {
            *self = Self::from_pods(&state.pods, &self.node);
            return;
        }
        for (key, pod) in &changes.pods {
            match pod.as_ref().filter(|p| runs_on(p, &self.node)) {
                Some(pod) => self.pods.insert(key.clone(), Arc::clone(pod)),
                None => self.pods.remove(key),
            };
        }
    }

    /// Notes [`Kind::HostedPod`] in `changes` when a pod that changed (not only in its
    /// labels) was or now is one of this node's: only then does this node's own view change.
    /// Call before [`Self::follow`].
    pub fn note_changes(&self, changes: &mut Changes) {
        if !changes.kinds.contains(&Kind::Pod) {
            return;
        }
        let here = changes.pods.iter().any(|(key, now)| {
            self.pods.contains_key(key) || now.as_ref().is_some_and(|p| runs_on(p, &self.node))
        });
        if here {
            changes.kinds.insert(Kind::HostedPod);
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Pod>> {
        self.pods.values()
    }
}

/// Builds this node's overlay view from cluster state. `find_host_interface` answers which
/// host interface leads to a pod address (the agent reads the routing table; tests pass a map).
/// `hosted` are `this_node`'s pods of `state`; `last` is the model the last sync built: when
/// no Node changed since, its node views are kept (5,000 of them at scale).
pub fn build(
    state: &ClusterState,
    hosted: &HostedPods,
    last: Option<&NodeModel>,
    this_node: &str,
    underlay: Underlay,
    settings: OverlaySettings,
    find_host_interface: impl Fn(IpAddr) -> Option<HostInterface>,
) -> NodeModel {
    let node_views = NodeViews::build(&state.nodes, last.map(|m| &m.node_views));
    let nodes = Arc::clone(&node_views.views);
    let mut warnings = node_views.warnings.clone();
    let own_cidrs: &[IpNet] = node_named(&nodes, this_node).map_or(&[], |n| &n.pod_cidrs);
    let hybrid = hybrid_view(state, this_node, own_cidrs, underlay.mtu, &mut warnings);
    let router_ip = hybrid.as_ref().map(|h| h.router_ip);
    let mut local_pods = Vec::new();
    let mut pod_interfaces = Vec::new();
    let mut unrouted = 0;
    let mut hosted_pods = std::collections::BTreeSet::new();
    for pod in hosted.iter() {
        let name = pod_name(pod);
        hosted_pods.insert(name.clone());
        let addresses = pod_addresses(pod, &mut warnings);
        let Some(first) = addresses.first() else {
            continue;
        };
        // An address outside this node's pod CIDRs is not the pod network's to give: taking
        // it would let the pod's veth speak for someone else's address.
        if let Some(outside) = addresses
            .iter()
            .find(|a| !own_cidrs.iter().any(|c| c.contains(*a)))
        {
            warnings.push(format!(
                "pod {name}: status.podIPs {outside} is outside node {this_node}'s spec.podCIDRs {}; not wired",
                cidr_list(own_cidrs)
            ));
            continue;
        }
        if let Some(router) = router_ip
            && addresses.contains(&IpAddr::V4(router))
        {
            warnings.push(format!(
                "pod {name}: status.podIPs {router} is this node's hybrid overlay router address; not wired"
            ));
            continue;
        }
        let Some(interface) = find_host_interface(*first) else {
            warnings.push(format!(
                "pod {name}: no host route to {first} yet; not wired"
            ));
            unrouted += 1;
            continue;
        };
        let Some(pod_mac) = pod_mac(pod, &addresses, &mut warnings) else {
            continue;
        };
        if !pod_interfaces.contains(&interface.name) {
            pod_interfaces.push(interface.name.clone());
        }
        local_pods.push(LocalPodView {
            name,
            addresses,
            pod_mac,
            host_ifindex: interface.ifindex,
            host_mac: interface.mac,
            takes_xdp: interface.takes_xdp,
        });
    }
    NodeModel {
        view: OverlayView {
            this_node: this_node.to_owned(),
            nodes,
            local_pods,
            unrestricted_ifindexes: Vec::new(),
            underlay,
            settings,
            hybrid,
        },
        pod_interfaces,
        unrouted,
        hosted_pods,
        warnings,
        node_views,
    }
}

fn cidr_list(cidrs: &[IpNet]) -> String {
    if cidrs.is_empty() {
        return "(none)".into();
    }
    cidrs
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The hybrid overlay as this node sees it, when the `Network` turns it on and this node has
/// an IPv4 pod subnet (its router address lies in it).
fn hybrid_view(
    state: &ClusterState,
    this_node: &str,
    own_cidrs: &[IpNet],
    underlay_mtu: u32,
    warnings: &mut Vec<String>,
) -> Option<HybridView> {
    let settings = state.hybrid?;
    let Some(router_ip) = hybrid::router_ip(own_cidrs) else {
        warnings.push(format!(
            "node {this_node}: the hybrid overlay needs an IPv4 spec.podCIDRs of /29 or wider;              hybrid nodes not reached"
        ));
        return None;
    };
    let this = state
        .nodes
        .iter()
        .find(|n| n.metadata.name.as_deref() == Some(this_node))
        .map(|n| &**n);
    Some(HybridView {
        settings,
        nodes: hybrid::hybrid_nodes(&state.nodes, &settings, warnings),
        router_ip,
        router_mac: hybrid::own_router_mac(this, router_ip),
        underlay_mtu,
        // Known once the management port exists (`crate::mgmt::sync`).
        mgmt_ifindex: 0,
    })
}

fn node_view(node: &Node, warnings: &mut Vec<String>) -> Option<NodeView> {
    let name = node.metadata.name.clone()?;
    let addresses = internal_ips(node)
        .filter_map(|address| match address.parse::<IpAddr>() {
            Ok(ip) => Some(ip),
            Err(_) => {
                warnings.push(format!(
                    "node {name}: status.addresses InternalIP {address:?} is not an address"
                ));
                None
            }
        })
        .collect();
    let spec = node.spec.as_ref();
    let cidrs: Vec<String> = match spec.and_then(|s| s.pod_cidrs.clone()) {
        // A hybrid node's pods are reached by the subnet it announces, in VXLAN
        // (`crate::hybrid`), whatever podCIDRs the cluster gave it.
        _ if hybrid::is_hybrid_node(node) => Vec::new(),
        Some(cidrs) if !cidrs.is_empty() => cidrs,
        _ => match spec.and_then(|s| s.pod_cidr.clone()) {
            Some(cidr) => vec![cidr],
            // No subnet from the cluster: the one the controller allocated (OpenShift runs no
            // kube-controller-manager allocation), as OVN-Kubernetes' cluster manager writes it.
            None => allocated_subnets(node, &name, warnings),
        },
    };
    let pod_cidrs = cidrs
        .iter()
        .filter_map(|c| match c.parse::<IpNet>() {
            Ok(net) => Some(net),
            Err(_) => {
                warnings.push(format!("node {name}: spec.podCIDRs {c:?} is not a CIDR"));
                None
            }
        })
        .collect();
    let created = node
        .metadata
        .creation_timestamp
        .as_ref()
        .map_or(i64::MAX, |t| t.0.as_second());
    Some(NodeView {
        name,
        addresses,
        pod_cidrs,
        created,
    })
}

/// The node's `k8s.ovn.org/node-subnets` (written by the controller), as CIDR texts; a bad
/// value is a warning naming the node, and no subnet.
fn allocated_subnets(node: &Node, name: &str, warnings: &mut Vec<String>) -> Vec<String> {
    let Some(text) = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(subnets::NODE_SUBNETS_ANNOTATION))
    else {
        return Vec::new();
    };
    match subnets::parse_node_subnets(text) {
        Ok(nets) => nets.iter().map(ToString::to_string).collect(),
        Err(error) => {
            warnings.push(format!("node {name}: {error}"));
            Vec::new()
        }
    }
}

pub(crate) fn pod_name(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or("<unnamed>")
    )
}

/// Whether the pod is a live, pod-network pod scheduled on `node`.
pub(crate) fn runs_on(pod: &Pod, node: &str) -> bool {
    in_pod_network(pod) && pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
}

/// Whether the pod is a live pod-network pod (not host-network, not finished).
pub(crate) fn in_pod_network(pod: &Pod) -> bool {
    let Some(spec) = &pod.spec else { return false };
    let finished = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Succeeded" || p == "Failed");
    spec.host_network != Some(true) && !finished
}

/// The pod's addresses (`status.podIPs`, else `status.podIP`); one warning per unparsable one.
pub(crate) fn pod_addresses(pod: &Pod, warnings: &mut Vec<String>) -> Vec<IpAddr> {
    let status = pod.status.as_ref();
    // Read in place: every pod of the cluster passes here at a full sync.
    let listed = status
        .and_then(|s| s.pod_ips.as_deref())
        .unwrap_or_default();
    let texts: Vec<&str> = if listed.is_empty() {
        status
            .and_then(|s| s.pod_ip.as_deref())
            .into_iter()
            .collect()
    } else {
        listed.iter().map(|p| p.ip.as_str()).collect()
    };
    texts
        .into_iter()
        .filter_map(|t| match t.parse() {
            Ok(ip) => Some(ip),
            Err(_) => {
                warnings.push(format!(
                    "pod {}: status.podIPs {t:?} is not an address",
                    pod_name(pod)
                ));
                None
            }
        })
        .collect()
}

/// The pod's MAC: the one OVN-Kubernetes' annotation names, else derived from its IPv4
/// address as OVN-Kubernetes does (0a:58 followed by the four address bytes).
pub(crate) fn pod_mac(
    pod: &Pod,
    addresses: &[IpAddr],
    warnings: &mut Vec<String>,
) -> Option<[u8; 6]> {
    let annotation = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(POD_NETWORKS_ANNOTATION));
    if let Some(text) = annotation {
        let parsed = serde_json::from_str::<serde_json::Value>(text)
            .ok()
            .and_then(|v| v["default"]["mac_address"].as_str().map(str::to_owned))
            .and_then(|m| crate::kernel::netdev::parse_mac(&m));
        match parsed {
            Some(mac) => return Some(mac),
            None => warnings.push(format!(
                "pod {}: annotation {POD_NETWORKS_ANNOTATION} has no valid default.mac_address",
                pod_name(pod)
            )),
        }
    }
    derived_pod_mac(addresses)
}

/// The MAC OVN-Kubernetes gives a pod: 0a:58 and its IPv4 address, or for an IPv6-only pod
/// the last four bytes of its IPv6 address.
pub fn derived_pod_mac(addresses: &[IpAddr]) -> Option<[u8; 6]> {
    let last4 = |a: &IpAddr| match a {
        IpAddr::V4(v4) => v4.octets(),
        IpAddr::V6(v6) => {
            let o = v6.octets();
            [o[12], o[13], o[14], o[15]]
        }
    };
    let chosen = addresses
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addresses.first())?;
    let o = last4(chosen);
    Some([0x0a, 0x58, o[0], o[1], o[2], o[3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_macs_follow_ovn_kubernetes() {
        let v4: IpAddr = "10.244.1.3".parse().unwrap();
        let v6: IpAddr = "fd00::1:2:3:4".parse().unwrap();
        assert_eq!(
            derived_pod_mac(&[v6, v4]),
            Some([0x0a, 0x58, 10, 244, 1, 3])
        );
        assert_eq!(derived_pod_mac(&[v6]), Some([0x0a, 0x58, 0, 3, 0, 4]));
        assert_eq!(derived_pod_mac(&[]), None);
    }
    use crate::{api::network::OvnKubernetesConfig, source::add_documents};

    const CLUSTER: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: a}
spec: {podCIDRs: [10.244.1.0/24, "fd00:10:244:1::/64"]}
status: {addresses: [{type: InternalIP, address: 10.99.0.1}, {type: Hostname, address: a}]}
---
apiVersion: v1
kind: Node
metadata: {name: b}
spec: {podCIDR: 10.244.2.0/24}
status: {addresses: [{type: InternalIP, address: 10.99.0.2}]}
---
apiVersion: v1
kind: Pod
metadata:
  name: annotated
  namespace: shop
  annotations: {k8s.ovn.org/pod-networks: '{"default":{"ip_addresses":["10.244.1.2/24"],"mac_address":"0a:58:0a:f4:01:99"}}'}
spec: {nodeName: a, containers: [{name: c, image: i}]}
status: {phase: Running, podIPs: [{ip: 10.244.1.2}, {ip: "fd00:10:244:1::2"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: derived, namespace: shop}
spec: {nodeName: a, containers: [{name: c, image: i}]}
status: {phase: Running, podIP: 10.244.1.3}
---
apiVersion: v1
kind: Pod
metadata: {name: elsewhere}
spec: {nodeName: b, containers: [{name: c, image: i}]}
status: {podIPs: [{ip: 10.244.2.2}]}
---
apiVersion: v1
kind: Pod
metadata: {name: host}
spec: {nodeName: a, hostNetwork: true, containers: [{name: c, image: i}]}
status: {podIPs: [{ip: 10.99.0.1}]}
---
apiVersion: v1
kind: Pod
metadata: {name: done}
spec: {nodeName: a, containers: [{name: c, image: i}]}
status: {phase: Succeeded, podIPs: [{ip: 10.244.1.9}]}
---
apiVersion: v1
kind: Pod
metadata: {name: squatter}
spec: {nodeName: a, containers: [{name: c, image: i}]}
status: {podIPs: [{ip: 10.244.2.9}]}
---
apiVersion: v1
kind: Pod
metadata: {name: unwired}
spec: {nodeName: a, containers: [{name: c, image: i}]}
status: {podIPs: [{ip: 10.244.1.7}]}
"#;

    #[test]
    fn builds_this_nodes_view_from_objects() {
        let mut state = ClusterState::default();
        add_documents(&mut state, "cluster.yaml", CLUSTER);
        let underlay = Underlay {
            ifindex: 2,
            mac: [2, 0, 0, 0, 0, 1],
            xdp_forward: false,
            nodeport_listed: false,
            mtu: 1500,
        };
        let settings = OvnKubernetesConfig::default()
            .validate(1500)
            .expect("settings");
        let interfaces = |ip: IpAddr| {
            let name = match ip.to_string().as_str() {
                "10.244.1.2" => "vp0",
                "10.244.1.3" => "vp1",
                "10.244.2.9" => "vp2",
                _ => return None,
            };
            Some(HostInterface {
                name: name.into(),
                ifindex: 10,
                mac: [2, 0, 0, 0, 1, 1],
                takes_xdp: false,
            })
        };
        let hosted = HostedPods::from_pods(&state.pods, "a");
        let model = build(&state, &hosted, None, "a", underlay, settings, interfaces);
        assert_eq!(model.view.nodes.len(), 2);
        assert_eq!(
            model.view.nodes[0].addresses,
            vec!["10.99.0.1".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(model.view.nodes[0].pod_cidrs.len(), 2);
        assert_eq!(
            model.view.nodes[1].pod_cidrs,
            vec!["10.244.2.0/24".parse::<IpNet>().unwrap()]
        );
        let pods: Vec<(&str, [u8; 6], usize)> = model
            .view
            .local_pods
            .iter()
            .map(|p| (p.name.as_str(), p.pod_mac, p.addresses.len()))
            .collect();
        assert_eq!(
            pods,
            vec![
                ("shop/annotated", [0x0a, 0x58, 0x0a, 0xf4, 0x01, 0x99], 2),
                ("shop/derived", [0x0a, 0x58, 10, 244, 1, 3], 1),
            ]
        );
        assert_eq!(
            model.pod_interfaces,
            vec!["vp0".to_owned(), "vp1".to_owned()]
        );
        assert_eq!(
            model.warnings,
            vec![
                "pod default/squatter: status.podIPs 10.244.2.9 is outside node a's \
                 spec.podCIDRs 10.244.1.0/24, fd00:10:244:1::/64; not wired"
                    .to_owned(),
                "pod default/unwired: no host route to 10.244.1.7 yet; not wired".to_owned()
            ]
        );
    }
}

#[cfg(test)]
mod hosted_tests {
    use super::*;
    use crate::{
        changes::{
            Stage,
            tests::{BASE, state},
        },
        source::{PodSpec, PodStatus},
    };

    fn pod(namespace: &str, name: &str, node: &str, phase: &str) -> Arc<Pod> {
        let mut pod = Pod::default();
        pod.metadata.namespace = Some(namespace.into());
        pod.metadata.name = Some(name.into());
        pod.spec = Some(PodSpec {
            node_name: Some(node.into()),
            ..PodSpec::default()
        });
        pod.status = Some(PodStatus {
            phase: Some(phase.into()),
            ..PodStatus::default()
        });
        Arc::new(pod)
    }

    fn keys(hosted: &HostedPods) -> Vec<String> {
        hosted.iter().map(|p| pod_name(p)).collect()
    }

    /// Patched with each sync's changes, this node's pods are those a fresh pass finds: pods
    /// moved here or away, added, removed and finished, over many random steps.
    #[test]
    fn the_hosted_pods_patched_by_changes_equal_a_fresh_pass() {
        let mut rng = crate::test_rng::TestRng::new(7);
        let mut next = |n: u64| rng.below(n);
        let mut pods: BTreeMap<(String, String), Arc<Pod>> = BTreeMap::new();
        let state_of = |pods: &BTreeMap<(String, String), Arc<Pod>>| ClusterState {
            pods: pods.values().cloned().collect(),
            ..ClusterState::default()
        };
        let mut last = state_of(&pods);
        let mut hosted = HostedPods::from_pods(&last.pods, "a");
        let mut seen_here = 0;
        for _ in 0..400 {
            let namespace = format!("ns-{}", next(3));
            let name = format!("p-{}", next(20));
            let key = (namespace.clone(), name.clone());
            if next(5) == 0 {
                pods.remove(&key);
            } else {
                let node = ["a", "b"][next(2) as usize];
                let phase = ["Running", "Running", "Succeeded"][next(3) as usize];
                pods.insert(key, pod(&namespace, &name, node, phase));
            }
            let state = state_of(&pods);
            hosted.follow(&state, &Changes::between(&last, &state));
            let fresh = HostedPods::from_pods(&state.pods, "a");
            assert_eq!(keys(&hosted), keys(&fresh));
            seen_here += fresh.pods.len();
            last = state;
        }
        assert!(seen_here > 0, "some steps had pods here");
    }

    /// A changed pod of this node (before or after) runs the overlay too; one elsewhere, or
    /// a label alone, does not.
    #[test]
    fn a_pod_change_runs_the_overlay_only_for_this_nodes_pods() {
        let address =
            |t: &str| t.replace("podIPs: [{ip: 10.244.1.5}]", "podIPs: [{ip: 10.244.1.7}]");
        let (old, new) = (state(BASE), state(&address(BASE)));
        let pod = new.pods.first().expect("pod");
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .expect("node");
        for (here, hosted_before) in [(node.as_str(), true), ("elsewhere", false)] {
            let hosted = HostedPods::from_pods(&old.pods, here);
            assert_eq!(hosted.iter().next().is_some(), hosted_before);
            let mut changes = Changes::between(&old, &new);
            hosted.note_changes(&mut changes);
            assert_eq!(changes.runs(Stage::Overlay), hosted_before, "{here}");
            assert!(changes.runs(Stage::AccessControl));
        }
        // Moved here: hosted after the change.
        let moved = |t: &str| address(t).replace(&format!("nodeName: {node}"), "nodeName: other");
        let away = state(&moved(BASE));
        let hosted = HostedPods::from_pods(&away.pods, "other");
        let mut changes = Changes::between(&old, &away);
        HostedPods::from_pods(&old.pods, "other").note_changes(&mut changes);
        assert!(changes.runs(Stage::Overlay), "a pod arriving here");
        assert!(hosted.iter().next().is_some());
        let relabelled = state(&BASE.replace("labels: {app: web}", "labels: {app: shop}"));
        let mut changes = Changes::between(&old, &relabelled);
        HostedPods::from_pods(&old.pods, &node).note_changes(&mut changes);
        assert!(!changes.runs(Stage::Overlay), "a label alone");
    }
}

#[cfg(test)]
mod reuse_tests {
    use super::*;
    use crate::source::add_documents;

    fn state(nodes: usize) -> ClusterState {
        let mut yaml = String::new();
        for i in 0..nodes {
            yaml += &format!(
                "apiVersion: v1\nkind: Node\nmetadata: {{name: n{i:02}}}\nspec: {{podCIDR: 10.244.{i}.0/24}}\n\
                 status: {{addresses: [{{type: InternalIP, address: 10.99.0.{}}}]}}\n---\n",
                i + 1
            );
        }
        yaml += "apiVersion: v1\nkind: Node\nmetadata: {name: zz}\nspec: {podCIDR: bad}\n\
                 status: {addresses: [{type: InternalIP, address: 10.99.1.1}]}\n";
        let mut state = ClusterState::default();
        add_documents(&mut state, "nodes.yaml", &yaml);
        state
    }

    fn build_over(state: &ClusterState, last: Option<&NodeModel>) -> NodeModel {
        let underlay = Underlay {
            ifindex: 2,
            mac: [2, 0, 0, 0, 0, 1],
            xdp_forward: false,
            nodeport_listed: false,
            mtu: 1500,
        };
        let settings = crate::api::network::OvnKubernetesConfig::default()
            .validate(1500)
            .expect("settings");
        let hosted = HostedPods::from_pods(&state.pods, "n00");
        build(state, &hosted, last, "n00", underlay, settings, |_| None)
    }

    /// A build over the same Node list keeps the last model's node views and their warnings;
    /// a changed list builds them anew.
    #[test]
    fn the_node_views_are_kept_while_no_node_changed() {
        let first_state = state(20);
        let first = build_over(&first_state, None);
        assert_eq!(first.view.nodes.len(), 21);
        assert_eq!(first.warnings.len(), 1, "{:?}", first.warnings);
        let again = build_over(&first_state.clone(), Some(&first));
        assert!(Arc::ptr_eq(&again.view.nodes, &first.view.nodes));
        assert_eq!(again.warnings, first.warnings);
        let more = state(21);
        let rebuilt = build_over(&more, Some(&again));
        assert!(!Arc::ptr_eq(&rebuilt.view.nodes, &first.view.nodes));
        assert_eq!(rebuilt.view.nodes.len(), 22);
        assert_eq!(rebuilt.warnings, first.warnings);
    }

    /// A Node added, one changed and one removed: the build over the last model gives what a
    /// build from nothing gives, views and warnings, and keeps the other nodes' views (the
    /// same objects, not views made again).
    #[test]
    fn only_the_changed_nodes_get_views_made_again() {
        let first_state = state(20);
        let first = build_over(&first_state, None);
        let node = |yaml: &str| {
            let mut parsed = ClusterState::default();
            add_documents(&mut parsed, "node.yaml", yaml);
            Arc::clone(parsed.nodes.first().expect("a node"))
        };
        let mut changed = first_state.clone();
        // n05 moves to another address, n07 goes, n10a comes (between n10 and n11).
        changed.nodes[5] = node(
            "apiVersion: v1\nkind: Node\nmetadata: {name: n05}\nspec: {podCIDR: 10.244.5.0/24}\n\
             status: {addresses: [{type: InternalIP, address: 10.99.9.9}]}\n",
        );
        changed.nodes.remove(7);
        changed.nodes.insert(
            10,
            node(
                "apiVersion: v1\nkind: Node\nmetadata: {name: n10a}\nspec: {podCIDR: bad}\n\
                 status: {addresses: [{type: InternalIP, address: 10.99.2.1}]}\n",
            ),
        );
        let patched = build_over(&changed, Some(&first));
        let fresh = build_over(&changed, None);
        assert_eq!(patched.view.nodes, fresh.view.nodes);
        assert_eq!(patched.warnings, fresh.warnings);
        assert_eq!(patched.warnings.len(), 2, "{:?}", patched.warnings);
        let kept = |name: &str| {
            let find = |m: &NodeModel| {
                m.view
                    .nodes
                    .iter()
                    .find(|n| n.name == name)
                    .cloned()
                    .expect("a view")
            };
            Arc::ptr_eq(&find(&patched), &find(&first))
        };
        assert!(kept("n04") && kept("n06") && kept("n08") && kept("n19"));
        assert!(!kept("n05"));
    }

    /// Node lists changed at random, step by step (nodes added in name order, removed,
    /// moved; nodes with a bad CIDR, which warn; nodes without a name, which give no view;
    /// now and then a list out of name order, as a manifest directory's): each build over the
    /// last gives the views and warnings a build from nothing gives, and keeps the views of
    /// the objects both lists share.
    #[test]
    fn node_views_patched_step_by_step_equal_those_built_anew() {
        use k8s_openapi::{
            api::core::v1::{NodeAddress, NodeSpec, NodeStatus},
            apimachinery::pkg::apis::meta::v1::ObjectMeta,
        };
        let node = |name: Option<String>, address: u64, cidr: &str| {
            Arc::new(Node {
                metadata: ObjectMeta {
                    name,
                    ..ObjectMeta::default()
                },
                spec: Some(NodeSpec {
                    pod_cidr: Some(cidr.to_owned()),
                    ..NodeSpec::default()
                }),
                status: Some(NodeStatus {
                    addresses: Some(vec![NodeAddress {
                        type_: "InternalIP".into(),
                        address: format!("10.99.{}.{}", address / 250, address % 250 + 1),
                    }]),
                    ..NodeStatus::default()
                }),
            })
        };
        let named = |i: u64| Some(format!("n{i:04}"));
        let mut rng = crate::test_rng::TestRng::new(11);
        let mut state = ClusterState::default();
        for i in 0..30 {
            state.nodes.push(node(named(i * 10), i, "10.244.0.0/24"));
        }
        let mut last = build_over(&state, None);
        let (mut checked, mut unviewed, mut warned) = (0, 0, 0);
        for step in 0..600 {
            let mut changed = state.clone();
            for _ in 0..=rng.below(3) {
                let len = changed.nodes.len();
                let at = rng.below(len as u64 + 1) as usize;
                match rng.below(8) {
                    0 | 1 => {
                        let i = rng.below(400);
                        let place = changed
                            .nodes
                            .iter()
                            .position(|n| n.metadata.name >= named(i))
                            .unwrap_or(len);
                        if changed
                            .nodes
                            .get(place)
                            .is_none_or(|n| n.metadata.name != named(i))
                        {
                            changed
                                .nodes
                                .insert(place, node(named(i), i, "10.244.0.0/24"));
                        }
                    }
                    2 if len > 1 => {
                        changed.nodes.remove(at.min(len - 1));
                    }
                    3 | 4 if len > 0 => {
                        let at = at.min(len - 1);
                        let name = changed.nodes[at].metadata.name.clone();
                        let cidr = if rng.below(3) == 0 {
                            "bad"
                        } else {
                            "10.244.1.0/24"
                        };
                        changed.nodes[at] = node(name, rng.below(1000), cidr);
                    }
                    5 if rng.below(4) == 0 => {
                        changed.nodes.insert(at, node(None, 7, "10.244.2.0/24"));
                    }
                    6 if len > 1 && rng.below(8) == 0 => {
                        let other = rng.below(len as u64) as usize;
                        let (a, b) = (at.min(len - 1), other);
                        let first = changed.nodes[a].clone();
                        changed.nodes[a] = changed.nodes[b].clone();
                        changed.nodes[b] = first;
                    }
                    // The list put back in name order, without unnamed nodes or bad CIDRs.
                    7 => {
                        let bad = |n: &Node| {
                            n.spec.as_ref().and_then(|s| s.pod_cidr.as_deref()) == Some("bad")
                        };
                        let mut nodes: Vec<Arc<Node>> = changed
                            .nodes
                            .iter()
                            .filter(|n| n.metadata.name.is_some() && !bad(n))
                            .cloned()
                            .collect();
                        nodes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
                        nodes.dedup_by(|a, b| a.metadata.name == b.metadata.name);
                        changed.nodes = Objects::default();
                        for node in nodes {
                            changed.nodes.push(node);
                        }
                    }
                    _ => {}
                }
            }
            let patched = build_over(&changed, Some(&last));
            let fresh = build_over(&changed, None);
            let values = |m: &NodeModel| {
                m.view
                    .nodes
                    .iter()
                    .map(|n| (**n).clone())
                    .collect::<Vec<_>>()
            };
            assert_eq!(values(&patched), values(&fresh), "step {step}");
            assert_eq!(patched.warnings, fresh.warnings, "step {step}");
            assert_eq!(
                patched.node_views.all_viewed(),
                fresh.node_views.all_viewed()
            );
            assert_eq!(patched.node_views.warned, fresh.node_views.warned);
            // Where both lists are in name order, the walk finds every object they share.
            let ordered = |nodes: &Objects<Node>| {
                let names: Vec<_> = nodes.iter().map(|n| n.metadata.name.clone()).collect();
                names.iter().all(Option::is_some) && names.windows(2).all(|w| w[0] < w[1])
            };
            let both_ordered = ordered(&state.nodes) && ordered(&changed.nodes);
            for (object, built) in changed.nodes.iter().zip(patched.node_views.built.iter()) {
                let before = state
                    .nodes
                    .iter()
                    .zip(last.node_views.built.iter())
                    .find(|(o, _)| Arc::ptr_eq(o, object));
                if let (true, Some((_, was)), Some(view)) = (both_ordered, before, &built.view) {
                    let kept = was.view.as_ref().is_some_and(|v| Arc::ptr_eq(v, view));
                    assert!(kept, "step {step}: a shared object's view was made again");
                }
            }
            checked += usize::from(both_ordered);
            unviewed += usize::from(!fresh.node_views.all_viewed());
            warned += usize::from(fresh.node_views.warned > 0);
            state = changed;
            last = patched;
        }
        assert!(checked > 200, "{checked}");
        assert!(unviewed > 50 && unviewed < 550, "{unviewed}");
        assert!(warned > 50 && warned < 550, "{warned}");
    }
}
