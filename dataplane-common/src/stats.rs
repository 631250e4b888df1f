//! Packet counters: every attach point counts what it sees by packet class, so an operator can
//! tell that traffic reaches the programs and what kind it is.

/// Where a kernel program is attached. The discriminant selects a row of the counter map.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    /// XDP on the node's underlay NIC (traffic arriving at the node).
    Underlay = 0,
    /// tc ingress on the host side of a pod veth (traffic leaving a pod).
    FromPod = 1,
    /// tc ingress on the underlay NIC: what XDP passed up, decapsulated or not.
    UnderlayTc = 2,
    /// tc egress on the host side of a pod veth (traffic the stack delivers to a pod).
    ToPod = 3,
}

impl Hook {
    pub const ALL: &'static [Hook] =
        &[Hook::Underlay, Hook::FromPod, Hook::UnderlayTc, Hook::ToPod];

    pub const fn name(self) -> &'static str {
        match self {
            Hook::Underlay => "underlay",
            Hook::FromPod => "from_pod",
            Hook::UnderlayTc => "underlay_tc",
            Hook::ToPod => "to_pod",
        }
    }
}

/// What the parser recognised. The discriminant selects a column of the counter map.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PacketClass {
    /// Every packet the program saw, whatever its class (including dropped ones).
    Total = 0,
    /// Neither IPv4 nor IPv6 nor ARP (LLDP, ...).
    OtherL2 = 1,
    Arp = 2,
    Tcp = 3,
    Udp = 4,
    Sctp = 5,
    Icmp = 6,
    Icmpv6 = 7,
    /// IP with another transport (GRE, ESP, ...).
    OtherL4 = 8,
    /// IPv4 or IPv6 fragment without a transport header (offset > 0).
    Fragment = 9,
    /// Dropped (the reason is counted in the drop map).
    Dropped = 10,
    // Outcomes rather than classes: what the overlay did with the packet.
    /// Wrapped in Geneve towards another node.
    GeneveEncap = 11,
    /// Unwrapped from Geneve for a local pod.
    GeneveDecap = 12,
    /// Handed straight to a pod on the same node.
    LocalRedirect = 13,
    /// Larger than the pod MTU: answered with ICMP fragmentation needed / packet too big.
    TooBigAnswered = 14,
    // What the load-balancer did.
    /// Sent to a service backend (destination rewritten).
    ServiceDnat = 15,
    /// A backend's reply given the service address back.
    ServiceReverseNat = 16,
    /// A packet to a service without endpoints, answered with a TCP reset or ICMP unreachable.
    ServiceRejected = 17,
    /// A TCP segment of a flow whose backend was removed, answered with a reset.
    ServiceResetBackendGone = 18,
    // What access control did.
    /// A pod packet to outside the cluster that its namespace's EgressFirewall let through.
    FirewallAllowed = 19,
    /// An access-control verdict sent to the agent as an audit record.
    AuditLogged = 20,
    /// An audit record not sent: over the rate limit, or the ring buffer was full.
    AuditSuppressed = 21,
    /// A new flow NetworkPolicy allowed (now tracked, so its replies pass).
    PolicyAllowed = 22,
    /// A packet of a flow NetworkPolicy already allowed (either direction).
    PolicyTracked = 23,
    /// A service packet translated and delivered from the flow cache (also counted as its
    /// translation and as a local redirect).
    ServiceFlowCached = 24,
    // What egress IPs did.
    /// A selected pod's packet sent through Geneve to the node holding its egress address.
    EgressRerouted = 25,
    /// A packet given an egress address held here as its source, and sent out.
    EgressSnat = 26,
    /// A reply to an egress address held here, given the pod's address back.
    EgressReverseNat = 27,
    /// An ARP request (or neighbour solicitation) for an egress address held here, answered.
    EgressArpAnswered = 28,
    // What the hybrid overlay did.
    /// Wrapped in VXLAN towards a hybrid node's pod.
    VxlanEncap = 29,
    /// VXLAN from a hybrid node, unwrapped for a pod or a service here.
    VxlanDecap = 30,
    /// An IGMP or MLD message of a pod of a multicast-enabled namespace, handed to the agent.
    MulticastReport = 31,
    /// A multicast copy handed to a local pod that joined the group.
    MulticastLocalCopy = 32,
    /// A multicast copy sent to another node in Geneve (one per node).
    MulticastRemoteCopy = 33,
    /// An IGMP or MLD query let into a pod.
    MulticastQuery = 34,
}

