//! Every map of the kernel programs, in one place. Names are spelled as in
//! `dataplane_common::maps` (the agent's tests check they match). All maps are pinned by name so
//! a restarted agent adopts them.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::SkStorage,
    macros::{btf_map, map},
    maps::{HashMap, LpmTrie, LruHashMap, LruPerCpuHashMap, PerCpuArray, ProgramArray},
};
use dataplane_common::{
    acl::{
        AclAddrKey, AclAddrValue, AclCtKey, AclCtValue, AclEndpoint, AclLogBucket, AclLogConfig,
        AclPortKey, AclVerdict,
    },
    drop::DROP_REASON_SLOTS,
    egressip::{EgressCtValue, EgressHolder, EgressPod},
    frag::{FragKey, FragPorts},
    hybrid::{HybridConfig, HybridNode},
    lb::{
        AffinityKey, AffinityValue, Backend, CtKey, CtValue, FLOW_CACHE_SLOTS, FlowCacheEntry,
        MaglevTable, MemberKey, ServiceKey, ServiceValue, SourceRangeKey, XdpFlowCacheEntry,
        socket::{SOCK_LB_MAX_PODS, SOCK_STAT_SLOTS, SockPod, SockRev},
    },
    maps::{
        ACL_EVENTS_BYTES, DEFAULT_ACL_ENTRIES, DEFAULT_BACKENDS, DEFAULT_CT_ENTRIES,
        DEFAULT_SERVICE_PORTS, MAX_ACL_CT_ENTRIES, MAX_AFFINITY_ENTRIES, MAX_AFFINITY_MEMBERS,
        MAX_EGRESS_CT_ENTRIES, MAX_EGRESS_INTERNAL_PREFIXES, MAX_EGRESS_IPS, MAX_EGRESS_SNAT_PODS,
        MAX_FRAGMENTED_DATAGRAMS, MAX_HYBRID_NODES, MAX_LOCAL_PODS, MAX_NODEPORT_ADDRS, MAX_NODES,
        MAX_POD_STATS, MCAST_REPORTS_BYTES,
    },
    multicast::{MAX_GROUPS, McastGroup, McastKey, McastPod},
    overlay::{ADDR_CACHE_SLOTS, Addr, AddrCacheEntry, LocalPod, OverlayConfig, TunnelEndpoint},
    port::{PORT_CACHE_SLOTS, PodPort, PortCacheEntry},
    stats::{PACKET_COUNTER_SLOTS, PodCounters},
};

use crate::work::{AclWork, EgressWork, LbScratch, Parsed};

/// Drop counters by reason code.
#[map(name = "DP_DROPS")]
pub static DROPS: PerCpuArray<u64> = PerCpuArray::pinned(DROP_REASON_SLOTS, 0);

/// Packet counters by hook and class.
#[map(name = "DP_PACKETS")]
pub static PACKETS: PerCpuArray<u64> = PerCpuArray::pinned(PACKET_COUNTER_SLOTS, 0);

/// One entry: the `LAYOUT_VERSION` of the agent that created the pins. Written and checked by
/// the agent only; the programs never read it.
#[map(name = "DP_META")]
pub static META: aya_ebpf::maps::Array<u32> = aya_ebpf::maps::Array::pinned(1, 0);

/// This node's overlay settings; `flags` without `OVERLAY_ENABLED` means no overlay.
#[map(name = "DP_OVL_CONFIG")]
pub static OVERLAY_CONFIG: aya_ebpf::maps::Array<OverlayConfig> =
    aya_ebpf::maps::Array::pinned(1, 0);

/// Remote IPv4 pod CIDRs -> the node that hosts them.
#[map(name = "DP_OVL_REMOTE4")]
pub static REMOTE_PODS_V4: LpmTrie<[u8; 4], TunnelEndpoint> = LpmTrie::pinned(MAX_NODES, 0);

/// Remote IPv6 pod CIDRs -> the node that hosts them.
#[map(name = "DP_OVL_REMOTE6")]
pub static REMOTE_PODS_V6: LpmTrie<[u8; 16], TunnelEndpoint> = LpmTrie::pinned(MAX_NODES, 0);

/// Underlay addresses of every cluster node: Geneve is accepted only from these.
#[map(name = "DP_OVL_NODES")]
pub static NODE_ADDRS: HashMap<Addr, u32> = HashMap::pinned(MAX_NODES * 2, 0);

/// Pods on this node by address.
#[map(name = "DP_OVL_PODS")]
pub static LOCAL_PODS: HashMap<Addr, LocalPod> = HashMap::pinned(MAX_LOCAL_PODS, 0);

