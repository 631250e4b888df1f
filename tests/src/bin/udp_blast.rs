//! Sends UDP datagrams to one address as fast as one socket can (sendmmsg, 64 per call) for a
//! number of seconds, then prints how many it sent. The load generator of the load-balancer
//! packet-rate benchmark; run inside a pod's namespace.

use std::{
    net::{SocketAddr, UdpSocket},
    os::fd::AsRawFd as _,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Destination, e.g. 10.96.0.10:80.
    target: SocketAddr,
    #[arg(long, default_value_t = 3)]
    seconds: u64,
    /// UDP payload bytes.
    #[arg(long, default_value_t = 18)]
    payload: usize,
}

const BATCH: usize = 64;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let socket = UdpSocket::bind("0.0.0.0:0").context("binding")?;
    socket.connect(args.target).context("connecting")?;
    let payload = vec![0x5au8; args.payload];
    let mut iovecs: Vec<libc::iovec> = (0..BATCH)
        .map(|_| libc::iovec {
            iov_base: payload.as_ptr() as *mut libc::c_void,
            iov_len: payload.len(),
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
        // SAFETY: the messages and their buffers outlive the call; the socket is connected.
        let n =
            unsafe { libc::sendmmsg(socket.as_raw_fd(), messages.as_mut_ptr(), BATCH as u32, 0) };
        if n > 0 {
            sent += n as u64;
        }
    }
    println!("{sent}");
    Ok(())
}
