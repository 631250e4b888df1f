//! Which node-network addresses egress router pods may claim, and in which namespaces. A
//! NetworkAttachmentDefinition is written by whoever may edit its namespace, and the
//! `egress-router` plugin would otherwise give a router pod any address it names: the
//! node's own, a gateway's, another tenant's reserved one. So the plugin claims an address
//! only where it is reserved: by an `EgressRouter` of the pod's namespace (an object cluster
//! administrators grant), or by the agent's `--egress-router-reservation` (for routers
//! written as attachments by hand). Each node's agent writes the reservations it knows into
//! its run directory after every sync; the plugin reads them there (or where the runtime's
//! environment says: never where the attachment says). Without the file (no agent on the
//! node yet) the plugin asks the runtime to try again later.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    str::FromStr,
};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::source::ClusterState;

/// The file's name in the agent's run directory.
pub const FILE_NAME: &str = "egress-router-reservations.json";
/// Where the plugin reads it unless [`PATH_ENV`] says otherwise (the agent's default run
/// directory).
pub const DEFAULT_PATH: &str = "/run/dataplane/egress-router-reservations.json";
/// The runtime's environment variable naming another file.
pub const PATH_ENV: &str = "DATAPLANE_EGRESS_ROUTER_RESERVATIONS";

/// Addresses a router pod may claim: inside `network`, for pods of `namespace` (any
/// namespace when `None`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Reservation {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    pub network: IpNet,
}

impl FromStr for Reservation {
    type Err = String;

    /// `NAMESPACE=CIDR`, or a lone `CIDR` for every namespace (a lone address is its /32 or
    /// /128).
    fn from_str(text: &str) -> Result<Self, String> {
        let (namespace, network) = match text.split_once('=') {
            Some((namespace, network)) if !namespace.is_empty() => {
                (Some(namespace.to_owned()), network)
            }
            Some(_) => return Err(format!("{text:?}: the namespace before '=' is empty")),
            None => (None, text),
        };
        let network = network
            .parse::<IpNet>()
            .or_else(|_| network.parse::<IpAddr>().map(IpNet::from))
            .map_err(|_| format!("{text:?}: {network:?} is not an address or a CIDR"))?;
        Ok(Reservation { namespace, network })
    }
}

/// The file's contents.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservations {
    pub reservations: Vec<Reservation>,
}

impl Reservations {
    /// What `state`'s EgressRouters reserve (each its one address, in its namespace; an
    /// address two ask for, the older's) and what the agent's flags add; sorted, no repeats.
    pub fn of(state: &ClusterState, flags: &[Reservation]) -> Reservations {
        let holders = super::resource::address_holders(state.egress_routers.iter());
        let mut reservations: Vec<Reservation> = holders
            .into_iter()
            .map(|(address, (namespace, _))| Reservation {
                namespace: Some(namespace),
                network: IpNet::from(address),
            })
            .chain(flags.iter().cloned())
            .collect();
        reservations.sort();
        reservations.dedup();
        Reservations { reservations }
    }

    /// Whether a pod of `namespace` (`None`: the runtime named none) may claim `address`.
    pub fn allow(&self, namespace: Option<&str>, address: IpAddr) -> bool {
        self.reservations.iter().any(|r| {
            r.network.contains(&address)
                && r.namespace
                    .as_deref()
                    .is_none_or(|reserved| Some(reserved) == namespace)
        })
    }

    /// Writes them into `dir` (aside and renamed: the plugin never reads half a file).
    pub fn write(&self, dir: &Path) -> std::io::Result<PathBuf> {
        let path = dir.join(FILE_NAME);
        let text = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        crate::kernel::state::write_replacing(&path, &text, true, 0o644)?;
        Ok(path)
    }

    /// Reads the file at `path`.
    pub fn read(path: &Path) -> Result<Reservations, String> {
        let text = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{api::egressrouter::EgressRouter, source::Objects};

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn flags_name_a_namespace_or_reserve_for_all() {
        assert_eq!(
            "egress=192.168.12.0/28".parse(),
            Ok(Reservation {
                namespace: Some("egress".into()),
                network: "192.168.12.0/28".parse().unwrap()
            })
        );
        assert_eq!(
            "2001:db8::99".parse(),
            Ok(Reservation {
                namespace: None,
                network: "2001:db8::99/128".parse().unwrap()
            })
        );
        assert_eq!(
            "=10.0.0.1".parse::<Reservation>(),
            Err("\"=10.0.0.1\": the namespace before '=' is empty".to_owned())
        );
        assert_eq!(
            "a=b".parse::<Reservation>(),
            Err("\"a=b\": \"b\" is not an address or a CIDR".to_owned())
        );
    }

    #[test]
    fn an_egress_router_reserves_its_address_in_its_namespace_only() {
        let router = |namespace: &str, created: &str| -> Arc<EgressRouter> {
            Arc::new(
                serde_yaml::from_str(&format!(
                    "metadata: {{name: r, namespace: {namespace}, creationTimestamp: '{created}'}}\n\
                     spec: {{addresses: [{{ip: 192.168.12.99/24, gateway: 192.168.12.1}}], \
                     redirect: {{fallbackIP: 203.0.113.1}}}}"
                ))
                .unwrap(),
            )
        };
        // A younger router of another namespace asking for the same address gets nothing; an
        // invalid one (no gateway) reserves nothing, older or not.
        let invalid: Arc<EgressRouter> = Arc::new(
            serde_yaml::from_str(
                "metadata: {name: r, namespace: broken, creationTimestamp: '2026-11-01T00:00:00Z'}\n\
                 spec: {addresses: [{ip: 192.168.13.5/24}], redirect: {fallbackIP: 203.0.113.1}}",
            )
            .unwrap(),
        );
        let state = ClusterState {
            egress_routers: Objects::from(vec![
                router("thief", "2026-12-02T00:00:00Z"),
                router("egress", "2026-12-01T00:00:00Z"),
                invalid,
            ]),
            ..ClusterState::default()
        };
        let flags = [
            "10.1.0.0/30".parse().unwrap(),
            "ops=10.2.0.5".parse().unwrap(),
        ];
        let reservations = Reservations::of(&state, &flags);
        // The router's address alone (not its network), in its namespace.
        assert!(reservations.allow(Some("egress"), ip("192.168.12.99")));
        assert!(!reservations.allow(Some("egress"), ip("192.168.12.98")));
        assert!(!reservations.allow(Some("tenant"), ip("192.168.12.99")));
        assert!(!reservations.allow(Some("thief"), ip("192.168.12.99")));
        assert!(!reservations.allow(None, ip("192.168.12.99")));
        assert!(!reservations.allow(Some("broken"), ip("192.168.13.5")));
        // A flag for every namespace, and one for a namespace.
        assert!(reservations.allow(None, ip("10.1.0.2")));
        assert!(reservations.allow(Some("tenant"), ip("10.1.0.2")));
        assert!(reservations.allow(Some("ops"), ip("10.2.0.5")));
        assert!(!reservations.allow(Some("tenant"), ip("10.2.0.5")));
        // Written and read back as the plugin reads it.
        let dir =
            std::env::temp_dir().join(format!("dataplane-reservations-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = reservations.write(&dir).expect("written");
        assert_eq!(Reservations::read(&path), Ok(reservations));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
