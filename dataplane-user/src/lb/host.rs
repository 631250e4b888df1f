//! The node's own connections to its NodePorts and to Services' external and load-balancer
//! addresses, as kube-proxy's output chain serves them. The kernel programs never see these:
//! a connection to the node's own address is delivered through `lo`, and one to an external
//! address leaves by the node's default route. An nftables table the agent owns
//! (`inet dataplane_services`) translates them in the output hook to the Service's ClusterIP
//! and port of the same family; the service networks are routed into the management port, so
//! from there the connection is balanced by `tc_from_pod` exactly as a host client's
//! connection to the ClusterIP is (same backends, affinity and policy), and conntrack gives
//! the replies their original address back.
//!
//! One map per family, keyed by protocol, destination address and port: one lookup per new
//! connection, whatever the number of Services. Loopback addresses are left alone, as
//! kube-proxy's nftables mode does (`127.0.0.1:<nodePort>` is not served). The table is
//! written whole, in one transaction, only when what it holds changes (a Service's addresses
//! or ports, not its endpoints).

use std::{collections::BTreeMap, net::IpAddr};

use aya::maps::{HashMap, MapData};
use dataplane_common::{
    lb::{SCOPE_EXTERNAL, SCOPE_NODEPORT, ServiceKey},
    maps::{self, MAX_NODEPORT_ADDRS},
    overlay::Addr,
};
use ipnet::IpNet;

use super::BackendAddr;
use crate::{
    error::AgentError,
    kernel::{capacity::map_err, loader::Dataplane},
    mapsync::{addr16, sync_hash},
};

/// Where NodePorts are served (`--nodeport-addresses`, as kube-proxy's): the node's primary
/// address of each family (`primary`, the default), and/or every address of the node inside
/// the listed networks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodePortAddresses {
    pub primary: bool,
    pub networks: Vec<IpNet>,
}

impl Default for NodePortAddresses {
    fn default() -> Self {
        Self {
            primary: true,
            networks: Vec::new(),
        }
    }
}

impl NodePortAddresses {
    /// Reads the flag's values: `primary` and CIDRs, in any mix; an error names the value
    /// that is neither.
    pub fn parse(values: &[String]) -> Result<Self, String> {
        let mut out = Self {
            primary: false,
            networks: Vec::new(),
        };
        for value in values.iter().map(|v| v.trim()).filter(|v| !v.is_empty()) {
            if value == "primary" {
                out.primary = true;
            } else {
                let network: IpNet = value.parse().map_err(|_| {
                    format!("--nodeport-addresses: {value:?} is neither a CIDR nor \"primary\"")
                })?;
                out.networks.push(network.trunc());
            }
        }
        if !out.primary && out.networks.is_empty() {
            out.primary = true;
        }
        Ok(out)
    }

    /// Whether the kernel reads the addresses from `LB_NODEPORT_ADDRS` (networks are listed)
    /// rather than taking the node's address of each family.
    pub fn listed(&self) -> bool {
        !self.networks.is_empty()
    }

    /// The addresses NodePorts are served on: `primary` (the node's address of each family,
    /// when asked for) and each of `local` inside a listed network; never a loopback address
    /// (as kube-proxy's nftables mode), each once, at most [`MAX_NODEPORT_ADDRS`].
    pub fn select(&self, primary: &[IpAddr], local: &[IpAddr]) -> Vec<IpAddr> {
        let mut out: Vec<IpAddr> = Vec::new();
        let wanted = primary.iter().filter(|_| self.primary).chain(
            local
                .iter()
                .filter(|a| self.networks.iter().any(|n| n.contains(*a))),
        );
        for address in wanted {
            if !address.is_loopback() && !out.contains(address) {
                out.push(*address);
            }
        }
        out.truncate(MAX_NODEPORT_ADDRS as usize);
        out
    }
}

impl Dataplane {
    /// Makes `LB_NODEPORT_ADDRS` hold exactly `addresses`; what was written and deleted.
    pub fn sync_nodeport_addresses(&mut self, addresses: &[IpAddr]) -> Result<usize, AgentError> {
        let desired: BTreeMap<Addr, u8> = addresses.iter().map(|a| (addr16(*a), 1)).collect();
        let mut map: HashMap<&mut MapData, Addr, u8> = self.typed_map(maps::LB_NODEPORT_ADDRS)?;
        let stats =
            sync_hash(&mut map, &desired).map_err(map_err(maps::LB_NODEPORT_ADDRS, "write"))?;
        Ok(stats.written + stats.deleted)
    }
}

/// The table's name (family `inet`).
pub const TABLE: &str = "dataplane_services";

