//! Facts about network devices of the agent's network namespace, read the namespace-aware way
//! (ioctl on a socket, /proc/net of this process) so they hold under `nsenter` too, where
//! /sys/class/net may show another namespace.

use std::{
    ffi::CString,
    fs, io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
};

/// A MAC address as `ip` and the logs write it (`0a:58:0a:f4:01:02`).
pub fn mac_text(bytes: &[u8; 6]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// MAC address of `name`.
/// A MAC address from its text (`0a:58:0a:f4:01:02`, or with dashes): six two-digit hex
/// bytes.
pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let bytes: Vec<u8> = text
        .split([':', '-'])
        .map(|b| {
            (b.len() == 2)
                .then(|| u8::from_str_radix(b, 16).ok())
                .flatten()
        })
        .collect::<Option<_>>()?;
    bytes.try_into().ok()
}

pub fn mac(name: &str) -> io::Result<[u8; 6]> {
    let request = ifreq_ioctl(name, libc::SIOCGIFHWADDR)?;
    // SAFETY: SIOCGIFHWADDR filled the hardware-address member of the union.
    let data = unsafe { request.ifr_ifru.ifru_hwaddr.sa_data };
    Ok([
        data[0] as u8,
        data[1] as u8,
        data[2] as u8,
        data[3] as u8,
        data[4] as u8,
        data[5] as u8,
    ])
}

/// MTU of `name`.
/// This host's name (the UTS namespace's, as `hostname` prints it).
pub fn host_name() -> io::Result<String> {
    Ok(fs::read_to_string("/proc/sys/kernel/hostname")?
        .trim()
        .to_owned())
}

pub fn mtu(name: &str) -> io::Result<u32> {
    let request = ifreq_ioctl(name, libc::SIOCGIFMTU)?;
    // SAFETY: SIOCGIFMTU filled the MTU member of the union.
    let mtu = unsafe { request.ifr_ifru.ifru_mtu };
    u32::try_from(mtu).map_err(|_| io::Error::other("negative MTU"))
}

/// Whether generic receive offload is on for `name`. XDP passes decapsulated frames up one wire
/// frame at a time; without GRO the pod's TCP then sees every one of them.
pub fn gro_enabled(name: &str) -> io::Result<bool> {
    /// `ETHTOOL_GGRO` from linux/ethtool.h: get the GRO flag into `ethtool_value.data`.
    const ETHTOOL_GGRO: u32 = 0x2b;
    Ok(ethtool_value(name, ETHTOOL_GGRO, 0)? != 0)
}

/// Turns generic receive offload on or off for `name` (in the calling thread's namespace). On
/// a veth it also makes the device poll its queue (NAPI), the only way it takes frames that
/// XDP redirects to its peer.
pub fn set_gro(name: &str, on: bool) -> io::Result<()> {
    /// `ETHTOOL_SGRO` from linux/ethtool.h: set the GRO flag from `ethtool_value.data`.
    const ETHTOOL_SGRO: u32 = 0x2c;
    ethtool_value(name, ETHTOOL_SGRO, u32::from(on)).map(|_| ())
}

/// One `struct ethtool_value` request (`cmd`, `data`) for `name`; the `data` it returns.
fn ethtool_value(name: &str, cmd: u32, data: u32) -> io::Result<u32> {
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    let mut value = EthtoolValue { cmd, data };
    let pointer = (&raw mut value).cast::<libc::c_char>();
    ifreq_ioctl_with(name, libc::SIOCETHTOOL, |ifreq| {
        ifreq.ifr_ifru.ifru_data = pointer
    })?;
    Ok(value.data)
}

/// The alias the CNI plugin gives a pod's host-side veth once the pod's end polls (GRO on):
/// the agent then lets XDP deliver that pod's frames straight into it (`DP_XDP_PODS`). A veth
/// whose peer does not poll would drop what XDP sends it, and the host side cannot read its
/// peer's setting, so the plugin, which made both ends, says so here.
pub const TAKES_XDP_ALIAS: &str = "dataplane:takes-xdp";

