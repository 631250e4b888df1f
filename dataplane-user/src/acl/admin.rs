//! Cluster-wide admin policies: `AdminNetworkPolicy` and `BaselineAdminNetworkPolicy`
//! (`policy.networking.k8s.io/v1alpha1`) and their successor `ClusterNetworkPolicy`
//! (`policy.networking.k8s.io/v1alpha2`, `tier: Admin | Baseline`), on one tier model.
//!
//! Evaluation order, per direction and per subject pod (the client's egress and the server's
//! ingress are judged apart, each with its own subject):
//! 1. the admin tier: policies by ascending priority (equal priorities by name, with a warning
//!    that the API leaves their order undefined), rules in order, the first match decides;
//!    `Allow`/`Accept` and `Deny` are final, `Pass` skips the rest of the admin tier;
//! 2. NetworkPolicy, when one isolates the pod in that direction (what none allows is denied);
//! 3. otherwise the baseline tier (the BANP `default`, Baseline-tier ClusterNetworkPolicies by
//!    priority): `Allow`/`Accept` or `Deny`;
//! 4. nothing matched: allowed.
//!
//! The three tiers are compiled into the pod's one policy set per direction (see
//! [`super::compile_tiered`]): the kernel does the same lookups whatever the number of admin
//! policies, rules and peers.
//!
//! Validation rejects an object whole, naming it and the field; the agent keeps the last good
//! version of an object that turns invalid (an object never valid has no effect).
//!
//! One piece (about 850 lines): the three kinds' validation onto one tier model and that
//! model's compile are kept together so that what is accepted and what is compiled cannot
//! drift apart; the kinds' types are in `api::adminpolicy`.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

use ipnet::IpNet;
use k8s_openapi::{api::core::v1::Node, apimachinery::pkg::apis::meta::v1::LabelSelector};

use crate::api::adminpolicy::{
    AdminEgressPeer, AdminEgressRule, AdminIngressPeer, AdminIngressRule, AdminNetworkPolicy,
    AdminObjects, AdminPort, AdminSubject, BASELINE_NAME, BaselineAdminNetworkPolicy,
    ClusterNetworkPolicy, ClusterPort, ClusterProtocol, MAX_NETWORKS, MAX_PEERS, MAX_PRIORITY,
    MAX_RULES, NamespacedPod,
};

use super::{
    PROTO_SCTP, PROTO_TCP, PROTO_UDP, PortMatch, Ports, Rule, Verdict,
    audit::{ACL_LOGGING_ANNOTATION, NamespaceLogging, parse_annotation},
    dns::normalize,
    pod_rules::{PodRules, PolicyKind, PortSpec, RuleRef, Tier, add_pod_peers, resolve},
    pods::{Direction, PolicyPod, selects},
    protocol_number,
    select::{PolicyCluster, select_pods},
};

/// What a rule does with what it matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Allow,
    Deny,
    Pass,
}

impl Action {
    fn verdict(self) -> Verdict {
        match self {
            Action::Allow => Verdict::Allow,
            Action::Deny => Verdict::Deny,
            Action::Pass => Verdict::Pass,
        }
    }
}

/// Pods chosen by namespace labels and, optionally, pod labels.
#[derive(Clone, Debug, PartialEq)]
pub struct PodChoice {
    pub namespaces: LabelSelector,
    pub pods: Option<LabelSelector>,
}

/// A validated peer.
#[derive(Clone, Debug, PartialEq)]
pub enum Peer {
    Pods(PodChoice),
    Nodes(LabelSelector),
    Networks(Vec<IpNet>),
    /// Normalized names (lower case, no trailing dot).
    DomainNames(Vec<String>),
}

/// A validated rule.
#[derive(Clone, Debug, PartialEq)]
pub struct AdminRule {
    /// Index in the object's `ingress` or `egress` list.
    pub index: usize,
    pub name: String,
    pub action: Action,
    pub peers: Vec<Peer>,
    /// Empty: every protocol and port.
    pub ports: Vec<PortSpec>,
}

