//! `dataplane inspect <table>`: what the pinned maps hold, decoded, as a table or JSON. It reads
//! the pins only (a running agent is not needed, nothing is written).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::IpAddr,
};

use aya::maps::{HashMap, LpmTrie, Map, MapData, lpm_trie::Key};
use dataplane_common::{
    acl::{
        ACL_CT_CLOSING, ACL_CT_INBOUND, ACL_ENTRY_FINAL, ACL_RULE_DEFAULT, ACL_RULE_EXEMPT,
        ACL_VERDICT_ALLOW, ACL_VERDICT_DENY, AclAddrKey, AclAddrValue, AclCtKey, AclCtValue,
        AclEndpoint,
    },
    egressip::{
        EGRESS_CT_CHOSEN, EGRESS_CT_IN, EGRESS_CT_OUT, EGRESS_HELD_HERE, EgressCtValue,
        EgressHolder, EgressPod,
    },
    hybrid::{HYBRID_ENABLED, HybridConfig, HybridNode},
    lb::{
        AffinityKey, AffinityValue, Backend, CT_AFFINITY, CT_CLOSING, CT_NODEPORT, CT_REPLY,
        CT_RESET, CT_SNAT, CtKey, CtValue, MaglevTable, SCOPE_EXTERNAL, SCOPE_NODEPORT,
        SCOPE_NODEPORT_FROM_POD, ServiceKey, ServiceValue, socket::SockPod,
    },
    maps,
    multicast::{MAX_LOCAL_MEMBERS, MAX_REMOTE_MEMBERS, McastGroup, McastKey},
    overlay::{Addr, LocalPod, TUNNEL_VXLAN, TunnelEndpoint},
};
use serde::Serialize;

use crate::kernel::capacity::map_err;
use crate::{
    acl::{
        explain::{PolicyMaps, SetRules},
        pods::Direction,
    },
    error::AgentError,
    kernel::pins::Pins,
    mapsync::ip_of,
    multicast,
};

/// What `inspect` can show.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Table {
    /// Service ports: address, port, protocol, scope -> id, backends, affinity, the sources
    /// a load-balancer address admits (`spec.loadBalancerSourceRanges`; empty: every source).
    Services,
    /// Backends by id.
    Backends,
    /// Tracked service flows, both directions.
    Conntrack,
    /// ClientIP affinity: client and service -> backend.
    Affinity,
    /// Cluster nodes, hybrid nodes, and where remote pod CIDRs live (Geneve or VXLAN).
    Nodes,
    /// Local pods under access control, and the entries of their EgressFirewall sets.
    Firewall,
    /// Local pods' NetworkPolicy sets, and the flows policy allowed.
    Policy,
    /// Egress IPs: who holds each address, the local pods that leave by them, the pods this
    /// node translates, and the translated flows.
    Egressip,
    /// Multicast groups: namespace, group, local member pods, member nodes.
    Multicast,
    /// Local pods by host-side veth: their addresses, the packets dropped at their veth and
    /// the service flows they opened (summed over CPUs), most drops first: which pod floods.
    Pods,
    /// Service translation at the socket (`--socket-lb on`): the pods served (by network
    /// namespace cookie) and each socket given a backend there: the backend it talks to and
    /// the service address `getpeername` and `recvmsg` give back.
    Sockets,
}

/// A decoded table: column names and rows of cells.
#[derive(Debug, Serialize)]
pub struct Rows {
    pub columns: Vec<&'static str>,
    pub rows: Vec<Vec<Cell>>,
}

/// One value of a row: a number (ids, counts, seconds) stays a number in JSON, an address or a
/// name is a string, and a list (a service's backends) is a list of strings.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(untagged)]
pub enum Cell {
    Number(u64),
    Text(String),
    List(Vec<String>),
}

impl std::fmt::Display for Cell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Number(n) => write!(f, "{n}"),
            Self::Text(text) => f.write_str(text),
            Self::List(items) if items.is_empty() => f.write_str("-"),
            Self::List(items) => f.write_str(&items.join(",")),
        }
    }
}

impl From<String> for Cell {
    fn from(text: String) -> Self {
        Self::Text(text)
    }
}

