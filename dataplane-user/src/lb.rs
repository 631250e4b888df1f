//! Service load-balancing, agent side: Services and EndpointSlices compiled (pure) into service
//! ports with their backends, Maglev tables built here, and the load-balancer maps synced in an
//! order packets can never see half-applied.
//!
//! What is compiled: every ClusterIP (all families of `spec.clusterIPs`), external IP and
//! load-balancer ingress IP of a Service, for each of its TCP, UDP and SCTP ports, as reached from
//! pods; and the NodePort of NodePort and LoadBalancer Services, once per address family, as
//! reached on this node's addresses from the underlay. Backends come from
//! the EndpointSlices labelled `kubernetes.io/service-name`, matched to the Service port by port
//! name; ready endpoints take new flows; serving-but-terminating ones only keep their
//! established flows (or take new ones when no endpoint is ready, as kube-proxy does).
//! Headless and ExternalName Services have nothing to balance. SCTP ports may differ from their
//! target ports: the kernel keeps SCTP's CRC32c right across the rewrite.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque},
    net::IpAddr,
    sync::Arc,
};

use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use dataplane_common::{
    lb::{
        AFFINITY_TIMEOUT_DEFAULT, AFFINITY_TIMEOUT_MAX, AFFINITY_TIMEOUT_MIN, AffinityKey,
        AffinityValue, BACKEND_PORTS_BASE, Backend, MAGLEV_TABLE_SIZE, MAX_BACKENDS_PER_SERVICE,
        MaglevTable, MemberKey, NODEPORT_ANY_V4, PORT_BITMAP_WORDS, SCOPE_CLUSTER, SCOPE_EXTERNAL,
        SCOPE_NODEPORT, SERVICE_PORTS_BASE, SNAT_LOW_PORT_MAX, SNAT_LOW_PORT_MIN, SNAT_PORT_MAX,
        SNAT_PORT_MIN, ServiceKey, ServiceValue, backend_slot, next_backend_id, port_bit,
    },
    maps::{self, MAX_AFFINITY_MEMBERS},
    overlay::{FAMILY_IPV4, FAMILY_IPV6},
};
use k8s_openapi::api::{
    core::v1::{Service, ServicePort as K8sServicePort},
    discovery::v1::{Endpoint, EndpointSlice},
};

use ipnet::IpNet;

use crate::{
    AgentError, Dataplane,
    mapsync::{addr16, map_err},
    source::{Objects, slice_service},
};

mod cache;
pub use cache::ServiceCache;

/// One backend address and target port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BackendAddr {
    pub ip: IpAddr,
    pub port: u16,
}

impl std::fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.ip {
            IpAddr::V4(ip) => write!(f, "{ip}:{}", self.port),
            IpAddr::V6(ip) => write!(f, "[{ip}]:{}", self.port),
        }
    }
}

/// What kind of Service address a port was compiled for: when two Services claim one key, the
/// lower kind holds it (a ClusterIP, which the API server allocates, over an external or
/// load-balancer address a Service names for itself), then the first Service by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AddressKind {
    ClusterIp,
    NodePort,
    /// `spec.externalIPs` and `status.loadBalancer.ingress[].ip`.
    External,
}

/// Which addresses, besides its cluster IPs, a Service may take (CVE-2020-8554: a tenant who
/// may create Services could otherwise name another's address as an external IP and take its
/// traffic, the cluster DNS's say).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AddressPolicy {
    /// `spec.externalIPs` are honoured only inside these (`--external-ip-cidrs`); none by
    /// default, as the API server's DenyServiceExternalIPs admission plugin advises.
    pub external_ip_cidrs: Vec<IpNet>,
    /// No external or load-balancer address may be inside these: the service networks, the
    /// cluster (pod) networks, the hybrid overlay's.
    pub reserved_networks: Vec<IpNet>,
    /// No external IP may be a node's address (it would take the node's own ports, the
    /// kubelet's among them). Load-balancer addresses may: some load balancers (k3s'
    /// ServiceLB) publish the nodes' addresses.
    pub node_addresses: BTreeSet<IpAddr>,
}

impl AddressPolicy {
    /// Why `ip`, given as `field` of a Service, is not honoured; `None` when it is.
    fn refuses(&self, ip: IpAddr, field: &str) -> Option<String> {
        let external_ip = field == EXTERNAL_IPS;
        if special_address(ip) {
            return Some(format!(
                "{ip} is an unspecified, loopback, link-local, multicast or broadcast address"
            ));
        }
        if let Some(net) = self.reserved_networks.iter().find(|n| n.contains(&ip)) {
            return Some(format!(
                "{ip} is inside the cluster's own network {net} (service or pod addresses)"
            ));
        }
        if external_ip && self.node_addresses.contains(&ip) {
            return Some(format!("{ip} is a node's address"));
        }
        if external_ip && !self.external_ip_cidrs.iter().any(|n| n.contains(&ip)) {
            return Some(if self.external_ip_cidrs.is_empty() {
                format!(
                    "{ip}: external IPs are not honoured on this cluster (the agent's --external-ip-cidrs is empty)"
                )
            } else {
                format!("{ip} is outside the agent's --external-ip-cidrs")
            });
        }
        None
    }
}

/// Addresses no Service may claim but as a cluster IP.
fn special_address(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            v4.is_unspecified()
                || v4.is_loopback()
                || v4.is_link_local()
                || v4.is_multicast()
                || v4.is_broadcast()
        }
        IpAddr::V6(v6) => {
            v6.is_unspecified()
                || v6.is_loopback()
                || v6.is_multicast()
                || v6.is_unicast_link_local()
                || v6.to_ipv4_mapped().is_some()
        }
    }
}

const EXTERNAL_IPS: &str = "spec.externalIPs";
const CLUSTER_IPS: &str = "spec.clusterIPs";
const INGRESS_IPS: &str = "status.loadBalancer.ingress[].ip";

/// One address + port + protocol of a Service, with its backends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    /// `namespace/name:port` for logs and status.
    pub name: String,
    /// Which of the Service's addresses this is (decides who holds a key two Services claim).
    pub kind: AddressKind,
    pub key: ServiceKey,
    /// ClientIP affinity timeout in seconds; 0 without affinity.
    pub affinity_timeout: u32,
    /// Backends new flows may go to (sorted).
    pub ready: Vec<BackendAddr>,
    /// Serving-but-terminating backends: they keep their established flows only (sorted).
    pub terminating: Vec<BackendAddr>,
}

/// What compiling the Services gave: the service ports, and one message per refused Service
/// or skipped port naming the object and field.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompiledServices {
    pub ports: Vec<ServicePort>,
    pub errors: Vec<String>,
}

/// A Service's namespace and name.
pub type ServiceName = (String, String);

/// One Service's compiled ports and the addresses of it that were not honoured (each message
/// names the Service, the field and why), or why the whole Service was refused.
pub type CompiledService = Result<ServiceCompiled, String>;

/// What compiling one Service gave.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceCompiled {
    pub ports: Vec<ServicePort>,
    /// Its external or load-balancer addresses the [`AddressPolicy`] refused.
    pub refused: Vec<String>,
}

/// Compiles every Service with its EndpointSlices into the service ports of node `node`
/// (pure): `internalTrafficPolicy: Local` and `externalTrafficPolicy: Local` keep only the
/// endpoints on this node; external and load-balancer addresses as `policy` allows.
pub fn compile_services(
    services: &Objects<Service>,
    slices: &Objects<EndpointSlice>,
    node: &str,
    policy: &AddressPolicy,
) -> CompiledServices {
    assemble(compile_each(services, slices, node, policy, |_| true).values())
}

