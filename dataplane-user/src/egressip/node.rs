//! This node's side of egress IPs: the lease the controller's probes renew, and applying the
//! egress maps from the last cluster state and that lease.
//!
//! Safety rests on the lease. Each probe names the addresses the controller grants this node
//! (those the published status gives it). The node holds an address only while the status
//! gives it the address AND a probe granted it less than the reachability timeout ago. The
//! controller gives an address to another node only after the old holder said it let go, or
//! after the timeout (plus a margin) passed since it last granted it: so two nodes never hold
//! one address, even when a node is cut off and cannot hear that it lost it.

use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use hyper::{Method, StatusCode};
use ipnet::IpNet;

use super::{
    compile::{EgressInputs, EgressMaps, InternalCounts, compile_with},
    probe::{KeyFile, Order, PROBE_PATH, Probe, ProbeError, ProbeReply},
};
use crate::{error::AgentError, kernel::loader::Dataplane};

/// The lease, shared between the probe server (renewals, on a thread of its own) and the
/// agent's loop (holding).
#[derive(Debug)]
pub struct Lease {
    node: String,
    state: Mutex<LeaseState>,
    key: Mutex<KeyFile>,
    /// The pods' networks: a probe from one of their addresses is a pod's, refused.
    pod_networks: Mutex<Vec<IpNet>>,
}

#[derive(Debug, Default)]
struct LeaseState {
    /// The latest probe taken.
    last: Order,
    granted: BTreeSet<IpAddr>,
    renewed: Option<Instant>,
    held: BTreeSet<IpAddr>,
}

impl Lease {
    /// The lease of node `node`, its probes checked with the key in `key_file`.
    pub fn new(node: &str, key_file: PathBuf) -> Self {
        Lease {
            node: node.to_owned(),
            state: Mutex::new(LeaseState::default()),
            key: Mutex::new(KeyFile::new(key_file)),
            pod_networks: Mutex::new(Vec::new()),
        }
    }

    /// Answers a probe from `peer` with `query`: refused from a pod's address, unsigned or
    /// signed with another key, meant for another node, or not later than one already taken.
    pub fn answer(&self, peer: IpAddr, query: &str) -> Result<ProbeReply, ProbeError> {
        if let Some(net) = lock(&self.pod_networks).iter().find(|n| n.contains(&peer)) {
            return Err(ProbeError::Refused(format!(
                "{peer} is in the pod network {net}: pods may not probe"
            )));
        }
        let mut key_file = lock(&self.key);
        let key = key_file.key()?;
        let probe = Probe::from_query(query, key)?;
        let reply = self.renew(&probe)?;
        Ok(reply.signed(key))
    }

    /// Takes `probe` (already authenticated): refused when it is meant for another node (a
    /// probe sent to a reused address renews nothing) or when it is not later than one
    /// already taken (a probe delayed on the way, replayed, or from a replica that lost the
    /// lead must not grant again what a later one took away).
    pub fn renew(&self, probe: &Probe) -> Result<ProbeReply, ProbeError> {
        if probe.node != self.node {
            return Err(ProbeError::OtherNode {
                this: self.node.clone(),
                asked: probe.node.clone(),
            });
        }
        let mut state = lock(&self.state);
        if probe.order <= state.last {
            return Err(ProbeError::Stale {
                got: probe.order,
                last: state.last,
            });
        }
        state.last = probe.order;
        state.granted = probe.grants.clone();
        state.renewed = Some(Instant::now());
        Ok(ProbeReply {
            node: self.node.clone(),
            order: probe.order,
            held: state.held.clone(),
            mac: String::new(),
        })
    }

    /// The addresses this node may hold now: all of them without a timeout (the check is
    /// off), else those granted by a probe younger than `timeout`.
    pub fn may_hold(&self, timeout: Option<Duration>) -> Option<BTreeSet<IpAddr>> {
        let timeout = timeout?;
        let state = lock(&self.state);
        Some(match state.renewed {
            Some(at) if at.elapsed() < timeout => state.granted.clone(),
            _ => BTreeSet::new(),
        })
    }

    fn set_held(&self, held: &BTreeSet<IpAddr>) {
        lock(&self.state).held = held.clone();
    }

    fn set_pod_networks(&self, networks: Vec<IpNet>) {
        *lock(&self.pod_networks) = networks;
    }
}

