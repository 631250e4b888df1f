//! Names of the kernel programs and pinned maps, and the layout version of everything pinned.
//! The kernel side spells these names in its `#[map]`/`#[xdp]`/`#[classifier]` attributes (they
//! must be literals there); the agent's tests check every name here exists in the built object.

/// Bumped whenever a pinned map's key/value layout or meaning changes. A restarted agent refuses
/// to adopt pins written under another version instead of misreading them.
pub const LAYOUT_VERSION: u32 = 10;

/// Per-CPU array of u64, indexed by [`crate::DropReason`] code.
pub const DROPS: &str = "DP_DROPS";
/// Per-CPU array of u64, indexed by [`crate::stats::counter_index`].
pub const PACKETS: &str = "DP_PACKETS";

/// Array of one u32: the layout version the pins were created under.
pub const META: &str = "DP_META";

/// Array of one [`crate::overlay::OverlayConfig`].
pub const OVERLAY_CONFIG: &str = "DP_OVL_CONFIG";
/// LPM trie: remote IPv4 pod CIDR -> [`crate::overlay::TunnelEndpoint`].
pub const REMOTE_PODS_V4: &str = "DP_OVL_REMOTE4";
/// LPM trie: remote IPv6 pod CIDR -> [`crate::overlay::TunnelEndpoint`].
pub const REMOTE_PODS_V6: &str = "DP_OVL_REMOTE6";
/// Hash: underlay address of every cluster node (16-byte form) -> u32 (unused, 0).
pub const NODE_ADDRS: &str = "DP_OVL_NODES";
/// Hash: address of every local pod (16-byte form) -> [`crate::overlay::LocalPod`].
pub const LOCAL_PODS: &str = "DP_OVL_PODS";
/// Array of u64 (not pinned: a new program starts with every bit clear, which means "look"):
/// destinations known to lie outside every pod network ([`crate::overlay::OUTSIDE_WORDS`]).
pub const OUTSIDE: &str = "DP_OVL_OUTSIDE";
/// Per-CPU array (not pinned): [`crate::overlay::RouteCacheEntry`] by
/// [`crate::overlay::route_cache_slot`].
pub const ROUTE_CACHE: &str = "DP_OVL_ROUTES";

/// Per-CPU array (not pinned): a copy of a transport segment XDP delivers to a pod, for its
/// checksum.
pub const SEGMENT_SCRATCH: &str = "DP_SEGMENT";

/// Device hash map (not pinned): host-side veths of local pods whose pod end takes frames
/// from XDP, keyed and valued by their ifindex.
pub const XDP_PODS: &str = "DP_XDP_PODS";

/// Hash: ifindex of a local pod's host-side veth -> [`crate::port::PodPort`], the addresses
/// the pod may send as and be sent to (port security).
pub const POD_PORTS: &str = "DP_POD_PORTS";
/// Per-CPU array (not pinned): [`crate::port::PortCacheEntry`] by ifindex slot.
pub const PORT_CACHE: &str = "DP_PORT_CACHE";

