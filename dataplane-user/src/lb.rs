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

mod cache;

mod address;
mod compile;
mod maglev;
mod snat;
mod state;
mod sync;

// What the tests beside this module take from here with `use super::*`.
#[cfg(test)]
use {
    crate::mapsync::addr16,
    compile::SERVICES_PER_TASK,
    dataplane_common::lb::{
        Backend, MAGLEV_TABLE_SIZE, NODEPORT_ANY_V4, SCOPE_CLUSTER, SCOPE_EXTERNAL, SCOPE_NODEPORT,
        ServiceKey,
    },
    maglev::maglev_permutation,
    snat::with_snat_ports,
    state::backend_value,
    std::{
        collections::{BTreeMap, BTreeSet},
        net::IpAddr,
    },
};

pub use address::{AddressKind, AddressPolicy};
pub use compile::{
    BackendAddr, CompiledService, CompiledServices, ServiceCompiled, ServiceName, ServicePort,
    assemble, compile_each, compile_services, key_taken,
};
pub use maglev::maglev_table;
pub use snat::reserve_snat_ports;
pub use state::{LbState, LbSyncStats, port_bitmaps};

pub use cache::ServiceCache;

#[cfg(test)]
mod tests;
