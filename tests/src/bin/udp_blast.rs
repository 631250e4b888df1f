//! Sends UDP datagrams to one address as fast as it can for a number of seconds, then prints
//! how many it sent. The load generator of the load-balancer packet-rate benchmark; run inside
//! a pod's namespace.
//!
//! Two ways: through a UDP socket (the pod's own stack builds every packet), or with `--raw`
//! as prebuilt Ethernet frames written to the interface (AF_PACKET, qdisc bypassed), so that
//! the node's forwarding, not the sender, dominates the cost. Both send in batches of 64.

use std::{
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Destination, e.g. 10.96.0.10:80.
    target: SocketAddrV4,
    #[arg(long, default_value_t = 3)]
    seconds: u64,
    /// UDP payload bytes.
    #[arg(long, default_value_t = 18)]
    payload: usize,
    /// Write prebuilt frames out of this interface instead of using a UDP socket.
    #[arg(long)]
    raw: Option<String>,
    /// With `--raw`: source address and the gateway's MAC (aa:bb:cc:dd:ee:ff).
    #[arg(long, requires = "raw")]
    source: Option<Ipv4Addr>,
    #[arg(long, requires = "raw")]
    gateway_mac: Option<String>,
}

const BATCH: usize = 64;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let payload = vec![0x5au8; args.payload];
    let (fd, datagram): (OwnedFd, Vec<u8>) = match &args.raw {
        None => {
            let socket = UdpSocket::bind("0.0.0.0:0").context("binding")?;
            socket
                .connect(SocketAddr::V4(args.target))
                .context("connecting")?;
            (socket.into(), payload)
        }
        Some(iface) => {
            let source = args.source.context("--raw needs --source")?;
            let gateway = parse_mac(
                args.gateway_mac
                    .as_deref()
                    .context("--raw needs --gateway-mac")?,
            )?;
            let (fd, own_mac) = packet_socket(iface)?;
            let frame = udp_frame(own_mac, gateway, source, args.target, &payload);
            (fd, frame)
        }
    };
    let mut iovecs: Vec<libc::iovec> = (0..BATCH)
        .map(|_| libc::iovec {
            iov_base: datagram.as_ptr() as *mut libc::c_void,
            iov_len: datagram.len(),
        })
        .collect();
    // SAFETY: an all-zero mmsghdr is valid; each one gets its iovec below.
    let mut messages: Vec<libc::mmsghdr> =
        (0..BATCH).map(|_| unsafe { std::mem::zeroed() }).collect();
    for (message, iovec) in messages.iter_mut().zip(iovecs.iter_mut()) {
        message.msg_hdr.msg_iov = iovec;
        message.msg_hdr.msg_iovlen = 1;
    }
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let mut sent: u64 = 0;
    while Instant::now() < deadline {
        // SAFETY: the messages and their buffers outlive the call; the socket is connected or
        // bound to the interface.
        let n = unsafe { libc::sendmmsg(fd.as_raw_fd(), messages.as_mut_ptr(), BATCH as u32, 0) };
        if n > 0 {
            sent += n as u64;
        }
    }
    println!("{sent}");
    Ok(())
}

fn parse_mac(text: &str) -> anyhow::Result<[u8; 6]> {
    let bytes: Vec<u8> = text
        .split(':')
        .map(|b| u8::from_str_radix(b, 16))
        .collect::<Result<_, _>>()
        .context("MAC address")?;
    bytes.try_into().ok().context("a MAC address has 6 bytes")
}

/// An AF_PACKET socket bound to `iface`, past the qdisc, and the interface's MAC.
fn packet_socket(iface: &str) -> anyhow::Result<(OwnedFd, [u8; 6])> {
    let protocol = (libc::ETH_P_ALL as u16).to_be();
    // SAFETY: plain socket creation; the fd is owned right away.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, protocol as i32) };
    if fd < 0 {
        bail!("AF_PACKET socket: {}", std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let name = std::ffi::CString::new(iface)?;
    // SAFETY: a NUL-terminated name.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        bail!("no interface {iface}");
    }
    let one: libc::c_int = 1;
    // SAFETY: a valid option value and length.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_PACKET,
            libc::PACKET_QDISC_BYPASS,
            (&raw const one).cast(),
            size_of::<libc::c_int>() as u32,
        );
    }
    // SAFETY: an all-zero sockaddr_ll is valid; family, protocol and index are set.
    let mut address: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    address.sll_family = libc::AF_PACKET as u16;
    address.sll_protocol = protocol;
    address.sll_ifindex = index as i32;
    // SAFETY: a valid address of the given length.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const address).cast(),
            size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if rc != 0 {
        bail!("binding to {iface}: {}", std::io::Error::last_os_error());
    }
    // Asked of the kernel in this thread's namespace: /sys/class/net shows the namespace that
    // mounted it (the host's, under nsenter), whose `eth0` is another interface. A frame with
    // another MAC than the pod's is refused by port security.
    let mac = dataplane_user::kernel::netdev::mac(iface)
        .with_context(|| format!("reading the MAC of {iface}"))?;
    Ok((fd, mac))
}

/// Ethernet + IPv4 (checksummed) + UDP (no checksum, allowed over IPv4) + payload.
fn udp_frame(
    source_mac: [u8; 6],
    gateway: [u8; 6],
    source: Ipv4Addr,
    target: SocketAddrV4,
    payload: &[u8],
) -> Vec<u8> {
    let mut frame = Vec::with_capacity(42 + payload.len());
    frame.extend_from_slice(&gateway);
    frame.extend_from_slice(&source_mac);
    frame.extend_from_slice(&0x0800u16.to_be_bytes());
    let total = (20 + 8 + payload.len()) as u16;
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    ip[6] = 0x40;
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&source.octets());
    ip[16..20].copy_from_slice(&target.ip().octets());
    let sum: u32 = ip
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    let folded = (sum & 0xffff) + (sum >> 16);
    let check = !(((folded & 0xffff) + (folded >> 16)) as u16);
    ip[10..12].copy_from_slice(&check.to_be_bytes());
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&40000u16.to_be_bytes());
    frame.extend_from_slice(&target.port().to_be_bytes());
    frame.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    frame.extend_from_slice(&[0, 0]);
    frame.extend_from_slice(payload);
    frame
}
