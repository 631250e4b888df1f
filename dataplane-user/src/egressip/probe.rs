//! The egress IP lease's probe on the wire, and what makes it trustworthy.
//!
//! A probe grants a node addresses; a node holds an address only while a fresh probe grants
//! it (see [`super::node`]). Whoever could send probes could make a node hold an address the
//! controller gave to another, or stop every node's leases. So:
//! - every probe and every reply is signed (HMAC-SHA256) with a key the controller and the
//!   agents share (a Kubernetes Secret mounted into both; a file beside the manifests without
//!   an API server), and anything unsigned or signed otherwise is refused;
//! - probes are ordered by the controller's *epoch* (a number that grows at each change of
//!   leader: the leader Lease's resourceVersion when it took it, which the API server only
//!   ever increases; without an API server, a count kept beside the manifests) and a counter
//!   within it. A node takes only a probe later than every probe it took: a probe replayed,
//!   delayed on the way, or sent by a replica that lost the lead is refused. No clock of one
//!   machine is compared with another's.

use std::{
    collections::BTreeSet,
    fmt::Write as _,
    io,
    net::IpAddr,
    path::{Path, PathBuf},
    time::SystemTime,
};

use ring::hmac;
use serde::{Deserialize, Serialize};

/// The path the agent serves probes on.
pub const PROBE_PATH: &str = "/egressip/probe";
/// Where agents listen for probes by default (their node's InternalIP): a port of its own,
/// apart from the metrics one, which pods may reach.
pub const DEFAULT_PROBE_PORT: u16 = 9478;
/// The key file in a Kubernetes deployment: the Secret `dataplane-probe-key` mounted there.
pub const DEFAULT_KEY_FILE: &str = "/etc/dataplane/probe-key/key";
/// The key file without an API server, beside the status file (made by the controller).
pub const MANIFEST_KEY_FILE: &str = "egressip-status/probe.key";
/// The epoch file without an API server: the controller counts its starts there.
pub const MANIFEST_EPOCH_FILE: &str = "egressip-status/epoch";
/// A key shorter than this is refused (it could be guessed).
const KEY_MIN_BYTES: usize = 16;

/// Why a probe or a reply is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProbeError {
    #[error("no probe key: {0}")]
    NoKey(String),
    #[error("{0}: missing or malformed")]
    Field(&'static str),
    #[error("not signed with the cluster's probe key")]
    BadSignature,
    #[error("probe {got:?} is not later than probe {last:?}, already taken")]
    Stale { got: Order, last: Order },
    #[error("this is node {this}, not {asked}")]
    OtherNode { this: String, asked: String },
    #[error("refused: {0}")]
    Refused(String),
}

/// The shared key.
pub struct ProbeKey(hmac::Key);

impl std::fmt::Debug for ProbeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProbeKey(..)")
    }
}

impl ProbeKey {
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ProbeError> {
        let bytes = bytes.trim_ascii();
        if bytes.len() < KEY_MIN_BYTES {
            return Err(ProbeError::NoKey(format!(
                "the key has {} bytes, fewer than {KEY_MIN_BYTES}",
                bytes.len()
            )));
        }
        Ok(ProbeKey(hmac::Key::new(hmac::HMAC_SHA256, bytes)))
    }

    /// The key in `path`.
    pub fn read(path: &Path) -> Result<Self, ProbeError> {
        let bytes = std::fs::read(path)
            .map_err(|e| ProbeError::NoKey(format!("{}: {e}", path.display())))?;
        Self::from_bytes(&bytes)
    }

    /// The key in `path`, made there first (32 random bytes as hex, mode 0600) when there is
    /// none: the controller's way without an API server.
    pub fn read_or_make(path: &Path) -> Result<Self, ProbeError> {
        if !path.exists() {
            let mut random = [0u8; 32];
            ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut random)
                .map_err(|_| ProbeError::NoKey("no randomness for a new key".into()))?;
            let text = hex(&random);
            // Exclusive: a key another process made meanwhile wins, and is read below.
            let made = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode_private()
                .open(path)
                .and_then(|mut file| io::Write::write_all(&mut file, text.as_bytes()));
            if let Err(error) = made
                && error.kind() != io::ErrorKind::AlreadyExists
            {
                return Err(ProbeError::NoKey(format!("{}: {error}", path.display())));
            }
        }
        Self::read(path)
    }

    /// The signature of `text` (hex).
    pub fn sign(&self, text: &str) -> String {
        hex(hmac::sign(&self.0, text.as_bytes()).as_ref())
    }

    /// Whether `mac` is the signature of `text` (in constant time).
    pub fn verify(&self, text: &str, mac: &str) -> Result<(), ProbeError> {
        let mac = unhex(mac).ok_or(ProbeError::BadSignature)?;
        hmac::verify(&self.0, text.as_bytes(), &mac).map_err(|_| ProbeError::BadSignature)
    }
}