/// A validated AdminNetworkPolicy, BaselineAdminNetworkPolicy or ClusterNetworkPolicy.
#[derive(Clone, Debug, PartialEq)]
pub struct AdminPolicy {
    pub kind: PolicyKind,
    pub name: String,
    pub tier: Tier,
    /// 0 for the BANP.
    pub priority: i32,
    pub subject: PodChoice,
    pub ingress: Vec<AdminRule>,
    pub egress: Vec<AdminRule>,
    /// The `k8s.ovn.org/acl-logging` annotation's levels.
    pub log: Option<NamespaceLogging>,
}

impl AdminPolicy {
    fn rules(&self, direction: Direction) -> &[AdminRule] {
        match direction {
            Direction::Ingress => &self.ingress,
            Direction::Egress => &self.egress,
        }
    }
}

/// Validates an AdminNetworkPolicy. The error names the object and the field.
pub fn from_admin(object: &AdminNetworkPolicy) -> Result<AdminPolicy, String> {
    let name = object.metadata.name.clone().unwrap_or_default();
    let at = |e: String| format!("AdminNetworkPolicy {name}: {e}");
    let spec = &object.spec;
    let priority = priority(spec.priority).map_err(at)?;
    let log = logging(object.metadata.annotations.as_ref()).map_err(at)?;
    Ok(AdminPolicy {
        kind: PolicyKind::AdminNetworkPolicy,
        name: name.clone(),
        tier: Tier::Admin,
        priority,
        subject: subject(&spec.subject).map_err(at)?,
        ingress: v1alpha1_rules(&spec.ingress, Tier::Admin).map_err(at)?,
        egress: v1alpha1_egress(&spec.egress, Tier::Admin).map_err(at)?,
        log,
    })
}

/// Validates a BaselineAdminNetworkPolicy (only the one named `default` counts).
pub fn from_baseline(object: &BaselineAdminNetworkPolicy) -> Result<AdminPolicy, String> {
    let name = object.metadata.name.clone().unwrap_or_default();
    let at = |e: String| format!("BaselineAdminNetworkPolicy {name}: {e}");
    if name != BASELINE_NAME {
        return Err(at(format!(
            "metadata.name: only the one named {BASELINE_NAME:?} counts"
        )));
    }
    let spec = &object.spec;
    Ok(AdminPolicy {
        kind: PolicyKind::BaselineAdminNetworkPolicy,
        name: name.clone(),
        tier: Tier::Baseline,
        priority: 0,
        subject: subject(&spec.subject).map_err(at)?,
        ingress: v1alpha1_rules(&spec.ingress, Tier::Baseline).map_err(at)?,
        egress: v1alpha1_egress(&spec.egress, Tier::Baseline).map_err(at)?,
        log: logging(object.metadata.annotations.as_ref()).map_err(at)?,
    })
}

/// Validates a ClusterNetworkPolicy.
pub fn from_cluster(object: &ClusterNetworkPolicy) -> Result<AdminPolicy, String> {
    let name = object.metadata.name.clone().unwrap_or_default();
    let at = |e: String| format!("ClusterNetworkPolicy {name}: {e}");
    let spec = &object.spec;
    let tier = match spec.tier.as_str() {
        "Admin" => Tier::Admin,
        "Baseline" => Tier::Baseline,
        other => return Err(at(format!("spec.tier: {other:?} is not Admin or Baseline"))),
    };
    let mut ingress = Vec::new();
    check_count("spec.ingress", spec.ingress.len(), MAX_RULES).map_err(at)?;
    for (index, rule) in spec.ingress.iter().enumerate() {
        let field = format!("spec.ingress[{index}]");
        let action =
            cluster_action(&rule.action, tier).map_err(|e| at(format!("{field}.action: {e}")))?;
        let peers = ingress_peers(&rule.from).map_err(|e| at(format!("{field}.{e}")))?;
        let ports =
            cluster_ports(rule.protocols.as_deref()).map_err(|e| at(format!("{field}.{e}")))?;
        ingress.push(rule_of(index, rule.name.as_ref(), action, peers, ports));
    }
    let mut egress = Vec::new();
    check_count("spec.egress", spec.egress.len(), MAX_RULES).map_err(at)?;
    for (index, rule) in spec.egress.iter().enumerate() {
        let field = format!("spec.egress[{index}]");
        let action =
            cluster_action(&rule.action, tier).map_err(|e| at(format!("{field}.action: {e}")))?;
        let peers = egress_peers(&rule.to, action).map_err(|e| at(format!("{field}.{e}")))?;
        let ports =
            cluster_ports(rule.protocols.as_deref()).map_err(|e| at(format!("{field}.{e}")))?;
        check_named_ports(&peers, &ports).map_err(|e| at(format!("{field}: {e}")))?;
        egress.push(rule_of(index, rule.name.as_ref(), action, peers, ports));
    }
    Ok(AdminPolicy {
        kind: PolicyKind::ClusterNetworkPolicy,
        name: name.clone(),
        tier,
        priority: priority(spec.priority).map_err(at)?,
        subject: subject(&spec.subject).map_err(at)?,
        ingress,
        egress,
        log: logging(object.metadata.annotations.as_ref()).map_err(at)?,
    })
}

