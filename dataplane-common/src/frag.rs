//! IP fragments: the ports of a datagram's first fragment, remembered so that its later
//! fragments, which carry no transport header, are judged and load-balanced like the first.

use crate::overlay::Addr;

/// Parse result's fragment state: not a fragment.
pub const FRAG_NONE: u8 = 0;
/// The first fragment (offset 0, more fragments follow): it carries the transport header.
pub const FRAG_FIRST: u8 = 1;
/// A later fragment (offset above 0): no transport header.
pub const FRAG_LATER: u8 = 2;
/// The last fragment (offset above 0, no more fragments follow): no transport header, and the
/// datagram's remembered ports go with it.
pub const FRAG_LAST: u8 = 3;

/// One datagram being fragmented, as every fragment names it (RFC 791, RFC 8200 4.5): its
/// addresses, identification and protocol.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    pub src: Addr,
    pub dst: Addr,
    /// IPv4's 16-bit identification, or IPv6's 32-bit one, in network byte order.
    pub id: [u8; 4],
    pub protocol: u8,
    pub _pad: [u8; 3],
}

/// The first fragment's transport ports, in network byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragPorts {
    pub src_port: [u8; 2],
    pub dst_port: [u8; 2],
}

const _: () = {
    assert!(core::mem::size_of::<FragKey>() == 40);
    assert!(core::mem::size_of::<FragPorts>() == 4);
};

#[cfg(feature = "user")]
mod pod_impls {
    // SAFETY: plain #[repr(C)] data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::FragKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::FragPorts {}
}
