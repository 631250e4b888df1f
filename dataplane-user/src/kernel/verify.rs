//! How much room each kernel program leaves: every program of the embedded object is loaded
//! into this kernel (not attached) under a private pin root, and for each the report gives the
//! instructions the verifier walked (against its 1,000,000 budget), the deepest stack of its
//! BPF-to-BPF call chain (against the 512 bytes the kernel allows), and how many tail-call
//! stages a packet can cross after it.
//!
//! The verifier does not hand back the stack depths it computed when a load succeeds, so they
//! are computed here from the object the way the verifier does: each function's frame is the
//! deepest stack slot it addresses through r10, rounded up to 16 bytes (the JIT's granularity),
//! and a program's stack is the deepest sum of frames along any chain of calls from it.

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
};

use aya::programs::Program;
use dataplane_common::maps::{ALL_PROGRAMS, TAIL_STAGES};
use object::{Object as _, ObjectSection as _, ObjectSymbol as _, RelocationTarget};
use serde::Serialize;

use crate::{error::AgentError, kernel::loader::Dataplane, kernel::pins::Pins};

/// Instructions the kernel's verifier walks at most per program (BPF_COMPLEXITY_LIMIT_INSNS).
pub const VERIFIER_BUDGET: u32 = 1_000_000;
/// Stack the kernel allows a program's deepest call chain (MAX_BPF_STACK).
pub const STACK_LIMIT: u32 = 512;

