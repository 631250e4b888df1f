//! The real kernel programs loaded under a private pin root, for BPF_PROG_TEST_RUN tests and
//! benchmarks. Pins are removed when the fixture drops.

use std::ops::{Deref, DerefMut};

use std::net::IpAddr;

use aya::maps::{Array, HashMap, MapData};
use dataplane_common::{
    maps::{OVERLAY_CONFIG, POD_PORTS},
    overlay::OverlayConfig,
    port::PodPort,
};
use dataplane_user::{
    AgentError, Dataplane, Pins,
    kernel::{capacity::Capacities, stats::Counters, testrun::RunOutcome},
    model::LocalPodView,
};

use crate::{
    packets::{POD_MAC, SRC_V4, SRC_V6},
    testbed::Testbed,
};

/// The device BPF_PROG_TEST_RUN runs tc programs on (loopback): port security looks up the
/// record of the pod a test frame comes from, or goes to, under its ifindex.
pub const TEST_RUN_IFINDEX: u32 = 1;

pub struct Fixture {
    dataplane: Option<Dataplane>,
    pins: Pins,
    /// The test bed's programs, loaded at the first run of one (`run_xdp`, `run_tc`).
    testbed: Option<Testbed>,
}

impl Fixture {
    /// Loads every program (through the verifier) with fresh, empty maps.
    pub fn load() -> anyhow::Result<Self> {
        Self::load_with(&Capacities::default())
    }

    /// [`Fixture::load`] with the sized maps created at `capacities`.
    pub fn load_with(capacities: &Capacities) -> anyhow::Result<Self> {
        let pins = Pins::new(format!("/sys/fs/bpf/{}", crate::unique_name("fx")));
        let dataplane = match Dataplane::load_with(&pins, capacities) {
            Ok(dataplane) => dataplane,
            Err(error) => {
                // A failed load (a verifier rejection, say) must not leave its fresh pins.
                let _ = pins.remove_all();
                return Err(error.into());
            }
        };
        let mut fixture = Self {
            dataplane: Some(dataplane),
            pins,
            testbed: None,
        };
        fixture.port_as_test_pod()?;
        Ok(fixture)
    }

    /// Makes the test runs' device the veth of the pod with `mac` and `addresses`: the pod
    /// the next tc test frames come from (or, for `tc_to_pod`, go to).
    pub fn port_as(&mut self, mac: [u8; 6], addresses: &[IpAddr]) -> anyhow::Result<()> {
        let pod = LocalPodView {
            name: "test/sender".into(),
            addresses: addresses.to_vec(),
            pod_mac: mac,
            host_ifindex: TEST_RUN_IFINDEX,
            host_mac: [0; 6],
            takes_xdp: false,
        };
        let record = dataplane_user::port::compile(&[pod])[&TEST_RUN_IFINDEX];
        let mut ports: HashMap<&mut MapData, u32, PodPort> = self.typed_map(POD_PORTS)?;
        ports.insert(TEST_RUN_IFINDEX, record, 0)?;
        // The kernel's per-CPU copies of the old record are stale from here, as after a sync.
        let mut config: Array<&mut MapData, OverlayConfig> = self.typed_map(OVERLAY_CONFIG)?;
        let mut current = config.get(&0, 0)?;
        current.pods_epoch = current.pods_epoch.wrapping_add(1);
        config.set(0, current, 0)?;
        Ok(())
    }

    /// `OverlayConfig::pods_epoch` as the kernel holds it.
    pub fn pods_epoch(&mut self) -> anyhow::Result<u32> {
        let config: Array<&mut MapData, OverlayConfig> = self.typed_map(OVERLAY_CONFIG)?;
        Ok(config.get(&0, 0)?.pods_epoch)
    }

    /// [`Fixture::port_as`] the pod `frame` comes from: its source MAC and address.
    pub fn port_as_sender_of(&mut self, frame: &[u8]) -> anyhow::Result<()> {
        let (mac, address) = crate::packets::source_of(frame)?;
        self.port_as(mac, &[address])
    }

    /// [`Fixture::port_as`] the pod `frame` is delivered to: its destination MAC and address.
    pub fn port_as_receiver_of(&mut self, frame: &[u8]) -> anyhow::Result<()> {
        let (mac, address) = crate::packets::destination_of(frame)?;
        self.port_as(mac, &[address])
    }

    /// [`Fixture::port_as`] the pod the frames of `crate::packets` come from.
    pub fn port_as_test_pod(&mut self) -> anyhow::Result<()> {
        self.port_as(POD_MAC, &[IpAddr::from(SRC_V4), IpAddr::from(SRC_V6)])
    }

    /// Runs XDP program `name` `repeat` times on `input`: the dataplane's program, or the test
    /// bed's when `name` is one of those (the benchmarks time a baseline beside each path).
    pub fn run_xdp(
        &mut self,
        name: &'static str,
        input: &[u8],
        repeat: u32,
    ) -> Result<RunOutcome, AgentError> {
        if Testbed::has_program(name) {
            return self.testbed()?.run_xdp(name, input, repeat);
        }
        Dataplane::run_xdp(self, name, input, repeat)
    }

    /// [`Fixture::run_xdp`] for a tc program.
    pub fn run_tc(
        &mut self,
        name: &'static str,
        input: &[u8],
        repeat: u32,
    ) -> Result<RunOutcome, AgentError> {
        if Testbed::has_program(name) {
            return self.testbed()?.run_tc(name, input, repeat);
        }
        Dataplane::run_tc(self, name, input, repeat)
    }

    /// The test bed's programs, loaded at the first call.
    fn testbed(&mut self) -> Result<&mut Testbed, AgentError> {
        if self.testbed.is_none() {
            self.testbed = Some(Testbed::load()?);
        }
        Ok(self.testbed.as_mut().expect("loaded just above"))
    }

    /// The counters as the maps hold them now.
    pub fn counters(&self) -> Counters {
        dataplane_user::kernel::stats::read(&self.pins)
            .expect("reading counters from the fixture's pins")
    }
}

impl Deref for Fixture {
    type Target = Dataplane;
    fn deref(&self) -> &Dataplane {
        self.dataplane.as_ref().expect("fixture is loaded")
    }
}

impl DerefMut for Fixture {
    fn deref_mut(&mut self) -> &mut Dataplane {
        self.dataplane.as_mut().expect("fixture is loaded")
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        drop(self.dataplane.take());
        if let Err(e) = self.pins.remove_all() {
            eprintln!("fixture cleanup: {e}");
        }
    }
}

/// Keeps the calling thread on the CPU it runs on: BPF_PROG_TEST_RUN runs the program there,
/// and a test of per-CPU state (the caches) must stay on the same CPU's.
pub fn pin_to_one_cpu() {
    // SAFETY: plain libc calls on a zeroed cpu_set_t owned here.
    unsafe {
        let cpu = libc::sched_getcpu();
        assert!(cpu >= 0, "sched_getcpu");
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        let result = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        assert_eq!(result, 0, "sched_setaffinity");
    }
}
