//! One pod's wiring, the way the kernel programs expect it (and as the test bed wires pods by
//! hand): a veth pair, the pod's end named as the runtime asks and moved into its network
//! namespace with the pod's MAC and the pod MTU; the pod's addresses as /32 and /128 on it,
//! default routes through link-local gateways (169.254.1.1, fe80::1) that every host-side
//! veth holds, so the node answers for them without a bridge; on the host, a /32 (/128)
//! route per pod address to its veth (the agent finds local pods by these routes).
//!
//! The wiring is made by netlink requests (rtnetlink), no processes: those of the pod's
//! namespace from a connection opened by a thread that entered it (`setns`), so any namespace
//! path the runtime passes works, named or not. (CHECK still reads through iproute2's JSON.)

use std::{
    fs::File,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
};

use futures_util::TryStreamExt as _;
use ipnet::IpNet;
use rtnetlink::{
    Handle, LinkMessageBuilder, LinkUnspec, LinkVeth, RouteMessageBuilder,
    packet_route::{
        address::AddressHeaderFlags,
        link::{InfoData, InfoKind, InfoVeth, LinkAttribute},
        route::{RouteMessage, RouteProtocol, RouteScope},
    },
};

use super::{GATEWAY_V4, GATEWAY_V6};
use crate::kernel::netdev;

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("network namespace {path}: {source}")]
    Netns {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{place}: `ip {command}` failed: {detail}")]
    Ip {
        place: String,
        command: String,
        detail: String,
    },
    #[error("{place}: netlink `{request}` failed: {detail}")]
    Netlink {
        place: String,
        request: String,
        detail: String,
    },
    #[error("{0}")]
    Mismatch(String),
}

/// What one pod's wiring is made of.
#[derive(Clone, Debug)]
pub struct PodWiring {
    pub host_iface: String,
    pub ifname: String,
    pub netns: PathBuf,
    pub mac: [u8; 6],
    /// Host addresses (/32, /128).
    pub addresses: Vec<IpAddr>,
    pub mtu: u32,
}

/// The host-side veth name of a container interface: `dp` and 13 hex digits of a hash of
/// (container id, interface name). Stable, so DEL finds it without any state; within the 15
/// characters an interface name may have.
pub fn host_iface_name(container_id: &str, ifname: &str) -> String {
    // FNV-1a, 64 bits: stable across builds, unlike std's hasher.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in container_id.bytes().chain([b'/']).chain(ifname.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("dp{:013x}", hash >> 12)
}

/// Makes the pod's wiring in `netns` (the namespace file [`open_pod_netns`] checked).
/// Anything left from an earlier attempt under the same host name is removed first; a
/// failure removes what was made.
pub fn create(wiring: &PodWiring, netns: &File) -> Result<(), WireError> {
    remove(&wiring.host_iface)?;
    let made = make(wiring, netns);
    if made.is_err() {
        let _ = remove(&wiring.host_iface);
    }
    made
}

fn make(wiring: &PodWiring, netns: &File) -> Result<(), WireError> {
    let host = &wiring.host_iface;
    let host_index = on_netlink_thread(None, |handle| make_host_side(handle, wiring, netns))?;
    // The routes are the pod's; nothing on the pair should take addresses from router
    // advertisements.
    set_sysctl(&format!("net/ipv6/conf/{host}/accept_ra"), "0");
    let polls = on_netlink_thread(Some(netns), |handle| make_pod_side(handle, wiring))?;
    if !polls {
        tracing::warn!(
            host,
            "GRO could not be turned on at the pod's end: no XDP delivery"
        );
        return Ok(());
    }
    // The pod's end polls (GRO is on): the agent may let XDP deliver to it
    // ([`netdev::TAKES_XDP_ALIAS`]). Without GRO its frames keep going through the node's
    // stack.
    on_netlink_thread(None, |handle| async move {
        let alias = LinkUnspec::new_with_index(host_index)
            .alias(netdev::TAKES_XDP_ALIAS)
            .build();
        let set = handle.link().set(alias).execute();
        request("the node", "link set alias", set).await
    })
}

