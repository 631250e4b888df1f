//! Ending sockets of the calling thread's network namespace through `NETLINK_SOCK_DIAG`: a
//! dump of its TCP and UDP sockets (`SOCK_DIAG_BY_FAMILY`), and `SOCK_DESTROY` of those a
//! caller picks (what `ss -K` does; the kernel needs `CONFIG_INET_DIAG_DESTROY`). The
//! socket-level service translation ends this way the connected sockets a removed backend
//! leaves behind: their owners get `ECONNABORTED` at once, as the per-packet path resets a
//! TCP flow whose backend is gone. The messages are a few fixed C layouts (`inet_diag_req_v2`,
//! `inet_diag_msg`), written here: rtnetlink's crates cover route messages only.

use std::{io, os::fd::AsRawFd as _, os::fd::FromRawFd as _, os::fd::OwnedFd, time::Duration};

use dataplane_common::overlay::Addr;

const NETLINK_SOCK_DIAG: libc::c_int = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const HEADER_LEN: usize = 16;
/// `struct inet_diag_sockid`: ports, addresses, interface, cookie.
const SOCKID_LEN: usize = 48;
/// `struct inet_diag_req_v2`: family, protocol, extensions, padding, states, the id.
const REQUEST_LEN: usize = 8 + SOCKID_LEN;
/// `struct inet_diag_msg`: family, state, timer, retransmits, the id, five more words.
const MESSAGE_LEN: usize = 4 + SOCKID_LEN + 20;
/// How long the kernel may take to answer one message.
const ANSWER_DEADLINE: Duration = Duration::from_secs(2);

/// One socket as the dump shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiagSocket {
    /// `libc::AF_INET` or `libc::AF_INET6`.
    pub family: u8,
    /// `libc::IPPROTO_TCP` or `libc::IPPROTO_UDP`.
    pub protocol: u8,
    pub cookie: u64,
    /// The peer's address (IPv4 as `::ffff:a.b.c.d`) and port (network order); zero for a
    /// socket with no peer.
    pub peer: Addr,
    pub peer_port_be: [u8; 2],
    /// The kernel's `inet_diag_sockid`, as the destroy request must repeat it.
    id: [u8; SOCKID_LEN],
}

/// Ends every TCP and UDP socket of the calling thread's namespace that `pick` chooses;
/// returns how many were ended.
pub fn destroy_sockets(pick: impl Fn(&DiagSocket) -> bool) -> io::Result<usize> {
    let socket = open()?;
    let mut ended = 0;
    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        for protocol in [libc::IPPROTO_TCP as u8, libc::IPPROTO_UDP as u8] {
            for found in dump(&socket, family, protocol)?.iter().filter(|s| pick(s)) {
                match destroy(&socket, found) {
                    Ok(()) => ended += 1,
                    // Gone meanwhile: nothing left to end.
                    Err(error) if error.raw_os_error() == Some(libc::ENOENT) => {}
                    Err(error) => return Err(error),
                }
            }
        }
    }
    Ok(ended)
}

fn open() -> io::Result<OwnedFd> {
    // SAFETY: a plain socket call; the descriptor is owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just returned by socket(2).
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let timeout = libc::timeval {
        tv_sec: ANSWER_DEADLINE.as_secs() as libc::time_t,
        tv_usec: 0,
    };
    // SAFETY: setsockopt reads a timeval of the given size.
    let set = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const timeout).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if set != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(socket)
}

/// A request: the netlink header, then `inet_diag_req_v2` (every state; `id` as given).
fn request(kind: u16, flags: u16, family: u8, protocol: u8, id: &[u8; SOCKID_LEN]) -> Vec<u8> {
    let len = (HEADER_LEN + REQUEST_LEN) as u32;
    let mut message = Vec::with_capacity(len as usize);
    message.extend_from_slice(&len.to_ne_bytes());
    message.extend_from_slice(&kind.to_ne_bytes());
    message.extend_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
    message.extend_from_slice(&1u32.to_ne_bytes());
    message.extend_from_slice(&0u32.to_ne_bytes());
    message.extend_from_slice(&[family, protocol, 0, 0]);
    message.extend_from_slice(&u32::MAX.to_ne_bytes());
    message.extend_from_slice(id);
    message
}

