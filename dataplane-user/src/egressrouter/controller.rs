//! The controller's egress router part (what OpenShift's network operator does for an
//! `EgressRouter`): the leader makes each router's attachment, Deployment and Service
//! ([`super::resource`]) and keeps them in step, and writes the router's `status.conditions`
//! (`Available`, `Progressing`, `Degraded`, with reasons).
//!
//! Each router is on its own: one that does not validate or whose objects cannot be written
//! is marked `Degraded` with the field or the API's answer, and what was made for its last
//! good version stays; the others carry on. Every API call has a deadline, and the work runs
//! in its own task beside the egress IP rounds, so a slow API server or many routers never
//! delay an egress IP move.

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::{apps::v1::Deployment, core::v1::Service},
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};
use kube::{
    Api,
    api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams},
};

use super::resource::{RouterObjects, plan};
use crate::{
    api::egressrouter::{
        ConditionStatus, ConditionType, EgressRouter, EgressRouterCondition, EgressRouterStatus,
    },
    kubernetes::within,
    source::ClusterState,
};

/// The field manager of the controller's server-side applies.
pub const FIELD_MANAGER: &str = "dataplane-egress-router";
/// How often the objects are applied again though nothing changed (a hand edit is undone),
/// as OpenShift's operator resyncs.
const RESYNC: Duration = Duration::from_secs(300);
/// How long after a failed apply it is tried again.
const RETRY: Duration = Duration::from_secs(10);
/// How often a router's Deployment is read for its status.
const CHECK: Duration = Duration::from_secs(2);
/// How often the task looks at the routers when nothing changed.
const TICK: Duration = Duration::from_secs(1);

/// How far a router's pod is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rollout {
    /// No Deployment (not made yet, or never: its spec was never valid).
    Missing,
    /// The Deployment is there and its pod not available (or an old pod still is).
    Progressing { available: i32, updated: i32 },
    /// The router pod of the current Deployment is available.
    Available,
}

impl Rollout {
    /// From the Deployment's status: done when the controller saw this generation and its one
    /// pod is updated and available.
    pub fn of(deployment: &Deployment) -> Rollout {
        let status = deployment.status.clone().unwrap_or_default();
        let available = status.available_replicas.unwrap_or(0);
        let updated = status.updated_replicas.unwrap_or(0);
        let seen =
            status.observed_generation.unwrap_or(0) >= deployment.metadata.generation.unwrap_or(0);
        if seen && available >= 1 && updated >= 1 {
            Rollout::Available
        } else {
            Rollout::Progressing { available, updated }
        }
    }
}

/// What went wrong with a router, if anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Problem {
    /// Its spec does not validate (the message names the field).
    InvalidSpec(String),
    /// Its address is held by an older router (the message names it).
    AddressConflict(String),
    /// Its objects could not be written (the API's answer).
    ApplyFailed(String),
}

/// The conditions for a router with `problem` and `rollout`, keeping each condition's
/// `lastTransitionTime` from `previous` where its status did not change.
pub fn conditions(
    previous: &[EgressRouterCondition],
    problem: Option<&Problem>,
    rollout: Rollout,
    now: Timestamp,
) -> Vec<EgressRouterCondition> {
    use ConditionStatus::{False, True};
    let (available, available_reason, available_message) = match rollout {
        Rollout::Available => (
            True,
            "RouterPodAvailable",
            "the router pod is available".to_owned(),
        ),
        Rollout::Progressing { available, .. } => (
            False,
            "RouterPodUnavailable",
            format!("{available} of 1 router pod available"),
        ),
        Rollout::Missing => (False, "NotCreated", "no router Deployment".to_owned()),
    };
    let (progressing, progressing_reason, progressing_message) = match (rollout, problem) {
        (_, Some(Problem::InvalidSpec(_))) => (False, "InvalidSpec", String::new()),
        (_, Some(Problem::AddressConflict(_))) => (False, "AddressConflict", String::new()),
        (Rollout::Progressing { updated, .. }, _) => (
            True,
            "Deploying",
            format!("rolling out the router pod ({updated} of 1 updated)"),
        ),
        (Rollout::Missing, _) => (True, "Creating", "making the router's objects".to_owned()),
        (Rollout::Available, _) => (False, "AsExpected", String::new()),
    };
    let (degraded, degraded_reason, degraded_message) = match problem {
        Some(Problem::InvalidSpec(why)) => (True, "InvalidSpec", why.clone()),
        Some(Problem::AddressConflict(why)) => (True, "AddressConflict", why.clone()),
        Some(Problem::ApplyFailed(why)) => (True, "ApplyFailed", why.clone()),
        None => (False, "AsExpected", String::new()),
    };
    [
        (
            ConditionType::Available,
            available,
            available_reason,
            available_message,
        ),
        (
            ConditionType::Progressing,
            progressing,
            progressing_reason,
            progressing_message,
        ),
        (
            ConditionType::Degraded,
            degraded,
            degraded_reason,
            degraded_message,
        ),
    ]
    .into_iter()
    .map(|(type_, status, reason, message)| {
        let since = previous
            .iter()
            .find(|c| c.type_ == type_ && c.status == status)
            .map_or(now, |c| c.last_transition_time.0);
        EgressRouterCondition {
            type_,
            status,
            last_transition_time: Time(since),
            reason: reason.to_owned(),
            message,
        }
    })
    .collect()
}

