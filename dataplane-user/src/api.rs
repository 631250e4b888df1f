//! The Kubernetes objects this project defines or reads beyond k8s-openapi's types, and the
//! checks they must pass before anything uses them: pure, no I/O, importing nothing of the
//! agent. The sources (`source`, `kubernetes`) decode objects into these types and refuse
//! what does not validate with the object and field named; the features compile them.

pub mod adminpolicy;
pub mod egressfirewall;
pub mod egressip;
pub mod egressrouter;
pub mod network;
pub mod userdefinednetwork;
