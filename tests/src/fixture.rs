//! The real kernel programs loaded under a private pin root, for BPF_PROG_TEST_RUN tests and
//! benchmarks. Pins are removed when the fixture drops.

use std::ops::{Deref, DerefMut};

use dataplane_user::{Dataplane, Pins, stats::Counters};

pub struct Fixture {
    dataplane: Option<Dataplane>,
    pins: Pins,
}

impl Fixture {
    /// Loads every program (through the verifier) with fresh, empty maps.
    pub fn load() -> anyhow::Result<Self> {
        let pins = Pins::new(format!("/sys/fs/bpf/{}", crate::unique_name("fx")));
        let dataplane = match Dataplane::load(&pins) {
            Ok(dataplane) => dataplane,
            Err(error) => {
                // A failed load (a verifier rejection, say) must not leave its fresh pins.
                let _ = pins.remove_all();
                return Err(error.into());
            }
        };
        Ok(Self {
            dataplane: Some(dataplane),
            pins,
        })
    }

    /// The counters as the maps hold them now.
    pub fn counters(&self) -> Counters {
        dataplane_user::stats::read(&self.pins).expect("reading counters from the fixture's pins")
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
