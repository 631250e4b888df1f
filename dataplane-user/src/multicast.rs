//! Multicast per namespace, the agent's side (the kernel's is `dataplane-ebpf/src/multicast.rs`).
//!
//! A namespace annotated `k8s.ovn.org/multicast-enabled: "true"` lets its pods send and
//! receive multicast among themselves; every other pod sends and receives none. The agent:
//! - writes the local pods of enabled namespaces into `DP_MCAST_PODS` at every sync;
//! - learns their memberships from the IGMP and MLD messages the kernel hands it
//!   (`DP_MCAST_REPORTS`), and ages them out after `2 × query interval + 10 s` without a
//!   report (260 s by default, as IGMP's defaults give);
//! - is the querier of those pods only: a general query every query interval (and at once
//!   when a pod's namespace is enabled, so that its memberships are reported without a
//!   restart), a group's query twice a second apart after a leave;
//! - tells the other nodes hosting pods of the same namespaces which groups have members here
//!   ([`peers`]) and learns theirs;
//! - writes each group's local members and member nodes into `DP_MCAST_GROUPS`, which the
//!   kernel copies packets by.

pub mod peers;
pub mod wire;

mod plan;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv6Addr, SocketAddr},
    path::PathBuf,
    time::{Duration, Instant, SystemTime},
};

use aya::maps::{HashMap as BpfHashMap, MapData, RingBuf};
use dataplane_common::{
    maps,
    multicast::{
        MAX_GROUPS, MAX_LOCAL_MEMBERS, MAX_REMOTE_MEMBERS, McastGroup, McastKey, McastPod,
        McastReport,
    },
    overlay::TunnelEndpoint,
};
use plan::MAX_RESPONSE;
use serde::Serialize;
use tokio::io::unix::AsyncFd;

use crate::kernel::capacity::map_err;
use crate::{
    cni::{GATEWAY_V4, GATEWAY_V6},
    error::AgentError,
    kernel::loader::Dataplane,
    mapsync::{addr16, ip_of, sync_hash},
};

pub use plan::{ENABLED_ANNOTATION, Peer, Plan, PlanPod, Settings, plan};

/// Where the agent describes its groups for `dataplane inspect multicast`.
pub const STATE_FILE: &str = "multicast.json";
/// Queries sent for a group after a leave, a second apart (last member query count and
/// interval).
const LAST_MEMBER_QUERIES: u32 = 2;
const LAST_MEMBER_INTERVAL: Duration = Duration::from_secs(1);

/// Each group this node copies for, and where: (host veths of local members, nodes with
/// members).
type Destinations<'a> = BTreeMap<peers::Group, (Vec<u32>, Vec<&'a str>)>;

/// What woke the multicast agent.
#[derive(Clone, Copy, Debug)]
pub enum Wake {
    Reports,
    Announcement,
    Timer,
}

/// A query waiting to be sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct PendingQuery {
    at: Instant,
    ifindex: u32,
    /// None: a general query.
    group: Option<IpAddr>,
    /// Queries of this group still to send after this one.
    remaining: u32,
}

/// The groups as `dataplane inspect multicast` shows them.
#[derive(Debug, Default, Serialize, serde::Deserialize)]
pub struct Described {
    pub namespaces: BTreeMap<String, u32>,
    /// Local pods of enabled namespaces by host veth ifindex.
    pub pods: BTreeMap<u32, String>,
    /// The peer nodes by underlay address.
    pub nodes: BTreeMap<IpAddr, String>,
    pub groups: Vec<DescribedGroup>,
    /// Joins refused because the node held [`MAX_GROUPS`] groups.
    pub refused_joins: u64,
}

#[derive(Debug, Serialize, serde::Deserialize)]
pub struct DescribedGroup {
    pub namespace: String,
    pub group: IpAddr,
    /// Local members (`namespace/name`) and the seconds left before each ages out.
    pub local: Vec<(String, u64)>,
    /// Other nodes with members.
    pub remote: Vec<String>,
}

