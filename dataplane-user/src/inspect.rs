//! `dataplane inspect <table>`: what the pinned maps hold, decoded, as a table or JSON. It reads
//! the pins only (a running agent is not needed, nothing is written).

use std::{fmt::Write as _, net::IpAddr};

use aya::maps::{HashMap, LpmTrie, Map, MapData, lpm_trie::Key};
use dataplane_common::{
    acl::{
        ACL_ENTRY_FINAL, ACL_RULE_DEFAULT, ACL_RULE_EXEMPT, ACL_VERDICT_ALLOW, ACL_VERDICT_DENY,
        AclAddrKey, AclAddrValue, AclCtKey, AclCtValue, AclEndpoint,
    },
    lb::{
        AffinityKey, AffinityValue, Backend, CT_AFFINITY, CT_CLOSING, CT_NODEPORT, CT_REPLY,
        CT_SNAT, CtKey, CtValue, SCOPE_EXTERNAL, SCOPE_NODEPORT, ServiceKey, ServiceValue,
    },
    maps,
    overlay::{Addr, TunnelEndpoint},
};
use serde::Serialize;

use crate::{AgentError, Pins, overlay::ip_of};

/// What `inspect` can show.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Table {
    /// Service ports: address, port, protocol, scope -> id, backends, affinity.
    Services,
    /// Backends by id.
    Backends,
    /// Tracked service flows, both directions.
    Conntrack,
    /// ClientIP affinity: client and service -> backend.
    Affinity,
    /// Cluster nodes and where remote pod CIDRs live.
    Nodes,
    /// Local pods under access control, and the entries of their EgressFirewall sets.
    Firewall,
    /// Local pods' NetworkPolicy sets, and the flows policy allowed.
    Policy,
}

/// A decoded table: column names and rows of text.
#[derive(Debug, Serialize)]
pub struct Rows {
    pub columns: Vec<&'static str>,
    pub rows: Vec<Vec<String>>,
}

fn open_err(
    name: &'static str,
    action: &'static str,
) -> impl Fn(aya::maps::MapError) -> AgentError {
    move |source| AgentError::Map {
        name: name.into(),
        action,
        source,
    }
}

fn pinned(pins: &Pins, name: &'static str) -> Result<MapData, AgentError> {
    MapData::from_pin(pins.map(name)).map_err(open_err(name, "open pin"))
}

fn hash<K: aya::Pod, V: aya::Pod>(
    pins: &Pins,
    name: &'static str,
    lru: bool,
) -> Result<Vec<(K, V)>, AgentError> {
    let data = pinned(pins, name)?;
    let map = if lru {
        Map::LruHashMap(data)
    } else {
        Map::HashMap(data)
    };
    let map: HashMap<MapData, K, V> = HashMap::try_from(map).map_err(open_err(name, "open"))?;
    Ok(map.iter().filter_map(Result::ok).collect())
}

/// The live backends of the backends array, by id.
fn live_backends(pins: &Pins) -> Result<Vec<Backend>, AgentError> {
    let name = maps::LB_BACKENDS;
    let map: aya::maps::Array<MapData, Backend> =
        aya::maps::Array::try_from(Map::Array(pinned(pins, name)?))
            .map_err(open_err(name, "open"))?;
    Ok(map
        .iter()
        .filter_map(Result::ok)
        .filter(|b| b.is_live(b.id))
        .collect())
}

fn endpoint(addr: &Addr, port_be: [u8; 2]) -> String {
    match ip_of(addr) {
        IpAddr::V4(v4) => format!("{v4}:{}", u16::from_be_bytes(port_be)),
        IpAddr::V6(v6) => format!("[{v6}]:{}", u16::from_be_bytes(port_be)),
    }
}

fn protocol(number: u8) -> String {
    match number {
        1 => "icmp".into(),
        6 => "tcp".into(),
        17 => "udp".into(),
        58 => "icmpv6".into(),
        132 => "sctp".into(),
        other => other.to_string(),
    }
}

fn rule(rule: u32) -> String {
    match rule {
        ACL_RULE_EXEMPT => "exempt".into(),
        ACL_RULE_DEFAULT => "default".into(),
        n => n.to_string(),
    }
}

fn verdict(code: u8) -> &'static str {
    match code {
        ACL_VERDICT_ALLOW => "allow",
        ACL_VERDICT_DENY => "deny",
        _ => "no match",
    }
}

