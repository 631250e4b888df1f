//! SCTP's CRC32c (RFC 9260, appendix A) kept right across a port rewrite without reading the
//! packet. The CRC is linear over GF(2): changing some bytes changes it by the CRC, from a zero
//! register, of the XOR difference followed by as many zero bytes as the packet has after it.
//! For a difference in the first four bytes of an `n`-byte packet that is the difference times
//! x^(8n) modulo the polynomial. Multiplying by x^(8n) is done one bit of `n` at a time, each
//! step four lookups in a precomputed table (the table of the bit's power, or of x^0 when the
//! bit is clear), so the cost is the same for every length and there is no branch and no
//! sign-mask arithmetic for the BPF verifier to split on.

/// CRC32c's polynomial, bit-reflected as SCTP computes it.
const POLY: u32 = 0x82F6_3B78;

/// x^0 in the reflected representation (bit 31 is the coefficient of x^0).
const ONE: u32 = 1 << 31;

/// Bits of a length (SCTP packets are at most 65,535 bytes).
const LENGTH_BITS: usize = 16;

/// `STEPS[k][bit][j][v]`: the byte value `v` at byte `j` of a register, times x^(8 * 2^k)
/// when `bit` is 1, as is when 0.
type Steps = [[[[u32; 256]; 4]; 2]; LENGTH_BITS];

/// The tables of [`port_rewrite_delta`], built at compile time.
pub static STEPS: Steps = steps();

/// `a * b` modulo the polynomial, both reflected (compile time only).
const fn multiply(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut i = 0;
    while i < 32 {
        if a & (ONE >> i) != 0 {
            product ^= b;
        }
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
        i += 1;
    }
    product
}

const fn steps() -> Steps {
    let mut table = [[[[0; 256]; 4]; 2]; LENGTH_BITS];
    // x^8, then squared for each further bit of the length.
    let mut power = ONE >> 8;
    let mut k = 0;
    while k < LENGTH_BITS {
        let mut j = 0;
        while j < 4 {
            let mut v = 0;
            while v < 256 {
                let register = (v as u32) << (8 * j);
                table[k][0][j][v] = register;
                table[k][1][j][v] = multiply(power, register);
                v += 1;
            }
            j += 1;
        }
        power = multiply(power, power);
        k += 1;
    }
    table
}

/// What the CRC32c of an SCTP packet of `len` bytes (common header included) changes by when
/// its first four bytes (the ports) change by XOR `delta`, in the byte order of the checksum
/// field: XOR it into the field.
#[inline(always)]
pub fn port_rewrite_delta(delta: [u8; 4], len: u16) -> [u8; 4] {
    let mut register = u32::from_le_bytes(delta);
    let mut k = 0;
    while k < LENGTH_BITS {
        let step = &STEPS[k][((len >> k) & 1) as usize];
        register = step[0][(register & 0xFF) as usize]
            ^ step[1][((register >> 8) & 0xFF) as usize]
            ^ step[2][((register >> 16) & 0xFF) as usize]
            ^ step[3][(register >> 24) as usize];
        k += 1;
    }
    register.to_le_bytes()
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;

    /// CRC32c bit by bit, as RFC 9260 defines it (reflected, inverted in and out).
    fn crc32c(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &byte in bytes {
            crc ^= u32::from(byte);
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ POLY
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    #[test]
    fn reference_crc_matches_the_standard_check_value() {
        // The catalogued check value of CRC-32C over "123456789".
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn delta_turns_the_old_checksum_into_the_new_one_at_every_length() {
        for len in [12usize, 13, 16, 28, 255, 256, 257, 1400, 4000, 9000, 65_535] {
            let mut packet: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            packet[8..12].fill(0);
            let old = crc32c(&packet);
            for (at, new) in [(0usize, [0x1f, 0x90]), (2, [0x00, 0x50]), (0, [0xff, 0xff])] {
                let mut changed = packet.clone();
                let mut delta = [0u8; 4];
                for i in 0..2 {
                    delta[at + i] = changed[at + i] ^ new[i];
                    changed[at + i] = new[i];
                }
                let field = port_rewrite_delta(delta, len as u16);
                let patched = u32::from_le_bytes(
                    old.to_le_bytes()
                        .iter()
                        .zip(field)
                        .map(|(a, b)| a ^ b)
                        .collect::<Vec<_>>()
                        .try_into()
                        .unwrap(),
                );
                assert_eq!(patched, crc32c(&changed), "len {len}, port at {at}");
            }
        }
    }
}