/// Where the router objects are written and read.
pub trait RouterApi {
    /// Creates or updates the three objects.
    fn apply(&mut self, objects: &RouterObjects) -> impl Future<Output = Result<(), String>>;
    /// The router's Deployment, if there is one.
    fn deployment(
        &mut self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Option<Deployment>, String>>;
    /// Writes the router's status.
    fn write_status(
        &mut self,
        namespace: &str,
        name: &str,
        status: &EgressRouterStatus,
    ) -> impl Future<Output = Result<(), String>>;
}

/// The API server: server-side applies owned by [`FIELD_MANAGER`], each call within
/// [`crate::kubernetes::CALL_DEADLINE`].
pub struct KubeRouters {
    pub client: kube::Client,
}

impl RouterApi for KubeRouters {
    async fn apply(&mut self, objects: &RouterObjects) -> Result<(), String> {
        let namespace = objects
            .deployment
            .metadata
            .namespace
            .clone()
            .unwrap_or_default();
        let name = objects.deployment.metadata.name.clone().unwrap_or_default();
        let gvk = GroupVersionKind::gvk("k8s.cni.cncf.io", "v1", "NetworkAttachmentDefinition");
        let resource = ApiResource::from_gvk_with_plural(&gvk, "network-attachment-definitions");
        let attachments: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &namespace, &resource);
        let attachment = objects.attachment.clone();
        apply(
            &attachments,
            &name,
            attachment,
            "NetworkAttachmentDefinition",
        )
        .await?;
        let deployment = with_kind(&objects.deployment, "apps/v1", "Deployment")?;
        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), &namespace);
        apply(&deployments, &name, deployment, "Deployment").await?;
        let service = with_kind(&objects.service, "v1", "Service")?;
        let services: Api<Service> = Api::namespaced(self.client.clone(), &namespace);
        apply(&services, &name, service, "Service").await?;
        Ok(())
    }

    async fn deployment(
        &mut self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Deployment>, String> {
        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), namespace);
        within(
            &format!("Deployment {namespace}/{name}"),
            deployments.get_opt(name),
        )
        .await
    }

    async fn write_status(
        &mut self,
        namespace: &str,
        name: &str,
        status: &EgressRouterStatus,
    ) -> Result<(), String> {
        let routers: Api<EgressRouter> = Api::namespaced(self.client.clone(), namespace);
        let patch = serde_json::json!({ "status": status });
        within(
            &format!("EgressRouter {namespace}/{name} status"),
            routers.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)),
        )
        .await
        .map(|_| ())
    }
}

/// A server-side apply of `object` (named `name`, a `kind`) owned by [`FIELD_MANAGER`],
/// within [`crate::kubernetes::CALL_DEADLINE`].
async fn apply<K>(
    api: &Api<K>,
    name: &str,
    object: serde_json::Value,
    kind: &str,
) -> Result<(), String>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let namespace = object["metadata"]["namespace"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    within(
        &format!("{kind} {namespace}/{name}"),
        api.patch(name, &params, &Patch::Apply(&object)),
    )
    .await
    .map(|_| ())
}

