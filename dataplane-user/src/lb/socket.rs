//! Service translation at the socket, the agent's side (the kernel's is `lb/socket.rs` of
//! dataplane-ebpf): where the programs attach (the node's cgroup v2 root) and which sockets
//! they serve: those of this node's pods, known by their network namespace's cookie, found
//! behind each pod's veth ([`crate::kernel::netns::peer_cookies`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
};

use aya::maps::{HashMap, MapData};
use dataplane_common::{
    lb::socket::{SockPod, SockRevKey, SockRevValue},
    maps::{SOCK_LB_PODS, SOCK_LB_REV},
    overlay::Addr,
};

use crate::{
    error::AgentError,
    kernel::{batch, capacity::map_err, loader::Dataplane, netns, sockdiag},
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

    /// Ends the connected sockets still sent to backends that left their services (`live`
    /// says which backend ids still serve, ready or terminating), as the per-packet path
    /// resets a TCP flow whose backend is gone: their owners get `ECONNABORTED` at once and
    /// connect again, to a backend that serves. Unconnected UDP sockets need nothing (each
    /// datagram is given a backend of its own). The reverse map says which sockets were
    /// sent where, and in which namespace; their entries go too. Returns the sockets ended.
    pub fn end_stale(
        &mut self,
        dataplane: &mut Dataplane,
        live: impl Fn(u32) -> bool,
    ) -> Result<usize, AgentError> {
        let map = dataplane.map(SOCK_LB_REV)?;
        let entries: Vec<(SockRevKey, SockRevValue)> =
            batch::read(map).map_err(map_err(SOCK_LB_REV, "read"))?;
        let stale: Vec<(SockRevKey, SockRevValue)> = entries
            .into_iter()
            .filter(|(_, value)| !live(value.backend_id))
            .collect();
        if stale.is_empty() {
            return Ok(0);
        }
        let mut by_netns: BTreeMap<u64, BTreeSet<(u64, Addr, [u8; 2])>> = BTreeMap::new();
        for (key, value) in &stale {
            by_netns
                .entry(value.netns)
                .or_default()
                .insert((key.cookie, key.addr, key.port_be));
        }
        let mut ended = 0;
        for (netns, sockets) in &by_netns {
            let Some(path) = self.files.get(netns) else {
                continue;
            };
            match end_in(path, sockets) {
                Ok(count) => ended += count,
                Err(error) => tracing::warn!(
                    netns = %path.display(),
                    %error,
                    "ending sockets sent to removed backends"
                ),
            }
        }
        let keys: Vec<SockRevKey> = stale.iter().map(|(key, _)| *key).collect();
        let mut rev: HashMap<&mut MapData, SockRevKey, SockRevValue> =
            dataplane.typed_map(SOCK_LB_REV)?;
        for key in &keys {
            let _ = rev.remove(key);
        }
        if ended > 0 {
            tracing::info!(
                sockets = ended,
                "ended connected sockets sent to backends that left their services"
            );
        }
        Ok(ended)
    }
}

/// Ends, in the namespace of `path`, the sockets of `sockets` (cookie, peer, peer port) that
/// are connected to that peer.
fn end_in(
    path: &std::path::Path,
    sockets: &BTreeSet<(u64, Addr, [u8; 2])>,
) -> std::io::Result<usize> {
    let file = std::fs::File::open(path)?;
    netns::in_netns(&file, || {
        sockdiag::destroy_sockets(|s| sockets.contains(&(s.cookie, s.peer, s.peer_port_be)))
    })?
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
