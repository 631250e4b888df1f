//! Kubernetes NetworkPolicy (`networking.k8s.io/v1`) compiled, per local pod and direction,
//! into the ordered rule lists that [`super::compile_rules`] turns into constant-time lookups.
//!
//! Semantics as the API defines them:
//! - a pod is isolated for ingress (egress) once any policy of its namespace selects it with
//!   that policy type (`policyTypes` absent: Ingress, plus Egress when the policy has egress
//!   rules); an isolated pod accepts only what some rule of some selecting policy allows (the
//!   union); a pod no policy selects is not isolated;
//! - a rule's peers: `podSelector` (pods of the policy's namespace), `namespaceSelector` (all
//!   pods of the selected namespaces), both in one peer (those pods of those namespaces),
//!   `ipBlock` with `except`; no peers: every address. A rule's ports: protocol (TCP by
//!   default, UDP, SCTP), a number or a container port name, `endPort` for ranges; no ports:
//!   all traffic;
//! - named ports resolve against the pod that receives: the selected pod for ingress, each peer
//!   pod for egress (so an egress named port never matches an ipBlock peer).
//!
//! A policy with an invalid field (selector operator, CIDR, protocol, port range) is reported
//! naming it and the field; its pods stay isolated in its policy types but it allows nothing
//! (failing closed rather than open).
//!
//! Every rule compiles to an `Allow` rule; what no rule allows is denied (the kernel treats
//! "no rule matched" as a deny for policy sets). `Rule::index` points into [`PodRules::refs`],
//! which says which policy and rule allowed (for audit records).
//!
//! One piece (about 870 lines): the compile of one pod's rules, the per-policy parts it reuses
//! and the cache that says which pods a change reaches are one algorithm; the pods, rules and
//! selectors it stands on are `pods`, `pod_rules` and `select`.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use dataplane_common::acl::ACL_RULE_EXEMPT;
use ipnet::IpNet;

use k8s_openapi::{
    api::networking::v1::{NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort},
    apimachinery::pkg::apis::meta::v1::LabelSelector,
};

use super::{
    Ports, Rule, Verdict,
    admin::{AdminPolicies, TierNotes},
    compile_tiered,
    pod_rules::{
        PodPolicy, PodRules, PolicyKind, PolicySet, PortSpec, RuleRef, add_pod_peers, port_spec,
        resolve,
    },
    pods::{Direction, PolicyChanges, PolicyPod, selects},
    recompile_hosts, repaint_ports,
    select::{PolicyCluster, Read, Reads, peer_pods},
};

/// Compiles the rules of every policy that selects `pod`. Errors name a policy and field; such a
/// policy still isolates what it selects.
pub fn pod_policy(
    policies: &[Arc<NetworkPolicy>],
    cluster: &PolicyCluster<'_>,
    pod: &PolicyPod,
) -> (PodPolicy, Vec<String>) {
    let parts = parts_reusing(
        policies,
        cluster,
        pod,
        Vec::new(),
        &PolicyChanges::default(),
    );
    assemble_parts(&parts)
}

/// What one NetworkPolicy of a pod's namespace gives the pod, compiled alone, so that a pod
/// recompiled because one of its policies changed (or a peer of one) takes the others' parts
/// as they were ([`parts_reusing`]): at 1,200 peers over four policies, resolving every
/// policy's peers again was most of a policy's port changed.
#[derive(Clone, Debug)]
pub struct PolicyPart {
    policy: Arc<NetworkPolicy>,
    /// Whether the policy selects the pod, and its rules (rule indexes from 0) or error in
    /// each direction it isolates; `Err`: the policy's pod selector fails.
    selected: Result<Option<Vec<DirectionPart>>, String>,
    /// The pods its peers' selectors looked at.
    reads: Reads,
}

/// A policy's rules in one direction (rule indexes from 0), or why it has none.
type DirectionPart = (Direction, Result<PodRules, String>);

/// The part of `policy` (of the pod's namespace) for `pod`.
fn policy_part(
    policy: &Arc<NetworkPolicy>,
    cluster: &PolicyCluster<'_>,
    pod: &PolicyPod,
) -> PolicyPart {
    let namespace = pod.namespace.as_str();
    let name = format!(
        "{namespace}/{}",
        policy.metadata.name.as_deref().unwrap_or("")
    );
    // This part's reads alone, then added back to the pod's.
    let outer = cluster.reads.take();
    let selected = policy_directions(policy, &name, namespace, cluster, pod);
    let reads = cluster.reads.replace(outer);
    cluster.reads.borrow_mut().merge(&reads);
    PolicyPart {
        policy: Arc::clone(policy),
        selected,
        reads,
    }
}