fn rule_of(
    index: usize,
    name: Option<&String>,
    action: Action,
    peers: Vec<Peer>,
    ports: Vec<PortSpec>,
) -> AdminRule {
    AdminRule {
        index,
        name: name.cloned().unwrap_or_default(),
        action,
        peers,
        ports,
    }
}

fn priority(value: i32) -> Result<i32, String> {
    if (0..=MAX_PRIORITY).contains(&value) {
        Ok(value)
    } else {
        Err(format!(
            "spec.priority: {value} is outside 0 to {MAX_PRIORITY}"
        ))
    }
}

fn logging(
    annotations: Option<&BTreeMap<String, String>>,
) -> Result<Option<NamespaceLogging>, String> {
    match annotations.and_then(|a| a.get(ACL_LOGGING_ANNOTATION)) {
        None => Ok(None),
        Some(text) => parse_annotation(text)
            .map(Some)
            .map_err(|e| format!("metadata.annotations[{ACL_LOGGING_ANNOTATION}]: {e}")),
    }
}

fn check_count(field: &str, count: usize, max: usize) -> Result<(), String> {
    if count > max {
        return Err(format!(
            "{field}: {count} entries, more than the {max} allowed"
        ));
    }
    Ok(())
}

fn selector(field: &str, selector: &LabelSelector) -> Result<LabelSelector, String> {
    crate::api::egressip::validate_selector(selector).map_err(|e| format!("{field}.{e}"))?;
    Ok(selector.clone())
}

fn pod_choice(field: &str, pods: &NamespacedPod) -> Result<PodChoice, String> {
    Ok(PodChoice {
        namespaces: selector(
            &format!("{field}.namespaceSelector"),
            &pods.namespace_selector,
        )?,
        pods: Some(selector(
            &format!("{field}.podSelector"),
            &pods.pod_selector,
        )?),
    })
}

fn subject(subject: &AdminSubject) -> Result<PodChoice, String> {
    match (&subject.namespaces, &subject.pods) {
        (Some(namespaces), None) => Ok(PodChoice {
            namespaces: selector("spec.subject.namespaces", namespaces)?,
            pods: None,
        }),
        (None, Some(pods)) => pod_choice("spec.subject.pods", pods),
        _ => Err("spec.subject: needs exactly one of namespaces and pods".into()),
    }
}

fn action(text: &str, tier: Tier, allow: &str) -> Result<Action, String> {
    match (text, tier) {
        (t, _) if t == allow => Ok(Action::Allow),
        ("Deny", _) => Ok(Action::Deny),
        ("Pass", Tier::Admin) => Ok(Action::Pass),
        ("Pass", Tier::Baseline) => Err("Pass is not allowed in a baseline policy".into()),
        (other, Tier::Admin) => Err(format!("{other:?} is not {allow}, Deny or Pass")),
        (other, Tier::Baseline) => Err(format!("{other:?} is not {allow} or Deny")),
    }
}

fn cluster_action(text: &str, tier: Tier) -> Result<Action, String> {
    action(text, tier, "Accept")
}