/// Hash: [`crate::lb::ServiceKey`] -> [`crate::lb::ServiceValue`].
pub const LB_SERVICES: &str = "DP_LB_SERVICES";
/// Array: [`crate::lb::backend_slot`] of a backend id -> [`crate::lb::Backend`] (an array, so
/// the kernel's lookup is inlined: no call per packet).
pub const LB_BACKENDS: &str = "DP_LB_BACKENDS";
/// Hash (allocated on use): table index -> [`crate::lb::MaglevTable`]. Two indexes per service
/// port, the live table and the one the next update is built in.
pub const LB_MAGLEV: &str = "DP_LB_MAGLEV";
/// Array of u64: two port bitmaps (service ports, backend ports) that let packets of no
/// service skip the service and conntrack lookups ([`crate::lb::port_bit`]).
pub const LB_PORTS: &str = "DP_LB_PORTS";
/// LRU hash: [`crate::lb::CtKey`] -> [`crate::lb::CtValue`], both directions of every flow.
pub const LB_CT: &str = "DP_LB_CT";
/// Array of one u64: the index of the next masquerade source port to try (shared by every CPU,
/// advanced atomically, so ports are handed out in turn and come round again only after all
/// the others have; pinned, so a restarted agent continues where the last one was).
pub const LB_SNAT_NEXT: &str = "DP_LB_SNAT_NEXT";
/// Per-CPU array (not pinned): [`crate::lb::flow_cache_slot`] -> [`crate::lb::FlowCacheEntry`].
pub const LB_FLOW_CACHE: &str = "DP_LB_FLOW_CACHE";
pub const LB_XDP_FLOW_CACHE: &str = "DP_LB_XDP_FLOW_CACHE";
pub const NODE_ADDR_CACHE: &str = "DP_OVL_NODE_CACHE";
pub const LOCAL_POD_CACHE: &str = "DP_OVL_POD_CACHE";
/// LRU hash: [`crate::lb::AffinityKey`] -> [`crate::lb::AffinityValue`].
pub const LB_AFFINITY: &str = "DP_LB_AFFINITY";
/// (service port, backend) pairs of the service ports with ClientIP affinity.
pub const LB_MEMBERS: &str = "DP_LB_MEMBERS";
/// LPM trie: [`crate::lb::SourceRangeKey`] -> `SOURCE_RANGE_ALLOW` or `SOURCE_RANGE_DENY`, the
/// load-balancer addresses' `spec.loadBalancerSourceRanges`.
pub const LB_SOURCE_RANGES: &str = "DP_LB_SRC_RANGES";
/// Hash: address -> 1, the addresses NodePorts are served on when `--nodeport-addresses`
/// lists networks (`OVERLAY_NODEPORT_LISTED`); unused with the default (the node's primary
/// address per family, in `OverlayConfig`).
pub const LB_NODEPORT_ADDRS: &str = "DP_LB_NP_ADDRS";
/// Capacity of [`LB_NODEPORT_ADDRS`]: the node's own addresses inside the listed networks.
pub const MAX_NODEPORT_ADDRS: u32 = 64;
/// Datagrams being fragmented -> their first fragment's ports (LRU).
pub const FRAGS: &str = "DP_FRAGS";
/// Per pod (host-side veth ifindex): drops and service flows opened (`stats::PodCounters`).
pub const POD_STATS: &str = "DP_POD_STATS";

/// Hash: address of every local pod under access control (16-byte form) ->
/// [`crate::acl::AclEndpoint`], the rule sets that apply to it.
pub const ACL_ENDPOINTS: &str = "DP_ACL_ENDPOINTS";
/// Hash (allocated on use): [`crate::acl::AclAddrKey`] -> [`crate::acl::AclAddrValue`].
pub const ACL_ADDRS: &str = "DP_ACL_ADDRS";
/// Hash (allocated on use): [`crate::acl::AclPortKey`] -> [`crate::acl::AclVerdict`].
pub const ACL_PORTS: &str = "DP_ACL_PORTS";
/// Hash (allocated on use): address of a pod (16-byte form) that policy sets name by its
/// peer identity -> the identity (`u32`, never zero), which those sets key their entries
/// for it by ([`crate::acl::peer_key`]).
pub const ACL_PEERS: &str = "DP_ACL_PEERS";

/// Array of one u32: how many local pod addresses are under access control (written by the
/// agent after the endpoints; zero lets every packet skip the stage's lookups).
pub const ACL_ACTIVE: &str = "DP_ACL_ACTIVE";
/// Hash: every address of this node's own interfaces (16-byte form) -> u32 (unused, 0). What
/// the node sends from them reaches its pods whatever their policies (kubelet probes).
pub const ACL_NODE_ADDRS: &str = "DP_ACL_NODE_ADDRS";
pub const MAX_NODE_LOCAL_ADDRS: u32 = 4096;
/// LRU hash: [`crate::acl::AclCtKey`] -> [`crate::acl::AclCtValue`]: flows NetworkPolicy
/// allowed, so that their packets and replies pass.
pub const ACL_CT: &str = "DP_ACL_CT";
pub const MAX_ACL_CT_ENTRIES: u32 = 262_144;
/// Ring buffer of [`crate::acl::AclEvent`]: audit records for the agent.
pub const ACL_EVENTS: &str = "DP_ACL_EVENTS";
/// Bytes of the audit ring buffer (4096 events).
pub const ACL_EVENTS_BYTES: u32 = 256 * 1024;
/// Ring buffer of [`crate::acl::AclDnsEvent`]: DNS answers to pods whose admin policies name
/// wildcard domains.
pub const ACL_DNS: &str = "DP_ACL_DNS";
/// Bytes of the DNS ring buffer (about 250 answers).
pub const ACL_DNS_BYTES: u32 = 256 * 1024;
/// Array of one [`crate::acl::AclLogConfig`].
pub const ACL_LOG_CONFIG: &str = "DP_ACL_LOG_CONFIG";
/// Per-CPU array of one [`crate::acl::AclLogBucket`] (not pinned: rate state only).
pub const ACL_LOG_BUCKETS: &str = "DP_ACL_LOG_BUCKETS";