impl PacketClass {
    pub const ALL: &'static [PacketClass] = &[
        PacketClass::Total,
        PacketClass::OtherL2,
        PacketClass::Arp,
        PacketClass::Tcp,
        PacketClass::Udp,
        PacketClass::Sctp,
        PacketClass::Icmp,
        PacketClass::Icmpv6,
        PacketClass::OtherL4,
        PacketClass::Fragment,
        PacketClass::Dropped,
        PacketClass::GeneveEncap,
        PacketClass::GeneveDecap,
        PacketClass::LocalRedirect,
        PacketClass::TooBigAnswered,
        PacketClass::ServiceDnat,
        PacketClass::ServiceReverseNat,
        PacketClass::ServiceRejected,
        PacketClass::ServiceResetBackendGone,
        PacketClass::FirewallAllowed,
        PacketClass::AuditLogged,
        PacketClass::AuditSuppressed,
        PacketClass::PolicyAllowed,
        PacketClass::PolicyTracked,
        PacketClass::ServiceFlowCached,
        PacketClass::EgressRerouted,
        PacketClass::EgressSnat,
        PacketClass::EgressReverseNat,
        PacketClass::EgressArpAnswered,
        PacketClass::VxlanEncap,
        PacketClass::VxlanDecap,
        PacketClass::MulticastReport,
        PacketClass::MulticastLocalCopy,
        PacketClass::MulticastRemoteCopy,
        PacketClass::MulticastQuery,
    ];

    /// The class with this counter column, if any (a match, not a table: the kernel side
    /// calls it).
    pub const fn from_code(code: u32) -> Option<PacketClass> {
        Some(match code {
            0 => PacketClass::Total,
            1 => PacketClass::OtherL2,
            2 => PacketClass::Arp,
            3 => PacketClass::Tcp,
            4 => PacketClass::Udp,
            5 => PacketClass::Sctp,
            6 => PacketClass::Icmp,
            7 => PacketClass::Icmpv6,
            8 => PacketClass::OtherL4,
            9 => PacketClass::Fragment,
            10 => PacketClass::Dropped,
            11 => PacketClass::GeneveEncap,
            12 => PacketClass::GeneveDecap,
            13 => PacketClass::LocalRedirect,
            14 => PacketClass::TooBigAnswered,
            15 => PacketClass::ServiceDnat,
            16 => PacketClass::ServiceReverseNat,
            17 => PacketClass::ServiceRejected,
            18 => PacketClass::ServiceResetBackendGone,
            19 => PacketClass::FirewallAllowed,
            20 => PacketClass::AuditLogged,
            21 => PacketClass::AuditSuppressed,
            22 => PacketClass::PolicyAllowed,
            23 => PacketClass::PolicyTracked,
            24 => PacketClass::ServiceFlowCached,
            25 => PacketClass::EgressRerouted,
            26 => PacketClass::EgressSnat,
            27 => PacketClass::EgressReverseNat,
            28 => PacketClass::EgressArpAnswered,
            29 => PacketClass::VxlanEncap,
            30 => PacketClass::VxlanDecap,
            31 => PacketClass::MulticastReport,
            32 => PacketClass::MulticastLocalCopy,
            33 => PacketClass::MulticastRemoteCopy,
            34 => PacketClass::MulticastQuery,
            _ => return None,
        })
    }

    pub const fn name(self) -> &'static str {
        match self {
            PacketClass::Total => "total",
            PacketClass::OtherL2 => "other_l2",
            PacketClass::Arp => "arp",
            PacketClass::Tcp => "tcp",
            PacketClass::Udp => "udp",
            PacketClass::Sctp => "sctp",
            PacketClass::Icmp => "icmp",
            PacketClass::Icmpv6 => "icmpv6",
            PacketClass::OtherL4 => "other_l4",
            PacketClass::Fragment => "fragment",
            PacketClass::Dropped => "dropped",
            PacketClass::GeneveEncap => "geneve_encap",
            PacketClass::GeneveDecap => "geneve_decap",
            PacketClass::LocalRedirect => "local_redirect",
            PacketClass::TooBigAnswered => "too_big_answered",
            PacketClass::ServiceDnat => "service_dnat",
            PacketClass::ServiceReverseNat => "service_reverse_nat",
            PacketClass::ServiceRejected => "service_rejected",
            PacketClass::ServiceResetBackendGone => "service_reset_backend_gone",
            PacketClass::FirewallAllowed => "firewall_allowed",
            PacketClass::AuditLogged => "audit_logged",
            PacketClass::AuditSuppressed => "audit_suppressed",
            PacketClass::PolicyAllowed => "policy_allowed",
            PacketClass::PolicyTracked => "policy_tracked",
            PacketClass::ServiceFlowCached => "service_flow_cached",
            PacketClass::EgressRerouted => "egress_rerouted",
            PacketClass::EgressSnat => "egress_snat",
            PacketClass::EgressReverseNat => "egress_reverse_nat",
            PacketClass::EgressArpAnswered => "egress_arp_answered",
            PacketClass::VxlanEncap => "vxlan_encap",
            PacketClass::VxlanDecap => "vxlan_decap",
            PacketClass::MulticastReport => "multicast_report",
            PacketClass::MulticastLocalCopy => "multicast_local_copy",
            PacketClass::MulticastRemoteCopy => "multicast_remote_copy",
            PacketClass::MulticastQuery => "multicast_query",
        }
    }
}