impl From<&str> for Cell {
    fn from(text: &str) -> Self {
        Self::Text(text.to_owned())
    }
}

impl From<u32> for Cell {
    fn from(n: u32) -> Self {
        Self::Number(n.into())
    }
}

impl Rows {
    /// One JSON object per row, keyed by the lower-case column names.
    pub fn to_json(&self) -> serde_json::Value {
        self.rows
            .iter()
            .map(|row| {
                self.columns
                    .iter()
                    .zip(row)
                    .map(|(column, cell)| {
                        let value = serde_json::to_value(cell).unwrap_or_default();
                        (column.to_ascii_lowercase(), value)
                    })
                    .collect::<serde_json::Map<_, _>>()
            })
            .collect()
    }
}

fn open_err(
    name: &'static str,
    action: &'static str,
) -> impl Fn(aya::maps::MapError) -> AgentError {
    map_err(name, action)
}

fn pinned(pins: &Pins, name: &'static str) -> Result<MapData, AgentError> {
    pins.open_map(name)
}

fn hash<K: aya::Pod, V: aya::Pod>(
    pins: &Pins,
    name: &'static str,
    lru: bool,
) -> Result<Vec<(K, V)>, AgentError> {
    let map = pins.open_hash::<K, V>(name, lru)?;
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

/// Each service port's backends by address, from its live Maglev table (the ready backends:
/// the ones new flows go to), keyed by table index.
fn service_backends(
    pins: &Pins,
    services: &[(ServiceKey, ServiceValue)],
) -> Result<BTreeMap<u32, Vec<String>>, AgentError> {
    let by_id: BTreeMap<u32, String> = live_backends(pins)?
        .iter()
        .map(|b| (b.id, endpoint(&b.addr, b.port_be)))
        .collect();
    let name = maps::LB_MAGLEV;
    let tables: HashMap<MapData, u32, MaglevTable> =
        HashMap::try_from(Map::HashMap(pinned(pins, name)?)).map_err(open_err(name, "open"))?;
    let mut out = BTreeMap::new();
    for (_, service) in services.iter().filter(|(_, s)| s.backends != 0) {
        let Ok(table) = tables.get(&service.table, 0) else {
            continue;
        };
        let ids: BTreeSet<u32> = table.iter().copied().collect();
        let mut addresses: Vec<String> = ids
            .iter()
            .map(|id| {
                by_id
                    .get(id)
                    .cloned()
                    .unwrap_or_else(|| format!("gone#{id}"))
            })
            .collect();
        addresses.sort();
        out.insert(service.table, addresses);
    }
    Ok(out)
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
/// The rows of `table`; `rules` (what the agent wrote of its policy sets, see
/// [`crate::acl::explain`]) names the policies that decided.
pub fn read(
    pins: &Pins,
    table: Table,
    rules: &BTreeMap<u32, SetRules>,
) -> Result<Rows, AgentError> {
    let (columns, mut rows): (Vec<&'static str>, Vec<Vec<Cell>>) = match table {
        Table::Services => {
            let rows = services_rows(pins, &crate::lb::Described::default())?;
            (rows.columns, rows.rows)
        }
        Table::Backends => (
            vec!["ID", "BACKEND"],
            live_backends(pins)?
                .iter()
                .map(|b| vec![b.id.into(), endpoint(&b.addr, b.port_be).into()])
                .collect(),
        ),
        Table::Conntrack => (
            vec![
                "FLOW",
                "PROTO",
                "DIR",
                "TRANSLATED_TO",
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
                        (CT_RESET, "reset"),
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
                        )
                        .into(),
                        protocol(k.protocol).into(),
                        if k.direction == CT_REPLY {
                            "reply"
                        } else {
                            "original"
                        }
                        .into(),
                        endpoint(&v.addr, v.port_be).into(),
                        v.backend_id.into(),
                        flags.join(",").into(),
                        v.last_seen.into(),
                    ]
                })
                .collect(),
        ),
        Table::Affinity => {
            let backends = live_backends(pins)?;
            (
                vec![
                    "CLIENT",
                    "SERVICE_ID",
                    "BACKEND",
                    "BACKEND_ADDRESS",
                    "LAST_SEEN_S",
                ],
                hash::<AffinityKey, AffinityValue>(pins, maps::LB_AFFINITY, true)?
                    .iter()
                    .map(|(k, v)| {
                        vec![
                            ip_of(&k.client).to_string().into(),
                            k.service_id.into(),
                            v.backend_id.into(),
                            endpoint_of(&backends, v.backend_id).into(),
                            v.last_seen.into(),
                        ]
                    })
                    .collect(),
            )
        }
        Table::Nodes => {
            let mut rows: Vec<Vec<Cell>> = hash::<Addr, u32>(pins, maps::NODE_ADDRS, false)?
                .iter()
                .map(|(a, _)| vec!["node".into(), ip_of(a).to_string().into(), "".into()])
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
                    let node = ip_of(&tunnel.addr);
                    let place = match tunnel.kind {
                        TUNNEL_VXLAN if node.is_unspecified() => {
                            "hybrid network, no node: dropped".to_owned()
                        }
                        TUNNEL_VXLAN => format!("via hybrid node {node} (VXLAN)"),
                        _ => format!("via node {node}"),
                    };
                    rows.push(vec!["pod CIDR".into(), cidr.into(), place.into()]);
                }
            }
            rows.extend(hybrid_rows(pins)?);
            (vec!["KIND", "ADDRESS", "WHERE"], rows)
        }
        Table::Firewall => {
            let endpoints = hash::<Addr, AclEndpoint>(pins, maps::ACL_ENDPOINTS, false)?;
            let mut rows: Vec<Vec<Cell>> = endpoints
                .iter()
                .filter(|(_, e)| e.firewall != 0)
                .map(|(a, e)| {
                    vec![
                        format!("pod {}", ip_of(a)).into(),
                        format!("set {}", e.firewall).into(),
                        "".into(),
                        "".into(),
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
        // By ids here; `dataplane inspect multicast` names them from the run directory.
        Table::Pods => (
            vec!["IFINDEX", "ADDRESSES", "DROPS", "SERVICE_FLOWS"],
            pod_rows(pins)?,
        ),
        Table::Multicast => {
            let rows = multicast_rows(pins, None)?;
            (rows.columns, rows.rows)
        }
        Table::Egressip => (
            vec!["KIND", "ADDRESS", "EGRESS", "DETAIL"],
            egress_rows(pins)?,
        ),
        Table::Policy => (
            vec!["WHAT", "WHO", "DETAIL", "STATE", "DECIDED_BY"],
            policy_rows(pins, rules)?,
        ),
        Table::Sockets => (
            vec!["KIND", "NETNS", "POD_VETH", "SOCKET", "BACKEND", "SERVICE"],
            socket_rows(pins)?,
        ),
    };
    rows.sort();
    Ok(Rows { columns, rows })
}

/// The socket-level translation's pods and sockets as rows: KIND, NETNS, POD_VETH, SOCKET,
/// BACKEND, SERVICE.
fn socket_rows(pins: &Pins) -> Result<Vec<Vec<Cell>>, AgentError> {
    if !pins.map(maps::SOCK_LB_PODS).exists() {
        return Ok(Vec::new());
    }
    let pods: BTreeMap<u64, SockPod> = hash::<u64, SockPod>(pins, maps::SOCK_LB_PODS, false)?
        .into_iter()
        .collect();
    let veth = |ifindex: u32| {
        if ifindex == 0 {
            // `--socket-lb-host on`: the host's own namespace.
            return "host".to_owned();
        }
        crate::kernel::preflight::interface_name(ifindex)
            .map_or_else(|| ifindex.to_string(), |name| format!("{name} ({ifindex})"))
    };
    let mut rows: Vec<Vec<Cell>> = pods
        .iter()
        .map(|(netns, pod)| {
            vec![
                "pod".into(),
                Cell::Number(*netns),
                veth(pod.ifindex).into(),
                "-".into(),
                "-".into(),
                "-".into(),
            ]
        })
        .collect();
    // The sockets live in the pods' namespaces, each with its translation in its own
    // storage: read through a sock_diag dump in every pod namespace found where runtimes keep
    // them.
    let storage = crate::lb::socket::Storage::open(pins)?;
    let dirs: Vec<std::path::PathBuf> = crate::cni::wire::DEFAULT_NETNS_DIRS
        .iter()
        .map(std::path::PathBuf::from)
        .collect();
    let mut namespaces = crate::kernel::netns::files_by_cookie(&dirs);
    // The host's (this command's) namespace, in scope with `--socket-lb-host on`.
    if let Ok(cookie) = crate::kernel::netns::current_cookie() {
        namespaces.insert(
            cookie,
            std::path::PathBuf::from(crate::lb::socket::HOST_NETNS),
        );
    }
    for (netns, path) in namespaces {
        let Some(pod) = pods.get(&netns) else {
            continue;
        };
        let sockets =
            crate::lb::socket::sockets_in(&path, &storage, crate::lb::socket::UdpSockets::All)
                .map_err(|source| AgentError::Io {
                    action: "reading the sockets of a pod's network namespace",
                    path: path.clone(),
                    source,
                })?;
        for (socket, rev) in &sockets {
            let Some(rev) = rev else {
                continue;
            };
            for slot in rev.slots.iter().filter(|s| s.backend_port_be != [0; 2]) {
                rows.push(vec![
                    "socket".into(),
                    Cell::Number(netns),
                    veth(pod.ifindex).into(),
                    Cell::Number(socket.cookie),
                    format!(
                        "{} (id {})",
                        endpoint(&slot.backend, slot.backend_port_be),
                        slot.backend_id
                    )
                    .into(),
                    endpoint(&slot.service, slot.service_port_be).into(),
                ]);
            }
        }
    }
    Ok(rows)
}

/// The hybrid overlay's settings and nodes as rows: KIND, ADDRESS, WHERE.
fn hybrid_rows(pins: &Pins) -> Result<Vec<Vec<Cell>>, AgentError> {
    let name = maps::HYBRID_CONFIG;
    let config: aya::maps::Array<MapData, HybridConfig> =
        aya::maps::Array::try_from(Map::Array(pinned(pins, name)?))
            .map_err(open_err(name, "open"))?;
    let config = config.get(&0, 0).map_err(open_err(name, "read"))?;
    if config.flags & HYBRID_ENABLED == 0 {
        return Ok(Vec::new());
    }
    let mac = |m: &[u8; 6]| crate::kernel::netdev::mac_text(m);
    let mut rows = vec![vec![
        "hybrid overlay".into(),
        format!("VXLAN port {}, VNI 4097", config.vxlan_port).into(),
        format!("router MAC {}, MTU {}", mac(&config.router_mac), config.mtu).into(),
    ]];
    for (address, node) in hash::<Addr, HybridNode>(pins, maps::HYBRID_NODES, false)? {
        rows.push(vec![
            "hybrid node".into(),
            ip_of(&address).to_string().into(),
            format!("router MAC {}", mac(&node.router_mac)).into(),
        ]);
    }
    Ok(rows)
}

/// The address of the live backend `id`, or `gone` when its slot holds another one now.
/// The egress IP maps as rows: KIND, ADDRESS, EGRESS, DETAIL.
fn egress_rows(pins: &Pins) -> Result<Vec<Vec<Cell>>, AgentError> {
    let mut rows = Vec::new();
    for (ip, holder) in hash::<Addr, EgressHolder>(pins, maps::EGRESS_IPS, false)? {
        let held = if holder.flags & EGRESS_HELD_HERE != 0 {
            "held here (answers ARP, translates)".to_owned()
        } else {
            format!("held by node {}", ip_of(&holder.node.addr))
        };
        rows.push(vec![
            "address".into(),
            ip_of(&ip).to_string().into(),
            "".into(),
            held.into(),
        ]);
    }
    for (pod, entry) in hash::<Addr, EgressPod>(pins, maps::EGRESS_PODS, false)? {
        let count = (entry.count as usize).min(entry.ips.len());
        let ips: Vec<String> = entry.ips[..count]
            .iter()
            .map(|a| ip_of(a).to_string())
            .collect();
        let detail = if ips.is_empty() {
            "no address assigned: its traffic out is dropped"
        } else {
            "local pod, spread per flow"
        };
        rows.push(vec![
            "pod".into(),
            ip_of(&pod).to_string().into(),
            Cell::List(ips),
            detail.into(),
        ]);
    }
    for (pod, ip) in hash::<Addr, Addr>(pins, maps::EGRESS_SNAT, false)? {
        rows.push(vec![
            "translated".into(),
            ip_of(&pod).to_string().into(),
            ip_of(&ip).to_string().into(),
            "this node translates it".into(),
        ]);
    }
    for (key, value) in hash::<CtKey, EgressCtValue>(pins, maps::EGRESS_CT, true)? {
        let flow = format!(
            "{} -> {} {}",
            endpoint(&key.src, key.src_port_be),
            endpoint(&key.dst, key.dst_port_be),
            protocol(key.protocol)
        );
        let (kind, egress) = match key.direction {
            EGRESS_CT_CHOSEN => ("flow chose", ip_of(&value.addr).to_string()),
            EGRESS_CT_OUT => ("flow out", endpoint(&value.addr, value.port_be)),
            EGRESS_CT_IN => ("flow reply", endpoint(&value.addr, value.port_be)),
            _ => continue,
        };
        rows.push(vec![kind.into(), flow.into(), egress.into(), "".into()]);
    }
    rows.sort();
    Ok(rows)
}

fn endpoint_of(backends: &[Backend], id: u32) -> String {
    backends
        .iter()
        .find(|b| b.id == id)
        .map_or_else(|| "gone".into(), |b| endpoint(&b.addr, b.port_be))
}

fn prefix_row(key: &AclAddrKey, value: &AclAddrValue) -> Vec<Cell> {
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
    vec![
        "prefix".into(),
        prefix.into(),
        decision.into(),
        rule(value.rule).into(),
    ]
}

/// The rows of `dataplane inspect services`: every service port in the kernel's map, named
/// from what the agent wrote in its run directory (`described`: the Service, how topology
/// narrowed the endpoints, the health-check port's answer) where it wrote something.
pub fn services_rows(pins: &Pins, described: &crate::lb::Described) -> Result<Rows, AgentError> {
    let services = hash::<ServiceKey, ServiceValue>(pins, maps::LB_SERVICES, false)?;
    let mut backends = service_backends(pins, &services)?;
    let ranges = crate::lb::admitted_sources(pins)?;
    let at_socket = crate::lb::socket::attached(pins);
    let (columns, mut rows) = (
        vec![
            "ADDRESS",
            "PROTO",
            "SCOPE",
            "ID",
            "BACKENDS",
            "AFFINITY_S",
            "BACKEND_ADDRESSES",
            "SOURCE_RANGES",
            "SERVICE",
            "TOPOLOGY",
            "HEALTH_CHECK",
            "FROM_PODS",
        ],
        services
            .iter()
            .map(|(k, v)| {
                let scope = match k.scope {
                    SCOPE_NODEPORT => "nodeport",
                    SCOPE_NODEPORT_FROM_POD => "nodeport-from-pods",
                    SCOPE_EXTERNAL => "external",
                    _ => "cluster",
                };
                let about = described.ports.get(&crate::lb::described_key(k));
                let text = |f: fn(&crate::lb::DescribedPort) -> Option<&String>| {
                    Cell::Text(about.and_then(f).cloned().unwrap_or_default())
                };
                vec![
                    endpoint(&k.addr, k.port_be).into(),
                    protocol(k.protocol).into(),
                    scope.into(),
                    v.id.into(),
                    v.backends.into(),
                    v.affinity_timeout.into(),
                    Cell::List(backends.remove(&v.table).unwrap_or_default()),
                    // NodePorts are not subject to them.
                    Cell::List(match k.scope {
                        SCOPE_NODEPORT | SCOPE_NODEPORT_FROM_POD => Vec::new(),
                        _ => ranges
                            .get(&(k.addr, k.port_be, k.protocol))
                            .cloned()
                            .unwrap_or_default(),
                    }),
                    text(|p| Some(&p.name)),
                    text(|p| p.topology.as_ref()),
                    text(|p| p.health_check.as_ref()),
                    // Which path a pod's new flow to it takes (`--socket-lb`).
                    crate::lb::socket::pod_path(
                        k.scope,
                        v,
                        ranges.contains_key(&(k.addr, k.port_be, k.protocol)),
                        at_socket,
                    )
                    .into(),
                ]
            })
            .collect::<Vec<_>>(),
    );
    rows.sort();
    Ok(Rows { columns, rows })
}

/// The rows of `dataplane inspect multicast`: every group in the kernel's map with its local
/// members and member nodes, named from what the agent wrote in `run_dir` (ids, interface
/// indexes and addresses where it wrote nothing).
pub fn multicast_rows(pins: &Pins, run_dir: Option<&std::path::Path>) -> Result<Rows, AgentError> {
    let names: multicast::Described = run_dir
        .and_then(|dir| std::fs::read_to_string(dir.join(multicast::STATE_FILE)).ok())
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default();
    let namespace_of: BTreeMap<u32, &str> = names
        .namespaces
        .iter()
        .map(|(name, id)| (*id, name.as_str()))
        .collect();
    let groups: Vec<(McastKey, McastGroup)> = hash(pins, maps::MCAST_GROUPS, false)?;
    let mut rows: Vec<Vec<Cell>> = groups
        .iter()
        .map(|(key, group)| {
            let namespace = namespace_of
                .get(&key.namespace)
                .map_or_else(|| format!("{:#x}", key.namespace), |n| (*n).to_owned());
            let local = group.local[..(group.local_count as usize).min(MAX_LOCAL_MEMBERS)]
                .iter()
                .map(|i| {
                    names
                        .pods
                        .get(i)
                        .cloned()
                        .unwrap_or_else(|| format!("ifindex {i}"))
                })
                .collect();
            let remote = group.remote[..(group.remote_count as usize).min(MAX_REMOTE_MEMBERS)]
                .iter()
                .map(|e| {
                    let address = ip_of(&e.addr);
                    names
                        .nodes
                        .get(&address)
                        .cloned()
                        .unwrap_or_else(|| address.to_string())
                })
                .collect();
            vec![
                Cell::Text(namespace),
                Cell::Text(ip_of(&key.group).to_string()),
                Cell::List(local),
                Cell::List(remote),
            ]
        })
        .collect();
    rows.sort();
    Ok(Rows {
        columns: vec!["NAMESPACE", "GROUP", "LOCAL_MEMBERS", "MEMBER_NODES"],
        rows,
    })
}

/// The rows as aligned text columns.
pub fn render(rows: &Rows) -> String {
    let cells: Vec<Vec<String>> = rows
        .rows
        .iter()
        .map(|row| row.iter().map(ToString::to_string).collect())
        .collect();
    let mut widths: Vec<usize> = rows.columns.iter().map(|c| c.len()).collect();
    for row in &cells {
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
    for row in &cells {
        line(row.iter().map(String::as_str).collect(), &mut out);
    }
    out
}

/// Local pods' policy sets (which tiers and objects each holds) and the allowed flows with
/// the decisions that let them through: WHAT, WHO, DETAIL, STATE, DECIDED_BY.
fn policy_rows(pins: &Pins, rules: &BTreeMap<u32, SetRules>) -> Result<Vec<Vec<Cell>>, AgentError> {
    let endpoints = hash::<Addr, AclEndpoint>(pins, maps::ACL_ENDPOINTS, false)?;
    let set = |s: u32| {
        if s == 0 {
            "-".to_owned()
        } else {
            s.to_string()
        }
    };
    let mut rows: Vec<Vec<Cell>> = Vec::new();
    let mut sets = BTreeSet::new();
    for (address, endpoint) in endpoints.iter().filter(|(_, e)| e.policed()) {
        rows.push(vec![
            format!("pod {}", ip_of(address)).into(),
            format!("ingress set {}", set(endpoint.ingress)).into(),
            format!("egress set {}", set(endpoint.egress)).into(),
            "".into(),
            "".into(),
        ]);
        sets.extend(
            [endpoint.ingress, endpoint.egress]
                .into_iter()
                .filter(|s| *s != 0),
        );
    }
    for id in sets {
        let (who, objects, count) = match rules.get(&id) {
            Some(described) => (
                format!("{} {}", described.namespace, described.direction),
                described.objects.join("; "),
                format!("{} rules", described.rules.len()),
            ),
            None => ("".to_owned(), "(not described)".to_owned(), "".to_owned()),
        };
        rows.push(vec![
            format!("policy set {id}").into(),
            who.into(),
            objects.into(),
            count.into(),
            "".into(),
        ]);
    }
    let decisions = PolicyMaps::open(pins)?;
    for (k, v) in hash::<AclCtKey, AclCtValue>(pins, maps::ACL_CT, true)? {
        let port = |p: u16| p.to_be_bytes();
        let (src, dst) = (ip_of(&k.src), ip_of(&k.dst));
        let mut decided = Vec::new();
        if let Some(d) = decisions.decide(src, Direction::Egress, dst, k.protocol, k.dst_port) {
            decided.push(format!("egress: {}", d.describe(rules)));
        }
        if let Some(d) = decisions.decide(dst, Direction::Ingress, src, k.protocol, k.dst_port) {
            decided.push(format!("ingress: {}", d.describe(rules)));
        }
        rows.push(vec![
            "allowed flow".into(),
            format!(
                "{} -> {}",
                endpoint(&k.src, port(k.src_port)),
                endpoint(&k.dst, port(k.dst_port))
            )
            .into(),
            protocol(k.protocol).into(),
            format!(
                "last seen {} s{}{}",
                v.last_seen,
                if v.flags & ACL_CT_INBOUND != 0 {
                    ", inbound"
                } else {
                    ""
                },
                if v.flags & ACL_CT_CLOSING != 0 {
                    ", closing"
                } else {
                    ""
                }
            )
            .into(),
            decided.join("; ").into(),
        ]);
    }
    Ok(rows)
}

/// One row per pod veth counted in `POD_STATS`, with the pod's addresses (from `LOCAL_PODS`),
/// most drops first.
fn pod_rows(pins: &Pins) -> Result<Vec<Vec<Cell>>, AgentError> {
    use dataplane_common::stats::PodCounters;
    let data = pinned(pins, maps::POD_STATS)?;
    let counters: aya::maps::PerCpuHashMap<MapData, u32, PodCounters> =
        aya::maps::PerCpuHashMap::try_from(Map::PerCpuLruHashMap(data))
            .map_err(open_err(maps::POD_STATS, "open"))?;
    let mut addresses: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for (addr, pod) in hash::<Addr, LocalPod>(pins, maps::LOCAL_PODS, false)? {
        addresses
            .entry(pod.ifindex)
            .or_default()
            .push(ip_of(&addr).to_string());
    }
    let mut rows: Vec<(u64, u64, u32)> = counters
        .iter()
        .filter_map(Result::ok)
        .map(|(ifindex, per_cpu)| {
            let (drops, flows) = per_cpu
                .iter()
                .fold((0u64, 0u64), |(d, f), c| (d + c.drops, f + c.flows));
            (drops, flows, ifindex)
        })
        .collect();
    rows.sort_by(|a, b| b.cmp(a));
    Ok(rows
        .into_iter()
        .map(|(drops, flows, ifindex)| {
            vec![
                ifindex.into(),
                Cell::List(addresses.remove(&ifindex).unwrap_or_default()),
                Cell::Number(drops),
                Cell::Number(flows),
            ]
        })
        .collect())
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
            rows: vec![vec!["wide cell".into(), 7u32.into()]],
        };
        assert_eq!(render(&rows), "A          LONGER\nwide cell  7\n");
        // Numbers stay numbers in JSON, addresses and lists are strings.
        let rows = Rows {
            columns: vec!["ID", "BACKEND_ADDRESSES"],
            rows: vec![vec![
                3u32.into(),
                Cell::List(vec!["10.244.1.3:8080".into(), "[fd00::3]:8080".into()]),
            ]],
        };
        assert_eq!(
            rows.to_json(),
            serde_json::json!([{"id": 3, "backend_addresses": ["10.244.1.3:8080", "[fd00::3]:8080"]}])
        );
        assert_eq!(
            render(&rows),
            "ID  BACKEND_ADDRESSES\n3   10.244.1.3:8080,[fd00::3]:8080\n"
        );
        assert_eq!(rule(ACL_RULE_EXEMPT), "exempt");
        assert_eq!(protocol(132), "sctp");
    }
}