/// Whether the alias of the interface `ifindex` says its pod end takes frames from XDP
/// ([`TAKES_XDP_ALIAS`]).
pub fn takes_xdp(ifindex: u32) -> bool {
    alias(ifindex).is_ok_and(|alias| alias == TAKES_XDP_ALIAS)
}

/// The alias of the interface `ifindex` in the calling thread's network namespace (empty when
/// none), asked of the kernel by one rtnetlink RTM_GETLINK: `/sys/class/net` shows the
/// namespace sysfs was mounted in, which is not the agent's when it was only entered.
pub fn alias(ifindex: u32) -> io::Result<String> {
    const IFINFOMSG_LEN: usize = 16;
    const HEADER_LEN: usize = 16;
    // SAFETY: plain socket creation; the fd is owned right away.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, valid descriptor owned by nothing else.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    // nlmsghdr (length, type, flags, sequence, port id), then ifinfomsg naming the link.
    let mut request = Vec::with_capacity(HEADER_LEN + IFINFOMSG_LEN);
    request.extend_from_slice(&((HEADER_LEN + IFINFOMSG_LEN) as u32).to_ne_bytes());
    request.extend_from_slice(&libc::RTM_GETLINK.to_ne_bytes());
    request.extend_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    request.extend_from_slice(&1u32.to_ne_bytes());
    request.extend_from_slice(&0u32.to_ne_bytes());
    request.extend_from_slice(&[libc::AF_UNSPEC as u8, 0, 0, 0]);
    request.extend_from_slice(&(ifindex as i32).to_ne_bytes());
    request.extend_from_slice(&[0; 8]);
    // SAFETY: the buffer is valid for its length; the kernel is the destination by default.
    let sent = unsafe {
        libc::send(
            socket.as_raw_fd(),
            request.as_ptr().cast(),
            request.len(),
            0,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut reply = vec![0u8; 64 * 1024];
    // SAFETY: the buffer is valid and writable for its length.
    let got = unsafe {
        libc::recv(
            socket.as_raw_fd(),
            reply.as_mut_ptr().cast(),
            reply.len(),
            0,
        )
    };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    link_alias(&reply[..got as usize])
}

/// The IFLA_IFALIAS attribute of an RTM_NEWLINK reply (empty without one).
fn link_alias(reply: &[u8]) -> io::Result<String> {
    let word = |at: usize| -> Option<u16> {
        Some(u16::from_ne_bytes(reply.get(at..at + 2)?.try_into().ok()?))
    };
    match word(4) {
        Some(kind) if kind == libc::RTM_NEWLINK => {}
        Some(kind) if kind == libc::NLMSG_ERROR as u16 => {
            let code = reply
                .get(16..20)
                .map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
            return Err(io::Error::from_raw_os_error(-code));
        }
        _ => return Err(io::Error::other("unexpected rtnetlink reply")),
    }
    let end = reply
        .get(0..4)
        .map_or(0, |b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .min(reply.len());
    // Attributes follow the 16-byte message header and the 16-byte ifinfomsg, 4-aligned.
    let mut at = 32;
    while at + 4 <= end {
        let (Some(len), Some(kind)) = (word(at), word(at + 2)) else {
            break;
        };
        let len = usize::from(len);
        if len < 4 || at + len > end {
            break;
        }
        if kind == libc::IFLA_IFALIAS {
            let value = &reply[at + 4..at + len];
            let value = value.split(|b| *b == 0).next().unwrap_or_default();
            return Ok(String::from_utf8_lossy(value).into_owned());
        }
        at += (len + 3) & !3;
    }
    Ok(String::new())
}

/// The name of the driver behind `name` ("veth", "mlx5_core", ...).
pub fn driver(name: &str) -> io::Result<String> {
    /// `ETHTOOL_GDRVINFO` from linux/ethtool.h, filling `struct ethtool_drvinfo`.
    const ETHTOOL_GDRVINFO: u32 = 0x03;
    #[repr(C)]
    struct DriverInfo {
        cmd: u32,
        driver: [u8; 32],
        rest: [u8; 160],
    }
    let mut info = DriverInfo {
        cmd: ETHTOOL_GDRVINFO,
        driver: [0; 32],
        rest: [0; 160],
    };
    let data = (&raw mut info).cast::<libc::c_char>();
    ifreq_ioctl_with(name, libc::SIOCETHTOOL, |ifreq| {
        ifreq.ifr_ifru.ifru_data = data
    })?;
    let len = info.driver.iter().position(|b| *b == 0).unwrap_or(32);
    Ok(String::from_utf8_lossy(&info.driver[..len]).into_owned())
}

fn ifreq_ioctl(name: &str, request: libc::c_ulong) -> io::Result<libc::ifreq> {
    ifreq_ioctl_with(name, request, |_| {})
}

fn ifreq_ioctl_with(
    name: &str,
    request: libc::c_ulong,
    fill: impl FnOnce(&mut libc::ifreq),
) -> io::Result<libc::ifreq> {
    let c_name = CString::new(name).map_err(io::Error::other)?;
    let bytes = c_name.as_bytes_with_nul();
    if bytes.len() > libc::IFNAMSIZ {
        return Err(io::Error::other("interface name too long"));
    }
    // SAFETY: an all-zero ifreq is valid; the name is copied in within IFNAMSIZ.
    let mut ifreq: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifreq.ifr_name.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    fill(&mut ifreq);
    // SAFETY: plain socket creation; the fd is owned right away.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, valid descriptor owned by nothing else.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is a valid, writable ifreq for this request.
    if unsafe { libc::ioctl(socket.as_raw_fd(), request, &mut ifreq) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(ifreq)
}

/// The device of the host route (/32 or /128) to `ip` in the main table: how a CNI wires a
/// pod's address to its host-side veth.
pub fn host_route_device(ip: IpAddr) -> Option<String> {
    match ip {
        IpAddr::V4(v4) => host_route_v4(&fs::read_to_string("/proc/net/route").ok()?, v4),
        IpAddr::V6(v6) => host_route_v6(&fs::read_to_string("/proc/net/ipv6_route").ok()?, v6),
    }
}

/// Every host route (/32 and /128) of the main tables and its device, read once: a sync
/// looks up each local pod's, and reading the tables per pod made that quadratic in pods.
pub fn host_route_devices() -> std::collections::HashMap<IpAddr, String> {
    let v4 = fs::read_to_string("/proc/net/route").unwrap_or_default();
    let v6 = fs::read_to_string("/proc/net/ipv6_route").unwrap_or_default();
    let mut routes = std::collections::HashMap::new();
    for (ip, device) in host_routes_v4(&v4).chain(host_routes_v6(&v6)) {
        routes.entry(ip).or_insert_with(|| device.to_owned());
    }
    routes
}

/// `/proc/net/route`: `Iface Destination Gateway Flags RefCnt Use Metric Mask ...`, addresses
/// as host-endian hex of the network-order value; the host routes (mask all ones).
fn host_routes_v4(table: &str) -> impl Iterator<Item = (IpAddr, &str)> {
    table.lines().skip(1).filter_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() <= 7 || fields[7] != "FFFFFFFF" {
            return None;
        }
        let raw = u32::from_str_radix(fields[1], 16).ok()?;
        Some((IpAddr::V4(Ipv4Addr::from(raw.to_ne_bytes())), fields[0]))
    })
}

/// `/proc/net/ipv6_route`: `dest plen src splen nexthop metric refcnt use flags iface`; the
/// host routes (prefix length 128).
fn host_routes_v6(table: &str) -> impl Iterator<Item = (IpAddr, &str)> {
    table.lines().filter_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() <= 9 || fields[1] != "80" {
            return None;
        }
        let raw = u128::from_str_radix(fields[0], 16).ok()?;
        Some((IpAddr::V6(Ipv6Addr::from(raw)), fields[9]))
    })
}

