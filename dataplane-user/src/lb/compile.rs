//! Services and EndpointSlices compiled (pure) into service ports with their backends: every
//! ClusterIP, external and load-balancer address and NodePort of a Service, for each of its
//! ports, with the ready (or serving) endpoints of its slices.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    sync::Arc,
};

use dataplane_common::lb::{
    AFFINITY_TIMEOUT_DEFAULT, AFFINITY_TIMEOUT_MAX, AFFINITY_TIMEOUT_MIN, MAX_BACKENDS_PER_SERVICE,
    NODEPORT_ANY_V4, SCOPE_CLUSTER, SCOPE_EXTERNAL, SCOPE_NODEPORT, ServiceKey,
};
use k8s_openapi::api::{
    core::v1::{Service, ServicePort as K8sServicePort},
    discovery::v1::{Endpoint, EndpointSlice},
};

use super::address::{AddressKind, AddressPolicy, CLUSTER_IPS, EXTERNAL_IPS, INGRESS_IPS};
use crate::{
    changes::ObjectName,
    mapsync::addr16,
    source::{Objects, slice_service},
};

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

/// A Service's namespace and name (as the store keys every namespaced object).
pub type ServiceName = ObjectName;

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
pub(super) const SERVICES_PER_TASK: usize = 256;

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
