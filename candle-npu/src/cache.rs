//! The prepared-graph cache: compiled graphs (for QNN, context binaries) saved on disk so that
//! the next run loads them instead of compiling again.
//!
//! Preparing an NPU graph is the costly step the chunk-sharing design exists to do once; the
//! cache makes "once" mean once per machine rather than once per process. This module owns the
//! files only (naming, format, validation, atomic writes); what the payload is, and how it is
//! turned back into a graph, is the executor's business.
//!
//! # Keys
//!
//! A [`CacheKey`] is SHA-256 over the graph's [`fingerprint`](crate::Graph::fingerprint) (which
//! covers the weights, the quant profile's scales and the chunk length; for QNN, whose entry is
//! a context of one graph or more, a hash of their fingerprints in order) and the executor's
//! `salt` (for QNN: the library's build id and API versions, the SoC model, the graph configs,
//! and this crate's version). The file name carries the key, so a changed model, profile, chunk
//! length, SoC or library simply misses.
//!
//! # Size
//!
//! The entries of a folder are kept within a size limit ([`DEFAULT_SIZE_LIMIT`], or
//! [`GraphCache::with_limit`]'s), least recently used first out, as ccache does: opening the
//! cache and every store delete the oldest entries beyond it, and an entry the executor loads
//! is marked used ([`GraphCache::mark_used`], its modification time). A deleted entry is a miss
//! for whoever wants it next (a process that has it open reads on). Only files named as entries
//! are counted or deleted.
//!
//! # File format (little endian)
//!
//! ```text
//! magic "CNPUGRF2" | key [32] | n_meta u32 | meta u32 * n_meta | payload_len u64 | payload
//! | sha256 [32] of everything before it
//! ```
//!
//! `meta` is the executor's small side table (for QNN: the tensor ids of the graph's inputs and
//! outputs, which a context binary does not give back without QNN's System library: the number
//! of graphs in the context, then each graph's ids in order). The
//! checksum covers every byte read back, the side table included: a damaged id would bind a
//! graph's buffers wrongly without any error. A checksum proves a file intact, not right (an
//! edited table can be hashed again), so the QNN executor also checks each id against the tensor
//! of that name in the binary's own metadata, read by `libQnnSystem.so`. ("CNPUGRF1" files hashed the payload alone; they
//! are rebuilt.)
//!
//! # Failure policy
//!
//! A missing file is a miss. A file that is truncated, corrupt (checksum), or holds another
//! key is [`Lookup::Invalid`]: the caller rebuilds the graph, logs a warning and overwrites the
//! file. So is anything at an entry's name that is not a regular file (a folder, a FIFO, a
//! device: refused before it is opened) or is larger than [`ENTRY_LIMIT`] (refused before it is
//! read); a write never replaces what is not a regular file, so such an entry stays a warning.
//! Writes go to a temporary file in the same folder and are renamed into place, so a
//! crash or a concurrent writer never leaves a half-written file under the final name. A failed
//! write is a warning, not an error: the cache only saves time.
//!
//! A writer killed mid-write (SIGKILL, power loss) leaves its temporary file
//! (`.<entry>.bin.tmp.<pid>.<seq>.<nanos>`). Opening the cache ([`GraphCache::new`]) deletes the
//! regular files of that name last modified more than [`STALE_TEMP_AGE`] ago, far longer than
//! any write takes, so never a live writer's (this process's or another's sharing the folder);
//! it logs their count and bytes at info. Nothing else in the folder is touched, and a temporary
//! file that cannot be deleted is a warning, never an error.

use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::fs::{remove_stale_temporaries, temp_target, write_atomic};

