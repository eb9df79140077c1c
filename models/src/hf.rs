//! HF-layout model folders: `config.json`, `*.safetensors` (memory-mapped through candle-nn's
//! `VarBuilder`), `tokenizer.json`; found directly or by `org/name` in hf-hub's local cache
//! (never over the network: an absent model is an error naming the cache path).

use std::path::{Path, PathBuf};

use candle_npu::{Error, NpuDevice, Result};

use crate::checkpoint::{Checkpoint, Mapped, SafetensorsCheckpoint};
use crate::spec::{Config, FamilySpec};
use crate::transformer::{LoadOptions, Model};

/// `config.json`, with errors that name the file and the field.
pub struct HfConfig {
    path: PathBuf,
    json: serde_json::Value,
}

impl HfConfig {
    /// Reads `dir/config.json`: an error naming the file when it is unreadable or not JSON.
    pub fn open(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        // A few KB in practice; 16 MiB leaves room for any text a config holds.
        const CONFIG_LIMIT: u64 = 16 * candle_npu::fs::MIB;
        let text = candle_npu::fs::read_to_string_bounded(&path, CONFIG_LIMIT, "config.json")?;
        let json = candle_npu::fs::parse_json(text.as_bytes()).map_err(|e| Error::Model { path: path.clone(), reason: format!("not valid JSON: {e}") })?;
        Ok(HfConfig { path, json })
    }

    /// An error about this config.json.
    pub fn bad(&self, reason: String) -> Error {
        Error::Model { path: self.path.clone(), reason }
    }

    fn field(&self, key: &str) -> Option<&serde_json::Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }

    /// Field `key` as a non-negative integer; `None` when absent or null, an error when of
    /// another type.
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        let int = |v: &serde_json::Value| v.as_u64().and_then(|v| usize::try_from(v).ok());
        self.field(key).map(|v| int(v).ok_or_else(|| self.bad(format!("field '{key}' is not a non-negative integer: {v}")))).transpose()
    }
    /// Field `key` as a non-negative integer; absent is an error.
    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.bad(format!("missing field '{key}'")))
    }
    /// Field `key` as a number (integers too); `None` when absent or null.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.field(key).map(|v| v.as_f64().ok_or_else(|| self.bad(format!("field '{key}' is not a number: {v}")))).transpose()
    }
    /// Field `key` as a number; absent is an error.
    pub fn f64(&self, key: &str) -> Result<f64> {
        self.opt_f64(key)?.ok_or_else(|| self.bad(format!("missing field '{key}'")))
    }
    /// Field `key` as a string; `None` when absent or null.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.field(key).map(|v| v.as_str().ok_or_else(|| self.bad(format!("field '{key}' is not a string: {v}")))).transpose()
    }
    /// Field `key` as a boolean; `default` when absent or null.
    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        self.field(key).map_or(Ok(default), |v| v.as_bool().ok_or_else(|| self.bad(format!("field '{key}' is not a boolean: {v}"))))
    }
    /// `eos_token_id`: one id or a list (none when absent).
    pub fn eos_token_ids(&self) -> Result<Vec<u32>> {
        let Some(v) = self.field("eos_token_id") else { return Ok(vec![]) };
        // An id of 2^32 or more is refused, not wrapped to a small one.
        let one = |v: &serde_json::Value| {
            v.as_u64().and_then(|v| u32::try_from(v).ok()).ok_or_else(|| self.bad(format!("eos_token_id is not a token id (0 to 2^32 - 1): {v}")))
        };
        match v.as_array() {
            Some(a) => a.iter().map(one).collect(),
            None => Ok(vec![one(v)?]),
        }
    }

    /// Whether a field is present and not null.
    pub fn has(&self, key: &str) -> bool {
        self.field(key).is_some()
    }

    /// The sizes, from the field names every HF decoder config uses.
    pub fn config(&self) -> Result<Config> {
        let hidden = self.usize("hidden_size")?;
        let n_head = self.usize("num_attention_heads")?;
        if n_head == 0 {
            return Err(self.bad("num_attention_heads is 0".into()));
        }
        let cfg = Config {
            n_layer: self.usize("num_hidden_layers")?,
            hidden,
            n_head,
            n_kv_head: self.opt_usize("num_key_value_heads")?.unwrap_or(n_head),
            head_dim: self.opt_usize("head_dim")?.unwrap_or(hidden / n_head),
            ffn: self.usize("intermediate_size")?,
            vocab: self.usize("vocab_size")?,
            rms_eps: self.f64("rms_norm_eps")?,
            context_len: self.usize("max_position_embeddings")?,
        };
        cfg.validate().map_err(|why| self.bad(why))?;
        Ok(cfg)
    }

    /// The FFN activation: the families here use SiLU; anything else is not what they compute.
    pub fn check_silu(&self) -> Result<()> {
        match self.opt_str("hidden_act")? {
            None | Some("silu") | Some("swish") => Ok(()),
            Some(other) => Err(self.bad(format!("hidden_act '{other}' is not supported for this family (SiLU only)"))),
        }
    }

    /// Biases on the attention or MLP projections (`attention_bias`, `mlp_bias`) are not in the
    /// Llama / Mistral / Phi-3 spec: refused rather than dropped.
    pub fn check_no_biases(&self) -> Result<()> {
        for key in ["attention_bias", "mlp_bias"] {
            if self.field(key).and_then(|v| v.as_bool()) == Some(true) {
                return Err(self.bad(format!("{key} is true: projection biases are not supported for this family")));
            }
        }
        Ok(())
    }

    /// RoPE scaling variants are not implemented: refuse them rather than compute wrong positions.
    pub fn check_no_rope_scaling(&self) -> Result<()> {
        match self.has("rope_scaling") {
            true => Err(self.bad("rope_scaling is not supported (plain RoPE only)".into())),
            false => Ok(()),
        }
    }
}

