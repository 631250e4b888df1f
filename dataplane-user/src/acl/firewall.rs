//! OVN-Kubernetes EgressFirewall (`k8s.ovn.org/v1`, the type in `api::egressfirewall`): its
//! validation and its translation into an ordered rule list for [`super::compile_rules`].
//!
//! Semantics (OVN-Kubernetes'): only the object named `default` in a namespace counts; its
//! `spec.egress` rules are evaluated in order and the first match wins; traffic no rule matches
//! is allowed. The rules apply to traffic from the namespace's pods to destinations outside the
//! cluster: the pod, service and cluster networks are exempt, and so is DNS (TCP and UDP 53) to
//! this node's own addresses. An object with any invalid rule, or with more than
//! `MAX_FIREWALL_RULES` rules, is rejected whole.

use std::sync::Arc;
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use dataplane_common::acl::{ACL_RULE_EXEMPT, MAX_FIREWALL_RULES};
use ipnet::IpNet;

use crate::{
    api::egressfirewall::{EgressFirewall, EgressFirewallPort, EgressFirewallRule, FIREWALL_NAME},
    model::{OverlayView, hybrid::internal_networks},
    source::ClusterState,
};

use super::{
    CompiledSet, DesiredFirewalls, PROTO_TCP, PROTO_UDP, PortMatch, Ports, Rule, SetTooLarge,
    Verdict, compile_rules, dns::normalize, protocol_number,
};

/// Why an EgressFirewall was rejected whole. The message names the object and the rule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FirewallError {
    #[error(
        "EgressFirewall {namespace}/{name}: {count} rules, more than the {MAX_FIREWALL_RULES} allowed; the namespace keeps its last good rules"
    )]
    TooManyRules {
        namespace: String,
        name: String,
        count: usize,
    },
    #[error(
        "EgressFirewall {namespace}/{name}: spec.egress[{rule}]: {problem}; the namespace keeps its last good rules"
    )]
    InvalidRule {
        namespace: String,
        name: String,
        rule: usize,
        problem: String,
    },
}

/// This node's view of the cluster that every firewall is compiled against.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FirewallContext {
    /// Pod, service and cluster networks: never affected by a firewall.
    pub exempt: Vec<IpNet>,
    /// This node's addresses: DNS to them is always allowed.
    pub node_addresses: Vec<IpAddr>,
}

/// The context of this node: the Network's cluster and service networks (every node's pod
/// CIDRs when there is no Network object), and this node's addresses.
pub fn context(state: &ClusterState, view: &OverlayView) -> FirewallContext {
    let mut exempt: Vec<IpNet> = state
        .cluster_networks
        .iter()
        .chain(&state.service_networks)
        .copied()
        .collect();
    if state.cluster_networks.is_empty() {
        exempt.extend(view.nodes.iter().flat_map(|n| n.pod_cidrs.iter().copied()));
    }
    // Hybrid nodes' pods are the cluster's too.
    exempt.extend(internal_networks(view.hybrid.as_ref()));
    let node_addresses = view
        .this_node_view()
        .into_iter()
        .flat_map(|n| n.addresses.iter().copied())
        .collect();
    FirewallContext {
        exempt,
        node_addresses,
    }
}

/// The last good addresses of each DNS name (normalized, see [`super::dns::normalize`]).
pub type DnsAddresses = BTreeMap<String, BTreeSet<IpAddr>>;

/// A validated EgressFirewall: its ordered rules (a `dnsName` rule covers the name's last good
/// addresses, none before the first answer) and the names it needs resolved.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FirewallRules {
    pub rules: Vec<Rule>,
    pub names: BTreeSet<String>,
}

/// Validates one EgressFirewall into its ordered rules.
pub fn firewall_rules(
    firewall: &EgressFirewall,
    dns: &DnsAddresses,
) -> Result<FirewallRules, FirewallError> {
    let namespace = firewall.metadata.namespace.clone().unwrap_or_default();
    let name = firewall.metadata.name.clone().unwrap_or_default();
    let egress = &firewall.spec.egress;
    if egress.len() > MAX_FIREWALL_RULES {
        return Err(FirewallError::TooManyRules {
            namespace,
            name,
            count: egress.len(),
        });
    }
    let mut out = FirewallRules::default();
    for (index, rule) in egress.iter().enumerate() {
        let valid = rule_of(index, rule, dns).map_err(|problem| FirewallError::InvalidRule {
            namespace: namespace.clone(),
            name: name.clone(),
            rule: index,
            problem,
        })?;
        out.names.extend(valid.1);
        out.rules.push(valid.0);
    }
    Ok(out)
}