trait PrivateMode {
    fn mode_private(&mut self) -> &mut Self;
}

impl PrivateMode for std::fs::OpenOptions {
    fn mode_private(&mut self) -> &mut Self {
        std::os::unix::fs::OpenOptionsExt::mode(self, 0o600)
    }
}

/// A key file, read again when it changes (a Secret's new version reaches a mounted file
/// within a minute or so) or while it is not there yet.
#[derive(Debug)]
pub struct KeyFile {
    path: PathBuf,
    /// The key and the file's modification time it was read at.
    loaded: Option<(ProbeKey, Option<SystemTime>)>,
    last_error: Option<String>,
}

impl KeyFile {
    pub fn new(path: PathBuf) -> Self {
        KeyFile {
            path,
            loaded: None,
            last_error: None,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The key as the file has it now.
    pub fn key(&mut self) -> Result<&ProbeKey, ProbeError> {
        let modified = std::fs::metadata(&self.path)
            .and_then(|m| m.modified())
            .ok();
        let stale = match &self.loaded {
            Some((_, at)) => *at != modified,
            None => true,
        };
        if stale {
            match ProbeKey::read(&self.path) {
                Ok(key) => {
                    if self.last_error.take().is_some() || self.loaded.is_none() {
                        tracing::info!(path = %self.path.display(), "egress IP probe key read");
                    }
                    self.loaded = Some((key, modified));
                }
                Err(error) => {
                    let text = error.to_string();
                    if self.last_error.as_deref() != Some(text.as_str()) {
                        tracing::warn!(
                            error = text,
                            "egress IP probes refused until the key is there"
                        );
                        self.last_error = Some(text);
                    }
                    // A key that went away is not used any longer.
                    self.loaded = None;
                    return Err(error);
                }
            }
        }
        match &self.loaded {
            Some((key, _)) => Ok(key),
            None => Err(ProbeError::NoKey(self.path.display().to_string())),
        }
    }
}

/// Where a probe stands among all probes: the controller's epoch, then its count within it.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Order {
    pub epoch: u64,
    pub counter: u64,
}

/// One probe: the node it is for, its place, the addresses it grants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    pub node: String,
    pub order: Order,
    pub grants: BTreeSet<IpAddr>,
}

impl Probe {
    /// What the signature covers: every field, unambiguously (a node name has no newline).
    fn signed_text(&self) -> String {
        let grants: Vec<String> = self.grants.iter().map(IpAddr::to_string).collect();
        format!(
            "probe\n{}\n{}\n{}\n{}",
            self.node,
            self.order.epoch,
            self.order.counter,
            grants.join(",")
        )
    }

    /// The query string, signed with `key`.
    pub fn to_query(&self, key: &ProbeKey) -> String {
        let grants: Vec<String> = self.grants.iter().map(IpAddr::to_string).collect();
        form_urlencoded::Serializer::new(String::new())
            .append_pair("node", &self.node)
            .append_pair("epoch", &self.order.epoch.to_string())
            .append_pair("counter", &self.order.counter.to_string())
            .append_pair("grant", &grants.join(","))
            .append_pair("mac", &key.sign(&self.signed_text()))
            .finish()
    }

    /// The probe a query says, if `key` signed it.
    pub fn from_query(query: &str, key: &ProbeKey) -> Result<Self, ProbeError> {
        let mut node = None;
        let mut epoch = None;
        let mut counter = None;
        let mut grants = None;
        let mut mac = None;
        for (name, value) in form_urlencoded::parse(query.as_bytes()) {
            match name.as_ref() {
                "node" => node = Some(value.into_owned()),
                "epoch" => epoch = value.parse::<u64>().ok(),
                "counter" => counter = value.parse::<u64>().ok(),
                "grant" => {
                    let parsed: Result<BTreeSet<IpAddr>, _> = value
                        .split(',')
                        .filter(|t| !t.is_empty())
                        .map(str::parse)
                        .collect();
                    grants = Some(parsed.map_err(|_| ProbeError::Field("grant"))?);
                }
                "mac" => mac = Some(value.into_owned()),
                _ => {}
            }
        }
        let probe = Probe {
            node: node.ok_or(ProbeError::Field("node"))?,
            order: Order {
                epoch: epoch.ok_or(ProbeError::Field("epoch"))?,
                counter: counter.ok_or(ProbeError::Field("counter"))?,
            },
            grants: grants.unwrap_or_default(),
        };
        key.verify(&probe.signed_text(), &mac.ok_or(ProbeError::Field("mac"))?)?;
        Ok(probe)
    }
}