/// HF model types this crate loads from a folder.
pub const HF_MODEL_TYPES: &[&str] = &["llama", "mistral", "qwen2", "phi3"];

/// The engine's (GGUF) names in the common HF layout (`model.layers.N.self_attn.q_proj`, ...).
pub fn standard_name(canonical: &str) -> Mapped {
    let global = match canonical {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = global {
        return Mapped::whole(n);
    }
    let mut parts = canonical.splitn(4, '.');
    let (Some("blk"), Some(l), Some(t), Some(kind)) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return Mapped::whole(canonical);
    };
    let hf = match t {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        other => other,
    };
    Mapped::whole(format!("model.layers.{l}.{hf}.{kind}"))
}

/// Load an HF folder of a supported family: NPU prefill on `device`, CPU decode.
pub fn load(dir: &Path, device: &NpuDevice, opts: LoadOptions) -> Result<Model> {
    let hf = HfConfig::open(dir)?;
    let model_type = hf.opt_str("model_type")?.ok_or_else(|| hf.bad("missing field 'model_type'".into()))?.to_string();
    let cfg = hf.config()?;
    let (mut spec, names): (FamilySpec, Box<dyn Fn(&str) -> Mapped>) = match model_type.as_str() {
        "llama" => (crate::llama::hf_spec(&hf, &cfg)?, Box::new(standard_name)),
        "mistral" => (crate::mistral::hf_spec(&hf, &cfg)?, Box::new(standard_name)),
        "qwen2" => (crate::qwen2::hf_spec(&hf, &cfg)?, Box::new(standard_name)),
        "phi3" => (crate::phi3::hf_spec(&hf, &cfg)?, Box::new(crate::phi3::names(&cfg))),
        other => return Err(hf.bad(format!("model_type '{other}' is not supported (HF folders: {})", HF_MODEL_TYPES.join(", ")))),
    };
    let ckpt = SafetensorsCheckpoint::open(dir)?;
    // HF's default is tied; a config that says untied needs the output matrix it implies. One
    // that says tied outputs through the embedding, as HF and candle-transformers do, even when
    // the folder also holds an output matrix (which is then not read).
    let output = names("output.weight").name;
    let tied = hf.bool_or("tie_word_embeddings", true)?;
    if !tied && !ckpt.contains(&output) {
        return Err(hf.bad(format!("tie_word_embeddings is false but the folder has no '{output}'")));
    }
    if tied && hf.has("tie_word_embeddings") {
        spec.tied_output = true;
        if ckpt.contains(&output) {
            tracing::warn!(folder = %dir.display(), tensor = %output, "tie_word_embeddings is true: the output is the embedding, and '{output}' is not read");
        }
    }
    let id = folder_id(dir)?;
    Model::load(cfg, spec, &ckpt, &*names, id, device.clone(), opts)
}

