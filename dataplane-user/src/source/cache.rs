//! The API source's cache: each object as last parsed, with its version, and the state they
//! make together, patched object by object.

use std::{borrow::Cow, collections::BTreeMap, sync::Arc};

use super::{pod::Pod, state::ClusterState};

/// A watched resource's name (its plural), and an object's namespace and name.
pub type ObjectKey = (&'static str, String, String);

/// Each object of an API source as last parsed, with the version it was parsed at, and the
/// cluster state they make together, patched object by object: a change parses and places only
/// its own object (at 183,000 objects, assembling the state anew took each sync 40 ms).
#[derive(Debug, Default)]
pub struct ObjectCache {
    /// In key order, as [`Self::assemble`] takes them. A Pod, most of a cluster's objects, is
    /// kept as the object alone (a whole state per Pod cost 60 MiB at 150,000 pods).
    objects: BTreeMap<ObjectKey, (Option<String>, Parsed)>,
    /// Every object held, each list in key order (namespace, name), as [`Self::assemble`]
    /// gives it.
    assembled: ClusterState,
    /// Whether `assembled` follows the objects. Not after [`Self::clear`] (nor at first): a
    /// whole list of puts would place each object in the middle of its list, moving the rest
    /// (at 150,000 pods, seconds); the next assemble makes it anew, and from then on each
    /// change is placed.
    placed: bool,
    /// The rejection lines of the objects that have some.
    rejected: BTreeMap<ObjectKey, Vec<String>>,
}

impl ObjectCache {
    /// The object `key` at `version`: parsed by `parse` unless it was parsed at that version
    /// (an object without a version is parsed every time).
    pub fn put(
        &mut self,
        key: ObjectKey,
        version: Option<String>,
        parse: impl FnOnce() -> ClusterState,
    ) {
        if !self.holds(&key, version.as_deref()) {
            let parsed = parse();
            if self.placed {
                self.place(&key, Some(&parsed));
            }
            self.objects.insert(key, (version, Parsed::from(parsed)));
        }
    }

    /// Puts `parsed`, the object `key` at `version`, whatever the cache held.
    fn put_parsed(&mut self, key: ObjectKey, version: Option<String>, parsed: Parsed) {
        if self.placed {
            self.place(&key, Some(&parsed.state()));
        }
        self.objects.insert(key, (version, parsed));
    }

    /// A list's objects, parsed: put as [`Self::put`] puts each, but while the state is
    /// not yet assembled (the first lists), merged in at once: 177,000 objects put one by
    /// one searched the tree for each twice.
    pub fn put_listed(&mut self, objects: Vec<(ObjectKey, Option<String>, Parsed)>) {
        if self.placed {
            for (key, version, parsed) in objects {
                if !self.holds(&key, version.as_deref()) {
                    self.put_parsed(key, version, parsed);
                }
            }
            return;
        }
        // Collecting sorts (stably: of two puts of one key, the later stays) and builds the
        // tree in one pass; appending merges two sorted trees the same way.
        let mut listed: BTreeMap<_, _> = objects
            .into_iter()
            .map(|(key, version, parsed)| (key, (version, parsed)))
            .collect();
        self.objects.append(&mut listed);
    }

    /// Whether the object `key` is held as parsed at `version` (an object without a version
    /// never is).
    pub fn holds(&self, key: &ObjectKey, version: Option<&str>) -> bool {
        version.is_some()
            && self
                .objects
                .get(key)
                .is_some_and(|(v, _)| v.as_deref() == version)
    }

    /// Forgets the object `key` (deleted).
    pub fn remove(&mut self, key: &ObjectKey) {
        if self.placed && self.objects.contains_key(key) {
            self.place(key, None);
        }
        self.objects.remove(key);
    }

    /// Forgets every object `keep` does not want (deleted ones).
    pub fn retain(&mut self, keep: impl Fn(&ObjectKey) -> bool) {
        let gone: Vec<ObjectKey> = self.objects.keys().filter(|k| !keep(k)).cloned().collect();
        for key in &gone {
            self.remove(key);
        }
    }

    /// Forgets everything: the next puts parse anew.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Has the next [`Self::assemble`] build the state anew from every object's parse (a
    /// full recompute) instead of returning the one patched change by change.
    pub fn reassemble(&mut self) {
        self.placed = false;
    }

    /// The cluster state of every object held.
    pub fn assemble(&mut self) -> ClusterState {
        if !self.placed {
            let mut state = ClusterState::default();
            self.rejected.clear();
            for (key, (_, parsed)) in &self.objects {
                let parsed = parsed.state();
                state.absorb(&parsed);
                if !parsed.rejected.is_empty() {
                    self.rejected.insert(key.clone(), parsed.rejected.clone());
                }
            }
            self.assembled = state;
            self.placed = true;
        }
        self.assembled.clone()
    }

    /// Puts the objects of `key`'s new parse (`None`: removed) into the assembled state in
    /// place of its last one's.
    fn place(&mut self, key: &ObjectKey, new: Option<&ClusterState>) {
        let empty = ClusterState::default();
        let old = self
            .objects
            .get(key)
            .map_or(Cow::Borrowed(&empty), |(_, parsed)| parsed.state());
        let new = new.unwrap_or(&empty);
        let at = (key.1.as_str(), key.2.as_str());
        let state = &mut self.assembled;
        macro_rules! place_in {
            ($($list:ident),*) => {$(
                // Only the list the object's kind goes to: another kind's object may have the
                // same namespace and name (a Node and a Namespace both called `worker-1`).
                if !old.$list.is_empty() || !new.$list.is_empty() {
                    // One object at most: one API object's parse.
                    state.$list.place(at, new.$list.first());
                }
            )*};
        }
        place_in!(
            nodes,
            namespaces,
            pods,
            services,
            endpoint_slices,
            network_policies,
            egress_firewalls,
            egress_ips,
            egress_routers,
            admin_network_policies,
            baseline_admin_network_policies,
            cluster_network_policies,
            user_defined_networks,
            cluster_user_defined_networks
        );
        let settings_changed = old.has_settings() || new.has_settings();
        if !old.rejected.is_empty() || !new.rejected.is_empty() {
            if new.rejected.is_empty() {
                self.rejected.remove(key);
            } else {
                self.rejected.insert(key.clone(), new.rejected.clone());
            }
            self.assembled.rejected = self.rejected.values().flatten().cloned().collect();
        }
        if settings_changed {
            self.take_settings(key, new);
        }
    }

    /// The `Network` settings after `key` became `new`: those of the last object in key
    /// order that has a `Network` (as assembling every object in order gives them), or none.
    fn take_settings(&mut self, key: &ObjectKey, new: &ClusterState) {
        let mut holders: Vec<(&ObjectKey, &ClusterState)> = self
            .objects
            .iter()
            .filter_map(|(k, (_, parsed))| match parsed {
                Parsed::State(state) if k != key && state.has_settings() => Some((k, &**state)),
                _ => None,
            })
            .collect();
        holders.push((key, new));
        holders.sort_by(|a, b| a.0.cmp(b.0));
        let mut settings = ClusterState::default();
        for (_, parsed) in holders {
            settings.absorb_settings(parsed);
        }
        self.assembled.copy_settings(&settings);
    }
}

/// One API object's parse as [`ObjectCache`] keeps it: a Pod alone, anything else (another
/// kind, a rejection, the `Network`'s settings) as the state it made. Made from the parse's
/// state (`Parsed::from`) where the object was parsed, which may be another thread.
#[derive(Debug)]
pub enum Parsed {
    Pod(Arc<Pod>),
    State(Box<ClusterState>),
}

impl From<ClusterState> for Parsed {
    fn from(state: ClusterState) -> Self {
        let lone_pod = state.pods.len() == 1
            && state.object_count() == 1
            && state.network.is_none()
            && state.rejected.is_empty();
        match state.pods.first() {
            Some(pod) if lone_pod => Parsed::Pod(Arc::clone(pod)),
            _ => Parsed::State(Box::new(state)),
        }
    }
}

impl Parsed {
    /// The state the object made.
    fn state(&self) -> Cow<'_, ClusterState> {
        match self {
            Parsed::Pod(pod) => {
                let mut state = ClusterState::default();
                state.pods.push(Arc::clone(pod));
                Cow::Owned(state)
            }
            Parsed::State(state) => Cow::Borrowed(state),
        }
    }
}