/// Whether `policy` (named `name`) selects `pod`, and its rules in each direction it isolates.
fn policy_directions(
    policy: &NetworkPolicy,
    name: &str,
    namespace: &str,
    cluster: &PolicyCluster<'_>,
    pod: &PolicyPod,
) -> Result<Option<Vec<DirectionPart>>, String> {
    let Some(spec) = &policy.spec else {
        return Ok(None);
    };
    let everything = LabelSelector::default();
    match selects(
        spec.pod_selector.as_ref().unwrap_or(&everything),
        &pod.labels,
    ) {
        Ok(true) => {}
        Ok(false) => return Ok(None),
        Err(e) => return Err(format!("NetworkPolicy {name}: spec.podSelector: {e}")),
    }
    let mut directions = Vec::new();
    for direction in policy_types(spec) {
        let mut rules = PodRules::default();
        let added = add_direction(&mut rules, spec, direction, name, namespace, cluster, pod)
            .and_then(|()| fits_alone(&rules, direction).map(|()| rules))
            .map_err(|e| {
                format!("NetworkPolicy {name}: {e}; it isolates its pods and allows nothing")
            });
        directions.push((direction, added));
    }
    Ok(Some(directions))
}

/// Whether one policy's rules for one pod and direction stay within
/// [`super::POLICY_MAX_PREFIXES`] address entries per family, counted alone: a policy of many
/// networks over many prefix lengths expands into more entries than any set may hold.
fn fits_alone(rules: &PodRules, direction: Direction) -> Result<(), String> {
    for ipv4 in [true, false] {
        let nets = rules
            .rules
            .iter()
            .flat_map(|r| r.destinations.iter().chain(&r.except))
            .filter(|n| matches!(n, IpNet::V4(_)) == ipv4)
            .copied();
        let needed = super::estimated_entries(nets);
        if needed > super::POLICY_MAX_PREFIXES as u128 {
            let field = match direction {
                Direction::Ingress => "spec.ingress[].from[].ipBlock",
                Direction::Egress => "spec.egress[].to[].ipBlock",
            };
            return Err(format!(
                "{field}: its {} networks would need about {needed} address entries for one pod, more than the {} one policy may have (fewer prefix lengths, or fewer networks)",
                if ipv4 { "IPv4" } else { "IPv6" },
                super::POLICY_MAX_PREFIXES
            ));
        }
    }
    Ok(())
}

/// The part whose rules in `direction` need the most address entries: what is refused when
/// a pod's policies fit alone but not together.
fn largest_part(parts: &[PolicyPart], direction: Direction) -> Option<usize> {
    parts
        .iter()
        .enumerate()
        .filter_map(|(index, part)| {
            let directions = part.selected.as_ref().ok()?.as_ref()?;
            let (_, rules) = directions.iter().find(|(d, _)| *d == direction)?;
            let rules = rules.as_ref().ok()?;
            let nets = rules
                .rules
                .iter()
                .flat_map(|r| r.destinations.iter().chain(&r.except))
                .copied();
            Some((index, super::estimated_entries(nets)))
        })
        .max_by_key(|&(index, entries)| (entries, std::cmp::Reverse(index)))
        .map(|(index, _)| index)
}

/// `parts` with the rules of `parts[index]` in `direction` refused for `why`: the policy
/// still isolates the pod and allows nothing there, as an invalid policy does.
fn refuse_part(parts: &mut [PolicyPart], index: usize, direction: Direction, why: &str) {
    let part = &mut parts[index];
    let name = format!(
        "{}/{}",
        part.policy
            .metadata
            .namespace
            .as_deref()
            .unwrap_or("default"),
        part.policy.metadata.name.as_deref().unwrap_or("")
    );
    if let Ok(Some(directions)) = &mut part.selected {
        for (d, rules) in directions.iter_mut() {
            if *d == direction {
                *rules = Err(format!(
                    "NetworkPolicy {name}: {why}; it isolates its pods and allows nothing"
                ));
            }
        }
    }
}

