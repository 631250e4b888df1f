//! The CNI specification's side of the plugin: the configuration on stdin, the environment,
//! the result and error shapes on stdout, by specification version.

use std::{collections::BTreeMap, path::PathBuf};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{GATEWAY_V4, GATEWAY_V6, ipam::PodRef};

/// A pod's wiring, as ADD made it: what the CNI result reports (the agent sends it to the
/// plugin in its reply).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    pub host_iface: String,
    pub host_mac: String,
    pub ifname: String,
    pub pod_mac: String,
    pub netns: String,
    pub addresses: Vec<IpNet>,
    pub mtu: u32,
}

/// The configuration versions this plugin reads and answers in.
pub const SUPPORTED_VERSIONS: [&str; 3] = ["0.4.0", "1.0.0", "1.1.0"];
/// The version VERSION answers in, and errors in when the configuration names none.
pub const LATEST_VERSION: &str = "1.1.0";

/// The specification's well-known error codes (1-99), and this plugin's own (100 and up).
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const UNSUPPORTED_FIELD: u32 = 2;
    pub const UNKNOWN_CONTAINER: u32 = 3;
    pub const INVALID_ENVIRONMENT: u32 = 4;
    pub const IO_FAILURE: u32 = 5;
    pub const DECODE_FAILURE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// STATUS: the plugin cannot serve ADD.
    pub const NOT_AVAILABLE: u32 = 50;
    /// The node's pod CIDR has no free address.
    pub const POOL_EXHAUSTED: u32 = 100;
    /// The pod's interface, addresses or routes could not be made.
    pub const WIRING_FAILED: u32 = 101;
    /// The pod's overlay entry or policy could not be installed: no unpoliced pod.
    pub const NOT_INSTALLED: u32 = 102;
    /// CHECK found the pod's wiring not as ADD left it.
    pub const CHECK_FAILED: u32 = 103;
    /// egress-router: the address is not reserved for the pod's namespace.
    pub const NOT_RESERVED: u32 = 104;
    /// The pod's namespace takes a primary user-defined network this dataplane does not
    /// give it (none selects it, or it is not carried yet): no default-network interface.
    pub const NO_PRIMARY_NETWORK: u32 = 105;
}

/// An error as the specification shapes it: printed as JSON on stdout, with a non-zero exit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("CNI error {code}: {msg}{}", if details.is_empty() { String::new() } else { format!(" ({details})") })]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub details: String,
}

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    /// The error object of the specification, in `version`.
    pub fn to_json(&self, version: &str) -> Value {
        let mut value = json!({"cniVersion": version, "code": self.code, "msg": self.msg});
        if !self.details.is_empty() {
            value["details"] = Value::String(self.details.clone());
        }
        value
    }
}

/// `CNI_COMMAND`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Status,
    Version,
    Gc,
}

impl Command {
    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "ADD" => Self::Add,
            "DEL" => Self::Del,
            "CHECK" => Self::Check,
            "STATUS" => Self::Status,
            "VERSION" => Self::Version,
            "GC" => Self::Gc,
            _ => return None,
        })
    }

    /// The first configuration version that has the command.
    fn since(self) -> &'static str {
        match self {
            Self::Status | Self::Gc => "1.1.0",
            _ => "0.4.0",
        }
    }
}

/// One attachment the runtime still has (GC's `cni.dev/valid-attachments`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ValidAttachment {
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
}

/// The plugin's configuration, as the runtime passes it on stdin.
#[derive(Clone, Debug, Deserialize)]
pub struct NetConf {
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    #[serde(default)]
    pub name: String,
    #[serde(rename = "type", default)]
    pub plugin_type: String,
    /// The agent's socket (default [`super::DEFAULT_SOCKET`]).
    #[serde(rename = "agentSocket", default)]
    pub agent_socket: Option<PathBuf>,
    /// How long ADD waits for the agent, in seconds (default 60).
    #[serde(rename = "agentTimeoutSeconds", default)]
    pub agent_timeout_seconds: Option<u64>,
    #[serde(rename = "prevResult", default)]
    pub prev_result: Option<Value>,
    #[serde(rename = "cni.dev/valid-attachments", default)]
    pub valid_attachments: Option<Vec<ValidAttachment>>,
    /// This plugin takes no IPAM plugin: the agent allocates from the node's pod CIDRs.
    #[serde(default)]
    pub ipam: Option<Value>,
}