/// Compiles the Services `wanted` picks (by namespace and name), each with its own
/// EndpointSlices: what a change to a few Services or slices recompiles.
pub fn compile_each<'a>(
    services: impl IntoIterator<Item = &'a Arc<Service>>,
    slices: impl IntoIterator<Item = &'a Arc<EndpointSlice>>,
    node: &str,
    policy: &AddressPolicy,
    wanted: impl Fn(&(&str, &str)) -> bool + Sync,
) -> BTreeMap<ServiceName, CompiledService> {
    // Slices by namespace and service name, found once: per-service scans would make the
    // compile quadratic in the number of services.
    let mut by_service: HashMap<(&str, &str), Vec<&EndpointSlice>> = HashMap::new();
    for slice in slices {
        if let Some(key) = slice_service(slice).filter(&wanted) {
            by_service.entry(key).or_default().push(slice);
        }
    }
    let wanted: Vec<((&str, &str), &Service)> = services
        .into_iter()
        .map(|service| {
            let key = (
                service.metadata.namespace.as_deref().unwrap_or("default"),
                service.metadata.name.as_deref().unwrap_or("<unnamed>"),
            );
            (key, &**service)
        })
        .filter(|(key, _)| wanted(key))
        .collect();
    let compile = |&(key, service): &((&str, &str), &Service)| {
        let own_slices = by_service.get(&key).map(Vec::as_slice).unwrap_or_default();
        (
            (key.0.to_owned(), key.1.to_owned()),
            compile_service(service, own_slices, node, policy),
        )
    };
    // A full compile (10,000 Services) on every core; a change's few here.
    crate::parallel::map(&wanted, SERVICES_PER_TASK, compile)
        .into_iter()
        .collect()
}

/// Services compiled by one task of [`compile_each`]: a Service is about 10 us.
const SERVICES_PER_TASK: usize = 256;

/// The service ports of compiled Services, in key order. Two Services claiming one address
/// and port: a cluster IP keeps it over an external or load-balancer address, then the first
/// in namespace and name order; the other's port is refused.
pub fn assemble<'a>(compiled: impl Iterator<Item = &'a CompiledService>) -> CompiledServices {
    let mut out = CompiledServices::default();
    for service in compiled {
        match service {
            Ok(compiled) => {
                out.ports.extend(compiled.ports.iter().cloned());
                out.errors.extend(compiled.refused.iter().cloned());
            }
            Err(error) => out.errors.push(error.clone()),
        }
    }
    // Stable: among the ports of one key, the lowest kind, then the first Service by name.
    out.ports.sort_by_key(|p| (p.key, p.kind));
    let mut seen = BTreeSet::new();
    let mut unique = Vec::new();
    for port in out.ports {
        if seen.insert(port.key) {
            unique.push(port);
        } else {
            out.errors.push(key_taken(&port));
        }
    }
    out.ports = unique;
    out
}

/// Why `port` is refused: another Service's port holds its key. The line names the Service
/// (`Service <namespace>/<name>: ...`), as every refusal does.
pub fn key_taken(port: &ServicePort) -> String {
    let (service, rest) = port.name.split_once(':').unwrap_or((&port.name, ""));
    format!("Service {service}: port {rest}: address and port already used by another Service")
}

/// One Service's ports; `Err` refuses the whole Service.
fn compile_service(
    service: &Service,
    own_slices: &[&EndpointSlice],
    node: &str,
    policy: &AddressPolicy,
) -> CompiledService {
    let namespace = service.metadata.namespace.as_deref().unwrap_or("default");
    let name = service.metadata.name.as_deref().unwrap_or("<unnamed>");
    let id = format!("Service {namespace}/{name}");
    let Some(spec) = &service.spec else {
        return Ok(ServiceCompiled::default());
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return Ok(ServiceCompiled::default());
    }
    let affinity_timeout = affinity_timeout(service).map_err(|e| format!("{id}: {e}"))?;
    let internal_local = spec.internal_traffic_policy.as_deref() == Some("Local");
    let external_local = spec.external_traffic_policy.as_deref() == Some("Local");
    let node_ports = matches!(spec.type_.as_deref(), Some("NodePort" | "LoadBalancer"));
    let (addresses, refused) =
        service_addresses(service, policy).map_err(|e| format!("{id}: {e}"))?;
    let mut refused: Vec<String> = refused
        .into_iter()
        .map(|why| format!("{id}: {why}; that address is not served"))
        .collect();
    refused.extend(
        own_slices
            .iter()
            .flat_map(|slice| unusable_endpoints(slice)),
    );
    let mut ports = Vec::new();
    for (index, port) in spec.ports.iter().flatten().enumerate() {
        let field = format!("{id}: spec.ports[{index}]");
        let protocol = match port.protocol.as_deref().unwrap_or("TCP") {
            "TCP" => 6,
            "UDP" => 17,
            "SCTP" => 132,
            other => {
                return Err(format!(
                    "{field}.protocol: {other:?} is not TCP, UDP or SCTP"
                ));
            }
        };
        let number = u16::try_from(port.port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| format!("{field}.port: {} is not a port", port.port))?;
        let port_name = format!(
            "{namespace}/{name}:{}",
            port.name.as_deref().unwrap_or(&number.to_string())
        );
        // Cluster IPs (ITP applies), external and load-balancer IPs reached from pods, and the
        // latter again as reached from outside (ETP applies).
        let mut keys: Vec<(ServiceKey, AddressKind, IpAddr, bool, String)> = Vec::new();
        for &(address, cluster_ip) in &addresses {
            let key = ServiceKey {
                addr: addr16(address),
                port_be: number.to_be_bytes(),
                protocol,
                scope: SCOPE_CLUSTER,
            };
            let kind = if cluster_ip {
                AddressKind::ClusterIp
            } else {
                AddressKind::External
            };
            keys.push((
                key,
                kind,
                address,
                cluster_ip && internal_local,
                port_name.clone(),
            ));
            if !cluster_ip {
                let key = ServiceKey {
                    scope: SCOPE_EXTERNAL,
                    ..key
                };
                let name = format!("{port_name} (external {address})");
                keys.push((key, kind, address, external_local, name));
            }
        }
        // The NodePort, once per address family of the Service (ETP applies).
        if let Some(node_port) = port.node_port.filter(|_| node_ports) {
            let node_port = u16::try_from(node_port)
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| format!("{field}.nodePort: {node_port} is not a port"))?;
            let families: BTreeSet<bool> = addresses.iter().map(|(a, _)| a.is_ipv4()).collect();
            for ipv4 in families {
                let (addr, any) = if ipv4 {
                    (NODEPORT_ANY_V4, IpAddr::from([0u8; 4]))
                } else {
                    ([0; 16], IpAddr::from([0u8; 16]))
                };
                let key = ServiceKey {
                    addr,
                    port_be: node_port.to_be_bytes(),
                    protocol,
                    scope: SCOPE_NODEPORT,
                };
                keys.push((
                    key,
                    AddressKind::NodePort,
                    any,
                    external_local,
                    format!("{port_name} (NodePort {node_port})"),
                ));
            }
        }
        for (key, kind, address, local_only, port_name) in keys {
            let local = local_only.then_some(node);
            let (ready, terminating) = endpoints_for(own_slices, port, address, protocol, local);
            if ready.len() + terminating.len() > MAX_BACKENDS_PER_SERVICE {
                return Err(format!(
                    "{field}: {} endpoints, more than the {MAX_BACKENDS_PER_SERVICE} one service port may have",
                    ready.len() + terminating.len()
                ));
            }
            ports.push(ServicePort {
                name: port_name,
                kind,
                key,
                affinity_timeout,
                ready,
                terminating,
            });
        }
    }
    Ok(ServiceCompiled { ports, refused })
}

