//! The load-balancer's cache of compiled Services between syncs: a change recompiles only the
//! Services it touches (found by the dependency model, `changes`), and the next map sync
//! compares only the service ports that may differ.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::Arc,
};

use dataplane_common::lb::{SCOPE_NODEPORT, ServiceKey};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use crate::{
    changes::{Changes, object_key, owned},
    error::AgentError,
    kernel::loader::Dataplane,
    source::Objects,
};

use super::{
    AddressKind, AddressPolicy, CompiledService, CompiledServices, HealthCheck, HostRedirect,
    LbState, LbSyncStats, LocalNode, ServiceName, ServicePort,
    describe::{Described, DescribedHealthCheck, DescribedPort, described_key},
};

/// Whether topology narrowed the endpoints of any of a compiled Service's ports.
fn narrowed(compiled: &super::ServiceCompiled) -> bool {
    compiled.ports.iter().any(|p| p.topology.is_some())
}

/// Every Service's compiled ports, kept between syncs: a change recompiles only the Services
/// it touches, and the service ports that may differ since the last load-balancer sync are
/// known by key, so that sync looks at those alone.
#[derive(Debug, Default)]
pub struct ServiceCache {
    compiled: BTreeMap<ServiceName, CompiledService>,
    /// The Services and EndpointSlices, patched with each change: a change compiles its
    /// Services from these, not from a pass over every object (at 10,000 Services, 10 ms).
    objects: HashMap<ServiceName, Arc<Service>>,
    slices: HashMap<(String, String), Arc<EndpointSlice>>,
    /// Each Service's EndpointSlices (their namespace and name).
    slices_of: HashMap<ServiceName, BTreeSet<(String, String)>>,
    /// Each service key and the Services whose ports claim it (with the kind of address),
    /// with how many ports each: the first port of the lowest kind, then of the first Service
    /// by name, holds it (as [`super::assemble`] decides).
    claims: BTreeMap<ServiceKey, BTreeMap<(AddressKind, ServiceName), usize>>,
    /// The address policy and the node the Services were compiled under: a change of either
    /// recompiles them all.
    policy: AddressPolicy,
    node: LocalNode,
    /// The Services whose compile failed, and the keys more than one port claims: what
    /// [`Self::errors`] lists, kept so that it does not walk 10,000 Services at each change.
    failed: BTreeSet<ServiceName>,
    shared: BTreeSet<ServiceKey>,
    /// The Services that ask for a health-check port (few: `externalTrafficPolicy: Local`
    /// LoadBalancers), so that [`Self::health_checks`] does not walk every Service.
    with_health_check: BTreeSet<ServiceName>,
    /// The Services with NodePorts or external or load-balancer addresses, which the node's
    /// own connections are translated for ([`Self::host_redirects`]).
    with_host: BTreeSet<ServiceName>,
    /// The Services with a port whose endpoints topology narrowed ([`Self::describe`]).
    with_topology: BTreeSet<ServiceName>,
    /// The keys whose port may have changed since the last [`Self::synced`] (`None`: any).
    dirty: Option<BTreeSet<ServiceKey>>,
}

