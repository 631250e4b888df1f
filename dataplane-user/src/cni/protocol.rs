//! What the plugin and the agent say to each other over the agent's unix socket: one JSON
//! request, the writing side shut, one JSON reply.

use std::{
    io::{Read as _, Write as _},
    os::unix::net::UnixStream,
    path::Path,
    time::Duration,
};

use serde::{Deserialize, Serialize};

use super::{
    ipam::PodRef,
    names::{check_container_id, check_ifname},
    spec::{Attachment, CniError, code},
};

/// One container interface, as the runtime names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Target {
    pub container_id: String,
    /// `CNI_NETNS` (DEL may come without it).
    pub netns: Option<String>,
    pub ifname: String,
    pub pod: Option<PodRef>,
}

/// The largest request the agent reads: a GC naming thousands of attachments fits easily.
pub const REQUEST_MAX: usize = 1 << 20;

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
    fn requests_with_bad_names_are_refused_with_the_specifications_codes() {
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