fn host_route_v4(table: &str, ip: Ipv4Addr) -> Option<String> {
    host_routes_v4(table)
        .find(|(found, _)| *found == IpAddr::V4(ip))
        .map(|(_, device)| device.to_owned())
}

fn host_route_v6(table: &str, ip: Ipv6Addr) -> Option<String> {
    host_routes_v6(table)
        .find(|(found, _)| *found == IpAddr::V6(ip))
        .map(|(_, device)| device.to_owned())
}

/// How long a helper program (`ip`, `nft`) may run before it is killed: each does one
/// netlink exchange, which takes milliseconds; one that hangs must not stall the agent's loop.
pub const CHILD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Runs iproute2's `ip` with `args`, `input` on its stdin (for `-batch -`); its stdout, or what
/// went wrong (its stderr, or why it could not run, or that it ran past [`CHILD_TIMEOUT`]).
pub fn run_ip(args: &[&str], input: Option<&str>) -> Result<String, String> {
    let mut command = std::process::Command::new("ip");
    command.args(args);
    let (status, stdout, stderr) = run_bounded(&mut command, input, CHILD_TIMEOUT)
        .map_err(|e| format!("cannot run ip: {e} (is iproute2 installed?)"))?;
    if !status.success() {
        return Err(String::from_utf8_lossy(&stderr).trim().to_owned());
    }
    Ok(String::from_utf8_lossy(&stdout).into_owned())
}