/// Columns per hook row in the counter map (room to grow without a layout change).
pub const CLASS_SLOTS: u32 = 48;
/// Rows in the counter map.
pub const HOOK_SLOTS: u32 = 8;
/// Entries of the per-CPU packet counter map.
pub const PACKET_COUNTER_SLOTS: u32 = CLASS_SLOTS * HOOK_SLOTS;

/// Index of the counter for `class` packets seen at `hook`.
#[inline(always)]
pub const fn counter_index(hook: Hook, class: PacketClass) -> u32 {
    hook as u32 * CLASS_SLOTS + class as u32
}

const _: () = {
    assert!(PacketClass::ALL.len() as u32 <= CLASS_SLOTS);
    assert!(Hook::ALL.len() as u32 <= HOOK_SLOTS);
};

/// What one pod's traffic cost, counted per CPU against its host-side veth (`POD_STATS`): the
/// packets dropped at its veth (either way), and the service flows it opened (each two
/// conntrack entries). `dataplane inspect pods` sums them, so the pod that floods is named.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodCounters {
    pub drops: u64,
    pub flows: u64,
}

/// [`PodCounters`] field: a drop.
pub const POD_DROP: u32 = 0;
/// [`PodCounters`] field: a service flow opened.
pub const POD_FLOW: u32 = 1;

#[cfg(feature = "user")]
// SAFETY: `repr(C)`, two u64 fields, no padding.
unsafe impl aya::Pod for PodCounters {}

const _: () = assert!(core::mem::size_of::<PodCounters>() == 16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_indices_are_distinct_and_in_range() {
        for &class in PacketClass::ALL {
            assert_eq!(PacketClass::from_code(class as u32), Some(class));
        }
        let mut seen = [false; PACKET_COUNTER_SLOTS as usize];
        for &hook in Hook::ALL {
            for &class in PacketClass::ALL {
                let index = counter_index(hook, class) as usize;
                assert!(!seen[index], "{hook:?} {class:?} collides");
                seen[index] = true;
            }
        }
    }
}