/// Per-CPU copies of `NODE_ADDRS` hits by `addr_cache_slot`, valid within the pods' epoch.
/// Not pinned: a cache.
#[map(name = "DP_OVL_NODE_CACHE")]
pub static NODE_ADDR_CACHE: PerCpuArray<AddrCacheEntry> =
    PerCpuArray::with_max_entries(ADDR_CACHE_SLOTS, 0);

/// Per-CPU copies of `LOCAL_PODS` hits by `addr_cache_slot`, valid within the pods' epoch.
/// Not pinned: a cache.
#[map(name = "DP_OVL_POD_CACHE")]
pub static LOCAL_POD_CACHE: PerCpuArray<AddrCacheEntry> =
    PerCpuArray::with_max_entries(ADDR_CACHE_SLOTS, 0);

/// This CPU's copy of a transport segment XDP delivers to a pod, for its checksum
/// (`overlay::deliver_in_xdp`): at most 512 bytes, and up to three bytes of padding.
#[map(name = "DP_SEGMENT")]
pub static SEGMENT_SCRATCH: PerCpuArray<[u8; 516]> = PerCpuArray::with_max_entries(1, 0);

/// Host-side veths of the local pods whose pod end takes frames from XDP (it polls: GRO on):
/// decapsulated frames for those pods go straight in (`overlay::deliver_in_xdp`). Not pinned:
/// a new program starts empty, which only means the stack delivers until the agent's sync.
#[map(name = "DP_XDP_PODS")]
pub static XDP_PODS: aya_ebpf::maps::DevMapHash =
    aya_ebpf::maps::DevMapHash::with_max_entries(MAX_LOCAL_PODS, 0);

/// Pods on this node by the ifindex of their host-side veth: what they may send as and be
/// sent to (port security).
#[map(name = "DP_POD_PORTS")]
pub static POD_PORTS: HashMap<u32, PodPort> = HashMap::pinned(MAX_LOCAL_PODS, 0);

/// Per-CPU copies of `POD_PORTS` entries by ifindex slot, valid within the local pods' epoch.
/// Not pinned: a cache.
#[map(name = "DP_PORT_CACHE")]
pub static PORT_CACHE: PerCpuArray<PortCacheEntry> =
    PerCpuArray::with_max_entries(PORT_CACHE_SLOTS, 0);

/// Service ports -> how to balance them.
#[map(name = "DP_LB_SERVICES")]
pub static LB_SERVICES: HashMap<ServiceKey, ServiceValue> =
    HashMap::pinned(DEFAULT_SERVICE_PORTS, 0);

/// Port bitmaps: service ports, then backend ports (one bit per port).
#[map(name = "DP_LB_PORTS")]
pub static LB_PORTS: aya_ebpf::maps::Array<u64> =
    aya_ebpf::maps::Array::pinned(dataplane_common::lb::PORT_BITMAP_WORDS * 2, 0);

/// Backends by slot (`backend_slot` of their id).
#[map(name = "DP_LB_BACKENDS")]
pub static LB_BACKENDS: aya_ebpf::maps::Array<Backend> =
    aya_ebpf::maps::Array::pinned(DEFAULT_BACKENDS, 0);

/// Maglev tables by index (4 KB each, allocated only for the service ports that exist).
#[map(name = "DP_LB_MAGLEV")]
pub static LB_MAGLEV: HashMap<u32, MaglevTable> =
    HashMap::pinned(DEFAULT_SERVICE_PORTS * 2, BPF_F_NO_PREALLOC);

/// Connection tracking of service flows, both directions.
#[map(name = "DP_LB_CT")]
pub static LB_CT: LruHashMap<CtKey, CtValue> = LruHashMap::pinned(DEFAULT_CT_ENTRIES, 0);

/// ClientIP session affinity: the backend each client sticks to.
#[map(name = "DP_LB_AFFINITY")]
pub static LB_AFFINITY: LruHashMap<AffinityKey, AffinityValue> =
    LruHashMap::pinned(MAX_AFFINITY_ENTRIES, 0);

/// Ready backends of the service ports with ClientIP affinity: an affine backend that left
/// the service port is not used for its new flows, whatever other service ports it serves.
#[map(name = "DP_LB_MEMBERS")]
pub static LB_MEMBERS: HashMap<MemberKey, u32> = HashMap::pinned(MAX_AFFINITY_MEMBERS, 0);

