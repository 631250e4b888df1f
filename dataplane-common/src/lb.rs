//! Service load-balancing: map layouts shared by the kernel programs and the agent, and the flow
//! hash both sides compute (the agent's tests predict which backend the kernel picks).
//!
//! A service port is one `(address, port, protocol)` a client can reach: every ClusterIP,
//! external IP and load-balancer ingress IP of a Service, for each of its ports. Each has a
//! Maglev lookup table of `MAGLEV_TABLE_SIZE` backend ids, built by the agent; the kernel picks
//! `table[flow_hash % MAGLEV_TABLE_SIZE]`, so its cost does not depend on the number of
//! services or backends. Addresses use the 16-byte form of [`crate::overlay::Addr`].

use crate::overlay::{Addr, LocalPod, RouteCacheEntry, TunnelEndpoint};

pub mod sctp;
pub mod socket;

/// Words of one port bitmap (one bit per port).
pub const PORT_BITMAP_WORDS: u32 = 65_536 / 64;
/// First word of the bitmap of service ports (destination ports worth a service lookup).
pub const SERVICE_PORTS_BASE: u32 = 0;
/// First word of the bitmap of backend ports (source ports worth a reply lookup).
pub const BACKEND_PORTS_BASE: u32 = PORT_BITMAP_WORDS;

/// Word index and bit of `port` in the bitmap starting at `base`.
#[inline(always)]
pub const fn port_bit(base: u32, port: u16) -> (u32, u64) {
    (base + (port as u32 >> 6), 1u64 << (port & 63))
}

/// Slots of one Maglev table: a prime well above 10x the backends of a service (Maglev's
/// balance stays within about 1% up to M/10 backends, and disruption stays near 1/N).
pub const MAGLEV_TABLE_SIZE: usize = 1021;
/// Most backends one service port may have (M / 10, see above).
pub const MAX_BACKENDS_PER_SERVICE: usize = 100;

/// Session affinity timeout bounds and default (`sessionAffinityConfig.clientIP.timeoutSeconds`).
pub const AFFINITY_TIMEOUT_MIN: u32 = 1;
pub const AFFINITY_TIMEOUT_MAX: u32 = 86_400;
pub const AFFINITY_TIMEOUT_DEFAULT: u32 = 10_800;

/// Name of the kernel programs' global holding the kernel's tick rate (HZ), set by the loader.
/// With it the clock of tracked flows is read from `jiffies_64`, which the verifier inlines
/// (no helper call per packet); while it is 0 the programs read the coarse monotonic clock.
pub const CLOCK_HZ_GLOBAL: &str = "CLOCK_HZ";

/// `jiffies_64` at boot on a 64-bit kernel: `INITIAL_JIFFIES`, -300 seconds of ticks as a u32,
/// so that 32-bit jiffies wrap five minutes after boot.
pub const fn jiffies_at_boot(hz: u64) -> u64 {
    (1u64 << 32) - 300 * hz
}

/// Idle timeouts of connection-tracking entries, in seconds (as kube-proxy's conntrack
/// defaults: established TCP long-lived, other protocols short, closing TCP briefly).
pub const CT_TIMEOUT_TCP: u32 = 21_600;
pub const CT_TIMEOUT_OTHER: u32 = 60;
/// An SCTP association's idle limit: its heartbeats (every 30 s by default) keep it alive; the
/// same as netfilter's for an established association.
pub const CT_TIMEOUT_SCTP: u32 = 210;
pub const CT_TIMEOUT_CLOSING: u32 = 10;
/// A TCP connection (or SCTP association) that never got past its opening (no segment but
/// its SYN, or INIT, was seen in that direction): as the kernel's conntrack gives SYN_RECV,
/// so that spoofed SYNs hold their entries, and a masquerade port, a minute, not six hours.
pub const CT_TIMEOUT_OPENING: u32 = 60;