/// The endpoint addresses of `slice` that are not addresses of its `addressType`, one line
/// each: skipped, the slice's other endpoints kept.
fn unusable_endpoints(slice: &EndpointSlice) -> Vec<String> {
    let namespace = slice.metadata.namespace.as_deref().unwrap_or("default");
    let name = slice.metadata.name.as_deref().unwrap_or("<unnamed>");
    let ipv4 = match slice.address_type.as_str() {
        "IPv4" => true,
        "IPv6" => false,
        // FQDN slices carry names, which no kube-proxy balances to.
        _ => return Vec::new(),
    };
    let mut lines = Vec::new();
    for (e, endpoint) in slice.endpoints.iter().enumerate() {
        for (a, address) in endpoint.addresses.iter().enumerate() {
            let usable = address
                .parse::<IpAddr>()
                .is_ok_and(|ip| ip.is_ipv4() == ipv4);
            if !usable {
                lines.push(format!(
                    "EndpointSlice {namespace}/{name}: endpoints[{e}].addresses[{a}]: {address:?} is not an {} address; that endpoint is skipped",
                    slice.address_type
                ));
            }
        }
    }
    lines
}

/// `sessionAffinity: ClientIP` with `sessionAffinityConfig.clientIP.timeoutSeconds`
/// (1 to 86400, default 10800); 0 without affinity.
fn affinity_timeout(service: &Service) -> Result<u32, String> {
    let Some(spec) = &service.spec else {
        return Ok(0);
    };
    match spec.session_affinity.as_deref().unwrap_or("None") {
        "None" => Ok(0),
        "ClientIP" => {
            let configured = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            match configured {
                None => Ok(AFFINITY_TIMEOUT_DEFAULT),
                Some(t)
                    if (AFFINITY_TIMEOUT_MIN as i32..=AFFINITY_TIMEOUT_MAX as i32).contains(&t) =>
                {
                    Ok(t as u32)
                }
                Some(t) => Err(format!(
                    "spec.sessionAffinityConfig.clientIP.timeoutSeconds: {t} is outside \
                     {AFFINITY_TIMEOUT_MIN}..={AFFINITY_TIMEOUT_MAX}"
                )),
            }
        }
        other => Err(format!(
            "spec.sessionAffinity: {other:?} is not None or ClientIP"
        )),
    }
}

/// A Service's address, and whether it is a cluster IP.
type ServiceAddress = (IpAddr, bool);

/// Every address clients reach the Service on: cluster IPs (both families), external IPs and
/// load-balancer ingress IPs (those `policy` honours; why each other is not, second), each
/// with whether it is a cluster IP. A headless Service has none.
fn service_addresses(
    service: &Service,
    policy: &AddressPolicy,
) -> Result<(Vec<ServiceAddress>, Vec<String>), String> {
    let mut texts: Vec<(String, &str)> = Vec::new();
    if let Some(spec) = &service.spec {
        let cluster_ips = spec
            .cluster_ips
            .clone()
            .or_else(|| spec.cluster_ip.clone().map(|ip| vec![ip]))
            .unwrap_or_default();
        texts.extend(
            cluster_ips
                .into_iter()
                .filter(|ip| ip != "None" && !ip.is_empty())
                .map(|ip| (ip, CLUSTER_IPS)),
        );
        texts.extend(
            spec.external_ips
                .iter()
                .flatten()
                .map(|ip| (ip.clone(), EXTERNAL_IPS)),
        );
    }
    if let Some(status) = &service.status {
        let ingress = status
            .load_balancer
            .as_ref()
            .and_then(|lb| lb.ingress.as_ref());
        texts.extend(
            ingress
                .into_iter()
                .flatten()
                .filter_map(|i| i.ip.clone())
                .map(|ip| (ip, INGRESS_IPS)),
        );
    }
    let mut addresses: Vec<ServiceAddress> = Vec::new();
    let mut refused = Vec::new();
    for (text, field) in texts {
        let ip: IpAddr = text
            .parse()
            .map_err(|_| format!("{field}: {text:?} is not an IP address"))?;
        let cluster_ip = field == CLUSTER_IPS;
        if addresses.iter().any(|(a, _)| *a == ip) {
            continue;
        }
        if !cluster_ip && let Some(why) = policy.refuses(ip, field) {
            refused.push(format!("{field}: {why}"));
            continue;
        }
        addresses.push((ip, cluster_ip));
    }
    Ok((addresses, refused))
}

/// Ready and serving-but-terminating backends of one Service port on one address family; with
/// `local_node`, only the endpoints on that node.
fn endpoints_for(
    slices: &[&EndpointSlice],
    port: &K8sServicePort,
    address: IpAddr,
    protocol: u8,
    local_node: Option<&str>,
) -> (Vec<BackendAddr>, Vec<BackendAddr>) {
    let family = if address.is_ipv4() { "IPv4" } else { "IPv6" };
    let protocol_name = match protocol {
        6 => "TCP",
        17 => "UDP",
        _ => "SCTP",
    };
    let mut ready = BTreeSet::new();
    let mut terminating = BTreeSet::new();
    for slice in slices.iter().filter(|s| s.address_type == family) {
        // The slice port with the Service port's name (both unnamed for a single-port
        // Service) carries the target port, named target ports already resolved.
        let Some(target) = slice
            .ports
            .iter()
            .flatten()
            .find(|p| {
                p.name.as_deref().unwrap_or("") == port.name.as_deref().unwrap_or("")
                    && p.protocol.as_deref().unwrap_or("TCP") == protocol_name
            })
            .and_then(|p| p.port)
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0)
        else {
            continue;
        };
        for endpoint in &slice.endpoints {
            if local_node.is_some_and(|node| endpoint.node_name.as_deref() != Some(node)) {
                continue;
            }
            let Some(state) = endpoint_state(endpoint) else {
                continue;
            };
            for ip in endpoint
                .addresses
                .iter()
                .filter_map(|a| a.parse::<IpAddr>().ok())
            {
                if ip.is_ipv4() != address.is_ipv4() {
                    continue;
                }
                let backend = BackendAddr { ip, port: target };
                match state {
                    EndpointState::Ready => ready.insert(backend),
                    EndpointState::Terminating => terminating.insert(backend),
                };
            }
        }
    }
    // kube-proxy's rule: with no ready endpoint, serving-terminating ones take new flows.
    if ready.is_empty() {
        return (terminating.into_iter().collect(), Vec::new());
    }
    let terminating = terminating.difference(&ready).copied().collect();
    (ready.into_iter().collect(), terminating)
}

enum EndpointState {
    Ready,
    Terminating,
}

/// Ready (unset counts as ready), serving-but-terminating, or neither (`None`).
fn endpoint_state(endpoint: &Endpoint) -> Option<EndpointState> {
    let conditions = endpoint.conditions.as_ref();
    let ready = conditions.and_then(|c| c.ready).unwrap_or(true);
    let terminating = conditions.and_then(|c| c.terminating).unwrap_or(false);
    let serving = conditions.and_then(|c| c.serving).unwrap_or(ready);
    if ready && !terminating {
        Some(EndpointState::Ready)
    } else if serving && terminating {
        Some(EndpointState::Terminating)
    } else {
        None
    }
}

