//! Egress router pods in redirect mode (OpenShift's egress router, with OVN-Kubernetes): a pod
//! with a second interface, a macvlan on the node's NIC holding an address reserved on the
//! node network, that sends what its clients send it on to chosen destinations with that
//! address as the source. The `egress-router` CNI plugin (the binary of that name, `config`,
//! `plugin`, `wire`) which Multus runs for the router pod's NetworkAttachmentDefinition; the
//! addresses it may claim (`reservations`, written by each node's agent); and the
//! controller's making of the router's objects from an `EgressRouter` (`resource`,
//! `controller`).

pub mod config;
pub mod controller;
pub mod plugin;
pub mod reservations;
pub mod resource;
pub mod wire;
