//! The kernel's audit records read from its ring buffer, named (policy, rule, namespace) and
//! written to the audit log at each namespace's level.

use aya::maps::{Map, MapData, RingBuf};
use dataplane_common::{
    acl::{ACL_KIND_POLICY, ACL_VERDICT_DENY, AclEvent},
    maps,
};
use tokio::io::{Interest, unix::AsyncFd};

use super::{
    super::{
        AclState,
        admin::AdminPolicies,
        audit::{AuditLog, NamespaceLogging, RecordSource},
        pod_rules::PolicyKind,
        pods::Direction,
    },
    FirewallAgent,
};
use crate::kernel::capacity::map_err;
use crate::{api::network::PolicyAuditConfig, error::AgentError, kernel::loader::Dataplane};

/// Waits until `fd` is readable (forever without one).
pub(crate) async fn readable(fd: Option<&AsyncFd<RingBuf<MapData>>>) {
    match fd {
        Some(fd) => match fd.readable().await {
            Ok(mut guard) => guard.clear_ready(),
            Err(_) => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

/// Opens a pinned ring buffer for polling; `None` (with a warning) where it cannot be polled.
pub(crate) fn open_ring(
    dataplane: &Dataplane,
    name: &'static str,
) -> Result<Option<AsyncFd<RingBuf<MapData>>>, AgentError> {
    let pin = dataplane.pins().map(name);
    let ring = MapData::from_pin(&pin)
        .map_err(map_err(name, "open pin"))
        .and_then(|data| RingBuf::try_from(Map::RingBuf(data)).map_err(map_err(name, "open")))?;
    // SAFETY: the ring buffer owns its map's descriptor, which stays open and the same for as
    // long as the ring (moved into the AsyncFd) lives.
    match unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) } {
        Ok(fd) => Ok(Some(fd)),
        Err(error) => {
            tracing::warn!(%error, ring = name, "ring buffer not pollable");
            Ok(None)
        }
    }
}

/// The audit levels of an admin policy in force.
fn admin_logging(admin: &AdminPolicies, kind: PolicyKind, name: &str) -> Option<NamespaceLogging> {
    admin
        .all()
        .find(|p| p.kind == kind && p.name == name)
        .and_then(|p| p.log)
}

/// Who a record is about and the name it is logged under.
pub(super) struct Described {
    /// The namespace of the pod whose rules decided.
    namespace: String,
    pub(super) acl_name: String,
    /// The rule index the record names (the event's own when `None`).
    pub(super) rule: Option<u32>,
    /// The cluster-wide policy that decided: its levels apply, not the namespace's.
    pub(super) admin: Option<(PolicyKind, String)>,
}

/// The ACL name a record is logged under, as OVN-Kubernetes names them:
/// `EF:<namespace>:default` for the EgressFirewall, `NP:<namespace>:<policy>:<Ingress|Egress>`
/// for a NetworkPolicy (the record's rule index follows), `ANP:<name>:<Ingress|Egress>` and
/// `BANP:default:<Ingress|Egress>` (with the rule's index in the policy), and `CNP:<name>:...`
/// for a ClusterNetworkPolicy.
pub(super) fn describe(state: &AclState, event: &AclEvent) -> Option<Described> {
    if event.kind == ACL_KIND_POLICY {
        let set = state.policy_set(event.set)?;
        let direction = match set.direction {
            Direction::Ingress => "Ingress",
            Direction::Egress => "Egress",
        };
        let namespace = set.namespace.clone();
        return Some(match set.refs.get(event.rule as usize) {
            Some(reference) if reference.kind == PolicyKind::NetworkPolicy => {
                let policy = reference.policy.rsplit('/').next().unwrap_or_default();
                Described {
                    acl_name: format!("NP:{namespace}:{policy}:{direction}"),
                    namespace,
                    rule: None,
                    admin: None,
                }
            }
            Some(reference) => Described {
                acl_name: format!(
                    "{}:{}:{direction}",
                    reference.kind.audit_prefix(),
                    reference.policy
                ),
                namespace,
                rule: Some(reference.rule as u32),
                admin: Some((reference.kind, reference.policy.clone())),
            },
            // No rule allowed: the isolation itself denied.
            None => Described {
                acl_name: format!("NP:{namespace}:isolation:{direction}"),
                namespace,
                rule: None,
                admin: None,
            },
        });
    }
    let namespace = state.namespace_of(event.set)?;
    Some(Described {
        acl_name: format!("EF:{namespace}:default"),
        namespace: namespace.to_owned(),
        rule: None,
        admin: None,
    })
}

impl FirewallAgent {
    /// Whether a namespace or an admin policy asks for audit records.
    pub(super) fn wants_audit(&self) -> bool {
        !self.levels.is_empty() || self.admin.all().any(|p| p.log.is_some())
    }

    /// Writes what the installed policy sets' rules stand for, for `inspect` and `trace`,
    /// when it changed since it was last written.
    pub(super) fn describe_sets(&mut self) {
        let version = self.state.meta_version();
        if self.described == Some(version) {
            return;
        }
        let changed = self.state.take_described_changes();
        let written = match self.described {
            Some(_) => {
                super::super::explain::set_rules_since(
                    &self.state,
                    &mut self.descriptions,
                    &changed,
                );
                Some(&changed)
            }
            None => {
                self.descriptions = super::super::explain::set_rules(&self.state);
                None
            }
        };
        self.described = Some(version);
        if let Err(error) =
            super::super::explain::write(&self.rules_dir, &self.descriptions, written)
        {
            tracing::warn!(path = %self.rules_dir.display(), %error, "writing the policy rule names");
            // Written whole at the next change, whichever sets it changes.
            self.described = None;
        }
    }

    /// Sets the kernel's per-CPU rate and, when a namespace logs, opens the log file and the
    /// ring buffer. An invalid `policyAuditConfig` is reported and the defaults are used.
    pub(super) fn open_audit(
        &mut self,
        dataplane: &mut Dataplane,
        config: &PolicyAuditConfig,
        path: &std::path::Path,
    ) -> Result<(), AgentError> {
        let settings = config.validate().unwrap_or_else(|error| {
            tracing::warn!(%error, "policyAuditConfig invalid; using the defaults");
            PolicyAuditConfig::default()
                .validate()
                .expect("the defaults are valid")
        });
        dataplane.set_audit_rate(settings.rate_limit)?;
        if !self.wants_audit() {
            return Ok(());
        }
        match AuditLog::open(settings, path) {
            Ok(log) => self.audit = Some(log),
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "audit log not writable; no audit records");
                return Ok(());
            }
        }
        self.events = open_ring(dataplane, maps::ACL_EVENTS)?;
        tracing::info!(path = %path.display(), "audit log open");
        Ok(())
    }

    /// Writes every record waiting in the ring buffer.
    pub(super) fn drain_events(&mut self) {
        let (Some(fd), Some(log)) = (self.events.as_mut(), self.audit.as_mut()) else {
            return;
        };
        let ring = fd.get_mut();
        while let Some(item) = ring.next() {
            if item.len() < std::mem::size_of::<AclEvent>() {
                continue;
            }
            // SAFETY: the kernel wrote an AclEvent (plain data) of at least this size.
            let event: AclEvent = unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
            drop(item);
            let Some(described) = describe(&self.state, &event) else {
                continue;
            };
            let levels = match &described.admin {
                Some((kind, name)) => admin_logging(&self.admin, *kind, name),
                None => self.levels.get(&described.namespace).copied(),
            };
            let Some(levels) = levels else {
                continue;
            };
            let severity = if event.verdict == ACL_VERDICT_DENY {
                levels.deny
            } else {
                levels.allow
            };
            let Some(severity) = severity else { continue };
            let source = RecordSource {
                namespace: described.namespace,
                acl_name: described.acl_name,
                severity,
                rule: described.rule,
            };
            if let Err(error) = log.record(&event, &source) {
                tracing::warn!(%error, "writing the audit log");
            }
        }
    }
}