/// An object with its `apiVersion` and `kind` (a server-side apply needs them; k8s-openapi's
/// types leave them to the serializer's wrapper).
fn with_kind(
    object: &impl serde::Serialize,
    api_version: &str,
    kind: &str,
) -> Result<serde_json::Value, String> {
    let mut value = serde_json::to_value(object).map_err(|e| e.to_string())?;
    value["apiVersion"] = api_version.into();
    value["kind"] = kind.into();
    Ok(value)
}

/// What the controller remembers of one router between rounds.
#[derive(Debug, Default)]
struct Tracked {
    /// The objects last applied with success, and when.
    applied: Option<(RouterObjects, Instant)>,
    /// The last failed apply: what, when.
    failed: Option<(RouterObjects, Instant, String)>,
    rollout: Option<(Rollout, Instant)>,
    /// The status last written.
    written: Option<EgressRouterStatus>,
    reported: Option<Problem>,
}

/// The leader's egress router reconciler.
pub struct Reconciler {
    image: String,
    routers: BTreeMap<(String, String), Tracked>,
    /// Left to OpenShift's network operator (logged once).
    deferred: bool,
}

impl Reconciler {
    /// Router pods run `image`.
    pub fn new(image: String) -> Self {
        Reconciler {
            image,
            routers: BTreeMap::new(),
            deferred: false,
        }
    }

    /// Brings every router of `state` one step closer to what it asks for; `now` is the
    /// round's time (the tests give theirs).
    pub async fn round(&mut self, state: &ClusterState, api: &mut impl RouterApi, now: Instant) {
        // On OpenShift (its cluster configuration is there) the network operator makes the
        // routers' objects itself: a second router pod would claim the same address.
        if state.platform.is_some() {
            if !self.deferred {
                tracing::info!(
                    "OpenShift's network operator makes the EgressRouters' objects on this cluster; leaving them to it"
                );
                self.deferred = true;
            }
            return;
        }
        self.deferred = false;
        let mut present = std::collections::BTreeSet::new();
        let holders = super::resource::address_holders(state.egress_routers.iter());
        for router in state.egress_routers.iter() {
            let (Some(namespace), Some(name)) = (
                router.metadata.namespace.clone(),
                router.metadata.name.clone(),
            ) else {
                continue;
            };
            let key = (namespace, name);
            present.insert(key.clone());
            let tracked = self.routers.entry(key.clone()).or_default();
            let conflict = super::resource::conflict(router, &holders);
            reconcile(router, &key, tracked, &self.image, conflict, api, now).await;
        }
        // The garbage collector removes a deleted router's objects (they are owned by it).
        self.routers.retain(|key, _| present.contains(key));
    }
}

/// One router: apply what changed (or is due again), read its rollout, write its status.
async fn reconcile(
    router: &Arc<EgressRouter>,
    (namespace, name): &(String, String),
    tracked: &mut Tracked,
    image: &str,
    conflict: Option<String>,
    api: &mut impl RouterApi,
    now: Instant,
) {
    let since = |at: &Instant| now.saturating_duration_since(*at);
    let problem = match (plan(router, image), conflict) {
        (Err(why), _) => Some(Problem::InvalidSpec(why)),
        // Nothing made: its pod would claim an address another router's pod holds.
        (Ok(_), Some(why)) => Some(Problem::AddressConflict(why)),
        (Ok(objects), None) => {
            let due = match (&tracked.applied, &tracked.failed) {
                (_, Some((failed, at, _))) if *failed == objects && since(at) < RETRY => false,
                (Some((applied, at)), _) => *applied != objects || since(at) >= RESYNC,
                (None, _) => true,
            };
            if due {
                match api.apply(&objects).await {
                    Ok(()) => {
                        tracing::info!(namespace, name, "egress router objects applied");
                        tracked.applied = Some((objects, now));
                        tracked.failed = None;
                        // Read the new rollout at once.
                        tracked.rollout = None;
                    }
                    Err(error) => {
                        tracked.failed = Some((objects, now, error));
                    }
                }
            }
            tracked
                .failed
                .as_ref()
                .map(|(_, _, error)| Problem::ApplyFailed(error.clone()))
        }
    };
    if tracked.reported != problem {
        if let Some(problem) = &problem {
            tracing::warn!(namespace, name, ?problem, "egress router refused");
        }
        tracked.reported = problem.clone();
    }
    if tracked.rollout.is_none_or(|(_, at)| since(&at) >= CHECK) {
        match api.deployment(namespace, name).await {
            Ok(found) => {
                let rollout = found.as_ref().map_or(Rollout::Missing, Rollout::of);
                tracked.rollout = Some((rollout, now));
            }
            Err(error) => {
                tracing::debug!(namespace, name, %error, "reading the router's Deployment")
            }
        }
    }
    let rollout = tracked.rollout.map_or(Rollout::Missing, |(r, _)| r);
    // What this controller wrote last is newer than what the watch brought back.
    let current = router.status.clone().unwrap_or_default();
    let previous = tracked.written.as_ref().unwrap_or(&current);
    let status = EgressRouterStatus {
        conditions: conditions(
            &previous.conditions,
            problem.as_ref(),
            rollout,
            Timestamp::now(),
        ),
    };
    if &status != previous {
        match api.write_status(namespace, name, &status).await {
            Ok(()) => tracked.written = Some(status),
            Err(error) => tracing::warn!(namespace, name, %error, "writing the router's status"),
        }
    }
}