/// Applies an nftables script with `nft -f -` (one transaction), bounded by [`CHILD_TIMEOUT`];
/// `table` names the agent's table the script writes, for the error.
pub fn run_nft(table: &'static str, script: &str) -> Result<(), crate::error::AgentError> {
    let mut command = std::process::Command::new("nft");
    command.args(["-f", "-"]);
    let (status, _, stderr) =
        run_bounded(&mut command, Some(script), CHILD_TIMEOUT).map_err(|source| {
            crate::error::AgentError::Spawn {
                program: "nft",
                source,
            }
        })?;
    if !status.success() {
        return Err(crate::error::AgentError::NftRefused {
            table,
            stderr: String::from_utf8_lossy(&stderr).trim().to_owned(),
        });
    }
    Ok(())
}

/// Removes the agent's nftables table `table` (family `inet`; nothing when it is not there).
pub fn remove_nft_table(table: &'static str) -> Result<(), crate::error::AgentError> {
    run_nft(
        table,
        &format!("table inet {table}\ndelete table inet {table}\n"),
    )
}

/// Runs `command` with `input` on its stdin, for at most `timeout` (killed and reaped past
/// it: an error); its exit status, stdout and stderr.
pub fn run_bounded(
    command: &mut std::process::Command,
    input: Option<&str>,
    timeout: std::time::Duration,
) -> std::io::Result<(std::process::ExitStatus, Vec<u8>, Vec<u8>)> {
    use std::{io::Read as _, process::Stdio};
    let mut child = command
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    // Fed and drained from threads: a child that fills a pipe must not block us, and a child
    // that does not read must not block our write.
    let feeder = child.stdin.take().map(|mut stdin| {
        let input = input.unwrap_or_default().to_owned();
        std::thread::spawn(move || {
            let _ = std::io::Write::write_all(&mut stdin, input.as_bytes());
        })
    });
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as Box<_>));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as Box<_>));
    let deadline = std::time::Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("still running after {timeout:?}; killed"),
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    if let Some(feeder) = feeder {
        let _ = feeder.join();
    }
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    Ok((status, stdout, stderr))
}

/// The names of this network namespace's interfaces.
pub fn interface_names() -> Vec<String> {
    let mut names = Vec::new();
    // SAFETY: if_nameindex returns a list terminated by a zero entry, or null; it is freed
    // with if_freenameindex once its names are copied.
    unsafe {
        let list = libc::if_nameindex();
        if list.is_null() {
            return names;
        }
        let mut entry = list;
        while (*entry).if_index != 0 {
            names.push(
                std::ffi::CStr::from_ptr((*entry).if_name)
                    .to_string_lossy()
                    .into_owned(),
            );
            entry = entry.add(1);
        }
        libc::if_freenameindex(list);
    }
    names
}

