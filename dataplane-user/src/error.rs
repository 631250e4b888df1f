//! Errors of the agent library. Each message says what went wrong and what to do about it.

use std::{io, path::PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(
        "missing privileges: loading eBPF programs needs root, or CAP_BPF, CAP_NET_ADMIN and \
         CAP_SYS_ADMIN; run as root or as a privileged pod"
    )]
    NotPrivileged,

    #[error(
        "unsupported kernel: {gap}; the dataplane needs Linux 5.15 or newer with BPF and BTF enabled"
    )]
    KernelUnsupported { gap: KernelGap },

    #[error(
        "IP forwarding is off on this node: the pod overlay needs it \
         (sysctl -w net.ipv4.conf.all.forwarding=1, and net.ipv6.conf.all.forwarding=1 for IPv6)"
    )]
    ForwardingDisabled,

    #[error("cannot run {program}: {source} (is it installed?)")]
    Spawn {
        program: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("nft refused the {table} table: {stderr}")]
    NftRefused { table: &'static str, stderr: String },
    #[error("ip {args}: {detail}")]
    IpCommand { args: String, detail: String },
    #[error("netlink request {request}: {detail}")]
    Netlink { request: String, detail: String },

    #[error("no dataplane pinned under {pins}: start the agent first")]
    NotRunning { pins: PathBuf },
    #[error("trace: source {from} and destination {to} must be of one family")]
    MixedFamilies {
        from: std::net::IpAddr,
        to: std::net::IpAddr,
    },
    #[error("trace: building the packet")]
    TracePacket(#[source] etherparse::err::packet::BuildWriteError),
    #[error("counting this machine's CPUs")]
    CpuCount(#[source] io::Error),

    #[error("cannot listen on {address} for metrics: {source}; pick a free address")]
    Listen {
        address: std::net::SocketAddr,
        #[source]
        source: io::Error,
    },

    #[error(
        "interface {name:?} not found in this network namespace: create it or name an existing one"
    )]
    InterfaceNotFound { name: String },

    #[error("bpffs: {path} is not on a bpf filesystem and could not be mounted there: {source}")]
    Bpffs {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error(
        "pinned maps under {path} were written with layout version {found}, this agent writes \
         version {expected}: run `dataplane cleanup --pin-root {path}` to start fresh (this drops \
         their state), or run the agent version that wrote them"
    )]
    LayoutMismatch {
        path: PathBuf,
        found: u32,
        expected: u32,
    },

    #[error("loading the eBPF object failed")]
    Load(#[source] aya::EbpfError),

    #[error("program {name} is missing from the eBPF object or has another type")]
    MissingProgram { name: &'static str },

    #[error("map {name} is missing from the eBPF object or has another type")]
    MissingMap { name: &'static str },

    #[error("program {name}: {action} failed")]
    Program {
        name: &'static str,
        action: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },

    #[error("map {name}: {action} failed")]
    Map {
        name: String,
        action: &'static str,
        #[source]
        source: aya::maps::MapError,
    },

    #[error("map {name}: {action} failed")]
    XdpMap {
        name: &'static str,
        action: &'static str,
        #[source]
        source: aya::maps::xdp::XdpMapError,
    },

    #[error("pinning {path} failed")]
    Pin {
        path: PathBuf,
        #[source]
        source: aya::pin::PinError,
    },

    #[error(
        "attaching {program} to {interface} failed in every allowed mode: {}",
        AttachAttempt::list(attempts)
    )]
    Attach {
        program: &'static str,
        interface: String,
        attempts: Vec<AttachAttempt>,
    },

    /// A sync needs more entries than a map holds: nothing of it was written.
    #[error(
        "{what}: {needed} needed, more than the {limit} map {map} holds; raise {flag} (a new \
         size applies to maps created anew: `dataplane cleanup`, then start the agent); the \
         last good state stays in force"
    )]
    Capacity {
        what: &'static str,
        needed: usize,
        map: &'static str,
        limit: u32,
        flag: &'static str,
    },

    /// A map refused an entry because it is full.
    #[error(
        "{name} is full ({action}); raise {flag} (a new size applies to maps created anew: \
         `dataplane cleanup`, then start the agent)"
    )]
    MapFull {
        name: String,
        action: &'static str,
        flag: &'static str,
    },

    /// A change to the node's interfaces, neighbours or routes failed (what was asked, and
    /// what the kernel or `ip` said).

    #[error("{action} {path}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_mismatch_says_what_to_do() {
        let text = AgentError::LayoutMismatch {
            path: "/sys/fs/bpf/dataplane".into(),
            found: 7,
            expected: 1,
        }
        .to_string();
        assert!(text.contains("layout version 7"), "{text}");
        assert!(
            text.contains("dataplane cleanup --pin-root /sys/fs/bpf/dataplane"),
            "{text}"
        );
    }
}

/// What the kernel lacks for the dataplane.
#[derive(Debug, thiserror::Error)]
pub enum KernelGap {
    #[error("cannot read the kernel version")]
    VersionUnreadable(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("running {running}")]
    TooOld { running: aya::util::KernelVersion },
    #[error("no /sys/kernel/btf/vmlinux (kernel built without CONFIG_DEBUG_INFO_BTF)")]
    NoBtf,
}

/// One way of attaching a program that the kernel refused.
#[derive(Debug)]
pub struct AttachAttempt {
    /// The mode or step tried: an XDP mode ("native"), "tc filter", "adding the clsact qdisc".
    pub step: &'static str,
    pub error: Box<dyn std::error::Error + Send + Sync>,
}

impl AttachAttempt {
    pub fn new(step: &'static str, error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self {
            step,
            error: Box::new(error),
        }
    }

    /// The attempts as one line, each with its error's chain of causes.
    fn list(attempts: &[AttachAttempt]) -> String {
        let each: Vec<String> = attempts.iter().map(ToString::to_string).collect();
        each.join("; ")
    }
}

impl std::fmt::Display for AttachAttempt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.step, error_chain(self.error.as_ref()))
    }
}

/// An error and its causes, in one line: the kernel's answer is often the innermost cause.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
