//! Loads the kernel programs with their maps pinned under the agent's pin root. Maps already
//! pinned there are adopted (counters and, later, connection state survive a restart) after the
//! layout version they were written under has been checked.

use std::{fs, io};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, MapData, ProgramArray},
    programs::{Program, ProgramError, SchedClassifier, Xdp},
};
use dataplane_common::lb::CLOCK_HZ_GLOBAL;
use dataplane_common::maps::{
    ALL_PROGRAMS, LAYOUT_VERSION, LB_BACKENDS, LB_MEMBERS, META, PROG_FROM_POD, PROG_TO_POD,
    PROG_UNDERLAY, PROG_UNDERLAY_TC, SOCK_LB_REV, TAIL_STAGES, TAILS, TailStage,
};

use crate::kernel::capacity::map_err;
use crate::{
    error::AgentError, kernel::capacity::Capacities, kernel::ebpf, kernel::pins::Pins,
    kernel::preflight,
};

/// Loads of one program tried before giving up on a verifier interrupted each time (twice
/// libbpf's default, with a growing pause between them).
const LOAD_ATTEMPTS: u32 = 10;

/// The loaded kernel programs and maps of one agent.
pub struct Dataplane {
    ebpf: Ebpf,
    pins: Pins,
    /// What the sized maps hold (as created, or as found pinned).
    capacities: Capacities,
    /// Maps this load created (none was pinned) that nothing has read back yet: they hold
    /// nothing, so the first read of each is answered without reading the kernel's map (at
    /// the first sync, reading the 262,144 empty slots of the backends array took 0.1 s).
    created_unread: std::collections::BTreeSet<&'static str>,
}

/// The maps whose first read [`Dataplane::first_read_of_created`] may spare: large ones the
/// first sync reads back whole.
const EMPTY_WHEN_CREATED: &[&str] = &[LB_BACKENDS, LB_MEMBERS];

/// The capacities the loaded maps give, each compared with what was asked: a map adopted from
/// the pins keeps the size it was created with, which the agent then works within.
fn found_capacities(ebpf: &Ebpf, wanted: &Capacities) -> Result<Capacities, AgentError> {
    let mut sizes = std::collections::BTreeMap::new();
    for (name, asked, flag) in wanted.map_sizes() {
        let map = ebpf.map(name).ok_or(AgentError::MissingMap { name })?;
        let data = match map {
            aya::maps::Map::HashMap(data)
            | aya::maps::Map::LruHashMap(data)
            | aya::maps::Map::LpmTrie(data)
            | aya::maps::Map::Array(data) => data,
            _ => return Err(AgentError::MissingMap { name }),
        };
        let size = data
            .info()
            .map_err(map_err(name, "read the size of"))?
            .max_entries();
        if size != asked {
            tracing::warn!(
                map = name,
                pinned = size,
                asked,
                flag,
                "map pinned with another size: kept (a new size applies to maps created anew, \
                 after `dataplane cleanup`)"
            );
        }
        sizes.insert(name, size);
    }
    Ok(Capacities::from_map_sizes(|name| sizes[name]))
}

impl Dataplane {
    /// Checks the environment, loads and verifies every program, and pins maps and programs
    /// under `pins`.
    pub fn load(pins: &Pins) -> Result<Self, AgentError> {
        Self::load_with(pins, &Capacities::default())
    }

    /// [`Dataplane::load`] with the sized maps created at `capacities` (maps already pinned
    /// keep their size: said in a warning when it differs).
    pub fn load_with(pins: &Pins, capacities: &Capacities) -> Result<Self, AgentError> {
        preflight::check_privileges()?;
        preflight::check_kernel()?;
        pins.prepare()?;
        check_layout_version(pins)?;

        // The programs' clock reads jiffies when they know the tick rate (see `now`).
        let tick_hz = preflight::kernel_tick_hz().unwrap_or(0);
        let mut loader = EbpfLoader::new();
        let socket_storage = pins.map(SOCK_LB_REV);
        drop_unless_socket_storage(&socket_storage)?;
        loader
            .default_map_pin_directory(pins.maps_dir())
            // A BTF map (socket storage must be) says nothing of pinning: named here.
            .map_pin_path(SOCK_LB_REV, socket_storage.as_path())
            .override_global(CLOCK_HZ_GLOBAL, &tick_hz, true);
        for (name, size, _) in capacities.map_sizes() {
            loader.map_max_entries(name, size);
        }
        let created_unread = EMPTY_WHEN_CREATED
            .iter()
            .copied()
            .filter(|name| !pins.map(name).exists())
            .collect();
        let ebpf = loader.load(ebpf::object()).map_err(AgentError::Load)?;
        let found = found_capacities(&ebpf, capacities)?;
        let mut dataplane = Self {
            ebpf,
            pins: pins.clone(),
            capacities: found,
            created_unread,
        };
        dataplane.write_layout_version()?;
        dataplane.load_programs()?;
        Ok(dataplane)
    }

