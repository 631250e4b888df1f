//! The objects of this node's namespaces, found by namespace and kept between syncs: what a
//! firewall compile reads without walking every object of the cluster.

use std::{collections::BTreeSet, sync::Arc};

use k8s_openapi::api::networking::v1::NetworkPolicy;

use crate::api::egressfirewall::EgressFirewall;

/// The hosted namespaces' EgressFirewalls and NetworkPolicies as [`FirewallInputs::from_state`]
/// last took them: taken again from a list only when that list or the hosted namespaces
/// changed. A pod or node change leaves both as they were, and walking the 2,000 policies of
/// a large cluster for them was 5 to 8 % of such a change.
#[derive(Default)]
pub struct HostedLists {
    /// The hosted namespaces, and whether the lists were in key order, of the last call.
    pub(super) namespaces: Vec<String>,
    in_key_order: bool,
    pub(super) firewalls: Hosted<EgressFirewall>,
    pub(super) policies: Hosted<NetworkPolicy>,
}

impl HostedLists {
    /// Forgets what was taken when the hosted namespaces are not those of the last call.
    pub(super) fn follow_namespaces(&mut self, namespaces: &BTreeSet<&str>, in_key_order: bool) {
        if self.in_key_order == in_key_order
            && namespaces
                .iter()
                .copied()
                .eq(self.namespaces.iter().map(String::as_str))
        {
            return;
        }
        *self = Self {
            namespaces: namespaces.iter().map(|n| n.to_string()).collect(),
            in_key_order,
            ..Self::default()
        };
    }
}

/// One kind's hosted objects and the list they were taken from.
pub(super) struct Hosted<T> {
    pub(super) from: Option<crate::source::Objects<T>>,
    hosted: Vec<Arc<T>>,
}

impl<T> Default for Hosted<T> {
    fn default() -> Self {
        Self {
            from: None,
            hosted: Vec::new(),
        }
    }
}

impl<T: kube::Resource> Hosted<T> {
    /// [`hosted`] of `objects`, the last result when `objects` is the list it came from.
    pub(super) fn take(
        &mut self,
        objects: &crate::source::Objects<T>,
        namespaces: &BTreeSet<&str>,
        ordered: bool,
    ) -> Vec<Arc<T>> {
        let kept = match &self.from {
            Some(from) if from.shares(objects) => true,
            // A list the object cache changed at a few keys since (a policy's port, say):
            // only those keys are looked at, where walking the 2,000 policies again was a
            // tenth of such a change.
            Some(from) if ordered => objects.placed_since(from).is_some_and(|placed| {
                let keys: BTreeSet<(&str, &str)> = placed.collect();
                keys.len() <= FEW_PLACED && {
                    patch_hosted(&mut self.hosted, objects, namespaces, &keys);
                    true
                }
            }),
            _ => false,
        };
        if !kept {
            self.hosted = hosted(objects, namespaces, ordered);
        }
        self.from = Some(objects.clone());
        self.hosted.clone()
    }
}

/// Up to this many keys placed since the last list, [`hosted`]'s result is patched.
const FEW_PLACED: usize = 64;

/// Where an object of `hosted`'s result sorts: by namespace (one without sorts where
/// `default` does, before `default`'s own objects), then name.
fn hosted_slot<'a>(namespace: &'a str, name: &'a str) -> (&'a str, bool, &'a str) {
    if namespace.is_empty() {
        ("default", false, name)
    } else {
        (namespace, true, name)
    }
}

/// Where `object` sorts in [`hosted`]'s result (see [`hosted_slot`]).
pub(super) fn slot_of<T: kube::Resource>(object: &T) -> (&str, bool, &str) {
    let meta = object.meta();
    hosted_slot(
        meta.namespace.as_deref().unwrap_or(""),
        meta.name.as_deref().unwrap_or(""),
    )
}

/// Brings `hosted`, [`hosted`]'s result for an earlier version of `objects` (in key order),
/// to `objects` at the `placed` keys: each is taken out, and put back where it sorts if the
/// list holds it and its namespace is hosted.
fn patch_hosted<T: kube::Resource>(
    hosted: &mut Vec<Arc<T>>,
    objects: &crate::source::Objects<T>,
    namespaces: &BTreeSet<&str>,
    placed: &BTreeSet<(&str, &str)>,
) {
    for &(namespace, name) in placed {
        let slot = hosted_slot(namespace, name);
        if !namespaces.contains(slot.0) {
            continue;
        }
        if let Some(at) = hosted.iter().position(|o| slot_of(&**o) == slot) {
            hosted.remove(at);
        }
        if let Some(object) = objects.at_key((namespace, name)) {
            let at = hosted.partition_point(|o| slot_of(&**o) < slot);
            hosted.insert(at, Arc::clone(object));
        }
    }
}

/// The objects of `namespaces` (an object without a namespace is in `default`), by namespace
/// and, within one, in the list's order. A node judges its own pods' traffic only (a pod's
/// egress at its veth, a packet to it at its veth), and EgressFirewalls and NetworkPolicies
/// apply to their own namespace's pods: so a node resolves, compiles and writes nothing for
/// namespaces it does not host (at 5,000 nodes, a firewall's DNS names are resolved by the
/// nodes of its namespace's pods, not by all). What stays cluster-wide is what a local pod's
/// rules may name: every pod as a policy peer, and the namespaces' labels. A list in key order
/// (the API source's) is walked once, its runs of one namespace kept or skipped whole: a
/// binary search per hosted namespace into the persistent list cost every access-control
/// sync 0.4 ms at 2,000 policies and 110 namespaces, against tens of microseconds for the walk.
pub(super) fn hosted<T: kube::Resource>(
    objects: &crate::source::Objects<T>,
    namespaces: &BTreeSet<&str>,
    ordered: bool,
) -> Vec<Arc<T>> {
    if !ordered {
        let mut out = Vec::new();
        for namespace in namespaces {
            if *namespace == "default" {
                out.extend(objects.of_namespace("", false));
            }
            out.extend(objects.of_namespace(namespace, false));
        }
        return out;
    }
    let hosts_default = namespaces.contains("default");
    // Objects without a namespace sort first in the list but belong where `default` sorts.
    let mut unnamespaced = Vec::new();
    let mut out = Vec::new();
    let mut run: Option<(&str, bool)> = None;
    for object in objects.iter() {
        let namespace = object.meta().namespace.as_deref().unwrap_or("");
        if namespace.is_empty() {
            if hosts_default {
                unnamespaced.push(Arc::clone(object));
            }
            continue;
        }
        let kept = match run {
            Some((current, kept)) if current == namespace => kept,
            _ => {
                let kept = namespaces.contains(namespace);
                run = Some((namespace, kept));
                kept
            }
        };
        if !kept {
            continue;
        }
        if namespace >= "default" && !unnamespaced.is_empty() {
            out.append(&mut unnamespaced);
        }
        out.push(Arc::clone(object));
    }
    out.append(&mut unnamespaced);
    out
}