/// The load-balancer addresses' source ranges (`spec.loadBalancerSourceRanges`, see
/// `SourceRangeKey`): one lookup per new flow, whatever the number of ranges. Sized with the
/// service ports (`--max-service-ports`, twice as many entries), allocated as used.
#[map(name = "DP_LB_SRC_RANGES")]
pub static LB_SOURCE_RANGES: LpmTrie<SourceRangeKey, u8> =
    LpmTrie::pinned(DEFAULT_SERVICE_PORTS * 2, 0);

/// The addresses NodePorts are served on when `--nodeport-addresses` lists networks
/// (`OVERLAY_NODEPORT_LISTED`): looked up only then.
#[map(name = "DP_LB_NP_ADDRS")]
pub static LB_NODEPORT_ADDRS: HashMap<Addr, u8> = HashMap::pinned(MAX_NODEPORT_ADDRS, 0);

/// Datagrams in flight in fragments -> their first fragment's ports (`frag`). LRU: a datagram
/// whose last fragment never came ages out.
#[map(name = "DP_FRAGS")]
pub static FRAGS: LruHashMap<FragKey, FragPorts> = LruHashMap::pinned(MAX_FRAGMENTED_DATAGRAMS, 0);

/// Per pod, by its host-side veth's ifindex, per CPU: drops at its veth and service flows it
/// opened (`stats::count_pod`).
#[map(name = "DP_POD_STATS")]
pub static POD_STATS: LruPerCpuHashMap<u32, PodCounters> =
    LruPerCpuHashMap::pinned(MAX_POD_STATS, 0);

/// Per CPU (not on the stack; not pinned): 0, the key of `FRAGS` being built; 1, the key of
/// the last fragment this CPU saw, whose entry goes at its next fragment (`_pad[0]` is 1
/// while it waits: see `frag::remember_or_fill`).
#[map(name = "DP_FRAG_KEY")]
pub static FRAG_KEY: PerCpuArray<FragKey> = PerCpuArray::with_max_entries(2, 0);

/// Local pods under access control -> the rule sets that apply to them.
#[map(name = "DP_ACL_ENDPOINTS")]
pub static ACL_ENDPOINTS: HashMap<Addr, AclEndpoint> = HashMap::pinned(MAX_LOCAL_PODS, 0);

/// (rule set, prefix) -> the decision, final or by port table.
#[map(name = "DP_ACL_ADDRS")]
pub static ACL_ADDRS: HashMap<AclAddrKey, AclAddrValue> =
    HashMap::pinned(DEFAULT_ACL_ENTRIES, BPF_F_NO_PREALLOC);

/// Address of a pod that policy sets name by its identity -> the identity.
#[map(name = "DP_ACL_PEERS")]
pub static ACL_PEERS: HashMap<Addr, u32> = HashMap::pinned(DEFAULT_ACL_ENTRIES, BPF_F_NO_PREALLOC);

/// (port table, protocol, kind, port) -> the first-match verdict.
#[map(name = "DP_ACL_PORTS")]
pub static ACL_PORTS: HashMap<AclPortKey, AclVerdict> =
    HashMap::pinned(DEFAULT_ACL_ENTRIES, BPF_F_NO_PREALLOC);

/// Later halves of programs, reached by tail call (filled by the loader).
#[map(name = "DP_TAILS")]
pub static TAILS: ProgramArray = ProgramArray::with_max_entries(16, 0);

/// How many local pod addresses are under access control (0: skip the stage).
#[map(name = "DP_ACL_ACTIVE")]
pub static ACL_ACTIVE: aya_ebpf::maps::Array<u32> = aya_ebpf::maps::Array::pinned(1, 0);

/// This node's own addresses: what it sends to its pods is not judged by their policies.
#[map(name = "DP_ACL_NODE_ADDRS")]
pub static ACL_NODE_ADDRS: HashMap<Addr, u32> =
    HashMap::pinned(dataplane_common::maps::MAX_NODE_LOCAL_ADDRS, 0);

/// Flows NetworkPolicy allowed.
#[map(name = "DP_ACL_CT")]
pub static ACL_CT: LruHashMap<AclCtKey, AclCtValue> = LruHashMap::pinned(MAX_ACL_CT_ENTRIES, 0);

/// Audit records for the agent.
#[map(name = "DP_ACL_EVENTS")]
pub static ACL_EVENTS: aya_ebpf::maps::RingBuf =
    aya_ebpf::maps::RingBuf::pinned(ACL_EVENTS_BYTES, 0);

/// DNS answers to pods whose admin policies name wildcard domains, for the agent.
#[map(name = "DP_ACL_DNS")]
pub static ACL_DNS: aya_ebpf::maps::RingBuf =
    aya_ebpf::maps::RingBuf::pinned(dataplane_common::maps::ACL_DNS_BYTES, 0);

