//! Service translation at the socket, the agent's side (the kernel's is `lb/socket.rs` of
//! dataplane-ebpf): where the programs attach (the node's cgroup v2 root) and which sockets
//! they serve: those of this node's pods, known by their network namespace's cookie, found
//! behind each pod's veth ([`crate::kernel::netns::peer_cookies`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
};

use std::os::fd::{AsFd as _, BorrowedFd};

use aya::maps::{HashMap, Map, MapData, SkStorage};
use dataplane_common::{
    lb::{
        NODEPORT_ANY_V4, SCOPE_CLUSTER, SCOPE_EXTERNAL, SCOPE_NODEPORT, SCOPE_NODEPORT_FROM_POD,
        ServiceKey, ServiceValue,
        socket::{SockPod, SockRev, SockRevSlot},
    },
    maps::{self, SOCK_LB_PODS, SOCK_LB_REV},
    overlay::Addr,
};

use crate::{
    error::AgentError,
    kernel::{capacity::map_err, loader::Dataplane, netns, pins::Pins, sockdiag, sockfd},
};

/// `--socket-lb`: whether pods' connections to services are translated at the socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SocketLb {
    /// At the socket where the kernel allows it (a cgroup v2 hierarchy to attach to, and
    /// the programs attach): else per packet, with a warning saying why.
    Auto,
    /// At the socket, for this node's pods (the per-packet path stays for the rest); the
    /// agent fails to start when the programs cannot attach.
    On,
    /// Per packet only.
    Off,
}

/// `--socket-lb-host`: whether the node's own (host-network) processes are served at the
/// socket too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SocketLbHost {
    /// The host's network namespace in scope: its processes' connections to services are
    /// given a backend at the socket, as pods' are.
    On,
    /// Host processes stay on the per-packet path.
    Off,
}

/// Where the programs attach: `given` (`--socket-lb-cgroup`), else the first cgroup v2
/// mount; a directory that is not a cgroup v2 hierarchy's (a hybrid host's `/sys/fs/cgroup`
/// bound from the host, say) is looked into for its `unified` hierarchy.
pub fn cgroup_for_attach(given: Option<&std::path::Path>) -> Option<PathBuf> {
    let dir = match given {
        Some(dir) => dir.to_path_buf(),
        None => cgroup2_root()?,
    };
    if is_cgroup2(&dir) {
        return Some(dir);
    }
    let unified = dir.join("unified");
    is_cgroup2(&unified).then_some(unified)
}

/// Whether `dir` lies on a cgroup v2 filesystem.
fn is_cgroup2(dir: &std::path::Path) -> bool {
    const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
    let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes one struct statfs into `stat`; the path is NUL-terminated.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let done = unsafe { libc::statfs(path.as_ptr(), &mut stat) };
    done == 0 && stat.f_type as i64 == CGROUP2_SUPER_MAGIC
}

/// The first cgroup v2 mount of this process's mount namespace (`/sys/fs/cgroup` on a
/// unified host, `/sys/fs/cgroup/unified` on a hybrid one).
pub fn cgroup2_root() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    cgroup2_in(&mounts)
}

fn cgroup2_in(mounts: &str) -> Option<PathBuf> {
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (_, target, kind) = (fields.next()?, fields.next()?, fields.next()?);
        (kind == "cgroup2").then(|| PathBuf::from(target.replace("\\040", " ")))
    })
}

/// The pods whose sockets the programs serve: each pod veth's namespace cookie, kept in
/// step with the pods attached.
pub struct SocketScope {
    netns_dirs: Vec<PathBuf>,
    /// Veth index -> the cookie written for it.
    written: BTreeMap<u32, u64>,
    /// The namespace file of each cookie written (where its sockets are ended).
    files: BTreeMap<u64, PathBuf>,
    /// Whether the map has been cleared of what a previous agent left.
    adopted: bool,
    /// The host's network namespace (`--socket-lb-host on`): its cookie, kept in scope.
    host: Option<u64>,
    /// The look at stale sockets under way, if any.
    ending: Option<std::thread::JoinHandle<usize>>,
    /// The load balancer's count of backends that left their service ports, when sockets
    /// were last checked ([`SocketScope::end_stale`] looks only when it has moved).
    departures_checked: u64,
}