/// One of a Service's NodePorts or external or load-balancer addresses, as the node's own
/// connections reach it: sent to the Service's ClusterIP of the same family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostRedirect {
    /// The service port's key: a NodePort (`SCOPE_NODEPORT`, served on the node's NodePort
    /// addresses of its family) or an external or load-balancer address (`SCOPE_EXTERNAL`).
    pub key: ServiceKey,
    /// The ClusterIP and port the connection is sent to.
    pub to: BackendAddr,
    /// The load-balancer address's source ranges (empty: every source): the node's own
    /// connections are translated only where the node's address may open flows.
    pub source_ranges: Vec<IpNet>,
}

/// The table's entries: each NodePort on each of `node_addresses` of its family, each
/// external or load-balancer address whose source ranges admit the node's address of that
/// family. The first redirect of a destination keeps it (the caller gives them in the order
/// the service keys were given out, so each key's holder).
pub fn host_entries<'a>(
    redirects: impl IntoIterator<Item = &'a HostRedirect>,
    node_addresses: &[IpAddr],
) -> BTreeMap<(u8, IpAddr, u16), BackendAddr> {
    let mut entries = BTreeMap::new();
    for redirect in redirects {
        let key = &redirect.key;
        let port = u16::from_be_bytes(key.port_be);
        let v4 = redirect.to.ip.is_ipv4();
        let of_family = node_addresses.iter().filter(|a| a.is_ipv4() == v4);
        let destinations: Vec<IpAddr> = match key.scope {
            SCOPE_NODEPORT => of_family.copied().collect(),
            SCOPE_EXTERNAL => {
                let address = crate::mapsync::ip_of(&key.addr);
                let admitted = redirect.source_ranges.is_empty()
                    || of_family
                        .clone()
                        .any(|a| redirect.source_ranges.iter().any(|r| r.contains(a)));
                if admitted { vec![address] } else { Vec::new() }
            }
            _ => Vec::new(),
        };
        for destination in destinations {
            if destination.is_loopback() || destination.is_ipv4() != v4 {
                continue;
            }
            entries
                .entry((key.protocol, destination, port))
                .or_insert(redirect.to);
        }
    }
    entries
}

/// The nftables script that makes the table hold exactly `entries`: created if missing,
/// deleted and written anew in one transaction (`nft -f` applies a file atomically).
pub fn script(entries: &BTreeMap<(u8, IpAddr, u16), BackendAddr>) -> String {
    let mut out = format!("table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n");
    let mut rules = Vec::new();
    for (v4, family, kind, loopback) in [
        (true, "ip", "ipv4_addr", "127.0.0.0/8"),
        (false, "ip6", "ipv6_addr", "::1"),
    ] {
        let elements: Vec<String> = entries
            .iter()
            .filter(|((_, address, _), _)| address.is_ipv4() == v4)
            .map(|((protocol, address, port), to)| {
                format!(
                    "{} . {address} . {port} : {} . {}",
                    protocol_name(*protocol),
                    to.ip,
                    to.port
                )
            })
            .collect();
        let map = format!("host_{}", if v4 { "v4" } else { "v6" });
        out.push_str(&format!(
            "  map {map} {{ type inet_proto . {kind} . inet_service : {kind} . inet_service;"
        ));
        if !elements.is_empty() {
            out.push_str(&format!(" elements = {{ {} }}", elements.join(", ")));
        }
        out.push_str(" }\n");
        rules.push(format!(
            "{family} daddr != {loopback} meta l4proto {{ tcp, udp, sctp }} dnat {family} to meta l4proto . {family} daddr . th dport map @{map}"
        ));
    }
    // dstnat's priority (-100): before the node's own output NAT rules, if any.
    out.push_str("  chain output {\n    type nat hook output priority -100; policy accept;\n");
    for rule in rules {
        out.push_str(&format!("    {rule}\n"));
    }
    out.push_str("  }\n}\n");
    out
}

fn protocol_name(protocol: u8) -> &'static str {
    match protocol {
        6 => "tcp",
        17 => "udp",
        _ => "sctp",
    }
}

/// Applies `script` with `nft -f -`.
pub fn apply(script: &str) -> Result<(), AgentError> {
    crate::kernel::netdev::run_nft(TABLE, script)
}