impl ServiceCache {
    /// Recompiles what `changes` touches (everything when full); returns how many Services
    /// were compiled.
    pub fn update(
        &mut self,
        services: &Objects<Service>,
        slices: &Objects<EndpointSlice>,
        node: &LocalNode,
        policy: &AddressPolicy,
        changes: &Changes,
    ) -> usize {
        if changes.full || self.policy != *policy || self.node != *node {
            self.policy = policy.clone();
            self.node = node.clone();
            self.index(services, slices);
            self.compiled = super::compile_each(services, slices, node, policy, |_| true);
            self.failed = self
                .compiled
                .iter()
                .filter(|(_, service)| service.is_err())
                .map(|(name, _)| name.clone())
                .collect();
            self.with_health_check = self
                .compiled
                .iter()
                .filter(|(_, c)| c.as_ref().is_ok_and(|c| c.health_check.is_some()))
                .map(|(name, _)| name.clone())
                .collect();
            self.with_host = self
                .compiled
                .iter()
                .filter(|(_, c)| c.as_ref().is_ok_and(|c| !c.host.is_empty()))
                .map(|(name, _)| name.clone())
                .collect();
            self.with_topology = self
                .compiled
                .iter()
                .filter(|(_, c)| c.as_ref().is_ok_and(narrowed))
                .map(|(name, _)| name.clone())
                .collect();
            self.claims.clear();
            self.shared.clear();
            let all: Vec<ServiceName> = self.compiled.keys().cloned().collect();
            for name in &all {
                self.claim(name);
            }
            self.dirty = None;
            return self.compiled.len();
        }
        for (name, service) in &changes.service_objects {
            match service {
                Some(service) => self.objects.insert(name.clone(), Arc::clone(service)),
                None => self.objects.remove(name),
            };
        }
        for (key, slice) in &changes.slices {
            self.forget_slice(key);
            if let Some(slice) = slice {
                self.add_slice(key.clone(), slice);
            }
        }
        let mut compiled = 0;
        for name in &changes.services {
            self.unclaim(name);
            self.compiled.remove(name);
            self.failed.remove(name);
            self.with_health_check.remove(name);
            self.with_host.remove(name);
            self.with_topology.remove(name);
            let Some(service) = self.objects.get(name) else {
                continue;
            };
            let own: Vec<Arc<EndpointSlice>> = self
                .slices_of
                .get(name)
                .into_iter()
                .flatten()
                .filter_map(|key| self.slices.get(key).cloned())
                .collect();
            let fresh =
                super::compile_each(std::slice::from_ref(service), &own, node, policy, |_| true);
            compiled += fresh.len();
            for (name, service) in fresh {
                if service.is_err() {
                    self.failed.insert(name.clone());
                }
                if service.as_ref().is_ok_and(|c| c.health_check.is_some()) {
                    self.with_health_check.insert(name.clone());
                }
                if service.as_ref().is_ok_and(|c| !c.host.is_empty()) {
                    self.with_host.insert(name.clone());
                }
                if service.as_ref().is_ok_and(narrowed) {
                    self.with_topology.insert(name.clone());
                }
                self.compiled.insert(name.clone(), service);
                self.claim(&name);
            }
        }
        compiled
    }

    /// The Services and EndpointSlices indexed anew.
    fn index(&mut self, services: &Objects<Service>, slices: &Objects<EndpointSlice>) {
        self.objects = services
            .iter()
            .map(|s| (object_key(&**s), Arc::clone(s)))
            .collect();
        self.slices.clear();
        self.slices_of.clear();
        for slice in slices {
            self.add_slice(object_key(&**slice), slice);
        }
    }

    fn add_slice(&mut self, key: (String, String), slice: &Arc<EndpointSlice>) {
        if let Some(service) = crate::source::slice_service(slice) {
            self.slices_of
                .entry(owned(service))
                .or_default()
                .insert(key.clone());
        }
        self.slices.insert(key, Arc::clone(slice));
    }

    fn forget_slice(&mut self, key: &(String, String)) {
        let Some(slice) = self.slices.remove(key) else {
            return;
        };
        if let Some(service) = crate::source::slice_service(&slice) {
            let service = owned(service);
            if let Some(keys) = self.slices_of.get_mut(&service) {
                keys.remove(key);
                if keys.is_empty() {
                    self.slices_of.remove(&service);
                }
            }
        }
    }

    /// Every port of the Service `name` (as compiled) claims its key.
    fn claim(&mut self, name: &ServiceName) {
        let Some(Ok(compiled)) = self.compiled.get(name) else {
            return;
        };
        for port in &compiled.ports {
            let claims = self.claims.entry(port.key).or_default();
            *claims.entry((port.kind, name.clone())).or_default() += 1;
            if claims.values().sum::<usize>() > 1 {
                self.shared.insert(port.key);
            }
            if let Some(dirty) = &mut self.dirty {
                dirty.insert(port.key);
            }
        }
    }

    /// The Service `name`'s ports (as compiled) give up their keys.
    fn unclaim(&mut self, name: &ServiceName) {
        let Some(Ok(compiled)) = self.compiled.get(name) else {
            return;
        };
        for port in &compiled.ports {
            if let Some(claims) = self.claims.get_mut(&port.key) {
                claims.remove(&(port.kind, name.clone()));
                if claims.values().sum::<usize>() <= 1 {
                    self.shared.remove(&port.key);
                }
                if claims.is_empty() {
                    self.claims.remove(&port.key);
                }
            }
            if let Some(dirty) = &mut self.dirty {
                dirty.insert(port.key);
            }
        }
    }

    /// The service ports of every Service, as [`super::compile_services`] gives them.
    pub fn ports(&self) -> CompiledServices {
        super::assemble(self.compiled.values())
    }