const MAGIC: &[u8; 8] = b"CNPUGRF2";
/// Side tables are a handful of tensor ids; anything larger is a corrupt length field.
const MAX_META: u32 = 1 << 16;
/// The largest entry read: 4 GiB. A context binary is loaded whole into the Hexagon NPU's 32-bit
/// address space, so no usable one is larger (SmolLM2's largest graph is 2.6 MB; an FFN layer of
/// a 70B model, 8192 x 28672 x 2 INT8 weights, 470 MB).
pub const ENTRY_LIMIT: u64 = 4 << 30;
pub use crate::fs::STALE_TEMP_AGE;
/// The bytes of entries a cache folder keeps by default: 16 GiB. The default folder is the
/// user's, shared by every model run: this holds the contexts of several (a 3B model's INT8
/// weights at two graph sizes, without the HTP's weight sharing, are about 6 GB) and keeps a
/// disk from filling with the contexts of profiles and builds long replaced.
pub const DEFAULT_SIZE_LIMIT: u64 = 16 << 30;

/// Environment variable naming the prepared-graph cache's folder: see [`default_dir`].
pub const ENV_CACHE_DIR: &str = "CANDLE_NPU_CACHE_DIR";

/// The folder the Hexagon executor caches prepared graphs in unless told otherwise
/// ([`HtpConfig::cache_dir`](crate::HtpConfig::cache_dir)): `$CANDLE_NPU_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/candle-npu/graphs`, else `$HOME/.cache/candle-npu/graphs` (the XDG base
/// directory convention, which hf-hub's `~/.cache/huggingface` follows too). Empty values count
/// as unset. `$CANDLE_NPU_CACHE_DIR` is the user's own word: a relative one is taken from the
/// current folder (and logged so). The others are taken only when absolute (the XDG rule), and
/// one that is not is skipped with a warning. `None` when none is set (an Android app has no
/// `HOME`: it passes its `getCacheDir()`), and then graphs are prepared in every process.
pub fn default_dir() -> Option<PathBuf> {
    let cwd = std::env::current_dir().ok();
    default_dir_from(|name| std::env::var_os(name), cwd.as_deref())
}

fn default_dir_from(var: impl Fn(&str) -> Option<std::ffi::OsString>, cwd: Option<&Path>) -> Option<PathBuf> {
    let set = |name: &str| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = set(ENV_CACHE_DIR) {
        if dir.is_absolute() {
            return Some(dir);
        }
        match cwd {
            Some(cwd) => {
                let dir = cwd.join(dir);
                tracing::info!(dir = %dir.display(), "{ENV_CACHE_DIR} is relative: taken from the current folder");
                return Some(dir);
            }
            None => tracing::warn!(value = %dir.display(), "{ENV_CACHE_DIR} is relative and the current folder is unknown: ignored"),
        }
    }
    let abs = |name: &str| {
        set(name).filter(|p| {
            let ok = p.is_absolute();
            if !ok {
                tracing::warn!(value = %p.display(), "${name} is not an absolute path: ignored for the graph cache (the XDG rule)");
            }
            ok
        })
    };
    let base = abs("XDG_CACHE_HOME").or_else(|| abs("HOME").map(|h| h.join(".cache")))?;
    Some(base.join("candle-npu").join("graphs"))
}

/// Identifies one compiled graph: see the [module documentation](self).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct CacheKey([u8; 32]);

impl CacheKey {
    /// The key of a graph with this [`fingerprint`](crate::Graph::fingerprint) on an executor
    /// described by `salt`.
    pub fn new(fingerprint: &[u8; 32], salt: &str) -> Self {
        let mut h = Sha256::new();
        h.update(fingerprint);
        h.update(salt.as_bytes());
        CacheKey(h.finalize().into())
    }

    fn hex(&self) -> String {
        self.0[..12].iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl std::fmt::Debug for CacheKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CacheKey({}..)", self.hex())
    }
}

/// A cache entry read back from disk.
#[derive(Debug, PartialEq, Eq)]
pub struct CachedGraph {
    /// The executor's side table as stored (for QNN: the tensor ids of the graph's inputs, then of
    /// its outputs).
    pub meta: Vec<u32>,
    /// The compiled graph (for QNN: the context binary).
    pub payload: Vec<u8>,
}