impl SocketScope {
    /// A scope whose namespaces are looked for under `netns_dirs` (where the runtime, or
    /// `ip netns`, keeps them); with `host`, the agent's own (the host's) namespace too.
    pub fn new(netns_dirs: Vec<PathBuf>, host: SocketLbHost) -> Result<Self, AgentError> {
        let mut files = BTreeMap::new();
        let host = match host {
            SocketLbHost::Off => None,
            SocketLbHost::On => {
                let cookie = netns::current_cookie().map_err(|source| AgentError::Io {
                    action: "reading the host network namespace's cookie",
                    path: PathBuf::from(HOST_NETNS),
                    source,
                })?;
                files.insert(cookie, PathBuf::from(HOST_NETNS));
                Some(cookie)
            }
        };
        Ok(Self {
            netns_dirs,
            written: BTreeMap::new(),
            files,
            adopted: false,
            host,
            ending: None,
            // The first look after a start checks every socket: backends may have left while
            // no agent ran.
            departures_checked: u64::MAX,
        })
    }

    /// Brings the scope map in step with the pods behind `veths` (ifindexes): the
    /// namespaces of new ones added, those of pods gone removed. A pod whose namespace is
    /// not found under the directories stays on the per-packet path (tried again at the next
    /// call).
    pub fn refresh(
        &mut self,
        dataplane: &mut Dataplane,
        veths: &BTreeSet<u32>,
    ) -> Result<(), AgentError> {
        let new: BTreeSet<u32> = veths
            .iter()
            .copied()
            .filter(|i| !self.written.contains_key(i))
            .collect();
        let gone: Vec<u32> = self
            .written
            .keys()
            .copied()
            .filter(|i| !veths.contains(i))
            .collect();
        if new.is_empty() && gone.is_empty() && self.adopted {
            return Ok(());
        }
        let found = match netns::peer_cookies(&new, &self.netns_dirs) {
            Ok(found) => found,
            Err(error) => {
                tracing::warn!(%error, "finding pods' network namespaces for the socket-level translation");
                BTreeMap::new()
            }
        };
        for index in &new {
            if !found.contains_key(index) {
                tracing::debug!(
                    ifindex = index,
                    "no namespace file found behind the pod veth: its pod stays on the \
                     per-packet path"
                );
            }
        }
        let mut map: HashMap<&mut MapData, u64, SockPod> = dataplane.typed_map(SOCK_LB_PODS)?;
        for index in gone {
            if let Some(cookie) = self.written.remove(&index) {
                let _ = map.remove(&cookie);
                self.files.remove(&cookie);
            }
        }
        for (&ifindex, (cookie, file)) in &found {
            let pod = SockPod { ifindex, _pad: 0 };
            map.insert(cookie, pod, 0)
                .map_err(map_err(SOCK_LB_PODS, "write"))?;
            self.written.insert(ifindex, *cookie);
            self.files.insert(*cookie, file.clone());
        }
        if !self.adopted {
            if let Some(cookie) = self.host {
                // Index 0: no veth, the host itself.
                map.insert(cookie, SockPod::default(), 0)
                    .map_err(map_err(SOCK_LB_PODS, "write"))?;
            }
            // What a previous agent wrote for pods that are gone now.
            let mut kept: BTreeSet<u64> = self.written.values().copied().collect();
            kept.extend(self.host);
            let stale: Vec<u64> = map.keys().flatten().filter(|c| !kept.contains(c)).collect();
            for cookie in stale {
                let _ = map.remove(&cookie);
            }
            self.adopted = true;
        }
        Ok(())
    }

