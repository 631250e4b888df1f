//! Access control (NetworkPolicy, admin network policies, EgressFirewall): map layouts shared by
//! the kernel stage and the agent's compiler.
//!
//! A rule set (one namespace's EgressFirewall, later one pod's policies for one direction) is
//! compiled into hash lookups whose number does not depend on the number of rules:
//! 1. `ACL_ADDRS`: (set, family, prefix length, masked destination) -> the decision for every
//!    packet to that prefix. The set uses at most `ACL_MAX_LENGTHS` prefix lengths per family
//!    (the agent expands prefixes of other lengths into those); the kernel tries them longest
//!    first and stops at the first hit. Each entry already holds the first-match outcome of
//!    every rule covering its prefix, so the longest match alone decides.
//! 2. When the decision depends on the protocol or port, `ACL_PORTS` holds the entries of that
//!    prefix's port table: an exact port, a 256-port bucket, or a whole protocol, tried in that
//!    order (each only when the table has entries of that kind); the table's default for
//!    everything else is in the address entry itself.
//! 3. Where no prefix decided and the set has peer entries, `ACL_PEERS` gives the peer
//!    address's identity (the pods a set's selectors can only pick together, as the agent
//!    groups them), and the set's entry for that identity (`peer_key`) decides as a prefix
//!    entry does. Three hundred peer pods picked alike are one entry of the set, not three
//!    hundred: a set that takes or leaves them changes one entry. The fallback is exact for
//!    sets whose rules only allow (NetworkPolicy's): a packet is allowed when either lookup
//!    allows it.

use crate::overlay::Addr;

/// No rule of the set matched: the set's default applies (allow for an EgressFirewall).
pub const ACL_VERDICT_NONE: u8 = 0;
pub const ACL_VERDICT_ALLOW: u8 = 1;
pub const ACL_VERDICT_DENY: u8 = 2;

/// `AclAddrValue::kind`: `verdict` and `rule` are the decision for every protocol and port.
pub const ACL_ENTRY_FINAL: u8 = 1;
/// `AclAddrValue::kind`: look the protocol and port up in port table `table`; `verdict` and
/// `rule` are the table's default.
pub const ACL_ENTRY_PORTS: u8 = 2;

/// `AclAddrValue::port_kinds` bits, and `AclPortKey::kind` values' bits: which kinds of entry
/// a port table has.
pub const ACL_PORT_EXACT: u8 = 1 << 0;
pub const ACL_PORT_BUCKET: u8 = 1 << 1;
pub const ACL_PORT_PROTOCOL: u8 = 1 << 2;

/// `rule` of decisions the firewall did not write a rule for: the cluster's own networks and
/// the node's DNS, which an EgressFirewall never affects.
pub const ACL_RULE_EXEMPT: u32 = u32::MAX;

/// Most rules of one EgressFirewall (OVN-Kubernetes' limit).
pub const MAX_FIREWALL_RULES: usize = 8000;

/// Most prefix lengths a set uses per address family (lookups per packet, at most).
pub const ACL_MAX_LENGTHS: usize = 8;
/// Marks an unused slot of a lengths list.
pub const ACL_NO_LENGTH: u8 = 0xFF;

/// `AclAddrKey::family`.
pub const ACL_FAMILY_V4: u8 = 4;
pub const ACL_FAMILY_V6: u8 = 6;
/// `AclAddrKey::family` of a peer identity's entry (`len` zero, the identity in `addr`).
pub const ACL_FAMILY_PEER: u8 = 0;

/// Key of `ACL_ADDRS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AclAddrKey {
    pub set: u32,
    /// `ACL_FAMILY_V4` or `ACL_FAMILY_V6`.
    pub family: u8,
    /// Prefix length within the family (0..=32 or 0..=128).
    pub len: u8,
    pub _pad: [u8; 2],
    /// The address masked to `len` bits, in the 16-byte form (IPv4-mapped for IPv4).
    pub addr: Addr,
}

/// The `ACL_ADDRS` key of set `set`'s entry for the peers of identity `identity`: the
/// identity's bytes (native order) lead `addr`, the rest is zero.
pub const fn peer_key(set: u32, identity: u32) -> AclAddrKey {
    let id = identity.to_ne_bytes();
    let mut addr = [0u8; 16];
    addr[0] = id[0];
    addr[1] = id[1];
    addr[2] = id[2];
    addr[3] = id[3];
    AclAddrKey {
        set,
        family: ACL_FAMILY_PEER,
        len: 0,
        _pad: [0; 2],
        addr,
    }
}