/// Default capacity of each access-control map (`--max-acl-entries`): 100 namespaces of 8000
/// rules each, with room for a second generation of the largest while it is switched in.
pub const DEFAULT_ACL_ENTRIES: u32 = 1_048_576;

/// Capacity of the load-balancer maps.
/// Default capacity of the service-port map (`--max-service-ports`).
pub const DEFAULT_SERVICE_PORTS: u32 = 16_384;
/// Backends: one array slot each, so one slot per value of [`crate::lb::backend_slot`].
/// Default capacity of the backends array (`--max-backends`, at most
/// [`crate::lb::MAX_BACKEND_SLOTS`]).
pub const DEFAULT_BACKENDS: u32 = 262_144;
/// Default capacity of the service conntrack map (`--max-conntrack`).
pub const DEFAULT_CT_ENTRIES: u32 = 262_144;
pub const MAX_AFFINITY_ENTRIES: u32 = 65_536;
/// Datagrams in flight in fragments, on all of a node's pods and its underlay.
pub const MAX_FRAGMENTED_DATAGRAMS: u32 = 8192;
/// Pods counted in `POD_STATS` (LRU: a pod gone long ago makes room).
pub const MAX_POD_STATS: u32 = 4096;
/// Ready backends summed over the service ports with ClientIP affinity.
pub const MAX_AFFINITY_MEMBERS: u32 = 65_536;

/// Egress IPs: the local pods an EgressIP selects, keyed by address (`egressip::EgressPod`).
pub const EGRESS_PODS: &str = "DP_EGRESS_PODS";
/// Egress IPs: where each assigned egress address is held (`egressip::EgressHolder`).
pub const EGRESS_IPS: &str = "DP_EGRESS_IPS";
/// Egress IPs: the pods (of any node) whose traffic this node translates, and the egress
/// address it gives them (`Addr` to `Addr`).
pub const EGRESS_SNAT: &str = "DP_EGRESS_SNAT";
/// Egress IPs: the destinations that are not outside the cluster (cluster and service
/// networks, node addresses): an LPM trie of 16-byte addresses.
pub const EGRESS_INTERNAL: &str = "DP_EGRESS_INTERNAL";
/// Egress IPs: flows' chosen addresses and translations (`lb::CtKey` to
/// `egressip::EgressCtValue`).
pub const EGRESS_CT: &str = "DP_EGRESS_CT";
/// Egress IPs: one u32 of `egressip::EGRESS_ACTIVE_*` bits (nothing to do when zero).
pub const EGRESS_ACTIVE: &str = "DP_EGRESS_ACTIVE";
pub const MAX_EGRESS_IPS: u32 = 4096;
pub const MAX_EGRESS_SNAT_PODS: u32 = 65_536;
pub const MAX_EGRESS_INTERNAL_PREFIXES: u32 = 16_384;
pub const MAX_EGRESS_CT_ENTRIES: u32 = 262_144;

/// Hybrid overlay: array of one [`crate::hybrid::HybridConfig`].
pub const HYBRID_CONFIG: &str = "DP_HYBRID_CONFIG";
/// Hybrid overlay: underlay address of every hybrid node (16-byte form) ->
/// [`crate::hybrid::HybridNode`], its router MAC. Their pod subnets are in
/// [`REMOTE_PODS_V4`] with `overlay::TUNNEL_VXLAN`.
pub const HYBRID_NODES: &str = "DP_HYBRID_NODES";
pub const MAX_HYBRID_NODES: u32 = 1024;

/// Multicast: host-side veth ifindex of each local pod of a multicast-enabled namespace ->
/// [`crate::multicast::McastPod`].
pub const MCAST_PODS: &str = "DP_MCAST_PODS";
/// Multicast: [`crate::multicast::McastKey`] -> [`crate::multicast::McastGroup`], where a
/// group's packets are copied to.
pub const MCAST_GROUPS: &str = "DP_MCAST_GROUPS";
/// Multicast: ring buffer of [`crate::multicast::McastReport`], the IGMP and MLD messages
/// pods of enabled namespaces send.
pub const MCAST_REPORTS: &str = "DP_MCAST_REPORTS";
/// Bytes of the report ring (about 700 messages).
pub const MCAST_REPORTS_BYTES: u32 = 1024 * 1024;