/// FNV-1a (64-bit) of `bytes` from `seed`: a hash stable across builds and restarts, so a
/// restarted agent rebuilds the same Maglev tables.
fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(seed, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The ids of `port`'s ready backends (allocated before).
fn ready_ids(state: &LbState, port: &ServicePort) -> Vec<u32> {
    port.ready.iter().map(|b| state.backend_ids[b]).collect()
}

/// The Maglev table of `port`, whose ready backends have the ids `ready`.
fn port_table(ready: &[u32], port: &ServicePort) -> Vec<u32> {
    let pairs: Vec<(u32, BackendAddr)> = ready
        .iter()
        .copied()
        .zip(port.ready.iter().copied())
        .collect();
    maglev_table(&pairs)
}

/// One port of a plan as [`new_tables`] prepared it: its ready backends' ids, and their
/// Maglev table unless the port installed before the plan has the same ready backends (its
/// table stays).
struct PreparedPort {
    ready: Vec<u32>,
    table: Option<Vec<u32>>,
}

/// [`PreparedPort`] of each of `ports`. Built on every core (`rayon`): a first sync builds
/// 10,000 tables, a fifth of it on one core.
fn new_tables(state: &LbState, ports: &[&ServicePort]) -> Vec<PreparedPort> {
    let build = |port: &&ServicePort| {
        let ready = ready_ids(state, port);
        let same = state
            .installed
            .get(&port.key)
            .is_some_and(|installed| installed.ready == ready);
        let table = (!same).then(|| port_table(&ready, port));
        PreparedPort { ready, table }
    };
    // A table is about 30 us; handing work to the pool and waiting for it about as much.
    crate::parallel::map(ports, TABLES_PER_TASK, build)
}

/// Maglev tables built by one task of [`new_tables`].
const TABLES_PER_TASK: usize = 64;

/// The Maglev lookup table (Eisenbud et al., NSDI 2016) of `backends`: each backend walks its
/// own permutation of the slots and they take turns claiming free slots, so every backend gets
/// about M/N slots and removing one backend moves about 1/N of the slots. The result depends
/// only on the set of backends, not their order.
pub fn maglev_table(backends: &[(u32, BackendAddr)]) -> Vec<u32> {
    let m = MAGLEV_TABLE_SIZE as u64;
    let mut sorted: Vec<&(u32, BackendAddr)> = backends.iter().collect();
    sorted.sort_by_key(|(_, b)| *b);
    let mut table = vec![u32::MAX; MAGLEV_TABLE_SIZE];
    if sorted.is_empty() {
        return vec![0; MAGLEV_TABLE_SIZE];
    }
    let permutations: Vec<(u64, u64)> = sorted
        .iter()
        .map(|(_, backend)| maglev_permutation(backend))
        .collect();
    // Each backend's next slot of its permutation, `(offset + j * skip) % m` for its j-th
    // choice, moved on by one addition: a division a probe made the fill of 10,000 tables
    // a fifth of a large cluster's first sync.
    let mut slots: Vec<u64> = permutations.iter().map(|&(offset, _)| offset).collect();
    let mut filled = 0;
    'fill: loop {
        for (i, &(_, skip)) in permutations.iter().enumerate() {
            let mut slot = slots[i];
            while table[slot as usize] != u32::MAX {
                slot = next_slot(slot, skip, m);
            }
            table[slot as usize] = sorted[i].0;
            slots[i] = next_slot(slot, skip, m);
            filled += 1;
            if filled == MAGLEV_TABLE_SIZE {
                break 'fill;
            }
        }
    }
    table
}

/// A backend's Maglev permutation, `(offset, skip)`: its j-th choice of slot is
/// `(offset + j * skip) % MAGLEV_TABLE_SIZE`, both taken from hashes of its address.
fn maglev_permutation(backend: &BackendAddr) -> (u64, u64) {
    let m = MAGLEV_TABLE_SIZE as u64;
    let name = backend.to_string();
    let offset = fnv1a(0xcbf2_9ce4_8422_2325, name.as_bytes()) % m;
    let skip = fnv1a(0x8422_2325_cbf2_9ce4, name.as_bytes()) % (m - 1) + 1;
    (offset, skip)
}

/// The live backends of the array's `slots`, by id.
fn live_by_id(slots: Vec<(u32, Backend)>) -> HashMap<u32, Backend> {
    slots
        .into_iter()
        .map(|(_, b)| b)
        .filter(|b| b.is_live(b.id))
        .map(|b| (b.id, b))
        .collect()
}

/// The slot after `slot` in a permutation of stride `skip` over `m` slots (both below `m`).
fn next_slot(slot: u64, skip: u64, m: u64) -> u64 {
    let next = slot + skip;
    if next >= m { next - m } else { next }
}

/// What this agent has written to the load-balancer maps, so a sync writes only differences.
#[derive(Debug, Default)]
pub struct LbState {
    backend_ids: HashMap<BackendAddr, u32>,
    /// The last id each slot of the backends array held (index: slot), live or removed, for
    /// every slot used so far.
    slot_ids: Vec<u32>,
    /// Slots free again, longest free first. Reused only once every slot has been used, and
    /// then in that order, so each slot's generation turns over as slowly as it can.
    free_slots: VecDeque<u32>,
    installed: BTreeMap<ServiceKey, Installed>,
    /// Service-port ids below `next_service_id` given back by removed service ports.
    free_service_ids: Vec<u32>,
    next_service_id: u32,
    /// The port bitmaps as last written (read from the map on the first sync).
    port_words: Option<Vec<u64>>,
    /// The backends map as last written (read from the map on the first sync), so that a
    /// sync compares in memory instead of reading every backend back.
    backends: Option<HashMap<u32, Backend>>,
    /// The membership map as last written (read from the map on the first sync).
    members: Option<BTreeSet<MemberKey>>,
    /// How many installed service ports reference each backend id (ready or terminating):
    /// a backend goes when its count does.
    backend_refs: HashMap<u32, u32>,
    /// How many times the installed service ports mark each bit of the port bitmaps (by bit
    /// number, `word * 64 + bit`), so that a sync of a few ports makes the bitmaps from
    /// theirs instead of from every port and backend (10,000 ports, 100,000 backends: most
    /// of an endpoint change's time). `None`: counted again from the installed ports (after a
    /// full sync or a failed one).
    bit_users: Option<HashMap<u32, u32>>,
}

/// What one load-balancer sync writes: the ports to install (new or different), the keys to
/// remove, how many ports there are in all, and the port bitmaps of them all.
struct SyncPlan<'a> {
    changed: Vec<&'a ServicePort>,
    removed: Vec<ServiceKey>,
    ports: usize,
    words: Vec<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Installed {
    value: ServiceValue,
    /// Ready backend ids in the live table.
    ready: Vec<u32>,
    /// Every backend id the port references (ready and terminating).
    referenced: Vec<u32>,
    /// The port as installed; `None` when adopted from a previous agent (unknown: the first
    /// sync installs it again).
    port: Option<ServicePort>,
}

impl Installed {
    /// The port's (service, backend) members: its ready backends, with ClientIP affinity.
    fn members(&self) -> impl Iterator<Item = MemberKey> + '_ {
        let service_id = self.value.id;
        self.ready
            .iter()
            .filter(move |_| self.value.affinity_timeout != 0)
            .map(move |&backend_id| MemberKey {
                service_id,
                backend_id,
            })
    }
}

