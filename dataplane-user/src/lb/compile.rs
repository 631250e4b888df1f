//! Services and EndpointSlices compiled (pure) into service ports with their backends: every
//! ClusterIP, external and load-balancer address and NodePort of a Service, for each of its
//! ports, with the ready (or serving) endpoints of its slices.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    sync::Arc,
};

use ipnet::IpNet;

use dataplane_common::lb::{
    AFFINITY_TIMEOUT_DEFAULT, AFFINITY_TIMEOUT_MAX, AFFINITY_TIMEOUT_MIN, MAX_BACKENDS_PER_SERVICE,
    NODEPORT_ANY_V4, SCOPE_CLUSTER, SCOPE_EXTERNAL, SCOPE_NODEPORT, SCOPE_NODEPORT_FROM_POD,
    ServiceKey,
};
use k8s_openapi::api::{
    core::v1::{Service, ServicePort as K8sServicePort},
    discovery::v1::{Endpoint, EndpointSlice},
};

use super::{
    address::{AddressKind, AddressPolicy, CLUSTER_IPS, EXTERNAL_IPS, INGRESS_IPS},
    host::HostRedirect,
    topology::{LocalNode, Topology, node_hints, topology_of, zone_hints},
};
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
    /// The sources allowed to open flows (`spec.loadBalancerSourceRanges`, truncated to their
    /// networks): set on the ports of load-balancer ingress addresses only, empty for every
    /// source.
    pub source_ranges: Vec<IpNet>,
    /// How topology narrowed `ready` (`None`: it did not), e.g. `zone zone-a`.
    pub topology: Option<String>,
}

/// Services and EndpointSlices with either label belong to another proxy, or to none (a
/// headless Service's slices): kube-proxy does not watch them, and neither does this one.
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";

/// Whether an object with these labels is another proxy's (or a headless Service's).
fn not_ours(labels: Option<&BTreeMap<String, String>>) -> bool {
    labels
        .is_some_and(|l| l.contains_key(SERVICE_PROXY_NAME_LABEL) || l.contains_key(HEADLESS_LABEL))
}

/// The most source ranges one Service may give: each becomes an entry per load-balancer
/// address and port in a map all Services share.
pub const MAX_SOURCE_RANGES: usize = 256;

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
    /// Its health-check node port, served on this node (`externalTrafficPolicy: Local`
    /// LoadBalancer Services).
    pub health_check: Option<HealthCheck>,
    /// Its NodePorts and external and load-balancer addresses as the node's own connections
    /// reach them (sent to its ClusterIP of their family).
    pub host: Vec<HostRedirect>,
}

/// A Service's health-check node port as this node answers it: load balancers send traffic
/// only to the nodes that answer 200, those with a ready endpoint of the Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    pub port: u16,
    pub namespace: String,
    pub name: String,
    /// The Service's ready endpoints on this node.
    pub local_endpoints: usize,
}

/// Health-check node ports below this are refused: the agent runs as root, and a Service must
/// not make it take a system port of the node (the API server allocates them from the
/// NodePort range, 30000-32767 by default).
pub const MIN_HEALTH_CHECK_PORT: u16 = 1024;

/// Compiles every Service with its EndpointSlices into the service ports of node `node`
/// (pure): `internalTrafficPolicy: Local` and `externalTrafficPolicy: Local` keep only the
/// endpoints on this node; external and load-balancer addresses as `policy` allows.
pub fn compile_services(
    services: &Objects<Service>,
    slices: &Objects<EndpointSlice>,
    node: &LocalNode,
    policy: &AddressPolicy,
) -> CompiledServices {
    assemble(compile_each(services, slices, node, policy, |_| true).values())
}

