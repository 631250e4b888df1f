//! The egress router plugin's network configuration, as OpenShift's egress router CNI plugin
//! takes it (`type: egress-router` in a NetworkAttachmentDefinition), validated with the field
//! named in every refusal.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::Deserialize;

use crate::cni::{names::check_ifname, spec::SUPPORTED_VERSIONS};

/// What the runtime passes on stdin; unknown fields (runtime configuration, Multus' own) are
/// left alone.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawConf {
    cni_version: Option<String>,
    interface_type: Option<String>,
    #[serde(default)]
    interface_args: RawInterfaceArgs,
    mtu: Option<u64>,
    ip: Option<RawIp>,
}

#[derive(Debug, Default, Deserialize)]
struct RawInterfaceArgs {
    master: Option<String>,
    mode: Option<String>,
}

#[derive(Debug, Deserialize)]
struct RawIp {
    #[serde(default)]
    addresses: Vec<String>,
    #[serde(default)]
    destinations: Vec<String>,
    gateway: Option<String>,
}

/// A validated egress router configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouterConf {
    pub cni_version: String,
    /// The node interface the macvlan sits on (`None`: the one of the node's default route).
    pub master: Option<String>,
    pub mode: MacvlanMode,
    pub mtu: Option<u32>,
    /// The reserved address, with the prefix of the node network it is on.
    pub address: IpNet,
    pub gateway: IpAddr,
    /// Per-port redirects, in the order given.
    pub rules: Vec<Redirect>,
    /// Where every other port and protocol goes (`None`: they are refused).
    pub fallback: Option<IpAddr>,
}

/// One `<port> <protocol> <address> [<remote port>]` destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Redirect {
    pub port: u16,
    pub protocol: Protocol,
    pub destination: IpAddr,
    /// The destination's port (the same as `port` when not given).
    pub target_port: u16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// The name nftables (and the configuration) uses.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
}

/// The macvlan modes the plugin accepts (`interfaceArgs.mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MacvlanMode {
    #[default]
    Bridge,
    Private,
    Vepa,
    Passthru,
}

impl MacvlanMode {
    /// The name iproute2 takes.
    pub fn name(self) -> &'static str {
        match self {
            MacvlanMode::Bridge => "bridge",
            MacvlanMode::Private => "private",
            MacvlanMode::Vepa => "vepa",
            MacvlanMode::Passthru => "passthru",
        }
    }
}

/// Parses and validates `stdin`; the error names the field.
pub fn parse(stdin: &[u8]) -> Result<RouterConf, String> {
    let raw: RawConf = serde_json::from_slice(stdin).map_err(|e| {
        format!("the network configuration is not valid JSON for egress-router: {e}")
    })?;
    let cni_version = raw.cni_version.unwrap_or_default();
    if !SUPPORTED_VERSIONS.contains(&cni_version.as_str()) {
        return Err(format!(
            "cniVersion: {cni_version:?} is not one of {}",
            SUPPORTED_VERSIONS.join(", ")
        ));
    }
    match raw.interface_type.as_deref() {
        None | Some("macvlan") => {}
        Some(other) => {
            return Err(format!(
                "interfaceType: {other:?} is not supported (macvlan only)"
            ));
        }
    }
    if let Some(master) = &raw.interface_args.master {
        check_ifname(master).map_err(|why| format!("interfaceArgs.master: {why}"))?;
    }
    let mode = match raw
        .interface_args
        .mode
        .as_deref()
        .map(str::to_ascii_lowercase)
    {
        None => MacvlanMode::default(),
        Some(mode) => match mode.as_str() {
            "bridge" => MacvlanMode::Bridge,
            "private" => MacvlanMode::Private,
            "vepa" => MacvlanMode::Vepa,
            "passthru" => MacvlanMode::Passthru,
            _ => {
                return Err(format!(
                    "interfaceArgs.mode: {mode:?} is not one of bridge, private, vepa, passthru"
                ));
            }
        },
    };
    let ip = raw
        .ip
        .ok_or("ip: missing (addresses, destinations, gateway)")?;
    let [address] = ip.addresses.as_slice() else {
        return Err(format!(
            "ip.addresses: one reserved address with its prefix is needed (e.g. 192.168.12.99/24), not {}",
            ip.addresses.len()
        ));
    };
    let address: IpNet = address.parse().map_err(|_| {
        format!(
            "ip.addresses[0]: {address:?} is not an address with its prefix (e.g. 192.168.12.99/24)"
        )
    })?;
    let mtu = match raw.mtu {
        None => None,
        Some(mtu) => {
            let least = if address.addr().is_ipv6() { 1280 } else { 68 };
            if !(least..=65535).contains(&mtu) {
                return Err(format!("mtu: {mtu} is not between {least} and 65535"));
            }
            Some(mtu as u32)
        }
    };
    let gateway_text = ip.gateway.ok_or("ip.gateway: missing")?;
    let gateway: IpAddr = gateway_text
        .parse()
        .map_err(|_| format!("ip.gateway: {gateway_text:?} is not an address"))?;
    if !address.trunc().contains(&gateway) || gateway == address.addr() {
        return Err(format!(
            "ip.gateway: {gateway} is not another address of {}, the reserved address's network",
            address.trunc()
        ));
    }
    let (rules, fallback) = destinations(&ip.destinations, address.addr())?;
    Ok(RouterConf {
        cni_version,
        master: raw.interface_args.master,
        mode,
        mtu,
        address,
        gateway,
        rules,
        fallback,
    })
}

