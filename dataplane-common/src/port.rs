//! Pod port security (OVN's `port_security` for every pod): what a pod may send as, and what
//! may be delivered to it. One record per pod, keyed by the ifindex of its host-side veth.

use crate::overlay::Addr;

/// `PodPort::flags`: the pod has an IPv4 address.
pub const PORT_HAS_IPV4: u8 = 1 << 0;
/// `PodPort::flags`: the pod has an IPv6 address.
pub const PORT_HAS_IPV6: u8 = 1 << 1;
/// `PodPort::flags`: no pod is known behind this veth (an interface the operator named on the
/// command line that no Pod of the cluster state claims): port security does not apply.
pub const PORT_UNRESTRICTED: u8 = 1 << 2;

/// The addresses a pod owns (value of `POD_PORTS`, keyed by its host-side veth's ifindex).
/// 4-aligned, so the kernel compares the addresses as words.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodPort {
    /// The pod's IPv6 address (valid with `PORT_HAS_IPV6`).
    pub ipv6: Addr,
    /// The IPv6 link-local address the pod's kernel derives from its MAC (EUI-64), which it
    /// sends router and neighbour solicitations and MLD reports from.
    pub ipv6_link_local: Addr,
    /// The pod's IPv4 address (valid with `PORT_HAS_IPV4`).
    pub ipv4: [u8; 4],
    /// The pod's MAC (eth0 inside the pod).
    pub mac: [u8; 6],
    /// `PORT_HAS_*`.
    pub flags: u8,
    pub _pad: u8,
}

const _: () = assert!(core::mem::size_of::<PodPort>() == 44);

/// Slots of each CPU's port-security cache (`PORT_CACHE`), by the veth's ifindex modulo this.
pub const PORT_CACHE_SLOTS: u32 = 256;

/// A CPU's copy of one `PodPort` (value of `PORT_CACHE`): valid for `ifindex` while the local
/// pods' epoch (`OverlayConfig::pods_epoch`, moved on by every change of them) is `epoch`.
/// One array read instead of a hash lookup for every packet of a pod not in the flow cache.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortCacheEntry {
    pub port: PodPort,
    /// The veth the copy is of (0: empty).
    pub ifindex: u32,
    pub epoch: u32,
}

/// The link-local address a pod's kernel gives itself from `mac` (RFC 4291 appendix A: the
/// universal/local bit flipped, ff:fe in the middle).
pub const fn link_local_of(mac: [u8; 6]) -> Addr {
    [
        0xfe,
        0x80,
        0,
        0,
        0,
        0,
        0,
        0,
        mac[0] ^ 0x02,
        mac[1],
        mac[2],
        0xff,
        0xfe,
        mac[3],
        mac[4],
        mac[5],
    ]
}

#[cfg(feature = "user")]
mod pod_impls {
    // SAFETY: plain #[repr(C)] data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::PodPort {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_local_follows_eui64() {
        // 0a:58:0a:f4:01:02 -> fe80::858:aff:fef4:102
        let expected: Addr = "fe80::858:aff:fef4:102"
            .parse::<core::net::Ipv6Addr>()
            .unwrap()
            .octets();
        assert_eq!(
            link_local_of([0x0a, 0x58, 0x0a, 0xf4, 0x01, 0x02]),
            expected
        );
    }
}