    pub fn pins(&self) -> &Pins {
        &self.pins
    }

    /// Whether map `name` was created empty by this load and this is the first time it is
    /// asked (the caller reads it otherwise): only the first read of a map can be spared, as
    /// whatever follows it may write.
    pub fn first_read_of_created(&mut self, name: &'static str) -> bool {
        self.created_unread.remove(name)
    }

    /// What the sized maps hold.
    pub fn capacities(&self) -> &Capacities {
        &self.capacities
    }

    /// The underlying object, for attaching and for BPF_PROG_TEST_RUN in tests and benchmarks.
    pub fn ebpf(&self) -> &Ebpf {
        &self.ebpf
    }

    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    /// Map `name` of the loaded object, untyped (for the batch calls of [`crate::kernel::batch`]).
    pub fn map(&self, name: &'static str) -> Result<&aya::maps::Map, AgentError> {
        self.ebpf.map(name).ok_or(AgentError::MissingMap { name })
    }

    /// Map `name` of the loaded object as the typed map `T` (aya's HashMap, LpmTrie, ...).
    pub fn typed_map<'a, T>(&'a mut self, name: &'static str) -> Result<T, AgentError>
    where
        T: TryFrom<&'a mut aya::maps::Map, Error = aya::maps::MapError>,
    {
        let map = self
            .ebpf
            .map_mut(name)
            .ok_or(AgentError::MissingMap { name })?;
        T::try_from(map).map_err(map_err(name, "open"))
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

    /// Loads every program of `ALL_PROGRAMS` (the list `status` names programs by), each as
    /// the type the object gives it.
    fn load_programs(&mut self) -> Result<(), AgentError> {
        for &name in ALL_PROGRAMS {
            self.load_program(name)?;
        }
        for name in [PROG_UNDERLAY, PROG_FROM_POD, PROG_TO_POD, PROG_UNDERLAY_TC] {
            self.pin_program(name)?;
        }
        self.fill_tails()
    }

    /// Loads one program, again when the verifier was interrupted: it gives up with EAGAIN when
    /// a signal is pending for the loading thread, which says nothing about the program
    /// (libbpf retries such loads too).
    fn load_program(&mut self, name: &'static str) -> Result<(), AgentError> {
        let mut attempt = 1;
        loop {
            let loaded = match self.ebpf.program_mut(name) {
                Some(Program::Xdp(program)) => program.load(),
                Some(Program::SchedClassifier(program)) => program.load(),
                Some(Program::CgroupSockAddr(program)) => program.load(),
                _ => return Err(AgentError::MissingProgram { name }),
            };
            match loaded {
                Err(ProgramError::LoadError { io_error, .. })
                    if io_error.raw_os_error() == Some(libc::EAGAIN) && attempt < LOAD_ATTEMPTS =>
                {
                    tracing::debug!(
                        program = name,
                        attempt,
                        "verifier interrupted, loading again"
                    );
                    // A moment for the signal to be taken: an immediate retry met it again
                    // five times in a row once in CI (a test process spawning commands).
                    std::thread::sleep(std::time::Duration::from_millis(20 * u64::from(attempt)));
                    attempt += 1;
                }
                other => {
                    return other.map_err(|source| AgentError::Program {
                        name,
                        action: "load (verifier)",
                        source,
                    });
                }
            }
        }
    }

    /// Puts the programs reached by tail call into their slots.
    fn fill_tails(&mut self) -> Result<(), AgentError> {
        for &TailStage {
            slot,
            program: name,
            ..
        } in TAIL_STAGES
        {
            let fd = self
                .classifier(name)?
                .fd()
                .map_err(|source| AgentError::Program {
                    name,
                    action: "get its descriptor",
                    source,
                })?
                .try_clone()
                .map_err(|source| AgentError::Program {
                    name,
                    action: "duplicate its descriptor",
                    source: source.into(),
                })?;
            let mut tails: ProgramArray<&mut MapData> = self.typed_map(TAILS)?;
            tails.set(slot, &fd, 0).map_err(map_err(TAILS, "fill"))?;
        }
        // The kernel empties a program array when its last user reference (descriptor or pin)
        // goes, even while attached programs still jump through it. Pinned under this agent's
        // own name, the array stays filled while no agent runs and until a successor has
        // swapped its programs (and its own array) into every link.
        let path = self.own_tails_pin();
        remove_if_present(&path, "replacing pinned program array")?;
        let map = self
            .ebpf
            .map(TAILS)
            .ok_or(AgentError::MissingMap { name: TAILS })?;
        map.pin(&path)
            .map_err(|source| AgentError::Pin { path, source })
    }

    fn own_tails_pin(&self) -> std::path::PathBuf {
        self.pins
            .program(&format!("{TAILS}@{}", std::process::id()))
    }

    /// Unpins the program arrays of previous agents. Call once every link has been taken over:
    /// a program still attached through an old link would find its tail calls gone.
    pub fn release_previous_tails(&self) {
        let own = self.own_tails_pin();
        let Ok(entries) = fs::read_dir(self.pins.progs_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let previous = path != own && name.to_string_lossy().starts_with(&format!("{TAILS}@"));
            if previous && let Err(error) = fs::remove_file(&path) {
                tracing::warn!(path = %path.display(), %error, "unpinning an old program array");
            }
        }
    }

    /// Pins a loaded program, replacing the pin a previous agent left.
    fn pin_program(&mut self, name: &'static str) -> Result<(), AgentError> {
        let path = self.pins.program(name);
        remove_if_present(&path, "replacing pinned program")?;
        let program = self
            .ebpf
            .program_mut(name)
            .ok_or(AgentError::MissingProgram { name })?;
        program
            .pin(&path)
            .map_err(|source| AgentError::Pin { path, source })
    }

    fn write_layout_version(&mut self) -> Result<(), AgentError> {
        let map = self
            .ebpf
            .map_mut(META)
            .ok_or(AgentError::MissingMap { name: META })?;
        let mut meta: Array<_, u32> = Array::try_from(map).map_err(map_err(META, "open"))?;
        meta.set(0, LAYOUT_VERSION, 0)
            .map_err(map_err(META, "write layout version"))
    }
}

fn remove_if_present(path: &std::path::Path, action: &'static str) -> Result<(), AgentError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(AgentError::Io {
            action,
            path: path.to_owned(),
            source,
        }),
    }
}

