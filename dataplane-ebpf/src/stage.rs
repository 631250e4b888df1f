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