fn send(socket: &OwnedFd, message: &[u8]) -> io::Result<()> {
    // SAFETY: send reads `message.len()` bytes of `message`.
    let sent = unsafe {
        libc::send(
            socket.as_raw_fd(),
            message.as_ptr().cast(),
            message.len(),
            0,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn receive(socket: &OwnedFd, buffer: &mut [u8]) -> io::Result<usize> {
    // SAFETY: recv writes at most `buffer.len()` bytes into `buffer`.
    let got = unsafe {
        libc::recv(
            socket.as_raw_fd(),
            buffer.as_mut_ptr().cast(),
            buffer.len(),
            0,
        )
    };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(got as usize)
}

/// Every socket of `family` and `protocol`.
fn dump(socket: &OwnedFd, family: u8, protocol: u8) -> io::Result<Vec<DiagSocket>> {
    send(
        socket,
        &request(
            SOCK_DIAG_BY_FAMILY,
            NLM_F_DUMP,
            family,
            protocol,
            &[0; SOCKID_LEN],
        ),
    )?;
    let mut found = Vec::new();
    let mut buffer = vec![0u8; 32 * 1024];
    loop {
        let got = receive(socket, &mut buffer)?;
        for (kind, payload) in messages(&buffer[..got]) {
            match kind {
                NLMSG_DONE => return Ok(found),
                NLMSG_ERROR => return Err(answered_error(payload).unwrap_or_else(truncated)),
                SOCK_DIAG_BY_FAMILY => {
                    found.extend(parse_socket(payload, protocol));
                }
                _ => {}
            }
        }
        if got == 0 {
            return Ok(found);
        }
    }
}

/// Ends one socket the dump showed.
fn destroy(socket: &OwnedFd, found: &DiagSocket) -> io::Result<()> {
    send(
        socket,
        &request(
            SOCK_DESTROY,
            NLM_F_ACK,
            found.family,
            found.protocol,
            &found.id,
        ),
    )?;
    let mut buffer = [0u8; 512];
    let got = receive(socket, &mut buffer)?;
    for (kind, payload) in messages(&buffer[..got]) {
        if kind == NLMSG_ERROR {
            return match answered_error(payload) {
                None => Ok(()),
                Some(error) => Err(error),
            };
        }
    }
    Err(truncated())
}

fn truncated() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "a truncated sock_diag answer")
}

/// The error an `NLMSG_ERROR` carries (`None`: zero, an acknowledgement).
fn answered_error(payload: &[u8]) -> Option<io::Error> {
    let code = i32::from_ne_bytes(payload.get(..4)?.try_into().ok()?);
    (code != 0).then(|| io::Error::from_raw_os_error(-code))
}

/// The netlink messages of one read: (type, payload).
fn messages(mut bytes: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while bytes.len() >= HEADER_LEN {
        let len = u32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
        if len < HEADER_LEN || len > bytes.len() {
            break;
        }
        let kind = u16::from_ne_bytes([bytes[4], bytes[5]]);
        out.push((kind, &bytes[HEADER_LEN..len]));
        // Messages are 4-byte aligned.
        let next = (len + 3) & !3;
        bytes = bytes.get(next..).unwrap_or_default();
    }
    out
}

/// One `inet_diag_msg`.
fn parse_socket(payload: &[u8], protocol: u8) -> Option<DiagSocket> {
    if payload.len() < MESSAGE_LEN {
        return None;
    }
    let family = payload[0];
    let id: [u8; SOCKID_LEN] = payload[4..4 + SOCKID_LEN].try_into().ok()?;
    let peer_port_be = [id[2], id[3]];
    let dst = &id[20..36];
    let mut peer = [0u8; 16];
    if family == libc::AF_INET as u8 {
        peer[10] = 0xff;
        peer[11] = 0xff;
        peer[12..].copy_from_slice(&dst[..4]);
    } else {
        peer.copy_from_slice(dst);
    }
    let low = u32::from_ne_bytes(id[40..44].try_into().ok()?);
    let high = u32::from_ne_bytes(id[44..48].try_into().ok()?);
    Some(DiagSocket {
        family,
        protocol,
        cookie: u64::from(high) << 32 | u64::from(low),
        peer,
        peer_port_be,
        id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut bytes = ((HEADER_LEN + payload.len()) as u32).to_ne_bytes().to_vec();
        bytes.extend_from_slice(&kind.to_ne_bytes());
        bytes.extend_from_slice(&[0; 10]);
        bytes.extend_from_slice(payload);
        while !bytes.len().is_multiple_of(4) {
            bytes.push(0);
        }
        bytes
    }

    #[test]
    fn a_dumped_socket_reads_its_peer_and_cookie_and_the_request_repeats_its_id() {
        let mut payload = vec![libc::AF_INET as u8, 1, 0, 0];
        let mut id = [0u8; SOCKID_LEN];
        id[0..2].copy_from_slice(&40000u16.to_be_bytes());
        id[2..4].copy_from_slice(&8080u16.to_be_bytes());
        id[4..8].copy_from_slice(&[10, 244, 0, 2]);
        id[20..24].copy_from_slice(&[10, 244, 1, 3]);
        id[40..44].copy_from_slice(&0x0000_0007u32.to_ne_bytes());
        id[44..48].copy_from_slice(&0x0000_0001u32.to_ne_bytes());
        payload.extend_from_slice(&id);
        payload.extend_from_slice(&[0; 20]);
        let mut bytes = message(SOCK_DIAG_BY_FAMILY, &payload);
        bytes.extend(message(NLMSG_DONE, &[0; 4]));
        let read = messages(&bytes);
        assert_eq!(read.len(), 2);
        assert_eq!(read[1].0, NLMSG_DONE);
        let socket = parse_socket(read[0].1, libc::IPPROTO_TCP as u8).expect("socket");
        assert_eq!(socket.cookie, 0x1_0000_0007);
        assert_eq!(
            socket.peer,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 244, 1, 3]
        );
        assert_eq!(socket.peer_port_be, 8080u16.to_be_bytes());
        let destroy = request(SOCK_DESTROY, NLM_F_ACK, socket.family, socket.protocol, &id);
        assert_eq!(destroy.len(), HEADER_LEN + REQUEST_LEN);
        assert_eq!(&destroy[4..6], &SOCK_DESTROY.to_ne_bytes());
        assert_eq!(&destroy[16..20], &[libc::AF_INET as u8, 6, 0, 0]);
        assert_eq!(&destroy[24..], &id);
        assert!(answered_error(&0i32.to_ne_bytes()).is_none());
        assert_eq!(
            answered_error(&(-libc::ENOENT).to_ne_bytes()).map(|e| e.raw_os_error()),
            Some(Some(libc::ENOENT))
        );
    }
}
