//! The Internet checksum (RFC 1071) over headers assembled in the per-CPU scratch block, and
//! the IPv4 header every packet the dataplane builds (Geneve, ICMP errors, resets) starts with.

use dataplane_common::overlay::Addr;

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

/// Folds a sum to 16 bits and complements it: the checksum field's value (the kernel's
/// `csum_fold`).
#[inline(always)]
pub fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xFFFF) + (sum >> 16);
    sum = (sum & 0xFFFF) + (sum >> 16);
    !(sum as u16)
}

/// The kernel's `csum_add`: a 32-bit one's-complement addition (end-around carry).
#[inline(always)]
pub const fn csum_add(a: u32, b: u32) -> u32 {
    let (sum, carry) = a.overflowing_add(b);
    sum.wrapping_add(carry as u32)
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
    // Field by field: a 20-byte array built first would hold every byte in a register at
    // once and spill most of them to the stack.
    let len = total_len.to_be_bytes();
    block[14] = 0x45;
    block[15] = 0;
    block[16] = len[0];
    block[17] = len[1];
    block[18] = 0;
    block[19] = 0;
    block[20] = if dont_fragment { 0x40 } else { 0 };
    block[21] = 0;
    block[22] = 64;
    block[23] = protocol;
    block[24] = 0;
    block[25] = 0;
    block[26..30].copy_from_slice(src);
    block[30..34].copy_from_slice(dst);
    store_checksum(block, 24, sum_words(block, 14, 20, 0));
}

/// The one's-complement difference from `from[skip..]` to `to[skip..]` (`N` even; for
/// 16-byte addresses `skip` is 12 for IPv4), added to `seed`: what `bpf_csum_diff` returns,
/// computed inline (a helper call costs more than these few additions). Words are taken in
/// memory order, as the kernel's checksum helpers and [`updated`] take them.
#[inline(always)]
pub fn csum_diff<const N: usize>(from: &[u8; N], to: &[u8; N], skip: usize, seed: u32) -> u32 {
    let mut sum = seed as u64;
    let mut i = 0;
    while 2 * i + 1 < N {
        if 2 * i >= skip {
            let old = u16::from_ne_bytes([from[2 * i], from[2 * i + 1]]);
            let new = u16::from_ne_bytes([to[2 * i], to[2 * i + 1]]);
            sum += (!old) as u64 + new as u64;
        }
        i += 1;
    }
    fold32(sum)
}

/// [`csum_diff`] of two 16-byte addresses (the last four bytes only for IPv4), read as 32-bit
/// words: one load per word where the byte-wise sum loads every byte, and volatile so the
/// words are summed as they are read (LLVM would otherwise load them all first and spill).
/// A one's-complement sum of 32-bit words folds to the same 16-bit sum as one of their
/// halves, in the same memory order.
///
/// # Safety
/// Both addresses must be 4-aligned (those of the per-CPU working sets and map values are).
#[inline(always)]
pub unsafe fn addr_diff(from: &Addr, to: &Addr, ipv4: bool, seed: u32) -> u32 {
    let (from, to) = (from.as_ptr().cast::<u32>(), to.as_ptr().cast::<u32>());
    let mut sum = seed as u64;
    let mut i = if ipv4 { 3 } else { 0 };
    while i < 4 {
        // SAFETY: word `i < 4` of a 16-byte, 4-aligned address (the caller's contract).
        let (old, new) = unsafe {
            (
                core::ptr::read_volatile(from.add(i)),
                core::ptr::read_volatile(to.add(i)),
            )
        };
        sum += (!old) as u64 + new as u64;
        i += 1;
    }
    fold32(sum)
}

/// Folds a 64-bit one's-complement sum to 32 bits (end-around carry).
#[inline(always)]
fn fold32(mut sum: u64) -> u32 {
    sum = (sum & 0xFFFF_FFFF) + (sum >> 32);
    sum = (sum & 0xFFFF_FFFF) + (sum >> 32);
    sum as u32
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