/// The global addresses of interface `name` with their prefix lengths (`ip -o addr show`),
/// e.g. `10.99.0.1/24`; empty when it has none or `ip` fails.
pub fn interface_networks(name: &str) -> Vec<ipnet::IpNet> {
    let Ok(out) = run_ip(
        &["-o", "addr", "show", "dev", name, "scope", "global"],
        None,
    ) else {
        return Vec::new();
    };
    out.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            words.find(|w| *w == "inet" || *w == "inet6")?;
            words.next()?.parse().ok()
        })
        .collect()
}

/// Every IP address of this network namespace's interfaces (getifaddrs).
pub fn local_addresses() -> io::Result<Vec<IpAddr>> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a linked list we free below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut addresses = Vec::new();
    let mut entry = list;
    while !entry.is_null() {
        // SAFETY: a node of the list getifaddrs returned, valid until freeifaddrs.
        let node = unsafe { &*entry };
        if !node.ifa_addr.is_null() {
            // SAFETY: ifa_addr points at a sockaddr whose family says its real type.
            let family = i32::from(unsafe { (*node.ifa_addr).sa_family });
            if family == libc::AF_INET {
                // SAFETY: an AF_INET sockaddr is a sockaddr_in.
                let v4 = unsafe { &*(node.ifa_addr as *const libc::sockaddr_in) };
                addresses.push(IpAddr::from(u32::from_be(v4.sin_addr.s_addr).to_be_bytes()));
            } else if family == libc::AF_INET6 {
                // SAFETY: an AF_INET6 sockaddr is a sockaddr_in6.
                let v6 = unsafe { &*(node.ifa_addr as *const libc::sockaddr_in6) };
                addresses.push(IpAddr::from(v6.sin6_addr.s6_addr));
            }
        }
        entry = node.ifa_next;
    }
    // SAFETY: the list getifaddrs allocated, freed once.
    unsafe { libc::freeifaddrs(list) };
    addresses.sort();
    addresses.dedup();
    Ok(addresses)
}