/// The node's side: the veth pair (its pod end made in the pod's namespace with the pod's
/// name, MAC and MTU), the gateways on the host end, the end up, a route per pod address to
/// it. Returns the host end's index.
async fn make_host_side(
    handle: Handle,
    wiring: &PodWiring,
    netns: &File,
) -> Result<u32, WireError> {
    let PodWiring {
        host_iface: host,
        ifname,
        mtu,
        mac,
        ..
    } = wiring;
    let place = "the node";
    let peer = LinkUnspec::new_with_name(ifname)
        .mtu(*mtu)
        .address(mac.to_vec())
        .setns_by_fd(netns.as_raw_fd())
        .build();
    let pair = LinkMessageBuilder::<LinkVeth>::new_with_info_kind(InfoKind::Veth)
        .name(host.clone())
        .mtu(*mtu)
        .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
        .build();
    request(place, "link add veth", handle.link().add(pair).execute()).await?;
    let index = link_index(&handle, place, host).await?;
    if wiring.addresses.iter().any(IpAddr::is_ipv4) {
        let add = handle.address().add(index, GATEWAY_V4.into(), 32);
        request(place, "addr add 169.254.1.1/32", add.execute()).await?;
    }
    if wiring.addresses.iter().any(IpAddr::is_ipv6) {
        let mut add = handle.address().add(index, GATEWAY_V6.into(), 64);
        add.message_mut().header.flags |= AddressHeaderFlags::Nodad;
        request(place, "addr add fe80::1/64 nodad", add.execute()).await?;
    }
    let up = LinkUnspec::new_with_index(index).up().build();
    request(place, "link set up", handle.link().set(up).execute()).await?;
    for address in &wiring.addresses {
        let route = route_to(host_net(*address), index, RouteScope::Link, None);
        let add = handle.route().add(route).replace();
        request(place, "route replace", add.execute()).await?;
    }
    Ok(index)
}

/// The pod's side (from a thread in its namespace): its loopback and interface up, its
/// addresses (no DAD), the routes through the gateways; GRO on at its end (returns whether
/// it went on).
async fn make_pod_side(handle: Handle, wiring: &PodWiring) -> Result<bool, WireError> {
    let ifname = &wiring.ifname;
    let place = format!("the pod's namespace {}", wiring.netns.display());
    let place = place.as_str();
    // Before the link is up: no DAD delay for the link-local address the pod's first
    // neighbour solicitation comes from.
    set_sysctl(&format!("net/ipv6/conf/{ifname}/accept_dad"), "0");
    set_sysctl(&format!("net/ipv6/conf/{ifname}/accept_ra"), "0");
    let lo = link_index(&handle, place, "lo").await?;
    let up = LinkUnspec::new_with_index(lo).up().build();
    request(place, "link set lo up", handle.link().set(up).execute()).await?;
    let index = link_index(&handle, place, ifname).await?;
    let up = LinkUnspec::new_with_index(index).up().build();
    request(place, "link set up", handle.link().set(up).execute()).await?;
    for address in &wiring.addresses {
        let net = host_net(*address);
        let mut add = handle.address().add(index, net.addr(), net.prefix_len());
        if address.is_ipv6() {
            add.message_mut().header.flags |= AddressHeaderFlags::Nodad;
        }
        request(place, "addr add", add.execute()).await?;
    }
    let add_route = |route: RouteMessage, what: &'static str| {
        let sent = handle.route().add(route).execute();
        async move { request(place, what, sent).await }
    };
    if wiring.addresses.iter().any(IpAddr::is_ipv4) {
        let gateway = IpNet::from(IpAddr::from(GATEWAY_V4));
        let default = IpNet::V4(Default::default());
        let via = Some(GATEWAY_V4.into());
        add_route(
            route_to(gateway, index, RouteScope::Link, None),
            "route add 169.254.1.1/32",
        )
        .await?;
        add_route(
            route_to(default, index, RouteScope::Universe, via),
            "route add default",
        )
        .await?;
    }
    if wiring.addresses.iter().any(IpAddr::is_ipv6) {
        let default = IpNet::V6(Default::default());
        let via = Some(GATEWAY_V6.into());
        add_route(
            route_to(default, index, RouteScope::Universe, via),
            "route add ::/0",
        )
        .await?;
    }
    // GRO on the pod's end: its stack merges what it receives, and the veth polls its
    // queue, so the agent's XDP can hand it decapsulated frames directly.
    Ok(netdev::set_gro(ifname, true).is_ok())
}