/// The outcome of [`GraphCache::load`].
#[derive(Debug)]
pub enum Lookup {
    /// A file for this key, intact (checksum verified).
    Hit(CachedGraph),
    /// No file for this key.
    Miss,
    /// A file exists but cannot be used; the reason names the path and what is wrong.
    Invalid(String),
}

/// A folder of compiled graphs.
#[derive(Debug, Clone)]
pub struct GraphCache {
    dir: PathBuf,
    /// Bytes of entries kept (see the module's "Size").
    limit: u64,
}

impl GraphCache {
    /// A cache in `dir`; the folder is created by the first [`store`](Self::store). Temporary
    /// files that killed writers left in it are deleted (see the module's failure policy).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self::with_limit(dir, DEFAULT_SIZE_LIMIT)
    }

    /// A cache in `dir` keeping at most `limit` bytes of entries, the least recently used
    /// deleted first (see the module's "Size").
    pub fn with_limit(dir: impl Into<PathBuf>, limit: u64) -> Self {
        let cache = GraphCache { dir: dir.into(), limit };
        cache.remove_stale_temporaries();
        cache.trim();
        cache
    }

    /// Deletes the least recently used entries until those left hold at most the limit. Never
    /// fails: what cannot be listed or deleted is a warning at most.
    fn trim(&self) {
        let Ok(read) = std::fs::read_dir(&self.dir) else { return };
        // Not followed: only regular files named as entries count.
        let mut entries: Vec<(std::time::SystemTime, u64, PathBuf)> = read
            .flatten()
            .filter(|e| e.file_name().to_str().is_some_and(is_entry_name))
            .filter_map(|e| e.metadata().ok().filter(|m| m.is_file()).map(|m| (m.modified().unwrap_or(std::time::UNIX_EPOCH), m.len(), e.path())))
            .collect();
        let mut total: u64 = entries.iter().map(|e| e.1).sum();
        if total <= self.limit {
            return;
        }
        entries.sort();
        let (mut files, mut bytes) = (0u64, 0u64);
        for (_, len, path) in entries {
            if total <= self.limit {
                break;
            }
            match std::fs::remove_file(&path) {
                Ok(()) => (files, bytes) = (files + 1, bytes + len),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %path.display(), "graph cache: cannot delete an entry beyond the size limit: {e}");
                    continue;
                }
            }
            total -= len; // deleted here or by another process
        }
        tracing::info!(dir = %self.dir.display(), files, bytes, limit = self.limit, "graph cache: deleted the least recently used entries beyond the size limit");
    }

    /// Marks the entry of graph `name` under `key` used now (its modification time), so the
    /// size limit deletes it after entries used longer ago. Best effort: a read-only cache is
    /// still a cache.
    pub fn mark_used(&self, name: &str, key: &CacheKey) {
        let path = self.path(name, key);
        if let Err(e) = std::fs::File::options().append(true).open(&path).and_then(|f| f.set_modified(std::time::SystemTime::now())) {
            tracing::debug!(path = %path.display(), "graph cache: entry not marked used: {e}");
        }
    }

    /// Deletes the temporary files of interrupted writes of entries ([`is_entry_temp_name`]).
    fn remove_stale_temporaries(&self) {
        remove_stale_temporaries(&self.dir, is_entry_temp_name, "graph cache");
    }

    /// The folder holding the cache files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of graph `name` under `key`: `<sanitized name>-<key prefix>.bin`.
    pub fn path(&self, name: &str, key: &CacheKey) -> PathBuf {
        let name: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '.' { c } else { '_' }).collect();
        self.dir.join(format!("{name}-{}.bin", key.hex()))
    }

    /// Reads the entry of graph `name` under `key`: [`Lookup::Miss`] without a file,
    /// [`Lookup::Invalid`] for one that is damaged or holds another key (the module's failure
    /// policy says what the caller does then).
    pub fn load(&self, name: &str, key: &CacheKey) -> Lookup {
        let path = self.path(name, key);
        let bytes = match crate::fs::read_bounded(&path, ENTRY_LIMIT, "graph cache entry") {
            Ok(b) => b,
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => return Lookup::Miss,
            Err(e) => return Lookup::Invalid(e.to_string()),
        };
        match parse(&bytes, key) {
            Ok(entry) => Lookup::Hit(entry),
            Err(why) => Lookup::Invalid(format!("{}: {why}", path.display())),
        }
    }

    /// Writes an entry atomically (temporary file + rename) and returns its path. An entry
    /// larger than [`ENTRY_LIMIT`] is refused (it could never be read back) with an error
    /// naming its size.
    pub fn store(&self, name: &str, key: &CacheKey, meta: &[u32], payload: &[u8]) -> Result<PathBuf> {
        let path = self.path(name, key);
        let size = 52 + 4 * meta.len() as u64 + payload.len() as u64 + 32;
        if size > ENTRY_LIMIT || meta.len() > MAX_META as usize {
            let why = format!("{size} bytes and {} side-table entries: over the cache's limits ({ENTRY_LIMIT} bytes, {MAX_META} entries)", meta.len());
            return Err(Error::io(&path, std::io::Error::new(std::io::ErrorKind::FileTooLarge, why)));
        }
        std::fs::create_dir_all(&self.dir).map_err(|e| match std::fs::metadata(&self.dir) {
            // "File exists" would not say which file, or why that is a problem.
            Ok(m) if !m.is_dir() => {
                let why = format!("the graph cache folder is {}, not a folder", crate::fs::kind(&m.file_type()));
                Error::io(&self.dir, std::io::Error::new(std::io::ErrorKind::NotADirectory, why))
            }
            _ => Error::io(&self.dir, e),
        })?;
        let mut header = Vec::with_capacity(52 + 4 * meta.len());
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&key.0);
        header.extend_from_slice(&(meta.len() as u32).to_le_bytes());
        meta.iter().for_each(|m| header.extend_from_slice(&m.to_le_bytes()));
        header.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        let sum = Sha256::new().chain_update(&header).chain_update(payload).finalize();
        write_atomic(&path, |f| {
            f.write_all(&header)?;
            f.write_all(payload)?;
            f.write_all(&sum)
        })?;
        self.trim();
        Ok(path)
    }
}