fn v1alpha1_rules(rules: &[AdminIngressRule], tier: Tier) -> Result<Vec<AdminRule>, String> {
    check_count("spec.ingress", rules.len(), MAX_RULES)?;
    let mut out = Vec::new();
    for (index, rule) in rules.iter().enumerate() {
        let field = format!("spec.ingress[{index}]");
        let action =
            action(&rule.action, tier, "Allow").map_err(|e| format!("{field}.action: {e}"))?;
        let peers = ingress_peers(&rule.from).map_err(|e| format!("{field}.{e}"))?;
        let ports = admin_ports(rule.ports.as_deref()).map_err(|e| format!("{field}.{e}"))?;
        out.push(rule_of(index, rule.name.as_ref(), action, peers, ports));
    }
    Ok(out)
}

fn v1alpha1_egress(rules: &[AdminEgressRule], tier: Tier) -> Result<Vec<AdminRule>, String> {
    check_count("spec.egress", rules.len(), MAX_RULES)?;
    let mut out = Vec::new();
    for (index, rule) in rules.iter().enumerate() {
        let field = format!("spec.egress[{index}]");
        let action =
            action(&rule.action, tier, "Allow").map_err(|e| format!("{field}.action: {e}"))?;
        let peers = egress_peers(&rule.to, action).map_err(|e| format!("{field}.{e}"))?;
        let ports = admin_ports(rule.ports.as_deref()).map_err(|e| format!("{field}.{e}"))?;
        check_named_ports(&peers, &ports).map_err(|e| format!("{field}: {e}"))?;
        out.push(rule_of(index, rule.name.as_ref(), action, peers, ports));
    }
    Ok(out)
}

fn ingress_peers(peers: &[AdminIngressPeer]) -> Result<Vec<Peer>, String> {
    check_peer_count("from", peers.len())?;
    peers
        .iter()
        .enumerate()
        .map(|(p, peer)| {
            let field = format!("from[{p}]");
            match (&peer.namespaces, &peer.pods) {
                (Some(namespaces), None) => Ok(Peer::Pods(PodChoice {
                    namespaces: selector(&format!("{field}.namespaces"), namespaces)?,
                    pods: None,
                })),
                (None, Some(pods)) => Ok(Peer::Pods(pod_choice(&format!("{field}.pods"), pods)?)),
                _ => Err(format!("{field}: needs exactly one of namespaces and pods")),
            }
        })
        .collect()
}

fn check_peer_count(field: &str, count: usize) -> Result<(), String> {
    if count == 0 {
        return Err(format!("{field}: needs at least one peer"));
    }
    check_count(field, count, MAX_PEERS)
}

