//! Network namespaces: entering one on a thread of its own, a netlink connection there with
//! a deadline, and namespaces by cookie as the socket-level programs see them
//! (`bpf_get_netns_cookie`): the cookie of a namespace file, and the namespaces behind this
//! node's pod veths.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    io,
    os::{fd::AsRawFd as _, unix::fs::MetadataExt as _},
    path::PathBuf,
    time::Duration,
};

use futures_util::{StreamExt as _, TryStreamExt as _};
use rtnetlink::{
    packet_core::{NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload},
    packet_route::{
        RouteNetlinkMessage,
        link::LinkAttribute,
        nsid::{NsidAttribute, NsidMessage},
    },
};

/// `SO_NETNS_COOKIE` (Linux 5.14; not in every libc crate release).
const SO_NETNS_COOKIE: libc::c_int = 71;

/// How long the netlink exchanges of one [`peer_cookies`] may take in all.
const NETLINK_DEADLINE: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("network namespace {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("netlink: {0}")]
    Netlink(String),
}

/// Runs `work` on a thread of its own that entered `netns` (a namespace applies to the thread
/// that enters it; the caller's stays where it is).
pub fn in_netns<T: Send>(netns: &File, work: impl FnOnce() -> T + Send) -> io::Result<T> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                // SAFETY: setns on this thread with a namespace file descriptor held open.
                if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(work())
            })
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the namespace thread panicked")))
    })
}

