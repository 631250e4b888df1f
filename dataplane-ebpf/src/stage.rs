//! The result of a stage compiled as a BPF subprogram (`#[inline(never)]`), as one fully
//! defined 64-bit integer. A Rust `Result`/`Option` returned from a subprogram can leave bits
//! of the return register undefined (LLVM treats unused payload bits as undef), and the
//! verifier refuses to read an undefined register. Inlined code keeps using `Result`.
//!
//! Layout: bits 0..32 a value (a tc verdict, a backend id), bits 32..40 a packet class or drop
//! reason code, bits 40..42 the kind (nothing done, a value, a drop).

use dataplane_common::{DropReason, PacketClass};

const KIND_SHIFT: u32 = 40;
const KIND_NONE: u64 = 0;
const KIND_VALUE: u64 = 1;
const KIND_DROP: u64 = 2;

#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Stage(u64);

impl Stage {
    /// Encodes what a stage did: nothing (`Ok(None)`), a value with the outcome to count, or a
    /// drop with its reason.
    #[inline(always)]
    pub fn new(result: Result<Option<(u32, PacketClass)>, DropReason>) -> Self {
        match result {
            Ok(None) => Self(KIND_NONE << KIND_SHIFT),
            Ok(Some((value, class))) => {
                Self(KIND_VALUE << KIND_SHIFT | (class as u64) << 32 | value as u64)
            }
            Err(reason) => Self(KIND_DROP << KIND_SHIFT | (reason as u64) << 32),
        }
    }

    /// A plain value (no outcome to count) or a drop.
    #[inline(always)]
    pub fn value(result: Result<u32, DropReason>) -> Self {
        Self::new(result.map(|v| Some((v, PacketClass::Total))))
    }

    /// Decodes what [`Stage::new`] encoded.
    #[inline(always)]
    pub fn result(self) -> Result<Option<(u32, PacketClass)>, DropReason> {
        let code = ((self.0 >> 32) & 0xff) as u32;
        match self.0 >> KIND_SHIFT {
            KIND_NONE => Ok(None),
            KIND_VALUE => Ok(Some((
                self.0 as u32,
                PacketClass::from_code(code).unwrap_or(PacketClass::Total),
            ))),
            _ => Err(DropReason::from_code(code).unwrap_or(DropReason::LbRewriteFailed)),
        }
    }

    /// Decodes what [`Stage::value`] encoded.
    #[inline(always)]
    pub fn into_value(self) -> Result<u32, DropReason> {
        self.result().map(|v| v.map_or(0, |(value, _)| value))
    }
}

/// A stage's value saying that the stage routed the packet out itself with tc verdict
/// `verdict`: the verdict plus one, so that 0 still says "not routed, go on".
#[inline(always)]
pub fn routed_out(verdict: u32) -> u32 {
    verdict + 1
}

/// The tc verdict in a value made by [`routed_out`]; `None` when the packet was not routed.
#[inline(always)]
pub fn routed_verdict(value: u32) -> Option<i32> {
    (value != 0).then(|| (value - 1) as i32)
}

/// The values of a reverse-NAT step: the packet untouched, translated, or translated and routed
/// out with a tc verdict (kept apart from the first two by two).
pub mod reverse_nat {
    /// Not a reply of a tracked flow: untouched.
    pub const UNTOUCHED: u32 = 0;
    /// Translated; the caller delivers it.
    pub const TRANSLATED: u32 = 1;

    /// Translated and routed out with tc verdict `verdict`.
    #[inline(always)]
    pub fn routed(verdict: u32) -> u32 {
        verdict + 2
    }

    /// The tc verdict of a value made by [`routed`] (a value above [`TRANSLATED`]).
    #[inline(always)]
    pub fn verdict_of(value: u32) -> u32 {
        value - 2
    }
}
