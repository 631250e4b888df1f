//! The Internet checksum (RFC 1071) over headers assembled in the per-CPU scratch block, and
//! the IPv4 header every packet the dataplane builds (Geneve, ICMP errors, resets) starts with.

use aya_ebpf::helpers::bpf_csum_diff;
use dataplane_common::DropReason;

use crate::maps::ENCAP_SCRATCH_LEN;

/// One's-complement sum of the 16-bit words of `block[start..start + len]` (len even), added
/// to `seed`. Bounded: at most half the block's words.
#[inline(always)]
pub fn sum_words(block: &[u8; ENCAP_SCRATCH_LEN], start: usize, len: usize, seed: u32) -> u32 {
    let mut sum = seed;
    let mut i = 0;
    while i < ENCAP_SCRATCH_LEN / 2 {
        let at = start + 2 * i;
        if 2 * i >= len || at + 1 >= ENCAP_SCRATCH_LEN {
            break;
        }
        sum += u16::from_be_bytes([block[at], block[at + 1]]) as u32;
        i += 1;
    }
    sum
}

/// Folds a sum to 16 bits and complements it: the checksum field's value.
#[inline(always)]
pub fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xFFFF) + (sum >> 16);
    sum = (sum & 0xFFFF) + (sum >> 16);
    !(sum as u16)
}

/// Folds `sum` and stores the checksum at `block[at..at + 2]`.
#[inline(always)]
pub fn store_checksum(block: &mut [u8; ENCAP_SCRATCH_LEN], at: usize, sum: u32) {
    let check = fold(sum).to_be_bytes();
    block[at] = check[0];
    block[at + 1] = check[1];
}

/// An IPv4 header at offset 14 (after Ethernet): no options, identification 0, TTL 64, DF as
/// asked, its checksum computed.
#[inline(always)]
pub fn write_ipv4(
    block: &mut [u8; ENCAP_SCRATCH_LEN],
    total_len: u16,
    protocol: u8,
    dont_fragment: bool,
    src: &[u8; 4],
    dst: &[u8; 4],
) {
    let len = total_len.to_be_bytes();
    let flags = if dont_fragment { 0x40 } else { 0 };
    let header: [u8; 20] = [
        0x45, 0, len[0], len[1], 0, 0, flags, 0, 64, protocol, 0, 0, src[0], src[1], src[2],
        src[3], dst[0], dst[1], dst[2], dst[3],
    ];
    block[14..34].copy_from_slice(&header);
    store_checksum(block, 24, sum_words(block, 14, 20, 0));
}

/// `bpf_csum_diff` from `from[skip..]` to `to[skip..]` (16-byte addresses; `skip` 12 for
/// IPv4), added to `seed`.
#[inline(always)]
pub fn csum_diff(
    from: &[u8; 16],
    to: &[u8; 16],
    skip: usize,
    seed: u32,
) -> Result<u32, DropReason> {
    // SAFETY: both buffers are 16 bytes; the helper reads `16 - skip` of each and writes none.
    let diff = unsafe {
        bpf_csum_diff(
            from.as_ptr().add(skip) as *mut u32,
            (16 - skip) as u32,
            to.as_ptr().add(skip) as *mut u32,
            (16 - skip) as u32,
            seed,
        )
    };
    if diff < 0 {
        return Err(DropReason::LbRewriteFailed);
    }
    Ok(diff as u32)
}

/// A checksum field (as stored) after the covered data changed by `diff` (RFC 1624, eqn. 3).
#[inline(always)]
pub fn updated(check: [u8; 2], diff: u32) -> [u8; 2] {
    let mut sum = (!u16::from_ne_bytes(check)) as u64 + diff as u64;
    sum = (sum & 0xFFFF) + (sum >> 16);
    sum = (sum & 0xFFFF) + (sum >> 16);
    sum = (sum & 0xFFFF) + (sum >> 16);
    (!(sum as u16)).to_ne_bytes()
}