/// A rule and the DNS name it needs, if any.
fn rule_of(
    index: usize,
    rule: &EgressFirewallRule,
    dns: &DnsAddresses,
) -> Result<(Rule, Option<String>), String> {
    let verdict = match rule.type_.as_str() {
        "Allow" => Verdict::Allow,
        "Deny" => Verdict::Deny,
        other => return Err(format!("type {other:?} is neither Allow nor Deny")),
    };
    let (destinations, dns_name) = match (&rule.to.cidr_selector, &rule.to.dns_name) {
        (Some(cidr), None) => {
            let net = cidr
                .parse::<IpNet>()
                .map_err(|_| format!("to.cidrSelector {cidr:?} is not a CIDR"))?;
            (vec![net], None)
        }
        (None, Some(name)) => {
            let name = normalize(name)?;
            let addresses = dns.get(&name).into_iter().flatten();
            (addresses.map(|a| IpNet::from(*a)).collect(), Some(name))
        }
        (Some(_), Some(_)) => {
            return Err("to has both cidrSelector and dnsName; exactly one is allowed".into());
        }
        (None, None) => return Err("to has neither cidrSelector nor dnsName".into()),
    };
    let ports = if rule.ports.is_empty() {
        Ports::Any
    } else {
        Ports::Only(
            rule.ports
                .iter()
                .enumerate()
                .map(|(i, p)| port_of(p).map_err(|e| format!("ports[{i}]: {e}")))
                .collect::<Result<_, _>>()?,
        )
    };
    let rule = Rule {
        index: index as u32,
        verdict,
        destinations,
        except: Vec::new(),
        peers: Vec::new(),
        ports,
    };
    Ok((rule, dns_name))
}

fn port_of(port: &EgressFirewallPort) -> Result<PortMatch, String> {
    let protocol = protocol_number(&port.protocol)
        .ok_or_else(|| format!("protocol {:?} is not TCP, UDP or SCTP", port.protocol))?;
    match port.port {
        None => Ok(PortMatch::all_ports(protocol)),
        Some(p) if (1..=65535).contains(&p) => Ok(PortMatch::port(protocol, p as u16)),
        Some(p) => Err(format!("port {p} is outside 1-65535")),
    }
}

/// The rules every firewall starts with: the cluster's networks, then DNS to this node.
fn exempt_rules(context: &FirewallContext) -> Vec<Rule> {
    let mut rules = Vec::new();
    if !context.exempt.is_empty() {
        rules.push(Rule {
            index: ACL_RULE_EXEMPT,
            verdict: Verdict::Allow,
            destinations: context.exempt.clone(),
            except: Vec::new(),
            peers: Vec::new(),
            ports: Ports::Any,
        });
    }
    if !context.node_addresses.is_empty() {
        rules.push(Rule {
            index: ACL_RULE_EXEMPT,
            verdict: Verdict::Allow,
            destinations: context
                .node_addresses
                .iter()
                .map(|a| IpNet::from(*a))
                .collect(),
            except: Vec::new(),
            peers: Vec::new(),
            ports: Ports::Only(vec![
                PortMatch::port(PROTO_UDP, 53),
                PortMatch::port(PROTO_TCP, 53),
            ]),
        });
    }
    rules
}

/// Compiles one namespace's firewall rules behind the exemptions. A firewall with DNS names
/// always keeps the host prefix lengths, so that a name's new addresses go into the set in
/// place.
pub fn compile_firewall(
    rules: &FirewallRules,
    context: &FirewallContext,
) -> Result<CompiledSet, SetTooLarge> {
    let mut all = exempt_rules(context);
    all.extend_from_slice(&rules.rules);
    compile_rules(&all, !rules.names.is_empty())
}

/// The outcome of compiling every EgressFirewall: what to install, and one error line per
/// rejected or ignored object.
#[derive(Clone, Debug, Default)]
pub struct CompiledFirewalls {
    pub desired: DesiredFirewalls,
    pub errors: Vec<String>,
    /// The DNS names each namespace's firewall uses.
    pub names: BTreeMap<String, BTreeSet<String>>,
    /// Each namespace's validated rules and the context they were compiled against (what
    /// the next compile compares with, to keep an unchanged namespace's set).
    pub rules: BTreeMap<String, Arc<FirewallRules>>,
    /// The object each namespace's rules were validated from: the same object again, with
    /// no DNS name, has the same rules (at 100 firewalls of 100 rules, validating and
    /// comparing them all again cost more than the change that ran access control).
    pub objects: BTreeMap<String, Arc<EgressFirewall>>,
    pub context: FirewallContext,
}