    /// The port each key that may have changed since the last [`Self::synced`] now has
    /// (`None`: no Service holds it); `None` when any may have.
    pub fn changed_ports(&self) -> Option<Vec<(ServiceKey, Option<ServicePort>)>> {
        let dirty = self.dirty.as_ref()?;
        Some(dirty.iter().map(|key| (*key, self.holder(key))).collect())
    }

    /// The port holding `key`: of the lowest kind, then of the first Service by name.
    fn holder(&self, key: &ServiceKey) -> Option<ServicePort> {
        let ((kind, name), _) = self.claims.get(key)?.first_key_value()?;
        let Some(Ok(compiled)) = self.compiled.get(name) else {
            return None;
        };
        compiled
            .ports
            .iter()
            .find(|p| p.key == *key && p.kind == *kind)
            .cloned()
    }

    /// Whether the Service `name` holds `key` (its port of the lowest kind, then the first
    /// Service by name, as [`super::assemble`] decides).
    fn holds(&self, name: &ServiceName, key: &ServiceKey) -> bool {
        self.claims
            .get(key)
            .and_then(|claims| claims.first_key_value())
            .is_some_and(|((_, holder), _)| holder == name)
    }

    /// Why Services or ports are refused: as [`Self::ports`] says, without assembling them.
    pub fn errors(&self) -> Vec<String> {
        let mut errors: Vec<String> = self
            .failed
            .iter()
            .filter_map(|name| self.compiled.get(name)?.as_ref().err().cloned())
            .collect();
        errors.extend(
            self.compiled
                .values()
                .filter_map(|c| c.as_ref().ok())
                .flat_map(|c| c.refused.iter().cloned()),
        );
        let shared = self
            .shared
            .iter()
            .filter_map(|key| Some((key, self.claims.get(key)?)));
        for (key, names) in shared {
            let ports = names
                .keys()
                .filter_map(|(kind, name)| match self.compiled.get(name) {
                    Some(Ok(compiled)) => Some(
                        compiled
                            .ports
                            .iter()
                            .filter(move |p| p.key == *key && p.kind == *kind),
                    ),
                    _ => None,
                });
            errors.extend(ports.flatten().skip(1).map(super::key_taken));
        }
        errors
    }

    /// The health-check node ports this node serves, by port, and a line for each one not
    /// served: a port two Services name goes to the first by namespace and name; a port that
    /// is also a NodePort (whose traffic the load-balancer takes before the node's stack
    /// sees it) to neither.
    pub fn health_checks(&self) -> (BTreeMap<u16, HealthCheck>, Vec<String>) {
        if self.with_health_check.is_empty() {
            return (BTreeMap::new(), Vec::new());
        }
        let node_ports: BTreeSet<u16> = self
            .claims
            .keys()
            .filter(|key| key.scope == SCOPE_NODEPORT && key.protocol == 6)
            .map(|key| u16::from_be_bytes(key.port_be))
            .collect();
        let mut checks = BTreeMap::new();
        let mut refused = Vec::new();
        let wanted = self.with_health_check.iter().filter_map(|name| {
            self.compiled
                .get(name)?
                .as_ref()
                .ok()?
                .health_check
                .as_ref()
        });
        for check in wanted {
            let id = format!("Service {}/{}", check.namespace, check.name);
            if node_ports.contains(&check.port) {
                refused.push(format!(
                    "{id}: spec.healthCheckNodePort: {} is a NodePort of a Service; the health check is not served",
                    check.port
                ));
                continue;
            }
            match checks.entry(check.port) {
                std::collections::btree_map::Entry::Occupied(_) => refused.push(format!(
                    "{id}: spec.healthCheckNodePort: {} is another Service's; the health check is not served",
                    check.port
                )),
                std::collections::btree_map::Entry::Vacant(slot) => {
                    slot.insert(check.clone());
                }
            }
        }
        (checks, refused)
    }

    /// The NodePorts and external and load-balancer addresses the node's own connections are
    /// translated for: each of a Service that holds its key (as the load-balancer maps have
    /// it), walking only the Services that have any.
    pub fn host_redirects(&self) -> Vec<&HostRedirect> {
        self.with_host
            .iter()
            .filter_map(|name| Some((name, self.compiled.get(name)?.as_ref().ok()?)))
            .flat_map(|(name, compiled)| {
                compiled
                    .host
                    .iter()
                    .filter(move |redirect| self.holds(name, &redirect.key))
            })
            .collect()
    }

