//! The per-CPU working sets of the stages: what the parser found, and the load-balancer's and
//! access control's keys and entries in the making. They live in per-CPU maps (`maps.rs`), not
//! on the 512-byte BPF stack, and cross tail calls there. Plain layouts only: the stages that
//! fill and read them sit above, the maps that hold them below.

use aya_ebpf::maps::lpm_trie::Key;
use dataplane_common::{
    PacketClass,
    acl::{ACL_MAX_LENGTHS, AclAddrKey, AclCtKey, AclPortKey},
    egressip::EgressCtValue,
    frag::FRAG_NONE,
    lb::{AffinityKey, AffinityValue, CtKey, CtValue, MemberKey, ServiceKey, SourceRangeKey},
    overlay::Addr,
};

/// What the parser found: offsets for the later stages and the packet class for counters.
#[derive(Clone, Copy)]
pub struct Parsed {
    /// Ethertype after any VLAN tags (host byte order).
    pub ether_type: u16,
    /// Offset of the IPv4/IPv6 header (0 when there is none).
    pub l3_offset: usize,
    /// Offset of the transport header (0 when there is none, e.g. a non-first fragment).
    pub l4_offset: usize,
    /// IP protocol / final IPv6 next header (0 when not IP).
    #[allow(
        dead_code,
        reason = "read by the LB and policy stages, which only the BPF build has (an expect \
                  would fail the host build)"
    )]
    pub protocol: u8,
    /// Transport ports in network byte order as on the wire (0 when the protocol has none).
    #[allow(
        dead_code,
        reason = "read by the LB and policy stages, which only the BPF build has (an expect \
                  would fail the host build)"
    )]
    pub src_port: [u8; 2],
    pub dst_port: [u8; 2],
    pub class: PacketClass,
    /// `FRAG_NONE`, `FRAG_FIRST`, `FRAG_LATER` or `FRAG_LAST`. A later fragment's ports are its first
    /// fragment's, filled in by `frag::follow_first` (its `l4_offset` stays 0).
    pub fragment: u8,
    /// The fragment's datagram identification (network byte order; IPv4's in the first two).
    pub frag_id: [u8; 4],
}

impl Parsed {
    #[inline(always)]
    pub(crate) const fn l2(ether_type: u16, class: PacketClass) -> Self {
        Self {
            ether_type,
            l3_offset: 0,
            l4_offset: 0,
            protocol: 0,
            src_port: [0; 2],
            dst_port: [0; 2],
            class,
            fragment: FRAG_NONE,
            frag_id: [0; 4],
        }
    }
}

/// The load-balancer's working set for one packet. It lives in a per-CPU map, not on the BPF
/// stack (512 bytes, shared with the overlay stage): keys are built in place and handed to the
/// map helpers from here.
#[repr(C)]
pub struct LbScratch {
    /// The packet's flow; `direction` is set before each lookup.
    pub(crate) flow: CtKey,
    /// The reply direction of a new flow.
    pub(crate) reply: CtKey,
    /// The original direction of the flow holding a masquerade port a new flow would take.
    pub(crate) holder: CtKey,
    /// Entries written for a new flow.
    pub(crate) original_entry: CtValue,
    pub(crate) reply_entry: CtValue,
    pub(crate) service: ServiceKey,
    pub(crate) affinity: AffinityKey,
    pub(crate) affinity_entry: AffinityValue,
    pub(crate) member: MemberKey,
    /// The translation to apply: address and port before and after.
    pub(crate) old_addr: Addr,
    pub(crate) new_addr: Addr,
    pub(crate) old_port: [u8; 2],
    pub(crate) new_port: [u8; 2],
    pub(crate) tcp_flags: u8,
    pub(crate) ipv4: u8,
    /// Whether the source is translated too (hairpin, NodePort to another node), to
    /// `snat_addr`.
    pub(crate) snat: u8,
    /// Whether the packet came from outside (a NodePort, an external or load-balancer IP).
    pub(crate) nodeport: u8,
    pub(crate) snat_addr: Addr,
    pub(crate) snat_port: [u8; 2],
    pub(crate) _pad2: [u8; 2],
    /// This node's address of the packet's family (from outside: the source towards remote
    /// backends).
    pub(crate) node_addr: Addr,
    /// The backend of the packet's flow (tracked or just chosen).
    pub(crate) backend_id: u32,
    /// Whether this packet's translation was a single rewrite (no masquerade, not from
    /// outside) that the flow cache may replay.
    pub(crate) cacheable: u8,
    pub(crate) _pad3: [u8; 3],
    /// A new flow's source-range lookup: its service address, port and protocol, its source.
    pub(crate) range: Key<SourceRangeKey>,
}

// The addresses whose checksum differences are summed as words (`addr_diff`) are 4-aligned.
const _: () = {
    use core::mem::{align_of, offset_of};
    assert!(align_of::<LbScratch>() >= 4);
    assert!(offset_of!(LbScratch, old_addr) % 4 == 0 && offset_of!(LbScratch, new_addr) % 4 == 0);
    assert!(offset_of!(LbScratch, snat_addr) % 4 == 0);
    assert!(offset_of!(LbScratch, flow) % 4 == 0 && offset_of!(CtKey, dst) % 4 == 0);
};

/// The stage's working set (value of `ACL_SCRATCH`).
pub struct AclWork {
    pub(crate) parsed: Parsed,
    /// The packet's flow, in its direction.
    pub(crate) flow: AclCtKey,
    /// For an ICMP error: the flow of the packet it quotes.
    pub(crate) quoted: AclCtKey,
    /// The prefix lengths of the set being looked up.
    pub(crate) lengths: [u8; ACL_MAX_LENGTHS],
    /// The keys of the lookups in a rule set.
    pub(crate) addr_key: AclAddrKey,
    pub(crate) port_key: AclPortKey,
}

/// The egress IP stage's working set (value of `EGRESS_SCRATCH`).
#[repr(C)]
pub struct EgressWork {
    /// The packet's flow; `direction` is set before each lookup.
    pub(crate) flow: CtKey,
    /// The reply direction of a new translated flow.
    pub(crate) reply: CtKey,
    /// An entry in the making.
    pub(crate) value: EgressCtValue,
    /// The egress address of the packet's flow.
    pub(crate) egress: Addr,
    /// A neighbour solicitation's source: where its answer goes.
    pub(crate) egress_peer: Addr,
    /// The flow's source port on the egress address (network byte order).
    pub(crate) port: [u8; 2],
    pub(crate) ipv4: u8,
    /// What kind of ICMP or ICMPv6 message the packet is (`ECHO_*` in `egressip`).
    pub(crate) icmp: u8,
    /// Key of the cluster-internal prefixes' lookup.
    pub(crate) lpm: aya_ebpf::maps::lpm_trie::Key<Addr>,
}
