//! Egress router pods in redirect mode (OpenShift's egress router, with OVN-Kubernetes): a pod
//! with a second interface, a macvlan on the node's NIC holding an address reserved on the
//! node network, that sends what its clients send it on to chosen destinations with that
//! address as the source. This part is the `egress-router` CNI plugin (the binary of that
//! name) which Multus runs for the router pod's NetworkAttachmentDefinition.

pub mod config;
pub mod controller;
pub mod plugin;
pub mod resource;
pub mod wire;