/// The cookie of the calling thread's network namespace.
pub fn current_cookie() -> io::Result<u64> {
    // SAFETY: a plain socket call; the descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just returned by socket(2), owned from here on.
    let socket = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let mut cookie = 0u64;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cookie`.
    let done = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    if done != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cookie)
}

/// The cookie of the namespace `netns` is a file of.
pub fn cookie_of(netns: &File) -> io::Result<u64> {
    in_netns(netns, current_cookie)?
}

/// For each veth (by index, in the calling thread's namespace) whose peer lies in a
/// namespace with a file under `dirs`, that namespace's cookie and file. A veth's peer namespace is
/// known here only by its id (`IFLA_LINK_NETNSID`), so each namespace file's id is asked
/// (`RTM_GETNSID`) and matched: exact, whatever addresses the namespaces hold.
pub fn peer_cookies(
    ifindexes: &BTreeSet<u32>,
    dirs: &[PathBuf],
) -> Result<BTreeMap<u32, (u64, PathBuf)>, NetnsError> {
    if ifindexes.is_empty() {
        return Ok(BTreeMap::new());
    }
    let files = namespace_files(dirs);
    let (peers, ids) = std::thread::scope(|scope| {
        scope
            .spawn(|| ask_netlink(ifindexes, &files))
            .join()
            .unwrap_or_else(|_| Err(NetnsError::Netlink("the netlink thread panicked".into())))
    })?;
    let mut cookies = BTreeMap::new();
    for (ifindex, nsid) in peers {
        let Some(file) = ids.get(&nsid).map(|&i| &files[i]) else {
            continue;
        };
        match cookie_of(&file.1) {
            Ok(cookie) => {
                cookies.insert(ifindex, (cookie, file.0.clone()));
            }
            Err(source) => {
                return Err(NetnsError::Open {
                    path: file.0.clone(),
                    source,
                });
            }
        }
    }
    Ok(cookies)
}

/// The namespaces with a file under `dirs`, by cookie (those that cannot be entered are left
/// out).
pub fn files_by_cookie(dirs: &[PathBuf]) -> BTreeMap<u64, PathBuf> {
    namespace_files(dirs)
        .into_iter()
        .filter_map(|(path, file)| cookie_of(&file).ok().map(|cookie| (cookie, path)))
        .collect()
}

/// The namespace files under `dirs` (one per namespace: the same one may be bound twice).
fn namespace_files(dirs: &[PathBuf]) -> Vec<(PathBuf, File)> {
    let mut seen = BTreeSet::new();
    let mut files = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(file) = File::open(&path) else {
                continue;
            };
            let Ok(meta) = file.metadata() else {
                continue;
            };
            if seen.insert((meta.dev(), meta.ino())) {
                files.push((path, file));
            }
        }
    }
    files
}

/// Each veth's peer namespace id, and the id of each namespace file (index into `files`).
type Ids = (BTreeMap<u32, i32>, BTreeMap<i32, usize>);

fn ask_netlink(ifindexes: &BTreeSet<u32>, files: &[(PathBuf, File)]) -> Result<Ids, NetnsError> {
    with_netlink(NETLINK_DEADLINE, NetnsError::Netlink, |handle| async move {
        let mut peers = BTreeMap::new();
        for &index in ifindexes {
            if let Some(nsid) = peer_netns_id(&handle, index).await? {
                peers.insert(index, nsid);
            }
        }
        let mut ids = BTreeMap::new();
        for (i, (_, file)) in files.iter().enumerate() {
            if let Some(nsid) = netns_id(&handle, file).await? {
                ids.insert(nsid, i);
            }
        }
        Ok((peers, ids))
    })
}

/// Runs `work` with a netlink connection opened by the calling thread (so in the namespace
/// it is in) on a current-thread runtime of its own, within `deadline`; `failed` names what
/// failed around the work (the runtime, the connection, the deadline). For a thread of its
/// own: the agent's loop is async and cannot wait on another runtime.
pub fn with_netlink<T, E, Fut>(
    deadline: Duration,
    failed: impl Fn(String) -> E,
    work: impl FnOnce(rtnetlink::Handle) -> Fut,
) -> Result<T, E>
where
    Fut: Future<Output = Result<T, E>>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|e| failed(e.to_string()))?;
    runtime.block_on(async {
        let (connection, handle, _) =
            rtnetlink::new_connection().map_err(|e| failed(e.to_string()))?;
        let connection = tokio::spawn(connection);
        let done = tokio::time::timeout(deadline, work(handle)).await;
        connection.abort();
        done.map_err(|_| failed(format!("no answer within {deadline:?}")))?
    })
}

/// The id (in this namespace) of the namespace the peer of veth `index` lies in; `None` for
/// a link that is gone or whose peer is in this namespace.
async fn peer_netns_id(handle: &rtnetlink::Handle, index: u32) -> Result<Option<i32>, NetnsError> {
    let mut links = handle.link().get().match_index(index).execute();
    let link = match links.try_next().await {
        Ok(link) => link,
        Err(rtnetlink::Error::NetlinkError(_)) => return Ok(None),
        Err(error) => return Err(NetnsError::Netlink(format!("link {index}: {error}"))),
    };
    Ok(link.and_then(|link| {
        link.attributes
            .iter()
            .find_map(|attribute| match attribute {
                LinkAttribute::LinkNetNsId(id) => Some(*id),
                _ => None,
            })
    }))
}

/// The id this namespace gives the namespace of `file`, if it gave it one (a namespace
/// holding a veth's peer has one).
async fn netns_id(handle: &rtnetlink::Handle, file: &File) -> Result<Option<i32>, NetnsError> {
    let mut message = NsidMessage::default();
    message
        .attributes
        .push(NsidAttribute::Fd(file.as_raw_fd() as u32));
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST;
    let mut request = NetlinkMessage::new(
        header,
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::GetNsId(message)),
    );
    request.finalize();
    let mut handle = handle.clone();
    let mut answers = handle
        .request(request)
        .map_err(|e| NetnsError::Netlink(format!("getnsid: {e}")))?;
    while let Some(answer) = answers.next().await {
        match answer.payload {
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewNsId(found)) => {
                let id = found.attributes.iter().find_map(|a| match a {
                    NsidAttribute::Id(id) => Some(*id),
                    _ => None,
                });
                return Ok(id.filter(|&id| id >= 0));
            }
            NetlinkPayload::Error(_) => return Ok(None),
            _ => {}
        }
    }
    Ok(None)
}
