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
