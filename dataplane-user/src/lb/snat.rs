//! The masquerade source ports the kernel takes for NodePort flows, kept out of the node's own
//! ephemeral range (`ip_local_reserved_ports`).

use dataplane_common::lb::{SNAT_LOW_PORT_MAX, SNAT_LOW_PORT_MIN, SNAT_PORT_MAX, SNAT_PORT_MIN};

use crate::error::AgentError;

/// The node's list of ports its own sockets never get as ephemeral ports.
const RESERVED_PORTS: &str = "net/ipv4/ip_local_reserved_ports";

/// Reserves the masquerade source ports (`SNAT_PORT_MIN..=SNAT_PORT_MAX` and
/// `SNAT_LOW_PORT_MIN..=SNAT_LOW_PORT_MAX`) on this node, so no local connection to a backend
/// ever shares its ports with a masqueraded flow (its replies would be taken for that flow's),
/// whatever ephemeral range the node is given. Ports reserved by others stay reserved.
pub fn reserve_snat_ports() -> Result<(), AgentError> {
    let path = crate::kernel::sysctl::path(RESERVED_PORTS);
    let io = |action| {
        let path = path.clone();
        move |source| AgentError::Io {
            action,
            path,
            source,
        }
    };
    let current = std::fs::read_to_string(&path).map_err(io("reading"))?;
    if let Some(updated) = with_snat_ports(&current) {
        std::fs::write(&path, &updated).map_err(io("writing"))?;
        tracing::info!(reserved = %updated, "masquerade source ports reserved on this node");
    }
    Ok(())
}

/// The reserved-ports list (`22,1000-2000`) with each masquerade range it does not cover
/// whole added, or `None` when it covers them all.
pub(super) fn with_snat_ports(current: &str) -> Option<String> {
    let ranges: Vec<(u16, u16)> = current
        .trim()
        .split(',')
        .filter_map(|item| {
            let (low, high) = item.split_once('-').unwrap_or((item, item));
            Some((low.trim().parse().ok()?, high.trim().parse().ok()?))
        })
        .collect();
    let covered = |port: u16| {
        ranges
            .iter()
            .any(|&(low, high)| (low..=high).contains(&port))
    };
    let missing: Vec<String> = [
        (SNAT_LOW_PORT_MIN, SNAT_LOW_PORT_MAX),
        (SNAT_PORT_MIN, SNAT_PORT_MAX),
    ]
    .into_iter()
    .filter(|&(low, high)| !(low..=high).all(covered))
    .map(|(low, high)| format!("{low}-{high}"))
    .collect();
    if missing.is_empty() {
        return None;
    }
    let existing = current.trim();
    Some(
        std::iter::once(existing)
            .filter(|e| !e.is_empty())
            .chain(missing.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(","),
    )
}