/// A route to `destination` out of interface `index` (through `gateway` when given), as
/// `ip route` makes them (protocol boot).
fn route_to(
    destination: IpNet,
    index: u32,
    scope: RouteScope,
    gateway: Option<IpAddr>,
) -> RouteMessage {
    let mut route = match destination {
        IpNet::V4(net) => {
            let mut route = RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(net.addr(), net.prefix_len());
            if let Some(IpAddr::V4(gateway)) = gateway {
                route = route.gateway(gateway);
            }
            route.output_interface(index).scope(scope).build()
        }
        IpNet::V6(net) => {
            let mut route = RouteMessageBuilder::<Ipv6Addr>::new()
                .destination_prefix(net.addr(), net.prefix_len());
            if let Some(IpAddr::V6(gateway)) = gateway {
                route = route.gateway(gateway);
            }
            route.output_interface(index).scope(scope).build()
        }
    };
    route.header.protocol = RouteProtocol::Boot;
    route
}

/// The index of interface `name` in the connection's namespace.
async fn link_index(handle: &Handle, place: &str, name: &str) -> Result<u32, WireError> {
    let mut links = handle.link().get().match_name(name.to_owned()).execute();
    let failed = |detail: String| netlink_failed(place, &format!("link get {name}"), detail);
    match links.try_next().await {
        Ok(Some(link)) => Ok(link.header.index),
        Ok(None) => Err(failed("no such link".into())),
        Err(error) => Err(failed(error.to_string())),
    }
}

/// One netlink request's outcome, failures named with the place and the request.
async fn request(
    place: &str,
    what: &str,
    sent: impl Future<Output = Result<(), rtnetlink::Error>>,
) -> Result<(), WireError> {
    sent.await
        .map_err(|error| netlink_failed(place, what, error.to_string()))
}

fn netlink_failed(place: &str, what: &str, detail: String) -> WireError {
    WireError::Netlink {
        place: place.to_owned(),
        request: what.to_owned(),
        detail,
    }
}

/// How long one wiring's netlink exchange may take: the kernel answers in microseconds to
/// milliseconds; one that hangs must not hold the agent's CNI batch for ever.
const NETLINK_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs `work` with a netlink connection of namespace `netns` (the agent's own when `None`)
/// on a thread of its own (which entered `netns`; the agent's loop is async and cannot wait
/// on a runtime of its own), within [`NETLINK_DEADLINE`].
fn on_netlink_thread<T, Work, Fut>(netns: Option<&File>, work: Work) -> Result<T, WireError>
where
    T: Send,
    Work: FnOnce(Handle) -> Fut + Send,
    Fut: Future<Output = Result<T, WireError>>,
{
    let run = move || -> Result<T, WireError> {
        // The socket is made on this thread, so it belongs to the namespace the thread is in.
        let failed = |detail: String| netlink_failed("netlink", "connect", detail);
        crate::kernel::netns::with_netlink(NETLINK_DEADLINE, failed, work)
    };
    match netns {
        Some(netns) => in_netns(netns, run),
        None => std::thread::scope(|scope| {
            let panicked = || WireError::Mismatch("the netlink thread panicked".to_owned());
            scope.spawn(run).join().unwrap_or_else(|_| Err(panicked()))
        }),
    }
}

/// Removes a pod's host-side veth (its peer goes with it) and the routes through it. Returns
/// whether there was one.
pub fn remove(host_iface: &str) -> Result<bool, WireError> {
    Ok(!remove_many(&[host_iface.to_owned()])?.is_empty())
}

/// The interface groups the veths being removed are put in: deleting a group unregisters its
/// devices in one batch, which waits out the kernel's grace periods once for all of them (10
/// veths: 19 ms, against 22 ms each one by one). Each removal takes a group of its own, so
/// that removals running at once (the agent's DELs run off its loop) never take each other's
/// veths.
const REMOVAL_GROUPS: std::ops::Range<u32> = 0x6470_0000..0x6471_0000;

/// The next removal's group.
fn removal_group() -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    REMOVAL_GROUPS.start + n % (REMOVAL_GROUPS.end - REMOVAL_GROUPS.start)
}