/// Compiles the Services `wanted` picks (by namespace and name), each with its own
/// EndpointSlices: what a change to a few Services or slices recompiles.
pub fn compile_each<'a>(
    services: impl IntoIterator<Item = &'a Arc<Service>>,
    slices: impl IntoIterator<Item = &'a Arc<EndpointSlice>>,
    node: &LocalNode,
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
    node: &LocalNode,
    policy: &AddressPolicy,
) -> CompiledService {
    let namespace = service.metadata.namespace.as_deref().unwrap_or("default");
    let name = service.metadata.name.as_deref().unwrap_or("<unnamed>");
    let id = format!("Service {namespace}/{name}");
    let Some(spec) = &service.spec else {
        return Ok(ServiceCompiled::default());
    };
    if spec.type_.as_deref() == Some("ExternalName") || not_ours(service.metadata.labels.as_ref()) {
        return Ok(ServiceCompiled::default());
    }
    let own_slices: Vec<&EndpointSlice> = own_slices
        .iter()
        .copied()
        .filter(|slice| !not_ours(slice.metadata.labels.as_ref()))
        .collect();
    let own_slices = own_slices.as_slice();
    let (source_ranges, bad_ranges) = source_ranges(spec.load_balancer_source_ranges.as_deref());
    let affinity_timeout = affinity_timeout(service).map_err(|e| format!("{id}: {e}"))?;
    let internal_local = spec.internal_traffic_policy.as_deref() == Some("Local");
    let external_local = spec.external_traffic_policy.as_deref() == Some("Local");
    let node_ports = matches!(spec.type_.as_deref(), Some("NodePort" | "LoadBalancer"));
    let (addresses, refused) =
        service_addresses(service, policy).map_err(|e| format!("{id}: {e}"))?;
    if source_ranges.len() > MAX_SOURCE_RANGES {
        return Err(format!(
            "{id}: spec.loadBalancerSourceRanges: {} ranges, more than the {MAX_SOURCE_RANGES} one Service may give",
            source_ranges.len()
        ));
    }
    let mut refused: Vec<String> = refused
        .into_iter()
        .map(|why| format!("{id}: {why}; that address is not served"))
        .collect();
    refused.extend(bad_ranges.into_iter().map(|why| {
        format!("{id}: spec.loadBalancerSourceRanges{why}; that range allows no source")
    }));
    refused.extend(
        own_slices
            .iter()
            .flat_map(|slice| unusable_endpoints(slice)),
    );
    let cluster_ip_of = |v4: bool| {
        addresses
            .iter()
            .find(|(a, origin)| *origin == Origin::ClusterIp && a.is_ipv4() == v4)
            .map(|(a, _)| *a)
    };
    let mut ports = Vec::new();
    let mut host = Vec::new();
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
        let mut keys: Vec<(ServiceKey, AddressKind, IpAddr, bool, String, bool)> = Vec::new();
        for &(address, origin) in &addresses {
            let cluster_ip = origin == Origin::ClusterIp;
            let ingress = origin == Origin::Ingress;
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
                ingress,
            ));
            if !cluster_ip {
                let key = ServiceKey {
                    scope: SCOPE_EXTERNAL,
                    ..key
                };
                let name = format!("{port_name} (external {address})");
                keys.push((key, kind, address, external_local, name, ingress));
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
                    false,
                ));
                // Pods reach an externalTrafficPolicy: Local NodePort's every endpoint.
                if external_local {
                    let key = ServiceKey {
                        scope: SCOPE_NODEPORT_FROM_POD,
                        ..key
                    };
                    let name = format!("{port_name} (NodePort {node_port} from pods)");
                    keys.push((key, AddressKind::NodePort, any, false, name, false));
                }
            }
        }
        for (key, kind, address, local_only, port_name, ingress) in keys {
            let local = local_only.then_some(node.name.as_str());
            let chosen = endpoints_for(own_slices, port, address, protocol, local, node);
            let (ready, terminating, topology) = chosen;
            // The ranges of the address's own family, as kube-proxy takes them: a family with
            // none (or with a range of every address) leaves that family's addresses open.
            let source_ranges = if ingress {
                ranges_of_family(&source_ranges, address.is_ipv4())
            } else {
                Vec::new()
            };
            if ready.len() + terminating.len() > MAX_BACKENDS_PER_SERVICE {
                return Err(format!(
                    "{field}: {} endpoints, more than the {MAX_BACKENDS_PER_SERVICE} one service port may have",
                    ready.len() + terminating.len()
                ));
            }
            if matches!(key.scope, SCOPE_NODEPORT | SCOPE_EXTERNAL)
                && let Some(ip) = cluster_ip_of(address.is_ipv4())
            {
                host.push(HostRedirect {
                    key,
                    to: BackendAddr { ip, port: number },
                    source_ranges: source_ranges.clone(),
                });
            }
            ports.push(ServicePort {
                name: port_name,
                kind,
                key,
                affinity_timeout,
                ready,
                terminating,
                source_ranges,
                topology,
            });
        }
    }
    let health_check = match health_check(service, own_slices, node) {
        Ok(check) => check,
        Err(why) => {
            refused.push(format!("{id}: {why}; the health check is not served"));
            None
        }
    };
    Ok(ServiceCompiled {
        ports,
        refused,
        health_check,
        host,
    })
}

