//! Files from outside, read and written defensively.
//!
//! Every file this workspace reads whole into memory (quant profiles, `tokenizer.json`,
//! `config.json`, `tokenizer_config.json`, the assets' texts, prepared-graph cache entries) is
//! read by [`read_bounded`]: only a regular file, of at most a limit its caller gives with the
//! reason for it. A path such as `/dev/zero` (endless), a FIFO (opening it blocks until a writer
//! comes) or a folder is refused from its metadata, before it is opened; a file over the limit
//! is refused from its size, and one that grows while read is still read no further than the
//! limit. Model weights (GGUF, safetensors) are memory-mapped or read by offset, never whole,
//! and are not concerned.
//!
//! Outputs are written by [`write_atomic`], which replaces nothing but a regular
//! file; [`check_output_path`] says so (and that the folder exists) before the work whose result
//! is written, so a bad path is reported at once rather than after minutes of prefill.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// One mebibyte, for limits.
pub const MIB: u64 = 1 << 20;

/// The bytes of the regular file at `path` (a symbolic link to one is followed), refused when it
/// is anything else or holds more than `limit` bytes. `what` names the file in the errors (e.g.
/// "quant profile"); every error is [`Error::Io`] naming `path`, and a missing file keeps the
/// operating system's error (kind `NotFound`).
pub fn read_bounded(path: &Path, limit: u64, what: &str) -> Result<Vec<u8>> {
    let refuse = |why: String| Error::io(path, std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{what}: {why}")));
    let over = |size: String| refuse(format!("{size} bytes, over the limit of {limit} bytes ({})", human(limit)));
    let (file, opened) = open_regular(path, what)?;
    if opened.len() > limit {
        return Err(over(opened.len().to_string()));
    }
    let mut bytes = Vec::with_capacity(opened.len().min(limit) as usize);
    // One byte more than the limit: a file that grew while read is seen to be over it.
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes).map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > limit {
        return Err(refuse(format!("grew while read beyond the limit of {limit} bytes ({})", human(limit))));
    }
    Ok(bytes)
}

/// The regular file at `path` (a symbolic link to one is followed), opened for reading, and its
/// metadata; anything else (a folder, a FIFO, a device, a socket) is refused from its metadata
/// before it is opened, since opening a FIFO blocks until a writer comes and a device may never
/// end. Errors are [`Error::Io`] naming `path` and `what`. The model readers (GGUF, safetensors)
/// open through this too; [`read_bounded`] adds a size limit.
pub fn open_regular(path: &Path, what: &str) -> Result<(std::fs::File, std::fs::Metadata)> {
    let refuse = |t: &std::fs::FileType| {
        let why = format!("{what}: is {}, not a regular file", kind(t));
        Error::io(path, std::io::Error::new(std::io::ErrorKind::InvalidInput, why))
    };
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(refuse(&meta.file_type()));
    }
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // The file opened may not be the one looked at (the path was replaced in between).
    let opened = file.metadata().map_err(|e| Error::io(path, e))?;
    if !opened.is_file() {
        return Err(refuse(&opened.file_type()));
    }
    Ok((file, opened))
}

