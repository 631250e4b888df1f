//! Leader election for the controller on a `coordination.k8s.io/v1` Lease: one replica
//! decides, the others wait. The Lease is taken when it is free or expired and renewed well
//! within its duration; every write carries the resourceVersion read, so two replicas racing
//! for it cannot both win.

use std::time::Duration;

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::{SignedDuration, Timestamp},
};
use kube::{Api, api::PostParams};

pub struct Leadership {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
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

    /// Takes or renews the Lease; whether this replica leads now.
    pub async fn acquire_or_renew(&self) -> Result<bool, kube::Error> {
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
                Ok(_) => Ok(true),
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
                Err(error) => Err(error),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let ours = spec.holder_identity.as_deref() == Some(&self.identity);
        if !ours && !expired(&spec, now) {
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
            Ok(_) => Ok(true),
            // Someone else wrote it since it was read.
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
            Err(error) => Err(error),
        }
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

/// Whether the Lease's holder let it run out (or it has none).
fn expired(spec: &LeaseSpec, now: Timestamp) -> bool {
    let Some(MicroTime(renewed)) = spec.renew_time else {
        return true;
    };
    let duration = i64::from(spec.lease_duration_seconds.unwrap_or(15));
    spec.holder_identity.is_none()
        || now.duration_since(renewed) > SignedDuration::from_secs(duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_expires_after_its_duration_without_renewal() {
        let now = Timestamp::now();
        let spec = |renewed: Timestamp| LeaseSpec {
            holder_identity: Some("other".into()),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(renewed)),
            ..Default::default()
        };
        assert!(!expired(&spec(now), now));
        let old = now - SignedDuration::from_secs(16);
        assert!(expired(&spec(old), now));
        assert!(expired(&LeaseSpec::default(), now));
    }
}