/// The health check a Service asks of this node: a LoadBalancer Service with
/// `externalTrafficPolicy: Local` and `spec.healthCheckNodePort`, answered with the number
/// of its ready endpoints on this node (distinct addresses, whatever their ports).
fn health_check(
    service: &Service,
    own_slices: &[&EndpointSlice],
    node: &LocalNode,
) -> Result<Option<HealthCheck>, String> {
    let Some(spec) = &service.spec else {
        return Ok(None);
    };
    let wanted = spec.type_.as_deref() == Some("LoadBalancer")
        && spec.external_traffic_policy.as_deref() == Some("Local");
    let Some(port) = spec.health_check_node_port.filter(|_| wanted) else {
        return Ok(None);
    };
    let port = u16::try_from(port)
        .ok()
        .filter(|p| *p >= MIN_HEALTH_CHECK_PORT)
        .ok_or_else(|| {
            format!(
                "spec.healthCheckNodePort: {port} is not a port from {MIN_HEALTH_CHECK_PORT} to 65535"
            )
        })?;
    let local: BTreeSet<&str> = own_slices
        .iter()
        .flat_map(|slice| &slice.endpoints)
        .filter(|e| e.node_name.as_deref() == Some(node.name.as_str()))
        .filter(|e| matches!(endpoint_state(e), Some(EndpointState::Ready)))
        .flat_map(|e| e.addresses.iter().map(String::as_str))
        .collect();
    Ok(Some(HealthCheck {
        port,
        namespace: service
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into()),
        name: service.metadata.name.clone().unwrap_or_default(),
        local_endpoints: local.len(),
    }))
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

/// Where a Service's address comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    /// `spec.clusterIPs`.
    ClusterIp,
    /// `spec.externalIPs`.
    ExternalIp,
    /// `status.loadBalancer.ingress[].ip` (in VIP mode).
    Ingress,
}

/// A Service's address, and where it comes from.
type ServiceAddress = (IpAddr, Origin);

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
        // `ipMode: Proxy`: the load balancer proxies to the nodes (from its own address), so
        // traffic to its address must leave the cluster for it rather than be short-cut here,
        // as kube-proxy leaves such addresses alone.
        texts.extend(
            ingress
                .into_iter()
                .flatten()
                .filter(|i| i.ip_mode.as_deref() != Some("Proxy"))
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
        let origin = match field {
            CLUSTER_IPS => Origin::ClusterIp,
            EXTERNAL_IPS => Origin::ExternalIp,
            _ => Origin::Ingress,
        };
        if addresses.iter().any(|(a, _)| *a == ip) {
            continue;
        }
        if origin != Origin::ClusterIp
            && let Some(why) = policy.refuses(ip, field)
        {
            refused.push(format!("{field}: {why}"));
            continue;
        }
        addresses.push((ip, origin));
    }
    Ok((addresses, refused))
}