/// The pod's rules from its policies' parts, in order: each part's rules numbered after
/// those before it in its direction.
fn assemble_parts(parts: &[PolicyPart]) -> (PodPolicy, Vec<String>) {
    let mut result = PodPolicy::default();
    let mut errors = Vec::new();
    for part in parts {
        let directions = match &part.selected {
            Ok(Some(directions)) => directions,
            Ok(None) => continue,
            Err(e) => {
                errors.push(e.clone());
                continue;
            }
        };
        for (direction, added) in directions {
            let slot = match direction {
                Direction::Ingress => &mut result.ingress,
                Direction::Egress => &mut result.egress,
            };
            let rules = slot.get_or_insert_with(PodRules::default);
            match added {
                Ok(added) => {
                    let first = rules.refs.len() as u32;
                    rules.rules.extend(added.rules.iter().map(|rule| Rule {
                        index: rule.index + first,
                        ..rule.clone()
                    }));
                    rules.refs.extend(added.refs.iter().cloned());
                }
                Err(e) => errors.push(e.clone()),
            }
        }
    }
    (result, errors)
}

/// The parts of `policies` for `pod`, taking from `last` (the pod's parts of its last
/// compile) those of the same policy object whose reads `changes` leaves alone. `last` is
/// of no use when the pod itself changed (its labels pick its policies, its named ports
/// resolve their ports): the caller passes none then.
fn parts_reusing(
    policies: &[Arc<NetworkPolicy>],
    cluster: &PolicyCluster<'_>,
    pod: &PolicyPod,
    mut last: Vec<PolicyPart>,
    changes: &PolicyChanges,
) -> Vec<PolicyPart> {
    let mut parts = Vec::new();
    for policy in policies {
        if policy.metadata.namespace.as_deref().unwrap_or("default") != pod.namespace {
            continue;
        }
        // A part holds its policy: the object's address is not taken by another meanwhile.
        let kept = last
            .iter()
            .position(|part| Arc::ptr_eq(&part.policy, policy))
            .map(|at| last.swap_remove(at))
            .filter(|part| !part.reads.touched_by(&changes.pods));
        match kept {
            Some(part) => {
                cluster.reads.borrow_mut().merge(&part.reads);
                parts.push(part);
            }
            None => parts.push(policy_part(policy, cluster, pod)),
        }
    }
    parts
}

fn policy_types(spec: &k8s_openapi::api::networking::v1::NetworkPolicySpec) -> BTreeSet<Direction> {
    match &spec.policy_types {
        Some(types) => types
            .iter()
            .filter_map(|t| match t.as_str() {
                "Ingress" => Some(Direction::Ingress),
                "Egress" => Some(Direction::Egress),
                _ => None,
            })
            .collect(),
        None => {
            let mut types = BTreeSet::from([Direction::Ingress]);
            if spec.egress.is_some() {
                types.insert(Direction::Egress);
            }
            types
        }
    }
}

/// A rule's peers and ports, whichever direction.
type RuleParts<'a> = (
    Option<&'a Vec<NetworkPolicyPeer>>,
    Option<&'a Vec<NetworkPolicyPort>>,
);