/// Whether something is at `path` (a symbolic link is followed): `Ok(false)` only when nothing
/// is; a path that cannot be looked at (permission denied, a file where a folder should be) is
/// that error, naming `path`, not "does not exist" as [`Path::exists`] would have it.
pub fn exists(path: &Path) -> Result<bool> {
    match std::fs::metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// JSON from outside (a quant profile, `config.json`, `tokenizer_config.json`) as a value, with
/// a key that appears twice in one object refused: `serde_json` keeps the last silently, so an
/// edited file could say two things and mean the one a reader does not see first. The error
/// says which key and where.
pub fn parse_json(bytes: &[u8]) -> std::result::Result<serde_json::Value, serde_json::Error> {
    use serde::de::{Deserialize, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
    struct Strict(serde_json::Value);
    struct Any;
    impl<'de> Visitor<'de> for Any {
        type Value = Strict;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_bool<E>(self, v: bool) -> std::result::Result<Strict, E> {
            Ok(Strict(v.into()))
        }
        fn visit_i64<E>(self, v: i64) -> std::result::Result<Strict, E> {
            Ok(Strict(v.into()))
        }
        fn visit_u64<E>(self, v: u64) -> std::result::Result<Strict, E> {
            Ok(Strict(v.into()))
        }
        fn visit_f64<E>(self, v: f64) -> std::result::Result<Strict, E> {
            Ok(Strict(v.into()))
        }
        fn visit_str<E>(self, v: &str) -> std::result::Result<Strict, E> {
            Ok(Strict(v.into()))
        }
        fn visit_unit<E>(self) -> std::result::Result<Strict, E> {
            Ok(Strict(serde_json::Value::Null))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Strict, A::Error> {
            let mut out = Vec::new();
            while let Some(Strict(v)) = seq.next_element()? {
                out.push(v);
            }
            Ok(Strict(out.into()))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Strict, A::Error> {
            let mut out = serde_json::Map::new();
            while let Some(key) = map.next_key::<String>()? {
                if out.contains_key(&key) {
                    return Err(A::Error::custom(format!("the key {key:?} appears twice in one object")));
                }
                let Strict(v) = map.next_value()?;
                out.insert(key, v);
            }
            Ok(Strict(out.into()))
        }
    }
    impl<'de> Deserialize<'de> for Strict {
        fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
            d.deserialize_any(Any)
        }
    }
    serde_json::from_slice::<Strict>(bytes).map(|s| s.0)
}

/// [`read_bounded`], as UTF-8 text (an error naming `path` when it is not).
pub fn read_to_string_bounded(path: &Path, limit: u64, what: &str) -> Result<String> {
    String::from_utf8(read_bounded(path, limit, what)?)
        .map_err(|e| Error::io(path, std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{what}: not UTF-8 text: {e}"))))
}

/// Checks, before any work whose result is written to `path`, that it can go there: nothing is
/// at `path` or a regular file is (which is replaced; not a folder, a symbolic link, a device, a
/// FIFO or a socket, which [`write_atomic`] refuses), and its folder
/// exists and is a folder. Nothing is created. `what` names the output in the error (e.g.
/// `--trace`): [`Error::Input`] with `what`, the path and the cause.
pub fn check_output_path(path: &Path, what: &str) -> Result<()> {
    let bad = |why: String| Error::Input(format!("{what} {}: {why}", path.display()));
    if path.as_os_str().is_empty() {
        return Err(bad("an empty path".into()));
    }
    match not_replaceable(path) {
        Ok(None) => {}
        Ok(Some(why)) => return Err(bad(why)),
        // A parent that is a file: said below.
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {}
        Err(e) => return Err(bad(e.to_string())),
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(m) => Err(bad(format!("{} is {}, not a folder", dir.display(), kind(&m.file_type())))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(bad(format!("folder {} does not exist", dir.display()))),
        Err(e) => Err(bad(format!("folder {}: {e}", dir.display()))),
    }
}

/// An [`Error::Input`] when writing `output` would replace one of the run's `inputs`: the same
/// file however it is named (compared as canonical paths; a path not there yet by its folder's),
/// or an existing file inside an input folder (an HF model's). Checked before anything loads:
/// `--trace` naming the run's own model file once replaced 98 MB of weights with a trace.
pub fn check_not_an_input(output: &Path, what: &str, inputs: &[&Path]) -> Result<()> {
    let out = identity(output);
    for input in inputs {
        let inp = identity(input);
        let inside = input.is_dir() && output.exists() && out.starts_with(&inp);
        if out == inp || inside {
            return Err(Error::Input(format!(
                "{what} {}: is {}, which this run reads: give another path",
                output.display(),
                if inside { format!("a file of the model folder {}", input.display()) } else { format!("the same file as {}", input.display()) }
            )));
        }
    }
    Ok(())
}

/// Whether `a` and `b` name the same file however they are written (a path not there yet is
/// compared by its folder's canonical path and its name).
pub fn same_file(a: &Path, b: &Path) -> bool {
    identity(a) == identity(b)
}

/// `path` as one name per file: canonical where it exists, else its folder's canonical path and
/// its file name (else as given, made absolute).
fn identity(path: &Path) -> PathBuf {
    if let Ok(p) = path.canonicalize() {
        return p;
    }
    let absolute = std::env::current_dir().map(|d| d.join(path)).unwrap_or_else(|_| path.to_path_buf());
    match (absolute.parent().and_then(|d| d.canonicalize().ok()), absolute.file_name()) {
        (Some(dir), Some(name)) => dir.join(name),
        _ => absolute,
    }
}

/// What makes `path` one an output must not replace (`None`: nothing is there, or a regular
/// file): e.g. "is a symbolic link (to /etc/passwd), not a regular file". Symbolic links are not
/// followed: renaming over one replaces the link, not its target. Errors are the operating
/// system's, other than `NotFound`.
pub(crate) fn not_replaceable(path: &Path) -> std::io::Result<Option<String>> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let t = meta.file_type();
    Ok(if t.is_file() {
        None
    } else if t.is_dir() {
        Some("is a folder, not a file".into())
    } else if t.is_symlink() {
        let to = std::fs::read_link(path).map(|t| format!(" (to {})", t.display())).unwrap_or_default();
        Some(format!("is a symbolic link{to}, not a regular file"))
    } else {
        Some(format!("is {}, not a regular file", kind(&t)))
    })
}

/// "a folder", "a character device", ... for messages.
pub(crate) fn kind(t: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_char_device() {
            return "a character device";
        } else if t.is_block_device() {
            return "a block device";
        } else if t.is_fifo() {
            return "a FIFO (named pipe)";
        } else if t.is_socket() {
            return "a socket";
        }
    }
    if t.is_dir() {
        "a folder"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_file() {
        "a regular file"
    } else {
        "a special file"
    }
}

/// `n` bytes in the largest unit it reaches, for limits: "256 MiB", "4 GiB", "1.5 KiB".
fn human(n: u64) -> String {
    let units = [("GiB", 1u64 << 30), ("MiB", MIB), ("KiB", 1 << 10)];
    let (unit, size) = units.into_iter().find(|&(_, s)| n >= s).unwrap_or(("bytes", 1));
    format!("{:.1} {unit}", n as f64 / size as f64).replace(".0 ", " ")
}

/// Age after which a temporary file of an interrupted write is deleted: an hour. A write is one
/// context binary, at most [`crate::cache::ENTRY_LIMIT`], from memory to a local disk: seconds, a minute on a
/// slow card; its file's modification time moves with every write, so an hour-old one is dead.
pub const STALE_TEMP_AGE: std::time::Duration = std::time::Duration::from_secs(3600);

static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// Deletes the regular files in `dir` whose names `is_temp` takes for [`write_atomic`]'s
/// temporary files and that were last modified more than [`STALE_TEMP_AGE`] ago: a writer
/// killed mid-write (SIGKILL, power loss) left them. `what` names the files in the log. Never
/// fails: a file that cannot be deleted is a warning.
pub(crate) fn remove_stale_temporaries(dir: &Path, is_temp: impl Fn(&str) -> bool, what: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return; // No folder yet, or unreadable: the write or read that follows will say.
    };
    let (mut files, mut bytes) = (0u64, 0u64);
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_str().is_some_and(&is_temp) {
            continue;
        }
        // Not followed: only a regular file of that name is a temporary file of ours.
        let Ok(meta) = entry.metadata() else { continue };
        let stale = meta.modified().ok().and_then(|m| m.elapsed().ok()).is_some_and(|age| age > STALE_TEMP_AGE);
        if !meta.file_type().is_file() || !stale {
            continue;
        }
        match std::fs::remove_file(entry.path()) {
            Ok(()) => {
                files += 1;
                bytes += meta.len();
            }
            // Another process may have just removed it too.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(path = %entry.path().display(), "{what}: cannot delete a stale temporary file: {e}"),
        }
    }
    if files > 0 {
        tracing::info!(dir = %dir.display(), files, bytes, "{what}: deleted the temporary files of interrupted writes");
    }
}

/// Write `path` atomically: `write` fills a temporary file in the same folder, which is synced
/// and renamed into place, so a reader never sees half a file. The temporary name is unique per
/// process, writer and moment (two containers sharing the folder can have the same pid), and
/// `create_new` refuses to reuse a name rather than truncate another writer's. Temporary files
/// of `path` that killed writers left (over [`STALE_TEMP_AGE`] old) are deleted first, as the
/// graph cache deletes its own.
///
/// A file-size limit (`ulimit -f`) is a write error naming `path`, not a SIGXFSZ that ends the
/// process: the signal is set to be ignored (once, for the process) before the first write.
///
/// Only a regular file at `path` is replaced: a folder, a symbolic link (the rename would
/// replace the link itself), a device (as root, `/dev/null` would become a file), a FIFO or a
/// socket there is an error naming the path and what is there, checked before writing and again
/// before the rename. [`crate::fs::check_output_path`] checks the same before long work.
pub fn write_atomic(path: &Path, write: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> std::io::Result<()>) -> Result<()> {
    let replaceable = || match crate::fs::not_replaceable(path) {
        Ok(None) => Ok(()),
        Ok(Some(what)) => Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{what}: not replaced"))),
        Err(e) => Err(e),
    };
    replaceable().map_err(|e| Error::io(path, e))?;
    ignore_sigxfsz();
    if let Some(target) = path.file_name().and_then(|n| n.to_str()) {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        remove_stale_temporaries(dir, |name| temp_target(name) == Some(target), "atomic write");
    }
    let tmp = temp_path(path);
    let run = || -> std::io::Result<()> {
        let file = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        let mut f = std::io::BufWriter::new(file);
        write(&mut f)?;
        f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        replaceable()?;
        std::fs::rename(&tmp, path)
    };
    run().map_err(|e| {
        if e.kind() != std::io::ErrorKind::AlreadyExists {
            let _ = std::fs::remove_file(&tmp);
        }
        Error::io(path, e)
    })
}

/// A temporary name next to `path`, unique per process, writer and moment (two containers
/// sharing the folder can have the same pid).
pub(crate) fn temp_path(path: &Path) -> PathBuf {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    dir.join(format!(
        ".{}.tmp.{}.{}.{nanos}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file"),
        std::process::id(),
        TMP_SEQ.fetch_add(1, Ordering::Relaxed)
    ))
}

/// The file a temporary file [`temp_path`] made is for, from its name
/// `.<file>.tmp.<pid>.<seq>.<nanos>` (the three numbers in decimal digits); `None` for any
/// other name.
pub(crate) fn temp_target(name: &str) -> Option<&str> {
    let mut parts = name.rsplitn(4, '.');
    let numbers = [parts.next(), parts.next(), parts.next()];
    let digits = |s: Option<&str>| s.is_some_and(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()));
    if !numbers.into_iter().all(digits) {
        return None;
    }
    parts.next()?.strip_prefix('.')?.strip_suffix(".tmp").filter(|t| !t.is_empty())
}

/// Sets SIGXFSZ to be ignored, once per process: a write past a file-size limit then fails with
/// EFBIG ("File too large"), which [`write_atomic`] reports with the path, instead of ending the
/// process without a word and leaving its temporary file. Only the default disposition is
/// changed (a handler the program installed is never touched); like any ignored signal, it
/// stays ignored in child processes the program starts later.
fn ignore_sigxfsz() {
    #[cfg(unix)]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: sigaction(2) reads the disposition into a zeroed struct of its own type;
            // signal(2) sets SIG_IGN for a valid signal number.
            unsafe {
                let mut now: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(libc::SIGXFSZ, std::ptr::null(), &mut now) == 0 && now.sa_sigaction == libc::SIG_DFL {
                    libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                }
            }
        });
    }
}

