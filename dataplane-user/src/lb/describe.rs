//! What `dataplane inspect services` shows beside the maps: which Service a port is, how
//! topology narrowed its endpoints, and the health-check node port its Service is answered
//! on. The maps hold none of it (the kernel needs none), so the agent writes it to its run
//! directory. Only the Services that have either are described: a description of every port
//! would cost each sync a walk of every Service.

use std::collections::BTreeMap;

use dataplane_common::lb::{
    SCOPE_CLUSTER, SCOPE_EXTERNAL, SCOPE_NODEPORT, SCOPE_NODEPORT_FROM_POD, ServiceKey,
};
use serde::{Deserialize, Serialize};

use crate::mapsync::ip_of;

/// The file in the agent's run directory.
pub const STATE_FILE: &str = "services.json";

/// The described service ports and health checks.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Described {
    /// This node's zone (`topology.kubernetes.io/zone`), as the compile took it.
    pub zone: Option<String>,
    /// By [`described_key`]: the ports of Services with topology-narrowed endpoints or a
    /// health check.
    pub ports: BTreeMap<String, DescribedPort>,
    /// The health-check node ports this node answers.
    pub health_checks: Vec<DescribedHealthCheck>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DescribedPort {
    /// `namespace/name:port`, as the logs name it.
    pub name: String,
    /// How topology narrowed its ready endpoints (`zone zone-a`, `node`), if it did.
    pub topology: Option<String>,
    /// Its Service's health-check node port and answer (`32000: 200, 2 local endpoints`).
    pub health_check: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DescribedHealthCheck {
    pub port: u16,
    /// `namespace/name`.
    pub service: String,
    pub local_endpoints: usize,
}

impl DescribedHealthCheck {
    /// The answer as `inspect` shows it: the status load balancers read, and why.
    pub fn answer(&self) -> String {
        if self.local_endpoints > 0 {
            format!(
                "{}: 200, {} local endpoint(s)",
                self.port, self.local_endpoints
            )
        } else {
            format!("{}: 503, no local endpoint", self.port)
        }
    }
}

/// A service key as the description and `inspect` match it: address, port, protocol number
/// and scope name (`10.96.0.10:80/6/cluster`).
pub fn described_key(key: &ServiceKey) -> String {
    let scope = match key.scope {
        SCOPE_CLUSTER => "cluster",
        SCOPE_NODEPORT => "nodeport",
        SCOPE_NODEPORT_FROM_POD => "nodeport-from-pods",
        SCOPE_EXTERNAL => "external",
        _ => "other",
    };
    let port = u16::from_be_bytes(key.port_be);
    match ip_of(&key.addr) {
        std::net::IpAddr::V4(ip) => format!("{ip}:{port}/{}/{scope}", key.protocol),
        std::net::IpAddr::V6(ip) => format!("[{ip}]:{port}/{}/{scope}", key.protocol),
    }
}

/// What the agent last wrote in `run_dir` (empty when nothing is there or it is unreadable).
pub fn read_described(run_dir: &std::path::Path) -> Described {
    std::fs::read_to_string(run_dir.join(STATE_FILE))
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapsync::addr16;

    #[test]
    fn keys_are_described_by_address_port_protocol_and_scope() {
        let key = |ip: &str, port: u16, scope| ServiceKey {
            addr: addr16(ip.parse().unwrap()),
            port_be: port.to_be_bytes(),
            protocol: 6,
            scope,
        };
        assert_eq!(
            described_key(&key("10.96.0.10", 80, SCOPE_CLUSTER)),
            "10.96.0.10:80/6/cluster"
        );
        assert_eq!(
            described_key(&key("0.0.0.0", 30080, SCOPE_NODEPORT_FROM_POD)),
            "0.0.0.0:30080/6/nodeport-from-pods"
        );
        assert_eq!(
            described_key(&key("fd00::1", 443, SCOPE_EXTERNAL)),
            "[fd00::1]:443/6/external"
        );
        let check = DescribedHealthCheck {
            port: 32000,
            service: "shop/web".into(),
            local_endpoints: 0,
        };
        assert_eq!(check.answer(), "32000: 503, no local endpoint");
    }
}
