//! Multicast with real sockets in pods: members that join groups (`IP_ADD_MEMBERSHIP`,
//! `IPV6_JOIN_GROUP`) and report every datagram with the TTL or hop limit it arrived with, and
//! senders that set theirs.

use std::{
    io::{BufRead as _, BufReader},
    process::{Child, Command, Stdio},
    sync::mpsc,
    thread,
    time::Duration,
};

use anyhow::{Context as _, bail};

/// The member's program: joins the groups (argv 1, comma-separated) on port argv 2, prints
/// `joined`, then `<payload> <ttl>` per datagram until killed.
const MEMBER: &str = r#"
import socket, struct, sys
groups = sys.argv[1].split(",")
port = int(sys.argv[2])
v6 = ":" in groups[0]
s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::" if v6 else "0.0.0.0", port))
for g in groups:
    if v6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_JOIN_GROUP, socket.inet_pton(socket.AF_INET6, g) + struct.pack("@I", 0))
    else:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton(g) + socket.inet_aton("0.0.0.0"))
if v6:
    s.setsockopt(socket.IPPROTO_IPV6, 51, 1)  # IPV6_RECVHOPLIMIT
else:
    s.setsockopt(socket.IPPROTO_IP, 12, 1)  # IP_RECVTTL
print("joined", flush=True)
while True:
    data, ancillary, _, _ = s.recvmsg(2048, 64)
    ttl = -1
    for level, kind, value in ancillary:
        ttl = struct.unpack("@i", value[:4])[0] if len(value) >= 4 else value[0]
    print(data.decode(), ttl, flush=True)
"#;

/// The sender's program: argv group, port, TTL, count, tag; one datagram `<tag>-<i>` every
/// 50 ms.
const SENDER: &str = r#"
import socket, struct, sys, time
group, port, ttl, count, tag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
v6 = ":" in group
s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
if v6:
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, ttl)
else:
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, ttl)
for i in range(count):
    s.sendto(f"{tag}-{i}".encode(), (group, port))
    time.sleep(0.05)
"#;

/// A member process in a pod; leaves its groups (the kernel sends the leave) when stopped.
pub struct Member {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Member {
    /// Joins `groups` on `port` inside `netns` and waits until joined.
    pub fn join(netns: &str, groups: &[&str], port: u16) -> anyhow::Result<Self> {
        let mut child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{netns}"))
            .args([
                "python3",
                "-u",
                "-c",
                MEMBER,
                &groups.join(","),
                &port.to_string(),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting a member")?;
        let stdout = child.stdout.take().context("member stdout")?;
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        match lines.recv_timeout(Duration::from_secs(10)) {
            Ok(line) if line == "joined" => Ok(Self { child, lines }),
            other => {
                let _ = child.kill();
                bail!("member in {netns} did not join: {other:?}")
            }
        }
    }

    /// The datagrams received so far (waiting `settle` first): (payload, TTL).
    pub fn received(&self, settle: Duration) -> Vec<(String, i32)> {
        thread::sleep(settle);
        self.lines
            .try_iter()
            .filter_map(|line| {
                let (payload, ttl) = line.rsplit_once(' ')?;
                Some((payload.to_owned(), ttl.parse().ok()?))
            })
            .collect()
    }

    /// Stops the member: its socket closes and the pod's kernel leaves the groups.
    pub fn leave(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `count` datagrams `<tag>-<i>` to `group`:`port` from inside `netns` with `ttl`.
pub fn send(
    netns: &str,
    group: &str,
    port: u16,
    ttl: u8,
    count: u32,
    tag: &str,
) -> anyhow::Result<()> {
    let out = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{netns}"))
        .args([
            "python3",
            "-c",
            SENDER,
            group,
            &port.to_string(),
            &ttl.to_string(),
            &count.to_string(),
            tag,
        ])
        .output()
        .context("running a sender")?;
    if !out.status.success() {
        bail!(
            "sender in {netns}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// The payloads of `received` with `tag`, and the TTLs they arrived with.
pub fn tagged(received: &[(String, i32)], tag: &str) -> Vec<(String, i32)> {
    received
        .iter()
        .filter(|(payload, _)| payload.starts_with(&format!("{tag}-")))
        .cloned()
        .collect()
}
