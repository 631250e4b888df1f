//! The Internet checksum (RFC 1071) over headers assembled in the per-CPU scratch block.

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