/// Adds one policy's rules of one direction, all or nothing.
fn add_direction(
    out: &mut PodRules,
    spec: &k8s_openapi::api::networking::v1::NetworkPolicySpec,
    direction: Direction,
    policy: &str,
    namespace: &str,
    cluster: &PolicyCluster<'_>,
    pod: &PolicyPod,
) -> Result<(), String> {
    let mut added = PodRules::default();
    let (field, rules): (&str, Vec<RuleParts<'_>>) = match direction {
        Direction::Ingress => (
            "ingress",
            spec.ingress
                .iter()
                .flatten()
                .map(|r| (r.from.as_ref(), r.ports.as_ref()))
                .collect(),
        ),
        Direction::Egress => (
            "egress",
            spec.egress
                .iter()
                .flatten()
                .map(|r| (r.to.as_ref(), r.ports.as_ref()))
                .collect(),
        ),
    };
    for (index, (peers, ports)) in rules.into_iter().enumerate() {
        let at = |what: &str, e: String| format!("spec.{field}[{index}].{what}: {e}");
        let ports = ports.map(Vec::as_slice).unwrap_or_default();
        let specs: Vec<PortSpec> = ports
            .iter()
            .enumerate()
            .map(|(i, p)| port_spec(p).map_err(|e| at(&format!("ports[{i}]"), e)))
            .collect::<Result<_, _>>()?;
        let reference = (out.refs.len() + added.refs.len()) as u32;
        let mut push =
            |destinations: Vec<IpNet>, except: Vec<IpNet>, peers: Vec<u32>, ports: Ports| {
                if destinations.is_empty() && peers.is_empty() {
                    return;
                }
                added.rules.push(Rule {
                    index: reference,
                    verdict: Verdict::Allow,
                    destinations,
                    except,
                    peers,
                    ports,
                });
            };
        let peers = peers.map(Vec::as_slice).unwrap_or_default();
        // Named ports of ingress rules resolve against this pod, for every peer alike.
        let own_ports = resolve(&specs, &pod.named_ports);
        if peers.is_empty() {
            let everything = vec![
                "0.0.0.0/0".parse().expect("valid"),
                "::/0".parse().expect("valid"),
            ];
            match direction {
                Direction::Ingress => push(everything, Vec::new(), Vec::new(), own_ports.clone()),
                // Every address: pods by their own named ports, the rest by numbers only
                // (with numbers only, every pod too: nothing to name by identity).
                Direction::Egress => {
                    cluster.read_all();
                    if cluster.identities.is_none() || names_ports(&specs) {
                        add_pod_peers(cluster.pods.iter().collect(), &specs, &mut |d, e, p| {
                            push(d, e, Vec::new(), p)
                        });
                    }
                    let ports = resolve(&specs, &BTreeMap::new());
                    push(everything, Vec::new(), Vec::new(), ports);
                }
            }
        }
        for (p, peer) in peers.iter().enumerate() {
            if let Some(block) = &peer.ip_block {
                let cidr: IpNet = block.cidr.parse().map_err(|_| {
                    at(
                        &format!("{}[{p}].ipBlock.cidr", peer_field(direction)),
                        format!("{:?} is not a CIDR", block.cidr),
                    )
                })?;
                let except = block
                    .except
                    .iter()
                    .flatten()
                    .map(|e| {
                        e.parse::<IpNet>().map_err(|_| {
                            at(
                                &format!("{}[{p}].ipBlock.except", peer_field(direction)),
                                format!("{e:?} is not a CIDR"),
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let ports = match direction {
                    Direction::Ingress => own_ports.clone(),
                    Direction::Egress => resolve(&specs, &BTreeMap::new()),
                };
                push(vec![cidr], except, Vec::new(), ports);
                continue;
            }
            let selected = peer_pods(peer, namespace, cluster)
                .map_err(|e| at(&format!("{}[{p}]", peer_field(direction)), e))?;
            // By identity where the ports are the same for every peer pod: ingress ports
            // resolve on this pod, egress numbers on none.
            let same_ports = match direction {
                Direction::Ingress => Some(own_ports.clone()),
                Direction::Egress => {
                    (!names_ports(&specs)).then(|| resolve(&specs, &BTreeMap::new()))
                }
            };
            match (cluster.identities, same_ports) {
                (Some(registry), Some(ports)) => {
                    let ids = selected.identities(registry).to_vec();
                    push(Vec::new(), Vec::new(), ids, ports);
                }
                (None, Some(ports)) if direction == Direction::Ingress => {
                    push(selected.addresses().to_vec(), Vec::new(), Vec::new(), ports)
                }
                _ => add_pod_peers(selected.pods.clone(), &specs, &mut |d, e, p| {
                    push(d, e, Vec::new(), p)
                }),
            }
        }
        added.refs.push(RuleRef {
            kind: PolicyKind::NetworkPolicy,
            tier: None,
            policy: policy.to_owned(),
            direction,
            rule: index,
            name: String::new(),
        });
    }
    out.rules.extend(added.rules);
    out.refs.extend(added.refs);
    Ok(())
}

/// Whether a rule's ports name container ports (which resolve on each peer pod).
fn names_ports(specs: &[PortSpec]) -> bool {
    specs.iter().any(|spec| matches!(spec, PortSpec::Named(..)))
}

fn peer_field(direction: Direction) -> &'static str {
    match direction {
        Direction::Ingress => "from",
        Direction::Egress => "to",
    }
}

/// The policy set names of a pod; `None` where nothing judges that direction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodSets {
    pub ingress: Option<String>,
    pub egress: Option<String>,
    /// `ACL_LOG_*` flags of the admin policies whose rules the sets hold.
    pub log: u8,
    /// Its admin policies name wildcard domains: its DNS answers are snooped.
    pub snoop_dns: bool,
}

/// Every local pod's policy sets, the distinct sets by name, and one line per invalid policy.
#[derive(Clone, Debug, Default)]
pub struct CompiledPolicies {
    pub sets: BTreeMap<String, PolicySet>,
    pub pods: BTreeMap<String, PodSets>,
    pub errors: Vec<String>,
    pub budget: EntryBudget,
}

/// Most entries the policy sets of all local pods may hold together: the maps' capacity
/// (`--max-acl-entries`), past which they could not be written anyway. It bounds what the
/// agent holds of them whatever the tenants write: without it, 110 pods each with policies
/// near one set's limit held gigabytes. A set that would pass it is refused as a set too large
/// is (its pod's largest policy allows nothing), and tried again at the next compile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryBudget(pub usize);

impl Default for EntryBudget {
    fn default() -> Self {
        Self(dataplane_common::maps::DEFAULT_ACL_ENTRIES as usize)
    }
}

/// Why a set was not compiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SetRefused {
    #[error(transparent)]
    TooLarge(#[from] super::SetTooLarge),
    #[error(
        "its {entries} entries would take the node's policy sets past the agent's budget of {budget} \
         (--max-acl-entries; {held} held by other sets)"
    )]
    OverBudget {
        entries: usize,
        held: usize,
        budget: usize,
    },
}

/// Compiles the policies for the pods of this node (`local`: `<namespace>/<name>` keys) against
/// every pod of the cluster. Pods of one namespace with the same rules share a set, named after
/// its contents so that an unchanged set keeps its name (and its maps) across syncs; a set of
/// `previous` (the last compile's) keeps its compiled lookups too, and only new sets are
/// compiled.
pub fn policy_sets(
    policies: &[Arc<NetworkPolicy>],
    cluster: &PolicyCluster<'_>,
    local: &[String],
    previous: &BTreeMap<String, PolicySet>,
    admin: &AdminPolicies,
) -> CompiledPolicies {
    let mut compiled = CompiledPolicies {
        sets: previous.clone(),
        ..CompiledPolicies::default()
    };
    policy_sets_since(
        policies,
        cluster,
        local,
        &mut compiled,
        admin,
        &mut PodRulesCache::default(),
        &PolicyChanges::everything(),
    );
    compiled
}

/// Each local pod's policy sets as the last compile gave them, and whose pods they were
/// compiled from: a change recompiles only the local pods it can affect (those of a namespace
/// whose policies changed, and those whose rules picked a changed pod). At 110 local pods
/// each taking 1,200 peers, compiling them all took a change 25 ms. Not kept with admin
/// policies in force: their rules read every pod, the nodes and DNS answers.
#[derive(Clone, Debug, Default)]
pub struct PodRulesCache {
    /// By `<namespace>/<name>`.
    pods: BTreeMap<String, CachedPod>,
}

#[derive(Clone, Debug)]
struct CachedPod {
    sets: PodSets,
    errors: Vec<String>,
    /// A set of it was refused for the budget: compiled again next time, when there may be
    /// room.
    over_budget: bool,
    reads: Reads,
    /// Its policies' parts.
    parts: Vec<PolicyPart>,
}

impl CachedPod {
    /// Whether the last compile of the pod, of `namespace`, still holds after `changes`.
    fn still_holds(&self, namespace: &str, changes: &PolicyChanges) -> bool {
        // The reads include the pod itself.
        !self.over_budget
            && !changes.policies.contains(namespace)
            && !self.reads.touched_by(&changes.pods)
    }
}

/// What [`policy_sets_since`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recompiled {
    /// Local pods compiled anew (the others kept their last compile's sets).
    pub pods: usize,
    /// Whether a local pod's sets changed, or a pod's came or went.
    pub changed: bool,
}