    /// Ends the connected sockets of this node's pods still sent to backends that left the
    /// service they were reached through (`members` gives, when called, the backend ids each
    /// service port still has, ready or terminating), as the per-packet path resets a TCP
    /// flow whose backend is gone: their owners get `ECONNABORTED` at once and connect again,
    /// to a backend that serves. Unconnected UDP sockets need nothing (each datagram is given
    /// a backend of its own), nor do sockets connected to a pod's address directly (they have
    /// no translation). Looks only when `departures` (the load balancer's count of backends
    /// that left) has moved since the last look, and on a thread of its own: every pod's
    /// namespace is dumped (each within its deadlines), which must not hold up the agent's
    /// loop. A look still running when another is due makes the next call try again (the
    /// agent calls again while [`Self::look_pending`] says so).
    pub fn end_stale(
        &mut self,
        pins: &Pins,
        departures: u64,
        members: impl FnOnce() -> Members,
    ) -> Result<(), AgentError> {
        if departures == self.departures_checked {
            return Ok(());
        }
        if let Some(running) = self.ending.take() {
            if !running.is_finished() {
                self.ending = Some(running);
                return Ok(());
            }
            let _ = running.join();
        }
        let storage = Storage::open(pins)?;
        let files: Vec<PathBuf> = self.files.values().cloned().collect();
        let members = members();
        let spawned = std::thread::Builder::new()
            .name("socket-lb-end".into())
            .spawn(move || end_stale_in(&files, &storage, &members))
            .map_err(|source| AgentError::Io {
                action: "starting the thread that ends stale sockets",
                path: PathBuf::from("/proc/self"),
                source,
            })?;
        self.ending = Some(spawned);
        self.departures_checked = departures;
        Ok(())
    }
}

impl SocketScope {
    /// Whether a look at stale sockets is due for `departures` and waits for the one still
    /// running.
    pub fn look_pending(&self, departures: u64) -> bool {
        departures != self.departures_checked && self.ending.is_some()
    }
}

/// The backend ids each service port references (ready or terminating), as the load balancer
/// installed them.
pub type Members = std::collections::HashMap<ServiceKey, std::collections::HashSet<u32>>;

/// [`SocketScope::end_stale`]'s work, in the namespaces of `files`; returns the sockets ended.
fn end_stale_in(files: &[PathBuf], storage: &Storage, members: &Members) -> usize {
    let serves = |key: &ServiceKey, id: u32| members.get(key).is_some_and(|ids| ids.contains(&id));
    let mut ended = 0;
    for path in files {
        let ending = sockets_in(path, storage, UdpSockets::Connected).and_then(|found| {
            let stale: Vec<sockdiag::DiagSocket> = found
                .into_iter()
                .filter(|(socket, rev)| {
                    translation_of(socket, rev.as_ref()).is_some_and(|slot| {
                        !serves(&slot.service_key(socket.protocol), slot.backend_id)
                    })
                })
                .map(|(socket, _)| socket)
                .collect();
            end_in(path, &stale)
        });
        match ending {
            Ok(count) => ended += count,
            Err(error) => tracing::warn!(
                netns = %path.display(),
                %error,
                "ending sockets sent to removed backends"
            ),
        }
    }
    if ended > 0 {
        tracing::info!(
            sockets = ended,
            "ended connected sockets sent to backends that left their services"
        );
    }
    ended
}

/// The translation a connected socket was given: the slot of its storage `rev` that
/// remembers the backend it is connected to (`None`: not connected, or connected to an address
/// the programs did not give it).
pub fn translation_of(socket: &sockdiag::DiagSocket, rev: Option<&SockRev>) -> Option<SockRevSlot> {
    if socket.peer_port_be == [0; 2] {
        return None;
    }
    rev?.find(&socket.peer, socket.peer_port_be).copied()
}

/// The socket-storage map of the translations (`DP_SOCK_LB_REV`), opened twice: for sock_diag
/// requests (by descriptor) and for lookups by socket.
pub struct Storage {
    diag: MapData,
    by_socket: SkStorage<MapData, SockRev>,
}

impl Storage {
    /// Opens the map pinned under `pins`.
    pub fn open(pins: &Pins) -> Result<Self, AgentError> {
        let open = || pins.open_map(SOCK_LB_REV);
        let diag = open()?;
        let by_socket =
            SkStorage::try_from(Map::SkStorage(open()?)).map_err(map_err(SOCK_LB_REV, "open"))?;
        Ok(Self { diag, by_socket })
    }