/// Source ports of masqueraded flows (NodePort to a backend on another node): above the
/// kernel's default ephemeral range (32768-60999), and reserved on the node by the agent
/// (`ip_local_reserved_ports`) so the node's own connections never take one of them: a reply
/// to a local socket must never look like a reply of a masqueraded flow.
pub const SNAT_PORT_MIN: u16 = 61_000;
pub const SNAT_PORT_MAX: u16 = 65_535;
/// More masquerade source ports, below the kernel's default ephemeral range (reserved by the
/// agent too), for flows to a backend in another node's pod subnet: the node's gateway
/// masquerade (pods to outside the cluster, ports 1024-60999) never goes there, so no tuple
/// can collide. Both ranges together are 36,280 ports per backend, handed out in turn, and a
/// port is free again two clock seconds after its flow has ended at both ends
/// (`SNAT_PORT_REUSE_IDLE`): room for about 18,000 new connections a second to one backend.
pub const SNAT_LOW_PORT_MIN: u16 = 1_024;
pub const SNAT_LOW_PORT_MAX: u16 = 32_767;

/// `ServiceKey::scope`: reached from a pod (ClusterIP, external and load-balancer IPs).
pub const SCOPE_CLUSTER: u8 = 0;
/// `ServiceKey::scope`: a NodePort, reached on any address of this node from the underlay.
/// The key's address is the family's unspecified address (`NODEPORT_ANY_V4` or `::`).
pub const SCOPE_NODEPORT: u8 = 1;
/// `ServiceKey::scope`: an external or load-balancer IP reached from outside, through the
/// underlay (externalTrafficPolicy applies, unlike the same address reached from a pod).
pub const SCOPE_EXTERNAL: u8 = 2;
/// `ServiceKey::scope`: a NodePort of an `externalTrafficPolicy: Local` Service as a pod of the
/// cluster reaches it (on any node's address): every endpoint, as kube-proxy sends pods'
/// traffic to such addresses, where `SCOPE_NODEPORT`'s table holds this node's endpoints
/// only. Keyed as `SCOPE_NODEPORT`; only Services with that policy have one.
pub const SCOPE_NODEPORT_FROM_POD: u8 = 3;
/// The address of an IPv4 NodePort key (`::ffff:0.0.0.0`).
pub const NODEPORT_ANY_V4: Addr = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0, 0, 0, 0];

/// `CtKey::direction`: client to service (the original direction).
pub const CT_ORIGINAL: u8 = 0;
/// `CtKey::direction`: backend back to the client (the reply direction).
pub const CT_REPLY: u8 = 1;

/// `CtValue::flags`: a FIN or RST was seen; the entry lives `CT_TIMEOUT_CLOSING` more.
pub const CT_CLOSING: u8 = 1 << 0;
/// `CtValue::flags`: the flow's source is translated too (`nat_addr`, `nat_port_be`): in the
/// original direction the new source, in the reply direction the destination to restore.
pub const CT_SNAT: u8 = 1 << 1;
/// `CtValue::flags` (reply direction): a NodePort reply; after translation it is routed out
/// of the underlay directly (its source is this node's address, which the stack would refuse
/// to forward).
pub const CT_NODEPORT: u8 = 1 << 2;
/// `CtValue::flags` (original direction): the service has ClientIP affinity; every packet of
/// the flow restarts the client's affinity timer (`service_id`, `backend_id`). Kept in the
/// entry so an established flow needs no service lookup.
pub const CT_AFFINITY: u8 = 1 << 3;
/// `CtValue::flags` (with `CT_CLOSING`): the FIN or RST seen was an RST, which ends the
/// connection at both ends at once.
pub const CT_RESET: u8 = 1 << 4;
/// `CtValue::flags`: a packet other than the opening one (a TCP segment without SYN, an SCTP
/// chunk other than INIT) passed in this entry's direction: the connection got past its
/// handshake there. Until then the entry lives `CT_TIMEOUT_OPENING`.
pub const CT_ESTABLISHED: u8 = 1 << 5;
/// `CtValue::flags` (reply direction): the client is a pod of this node that sent to a node's
/// address and NodePort. Translated, the reply comes from that address, which the stack would
/// not forward to a pod when it is this node's own: the load-balancer hands it to the pod.
pub const CT_LOCAL_CLIENT: u8 = 1 << 6;