/// What one program costs the verifier and the stack.
#[derive(Debug, Clone, Serialize)]
pub struct ProgramBudget {
    pub name: String,
    /// Instructions the verifier walked to accept the program.
    pub verified_instructions: u32,
    /// `verified_instructions` as a share of [`VERIFIER_BUDGET`], in percent.
    pub budget_percent: f64,
    /// Bytes of stack of the deepest call chain (frames rounded as the kernel rounds them).
    pub stack_bytes: u32,
    /// The functions of that chain, outermost first, with their frames.
    pub stack_chain: Vec<Frame>,
    /// Tail-call stages a packet can cross after this program (0: it hands on to none).
    pub tail_stages: u32,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Frame {
    pub function: String,
    pub bytes: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("loading the programs into this kernel: {0}")]
    Load(#[from] AgentError),
    #[error("reading program {name}'s kernel info: {source}")]
    Info {
        name: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("the kernel does not report verified instructions for {name} (needs Linux 5.16+)")]
    NoCount { name: &'static str },
    #[error("reading the eBPF object: {0}")]
    Object(#[from] object::Error),
    #[error("program {name} is not a function of the eBPF object")]
    MissingFunction { name: String },
}

/// Loads every program under a private pin root (removed again) and measures each.
pub fn measure() -> Result<Vec<ProgramBudget>, VerifyError> {
    let stacks = stack_chains(crate::kernel::ebpf::object())?;
    let pins = Pins::new(PathBuf::from(format!(
        "/sys/fs/bpf/dataplane-verify-{}",
        std::process::id()
    )));
    let counts = verified_counts(&pins);
    if let Err(error) = pins.remove_all() {
        tracing::warn!(%error, "removing the verify pins");
    }
    let counts = counts?;
    ALL_PROGRAMS
        .iter()
        .map(|&name| {
            let chain = stacks
                .get(name)
                .cloned()
                .ok_or_else(|| VerifyError::MissingFunction { name: name.into() })?;
            let verified = counts[name];
            Ok(ProgramBudget {
                name: name.to_owned(),
                verified_instructions: verified,
                budget_percent: f64::from(verified) * 100.0 / f64::from(VERIFIER_BUDGET),
                stack_bytes: chain.iter().map(|f| f.bytes).sum(),
                stack_chain: chain,
                tail_stages: tail_stages_after(name),
            })
        })
        .collect()
}

fn verified_counts(pins: &Pins) -> Result<HashMap<&'static str, u32>, VerifyError> {
    let dataplane = Dataplane::load(pins)?;
    let mut counts = HashMap::new();
    for &name in ALL_PROGRAMS {
        let info = match dataplane.ebpf().program(name) {
            Some(Program::Xdp(p)) => p.info(),
            Some(Program::SchedClassifier(p)) => p.info(),
            Some(Program::CgroupSockAddr(p)) => p.info(),
            _ => return Err(AgentError::MissingProgram { name }.into()),
        }
        .map_err(|source| VerifyError::Info { name, source })?;
        let count = info
            .verified_instruction_count()
            .ok_or(VerifyError::NoCount { name })?;
        counts.insert(name, count);
    }
    Ok(counts)
}

/// The longest run of tail calls a packet can take from `program` through [`TAIL_STAGES`].
pub fn tail_stages_after(program: &str) -> u32 {
    fn walk(program: &str, depth: u32) -> u32 {
        // The stage table is acyclic; the bound only guards against a mistake in it.
        if depth > 32 {
            return depth;
        }
        TAIL_STAGES
            .iter()
            .filter(|stage| stage.reached_from.contains(&program))
            .map(|stage| 1 + walk(stage.program, depth + 1))
            .max()
            .unwrap_or(0)
    }
    walk(program, 0)
}

/// One function of the object: where its code lies and what it calls.
struct Function {
    name: String,
    frame: u32,
    calls: Vec<(usize, u64)>,
}

const INSN_LEN: usize = 8;
const OP_LD_IMM64: u8 = 0x18;
const OP_CALL: u8 = 0x85;
const OP_MOV64_REG: u8 = 0xbf;
const OP_ADD64_IMM: u8 = 0x07;
const PSEUDO_CALL: u8 = 1;
const FRAME_POINTER: u8 = 10;

/// For every function symbol of the object: its deepest call chain, outermost first.
pub fn stack_chains(elf: &[u8]) -> Result<BTreeMap<String, Vec<Frame>>, VerifyError> {
    let file = object::File::parse(elf)?;
    let mut functions: BTreeMap<(usize, u64), Function> = BTreeMap::new();
    for symbol in file.symbols() {
        if symbol.kind() != object::SymbolKind::Text || symbol.size() == 0 {
            continue;
        }
        let Some(index) = symbol.section_index() else {
            continue;
        };
        let section = file.section_by_index(index)?;
        let data = section.data()?;
        let start = symbol.address() as usize;
        let end = (start + symbol.size() as usize).min(data.len());
        let relocations: HashMap<u64, (usize, i64)> = section
            .relocations()
            .filter_map(|(offset, relocation)| match relocation.target() {
                RelocationTarget::Symbol(target) => {
                    let target = file.symbol_by_index(target).ok()?;
                    Some((offset, (target.section_index()?.0, target.address() as i64)))
                }
                _ => None,
            })
            .collect();
        let code = data.get(start..end).unwrap_or_default();
        let (frame, calls) = scan(code, start as u64, index.0, &relocations);
        functions.insert(
            (index.0, symbol.address()),
            Function {
                name: symbol.name()?.to_owned(),
                frame: round_frame(frame),
                calls,
            },
        );
    }
    let mut chains = BTreeMap::new();
    let mut memo = HashMap::new();
    for key in functions.keys() {
        let chain = deepest(*key, &functions, &mut memo, 0);
        chains.insert(functions[key].name.clone(), chain);
    }
    Ok(chains)
}

/// The deepest stack slot a function's code addresses through the frame pointer, and the
/// (section, address) of the functions it calls.
fn scan(
    code: &[u8],
    base: u64,
    section: usize,
    relocations: &HashMap<u64, (usize, i64)>,
) -> (u32, Vec<(usize, u64)>) {
    let mut deepest = 0u32;
    let mut calls = Vec::new();
    // Registers holding r10 plus a known offset (pointers to stack slots).
    let mut frame_pointers = [None::<i64>; 11];
    let mut at = 0;
    while at + INSN_LEN <= code.len() {
        let insn = &code[at..at + INSN_LEN];
        let (op, dst, src) = (insn[0], insn[1] & 0x0f, insn[1] >> 4);
        let off = i64::from(i16::from_le_bytes([insn[2], insn[3]]));
        let imm = i64::from(i32::from_le_bytes([insn[4], insn[5], insn[6], insn[7]]));
        let class = op & 0x07;
        // Loads (LDX) address through src, stores (ST, STX) through dst.
        let base_reg = match class {
            0x01 => Some(src),
            0x02 | 0x03 => Some(dst),
            _ => None,
        };
        if let Some(reg) = base_reg {
            let slot = if reg == FRAME_POINTER {
                Some(off)
            } else {
                frame_pointers
                    .get(reg as usize)
                    .copied()
                    .flatten()
                    .map(|p| p + off)
            };
            if let Some(slot) = slot.filter(|s| *s < 0) {
                deepest = deepest.max((-slot) as u32);
            }
        }
        if op == OP_CALL && src == PSEUDO_CALL {
            let pc = base + at as u64;
            let target = match relocations.get(&pc) {
                Some(&(target_section, value)) => {
                    (target_section, (value + (imm + 1) * INSN_LEN as i64) as u64)
                }
                None => (section, (pc as i64 + (imm + 1) * INSN_LEN as i64) as u64),
            };
            calls.push(target);
        }
        // Track which registers point into the frame; any other write forgets.
        let writes_dst = matches!(class, 0x00 | 0x01 | 0x04 | 0x07);
        if op == OP_MOV64_REG && src == FRAME_POINTER {
            frame_pointers[dst as usize] = Some(0);
        } else if op == OP_ADD64_IMM && dst < 11 && frame_pointers[dst as usize].is_some() {
            let moved = frame_pointers[dst as usize].map(|p| p + imm);
            if let Some(p) = moved.filter(|p| *p < 0) {
                deepest = deepest.max((-p) as u32);
            }
            frame_pointers[dst as usize] = moved;
        } else if writes_dst && dst < 11 {
            frame_pointers[dst as usize] = None;
        }
        if op == OP_CALL {
            // Calls clobber r0-r5.
            for reg in frame_pointers.iter_mut().take(6) {
                *reg = None;
            }
        }
        at += if op == OP_LD_IMM64 { 2 } else { 1 } * INSN_LEN;
    }
    (deepest, calls)
}

/// A frame as the verifier counts it with the JIT on: rounded up to 16 bytes.
fn round_frame(bytes: u32) -> u32 {
    bytes.div_ceil(16) * 16
}

fn deepest(
    key: (usize, u64),
    functions: &BTreeMap<(usize, u64), Function>,
    memo: &mut HashMap<(usize, u64), Vec<Frame>>,
    depth: u32,
) -> Vec<Frame> {
    if let Some(chain) = memo.get(&key) {
        return chain.clone();
    }
    let Some(function) = functions.get(&key) else {
        return Vec::new();
    };
    // BPF forbids recursion; the bound only guards against a misread call.
    let below = if depth > 8 {
        Vec::new()
    } else {
        function
            .calls
            .iter()
            .map(|callee| deepest(*callee, functions, memo, depth + 1))
            .max_by_key(|chain| chain.iter().map(|f| f.bytes).sum::<u32>())
            .unwrap_or_default()
    };
    let mut chain = vec![Frame {
        function: demangle(&function.name),
        bytes: function.frame,
    }];
    chain.extend(below);
    memo.insert(key, chain.clone());
    chain
}

/// `_RNvNtCs8jKqfOUGQks_14dataplane_ebpf2lb8from_pod` as `lb::from_pod` (Rust v0 mangling:
/// the path's identifiers after the crate's); other names as they are.
fn demangle(name: &str) -> String {
    let Some(rest) = name.strip_prefix("_R") else {
        return name.to_owned();
    };
    let Some(root) = rest.find('C') else {
        return name.to_owned();
    };
    let bytes = rest.as_bytes();
    let mut i = root + 1;
    let mut segments = Vec::new();
    while i < bytes.len() {
        match bytes[i] {
            // A disambiguator: `s`, base-62 digits, `_`.
            b's' => i += rest[i..].find('_').map_or(bytes.len(), |at| at + 1),
            b'0'..=b'9' => {
                let start = i;
                while i < bytes.len() && bytes[i].is_ascii_digit() {
                    i += 1;
                }
                let len: usize = rest[start..i].parse().unwrap_or(usize::MAX);
                let Some(ident) = rest.get(i..i.saturating_add(len)) else {
                    break;
                };
                segments.push(ident);
                i += len;
            }
            _ => i += 1,
        }
    }
    // The first identifier is the crate's.
    match segments.get(1..) {
        Some(path) if !path.is_empty() => path.join("::"),
        _ => name.to_owned(),
    }
}

/// The report as a table.
pub fn render(budgets: &[ProgramBudget]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<24} {:>12} {:>7} {:>6} {:>6}  deepest chain",
        "program", "verified", "budget", "stack", "tails"
    );
    for b in budgets {
        let chain: Vec<String> = b
            .stack_chain
            .iter()
            .map(|f| format!("{}({})", f.function, f.bytes))
            .collect();
        let _ = writeln!(
            out,
            "{:<24} {:>12} {:>6.1}% {:>6} {:>6}  {}",
            b.name,
            b.verified_instructions,
            b.budget_percent,
            b.stack_bytes,
            b.tail_stages,
            chain.join(" > ")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn insn(op: u8, dst: u8, src: u8, off: i16, imm: i32) -> [u8; 8] {
        let o = off.to_le_bytes();
        let i = imm.to_le_bytes();
        [op, dst | src << 4, o[0], o[1], i[0], i[1], i[2], i[3]]
    }

    #[test]
    fn frames_count_direct_and_derived_stack_slots_and_round_to_sixteen() {
        let code: Vec<u8> = [
            insn(0x7b, 10, 1, -24, 0), // *(u64 *)(r10 - 24) = r1
            insn(0xbf, 2, 10, 0, 0),   // r2 = r10
            insn(0x07, 2, 0, 0, -40),  // r2 += -40
            insn(0x79, 3, 2, 8, 0),    // r3 = *(u64 *)(r2 + 8)
            insn(0x85, 0, 1, 0, 1),    // call pc+1
            insn(0x95, 0, 0, 0, 0),    // exit
        ]
        .concat();
        let (deepest, calls) = scan(&code, 0, 3, &HashMap::new());
        assert_eq!(deepest, 40);
        assert_eq!(calls, vec![(3, 6 * 8)]);
        assert_eq!(round_frame(40), 48);
        assert_eq!(round_frame(0), 0);
    }

    #[test]
    fn rust_v0_names_read_as_paths() {
        assert_eq!(
            demangle("_RNvNtCs8jKqfOUGQks_14dataplane_ebpf2lb8from_pod"),
            "lb::from_pod"
        );
        assert_eq!(demangle("tc_from_pod"), "tc_from_pod");
    }
}
