//! Every bpffs path the agent owns, in one place. Layout under the pin root:
//! `maps/<MAP>` for maps (adopted across restarts), `progs/<program>` for loaded programs,
//! `links/<program>@<ifindex>[@<mode>]` for attachments. Pinned links keep the programs attached
//! while no agent runs, so the data path forwards through an agent restart; a new agent swaps
//! its programs into them atomically. Removing the pins (`dataplane cleanup`) detaches.

use std::{
    ffi::CString,
    fs, io,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
};

use aya::maps::{HashMap, Map, MapData};

use crate::{error::AgentError, kernel::capacity::map_err};

/// Where a node's agent pins everything by default.
pub const DEFAULT_PIN_ROOT: &str = "/sys/fs/bpf/dataplane";
/// Where the bpf filesystem is mounted when nothing is.
const BPFFS_MOUNT: &str = "/sys/fs/bpf";
/// `statfs` magic of the bpf filesystem (include/uapi/linux/magic.h).
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

#[derive(Clone, Debug)]
pub struct Pins {
    root: PathBuf,
}

impl Pins {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn maps_dir(&self) -> PathBuf {
        self.root.join("maps")
    }

    pub fn map(&self, name: &str) -> PathBuf {
        self.maps_dir().join(name)
    }

    /// The map pinned as `name`, opened.
    pub fn open_map(&self, name: &'static str) -> Result<MapData, AgentError> {
        MapData::from_pin(self.map(name)).map_err(map_err(name, "open pin"))
    }

    /// The hash map pinned as `name`, with its key and value types (`lru`: an LRU hash map).
    pub fn open_hash<K: aya::Pod, V: aya::Pod>(
        &self,
        name: &'static str,
        lru: bool,
    ) -> Result<HashMap<MapData, K, V>, AgentError> {
        let data = self.open_map(name)?;
        let map = if lru {
            Map::LruHashMap(data)
        } else {
            Map::HashMap(data)
        };
        HashMap::try_from(map).map_err(map_err(name, "open"))
    }

    pub fn progs_dir(&self) -> PathBuf {
        self.root.join("progs")
    }

    pub fn program(&self, name: &str) -> PathBuf {
        self.progs_dir().join(name)
    }

    pub fn links_dir(&self) -> PathBuf {
        self.root.join("links")
    }

    pub fn link(&self, name: &str) -> PathBuf {
        self.links_dir().join(name)
    }

    /// The pinned links, as file names (`<program>@<ifindex>[@<mode>]`).
    pub fn link_names(&self) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(self.links_dir())
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .filter_map(|entry| entry.file_name().into_string().ok())
            .collect();
        names.sort();
        names
    }

    /// Makes sure the pin root lies on a bpf filesystem (mounting one at /sys/fs/bpf if the
    /// root is below it and nothing is mounted) and creates the directories.
    pub fn prepare(&self) -> Result<(), AgentError> {
        if self.root.starts_with(BPFFS_MOUNT) {
            ensure_bpffs()?;
        }
        for dir in [self.maps_dir(), self.progs_dir(), self.links_dir()] {
            fs::create_dir_all(&dir).map_err(|source| AgentError::Io {
                action: "creating pin directory",
                path: dir.clone(),
                source,
            })?;
        }
        if !is_bpffs(&self.root) {
            return Err(AgentError::Bpffs {
                path: self.root.clone(),
                source: io::Error::other("not a bpf filesystem"),
            });
        }
        Ok(())
    }

    /// Removes every pin (links, maps and programs) and the directories. Unpinning a link no
    /// process holds detaches its program; maps are freed once nothing uses them.
    pub fn remove_all(&self) -> Result<(), AgentError> {
        for dir in [self.links_dir(), self.maps_dir(), self.progs_dir()] {
            remove_dir_contents(&dir)?;
        }
        match fs::remove_dir(&self.root) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(AgentError::Io {
                action: "removing pin root",
                path: self.root.clone(),
                source,
            }),
        }
    }
}

fn remove_dir_contents(dir: &Path) -> Result<(), AgentError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(AgentError::Io {
                action: "listing",
                path: dir.to_owned(),
                source,
            });
        }
    };
    for entry in entries.flatten() {
        let path = entry.path();
        fs::remove_file(&path).map_err(|source| AgentError::Io {
            action: "unpinning",
            path: path.clone(),
            source,
        })?;
    }
    fs::remove_dir(dir).map_err(|source| AgentError::Io {
        action: "removing",
        path: dir.to_owned(),
        source,
    })
}

/// Whether `path` (or its nearest existing ancestor) is on a bpf filesystem.
pub fn is_bpffs(path: &Path) -> bool {
    let mut probe = path;
    while !probe.exists() {
        match probe.parent() {
            Some(parent) => probe = parent,
            None => return false,
        }
    }
    let Ok(c_path) = CString::new(probe.as_os_str().as_bytes()) else {
        return false;
    };
    let mut stat = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: c_path is a valid NUL-terminated string and stat points to writable memory.
    let rc = unsafe { libc::statfs(c_path.as_ptr(), stat.as_mut_ptr()) };
    if rc != 0 {
        return false;
    }
    // SAFETY: statfs returned 0, so it filled the struct.
    let stat = unsafe { stat.assume_init() };
    #[allow(
        clippy::unnecessary_cast,
        reason = "f_type's integer type differs by architecture (an expect would fail on the \
                  architectures where the cast is needed)"
    )]
    let fs_type = stat.f_type as i64;
    fs_type == BPF_FS_MAGIC
}

/// Mounts a bpf filesystem at /sys/fs/bpf unless one is there.
pub fn ensure_bpffs() -> Result<(), AgentError> {
    if is_bpffs(Path::new(BPFFS_MOUNT)) {
        return Ok(());
    }
    mount_bpffs(Path::new(BPFFS_MOUNT))
}

fn mount_bpffs(at: &Path) -> Result<(), AgentError> {
    let err = |source| AgentError::Bpffs {
        path: at.to_owned(),
        source,
    };
    fs::create_dir_all(at).map_err(err)?;
    let target = CString::new(at.as_os_str().as_bytes()).map_err(|e| err(io::Error::other(e)))?;
    // SAFETY: all pointers are valid NUL-terminated strings or null for data.
    let rc = unsafe {
        libc::mount(
            c"bpf".as_ptr(),
            target.as_ptr(),
            c"bpf".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(err(io::Error::last_os_error()));
    }
    tracing::info!(path = %at.display(), "mounted bpffs");
    Ok(())
}