fn egress_peers(peers: &[AdminEgressPeer], action: Action) -> Result<Vec<Peer>, String> {
    check_peer_count("to", peers.len())?;
    let mut out = Vec::new();
    for (p, peer) in peers.iter().enumerate() {
        let field = format!("to[{p}]");
        let set = [
            peer.namespaces.is_some(),
            peer.pods.is_some(),
            peer.nodes.is_some(),
            peer.networks.is_some(),
            peer.domain_names.is_some(),
        ];
        if set.iter().filter(|s| **s).count() != 1 {
            return Err(format!(
                "{field}: needs exactly one of namespaces, pods, nodes, networks and domainNames"
            ));
        }
        if let Some(namespaces) = &peer.namespaces {
            out.push(Peer::Pods(PodChoice {
                namespaces: selector(&format!("{field}.namespaces"), namespaces)?,
                pods: None,
            }));
        } else if let Some(pods) = &peer.pods {
            out.push(Peer::Pods(pod_choice(&format!("{field}.pods"), pods)?));
        } else if let Some(nodes) = &peer.nodes {
            out.push(Peer::Nodes(selector(&format!("{field}.nodes"), nodes)?));
        } else if let Some(networks) = &peer.networks {
            check_count(&format!("{field}.networks"), networks.len(), MAX_NETWORKS)?;
            let nets = networks
                .iter()
                .enumerate()
                .map(|(i, text)| {
                    text.parse::<IpNet>()
                        .map(|net| net.trunc())
                        .map_err(|_| format!("{field}.networks[{i}]: {text:?} is not a CIDR"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            out.push(Peer::Networks(nets));
        } else if let Some(names) = &peer.domain_names {
            if action != Action::Allow {
                return Err(format!(
                    "{field}.domainNames: only an Allow (Accept) rule may name domains"
                ));
            }
            let names = names
                .iter()
                .enumerate()
                .map(|(i, name)| {
                    domain_name(name).map_err(|e| format!("{field}.domainNames[{i}]: {e}"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            out.push(Peer::DomainNames(names));
        }
    }
    Ok(out)
}

/// A `domainNames` entry in its key form (lower case, no trailing dot): a name, or `*.`
/// before one (one or more labels, learned from the DNS answers the subject pods get).
fn domain_name(name: &str) -> Result<String, String> {
    match name.strip_prefix("*.") {
        Some(rest) => normalize(rest)
            .map(|rest| format!("*.{rest}"))
            .map_err(|_| format!("{name:?} is not *. followed by a valid DNS name")),
        None => normalize(name).map_err(|_| format!("{name:?} is not a valid DNS name")),
    }
}

/// The API refuses a named port beside peers that have no named ports.
fn check_named_ports(peers: &[Peer], ports: &[PortSpec]) -> Result<(), String> {
    let named = ports.iter().any(|p| matches!(p, PortSpec::Named(..)));
    let unnamed_peer = peers.iter().any(|p| !matches!(p, Peer::Pods(_)));
    if named && unnamed_peer {
        return Err(
            "a named port with nodes, networks or domainNames peers, which have none".into(),
        );
    }
    Ok(())
}

fn protocol(text: Option<&str>) -> Result<u8, String> {
    let text = text.unwrap_or("TCP");
    protocol_number(text).ok_or_else(|| format!("protocol {text:?} is not TCP, UDP or SCTP"))
}

fn port_range(protocol: u8, start: i32, end: i32) -> Result<PortSpec, String> {
    let valid = |p: i32| (1..=65535).contains(&p);
    if !valid(start) || !valid(end) || end < start {
        return Err(format!("{start} to {end} is not a range within 1-65535"));
    }
    Ok(PortSpec::Range(PortMatch {
        protocol,
        first: start as u16,
        last: end as u16,
    }))
}

fn admin_ports(ports: Option<&[AdminPort]>) -> Result<Vec<PortSpec>, String> {
    let ports = ports.unwrap_or_default();
    check_count("ports", ports.len(), MAX_PEERS)?;
    ports
        .iter()
        .enumerate()
        .map(|(i, port)| {
            let field = format!("ports[{i}]");
            match (&port.port_number, &port.named_port, &port.port_range) {
                (Some(number), None, None) => {
                    let protocol = protocol(number.protocol.as_deref())
                        .map_err(|e| format!("{field}.portNumber: {e}"))?;
                    port_range(protocol, number.port, number.port)
                        .map_err(|e| format!("{field}.portNumber.port: {e}"))
                }
                (None, Some(name), None) => Ok(PortSpec::Named(None, name.clone())),
                (None, None, Some(range)) => {
                    let protocol = protocol(range.protocol.as_deref())
                        .map_err(|e| format!("{field}.portRange: {e}"))?;
                    port_range(protocol, range.start, range.end)
                        .map_err(|e| format!("{field}.portRange: {e}"))
                }
                _ => Err(format!(
                    "{field}: needs exactly one of portNumber, namedPort and portRange"
                )),
            }
        })
        .collect()
}

fn cluster_ports(protocols: Option<&[ClusterProtocol]>) -> Result<Vec<PortSpec>, String> {
    let protocols = protocols.unwrap_or_default();
    check_count("protocols", protocols.len(), MAX_PEERS)?;
    protocols
        .iter()
        .enumerate()
        .map(|(i, entry)| {
            let field = format!("protocols[{i}]");
            let transports = [
                (entry.tcp.as_ref(), PROTO_TCP, "tcp"),
                (entry.udp.as_ref(), PROTO_UDP, "udp"),
                (entry.sctp.as_ref(), PROTO_SCTP, "sctp"),
            ];
            let given: Vec<_> = transports.iter().filter(|(t, _, _)| t.is_some()).collect();
            match (given.as_slice(), &entry.destination_named_port) {
                ([(Some(transport), protocol, key)], None) => {
                    let at = |e: String| format!("{field}.{key}.destinationPort: {e}");
                    match &transport.destination_port {
                        None => Ok(PortSpec::Range(PortMatch::all_ports(*protocol))),
                        Some(ClusterPort {
                            number: Some(n),
                            range: None,
                        }) => port_range(*protocol, *n, *n).map_err(at),
                        Some(ClusterPort {
                            number: None,
                            range: Some(r),
                        }) => port_range(*protocol, r.start, r.end).map_err(at),
                        Some(_) => Err(at("needs exactly one of number and range".into())),
                    }
                }
                ([], Some(name)) => Ok(PortSpec::Named(None, name.clone())),
                _ => Err(format!(
                    "{field}: needs exactly one of tcp, udp, sctp and destinationNamedPort"
                )),
            }
        })
        .collect()
}

/// A node as `nodes` peers see it.
#[derive(Clone, Debug, PartialEq)]
pub struct AdminNode {
    pub labels: BTreeMap<String, String>,
    pub addresses: Vec<IpAddr>,
}

/// The nodes' labels and addresses (`InternalIP` and `ExternalIP`).
pub fn admin_nodes<'a>(nodes: impl IntoIterator<Item = &'a Arc<Node>>) -> Vec<AdminNode> {
    nodes
        .into_iter()
        .map(|node| AdminNode {
            labels: node.metadata.labels.clone().unwrap_or_default(),
            addresses: node
                .status
                .iter()
                .flat_map(|s| s.addresses.iter().flatten())
                .filter(|a| matches!(a.type_.as_str(), "InternalIP" | "ExternalIP"))
                .filter_map(|a| a.address.parse().ok())
                .collect(),
        })
        .collect()
}

/// The validated admin policies in evaluation order, with what their peers need.
#[derive(Clone, Debug, Default)]
pub struct AdminPolicies {
    pub admin: Vec<AdminPolicy>,
    pub baseline: Vec<AdminPolicy>,
    pub nodes: Vec<AdminNode>,
    /// The addresses of `domainNames` peers (what the resolver last answered).
    pub domains: BTreeMap<String, BTreeSet<IpAddr>>,
}

impl AdminPolicies {
    /// Every policy in force, the admin tier's first, then the baseline's.
    pub fn all(&self) -> impl Iterator<Item = &AdminPolicy> {
        self.admin.iter().chain(&self.baseline)
    }
}

/// What validating the objects gave: the policies, and one line per rejected object or
/// warning.
#[derive(Debug, Default)]
pub struct Validated {
    pub policies: AdminPolicies,
    pub errors: Vec<String>,
    pub warnings: Vec<String>,
}

/// The key under which the last good version of an object is kept.
pub type ObjectKey = (PolicyKind, String);

/// Validates every object; one that is invalid is replaced by its last good version in
/// `last_good` (which this updates), or left out when it never was valid. Orders each tier.
pub fn validate_all(
    objects: &AdminObjects,
    last_good: &mut BTreeMap<ObjectKey, AdminPolicy>,
) -> Validated {
    let mut out = Validated::default();
    let mut seen: BTreeSet<ObjectKey> = BTreeSet::new();
    let results = objects
        .admin
        .iter()
        .map(|o| {
            (
                PolicyKind::AdminNetworkPolicy,
                o.metadata.name.clone(),
                from_admin(o),
            )
        })
        .chain(objects.baseline.iter().map(|o| {
            (
                PolicyKind::BaselineAdminNetworkPolicy,
                o.metadata.name.clone(),
                from_baseline(o),
            )
        }))
        .chain(objects.cluster.iter().map(|o| {
            (
                PolicyKind::ClusterNetworkPolicy,
                o.metadata.name.clone(),
                from_cluster(o),
            )
        }));
    for (kind, name, result) in results {
        let key = (kind, name.unwrap_or_default());
        seen.insert(key.clone());
        let policy = match result {
            Ok(policy) => {
                last_good.insert(key, policy.clone());
                policy
            }
            Err(error) => match last_good.get(&key) {
                Some(good) => {
                    out.errors
                        .push(format!("{error}; its last good version stays in force"));
                    good.clone()
                }
                None => {
                    out.errors.push(format!("{error}; it has no effect"));
                    continue;
                }
            },
        };
        match policy.tier {
            Tier::Admin => out.policies.admin.push(policy),
            Tier::Baseline => out.policies.baseline.push(policy),
        }
    }
    last_good.retain(|key, _| seen.contains(key));
    for tier in [&mut out.policies.admin, &mut out.policies.baseline] {
        tier.sort_by(|a, b| (a.priority, a.kind, &a.name).cmp(&(b.priority, b.kind, &b.name)));
        for pair in tier.windows(2) {
            if pair[0].priority == pair[1].priority {
                out.warnings.push(format!(
                    "{} {} and {} {} have the same priority {}: the API leaves their order undefined (here: by kind, then name)",
                    pair[0].kind.name(),
                    pair[0].name,
                    pair[1].kind.name(),
                    pair[1].name,
                    pair[0].priority
                ));
            }
        }
    }
    out
}

/// Whether a pod is one of a choice's (by its namespace's labels and its own).
fn chooses(choice: &PodChoice, cluster: &PolicyCluster<'_>, pod: &PolicyPod) -> bool {
    let empty = BTreeMap::new();
    let labels = cluster.namespaces.get(&pod.namespace).unwrap_or(&empty);
    selects(&choice.namespaces, labels).unwrap_or(false)
        && choice
            .pods
            .as_ref()
            .is_none_or(|s| selects(s, &pod.labels).unwrap_or(false))
}

/// What the admin policies that apply to a pod ask of its endpoint besides its sets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierNotes {
    /// `ACL_LOG_*` flags of the policies that contributed rules.
    pub log: u8,
    /// A rule names wildcard domains: the pod's DNS answers are snooped.
    pub snoop_dns: bool,
}

impl TierNotes {
    pub fn merge(&mut self, other: TierNotes) {
        self.log |= other.log;
        self.snoop_dns |= other.snoop_dns;
    }
}

/// The rules of one tier that apply to `pod` in `direction`, appended to `out` in evaluation
/// order.
pub(super) fn tier_rules(
    tier: &[AdminPolicy],
    direction: Direction,
    cluster: &PolicyCluster<'_>,
    admin: &AdminPolicies,
    pod: &PolicyPod,
    out: &mut PodRules,
) -> TierNotes {
    let mut notes = TierNotes::default();
    for policy in tier {
        let rules = policy.rules(direction);
        if rules.is_empty() || !chooses(&policy.subject, cluster, pod) {
            continue;
        }
        notes.log |= policy.log.map_or(0, NamespaceLogging::flags);
        notes.snoop_dns |= !wildcards(std::slice::from_ref(policy)).is_empty();
        for rule in rules {
            add_rule(policy, rule, direction, cluster, admin, pod, out);
        }
    }
    notes
}

/// The wildcard `domainNames` of `policies`.
fn wildcards(policies: &[AdminPolicy]) -> BTreeSet<String> {
    policies
        .iter()
        .flat_map(|p| p.egress.iter())
        .flat_map(|r| r.peers.iter())
        .filter_map(|peer| match peer {
            Peer::DomainNames(names) => Some(names.iter().filter(|n| n.starts_with("*."))),
            _ => None,
        })
        .flatten()
        .cloned()
        .collect()
}

fn add_rule(
    policy: &AdminPolicy,
    rule: &AdminRule,
    direction: Direction,
    cluster: &PolicyCluster<'_>,
    admin: &AdminPolicies,
    pod: &PolicyPod,
    out: &mut PodRules,
) {
    let reference = out.refs.len() as u32;
    let verdict = rule.action.verdict();
    let mut push = |destinations: Vec<IpNet>, _except: Vec<IpNet>, ports: Ports| {
        if destinations.is_empty() {
            return;
        }
        out.rules.push(Rule {
            index: reference,
            verdict,
            destinations,
            except: Vec::new(),
            peers: Vec::new(),
            ports,
        });
    };
    let numbered = resolve(&rule.ports, &BTreeMap::new());
    for peer in &rule.peers {
        match peer {
            Peer::Pods(choice) => {
                let pods = select_pods(cluster, &choice.namespaces, choice.pods.as_ref());
                match direction {
                    // Named ports of ingress rules resolve against the subject pod.
                    Direction::Ingress => push(
                        pods.iter()
                            .flat_map(|p| p.addresses.iter().map(|a| IpNet::from(*a)))
                            .collect(),
                        Vec::new(),
                        resolve(&rule.ports, &pod.named_ports),
                    ),
                    Direction::Egress => add_pod_peers(pods, &rule.ports, &mut push),
                }
            }
            Peer::Nodes(selector) => push(
                admin
                    .nodes
                    .iter()
                    .filter(|n| selects(selector, &n.labels).unwrap_or(false))
                    .flat_map(|n| n.addresses.iter().map(|a| IpNet::from(*a)))
                    .collect(),
                Vec::new(),
                numbered.clone(),
            ),
            Peer::Networks(nets) => push(nets.clone(), Vec::new(), numbered.clone()),
            Peer::DomainNames(names) => push(
                names
                    .iter()
                    .filter_map(|n| admin.domains.get(n))
                    .flatten()
                    .map(|a| IpNet::from(*a))
                    .collect(),
                Vec::new(),
                numbered.clone(),
            ),
        }
    }
    out.refs.push(RuleRef {
        kind: policy.kind,
        tier: Some(policy.tier),
        policy: policy.name.clone(),
        direction,
        rule: rule.index,
        name: rule.name.clone(),
    });
}

/// The `domainNames` of the policies whose subject is one of `local` (this node's pods):
/// only those are looked after here, by the nodes of the pods they apply to. Returns the
/// names to resolve and the wildcard patterns to learn from DNS answers.
pub fn domain_names(
    policies: &AdminPolicies,
    cluster: &PolicyCluster<'_>,
    local: &[&PolicyPod],
) -> (BTreeSet<String>, BTreeSet<String>) {
    let applying: Vec<AdminPolicy> = policies
        .all()
        .filter(|p| local.iter().any(|pod| chooses(&p.subject, cluster, pod)))
        .cloned()
        .collect();
    let names = applying
        .iter()
        .flat_map(|p| p.egress.iter())
        .flat_map(|r| r.peers.iter())
        .filter_map(|peer| match peer {
            Peer::DomainNames(names) => Some(names.iter().filter(|n| !n.starts_with("*."))),
            _ => None,
        })
        .flatten()
        .cloned()
        .collect();
    (names, wildcards(&applying))
}

/// The addresses the pods' DNS answers may come from: the cluster DNS Service's addresses
/// (`kube-system/kube-dns`, OpenShift's `openshift-dns/dns-default`) and its endpoints. A DNS
/// answer from anywhere else teaches nothing (a pod could forge one).
/// `in_key_order`: the state's lists are in namespace and name order (the API source's).
pub fn dns_servers(state: &crate::source::ClusterState, in_key_order: bool) -> BTreeSet<IpAddr> {
    const DNS_SERVICES: [(&str, &str); 2] = [
        ("kube-system", "kube-dns"),
        ("openshift-dns", "dns-default"),
    ];
    let mut servers = BTreeSet::new();
    // Only the two namespaces are looked at (10,000 Services and their slices at scale), by
    // binary search in the API source's lists.
    for (namespace, name) in DNS_SERVICES {
        for service in state.services.of_namespace(namespace, in_key_order) {
            if service.metadata.name.as_deref() != Some(name) {
                continue;
            }
            let spec = service.spec.iter();
            servers.extend(
                spec.flat_map(|s| s.cluster_ips.iter().flatten().chain(s.cluster_ip.iter()))
                    .filter_map(|a| a.parse::<IpAddr>().ok()),
            );
        }
        for slice in state.endpoint_slices.of_namespace(namespace, in_key_order) {
            let service = slice
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("kubernetes.io/service-name"));
            if service.map(String::as_str) != Some(name) {
                continue;
            }
            servers.extend(
                slice
                    .endpoints
                    .iter()
                    .flat_map(|e| e.addresses.iter())
                    .filter_map(|a| a.parse::<IpAddr>().ok()),
            );
        }
    }
    servers
}