/// Removes the host-side veths among `hosts` that exist (their peers go with them), in one
/// kernel operation; returns those removed.
pub fn remove_many(hosts: &[String]) -> Result<Vec<String>, WireError> {
    let present: Vec<String> = hosts.iter().filter(|h| exists(h)).cloned().collect();
    if present.is_empty() {
        return Ok(present);
    }
    let group = removal_group();
    on_netlink_thread(None, |handle| async move {
        for host in &present {
            let index = link_index(&handle, "the node", host).await?;
            let grouped = LinkUnspec::new_with_index(index).link_group(group).build();
            let set = handle.link().set(grouped).execute();
            request("the node", &format!("link set {host} group"), set).await?;
        }
        // Index 0 and the group: every link of the group goes.
        let mut delete = handle.link().del(0);
        delete
            .message_mut()
            .attributes
            .push(LinkAttribute::Group(group));
        request("the node", "link del group", delete.execute()).await?;
        Ok(present)
    })
}

/// Checks that the pod's wiring is as [`create`] made it: the host veth and its routes, the
/// pod's interface with its MAC, MTU and addresses, and its default routes.
pub fn check(wiring: &PodWiring, netns: &File) -> Result<(), WireError> {
    let host = &wiring.host_iface;
    if !exists(host) {
        return Err(WireError::Mismatch(format!(
            "the pod's host-side veth {host} is missing"
        )));
    }
    for address in &wiring.addresses {
        let device = netdev::host_route_device(*address);
        if device.as_deref() != Some(host.as_str()) {
            return Err(WireError::Mismatch(format!(
                "the node routes {address} to {device:?}, not to {host}"
            )));
        }
    }
    in_netns(netns, || check_pod_side(wiring))
}

fn check_pod_side(wiring: &PodWiring) -> Result<(), WireError> {
    let ifname = &wiring.ifname;
    let place = format!("the pod's namespace {}", wiring.netns.display());
    let links = ip_json(&place, &["-json", "addr", "show", "dev", ifname])?;
    let link = links
        .as_array()
        .and_then(|l| l.first())
        .ok_or_else(|| WireError::Mismatch(format!("{place} has no interface {ifname}")))?;
    let mac = netdev::mac_text(&wiring.mac);
    if link["address"].as_str() != Some(mac.as_str()) {
        return Err(WireError::Mismatch(format!(
            "{ifname} has MAC {}, not {mac}",
            link["address"]
        )));
    }
    if link["mtu"].as_u64() != Some(u64::from(wiring.mtu)) {
        return Err(WireError::Mismatch(format!(
            "{ifname} has MTU {}, not {}",
            link["mtu"], wiring.mtu
        )));
    }
    let held: Vec<String> = link["addr_info"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| Some(format!("{}/{}", a["local"].as_str()?, a["prefixlen"])))
        .collect();
    for address in &wiring.addresses {
        let wanted = host_net(*address).to_string();
        if !held.contains(&wanted) {
            return Err(WireError::Mismatch(format!(
                "{ifname} lacks address {wanted} (has {})",
                held.join(", ")
            )));
        }
    }
    for (family, gateway, present) in [
        (
            "-4",
            IpAddr::from(GATEWAY_V4),
            wiring.addresses.iter().any(IpAddr::is_ipv4),
        ),
        (
            "-6",
            IpAddr::from(GATEWAY_V6),
            wiring.addresses.iter().any(IpAddr::is_ipv6),
        ),
    ] {
        if !present {
            continue;
        }
        let routes = ip_json(&place, &[family, "-json", "route", "show", "default"])?;
        let found = routes.as_array().into_iter().flatten().any(|r| {
            r["gateway"].as_str() == Some(gateway.to_string().as_str())
                && r["dev"].as_str() == Some(ifname.as_str())
        });
        if !found {
            return Err(WireError::Mismatch(format!(
                "{place} has no default route via {gateway} dev {ifname}"
            )));
        }
    }
    Ok(())
}

/// Whether this namespace has interface `name` (asked of the kernel: /sys may show another
/// namespace's).
fn exists(name: &str) -> bool {
    crate::kernel::preflight::interface_index(name).is_ok()
}

/// `address` as a host prefix.
fn host_net(address: IpAddr) -> IpNet {
    IpNet::from(address)
}