/// The audit rate limit.
#[map(name = "DP_ACL_LOG_CONFIG")]
pub static ACL_LOG_CONFIG: aya_ebpf::maps::Array<AclLogConfig> =
    aya_ebpf::maps::Array::pinned(1, 0);

/// Each CPU's audit token bucket. Not pinned: only rate state.
#[map(name = "DP_ACL_LOG_BUCKETS")]
pub static ACL_LOG_BUCKETS: PerCpuArray<AclLogBucket> = PerCpuArray::with_max_entries(1, 0);

/// Size of the per-CPU scratch buffer (the largest encapsulation block is 84 bytes).
pub const ENCAP_SCRATCH_LEN: usize = 128;

/// Per-CPU scratch space for building headers too large for the BPF stack. Not pinned: it
/// holds nothing between packets.
#[map(name = "DP_SCRATCH")]
pub static SCRATCH: PerCpuArray<[u8; ENCAP_SCRATCH_LEN]> = PerCpuArray::with_max_entries(1, 0);

/// Per-CPU room for a 16-byte address being looked up (the pod, node and pod-CIDR maps), as
/// an LPM key whose data doubles as the plain address: 16 bytes (and their copies) the
/// deepest paths have no stack for. Not pinned.
#[map(name = "DP_ADDR_SCRATCH")]
pub static ADDR_SCRATCH: PerCpuArray<aya_ebpf::maps::lpm_trie::Key<[u8; 16]>> =
    PerCpuArray::with_max_entries(1, 0);

/// Destinations known to lie outside every pod network, one bit per IPv4 /16 or folded IPv6
/// prefix (`dataplane_common::overlay::outside_bit_v4`). Not pinned: written by each agent's
/// overlay sync; all clear (look up everything) until then.
#[map(name = "DP_OVL_OUTSIDE")]
pub static OUTSIDE: aya_ebpf::maps::Array<u64> =
    aya_ebpf::maps::Array::with_max_entries(dataplane_common::overlay::OUTSIDE_WORDS, 0);

/// Per-CPU copies of the underlay routes to tunnel endpoints, valid within a clock second.
/// Not pinned: a cache.
#[map(name = "DP_OVL_ROUTES")]
pub static ROUTE_CACHE: PerCpuArray<dataplane_common::overlay::RouteCacheEntry> =
    PerCpuArray::with_max_entries(dataplane_common::overlay::ROUTE_CACHE_SLOTS, 0);

/// Per-CPU room for the FIB lookup parameters of the encapsulation. Not pinned.
#[map(name = "DP_FIB_SCRATCH")]
pub static FIB_SCRATCH: PerCpuArray<aya_ebpf::bindings::bpf_fib_lookup> =
    PerCpuArray::with_max_entries(1, 0);

/// The next masquerade source port's index (`lb::conntrack::claimed_port`).
#[map(name = "DP_LB_SNAT_NEXT")]
pub static LB_SNAT_NEXT: aya_ebpf::maps::Array<u64> = aya_ebpf::maps::Array::pinned(1, 0);

/// Per-CPU service flow cache: the translation and local delivery of recent flows, by
/// `flow_cache_slot`. Not pinned: a cache, refilled by the first packet of each flow and second.
#[map(name = "DP_LB_FLOW_CACHE")]
pub static LB_FLOW_CACHE: PerCpuArray<FlowCacheEntry> =
    PerCpuArray::with_max_entries(FLOW_CACHE_SLOTS, 0);

/// Per-CPU NodePort flow cache of XDP: the translation and tunnel route of recent flows to
/// remote backends, by `flow_cache_slot`. Not pinned: a cache, as `LB_FLOW_CACHE`.
#[map(name = "DP_LB_XDP_FLOW_CACHE")]
pub static LB_XDP_FLOW_CACHE: PerCpuArray<XdpFlowCacheEntry> =
    PerCpuArray::with_max_entries(FLOW_CACHE_SLOTS, 0);

/// Per-CPU working set of the load-balancer (keys and entries being built). Not pinned.
#[map(name = "DP_LB_SCRATCH")]
pub static LB_SCRATCH: PerCpuArray<LbScratch> = PerCpuArray::with_max_entries(1, 0);

/// Per-CPU copy of the parse result for the access-control stage. Not pinned. Read back from
/// here, the parse result is no longer a set of constants per parse path, so the verifier
/// walks the stage once instead of once per kind of packet.
#[map(name = "DP_ACL_SCRATCH")]
pub static ACL_SCRATCH: PerCpuArray<AclWork> = PerCpuArray::with_max_entries(1, 0);