/// Seconds both directions of a masqueraded flow that has ended (a FIN each way, or an RST)
/// must have been idle before its port goes to a new flow, ahead of `CT_TIMEOUT_CLOSING`:
/// the last ACK has long arrived, so the backend's socket has closed (or sits in TIME_WAIT,
/// which accepts a new connection's SYN as the kernel's own NAT expects it to). Counted in
/// whole clock seconds, so at least one second.
pub const SNAT_PORT_REUSE_IDLE: u32 = 2;

/// The source a pod's packets get when they reach the pod itself through a service (hairpin),
/// so its replies leave the pod and come back through the load-balancer: OVN-Kubernetes'
/// hairpin masquerade addresses.
pub const HAIRPIN_V4: [u8; 4] = [169, 254, 0, 5];
pub const HAIRPIN_V6: Addr = [0xfd, 0x69, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5];

/// A service port (key of the services map).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub addr: Addr,
    /// Port in network byte order, as on the wire.
    pub port_be: [u8; 2],
    /// IP protocol number (6, 17, 132).
    pub protocol: u8,
    /// `SCOPE_*`.
    pub scope: u8,
}

/// What the kernel needs to balance one service port (value of the services map).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceValue {
    /// Identifies the service port in affinity keys (stable while the service port exists).
    pub id: u32,
    /// Index of its Maglev table in the tables map.
    pub table: u32,
    /// Ready backends; 0 means the service has no endpoint and new flows are refused.
    pub backends: u32,
    /// ClientIP affinity timeout in seconds; 0 means no affinity.
    pub affinity_timeout: u32,
}

/// Key of the load-balancer source ranges (`LB_SOURCE_RANGES`, an LPM trie): a load-balancer
/// address, port and protocol (the first [`SOURCE_RANGE_SERVICE_BITS`] bits, always whole),
/// then a client source prefix. An address with source ranges has one entry per range
/// ([`SOURCE_RANGE_ALLOW`]) and one for every other source ([`SOURCE_RANGE_DENY`], prefix
/// length [`SOURCE_RANGE_SERVICE_BITS`]), so one lookup answers, whatever the number of
/// ranges; an address without ranges has no entry and every source may open a flow.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceRangeKey {
    pub addr: Addr,
    /// Port in network byte order, as on the wire.
    pub port_be: [u8; 2],
    pub protocol: u8,
    pub _pad: u8,
    /// The client's address (IPv4 as `::ffff:a.b.c.d`).
    pub source: Addr,
}

/// Bits of a [`SourceRangeKey`] before its source: address, port, protocol and padding.
pub const SOURCE_RANGE_SERVICE_BITS: u32 = 160;
/// Prefix length of a lookup: the whole key.
pub const SOURCE_RANGE_FULL_BITS: u32 = SOURCE_RANGE_SERVICE_BITS + 128;
/// `LB_SOURCE_RANGES` value: sources under this prefix may open flows.
pub const SOURCE_RANGE_ALLOW: u8 = 1;
/// `LB_SOURCE_RANGES` value: sources under this prefix (every source no range allows) may not.
pub const SOURCE_RANGE_DENY: u8 = 0;

/// One slot of the backends array (indexed by [`backend_slot`] of a backend id).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backend {
    pub addr: Addr,
    /// Target port in network byte order.
    pub port_be: [u8; 2],
    /// `FAMILY_IPV4` or `FAMILY_IPV6`; 0 once the backend is removed (the slot keeps its id, so
    /// the next backend in it gets a newer generation).
    pub family: u8,
    pub _pad: u8,
    /// The id of the backend in this slot (or of the last one, once removed); 0 if never used.
    pub id: u32,
}

