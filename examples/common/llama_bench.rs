//! llama.cpp's `llama-bench`, for the benchmarks' llama.cpp rows (never in CI). Build it from the
//! PyPI `llama-cpp-python` sdist's vendored source (cmake, `GGML_NATIVE=ON`), outside the repo.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// The `llama-bench` binary: the one given on the command line, else `$LLAMA_BENCH`.
pub fn binary(arg: Option<&Path>) -> Option<PathBuf> {
    arg.map(Path::to_path_buf).or_else(|| std::env::var_os("LLAMA_BENCH").map(PathBuf::from))
}

/// `llama-bench`'s `avg_ts` (tokens/s) for one repetition of the test that `test` describes
/// (e.g. `-p 256 -n 0`, or `-p 0 -n 64 -d 2048`), on `model` with `threads` threads.
pub fn avg_ts(bin: &Path, model: &Path, test: &[&str], threads: usize) -> Result<f64> {
    let out = Command::new(bin)
        .args(["-m", &model.display().to_string()])
        .args(test)
        .args(["-t", &threads.to_string(), "-r", "1", "-o", "json"])
        .stderr(Stdio::null())
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        bail!("{} failed: {}", bin.display(), String::from_utf8_lossy(&out.stdout));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("llama-bench's JSON")?;
    v.get(0).and_then(|r| r.get("avg_ts")).and_then(|t| t.as_f64()).context("llama-bench's avg_ts")
}