/// Reads and decodes one table from the pins under `pins`.
pub fn read(pins: &Pins, table: Table) -> Result<Rows, AgentError> {
    let (columns, mut rows): (Vec<&'static str>, Vec<Vec<String>>) = match table {
        Table::Services => (
            vec!["ADDRESS", "PROTO", "SCOPE", "ID", "BACKENDS", "AFFINITY_S"],
            hash::<ServiceKey, ServiceValue>(pins, maps::LB_SERVICES, false)?
                .iter()
                .map(|(k, v)| {
                    let scope = match k.scope {
                        SCOPE_NODEPORT => "nodeport",
                        SCOPE_EXTERNAL => "external",
                        _ => "cluster",
                    };
                    vec![
                        endpoint(&k.addr, k.port_be),
                        protocol(k.protocol),
                        scope.into(),
                        v.id.to_string(),
                        v.backends.to_string(),
                        v.affinity_timeout.to_string(),
                    ]
                })
                .collect(),
        ),
        Table::Backends => (
            vec!["ID", "BACKEND"],
            live_backends(pins)?
                .iter()
                .map(|b| vec![b.id.to_string(), endpoint(&b.addr, b.port_be)])
                .collect(),
        ),
        Table::Conntrack => (
            vec![
                "FLOW",
                "PROTO",
                "DIR",
                "TRANSLATED TO",
                "BACKEND",
                "FLAGS",
                "LAST_SEEN_S",
            ],
            hash::<CtKey, CtValue>(pins, maps::LB_CT, true)?
                .iter()
                .map(|(k, v)| {
                    let mut flags = Vec::new();
                    for (bit, name) in [
                        (CT_CLOSING, "closing"),
                        (CT_SNAT, "snat"),
                        (CT_NODEPORT, "nodeport"),
                        (CT_AFFINITY, "affinity"),
                    ] {
                        if v.flags & bit != 0 {
                            flags.push(name);
                        }
                    }
                    vec![
                        format!(
                            "{} -> {}",
                            endpoint(&k.src, k.src_port_be),
                            endpoint(&k.dst, k.dst_port_be)
                        ),
                        protocol(k.protocol),
                        if k.direction == CT_REPLY {
                            "reply"
                        } else {
                            "original"
                        }
                        .into(),
                        endpoint(&v.addr, v.port_be),
                        v.backend_id.to_string(),
                        flags.join(","),
                        v.last_seen.to_string(),
                    ]
                })
                .collect(),
        ),
        Table::Affinity => (
            vec!["CLIENT", "SERVICE_ID", "BACKEND", "LAST_SEEN_S"],
            hash::<AffinityKey, AffinityValue>(pins, maps::LB_AFFINITY, true)?
                .iter()
                .map(|(k, v)| {
                    vec![
                        ip_of(&k.client).to_string(),
                        k.service_id.to_string(),
                        v.backend_id.to_string(),
                        v.last_seen.to_string(),
                    ]
                })
                .collect(),
        ),
        Table::Nodes => {
            let mut rows: Vec<Vec<String>> = hash::<Addr, u32>(pins, maps::NODE_ADDRS, false)?
                .iter()
                .map(|(a, _)| vec!["node".into(), ip_of(a).to_string(), String::new()])
                .collect();
            for (name, v4) in [(maps::REMOTE_PODS_V4, true), (maps::REMOTE_PODS_V6, false)] {
                let data = pinned(pins, name)?;
                let cidrs: Vec<(String, TunnelEndpoint)> = if v4 {
                    let trie: LpmTrie<MapData, [u8; 4], TunnelEndpoint> =
                        LpmTrie::try_from(Map::LpmTrie(data)).map_err(open_err(name, "open"))?;
                    trie.iter()
                        .filter_map(Result::ok)
                        .map(|(k, v): (Key<[u8; 4]>, _)| {
                            (format!("{}/{}", IpAddr::from(k.data()), k.prefix_len()), v)
                        })
                        .collect()
                } else {
                    let trie: LpmTrie<MapData, [u8; 16], TunnelEndpoint> =
                        LpmTrie::try_from(Map::LpmTrie(data)).map_err(open_err(name, "open"))?;
                    trie.iter()
                        .filter_map(Result::ok)
                        .map(|(k, v): (Key<[u8; 16]>, _)| {
                            (format!("{}/{}", IpAddr::from(k.data()), k.prefix_len()), v)
                        })
                        .collect()
                };
                for (cidr, tunnel) in cidrs {
                    rows.push(vec![
                        "pod CIDR".into(),
                        cidr,
                        format!("via node {}", ip_of(&tunnel.addr)),
                    ]);
                }
            }
            (vec!["KIND", "ADDRESS", "WHERE"], rows)
        }
        Table::Firewall => {
            let endpoints = hash::<Addr, AclEndpoint>(pins, maps::ACL_ENDPOINTS, false)?;
            let mut rows: Vec<Vec<String>> = endpoints
                .iter()
                .filter(|(_, e)| e.firewall != 0)
                .map(|(a, e)| {
                    vec![
                        format!("pod {}", ip_of(a)),
                        format!("set {}", e.firewall),
                        String::new(),
                        String::new(),
                    ]
                })
                .collect();
            let sets: std::collections::BTreeSet<u32> =
                endpoints.iter().map(|(_, e)| e.firewall).collect();
            for (k, v) in hash::<AclAddrKey, AclAddrValue>(pins, maps::ACL_ADDRS, false)? {
                if sets.contains(&k.set) {
                    rows.push(prefix_row(&k, &v));
                }
            }
            (vec!["WHAT", "SET / PREFIX", "DECISION", "RULE"], rows)
        }
        Table::Policy => {
            let endpoints = hash::<Addr, AclEndpoint>(pins, maps::ACL_ENDPOINTS, false)?;
            let mut rows: Vec<Vec<String>> = endpoints
                .iter()
                .filter(|(_, e)| e.policed())
                .map(|(a, e)| {
                    let set = |s: u32| {
                        if s == 0 {
                            "-".to_owned()
                        } else {
                            s.to_string()
                        }
                    };
                    vec![
                        format!("pod {}", ip_of(a)),
                        format!("ingress set {}", set(e.ingress)),
                        format!("egress set {}", set(e.egress)),
                        String::new(),
                    ]
                })
                .collect();
            for (k, v) in hash::<AclCtKey, AclCtValue>(pins, maps::ACL_CT, true)? {
                let port = |p: u16| p.to_be_bytes();
                rows.push(vec![
                    "allowed flow".into(),
                    format!(
                        "{} -> {}",
                        endpoint(&k.src, port(k.src_port)),
                        endpoint(&k.dst, port(k.dst_port))
                    ),
                    protocol(k.protocol),
                    format!(
                        "last seen {} s{}",
                        v.last_seen,
                        if v.flags != 0 { ", closing" } else { "" }
                    ),
                ]);
            }
            (vec!["WHAT", "WHO", "DETAIL", "STATE"], rows)
        }
    };
    rows.sort();
    Ok(Rows { columns, rows })
}