/// A lock of the lease's parts: a panic elsewhere cannot leave one half-written (each field
/// is set whole).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Serves the controller's probes (`GET /egressip/probe?...`) for `lease` on `listener`, from
/// a thread of its own ([`crate::http`]): a probe is answered whatever the agent's loop is
/// doing, so a slow sync never lets a lease lapse.
pub fn serve_probes(listener: std::net::TcpListener, lease: Arc<Lease>) -> std::io::Result<()> {
    if let Ok(address) = listener.local_addr() {
        tracing::info!(%address, "answering the egress IP controller's probes");
    }
    let handler = move |request: &hyper::Request<hyper::body::Incoming>, peer: SocketAddr| {
        if (request.method(), request.uri().path()) != (&Method::GET, PROBE_PATH) {
            return crate::http::reply(
                StatusCode::NOT_FOUND,
                "text/plain",
                format!("only {PROBE_PATH}\n"),
            );
        }
        let query = request.uri().query().unwrap_or_default();
        match lease.answer(peer.ip(), query) {
            Ok(reply) => match serde_json::to_string(&reply) {
                Ok(body) => crate::http::reply(StatusCode::OK, "application/json", body),
                Err(error) => crate::http::reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    format!("{error}\n"),
                ),
            },
            Err(error) => {
                let status = match error {
                    ProbeError::Stale { .. } | ProbeError::OtherNode { .. } => StatusCode::CONFLICT,
                    ProbeError::NoKey(_) => StatusCode::SERVICE_UNAVAILABLE,
                    _ => StatusCode::FORBIDDEN,
                };
                if status == StatusCode::FORBIDDEN {
                    tracing::warn!(%peer, %error, "egress IP probe refused");
                }
                crate::http::reply(status, "text/plain", format!("{error}\n"))
            }
        }
    };
    crate::http::spawn("egressip-probes", listener, Arc::new(handler))
}

/// The agent's egress state between syncs.
pub struct EgressNode {
    pub lease: Arc<Lease>,
    underlay: String,
    inputs: Option<EgressInputs>,
    /// The internal prefixes of `inputs`, once compiled: kept while the networks stay, and
    /// following the nodes' changes.
    internal: Option<InternalCounts>,
    timeout: Option<Duration>,
    applied: Option<EgressMaps>,
}

impl EgressNode {
    /// This node's egress state, its lease's probes checked with the key in `key_file`.
    pub fn new(node: &str, underlay: &str, key_file: PathBuf) -> Self {
        EgressNode {
            lease: Arc::new(Lease::new(node, key_file)),
            underlay: underlay.to_owned(),
            inputs: None,
            internal: None,
            timeout: Some(Duration::from_secs(1)),
            applied: None,
        }
    }

    /// The cluster state a sync read; applied at the next [`EgressNode::apply`].
    pub fn set_inputs(&mut self, inputs: EgressInputs, timeout: Option<Duration>) {
        let same_networks = self.inputs.as_ref().is_some_and(|last| {
            last.cluster_networks == inputs.cluster_networks
                && last.service_networks == inputs.service_networks
        });
        match (&self.inputs, &mut self.internal) {
            (Some(_), Some(internal)) if same_networks => internal.follow_nodes(&inputs.nodes),
            _ => self.internal = None,
        }
        if !same_networks {
            self.lease.set_pod_networks(inputs.cluster_networks.clone());
        }
        self.inputs = Some(inputs);
        self.timeout = timeout;
    }

    /// Replaces the objects' status (the controller's status file changed).
    pub fn set_status(&mut self, statuses: &super::StatusFile) {
        if let Some(inputs) = &mut self.inputs {
            super::merge_status(&mut inputs.objects, statuses);
        }
    }

    /// Compiles and writes the egress maps when they differ from the last applied, then
    /// announces the addresses this node newly holds. Cheap when nothing changed: the agent
    /// calls it often, as the lease ages.
    pub fn apply(&mut self, dataplane: &mut Dataplane) -> Result<(), AgentError> {
        let Some(inputs) = &self.inputs else {
            return Ok(());
        };
        let allowed = self.lease.may_hold(self.timeout);
        let internal = self
            .internal
            .get_or_insert_with(|| InternalCounts::of(inputs))
            .prefixes();
        let desired = compile_with(inputs, internal, |ip| {
            allowed.as_ref().is_none_or(|allowed| allowed.contains(ip))
        });
        if self.applied.as_ref() == Some(&desired) {
            return Ok(());
        }
        let before = self
            .applied
            .as_ref()
            .map(|a| a.held.clone())
            .unwrap_or_default();
        // Withdrawn addresses leave the lease's answer only once they left the maps, and new
        // ones enter it only once they are in: the controller trusts what the reply says.
        // What was applied is taken first: after a failed write the next sync reads the kernel.
        let last = self.applied.take();
        let stats = dataplane.sync_egress(&desired, last.as_ref())?;
        self.lease.set_held(&desired.held);
        for ip in desired.held.difference(&before) {
            tracing::info!(egress_ip = %ip, "holding egress IP");
            if let Err(error) = announce(&self.underlay, *ip) {
                tracing::warn!(egress_ip = %ip, %error, "announcing egress IP");
            }
        }
        for ip in before.difference(&desired.held) {
            tracing::info!(egress_ip = %ip, "egress IP released");
        }
        tracing::debug!(
            written = stats.written,
            deleted = stats.deleted,
            "egress maps synced"
        );
        self.applied = Some(desired);
        Ok(())
    }
}

