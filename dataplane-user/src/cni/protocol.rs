//! What the plugin and the agent say to each other over the agent's unix socket: one JSON
//! request, the writing side shut, one JSON reply.

use std::{
    io::{Read as _, Write as _},
    os::unix::net::UnixStream,
    path::Path,
    time::Duration,
};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::spec::{CniError, code};
use crate::ipam::PodRef;

/// One container interface, as the runtime names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Target {
    pub container_id: String,
    /// `CNI_NETNS` (DEL may come without it).
    pub netns: Option<String>,
    pub ifname: String,
    pub pod: Option<PodRef>,
}

/// The longest interface name the kernel takes: IFNAMSIZ (16) less its terminating zero.
pub const IFNAME_MAX: usize = 15;
/// The longest container id taken: runtimes use 64 hex digits; room for others' schemes.
pub const CONTAINER_ID_MAX: usize = 256;
/// The largest request the agent reads: a GC naming thousands of attachments fits easily.
pub const REQUEST_MAX: usize = 1 << 20;

/// Whether `name` may be given to the kernel as a pod's interface name, and written into an
/// `ip -batch` line and a `/proc/sys/net/.../conf/<name>/` path: 1 to 15 characters of
/// `[A-Za-z0-9_.-]`, not `.` or `..` (path components), not `all` or `default` (the sysctl
/// directories that change every interface of the namespace).
pub fn check_ifname(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > IFNAME_MAX {
        return Err(format!(
            "CNI_IFNAME {name:?}: an interface name has 1 to {IFNAME_MAX} characters"
        ));
    }
    if !name.bytes().all(is_name_byte) {
        return Err(format!(
            "CNI_IFNAME {name:?}: only letters, digits, '_', '.' and '-' are allowed"
        ));
    }
    if matches!(name, "." | ".." | "all" | "default") {
        return Err(format!("CNI_IFNAME {name:?} is reserved"));
    }
    Ok(())
}

/// Whether `id` is a container id as the specification allows it: 1 to
/// [`CONTAINER_ID_MAX`] characters of `[A-Za-z0-9_.-]` (it keys the address allocations and
/// appears in logs).
pub fn check_container_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > CONTAINER_ID_MAX {
        return Err(format!(
            "CNI_CONTAINERID: a container id has 1 to {CONTAINER_ID_MAX} characters (got {})",
            id.len()
        ));
    }
    if !id.bytes().all(is_name_byte) {
        return Err(format!(
            "CNI_CONTAINERID {:?}: only letters, digits, '_', '.' and '-' are allowed",
            id.chars().take(80).collect::<String>()
        ));
    }
    Ok(())
}

fn is_name_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'.' | b'-')
}

impl Target {
    /// Checks the names the runtime gave before anything is made of them (the netns path is
    /// checked where it is opened: [`super::wire::open_pod_netns`]).
    pub fn check_names(&self) -> Result<(), CniError> {
        check_container_id(&self.container_id)
            .and_then(|()| check_ifname(&self.ifname))
            .map_err(|why| CniError::new(code::INVALID_ENVIRONMENT, why))
    }
}

impl Request {
    /// Checks every name the request carries (see [`Target::check_names`]).
    pub fn check_names(&self) -> Result<(), CniError> {
        match self {
            Request::Add(target) | Request::Del(target) | Request::Check(target) => {
                target.check_names()
            }
            Request::Status => Ok(()),
            Request::Gc(valid) => valid.iter().try_for_each(|(id, ifname)| {
                check_container_id(id)
                    .and_then(|()| check_ifname(ifname))
                    .map_err(|why| CniError::new(code::INVALID_CONFIG, format!("GC: {why}")))
            }),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    Add(Target),
    Del(Target),
    Check(Target),
    Status,
    /// Every attachment the runtime still has; the agent releases the others.
    Gc(Vec<(String, String)>),
}

/// A pod's wiring, as ADD made it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    pub host_iface: String,
    pub host_mac: String,
    pub ifname: String,
    pub pod_mac: String,
    pub netns: String,
    pub addresses: Vec<IpNet>,
    pub mtu: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    Attached(Attachment),
    Done,
    Failed(CniError),
}

/// Sends `request` to the agent at `socket` and waits up to `timeout` for its reply. An agent
/// that cannot be reached is `unreachable_code` (ADD: try again later; STATUS: not available).
pub fn call(
    socket: &Path,
    request: &Request,
    timeout: Duration,
    unreachable_code: u32,
) -> Result<Reply, CniError> {
    let unreachable = |e: std::io::Error| {
        CniError::new(
            unreachable_code,
            format!(
                "the dataplane agent is not reachable at {}: is the dataplane DaemonSet's pod running and ready on this node?",
                socket.display()
            ),
        )
        .with_details(e.to_string())
    };
    let mut stream = UnixStream::connect(socket).map_err(unreachable)?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(unreachable)?;
    stream
        .set_write_timeout(Some(timeout))
        .map_err(unreachable)?;
    let text = serde_json::to_vec(request).expect("a request serializes");
    stream.write_all(&text).map_err(unreachable)?;
    stream
        .shutdown(std::net::Shutdown::Write)
        .map_err(unreachable)?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).map_err(|e| {
        CniError::new(
            code::TRY_AGAIN_LATER,
            format!(
                "the dataplane agent at {} did not answer within {} s",
                socket.display(),
                timeout.as_secs()
            ),
        )
        .with_details(e.to_string())
    })?;
    serde_json::from_slice(&answer).map_err(|e| {
        CniError::new(
            code::TRY_AGAIN_LATER,
            format!(
                "the dataplane agent at {} closed the connection without an answer (restarting?)",
                socket.display()
            ),
        )
        .with_details(e.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_that_could_reach_a_command_or_a_path_are_refused() {
        for good in ["eth0", "net1", "a", "veth_1.2-x", "abcdefghijklmno"] {
            assert_eq!(check_ifname(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "abcdefghijklmnop",
            "eth0\nlink del eth0",
            "eth0 type dummy",
            "../../x",
            "a/b",
            ".",
            "..",
            "all",
            "default",
            "eth0\0",
            "é",
        ] {
            assert!(check_ifname(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn container_ids_are_checked_as_the_specification_says() {
        assert_eq!(check_container_id(&"f".repeat(64)), Ok(()));
        assert!(check_container_id("").is_err());
        assert!(check_container_id(&"f".repeat(CONTAINER_ID_MAX + 1)).is_err());
        assert!(check_container_id("abc/../x").is_err());
        assert!(check_container_id("abc\ndef").is_err());
        let target = Target {
            container_id: "abc".into(),
            netns: None,
            ifname: "eth0;reboot".into(),
            pod: None,
        };
        let refused = Request::Add(target).check_names().unwrap_err();
        assert_eq!(refused.code, code::INVALID_ENVIRONMENT);
        assert!(refused.msg.contains("CNI_IFNAME"), "{}", refused.msg);
        let gc = Request::Gc(vec![("abc".into(), "eth0\n".into())]);
        assert_eq!(gc.check_names().unwrap_err().code, code::INVALID_CONFIG);
    }
}