/// The probe's answer: which node answered, to which probe, and what it holds now; signed, so
/// that no one but the node can tell the controller it let an address go.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct ProbeReply {
    pub node: String,
    pub order: Order,
    pub held: BTreeSet<IpAddr>,
    #[serde(default)]
    pub mac: String,
}

impl ProbeReply {
    fn signed_text(&self) -> String {
        let held: Vec<String> = self.held.iter().map(IpAddr::to_string).collect();
        format!(
            "reply\n{}\n{}\n{}\n{}",
            self.node,
            self.order.epoch,
            self.order.counter,
            held.join(",")
        )
    }

    pub fn signed(mut self, key: &ProbeKey) -> Self {
        self.mac = key.sign(&self.signed_text());
        self
    }

    /// Whether this is the signed answer of `node` to `probe`.
    pub fn check(&self, key: &ProbeKey, probe: &Probe) -> Result<(), ProbeError> {
        key.verify(&self.signed_text(), &self.mac)?;
        if self.node != probe.node || self.order != probe.order {
            return Err(ProbeError::Refused(format!(
                "the answer is node {}'s to probe {:?}, not {}'s to {:?}",
                self.node, self.order, probe.node, probe.order
            )));
        }
        Ok(())
    }
}

/// The next epoch without an API server: one more than the last start's, kept in `path`.
pub fn next_manifest_epoch(path: &Path) -> io::Result<u64> {
    let last = std::fs::read_to_string(path)
        .ok()
        .and_then(|t| t.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let next = last + 1;
    crate::kernel::state::write_replacing(path, next.to_string().as_bytes(), true, 0o600)?;
    Ok(next)
}

fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        let _ = write!(out, "{byte:02x}");
    }
    out
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(text: &str) -> ProbeKey {
        ProbeKey::from_bytes(text.as_bytes()).unwrap()
    }

    fn probe() -> Probe {
        Probe {
            node: "node-1".into(),
            order: Order {
                epoch: 7,
                counter: 3,
            },
            grants: BTreeSet::from(["10.99.0.50".parse().unwrap()]),
        }
    }

    #[test]
    fn a_signed_probe_reads_back_and_every_change_breaks_its_signature() {
        let k = key("0123456789abcdef0123456789abcdef");
        let query = probe().to_query(&k);
        assert_eq!(Probe::from_query(&query, &k), Ok(probe()));
        // Another key, a forged field, no signature, a signature of another probe.
        assert_eq!(
            Probe::from_query(&query, &key("another key, long enough")),
            Err(ProbeError::BadSignature)
        );
        for (field, forged) in [
            ("counter=3", "counter=4"),
            ("epoch=7", "epoch=8"),
            ("node=node-1", "node=node-2"),
            ("grant=10.99.0.50", "grant=10.99.0.51"),
            ("grant=10.99.0.50", "grant="),
        ] {
            let tampered = query.replace(field, forged);
            assert_eq!(
                Probe::from_query(&tampered, &k),
                Err(ProbeError::BadSignature),
                "{forged}"
            );
        }
        let unsigned: String = query.split("&mac=").next().unwrap().to_owned();
        assert_eq!(
            Probe::from_query(&unsigned, &k),
            Err(ProbeError::Field("mac"))
        );
        assert_eq!(
            Probe::from_query("node=a&epoch=18446744073709551615&counter=1&mac=00", &k),
            Err(ProbeError::BadSignature)
        );
    }

    #[test]
    fn a_reply_is_checked_against_its_probe_and_key() {
        let k = key("0123456789abcdef0123456789abcdef");
        let reply = ProbeReply {
            node: "node-1".into(),
            order: probe().order,
            held: BTreeSet::new(),
            mac: String::new(),
        }
        .signed(&k);
        assert_eq!(reply.check(&k, &probe()), Ok(()));
        let mut lying = reply.clone();
        lying.held.insert("10.99.0.50".parse().unwrap());
        assert_eq!(lying.check(&k, &probe()), Err(ProbeError::BadSignature));
        let mut other = probe();
        other.order.counter = 4;
        assert!(
            reply.check(&k, &other).is_err(),
            "an answer to another probe"
        );
    }

    #[test]
    fn keys_are_made_once_private_and_short_ones_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("probe-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("probe.key");
        let made = ProbeKey::read_or_make(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.len(), 64);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // Made once: read again, the same key signs alike.
        let again = ProbeKey::read_or_make(&path).unwrap();
        assert_eq!(made.sign("x"), again.sign("x"));
        std::fs::write(&path, "short").unwrap();
        assert!(matches!(ProbeKey::read(&path), Err(ProbeError::NoKey(_))));
        // Epochs count up from the file.
        let epoch = dir.join("epoch");
        assert_eq!(next_manifest_epoch(&epoch).unwrap(), 1);
        assert_eq!(next_manifest_epoch(&epoch).unwrap(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