/// `ip.destinations`: per-port redirects and at most one fallback address, all of the
/// reserved address's family, no port and protocol twice.
fn destinations(
    lines: &[String],
    reserved: IpAddr,
) -> Result<(Vec<Redirect>, Option<IpAddr>), String> {
    if lines.is_empty() {
        return Err(
            "ip.destinations: none given (an address for every port, or <port> <tcp|udp|sctp> <address> [<remote port>])"
                .to_owned(),
        );
    }
    let mut rules: Vec<Redirect> = Vec::new();
    let mut fallback: Option<(usize, IpAddr)> = None;
    for (index, line) in lines.iter().enumerate() {
        let field = format!("ip.destinations[{index}]");
        let address = |text: &str| -> Result<IpAddr, String> {
            let address: IpAddr = text
                .parse()
                .map_err(|_| format!("{field}: {text:?} is not an address"))?;
            if address.is_ipv4() != reserved.is_ipv4() {
                return Err(format!(
                    "{field}: {address} is not of the reserved address {reserved}'s family"
                ));
            }
            Ok(address)
        };
        let port = |text: &str| -> Result<u16, String> {
            text.parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| format!("{field}: {text:?} is not a port (1-65535)"))
        };
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            [only] => {
                if let Some((first, _)) = fallback {
                    return Err(format!(
                        "{field}: a second fallback address (ip.destinations[{first}] is one)"
                    ));
                }
                fallback = Some((index, address(only)?));
            }
            [port_text, protocol, destination, rest @ ..] if rest.len() <= 1 => {
                let protocol = match protocol.to_ascii_lowercase().as_str() {
                    "tcp" => Protocol::Tcp,
                    "udp" => Protocol::Udp,
                    "sctp" => Protocol::Sctp,
                    other => {
                        return Err(format!("{field}: {other:?} is not tcp, udp or sctp"));
                    }
                };
                let rule = Redirect {
                    port: port(port_text)?,
                    protocol,
                    destination: address(destination)?,
                    target_port: match rest.first() {
                        Some(remote) => port(remote)?,
                        None => port(port_text)?,
                    },
                };
                if let Some(twice) = rules
                    .iter()
                    .position(|r| (r.port, r.protocol) == (rule.port, rule.protocol))
                {
                    return Err(format!(
                        "{field}: {} port {} is redirected already by ip.destinations[{twice}]",
                        rule.protocol.name(),
                        rule.port
                    ));
                }
                rules.push(rule);
            }
            _ => {
                return Err(format!(
                    "{field}: {line:?} is neither <address> nor <port> <tcp|udp|sctp> <address> [<remote port>]"
                ));
            }
        }
    }
    Ok((rules, fallback.map(|(_, address)| address)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(ip: &str, extra: &str) -> Result<RouterConf, String> {
        parse(
            format!(
                r#"{{"cniVersion": "0.4.0", "name": "egress-router", "type": "egress-router"{extra}, "ip": {ip}}}"#
            )
            .as_bytes(),
        )
    }

    #[test]
    fn the_seeds_redirect_configuration_is_taken_whole() {
        let parsed = conf(
            r#"{"addresses": ["192.168.12.99/24"], "destinations": ["80 tcp 203.0.113.25", "8080 tcp 203.0.113.26 80", "8443 UDP 203.0.113.26 443", "203.0.113.27"], "gateway": "192.168.12.1"}"#,
            r#", "interfaceType": "macvlan", "interfaceArgs": {"master": "eth1", "mode": "Private"}, "mtu": 1450"#,
        )
        .expect("valid");
        let ip = |t: &str| t.parse::<IpAddr>().unwrap();
        assert_eq!(
            parsed,
            RouterConf {
                cni_version: "0.4.0".into(),
                master: Some("eth1".into()),
                mode: MacvlanMode::Private,
                mtu: Some(1450),
                address: "192.168.12.99/24".parse().unwrap(),
                gateway: ip("192.168.12.1"),
                rules: vec![
                    Redirect {
                        port: 80,
                        protocol: Protocol::Tcp,
                        destination: ip("203.0.113.25"),
                        target_port: 80
                    },
                    Redirect {
                        port: 8080,
                        protocol: Protocol::Tcp,
                        destination: ip("203.0.113.26"),
                        target_port: 80
                    },
                    Redirect {
                        port: 8443,
                        protocol: Protocol::Udp,
                        destination: ip("203.0.113.26"),
                        target_port: 443
                    },
                ],
                fallback: Some(ip("203.0.113.27")),
            }
        );
        // The defaults: macvlan in bridge mode on the default route's interface.
        let parsed = conf(
            r#"{"addresses": ["fd00:12::99/64"], "destinations": ["fd00:99::1"], "gateway": "fd00:12::1"}"#,
            "",
        )
        .expect("IPv6");
        assert_eq!((parsed.master, parsed.mode), (None, MacvlanMode::Bridge));
        assert!(parsed.rules.is_empty());
    }

    #[test]
    fn a_bad_configuration_is_refused_with_its_field_named() {
        let good_ip = r#"{"addresses": ["192.168.12.99/24"], "destinations": ["203.0.113.27"], "gateway": "192.168.12.1"}"#;
        let cases = [
            (
                good_ip.to_owned(),
                r#", "interfaceType": "ipvlan""#,
                "interfaceType: \"ipvlan\" is not supported (macvlan only)",
            ),
            (
                good_ip.to_owned(),
                r#", "interfaceArgs": {"mode": "source"}"#,
                "interfaceArgs.mode: \"source\" is not one of bridge, private, vepa, passthru",
            ),
            (
                good_ip.to_owned(),
                r#", "interfaceArgs": {"master": "eth0\nlink del x"}"#,
                "interfaceArgs.master:",
            ),
            (
                good_ip.to_owned(),
                r#", "mtu": 40"#,
                "mtu: 40 is not between 68 and 65535",
            ),
            (
                good_ip.replace(
                    r#"["192.168.12.99/24"]"#,
                    r#"["192.168.12.99/24", "192.168.12.98/24"]"#,
                ),
                "",
                "ip.addresses: one reserved address with its prefix is needed (e.g. 192.168.12.99/24), not 2",
            ),
            (
                good_ip.replace("192.168.12.99/24", "192.168.12.99"),
                "",
                "ip.addresses[0]: \"192.168.12.99\" is not an address with its prefix",
            ),
            (
                good_ip.replace(
                    r#""gateway": "192.168.12.1""#,
                    r#""gateway": "192.168.13.1""#,
                ),
                "",
                "ip.gateway: 192.168.13.1 is not another address of 192.168.12.0/24, the reserved address's network",
            ),
            (
                good_ip.replace(r#", "gateway": "192.168.12.1""#, ""),
                "",
                "ip.gateway: missing",
            ),
            (
                good_ip.replace(r#"["203.0.113.27"]"#, "[]"),
                "",
                "ip.destinations: none given",
            ),
            (
                good_ip.replace(r#"["203.0.113.27"]"#, r#"["203.0.113.27", "203.0.113.28"]"#),
                "",
                "ip.destinations[1]: a second fallback address (ip.destinations[0] is one)",
            ),
            (
                good_ip.replace(r#"["203.0.113.27"]"#, r#"["80 icmp 203.0.113.25"]"#),
                "",
                "ip.destinations[0]: \"icmp\" is not tcp, udp or sctp",
            ),
            (
                good_ip.replace(r#"["203.0.113.27"]"#, r#"["0 tcp 203.0.113.25"]"#),
                "",
                "ip.destinations[0]: \"0\" is not a port (1-65535)",
            ),
            (
                good_ip.replace(r#"["203.0.113.27"]"#, r#"["80 tcp 203.0.113.25 70000"]"#),
                "",
                "ip.destinations[0]: \"70000\" is not a port (1-65535)",
            ),
            (
                good_ip.replace(r#"["203.0.113.27"]"#, r#"["80 tcp fd00::1"]"#),
                "",
                "ip.destinations[0]: fd00::1 is not of the reserved address 192.168.12.99's family",
            ),
            (
                good_ip.replace(
                    r#"["203.0.113.27"]"#,
                    r#"["80 tcp 203.0.113.25", "80 TCP 203.0.113.26"]"#,
                ),
                "",
                "ip.destinations[1]: tcp port 80 is redirected already by ip.destinations[0]",
            ),
            (
                good_ip.replace(r#"["203.0.113.27"]"#, r#"["80 tcp"]"#),
                "",
                "ip.destinations[0]: \"80 tcp\" is neither <address> nor",
            ),
        ];
        for (ip, extra, want) in cases {
            let error = conf(&ip, extra).expect_err(want);
            assert!(error.starts_with(want), "{error}\nwanted: {want}");
        }
        assert!(
            conf("7", "")
                .unwrap_err()
                .starts_with("the network configuration is not valid JSON")
        );
        assert_eq!(
            parse(br#"{"cniVersion": "9.9.9", "ip": {}}"#).unwrap_err(),
            "cniVersion: \"9.9.9\" is not one of 0.4.0, 1.0.0, 1.1.0"
        );
        assert_eq!(
            parse(br#"{"cniVersion": "1.0.0"}"#).unwrap_err(),
            "ip: missing (addresses, destinations, gateway)"
        );
    }
}