/// Tells the underlay's hosts that `ip` is now at this node's MAC: a gratuitous ARP request
/// (sender and target both `ip`, broadcast), or an unsolicited neighbour advertisement (to
/// all nodes, override set).
fn announce(underlay: &str, ip: IpAddr) -> std::io::Result<()> {
    let mac = crate::kernel::netdev::mac(underlay)?;
    let ifindex = crate::kernel::preflight::interface_index(underlay)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    match ip {
        IpAddr::V4(v4) => {
            crate::kernel::netdev::send_frame(ifindex, &gratuitous_arp(mac, v4.octets()))
        }
        IpAddr::V6(v6) => {
            crate::kernel::netdev::send_frame(ifindex, &unsolicited_na(mac, v6.octets()))
        }
    }
}

/// An unsolicited neighbour advertisement of `ip` at `mac` (RFC 4861 7.2.6): from `ip` to
/// ff02::1, hop limit 255, override set, with the target link-layer address option.
pub fn unsolicited_na(mac: [u8; 6], ip: [u8; 16]) -> [u8; 86] {
    const ALL_NODES: [u8; 16] = [0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    let mut frame = [0u8; 86];
    frame[0..6].copy_from_slice(&[0x33, 0x33, 0, 0, 0, 1]);
    frame[6..12].copy_from_slice(&mac);
    frame[12..14].copy_from_slice(&0x86ddu16.to_be_bytes());
    frame[14..22].copy_from_slice(&[0x60, 0, 0, 0, 0, 32, 58, 255]);
    frame[22..38].copy_from_slice(&ip);
    frame[38..54].copy_from_slice(&ALL_NODES);
    frame[54..62].copy_from_slice(&[136, 0, 0, 0, 0x20, 0, 0, 0]);
    frame[62..78].copy_from_slice(&ip);
    frame[78..80].copy_from_slice(&[2, 1]);
    frame[80..86].copy_from_slice(&mac);
    let checksum = icmpv6_checksum(&frame[22..54], &frame[54..]);
    frame[56..58].copy_from_slice(&checksum.to_be_bytes());
    frame
}

/// The ICMPv6 checksum of `message` between the `addresses` (source then destination).
fn icmpv6_checksum(addresses: &[u8], message: &[u8]) -> u16 {
    let words = |bytes: &[u8]| -> u32 {
        bytes
            .chunks(2)
            .map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)])))
            .sum()
    };
    let mut sum = words(addresses) + message.len() as u32 + 58 + words(message);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An Ethernet broadcast ARP request announcing `ip` at `mac`.