impl NetConf {
    /// Parses stdin and checks what the plugin can serve.
    pub fn parse(stdin: &[u8], command: Command) -> Result<Self, CniError> {
        let conf: NetConf = serde_json::from_slice(stdin).map_err(|e| {
            CniError::new(
                code::DECODE_FAILURE,
                format!("the network configuration on stdin is not valid JSON of a plugin configuration: {e}"),
            )
        })?;
        if !SUPPORTED_VERSIONS.contains(&conf.cni_version.as_str()) {
            return Err(CniError::new(
                code::INCOMPATIBLE_VERSION,
                format!(
                    "cniVersion {:?} is not supported; use one of {}",
                    conf.cni_version,
                    SUPPORTED_VERSIONS.join(", ")
                ),
            ));
        }
        if version_order(&conf.cni_version) < version_order(command.since()) {
            return Err(CniError::new(
                code::INCOMPATIBLE_VERSION,
                format!(
                    "{command:?} needs cniVersion {} or later; the configuration says {}",
                    command.since(),
                    conf.cni_version
                ),
            ));
        }
        if let Some(ipam) = conf.ipam.as_ref().filter(|v| !v.is_null()) {
            return Err(CniError::new(
                code::UNSUPPORTED_FIELD,
                format!(
                    "ipam = {ipam}: the dataplane agent allocates pod addresses from the node's spec.podCIDRs; remove the ipam section"
                ),
            ));
        }
        Ok(conf)
    }
}

/// `0.4.0` < `1.0.0` < `1.1.0`.
fn version_order(version: &str) -> usize {
    SUPPORTED_VERSIONS
        .iter()
        .position(|v| *v == version)
        .unwrap_or(0)
}

/// The pod a container belongs to, from `CNI_ARGS` (`K8S_POD_NAMESPACE`, `K8S_POD_NAME`,
/// `K8S_POD_UID`; other keys ignored). A runtime that names no namespace (podman names only
/// the container) puts the pod in `default`; no name at all is no pod.
pub fn pod_from_args(args: &str) -> Result<Option<PodRef>, CniError> {
    let mut pairs = BTreeMap::new();
    for pair in args.split(';').filter(|p| !p.is_empty()) {
        let Some((key, value)) = pair.split_once('=') else {
            return Err(CniError::new(
                code::INVALID_ENVIRONMENT,
                format!("CNI_ARGS: {pair:?} is not KEY=VALUE (pairs are separated by ';')"),
            ));
        };
        pairs.insert(key, value);
    }
    let Some(name) = pairs.get("K8S_POD_NAME").filter(|n| !n.is_empty()) else {
        return Ok(None);
    };
    Ok(Some(PodRef {
        namespace: pairs
            .get("K8S_POD_NAMESPACE")
            .filter(|n| !n.is_empty())
            .map_or("default", |n| n)
            .to_owned(),
        name: (*name).to_owned(),
        uid: pairs.get("K8S_POD_UID").copied().unwrap_or("").to_owned(),
    }))
}

/// The ADD (and CHECK) result of `attachment`, shaped for `version`: the host-side veth,
/// the pod's interface (in its sandbox), one entry per address on the pod's interface, the
/// default routes through the gateways every host-side veth holds.
pub fn result(version: &str, attachment: &Attachment) -> Value {
    let mut pod_interface = json!({
        "name": attachment.ifname,
        "mac": attachment.pod_mac,
        "sandbox": attachment.netns,
    });
    if version == "1.1.0" {
        pod_interface["mtu"] = json!(attachment.mtu);
    }
    let ips: Vec<Value> = attachment
        .addresses
        .iter()
        .map(|address| {
            let v4 = address.addr().is_ipv4();
            let gateway = if v4 {
                GATEWAY_V4.to_string()
            } else {
                GATEWAY_V6.to_string()
            };
            let mut ip =
                json!({"address": address.to_string(), "gateway": gateway, "interface": 1});
            if version == "0.4.0" {
                ip["version"] = json!(if v4 { "4" } else { "6" });
            }
            ip
        })
        .collect();
    let routes: Vec<Value> = attachment
        .addresses
        .iter()
        .map(|address| match address {
            IpNet::V4(_) => json!({"dst": "0.0.0.0/0", "gw": GATEWAY_V4.to_string()}),
            IpNet::V6(_) => json!({"dst": "::/0", "gw": GATEWAY_V6.to_string()}),
        })
        .collect();
    json!({
        "cniVersion": version,
        "interfaces": [
            {"name": attachment.host_iface, "mac": attachment.host_mac},
            pod_interface,
        ],
        "ips": ips,
        "routes": routes,
        "dns": {},
    })
}

