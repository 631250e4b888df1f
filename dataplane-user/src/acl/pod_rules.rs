//! A policy's rules for one pod before they are compiled: where each rule comes from (kind,
//! tier, object, direction, index), the ports it names (named ports resolved on each peer
//! pod), and the policy set the kernel holds for one direction of one or more pods.

use std::{collections::BTreeMap, sync::Arc};

use ipnet::IpNet;
use k8s_openapi::{
    api::networking::v1::NetworkPolicyPort, apimachinery::pkg::util::intstr::IntOrString,
};

use super::{
    CompiledSet, PortMatch, Ports, Rule,
    pods::{Direction, PolicyPod},
    protocol_number,
};

/// Which tier a policy is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    Admin,
    Baseline,
}

/// The kind of object a rule comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PolicyKind {
    NetworkPolicy,
    AdminNetworkPolicy,
    BaselineAdminNetworkPolicy,
    ClusterNetworkPolicy,
}

impl PolicyKind {
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::NetworkPolicy => "NetworkPolicy",
            PolicyKind::AdminNetworkPolicy => "AdminNetworkPolicy",
            PolicyKind::BaselineAdminNetworkPolicy => "BaselineAdminNetworkPolicy",
            PolicyKind::ClusterNetworkPolicy => "ClusterNetworkPolicy",
        }
    }

    /// The prefix of audit record names (OVN-Kubernetes' `NP`, `ANP`, `BANP`; `CNP` here).
    pub fn audit_prefix(self) -> &'static str {
        match self {
            PolicyKind::NetworkPolicy => "NP",
            PolicyKind::AdminNetworkPolicy => "ANP",
            PolicyKind::BaselineAdminNetworkPolicy => "BANP",
            PolicyKind::ClusterNetworkPolicy => "CNP",
        }
    }
}

/// Which policy rule a decision came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleRef {
    pub kind: PolicyKind,
    /// The admin policies' tier; `None` for a NetworkPolicy.
    pub tier: Option<Tier>,
    /// `<namespace>/<name>` of a NetworkPolicy, the name of a cluster-wide policy.
    pub policy: String,
    pub direction: Direction,
    /// Index in the policy's `ingress` or `egress` list.
    pub rule: usize,
    /// The rule's `name` (admin policies), empty when it has none.
    pub name: String,
}

impl RuleRef {
    /// The tier's name for people.
    pub fn tier_name(&self) -> &'static str {
        match self.tier {
            None => "NetworkPolicy tier",
            Some(Tier::Admin) => "admin tier",
            Some(Tier::Baseline) => "baseline tier",
        }
    }

    /// What decided, for people: `tier: kind name direction[rule] "rule name"`.
    pub fn describe(&self) -> String {
        let tier = self.tier_name();
        let direction = match self.direction {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        };
        let name = if self.name.is_empty() {
            String::new()
        } else {
            format!(" {:?}", self.name)
        };
        format!(
            "{tier}: {} {} {direction}[{}]{name}",
            self.kind.name(),
            self.policy,
            self.rule
        )
    }
}

/// One direction of one pod: the rules and where each came from. The first `admin_end`
/// rules are the admin tier's (a `Pass` among them hands over to the rest).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodRules {
    pub rules: Vec<Rule>,
    pub refs: Vec<RuleRef>,
    pub admin_end: usize,
}

/// A pod's isolation: `None` in a direction no policy selects it for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodPolicy {
    pub ingress: Option<PodRules>,
    pub egress: Option<PodRules>,
}

/// A validated port of a rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortSpec {
    Range(PortMatch),
    /// A container port name, of one protocol (NetworkPolicy) or of any (admin policies).
    Named(Option<u8>, String),
}

pub(super) fn port_spec(port: &NetworkPolicyPort) -> Result<PortSpec, String> {
    let protocol = protocol_number(port.protocol.as_deref().unwrap_or("TCP")).ok_or_else(|| {
        format!(
            "protocol {:?} is not TCP, UDP or SCTP",
            port.protocol.as_deref().unwrap_or_default()
        )
    })?;
    match (&port.port, port.end_port) {
        (None, None) => Ok(PortSpec::Range(PortMatch::all_ports(protocol))),
        (None, Some(_)) => Err("endPort without port".into()),
        (Some(IntOrString::Int(first)), end) => {
            let last = end.unwrap_or(*first);
            let valid = |p: i32| (1..=65535).contains(&p);
            if !valid(*first) || !valid(last) || last < *first {
                return Err(format!(
                    "port {first} to endPort {last} is not a range within 1-65535"
                ));
            }
            Ok(PortSpec::Range(PortMatch {
                protocol,
                first: *first as u16,
                last: last as u16,
            }))
        }
        (Some(IntOrString::String(_)), Some(_)) => Err("endPort with a named port".into()),
        (Some(IntOrString::String(name)), None) => {
            Ok(PortSpec::Named(Some(protocol), name.clone()))
        }
    }
}

/// A rule's ports with named ones resolved against `named` (a name that resolves to nothing
/// matches nothing). No ports at all: everything.
pub(super) fn resolve(specs: &[PortSpec], named: &BTreeMap<String, Vec<(u8, u16)>>) -> Ports {
    if specs.is_empty() {
        return Ports::Any;
    }
    let mut matches = Vec::new();
    for spec in specs {
        match spec {
            PortSpec::Range(m) => matches.push(*m),
            PortSpec::Named(protocol, name) => matches.extend(
                named
                    .get(name)
                    .into_iter()
                    .flatten()
                    .filter(|(p, _)| protocol.is_none_or(|wanted| *p == wanted))
                    .map(|(p, port)| PortMatch::port(*p, *port)),
            ),
        }
    }
    Ports::Only(matches)
}

/// Egress to pods: grouped by how the rule's named ports resolve on each, one rule per group.
pub(super) fn add_pod_peers(
    pods: Vec<&PolicyPod>,
    specs: &[PortSpec],
    push: &mut impl FnMut(Vec<IpNet>, Vec<IpNet>, Ports),
) {
    let mut groups: Vec<(Ports, Vec<IpNet>)> = Vec::new();
    for pod in pods {
        let ports = resolve(specs, &pod.named_ports);
        let nets = pod.addresses.iter().map(|a| IpNet::from(*a));
        match groups.iter_mut().find(|(p, _)| *p == ports) {
            Some((_, list)) => list.extend(nets),
            None => groups.push((ports, nets.collect())),
        }
    }
    for (ports, nets) in groups {
        push(nets, Vec::new(), ports);
    }
}

/// One isolated direction of one or more local pods of a namespace: what the kernel holds as a
/// policy set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicySet {
    pub namespace: String,
    pub direction: Direction,
    /// What each rule index of the set stands for (audit records). Shared, as `compiled`
    /// is: the set as last installed is compared with the wanted one at every sync, and
    /// comparing 110 sets' references string by string was a tenth of the ACL sync.
    pub refs: Arc<Vec<RuleRef>>,
    pub compiled: Arc<CompiledSet>,
    /// The rules `compiled` was made from: a later set of the same pod that differs only in
    /// peer hosts is made from this one (`acl::recompile_hosts`).
    pub rules: Arc<Vec<Rule>>,
}