/// [`policy_sets`], changing `last` (the last compile's, of the same local pods or others)
/// in place: only the local pods `changes` can affect since the compile `cache` holds are
/// compiled again, the sets no local pod names any more dropped. When a change reaches no
/// local pod, nothing is copied or rebuilt: at 110 local pods, making every pod's entry and
/// moving every set again cost a change elsewhere in a large cluster more than the rest of
/// access control.
pub fn policy_sets_since(
    policies: &[Arc<NetworkPolicy>],
    cluster: &PolicyCluster<'_>,
    local: &[String],
    last: &mut CompiledPolicies,
    admin: &AdminPolicies,
    cache: &mut PodRulesCache,
    changes: &PolicyChanges,
) -> Recompiled {
    let admin_in_force = admin.all().next().is_some();
    if changes.everything || admin_in_force {
        cache.pods.clear();
    }
    let mut stale: BTreeSet<&str> = BTreeSet::new();
    let mut cached = 0;
    for key in local {
        let holds = cache.pods.get(key.as_str()).is_some_and(|pod| {
            let namespace = key.split_once('/').map_or("", |(namespace, _)| namespace);
            pod.still_holds(namespace, changes) && sets_present(&pod.sets, &last.sets)
        });
        if holds {
            cached += 1;
        } else {
            stale.insert(key);
        }
    }
    let none_gone = cached == local.len() && cache.pods.len() == local.len();
    if stale.is_empty() && none_gone {
        return Recompiled::default();
    }
    let mut done = Recompiled::default();
    let local_keys: BTreeSet<&str> = local.iter().map(String::as_str).collect();
    let gone: Vec<String> = cache
        .pods
        .keys()
        .filter(|key| !local_keys.contains(key.as_str()))
        .cloned()
        .collect();
    for key in gone {
        cache.pods.remove(&key);
        done.changed |= last.pods.remove(&key).is_some();
    }
    // Errors of the pods compiled but not cached (admin policies in force).
    let mut uncached_errors = Vec::new();
    for key in stale {
        // The pod's sets of the last compile, which a set that moved by a few peers is made
        // from.
        let (prior, parts) = match cache.pods.remove(key) {
            Some(pod) => (pod.sets, pod.parts),
            None => (last.pods.get(key).cloned().unwrap_or_default(), Vec::new()),
        };
        let found = key
            .split_once('/')
            .and_then(|(namespace, name)| cluster.pods.get(namespace, name));
        let Some(pod) = found else {
            done.changed |= last.pods.remove(key).is_some();
            continue;
        };
        done.pods += 1;
        // The pod itself changed: its labels pick its policies, its named ports resolve them.
        let itself = changes
            .pods
            .get(&pod.namespace)
            .is_some_and(|changed| changed.iter().any(|c| c.name == pod.name));
        let parts = if itself { Vec::new() } else { parts };
        let (sets, errors, reads, parts, over_budget) =
            compile_pod(policies, cluster, admin, pod, &prior, parts, changes, last);
        let before = if sets == PodSets::default() {
            last.pods.remove(key)
        } else {
            last.pods.insert(key.to_owned(), sets.clone())
        };
        done.changed |= before.unwrap_or_default() != sets;
        if admin_in_force {
            uncached_errors.extend(errors);
        } else {
            cache.pods.insert(
                key.to_owned(),
                CachedPod {
                    sets,
                    errors,
                    over_budget,
                    reads,
                    parts,
                },
            );
        }
    }
    // The sets no local pod names any more.
    let named: BTreeSet<&str> = last
        .pods
        .values()
        .flat_map(|sets| [&sets.ingress, &sets.egress])
        .flatten()
        .map(String::as_str)
        .collect();
    last.sets.retain(|name, _| named.contains(name.as_str()));
    let errors: BTreeSet<String> = cache
        .pods
        .values()
        .flat_map(|pod| pod.errors.iter().cloned())
        .chain(uncached_errors)
        .collect();
    last.errors = errors.into_iter().collect();
    done
}