/// What `ACL_ADDRS` answers for a prefix.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AclAddrValue {
    /// Port table to consult (`ACL_ENTRY_PORTS`).
    pub table: u32,
    /// The deciding rule: its index in the object, or `ACL_RULE_EXEMPT`. With
    /// `ACL_ENTRY_PORTS`, the rule deciding what the port table does not list.
    pub rule: u32,
    /// `ACL_VERDICT_*`, as `rule`.
    pub verdict: u8,
    /// `ACL_ENTRY_FINAL` or `ACL_ENTRY_PORTS`.
    pub kind: u8,
    /// `ACL_PORT_*` bits: the kinds of entry the port table has.
    pub port_kinds: u8,
    pub _pad: u8,
}

/// Key of `ACL_PORTS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AclPortKey {
    pub table: u32,
    /// IP protocol.
    pub protocol: u8,
    /// One of `ACL_PORT_EXACT`, `ACL_PORT_BUCKET`, `ACL_PORT_PROTOCOL`.
    pub kind: u8,
    /// Exact: the port; bucket: the port with its low 8 bits cleared; protocol: zero. Host
    /// byte order.
    pub port: u16,
}

/// A first-match outcome: value of `ACL_PORTS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AclVerdict {
    /// Index of the deciding rule in its object, or `ACL_RULE_EXEMPT`.
    pub rule: u32,
    /// `ACL_VERDICT_*`.
    pub verdict: u8,
    pub _pad: [u8; 3],
}

/// The prefix lengths a set uses, longest first, per family; unused slots `ACL_NO_LENGTH`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AclLengths {
    pub v4: [u8; ACL_MAX_LENGTHS],
    pub v6: [u8; ACL_MAX_LENGTHS],
}

impl Default for AclLengths {
    fn default() -> Self {
        Self {
            v4: [ACL_NO_LENGTH; ACL_MAX_LENGTHS],
            v6: [ACL_NO_LENGTH; ACL_MAX_LENGTHS],
        }
    }
}

/// `AclEndpoint::log`: send an audit event for each allowed / denied packet.
pub const ACL_LOG_ALLOW: u8 = 1 << 0;
pub const ACL_LOG_DENY: u8 = 1 << 1;

/// `AclEndpoint::flags`: the pod's admin policies name wildcard domains, whose addresses
/// the agent learns from the DNS answers the pod receives: copy them to `ACL_DNS`.
pub const ACL_ENDPOINT_SNOOP_DNS: u8 = 1 << 0;
/// `AclEndpoint::flags`: the pod's ingress (egress) set has peer entries: where no prefix
/// decides, the peer's identity is looked up (`ACL_PEERS`, then `peer_key`).
pub const ACL_ENDPOINT_INGRESS_PEERS: u8 = 1 << 1;
pub const ACL_ENDPOINT_EGRESS_PEERS: u8 = 1 << 2;

/// Bytes of a DNS answer copied to the agent (an answer's A and AAAA records past them are
/// not seen).
pub const ACL_DNS_CAPTURE: usize = 1024;

/// One DNS answer delivered to a pod, sent through the `ACL_DNS` ring buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AclDnsEvent {
    /// Who sent the answer, as the pod sees it (a DNS Service's address after the
    /// load-balancer's reverse translation): the agent trusts only DNS servers.
    pub src: Addr,
    /// Bytes of `message` copied (the UDP payload, at most `ACL_DNS_CAPTURE`).
    pub len: u32,
    pub _pad: u32,
    pub message: [u8; ACL_DNS_CAPTURE],
}

/// Which rule sets apply to a local pod (value of `ACL_ENDPOINTS`, keyed by its address).
/// A set id of zero means none. The set id and its lengths change in one write.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AclEndpoint {
    /// The EgressFirewall set of the pod's namespace.
    pub firewall: u32,
    /// `ACL_LOG_*` bits: the namespace's audit logging (`k8s.ovn.org/acl-logging`).
    pub log: u8,
    /// `ACL_ENDPOINT_*` bits.
    pub flags: u8,
    pub _reserved: [u8; 2],
    pub firewall_lengths: AclLengths,
    /// The NetworkPolicy sets of the pod (zero: not isolated in that direction). What no rule
    /// of an isolating set allows is denied.
    pub egress: u32,
    pub ingress: u32,
    pub egress_lengths: AclLengths,
    pub ingress_lengths: AclLengths,
}