/// Runs the reconciler on the states `states` brings while it brings `Some` (the leader's
/// state); stands by on `None`.
pub async fn run(
    mut states: tokio::sync::watch::Receiver<Option<ClusterState>>,
    image: String,
    mut api: impl RouterApi,
) {
    let mut reconciler: Option<Reconciler> = None;
    loop {
        let state = states.borrow_and_update().clone();
        match state {
            Some(state) => {
                let reconciler = reconciler.get_or_insert_with(|| Reconciler::new(image.clone()));
                reconciler.round(&state, &mut api, Instant::now()).await;
            }
            // A new leader starts from what the objects say.
            None => reconciler = None,
        }
        // The sender gone: the controller is stopping.
        if let Ok(Err(_)) = tokio::time::timeout(TICK, states.changed()).await {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::apps::v1::DeploymentStatus;

    use super::*;
    use crate::source::Objects;

    /// An API server in memory: what was applied, the Deployments' statuses, the routers'
    /// statuses; `refuse` makes applies fail.
    #[derive(Default)]
    struct Memory {
        applied: Vec<RouterObjects>,
        deployments: BTreeMap<(String, String), Deployment>,
        statuses: BTreeMap<(String, String), EgressRouterStatus>,
        refuse: Option<String>,
    }

    impl RouterApi for Memory {
        async fn apply(&mut self, objects: &RouterObjects) -> Result<(), String> {
            if let Some(why) = &self.refuse {
                return Err(why.clone());
            }
            let meta = &objects.deployment.metadata;
            let key = (meta.namespace.clone().unwrap(), meta.name.clone().unwrap());
            let mut deployment = objects.deployment.clone();
            let generation = self
                .deployments
                .get(&key)
                .and_then(|d| d.metadata.generation)
                .unwrap_or(0);
            deployment.metadata.generation = Some(generation + 1);
            deployment.status = self.deployments.get(&key).and_then(|d| d.status.clone());
            self.deployments.insert(key, deployment);
            self.applied.push(objects.clone());
            Ok(())
        }

        async fn deployment(
            &mut self,
            namespace: &str,
            name: &str,
        ) -> Result<Option<Deployment>, String> {
            Ok(self
                .deployments
                .get(&(namespace.to_owned(), name.to_owned()))
                .cloned())
        }

        async fn write_status(
            &mut self,
            namespace: &str,
            name: &str,
            status: &EgressRouterStatus,
        ) -> Result<(), String> {
            self.statuses
                .insert((namespace.to_owned(), name.to_owned()), status.clone());
            Ok(())
        }
    }

    impl Memory {
        /// The Deployment's controller finished: its pod is available.
        fn roll_out(&mut self, namespace: &str, name: &str) {
            let deployment = self
                .deployments
                .get_mut(&(namespace.to_owned(), name.to_owned()))
                .expect("a Deployment");
            deployment.status = Some(DeploymentStatus {
                observed_generation: deployment.metadata.generation,
                available_replicas: Some(1),
                updated_replicas: Some(1),
                ..DeploymentStatus::default()
            });
        }

        /// `(type, status, reason)` of each condition of a router's last written status.
        fn conditions(
            &self,
            namespace: &str,
            name: &str,
        ) -> Vec<(ConditionType, ConditionStatus, String)> {
            self.statuses[&(namespace.to_owned(), name.to_owned())]
                .conditions
                .iter()
                .map(|c| (c.type_, c.status, c.reason.clone()))
                .collect()
        }
    }

    fn state(routers: &[&str]) -> ClusterState {
        let routers: Vec<Arc<EgressRouter>> = routers
            .iter()
            .map(|yaml| Arc::new(serde_yaml::from_str(yaml).expect("EgressRouter")))
            .collect();
        ClusterState {
            egress_routers: Objects::from(routers),
            ..ClusterState::default()
        }
    }

    const GOOD: &str = "
metadata: {name: good, namespace: a, uid: u-good}
spec:
  addresses: [{ip: 192.168.12.99/24, gateway: 192.168.12.1}]
  redirect: {fallbackIP: 203.0.113.1}
";
    const BAD: &str = "
metadata: {name: bad, namespace: b, uid: u-bad}
spec:
  addresses: [{ip: 192.168.12.98/24}]
  redirect: {fallbackIP: 203.0.113.1}
";

    use ConditionStatus::{False, True};
    use ConditionType::{Available, Degraded, Progressing};

    fn expect(
        list: &[(ConditionType, ConditionStatus, &str)],
    ) -> Vec<(ConditionType, ConditionStatus, String)> {
        list.iter()
            .map(|(t, s, r)| (*t, *s, (*r).to_owned()))
            .collect()
    }

    #[tokio::test]
    async fn a_router_is_made_rolls_out_and_a_bad_one_is_degraded_alone() {
        let mut api = Memory::default();
        let mut reconciler = Reconciler::new("pause".into());
        let mut now = Instant::now();
        reconciler.round(&state(&[GOOD, BAD]), &mut api, now).await;
        // The good one's objects applied once, the bad one's never.
        assert_eq!(api.applied.len(), 1);
        assert_eq!(
            api.applied[0].deployment.metadata.name.as_deref(),
            Some("good")
        );
        assert_eq!(
            api.conditions("a", "good"),
            expect(&[
                (Available, False, "RouterPodUnavailable"),
                (Progressing, True, "Deploying"),
                (Degraded, False, "AsExpected"),
            ])
        );
        assert_eq!(
            api.conditions("b", "bad"),
            expect(&[
                (Available, False, "NotCreated"),
                (Progressing, False, "InvalidSpec"),
                (Degraded, True, "InvalidSpec"),
            ])
        );
        assert_eq!(
            api.statuses[&("b".to_owned(), "bad".to_owned())].conditions[2].message,
            "spec.addresses[0].gateway: missing (the router's next hop on the reserved address's network)"
        );
        // The pod comes up: Available at the next look at the Deployment, not applied again.
        api.roll_out("a", "good");
        let written = api.statuses[&("a".to_owned(), "good".to_owned())].clone();
        now += CHECK;
        reconciler.round(&state(&[GOOD, BAD]), &mut api, now).await;
        assert_eq!(api.applied.len(), 1);
        assert_eq!(
            api.conditions("a", "good"),
            expect(&[
                (Available, True, "RouterPodAvailable"),
                (Progressing, False, "AsExpected"),
                (Degraded, False, "AsExpected"),
            ])
        );
        // Degraded kept its status, so it kept its transition time.
        let latest = &api.statuses[&("a".to_owned(), "good".to_owned())];
        assert_eq!(latest.conditions[2], written.conditions[2]);
        assert_ne!(
            latest.conditions[0].last_transition_time,
            written.conditions[0].last_transition_time
        );
        // Nothing changes: nothing is written or applied.
        let before = api.statuses.clone();
        now += CHECK;
        reconciler.round(&state(&[GOOD, BAD]), &mut api, now).await;
        assert_eq!(api.statuses, before);
        assert_eq!(api.applied.len(), 1);
        // Resync: applied again after five minutes.
        now += RESYNC;
        reconciler.round(&state(&[GOOD, BAD]), &mut api, now).await;
        assert_eq!(api.applied.len(), 2);
    }

    #[tokio::test]
    async fn a_router_asking_for_another_routers_address_is_degraded_and_made_nothing() {
        let mut api = Memory::default();
        let mut reconciler = Reconciler::new("pause".into());
        let older = GOOD.replace(
            "uid: u-good}",
            "uid: u-good, creationTimestamp: '2026-12-01T00:00:00Z'}",
        );
        let younger = GOOD
            .replace("name: good, namespace: a", "name: thief, namespace: t")
            .replace(
                "uid: u-good}",
                "uid: u-thief, creationTimestamp: '2026-12-02T00:00:00Z'}",
            );
        reconciler
            .round(&state(&[&younger, &older]), &mut api, Instant::now())
            .await;
        assert_eq!(api.applied.len(), 1);
        assert_eq!(
            api.applied[0].deployment.metadata.name.as_deref(),
            Some("good")
        );
        let status = &api.statuses[&("t".to_owned(), "thief".to_owned())];
        assert_eq!(status.conditions[2].reason, "AddressConflict");
        assert_eq!(
            status.conditions[2].message,
            "spec.addresses[0].ip: 192.168.12.99 is held by the older EgressRouter a/good"
        );
    }

    #[tokio::test]
    async fn on_openshift_the_routers_are_left_to_its_network_operator() {
        let mut api = Memory::default();
        let mut reconciler = Reconciler::new("pause".into());
        let mut openshift = state(&[GOOD]);
        openshift.platform = Some(crate::api::network::PlatformNetwork {
            cluster_networks: Vec::new(),
            subnet_pools: Vec::new(),
            service_networks: Vec::new(),
            external_ips: crate::api::network::ExternalIpPolicy::default(),
            not_applied: Vec::new(),
        });
        reconciler.round(&openshift, &mut api, Instant::now()).await;
        assert!(api.applied.is_empty() && api.statuses.is_empty());
    }

    #[tokio::test]
    async fn a_change_is_rolled_out_and_a_refused_apply_keeps_the_last_good_objects() {
        let mut api = Memory::default();
        let mut reconciler = Reconciler::new("pause".into());
        let mut now = Instant::now();
        reconciler.round(&state(&[GOOD]), &mut api, now).await;
        api.roll_out("a", "good");
        now += CHECK;
        reconciler.round(&state(&[GOOD]), &mut api, now).await;
        assert_eq!(
            api.conditions("a", "good")[0],
            (Available, True, "RouterPodAvailable".to_owned())
        );
        // A new fallback: the attachment changes, applied at once, the Deployment's new
        // generation rolls out.
        let changed = GOOD.replace("203.0.113.1", "203.0.113.2");
        reconciler.round(&state(&[&changed]), &mut api, now).await;
        assert_eq!(api.applied.len(), 2);
        assert!(
            api.applied[1].attachment["spec"]["config"]
                .as_str()
                .unwrap()
                .contains("203.0.113.2")
        );
        assert_eq!(
            api.conditions("a", "good")[1],
            (Progressing, True, "Deploying".to_owned())
        );
        // The change made invalid: degraded, named, nothing applied; the objects of the last
        // good spec stay (the pod still available).
        api.roll_out("a", "good");
        let invalid = GOOD.replace("gateway: 192.168.12.1", "gateway: 10.9.9.9");
        now += CHECK;
        reconciler.round(&state(&[&invalid]), &mut api, now).await;
        assert_eq!(api.applied.len(), 2);
        assert_eq!(
            api.conditions("a", "good"),
            expect(&[
                (Available, True, "RouterPodAvailable"),
                (Progressing, False, "InvalidSpec"),
                (Degraded, True, "InvalidSpec"),
            ])
        );
        // The API refuses a write: degraded with its answer, retried after a while, not at
        // every round.
        api.refuse = Some("Service a/good: field is immutable".into());
        let third = GOOD.replace("203.0.113.1", "203.0.113.3");
        reconciler.round(&state(&[&third]), &mut api, now).await;
        let status = &api.statuses[&("a".to_owned(), "good".to_owned())];
        assert_eq!(status.conditions[2].reason, "ApplyFailed");
        assert_eq!(
            status.conditions[2].message,
            "Service a/good: field is immutable"
        );
        api.refuse = None;
        reconciler.round(&state(&[&third]), &mut api, now).await;
        assert_eq!(api.applied.len(), 2, "not retried before {RETRY:?}");
        now += RETRY;
        reconciler.round(&state(&[&third]), &mut api, now).await;
        assert_eq!(api.applied.len(), 3);
        assert_eq!(
            api.conditions("a", "good")[2],
            (Degraded, False, "AsExpected".to_owned())
        );
    }
}