/// The source ranges of a Service (`spec.loadBalancerSourceRanges`), each truncated to its
/// network (kube-proxy reads `10.1.2.3/8` as `10.0.0.0/8`, and forgives surrounding spaces),
/// and a line for each that is no CIDR (`[index]: why`), which allows nothing.
fn source_ranges(texts: Option<&[String]>) -> (Vec<IpNet>, Vec<String>) {
    let (mut ranges, mut bad) = (Vec::new(), Vec::new());
    for (index, text) in texts.unwrap_or_default().iter().enumerate() {
        match text.trim().parse::<IpNet>() {
            Ok(range) => ranges.push(range.trunc()),
            Err(_) => bad.push(format!("[{index}]: {text:?} is not a CIDR")),
        }
    }
    ranges.sort();
    ranges.dedup();
    (ranges, bad)
}

/// The ranges of one family; none when one of them is every address of the family (kube-proxy
/// reads `0.0.0.0/0` as no restriction, as it reads no ranges).
fn ranges_of_family(ranges: &[IpNet], ipv4: bool) -> Vec<IpNet> {
    let own: Vec<IpNet> = ranges
        .iter()
        .filter(|r| r.addr().is_ipv4() == ipv4)
        .copied()
        .collect();
    if own.iter().any(|r| r.prefix_len() == 0) {
        return Vec::new();
    }
    own
}

/// Ready and serving-but-terminating backends of one Service port on one address family, and
/// how topology narrowed the ready ones; with `local_node`, only the endpoints on that node
/// (and no topology: a Local traffic policy has its own).
fn endpoints_for(
    slices: &[&EndpointSlice],
    port: &K8sServicePort,
    address: IpAddr,
    protocol: u8,
    local_node: Option<&str>,
    node: &LocalNode,
) -> (Vec<BackendAddr>, Vec<BackendAddr>, Option<String>) {
    let family = if address.is_ipv4() { "IPv4" } else { "IPv6" };
    let protocol_name = match protocol {
        6 => "TCP",
        17 => "UDP",
        _ => "SCTP",
    };
    let mut ready = BTreeSet::new();
    let mut terminating = BTreeSet::new();
    // The ready endpoints' hints, for topology: (backend, zones hinted, nodes hinted).
    let mut hinted: Vec<(BackendAddr, Vec<&str>, Vec<&str>)> = Vec::new();
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
                    EndpointState::Ready => {
                        hinted.push((backend, zone_hints(endpoint), node_hints(endpoint)));
                        ready.insert(backend)
                    }
                    EndpointState::Terminating => terminating.insert(backend),
                };
            }
        }
    }
    // kube-proxy's rule: with no ready endpoint, serving-terminating ones take new flows.
    if ready.is_empty() {
        return (terminating.into_iter().collect(), Vec::new(), None);
    }
    let topology = match local_node {
        Some(_) => None,
        None => topology_of(&hinted, node),
    };
    let all_ready = ready;
    let chosen: BTreeSet<BackendAddr> = match &topology {
        // Only the ready endpoints hinted for this node (or its zone); the others keep their
        // established flows, as terminating ones do, until they are chosen again.
        Some(Topology::SameNode) => hinted
            .iter()
            .filter(|(_, _, nodes)| nodes.contains(&node.name.as_str()))
            .map(|(backend, _, _)| *backend)
            .collect(),
        Some(Topology::SameZone(zone)) => hinted
            .iter()
            .filter(|(_, zones, _)| zones.contains(&zone.as_str()))
            .map(|(backend, _, _)| *backend)
            .collect(),
        None => all_ready.clone(),
    };
    // Ready endpoints topology left out keep their established flows, as terminating ones.
    let terminating = terminating
        .union(&all_ready)
        .filter(|b| !chosen.contains(b))
        .copied()
        .collect();
    let ready = chosen;
    let description = topology.map(|t| match t {
        Topology::SameNode => format!("node {}", node.name),
        Topology::SameZone(zone) => format!("zone {zone}"),
    });
    (ready.into_iter().collect(), terminating, description)
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