/// Whether the sets `sets` names are all in `sets_by_name`.
fn sets_present(sets: &PodSets, sets_by_name: &BTreeMap<String, PolicySet>) -> bool {
    [&sets.ingress, &sets.egress]
        .into_iter()
        .flatten()
        .all(|name| sets_by_name.contains_key(name))
}

/// Compiles one local pod's sets, adding those not in `last` (made from the pod's `prior`
/// sets where they moved by a few peers, from its policies' `parts` of the last compile
/// where `changes` leaves them); also its errors, what it read, its policies' parts and
/// whether a set was refused for the budget.
#[expect(
    clippy::too_many_arguments,
    reason = "the pod, its cluster, its policies and what the last compile left, passed down"
)]
fn compile_pod(
    policies: &[Arc<NetworkPolicy>],
    cluster: &PolicyCluster<'_>,
    admin: &AdminPolicies,
    pod: &PolicyPod,
    prior: &PodSets,
    parts: Vec<PolicyPart>,
    changes: &PolicyChanges,
    last: &mut CompiledPolicies,
) -> (PodSets, Vec<String>, Reads, Vec<PolicyPart>, bool) {
    *cluster.reads.borrow_mut() = Reads::Nothing;
    cluster.read(&pod.namespace, Read::Named(pod.name.clone()));
    let parts = parts_reusing(policies, cluster, pod, parts, changes);
    // The parts with those refused for size (a copy, made at the first refusal): the parts
    // themselves are kept for the next compile, which may find room for them.
    let mut refused: Option<Vec<PolicyPart>> = None;
    let mut sets = PodSets::default();
    let mut errors = Vec::new();
    let mut over_budget = false;
    for direction in [Direction::Ingress, Direction::Egress] {
        // Policies that fit alone may not fit together: the largest is refused (it allows
        // nothing for this pod), and the rest compiled again, until what is left fits.
        let (name, notes) = loop {
            let working = refused.as_deref().unwrap_or(&parts);
            let (policy, _) = assemble_parts(working);
            let rules = match direction {
                Direction::Ingress => policy.ingress,
                Direction::Egress => policy.egress,
            };
            let (rules, notes) = with_tiers(rules, direction, cluster, admin, pod);
            let Some(rules) = rules else {
                break (None, notes);
            };
            match compile_set(&pod.namespace, direction, rules, prior, last) {
                Ok(name) => break (Some(name), notes),
                Err(too_large) => {
                    over_budget |= matches!(too_large, SetRefused::OverBudget { .. });
                    match largest_part(working, direction) {
                        Some(index) => refuse_part(
                            refused.get_or_insert_with(|| parts.clone()),
                            index,
                            direction,
                            &format!("with the pod {}'s other policies, {too_large}", pod.key()),
                        ),
                        // Nothing of the namespace's own to refuse: the cluster-wide tiers alone
                        // are too large, and the pod's direction is closed.
                        None => {
                            errors.push(format!(
                            "pod {}: its admin network policies' {direction:?} rules: {too_large}; it is denied everything in that direction",
                            pod.key()
                        ));
                            let closed = PodRules::default();
                            let name = compile_set(&pod.namespace, direction, closed, prior, last)
                                .expect("an empty rule list fits");
                            break (Some(name), notes);
                        }
                    }
                }
            }
        };
        sets.log |= notes.log;
        sets.snoop_dns |= notes.snoop_dns;
        match direction {
            Direction::Ingress => sets.ingress = name,
            Direction::Egress => sets.egress = name,
        }
    }
    let (_, part_errors) = assemble_parts(refused.as_deref().unwrap_or(&parts));
    errors.splice(0..0, part_errors);
    (sets, errors, cluster.reads.take(), parts, over_budget)
}

