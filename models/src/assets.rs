//! Where `scripts/setup.sh` puts the fetched models and texts: `$CANDLE_NPU_ASSETS`, or
//! `assets/` in the current folder.

use std::path::{Path, PathBuf};

use candle_npu::{Error, Result};

/// The assets directory: `$CANDLE_NPU_ASSETS` when set and not empty, else `assets` in the
/// current folder (where `scripts/setup.sh` puts them when run from the checkout's root). No path
/// is fixed at build time; the workspace's `.cargo/config.toml` sets the variable to the
/// checkout's `assets/` for every `cargo run` and `cargo test` in it, whatever their folder. An
/// empty value counts as unset, as shells mean `CANDLE_NPU_ASSETS=`, not the current folder.
pub fn dir() -> PathBuf {
    dir_from(std::env::var_os("CANDLE_NPU_ASSETS"))
}

fn dir_from(var: Option<std::ffi::OsString>) -> PathBuf {
    match var.filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from("assets"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_empty_assets_variable_is_unset_not_the_current_folder() {
        let default = super::dir_from(None);
        assert_eq!(default, std::path::PathBuf::from("assets"));
        assert_eq!(super::dir_from(Some("".into())), default);
        assert_eq!(super::dir_from(Some("/x".into())), std::path::PathBuf::from("/x"));
    }
}

/// SmolLM2-135M-Instruct, Q4_1 GGUF (the default model).
pub fn smollm2() -> PathBuf {
    dir().join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Gemma 3 270M base, Q4_K_M GGUF (SentencePiece tokenizer, Gemma turn template).
pub fn gemma3_270m() -> Result<PathBuf> {
    fetched("gemma-3-270m-q4_k_m.gguf")
}

/// Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (Qwen2 byte-level BPE, ChatML template).
pub fn qwen25_coder_05b() -> Result<PathBuf> {
    fetched("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
}

/// The real models by the short names the examples' `--models` take (`smollm2`, `qwen`,
/// `gemma`); `None` for another name.
pub fn real_model(name: &str) -> Option<Result<PathBuf>> {
    match name {
        "smollm2" => Some(Ok(smollm2())),
        "qwen" => Some(qwen25_coder_05b()),
        "gemma" => Some(gemma3_270m()),
        _ => None,
    }
}

/// `name` in the assets directory, or an error that says how to get it: these files are never
/// committed, so a missing one almost always means the set-up script has not been run.
fn fetched(name: &str) -> Result<PathBuf> {
    let path = dir().join(name);
    if candle_npu::fs::exists(&path)? {
        return Ok(path);
    }
    Err(Error::Model {
        path,
        reason: "not found: run scripts/setup.sh (it fetches the models into $CANDLE_NPU_ASSETS, default assets/ in the checkout), and set CANDLE_NPU_ASSETS to that folder when running outside cargo".to_string(),
    })
}

/// English Wikipedia lead sections as `(title, text)`, sorted by title (a fixed order, so that
/// calibration and held-out splits are reproducible).
pub fn wiki_articles() -> Result<Vec<(String, String)>> {
    let path = dir().join("wiki_summaries_en.json");
    let bytes = candle_npu::fs::read_bounded(&path, ASSET_LIMIT, "asset")?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| Error::Input(format!("{}: not JSON: {e}", path.display())))?;
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

/// Held-out evaluation text: the last `n_articles` articles of the sorted list (all of them when
/// there are fewer). Disjoint from [`wiki_calibration`]'s as long as the two counts together stay
/// within the file's articles.
pub fn wiki_heldout(n_articles: usize) -> Result<Vec<String>> {
    let a = wiki_articles()?;
    let start = a.len().saturating_sub(n_articles);
    Ok(a[start..].iter().map(|(_, t)| t.clone()).collect())
}

/// The largest text read whole: mmlu.jsonl, 8 MB (the Wikipedia JSON 6.5 MB); 8x that is ample.
const ASSET_LIMIT: u64 = 64 * candle_npu::fs::MIB;

fn read_text(path: &Path) -> Result<String> {
    candle_npu::fs::read_to_string_bounded(path, ASSET_LIMIT, "asset")
}

/// State of the Union addresses (233, 1790-2021), in file-name order, i.e. by year.
pub fn sotu_speeches() -> Result<Vec<String>> {
    let d = dir().join("sotu");
    let rd = std::fs::read_dir(&d).map_err(|e| Error::Io { path: d.clone(), source: e })?;
    let mut paths: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "txt")).collect();
    paths.sort();
    if paths.is_empty() {
        return Err(Error::Input(format!("{}: no speeches (run scripts/setup.sh)", d.display())));
    }
    paths.iter().map(|p| read_text(p)).collect()
}

/// Moby Dick, from Chapter 1 to the end.
pub fn moby_dick() -> Result<String> {
    read_text(&dir().join("moby_dick.txt"))
}

/// One MMLU test question.
#[derive(Debug, Clone, PartialEq)]
pub struct MmluQuestion {
    /// The subject, one of 57 (the file's `topic`, e.g. "moral scenarios").
    pub subject: String,
    /// The question text.
    pub question: String,
    /// Choices A to D, in order.
    pub choices: [String; 4],
    /// Index of the correct choice (A = 0).
    pub answer: usize,
}

/// The MMLU test set (14,042 questions, 57 subjects), without the file's two stray header rows.
pub fn mmlu() -> Result<Vec<MmluQuestion>> {
    let path = dir().join("mmlu.jsonl");
    let text = read_text(&path)?;
    let bad = |line: usize, what: &str| Error::Input(format!("{}:{line}: {what}", path.display()));
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(i + 1, &format!("not JSON: {e}")))?;
        let field = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string).ok_or_else(|| bad(i + 1, &format!("no string field '{k}'")));
        let answer = field("correct_answer")?;
        if answer == "answer" {
            continue; // a header row that slipped into the data
        }
        let answer = match answer.as_str() {
            "A" => 0,
            "B" => 1,
            "C" => 2,
            "D" => 3,
            other => return Err(bad(i + 1, &format!("correct_answer '{other}' is not A-D"))),
        };
        out.push(MmluQuestion {
            subject: field("topic")?,
            question: field("question")?,
            choices: [field("answer_a")?, field("answer_b")?, field("answer_c")?, field("answer_d")?],
            answer,
        });
    }
    Ok(out)
}