/// Default capacity of the nodes' maps (`--max-nodes`): the remote pod subnets (IPv4 and
/// IPv6, one per node) and the nodes' addresses (two per node).
pub const MAX_NODES: u32 = 8192;
/// Capacity of the local-pod map.
pub const MAX_LOCAL_PODS: u32 = 1024;

/// Hash: a pod network namespace's cookie -> [`crate::lb::socket::SockPod`]: the sockets the
/// socket-level service translation serves (this node's pods).
pub const SOCK_LB_PODS: &str = "DP_SOCK_LB_PODS";
/// Socket storage: [`crate::lb::socket::SockRev`] of each translated socket, the service
/// address it asked for, given back to `getpeername` and `recvmsg` (no entries to count: the
/// values live with the sockets).
pub const SOCK_LB_REV: &str = "DP_SOCK_LB_REV";
/// Per-CPU array of `u64`: the socket-level translation's counters (`SOCK_STAT_*`).
pub const SOCK_LB_STATS: &str = "DP_SOCK_LB_STATS";

/// Every pinned map, for status and cleanup.
pub const ALL_MAPS: &[&str] = &[
    DROPS,
    PACKETS,
    META,
    OVERLAY_CONFIG,
    REMOTE_PODS_V4,
    REMOTE_PODS_V6,
    NODE_ADDRS,
    LOCAL_PODS,
    POD_PORTS,
    LB_SERVICES,
    LB_PORTS,
    LB_BACKENDS,
    LB_MAGLEV,
    LB_CT,
    LB_SNAT_NEXT,
    LB_AFFINITY,
    LB_MEMBERS,
    LB_SOURCE_RANGES,
    LB_NODEPORT_ADDRS,
    FRAGS,
    POD_STATS,
    ACL_ENDPOINTS,
    ACL_ADDRS,
    ACL_PORTS,
    ACL_PEERS,
    ACL_ACTIVE,
    ACL_NODE_ADDRS,
    ACL_CT,
    ACL_EVENTS,
    ACL_DNS,
    ACL_LOG_CONFIG,
    EGRESS_PODS,
    EGRESS_IPS,
    EGRESS_SNAT,
    EGRESS_INTERNAL,
    EGRESS_CT,
    EGRESS_ACTIVE,
    HYBRID_CONFIG,
    HYBRID_NODES,
    MCAST_PODS,
    MCAST_GROUPS,
    MCAST_REPORTS,
    SOCK_LB_PODS,
    SOCK_LB_REV,
    SOCK_LB_STATS,
];