/// Whether `name` is an entry's file name: `<name>-<24 hex digits>.bin` ([`GraphCache::path`]).
fn is_entry_name(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(".bin") else { return false };
    let Some((graph, key)) = stem.rsplit_once('-') else { return false };
    !graph.is_empty() && !name.starts_with('.') && key.len() == 24 && key.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Whether `name` is that of a temporary file [`temp_path`] makes for a cache entry:
/// `.<name>.bin.tmp.<pid>.<seq>.<nanos>`.
fn is_entry_temp_name(name: &str) -> bool {
    temp_target(name).and_then(|t| t.strip_suffix(".bin")).is_some_and(|entry| !entry.is_empty())
}

/// Reads `n` bytes at `*at`, advancing it.
fn take<'a>(bytes: &'a [u8], at: &mut usize, n: usize, what: &str) -> std::result::Result<&'a [u8], String> {
    let end = at.checked_add(n).filter(|&e| e <= bytes.len());
    let Some(end) = end else {
        return Err(format!("truncated: {} bytes, {what} needs {n} more at offset {at}", bytes.len()));
    };
    let s = &bytes[*at..end];
    *at = end;
    Ok(s)
}

fn parse(bytes: &[u8], key: &CacheKey) -> std::result::Result<CachedGraph, String> {
    let at = &mut 0;
    if take(bytes, at, 8, "magic")? != MAGIC {
        return Err("not a candle-npu graph cache file of this version (bad magic)".into());
    }
    // The checksum first: everything parsed below is covered by it.
    let Some(body) = bytes.len().checked_sub(32).filter(|&n| n >= 8) else {
        return Err(format!("truncated: {} bytes", bytes.len()));
    };
    if Sha256::digest(&bytes[..body]).as_slice() != &bytes[body..] {
        return Err("corrupt: checksum mismatch".into());
    }
    let bytes = &bytes[..body];
    if take(bytes, at, 32, "key")? != key.0 {
        return Err(format!("holds another graph's key (expected {key:?})"));
    }
    let n_meta = u32::from_le_bytes(take(bytes, at, 4, "meta count")?.try_into().expect("4 bytes"));
    if n_meta > MAX_META {
        return Err(format!("corrupt: meta count {n_meta}"));
    }
    let meta = take(bytes, at, 4 * n_meta as usize, "meta")?.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
    let len = u64::from_le_bytes(take(bytes, at, 8, "payload length")?.try_into().expect("8 bytes"));
    let len = usize::try_from(len).map_err(|_| format!("corrupt: payload length {len}"))?;
    let payload = take(bytes, at, len, "payload")?;
    if *at != bytes.len() {
        return Err(format!("corrupt: {} trailing bytes", bytes.len() - *at));
    }
    Ok(CachedGraph { meta, payload: payload.to_vec() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::temp_path;

    fn tmp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("candle-npu-cache-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn round_trip_miss_and_key_separation() {
        let cache = GraphCache::new(tmp_dir("rt"));
        let k1 = CacheKey::new(&[1; 32], "soc 57");
        let k2 = CacheKey::new(&[1; 32], "soc 69");
        assert_ne!(k1, k2, "the salt is part of the key");
        assert!(matches!(cache.load("blk.0.qkv", &k1), Lookup::Miss));
        let payload: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let path = cache.store("blk.0.qkv", &k1, &[3, 1, u32::MAX], &payload).unwrap();
        assert!(path.file_name().unwrap().to_str().unwrap().starts_with("blk.0.qkv-"));
        match cache.load("blk.0.qkv", &k1) {
            Lookup::Hit(e) => assert_eq!(e, CachedGraph { meta: vec![3, 1, u32::MAX], payload }),
            other => panic!("expected a hit, got {other:?}"),
        }
        assert!(matches!(cache.load("blk.0.qkv", &k2), Lookup::Miss));
        // Only the final file is left: the temporary one was renamed.
        assert_eq!(std::fs::read_dir(cache.dir()).unwrap().count(), 1);
        std::fs::remove_dir_all(cache.dir()).unwrap();
    }

    #[test]
    fn truncated_corrupt_and_foreign_files_are_invalid() {
        let cache = GraphCache::new(tmp_dir("bad"));
        let key = CacheKey::new(&[2; 32], "");
        let path = cache.store("g", &key, &[7], &[5u8; 4096]).unwrap();
        let good = std::fs::read(&path).unwrap();
        let invalid = |bytes: &[u8]| {
            std::fs::write(&path, bytes).unwrap();
            match cache.load("g", &key) {
                Lookup::Invalid(why) => why,
                other => panic!("expected invalid, got {other:?}"),
            }
        };
        assert!(invalid(&good[..good.len() - 1]).contains("checksum"));
        assert!(invalid(&good[..20]).contains("truncated"));
        assert!(invalid(&[]).contains("truncated"));
        // Any byte after the magic, the side table's included, is covered by the checksum.
        for at in [8, 40, 44, 48, 56, good.len() / 2, good.len() - 1] {
            let mut flipped = good.clone();
            flipped[at] ^= 1;
            assert!(invalid(&flipped).contains("checksum"), "byte {at}");
        }
        // Well sealed but inconsistent: the fields are still checked.
        let sealed = |mut body: Vec<u8>| {
            let sum = Sha256::digest(&body);
            body.extend_from_slice(&sum);
            body
        };
        let body = good[..good.len() - 32].to_vec();
        let mut extra = body.clone();
        extra.push(0);
        assert!(invalid(&sealed(extra)).contains("trailing"));
        let mut count = body.clone();
        count[40..44].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(invalid(&sealed(count)).contains("meta count"));
        let mut len = body.clone();
        len[48..56].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(invalid(&sealed(len)).contains("payload"));
        let mut magic = good.clone();
        magic[0] = b'X';
        assert!(invalid(&magic).contains("magic"));
        // Another key's file copied under this name.
        let other = CacheKey::new(&[3; 32], "");
        let other_path = cache.store("g", &other, &[7], &[5u8; 4096]).unwrap();
        let why = invalid(&std::fs::read(other_path).unwrap());
        assert!(why.contains("another graph's key") && why.contains(&path.display().to_string()), "{why}");
        std::fs::remove_dir_all(cache.dir()).unwrap();
    }

    #[test]
    fn opening_deletes_only_stale_temporary_files_of_entries() {
        let dir = tmp_dir("stale");
        std::fs::create_dir_all(&dir).unwrap();
        let entry = GraphCache::new(&dir).path("blk.0.qkv", &CacheKey::new(&[4; 32], ""));
        let stale = temp_path(&entry);
        let fresh = temp_path(&entry);
        assert!(is_entry_temp_name(stale.file_name().unwrap().to_str().unwrap()), "{}", stale.display());
        let two_hours_ago = std::time::SystemTime::now() - 2 * STALE_TEMP_AGE;
        let old = |name: &str, bytes: &[u8]| {
            let p = dir.join(name);
            std::fs::write(&p, bytes).unwrap();
            std::fs::File::options().write(true).open(&p).unwrap().set_modified(two_hours_ago).unwrap();
            p
        };
        let stale = old(stale.file_name().unwrap().to_str().unwrap(), &[1; 100]);
        std::fs::write(&fresh, [2; 10]).unwrap();
        // Old, but not a temporary file of an entry: an entry, other files, near misses.
        let kept: Vec<PathBuf> = [
            entry.file_name().unwrap().to_str().unwrap(),
            "notes.txt",
            ".profile.json.tmp.12.0.5",
            ".blk.0.qkv-00.bin.tmp.12.x.5",
            ".blk.0.qkv-00.bin.tmp.12.0",
            "blk.0.qkv-00.bin.tmp.12.0.5",
            ".bin.tmp.1.2.3",
        ]
        .iter()
        .map(|n| old(n, b"keep"))
        .collect();
        // A folder named like a temporary file is not one.
        let folder = dir.join(".g-00.bin.tmp.1.2.3");
        std::fs::create_dir(&folder).unwrap();
        std::fs::File::open(&folder).unwrap().set_modified(two_hours_ago).unwrap();

        let cache = GraphCache::new(&dir);
        assert!(!stale.exists(), "the stale temporary file is deleted");
        assert!(fresh.exists(), "a live writer's temporary file is kept");
        for p in &kept {
            assert_eq!(std::fs::read(p).unwrap(), b"keep", "{}", p.display());
        }
        assert!(folder.is_dir());
        // And the cache works as before.
        assert!(matches!(cache.load("blk.0.qkv", &CacheKey::new(&[4; 32], "")), Lookup::Invalid(_)));
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Beyond the size limit the least recently used entries go, a loaded one counting as used;
    /// other files stay, whatever their size.
    #[test]
    fn entries_beyond_the_size_limit_go_least_recently_used_first() {
        let dir = tmp_dir("lru");
        let cache = GraphCache::new(&dir);
        let key = |i: u8| CacheKey::new(&[i; 32], "salt");
        let at = |name: &str, i: u8, secs: u64| {
            let f = std::fs::File::options().append(true).open(cache.path(name, &key(i))).unwrap();
            f.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs)).unwrap();
        };
        let path_a = cache.store("a", &key(1), &[], &[0; 1000]).unwrap();
        let path_b = cache.store("b", &key(2), &[], &[0; 1000]).unwrap();
        at("a", 1, 1_000);
        at("b", 2, 2_000);
        std::fs::write(dir.join("notes.txt"), vec![b'x'; 5000]).unwrap();
        let size = std::fs::metadata(&path_a).unwrap().len();
        // Room for two entries: a, the older, is marked used, so the third store deletes b.
        let cache = GraphCache::with_limit(&dir, 2 * size);
        cache.mark_used("a", &key(1));
        // A write's time stamp is the kernel's coarse clock, which lags `SystemTime::now()` (what
        // `mark_used` sets) by up to a tick (4 ms at HZ = 250): without a pause, c, stored after a
        // was marked, could look older than a (a CI run failed on it).
        std::thread::sleep(std::time::Duration::from_millis(30));
        let path_c = cache.store("c", &key(3), &[], &[0; 1000]).unwrap();
        assert!(path_a.is_file() && path_c.is_file() && !path_b.exists());
        assert!(dir.join("notes.txt").is_file(), "not an entry: never deleted");
        assert!(matches!(cache.load("b", &key(2)), Lookup::Miss));
        // Opening with a smaller limit trims at once: c is the most recently used.
        let _ = GraphCache::with_limit(&dir, size);
        assert!(!path_a.exists() && path_c.is_file());
        assert!(is_entry_name("layer0.m32_7-0123456789abcdef01234567.bin"));
        for name in ["notes.txt", ".a-0123456789abcdef01234567.bin", "a-0123.bin", "-0123456789abcdef01234567.bin"] {
            assert!(!is_entry_name(name), "{name}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_atomic_write_deletes_the_stale_temporary_files_of_its_file() {
        let dir = tmp_dir("stale-atomic");
        std::fs::create_dir_all(&dir).unwrap();
        let two_hours_ago = std::time::SystemTime::now() - 2 * STALE_TEMP_AGE;
        let file = |name: &str, old: bool| {
            let p = dir.join(name);
            std::fs::write(&p, b"x").unwrap();
            if old {
                std::fs::File::options().write(true).open(&p).unwrap().set_modified(two_hours_ago).unwrap();
            }
            p
        };
        // What a session save and a profile save killed mid-write left, and what is not theirs.
        let stale = [file(".turn.kv.tmp.12.0.5", true), file(".turn.kv.tmp.99.3.1", true)];
        let kept = [file(".turn.kv.tmp.12.0.6", false), file(".other.kv.tmp.12.0.5", true), file(".turn.kv.tmp.12.0", true)];
        write_atomic(&dir.join("turn.kv"), |f| f.write_all(b"state")).unwrap();
        assert!(stale.iter().all(|p| !p.exists()), "stale temporary files of turn.kv deleted");
        assert!(kept.iter().all(|p| p.exists()), "a live writer's, another file's and a near miss kept");
        assert_eq!(std::fs::read(dir.join("turn.kv")).unwrap(), b"state");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_default_folder_follows_the_variables_and_the_xdg_convention() {
        let env = |vars: &'static [(&'static str, &'static str)]| move |name: &str| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.into());
        let cwd = Some(Path::new("/work"));
        assert_eq!(default_dir_from(env(&[("HOME", "/home/u")]), cwd), Some("/home/u/.cache/candle-npu/graphs".into()));
        assert_eq!(default_dir_from(env(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/c")]), cwd), Some("/c/candle-npu/graphs".into()));
        assert_eq!(default_dir_from(env(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/c"), (ENV_CACHE_DIR, "/g")]), cwd), Some("/g".into()));
        // Ours, relative: from the current folder (it was ignored without a word).
        assert_eq!(default_dir_from(env(&[("HOME", "/home/u"), (ENV_CACHE_DIR, "rel")]), cwd), Some("/work/rel".into()));
        // Empty values are unset; a relative XDG one is not a folder to write in.
        let unset = &[("HOME", "/home/u"), ("XDG_CACHE_HOME", "c"), (ENV_CACHE_DIR, "")];
        assert_eq!(default_dir_from(env(unset), cwd), Some("/home/u/.cache/candle-npu/graphs".into()));
        assert_eq!(default_dir_from(env(&[("HOME", "")]), cwd), None);
        assert_eq!(default_dir_from(env(&[(ENV_CACHE_DIR, "rel")]), None), None);
    }

    /// Under a file-size limit (`ulimit -f`), a write is an error naming the file and leaves no
    /// temporary file, where SIGXFSZ once ended the process. Run in a child process (this test
    /// again, with the limit set): the limit would hit every other test's writes.
    #[test]
    fn a_file_size_limit_is_an_error_naming_the_file() {
        const CHILD: &str = "CANDLE_NPU_TEST_FSIZE_CHILD";
        if let Some(dir) = std::env::var_os(CHILD) {
            let path = PathBuf::from(dir).join("big.json");
            let e = write_atomic(&path, |f| f.write_all(&vec![7u8; 1 << 20])).unwrap_err().to_string();
            assert!(e.contains("big.json") && e.contains("File too large"), "{e}");
            assert_eq!(std::fs::read_dir(path.parent().unwrap()).unwrap().count(), 0, "the temporary file is removed");
            println!("limit reported: {e}");
            return;
        }
        let dir = tmp_dir("fsize");
        std::fs::create_dir_all(&dir).unwrap();
        // Under qemu-user (scripts/aarch64.sh sets QEMU_CPU) the child runs through it too: an
        // aarch64 binary cannot be executed directly on the x86_64 host.
        let exe = std::env::current_exe().unwrap();
        let mut child = match std::env::var_os("QEMU_CPU") {
            Some(_) if cfg!(target_arch = "aarch64") => {
                let mut c = std::process::Command::new("qemu-aarch64-static");
                c.arg(&exe);
                c
            }
            _ => std::process::Command::new(&exe),
        };
        child.args(["--exact", "cache::tests::a_file_size_limit_is_an_error_naming_the_file", "--nocapture"]).env(CHILD, &dir);
        // SAFETY: setrlimit is async-signal-safe; the limit is this child's alone.
        unsafe {
            use std::os::unix::process::CommandExt;
            child.pre_exec(|| {
                let limit = libc::rlimit { rlim_cur: 64 << 10, rlim_max: 64 << 10 };
                if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        let out = child.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && stdout.contains("limit reported"), "{:?}\n{stdout}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn an_entry_that_is_not_a_regular_file_is_invalid_and_not_replaced() {
        let cache = GraphCache::new(tmp_dir("special"));
        let key = CacheKey::new(&[5; 32], "");
        std::fs::create_dir_all(cache.path("g", &key)).unwrap();
        match cache.load("g", &key) {
            Lookup::Invalid(why) => assert!(why.contains("is a folder, not a regular file"), "{why}"),
            other => panic!("expected invalid, got {other:?}"),
        }
        let err = cache.store("g", &key, &[], &[1]).unwrap_err().to_string();
        assert!(err.contains("is a folder") && err.contains("not replaced"), "{err}");
        assert!(cache.path("g", &key).is_dir());
        std::fs::remove_dir_all(cache.dir()).unwrap();
    }

    #[test]
    fn an_entry_that_could_not_be_read_back_is_not_written() {
        let cache = GraphCache::new(tmp_dir("limits"));
        let key = CacheKey::new(&[6; 32], "");
        let err = cache.store("g", &key, &vec![0; MAX_META as usize + 1], &[1]).unwrap_err().to_string();
        assert!(err.contains("over the cache's limits") && err.contains(&cache.path("g", &key).display().to_string()), "{err}");
        assert!(!cache.path("g", &key).exists());
        cache.store("g", &key, &vec![0; MAX_META as usize], &[1]).unwrap();
        assert!(matches!(cache.load("g", &key), Lookup::Hit(_)), "the largest side table reads back");
        std::fs::remove_dir_all(cache.dir()).unwrap();
    }

    #[test]
    fn unwritable_folder_is_an_error_naming_the_path() {
        let file = tmp_dir("file");
        std::fs::write(&file, b"not a folder").unwrap();
        let err = GraphCache::new(&file).store("g", &CacheKey::new(&[0; 32], ""), &[], &[1]).unwrap_err();
        assert!(err.to_string().contains(&file.display().to_string()) && err.to_string().contains("a regular file, not a folder"), "{err}");
        std::fs::remove_file(file).unwrap();
    }
}
