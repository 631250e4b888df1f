//! Why a packet was dropped. Every drop in the kernel programs names one of these reasons and
//! increments its per-CPU counter (`maps::DROPS`), so operators can see exactly what was refused.

/// Defines [`DropReason`] with its code, name and one-line description in one place, plus the
/// list of all reasons for the userspace readers.
macro_rules! drop_reasons {
    ($($variant:ident = $code:literal, $name:literal, $doc:literal;)+) => {
        /// A named reason for dropping a packet. The discriminant is the index into the
        /// per-CPU drop counter map.
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum DropReason {
            $(#[doc = $doc] $variant = $code,)+
        }

        impl DropReason {
            /// Every reason, in code order.
            pub const ALL: &'static [DropReason] = &[$(DropReason::$variant,)+];

            /// Stable snake_case name used by the CLI, JSON output and metrics labels.
            pub const fn name(self) -> &'static str {
                match self { $(DropReason::$variant => $name,)+ }
            }

            /// One-line human description.
            pub const fn description(self) -> &'static str {
                match self { $(DropReason::$variant => $doc,)+ }
            }

            /// The reason with this counter index, if any.
            pub const fn from_code(code: u32) -> Option<DropReason> {
                match code { $($code => Some(DropReason::$variant),)+ _ => None }
            }
        }
    };
}