    fn diag_fd(&self) -> BorrowedFd<'_> {
        self.diag.fd().as_fd()
    }
}

/// Which UDP sockets [`sockets_in`] reads the storage of (each needs a descriptor borrowed
/// from its owner: the kernel's dump carries none for UDP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UdpSockets {
    /// Connected ones only (those a removed backend can leave behind).
    Connected,
    /// All of them (inspection).
    All,
}

/// The TCP and UDP sockets of the namespace of `path`, each with its translations: from the
/// dump for TCP sockets, through a descriptor borrowed from the owner for the UDP sockets
/// `udp` picks.
pub fn sockets_in(
    path: &std::path::Path,
    storage: &Storage,
    udp: UdpSockets,
) -> std::io::Result<Vec<(sockdiag::DiagSocket, Option<SockRev>)>> {
    let file = std::fs::File::open(path)?;
    let diag_fd = storage.diag_fd();
    let sockets = netns::in_netns(&file, || sockdiag::sockets(Some(diag_fd)))??;
    let wanted: BTreeSet<u32> = sockets
        .iter()
        .filter(|s| s.protocol == libc::IPPROTO_UDP as u8)
        .filter(|s| udp == UdpSockets::All || s.peer_port_be != [0; 2])
        .map(|s| s.inode)
        .collect();
    let borrowed = sockfd::borrow_sockets(&file, &wanted)?;
    Ok(sockets
        .into_iter()
        .map(|socket| {
            let rev = match borrowed.get(&socket.inode) {
                Some(fd) => storage.by_socket.get(fd, 0).ok(),
                None => storage_of(&socket),
            };
            (socket, rev)
        })
        .collect())
}

/// A socket's storage value as the dump carried it.
fn storage_of(socket: &sockdiag::DiagSocket) -> Option<SockRev> {
    let bytes = socket.storage.as_deref()?;
    if bytes.len() < std::mem::size_of::<SockRev>() {
        return None;
    }
    // SAFETY: `SockRev` is plain data with no invalid bit patterns, and the slice holds at
    // least its size; read unaligned.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<SockRev>()) })
}

/// Ends, in the namespace of `path`, the sockets of `stale`.
fn end_in(path: &std::path::Path, stale: &[sockdiag::DiagSocket]) -> std::io::Result<usize> {
    if stale.is_empty() {
        return Ok(0);
    }
    let file = std::fs::File::open(path)?;
    netns::in_netns(&file, || sockdiag::destroy_listed(stale))?
}

/// Whether the socket-level programs are attached (their links pinned under `pins`).
pub fn attached(pins: &Pins) -> bool {
    pins.link_names()
        .iter()
        .any(|name| name.ends_with("@cgroup"))
}

/// The path a pod's new flow to a service port of `scope` takes, as the programs decide it:
/// `socket` (a backend given at connect or send), `socket: refused` (no endpoints:
/// ECONNREFUSED at once), or `per packet` with why; `-` for keys pods never reach.
pub fn pod_path(
    scope: u8,
    service: &ServiceValue,
    has_ranges: bool,
    attached: bool,
) -> &'static str {
    if scope == SCOPE_EXTERNAL {
        return "-";
    }
    if !attached {
        return "per packet";
    }
    if service.backends == 0 {
        "socket: refused"
    } else if service.affinity_timeout != 0 {
        "per packet: affinity"
    } else if scope == SCOPE_CLUSTER && has_ranges {
        "per packet: source ranges"
    } else {
        "socket"
    }
}