/// Removes the table (nothing when it is not there).
pub fn remove() -> Result<(), AgentError> {
    crate::kernel::netdev::remove_nft_table(TABLE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodeport_addresses_are_the_primary_ones_and_those_in_the_listed_networks() {
        let parse = |values: &[&str]| {
            NodePortAddresses::parse(&values.iter().map(|v| v.to_string()).collect::<Vec<_>>())
        };
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let primary = [ip("10.99.0.1"), ip("fd99::1")];
        let local = [
            ip("10.99.0.1"),
            ip("192.168.7.4"),
            ip("192.168.8.4"),
            ip("127.0.0.1"),
            ip("fd99::1"),
        ];
        let default = parse(&[]).unwrap();
        assert_eq!(default, NodePortAddresses::default());
        assert!(!default.listed());
        assert_eq!(default.select(&primary, &local), primary);
        let listed = parse(&["192.168.7.0/24", "127.0.0.0/8"]).unwrap();
        assert!(listed.listed());
        // Only what is listed (the loopback address never): the primary address is not.
        assert_eq!(listed.select(&primary, &local), [ip("192.168.7.4")]);
        let both = parse(&["primary", "192.168.0.0/16"]).unwrap();
        assert_eq!(
            both.select(&primary, &local),
            [
                ip("10.99.0.1"),
                ip("fd99::1"),
                ip("192.168.7.4"),
                ip("192.168.8.4")
            ]
        );
        assert_eq!(
            parse(&["10.0.0.0/8", "eth0"]).unwrap_err(),
            "--nodeport-addresses: \"eth0\" is neither a CIDR nor \"primary\""
        );
    }

    fn redirect(
        scope: u8,
        addr: &str,
        port: u16,
        protocol: u8,
        to: &str,
        to_port: u16,
    ) -> HostRedirect {
        HostRedirect {
            key: ServiceKey {
                addr: addr16(addr.parse().unwrap()),
                port_be: port.to_be_bytes(),
                protocol,
                scope,
            },
            to: BackendAddr {
                ip: to.parse().unwrap(),
                port: to_port,
            },
            source_ranges: Vec::new(),
        }
    }

    #[test]
    fn nodeports_are_served_on_each_node_address_of_their_family_and_external_addresses_as_given() {
        let node: Vec<IpAddr> = vec![
            "10.99.0.1".parse().unwrap(),
            "fd99::1".parse().unwrap(),
            "127.0.0.1".parse().unwrap(),
        ];
        let mut ranged = redirect(SCOPE_EXTERNAL, "192.0.2.20", 443, 6, "10.96.0.20", 443);
        ranged.source_ranges = vec!["203.0.113.0/24".parse().unwrap()];
        let redirects = [
            redirect(SCOPE_NODEPORT, "0.0.0.0", 30080, 6, "10.96.0.10", 80),
            redirect(SCOPE_NODEPORT, "::", 30080, 6, "fd96::10", 80),
            redirect(SCOPE_EXTERNAL, "192.0.2.10", 53, 17, "10.96.0.10", 53),
            // The node's address is outside the ranges: not translated (the address's own
            // load balancer decides, as for any other client).
            ranged,
            // A second claim of a destination: the first keeps it.
            redirect(SCOPE_EXTERNAL, "192.0.2.10", 53, 17, "10.96.0.99", 53),
        ];
        let entries = host_entries(&redirects, &node);
        let listed: Vec<String> = entries
            .iter()
            .map(|((p, a, port), to)| format!("{p} {a} {port} -> {to}"))
            .collect();
        assert_eq!(
            listed,
            [
                "6 10.99.0.1 30080 -> 10.96.0.10:80",
                "6 fd99::1 30080 -> [fd96::10]:80",
                "17 192.0.2.10 53 -> 10.96.0.10:53",
            ]
        );
        let script = script(&entries);
        assert!(
            script.starts_with(
                "table inet dataplane_services\ndelete table inet dataplane_services\n"
            )
        );
        assert!(script.contains(
            "map host_v4 { type inet_proto . ipv4_addr . inet_service : ipv4_addr . inet_service; elements = { tcp . 10.99.0.1 . 30080 : 10.96.0.10 . 80, udp . 192.0.2.10 . 53 : 10.96.0.10 . 53 } }"
        ), "{script}");
        assert!(script.contains(
            "ip daddr != 127.0.0.0/8 meta l4proto { tcp, udp, sctp } dnat ip to meta l4proto . ip daddr . th dport map @host_v4"
        ));
        assert!(script.contains("elements = { tcp . fd99::1 . 30080 : fd96::10 . 80 }"));
        assert!(script.contains("type nat hook output priority -100; policy accept;"));
    }

    #[test]
    fn an_address_inside_the_source_ranges_is_translated_and_an_empty_table_is_still_whole() {
        let mut ranged = redirect(SCOPE_EXTERNAL, "192.0.2.20", 443, 6, "10.96.0.20", 443);
        ranged.source_ranges = vec!["10.99.0.0/24".parse().unwrap()];
        let node = ["10.99.0.1".parse().unwrap()];
        let entries = host_entries(&[ranged], &node);
        assert_eq!(entries.len(), 1);
        let empty = script(&BTreeMap::new());
        assert!(empty.contains(
            "map host_v6 { type inet_proto . ipv6_addr . inet_service : ipv6_addr . inet_service; }"
        ), "{empty}");
    }
}
