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
        SCOPE_CLUSTER, ServiceKey,
        socket::{SockPod, SockRev, SockRevSlot},
    },
    maps::{SOCK_LB_PODS, SOCK_LB_REV},
};

use crate::{
    error::AgentError,
    kernel::{capacity::map_err, loader::Dataplane, netns, sockdiag, sockfd},
};

/// `--socket-lb`: whether pods' connections to services are translated at the socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SocketLb {
    /// At the socket, for this node's pods (the per-packet path stays for the rest).
    On,
    /// Per packet only.
    Off,
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
    /// The load balancer's count of backends that left their service ports, when sockets
    /// were last checked ([`SocketScope::end_stale`] looks only when it has moved).
    departures_checked: u64,
}

impl SocketScope {
    /// A scope whose namespaces are looked for under `netns_dirs` (where the runtime, or
    /// `ip netns`, keeps them).
    pub fn new(netns_dirs: Vec<PathBuf>) -> Self {
        Self {
            netns_dirs,
            written: BTreeMap::new(),
            files: BTreeMap::new(),
            adopted: false,
            // The first look after a start checks every socket: backends may have left while
            // no agent ran.
            departures_checked: u64::MAX,
        }
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
            // What a previous agent wrote for pods that are gone now.
            let kept: BTreeSet<u64> = self.written.values().copied().collect();
            let stale: Vec<u64> = map.keys().flatten().filter(|c| !kept.contains(c)).collect();
            for cookie in stale {
                let _ = map.remove(&cookie);
            }
            self.adopted = true;
        }
        Ok(())
    }

    /// Ends the connected sockets of this node's pods still sent to backends that left the
    /// service they were reached through (`serves` says which backend ids each service port
    /// still has, ready or terminating), as the per-packet path resets a TCP flow whose
    /// backend is gone: their owners get `ECONNABORTED` at once and connect again, to a
    /// backend that serves. Unconnected UDP sockets need nothing (each datagram is given a
    /// backend of its own), nor do sockets connected to a pod's address directly (they have
    /// no translation). Looks only when `departures` (the load balancer's count of backends
    /// that left) has moved since the last look. Returns the sockets ended.
    pub fn end_stale(
        &mut self,
        dataplane: &mut Dataplane,
        departures: u64,
        serves: impl Fn(&ServiceKey, u32) -> bool + Sync,
    ) -> Result<usize, AgentError> {
        if departures == self.departures_checked {
            return Ok(0);
        }
        let storage = Storage::open(dataplane.pins())?;
        let mut ended = 0;
        for path in self.files.values() {
            let ending = sockets_in(path, &storage, UdpSockets::Connected).and_then(|found| {
                let stale: Vec<sockdiag::DiagSocket> = found
                    .into_iter()
                    .filter(|(socket, rev)| {
                        translation_of(socket, rev.as_ref()).is_some_and(|slot| {
                            !serves(&service_key(&slot, socket.protocol), slot.backend_id)
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
        self.departures_checked = departures;
        if ended > 0 {
            tracing::info!(
                sockets = ended,
                "ended connected sockets sent to backends that left their services"
            );
        }
        Ok(ended)
    }
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

/// The service port a slot's socket asked for (`protocol`: the socket's).
fn service_key(slot: &SockRevSlot, protocol: u8) -> ServiceKey {
    ServiceKey {
        addr: slot.service,
        port_be: slot.service_port_be,
        protocol,
        scope: SCOPE_CLUSTER,
    }
}

/// The socket-storage map of the translations (`DP_SOCK_LB_REV`), opened twice: for sock_diag
/// requests (by descriptor) and for lookups by socket.
pub struct Storage {
    diag: MapData,
    by_socket: SkStorage<MapData, SockRev>,
}

impl Storage {
    /// Opens the map pinned under `pins`.
    pub fn open(pins: &crate::kernel::pins::Pins) -> Result<Self, AgentError> {
        let open =
            || MapData::from_pin(pins.map(SOCK_LB_REV)).map_err(map_err(SOCK_LB_REV, "open pin"));
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
