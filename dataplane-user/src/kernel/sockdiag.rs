//! Ending sockets of the calling thread's network namespace through `NETLINK_SOCK_DIAG`: a
//! dump of its TCP and UDP sockets (`SOCK_DIAG_BY_FAMILY`), and `SOCK_DESTROY` of those a
//! caller picks (what `ss -K` does; the kernel needs `CONFIG_INET_DIAG_DESTROY`). The
//! socket-level service translation ends this way the connected sockets a removed backend
//! leaves behind: their owners get `ECONNABORTED` at once, as the per-packet path resets a
//! TCP flow whose backend is gone. The dump can carry each socket's value in a socket-storage
//! map (`INET_DIAG_REQ_SK_BPF_STORAGES`): that is how the agent tells the sockets the
//! programs translated from the others. The messages are a few fixed C layouts
//! (`inet_diag_req_v2`, `inet_diag_msg`, netlink attributes), written here: rtnetlink's crates
//! cover route messages only.

use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    time::Duration,
};

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
/// `INET_DIAG_REQ_SK_BPF_STORAGES`: the socket-storage maps whose values the dump carries.
const REQ_SK_BPF_STORAGES: u16 = 2;
/// `SK_DIAG_BPF_STORAGE_REQ_MAP_FD`, inside it.
const STORAGE_REQ_MAP_FD: u16 = 1;
/// `INET_DIAG_SK_BPF_STORAGES`: the answer's attribute holding them.
const SK_BPF_STORAGES: u16 = 20;
/// `SK_DIAG_BPF_STORAGE`: one map's value, inside it.
const STORAGE: u16 = 1;
/// `SK_DIAG_BPF_STORAGE_MAP_VALUE`, inside that.
const STORAGE_MAP_VALUE: u16 = 3;
const NLA_F_NESTED: u16 = 0x8000;
/// The attribute type bits (the rest are flags).
const NLA_TYPE_MASK: u16 = 0x3fff;
/// How long one dump may take in all, and how many sockets it may hold: a namespace with more
/// (a pod holding a million sockets, say) is refused rather than let hold up the agent.
const DUMP_DEADLINE: Duration = Duration::from_secs(5);
const MAX_SOCKETS: usize = 262_144;
/// How long the kernel may take to answer one message.
const ANSWER_DEADLINE: Duration = Duration::from_secs(2);

/// One socket as the dump shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
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
    /// The socket's inode (how its owners' descriptors name it).
    pub inode: u32,
    /// The socket's value in the socket-storage map the dump asked for, if it has one (the
    /// kernel gives it for TCP sockets only).
    pub storage: Option<Vec<u8>>,
    /// The kernel's `inet_diag_sockid`, as the destroy request must repeat it.
    id: [u8; SOCKID_LEN],
}

/// Every TCP and UDP socket of the calling thread's namespace, each with its value in the
/// socket-storage map `storage` when given.
pub fn sockets(storage: Option<BorrowedFd<'_>>) -> io::Result<Vec<DiagSocket>> {
    let socket = open()?;
    let mut all = Vec::new();
    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        for protocol in [libc::IPPROTO_TCP as u8, libc::IPPROTO_UDP as u8] {
            all.extend(dump(&socket, family, protocol, storage)?);
        }
    }
    Ok(all)
}

/// Ends the sockets of `listed` (from a dump of the calling thread's namespace); returns how
/// many were ended (those gone meanwhile are not counted).
pub fn destroy_listed(listed: &[DiagSocket]) -> io::Result<usize> {
    if listed.is_empty() {
        return Ok(0);
    }
    let socket = open()?;
    let mut ended = 0;
    for found in listed {
        match destroy(&socket, found) {
            Ok(()) => ended += 1,
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => {}
            Err(error) => return Err(error),
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
    let mut message = Vec::with_capacity(len as usize + 12);
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

/// Adds to a request the attribute asking for each socket's value in the socket-storage map
/// open at `map_fd` (the descriptor must stay open until the answer is read).
fn ask_storage(message: &mut Vec<u8>, map_fd: BorrowedFd<'_>) {
    // The nested attribute (4 bytes of header) holding one map descriptor attribute (8).
    message.extend_from_slice(&12u16.to_ne_bytes());
    message.extend_from_slice(&(REQ_SK_BPF_STORAGES | NLA_F_NESTED).to_ne_bytes());
    message.extend_from_slice(&8u16.to_ne_bytes());
    message.extend_from_slice(&STORAGE_REQ_MAP_FD.to_ne_bytes());
    message.extend_from_slice(&(map_fd.as_raw_fd() as u32).to_ne_bytes());
    let len = message.len() as u32;
    message[..4].copy_from_slice(&len.to_ne_bytes());
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

/// Every socket of `family` and `protocol` (with its value in `storage`, if asked).
fn dump(
    socket: &OwnedFd,
    family: u8,
    protocol: u8,
    storage: Option<BorrowedFd<'_>>,
) -> io::Result<Vec<DiagSocket>> {
    let mut message = request(
        SOCK_DIAG_BY_FAMILY,
        NLM_F_DUMP,
        family,
        protocol,
        &[0; SOCKID_LEN],
    );
    if let Some(map_fd) = storage {
        ask_storage(&mut message, map_fd);
    }
    send(socket, &message)?;
    let mut found = Vec::new();
    let mut buffer = vec![0u8; 32 * 1024];
    let started = std::time::Instant::now();
    loop {
        if found.len() > MAX_SOCKETS || started.elapsed() > DUMP_DEADLINE {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "more than {MAX_SOCKETS} sockets or {} s: not looked at further",
                    DUMP_DEADLINE.as_secs()
                ),
            ));
        }
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
        inode: u32::from_ne_bytes(payload[MESSAGE_LEN - 4..MESSAGE_LEN].try_into().ok()?),
        storage: storage_value(&payload[MESSAGE_LEN..]),
        id,
    })
}