/// The addresses a previous result (`prevResult`) gave the pod's interface.
pub fn previous_addresses(prev: &Value) -> Result<Vec<IpNet>, CniError> {
    let bad = |what: &str| CniError::new(code::DECODE_FAILURE, format!("prevResult: {what}"));
    let Some(ips) = prev.get("ips") else {
        return Ok(Vec::new());
    };
    let ips = ips.as_array().ok_or_else(|| bad("ips is not a list"))?;
    ips.iter()
        .map(|ip| {
            ip.get("address")
                .and_then(Value::as_str)
                .and_then(|a| a.parse::<IpNet>().ok())
                .ok_or_else(|| bad(&format!("{ip} has no address in CIDR notation")))
        })
        .collect()
}

/// VERSION's answer.
pub fn version_info() -> Value {
    json!({"cniVersion": LATEST_VERSION, "supportedVersions": SUPPORTED_VERSIONS})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attachment() -> Attachment {
        Attachment {
            host_iface: "dp0123456789abc".into(),
            host_mac: "aa:bb:cc:dd:ee:ff".into(),
            ifname: "eth0".into(),
            pod_mac: "0a:58:0a:f4:01:03".into(),
            netns: "/run/netns/pod".into(),
            addresses: vec![
                "10.244.1.3/32".parse().unwrap(),
                "fd00:10:244:1::3/128".parse().unwrap(),
            ],
            mtu: 1400,
        }
    }

    #[test]
    fn results_take_the_shape_of_their_version() {
        let old = result("0.4.0", &attachment());
        assert_eq!(old["ips"][0]["version"], "4");
        assert_eq!(old["ips"][1]["version"], "6");
        assert!(old["interfaces"][1].get("mtu").is_none());
        let new = result("1.1.0", &attachment());
        assert!(new["ips"][0].get("version").is_none());
        assert_eq!(new["ips"][0]["address"], "10.244.1.3/32");
        assert_eq!(new["ips"][0]["gateway"], "169.254.1.1");
        assert_eq!(new["ips"][1]["gateway"], "fe80::1");
        assert_eq!(new["ips"][1]["interface"], 1);
        assert_eq!(new["interfaces"][1]["sandbox"], "/run/netns/pod");
        assert_eq!(new["interfaces"][1]["mtu"], 1400);
        assert_eq!(
            new["routes"][0],
            json!({"dst": "0.0.0.0/0", "gw": "169.254.1.1"})
        );
        assert_eq!(new["routes"][1], json!({"dst": "::/0", "gw": "fe80::1"}));
        assert_eq!(previous_addresses(&new).unwrap(), attachment().addresses);
    }

    #[test]
    fn configurations_are_checked_for_version_and_fields() {
        let conf = |text: &str, command| NetConf::parse(text.as_bytes(), command);
        let ok = conf(
            r#"{"cniVersion":"1.0.0","name":"n","type":"dataplane-cni"}"#,
            Command::Add,
        );
        assert!(ok.is_ok());
        let old = conf(r#"{"cniVersion":"0.3.1","name":"n"}"#, Command::Add).unwrap_err();
        assert_eq!(old.code, code::INCOMPATIBLE_VERSION);
        let status = conf(r#"{"cniVersion":"1.0.0","name":"n"}"#, Command::Status).unwrap_err();
        assert_eq!(status.code, code::INCOMPATIBLE_VERSION);
        let garbage = conf("{not json", Command::Add).unwrap_err();
        assert_eq!(garbage.code, code::DECODE_FAILURE);
        let ipam = conf(
            r#"{"cniVersion":"1.1.0","name":"n","ipam":{"type":"host-local"}}"#,
            Command::Add,
        )
        .unwrap_err();
        assert_eq!(ipam.code, code::UNSUPPORTED_FIELD);
        assert!(ipam.msg.contains("host-local"), "{}", ipam.msg);
    }

    #[test]
    fn pods_come_from_cni_args() {
        let pod =
            pod_from_args("IgnoreUnknown=1;K8S_POD_NAMESPACE=web;K8S_POD_NAME=a;K8S_POD_UID=u1")
                .unwrap()
                .unwrap();
        assert_eq!(
            (pod.namespace.as_str(), pod.name.as_str(), pod.uid.as_str()),
            ("web", "a", "u1")
        );
        let podman = pod_from_args("IgnoreUnknown=1;K8S_POD_NAME=box")
            .unwrap()
            .unwrap();
        assert_eq!(podman.namespace, "default");
        assert_eq!(pod_from_args("").unwrap(), None);
        let bad = pod_from_args("K8S_POD_NAME").unwrap_err();
        assert_eq!(bad.code, code::INVALID_ENVIRONMENT);
    }
}
