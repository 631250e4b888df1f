//! The running agent's record of what it attached where, kept in its run directory so
//! `dataplane status` (another process) can report it.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::{error::AgentError, kernel::attach::Attachment};

/// Default run directory of a node's agent.
pub const DEFAULT_RUN_DIR: &str = "/run/dataplane";
const STATE_FILE: &str = "state.json";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AgentState {
    pub pid: u32,
    pub pin_root: PathBuf,
    pub layout_version: u32,
    pub started_unix: u64,
    pub attachments: Vec<Attachment>,
    /// Where the agent serves the CNI plugin and keeps the pods' allocations (with a cluster
    /// state only).
    #[serde(default)]
    pub cni: Option<CniPlaces>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CniPlaces {
    pub socket: PathBuf,
    pub ipam_file: PathBuf,
}

pub fn state_path(run_dir: &Path) -> PathBuf {
    run_dir.join(STATE_FILE)
}

/// Writes the state atomically (write aside, rename), so a reader never sees half a file.
pub fn write(run_dir: &Path, state: &AgentState) -> Result<(), AgentError> {
    let path = state_path(run_dir);
    write_json_atomically(&path, state).map_err(|source| AgentError::Io {
        action: "writing",
        path,
        source,
    })
}

/// Writes `value` as JSON to `path`: its directory made if missing, the text written aside,
/// synced to disk and renamed over the file, so a reader (or a restart after a crash) sees
/// the old content or the new, never half of either.
pub fn write_json_atomically(path: &Path, value: &impl serde::Serialize) -> io::Result<()> {
    write_json_replacing(path, value, true)
}

/// As [`write_json_atomically`]; `durable`: the file is on disk before it replaces the old
/// one (not needed for what is made again from the cluster state at the next start: there a
/// reader only needs to see a whole file, and a sync does not wait for the disk).
pub fn write_json_replacing(
    path: &Path,
    value: &impl serde::Serialize,
    durable: bool,
) -> io::Result<()> {
    let text = serde_json::to_vec_pretty(value).map_err(io::Error::other)?;
    write_replacing(path, &text, durable, PRIVATE)
}

/// Files only the agent (root) reads and writes.
pub const PRIVATE: u32 = 0o600;

/// Writes `bytes` to `path` by a file of its own beside it (a name no other writer uses,
/// created exclusively with `mode`), renamed over `path`. `durable`: the file's data before
/// the rename, and the directory's entry after it, are on disk when this returns.
pub fn write_replacing(path: &Path, bytes: &[u8], durable: bool, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    use std::sync::atomic::{AtomicU64, Ordering};
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    fs::create_dir_all(dir)?;
    let name = path.file_name().ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidInput, "a file path has a file name")
    })?;
    let mut aside_name = std::ffi::OsString::from(".");
    aside_name.push(name);
    aside_name.push(format!(
        ".{}.{}.tmp",
        std::process::id(),
        WRITES.fetch_add(1, Ordering::Relaxed)
    ));
    let aside = dir.join(aside_name);
    let written = (|| {
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&aside)?;
        io::Write::write_all(&mut file, bytes)?;
        if durable {
            file.sync_all()?;
        }
        fs::rename(&aside, path)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&aside);
        return written;
    }
    if durable {
        // The rename itself is on disk only once the directory is.
        fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Reads the state a running (or crashed) agent left, if any.
pub fn read(run_dir: &Path) -> Result<Option<AgentState>, AgentError> {
    let path = state_path(run_dir);
    let text = match fs::read(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(AgentError::Io {
                action: "reading",
                path,
                source,
            });
        }
    };
    serde_json::from_slice(&text)
        .map(Some)
        .map_err(|e| AgentError::Io {
            action: "decoding",
            path,
            source: io::Error::other(e),
        })
}

pub fn remove(run_dir: &Path) {
    let _ = fs::remove_file(state_path(run_dir));
}

/// Whether a process with this pid exists.
pub fn process_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks for existence and permission.
    unsafe { libc::kill(pid, 0) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_round_trips_and_absence_is_none() {
        let dir = std::env::temp_dir().join(format!("dp-state-test-{}", std::process::id()));
        assert!(read(&dir).expect("read absent").is_none());
        let state = AgentState {
            pid: 42,
            pin_root: "/sys/fs/bpf/x".into(),
            layout_version: 1,
            started_unix: 7,
            cni: None,
            attachments: vec![Attachment {
                interface: "eth0".into(),
                ifindex: 2,
                program: "xdp_underlay".into(),
                hook: "underlay".into(),
                mode: "native".into(),
                why: None,
            }],
        };
        write(&dir, &state).expect("write");
        let back = read(&dir).expect("read").expect("present");
        assert_eq!(back.pid, 42);
        assert_eq!(back.attachments, state.attachments);
        remove(&dir);
        assert!(read(&dir).expect("read removed").is_none());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_corrupt_state_file_is_an_error_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("dp-state-bad-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("mkdir");
        fs::write(state_path(&dir), b"{not json").expect("write");
        let error = read(&dir).expect_err("corrupt file");
        assert!(error.to_string().contains("state.json"), "{error}");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_replaced_file_is_private_whole_and_leaves_nothing_aside() {
        let dir = std::env::temp_dir().join(format!("state-write-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let path = dir.join("x.json");
        write_json_atomically(&path, &vec![1, 2, 3]).unwrap();
        write_json_atomically(&path, &vec![4]).unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, PRIVATE);
        let back: Vec<u32> = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(back, vec![4]);
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("x.json")]);
        // A write that cannot be made leaves the old file and no temporary one.
        fs::create_dir(dir.join("taken")).unwrap();
        assert!(write_replacing(&dir.join("taken"), b"x", true, PRIVATE).is_err());
        let count = fs::read_dir(&dir).unwrap().count();
        assert_eq!(count, 2, "x.json and the directory in the way");
        fs::remove_dir_all(&dir).unwrap();
    }
}