/// The parse result `tc_from_pod` hands to its second half across the tail call (which then
/// need not parse again). Not pinned.
#[map(name = "DP_PARSED")]
pub static PARSED: PerCpuArray<Parsed> = PerCpuArray::with_max_entries(1, 0);

/// Local pods an EgressIP selects -> the egress addresses of their family.
#[map(name = "DP_EGRESS_PODS")]
pub static EGRESS_PODS: HashMap<Addr, EgressPod> = HashMap::pinned(MAX_LOCAL_PODS, 0);

/// Assigned egress addresses -> the node holding each.
#[map(name = "DP_EGRESS_IPS")]
pub static EGRESS_IPS: HashMap<Addr, EgressHolder> = HashMap::pinned(MAX_EGRESS_IPS, 0);

/// Pods (of any node) whose traffic this node translates -> the egress address it gives them.
#[map(name = "DP_EGRESS_SNAT")]
pub static EGRESS_SNAT: HashMap<Addr, Addr> =
    HashMap::pinned(MAX_EGRESS_SNAT_PODS, BPF_F_NO_PREALLOC);

/// Destinations inside the cluster (cluster and service networks, node addresses).
#[map(name = "DP_EGRESS_INTERNAL")]
pub static EGRESS_INTERNAL: LpmTrie<Addr, u32> = LpmTrie::pinned(MAX_EGRESS_INTERNAL_PREFIXES, 0);

/// Egress flows: chosen addresses and translations, both directions.
#[map(name = "DP_EGRESS_CT")]
pub static EGRESS_CT: LruHashMap<CtKey, EgressCtValue> =
    LruHashMap::pinned(MAX_EGRESS_CT_ENTRIES, 0);

/// `EGRESS_ACTIVE_*` bits: whether the egress stages have anything to do on this node.
#[map(name = "DP_EGRESS_ACTIVE")]
pub static EGRESS_ACTIVE: aya_ebpf::maps::Array<u32> = aya_ebpf::maps::Array::pinned(1, 0);

/// Per-CPU working set of the egress IP stage. Not pinned.
#[map(name = "DP_EGRESS_SCRATCH")]
pub static EGRESS_SCRATCH: PerCpuArray<EgressWork> = PerCpuArray::with_max_entries(1, 0);

/// This node's hybrid overlay settings; `flags` without `HYBRID_ENABLED` means none.
#[map(name = "DP_HYBRID_CONFIG")]
pub static HYBRID_CONFIG: aya_ebpf::maps::Array<HybridConfig> = aya_ebpf::maps::Array::pinned(1, 0);

/// Hybrid nodes' underlay addresses -> their router MACs.
#[map(name = "DP_HYBRID_NODES")]
pub static HYBRID_NODES: HashMap<Addr, HybridNode> = HashMap::pinned(MAX_HYBRID_NODES, 0);

/// Local pods of multicast-enabled namespaces, by host-side veth.
#[map(name = "DP_MCAST_PODS")]
pub static MCAST_PODS: HashMap<u32, McastPod> = HashMap::pinned(MAX_LOCAL_PODS, 0);

/// Where each group's packets are copied to (local pods, other nodes).
#[map(name = "DP_MCAST_GROUPS")]
pub static MCAST_GROUPS: HashMap<McastKey, McastGroup> = HashMap::pinned(MAX_GROUPS, 0);

/// IGMP and MLD messages of pods of enabled namespaces, for the agent.
#[map(name = "DP_MCAST_REPORTS")]
pub static MCAST_REPORTS: aya_ebpf::maps::RingBuf =
    aya_ebpf::maps::RingBuf::pinned(MCAST_REPORTS_BYTES, 0);

/// The network namespaces (by cookie) of this node's pods, whose sockets the socket-level
/// service translation serves.
#[map(name = "DP_SOCK_LB_PODS")]
pub static SOCK_LB_PODS: HashMap<u64, SockPod> = HashMap::pinned(SOCK_LB_MAX_PODS, 0);

/// The service address each translated socket asked for, in the socket's own storage (freed
/// with the socket, charged to it: no pod can push another's out). A BTF map, as socket
/// storage must be; the agent pins it by name like the others.
#[btf_map(name = "DP_SOCK_LB_REV")]
pub static SOCK_LB_REV: SkStorage<SockRev> = SkStorage::new();

/// Counters of the socket-level translation (`SOCK_STAT_*`).
#[map(name = "DP_SOCK_LB_STATS")]
pub static SOCK_LB_STATS: PerCpuArray<u64> = PerCpuArray::pinned(SOCK_STAT_SLOTS, 0);