impl Backend {
    /// Whether this slot holds the live backend `id`: not removed, and not a later backend
    /// reusing the slot under a newer generation.
    pub const fn is_live(&self, id: u32) -> bool {
        self.id == id && self.family != 0
    }
}

/// Bits of a backend id that index its slot; the bits above are the slot's generation, which
/// grows each time the slot is reused, so a conntrack or affinity entry naming a removed
/// backend never reaches the backend that took its slot. 20 bits: up to 1,048,576 backends
/// (`--max-backends` sizes the array within that; a slot beyond it is simply not found), and
/// 4,095 generations per slot.
pub const BACKEND_SLOT_BITS: u32 = 20;

/// The most backends the slot bits can address.
pub const MAX_BACKEND_SLOTS: u32 = 1 << BACKEND_SLOT_BITS;

/// The backends array index of a backend id.
pub const fn backend_slot(id: u32) -> u32 {
    id & ((1 << BACKEND_SLOT_BITS) - 1)
}

/// The id of generation `generation` (1 to 32,767: never 0, so no id is 0) of slot `slot`.
pub const fn backend_id(slot: u32, generation: u32) -> u32 {
    generation << BACKEND_SLOT_BITS | slot
}

/// The generation of a backend id.
pub const fn backend_generation(id: u32) -> u32 {
    id >> BACKEND_SLOT_BITS
}

/// The id the next backend in `slot` gets, after `previous` (0 for a slot never used): the
/// next generation, from the last (32,767) back to 1.
pub const fn next_backend_id(slot: u32, previous: u32) -> u32 {
    let generations = u32::MAX >> BACKEND_SLOT_BITS;
    backend_id(slot, backend_generation(previous) % generations + 1)
}

/// A Maglev lookup table: backend ids (value of the tables map).
pub type MaglevTable = [u32; MAGLEV_TABLE_SIZE];

/// A flow as the conntrack map keys it. 4-aligned so its addresses can be read as words.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtKey {
    pub src: Addr,
    pub dst: Addr,
    pub src_port_be: [u8; 2],
    pub dst_port_be: [u8; 2],
    pub protocol: u8,
    /// `CT_ORIGINAL` or `CT_REPLY`.
    pub direction: u8,
    pub _pad: [u8; 2],
}

/// A tracked flow: in the original direction the backend it was sent to, in the reply
/// direction the service address its replies must come from.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtValue {
    /// Backend address (original) or service address (reply).
    pub addr: Addr,
    /// Backend port (original) or service port (reply), network byte order.
    pub port_be: [u8; 2],
    /// `CT_*` flags.
    pub flags: u8,
    pub _pad: u8,
    /// The backend id chosen (original direction; checked against the backends map).
    pub backend_id: u32,
    /// The service port's id (original direction), for refreshing its affinity entry.
    pub service_id: u32,
    /// Seconds of the kernel's monotonic clock at the last packet (refreshed at most once a
    /// second, in place).
    pub last_seen: u32,
    /// With `CT_SNAT`: the source to write (original) or the destination to restore (reply).
    pub nat_addr: Addr,
    pub nat_port_be: [u8; 2],
    pub _pad2: [u8; 2],
}

/// Entries per CPU of the service flow cache (a power of two: a flow's slot is its hash's low
/// bits).
pub const FLOW_CACHE_SLOTS: u32 = 2048;