/// Where a runtime's named network namespaces are, unless the agent is told others
/// (`--cni-netns-dir`): iproute2's, which containerd, CRI-O and podman use.
pub const DEFAULT_NETNS_DIRS: [&str; 2] = ["/run/netns", "/var/run/netns"];

/// Opens the pod's network namespace `path` as the runtime named it, refusing what is no
/// pod's: a path outside `/proc/<pid>/ns/net` and the files directly in `allowed_dirs`
/// (no `..`, no symbolic link as the last part), a file that is not a network namespace,
/// and the agent's own namespace or init's (the node's: wiring a "pod" there would put its
/// interface and routes on the node).
pub fn open_pod_netns(path: &Path, allowed_dirs: &[PathBuf]) -> Result<File, WireError> {
    check_netns_path(path, allowed_dirs)?;
    let in_proc = is_proc_netns(path);
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    if !in_proc {
        // /proc's ns/net is a link by design; a runtime's bind-mounted file is not.
        std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NOFOLLOW);
    }
    let refused = |why: String| refused_netns(path, why);
    let file = options.open(path).map_err(|source| WireError::Netns {
        path: path.to_owned(),
        source,
    })?;
    if !is_network_namespace(&file) {
        return Err(refused("not a network namespace".into()));
    }
    let identity = file_identity(&file);
    for node_namespace in ["/proc/self/ns/net", "/proc/1/ns/net"] {
        let same = File::open(node_namespace)
            .ok()
            .is_some_and(|node| file_identity(&node) == identity);
        if same {
            return Err(refused(format!(
                "the node's own network namespace ({node_namespace}), not a pod's"
            )));
        }
    }
    Ok(file)
}

/// Whether `path` may name a pod's network namespace at all (before anything is opened):
/// `/proc/<pid>/ns/net`, or a plain file name directly in one of `allowed_dirs`.
fn check_netns_path(path: &Path, allowed_dirs: &[PathBuf]) -> Result<(), WireError> {
    let in_dirs = path
        .parent()
        .is_some_and(|dir| allowed_dirs.iter().any(|a| a == dir))
        && plain_components(path);
    if is_proc_netns(path) || in_dirs {
        return Ok(());
    }
    Err(refused_netns(
        path,
        format!(
            "not a pod's network namespace: only /proc/<pid>/ns/net and files in {} are taken",
            allowed_dirs
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    ))
}

/// A namespace the agent will not wire (`PermissionDenied`, told apart from a namespace
/// that is gone).
fn refused_netns(path: &Path, why: String) -> WireError {
    WireError::Netns {
        path: path.to_owned(),
        source: std::io::Error::new(std::io::ErrorKind::PermissionDenied, why),
    }
}

/// `/proc/<pid>/ns/net` exactly.
fn is_proc_netns(path: &Path) -> bool {
    let Some(text) = path.to_str() else {
        return false;
    };
    text.strip_prefix("/proc/")
        .and_then(|rest| rest.strip_suffix("/ns/net"))
        .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
}

/// An absolute path of plain names only (no `.`, `..` or empty parts): read from its bytes,
/// as `Path::components` quietly drops `.` and doubled separators.
fn plain_components(path: &Path) -> bool {
    let text = path.as_os_str().as_encoded_bytes();
    let Some(rest) = text.strip_prefix(b"/") else {
        return false;
    };
    rest.split(|b| *b == b'/')
        .all(|part| !matches!(part, b"" | b"." | b".."))
}

/// Whether `file` is a network namespace (nsfs' `NS_GET_NSTYPE`).
fn is_network_namespace(file: &File) -> bool {
    /// `_IO(0xb7, 0x3)`.
    const NS_GET_NSTYPE: libc::c_ulong = 0xb703;
    // SAFETY: the ioctl takes no argument and only reads the open descriptor.
    let kind = unsafe { libc::ioctl(file.as_raw_fd(), NS_GET_NSTYPE as _) };
    kind == libc::CLONE_NEWNET
}

/// The (device, inode) that names a namespace.
fn file_identity(file: &File) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    file.metadata().ok().map(|m| (m.dev(), m.ino()))
}

/// A path naming the open namespace `file` for a child process (`ip ... netns <path>`): the
/// agent's own descriptor, so what the child enters is what was checked, whatever happens to
/// the runtime's path meanwhile.
pub(crate) fn fd_path(file: &File) -> PathBuf {
    PathBuf::from(format!(
        "/proc/{}/fd/{}",
        std::process::id(),
        file.as_raw_fd()
    ))
}