impl CompiledFirewalls {
    /// Every DNS name in use.
    pub fn all_names(&self) -> BTreeSet<String> {
        self.names.values().flatten().cloned().collect()
    }
}

/// Compiles the EgressFirewalls of every namespace. Objects not named `default` are ignored
/// with a message; a rejected object leaves its namespace in `desired.rejected`.
pub fn compile_firewalls(
    firewalls: &[Arc<EgressFirewall>],
    context: &FirewallContext,
    dns: &DnsAddresses,
) -> CompiledFirewalls {
    compile_firewalls_reusing(firewalls, context, dns, &CompiledFirewalls::default())
}

/// As [`compile_firewalls`]; a namespace whose rules (its DNS names' addresses included) and
/// context are those `previous` compiled keeps the set compiled then: a change to one
/// firewall, or to a pod or policy, compiles no other namespace's firewall again.
pub fn compile_firewalls_reusing(
    firewalls: &[Arc<EgressFirewall>],
    context: &FirewallContext,
    dns: &DnsAddresses,
    previous: &CompiledFirewalls,
) -> CompiledFirewalls {
    let mut compiled = CompiledFirewalls::default();
    let mut seen: BTreeSet<String> = BTreeSet::new();
    let mut rules_by_namespace: BTreeMap<String, Arc<FirewallRules>> = BTreeMap::new();
    for firewall in firewalls {
        let namespace = firewall.metadata.namespace.clone().unwrap_or_default();
        let name = firewall.metadata.name.clone().unwrap_or_default();
        if name != FIREWALL_NAME {
            compiled.errors.push(format!(
                "EgressFirewall {namespace}/{name}: ignored, only the object named {FIREWALL_NAME:?} counts"
            ));
            continue;
        }
        if !seen.insert(namespace.clone()) {
            compiled.errors.push(format!(
                "EgressFirewall {namespace}/{name}: a second object of that name; the first is used"
            ));
            continue;
        }
        let unchanged = previous
            .objects
            .get(&namespace)
            .is_some_and(|before| Arc::ptr_eq(before, firewall));
        let validated = match previous.rules.get(&namespace) {
            Some(rules) if unchanged && rules.names.is_empty() => Ok(Arc::clone(rules)),
            _ => firewall_rules(firewall, dns).map(Arc::new),
        };
        match validated {
            Ok(rules) => {
                if !rules.names.is_empty() {
                    compiled
                        .names
                        .insert(namespace.clone(), rules.names.clone());
                }
                compiled
                    .objects
                    .insert(namespace.clone(), Arc::clone(firewall));
                rules_by_namespace.insert(namespace, rules);
            }
            Err(error) => {
                compiled.errors.push(error.to_string());
                compiled.desired.rejected.insert(namespace);
            }
        }
    }
    let reusable = previous.context == *context;
    let mut to_compile = Vec::new();
    for (namespace, rules) in &rules_by_namespace {
        let kept = previous
            .rules
            .get(namespace)
            .filter(|before| reusable && *before == rules)
            .and_then(|_| previous.desired.sets.get(namespace));
        match kept {
            Some(set) => {
                compiled.desired.sets.insert(namespace.clone(), set.clone());
            }
            None => to_compile.push((namespace, rules)),
        }
    }
    let compile = |(namespace, rules): &(&String, &Arc<FirewallRules>)| {
        ((*namespace).clone(), compile_firewall(rules, context))
    };
    // A firewall of 100 rules takes about 2 ms: several (a first sync's 100) on every core.
    let fresh = crate::parallel::map(&to_compile, FIREWALLS_PER_TASK, compile);
    for (namespace, set) in fresh {
        match set {
            Ok(set) => {
                compiled.desired.sets.insert(namespace, Arc::new(set));
            }
            // Refused alone: its namespace keeps its last good set, the others are untouched.
            Err(too_large) => {
                compiled.errors.push(format!(
                    "EgressFirewall {namespace}/{FIREWALL_NAME}: spec.egress: {too_large}; its last good rules stay in force"
                ));
                compiled.desired.rejected.insert(namespace);
            }
        }
    }
    compiled.rules = rules_by_namespace;
    compiled.context = context.clone();
    compiled
}

/// EgressFirewalls compiled by one task of [`compile_firewalls_reusing`].
const FIREWALLS_PER_TASK: usize = 2;
