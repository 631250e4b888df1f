//! Copies, fills and compares as plain loads and stores. LLVM lowers some assignments of byte arrays to
//! calls of `memmove` or `memset`, each a BPF subprogram: a call, a byte loop and a return.
//! On machines with the SRSO "safe RET" mitigation every return costs tens of nanoseconds, so
//! the per-packet paths copy addresses and MACs through these instead.

use dataplane_common::overlay::Addr;

/// Copies `N` bytes from `src` to `dst`; the ranges must not overlap.
///
/// # Safety
/// Both pointers must be valid for `N` bytes.
#[inline(always)]
pub unsafe fn copy_bytes<const N: usize>(dst: *mut u8, src: *const u8) {
    // Volatile, so LLVM neither merges the bytes back into the library call nor loads them all
    // before storing any (which would spill registers to the stack).
    let mut i = 0;
    while i < N {
        // SAFETY: the caller's contract; `i < N`.
        unsafe { core::ptr::write_volatile(dst.add(i), core::ptr::read_volatile(src.add(i))) };
        i += 1;
    }
}

/// `*dst = *src` for a 16-byte address.
#[inline(always)]
pub fn copy_addr(dst: &mut Addr, src: &Addr) {
    // SAFETY: two distinct 16-byte arrays (a `&mut` cannot alias a `&`).
    unsafe { copy_bytes::<16>(dst.as_mut_ptr(), src.as_ptr()) }
}

/// `*dst = ipv4_mapped(v4)`, byte by byte (no temporary on the stack).
#[inline(always)]
pub fn set_ipv4_mapped(dst: &mut Addr, v4: [u8; 4]) {
    let at = dst.as_mut_ptr();
    let mut i = 0;
    while i < 16 {
        let byte = match i {
            0..10 => 0,
            10..12 => 0xff,
            _ => v4[i - 12],
        };
        // SAFETY: `i < 16`; volatile as in `copy_bytes`.
        unsafe { core::ptr::write_volatile(at.add(i), byte) };
        i += 1;
    }
}

/// Fills `dst` with zeros, four bytes at a time.
#[inline(always)]
pub fn zero<T>(dst: &mut T) {
    const { assert!(core::mem::align_of::<T>() >= 4 && core::mem::size_of::<T>().is_multiple_of(4)) };
    let words = (dst as *mut T).cast::<u32>();
    let mut i = 0;
    while i < core::mem::size_of::<T>() / 4 {
        // SAFETY: within `dst`, aligned (asserted above); volatile so LLVM keeps the stores.
        unsafe { core::ptr::write_volatile(words.add(i), 0) };
        i += 1;
    }
}

/// Whether the `N` bytes at `at` equal `expected` (`N` even), compared as 16-bit words into
/// one accumulator: no copy of either side on the stack.
///
/// # Safety
/// `at` must be valid for reading `N` bytes. Both sides sit at even offsets (MACs, addresses
/// in the headers and in `PodPort`); the JIT's loads do not need more.
#[inline(always)]
pub unsafe fn same_bytes<const N: usize>(at: *const u8, expected: &[u8; N]) -> bool {
    const { assert!(N.is_multiple_of(2)) };
    let (at, expected) = (at.cast::<u16>(), expected.as_ptr().cast::<u16>());
    let mut differ = 0u16;
    let mut i = 0;
    while i < N / 2 {
        // SAFETY: the caller's contract; `i < N / 2` words. Volatile, so each word is compared
        // as it is read instead of all being loaded (and spilled) first.
        differ |= unsafe {
            core::ptr::read_volatile(at.add(i)) ^ core::ptr::read_volatile(expected.add(i))
        };
        i += 1;
    }
    differ == 0
}
