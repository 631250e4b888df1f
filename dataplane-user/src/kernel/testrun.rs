//! Running the loaded programs on packet bytes with BPF_PROG_TEST_RUN: the packet tests, the
//! benchmarks and (later) `dataplane trace` all go through here, against the real verified code.

use std::time::Duration;

use aya::{
    TestRun as _, TestRunOptions,
    programs::{SchedClassifier, Xdp},
};

use crate::{error::AgentError, kernel::loader::Dataplane};

/// Headroom for programs that grow the packet (encapsulation adds up to ~100 bytes).
const OUTPUT_HEADROOM: usize = 256;

/// What one program run returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunOutcome {
    /// XDP action or tc verdict as the program returned it.
    pub action: u32,
    /// The packet after the program (as it would continue on its way).
    pub output: Vec<u8>,
    /// Mean time per run as measured by the kernel.
    pub duration: Duration,
}

impl Dataplane {
    /// Runs XDP program `name` `repeat` times on `input`.
    pub fn run_xdp(
        &mut self,
        name: &'static str,
        input: &[u8],
        repeat: u32,
    ) -> Result<RunOutcome, AgentError> {
        run_xdp_program(self.xdp(name)?, name, input, repeat)
    }

    /// Runs tc program `name` `repeat` times on `input` (an Ethernet frame).
    pub fn run_tc(
        &mut self,
        name: &'static str,
        input: &[u8],
        repeat: u32,
    ) -> Result<RunOutcome, AgentError> {
        run_tc_program(self.classifier(name)?, name, input, repeat)
    }

    /// [`Dataplane::run_tc`] on the device `ifindex` of the calling thread's namespace (the
    /// kernel runs test frames on the loopback device otherwise), as if `input` arrived there.
    pub fn run_tc_on(
        &mut self,
        name: &'static str,
        input: &[u8],
        repeat: u32,
        ifindex: u32,
    ) -> Result<RunOutcome, AgentError> {
        let program = self.classifier(name)?;
        let context = skb_context(ifindex);
        run(name, input, repeat, |opts| {
            program.test_run(TestRunOptions {
                ctx_in: Some(&context),
                ..opts
            })
        })
    }
}

/// Runs the loaded XDP program `program` (`name` in errors) `repeat` times on `input`: for
/// programs of another object than the dataplane's (the test bed's).
pub fn run_xdp_program(
    program: &mut Xdp,
    name: &'static str,
    input: &[u8],
    repeat: u32,
) -> Result<RunOutcome, AgentError> {
    run(name, input, repeat, |opts| program.test_run(opts))
}

/// [`run_xdp_program`] for a loaded tc program.
pub fn run_tc_program(
    program: &mut SchedClassifier,
    name: &'static str,
    input: &[u8],
    repeat: u32,
) -> Result<RunOutcome, AgentError> {
    run(name, input, repeat, |opts| program.test_run(opts))
}

/// The start of a `struct __sk_buff` for BPF_PROG_TEST_RUN: zero (what the kernel requires of
/// the fields a test may not set) but `ifindex`, the device the frame is run on. The kernel
/// zero-fills the rest.
fn skb_context(ifindex: u32) -> [u8; SKB_IFINDEX_OFFSET + 4] {
    let mut context = [0u8; SKB_IFINDEX_OFFSET + 4];
    context[SKB_IFINDEX_OFFSET..].copy_from_slice(&ifindex.to_ne_bytes());
    context
}

/// Offset of `ifindex` in `struct __sk_buff` (uapi/linux/bpf.h: ten u32 fields before it).
const SKB_IFINDEX_OFFSET: usize = 40;

fn run(
    name: &'static str,
    input: &[u8],
    repeat: u32,
    test_run: impl FnOnce(TestRunOptions<'_>) -> Result<aya::TestRunResult, aya::programs::ProgramError>,
) -> Result<RunOutcome, AgentError> {
    let mut output = vec![0u8; input.len() + OUTPUT_HEADROOM];
    let result = test_run(TestRunOptions {
        data_in: Some(input),
        data_out: Some(&mut output),
        repeat,
        ..TestRunOptions::default()
    })
    .map_err(|source| AgentError::Program {
        name,
        action: "test run",
        source,
    })?;
    output.truncate(result.data_size_out as usize);
    Ok(RunOutcome {
        action: result.return_value,
        output,
        duration: result.duration,
    })
}