/// What the socket-level translation does to a new flow from the pod behind veth `ifindex`
/// to `dst` port `port` (`protocol`), read from the maps pinned under `pins`: `None` when the
/// programs are not attached or the flow is to no service port.
pub fn flow_path(
    pins: &Pins,
    ifindex: u32,
    dst: std::net::IpAddr,
    protocol: u8,
    port: u16,
) -> Result<Option<String>, AgentError> {
    if !attached(pins)
        || (protocol != libc::IPPROTO_TCP as u8 && protocol != libc::IPPROTO_UDP as u8)
    {
        return Ok(None);
    }
    let services: HashMap<MapData, ServiceKey, ServiceValue> =
        pins.open_hash(maps::LB_SERVICES, false)?;
    let addr = crate::mapsync::addr16(dst);
    let mut key = ServiceKey {
        addr,
        port_be: port.to_be_bytes(),
        protocol,
        scope: SCOPE_CLUSTER,
    };
    let mut found = services.get(&key, 0).ok();
    if found.is_none() {
        let nodes: HashMap<MapData, Addr, u32> = pins.open_hash(maps::NODE_ADDRS, false)?;
        if nodes.get(&addr, 0).is_ok() {
            key.addr = if dst.is_ipv4() {
                NODEPORT_ANY_V4
            } else {
                [0; 16]
            };
            for scope in [SCOPE_NODEPORT_FROM_POD, SCOPE_NODEPORT] {
                key.scope = scope;
                found = services.get(&key, 0).ok();
                if found.is_some() {
                    break;
                }
            }
        }
    }
    let Some(service) = found else {
        return Ok(None);
    };
    let pods: HashMap<MapData, u64, SockPod> = pins.open_hash(SOCK_LB_PODS, false)?;
    if !pods.iter().flatten().any(|(_, pod)| pod.ifindex == ifindex) {
        return Ok(Some(
            "per packet: the pod is not served at the socket (its namespace was not found)".into(),
        ));
    }
    let has_ranges =
        crate::lb::admitted_sources(pins)?.contains_key(&(key.addr, key.port_be, protocol));
    let path = pod_path(key.scope, &service, has_ranges, true);
    Ok(Some(match path {
        "socket" => "socket: a connect (or unconnected send) from this pod is given a backend \
                     before any packet leaves; its packets carry the backend's address and take \
                     none of the translation traced below (which serves sockets opened before \
                     the programs attached)"
            .into(),
        "socket: refused" => {
            "socket: refused at connect or send (ECONNREFUSED): no endpoints".into()
        }
        other => other.to_owned(),
    }))
}

/// The agent's own network namespace (the host's: the agent runs on the host network).
pub const HOST_NETNS: &str = "/proc/self/ns/net";

/// Empties the scope map (`--socket-lb off`): programs a previous agent left attached serve
/// no one.
pub fn clear_scope(dataplane: &mut Dataplane) -> Result<(), AgentError> {
    let mut map: HashMap<&mut MapData, u64, SockPod> = dataplane.typed_map(SOCK_LB_PODS)?;
    let all: Vec<u64> = map.keys().flatten().collect();
    for cookie in all {
        let _ = map.remove(&cookie);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_look_that_came_due_while_another_ran_stays_pending_until_it_starts() {
        let mut scope = SocketScope::new(Vec::new(), SocketLbHost::Off).expect("scope");
        // Nothing running: a due look starts at the next sync, nothing to retry.
        assert!(!scope.look_pending(1));
        // A look running (for departures 1) when departure 2 comes: pending.
        let (release, wait) = std::sync::mpsc::channel::<()>();
        scope.ending = Some(std::thread::spawn(move || {
            let _ = wait.recv();
            0
        }));
        scope.departures_checked = 1;
        assert!(!scope.look_pending(1));
        assert!(scope.look_pending(2));
        // Still running: the retry leaves it pending.
        scope
            .end_stale(&Pins::new("/nonexistent"), 2, Members::default)
            .expect("deferred");
        assert!(scope.look_pending(2));
        // Finished: the retry takes it up (here its maps are missing: an error, and no
        // further retries until the next sync).
        release.send(()).expect("release");
        while !scope.ending.as_ref().is_some_and(|t| t.is_finished()) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(
            scope
                .end_stale(&Pins::new("/nonexistent"), 2, Members::default)
                .is_err()
        );
        assert!(!scope.look_pending(2));
    }

    #[test]
    fn the_first_cgroup2_mount_is_the_root() {
        let hybrid = "cgroup /sys/fs/cgroup/cpu cgroup rw 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n";
        assert_eq!(
            cgroup2_in(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(
            cgroup2_in("cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n"),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
        assert_eq!(cgroup2_in("proc /proc proc rw 0 0\n"), None);
    }
}