    /// What `dataplane inspect services` shows beside the maps: the ports of the Services
    /// whose endpoints topology narrowed or that have a health check (each port its Service
    /// holds), and the health-check ports served.
    pub fn describe(&self) -> Described {
        let (checks, _) = self.health_checks();
        let health_checks: Vec<DescribedHealthCheck> = checks
            .values()
            .map(|c| DescribedHealthCheck {
                port: c.port,
                service: format!("{}/{}", c.namespace, c.name),
                local_endpoints: c.local_endpoints,
            })
            .collect();
        let served: BTreeMap<&str, String> = health_checks
            .iter()
            .map(|c| (c.service.as_str(), c.answer()))
            .collect();
        let mut ports = BTreeMap::new();
        for name in self.with_topology.union(&self.with_health_check) {
            let Some(Ok(compiled)) = self.compiled.get(name) else {
                continue;
            };
            let health_check = served.get(format!("{}/{}", name.0, name.1).as_str());
            for port in &compiled.ports {
                if self.holds(name, &port.key) {
                    ports.insert(
                        described_key(&port.key),
                        DescribedPort {
                            name: port.name.clone(),
                            topology: port.topology.clone(),
                            health_check: health_check.cloned(),
                        },
                    );
                }
            }
        }
        Described {
            zone: self.node.zone.clone(),
            ports,
            health_checks,
        }
    }

    /// Brings the load-balancer maps to the ports as they are now: only the keys that may
    /// have changed since the last call, or every port after a full compile or a failed sync.
    pub fn sync_maps(
        &mut self,
        dataplane: &mut Dataplane,
        lb: &mut LbState,
    ) -> Result<LbSyncStats, AgentError> {
        let changed = match self.changed_ports() {
            Some(changed) => dataplane.sync_lb_changed(lb, &changed)?,
            None => None,
        };
        let stats = match changed {
            Some(stats) => stats,
            None => dataplane.sync_lb(lb, &self.ports().ports)?,
        };
        self.synced();
        Ok(stats)
    }

