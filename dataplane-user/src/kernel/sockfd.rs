//! Borrowing another process's sockets (`pidfd_getfd`), so that the agent can read what the
//! kernel programs keep in a socket's own storage where `NETLINK_SOCK_DIAG` does not carry it:
//! the kernel's dump gives socket-storage values for TCP sockets only, UDP sockets' are read
//! through a descriptor of the socket, which only its owners hold. Needs the host's process
//! table (the DaemonSet runs with `hostPID`) and the right to ptrace the owners (root).

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    io,
    os::{
        fd::{FromRawFd as _, OwnedFd},
        unix::fs::MetadataExt as _,
    },
    time::{Duration, Instant},
};

/// How long one search of the process table may take: a pod with a great many processes or
/// descriptors is given up on (with an error) rather than let hold up the agent.
const SEARCH_DEADLINE: Duration = Duration::from_secs(2);

/// A descriptor of each socket of `inodes` held by a process of the network namespace
/// `netns` (sockets no process of it holds, or whose owner cannot be reached, are left out).
pub fn borrow_sockets(netns: &File, inodes: &BTreeSet<u32>) -> io::Result<BTreeMap<u32, OwnedFd>> {
    let mut found = BTreeMap::new();
    if inodes.is_empty() {
        return Ok(found);
    }
    let started = Instant::now();
    let late = || {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "searching the processes for sockets took over {} s",
                SEARCH_DEADLINE.as_secs()
            ),
        )
    };
    let target = netns.metadata()?;
    let target = (target.dev(), target.ino());
    for entry in std::fs::read_dir("/proc")?.flatten() {
        if started.elapsed() > SEARCH_DEADLINE {
            return Err(late());
        }
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(ns) = std::fs::metadata(entry.path().join("ns/net")) else {
            continue;
        };
        if (ns.dev(), ns.ino()) != target {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        let mut pidfd = None;
        for fd in fds.flatten() {
            if started.elapsed() > SEARCH_DEADLINE {
                return Err(late());
            }
            let Some(inode) = std::fs::read_link(fd.path())
                .ok()
                .and_then(|link| socket_inode(&link.to_string_lossy()))
            else {
                continue;
            };
            if !inodes.contains(&inode) || found.contains_key(&inode) {
                continue;
            }
            let Some(number) = fd.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                continue;
            };
            if pidfd.is_none() {
                pidfd = Some(pidfd_open(pid));
            }
            let Some(Ok(process)) = &pidfd else {
                break;
            };
            if let Ok(socket) = pidfd_getfd(process, number) {
                found.insert(inode, socket);
            }
        }
        if found.len() == inodes.len() {
            break;
        }
    }
    Ok(found)
}

/// The inode of a descriptor link `socket:[N]`.
fn socket_inode(link: &str) -> Option<u32> {
    link.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: a plain system call; the descriptor it returns is owned below.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just returned by the kernel, owned from here on.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn pidfd_getfd(process: &OwnedFd, number: i32) -> io::Result<OwnedFd> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: a plain system call; the descriptor it returns is owned below.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, process.as_raw_fd(), number, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just returned by the kernel, owned from here on.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_link_gives_its_inode_and_nothing_else_does() {
        assert_eq!(socket_inode("socket:[123456]"), Some(123_456));
        assert_eq!(socket_inode("pipe:[123456]"), None);
        assert_eq!(socket_inode("/dev/null"), None);
        assert_eq!(socket_inode("socket:[x]"), None);
    }

    #[test]
    fn a_socket_of_this_process_is_borrowed_by_its_inode() {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("socket");
        let inode = std::fs::metadata(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&socket)
        ))
        .expect("fd")
        .ino() as u32;
        let netns = File::open("/proc/self/ns/net").expect("netns");
        let borrowed = borrow_sockets(&netns, &BTreeSet::from([inode])).expect("borrow");
        let fd = borrowed.get(&inode).expect("borrowed");
        let seen = std::fs::metadata(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(fd)
        ))
        .expect("fd");
        assert_eq!(seen.ino() as u32, inode);
    }
}