/// The agent's multicast state between syncs.
pub struct MulticastAgent {
    settings: Settings,
    node: String,
    plan: Plan,
    reports: Option<AsyncFd<RingBuf<MapData>>>,
    peers: Option<tokio::net::UdpSocket>,
    /// Local memberships: group -> host veth -> when it ages out.
    local: BTreeMap<(String, IpAddr), BTreeMap<u32, Instant>>,
    received: peers::Received,
    queries: BTreeSet<PendingQuery>,
    next_general_query: Option<Instant>,
    next_announce: Option<Instant>,
    /// The groups last announced.
    announced: Option<BTreeSet<peers::Group>>,
    refused: u64,
    /// Announcements refused (unsigned, forged, too large, from no node): counted, logged
    /// once in a while, so a flood of them costs no log flood.
    refused_announcements: u64,
    key: Option<crate::egressip::probe::KeyFile>,
    state_file: PathBuf,
    /// What the pinned groups map held at start, adopted at the first plan.
    adopted: Adopted,
}

impl MulticastAgent {
    /// Opens the report ring and the announcement socket. What cannot be opened is said in a
    /// warning, and that part of multicast stays off.
    pub fn start(
        dataplane: &mut Dataplane,
        settings: Settings,
        node: &str,
        run_dir: &std::path::Path,
    ) -> Result<Self, AgentError> {
        let reports = crate::acl::agent::open_ring(dataplane, maps::MCAST_REPORTS)?;
        let peers = match bind_peer_socket(settings.peer_port) {
            Ok(socket) => Some(socket),
            Err(error) => {
                tracing::warn!(%error, port = settings.peer_port, "multicast announcements cannot be received: other nodes' members get no copies from here");
                None
            }
        };
        let mut agent = Self::new(settings, node, run_dir.join(STATE_FILE));
        agent.reports = reports;
        agent.peers = peers;
        agent.adopted = adopt(dataplane)?;
        Ok(agent)
    }

    /// An agent with nothing learnt yet and nothing opened.
    fn new(settings: Settings, node: &str, state_file: PathBuf) -> Self {
        Self {
            key: settings
                .key_file
                .clone()
                .map(crate::egressip::probe::KeyFile::new),
            refused_announcements: 0,
            settings,
            node: node.to_owned(),
            plan: Plan::default(),
            reports: None,
            peers: None,
            local: BTreeMap::new(),
            received: peers::Received::default(),
            queries: BTreeSet::new(),
            next_general_query: None,
            next_announce: None,
            announced: None,
            refused: 0,
            state_file,
            adopted: Adopted::default(),
        }
    }

    /// Takes a new plan: the pods' records written, memberships of pods that left (or whose
    /// namespace turned multicast off) dropped, newly enabled pods queried at once. Returns
    /// the map entries written.
    pub fn configure(
        &mut self,
        dataplane: &mut Dataplane,
        plan: Plan,
    ) -> Result<usize, AgentError> {
        for error in &plan.errors {
            tracing::warn!(%error, "multicast");
        }
        let now = Instant::now();
        for (ifindex, pod) in &plan.pods {
            if self.plan.pods.get(ifindex) != Some(pod) {
                tracing::info!(pod = %pod.name, "multicast enabled for pod: querying its memberships");
                self.queries.insert(PendingQuery {
                    at: now,
                    ifindex: *ifindex,
                    group: None,
                    remaining: 0,
                });
            }
        }
        self.take_adopted(&plan, now);
        for ((namespace, _), members) in self.local.iter_mut() {
            members.retain(|ifindex, _| {
                plan.pods
                    .get(ifindex)
                    .is_some_and(|pod| &pod.namespace == namespace)
            });
        }
        self.local.retain(|_, members| !members.is_empty());
        self.queries.retain(|q| plan.pods.contains_key(&q.ifindex));
        if plan.pods.is_empty() {
            self.next_general_query = None;
        } else if self.next_general_query.is_none() {
            self.next_general_query = Some(now + self.settings.query_interval);
        }
        self.plan = plan;
        let nodes: BTreeSet<&str> = self
            .plan
            .node_addresses
            .values()
            .map(String::as_str)
            .collect();
        self.received.expire(now, &nodes);
        let pods: BTreeMap<u32, McastPod> = self
            .plan
            .pods
            .iter()
            .map(|(ifindex, pod)| {
                (
                    *ifindex,
                    McastPod {
                        namespace: self.plan.namespaces[&pod.namespace],
                        _pad: 0,
                    },
                )
            })
            .collect();
        let mut map: BpfHashMap<&mut MapData, u32, McastPod> =
            dataplane.typed_map(maps::MCAST_PODS)?;
        let stats = sync_hash(&mut map, &pods).map_err(map_err(maps::MCAST_PODS, "sync"))?;
        let written = self.write_groups(dataplane)?;
        self.announce(now);
        Ok(stats.written + stats.deleted + written)
    }

