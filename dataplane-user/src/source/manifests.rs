//! The manifest directory: its YAML files parsed (again only when a file's text changed) into
//! the store, and followed by their inotify events.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fs,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use super::{decode::add_documents, state::ClusterState};

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("reading manifests from {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("following {path} with inotify")]
    Watch {
        path: String,
        #[source]
        source: notify::Error,
    },
}

/// When a source first saw a change that no sync has taken yet: the start of the sync lag
/// (from the change to the maps holding it). Shared between the source's event handlers and
/// the agent.
#[derive(Clone, Debug, Default)]
pub struct FirstChange(Arc<std::sync::Mutex<Option<std::time::Instant>>>);

impl FirstChange {
    /// Notes a change now, unless an earlier one is still pending.
    pub fn note(&self) {
        if let Ok(mut first) = self.0.lock() {
            first.get_or_insert_with(std::time::Instant::now);
        }
    }

    /// The pending change's time, which is then no longer pending.
    pub fn take(&self) -> Option<std::time::Instant> {
        self.0.lock().ok().and_then(|mut first| first.take())
    }
}

/// A manifest directory (and its subdirectories: the other nodes' pod status records)
/// followed by its inotify events: a change wakes the agent at once instead of at its next
/// look. Reads (which the agent's own syncs cause) are not changes; its own writes are, and
/// the caller tells them apart by what the files say.
pub struct ManifestWatch {
    _watcher: notify::RecommendedWatcher,
    events: Arc<AtomicU64>,
    wake: Arc<tokio::sync::Notify>,
    first: FirstChange,
    named: Arc<std::sync::Mutex<Named>>,
}

/// The paths inotify named since they were last taken, or that it may have missed some.
#[derive(Debug, Default)]
struct Named {
    paths: BTreeSet<PathBuf>,
    /// An error or an event without paths (an overflowed queue): the directory must be read
    /// whole.
    unknown: bool,
}

impl ManifestWatch {
    /// Starts following `dir`.
    pub fn start(dir: &Path) -> Result<Self, SourceError> {
        use notify::Watcher as _;
        let events = Arc::new(AtomicU64::new(0));
        let wake = Arc::new(tokio::sync::Notify::new());
        let first = FirstChange::default();
        let named = Arc::new(std::sync::Mutex::new(Named::default()));
        let (counted, woken, noted) = (Arc::clone(&events), Arc::clone(&wake), first.clone());
        let naming = Arc::clone(&named);
        let watch_err = |source| SourceError::Watch {
            path: dir.display().to_string(),
            source,
        };
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                // An error (an overflowed event queue, say) may hide a change: look again.
                if event
                    .as_ref()
                    .is_ok_and(|e| matches!(e.kind, notify::EventKind::Access(_)))
                {
                    return;
                }
                if let Ok(mut named) = naming.lock() {
                    match &event {
                        Ok(event) if !event.paths.is_empty() && !event.need_rescan() => {
                            named.paths.extend(event.paths.iter().cloned());
                        }
                        _ => named.unknown = true,
                    }
                }
                counted.fetch_add(1, Ordering::Relaxed);
                noted.note();
                // A permit is kept when nobody waits, so no change is lost.
                woken.notify_one();
            })
            .map_err(watch_err)?;
        watcher
            .watch(dir, notify::RecursiveMode::Recursive)
            .map_err(watch_err)?;
        Ok(Self {
            _watcher: watcher,
            events,
            wake,
            first,
            named,
        })
    }

    /// The paths changed since the last call (files written, created, removed or renamed),
    /// or `None` when the events may not have named every change: read the directory whole.
    pub fn take_named(&self) -> Option<BTreeSet<PathBuf>> {
        let mut named = self.named.lock().ok()?;
        let Named { paths, unknown } = std::mem::take(&mut *named);
        (!unknown).then_some(paths)
    }

    /// When the first change no sync has taken yet came (taken: the next one starts anew).
    pub fn take_first_change(&self) -> Option<std::time::Instant> {
        self.first.take()
    }

    /// Returns at the next change (or at once if one came since the last wait).
    pub async fn wait_changed(&self) {
        self.wake.notified().await;
    }

    /// Changes seen since the start.
    pub fn events(&self) -> u64 {
        self.events.load(Ordering::Relaxed)
    }
}

/// Reads every `*.yaml` / `*.yml` file of `dir` (sorted by name; multi-document files allowed).
pub fn read_dir(dir: &Path) -> Result<ClusterState, SourceError> {
    ManifestCache::default().read_dir(dir)
}

/// Each manifest file as last parsed, by a hash of its text, so that reading the directory
/// again parses only the files whose text changed (reading and hashing is cheap; parsing
/// is most of a read's cost; a modification time can miss a quick rewrite of the same size),
/// and in a changed file only the documents whose text changed: one EndpointSlice changed in
/// a file of a namespace's 100 Services and their slices parsed 200 documents (5 ms).
#[derive(Debug, Default)]
pub struct ManifestCache {
    files: BTreeMap<PathBuf, ParsedFile>,
    /// The directory was listed once (later reads may take inotify's word for what changed).
    listed: bool,
}

#[derive(Debug)]
pub(super) struct ParsedFile {
    text_hash: u64,
    /// Each document as parsed, in the file's order.
    documents: Vec<ParsedDocument>,
    pub(super) state: ClusterState,
}