drop_reasons! {
    EthTruncated = 1, "eth_truncated", "Ethernet header shorter than 14 bytes";
    VlanTruncated = 2, "vlan_truncated", "802.1Q tag cut short";
    VlanTooDeep = 3, "vlan_too_deep", "more VLAN tags than the parser accepts (2)";
    Ipv4Truncated = 4, "ipv4_truncated", "IPv4 header shorter than 20 bytes";
    Ipv4BadVersion = 5, "ipv4_bad_version", "IPv4 ethertype but version field is not 4";
    Ipv4BadIhl = 6, "ipv4_bad_ihl", "IPv4 IHL below 5 words";
    Ipv4OptionsTruncated = 7, "ipv4_options_truncated", "IPv4 IHL points beyond the packet";
    Ipv4BadTotalLength = 8, "ipv4_bad_total_length", "IPv4 total length below the header length or beyond the packet";
    Ipv6Truncated = 9, "ipv6_truncated", "IPv6 header shorter than 40 bytes";
    Ipv6BadVersion = 10, "ipv6_bad_version", "IPv6 ethertype but version field is not 6";
    Ipv6ExtTruncated = 11, "ipv6_ext_truncated", "IPv6 extension header cut short";
    Ipv6ExtTooDeep = 12, "ipv6_ext_too_deep", "IPv6 extension header chain longer than the parser accepts";
    TcpTruncated = 13, "tcp_truncated", "TCP header cut short";
    TcpBadDataOffset = 14, "tcp_bad_data_offset", "TCP data offset below 5 words or beyond the packet";
    UdpTruncated = 15, "udp_truncated", "UDP header cut short";
    SctpTruncated = 16, "sctp_truncated", "SCTP common header cut short";
    IcmpTruncated = 17, "icmp_truncated", "ICMP header cut short";
    Icmpv6Truncated = 18, "icmpv6_truncated", "ICMPv6 header cut short";
    Ipv6BadPayloadLength = 19, "ipv6_bad_payload_length", "IPv6 payload length beyond the packet";
    GeneveUnknownNode = 20, "geneve_unknown_node", "Geneve from an address that is not a cluster node";
    GeneveBadVersion = 21, "geneve_bad_version", "Geneve version other than 0";
    GeneveOptionsTruncated = 22, "geneve_options_truncated", "Geneve options run past the packet";
    GeneveCriticalOption = 23, "geneve_critical_option", "Geneve option with the critical bit that this node does not understand";
    GeneveControl = 24, "geneve_control", "Geneve control packet (O bit): never delivered to a pod";
    GeneveBadProtocol = 25, "geneve_bad_protocol", "Geneve payload other than Ethernet (0x6558)";
    GeneveInnerMalformed = 26, "geneve_inner_malformed", "inner frame of a Geneve packet is malformed";
    GeneveNoLocalPod = 27, "geneve_no_local_pod", "Geneve inner destination is not a pod on this node";
    OverlayNoRoute = 28, "overlay_no_route", "no underlay route to the remote node";
    OverlayEncapFailed = 29, "overlay_encap_failed", "the kernel refused to grow the packet for encapsulation";
    OverlayMtuExceeded = 30, "overlay_mtu_exceeded", "a pod packet too large for the underlay after encapsulation";
    LbNoEndpoints = 31, "lb_no_endpoints", "a new flow to a service port without a ready endpoint";
    LbBackendGone = 32, "lb_backend_gone", "a TCP packet of a flow whose backend was removed, not answerable with a reset";
    LbRewriteFailed = 33, "lb_rewrite_failed", "the kernel refused to rewrite a service packet";
    LbSnatPortsExhausted = 34, "lb_snat_ports_exhausted", "no free source port to masquerade a NodePort flow to a remote backend";
    FirewallDenied = 35, "firewall_denied", "a pod packet to outside the cluster denied by its namespace's EgressFirewall";
    PolicyDeniedEgress = 36, "policy_denied_egress", "a new flow from a pod that no NetworkPolicy of the pod allows (egress)";
    PolicyDeniedIngress = 37, "policy_denied_ingress", "a new flow to a pod that no NetworkPolicy of the pod allows (ingress)";
    TailCallFailed = 38, "tail_call_failed", "the next stage of a program could not be reached (its program array slot is empty)";
    GeneveUnknownVni = 40, "geneve_unknown_vni", "Geneve with a VNI other than the default pod network's";
    GeneveWrongVlan = 41, "geneve_wrong_vlan", "Geneve to this node in a VLAN the underlay does not carry the overlay in";
    PortUnknown = 42, "port_unknown", "a packet on a pod veth the agent has no port-security record for";
    PortSrcMac = 43, "port_src_mac", "a pod sent with a source MAC that is not its own";
    PortSrcIp = 44, "port_src_ip", "a pod sent with a source address that is not its own";
    PortArp = 45, "port_arp", "a pod's ARP with a sender MAC or address that is not its own";
    PortNd = 46, "port_nd", "a pod's neighbour discovery with a link-layer address or target that is not its own, or a router advertisement or redirect";
    PortEthertype = 47, "port_ethertype", "a frame from or to a pod that is neither untagged IP nor ARP";
    PortDstMac = 48, "port_dst_mac", "a frame to a pod for a unicast MAC that is not the pod's";
    PortDstIp = 49, "port_dst_ip", "a packet to a pod for a unicast address that is not the pod's";
    FragmentWithoutFirst = 50, "fragment_without_first", "a later fragment of a datagram whose first fragment (with the ports) was not seen here";
    EgressIpUnassigned = 51, "egress_ip_unassigned", "a selected pod's packet to outside the cluster while no node holds an egress address for it (never sent with the pod's own address)";
    EgressIpNotHere = 52, "egress_ip_not_here", "another node's pod traffic to outside the cluster arriving at a node that holds no egress address for that pod";
    EgressIpNoFlow = 53, "egress_ip_no_flow", "a packet to an egress address held here that answers no flow a pod opened (the node's own sockets never take it)";
    EgressIpProtocol = 54, "egress_ip_protocol", "a selected pod's packet to outside the cluster that is neither TCP, UDP nor an ICMP or ICMPv6 echo request (not translated, so not sent)";
    EgressIpPortsExhausted = 55, "egress_ip_ports_exhausted", "no free source port on the egress address for a new flow";
    EgressIpRewriteFailed = 56, "egress_ip_rewrite_failed", "the kernel refused to translate or forward an egress packet";
    HybridUnknownNode = 57, "hybrid_unknown_node", "VXLAN to the hybrid overlay port from an address that is not a hybrid node's";
    HybridWrongVni = 58, "hybrid_wrong_vni", "hybrid overlay VXLAN without the I flag or with a VNI other than 4097";
    HybridWrongMac = 59, "hybrid_wrong_mac", "hybrid overlay VXLAN whose inner destination MAC is not this node's router MAC";
    HybridMalformed = 60, "hybrid_malformed", "hybrid overlay VXLAN too short for its headers, or whose inner frame is not IPv4";
    HybridNoNode = 61, "hybrid_no_node", "a packet to the hybrid overlay's network for a subnet no hybrid node announces (its node left, or removed its annotations)";
    MulticastDisabled = 62, "multicast_disabled", "multicast to or from a pod whose namespace has not enabled it (k8s.ovn.org/multicast-enabled), or to a pod that did not join the group";
    MulticastNoMembers = 63, "multicast_no_members", "multicast to a group that no pod of the sender's namespace joined";
    MulticastBadTunnel = 64, "multicast_bad_tunnel", "a Geneve multicast copy without a valid namespace option, or whose inner frame is no IP multicast";
    MulticastCopyFailed = 65, "multicast_copy_failed", "a multicast copy could not be made (clone, encapsulation or route to the other node failed)";
    MulticastReportLost = 66, "multicast_report_lost", "an IGMP or MLD message found the agent's ring full (the next query asks again)";
    LbNotOpening = 67, "lb_not_opening", "a TCP segment without SYN (or an SCTP chunk other than INIT) to a service port that belongs to no tracked flow: only a connection's opening is given a backend";
    LbSourceRange = 68, "lb_source_range", "a new flow to a load-balancer address from a source outside the Service's spec.loadBalancerSourceRanges";
    ScratchUnavailable = 39, "scratch_unavailable", "a program's per-CPU working set (the parse result handed between stages) could not be reached";
}

/// Size of the drop counter map: one slot per code, slot 0 unused.
pub const DROP_REASON_SLOTS: u32 = 96;

const _: () = {
    let mut i = 0;
    while i < DropReason::ALL.len() {
        assert!((DropReason::ALL[i] as u32) < DROP_REASON_SLOTS);
        i += 1;
    }
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_unique_and_round_trip() {
        for (i, reason) in DropReason::ALL.iter().enumerate() {
            assert_eq!(DropReason::from_code(*reason as u32), Some(*reason));
            for other in &DropReason::ALL[i + 1..] {
                assert_ne!(*reason as u32, *other as u32);
                assert_ne!(reason.name(), other.name());
            }
        }
        assert_eq!(DropReason::from_code(0), None);
    }
}