impl AclEndpoint {
    /// Whether NetworkPolicy isolates the pod in either direction (its flows are tracked, so
    /// that replies pass).
    pub const fn policed(&self) -> bool {
        self.egress != 0 || self.ingress != 0
    }
}

/// Key of `ACL_CT`: a flow in the direction of its first packet, as the pod sees it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AclCtKey {
    pub src: Addr,
    pub dst: Addr,
    /// Host byte order (0 for protocols without ports).
    pub src_port: u16,
    pub dst_port: u16,
    pub protocol: u8,
    pub _pad: [u8; 3],
}

/// Value of `ACL_CT`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AclCtValue {
    /// Clock seconds (`bpf_ktime_get_coarse_ns / 1e9`) of the last packet.
    pub last_seen: u32,
    /// `ACL_CT_CLOSING` once a FIN or RST was seen; `ACL_CT_INBOUND` for a flow that came in
    /// to the pod.
    pub flags: u32,
}

pub const ACL_CT_CLOSING: u32 = 1;
/// The flow's first packet was delivered to a pod (from another node, a NodePort, outside):
/// the pod's replies are answers, not its own egress, and no EgressFirewall judges them.
pub const ACL_CT_INBOUND: u32 = 2;

/// `skb->mark` bit set by `tc_underlay` on service replies it reverse-NATed: the pod's
/// ingress policy does not judge replies of a connection the pod opened.
pub const SERVICE_REPLY_MARK: u32 = 1 << 20;

/// `AclEvent::direction`: traffic leaving the pod (OVN's from-lport) or reaching it.
pub const ACL_DIRECTION_EGRESS: u8 = 1;
pub const ACL_DIRECTION_INGRESS: u8 = 2;

/// `AclEvent::kind`: which rule set decided.
pub const ACL_KIND_FIREWALL: u8 = 1;
pub const ACL_KIND_POLICY: u8 = 2;

/// One audit record, sent through the `ACL_EVENTS` ring buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AclEvent {
    /// `bpf_ktime_get_ns` when the packet was judged.
    pub time_ns: u64,
    /// The deciding set and rule (`ACL_RULE_EXEMPT` never logs; `u32::MAX - 1`: no rule
    /// matched, the set's default decided).
    pub set: u32,
    pub rule: u32,
    pub src: Addr,
    pub dst: Addr,
    /// Host byte order.
    pub src_port: u16,
    pub dst_port: u16,
    pub protocol: u8,
    /// `ACL_VERDICT_ALLOW` or `ACL_VERDICT_DENY`.
    pub verdict: u8,
    /// `ACL_DIRECTION_*`.
    pub direction: u8,
    /// `ACL_KIND_*`.
    pub kind: u8,
    /// Packets this CPU suppressed (rate limit or full ring) since its previous event.
    pub suppressed: u32,
}

/// `AclEvent::rule` when no rule matched and the set's default decided.
pub const ACL_RULE_DEFAULT: u32 = u32::MAX - 1;

/// Audit rate limit (value of `ACL_LOG_CONFIG`): events per second each CPU may send; the
/// agent applies the node-wide limit on top.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AclLogConfig {
    pub rate_per_second: u32,
    pub _pad: u32,
}

/// Per-CPU token bucket of the audit rate limit (value of `ACL_LOG_BUCKETS`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AclLogBucket {
    /// Tokens in units of 1/1e9 event.
    pub nano_tokens: u64,
    pub last_ns: u64,
    /// Events suppressed since the last one sent.
    pub suppressed: u32,
    pub _pad: u32,
}

const _: () = {
    assert!(core::mem::size_of::<AclAddrKey>() == 24);
    assert!(core::mem::size_of::<AclAddrValue>() == 12);
    assert!(core::mem::size_of::<AclPortKey>() == 8);
    assert!(core::mem::size_of::<AclVerdict>() == 8);
    assert!(core::mem::size_of::<AclEndpoint>() == 64);
    assert!(core::mem::size_of::<AclCtKey>() == 40);
    assert!(core::mem::size_of::<AclCtValue>() == 8);
    assert!(core::mem::size_of::<AclEvent>() == 64);
    assert!(core::mem::size_of::<AclLogConfig>() == 8);
    assert!(core::mem::size_of::<AclLogBucket>() == 24);
};

#[cfg(feature = "user")]
mod pod_impls {
    // SAFETY: plain #[repr(C)] data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::AclAddrKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::AclAddrValue {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::AclPortKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::AclVerdict {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::AclEndpoint {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::AclEvent {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::AclCtKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::AclCtValue {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::AclLogConfig {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::AclLogBucket {}
}