/// Checks, before long work whose result goes to `path`, that [`write_atomic`] could write it:
/// `path` is absent or a regular file (not a folder, a symbolic link, a device...), and its
/// folder exists and takes a new file (one is made and removed).
pub fn check_writable(path: &Path) -> Result<()> {
    match crate::fs::not_replaceable(path) {
        Ok(None) => {}
        Ok(Some(what)) => return Err(Error::io(path, std::io::Error::other(what))),
        Err(e) => return Err(Error::io(path, e)),
    }
    let tmp = temp_path(path);
    std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(|e| Error::io(path, e))?;
    std::fs::remove_file(&tmp).map_err(|e| Error::io(&tmp, e))
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::io::Write;
    use std::path::PathBuf;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("candle-npu-fs-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn err_of<T: std::fmt::Debug>(r: Result<T>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn a_regular_file_within_the_limit_is_read() {
        let d = scratch("ok");
        let p = d.join("a.json");
        std::fs::write(&p, b"{\"a\": 1}").unwrap();
        assert_eq!(read_bounded(&p, 8, "test file").unwrap(), b"{\"a\": 1}");
        assert_eq!(read_to_string_bounded(&p, 100, "test file").unwrap(), "{\"a\": 1}");
        // A symbolic link to a regular file is read through.
        let l = d.join("link.json");
        std::os::unix::fs::symlink(&p, &l).unwrap();
        assert_eq!(read_bounded(&l, 8, "test file").unwrap().len(), 8);
        std::fs::write(&p, [0xff, 0xfe]).unwrap();
        assert!(err_of(read_to_string_bounded(&p, 100, "test file")).contains("not UTF-8"));
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn dev_zero_and_folders_are_refused_unread() {
        let e = err_of(read_bounded(Path::new("/dev/zero"), 1 << 20, "quant profile"));
        assert!(e.contains("/dev/zero") && e.contains("quant profile") && e.contains("is a character device, not a regular file"), "{e}");
        let d = scratch("dir");
        let e = err_of(read_bounded(&d, 1 << 20, "tokenizer"));
        assert!(e.contains(&d.display().to_string()) && e.contains("is a folder, not a regular file"), "{e}");
        let missing = d.join("missing.json");
        match read_bounded(&missing, 10, "x") {
            Err(Error::Io { path, source }) => assert!(path == missing && source.kind() == std::io::ErrorKind::NotFound),
            other => panic!("{other:?}"),
        }
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn a_file_over_the_limit_is_refused_with_the_limit_and_its_size() {
        let d = scratch("big");
        let p = d.join("big.json");
        std::fs::write(&p, vec![b' '; 1025]).unwrap();
        let e = err_of(read_bounded(&p, 1024, "quant profile"));
        assert!(e.contains(&p.display().to_string()) && e.contains("1025 bytes, over the limit of 1024 bytes (1 KiB)"), "{e}");
        assert_eq!(human(4 << 30), "4 GiB");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(1000), "1000 bytes");
        // A sparse file of 3 GiB: refused from its size, nothing allocated.
        std::fs::File::create(&p).unwrap().set_len(3 << 30).unwrap();
        let e = err_of(read_bounded(&p, 256 * MIB, "quant profile"));
        assert!(e.contains("3221225472 bytes") && e.contains("limit of 268435456 bytes (256 MiB)"), "{e}");
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn json_with_a_key_twice_is_refused() {
        let v = parse_json(br#"{"a": [1, -2, 3.5, "x", null, true], "b": {"c": {}}}"#).unwrap();
        assert_eq!(v, serde_json::from_str::<serde_json::Value>(r#"{"a": [1, -2, 3.5, "x", null, true], "b": {"c": {}}}"#).unwrap());
        for json in [r#"{"a": 1, "a": 2}"#, r#"{"p": {"points": {"x": 1, "x": 1}}}"#] {
            let e = parse_json(json.as_bytes()).unwrap_err().to_string();
            assert!(e.contains("appears twice") && e.contains("line 1"), "{e}");
        }
        assert!(parse_json(b"{").is_err());
    }

    #[test]
    fn a_path_that_cannot_be_looked_at_is_not_called_absent() {
        let d = scratch("exists");
        let file = d.join("f");
        std::fs::write(&file, b"x").unwrap();
        assert!(exists(&file).unwrap());
        assert!(!exists(&d.join("absent")).unwrap());
        // Under a file (as under a folder this user may not read): the system's error, naming
        // the path, where Path::exists says "false" and callers said "not found".
        let under = file.join("model.gguf");
        assert!(!under.exists());
        let e = err_of(exists(&under));
        assert!(e.contains(&under.display().to_string()) && e.contains("Not a directory"), "{e}");
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let d = scratch("fifo");
        let p = d.join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&p).status().unwrap();
        assert!(made.success());
        // Opening it for reading would block until a writer comes: the test would hang.
        let e = err_of(read_bounded(&p, 1024, "tokenizer"));
        assert!(e.contains(&p.display().to_string()) && e.contains("is a FIFO (named pipe), not a regular file"), "{e}");
        let e = err_of(check_output_path(&p, "--trace"));
        assert!(e.contains("FIFO"), "{e}");
        let e = err_of(write_atomic(&p, |f| f.write_all(b"x")));
        assert!(e.contains("FIFO"), "{e}");
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::symlink_metadata(&p).unwrap().file_type().is_fifo(), "the FIFO is still there");
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn outputs_replace_only_regular_files() {
        let d = scratch("out");
        // Absent, in an existing folder: fine, and nothing is created by the check.
        let absent = d.join("trace.json");
        check_output_path(&absent, "--trace").unwrap();
        assert!(!absent.exists());
        write_atomic(&absent, |f| f.write_all(b"1")).unwrap();
        // A regular file: replaced.
        check_output_path(&absent, "--trace").unwrap();
        write_atomic(&absent, |f| f.write_all(b"2")).unwrap();
        assert_eq!(std::fs::read(&absent).unwrap(), b"2");
        // A symbolic link: neither it nor its target is touched.
        let target = d.join("target");
        std::fs::write(&target, b"keep").unwrap();
        let link = d.join("link.json");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = err_of(check_output_path(&link, "--trace"));
        assert!(e.contains("--trace") && e.contains(&link.display().to_string()) && e.contains("is a symbolic link (to "), "{e}");
        let e = err_of(write_atomic(&link, |f| f.write_all(b"clobbered")));
        assert!(e.contains(&link.display().to_string()) && e.contains("symbolic link"), "{e}");
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        // A folder, a device.
        let e = err_of(check_output_path(&d, "--trace"));
        assert!(e.contains("is a folder, not a file"), "{e}");
        assert!(err_of(write_atomic(&d, |f| f.write_all(b"x"))).contains("is a folder"));
        assert!(err_of(check_output_path(Path::new("/dev/null"), "--trace")).contains("is a character device"));
        // The folder: missing, or a file.
        let e = err_of(check_output_path(&d.join("no/such/t.json"), "--trace"));
        assert!(e.contains(&format!("folder {} does not exist", d.join("no/such").display())), "{e}");
        let e = err_of(check_output_path(&target.join("t.json"), "--png"));
        assert!(e.contains(&format!("{} is a regular file, not a folder", target.display())), "{e}");
        // Only the files written are left: no temporary file of a refused write.
        let mut left: Vec<String> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        left.sort();
        assert_eq!(left, ["link.json", "target", "trace.json"]);
        std::fs::remove_dir_all(d).unwrap();
    }
}
