//! Leader election for the controller on a `coordination.k8s.io/v1` Lease: one replica
//! decides, the others wait. The Lease is taken when it is free or expired and renewed well
//! within its duration; every write carries the resourceVersion read, so two replicas racing
//! for it cannot both win.
//!
//! Expiry is judged as client-go judges it: by when this replica last *saw the record
//! change* on its own monotonic clock, never by comparing the holder's `renewTime` (another
//! machine's wall clock) with its own. A replica whose clock is behind, or an NTP step, can
//! then neither take a Lease that is being renewed nor wait for ever on one that is not.

use std::time::{Duration, Instant};

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{Api, api::PostParams};

pub struct Leadership {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
    /// The Lease's record as last read, and when (this replica's clock) it last changed.
    observed: Option<(Observed, Instant)>,
    /// While leading: the epoch of this leadership (see [`epoch_of`]).
    epoch: Option<u64>,
}

/// What of a Lease tells its holder is alive: who holds it and the record of the last write.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Observed {
    holder: Option<String>,
    renew_time: Option<MicroTime>,
    transitions: Option<i32>,
}

impl Observed {
    fn of(spec: &LeaseSpec) -> Self {
        Observed {
            holder: spec.holder_identity.clone(),
            renew_time: spec.renew_time.clone(),
            transitions: spec.lease_transitions,
        }
    }
}

impl Leadership {
    pub fn new(
        client: kube::Client,
        namespace: &str,
        name: &str,
        identity: &str,
        duration: Duration,
    ) -> Self {
        Leadership {
            api: Api::namespaced(client, namespace),
            name: name.to_owned(),
            identity: identity.to_owned(),
            duration,
            observed: None,
            epoch: None,
        }
    }

    /// How often the leader renews: a third of the duration, so two renewals may fail.
    pub fn renew_every(&self) -> Duration {
        self.duration / 3
    }

    /// The leader stops leading when it has not renewed for this long: before the Lease can
    /// pass to another replica.
    pub fn step_down_after(&self) -> Duration {
        self.duration - self.renew_every()
    }

    /// Takes or renews the Lease; while this replica leads, the epoch of its leadership
    /// (the same from the round it took the Lease to the round it loses it).
    pub async fn acquire_or_renew(&mut self) -> Result<Option<u64>, kube::Error> {
        let leading = self.try_lead().await;
        if !matches!(leading, Ok(true)) {
            self.epoch = None;
        }
        Ok(leading?.then_some(self.epoch).flatten())
    }

    async fn try_lead(&mut self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..Default::default()
                },
                spec: Some(self.spec(now, now, 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(created) => {
                    self.epoch = Some(epoch_of(&created));
                    Ok(true)
                }
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
                Err(error) => Err(error),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let ours = spec.holder_identity.as_deref() == Some(&self.identity);
        let observed = self.observe(&spec);
        if !ours && !self.expired(&spec, observed) {
            return Ok(false);
        }
        let acquired = match (&spec.acquire_time, ours) {
            (Some(MicroTime(at)), true) => *at,
            _ => now,
        };
        let transitions = spec.lease_transitions.unwrap_or(0) + i32::from(!ours);
        lease.spec = Some(self.spec(acquired, now, transitions));
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(written) => {
                // A new leadership (or one this replica lost track of) starts an epoch.
                if !ours || self.epoch.is_none() {
                    self.epoch = Some(epoch_of(&written));
                }
                Ok(true)
            }
            // Someone else wrote it since it was read.
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// Notes the record read; when (on this replica's clock) it last changed.
    fn observe(&mut self, spec: &LeaseSpec) -> Instant {
        let record = Observed::of(spec);
        match &self.observed {
            Some((seen, at)) if *seen == record => *at,
            _ => {
                let now = Instant::now();
                self.observed = Some((record, now));
                now
            }
        }
    }

    /// Whether the Lease's holder let it run out: no holder, or a record that has not changed
    /// for its whole duration as this replica watched it.
    fn expired(&self, spec: &LeaseSpec, changed_at: Instant) -> bool {
        let duration = u64::try_from(spec.lease_duration_seconds.unwrap_or(15)).unwrap_or(15);
        spec.holder_identity.is_none() || changed_at.elapsed() > Duration::from_secs(duration)
    }

    fn spec(&self, acquired: Timestamp, renewed: Timestamp, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.duration.as_secs().max(1) as i32),
            acquire_time: Some(MicroTime(acquired)),
            renew_time: Some(MicroTime(renewed)),
            lease_transitions: Some(transitions),
            ..Default::default()
        }
    }
}

/// The epoch a leadership's probes carry: the Lease's resourceVersion as the write that took
/// it left it. The API server hands out resource versions that only grow (etcd's revision),
/// even across the Lease's deletion, so a later leader's epoch is larger whatever the
/// replicas' clocks say. A version that is no number (another store) falls back to the
/// transitions count, which also grows with each new leader.
fn epoch_of(lease: &Lease) -> u64 {
    lease
        .metadata
        .resource_version
        .as_deref()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or_else(|| {
            let transitions = lease.spec.as_ref().and_then(|s| s.lease_transitions);
            u64::try_from(transitions.unwrap_or(0)).unwrap_or(0)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::SignedDuration;

    fn spec(holder: &str, renewed: Timestamp) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(1),
            renew_time: Some(MicroTime(renewed)),
            ..Default::default()
        }
    }

    /// A Lease whose holder's clock runs a day behind (or ahead) is neither taken while its
    /// record keeps changing nor waited on once it stops: only this replica's clock counts.
    #[test]
    fn expiry_follows_the_observed_record_not_the_holders_clock() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _entered = runtime.enter();
        let client =
            kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap()))
                .unwrap();
        let mut leadership = Leadership::new(client, "ns", "lease", "me", Duration::from_secs(1));
        let day_behind = Timestamp::now() - SignedDuration::from_hours(24);
        // Renewed (its record changes) with a clock a day behind: alive.
        for step in 0..3 {
            let renewed = day_behind + SignedDuration::from_secs(step);
            let s = spec("other", renewed);
            let at = leadership.observe(&s);
            assert!(!leadership.expired(&s, at), "step {step}");
        }
        // No longer renewed: expired once a whole duration passed here.
        let s = spec("other", day_behind + SignedDuration::from_secs(2));
        let at = leadership.observe(&s);
        assert!(!leadership.expired(&s, at));
        std::thread::sleep(Duration::from_millis(1100));
        let at = leadership.observe(&s);
        assert!(leadership.expired(&s, at));
        // A holder a day ahead is not expired the moment it is seen either.
        let ahead = spec("third", Timestamp::now() + SignedDuration::from_hours(24));
        let at = leadership.observe(&ahead);
        assert!(!leadership.expired(&ahead, at));
        assert!(leadership.expired(&LeaseSpec::default(), Instant::now()));
    }

    #[test]
    fn epochs_come_from_the_resource_version_else_the_transitions() {
        let mut lease = Lease::default();
        lease.metadata.resource_version = Some("123456".into());
        assert_eq!(epoch_of(&lease), 123456);
        lease.metadata.resource_version = Some("opaque-v9".into());
        lease.spec = Some(LeaseSpec {
            lease_transitions: Some(4),
            ..Default::default()
        });
        assert_eq!(epoch_of(&lease), 4);
    }
}