/// Sends one whole Ethernet frame out of `ifindex` through an AF_PACKET socket.
pub fn send_frame(ifindex: u32, frame: &[u8]) -> std::io::Result<()> {
    // SAFETY: a plain socket(2); the descriptor is owned and closed below.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by socket(2) and nothing else owns it.
    let socket = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: sockaddr_ll is plain data; zero is a valid start.
    let mut address: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    address.sll_family = libc::AF_PACKET as u16;
    address.sll_ifindex = ifindex as i32;
    address.sll_halen = 6;
    address.sll_addr[..6].copy_from_slice(&frame[..6]);
    // SAFETY: the frame and the address outlive the call; their lengths are passed.
    let sent = unsafe {
        libc::sendto(
            std::os::fd::AsRawFd::as_raw_fd(&socket),
            frame.as_ptr().cast(),
            frame.len(),
            0,
            (&raw const address).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An RTM_NEWLINK reply: the header, an ifinfomsg, an IFLA_MTU and an IFLA_IFALIAS.
    fn newlink_reply(alias: &str) -> Vec<u8> {
        let mut attrs = Vec::new();
        attrs.extend_from_slice(&8u16.to_ne_bytes());
        attrs.extend_from_slice(&libc::IFLA_MTU.to_ne_bytes());
        attrs.extend_from_slice(&1500u32.to_ne_bytes());
        let len = 4 + alias.len() + 1;
        attrs.extend_from_slice(&(len as u16).to_ne_bytes());
        attrs.extend_from_slice(&libc::IFLA_IFALIAS.to_ne_bytes());
        attrs.extend_from_slice(alias.as_bytes());
        attrs.push(0);
        attrs.resize(attrs.len().next_multiple_of(4), 0);
        let mut reply = Vec::new();
        reply.extend_from_slice(&((32 + attrs.len()) as u32).to_ne_bytes());
        reply.extend_from_slice(&libc::RTM_NEWLINK.to_ne_bytes());
        reply.extend_from_slice(&[0; 10]);
        reply.extend_from_slice(&[0; 16]);
        reply.extend_from_slice(&attrs);
        reply
    }

    #[test]
    fn the_alias_is_read_from_the_link_reply() {
        assert_eq!(
            link_alias(&newlink_reply(TAKES_XDP_ALIAS)).expect("alias"),
            TAKES_XDP_ALIAS
        );
        let mut without = newlink_reply("x");
        without.truncate(40);
        without[..4].copy_from_slice(&40u32.to_ne_bytes());
        assert_eq!(link_alias(&without).expect("no alias"), "");
        // The loopback device of this namespace, asked of the kernel itself.
        assert_eq!(alias(1).expect("rtnetlink"), "");
        assert!(!takes_xdp(1));
    }

    #[test]
    fn local_addresses_include_loopback() {
        let addresses = local_addresses().expect("getifaddrs");
        assert!(
            addresses.contains(&IpAddr::from([127, 0, 0, 1])),
            "{addresses:?}"
        );
    }

    #[test]
    fn a_helper_that_hangs_is_killed_at_its_deadline_and_one_that_answers_is_read_whole() {
        let started = std::time::Instant::now();
        let error = run_bounded(
            std::process::Command::new("sleep").arg("30"),
            None,
            std::time::Duration::from_millis(200),
        )
        .expect_err("killed");
        assert_eq!(error.kind(), std::io::ErrorKind::TimedOut);
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        // Input in, a large output out (more than a pipe holds), both whole.
        let input = "x".repeat(200_000);
        let (status, out, _) = run_bounded(
            &mut std::process::Command::new("cat"),
            Some(&input),
            std::time::Duration::from_secs(10),
        )
        .unwrap();
        assert!(status.success());
        assert_eq!(out.len(), input.len());
    }

    #[test]
    fn reads_gro_as_ethtool_does() {
        let ethtool = std::process::Command::new("ethtool")
            .args(["-k", "lo"])
            .output()
            .expect("ethtool is installed by cargo xtask setup");
        let text = String::from_utf8_lossy(&ethtool.stdout);
        assert!(
            ethtool.status.success(),
            "ethtool -k lo: {}{text}",
            String::from_utf8_lossy(&ethtool.stderr)
        );
        // Its one line for the feature, `on` or `off` (with ` [fixed]` where it cannot change).
        let state = text
            .lines()
            .find_map(|line| line.strip_prefix("generic-receive-offload: "))
            .unwrap_or_else(|| panic!("no GRO line in ethtool's answer:\n{text}"));
        let expected = match state.split_whitespace().next() {
            Some("on") => true,
            Some("off") => false,
            _ => panic!("GRO state {state:?}"),
        };
        assert_eq!(gro_enabled("lo").unwrap(), expected);
        assert!(gro_enabled("no-such-dev0").is_err());
    }

    #[test]
    fn finds_host_routes_in_proc_tables() {
        let v4 = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                  eth0\t0063A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
                  vp0\t0201F40A\t00000000\t0005\t0\t0\t0\tFFFFFFFF\t0\t0\t0\n";
        assert_eq!(
            host_route_v4(v4, Ipv4Addr::new(10, 244, 1, 2)).as_deref(),
            Some("vp0")
        );
        assert_eq!(host_route_v4(v4, Ipv4Addr::new(10, 244, 1, 3)), None);
        let v6 = "fd00102a000000010000000000000002 80 00000000000000000000000000000000 00 \
                  00000000000000000000000000000000 00000400 00000001 00000000 00000001 vp1\n";
        let ip: Ipv6Addr = "fd00:102a:0:1::2".parse().expect("address");
        assert_eq!(host_route_v6(v6, ip).as_deref(), Some("vp1"));
    }

    #[test]
    fn loopback_has_an_mtu_and_a_mac() {
        assert!(mtu("lo").expect("lo mtu") >= 1500);
        assert_eq!(mac("lo").expect("lo mac"), [0; 6]);
        assert!(mtu("nosuch0").is_err());
    }
}
