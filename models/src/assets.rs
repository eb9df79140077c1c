//! Where `scripts/setup.sh` puts the fetched models and texts: `$CANDLE_NPU_ASSETS`, or
//! `assets/` at the workspace root.

use std::path::{Path, PathBuf};

use candle_npu::{Error, Result};

pub fn dir() -> PathBuf {
    match std::env::var_os("CANDLE_NPU_ASSETS") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("assets"),
    }
}

/// SmolLM2-135M-Instruct, Q4_1 GGUF (the default model).
pub fn smollm2() -> PathBuf {
    dir().join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// English Wikipedia lead sections as `(title, text)`, sorted by title (a fixed order, so that
/// calibration and held-out splits are reproducible).
pub fn wiki_articles() -> Result<Vec<(String, String)>> {
    let path = dir().join("wiki_summaries_en.json");
    let bytes = std::fs::read(&path).map_err(|e| Error::Io { path: path.clone(), source: e })?;
    let v: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| Error::Input(format!("{}: not JSON: {e}", path.display())))?;
    let obj = v.as_object().ok_or_else(|| Error::Input(format!("{}: expected an object of articles", path.display())))?;
    let mut out: Vec<(String, String)> = obj
        .iter()
        .filter_map(|(k, a)| a.get("extract").and_then(|e| e.as_str()).map(|e| (k.clone(), e.to_string())))
        .filter(|(_, t)| !t.trim().is_empty())
        .collect();
    out.sort();
    Ok(out)
}

/// Calibration text: articles from the front of the sorted list. Held-out evaluation text comes
/// from the back ([`wiki_heldout`]), so the two never overlap.
pub fn wiki_calibration(n_articles: usize) -> Result<Vec<String>> {
    Ok(wiki_articles()?.into_iter().take(n_articles).map(|(_, t)| t).collect())
}

pub fn wiki_heldout(n_articles: usize) -> Result<Vec<String>> {
    let a = wiki_articles()?;
    let start = a.len().saturating_sub(n_articles);
    Ok(a[start..].iter().map(|(_, t)| t.clone()).collect())
}