/// sha256 over `config.json` and every `*.safetensors` (names and bytes, in name order): the
/// identity quant profiles and graph caches are checked against.
pub fn folder_id(dir: &Path) -> Result<String> {
    use sha2::Digest;
    use std::io::Read;
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::Model { path: dir.to_path_buf(), reason: format!("cannot read the folder: {e}") })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().is_some_and(|n| n == "config.json") || p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for path in files {
        h.update(path.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
        let (mut f, _) = candle_npu::fs::open_regular(&path, "model file")?;
        loop {
            let n = f.read(&mut buf).map_err(|e| Error::Model { path: path.clone(), reason: format!("reading: {e}") })?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The folder of `org/name` in hf-hub's local cache (`cache`, or `$HF_HOME/hub`, or
/// `~/.cache/huggingface/hub`). Never downloads: this machine may have no network, and a model
/// of several GB should not start downloading behind a flag.
pub fn resolve_model_id(model_id: &str, cache: Option<&Path>) -> Result<PathBuf> {
    // hf-hub's own default panics where there is no home folder: the same rule, as an error.
    let cache = match (cache, std::env::var_os("HF_HOME"), std::env::var_os("HOME").filter(|h| !h.is_empty())) {
        (Some(p), _, _) => p.to_path_buf(),
        (None, Some(hf_home), _) => PathBuf::from(hf_home).join("hub"),
        (None, None, Some(home)) => PathBuf::from(home).join(".cache/huggingface/hub"),
        (None, None, None) => return Err(Error::Input(format!("model {model_id}: no hf-hub cache folder to look in: set HF_HOME (or HOME)"))),
    };
    // hf-hub's layout: models--org--name/refs/main holds the commit whose snapshot folder holds
    // the files. Read here rather than by hf-hub, which reads refs/main whole, whatever it is
    // (a FIFO blocks it forever, a link to /dev/zero reads without end).
    let repo = cache.join(format!("models--{}", model_id.replace('/', "--")));
    let refs = repo.join("refs").join("main");
    let missing = || Error::Model {
        path: cache.clone(),
        reason: format!(
            "model '{model_id}' is not in the hf-hub cache (no config.json under models--{}): download it first, e.g. `huggingface-cli download {model_id}`",
            model_id.replace('/', "--")
        ),
    };
    if !refs.exists() {
        return Err(missing());
    }
    // A commit hash is 40 hex digits; a line end may follow.
    let commit = candle_npu::fs::read_to_string_bounded(&refs, 256, "hf-hub ref")?;
    let commit = commit.trim();
    if commit.is_empty() || !commit.chars().all(|c| c.is_ascii_alphanumeric()) {
        return Err(Error::Model { path: refs, reason: format!("not a commit hash: {commit:?}") });
    }
    let snapshot = repo.join("snapshots").join(commit);
    if !snapshot.join("config.json").exists() {
        return Err(missing());
    }
    Ok(snapshot)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> HfConfig {
        HfConfig { path: PathBuf::from("m/config.json"), json: serde_json::from_str(json).unwrap() }
    }

    #[test]
    fn ids_beyond_u32_are_refused_not_wrapped() {
        assert_eq!(config(r#"{"eos_token_id": 2}"#).eos_token_ids().unwrap(), vec![2]);
        assert_eq!(config(r#"{"eos_token_id": [2, 4294967295]}"#).eos_token_ids().unwrap(), vec![2, u32::MAX]);
        for json in [r#"{"eos_token_id": 4294967298}"#, r#"{"eos_token_id": [1, 4294967298]}"#, r#"{"eos_token_id": -1}"#] {
            let err = config(json).eos_token_ids().unwrap_err().to_string();
            assert!(err.contains("m/config.json") && err.contains("eos_token_id is not a token id"), "{json}: {err}");
        }
    }
}