    /// What a restarted agent found pinned, for the pods and nodes still there: the local
    /// memberships (renewed by the next reports, or aging out), and the member nodes (kept
    /// for one hold time, until their own announcements arrive), so that no copy stops
    /// across the restart.
    fn take_adopted(&mut self, plan: &Plan, now: Instant) {
        let adopted = std::mem::take(&mut self.adopted);
        let by_id: BTreeMap<u32, &String> =
            plan.namespaces.iter().map(|(n, id)| (*id, n)).collect();
        for (id, group, ifindex) in adopted.local {
            if let (Some(namespace), Some(pod)) = (by_id.get(&id), plan.pods.get(&ifindex))
                && &pod.namespace == *namespace
            {
                self.local
                    .entry(((*namespace).clone(), group))
                    .or_default()
                    .insert(ifindex, now + self.settings.membership_timeout());
            }
        }
        let node_at: BTreeMap<IpAddr, &String> = plan
            .peers
            .iter()
            .map(|(name, peer)| (peer.address, name))
            .collect();
        let mut remote: BTreeMap<&String, BTreeSet<peers::Group>> = BTreeMap::new();
        for (id, group, address) in adopted.remote {
            if let (Some(namespace), Some(node)) = (by_id.get(&id), node_at.get(&address)) {
                remote
                    .entry(*node)
                    .or_default()
                    .insert(((*namespace).clone(), group));
            }
        }
        for (node, groups) in remote {
            self.received
                .adopt(node, groups, now + self.settings.peer_hold());
        }
    }