    /// The load-balancer maps hold the ports as they are now.
    pub fn synced(&mut self) {
        self.dirty = Some(BTreeSet::new());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::changes::tests::{BASE, state};

    /// The cache after a change equals a compile of everything from the new state.
    #[test]
    fn the_service_cache_after_changes_equals_a_full_compile() {
        let edits: [fn(&str) -> String; 4] = [
            |t| {
                t.replace(
                    "addresses: [10.244.1.5]",
                    "addresses: [10.244.1.6, 10.244.1.7]",
                )
            },
            |t| {
                t.replace(
                    "kubernetes.io/service-name: web",
                    "kubernetes.io/service-name: db",
                )
            },
            |t| t.replace("name: db, namespace: shop", "name: db2, namespace: shop"),
            // Two Services on one address: the first by namespace and name keeps it.
            |t| {
                t.replace(
                    "clusterIP: 10.96.0.11, ports: [{name: pg, port: 5432}]",
                    "clusterIP: 10.96.0.10, ports: [{name: http, port: 80}]",
                )
            },
        ];
        for edit in edits {
            let (old, new) = (state(BASE), state(&edit(BASE)));
            let mut cache = ServiceCache::default();
            cache.update(
                &old.services,
                &old.endpoint_slices,
                &LocalNode::named("node-a"),
                &AddressPolicy::default(),
                &Changes::full(),
            );
            let before = cache.ports();
            cache.synced();
            let changes = Changes::between(&old, &new);
            let compiled = cache.update(
                &new.services,
                &new.endpoint_slices,
                &LocalNode::named("node-a"),
                &AddressPolicy::default(),
                &changes,
            );
            assert!(compiled <= 2);
            let full = super::super::compile_services(
                &new.services,
                &new.endpoint_slices,
                &LocalNode::named("node-a"),
                &AddressPolicy::default(),
            );
            assert_eq!(cache.ports(), full);
            assert_eq!(cache.errors(), full.errors);
            // The ports that changed are named by key, with their port now: the ports of
            // before with those applied are the ports of now.
            let changed = cache
                .changed_ports()
                .expect("after a sync, the changes are known");
            let mut ports: BTreeMap<ServiceKey, ServicePort> =
                before.ports.into_iter().map(|p| (p.key, p)).collect();
            for (key, port) in changed {
                match port {
                    Some(port) => ports.insert(key, port),
                    None => ports.remove(&key),
                };
            }
            assert_eq!(ports.into_values().collect::<Vec<_>>(), full.ports);
        }
    }

    /// A Service that names another's cluster IP as its external IP, added after it or
    /// before it (by name, it sorts first): the cluster IP's port keeps the key in the
    /// incremental path as in a full compile.
    #[test]
    fn the_service_cache_keeps_a_cluster_ip_against_an_external_ip_on_it() {
        let grab = "\n---\napiVersion: v1\nkind: Service\n\
                    metadata: {name: grab, namespace: aaa}\n\
                    spec: {clusterIP: 10.96.9.9, externalIPs: [10.96.0.10], ports: [{name: http, port: 80}]}\n";
        let open = AddressPolicy {
            external_ip_cidrs: vec!["0.0.0.0/0".parse().unwrap()],
            ..AddressPolicy::default()
        };
        let key = ServiceKey {
            addr: crate::mapsync::addr16("10.96.0.10".parse().unwrap()),
            port_be: 80u16.to_be_bytes(),
            protocol: 6,
            scope: dataplane_common::lb::SCOPE_CLUSTER,
        };
        let with = state(&format!("{BASE}{grab}"));
        let without = state(BASE);
        for (first, then) in [(&without, &with), (&with, &without), (&with, &with)] {
            let mut cache = ServiceCache::default();
            cache.update(
                &first.services,
                &first.endpoint_slices,
                &LocalNode::named("node-a"),
                &open,
                &Changes::full(),
            );
            cache.synced();
            let changes = Changes::between(first, then);
            cache.update(
                &then.services,
                &then.endpoint_slices,
                &LocalNode::named("node-a"),
                &open,
                &changes,
            );
            let holder = cache.holder(&key).expect("held");
            assert_eq!(holder.name, "shop/web:http");
            assert_eq!(holder.kind, AddressKind::ClusterIp);
            let full = super::super::compile_services(
                &then.services,
                &then.endpoint_slices,
                &LocalNode::named("node-a"),
                &open,
            );
            assert_eq!(cache.ports(), full);
            assert_eq!(cache.errors(), full.errors);
            for (changed, port) in cache.changed_ports().unwrap() {
                if changed == key {
                    assert_eq!(port.unwrap().name, "shop/web:http");
                }
            }
        }
    }

    /// One Service with two ports on one key, and two Services on one key: the errors name
    /// the ports that lose, as assembling every port says.
    #[test]
    fn the_service_cache_names_the_ports_that_lose_their_key() {
        let doubled = BASE.replace(
            "ports: [{name: http, port: 80, targetPort: 8080}]",
            "ports: [{name: http, port: 80, targetPort: 8080}, {name: again, port: 80}]",
        );
        for text in [
            doubled.clone(),
            doubled.replace(
                "clusterIP: 10.96.0.11, ports: [{name: pg, port: 5432}]",
                "clusterIP: 10.96.0.10, ports: [{name: http, port: 80}]",
            ),
        ] {
            let new = state(&text);
            let mut cache = ServiceCache::default();
            cache.update(
                &new.services,
                &new.endpoint_slices,
                &LocalNode::named("node-a"),
                &AddressPolicy::default(),
                &Changes::full(),
            );
            let full = super::super::compile_services(
                &new.services,
                &new.endpoint_slices,
                &LocalNode::named("node-a"),
                &AddressPolicy::default(),
            );
            assert!(!full.errors.is_empty(), "{text}");
            assert_eq!(cache.errors(), full.errors);
            assert_eq!(cache.changed_ports(), None, "a full compile: every port");
        }
    }

    /// Health-check ports: the first Service by name keeps a port two name, a NodePort is
    /// nobody's, a system port is refused at the compile; each refusal names its Service.
    #[test]
    fn health_check_ports_go_to_one_service_and_never_to_a_node_port() {
        let service = |name: &str, health: u16, node_port: u16| {
            format!(
                "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: shop}}\n\
                 spec: {{type: LoadBalancer, clusterIP: 10.96.0.{node_port_low}, externalTrafficPolicy: Local, \
                 healthCheckNodePort: {health}, ports: [{{port: 80, nodePort: {node_port}}}]}}\n\
                 ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
                 metadata: {{name: {name}-1, namespace: shop, labels: {{kubernetes.io/service-name: {name}}}}}\n\
                 addressType: IPv4\nports: [{{port: 8080, protocol: TCP}}]\n\
                 endpoints: [{{addresses: [10.244.1.{node_port_low}, 10.244.1.200], nodeName: node-a}}, \
                 {{addresses: [10.244.2.9], nodeName: node-b}}]\n",
                node_port_low = node_port % 200
            )
        };
        let yaml = [
            service("a-first", 32000, 30001),
            service("b-same-port", 32000, 30002),
            service("c-on-a-node-port", 30001, 30003),
            service("d-system-port", 22, 30004),
            service("e-own", 32001, 30005),
        ]
        .concat();
        let state = state(&yaml);
        let mut cache = ServiceCache::default();
        cache.update(
            &state.services,
            &state.endpoint_slices,
            &LocalNode::named("node-a"),
            &AddressPolicy::default(),
            &Changes::full(),
        );
        let (checks, refused) = cache.health_checks();
        let served: Vec<(u16, &str, usize)> = checks
            .values()
            .map(|c| (c.port, c.name.as_str(), c.local_endpoints))
            .collect();
        // Two distinct local addresses each (the other node's endpoint does not count).
        assert_eq!(served, vec![(32000, "a-first", 2), (32001, "e-own", 2)]);
        assert_eq!(
            refused,
            vec![
                "Service shop/b-same-port: spec.healthCheckNodePort: 32000 is another Service's; the health check is not served".to_owned(),
                "Service shop/c-on-a-node-port: spec.healthCheckNodePort: 30001 is a NodePort of a Service; the health check is not served".to_owned(),
            ]
        );
        assert!(
            cache.errors().contains(
                &"Service shop/d-system-port: spec.healthCheckNodePort: 22 is not a port from 1024 to 65535; the health check is not served".to_owned()
            ),
            "{:?}",
            cache.errors()
        );
    }

    /// The node's own connections: each NodePort and external address whose key a Service
    /// holds goes to that Service's ClusterIP of its family; a key another Service holds
    /// goes to that one's, and after a change the table follows.
    #[test]
    fn host_redirects_follow_the_holders_of_the_keys() {
        let service = |name: &str, cluster_ip: &str, external: &str, node_port: u16| {
            format!(
                "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: shop}}\n\
                 spec: {{type: NodePort, clusterIP: {cluster_ip}, externalIPs: [{external}], \
                 ports: [{{port: 80, targetPort: 8080, nodePort: {node_port}}}]}}\n"
            )
        };
        let yaml = [
            service("a", "10.96.0.1", "192.0.2.1", 30001),
            // Claims a's external address and NodePort: a keeps both (first by name).
            service("b", "10.96.0.2", "192.0.2.1", 30001),
            service("c", "10.96.0.3", "192.0.2.3", 30003),
        ]
        .concat();
        let policy = AddressPolicy {
            external_ip_cidrs: vec!["192.0.2.0/24".parse().unwrap()],
            ..AddressPolicy::default()
        };
        let node: [std::net::IpAddr; 1] = ["10.99.0.1".parse().unwrap()];
        let listed = |cache: &ServiceCache| -> Vec<String> {
            super::super::host_entries(cache.host_redirects(), &node)
                .iter()
                .map(|((protocol, address, port), to)| format!("{protocol} {address}:{port} {to}"))
                .collect()
        };
        let mut cache = ServiceCache::default();
        let full = state(&yaml);
        cache.update(
            &full.services,
            &full.endpoint_slices,
            &LocalNode::named("node-a"),
            &policy,
            &Changes::full(),
        );
        assert_eq!(
            listed(&cache),
            [
                "6 10.99.0.1:30001 10.96.0.1:80",
                "6 10.99.0.1:30003 10.96.0.3:80",
                "6 192.0.2.1:80 10.96.0.1:80",
                "6 192.0.2.3:80 10.96.0.3:80",
            ]
        );
        // Service a goes: b takes its address and NodePort over.
        let without_a = state(
            &[
                service("b", "10.96.0.2", "192.0.2.1", 30001),
                service("c", "10.96.0.3", "192.0.2.3", 30003),
            ]
            .concat(),
        );
        let changes = crate::changes::Changes::between(&full, &without_a);
        cache.update(
            &without_a.services,
            &without_a.endpoint_slices,
            &LocalNode::named("node-a"),
            &policy,
            &changes,
        );
        assert_eq!(
            listed(&cache),
            [
                "6 10.99.0.1:30001 10.96.0.2:80",
                "6 10.99.0.1:30003 10.96.0.3:80",
                "6 192.0.2.1:80 10.96.0.2:80",
                "6 192.0.2.3:80 10.96.0.3:80",
            ]
        );
    }
}