#[derive(Debug)]
struct ParsedDocument {
    text_hash: u64,
    /// The document's first line in its file (0-based): a document that did not parse is
    /// named by the line and column of the fault, counted from the file's start.
    first_line: usize,
    state: ClusterState,
}

impl ManifestCache {
    /// Reads `dir` as [`read_dir`] does, parsing again only the files whose text changed
    /// since the last read, and in those only the documents whose text changed.
    pub fn read_dir(&mut self, dir: &Path) -> Result<ClusterState, SourceError> {
        let read_err = |source| SourceError::Read {
            path: dir.display().to_string(),
            source,
        };
        let files: BTreeSet<PathBuf> = fs::read_dir(dir)
            .map_err(read_err)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|path| is_manifest(path))
            .collect();
        self.files.retain(|path, _| files.contains(path));
        for file in files {
            self.refresh(&file)?;
        }
        self.listed = true;
        Ok(self.assemble())
    }

    /// Reads `dir` again where only the files `named` may have changed (inotify named every
    /// change since the last read): a change reads, hashes and parses its own file, not the
    /// directory's hundred. The first read lists the directory.
    pub fn read_named(
        &mut self,
        dir: &Path,
        named: &BTreeSet<PathBuf>,
    ) -> Result<ClusterState, SourceError> {
        if !self.listed {
            return self.read_dir(dir);
        }
        for path in named {
            if path.parent() == Some(dir) && is_manifest(path) {
                self.refresh(path)?;
            }
        }
        Ok(self.assemble())
    }

    /// Reads `file` again, parsing what changed in it (gone: forgotten).
    fn refresh(&mut self, file: &Path) -> Result<(), SourceError> {
        let text = match fs::read_to_string(file) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.files.remove(file);
                return Ok(());
            }
            Err(source) => {
                return Err(SourceError::Read {
                    path: file.display().to_string(),
                    source,
                });
            }
        };
        let text_hash = text_hash(&text);
        let parsed = match self.files.remove(file) {
            Some(old) if old.text_hash == text_hash => old,
            old => parse_file(&file.display().to_string(), &text, text_hash, old),
        };
        self.files.insert(file.to_path_buf(), parsed);
        Ok(())
    }

    /// The objects of every file, in the files' order (by name).
    fn assemble(&self) -> ClusterState {
        let mut state = ClusterState::default();
        for parsed in self.files.values() {
            state.absorb(&parsed.state);
        }
        state.settle_networks();
        state
    }
}

/// A manifest's name: `*.yaml` or `*.yml`.
fn is_manifest(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "yaml" || e == "yml")
}

pub(super) fn text_hash(text: &str) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(text, &mut hasher);
    std::hash::Hasher::finish(&hasher)
}

/// Parses a manifest file's `text` (whose hash is `text_hash`) document by document, taking
/// each document whose text `old`, the file's last parse, had unchanged from it.
pub(super) fn parse_file(
    file: &str,
    text: &str,
    text_hash: u64,
    old: Option<ParsedFile>,
) -> ParsedFile {
    let mut reusable: HashMap<u64, ParsedDocument> = old
        .into_iter()
        .flat_map(|old| old.documents)
        .map(|document| (document.text_hash, document))
        .collect();
    let mut state = ClusterState::default();
    let mut documents = Vec::new();
    for (first_line, document) in split_documents(text) {
        let document_hash = self::text_hash(document);
        let parsed = match reusable.remove(&document_hash) {
            // A fault's line is the file's: a faulty document that moved is parsed again.
            Some(old) if old.state.rejected.is_empty() || old.first_line == first_line => {
                ParsedDocument { first_line, ..old }
            }
            _ => ParsedDocument {
                text_hash: document_hash,
                first_line,
                state: parse_document(file, document, first_line),
            },
        };
        state.absorb(&parsed.state);
        documents.push(parsed);
    }
    ParsedFile {
        text_hash,
        documents,
        state,
    }
}

/// The objects of one document of a file (or of several, where the file could not be split),
/// whose first line is the file's line `first_line`.
fn parse_document(file: &str, document: &str, first_line: usize) -> ClusterState {
    let mut state = ClusterState::default();
    add_documents(&mut state, file, document);
    if !state.rejected.is_empty() && first_line > 0 {
        // Parsed again behind as many empty lines, so that a fault is named by the file's
        // line (rare: only documents with a fault pay for it).
        state = ClusterState::default();
        add_documents(&mut state, file, &("\n".repeat(first_line) + document));
    }
    state
}

/// The documents of a manifest's text, each with its first line (0-based), split before each
/// line that starts a document (`---` alone or followed by a blank): such a line starts one
/// wherever it is, even inside a block scalar, so each part parses as it would in the whole.
/// A text with directives (`%YAML`, whose document follows the next marker) is one part.
pub(super) fn split_documents(text: &str) -> Vec<(usize, &str)> {
    let starts_document = |line: &str| {
        line.strip_prefix("---")
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\r']))
    };
    if text.lines().any(|line| line.starts_with('%')) {
        return vec![(0, text)];
    }
    let mut parts = Vec::new();
    let (mut start, mut start_line, mut offset) = (0, 0, 0);
    for (number, line) in text.split_inclusive('\n').enumerate() {
        if number > 0 && starts_document(line.trim_end_matches('\n')) {
            parts.push((start_line, &text[start..offset]));
            (start, start_line) = (offset, number);
        }
        offset += line.len();
    }
    parts.push((start_line, &text[start..]));
    parts
}