/// Runs `work` on a thread that entered `netns` (the thread, and what it spawns, only).
pub(crate) fn in_netns<T: Send>(
    netns: &File,
    work: impl FnOnce() -> Result<T, WireError> + Send,
) -> Result<T, WireError> {
    crate::kernel::netns::in_netns(netns, work).unwrap_or_else(|source| {
        Err(WireError::Netns {
            path: PathBuf::from("(entering)"),
            source,
        })
    })
}

/// Writes a sysctl of the current thread's network namespace; a missing key (IPv6 off) is
/// left alone.
pub(crate) fn set_sysctl(key: &str, value: &str) {
    let path = crate::kernel::sysctl::path(key);
    if let Err(error) = std::fs::write(&path, value) {
        tracing::debug!(path = %path.display(), %error, "sysctl not set");
    }
}

pub(crate) fn ip_batch(place: &str, commands: &[String]) -> Result<(), WireError> {
    let input = format!("{}\n", commands.join("\n"));
    netdev::run_ip(&["-batch", "-"], Some(&input))
        .map(|_| ())
        .map_err(|detail| WireError::Ip {
            place: place.to_owned(),
            command: format!("-batch ({})", commands.join("; ")),
            detail,
        })
}

pub(crate) fn ip_json(place: &str, args: &[&str]) -> Result<serde_json::Value, WireError> {
    let failed = |detail: String| WireError::Ip {
        place: place.to_owned(),
        command: args.join(" "),
        detail,
    };
    let out = netdev::run_ip(args, None).map_err(failed)?;
    serde_json::from_str(&out).map_err(|e| failed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_are_stable_and_fit_an_interface_name() {
        let name = host_iface_name("0123456789abcdef", "eth0");
        assert_eq!(name.len(), 15);
        assert!(name.starts_with("dp"));
        assert_eq!(name, host_iface_name("0123456789abcdef", "eth0"));
        assert_ne!(name, host_iface_name("0123456789abcdef", "eth1"));
        assert_ne!(name, host_iface_name("0123456789abcdee", "eth0"));
    }

    #[test]
    fn only_pod_namespace_paths_are_taken() {
        let dirs: Vec<PathBuf> = DEFAULT_NETNS_DIRS.iter().map(PathBuf::from).collect();
        for good in [
            "/proc/4242/ns/net",
            "/run/netns/cni-1234",
            "/var/run/netns/pod",
        ] {
            assert!(check_netns_path(Path::new(good), &dirs).is_ok(), "{good}");
        }
        for bad in [
            "/proc/self/ns/net",
            "/proc/1/ns/mnt",
            "/proc/12/task/12/ns/net",
            "/run/netns/../../etc/passwd",
            "/run/netns//x",
            "/run/netns/a/b",
            "/run/netns",
            "run/netns/x",
            "/etc/shadow",
            "/dev/sda",
            "/run/netns/./x",
        ] {
            let error = check_netns_path(Path::new(bad), &dirs).unwrap_err();
            assert!(
                matches!(&error, WireError::Netns { source, .. } if source.kind() == std::io::ErrorKind::PermissionDenied),
                "{bad}: {error}"
            );
        }
    }

    #[test]
    fn the_nodes_own_namespace_and_other_files_are_refused_when_opened() {
        // /proc/<own pid>/ns/net passes the path check and is the agent's (the node's).
        let own = PathBuf::from(format!("/proc/{}/ns/net", std::process::id()));
        let error = open_pod_netns(&own, &[]).unwrap_err();
        assert!(error.to_string().contains("node's own"), "{error}");
        // A plain file in an allowed directory is no namespace.
        let dir = std::env::temp_dir().join(format!("netns-dir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("fake"), b"").unwrap();
        let error = open_pod_netns(&dir.join("fake"), std::slice::from_ref(&dir)).unwrap_err();
        assert!(
            error.to_string().contains("not a network namespace"),
            "{error}"
        );
        // Nor is a symbolic link to the node's namespace.
        std::os::unix::fs::symlink("/proc/1/ns/net", dir.join("link")).unwrap();
        assert!(open_pod_netns(&dir.join("link"), std::slice::from_ref(&dir)).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