pub fn gratuitous_arp(mac: [u8; 6], ip: [u8; 4]) -> [u8; 42] {
    let mut frame = [0u8; 42];
    frame[0..6].copy_from_slice(&[0xff; 6]);
    frame[6..12].copy_from_slice(&mac);
    frame[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    // Ethernet, IPv4, 6-byte and 4-byte addresses, request.
    frame[14..22].copy_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 1]);
    frame[22..28].copy_from_slice(&mac);
    frame[28..32].copy_from_slice(&ip);
    frame[32..38].copy_from_slice(&[0; 6]);
    frame[38..42].copy_from_slice(&ip);
    frame
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(node: &str, epoch: u64, counter: u64, grants: &[IpAddr]) -> Probe {
        Probe {
            node: node.into(),
            order: Order { epoch, counter },
            grants: grants.iter().copied().collect(),
        }
    }

    #[test]
    fn the_lease_grants_only_while_fresh_only_to_its_node_and_only_later_probes() {
        let lease = Lease::new("node-1", PathBuf::from("/nonexistent"));
        let ip: IpAddr = "10.99.0.50".parse().unwrap();
        assert_eq!(
            lease.may_hold(Some(Duration::from_secs(1))),
            Some(BTreeSet::new())
        );
        assert!(lease.renew(&probe("node-2", 1, 1, &[ip])).is_err());
        assert_eq!(
            lease.may_hold(Some(Duration::from_secs(1))),
            Some(BTreeSet::new())
        );
        let reply = lease.renew(&probe("node-1", 1, 2, &[ip])).unwrap();
        assert_eq!(reply.node, "node-1");
        assert_eq!(
            reply.order,
            Order {
                epoch: 1,
                counter: 2
            }
        );
        for (epoch, counter) in [(1, 1), (1, 2), (0, 99)] {
            assert!(
                matches!(
                    lease.renew(&probe("node-1", epoch, counter, &[])),
                    Err(ProbeError::Stale { .. })
                ),
                "a late or replayed probe ({epoch}, {counter}) is refused"
            );
        }
        assert_eq!(
            lease.may_hold(Some(Duration::from_secs(1))),
            Some(BTreeSet::from([ip]))
        );
        // A new leader's epoch goes on from any counter.
        assert!(lease.renew(&probe("node-1", 2, 1, &[ip])).is_ok());
        assert_eq!(
            lease.may_hold(Some(Duration::ZERO)),
            Some(BTreeSet::new()),
            "an expired grant holds nothing"
        );
        assert_eq!(lease.may_hold(None), None, "the check off: no limit");
    }

    #[test]
    fn probes_need_the_key_and_no_pod_may_send_one() {
        use super::super::probe::ProbeKey;
        let dir = std::env::temp_dir().join(format!("lease-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("key");
        let lease = Lease::new("node-1", path.clone());
        lease.set_pod_networks(vec!["10.244.0.0/16".parse().unwrap()]);
        let ip: IpAddr = "10.99.0.50".parse().unwrap();
        let controller: IpAddr = "10.99.0.254".parse().unwrap();
        // No key yet: nothing is taken.
        std::fs::write(&path, "0123456789abcdef0123456789abcdef").unwrap();
        let key = ProbeKey::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let query = probe("node-1", 1, 1, &[ip]).to_query(&key);
        assert!(matches!(
            lease.answer(controller, &query),
            Err(ProbeError::NoKey(_))
        ));
        std::fs::write(&path, "0123456789abcdef0123456789abcdef").unwrap();
        // The forged probe of the issue: unsigned, `seq` at its largest.
        let forged = "node=node-1&epoch=18446744073709551615&counter=18446744073709551615&grant=";
        assert!(lease.answer(controller, forged).is_err());
        // From a pod's address, even signed.
        assert!(matches!(
            lease.answer("10.244.1.7".parse().unwrap(), &query),
            Err(ProbeError::Refused(_))
        ));
        // Signed, from the controller: taken, and the reply signed for the controller.
        let reply = lease.answer(controller, &query).unwrap();
        assert_eq!(reply.check(&key, &probe("node-1", 1, 1, &[ip])), Ok(()));
        assert_eq!(
            lease.may_hold(Some(Duration::from_secs(1))),
            Some(BTreeSet::from([ip]))
        );
        // The forgery changed nothing: the next real probe is still taken.
        let next = probe("node-1", 1, 2, &[]).to_query(&key);
        assert!(lease.answer(controller, &next).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_unsolicited_na_overrides_with_a_valid_checksum() {
        let ip: std::net::Ipv6Addr = "fd99::50".parse().unwrap();
        let frame = unsolicited_na([2, 0, 0, 0, 0, 1], ip.octets());
        assert_eq!(frame[54], 136);
        assert_eq!(frame[58], 0x20, "override, not solicited");
        assert_eq!(frame[62..78], ip.octets());
        // Summed again with the checksum in place, the message checks out.
        assert_eq!(icmpv6_checksum(&frame[22..54], &frame[54..]), 0);
    }

    #[test]
    fn the_gratuitous_arp_names_the_address_as_sender_and_target() {
        let frame = gratuitous_arp([2, 0, 0, 0, 0, 1], [10, 99, 0, 50]);
        assert_eq!(frame[..6], [0xff; 6]);
        assert_eq!(frame[12..14], [0x08, 0x06]);
        assert_eq!(frame[20..22], [0, 1], "a request");
        assert_eq!(frame[22..28], [2, 0, 0, 0, 0, 1]);
        assert_eq!(frame[28..32], [10, 99, 0, 50]);
        assert_eq!(frame[38..42], [10, 99, 0, 50]);
    }
}