/// Unpins a `DP_SOCK_LB_REV` that is not socket storage (an LRU map of a development build of
/// the socket-level translation): it held only reverse translations, which the programs
/// loaded now keep with each socket instead.
fn drop_unless_socket_storage(path: &std::path::Path) -> Result<(), AgentError> {
    if !path.exists() {
        return Ok(());
    }
    let kind = aya::maps::MapInfo::from_pin(path)
        .and_then(|info| info.map_type())
        .map_err(map_err(SOCK_LB_REV, "read type"))?;
    if kind != aya::maps::MapType::SkStorage {
        tracing::info!(
            map = SOCK_LB_REV,
            ?kind,
            "replacing a pinned map of another type"
        );
        remove_if_present(path, "replacing a pinned map of another type")?;
    }
    Ok(())
}

/// Refuses to adopt pins written under another layout version. Pins without a version (0: a
/// previous agent died between creating and stamping them) are adopted and stamped.
fn check_layout_version(pins: &Pins) -> Result<(), AgentError> {
    let path = pins.map(META);
    if !path.exists() {
        return Ok(());
    }
    let found = read_layout_version(&path).map_err(map_err(META, "read layout version"))?;
    if found != 0 && found != LAYOUT_VERSION {
        return Err(AgentError::LayoutMismatch {
            path: pins.root().to_owned(),
            found,
            expected: LAYOUT_VERSION,
        });
    }
    Ok(())
}

fn read_layout_version(path: &std::path::Path) -> Result<u32, aya::maps::MapError> {
    let data = MapData::from_pin(path)?;
    let meta: Array<MapData, u32> = Array::try_from(aya::maps::Map::Array(data))?;
    meta.get(&0, 0)
}