/// One service flow as `tc_from_pod` last translated and delivered it to a pod of this node,
/// cached per CPU (direct-mapped by [`flow_cache_slot`]) so the flow's next packets skip the
/// conntrack and pod lookups. Valid only within the clock second it was filled in (every
/// flow's first packet of a second takes the full path, which refreshes the conntrack and
/// affinity timers as before) and while the local pods are unchanged (`pods_epoch`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowCacheEntry {
    /// The packet's flow as it leaves the pod (`direction` always 0: the tuple alone).
    pub flow: CtKey,
    /// The address and port written: the destination's (a backend) for a flow to a service,
    /// the source's (the service) for a backend's reply.
    pub addr: Addr,
    pub port_be: [u8; 2],
    /// `CT_ORIGINAL` (destination rewritten) or `CT_REPLY` (source rewritten).
    pub direction: u8,
    pub _pad: u8,
    /// The backend of a flow to a service (original direction), checked live on every packet.
    pub backend_id: u32,
    /// The end of the fill's clock second, in the kernel clock's ticks since boot (the clock
    /// of `CtValue::last_seen`): the entry is valid while the clock is below it.
    pub until: u64,
    /// `OverlayConfig::pods_epoch` at the fill.
    pub epoch: u32,
    /// Where the packet was delivered.
    pub pod: LocalPod,
    /// The veth the packet arrived on and its source MAC: a replay needs the same, which
    /// port security checked for the packet that filled the entry (the flow's source address
    /// is in `flow`), so a replayed packet needs no check of its own.
    pub from_ifindex: u32,
    pub from_mac: [u8; 6],
    pub _pad2: [u8; 2],
}

/// One NodePort flow to a backend on another node as XDP last translated and wrapped it
/// (`lb/xdp.rs`), cached per CPU in the slot [`flow_cache_slot`] gives its original key, so
/// the flow's next packets skip the conntrack, pod, pod-subnet and route lookups. Valid only
/// within the clock second it was filled in (each flow's first packet of a second takes the
/// full path, which refreshes the conntrack and affinity timers) and the route cache entry's
/// own validity, while the local pods are unchanged (`pods_epoch`) and the backend is live.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct XdpFlowCacheEntry {
    /// The client's packet as it arrives (`direction` `CT_ORIGINAL`).
    pub flow: CtKey,
    /// The backend's address and port (the new destination).
    pub new_addr: Addr,
    /// The new source: this node's address when masqueraded, else the client's.
    pub snat_addr: Addr,
    pub new_port: [u8; 2],
    pub snat_port: [u8; 2],
    /// Checked live on every packet.
    pub backend_id: u32,
    /// `OverlayConfig::pods_epoch` at the fill.
    pub epoch: u32,
    /// The backend's node.
    pub endpoint: TunnelEndpoint,
    /// This CPU's route to that node at the fill (`fits_len`: the longest outer packet it
    /// was checked for).
    pub route: RouteCacheEntry,
    /// The end of the fill's clock second (or the route's validity, if sooner), in the flow
    /// clock's ticks: valid while the clock is below it.
    pub until: u64,
}

/// The flow cache slot of a flow (its direction ignored): the words of its addresses, ports
/// and protocol folded by XOR, then Fibonacci hashing (one multiply; the product's top bits
/// depend on every input bit). Cheaper than [`flow_hash`], which a cache need not match.
#[inline(always)]
pub fn flow_cache_slot(key: &CtKey) -> u32 {
    let (s, d) = (key.src_port_be, key.dst_port_be);
    let ports = u32::from_ne_bytes([s[0], s[1], d[0], d[1]]);
    let mut folded = ports ^ key.protocol as u32;
    let mut i = 0;
    while i < 16 {
        folded ^= word(&key.src, i) ^ word(&key.dst, i).rotate_left(16);
        i += 4;
    }
    flow_cache_spread(folded)
}

/// [`flow_cache_slot`] of the IPv4 flow `src` to `dst` (the key's addresses IPv4-mapped),
/// computed from the packet's fields without assembling the key: the mapped prefix's words
/// fold to a constant.
#[inline(always)]
pub fn flow_cache_slot_v4(src: [u8; 4], dst: [u8; 4], ports: u32, protocol: u8) -> u32 {
    // `::ffff:0:0/96`: words 0 and 0xffff of the source, the latter rotated for the
    // destination; the zero words fold to nothing.
    const MAPPED_PREFIX: u32 = 0x0000_ffff ^ 0xffff_0000;
    let folded = ports
        ^ protocol as u32
        ^ MAPPED_PREFIX
        ^ u32::from_be_bytes(src)
        ^ u32::from_be_bytes(dst).rotate_left(16);
    flow_cache_spread(folded)
}