/// The name of the set of `rules` (one pod's, in `direction`), compiled into `last` unless it
/// is there already: made from the pod's `prior` set where it moved by a few peers or ports.
fn compile_set(
    namespace: &str,
    direction: Direction,
    rules: PodRules,
    prior: &PodSets,
    last: &mut CompiledPolicies,
) -> Result<String, SetRefused> {
    let name = set_name(namespace, direction, &rules);
    if last.sets.contains_key(&name) {
        return Ok(name);
    }
    let prior = match direction {
        Direction::Ingress => prior.ingress.as_ref(),
        Direction::Egress => prior.egress.as_ref(),
    };
    let base = prior.and_then(|n| last.sets.get(n));
    let reused = base.and_then(|base| {
        recompile_hosts(
            &base.rules,
            &base.compiled,
            &rules.rules,
            rules.admin_end,
            false,
        )
        .or_else(|| repaint_ports(&base.rules, &base.compiled, &rules.rules, rules.admin_end))
    });
    let compiled = match reused {
        Some(compiled) => compiled,
        None => compile_tiered(&rules.rules, rules.admin_end, false)?,
    };
    // A rule list that allows nothing always fits: it is what a refusal leaves.
    if !rules.rules.is_empty() {
        within_budget(&compiled, prior.map(String::as_str), last)?;
    }
    let set = PolicySet {
        namespace: namespace.to_owned(),
        direction,
        compiled: Arc::new(compiled),
        refs: Arc::new(rules.refs),
        rules: Arc::new(rules.rules),
    };
    last.sets.insert(name.clone(), set);
    Ok(name)
}