/// The attributes of a run of netlink attributes: (type without flags, payload).
fn attributes(mut bytes: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if bytes.len() < 4 {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([bytes[0], bytes[1]]));
        if len < 4 || len > bytes.len() {
            return None;
        }
        let kind = u16::from_ne_bytes([bytes[2], bytes[3]]) & NLA_TYPE_MASK;
        let payload = &bytes[4..len];
        // Attributes are 4-byte aligned.
        bytes = bytes.get((len + 3) & !3..).unwrap_or_default();
        Some((kind, payload))
    })
}

/// The first socket-storage value among a socket's attributes (one map is asked for).
fn storage_value(attrs: &[u8]) -> Option<Vec<u8>> {
    let (_, storages) = attributes(attrs).find(|(kind, _)| *kind == SK_BPF_STORAGES)?;
    let (_, storage) = attributes(storages).find(|(kind, _)| *kind == STORAGE)?;
    let (_, value) = attributes(storage).find(|(kind, _)| *kind == STORAGE_MAP_VALUE)?;
    Some(value.to_vec())
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
        assert_eq!(socket.storage, None);
        assert!(answered_error(&0i32.to_ne_bytes()).is_none());
        assert_eq!(
            answered_error(&(-libc::ENOENT).to_ne_bytes()).map(|e| e.raw_os_error()),
            Some(Some(libc::ENOENT))
        );
    }

    fn attribute(kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut bytes = ((4 + payload.len()) as u16).to_ne_bytes().to_vec();
        bytes.extend_from_slice(&kind.to_ne_bytes());
        bytes.extend_from_slice(payload);
        while !bytes.len().is_multiple_of(4) {
            bytes.push(0);
        }
        bytes
    }

    #[test]
    fn the_dump_asks_for_one_map_and_reads_its_value_among_the_answer_attributes() {
        let map = std::fs::File::open("/dev/null").expect("a descriptor");
        let mut message = request(
            SOCK_DIAG_BY_FAMILY,
            NLM_F_DUMP,
            libc::AF_INET as u8,
            libc::IPPROTO_TCP as u8,
            &[0; SOCKID_LEN],
        );
        ask_storage(&mut message, std::os::fd::AsFd::as_fd(&map));
        assert_eq!(message.len(), HEADER_LEN + REQUEST_LEN + 12);
        assert_eq!(&message[..4], &(message.len() as u32).to_ne_bytes());
        let attr = &message[HEADER_LEN + REQUEST_LEN..];
        assert_eq!(&attr[..4], &[12, 0, 2, 0x80]);
        assert_eq!(&attr[4..8], &[8, 0, 1, 0]);
        assert_eq!(&attr[8..], &(map.as_raw_fd() as u32).to_ne_bytes());

        // An answer: the socket, then an attribute the dump did not ask for, then the
        // storages (a map id, then the value, 6 bytes: padded to 8 on the wire).
        let mut payload = vec![libc::AF_INET6 as u8, 1, 0, 0];
        payload.extend_from_slice(&[0; SOCKID_LEN + 20]);
        payload.extend(attribute(5, &[0]));
        let mut storage = attribute(2, &7u32.to_ne_bytes());
        storage.extend(attribute(3, &[1, 2, 3, 4, 5, 6]));
        let storages = attribute(STORAGE | NLA_F_NESTED, &storage);
        payload.extend(attribute(SK_BPF_STORAGES | NLA_F_NESTED, &storages));
        let socket = parse_socket(&payload, libc::IPPROTO_UDP as u8).expect("socket");
        assert_eq!(socket.storage, Some(vec![1, 2, 3, 4, 5, 6]));
        // A truncated attribute ends the walk instead of reading beyond it.
        let mut cut = payload.clone();
        cut.truncate(MESSAGE_LEN + 8 + 6);
        assert_eq!(parse_socket(&cut, 17).expect("socket").storage, None);
    }
}