/// Fibonacci hashing of a folded key down to a slot.
#[inline(always)]
fn flow_cache_spread(folded: u32) -> u32 {
    folded.wrapping_mul(0x9e37_79b1) >> (32 - FLOW_CACHE_SLOTS.trailing_zeros())
}

/// Key of the membership map: one ready backend of one service port with ClientIP affinity.
/// Backends are shared by address and port across service ports, so whether a client's
/// affine backend still serves *this* service port is asked here, not of the backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MemberKey {
    pub service_id: u32,
    pub backend_id: u32,
}

/// Key of the affinity map: one client of one service port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey {
    pub client: Addr,
    pub service_id: u32,
}

/// The backend a client sticks to and when it last sent.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AffinityValue {
    pub backend_id: u32,
    /// Seconds of the kernel's monotonic clock at the client's last packet.
    pub last_seen: u32,
}

const _: () = {
    assert!(core::mem::size_of::<ServiceKey>() == 20);
    assert!(core::mem::size_of::<ServiceValue>() == 16);
    assert!(core::mem::size_of::<Backend>() == 24);
    assert!(core::mem::size_of::<CtKey>() == 40);
    assert!(core::mem::size_of::<CtValue>() == 52);
    assert!(core::mem::size_of::<AffinityKey>() == 20);
    assert!(core::mem::size_of::<AffinityValue>() == 8);
    assert!(core::mem::size_of::<MemberKey>() == 8);
    assert!(core::mem::size_of::<FlowCacheEntry>() == 104);
    assert!(core::mem::size_of::<XdpFlowCacheEntry>() == 168);
    assert!(FLOW_CACHE_SLOTS.is_power_of_two());
};

/// Mixes one 32-bit word into the running hash (the murmur3 block step).
#[inline(always)]
const fn mix(hash: u32, word: u32) -> u32 {
    let k = word
        .wrapping_mul(0xcc9e_2d51)
        .rotate_left(15)
        .wrapping_mul(0x1b87_3593);
    (hash ^ k)
        .rotate_left(13)
        .wrapping_mul(5)
        .wrapping_add(0xe654_6b64)
}

/// The big-endian word at byte `at` of an address inside a 4-aligned key.
#[inline(always)]
fn word(addr: &Addr, at: usize) -> u32 {
    // SAFETY: `at` is 0, 4, 8 or 12 and the address sits at a 4-aligned offset of a 4-aligned
    // `CtKey`, so the read is in bounds and aligned. Word loads (not byte loads) keep the
    // kernel build from spilling sixteen bytes per address to the 512-byte BPF stack.
    // Volatile: the words are mixed as they are read; LLVM would load all eight first and
    // spill them.
    u32::from_be(unsafe { core::ptr::read_volatile(addr.as_ptr().add(at).cast::<u32>()) })
}

/// The hash the kernel uses to pick a Maglev slot for a new flow: murmur3 over the addresses,
/// ports and protocol of `key` (its direction is ignored). Defined once so the agent and the
/// tests can predict the kernel's choice.
#[inline(always)]
pub fn flow_hash(key: &CtKey) -> u32 {
    let mut hash = 0x5eed_1b0du32;
    let mut i = 0;
    while i < 16 {
        hash = mix(hash, word(&key.src, i));
        hash = mix(hash, word(&key.dst, i));
        i += 4;
    }
    let (s, d) = (key.src_port_be, key.dst_port_be);
    let ports = (s[0] as u32) << 24 | (s[1] as u32) << 16 | (d[0] as u32) << 8 | d[1] as u32;
    hash = mix(hash, ports);
    hash = mix(hash, key.protocol as u32);
    finalize(hash)
}