/// Whether `compiled`, a new set replacing the pod's `prior` one, keeps the sets within the
/// budget. The prior set is not counted (it goes when no pod names it any more), nor are the
/// sets no pod names since the last compile.
fn within_budget(
    compiled: &super::CompiledSet,
    prior: Option<&str>,
    last: &CompiledPolicies,
) -> Result<(), SetRefused> {
    let named: BTreeSet<&str> = (last.pods.values())
        .flat_map(|sets| [&sets.ingress, &sets.egress])
        .flatten()
        .map(String::as_str)
        .filter(|name| Some(*name) != prior)
        .collect();
    let held: usize = (last.sets.iter())
        .filter(|(name, _)| named.contains(name.as_str()))
        .map(|(_, set)| set.compiled.entries())
        .sum();
    let entries = compiled.entries();
    let budget = last.budget.0;
    if held.saturating_add(entries) > budget {
        return Err(SetRefused::OverBudget {
            entries,
            held,
            budget,
        });
    }
    Ok(())
}

/// One direction of a pod with the cluster-wide tiers around its NetworkPolicy rules (`np`,
/// `None` where no NetworkPolicy isolates it): the admin tier's rules first, then the
/// NetworkPolicy rules (what none allows is denied: the kernel's default for a policy set),
/// or, for a pod no NetworkPolicy isolates, the baseline tier's rules and an allow for
/// everything else. `None`: nothing judges that direction. Also what the admin policies
/// that contributed ask of the pod's endpoint.
fn with_tiers(
    np: Option<PodRules>,
    direction: Direction,
    cluster: &PolicyCluster<'_>,
    admin: &AdminPolicies,
    pod: &PolicyPod,
) -> (Option<PodRules>, TierNotes) {
    let mut tiered = PodRules::default();
    let mut notes =
        super::admin::tier_rules(&admin.admin, direction, cluster, admin, pod, &mut tiered);
    tiered.admin_end = tiered.rules.len();
    let rest = match np {
        Some(np) => np,
        None => {
            let mut baseline = PodRules::default();
            notes.merge(super::admin::tier_rules(
                &admin.baseline,
                direction,
                cluster,
                admin,
                pod,
                &mut baseline,
            ));
            if tiered.rules.is_empty() && baseline.rules.is_empty() {
                return (None, notes);
            }
            // Nothing matched: allowed (not a rule anyone wrote, so never audited).
            baseline.rules.push(Rule {
                index: ACL_RULE_EXEMPT,
                verdict: Verdict::Allow,
                destinations: vec![
                    "0.0.0.0/0".parse().expect("valid"),
                    "::/0".parse().expect("valid"),
                ],
                except: Vec::new(),
                peers: Vec::new(),
                ports: Ports::Any,
            });
            baseline
        }
    };
    if tiered.rules.is_empty() {
        return (Some(rest), notes);
    }
    let offset = tiered.refs.len() as u32;
    tiered.rules.extend(rest.rules.into_iter().map(|mut rule| {
        if rule.index != ACL_RULE_EXEMPT {
            rule.index += offset;
        }
        rule
    }));
    tiered.refs.extend(rest.refs);
    (Some(tiered), notes)
}

/// `<namespace>:<direction>:<hash of the rules>`.
fn set_name(namespace: &str, direction: Direction, rules: &PodRules) -> String {
    use std::hash::{BuildHasher, Hash, Hasher};
    // A fixed seed: the same rules have the same name in every agent and every run. Not
    // SipHash: hashing a set of 1,200 peers with it was a tenth of a peer added.
    let mut hasher = foldhash::quality::FixedState::with_seed(0).build_hasher();
    rules.rules.hash(&mut hasher);
    rules.admin_end.hash(&mut hasher);
    for reference in &rules.refs {
        (
            reference.kind,
            &reference.policy,
            reference.rule,
            &reference.name,
        )
            .hash(&mut hasher);
    }
    let direction = match direction {
        Direction::Ingress => "ingress",
        Direction::Egress => "egress",
    };
    format!("{namespace}:{direction}:{:016x}", hasher.finish())
}
