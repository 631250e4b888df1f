//! The test bed's own kernel programs (`dataplane_common::testbed`): the empty programs every
//! benchmark is measured against, the redirect floor of the service packet-rate benchmark and
//! the fabric's XDP switch. A separate object from the dataplane's, loaded here only.

use aya::{
    Ebpf,
    maps::{Map, MapError},
    programs::{Program, SchedClassifier, Xdp},
};
use dataplane_common::testbed::TESTBED_PROGRAMS;
use dataplane_user::{
    AgentError,
    kernel::{
        ebpf::testbed_object,
        testrun::{RunOutcome, run_tc_program, run_xdp_program},
    },
};

pub struct Testbed {
    ebpf: Ebpf,
}

impl Testbed {
    /// Loads every program of the test bed's object (through the verifier), with fresh maps
    /// that live as long as this value (or an attachment of one of its programs).
    pub fn load() -> Result<Self, AgentError> {
        let mut ebpf = Ebpf::load(testbed_object()).map_err(AgentError::Load)?;
        for &name in TESTBED_PROGRAMS {
            let loaded = match ebpf.program_mut(name) {
                Some(Program::Xdp(program)) => program.load(),
                Some(Program::SchedClassifier(program)) => program.load(),
                _ => return Err(AgentError::MissingProgram { name }),
            };
            loaded.map_err(|source| AgentError::Program {
                name,
                action: "load (verifier)",
                source,
            })?;
        }
        Ok(Self { ebpf })
    }

    /// Whether `name` is one of the test bed's programs (rather than the dataplane's).
    pub fn has_program(name: &str) -> bool {
        TESTBED_PROGRAMS.contains(&name)
    }

    pub fn xdp(&mut self, name: &'static str) -> Result<&mut Xdp, AgentError> {
        self.ebpf
            .program_mut(name)
            .and_then(|p| p.try_into().ok())
            .ok_or(AgentError::MissingProgram { name })
    }

    pub fn classifier(&mut self, name: &'static str) -> Result<&mut SchedClassifier, AgentError> {
        self.ebpf
            .program_mut(name)
            .and_then(|p| p.try_into().ok())
            .ok_or(AgentError::MissingProgram { name })
    }

    /// The map `name` as `T` (an `Array`, a `DevMapHash`, ...).
    pub fn typed_map<'a, T>(&'a mut self, name: &'static str) -> Result<T, AgentError>
    where
        T: TryFrom<&'a mut Map, Error = MapError>,
    {
        let map = self
            .ebpf
            .map_mut(name)
            .ok_or(AgentError::MissingMap { name })?;
        T::try_from(map).map_err(|source| AgentError::Map {
            name: name.into(),
            action: "open",
            source,
        })
    }

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
}