/// XDP program on the underlay NIC.
pub const PROG_UNDERLAY: &str = "xdp_underlay";
/// tc program on the host side of every pod veth (ingress, i.e. packets leaving the pod).
pub const PROG_FROM_POD: &str = "tc_from_pod";
/// Program array: programs a stage hands the packet on to with a tail call, so that each is
/// verified on its own. Not pinned by name: each agent fills its own and pins it under its own
/// name (`progs/DP_TAILS@<pid>`), since programs of two agent versions must not mix.
pub const TAILS: &str = "DP_TAILS";
/// `TAILS` slot of [`PROG_FROM_POD_DELIVER`].
pub const TAIL_FROM_POD_DELIVER: u32 = 0;
/// The second half of `tc_from_pod` (access control and the overlay), reached by tail call.
pub const PROG_FROM_POD_DELIVER: &str = "tc_from_pod_deliver";
/// `TAILS` slot of [`PROG_FROM_POD_SCTP`].
pub const TAIL_FROM_POD_SCTP: u32 = 1;
/// Between the halves of `tc_from_pod` for SCTP: its CRC32c after the load-balancer's port
/// rewrite, verified on its own (inside either half it multiplies the paths the verifier walks
/// past its limit).
pub const PROG_FROM_POD_SCTP: &str = "tc_from_pod_sctp";
/// `TAILS` slot of [`PROG_FROM_POD_ICMP`].
pub const TAIL_FROM_POD_ICMP: u32 = 2;
/// Between the halves of `tc_from_pod` for ICMP and ICMPv6: an error from a local backend
/// about a service flow gets the service's address back (in the quoted packet too).
pub const PROG_FROM_POD_ICMP: &str = "tc_from_pod_icmp";
/// `TAILS` slot of [`PROG_UNDERLAY_ICMP`].
pub const TAIL_UNDERLAY_ICMP: u32 = 3;
/// After `tc_underlay` for ICMP and ICMPv6: the same for errors from remote backends.
pub const PROG_UNDERLAY_ICMP: &str = "tc_underlay_icmp";
/// `TAILS` slot of [`PROG_UNDERLAY_SCTP`].
pub const TAIL_UNDERLAY_SCTP: u32 = 4;
/// `tc_underlay` for SCTP: the same load-balancing, then the CRC32c after a port rewrite.
pub const PROG_UNDERLAY_SCTP: &str = "tc_underlay_sctp";
/// `TAILS` slot of [`PROG_FROM_POD_EGRESS`].
pub const TAIL_FROM_POD_EGRESS: u32 = 5;
/// After `tc_from_pod_deliver` for a selected pod's packet to outside the cluster: the egress
/// address chosen, then translated here or sent through Geneve to the node holding it.
pub const PROG_FROM_POD_EGRESS: &str = "tc_from_pod_egress";
/// `TAILS` slot of [`PROG_UNDERLAY_EGRESS`].
pub const TAIL_UNDERLAY_EGRESS: u32 = 6;
/// After `tc_underlay` for what the load-balancer left alone: replies to an egress address held
/// here translated back, and other nodes' egress traffic (decapsulated) translated.
pub const PROG_UNDERLAY_EGRESS: &str = "tc_underlay_egress";
/// `TAILS` slot of [`PROG_FROM_POD_MULTICAST`].
pub const TAIL_FROM_POD_MULTICAST: u32 = 7;
/// After `tc_from_pod`'s port security for a packet to a multicast group: IGMP and MLD
/// reports to the agent, data copied to the group's local pods and other nodes.
pub const PROG_FROM_POD_MULTICAST: &str = "tc_from_pod_multicast";
/// `TAILS` slot of [`PROG_UNDERLAY_MULTICAST`].
pub const TAIL_UNDERLAY_MULTICAST: u32 = 8;
/// After `tc_underlay` for Geneve to this node that XDP left whole (a multicast copy): checked,
/// unwrapped and copied to the group's local pods.
pub const PROG_UNDERLAY_MULTICAST: &str = "tc_underlay_multicast";
/// `TAILS` slot of [`PROG_UNDERLAY_NEIGHBOUR`].
pub const TAIL_UNDERLAY_NEIGHBOUR: u32 = 9;
/// After `tc_underlay` for an ARP request or neighbour solicitation where XDP may not send
/// frames back out of the underlay: answered for egress addresses held here.
pub const PROG_UNDERLAY_NEIGHBOUR: &str = "tc_underlay_neighbour";
/// `TAILS` slot of [`PROG_UNDERLAY_DECAP`].
pub const TAIL_UNDERLAY_DECAP: u32 = 10;
/// After `tc_underlay` for Geneve or hybrid VXLAN to this node: checked and unwrapped in the
/// socket buffer (every tunnel packet where the uplink runs no XDP, `--uplink-hook tc`; what
/// XDP left whole otherwise), then taken on as `tc_underlay` takes what XDP unwrapped.
pub const PROG_UNDERLAY_DECAP: &str = "tc_underlay_decap";
/// tc program on the host side of every pod veth (egress, i.e. packets the stack delivers to
/// the pod): the pod's ingress NetworkPolicy.
pub const PROG_TO_POD: &str = "tc_to_pod";
/// tc program on the underlay NIC's ingress: reverse NAT of service replies that XDP
/// decapsulated.
pub const PROG_UNDERLAY_TC: &str = "tc_underlay";
/// cgroup programs of the socket-level service translation (`--socket-lb`), attached to the
/// node's cgroup v2 root: `connect` and unconnected UDP `sendmsg` to a service port get a
/// backend; `recvmsg` and `getpeername` give the service address back.
pub const PROG_SOCK_CONNECT4: &str = "sock_connect4";
pub const PROG_SOCK_CONNECT6: &str = "sock_connect6";
pub const PROG_SOCK_SENDMSG4: &str = "sock_sendmsg4";
pub const PROG_SOCK_SENDMSG6: &str = "sock_sendmsg6";
pub const PROG_SOCK_RECVMSG4: &str = "sock_recvmsg4";
pub const PROG_SOCK_RECVMSG6: &str = "sock_recvmsg6";
pub const PROG_SOCK_GETPEERNAME4: &str = "sock_peername4";
pub const PROG_SOCK_GETPEERNAME6: &str = "sock_peername6";
/// The socket-level programs, in the order they are attached.
pub const SOCK_PROGRAMS: &[&str] = &[
    PROG_SOCK_RECVMSG4,
    PROG_SOCK_RECVMSG6,
    PROG_SOCK_GETPEERNAME4,
    PROG_SOCK_GETPEERNAME6,
    PROG_SOCK_CONNECT4,
    PROG_SOCK_CONNECT6,
    PROG_SOCK_SENDMSG4,
    PROG_SOCK_SENDMSG6,
];