/// murmur3's 32-bit finalizer: every input bit reaches every output bit.
#[inline(always)]
pub const fn finalize(mut hash: u32) -> u32 {
    hash ^= hash >> 16;
    hash = hash.wrapping_mul(0x85eb_ca6b);
    hash ^= hash >> 13;
    hash = hash.wrapping_mul(0xc2b2_ae35);
    hash ^ (hash >> 16)
}

/// The Maglev slot of a flow hash.
#[inline(always)]
pub const fn maglev_slot(hash: u32) -> usize {
    hash as usize % MAGLEV_TABLE_SIZE
}

#[cfg(feature = "user")]
mod pod_impls {
    // SAFETY: plain #[repr(C)] data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::ServiceKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ServiceValue {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::Backend {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::CtKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::CtValue {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::AffinityKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::AffinityValue {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::MemberKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::FlowCacheEntry {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::XdpFlowCacheEntry {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::overlay::ipv4_mapped;

    #[test]
    fn flow_cache_slots_spread_clients_and_ignore_the_direction() {
        let dst = ipv4_mapped([10, 96, 0, 10]);
        let mut used = [false; FLOW_CACHE_SLOTS as usize];
        for client in 0..FLOW_CACHE_SLOTS {
            let [_, _, c, d] = client.to_be_bytes();
            let mut key = CtKey {
                src: ipv4_mapped([10, 244, c, d]),
                dst,
                src_port_be: 40000u16.to_be_bytes(),
                dst_port_be: 80u16.to_be_bytes(),
                protocol: 6,
                ..CtKey::default()
            };
            let slot = flow_cache_slot(&key);
            assert!(slot < FLOW_CACHE_SLOTS);
            key.direction = CT_REPLY;
            assert_eq!(flow_cache_slot(&key), slot);
            used[slot as usize] = true;
        }
        // As many clients as slots: a uniform hash fills about 1 - 1/e of them (63%).
        let filled = used.iter().filter(|&&u| u).count();
        assert!(filled > FLOW_CACHE_SLOTS as usize / 2, "{filled} slots");
    }

    #[test]
    fn the_ipv4_flow_cache_slot_is_the_slot_of_the_mapped_key() {
        for (i, protocol) in (0..500u32).zip([6u8, 17, 132].into_iter().cycle()) {
            let [a, b, c, d] = i.wrapping_mul(0x0101_6d2b).to_be_bytes();
            let (src, dst) = ([10, a, b, c], [172, d, a ^ c, b]);
            let (sport, dport) = ((i as u16).wrapping_mul(131), 80 + i as u16);
            let key = CtKey {
                src: ipv4_mapped(src),
                dst: ipv4_mapped(dst),
                src_port_be: sport.to_be_bytes(),
                dst_port_be: dport.to_be_bytes(),
                protocol,
                ..CtKey::default()
            };
            let (s, p) = (sport.to_be_bytes(), dport.to_be_bytes());
            // The ports word as the kernel reads it off the packet.
            let ports = u32::from_ne_bytes([s[0], s[1], p[0], p[1]]);
            assert_eq!(
                flow_cache_slot_v4(src, dst, ports, protocol),
                flow_cache_slot(&key),
                "{key:?}"
            );
        }
    }

    #[test]
    fn flow_hash_spreads_source_ports_over_the_table() {
        let (src, dst) = (ipv4_mapped([10, 0, 0, 1]), ipv4_mapped([10, 96, 0, 10]));
        let mut hits = [0u32; 8];
        for port in 0..8000u16 {
            let key = CtKey {
                src,
                dst,
                src_port_be: port.to_be_bytes(),
                dst_port_be: 80u16.to_be_bytes(),
                protocol: 6,
                ..CtKey::default()
            };
            let h = flow_hash(&key);
            hits[maglev_slot(h) % 8] += 1;
        }
        assert!(hits.iter().all(|&n| (800..1200).contains(&n)), "{hits:?}");
    }
}