fn prefix_row(key: &AclAddrKey, value: &AclAddrValue) -> Vec<String> {
    let ip = ip_of(&key.addr);
    let prefix = format!("set {} {ip}/{}", key.set, key.len);
    let decision = if value.kind == ACL_ENTRY_FINAL {
        verdict(value.verdict).to_owned()
    } else {
        format!(
            "port table {} (else {})",
            value.table,
            verdict(value.verdict)
        )
    };
    vec!["prefix".into(), prefix, decision, rule(value.rule)]
}

/// The rows as aligned text columns.
pub fn render(rows: &Rows) -> String {
    let mut widths: Vec<usize> = rows.columns.iter().map(|c| c.len()).collect();
    for row in &rows.rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let text: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        let _ = writeln!(out, "{}", text.join("  ").trim_end());
    };
    line(rows.columns.clone(), &mut out);
    for row in &rows.rows {
        line(row.iter().map(String::as_str).collect(), &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::net::Ipv6Addr;

    use super::*;

    #[test]
    fn addresses_and_tables_read_as_operators_write_them() {
        let v4 = dataplane_common::overlay::ipv4_mapped([10, 96, 0, 10]);
        assert_eq!(endpoint(&v4, 80u16.to_be_bytes()), "10.96.0.10:80");
        let v6: Addr = "fd00::1".parse::<Ipv6Addr>().unwrap().octets();
        assert_eq!(endpoint(&v6, 443u16.to_be_bytes()), "[fd00::1]:443");
        let rows = Rows {
            columns: vec!["A", "LONGER"],
            rows: vec![vec!["wide cell".into(), "x".into()]],
        };
        assert_eq!(render(&rows), "A          LONGER\nwide cell  x\n");
        assert_eq!(rule(ACL_RULE_EXEMPT), "exempt");
        assert_eq!(protocol(132), "sctp");
    }
}