    /// Waits for reports, an announcement or the next timer.
    pub async fn wait(&self) -> Wake {
        let due = self.next_due();
        let timer = async {
            match due {
                Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
                None => std::future::pending().await,
            }
        };
        let announcement = async {
            match &self.peers {
                Some(socket) => {
                    if socket.readable().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = crate::acl::agent::readable(self.reports.as_ref()) => Wake::Reports,
            () = announcement => Wake::Announcement,
            () = timer => Wake::Timer,
        }
    }

    /// Does what [`MulticastAgent::wait`] woke up for.
    pub fn handle(&mut self, dataplane: &mut Dataplane, wake: Wake) -> Result<(), AgentError> {
        let now = Instant::now();
        let changed = match wake {
            Wake::Reports => self.take_reports(now),
            Wake::Announcement => self.take_announcements(now),
            Wake::Timer => self.run_timers(now),
        };
        if changed {
            self.write_groups(dataplane)?;
        }
        self.announce(now);
        Ok(())
    }

    /// The earliest of the timers.
    fn next_due(&self) -> Option<Instant> {
        let local_expiry = self
            .local
            .values()
            .flat_map(|members| members.values())
            .min()
            .copied();
        [
            local_expiry,
            self.received.next_expiry(),
            self.queries.first().map(|q| q.at),
            self.next_general_query,
            self.next_announce,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Applies the IGMP and MLD messages the kernel copied; whether the groups changed.
    fn take_reports(&mut self, now: Instant) -> bool {
        let mut messages = Vec::new();
        if let Some(fd) = self.reports.as_mut() {
            let ring = fd.get_mut();
            while let Some(item) = ring.next() {
                if item.len() < std::mem::size_of::<McastReport>() {
                    continue;
                }
                // SAFETY: the kernel wrote a McastReport (plain data) of at least this size.
                let report: McastReport = unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
                messages.push(report);
            }
        }
        let mut changed = false;
        for report in messages {
            let len = (report.len as usize).min(report.message.len());
            changed |= self.take_report(report.ifindex, report.family, &report.message[..len], now);
        }
        changed
    }

    /// One pod's message; whether the groups changed.
    fn take_report(&mut self, ifindex: u32, family: u32, message: &[u8], now: Instant) -> bool {
        let Some(pod) = self.plan.pods.get(&ifindex) else {
            return false;
        };
        let namespace = pod.namespace.clone();
        let changes = match wire::changes(family, message) {
            Ok(changes) => changes,
            Err(error) => {
                tracing::debug!(pod = %pod.name, %error, "multicast message ignored");
                return false;
            }
        };
        let mut changed = false;
        for change in changes {
            match change {
                wire::Change::Join(group) => {
                    let key = (namespace.clone(), group);
                    if !self.local.contains_key(&key) && self.group_count() >= MAX_GROUPS as usize {
                        self.refused += 1;
                        tracing::warn!(pod = %self.plan.pods[&ifindex].name, %group, limit = MAX_GROUPS, refused = self.refused, "multicast join refused: the node holds as many groups as it can");
                        continue;
                    }
                    let members = self.local.entry(key).or_default();
                    if members.len() >= MAX_LOCAL_MEMBERS && !members.contains_key(&ifindex) {
                        self.refused += 1;
                        tracing::warn!(%group, limit = MAX_LOCAL_MEMBERS, "multicast join refused: the group has as many members on this node as it can");
                        continue;
                    }
                    changed |= members
                        .insert(ifindex, now + self.settings.membership_timeout())
                        .is_none();
                }
                wire::Change::Leave(group) => {
                    let key = (namespace.clone(), group);
                    if let Some(members) = self.local.get_mut(&key) {
                        // One host behind each veth: its leave is its last socket's, so the
                        // membership goes at once; the group's queries give it a chance to
                        // say otherwise.
                        changed |= members.remove(&ifindex).is_some();
                        if members.is_empty() {
                            self.local.remove(&key);
                        }
                    }
                    self.queries.insert(PendingQuery {
                        at: now,
                        ifindex,
                        group: Some(group),
                        remaining: LAST_MEMBER_QUERIES - 1,
                    });
                }
            }
        }
        changed
    }

    /// Groups held: local ones and other nodes' (of namespaces with pods here).
    fn group_count(&self) -> usize {
        self.desired_groups().len()
    }

    /// Takes the other agents' announcements; whether their groups changed.
    fn take_announcements(&mut self, now: Instant) -> bool {
        let Some(socket) = &self.peers else {
            return false;
        };
        let mut buffer = vec![0u8; 65_536];
        let mut changed = false;
        loop {
            match socket.try_recv_from(&mut buffer) {
                Ok((len, from)) => {
                    let from = canonical(from.ip());
                    let key = self.key.as_mut().and_then(|k| k.key().ok());
                    match peers::decode(&buffer[..len], from, &self.plan.node_addresses, key) {
                        Ok(announcement) => {
                            changed |=
                                self.received
                                    .take(announcement, now, self.settings.peer_hold());
                        }
                        Err(error) => {
                            self.refused_announcements += 1;
                            if self.refused_announcements.is_power_of_two() {
                                tracing::warn!(%error, refused = self.refused_announcements, "multicast announcement refused");
                            }
                        }
                    }
                }
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(error) => {
                    tracing::warn!(%error, "receiving multicast announcements");
                    break;
                }
            }
        }
        changed
    }

    /// Ages memberships out and sends the queries that are due; whether the groups changed.
    fn run_timers(&mut self, now: Instant) -> bool {
        let mut changed = false;
        for ((namespace, group), members) in self.local.iter_mut() {
            let before = members.len();
            members.retain(|_, expires| *expires > now);
            if members.len() != before {
                tracing::info!(%namespace, %group, "multicast membership aged out");
                changed = true;
            }
        }
        self.local.retain(|_, members| !members.is_empty());
        let nodes: BTreeSet<&str> = self
            .plan
            .node_addresses
            .values()
            .map(String::as_str)
            .collect();
        changed |= self.received.expire(now, &nodes);
        if self.next_general_query.is_some_and(|at| at <= now) {
            for ifindex in self.plan.pods.keys() {
                self.queries.insert(PendingQuery {
                    at: now,
                    ifindex: *ifindex,
                    group: None,
                    remaining: 0,
                });
            }
            self.next_general_query = Some(now + self.settings.query_interval);
        }
        while let Some(query) = self.queries.first().copied() {
            if query.at > now {
                break;
            }
            self.queries.remove(&query);
            self.send_query(query);
            if query.remaining > 0 {
                self.queries.insert(PendingQuery {
                    at: now + LAST_MEMBER_INTERVAL,
                    remaining: query.remaining - 1,
                    ..query
                });
            }
        }
        changed
    }

    /// Sends one query into a pod: IGMPv3 and MLDv2 as its addresses ask (a group's query in
    /// the group's family only).
    fn send_query(&self, query: PendingQuery) {
        let Some(pod) = self.plan.pods.get(&query.ifindex) else {
            return;
        };
        let interval = self.settings.query_interval.as_secs().min(127) as u8;
        let max_response_tenths = match query.group {
            Some(_) => 10,
            None => (MAX_RESPONSE.as_millis() / 100) as u8,
        };
        let mut sources = Vec::new();
        if pod.ipv4 && query.group.is_none_or(|g| g.is_ipv4()) {
            sources.push(IpAddr::V4(GATEWAY_V4));
        }
        if pod.ipv6 && query.group.is_none_or(|g| g.is_ipv6()) {
            sources.push(IpAddr::V6(GATEWAY_V6));
        }
        for source in sources {
            let frame = wire::query_frame(
                &wire::Query {
                    source,
                    group: query.group,
                    max_response_tenths,
                    interval_secs: interval,
                },
                pod.host_mac,
            );
            if let Err(error) = crate::kernel::netdev::send_frame(query.ifindex, &frame) {
                tracing::warn!(pod = %pod.name, %error, "sending a multicast query");
            }
        }
    }

    /// Every group this node copies for: its local members' (of enabled namespaces) and the
    /// other nodes' groups of namespaces with pods here.
    fn desired_groups(&self) -> Destinations<'_> {
        let mut groups = Destinations::new();
        for (key, members) in &self.local {
            groups.entry(key.clone()).or_default().0 = members.keys().copied().collect();
        }
        for (node, announced) in self.received.nodes() {
            if !self.plan.peers.contains_key(node) {
                continue;
            }
            for key in announced {
                if !self.plan.local_namespaces.contains(&key.0) {
                    continue;
                }
                groups.entry(key.clone()).or_default().1.push(node);
            }
        }
        groups
    }

    /// Brings `DP_MCAST_GROUPS` to the groups; returns the entries written or removed.
    fn write_groups(&mut self, dataplane: &mut Dataplane) -> Result<usize, AgentError> {
        let mut desired: BTreeMap<McastKey, McastGroup> = BTreeMap::new();
        let groups = self.desired_groups();
        for ((namespace, group), (local, remote)) in &groups {
            let Some(id) = self.plan.namespaces.get(namespace) else {
                continue;
            };
            if desired.len() >= MAX_GROUPS as usize {
                tracing::warn!(
                    limit = MAX_GROUPS,
                    "multicast groups past the limit left out"
                );
                break;
            }
            let mut entry = McastGroup::default();
            for (slot, ifindex) in entry.local.iter_mut().zip(local) {
                *slot = *ifindex;
            }
            entry.local_count = local.len().min(MAX_LOCAL_MEMBERS) as u32;
            let endpoints: Vec<TunnelEndpoint> = remote
                .iter()
                .filter_map(|node| self.plan.peers.get(*node))
                .map(|peer| peer.endpoint)
                .collect();
            if endpoints.len() > MAX_REMOTE_MEMBERS {
                tracing::warn!(%namespace, %group, nodes = endpoints.len(), limit = MAX_REMOTE_MEMBERS, "multicast group has members on more nodes than one packet is copied to");
            }
            for (slot, endpoint) in entry.remote.iter_mut().zip(&endpoints) {
                *slot = *endpoint;
            }
            entry.remote_count = endpoints.len().min(MAX_REMOTE_MEMBERS) as u32;
            desired.insert(
                McastKey {
                    namespace: *id,
                    group: addr16(*group),
                },
                entry,
            );
        }
        let mut map: BpfHashMap<&mut MapData, McastKey, McastGroup> =
            dataplane.typed_map(maps::MCAST_GROUPS)?;
        let stats = sync_hash(&mut map, &desired).map_err(map_err(maps::MCAST_GROUPS, "sync"))?;
        if stats.written + stats.deleted > 0 {
            tracing::info!(
                groups = desired.len(),
                written = stats.written,
                deleted = stats.deleted,
                "multicast groups updated"
            );
        }
        self.describe(&groups);
        Ok(stats.written + stats.deleted)
    }

    /// Writes what `dataplane inspect multicast` shows.
    fn describe(&self, groups: &Destinations<'_>) {
        let now = Instant::now();
        let described = Described {
            namespaces: self.plan.namespaces.clone(),
            pods: self
                .plan
                .pods
                .iter()
                .map(|(i, p)| (*i, p.name.clone()))
                .collect(),
            nodes: self
                .plan
                .peers
                .iter()
                .map(|(n, p)| (p.address, n.clone()))
                .collect(),
            groups: groups
                .iter()
                .map(|((namespace, group), (local, remote))| DescribedGroup {
                    namespace: namespace.clone(),
                    group: *group,
                    local: local
                        .iter()
                        .map(|ifindex| {
                            let name = self
                                .plan
                                .pods
                                .get(ifindex)
                                .map_or_else(|| ifindex.to_string(), |p| p.name.clone());
                            let left = self.local[&(namespace.clone(), *group)]
                                .get(ifindex)
                                .map_or(0, |at| at.saturating_duration_since(now).as_secs());
                            (name, left)
                        })
                        .collect(),
                    remote: remote.iter().map(|n| (*n).to_owned()).collect(),
                })
                .collect(),
            refused_joins: self.refused,
        };
        // Written aside and renamed over: `inspect multicast` (and a test reading it while
        // the groups change) must see the old description or the new, never a cut one.
        if let Err(error) =
            crate::kernel::state::write_json_replacing(&self.state_file, &described, false)
        {
            tracing::debug!(%error, "writing the multicast state file");
        }
    }

    /// Sends this node's groups to its peers when they changed or the refresh is due.
    fn announce(&mut self, now: Instant) {
        let Some(socket) = &self.peers else {
            return;
        };
        if self.plan.peers.is_empty() {
            self.next_announce = None;
            return;
        }
        let groups: BTreeSet<peers::Group> = self.local.keys().cloned().collect();
        let due = self.next_announce.is_none_or(|at| at <= now);
        if !due && self.announced.as_ref() == Some(&groups) {
            return;
        }
        let generation = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let key = self.key.as_mut().and_then(|k| k.key().ok());
        let datagrams = peers::encode(&self.node, generation, &groups, key);
        for peer in self.plan.peers.values() {
            let to = SocketAddr::new(peer.address, self.settings.peer_port);
            for datagram in &datagrams {
                if let Err(error) = socket.try_send_to(datagram, to) {
                    tracing::debug!(%error, %to, "sending a multicast announcement");
                }
            }
        }
        self.announced = Some(groups);
        self.next_announce = Some(now + self.settings.announce_every);
    }
}

/// What a previous agent left in the pinned groups map.
#[derive(Debug, Default)]
struct Adopted {
    /// (namespace id, group, host veth) of each local member.
    local: Vec<(u32, IpAddr, u32)>,
    /// (namespace id, group, underlay address) of each member node.
    remote: Vec<(u32, IpAddr, IpAddr)>,
}

fn adopt(dataplane: &mut Dataplane) -> Result<Adopted, AgentError> {
    let map: BpfHashMap<&mut MapData, McastKey, McastGroup> =
        dataplane.typed_map(maps::MCAST_GROUPS)?;
    let mut found = Adopted::default();
    for (key, group) in map.iter().filter_map(Result::ok) {
        let address = ip_of(&key.group);
        for ifindex in group.local.iter().take(group.local_count as usize) {
            found.local.push((key.namespace, address, *ifindex));
        }
        for endpoint in group.remote.iter().take(group.remote_count as usize) {
            found
                .remote
                .push((key.namespace, address, ip_of(&endpoint.addr)));
        }
    }
    Ok(found)
}

/// An address as it compares with the nodes' (an IPv4-mapped IPv6 address as IPv4).
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// A UDP socket on every address of the node (IPv4 and IPv6) at `port`.
fn bind_peer_socket(port: u16) -> std::io::Result<tokio::net::UdpSocket> {
    // An IPv6 socket on `::` takes IPv4 too (as IPv4-mapped) where the host allows it, the
    // default; an IPv4 one is the fallback.
    let socket =
        std::net::UdpSocket::bind(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port))
            .or_else(|_| {
                std::net::UdpSocket::bind(SocketAddr::new(
                    IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
                    port,
                ))
            })?;
    socket.set_nonblocking(true)?;
    tokio::net::UdpSocket::from_std(socket)
}

// What the tests below take from here with `use super::*`.
#[cfg(test)]
use dataplane_common::multicast::namespace_id;

#[cfg(test)]
mod tests {
    use super::*;

    /// An agent with no kernel, sockets or files: its membership logic alone.
    fn detached(plan: Plan) -> MulticastAgent {
        let mut agent = MulticastAgent::new(
            Settings::default(),
            "node0",
            PathBuf::from("/nonexistent/multicast.json"),
        );
        agent.plan = plan;
        agent
    }

    fn one_pod() -> Plan {
        let mut plan = Plan::default();
        plan.namespaces.insert("team".into(), namespace_id(b"team"));
        plan.local_namespaces.insert("team".into());
        plan.pods.insert(
            7,
            PlanPod {
                name: "team/a".into(),
                namespace: "team".into(),
                host_mac: [2, 0, 0, 0, 0, 7],
                ipv4: true,
                ipv6: false,
            },
        );
        plan
    }

    fn report(kind: u8, group: [u8; 4]) -> Vec<u8> {
        let mut message = vec![kind, 0, 0, 0, group[0], group[1], group[2], group[3]];
        let sum = etherparse::checksum::Sum16BitWords::new()
            .add_slice(&message)
            .ones_complement();
        message[2..4].copy_from_slice(&sum.to_ne_bytes());
        message
    }

    #[test]
    fn namespace_ids_are_fnv1a_and_never_zero() {
        // FNV-1a test vectors (Fowler/Noll/Vo): "" and "a".
        assert_eq!(namespace_id(b""), 0x811c_9dc5);
        assert_eq!(namespace_id(b"a"), 0xe40c_292c);
    }

    #[test]
    fn a_membership_lasts_260_seconds_after_its_last_report() {
        let mut agent = detached(one_pod());
        let t0 = Instant::now();
        let group: IpAddr = "224.5.5.5".parse().unwrap();
        assert!(agent.take_report(7, 4, &report(0x16, [224, 5, 5, 5]), t0));
        assert_eq!(
            agent.settings.membership_timeout(),
            Duration::from_secs(260)
        );
        assert!(!agent.run_timers(t0 + Duration::from_secs(259)));
        assert!(agent.local.contains_key(&("team".into(), group)));
        // A report at 200 s renews it.
        agent.take_report(
            7,
            4,
            &report(0x16, [224, 5, 5, 5]),
            t0 + Duration::from_secs(200),
        );
        assert!(!agent.run_timers(t0 + Duration::from_secs(261)));
        assert!(agent.run_timers(t0 + Duration::from_secs(461)));
        assert!(agent.local.is_empty());
    }

    #[test]
    fn a_leave_drops_the_member_at_once_and_queries_the_group_twice() {
        let mut agent = detached(one_pod());
        let t0 = Instant::now();
        agent.take_report(7, 4, &report(0x16, [224, 5, 5, 5]), t0);
        assert!(agent.take_report(7, 4, &report(0x17, [224, 5, 5, 5]), t0));
        assert!(agent.local.is_empty());
        let group = Some("224.5.5.5".parse().unwrap());
        let pending: Vec<_> = agent
            .queries
            .iter()
            .map(|q| (q.group, q.remaining))
            .collect();
        assert_eq!(pending, vec![(group, 1)]);
        agent.run_timers(t0);
        let pending: Vec<_> = agent.queries.iter().map(|q| (q.at, q.remaining)).collect();
        assert_eq!(pending, vec![(t0 + LAST_MEMBER_INTERVAL, 0)]);
        agent.run_timers(t0 + LAST_MEMBER_INTERVAL);
        assert!(agent.queries.is_empty());
    }

    #[test]
    fn reports_of_unknown_veths_and_bad_messages_change_nothing() {
        let mut agent = detached(one_pod());
        let t0 = Instant::now();
        assert!(!agent.take_report(8, 4, &report(0x16, [224, 5, 5, 5]), t0));
        let mut bad = report(0x16, [224, 5, 5, 5]);
        bad[2] ^= 0xff;
        assert!(!agent.take_report(7, 4, &bad, t0));
        assert!(!agent.take_report(7, 4, &[0x16, 0], t0));
        assert!(agent.local.is_empty());
    }
}