/// A program reached by tail call: its `TAILS` slot, and the programs that hand packets to it.
pub struct TailStage {
    pub slot: u32,
    pub program: &'static str,
    pub reached_from: &'static [&'static str],
}

/// The pipeline's tail-call stages, one entry per `TAILS` slot: the loader fills the slots
/// from it, and `dataplane verify` counts the stages a packet can cross.
pub const TAIL_STAGES: &[TailStage] = &[
    TailStage {
        slot: TAIL_FROM_POD_DELIVER,
        program: PROG_FROM_POD_DELIVER,
        reached_from: &[PROG_FROM_POD, PROG_FROM_POD_SCTP, PROG_FROM_POD_ICMP],
    },
    TailStage {
        slot: TAIL_FROM_POD_SCTP,
        program: PROG_FROM_POD_SCTP,
        reached_from: &[PROG_FROM_POD],
    },
    TailStage {
        slot: TAIL_FROM_POD_ICMP,
        program: PROG_FROM_POD_ICMP,
        reached_from: &[PROG_FROM_POD],
    },
    TailStage {
        slot: TAIL_UNDERLAY_ICMP,
        program: PROG_UNDERLAY_ICMP,
        reached_from: &[PROG_UNDERLAY_TC, PROG_UNDERLAY_DECAP],
    },
    TailStage {
        slot: TAIL_UNDERLAY_SCTP,
        program: PROG_UNDERLAY_SCTP,
        reached_from: &[PROG_UNDERLAY_TC, PROG_UNDERLAY_DECAP],
    },
    TailStage {
        slot: TAIL_FROM_POD_EGRESS,
        program: PROG_FROM_POD_EGRESS,
        reached_from: &[PROG_FROM_POD_DELIVER],
    },
    TailStage {
        slot: TAIL_UNDERLAY_EGRESS,
        program: PROG_UNDERLAY_EGRESS,
        reached_from: &[PROG_UNDERLAY_TC, PROG_UNDERLAY_DECAP, PROG_UNDERLAY_SCTP],
    },
    TailStage {
        slot: TAIL_FROM_POD_MULTICAST,
        program: PROG_FROM_POD_MULTICAST,
        reached_from: &[PROG_FROM_POD],
    },
    TailStage {
        slot: TAIL_UNDERLAY_MULTICAST,
        program: PROG_UNDERLAY_MULTICAST,
        reached_from: &[PROG_UNDERLAY_DECAP],
    },
    TailStage {
        slot: TAIL_UNDERLAY_NEIGHBOUR,
        program: PROG_UNDERLAY_NEIGHBOUR,
        reached_from: &[PROG_UNDERLAY_TC, PROG_UNDERLAY_DECAP],
    },
    TailStage {
        slot: TAIL_UNDERLAY_DECAP,
        program: PROG_UNDERLAY_DECAP,
        reached_from: &[PROG_UNDERLAY_TC],
    },
];

/// Every program the dataplane loads (the test bed's own are `crate::testbed`'s).
pub const ALL_PROGRAMS: &[&str] = &[
    PROG_UNDERLAY,
    PROG_FROM_POD,
    PROG_FROM_POD_DELIVER,
    PROG_FROM_POD_SCTP,
    PROG_FROM_POD_ICMP,
    PROG_UNDERLAY_ICMP,
    PROG_UNDERLAY_SCTP,
    PROG_FROM_POD_EGRESS,
    PROG_UNDERLAY_EGRESS,
    PROG_FROM_POD_MULTICAST,
    PROG_UNDERLAY_MULTICAST,
    PROG_UNDERLAY_NEIGHBOUR,
    PROG_UNDERLAY_DECAP,
    PROG_TO_POD,
    PROG_UNDERLAY_TC,
    PROG_SOCK_CONNECT4,
    PROG_SOCK_CONNECT6,
    PROG_SOCK_SENDMSG4,
    PROG_SOCK_SENDMSG6,
    PROG_SOCK_RECVMSG4,
    PROG_SOCK_RECVMSG6,
    PROG_SOCK_GETPEERNAME4,
    PROG_SOCK_GETPEERNAME6,
];
