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
//! target ports: the kernel keeps SCTP's CRC32c right across the rewrite. As kube-proxy: the
//! endpoints' topology hints narrow a node's ready endpoints (`compile`), load-balancer
//! addresses admit new flows from their source ranges alone (`ranges`), `ipMode: Proxy`
//! addresses and other proxies' Services are left alone, and every node answers the
//! health-check ports of `externalTrafficPolicy: Local` Services and kube-proxy's node health
//! (`health`).

mod cache;

mod address;
mod compile;
mod describe;
mod health;
mod host;
mod maglev;
mod ranges;
mod snat;
pub mod socket;
mod state;
mod sync;
mod topology;

// What the tests beside this module take from here with `use super::*`.
#[cfg(test)]
use {
    crate::mapsync::addr16,
    compile::SERVICES_PER_TASK,
    dataplane_common::lb::{
        Backend, MAGLEV_TABLE_SIZE, NODEPORT_ANY_V4, SCOPE_CLUSTER, SCOPE_EXTERNAL, SCOPE_NODEPORT,
        SCOPE_NODEPORT_FROM_POD, ServiceKey,
    },
    maglev::maglev_permutation,
    snat::with_snat_ports,
    state::backend_value,
    std::{
        collections::{BTreeMap, BTreeSet},
        net::IpAddr,
    },
};

pub use address::{AddressKind, AddressPolicy, ExternalIpSource};
pub use compile::{
    BackendAddr, CompiledService, CompiledServices, HEADLESS_LABEL, HealthCheck, MAX_SOURCE_RANGES,
    MIN_HEALTH_CHECK_PORT, SERVICE_PROXY_NAME_LABEL, ServiceCompiled, ServiceName, ServicePort,
    assemble, compile_each, compile_services, key_taken,
};
pub use describe::{
    Described, DescribedHealthCheck, DescribedPort, STATE_FILE as DESCRIBED_FILE, described_key,
    read_described,
};
pub use host::{
    HostRedirect, NodePortAddresses, TABLE as HOST_TABLE, apply as apply_host_table, host_entries,
    remove as remove_host_table, script as host_script,
};
pub use maglev::maglev_table;
pub use ranges::{RANGE_KEY_LEN, RangeEntries, admitted_sources, range_entries};
pub use snat::reserve_snat_ports;
pub use state::{LbState, LbSyncStats, port_bitmaps};
pub use topology::{LocalNode, ZONE_LABEL};

pub use cache::ServiceCache;
pub use health::{
    HealthServers, ProxyHealth, TO_BE_DELETED_TAINT, health_answer, node_eligible,
    serve_proxy_health,
};

#[cfg(test)]
mod tests;