/// Entries written and removed by one sync.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LbSyncStats {
    pub services: usize,
    pub backends: usize,
    pub written: usize,
    pub deleted: usize,
}

impl LbState {
    /// The id of a backend, allocated on first use: a slot of the backends array and that
    /// slot's next generation, so a conntrack or affinity entry naming an earlier backend of
    /// the slot never matches it. None when every one of the `capacity` slots is taken.
    fn backend_id(&mut self, backend: BackendAddr, capacity: u32) -> Option<u32> {
        if let Some(&id) = self.backend_ids.get(&backend) {
            return Some(id);
        }
        let used = self.slot_ids.len() as u32;
        let id = if used < capacity {
            let id = next_backend_id(used, 0);
            self.slot_ids.push(id);
            id
        } else {
            let slot = self.free_slots.pop_front()?;
            let id = next_backend_id(slot, self.slot_ids[slot as usize]);
            self.slot_ids[slot as usize] = id;
            id
        };
        self.backend_ids.insert(backend, id);
        Some(id)
    }

    /// Gives ids to the backends of `changed` that have none, before anything is written.
    /// When the slots run out, the ids given here are taken back and the error says how many
    /// backends `all` needs.
    fn allocate_backend_ids(
        &mut self,
        changed: &[&ServicePort],
        capacity: u32,
    ) -> Result<(), AgentError> {
        let mut fresh = Vec::new();
        for port in changed {
            for &backend in port.ready.iter().chain(&port.terminating) {
                if self.backend_ids.contains_key(&backend) {
                    continue;
                }
                match self.backend_id(backend, capacity) {
                    Some(id) => fresh.push((backend, id)),
                    None => {
                        for (backend, id) in fresh {
                            self.backend_ids.remove(&backend);
                            self.free_slots.push_front(backend_slot(id));
                        }
                        // Those of the kept ports and those of the changed ones.
                        let mut needed: BTreeSet<BackendAddr> =
                            self.backend_ids.keys().copied().collect();
                        needed.extend(
                            changed
                                .iter()
                                .flat_map(|p| p.ready.iter().chain(&p.terminating)),
                        );
                        return Err(AgentError::Capacity {
                            what: "backends",
                            needed: needed.len(),
                            map: maps::LB_BACKENDS,
                            limit: capacity,
                            flag: "--max-backends",
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether `port` is not installed as it is.
    fn differs(&self, port: &ServicePort) -> bool {
        self.installed
            .get(&port.key)
            .and_then(|i| i.port.as_ref())
            .is_none_or(|installed| installed != port)
    }

    /// The ids (given) and addresses of every backend a port references.
    fn referenced_ids(&self, port: &ServicePort) -> Vec<(u32, BackendAddr)> {
        port.ready
            .iter()
            .chain(&port.terminating)
            .map(|b| (self.backend_ids[b], *b))
            .collect()
    }

    fn add_refs(&mut self, referenced: &[(u32, BackendAddr)]) {
        for (id, _) in referenced {
            *self.backend_refs.entry(*id).or_default() += 1;
        }
    }

    /// Takes back one reference to each of `ids`; returns those nothing references now.
    fn drop_refs(&mut self, ids: &[u32]) -> Vec<u32> {
        let mut unreferenced = Vec::new();
        for id in ids {
            if let Some(count) = self.backend_refs.get_mut(id) {
                *count -= 1;
                if *count == 0 {
                    self.backend_refs.remove(id);
                    unreferenced.push(*id);
                }
            }
        }
        unreferenced
    }

    /// Counts the references again from what is installed (after adoption or a failure).
    fn count_backend_refs(&mut self) {
        self.backend_refs.clear();
        for id in self.installed.values().flat_map(|i| &i.referenced) {
            *self.backend_refs.entry(*id).or_default() += 1;
        }
    }

    /// Forgets a backend's id: its slot is free from now on.
    fn release_backend(&mut self, id: u32) {
        self.backend_ids.retain(|_, held| *held != id);
        self.free_slots.push_back(backend_slot(id));
    }

    /// Forgets every id no installed port references.
    fn release_backends_without_refs(&mut self) {
        let (refs, free_slots) = (&self.backend_refs, &mut self.free_slots);
        self.backend_ids.retain(|_, &mut id| {
            let keep = refs.contains_key(&id);
            if !keep {
                free_slots.push_back(backend_slot(id));
            }
            keep
        });
    }

    /// Records a backends array slot as read from the pinned map.
    fn adopt_slot(&mut self, slot: u32, backend: &Backend) {
        if backend.id == 0 {
            return;
        }
        let slot = slot as usize;
        if self.slot_ids.len() <= slot {
            self.slot_ids.resize(slot + 1, 0);
        }
        self.slot_ids[slot] = backend.id;
        if backend.is_live(backend.id) {
            self.backend_ids.insert(backend_addr(backend), backend.id);
        }
    }

    /// After adoption: every used slot that holds no live backend is free.
    fn free_unused_slots(&mut self) {
        let live: HashSet<u32> = self.backend_ids.values().copied().collect();
        self.free_slots = (0..self.slot_ids.len() as u32)
            .filter(|&slot| !live.contains(&self.slot_ids[slot as usize]))
            .collect();
    }

    /// The id of the backend `backend` in the maps, if this agent wrote it.
    pub fn id_of(&self, backend: BackendAddr) -> Option<u32> {
        self.backend_ids.get(&backend).copied()
    }

    /// An unused service-port id of the `capacity` (its tables are at `2 * id` and
    /// `2 * id + 1`).
    fn allocate_service_id(&mut self, capacity: u32) -> Option<u32> {
        if let Some(id) = self.free_service_ids.pop() {
            return Some(id);
        }
        let id = self.next_service_id;
        if id >= capacity {
            return None;
        }
        self.next_service_id += 1;
        Some(id)
    }

    /// Records an id found in use (adopted from pins).
    fn mark_service_id_used(&mut self, id: u32) {
        while self.next_service_id <= id {
            self.free_service_ids.push(self.next_service_id);
            self.next_service_id += 1;
        }
        self.free_service_ids.retain(|&free| free != id);
    }
}

fn backend_value(backend: BackendAddr, id: u32) -> Backend {
    Backend {
        addr: addr16(backend.ip),
        port_be: backend.port.to_be_bytes(),
        family: if backend.ip.is_ipv4() {
            FAMILY_IPV4
        } else {
            FAMILY_IPV6
        },
        _pad: 0,
        id,
    }
}

/// The slot of a removed backend: its id kept (its generation is remembered), marked gone.
fn removed_backend(id: u32) -> Backend {
    Backend {
        id,
        ..Backend::default()
    }
}

/// The address and port a live backends-array entry holds.
fn backend_addr(backend: &Backend) -> BackendAddr {
    let ip = if backend.family == FAMILY_IPV4 {
        let a = backend.addr;
        IpAddr::from([a[12], a[13], a[14], a[15]])
    } else {
        IpAddr::from(backend.addr)
    };
    BackendAddr {
        ip,
        port: u16::from_be_bytes(backend.port_be),
    }
}

/// The bits (`word * 64 + bit`) a service port marks in the port bitmaps: its own port's, and
/// each of its backends' (once per backend).
fn port_bit_numbers(port: &ServicePort) -> impl Iterator<Item = u32> + '_ {
    let own = port_bit(SERVICE_PORTS_BASE, u16::from_be_bytes(port.key.port_be));
    let backends = port
        .ready
        .iter()
        .chain(&port.terminating)
        .map(|backend| port_bit(BACKEND_PORTS_BASE, backend.port));
    std::iter::once(own)
        .chain(backends)
        .map(|(word, bit)| word * 64 + bit.trailing_zeros())
}

/// How many times `ports` mark each bit of the port bitmaps.
fn count_port_bits<'a>(ports: impl Iterator<Item = &'a ServicePort>) -> HashMap<u32, u32> {
    let mut users = HashMap::new();
    for port in ports {
        for bit in port_bit_numbers(port) {
            *users.entry(bit).or_default() += 1;
        }
    }
    users
}

/// The port bitmaps' words with `bits` set.
fn words_with(bits: impl Iterator<Item = u32>) -> Vec<u64> {
    let mut words = vec![0u64; (PORT_BITMAP_WORDS * 2) as usize];
    for bit in bits {
        words[(bit / 64) as usize] |= 1 << (bit % 64);
    }
    words
}

/// The port bitmaps' words with the bits `users` counts set.
fn bitmap_words(users: &HashMap<u32, u32>) -> Vec<u64> {
    words_with(users.iter().filter(|(_, n)| **n > 0).map(|(bit, _)| *bit))
}

/// `written` with each bit of `flipped` set or cleared as `users` counts it.
fn patched_words(written: &[u64], users: &HashMap<u32, u32>, flipped: &BTreeSet<u32>) -> Vec<u64> {
    let mut words = written.to_vec();
    for &bit in flipped {
        let (word, mask) = ((bit / 64) as usize, 1u64 << (bit % 64));
        if users.contains_key(&bit) {
            words[word] |= mask;
        } else {
            words[word] &= !mask;
        }
    }
    words
}

/// The two port bitmaps `ports` need: their service ports, then their backends' ports.
pub fn port_bitmaps<'a>(ports: impl Iterator<Item = &'a ServicePort>) -> Vec<u64> {
    words_with(ports.flat_map(port_bit_numbers))
}

impl Dataplane {
    /// Writes the words of the port bitmaps that differ from what the map holds.
    fn sync_port_bitmaps(
        &mut self,
        state: &mut LbState,
        wanted: Vec<u64>,
    ) -> Result<usize, AgentError> {
        let err = |action: &'static str| {
            move |source| AgentError::Map {
                name: maps::LB_PORTS.into(),
                action,
                source,
            }
        };
        let mut map: Array<&mut MapData, u64> = self.typed_map(maps::LB_PORTS)?;
        let current = match state.port_words.take() {
            Some(words) => words,
            None => (0..PORT_BITMAP_WORDS * 2)
                .map(|i| map.get(&i, 0))
                .collect::<Result<_, _>>()
                .map_err(err("read port bitmap"))?,
        };
        let mut written = 0;
        for (index, (&want, &have)) in wanted.iter().zip(&current).enumerate() {
            if want != have {
                map.set(index as u32, want, 0)
                    .map_err(err("write port bitmap"))?;
                written += 1;
            }
        }
        state.port_words = Some(wanted);
        Ok(written)
    }

    /// Takes over what a previous agent left in the pinned load-balancer maps: backend ids stay
    /// attached to the same backends (tracked flows keep them), service ports keep their ids
    /// and live tables until the first sync replaces or removes them.
    pub fn adopt_lb(&mut self, state: &mut LbState) -> Result<(), AgentError> {
        let slots = self.backend_slots()?;
        for (slot, backend) in &slots {
            state.adopt_slot(*slot, backend);
        }
        state.free_unused_slots();
        // What the first sync would otherwise read back once more.
        state.backends = Some(live_by_id(slots));
        let map = self.map(maps::LB_SERVICES)?;
        let services = crate::batch::read::<ServiceKey, ServiceValue>(map)
            .map_err(map_err(maps::LB_SERVICES, "read services"))?;
        for (key, value) in services {
            // The live table's backends are not known: the first sync rebuilds it aside.
            let unknown = vec![u32::MAX];
            state.mark_service_id_used(value.id);
            state.installed.insert(
                key,
                Installed {
                    value,
                    ready: unknown,
                    referenced: Vec::new(),
                    port: None,
                },
            );
        }
        Ok(())
    }

    /// Makes the load-balancer maps hold exactly `ports`, writing only what differs from the
    /// last sync: a service port equal to the one installed is not looked at again (so one
    /// changed endpoint costs its own port's work, not every port's). Order: the port bitmaps,
    /// then per changed service port its backends, its new Maglev table under its spare index
    /// and the service entry that switches to it in one write; then removals (old tables,
    /// gone service ports, members, and backends no service port uses any more).
    ///
    /// Everything the sync needs must fit before anything is written. After a failure (or
    /// on the first sync, or after adopting a previous agent's maps) the next sync reads the
    /// maps anew and sweeps what no installed port references.
    pub fn sync_lb(
        &mut self,
        state: &mut LbState,
        ports: &[ServicePort],
    ) -> Result<LbSyncStats, AgentError> {
        let sweep = state.backends.is_none() || state.members.is_none();
        // Unknown until this sync has installed `ports`: a failed one leaves them to be
        // counted again from the installed ports.
        state.bit_users = None;
        // Counted here, where every port is walked anyway, so that the next sync of a few
        // ports patches the bitmaps instead of counting every installed port's bits (about 2
        // ms at 10,000 ports, which the first change after a full sync paid).
        let users = count_port_bits(ports.iter());
        let wanted: HashSet<ServiceKey> = ports.iter().map(|p| p.key).collect();
        let plan = SyncPlan {
            changed: ports.iter().filter(|p| state.differs(p)).collect(),
            removed: state
                .installed
                .keys()
                .filter(|k| !wanted.contains(k))
                .copied()
                .collect(),
            ports: ports.len(),
            words: bitmap_words(&users),
        };
        let stats = self.sync_lb_planned(state, plan, sweep)?;
        state.bit_users = Some(users);
        Ok(stats)
    }

    /// [`Self::sync_lb`] for the service ports that may have changed since the last sync:
    /// each key with its port now (`None`: no Service holds it). The others stay as installed,
    /// untouched and not compared. After a sync that failed (and at the first), every port is
    /// needed: `Ok(None)` says so, and nothing was done.
    pub fn sync_lb_changed(
        &mut self,
        state: &mut LbState,
        updates: &[(ServiceKey, Option<ServicePort>)],
    ) -> Result<Option<LbSyncStats>, AgentError> {
        if state.backends.is_none() || state.members.is_none() {
            return Ok(None);
        }
        let now = || updates.iter().filter_map(|(_, port)| port.as_ref());
        // Each key's port after this sync (the last update of a key is the one installed).
        let after: BTreeMap<ServiceKey, Option<&ServicePort>> = updates
            .iter()
            .map(|(key, port)| (*key, port.as_ref()))
            .collect();
        // The bitmaps of every port after this sync: the installed ports' bit counts, less
        // the updated ports' old bits, plus their new ones. Only the bits whose count
        // reaches or leaves zero change a word, so the words as last written are patched
        // (a walk of every bit user was most of an endpoint change's time at 10,000 ports).
        let counted = state.bit_users.is_some();
        let mut users = state.bit_users.take().unwrap_or_else(|| {
            count_port_bits(state.installed.values().filter_map(|i| i.port.as_ref()))
        });
        let mut flipped = BTreeSet::new();
        let installed_port = |key: &ServiceKey| state.installed.get(key)?.port.as_ref();
        for (key, port) in &after {
            for bit in installed_port(key).into_iter().flat_map(port_bit_numbers) {
                if let Some(n) = users.get_mut(&bit) {
                    *n -= 1;
                    if *n == 0 {
                        users.remove(&bit);
                        flipped.insert(bit);
                    }
                }
            }
            for bit in port.iter().flat_map(|p| port_bit_numbers(p)) {
                let n = users.entry(bit).or_default();
                if *n == 0 {
                    flipped.insert(bit);
                }
                *n += 1;
            }
        }
        let words = match &state.port_words {
            Some(written) if counted => patched_words(written, &users, &flipped),
            _ => bitmap_words(&users),
        };
        // Every installed port is known here (a full sync installed them all: adopted ones
        // without a port lead to `Ok(None)` above), so the count needs no walk.
        let replaced = after
            .keys()
            .filter(|k| state.installed.contains_key(k))
            .count();
        let ports = state.installed.len() - replaced + after.values().flatten().count();
        let plan = SyncPlan {
            changed: now().filter(|p| state.differs(p)).collect(),
            removed: updates
                .iter()
                .filter(|(key, port)| port.is_none() && state.installed.contains_key(key))
                .map(|(key, _)| *key)
                .collect(),
            ports,
            words,
        };
        let stats = self.sync_lb_planned(state, plan, false)?;
        // The installed ports are now those the counts were made for.
        state.bit_users = Some(users);
        Ok(Some(stats))
    }

    fn sync_lb_planned(
        &mut self,
        state: &mut LbState,
        plan: SyncPlan<'_>,
        sweep: bool,
    ) -> Result<LbSyncStats, AgentError> {
        let result = self.sync_lb_changes(state, plan, sweep);
        if result.is_err() {
            // The maps may hold part of this sync: read them again next time.
            state.backends = None;
            state.members = None;
        }
        result
    }

    fn sync_lb_changes(
        &mut self,
        state: &mut LbState,
        plan: SyncPlan<'_>,
        sweep: bool,
    ) -> Result<LbSyncStats, AgentError> {
        let capacities = *self.capacities();
        let SyncPlan {
            changed,
            removed,
            ports,
            words,
        } = plan;
        let new_ports = changed
            .iter()
            .filter(|p| !state.installed.contains_key(&p.key))
            .count();
        let needed_ports = state.installed.len() + new_ports;
        if needed_ports > capacities.service_ports as usize {
            return Err(AgentError::Capacity {
                what: "service ports",
                needed: needed_ports,
                map: maps::LB_SERVICES,
                limit: capacities.service_ports,
                flag: "--max-service-ports",
            });
        }
        state.allocate_backend_ids(&changed, capacities.backends)?;
        if sweep {
            state.count_backend_refs();
        }
        let mut stats = LbSyncStats {
            services: ports,
            ..LbSyncStats::default()
        };
        stats.written += self.sync_port_bitmaps(state, words)?;
        let mut have = match state.backends.take() {
            Some(have) => have,
            None => self.live_backends()?,
        };
        let mut have_members = match state.members.take() {
            Some(have) => have,
            None if self.first_read_of_created(maps::LB_MEMBERS) => BTreeSet::new(),
            None => {
                let members: BpfHashMap<&mut MapData, MemberKey, u32> =
                    self.typed_map(maps::LB_MEMBERS)?;
                members.keys().filter_map(Result::ok).collect()
            }
        };
        let mut gone_members = BTreeSet::new();
        let mut stale_tables = Vec::new();
        let mut unreferenced = Vec::new();
        let tables = new_tables(state, &changed);
        for (port, prepared) in changed.into_iter().zip(tables) {
            let referenced = state.referenced_ids(port);
            stats.written += self.write_backends(&referenced, &mut have)?;
            let old = state.installed.get(&port.key).cloned();
            let installed = self.install_port(
                state,
                port,
                prepared,
                old.as_ref(),
                &mut have_members,
                &mut gone_members,
                &mut stale_tables,
                &mut stats,
            )?;
            state.add_refs(&referenced);
            if let Some(old) = &old {
                unreferenced.extend(state.drop_refs(&old.referenced));
            }
            state.installed.insert(port.key, installed);
        }
        // Removals, after every addition.
        {
            let mut services: BpfHashMap<&mut MapData, ServiceKey, ServiceValue> =
                self.typed_map(maps::LB_SERVICES)?;
            for key in &removed {
                let Some(installed) = state.installed.remove(key) else {
                    continue;
                };
                services
                    .remove(key)
                    .map_err(map_err(maps::LB_SERVICES, "remove service"))?;
                stats.deleted += 1;
                stale_tables.push(installed.value.table);
                state.free_service_ids.push(installed.value.id);
                gone_members.extend(installed.members());
                unreferenced.extend(state.drop_refs(&installed.referenced));
            }
        }
        {
            let mut tables: BpfHashMap<&mut MapData, u32, MaglevTable> =
                self.typed_map(maps::LB_MAGLEV)?;
            for table in stale_tables {
                if tables.remove(&table).is_ok() {
                    stats.deleted += 1;
                }
            }
        }
        if sweep {
            // What a previous agent (or a failed sync) left that no installed port has.
            let wanted: BTreeSet<MemberKey> = state
                .installed
                .values()
                .flat_map(Installed::members)
                .collect();
            gone_members.extend(have_members.difference(&wanted).copied());
            unreferenced.extend(have.keys().copied());
        }
        stats.deleted += self.remove_members(&mut have_members, &gone_members)?;
        state.members = Some(have_members);
        stats.deleted += self.remove_backends(state, &unreferenced, &mut have)?;
        state.backends = Some(have);
        if sweep {
            state.release_backends_without_refs();
        }
        stats.backends = state.backend_refs.len();
        Ok(stats)
    }

    /// The live entries of the backends array, by id.
    fn live_backends(&mut self) -> Result<HashMap<u32, Backend>, AgentError> {
        Ok(live_by_id(self.backend_slots()?))
    }

    /// Every slot of the backends array, read in batches (262,144 slots one call each took
    /// most of a second).
    fn backend_slots(&mut self) -> Result<Vec<(u32, Backend)>, AgentError> {
        if self.first_read_of_created(maps::LB_BACKENDS) {
            return Ok(Vec::new());
        }
        let map = self.map(maps::LB_BACKENDS)?;
        crate::batch::read::<u32, Backend>(map).map_err(map_err(maps::LB_BACKENDS, "read backends"))
    }

    /// Writes the backends of `ids` that the array does not hold as they should be.
    fn write_backends(
        &mut self,
        ids: &[(u32, BackendAddr)],
        have: &mut HashMap<u32, Backend>,
    ) -> Result<usize, AgentError> {
        // One batch per port (its ten or a thousand backends in one call).
        let wanted: Vec<(u32, Backend)> = ids
            .iter()
            .map(|&(id, backend)| (id, backend_value(backend, id)))
            .filter(|(id, value)| have.get(id) != Some(value))
            .collect();
        let map = self.map(maps::LB_BACKENDS)?;
        let slots: Vec<(u32, Backend)> = wanted
            .iter()
            .map(|&(id, value)| (backend_slot(id), value))
            .collect();
        let result = crate::batch::update(map, &slots);
        let written = match &result {
            Ok(()) => wanted.len(),
            Err(stopped) => stopped.done,
        };
        have.extend(wanted.into_iter().take(written));
        result.map_err(|stopped| map_err(maps::LB_BACKENDS, "write backend")(stopped.source))?;
        Ok(written)
    }

    /// Marks removed the backends of `candidates` no installed service port references, and
    /// gives their slots back.
    fn remove_backends(
        &mut self,
        state: &mut LbState,
        candidates: &[u32],
        have: &mut HashMap<u32, Backend>,
    ) -> Result<usize, AgentError> {
        let mut backends: Array<&mut MapData, Backend> = self.typed_map(maps::LB_BACKENDS)?;
        let mut deleted = 0;
        for &id in candidates {
            if state.backend_refs.contains_key(&id) || have.remove(&id).is_none() {
                continue;
            }
            backends
                .set(backend_slot(id), removed_backend(id), 0)
                .map_err(map_err(maps::LB_BACKENDS, "remove backend"))?;
            deleted += 1;
            state.release_backend(id);
        }
        Ok(deleted)
    }

    /// One changed service port: its Maglev table (a new one under the spare index when its
    /// ready backends changed), its members (before the service entry: new backends are
    /// members from their first flow), then the service entry. Returns what is installed.
    #[expect(
        clippy::too_many_arguments,
        reason = "the sync's working sets, passed down"
    )]
    fn install_port(
        &mut self,
        state: &mut LbState,
        port: &ServicePort,
        // `port`'s ready ids, and their Maglev table if built already.
        prepared: PreparedPort,
        current: Option<&Installed>,
        have_members: &mut BTreeSet<MemberKey>,
        gone_members: &mut BTreeSet<MemberKey>,
        stale_tables: &mut Vec<u32>,
        stats: &mut LbSyncStats,
    ) -> Result<Installed, AgentError> {
        let capacities = *self.capacities();
        let PreparedPort {
            ready,
            table: new_table,
        } = prepared;
        let id =
            match current {
                Some(installed) => installed.value.id,
                None => state.allocate_service_id(capacities.service_ports).ok_or(
                    AgentError::Capacity {
                        what: "service ports",
                        needed: state.installed.len() + 1,
                        map: maps::LB_SERVICES,
                        limit: capacities.service_ports,
                        flag: "--max-service-ports",
                    },
                )?,
            };
        let same_backends = current.is_some_and(|c| c.ready == ready);
        let table = match current {
            Some(installed) if same_backends => installed.value.table,
            // The spare index of this service port: the live table stays intact until the
            // service entry switches.
            Some(installed) => installed.value.table ^ 1,
            None => id * 2,
        };
        if !same_backends {
            // Built before for these ready backends (`new_tables`), unless an earlier port
            // of the same plan, of the same key, made them the installed ones.
            let built = new_table.unwrap_or_else(|| port_table(&ready, port));
            let mut value: MaglevTable = [0; MAGLEV_TABLE_SIZE];
            value.copy_from_slice(&built);
            let mut tables: BpfHashMap<&mut MapData, u32, MaglevTable> =
                self.typed_map(maps::LB_MAGLEV)?;
            tables
                .insert(table, value, 0)
                .map_err(map_err(maps::LB_MAGLEV, "write Maglev table"))?;
            stats.written += 1;
            if let Some(installed) = current {
                stale_tables.push(installed.value.table);
            }
        }
        let value = ServiceValue {
            id,
            table,
            backends: ready.len() as u32,
            affinity_timeout: port.affinity_timeout,
        };
        let installed = Installed {
            value,
            ready,
            referenced: state
                .referenced_ids(port)
                .iter()
                .map(|(id, _)| *id)
                .collect(),
            port: Some(port.clone()),
        };
        let members: BTreeSet<MemberKey> = installed.members().collect();
        if !members.is_empty() {
            let mut map: BpfHashMap<&mut MapData, MemberKey, u32> =
                self.typed_map(maps::LB_MEMBERS)?;
            for &member in &members {
                if have_members.insert(member) {
                    if have_members.len() > MAX_AFFINITY_MEMBERS as usize {
                        return Err(AgentError::Capacity {
                            what: "backends of service ports with ClientIP affinity",
                            needed: have_members.len(),
                            map: maps::LB_MEMBERS,
                            limit: MAX_AFFINITY_MEMBERS,
                            flag: "(fixed size)",
                        });
                    }
                    map.insert(member, 1, 0)
                        .map_err(map_err(maps::LB_MEMBERS, "write member"))?;
                    stats.written += 1;
                }
            }
        }
        if let Some(old) = current {
            gone_members.extend(old.members().filter(|m| !members.contains(m)));
        }
        if current.map(|c| c.value) != Some(value) {
            let mut services: BpfHashMap<&mut MapData, ServiceKey, ServiceValue> =
                self.typed_map(maps::LB_SERVICES)?;
            services
                .insert(port.key, value, 0)
                .map_err(map_err(maps::LB_SERVICES, "write service"))?;
            stats.written += 1;
        }
        Ok(installed)
    }
}

impl Dataplane {
    /// Removes the members no service port has any more, then the affinity entries that name
    /// them: a client stuck to a backend that left the service port starts afresh (the
    /// programs would not use the entry, and `inspect affinity` must not show it).
    fn remove_members(
        &mut self,
        have: &mut BTreeSet<MemberKey>,
        gone: &BTreeSet<MemberKey>,
    ) -> Result<usize, AgentError> {
        let gone: Vec<MemberKey> = gone.intersection(have).copied().collect();
        if gone.is_empty() {
            return Ok(0);
        }
        let mut deleted = 0;
        {
            let mut members: BpfHashMap<&mut MapData, MemberKey, u32> =
                self.typed_map(maps::LB_MEMBERS)?;
            for member in &gone {
                members
                    .remove(member)
                    .map_err(map_err(maps::LB_MEMBERS, "remove member"))?;
                have.remove(member);
                deleted += 1;
            }
        }
        let gone: BTreeSet<MemberKey> = gone.into_iter().collect();
        let mut affinity: BpfHashMap<&mut MapData, AffinityKey, AffinityValue> =
            self.typed_map(maps::LB_AFFINITY)?;
        let stale: Vec<AffinityKey> = affinity
            .iter()
            .filter_map(Result::ok)
            .filter(|(key, value)| {
                gone.contains(&MemberKey {
                    service_id: key.service_id,
                    backend_id: value.backend_id,
                })
            })
            .map(|(key, _)| key)
            .collect();
        for key in stale {
            // Gone already if the client's entry aged out of the LRU meanwhile.
            if affinity.remove(&key).is_ok() {
                deleted += 1;
            }
        }
        Ok(deleted)
    }
}

/// The node's list of ports its own sockets never get as ephemeral ports.
const RESERVED_PORTS: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";

/// Reserves the masquerade source ports (`SNAT_PORT_MIN..=SNAT_PORT_MAX` and
/// `SNAT_LOW_PORT_MIN..=SNAT_LOW_PORT_MAX`) on this node, so no local connection to a backend
/// ever shares its ports with a masqueraded flow (its replies would be taken for that flow's),
/// whatever ephemeral range the node is given. Ports reserved by others stay reserved.
pub fn reserve_snat_ports() -> Result<(), AgentError> {
    let io = |action| {
        move |source| AgentError::Io {
            action,
            path: RESERVED_PORTS.into(),
            source,
        }
    };
    let current = std::fs::read_to_string(RESERVED_PORTS).map_err(io("reading"))?;
    if let Some(updated) = with_snat_ports(&current) {
        std::fs::write(RESERVED_PORTS, &updated).map_err(io("writing"))?;
        tracing::info!(reserved = %updated, "masquerade source ports reserved on this node");
    }
    Ok(())
}

/// The reserved-ports list (`22,1000-2000`) with each masquerade range it does not cover
/// whole added, or `None` when it covers them all.
fn with_snat_ports(current: &str) -> Option<String> {
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

#[cfg(test)]
mod tests;
